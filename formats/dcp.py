"""PyTorch Distributed Checkpoint (``torch.distributed.checkpoint``), read without torch.

Layout (torch 2.13 ``FileSystemWriter``): a pickled ``.metadata`` and data files
``__{rank}_{n}.distcp``, each a concatenation of ``torch.save`` archives, one per stored chunk
(optionally zstd-framed). ``use_collectives=False`` saves write one ``__{rank}.metadata`` per rank
and no global file; we merge them. The ``HuggingFaceStorageWriter`` variant (safetensors shards
carrying ``DCP_SHARDING_INFO``) is read by :mod:`ckpttool.formats.safetensors`.

``.metadata`` is unpickled with stub classes for exactly the globals DCP writes (the allowlist
below); bytes items (non-tensor values) through the plain-value allowlist. Nothing else loads.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
from collections import ChainMap
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ckpttool import _torchzip, _unpickle
from ckpttool.assemble import item_coverage
from ckpttool.dtypes import BY_NAME
from ckpttool.dtypes import dtype as lookup_dtype
from ckpttool.errors import (
    CkptError,
    CorruptFileError,
    IncompleteCheckpointError,
    PathEscapeError,
    UnsafePickleError,
    raise_together,
)
from ckpttool.formats import _pt
from ckpttool.formats import safetensors as st
from ckpttool.formats.base import Detection, PieceReader
from ckpttool.geometry import Box
from ckpttool.io import RandomAccessFile, confine, left_out, list_files, outside
from ckpttool.manifest import UNSAFE_PICKLE, FileRecord, Item, Layout, Manifest, Piece, ReplicaCounter
from ckpttool.naming import classify
from ckpttool.values import find_step, plain_value, set_value

_GLOBAL_MD = ".metadata"
_RANK_MD = re.compile(r"^__(\d+)\.metadata$")
_DATA = re.compile(r"^__(\d+)_(\d+)\.distcp$")
_ZSTD = "stream.zstd/1"
_HF_SHARD = re.compile(r"^shard-(\d+)-model-\d+-of-\d+\.safetensors$")


# -- stand-ins for the classes pickled in .metadata ------------------------------------------------


class _Record(_unpickle.Record):
    """A dataclass instance from the pickle: attributes only, no behaviour (a Record, so that the
    unpickler's checks on the tree walk into it). Unhashable, as torch's dataclasses are (``eq``
    without ``frozen``): a damaged pickle that uses one as a dict key fails here as in torch."""

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({_unpickle.brief(self.__dict__, 400)})"


class _Metadata(_Record):
    state_dict_metadata: dict[str, Any]
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: Any = None
    version: str | None = None


class _TensorStorageMetadata(_Record):
    properties: Any
    size: tuple[int, ...]
    chunks: list[Any]


class _BytesStorageMetadata(_Record):
    pass


class _ChunkStorageMetadata(_unpickle.Fields):
    __slots__ = ("offsets", "sizes")
    __hash__ = None  # type: ignore[assignment]  # (as torch's, see _Record)
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


class _TensorProperties(_Record):
    dtype: str = "float32"

    def __setstate__(self, state: Any) -> None:
        # pickled as (dtype, layout, requires_grad, memory_format encoding, pin_memory)
        if isinstance(state, tuple) and len(state) == 5:
            if not isinstance(state[3], _MemFormat):  # torch refuses any other memory format too
                what = _unpickle.brief(state[3], 60)
                raise ValueError(f"invalid torch.memory_format encoding {what} in TensorProperties")
            if not isinstance(state[0], str):
                raise ValueError(f"TensorProperties dtype {_unpickle.brief(state[0], 60)} is not a torch dtype")
            self.dtype = str(state[0])
        elif isinstance(state, dict):
            super().__setstate__(state)
        else:
            raise ValueError(f"unexpected TensorProperties state {_unpickle.brief(state)}")


class _StorageMeta(_Record):
    checkpoint_id: Any = None
    save_id: str | None = None
    load_id: str | None = None
    modules: list[str] = []  # noqa: RUF012 - class default, never mutated


class _MetadataIndex(_unpickle.Fields):
    __slots__ = ("fqn", "index", "offset")
    fqn: str
    offset: tuple[int, ...] | None
    index: int | None


class _StorageInfo(_unpickle.Fields):
    __slots__ = ("length", "offset", "relative_path", "transform_descriptors")
    __hash__ = None  # type: ignore[assignment]  # (as torch's, see _Record)
    relative_path: str
    offset: int
    length: int
    transform_descriptors: list[str] | None


class _MemFormat(int):
    """A member of torch's ``_MEM_FORMAT_ENCODING`` (contiguous, channels last, preserve), by value."""

    __slots__ = ()


def _mem_format(value: Any) -> _MemFormat:
    if type(value) is not int or value not in (0, 1, 2):  # (as the enum's own lookup refuses)
        raise ValueError(f"{_unpickle.brief(value, 40)} is not a valid _MEM_FORMAT_ENCODING")
    return _MemFormat(value)


_LAYOUTS = frozenset(
    f"torch.{n}"
    for n in ("strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc", "_mkldnn", "jagged")
)
"""Every ``torch.layout`` by the name ``torch.serialization._get_layout`` finds it under."""


def _layout(name: Any) -> str:
    if type(name) is not str or name not in _LAYOUTS:  # (torch's lookup raises KeyError)
        raise ValueError(f"unknown torch layout {_unpickle.brief(name, 40)}")
    return str(name)


_DCP = "torch.distributed.checkpoint.metadata"
_PLANNER = "torch.distributed.checkpoint.planner"
METADATA_ALLOWLIST: dict[tuple[str, str], Any] = {
    **_unpickle.PLAIN,
    (_DCP, "Metadata"): _Metadata,
    (_DCP, "TensorStorageMetadata"): _TensorStorageMetadata,
    (_DCP, "BytesStorageMetadata"): _BytesStorageMetadata,
    (_DCP, "ChunkStorageMetadata"): _ChunkStorageMetadata,
    (_DCP, "TensorProperties"): _TensorProperties,
    (_DCP, "MetadataIndex"): _MetadataIndex,
    (_DCP, "StorageMeta"): _StorageMeta,
    (_DCP, "_MEM_FORMAT_ENCODING"): _mem_format,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): _unpickle.TORCH_TENSORS[("torch", "Size")],
    ("torch.serialization", "_get_layout"): _layout,
    **_unpickle.PATHS,
    **{("torch", name): _unpickle.TorchDType(dt.name) for name, dt in BY_NAME.items()},
    # megatron-core's planner keeps every rank's save plan in the metadata (``all_local_plans``)
    **{(_PLANNER, n): _unpickle.record(f"{_PLANNER}.{n}") for n in ("SavePlan", "WriteItem", "TensorWriteData")},
    (_PLANNER, "WriteItemType"): _unpickle.enum(f"{_PLANNER}.WriteItemType"),
}
"""Every global a torch 2.x ``FileSystemWriter`` puts in ``.metadata`` (research/dcp.md §4), plus the
save-plan records megatron-core's planner adds."""

