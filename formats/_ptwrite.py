"""Writing ``torch.save`` files from ckpttool's own values, one tensor in memory at a time.

A tree read through the restricted unpickler holds stand-ins (``Record`` for an allowlisted class,
``EnumValue``, ``TorchDType``, ``OrderedDictStandIn``) and tensors. :func:`save` pickles such a tree
back so that ``torch.load`` in the framework that wrote it rebuilds the original classes: a
stand-in is written as a reference to the class it stands for (its module and name), never by
importing that class, so Megatron or DeepSpeed need not be installed here.

Tensors are :class:`OutTensor` placeholders: the pickle names their storage (``data/<key>``) and
the bytes are produced by a callback, one storage at a time, straight into the zip record. The zip
is :mod:`ckpttool._zipwrite` (64-byte aligned records, CRC-32s, torch's serialization id), so the
output is what ``torch.save`` makes of the same tree, without importing torch.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import io
import itertools
import os
import pickle
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO, ClassVar

import numpy as np

from ckpttool import _dtensor, _torchzip, _unpickle, device
from ckpttool._zipwrite import PARALLEL, WRITE_CHUNK, ZipWriter
from ckpttool.dtypes import carrier
from ckpttool.errors import UnsupportedError
from ckpttool.formats.base import PlannedFile
from ckpttool.geometry import row_major_strides
from ckpttool.hashing import open_output
from ckpttool.io import helper

_STORAGE_CLASS = {
    "float32": "FloatStorage",
    "float64": "DoubleStorage",
    "float16": "HalfStorage",
    "bfloat16": "BFloat16Storage",
    "int64": "LongStorage",
    "int32": "IntStorage",
    "int16": "ShortStorage",
    "int8": "CharStorage",
    "uint8": "ByteStorage",
    "bool": "BoolStorage",
    "complex64": "ComplexFloatStorage",
    "complex128": "ComplexDoubleStorage",
}


@dataclass(frozen=True, slots=True)
class GlobalRef:
    """A class or function written into the pickle by name only."""

    module: str
    name: str


@dataclass(eq=False, slots=True)
class OutTensor:
    """A tensor to write: its dtype and shape; ``fill(buffer)`` produces its C-ordered bytes."""

    dtype: str
    shape: tuple[int, ...]
    fill: Callable[[np.ndarray], None]
    requires_grad: bool = False
    parts: Callable[[], Iterator[tuple[int, Callable[[np.ndarray], None] | None]]] | None = None
    """when set, the bytes as consecutive parts ``(nbytes, fill)`` (``fill`` None: zeros), so that a
    tensor far larger than any of its parts is written holding one part at a time"""
    attrs: dict[str, Any] | None = None
    """Python attributes the tensor carries (DeepSpeed's ``ds_id``): pickled, as torch pickles a
    tensor with a ``__dict__``, through ``_rebuild_from_type_v2`` with them as its state"""
    spans: tuple[tuple[int, int], ...] = ()
    """byte ranges of its data that the output's manifest makes pieces of (the parameters in a ZeRO
    partition): hashed on their own as they are written, for the seal"""

    @property
    def nbytes(self) -> int:
        n = carrier(self.dtype).itemsize
        for s in self.shape:
            n *= s
        return n

    @property
    def peak(self) -> int:
        """its largest piece filled at once: the whole tensor, or its largest part (see
        :func:`written_peak` for the one filled ahead)"""
        if self.parts is None:
            return self.nbytes
        return max((n for n, _ in self.parts()), default=0)


def streamed(
    dtype: str, shape: tuple[int, ...], parts: Callable[[], Iterator[tuple[int, Callable[[np.ndarray], None] | None]]]
) -> OutTensor:
    """An OutTensor made of consecutive parts (see ``OutTensor.parts``); filled whole, it fills part
    after part into the one buffer."""

    def fill(buf: np.ndarray) -> None:
        flat, pos = buf.reshape(-1).view(np.uint8), 0
        for n, part in parts():
            if part is None:
                flat[pos : pos + n] = 0
            else:
                part(flat[pos : pos + n])
            pos += n

    return OutTensor(dtype=dtype, shape=shape, fill=fill, parts=parts)


def assembled(reader: Any, item: Any, box: Any = None, *, requires_grad: bool = False) -> OutTensor:
    """``item`` (or the part ``box`` of it) as an OutTensor assembled from ``reader``'s pieces
    straight into the buffer :func:`save` fills it into."""
    from ckpttool.assemble import assemble

    dtype, shape = item.dtype, tuple(box.sizes if box is not None else item.shape)

    def fill(buf: np.ndarray) -> None:
        assemble(reader, item, out=buf.view(carrier(dtype)).reshape(shape), box=box)

    return OutTensor(dtype=dtype, shape=shape, fill=fill, requires_grad=requires_grad)


def carried(reader: Any, item: Any, *, now: bool = False) -> Any:
    """The non-tensor ``item`` as the restricted unpickler reads it, ready to be pickled again (its
    tensors, an RNG state say, copied from the archive that holds them; with ``now``, read at once,
    for a tree kept after the reader is closed)."""
    piece = item.pieces[0]
    return carry(reader.read_object(item), lambda: reader.archive_of(piece), now=now)


def carry(
    value: Any, archive_of: Callable[[], Any], _memo: dict[int, tuple[Any, Any]] | None = None, *, now: bool = False
) -> Any:
    """A source tree (RNG state, ``_extra_state``, ``step``) with its tensors turned into
    OutTensors that copy them from the archive ``archive_of()`` returns. An object the tree holds
    twice (a ``betas`` tuple shared by two param groups, a tied tensor) comes out as one object, so
    it is pickled once, as torch pickles it; a container holding itself comes out so too.

    ``now``: the tensors' bytes are read here and kept (small trees whose archive will not be open
    when they are written: a ShardedObject's grad scaler). Carrying the result again leaves it as it
    is, whatever archive that carry is given."""
    memo: dict[int, tuple[Any, Any]] = {} if _memo is None else _memo
    seen = memo.get(id(value))
    if seen is not None:
        return seen[0]

    def keep(out: Any) -> Any:
        memo[id(value)] = (out, value)  # the source object stays alive: its id is not reused
        return out

    if isinstance(value, _dtensor.DTensorRef):  # (a DTensor as a tensor is written as its item, assembled)
        raise UnsupportedError(
            f"a DTensor ({value.dtype}{list(value.shape)}) inside a value that is not a tensor (a Namespace, a list "
            "beside other values): ckpttool writes a DTensor only as a tensor item of its own, assembled from the "
            "ranks' files"
        )
    if isinstance(value, _unpickle.TensorRef):
        ref = value

        def fill(buf: np.ndarray, ref: Any = ref) -> None:
            _torchzip.read_tensor(archive_of(), ref, buf.view(carrier(ref.dtype)).reshape(ref.shape))

        attrs = dict(ref.extra) or None
        out = OutTensor(ref.dtype, ref.shape, fill, requires_grad=ref.requires_grad, attrs=attrs)
        if now:  # its bytes, read while the archive is open
            data = np.empty(out.nbytes, dtype=np.uint8)
            fill(data)
            out.fill = partial(_copy_into, data)
        elif out.nbytes > CARRY_PART and _torchzip.is_c_contiguous(ref.shape, ref.stride):
            out.parts = partial(_carried_parts, ref, archive_of, out.nbytes)
        return keep(out)
    if isinstance(value, _unpickle.Record):
        record = keep(type(value)())
        record.__dict__.update({k: carry(v, archive_of, memo, now=now) for k, v in value.__dict__.items()})
        return record
    if isinstance(value, _unpickle.OrderedDictStandIn):
        ordered = keep(_unpickle.OrderedDictStandIn())
        for k, v in value.items():
            ordered[k] = carry(v, archive_of, memo, now=now)
        ordered.__dict__.update(value.__dict__)
        return ordered
    if isinstance(value, _unpickle.CounterStandIn):
        counts = keep(_unpickle.CounterStandIn())
        for k, v in value.items():
            counts[k] = carry(v, archive_of, memo, now=now)
        return counts
    if isinstance(value, dict):
        mapping = keep({})
        for k, v in value.items():
            mapping[k] = carry(v, archive_of, memo, now=now)
        return mapping
    if isinstance(value, list):
        items = keep([])
        items.extend(carry(v, archive_of, memo, now=now) for v in value)
        return items
    if isinstance(value, _unpickle.TorchSize):
        return value
    if isinstance(value, tuple):
        return keep(tuple(carry(v, archive_of, memo, now=now) for v in value))
    return value


def _copy_into(data: np.ndarray, buf: np.ndarray) -> None:
    buf.reshape(-1).view(np.uint8)[...] = data


CARRY_PART = WRITE_CHUNK
"""a carried tensor bigger than this (a ZeRO flat partition copied as it is) is copied this many bytes
at a time, straight from the source record into the output's: one chunk of the zip writer's"""


PIPELINED = PARALLEL
"""a tensor given in parts of this size or more is filled on a helper thread a part ahead (from the
size on which the zip writer computes checksums beside the write)"""


def held(nbytes: int) -> int:
    """The largest piece of output a tensor of ``nbytes`` produced in ``CARRY_PART`` parts (a carried
    contiguous tensor, a ZeRO partition) is filled as; :func:`written_peak` counts the part filled
    ahead."""
    return min(nbytes, CARRY_PART)


def _carried_parts(
    ref: Any, archive_of: Callable[[], Any], nbytes: int
) -> Iterator[tuple[int, Callable[[np.ndarray], None] | None]]:
    """A contiguous source tensor's bytes, ``CARRY_PART`` at a time."""
    span: list[tuple[int, int]] = []

    def part(lo: int, buf: np.ndarray) -> None:
        archive = archive_of()
        if not span:
            found = _torchzip.tensor_span(archive, ref)
            if found is None:  # the storage is too short for it: read_tensor names the damage
                _torchzip.read_tensor(archive, ref)
                raise AssertionError("unreachable: read_tensor accepted a tensor its storage cannot hold")
            span.append(found)
        start = span[0][0] + lo
        view = buf.reshape(-1).view(np.uint8)
        if isinstance(archive.source, bytes):
            view[:] = np.frombuffer(archive.source, np.uint8, view.nbytes, start)
        else:
            archive.source.read_into(start, view.data)

    for lo in range(0, nbytes, CARRY_PART):
        yield min(CARRY_PART, nbytes - lo), partial(part, lo)


