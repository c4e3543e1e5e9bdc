from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpttool.geometry import Box, coverage, flat_range_boxes, intersect, row_major_strides


def test_intersect_basic():
    a = Box((0, 0), (4, 4))
    b = Box((2, 3), (4, 4))
    assert intersect(a, b) == Box((2, 3), (2, 1))
    assert intersect(a, Box((4, 0), (1, 4))) is None
    assert intersect(Box((), ()), Box((), ())) == Box((), ())


def test_coverage_exact_gap_overlap():
    shape = (8, 6)
    rows = [Box((0, 0), (4, 6)), Box((4, 0), (4, 6))]
    assert coverage(shape, rows).exact
    gap = coverage(shape, rows[:1])
    assert (gap.gaps, gap.overlapping) == (24, 0)
    over = coverage(shape, [*rows, Box((3, 0), (2, 3))])
    assert over.gaps == 0 and over.overlapping == 6
    assert coverage((), [Box((), ())]).exact
    assert not coverage((), []).exact


def test_coverage_2x2_mesh():
    boxes = [Box((r, c), (4, 3)) for r in (0, 4) for c in (0, 3)]
    assert coverage((8, 6), boxes).exact


def test_box_outside_tensor_is_refused():
    with pytest.raises(ValueError):
        coverage((4,), [Box((2,), (4,))])


def test_flat_range_boxes_examples():
    box = Box((0, 0, 0), (2, 3, 4))
    assert flat_range_boxes(box, 0, 24) == [box]
    assert flat_range_boxes(box, 0, 12) == [Box((0, 0, 0), (1, 3, 4))]
    parts = flat_range_boxes(box, 5, 10)
    assert sum(p.volume for p in parts) == 10
    with pytest.raises(ValueError):
        flat_range_boxes(box, 20, 5)


@settings(max_examples=300, deadline=None)
@given(
    shape=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    data=st.data(),
)
def test_flat_range_boxes_match_numpy(shape, data):
    n = math.prod(shape)
    start = data.draw(st.integers(0, n - 1))
    length = data.draw(st.integers(0, n - start))
    offsets = tuple(data.draw(st.integers(0, 3)) for _ in shape)
    box = Box(offsets, tuple(shape))
    big = np.arange(math.prod(o + s for o, s in zip(offsets, shape, strict=True))).reshape(
        [o + s for o, s in zip(offsets, shape, strict=True)]
    )
    expected = big[box.slices()].reshape(-1)[start : start + length]
    got = [big[b.slices()].reshape(-1) for b in flat_range_boxes(box, start, length)]
    joined = np.concatenate(got) if got else np.empty(0, dtype=big.dtype)
    np.testing.assert_array_equal(joined, expected)
    assert len(got) <= max(1, 2 * len(shape) - 1)


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(1, 30), min_size=1, max_size=6), cols=st.integers(1, 5), drop=st.booleans())
def test_coverage_of_row_splits(cuts, cols, drop):
    rows = sum(cuts)
    boxes, start = [], 0
    for c in cuts:
        boxes.append(Box((start, 0), (c, cols)))
        start += c
    if drop and len(boxes) > 1:
        removed = boxes.pop(len(boxes) // 2)
        cov = coverage((rows, cols), boxes)
        assert cov.gaps == removed.volume and cov.overlapping == 0
    else:
        assert coverage((rows, cols), boxes).exact


def test_contiguous_part_agrees_with_numpy() -> None:
    """``contiguous_part`` says where a sub-box lies in its piece's C-ordered storage exactly when
    its elements are consecutive there."""
    from ckpttool.assemble import contiguous_part

    rng = np.random.default_rng(0)
    for _ in range(3000):
        nd = int(rng.integers(0, 4))
        sizes = tuple(int(x) for x in rng.integers(1, 5, nd))
        offs = tuple(int(x) for x in rng.integers(0, 3, nd))
        whole = Box(offs, sizes)
        po = tuple(int(o + rng.integers(0, s)) for o, s in zip(offs, sizes, strict=True))
        ps = tuple(int(rng.integers(1, o + s - p + 1)) for o, s, p in zip(offs, sizes, po, strict=True))
        part = Box(po, ps)
        flat = np.arange(int(np.prod(sizes))).reshape(sizes)[part.slices(relative_to=whole)].reshape(-1)
        consecutive = flat.size < 2 or bool(np.all(np.diff(flat) == 1))
        assert contiguous_part(whole, part) == (int(flat[0]) if consecutive else None), (whole, part)


def test_row_major_strides():
    """C-order strides, as torch gives a contiguous tensor's, a size-0 dim counted as 1 in the
    strides before it: (3, 0) gave (0, 1) where torch has (1, 1), and convert --to torch wrote other
    bytes than dcp_to_torch_save for a tensor with no elements."""
    import torch

    for shape in [(), (5,), (3, 4), (2, 3, 4, 1), (3, 0), (0, 3), (2, 0, 3), (0,)]:
        assert row_major_strides(shape) == torch.empty(shape).stride(), shape


def test_first_gap_is_the_first_block_no_box_holds():
    def first_gap(shape, boxes):
        return coverage(shape, boxes).first_gap

    rows = [Box((0, 0), (16, 8)), Box((16, 0), (16, 8)), Box((48, 0), (16, 8))]
    assert first_gap((64, 8), rows) == Box((32, 0), (16, 8))
    assert first_gap((64, 8), [*rows, Box((32, 0), (16, 8))]) is None
    cols = [Box((0, 0), (4, 2)), Box((0, 4), (4, 4))]  # columns 2:4 of every row: the first block
    assert first_gap((4, 8), cols) == Box((0, 2), (4, 2))
    assert first_gap((4, 8), []) == Box((0, 0), (4, 8))

