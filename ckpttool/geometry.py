"""Boxes and flat ranges inside logical tensors: the geometry every command shares.

A *box* is a pair ``(offsets, sizes)`` of equal-length integer tuples: the rectangular region
``[offsets[d], offsets[d] + sizes[d])`` in every dimension ``d`` of a logical tensor. A 0-d tensor
has the empty box ``((), ())`` of volume 1.

A *flat range* ``(start, length)`` selects elements of a box flattened in C order; ZeRO and
Megatron's distributed optimizer store such ranges. :func:`flat_range_boxes` turns one into boxes,
so the rest of ckpttool only reasons about boxes.

Pure functions, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

Shape = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Box:
    offsets: Shape
    sizes: Shape

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.sizes):
            raise ValueError(f"box rank mismatch: offsets {self.offsets} vs sizes {self.sizes}")

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Box:
        return cls((0,) * len(shape), tuple(shape))

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    @property
    def volume(self) -> int:
        return math.prod(self.sizes)

    @property
    def ends(self) -> Shape:
        return tuple(o + s for o, s in zip(self.offsets, self.sizes, strict=True))

    def text(self) -> str:
        """The box as slices, for messages: ``[0:4, 8:16]``."""
        return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.sizes, strict=True)) + "]"

    def within(self, shape: Sequence[int]) -> bool:
        """Whether the box lies inside a tensor of ``shape``."""
        return len(shape) == self.ndim and all(
            o >= 0 and s >= 0 and o + s <= n for o, s, n in zip(self.offsets, self.sizes, shape, strict=True)
        )

    def slices(self, relative_to: Box | None = None) -> tuple[slice, ...]:
        """numpy slices selecting this box, optionally inside the array holding ``relative_to``."""
        base = relative_to.offsets if relative_to is not None else (0,) * self.ndim
        return tuple(slice(o - b, o - b + s) for o, s, b in zip(self.offsets, self.sizes, base, strict=True))


def row_major_strides(shape: Sequence[int]) -> Shape:
    """The element strides of a contiguous (C-order) tensor of ``shape``, as torch gives them: a
    dimension of size 0 counts as 1 (``torch.empty(3, 0).stride()`` is ``(1, 1)``), so that a file
    written with them is byte for byte the one torch writes."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes, or None when they do not meet (or meet in an empty box)."""
    if a.ndim != b.ndim:
        raise ValueError(f"cannot intersect boxes of rank {a.ndim} and {b.ndim}")
    offsets = []
    sizes = []
    for ao, asz, bo, bsz in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True):
        lo = max(ao, bo)
        hi = min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    return Box(tuple(offsets), tuple(sizes))


def flat_range_boxes(box: Box, start: int, length: int) -> list[Box]:
    """Boxes, in C order, that together hold elements ``[start, start + length)`` of ``box``
    flattened in C order.

    At most ``2 * ndim - 1`` boxes: a ragged head, whole blocks, a ragged tail, per dimension.
    """
    if start < 0 or length < 0 or start + length > box.volume:
        raise ValueError(f"flat range [{start}, {start + length}) outside a box of {box.volume} elements")
    if length == 0:
        return []
    if box.ndim == 0:
        return [box]
    return [
        Box(tuple(o + r for o, r in zip(box.offsets, rel.offsets, strict=True)), rel.sizes)
        for rel in _flat_boxes(box.sizes, start, start + length)
    ]


def _flat_boxes(sizes: Shape, lo: int, hi: int) -> list[Box]:
    # Boxes (relative to the origin) holding flat elements [lo, hi) of a C-ordered array.
    if len(sizes) == 1:
        return [Box((lo,), (hi - lo,))]
    inner = math.prod(sizes[1:])
    first, last = lo // inner, (hi - 1) // inner
    if first == last:
        return [
            Box((first, *b.offsets), (1, *b.sizes))
            for b in _flat_boxes(sizes[1:], lo - first * inner, hi - first * inner)
        ]
    out: list[Box] = []
    if lo % inner:
        out += [Box((first, *b.offsets), (1, *b.sizes)) for b in _flat_boxes(sizes[1:], lo % inner, inner)]
        first += 1
    full_end = last if hi % inner else last + 1
    if full_end > first:
        out.append(Box((first,) + (0,) * (len(sizes) - 1), (full_end - first, *sizes[1:])))
    if hi % inner:
        out += [Box((last, *b.offsets), (1, *b.sizes)) for b in _flat_boxes(sizes[1:], 0, hi % inner)]
    return out