_PurePickler: Any = pickle._Pickler  # pure Python: its save() can be extended


class _Pickler(_PurePickler):
    def __init__(self, file: io.BytesIO, tensors: list[OutTensor]) -> None:
        super().__init__(file, protocol=2)
        self.tensors = tensors
        self.refs: dict[tuple[str, str], GlobalRef] = {}  # one object per global, for the memo
        # the OrderedDict or BytesIO pickled for a stand-in, one per stand-in: a stand-in met again
        # is a memo reference to it, as the shared object it was in the source
        self.stand_ins: dict[int, Any] = {}

    def _memoized(self, obj: Any) -> bool:
        """Write a reference to ``obj`` if it was pickled before (as torch's pickler does)."""
        x = self.memo.get(id(obj))
        if x is None:
            return False
        self.write(self.get(x[0]))
        return True

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageOf):
            t = obj.tensor
            numel = 1
            for s in t.shape:
                numel *= s
            if t.dtype in _STORAGE_CLASS:
                return ("storage", GlobalRef("torch", _STORAGE_CLASS[t.dtype]), obj.key, "cpu", numel)
            # dtypes with no typed-storage class (float8, uint16/32/64): torch names the untyped
            # storage, sized in bytes, and rebuilds with _rebuild_tensor_v3, which takes the dtype
            return ("storage", GlobalRef("torch.storage", "UntypedStorage"), obj.key, "cpu", t.nbytes)
        return None

    def _save_dict(self, obj: dict[Any, Any]) -> None:
        """A dict as CPython's C pickler writes it (``batch_dict_exact``): one item with SETITEM,
        more in batches of 1000, and an empty batch after a multiple of 1000."""
        self.write(pickle.EMPTY_DICT)
        self.memoize(obj)
        items = list(obj.items())
        if len(items) == 1:
            self.save(items[0][0])
            self.save(items[0][1])
            self.write(pickle.SETITEM)
            return
        if items:
            for at in range(0, len(items) + 1, self._BATCHSIZE):
                self.write(pickle.MARK)
                for k, v in items[at : at + self._BATCHSIZE]:
                    self.save(k)
                    self.save(v)
                self.write(pickle.SETITEMS)

    def _save_list(self, obj: list[Any]) -> None:
        """A list as the C pickler writes it (``batch_list_exact``): one item with APPEND, more in
        batches of 1000."""
        self.write(pickle.EMPTY_LIST)
        self.memoize(obj)
        if len(obj) == 1:
            self.save(obj[0])
            self.write(pickle.APPEND)
            return
        for at in range(0, len(obj), self._BATCHSIZE):
            self.write(pickle.MARK)
            for v in obj[at : at + self._BATCHSIZE]:
                self.save(v)
            self.write(pickle.APPENDS)

    dispatch: ClassVar[dict[type, Any]] = {**_PurePickler.dispatch, dict: _save_dict, list: _save_list}

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        t = type(obj)
        if t is _unpickle.TensorRef or t is _unpickle.StorageRef:
            raise TypeError("a tensor of the source reached the writer without carry(): it would be pickled as ours")
        if t is GlobalRef:
            ref = self.refs.setdefault((obj.module, obj.name), obj)
            if not self._memoized(ref):
                self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
                self.memoize(ref)
            return
        if self._memoized(obj):  # met before (a shared tensor, Record, tuple...): a reference
            return
        if t is OutTensor:
            key = str(len(self.tensors))  # a tensor met again is a memo reference (above)
            self.tensors.append(obj)
            v3 = obj.dtype not in _STORAGE_CLASS
            rebuild = GlobalRef("torch._utils", "_rebuild_tensor_v3" if v3 else "_rebuild_tensor_v2")
            hooks: collections.OrderedDict[Any, Any] = collections.OrderedDict()
            args: tuple[Any, ...] = (
                _StorageOf(obj, key), 0, tuple(obj.shape), row_major_strides(obj.shape), obj.requires_grad, hooks
            )  # fmt: skip
            if v3:
                args += (_unpickle.TorchDType(obj.dtype),)
            if obj.attrs:  # torch's Tensor.__reduce_ex__ for a tensor with a __dict__
                self.save(GlobalRef("torch._tensor", "_rebuild_from_type_v2"))
                self.save((rebuild, GlobalRef("torch", "Tensor"), args, dict(obj.attrs)))
            else:
                self.save(rebuild)
                self.save(args)
            self.write(pickle.REDUCE)
            self.memoize(obj)
            return
        if isinstance(obj, _unpickle.Record):
            module, name = type(obj)._qualname.rsplit(".", 1)
            self.save(GlobalRef(module, name))
            self.write(pickle.EMPTY_TUPLE + pickle.NEWOBJ)
            self.memoize(obj)
            self.save(dict(obj.__dict__))
            self.write(pickle.BUILD)
            return
        if t is _unpickle.EnumValue:
            module, name = obj.enum.rsplit(".", 1)
            self.save(GlobalRef(module, name))
            self.save((obj.value,))
            self.write(pickle.REDUCE)
            self.memoize(obj)
            return
        if t is _unpickle.TorchSize:
            self.save(GlobalRef("torch", "Size"))
            self.save((tuple(obj),))
            self.write(pickle.REDUCE)
            self.memoize(obj)
            return
        if t is datetime.datetime or t is datetime.time:  # (their protocol-4 state: protocol 2 leaves the fold out)
            self.save_reduce(*obj.__reduce_ex__(4), obj=obj)
            return
        if t is _unpickle.TorchVersion:  # (as torch's str subclass pickles: NEWOBJ)
            self.save(GlobalRef("torch.torch_version", "TorchVersion"))
            self.save((str(obj),))
            self.write(pickle.NEWOBJ)
            self.memoize(obj)
            return
        if t is _unpickle.TorchDType:
            self.save(GlobalRef("torch", str(obj)))
            return
        if t is _unpickle.OrderedDictStandIn or t is _unpickle.OpaqueBytes:
            real = self.stand_ins.get(id(obj))
            if real is None:
                if t is _unpickle.OpaqueBytes:
                    real = io.BytesIO(obj.data)
                else:
                    real = collections.OrderedDict(obj)
                    real.__dict__.update(getattr(obj, "__dict__", {}))
                self.stand_ins[id(obj)] = real
            super().save(real, save_persistent_id)
            return
        super().save(obj, save_persistent_id)


