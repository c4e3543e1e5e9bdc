"""ckpttool: inspect, verify, diff, compress and reshard distributed training checkpoints."""

from __future__ import annotations

import os as _os
import sys as _sys


def _load_numpy() -> None:
    """Import numpy with its OpenBLAS limited to one thread, where numpy is not loaded yet and the
    user has not chosen a count. OpenBLAS starts a thread per core when it loads, and each spins
    for about 0.1 s before it sleeps: on a 2-core machine that was a tenth of a reshard's CPU time
    (``perf``), on a 128-core node 127 spinning threads. ckpttool does no linear algebra that
    threads would speed up (its parallelism is its own readers and writers), and the variable is
    put back at once, so that processes it starts (a rehearsal's training run) see the user's
    environment."""
    if "numpy" in _sys.modules or "OPENBLAS_NUM_THREADS" in _os.environ:
        return
    _os.environ["OPENBLAS_NUM_THREADS"] = "1"
    try:
        import numpy  # noqa: F401
    finally:
        del _os.environ["OPENBLAS_NUM_THREADS"]


_load_numpy()

from ckpttool.errors import (  # noqa: E402
    CkptError,
    CorruptFileError,
    FormatNotRecognizedError,
    IncompleteCheckpointError,
    NotFoundError,
    PathEscapeError,
    UnsafePickleError,
)
from ckpttool.geometry import Box  # noqa: E402
from ckpttool.manifest import FileRecord, Item, Layout, Manifest, Piece  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "Box",
    "CkptError",
    "CorruptFileError",
    "FileRecord",
    "FormatNotRecognizedError",
    "IncompleteCheckpointError",
    "Item",
    "Layout",
    "Manifest",
    "NotFoundError",
    "PathEscapeError",
    "Piece",
    "UnsafePickleError",
    "__version__",
]
