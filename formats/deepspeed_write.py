"""Writing a DeepSpeed ZeRO-1/2 (:class:`ZeroWriter`) or ZeRO-3 (:class:`Zero3Writer`) checkpoint at a
new data-parallel size, from one of the same stage at any other, or of another stage
(:class:`ZeroFrom3Writer`, :class:`Zero3From12Writer`); and DeepSpeed's universal checkpoint
(:class:`UniversalWriter`, :class:`Universal3Writer`).

ZeRO-1/2 keep, per parameter group, one flat fp32 buffer of the group's parameters in
``param_shapes`` order, padded at the end to a multiple of ``2 x DP`` elements (DeepSpeed's
``nccl_start_alignment_factor`` times the DP size) and cut into DP equal partitions; rank ``r``'s
``zero_pp_rank_r_mp_rank_00_optim_states.pt`` holds partition ``r`` of the fp32 master
(``single_partition_of_fp32_groups``) and of each Adam moment, the fragments of each parameter
it holds (``param_slice_mappings``: ``fragment_address(numel, start)``), and the padding (only
the last rank's ``group_paddings`` is non-zero). This module lays the groups out again for the
new DP and writes what DeepSpeed's ``load_checkpoint`` at that DP size reads; the model-states
file is carried over with ``dp_world_size`` updated. Everything else (loss scaler, clip, step,
param-group hyper-parameters, scheduler, counters, config) is kept.
"""

from __future__ import annotations

import math
import re
import shutil
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, cast

import numpy as np

from ckpttool import _torchzip, _unpickle
from ckpttool.assemble import assemble
from ckpttool.dtypes import bf16_to_float32, carrier, float32_to_bf16
from ckpttool.dtypes import dtype as lookup_dtype
from ckpttool.errors import CorruptFileError, UsageError
from ckpttool.formats import _pt, _ptwrite
from ckpttool.formats.base import PieceReader, PlannedFile
from ckpttool.formats.deepspeed import (
    ALIGN,
    ALLOWLIST,
    SUBPARAM_SHAPE,
    GroupLayout,
    TpRules,
    group_layout,
)
from ckpttool.geometry import Box, flat_range_boxes
from ckpttool.io import RandomAccessFile, confine
from ckpttool.manifest import Item, Manifest

_OPTIM = re.compile(
    r"^(?P<dir>(?:.*/)?)(?P<prefix>bf16_)?zero_pp_rank_(?P<dp>\d+)_mp_rank_(?P<mp>\d+)_optim_states\.pt$"
)
_MODEL = re.compile(r"^(?P<dir>(?:.*/)?)mp_rank_(?P<mp>\d+)_model_states\.pt$")
_LAYER = re.compile(r"^(?:.*/)?layer_\d+(?:-model_\d+)?-model_states\.pt$")
_FRAGMENT = "deepspeed.utils.tensor_fragment.fragment_address"

PLANNING = cast(PieceReader, None)
"""The reader a tree is built with for its plan (:func:`_ptwrite.planned`): its tensors' fills,
which alone read, never run."""


def with_stage(config: Any, stage: int, sub_group_size: int | None = None) -> Any:
    """The saved ``ds_config`` with ``zero_optimization.stage`` set to ``stage`` (and its
    ``sub_group_size``, when given), ZeRO-3's own settings dropped below stage 3 (a config
    DeepSpeed saved as a path is left as it is)."""
    if not isinstance(config, dict):
        return config
    saved = config.get("zero_optimization")
    zero: dict[str, Any] = saved if isinstance(saved, dict) else {}
    if stage < 3:  # ZeRO-3's own settings (sub-groups, persistence, gathering) mean nothing below it
        zero = {k: v for k, v in zero.items() if k not in stage3_settings(config)}
    zero = {**zero, "stage": stage}
    if sub_group_size is not None:
        zero["sub_group_size"] = sub_group_size
    return {**config, "zero_optimization": zero}


def stage3_settings(config: Any) -> dict[str, Any]:
    """The ZeRO-3 settings of a saved ``ds_config`` (``stage3_*``, ``sub_group_size``) that
    :func:`with_stage` drops below stage 3."""
    zero = config.get("zero_optimization") if isinstance(config, dict) else None
    if not isinstance(zero, dict):
        return {}
    return {k: v for k, v in zero.items() if k.startswith("stage3_") or k == "sub_group_size"}


def zero_stage_enum(saved: Any, stage: int) -> _unpickle.EnumValue:
    """DeepSpeed's ``ZeroStageEnum`` member for ``stage``, named as the source's ``saved`` one is."""
    enum = saved.enum if isinstance(saved, _unpickle.EnumValue) else "deepspeed.runtime.zero.config.ZeroStageEnum"
    return _unpickle.EnumValue(enum, stage)


def frozen_of(model: dict[str, Any]) -> list[tuple[str, Any]]:
    """The module entries of a model-states file the optimizer does not hold: not in
    ``param_shapes``, not buffers, not tied aliases (DeepSpeed's frozen parameters), in module
    order, with their tensors."""
    module = model["module"] if isinstance(model.get("module"), dict) else {}
    held = {n for group in (model.get("param_shapes") or []) for n in group}
    others = held | set(model.get("buffer_names") or []) | set(model.get("shared_params") or {})
    return [(n, v) for n, v in module.items() if n not in others and isinstance(v, _unpickle.TensorRef)]


ADAM_STATE = frozenset({"step", "exp_avg", "exp_avg_sq"})
"""the per-group state DeepSpeed's ZeRO optimizer files hold for Adam, the only optimizer the
DeepSpeed writers lay out"""


def refuse_other_optimizer(state: Any, rel: str, doing: str) -> None:
    """Refuse a source whose optimizer keeps other state than Adam's (SGD's ``momentum_buffer``,
    Adagrad's ``sum``, AMSGrad's ``max_exp_avg_sq``): the writers lay out Adam's moments alone, and
    the refusal came late, as "<param>.exp_avg is not in the source checkpoint"."""
    extra = sorted(
        {str(k) for v in (state.values() if isinstance(state, dict) else ()) if isinstance(v, dict) for k in v}
        - ADAM_STATE
    )
    if extra:
        raise UsageError(
            f"{rel}: optimizer state {extra} is not Adam's; {doing} is not supported yet (DeepSpeed's layout is "
            "written for Adam's exp_avg and exp_avg_sq)",
            hint="'ckpttool convert --to dcp' or '--to torch' carries it, every tensor named by its parameter",
        )