OBJECT_ALLOWLIST: dict[tuple[str, str], Any] = {
    **_unpickle.PLAIN,
    **_unpickle.TORCH_TENSORS,
    **_unpickle.numpy_arrays(),
    **_unpickle.BYTES_IO,
}
"""Globals allowed in bytes items: plain Python values, tensors and plain numeric numpy arrays inside
them (``np.random.get_state()``: Megatron's RNG records, carried by ``--to dcp``, and what training
loops keep beside their torch RNG), and ``io.BytesIO``, a state-dict value DCP saves as it is
(its bytes kept, nothing run)."""


def _load_metadata(root: Path, name: str) -> _Metadata:
    with RandomAccessFile(root / name, display=name) as f:
        data = f.read(0, f.size)
    md = _unpickle.loads(data, allow=METADATA_ALLOWLIST, source=name, what="DCP metadata pickle")
    if not isinstance(md, _Metadata) or not isinstance(getattr(md, "state_dict_metadata", None), dict):
        raise CorruptFileError(
            f"{name}: expected a pickled DCP Metadata, found {type(md).__name__}",
            hint="the file is not DCP metadata, or it is damaged",
            path=name,
        )
    if not isinstance(md.storage_data, dict):
        raise CorruptFileError(
            f"{name}: the metadata has no file-system storage index (storage_data is "
            f"{type(md.storage_data).__name__}); it was written by a storage writer ckpttool does not read",
            path=name,
        )
    return md


_MAX_NESTING = 64
"""Deepest path ``planner_data`` may give (deeper ones are refused: each level is a container)."""


def _keep_nesting(manifest: Manifest, maps: list[dict[Any, Any]]) -> None:
    """Keep on each item the path its key had in the nested state dict (``Item.nesting``), from the
    ``planner_data`` of the metadata files read: one global ``.metadata``, or every rank's
    ``__<rank>.metadata`` merged as DCP's global plan merges the ranks' maps (``dict(ChainMap(*maps))``:
    a key's first map gives its path). Kept as recorded (the tuples themselves: their strings are
    shared between paths as in torch's map, which a re-pickling keeps), checked where used
    (:func:`nesting`, the DCP writer): describing never fails on this map."""
    merged = maps[0] if len(maps) == 1 else dict(ChainMap(*maps)) if maps else {}
    items = manifest.items
    for key, path in merged.items():
        if type(key) is not str or type(path) is not tuple:
            continue
        item = items.get(key)
        if item is not None:
            item.nesting = path


def is_own_path(key: str, path: tuple[Any, ...]) -> bool:
    """Whether ``path`` is ``key``'s place in the nested state dict: ``flatten_state_dict`` names
    each key by its path's parts joined by dots."""
    return ".".join(map(str, path)) == key


def _planner_problem(planner_data: dict[Any, Any], saved: dict[Any, Any]) -> str | None:
    """What is wrong with a metadata's ``planner_data`` (None: nothing). torch writes it as the map
    from each flattened key to its path in the nested state dict, the key being the path's parts
    joined by dots, for every key the metadata lists (``flatten_state_dict``)."""
    wrong = []
    for key, path in planner_data.items():
        ok = type(key) is str and type(path) is tuple and all(type(p) in (str, int) for p in path)
        if not ok or not is_own_path(key, path):
            wrong.append(f"maps {str(key)[:80]!r} to {str(path)[:80]}, which is not that key's path")
    unplaced = [k for k in saved if k not in planner_data]
    if unplaced:
        wrong.append(f"has no entry for the saved key {str(unplaced[0])[:80]!r}")
    if not wrong:
        return None
    more = len(wrong) - 1 + max(len(unplaced) - 1, 0)
    return wrong[0] + (f" (and {more} more)" if more else "")


def path_problem(path: tuple[Any, ...], limit: int) -> str | None:
    """Why ``path`` cannot be a ``planner_data`` path of a checkpoint of ``limit`` items (None: it
    can): strings and list indices (below ``limit``: an index is a list length to allocate),
    starting with a string, at most 64 deep."""
    ok = 0 < len(path) <= _MAX_NESTING and type(path[0]) is str
    if ok and all(type(p) is str or (type(p) is int and 0 <= p < limit) for p in path):
        return None
    return f"expected a tuple of at most {_MAX_NESTING} names and list indices below {limit}, starting with a name"


def nesting(manifest: Manifest) -> dict[str, tuple[str | int, ...]] | None:
    """Where each flat key of a DCP checkpoint goes in the nested state dict it was saved from
    (``planner_data``, as ``dcp_to_torch_save`` rebuilds it; kept on the items by ``describe``),
    for the keys it records, or None when it records none. A path that :func:`path_problem`
    refuses is an error."""
    if manifest.format != "dcp":
        return None
    limit = len(manifest.items)
    out: dict[str, tuple[str | int, ...]] = {}
    for item in manifest.items.values():
        path = item.nesting
        if path is None:
            continue
        problem = path_problem(path, limit)
        if problem is not None:
            raise CorruptFileError(
                f"{_GLOBAL_MD}: planner_data maps {item.name[:80]!r} to {str(path)[:80]}, {problem}",
                hint="the metadata is damaged or hostile; convert --to safetensors or dcp does not need this map",
                path=_GLOBAL_MD,
            )
        out[item.name] = path
    return out or None


def is_dist_config(path: Path) -> bool:
    """Whether ``path`` is megatron-core dist_checkpointing's ``metadata.json`` (such a directory
    is DCP underneath, but read as ``megatron-dist``)."""
    if outside(path.parent, path) is not None:  # a link out: claimed by its name, refused by name when read
        return not left_out(path.parent, path.name)
    try:
        if not path.is_file():
            return False
        with open(path, "rb") as fh:
            text = fh.read(_DIST_CONFIG_MAX + 1)  # (megatron-core writes about a hundred bytes)
        return len(text) <= _DIST_CONFIG_MAX and "sharded_backend" in json.loads(text)
    except (OSError, ValueError, TypeError, RecursionError):
        return False


_DIST_CONFIG_MAX = 1 << 20
"""bytes of a ``metadata.json`` read, at most, to tell whether it is megatron-core's"""


