"""Writing a PyTorch DCP checkpoint at a chosen world size, from any manifest.

Every tensor the source holds in several pieces is cut along its first dimension into
``world_size`` chunks the way ``torch.chunk`` (and FSDP2's ``Shard(0)``) cuts it; rank ``r``'s
chunks go to ``__r_0.distcp`` as ``torch.save`` archives, as torch's ``FileSystemWriter`` writes
them. A tensor the source holds whole (replicated, or unsharded state such as RNG) is written
whole by rank 0, as DCP's de-duplication saves a replicated tensor. Non-tensor values go to rank 0's file.
``.metadata`` is torch's own ``Metadata`` with the ``_StorageInfo`` index, pickled as DCP pickles
it, and ``planner_data`` mapping each key to its path in the nested state dict: the path a DCP
source recorded, else the key itself (:func:`planner_paths`). The result is what ``dcp.load`` reads
at that world size (or any other), and what ``dcp_to_torch_save`` nests as the source nested.
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpttool.assemble import check_coverage
from ckpttool.dtypes import carrier
from ckpttool.errors import UsageError
from ckpttool.formats._ptwrite import GlobalRef, Raw, Scratch, assembled, carried, save_each
from ckpttool.formats.base import Adapter, PieceReader, PlannedFile
from ckpttool.geometry import Box
from ckpttool.hashing import open_output
from ckpttool.io import fsync_tree, publish_dir, staged_dir
from ckpttool.manifest import Item, Manifest
from ckpttool.naming import MOMENTS, canonical, param_state
from ckpttool.values import gc_paused


def chunk_boxes(shape: tuple[int, ...], parts: int) -> list[Box | None]:
    """The dim-0 chunk each rank holds, as ``torch.chunk`` makes them (None: that rank holds none)."""
    if not shape:
        return [Box((), ())] + [None] * (parts - 1)
    size = -(-shape[0] // parts) if shape[0] else 0
    out: list[Box | None] = []
    for r in range(parts):
        lo, hi = r * size, min(shape[0], (r + 1) * size)
        out.append(Box((lo, *([0] * (len(shape) - 1))), (hi - lo, *shape[1:])) if hi > lo else None)
    if shape[0] == 0:
        out[0] = Box.whole(shape)
    return out


LIST_SLOTS = 1 << 16
"""List entries the written ``planner_data`` may ask ``dcp_to_torch_save`` for in all, at least (or one per key)"""

NestedPath = tuple[str | int, ...]
"""A ``planner_data`` path: the dict keys and list indices that lead to a value in the nested state dict"""


class _Node:
    """A dict or list of the nested state dict ``dcp_to_torch_save`` would build, as far as
    :func:`planner_paths` needs it: its entries (a name for a value) and, a list, its length."""

    __slots__ = ("entries", "is_list", "length")

    def __init__(self, is_list: bool) -> None:
        self.entries: dict[str | int, _Node | str] = {}
        self.is_list = is_list
        self.length = 0


def unread(item: Item) -> bool:
    """Whether ``item`` is a DCP bytes item whose pickle ckpttool refused (it refers to a global
    outside the allowlist: a custom class, or worse) and which a DCP output carries as its bytes,
    unread and unchanged: the state is kept, and nothing of it runs here."""
    piece = item.pieces[0] if len(item.pieces) == 1 else None
    return (
        not item.is_tensor
        and item.refused
        and piece is not None
        and "offset" in piece.locator
        and "length" in piece.locator
        and not piece.locator.get("transforms")
    )


def unread_record(reader: PieceReader, item: Item) -> bytes:
    """The record of an :func:`unread` item, as its source file holds it."""
    piece = item.pieces[0]
    f = reader.files.get(piece.file)
    return bytes(f.read(piece.locator["offset"], piece.locator["length"]))


def dcp_items(manifest: Manifest, items: list[Item], *, hint: str | None = None) -> tuple[list[Item], list[str]]:
    """The ``items`` a DCP output of ``manifest`` writes, and what the plan says of those it treats
    apart: an item that could not be read is refused (:func:`ckpttool.export.refuse_unreadable`),
    except a bytes item carried :func:`unread`; a parameter the source format knows nothing trains
    (:func:`ckpttool.export.unused_states`) is left out."""
    from ckpttool.export import refuse_unreadable, unused_note, unused_states

    refuse_unreadable((i for i in items if not unread(i)), hint=hint)
    dropped = set(unused_states(manifest))
    notes = []
    if kept := [f"{i.name} ({i.error})" for i in items if unread(i)]:
        notes.append(
            f"carried as their bytes, unread (ckpttool will not run their pickles): {', '.join(kept[:4])}"
            + (" …" if len(kept) > 4 else "")
        )
    notes += unused_note(manifest, "DCP", (i.name for i in items if i.name in dropped))
    # an empty mapping (a disabled GradScaler's state dict, {}): torch's dcp.save keeps no entry for
    # one, and dcp.load of the same nested state dict, given an entry it has no place for, fell back
    # to its old flattening and failed ("Missing key in checkpoint state_dict: optim.param_groups")
    empty = [i.name for i in items if not i.is_tensor and i.summary is None and i.value == {} and not i.refused]
    if empty:
        notes.append(
            f"not written: {', '.join(empty[:4])}{' …' if len(empty) > 4 else ''} (an empty dict, of which DCP keeps "
            "no entry, as torch's dcp.save; the state dict loaded into keeps its own)"
        )
        dropped.update(empty)
    return [i for i in items if i.name not in dropped], notes


def planner_paths(items: list[Item]) -> tuple[dict[str, NestedPath], dict[str, str]]:
    """The ``planner_data`` of a checkpoint of ``items`` (state-dict keys in ``.metadata`` order):
    the nested path the source recorded for a key (``Item.nesting``: a DCP source's own
    ``planner_data``, as torch writes for the same nested state dict), else the key itself (one flat
    level: names such as ``w`` and ``w.exp_avg`` from other formats cannot both be paths of one tree).

    Never a tree torch cannot build: ``dcp_to_torch_save`` puts each key in turn at its path
    (``set_element``), so keys whose paths would make one entry both a value and a container, or a
    list and a dict at once, or open more list entries than there are keys (at least 65,536), or
    leave a list with entries no key fills (a subset of a source's keys: torch pads the list with
    None, and its load then fails on the missing key), are all written flat; so is a
    recorded path that is not the key's own (``".".join(path)``, as ``flatten_state_dict`` names
    keys: an item renamed since) or not a path at all. Returns the map and, for each key written
    flat despite a recorded path, why."""
    from ckpttool.formats.dcp import is_own_path, path_problem

    limit = max(len(items), LIST_SLOTS)
    paths: dict[str, NestedPath] = {}
    flat: dict[str, str] = {}
    nested: set[str] = set()
    for item in items:
        name, path = item.name, item.nesting
        if path is None:
            paths[name] = (name,)
            continue
        problem = path_problem(path, limit)
        if problem is None and not is_own_path(name, path):
            problem = "it is another key's path (the item was renamed?)"
        if problem is None:
            paths[name] = path
            nested.add(name)
        else:
            flat[name] = f"its recorded path {str(path)[:80]}: {problem}"
            paths[name] = (name,)
    while nested:
        clashing = _clashes(paths, limit) & nested
        if not clashing:
            break
        for name in clashing:
            flat[name] = f"its path {str(paths[name])[:80]} clashes with another key's"
            paths[name] = (name,)
            nested.discard(name)
    for name, lacking in with_holes({n: paths[n] for n in nested}).items():
        flat[name] = f"its list {lacking} lacks entries (a --filter kept some): torch's loader needs every one"
        paths[name] = (name,)
    return paths, flat


def with_holes(paths: dict[str, NestedPath]) -> dict[str, str]:
    """The keys under a list some of whose entries no key fills (``layers.0`` and ``layers.2``
    kept, ``layers.1`` not): ``dcp_to_torch_save`` cannot load such a tree ("Missing key"), nor
    does ckpttool read it back. Each with the list's path."""
    used: dict[NestedPath, set[int]] = {}
    for path in paths.values():
        for i, step in enumerate(path):
            if type(step) is int:
                used.setdefault(path[:i], set()).add(step)
    holed = {prefix for prefix, ix in used.items() if len(ix) != max(ix) + 1}
    out: dict[str, str] = {}
    for name, path in paths.items():
        hit = next((prefix for prefix in holed if path[: len(prefix)] == prefix and len(path) > len(prefix)), None)
        if hit is not None:
            out[name] = ".".join(map(str, hit)) or "(the root)"
    return out


