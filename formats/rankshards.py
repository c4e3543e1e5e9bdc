"""Per-rank shard files written by hand-rolled trainers (``rankshards``).

Recognised file layouts (one directory = one checkpoint):

- ``shard_RRRRR.pt`` (often in ``step_NNNNNNNN/``, with an optional ``metadata.json`` holding
  ``step`` and ``world_size``);
- ``shard_RRRRR_of_NNNNN.pt``;
- ``checkpoint_stepS_stageP.pt`` (pipeline stages, each with its own layers; a stack that every
  stage numbers from 0 is numbered across the stages);
- ``rankR.pt``, ``rank_R.pt`` and ``<name>_rankR.pt`` (one name for every rank's file).

Each file is a ``torch.save``'d dict. A tensor stored as ``{"local": t, "global_shape": [...],
"global_offset": [...]}`` (also ``tensor``/``data`` and ``shape``/``offsets``) is one piece of the
global tensor; so is a DTensor (FSDP2's and tensor parallelism's ``state_dict()`` values), placed
by its spec (:mod:`ckpttool._dtensor`). A plain tensor saved under the same name by several ranks
is one item with replicas, except RNG and dataloader state, which is per rank by nature: those
items are named ``<name>[rank=R]``.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpttool import _dtensor, _unpickle
from ckpttool.errors import CkptError, CorruptFileError, IncompleteCheckpointError, raise_together
from ckpttool.formats import _pt
from ckpttool.formats.base import Detection, claim
from ckpttool.geometry import Box
from ckpttool.io import list_files
from ckpttool.manifest import FileRecord, Item, Layout, Manifest, ReplicaCounter
from ckpttool.naming import classify, plural
from ckpttool.values import find_step, flatten, set_value

ALLOWLIST: dict[tuple[str, str], Any] = {
    **_unpickle.PLAIN,
    **_unpickle.TORCH_TENSORS,
    **_unpickle.numpy_arrays(),
    **_unpickle.NAMESPACES,
    **_dtensor.DTENSORS,
}
_PATTERNS = [
    re.compile(r"^shard_(?P<rank>\d+)_of_(?P<world>\d+)\.pt$"),
    re.compile(r"^shard_(?P<rank>\d+)\.pt$"),
    re.compile(r"^checkpoint_step(?P<step>\d+)_stage(?P<rank>\d+)\.pt$"),
    re.compile(r"^(?P<stem>(?:[\w.-]*[_-])?)rank_?(?P<rank>\d+)\.pth?$"),
]
_STEP_DIR = re.compile(r"^step_?(\d+)$")
LOCAL_KEYS = ("local", "tensor", "data")
"""the keys a shard's dict holds its part of a tensor under (beside its global shape and offset)"""
_SHAPE_KEYS = ("global_shape", "shape")
_OFFSET_KEYS = ("global_offset", "offsets", "offset")
_PER_RANK_KINDS = ("rng", "dataloader")


@dataclass(frozen=True, slots=True)
class _Sharded:
    """A rank's part of a global tensor: its regions, each a view of the local tensor and where
    that lies in the global one."""

    shape: tuple[int, ...]
    dtype: str
    parts: tuple[tuple[_unpickle.TensorRef, tuple[int, ...]], ...]


_TENSORS = (_unpickle.TensorRef, _Sharded)
"""a leaf that is a tensor once a rank file's DTensors are placed (as each file is read)"""


def _sharded(value: Any) -> _Sharded | None:
    if not isinstance(value, dict):
        return None
    local = next((value[k] for k in LOCAL_KEYS if k in value), None)
    shape = next((value[k] for k in _SHAPE_KEYS if k in value), None)
    offset = next((value[k] for k in _OFFSET_KEYS if k in value), None)
    if not isinstance(local, _unpickle.TensorRef) or shape is None or offset is None:
        return None
    if not (
        isinstance(shape, list | tuple)
        and isinstance(offset, list | tuple)
        and len(shape) == len(offset) == len(local.shape)
        and all(isinstance(v, int) and v >= 0 for v in (*shape, *offset))
    ):
        return None
    return _Sharded(tuple(shape), local.dtype, ((local, tuple(offset)),))


def _placed(placer: _pt.DTensorPlacer, name: str, ref: _dtensor.DTensorRef) -> _Sharded:
    """DTensor ``ref`` (leaf ``name`` of rank file ``placer.rel``) as the regions of its global tensor
    that its local tensor holds."""
    return _Sharded(ref.shape, ref.dtype, placer.parts(name, ref))


def _misplaced(
    shards: dict[int, str], order: list[int], noun: str, context: str, expected: list[int] | None = None
) -> dict[str, Any]:
    """The finding for rank files whose contents run in ``order`` of ranks where ``expected`` (the
    ranks' own order) was: each file out of place and the rank whose ``noun`` it holds."""
    moved = [(shards[r], e) for r, e in zip(order, expected or sorted(order), strict=True) if r != e]
    said = ", ".join(f"{f} holds rank {e}'s {noun}" for f, e in moved[:4]) + (" …" if len(moved) > 4 else "")
    return {
        "rule": "misplaced-file",
        "file": moved[0][0],
        "message": f"{said}: {context}; the files were swapped or renamed",
        "hint": "put each file back under its rank's name, or restore them from the save (if your trainer orders "
        "its ranks' data otherwise on purpose, this finding does not apply)",
    }


_Grid = tuple[str, tuple[int, ...], dict[tuple[int, ...], int], list[int]]
"""a tensor's blocks on a full grid: its name, the grid's sizes, the rank at each place, the cut
dimensions"""


