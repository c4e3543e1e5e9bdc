"""Megatron-LM checkpoints: ``torch_dist`` (megatron-core ``dist_checkpointing``) and legacy
``mp_rank_*`` directories.

Both are read into the names the training code knew, with layers numbered globally
(``decoder.layers.3.mlp.linear_fc1.weight``) and optimizer state as the parameter name plus the
state name (``<param>.exp_avg``, ``<param>.exp_avg_sq``, master copies ``<param>.fp32``). See
``docs/formats/megatron.md``.
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import json
import math
import os
import re
import shlex
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ckpttool import _unpickle
from ckpttool.dtypes import BY_NAME
from ckpttool.dtypes import dtype as lookup_dtype
from ckpttool.errors import (
    CkptError,
    CorruptFileError,
    IncompleteCheckpointError,
    PathEscapeError,
    name_from_above,
    raise_together,
)
from ckpttool.formats import _pt
from ckpttool.formats.base import Detection, claim
from ckpttool.formats.dcp import DcpAdapter, DcpReader, is_dist_config, misplaced_in
from ckpttool.formats.dcp import records as dcp_records
from ckpttool.geometry import Box, row_major_strides
from ckpttool.io import confine, left_out, open_regular, outside, read_tracker
from ckpttool.manifest import (
    UNSAFE_PICKLE,
    FileRecord,
    FileRole,
    Item,
    Kind,
    Layout,
    Manifest,
    Piece,
    ReplicaCounter,
)
from ckpttool.naming import RANK_LABEL, classify
from ckpttool.values import flatten, plain_value, set_value

TRACKER = "latest_checkpointed_iteration.txt"

RNG_CARRIED = "ckpttool_rng_state"
"""The key under which a legacy checkpoint ckpttool wrote keeps, in its first rank file, the RNG
states of source ranks its layout has no rank for (``{rank label: rng_state}``): a reshard back to
a layout with those ranks gives each its own again (Megatron's loader ignores the key)."""

SPLIT_RULES = "ckpttool_split_rules"
"""The key under which a legacy checkpoint ckpttool wrote with ``--split-rule`` keeps, in its first
rank file, how it split the parameters megatron-core's rules leave open (``{parameter: dim}``, None
for whole on every rank): later reads place their TP ranks' parts by it (Megatron ignores the key).
Parameter names, not the user's patterns: a file's patterns would be regular expressions run on
every name, which a hostile file could make take for ever."""

_COMMON_KEYS = frozenset(
    {
        "args",
        "checkpoint_version",
        "iteration",
        "num_floating_point_operations_so_far",
        "opt_param_scheduler",
        "optimizer",
        "content_metadata",  # (how megatron-core laid the save out: written anew for the layout written)
    }
)
"""The keys of a torch_dist save's ``common.pt`` the reader turns into items or reads as the save's
own description; any other is carried by :func:`_add_unknown_keys`."""

_LEGACY_KEYS = (_COMMON_KEYS - {"content_metadata"}) | {"lr_scheduler", "rng_state", RNG_CARRIED, SPLIT_RULES}
"""The top-level keys of a legacy rank file the reader turns into items (with the model chunks,
:data:`_MODEL_KEY`); any other is carried by :func:`_add_unknown_keys`."""

_MODEL_KEY = re.compile(r"model\d*")
"""A legacy rank file's model chunk: ``model``, or ``model<v>`` with virtual pipeline stages."""


def _plain(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is built of what every format ckpttool writes can hold (Python's and
    NumPy's plain values, in lists, tuples and dicts): not megatron-core's own classes (a pending
    rerun's ``RerunMode``), which a DCP or torch.save output's readers refuse."""
    if value is None or isinstance(value, bool | int | float | complex | str | bytes | np.ndarray | np.generic):
        return True
    if depth > 32:
        return False
    if isinstance(value, list | tuple):
        return all(_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str | int) and _plain(v, depth + 1) for k, v in value.items())
    return False


def _add_unknown_keys(
    manifest: Manifest, tree: Mapping[str, Any], rel: str, known: frozenset[str], *, tensors: bool = True
) -> None:
    """Items for the top-level keys of ``tree`` (file ``rel``) that Megatron-LM itself does not
    write, or writes only at times (``rerun_state_machine``, ``modelopt_state``, a fork's counters
    or data position): each leaf an item, named by its dotted path as a torch.save file's are, so
    that a conversion carries it and ``diff`` compares it. Before, they were left out: ``convert
    --to dcp`` dropped them and ``diff`` called the result equal. Left out still: a leaf of a class
    of megatron-core's own (:func:`_plain`), which other formats' readers refuse, and, without
    ``tensors`` (a torch_dist ``common.pt``, whose reader reads DCP pieces), a tensor; each is
    listed in ``extras["not_carried"]``."""
    for key, value in tree.items():
        if not isinstance(key, str) or key in known or _MODEL_KEY.fullmatch(key):
            continue
        for name, leaf in flatten(value, key):
            if name in manifest.items:
                continue  # (a name the model or the optimizer already gave an item)
            is_tensor = isinstance(leaf, _unpickle.TensorRef)
            if (is_tensor and not tensors) or (not is_tensor and not _plain(leaf)):
                what = "a tensor" if is_tensor else str(getattr(leaf, "enum", None) or type(leaf).__name__)
                manifest.extras.setdefault("not_carried", []).append(f"{rel}: {name} ({what})")
                continue
            if is_tensor:
                kind = classify(name, is_tensor=True)
                manifest.add(
                    Item(
                        name=name,
                        kind="object" if kind in ("param", "master", "optim") else kind,
                        dtype=leaf.dtype,
                        shape=leaf.shape,
                        pieces=[_pt.tensor_piece(rel, leaf)],
                    )
                )
            else:
                item = manifest.add(
                    Item(name=name, kind=classify(name, is_tensor=False), pieces=[_pt.object_piece(rel, name)])
                )
                set_value(item, leaf)


_USER_RULES: contextvars.ContextVar[Mapping[str, int | None] | None] = contextvars.ContextVar(
    "split_rules", default=None
)


@contextlib.contextmanager
def user_split_rules(rules: Mapping[str, int | None]) -> Iterator[None]:
    """Read legacy checkpoints, inside the block, with ``--split-rule`` patterns ``rules``
    (``{pattern: dim}``) for the parameters megatron-core's rules leave open: a source at TP > 1
    holds one part of each per rank, not a copy (read as copies, a reshard kept rank 0's part)."""
    token = _USER_RULES.set(dict(rules))
    try:
        yield
    finally:
        _USER_RULES.reset(token)


def rule_of_dim(dim: int | None) -> tuple[str, int | None]:
    """The split rule a ``--split-rule`` dim stands for."""
    return ("replicated", None) if dim is None else ("column" if dim == 0 else "row", dim)


def matched_dim(name: str, rules: Mapping[str, int | None]) -> tuple[int | None] | None:
    """``(dim,)`` of the first of ``rules`` (``{pattern: dim}``) whose pattern ``name`` matches;
    None where none does (a dim of None is a rule too: whole on every rank)."""
    return next(((dim,) for pattern, dim in rules.items() if re.search(pattern, name)), None)


def _carried_rules(value: Any, rel: str) -> dict[str, int | None]:
    """The split rules a legacy file ckpttool wrote carries (:data:`SPLIT_RULES`), checked."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and (d is None or (type(d) is int and 0 <= d < 8)) for k, d in value.items()
    ):
        raise CorruptFileError(
            f"{rel}: '{SPLIT_RULES}' holds {plain_value(value)!r:.120}; ckpttool writes parameter names and "
            "split dims (or None) there",
            hint="the file is damaged or was not written by ckpttool; restore it from its source",
            path=rel,
        )
    return dict(value)


def _add_rng(manifest: Manifest, rel: str, rng: Any, path: str, label: str, rank: int) -> None:
    """The items of one rank's ``rng_state`` list (at dotted ``path`` in file ``rel``), named
    ``rng_state.<entry>...<label>``."""
    if not isinstance(rng, list):
        return
    for name, value in flatten(rng, path):
        key = "rng_state" + name[len(path) :] + label
        if isinstance(value, _unpickle.TensorRef):
            manifest.add(
                Item(
                    name=key,
                    kind="rng",
                    dtype=value.dtype,
                    shape=value.shape,
                    pieces=[_pt.tensor_piece(rel, value, rank=rank)],
                )
            )
        else:
            item = manifest.add(Item(name=key, kind="rng", pieces=[_pt.object_piece(rel, name, rank=rank)]))
            set_value(item, value)


def _rng_labels(manifest: Manifest) -> set[str]:
    """The rank labels of the RNG items so far."""
    found = (RANK_LABEL.search(name) for name, item in manifest.items.items() if item.kind == "rng")
    return {m.group(0) for m in found if m and m.end() == len(m.string)}


def label_ranks(label: str) -> tuple[int, int, int]:
    """(TP, PP, EP) rank of a :func:`rank_label` (EP 0 where it names none)."""
    m = RANK_LABEL.fullmatch(label)
    if m is None:
        raise ValueError(f"not a rank label: {label!r}")
    return int(m[1]), int(m[2]), int(m[3] or 0)


def rank_label(t: int, p: int, e: int = 0) -> str:
    """How per-rank state (RNG) is named: ``[tp=T,pp=P]``, with ``,ep=E`` for an expert-parallel
    rank other than 0 (EP rank 0's file is the one a layout without expert parallelism has: the
    two name the same rank, so that a reshard between them compares its RNG)."""
    return f"[tp={t},pp={p}" + (f",ep={e}]" if e else "]")


_ITER_DIR = re.compile(r"^iter_(\d{7})$")

_MCORE_ENUMS = [
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.AttnMaskType",
    "megatron.core.transformer.enums.AttnType",
    "megatron.core.transformer.enums.LayerType",
    "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.core.transformer.enums.CudaGraphModule",
    "megatron.core.transformer.enums.InferenceCudaGraphScope",
    "megatron.core.enums.ModelType",
    "megatron.core.enums.Fp8Recipe",
    "megatron.core.enums.Fp4Recipe",
    "megatron.core.model_parallel_config.ModelType",
    "megatron.core.rerun_state_machine.RerunMode",
    "megatron.core.rerun_state_machine.RerunState",
    "megatron.core.rerun_state_machine.RerunDiagnostic",
    "signal.Signals",
]
ALLOWLIST: dict[tuple[str, str], Any] = {
    **_unpickle.PLAIN,
    **_unpickle.TORCH_TENSORS,
    **_unpickle.numpy_arrays(),
    **_unpickle.NAMESPACES,
    **{tuple(q.rsplit(".", 1)): _unpickle.enum(q) for q in _MCORE_ENUMS},  # type: ignore[misc]
    ("megatron.core.optimizer", "OptimizerConfig"): _unpickle.record("megatron.core.optimizer.OptimizerConfig"),
    ("megatron.core.optimizer.optimizer_config", "OptimizerConfig"): _unpickle.record(
        "megatron.core.optimizer.OptimizerConfig"
    ),
}
"""Globals Megatron-LM writes into ``args``, ``rng_state`` and ``common.pt`` (megatron-core's own
``safe_globals`` list, as stand-ins; research/megatron.md §1)."""

# the Float16 optimizer's state (fp32_param), and the distributed optimizer's fully_reshardable
# model-space view of it (param)
_OPT_STATE = re.compile(r"^optimizer\.state\.(fp32_param|param|exp_avg|exp_avg_sq)\.(.+)$")
_STATE_SUFFIX = {"fp32_param": "fp32", "param": "fp32", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
# the distributed optimizer's dp_reshardable layout: one 1-D tensor per grad-buffer bucket
_BUCKET = re.compile(
    r"^(?P<chain>chained_\d+\.)?optimizer\.distributed\.dp_group_idx_(?P<g>\d+)\.gbuf_idx_(?P<i>\d+)"
    r"\.dtype_(?P<dt>.+)\.bucket_idx_(?P<b>\d+)\.(?P<key>param|exp_avg|exp_avg_sq)$"
)
BUCKET_OBJECT = re.compile(
    r"^(?:chained_(?P<c>\d+)\.)?optimizer\.distributed\.dp_group_idx_(?P<g>\d+)\.(?P<key>[^./]+)/shard_0_1$"
)
"""the ``dp_reshardable`` optimizer's ShardedObjects: its state dict without per-parameter state
(``optimizer``, ``grad_scaler``) and ``per_bucket_numel[_unpadded]``, once per model-parallel rank
(and per member ``c`` of a chain)"""
_BUCKET_SUFFIX: dict[str, tuple[str, Kind]] = {
    "param": ("fp32", "master"),
    "exp_avg": ("exp_avg", "optim"),
    "exp_avg_sq": ("exp_avg_sq", "optim"),
}
# the order megatron-core registers a transformer layer's parameters in (TransformerLayer,
# SelfAttention, MLP; TransformerEngine's fused LayerNormLinear: the norm's before the weight; an
# MoE layer's router, its routed experts (``*``: each local expert's in turn), then its shared
# experts); the grad buffer lays them out in reverse
_LAYER_ORDER = tuple(
    f"{module}.{param}"
    for module, params in (
        ("input_layernorm", ("weight", "bias")),
        ("self_attention.linear_proj", ("weight", "bias")),
        ("self_attention.linear_qkv", ("layer_norm_weight", "layer_norm_bias", "weight", "bias")),
        ("self_attention.q_layernorm", ("weight", "bias")),
        ("self_attention.k_layernorm", ("weight", "bias")),
        ("pre_mlp_layernorm", ("weight", "bias")),
        ("mlp.linear_fc1", ("layer_norm_weight", "layer_norm_bias", "weight", "bias")),
        ("mlp.linear_fc2", ("weight", "bias")),
        ("mlp.router", ("weight", "bias")),
        ("mlp.experts.local_experts.*", ("",)),
        ("mlp.shared_experts.linear_fc1", ("weight", "bias")),
        ("mlp.shared_experts.linear_fc2", ("weight", "bias")),
        ("mlp.shared_experts", ("gate_weight",)),
    )
    for param in params
)
_EXPERT_ORDER = ("linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight", "linear_fc2.bias")
"""a SequentialMLP expert's parameters, in registration order"""
_PRE_LAYERS = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
_POST_LAYERS = (
    "decoder.final_layernorm.weight",
    "decoder.final_layernorm.bias",
    "output_layer.weight",
    "output_layer.bias",
)
# local-spec norms are saved under the TransformerEngine-spec keys in torch_dist
_TE_TO_LOCAL = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}


GROUP_HYPER = ("lr", "betas", "eps")
"""the param groups' values ``extras["param_groups"]`` keeps, which diff compares: the same set of
values at any layout (how parameters fall into groups with their own weight decay, expert flags or
steps changes with the layout and the optimizer's kind)"""


GROUPS_UNREAD = "the param groups (lr, betas, eps, weight decay)"
"""the ``extras["unread_state"]`` entry of the param groups (diff, which compares their
:data:`GROUP_HYPER`, says what is left of them)"""


def _numbers(v: Any) -> list[float] | float | None:
    """A finite number, or a tuple or list of them (betas) as a list; None for anything else."""
    if type(v) in (int, float) and math.isfinite(v):
        return v
    if isinstance(v, list | tuple) and v and all(type(x) in (int, float) and math.isfinite(x) for x in v):
        return list(v)
    return None


def _note_unread(manifest: Manifest, opt: dict[str, Any], inner: dict[str, Any], stepped: bool, rel: str) -> None:
    """Record (``extras["unread_state"]``) the optimizer state of a rank file (a legacy one's, or a
    ``torch_dist`` save's ``common.pt``) that the manifest holds no items of: Megatron's writers
    carry it from the pickles, the other formats' cannot (``reshard`` and ``convert`` to them say
    it is not carried). ``stepped``: the state holds Adam's step. The steps the param groups keep
    (the distributed optimizer's, megatron-core's ``torch_dist`` ones) go to
    ``extras["group_steps"]`` (file ``rel`` -> steps), which verify compares across the files and
    with the iteration."""
    groups = inner.get("param_groups")
    steps = [g["step"] for g in groups or () if isinstance(g, dict) and type(g.get("step")) in (int, float)]
    hyper = [{k: n for k in GROUP_HYPER if (n := _numbers(g.get(k))) is not None}
             for g in groups or () if isinstance(g, dict)]  # fmt: skip
    if any(hyper):  # (what diff compares of two Megatron checkpoints' param groups, whatever their layouts)
        manifest.extras.setdefault("param_groups", {})[rel] = hyper
    if steps:
        held: dict[str, list[float]] = manifest.extras.setdefault("group_steps", {})
        held.setdefault(rel, []).extend(float(x) for x in steps)
    unread: list[str] = manifest.extras.setdefault("unread_state", [])
    found = []
    if stepped:
        found.append("Adam's step")
    if inner.get("param_groups"):
        found.append(GROUPS_UNREAD)
    if isinstance(opt.get("grad_scaler"), dict):
        found.append("the fp16 loss scaler")
    unread += [f for f in found if f not in unread]


def _saves_distrib_optim(args: Any, obj: dict[str, Any]) -> bool:
    """Whether a rank file's save wrote ``distrib_optim.pt`` beside it: Megatron-LM saves the
    distributed optimizer's state there whenever it saves the optimizer (the rank file then holds
    its param groups)."""
    return bool(getattr(args, "use_distributed_optimizer", False)) and isinstance(obj.get("optimizer"), dict | list)


def _missing_distrib_optim(rel: str, tp_rank: int) -> IncompleteCheckpointError:
    return IncompleteCheckpointError(
        f"{rel} is missing: the rank file beside it holds the distributed optimizer's param groups, so its "
        "state was saved there",
        hint="a rank did not finish saving or the file was deleted; use another iteration",
        path=rel,
        rule="missing-file",
        rank=tp_rank,
    )


def _untracked_iterations(path: Path) -> list[str]:
    """The Megatron iteration directories (``iter_NNNNNNN`` or ``release`` holding ``mp_rank_*``
    directories or a torch_dist ``metadata.json``) just below ``path``, oldest first: a save
    directory that lost its tracker."""
    try:  # (scandir: a folder's type from the listing)
        with os.scandir(path) as entries:
            folders = sorted(e.name for e in entries if e.is_dir(follow_symlinks=False))
    except OSError:
        return []
    found = []
    for name in folders:
        if not (_ITER_DIR.match(name) or name == "release"):
            continue
        it = path / name
        if (it / "metadata.json").is_file() or any(_MP_DIR.match(p.name) for p in it.iterdir() if p.is_dir()):
            found.append(name)
    return sorted(found, key=lambda n: (n == "release", n))


def _read_tracker(root: Path) -> Path:
    """The iteration directory a save directory's tracker file names."""
    text = read_tracker(root, TRACKER)
    if text == "release":
        target = root / "release"
    elif text.isdigit():
        target = root / f"iter_{int(text):07d}"
    else:
        raise CorruptFileError(
            f"{TRACKER}: expected an iteration number or 'release', found {text[:40]!r}", path=TRACKER
        )
    confine(root, target.name, named_by=TRACKER)  # an iteration folder linked out of the save directory
    if not target.is_dir():
        raise IncompleteCheckpointError(
            f"{TRACKER} names iteration {text} but {target.name}/ does not exist",
            hint="the save was interrupted or the directory was deleted; list the iter_* directories and pass one",
            path=TRACKER,
        )
    return target


_MISPLACED_HINT = (
    "a rank's file was copied or moved into another rank's directory: restore each rank directory's files from the save"
)


def _misplaced_ranks(
    dirs: dict[str, tuple[tuple[int, int, int], Any]], args: Any, trained: bool
) -> list[dict[str, str]]:
    """Rank directories whose file another rank saved: each file's ``args.rank`` is the global rank
    that wrote it, and megatron-core's rank layout says which rank saves each directory
    (:func:`saving_ranks`). A file copied or renamed into another rank's place reads as a valid
    checkpoint with the wrong rank's tensors; this names it. Nothing is said where the layout
    cannot be replayed (no world size in the args, a layout megatron-core would refuse), nor where
    every file records one rank and none holds training state (``trained``: optimizer or RNG
    state, which only the training ranks save): Megatron-LM's tools/checkpoint saver writes every
    file from one process."""
    sizes = _rank_sizes(args)
    try:
        savers = saving_ranks(**sizes)
    except (ValueError, ZeroDivisionError):
        return []
    pp, ep = sizes["pp"], sizes["ep"]
    saves = {s.rank: key for key, s in savers.items()}
    recorded = {getattr(own, "rank", None) for _, own in dirs.values()}
    if len(recorded) < 2 and not trained:
        return []  # one process wrote every file (Megatron-LM's tools/checkpoint saver: rank 0 in all)
    out = []
    for rel, (rank, own) in dirs.items():
        found = getattr(own, "rank", None)
        want = savers.get(rank)
        if not isinstance(found, int) or isinstance(found, bool) or want is None or found == want.rank:
            continue
        where = saves.get(found)
        if where is None or where not in {r for r, _ in dirs.values()}:
            continue  # not another directory's saver here (a CP rank of an older save, say): no evidence
        whose = f"which saves {rank_dir(where[0], where[1], pp, where[2], ep)}"
        out.append(
            {
                "rule": "misplaced-file",
                "file": f"{rel}/model_optim_rng.pt",
                "message": f"{rel}/model_optim_rng.pt was saved by rank {found} ({whose}); "
                f"{rel} is rank {want.rank}'s under the args' layout",
                "hint": _MISPLACED_HINT,
            }
        )
    return out


def _describe_bytes(path: Path) -> str:
    """A few words on what a small file that should be JSON holds."""
    if outside(path.parent, path) is not None:
        return "a link out of the checkpoint (not read)"
    try:
        with open_regular(path, path.name) as fh:
            data = fh.read(1 << 20)
    except OSError as exc:
        return f"an unreadable file ({exc.strerror})"
    except IncompleteCheckpointError as exc:  # (what stands there: "a FIFO (named pipe) stands at that path, …")
        return exc.message.removeprefix(f"{path.name}: ")
    if not data:
        return "an empty file"
    if len(data) == 1 << 20:
        return "over 1 MiB, not what megatron-core writes"
    try:
        json.loads(data)
    except (ValueError, RecursionError) as exc:
        return f"bytes that are not JSON ({exc})"
    return "JSON without sharded_backend 'torch_dist'"


def _step_claims(files: dict[str, Any], it_dir: str, tracked: bool) -> dict[str, int]:
    """The iteration each file records, with the iteration directory's name (``iter_NNNNNNN/``)
    and, when the save directory was given, its tracker's as claims of their own: verify names the
    files whose step disagrees with the rest (a rank file left from another save)."""
    claims = {rel: v for rel, v in files.items() if isinstance(v, int) and not isinstance(v, bool)}
    if claims and (m := _ITER_DIR.match(it_dir)) is not None:
        claims[f"{it_dir}/"] = int(m.group(1))
        if tracked:
            claims[TRACKER] = int(m.group(1))  # (it named this directory)
    return claims


def _claimed_step(claims: dict[str, int], it_dir: str, fallback: Any) -> int | None:
    """The step most ``claims`` give; where they split evenly (verify then reports no majority),
    the iteration directory's, the one the path names."""
    steps = list(claims.values())
    if not steps:
        return fallback if isinstance(fallback, int) else None
    most = max(steps.count(v) for v in steps)
    tied = {v for v in steps if steps.count(v) == most}
    if len(tied) > 1 and claims.get(f"{it_dir}/") in tied:
        return claims[f"{it_dir}/"]
    return max(steps, key=steps.count)


def _int_arg(args: Any, name: str, default: int = 1) -> int:
    """``args.<name>`` when it is a positive int, else ``default``."""
    v = getattr(args, name, None)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else default


def _args_layout(args: Any) -> Layout:
    def get(name: str) -> int | None:
        return _int_arg(args, name, 0) or None

    tp, pp = get("tensor_model_parallel_size"), get("pipeline_model_parallel_size")
    world = get("world_size")
    dp = get("data_parallel_size") or (world // (tp * pp) if world and tp and pp else None)
    return Layout(
        world_size=world,
        tp=tp,
        pp=pp,
        dp=dp,
        ep=get("expert_model_parallel_size"),
        vpp=get("virtual_pipeline_model_parallel_size"),
    )


def _data_position(manifest: Manifest, args: Any) -> None:
    """Megatron-LM resumes its data sampler from ``args.consumed_train_samples`` (``load_checkpoint``
    takes it from the checkpoint's args): the dataloader's place, held in the metadata (not an item)."""
    consumed = getattr(args, "consumed_train_samples", None)
    if isinstance(consumed, int) and not isinstance(consumed, bool) and consumed >= 0:
        manifest.extras.setdefault("state_in_metadata", {})["dataloader"] = f"args.consumed_train_samples ({consumed})"


def _args_extras(args: Any) -> dict[str, Any]:
    keep = (
        "num_layers",
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "kv_channels",
        "padded_vocab_size",
        "swiglu",
        "group_query_attention",
        "normalization",
        "transformer_impl",
        "untie_embeddings_and_output_weights",
        "use_distributed_optimizer",
        "bf16",
        "fp16",
        "params_dtype",
        "num_experts",
        "ckpt_format",
        "decoder_first_pipeline_num_layers",
        "decoder_last_pipeline_num_layers",
        "account_for_embedding_in_pipeline_split",
        "account_for_loss_in_pipeline_split",
        "pipeline_model_parallel_layout",
    )
    out = {}
    for k in keep:
        if hasattr(args, k):
            out[k] = (
                plain_value(getattr(args, k))
                if not isinstance(getattr(args, k), _unpickle.EnumValue)
                else str(getattr(args, k))
            )
    return out


_COMMON_MISSING = (
    "common.pt is missing: megatron-core saves the iteration, args, optimizer param groups, scheduler and RNG "
    "there, and its load stops without it"
)
_COMMON_HINT = "the save was interrupted or the file deleted; use another iteration"


def _common_damage(it_dir: Path) -> list[CkptError]:
    """``common.pt`` of a torch_dist save, missing or not reading (read as far as to know it reads)."""
    if not (it_dir / "common.pt").is_file():
        return [IncompleteCheckpointError(_COMMON_MISSING, hint=_COMMON_HINT, path="common.pt", rule="missing-file")]
    damaged: list[CkptError] = []
    if (loaded := _pt.load_or_note(it_dir, "common.pt", ALLOWLIST, damaged)) is not None:
        loaded[0].close()
    return damaged


def _dist_damage(it_dir: Path) -> list[CkptError]:
    """The damage of a torch_dist save's other files (its DCP files, ``common.pt``), where its
    ``metadata.json`` does not read: named with it, not after it is mended."""
    try:
        DcpAdapter(object_allow=ALLOWLIST).describe(it_dir)
    except (CorruptFileError, IncompleteCheckpointError) as exc:
        return [exc, *_common_damage(it_dir)]
    except CkptError:
        return []
    return _common_damage(it_dir)


class MegatronDistAdapter:
    """``torch_dist``: ``metadata.json`` + ``common.pt`` + DCP files, read through the dcp adapter."""

    name = "megatron-dist"

    def detect(self, path: Path) -> Detection:
        target = self._iter_dir(path)
        if target is None:
            return Detection(False, "no metadata.json (torch_dist) here or in the tracker's iteration")
        return Detection(True, f"found {target.name}/metadata.json")

    @staticmethod
    def _iter_dir(path: Path) -> Path | None:
        if not path.is_dir():
            return None
        if is_dist_config(path / "metadata.json"):
            return path
        if (path / TRACKER).is_file():
            try:
                target = _read_tracker(path)
            except (CorruptFileError, IncompleteCheckpointError, PathEscapeError, OSError):
                return None  # (a tracker linked out: the legacy adapter claims it, and refuses it by name)
            return target if is_dist_config(target / "metadata.json") else None
        return None

    def describe(self, path: Path) -> Manifest:
        tracked = (path / TRACKER).is_file() and not (path / "metadata.json").is_file()
        if not tracked:
            return self._describe(path, tracked)
        path = _read_tracker(path)
        try:
            return self._describe(path, tracked)
        except CkptError as exc:  # its files named from the save directory given, as the iteration is not said
            name_from_above([exc], path)
            raise

    def _describe(self, path: Path, tracked: bool) -> Manifest:
        try:
            config = json.loads(Path(confine(path, "metadata.json", named_by="the listing")).read_text())
        except (OSError, ValueError, RecursionError) as exc:
            raise CorruptFileError(f"metadata.json: not readable JSON ({exc})", path="metadata.json") from None
        backend = config.get("sharded_backend") if isinstance(config, dict) else None
        if backend != "torch_dist":
            raise CorruptFileError(
                f"metadata.json: sharded_backend is {backend!r}; ckpttool reads 'torch_dist' only",
                hint="re-save with --ckpt-format torch_dist",
                path="metadata.json",
            )
        try:
            base = DcpAdapter(object_allow=ALLOWLIST).describe(path)
        except CkptError as exc:
            damaged: list[CkptError] = [exc]
            if isinstance(exc, CorruptFileError | IncompleteCheckpointError):  # common.pt's damage named too
                damaged += _common_damage(path)
            raise_together(damaged)
            raise
        manifest = Manifest(
            root=str(path),
            format=self.name,
            format_version=str(config.get("sharded_backend_version")),
            files=base.files,
        )
        common: dict[str, Any] = {}
        if (path / "common.pt").is_file():
            archive, common, _ = _pt.load(path, "common.pt", ALLOWLIST)
            archive.close()
        for f in manifest.files:
            if f.path in ("metadata.json", "common.pt"):
                f.role = "metadata"
        if isinstance(common.get("optimizer"), dict):  # (megatron-core's: {"optimizer": {state, param_groups}})
            opt = common["optimizer"]
            inner = opt.get("optimizer") if isinstance(opt.get("optimizer"), dict) else opt
            state = inner.get("state") if isinstance(inner.get("state"), dict) else {}
            _note_unread(manifest, opt, inner, "common_step" in state, "common.pt")
        args = common.get("args")
        num_layers = getattr(args, "num_layers", None)
        num_experts = getattr(args, "num_experts", None)
        local_spec = getattr(args, "transformer_impl", None) == "local"
        for item in base.items.values():
            for named in _named(item, num_layers, num_experts, local_spec):
                manifest.add(named)
        for key in ("iteration", "checkpoint_version", "num_floating_point_operations_so_far"):
            if key in common:
                counter = Item(
                    name=key,
                    kind="counter" if key == "iteration" else "object",
                    pieces=[_pt.object_piece("common.pt", key)],
                )
                set_value(counter, common[key])
                manifest.add(counter)
        _add_unknown_keys(manifest, common, "common.pt", _COMMON_KEYS, tensors=False)
        if isinstance(common.get("opt_param_scheduler"), dict):
            for k, v in common["opt_param_scheduler"].items():
                scheduler = Item(
                    name=f"opt_param_scheduler.{k}",
                    kind="scheduler",
                    pieces=[_pt.object_piece("common.pt", f"opt_param_scheduler.{k}")],
                )
                set_value(scheduler, v)
                manifest.add(scheduler)
        it = common.get("iteration")
        # common.pt's iteration, the directory's name and the tracker that named it (given the save
        # directory): the step most of them give
        claims = _step_claims({"common.pt": it} if common else {}, path.name, tracked)
        manifest.extras["step_claims"] = claims
        manifest.step = _claimed_step(claims, path.name, it)
        # (what the DCP reader found: a data file with bytes added after its records)
        findings: list[dict[str, Any]] = list(base.extras.get("findings") or ())
        if not common and not any(n in manifest.items for n in ("iteration", "args")):
            findings.append(
                {
                    "rule": "missing-file",
                    "file": "common.pt",
                    "message": _COMMON_MISSING,
                    "hint": _COMMON_HINT,
                }
            )
        if findings:
            manifest.extras["findings"] = findings
        manifest.layout = _args_layout(args) if args is not None else base.layout
        content = common.get("content_metadata")
        sharding = content.get("distrib_optim_sharding_type") if isinstance(content, dict) else None
        if isinstance(sharding, str):
            manifest.extras["distrib_optim_sharding_type"] = sharding
        if any(_BUCKET.match(name) for name in manifest.items):
            problem = _debucket_dist(manifest, args)
            manifest.extras["distrib_optim"] = (
                f"kept as the distributed optimizer's buckets: {problem}"
                if problem
                else "de-bucketed from the dp_reshardable buckets by replaying the grad-buffer layout"
            )
        if args is not None:
            manifest.extras["args"] = _args_extras(args)
            _data_position(manifest, args)
            # a dp_reshardable save's buckets hold the MTP chunk's copy's optimizer state, read as a replica
            if (notes := _unsynced_copies(args, manifest.layout.pp or 1)) is not None:
                manifest.extras["copy_notes"] = notes
        manifest.extras["dcp"] = {"world_size": base.layout.world_size}
        if _ITER_DIR.match(path.name) or path.name == "release":
            manifest.extras["iteration_dir"] = path.name
        return manifest

    misplaced = staticmethod(misplaced_in)
    """its DCP files whose records did not read because they hold another file's (verify asks)"""

    @staticmethod
    def record_owners(root: Path) -> dict[str, dict[int, str]]:
        """For verify where describe stopped (a data file missing or cut): each DCP file's records by
        the byte they start at, with the item each holds, named as describe names it (a layer's own
        ``decoder.layers.3.…``, not megatron-core's stacked key), so that a damaged record is named as
        the described checkpoint names its item. Paths from ``root`` (the save directory given, with
        its tracker, or the iteration's)."""
        it_dir = MegatronDistAdapter._iter_dir(root)
        if it_dir is None:
            return {}
        prefix = "" if it_dir == root else f"{it_dir.name}/"
        args = None
        with contextlib.suppress(CkptError):  # (without common.pt's args: megatron-core's own keys)
            archive, common, _ = _pt.load(it_dir, "common.pt", ALLOWLIST)
            archive.close()
            args = common.get("args") if isinstance(common, dict) else None
        num_layers, num_experts = getattr(args, "num_layers", None), getattr(args, "num_experts", None)
        local_spec = getattr(args, "transformer_impl", None) == "local"
        out: dict[str, dict[int, str]] = {}
        for md, key, info in dcp_records(it_dir):
            names = [
                n.name for n in _named(_record_item(md, key, info), num_layers, num_experts, local_spec) if n.pieces
            ]
            # (one item's record only: a distributed optimizer's bucket holds many parameters' ranges,
            # which describe assigns from the whole grad-buffer layout, not from one record)
            if len(names) == 1 and not _BUCKET.match(names[0]):
                out.setdefault(prefix + info.relative_path, {})[info.offset] = names[0]
        return out

    def reader(self, manifest: Manifest) -> MegatronDistReader:
        return MegatronDistReader(manifest)


def _debucket_dist(manifest: Manifest, args: Any) -> str | None:
    """Place the distributed optimizer's ``dp_reshardable`` state (one 1-D tensor per grad-buffer
    bucket and state, ``[chained_<c>.]optimizer.distributed.dp_group_idx_<g>.gbuf_idx_<i>.dtype_<dt>
    .bucket_idx_<b>.<param|exp_avg|exp_avg_sq>``, cut between the DP ranks) parameter by parameter,
    as ``<param>.fp32`` / ``.exp_avg`` / ``.exp_avg_sq``. Under expert parallelism megatron-core
    chains two optimizers: ``chained_0`` over the dense parameters, whose ``g`` is the rank in the
    TP x PP group (``g = p * TP + t``), and ``chained_1`` over the routed experts, whose ``g`` is the
    rank in the expert TP x EP x PP group (``g = (p * EP + e) * ETP + t``). Grad buffer ``i`` is the
    ``i``-th model chunk with parameters of that optimizer, and its layout is replayed as for
    ``distrib_optim.pt`` (:func:`grad_buffer_layout`), the buckets one after the other.
    megatron-core saves each parameter (and each gap) as a chunk of its own, so every parameter must
    start and end on a chunk boundary: a replay that disagrees is not used. Returns None once placed
    (the bucket items replaced), else why the buckets were kept as they are."""
    buckets: dict[tuple[int | None, int, int], dict[int, dict[str, Item]]] = {}  # (chain, g, i) -> b -> key
    dtypes: dict[tuple[int | None, int, int], set[str]] = {}
    for name, item in manifest.items.items():
        if (m := _BUCKET.match(name)) is not None:
            c = int(m["chain"][len("chained_") : -1]) if m["chain"] else None
            buffer = buckets.setdefault((c, int(m["g"]), int(m["i"])), {})
            buffer.setdefault(int(m["b"]), {})[m["key"]] = item
            dtypes.setdefault((c, int(m["g"]), int(m["i"])), set()).add(m["dt"])
    several = sorted((k for k, v in dtypes.items() if len(v) > 1), key=repr)
    if several:
        c, g, i = several[0]
        chain = "" if c is None else f"chained_{c}."
        return f"{chain}dp_group_idx_{g} grad buffer {i} has buckets of several dtypes, not replayed yet"
    if args is None:
        return "common.pt has no args to replay the layout with"
    chains = {c for c, _, _ in buckets}
    if chains - {None, 0, 1} or (None in chains and len(chains) > 1):
        return f"a chain of optimizers {sorted(map(str, chains))} other than megatron-core's dense and expert pair"
    experts = _int_arg(args, "num_experts", 0)
    chained = chains != {None}
    if chained and not experts:
        return "a chain of distributed optimizers in a model without routed experts, not replayed yet"
    tp = _int_arg(args, "tensor_model_parallel_size")
    pp = _int_arg(args, "pipeline_model_parallel_size")
    ep = _int_arg(args, "expert_model_parallel_size") if experts else 1
    etp = (own_etp(args) or tp) if experts else tp
    if experts % ep:
        return f"{experts} experts do not split over EP={ep}"
    gated = bool(getattr(args, "swiglu", False) or getattr(args, "gated_linear_unit", False))
    try:
        chunks = placement(args)
    except ValueError as exc:
        return f"the args' pipeline placement is not followed ({exc})"
    params = {n: i for n, i in manifest.items.items() if i.kind == "param" and i.is_tensor and i.shape is not None}
    unknown = sorted(
        n
        for n in params
        if not (n in _PRE_LAYERS or n in _POST_LAYERS or _layer_slot(n) is not None or _mtp_slot(n) is not None)
    )
    if unknown:
        return f"parameters whose registration order ckpttool does not know: {', '.join(unknown[:4])}"
    tied = not getattr(args, "untie_embeddings_and_output_weights", False) and pp > 1
    mtp = sorted((at, n) for n in params if (at := _mtp_slot(n)) is not None)
    layers = sum(n for chunk in chunks for _, n in chunk)
    mtp_at = mtp_chunk(getattr(args, "pipeline_model_parallel_layout", None) or None, pp, len(chunks[0]))
    if mtp and tied:
        # no real save to replay against: megatron-core 0.16.1 cannot write one (MTP layers in the
        # last chunk: its sharded_state_dict asserts on the unused output layer; in a stage of their
        # own: the save fails its DCP plan check, the MTP stage's chunks overrunning the bucket)
        return (
            "multi-token prediction layers with tied embeddings at PP > 1, which megatron-core 0.16.1 "
            "cannot save as dp_reshardable itself, so no layout of its own to replay"
        )
    if mtp and "embedding.position_embeddings.weight" in params:
        return "multi-token prediction layers with position embeddings, not replayed yet"
    local = experts // ep

    def on_rank(n: str, e: int) -> bool:
        """Whether EP rank ``e`` holds ``n`` (the dense parameters: every rank)."""
        return (j := expert_of(n)) is None or e * local <= j < (e + 1) * local

    by_layer: dict[int, list[tuple[tuple[int, int, int], str]]] = {}  # each layer's parameters, in order
    for n in params:
        if (slot := _layer_slot(n)) is not None:
            by_layer.setdefault(int(_LAYER.match(n)["i"]), []).append((slot, n))  # type: ignore[index]
    for found in by_layer.values():
        found.sort()

    def chunk_orders(p: int, e: int) -> list[list[str]]:
        """The parameter names of each model chunk of stage ``p`` on EP rank ``e``, in registration order."""
        orders: list[list[str]] = []
        for v, (first, count) in enumerate(chunks[p]):
            names: list[str] = []
            if (p, v) == (0, 0):
                names += [n for n in _PRE_LAYERS if n in params]
            for layer in range(first, first + count):
                names += [n for _, n in by_layer.get(layer, ()) if on_rank(n, e)]
            # the final norm: in the last chunk, or with MTP layers the last decoder layer's
            # (TransformerBlock.has_final_layernorm_in_this_stage), which a layout may put before it
            if (first <= layers - 1 < first + count) if mtp else (p, v) == (pp - 1, len(chunks[p]) - 1):
                names += [n for n in _POST_LAYERS[:2] if n in params]
            if mtp and (p, v) == mtp_at:
                if (p, v) != (0, 0):  # the MTP stage's copy of the word embeddings, registered first
                    names.insert(0, "embedding.word_embeddings.weight")
                names += [n for _, n in mtp if on_rank(n, e)]  # the MTP block, between the decoder and the output layer
            if (p, v) == (pp - 1, len(chunks[p]) - 1):
                names += [n for n in _POST_LAYERS[2:] if n in params]
                if tied and "embedding.word_embeddings.weight" in params:
                    names.append("output_layer.weight")  # the last stage's copy of the tied embedding
            orders.append(names)
        return orders

    def split(name: str, t: int) -> tuple[int, int]:
        """(TP rank, ways) of ``name`` on a rank: the experts by ETP, the rest by TP."""
        return (t, etp) if is_expert(name) else (t, tp)

    def numel(name: str, t: int) -> int:
        """Elements of ``name`` on a rank of TP (or ETP) rank ``t`` (the splits are even: any rank's count)."""
        t, ways = split(name, t)
        return _local_numel(params, name, t % ways, ways, gated)

    replicas = ReplicaCounter()
    indexes: dict[str, tuple[list[int], list[Piece]]] = {}  # bucket item -> its chunks, sorted
    made: dict[str, Item] = {}  # the per-parameter items, added to the manifest at the end
    for (c, g, i), buffer in sorted(buckets.items(), key=lambda kv: (kv[0][0] or 0, kv[0][1], kv[0][2])):
        group = f"{'' if c is None else f'chained_{c}.'}dp_group_idx_{g}"
        if c == 1:  # the experts' optimizer: rank in the expert TP x EP x PP group
            t, e, p = g % etp, g // etp % ep, g // (etp * ep)
        else:
            t, e, p = g % tp, 0, g // tp
        if p >= pp:
            return f"{group} is outside the {'expert ' if c == 1 else ''}model-parallel group"
        names = chunk_orders(p, e)
        # every parameter of the rank counts towards its bucket size (Megatron-LM's get_model)
        total = sum(numel(n, t) for order in names for n in order)
        mine = [[n for n in order if c is None or is_expert(n) == (c == 1)] for order in names]
        orders: list[list[tuple[str, tuple[int, ...]]]] = [[(n, (numel(n, t),)) for n in order] for order in mine]
        held = [(v, order) for v, order in enumerate(orders) if order]
        if i >= len(held) or sorted(buffer) != list(range(len(buffer))):
            return f"{group} has grad buffer {i} and buckets {sorted(buffer)}, not what its stage holds"
        v, order = held[i]
        layout, end = chunk_buffer_layout(args, order, (p, pp, v, len(orders)), total)
        sizes = []
        for b in range(len(buffer)):
            states = buffer[b]
            lengths = {it.shape for it in states.values()}
            if set(states) != set(_BUCKET_SUFFIX) or len(lengths) != 1 or any(len(x or ()) != 1 for x in lengths):
                return f"bucket {b} of {group} grad buffer {i} does not hold param, exp_avg and exp_avg_sq alike"
            sizes.append(next(iter(lengths))[0])  # type: ignore[index]
        if sum(sizes) != end:
            return (
                f"replaying the grad-buffer layout of {group} buffer {i} gives {end} elements, "
                f"its buckets hold {sum(sizes)}"
            )
        starts = [sum(sizes[:b]) for b in range(len(sizes))]
        for name, (count,), offset in layout:
            b = max(k for k, s0 in enumerate(starts) if s0 <= offset)
            lo = offset - starts[b]
            if lo + count > sizes[b]:
                return f"{name} would cross the end of bucket {b} of {group}"
            target = "embedding.word_embeddings.weight" if tied and name == "output_layer.weight" and p else name
            shape = params[target].shape
            assert shape is not None
            regions = tp_regions(shape, *split_rule(target, gated=gated), *split(target, t))
            for key, (suffix, kind) in _BUCKET_SUFFIX.items():
                src = buffer[b][key]
                if src.name not in indexes:
                    ranked = sorted((pc for pc in src.pieces if pc.replica == 0), key=lambda pc: pc.box.offsets[0])
                    indexes[src.name] = ([pc.box.offsets[0] for pc in ranked], ranked)
                pieces = _bucket_pieces(src, indexes[src.name], lo, lo + count, regions)
                if pieces is None:
                    return (
                        f"{name} does not start and end on chunk boundaries of {src.name}: the replayed layout is "
                        "not the saved one"
                    )
                state = made.get(f"{target}.{suffix}")
                if state is None:
                    state = Item(name=f"{target}.{suffix}", kind=kind, dtype=src.dtype, shape=shape)
                    made[state.name] = state
                for piece in pieces:
                    piece.replica = replicas.next(state.name, (piece.box, piece.flat))
                    state.pieces.append(piece)
    taken = [n for n in made if n in manifest.items]
    if taken:
        return f"{taken[0]} is in the checkpoint already"
    for name in [n for n in manifest.items if _BUCKET.match(n)]:
        del manifest.items[name]
    manifest.items.update(made)  # only once every buffer is placed: a failed replay leaves nothing behind
    return None


def _layer_slot(name: str) -> tuple[int, int, int] | None:
    """Where a decoder layer's parameter comes in its layer's registration order (:data:`_LAYER_ORDER`;
    a routed expert's by its number, then :data:`_EXPERT_ORDER`), or None for one ckpttool does not place."""
    m = _LAYER.match(name)
    if m is None or m["pre"] != "decoder.layers.":
        return None
    rest = m["rest"][1:]
    if rest in _LAYER_ORDER:
        return _LAYER_ORDER.index(rest), 0, 0
    slot = expert_slot(rest)
    if slot is None or slot[2]:  # grouped-GEMM experts: not placed
        return None
    pattern, j, _ = slot
    head, _, tail = pattern.partition("*.")
    if f"{head}*." not in _LAYER_ORDER or tail not in _EXPERT_ORDER:
        return None
    return _LAYER_ORDER.index(f"{head}*."), j, _EXPERT_ORDER.index(tail)


_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.(.*)$")
_MTP_OWN = ("enorm.weight", "enorm.bias", "hnorm.weight", "hnorm.bias", "eh_proj.weight", "eh_proj.bias")


def _mtp_slot(name: str) -> tuple[int, int, tuple[int, int, int]] | None:
    """Where a multi-token prediction layer's parameter comes in megatron-core's registration order
    (MultiTokenPredictionLayer: enorm, hnorm, eh_proj, its transformer layer, final_layernorm), or None
    for one that is not, or that ckpttool does not place."""
    m = _MTP_LAYER.match(name)
    if m is None:
        return None
    k, rest = int(m[1]), m[2]
    if rest in _MTP_OWN:
        return k, 0, (_MTP_OWN.index(rest), 0, 0)
    if rest.startswith("transformer_layer."):
        slot = _layer_slot("decoder.layers.0." + rest[len("transformer_layer.") :])
        return None if slot is None else (k, 1, slot)
    if rest in ("final_layernorm.weight", "final_layernorm.bias"):
        return k, 2, (int(rest.endswith("bias")), 0, 0)
    return None


def _local_numel(params: dict[str, Item], name: str, t: int, tp: int, gated: bool) -> int:
    """Elements of ``name`` TP rank ``t`` holds (the tied output layer: the embedding's)."""
    item = params.get(name) or params["embedding.word_embeddings.weight"]
    assert item.shape is not None
    rule, dim = split_rule(name, gated=gated)
    return sum(box.volume for box in tp_regions(item.shape, rule, dim, t, tp))


def _bucket_pieces(
    src: Item, index: tuple[list[int], list[Piece]], lo: int, hi: int, boxes: list[Box]
) -> list[Piece] | None:
    """Pieces for the elements ``[lo, hi)`` of bucket item ``src`` (``index``: its first copies'
    starts and pieces, sorted): one TP rank's local tensor, whose values fill ``boxes`` one after
    the other. None unless the chunks there lie wholly inside ``[lo, hi)`` and tile it."""
    starts, sorted_pieces = index
    k = max(bisect.bisect_right(starts, lo) - 1, 0)
    chunks = []
    while k < len(starts) and starts[k] < hi:
        if starts[k] + sorted_pieces[k].box.sizes[0] > lo:
            chunks.append(sorted_pieces[k])
        k += 1
    pos = lo
    for c in chunks:
        if c.box.offsets[0] != pos or "transforms" in c.locator:
            return None
        pos += c.box.sizes[0]
    if pos != hi:
        return None
    itemsize = lookup_dtype(src.dtype or "float32").itemsize
    out = []
    start = lo
    for box in boxes:
        end = start + box.volume
        for c in chunks:
            c_lo, c_hi = c.box.offsets[0], c.box.offsets[0] + c.box.sizes[0]
            a, z = max(start, c_lo), min(end, c_hi)
            if a >= z:
                continue
            whole = (a, z) == (start, end)
            out.append(
                Piece(
                    file=c.file,
                    locator={**c.locator, "chunk_sizes": [c.box.sizes[0]], "range": [a - c_lo, z - c_lo]},
                    box=box,
                    flat=None if whole else (a - start, z - a),
                    rank=c.rank,
                    nbytes=(z - a) * itemsize,
                )
            )
        start = end
    return out


class MegatronDistReader(DcpReader):
    def __init__(self, manifest: Manifest) -> None:
        super().__init__(manifest, ALLOWLIST)
        self._pt = _pt.PtReader(manifest, ALLOWLIST)

    @property
    def pt(self) -> _pt.PtReader:
        """The reader of ``common.pt`` (a torch.save file)."""
        return self._pt

    def read_object(self, item: Item) -> Any:
        if item.pieces and item.pieces[0].file == "common.pt":
            return self._pt.read_object(item)
        return super().read_object(item)

    def read_in_object(self, item: Item, ref: _unpickle.TensorRef) -> Any:
        if item.pieces and item.pieces[0].file == "common.pt":
            return self._pt.read_in_object(item, ref)
        return super().read_in_object(item, ref)

    def archive_of(self, piece: Piece) -> Any:
        """``common.pt``'s archive for its pieces (a value there may hold tensors), else the DCP
        record's."""
        return self._pt.archive(piece.file) if piece.file == "common.pt" else super().archive_of(piece)

    def close(self) -> None:
        self._pt.close()
        super().close()


def _named(item: Item, num_layers: Any, num_experts: Any, local_spec: bool) -> list[Item]:
    """A torch_dist (DCP) item as the items ckpttool names: megatron-core's stacked layers and
    experts one item each, TransformerEngine and optimizer names as the legacy reader gives them."""
    out = []
    for renamed in _split_layers(item, num_layers):
        _rename(renamed, local_spec)
        out += _split_experts(renamed, num_experts)
    return out


def _record_item(md: Any, key: Any, info: Any) -> Item:
    """The item a DCP record holds, as far as its metadata says: the tensor with the one piece
    the record stores (its chunk's box), or the object."""
    meta = md.state_dict_metadata.get(key.fqn)
    size, at = tuple(getattr(meta, "size", None) or ()), tuple(getattr(key, "offset", None) or ())
    box = next(
        (
            Box(at, sizes)
            for chunk in getattr(meta, "chunks", None) or ()
            if tuple(getattr(chunk, "offsets", ())) == at
            and len(sizes := tuple(getattr(chunk, "sizes", ()))) == len(at) == len(size)
            and all(type(n) is int for n in (*size, *at, *sizes))
        ),
        None,
    )
    if box is None or not box.within(size):  # (an object, or metadata that does not say: its own key)
        return Item(name=key.fqn, kind="object", pieces=[Piece(file=info.relative_path, locator={}, box=Box((), ()))])
    dtype = str(getattr(getattr(meta, "properties", None), "dtype", ""))
    return Item(
        name=key.fqn,
        kind=classify(key.fqn, is_tensor=True),
        dtype=dtype if dtype in BY_NAME else "torch.uint8",
        shape=size,
        pieces=[Piece(file=info.relative_path, locator={}, box=box)],
    )


def _split_layers(item: Item, num_layers: Any) -> list[Item]:
    """One item per layer for Megatron's stacked ``decoder.layers.<name>`` tensors (the layer
    index is a prepended global axis in torch_dist)."""
    name = item.name
    m = _OPT_STATE.match(name)
    param = m.group(2) if m else name
    stacked = (
        param.startswith("decoder.layers.")
        and not param.split(".")[2].isdigit()
        and item.shape
        and isinstance(num_layers, int)
        and item.shape[0] == num_layers
    )
    if not stacked or item.shape is None or item.dtype is None:
        return [item]
    out = []
    for layer in range(item.shape[0]):
        rest = param[len("decoder.layers.") :]
        layer_param = f"decoder.layers.{layer}.{rest}"
        new_name = f"optimizer.state.{m.group(1)}.{layer_param}" if m else layer_param
        out.append(_leading_index(item, layer, new_name, lambda p, k: {"select0": k, "chunk_sizes": list(p.box.sizes)}))
    return out


def _leading_index(item: Item, index: int, name: str, select: Callable[[Piece, int], dict[str, Any]]) -> Item:
    """``item[index]`` (one index of its leading axis) as an item of its own, named ``name``: each
    piece holding that index, its box without the axis, its locator updated by ``select(piece, k)``
    to read index ``k`` of the stored chunk."""
    assert item.shape is not None and item.dtype is not None
    itemsize = lookup_dtype(item.dtype).itemsize
    pieces = []
    for p in item.pieces:
        lo, n = p.box.offsets[0], p.box.sizes[0]
        if not lo <= index < lo + n:
            continue
        sub = Box(p.box.offsets[1:], p.box.sizes[1:])
        pieces.append(
            Piece(
                file=p.file,
                locator={**p.locator, **select(p, index - lo)},
                box=sub,
                replica=p.replica,
                rank=p.rank,
                nbytes=sub.volume * itemsize,
            )
        )
    saved_in = item.saved_in or item.name
    return Item(name=name, kind=item.kind, dtype=item.dtype, shape=item.shape[1:], pieces=pieces, saved_in=saved_in)


_STACKED_EXPERTS = re.compile(
    r"^(?P<pre>(?P<layer>decoder\.layers\.\d+|mtp\.layers\.\d+\.transformer_layer)\.mlp\.experts\.)experts\.(?P<rest>.+)$"
)


def _split_experts(item: Item, num_experts: Any) -> list[Item]:
    """One item per routed expert for torch_dist's ``….mlp.experts.experts.<name>`` tensors (the
    global expert number is a prepended axis: after the layer's for the decoder's stacked layers,
    the first one for a multi-token prediction layer's), named as the legacy reader names them:
    ``….mlp.experts.local_experts.<global j>.<name>``."""
    m = _STACKED_EXPERTS.match(item.name)
    stacked = m is not None and m["layer"].startswith("decoder.")  # (split by layer first: select0 is the layer)
    if (
        m is None
        or not isinstance(num_experts, int)
        or not item.shape
        or item.shape[0] != num_experts
        or item.dtype is None
        or any(("select0" in p.locator) != stacked for p in item.pieces)
    ):
        return [item]

    def select(p: Piece, k: int) -> dict[str, Any]:
        if stacked:  # the layer's index, then the expert's
            return {"select0": [p.locator["select0"], k]}
        return {"select0": k, "chunk_sizes": list(p.box.sizes)}

    return [_leading_index(item, j, f"{m['pre']}local_experts.{j}.{m['rest']}", select) for j in range(num_experts)]


def _rename(item: Item, local_spec: bool) -> None:
    m = _OPT_STATE.match(item.name)
    param = m.group(2) if m else item.name
    if local_spec:
        for te, local in _TE_TO_LOCAL.items():
            if param.endswith("." + te):
                param = param[: -len(te)] + local
    if m:
        suffix = _STATE_SUFFIX[m.group(1)]
        item.name = f"{param}.{suffix}"
        item.kind = "master" if suffix == "fp32" else "optim"
    else:
        item.name = param
        if item.kind == "object" and param.startswith("rng_state"):
            item.kind = "rng"
        elif item.is_tensor and item.kind not in ("optim", "rng"):
            item.kind = classify(param, is_tensor=True)


# -- legacy (--ckpt-format torch) -------------------------------------------------------------------


def _model_leaves(obj: dict[str, Any]) -> list[tuple[str, Any]]:
    """``(model.<name> or model<k>.<name>, value)`` for the model state of one legacy rank file."""
    return [
        (f"{key}.{local}", value)
        for key, model in obj.items()
        if isinstance(key, str) and _MODEL_KEY.fullmatch(key) and isinstance(model, dict)
        for local, value in flatten(model)
    ]


_MP_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
_LAYER = re.compile(r"^(?P<pre>(?:.*\.)?(?:decoder|encoder)\.layers\.)(?P<i>\d+)(?P<rest>\..*)$")
_COLUMN = (
    "linear_qkv.weight",
    "linear_qkv.bias",
    "word_embeddings.weight",
    "output_layer.weight",
    "query_key_value.weight",
    "query_key_value.bias",
    "linear_q_proj.weight",
    "linear_q_up_proj.weight",
    "linear_kv_up_proj.weight",
    "eh_proj.weight",  # a multi-token prediction layer's projection of [embedding; hidden] to hidden
)
_GATED = ("linear_fc1.weight", "linear_fc1.bias", "dense_h_to_4h.weight", "dense_h_to_4h.bias")
_ROW = ("linear_proj.weight", "linear_fc2.weight", "dense.weight", "dense_4h_to_h.weight")


def split_rule(name: str, *, gated: bool) -> tuple[str, int | None]:
    """How tensor parallelism splits parameter ``name``: ``("column", 0)``, ``("row", 1)``,
    ``("gated", 0)`` (SwiGLU fc1: each rank holds ``[gate_r; up_r]``) or ``("replicated", None)``
    (research/megatron.md §7)."""
    name = re.sub(r"\.(weight|bias)\d+$", r".\1", name)  # TEGroupedMLP: linear_fc1.weight<expert>
    if name.endswith(_GATED):
        return ("gated", 0) if gated else ("column", 0)
    if name.endswith(_COLUMN):
        return "column", 0
    if name.endswith(_ROW) and not name.endswith("layernorm.weight"):
        return "row", 1
    return "replicated", None


def global_shape(local: tuple[int, ...], rule: str, dim: int | None, tp: int) -> tuple[int, ...]:
    """The shape of the whole tensor whose TP rank parts have shape ``local``."""
    if rule == "replicated" or dim is None or tp == 1:
        return local
    return tuple(n * tp if d == dim else n for d, n in enumerate(local))


def tp_regions(shape: tuple[int, ...], rule: str, dim: int | None, t: int, tp: int) -> list[Box]:
    """The regions of the whole tensor (of ``shape``) TP rank ``t`` of ``tp`` holds, in the order
    of its local rows: the whole tensor (replicated), one slice of ``dim`` (column, row) or, for
    SwiGLU's ``[gate_r; up_r]``, rows ``t*h`` of the gates and ``H + t*h`` of the ups. The reader
    places each rank's tensor with it, the writer cuts with it."""
    if rule == "replicated" or dim is None or tp == 1:
        return [Box.whole(shape)]
    if rule == "gated":
        half = shape[0] // 2 // tp
        rest = (0,) * (len(shape) - 1)
        sub = (half, *shape[1:])
        return [Box((t * half, *rest), sub), Box((shape[0] // 2 + t * half, *rest), sub)]
    size = shape[dim] // tp
    offsets = tuple(t * size if d == dim else 0 for d in range(len(shape)))
    return [Box(offsets, tuple(size if d == dim else n for d, n in enumerate(shape)))]


def pipeline_stages(
    layers: int,
    pp: int,
    first: int | None = None,
    last: int | None = None,
    *,
    embedding: bool = False,
    loss: bool = False,
) -> list[tuple[int, int]]:
    """``(first global layer, number of layers)`` of each pipeline stage (no virtual stages), as
    megatron-core splits them (``get_num_layers_to_build``, ``get_transformer_layer_offset``):
    evenly; or ``first`` (``last``) layers on the first (last) stage and the others evenly over the
    stages between (``--decoder-first/last-pipeline-num-layers``; megatron-core's
    ``TransformerConfig`` refuses middle stages left with none, and so does this); or evenly with
    the embedding (the loss) counted as a layer of the first (last) stage. ValueError, with the
    reason, when the layers do not split so."""
    if pp < 1:
        raise ValueError("PP must be at least 1")
    if first is not None or last is not None:
        if embedding or loss:
            raise ValueError("an uneven first or last stage cannot be combined with counting the embedding or loss")
        if pp == 1:
            raise ValueError("a first or last stage size needs PP > 1")
        for value, end in ((first, "first"), (last, "last")):
            if value is not None and value < 1:
                raise ValueError(f"the {end} stage needs at least one layer (got {value})")
        middle = pp - (first is not None) - (last is not None)
        rest = layers - (first or 0) - (last or 0)
        if rest < 0:
            ends = (first or 0) + (last or 0)
            raise ValueError(f"the first and last stages' {ends} layers exceed the {layers} layers")
        if middle == 0 and rest:
            raise ValueError(f"PP={pp} with both end stages given leaves {rest} layers on no stage")
        if middle and not rest:
            both = first is not None and last is not None
            taking = "the end stages take" if both else f"the {'first' if last is None else 'last'} stage takes"
            rest_of = f"the {middle} stages between them" if both else f"the other {middle} stage(s)"
            raise ValueError(
                f"{taking} all {layers} layers and leave{'' if both else 's'} {rest_of} none (megatron-core refuses a "
                "stage without layers)"
            )
        if middle and rest % middle:
            raise ValueError(f"the {rest} layers between the end stages do not split evenly over {middle} stages")
        counts = [rest // middle if middle else 0] * pp
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
    else:
        total = layers + embedding + loss
        counted = " (the embedding and loss counted as layers)" if embedding or loss else ""
        if pp > total:
            raise ValueError(f"PP={pp} is larger than the {layers} layers{counted}")
        if total % pp:
            raise ValueError(f"PP={pp} does not divide the {total} layers{counted}")
        counts = [total // pp] * pp
        counts[0] -= embedding
        counts[-1] -= loss
    out, offset = [], 0
    for count in counts:
        out.append((offset, count))
        offset += count
    return out


def pipeline_chunks(
    layers: int,
    pp: int,
    vpp: int = 1,
    first: int | None = None,
    last: int | None = None,
    *,
    embedding: bool = False,
    loss: bool = False,
) -> list[list[tuple[int, int]]]:
    """For each pipeline stage, ``(first global layer, number of layers)`` of each of its ``vpp``
    model chunks, as megatron-core places them: each stage's layers (:func:`pipeline_stages`, the
    embedding or loss counted where they are) cut into ``vpp`` equal chunks, and chunk ``v`` of every
    stage following chunk ``v - 1`` of the last (the interleaved schedule). ValueError, with the
    reason, when the layers do not split so."""
    stages = pipeline_stages(layers, pp, first, last, embedding=embedding, loss=loss)
    if vpp == 1:
        return [[stage] for stage in stages]
    if vpp < 1:
        raise ValueError("VPP must be at least 1")
    if pp == 1:
        raise ValueError(f"VPP={vpp} needs PP > 1 (virtual stages interleave pipeline ranks)")
    if first is not None and last is not None and pp == 2:  # megatron-core divides by the stages between
        raise ValueError("virtual stages with both end stages given need a stage between them (PP > 2)")
    counts = [n + (embedding and p == 0) + (loss and p == pp - 1) for p, (_, n) in enumerate(stages)]
    for p, n in enumerate(counts):
        if n % vpp:
            raise ValueError(f"the {n} layers of pipeline stage {p} do not split into VPP={vpp} model chunks")
    per = [n // vpp for n in counts]
    rounds = sum(per)  # layers (the embedding and loss counted) in chunk v of all stages together
    out = []
    for p in range(pp):
        row = []
        for v in range(vpp):
            offset, count = v * rounds + sum(per[:p]), per[p]
            if embedding:  # the embedding takes a layer's place in the very first chunk
                if (p, v) == (0, 0):
                    count -= 1
                else:
                    offset -= 1
            if loss and (p, v) == (pp - 1, vpp - 1):
                count -= 1
            row.append((offset, count))
        out.append(row)
    return out


_LAYOUT_GROUP = re.compile(r"\(([^)]+)\)\*(\d+)")
_LAYOUT_REPEAT = re.compile(r"(.)\*(\d+)")
_LAYOUT_CHARS = frozenset("ELtm")


def layout_stages(layout: str) -> list[str]:
    """A ``--pipeline-model-parallel-layout`` string as its list of stages, each a string of layer
    letters (``E`` embedding, ``t`` transformer layer, ``L`` loss, ``m`` MTP), in the order
    megatron-core lists them (virtual stage by virtual stage, each over the pipeline ranks):
    commas dropped, ``(…)*n`` and ``x*n`` unrolled, stages split at ``|``. ValueError on a letter
    megatron-core does not know, or an expansion past a million layers."""
    text = layout.replace(",", "")
    for pattern in (_LAYOUT_GROUP, _LAYOUT_REPEAT):
        grown = [len(text)]  # the expanded length so far, over all the matches of this pass

        def unroll(m: re.Match[str], grown: list[int] = grown) -> str:
            grown[0] += len(m[1]) * int(m[2]) - len(m[0])
            if grown[0] > 1_000_000:
                raise ValueError(f"the layout {layout!r} expands past a million layers")
            return m[1] * int(m[2])

        text = pattern.sub(unroll, text)
    stages = text.split("|")
    bad = sorted({c for stage in stages for c in stage} - _LAYOUT_CHARS)
    if bad:
        raise ValueError(f"the layout {layout!r} has letters {bad} megatron-core does not know (E, t, L, m)")
    return stages


def layout_chunks(layout: str, pp: int, layers: int) -> list[list[tuple[int, int]]]:
    """For each pipeline stage, ``(first global layer, number of layers)`` of each of its model
    chunks, as megatron-core's ``PipelineParallelLayerLayout`` places them
    (``get_layer_offset``, ``get_num_layers_to_build``): stage ``v·PP + p`` of the list is chunk
    ``v`` of pipeline rank ``p``, and layers are numbered chunk by chunk in that order. ValueError,
    with the reason, for a layout megatron-core refuses (its ``validate_layer_layout``). MTP layers (``m``)
    place no decoder layer: where they go is :func:`mtp_chunk`'s."""
    stages = layout_stages(layout)
    if pp < 1 or len(stages) % pp:
        raise ValueError(f"the layout's {len(stages)} stages do not divide over PP={pp}")
    flat = "".join(stages)
    if "m" in flat:
        if "t" in flat[flat.index("m") :]:
            raise ValueError("the layout places transformer layers after MTP layers")
        holding = [s for s, stage in enumerate(stages) if "m" in stage]
        if len(holding) > 1:
            raise ValueError("the layout spreads the MTP layers over several stages (megatron-core builds them in one)")
        if holding[0] // pp != len(stages) // pp - 1:
            raise ValueError(
                "the layout places the MTP layers in a model chunk other than its pipeline rank's last "
                "(megatron-core builds them only there)"
            )
    if not flat.startswith("E") or flat.count("E") != 1:
        raise ValueError("the layout must start with the embedding (E), once")
    if not flat.endswith("L") or flat.count("L") != 1:
        raise ValueError("the layout must end with the loss (L), once")
    if flat.count("t") != layers:
        raise ValueError(f"the layout places {flat.count('t')} transformer layers, the model has {layers}")
    vpp = len(stages) // pp
    if pp == 1 and vpp > 1:
        raise ValueError(
            f"the layout's {len(stages)} stages at PP=1 are {vpp} virtual stages on one pipeline rank: virtual "
            "stages interleave pipeline ranks, so give the PP size the layout is for (--pp)"
        )
    out: list[list[tuple[int, int]]] = [[] for _ in range(pp)]
    offset = 0
    for v in range(vpp):
        for p in range(pp):
            n = stages[v * pp + p].count("t")
            out[p].append((offset, n))
            offset += n
    return out


def example_layout(layers: int, stages: int, mtp: int = 0) -> str:
    """A pipeline layout megatron-core accepts for a model of ``layers`` transformer layers and
    ``mtp`` MTP layers over ``stages`` stages (PP x VPP): the layers spread evenly, the earlier
    stages taking one more where they do not divide, the embedding first, the MTP layers and the
    loss in the last stage (the last chunk of the last pipeline rank). What a refusal of a
    ``--pipeline-layout`` offers instead."""
    stages = max(stages, 1)
    per, extra = divmod(layers, stages)

    def run(letter: str, n: int) -> str:  # (x*n, as megatron-core reads it, where n is large)
        return letter * n if n <= 8 else f"{letter}*{n}"

    out = [run("t", per + (s < extra)) for s in range(stages)]
    out[0] = "E" + out[0]
    out[-1] += run("m", mtp) + "L"
    return "|".join(out)


def mtp_chunk(layout: str | None, pp: int, vpp: int) -> tuple[int, int]:
    """The (pipeline rank, model chunk) whose model builds the MTP layers, and with them a copy of
    the word embeddings: the stage of ``layout`` holding ``m`` (stage ``v·PP + p`` is chunk ``v`` of
    rank ``p``; megatron-core's "standalone MTP" when it is not the loss's), else the last chunk of the
    last rank (megatron-core's ``mtp_on_this_rank``)."""
    if layout is not None:
        for s, stage in enumerate(layout_stages(layout)):
            if "m" in stage:
                return (s % pp, s // pp)
    return (pp - 1, vpp - 1)


def mtp_copy_apart(layout: str | None, pp: int, vpp: int, decoupled: bool) -> str | None:
    """How megatron-core trains the MTP layers' copy of the word embeddings apart from them at this
    placement (:func:`mtp_chunk`), or None (no copy: the MTP layers are in the first stage's first
    chunk, with the embeddings; or a copy kept equal). ``"first rank"``: in a later chunk of the first
    pipeline rank the copy is never synced (``pretrain_gpt.py``'s embedding group is then that rank
    alone) and starts from zeros; ``"decoupled"``: with ``--decoupled-lr`` (``decoupled``), which only
    the first stage's embedding gets (megatron-core marks it alone ``is_embedding_or_output_parameter``),
    the copy takes the same gradients at the default LR. ValueError from :func:`layout_stages`."""
    p, v = mtp_chunk(layout, pp, vpp)
    if pp < 2 or (p, v) == (0, 0):
        return None
    if p == 0:
        return "first rank"
    return "decoupled" if decoupled else None


def args_pipeline(args: Any) -> tuple[str | None, int]:
    """The ``--pipeline-model-parallel-layout`` string ``args`` give (None: none) and their model
    chunks per pipeline rank."""
    layout = getattr(args, "pipeline_model_parallel_layout", None)
    vpp = int(getattr(args, "virtual_pipeline_model_parallel_size", None) or 1)
    return (layout if isinstance(layout, str) and layout else None), vpp


def tied_output_copy(args: Any, pp: int) -> bool:
    """Whether the last stage's ``output_layer.weight`` is its copy of the word embeddings: the
    output layer tied to them (no ``--untie-embeddings-and-output-weights``) at PP > 1, megatron-core
    zero-filling it at build and syncing it with the first stage's through the embedding group. Not
    when the last chunk also builds the MTP layers (:func:`unused_output_layer`)."""
    tied = pp > 1 and not getattr(args, "untie_embeddings_and_output_weights", False)
    return tied and not unused_output_layer(args, pp)


def unused_output_layer(args: Any, pp: int) -> bool:
    """Whether the last stage's ``output_layer.weight`` is a parameter nothing uses: the output layer
    tied to the word embeddings at PP > 1 and the MTP layers in the last chunk. megatron-core 0.16.1
    then ties the output to that chunk's own copy of the embeddings (``shared_embedding_or_output_weight``)
    but still allocates the output layer's weight (it skips that only on the first stage): kept at its
    random init, its gradients zero, its Adam moments zero, only decayed; its ``sharded_state_dict``
    asserts on it, so such a run saves legacy files only."""
    untied = getattr(args, "untie_embeddings_and_output_weights", False)
    if pp < 2 or untied or not getattr(args, "mtp_num_layers", None):
        return False
    layout, vpp = args_pipeline(args)
    try:
        return mtp_chunk(layout, pp, vpp) == (pp - 1, vpp - 1)
    except ValueError:
        return False  # (the reader refuses the layout)


def _mtp_apart(args: Any, pp: int) -> str | None:
    """How the MTP layers' copy of the word embeddings trained apart from the first stage's in the
    run of ``args`` (:func:`mtp_copy_apart`), or None: it did not, the run has no MTP layers, or the
    reader refuses its layout."""
    if not getattr(args, "mtp_num_layers", None):
        return None
    layout, vpp = args_pipeline(args)
    try:
        return mtp_copy_apart(layout, pp, vpp, getattr(args, "decoupled_lr", None) is not None)
    except ValueError:
        return None


def _unsynced_copies(args: Any, pp: int) -> dict[str, str] | None:
    """Why the copies of the word embeddings may differ, as ``copy_notes`` for verify's findings: in a
    save whose MTP layers keep a copy of them that megatron-core trains apart (:func:`_mtp_apart`),
    or whose last stage keeps them as its tied output layer; None for other saves."""
    layout = args_pipeline(args)[0]
    apart = _mtp_apart(args, pp)
    if apart is None and tied_output_copy(args, pp):
        hint = (
            "at PP > 1 the last pipeline stage keeps its own copy of the tied word embeddings (its "
            "output_layer.weight), which megatron-core syncs with the first stage's through the embedding group: if "
            "the differing copy is that stage's, the stages diverged (an embedding group without the last stage) or "
            "a file is damaged; a reshard to PP=1 keeps the first stage's"
        )
    elif apart == "first rank":
        hint = (
            f"the pipeline layout {layout!r} puts the MTP layers on the first pipeline rank, whose copy of the word "
            "embeddings megatron-core never syncs with the embeddings (it starts from zeros and trains apart): the "
            "run trained two embeddings; put the MTP layers on another rank"
        )
    elif apart == "decoupled":
        hint = (
            "with --decoupled-lr, megatron-core gives the MTP stage's copy of the word embeddings the default LR (it "
            "marks only the first stage's embedding as one): the copy takes the same gradients at another LR and "
            "drifts apart, so the run trained two embeddings; megatron-core's bug, not a damaged file"
        )
    else:
        return None
    base = "embedding.word_embeddings.weight"
    return {base + suffix: hint for suffix in ("", ".fp32", ".exp_avg", ".exp_avg_sq")}


def stage_split(args: Any) -> tuple[int | None, int | None]:
    """The first and last stages' layer counts when ``args`` gives them (uneven pipeline)."""
    first = getattr(args, "decoder_first_pipeline_num_layers", None)
    last = getattr(args, "decoder_last_pipeline_num_layers", None)
    return (first if isinstance(first, int) else None, last if isinstance(last, int) else None)


def placement(
    args: Any,
    *,
    pp: int | None = None,
    vpp: int | None = None,
    split: tuple[int | None, int | None] | None = None,
    layout: str | None = None,
) -> list[list[tuple[int, int]]]:
    """:func:`pipeline_chunks` for the model ``args`` describe (its layers, and whether the embedding
    and loss count as layers), at ``pp`` / ``vpp`` / first-and-last ``split`` (default: the args'),
    or :func:`layout_chunks` of ``layout`` (default: the args' ``--pipeline-model-parallel-layout``
    when none of ``pp``, ``vpp``, ``split`` is given)."""
    layers = int(getattr(args, "num_layers", 0) or 0)
    if layout is None and pp is None and vpp is None and split is None:
        layout = getattr(args, "pipeline_model_parallel_layout", None) or None
    if layout is not None:
        if not isinstance(layout, str):
            raise ValueError(f"a pipeline layout of type {type(layout).__name__}, not a string")
        return layout_chunks(layout, pp or int(getattr(args, "pipeline_model_parallel_size", 1) or 1), layers)
    ends = stage_split(args) if split is None else split
    counted = ends == (None, None)
    return pipeline_chunks(
        layers,
        pp or int(getattr(args, "pipeline_model_parallel_size", 1) or 1),
        vpp or int(getattr(args, "virtual_pipeline_model_parallel_size", None) or 1),
        *ends,
        # (megatron-core refuses end stages given with the embedding or loss counted: given ends
        # replace the counting, which the output's args then drop)
        embedding=counted and bool(getattr(args, "account_for_embedding_in_pipeline_split", False)),
        loss=counted and bool(getattr(args, "account_for_loss_in_pipeline_split", False)),
    )


def model_chunks(obj: dict[str, Any]) -> list[tuple[int, Any]]:
    """A legacy rank file's model chunks: ``[(0, model)]``, or with virtual pipeline stages
    ``[(v, model<v>), ...]`` in chunk order."""
    if isinstance(obj.get("model"), dict):
        return [(0, obj["model"])]
    found = [(int(k[5:]), v) for k, v in obj.items() if re.fullmatch(r"model\d+", k) and isinstance(v, dict)]
    return sorted(found, key=lambda kv: kv[0])


def _layer_offset(args: Any, pp_rank: int, vp: int, rel: str = "") -> int:
    """Global index of the first layer a (pipeline rank, virtual chunk) holds. CorruptFileError when
    ``args`` place the layers in a way megatron-core cannot: numbering them anyway would give wrong
    names."""
    layers = int(getattr(args, "num_layers", 0) or 0)
    if not layers:
        return 0
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    vpp = int(getattr(args, "virtual_pipeline_model_parallel_size", None) or 1)
    try:
        chunks = placement(args)
    except ValueError as exc:
        raise CorruptFileError(
            f"{rel}: its args place {layers} layers on PP={pp} x VPP={vpp} stages in a way Megatron cannot ({exc})",
            hint="the args are damaged, or from a Megatron version ckpttool does not know",
            path=rel,
        ) from None
    if pp_rank >= len(chunks) or vp >= len(chunks[pp_rank]):
        raise CorruptFileError(
            f"{rel}: pipeline rank {pp_rank}, model chunk {vp} is outside the args' PP={pp} x VPP={vpp}", path=rel
        )
    return chunks[pp_rank][vp][0]


class MegatronLegacyAdapter:
    """``iter_NNNNNNN/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` (``--ckpt-format torch``)."""

    name = "megatron"

    def detect(self, path: Path) -> Detection:
        if not path.is_dir():
            return Detection(False, "not a directory")
        if (path / TRACKER).is_file():
            try:
                target = _read_tracker(path)
            except (CorruptFileError, IncompleteCheckpointError, PathEscapeError):
                return Detection(True, f"found {TRACKER} (naming a missing or bad iteration, or linked out)")
            if is_dist_config(target / "metadata.json"):
                return Detection(False, "a torch_dist checkpoint (read as megatron-dist)")
            return Detection(True, f"found {TRACKER}")
        if any(_MP_DIR.match(p.name) for p in path.iterdir() if p.is_dir()):
            return Detection(True, "found mp_rank_* directories")
        if _untracked_iterations(path):
            return Detection(True, f"found Megatron iteration directories but no {TRACKER}", weak=True)
        return Detection(False, f"no {TRACKER} and no mp_rank_* directories")

    def describe(self, path: Path) -> Manifest:
        root = path
        if not (path / TRACKER).is_file() and (iterations := _untracked_iterations(path)):
            shown = ", ".join(iterations[-5:]) + (f" and {len(iterations) - 5} more" if len(iterations) > 5 else "")
            raise IncompleteCheckpointError(
                f"{path} holds the Megatron iteration director{'ies' if len(iterations) > 1 else 'y'} {shown} but no "
                f"{TRACKER}, which Megatron-LM writes after a save's last file: the save did not finish, or the "
                "file was deleted",
                hint=f"if the save finished, verify the iteration itself (ckpttool verify "
                f"{shlex.quote(str(path / iterations[-1]))}) or write its number into {TRACKER}",
                path=TRACKER,
                rule="incomplete-save",
            )
        if (path / TRACKER).is_file():
            it_dir = _read_tracker(path)
            prefix = f"{it_dir.name}/"
        else:
            it_dir, prefix = path, ""
        dirs = sorted(p.name for p in it_dir.iterdir() if p.is_dir() and _MP_DIR.match(p.name))
        if not dirs:
            meta = it_dir / "metadata.json"
            if meta.is_file() or meta.is_symlink():  # a torch_dist save whose metadata.json does not read as one
                bad = CorruptFileError(
                    f'{prefix}metadata.json: expected torch_dist\'s JSON ({{"sharded_backend": "torch_dist", ...}}), '
                    f"found {_describe_bytes(meta)}",
                    hint="the save was interrupted while writing it, or the file was damaged; use another iteration",
                    path=f"{prefix}metadata.json",
                )
                others = _dist_damage(it_dir) if meta.is_file() else []
                if prefix:
                    name_from_above(others, it_dir)
                raise_together([bad, *others])
            dist = [n for n in ("common.pt", ".metadata") if (it_dir / n).is_file()]
            dist += ["*.distcp"] if any(it_dir.glob("*.distcp")) else []
            if dist:  # torch_dist's other files, without its metadata.json
                raise IncompleteCheckpointError(
                    f"{prefix}metadata.json: missing; {it_dir.name} holds a torch_dist save ({', '.join(dist)}), "
                    "which megatron-core cannot load without it",
                    hint="megatron-core writes metadata.json last: the save did not finish, or the file was deleted; "
                    "use another iteration or restore it",
                    path=f"{prefix}metadata.json",
                    rule="missing-file",
                )
            raise IncompleteCheckpointError(f"{it_dir}: no mp_rank_* directories", path=str(it_dir))
        manifest = Manifest(root=str(root), format=self.name)
        objs: dict[str, Any] = {}
        self._nested: dict[tuple[str, str], str] = {}
        self._grouped: dict[str, GroupedWeights] = {}
        self._etp: dict[str, tuple[int, int]] = {}  # rank directory -> (its experts' ETP rank, ETP)
        self._tied_copy = False
        damaged: list[CkptError] = []  # rank files missing or unreadable: every one named, not the first
        for d in dirs:
            rel = f"{prefix}{d}/model_optim_rng.pt"
            gone = left_out(root, f"{prefix}{d}") or left_out(root, rel)  # (verify's second look: a link out)
            if not gone:
                confine(root, f"{prefix}{d}", named_by="the listing")  # a rank folder linked out
            if gone or not (root / rel).is_file():
                tp = rank_of(d, 1)[0]  # (the TP rank, as this file's pieces name it)
                damaged.append(IncompleteCheckpointError(f"{rel} is missing", path=rel, rule="missing-file", rank=tp))
                continue
            if (loaded := _pt.load_or_note(root, rel, ALLOWLIST, damaged)) is None:
                damaged[-1].rank = rank_of(d, 1)[0]
                continue
            archive, obj, _ = loaded
            if not isinstance(obj, dict):
                archive.close()
                damaged.append(
                    CorruptFileError(
                        f"{rel}: expected a dict, found {type(obj).__name__}", path=rel, rank=rank_of(d, 1)[0]
                    )
                )
                continue
            try:
                for local, value in _model_leaves(obj):
                    if local.endswith("_extra_state") and (glob := _pt.nested_refusal(archive, value)):
                        self._nested[(rel, local)] = glob
            finally:
                archive.close()
            objs[d] = obj
        if damaged:  # the distrib_optim.pt files beside them named too, read as far as to know they read
            damaged += self._distrib_optim_damage(root, prefix, dirs, objs)
        raise_together(damaged)
        args = next((o.get("args") for o in objs.values() if o.get("args") is not None), None)
        if args is None:
            raise CorruptFileError(
                f"{it_dir}: no 'args' in any model_optim_rng.pt; TP/PP cannot be known", path=str(it_dir)
            )
        layout = _args_layout(args)
        tp, pp, ep = layout.tp or 1, layout.pp or 1, layout.ep or 1
        # tied at PP > 1: the last stage's output_layer.weight is its copy of the word embeddings (a
        # parameter of its own, synced with the first stage's), read as a replica of them, as
        # torch_dist saves it
        self._tied_copy = tied_output_copy(args, pp)
        ranks: dict[str, tuple[int, int, int]] = {}
        owners: dict[tuple[int, int, int], str] = {}
        for d in dirs:
            ranks[d] = rank_of(d, pp)
            t, p, e = ranks[d]
            claim(owners, ranks[d], f"{prefix}{d}", f"TP rank {t}, PP rank {p}" + (f", EP rank {e}" if ep > 1 else ""))
        if tp * pp * ep > 64 * len(dirs):
            raise CorruptFileError(
                f"{it_dir}: args say TP={tp} PP={pp} EP={ep} ({tp * pp * ep:,} ranks) but {len(dirs)} rank "
                "directories exist",
                hint="the args are damaged, or most of the checkpoint is gone",
                path=str(it_dir),
            )
        try:
            etp_of = expert_tp_ranks(args)
        except ValueError as exc:
            raise CorruptFileError(
                f"{it_dir}: the args' expert tensor parallelism cannot be laid out: {exc}",
                hint="a legacy checkpoint of this layout cannot be read; save it with --ckpt-format torch_dist",
                path=str(it_dir),
            ) from None
        etp_said = ""
        if etp_of is None:
            expected = {(t, p, e) for t in range(tp) for p in range(pp) for e in range(ep)}
        else:
            expected = set(etp_of)
            etp = own_etp(args)
            etp_said = f" ETP={etp}"
            self._etp = {f"{prefix}{d}": (etp_of[r].etp, etp) for d, r in ranks.items() if r in etp_of}
        # a rank directory past the args' layout (left by a save at another one) and those missing,
        # each named in one look
        missing = sorted(expected - set(ranks.values()))
        raise_together(
            [
                CorruptFileError(
                    f"{prefix}{d}: no rank saves this directory under the args' layout (TP={tp} PP={pp} EP={ep}"
                    f"{etp_said}, world size {layout.world_size}): one left from a save at another layout",
                    hint="remove the rank directories the save did not have, or restore the iteration from one save "
                    "(the args may be damaged instead)",
                    path=f"{prefix}{d}/model_optim_rng.pt",
                    rule="misplaced-file",
                    rank=ranks[d][0],
                )
                for d in sorted(d for d, r in ranks.items() if r not in expected)
            ]
            + [
                IncompleteCheckpointError(
                    f"{prefix}{name}/model_optim_rng.pt: missing; the args say TP={tp} PP={pp} EP={ep}, and "
                    f"{len(missing)} of {len(expected)} rank directories are missing",
                    hint="a rank did not save or the directory was deleted; use another iteration",
                    path=f"{prefix}{name}/model_optim_rng.pt",
                    rule="missing-file",
                    rank=t,  # (the TP rank, as the pieces of its files name it)
                )
                for t, p, e in missing
                for name in [rank_dir(t, p, pp, e, ep)]
            ]
        )
        gated = bool(getattr(args, "swiglu", False) or getattr(args, "gated_linear_unit", False))
        replicas = ReplicaCounter()  # this describe's: the adapter is shared
        first = objs[dirs[0]]
        self._user_rules: dict[str, int | None] = dict(_USER_RULES.get() or {})
        self._carried_rules = _carried_rules(first.get(SPLIT_RULES), f"{prefix}{dirs[0]}/model_optim_rng.pt")
        for f_rel, size in ((r, s) for r, s in _list(root, prefix, dirs)):
            role: FileRole = "data" if f_rel.endswith(".pt") else "aux"
            tp_rank = ranks[f_rel[len(prefix) :].split("/", 1)[0]][0]  # (verify's findings name the TP rank)
            manifest.files.append(FileRecord(path=f_rel, size=size, role=role, ranks=[tp_rank]))
        if prefix:
            manifest.files.append(
                FileRecord(path=TRACKER, size=os.stat(confine(root, TRACKER)).st_size, role="tracker")
            )
        trained = any(o.get("optimizer") is not None or o.get("rng_state") is not None for o in objs.values())
        misplaced = _misplaced_ranks({f"{prefix}{d}": (ranks[d], objs[d].get("args")) for d in dirs}, args, trained)
        copied = {f["file"]: f for f in misplaced}
        for d in dirs:  # a distrib_optim.pt missing or damaged: every rank's named, not the first
            rel = f"{prefix}{d}/model_optim_rng.pt"
            try:
                self._rank(manifest, objs[d], rel, ranks[d], args, tp, gated, replicas)
            except (CorruptFileError, IncompleteCheckpointError) as exc:
                if rel in copied and isinstance(exc, CorruptFileError):  # (what does not fit beside a copy: its doing)
                    said = copied.pop(rel)
                    exc = CorruptFileError(
                        said["message"] + f"; so {exc.path or 'the state'} beside it, this rank's, does not fit the "
                        "parameters the copied file gives it",
                        hint=_MISPLACED_HINT,
                        path=rel,
                        rule="misplaced-file",
                    )
                exc.rank = ranks[d][0] if exc.rank is None else exc.rank  # (its files are this TP rank's)
                damaged.append(exc)
        if damaged:  # (a copied rank file is said beside the damage, which stops the reading)
            damaged += [
                CorruptFileError(f["message"], hint=_MISPLACED_HINT, path=f["file"], rule="misplaced-file")
                for f in copied.values()
            ]
        raise_together(damaged)
        carried = first.get(RNG_CARRIED)
        if isinstance(carried, dict):  # other layouts' ranks' RNG, as ckpttool carried them (none a rank here has)
            held = _rng_labels(manifest)
            for label, rng in carried.items():
                if isinstance(label, str) and RANK_LABEL.fullmatch(label) and label not in held:
                    _add_rng(manifest, f"{prefix}{dirs[0]}/model_optim_rng.pt", rng, f"{RNG_CARRIED}.{label}", label, 0)
        for key, kind in (
            ("iteration", "counter"),
            ("checkpoint_version", "object"),
            ("num_floating_point_operations_so_far", "object"),
        ):
            if key in first:
                item = manifest.add(
                    Item(
                        name=key,
                        kind=kind,  # type: ignore[arg-type]
                        pieces=[_pt.object_piece(f"{prefix}{dirs[0]}/model_optim_rng.pt", key)],
                    )
                )
                set_value(item, first[key])
        _add_unknown_keys(manifest, first, f"{prefix}{dirs[0]}/model_optim_rng.pt", _LEGACY_KEYS)
        sched = first.get("opt_param_scheduler") or first.get("lr_scheduler")
        if isinstance(sched, dict):
            for k, v in sched.items():
                item = manifest.add(
                    Item(
                        name=f"opt_param_scheduler.{k}",
                        kind="scheduler",
                        pieces=[_pt.object_piece(f"{prefix}{dirs[0]}/model_optim_rng.pt", f"opt_param_scheduler.{k}")],
                    )
                )
                set_value(item, v)
        it = first.get("iteration")
        claims = _step_claims(
            {f"{prefix}{d}/model_optim_rng.pt": objs[d].get("iteration") for d in dirs}, it_dir.name, bool(prefix)
        )
        manifest.extras["step_claims"] = claims
        # the step most claim (one rank's file left from another save does not name the checkpoint's)
        manifest.step = _claimed_step(claims, it_dir.name, it)
        manifest.layout = layout
        manifest.layout.world_size = layout.world_size or tp * pp * ep * (layout.dp or 1)
        if copied:
            manifest.extras["findings"] = list(copied.values())
        manifest.extras["args"] = _args_extras(args)
        if any(n.startswith("mtp.layers.") for n in manifest.items) and (apart := _mtp_apart(args, pp)) is not None:
            manifest.extras["copies_apart"] = apart  # (the writers of other formats keep one copy: which is not ours)
        _data_position(manifest, args)
        manifest.extras["iteration_dir"] = it_dir.name
        if (notes := _unsynced_copies(args, pp)) is not None:
            manifest.extras["copy_notes"] = notes
        if unused_output_layer(args, pp):  # (verify: its moments are zero by design)
            manifest.extras["unused"] = ["output_layer.weight"]
        if any((root / f"{prefix}{d}/distrib_optim.pt").is_file() for d in dirs):
            manifest.extras["distrib_optim"] = "de-bucketed from distrib_optim.pt by replaying the grad-buffer layout"
        return manifest

    @staticmethod
    def _distrib_optim_damage(root: Path, prefix: str, dirs: list[str], objs: dict[str, Any]) -> list[CkptError]:
        """Where some rank files do not read: each rank directory's ``distrib_optim.pt`` that is
        missing (the rank files read save the distributed optimizer's state beside them) or does
        not read."""
        saved = any(_saves_distrib_optim(o.get("args"), o) for o in objs.values())
        damaged: list[CkptError] = []
        for d in dirs:
            rel = f"{prefix}{d}/distrib_optim.pt"
            if left_out(root, f"{prefix}{d}") or left_out(root, rel):
                continue  # (verify's second look past a link out: reported as such already)
            if not (root / rel).is_file():
                if saved:
                    damaged.append(_missing_distrib_optim(rel, rank_of(d, 1)[0]))
                continue
            if (loaded := _pt.load_or_note(root, rel, ALLOWLIST, damaged)) is not None:
                loaded[0].close()
            else:
                damaged[-1].rank = rank_of(d, 1)[0]
        return damaged

    def _rank(
        self,
        manifest: Manifest,
        obj: dict[str, Any],
        rel: str,
        rank: tuple[int, int, int],
        args: Any,
        tp: int,
        gated: bool,
        replicas: ReplicaCounter,
    ) -> None:
        t, p, e = rank
        experts = getattr(args, "num_experts", None)
        ep = int(getattr(args, "expert_model_parallel_size", 1) or 1)
        local_experts = experts // ep if isinstance(experts, int) and experts and ep else None
        chunks = model_chunks(obj)
        orders: list[list[tuple[str, tuple[int, ...]]]] = []  # the parameters of each model chunk
        # GroupedMLP's weight1 / weight2 (named as in ``orders``) -> how to cut them into experts
        self._grouped.clear()
        for vp, model in chunks:
            orders.append([])
            offset = _layer_offset(args, p, vp, rel)
            for local, value in flatten(model):
                m = _LAYER.match(local)
                name = f"{m['pre']}{int(m['i']) + offset}{m['rest']}" if m else local
                if local_experts is not None:
                    name = _global_expert(name, e, local_experts)
                path = f"model.{local}" if len(chunks) == 1 else f"model{vp}.{local}"
                refused = self._nested.get((rel, path))
                if refused is not None:  # a nested pickle naming a global we would not load
                    item = manifest.items.get(name) or manifest.add(Item(name=name, kind="object"))
                    item.error = f"{UNSAFE_PICKLE}: nested pickle refers to {refused}"
                    item.pieces.append(_pt.object_piece(rel, path, rank=t, replica=len(item.pieces)))
                elif isinstance(value, _unpickle.TensorRef):
                    if _GROUPED_WEIGHT.search(name):
                        self._grouped[name] = GroupedWeights.of(name, value, args, e, local_experts, rel)
                    self._place_state(manifest, name, None, value, rel, t, tp, gated, replicas, kind="param")
                    orders[-1].append((name, value.shape))
                elif name.endswith("_extra_state"):
                    item = manifest.items.get(name) or manifest.add(Item(name=name, kind="object"))
                    if not item.pieces:
                        set_value(item, value)
                    item.pieces.append(_pt.object_piece(rel, path, rank=t, replica=len(item.pieces)))
        # one optimizer over all chunks: its parameters chunk by chunk; a ChainedOptimizer (dense
        # and expert parameters, under expert parallelism) saves a list, one entry per optimizer
        params = [x for order in orders for x in order]
        for opt, members in optimizer_members(obj.get("optimizer"), params, rel):
            inner = opt["optimizer"]
            state = inner.get("state") or {}
            ids = _pt.match_param_ids(members, inner.get("param_groups") or [], state)
            if ids is None:
                raise CorruptFileError(f"{rel}: optimizer state does not match the model's parameters", path=rel)
            masters = opt.get("fp32_from_fp16_params")
            stepped = any(isinstance(v, dict) and "step" in v for v in state.values())
            _note_unread(manifest, opt, inner, stepped, rel)
            for pid, (name, g, i) in ids.items():
                for key, value in (state.get(pid) or {}).items():
                    if key in ("exp_avg", "exp_avg_sq") and isinstance(value, _unpickle.TensorRef):
                        self._place_state(manifest, name, key, value, rel, t, tp, gated, replicas, kind="optim")
                if isinstance(masters, list) and g < len(masters) and i < len(masters[g]):
                    ref = masters[g][i]
                    if isinstance(ref, _unpickle.TensorRef):
                        self._place_state(manifest, name, "fp32", ref, rel, t, tp, gated, replicas, kind="master")
        dist_rel = rel.rsplit("/", 1)[0] + "/distrib_optim.pt"
        if Path(manifest.root, dist_rel).is_file():
            self._distrib_optim(manifest, dist_rel, orders, args, rank, tp, gated, replicas)
        elif _saves_distrib_optim(args, obj):
            raise _missing_distrib_optim(dist_rel, t)
        _add_rng(manifest, rel, obj.get("rng_state"), "rng_state", rank_label(t, p, e), t)

    def _distrib_optim(
        self,
        manifest: Manifest,
        rel: str,
        orders: list[list[tuple[str, tuple[int, ...]]]],
        args: Any,
        rank: tuple[int, int, int],
        tp: int,
        gated: bool,
        replicas: ReplicaCounter,
    ) -> None:
        """De-bucket ``distrib_optim.pt`` (the distributed optimizer's state, gathered over DP) by
        replaying the grad-buffer layout (:func:`grad_buffer_layout`). Under expert parallelism
        the file holds megatron-core's ``ChainedOptimizer`` list: the dense optimizer's buffers
        (None in the files of ranks other than its DP rank 0, which saves them once: at ETP = TP
        the EP ranks > 0) and the experts'. A buffer whose replayed size disagrees with
        ``numel_unpadded`` (several dtypes, other versions) is refused rather than guessed."""
        archive, obj, _ = _pt.load(Path(manifest.root), rel, ALLOWLIST)
        archive.close()
        if isinstance(obj, list):
            if len(obj) != 2 or not any(isinstance(o, dict) for o in obj):
                raise CorruptFileError(
                    f"{rel}: expected the dense and the expert optimizers' states (a list of 2), found a list of "
                    f"{len(obj)}; this distributed-optimizer layout is not supported yet",
                    path=rel,
                )
            dense = [[x for x in order if not is_expert(x[0])] for order in orders]
            experts = [[x for x in order if is_expert(x[0])] for order in orders]
            members = [(obj[0], dense), (obj[1], experts)]
        else:
            members = [(obj, orders)]
        t, p, _ = rank
        pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
        total = sum(math.prod(s) for order in orders for _, s in order)
        for member, chunk_orders in members:
            if member is None:
                continue  # another rank's file holds this optimizer's state
            # one grad buffer per model chunk that has parameters of this optimizer
            held = [(v, order) for v, order in enumerate(chunk_orders) if order]
            keys = sorted(k for k in member if isinstance(k, int)) if isinstance(member, dict) else []
            if keys != list(range(len(held))) or any(
                not isinstance(member[k], dict) or len(member[k]) != 1 for k in keys
            ):
                raise CorruptFileError(
                    f"{rel}: expected one grad buffer of one dtype per model chunk ({len(held)}), found buffers "
                    f"{keys} with "
                    f"{[len(member[k]) if isinstance(member[k], dict) else type(member[k]).__name__ for k in keys]} "
                    "dtypes; this distributed-optimizer layout is not supported yet",
                    path=rel,
                )
            for k, (v, order) in enumerate(held):
                self._debucket(
                    manifest, rel, member[k], order, args, (t, p, v, len(orders)), pp, total, tp, gated, replicas
                )

    def _debucket(
        self,
        manifest: Manifest,
        rel: str,
        buffer: dict[Any, Any],
        order: list[tuple[str, tuple[int, ...]]],
        args: Any,
        where: tuple[int, int, int, int],
        pp: int,
        total: int,
        tp: int,
        gated: bool,
        replicas: ReplicaCounter,
    ) -> None:
        """One grad buffer's state (model chunk ``v`` of ``chunks`` of TP rank t, stage p) placed
        parameter by parameter."""
        t, p, v, chunks = where
        state = next(iter(buffer.values()))
        numel = state.get("numel_unpadded") if isinstance(state, dict) else None
        layout, pos = chunk_buffer_layout(args, order, (p, pp, v, chunks), total)
        if pos != numel:
            raise CorruptFileError(
                f"{rel}: holds numel_unpadded={numel} elements of optimizer state for model chunk {v}, where this "
                f"rank's parameters take {pos} (its grad-buffer layout replayed): the file is another rank's or "
                "another save's, copied into this folder, or of a layout ckpttool does not replay",
                hint="restore this rank's distrib_optim.pt from the save; if every rank's says so, report the layout",
                path=rel,
            )
        for key, suffix, kind in (
            ("param", "fp32", "master"),
            ("exp_avg", "exp_avg", "optim"),
            ("exp_avg_sq", "exp_avg_sq", "optim"),
        ):
            flat = state.get(key)
            if not isinstance(flat, _unpickle.TensorRef) or flat.shape != (numel,):
                raise CorruptFileError(f"{rel}: no flat {key} tensor of {numel} elements", path=rel)
            for name, shape, start in layout:
                stride = row_major_strides(shape)
                view = _unpickle.TensorRef(flat.storage, flat.storage_offset + start, shape, stride, flat.dtype)
                self._place_state(manifest, name, suffix, view, rel, t, tp, gated, replicas, kind=kind)

    def _place_state(
        self,
        manifest: Manifest,
        param: str,
        suffix: str | None,
        ref: _unpickle.TensorRef,
        rel: str,
        t: int,
        tp: int,
        gated: bool,
        replicas: ReplicaCounter,
        *,
        kind: Any,
    ) -> None:
        """Parameter ``param`` (``suffix`` None) or its state ``<param>.<suffix>`` placed as the
        pieces of its global item, split by the parameter's TP rule (its expert TP for a routed
        expert); a GroupedMLP weight (and its state, of the same shape) as one item per expert,
        each a strided view of it (:class:`GroupedWeights`)."""
        if self._tied_copy and param == "output_layer.weight":
            param = "embedding.word_embeddings.weight"
        grouped = self._grouped.get(param)
        for owner, view in [(param, ref)] if grouped is None else grouped.views(ref, rel):
            name = owner if suffix is None else f"{owner}.{suffix}"
            rt, rtp = t, tp
            if self._etp and is_expert(owner):  # the experts are split by an expert TP of their own
                rt, rtp = self._etp.get(rel.rsplit("/", 1)[0], (t, tp))
            rule, dim = self._split_rule(manifest, owner, gated, len(view.shape))
            local = view.shape
            shape = global_shape(local, rule, dim, rtp)
            item = manifest.items.get(name)
            if item is None:
                item = manifest.add(
                    Item(
                        name=name,
                        kind=kind if kind != "param" else classify(name, is_tensor=True),
                        dtype=view.dtype,
                        shape=shape,
                    )
                )
            elif item.shape != shape or item.dtype != view.dtype:
                raise CorruptFileError(
                    f"{rel}: {name} is {view.dtype}{list(local)} here, inconsistent with "
                    f"{item.dtype}{list(item.shape or ())} from other ranks",
                    path=rel,
                )
            row0 = 0
            for box in tp_regions(shape, rule, dim, rt, rtp):
                same = replicas.next(name, box)
                part = view
                if row0 or box.sizes != local:  # one half of the local rows: the same strided view, row0 rows in
                    part = _unpickle.TensorRef(
                        view.storage, view.storage_offset + row0 * view.stride[0], box.sizes, view.stride, view.dtype
                    )
                item.pieces.append(_pt.tensor_piece(rel, part, box=box, rank=rt, replica=same))
                row0 += box.sizes[0] if box.ndim else 0

    def _split_rule(self, manifest: Manifest, name: str, gated: bool, ndim: int) -> tuple[str, int | None]:
        """megatron-core's split of parameter ``name``; for one its rules leave whole, the rule the
        file carries (:data:`SPLIT_RULES`: how ckpttool cut it), else the user's ``--split-rule``
        (:func:`user_split_rules`), recorded in ``manifest.extras["split_rules"]`` for the writer.
        A rule past the tensor's dimensions is left to the writer's checks, which name it."""
        rule = split_rule(name, gated=gated)
        if rule[0] != "replicated" or not (self._user_rules or self._carried_rules):
            return rule
        found = (self._carried_rules[name],) if name in self._carried_rules else matched_dim(name, self._user_rules)
        if found is None or (found[0] is not None and found[0] >= ndim):
            return rule
        manifest.extras.setdefault("split_rules", {})[name] = found[0]
        return rule_of_dim(found[0])

    def reader(self, manifest: Manifest) -> _pt.PtReader:
        return _pt.PtReader(manifest, ALLOWLIST)


def grad_buffer_layout(
    params: list[tuple[str, tuple[int, ...]]], *, bucket_size: int | None, shared: frozenset[str] = frozenset()
) -> tuple[list[tuple[str, tuple[int, ...], int]], int]:
    """Where each parameter's state lies in a ``distrib_optim.pt`` world tensor, as megatron-core
    0.16's ``_ParamAndGradBuffer`` lays out its buffer and ``get_parameter_state_dp_zero`` strips it:
    parameters in reverse registration order, each starting on a multiple of 64 elements of its
    bucket; a bucket closed once it holds ``bucket_size`` elements or more, and before and after a
    parameter in ``shared`` (the tied embedding on the first or last pipeline stage); the padding
    at the end of each bucket (to a multiple of lcm(DP, 128) elements) dropped. Bucket starts are
    multiples of 128, so the alignment inside a bucket does not depend on DP. Returns
    ``[(name, shape, offset)]`` and the world tensor's length (``numel_unpadded``)."""
    out: list[tuple[str, tuple[int, ...], int]] = []
    base = rel = count = 0  # world offset of the open bucket; position in it; its parameters
    for name, shape in reversed(params):
        rel = -(-rel // 64) * 64
        if name in shared and count:  # the open bucket ends here, alignment padding included
            base, rel, count = base + rel, 0, 0
        out.append((name, shape, base + rel))
        rel += math.prod(shape)
        count += 1
        if (bucket_size is not None and rel >= bucket_size) or name in shared:
            base, rel, count = base + rel, 0, 0
    return out, base + rel


def chunk_buffer_layout(
    args: Any, order: list[tuple[str, tuple[int, ...]]], where: tuple[int, int, int, int], total: int
) -> tuple[list[tuple[str, tuple[int, ...], int]], int]:
    """:func:`grad_buffer_layout` of the grad buffer of model chunk ``v`` of ``chunks`` on pipeline
    rank ``p`` of ``pp`` (``where``), whose parameters in registration order are ``order``, the rank
    holding ``total`` parameter elements: megatron-core buckets only the first model chunk of the
    first stage (DDP's disable_bucketing), and gives a tied embedding a bucket of its own."""
    p, pp, v, chunks = where
    size = bucket_size(args, p, total) if v == 0 else None
    return grad_buffer_layout(order, bucket_size=size, shared=chunk_shared_embedding(args, p, pp, v, chunks))


def bucket_size(args: Any, pp_rank: int, numel: int) -> int | None:
    """The DDP bucket size Megatron-LM's ``get_model`` gives pipeline rank ``pp_rank`` holding
    ``numel`` parameter elements (one model chunk: no virtual stages): none without
    ``overlap_grad_reduce`` and on stages after the first; else ``ddp_bucket_size``, or the
    parameters over ``ddp_num_buckets``, or max(40M, 1M x DP x CP). Only ``args`` that a reshard
    keeps are read (not the TP or PP size)."""
    if not getattr(args, "overlap_grad_reduce", False) or pp_rank > 0:
        return None
    if getattr(args, "overlap_param_gather_with_optimizer_step", False):
        return None
    buckets = getattr(args, "ddp_num_buckets", None)
    if buckets:
        return numel // int(buckets)
    size = getattr(args, "ddp_bucket_size", None)
    if size:
        return int(size)
    dp = int(getattr(args, "data_parallel_size", 1) or 1) * int(getattr(args, "context_parallel_size", 1) or 1)
    return max(40_000_000, 1_000_000 * dp)


def chunk_shared_embedding(args: Any, pp_rank: int, pp: int, chunk: int, chunks: int) -> frozenset[str]:
    """:func:`shared_embedding` for model chunk ``chunk`` of ``chunks`` (virtual pipeline stages):
    the embedding is in the first chunk of the first stage, the output layer in the last chunk of
    the last stage."""
    first, last = chunk == 0, chunk == chunks - 1
    return frozenset(n for n in shared_embedding(args, pp_rank, pp) if (first if n.startswith("embedding.") else last))


def shared_embedding(args: Any, pp_rank: int, pp: int) -> frozenset[str]:
    """The parameters megatron-core marks ``shared_embedding`` on pipeline rank ``pp_rank`` of ``pp``
    (they get a bucket of their own): the tied word embedding on the first stage and its copy as
    the output layer on the last, when there is more than one stage. megatron-core marks an MTP
    stage's copy of the embeddings too; registered first in its chunk, it lies last in the buffer,
    where a bucket of its own starts at the same offset, so it is left out. With the MTP layers in
    the last chunk that copy is the one it marks, not the (unused) output layer
    (:func:`unused_output_layer`): nothing on that stage."""
    if pp == 1 or getattr(args, "untie_embeddings_and_output_weights", False):
        return frozenset()
    if pp_rank == 0:
        return frozenset({"embedding.word_embeddings.weight"})
    if pp_rank == pp - 1 and not unused_output_layer(args, pp):
        return frozenset({"output_layer.weight"})
    return frozenset()


_GROUPED_WEIGHT = re.compile(r"\.mlp\.experts\.weight([12])$")


def grouped_experts(name: str, first: int, local: int) -> list[str] | None:
    """The items a GroupedMLP weight ``name`` (``….mlp.experts.weight1``/``weight2``, layer numbered
    globally) is read as: its ``local`` experts' ``….mlp.experts.local_experts.<first + j>.linear_fc<1|2>.weight``
    (None: ``name`` is not such a weight)."""
    m = _GROUPED_WEIGHT.search(name)
    if m is None:
        return None
    head = name[: m.start() + len(".mlp.experts.")]
    return [f"{head}local_experts.{first + j}.linear_fc{m[1]}.weight" for j in range(local)]


@dataclass(frozen=True, slots=True)
class GroupedWeights:
    """How megatron-core's legacy GroupedMLP keeps one rank's local experts (``experts.py``): two
    parameters, ``weight1`` of nominal shape ``[hidden, E·c1]`` and ``weight2`` of ``[E·c2, hidden]``
    (``c1`` = the rank's fc1 rows: ``2·ffn/ETP`` under SwiGLU, its ``[gate_t; up_t]`` as
    SequentialMLP's; ``c2 = ffn/ETP``), whose memory is really ``[E, hidden, c1]`` and ``[E, c2,
    hidden]`` (its forward and its sharded state dict view them so). Expert ``j``'s
    ``linear_fc1.weight`` (``[c1, hidden]``, as SequentialMLP's) is the transpose of block ``j`` of
    weight1, and its ``linear_fc2.weight`` (``[hidden, c2]``) the transpose of block ``j`` of weight2:
    strided views of the same bytes, named ``local_experts.<ep_rank·E + j>.linear_fc<1|2>.weight``
    as SequentialMLP's, so every command reads them as it reads SequentialMLP's experts. The
    optimizer's state of a weight has its shape and is cut the same way."""

    prefix: str  # the name up to ``mlp.experts.``
    which: int  # 1: weight1 (fc1), 2: weight2 (fc2)
    shape: tuple[int, int]  # the nominal shape
    hidden: int
    first: int  # the global number of the rank's first expert
    local: int  # experts on the rank

    @classmethod
    def of(
        cls, name: str, ref: _unpickle.TensorRef, args: Any, ep_rank: int, local: int | None, rel: str
    ) -> GroupedWeights:
        hidden = getattr(args, "hidden_size", None)
        which = int(name[-1])
        rows, cols = ref.shape if len(ref.shape) == 2 else (0, 0)
        block = cols if which == 1 else rows
        if not local or not isinstance(hidden, int) or (rows if which == 1 else cols) != hidden or block % local:
            raise CorruptFileError(
                f"{rel}: {name} is {list(ref.shape)}; a GroupedMLP weight{which} of {local} local experts and "
                f"hidden size {hidden} is [{'hidden, experts x ffn' if which == 1 else 'experts x ffn, hidden'}]",
                hint="the args do not describe this model (num_experts, expert_model_parallel_size, hidden_size)",
                path=rel,
            )
        prefix = name[: -len("weight1")]
        return cls(prefix, which, (rows, cols), hidden, ep_rank * local, local)

    def views(self, ref: _unpickle.TensorRef, rel: str) -> list[tuple[str, _unpickle.TensorRef]]:
        """Each expert's name and its view of ``ref`` (the weight or a state of its shape)."""
        rows, cols = self.shape
        if ref.shape != self.shape or ref.stride != (cols, 1):
            raise CorruptFileError(
                f"{rel}: the state of {self.prefix}weight{self.which} is {list(ref.shape)} with strides "
                f"{list(ref.stride)}; expected the weight's own contiguous {list(self.shape)}",
                path=rel,
            )
        c = (cols if self.which == 1 else rows) // self.local
        block = self.hidden * c
        shape = (c, self.hidden) if self.which == 1 else (self.hidden, c)
        stride = (1, c) if self.which == 1 else (1, self.hidden)
        names = grouped_experts(f"{self.prefix}weight{self.which}", self.first, self.local) or []
        return [
            (name, _unpickle.TensorRef(ref.storage, ref.storage_offset + j * block, shape, stride, ref.dtype))
            for j, name in enumerate(names)
        ]


def is_expert(name: str) -> bool:
    """Whether ``name`` is a routed expert's parameter (megatron-core keeps those out of the dense
    optimizer and grad buffers under expert parallelism; shared experts are dense)."""
    return ".mlp.experts." in name


def optimizer_members(
    opt: Any, params: list[tuple[str, tuple[int, ...]]], rel: str
) -> list[tuple[dict[str, Any], list[tuple[str, tuple[int, ...]]]]]:
    """A rank file's ``optimizer`` entry as (optimizer state dict, the parameters it holds, in model
    order) pairs: one for a single optimizer, one per member of a ``ChainedOptimizer`` list (the
    dense parameters, then the experts': megatron-core's ``get_megatron_optimizer`` order; a stage
    without experts still has the expert member, with empty groups). Each state dict is
    ``{"optimizer": torch state dict, ...}``: the mixed-precision optimizers' own, an FP32
    optimizer's bare torch state dict wrapped so. Nothing for a missing entry; a distributed
    optimizer's members (groups without parameters) give pairs that match no parameter."""

    def wrapped(o: Any) -> dict[str, Any]:
        if isinstance(o, dict) and isinstance(o.get("optimizer"), dict):
            return o
        if isinstance(o, dict) and "param_groups" in o and "state" in o:  # FP32Optimizer: torch's own
            return {"optimizer": o}
        raise CorruptFileError(
            f"{rel}: the optimizer entry is a {type(o).__name__}"
            + (f" with keys {sorted(map(str, o))[:6]}" if isinstance(o, dict) else "")
            + ", not an optimizer state dict",
            hint="the file is damaged, or was saved by an optimizer ckpttool does not know",
            path=rel,
        )

    if opt is None:
        return []
    if not isinstance(opt, list):
        return [(wrapped(opt), params)]
    members = [wrapped(o) for o in opt]
    if len(members) == 1:
        return [(members[0], params)]
    dense = [x for x in params if not is_expert(x[0])]
    experts = [x for x in params if is_expert(x[0])]
    groups = [[g for g in m["optimizer"].get("param_groups") or [] if isinstance(g, dict)] for m in members]
    flags = [{bool(g.get("is_expert_parallel")) for g in gs} for gs in groups]
    # a stage without routed experts: megatron-core aligns the groups over all ranks, so its expert
    # optimizer is there with empty groups
    idle = len(members) == 2 and not experts and not any(g.get("params") for g in groups[1])
    if len(members) != 2 or flags[0] == {True} or flags[1] == {False} or (not experts and not idle):
        raise CorruptFileError(
            f"{rel}: a chained optimizer of {len(opt)} members (expert-parallel groups: "
            f"{[sorted(f) for f in flags]}) over {len(experts)} expert parameters; expected two, the dense "
            "parameters' then the experts'",
            hint="ckpttool reads megatron-core's dense + expert chain; other chains are not supported yet",
            path=rel,
        )
    return [(members[0], dense), (members[1], experts)]


_LOCAL_EXPERT = re.compile(r"(\.experts\.local_experts\.)(\d+)(\.)")
_GROUPED_EXPERT = re.compile(r"(\.experts\.linear_fc[12]\.(?:weight|bias))(\d+)$")


def _expert_match(name: str) -> tuple[re.Match[str], bool] | None:
    """The match of a routed expert's number in ``name`` and whether it is a grouped-GEMM name."""
    for pattern, grouped in ((_LOCAL_EXPERT, False), (_GROUPED_EXPERT, True)):
        m = pattern.search(name)
        if m is not None:
            return m, grouped
    return None


def expert_slot(name: str) -> tuple[str, int, bool] | None:
    """For a routed expert's entry: the name with its expert number replaced by ``*``, the number,
    and whether it is a grouped-GEMM name (``linear_fc1.weight<j>``: the experts' tensors follow
    one another weight by weight, where SequentialMLP's follow expert by expert). None otherwise."""
    found = _expert_match(name)
    if found is None:
        return None
    m, grouped = found
    return name[: m.start(2)] + "*" + name[m.end(2) :], int(m[2]), grouped


def experts_owner(name: str) -> str | None:
    """The module whose routed experts ``name`` is an entry of (``decoder.layers.3.mlp``,
    ``mtp.layers.0.transformer_layer.mlp``), or None for entries of no single expert."""
    found = _expert_match(name)
    return None if found is None else name[: found[0].start()]  # (both patterns start at ".experts.")


def expert_of(name: str) -> int | None:
    """The routed expert number in ``name`` (``local_experts.<j>.`` of SequentialMLP,
    ``linear_fc1.weight<j>`` of TEGroupedMLP), or None for entries of no single expert."""
    slot = expert_slot(name)
    return slot[1] if slot else None


def renumber_expert(name: str, fn: Callable[[int], int]) -> str:
    """``name`` with its expert number ``j`` replaced by ``fn(j)``."""
    name = _LOCAL_EXPERT.sub(lambda m: f"{m[1]}{fn(int(m[2]))}{m[3]}", name)
    return _GROUPED_EXPERT.sub(lambda m: f"{m[1]}{fn(int(m[2]))}", name)


def _global_expert(name: str, ep_rank: int, local_experts: int) -> str:
    """MoE expert names carry local indices in legacy files: ``local_experts.<j>`` (SequentialMLP)
    and ``linear_fc1.weight<j>`` (TEGroupedMLP) become ``ep_rank · local_experts + j``."""
    return renumber_expert(name, lambda j: ep_rank * local_experts + j)


def rank_dir(t: int, p: int, pp: int, e: int = 0, ep: int = 1) -> str:
    """Megatron-LM's rank directory: ``mp_rank_TT``, ``_PPP`` when PP > 1, ``_EEE`` when EP > 1."""
    return f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") + (f"_{e:03d}" if ep > 1 else "")


def _coords(rank: int, order: list[str], sizes: dict[str, int]) -> dict[str, int]:
    """The rank's coordinate on each axis of megatron-core's ``RankGenerator``: mixed radix, the
    first axis of ``order`` varying fastest."""
    out = {}
    for axis in order:
        out[axis] = rank % sizes[axis]
        rank //= sizes[axis]
    return out


def own_etp(args: Any) -> int:
    """The expert tensor-parallel size of a run whose routed experts are split their own way
    (``expert_tensor_parallel_size`` set and ≠ TP); 0 when they are split as the other layers."""
    etp = _int_arg(args, "expert_tensor_parallel_size", 0)
    if not _int_arg(args, "num_experts", 0) or etp == _int_arg(args, "tensor_model_parallel_size"):
        return 0
    return etp


class Saver(NamedTuple):
    """The rank that saves a legacy rank directory under expert tensor parallelism."""

    etp: int
    """the ETP rank of the experts it saves"""
    rank: int
    """its global rank"""
    dp: int
    """its dense data-parallel rank counting context parallelism (``cp + CP·dp``, megatron-core's
    DP-CP group; 0: it saves the dense optimizer's ``distrib_optim.pt`` state)"""


def _rank_sizes(args: Any) -> dict[str, Any]:
    """The sizes :func:`saving_ranks` takes, from a run's ``args`` (ETP = TP and EP = 1 where
    the experts are not split their own way, or there are none)."""
    tp = _int_arg(args, "tensor_model_parallel_size")
    return {
        "tp": tp,
        "etp": own_etp(args) or tp,
        "ep": _int_arg(args, "expert_model_parallel_size") if _int_arg(args, "num_experts", 0) else 1,
        "pp": _int_arg(args, "pipeline_model_parallel_size"),
        "cp": _int_arg(args, "context_parallel_size"),
        "world": _int_arg(args, "world_size", 0),
        "tp_pp_dp": bool(getattr(args, "use_tp_pp_dp_mapping", False)),
    }


def _etp_sizes(args: Any) -> dict[str, Any] | None:
    """:func:`_rank_sizes`; None when the run's experts are split as the other layers."""
    return _rank_sizes(args) if own_etp(args) else None


def expert_tp_ranks(args: Any) -> dict[tuple[int, int, int], Saver] | None:
    """:func:`saving_ranks` of a run's ``args``; None when its experts are split as the other layers."""
    sizes = _etp_sizes(args)
    return None if sizes is None else saving_ranks(**sizes)


def saving_ranks(
    *, tp: int, etp: int, ep: int, pp: int, cp: int, world: int, tp_pp_dp: bool
) -> dict[tuple[int, int, int], Saver]:
    """Under expert tensor parallelism (ETP ≠ TP), the rank that saves each legacy rank directory
    (:class:`Saver`: its experts' ETP rank, its global rank, its dense DP-CP rank), by the
    directory's (TP, PP, EP) rank.

    megatron-core lays both the dense ranks (TP, CP, DP, PP) and the expert ranks (ETP, EP, expert
    DP, PP) over the world in one order (``tp-cp-ep-dp-pp``, or ``tp-cp-ep-pp-dp`` with
    ``--use-tp-pp-dp-mapping``: ``tp_pp_dp``), and the ranks of expert DP rank 0 save the legacy
    files, named by their dense TP rank and their EP rank.

    Raises ValueError for sizes that lay out no such world, where two ranks save one directory
    (Megatron-LM then writes one over the other), or where the saving ranks leave a TP or expert
    part unsaved."""
    if world > 1 << 20:
        raise ValueError(f"world size {world:,} is not plausible")
    if not world or world % (tp * cp * pp) or world % (etp * ep * pp):
        raise ValueError(
            f"world size {world or 'unknown'} is not a whole number of TP={tp} x CP={cp} x PP={pp} dense and "
            f"ETP={etp} x EP={ep} x PP={pp} expert groups"
        )
    order, dense, expert = _rank_axes(tp=tp, etp=etp, ep=ep, pp=pp, cp=cp, world=world, tp_pp_dp=tp_pp_dp)
    out: dict[tuple[int, int, int], Saver] = {}
    for r in range(world):
        d, x = _coords(r, order, dense), _coords(r, order, expert)
        if x["dp"]:
            continue
        key = (d["tp"], d["pp"], x["ep"])
        if out.setdefault(key, Saver(x["tp"], r, d["cp"] + cp * d["dp"])).etp != x["tp"]:
            raise ValueError(
                f"the experts of ETP ranks {out[key].etp} and {x['tp']} are both saved as TP rank {key[0]}, PP rank "
                f"{key[1]}, EP rank {key[2]}: one rank's file overwrote the other's"
            )
    # Megatron-LM's legacy save can drop ranks: every dense TP part and every expert part must be saved
    dropped = sorted({(t, p) for t in range(tp) for p in range(pp)} - {(t, p) for t, p, _ in out})
    experts_held = {(saver.etp, p, e) for (_, p, e), saver in out.items()}
    if dropped or len(experts_held) != etp * pp * ep:
        raise ValueError(
            "the ranks of expert-DP rank 0, which save the legacy files, do not hold "
            + (f"TP rank {dropped[0][0]} of PP rank {dropped[0][1]}" if dropped else "every expert's part")
            + f" (TP={tp} ETP={etp} EP={ep}): a legacy checkpoint cannot hold this layout"
        )
    return out


def _rank_axes(
    *, tp: int, etp: int, ep: int, pp: int, cp: int, world: int, tp_pp_dp: bool
) -> tuple[list[str], dict[str, int], dict[str, int]]:
    """megatron-core's rank order and the sizes of the dense and the expert axes over one world."""
    order = ["tp", "cp", "ep", "pp", "dp"] if tp_pp_dp else ["tp", "cp", "ep", "dp", "pp"]
    dense = {"tp": tp, "cp": cp, "ep": 1, "dp": world // (tp * cp * pp), "pp": pp}
    expert = {"tp": etp, "cp": 1, "ep": ep, "dp": world // (etp * ep * pp), "pp": pp}
    return order, dense, expert


def rng_holders(args: Any) -> tuple[dict[tuple[int, int, int], tuple[int, int, int]], int]:
    """Under expert tensor parallelism, the legacy rank file (TP, PP, EP rank) that holds the RNG
    state of each dense rank (TP t, PP p, DP-CP rank d = ``cp + CP·dp``, as torch_dist's RNG shards
    count it) of the run: the file that rank saved, or else one whose saving rank has the same TP,
    PP, EP and expert-TP ranks, as megatron-core seeds a rank's generators from those alone
    (``_set_random_seed``, ``model_parallel_cuda_manual_seed``; with ``data_parallel_random_init``
    each file holds the states of its whole DP group). Ranks that no saved file stands for are left
    out. Also returns the DP-CP size; ({}, 1) when the experts split as the other layers."""
    sizes = _etp_sizes(args)
    if sizes is None:
        return {}, 1
    savers = saving_ranks(**sizes)
    order, dense, expert = _rank_axes(**sizes)
    out: dict[tuple[int, int, int], tuple[int, int, int]] = {}
    for r in range(sizes["world"]):
        d, x = _coords(r, order, dense), _coords(r, order, expert)
        key = (d["tp"], d["pp"], x["ep"])
        saver = savers.get(key)
        if saver is not None and (saver.rank == r or saver.etp == x["tp"]):
            out[(d["tp"], d["pp"], d["cp"] + sizes["cp"] * d["dp"])] = key
    return out, sizes["world"] // (sizes["tp"] * sizes["pp"])


def rank_of(directory: str, pp: int) -> tuple[int, int, int]:
    """(TP, PP, EP) rank of a legacy rank directory: ``mp_rank_TT[_PPP][_EEE]``, where a lone
    second number is the PP rank when PP > 1 and the EP rank otherwise (Megatron-LM appends the EP
    suffix whatever came before; only ``args`` tell the two apart)."""
    m = _MP_DIR.match(directory)
    if m is None:
        raise ValueError(f"{directory}: not an mp_rank_* directory")
    t, b, c = int(m[1]), m[2], m[3]
    return (t, int(b or 0), int(c or 0)) if pp > 1 else (t, 0, int(b or 0))


def _list(root: Path, prefix: str, dirs: list[str]) -> list[tuple[str, int]]:
    out = []
    for d in dirs:
        if left_out(root, f"{prefix}{d}"):
            continue
        for p in sorted(Path(confine(root, f"{prefix}{d}", named_by="the listing")).iterdir()):
            if p.is_file() and not left_out(root, f"{prefix}{d}/{p.name}"):
                rel = f"{prefix}{d}/{p.name}"
                out.append((rel, os.stat(confine(root, rel, named_by="the listing")).st_size))
    return out


ADAPTER = MegatronDistAdapter()
ADAPTERS = [MegatronDistAdapter(), MegatronLegacyAdapter()]
