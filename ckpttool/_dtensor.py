"""DTensors in ``torch.save`` pickles: the state dicts of FSDP2 and tensor-parallel models, saved
one file per rank.

``torch.save`` pickles a DTensor as a wrapper (its global shape and dtype, no storage) whose state
holds the rank's local tensor and its spec: the device mesh (its shape, and this rank's coordinate
on it), one placement per mesh dimension (``Shard(d)``, ``_StridedShard(d, sf)``, ``Replicate()``,
``Partial()``), and the global shape again. :data:`DTENSORS` reads those into a
:class:`DTensorRef` without running anything; :func:`local_parts` says which regions of the global
tensor the local one holds, as DTensor lays them out (checked against torch's own layout in the
tests and against ``full_tensor()`` on real saves).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import itertools
import math
import pickle
from dataclasses import dataclass
from typing import Any

from ckpttool._unpickle import (
    Record,
    TensorRef,
    TorchDType,
    WrapperType,
    _copied,
    _refuse_state,
    brief,
    record,
)

MAX_MESH_DIMS = 8
"""most dimensions a device mesh may have (torchtitan's deepest: pp, dp_replicate, dp_shard, cp, tp)"""
MAX_SPLIT_FACTOR = 1 << 12
"""largest ``_StridedShard`` split factor read (the ranks of the mesh dimensions that cut first)"""
MAX_PARTS = 1 << 12
"""most regions one rank's DTensor may hold (each a piece of the manifest)"""


@dataclass(frozen=True, slots=True)
class DTensorRef:
    """One rank's DTensor: its local tensor and where that lies in the global one."""

    local: TensorRef
    shape: tuple[int, ...]
    """the global shape"""
    placements: tuple[tuple[Any, ...], ...]
    """per mesh dimension: ``("shard", dim)``, ``("strided", dim, split_factor)``, ``("replicate",)`` or
    ``("partial", reduce_op)``"""
    mesh_shape: tuple[int, ...]
    coordinate: tuple[int, ...] | None
    """this rank's place on the mesh (None: the rank is not on it, and holds none of the tensor)"""
    rank: int | None = None
    """the global rank that saved it, where the mesh says"""
    mesh_dim_names: tuple[str, ...] | None = None
    world: tuple[tuple[str | None, int], ...] | None = None
    """the dimensions (name, size) of the mesh the job made first (this one's root; this one where it
    is a root), where the pickle says: their product is the world size"""

    @property
    def dtype(self) -> str:
        return self.local.dtype

    def describe(self) -> str:
        """``(Shard(0), Replicate()) on a 2x2 mesh (dp, tp) at (0, 1)``"""
        said = ", ".join(_placement_text(p) for p in self.placements)
        names = f" ({', '.join(self.mesh_dim_names)})" if self.mesh_dim_names else ""
        mesh = "x".join(map(str, self.mesh_shape)) if len(self.mesh_shape) > 1 else f"{self.mesh_shape[0]}-rank"
        if self.coordinate is None:
            return f"({said}) on a {mesh} mesh{names}, saved by a rank not on it"
        at = ", ".join(map(str, self.coordinate))
        return f"({said}) on a {mesh} mesh{names} at ({at})"


def _placement_text(p: tuple[Any, ...]) -> str:
    if p[0] == "shard":
        return f"Shard({p[1]})"
    if p[0] == "strided":
        return f"_StridedShard({p[1]}, sf={p[2]})"
    if p[0] == "replicate":
        return "Replicate()"
    return f"Partial({p[1]})"


class DTensorError(ValueError):
    """A DTensor whose local tensor is not a piece of its global one (a pending sum), or whose spec
    its local tensor contradicts."""


def local_parts(ref: DTensorRef) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """The regions of the global tensor that ``ref``'s local tensor holds, as ``(global offset,
    shape, offset in the local tensor)``: one region, except where a ``_StridedShard`` gives a rank
    rows from several places. Raises :class:`DTensorError` for a ``Partial`` placement (the ranks'
    local tensors are terms of a sum, not pieces) and where the local shape is not the one the
    placements give.

    Each tensor dimension's indices are refined mesh dimension by mesh dimension, left to right, as
    DTensor lays them out: ``Shard`` over ``k`` ranks cuts the indices held so far into ``k``
    chunks of ``ceil(n / k)`` (the last ones shorter or empty) and keeps the coordinate's chunk;
    ``_StridedShard(sf)`` first cuts them into ``sf`` such chunks, cuts each of those into ``k``,
    and keeps the coordinate's chunk of each, in order."""
    for p in ref.placements:
        if p[0] == "partial":
            raise DTensorError(f"a DTensor {ref.describe()} holding a pending {p[1]}")
    if ref.coordinate is None:  # (an empty local tensor, checked as it was read)
        return []
    runs: list[list[tuple[int, int]]] = [[(0, n)] if n else [] for n in ref.shape]
    for mesh_dim, p in enumerate(ref.placements):
        if p[0] not in ("shard", "strided"):
            continue
        k, c = ref.mesh_shape[mesh_dim], ref.coordinate[mesh_dim]
        dim = p[1]
        indices = _Indices(runs[dim])
        total = indices.cum[-1]
        # (_StridedShard: cut into sf chunks first, then each of those over the mesh dimension)
        cuts = [(0, total)] if p[0] == "shard" else [_chunk(0, total, p[2], i) for i in range(p[2])]
        kept: list[tuple[int, int]] = []
        for lo, hi in cuts:
            indices.take(*_chunk(lo, hi, k, c), kept)
            if len(kept) > MAX_PARTS:
                raise DTensorError(
                    f"placements {ref.describe()} that cut dimension {dim} into more than {MAX_PARTS} runs"
                )
        runs[dim] = kept
    held = tuple(sum(n for _, n in r) for r in runs)
    if held != ref.local.shape:
        raise DTensorError(
            f"a local tensor of shape {list(ref.local.shape)} where its placements {ref.describe()} give "
            f"{list(held)} of the global {list(ref.shape)}"
        )
    if any(not r for r in runs):  # (an empty local tensor: one empty region, at the origin)
        return [((0,) * len(ref.shape), ref.local.shape, (0,) * len(ref.shape))]
    if math.prod(len(r) for r in runs) > MAX_PARTS:
        raise DTensorError(f"placements {ref.describe()} that cut it into more than {MAX_PARTS} regions")
    local_starts = [list(itertools.accumulate((n for _, n in r), initial=0)) for r in runs]
    parts = []
    for picks in itertools.product(*(range(len(r)) for r in runs)):
        offset = tuple(runs[d][i][0] for d, i in enumerate(picks))
        shape = tuple(runs[d][i][1] for d, i in enumerate(picks))
        at = tuple(local_starts[d][i] for d, i in enumerate(picks))
        parts.append((offset, shape, at))
    return parts


def _chunk(lo: int, hi: int, k: int, c: int) -> tuple[int, int]:
    """Chunk ``c`` of positions ``lo..hi`` cut into ``k`` as ``torch.chunk`` cuts them: ``ceil(n / k)``
    each, the last ones shorter or empty."""
    size = -(-(hi - lo) // k)
    return min(lo + c * size, hi), min(lo + (c + 1) * size, hi)


class _Indices:
    """The global indices a dimension holds so far (runs of consecutive ones, in local order), by
    position: ``take(a, b)`` appends those at positions ``a..b``."""

    def __init__(self, runs: list[tuple[int, int]]) -> None:
        self.runs = runs
        self.cum = list(itertools.accumulate((n for _, n in runs), initial=0))

    def take(self, a: int, b: int, out: list[tuple[int, int]]) -> None:
        i = bisect.bisect_right(self.cum, a) - 1
        while a < b and i < len(self.runs):
            start, n = self.runs[i]
            lo, hi = max(a, self.cum[i]), min(b, self.cum[i] + n)
            if lo < hi:
                at = start + lo - self.cum[i]
                if out and out[-1][0] + out[-1][1] == at:  # (adjacent: one run)
                    out[-1] = (out[-1][0], out[-1][1] + hi - lo)
                else:
                    out.append((at, hi - lo))
            i += 1
            if self.cum[i] >= b:
                break


def local_view(local: TensorRef, at: tuple[int, ...], shape: tuple[int, ...]) -> TensorRef:
    """The region of ``local`` from ``at`` of ``shape``, as a view of its storage."""
    offset = local.storage_offset + sum(a * s for a, s in zip(at, local.stride, strict=True))
    return dataclasses.replace(local, storage_offset=offset, shape=shape, extra={})


# -- stand-ins for what a pickled DTensor names --------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Wrapper:
    """What ``torch._utils._rebuild_wrapper_subclass`` makes of a DTensor: its global dtype and shape."""

    dtype: str
    shape: tuple[int, ...]

    __setstate__ = _refuse_state


class DTensorType(WrapperType):
    """``torch.distributed.tensor.DTensor``, named as the class of a wrapper and of its rebuild."""

    __setstate__ = _refuse_state

    @classmethod
    def rebuild(cls, func: Any, args: Any, state: Any) -> DTensorRef:
        """The DTensor ``_rebuild_from_type_v2(func, DTensor, args, state)`` makes."""
        wrapper = func(*args) if callable(func) and isinstance(args, tuple) else None
        if not isinstance(wrapper, _Wrapper):
            raise pickle.UnpicklingError(f"a DTensor rebuilt from {brief(func, 40)}, not from its wrapper")
        # (torch pickles a subclass's state as its __dict__, or as (__dict__, slots) where it has slots:
        # DTensor keeps its local tensor and spec in slots)
        parts = state if type(state) is tuple and len(state) == 2 else (state,)
        if not all(p is None or type(p) is dict for p in parts):
            raise pickle.UnpicklingError(f"a DTensor whose state is {brief(state, 60)}, not its attributes")
        fields = {k: p[k] for p in parts if p for k in ("_local_tensor", "_spec") if k in p}  # (not walked: memo)
        return _dtensor(wrapper, fields)


def _rebuild_wrapper_subclass(
    cls: Any, dtype: Any, size: Any, stride: Any, offset: Any, layout: Any, device: Any, requires_grad: Any = False
) -> _Wrapper:
    if cls is not DTensorType:
        raise pickle.UnpicklingError(f"a tensor subclass {brief(cls, 40)} (only DTensor is read)")
    if not isinstance(dtype, TorchDType):
        raise pickle.UnpicklingError(f"a DTensor of dtype {brief(dtype, 40)}")
    if layout != "torch.strided":
        raise pickle.UnpicklingError(f"a DTensor of layout {brief(layout, 40)}, which ckpttool does not read")
    return _Wrapper(str(dtype), _sizes(size, "DTensor shape"))


def _get_layout(name: Any) -> str:
    if type(name) is not str or len(name) > 64:
        raise pickle.UnpicklingError(f"torch layout {brief(name, 40)}")
    return name


def _sizes(value: Any, what: str) -> tuple[int, ...]:
    if not (isinstance(value, tuple) and len(value) <= 64 and all(type(v) is int and 0 <= v <= 2**48 for v in value)):
        raise pickle.UnpicklingError(f"{what} {brief(value, 60)}")
    return tuple(value)


class _NamedTuple(tuple[Any, ...]):
    """A NamedTuple of DTensor's spec (``TensorMeta``, ``ShardOrderEntry``), pickled as a call with its
    fields."""

    __slots__ = ()
    __setstate__ = _refuse_state

    def __new__(cls, *args: Any) -> _NamedTuple:
        if len(args) > 4:
            raise pickle.UnpicklingError(f"{cls.__name__} of {len(args)} fields")
        return tuple.__new__(cls, args)


class TensorMeta(_NamedTuple):
    __slots__ = ()


class ShardOrderEntry(_NamedTuple):
    __slots__ = ()


_PLACEMENTS = ("Shard", "_StridedShard", "Replicate", "Partial", "_Partial")
_DTENSOR_MODULES = ("torch.distributed.tensor", "torch.distributed._tensor")


def _names(*pairs: tuple[tuple[str, ...], str]) -> list[tuple[str, str]]:
    return [(m, n) for modules, n in pairs for m in modules]


DTENSORS: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_wrapper_subclass"): _rebuild_wrapper_subclass,
    ("torch.serialization", "_get_layout"): _get_layout,
    **{
        key: DTensorType
        for key in _names(
            (("torch.distributed.tensor", "torch.distributed.tensor._api"), "DTensor"),
            (("torch.distributed._tensor", "torch.distributed._tensor.api"), "DTensor"),
        )
    },
    **{
        (f"{m}.{sub}", name): cls
        for m in _DTENSOR_MODULES
        for sub in ("_dtensor_spec", "placement_types")
        for name, cls in (("TensorMeta", TensorMeta), ("ShardOrderEntry", ShardOrderEntry))
    },
    **{
        (f"{m}.{sub}", "DTensorSpec"): record(f"{m}.{sub}.DTensorSpec")
        for m in _DTENSOR_MODULES
        for sub in ("_dtensor_spec", "placement_types")
    },
    **{
        (f"{m}.placement_types", name): record(f"{m}.placement_types.{name}")
        for m in _DTENSOR_MODULES
        for name in _PLACEMENTS
    },
    **{
        key: record(f"{key[0]}.{key[1]}")
        for key in (
            ("torch.distributed.device_mesh", "DeviceMesh"),
            ("torch.distributed._tensor.device_mesh", "DeviceMesh"),
            ("torch.distributed._mesh_layout", "_MeshLayout"),
            ("torch.distributed._mesh_layout", "_FlatLayout"),
        )
    },
}
"""Globals a pickled DTensor names (torch 2.13's, and the ``torch.distributed._tensor`` spellings of
the releases before ``torch.distributed.tensor``)."""


def _dtensor(wrapper: _Wrapper, state: dict[str, Any]) -> DTensorRef:
    local, spec = state.get("_local_tensor"), state.get("_spec")
    if not isinstance(local, TensorRef):
        raise pickle.UnpicklingError(f"a DTensor whose local tensor is {type(local).__name__}")
    if local.dtype != wrapper.dtype:
        raise pickle.UnpicklingError(f"a DTensor of {wrapper.dtype} whose local tensor is {local.dtype}")
    if not isinstance(spec, Record):
        raise pickle.UnpicklingError(f"a DTensor whose spec is {type(spec).__name__}")
    fields = spec.__dict__
    meta, mesh = fields.get("tensor_meta"), fields.get("mesh")
    if not isinstance(meta, TensorMeta) or not meta or _sizes(meta[0], "DTensor shape") != wrapper.shape:
        raise pickle.UnpicklingError(f"a DTensor of shape {list(wrapper.shape)} whose spec says {brief(meta, 60)}")
    if not isinstance(mesh, Record):
        raise pickle.UnpicklingError(f"a DTensor whose device mesh is {type(mesh).__name__}")
    mesh_shape = _mesh_shape(mesh.__dict__)
    coordinate = mesh.__dict__.get("_coordinate_on_dim")
    if coordinate is None:  # (a rank outside the mesh: it holds nothing of the tensor)
        if math.prod(local.shape):
            raise pickle.UnpicklingError(
                f"a DTensor saved by a rank outside its device mesh (no coordinate on it) holding {list(local.shape)}"
            )
    elif not (
        isinstance(coordinate, list | tuple)
        and len(coordinate) == len(mesh_shape)
        and all(type(c) is int and 0 <= c < n for c, n in zip(coordinate, mesh_shape, strict=False))
    ):
        raise pickle.UnpicklingError(f"a DTensor at {brief(coordinate, 40)} on a mesh of shape {list(mesh_shape)}")
    raw = fields.get("placements")
    if not isinstance(raw, tuple | list) or len(raw) != len(mesh_shape):
        raise pickle.UnpicklingError(f"DTensor placements {brief(raw, 60)} on a {len(mesh_shape)}-d mesh")
    placements = tuple(_placement(p, len(wrapper.shape)) for p in raw)
    _check_order(fields.get("shard_order"), placements)
    rank = mesh.__dict__.get("_rank")
    names = _dim_names(mesh.__dict__, len(mesh_shape))
    root = mesh.__dict__.get("_root_mesh", mesh.__dict__.get("_parent_mesh"))
    world: tuple[tuple[str | None, int], ...] | None = None
    if root is None:
        world = _dims(mesh.__dict__, mesh_shape)
    elif isinstance(root, Record):
        with contextlib.suppress(pickle.UnpicklingError):  # (a root mesh unread: no world size said)
            world = _dims(root.__dict__, _mesh_shape(root.__dict__))
    return DTensorRef(
        local=local,
        shape=wrapper.shape,
        placements=placements,
        mesh_shape=mesh_shape,
        coordinate=tuple(coordinate) if coordinate is not None else None,
        rank=rank if type(rank) is int and rank >= 0 else None,
        mesh_dim_names=names,
        world=world,
    )


def _dims(fields: dict[str, Any], shape: tuple[int, ...]) -> tuple[tuple[str | None, int], ...]:
    names = _dim_names(fields, len(shape))
    return tuple(zip(names or (None,) * len(shape), shape, strict=True))


def _dim_names(fields: dict[str, Any], ndim: int) -> tuple[str, ...] | None:
    names = fields.get("_mesh_dim_names", fields.get("mesh_dim_names"))
    if isinstance(names, tuple | list) and len(names) == ndim and all(type(n) is str and len(n) < 64 for n in names):
        return tuple(names)
    return None


def _mesh_shape(fields: dict[str, Any]) -> tuple[int, ...]:
    """A device mesh's shape: from its layout (torch 2.9 on: one flat layout per mesh dimension,
    whose shape may itself be several dimensions flattened into one), else from its ``mesh`` tensor
    of ranks (before)."""
    layout = fields.get("_layout")
    if isinstance(layout, Record):
        axes = layout.__dict__.get("axes")
        if isinstance(axes, tuple) and 0 < len(axes) <= MAX_MESH_DIMS and all(isinstance(a, Record) for a in axes):
            sizes = [a.__dict__.get("shape") for a in axes]
            # (a mesh dimension of size 1 has the empty shape: its size, the empty product, is 1)
            if all(isinstance(s, tuple) and len(s) <= MAX_MESH_DIMS for s in sizes):
                shape = tuple(math.prod(_sizes(s, "device mesh layout")) for s in sizes)
                if all(shape):
                    return shape
        raise pickle.UnpicklingError(f"a device mesh of layout {brief(layout, 60)}")
    ranks = fields.get("mesh")
    if isinstance(ranks, TensorRef) and 0 < len(ranks.shape) <= MAX_MESH_DIMS and all(ranks.shape):
        return ranks.shape
    raise pickle.UnpicklingError("a device mesh with neither a layout nor a tensor of ranks")


def _placement(p: Any, ndim: int) -> tuple[Any, ...]:
    name = type(p)._qualname.rsplit(".", 1)[-1] if isinstance(p, Record) else None
    if name not in _PLACEMENTS:
        raise pickle.UnpicklingError(f"DTensor placement {brief(p, 60)}")
    fields = p.__dict__
    if name == "Replicate":
        return ("replicate",)
    if name in ("Partial", "_Partial"):
        op = fields.get("reduce_op", "sum")
        return ("partial", op if type(op) is str and len(op) <= 32 else "reduction")
    dim = fields.get("dim")
    if type(dim) is not int or not 0 <= dim < ndim:
        raise pickle.UnpicklingError(f"a DTensor of {ndim} dimensions sharded on dimension {brief(dim, 20)}")
    if name == "Shard":
        return ("shard", dim)
    sf = fields.get("split_factor")
    if type(sf) is not int or not 0 < sf <= MAX_SPLIT_FACTOR:
        raise pickle.UnpicklingError(f"_StridedShard split factor {brief(sf, 20)}")
    _copied(sf)  # (placing it cuts the dimension sf times: charged as copies, a DTensor made again and again)
    return ("strided", dim, sf)


def _check_order(order: Any, placements: tuple[tuple[Any, ...], ...]) -> None:
    """Refuse a shard order other than DTensor's default (each tensor dimension cut by its mesh
    dimensions left to right), which :func:`local_parts` does not lay out."""
    if order is None:
        return
    if not isinstance(order, tuple) or not all(isinstance(e, ShardOrderEntry) and len(e) == 2 for e in order):
        raise pickle.UnpicklingError(f"DTensor shard order {brief(order, 60)}")
    for tensor_dim, mesh_dims in order:
        if not (isinstance(mesh_dims, tuple) and all(type(m) is int for m in mesh_dims)):
            raise pickle.UnpicklingError(f"DTensor shard order {brief(order, 60)}")
        default = tuple(m for m, p in enumerate(placements) if p[0] in ("shard", "strided") and p[1] == tensor_dim)
        if mesh_dims != default:
            raise pickle.UnpicklingError(
                f"a DTensor whose dimension {tensor_dim} is sharded over mesh dimensions {list(mesh_dims)} in that "
                "order, which ckpttool does not lay out yet (only left to right); redistribute it before saving"
            )