def _blocks_out_of_order(manifest: Manifest, shards: dict[int, str]) -> dict[str, Any] | None:
    """Tensor-parallel blocks (``local`` + ``global_offset``) on a full grid, one rank each, that
    no mesh of the ranks lays out so: rank files in each other's places.

    A device mesh gives each rank digits (its coordinates, the last the fastest), and each tensor
    dimension is cut by some of them, outer to inner: the rank of the block at grid place ``c`` is
    then a sum of the digits of ``c`` (in some mixed radix of each dimension) times weights
    (:func:`_follows_a_mesh`). Blocks in the ranks' order are such a layout; so are rows following
    the fast rank index, and FSDP's cut inside a tensor-parallel one ([0, 2, 1, 3] along one
    dimension). Two files swapped break every such layout but a few (ranks 1 and 2 of a 2×2 grid
    make it the other order).

    Only blocks held by all ranks, or by a sub-mesh of them (a pipeline stage's ranks: some mesh
    digits fixed, the others free), are judged: a trainer that saves a replicated block once, by
    whichever rank it chose, lays it out as it likes. Blocks held otherwise are out of place only
    where exchanging two ranks gives every tensor those ranks hold a sub-mesh laid out as a mesh
    (two stages' files swapped). Files are named as that pair of ranks; else (three or more moved)
    as the files whose blocks lie out of place, without saying whose they hold. Empty blocks
    (which DTensor places at the end of their dimension) leave a tensor unjudged."""
    world = len(shards)
    known: dict[tuple[tuple[int, ...], tuple[int, ...]], bool] = {}
    subs: dict[frozenset[int], bool] = {}
    grids: list[_Grid] = []
    broken: list[int] = []  # (grids of judged holders that no mesh lays out)
    odd: list[int] = []  # (grids of holders that are no sub-mesh)
    seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    for item in manifest.items.values():
        placed = [(p.box.offsets, p.rank) for p in item.pieces if p.box is not None and p.rank is not None]
        if len(placed) < 2 or len(placed) != len(item.pieces) or not item.is_tensor:
            continue
        if len({r for _, r in placed}) != len(placed) or len({o for o, _ in placed}) != len(placed):
            continue  # (replicated blocks: several ranks per block, no one order)
        if any(p.box is not None and p.box.volume == 0 for p in item.pieces):
            continue
        cut = [d for d in range(len(placed[0][0])) if len({o[d] for o, _ in placed}) > 1]
        axes = [{v: i for i, v in enumerate(sorted({o[d] for o, _ in placed}))} for d in cut]
        sizes = tuple(len(a) for a in axes)
        if math.prod(sizes) != len(placed):
            continue  # (not a full grid of blocks: no mesh to go by)
        grid = {tuple(a[o[d]] for a, d in zip(axes, cut, strict=True)): r for o, r in placed}
        if (layout := (sizes, tuple(grid[c] for c in sorted(grid)))) in seen:
            continue  # (the layout of a tensor before it: judged once)
        seen.add(layout)
        grids.append((item.name, sizes, grid, cut))
        if not _submesh(frozenset(grid.values()), world, subs):
            odd.append(len(grids) - 1)
        elif not _meshed(grid, sizes, known):
            broken.append(len(grids) - 1)
    if broken:
        pair = _one_swap(grids, broken, world, known, subs)
    elif odd and (pair := _one_swap(grids, odd, world, known, subs, some=True)) is not None:
        broken = [k for k in odd if set(pair) & set(grids[k][2].values())]
    else:
        return None
    name, sizes, grid, cut = grids[broken[0]]
    blocks = sorted(grid)  # row by row
    held = [grid[c] for c in blocks]
    shown = f"ranks {held[:16]}{' …' if len(held) > 16 else ''}"
    if len(cut) == 1:
        context = f"the {len(held)} blocks of {name} (cut along dimension {cut[0]}) hold, in order, {shown}"
    else:
        grid_of = f"the {'×'.join(map(str, sizes))} grid of {name}'s blocks (cut along dimensions {cut})"
        context = f"{grid_of} holds, row by row, {shown}"
    context += ": no mesh of the ranks lays its blocks out so"
    if pair is not None:
        a, b = sorted(pair, key=lambda r: held.index(r) if r in held else len(held))  # (in block order)
        mended = context + f", and one does with ranks {a} and {b} exchanged"
        return _misplaced(shards, [a, b], "blocks", mended, [b, a])
    ranks = sorted(held)
    index = {r: i for i, r in enumerate(ranks)}
    nearest = _nearest_mesh({c: index[r] for c, r in grid.items()}, sizes)
    moved = [shards[r] for c, r in zip(blocks, held, strict=True) if ranks[nearest[c]] != r]
    said = ", ".join(moved[:4]) + (" …" if len(moved) > 4 else "")
    return {
        "rule": "misplaced-file",
        "file": moved[0],
        "message": f"{said} hold blocks out of their ranks' places: {context}; files were swapped or renamed "
        "(more than two: which rank's blocks each holds is not told)",
        "hint": "put each file back under its rank's name, or restore them from the save (if your trainer orders "
        "its ranks' data otherwise on purpose, this finding does not apply)",
    }


def _said_by_mesh(shards: dict[int, str], said: dict[int, set[int | None]]) -> dict[str, Any] | None:
    """Rank files whose DTensors' device mesh names another rank as the one that saved them."""
    moved = {r: m for r, s in said.items() if len(s) == 1 and (m := next(iter(s))) is not None and m != r}
    if not moved:
        return None
    context = "the device mesh pickled with each DTensor names the rank that saved it"
    return _misplaced(shards, list(moved), "DTensors", context, [moved[r] for r in moved])


def _saved_as(manifest: Manifest, shards: dict[int, str], inner: dict[int, str]) -> dict[str, Any] | None:
    """Rank files saved under another rank's name (:func:`_pt.saved_as`)."""
    found = _pt.saved_as(
        Path(manifest.root), {shards[r]: name for r, name in inner.items()}, {f.path: f.size for f in manifest.files}
    )
    if found is None:
        return None
    return {
        "rule": "misplaced-file",
        "file": found[0],
        "message": found[1],
        "hint": "put each file back under its rank's name, or restore the overwritten ones from the save",
    }