@dataclass(eq=False, slots=True)
class _StorageOf:
    tensor: OutTensor
    key: str


def dumps(tree: Any) -> tuple[bytes, list[OutTensor]]:
    """The ``data.pkl`` bytes of ``tree`` and the tensors it refers to, in storage-key order (the
    key of the i-th is ``str(i)``)."""
    buf = io.BytesIO()
    tensors: list[OutTensor] = []
    _Pickler(buf, tensors).dump(tree)
    return buf.getvalue(), tensors


class Scratch:
    """One reusable buffer for the tensors a writer produces, grown to the largest it has met (kept
    between files: a writer holds one and passes it to every :func:`save`)."""

    def __init__(self) -> None:
        self._buf = np.empty(0, dtype=np.uint8)

    def take(self, n: int) -> np.ndarray:
        if self._buf.nbytes < n:
            self._buf = np.empty(0, dtype=np.uint8)  # the outgrown one freed before the next is made
            self._buf = device.host_empty(n)  # pinned when a GPU fills it
        return self._buf[:n]


def _fill_into(view: np.ndarray, fill: Callable[[np.ndarray], None] | None) -> np.ndarray:
    if fill is None:
        view[:] = 0
    else:
        fill(view)
    return view


PREFETCH_MAX = 64 << 20
"""pieces up to this size are filled one ahead (two held at once); with a bigger one, one at a time"""


