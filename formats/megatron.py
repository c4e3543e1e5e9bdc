"""Megatron-LM checkpoints: ``torch_dist`` (megatron-core ``dist_checkpointing``) and legacy
``mp_rank_*`` directories.

Both are read into the names the training code knew, with layers numbered globally
(``decoder.layers.3.mlp.linear_fc1.weight``) and optimizer state as the parameter name plus the
state name (``<param>.exp_avg``, ``<param>.exp_avg_sq``, master copies ``<param>.fp32``). See
``docs/formats/megatron.md``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ckpttool import _unpickle
from ckpttool.dtypes import dtype as lookup_dtype
from ckpttool.errors import CorruptFileError, IncompleteCheckpointError
from ckpttool.formats import _pt
from ckpttool.formats.base import Detection
from ckpttool.formats.dcp import DcpAdapter, DcpReader
from ckpttool.geometry import Box
from ckpttool.manifest import Item, Layout, Manifest, Piece
from ckpttool.naming import classify
from ckpttool.values import plain_value

TRACKER = "latest_checkpointed_iteration.txt"
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

_OPT_STATE = re.compile(r"^optimizer\.state\.(fp32_param|exp_avg|exp_avg_sq)\.(.+)$")
_STATE_SUFFIX = {"fp32_param": "fp32", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
# local-spec norms are saved under the TransformerEngine-spec keys in torch_dist
_TE_TO_LOCAL = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}


def _is_dist_config(path: Path) -> bool:
    """Whether ``path`` is megatron-core's dist_checkpointing ``metadata.json``."""
    try:
        return path.is_file() and "sharded_backend" in json.loads(path.read_text())
    except (OSError, ValueError, TypeError):
        return False


def _read_tracker(root: Path) -> Path:
    """The iteration directory a save directory's tracker file names."""
    text = (root / TRACKER).read_text().strip()
    if text == "release":
        target = root / "release"
    elif text.isdigit():
        target = root / f"iter_{int(text):07d}"
    else:
        raise CorruptFileError(
            f"{TRACKER}: expected an iteration number or 'release', found {text[:40]!r}", path=TRACKER
        )
    if not target.is_dir():
        raise IncompleteCheckpointError(
            f"{TRACKER} names iteration {text} but {target.name}/ does not exist",
            hint="the save was interrupted or the directory was deleted; list the iter_* directories and pass one",
            path=TRACKER,
        )
    return target


def _args_layout(args: Any) -> Layout:
    def get(name: str) -> int | None:
        v = getattr(args, name, None)
        return v if isinstance(v, int) and not isinstance(v, bool) else None

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
        if _is_dist_config(path / "metadata.json"):
            return path
        if (path / TRACKER).is_file():
            try:
                target = _read_tracker(path)
            except (CorruptFileError, IncompleteCheckpointError, OSError):
                return None
            return target if _is_dist_config(target / "metadata.json") else None
        return None

    def describe(self, path: Path) -> Manifest:
        if (path / TRACKER).is_file() and not (path / "metadata.json").is_file():
            path = _read_tracker(path)
        try:
            config = json.loads((path / "metadata.json").read_text())
        except (OSError, ValueError) as exc:
            raise CorruptFileError(f"metadata.json: not readable JSON ({exc})", path="metadata.json") from None
        backend = config.get("sharded_backend") if isinstance(config, dict) else None
        if backend != "torch_dist":
            raise CorruptFileError(
                f"metadata.json: sharded_backend is {backend!r}; ckpttool reads 'torch_dist' only",
                hint="re-save with --ckpt-format torch_dist",
                path="metadata.json",
            )
        base = DcpAdapter().describe(path)
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
        args = common.get("args")
        num_layers = getattr(args, "num_layers", None)
        local_spec = getattr(args, "transformer_impl", None) == "local"
        for item in base.items.values():
            for renamed in _split_layers(item, num_layers):
                _rename(renamed, local_spec)
                manifest.add(renamed)
        for key in ("iteration", "checkpoint_version", "num_floating_point_operations_so_far"):
            if key in common:
                manifest.add(
                    Item(
                        name=key,
                        kind="counter" if key == "iteration" else "object",
                        value=plain_value(common[key]),
                        pieces=[_pt.object_piece("common.pt", key)],
                    )
                )
        if isinstance(common.get("opt_param_scheduler"), dict):
            for k, v in common["opt_param_scheduler"].items():
                manifest.add(
                    Item(
                        name=f"opt_param_scheduler.{k}",
                        kind="scheduler",
                        value=plain_value(v),
                        pieces=[_pt.object_piece("common.pt", f"opt_param_scheduler.{k}")],
                    )
                )
        it = common.get("iteration")
        manifest.step = it if isinstance(it, int) else None
        manifest.layout = _args_layout(args) if args is not None else base.layout
        if args is not None:
            manifest.extras["args"] = _args_extras(args)
        manifest.extras["dcp"] = {"world_size": base.layout.world_size}
        return manifest

    def reader(self, manifest: Manifest) -> MegatronDistReader:
        return MegatronDistReader(manifest)


class MegatronDistReader(DcpReader):
    def __init__(self, manifest: Manifest) -> None:
        super().__init__(manifest)
        self._pt = _pt.PtReader(manifest, ALLOWLIST)

    def read_object(self, item: Item) -> Any:
        if item.pieces and item.pieces[0].file == "common.pt":
            return self._pt.read_object(item)
        return super().read_object(item)

    def close(self) -> None:
        self._pt.close()
        super().close()


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
    itemsize = lookup_dtype(item.dtype).itemsize
    out = []
    for layer in range(item.shape[0]):
        rest = param[len("decoder.layers.") :]
        layer_param = f"decoder.layers.{layer}.{rest}"
        new_name = f"optimizer.state.{m.group(1)}.{layer_param}" if m else layer_param
        pieces = []
        for p in item.pieces:
            lo, n = p.box.offsets[0], p.box.sizes[0]
            if not lo <= layer < lo + n:
                continue
            sub = Box(p.box.offsets[1:], p.box.sizes[1:])
            pieces.append(
                Piece(
                    file=p.file,
                    locator={**p.locator, "select0": layer - lo, "chunk_sizes": list(p.box.sizes)},
                    box=sub,
                    replica=p.replica,
                    rank=p.rank,
                    nbytes=sub.volume * itemsize,
                )
            )
        out.append(Item(name=new_name, kind=item.kind, dtype=item.dtype, shape=item.shape[1:], pieces=pieces))
    return out


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


ADAPTER = MegatronDistAdapter()