_Cells = dict[tuple[int, ...], set[int]]
"""a tensor's equal blocks by grid place (block offsets over block sizes): the ranks holding each"""


def _copied_over(manifest: Manifest, shards: dict[int, str]) -> dict[str, Any] | None:
    """Rank files with the same bytes where the tensors' blocks show one is out of place: a block
    more ranks hold than the others (or a part of the tensor no rank holds), and files among those
    ranks that are one file's bytes twice. Such a copy reads as a valid file of the rank it
    overwrote, and only a gap in a tensor (no file named) told of it.

    The copy is named where one file of the same bytes alone, holding the blocks too few ranks
    hold, gives every such tensor a layout of a mesh (:func:`_placed_evenly`); else the files of
    the same bytes are named together."""
    uneven: list[_Cells | None] = []  # (each uneven tensor's grid, where it has one)
    suspects: set[int] = set()
    example = ""
    for item in manifest.items.values():
        if not item.is_tensor or item.shape is None or not item.pieces:
            continue
        if any(p.box is None or p.rank is None for p in item.pieces):
            continue
        holders: dict[tuple[tuple[int, ...], tuple[int, ...]], set[int]] = {}
        for p in item.pieces:
            assert p.box is not None and p.rank is not None
            holders.setdefault((p.box.offsets, p.box.sizes), set()).add(p.rank)
        counts = [len(r) for r in holders.values()]
        total = math.prod(item.shape)
        covered = sum(math.prod(sizes) for _, sizes in holders)
        if covered >= total and min(counts) == max(counts):
            continue
        most = max(counts)
        crowded = [(b, r) for b, r in holders.items() if len(r) == most]
        for _block, ranks in crowded:
            suspects |= ranks
        uneven.append(_cells(item.shape, holders))
        if not example:
            block, ranks = crowded[0]
            why = (
                f"{total - covered:,} of its {total:,} elements are in no file"
                if covered < total
                else f"{len(ranks)} ranks hold it, {min(counts)} some other block"
            )
            example = f"the block {Box(*block).text()} of {item.name} is in {len(ranks)} files ({why})"
    if len(suspects) < 2:
        return None
    root = Path(manifest.root)
    sizes = {f.path: f.size for f in manifest.files}
    groups: list[list[int]] = []
    for r in sorted(suspects):  # files of the same bytes, in rank order
        for g in groups:
            a, b = shards[g[0]], shards[r]
            if sizes.get(a) == sizes.get(b) and _pt.same_bytes(root / a, root / b):
                g.append(r)
                break
        else:
            groups.append([r])
    groups = [g for g in groups if len(g) > 1]
    if not groups:
        return None
    world = len(shards)
    subs: dict[frozenset[int], bool] = {}
    known: dict[tuple[tuple[int, ...], tuple[int, ...]], bool] = {}
    fits = [
        c
        for g in groups
        for c in g
        if all(cells is None or _placed_evenly(cells, c, world, subs, known) for cells in uneven)
    ]
    hint = "restore the overwritten rank's file from the save"
    if len(fits) == 1:
        copy = fits[0]
        origin = next(r for g in groups if copy in g for r in g if r != copy)
        return {
            "rule": "misplaced-file",
            "file": shards[copy],
            "message": f"{shards[copy]} holds the same bytes as {shards[origin]}: {example}; with {shards[copy]} "
            "holding the blocks too few files hold, every tensor is laid out as a mesh lays it out: "
            f"{shards[origin]} was copied over rank {copy}'s file",
            "hint": hint,
        }
    group = groups[0]
    named = ", ".join(shards[r] for r in group[:4]) + (" …" if len(group) > 4 else "")
    return {
        "rule": "misplaced-file",
        "file": shards[group[-1]],
        "message": f"{named} hold the same bytes: {example}; one file was copied over another rank's (which, the "
        "blocks do not tell)",
        "hint": hint,
    }


