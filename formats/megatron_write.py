"""Writing a Megatron-LM legacy checkpoint (``iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt``) at a new
tensor- and pipeline-parallel size, from a legacy checkpoint at any other.

Everything a resume reads is carried:

* the model state dict of each (TP, PP) rank, with layers renumbered locally, ``_extra_state``
  entries and the module ``_metadata`` Megatron's ``load_state_dict`` sees;
* the optimizer (``Float16OptimizerWithFloat16Params`` / ``FP32Optimizer`` state dicts): Adam
  moments and fp32 master copies cut with the parameter's split rule, parameter ids renumbered
  group by group in model order (the order ``torch.optim.Optimizer.load_state_dict`` matches them
  by), group hyper-parameters and per-parameter ``step`` kept;
* ``args`` with the new sizes (and the ``make_vocab_size_divisible_by`` that reproduces the
  vocabulary padding at the new TP; the first and last stages' layer counts of an uneven
  pipeline), ``iteration``, ``checkpoint_version``, the LR scheduler,
  ``num_floating_point_operations_so_far``;
* RNG state: rank (t, p) gets the source's rank (t mod TP, p mod PP) states (the per-rank RNG of a
  different layout cannot exist; replay after a TP/PP change is not bit-identical anyway); the
  source ranks the output has none for keep theirs in its first rank file (``ckpttool_rng_state``),
  which a reshard back to their layout gives them.

The split rules are the reader's (:func:`ckpttool.formats.megatron.split_rule`): column, row,
SwiGLU halves (``[gate_r; up_r]``), replicated. One tensor is in memory at a time.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property, partial
from pathlib import Path
from typing import Any

import numpy as np

from ckpttool import _torchzip, _unpickle
from ckpttool._torchzip import read_tensor
from ckpttool.assemble import assemble, check_coverage
from ckpttool.dtypes import carrier
from ckpttool.dtypes import dtype as lookup_dtype
from ckpttool.errors import CorruptFileError, UsageError
from ckpttool.formats import _pt, _ptwrite
from ckpttool.formats.base import PieceReader, PlannedFile
from ckpttool.formats.megatron import (
    _LAYER,
    ALLOWLIST,
    RNG_CARRIED,
    SPLIT_RULES,
    TRACKER,
    MegatronDistReader,
    Saver,
    args_pipeline,
    bucket_size,
    chunk_shared_embedding,
    example_layout,
    expert_of,
    expert_slot,
    experts_owner,
    grad_buffer_layout,
    grouped_experts,
    is_expert,
    label_ranks,
    layout_stages,
    matched_dim,
    model_chunks,
    mtp_chunk,
    mtp_copy_apart,
    optimizer_members,
    own_etp,
    placement,
    rank_dir,
    rank_label,
    rank_of,
    renumber_expert,
    rng_holders,
    rule_of_dim,
    saving_ranks,
    split_rule,
    stage_split,
    tied_output_copy,
    tp_regions,
)
from ckpttool.geometry import Box
from ckpttool.manifest import Item, Manifest
from ckpttool.naming import RANK_LABEL, plural
from ckpttool.values import flatten, same_value

_STATE_KEYS = ("exp_avg", "exp_avg_sq")
_GROUP_KEYS = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")
"""megatron-core's ``param_group_identifier_keys``"""
DISTRIB = "distrib_optim.pt"


@dataclass(slots=True)
class _Source:
    """What the writer needs from the source besides its items: one rank file's tree per (t, p, e)."""

    tp: int
    pp: int
    objs: dict[tuple[int, int, int], Any]
    rels: dict[tuple[int, int, int], str]
    ep: int = 1
    """expert-parallel ranks (rank files per TP x PP rank)"""
    model_order: list[str] = field(default_factory=list)
    """global names of model state-dict entries, in model order"""
    group_of: dict[str, int] = field(default_factory=dict)
    groups: list[dict[str, Any]] = field(default_factory=list)
    """param-group hyper-parameters (without ``params``), in source order"""
    step_of: dict[str, tuple[str, Any]] = field(default_factory=dict)
    """per-parameter optimizer ``step`` (rank file, value) by global parameter name"""
    metadata: dict[str, Any] = field(default_factory=dict)
    """the module ``_metadata`` of all stages, layers numbered globally"""
    optimizer_extra: tuple[str, dict[str, Any]] = ("", {})
    """(rank file, entries beside ``optimizer``: loss scaler, grad scaler with its tensors, ...)"""
    experts: int = 0
    """routed experts of the model (``args.num_experts``; 0: none)"""
    grouped_mlp: bool = False
    """the experts were saved by megatron-core's legacy GroupedMLP (``mlp.experts.weight1`` and
    ``weight2``, read one item per expert: :class:`~ckpttool.formats.megatron.GroupedWeights`)"""
    fp32_masters: bool = False
    """the optimizer keeps fp32 master copies (``fp32_from_fp16_params``: Megatron's Float16
    optimizer); without, an FP32 optimizer's bare torch state dict"""
    distopt: bool = False
    """saved by the distributed optimizer: its state in ``distrib_optim.pt`` beside each rank file,
    ``groups`` its param groups as saved (no ``params``, the common ``step``), no membership"""
    buffer_key: Any = None
    """the ``(param dtype, grad dtype)`` key of the source's ``distrib_optim.pt`` grad buffer"""
    etp: int = 0
    """expert tensor-parallel ranks (``args.expert_tensor_parallel_size``; 0: the experts split as
    the other layers, TP ways)"""
    rng_of: dict[tuple[int, int, int], tuple[int, int, int]] = field(default_factory=dict)
    """under expert tensor parallelism, the rank file holding the RNG state of each dense rank
    (TP, PP, DP rank) of the source run (:func:`~ckpttool.formats.megatron.rng_holders`)"""
    dp: int = 1
    """the source run's data-parallel size times its context-parallel size (under expert TP)"""
    rng_carried: dict[str, Any] = field(default_factory=dict)
    """RNG states of ranks of another layout that the source carries (``ckpttool_rng_state`` of a
    checkpoint ckpttool wrote), by rank label: none a rank file of the source has"""
    dist: bool = False
    """a ``torch_dist`` source: one ``common.pt`` for all ranks, global tensors, ``ShardedObject``
    records; its param groups (from ``common.pt``, each given the common step) name no members"""
    objects: dict[str, Item | None] = field(default_factory=dict)
    """model entries that are no manifest items by their legacy name: a ``torch_dist`` source's
    ``_extra_state`` records (``ShardedObject`` items) by the entry's name, or None for an entry
    megatron-core does not save (``output_layer._extra_state``, always None)"""

    @property
    def memberless(self) -> bool:
        """Whether the param groups do not say which parameters are theirs (the distributed
        optimizer's, and any ``torch_dist`` checkpoint's): each carries the common ``step``."""
        return self.distopt or self.dist

    def key(self, t: int, p: int, e: int) -> tuple[int, int, int]:
        """A rank file of PP rank ``p`` and EP rank ``e`` (TP rank ``t`` if it has one: under expert
        tensor parallelism not every (TP, EP) pair saves a file)."""
        want = (t % self.tp, p % self.pp, e % self.ep)
        if want in self.objs:
            return want
        found = next((k for k in sorted(self.objs) if k[1:] == want[1:]), None)
        if found is None:
            raise CorruptFileError(f"no rank file of PP rank {want[1]} and EP rank {want[2]} in the source")
        return found

    def rng_key(self, t: int, p: int, d: int) -> tuple[int, int, int]:
        """The rank file whose RNG state dense rank (TP ``t``, PP ``p``, DP-CP rank ``d``) gets, each
        taken modulo the source's sizes: under expert tensor parallelism the file that rank saved or
        one of the same seeds (``rng_of``), else its TP and PP rank's at DP-CP rank 0 (every such
        rank saves a file); otherwise the file of EP rank ``d`` (at ETP = TP the rank of DP-CP rank
        ``d`` < EP saves it)."""
        if not self.rng_of:
            return self.key(t, p, d)
        t, p = t % self.tp, p % self.pp
        return self.rng_of.get((t, p, d % self.dp)) or self.rng_of.get((t, p, 0)) or self.key(t, p, d)


@dataclass(frozen=True, slots=True)
class SourceObject:
    """A ``torch_dist`` source's ``ShardedObject`` record (megatron-core stores it as ``[value]``),
    read when the file that holds its value is written."""

    item: Item

    def value(self, reader: PieceReader) -> Any:
        """The record's value, its tensors carried."""
        return sharded_value(_ptwrite.carried(reader, self.item), self.item.name)


def sharded_value(record: Any, name: str) -> Any:
    """The value of a ``ShardedObject`` record as megatron-core stores it, ``[value]``."""
    if not isinstance(record, list) or len(record) != 1:
        raise CorruptFileError(f"{name}: expected a ShardedObject's [value], found {type(record).__name__}")
    return record[0]


@dataclass(slots=True, kw_only=True)
class MegatronTarget:
    tp: int
    pp: int
    repad_vocab: bool = False
    """pad the vocabulary as Megatron pads it at the new TP (``make_vocab_size_divisible_by`` x TP
    rows), instead of keeping the source's padded rows"""
    distributed_optimizer: bool | None = None
    """write the distributed optimizer's layout (``distrib_optim.pt``); None: as the source"""
    uneven: tuple[int | None, int | None] | None = None
    """layers on the first and last pipeline stages (``--decoder-first/last-pipeline-num-layers``;
    None for either: that stage like the middle ones); None: as the source"""
    vpp: int | None = None
    """virtual pipeline stages (model chunks) per pipeline rank; None: as the source"""
    ep: int | None = None
    """expert-parallel ranks (each holds num_experts / EP routed experts); None: as the source"""
    etp: int | None = None
    """expert tensor-parallel ranks (each routed expert split over them); None: the source's when it
    differs from its TP, else TP"""
    layout: str | None = None
    """``--pipeline-model-parallel-layout`` of the output; "": none (even or ``uneven`` stages);
    None: as the source"""


def _same_state(
    a: Any, b: Any, archive_a: Callable[[], _torchzip.Archive], archive_b: Callable[[], _torchzip.Archive]
) -> bool:
    """Whether two objects read from rank files hold the same values: tensors (read from their
    files' archives) and numpy arrays by dtype, shape and bytes; other values as ``diff`` compares
    them (a float bit for bit, a bool not the int it equals)."""
    if isinstance(a, _unpickle.TensorRef) or isinstance(b, _unpickle.TensorRef):
        if not (isinstance(a, _unpickle.TensorRef) and isinstance(b, _unpickle.TensorRef)):
            return False
        if (a.dtype, a.shape) != (b.dtype, b.shape):
            return False
        return read_tensor(archive_a(), a).tobytes() == read_tensor(archive_b(), b).tobytes()
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and (a.dtype, a.shape) == (b.dtype, b.shape)
            and a.tobytes() == b.tobytes()
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k], archive_a, archive_b) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(_same_state(x, y, archive_a, archive_b) for x, y in zip(a, b, strict=True))
        )
    return same_value(a, b)


def _few(labels: list[str]) -> str:
    return ", ".join(labels[:4]) + (f" and {len(labels) - 4} more" if len(labels) > 4 else "")


def _globalize(local: str, offset: int, expert_offset: int = 0) -> str:
    m = _LAYER.match(local)
    name = f"{m['pre']}{int(m['i']) + offset}{m['rest']}" if m else local
    return renumber_expert(name, lambda j: j + expert_offset) if expert_offset else name


def _layer_of(name: str) -> int | None:
    m = _LAYER.match(name)
    return int(m["i"]) if m else None


def load_source(root: Path, manifest: Manifest) -> _Source:
    """Re-read the rank files' pickles (no tensor bytes) for the state the manifest does not keep."""
    from ckpttool.formats.megatron import _layer_offset

    tp, pp, ep = manifest.layout.tp or 1, manifest.layout.pp or 1, manifest.layout.ep or 1
    objs: dict[tuple[int, int, int], Any] = {}
    rels: dict[tuple[int, int, int], str] = {}
    for f in manifest.files:
        parts = f.path.split("/")
        if parts[-1] != "model_optim_rng.pt":
            continue
        rank = rank_of(parts[-2], pp)
        archive, obj, _ = _pt.load(root, f.path, ALLOWLIST)
        archive.close()
        objs[rank], rels[rank] = obj, f.path
    src = _Source(tp=tp, pp=pp, objs=objs, rels=rels, ep=ep)
    first = objs[(0, 0, 0)]
    args = first.get("args")
    src.experts = int(getattr(args, "num_experts", None) or 0)
    src.etp = own_etp(args)
    src.rng_of, src.dp = rng_holders(args)
    carried = first.get(RNG_CARRIED)
    if isinstance(carried, dict):
        own = {rank_label(*k) for k in objs}
        src.rng_carried = {
            k: v for k, v in carried.items() if isinstance(k, str) and RANK_LABEL.fullmatch(k) and k not in own
        }
    local = src.experts // ep if src.experts else 0
    distrib = {key: (root / rel).with_name("distrib_optim.pt").is_file() for key, rel in rels.items()}
    if any(distrib.values()):
        lacking = sorted(rels[k] for k, v in distrib.items() if not v)
        if lacking:
            raise CorruptFileError(
                f"{len(lacking)} rank directories have no distrib_optim.pt beside model_optim_rng.pt, the others "
                f"do: {', '.join(lacking[:4])}",
                hint="a rank's distributed-optimizer save did not finish; use another iteration",
            )
        src.distopt = True
        rel = str(Path(rels[(0, 0, 0)]).with_name("distrib_optim.pt"))
        archive, tree, _ = _pt.load(root, rel, ALLOWLIST)
        archive.close()
        # the reader checked: one buffer of one dtype (a list under expert parallelism: dense, experts)
        first_state = tree if isinstance(tree, dict) else next(m for m in tree if isinstance(m, dict))
        src.buffer_key = next(iter(first_state[0]))
    for p in range(pp):
        for e in range(ep):  # the dense entries of every EP rank's file are the same
            _read_stage(src, args, src.key(0, p, e), _layer_offset, local)
    src.model_order = _canonical(src.model_order)
    # module by module, as the model order: each EP rank's experts in their layer's block
    src.metadata = {k[:-1]: src.metadata[k[:-1]] for k in _canonical([k + "." for k in src.metadata])}
    return src