class DcpAdapter:
    name = "dcp"

    def __init__(self, object_allow: dict[tuple[str, str], Any] | None = None) -> None:
        # formats built on DCP (megatron-core's torch_dist) keep richer objects in bytes items
        self.object_allow = object_allow or OBJECT_ALLOWLIST

    def detect(self, path: Path) -> Detection:
        if not path.is_dir():
            return Detection(False, "not a directory")
        names = set(os.listdir(path))
        if "metadata.json" in names and is_dist_config(path / "metadata.json"):
            return Detection(False, "a Megatron torch_dist checkpoint (metadata.json): read as megatron-dist")
        if _GLOBAL_MD in names:
            return Detection(True, "found .metadata")
        if any(_RANK_MD.match(n) for n in names):
            return Detection(True, "found rank-local __<rank>.metadata files (use_collectives=False)")
        if any(n.endswith(".safetensors") for n in names) and st.has_sharding_info(path):
            return Detection(True, "found safetensors shards with DCP_SHARDING_INFO (HuggingFaceStorageWriter)")
        if ".metadata.tmp" in names or any(_DATA.match(n) for n in names):
            return Detection(True, "found DCP data files or .metadata.tmp but no .metadata (interrupted save)")
        return Detection(False, "no .metadata, __<rank>.metadata or *.distcp file")

    # -- manifest ----------------------------------------------------------------------------------

    def describe(self, path: Path) -> Manifest:
        listing = list_files(path)
        if not any(rel == _GLOBAL_MD or _RANK_MD.match(rel) for rel, _ in listing) and st.has_sharding_info(path):
            return self._describe_hf(path, listing)
        names = {rel for rel, _ in listing}
        rank_local = sorted((int(m.group(1)), rel) for rel in names if (m := _RANK_MD.match(rel)))
        sources: list[tuple[int | None, str]]
        if _GLOBAL_MD in names:
            sources = [(None, _GLOBAL_MD)]
        elif rank_local:
            sources = [(rank, rel) for rank, rel in rank_local]
        else:
            if left_out(path, _GLOBAL_MD):  # (verify's second look: .metadata is the link out it reported)
                raise PathEscapeError(f"{_GLOBAL_MD}: a link out of the checkpoint", path=_GLOBAL_MD)
            found = ".metadata.tmp" if ".metadata.tmp" in names else "data files only"
            raise IncompleteCheckpointError(
                f"{path}: DCP checkpoint without .metadata (found {found}): the save was interrupted "
                "before rank 0 committed it",
                hint="use the previous checkpoint; this one cannot be loaded by dcp.load either",
                path=".metadata.tmp" if found == ".metadata.tmp" else str(path),  # (verify: one finding of it)
            )
        manifest = Manifest(root=str(path), format=self.name)
        sizes = dict(listing)
        roles: dict[str, FileRecord] = {}
        for rel, size in listing:
            m = _DATA.match(rel)
            if rel in (_GLOBAL_MD,) or _RANK_MD.match(rel):
                roles[rel] = FileRecord(path=rel, size=size, role="metadata")
            elif m:
                roles[rel] = FileRecord(path=rel, size=size, role="data", ranks=[int(m.group(1))])
            else:
                roles[rel] = FileRecord(path=rel, size=size, role="aux")
        versions: set[str] = set()
        replicas = ReplicaCounter()  # an entry per chunk: local to this describe, dropped with it
        maps: list[dict[Any, Any]] = []  # each metadata's planner_data
        findings: list[dict[str, Any]] = []
        ends: dict[str, dict[str, int]] = {}  # each metadata's: where each data file's records end
        # rank-local: each rank's metadata, and what it places, read whatever another's holds, so
        # that every damaged one is named (a rank's metadata deleted: its data files say it saved)
        damaged: list[CkptError] = [_missing_rank_metadata(r, names) for r in _unplaced_ranks(names, rank_local)]
        for rank, md_name in sources:
            try:
                md = _load_metadata(path, md_name)
            except (CorruptFileError, IncompleteCheckpointError) as exc:
                if rank is None:
                    raise
                exc.rank = rank
                damaged.append(exc)
                continue
            versions.add(str(getattr(md, "version", None)))
            if rank is None:
                self._extras(manifest, md)
            try:
                ends[md_name] = self._add_items(manifest, md, md_name, rank, path, sizes, replicas)
            except (CorruptFileError, IncompleteCheckpointError) as exc:  # (rank-local: each sees its own files)
                if len(sources) == 1:
                    raise
                if exc.rule == "truncated-file" and (swapped := _misplaced_across(path, sources, sizes)):
                    raise swapped from None
                damaged.append(exc)
                continue
            planner_data = getattr(md, "planner_data", None)
            if isinstance(planner_data, dict) and planner_data:
                maps.append(planner_data)
                if problem := _planner_problem(planner_data, md.state_dict_metadata):
                    findings.append(
                        {
                            "rule": "corrupt-file",
                            "file": md_name,
                            "message": f"{md_name}: planner_data, the nested place of each saved key, {problem}",
                            "hint": "the metadata is damaged: dcp_to_torch_save and loads without a state dict of "
                            "your own fail on it (dcp.load into your state dict does not read it); restore "
                            f"{md_name} from a good copy",
                            "stops_writes": False,  # (checked where used: nesting(), the DCP writer)
                        }
                    )
            del md  # before the next rank's metadata is loaded
        raise_together(damaged)
        if sources[0][0] is not None:  # (rank-local metadata read, not a .metadata beside it)
            _refuse_absent_ranks(manifest, [r for r, _ in rank_local])
        del replicas
        odd = any(sizes[r] != e for each in ends.values() for r, e in each.items())
        if odd and len(sources) > 1 and (swapped := _misplaced_across(path, sources, sizes)):
            raise swapped
        for md_name, each in ends.items():
            findings.extend(_longer(each, sizes, md_name, path))
        if len(sources) > 1 and (crossed := _crossed_metadata(ends, sources)):
            findings.append(crossed)
        _keep_nesting(manifest, maps)
        del maps
        if findings:
            manifest.extras["findings"] = findings
        manifest.files = list(roles.values())
        manifest.format_version = "/".join(sorted(versions))
        if rank_local:
            manifest.extras["variant"] = "rank-local (use_collectives=False)"
        data_ranks = {r for f in manifest.files if f.role == "data" for r in f.ranks}
        ranks = data_ranks | {r for r, _ in rank_local}
        manifest.layout = Layout(world_size=max(ranks) + 1 if ranks else None)
        self._read_objects(manifest)
        manifest.step = find_step(manifest.items)
        return manifest

    def _describe_hf(self, path: Path, listing: list[tuple[str, int]]) -> Manifest:
        """Shards of ``HuggingFaceStorageWriter(save_distributed=True)``: each rank's safetensors file
        holds its local chunk of every tensor, placed by the offsets in ``DCP_SHARDING_INFO``; the
        global shape is where the chunks end, as DCP's own reader computes it."""
        manifest = Manifest(root=str(path), format=self.name, format_version=None)
        manifest.extras["variant"] = "hf-safetensors (HuggingFaceStorageWriter)"
        ends: dict[str, list[int]] = {}
        pieces: dict[str, list[Piece]] = {}
        dtypes: dict[str, str] = {}
        for rel, size in listing:
            if not rel.endswith(".safetensors") or "/" in rel:
                manifest.files.append(FileRecord(path=rel, size=size, role="aux"))
                continue
            header = st.read_header(path / rel, rel)
            try:
                info = json.loads(header.metadata.get(st.SHARDING_INFO, "{}"))
            except (ValueError, RecursionError):
                raise CorruptFileError(f"{rel}: {st.SHARDING_INFO} is not JSON", path=rel) from None
            m = _HF_SHARD.match(rel)
            rank = int(m.group(1)) - 1 if m else None
            manifest.files.append(
                FileRecord(path=rel, size=size, role="data", ranks=[rank] if rank is not None else [])
            )
            manifest.format_version = header.metadata.get("DCP_VERSION")
            for e in header.tensors:
                spec = info.get(e.name, {}) if isinstance(info, dict) else {}
                offsets = spec.get("saved_offsets", [0] * len(e.shape)) if isinstance(spec, dict) else None
                if not (
                    isinstance(offsets, list)
                    and len(offsets) == len(e.shape)
                    and all(isinstance(o, int) and o >= 0 for o in offsets)
                ):
                    raise CorruptFileError(f"{rel}: bad saved_offsets for {e.name}: {offsets!r:.60}", path=rel)
                if dtypes.setdefault(e.name, e.dtype) != e.dtype:
                    raise CorruptFileError(f"{rel}: {e.name} is {e.dtype} here, {dtypes[e.name]} elsewhere", path=rel)
                box = Box(tuple(offsets), e.shape)
                prev = ends.setdefault(e.name, list(box.ends))
                if len(prev) != box.ndim:
                    raise CorruptFileError(f"{rel}: {e.name} changes rank between shards", path=rel)
                ends[e.name] = [max(a, b) for a, b in zip(prev, box.ends, strict=True)]
                same = sum(1 for p in pieces.get(e.name, []) if p.box == box)
                pieces.setdefault(e.name, []).append(
                    Piece(
                        file=rel,
                        locator={"begin": e.begin, "end": e.end},
                        box=box,
                        rank=rank,
                        nbytes=e.end - e.begin,
                        replica=same,
                    )
                )
        for name, plist in pieces.items():
            manifest.add(
                Item(
                    name=name,
                    kind=classify(name, is_tensor=True),
                    dtype=dtypes[name],
                    shape=tuple(ends[name]),
                    pieces=plist,
                )
            )
        ranks = {r for f in manifest.files for r in f.ranks}
        manifest.layout = Layout(world_size=max(ranks) + 1 if ranks else None)
        return manifest

    @staticmethod
    def _extras(manifest: Manifest, md: _Metadata) -> None:
        meta = getattr(md, "storage_meta", None)
        if meta is not None:
            manifest.extras["save_id"] = getattr(meta, "save_id", None)
            manifest.extras["checkpoint_id"] = plain_value(getattr(meta, "checkpoint_id", None))
            modules = getattr(meta, "modules", None)
            if modules:
                manifest.extras["modules"] = list(modules)

    def _add_items(
        self,
        manifest: Manifest,
        md: _Metadata,
        md_name: str,
        rank: int | None,
        root: Path,
        sizes: dict[str, int],
        replicas: ReplicaCounter,
    ) -> dict[str, int]:
        """Add the items ``md`` describes; where each data file's records end (its size, as torch
        writes it)."""
        storage: dict[tuple[str, tuple[int, ...] | None], _StorageInfo] = {}
        for key, info in md.storage_data.items():
            if not isinstance(key, _MetadataIndex) or not isinstance(info, _StorageInfo):
                raise CorruptFileError(f"{md_name}: malformed storage index entry", path=md_name)
            if wrong := _entry_problems(key, info):
                name = key.fqn if not wrong[0].startswith("item name") else "an entry"
                # (the data files the other entries name, missing too: said with it)
                named = {r for i in md.storage_data.values() if isinstance(r := getattr(i, "relative_path", None), str)}
                damaged = CorruptFileError(
                    f"{md_name}: the storage entry of {name} has {', '.join(wrong)} (a file name and two byte "
                    "counts expected): the metadata is damaged",
                    hint=f"restore {md_name} from a good copy; its data files cannot be placed without it",
                    path=md_name,
                )
                damaged.others = [_missing(rel, md_name) for rel in sorted(named) if rel not in sizes]
                raise damaged
            offset = getattr(key, "offset", None)
            if offset is not None and not isinstance(offset, tuple):  # torch.Size is one already
                offset = tuple(offset)
            storage[(key.fqn, offset)] = info
        placed: set[tuple[str, tuple[int, ...] | None]] = set()  # the entries the items below name
        # one object for each distinct file name, rank and box: at 400 000 chunks the copies the
        # pickle gives (a name and three tuples per chunk) were a third of the manifest's memory
        files: dict[str, tuple[str, int | None]] = {}
        ends: dict[str, int] = {}  # where each file's last record ends (its size, as torch writes it)
        boxes: dict[tuple[tuple[int, ...], tuple[int, ...]], Box] = {}
        shapes: dict[tuple[int, ...], tuple[int, ...]] = {}
        for fqn, meta in md.state_dict_metadata.items():
            if not isinstance(fqn, str):
                raise CorruptFileError(f"{md_name}: item key {fqn!r:.60} is not a string", path=md_name)
            if isinstance(meta, _TensorStorageMetadata):
                dt = str(meta.properties.dtype)
                if dt not in BY_NAME:
                    raise CorruptFileError(f"{md_name}: {fqn} has unknown dtype {dt}", path=md_name)
                shape = tuple(int(s) for s in meta.size)
                item = manifest.items.get(fqn)
                if item is None:
                    item = manifest.add(Item(name=fqn, kind=classify(fqn, is_tensor=True), dtype=dt, shape=shape))
                elif item.dtype != dt or item.shape != shape:
                    raise CorruptFileError(
                        f"{md_name}: {fqn} is {dt}{list(shape)} here but {item.dtype}{list(item.shape or ())} "
                        "in another rank's metadata",
                        path=md_name,
                    )
                itemsize = lookup_dtype(dt).itemsize
                for chunk in meta.chunks:
                    key = (tuple(int(o) for o in chunk.offsets), tuple(int(s) for s in chunk.sizes))
                    box = boxes.get(key)
                    if box is None:
                        box = boxes[key] = Box(*(shapes.setdefault(t, t) for t in key))
                    if not box.within(shape):
                        raise CorruptFileError(
                            f"{md_name}: chunk {list(box.offsets)}+{list(box.sizes)} of {fqn} lies outside "
                            f"its shape {list(shape)}",
                            path=md_name,
                        )
                    info = self._storage(storage, fqn, box.offsets, md_name)
                    placed.add((fqn, box.offsets))
                    piece = self._piece(info, box, rank, root, sizes, files, md_name, storage, ends)
                    piece.nbytes = box.volume * itemsize
                    if "transforms" not in piece.locator and piece.nbytes > piece.locator["length"]:
                        raise CorruptFileError(
                            f"{md_name}: chunk {list(box.offsets)}+{list(box.sizes)} of {fqn} holds "
                            f"{piece.nbytes:,} bytes of {dt} but its storage in {piece.file} is "
                            f"{piece.locator['length']:,} bytes",
                            hint="the metadata does not describe the data files; it is damaged or hostile",
                            path=md_name,
                        )
                    piece.replica = replicas.next(fqn, box)
                    item.pieces.append(piece)
            elif isinstance(meta, _BytesStorageMetadata):
                item = manifest.items.get(fqn)
                if item is None:
                    item = manifest.add(Item(name=fqn, kind=classify(fqn, is_tensor=False)))
                elif item.dtype is not None:
                    raise CorruptFileError(f"{md_name}: {fqn} is a tensor in another rank's metadata", path=md_name)
                info = self._storage(storage, fqn, None, md_name)
                placed.add((fqn, None))
                piece = self._piece(info, Box((), ()), rank, root, sizes, files, md_name, storage, ends)
                piece.replica = len(item.pieces)
                item.pieces.append(piece)
            else:
                raise CorruptFileError(
                    f"{md_name}: {fqn} has storage metadata of type {type(meta).__name__}", path=md_name
                )
        # (an item's chunk missing from its list: the coverage check names the gap; an item gone whole: here)
        if unlisted := [k for k in storage if k not in placed and k[0] not in md.state_dict_metadata]:
            fqn, offsets = unlisted[0]
            where = f" at offsets {list(offsets)}" if offsets is not None else ""
            raise CorruptFileError(
                f"{md_name}: {len(unlisted)} storage entr{'y' if len(unlisted) == 1 else 'ies'} that no item lists, "
                f"the first for {fqn}{where} in {storage[unlisted[0]].relative_path}: an item's entry was lost "
                "from the metadata (dcp.load fails on it: missing key)",
                hint=f"restore {md_name} from a good copy",
                path=md_name,
            )
        if any(sizes[rel] != end for rel, end in ends.items()) and (
            swapped := _misplaced(root, [*storage.values()], sizes)
        ):
            raise swapped  # (a file longer than its records reach, holding another's)
        return ends

    @staticmethod
    def _storage(
        storage: dict[tuple[str, tuple[int, ...] | None], _StorageInfo],
        fqn: str,
        offsets: tuple[int, ...] | None,
        md_name: str,
    ) -> _StorageInfo:
        info = storage.get((fqn, offsets))
        if info is None:
            where = f" at offsets {list(offsets)}" if offsets is not None else ""
            raise CorruptFileError(f"{md_name}: {fqn}{where} is listed but has no storage entry", path=md_name)
        return info

    @staticmethod
    def _piece(
        info: _StorageInfo,
        box: Box,
        rank: int | None,
        root: Path,
        sizes: dict[str, int],
        files: dict[str, tuple[str, int | None]],
        md_name: str,
        storage: dict[tuple[str, tuple[int, ...] | None], _StorageInfo],
        ends: dict[str, int],
    ) -> Piece:
        """The piece ``info`` places; ``files`` maps each file name seen to one copy of it and the
        rank its name gives and ``ends`` where each file's records reach (both filled here);
        ``storage``: every place the metadata gives, to tell a file cut short from one in another's
        place."""
        rel = str(info.relative_path)
        known = files.get(rel)
        if known is None:
            confine(root, rel, named_by=md_name, listed=sizes)
            known = files[rel] = (rel, writer_rank(rel))
        rel, named_rank = known
        if rel not in sizes:
            _damaged_files(root, storage, sizes, md_name)  # (with other files missing or cut short: all)
            raise _missing(rel, md_name)
        offset, length = int(info.offset), int(info.length)
        if offset < 0 or length <= 0 or offset + length > sizes[rel]:
            if offset >= 0 and length > 0 and (swapped := _misplaced(root, [*storage.values()], sizes)):
                raise swapped
            end = offset + length
            if offset >= 0 and length > 0:
                _damaged_files(root, storage, sizes, md_name)
                end = max(end, (_record_ends(storage.values()) or {}).get(rel, 0))  # (where its last record ends)
            raise _cut_short(rel, sizes[rel], md_name, end)
        if offset + length > ends.get(rel, 0):
            ends[rel] = offset + length
        transforms = list(getattr(info, "transform_descriptors", None) or [])
        for t in transforms:
            if t != _ZSTD:
                raise CorruptFileError(f"{rel}: unsupported DCP storage transform {t!r}", path=rel)
        locator: dict[str, Any] = {"offset": offset, "length": length}
        if transforms:
            locator["transforms"] = transforms
        return Piece(file=rel, locator=locator, box=box, rank=rank if rank is not None else named_rank)

    def _read_objects(self, manifest: Manifest) -> None:
        """Read the (small) bytes items so step counters and hyperparameters show; an item whose
        pickle is refused keeps the reason and the rest of the checkpoint is still described."""
        objects = [i for i in manifest.items.values() if not i.is_tensor and i.pieces]
        objects.sort(key=lambda i: (i.pieces[0].file, i.pieces[0].locator.get("offset", 0)))  # read forwards
        with self.reader(manifest) as reader:
            for item in objects:
                try:
                    set_value(item, reader.read_object(item))
                except UnsafePickleError as exc:
                    item.error = f"{UNSAFE_PICKLE}: refers to {exc.hostile or exc.global_name}"
                except CkptError as exc:
                    item.error = exc.message

    def reader(self, manifest: Manifest) -> DcpReader:
        return DcpReader(manifest, self.object_allow)

    @staticmethod
    def record_owners(root: Path) -> dict[str, dict[int, str]]:
        """For verify where describe stopped (a data file missing or cut): each data file's
        records by the byte they start at, with the item each holds, from the metadata files
        that still read (none: nothing)."""
        out: dict[str, dict[int, str]] = {}
        for _, key, info in records(root):
            out.setdefault(info.relative_path, {})[info.offset] = key.fqn
        return out

    @staticmethod
    def misplaced(manifest: Manifest, damaged: set[str]) -> tuple[CorruptFileError, set[str]] | None:
        """:func:`misplaced_in` (verify asks, with the data files whose records did not read)."""
        return misplaced_in(manifest, damaged)