def _cells(shape: tuple[int, ...], holders: dict[tuple[tuple[int, ...], tuple[int, ...]], set[int]]) -> _Cells | None:
    """The ranks holding each place of a tensor's grid of equal blocks, empty places included (None
    when the blocks are not of one size tiling the tensor, or the grid is too large to judge)."""
    sizes = {s for _, s in holders}
    if len(sizes) != 1:
        return None
    (size,) = sizes
    if any(n == 0 or d % n for d, n in zip(shape, size, strict=True)):
        return None
    grid = tuple(d // n for d, n in zip(shape, size, strict=True))
    if math.prod(grid) > 4096 or any(any(o % n for o, n in zip(off, size, strict=True)) for off, _ in holders):
        return None
    cells: _Cells = {c: set() for c in itertools.product(*(range(g) for g in grid))}
    for (off, _), ranks in holders.items():
        cells[tuple(o // n for o, n in zip(off, size, strict=True))] = set(ranks)
    return cells


def _placed_evenly(
    cells: _Cells,
    c: int,
    world: int,
    subs: dict[frozenset[int], bool],
    known: dict[tuple[tuple[int, ...], tuple[int, ...]], bool],
) -> bool:
    """Whether rank ``c``, moved from the block it shares with the most ranks to the one place too
    few ranks hold, leaves every block held by as many ranks, laid out by a mesh (one rank a block:
    :func:`_meshed`; several: each block's ranks a sub-mesh)."""
    pieces = sum(len(r) for r in cells.values())
    if pieces % len(cells):
        return False
    each = pieces // len(cells)
    over = [k for k, r in cells.items() if c in r and len(r) > each]
    under = [k for k, r in cells.items() if len(r) < each]
    if len(over) != 1 or len(under) != 1:
        return False
    moved = {k: set(r) for k, r in cells.items()}
    moved[over[0]].discard(c)
    moved[under[0]].add(c)
    if each == 1:
        grid = {k: next(iter(r)) for k, r in moved.items()}
        cut = tuple(max(k[d] for k in grid) + 1 for d in range(len(over[0])))
        keep = [d for d, n in enumerate(cut) if n > 1]
        return _meshed({tuple(k[d] for d in keep): r for k, r in grid.items()}, tuple(cut[d] for d in keep), known)
    return all(_submesh(frozenset(r), world, subs) for r in moved.values())


def _meshed(
    grid: dict[tuple[int, ...], int],
    sizes: tuple[int, ...],
    known: dict[tuple[tuple[int, ...], tuple[int, ...]], bool],
) -> bool:
    """:func:`_follows_a_mesh` for a grid of ranks (not rank indices), remembered in ``known``."""
    index = {r: i for i, r in enumerate(sorted(grid.values()))}
    key = (sizes, tuple(index[grid[c]] for c in sorted(grid)))
    if key not in known:
        known[key] = _follows_a_mesh({c: index[r] for c, r in grid.items()}, sizes)
    return known[key]


def _submesh(holders: frozenset[int], world: int, known: dict[frozenset[int], bool]) -> bool:
    """Whether ``holders`` are all ``world`` ranks, or the ranks of a mesh of them whose digits (in
    some mixed radix of the world) each run free or stay fixed: a pipeline stage's ranks, say."""
    if holders not in known:
        known[holders] = len(holders) == world or any(
            _digits_free_or_fixed(holders, fs) for fs in itertools.islice(_factorizations(world), 64)
        )
    return known[holders]


def _digits_free_or_fixed(ranks: frozenset[int], radices: tuple[int, ...]) -> bool:
    values: list[set[int]] = [set() for _ in radices]
    for r in ranks:
        for i in range(len(radices) - 1, -1, -1):
            r, d = divmod(r, radices[i])
            values[i].add(d)
    if any(len(v) not in (1, f) for v, f in zip(values, radices, strict=True)):
        return False
    return math.prod(len(v) for v in values) == len(ranks)


def _one_swap(
    grids: list[_Grid],
    suspects: list[int],
    world: int,
    known: dict[tuple[tuple[int, ...], tuple[int, ...]], bool],
    subs: dict[frozenset[int], bool],
    some: bool = False,
) -> tuple[int, int] | None:
    """The one pair of ranks (of the ``suspects`` grids', at most 32 of them) whose exchange mends
    them: every one (``some``: those holding either rank, one at least) becomes a sub-mesh's grid
    laid out as a mesh, and every other grid holding either rank that is a sub-mesh's is laid out
    as one. None where no pair, or several, do."""
    ranks = sorted({r for k in suspects for r in grids[k][2].values()})
    if len(ranks) > 32:
        return None
    found = []
    for a, b in itertools.combinations(ranks, 2):
        touched = [k for k in suspects if a in grids[k][2].values() or b in grids[k][2].values()]
        if not touched or (not some and len(touched) != len(suspects)):
            continue
        swap = {a: b, b: a}
        good = True
        for k, (_, sizes, grid, _) in enumerate(grids):
            if a not in grid.values() and b not in grid.values():
                continue
            moved = {c: swap.get(r, r) for c, r in grid.items()}
            sub = _submesh(frozenset(moved.values()), world, subs)
            if (k in touched and not sub) or (sub and not _meshed(moved, sizes, known)):
                good = False
                break
        if good:
            found.append((a, b))
            if len(found) > 1:
                return None
    return found[0] if found else None


def _follows_a_mesh(grid: dict[tuple[int, ...], int], sizes: tuple[int, ...]) -> bool:
    """Whether rank index ``grid[c]`` of the block at grid place ``c`` is what a device mesh gives:
    block 0 on rank 0, the grid's dimensions adding up (the rank at ``c`` is the sum of those at
    each of its coordinates alone), and along each dimension a sum of digits times weights
    (:func:`_digit_sum`)."""
    zero = (0,) * len(sizes)
    if grid[zero] != 0:
        return False
    along = [[grid[(*zero[:d], c, *zero[d + 1 :])] for c in range(n)] for d, n in enumerate(sizes)]
    if not all(_digit_sum(h) for h in along):
        return False
    return all(v == sum(h[c] for h, c in zip(along, place, strict=True)) for place, v in grid.items())


def _digit_sum(h: list[int]) -> bool:
    """Whether ``h[c]`` is a sum of the digits of ``c`` (in some mixed radix) times weights, as the
    ranks along one tensor dimension are that mesh dimensions cut: the innermost digit runs until
    ``h`` stops rising by ``h[1]``, and what is left is the same question one digit coarser."""
    while len(h) > 1:
        step = h[1]
        radix = next((c for c in range(1, len(h)) if h[c] != c * step), len(h))
        if len(h) % radix:
            return False
        coarse = h[::radix]
        if any(h[q * radix + c] != coarse[q] + c * step for q in range(len(coarse)) for c in range(radix)):
            return False
        h = coarse
    return True


def _nearest_mesh(grid: dict[tuple[int, ...], int], sizes: tuple[int, ...]) -> dict[tuple[int, ...], int]:
    """The rank index a mesh layout gives each grid place, of the layouts tried (the grid row by
    row first, then each dimension's factors in every order, as many as a budget allows) the one
    that fewest places disagree with."""
    budget = max(24, 200_000 // len(grid))
    best: tuple[int, dict[tuple[int, ...], int]] | None = None
    per_axis = [list(itertools.islice(_factorizations(n), 24)) for n in sizes]
    for facts in itertools.product(*per_axis):
        digits = [(d, i, f) for d, fs in enumerate(facts) for i, f in enumerate(fs)]
        for order in itertools.permutations(digits):
            budget -= 1
            if budget < 0:
                break
            layout = {place: _mesh_index(place, facts, order) for place in grid}
            wrong = sum(layout[p] != v for p, v in grid.items())
            if best is None or wrong < best[0]:
                best = (wrong, layout)
        if budget < 0:
            break
    assert best is not None
    return best[1]


def _mesh_index(
    place: tuple[int, ...], facts: tuple[tuple[int, ...], ...], order: tuple[tuple[int, int, int], ...]
) -> int:
    """The rank index of grid ``place`` when each dimension ``d`` is cut by mesh digits of radices
    ``facts[d]`` (outer to inner) and the ranks run through the digits in ``order`` (outer to inner)."""
    value: dict[tuple[int, int], int] = {}
    for d, fs in enumerate(facts):
        c = place[d]
        for i in range(len(fs) - 1, -1, -1):
            c, value[d, i] = divmod(c, fs[i])
    index = 0
    for d, i, f in order:
        index = index * f + value[d, i]
    return index


def _factorizations(n: int) -> Iterator[tuple[int, ...]]:
    """The ordered factorizations of ``n`` into factors above 1, ``(n,)`` first."""
    if n == 1:
        yield ()
        return
    for f in range(n, 1, -1):
        if n % f == 0:
            for rest in _factorizations(n // f):
                yield (f, *rest)


_LAYER_INDEX = re.compile(r"^(?:(.*?)\.)?(\d+)\.")  # (a stage's bare state dict: "0.weight")
_NUMBERED_KINDS = ("param", "optim", "master")


def _stages_out_of_order(manifest: Manifest, shards: dict[int, str]) -> dict[str, Any] | None:
    """Pipeline stages whose layers (parameters only one rank holds, numbered by the first number in
    their names, within one stack: the name before it) do not rise with the rank: stage files in
    each other's places. Stacks on one stage only (a vision tower before a language model) and
    stacks numbered from 0 on every stage have no order to go by."""
    stacks: dict[str, dict[int, list[int]]] = {}
    for item in manifest.items.values():
        if item.kind != "param" or len({p.rank for p in item.pieces}) != 1 or item.pieces[0].rank is None:
            continue
        if m := _LAYER_INDEX.search(item.name):
            stacks.setdefault(m.group(1) or "", {}).setdefault(item.pieces[0].rank, []).append(int(m.group(2)))
    for stack, layers in sorted(stacks.items()):
        if len(layers) < 2:
            continue
        spans = sorted((min(v), max(v), r) for r, v in layers.items())
        if any(a[1] >= b[0] for a, b in itertools.pairwise(spans)):
            continue  # (layers numbered per stage, or interleaved: no order to go by)
        order = [r for _, _, r in spans]
        if order != sorted(order):
            where = ", ".join(f"{stack + '.' if stack else ''}{lo}..{hi} in {shards[r]}" for lo, hi, r in spans[:4])
            context = f"the layers ({where}) run in the order of ranks {order}, not in rank order"
            return _misplaced(shards, order, "layers", context)
    return None


def _stage_numbering(stages: dict[int, list[tuple[str, Any]]]) -> dict[tuple[int, str], str]:
    """Names across pipeline stages for the leaves of stacks of parameters or optimizer state that
    each stage numbers on its own, so that two stages hold the same numbers (a stage's own
    ``nn.Sequential``, with gaps where a module holds no parameter; its optimizer's states, with
    gaps where a parameter had no gradient, and groups): stage by stage, each stage's numbers
    follow the highest of the stages before it. A stack numbered across stages already (stage 1
    going on where stage 0 stops, or stages interleaved) keeps its names; so does other state (RNG,
    dataloader, a scheduler's list of schedulers). Keyed by (stage, leaf name)."""
    held: dict[str, dict[int, set[int]]] = {}
    tails: dict[str, dict[int, set[tuple[int, str]]]] = {}  # (number, the name after it) by stack and stage
    params: set[str] = set()  # (the stacks of parameters)
    for stage, leaves in stages.items():
        for name, value in leaves:
            kind = classify(name, is_tensor=isinstance(value, _TENSORS))
            if kind in _NUMBERED_KINDS and (m := _LAYER_INDEX.search(name)):
                stack, n = m.group(1) or "", int(m.group(2))
                held.setdefault(stack, {}).setdefault(stage, set()).add(n)
                tails.setdefault(stack, {}).setdefault(stage, set()).add((n, name[m.end(2) + 1 :]))
                if kind == "param":
                    params.add(stack)
    shift: dict[tuple[str, int], int] = {}
    for stack, numbers in held.items():
        if sum(map(len, numbers.values())) == len(set().union(*numbers.values())):
            continue  # (no number on two stages: numbered across them, in turn or interleaved)
        offset = 0
        for stage in sorted(numbers):
            shift[stack, stage] = offset
            offset += max(numbers[stage]) + 1
    for stack in held.keys() - params:  # optimizer state keyed by its parameter's name: as the parameter
        if (owner := _keyed_by(tails[stack], {p: tails[p] for p in params})) is not None:
            for stage in held[stack]:
                if (owner, stage) in shift:
                    shift[stack, stage] = shift[owner, stage]
                else:
                    shift.pop((stack, stage), None)
    renamed: dict[tuple[int, str], str] = {}
    for stage, leaves in stages.items():
        for name, value in leaves:
            m = _LAYER_INDEX.search(name)
            if not m or not (by := shift.get((m.group(1) or "", stage))):
                continue
            if classify(name, is_tensor=isinstance(value, _TENSORS)) not in _PER_RANK_KINDS:
                renamed[stage, name] = f"{name[: m.start(2)]}{int(m.group(2)) + by}{name[m.end(2) :]}"
    return renamed


def _keyed_by(state: dict[int, set[tuple[int, str]]], params: dict[str, dict[int, set[tuple[int, str]]]]) -> str | None:
    """The stack of parameters whose names key a stack of optimizer state (``optim.state.2.weight.
    exp_avg`` for ``model.2.weight``: on every stage, each state's number and the name after it
    begin with a parameter's), if one does."""
    for stack, held in params.items():
        if all(
            any((n, ".".join(tail.split(".")[:k])) in held.get(stage, ()) for k in range(1, tail.count(".") + 1))
            for stage, entries in state.items()
            for n, tail in entries
        ):
            return stack
    return None


def _missing(path: Path, shards: dict[int, str], missing: list[int], said: str, why: str) -> list[CkptError]:
    """An error for each of the ``missing`` ranks' files (named after another rank's), of ``said``
    ranks; where there are too many to list (or no file to name them after), one error raised."""
    hint = "a rank did not finish saving or its file was deleted; use another checkpoint"
    like = shards[min(shards)] if shards else None
    if like is None or len(missing) > 64:
        raise IncompleteCheckpointError(
            f"{path}: {len(missing)} of {said} rank shards missing "
            f"(ranks {', '.join(map(str, missing[:12]))}{' …' if len(missing) > 12 else ''})",
            hint=hint,
            path=str(path),
            rule="missing-file",
        )
    return [
        IncompleteCheckpointError(
            f"{name}: rank {r}'s shard is missing ({len(missing)} of {said} ranks have no file here{why})",
            hint=hint,
            path=name,
            rule="missing-file",
            rank=r,
        )
        for r in missing
        for name in [_named_like(like, r)]
    ]


_DP_NAMES = frozenset({"dp", "dp_shard", "dp_replicate", "fsdp", "ddp", "hsdp"})


def _mesh_layout(world: tuple[tuple[str | None, int], ...]) -> Layout:
    """The layout a DTensor's root mesh gives: its size, and the sizes of the dimensions it names as
    data ("dp", "dp_shard", "dp_replicate", ...: multiplied), tensor, pipeline and expert parallel."""
    sizes = dict.fromkeys(("tp", "pp", "ep"), None) | {n: k for n, k in world if n in ("tp", "pp", "ep")}
    dp = [k for n, k in world if n in _DP_NAMES]
    return Layout(world_size=math.prod(k for _, k in world), dp=math.prod(dp) if dp else None, **sizes)


def _match(name: str) -> re.Match[str] | None:
    for pattern in _PATTERNS:
        m = pattern.match(name)
        if m:
            return m
    return None


def _named_like(rel: str, rank: int) -> str:
    """The file name rank ``rank`` saves under, after another rank's file ``rel`` (its digits
    padded as that one's are)."""
    m = _match(rel)
    assert m is not None
    digits = m.group("rank")
    width = len(digits) if digits.startswith("0") and len(digits) > 1 else 1
    return rel[: m.start("rank")] + f"{rank:0{width}d}" + rel[m.end("rank") :]


class RankShardsAdapter:
    name = "rankshards"

    def detect(self, path: Path) -> Detection:
        if not path.is_dir():
            return Detection(False, "not a directory")
        shards = [p.name for p in path.iterdir() if _match(p.name)]
        if shards:
            return Detection(True, f"found per-rank shard files ({shards[0]}, ...)")
        return Detection(
            False, "no shard_<rank>.pt, shard_<rank>_of_<n>.pt, checkpoint_step<s>_stage<p>.pt or rank<r>.pt"
        )

    def describe(self, path: Path) -> Manifest:
        manifest = Manifest(root=str(path), format=self.name)
        meta: dict[str, Any] = {}
        shards: dict[int, str] = {}
        world: int | None = None
        world_from = "."  # the file that gave the world size
        step: int | None = None
        named: dict[str, int] = {}  # the step in a file's name (checkpoint_step<s>_stage<p>.pt)
        worlds: dict[str, int] = {}  # the world size in a file's name (shard_<r>_of_<n>.pt)
        listing = [(rel, size, _match(rel)) for rel, size in list_files(path)]  # (each name matched once)
        # a run that keeps each save's files side by side (checkpoint_step<s>_stage<p>.pt for every s):
        # the latest save is the checkpoint, the others' files are listed beside it
        # (a stage saved under two steps; stages split between steps are one save's files, misnamed)
        named_steps = [(int(m["step"]), int(m["rank"])) for _, _, m in listing if m and "step" in m.groupdict()]
        # the world size most files' names give (shard_<r>_of_<n>.pt): a leftover file of a save at
        # another world size is not one of this save's ranks, whichever sorts first
        named_worlds = Counter(int(m["world"]) for _, _, m in listing if m and "world" in m.groupdict())
        name_world = max(named_worlds, key=lambda n: (named_worlds[n], n)) if named_worlds else None
        steps = {st for st, _ in named_steps}
        twice = len({r for _, r in named_steps}) < len(named_steps)
        latest = max(steps) if len(steps) > 1 and twice else None
        older: list[str] = []
        for rel, size, m in listing:
            if m is not None and latest is not None and int(m.groupdict().get("step") or latest) != latest:
                older.append(rel)
                m = None
            if m is None:
                manifest.files.append(
                    FileRecord(path=rel, size=size, role="metadata" if rel == "metadata.json" else "aux")
                )
                continue
            rank = int(m.group("rank"))
            if "world" in m.groupdict():
                worlds[rel] = int(m.group("world"))
                if worlds[rel] != name_world:  # (named below as a file of another layout)
                    manifest.files.append(FileRecord(path=rel, size=size, role="aux"))
                    continue
            other = _match(shards[rank]) if rank in shards else None
            if other and "stem" in other.groupdict() and "stem" in m.groupdict() and other["stem"] != m["stem"]:
                stems = sorted({other["stem"], m["stem"]})
                raise CkptError(
                    f"{path}: several files for each rank ({shards[rank]}, {rel}): ckpttool reads one file per rank "
                    f"as one checkpoint",
                    hint=f"check each set apart: move the {' and '.join(f'{s}rank*.pt' for s in stems)} files into "
                    "folders of their own",
                    path=rel,
                )
            claim(shards, rank, rel, f"rank {rank}")
            manifest.files.append(FileRecord(path=rel, size=size, role="data", ranks=[rank]))
            if "step" in m.groupdict():
                step = named[rel] = int(m.group("step"))
        meta_step: int | None = None
        if any(f.path == "metadata.json" for f in manifest.files):  # (listed: inside the checkpoint)
            try:
                meta = json.loads((path / "metadata.json").read_text())
            except (OSError, ValueError, RecursionError) as exc:
                raise CorruptFileError(f"metadata.json: not readable JSON ({exc})", path="metadata.json") from None
            if not isinstance(meta, dict):
                raise CorruptFileError("metadata.json: not a JSON object", path="metadata.json")
            if isinstance(meta.get("world_size"), int) and not isinstance(meta["world_size"], bool):
                world, world_from = meta["world_size"], "metadata.json"
            if isinstance(meta.get("step"), int) and not isinstance(meta["step"], bool):
                step = meta_step = meta["step"]
        if world is None and name_world is not None:
            world = name_world
            world_from = next(rel for rel, n in worlds.items() if n == world)
        if world is not None and not 0 < world <= max(4 * len(shards), 1 << 16):
            raise CorruptFileError(
                f"{path}: world size {world:,} for {len(shards)} shard files is not plausible",
                path=world_from,
            )
        # files of another layout: a rank beyond the world size or a name giving another one, and
        # those set aside above (of another world size than most names give)
        taken = set(shards.values())
        strays = sorted(
            [rel for r, rel in shards.items() if world is not None and (r >= world or worlds.get(rel, world) != world)]
            + [rel for rel in worlds if rel not in taken]
        )
        if strays:  # files of another save's layout: not this checkpoint's ranks
            shards = {r: rel for r, rel in shards.items() if rel not in strays}
            manifest.files = [
                FileRecord(path=f.path, size=f.size, role="aux") if f.path in strays else f for f in manifest.files
            ]
        # without a world size, the ranks still run from 0 without a gap (the last one's absence
        # shows only as a sharded tensor's coverage gap)
        expect = world if world is not None else (max(shards) + 1 if shards else 0)
        # an earlier save beside it with more stages: the latest's last stages are missing, not absent
        before = max((int(m["rank"]) + 1 for rel in older if (m := _match(rel))), default=0)
        if world is None and before > expect:
            expect = before
        damaged: list[CkptError] = []  # every rank file absent or unreadable named, not the first
        missing = [r for r in range(expect) if r not in shards]
        if missing:
            said = f"{world}" if world is not None else f"at least {expect}"
            why = f"; the earlier save beside it has {before}" if world is None and before == expect else ""
            damaged += _missing(path, shards, missing, said, why)
        replicas = ReplicaCounter()
        claims: dict[str, int] = {}
        # pipeline stages' leaves are kept until every stage is read (their names may change with
        # the stages after them: _stage_numbering); other rank files' are added as each is read
        staged = any(_PATTERNS[2].match(rel) for rel in shards.values())
        kept: dict[int, list[tuple[str, Any]]] = {}
        inner: dict[int, str] = {}  # the name torch.save gave the archive inside each file
        meshes: set[tuple[tuple[str | None, int], ...] | None] = set()  # the DTensors' root meshes
        said_rank: dict[int, set[int | None]] = {}  # the ranks a file's DTensors' meshes say saved them
        for rank, rel in sorted(shards.items()):
            if (loaded := _pt.load_or_note(path, rel, ALLOWLIST, damaged)) is None:
                damaged[-1].rank = rank
                continue
            archive, obj, _ = loaded
            archive.close()
            inner[rank] = archive.prefix.rstrip("/")
            leaves = flatten(obj if isinstance(obj, dict) else {"value": obj}, leaf=_sharded)
            placer = _pt.DTensorPlacer(rel)
            for i, (n, v) in enumerate(leaves):
                if isinstance(v, _dtensor.DTensorRef):
                    meshes.add(v.world)
                    said_rank.setdefault(rank, set()).add(v.rank)
                    leaves[i] = (n, _placed(placer, n, v))
            claimed = next((v for k, v in leaves if k in ("step", "iteration", "global_step")), None)
            if isinstance(claimed, int) and not isinstance(claimed, bool):
                claims[rel] = claimed
            if staged:
                kept[rank] = leaves
            else:
                self._add_all(manifest, leaves, rel, rank, replicas, {})
        # the DTensors' mesh gives the world size where nothing else does: the last ranks' files are
        # then missing files, not only coverage gaps
        mesh = next(iter(meshes)) if len(meshes) == 1 else None
        layout = _mesh_layout(mesh) if mesh is not None else Layout()
        if world is None and layout.world_size is not None and layout.world_size >= expect:
            world, world_from = layout.world_size, "the DTensors' device mesh"
            if late := [r for r in range(expect, world) if r not in shards]:
                damaged += _missing(path, shards, late, str(world), f"; {world} is the DTensors' device mesh's size")
        raise_together(damaged)
        renamed = _stage_numbering(kept)
        for rank, leaves in kept.items():
            self._add_all(manifest, leaves, shards[rank], rank, replicas, renamed)
        if renamed:
            manifest.extras["stage_numbering"] = (
                "each pipeline stage numbers its layers (and its optimizer's states and groups) from 0: "
                "names here number them across stages, in stage order"
            )
        dir_step = int(m.group(1)) if (m := _STEP_DIR.match(path.name)) else None
        if step is None:
            step = dir_step if dir_step is not None else find_step(manifest.items)
        findings: list[dict[str, Any]] = []
        for rel, by_name in named.items():  # a file's name is its claim where its content makes none
            if claims.setdefault(rel, by_name) != by_name:
                findings.append(
                    {
                        "rule": "step-mismatch",
                        "file": rel,
                        "message": f"{rel} is named for step {by_name} but holds step {claims[rel]}",
                        "hint": "the file was renamed, or copied in from another save: restore it from this save",
                    }
                )
        if len(set(named.values())) > 1 and meta_step is None:  # the step most of the files give
            counted = list(claims.values())
            step = max(counted, key=counted.count)
        if claims and meta_step is not None:  # the shards' own and metadata.json's: the step most give
            claims["metadata.json"] = meta_step
            counted = list(claims.values())
            step = max(counted, key=counted.count)
        manifest.step = step
        layout.world_size = world or len(shards)
        manifest.layout = layout
        if claims:
            manifest.extras["step_claims"] = claims
        if strays:
            findings.append(
                {
                    "rule": "extra-file",
                    "severity": "warning",
                    "file": strays[0],
                    "message": f"{plural(len(strays), 'rank file')} of another layout than this save's {world} ranks "
                    f"(by {world_from}) beside it: {', '.join(strays[:4])}{' …' if len(strays) > 4 else ''}; "
                    "ckpttool reads the ranks of this save",
                    "hint": "files of an earlier save at another world size: move them into a folder of their own",
                    "stops_writes": False,
                }
            )
        if out_of_order := (
            _said_by_mesh(shards, said_rank)
            or _saved_as(manifest, shards, inner)
            or _copied_over(manifest, shards)
            or _blocks_out_of_order(manifest, shards)
            or _stages_out_of_order(manifest, shards)
        ):
            findings.append(out_of_order)
        if older:
            earlier = sorted(steps - {latest})
            findings.append(
                {
                    "rule": "extra-file",
                    "severity": "warning",
                    "file": older[0],
                    "message": f"{len(older)} file(s) of earlier saves (step {', '.join(map(str, earlier))}) beside "
                    f"this one: {', '.join(older[:4])}{' …' if len(older) > 4 else ''}; ckpttool reads the latest "
                    f"save, step {latest}",
                    "hint": "to check an earlier save, move its files into a folder of their own",
                    "stops_writes": False,
                }
            )
        if findings:
            manifest.extras["findings"] = findings
        return manifest

    @classmethod
    def _add_all(
        cls,
        manifest: Manifest,
        leaves: list[tuple[str, Any]],
        rel: str,
        rank: int,
        replicas: ReplicaCounter,
        renamed: dict[tuple[int, str], str],
    ) -> None:
        for name, value in leaves:
            cls._add(manifest, name, value, rel, rank, replicas, renamed.get((rank, name), name))

    @staticmethod
    def _add(
        manifest: Manifest, name: str, value: Any, rel: str, rank: int, replicas: ReplicaCounter, key: str
    ) -> None:
        """Add leaf ``name`` of rank file ``rel`` as (a piece of) item ``key``."""
        if isinstance(value, _Sharded):
            item = manifest.items.get(key) or manifest.add(
                Item(name=key, kind=classify(key, is_tensor=True), dtype=value.dtype, shape=value.shape)
            )
            if item.dtype != value.dtype or item.shape != value.shape:
                raise CorruptFileError(
                    f"{rel}: {name} is {value.dtype}{list(value.shape)} here, {item.dtype}"
                    f"{list(item.shape or ())} on another rank",
                    path=rel,
                )
            for ref, offset in value.parts:
                box = Box(offset, ref.shape)
                if not box.within(value.shape):
                    raise CorruptFileError(
                        f"{rel}: {name} local shard {list(ref.shape)} at {list(offset)} lies "
                        f"outside its global shape {list(value.shape)}",
                        path=rel,
                    )
                same = replicas.next(key, box)
                item.pieces.append(_pt.tensor_piece(rel, ref, box=box, rank=rank, replica=same))
            return
        is_tensor = isinstance(value, _unpickle.TensorRef)
        kind = classify(key, is_tensor=is_tensor)
        if kind in _PER_RANK_KINDS:
            key = f"{key}[rank={rank}]"
        found = manifest.items.get(key)
        if is_tensor:
            if found is None:
                item = manifest.add(Item(name=key, kind=kind, dtype=value.dtype, shape=value.shape))
            else:
                item = found
            if item.dtype != value.dtype or item.shape != value.shape:
                raise CorruptFileError(
                    f"{rel}: {name} is {value.dtype}{list(value.shape)} here but "
                    f"{item.dtype}{list(item.shape or ())} on another rank, and has no sharding spec",
                    hint="a file replaced by another save's, or a trainer whose ranks each save their own part under "
                    "the same names (ZeroRedundancyOptimizer's state_dict per rank), which ckpttool cannot tell "
                    "apart: give the parts a sharding spec ({'local', 'global_shape', 'global_offset'}) or a name each",
                    path=rel,
                )
            item.pieces.append(_pt.tensor_piece(rel, value, rank=rank, replica=replicas.next(key, None)))
        else:
            if found is None:
                item = manifest.add(Item(name=key, kind=kind))
                set_value(item, value)
            else:
                item = found
            item.pieces.append(_pt.object_piece(rel, name, rank=rank, replica=len(item.pieces)))

    def reader(self, manifest: Manifest) -> _pt.PtReader:
        return _pt.PtReader(manifest, ALLOWLIST)


ADAPTER = RankShardsAdapter()