@dataclass(frozen=True, slots=True)
class Coverage:
    """How a set of boxes tiles a tensor."""

    total: int
    """elements in the tensor"""
    covered: int
    """elements held by at least one box"""
    overlapping: int
    """elements held by more than one box"""
    first_gap: Box | None = None
    """the first block (in C order of the grid of the boxes' cut points) that no box holds, where
    there is one and the grid was laid out"""

    @property
    def gaps(self) -> int:
        return self.total - self.covered

    @property
    def exact(self) -> bool:
        return self.gaps == 0 and self.overlapping == 0


_MAX_CELLS = 20_000_000


def _grid(shape: tuple[int, ...], boxes: list[Box]) -> tuple[list[list[int]], np.ndarray] | None:
    """The boxes' cut points along each dimension, and how many boxes hold each cell of the grid
    they make (None where it has more than _MAX_CELLS cells)."""
    cuts = [sorted({0, n, *(b.offsets[d] for b in boxes), *(b.ends[d] for b in boxes)}) for d, n in enumerate(shape)]
    if math.prod(len(c) - 1 for c in cuts) > _MAX_CELLS:
        return None
    counts = np.zeros([max(len(c) - 1, 1) for c in cuts], dtype=np.int32)
    index = [{v: i for i, v in enumerate(c)} for c in cuts]
    for b in boxes:
        counts[tuple(slice(index[d][b.offsets[d]], index[d][b.ends[d]]) for d in range(len(shape)))] += 1
    return cuts, counts


def coverage(shape: Sequence[int], boxes: Iterable[Box]) -> Coverage:
    """Count elements of a tensor of ``shape`` that ``boxes`` leave out or hold twice.

    Boxes are placed on the grid of all their cut points, so the work depends on the number of
    distinct cuts, not on the tensor size. Boxes must lie inside the tensor.
    """
    shape = tuple(shape)
    boxes = list(boxes)
    total = math.prod(shape)
    if not shape:
        return Coverage(1, 1 if boxes else 0, 1 if len(boxes) > 1 else 0)
    for b in boxes:
        if not b.within(shape):
            raise ValueError(f"box {b.offsets}+{b.sizes} outside a tensor of shape {shape}")
    if total == 0:
        return Coverage(0, 0, 0)  # a tensor with a zero-length dimension: nothing to hold
    grid = _grid(shape, boxes)
    if grid is None:
        return _coverage_pairwise(shape, boxes)
    cuts, counts = grid
    widths = [np.diff(np.asarray(c, dtype=np.int64)) for c in cuts]
    cell_volume = widths[0]
    for w in widths[1:]:
        cell_volume = np.multiply.outer(cell_volume, w)
    covered = int(cell_volume[counts > 0].sum())
    overlapping = int(cell_volume[counts > 1].sum())
    gap = None
    if covered < total:
        cell = np.argwhere(counts == 0)[0]
        at = [(cuts[d][int(i)], cuts[d][int(i) + 1]) for d, i in enumerate(cell)]
        gap = Box(tuple(lo for lo, _ in at), tuple(hi - lo for lo, hi in at))
    return Coverage(total, covered, overlapping, gap)


def _coverage_pairwise(shape: Shape, boxes: list[Box]) -> Coverage:
    # Fallback for pathological cut grids: sum of volumes and pairwise overlaps (exact when no
    # element lies in three boxes, which holds for any real sharding).
    total = math.prod(shape)
    volume = sum(b.volume for b in boxes)
    overlapping = 0
    ordered = sorted(boxes, key=lambda b: b.offsets)
    for i, a in enumerate(ordered):
        for b in ordered[i + 1 :]:
            if b.offsets[0] >= a.ends[0]:
                break
            common = intersect(a, b)
            if common is not None:
                overlapping += common.volume
    covered = volume - overlapping
    return Coverage(total, covered, overlapping)