def records(root: Path) -> Iterator[tuple[_Metadata, _MetadataIndex, _StorageInfo]]:
    """Each record the metadata files of the DCP checkpoint at ``root`` place, with the metadata
    placing it, for those that read (verify, where describe stopped); entries of the wrong types
    are left out."""
    try:
        with os.scandir(root) as entries:
            names = sorted(e.name for e in entries if e.name == _GLOBAL_MD or _RANK_MD.match(e.name))
    except OSError:
        return
    for name in names:
        try:
            md = _load_metadata(root, name)
        except CkptError:
            continue
        for key, info in md.storage_data.items():
            if isinstance(key, _MetadataIndex) and isinstance(info, _StorageInfo) and not _entry_problems(key, info):
                yield md, key, info


def _entry_problems(key: _MetadataIndex, info: _StorageInfo) -> list[str]:
    """What is wrong with a storage index entry as DCP writes it (an item name; a file name and two
    byte counts), each as ``field value``; a pickle that lacks a field leaves it unset."""
    try:  # (the usual entry: one look; describe walks every chunk's)
        if type(key.fqn) is type(info.relative_path) is str and type(info.offset) is type(info.length) is int:
            return []
    except AttributeError:
        pass
    problems = [] if isinstance(getattr(key, "fqn", None), str) else [f"item name {getattr(key, 'fqn', None)!r:.40}"]
    return problems + [
        f"{n} {v!r:.40}"
        for n, t in (("relative_path", str), ("offset", int), ("length", int))
        if type(v := getattr(info, n, None)) is not t
    ]


