"""A writer for reshard's executor whose files take a set time or fail, in this process or in a
spawned worker (tests/test_reshard.py: a worker's failure is raised without waiting for the
others' files)."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class File:
    path: str
    key: tuple[int, ...]
    nbytes: int = 10
    tensors: int = 1
    largest: int = 10


class Adapter:
    def reader(self, manifest: Any) -> Any:
        return contextlib.nullcontext(None)


class Writer:
    """``plan``: (name, seconds, fails in a worker) for each file."""

    def __init__(self, plan: list[tuple[str, float, bool]]) -> None:
        self.plan = plan

    def files(self) -> list[File]:
        return [File(name, (k,)) for k, (name, _, _) in enumerate(self.plan)]

    def write(self, k: int, out: Path, reader: Any, progress: Any) -> tuple[int, bool]:
        _, seconds, fails = self.plan[k]
        in_worker = os.environ.get("FAKE_WRITER_WORKER") == "1"
        end = time.monotonic() + seconds
        while time.monotonic() < end:  # (calling progress as a real writer does, archive by archive)
            time.sleep(min(0.05, max(0.0, end - time.monotonic())))
            if progress is not None:
                progress(0)
        if fails and in_worker:
            raise ValueError(f"file {k} failed in a worker")
        out.write_bytes(b"x" * 10)
        return k, in_worker

    def finish(self, tmp: Path, results: list[Any]) -> None:
        pass


def build(plan: list[tuple[str, float, bool]]) -> Writer:  # (in a worker)
    os.environ["FAKE_WRITER_WORKER"] = "1"
    return Writer(plan)
