"""Reading ``torch.save`` zip archives without torch and without running their pickles.

A torch.save file (and every item inside a DCP ``.distcp`` file) is a zip archive holding
``<name>/data.pkl`` (the object, tensors replaced by persistent storage ids) and one uncompressed
member ``<name>/data/<key>`` per storage. We parse the central directory with :mod:`zipfile`,
unpickle ``data.pkl`` through the restricted unpickler (tensors become :class:`TensorRef`), and
locate every storage's raw bytes so tensors can be read by offset, straight into their destination.
"""

from __future__ import annotations

import io
import math
import struct
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckpttool import _unpickle
from ckpttool.dtypes import carrier
from ckpttool.dtypes import dtype as lookup_dtype
from ckpttool.errors import CorruptFileError, UnsafePickleError
from ckpttool.io import RandomAccessFile

_LFH = struct.Struct("<4s2B4HL2L2H")  # zip local file header, 30 bytes
_MAX_PICKLE = 1 << 30


class _Window(io.RawIOBase):
    """A seekable read-only view of ``[base, base + length)`` of an open file, for zipfile."""

    def __init__(self, f: RandomAccessFile, base: int, length: int) -> None:
        self._f = f
        self._base = base
        self._len = length
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        if whence == 0:
            self._pos = pos
        elif whence == 1:
            self._pos += pos
        else:
            self._pos = self._len + pos
        if self._pos < 0:
            raise OSError("seek before start")
        return self._pos

    def read(self, n: int | None = -1) -> bytes:
        end = self._len if n is None or n < 0 else min(self._len, self._pos + n)
        if end <= self._pos:
            return b""
        data = self._f.read(self._base + self._pos, end - self._pos)
        self._pos = end
        return data

    def readinto(self, buf: Any) -> int:
        data = self.read(len(buf))
        buf[: len(data)] = data
        return len(data)


@dataclass(frozen=True, slots=True)
class StorageSpan:
    offset: int
    """byte offset of the storage's first element, in the file (or in the in-memory buffer)"""
    length: int


class Archive:
    """A torch.save zip archive at ``[base, base + length)`` of a file, or in a bytes buffer."""

    def __init__(
        self,
        source: RandomAccessFile | bytes,
        *,
        base: int = 0,
        length: int | None = None,
        display: str,
        allow: Mapping[tuple[str, str], Any] | None = None,
    ) -> None:
        self.display = display
        self.source = source
        if isinstance(source, bytes):
            self.base = 0
            self.length = len(source)
            stream: io.RawIOBase | io.BytesIO = io.BytesIO(source)
        else:
            self.base = base
            self.length = source.size - base if length is None else length
            stream = _Window(source, base, self.length)
        try:
            self._zip = zipfile.ZipFile(stream)
        except CorruptFileError:
            raise
        except (zipfile.BadZipFile, OSError, ValueError, EOFError, struct.error) as exc:
            raise CorruptFileError(
                f"{display}: not a readable torch.save archive ({exc})",
                hint="the file is truncated or damaged; restore it from its source",
                path=display,
            ) from None
        self.members = {info.filename: info for info in self._zip.infolist()}
        pkl = [name for name in self.members if name.endswith("/data.pkl") and name.count("/") == 1]
        if len(pkl) != 1:
            raise CorruptFileError(
                f"{display}: zip archive without a single <name>/data.pkl (found {len(pkl)}): "
                "not written by torch.save",
                path=display,
            )
        self.prefix = pkl[0][: -len("data.pkl")]
        self._allow = allow if allow is not None else {**_unpickle.PLAIN, **_unpickle.TORCH_TENSORS}
        self._spans: dict[str, StorageSpan] = {}

    def load(self) -> Any:
        """The archived object, tensors as :class:`~ckpttool._unpickle.TensorRef`."""
        info = self.members[self.prefix + "data.pkl"]
        if info.file_size > _MAX_PICKLE:
            raise CorruptFileError(f"{self.display}: data.pkl claims {info.file_size:,} bytes", path=self.display)
        try:
            data = self._zip.read(info)
        except (zipfile.BadZipFile, OSError, ValueError, EOFError, struct.error) as exc:
            raise CorruptFileError(f"{self.display}: data.pkl unreadable ({exc})", path=self.display) from None
        return _unpickle.loads(
            data,
            allow=self._allow,
            source=self.display,
            persistent_load=_unpickle.storage_persistent_load,
        )

    def storage_span(self, key: str) -> StorageSpan:
        """Where the raw bytes of storage ``key`` start, without reading them."""
        span = self._spans.get(key)
        if span is not None:
            return span
        name = f"{self.prefix}data/{key}"
        info = self.members.get(name)
        if info is None:
            raise CorruptFileError(f"{self.display}: storage {name} is missing from the archive", path=self.display)
        if info.compress_type != zipfile.ZIP_STORED:
            raise CorruptFileError(
                f"{self.display}: storage {name} is compressed; torch never does that", path=self.display
            )
        header = self._read(info.header_offset, _LFH.size)
        fields = _LFH.unpack(header)
        if fields[0] != b"PK\x03\x04":
            raise CorruptFileError(f"{self.display}: bad zip local header for {name}", path=self.display)
        name_len, extra_len = fields[-2], fields[-1]
        start = info.header_offset + _LFH.size + name_len + extra_len
        if start + info.file_size > self.length:
            raise CorruptFileError(
                f"{self.display}: storage {name} runs to byte {start + info.file_size:,} of a "
                f"{self.length:,}-byte archive: the file was cut short",
                path=self.display,
            )
        span = StorageSpan(self.base + start, info.file_size)
        self._spans[key] = span
        return span

    def _read(self, offset: int, length: int) -> bytes:
        if isinstance(self.source, bytes):
            return self.source[offset : offset + length]
        return self.source.read(self.base + offset, length)

    def close(self) -> None:
        """Close the underlying file (when the archive was opened on one)."""
        if not isinstance(self.source, bytes):
            self.source.close()

    def crc_errors(self) -> list[str]:
        """Members whose CRC32 does not match their bytes (reads the whole archive)."""
        bad: list[str] = []
        for info in self.members.values():
            if info.CRC == 0 and info.file_size > 0:
                continue  # torch writes 0 when CRCs are switched off
            try:
                self._zip.read(info)
            except zipfile.BadZipFile:
                bad.append(info.filename)
        return bad