def _clashes(paths: dict[str, NestedPath], limit: int) -> set[str]:
    """The keys ``set_element`` could not place at ``paths`` in this order: each key that meets an
    entry already there, every key under the entry it meets, and each key that would take the
    lists past ``limit`` entries in all."""
    root = _Node(is_list=False)
    slots = 0
    bad: set[str] = set()
    at: set[NestedPath] = set()  # the entries clashed at: every key below one clashes too
    for name, path in paths.items():
        node, more, where = root, 0, None
        last = len(path) - 1
        for i, step in enumerate(path):
            if node.is_list != (type(step) is int):  # a list indexed by a name, or a dict by an index
                where = path[:i]
                break
            if node.is_list:
                more += max(0, int(step) + 1 - node.length)
            child = node.entries.get(step)
            if i == last:
                where = path if child is not None else None
                break
            if child is None:  # new containers from here on: each list as long as its index asks
                more += sum(q + 1 for q in path[i + 1 :] if type(q) is int)
                break
            if isinstance(child, str):  # a value where this path needs a container
                where = path[: i + 1]
                break
            node = child
        if where is not None or slots + more > limit:
            bad.add(name)
            if where is not None:
                at.add(where)
            continue
        slots += more
        node = root
        for i, step in enumerate(path):
            if node.is_list:
                node.length = max(node.length, int(step) + 1)
            if i == last:
                node.entries[step] = name
                break
            child = node.entries.get(step)
            if child is None:
                child = node.entries[step] = _Node(is_list=type(path[i + 1]) is int)
            assert isinstance(child, _Node)
            node = child
    if at:
        bad.update(name for name, path in paths.items() if any(path[:j] in at for j in range(1, len(path) + 1)))
    return bad