class ZeroWriter:
    """A ZeRO-1/2 checkpoint at ``dp`` ranks from one of either stage (``stage``: the output's,
    None: the source's). ZeRO-1 and ZeRO-2 save the same layout: a change of stage rewrites the
    ``zero_stage`` the optimizer files record and the saved config's stage, and adds (ZeRO-2) or
    drops (ZeRO-1) the frozen parameters' shapes and values DeepSpeed saves only when it
    partitions gradients."""

    mp = 0
    """the model-parallel rank whose files this writer writes"""
    _own_files: set[str] | None = None
    """that rank's optimizer files, when the run is model-parallel (None: every piece is the rank's)"""
    bf16_optimizer = False
    """whether the source's optimizer files are BF16_Optimizer's (written so again)"""

    def __init__(
        self, root: Path, manifest: Manifest, dp: int, target_stage: int | None = None, mp: int | None = None
    ) -> None:
        """``mp``: the model-parallel rank whose files to write (:class:`ZeroModelParallelWriter`
        makes one writer per rank); None: a run without model or pipeline parallelism."""
        self.root, self.manifest, self.dp = root, manifest, dp
        self.mp = mp or 0
        self.scratch = _ptwrite.Scratch()  # one tensor buffer for every file this writer writes
        if dp < 1:
            raise UsageError("--dp must be at least 1")
        stage = manifest.layout.zero_stage or 0
        self.bf16_optimizer = manifest.extras.get("variant") == "BF16_Optimizer"
        if self.bf16_optimizer and target_stage not in (None, stage):
            raise UsageError(
                f"--zero-stage {target_stage}: DeepSpeed's BF16_Optimizer saved this checkpoint; its files can "
                "change DP size, not optimizer",
                hint="'ckpttool convert --to deepspeed-universal' writes a universal checkpoint, which DeepSpeed "
                "loads into any ZeRO stage",
            )
        if stage not in (1, 2) and not self.bf16_optimizer:
            what = "a universal checkpoint" if manifest.extras.get("variant") == "universal" else f"ZeRO stage {stage}"
            raise UsageError(
                f"--to deepspeed: writing ZeRO files from {what} is not supported yet (from the ZeRO-1/2/3 "
                "optimizers and BF16_Optimizer it is)",
                hint="'ckpttool convert --to dcp' keeps the state in a layout-free form",
            )
        model_rel = None
        optims: dict[int, str] = {}
        self.file_prefix = ""
        if mp is None and (shown := model_parallel(manifest)):
            raise UsageError(
                f"{shown}: a pipeline or model-parallel DeepSpeed checkpoint can change its DP size and its "
                "stage between ZeRO-1 and ZeRO-2 (not to or from ZeRO-3, yet) or be written as a universal one "
                "(--to deepspeed-universal)"
            )
        for f in manifest.files:
            if (m := _MODEL.match(f.path)) and int(m["mp"]) == self.mp:
                model_rel = f.path
            elif (m := _OPTIM.match(f.path)) and int(m["mp"]) == self.mp:
                optims[int(m["dp"])] = f.path
                self.file_prefix = m["prefix"] or ""
        if model_rel is None or not optims:
            raise CorruptFileError(
                f"{manifest.root}: no mp_rank_{self.mp:02d}_model_states.pt with ZeRO optimizer files"
            )
        self.tag_dir = model_rel.rsplit("/", 1)[0] if "/" in model_rel else ""
        self.model_rel, self.optim_rels = model_rel, optims
        self._own_files = set(optims.values()) if mp is not None else None
        archive, self.model_obj, _ = _pt.load(root, model_rel, ALLOWLIST)
        archive.close()
        archive, optim, _ = _pt.load(root, optims[0], ALLOWLIST)
        archive.close()
        self.optim_obj = optim
        osd = optim.get("optimizer_state_dict") if isinstance(optim, dict) else None
        if not isinstance(osd, dict) or "single_partition_of_fp32_groups" not in osd:
            raise CorruptFileError(f"{optims[0]}: not a ZeRO-1/2 optimizer file", path=optims[0])
        if osd.get("round_robin_gradients") or any(
            list(s) != sorted(s) for s in (osd.get("round_robin_indices") or [])
        ):  # not saved by 0.19; refuse rather than guess if a version does
            raise UsageError(f"{optims[0]}: round-robin gradient ordering is not supported yet")
        base = osd.get("base_optimizer_state")
        refuse_other_optimizer(base.get("state") if isinstance(base, dict) else None, optims[0], "resharding it")
        shapes = self.model_obj.get("param_shapes")
        pads = osd.get("param_alignment_paddings") or []
        if not isinstance(shapes, list) or len(shapes) != len(osd["single_partition_of_fp32_groups"]):
            raise CorruptFileError(f"{model_rel}: param_shapes does not match the optimizer's groups", path=model_rel)
        self.groups = [group_layout(s, dp, pads[g] if g < len(pads) else None) for g, s in enumerate(shapes)]
        for layout in self.groups:
            for name, shape, _off in layout.params:
                for suffix in ("fp32", "exp_avg", "exp_avg_sq"):
                    own = self._own(name, suffix).shape
                    if own != tuple(shape):
                        raise CorruptFileError(
                            f"{name}.{suffix}: model-parallel rank {self.mp}'s pieces make a {list(own or ())} "
                            f"tensor; its param_shapes say {list(shape)}",
                            path=self.model_rel,
                        )
        self.tag = self.tag_dir.rsplit("/", 1)[-1] if self.tag_dir else str(manifest.extras.get("tag") or "")
        self.source_stage: int = stage
        self.stage: int = target_stage or stage

    def _prefix(self) -> str:
        return f"{self.tag}/" if self.tag else ""

    def files(self) -> list[PlannedFile]:
        model = f"{self._prefix()}mp_rank_{self.mp:02d}_model_states.pt"
        out = [_ptwrite.planned(model, (-1,), self._model_tree(PLANNING, _ptwrite.unread))]
        for r in range(self.dp):
            name = f"{self._prefix()}{self.file_prefix}zero_pp_rank_{r}_mp_rank_{self.mp:02d}_optim_states.pt"
            out.append(_ptwrite.planned(name, (r,), self._optim_tree(r, PLANNING, _ptwrite.unread)))
        return out

    def last_files(self) -> list[str]:
        """The files :meth:`finish` writes once every planned file is written."""
        return ["latest"] if self.tag else []

    def finish(self, tmp: Path, results: list[Any]) -> None:
        """The ``latest`` file naming the tag directory, as DeepSpeed writes it."""
        if self.tag:
            (tmp / "latest").write_text(self.tag)

    def write(self, rank: int, out: Path, reader: PieceReader, progress: Callable[[int], None] | None) -> int:
        archive: Callable[[str], Any] = _pt.archive_cache(reader)  # the reader's open archives

        tree = self._model_tree(reader, archive) if rank < 0 else self._optim_tree(rank, reader, archive)
        n = _ptwrite.save(tree, out, scratch=self.scratch)
        if progress is not None:
            progress(n)
        return n

    def _model_tree(self, reader: PieceReader, archive: Callable[[str], Any]) -> Any:
        """The model states file's tree (``reader``: subclasses that build its tensors read them)."""
        tree = _ptwrite.carry(self._model_template(), partial(archive, self.model_rel))
        if isinstance(tree, dict) and "dp_world_size" in tree:
            tree["dp_world_size"] = self.dp
        return tree

    def _model_template(self) -> Any:
        """The source's model states, at the output's stage."""
        obj = self.model_obj
        if self.stage == self.source_stage or not isinstance(obj, dict):
            return obj
        obj = {**obj, "ds_config": with_stage(obj.get("ds_config"), self.stage)}
        if self.stage == 1:  # DeepSpeed saves the frozen parameters' shapes and values from ZeRO-2 on
            obj.update(frozen_param_shapes=None, frozen_param_fragments=None)
            return obj
        shapes, values = _unpickle.OrderedDictStandIn(), _unpickle.OrderedDictStandIn()
        for name, ref in frozen_of(obj):
            shapes[name] = _unpickle.TorchSize(ref.shape)
            values[name] = ref  # the module's tensor: pickled once, as DeepSpeed saves the parameter itself
        obj.update(frozen_param_shapes=shapes, frozen_param_fragments=values)
        return obj

    def _optim_tree(self, r: int, reader: PieceReader, archive: Callable[[str], Any]) -> Any:
        template = self.optim_obj
        if self.stage != self.source_stage:
            template = {**template, "ds_config": with_stage(template.get("ds_config"), self.stage)}
        src_rel = self.optim_rels[0]
        tree = _ptwrite.carry(
            {k: v for k, v in template.items() if k != "optimizer_state_dict"}, partial(archive, src_rel)
        )
        osd_src = template["optimizer_state_dict"]
        osd: dict[str, Any] = {}
        base_src = osd_src.get("base_optimizer_state") or {}
        if not isinstance(base_src, dict):
            raise UsageError(
                f"{src_rel}: an elastic ZeRO checkpoint (base_optimizer_state is a list); resharding it is not "
                "supported yet"
            )
        for key, value in osd_src.items():
            if key == "base_optimizer_state":
                state = {}
                for g, gstate in (base_src.get("state") or {}).items():
                    entry = {}
                    for k, v in gstate.items():
                        if k in ("exp_avg", "exp_avg_sq"):
                            entry[k] = self._partition(g, r, k, reader)
                        else:
                            entry[k] = _ptwrite.carry(v, partial(archive, src_rel))
                    state[g] = entry
                osd[key] = {**_ptwrite.carry(base_src, partial(archive, src_rel)), "state": state}
            elif key == "single_partition_of_fp32_groups":
                # ZeRO-1/2 save it without the alignment padding (``_get_groups_without_padding``),
                # BF16_Optimizer with it
                # with requires_grad set, as both keep it ("in case internal optimizer uses it")
                lean = not self.bf16_optimizer
                osd[key] = [
                    self._partition(g, r, "fp32", reader, lean=lean, requires_grad=True)
                    for g in range(len(self.groups))
                ]
            elif key == "group_paddings":
                osd[key] = [g.padding(r) for g in self.groups]
            elif key == "partition_count":
                osd[key] = [self.dp] * len(self.groups)
            elif key == "param_slice_mappings":
                osd[key] = [self._mappings(g, r) for g in range(len(self.groups))]
            elif key == "zero_stage" and isinstance(value, _unpickle.EnumValue):
                osd[key] = zero_stage_enum(value, self.stage)
            else:
                osd[key] = _ptwrite.carry(value, partial(archive, src_rel))
        tree["optimizer_state_dict"] = osd
        return {k: tree[k] for k in template}

    def _mappings(self, g: int, r: int) -> Any:
        cls = _unpickle.record(_FRAGMENT)
        out = _unpickle.OrderedDictStandIn()
        for name, _shape, _first, count, pos in self.groups[g].fragments(r):
            frag = cls()
            frag.__dict__.update(numel=count, start=pos)
            out[name] = frag
        return out

    def _partition(
        self, g: int, r: int, suffix: str, reader: PieceReader, lean: bool = False, requires_grad: bool = False
    ) -> _ptwrite.OutTensor:
        """Partition ``r`` of group ``g``'s flat ``suffix`` state (``lean``: without the padding)."""
        layout = self.groups[g]
        size = layout.partition - (layout.padding(r) if lean else 0)
        segments = [
            (self._own(name, suffix), shape, first, count, pos)
            for name, shape, first, count, pos in self.groups[g].fragments(r)
        ]
        dtype = segments[0][0].dtype if segments else "float32"
        return flat_tensor(dtype, size, segments, reader, requires_grad)

    def _own(self, param: str, suffix: str) -> Item:
        """The state ``suffix`` of ``param`` as this writer's model-parallel rank holds it: its
        pieces in that rank's optimizer files only, in the coordinates of the rank's own tensor (the
        manifest joins the TP slices of a parameter into one item where the checkpoint says how,
        and names each rank's copy ``<param>[tp=R]`` where it does not)."""
        tp = self.manifest.layout.tp or 1
        item = self.manifest.items.get(f"{param}.{suffix}") or self.manifest.items.get(
            f"{param}[tp={self.mp % tp}].{suffix}"
        )
        if item is None:
            raise CorruptFileError(f"{param}.{suffix} is not in the source checkpoint")
        if self._own_files is None:
            return item
        pieces = [p for p in item.pieces if p.file in self._own_files]
        boxes = sorted({p.box for p in pieces}, key=lambda b: b.offsets)
        if not boxes or any(b.sizes[1:] != boxes[0].sizes[1:] or b.offsets[1:] != boxes[0].offsets[1:] for b in boxes):
            raise CorruptFileError(
                f"{item.name}: the optimizer files of model-parallel rank {self.mp} hold "
                f"{'none' if not boxes else f'{len(boxes)} regions that do not stack on dim 0'} of it, expected "
                "one (or one per sub-parameter)"
            )
        # the rank's own tensor: its regions stacked on dim 0 in order (one per sub-parameter)
        local: dict[Box, Box] = {}
        row = 0
        for b in boxes:
            local[b] = Box((row, *(0,) * (len(b.sizes) - 1)), b.sizes)
            row += b.sizes[0]
        shape = (row, *boxes[0].sizes[1:])
        return replace(item, shape=shape, pieces=[replace(p, replica=0, box=local[p.box]) for p in pieces])


def copy_plan(root: Path, rel: str, path: str, key: tuple[int, ...]) -> PlannedFile:
    """The plan of a source file copied as it is to ``path``: its bytes and its tensors (the
    storages its zip directory lists, as a written file's plan counts them: ZeRO-3's module
    placeholders included, views into one flat buffer once), no tensor buffer."""
    with RandomAccessFile(confine(root, rel, named_by="the listing"), display=rel) as f:
        archive = _torchzip.Archive(f, display=rel)
        storages = sum(1 for name in archive.members if name.split("/")[-2:-1] == ["data"])
        return PlannedFile(path=path, key=key, nbytes=f.size, tensors=storages, largest=0)


def copy_source(root: Path, rel: str, out: Path, progress: Callable[[int], None] | None) -> int:
    """Copy the source file ``rel`` to ``out`` byte for byte; returns (and reports) its size."""
    shutil.copyfile(confine(root, rel), out)
    n = out.stat().st_size
    if progress is not None:
        progress(n)
    return n


def model_parallel(manifest: Manifest) -> str | None:
    """A file that shows a ZeRO checkpoint was saved by a pipeline or model-parallel run (a layer
    file, or the model states of a model-parallel rank other than 0); None when there is none."""
    for f in manifest.files:
        if _LAYER.match(f.path) or ((m := _MODEL.match(f.path)) is not None and int(m["mp"]) > 0):
            return f.path
    return None


