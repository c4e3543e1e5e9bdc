"""The adapter protocol every format module follows.

An adapter answers three questions about a path: is it mine (:meth:`Adapter.detect`, with a reason
either way), what does it hold (:meth:`Adapter.describe`, a :class:`~ckpttool.manifest.Manifest`
built from metadata alone), and what are the bytes of one piece (:meth:`Adapter.reader`). Commands
never look past this protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ckpttool.errors import CorruptFileError
from ckpttool.io import FileCache
from ckpttool.manifest import Item, Manifest, Piece


@dataclass(frozen=True, slots=True)
class Detection:
    matches: bool
    reason: str
    """why it matches (what was seen) or why not (what was missing)"""
    weak: bool = False
    """a match by a guess that any other adapter overrides, plugins included (a directory holding
    one ``.pt`` file is torch's, unless a plugin's format claims it)"""


def claim(table: dict[Any, str], key: Any, rel: str, what: str) -> None:
    """Record that file ``rel`` holds ``key`` (a rank); two files holding the same one is an error,
    since either could be the stale copy."""
    if key in table:
        raise CorruptFileError(
            f"{table[key]} and {rel} both claim {what}",
            hint="one is a stray copy (a renamed or re-saved rank file); remove the one that does not belong",
            path=rel,
        )
    table[key] = rel


@dataclass(frozen=True, slots=True)
class PlannedFile:
    """A file a writer will write (``reshard``'s plan): the writer's ``write(*key, out, ...)``
    writes it, holding at most ``largest`` bytes of output tensor at once."""

    path: str
    """relative to the output root"""
    key: tuple[int, ...]
    nbytes: int
    """bytes of tensor values"""
    tensors: int
    largest: int

    @classmethod
    def of(cls, path: str, key: tuple[int, ...], sizes: list[int]) -> PlannedFile:
        """The file at ``path`` holding output tensors of ``sizes`` bytes."""
        return cls(path=path, key=key, nbytes=sum(sizes), tensors=len(sizes), largest=max(sizes, default=0))


class PieceReader:
    """Reads piece values of one manifest; keeps files open until closed."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self.files = FileCache(manifest.root)

    def read(self, piece: Piece, item: Item, out: np.ndarray | None = None) -> np.ndarray:
        """The piece's values as a C-ordered numpy array in the item's carrier dtype, shaped like
        ``piece.box.sizes`` (or 1-d of ``piece.flat[1]`` elements for a flat piece). With ``out``
        (C-contiguous, right size) the values are written there and ``out`` is returned."""
        raise NotImplementedError

    def read_object(self, item: Item) -> Any:
        """The value of a non-tensor item, through the format's restricted unpickler."""
        raise NotImplementedError

    def archive_of(self, piece: Piece) -> Any:
        """The ``torch.save`` zip archive holding the piece (for CRC checks), or None when the format
        stores raw bytes."""
        return None

    def raw_span(self, piece: Piece, item: Item) -> tuple[int, int] | None:
        """``(offset, length)`` of the bytes in ``piece.file`` that hold the piece's values in C
        order, when they are stored so (uncompressed, contiguous); None otherwise."""
        return None

    def values_in_member(self, file: str, member: str) -> list[str]:
        """The dotted paths, in ``file``'s pickle, of the tensors whose storage is zip ``member``:
        to name what a failing CRC-32 damaged where no piece of the manifest lies (a value carried
        beside the items, such as a Megatron per-parameter Adam step). [] where not known."""
        return []

    def close(self) -> None:
        self.files.close()

    def __enter__(self) -> PieceReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@runtime_checkable
class Adapter(Protocol):
    name: str
    """the format name shown in ``inspect --json`` (``dcp``, ``safetensors``, ...)"""

    def detect(self, path: Path) -> Detection: ...

    def describe(self, path: Path) -> Manifest: ...

    def reader(self, manifest: Manifest) -> PieceReader: ...

    # Optional: ``misplaced(manifest, damaged_files) -> (CorruptFileError, files) | None``: which of
    # the files whose bytes did not read hold another file's data (DCP); verify then reports one
    # misplaced-file for them in place of their damage findings.
