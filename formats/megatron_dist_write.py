"""Writing a Megatron ``torch_dist`` checkpoint (``iter_N/{metadata.json, common.pt, .metadata,
__R_0.distcp}``) at any tensor- and pipeline-parallel size, from a Megatron legacy or
``torch_dist`` checkpoint at any other.

``torch_dist`` stores each parameter as one global tensor: the layers of ``decoder.layers.*``
stacked along a prepended axis of ``num_layers`` rows (global layer numbers, so the pipeline
layout leaves no trace in the keys), SwiGLU's ``linear_fc1`` as ``[all gates; all ups]``,
local-spec norms under the TransformerEngine keys (``self_attention.linear_qkv.layer_norm_weight``).
What the writer chooses is only how the global tensors are cut into chunks: as megatron-core's
own save cuts them at the target layout (one chunk per layer and TP region, replicated tensors
written once), with the chunks of pipeline stage ``p`` and TP rank ``t`` in ``__{p*TP+t}_0.distcp``.
megatron-core's ``dist_checkpointing.load`` reads it at this layout or any other.

What is carried besides the tensors:

* optimizer state as megatron-core's ``Float16OptimizerWithFloat16Params.sharded_state_dict``
  saves it: ``optimizer.state.{exp_avg,exp_avg_sq,fp32_param}.<key>`` cut like their parameter;
  in ``common.pt`` the param groups' hyper-parameters (their ``params`` are rebuilt by the
  loader) and the one ``common_step`` megatron-core keeps for all parameters;
* routed experts stacked on a second prepended axis, after the layer's:
  ``decoder.layers.mlp.experts.experts.<name>`` of ``[layers, experts, ...]`` (global expert
  numbers, so expert parallelism leaves no trace in the tensors); under expert parallelism the
  optimizer's common part is the chain's ``{0: dense, 1: experts}``;
* ``_extra_state`` as megatron-core's ``ShardedObject`` per layer (``<key>/shard_<layer>_<L>``;
  an expert's ``<key>/shard_<layer>.<expert>_<L>.<E>``);
* RNG as ``rng_state/shard_<p>.<t>_<PP>.<TP>``, rank (t, p) getting the source rank
  (t mod TP, p mod PP)'s states (as the legacy writer does); under expert parallelism sharded by
  data-parallel rank too, ``rng_state/shard_<p>.<t>.<d>_<PP>.<TP>.<DP>`` (Megatron-LM's
  ``get_rng_state``), rank d getting the source's (d mod source DP or EP);
* ``common.pt``: ``args`` with the new sizes (as the legacy writer updates them, and
  ``ckpt_format`` set to ``torch_dist``), ``iteration``, ``checkpoint_version``, the scheduler,
  ``num_floating_point_operations_so_far``, ``content_metadata``.

From a ``torch_dist`` source, ``common.pt`` is re-pickled with the new ``args`` and every
``ShardedObject`` record is copied byte for byte. A ``torch_dist`` source saved with the
distributed optimizer (``dp_reshardable``, read de-bucketed, or ``fully_reshardable``) is written
in the distributed optimizer's ``fully_reshardable`` layout, which megatron-core loads at any TP
and PP: ``optimizer.state.{param,exp_avg,exp_avg_sq}.<key>`` cut like the parameter, and in
``common.pt`` the optimizer state dict without per-parameter state, ``param_state_sharding_type``
and the content metadata that names the layout.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ckpttool import _unpickle
from ckpttool._torchzip import read_tensor
from ckpttool.assemble import check_coverage
from ckpttool.dtypes import carrier
from ckpttool.errors import CorruptFileError, UsageError
from ckpttool.formats import _pt, _ptwrite
from ckpttool.formats.base import PieceReader, PlannedFile
from ckpttool.formats.dcp_write import Record, write_metadata
from ckpttool.formats.megatron import (
    _LAYER,
    _TE_TO_LOCAL,
    ALLOWLIST,
    BUCKET_OBJECT,
    RNG_CARRIED,
    SPLIT_RULES,
    expert_slot,
    own_etp,
    rank_label,
)
from ckpttool.formats.megatron_write import (
    LegacyWriter,
    MegatronTarget,
    SourceObject,
    _base_param,
    _few,
    _Fill,
    _is_vocab,
    _local,
    _num_layers,
    _rule,
    _scalar,
    _Source,
    check_group_keys,
    expert_kinds,
    fp32_scaler,
    group_identity,
    group_step,
    module_order,
    sharded_value,
)
from ckpttool.geometry import Box
from ckpttool.hashing import open_output
from ckpttool.manifest import Item, Manifest

CONFIG = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
"""``metadata.json`` as megatron-core 0.16 writes it"""

CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
"""``common.pt``'s ``content_metadata`` for the non-distributed optimizer (megatron-core 0.16)"""

_LOCAL_TO_TE = {local: te for te, local in _TE_TO_LOCAL.items()}
_STATE_PREFIX = {
    "fp32": "optimizer.state.fp32_param.",
    "exp_avg": "optimizer.state.exp_avg.",
    "exp_avg_sq": "optimizer.state.exp_avg_sq.",
}
"""the Float16 optimizer's keys"""
_MODEL_SPACE_PREFIX = {**_STATE_PREFIX, "fp32": "optimizer.state.param."}
"""the distributed optimizer's ``fully_reshardable`` keys"""
_SHARD = re.compile(r"^(?P<key>.+)/shard_(?P<offsets>\d+(?:\.\d+)*)_(?P<shape>\d+(?:\.\d+)*)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(?P<j>\d+)\.(?P<rest>.+)$")


_EXPERT_FC = re.compile(r"(\.mlp\.experts\.local_experts\.\d+\.linear_fc[12])\.weight$")
"""a routed expert's fc weight (the entry its ``_extra_state`` goes with)"""


@dataclass(slots=True)
class _Chunk:
    """One chunk of a global tensor: ``region`` of the manifest item, at ``chunk`` of the key."""

    key: str
    item: Item
    region: Box
    chunk: Box

    @property
    def nbytes(self) -> int:
        assert self.item.dtype is not None
        return self.region.volume * carrier(self.item.dtype).itemsize


@dataclass(slots=True)
class _Object:
    """One ``ShardedObject`` record: ``write(file, reader)`` stores its ``torch.save`` bytes."""

    key: str
    write: Callable[[BinaryIO, PieceReader], None]


