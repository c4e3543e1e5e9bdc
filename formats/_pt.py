"""Pieces stored inside ``torch.save`` files, shared by the torch, megatron, deepspeed and
rankshards adapters.

A piece locator ``{"storage", "storage_offset", "shape", "stride"}`` names a strided view of one
storage of a ``.pt`` archive; a flat range of a flat optimizer partition is such a view too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ckpttool import _dtensor, _torchzip, _unpickle
from ckpttool.dtypes import dtype as lookup_dtype
from ckpttool.errors import (
    CkptError,
    CorruptFileError,
    IncompleteCheckpointError,
    UnsafePickleError,
    UnsupportedError,
)
from ckpttool.formats.base import PieceReader
from ckpttool.geometry import Box
from ckpttool.io import RandomAccessFile, confine
from ckpttool.manifest import Item, Manifest, Piece
from ckpttool.naming import MOMENTS
from ckpttool.values import flatten

ZIP_MAGIC = b"PK\x03\x04"


SUFFIXES = (".pt", ".pth", ".bin")
"""the names torch.save files go by"""


LEGACY_MAGIC = b"\x80\x02\x8a"
"""how a pre-1.6 (pickle, not zip) torch.save file starts: protocol 2, then its magic number as a long"""


def check_head(rel: str, head: bytes, size: int) -> None:
    """Refuse a file said to be a torch.save whose first bytes (``head``, up to 4) are not the
    zip's: empty (the save stopped before its first write), zeros (blocks allocated but never
    written: a crash or power loss after the file got its size), a legacy pickle, something else."""
    if head == ZIP_MAGIC:
        return
    if size == 0:
        raise CorruptFileError(
            f"{rel}: the file is empty (0 bytes): the save stopped before its first write",
            hint="use another checkpoint, or save this one again",
            path=rel,
            rule="truncated-file",
        )
    if not head.strip(b"\0"):
        raise CorruptFileError(
            f"{rel}: starts with zero bytes where torch.save's zip header is: space the file system "
            "allocated but the save never wrote (a crash or power loss during the save, a disk that filled)",
            hint="use another checkpoint, or restore the file from a copy",
            path=rel,
        )
    if head[:3] == LEGACY_MAGIC:
        raise CorruptFileError(
            f"{rel}: legacy (pre-1.6, non-zip) torch.save format, which ckpttool does not read",
            hint="re-save it with a current torch: torch.save(torch.load(p, weights_only=True), p2)",
            path=rel,
        )
    raise CorruptFileError(
        f"{rel}: not a torch.save file: it starts with bytes {head.hex()}, not the zip header 504b0304",
        hint="check that the file is what its name says, or restore it from a copy",
        path=rel,
    )


def load(root: Path, rel: str, allow: Mapping[tuple[str, str], Any]) -> tuple[_torchzip.Archive, Any, int]:
    """Parse one torch.save file below ``root``: its archive (file left open), object and size."""
    f = RandomAccessFile(confine(root, rel, named_by="the listing"), display=rel)
    try:
        check_head(rel, bytes(f.read(0, min(4, f.size))), f.size)
        archive = _torchzip.Archive(f, display=rel, allow=allow)
        return archive, archive.load(), f.size
    except BaseException:
        f.close()
        raise


def load_or_note(
    root: Path, rel: str, allow: Mapping[tuple[str, str], Any], damaged: list[CkptError]
) -> tuple[_torchzip.Archive, Any, int] | None:
    """:func:`load`; or, where the file is missing, cut short or damaged, None with its error added
    to ``damaged``, so that a read of every rank's file names each damaged one
    (:func:`~ckpttool.errors.raise_together`). A hostile pickle is raised at once, carrying the
    damage found before it (which it dropped: an earlier rank's file cut short went unsaid)."""
    try:
        return load(root, rel, allow)
    except (CorruptFileError, IncompleteCheckpointError) as exc:
        damaged.append(exc)
        return None
    except UnsafePickleError as exc:
        exc.others = [*exc.others, *(e for d in damaged for e in (d, *d.others))]
        raise


NESTED_LIMIT = 64 * 2**20
"""Largest byte value scanned for a nested pickle (TransformerEngine's are a few KiB)."""


PICKLE_SUFFIXES = (*SUFFIXES, ".pkl", ".pickle")
"""the names of files that ``torch.load`` or ``pickle.load`` is pointed at"""

BESIDE_LIMIT = 16 * 2**20
"""Longest pickle read of a file beside the state (:func:`hostile_beside`; a Trainer's
``training_args.bin`` is a few KiB): read op by op in Python, about 2 s a limit's worth"""


def foreign_zip(path: Path) -> bool:
    """Whether file ``path`` is a zip archive that torch.save did not write (a TorchScript file,
    whose members torch.jit.save compresses beside its ``constants.pkl`` and ``code/``; a zip of
    assets named ``.bin``): kept beside a checkpoint, it is no torch.save file to judge by torch.save's
    rules. One that does not read as a zip at all (cut short, damaged) is not foreign."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
    except (OSError, zipfile.BadZipFile, ValueError, EOFError, NotImplementedError):
        return False
    pickles = [i.filename for i in infos if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1]
    return (
        len(pickles) != 1
        or any(i.compress_type != zipfile.ZIP_STORED for i in infos)
        or any(i.filename.endswith("/constants.pkl") or "/code/" in i.filename for i in infos)
    )


def hostile_beside(root: Path, manifest: Manifest) -> None:
    """The pickles a checkpoint keeps beside the state its format reads (``aux`` files: a Hugging
    Face Trainer's ``training_args.bin``, a ``.pt`` dropped into a DCP folder) are read by no reader,
    but whoever loads them with ``torch.load(weights_only=False)`` runs what they name: one that
    names a global that runs code (:func:`~ckpttool._unpickle.hostile`) is an ``unsafe-pickle``
    error in ``extras["findings"]`` (verify reports it, seal and the writers refuse); one too long to
    read whole (:data:`BESIDE_LIMIT`) is a warning, not checked. Files a format's reader already
    judged (the Trainer's state files) are not read again; a file that does not parse is left to
    the archive checks. Called by the commands that judge or write a checkpoint (verify, seal,
    convert, reshard, export), not by those that only list it."""
    judged = {f.get("file") for f in manifest.extras.get("findings") or () if f.get("rule") == "unsafe-pickle"}
    found = []
    for rec in manifest.files:
        if rec.role != "aux" or not rec.path.endswith(PICKLE_SUFFIXES) or rec.path in judged:
            continue
        try:
            name = _unpickle.hostile(_globals_of(root, rec.path))
        except _unpickle.PickleTooLong:
            found.append(
                {
                    "rule": "unsafe-pickle",
                    "severity": "warning",
                    "file": rec.path,
                    "message": f"{rec.path}: its pickle is longer than the {BESIDE_LIMIT >> 20} MiB ckpttool reads of "
                    "one: not checked for globals that run code",
                    "hint": "do not load it with torch.load(weights_only=False) unless you trust its source",
                }
            )
            continue
        if name is None:
            continue
        found.append(
            {
                "rule": "unsafe-pickle",
                "severity": "error",
                "file": rec.path,
                "message": f"{rec.path}: its pickle refers to {name}, which runs code or reaches the system; no "
                "reader of the checkpoint loads it, but torch.load(weights_only=False) of it would run that",
                "hint": "the file is hostile: delete it, do not load it with torch.load(weights_only=False), and "
                "take the checkpoint from a source you trust",
            }
        )
    if found:
        manifest.extras.setdefault("findings", []).extend(found)


def _globals_of(root: Path, rel: str) -> list[str]:
    """The globals the pickles of file ``rel`` name: a torch.save archive's ``data.pkl`` (nested
    archives in it too), else the pickles at the file's start, of any protocol (a plain pickle, a
    pre-1.6 torch.save file). None from a file that is neither (another zip, other bytes). Raises
    ``PickleTooLong`` for a pickle of more than :data:`BESIDE_LIMIT` bytes."""
    try:
        path = confine(root, rel, named_by="the listing")
        f = RandomAccessFile(path, display=rel)
    except (CkptError, OSError):
        return []
    try:
        if bytes(f.read(0, min(4, f.size))) == ZIP_MAGIC:
            try:
                archive = _torchzip.Archive(f, display=rel, allow={})
                info = archive.members[archive.prefix + "data.pkl"]
            except (CkptError, KeyError):
                return []  # (another zip, or a damaged one: the archive checks say which)
            if info.file_size > BESIDE_LIMIT:
                raise _unpickle.PickleTooLong
            return _unpickle.nested_globals(archive.pickle_bytes(check=False))
    except (CkptError, OSError, ValueError):
        return []
    finally:
        f.close()
    try:
        with open(path, "rb") as fh:  # (streamed: a pickle is read op by op, to its STOP)
            return _unpickle.stream_globals(fh, BESIDE_LIMIT)
    except OSError:
        return []


def saved_as(root: Path, inner: dict[str, str], sizes: dict[str, int]) -> tuple[str, str] | None:
    """Files saved under another file's name: ``torch.save(obj, path)`` names the archive inside a
    file after the file (``shard_00001/data.pkl`` in ``shard_00001.pt``), and a rename or a copy
    keeps it. ``inner``: each file's archive name. A file whose archive is named after another file
    of its folder is that file's save, whatever its bytes hold (a swap of files of one size and
    structure, or of replicated data, shows nowhere else). Archives named otherwise (a save to a
    temporary name renamed into place; into an open file, ``archive``) say nothing, nor do files
    of one name in many folders (Megatron's ``model_optim_rng.pt``). Returns the first such file
    and a message naming each, or None."""

    def stem(rel: str) -> tuple[str, str]:
        folder, _, base = rel.rpartition("/")
        return folder, base.rpartition(".")[0] or base

    by_stem = {stem(rel): rel for rel in inner}
    moved = {}
    for rel, name in sorted(inner.items()):
        other = by_stem.get((stem(rel)[0], name))
        if other is not None and other != rel:
            moved[rel] = other
    if not moved:
        return None
    said = []
    for a, b in moved.items():
        if moved.get(b) == a:
            if a < b:
                said.append(f"{a} and {b} were swapped: each was saved under the other's name")
        elif inner.get(b) == stem(b)[1] and sizes.get(a) == sizes.get(b) and same_bytes(root / a, root / b):
            said.append(f"{a} is a copy of {b}: {b} was copied over it")
        else:
            said.append(f"{a} was saved as {b}")
    first = next(iter(moved))
    message = "; ".join(said[:4]) + (" …" if len(said) > 4 else "")
    return first, f"{message} (torch.save names the archive inside a file after the file; {first}'s is {inner[first]}/)"


def same_bytes(a: Path, b: Path) -> bool:
    """Whether two files of one size hold the same bytes (read until they differ)."""
    try:
        with open(a, "rb") as fa, open(b, "rb") as fb:
            while chunk := fa.read(1 << 20):
                if chunk != fb.read(len(chunk)):
                    return False
    except OSError:
        return False
    return True


def nested_refusal(archive: _torchzip.Archive, value: Any) -> str | None:
    """For a value that holds a nested pickle (``_extra_state``: a uint8 tensor of pickled bytes,
    or an ``io.BytesIO``), the first global it names outside the nested allowlist; else None."""
    if isinstance(value, _unpickle.OpaqueBytes):
        data = value.data
    elif (
        isinstance(value, _unpickle.TensorRef)
        and value.dtype == "uint8"
        and len(value.shape) == 1
        and value.stride == (1,)
        and 0 < value.shape[0] <= NESTED_LIMIT
    ):
        data = _torchzip.read_tensor(archive, value).tobytes()
    else:
        return None
    return _unpickle.nested_refusal(data)


def tensor_piece(
    rel: str,
    ref: _unpickle.TensorRef,
    *,
    box: Box | None = None,
    start: int = 0,
    numel: int | None = None,
    flat: tuple[int, int] | None = None,
    rank: int | None = None,
    replica: int = 0,
    rows: tuple[int, int] | None = None,
) -> Piece:
    """A piece holding tensor ``ref`` of file ``rel`` (with ``rows``, its rows ``lo..hi`` on dim 0;
    with ``numel``, the 1-d run of ``numel`` elements from element ``start`` of a flat tensor)."""
    if rows is not None:
        lo, hi = rows
        if not ref.shape or not 0 <= lo <= hi <= ref.shape[0]:
            raise CorruptFileError(f"{rel}: rows {lo}..{hi} outside a tensor of {ref.shape}", path=rel)
        shape, stride = (hi - lo, *ref.shape[1:]), ref.stride
        offset = ref.storage_offset + lo * ref.stride[0]
        count = math.prod(shape)
    elif numel is None:
        shape, stride, offset = ref.shape, ref.stride, ref.storage_offset
        count = math.prod(shape)
    else:
        if len(ref.shape) != 1 or start < 0 or start + numel > ref.shape[0]:
            raise CorruptFileError(
                f"{rel}: range {start}..{start + numel} outside a flat tensor of {ref.shape}", path=rel
            )
        shape, stride, offset = (numel,), (ref.stride[0],), ref.storage_offset + start * ref.stride[0]
        count = numel
    locator: dict[str, Any] = {
        "storage": ref.storage.key,
        "storage_offset": offset,
        "shape": list(shape),
        "stride": list(stride),
    }
    return Piece(
        file=rel,
        locator=locator,
        box=box if box is not None else Box.whole(shape),
        flat=flat,
        rank=rank,
        replica=replica,
        nbytes=count * lookup_dtype(ref.dtype).itemsize,
    )


MAX_EXTRA_REGIONS = 1 << 16
"""most regions beyond one a DTensor that one file's DTensors may be cut into (a rank's strided
shards: a few each; a pickle referring to one DTensor of 4096 regions a thousand times made 4 M)"""


class DTensorPlacer:
    """Places the DTensors of one file: each once, however often the pickle refers to it, and no
    more than ``MAX_EXTRA_REGIONS`` regions beyond one a DTensor in all."""

    def __init__(self, rel: str) -> None:
        self.rel = rel
        self._placed: dict[int, tuple[Any, Any]] = {}  # by id: the DTensor (kept alive) and its parts
        self._extra = 0

    def parts(self, name: str, ref: _dtensor.DTensorRef) -> tuple[tuple[_unpickle.TensorRef, tuple[int, ...]], ...]:
        hit = self._placed.get(id(ref))
        if hit is None:
            hit = self._placed[id(ref)] = (ref, _dtensor_parts(self.rel, name, ref))
        self._extra += max(0, len(hit[1]) - 1)
        if self._extra > MAX_EXTRA_REGIONS:
            raise CorruptFileError(
                f"{self.rel}: its DTensors are cut into more than {MAX_EXTRA_REGIONS:,} regions beyond one each "
                "(a DTensor referred to again and again): it is not read",
                path=self.rel,
            )
        return hit[1]


def _dtensor_parts(
    rel: str, name: str, ref: _dtensor.DTensorRef
) -> tuple[tuple[_unpickle.TensorRef, tuple[int, ...]], ...]:
    """The regions of its global tensor that DTensor ``ref`` (leaf ``name`` of file ``rel``) holds:
    each a view of its local tensor, and where that lies in the global one."""
    try:
        parts = _dtensor.local_parts(ref)
    except _dtensor.DTensorError as exc:
        if any(p[0] == "partial" for p in ref.placements):
            raise UnsupportedError(
                f"{rel}: {name} is {exc}: each rank holds a term of a sum, not a piece of the tensor, and ckpttool "
                "does not add the ranks' values",
                hint="save it after .redistribute(placements=[Replicate()]) or .full_tensor(), or leave it out",
                path=rel,
            ) from None
        raise CorruptFileError(f"{rel}: {name} is a DTensor with {exc}", path=rel) from None
    return tuple((_dtensor.local_view(ref.local, at, shape), offset) for offset, shape, at in parts)


def object_piece(rel: str, path: str, *, rank: int | None = None, replica: int = 0) -> Piece:
    """A piece holding the non-tensor value at dotted ``path`` inside file ``rel``."""
    return Piece(file=rel, locator={"path": path}, box=Box((), ()), rank=rank, replica=replica)


class PtReader(PieceReader):
    """Reads pieces located by :func:`tensor_piece` / :func:`object_piece`."""

    def __init__(self, manifest: Manifest, allow: Mapping[tuple[str, str], Any]) -> None:
        super().__init__(manifest)
        self._allow = allow
        self._archives: dict[str, _torchzip.Archive] = {}
        self._objects: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}

    def archive(self, rel: str) -> _torchzip.Archive:
        archive = self._archives.get(rel)
        if archive is None:
            archive = _torchzip.Archive(self.files.get(rel), display=rel, allow=self._allow)
            self._archives[rel] = archive
        return archive

    def read(self, piece: Piece, item: Item, out: np.ndarray | None = None) -> np.ndarray:
        assert item.dtype is not None
        loc = piece.locator
        if "storage" not in loc:
            raise CorruptFileError(
                f"{piece.file}: {item.name} is a tensor in one place and another value in {piece.file}",
                path=piece.file,
            )
        storage = _unpickle.StorageRef(key=loc["storage"], dtype=item.dtype, numel=0, location="cpu")
        ref = _unpickle.TensorRef(storage, loc["storage_offset"], tuple(loc["shape"]), tuple(loc["stride"]), item.dtype)
        return _torchzip.read_tensor(self.archive(piece.file), ref, out)

    def archive_of(self, piece: Piece) -> _torchzip.Archive | None:
        return self.archive(piece.file)

    def read_in_object(self, item: Item, ref: _unpickle.TensorRef) -> np.ndarray:
        """The values of a tensor inside a value item (an RNG state's), ``ref`` as
        :meth:`read_object` gave it."""
        return _torchzip.read_tensor(self.archive(item.pieces[0].file), ref)

    def raw_span(self, piece: Piece, item: Item) -> tuple[int, int] | None:
        assert item.dtype is not None
        loc = piece.locator
        if "storage" not in loc:
            return None
        storage = _unpickle.StorageRef(key=loc["storage"], dtype=item.dtype, numel=0, location="cpu")
        ref = _unpickle.TensorRef(storage, loc["storage_offset"], tuple(loc["shape"]), tuple(loc["stride"]), item.dtype)
        archive = self.archive(piece.file)
        if math.prod(ref.shape):  # (a view past its storage's end is damage to name: verify reads no values)
            _torchzip.check_view(archive, ref)
        return _torchzip.tensor_span(archive, ref)

    def _tree(self, rel: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """File ``rel``'s pickled tree, and its leaves by dotted path (read once)."""
        cached = self._objects.get(rel)
        if cached is None:
            obj = self.archive(rel).load()
            tree = obj if isinstance(obj, dict) else {"value": obj}  # as the adapters name them
            cached = self._objects[rel] = (tree, dict(flatten(tree)))
        return cached

    def values_in_member(self, file: str, member: str) -> list[str]:
        head, _, key = member.rpartition("/")
        if not head.endswith("data"):
            return []
        try:
            leaves = self._tree(file)[1]
        except CkptError:
            return []
        return [p for p, v in leaves.items() if isinstance(v, _unpickle.TensorRef) and v.storage.key == key]

    def read_object(self, item: Item) -> Any:
        piece = item.pieces[0]
        tree, leaves = self._tree(piece.file)
        path = piece.locator["path"]
        if path in leaves:
            return leaves[path]
        try:  # a value the adapter recorded whole (a dict-valued entry): walk to it
            return lookup(tree, path)
        except KeyError:
            raise CorruptFileError(
                f"{piece.file}: no value at {piece.locator['path']!r} (the file changed since it was described?)",
                path=piece.file,
            ) from None


def lookup(tree: Any, path: str) -> Any:
    """The value at dotted ``path`` of a nested state dict, as :func:`~ckpttool.values.flatten`
    names it (keys may hold dots themselves: the longest key that fits is tried first)."""
    if isinstance(tree, dict):
        keys = sorted((k for k in tree if isinstance(k, str | int)), key=lambda k: -len(str(k)))
        for key in keys:
            name = str(key)
            if path == name:
                return tree[key]
            if path.startswith(name + "."):
                try:
                    return lookup(tree[key], path[len(name) + 1 :])
                except KeyError:
                    continue
    elif isinstance(tree, list | tuple):
        head, _, rest = path.partition(".")
        if head.isdigit() and int(head) < len(tree):
            return tree[int(head)] if not rest else lookup(tree[int(head)], rest)
    raise KeyError(path)


def archive_cache(reader: PieceReader) -> Callable[[str], _torchzip.Archive]:
    """``rel -> open archive`` for a writer that copies objects out of the source's rank files:
    the archives the reader keeps open (it closes them)."""
    if isinstance(reader, PtReader):
        return reader.archive
    inner = getattr(reader, "pt", None)  # a reader of other files that has torch.save files beside them
    if isinstance(inner, PtReader):
        return inner.archive
    raise TypeError(f"expected a torch.save reader, got {type(reader).__name__}")


def match_param_ids(
    order: list[tuple[str, tuple[int, ...]]], groups: list[Any], state: dict[Any, Any]
) -> dict[Any, tuple[str, int, int]] | None:
    """Name the parameters of a torch optimizer state dict, which keeps only integer ids.

    ``order`` is the model's parameters in registration order with their shapes. Each param group
    takes its parameters in that order (how Megatron and DeepSpeed build groups); they are matched
    by the shape of their per-element state (``naming.MOMENTS``: Adam's ``exp_avg``, SGD's
    ``momentum_buffer``, ...; only ``exp_avg`` was looked at, and SGD's momentum of one parameter
    was named after the next). Returns id -> (name, group, position in group), or None if the
    state does not fit the model.
    """
    taken: set[int] = set()  # positions in ``order`` (a name may stand twice: two chunks' copies)
    out: dict[Any, tuple[str, int, int]] = {}
    for g, group in enumerate(groups):
        pos = 0
        for i, pid in enumerate(group.get("params") or []):
            held = state.get(pid) or {}
            moment = next((held[k] for k in MOMENTS if isinstance(held.get(k), _unpickle.TensorRef)), None)
            shape = moment.shape if moment is not None else None
            while pos < len(order) and (pos in taken or (shape is not None and order[pos][1] != shape)):
                pos += 1
            if pos == len(order):
                return None
            out[pid] = (order[pos][0], g, i)
            taken.add(pos)
            pos += 1
    return out
