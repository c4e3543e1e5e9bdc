"""Which process this is among those ``torchrun`` started: read by the commands that split work
between ranks (reshard, convert) and by the CLI, which leaves the reporting to rank 0. Imports
nothing heavy."""

from __future__ import annotations

import os


def torchrun_world() -> tuple[int, int] | None:
    """(rank, world size) when this process is one of several that ``torchrun`` started (its
    ``RANK`` and ``WORLD_SIZE``); None for a single process."""
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ.get("WORLD_SIZE", "1"))
    except (KeyError, ValueError):
        return None
    return (rank, world) if world > 1 and 0 <= rank < world else None