def dim0_cut(manifest: Manifest) -> Callable[[Item], bool]:
    """Which tensors of ``manifest`` a DCP output cuts on dim 0 across its ranks, as FSDP2 cuts
    them (the rest rank 0 holds whole).

    A DCP source of more than one rank keeps its own cut: its whole tensors are those its writer
    kept whole (a buffer, a DDP replica, a step). Any other source (one rank, or another format's
    layout) is cut as FSDP2 cuts a model: master weights and optimizer state, and the floating
    point parameters of at least one dimension, but for those the optimizer does not train where
    the source's optimizer state names its parameters (buffers, frozen weights); 0-dim steps, RNG
    states and counters stay whole."""
    if manifest.format == "dcp" and (manifest.layout.world_size or 1) > 1:
        return lambda item: sum(1 for p in item.pieces if p.replica == 0) > 1
    trained = _trained(manifest)

    def cut(item: Item) -> bool:
        if not item.shape:
            return False
        if item.kind in ("master", "optim"):
            return True
        floating = (item.dtype or "").startswith(("float", "bfloat"))
        return item.kind == "param" and floating and (trained is None or canonical(item.name) in trained)

    return cut


def _trained(manifest: Manifest) -> set[str] | None:
    """The parameters (canonical names) the source's optimizer keeps moments of; None where its
    state names no parameter of the manifest (none, or keyed by index: torch's own state_dict)."""
    trained = set()
    for item in manifest.items.values():
        if item.kind == "optim" and (found := param_state(item.name, MOMENTS)):
            trained.add(canonical(found[0].removeprefix("optim.state.").removeprefix("optimizer.state.")))
    params = {canonical(n) for n, item in manifest.items.items() if item.kind == "param"}
    return trained if trained & params else None