def written_peak(largest: int) -> int:
    """Bytes of output held at once to write a file whose largest tensor, or part of one, is
    ``largest``: from ``PIPELINED`` up to ``PREFETCH_MAX`` the next one is filled ahead."""
    return 2 * largest if PIPELINED <= largest <= PREFETCH_MAX else largest


@contextlib.contextmanager
def _filled_ahead(tensors: list[OutTensor], scratch: Scratch) -> Iterator[Iterator[np.ndarray]]:
    """The bytes of ``tensors`` (a whole tensor, or each of its parts in turn), in the order they
    are written: the next piece filled on the helper thread while the caller writes this one,
    into the two halves of ``scratch``. When no piece reaches ``PIPELINED`` bytes, or one is over
    ``PREFETCH_MAX``, they are filled one at a time. On leaving, a fill under way is waited for
    (after a failed write: the buffer is about to be reused)."""
    todo: list[tuple[int, Callable[[np.ndarray], None] | None]] = []
    for t in tensors:
        todo += list(t.parts()) if t.parts is not None else [(t.nbytes, t.fill)]
    biggest = max((n for n, _ in todo), default=0)
    if len(todo) < 2 or written_peak(biggest) == biggest:
        yield (_fill_into(scratch.take(n), fill) for n, fill in todo)
        return
    both = scratch.take(2 * biggest)
    halves = (both[:biggest], both[biggest:])
    pool = helper("fill")
    pending = [pool.submit(_fill_into, halves[0][: todo[0][0]], todo[0][1])]

    def stream() -> Iterator[np.ndarray]:
        for k in range(len(todo)):
            view = pending[0].result()
            if k + 1 < len(todo):
                n, fill = todo[k + 1]
                pending[0] = pool.submit(_fill_into, halves[(k + 1) % 2][:n], fill)
            yield view

    try:
        yield stream()
    finally:
        pending[0].cancel() or pending[0].exception()


