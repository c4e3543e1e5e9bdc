"""Building logical tensors (or any box of one) from their pieces."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ckpttool import device
from ckpttool._torchzip import BROADCAST_HINT, broadcast_problem
from ckpttool.dtypes import carrier
from ckpttool.errors import CorruptFileError
from ckpttool.formats.base import PieceReader
from ckpttool.geometry import Box, Coverage, coverage, flat_range_boxes, intersect
from ckpttool.manifest import Item, Piece


def regions(piece: Piece) -> list[Box]:
    """The boxes of the logical tensor a piece holds, in the order of its values."""
    if piece.flat is None:
        return [piece.box]
    return flat_range_boxes(piece.box, *piece.flat)


def contiguous_part(whole: Box, part: Box) -> int | None:
    """The element offset of ``part`` inside ``whole`` stored in C order, when ``part``'s elements
    lie there contiguously (one wide in every dimension before the last partial one); None
    otherwise."""
    k = next((d for d in reversed(range(whole.ndim)) if part.sizes[d] != whole.sizes[d]), 0)
    if any(part.sizes[d] != 1 for d in range(k)):
        return None
    offset, stride = 0, 1
    for d in reversed(range(whole.ndim)):
        offset += (part.offsets[d] - whole.offsets[d]) * stride
        stride *= whole.sizes[d]
    return offset


def part_offset(reader: PieceReader, piece: Piece, item: Item, part: Box, itemsize: int) -> int | None:
    """Where in ``piece.file`` the values of ``part`` (inside the piece) start, when they can be
    read alone: the piece stored raw and C-ordered, ``part`` contiguous in it. None otherwise."""
    at = contiguous_part(piece.box, part)
    if at is None:
        return None
    span = reader.raw_span(piece, item)
    if span is None or span[1] != piece.box.volume * itemsize:
        return None
    return span[0] + at * itemsize


def _read_part(reader: PieceReader, piece: Piece, item: Item, part: Box, out: np.ndarray) -> bool:
    """Read the values of ``part`` straight into ``out`` (C-contiguous): only those bytes, not the
    whole piece. False when they cannot be read alone (:func:`part_offset`)."""
    offset = part_offset(reader, piece, item, part, out.dtype.itemsize)
    if offset is None:
        return False
    reader.files.get(piece.file).read_into(offset, out.reshape(-1).view(np.uint8).data)
    return True


def item_coverage(item: Item) -> Coverage:
    """How the first copies of tensor ``item``'s pieces cover it (:func:`ckpttool.geometry.coverage`)."""
    assert item.shape is not None
    return coverage(item.shape, [b for p in item.pieces if p.replica == 0 for b in regions(p)])


def check_coverage(item: Item) -> None:
    """Raise unless the first copies of the pieces tile the tensor exactly."""
    cov = item_coverage(item)
    if not cov.exact:
        files = sorted({p.file for p in item.pieces})
        problem = []
        if cov.gaps:
            problem.append(f"{cov.gaps:,} of {cov.total:,} elements are in no piece")
        if cov.overlapping:
            problem.append(f"{cov.overlapping:,} elements are in two pieces")
        raise CorruptFileError(
            f"{item.name}: {' and '.join(problem)} (pieces in {', '.join(files[:4])}{'…' if len(files) > 4 else ''})",
            hint="a rank's data is missing or the metadata is inconsistent; 'ckpttool verify' gives details",
            path=files[0] if files else None,
        )


def refuse_unexpandable(items: Iterable[Item], *, written: bool = False) -> None:
    """Refuse a tensor with a piece no command expands (a strided view of a pickle, ``formats._pt``,
    that broadcasts a few stored elements to terabytes: ``_torchzip.broadcast_problem``), before
    room is made for its values (``assemble``, and every writer, which makes room for the largest
    tensor first: they ran out of memory, reported as a bug). ``written``: said by a command that
    writes an output."""
    for item in items:
        for p in item.pieces:
            loc = p.locator
            if "stride" not in loc or item.dtype is None:
                continue
            if (problem := broadcast_problem(loc["shape"], loc["stride"], item.dtype)) is not None:
                raise CorruptFileError(
                    f"{p.file}: {item.name}: {problem}" + ("; nothing was written" if written else ""),
                    hint=BROADCAST_HINT,
                    path=p.file,
                )


def assemble(reader: PieceReader, item: Item, out: np.ndarray | None = None, box: Box | None = None) -> np.ndarray:
    """The values of ``item`` inside ``box`` (default: the whole tensor) as a C-ordered array of the
    item's carrier dtype. Pieces whose region lies on contiguous memory of ``out`` are read straight
    into it. Of a piece that lies partly in ``box``, only the bytes needed are read when they are
    contiguous in the piece (``contiguous_part``); otherwise the whole piece is read into a
    temporary. Under ``--device cuda`` (:mod:`ckpttool.device`) the GPU does this work."""
    assert item.dtype is not None and item.shape is not None
    target = box or Box.whole(item.shape)
    if out is None:
        refuse_unexpandable((item,))  # (said before room is made for it)
        out = np.empty(target.sizes, dtype=carrier(item.dtype))
    elif out.shape != target.sizes:
        out = out.reshape(target.sizes)
    on = device.active()
    if on is not None and on.assemble(reader, item, out, box):
        return out
    for piece in item.pieces:
        if piece.replica != 0:
            continue
        parts = regions(piece)
        if piece.flat is None:
            common = intersect(piece.box, target)
            if common is None:
                continue
            if common == piece.box:
                view = out[piece.box.slices(relative_to=target)] if target.ndim else out
                if view.flags.c_contiguous:
                    reader.read(piece, item, out=view)
                    continue
            view = out[common.slices(relative_to=target)] if target.ndim else out
            # the part of the piece needed, read alone: straight into out, or through a temporary
            # of its size when its place in out is strided (a column cut)
            if contiguous_part(piece.box, common) is not None:
                part = view if view.flags.c_contiguous else np.empty(common.sizes, dtype=out.dtype)
                if _read_part(reader, piece, item, common, part):
                    if part is not view:
                        view[...] = part
                    continue
            values = reader.read(piece, item)
            view[...] = values[common.slices(relative_to=piece.box)]
            continue
        if not any(intersect(b, target) for b in parts):
            continue
        flat = reader.read(piece, item).reshape(-1)
        pos = 0
        for region in parts:
            chunk = flat[pos : pos + region.volume].reshape(region.sizes)
            pos += region.volume
            common = intersect(region, target)
            if common is not None:
                out[common.slices(relative_to=target)] = chunk[common.slices(relative_to=region)]
    return out
