"""DeepSpeed checkpoints: ZeRO stages 0-3, bf16 (BF16_Optimizer), pipeline layer files.

Read without importing DeepSpeed: its pickles name four classes, given inert stand-ins here
(``ZeroStageEnum``, ``LossScaler``, ``DynamicLossScaler``, ``fragment_address``). Names (see
``docs/formats/deepspeed.md``): module weights and buffers under their module names (kind
``param``); fp32 master weights ``<param>.fp32`` (kind ``master``) rebuilt from the flat
partitions; Adam moments ``<param>.exp_avg`` / ``<param>.exp_avg_sq`` (kind ``optim``).
"""

from __future__ import annotations

import math
import os
import re
import shlex
from collections import Counter, defaultdict
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpttool import _unpickle
from ckpttool.errors import (
    CkptError,
    CorruptFileError,
    IncompleteCheckpointError,
    UnsupportedError,
    name_from_above,
    raise_together,
)
from ckpttool.formats import _pt
from ckpttool.formats.base import Detection, claim
from ckpttool.geometry import Box, coverage, row_major_strides
from ckpttool.io import confine, escapes, list_files, read_tracker
from ckpttool.manifest import FileRecord, Item, Kind, Layout, Manifest, Piece, ReplicaCounter
from ckpttool.naming import MOMENTS, classify, plural
from ckpttool.values import flatten, same_value, set_value

SUBPARAM_SHAPE = "deepspeed.checkpoint.universal_checkpoint.SubparamShape"
"""the dataclass ds_to_universal saves with a parameter of sub-parameters (``sub_param_shape``)"""

ALLOWLIST: dict[tuple[str, str], Any] = {
    **_unpickle.PLAIN,
    **_unpickle.TORCH_TENSORS,
    **_unpickle.NAMESPACES,
    **_unpickle.numpy_arrays(),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"): _unpickle.enum("deepspeed.runtime.zero.config.ZeroStageEnum"),
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"): _unpickle.record(
        "deepspeed.runtime.fp16.loss_scaler.LossScaler"
    ),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"): _unpickle.record(
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"
    ),
    ("deepspeed.utils.tensor_fragment", "fragment_address"): _unpickle.record(
        "deepspeed.utils.tensor_fragment.fragment_address"
    ),
    ("deepspeed.checkpoint.universal_checkpoint", "SubparamShape"): _unpickle.record(SUBPARAM_SHAPE),
}
"""The globals DeepSpeed 0.19 pickles (research/deepspeed.md §1.4; ``SubparamShape`` in a universal
checkpoint), as stand-ins."""

_MODEL = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_Z3_MODEL = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_OPTIM = re.compile(r"^(bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_LAYER = re.compile(r"^layer_(\d+)(?:-model_(\d+))?-model_states\.pt$")
_EXPERT_FILE = re.compile(
    r"^(layer_\d+_expert_\d+_mp_rank_\d+_model_states|expp_rank_\d+_mp_rank_\d+_optim_states)\.pt$"
)
"""an MoE layer's expert weights (one file per expert), and the optimizer state of an expert-parallel
rank when ZeRO is off (research/deepspeed.md 1.1)"""
RECOVERY_SCRIPTS = {"zero_to_fp32.py", "zero_to_torch.py"}
"""the scripts DeepSpeed copies beside every save it writes (its files, not the run's)"""
_RESERVED = {
    "module",
    "buffer_names",
    "optimizer",
    "param_shapes",
    "frozen_param_shapes",
    "frozen_param_fragments",
    "shared_params",
    "lr_scheduler",
    "data_sampler",
    "random_ltd",
    "skipped_steps",
    "global_steps",
    "global_samples",
    "dp_world_size",
    "mp_world_size",
    "ds_config",
    "ds_version",
    "checkpoint_parallel_dimensions",
    "universal_checkpoint_info",
}


PER_RANK = "rank"
"""a TP split rule: the copies' relation is unknown; one item per TP rank, ``<param>[tp=R]``"""


@dataclass(frozen=True)
class Regions:
    """A TP split rule given region by region: the whole tensor's shape, each TP rank's copy's shape,
    and the regions of the whole tensor each copy holds, with the element of the (flattened) copy
    where each starts. A rank's regions are whole rows of its copy, in the order they come in the
    whole tensor (or the one region is the whole copy), so a copy is its regions stacked on dim 0.
    Made from an affine map, from sub-parameters (fused QKV, ``parameter_with_sub_params``) and
    from two sub-parameters on dim 0 (SwiGLU's gate and up projections)."""

    full: tuple[int, ...]
    shards: tuple[tuple[int, ...], ...]
    held: tuple[tuple[tuple[Box, int], ...], ...]


Rule = int | str | Regions | None


@dataclass(frozen=True)
class SubParams:
    """A ``parameter_with_sub_params`` pattern as ds_to_universal reads it: the dict holding it
    (``SubparamShape``'s fields), the dim the sub-parameters are fused on, their sizes on it (a
    tuple, or an int: a count of equal ones; None where ds_to_universal cannot read them) and, from
    universal version 0.4, their recorded widths on each TP rank (before it: None, equal slices)."""

    pattern: str
    spec: dict[str, Any]
    dim: int
    sizes: tuple[int, ...] | int | None
    widths: Any


def _strides_match(shape: tuple[int, ...], got: tuple[int, ...], want: tuple[int, ...]) -> bool:
    """Whether ``got`` walks a tensor of ``shape`` as ``want`` does (a dim of size 1 has no stride to keep)."""
    return len(got) == len(shape) and all(n == 1 or g == w for n, g, w in zip(shape, got, want, strict=True))


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list | tuple) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise TypeError(f"{what} holds {str(value)[:80]}, not a list of ints")
    return tuple(value)


def _rows_rule(full: tuple[int, ...], held: list[list[tuple[Box, int]]]) -> Regions | None:
    """``held`` (each rank's regions, in the order of its copy) as :class:`Regions`, or None when a
    copy is not its regions stacked on dim 0 in the whole tensor's order."""
    shards = []
    for regions in held:
        regions = [(b, f) for b, f in regions if b.volume]  # a rank may hold none of an uneven sub-parameter
        if not regions:
            return None
        if len(regions) == 1:
            box, first = regions[0]
            if first:
                return None
            shards.append(box.sizes)
            continue
        rest = regions[0][0].sizes[1:]
        row = math.prod(rest)
        at = 0
        for box, first in regions:
            if box.sizes[1:] != rest or any(box.offsets[1:]) or first != at * row:
                return None
            at += box.sizes[0]
        if [b.offsets[0] for b, _ in regions] != sorted(b.offsets[0] for b, _ in regions):
            return None
        shards.append((at, *rest))
    return Regions(full, tuple(shards), tuple(tuple((b, f) for b, f in regions if b.volume) for regions in held))


