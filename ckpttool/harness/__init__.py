"""The harness protocol ``rehearse`` drives (see docs/rehearse.md).

A harness is your training code behind five methods. ``rehearse --harness module:factory`` imports
``module``, calls ``factory()`` in a fresh process per run, and uses the object it returns.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

COMPONENTS = ("model", "optimizer", "scheduler", "rng", "dataloader")
"""The state a resume must restore, in the order blame is tried."""

TRAJECTORY = "ckpttool.trajectory.json"
"""Beside a checkpoint: the saving run's component digests at the save and its next steps"""
TRAJECTORY_STATES = "ckpttool.trajectory.pt"
"""Beside a checkpoint: the saving run's component states at the save (``torch.save``), for blame"""


@runtime_checkable
class Harness(Protocol):
    def restore(self, path: str) -> dict[str, bool]:
        """Load the checkpoint at ``path`` into a fresh model, optimizer, scheduler, RNG streams
        and data loader. Returns, for each of :data:`COMPONENTS`, whether it was restored from the
        checkpoint (False when the checkpoint does not hold it). Raise on a checkpoint that cannot
        be loaded (a missing parameter, say), naming what is missing."""
        ...

    def step(self) -> float:
        """Run one training step; return its loss."""
        ...

    def digests(self) -> dict[str, str]:
        """A digest of each component's current state (at least :data:`COMPONENTS`), e.g. xxh3 of
        the parameter bytes, of the optimizer moments, of the RNG state bytes."""
        ...

    def capture(self, component: str) -> Any:
        """The component's current state, as something ``force`` accepts (used to record the
        uninterrupted run's state beside a checkpoint)."""
        ...

    def force(self, component: str, state: Any) -> None:
        """Set the component to a state captured from the uninterrupted run (used to find which
        component breaks replay)."""
        ...