def _longer(ends: dict[str, int], sizes: dict[str, int], md_name: str, root: Path) -> list[dict[str, Any]]:
    """Findings for data files longer than their records reach (and holding no other file's: that
    is :func:`_misplaced`): torch writes a file's records back to back and nothing after them, so
    the bytes past the end were added later. The data reads intact: a warning, which stops no write
    (a writer reads only the records); ``seal`` refuses it all the same (it vouches for the bytes
    the writer wrote)."""
    return [
        {
            "rule": "corrupt-file",
            "severity": "warning",
            "file": rel,
            "message": f"{rel} is {sizes[rel]:,} bytes, {sizes[rel] - end:,} more than its records reach: "
            f"{md_name} places the last of them to end at byte {end:,}, and the save writes nothing after it; "
            "bytes were added to the file after the save",
            "hint": "the data reads intact; find what wrote to the file, restore it from the save (or cut it "
            f"back to its records with 'truncate -s {end} {shlex.quote(str(root / rel))}')",
            "stops_writes": False,
        }
        for rel, end in sorted(ends.items())
        if sizes[rel] > end
    ]


def _crossed_metadata(ends: dict[str, dict[str, int]], sources: list[tuple[int | None, str]]) -> dict[str, Any] | None:
    """The finding for rank-local metadata files (``__R.metadata``) that place their data only in
    another rank's files (``__S_N.distcp``): the metadata files were swapped or renamed, and a load
    at rank R would read rank S's state."""
    crossed = []
    for rank, md_name in sources:
        named = {int(m.group(1)) for rel in ends.get(md_name, {}) if (m := _DATA.match(rel))}
        if rank is not None and named and rank not in named:
            crossed.append((md_name, sorted(named), rank))
    if not crossed:
        return None
    said = "; ".join(f"{md} places its data in rank {', '.join(map(str, rs))}'s files" for md, rs, _ in crossed[:4])
    return {
        "rule": "misplaced-file",
        "file": crossed[0][0],
        "message": f"{said}{' …' if len(crossed) > 4 else ''}: the rank-local metadata files were swapped or "
        "renamed (a load at each rank reads its own __R.metadata)",
        "hint": "put each __R.metadata back under the rank whose __R_N.distcp files it names, or restore them "
        "from the save",
        "rank": crossed[0][2],
    }