def _read_stage(src: _Source, args: Any, rank: tuple[int, int, int], layer_offset: Any, local: int) -> None:
    """Rank file ``rank``'s model order, module metadata and optimizer groups and steps, into ``src``."""
    obj, rel = src.objs[rank], src.rels[rank]
    _, p, e = rank
    order: list[tuple[str, tuple[int, ...]]] = []  # the optimizer's parameters: chunk by chunk
    experts_of: dict[str, list[str]] = {}  # a GroupedMLP weight -> its experts' items (the reader's names)
    # tied at PP > 1: the last stage's output_layer.weight, read as a copy of the embeddings, is no entry of
    # the model order (the writer gives a tied target's last stage its copy)
    tied_copy = tied_output_copy(args, src.pp)
    for vp, model in model_chunks(obj):
        offset = layer_offset(args, p, vp, rel)
        for name_here, value in model.items():
            name = _globalize(name_here, offset, e * local)
            experts = grouped_experts(name, e * local, local) if local else None
            if experts is not None:
                experts_of[name] = experts
                src.grouped_mlp = True
            if not (tied_copy and name == "output_layer.weight"):
                src.model_order += experts or [name]
            if isinstance(value, _unpickle.TensorRef):
                order.append((name, value.shape))
        for key, value in (getattr(model, "__dict__", {}).get("_metadata") or {}).items():
            gkey = _globalize(key + ".", offset, e * local)[:-1] if key else key
            src.metadata.setdefault(gkey, value)
    opt = obj.get("optimizer")
    if src.distopt:  # groups without members; the tensors are in distrib_optim.pt
        for member in opt if isinstance(opt, list) else [opt]:  # a chain under expert parallelism
            if not isinstance(member, dict):
                continue
            inner: dict[str, Any] = member["optimizer"] if isinstance(member.get("optimizer"), dict) else member
            for group in inner.get("param_groups") or []:
                hyper = {k: v for k, v in group.items() if k != "params"}
                if hyper not in src.groups:
                    src.groups.append(hyper)
            if not src.optimizer_extra[0]:
                src.optimizer_extra = (rel, {k: v for k, v in member.items() if k != "optimizer"})
        return
    for member, params in optimizer_members(opt, order, rel):
        inner = member["optimizer"]
        groups, state = inner.get("param_groups") or [], inner.get("state") or {}
        ids = _pt.match_param_ids(params, groups, state)
        if ids is None:
            raise CorruptFileError(f"{rel}: optimizer state does not match the model's parameters")
        remap: dict[int, int] = {}
        for g, group in enumerate(groups):
            hyper = {k: v for k, v in group.items() if k != "params"}
            if hyper not in src.groups:
                src.groups.append(hyper)
            remap[g] = src.groups.index(hyper)
        for pid, (name, g, _i) in ids.items():
            entry = state.get(pid) or {}
            extra = set(entry) - {"step", *_STATE_KEYS}
            if extra:
                raise UsageError(
                    f"{rel}: optimizer state {sorted(extra)} is not Adam's; resharding it is not supported yet"
                )
            for member_name in experts_of.get(name, [name]):  # a GroupedMLP weight's state: its experts'
                src.group_of[member_name] = remap[g]
                if "step" in entry:
                    src.step_of[member_name] = (rel, entry["step"])
        src.fp32_masters |= "fp32_from_fp16_params" in member
        if not src.optimizer_extra[0]:
            kept = {k: v for k, v in member.items() if k not in ("optimizer", "fp32_from_fp16_params")}
            src.optimizer_extra = (rel, kept)


_SEQUENTIAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(?P<j>\d+)\.linear_fc(?P<fc>[12])\.(?P<what>\w+)$")


def _canonical(names: list[str]) -> list[str]:
    """Model entries in the order of the whole model, whatever the source's pipeline split and
    however many EP ranks' files they were gathered from: the entries before the layers
    (embedding), the layers by global number, then the rest (final norm, MTP layers, output layer,
    megatron-core's order of the modules whatever stages they were read from). In a layer
    the entries keep their order, but its routed experts form one block where the first of them
    stands: SequentialMLP's expert by expert (``local_experts.<j>.*``), grouped GEMM's weight by
    weight (``linear_fc1.weight<j>`` for every j, then ``linear_fc2``), as megatron-core registers
    them; what follows the block (shared experts) stays after it. Stages and chunks take their
    entries in this order."""
    seen = list(dict.fromkeys(names))  # each entry once (tied or shared entries)
    first_layer = next((i for i, n in enumerate(seen) if _layer_of(n) is not None), len(seen))
    pattern_at: dict[str, int] = {}  # an expert entry with its number starred -> where it first stands
    block_at: dict[str, int] = {}  # the module of a block of experts -> where its first expert entry stands
    for pos, name in enumerate(seen):
        if (slot := expert_slot(name)) is not None:
            pattern_at.setdefault(slot[0], pos)
            block_at.setdefault(experts_owner(name) or name, pos)

    def key(item: tuple[int, str]) -> tuple[int, ...]:
        pos, name = item
        layer, slot = _layer_of(name), expert_slot(name)
        # after the layers, by name: the final norm, the MTP block, the output layer (a stage read
        # earlier may hold a later module: the MTP layers in a stage before any decoder layer's, or
        # before the last one's); the rest by where it was first seen
        top = name.split(".", 1)[0]
        if layer is not None:
            group: tuple[int, int] = (1, layer)
        elif top in ("mtp", "output_layer") or name.startswith(("decoder.final_layernorm", "final_layernorm")):
            group = (2, {"mtp": 1, "output_layer": 2}.get(top, 0))
        else:
            group = (0, 0) if pos < first_layer or top == "embedding" else (2, 0)
        if slot is None:
            return (*group, pos, 0, 0)
        pattern, j, grouped = slot  # (a decoder layer's experts, or a multi-token prediction layer's)
        inner = (pattern_at[pattern], j) if grouped else (j, pattern_at[pattern])
        return (*group, block_at[experts_owner(name) or name], *inner)

    return [n for _, n in sorted(enumerate(seen), key=key)]


_CHILD_ORDER = {
    # GPTModel
    "embedding": 0,
    "rotary_pos_emb": 1,
    "decoder": 2,
    "mtp": 3,
    "output_layer": 4,
    # LanguageModelEmbedding
    "word_embeddings": 0,
    "position_embeddings": 1,
    "tokentype_embeddings": 2,
    # TransformerBlock, MultiTokenPredictionBlock; MultiTokenPredictionLayer (between them)
    "layers": 0,
    "enorm": 1,
    "hnorm": 2,
    "eh_proj": 3,
    "transformer_layer": 4,
    "final_layernorm": 5,
    # TransformerLayer
    "input_layernorm": 0,
    "self_attention": 1,
    "pre_cross_attn_layernorm": 2,
    "cross_attention": 3,
    "pre_mlp_layernorm": 4,
    "mlp": 5,
    # SelfAttention (Attention builds core_attention and linear_proj before linear_qkv)
    "core_attention": 0,
    "linear_proj": 1,
    "linear_qkv": 2,
    "q_layernorm": 3,
    "k_layernorm": 4,
    # MLP, MoELayer, SequentialMLP
    "linear_fc1": 0,
    "linear_fc2": 1,
    "router": 0,
    "experts": 1,
    "shared_experts": 2,
    "local_experts": 0,
}
"""megatron-core 0.16's GPT modules: the order in which each registers its submodules"""
_LEAF_ORDER = {
    "layer_norm_weight": 0,
    "layer_norm_bias": 1,
    "weight": 2,
    "bias": 3,
    "gate_weight": 4,
    "expert_bias": 10,
    "global_tokens_per_expert": 11,
    "_extra_state": 20,
}
"""a module's own entries: its parameters in registration order, then its persistent buffers, then
``_extra_state`` (``torch.nn.Module.state_dict`` saves them so, before its submodules')"""


def module_order(names: list[str]) -> list[str]:
    """Model entries (global layer and expert numbers) in the order megatron-core's GPT model
    registers them: the order of its ``state_dict`` and of ``parameters()``, by which Megatron's
    optimizers number their parameters and lay out their grad buffers. For a source that does not
    keep that order (``torch_dist``, whose ``.metadata`` lists keys in the order ranks saved them).
    A module or entry this table does not know is refused: guessing would give the optimizer state
    of one parameter to another of the same shape."""

    def key(name: str) -> tuple[tuple[int, int], ...]:
        parts = name.split(".")
        out = []
        for i, part in enumerate(parts):
            leaf = i == len(parts) - 1
            rank = int(part) if part.isdigit() and not leaf else (_LEAF_ORDER if leaf else _CHILD_ORDER).get(part)
            if rank is None:
                raise UsageError(
                    f"{name}: ckpttool does not know where megatron-core's GPT model registers "
                    f"{'entry' if leaf else 'module'} {part!r}, and a torch_dist checkpoint does not record the "
                    "module order a legacy checkpoint's optimizer state follows",
                    hint="'ckpttool convert --to megatron-dist' or '--to dcp' keeps it in a layout that needs no order",
                )
            out.append((0, rank) if leaf else (1, rank))
        return tuple(out)

    return sorted(dict.fromkeys(names), key=key)


def _num_layers(args: Any) -> int:
    return int(getattr(args, "num_layers", 0) or 0)


def _source_vpp(args: Any) -> int:
    return int(getattr(args, "virtual_pipeline_model_parallel_size", None) or 1)


def _target_layout(args: Any, target: MegatronTarget) -> str | None:
    """The output's pipeline layout string, if it has one."""
    if target.layout is None:
        source = getattr(args, "pipeline_model_parallel_layout", None)
        return source if isinstance(source, str) and source else None
    return target.layout or None