class ZeroModelParallelWriter:
    """A ZeRO-1/2 checkpoint of a pipeline or model-parallel run at ``dp`` ranks and the same TP x
    PP, at either stage (``stage``; None: the source's). DeepSpeed keeps one ZeRO layout per
    model-parallel rank ``m``: its parameters (``param_shapes`` of ``mp_rank_{m}_model_states.pt``)
    flattened per group and partitioned over the DP ranks in
    ``zero_pp_rank_{r}_mp_rank_{m}_optim_states.pt``. Each rank's layout is written again for the
    new DP (and stage) by a :class:`ZeroWriter` of its own, reading that rank's files only; the
    pipeline's ``layer_*-model_states.pt`` files (module weights, which depend on neither) are
    copied byte for byte. A pipeline run at ZeRO-2 is refused: DeepSpeed's pipeline engine runs
    ZeRO-1 at most."""

    def __init__(self, root: Path, manifest: Manifest, dp: int, stage: int | None = None) -> None:
        ranks = sorted({int(m["mp"]) for f in manifest.files if (m := _MODEL.match(f.path))})
        if ranks != list(range(len(ranks))):
            raise CorruptFileError(f"{manifest.root}: model-parallel ranks {ranks}, expected 0 to {len(ranks) - 1}")
        self.layers = sorted(f.path for f in manifest.files if _LAYER.match(f.path))
        if self.layers and stage is not None and stage >= 2:
            raise UsageError(
                f"{self.layers[0]}: a pipeline run at ZeRO-{stage}: DeepSpeed's pipeline engine runs ZeRO-1 at "
                "most (it asserts 'ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism')",
                hint="leave --zero-stage out, or give 1",
            )
        self.ranks = [ZeroWriter(root, manifest, dp, stage, mp=m) for m in ranks]
        self.root = root

    def files(self) -> list[PlannedFile]:
        out = [replace(f, key=(m, *f.key)) for m, w in enumerate(self.ranks) for f in w.files()]
        prefix = self.ranks[0]._prefix()
        out += [
            copy_plan(self.root, rel, prefix + rel.rsplit("/", 1)[-1], (-1, k)) for k, rel in enumerate(self.layers)
        ]
        return out

    def last_files(self) -> list[str]:
        return self.ranks[0].last_files()

    def finish(self, tmp: Path, results: list[Any]) -> None:
        self.ranks[0].finish(tmp, results)

    def write(self, m: int, k: int, out: Path, reader: PieceReader, progress: Callable[[int], None] | None) -> int:
        if m < 0:
            return copy_source(self.root, self.layers[k], out, progress)
        return self.ranks[m].write(k, out, reader, progress)


Segment = tuple[Any, tuple[int, ...], int, int, int]
"""(item, its shape, first element of it, element count, position in the flat tensor)"""