def _misplaced_across(
    root: Path, sources: list[tuple[int | None, str]], sizes: dict[str, int]
) -> CorruptFileError | None:
    """:func:`_misplaced` over every rank's metadata (``use_collectives=False``: each one places
    only its rank's files, so none alone knows where another's records end)."""
    infos: list[_StorageInfo] = []
    for _, md_name in sources:
        try:
            data = getattr(_load_metadata(root, md_name), "storage_data", None)
        except (CorruptFileError, IncompleteCheckpointError):
            continue  # (its own damage is said where it is read)
        infos.extend(v for v in (data.values() if isinstance(data, dict) else ()) if isinstance(v, _StorageInfo))
    return _misplaced(root, infos, sizes)


def _damaged_files(
    root: Path, storage: dict[tuple[str, tuple[int, ...] | None], _StorageInfo], sizes: dict[str, int], md_name: str
) -> None:
    """Where two or more data files are missing or cut short, all of them in one error (each in its
    ``others``), so that verify names every one; one such file is left to the piece's own error,
    which names it with the piece it cuts. Files in each other's places are said as such first.
    Called only once a piece has found damage: a clean checkpoint's describe does not pay for it."""
    needs = _record_ends(storage.values())
    if needs is None:
        return  # malformed: the pieces' checks say how
    damaged = sorted(rel for rel, end in needs.items() if sizes.get(rel, -1) < end)
    if len(damaged) < 2:
        return
    for rel in damaged:
        confine(root, rel, named_by=md_name, listed=sizes)  # (a path out of the checkpoint is said first)
    if any(rel in sizes for rel in damaged) and (swapped := _misplaced(root, [*storage.values()], sizes)):
        raise swapped
    errors = [
        _cut_short(rel, sizes[rel], md_name, needs[rel]) if rel in sizes else _missing(rel, md_name) for rel in damaged
    ]
    raise_together(errors)


def _unplaced_ranks(names: set[str], rank_local: list[tuple[int, str]]) -> list[int]:
    """Of a rank-local save (``rank_local``: each ``__R.metadata``), the ranks whose data files are
    here without their metadata."""
    if not rank_local:
        return []
    held = {r for r, _ in rank_local}
    return sorted({w for rel in names if (w := writer_rank(rel)) is not None} - held)


def _refuse_absent_ranks(manifest: Manifest, ranks: list[int]) -> None:
    """A rank-local save (each ``__R.metadata`` places only its own rank's data) with a rank's
    files all gone: a number missing between the ranks here, or, the last rank's gone, tensors
    whose chunks leave parts that no rank here places. Each is a rank ``dcp.load`` cannot restore."""
    absent = sorted(set(range(max(ranks) + 1)) - set(ranks))
    short: list[str] = []
    for item in manifest.items.values():  # (a chunk outside its tensor was refused as it was read)
        if item.is_tensor and item.shape and item_coverage(item).gaps:
            short.append(item.name)
    if not absent and not short:
        return
    rank = absent[0] if absent else max(ranks) + 1
    files = f"__{rank}.metadata and __{rank}_*.distcp are missing"
    said = f"{len(short)} tensor(s) have parts that no rank here places ({', '.join(short[:3])}"
    said += " …)" if len(short) > 3 else ")"
    if absent:
        message = (
            f"{files}: rank(s) {', '.join(map(str, absent))} of this save without collectives left no files "
            f"beside those of ranks {', '.join(map(str, sorted(ranks)))}" + (f"; {said}" if short else "")
        )
    else:
        message = (
            f"{files}: {said}, and this save without collectives has the files of ranks 0 to {max(ranks)} only "
            f"(rank {rank}'s, and any later rank's, would hold them)"
        )
    raise IncompleteCheckpointError(
        message,
        hint="a rank's save did not finish or its files were deleted: restore them from the save, or use another "
        "checkpoint",
        path=f"__{rank}.metadata",
        rule="missing-file",
        rank=rank,
    )


def _missing_rank_metadata(rank: int, names: set[str]) -> IncompleteCheckpointError:
    data = sorted(rel for rel in names if writer_rank(rel) == rank)
    said = ", ".join(data[:3]) + (" …" if len(data) > 3 else "")
    return IncompleteCheckpointError(
        f"__{rank}.metadata is missing: rank {rank} saved its data ({said}) without collectives, and "
        "a load at that rank reads only its own metadata",
        hint="the save did not finish on that rank or the file was deleted; restore it or use another checkpoint",
        path=f"__{rank}.metadata",
        rule="missing-file",
        rank=rank,
    )


