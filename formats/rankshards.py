"""Per-rank shard files written by hand-rolled trainers (``rankshards``).

Recognised file layouts (one directory = one checkpoint):

- ``shard_RRRRR.pt`` (often in ``step_NNNNNNNN/``, with an optional ``metadata.json`` holding
  ``step`` and ``world_size``);
- ``shard_RRRRR_of_NNNNN.pt``;
- ``checkpoint_stepS_stageP.pt`` (pipeline stages, each with its own layers; a stack that every
  stage numbers from 0 is numbered across the stages).

Each file is a ``torch.save``'d dict. A tensor stored as ``{"local": t, "global_shape": [...],
"global_offset": [...]}`` (also ``tensor``/``data`` and ``shape``/``offsets``) is one piece of the
global tensor. A plain tensor saved under the same name by several ranks is one item with
replicas, except RNG and dataloader state, which is per rank by nature: those items are named
``<name>[rank=R]``.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpttool import _unpickle
from ckpttool.errors import CorruptFileError, IncompleteCheckpointError
from ckpttool.formats import _pt
from ckpttool.formats.base import Detection, claim
from ckpttool.geometry import Box
from ckpttool.io import list_files
from ckpttool.manifest import FileRecord, Item, Layout, Manifest, ReplicaCounter
from ckpttool.naming import classify
from ckpttool.values import find_step, flatten, set_value

ALLOWLIST: dict[tuple[str, str], Any] = {
    **_unpickle.PLAIN,
    **_unpickle.TORCH_TENSORS,
    **_unpickle.numpy_arrays(),
    **_unpickle.NAMESPACES,
}
_PATTERNS = [
    re.compile(r"^shard_(?P<rank>\d+)_of_(?P<world>\d+)\.pt$"),
    re.compile(r"^shard_(?P<rank>\d+)\.pt$"),
    re.compile(r"^checkpoint_step(?P<step>\d+)_stage(?P<rank>\d+)\.pt$"),
]
_STEP_DIR = re.compile(r"^step_?(\d+)$")
_LOCAL_KEYS = ("local", "tensor", "data")
_SHAPE_KEYS = ("global_shape", "shape")
_OFFSET_KEYS = ("global_offset", "offsets", "offset")
_PER_RANK_KINDS = ("rng", "dataloader")


@dataclass(frozen=True, slots=True)
class _Sharded:
    local: _unpickle.TensorRef
    shape: tuple[int, ...]
    offset: tuple[int, ...]


def _sharded(value: Any) -> _Sharded | None:
    if not isinstance(value, dict):
        return None
    local = next((value[k] for k in _LOCAL_KEYS if k in value), None)
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
    return _Sharded(local, tuple(shape), tuple(offset))


def _misplaced(shards: dict[int, str], order: list[int], noun: str, context: str) -> dict[str, Any]:
    """The finding for rank files whose contents run in ``order`` of ranks where the ranks' own
    order was expected: each file out of place and the rank whose ``noun`` it holds."""
    moved = [(shards[r], e) for r, e in zip(order, sorted(order), strict=True) if r != e]
    said = ", ".join(f"{f} holds rank {e}'s {noun}" for f, e in moved[:4]) + (" …" if len(moved) > 4 else "")
    return {
        "rule": "misplaced-file",
        "file": moved[0][0],
        "message": f"{said}: {context}; the files were swapped or renamed",
        "hint": "put each file back under its rank's name, or restore them from the save (if your trainer orders "
        "its ranks' data otherwise on purpose, this finding does not apply)",
    }


def _blocks_out_of_order(manifest: Manifest, shards: dict[int, str]) -> dict[str, Any] | None:
    """Tensor-parallel blocks (``local`` + ``global_offset``), one rank each, whose ranks do not
    follow the blocks' places: rank files in each other's places.

    Blocks cut along one dimension run in the ranks' order; that the same other order in every
    such tensor (with the same ranks) is files out of place. Blocks cut along several dimensions
    (a mesh) follow the ranks with one mesh dimension the slow index and another the fast one, in
    whichever order the trainer chose (rows by the fast rank index, or by the slow): a tensor
    whose blocks follow the ranks in no such order is files out of place, named from the order
    they break least."""
    orders: dict[tuple[int, ...], dict[tuple[int, ...], str]] = {}
    for item in manifest.items.values():
        placed = [(p.box.offsets, p.rank) for p in item.pieces if p.box is not None and p.rank is not None]
        if len(placed) < 2 or len(placed) != len(item.pieces) or not item.is_tensor:
            continue
        if len({r for _, r in placed}) != len(placed) or len({o for o, _ in placed}) != len(placed):
            continue  # (replicated blocks: several ranks per block, no one order)
        cut = [d for d in range(len(placed[0][0])) if len({o[d] for o, _ in placed}) > 1]
        if len(cut) == 1:
            order = tuple(r for _, r in sorted(placed, key=lambda x: x[0][cut[0]]))
            orders.setdefault(tuple(sorted(order)), {}).setdefault(order, item.name)
        elif 1 < len(cut) <= 3 and (found := _mesh_out_of_order(placed, cut)) is not None:
            context = f"{item.name} is cut along dimensions {cut}: {found[1]} (row by row, or column by column)"
            return _misplaced(shards, found[0], "blocks", context)
    for ranks, seen in orders.items():
        if len(seen) == 1 and (order := next(iter(seen))) != ranks:
            context = f"in every sharded tensor ({seen[order]}, …) the blocks run in the order of ranks {list(order)}"
            return _misplaced(shards, list(order), "blocks", context + ", not in rank order")
    return None


def _mesh_out_of_order(placed: list[tuple[tuple[int, ...], int]], cut: list[int]) -> tuple[list[int], str] | None:
    """For blocks on a full grid (cut along ``cut``), one rank each: None if the ranks, in order,
    follow the grid with its dimensions taken slow to fast in some order; else the holders of the
    blocks in the order they break least (the ranks there expected sorted) and a few words on the
    grid."""
    axes = [sorted({o[d] for o, _ in placed}) for d in cut]
    if math.prod(len(a) for a in axes) != len(placed):
        return None  # (not a full grid: no mesh to go by)
    ranks = sorted(r for _, r in placed)
    at = {tuple(a.index(o[d]) for a, d in zip(axes, cut, strict=True)): r for o, r in placed}
    best: tuple[int, list[int]] | None = None
    for slow_to_fast in itertools.permutations(range(len(cut))):
        held = []  # the rank holding each block, blocks in the rank order this permutation gives
        for coords in itertools.product(*(range(len(axes[a])) for a in slow_to_fast)):
            full = [0] * len(cut)
            for a, c in zip(slow_to_fast, coords, strict=True):
                full[a] = c
            held.append(at[tuple(full)])
        wrong = sum(r != e for r, e in zip(held, ranks, strict=True))
        if wrong == 0:
            return None
        if best is None or wrong < best[0]:
            best = (wrong, held)
    assert best is not None
    grid = "×".join(str(len(a)) for a in axes)
    return best[1], f"the {grid} grid of blocks holds ranks {best[1]} where the ranks in order were expected"


_LAYER_INDEX = re.compile(r"^(.*?)\.(\d+)\.")


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
            stacks.setdefault(m.group(1), {}).setdefault(item.pieces[0].rank, []).append(int(m.group(2)))
    for stack, layers in sorted(stacks.items()):
        if len(layers) < 2:
            continue
        spans = sorted((min(v), max(v), r) for r, v in layers.items())
        if any(a[1] >= b[0] for a, b in itertools.pairwise(spans)):
            continue  # (layers numbered per stage, or interleaved: no order to go by)
        order = [r for _, _, r in spans]
        if order != sorted(order):
            where = ", ".join(f"{stack}.{lo}..{hi} in {shards[r]}" for lo, hi, r in spans[:4])
            context = f"the layers ({where}) run in the order of ranks {order}, not in rank order"
            return _misplaced(shards, order, "layers", context)
    return None


def _stage_numbering(stages: dict[int, list[tuple[str, Any]]]) -> dict[tuple[int, str], str]:
    """Names across pipeline stages for the leaves of stacks that every stage holding them numbers
    from 0 (a stage's own ``nn.Sequential``, its optimizer's states and groups): stage by stage,
    each stage's numbers follow those of the stages before it. A stack numbered across stages
    already (stage 1 going on where stage 0 stops), or with gaps, keeps its names; so does per-rank
    state (RNG, dataloader). Keyed by (stage, leaf name)."""
    held: dict[str, dict[int, set[int]]] = {}
    for stage, leaves in stages.items():
        for name, value in leaves:
            if classify(name, is_tensor=isinstance(value, _unpickle.TensorRef | _Sharded)) in _PER_RANK_KINDS:
                continue
            if m := _LAYER_INDEX.search(name):
                held.setdefault(m.group(1), {}).setdefault(stage, set()).add(int(m.group(2)))
    shift: dict[tuple[str, int], int] = {}
    for stack, numbers in held.items():
        if len(numbers) < 2 or any(v != set(range(len(v))) for v in numbers.values()):
            continue
        offset = 0
        for stage in sorted(numbers):
            shift[stack, stage] = offset
            offset += len(numbers[stage])
    renamed: dict[tuple[int, str], str] = {}
    for stage, leaves in stages.items():
        for name, _ in leaves:
            m = _LAYER_INDEX.search(name)
            if m and (by := shift.get((m.group(1), stage))):
                renamed[stage, name] = f"{name[: m.start(2)]}{int(m.group(2)) + by}{name[m.end(2) :]}"
    return renamed


def _match(name: str) -> re.Match[str] | None:
    for pattern in _PATTERNS:
        m = pattern.match(name)
        if m:
            return m
    return None


class RankShardsAdapter:
    name = "rankshards"

    def detect(self, path: Path) -> Detection:
        if not path.is_dir():
            return Detection(False, "not a directory")
        shards = [p.name for p in path.iterdir() if _match(p.name)]
        if shards:
            return Detection(True, f"found per-rank shard files ({shards[0]}, ...)")
        return Detection(False, "no shard_<rank>.pt, shard_<rank>_of_<n>.pt or checkpoint_step<s>_stage<p>.pt")

    def describe(self, path: Path) -> Manifest:
        manifest = Manifest(root=str(path), format=self.name)
        meta: dict[str, Any] = {}
        shards: dict[int, str] = {}
        world: int | None = None
        step: int | None = None
        for rel, size in list_files(path):
            m = _match(rel)
            if m is None:
                manifest.files.append(
                    FileRecord(path=rel, size=size, role="metadata" if rel == "metadata.json" else "aux")
                )
                continue
            rank = int(m.group("rank"))
            claim(shards, rank, rel, f"rank {rank}")
            manifest.files.append(FileRecord(path=rel, size=size, role="data", ranks=[rank]))
            if "world" in m.groupdict():
                world = int(m.group("world"))
            if "step" in m.groupdict():
                step = int(m.group("step"))
        meta_step: int | None = None
        if (path / "metadata.json").is_file():
            try:
                meta = json.loads((path / "metadata.json").read_text())
            except (OSError, ValueError, RecursionError) as exc:
                raise CorruptFileError(f"metadata.json: not readable JSON ({exc})", path="metadata.json") from None
            if not isinstance(meta, dict):
                raise CorruptFileError("metadata.json: not a JSON object", path="metadata.json")
            if isinstance(meta.get("world_size"), int):
                world = meta["world_size"]
            if isinstance(meta.get("step"), int) and not isinstance(meta["step"], bool):
                step = meta_step = meta["step"]
        if world is not None and not 0 < world <= max(4 * len(shards), 1 << 16):
            raise CorruptFileError(
                f"{path}: world size {world:,} for {len(shards)} shard files is not plausible", path=str(path)
            )
        # without a world size, the ranks still run from 0 without a gap (the last one's absence
        # shows only as a sharded tensor's coverage gap)
        expect = world if world is not None else (max(shards) + 1 if shards else 0)
        if expect:
            missing = [r for r in range(expect) if r not in shards]
            if missing:
                said = f"{world}" if world is not None else f"at least {expect}"
                raise IncompleteCheckpointError(
                    f"{path}: {len(missing)} of {said} rank shards missing (ranks {', '.join(map(str, missing[:12]))})",
                    hint="a rank did not finish saving or its file was deleted; use another checkpoint",
                    path=str(path),
                    rule="missing-file",
                )
        replicas = ReplicaCounter()
        claims: dict[str, int] = {}
        loaded: dict[int, list[tuple[str, Any]]] = {}
        for rank, rel in sorted(shards.items()):
            archive, obj, _ = _pt.load(path, rel, ALLOWLIST)
            archive.close()
            loaded[rank] = leaves = flatten(obj if isinstance(obj, dict) else {"value": obj}, leaf=_sharded)
            claimed = next((v for k, v in leaves if k in ("step", "iteration", "global_step")), None)
            if isinstance(claimed, int) and not isinstance(claimed, bool):
                claims[rel] = claimed
        staged = any(_PATTERNS[2].match(rel) for rel in shards.values())
        renamed = _stage_numbering(loaded) if staged else {}
        for rank, leaves in loaded.items():
            for name, value in leaves:
                self._add(manifest, name, value, shards[rank], rank, replicas, renamed.get((rank, name), name))
        if renamed:
            manifest.extras["stage_numbering"] = (
                "each pipeline stage numbers its layers (and its optimizer's states and groups) from 0: "
                "names here number them across stages, in stage order"
            )
        dir_step = int(m.group(1)) if (m := _STEP_DIR.match(path.name)) else None
        if step is None:
            step = dir_step if dir_step is not None else find_step(manifest.items)
        if claims and meta_step is not None:  # the shards' own and metadata.json's: the step most give
            claims["metadata.json"] = meta_step
            counted = list(claims.values())
            step = max(counted, key=counted.count)
        manifest.step = step
        manifest.layout = Layout(world_size=world or len(shards))
        if claims:
            manifest.extras["step_claims"] = claims
        if out_of_order := _blocks_out_of_order(manifest, shards) or _stages_out_of_order(manifest, shards):
            manifest.extras["findings"] = [out_of_order]
        return manifest

    @staticmethod
    def _add(
        manifest: Manifest, name: str, value: Any, rel: str, rank: int, replicas: ReplicaCounter, key: str
    ) -> None:
        """Add leaf ``name`` of rank file ``rel`` as (a piece of) item ``key``."""
        if isinstance(value, _Sharded):
            ref = value.local
            box = Box(value.offset, ref.shape)
            if not box.within(value.shape):
                raise CorruptFileError(
                    f"{rel}: {name} local shard {list(ref.shape)} at {list(value.offset)} lies "
                    f"outside its global shape {list(value.shape)}",
                    path=rel,
                )
            item = manifest.items.get(key) or manifest.add(
                Item(name=key, kind=classify(key, is_tensor=True), dtype=ref.dtype, shape=value.shape)
            )
            if item.dtype != ref.dtype or item.shape != value.shape:
                raise CorruptFileError(
                    f"{rel}: {name} is {ref.dtype}{list(value.shape)} here, {item.dtype}"
                    f"{list(item.shape or ())} on another rank",
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
