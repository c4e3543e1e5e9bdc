"""ckpttool: inspect, verify, diff, compress and reshard distributed training checkpoints."""

from __future__ import annotations

from ckpttool.errors import (
    CkptError,
    CorruptFileError,
    FormatNotRecognizedError,
    IncompleteCheckpointError,
    NotFoundError,
    PathEscapeError,
    UnsafePickleError,
)
from ckpttool.geometry import Box
from ckpttool.manifest import FileRecord, Item, Layout, Manifest, Piece

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
