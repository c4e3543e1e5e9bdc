"""ckpttool: inspect, verify, diff, compress and reshard distributed training checkpoints."""

from __future__ import annotations

import os as _os
import signal as _signal
import sys as _sys
from typing import Any as _Any


def _quiet_interrupt(signum: int, frame: _Any) -> None:
    """Ctrl-C while the command line loads its modules (numpy, typer, rich: 0.1-0.3 s), before
    ``cli.main`` takes SIGINT over: said in one word with the contract's status, 130, where the
    interpreter printed a KeyboardInterrupt traceback from inside whichever import it was in. The
    process ends here: nothing has been written yet, and an exception raised from a handler can
    land where Python drops it with a traceback (an import lock's weak-reference callback)."""
    try:
        _sys.stderr.write("interrupted\n")
        _sys.stderr.flush()
    finally:
        _os._exit(130)


def _guard_start() -> None:
    """Take SIGINT while the package loads when this process is the ``ckpttool`` command (its
    console script, or ``python -m ckpttool``, during whose module search ``argv[0]`` is ``-m``).
    A program importing ckpttool as a library keeps its own handling, and so does a module of it
    run as a program (``python -m ckpttool.rehearse worker``, a harness's process)."""
    argv0 = _sys.argv[0] if _sys.argv else ""
    orig = list(getattr(_sys, "orig_argv", []))
    module = (
        argv0 == "-m"
        and any(  # (python -m ckpttool.rehearse worker is not the command)
            a == "-mckpttool" or (a == "-m" and b == "ckpttool") for a, b in zip(orig, [*orig[1:], ""], strict=True)
        )
    )
    if not module and _os.path.basename(argv0) != "ckpttool":
        return
    if _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
        _signal.signal(_signal.SIGINT, _quiet_interrupt)


def _release_start() -> None:
    """Give SIGINT back to Python's default (``interrupt.install`` then takes it for the command)."""
    if _signal.getsignal(_signal.SIGINT) is _quiet_interrupt:
        _signal.signal(_signal.SIGINT, _signal.default_int_handler)


_guard_start()


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
    PartOfCheckpointError,
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
    "PartOfCheckpointError",
    "PathEscapeError",
    "Piece",
    "UnsafePickleError",
    "__version__",
]