def tensor_nbytes(ref: _unpickle.TensorRef) -> int:
    return math.prod(ref.shape) * lookup_dtype(ref.dtype).itemsize


def is_c_contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for n, s in zip(reversed(shape), reversed(stride), strict=True):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


def read_tensor(archive: Archive, ref: _unpickle.TensorRef, out: np.ndarray | None = None) -> np.ndarray:
    """The tensor's elements as a C-ordered numpy array of its carrier dtype.

    When ``out`` is given (a C-contiguous array of the right size) the bytes land there directly.
    """
    dt = lookup_dtype(ref.dtype)
    itemsize = dt.itemsize
    numel = math.prod(ref.shape)
    span = archive.storage_span(ref.storage.key)
    if numel == 0:
        return np.empty(ref.shape, dtype=carrier(ref.dtype)) if out is None else out
    extent = ref.storage_offset + 1 + sum((n - 1) * s for n, s in zip(ref.shape, ref.stride, strict=True))
    if extent * itemsize > span.length:
        raise CorruptFileError(
            f"{archive.display}: tensor needs {extent * itemsize:,} bytes of storage "
            f"{ref.storage.key} which holds {span.length:,}",
            path=archive.display,
        )
    start = span.offset + ref.storage_offset * itemsize
    if is_c_contiguous(ref.shape, ref.stride):
        if out is None:
            out = np.empty(ref.shape, dtype=carrier(ref.dtype))
        buf = out.reshape(-1).view(np.uint8).data
        if isinstance(archive.source, bytes):
            buf[:] = archive.source[start : start + numel * itemsize]
        else:
            archive.source.read_into(start, buf)
        return out
    # a strided view: read the storage extent it spans, then gather
    raw_len = (extent - ref.storage_offset) * itemsize
    raw = (
        archive.source[start : start + raw_len]
        if isinstance(archive.source, bytes)
        else archive.source.read(start, raw_len)
    )
    flat = np.frombuffer(raw, dtype=carrier(ref.dtype))
    view = np.lib.stride_tricks.as_strided(flat, shape=ref.shape, strides=[s * itemsize for s in ref.stride])
    if out is None:
        return np.ascontiguousarray(view)
    out.reshape(ref.shape)[...] = view
    return out


def load_object(data: bytes, *, display: str, allow: Mapping[tuple[str, str], Any] | None = None) -> Any:
    """Unpickle a small torch.save archive held in memory (a DCP bytes item)."""
    archive = Archive(data, display=display, allow=allow)
    return archive.load()


__all__ = ["Archive", "StorageSpan", "UnsafePickleError", "load_object", "read_tensor", "tensor_nbytes"]