def flat_tensor(
    dtype: str | None, size: int, segments: list[Segment], reader: PieceReader, requires_grad: bool = False
) -> _ptwrite.OutTensor:
    """A flat tensor of ``size`` elements made of the ``segments`` (in position order, not
    overlapping), zeros between and after them: a ZeRO partition. Bigger than ``CARRY_PART``, it
    is produced in parts of that size, each assembled from the ranges of the segments it covers,
    so a partition of any size is written holding two parts at a time (one filled while the other
    is written)."""
    assert dtype is not None
    itemsize = carrier(dtype).itemsize

    def fill_range(buf: np.ndarray, lo: int, hi: int) -> None:
        values = buf.view(carrier(dtype))
        end = lo  # elements before this are written; gaps between segments are padding (zeros)
        for item, shape, first, count, pos in segments:
            a, b = max(pos, lo), min(pos + count, hi)
            if a >= b:
                continue
            values[end - lo : a - lo] = 0
            at = a - lo
            for box in flat_range_boxes(Box.whole(shape), first + a - pos, b - a):
                assemble(reader, item, out=values[at : at + box.volume].reshape(box.sizes), box=box)
                at += box.volume
            end = b
        values[end - lo : hi - lo] = 0

    out = _ptwrite.OutTensor(dtype=dtype, shape=(size,), fill=partial(fill_range, lo=0, hi=size),
                             requires_grad=requires_grad)  # fmt: skip
    out.spans = tuple((pos * itemsize, count * itemsize) for _item, _shape, _first, count, pos in segments)
    per = max(1, _ptwrite.CARRY_PART // itemsize)
    if size > per:

        def parts() -> Any:
            for lo in range(0, size, per):
                hi = min(size, lo + per)
                yield (hi - lo) * itemsize, partial(fill_range, lo=lo, hi=hi)

        out.parts = parts
    return out


_Z3_OPTIM = re.compile(r"^(?P<dir>(?:.*/)?)(?P<prefix>bf16_)?zero_pp_rank_(?P<dp>\d+)_mp_rank_00_optim_states\.pt$")
_Z3_MODEL = re.compile(r"^(?P<dir>(?:.*/)?)zero_pp_rank_(?P<dp>\d+)_mp_rank_00_model_states\.pt$")
SUB_GROUP_SIZE = 1_000_000_000
"""DeepSpeed's default ``zero_optimization.sub_group_size``."""


def zero3_sub_groups(params: list[tuple[str, tuple[int, ...]]], dp: int, sub_group_size: int) -> list[list[int]]:
    """DeepSpeed ZeRO-3's sub-groups of one param group at ``dp`` ranks (``_create_fp16_sub_groups``):
    indices into ``params``, a sub-group closed once its partitions (``ceil(numel / dp)`` elements
    each) reach ``sub_group_size``; one sub-group when the whole group's partitions fit."""
    sizes = [-(-math.prod(shape) // dp) for _, shape in params]
    if sub_group_size >= sum(sizes):
        return [list(range(len(params)))]
    out: list[list[int]] = []
    current: list[int] = []
    held = 0
    for k, size in enumerate(sizes):
        current.append(k)
        held += size
        if held >= sub_group_size or k == len(params) - 1:
            out.append(current)
            current, held = [], 0
    return out


class Zero3Writer:
    """A DeepSpeed ZeRO-3 checkpoint at a new data-parallel size, from one at any other.

    ZeRO-3 partitions every parameter on its own: rank ``r`` holds elements ``[r·P, (r+1)·P)`` of
    each (``P = ceil(numel / DP)``, the last rank's part padded with zeros), and keeps them back to
    back in one flat fp32 tensor per *sub-group* (``fp32_flat_groups``), with the Adam moments of
    that sub-group in the inner optimizer's state under the sub-group's index. Sub-groups cut each
    param group where the partitions reach ``sub_group_size``, so they depend on DP: they are laid
    out again (:func:`zero3_sub_groups`), and ``param_shapes`` in every model-states file with them.
    Each rank's ``zero_pp_rank_r_mp_rank_00_model_states.pt`` also holds its part of the frozen
    parameters (``frozen_param_fragments``); the tied-weight map is on rank 0 only, as DeepSpeed
    saves it. Everything else (module placeholders and buffers, scheduler, counters, config, loss
    scaler, the param groups' hyper-parameters and step) is carried."""

    def __init__(self, root: Path, manifest: Manifest, dp: int | None) -> None:
        """``dp`` None: the source's DP and sub-groups, as saved (for the writers that read a
        ZeRO-3 checkpoint through this one and do not lay sub-groups out again)."""
        self.root, self.manifest = root, manifest
        self.scratch = _ptwrite.Scratch()
        if dp is not None and dp < 1:
            raise UsageError("--dp must be at least 1")
        self._load_source()
        optims, models = self.optim_rels, self.model_rels
        osd = self.optim_obj.get("optimizer_state_dict") if isinstance(self.optim_obj, dict) else None
        inner = osd.get("optimizer_state_dict") if isinstance(osd, dict) else None
        if not isinstance(osd, dict) or "fp32_flat_groups" not in osd or not isinstance(inner, dict):
            raise CorruptFileError(f"{optims[0]}: not a ZeRO-3 optimizer file", path=optims[0])
        if osd.get("ds_zero_partition_groups") is not None:
            raise UsageError(
                f"{optims[0]}: a ZeRO-3 checkpoint with its own partition groups (AutoEP); resharding it is not "
                "supported yet"
            )
        shapes = self.model_obj.get("param_shapes")
        groups = inner.get("param_groups") or []
        subs = [list(g.get("params") or []) for g in groups]
        if not isinstance(shapes, list) or sorted(i for ids in subs for i in ids) != list(range(len(shapes))):
            raise CorruptFileError(
                f"{models[0]}: param_shapes ({len(shapes) if isinstance(shapes, list) else 'none'} sub-groups) does "
                f"not match the optimizer's param groups (sub-groups {subs})",
                path=models[0],
            )
        source_dp = int(osd.get("partition_count") or len(optims))
        self.dp = source_dp if dp is None else dp
        size = self._sub_group_size(shapes, subs, source_dp, models[0]) if dp is not None else 0
        state = inner.get("state") or {}
        self.groups: list[dict[str, Any]] = []
        """per param group: its hyper-parameters and its source step"""
        self.subgroups: list[tuple[int, list[tuple[str, tuple[int, ...]]]]] = []
        """(param group, [(name, shape)]) of each new sub-group, in order"""
        self.shape_objs: dict[str, Any] = {}
        for g, group in enumerate(groups):
            params: list[tuple[str, tuple[int, ...]]] = []
            for sid in subs[g]:
                for name, shape in shapes[sid].items():
                    self.shape_objs[name] = shape
                    params.append((name, tuple(int(x) for x in shape)))
            step = (state.get(subs[g][0]) or {}).get("step") if subs[g] else None
            self.groups.append({"hyper": {k: v for k, v in group.items() if k != "params"}, "step": step})
            if dp is None:  # as saved
                for sid in subs[g]:
                    self.subgroups.append((g, [(n, tuple(int(x) for x in s)) for n, s in shapes[sid].items()]))
                continue
            for ids in zero3_sub_groups(params, dp, size):
                self.subgroups.append((g, [params[k] for k in ids]))
        refuse_other_optimizer(state, optims[0], "resharding it")
        for _, params in self.subgroups:
            for name, _shape in params:
                for suffix in ("fp32", "exp_avg", "exp_avg_sq"):
                    if f"{name}.{suffix}" not in manifest.items:
                        raise CorruptFileError(f"{name}.{suffix} is not in the source checkpoint")
        self.frozen = [
            (n, tuple(int(x) for x in s)) for n, s in (self.model_obj.get("frozen_param_shapes") or {}).items()
        ]

    def _load_source(self) -> None:
        """The source's files (``model_rels``, ``optim_rels`` by rank), rank 0's model states and
        optimizer file (``model_obj``, ``optim_obj``), ``file_prefix``, ``tag_dir`` and ``tag``."""
        models: dict[int, str] = {}
        optims: dict[int, str] = {}
        self.file_prefix = ""
        for f in self.manifest.files:
            if m := _Z3_MODEL.match(f.path):
                models[int(m["dp"])] = f.path
            elif m := _Z3_OPTIM.match(f.path):
                optims[int(m["dp"])] = f.path
                self.file_prefix = m["prefix"] or ""
            elif re.search(r"mp_rank_(?!00_)\d+_\w+_states\.pt$", f.path) or "layer_" in f.path.rsplit("/", 1)[-1]:
                raise UsageError(f"{f.path}: model-parallel or pipeline ZeRO-3 checkpoints cannot be resharded yet")
        if 0 not in models or 0 not in optims or sorted(models) != sorted(optims):
            raise CorruptFileError(
                f"{self.manifest.root}: expected one ZeRO-3 model-states and one optimizer file per rank, found "
                f"model states of ranks {sorted(models)} and optimizer files of ranks {sorted(optims)}"
            )
        self.model_rels, self.optim_rels = models, optims
        self.tag_dir = models[0].rsplit("/", 1)[0] if "/" in models[0] else ""
        self.tag = self.tag_dir.rsplit("/", 1)[-1] if self.tag_dir else str(self.manifest.extras.get("tag") or "")
        archive, self.model_obj, _ = _pt.load(self.root, models[0], ALLOWLIST)
        archive.close()
        archive, self.optim_obj, _ = _pt.load(self.root, optims[0], ALLOWLIST)
        archive.close()

    def _sub_group_size(self, shapes: list[Any], subs: list[list[int]], dp: int, rel: str) -> int:
        """``zero_optimization.sub_group_size`` from the saved ``ds_config`` (DeepSpeed's default
        when it has none), checked against the source: its param groups cut into sub-groups at
        the source's DP must give the sub-groups the checkpoint has. DeepSpeed saves the config's
        path instead of the config when it was launched with one: then the default is tried."""
        config = self.model_obj.get("ds_config")
        zero = config.get("zero_optimization") if isinstance(config, dict) else None
        value = zero.get("sub_group_size") if isinstance(zero, dict) else None
        size = int(value) if isinstance(value, int | float) and value >= 0 else SUB_GROUP_SIZE
        for ids in subs:
            params = [(n, tuple(int(x) for x in s)) for sid in ids for n, s in shapes[sid].items()]
            cut = zero3_sub_groups(params, dp, size)
            if [len(c) for c in cut] != [len(shapes[sid]) for sid in ids]:
                said = f"sub_group_size {value}" if value is not None else f"no sub_group_size (default {size:,})"
                raise UsageError(
                    f"{rel}: the saved config gives {said}, which cuts the param groups into other sub-groups "
                    f"({[len(c) for c in cut]} parameters) than the checkpoint's "
                    f"({[len(shapes[sid]) for sid in ids]}); the new sub-groups cannot be laid out",
                    hint="the saved ds_config is not the config the run used (DeepSpeed saves the path of a config "
                    "file instead of the config when launched with one)",
                )
        return size

    def _prefix(self) -> str:
        return f"{self.tag}/" if self.tag else ""

    def _part(self, numel: int) -> int:
        return -(-numel // self.dp)

    def files(self) -> list[PlannedFile]:
        out = []
        for r in range(self.dp):
            model = f"{self._prefix()}zero_pp_rank_{r}_mp_rank_00_model_states.pt"
            out.append(_ptwrite.planned(model, (r, 0), self._model_tree(r, PLANNING, _ptwrite.unread)))
            name = f"{self._prefix()}{self.file_prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
            out.append(_ptwrite.planned(name, (r, 1), self._optim_tree(r, PLANNING, _ptwrite.unread)))
        return out

    def last_files(self) -> list[str]:
        """The files :meth:`finish` writes once every planned file is written."""
        return ["latest"] if self.tag else []

    def finish(self, tmp: Path, results: list[Any]) -> None:
        if self.tag:
            (tmp / "latest").write_text(self.tag)

    def write(
        self, rank: int, which: int, out: Path, reader: PieceReader, progress: Callable[[int], None] | None
    ) -> int:
        archive: Callable[[str], Any] = _pt.archive_cache(reader)
        tree = self._model_tree(rank, reader, archive) if which == 0 else self._optim_tree(rank, reader, archive)
        n = _ptwrite.save(tree, out, scratch=self.scratch)
        if progress is not None:
            progress(n)
        return n

    def _model_tree(self, r: int, reader: PieceReader, archive: Callable[[str], Any]) -> Any:
        src = self.model_rels[0]
        tree: dict[str, Any] = {}
        for key, value in self.model_obj.items():
            if key == "param_shapes":
                shapes = []
                for _, params in self.subgroups:
                    d = _unpickle.OrderedDictStandIn()
                    for name, _shape in params:
                        d[name] = _ptwrite.carry(self.shape_objs[name], partial(archive, src))
                    shapes.append(d)
                tree[key] = shapes
            elif key == "frozen_param_fragments" and isinstance(value, dict):
                frags = _unpickle.OrderedDictStandIn()
                for name, shape in self.frozen:
                    frags[name] = self._flat(r, [(name, shape)], "fp32", reader)
                tree[key] = frags
            elif key == "shared_params" and r > 0:
                tree[key] = {}  # DeepSpeed computes the tied-weight map on global rank 0 only
            elif key == "dp_world_size":
                tree[key] = self.dp
            else:
                tree[key] = _ptwrite.carry(value, partial(archive, src))
        return tree

    def _optim_tree(self, r: int, reader: PieceReader, archive: Callable[[str], Any]) -> Any:
        src = self.optim_rels[0]
        template = self.optim_obj
        tree = _ptwrite.carry({k: v for k, v in template.items() if k != "optimizer_state_dict"}, partial(archive, src))
        osd: dict[str, Any] = {}
        for key, value in template["optimizer_state_dict"].items():
            if key == "optimizer_state_dict":
                state: dict[int, Any] = {}
                members: dict[int, list[int]] = {g: [] for g in range(len(self.groups))}
                for sid, (g, params) in enumerate(self.subgroups):
                    entry: dict[str, Any] = {}
                    step = self.groups[g]["step"]
                    if step is not None:
                        entry["step"] = _ptwrite.carry(step, partial(archive, self.groups[g].get("step_rel", src)))
                    entry["exp_avg"] = self._flat(r, params, "exp_avg", reader)
                    entry["exp_avg_sq"] = self._flat(r, params, "exp_avg_sq", reader)
                    state[sid] = entry
                    members[g].append(sid)
                groups = [
                    {**_ptwrite.carry(self.groups[g]["hyper"], partial(archive, src)), "params": members[g]}
                    for g in range(len(self.groups))
                ]
                osd[key] = {"state": state, "param_groups": groups}
            elif key == "fp32_flat_groups":
                osd[key] = [self._flat(r, params, "fp32", reader, requires_grad=True) for _, params in self.subgroups]
            elif key == "partition_count":
                osd[key] = self.dp
            else:
                osd[key] = _ptwrite.carry(value, partial(archive, src))
        tree["optimizer_state_dict"] = osd
        return {k: tree[k] for k in template}

    def _flat(
        self,
        r: int,
        params: list[tuple[str, tuple[int, ...]]],
        suffix: str,
        reader: PieceReader,
        requires_grad: bool = False,
    ) -> _ptwrite.OutTensor:
        """Rank ``r``'s partitions of ``params``' ``suffix`` state, back to back (zeros past a
        parameter's end)."""
        segments: list[Segment] = []
        pos = 0
        for name, shape in params:
            numel = math.prod(shape)
            part = self._part(numel)
            first = min(numel, r * part)
            segments.append((self.manifest.items[f"{name}.{suffix}"], shape, first, min(part, numel - first), pos))
            pos += part
        dtype = segments[0][0].dtype if segments else "float32"
        return flat_tensor(dtype, pos, segments, reader, requires_grad)


def universal_names(manifest: Manifest, model_obj: Any) -> tuple[str, str]:
    """The tag and optimizer-file prefix of the run a universal checkpoint was made from: the tag
    its ``<tag>_universal`` folder is named after (else ``global_step<step>``), and ``bf16_`` when
    the module is bf16 (DeepSpeed's name for a bf16 run's optimizer files)."""
    name = Path(manifest.root).name
    tag = name.removesuffix("_universal") if name.endswith("_universal") else f"global_step{manifest.step or 0}"
    module = model_obj.get("module") if isinstance(model_obj, dict) else None
    values = module.values() if isinstance(module, dict) else []
    bf16 = any(isinstance(v, _unpickle.TensorRef) and v.dtype == "bfloat16" for v in values)
    return tag, "bf16_" if bf16 else ""


class Zero3FromUniversalWriter(Zero3Writer):
    """ZeRO-3 files at ``dp`` ranks from DeepSpeed's universal checkpoint of a ZeRO-3 run: the
    copied ``zero_pp_rank_*_model_states.pt`` are the model states, ``zero/optimizer_state.pt``
    (rank 0's whole optimizer state) the optimizer file's template; the values come from the
    per-parameter flat files. Resuming from these, unlike DeepSpeed 0.19.8's ZeRO-3
    ``load_universal``, restores frozen parameters and buffers, every param group's own
    hyper-parameters and one Adam step per sub-group."""

    def _load_source(self) -> None:
        models: dict[int, str] = {}
        optim_rel = None
        for f in self.manifest.files:
            if m := _Z3_MODEL.match(f.path):
                models[int(m["dp"])] = f.path
            elif f.path.endswith("zero/optimizer_state.pt"):
                optim_rel = f.path
        if 0 not in models or optim_rel is None:
            raise UsageError(
                f"{self.manifest.root}: a universal checkpoint without zero_pp_rank_*_model_states.pt and "
                "zero/optimizer_state.pt: not one of a ZeRO-3 run"
            )
        self.model_rels, self.optim_rels = models, {0: optim_rel}
        archive, self.model_obj, _ = _pt.load(self.root, models[0], ALLOWLIST)
        archive.close()
        archive, state, _ = _pt.load(self.root, optim_rel, ALLOWLIST)
        archive.close()
        if not isinstance(state, dict):
            raise CorruptFileError(f"{optim_rel}: not an optimizer state", path=optim_rel)
        osd = {k: v for k, v in state.items() if k != "param_groups"}  # ds_to_universal's copy of the inner ones
        top = {"optimizer_state_dict": osd}
        top.update({k: self.model_obj.get(k) for k in ("ds_config", "ds_version")})
        self.optim_obj = top
        self.tag_dir, (self.tag, self.file_prefix) = "", universal_names(self.manifest, self.model_obj)
        self.stage = self.source_stage = 3


_CAST_SLICE = 1 << 20
"""Elements converted at once between float32 and bfloat16 (a few MB of temporaries)."""


def _nothing(buf: np.ndarray) -> None:
    """The fill of an empty tensor (ZeRO-3's module placeholders)."""


class Zero3From12Writer(Zero3Writer):
    """A ZeRO-3 checkpoint at ``dp`` ranks from a ZeRO-1/2 one: the state DeepSpeed's ZeRO-3 engine
    saves for the same run, its param groups cut into sub-groups of ``sub_group_size`` (which the
    ZeRO-1/2 checkpoint does not record: the value the resuming config gives, DeepSpeed's default
    otherwise).

    - ``zero_pp_rank_r_mp_rank_00_model_states.pt``: the ZeRO-1/2 model states with the module's
      parameters as ZeRO-3's empty placeholders (buffers kept), ``param_shapes`` per sub-group,
      each rank's part of every frozen parameter, the tied-weight map on rank 0 only;
    - ``…_optim_states.pt``: ZeRO-3's layout (see :class:`Zero3Writer`) with the ZeRO-1/2 run's
      loss scaler, hyper-parameters and step."""

    def __init__(self, root: Path, manifest: Manifest, dp: int, sub_group_size: int | None) -> None:
        if dp < 1:
            raise UsageError("--dp must be at least 1")
        self.root, self.manifest, self.dp = root, manifest, dp
        self.scratch = _ptwrite.Scratch()
        src: ZeroWriter  # parses and checks the source
        if manifest.extras.get("variant") == "universal":  # ds_to_universal's output of a ZeRO-1/2 run
            src = ZeroFromUniversalWriter(root, manifest, 1, None)
        else:
            src = ZeroWriter(root, manifest, manifest.layout.dp or 1)
        if src.bf16_optimizer:
            raise UsageError(
                "--zero-stage 3: the checkpoint is BF16_Optimizer's (its state has no loss scaler or stage for "
                "ZeRO-3's files); --to deepspeed writes that optimizer's files again (at --dp N)",
                hint="DeepSpeed's checkpoint.load_universal loads its universal checkpoint into an engine at any "
                "ZeRO stage",
            )
        steps: dict[int, tuple[str, Any]] = getattr(src, "steps", {})
        self.source_stage, self.stage = src.source_stage, 3
        self.tag_dir, self.tag, self.file_prefix = src.tag_dir, src.tag, src.file_prefix
        self.model_rels, self.optim_rels = {0: src.model_rel}, {0: src.optim_rels[0]}
        size = SUB_GROUP_SIZE if sub_group_size is None else sub_group_size
        model, optim = src.model_obj, src.optim_obj
        osd = optim["optimizer_state_dict"]
        base = osd.get("base_optimizer_state") or {}
        if not isinstance(base, dict):
            raise UsageError(
                f"{src.optim_rels[0]}: an elastic ZeRO checkpoint; writing ZeRO-3 from it is not supported yet"
            )
        state = base.get("state") or {}
        self.groups, self.subgroups, self.shape_objs = [], [], {}
        for g, group in enumerate(base.get("param_groups") or []):
            shapes = model["param_shapes"][g]
            params = [(n, tuple(int(x) for x in s)) for n, s in shapes.items()]
            self.shape_objs.update(shapes)
            step = (state.get(g) or {}).get("step")
            hyper = {k: v for k, v in group.items() if k != "params"}
            if g in steps:  # a universal checkpoint's: in the group's first parameter's step.pt
                self.groups.append({"hyper": hyper, "step": steps[g][1], "step_rel": steps[g][0]})
            else:
                self.groups.append({"hyper": hyper, "step": step})
            for ids in zero3_sub_groups(params, dp, size):
                self.subgroups.append((g, [params[k] for k in ids]))
        refuse_other_optimizer(state, src.optim_rels[0], "writing ZeRO-3 from it")
        module = model.get("module") if isinstance(model.get("module"), dict) else {}
        buffers = set(model.get("buffer_names") or [])
        self.frozen = [(n, tuple(v.shape)) for n, v in frozen_of(model)]
        placeholders = type(module)()
        placeholders.__dict__.update(getattr(module, "__dict__", {}))
        for name, value in module.items():
            if name in buffers or not isinstance(value, _unpickle.TensorRef):
                placeholders[name] = value
            else:
                placeholders[name] = _ptwrite.OutTensor(value.dtype, (0,), _nothing)
        frozen_shapes = _unpickle.OrderedDictStandIn()
        for name, shape in self.frozen:
            frozen_shapes[name] = _unpickle.TorchSize(shape)
        config = with_stage(model.get("ds_config"), 3, size)
        self.model_obj = {}
        for key, value in model.items():
            if key == "module":
                value = placeholders
            elif key == "frozen_param_shapes":
                value = frozen_shapes
            elif key == "frozen_param_fragments":
                value = {}  # filled per rank by _model_tree
            elif key == "ds_config":
                value = config
            self.model_obj[key] = value
        z3 = {
            "zero_stage": zero_stage_enum(osd.get("zero_stage"), 3),
            "loss_scaler": osd.get("loss_scaler"),
            "dynamic_loss_scale": osd.get("dynamic_loss_scale", False),
            "overflow": osd.get("overflow", False),
            "partition_count": dp,
            "optimizer_state_dict": None,
            "fp32_flat_groups": None,
        }
        self.optim_obj = {
            k: z3 if k == "optimizer_state_dict" else with_stage(v, 3, size) if k == "ds_config" else v
            for k, v in optim.items()
        }


def refuse_model_parallel_universal(manifest: Manifest) -> None:
    """Refuse ZeRO files from the universal checkpoint of a tensor- or pipeline-parallel run
    (whatever the target): its ``zero/`` folders hold whole tensors and its model states each
    rank's slices, and cutting the one by the other's split rules is not written yet."""
    lay = manifest.layout
    degrees = {k: v for k, v in (("TP", lay.tp or 1), ("PP", lay.pp or 1)) if v > 1}
    models = sum(1 for f in manifest.files if _MODEL.match(f.path))
    if models > 1 and not degrees:  # (model states of several ranks, whatever their degrees say)
        degrees = {"model-parallel ranks": models}
    if degrees:
        raise UsageError(
            f"{manifest.root}: the universal checkpoint of a model-parallel run "
            f"({', '.join(f'{k}={v}' for k, v in degrees.items())}): its zero/ folders hold whole tensors, its "
            "model states each rank's slices; writing ZeRO files from it is not supported yet, at any --tp, --pp "
            "or --dp",
            hint="load it with DeepSpeed's checkpoint.load_universal, at any TP, PP and DP, or reshard the "
            "checkpoint it was made from (ckpttool reshard SRC -o DST --to deepspeed --dp N)",
        )


class ZeroFromUniversalWriter(ZeroWriter):
    """ZeRO-1/2 files at ``dp`` ranks from DeepSpeed's universal checkpoint of a ZeRO-1/2 run (what
    ``ds_to_universal`` writes: ``zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt``, the run's
    ``mp_rank_00_model_states.pt`` copied, and ``zero/optimizer_state.pt``, the optimizer state
    without its partitioned parts). The model states are the copied file's; the optimizer files
    take ZeRO-1/2's layout at ``dp`` with the loss scaler, clip, paddings and param groups of
    ``optimizer_state.pt`` and each group's step from its parameters' ``step.pt``. Resuming from
    these, unlike ``checkpoint.load_universal``, restores the frozen parameters and buffers."""

    def __init__(self, root: Path, manifest: Manifest, dp: int, target_stage: int | None) -> None:
        if dp < 1:
            raise UsageError("--dp must be at least 1")
        self.root, self.manifest, self.dp = root, manifest, dp
        self.scratch = _ptwrite.Scratch()
        paths = {f.path for f in manifest.files}
        model_rel = next((p for p in sorted(paths) if _MODEL.match(p)), None)
        optim_rel = next((p for p in sorted(paths) if p.endswith("zero/optimizer_state.pt")), None)
        if model_rel is None or optim_rel is None:
            raise UsageError(
                f"{manifest.root}: a universal checkpoint without mp_rank_00_model_states.pt and "
                "zero/optimizer_state.pt (from ZeRO-3, or with tensor or pipeline parallelism): writing ZeRO files "
                "from it is not supported yet"
            )
        self.model_rel, self.optim_rels = model_rel, {0: optim_rel}
        archive, self.model_obj, _ = _pt.load(root, model_rel, ALLOWLIST)
        archive.close()
        refuse_model_parallel_universal(manifest)
        archive, state, _ = _pt.load(root, optim_rel, ALLOWLIST)
        archive.close()
        stage = state.get("zero_stage") if isinstance(state, dict) else None
        # BF16_Optimizer's state records no stage and no loss scaler; its files are written again
        self.bf16_optimizer = isinstance(state, dict) and stage is None and "group_paddings" in state
        if self.bf16_optimizer:
            if target_stage not in (None, 1):
                raise UsageError(
                    f"--zero-stage {target_stage}: {optim_rel} is the universal state of a BF16_Optimizer run; "
                    "--to deepspeed writes that optimizer's files again (at --dp N), not ZeRO-1/2's",
                    hint="DeepSpeed's checkpoint.load_universal loads it into an engine at any ZeRO stage",
                )
            self.source_stage = self.stage = 1
        elif not isinstance(stage, _unpickle.EnumValue) or stage.value not in (1, 2):
            raise UsageError(f"{optim_rel}: not the optimizer state of a ZeRO-1/2 run (zero_stage {stage})")
        else:
            self.source_stage = int(stage.value)
            self.stage = target_stage or self.source_stage
        self.tag_dir, (self.tag, self.file_prefix) = "", universal_names(manifest, self.model_obj)
        shapes = self.model_obj.get("param_shapes")
        groups = state.get("param_groups") or []
        pads = state.get("param_alignment_paddings") or []
        if not isinstance(shapes, list) or len(shapes) != len(groups):
            raise CorruptFileError(f"{model_rel}: param_shapes does not match the optimizer's groups", path=model_rel)
        self.groups = [group_layout(s, dp, pads[g] if g < len(pads) else None) for g, s in enumerate(shapes)]
        self.steps: dict[int, tuple[str, Any]] = {}
        """each param group's step: its first parameter's step.pt and the tensor in it"""
        for g, layout in enumerate(self.groups):
            for name_, _shape, _off in layout.params:
                for suffix in ("fp32", "exp_avg", "exp_avg_sq"):
                    if f"{name_}.{suffix}" not in manifest.items:
                        raise CorruptFileError(f"{name_}.{suffix} is not in the universal checkpoint")
            first = layout.params[0][0] if layout.params else None
            step_rel = optim_rel.removesuffix("optimizer_state.pt") + f"{first}/step.pt"
            if first is not None and step_rel in paths:
                archive, step, _ = _pt.load(root, step_rel, ALLOWLIST)
                archive.close()
                self.steps[g] = (step_rel, step)
        keys = ("loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad")
        osd: dict[str, Any] = {k: state[k] for k in keys if k in state}
        states = {g: {"step": None, "exp_avg": None, "exp_avg_sq": None} for g in self.steps}
        osd["base_optimizer_state"] = {"state": states, "param_groups": groups}
        osd["single_partition_of_fp32_groups"] = None
        later = ("zero_stage", "group_paddings", "param_alignment_paddings", "partition_count", "ds_version")
        for key in later if not self.bf16_optimizer else ("group_paddings", "partition_count", "ds_version"):
            osd[key] = state.get(key)  # (in the order each optimizer's state_dict gives them)
        osd["param_slice_mappings"] = None
        self.optim_obj = {
            "optimizer_state_dict": osd,
            "ds_config": self.model_obj.get("ds_config"),
            "ds_version": self.model_obj.get("ds_version"),
        }

    def _optim_tree(self, r: int, reader: PieceReader, archive: Callable[[str], Any]) -> Any:
        tree = super()._optim_tree(r, reader, archive)
        state = tree["optimizer_state_dict"]["base_optimizer_state"]["state"]
        for g, (rel, step) in self.steps.items():  # each group's step, from its first parameter's step.pt
            state[g]["step"] = _ptwrite.carry(step, partial(archive, rel))
        return tree


class ZeroFrom3Writer(ZeroWriter):
    """A ZeRO-1/2 checkpoint at ``dp`` ranks from a ZeRO-3 one: the state DeepSpeed's ZeRO-1/2
    engine saves for the same run.

    - ``mp_rank_00_model_states.pt``: the ZeRO-3 model states (rank 0's) with the module whole:
      each trainable parameter its fp32 master in the module's dtype (what ZeRO copies into the
      module after each step), each frozen parameter gathered from every rank's fragment, a tied
      alias its owner's value, buffers as saved; ``param_shapes`` one mapping per param group (the
      ZeRO-3 sub-groups joined); ZeRO-2's frozen shapes and values, none at ZeRO-1.
    - ``zero_pp_rank_r_mp_rank_00_optim_states.pt``: ZeRO-1/2's layout (see :class:`ZeroWriter`),
      one flat group per param group, with the ZeRO-3 run's loss scaler, hyper-parameters and step,
      ``clip_grad`` from the saved config's ``gradient_clipping``, and the parameters padded as
      the saved config's ``zero_optimization.parameter_alignment`` pads them (not, when the config
      was saved as a path: DeepSpeed's default)."""

    def __init__(self, root: Path, manifest: Manifest, dp: int, stage: int) -> None:
        if dp < 1:
            raise UsageError("--dp must be at least 1")
        self.root, self.manifest, self.dp, self.stage, self.source_stage = root, manifest, dp, stage, 3
        self.scratch = _ptwrite.Scratch()
        universal = manifest.extras.get("variant") == "universal"
        source = Zero3FromUniversalWriter if universal else Zero3Writer
        src = self.src = source(root, manifest, None)  # the sub-groups are joined: their size is moot
        self.tag_dir, self.tag, self.file_prefix = src.tag_dir, src.tag, src.file_prefix
        self.model_rel, self.model_obj = src.model_rels[0], src.model_obj
        self.optim_rels = {0: src.optim_rels[0]}  # the archive the carried optimizer objects come from
        module = src.model_obj.get("module")
        self.module = module if isinstance(module, dict) else {}
        self.buffers = set(src.model_obj.get("buffer_names") or [])
        self.shared = dict(src.model_obj.get("shared_params") or {})
        for name, ref in self.module.items():
            if name in self.buffers or not isinstance(ref, _unpickle.TensorRef):
                continue
            owner = self.shared.get(name, name)
            if f"{owner}.fp32" not in manifest.items:
                raise CorruptFileError(f"{name}: no value for it in the ZeRO-3 checkpoint (no {owner}.fp32)")
            if ref.dtype not in ("float32", "bfloat16"):
                raise UsageError(
                    f"{self.model_rel}: module parameter {name} is {ref.dtype}; writing ZeRO-1/2 from a {ref.dtype} "
                    "ZeRO-3 run is not supported yet (float32 and bfloat16 are)"
                )
        self.param_groups: list[_unpickle.OrderedDictStandIn] = []
        for g in range(len(src.groups)):
            shapes = _unpickle.OrderedDictStandIn()
            for sg, params in src.subgroups:
                if sg == g:
                    for name, _shape in params:
                        shapes[name] = src.shape_objs[name]
            self.param_groups.append(shapes)
        config = src.model_obj.get("ds_config")
        zero = config.get("zero_optimization") if isinstance(config, dict) else None
        aligned = bool(zero.get("parameter_alignment")) if isinstance(zero, dict) else False
        dtypes = {
            ref.dtype
            for n, ref in self.module.items()
            if isinstance(ref, _unpickle.TensorRef) and n not in self.buffers
        }
        self.paddings = [self._paddings(shapes, dtypes, aligned) for shapes in self.param_groups]
        self.groups = [
            group_layout(shapes, dp, pads) for shapes, pads in zip(self.param_groups, self.paddings, strict=True)
        ]
        self.optim_obj = self._optim_template()

    @staticmethod
    def _paddings(shapes: dict[str, Any], dtypes: set[str], aligned: bool) -> list[int]:
        """ZeRO-1/2's ``param_alignment_paddings`` of a group (``zero_optimization.parameter_alignment``:
        each parameter but the last padded to 16 bytes of the module's dtype; none without it)."""
        if not aligned:
            return [0] * len(shapes)
        size = max(carrier(d).itemsize for d in dtypes) if dtypes else 4
        step, at, out = 16 // math.gcd(16, size), 0, []
        for k, shape in enumerate(shapes.values()):
            at += math.prod(int(x) for x in shape)
            pad = 0 if k == len(shapes) - 1 else (-at) % step
            out.append(pad)
            at += pad
        return out

    def _optim_template(self) -> dict[str, Any]:
        """ZeRO-1/2's optimizer file as :meth:`ZeroWriter._optim_tree` fills it in: its keys in
        DeepSpeed's order, the partitioned entries left for it to lay out."""
        top = self.src.optim_obj
        z3 = top["optimizer_state_dict"]
        inner = z3["optimizer_state_dict"]
        state = inner.get("state") or {}
        config = top.get("ds_config")
        groups, gstate = [], {}
        for g, group in enumerate(inner.get("param_groups") or []):
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": [g]})
            first = (group.get("params") or [None])[0]
            step = (state.get(first) or {}).get("step")
            gstate[g] = {**({"step": step} if step is not None else {}), "exp_avg": None, "exp_avg_sq": None}
        osd = {
            "loss_scaler": z3.get("loss_scaler"),
            "dynamic_loss_scale": z3.get("dynamic_loss_scale", False),
            "overflow": z3.get("overflow", False),
            # ZeRO-3 saves no clip_grad: the run's config gives it (DeepSpeed's default 0.0); a config saved as
            # a path does not, and without the key DeepSpeed keeps the resuming config's
            **({"clip_grad": config.get("gradient_clipping", 0.0)} if isinstance(config, dict) else {}),
            "base_optimizer_state": {"state": gstate, "param_groups": groups},
            "single_partition_of_fp32_groups": None,
            "zero_stage": zero_stage_enum(z3.get("zero_stage"), self.stage),
            "group_paddings": None,
            "param_alignment_paddings": self.paddings,
            "partition_count": None,
            "ds_version": top.get("ds_version"),
            "param_slice_mappings": None,
        }
        out: dict[str, Any] = {}
        for key, value in top.items():
            out[key] = (
                osd if key == "optimizer_state_dict" else with_stage(value, self.stage) if key == "ds_config" else value
            )
        return out

    def files(self) -> list[PlannedFile]:
        out = super().files()
        peak = out[0].largest
        for name, ref in self.module.items():
            item = self.manifest.items.get(f"{self.shared.get(name, name)}.fp32")
            if isinstance(ref, _unpickle.TensorRef) and name not in self.buffers and item and item.dtype != ref.dtype:
                # converted: its values assembled whole, then narrowed a slice at a time
                size = math.prod(self._shape(name)) * carrier(ref.dtype).itemsize
                peak = max(peak, size + (item.nbytes or 0) + 12 * _CAST_SLICE)
        out[0] = replace(out[0], largest=peak)
        return out

    def _shape(self, name: str) -> tuple[int, ...]:
        item = self.manifest.items.get(f"{self.shared.get(name, name)}.fp32")
        if name in self.buffers or item is None:
            return tuple(self.module[name].shape)
        return tuple(item.shape or ())

    def _model_template(self) -> Any:
        raise AssertionError("ZeroFrom3Writer builds its model states in write()")

    def _model_tree(self, reader: PieceReader, archive: Callable[[str], Any]) -> Any:
        src = self.src.model_obj
        module = type(self.module)()
        module.__dict__.update(getattr(self.module, "__dict__", {}))  # the state dict's _metadata
        whole: dict[str, _ptwrite.OutTensor] = {}
        made: dict[tuple[str, str], _ptwrite.OutTensor] = {}  # a tied alias is its owner's tensor, saved once
        for name, ref in self.module.items():
            if name in self.buffers or not isinstance(ref, _unpickle.TensorRef):
                module[name] = ref  # carried below
                continue
            owner = str(self.shared.get(name, name))
            if (owner, ref.dtype) not in made:
                made[owner, ref.dtype] = self._whole(owner, ref.dtype, reader)
            module[name] = whole[name] = made[owner, ref.dtype]
        frozen = [n for n, _shape in self.src.frozen]
        tree: dict[str, Any] = {}
        for key, value in src.items():
            if key == "module":
                tree[key] = module
            elif key == "param_shapes":
                tree[key] = self.param_groups
            elif key in ("frozen_param_shapes", "frozen_param_fragments") and self.stage == 1:
                tree[key] = None  # DeepSpeed saves them from ZeRO-2 on
            elif key == "frozen_param_fragments":
                fragments = _unpickle.OrderedDictStandIn()
                for name in frozen:
                    fragments[name] = whole[name]  # the module's tensor, pickled once
                tree[key] = fragments
            elif key == "dp_world_size":
                tree[key] = self.dp
            elif key == "ds_config":
                tree[key] = with_stage(value, self.stage)
            else:
                tree[key] = value
        return _ptwrite.carry(tree, partial(archive, self.model_rel))

    def _whole(self, name: str, dtype: str, reader: PieceReader) -> _ptwrite.OutTensor:
        """Parameter ``name``'s fp32 value (master or gathered frozen fragments) in ``dtype``."""
        item = self.manifest.items[f"{name}.fp32"]
        shape = tuple(item.shape or ())
        if dtype == item.dtype:
            return _ptwrite.assembled(reader, item)

        def fill(buf: np.ndarray) -> None:
            values = assemble(reader, item).reshape(-1)
            out = buf.view(np.uint16 if dtype == "bfloat16" else np.float32).reshape(-1)
            for a in range(0, values.size, _CAST_SLICE):  # the conversion's temporaries stay small
                part = values[a : a + _CAST_SLICE]
                wide = bf16_to_float32(part) if item.dtype == "bfloat16" else part.astype(np.float32, copy=False)
                out[a : a + _CAST_SLICE] = float32_to_bf16(wide) if dtype == "bfloat16" else wide

        return _ptwrite.OutTensor(dtype=dtype, shape=shape, fill=fill)


class _UniversalOut:
    """What both universal writers share: ``<tag>_universal/`` beside a ``latest_universal`` naming
    it (what DeepSpeed's ``load_checkpoint`` reads when the config asks for a universal checkpoint),
    and each file saved with the writer's one buffer."""

    scratch: _ptwrite.Scratch
    out_dir: str

    def _name_dir(self, tag: str, manifest: Manifest) -> None:
        self.out_dir = f"{tag or 'global_step' + str(manifest.step or 0)}_universal"

    def last_files(self) -> list[str]:
        return ["latest_universal"]

    def finish(self, tmp: Path, results: list[Any]) -> None:
        (tmp / "latest_universal").write_text(self.out_dir)

    def _save(self, tree: Any, out: Path, progress: Callable[[int], None] | None) -> int:
        n = _ptwrite.save(tree, out, scratch=self.scratch)
        if progress is not None:
            progress(n)
        return n


class UniversalWriter(_UniversalOut, ZeroWriter):
    """DeepSpeed's universal checkpoint, as ``ds_to_universal`` (0.19.x) writes it from a ZeRO-1/2
    checkpoint, next to a ``latest_universal`` naming it:

    - ``<tag>_universal/zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt``: ``{"cat_dim": 0, "param": t}``
      with the whole parameter, and ``step.pt`` (its group's step) for every parameter the
      optimizer holds;
    - ``zero/<name>/fp32.pt``: ``{"param": t.float()}`` for the module's other entries (tied,
      frozen, buffers), from the model states;
    - ``zero/optimizer_state.pt``: the rank-0 optimizer state without its sharded parts, with the
      base optimizer's param groups;
    - every ``mp_rank_XX_model_states.pt``, copied as it is.

    A tensor-parallel run (no pipeline) is written from the whole tensors the manifest joins by the
    model's ``universal_checkpoint_info`` patterns, as ds_to_universal merges them: replicated
    parameters as ``{"param": t}``, row-parallel ones with ``"cat_dim": 1``, two sub-parameters on
    dim 0 (SwiGLU's fused gate and up projections) joined sub-parameter by sub-parameter with
    ``"param_n_sub_params": 2``, averaged parameters as the mean of the TP ranks' copies,
    vocabulary parameters cut to ``original_vocab_size`` rows with ``"vocab_tensor": True``. The
    patterns mark the parameters at TP=1 too. AutoTP's affine maps are followed as ds_to_universal
    follows them (``{"param": t}`` alone), and sub-parameters by ``parameter_with_sub_params``
    (fused QKV) are written with the ``SubparamShape`` it pickles beside them. Refused: a TP run
    saved without the patterns, a map the reader cannot follow (a scaled piece), parameters AutoTP
    could not describe.

    A pipeline run gets a folder for every parameter of every stage (each stage's optimizer files
    hold its own layers'), each with its stage's step; its ``layer_*-model_states.pt`` files are
    not written, as ds_to_universal writes none: a universal load takes the module weights from the
    fp32 masters. A weight tied across stages is written once, from the first stage's copy: what
    ds_to_universal keeps of one its ``pipeline_replicated_parameter_patterns`` name (of one they
    do not name it keeps fragments of the stages in turn, each overwriting the last; and it drops
    a parameter they name that only later stages hold, which this writer writes)."""

    _STATES = ("fp32", "exp_avg", "exp_avg_sq")

    _KNOWN = frozenset(
        {
            "universal_checkpoint_version",
            "tp_replicated_parameter_patterns",
            "parameter_to_average_patterns",
            "parameter_with_row_parallelism_patterns",
            "vocabulary_parameter_patterns",
            "parameter_with_2_sub_params_cat_dim_0",
            "parameter_with_sub_params",
            "sub_param_shard_widths",
            "affine_map",
            "autotp_unsupported_parameter_patterns",
            "original_vocab_size",
            "padded_vocab_size",
            "pipeline_replicated_parameter_patterns",
        }
    )
    """universal_checkpoint_info keys whose meaning this writer follows (or refuses by parameter)"""

    def __init__(self, root: Path, manifest: Manifest) -> None:
        tp = manifest.layout.tp or 1
        # a model-parallel run: rank 0's files give the optimizer's common state (each stage's
        # files its parameters and their steps, below)
        super().__init__(root, manifest, manifest.layout.dp or 1, mp=0 if model_parallel(manifest) else None)
        info = self.model_obj.get("universal_checkpoint_info") if isinstance(self.model_obj, dict) else None
        self.rules = TpRules(info, tp, self.model_rel)
        hint = "run DeepSpeed's ds_to_universal on this checkpoint"
        if tp > 1 and self.rules.info is None:
            raise UsageError(
                f"{self.model_rel}: a TP={tp} run saved without universal_checkpoint_info: nothing says how "
                "its TP slices join into whole tensors",
                hint="Megatron-DeepSpeed and AutoTP save it; a checkpoint of another client cannot be made universal",
            )
        unknown = sorted(set(self.rules.info or {}) - self._KNOWN)
        if unknown:
            raise UsageError(
                f"{self.model_rel}: universal_checkpoint_info holds {', '.join(unknown)}; writing a universal "
                "checkpoint with those is not supported yet",
                hint=hint,
            )
        self.held = self._held_by_stage()
        names = list(self.held)
        self.kinds = {n: self.rules.kind(n) for n in names}
        """each parameter's category in the patterns (:meth:`TpRules.kind`)"""
        unsupported = (self.rules.info or {}).get("autotp_unsupported_parameter_patterns")
        if unsupported:  # ds_to_universal refuses the whole checkpoint
            raise UsageError(
                f"{self.model_rel}: AutoTP could not describe how it split "
                f"{', '.join(f'{p} ({r})' for p, r in sorted(unsupported.items())[:3])}: no universal checkpoint "
                "of it can be written",
                hint="keep it in its TP layout: 'ckpttool reshard --dp N' changes its data-parallel size",
            )
        apart = [n for n in names if self.kinds[n] in ("map", "sub-parameters") and f"{n}.fp32" not in manifest.items]
        if apart:
            raise UsageError(
                f"{self.model_rel}: universal_checkpoint_info places {', '.join(apart[:3])}"
                f"{' …' if len(apart) > 3 else ''} by a map ckpttool cannot follow (a scaled piece, a piece "
                "that is not whole rows of a rank's copy, sub-parameters off dim 0); writing those is not "
                "supported yet",
                hint=hint,
            )
        self.sub_shapes = {n: self._sub_param_shape(n) for n in names if self.kinds[n] == "sub-parameters"}
        # every other parameter is one whole tensor, or (averaged) one copy per TP rank
        for n in names:
            if self.kinds[n] == "average":
                for state in self._STATES:
                    self._averaged(n, state)
        unjoined = [n for n in names if self.kinds[n] != "average" and f"{n}.fp32" not in manifest.items]
        if unjoined:
            raise UsageError(
                f"{self.model_rel}: no pattern of universal_checkpoint_info joins the TP ranks' copies of "
                f"{', '.join(unjoined[:3])}{' …' if len(unjoined) > 3 else ''} into one tensor (a row-parallel "
                "pattern naming a 1-D parameter, halves of an odd size, a 0-d parameter); writing it is not "
                "supported yet",
                hint=hint,
            )
        rows = (self.rules.info or {}).get("original_vocab_size")
        if any(self.rules.vocab(n) for n in names) and not (isinstance(rows, int) and rows > 0):
            raise CorruptFileError(
                f"{self.model_rel}: universal_checkpoint_info names vocabulary parameters but its "
                f"original_vocab_size is {rows!r}",
                path=self.model_rel,
            )
        self.vocab_rows: int = rows if isinstance(rows, int) else 0
        self.vocab_cut = [  # (as write cuts them: rows of the first copy past the vocabulary's)
            n for n in names if self.rules.vocab(n) and (self._copies(n, "fp32")[0].shape or (0,))[0] > self.vocab_rows
        ]
        """the vocabulary parameters whose fp32 copies and moments lose padding rows here (``write``)"""
        self.model_rels = sorted(f.path for f in manifest.files if _MODEL.match(f.path))
        self._name_dir(self.tag, manifest)
        module = self.model_obj.get("module") if isinstance(self.model_obj, dict) else None
        entries = module if isinstance(module, dict) else {}  # None in a pipeline run's: its layer files hold it
        self.fallback = [n for n, v in entries.items() if n not in self.held and isinstance(v, _unpickle.TensorRef)]
        for n in self.fallback:  # widened to float32 by value: float8 (carried as uint8 bits) would not be
            dt = entries[n].dtype
            if dt != "bfloat16" and not lookup_dtype(dt).exact_numpy:
                raise UsageError(
                    f"{self.model_rel}: module entry {n} is {dt}; widening it to float32 is not supported yet",
                    hint="run DeepSpeed's ds_to_universal on this checkpoint",
                )

        missing = [n for n in self.fallback if n not in manifest.items]
        if missing:
            raise UsageError(
                f"{self.model_rel}: no split rule joins the TP ranks' copies of {', '.join(missing[:3])}, which "
                "the optimizer does not hold; writing them is not supported yet",
                hint=hint,
            )
        self.jobs: list[tuple[str, str]] = [("model", rel) for rel in self.model_rels]
        self.jobs.append(("optimizer", ""))
        for name, (_rel, step, _grad) in self.held.items():
            self.jobs += [(state, name) for state in self._STATES]
            if step is not None:
                self.jobs.append(("step", name))
        self.jobs += [("module", name) for name in self.fallback]

    def _held_by_stage(self) -> dict[str, tuple[str, Any, bool]]:
        """Every parameter the optimizer holds, in any pipeline stage, in the order ds_to_universal
        meets them (stage by stage), with the optimizer file of the first model-parallel rank that
        holds it (its data-parallel rank 0), its group's step there, and whether that file's fp32
        partitions require grad. A pipeline stage holds its own layers' parameters; a parameter tied
        across stages is met in each and written once."""
        out: dict[str, tuple[str, Any, bool]] = {}
        models = sorted((int(m["mp"]), f.path) for f in self.manifest.files if (m := _MODEL.match(f.path)) is not None)
        optims = {
            int(m["mp"]): f.path
            for f in self.manifest.files
            if (m := _OPTIM.match(f.path)) is not None and int(m["dp"]) == 0
        }
        for mp, model_rel in models:
            if mp == self.mp:
                model, optim_rel, optim = self.model_obj, self.optim_rels[0], self.optim_obj
            elif mp in optims:
                archive, model, _ = _pt.load(self.root, model_rel, ALLOWLIST)
                archive.close()
                optim_rel = optims[mp]
                archive, optim, _ = _pt.load(self.root, optim_rel, ALLOWLIST)
                archive.close()
            else:
                raise CorruptFileError(f"{model_rel}: no optimizer file of its data-parallel rank 0", path=model_rel)
            osd = optim.get("optimizer_state_dict") if isinstance(optim, dict) else None
            shapes = model.get("param_shapes") if isinstance(model, dict) else None
            if not isinstance(osd, dict) or not isinstance(shapes, list):
                raise CorruptFileError(f"{optim_rel}: not a ZeRO-1/2 optimizer file", path=optim_rel)
            base = osd.get("base_optimizer_state") or {}
            states = base.get("state") if isinstance(base, dict) else None
            states = states if isinstance(states, dict) else {}
            grad = any(getattr(t, "requires_grad", False) for t in osd.get("single_partition_of_fp32_groups") or [])
            for g, group in enumerate(shapes):
                state = states.get(g)
                step = state.get("step") if isinstance(state, dict) else None
                for name in group if isinstance(group, dict) else ():
                    out.setdefault(name, (optim_rel, step, grad))
        return out

    def _path(self, kind: str, name: str) -> str:
        if kind == "model":
            return f"{self.out_dir}/{name.rsplit('/', 1)[-1]}"
        if kind == "optimizer":
            return f"{self.out_dir}/zero/optimizer_state.pt"
        return f"{self.out_dir}/zero/{name}/{'fp32' if kind == 'module' else kind}.pt"

    def files(self) -> list[PlannedFile]:
        out = []
        for k, (kind, name) in enumerate(self.jobs):
            path = self._path(kind, name)
            if kind == "model":
                out.append(copy_plan(self.root, name, path, (k,)))
                continue
            plan = _ptwrite.planned(path, (k,), self._tree(k, PLANNING, _ptwrite.unread))
            if kind == "module":  # widened to float32: the source values assembled beside its buffer
                plan = replace(plan, largest=plan.largest + (self.manifest.items[name].nbytes or 0))
            elif kind in self._STATES and self.kinds[name] == "average":  # the copies summed in a buffer
                plan = replace(plan, largest=2 * plan.largest)
            out.append(plan)
        return out

    def write(self, k: int, out: Path, reader: PieceReader, progress: Callable[[int], None] | None) -> int:
        kind, name = self.jobs[k]
        if kind == "model":  # copied byte for byte, as ds_to_universal copies it
            return copy_source(self.root, name, out, progress)
        return self._save(self._tree(k, reader, _pt.archive_cache(reader)), out, progress)

    def _tree(self, k: int, reader: PieceReader, archive: Callable[[str], Any]) -> Any:
        """The tree of job ``k``'s file (not a model file, which is copied)."""
        kind, name = self.jobs[k]
        if kind == "optimizer":
            osd = self.optim_obj["optimizer_state_dict"]
            sharded = ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups")
            tree = {key: value for key, value in osd.items() if key not in sharded}
            base = osd.get("base_optimizer_state")
            tree["param_groups"] = base.get("param_groups") if isinstance(base, dict) else None
            return _ptwrite.carry(tree, partial(archive, self.optim_rels[0]))
        if kind == "step":
            rel, step, _grad = self.held[name]
            return _ptwrite.carry(step, partial(archive, rel))
        if kind == "module":
            return {"param": self._as_float32(self.manifest.items[name], reader)}
        copies = self._copies(name, kind)
        item = copies[0]
        # the fp32 partition is a leaf that requires grad, and ds_to_universal's slices of it keep that
        grad = kind == "fp32" and self.held[name][2]
        category = self.kinds[name]
        head: dict[str, Any] = {}
        if category == "halves":
            head.update(cat_dim=0, param_n_sub_params=2)
        elif category == "sub-parameters":
            head["sub_param_shape"] = self.sub_shapes[name]
        elif category not in ("replicated", "average", "map"):  # an affine map: the param alone
            head["cat_dim"] = 1 if category == "row" else 0
        box = None
        if self.rules.vocab(name):  # its padding rows cut, as ds_to_universal cuts them
            dims: tuple[int, ...] = tuple(item.shape or ())
            box = Box((0,) * len(dims), (min(self.vocab_rows, dims[0]), *dims[1:]))
            head["vocab_tensor"] = True
        if category == "average":  # at TP=1 too: (0 + x) / 1 is x with its negative zeros made positive
            head["param"] = self._mean(copies, box, reader, grad)
        else:
            head["param"] = _ptwrite.assembled(reader, item, box, requires_grad=grad)
        return head

    def _sub_param_shape(self, name: str) -> Any:
        """The ``SubparamShape`` ds_to_universal saves with ``name``'s sub-parameters: the
        ``parameter_with_sub_params`` entry naming it, its count of equal sub-parameters (in a
        checkpoint before universal version 0.4) made their sizes."""
        index = self.rules.sub_params(name)
        assert index is not None  # its kind says a pattern names it
        sub = self.rules.subs[index]
        whole = self.manifest.items[f"{name}.fp32"].shape or (0,)
        rows = whole[0]  # joined by the reader: the sub-parameters are on dim 0
        sizes = sub.sizes
        counted = isinstance(sizes, int) and 0 < sizes <= rows and rows % sizes == 0
        if set(sub.spec) != {"patterns", "shape", "partition_dim"} or not (
            counted or (isinstance(sizes, tuple) and sum(sizes) == rows)
        ):
            info = self.rules.info or {}
            raise UsageError(
                f"{self.model_rel}: universal_checkpoint_info's sub-parameters of {name} ({str(sub.spec)[:160]}, "
                f"universal version {info.get('universal_checkpoint_version', 0.0)!r}) do not describe its "
                f"{list(whole)} tensor as ds_to_universal reads them",
                hint="run DeepSpeed's ds_to_universal on this checkpoint",
            )
        shape = sub.spec["shape"]
        if isinstance(sizes, int):  # before version 0.4: a count of equal sub-parameters, made their sizes
            shape = tuple((rows // sizes,) * sizes if d == sub.dim else n for d, n in enumerate(shape))
        out = _unpickle.record(SUBPARAM_SHAPE)()
        out.__dict__.update(patterns=sub.spec["patterns"], shape=shape, partition_dim=sub.dim)
        return out

    def _copies(self, name: str, state: str) -> list[Item]:
        """The items of ``name``'s ``state``: the whole tensor, or the TP ranks' copies of an
        averaged parameter."""
        if self.kinds[name] == "average":
            return self._averaged(name, state)
        return [self.manifest.items[f"{name}.{state}"]]

    def _averaged(self, name: str, state: str) -> list[Item]:
        """The TP ranks' copies of the averaged parameter ``name``'s ``state`` (at TP=1 the one
        tensor), checked to be averaged as they are: of one float dtype and shape."""
        tp = self.manifest.layout.tp or 1
        one = self.manifest.items.get(f"{name}.{state}") if tp == 1 else None
        found = [one] if one is not None else [self.manifest.items.get(f"{name}[tp={t}].{state}") for t in range(tp)]
        copies = [c for c in found if c is not None]
        if len(copies) != tp:
            raise CorruptFileError(f"{name}.{state}: {len(copies)} of the {tp} TP ranks' copies in the source")
        first = copies[0]
        if first.dtype not in ("float32", "float64") or any(
            (c.dtype, c.shape) != (first.dtype, first.shape) for c in copies
        ):
            raise UsageError(
                f"{name}.{state}: averaging TP copies of "
                f"{sorted({f'{c.dtype}{list(c.shape or ())}' for c in copies})} is not supported yet",
                hint="run DeepSpeed's ds_to_universal on this checkpoint",
            )
        return copies

    @staticmethod
    def _mean(copies: list[Item], box: Box | None, reader: PieceReader, grad: bool) -> _ptwrite.OutTensor:
        """``sum(copies) / len(copies)`` as ds_to_universal takes it: summed in their dtype from
        0, one copy after another, then divided (a true division, as torch's)."""
        first = copies[0]
        shape = tuple(box.sizes if box is not None else first.shape or ())
        dtype = first.dtype or "float32"  # checked float32 or float64 by _averaged

        def fill(buf: np.ndarray) -> None:
            total = buf.view(dtype).reshape(shape)
            total[...] = 0
            for c in copies:
                total += assemble(reader, c, box=box)
            np.divide(total, total.dtype.type(len(copies)), out=total)

        return _ptwrite.OutTensor(dtype=dtype, shape=shape, fill=fill, requires_grad=grad)

    @staticmethod
    def _as_float32(item: Any, reader: PieceReader) -> _ptwrite.OutTensor:
        """``tensor.float()``: the values in float32 (bf16 widened bit for bit, others converted)."""
        assert item.dtype is not None and item.shape is not None

        def fill(buf: np.ndarray) -> None:
            values = assemble(reader, item)
            out = buf.view(np.float32).reshape(item.shape or ())
            if item.dtype == "bfloat16":
                out[...] = bf16_to_float32(values)
            else:
                out[...] = values.astype(np.float32)

        return _ptwrite.OutTensor(dtype="float32", shape=item.shape, fill=fill)


class Universal3Writer(_UniversalOut, Zero3Writer):
    """DeepSpeed's universal checkpoint, as ``ds_to_universal`` (0.19.x) writes it from a ZeRO-3
    checkpoint without tensor parallelism, next to a ``latest_universal`` naming it:

    - ``<tag>_universal/zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt``: the whole parameter as a bare
      flat 1-D tensor (no dict, no shape, no ``step.pt``: the ZeRO-3 loader reshapes nothing and
      takes the step from ``optimizer_state.pt``), for every parameter the optimizer holds;
    - ``zero/optimizer_state.pt``: rank 0's ``optimizer_state_dict`` whole (its flat fp32 groups
      and moments included), with the inner optimizer's ``param_groups`` also at the top;
    - every rank's ``zero_pp_rank_*_model_states.pt``, copied as it is.

    Frozen parameters and buffers get no file, as ds_to_universal writes none: DeepSpeed's
    universal load restores neither (it loads the optimizer's parameters only)."""

    _STATES = ("fp32", "exp_avg", "exp_avg_sq")

    def __init__(self, root: Path, manifest: Manifest) -> None:
        super().__init__(root, manifest, None)  # ds_to_universal takes param_shapes as saved
        self._name_dir(self.tag, manifest)
        osd = self.optim_obj["optimizer_state_dict"]
        self.fp32_requires_grad = any(getattr(t, "requires_grad", False) for t in osd.get("fp32_flat_groups") or [])
        names = [name for _g, params in self.subgroups for name, _shape in params]
        self.jobs: list[tuple[str, str]] = [("optimizer", "")]
        self.jobs += [("model", rel) for _r, rel in sorted(self.model_rels.items())]
        self.jobs += [(state, name) for name in names for state in self._STATES]

    def files(self) -> list[PlannedFile]:
        out = []
        for k, (kind, name) in enumerate(self.jobs):
            if kind == "model":
                out.append(copy_plan(self.root, name, f"{self.out_dir}/{name.rsplit('/', 1)[-1]}", (k,)))
                continue
            path = f"{self.out_dir}/zero/{'optimizer_state' if kind == 'optimizer' else f'{name}/{kind}'}.pt"
            out.append(_ptwrite.planned(path, (k,), self._tree(k, PLANNING, _ptwrite.unread)))
        return out

    def write(self, k: int, out: Path, reader: PieceReader, progress: Callable[[int], None] | None) -> int:  # type: ignore[override]
        kind, name = self.jobs[k]
        if kind == "model":  # copied byte for byte, as ds_to_universal copies it
            return copy_source(self.root, name, out, progress)
        return self._save(self._tree(k, reader, _pt.archive_cache(reader)), out, progress)

    def _tree(self, k: int, reader: PieceReader, archive: Callable[[str], Any]) -> Any:
        """The tree of job ``k``'s file (not a model file, which is copied)."""
        kind, name = self.jobs[k]
        if kind == "optimizer":
            osd = self.optim_obj["optimizer_state_dict"]
            tree = dict(osd)
            tree["param_groups"] = osd["optimizer_state_dict"]["param_groups"]  # the same list, pickled once
            return _ptwrite.carry(tree, partial(archive, self.optim_rels[0]))
        item = self.manifest.items[f"{name}.{kind}"]
        whole = _ptwrite.assembled(reader, item, requires_grad=kind == "fp32" and self.fp32_requires_grad)
        return _ptwrite.OutTensor(whole.dtype, (math.prod(whole.shape),), whole.fill, whole.requires_grad)


__all__ = [
    "ALIGN",
    "GroupLayout",
    "Universal3Writer",
    "UniversalWriter",
    "Zero3From12Writer",
    "Zero3FromUniversalWriter",
    "Zero3Writer",
    "ZeroFrom3Writer",
    "ZeroFromUniversalWriter",
    "ZeroModelParallelWriter",
    "ZeroWriter",
    "copy_plan",
    "copy_source",
    "flat_tensor",
    "frozen_of",
    "group_layout",
    "model_parallel",
    "stage3_settings",
    "universal_names",
    "with_stage",
    "zero3_sub_groups",
    "zero_stage_enum",
]