class DistWriter(LegacyWriter):
    """Plans and writes the ``.distcp`` files of one target layout (one per TP x PP rank), then
    ``.metadata`` and the tracker (``finish``); rank 0's task also writes ``common.pt`` and
    ``metadata.json``."""

    rank_files = False

    def __init__(
        self, root: Path, manifest: Manifest, target: MegatronTarget, rules: dict[str, Any] | None = None
    ) -> None:
        self.from_dist = manifest.format == "megatron-dist"
        super().__init__(root, manifest, target, rules)
        self.experts = int(getattr(self.args, "num_experts", None) or 0)
        if self.experts and any((slot := expert_slot(n)) and slot[2] for n in manifest.items):  # TEGroupedMLP
            raise UsageError("writing torch_dist checkpoints of grouped-GEMM experts is not supported yet")
        self.rechain = bool(
            self.from_dist
            and self.experts
            and (self.ep > 1) != ((manifest.layout.ep or 1) > 1)
            and self.src.objs[(0, 0, 0)].get("optimizer") is not None  # (saved without: nothing to move)
        )
        """between EP = 1 and EP > 1 from a torch_dist source: the experts move between the dense
        optimizer and an expert optimizer of their own (megatron-core's chain), their param groups
        with them (:meth:`_rechain`)"""
        self.model_space = self.distopt
        """write the distributed optimizer's ``fully_reshardable`` layout (model space): kept from a
        source saved with the distributed optimizer (torch_dist in either of its layouts, or legacy
        ``distrib_optim.pt``), or asked for with ``--distributed-optimizer``"""
        self.optimizer_commons: list[dict[str, Any]] = []
        """per optimizer (one, or the chain's dense and expert members) of a torch_dist source whose
        optimizer layout is rewritten or kept in model space: the optimizer's part of ``common.pt``
        in the output's layout (empty: ``common.pt``'s optimizer is copied as it is)"""
        if self.from_dist and (self.model_space or self.src.distopt or self.rechain):
            self.optimizer_commons = self._source_commons()
            if self.rechain:
                self.optimizer_commons = self._rechain(self.optimizer_commons)
        self.layers = _num_layers(self.args)
        self.local_spec = getattr(self.args, "transformer_impl", None) == "local"
        tp, pp = target.tp, target.pp
        self.ranks: list[list[_Chunk | _Object]] = [[] for _ in range(tp * pp)]
        self.tensors: dict[str, tuple[str, tuple[int, ...], list[Box]]] = {}
        self.objects: list[str] = []
        self.stacked: dict[str, set[int]] = {}
        """the layers each key stacked over the layers holds (all of them, or the output is not whole)"""
        self._plan()

    def _check_distopt_groups(self) -> None:
        if not self.from_dist:  # (from torch_dist: _source_commons checks the groups)
            super()._check_distopt_groups()

    def _infer_membership(self, why: str = "--no-distributed-optimizer") -> None:
        # torch_dist keeps no param-group membership in either layout (megatron-core matches groups by
        # their identifier keys): nothing to infer from a torch_dist source
        if not self.from_dist:
            super()._infer_membership(why)

    def _source_commons(self) -> list[dict[str, Any]]:
        """The optimizer's part of ``common.pt`` per optimizer of a torch_dist source, in the
        output's layout. The Float16 optimizer's is ``{'optimizer': {'state': {'common_step': t},
        'param_groups': [...]}}``; the distributed optimizer's (``fully_reshardable``) keeps the
        step in each group instead: ``{'optimizer': {'param_groups': [{..., 'step': s}]}}``. Between
        the two only the step moves (neither names the groups' members: megatron-core matches them
        by their identifier keys), and the per-parameter state is renamed (``_plan_tensor``). An fp32
        model's FP32Optimizer saves its state dict bare (``{'state': ..., 'param_groups': ...}``, see
        ``_plain_optimizer``) and keeps no main copy."""
        if self.src.distopt and self.model_space:  # kept: as saved (fully_reshardable) or read from the buckets
            return self._model_space_commons()
        if not self.src.distopt and not self.model_space:  # kept as saved (an EP change regroups it)
            return _chain_members(self.src.objs[(0, 0, 0)].get("optimizer"))
        members = self._model_space_commons() if self.src.distopt else self._float16_commons()
        out = []
        for k, member in enumerate(members):
            inner = member["optimizer"]
            groups = inner.get("param_groups") or []
            extra = {key: v for key, v in member.items() if key != "optimizer"}
            if self.src.distopt:  # -> Float16 (an fp32 model: FP32): one common step for all
                refuse = f"--no-distributed-optimizer from this torch_dist checkpoint (optimizer {k}): "
                if self.fp32_model and extra:
                    raise UsageError(refuse + fp32_scaler(extra), hint="keep the distributed optimizer")
                step = group_step(groups, refuse)
                state = {"common_step": _scalar(step)}
                plain = [{key: v for key, v in g.items() if key != "step"} for g in groups]
                out.append(self._plain_optimizer({"state": state, "param_groups": plain}, extra))
            else:  # Float16 -> the distributed optimizer: the common step into every group
                check_group_keys(groups, f"the param groups of common.pt's optimizer {k}")
                step = inner["state"]["common_step"]
                out.append({"optimizer": {"param_groups": [{**g, "step": step} for g in groups]}, **extra})
        return out

    def _rechain(self, members: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The optimizer's part of ``common.pt`` (``members``, in the output's layout) between EP = 1
        and EP > 1. megatron-core puts the routed experts in param groups of their own only under
        expert parallelism (``is_expert_parallel``), and those groups in an expert optimizer chained
        after the dense one; a group is matched on load by its identifier keys, and each optimizer
        must get exactly its own groups. Neither of torch_dist's optimizer layouts names a group's
        members. To EP > 1 they are inferred by megatron-core's standard rule (refused if the groups
        do not fit it): the one optimizer becomes the chain, its groups that hold experts copied into
        the expert optimizer (``is_expert_parallel`` set), those that hold other parameters kept in
        the dense one. To EP = 1 the expert optimizer's groups join the dense ones, each of which must
        have one alike but for ``is_expert_parallel``, as the rest of the two optimizers' state (step,
        grad scaler) must be; an expert optimizer saved empty (rank 0 held no experts: megatron-core
        then saves no step for it) takes the dense one's."""
        src_ep = self.manifest.layout.ep or 1
        refuse = f"EP {src_ep} -> {self.ep} from this torch_dist checkpoint (the experts change optimizer): "
        hint = "keep EP = 1, or EP > 1, as the source has it: its param groups are then kept as saved"
        want = 1 if self.ep > 1 else 2
        if len(members) != want:
            raise UsageError(
                refuse
                + f"common.pt holds {len(members)} optimizers, where megatron-core's standard build has "
                + ("one at EP = 1" if want == 1 else "two under expert parallelism (dense, experts)"),
                hint=hint,
            )
        if self.ep > 1:
            (member,) = members
            groups = _optimizer_groups(member)
            kinds = expert_kinds(self.standard_membership(groups, False, refuse, hint))
            out = []
            for expert in (False, True):
                taken = sorted(g for g, held in kinds.items() if expert in held)
                # (a copy for the expert optimizer: megatron-core builds its groups apart)
                kept = [groups[g] for g in taken] if not expert else copy.deepcopy([groups[g] for g in taken])
                out.append(_with_groups(member, [{**h, "is_expert_parallel": expert} for h in kept]))
            return out
        dense, experts = members
        groups = _optimizer_groups(dense)
        for h in _optimizer_groups(experts):
            # (a group of an expert optimizer saved empty may lack its step)
            alike = [{k: v for k, v in g.items() if k != "step" or "step" in h} for g in groups]
            if {**h, "is_expert_parallel": False} not in alike:
                raise UsageError(
                    refuse + f"the expert optimizer's param group {group_identity(h)} has no like group in the dense "
                    "optimizer to join",
                    hint=hint,
                )
        rest = [_with_groups(m, []) for m in (dense, experts)]
        ours, theirs = (m.get("optimizer", m) for m in rest)
        if theirs.get("state") == {} and "state" in ours:  # saved empty: no common step
            theirs = {**theirs, "state": ours["state"]}
            rest[1] = {**rest[1], "optimizer": theirs} if "optimizer" in rest[1] else theirs
        archive, _, _ = _pt.load(self.root, "common.pt", ALLOWLIST)
        try:
            same = [_content(_ptwrite.carry(m, lambda: archive, now=True)) for m in rest]
        finally:
            archive.close()
        if same[0] != same[1]:
            raise UsageError(
                refuse + "the dense and the expert optimizer's states differ beside their param groups (their "
                "step, or a grad scaler), and one optimizer keeps one",
                hint=hint,
            )
        return [dense]

    def _saved_groups(self) -> list[dict[str, Any]]:
        if self.src.groups or not self.from_dist:
            return self.src.groups
        if self.optimizer_commons:  # read for the output (dp_reshardable: from its records)
            members = self.optimizer_commons
        else:  # copied as it is: the Float16 (FP32: bare) optimizer's, or a chain of them
            optimizer = self.src.objs[(0, 0, 0)].get("optimizer")
            members = _chain_members(optimizer)
        out: list[dict[str, Any]] = []
        for member in members:
            inner = member.get("optimizer", member) if isinstance(member, dict) else None
            out += inner.get("param_groups") or [] if isinstance(inner, dict) else []
        return out

    def _float16_commons(self) -> list[dict[str, Any]]:
        return float16_members(self.root, self.src.objs[(0, 0, 0)].get("optimizer"), "--distributed-optimizer")

    def _source(self, root: Path, manifest: Manifest) -> _Source:
        if not self.from_dist:
            return super()._source(root, manifest)
        common, src = _dist_common(root, manifest)
        src.objs, src.rels = {(0, 0, 0): common}, {(0, 0, 0): "common.pt"}
        return src

    def _model_space_commons(self) -> list[dict[str, Any]]:
        return model_space_members(self.manifest, self.src.objs[(0, 0, 0)].get("optimizer"))

    # -- planning --------------------------------------------------------------------------------

    def _key(self, param: str) -> tuple[str, int | None, int | None]:
        """The torch_dist key of a manifest parameter name, its layer (None: not a decoder layer's)
        and its routed expert (None: not an expert's). A multi-token prediction layer is not stacked:
        its experts' key has the expert axis only."""
        m = _LAYER.match(param)
        if m is None:
            head, sep, rest = param.partition(".transformer_layer.")  # a multi-token prediction layer's
            if sep and head.startswith("mtp.layers."):
                if (e := _EXPERT.match(rest)) is not None:
                    return f"{head}{sep}mlp.experts.experts.{e['rest']}", None, int(e["j"])
                if self.local_spec:
                    return head + sep + _LOCAL_TO_TE.get(rest, rest), None, None
            return param, None, None
        rest = m["rest"][1:]
        if (e := _EXPERT.match(rest)) is not None:
            return f"{m['pre']}mlp.experts.experts.{e['rest']}", int(m["i"]), int(e["j"])
        if self.local_spec:
            rest = _LOCAL_TO_TE.get(rest, rest)
        return f"{m['pre']}{rest}", int(m["i"]), None

    def _stage(self, param: str, layer: int | None) -> int:
        if layer is not None:
            return self.layer_stage(layer)
        stages = self.stage_of(param)
        return stages[0] if stages else 0

    def _plan(self) -> None:
        unknown: list[str] = []
        model = set(self.src.model_order)  # legacy: the model state dict's entries
        for item in self.manifest.items.values():
            if item.is_tensor:
                if item.kind != "rng":
                    self._plan_tensor(item)
                if self.model_space and item.kind == "param" and f"{item.name}.exp_avg" in self.manifest.items:
                    master = self._master(item.name)
                    if master is None:
                        why = (
                            f"an fp32 run's by its args, but the parameter is {item.dtype}"
                            if self.fp32_model
                            else "its args say a bf16 or fp16 run, whose optimizer keeps an fp32 copy; none was saved"
                        )
                        raise UsageError(f"--distributed-optimizer: {item.name} has no float32 main param ({why})")
                    if master is item:  # an fp32 model's FP32 optimizer: the main param is the parameter
                        self._plan_tensor(item, as_master=True)
            elif item.kind == "rng" or (item.pieces and item.pieces[0].file == "common.pt"):
                continue  # RNG: below, per target rank; counters, scheduler: in common.pt
            elif self.src.distopt and BUCKET_OBJECT.match(item.name):
                continue  # dp_reshardable's optimizer objects: into common.pt
            elif item.name.endswith("_extra_state") or "._extra_state/shard_" in item.name:
                self._plan_extra_state(item)
            elif not self.from_dist and item.name not in model:
                continue  # legacy: iteration, scheduler, ... are carried into common.pt from the rank file
            else:
                unknown.append(item.name)  # a model entry (or ShardedObject) with no rule: refused
        gaps = {key: sorted(set(range(self.layers)) - held) for key, held in self.stacked.items()}
        if gaps := {key: lacking for key, lacking in gaps.items() if lacking}:
            key, lacking = next(iter(sorted(gaps.items())))
            raise UsageError(
                f"{key}: only {self.layers - len(lacking)} of the {self.layers} layers hold it (not layer "
                f"{', '.join(map(str, lacking[:6]))}{' …' if len(lacking) > 6 else ''})"
                + (f", and {len(gaps) - 1} more such parameters" if len(gaps) > 1 else "")
                + ": torch_dist stacks a layer's parameter over every layer, so the output would lack the rest "
                "(megatron-core saves layers that differ under each layer's number, which ckpttool does not write)",
                hint="write this model with --to megatron (legacy files), or another format",
            )
        if not self.from_dist and self.src.grouped_mlp:
            self._plan_grouped_extra_states()
        if unknown:
            raise UsageError(
                f"no rule to place {len(unknown)} non-tensor entries in a torch_dist checkpoint: "
                + ", ".join(unknown[:4])
                + (" …" if len(unknown) > 4 else "")
            )
        self._plan_rng()

    def _plan_tensor(self, item: Item, as_master: bool = False) -> None:
        """Plan ``item``'s chunks (``as_master``: a parameter planned a second time as its own main
        param, the distributed optimizer's ``param`` state of an fp32 model)."""
        assert item.shape is not None and item.dtype is not None
        param = _base_param(item)
        if self.tied and param.startswith("output_layer.weight"):
            return  # tied: megatron-core saves the output layer under the embedding's key
        key, layer, expert = self._key(param)
        if item.kind == "master" and self.fp32_model and not self.model_space:
            return  # the FP32 optimizer keeps no main copy of an fp32 model (it is the parameter)
        if as_master:
            key = _MODEL_SPACE_PREFIX["fp32"] + key
        elif item.kind in ("optim", "master"):
            key = (_MODEL_SPACE_PREFIX if self.model_space else _STATE_PREFIX)[item.name.rsplit(".", 1)[1]] + key
        rows = self.rows if _is_vocab(param) else None
        shape = item.shape if rows is None else (rows, *item.shape[1:])
        whole = Box.whole(shape)
        axes = [(i, n) for i, n in ((layer, self.layers), (expert, self.experts)) if i is not None]
        lead = tuple(i for i, _ in axes)  # the layer's index, the expert's, or both
        gshape = (*(n for _, n in axes), *shape)
        dtype, have, chunks = self.tensors.setdefault(key, (item.dtype, gshape, []))
        if layer is not None:
            self.stacked.setdefault(key, set()).add(layer)
        if (dtype, have) != (item.dtype, gshape):
            raise UsageError(f"{item.name}: {item.dtype} {shape} does not stack with the other layers' {key}")
        stage = self._stage(param, layer)
        # the experts split by their own TP (ETP), each part in the file of a TP rank that holds it
        ways = self.etp if expert is not None else self.target.tp
        gated_whole = ways == 1 and _rule(item, self.gated, self.rules)[0] == "gated"
        for t in range(ways):
            regions = _local(item, t, ways, self.gated, self.rules, rows)
            if gated_whole:  # megatron-core saves SwiGLU's gate and up halves as two chunks, even at TP=1
                half = (shape[0] // 2, *shape[1:])
                regions = [Box((0,) * len(shape), half), Box((shape[0] // 2, *(0,) * (len(shape) - 1)), half)]
            for region in regions:
                if t and region == whole:
                    continue  # replicated on every TP rank: written once
                chunk = Box((*lead, *region.offsets), (*(1,) * len(lead), *region.sizes))
                chunks.append(chunk)
                self.ranks[stage * self.target.tp + t % self.target.tp].append(_Chunk(key, item, region, chunk))

    def _plan_extra_state(self, item: Item) -> None:
        if self.from_dist:
            m = _SHARD.match(item.name)
            stacked = m is not None and m["key"].startswith("decoder.layers.")  # offsets: layer[.expert]
            if m is not None and stacked:
                stage = self._stage(item.name, int(m["offsets"].split(".")[0]))
            else:  # (a multi-token prediction layer's: in the MTP stage, with the layer)
                stage = self._stage(_legacy_object_name(item.name, self.local_spec) or item.name, None)
            self._add_object(stage * self.target.tp, item.name, partial(self._copy_record, item))
            return
        param = item.name
        if param == "output_layer._extra_state":
            return  # megatron-core drops it on save (it holds no data)
        piece = next((pc for pc in item.pieces if pc.rank == 0), item.pieces[0])
        one = Item(name=item.name, kind=item.kind, pieces=[piece])
        self._add_object(*self._extra_state_record(param), partial(self._pickle_object, one))

    def _extra_state_record(self, param: str) -> tuple[int, str]:
        """The rank that writes legacy ``_extra_state`` entry ``param`` and its torch_dist key."""
        key, layer, expert = self._key(param)
        if expert is not None and layer is not None:
            key = f"{key}/shard_{layer}.{expert}_{self.layers}.{self.experts}"
        elif expert is not None:  # a multi-token prediction layer's expert
            key = f"{key}/shard_{expert}_{self.experts}"
        elif layer is not None:
            key = f"{key}/shard_{layer}_{self.layers}"
        else:
            key = f"{key}/shard_0_1"
        return self._stage(param, layer) * self.target.tp, key

    def _plan_grouped_extra_states(self) -> None:
        """A legacy GroupedMLP source's experts: its rank files keep no ``_extra_state`` for them,
        but its sharded state dict has one per layer, expert and fc, holding None (for SequentialMLP's
        layout), and megatron-core's load asks for them; written as its save writes them."""
        for name in self.manifest.items:
            m = _EXPERT_FC.search(name)
            if m is not None and (param := f"{name[: m.end(1)]}._extra_state") not in self.manifest.items:
                self._add_object(*self._extra_state_record(param), self._pickle_none)

    @staticmethod
    def _pickle_none(f: BinaryIO, reader: PieceReader) -> None:
        _ptwrite.save([None], f)

    def _plan_rng(self) -> None:
        stp, spp = self.src.tp, self.src.pp
        tp, pp = self.target.tp, self.target.pp
        # under expert parallelism Megatron-LM shards the RNG state by data-parallel rank too
        dp = self._resume_dp() if self.ep > 1 else 1
        sdp = rng_dp(self.manifest.items) or 1  # the DP size a torch_dist source's RNG records are for
        for p in range(pp):
            for t in range(tp):
                for d in range(dp):
                    ts, ps = t % stp, p % spp
                    key = rng_record(p, t, pp, tp, (d, dp) if self.ep > 1 else None)
                    if self.from_dist:
                        name = rng_record(ps, ts, spp, stp, (d % sdp, sdp) if self.src.ep > 1 else None)
                        item = self.manifest.items.get(name)
                        if item is not None:
                            self._add_object(p * tp + t, key, partial(self._copy_record, item))
                    elif carried := self._rng_carried_by(t, p, d % self.ep if self.ep > 1 else 0):
                        # the state this very rank had in an earlier layout, which the source carries
                        self._add_object(p * tp + t, key, partial(self._pickle_rng, carried))
                    elif "rng_state" in self.src.objs[src := self.src.rng_key(ts, ps, d)]:
                        held = (self.src.rels[src], self.src.objs[src]["rng_state"])
                        self._add_object(p * tp + t, key, partial(self._pickle_rng, held))

    def _add_object(self, rank: int, key: str, write: Callable[[BinaryIO, PieceReader], None]) -> None:
        self.objects.append(key)
        self.ranks[rank].append(_Object(key, write))

    # -- object records ----------------------------------------------------------------------------

    @staticmethod
    def _copy_record(item: Item, f: BinaryIO, reader: PieceReader) -> None:
        """A torch_dist source's record, byte for byte."""
        piece = item.pieces[0]
        loc = piece.locator
        if loc.get("transforms") or "offset" not in loc:
            _ptwrite.save(_ptwrite.carried(reader, item), f)
            return
        if reader.files.check_crcs and (archive := reader.archive_of(piece)) is not None:
            archive.watch_all()  # the copy's read checks the record's members
        f.write(reader.files.get(piece.file).read(loc["offset"], loc["length"]))

    def _pickle_object(self, item: Item, f: BinaryIO, reader: PieceReader) -> None:
        """A legacy ``_extra_state`` as megatron-core stores a ``ShardedObject``: ``[value]``."""
        _ptwrite.save([_ptwrite.carried(reader, item)], f)

    @staticmethod
    def _pickle_rng(held: tuple[str, Any], f: BinaryIO, reader: PieceReader) -> None:
        """An RNG state (the file holding it, its value) as megatron-core stores a ``ShardedObject``."""
        rel, value = held
        _ptwrite.save([_ptwrite.carry(value, partial(_pt.archive_cache(reader), rel))], f)

    def _rng_dropped(self) -> list[str]:
        """The rank labels of the source's RNG states (its ranks', and those it carries) that no
        rank of the output gets: of ranks beyond the output's TP or PP size, and carried states
        :meth:`_rng_carried_by` gives no rank."""
        if self.src.dist:
            ranks = {
                (int(at[1]), int(at[0]))
                for name in self.manifest.items
                if (m := _SHARD.match(name)) and m["key"] == "rng_state" and len(at := m["offsets"].split(".")) >= 2
            }
            return [rank_label(t, p) for t, p in sorted(ranks) if t >= self.target.tp or p >= self.target.pp]
        used = {
            id(got[1])
            for p in range(self.target.pp)
            for t in range(self.target.tp)
            for e in range(max(self.ep, 1))
            if (got := self._rng_carried_by(t, p, e)) is not None
        }
        carried = self.src.rng_carried
        return [label for label in self._rng_unhoused if label not in carried or id(carried[label]) not in used]

    # -- the executor's protocol -------------------------------------------------------------------

    def files(self) -> list[PlannedFile]:
        out = []
        for r, entries in enumerate(self.ranks):
            sizes = [e.nbytes for e in entries if isinstance(e, _Chunk)]
            out.append(PlannedFile.of(f"{self.iter_dir}/__{r}_0.distcp", (r,), sizes))
        return out

    def write(self, rank: int, out: Path, reader: PieceReader, progress: Callable[[int], None] | None) -> list[Record]:
        """Write rank ``rank``'s ``.distcp`` file (and, for rank 0, ``common.pt`` and
        ``metadata.json`` beside it); returns where each record lies, for ``finish``."""
        entries: list[Record] = []
        run: list[_Chunk] = []  # chunks in a row: each archive's tensor filled while the one before is written

        def flush(f: BinaryIO) -> None:
            tensors = []
            for e in run:
                check_coverage(e.item)
                assert e.item.dtype is not None
                fill = _Fill(reader, e.item, [e.region])
                tensors.append(_ptwrite.OutTensor(dtype=e.item.dtype, shape=e.chunk.sizes, fill=fill))
            # as DCP's FileSystemWriter: one archive per chunk, straight into the file
            spans = _ptwrite.save_each(iter(tensors), f, scratch=self.scratch, progress=progress)
            entries.extend((e.key, e.chunk.offsets, start, n) for e, (start, n) in zip(run, spans, strict=True))
            run.clear()

        with open_output(out) as f:
            for e in self.ranks[rank]:
                if isinstance(e, _Object):
                    flush(f)
                    start = f.tell()
                    e.write(f, reader)
                    entries.append((e.key, None, start, f.tell() - start))
                else:
                    run.append(e)
            flush(f)
        if rank == 0:
            _ptwrite.save(self._common(reader), out.parent / "common.pt")
            (out.parent / "metadata.json").write_text(json.dumps(CONFIG))
        return entries

    def last_files(self) -> list[str]:
        """What rank 0's task writes beside its file, and :meth:`finish` once all are written."""
        return [f"{self.iter_dir}/{n}" for n in ("common.pt", "metadata.json", ".metadata")] + super().last_files()

    def finish(self, tmp: Path, results: list[Any]) -> None:
        write_metadata(
            tmp / self.iter_dir / ".metadata",
            keys={**self.tensors, **dict.fromkeys(self.objects)},  # Megatron's order: tensors, then objects
            records={f"__{r}_0.distcp": entries for r, entries in enumerate(results)},
            planner_data=None,
            checkpoint_id=self.iter_dir,
        )
        super().finish(tmp, results)

    # -- common.pt ---------------------------------------------------------------------------------

    def _common(self, reader: PieceReader) -> dict[str, Any]:
        if self.from_dist:
            common = self.src.objs[(0, 0, 0)]
            archive = partial(reader.archive_of, _pt.object_piece("common.pt", ""))
            tree = {k: (self._dist_args(v) if k == "args" else _ptwrite.carry(v, archive)) for k, v in common.items()}
            if self.optimizer_commons:
                members = [{k: _ptwrite.carry(v, archive) for k, v in m.items()} for m in self.optimizer_commons]
                tree["optimizer"] = self._optimizer_entry(members)
                tree["content_metadata"] = self._content_metadata()
            return tree
        first, rel = self.src.objs[(0, 0, 0)], self.src.rels[(0, 0, 0)]
        archives = _pt.archive_cache(reader)
        tree = {}
        for key, value in first.items():
            if key == "args":
                tree[key] = self._dist_args(value)
            elif key == "optimizer" and self.model_space:
                # DistributedOptimizer.state_dict(): the param groups without members, with their step
                tree[key] = self._optimizer_entry([self._distopt_state(archives, kind) for kind in self._members])
            elif key == "optimizer":
                tree[key] = self._optimizer_entry(
                    [self._common_optimizer(reader, archives, kind) for kind in self._members]
                )
            elif key in ("rng_state", RNG_CARRIED, SPLIT_RULES) or re.fullmatch(r"model\d*", key):
                continue  # (ckpttool's own keys of a legacy file it wrote: the records say it all)
            else:
                tree[key] = _ptwrite.carry(value, partial(archives, rel))
        tree["content_metadata"] = self._content_metadata()
        return tree

    def _optimizer_entry(self, members: list[dict[str, Any]]) -> Any:
        """``common.pt``'s ``optimizer``: the one optimizer's part, or under expert parallelism
        megatron-core's ChainedOptimizer ``{0: dense, 1: experts}``; in model space each member with
        its ``param_state_sharding_type``."""
        if self.model_space:
            members = [{**m, "param_state_sharding_type": "fully_reshardable"} for m in members]
        return dict(enumerate(members)) if len(members) > 1 else members[0]

    def _content_metadata(self) -> dict[str, Any]:
        """``common.pt``'s ``content_metadata``: Megatron-LM's, with the distributed optimizer's
        sharding type first when its state is written (model space)."""
        if not self.model_space:
            return dict(CONTENT_METADATA)
        return {
            "distrib_optim_sharding_type": "fully_reshardable",
            "distrib_optim_fully_reshardable_mem_efficient": False,
            **CONTENT_METADATA,
        }

    def _dist_args(self, args: Any) -> Any:
        new = self._args(args, 0, 0)
        if "ckpt_format" in new.__dict__:
            new.__dict__["ckpt_format"] = "torch_dist"
        if "use_dist_ckpt" in new.__dict__:  # (Megatron-LM derives it: ckpt_format != "torch")
            new.__dict__["use_dist_ckpt"] = True
        return new

    def _common_optimizer(
        self, reader: PieceReader, archives: Callable[[str], Any], kind: bool | None
    ) -> dict[str, Any]:
        """The optimizer's non-sharded part: param groups without ``params`` (of the chain's dense
        or expert optimizer, ``kind``, as in ``_target_groups``) and one common step."""
        steps: dict[bytes, Any] = {}
        for rel, value in self.src.step_of.values():
            carried = _ptwrite.carry(value, partial(archives, rel))
            steps.setdefault(_value_bytes(carried), carried)
        if len(steps) > 1:
            raise UsageError(
                "the optimizer's step differs between parameters; torch_dist keeps one step for all "
                "(megatron-core refuses such an optimizer too)"
            )
        state: dict[str, Any] = {}
        if steps:
            state["common_step"] = next(iter(steps.values()))
        inner = {"state": state, "param_groups": [hyper for hyper, _ in self._target_groups(kind)]}
        return self._plain_optimizer(inner, self._optimizer_extra(archives))

    def notes(self) -> list[str]:
        out = super().notes()
        if dropped := self._rng_dropped():
            out.append(
                f"RNG state of {len(dropped)} rank(s) of the source (or of a layout it carries) that this layout "
                f"has none for ({_few(dropped)}) is not written: torch_dist keeps the RNG of its own ranks only"
                + ("" if self.src.dist else " (a reshard to a legacy layout keeps them, for a reshard back)")
            )
        if self.ep > 1:
            out.append(
                "RNG state is sharded by data-parallel rank under expert parallelism: written for "
                f"DP={self._resume_dp()}; resume at that DP, or with --no-load-rng"
            )
        if not self.from_dist:
            out.append("written from a legacy checkpoint: Megatron reads it with --ckpt-format torch_dist (default)")
        if self.model_space:
            out.append(
                "the distributed optimizer's state is written in its fully_reshardable layout (model space), "
                "which Megatron-LM loads at any TP and PP: resume with --use-distributed-optimizer"
            )
        return out


_LEGACY_ORDER = ("args", "checkpoint_version", "iteration", "model", "optimizer", "opt_param_scheduler")
"""the first entries of a legacy rank file, as Megatron-LM's ``generate_state_dict`` makes them
(then ``rerun_state_machine``, ``rng_state`` and what ``save_checkpoint`` adds)"""


def load_dist_source(root: Path, manifest: Manifest) -> _Source:
    """A ``torch_dist`` checkpoint as the legacy writer's source: one rank-file template per source
    (TP, PP, EP) rank (``common.pt``'s entries in a legacy rank file's order, the rank's
    ``rng_state`` record), the model entries in megatron-core's module order (:func:`module_order`:
    torch_dist does not keep it), ``_extra_state`` records by their legacy names, and the param
    groups of ``common.pt`` (of the distributed optimizer's ``dp_reshardable`` records), each with
    the common step. torch_dist keeps no module ``_metadata`` (Megatron-LM's own torch_dist load
    gives the model none either)."""
    common, src = _dist_common(root, manifest)
    args = common["args"]
    if src.experts and any((slot := expert_slot(n)) and slot[2] for n in manifest.items):
        raise UsageError("writing legacy checkpoints of grouped-GEMM experts from torch_dist is not supported yet")
    local_spec = getattr(args, "transformer_impl", None) == "local"
    names: list[str] = []
    unknown: list[str] = []
    rng: dict[str, Item] = {}
    for name, item in manifest.items.items():
        if item.pieces and item.pieces[0].file == "common.pt":
            continue  # common.pt's entries: carried from the template
        if item.is_tensor:
            if item.kind not in ("optim", "master", "rng"):
                names.append(name)
        elif name.startswith("rng_state/shard_"):
            rng[name] = item
        elif src.distopt and BUCKET_OBJECT.match(name):
            continue  # the dp_reshardable optimizer's records: read for the param groups
        elif (legacy := _legacy_object_name(name, local_spec)) is not None:
            src.objects[legacy] = item
        else:
            unknown.append(name)
    if unknown:
        raise UsageError(
            f"no rule to place {len(unknown)} torch_dist records in a legacy checkpoint: "
            + ", ".join(unknown[:4])
            + (" …" if len(unknown) > 4 else "")
        )
    if any(n.startswith("output_layer.") for n in names) or "embedding.word_embeddings.weight" in names:
        # megatron-core drops the output layer's _extra_state on save; it is always None
        src.objects.setdefault("output_layer._extra_state", None)
    src.model_order = module_order([*names, *src.objects])
    opt = common.get("optimizer")
    if opt is not None:
        why = "--to megatron from this torch_dist checkpoint"
        members = model_space_members(manifest, opt) if src.distopt else float16_members(root, opt, why)
        for c, member in enumerate(members):
            inner: Any = member.get("optimizer") if isinstance(member, dict) else None
            groups = inner.get("param_groups") if isinstance(inner, dict) else None
            if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
                raise CorruptFileError(
                    f"the optimizer state of this torch_dist checkpoint (optimizer {c}) has no param groups"
                )
            state = inner.get("state")
            step = state.get("common_step") if isinstance(state, dict) else None
            for group in groups:
                hyper = {k: v for k, v in group.items() if k != "params"}
                if step is not None:
                    hyper["step"] = step
                if hyper not in src.groups:
                    src.groups.append(hyper)
        extra = {k: v for k, v in members[0].items() if k not in ("optimizer", "param_state_sharding_type")}
        src.optimizer_extra = ("common.pt", extra)
    template = {
        k: None if k in ("model", "optimizer") else common[k] for k in _LEGACY_ORDER if k in common or k == "model"
    }
    if "rerun_state_machine" in common:
        template["rerun_state_machine"] = common["rerun_state_machine"]
    after = {k: v for k, v in common.items() if k not in template and k != "content_metadata"}
    sdp = rng_dp(rng)  # under expert parallelism the records are by DP rank too
    for t in range(src.tp):
        for p in range(src.pp):
            for e in range(src.ep):
                name = rng_record(p, t, src.pp, src.tp, (e % sdp, sdp) if sdp else None)
                obj = dict(template)
                if name in rng:
                    obj["rng_state"] = SourceObject(rng[name])
                obj.update(after)
                src.objs[(t, p, e)], src.rels[(t, p, e)] = obj, "common.pt"
    return src


def _dist_common(root: Path, manifest: Manifest) -> tuple[dict[str, Any], _Source]:
    """A torch_dist checkpoint's ``common.pt`` and what its ``args`` and the manifest's layout say
    of the source (no rank files yet); a distributed-optimizer layout ckpttool cannot rewrite is
    refused here."""
    archive, common, _ = _pt.load(root, "common.pt", ALLOWLIST)
    archive.close()
    if not isinstance(common, dict) or "args" not in common:
        raise UsageError("common.pt has no args: ckpttool cannot tell the model's layout")
    args, lay = common["args"], manifest.layout
    src = _Source(
        tp=lay.tp or 1,
        pp=lay.pp or 1,
        objs={},
        rels={},
        ep=lay.ep or 1,
        experts=int(getattr(args, "num_experts", None) or 0),
        distopt=bool(getattr(args, "use_distributed_optimizer", False)),
        etp=own_etp(args),
        dist=True,
    )
    if src.distopt:
        check_distopt_source(manifest)
    return common, src


def rng_record(p: int, t: int, pp: int, tp: int, dp: tuple[int, int] | None = None) -> str:
    """The name of Megatron-LM's torch_dist RNG record of rank (t, p): ``rng_state/shard_<p>.<t>_<PP>.<TP>``;
    under expert parallelism, with ``dp`` = (DP rank, DP size), ``rng_state/shard_<p>.<t>.<d>_<PP>.<TP>.<DP>``
    (``get_rng_state``)."""
    if dp is None:
        return f"rng_state/shard_{p}.{t}_{pp}.{tp}"
    return f"rng_state/shard_{p}.{t}.{dp[0]}_{pp}.{tp}.{dp[1]}"


def rng_dp(names: Any) -> int:
    """The data-parallel size the RNG records among ``names`` are sharded for (0: not by DP)."""
    for name in names:
        m = _SHARD.match(name)
        if m is not None and m["key"] == "rng_state" and m["shape"].count(".") == 2:
            return int(m["shape"].rsplit(".", 1)[1])
    return 0


def _legacy_object_name(name: str, local_spec: bool) -> str | None:
    """The legacy model entry of a torch_dist ``_extra_state`` record (None: not one): a layer's
    ``<key>/shard_<layer>_<L>``, a routed expert's
    ``decoder.layers.mlp.experts.experts.<rest>/shard_<layer>.<expert>_<L>.<E>`` (a multi-token
    prediction layer's: ``mtp.layers.<k>.transformer_layer.mlp.experts.experts.<rest>/shard_<expert>_<E>``)."""
    m = _SHARD.match(name)
    if m is None or not m["key"].endswith("._extra_state"):
        return None
    key, offsets = m["key"], m["offsets"].split(".")
    head, sep, rest = key.partition(".transformer_layer.mlp.experts.experts.")
    if sep and head.startswith("mtp.layers.") and len(offsets) == 1:
        return f"{head}.transformer_layer.mlp.experts.local_experts.{offsets[0]}.{rest}"
    if not key.startswith("decoder.layers."):
        return key if offsets == ["0"] else None
    rest = key[len("decoder.layers.") :]
    if rest.startswith("mlp.experts.experts."):
        if len(offsets) != 2:
            return None
        rest = f"mlp.experts.local_experts.{offsets[1]}.{rest[len('mlp.experts.experts.') :]}"
    elif len(offsets) != 1:
        return None
    if local_spec:
        rest = _TE_TO_LOCAL.get(rest, rest)
    return f"decoder.layers.{offsets[0]}.{rest}"


def float16_members(root: Path, optimizer: Any, why: str) -> list[dict[str, Any]]:
    """The Float16 (or FP32) optimizer's part of a torch_dist ``common.pt`` (its ``optimizer``
    entry), per optimizer: one, or megatron-core's chain's dense and expert members. Each is
    ``{'optimizer': {'state': {'common_step': t}, 'param_groups': [...]}, ...}``, its common step
    read as a float here (the distributed optimizer keeps it so in each group); ``why``: what
    needs it, for the refusal."""
    members = _chain_members(optimizer)
    # megatron-core's FP32Optimizer (an fp32 model's) saves its torch optimizer's state dict bare
    members = [{"optimizer": m} if isinstance(m, dict) and "param_groups" in m else m for m in members]
    archive, _, _ = _pt.load(root, "common.pt", ALLOWLIST)
    try:
        out = []
        for k, member in enumerate(members):
            inner: dict[str, Any] = member.get("optimizer") or {} if isinstance(member, dict) else {}
            state = inner.get("state")
            step = state.get("common_step") if isinstance(state, dict) else None
            if step is None:
                raise UsageError(
                    f"{why}: common.pt's optimizer {k} has no common_step (it never stepped, or it is not "
                    "megatron-core's Float16 optimizer state)"
                )
            if isinstance(step, _unpickle.TensorRef):
                step = read_tensor(archive, step).reshape(-1)[0]
            value = {**inner, "state": {**inner["state"], "common_step": float(step)}}
            out.append({**member, "optimizer": value})
        return out
    finally:
        archive.close()


def check_distopt_source(manifest: Manifest) -> None:
    """Refuse a torch_dist distributed-optimizer layout that is not read as the run's parameters,
    with the reason."""
    sharding = manifest.extras.get("distrib_optim_sharding_type")
    kept = str(manifest.extras.get("distrib_optim", ""))
    if sharding not in ("dp_reshardable", "fully_reshardable"):
        raise UsageError(
            f"this torch_dist checkpoint's distributed-optimizer layout is {sharding!r}; ckpttool rewrites "
            "dp_reshardable and fully_reshardable (megatron-core 0.13 and later)",
            hint="'ckpttool convert --to dcp' keeps its state in a layout-free form",
        )
    if kept.startswith("kept as"):
        raise UsageError(
            f"this torch_dist checkpoint's distributed-optimizer state is {kept}",
            hint="'ckpttool inspect' shows the buckets as saved; 'ckpttool convert --to dcp' keeps them",
        )


def model_space_members(manifest: Manifest, optimizer: Any) -> list[dict[str, Any]]:
    """The optimizer's part of ``common.pt`` in the ``fully_reshardable`` layout, per optimizer
    (megatron-core's ChainedOptimizer under expert parallelism: the dense, then the experts'):
    the optimizer state dict without per-parameter state (param groups with their step; a grad
    scaler), which a ``dp_reshardable`` source keeps once per model-parallel rank as
    ShardedObjects (``[chained_<c>.]optimizer.distributed.dp_group_idx_<g>.<key>``); those must
    agree. ``optimizer``: ``common.pt``'s entry."""
    if manifest.extras.get("distrib_optim_sharding_type") == "fully_reshardable":
        members = _chain_members(optimizer)
        for k, member in enumerate(members):
            if not isinstance(member, dict) or not isinstance(member.get("optimizer"), dict):
                raise CorruptFileError(
                    f"common.pt: no optimizer state dict beside the fully_reshardable state (optimizer {k})"
                )
        return [{k: v for k, v in m.items() if k != "param_state_sharding_type"} for m in members]
    from ckpttool.formats.megatron import MegatronDistReader

    found: dict[tuple[int | None, int], dict[str, Any]] = {}  # (chain member, dp_group_idx) -> objects
    with MegatronDistReader(manifest) as reader:
        for name, item in manifest.items.items():
            m = BUCKET_OBJECT.match(name)
            if m is None or m["key"] in ("per_bucket_numel", "per_bucket_numel_unpadded"):
                continue
            c = None if m["c"] is None else int(m["c"])
            # its tensors (a grad scaler's) live in this record, not in common.pt: read while it is open
            found.setdefault((c, int(m["g"])), {})[m["key"]] = sharded_value(
                _ptwrite.carried(reader, item, now=True), name
            )
    chain = sorted({c for c, _ in found}, key=lambda c: -1 if c is None else c)
    if chain not in ([None], [0, 1]) or any("optimizer" not in v for v in found.values()):
        raise CorruptFileError(
            "the param groups of this dp_reshardable checkpoint are missing: expected an "
            "optimizer.distributed.dp_group_idx_<g>.optimizer object for every model-parallel rank (chained_0. "
            f"and chained_1. under expert parallelism), found them for {sorted(map(str, found))[:6]}"
        )
    out = []
    for c in chain:
        groups = {g: v for (k, g), v in found.items() if k == c}
        first = groups[min(groups)]
        differ = sorted(g for g, v in groups.items() if _content(v) != _content(first))
        if differ:
            member = "" if c is None else f" ({'dense' if c == 0 else 'expert'} optimizer)"
            raise UsageError(
                f"the optimizer state{member} of model-parallel ranks {differ} differs from rank "
                f"{min(groups)}'s (param groups, step); the fully_reshardable layout keeps one for all"
            )
        out.append(first)
    return out


def _optimizer_groups(member: dict[str, Any]) -> list[dict[str, Any]]:
    """The param groups of one optimizer's part of ``common.pt`` (the Float16 or the distributed
    optimizer's ``{'optimizer': {...}, ...}``, or an FP32 optimizer's torch state dict, bare)."""
    inner = member.get("optimizer", member)
    groups = inner.get("param_groups") if isinstance(inner, dict) else None
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise CorruptFileError(f"common.pt: an optimizer without param groups ({type(groups).__name__})")
    return groups


def _with_groups(member: dict[str, Any], groups: list[dict[str, Any]]) -> dict[str, Any]:
    """``member`` (as :func:`_optimizer_groups` reads it) with ``groups`` as its param groups."""
    if "optimizer" in member:
        return {**member, "optimizer": {**member["optimizer"], "param_groups": groups}}
    return {**member, "param_groups": groups}


def _chain_members(optimizer: Any) -> list[Any]:
    """The optimizers of a ``common.pt`` optimizer entry: megatron-core's ChainedOptimizer
    ``{0: ..., 1: ...}``'s members in order, or the entry itself."""
    if isinstance(optimizer, dict) and optimizer and all(isinstance(k, int) for k in optimizer):
        return [optimizer[k] for k in sorted(optimizer)]
    return [optimizer]


def _content(value: Any) -> Any:
    """A comparable form of a carried tree: its structure, its plain values, its tensors' bytes."""
    if isinstance(value, _ptwrite.OutTensor):
        return ("tensor", _value_bytes(value))
    if isinstance(value, dict):
        return (type(value).__name__, [(k, _content(v)) for k, v in value.items()])
    if isinstance(value, list | tuple):
        return (type(value).__name__, [_content(v) for v in value])
    if isinstance(value, _unpickle.Record):
        return (type(value).__name__, _content(value.__dict__))
    return repr(value)


def _value_bytes(value: Any) -> bytes:
    """Comparable bytes of a carried value (an OutTensor's contents, or its repr)."""
    if isinstance(value, _ptwrite.OutTensor):
        buf = np.empty(value.nbytes, dtype=np.uint8)
        value.fill(buf)
        return value.dtype.encode() + b":" + buf.tobytes()
    return repr(value).encode()


__all__ = ["CONFIG", "DistWriter"]