def affine_regions(entry: Any, tp: int) -> Regions | None:
    """An affine map of DeepSpeed's (``affine_map.params[pattern]``: for each TP rank the pieces of
    the whole tensor its copy holds, each a strided view on both sides, with a scale) as
    :class:`Regions`, or None when the map says something regions cannot: a scaled piece (a bias
    pre-divided by the TP size), a piece that is not a box of the whole tensor or not contiguous in
    the copy, ranks other than 0 … TP-1. Raises TypeError for a map that is not one."""
    if not isinstance(entry, dict) or not isinstance(entry.get("ranks"), dict):
        raise TypeError(f"an affine map holds {str(entry)[:80]}, not logical_shape and ranks")
    full = _ints(entry.get("logical_shape"), "affine_map logical_shape")
    # DeepSpeed's from_dict takes int(rank): a map that went through JSON has string keys
    ranks = {int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in entry["ranks"].items()}
    if set(ranks) != set(range(tp)) or len(ranks) != len(entry["ranks"]) or min(full, default=1) < 1:
        return None  # other ranks than the TP axis's; an empty tensor (nothing to place)
    whole = row_major_strides(full)
    held: list[list[tuple[Box, int]]] = []
    shards: list[tuple[int, ...]] = []
    for t in range(tp):
        value = ranks[t]
        if not isinstance(value, dict) or not isinstance(value.get("pieces"), list | tuple):
            raise TypeError(f"affine_map rank {t} holds {str(value)[:80]}, not shard_shape and pieces")
        shard = _ints(value.get("shard_shape"), "affine_map shard_shape")
        regions = []
        for piece in value["pieces"]:
            if not isinstance(piece, dict):
                raise TypeError(f"affine_map piece {str(piece)[:80]}")
            shape = _ints(piece.get("shape"), "affine_map piece shape")
            src, dest = piece.get("source"), piece.get("dest")
            if not (
                isinstance(src, list | tuple) and len(src) == 2 and isinstance(dest, list | tuple) and len(dest) == 2
            ):
                raise TypeError(f"affine_map piece source/dest {str(piece)[:80]}")
            src_off, src_strides = _ints((src[0],), "source offset")[0], _ints(src[1], "source strides")
            dest_off, dest_strides = _ints((dest[0],), "dest offset")[0], _ints(dest[1], "dest strides")
            if piece.get("scale", 1.0) != 1.0 or len(shape) != len(full) or len(shard) != len(full):
                return None
            if not math.prod(shape):
                continue  # a rank holding none of an uneven sub-parameter
            if not _strides_match(shape, src_strides, whole) or not _strides_match(
                shape, dest_strides, row_major_strides(shape)
            ):
                return None
            corner = tuple((src_off // w) % n if n else 0 for w, n in zip(whole, full, strict=True))
            box = Box(corner, shape)
            if (
                sum(o * w for o, w in zip(corner, whole, strict=True)) != src_off
                or not box.within(full)
                or dest_off < 0
            ):
                return None
            regions.append((box, dest_off))
        if sum(b.volume for b, _ in regions) != math.prod(shard):  # DeepSpeed's validate() refuses it too
            raise TypeError(
                f"affine_map rank {t}'s pieces hold {sum(b.volume for b, _ in regions)} elements, "
                f"its shard_shape {list(shard)} {math.prod(shard)}"
            )
        regions.sort(key=lambda r: r[1])
        held.append(regions)
        shards.append(shard)
    tiling = coverage(full, {b for regions in held for b, _ in regions})
    if not tiling.exact or any(coverage(full, [b for b, _ in regions]).overlapping for regions in held):
        # DeepSpeed's validate_coverage refuses it too: the whole tensor cannot be made from it
        raise TypeError(
            f"affine_map of a {list(full)} tensor: its pieces leave {tiling.gaps} elements uncovered, "
            f"{tiling.overlapping} held by pieces that only partly overlap, or a rank holds rows twice"
        )
    rule = _rows_rule(full, held)
    return rule if rule is not None and rule.shards == tuple(shards) else None


def sub_param_regions(
    shape: tuple[int, ...], dim: int, sizes: tuple[int, ...] | int | None, widths: Any, tp: int
) -> Regions | None:
    """Sub-parameters fused on dim ``dim`` (q, k and v; a gate and an up projection), each split over
    the TP ranks, rank t's copy (of ``shape``) holding its slice of each in turn: ``widths[s][t]``
    rows of sub-parameter s (None: equal slices of the sub-parameters' ``sizes``, or of ``sizes``
    equal sub-parameters when it is an int). None where it is not rows of dim 0 or the numbers do
    not add up."""
    if dim != 0 or not shape:
        return None
    if isinstance(sizes, int):  # a count of equal sub-parameters (before version 0.4: no widths)
        if sizes < 1 or (shape[0] * tp) % sizes:
            return None
        sizes = (shape[0] * tp // sizes,) * sizes
    if widths is None:
        if sizes is None:
            return None
        if any(size % tp for size in sizes):
            return None
        widths = [[size // tp] * tp for size in sizes]
    if not isinstance(widths, list | tuple) or not widths:
        raise TypeError(f"sub_param_shard_widths holds {str(widths)[:80]}, not a list of lists")
    rows = [_ints(w, "sub_param_shard_widths") for w in widths]
    if any(len(w) != tp or min(w) < 0 for w in rows):
        return None
    if sizes is not None and (len(sizes) != len(rows) or any(sum(w) != n for w, n in zip(rows, sizes, strict=True))):
        return None
    rest = shape[1:]
    per_row = math.prod(rest)
    full = (sum(sum(w) for w in rows), *rest)
    held: list[list[tuple[Box, int]]] = []
    for t in range(tp):
        regions, start, at = [], 0, 0
        for w in rows:
            regions.append((Box((start + sum(w[:t]), *(0,) * len(rest)), (w[t], *rest)), at * per_row))
            at += w[t]
            start += sum(w)
        held.append(regions)
    return _rows_rule(full, held)


class TpRules:
    """How the copies of a parameter on the ranks of a tensor-parallel axis make the whole tensor.
    DeepSpeed records no split rule of its own; Megatron-DeepSpeed and AutoTP save the model's in
    ``universal_checkpoint_info``: the regular expressions by which ``ds_to_universal`` merges TP
    slices (research/deepspeed.md §2.2), and AutoTP an affine map per parameter, which supersedes
    them. :meth:`rule` follows them as ds_to_universal does, in its order: an affine map places each
    rank's pieces; replicated patterns are replicas; two sub-parameters on dim 0 (SwiGLU's fused
    gate and up projections) and sub-parameters by ``parameter_with_sub_params`` (fused QKV, with
    ``sub_param_shard_widths`` when uneven) are joined sub-parameter by sub-parameter; row-parallel
    ones are joined on dim 1, the rest on dim 0 (vocabulary parameters keep their padding rows).
    Averaged parameters (copies that may differ, which ds_to_universal averages), parameters AutoTP
    could not describe, and maps that regions cannot express (a scaled piece) are not joined: their
    copies, like every copy when there is no ``universal_checkpoint_info``, stay one item per TP
    rank (``PER_RANK``)."""

    def __init__(self, raw: Any, tp: int, rel: str) -> None:
        self.tp = tp
        self.rel = rel
        self.info: dict[str, Any] | None = raw if isinstance(raw, dict) else None
        self.compiled: dict[str, list[re.Pattern[str]]] = {}
        self.maps: list[Regions | None] = []
        """each affine map's regions (None: not expressible), in the order of ``compiled["affine"]``"""
        self.subs: list[SubParams] = []
        """each sub-parameter pattern, in the order of ``compiled["sub-parameters"]``"""
        self.copy_shapes: dict[str, dict[int, tuple[int, ...]]] = {}
        """each module tensor's shape on each TP rank (:meth:`note_copies`)"""
        if self.info is not None:
            try:
                self._compile(self.info)
            except (re.error, TypeError) as e:
                raise CorruptFileError(
                    f"{rel}: universal_checkpoint_info is not the split rules (regular expressions, maps) "
                    f"ds_to_universal reads ({e})",
                    path=rel,
                    hint="the file was damaged, or written by a tool that spells the model's split rules its own way",
                ) from None

    def _compile(self, info: dict[str, Any]) -> None:
        def patterns(key: str, value: Any) -> list[str]:
            if not isinstance(value, list | tuple) or not all(isinstance(p, str) for p in value):
                raise TypeError(f"{key} holds {str(value)[:120]}, not a list of strings")
            return list(value)

        for key in (
            "tp_replicated_parameter_patterns",
            "parameter_to_average_patterns",
            "parameter_with_2_sub_params_cat_dim_0",
            "parameter_with_row_parallelism_patterns",
            "vocabulary_parameter_patterns",
        ):
            self.compiled[key] = [re.compile(p) for p in patterns(key, info.get(key) or [])]
        widths = info.get("sub_param_shard_widths") or {}
        if not isinstance(widths, dict):
            raise TypeError(f"sub_param_shard_widths holds {str(widths)[:120]}, not a dict")
        version = info.get("universal_checkpoint_version", 0.0)
        self.recorded_widths = isinstance(version, int | float) and not isinstance(version, bool) and version >= 0.4
        """version 0.4 on: sub-parameters are cut by their recorded widths, and only by them
        (ds_to_universal reads the widths from that version on, and an even split before it)"""
        subs: list[str] = []
        for sub in _sub_param_dicts(info.get("parameter_with_sub_params")):
            spec, dim = sub.get("shape"), sub.get("partition_dim")
            sizes: tuple[int, ...] | int | None = None
            if isinstance(spec, list | tuple) and isinstance(dim, int) and 0 <= dim < len(spec):
                at = spec[dim]
                sizes = _ints(at, "parameter_with_sub_params shape") if isinstance(at, list | tuple) else None
                if isinstance(at, int) and not isinstance(at, bool):
                    sizes = at  # a count of equal sub-parameters
            for p in patterns("parameter_with_sub_params.patterns", sub.get("patterns") or []):
                subs.append(p)
                readable = not self.recorded_widths or (p in widths and isinstance(sizes, tuple))
                self.subs.append(  # one ds_to_universal fails on has no rule (one item per TP rank)
                    SubParams(
                        p,
                        sub,
                        dim if isinstance(dim, int) else -1,
                        sizes if readable else None,
                        widths.get(p) if self.recorded_widths else None,
                    )
                )
        self.compiled["sub-parameters"] = [re.compile(p) for p in subs]
        unsupported = info.get("autotp_unsupported_parameter_patterns") or {}
        if not isinstance(unsupported, dict):
            raise TypeError(f"autotp_unsupported_parameter_patterns holds {str(unsupported)[:120]}, not a dict")
        self.compiled["unsupported"] = [re.compile(p) for p in patterns("unsupported", list(unsupported))]
        affine = info.get("affine_map")
        params = affine.get("params") if isinstance(affine, dict) else None
        maps = params if isinstance(params, dict) else {}
        self.compiled["affine"] = [re.compile(p) for p in patterns("affine_map.params", list(maps))]
        version = affine.get("version", 1) if isinstance(affine, dict) else 1
        known = isinstance(version, int | float) and not isinstance(version, bool) and version <= 1
        # (a later map format may mean more than this reads)
        self.maps = [affine_regions(entry, self.tp) if known and self.tp > 1 else None for entry in maps.values()]

    def _matches(self, key: str, name: str) -> bool:
        return any(p.match(name) for p in self.compiled.get(key, ()))

    def _first(self, key: str, name: str) -> int | None:
        return next((i for i, p in enumerate(self.compiled.get(key, ())) if p.match(name)), None)

    def kind(self, name: str) -> str:
        """``name``'s category in the patterns, taken in ds_to_universal's order: "unsupported"
        (AutoTP could not describe it), "map" (an affine map, which supersedes the patterns),
        "replicated", "average" (copies averaged by ds_to_universal, kept apart here), "halves"
        (two sub-parameters on dim 0), "sub-parameters" (``parameter_with_sub_params``), "row"
        (joined on dim 1), "vocab" (a vocabulary parameter, joined on dim 0) or "default" (no
        pattern names it)."""
        for key, kind in self._ORDER:
            if self._matches(key, name):
                return kind
        return "vocab" if self.vocab(name) else "default"

    _ORDER = (
        ("unsupported", "unsupported"),
        ("affine", "map"),
        ("tp_replicated_parameter_patterns", "replicated"),
        ("parameter_to_average_patterns", "average"),
        ("parameter_with_2_sub_params_cat_dim_0", "halves"),
        ("sub-parameters", "sub-parameters"),
        ("parameter_with_row_parallelism_patterns", "row"),
    )
    """the pattern lists :meth:`kind` tries, in ds_to_universal's order, and the category each gives"""

    def vocab(self, name: str) -> bool:
        """Whether ``name`` is a vocabulary parameter (ds_to_universal cuts its padding rows)."""
        return self._matches("vocabulary_parameter_patterns", name)

    def sub_params(self, name: str) -> int | None:
        """The index of the first ``parameter_with_sub_params`` pattern naming ``name``, in the order
        the patterns come (one dict may hold several)."""
        return self._first("sub-parameters", name)

    def rule(self, name: str, shape: tuple[int, ...], trainable: bool = True) -> Rule:
        """None: the TP ranks' copies of ``name`` (each of ``shape``) are replicas; an int: TP slices
        joined along that dim; :class:`Regions`: placed region by region; ``PER_RANK``: unknown.
        Without a TP axis every copy is a replica. A parameter no pattern names is a slice on dim 0
        if the optimizer trains it (ds_to_universal's default); anything else (buffers, frozen
        weights) is joined only where a pattern says so."""
        if self.tp <= 1:
            return None
        if self.info is None:
            return PER_RANK
        kind = self.kind(name)
        regions: Regions | None = None
        if kind == "map":
            index = self._first("affine", name)
            regions = self.maps[index] if index is not None else None
        elif kind == "halves" and shape and shape[0] % 2 == 0:
            regions = sub_param_regions(shape, 0, None, [[shape[0] // 2] * self.tp] * 2, self.tp)
        elif kind == "sub-parameters":
            index = self.sub_params(name)
            if index is not None:
                sub = self.subs[index]
                try:
                    regions = sub_param_regions(shape, sub.dim, sub.sizes, sub.widths, self.tp)
                except TypeError as e:
                    raise CorruptFileError(
                        f"{self.rel}: universal_checkpoint_info's sub-parameters of {name}: {e}", path=self.rel
                    ) from None
        if kind in ("map", "halves", "sub-parameters"):
            return regions if regions is not None else PER_RANK
        if kind in ("unsupported", "average") or (kind == "default" and not trainable):
            return PER_RANK
        if kind == "replicated":
            return None
        dim = 1 if kind == "row" else 0
        if dim >= len(shape):
            return PER_RANK
        copies = self.copy_shapes.get(name, {})
        if set(copies) == set(range(self.tp)) and len(set(copies.values())) > 1:  # uneven: as torch.cat joins them
            return uneven_regions([copies[t] for t in range(self.tp)], dim) or PER_RANK
        return dim

    def note_copies(self, modules: dict[int, Any]) -> None:
        """Note the shape of each tensor of each TP rank's module (``modules``: TP rank -> its
        ``module`` dict), so that slices of uneven sizes (AutoTP splits 31 rows 16 + 15) are joined
        where the last one ends."""
        for t, module in modules.items():
            for name, value in module.items() if isinstance(module, dict) else ():
                if isinstance(value, _unpickle.TensorRef):
                    self.copy_shapes.setdefault(name, {})[t] = tuple(value.shape)


def uneven_regions(shapes: list[tuple[int, ...]], dim: int) -> Regions | None:
    """TP slices of ``shapes`` (one per rank) joined on ``dim`` as ``torch.cat`` joins them, or None
    when they differ elsewhere than on ``dim``."""
    rest = {s[:dim] + s[dim + 1 :] for s in shapes}
    if len(rest) != 1 or any(len(s) <= dim for s in shapes):
        return None
    full = list(shapes[0])
    full[dim] = sum(s[dim] for s in shapes)
    held, at = [], 0
    for s in shapes:
        held.append(((Box(tuple(at if d == dim else 0 for d in range(len(s))), s), 0),))
        at += s[dim]
    return Regions(tuple(full), tuple(shapes), tuple(held))


def parallel_degree(model_states: Any, key: str) -> int | None:
    """``checkpoint_parallel_dimensions[key]`` (``tp_degree``, ``pp_degree``) of a model-states
    file, when it is a positive int."""
    dims = model_states.get("checkpoint_parallel_dimensions") if isinstance(model_states, dict) else None
    value = dims.get(key) if isinstance(dims, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _sub_param_dicts(value: Any) -> list[dict[str, Any]]:
    """``parameter_with_sub_params``: a list of dicts (``SubparamShape`` fields), or nothing."""
    if value is None:
        return []
    if not isinstance(value, list | tuple) or not all(isinstance(d, dict) for d in value):
        raise TypeError(f"parameter_with_sub_params holds {str(value)[:120]}, not a list of dicts")
    return list(value)


def _check_tag_name(tag: str, tracker: str) -> None:
    """A tracker holding control characters (NUL, line breaks inside it) was overwritten or
    damaged: said as such, not as a path out of the checkpoint."""
    if any(ord(c) < 32 or ord(c) == 127 for c in tag):
        raise CorruptFileError(
            f"{tracker}: holds {tag[:60]!r}, not a tag name (control characters): the file is damaged",
            hint=f"write the name of the save's tag directory into '{tracker}', or verify the tag directory itself",
            path=tracker,
            rule="incomplete-save",
        )


def _roundabout_tag(path: Path, tag: str, tracker: str) -> str | None:
    """The one folder a tag spelt with ``..`` (``global_step3/../global_step3``) leads to when its
    spelling stays in the save directory: the folder DeepSpeed opens, by its plain name; refused when
    it leads to none; None for a spelling that leaves the directory (refused as such by the caller)."""
    spelt = tag.replace("\\", "/")
    plain = os.path.normpath(spelt)
    if spelt.startswith("/") or plain in (".", "..") or "/" in plain or plain.startswith(".."):
        return None
    full, named = os.path.join(path, spelt), os.path.join(path, plain)
    try:
        same = os.path.isdir(full) and os.path.samefile(full, named)
    except OSError:
        same = False
    if not same:
        raise IncompleteCheckpointError(
            f"{tracker} names tag {tag[:60]!r}, which leads to no tag directory of {path} "
            "(DeepSpeed joins it to the save directory and could not open it either)",
            hint=f"write the plain name of the save's tag directory (e.g. {plain}) into '{tracker}'",
            path=tracker,
        )
    return plain


def _tracked_tag(path: Path, tracker: str) -> str:
    """The tag named by the tracker file ``tracker`` (``latest``, ``latest_universal``) of the save
    directory ``path``: one folder name, a trailing slash allowed (DeepSpeed joins the text to the
    save directory as it is, so ``global_step3/`` resumes as well)."""
    tag = read_tracker(path, tracker)
    _check_tag_name(tag, tracker)
    if tag and escapes(tag):  # DeepSpeed joins it to the save directory and reads wherever it leads
        tag = _roundabout_tag(path, tag, tracker) or tag
    if tag and escapes(tag):
        confine(path, tag, named_by=tracker, kind="tag directory", holder=tracker)
    name = tag.rstrip("/\\") or tag
    if not name or "/" in name or "\\" in name or name in (".", ".."):
        raise CorruptFileError(
            f"{tracker}: names {tag[:60]!r}, not a tag directory",
            hint=f"write the name of the save's tag directory (e.g. global_step100) into '{tracker}'",
            path=tracker,
        )
    confine(path, name, named_by=tracker)  # a tag folder linked out of the save directory
    return name


def _tag_dir(path: Path) -> tuple[Path, Path]:
    """(save dir, tag dir) for a save directory with ``latest`` or a tag directory itself."""
    if (path / "latest").is_file():
        tag = _tracked_tag(path, "latest")
        target = path / tag
        if not target.is_dir():
            raise IncompleteCheckpointError(
                f"latest names tag {tag!r} but {tag}/ does not exist in {path}",
                hint="the save was interrupted or the tag was deleted; pass an existing global_step* directory",
                path="latest",
            )
        return path, target
    if path.name in ("", ".", ".."):  # "." has no parent of its own: name the folder
        path = Path(os.path.abspath(path))
    return path.parent, path


def flat_moments(gstate: Any, fp32: Any) -> dict[str, _unpickle.TensorRef]:
    """The per-element state a ZeRO-1/2/3 partition's optimizer keeps beside its flat fp32 master
    (``gstate``: the base optimizer's state of the partition): every flat tensor at least as long
    as the master, whatever the optimizer calls it: Adam's ``exp_avg`` and ``exp_avg_sq``, SGD's
    ``momentum_buffer``, Adagrad's ``sum``, RMSprop's ``square_avg`` (only Adam's were read: SGD's
    momentum went unseen by every command, diff included). DeepSpeed 0.19 cuts the alignment
    padding off the master and Adam's moments of a ZeRO-1/2 save, not off SGD's momentum: that one
    is longer by the padding, which lies at its end."""
    if not isinstance(gstate, dict) or not isinstance(fp32, _unpickle.TensorRef) or len(fp32.shape) != 1:
        return {}
    return {
        k: v
        for k, v in gstate.items()
        if isinstance(k, str)
        and k != "step"
        and isinstance(v, _unpickle.TensorRef)
        and len(v.shape) == 1
        and v.shape[0] >= fp32.shape[0]
    }


def _zero0_names(first: dict[str, Any], groups: list[Any], state: dict[Any, Any]) -> dict[Any, str] | None:
    """Parameter names for a ZeRO-0 torch optimizer state (which keeps only indices)."""
    module = first.get("module") or {}
    skip = set(first.get("buffer_names") or []) | set((first.get("shared_params") or {}).keys())
    order = [(n, v.shape) for n, v in module.items() if n not in skip and isinstance(v, _unpickle.TensorRef)]
    ids = _pt.match_param_ids(order, groups, state)
    return {pid: name for pid, (name, _, _) in ids.items()} if ids is not None else None


def _is_universal(path: Path) -> bool:
    zero = path / "zero"
    return zero.is_dir() and any((d / "fp32.pt").is_file() for d in zero.iterdir() if d.is_dir())


def _untracked_tags(path: Path) -> list[str]:
    """The DeepSpeed tag directories just below ``path`` (a save directory that lost its
    ``latest``), in the order a step count sorts them."""
    try:  # (scandir: a folder's type from the listing, no stat per entry of a 10 000-file checkpoint)
        with os.scandir(path) as entries:
            folders = [Path(e.path) for e in entries if e.is_dir(follow_symlinks=False)]
        tags = [c.name for c in folders if _is_tag_dir(c)]
    except OSError:
        return []
    return sorted(tags, key=lambda n: (int(m.group()) if (m := re.search(r"\d+$", n)) else -1, n))


def _is_tag_dir(path: Path) -> bool:
    return path.is_dir() and any(
        _MODEL.match(n) or _Z3_MODEL.match(n) or _LAYER.match(n) for n in (p.name for p in path.iterdir())
    )


class DeepSpeedAdapter:
    name = "deepspeed"

    def detect(self, path: Path) -> Detection:
        if not path.is_dir():
            return Detection(False, "not a directory")
        if (path / "latest").is_file():
            return Detection(True, "found a DeepSpeed 'latest' tag file")
        if _is_tag_dir(path):
            return Detection(True, "found *_model_states.pt files")
        if _is_universal(path) or (path / "latest_universal").is_file():
            return Detection(True, "found a universal checkpoint (zero/<param>/fp32.pt)")
        if _untracked_tags(path):
            return Detection(True, "found DeepSpeed tag directories but no 'latest' file", weak=True)
        return Detection(False, "no 'latest' file and no *_model_states.pt")

    def describe(self, path: Path) -> Manifest:
        if (path / "latest_universal").is_file() and not (path / "latest").is_file():
            tag = _tracked_tag(path, "latest_universal")
            if not (path / tag).is_dir():
                raise IncompleteCheckpointError(
                    f"latest_universal names {tag!r}, which is not a directory in {path}", path="latest_universal"
                )
            path = path / tag
            if _is_universal(path):
                try:
                    return self._describe_universal(path)
                except CkptError as exc:  # its files named from the save directory given
                    name_from_above([exc], path)
                    raise
        if _is_universal(path) and not (path / "latest").is_file():
            return self._describe_universal(path)
        if not (path / "latest").is_file() and not _is_tag_dir(path) and (tags := _untracked_tags(path)):
            shown = ", ".join(tags[:5]) + (f" and {len(tags) - 5} more" if len(tags) > 5 else "")
            tracker = "latest_universal" if _is_universal(path / tags[-1]) else "latest"
            raise IncompleteCheckpointError(
                f"{path} holds the DeepSpeed tag director{'ies' if len(tags) > 1 else 'y'} {shown} but no "
                f"'{tracker}' file, which DeepSpeed writes after a save's last file: the save did not finish, the "
                "file was deleted, or the run saved with save_latest=False",
                hint=f"if the save finished, verify the tag itself (ckpttool verify "
                f"{shlex.quote(str(path / tags[-1]))}) or write its name into '{tracker}'",
                path=tracker,
            )
        save_dir, tag_dir = _tag_dir(path)
        # given the save directory, the manifest covers its tracker and scripts and the tag named by
        # `latest` (not the other tags); given a tag directory, just that
        root = save_dir if (path / "latest").is_file() else tag_dir
        prefix = f"{tag_dir.name}/" if root == save_dir else ""
        manifest = Manifest(root=str(root), format=self.name)
        listing = [(prefix + rel, size) for rel, size in list_files(tag_dir, relative_to=root)]
        if prefix:
            listing += [(p.name, os.stat(confine(root, p.name)).st_size) for p in sorted(root.iterdir()) if p.is_file()]
        # (refused before any rank file is read)
        if experts := sorted(rel for rel, _ in listing if _EXPERT_FILE.match(rel.rsplit("/", 1)[-1])):
            raise UnsupportedError(
                f"{tag_dir}: a DeepSpeed MoE checkpoint ({plural(len(experts), 'expert file')}: {experts[0]}"
                f"{' …' if len(experts) > 1 else ''}), which ckpttool does not read yet: every command would leave "
                "the experts' weights and optimizer state out",
                hint="check it with DeepSpeed's own tools (zero_to_fp32, load_checkpoint) for now",
                path=experts[0],
            )
        files: dict[str, Any] = {}
        inner: dict[str, str] = {}  # the name torch.save gave the archive inside each file
        roles: list[FileRecord] = []
        stray: dict[str, str] = {}  # rank files outside the tag directory (DeepSpeed never reads those)
        damaged: list[CkptError] = []
        unread: list[str] = []  # rank files present but damaged (named in ``damaged``)
        for rel, size in listing:
            base = rel.rsplit("/", 1)[-1]
            ranked = bool(_MODEL.match(base) or _Z3_MODEL.match(base) or _OPTIM.match(base) or _LAYER.match(base))
            if base in ("latest", "latest_universal"):
                roles.append(FileRecord(path=rel, size=size, role="tracker"))
            elif base in RECOVERY_SCRIPTS or not ranked or rel != prefix + base:
                if ranked and base not in RECOVERY_SCRIPTS:
                    stray.setdefault(base, rel)
                roles.append(FileRecord(path=rel, size=size, role="aux"))
            else:
                if (loaded := _pt.load_or_note(root, rel, ALLOWLIST, damaged)) is None:
                    damaged[-1].rank = _file_rank(base)
                    unread.append(rel)
                    continue  # (and on to the next: each damaged rank file named, not the first)
                archive, obj, _ = loaded
                archive.close()
                files[rel] = obj
                inner[rel] = archive.prefix.rstrip("/")
                roles.append(FileRecord(path=rel, size=size, role="data"))
        if save_dir != tag_dir:
            manifest.extras["tag"] = tag_dir.name
        manifest.files = roles
        base_names = {rel: rel.rsplit("/", 1)[-1] for rel in [*files, *unread]}
        models: dict[int, str] = {}
        z3_models: dict[tuple[int, int], str] = {}
        optims: dict[tuple[int, int], str] = {}
        layers: dict[tuple[int, int], str] = {}
        for rel, base in base_names.items():
            if m := _MODEL.match(base):
                claim(models, int(m.group(1)), rel, f"model-parallel rank {int(m.group(1))}")
            elif m := _Z3_MODEL.match(base):
                dp, mp = int(m.group(1)), int(m.group(2))
                claim(z3_models, (dp, mp), rel, f"the model states of DP rank {dp}, MP rank {mp}")
            elif m := _OPTIM.match(base):
                dp, mp = int(m.group(2)), int(m.group(3))
                claim(optims, (dp, mp), rel, f"the optimizer states of DP rank {dp}, MP rank {mp}")
            elif m := _LAYER.match(base):
                key = (int(m.group(1)), int(m.group(2) or 0))
                claim(layers, key, rel, f"layer {key[0]} of MP rank {key[1]}")
        # the parameters the optimizer trains, by the model states read (each rank's its own at PP > 1)
        shapes_of = {
            n: tuple(s) if isinstance(s, list | tuple) else None
            for rel in models.values()
            for group in (files.get(rel, {}).get("param_shapes") or [])
            if isinstance(group, dict)
            for n, s in group.items()
        }
        if damaged:  # the rank files absent beside them named too, as far as the files read tell
            absent = _absent_beside_damage(tag_dir.name, prefix, files, (models, z3_models, optims), stray)
            absent += _absent_layer_files(tag_dir, prefix, layers, set(shapes_of))
            raise_together([*damaged, *absent])
        stage = self._stage(files, optims)
        if bf16_optimizer(files, optims):
            manifest.extras["variant"] = "BF16_Optimizer"
        dp_ranks = _check_rank_files(tag_dir.name, prefix, files, (models, z3_models, optims), stage, stray)
        first_model = files[models[min(models)]] if models else files[z3_models[min(z3_models)]] if z3_models else None
        if first_model is None:
            raise IncompleteCheckpointError(
                f"{tag_dir}: no mp_rank_*_model_states.pt or zero_pp_rank_*_model_states.pt",
                hint="the tag directory is incomplete",
                path=str(tag_dir),
            )
        mp_size = max(len(models), len({mp for _, mp in z3_models}), 1)
        dp_size = max((dp for dp, _ in optims), default=-1) + 1 or int(first_model.get("dp_world_size") or 1)
        tp = parallel_degree(first_model, "tp_degree")
        pp = parallel_degree(first_model, "pp_degree")
        if layers:
            tp = tp or max(t for _, t in layers) + 1
            pp = pp or mp_size // tp
        manifest.layout = Layout(
            world_size=dp_size * mp_size, dp=dp_size, tp=tp or (1 if not layers else None), pp=pp or 1, zero_stage=stage
        )
        tp_size = int(tp or 1)
        first_rel = models.get(0) or z3_models[min(z3_models)]
        b = _Builder(manifest, files, TpRules(first_model.get("universal_checkpoint_info"), tp_size, first_rel))
        if tp_size > 1 and mp_size == tp_size:
            b.rules.note_copies({mp: files[rel].get("module") for mp, rel in models.items()})
        if tp_size > 1:
            manifest.extras["tp_split"] = (
                "universal_checkpoint_info"
                if b.rules.info is not None
                else "unknown (no universal_checkpoint_info): one item per TP rank"
            )
        # module weights
        trainable = set(shapes_of)
        raise_together(_absent_layer_files(tag_dir, prefix, layers, trainable))
        if layers:
            b.layers(layers, shapes_of)
        for mp, rel in sorted(models.items()):
            module = files[rel].get("module")
            if isinstance(module, dict):
                for name, value in module.items():
                    b.module_value(name, value, rel, mp % tp_size, name in trainable, f"module.{name}")
        if z3_models:
            rel0 = z3_models[min(z3_models)]
            module = files[rel0].get("module") or {}
            buffers = set(files[rel0].get("buffer_names") or [])
            for name, value in module.items():
                if name in buffers:
                    b.tensor_or_object(name, value, rel0, "param", rank=0, path=f"module.{name}")
        # optimizer side
        if stage != 3:
            _check_stage_files(files, optims, models)
        for mp in sorted({mp for _, mp in optims}):
            ranks = sorted(dp for dp, m in optims if m == mp)
            model_rel = models.get(mp) or z3_models.get((0, mp)) or models.get(0)
            shapes = (files[model_rel] if model_rel else first_model).get("param_shapes") or []
            per_rank = [(dp, optims[(dp, mp)]) for dp in ranks]
            if stage == 3:
                b.zero3(per_rank, shapes, mp % tp_size, mp, dp_ranks)
            else:
                _check_zero12_ranks(files, per_rank, shapes, dp_ranks or len(per_rank))
                b.zero12(per_rank, shapes, mp % tp_size, mp)
        if staged := b.stage_copies():
            manifest.extras["stage_copies"] = staged
        if stage == 0 and not optims:
            opt = first_model.get("optimizer")
            if isinstance(opt, dict):
                b.zero0(opt, models[min(models)], first_model)
        b.frozen(stage, models, z3_models, first_model, dp_ranks)
        if frozen := _frozen(first_model, trainable):
            manifest.extras["frozen"] = frozen
        b.shared(_tied(files, [*(models[k] for k in sorted(models)), *(z3_models[k] for k in sorted(z3_models))]))
        b.common(first_model, models.get(0) or z3_models[min(z3_models)])
        # each rank's own client state: ZeRO-3's every rank saves its own model states file, a model-
        # parallel run each MP rank (ZeRO-0..2 write only DP rank 0's)
        holders: dict[str, tuple[str, int | None]] = (
            {f"rank={dp}" if not any(mp for _, mp in z3_models) else f"dp={dp},mp={mp}": (rel, dp)
             for (dp, mp), rel in sorted(z3_models.items())}
            if z3_models
            else {f"mp={mp}": (rel, None) for mp, rel in sorted(models.items())}
        )  # fmt: skip
        b.client_state(holders)
        manifest.format_version = str(first_model.get("ds_version") or "") or None
        steps = first_model.get("global_steps")
        manifest.step = steps if isinstance(steps, int) else None
        claims = {
            rel: files[rel]["global_steps"]
            for rel in [*models.values(), *z3_models.values()]
            if isinstance(files[rel].get("global_steps"), int)
        }
        if claims and (m := _STEP_TAG.fullmatch(tag_dir.name)):  # DeepSpeed's default tag names the step
            claims[f"{tag_dir.name}/"] = int(m.group(1))
        manifest.extras["step_claims"] = claims
        cfg = first_model.get("ds_config")
        if isinstance(cfg, dict):
            manifest.extras["ds_config"] = {k: v for k, v in flatten(cfg) if isinstance(v, int | float | str | bool)}
        for (dp, _mp), rel in optims.items():
            manifest.file(rel).ranks = [dp]  # (its DP rank, as its name and every finding about it give)
        if any(_dynamic_scaler(obj) for obj in files.values()):  # (no item holds it: only our writer carries it)
            manifest.extras.setdefault("unread_state", []).append("the fp16 loss scaler")
        # files whose content the checks above could not place: named by the archive inside them
        if renamed := _pt.saved_as(root, inner, {f.path: f.size for f in roles}):
            raise CorruptFileError(
                renamed[1],
                hint="put each file back under its own name, or restore the tag directory from the save",
                path=renamed[0],
                rule="misplaced-file",
                rank=_rel_rank(renamed[0]),
            )
        return manifest

    def _describe_universal(self, path: Path) -> Manifest:
        """ds_to_universal output: one folder per parameter under ``zero/`` holding the full fp32
        weight and moments (ZeRO-1/2: ``{'param': tensor, ...}``; ZeRO-3: a flat tensor), beside the
        source's model-states files (ZeRO-3: every rank's, with the frozen parameters' fragments)."""
        manifest = Manifest(root=str(path), format=self.name)
        manifest.extras["variant"] = "universal"
        files: dict[str, Any] = {}
        damaged: list[CkptError] = []  # every damaged or missing file named, not the first
        present: list[str] = []
        listing = list(list_files(path))
        folders = _param_folders(rel for rel, _ in listing)
        strays = _stray_universal_files(folders)
        for rel, size in listing:
            base = rel.rsplit("/", 1)[-1]
            role = "data" if rel.endswith(".pt") else ("tracker" if base.startswith("latest") else "aux")
            manifest.files.append(FileRecord(path=rel, size=size, role="aux" if rel in strays else role))  # type: ignore[arg-type]
            if rel in strays:  # not a state of the parameter: named below, never read
                continue
            present.append(rel)
            if rel.endswith(".pt") and (_MODEL.match(base) or _Z3_MODEL.match(base) or rel.startswith("zero/")):
                if (loaded := _pt.load_or_note(path, rel, ALLOWLIST, damaged)) is None:
                    damaged[-1].rank = _file_rank(base)
                    continue
                archive, obj, _ = loaded
                archive.close()
                files[rel] = obj
        z3 = {(int(m[1]), int(m[2])): r for r in present if (m := _Z3_MODEL.match(r))}  # copied from ZeRO-3
        models = {int(m[1]): r for r in present if (m := _MODEL.match(r))}
        if not models and not z3:  # DeepSpeed's universal load reads the step and client state there
            flat = any(not isinstance(files[r], dict) for r in files if r.startswith("zero/") and r.endswith("fp32.pt"))
            name = "zero_pp_rank_0_mp_rank_00_model_states.pt" if flat else "mp_rank_00_model_states.pt"
            damaged.append(
                IncompleteCheckpointError(
                    f"{name} is missing: ds_to_universal copies the source's model states beside zero/, and "
                    "DeepSpeed's universal load reads the step, the scheduler and the client state from them",
                    hint="copy the model-states file(s) from the source tag, or convert again with ds_to_universal",
                    path=name,
                    rule="missing-file",
                    rank=0,
                )
            )
        damaged += _absent_universal_files(present, files, z3)
        model_rel = models.get(min(models)) if models else (z3[min(z3)] if z3 else None)
        first = files.get(model_rel, {}) if model_rel else {}
        shapes = {n: tuple(s) for group in (first.get("param_shapes") or []) for n, s in group.items()}
        copied = [] if z3 else [*(first.get("frozen_param_shapes") or {}), *(first.get("shared_params") or {})]
        states = {p: {n for n in names if f"zero/{p}/{n}" not in strays} for p, names in folders.items()}
        raise_together([*damaged, *_absent_universal_states(path, states, shapes, copied)])
        # a TP run's universal checkpoint keeps every TP rank's model states: its module is joined
        # by the same rules as the source's
        tp = parallel_degree(first, "tp_degree") or (len(models) if not z3 else 1)
        b = _Builder(manifest, files, TpRules(first.get("universal_checkpoint_info"), tp, model_rel or ""))
        if tp > 1 and len(models) == tp:
            b.rules.note_copies({mp: files[rel].get("module") for mp, rel in models.items()})
        if z3 and model_rel and isinstance(first.get("module"), dict):
            buffers = set(first.get("buffer_names") or [])
            for name, value in first["module"].items():
                if name in buffers:  # ZeRO-3 modules hold empty placeholders for the parameters
                    b.tensor_or_object(name, value, model_rel, "param", rank=0, path=f"module.{name}")
        for mp, rel in sorted(models.items()):
            module = files[rel].get("module")
            if isinstance(module, dict):
                for name, value in module.items():
                    b.module_value(name, value, rel, mp % tp, name in shapes, f"module.{name}")
        cut = []
        for rel in sorted(files):
            parts = rel.split("/")
            if len(parts) != 3 or parts[0] != "zero":
                continue
            param, state = parts[1], parts[2].removesuffix(".pt")
            obj = files[rel]
            ref = obj.get("param") if isinstance(obj, dict) else obj
            if not isinstance(ref, _unpickle.TensorRef):
                continue
            name = f"{param}.{state}"
            kind: Kind = "master" if state == "fp32" else "optim"
            # ZeRO-1/2 files hold the whole tensor; ZeRO-3's are flat, shaped by param_shapes
            shape = shapes.get(param, ref.shape) if state != "step" and not isinstance(obj, dict) else ref.shape
            if isinstance(obj, dict) and obj.get("vocab_tensor") is True and state == "fp32":
                cut.append(param)
            item = b.item(name, kind, ref.dtype, shape)
            if ref.shape == shape:
                item.pieces.append(_pt.tensor_piece(rel, ref))
            else:  # ZeRO-3 universal files are flat
                numel = math.prod(shape)
                item.pieces.append(
                    _pt.tensor_piece(rel, ref, box=Box.whole(shape), start=0, numel=numel, flat=(0, numel))
                )
        if cut:
            manifest.extras["vocab_cut"] = cut
        if strays:
            manifest.extras.setdefault("findings", []).append(_stray_finding(strays))
        if z3:  # the frozen parameters' fragments are in every rank's model states, as in the source
            b.frozen(3, {}, z3, first)
            b.universal3_groups(_UNIVERSAL_OPTIM)
        else:
            b.universal_hyperparameters(_UNIVERSAL_OPTIM)
        b.shared(_tied(files, [*(models[k] for k in sorted(models)), *(z3[k] for k in sorted(z3))]))
        # frozen: what the source froze (ds_to_universal writes them an fp32.pt and no moments)
        if frozen := _frozen(first, shapes):
            manifest.extras["frozen"] = frozen
        if model_rel:
            b.common(first, model_rel)
            manifest.format_version = str(first.get("ds_version") or "") or None
            steps = first.get("global_steps")
            manifest.step = steps if isinstance(steps, int) else None
        # the run's model-parallel degrees (the model states are its TP ranks'); the DP size is chosen
        # at load time
        pp = parallel_degree(first, "pp_degree") or 1
        manifest.layout = Layout(world_size=None, tp=tp, pp=pp)
        return manifest

    @staticmethod
    def _stage(files: dict[str, Any], optims: dict[tuple[int, int], str]) -> int:
        if not optims:
            return 0
        rel = next(iter(optims.values()))
        kind = _optimizer_kind(files[rel])
        if kind is None:
            raise CorruptFileError(f"{rel}: no zero_stage in the optimizer state", path=rel)
        # BF16_Optimizer records no stage: it partitions the fp32 masters and the moments over DP as
        # ZeRO-1 does, whether its config says 1 (with fp32 gradient accumulation) or 0 (a pipeline
        # run without ZeRO)
        return 1 if kind == "BF16_Optimizer" else int(kind.removeprefix("ZeRO-"))

    def reader(self, manifest: Manifest) -> _pt.PtReader:
        return _pt.PtReader(manifest, ALLOWLIST)


def _absent_universal_files(
    present: list[str], files: dict[str, Any], z3: dict[tuple[int, int], str]
) -> list[CkptError]:
    """The files of a universal checkpoint that DeepSpeed's universal load cannot do without, found
    missing: ``zero/optimizer_state.pt`` (the param groups: learning rate, betas, weight decay,
    step), and, converted from ZeRO-3 (``z3``: its model-states files by DP and MP rank), every
    rank's model states, which hold that rank's fragments of the frozen parameters (as many ranks
    as their ``dp_world_size`` x ``mp_world_size`` record)."""
    out: list[CkptError] = []
    if _UNIVERSAL_OPTIM not in present and any(r.startswith("zero/") for r in present):
        out.append(
            IncompleteCheckpointError(
                f"{_UNIVERSAL_OPTIM} is missing: ds_to_universal writes the optimizer's param groups there "
                "(learning rate, betas, weight decay, step), and DeepSpeed's universal load stops without it",
                hint="copy it from another copy of this checkpoint, or convert again from the source checkpoint",
                path=_UNIVERSAL_OPTIM,
                rule="missing-file",
            )
        )
    if z3:
        some: dict[str, Any] = next((files[r] for r in z3.values() if isinstance(files.get(r), dict)), {})
        dp_n = max(_count(some.get("dp_world_size")) or 1, max(dp for dp, _ in z3) + 1)
        mp_n = max(_count(some.get("mp_world_size")) or 1, max(mp for _, mp in z3) + 1)
        if dp_n * mp_n <= _MAX_RANK_FILES:
            absent = [(dp, mp) for mp in range(mp_n) for dp in range(dp_n) if (dp, mp) not in z3]
            out += [
                IncompleteCheckpointError(
                    f"zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt is missing: a universal checkpoint "
                    f"converted from ZeRO-3 keeps every rank's model states (each holds its rank's fragments of "
                    f"the frozen parameters), and they record {dp_n} DP x {mp_n} MP rank(s)",
                    hint="copy the model-states files from the source tag, or convert again with ds_to_universal",
                    path=f"zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt",
                    rule="missing-file",
                    rank=dp,
                )
                for dp, mp in absent
            ]
    return out


_UNIVERSAL_OPTIM = "zero/optimizer_state.pt"


_UNIVERSAL_STATES = frozenset({"fp32.pt", "step.pt", *(f"{m}.pt" for m in MOMENTS)})
"""State files ds_to_universal writes in a parameter's folder, whatever the other folders hold"""
_DS_STATE_NAME = re.compile(r"(.+).pt")
"""the pattern DeepSpeed's universal load searches each name in a parameter's folder for: every
file it matches is loaded as a state (its dot matches any character)"""


def _param_folders(rels: Iterable[str]) -> dict[str, set[str]]:
    """The file names in each parameter's folder of a universal checkpoint (``zero/<param>/<name>``)."""
    held: dict[str, set[str]] = defaultdict(set)
    for rel in rels:
        parts = rel.split("/")
        if len(parts) == 3 and parts[0] == "zero":
            held[parts[1]].add(parts[2])
    return held


def _stray_universal_files(held: dict[str, set[str]]) -> set[str]:
    """Files in ``zero/<param>/`` (``held``: :func:`_param_folders`) that are not states of the
    parameter: any name that is neither one ds_to_universal writes (:data:`_UNIVERSAL_STATES`) nor
    a ``.pt`` file most parameter folders with optimizer state hold (an optimizer's own states). A
    stray file in one folder is not a state every other folder lacks."""
    trained = [names for names in held.values() if any(n.endswith(".pt") and n != "fp32.pt" for n in names)]
    count = Counter(n for names in trained for n in names)
    states = _UNIVERSAL_STATES | {n for n, c in count.items() if n.endswith(".pt") and 2 * c > len(trained)}
    return {f"zero/{param}/{name}" for param, names in held.items() for name in names if name not in states}


def _stray_finding(strays: set[str]) -> dict[str, Any]:
    """An ``extra-file`` warning naming the stray files of parameter folders; those DeepSpeed's
    universal load would take for states (:data:`_DS_STATE_NAME`) first."""
    loaded = [rel for rel in strays if _DS_STATE_NAME.search(rel.rsplit("/", 1)[-1])]
    named = sorted(strays, key=lambda rel: (rel not in loaded, rel))
    listed = ", ".join(named[:4]) + (f" and {len(named) - 4} more" if len(named) > 4 else "")
    why = (
        f"; DeepSpeed's universal load reads every file of a parameter's folder whose name matches "
        f"{_DS_STATE_NAME.pattern!r} as one of its states, and would load {len(loaded)} of them"
        if loaded
        else ""
    )
    return {
        "rule": "extra-file",
        "severity": "warning",
        "file": named[0],
        "message": f"{plural(len(strays), 'file')} in parameter folders that ds_to_universal does not write and "
        f"most parameters' folders lack: {listed}; ckpttool reads none of them{why}",
        "hint": "move them out of zero/ (a parameter's folder holds only its fp32.pt and optimizer states)",
        "stops_writes": False,
    }


def _absent_universal_states(
    path: Path, held: dict[str, set[str]], shapes: dict[str, tuple[int, ...]], copied: Iterable[str]
) -> list[CkptError]:
    """ds_to_universal writes, for every trained parameter (``param_shapes``), a ``zero/<name>/``
    folder with its fp32 weight and the same optimizer states as the others, and (ZeRO-1/2) an
    ``fp32.pt`` copied from the module for every parameter without optimizer state (``copied``:
    frozen parameters, tied aliases): one absent is a deleted or unfinished file, not a parameter
    without state. ``held``: the states found in each parameter's folder (:func:`_param_folders`,
    stray files left out)."""
    # (without the model states' param_shapes: the folders holding optimizer state are the trained ones)
    trained = list(shapes) or [n for n, h in held.items() if h - {"fp32.pt"}]
    states = {"fp32.pt"}.union(*(held[n] for n in trained if n in held))
    absent = [f"zero/{n}/{st}" for n in trained for st in sorted(states) if st not in held.get(n, ())]
    absent += [f"zero/{n}/fp32.pt" for n in copied if n not in shapes and "fp32.pt" not in held.get(n, ())]
    return _absent_files(
        path,
        absent,
        "universal state",
        "every trained parameter has the same files, and every other one its fp32.pt",
        "ds_to_universal did not finish or a file was deleted; convert again from the source checkpoint",
    )


def _absent_files(where: Path, absent: list[str], what: str, why: str, hint: str) -> list[CkptError]:
    """Files the format implies but no metadata lists, found missing: one ``missing-file`` error
    each (``absent``: their paths in the manifest), the first saying how many and why."""
    return [
        IncompleteCheckpointError(
            f"{rel} is missing"
            + (f": {where.name} lacks {len(absent)} {what} file(s) ({why})" if i == 0 else f" ({what} file)"),
            hint=hint,
            path=rel,
            rule="missing-file",
            rank=_rel_rank(rel),
        )
        for i, rel in enumerate(absent)
    ]


_MAX_RANK_FILES = 1 << 22
"""more (DP x MP) rank files than this: the counts recorded are damaged, not a layout"""


def _count(value: Any) -> int | None:
    """``value`` when it is a positive int (a rank count as DeepSpeed records it), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _partition_count(optim: Any) -> int | None:
    """The DP ranks a ZeRO optimizer file says its state was partitioned over: ``partition_count``,
    an int at ZeRO-3, one per param group at ZeRO-1/2 and in BF16_Optimizer (the largest: an MoE
    model's expert groups count fewer), DeepSpeed's ``dist.get_world_size(dp_process_group)``, the
    group whose rank names the file. None when the file records none that reads as one."""
    value = _osd_entry(optim, "partition_count")
    if isinstance(value, list | tuple):
        counts = [c for v in value if (c := _count(v)) is not None]
        return max(counts) if counts and len(counts) == len(value) else None
    return _count(value)


def _optimizer_kind(optim: Any) -> str | None:
    """What wrote a ZeRO optimizer file: ``ZeRO-N`` (its ``zero_stage``) or ``BF16_Optimizer`` (none,
    flat fp32 partitions); None when its state says neither (damaged: left to the other checks)."""
    osd = optim.get("optimizer_state_dict") if isinstance(optim, dict) else None
    if not isinstance(osd, dict):
        return None
    stage = osd.get("zero_stage")
    if isinstance(stage, _unpickle.EnumValue):
        return f"ZeRO-{stage.value}"
    return "BF16_Optimizer" if "zero_stage" not in osd and "single_partition_of_fp32_groups" in osd else None


def _check_one_run(files: dict[str, Any], optims: dict[tuple[int, int], str]) -> None:
    """Every optimizer file was written by the same optimizer as the others (its ZeRO stage, or
    BF16_Optimizer) and with the alignment paddings of the first of its model-parallel rank: a rank
    file of another run dropped into the tag directory is named, where reading it as this run's
    would cut its partitions wrong. (DeepSpeed 0.19 saves the same state keys on every rank, but a
    key's name is not compared: a flipped bit in one is damage, which the CRC-32 checks name.)"""
    ranks = sorted(optims.items(), key=lambda kv: (kv[0][1], kv[0][0]))  # MP rank, then DP rank
    known = [(rel, kind) for _, rel in ranks if (kind := _optimizer_kind(files[rel])) is not None]
    first_of: dict[int, str] = {}
    for (_dp, mp), rel in ranks:
        kind, ref = _optimizer_kind(files[rel]), first_of.setdefault(mp, rel)
        if kind is not None and known and kind != known[0][1]:
            why = f"{kind}'s optimizer state where {known[0][0]} holds {known[0][1]}'s"
        elif _paddings(files[rel]) != _paddings(files[ref]):
            why = f"other param_alignment_paddings than {ref}, of the same model-parallel rank"
        else:
            continue
        raise CorruptFileError(
            f"{rel}: {why}: a file of another run or configuration is in this tag directory (or damaged: "
            "'ckpttool verify' checks its CRC-32s)",
            hint="restore the tag directory from one save (DeepSpeed would load it and train on wrong state)",
            path=rel,
            rule="misplaced-file",
            rank=_rel_rank(rel),
        )


def _osd_entry(optim: Any, key: str) -> Any:
    """``optimizer_state_dict[key]`` of a ZeRO optimizer file, None where the file holds no such thing."""
    osd = optim.get("optimizer_state_dict") if isinstance(optim, dict) else None
    return osd.get(key) if isinstance(osd, dict) else None


def _paddings(optim: Any) -> Any:
    return _osd_entry(optim, "param_alignment_paddings")


def _slice_mappings(optim: Any) -> Any:
    return _osd_entry(optim, "param_slice_mappings")


def bf16_optimizer(files: dict[str, Any], optims: dict[Any, str]) -> bool:
    """Whether the optimizer files are DeepSpeed's BF16_Optimizer's (bf16 + ZeRO-1 with fp32
    gradient accumulation, or bf16 + pipeline without ZeRO): ZeRO-1's partitions, saved with their
    padding, and no ``zero_stage``."""
    return bool(optims) and _optimizer_kind(files[next(iter(optims.values()))]) == "BF16_Optimizer"


RankFiles = tuple[dict[int, str], dict[tuple[int, int], str], dict[tuple[int, int], str]]
"""A tag directory's rank files by rank: model states by MP rank, ZeRO-3 model states and optimizer
files by (DP, MP) rank."""


def _is_bf16(config: Any) -> bool:
    """Whether a saved ``ds_config`` enables bf16 (DeepSpeed then names optimizer files ``bf16_…``)."""
    if not isinstance(config, dict):
        return False
    section = config.get("bf16", config.get("bfloat16"))
    return isinstance(section, dict) and section.get("enabled") is True


def _check_rank_files(
    tag: str, prefix: str, files: dict[str, Any], maps: RankFiles, stage: int, stray: dict[str, str]
) -> int | None:
    """Every rank file the save wrote is here (:func:`_absent_rank_files`), and no DP rank beyond
    those it had, the optimizer files all of one run. Returns the DP size the optimizer files are
    partitioned over (None: no partitioned optimizer)."""
    _, z3_models, optims = maps
    recorded = {rel: n for _, rel in sorted(optims.items()) if (n := _partition_count(files[rel])) is not None}
    if len(set(recorded.values())) > 1:
        (a, x), *rest = recorded.items()
        b, y = next((r, n) for r, n in rest if n != x)
        raise CorruptFileError(
            f"{b}: records partition_count {y} (its DP size) where {a} records {x}: "
            "optimizer files of saves at two DP sizes are mixed in one tag directory",
            hint="restore the tag directory from one save (DeepSpeed's zero_to_fp32 refuses it too)",
            path=b,
            rule="misplaced-file",
            rank=_rel_rank(b),
        )
    _check_one_run(files, optims)
    pc = next(iter(recorded.values()), None)
    if pc is not None and (extra := sorted(k for k in [*optims, *z3_models] if k[0] >= pc)):
        rel = optims.get(extra[0]) or z3_models[extra[0]]
        raise CorruptFileError(
            f"{rel}: DP rank {extra[0][0]}'s file, but the optimizer files record {pc} DP ranks "
            f"(partition_count {pc} in {next(iter(recorded))}): a file left from a save at a larger DP size",
            hint="remove the files of DP ranks the save did not have, or restore the tag directory from one save "
            "(DeepSpeed's zero_to_fp32 refuses it too)",
            path=rel,
            rule="misplaced-file",
            rank=_rel_rank(rel),
        )
    dp_size, partitioned, absent = _absent_rank_files(tag, prefix, files, maps, stage, stray)
    raise_together(absent)
    _check_rank0_file(files, maps[0], z3_models)
    return dp_size if partitioned else None


def _rel_rank(rel: str) -> int | None:
    """:func:`_file_rank` of the file at ``rel`` (a path below the save or tag directory)."""
    return _file_rank(rel.rsplit("/", 1)[-1])


def _file_rank(base: str) -> int | None:
    """The rank a rank file's pieces name, by its name: the DP rank of a ZeRO partition or ZeRO-3
    model states, the model-parallel rank of model states or a pipeline layer file."""
    if m := _OPTIM.match(base):
        return int(m.group(2))
    if m := _Z3_MODEL.match(base):
        return int(m.group(1))
    if m := _MODEL.match(base):
        return int(m.group(1))
    if m := _LAYER.match(base):
        return int(m.group(2) or 0)
    return None


def _absent_beside_damage(
    tag: str,
    prefix: str,
    files: dict[str, Any],
    maps: RankFiles,
    stray: dict[str, str],
) -> list[CkptError]:
    """:func:`_absent_rank_files` where some rank files present could not be read (``files`` lacks
    them; ``maps``: the model, ZeRO-3 model and optimizer files present): the layout worked out
    from those that were, nothing where they say too little."""
    read = {k: rel for k, rel in maps[2].items() if rel in files}
    try:
        stage = DeepSpeedAdapter._stage(files, read)
        return _absent_rank_files(tag, prefix, files, maps, stage, stray)[2]
    except CkptError:
        return []


def _absent_rank_files(
    tag: str, prefix: str, files: dict[str, Any], maps: RankFiles, stage: int, stray: dict[str, str]
) -> tuple[int, bool, list[CkptError]]:
    """The DP size, whether the optimizer state is partitioned, and one ``missing-file`` error
    naming each absent rank file, as the files themselves give the layout (DeepSpeed 0.19 records
    no file list). The DP size: ``partition_count`` in the optimizer files, else ``dp_world_size``
    in the model states; the model-parallel size: ``mp_world_size``. DeepSpeed writes one optimizer
    file per (DP, MP) rank when a ZeRO or bf16 optimizer partitions the state (``param_shapes``
    saved), one model-states file per (DP, MP) rank at ZeRO-3 and one per MP rank below it. Without
    a rank's file its partitions are missing from every partitioned tensor: reading the others as
    the whole (as a save at a smaller DP would be) gives wrong values. The maps name every rank
    file present; ``files`` holds those that could be read (the others are damaged, and said so
    beside these)."""
    models, z3_models, optims = maps
    recorded = {rel: n for _, rel in sorted(optims.items()) if (n := _partition_count(files.get(rel))) is not None}
    model_rels = [models[k] for k in sorted(models)] + [z3_models[k] for k in sorted(z3_models)]
    first: dict[str, Any] = next((files[rel] for rel in model_rels if rel in files), {})
    partitioned = bool(optims) or bool(z3_models) or isinstance(first.get("param_shapes"), list)
    present_dp = {dp for dp, _ in optims} | {dp for dp, _ in z3_models}
    present_mp = set(models) | {mp for _, mp in optims} | {mp for _, mp in z3_models}
    pc = next(iter(recorded.values()), None)
    world = _count(first.get("dp_world_size"))
    dp_size = pc or world or (max(present_dp) + 1 if present_dp else 1)
    if pc is None:
        dp_size = max(dp_size, max(present_dp, default=-1) + 1)
    mp_size = max(_count(first.get("mp_world_size")) or 1, max(present_mp, default=-1) + 1)
    if not model_rels and not optims:
        return dp_size, partitioned, []
    if dp_size * mp_size > _MAX_RANK_FILES:
        raise CorruptFileError(
            f"{model_rels[0] if model_rels else next(iter(optims.values()))}: records {dp_size} DP x {mp_size} "
            "model-parallel ranks, not a layout DeepSpeed saved",
            path=model_rels[0] if model_rels else next(iter(optims.values())),
        )
    absent: list[tuple[str, str, int]] = []  # (file name, what it holds, the rank its pieces name)
    z3 = stage == 3 or bool(z3_models)
    names = [m.group(1) or "" for rel in optims.values() if (m := _OPTIM.match(rel.rsplit("/", 1)[-1]))]
    opt_prefix = names[0] if names else ("bf16_" if _is_bf16(first.get("ds_config")) else "")

    def rank(dp: int, mp: int) -> str:
        return f"DP rank {dp}, MP rank {mp}" if mp_size > 1 else f"DP rank {dp}"

    for mp in range(mp_size):
        if not z3 and mp not in models:
            absent.append((f"mp_rank_{mp:02d}_model_states.pt", f"MP rank {mp}'s model states", mp))
        for dp in range(dp_size) if partitioned else ():
            if z3 and (dp, mp) not in z3_models:
                absent.append(
                    (f"zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt", f"{rank(dp, mp)}'s model states", dp)
                )
            if (dp, mp) not in optims:
                absent.append(
                    (
                        f"{opt_prefix}zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt",
                        f"{rank(dp, mp)}'s optimizer partition",
                        dp,
                    )
                )
    if not absent:
        return dp_size, partitioned, []
    source = (
        f"partition_count {pc} in {next(iter(recorded)).rsplit('/', 1)[-1]}"
        if pc is not None
        else f"dp_world_size {world} in the model states"
        if world is not None
        else "the rank files found"
    )
    context = (
        f"{len(absent)} rank file(s) missing from {tag}. The files record {dp_size} DP rank(s) "
        f"({source}){f' x {mp_size} model-parallel ranks (mp_world_size)' if mp_size > 1 else ''}, each saving "
        f"its own files; found {len(optims)} optimizer and {len(model_rels)} model-states file(s)"
    )
    # one error per file, each naming its rank (verify reports each; the CLI names the rest after
    # the first, which alone says how the set of files was worked out)
    return (
        dp_size,
        partitioned,
        [
            IncompleteCheckpointError(
                f"{prefix}{name}: {what} is missing"
                + (f" (found at {stray[name]}, where DeepSpeed does not read it)" if name in stray else "")
                + (f": {context}" if i == 0 else ""),
                hint="a rank did not finish saving or its file was deleted or renamed: restore it from the save, "
                "or use another checkpoint (the other ranks' partitions are not whole tensors)",
                path=prefix + name,
                rule="missing-file",
                rank=r,
            )
            for i, (name, what, r) in enumerate(absent)
        ],
    )


def _frozen(model_states: dict[str, Any], trained: Collection[str]) -> list[str]:
    """The parameters a run froze: named by the model states at ZeRO-2 and 3
    (``frozen_param_shapes``); at ZeRO-1, the module's entries that are neither ``trained`` nor
    buffers (none where nothing is known trained)."""
    if named := list((model_states.get("frozen_param_shapes") or {}).keys()):
        return named
    module = model_states.get("module")
    if not trained or not isinstance(module, dict):
        return []
    buffers = set(model_states.get("buffer_names") or [])
    return [n for n in module if n not in trained and n not in buffers]


def _tied(files: dict[str, Any], rels: list[str]) -> dict[str, str]:
    """The tied-weight map (``shared_params``: alias -> owner), from the first of the model-states
    files ``rels`` (in rank order) that records one: DeepSpeed computes it on global rank 0 only
    and saves ``{}`` in the other ranks' files (ZeRO-3)."""
    for rel in rels:
        value = files[rel].get("shared_params") if isinstance(files[rel], dict) else None
        if isinstance(value, dict) and value:
            return value
    return {}


def _check_rank0_file(files: dict[str, Any], models: dict[int, str], z3_models: dict[tuple[int, int], str]) -> None:
    """DeepSpeed writes the tied-weight map (``shared_params``) in global rank 0's model states
    only (``_get_shared_params``: ``if dist.get_rank() == 0``), ``{}`` in every other rank's: the
    one trace of a rank that a ZeRO-3 model-states file keeps. A map in another rank's file is rank
    0's file under another name (renamed or swapped, when rank 0's has none) or a copy of it."""
    ordered = [(k, z3_models[k]) for k in sorted(z3_models)] or [((0, k), models[k]) for k in sorted(models)]
    if not ordered or ordered[0][0] != (0, 0):
        return
    rank0 = ordered[0][1]
    holder = next(((k, rel) for k, rel in ordered[1:] if _tied(files, [rel])), None)
    if holder is None or not isinstance(files[rank0].get("shared_params"), dict):
        return
    (dp, mp), rel = holder
    if _tied(files, [rank0]):  # both record it: the other is a copy of rank 0's file
        raise CorruptFileError(
            f"{rel} is a copy of global rank 0's model states ({rank0}): it records the tied-weight map "
            f"(shared_params {str(_tied(files, [rel]))[:80]}), which DeepSpeed saves in global rank 0's file only; "
            f"the file of DP rank {dp}, MP rank {mp} was overwritten",
            hint="restore that rank's file from the save; read as it is, its partitions would be rank 0's",
            path=rel,
            rule="misplaced-file",
            rank=_rel_rank(rel),
        )
    raise CorruptFileError(
        f"{rel} holds global rank 0's model states: it records the tied-weight map (shared_params "
        f"{str(_tied(files, [rel]))[:80]}), which DeepSpeed saves in global rank 0's file only, while {rank0} "
        f"records none: the files of rank 0 and of DP rank {dp}, MP rank {mp} were swapped or renamed",
        hint="restore the files from the save, or give each rank's files back their names (its optimizer file "
        "too: a ZeRO-3 optimizer file records no rank); read as they are, the partitions join in the wrong order",
        path=rel,
        rule="misplaced-file",
        rank=_rel_rank(rel),
    )


_STEP_TAG = re.compile(r"global_step(\d+)")
"""the tag DeepSpeed's save_checkpoint names a save by when given none: ``global_step{global_steps}``"""

ALIGN = 2
"""DeepSpeed's ``nccl_start_alignment_factor``: groups are padded to a multiple of ALIGN x DP."""


@dataclass(slots=True)
class GroupLayout:
    """A ZeRO-1/2 (or BF16_Optimizer) param group's flat buffer at a DP size."""

    params: list[tuple[str, tuple[int, ...], int]]
    """(name, shape, offset in the flat group)"""
    total: int
    padded: int
    partition: int

    def padding(self, r: int) -> int:
        """The zeros at the end of rank ``r``'s partition (DeepSpeed's ``groups_padding``)."""
        return min(self.partition, max(0, (r + 1) * self.partition - self.total))

    def fragments(self, r: int) -> list[tuple[str, tuple[int, ...], int, int, int]]:
        """(name, shape, first element of the param, count, position in the partition) for the
        parameters partition ``r`` holds (DeepSpeed's ``param_slice_mappings``: start, numel)."""
        lo, hi = r * self.partition, (r + 1) * self.partition
        out = []
        for name, shape, off in self.params:
            a, b = max(off, lo), min(off + math.prod(shape), hi)
            if a < b:
                out.append((name, shape, a - off, b - a, a - lo))
        return out


def group_layout(shapes: dict[str, Any], dp: int, paddings: list[int] | None = None) -> GroupLayout:
    """Where each parameter of a group lies in its flat buffer at ``dp`` ranks. ``paddings``: the
    zeros after each parameter (``param_alignment_paddings``; they depend on the parameters' sizes
    and dtype, not on DP). ``total`` counts them; the group is padded to ALIGN x DP after that."""
    params, pos = [], 0
    for k, (name, shape) in enumerate(shapes.items()):
        shape = tuple(int(s) for s in shape)
        params.append((name, shape, pos))
        pos += math.prod(shape) + (paddings[k] if paddings and k < len(paddings) else 0)
    padded = -(-pos // (ALIGN * dp)) * ALIGN * dp
    return GroupLayout(params=params, total=pos, padded=padded, partition=padded // dp)


def _saved_layout(shapes: Any, paddings: Any, ws: int) -> GroupLayout | None:
    """:func:`group_layout` of a group as an optimizer file records it (``param_shapes``,
    ``param_alignment_paddings``), None when those do not read as sizes."""
    if not isinstance(shapes, dict) or not all(
        isinstance(shape, list | tuple) and all(_count(n) is not None or n == 0 for n in shape)
        for shape in shapes.values()
    ):
        return None
    pads = paddings if isinstance(paddings, list | tuple) else []
    pads = [p if isinstance(p, int) and not isinstance(p, bool) and p >= 0 else 0 for p in pads]
    return group_layout(shapes, ws, pads)


def _fragments_of(layout: GroupLayout, r: int) -> dict[str, tuple[int, int]]:
    """The (start in the partition, numel) of each parameter partition ``r`` holds."""
    return {name: (pos, count) for name, _, _, count, pos in layout.fragments(r)}


def _held_rank(layout: GroupLayout, ws: int, actual: dict[str, tuple[int, int]]) -> list[int]:
    """The DP ranks whose partition holds exactly the fragments ``actual`` (a file's
    ``param_slice_mappings`` of one group), found from its first fragment's place."""
    params = {name: (off, math.prod(shape)) for name, shape, off in layout.params}
    part = layout.partition
    known = [(params[n][0], n) for n in actual if n in params]
    if not known or part <= 0 or len(known) != len(actual):
        return []
    off, name = min(known)
    start, numel = actual[name]
    size = params[name][1]
    if start > 0:  # the parameter begins inside the partition
        guesses = [(off - start) // part] if (off - start) % part == 0 else []
    elif numel < part:  # the partition begins inside it and holds its end
        guesses = [(off + size - numel) // part] if (off + size - numel) % part == 0 else []
    else:  # the partition lies inside it
        guesses = list(range(-(-off // part), (off + size) // part))[:8]
    return [r for r in guesses if 0 <= r < ws and _fragments_of(layout, r) == actual]


def _check_stage_files(files: dict[str, Any], optims: dict[tuple[int, int], str], models: dict[int, str]) -> None:
    """Each ZeRO-1/2 optimizer file holds parameters of its own model-parallel rank: the names in
    its ``param_slice_mappings`` are among those of ``mp_rank_MM_model_states.pt``'s
    ``param_shapes``. Pipeline stages hold different parameters, so a stage's file given another
    stage's name (swapped, renamed) is found here and named with the rank whose parameters it holds."""

    def names(groups: Any) -> set[str]:
        if not isinstance(groups, list):
            return set()
        return {n for g in groups if isinstance(g, dict) for n in g if isinstance(n, str)}

    params = {mp: names(files[rel].get("param_shapes")) for mp, rel in models.items() if isinstance(files[rel], dict)}
    for (_dp, mp), rel in sorted(optims.items()):
        held = names(_slice_mappings(files[rel]))
        if not held or mp not in params or not params[mp] or held <= params[mp]:
            continue
        owners = [m for m, own in sorted(params.items()) if m != mp and held <= own]
        whose = f"model-parallel rank {owners[0]}'s ({models[owners[0]]})" if owners else "no model-parallel rank's"
        raise CorruptFileError(
            f"{rel}: its param_slice_mappings name {len(held - params[mp])} parameters that "
            f"{models[mp]} does not hold ({sorted(held - params[mp])[0]} first): the optimizer partition of "
            f"{whose}, not of MP rank {mp}: the stages' files were swapped or renamed",
            hint="restore the files from the save, or rename each to the rank whose parameters it holds",
            path=rel,
            rule="misplaced-file",
            rank=_rel_rank(rel),
        )


def _check_zero12_ranks(files: dict[str, Any], per_rank: list[tuple[int, str]], shapes: Any, ws: int) -> None:
    """Each ZeRO-1/2 optimizer file holds its own DP rank's partition: its ``param_slice_mappings``
    (each parameter's fragment: start in the partition, numel) are those of the partition its
    name says, in the layout DeepSpeed cuts (:func:`group_layout`). A file whose fragments are
    exactly another rank's holds that rank's partition (files swapped or renamed); one matching
    no rank of that layout is left to the reader."""
    if not isinstance(shapes, list):
        return
    misplaced: list[tuple[str, int]] = []
    for dp, rel in per_rank:
        mappings = _slice_mappings(files[rel])
        if not isinstance(mappings, list):
            continue
        paddings = _paddings(files[rel])
        for g, mapping in enumerate(mappings):
            layout = (
                _saved_layout(shapes[g], paddings[g] if isinstance(paddings, list) and g < len(paddings) else None, ws)
                if g < len(shapes)
                else None
            )
            if layout is None or not isinstance(mapping, dict):
                continue
            actual = {}
            for name, frag in mapping.items():
                start, numel = getattr(frag, "start", None), getattr(frag, "numel", None)
                if not (isinstance(start, int) and isinstance(numel, int)):
                    break
                actual[name] = (start, numel)
            else:
                if _fragments_of(layout, dp) == actual:
                    continue
                others = [r for r in _held_rank(layout, ws, actual) if r != dp]
                if others:
                    misplaced.append((rel, others[0]))
                    break
    if misplaced:
        said = ", ".join(f"{rel.rsplit('/', 1)[-1]} holds DP rank {r}'s" for rel, r in misplaced[:4])
        names = " and ".join(rel for rel, _ in misplaced[:4]) + (" …" if len(misplaced) > 4 else "")
        raise CorruptFileError(
            f"{names}: not the partitions their names say ({said}): each file's param_slice_mappings place its "
            f"fragments in another DP rank's partition of the {ws}-rank layout: the ranks' files were swapped "
            "or renamed",
            hint="restore the files from the save, or rename each to the DP rank it holds (zero_pp_rank_<rank>_…); "
            "read as they are, the partitions join in the wrong order",
            path=misplaced[0][0],
            rule="misplaced-file",
            rank=_rel_rank(misplaced[0][0]),
        )


def _absent_layer_files(
    tag_dir: Path, prefix: str, layers: dict[tuple[int, int], str], trainable: set[str]
) -> list[CkptError]:
    """A pipeline save writes one file per layer with parameters and model-parallel rank: a layer
    the optimizer trains (``<layer>.<name>`` in ``param_shapes``) with no file, or a file for some
    model-parallel ranks only, is a deleted or unfinished file (one error each)."""
    if not layers:
        return []
    tps = sorted({t for _, t in layers})
    wanted = {int(n.split(".", 1)[0]) for n in trainable if n.split(".", 1)[0].isdigit()}
    wanted |= {layer for layer, _ in layers}
    spelled = "-model_" in next(iter(layers.values()))  # the files' own naming: with the MP rank or without

    def named(layer: int, t: int) -> str:
        return f"layer_{layer:02d}-model_{t:02d}-model_states.pt" if spelled else f"layer_{layer:02d}-model_states.pt"

    absent = [named(layer, t) for layer in sorted(wanted) for t in tps if (layer, t) not in layers]
    return _absent_files(
        tag_dir,
        [prefix + name for name in absent],
        "pipeline layer",
        "the optimizer trains these layers' parameters",
        "a stage did not finish saving or the file was deleted; use another checkpoint",
    )


def _dynamic_scaler(optim: Any) -> bool:
    """Whether a DeepSpeed file (a ZeRO optimizer file, or ZeRO-0's model states, whose
    ``optimizer`` is FP16_Optimizer's state dict) keeps an fp16 run's dynamic loss scaler (its scale and the steps
    since the last overflow: state a resume needs, which only DeepSpeed's files hold). A static one
    (bf16, fp32 runs, a fixed ``loss_scale``) is the config's, not state."""
    if not isinstance(optim, dict):
        return False
    for osd in (optim.get("optimizer_state_dict"), optim.get("optimizer")):  # (ZeRO files; ZeRO-0's model states)
        if isinstance(osd, dict) and (
            osd.get("dynamic_loss_scale") is True
            or getattr(osd.get("loss_scaler"), "_qualname", "").endswith(".DynamicLossScaler")
        ):
            return True
    return False


class _Builder:
    """Adds DeepSpeed items to a manifest."""

    def __init__(self, manifest: Manifest, files: dict[str, Any], rules: TpRules | None = None) -> None:
        self.m = manifest
        self.files = files
        self.replicas = ReplicaCounter()
        self.copies: dict[tuple[str, Box], list[int]] = {}
        """the model-parallel ranks holding a copy of a region of a flat-partitioned item, in order"""
        self.rules = rules or TpRules(None, 1, "")

    def stage_copies(self) -> list[str]:
        """The flat-partitioned items whose copies are held by more than one pipeline stage (a
        weight tied across the stages: each stage's optimizer holds one)."""
        tp = max(self.rules.tp, 1)
        return sorted({name for (name, _box), mps in self.copies.items() if len({m // tp for m in mps}) > 1})

    def tp_item(
        self, param: str, suffix: str, kind: Kind, dtype: str, shape: tuple[int, ...], t: int, rule: Rule
    ) -> tuple[Item, list[tuple[Box, int]]]:
        """The item that TP rank ``t``'s copy (of ``shape``) of ``param`` + ``suffix`` belongs to
        under ``rule``, and the regions of it that the copy holds, each with the element of the
        (flattened) copy it starts at: one region, or several (:class:`Regions`)."""
        if isinstance(rule, Regions):
            if t >= len(rule.shards) or rule.shards[t] != tuple(shape):
                raise CorruptFileError(
                    f"{param}{suffix}: TP rank {t} holds a {list(shape)} tensor; universal_checkpoint_info's map of "
                    f"it says {list(rule.shards[t]) if t < len(rule.shards) else 'no copy'}",
                    path=self.rules.rel,
                    hint="the checkpoint's files and its split rules disagree: it was damaged or mixed from two runs",
                )
            return self.item(param + suffix, kind, dtype, rule.full), list(rule.held[t])
        if isinstance(rule, int):
            full = tuple(n * self.rules.tp if d == rule else n for d, n in enumerate(shape))
            offsets = tuple(t * n if d == rule else 0 for d, n in enumerate(shape))
            return self.item(param + suffix, kind, dtype, full), [(Box(offsets, shape), 0)]
        name = f"{param}[tp={t}]{suffix}" if rule == PER_RANK else param + suffix
        return self.item(name, kind, dtype, shape), [(Box.whole(shape), 0)]

    def module_value(self, name: str, value: Any, rel: str, t: int, trainable: bool, path: str) -> None:
        """A module weight or buffer of TP rank ``t``, placed by the TP rule."""
        if not isinstance(value, _unpickle.TensorRef):
            if t == 0:
                self.tensor_or_object(name, value, rel, "param", rank=0, path=path)
            return
        rule = self.rules.rule(name, tuple(value.shape), trainable)
        item, regions = self.tp_item(name, "", "param", value.dtype, value.shape, t, rule)
        for box, first in regions:
            replica = self.replicas.next(item.name, box)
            lo = first // max(1, math.prod(value.shape[1:]))  # a sub-parameter: rows of the copy
            rows = (lo, lo + box.sizes[0]) if box.sizes != tuple(value.shape) else None
            item.pieces.append(_pt.tensor_piece(rel, value, box=box, rank=t, replica=replica, rows=rows))

    def item(self, name: str, kind: Kind, dtype: str, shape: tuple[int, ...], param: str | None = None) -> Item:
        item = self.m.items.get(name)
        if item is None:
            item = self.m.add(Item(name=name, kind=kind, dtype=dtype, shape=shape))
        elif item.dtype != dtype or item.shape != shape:
            raise CorruptFileError(
                f"{name}: {dtype}{list(shape)} in one file, {item.dtype}{list(item.shape or ())} in another",
                path=self.m.root,
            )
        return item

    def tensor_or_object(
        self, name: str, value: Any, rel: str, kind: Kind, rank: int | None, path: str | None = None
    ) -> None:
        """Add a tensor piece or a non-tensor value; ``path`` is the value's dotted path in the file."""
        if isinstance(value, _unpickle.TensorRef):
            item = self.item(name, kind, value.dtype, value.shape)
            item.pieces.append(_pt.tensor_piece(rel, value, rank=rank, replica=len(item.pieces)))
        elif name not in self.m.items:
            item = self.m.add(
                Item(
                    name=name,
                    kind=classify(name, is_tensor=False) if kind == "param" else kind,
                    pieces=[_pt.object_piece(rel, path or name, rank=rank)],
                )
            )
            set_value(item, value)

    def flat_state(
        self,
        osd_rel: str,
        dp: int,
        names: list[tuple[str, tuple[int, ...], int, int, int]],
        refs: dict[str, _unpickle.TensorRef],
        t: int = 0,
        mp: int = 0,
    ) -> None:
        """Per-parameter pieces of flat fp32/moment partitions of TP rank ``t`` of model-parallel
        rank ``mp``: ``names`` holds (param, shape, start in the partition, numel, start in the
        flattened param). Each model-parallel rank holding the same region (TP ranks of a replicated
        parameter, the pipeline stages of a tied one) has a copy of its own, numbered in the order
        the ranks come: a stage's copy is cut at its own partition boundaries, which need not be
        another's."""
        for param, shape, start, numel, local in names:
            rule = self.rules.rule(param, tuple(shape))
            for state, ref in refs.items():
                kind: Kind = "master" if state == "fp32" else "optim"
                item, regions = self.tp_item(param, f".{state}", kind, ref.dtype, shape, t, rule)
                for box, first in regions:  # the part of the fragment in each region the copy holds
                    a, z = max(local, first), min(local + numel, first + box.volume)
                    if a >= z:
                        continue
                    copies = self.copies.setdefault((item.name, box), [])
                    if mp not in copies:
                        copies.append(mp)
                    same = copies.index(mp)
                    item.pieces.append(
                        _pt.tensor_piece(
                            osd_rel,
                            ref,
                            box=box,
                            start=start + a - local,
                            numel=z - a,
                            flat=(a - first, z - a),
                            rank=dp,
                            replica=same,
                        )
                    )

    def layers(self, layers: dict[tuple[int, int], str], shapes: dict[str, tuple[int, ...] | None]) -> None:
        """Pipeline layer files: parameters named ``<layer>.<name>`` (DeepSpeed's own spelling),
        the copies of the ranks of a TP axis placed by the TP rules. A layer that is a module tied
        across stages (``TiedLayerSpec``) is saved under its layer number, but the module and the
        optimizer name it ``tied_modules.<key>.<name>``: a layer none of whose tensors the
        optimizer knows by number, and all of whose tensors it knows under exactly one tied key with
        those shapes, is named so. (A tied layer with a ``forward_fn``, the output layer reusing the
        embedding, has no file: DeepSpeed saves only modules. A frozen layer with the very names and
        shapes of a tied module cannot be told from it: DeepSpeed's pipeline engine runs ZeRO-1 at
        most, which records no frozen parameters.)"""
        trainable = set(shapes)
        tied = {n.split(".")[1] for n in trainable if n.startswith("tied_modules.") and n.count(".") >= 2}
        for (layer, tp_rank), rel in sorted(layers.items()):
            entries = flatten(self.files[rel])
            tensors = {name: value for name, value in entries if isinstance(value, _unpickle.TensorRef)}
            prefix = f"{layer}."
            if tensors and not any(prefix + n in trainable for n in tensors):
                keys = [
                    k
                    for k in sorted(tied)
                    if all(shapes.get(f"tied_modules.{k}.{n}", ()) == tuple(v.shape) for n, v in tensors.items())
                ]
                prefix = f"tied_modules.{keys[0]}." if len(keys) == 1 else prefix
            for name, value in entries:
                full = prefix + name
                self.module_value(full, value, rel, tp_rank, full in trainable, name)

    def zero12(self, per_rank: list[tuple[int, str]], shapes: list[Any], t: int = 0, mp: int = 0) -> None:
        consumed: dict[str, int] = defaultdict(int)
        for dp, rel in per_rank:
            osd = self.files[rel].get("optimizer_state_dict")
            if not isinstance(osd, dict) or "single_partition_of_fp32_groups" not in osd:
                raise CorruptFileError(
                    f"{rel}: no single_partition_of_fp32_groups; not a ZeRO-1/2 optimizer file", path=rel
                )
            mappings = osd.get("param_slice_mappings")
            if not isinstance(mappings, list):
                raise CorruptFileError(
                    f"{rel}: no param_slice_mappings (written by DeepSpeed older than 0.10?); not supported yet",
                    path=rel,
                )
            base = osd.get("base_optimizer_state") or {}
            if isinstance(base, list):  # (elastic_checkpoint: the partition's state of each group, in a list)
                state, base = dict(enumerate(base)), {}
            else:
                state = base.get("state") or {}
            for g, fp32 in enumerate(osd["single_partition_of_fp32_groups"]):
                group_shapes = shapes[g] if g < len(shapes) else {}
                gstate = state.get(g) or {}
                refs = {"fp32": fp32, **flat_moments(gstate, fp32)}
                names = []
                for param, frag in (mappings[g] if g < len(mappings) else {}).items():
                    shape = tuple(group_shapes.get(param, ()))
                    numel, start = int(frag.numel), int(frag.start)
                    names.append((param, shape, start, numel, consumed[param]))
                    consumed[param] += numel
                self.flat_state(rel, dp, names, refs, t, mp)
                self.group_objects(rel, dp, g, base, gstate, "optimizer_state_dict.base_optimizer_state")

    def zero3(
        self, per_rank: list[tuple[int, str]], shapes: list[Any], t: int = 0, mp: int = 0, ws: int | None = None
    ) -> None:
        """``ws``: the DP ranks the files record the parameters were partitioned over (default: one
        per file; :func:`_check_rank_files` has made sure each has its file)."""
        ws = ws or len(per_rank)
        for dp, rel in per_rank:
            osd = self.files[rel].get("optimizer_state_dict")
            if not isinstance(osd, dict) or "fp32_flat_groups" not in osd:
                raise CorruptFileError(f"{rel}: no fp32_flat_groups; not a ZeRO-3 optimizer file", path=rel)
            inner = osd.get("optimizer_state_dict") or {}
            state = inner.get("state") or {}
            flats = osd["fp32_flat_groups"]
            # params are partitioned one by one (ceil(numel / ws) each) and laid back to back over
            # the concatenated sub-group buffers
            bounds = []
            pos = 0
            for s, ref in enumerate(flats):
                bounds.append((pos, pos + ref.shape[0], s))
                pos += ref.shape[0]
            offset = 0
            for group in shapes:
                for param, shape in group.items():
                    shape = tuple(shape)
                    numel = math.prod(shape)
                    part = -(-numel // ws)
                    held = max(0, min(part, numel - dp * part))
                    seg_lo, seg_hi = offset, offset + held
                    for lo, hi, s in bounds:
                        a, z = max(lo, seg_lo), min(hi, seg_hi)
                        if a >= z:
                            continue
                        refs = {"fp32": flats[s], **flat_moments(state.get(s) or {}, flats[s])}
                        names = [(param, shape, a - lo, z - a, dp * part + (a - seg_lo))]
                        self.flat_state(rel, dp, names, refs, t, mp)
                    offset += part
            # a param group is cut into sub-groups (how many depends on DP): each sub-group's step
            # is a replica of its param group's
            group_of = {
                sid: g
                for g, group in enumerate(inner.get("param_groups") or [])
                if isinstance(group, dict)
                for sid in group.get("params") or []
            }
            for s in range(len(flats)):
                g = group_of.get(s)
                if g is None:
                    raise CorruptFileError(
                        f"{rel}: fp32 sub-group {s} is in none of the optimizer's param groups "
                        f"({sorted(group_of)} listed)",
                        path=rel,
                    )
                self.group_objects(rel, dp, g, inner, state.get(s) or {}, "optimizer_state_dict.optimizer_state_dict")

    def universal3_groups(self, rel: str) -> None:
        """A ZeRO-3 universal checkpoint has no ``step.pt``: the step (and the hyper-parameters) of
        each param group are in ``optimizer_state.pt``, rank 0's whole optimizer state, one replica
        per sub-group as in the source."""
        osd = self.files.get(rel)
        inner = osd.get("optimizer_state_dict") if isinstance(osd, dict) else None
        if not isinstance(inner, dict):
            return
        state = inner.get("state") or {}
        for g, group in enumerate(inner.get("param_groups") or []):
            for sid in group.get("params") or [] if isinstance(group, dict) else []:
                self.group_objects(rel, 0, g, inner, state.get(sid) or {}, "optimizer_state_dict")

    def universal_hyperparameters(self, rel: str) -> None:
        """A ZeRO-1/2 universal checkpoint keeps each param group's hyperparameters in
        ``optimizer_state.pt``'s ``param_groups`` (its steps are per parameter, ``step.pt``): the
        source's ``optimizer.param_groups.<g>.<key>`` items, which went unread (``diff`` of a run
        and its universal checkpoint could not see an lr changed on the way)."""
        osd = self.files.get(rel)
        groups = osd.get("param_groups") if isinstance(osd, dict) else None
        if isinstance(osd, dict) and isinstance(groups, list):
            for g, group in enumerate(groups):
                if isinstance(group, dict):
                    self.group_objects(rel, 0, g, osd, {}, "")

    def zero0(self, opt: dict[str, Any], rel: str, first: dict[str, Any]) -> None:
        """ZeRO off: the whole torch optimizer state dict sits in the model-states file (inside
        ``optimizer_state_dict`` with ``fp32_groups`` masters for the fp16/bf16 optimizer)."""
        nested = opt.get("optimizer_state_dict")
        inner: dict[str, Any] = nested if isinstance(nested, dict) else opt
        base_path = "optimizer.optimizer_state_dict" if inner is not opt else "optimizer"
        state = inner.get("state") or {}
        groups = inner.get("param_groups") or []
        names = _zero0_names(first, groups, state)
        if names is not None:
            self.m.extras["optimizer_names"] = (
                "inferred from module parameter order and shapes (ZeRO-0 keeps none): param groups built in another "
                "order than the module's would swap the state of parameters of one shape"
            )
        masters = opt.get("fp32_groups") if isinstance(opt.get("fp32_groups"), list) else None
        for g, group in enumerate(groups):
            for i, pid in enumerate(group.get("params") or []):
                param = names.get(pid, f"param{pid}") if names is not None else f"param{pid}"
                for k, v in (state.get(pid) or {}).items():
                    if k != "step" and isinstance(v, _unpickle.TensorRef):
                        item = self.item(f"{param}.{k}", "optim", v.dtype, v.shape)
                        item.pieces.append(_pt.tensor_piece(rel, v, rank=0))
                if masters is not None and g < len(masters) and i < len(masters[g]):
                    ref = masters[g][i]
                    if isinstance(ref, _unpickle.TensorRef):
                        self.item(f"{param}.fp32", "master", ref.dtype, ref.shape).pieces.append(
                            _pt.tensor_piece(rel, ref, rank=0)
                        )
            params = group.get("params") or []
            self.group_objects(rel, 0, g, inner, (state.get(params[0]) or {}) if params else {}, base_path)

    def group_objects(
        self, rel: str, dp: int, g: int, base: dict[str, Any], gstate: dict[str, Any], base_path: str
    ) -> None:
        """The group's step counter (a replica per rank) and, from rank 0, its hyperparameters;
        ``base_path`` is where the torch optimizer state dict sits in the file."""
        step = gstate.get("step")
        name = f"optimizer.param_groups.{g}.step"
        if isinstance(step, _unpickle.TensorRef):
            item = self.item(name, "optim", step.dtype, step.shape)
            item.pieces.append(_pt.tensor_piece(rel, step, rank=dp, replica=len(item.pieces)))
        if dp != 0:
            return
        groups = base.get("param_groups") or []
        if g < len(groups):
            for k, v in groups[g].items():
                if k == "params":
                    continue
                key = f"optimizer.param_groups.{g}.{k}"
                if key not in self.m.items:
                    where = f"{base_path}.param_groups.{g}.{k}" if base_path else f"param_groups.{g}.{k}"
                    item = self.m.add(Item(name=key, kind="optim", pieces=[_pt.object_piece(rel, where, rank=dp)]))
                    set_value(item, v)

    def frozen(
        self,
        stage: int,
        models: dict[int, str],
        z3_models: dict[tuple[int, int], str],
        first: Any,
        dp_size: int | None = None,
    ) -> None:
        if first.get("param_shapes") is None:  # ZeRO off: no partitioned optimizer, nothing is frozen apart
            return
        shapes = first.get("frozen_param_shapes") or {}
        if stage == 3 and shapes:
            ranks = sorted(dp for dp, mp in z3_models if mp == 0)
            ws = dp_size or len(ranks)
            for name, shape in shapes.items():
                shape = tuple(shape)
                numel = math.prod(shape)
                part = -(-numel // ws)
                if numel == 0:  # DeepSpeed counts empty parameters as frozen: no rank holds an element
                    frag = (self.files[z3_models[(ranks[0], 0)]].get("frozen_param_fragments") or {}).get(name)
                    dtype = frag.dtype if isinstance(frag, _unpickle.TensorRef) else "float32"
                    self.item(f"{name}.fp32", "master", dtype, shape)
                    continue
                for dp in ranks:
                    rel = z3_models[(dp, 0)]
                    frag = (self.files[rel].get("frozen_param_fragments") or {}).get(name)
                    held = max(0, min(part, numel - dp * part))
                    if not isinstance(frag, _unpickle.TensorRef) or held == 0:
                        continue
                    flat = frag if len(frag.shape) == 1 else None
                    if flat is None:
                        raise CorruptFileError(f"{rel}: frozen fragment of {name} is not flat", path=rel)
                    item = self.item(f"{name}.fp32", "master", frag.dtype, shape)
                    item.pieces.append(
                        _pt.tensor_piece(
                            rel, frag, box=Box.whole(shape), start=0, numel=held, flat=(dp * part, held), rank=dp
                        )
                    )
            return
        # ZeRO 0-2: frozen params are whole in the module (and in frozen_param_fragments at ZeRO-2)
        module = first.get("module") or {}
        trainable = {n for group in (first.get("param_shapes") or []) for n in group}
        buffers = set(first.get("buffer_names") or [])
        shared = first.get("shared_params") or {}
        model_rel = models.get(0)
        if model_rel is None:
            return
        for name, value in module.items():
            if name in trainable or name in buffers or name in shared or not isinstance(value, _unpickle.TensorRef):
                continue
            item = self.item(f"{name}.fp32", "master", value.dtype, value.shape)
            item.pieces.append(_pt.tensor_piece(model_rel, value, rank=0))

    def shared(self, shared: dict[str, str]) -> None:
        """Tied weights: the alias gets the owner's master copy (DeepSpeed stores it once)."""
        for alias, owner in shared.items():
            src = self.m.items.get(f"{owner}.fp32")
            if src is not None and f"{alias}.fp32" not in self.m.items:
                self.m.add(
                    Item(
                        name=f"{alias}.fp32",
                        kind="master",
                        dtype=src.dtype,
                        shape=src.shape,
                        pieces=[
                            Piece(
                                file=p.file,
                                locator=p.locator,
                                box=p.box,
                                flat=p.flat,
                                rank=p.rank,
                                replica=p.replica,
                                nbytes=p.nbytes,
                            )
                            for p in src.pieces
                        ],
                    )
                )
        if shared:
            self.m.extras["shared_params"] = dict(shared)

    def common(self, first: dict[str, Any], rel: str) -> None:
        for key in ("global_steps", "global_samples", "skipped_steps"):
            if key in first:
                item = self.m.add(Item(name=key, kind="counter", pieces=[_pt.object_piece(rel, key, rank=0)]))
                set_value(item, first[key])
        sched = first.get("lr_scheduler")
        if isinstance(sched, dict):
            for name, value in flatten(sched, "lr_scheduler"):
                self.tensor_or_object(name, value, rel, "scheduler", rank=0)
        sampler = first.get("data_sampler")
        if sampler is not None:
            for name, value in flatten(sampler, "data_sampler"):
                self.tensor_or_object(name, value, rel, "dataloader", rank=0)

    def client_state(self, holders: dict[str, tuple[str, int | None]]) -> None:
        """What the run passed to ``save_checkpoint(client_state=...)``, from each file that holds its
        own (``holders``: each file and its DP rank, by the label its values are named with). Values
        every file holds alike are one item (tensors: a replica a file); RNG and dataloader state,
        and values the files hold differently, are an item a file, ``<name>[<label>]`` (only the
        first file's were read: a ZeRO-3 run's other ranks' cursors were never seen, and diff said
        "equal" of two runs whose rank 1 cursors differed)."""
        leaves = {
            label: {n: leaf for k, v in self.files[rel].items() if k not in _RESERVED for n, leaf in flatten(v, k)}
            for label, (rel, _) in holders.items()
        }
        names = list(dict.fromkeys(n for found in leaves.values() for n in found))
        for name in names:
            held = {label: found[name] for label, found in leaves.items() if name in found}
            first = next(iter(held.values()))
            kind = classify(name, is_tensor=isinstance(first, _unpickle.TensorRef))
            alike = len(held) == len(leaves) and (
                all(isinstance(v, _unpickle.TensorRef) and v.shape == first.shape and v.dtype == first.dtype
                    for v in held.values())
                if isinstance(first, _unpickle.TensorRef)
                else all(same_value(v, first) for v in held.values())
            )  # fmt: skip
            for i, (label, value) in enumerate(held.items()):
                rel, rank = holders[label]
                if alike and kind not in ("rng", "dataloader"):
                    if i == 0 or isinstance(value, _unpickle.TensorRef):  # (tensors: a replica each, compared)
                        self.tensor_or_object(name, value, rel, kind, rank=rank, path=name)
                else:
                    self.tensor_or_object(f"{name}[{label}]", value, rel, kind, rank=rank, path=name)


ADAPTER = DeepSpeedAdapter()