def save(tree: Any, path: Path | BinaryIO, *, scratch: Scratch | None = None) -> int:
    """Write ``tree`` as a ``torch.save`` file at ``path`` (not atomically: callers write into a
    directory that is published as a whole), or into an open binary file from its current position
    on (as DCP stores its records). Tensors are produced into ``scratch`` (a fresh one when not
    given), the next filled while the last is written. Returns the bytes of tensor data written. No
    torch needed: the zip container is :class:`ckpttool._zipwrite.ZipWriter`, which writes what
    torch's own writer writes."""
    data, tensors = dumps(tree)
    with _filled_ahead(tensors, scratch or Scratch()) as views:
        if isinstance(path, Path):
            with open_output(path) as fh:
                return _write(fh, os.path.splitext(path.name)[0], data, tensors, views)  # torch names it so
        return _write(path, "archive", data, tensors, views)


def planned(path: str, key: tuple[int, ...], tree: Any) -> PlannedFile:
    """The plan of :func:`save` of ``tree`` at ``path`` (``reshard --dry-run``): the tensors it
    pickles (one per object, as :func:`save` writes them), their bytes, and the largest piece of
    them filled at once. Nothing is read: a tree is built of fills that run only when written."""
    _, tensors = dumps(tree)
    return PlannedFile(
        path=path,
        key=key,
        nbytes=sum(t.nbytes for t in tensors),
        tensors=len(tensors),
        largest=max((t.peak for t in tensors), default=0),
    )