class DcpWriter:
    """Writes rank files one at a time (``write``: any process may write any rank) and then the
    ``.metadata`` index of all of them (``finish``)."""

    def __init__(
        self, world_size: int, items: list[Item], *, cut: Callable[[Item], bool], names: dict[str, str] | None = None
    ) -> None:
        """``cut``: whether a tensor is cut on dim 0 across the ranks (:func:`dim0_cut`); ``names``:
        the state-dict key of an item written under another name than its own (``--kind master``:
        a master copy under its parameter's name)."""
        if world_size < 1:
            raise UsageError("--world-size must be at least 1")
        self.world = world_size
        self.items = items
        self.names = names or {}
        self._scratch = Scratch()  # one reusable tensor buffer, grown to the largest chunk
        self.cuts: dict[str, list[tuple[int, Box]]] = {}
        for item in items:
            if not item.is_tensor:
                continue
            assert item.shape is not None
            boxes = chunk_boxes(item.shape, world_size if cut(item) else 1)
            self.cuts[item.name] = [(r, b) for r, b in enumerate(boxes) if b is not None]

    @functools.cached_property
    def _planner(self) -> tuple[dict[str, NestedPath], dict[str, str]]:
        keyed = [
            dataclasses.replace(i, name=self._key(i), nesting=None) if i.name in self.names else i for i in self.items
        ]
        return planner_paths(keyed)

    def _key(self, item: Item) -> str:
        """Item ``item``'s key in the state dict written."""
        return self.names.get(item.name, item.name)

    def notes(self) -> list[str]:
        """What the plan should say: keys written flat though their source recorded a nested path."""
        flat = self._planner[1]
        if not flat:
            return []
        name, why = next(iter(flat.items()))
        return [
            f"{len(flat)} state-dict key(s) written flat in .metadata's planner_data, not at the nested path "
            f"the source recorded (dcp_to_torch_save gives them as top-level dotted keys), e.g. {name!r}: {why}"
        ]

    def files(self) -> list[PlannedFile]:
        sizes: list[list[int]] = [[] for _ in range(self.world)]
        for item in self.items:  # (objects are rank 0's records, not counted among its tensors)
            if item.is_tensor:
                assert item.dtype is not None
                for r, box in self.cuts[item.name]:
                    sizes[r].append(box.volume * carrier(item.dtype).itemsize)
        return [PlannedFile.of(f"__{r}_0.distcp", (r,), s) for r, s in enumerate(sizes)]

    def write(
        self, rank: int, out: Path, reader: PieceReader, progress: Callable[[int], None] | None
    ) -> list[tuple[str, tuple[int, ...] | None, int, int]]:
        """Write rank ``rank``'s ``.distcp`` file; returns (item, chunk offsets or None for bytes,
        byte offset, length) for each record, for ``finish``. Every record is a ``torch.save``
        archive, written without torch (:func:`ckpttool.formats._ptwrite.save_each`)."""
        keys: list[tuple[str, tuple[int, ...] | None]] = []
        trees: list[Any] = []
        for item in self.items:
            if not item.is_tensor:
                if rank == 0:
                    keys.append((self._key(item), None))
                    trees.append(Raw(unread_record(reader, item)) if unread(item) else carried(reader, item))
                continue
            assert item.dtype is not None
            mine = [box for r, box in self.cuts[item.name] if r == rank]
            if mine:
                check_coverage(item)
            for box in mine:  # as DCP's FileSystemWriter: one archive per chunk, straight into the file
                keys.append((self._key(item), box.offsets))
                trees.append(assembled(reader, item, box))
        with open_output(out) as f:  # each archive's tensor filled while the one before is written
            spans = save_each(iter(trees), f, scratch=self._scratch, progress=progress)
        return [(name, offsets, start, length) for (name, offsets), (start, length) in zip(keys, spans, strict=True)]

    def last_files(self) -> list[str]:
        """The files :meth:`finish` writes once every planned file is written."""
        return [".metadata"]

    def finish(self, tmp: Path, results: list[list[Record]]) -> None:
        """Write ``.metadata`` for the rank files whose ``write`` results are given, in rank order."""
        keys: dict[str, TensorMeta | None] = {}
        for item in self.items:  # in the source's order, tensors and objects as they come
            if item.is_tensor:
                assert item.shape is not None and item.dtype is not None
                keys[self._key(item)] = (
                    item.dtype,
                    item.shape,
                    [b for _, b in self.cuts[item.name]],
                )
            else:
                keys[self._key(item)] = None
        write_metadata(
            tmp / ".metadata",
            keys=keys,
            records={f"__{rank}_0.distcp": entries for rank, entries in enumerate(results)},
            # the source's nested paths where it recorded them, else one flat level
            planner_data=self._planner[0],
            # the directory itself: a staging path would be gone once published, and would make two
            # identical runs write different bytes
            checkpoint_id=".",
        )