def _target_vpp(args: Any, target: MegatronTarget) -> int:
    layout = _target_layout(args, target)
    if layout is not None:  # the layout's stages over the pipeline ranks
        return max(1, len(layout_stages(layout)) // max(target.pp, 1))
    return target.vpp or _source_vpp(args)


def _target_split(args: Any, target: MegatronTarget) -> tuple[int | None, int | None]:
    """The first and last stages' layer counts of the output (None: as the middle ones)."""
    if _target_layout(args, target) is not None:
        return (None, None)
    return stage_split(args) if target.uneven is None else target.uneven


def _target_ep(src: _Source, target: MegatronTarget) -> int:
    return target.ep or src.ep


def _target_etp(src: _Source, target: MegatronTarget) -> int:
    """The output's expert TP: as asked, else the source's when it split its experts its own way,
    else TP (Megatron's default). A model without routed experts has none to split: an ETP asked
    of it (1, which it is let give) is TP's, as Megatron's default."""
    if not src.experts:
        return src.etp or target.tp
    return target.etp or src.etp or target.tp


def target_chunks(args: Any, target: MegatronTarget) -> list[list[tuple[int, int]]]:
    """For each target pipeline stage, (first layer, layers) of each of its model chunks (one
    without virtual stages); ValueError (the reason) when the layers cannot be split so."""
    return placement(
        args,
        pp=target.pp,
        vpp=_target_vpp(args, target),
        split=_target_split(args, target),
        layout=_target_layout(args, target),
    )


def validate(
    manifest: Manifest, src: _Source, target: MegatronTarget, rules: dict[str, Any], rank_files: bool = True
) -> list[str]:
    """Reasons the target layout cannot hold this model (empty: it can); ``rank_files``: the output is
    legacy (a file per stage), not torch_dist."""
    args = src.objs[(0, 0, 0)].get("args")
    problems = []
    tp, pp, ep = target.tp, target.pp, _target_ep(src, target)
    if tp < 1 or pp < 1 or ep < 1:
        return ["TP, PP and EP must be at least 1"]
    etp = _target_etp(src, target)
    # (ETP=1 and EP=1 are the sizes a model without routed experts has: a script that gives the same
    # sizes for every model is not refused for them)
    if target.etp is not None and (target.etp < 1 or (not src.experts and target.etp > 1)):
        problems.append(
            f"ETP={target.etp}: " + ("must be at least 1" if src.experts else "the model has no routed experts")
        )
    if ep > 1 and not src.experts:
        problems.append(f"EP={ep}: the model has no routed experts (args.num_experts is not set)")
    elif src.experts % ep:
        problems.append(f"EP={ep} does not divide the {src.experts} experts")
    if _num_layers(args):
        try:
            target_chunks(args, target)
        except ValueError as exc:
            problems.append(str(exc))
    heads = getattr(args, "num_attention_heads", None)
    groups = getattr(args, "num_query_groups", None) if getattr(args, "group_query_attention", False) else heads
    if isinstance(heads, int) and heads % tp:
        problems.append(f"TP={tp} does not divide the {heads} attention heads")
    if isinstance(groups, int) and groups % tp:
        problems.append(f"TP={tp} does not divide the {groups} query groups")
    ffn = getattr(args, "ffn_hidden_size", None)
    if isinstance(ffn, int) and ffn % tp:
        problems.append(f"TP={tp} does not divide ffn_hidden_size={ffn}")
    problems += _mtp_problems(manifest, src, target, rank_files)
    gated = _gated(args)
    uneven, unknown, beyond = [], [], []
    problems += _pattern_problems(manifest, rules, gated)
    for item in manifest.items.values():
        if not item.is_tensor or item.kind not in ("param", "optim", "master") or item.shape is None:
            continue
        rule, dim = _rule(item, gated, rules)
        if rule == "replicated" and (tp > 1 or src.tp > 1) and item.kind == "param" and not _known(item.name, rules):
            unknown.append(item.name)
        if rule == "replicated" or dim is None or _is_vocab(item.name):
            continue
        if dim >= len(item.shape):  # (only a --split-rule can ask for that)
            beyond.append(f"{item.name} ({len(item.shape)}-D, dim {dim})")
            continue
        size = item.shape[dim] // (2 if rule == "gated" else 1)
        ways = etp if is_expert(_base_param(item)) else tp
        if size % ways:
            uneven.append(f"{item.name} (dim {dim} of size {size}, split {ways} ways)")
    if beyond:
        problems.append(_beyond_problem(beyond))
    if unknown:
        problems.append(
            f"no tensor-parallel split rule for {len(unknown)} parameters: {', '.join(unknown[:5])}"
            + (" …" if len(unknown) > 5 else "")
            + "; give one with --split-rule 'REGEX=DIM' (or REGEX=none if replicated)"
        )
    if uneven and not problems:
        problems.append(
            f"{len(uneven)} tensors cannot be split evenly: {', '.join(uneven[:3])}" + (" …" if len(uneven) > 3 else "")
        )
    return problems


TWO_EMBEDDINGS_HINT = (
    "the run trained two word embeddings ('ckpttool verify --deep' shows how its copies differ); ckpttool does not "
    "choose between them"
)
"""what to do about a source whose MTP stage trained its own copy of the embeddings (none but that)"""


def _validate_hint(problems: list[str], dist_helps: bool, layout_help: str | None = None) -> str:
    """What to do about :func:`validate`'s ``problems``; ``dist_helps``: a torch_dist output would
    avoid the MTP stage's copy of position embeddings (a legacy output from a source that is not a
    legacy save at PP > 1); ``layout_help``: how a pipeline layout for this model and target is
    written (:func:`_layout_help`), given where a layout is the target's."""
    if all("the model has no routed experts" in p for p in problems):
        return "the model has no routed experts: leave out --ep and --etp, or give them as 1"
    if layout_help is not None and (layout := [p for p in problems if p.startswith(_LAYOUT_PROBLEMS)]):
        rest = [p for p in problems if p not in layout]
        return layout_help + (f"; {_validate_hint(rest, dist_helps)}" if rest else "")
    if any(
        "the source's pipeline layout puts the MTP layers" in p or "the source's MTP stage trained" in p
        for p in problems
    ):
        return TWO_EMBEDDINGS_HINT
    mtp = [p for p in problems if "MTP" in p or "multi-token" in p]
    if mtp and len(mtp) == len(problems):
        tips = []
        if any("first pipeline rank" in p for p in mtp):
            tips.append("give the MTP layers a stage of their own on another pipeline rank (--pipeline-layout)")
        staged = any("at PP > 1" in p for p in mtp)  # the MTP stage's copy of position embeddings
        if staged and not dist_helps:
            tips.append("from a legacy save at PP > 1 these are not supported yet, whatever the output")
        elif staged or any("the target pipeline layout puts" in p for p in mtp):
            tips.append("'--to megatron-dist' writes torch_dist, which keeps one copy of the embeddings at any layout")
        return "; ".join(tips)
    if all(p.startswith(("--split-rule", "no tensor-parallel split rule")) for p in problems):
        return "'ckpttool ls' lists the parameters; a --split-rule gives one that ckpttool has no rule for"
    return "choose sizes that divide the model's heads, query groups, hidden sizes and layers" + (
        " (--pp-first-layers / --pp-last-layers give the end stages other layer counts; --pipeline-layout places "
        "each layer, the embedding, the MTP layers and the loss on a stage itself)"
        if any("layers" in p for p in problems)
        else ""
    )


def _inherited_vpp(args: Any, target: MegatronTarget, problems: list[str]) -> str:
    """Where stages do not split into model chunks the user never asked for: the source's (its
    virtual stages, or those of its pipeline layout), and how to ask for one chunk a stage."""
    if target.vpp is not None or not any("model chunks" in p for p in problems):
        return ""
    try:
        vpp = _target_vpp(args, target)
    except ValueError:  # (a layout that does not parse: its own problem says so)
        return ""
    if vpp < 2 or not any(f"split into VPP={vpp} model chunks" in p for p in problems):
        return ""
    return f"; VPP={vpp} is the source's, kept as no --vpp was given: --vpp 1 gives each stage one model chunk"


_LAYOUT_PROBLEMS = ("the layout", "the pipeline layout places", "VPP=")
"""how the reasons a pipeline layout does not fit begin (:func:`layout_chunks`, :func:`_mtp_problems`)"""


def _layout_help(args: Any, manifest: Manifest, target: MegatronTarget) -> str | None:
    """How a pipeline layout for this model at ``target``'s PP is written, with an example that
    fits (None where the output has no layout)."""
    layout = _target_layout(args, target)
    if layout is None:
        return None
    layers, mtp = _num_layers(args), _mtp_layers(manifest)
    try:  # (as many virtual stages as the layout gives, where PP > 1 lets it have any)
        vpp = max(1, len(layout_stages(layout)) // target.pp) if target.pp > 1 else 1
    except ValueError:
        vpp = 1
    stages = target.pp * vpp
    given = "--pipeline-layout" if target.layout else "a pipeline layout (the source's args give one)"
    return (
        f"{given} lists the stages, '|' between them, PP x VPP in all (PP={target.pp}: {target.pp} or a multiple): "
        f"E (the embedding) first, each of the model's {plural(layers, 'transformer layer')} as t, "
        + (f"its {plural(mtp, 'MTP layer')} as m in one stage that is a rank's last chunk, " if mtp else "")
        + f"L (the loss) last; for example --pipeline-layout '{example_layout(layers, stages, mtp)}'"
    )


def _mtp_layers(manifest: Manifest) -> int:
    """The model's multi-token prediction layers (``mtp.layers.<k>.*``, megatron-core's
    MultiTokenPredictionBlock)."""
    return len({n.split(".", 3)[2] for n in manifest.items if n.startswith("mtp.layers.")})


def _mtp_problems(manifest: Manifest, src: _Source, target: MegatronTarget, rank_files: bool) -> list[str]:
    """Why the target layout cannot hold this model's multi-token prediction layers (empty: it can,
    or there are none). megatron-core builds them in one model chunk (:func:`mtp_chunk`: the last
    stage's last, or the stage a pipeline layout gives them, ``m``), which then also keeps a copy of
    the word embeddings (its own parameter, synced with the first stage's through the embedding
    group). Where megatron-core trains that copy apart (:func:`mtp_copy_apart`: a later chunk of
    the first rank, or ``--decoupled-lr``), ckpttool neither reads it as the embeddings nor writes it.
    torch_dist keeps the embeddings once (the copies are replicas it does not save): only legacy files
    (``rank_files``, or a legacy source) have stage copies to refuse."""
    args = src.objs[(0, 0, 0)].get("args")
    problems = []
    layout = _target_layout(args, target)
    mtp = _mtp_layers(manifest)
    if layout is not None:
        try:
            stages = layout_stages(layout)
        except ValueError:
            stages = []  # (target_chunks names what is wrong with it)
        placed = "".join(stages).count("m")
        if stages and placed != mtp:
            problems.append(f"the pipeline layout places {placed} MTP layers (m), the model has {mtp}")
    if not mtp:
        return problems
    source_layout, source_vpp = args_pipeline(args)
    legacy_in = manifest.format == "megatron"
    decoupled = getattr(args, "decoupled_lr", None) is not None
    aparts: dict[str, str | None] = {}
    for which, given, pp, vpp, staged in (  # (a legacy source, or a legacy output: torch_dist keeps no stage copies)
        ("source", source_layout, src.pp, source_vpp, legacy_in),
        ("target", layout, target.pp, _target_vpp(args, target), rank_files),
    ):
        try:
            aparts[which] = mtp_copy_apart(given, pp, vpp, decoupled) if staged else None
        except ValueError:
            aparts[which] = None  # (target_chunks names what is wrong with the layout)
    first = [w for w, apart in aparts.items() if apart == "first rank"]
    if first:  # (said once where both layouts do it: a convert keeps the source's)
        said = {"source": "the source's pipeline layout puts", "target": "the target pipeline layout puts"}
        both = "the source and target pipeline layouts put"
        problems.append(
            f"{said[first[0]] if len(first) == 1 else both} the MTP layers on the first pipeline rank, where "
            "megatron-core never syncs their copy of the word embeddings (pretrain_gpt.py's embedding group is that "
            "rank alone): the copy starts from zeros and trains apart; not supported"
        )
    if aparts["source"] == "decoupled":
        problems.append(
            "the source's MTP stage trained its own copy of the word embeddings (with --decoupled-lr at PP > 1 "
            "megatron-core gives that copy the default LR: it marks only the first stage's embedding as one)"
        )
    elif aparts["target"] == "decoupled":  # (the source's note says it already where both do)
        problems.append(
            "multi-token prediction layers with --decoupled-lr at PP > 1: megatron-core would give the MTP "
            "stage's copy of the word embeddings the default LR (it marks only the first stage's embedding as "
            "one), and a run resumed from these files would train two embeddings; not supported"
        )
    # the MTP stage's copy of position embeddings would live in legacy files of a stage (torch_dist keeps
    # the model's embeddings once)
    stage_files = (target.pp > 1 and rank_files) or (src.pp > 1 and legacy_in)
    if stage_files and "embedding.position_embeddings.weight" in manifest.items:
        problems.append(
            "multi-token prediction layers with learned position embeddings at PP > 1: Megatron-LM core_v0.16.1 "
            "refuses the pair (validate_args: MTP takes rope or no position embeddings), so where the MTP stage "
            "keeps its copy of them is not known"
        )
    return problems


_REPLICATED = (
    "layernorm.weight",
    "layernorm.bias",
    "layer_norm_weight",
    "layer_norm_bias",
    "norm.weight",
    "norm.bias",
    "linear_proj.bias",
    "linear_fc2.bias",
    "dense.bias",
    "dense_4h_to_h.bias",
    "router.weight",
    "router.expert_bias",
    "position_embeddings.weight",
)


def _beyond_problem(beyond: list[str]) -> str:
    """The problem of ``--split-rule`` dims past their tensors' last (``beyond``: each tensor, said)."""
    more = " …" if len(beyond) > 3 else ""
    return (
        f"--split-rule splits {len(beyond)} tensors along a dimension they do not have: {', '.join(beyond[:3])}"
        f"{more}; dimensions count from 0"
    )


def _pattern_problems(manifest: Manifest, rules: Mapping[str, int | None], gated: bool) -> list[str]:
    """What is wrong with ``--split-rule`` patterns ``rules``: one that matches no parameter, or
    parameters whose split megatron-core fixes (the patterns are only for those it leaves open)."""
    problems = []
    for pattern, dim in rules.items():
        fixed = sorted(
            n
            for n, i in manifest.items.items()
            if i.kind == "param"
            and i.is_tensor
            and re.search(pattern, n)
            and (_known(n, {}) or split_rule(n, gated=gated)[0] != "replicated")
        )
        if not any(i.kind == "param" and i.is_tensor and re.search(pattern, n) for n, i in manifest.items.items()):
            problems.append(
                f"--split-rule '{pattern}={'none' if dim is None else dim}' matches no parameter: check the "
                "pattern against the parameter names 'ckpttool ls' prints"
            )
        elif fixed:
            rule, d = split_rule(fixed[0], gated=gated)
            problems.append(
                f"--split-rule '{pattern}={'none' if dim is None else dim}' matches {len(fixed)} parameters whose "
                f"tensor-parallel split megatron-core fixes, such as {fixed[0]} ({rule}"
                + (f", dim {d}" if d is not None else "")
                + "); --split-rule is for parameters ckpttool has no rule for: narrow the pattern"
            )
    # (the first rule a name matches is the one taken: two that disagree leave which was meant to chance)
    for n, i in manifest.items.items():
        if i.kind == "param" and i.is_tensor:
            matched = [(p, d) for p, d in rules.items() if re.search(p, n)]
            if len({d for _, d in matched}) > 1:
                named = [f"'{p}={'none' if d is None else d}'" for p, d in matched]
                problems.append(
                    f"--split-rule {' and '.join(named)} both match {n} and disagree on its split: make the "
                    "patterns exclusive"
                )
                break
    return problems


def check_split_rules(manifest: Manifest, rules: Mapping[str, int | None]) -> None:
    """For an output in a format other than Megatron's, from a legacy source read with ``--split-rule``
    patterns ``rules``: refuse (before anything is written) patterns :func:`validate` would refuse
    for a Megatron output, a dimension a tensor lacks, and parameters no rule places
    (:func:`unsplit_parameters`), whose full tensors would be rank 0's part alone. Rules for a
    source of another format are refused: those record how their tensors were split."""
    if manifest.format != "megatron":
        if rules:
            raise UsageError(
                f"--split-rule applies to Megatron checkpoints (how a legacy source's tensor-parallel parts join, how "
                f"a Megatron output is cut); this {manifest.format} checkpoint records its own splits",
                hint="drop --split-rule, or write a Megatron output (--to megatron|megatron-dist)",
            )
        return
    gated = _gated(manifest.extras.get("args"))
    problems = _pattern_problems(manifest, rules, gated)
    beyond = [
        f"{n} ({len(i.shape)}-D, dim {found[0]})"
        for n, i in manifest.items.items()
        if i.kind == "param"
        and i.is_tensor
        and i.shape is not None
        and (found := matched_dim(n, rules)) is not None
        and found[0] is not None
        and found[0] >= len(i.shape)
    ]
    if beyond:
        problems.append(_beyond_problem(beyond))
    elif unknown := unsplit_parameters(manifest):
        problems.append(
            f"no tensor-parallel split rule for {len(unknown)} parameters of this TP={manifest.layout.tp} checkpoint: "
            + ", ".join(unknown[:5])
            + (" …" if len(unknown) > 5 else "")
            + " (each TP rank holds its own, which would be read as copies and rank 0's kept alone)"
        )
    if problems:
        raise UsageError(
            "; ".join(problems) + "; nothing was written",
            hint="give a rule with --split-rule 'REGEX=DIM' (or REGEX=none if replicated); 'ckpttool ls' lists "
            "the parameters",
        )


def unsplit_parameters(manifest: Manifest) -> list[str]:
    """The parameters of a legacy source at TP > 1 that no rule places: megatron-core's rules do
    not split them, they are not among those it keeps whole on every rank, and neither a
    ``--split-rule`` nor the checkpoint (:data:`SPLIT_RULES`) says how. They are read as copies of
    one tensor, where each rank's may be a part of it: an output of any format but Megatron's own
    would keep rank 0's part alone."""
    if manifest.format != "megatron" or (manifest.layout.tp or 1) < 2:
        return []
    gated = _gated(manifest.extras.get("args"))
    given = manifest.extras.get("split_rules") or {}
    return sorted(
        n
        for n, i in manifest.items.items()
        if i.kind == "param"
        and i.is_tensor
        and n not in given
        and not _known(n, {})
        and split_rule(n, gated=gated)[0] == "replicated"
    )


def _known(name: str, rules: dict[str, Any]) -> bool:
    """Whether ``name`` is a parameter Megatron keeps whole on every TP rank (or the user said how)."""
    return name.endswith(_REPLICATED) or any(re.search(r, name) for r in rules)


def _gated(args: Any) -> bool:
    return bool(getattr(args, "swiglu", False) or getattr(args, "gated_linear_unit", False))


def _base_param(item: Item) -> str:
    if item.kind in ("optim", "master"):
        return item.name.rsplit(".", 1)[0]
    return item.name


def _rule(item: Item, gated: bool, rules: dict[str, Any]) -> tuple[str, int | None]:
    name = _base_param(item)
    found = matched_dim(name, rules)
    return rule_of_dim(found[0]) if found is not None else split_rule(name, gated=gated)


def _is_vocab(name: str) -> bool:
    return name.startswith(("embedding.word_embeddings.weight", "output_layer.weight"))


def _local(item: Item, t: int, tp: int, gated: bool, rules: dict[str, Any], rows: int | None) -> list[Box]:
    """The regions of the global tensor rank ``t`` of ``tp`` holds, stacked along their split dim
    (``rows``: the vocabulary re-padded to that many rows)."""
    assert item.shape is not None
    shape = item.shape if rows is None else (rows, *item.shape[1:])
    rule, dim = _rule(item, gated, rules)
    return tp_regions(shape, rule, dim, t, tp)


_BUFFERS = frozenset({"expert_bias"})
"""The persistent buffers of megatron-core's modules (in a model chunk's state dict, never optimized):
the MoE router's ``expert_bias`` (``--moe-router-enable-expert-bias``)"""


class _Fill:
    """Produces one output tensor from the source's pieces (``OutTensor.fill``)."""

    def __init__(self, reader: PieceReader | None, item: Item, boxes: list[Box]) -> None:
        self.reader, self.item, self.boxes = reader, item, boxes

    def __call__(self, buf: np.ndarray) -> None:
        item, reader = self.item, self.reader
        assert item.shape is not None and item.dtype is not None
        assert reader is not None, "a tensor planned without a reader is never written"
        values = buf.view(carrier(item.dtype))
        pos = 0
        for box in self.boxes:
            n = box.volume
            out = values[pos : pos + n].reshape(box.sizes)
            pos += n
            have = item.shape[0] if item.shape else 0
            if box.ndim and box.offsets[0] + box.sizes[0] > have:  # re-padded vocabulary rows
                out[...] = 0
                keep = max(0, have - box.offsets[0])
                if keep:
                    assemble(reader, item, out=out[:keep], box=Box(box.offsets, (keep, *box.sizes[1:])))
                continue
            assemble(reader, item, out=out, box=box)


class _GroupedFill:
    """Produces a GroupedMLP weight (or its state) of one rank file: block ``j`` of its memory is
    the transpose of its ``j``-th expert's part, one expert read at a time."""

    def __init__(self, reader: PieceReader | None, parts: list[tuple[Item, list[Box]]], dtype: str) -> None:
        self.reader, self.parts, self.dtype = reader, parts, dtype

    def __call__(self, buf: np.ndarray) -> None:
        kind = carrier(self.dtype)
        rows, cols = _stacked(self.parts[0][1])
        blocks = buf.view(kind).reshape(len(self.parts), cols, rows)
        one = np.empty(rows * cols * np.dtype(kind).itemsize, np.uint8)
        for j, (item, boxes) in enumerate(self.parts):
            _Fill(self.reader, item, boxes)(one)
            blocks[j] = one.view(kind).reshape(rows, cols).T


def _stacked(boxes: list[Box]) -> tuple[int, ...]:
    if len(boxes) == 1:
        return boxes[0].sizes
    return (sum(b.sizes[0] for b in boxes), *boxes[0].sizes[1:])


def padded_vocab(vocab: int, divisor: int, tp: int) -> int:
    """The rows Megatron pads a vocabulary of ``vocab`` to at ``tp``: a multiple of
    ``make_vocab_size_divisible_by`` x TP."""
    return -(-vocab // (divisor * tp)) * divisor * tp


_FIRST_DIVISOR = "ckpttool_make_vocab_size_divisible_by"
"""``args``' record of the run's own ``make_vocab_size_divisible_by`` when a reshard to a TP it does not
give the padded rows at changed it (Megatron reads no such argument), so that a reshard back to a TP
where it does gives the run's ``args`` back"""


class LegacyWriter:
    """Plans and writes the rank files of one target layout."""

    distopt: bool
    """write ``distrib_optim.pt`` files (the distributed optimizer's layout)"""

    rank_files = True
    """one file per (TP, PP, EP) rank, saved by the rank that holds it (legacy); False: any
    rank's file may hold any piece (torch_dist)"""

    def __init__(
        self, root: Path, manifest: Manifest, target: MegatronTarget, rules: dict[str, Any] | None = None
    ) -> None:
        self.root, self.manifest, self.target = root, manifest, target
        self.scratch = _ptwrite.Scratch()  # one tensor buffer for every file this writer writes
        self.rules = rules or {}
        self._records: dict[str, Any] = {}  # torch_dist records read for planning (:meth:`_record_value`)
        self.src = self._source(root, manifest)
        self.args = self.src.objs[(0, 0, 0)].get("args")
        self.grouped = self.rank_files and (self.src.grouped_mlp or bool(getattr(self.args, "moe_grouped_gemm", False)))
        """legacy output of grouped-GEMM experts: each rank's in GroupedMLP's ``weight1``/``weight2``"""
        self._composed: dict[str, tuple[int, list[Item]]] = {}
        """a GroupedMLP weight (or its state) of the output -> (fc, its experts' items, by global number)"""
        te_grouped = getattr(self.args, "transformer_impl", "local") != "local" and not getattr(
            self.args, "moe_use_legacy_grouped_gemm", False
        )  # TransformerEngine's spec builds TEGroupedMLP unless told to keep the legacy GroupedMLP
        if self.grouped and te_grouped:
            raise UsageError(
                "this model's experts run as TransformerEngine's grouped GEMM (TEGroupedMLP keeps each rank's "
                "experts in linear_fc1.weight<j> with TE's _extra_state); writing them in a legacy checkpoint is "
                "not supported yet",
                hint="'--to megatron-dist' writes torch_dist, whose expert layout megatron-core loads into "
                "SequentialMLP, GroupedMLP and TEGroupedMLP alike",
            )
        self.gated = _gated(self.args)
        self.ep = _target_ep(self.src, target)
        """expert-parallel ranks of the output"""
        self.local_experts = self.src.experts // self.ep if self.src.experts and self.ep else 0
        """routed experts in each EP rank's files"""
        self.etp = _target_etp(self.src, target)
        """expert tensor-parallel ranks of the output"""
        problems = validate(manifest, self.src, target, self.rules, self.rank_files)
        staged_source = manifest.format == "megatron" and self.src.pp > 1  # (its MTP stage's copies)
        if problems:
            raise UsageError(
                f"cannot reshard to TP={target.tp} PP={target.pp}"
                + (f" EP={self.ep}" if self.ep > 1 or self.src.ep > 1 else "")
                + ": "
                + "; ".join(problems),
                hint=_validate_hint(
                    problems, self.rank_files and not staged_source, _layout_help(self.args, manifest, target)
                )
                + _inherited_vpp(self.args, target, problems),
            )
        self.vpp = _target_vpp(self.args, target)
        """model chunks (virtual pipeline stages) per pipeline rank in the output"""
        self._layer_places: dict[int, tuple[int, int]] | None = None
        self._placement: dict[tuple[int, int], list[str]] | None = None
        self.chunks = target_chunks(self.args, target) if _num_layers(self.args) else [[(0, 0)] * self.vpp] * target.pp
        """(first layer, layers) of each model chunk of each target pipeline stage"""
        self.split = _target_split(self.args, target)
        """the first and last stages' layer counts written to ``args`` (None: as the middle ones)"""
        self.iteration = self.src.objs[(0, 0, 0)].get("iteration")
        release = manifest.extras.get("iteration_dir") == "release"  # (Megatron loads one as a fresh start)
        self.iter_dir = f"iter_{self.iteration:07d}" if isinstance(self.iteration, int) and not release else "release"
        """the iteration directory written: the source's ``release`` stays one, whatever iteration it records"""
        self.rows = self._vocab_rows()
        self.tied = not bool(getattr(self.args, "untie_embeddings_and_output_weights", False))
        self.mtp = _mtp_layers(manifest) > 0
        """multi-token prediction layers, with a copy of the word embeddings in their model chunk"""
        self.mtp_at = mtp_chunk(_target_layout(self.args, target), target.pp, self.vpp)
        """the (pipeline stage, model chunk) building the MTP layers: the last, or the layout's ``m`` stage"""
        self.unused_out = self.tied and target.pp > 1 and self.mtp and self.mtp_at == (target.pp - 1, self.vpp - 1)
        """the last stage's output_layer.weight is a parameter megatron-core allocates but never uses (tied,
        the MTP layers in the last chunk: :func:`~ckpttool.formats.megatron.unused_output_layer`)"""
        self.copy_out = self.tied and target.pp > 1 and not self.unused_out
        """the last stage's output_layer.weight is its copy of the word embeddings, written from them"""
        emb = manifest.items.get("embedding.word_embeddings.weight")
        self.padded = self.rows or (emb.shape[0] if emb is not None and emb.shape else None)
        """rows of the embedding (the padded vocabulary) in the output"""
        if self.padded is not None and self.padded % target.tp:
            raise UsageError(
                f"cannot reshard to TP={target.tp}: the embedding's {self.padded} rows (padded vocabulary) cannot "
                f"be split {target.tp} ways",
                hint="pass --vocab-padding megatron to re-pad the vocabulary for the new TP",
            )
        self.divisor = self._vocab_divisor()
        """the ``make_vocab_size_divisible_by`` recorded in ``args`` when the source's would not
        give ``padded`` rows at the new TP (None: it does)"""
        missing = [n for n in self.src.model_order if n not in self.manifest.items and n not in self.src.objects]
        if missing:
            raise CorruptFileError(f"model entries missing from the manifest: {', '.join(missing[:4])}")
        want = target.distributed_optimizer
        self.distopt = self.src.distopt if want is None else bool(want)
        self._xranks: dict[tuple[int, int, int], Saver] | None = None
        """under expert tensor parallelism, the rank that saves each output rank file, by its (TP,
        PP, EP) rank; None: the experts split as the other layers"""
        self._savers: dict[tuple[int, int, int], Saver] | None = None
        """the same at any layout, for ``args.rank`` (made on first use: :meth:`_saving_rank`)"""
        if self.src.etp or self.etp != target.tp:
            self._expert_layout()
        if self.src.memberless and not self.distopt and self.src.groups:  # (none: no optimizer saved)
            self._infer_membership()
        if self.distopt and not self.src.distopt:
            self._check_distopt_groups()
        if self.distopt and self.rank_files:
            self._check_frozen()
        if self.grouped:
            self._group_experts()
        self._group_kinds = self._memberless_kinds() if self.src.memberless else expert_kinds(self.src.group_of)
        """the kinds of parameter (routed expert or not) each source param group holds"""

    def _group_experts(self) -> None:
        """Write the routed experts as megatron-core's legacy GroupedMLP keeps them (the model was
        trained with ``--moe-grouped-gemm``): in each layer, ``mlp.experts.weight1`` and ``weight2``
        stand where the experts' block stood, each EP rank's file holding its experts' blocks
        (:class:`~ckpttool.formats.megatron.GroupedWeights`, the reader's inverse); the optimizer
        state of a weight is its experts' state laid out the same way. GroupedMLP has no biases
        and saves no ``_extra_state`` for its experts."""
        items = dict(self.manifest.items)
        order: list[str] = []
        placed: set[str] = set()
        for name in self.src.model_order:
            m = _SEQUENTIAL_EXPERT.search(name)
            if m is None:
                order.append(name)
                continue
            if m["what"] == "bias":
                raise UsageError(
                    f"{name}: GroupedMLP (--moe-grouped-gemm) has no expert biases, and this model's experts have",
                    hint="'--to megatron-dist' writes the experts as megatron-core's sharded state dict names them",
                )
            if m["what"] != "weight":
                continue  # an expert's _extra_state: GroupedMLP saves none
            head, fc = name[: m.start("j") - len("local_experts.")], int(m["fc"])
            grouped = f"{head}weight{fc}"
            if grouped in placed:
                continue
            placed.add(grouped)
            order.append(grouped)
            found = [items.get(f"{head}local_experts.{j}.linear_fc{fc}.weight") for j in range(self.src.experts)]
            members = [x for x in found if x is not None and x.shape is not None and len(x.shape) == 2]
            if len(members) != self.src.experts:
                raise CorruptFileError(f"{grouped}: the source lacks some of its {self.src.experts} experts' fc{fc}")
            first = members[0]
            rows, cols = first.shape or (0, 0)
            shape = (cols, self.src.experts * rows) if fc == 1 else (self.src.experts * cols, rows)
            for suffix in ("", ".fp32", *(f".{k}" for k in _STATE_KEYS)):
                states = [st for x in members if (st := items.get(f"{x.name}{suffix}")) is not None]
                if len(states) == len(members):  # a state every expert has: composed as the weight
                    top = states[0]
                    items[grouped + suffix] = Item(name=grouped + suffix, kind=top.kind, dtype=top.dtype, shape=shape)
                    self._composed[grouped + suffix] = (fc, states)
            if first.name in self.src.group_of:
                self.src.group_of[grouped] = self.src.group_of[first.name]
            if first.name in self.src.step_of:
                self.src.step_of[grouped] = self.src.step_of[first.name]
        self.src.model_order = order
        self.manifest = copy.copy(self.manifest)
        self.manifest.items = items

    def _layout_savers(self) -> dict[tuple[int, int, int], Saver]:
        """Which global rank saves each output rank file (t, p, e), in megatron-core's rank layout
        (``tp-cp-ep-dp-pp``, or ``tp-cp-ep-pp-dp`` with ``--use-tp-pp-dp-mapping``) at the output's
        sizes (:func:`saving_ranks`; ValueError where they lay out no such world)."""
        cp = int(getattr(self.args, "context_parallel_size", 1) or 1)
        tp, pp = self.target.tp, self.target.pp
        return saving_ranks(
            tp=tp,
            etp=self.etp,
            ep=self.ep,
            pp=pp,
            cp=cp,
            world=tp * cp * pp * self._resume_dp(),
            tp_pp_dp=bool(getattr(self.args, "use_tp_pp_dp_mapping", False)),
        )

    def _saving_rank(self, t: int, p: int, e: int) -> int:
        """The global rank that saves rank file (t, p, e) of the output, as ``args.rank`` records it
        (verify checks it; context parallelism and the mapping included); ``t + TP·e + TP·DP·p``
        where the sizes lay out no world megatron-core would run."""
        if self._savers is None:
            try:
                self._savers = self._layout_savers()
            except ValueError:
                self._savers = {}
        saver = self._savers.get((t, p, e))
        tp = self.target.tp
        return saver.rank if saver is not None else t + tp * e + tp * self._resume_dp() * p

    def _expert_layout(self) -> None:
        """Which global rank saves each output rank file, and its experts' ETP rank
        (:func:`saving_ranks`), when the output's experts are split their own way."""
        if self.etp == self.target.tp or not self.rank_files:
            return
        try:
            self._xranks = self._savers = self._layout_savers()
        except ValueError as exc:
            # (the data-parallel size written for is chosen so that a stage holds whole expert
            # groups: _resume_dp; what is left is how the legacy files are named and who saves them)
            if self.etp > self.target.tp:
                hint = "choose --etp at most --tp: legacy rank files are named by TP rank, one per expert split"
            else:
                hint = "choose --etp and --ep with ETP x EP >= TP: the ranks saving legacy files hold every TP rank"
            hint += ", or write --to megatron-dist"
            raise UsageError(
                f"cannot reshard to TP={self.target.tp} PP={self.target.pp} EP={self.ep} with the experts split "
                f"{self.etp} way{'s' if self.etp != 1 else ''}: {exc}",
                hint=hint,
            ) from None

    def _experts_at(self, t: int, p: int, e: int) -> tuple[int, int]:
        """(rank, ranks) of the experts' tensor-parallel split in output rank file (t, p, e)."""
        if self._xranks is None:
            return t, self.target.tp
        return self._xranks[(t, p, e)].etp, self.etp

    @property
    def _chained(self) -> bool:
        """Whether the output's optimizer is megatron-core's chain of a dense and an expert optimizer
        (expert parallelism: the experts leave the dense optimizer and its grad buffers)."""
        return self.ep > 1 and bool(self.src.experts)

    @property
    def _members(self) -> tuple[bool | None, ...]:
        """The output optimizers, by the ``kind`` of :meth:`_target_groups`: the chain's dense and
        expert members, or one optimizer of every parameter."""
        return (False, True) if self._chained else (None,)

    def _infer_membership(self, why: str = "--no-distributed-optimizer") -> None:
        """``--no-distributed-optimizer`` from a distributed-optimizer checkpoint (or a legacy output
        from torch_dist): the param group of each parameter, and its step. Neither saves the groups'
        members; megatron-core forms them by its standard rule (:meth:`standard_membership`), which
        is applied here."""
        args = self.args
        if self.src.dist:  # torch_dist names no members in either optimizer's layout
            refuse = (
                f"--to megatron{' --no-distributed-optimizer' if self.src.distopt else ''} from this torch_dist "
                "checkpoint (its param groups do not name their parameters): "
            )
            hint = (
                "'--to megatron --distributed-optimizer' needs no membership; '--to megatron-dist' keeps it torch_dist"
            )
        else:
            refuse = f"{why} from this distributed-optimizer checkpoint (its state per parameter): "
            hint = "keep the distributed optimizer: '--to megatron' without --no-distributed-optimizer"
        self._check_standard_rule(refuse, hint)
        step = group_step(self.src.groups, refuse, hint)
        self.src.groups = [{k: v for k, v in h.items() if k != "step"} for h in self.src.groups]
        for name, g in self.standard_membership(self.src.groups, self.src.ep > 1, refuse, hint).items():
            self.src.group_of[name] = g
            self.src.step_of[name] = ("", _scalar(step))
        # megatron-core's Float16 optimizer (fp32 masters) for bf16 and fp16 models, torch's own otherwise
        self.src.fp32_masters = bool(getattr(args, "bf16", False) or getattr(args, "fp16", False))
        if not self.src.fp32_masters and self.src.optimizer_extra[1]:
            raise UsageError(refuse + fp32_scaler(self.src.optimizer_extra[1]), hint=hint)

    def standard_membership(
        self,
        groups: list[dict[str, Any]],
        expert_parallel: bool,
        refuse: str,
        hint: str,
    ) -> dict[str, int]:
        """The param group, among ``groups``, that megatron-core's standard rule (``_get_param_groups``,
        0.16) puts each parameter with optimizer state in: no weight decay (``wd_mult`` 0) for biases
        and 1-D parameters (with ``--apply-wd-to-qk-layernorm``, the q/k layernorms excepted), weight
        decay for the rest; with ``expert_parallel`` (EP > 1) the routed experts in groups of their
        own (``is_expert_parallel``: an expert optimizer's), at EP = 1 in the dense groups; with
        ``--decoupled-lr`` the embedding and the output layer in groups of that LR. Each parameter
        must land in exactly one group and every group must get one, or the checkpoint is refused
        (``refuse`` begins the message): a run with other overrides saved groups the rule cannot
        tell apart."""
        args = self.args
        self._check_standard_rule(refuse, hint)
        qk = bool(getattr(args, "apply_wd_to_qk_layernorm", False))
        decoupled_lr = getattr(args, "decoupled_lr", None)
        items = self.manifest.items
        out: dict[str, int] = {}
        for name, item in items.items():
            if item.kind != "param" or not item.is_tensor or f"{name}.exp_avg" not in items:
                continue
            skip_wd = len(item.shape or ()) == 1 or name.endswith(".bias")
            if qk and ("q_layernorm." in name or "k_layernorm." in name):
                skip_wd = False
            wd_mult = 0.0 if skip_wd else 1.0
            # under expert parallelism the routed experts' groups are the expert optimizer's
            # (``is_expert_parallel``: megatron-core's experts do not all-reduce there)
            expert = expert_parallel and is_expert(name)
            decoupled = decoupled_lr is not None and name in _EMBEDDING_OR_OUTPUT
            found = [
                g
                for g, h in enumerate(groups)
                if float(h.get("wd_mult", 1.0)) == wd_mult
                and bool(h.get("is_expert_parallel")) == expert
                and _decoupled_group(h, decoupled_lr) == decoupled
            ]
            if len(found) != 1:
                raise UsageError(
                    refuse
                    + f"{len(found)} of its {len(groups)} param groups have wd_mult {wd_mult}"
                    + (" and is_expert_parallel" if expert else "")
                    + (f" and the --decoupled-lr {decoupled_lr}" if decoupled else "")
                    + f", the group megatron-core's standard rule puts {name} in",
                    hint=hint,
                )
            out[name] = found[0]
        empty = [group_identity(h) for g, h in enumerate(groups) if g not in set(out.values())]
        if empty:
            raise UsageError(
                refuse + f"{len(empty)} of its param groups would hold no parameter under megatron-core's standard "
                f"rule (the run used other group overrides): {', '.join(empty)}",
                hint=hint,
            )
        return out

    def _check_standard_rule(self, refuse: str, hint: str) -> None:
        """Refuse a run :meth:`standard_membership`'s rule does not describe."""
        args = self.args
        if getattr(args, "embedding_init_method_std", None) is not None:
            # megatron-core 0.14-0.15 then also took weight decay off every "embedding" parameter
            raise UsageError(refuse + "it was trained with --embedding-init-method-std, not supported yet", hint=hint)
        if getattr(args, "optimizer", "adam") != "adam":
            raise UsageError(refuse + f"only Adam's state is supported, not {args.optimizer}'s", hint=hint)

    def _check_distopt_groups(self) -> None:
        """The distributed optimizer matches saved param groups to its own by Megatron's identifier
        keys; a source whose groups lack them cannot be loaded so."""
        if not self.src.groups:
            raise UsageError("--distributed-optimizer: the source has no optimizer state (it was saved without it)")
        check_group_keys(self.src.groups, "the source's param groups")
        if not self.src.step_of and not self.src.memberless:
            raise UsageError("--distributed-optimizer: the source's optimizer has no step (it never stepped)")

    def _check_frozen(self) -> None:
        """A parameter without optimizer state (frozen) is not in megatron-core's grad buffers, and
        ckpttool's reader of ``distrib_optim.pt`` replays buffers that hold every parameter: it would
        call the output damaged, so none is written."""
        frozen = [n for n, i in self.manifest.items.items() if i.kind == "param" and self._frozen(n)]
        if frozen and (self.distopt or self.vpp > 1):
            raise UsageError(
                f"{'--distributed-optimizer' if self.distopt else f'VPP={self.vpp}'}: {len(frozen)} parameter(s) have "
                f"no optimizer state (frozen), such as {frozen[0]}: "
                + (
                    "a distrib_optim.pt whose grad buffers leave parameters out is not supported yet"
                    if self.distopt
                    else "frozen parameters in several model chunks are not supported yet"
                ),
                hint="write the optimizer per parameter (--no-distributed-optimizer), or --to megatron-dist",
            )

    def _source(self, root: Path, manifest: Manifest) -> _Source:
        if manifest.format == "megatron-dist":
            from ckpttool.formats.megatron_dist_write import load_dist_source

            return load_dist_source(root, manifest)
        return load_source(root, manifest)

    def _vocab_rows(self) -> int | None:
        emb = self.manifest.items.get("embedding.word_embeddings.weight")
        if emb is None or emb.shape is None:
            return None
        if not self.target.repad_vocab:
            return None
        vocab = getattr(self.args, "vocab_size", None)
        multiple = self._run_divisor()
        if not isinstance(vocab, int) or multiple is None:
            raise UsageError(
                "--vocab-padding megatron needs args.vocab_size and make_vocab_size_divisible_by, which this "
                "checkpoint lacks",
                hint="Megatron-LM records vocab_size only for its null and tiktoken tokenizers: keep the padded rows "
                "(--vocab-padding keep, the default)",
            )
        return padded_vocab(vocab, multiple, self.target.tp)

    def _run_divisor(self) -> int | None:
        """The training run's own ``make_vocab_size_divisible_by``: the one ``args`` records beside
        a divisor an earlier reshard wrote (``_FIRST_DIVISOR``), else ``args``' (None: neither)."""
        for name in (_FIRST_DIVISOR, "make_vocab_size_divisible_by"):
            div = getattr(self.args, name, None)
            if isinstance(div, int) and not isinstance(div, bool) and div > 0:
                return div
        return None

    # -- which entries go where ----------------------------------------------------------------

    def place_of(self, name: str) -> list[tuple[int, int]]:
        """The (pipeline stage, model chunk) pairs whose model holds entry ``name``."""
        pp, last = self.target.pp, (self.target.pp - 1, self.vpp - 1)
        layer = _layer_of(name)
        if layer is not None:
            return [self.layer_place(layer)]
        if name.startswith("mtp."):
            return [self.mtp_at]
        if name.startswith("embedding."):
            # the MTP stage's copy (none when the MTP layers are in the first chunk, with the embedding)
            return [(0, 0), self.mtp_at] if self.mtp and pp > 1 and self.mtp_at != (0, 0) else [(0, 0)]
        if name.startswith("output_layer.weight") and self.tied:
            return [last] if pp > 1 else []
        if name.startswith(("decoder.final_layernorm", "final_layernorm")) and self.mtp and _num_layers(self.args):
            # with MTP layers megatron-core builds the final norm with the last decoder layer (its
            # TransformerBlock.has_final_layernorm_in_this_stage), which a layout may put before the last chunk
            return [self.layer_place(_num_layers(self.args) - 1)]
        if name.startswith(("output_layer.", "decoder.final_layernorm", "final_layernorm")):
            return [last]
        return [(p, v) for p in range(pp) for v in range(self.vpp)]

    def stage_of(self, name: str) -> list[int]:
        return sorted({p for p, _ in self.place_of(name)})

    def layer_place(self, layer: int) -> tuple[int, int]:
        """The target (pipeline stage, model chunk) holding global ``layer``."""
        if self._layer_places is None:
            self._layer_places = {
                first + i: (p, v)
                for p, chunks in enumerate(self.chunks)
                for v, (first, n) in enumerate(chunks)
                for i in range(n)
            }
        place = self._layer_places.get(layer)
        if place is None:
            raise CorruptFileError(
                f"layer {layer} is in the checkpoint, but its args say {_num_layers(self.args)} layers"
            )
        return place

    def layer_stage(self, layer: int) -> int:
        """The target pipeline stage holding global ``layer``."""
        return self.layer_place(layer)[0]

    def _holds(self, e: int | None, name: str) -> bool:
        """Whether EP rank ``e``'s files hold entry ``name`` (every rank holds the dense entries;
        ``e`` None: all ranks together)."""
        j = expert_of(name) if e is not None and self.local_experts else None
        return j is None or j // self.local_experts == e

    def _chunk_names(self, p: int, v: int, e: int | None = None) -> list[str]:
        """Model chunk ``v`` of stage ``p``'s entries, in model order (placed once, then kept); of EP
        rank ``e``'s files only, if given."""
        if self._placement is None:
            self._placement = {(q, w): [] for q in range(self.target.pp) for w in range(self.vpp)}
            for n in self.src.model_order:
                for place in self.place_of(n):
                    self._placement[place].append(n)
            last = self._placement[(self.target.pp - 1, self.vpp - 1)]
            if self.tied and self.target.pp > 1 and "output_layer.weight" not in last:
                # the last stage's copy of the tied embedding, before the output layer's _extra_state
                extra = "output_layer._extra_state"
                last.insert(last.index(extra) if extra in last else len(last), "output_layer.weight")
        return [n for n in self._placement[(p, v)] if self._holds(e, n)]

    def _model_names(self, p: int, e: int | None = None) -> list[str]:
        """Stage ``p``'s model entries, chunk after chunk (the order of its optimizer's parameters);
        of EP rank ``e``'s files only, if given."""
        return [n for v in range(self.vpp) for n in self._chunk_names(p, v, e)]

    @property
    def fp32_model(self) -> bool:
        """An fp32 model (trained without --bf16 and --fp16): megatron-core's FP32Optimizer keeps no
        main copy of it, and the distributed optimizer's main params are the parameters themselves."""
        return not (getattr(self.args, "bf16", False) or getattr(self.args, "fp16", False))

    def _master(self, name: str) -> Item | None:
        """The fp32 main param of parameter ``name`` (a source name): its saved copy, or an fp32
        model's parameter itself, which an FP32 optimizer's checkpoint keeps no other copy of."""
        master = self.manifest.items.get(f"{name}.fp32")
        if master is None and self.fp32_model:
            item = self.manifest.items.get(name)
            if item is not None and item.dtype == "float32" and f"{name}.exp_avg" in self.manifest.items:
                return item
        return master

    def _item(self, name: str) -> Item:
        if name in self.src.objects:  # a torch_dist record (or an entry it does not save)
            return self.src.objects[name] or Item(name=name, kind="object")
        item = self.manifest.items.get(self._src_name(name))
        if item is None:
            raise CorruptFileError(f"{name}: not in the source checkpoint")
        return item

    def files(self) -> list[PlannedFile]:
        out = []
        for p in range(self.target.pp):
            for e in range(self.ep):
                for t in range(self.target.tp):
                    if self._xranks is not None and (t, p, e) not in self._xranks:
                        continue  # no rank of expert DP rank 0 has these TP and EP ranks: none saves it
                    sizes = [o.nbytes for o in self._tensors(t, p, e)] + self._carried(t, p, e)
                    folder = f"{self.iter_dir}/{rank_dir(t, p, self.target.pp, e, self.ep)}"
                    out.append(PlannedFile.of(f"{folder}/model_optim_rng.pt", (t, p, e, 0), sizes))
                    if self.distopt:
                        tensors = [
                            o
                            for kind in self._kinds(t, p, e)
                            for v in self._buffers(p, e, kind)
                            for o in self._distrib(t, p, v, None, e, kind).values()
                        ]
                        nbytes = sum(o.nbytes for o in tensors)
                        largest = max((o.peak for o in tensors), default=0)  # a stage may hold none
                        key = (t, p, e, 1)
                        out.append(
                            PlannedFile(
                                path=f"{folder}/{DISTRIB}",
                                key=key,
                                nbytes=nbytes,
                                tensors=len(tensors),
                                largest=largest,
                            )
                        )
        return out

    def _carried(self, t: int, p: int, e: int) -> list[int]:
        """Bytes of each tensor rank (t, p, e)'s file carries as the source holds it (for planning):
        its RNG state's and, beside its parameters' moments, their Adam steps."""
        if not self.rank_files:
            return []
        carried = self._rng_carried_by(t, p, e)
        rng = carried[1] if carried else self.src.objs[self._rng_source(t, p, e)].get("rng_state")
        if isinstance(rng, SourceObject):  # a torch_dist source's record: its tensors are inside
            rng = self._record_value(rng)
        kept = {k: v for k, (_, v) in self._rng_kept.items()} if (t, p, e) == (0, 0, 0) else {}
        refs = [v for _, v in flatten({"rng_state": rng, "kept": kept}) if isinstance(v, _unpickle.TensorRef)]
        extra = self.src.optimizer_extra[1] if self.src.optimizer_extra else {}
        for kind in self._members:  # each optimizer (a chain's members): its scalers, its groups' steps
            held = {"extra": extra, "groups": [hyper for hyper, _ in self._target_groups(kind)]}
            # (a torch_dist source's grad scaler: read with its record, as an OutTensor)
            refs += [v for _, v in flatten(held) if isinstance(v, _unpickle.TensorRef | _ptwrite.OutTensor)]
        # (a tree holding a tensor twice pickles it once)
        once = list({id(r): r for r in refs}.values())
        if not self.distopt:  # every parameter's own step, even two taken from one source tensor
            steps = [self.src.step_of.get(self._src_name(n)) for n in self._params(p, None, e)]
            once += [s[1] for s in steps if s and isinstance(s[1], _unpickle.TensorRef | _ptwrite.OutTensor)]
        return [math.prod(r.shape) * lookup_dtype(r.dtype).itemsize for r in once]

    def _record_value(self, record: SourceObject) -> Any:
        """A torch_dist record's value as read (its tensors as references), for planning: one small
        read per record, kept for the ranks that share it."""
        if record.item.name not in self._records:
            with MegatronDistReader(self.manifest) as reader:
                self._records[record.item.name] = sharded_value(reader.read_object(record.item), record.item.name)
        return self._records[record.item.name]

    def _tensors(self, t: int, p: int, e: int = 0) -> Iterator[_ptwrite.OutTensor]:
        """The tensors of rank (t, p, e)'s ``model_optim_rng.pt`` (for planning)."""
        for name in self._model_names(p, e):
            item = self._item(name)
            if item.is_tensor:
                yield self._out(item, (t, p, e), None)
                for suffix in ("fp32", *_STATE_KEYS) if not self.distopt else ():
                    extra = self.manifest.items.get(f"{item.name}.{suffix}")
                    if extra is not None:
                        yield self._out(extra, (t, p, e), None)

    def _params(self, p: int, v: int | None = None, e: int | None = None, kind: bool | None = None) -> list[str]:
        """Stage ``p``'s parameters with optimizer state (of model chunk ``v`` only, of EP rank
        ``e``'s files only, of the dense (``kind`` False) or expert (True) parameters only, when
        given), in model order."""
        items = self.manifest.items
        names = self._model_names(p, e) if v is None else self._chunk_names(p, v, e)
        return [
            n
            for n in names
            if self._item(n).is_tensor
            and f"{self._src_name(n)}.exp_avg" in items
            and (kind is None or is_expert(n) == kind)
        ]

    def _buffers(self, p: int, e: int, kind: bool | None) -> list[int]:
        """The model chunks whose grad buffer holds parameters of this kind (one buffer each)."""
        return [v for v in range(self.vpp) if self._params(p, v, e, kind)]

    def _distrib(
        self,
        t: int,
        p: int,
        v: int,
        reader: PieceReader | None,
        e: int = 0,
        kind: bool | None = None,
    ) -> dict[str, _ptwrite.OutTensor]:
        """Rank (t, p, e)'s ``distrib_optim.pt`` world tensors of model chunk ``v`` (fp32 main params
        and Adam moments laid out as megatron-core's grad buffer of that chunk lays out its
        parameters at the new TP; ``kind``: the dense or the expert buffer under expert
        parallelism), each streamed one parameter at a time."""
        items = self.manifest.items
        params = self._params(p, v, e, kind)
        shapes = [(n, self._out(self._item(n), (t, p, e), None).shape) for n in params]
        size = None  # megatron-core buckets only the first model chunk (DDP's disable_bucketing)
        if v == 0:  # sized by all the rank's parameters, as DDP sizes both its buffers
            stage = sum(math.prod(self._out(self._item(n), (t, p, e), None).shape) for n in self._params(p, None, e))
            size = bucket_size(self.args, p, stage)
        shared = chunk_shared_embedding(self.args, p, self.target.pp, v, self.vpp) if not kind else frozenset()
        layout, numel = grad_buffer_layout(shapes, bucket_size=size, shared=shared)
        out: dict[str, _ptwrite.OutTensor] = {}
        for key, suffix in (("param", "fp32"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
            sources = []
            for name, shape, offset in layout:
                src = self._src_name(name)
                item = self._master(src) if suffix == "fp32" else items.get(f"{src}.{suffix}")
                if item is None or item.dtype != "float32":
                    raise UsageError(
                        f"--distributed-optimizer: {name} has no float32 {suffix} state in the source"
                        + (f" (it is {item.dtype})" if item is not None else "")
                    )
                sources.append((offset, math.prod(shape), item))
            out[key] = _ptwrite.streamed(
                "float32", (numel,), partial(self._world_parts, sources, numel, (t, p, e), reader)
            )
        return out

    def _world_parts(
        self, sources: list[tuple[int, int, Item]], numel: int, rank: tuple[int, int, int], reader: PieceReader | None
    ) -> Iterator[tuple[int, Callable[[np.ndarray], None] | None]]:
        pos = 0
        for offset, n, item in sources:  # in buffer order: the offsets grow
            if offset > pos:
                yield (offset - pos) * 4, None
            yield n * 4, self._out(item, rank, reader).fill
            pos = offset + n
        if numel > pos:
            yield (numel - pos) * 4, None

    def _out(self, item: Item, rank: tuple[int, int, int], reader: PieceReader | None) -> _ptwrite.OutTensor:
        """Output rank file ``rank`` = (t, p, e)'s part of ``item`` (``reader`` None: for planning
        only, never filled): TP rank t's, or for a routed expert's its ETP rank's."""
        assert item.dtype is not None
        composed = self._composed.get(item.name)
        if composed is not None:  # a GroupedMLP weight: EP rank e's experts, each transposed
            fc, members = composed
            t, tp = self._experts_at(*rank)
            mine = members[rank[2] * self.local_experts : (rank[2] + 1) * self.local_experts]
            parts = [(x, _local(x, t, tp, self.gated, self.rules, None)) for x in mine]
            a, b = _stacked(parts[0][1])  # one expert's part, as SequentialMLP's
            shape = (b, len(mine) * a) if fc == 1 else (len(mine) * b, a)
            return _ptwrite.OutTensor(dtype=item.dtype, shape=shape, fill=_GroupedFill(reader, parts, item.dtype))
        param = _base_param(item)
        rows = self.rows if _is_vocab(param) else None
        t, tp = self._experts_at(*rank) if is_expert(param) else (rank[0], self.target.tp)
        boxes = _local(item, t, tp, self.gated, self.rules, rows)
        return _ptwrite.OutTensor(dtype=item.dtype, shape=_stacked(boxes), fill=_Fill(reader, item, boxes))

    # -- writing -------------------------------------------------------------------------------

    def last_files(self) -> list[str]:
        """The files :meth:`finish` writes once every planned file is written."""
        return [TRACKER]

    def finish(self, tmp: Path, results: list[Any]) -> None:
        """The tracker file Megatron's loader starts from."""
        (tmp / TRACKER).write_text("release" if self.iter_dir == "release" else f"{self.iteration}")

    def write(
        self,
        t: int,
        p: int,
        e: int,
        which: int,
        out: Path,
        reader: PieceReader,
        progress: Callable[[int], None] | None,
    ) -> int:
        """Write rank (t, p, e)'s ``model_optim_rng.pt`` (``which`` 0) or ``distrib_optim.pt`` (1) to
        ``out``; returns the tensor bytes written."""
        if which == 1:
            if self.src.buffer_key is not None:  # the source's (param dtype, grad dtype)
                key = _ptwrite.carry(self.src.buffer_key, lambda: None)
            else:  # from the Float16 optimizer: its params' dtype; grads as Megatron-LM's DDP keeps them
                dtype = self._param_dtype()
                grads = "float32" if getattr(self.args, "accumulate_allreduce_grads_in_fp32", True) else dtype
                key = (_unpickle.TorchDType(dtype), _unpickle.TorchDType(grads))
            members: list[Any] = []
            for kind in self._members:
                if kind not in self._kinds(t, p, e):  # another rank's file holds it
                    members.append(None)
                    continue
                buffers: dict[Any, Any] = {"buckets_coalesced": True}
                for k, v in enumerate(self._buffers(p, e, kind)):  # one grad buffer per model chunk
                    state: dict[str, Any] = dict(self._distrib(t, p, v, reader, e, kind))
                    state["numel_unpadded"] = state["param"].shape[0]
                    # a tuple of its own per buffer (the same dtypes), as megatron-core pickles them
                    buffers[k] = {tuple(x for x in key): state}
                members.append(buffers)
            n = _ptwrite.save(members if self._chained else members[0], out, scratch=self.scratch)
            if progress is not None:
                progress(n)
            return n
        src_key = self.src.key(t, p, e)
        template = self.src.objs[src_key]
        rel = self.src.rels[src_key]
        rng_key = self._rng_source(t, p, e)
        archive: Callable[[str], Any] = _pt.archive_cache(reader)  # the reader's open archives
        models: dict[str, Any] = {}
        names: list[str] = []
        for v in range(self.vpp):
            offset = self.chunks[p][v][0]
            model = _unpickle.OrderedDictStandIn()
            chunk = self._frozen_last(self._chunk_names(p, v, e))
            for name in chunk:
                item = self._item(name)
                local = _localize(name, offset, e * self.local_experts)
                if item.is_tensor:
                    for part in self._composed.get(name, (0, [item]))[1]:  # a GroupedMLP weight: its experts
                        check_coverage(part)
                    model[local] = self._out(item, (t, p, e), reader)
                elif name in self.src.objects:
                    record = self.src.objects[name]
                    model[local] = None if record is None else SourceObject(record).value(reader)
                else:
                    piece = next((pc for pc in item.pieces if pc.rank == t % self.src.tp), item.pieces[0])
                    value = reader.read_object(Item(name=item.name, kind=item.kind, pieces=[piece]))
                    model[local] = _ptwrite.carry(value, partial(archive, piece.file))
            if self.src.metadata:  # (torch_dist keeps none)
                model.__dict__["_metadata"] = self._metadata(p, v, e, chunk, offset)
            models["model" if self.vpp == 1 else f"model{v}"] = model
            names += chunk
        tree: dict[str, Any] = {}
        for key, value in template.items():
            if key == "model" or re.fullmatch(r"model\d+", key):
                tree.update(models)  # where the source's model (or model chunks) stood
            elif key == "optimizer":
                if self.distopt:
                    states = [self._distopt_state(archive, kind) for kind in self._members]
                    tree[key] = states if self._chained else states[0]
                else:
                    tree[key] = self._optimizers((t, p, e), names, reader, archive)
            elif isinstance(value, SourceObject):  # a torch_dist source's RNG record
                tree[key] = value.value(reader)
            elif key == "args":
                tree[key] = self._args(value, t, p, e)
            elif key in (RNG_CARRIED, SPLIT_RULES):
                continue  # (written anew below, for the layout written)
            elif key == "rng_state" and (carried := self._rng_carried_by(t, p, e)) is not None:
                tree[key] = _ptwrite.carry(carried[1], partial(archive, carried[0]))
            elif key == "rng_state" and rng_key != src_key and "rng_state" in self.src.objs[rng_key]:
                rng_rel = self.src.rels[rng_key]
                tree[key] = _ptwrite.carry(self.src.objs[rng_key]["rng_state"], partial(archive, rng_rel))
            else:
                tree[key] = _ptwrite.carry(value, partial(archive, rel))
            if key == "rng_state" and (t, p, e) == (0, 0, 0) and (kept := self._rng_kept):
                tree[RNG_CARRIED] = {
                    label: _ptwrite.carry(rng, partial(archive, where)) for label, (where, rng) in kept.items()
                }
        if (t, p, e) == (0, 0, 0) and self._ruled:
            tree[SPLIT_RULES] = dict(self._ruled)
        n = _ptwrite.save(tree, out, scratch=self.scratch)
        if progress is not None:
            progress(n)
        return n

    def _frozen_last(self, names: list[str]) -> list[str]:
        """A model chunk's entries with its frozen parameters (no optimizer state) last: readers
        name a legacy optimizer's integer ids by walking the parameters in order and matching
        shapes (Megatron's own loader knows which are frozen), so a frozen one of a trained one's
        shape before it took its state."""
        frozen = {n for n in names if self._frozen(n)}
        return [n for n in names if n not in frozen] + [n for n in names if n in frozen] if frozen else names

    def _frozen(self, name: str) -> bool:
        """Whether entry ``name`` is a parameter without optimizer state where the source has some
        (not a buffer megatron-core keeps in the state dict, such as the router's ``expert_bias``,
        which stays in its place: it was moved after every other entry)."""
        return (
            self._optimized
            and name.rsplit(".", 1)[-1] not in _BUFFERS
            and self._item(name).is_tensor
            and f"{self._src_name(name)}.exp_avg" not in self.manifest.items
        )

    @cached_property
    def _optimized(self) -> bool:
        """Whether the source holds optimizer state (asked for every model chunk written)."""
        return any(i.kind == "optim" for i in self.manifest.items.values())

    @cached_property
    def _ruled(self) -> dict[str, int | None]:
        """The parameters a ``--split-rule`` (or the source's :data:`SPLIT_RULES`) splits, with
        their dims: kept in the first rank file, so that later reads place their parts."""
        out: dict[str, int | None] = {}
        for name, item in self.manifest.items.items():
            if item.kind == "param" and item.is_tensor and (found := matched_dim(name, self.rules)) is not None:
                out[name] = found[0]
        return out

    @cached_property
    def _labels(self) -> frozenset[str]:
        """The rank labels of the output's rank files."""
        return frozenset(
            rank_label(t, p, e)
            for p in range(self.target.pp)
            for e in range(self.ep)
            for t in range(self.target.tp)
            if self._xranks is None or (t, p, e) in self._xranks
        )

    def _rng_shared(self) -> list[str]:
        """The output's ranks beyond the source's TP or EP size that get another rank's RNG state
        (none of their own carried): their model-parallel (or expert-parallel) stream is a copy."""
        out = []
        for label in sorted(self._labels):
            t, p, e = label_ranks(label)
            if (t >= self.src.tp or e >= self.src.ep) and self._rng_carried_by(t, p, e) is None:
                out.append(label)
        return out

    def _rng_carried_by(self, t: int, p: int, e: int) -> tuple[str, Any] | None:
        """(file, ``rng_state``) of output rank (t, p, e) where the source carries that rank's own
        from an earlier layout (``ckpttool_rng_state``): a round trip through fewer ranks gives
        every rank its RNG back."""
        carried = self.src.rng_carried
        value = carried.get(rank_label(t, p, e))
        if value is None and carried and self._rng_source(t, p, e)[:2] != (t, p):
            # the rule would give it another TP or PP rank's state: a state of its own TP and PP
            # rank carried from another EP rank is closer (its model-parallel seeds are this rank's)
            same = sorted((k[2], label) for label in carried if (k := label_ranks(label))[:2] == (t, p))
            value = carried[same[0][1]] if same else None
        return None if value is None else (self.src.rels[(0, 0, 0)], value)

    @cached_property
    def _rng_kept(self) -> dict[str, tuple[str, Any]]:
        """The RNG states, by rank label, of the source's ranks (and those it carries) that no rank
        of the output has: kept in the output's first rank file (``ckpttool_rng_state``), for a
        reshard back to their layout, but for copies (:attr:`_rng_copied`). None from a
        ``torch_dist`` source (its RNG are records)."""
        return {label: v for label, v in self._rng_unhoused.items() if label not in self._rng_copied}

    @cached_property
    def _rng_copied(self) -> dict[str, str]:
        """:meth:`_rng_copies` of the states no output rank has."""
        return self._rng_copies(self._rng_unhoused)

    @cached_property
    def _rng_unhoused(self) -> dict[str, tuple[str, Any]]:
        """(file, ``rng_state``), by rank label, of the source's ranks (and those it carries) that
        no rank of the output has. None from a ``torch_dist`` source."""
        if self.src.dist:
            return {}
        held: dict[str, tuple[str, Any]] = {
            label: (self.src.rels[(0, 0, 0)], v) for label, v in self.src.rng_carried.items()
        }
        for k, obj in self.src.objs.items():
            if isinstance(obj.get("rng_state"), list):
                held[rank_label(*k)] = (self.src.rels[k], obj["rng_state"])
        return {label: held[label] for label in sorted(held) if label not in self._labels}

    def _rng_copies(self, kept: dict[str, tuple[str, Any]]) -> dict[str, str]:
        """Of the RNG states of ranks this layout has none for, those equal, tensors byte for byte,
        to the state this output gives rank (t mod TP, p mod PP, e mod EP), the rank whose state a
        reshard from it gives rank (t, p, e): copies a larger layout gave them (TP 1 → 2 gave rank 1
        rank 0's). They are not kept, so that a round trip through more ranks adds no entry to the
        source's, and a reshard back gives each the same state again. By label, the output rank's.
        None when the output's experts are split their own way (the rank whose state a reshard
        gives a rank then depends on who saved it), and none that shares its TP and PP rank with a
        state kept (a reshard gives the rank that one)."""
        if self._xranks is not None:
            return {}
        copies: dict[str, str] = {}
        with _pt.PtReader(self.manifest, ALLOWLIST) as reader:  # (its open archives)
            archive = _pt.archive_cache(reader)
            for label, (rel, value) in kept.items():
                t, p, e = label_ranks(label)
                k = (t % self.target.tp, p % self.target.pp, e % self.ep)
                given = self._rng_carried_by(*k)
                if given is None:
                    src_key = self._rng_source(*k)
                    given = (self.src.rels[src_key], self.src.objs[src_key].get("rng_state"))
                if _same_state(value, given[1], partial(archive, rel), partial(archive, given[0])):
                    copies[label] = rank_label(*k)
        own = {label_ranks(label)[:2] for label in kept if label not in copies}
        return {label: k for label, k in copies.items() if label_ranks(label)[:2] not in own}

    def _rng_source(self, t: int, p: int, e: int) -> tuple[int, int, int]:
        """The source rank file whose RNG state output rank file (t, p, e) gets: from a legacy source
        under expert TP, that of the source rank with the saving rank's dense TP, PP and DP-CP rank
        (:meth:`_Source.rng_key`; at ETP = TP the saving rank of file (t, p, e) is DP-CP rank e);
        otherwise the file the rest of it comes from, as the plan's note says."""
        if not self.src.rng_of:
            return self.src.key(t, p, e)
        d = e if self._xranks is None else self._xranks[(t, p, e)].dp
        return self.src.rng_key(t, p, d)

    def _metadata(self, p: int, v: int, e: int, names: list[str], offset: int) -> dict[str, Any]:
        layers = {_layer_of(n) for n in names} - {None}
        last = (p, v) == (self.target.pp - 1, self.vpp - 1)
        out: dict[str, Any] = _unpickle.OrderedDictStandIn()  # (as Module.state_dict() makes it)
        for key, value in self.src.metadata.items():
            layer = _layer_of(key + ".") if key else None
            local = _localize(key + ".", offset, e * self.local_experts)[:-1]
            if layer is not None:
                if layer in layers and self._holds(e, key + "."):
                    out[local] = copy.deepcopy(value)
            elif not self._holds(e, key + "."):
                continue  # another EP rank's expert of a multi-token prediction layer
            elif (p, v) in self.place_of(key + ".") or (self.tied and key.startswith("output_layer") and last):
                out[local] = copy.deepcopy(value)
        return out

    def _args(self, args: Any, t: int, p: int, e: int = 0) -> Any:
        tp, pp = self.target.tp, self.target.pp
        new = copy.copy(args)
        new.__dict__ = dict(args.__dict__)
        d = new.__dict__
        if "use_distributed_optimizer" in d or self.distopt:
            d["use_distributed_optimizer"] = self.distopt
        if self.rank_files and d.get("ckpt_format") == "torch_dist":  # legacy, from torch_dist
            d["ckpt_format"] = "torch"
            if "use_dist_ckpt" in d:
                d["use_dist_ckpt"] = False
        old_tp = d.get("tensor_model_parallel_size")
        # ranks and world size for the DP the output resumes at; data_parallel_size stays the source
        # run's (what the RNG of a later reshard is laid out for)
        dp = self._resume_dp()
        d["tensor_model_parallel_size"] = tp
        d["pipeline_model_parallel_size"] = pp
        if "transformer_pipeline_model_parallel_size" in d:
            d["transformer_pipeline_model_parallel_size"] = pp
        layout = _target_layout(args, self.target)
        if self.vpp > 1 or _source_vpp(args) > 1:
            d["virtual_pipeline_model_parallel_size"] = self.vpp if self.vpp > 1 else None
            # Megatron-LM takes the virtual stages from one of these: the layout, or this count
            d["num_virtual_stages_per_pipeline_rank"] = self.vpp if self.vpp > 1 and layout is None else None
            d["num_layers_per_virtual_pipeline_stage"] = None
        if layout is not None or d.get("pipeline_model_parallel_layout"):
            d["pipeline_model_parallel_layout"] = layout
        if self.split != stage_split(args) or "decoder_first_pipeline_num_layers" in d:
            d["decoder_first_pipeline_num_layers"], d["decoder_last_pipeline_num_layers"] = self.split
        if layout is not None or self.split != (None, None):  # (megatron-core allows neither with these)
            for flag in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"):
                if d.get(flag):
                    d[flag] = False
        if d.get("expert_tensor_parallel_size") == old_tp or self.src.etp or self.etp != tp:
            d["expert_tensor_parallel_size"] = self.etp
        if "expert_model_parallel_size" in d or self.ep > 1:
            d["expert_model_parallel_size"] = self.ep
        if "world_size" in d:
            d["world_size"] = tp * int(d.get("context_parallel_size") or 1) * pp * dp
        if "rank" in d:  # the rank that saves the file, in megatron-core's rank layout (verify checks it)
            rank = self._saving_rank(t, p, e)
            if d.get("local_rank") == d["rank"]:
                d["local_rank"] = rank
            d["rank"] = rank
        if self.padded is not None and "padded_vocab_size" in d:
            d["padded_vocab_size"] = self.padded
            if self.divisor is not None:
                d.setdefault(_FIRST_DIVISOR, d.get("make_vocab_size_divisible_by"))
                d["make_vocab_size_divisible_by"] = self.divisor
                if d[_FIRST_DIVISOR] == self.divisor:
                    del d[_FIRST_DIVISOR]
        return new

    def _resume_dp(self) -> int:
        """The data-parallel size the output is written for: the source run's, or under expert
        parallelism the smallest multiple of it whose TP x DP ranks hold whole ETP x EP expert
        groups (at ETP = TP: a multiple of EP, as Megatron needs; ``args``' rank and world size and
        the sharded RNG of ``torch_dist`` follow it)."""
        dp = int(getattr(self.args, "data_parallel_size", 1) or 1)
        return math.lcm(dp, self._dp_multiple())

    def _dp_multiple(self) -> int:
        """What the data-parallel size of the output must be a multiple of: its TP x DP ranks (a
        stage's) must hold whole ETP x EP expert groups (EP itself at ETP = TP)."""
        group = self.etp * self.ep
        return group // math.gcd(self.target.tp, group)

    def _vocab_divisor(self) -> int | None:
        """The ``make_vocab_size_divisible_by`` to record in ``args`` so that Megatron pads the
        vocabulary to the output's rows at the new TP (None: ``args``' own does). Where ``args``
        holds no ``vocab_size`` (Megatron-LM records it only for its null and tiktoken tokenizers:
        a GPT-2, SentencePiece or Hugging Face tokenizer's run saves None), any vocabulary up to the
        rows is padded to them by rows / TP, and the run's own divisor only where it provably is:
        at a TP no smaller than the source's, of whose rows ``args``' divisor x TP is a multiple."""
        tp, rows = self.target.tp, self.padded
        vocab = getattr(self.args, "vocab_size", None)
        div = getattr(self.args, "make_vocab_size_divisible_by", None)
        own = self._run_divisor()
        if rows is None or own is None or not isinstance(div, int) or rows % tp:
            return None
        if not isinstance(vocab, int) or isinstance(vocab, bool) or not 0 < vocab <= rows:
            if div == own and tp >= self.src.tp and rows % (own * tp) == 0:
                return None
            return own if rows // tp == own else rows // tp
        if own != div and padded_vocab(vocab, own, tp) == rows:
            return own  # (back at a TP the run's divisor gives these rows at: its args come back)
        if padded_vocab(vocab, div, tp) == rows:
            return None
        return rows // tp

    def _unused_output_notes(self) -> list[str]:
        """What becomes of the output_layer.weight megatron-core allocates but never uses on the last
        stage of a tied model whose MTP layers share its last chunk
        (:func:`~ckpttool.formats.megatron.unused_output_layer`), in the source or the target."""
        what = (
            "megatron-core 0.16.1 allocates it but never uses it when the MTP layers share the last chunk of a tied "
            "model"
        )
        unused_in = "output_layer.weight" in (self.manifest.extras.get("unused") or ())
        unused_out = self.unused_out
        out = []
        if unused_in and not (unused_out and self.rank_files):
            out.append(f"the source's last-stage output_layer.weight is not written ({what}: random init, zero "
                       "moments)")  # fmt: skip
        if unused_out and not self.rank_files:
            out.append(
                "megatron-core 0.16.1 cannot load this model at this pipeline layout (its sharded_state_dict asserts "
                "on the last stage's output layer, which it allocates but never uses when the MTP layers share the "
                "last chunk of a tied model): load it at a layout with a stage of its own for the MTP layers, or "
                "write legacy files (--to megatron)"
            )
        elif unused_out and not unused_in:
            out.append(f"the last stage's output_layer.weight is written as a copy of the word embeddings ({what}, so "
                       "its values do not change training)")  # fmt: skip
        return out

    def notes(self) -> list[str]:
        """What a user resuming from the output must know."""
        out = []
        if self.divisor is not None and self.divisor != self._run_divisor():
            known = isinstance(getattr(self.args, "vocab_size", None), int)  # (re-padding needs the size)
            out.append(
                f"the vocabulary stays padded to {self.padded} rows: resume with --make-vocab-size-divisible-by "
                f"{self.divisor} (recorded in args)" + (", or reshard with --vocab-padding megatron" if known else "")
            )
        if self.rank_files and self._ruled:
            out.append(
                f"split rules of {len(self._ruled)} parameter(s) ({_few(list(self._ruled))}): kept in the first rank "
                f"file under '{SPLIT_RULES}' (Megatron ignores it), so that later reads and reshards place their "
                "parts without --split-rule"
            )
        own = self.etp if self.etp != self.target.tp else 0  # the output's experts split their own way
        layout = (self.target.tp, self.target.pp, self.ep, own)
        if (self.src.tp, self.src.pp, self.src.ep, self.src.etp) != layout and any(
            i.kind == "rng" for i in self.manifest.items.values()
        ):
            if self.src.rng_of:  # a legacy source under expert TP: only expert-DP rank 0's ranks saved theirs
                out.append(
                    f"RNG state: each rank gets the state of the source rank of its TP, PP and DP-CP rank (modulo "
                    f"{self.src.tp}, {self.src.pp} and {self.src.dp}) when that rank saved a file, else of a rank "
                    "that did with the same seeds (TP, PP, EP and expert TP rank), else of its TP and PP rank at DP-CP "
                    "rank 0"
                )
            elif self.ep > 1 or self.src.ep > 1:
                out.append(
                    f"RNG state: rank (t, p, e) gets source rank (t mod {self.src.tp}, p mod {self.src.pp}, "
                    f"e mod {self.src.ep})'s"
                )
            else:
                out.append(f"RNG state: rank (t, p) gets source rank (t mod {self.src.tp}, p mod {self.src.pp})'s")
            own_back = [lab for lab in self.src.rng_carried if lab in self._labels]
            if own_back:
                out[-1] += (
                    f", except {_few(own_back)}, which get their own back (carried by the source, a checkpoint "
                    "ckpttool wrote at fewer ranks)"
                )
            if self.rank_files:
                if kept := self._rng_kept:
                    out.append(
                        f"RNG state of {len(kept)} rank(s) of the source that this layout has none for "
                        f"({_few(list(kept))}): kept in the first rank file under '{RNG_CARRIED}' (Megatron ignores "
                        "it), so that a reshard back to a layout with those ranks gives each its own"
                    )
                if copied := self._rng_copied:
                    out.append(
                        f"RNG state of {len(copied)} rank(s) of the source that this layout has none for "
                        f"({_few(list(copied))}) not kept: each equals the state of a rank written "
                        f"({_few(sorted(set(copied.values())))}), a copy a larger layout gave it, and a reshard "
                        "back gives it that state again"
                    )
            if shared := self._rng_shared():
                out.append(
                    f"RNG streams: {len(shared)} new rank(s) ({_few(shared)}) get the state of a source rank that "
                    "another output rank gets too, the model-parallel stream included (Megatron seeds it per TP "
                    "rank, the expert-parallel one per EP rank): dropout in tensor-parallel regions then draws the "
                    "same masks on those ranks. To seed every rank afresh from --seed, resume with --no-load-rng"
                )
        if self.ep != self.src.ep or own != self.src.etp:
            dp = getattr(self.args, "data_parallel_size", None)
            multiple = self._dp_multiple()
            out.append(
                f"experts: {self.local_experts} per EP rank; resume with --expert-model-parallel-size {self.ep}"
                + (f" --expert-tensor-parallel-size {self.etp}" if self.etp != self.target.tp else "")
                + (
                    f" and a data-parallel size that is a multiple of {multiple} (the source ran DP={dp}; written "
                    f"for DP={self._resume_dp()})"
                    if isinstance(dp, int) and dp % multiple
                    else ""
                )
            )
        if self.target.pp > 1 and _num_layers(self.args):
            out.append(self._placement_note())
        out += self._unused_output_notes()
        if self.src.dist and self.rank_files:
            out.append(
                "written from a torch_dist checkpoint: Megatron-LM reads it with --ckpt-format torch; the modules' "
                "_metadata (versions) is left out, as torch_dist keeps none (Megatron-LM's torch_dist load gives "
                "the model none either)"
            )
        alike = _alike_groups(self._saved_groups())
        if alike:
            out.append(
                f"param groups {' and '.join(map(str, alike))} differ only in their LR schedule (max_lr, min_lr: "
                "--decoupled-lr), which megatron-core before 0.19 does not match saved groups by (Megatron-LM "
                "#4705): there, as with the source, the Float16 optimizer fails to load them and the distributed "
                "optimizer gives both the last one's schedule; resume with megatron-core 0.19 or later"
            )
        if self.src.distopt != self.distopt:
            out.append(
                "optimizer state written for megatron-core's distributed optimizer: resume with "
                "--use-distributed-optimizer"
                if self.distopt
                else "optimizer state written per parameter (Float16/FP32 optimizer): resume without "
                "--use-distributed-optimizer"
            )
        return out

    def _saved_groups(self) -> list[dict[str, Any]]:
        """The source optimizer's param groups (of every member of a chain)."""
        return self.src.groups

    def _placement_note(self) -> str:
        """The layers of each stage (and model chunk), e.g. ``layers by stage: [0-1] [2] [3]``; with
        the Megatron-LM flags a resumed run needs to place them so."""

        def span(first: int, n: int) -> str:
            return "[]" if not n else f"[{first}]" if n == 1 else f"[{first}-{first + n - 1}]"

        stages = " ".join(
            "+".join(span(first, n) for first, n in chunks) if self.vpp > 1 else span(*chunks[0])
            for chunks in self.chunks
        )
        flags = []
        layout = _target_layout(self.args, self.target)
        if layout is not None:
            flags.append(f"--pipeline-model-parallel-layout {layout!r}")
        first, last = self.split
        if first is not None:
            flags.append(f"--decoder-first-pipeline-num-layers {first}")
        if last is not None:
            flags.append(f"--decoder-last-pipeline-num-layers {last}")
        if self.vpp > 1 and layout is None:
            flags.append(f"--num-virtual-stages-per-pipeline-rank {self.vpp}")
        counted = [
            f"--{flag.replace('_', '-')}"
            for flag in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
            if getattr(self.args, flag, False)
        ]
        if counted and (layout is not None or self.split != (None, None)):  # (dropped from args: see _args)
            flags.append(f"and without {' or '.join(counted)}")
        what = "layers by stage" + (" (model chunks joined by +)" if self.vpp > 1 else "")
        return f"{what}: {stages}" + (f"; resume with {' '.join(flags)}" if flags else "")

    def _optimizers(
        self, rank: tuple[int, int, int], names: list[str], reader: PieceReader, archive: Callable[[str], Any]
    ) -> Any:
        """The rank file's ``optimizer``: one optimizer's state dict, or under expert parallelism
        megatron-core's ``ChainedOptimizer`` list (the dense parameters', then the experts'; at EP=1
        the experts are in the dense optimizer, as megatron-core builds it)."""
        members = [
            self._optimizer(
                rank, [n for n in names if kind is None or is_expert(n) == kind], reader, archive, kind=kind
            )
            for kind in self._members
        ]
        return members if self._chained else members[0]

    def _memberless_kinds(self) -> dict[int, set[bool]]:
        """The kinds of parameter (routed expert or not) each param group of a source whose groups
        name no members holds (the distributed optimizer's, a torch_dist checkpoint's): under expert
        parallelism the group's own ``is_expert_parallel``. A source saved at EP = 1 has the experts
        in its dense groups; to chain a dense and an expert optimizer (EP > 1), the groups that hold
        experts are found by megatron-core's standard rule (:meth:`standard_membership`, refused if
        the groups do not fit it), and the expert optimizer takes copies of them."""
        groups = self.src.groups
        if not (self._chained and groups and not any(g.get("is_expert_parallel") for g in groups)):
            return {g: {bool(h.get("is_expert_parallel"))} for g, h in enumerate(groups)}
        group_of = self.src.group_of or self.standard_membership(
            groups,
            False,
            f"EP={self.ep} from this checkpoint saved at EP=1 "
            + ("in torch_dist" if self.src.dist else "by the distributed optimizer")
            + " (its param groups do not name their parameters, and the experts move to an expert optimizer "
            "of their own): ",
            "reshard it at EP=1: its param groups are then kept as saved",
        )
        return expert_kinds(group_of)

    def _target_groups(self, kind: bool | None) -> list[tuple[dict[str, Any], set[int]]]:
        """The param groups of an output optimizer: (hyper-parameters, the source groups whose
        parameters it takes). ``kind``: None for an optimizer of all parameters, False for the
        dense member of a chain, True for the experts' member (``is_expert_parallel`` set). Every
        group of that kind in the whole model, as megatron-core aligns groups over all ranks. A
        group's kind is that of its parameters (where the groups name none: :meth:`_memberless_kinds`)."""
        kinds = self._group_kinds
        out: list[tuple[dict[str, Any], set[int]]] = []
        for g, hyper in enumerate(self.src.groups):
            if not kinds.get(g) or (kind is not None and kind not in kinds[g]):
                continue
            new = copy.deepcopy(hyper)
            if "is_expert_parallel" in new or kind:
                new["is_expert_parallel"] = bool(kind)
            same = next((taken for h, taken in out if h == new), None)
            if same is None:
                out.append((new, {g}))
            else:
                same.add(g)
        return out

    def _optimizer(
        self,
        rank: tuple[int, int, int],
        names: list[str],
        reader: PieceReader,
        archive: Callable[[str], Any],
        *,
        kind: bool | None,
    ) -> Any:
        params = [n for n in names if self._item(n).is_tensor and f"{self._src_name(n)}.exp_avg" in self.manifest.items]
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        masters: list[list[Any]] = []
        pid = 0
        stepped: set[int] = set()
        for hyper, taken in self._target_groups(kind):
            members = [n for n in params if self.src.group_of.get(self._src_name(n), 0) in taken]
            ids = []
            fp32 = []
            for name in members:
                src_name = self._src_name(name)
                entry: dict[str, Any] = {}
                step = self.src.step_of.get(src_name)
                if step is not None:
                    carried = _ptwrite.carry(step[1], partial(archive, step[0]))
                    if isinstance(carried, _ptwrite.OutTensor) and id(carried) in stepped:
                        # a tied output layer's copy takes the embeddings' step (a torch_dist
                        # source's one record): its own tensor, as torch's Adam keeps one per
                        # parameter and steps it in place (one tensor shared would step twice)
                        carried = replace(carried)
                    stepped.add(id(carried))
                    entry["step"] = carried
                for key in _STATE_KEYS:
                    entry[key] = self._out(self.manifest.items[f"{src_name}.{key}"], rank, reader)
                state[pid] = entry
                master = self.manifest.items.get(f"{src_name}.fp32")
                if master is not None:
                    fp32.append(self._out(master, rank, reader))
                ids.append(pid)
                pid += 1
            groups.append({**hyper, "params": ids})
            masters.append(fp32)
        inner = {"state": state, "param_groups": groups}
        extra = self._optimizer_extra(archive)
        if not self.src.fp32_masters:  # an FP32 optimizer's state dict is torch's own
            return self._plain_optimizer(inner, extra)
        # the Float16 optimizer's, even for a chain member that holds no parameters here
        return {"optimizer": inner, "fp32_from_fp16_params": masters, **extra}

    def _plain_optimizer(self, inner: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
        """An optimizer's state dict without fp32 masters: the FP32Optimizer's (an fp32 model's)
        is torch's own, ``inner``, bare; otherwise ``{'optimizer': inner, ...extra}`` (in torch_dist's
        ``common.pt``, the Float16 optimizer's). An fp32 run's grad scaler is refused before
        (``fp32_scaler``)."""
        return inner if self.fp32_model and not extra else {"optimizer": inner, **extra}

    def _kinds(self, t: int, p: int, e: int) -> tuple[bool | None, ...]:
        """The optimizers whose state rank file (t, p, e)'s ``distrib_optim.pt`` holds: each
        optimizer's DP rank 0 saves its state (megatron-core's ``ChainedOptimizer``), so the dense
        state is in the files of the saving ranks of dense DP rank 0 (at ETP = TP: EP rank 0's), the
        experts' in every file (their expert-DP rank 0 saves the files)."""
        dense = e == 0 if self._xranks is None else self._xranks[(t, p, e)].dp == 0
        return self._members if dense else (True,)

    def _distopt_state(self, archive: Callable[[str], Any], kind: bool | None = None) -> dict[str, Any]:
        """What ``DistributedOptimizer.state_dict`` saves in the rank file: the param groups without
        their members, each with the common ``step`` (its tensors go in ``distrib_optim.pt``);
        ``kind`` as for :meth:`_target_groups`."""
        if self.src.memberless:  # the groups as saved, each with its step
            groups = [hyper for hyper, _ in self._target_groups(kind)]
        else:
            steps = set()
            for rel, value in self.src.step_of.values():
                if isinstance(value, _unpickle.TensorRef):
                    value = read_tensor(archive(rel), value).reshape(-1)[0]
                steps.add(float(value))
            if len(steps) != 1:
                raise UsageError(f"--distributed-optimizer: the parameters' optimizer steps differ: {sorted(steps)}")
            step = steps.pop()
            groups = [{**h, "step": step} for h, _ in self._target_groups(kind)]
        return {"optimizer": {"param_groups": groups}, **self._optimizer_extra(archive)}

    def _param_dtype(self) -> str:
        dtypes = {self._item(n).dtype for p in range(self.target.pp) for n in self._params(p)}
        if len(dtypes) != 1:
            raise UsageError(f"--distributed-optimizer: parameters of several dtypes ({sorted(map(str, dtypes))})")
        return str(dtypes.pop())

    def _optimizer_extra(self, archive: Callable[[str], Any]) -> dict[str, Any]:
        """The source optimizer's other entries (loss and grad scalers: their tensors copied)."""
        rel, extra = self.src.optimizer_extra
        return {k: _ptwrite.carry(v, partial(archive, rel)) for k, v in extra.items()}

    def _src_name(self, name: str) -> str:
        """The source item a target entry is written from: a tied output layer's copy from the word
        embeddings (an unused output layer from the source's own, when it has one)."""
        if self.tied and name.startswith("output_layer.weight") and (self.copy_out or name not in self.manifest.items):
            return name.replace("output_layer.weight", "embedding.word_embeddings.weight")
        return name


def fp32_scaler(extra: dict[str, Any]) -> str:
    """Why an fp32 model's distributed-optimizer state with other entries (a grad scaler:
    ``--loss-scale``) cannot become the FP32 optimizer's, which keeps torch's state dict alone."""
    return (
        f"it is an fp32 model whose distributed optimizer also saved {', '.join(sorted(map(str, extra)))} "
        "(--loss-scale), which megatron-core's FP32 optimizer has no place for"
    )


def expert_kinds(group_of: dict[str, int]) -> dict[int, set[bool]]:
    """The kinds of parameter (routed expert or not) each param group holds, by ``group_of``
    (parameter name -> group)."""
    kinds: dict[int, set[bool]] = {}
    for name, g in group_of.items():
        kinds.setdefault(g, set()).add(is_expert(name))
    return kinds


def group_identity(group: dict[str, Any]) -> str:
    """A param group by megatron-core's identifier keys, for a message."""
    return "(" + ", ".join(f"{k}={group.get(k)!r}" for k in ("wd_mult", "lr_mult", "is_decoupled_lr")) + ")"


def group_step(groups: list[dict[str, Any]], refuse: str, hint: str | None = None) -> float:
    """The one step the distributed optimizer saved in each of its param groups; ``refuse`` (the
    reason's start) when they do not carry one common float step."""
    raw: list[Any] = [h.get("step") for h in groups]
    if any(type(v) is not float for v in raw):
        # torch's Adam gives float (megatron-core saves step.item()); TransformerEngine's and apex's
        # FusedAdam keep an int step per group only, and refuse a step per parameter
        raise UsageError(
            refuse + f"its param groups' steps are {raw}, not torch Adam's float steps (TransformerEngine's "
            "or apex's FusedAdam keep the step per group, and their state has no step per parameter)",
            hint=hint,
        )
    if len(set(raw)) != 1:
        raise UsageError(refuse + f"its param groups do not carry one common step ({raw})", hint=hint)
    return float(raw[0])


_EMBEDDING_OR_OUTPUT = frozenset({"embedding.word_embeddings.weight", "output_layer.weight"})
"""the parameters megatron-core marks ``is_embedding_or_output_parameter`` (the ones ``--decoupled-lr``
applies to)"""


def _decoupled_group(group: dict[str, Any], decoupled_lr: float | None) -> bool:
    """Whether a saved param group is ``--decoupled-lr``'s. megatron-core before 0.16 marks it
    ``is_decoupled_lr``; 0.16 forms it from a ``max_lr`` (and ``min_lr``) override, so it is the group
    whose LR schedule is not the default one (``default_config`` False) and whose ``max_lr`` is the
    decoupled LR."""
    if group.get("is_decoupled_lr"):
        return True
    return (
        decoupled_lr is not None
        and group.get("default_config") is False
        and float(group.get("max_lr", float("nan"))) == float(decoupled_lr)
    )


def _alike_groups(groups: list[dict[str, Any]]) -> list[int]:
    """The first two param groups that differ in their LR schedule (``max_lr``, ``min_lr``) only,
    which megatron-core's identifier keys before 0.19 do not tell apart (its loaders match saved
    groups to their own by those keys alone), or none. Groups without the keys are not compared."""
    seen: dict[tuple[Any, ...], tuple[int, tuple[Any, ...]]] = {}
    for g, group in enumerate(groups):
        key = tuple(group.get(k, group.get(f"pre_{k}")) for k in _GROUP_KEYS)
        if any(v is None for v in key):
            continue
        schedule = (group.get("max_lr"), group.get("min_lr"))
        if key in seen and seen[key][1] != schedule:
            return [seen[key][0], g]
        seen.setdefault(key, (g, schedule))
    return []


def check_group_keys(groups: list[dict[str, Any]], what: str) -> None:
    """The distributed optimizer matches saved param groups to its own by megatron-core's
    identifier keys: refuse groups (``what``) that lack them."""
    for group in groups:
        lacking = [k for k in _GROUP_KEYS if k not in group and f"pre_{k}" not in group]
        if lacking:
            raise UsageError(
                f"--distributed-optimizer: {what} lack {', '.join(lacking)}, by which Megatron's distributed "
                "optimizer matches them",
            )


def _scalar(value: float) -> _ptwrite.OutTensor:
    """A 0-d float32 tensor (torch's Adam keeps ``step`` so), one object per use."""

    def fill(buf: np.ndarray) -> None:
        buf.view(np.float32).reshape(())[...] = value

    return _ptwrite.OutTensor(dtype="float32", shape=(), fill=fill)


def _localize(name: str, offset: int, expert_offset: int = 0) -> str:
    m = _LAYER.match(name)
    name = f"{m['pre']}{int(m['i']) - offset}{m['rest']}" if m else name
    return renumber_expert(name, lambda j: j - expert_offset) if expert_offset else name


__all__ = ["LegacyWriter", "MegatronTarget", "load_source"]