def unread(rel: str) -> Any:
    """The archive callable a tree is built with for :func:`planned` (never called: planning reads
    no tensor)."""
    raise AssertionError(f"planning read {rel}")


@dataclass(frozen=True, slots=True)
class Raw:
    """A record copied as it is (a DCP bytes item whose pickle ckpttool will not read): its bytes."""

    data: bytes


def save_each(
    trees: Iterator[Any], fh: BinaryIO, *, scratch: Scratch, progress: Callable[[int], None] | None = None
) -> list[tuple[int, int]]:
    """Write each of ``trees`` as its own ``torch.save`` archive, one after the other into ``fh``
    (a DCP rank file): what :func:`save` into ``fh`` does for each, with the tensors of the next
    archive filled while this one's are written; a :class:`Raw` tree is written as its bytes.
    Returns each archive's (offset, length) in the file; ``progress`` gets each archive's bytes of
    tensor data."""
    dumped = [tree if isinstance(tree, Raw) else dumps(tree) for tree in trees]
    spans = []
    with _filled_ahead([t for d in dumped if not isinstance(d, Raw) for t in d[1]], scratch) as views:
        for entry in dumped:
            start = fh.tell()
            if isinstance(entry, Raw):
                fh.write(entry.data)
                spans.append((start, len(entry.data)))
                continue
            data, tensors = entry
            n = _write(fh, "archive", data, tensors, views)
            spans.append((start, fh.tell() - start))
            if progress is not None:
                progress(n)
    return spans


def _write(fh: BinaryIO, archive: str, data: bytes, tensors: list[OutTensor], views: Iterator[np.ndarray]) -> int:
    """One archive; ``views`` gives its tensors' bytes (whole, or part after part) in order."""
    zf = ZipWriter(fh, archive)
    zf.write_record("data.pkl", data)
    zf.write_record(".format_version", b"1")
    zf.write_record(".storage_alignment", b"64")
    zf.write_record("byteorder", sys.byteorder.encode())
    total = 0
    for key, t in enumerate(tensors):
        if t.parts is not None:
            count = sum(1 for _ in t.parts())
            zf.write_record_parts(f"data/{key}", t.nbytes, itertools.islice(views, count), t.spans)
        else:
            zf.write_record(f"data/{key}", next(views), t.spans)
        total += t.nbytes
    zf.finish()
    return total


__all__ = [
    "CARRY_PART",
    "GlobalRef",
    "OutTensor",
    "Scratch",
    "assembled",
    "carried",
    "carry",
    "dumps",
    "held",
    "planned",
    "save",
    "save_each",
    "unread",
    "written_peak",
]