Record = tuple[str, tuple[int, ...] | None, int, int]
"""(state-dict key, chunk offsets or None for a bytes item, byte offset in its file, length)"""
TensorMeta = tuple[str, tuple[int, ...], list[Box]]
"""(dtype, global shape, chunk boxes) of a tensor key"""


def write_metadata(
    path: Path,
    *,
    keys: dict[str, TensorMeta | None],
    records: dict[str, list[Record]],
    planner_data: Any,
    checkpoint_id: str,
) -> None:
    """Write a DCP ``.metadata`` file: torch's own ``Metadata`` (``keys``: the state-dict keys in
    order, a tensor's dtype, global shape and chunk boxes, or None for a bytes key; ``records``:
    for each data file, where each chunk or object lies in it), pickled as DCP pickles it
    (``pickle.dump``, the default protocol). A chunk's ``MetadataIndex.index`` is its position in
    its tensor's chunks, as DCP's global plan numbers them. No torch needed: the pickle names
    torch's classes (see :class:`_Pickle4`); ``pickle.load`` with torch installed rebuilds them,
    and the bytes equal what pickling the real objects gives (a test checks).

    The pickler here takes about 45 us per record: past ``TORCH_PICKLE_FROM`` records,
    torch's own classes and the C pickler are faster despite the 2 s it takes to import them."""
    same = {name: name for name in keys}  # one string object per key, pickled once
    position: dict[tuple[str, tuple[int, ...] | None], int] = {
        (name, b.offsets): i for name, spec in keys.items() if spec is not None for i, b in enumerate(spec[2])
    }
    indexed = {
        rel: [(same.get(n, n), offsets, at, length, position.get((n, offsets))) for n, offsets, at, length in entries]
        for rel, entries in records.items()
    }
    with open(path, "wb") as fh, gc_paused():
        if sum(len(entries) for entries in records.values()) < TORCH_PICKLE_FROM:
            try:
                fh.write(_Pickle4().dumps(_standin_metadata(keys, indexed, planner_data, checkpoint_id)))
                return
            except (ValueError, TypeError):  # a value _Pickle4 does not write (a str of 64 KiB, a subclass)
                pass  # nothing was written: dumps failed before
        # DCP's FileSystemWriter: pickle.dump with the default protocol
        pickle.dump(_torch_metadata(keys, indexed, planner_data, checkpoint_id), fh)


_Indexed = tuple[str, tuple[int, ...] | None, int, int, int | None]
"""A ``Record`` with its chunk's position among its tensor's chunks (None for a bytes item)"""


TORCH_PICKLE_FROM = 50_000