def writer_rank(rel: str) -> int | None:
    """The rank that wrote data file ``rel`` (a name, or a path ending in one), by
    FileSystemWriter's ``__<rank>_<n>.distcp`` naming."""
    m = _DATA.match(rel.rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


def _missing(rel: str, md_name: str) -> CkptError:
    return IncompleteCheckpointError(
        f"{rel}: data file named by {md_name} is missing",
        hint="a rank's file was not written or was deleted; restore it or use another checkpoint",
        path=rel,
        rule="missing-file",
        rank=writer_rank(rel),
    )


def _cut_short(rel: str, size: int, md_name: str, end: int) -> CkptError:
    return CorruptFileError(
        f"{rel} is {size:,} bytes but {md_name} places data through byte {end:,}: cut short (a copy or save "
        "interrupted), or another file in its place",
        hint="restore the file from its source; 'ckpttool verify' lists every damaged file",
        path=rel,
        rule="truncated-file",
        rank=writer_rank(rel),
    )


def _record_ends(infos: Iterable[_StorageInfo]) -> dict[str, int] | None:
    """Where each data file's last record ends, by the metadata (a file's size, as DCP writes its
    records back to back); None for entries too malformed to say."""
    ends: dict[str, int] = {}
    try:
        for info in infos:
            rel, end = str(info.relative_path), int(info.offset) + int(info.length)
            if end > ends.get(rel, 0):
                ends[rel] = end
    except (AttributeError, TypeError, ValueError):
        return None
    return ends


def _misplaced(root: Path, storage: list[_StorageInfo], sizes: dict[str, int]) -> CorruptFileError | None:
    """The error for data files in each other's places (renamed, swapped, copied over each other),
    from the sizes alone: DCP writes a file's records back to back, so a file's size is where the
    metadata's last record in it ends, and one of another size is looked at (:func:`holders`)."""
    ends = _record_ends(storage)
    if ends is None:  # an entry no item uses, malformed: no sizes to go by
        return None
    odd = {rel for rel, end in ends.items() if rel in sizes and sizes[rel] != end}
    if not odd:
        return None
    starts: dict[str, set[int]] = {}
    for info in storage:
        starts.setdefault(info.relative_path, set()).add(int(info.offset))
    return misplaced_error(holders(root, ends, starts, sizes, odd), sizes)


class Holder(NamedTuple):
    """Whose data a misplaced file holds: ``named`` (one file, or several of one structure that
    nothing tells apart), or ``unless`` more than two files moved, one of ``unless`` instead."""

    named: tuple[str, ...]
    unless: tuple[str, ...] = ()

    def said(self) -> str:
        if len(self.named) > 1:
            return "one of " + ", ".join(self.named[:3]) + (" …" if len(self.named) > 3 else "")
        if self.unless:
            return f"{self.named[0]} (or, if more than two files moved, one of {', '.join(self.unless[:3])})"
        return self.named[0]


def holders(
    root: Path, ends: dict[str, int], starts: dict[str, set[int]], sizes: dict[str, int], suspects: set[str]
) -> dict[str, Holder]:
    """Each of ``suspects`` (data files of a suspect size, or whose records do not read) that holds
    another file's data: the other files whose records end where the suspect does, and which have
    records (a zip local header, a zstd frame) in it where their records start and its own do not.
    Several such (files of one structure) narrow to the one it is a byte-for-byte copy of, or else
    to the one that is a suspect too (the two swapped; in a ring of three files it may be another
    of them: said so); failing both, all are named. A file cut short where another of its structure
    ends has no such place."""
    by_end: dict[int, list[str]] = {}
    for rel, end in ends.items():
        by_end.setdefault(end, []).append(rel)
    moved: dict[str, Holder] = {}
    for rel in sorted(suspects):
        if rel not in sizes:
            continue
        found = [
            o
            for o in by_end.get(sizes[rel], [])
            if o != rel
            and o in sizes  # (a file the listing holds: a name from the metadata may lead anywhere)
            and (telling := sorted(starts.get(o, set()) - starts.get(rel, set()))[:3])
            and _records_at(root / rel, telling)
        ]
        if len(found) > 1 and len(copied := [o for o in found if _pt.same_bytes(root / rel, root / o)]) == 1:
            moved[rel] = Holder((copied[0],))
        elif len(found) > 1 and len(swapped := [o for o in found if o in suspects]) == 1:
            moved[rel] = Holder((swapped[0],), tuple(o for o in found if o != swapped[0]))
        elif found:
            moved[rel] = Holder(tuple(found))
    return moved


def misplaced_error(moved: dict[str, Holder], sizes: dict[str, int]) -> CorruptFileError | None:
    """The ``misplaced-file`` error naming each file of ``moved`` and whose data it holds."""
    if not moved:
        return None
    said = [f"{rel} ({sizes[rel]:,} bytes) holds what the metadata places in {o.said()}" for rel, o in moved.items()]
    first, owners = next(iter(moved.items()))
    whose, theirs = (f"{owners.named[0]}'s",) * 2 if len(owners.named) == 1 else ("their", "theirs")
    why = (
        f"its size is where {whose} records end, and records start in it where {theirs} do"
        if len(moved) == 1
        else "each one's size is where the other file's records end, and records start in it where that file's do"
    )
    return CorruptFileError(
        f"{'; '.join(said[:4])}{' …' if len(said) > 4 else ''}: {why}; the files were renamed, swapped or copied "
        "over each other",
        hint="put each file back under its own name, or restore them from the save",
        path=first,
        rule="misplaced-file",
        rank=writer_rank(first),
    )


def misplaced_in(manifest: Manifest, suspects: set[str]) -> tuple[CorruptFileError, set[str]] | None:
    """:func:`holders` for a described checkpoint, whose data files of the same size (which the
    sizes alone cannot tell apart) gave damage when read: their records' places from the pieces."""
    ends: dict[str, int] = {}
    starts: dict[str, set[int]] = {}
    for item in manifest.items.values():
        for piece in item.pieces:
            loc = piece.locator
            if "offset" in loc and "length" in loc:
                ends[piece.file] = max(ends.get(piece.file, 0), loc["offset"] + loc["length"])
                starts.setdefault(piece.file, set()).add(loc["offset"])
    sizes = {f.path: f.size for f in manifest.files if f.role == "data"}
    moved = holders(Path(manifest.root), ends, starts, sizes, suspects & set(ends))
    error = misplaced_error(moved, sizes)
    return None if error is None else (error, set(moved))


def _records_at(path: Path, offsets: list[int]) -> bool:
    """Whether a record (a torch.save archive's zip local header, or a zstd frame's magic) starts at
    each of ``offsets`` of ``path``."""
    try:
        with open(path, "rb") as fh:
            for at in offsets:
                fh.seek(at)
                if fh.read(4) not in (b"PK\x03\x04", b"\x28\xb5\x2f\xfd"):
                    return False
    except OSError:
        return False
    return True


class DcpReader(PieceReader):
    _last: tuple[tuple[str, int], np.ndarray] | None = None

    def __init__(self, manifest: Manifest, object_allow: dict[tuple[str, str], Any] | None = None) -> None:
        super().__init__(manifest)
        self.object_allow = object_allow or OBJECT_ALLOWLIST

    _recent: tuple[tuple[str, int], _torchzip.Archive] | None = None

    def _archive(self, piece: Piece) -> _torchzip.Archive:
        # raw_span then archive_of on the same piece (verify) parse its archive once
        key = (piece.file, piece.locator["offset"])
        if self._recent is None or self._recent[0] != key:
            self._recent = (key, self._open_archive(piece))
        return self._recent[1]

    def _open_archive(self, piece: Piece) -> _torchzip.Archive:
        f = self.files.get(piece.file)
        loc = piece.locator
        display = f"{piece.file}@{loc['offset']}"
        if loc.get("transforms"):
            import zstandard

            raw = f.read(loc["offset"], loc["length"])
            # a torch.save archive of the piece: its bytes and a little zip; objects have no size
            bound = 2 * piece.nbytes + (1 << 20) if piece.nbytes else max(32 << 20, 64 * len(raw))
            bomb = CorruptFileError(
                f"{display}: zstd frame of {len(raw):,} bytes expands past {bound:,} bytes (a decompression bomb)",
                path=piece.file,
            )
            # decoded in one pass into one buffer (the buffer is the frame's window: a stream reader
            # would hold a window the size the frame asks for beside the output); a frame that says
            # its size is held to the bound before anything is allocated, one that does not stops there
            try:
                declared = zstandard.get_frame_parameters(raw).content_size
                if declared != zstandard.CONTENTSIZE_UNKNOWN and declared > bound:
                    raise bomb
                data = zstandard.ZstdDecompressor().decompress(raw, max_output_size=bound + 1)
            except zstandard.ZstdError as exc:
                if "did not decompress full frame" in str(exc):
                    raise bomb from None
                raise CorruptFileError(f"{display}: zstd frame does not decode ({exc})", path=piece.file) from None
            if len(data) > bound:
                raise bomb
            return _torchzip.Archive(
                data, display=display, file=piece.file, allow=self.object_allow, check=f.crcs is not None
            )
        return _torchzip.Archive(
            f, base=loc["offset"], length=loc["length"], display=display, file=piece.file, allow=self.object_allow
        )

    def read(self, piece: Piece, item: Item, out: np.ndarray | None = None) -> np.ndarray:
        if "begin" in piece.locator:  # HuggingFaceStorageWriter shard
            return st.read_range(self.files, piece, item, out)
        loc = piece.locator
        if (
            "select0" in loc
            and out is not None
            and out.flags.c_contiguous
            and math.prod(loc["chunk_sizes"]) == out.size
        ):  # the index selects the whole chunk (megatron-core's record of one layer or expert): no copy
            self._read_chunk(piece, item, tuple(loc["chunk_sizes"]), out)
            return out
        if "range" in loc or "select0" in loc:  # part of a stored chunk, which is read whole (and kept)
            chunk = self._chunk(piece, item)
            if "range" in loc:  # elements [a, b) of a 1-D chunk (Megatron's optimizer buckets)
                a, b = loc["range"]
                values = chunk[a:b] if piece.flat is not None else chunk[a:b].reshape(piece.box.sizes)
            else:  # one index (Megatron's stacked layers, experts)
                values = chunk[_selected(loc)]
            if out is None:
                return np.ascontiguousarray(values)
            out.reshape(values.shape)[...] = values
            return out
        return self._read_chunk(piece, item, piece.box.sizes, out)

    def _chunk(self, piece: Piece, item: Item) -> np.ndarray:
        key = (piece.file, piece.locator["offset"])
        if self._last is None or self._last[0] != key:
            self._last = (key, self._read_chunk(piece, item, tuple(piece.locator["chunk_sizes"]), None))
        return self._last[1]

    def _read_chunk(self, piece: Piece, item: Item, sizes: tuple[int, ...], out: np.ndarray | None) -> np.ndarray:
        archive = self._archive(piece)
        ref = archive.load()
        if not isinstance(ref, _unpickle.TensorRef):
            raise CorruptFileError(
                f"{archive.display}: expected the tensor chunk of {item.name}, found {type(ref).__name__}",
                path=piece.file,
            )
        if ref.dtype != item.dtype or ref.shape != sizes:
            raise CorruptFileError(
                f"{archive.display}: chunk of {item.name} is {ref.dtype}{list(ref.shape)}, metadata says "
                f"{item.dtype}{list(sizes)}",
                path=piece.file,
            )
        return _torchzip.read_tensor(archive, ref, out)

    def read_object(self, item: Item) -> Any:
        piece = item.pieces[0]
        return self._archive(piece).load()

    def read_in_object(self, item: Item, ref: _unpickle.TensorRef) -> np.ndarray:
        """The values of a tensor inside a value item's pickle (DCP keeps a tuple holding a tensor
        whole, as one object), ``ref`` as :meth:`read_object` gave it."""
        return _torchzip.read_tensor(self._archive(item.pieces[0]), ref)

    def archive_of(self, piece: Piece) -> _torchzip.Archive | None:
        return self._archive(piece) if "offset" in piece.locator else None

    def raw_span(self, piece: Piece, item: Item) -> tuple[int, int] | None:
        loc = piece.locator
        if "begin" in loc:
            return loc["begin"], loc["end"] - loc["begin"]
        if loc.get("transforms"):
            return None
        archive = self._archive(piece)
        ref = archive.load()
        if not isinstance(ref, _unpickle.TensorRef):
            return None
        if ref.dtype != item.dtype or ref.shape != tuple(loc.get("chunk_sizes", piece.box.sizes)):
            return None  # read() says what is wrong
        span = _torchzip.tensor_span(archive, ref)
        if span is not None and "range" in loc:
            a, b = loc["range"]
            itemsize = lookup_dtype(ref.dtype).itemsize
            return span[0] + a * itemsize, (b - a) * itemsize
        if span is None or "select0" not in loc:
            return span
        return selected_span(span, ref.shape, _selected(loc))


def selected_span(span: tuple[int, int], shape: tuple[int, ...], index: tuple[int, ...]) -> tuple[int, int] | None:
    """The byte range of ``chunk[index]`` inside a C-ordered chunk of ``shape`` stored at ``span``
    (``index``: leading indices, as in ``select0``)."""
    lead = shape[: len(index)]
    if len(lead) != len(index) or any(not 0 <= i < n for i, n in zip(index, lead, strict=True)):
        return None
    rows = math.prod(lead)
    row = span[1] // rows if rows else 0
    flat = 0
    for i, n in zip(index, lead, strict=True):
        flat = flat * n + i
    return span[0] + flat * row, row


def _selected(loc: dict[str, Any]) -> tuple[int, ...]:
    """The leading indices a piece selects in its stored chunk (``select0``: one index, the layer of
    Megatron's stacked layers; or a list, the layer and the expert)."""
    sel = loc["select0"]
    return tuple(int(i) for i in sel) if isinstance(sel, list) else (int(sel),)


ADAPTER = DcpAdapter()