def _standin_metadata(
    keys: dict[str, TensorMeta | None], records: dict[str, list[_Indexed]], planner_data: Any, checkpoint_id: str
) -> _New:
    m = _Names()
    sd_meta: dict[str, Any] = {}
    for name, spec in keys.items():
        if spec is None:
            sd_meta[name] = _New(m.cls(_METADATA, "BytesStorageMetadata"), None)
            continue
        dtype, shape, boxes = spec
        properties = _New(m.cls(_METADATA, "TensorProperties"), (m.dtype(dtype), m.strided, False, m.contiguous, False))
        chunks = [
            _New(m.cls(_METADATA, "ChunkStorageMetadata"), {"offsets": m.size(b.offsets), "sizes": m.size(b.sizes)})
            for b in boxes
        ]
        state = {"properties": properties, "size": m.size(shape), "chunks": chunks}
        sd_meta[name] = _New(m.cls(_METADATA, "TensorStorageMetadata"), state)
    storage: dict[Any, Any] = {}
    for rel, entries in records.items():
        for name, offsets, at, length, position in entries:
            index = {"fqn": name, "index": position} | ({} if offsets is None else {"offset": m.size(offsets)})
            info = {"relative_path": rel, "offset": at, "length": length}
            storage[_New(m.cls(_METADATA, "MetadataIndex"), index)] = _New(m.cls(_FILESYSTEM, "_StorageInfo"), info)
    meta: dict[str, Any] = {"checkpoint_id": checkpoint_id, "save_id": None, "load_id": None, "modules": []}
    md = _New(
        m.cls(_METADATA, "Metadata"),
        {
            "state_dict_metadata": sd_meta,
            "planner_data": planner_data,
            "storage_data": storage,
            "storage_meta": _New(m.cls(_METADATA, "StorageMeta"), meta),
            "version": "1.0.0",
        },
    )
    return md


def _torch_metadata(
    keys: dict[str, TensorMeta | None], records: dict[str, list[_Indexed]], planner_data: Any, checkpoint_id: str
) -> Any:
    """The same ``Metadata``, built from torch's classes."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    storage: dict[Any, Any] = {}
    for rel, entries in records.items():
        for name, offsets, at, length, position in entries:
            index = MetadataIndex(name, None if offsets is None else torch.Size(offsets), position)
            storage[index] = _StorageInfo(rel, at, length)
    sd_meta: dict[str, Any] = {}
    for name, spec in keys.items():
        if spec is None:
            sd_meta[name] = BytesStorageMetadata()
            continue
        dtype, shape, boxes = spec
        sd_meta[name] = TensorStorageMetadata(
            properties=TensorProperties(dtype=getattr(torch, dtype)),
            size=torch.Size(shape),
            chunks=[ChunkStorageMetadata(offsets=torch.Size(b.offsets), sizes=torch.Size(b.sizes)) for b in boxes],
        )
    return Metadata(
        state_dict_metadata=sd_meta,
        planner_data=planner_data,
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=checkpoint_id, modules=[]),
        version="1.0.0",
    )


_METADATA = "torch.distributed.checkpoint.metadata"
_FILESYSTEM = "torch.distributed.checkpoint.filesystem"


@dataclass(eq=False, slots=True)
class _New:
    """An instance of ``cls`` as ``copyreg.__newobj__`` pickles it: ``cls()`` then ``BUILD`` with
    ``state`` (no state: nothing to build)."""

    cls: GlobalRef
    state: Any


@dataclass(eq=False, slots=True)
class _Reduce:
    """``func(*args)`` (``REDUCE``)."""

    func: GlobalRef
    args: tuple[Any, ...]


class _Names:
    """One stand-in object per torch name, so the pickle memo refers back to it as pickling the
    real objects would. The module-name strings are distinct objects where torch's are (a dtype's
    ``'torch'`` is not ``torch.Size``'s)."""

    def __init__(self) -> None:
        self.classes: dict[tuple[str, str], GlobalRef] = {}
        self.dtypes: dict[str, GlobalRef] = {}
        self.dtype_module = "".join(["tor", "ch"])  # not the interned literal
        self.size_cls = GlobalRef("".join(["tor", "ch"]), "Size")
        self.strided = _Reduce(GlobalRef("torch.serialization", "_get_layout"), ("torch.strided",))
        self.contiguous = _Reduce(GlobalRef(_METADATA, "_MEM_FORMAT_ENCODING"), (0,))

    def cls(self, module: str, name: str) -> GlobalRef:
        ref = self.classes.get((module, name))
        if ref is None:
            ref = self.classes[(module, name)] = GlobalRef(module, name)  # module: one of the constants below
        return ref

    def dtype(self, name: str) -> GlobalRef:
        ref = self.dtypes.get(name)
        if ref is None:
            ref = self.dtypes[name] = GlobalRef(self.dtype_module, name)
        return ref

    def size(self, dims: tuple[int, ...]) -> _Reduce:
        return _Reduce(self.size_cls, ((*dims,),))  # a new tuple each time, as torch.Size's reduce makes


class _Pickle4:
    """``pickle.dumps(obj)`` (protocol 4 or 5) as CPython's C pickler writes it, for the values a
    ``.metadata`` holds (None, bool, int, float, str, tuple, list, dict) and the stand-ins for
    torch's objects (:class:`GlobalRef`, :class:`_New`, :class:`_Reduce`). Same opcodes, the same
    memo (by object identity), the same batches of 1000 (with the C pickler's empty batch after a
    dict whose size is a multiple of 1000) and the same frames (cut after the object that takes a
    frame past 64 KiB). Written out rather than built on :class:`pickle._Pickler`, which frames
    differently and is four times slower."""

    _FRAME = 1 << 16
    _BATCH = 1000

    def __init__(self) -> None:
        # pickle.dump's default protocol, as DCP uses it: 4, or 5 from Python 3.14 on (the same
        # opcodes for these values, another PROTO byte)
        self.done = bytearray(pickle.PROTO + bytes((pickle.DEFAULT_PROTOCOL,)))
        self.frame = bytearray()
        self.memo: dict[int, tuple[int, Any]] = {}  # id -> (index, object kept alive)

    def dumps(self, obj: Any) -> bytes:
        self.save(obj)
        self.frame += pickle.STOP
        self._commit()
        return bytes(self.done)

    def _commit(self) -> None:
        if len(self.frame) >= 4:  # shorter frames go without a header
            self.done += pickle.FRAME + struct.pack("<Q", len(self.frame))
        self.done += self.frame
        self.frame = bytearray()

    def _memoize(self, obj: Any) -> None:
        self.memo[id(obj)] = (len(self.memo), obj)
        self.frame += pickle.MEMOIZE

    def _get(self, index: int) -> bytes:
        return pickle.BINGET + bytes((index,)) if index < 256 else pickle.LONG_BINGET + struct.pack("<I", index)

    def save(self, obj: Any) -> None:
        if len(self.frame) >= self._FRAME:  # a frame ends before the object that finds it full
            self._commit()
        t = type(obj)
        if obj is None or t is bool or t is int or t is float:
            self._atom(obj)
        else:
            self._save(obj)

    def _atom(self, obj: Any) -> None:
        out = self.frame
        t = type(obj)
        if obj is None:
            out += pickle.NONE
        elif t is bool:
            out += pickle.NEWTRUE if obj else pickle.NEWFALSE
        elif t is int:
            if 0 <= obj < 256:
                out += pickle.BININT1 + bytes((obj,))
            elif 0 <= obj < 65536:
                out += pickle.BININT2 + struct.pack("<H", obj)
            elif -(2**31) <= obj < 2**31:
                out += pickle.BININT + struct.pack("<i", obj)
            else:
                data = pickle.encode_long(obj)
                size = bytes((len(data),)) if len(data) < 256 else struct.pack("<i", len(data))
                out += (pickle.LONG1 if len(data) < 256 else pickle.LONG4) + size + data
        else:
            out += pickle.BINFLOAT + struct.pack(">d", obj)

    def _save(self, obj: Any) -> None:
        out = self.frame
        t = type(obj)
        if t is tuple and not obj:
            out += pickle.EMPTY_TUPLE
            return
        seen = self.memo.get(id(obj))
        if seen is not None:
            out += self._get(seen[0])
            return
        if t is str:
            data = obj.encode("utf-8", "surrogatepass")
            if len(data) >= self._FRAME:
                raise ValueError("a .metadata string of 64 KiB or more")  # the C pickler writes it outside frames
            size = bytes((len(data),)) if len(data) < 256 else struct.pack("<I", len(data))
            out += (pickle.SHORT_BINUNICODE if len(data) < 256 else pickle.BINUNICODE) + size + data
            self._memoize(obj)
        elif t is tuple:
            if len(obj) <= 3:
                for v in obj:
                    self.save(v)
                self.frame += (pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3)[len(obj) - 1]
            else:
                out += pickle.MARK
                for v in obj:
                    self.save(v)
                self.frame += pickle.TUPLE
            self._memoize(obj)
        elif t is list:
            out += pickle.EMPTY_LIST
            self._memoize(obj)
            if len(obj) == 1:
                self.save(obj[0])
                self.frame += pickle.APPEND
            elif obj:
                for at in range(0, len(obj), self._BATCH):
                    self.frame += pickle.MARK
                    for v in obj[at : at + self._BATCH]:
                        self.save(v)
                    self.frame += pickle.APPENDS
        elif t is dict:
            out += pickle.EMPTY_DICT
            self._memoize(obj)
            if len(obj) == 1:
                for k, v in obj.items():
                    self.save(k)
                    self.save(v)
                self.frame += pickle.SETITEM
            elif obj:
                items = list(obj.items())
                for at in range(0, len(items) + 1, self._BATCH):  # an empty last batch when len % 1000 == 0
                    self.frame += pickle.MARK
                    for k, v in items[at : at + self._BATCH]:
                        self.save(k)
                        self.save(v)
                    self.frame += pickle.SETITEMS
        elif t is GlobalRef:
            self.save(obj.module)
            self.save(obj.name)
            self.frame += pickle.STACK_GLOBAL
            self._memoize(obj)
        elif t is _New:
            self.save(obj.cls)
            self.save(())
            self.frame += pickle.NEWOBJ
            self._memoize(obj)
            if obj.state is not None:
                self.save(obj.state)
                self.frame += pickle.BUILD
        elif t is _Reduce:
            self.save(obj.func)
            self.save(obj.args)
            self.frame += pickle.REDUCE
            self._memoize(obj)
        else:
            raise TypeError(f"cannot write a {t.__name__} into a .metadata")


def write_dcp(
    adapter: Adapter,
    manifest: Manifest,
    dst: Path,
    *,
    world_size: int,
    items: list[Item],
    names: dict[str, str] | None = None,
    progress: Callable[[int], None] | None = None,
    finish: Callable[[Path], None] | None = None,
) -> list[str]:
    """Write ``items`` of ``manifest`` (under the keys ``names`` gives, else their own) as a DCP
    checkpoint of ``world_size`` ranks at ``dst``
    (published atomically; ``finish`` called with the staging directory first: the seal).
    Returns the files written."""
    writer = DcpWriter(world_size, items, cut=dim0_cut(manifest), names=names)
    with staged_dir(dst) as tmp:
        results = []
        with adapter.reader(manifest) as reader:
            for r in range(world_size):
                results.append(writer.write(r, tmp / f"__{r}_0.distcp", reader, progress))
        writer.finish(tmp, results)
        if finish is not None:
            finish(tmp)
        fsync_tree(tmp)
        publish_dir(tmp, dst)
    return [".metadata"] + [f"__{r}_0.distcp" for r in range(world_size)]


__all__ = [
    "DcpWriter",
    "NestedPath",
    "Record",
    "chunk_boxes",
    "dim0_cut",
    "planner_paths",
    "write_dcp",
    "write_metadata",
]
