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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckpttool import _unpickle
from ckpttool._crc import crc32
from ckpttool.dtypes import carrier
from ckpttool.dtypes import dtype as lookup_dtype
from ckpttool.errors import CkptError, CorruptFileError, UnsafePickleError
from ckpttool.io import RandomAccessFile, crc_mismatch
from ckpttool.naming import printable

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


def _zip64_size(extra: bytes) -> int | None:
    """The compressed size in a local header's zip64 extra field (after the uncompressed size)."""
    i = 0
    while i + 4 <= len(extra):
        tag, n = int.from_bytes(extra[i : i + 2], "little"), int.from_bytes(extra[i + 2 : i + 4], "little")
        if tag == 1 and n >= 16:
            return int.from_bytes(extra[i + 12 : i + 20], "little")
        i += 4 + n
    return None


def _signature_begun(tail: bytes) -> bool:
    """Whether the last bytes of a file (fewer than 4) begin a zip record's signature: the file was
    cut inside it."""
    return any(sig.startswith(tail) for sig in _SIGNATURES)


_SIGNATURES = (b"PK\x03\x04", b"PK\x01\x02", b"PK\x06\x06", b"PK\x06\x07", b"PK\x05\x06")
"""a local header's, a central-directory entry's, zip64's end record's and locator's, the end record's"""


class Archive:
    """A torch.save zip archive at ``[base, base + length)`` of a file, or in a bytes buffer."""

    def __init__(
        self,
        source: RandomAccessFile | bytes,
        *,
        base: int = 0,
        length: int | None = None,
        display: str,
        file: str | None = None,
        allow: Mapping[tuple[str, str], Any] | None = None,
        check: bool = False,
    ) -> None:
        """``display`` names the archive in messages (a DCP record: ``file@offset``), ``file`` the
        file it is in, for the errors' path (default: ``display``). ``check``: an archive in memory
        checks the CRC-32 of each storage it is asked for (an archive in a file does when the
        file's reads are checked: ``RandomAccessFile.crcs``)."""
        self.display = display
        self.file = display if file is None else file
        self.source = source
        self.check = check
        if isinstance(source, bytes):
            self.base = 0
            self.length = len(source)
            stream: io.RawIOBase | io.BytesIO = io.BytesIO(source)
        else:
            self.base = base
            self.length = source.size - base if length is None else length
            stream = _Window(source, base, self.length)
        self._stream = stream
        self._zip: zipfile.ZipFile | None = None
        self._windows: list[tuple[int, bytes]] = []
        if not isinstance(source, bytes) and self.length <= _SMALL:
            self._windows.append((0, source.read(base, self.length)))
        members = _central_directory(self._read, self.length, display, self.file)
        self._plain = members is not None  # (its end record ends the archive: nothing after it)
        self.members: Mapping[str, Any] = (
            members
            if members is not None  # else anything unusual (comments, multi-disk, damage): zipfile judges
            else {info.filename: info for info in self._zipfile().infolist()}
        )
        pkl = [name for name in self.members if name.endswith("/data.pkl") and name.count("/") == 1]
        if len(pkl) != 1:
            raise CorruptFileError(
                f"{display}: zip archive without a single <name>/data.pkl (found {len(pkl)}): "
                "not written by torch.save",
                path=self.file,
            )
        self.prefix = pkl[0][: -len("data.pkl")]
        self._allow = allow if allow is not None else {**_unpickle.PLAIN, **_unpickle.TORCH_TENSORS}
        self._spans: dict[str, StorageSpan] = {}
        self._member_spans: dict[str, StorageSpan] = {}

    def _zipfile(self) -> zipfile.ZipFile:
        if self._zip is None:
            try:
                self._zip = zipfile.ZipFile(self._stream)
            except CorruptFileError:
                raise
            except Exception as exc:  # zipfile raises many types on damaged input
                if self._cut_short():
                    raise CorruptFileError(
                        f"{self.display}: cut short: its {self.length:,} bytes start as a torch.save archive but "
                        "end before the archive's central directory and end records, which torch.save writes last",
                        hint="the save or the copy stopped before the end; restore the file from its source",
                        path=self.file,
                        rule="truncated-file",
                    ) from None
                raise CorruptFileError(
                    f"{self.display}: not a readable torch.save archive ({type(exc).__name__}: {exc})",
                    hint="the file is truncated or damaged; restore it from its source",
                    path=self.file,
                ) from None
        return self._zip

    def bytes_after(self) -> int:
        """How many bytes follow the archive's end record (and its comment) in its window: bytes
        appended after the save. torch.load reads past them; zipfile finds the end record within
        the last 64 KiB (more: the archive does not read at all)."""
        if self._plain:
            return 0
        start = max(0, self.length - (_EOCD.size + 0xFFFF + 4096))
        tail = self._read(start, self.length - start)
        at = tail.rfind(b"PK\x05\x06")
        if at < 0 or at + _EOCD.size > len(tail):
            return 0
        comment = _EOCD.unpack_from(tail, at)[-1]
        return max(0, len(tail) - (at + _EOCD.size + comment))

    def _cut_short(self) -> bool:
        """Whether the archive's records, walked from its start, run past its end: its local
        headers with their data, then its central directory, without reaching an end record (a
        tail cut off, not damaged bytes: those stop the walk where no record starts)."""
        try:
            return self._walk_runs_out()
        except OSError:
            return False

    def _walk_runs_out(self) -> bool:
        at = 0
        while (sig := self._read(at, 4)) == b"PK\x03\x04":  # a local header, then its data
            head = self._read(at, 30)
            if len(head) < 30:
                return True
            flags, size = int.from_bytes(head[6:8], "little"), int.from_bytes(head[18:22], "little")
            n, m = int.from_bytes(head[26:28], "little"), int.from_bytes(head[28:30], "little")
            data = at + 30 + n + m
            if flags & 0x08 and size == 0:  # torch.save streams: the size is in a descriptor after the data
                end = self._descriptor_after(data)
                if end is None:
                    return self._read(self.length - 4, 4) != b"PK\x05\x06"  # (no end record either)
                at = end
            else:
                if size == 0xFFFFFFFF:  # zip64: the size is in the extra field
                    wide = _zip64_size(self._read(at + 30 + n, m))
                    if wide is None:
                        return False
                    size = wide
                at = data + size
            if at > self.length:
                return True
        while sig == b"PK\x01\x02":  # the central directory
            head = self._read(at, 46)
            if len(head) < 46:
                return True
            n, m, k = (int.from_bytes(head[i : i + 2], "little") for i in (28, 30, 32))
            at += 46 + n + m + k
            if at > self.length:
                return True
            sig = self._read(at, 4)
        if len(sig) < 4 and at < self.length:
            return _signature_begun(sig)
        if sig == b"PK\x06\x06":  # zip64's end record: its size after the first 12 bytes
            head = self._read(at, 12)
            if len(head) < 12:
                return True
            at += 12 + int.from_bytes(head[4:12], "little")
            sig = self._read(at, 4)
        if sig == b"PK\x06\x07":  # zip64's locator: 20 bytes
            at += 20
            sig = self._read(at, 4)
        if len(sig) < 4 and at < self.length:
            return _signature_begun(sig)
        if sig == b"PK\x05\x06":  # the end record: 22 bytes and its comment
            head = self._read(at, 22)
            return len(head) < 22 or at + 22 + int.from_bytes(head[20:22], "little") > self.length
        return at >= self.length  # the records end where the bytes do, no end record after them

    def _descriptor_after(self, data: int) -> int | None:
        """Where the data descriptor closing the member whose data starts at ``data`` ends: the
        first ``PK\\x07\\x08`` whose stored size (zip64's 8 bytes or zip's 4) is the distance from
        ``data``. None where none is found before the archive's end. Read in 1 MiB windows."""
        at = data
        while at < self.length:
            window = self._read(at, (1 << 20) + 24)
            i = window.find(b"PK\x07\x08")
            while i >= 0:
                pos = at + i
                d = self._read(pos, 24)
                wide = len(d) == 24 and int.from_bytes(d[8:16], "little") == pos - data  # (zip64's)
                if wide or (len(d) >= 16 and int.from_bytes(d[8:12], "little") == pos - data):
                    # the width whose end a record follows (a zip64 size matches the 4-byte test too)
                    ends = [pos + w for w in ((24, 16) if wide else (16,)) if self._read(pos + w, 2) == b"PK"]
                    return ends[0] if ends else pos + (24 if wide else 16)
                i = window.find(b"PK\x07\x08", i + 1)
            at += 1 << 20
        return None

    def load(self) -> Any:
        """The archived object, tensors as :class:`~ckpttool._unpickle.TensorRef`.

        A pickle whose CRC-32 fails is still vetted by the allowlist first (nothing runs either
        way): a hostile pickle must not pass for bit rot by carrying a wrong CRC-32, so a global
        outside the allowlist is reported as such, the failed CRC-32 said with it."""
        try:
            data = self.pickle_bytes()
        except CorruptFileError as damaged:
            if damaged.rule != "checksum-mismatch":
                raise
            try:
                self._unpickle(self.pickle_bytes(check=False))
            except UnsafePickleError as unsafe:
                unsafe.message += "; its CRC-32 fails too (damage or tampering: treat it as hostile either way)"
                raise unsafe from None
            except CkptError:
                pass
            raise
        return self._unpickle(data)

    def _unpickle(self, data: bytes) -> Any:
        try:
            return _unpickle.loads(
                data, allow=self._allow, source=self.display, persistent_load=_unpickle.storage_persistent_load
            )
        except CkptError as exc:
            if exc.path == self.display:  # (a DCP record's name is its file and offset)
                exc.path = self.file
            raise

    def pickle_bytes(self, *, check: bool = True) -> bytes:
        """The bytes of ``data.pkl`` (not unpickled); checked against its CRC-32 when this archive
        checks its reads and ``check``."""
        info = self.members[self.prefix + "data.pkl"]
        if info.file_size > _MAX_PICKLE:
            raise CorruptFileError(f"{self.display}: data.pkl claims {info.file_size:,} bytes", path=self.file)
        if info.compress_type != zipfile.ZIP_STORED:
            raise CorruptFileError(
                f"{self.display}: data.pkl is compressed (method {info.compress_type}); torch.save never does that",
                hint="the file was rewritten by another tool, or it is damaged or hostile",
                path=self.file,
            )
        span = self.member_span(self.prefix + "data.pkl", info)
        data = self._read(span.offset - self.base, span.length)
        if self.checked and check:  # read through the windows, not the file's watched reads: checked here
            self._check_now(self.prefix + "data.pkl", info, span, data)
        return data

    def storage_span(self, key: str) -> StorageSpan:
        """Where the raw bytes of storage ``key`` start, without reading them."""
        span = self._spans.get(key)
        if span is not None:
            return span
        name = f"{self.prefix}data/{key}"
        info = self.members.get(name)
        if info is None:
            raise CorruptFileError(f"{self.display}: storage {name} is missing from the archive", path=self.file)
        if info.compress_type != zipfile.ZIP_STORED:
            raise CorruptFileError(
                f"{self.display}: storage {name} is compressed; torch never does that", path=self.file
            )
        span = self.member_span(name, info)
        self._spans[key] = span
        self._watch(name, info, span)
        return span

    def watch_all(self) -> None:
        """Have every stored member checked against its CRC-32 as it is read (:meth:`_watch`): an
        archive about to be copied byte for byte."""
        for name, info in self.members.items():
            if info.compress_type == zipfile.ZIP_STORED:
                self._watch(name, info, self.member_span(name, info))

    def _watch(self, name: str, info: Any, span: StorageSpan) -> None:
        """Have the storage's bytes checked against its stored CRC-32 as they are read, when the
        file's reads are checked (:func:`ckpttool.io.checking_crcs`); an archive held in memory
        (a decompressed DCP record) is checked here and now, when ``check`` was asked."""
        if isinstance(self.source, bytes):
            if self.check:
                self._check_now(name, info, span, memoryview(self.source)[span.offset : span.offset + span.length])
        elif self.source.crcs is not None:  # (tensors are read from the file, never from _windows)
            self.source.crcs.expect(span.offset, span.length, info.CRC, f"{self.display}: {name}")

    @property
    def checked(self) -> bool:
        """whether the members read are checked against their CRC-32s"""
        return self.check if isinstance(self.source, bytes) else self.source.crcs is not None

    def _check_now(self, name: str, info: Any, span: StorageSpan, data: Any) -> None:
        """A member's bytes, all in hand, against its CRC-32 (0: not computed, not checked)."""
        if info.CRC and (found := crc32(data)) != info.CRC:
            raise crc_mismatch(
                f"{self.display}: {name}", self.display, span.offset, span.length, info.CRC, found, path=self.file
            )

    def member_span(self, name: str, info: Any) -> StorageSpan:
        """Where a stored member's bytes are (after its local header); each local header read once
        (locating a storage and then its CRC-32's span read the same one)."""
        span = self._member_spans.get(name)
        if span is None:
            span = self._member_spans[name] = self._member_span(name, info)
        return span

    def _member_span(self, name: str, info: Any) -> StorageSpan:
        at, want = info.header_offset, name.encode()
        # the header and the name after it, in one read
        header = self._read(at, _LFH.size + len(want)) if 0 <= at < self.length else b""
        fields = _LFH.unpack_from(header) if len(header) >= _LFH.size else (b"",)
        # the local header the central directory points at must be this member's (torch's reader
        # takes the offset as it is; zipfile would shift every offset to fit a damaged directory)
        found = fields[0] == b"PK\x03\x04"
        if not found or fields[-2] != len(want) or header[_LFH.size :] != want:
            what = "the local header of another member" if found else "no local header"
            raise CorruptFileError(
                f"{self.display}: the zip index places {name} at byte {at:,}, where there is {what}: "
                "the archive is damaged",
                hint="torch.load fails on it too; restore the file from a good copy",
                path=self.file,
            )
        name_len, extra_len = fields[-2], fields[-1]
        start = info.header_offset + _LFH.size + name_len + extra_len
        if start + info.file_size > self.length:
            raise CorruptFileError(
                f"{self.display}: {name} runs to byte {start + info.file_size:,} of a "
                f"{self.length:,}-byte archive: the file was cut short",
                path=self.file,
                rule="truncated-file",
            )
        return StorageSpan(self.base + start, info.file_size)

    def _read(self, offset: int, length: int) -> bytes:
        """Bytes at ``offset`` of the archive (short only past its end).

        Locating a piece reads the tail (central directory), then the local header of
        ``data.pkl``, the pickle and the storage's local header, all near the start. Those reads
        are served from two windows read once: the tail, and the first ``_HEAD`` bytes (a whole
        archive of at most ``_SMALL`` bytes is read at once). Under :func:`ckpttool.io.probing` each
        read that misses the cache goes to the disk and its pages are dropped after it, so at
        400 000 small DCP chunks this turned four disk reads per piece into one."""
        if offset < 0:
            return b""
        length = max(0, min(length, self.length - offset))
        if isinstance(self.source, bytes):
            return self.source[offset : offset + length]
        for start, data in self._windows:
            if start <= offset and offset + length <= start + len(data):
                return data[offset - start : offset - start + length]
        if offset + length <= min(_HEAD, self.length):
            head = self.source.read(self.base, min(_HEAD, self.length))
            self._windows.append((0, head))
            return head[offset : offset + length]
        data = self.source.read(self.base + offset, length)
        if offset + length == self.length and length <= _TAIL:
            self._windows.append((offset, data))
        return data

    def close(self) -> None:
        """Close the underlying file (when the archive was opened on one)."""
        if not isinstance(self.source, bytes):
            self.source.close()

    def crc_errors(self) -> list[str]:
        """Members whose CRC32 does not match their bytes (reads the whole archive). Members torch
        would not write (compressed ones) and members whose bytes cannot be found count as bad."""
        bad: list[str] = []
        for name, info in self.members.items():
            if info.CRC == 0 and info.file_size > 0:
                continue  # torch writes 0 when CRCs are switched off
            if info.compress_type != zipfile.ZIP_STORED:
                bad.append(name)
                continue
            try:
                span = self.member_span(name, info)
            except CorruptFileError:
                bad.append(name)
                continue
            crc, pos, end = 0, span.offset - self.base, span.offset - self.base + span.length
            while pos < end:
                chunk = self._read(pos, min(_CRC_CHUNK, end - pos))
                if not chunk:
                    break
                crc = crc32(chunk, crc)
                pos += len(chunk)
            if pos != end or crc != info.CRC:
                bad.append(name)
        return bad


_CRC_CHUNK = 16 << 20
_HEAD = 4 << 10
"""The start of an archive read at once when a read falls in it (data.pkl and torch's small
records come first, each 64-byte aligned: a pickle of a few hundred bytes)."""
_SMALL = 8 << 10
"""An archive this short is read whole, once."""


@dataclass(frozen=True, slots=True)
class _Member:
    """A central-directory entry, with the attribute names of ``zipfile.ZipInfo``."""

    filename: str
    compress_type: int
    CRC: int
    compress_size: int
    file_size: int
    header_offset: int


_EOCD = struct.Struct("<4s4H2LH")  # end of central directory, 22 bytes
_EOCD64_LOCATOR = struct.Struct("<4sLQL")  # 20 bytes
_EOCD64 = struct.Struct("<4sQ2H2L4Q")  # 56 bytes
_CDH = struct.Struct("<4s6H3L5H2L")  # central directory header, 46 bytes
_UNREADABLE = 0x0001 | 0x0020 | 0x0040 | 0x2000
"""General-purpose flags torch's reader (miniz) refuses: encrypted, compressed patch, strong
encryption, masked local headers."""
_TAIL = 1024  # the EOCD and, for files with few members, the whole central directory


def record_start(f: RandomAccessFile, end: int) -> int | None:
    """Where the torch.save archive that ends at byte ``end`` of ``f`` begins, from its end records
    (a DCP ``.distcp`` file is such archives back to back, found without its ``.metadata`` this
    way, last to first). None where no archive torch writes ends there: no end record without a
    comment, or one whose directory offset places the start before the file or not at a local
    header. The archive itself is judged by :class:`Archive`."""
    if end < _EOCD.size:
        return None
    sig, *_, cd_size, cd_offset, comment = _EOCD.unpack(f.read(end - _EOCD.size, _EOCD.size))
    if sig != b"PK\x05\x06" or comment != 0:
        return None
    at = end - _EOCD.size - _EOCD64_LOCATOR.size
    locator = f.read(at, _EOCD64_LOCATOR.size) if at >= _EOCD64.size else b""
    if locator[:4] == b"PK\x06\x07":  # torch's writer: a zip64 record right before its locator
        rec_at = at - _EOCD64.size
        rec = f.read(rec_at, _EOCD64.size)
        if rec[:4] != b"PK\x06\x06":
            return None
        start = rec_at - _EOCD64_LOCATOR.unpack(locator)[2]
    else:
        start = end - _EOCD.size - cd_size - cd_offset
    return start if 0 <= start < end and f.read(start, 4) == b"PK\x03\x04" else None


def record_crc_errors(f: RandomAccessFile, display: str) -> list[tuple[str, int]]:
    """The members of a file of torch.save archives back to back (a DCP ``.distcp`` file, read
    without its ``.metadata``) whose CRC-32 does not match their bytes, each with the byte its
    record starts at, first record first. The archives are walked from the last to the first.
    Raises CorruptFileError where the chain breaks: no archive ends at the end of the file, or
    where the archive after it begins."""
    records: list[list[tuple[str, int]]] = []
    end = f.size
    while end > 0:
        start = record_start(f, end)
        if start is None:
            where = (
                f"at its end (byte {end:,})"
                if end == f.size
                else f"at byte {end:,}, where the record after it begins (the {f.size - end:,} bytes after "
                "it read as records)"
            )
            raise CorruptFileError(
                f"{display}: no torch.save record ends {where}: the file was cut short or overwritten there",
                hint="restore the file from a good copy",
                path=display,
            )
        archive = Archive(f, base=start, length=end - start, display=f"{display}@{start}", file=display)
        records.append([(name, start) for name in archive.crc_errors()])
        end = start
    return [name for bad in reversed(records) for name in bad]


def _central_directory(
    read: Any, length: int, display: str = "zip archive", file: str | None = None
) -> dict[str, _Member] | None:
    """Parse the central directory of a comment-less zip with two reads (torch.save writes no
    comment). Returns None for anything else, so the caller can fall back to :mod:`zipfile`.
    Raises CorruptFileError where the directory is damaged in a way torch's reader (miniz) fails
    on and :mod:`zipfile` would read past: a zip64 end record that disagrees with the plain one
    (torch's reader takes the zip64 one), a directory past the end, a stored member whose two
    sizes differ; and every field miniz refuses or fails on when torch reads a member (multi-disk
    numbers, encryption and patch flags, a member marked as a folder, a directory that does not end
    where the end records begin) and a compressed member, which torch.save never writes: what
    verify passes, torch can load."""

    def damaged(
        what: str, hint: str = "torch.load fails on it too; restore the file from a good copy"
    ) -> CorruptFileError:
        return CorruptFileError(
            f"{display}: the zip index is damaged ({what})", hint=hint, path=display if file is None else file
        )

    if length < _EOCD.size:
        return None
    tail_start = max(0, length - _TAIL)
    tail = read(tail_start, length - tail_start)
    eocd_at = len(tail) - _EOCD.size
    sig, disk, cd_disk, on_disk, entries, cd_size, cd_offset, comment = _EOCD.unpack_from(tail, eocd_at)
    if sig != b"PK\x05\x06" or comment != 0:
        return None
    loc_at = eocd_at - _EOCD64_LOCATOR.size
    ends_at = tail_start + eocd_at  # where the end records begin: the directory ends there
    lsig, _, eocd64_offset, disks = _EOCD64_LOCATOR.unpack_from(tail, loc_at) if loc_at >= 0 else (b"", 0, 0, 0)
    if lsig == b"PK\x06\x07":  # torch writes one always; its reader then goes by the zip64 record
        rec = read(eocd64_offset, _EOCD64.size) if 0 <= eocd64_offset < length else b""
        if len(rec) != _EOCD64.size or rec[:4] != b"PK\x06\x06":
            raise damaged(f"no zip64 end record at byte {eocd64_offset:,}, where its locator points")
        fields = _EOCD64.unpack(rec)
        if fields[1] < _EOCD64.size - 12 or disks != 1:
            raise damaged(f"its zip64 end record gives a record size of {fields[1]} and its locator {disks} disks")
        ends_at = eocd64_offset
        plain = (entries, cd_size, cd_offset)
        disk, cd_disk, on_disk = fields[4], fields[5], fields[6]
        entries, cd_size, cd_offset = fields[7], fields[8], fields[9]
        names = ("entries", "directory size", "directory offset")
        marks = (0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF)
        for name, small, big, mark in zip(names, plain, (entries, cd_size, cd_offset), marks, strict=True):
            if small != mark and small != big:
                raise damaged(f"its {name} is {small:,} in the end record and {big:,} in the zip64 one")
    elif entries == 0xFFFF or cd_size == 0xFFFFFFFF or cd_offset == 0xFFFFFFFF:
        return None
    if on_disk != entries or ((disk | cd_disk) and (disk, cd_disk) != (1, 1)):
        raise damaged(
            f"its end record numbers this disk {disk} and the directory's {cd_disk}, with {on_disk:,} of "
            f"{entries:,} entries on it: a multi-disk archive, which torch cannot read"
        )
    if cd_size < entries * _CDH.size:
        raise damaged(f"its directory of {cd_size:,} bytes is too short for {entries:,} entries")
    if cd_offset + cd_size > length:
        raise damaged(f"the directory at byte {cd_offset:,} runs {cd_size:,} bytes, past the end at {length:,}")
    if cd_offset + cd_size != ends_at:
        raise damaged(f"the directory ends at byte {cd_offset + cd_size:,}, its end records begin at {ends_at:,}")
    if cd_offset >= tail_start:
        cd = tail[cd_offset - tail_start : cd_offset - tail_start + cd_size]
    else:
        cd = read(cd_offset, cd_size)
    members: dict[str, _Member] = {}
    pos = 0
    for k in range(entries):
        f = _CDH.unpack_from(cd, pos) if pos + _CDH.size <= len(cd) else (b"",)
        if f[0] != b"PK\x01\x02":
            raise damaged(f"entry {k} of {entries} is not a directory entry")
        flags, method, crc, csize, usize = f[3], f[4], f[7], f[8], f[9]
        name_len, extra_len, comment_len, start_disk, offset = f[10], f[11], f[12], f[13], f[16]
        if pos + _CDH.size + name_len + extra_len + comment_len > len(cd):
            raise damaged(f"entry {k} of {entries} runs past the end of the directory")
        name = cd[pos + _CDH.size : pos + _CDH.size + name_len].decode("utf-8", "replace")
        extra = cd[pos + _CDH.size + name_len : pos + _CDH.size + name_len + extra_len]
        if 0xFFFFFFFF in (usize, csize, offset):
            usize, csize, offset = _zip64_extra(extra, usize, csize, offset)
        if method == zipfile.ZIP_STORED and csize != usize:
            raise damaged(f"{printable(name)} is stored, yet its sizes differ: {csize:,} and {usize:,} bytes")
        if usize and not csize:
            raise damaged(f"{printable(name)} holds {usize:,} bytes in a compressed size of 0")
        if method != zipfile.ZIP_STORED:  # (torch would inflate a stored member marked deflated: garbage)
            raise damaged(f"{printable(name)} has compression method {method}; torch.save stores every member")
        if flags & _UNREADABLE:
            raise damaged(f"{printable(name)} is flagged encrypted or patched (flags {flags:#06x})")
        if f[15] & 0x10:  # (torch's reader takes it for a folder and reads none of its bytes)
            raise damaged(f"{printable(name)} is marked as a folder (attributes {f[15]:#x})")
        if start_disk == 0xFFFF or start_disk not in (disk, 1):
            raise damaged(f"{printable(name)} starts on disk {start_disk}, not this one ({disk})")
        if name in members:  # (torch's reader takes one copy and ckpttool's another: values no load gives)
            raise damaged(
                f"{printable(name)} is listed twice in the zip directory; torch.save writes each member once",
                hint="torch.load reads one of the copies, and nothing says which was saved: restore the file from a "
                "good copy",
            )
        members[name] = _Member(name, method, crc, csize, usize, offset)
        pos += _CDH.size + name_len + extra_len + comment_len
    return members


def _zip64_extra(extra: bytes, usize: int, csize: int, offset: int) -> tuple[int, int, int]:
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack_from("<2H", extra, pos)
        if tag == 1:
            count = max(0, min(size, len(extra) - pos - 4)) // 8  # never past the field's real end
            values = list(struct.unpack_from(f"<{count}Q", extra, pos + 4))
            if usize == 0xFFFFFFFF and values:
                usize = values.pop(0)
            if csize == 0xFFFFFFFF and values:
                csize = values.pop(0)
            if offset == 0xFFFFFFFF and values:
                offset = values.pop(0)
            break
        pos += 4 + size
    return usize, csize, offset


def is_c_contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for n, s in zip(reversed(shape), reversed(stride), strict=True):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


def tensor_span(archive: Archive, ref: _unpickle.TensorRef) -> tuple[int, int] | None:
    """``(offset, length)`` in the source of a C-contiguous tensor's bytes; None if strided or if
    the storage is too short to hold them (``read_tensor`` says why)."""
    if not is_c_contiguous(ref.shape, ref.stride):
        return None
    itemsize = lookup_dtype(ref.dtype).itemsize
    span = archive.storage_span(ref.storage.key)
    length = math.prod(ref.shape) * itemsize
    if ref.storage_offset * itemsize + length > span.length:
        return None
    return span.offset + ref.storage_offset * itemsize, length


BROADCAST_HINT = (
    "torch.save of an expanded tensor (torch.zeros(1).expand(n)) keeps the expansion lazy; save it "
    ".contiguous(), or the file is damaged or hostile"
)


def broadcast_problem(shape: Sequence[int], stride: Sequence[int], dtype: str) -> str | None:
    """Why a tensor view is not expanded into memory: a broadcast view (strides of 0) far larger
    than the elements it stores, past 256 MB (4 TB from one stored element took every command that
    read it to an out-of-memory error); None for any other view."""
    numel = math.prod(shape)
    stored = 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True) if n > 0)
    if numel > 1024 * stored and numel * lookup_dtype(dtype).itemsize > 256 << 20:
        return (
            f"tensor of {numel:,} elements is a broadcast view of {stored:,} stored ones; ckpttool does not expand it"
        )
    return None


def check_view(archive: Archive, ref: _unpickle.TensorRef) -> tuple[Any, int]:
    """Raise CorruptFileError where tensor ``ref`` (of at least one element) reaches past the end of
    its storage, or is a broadcast view ckpttool does not expand; else the storage's span and the
    elements of it the view reaches to. Reads nothing but the storage's zip header."""
    span = archive.storage_span(ref.storage.key)
    extent = ref.storage_offset + 1 + sum((n - 1) * s for n, s in zip(ref.shape, ref.stride, strict=True))
    itemsize = lookup_dtype(ref.dtype).itemsize
    if extent * itemsize > span.length:
        raise CorruptFileError(
            f"{archive.display}: tensor needs {extent * itemsize:,} bytes of storage "
            f"{ref.storage.key} which holds {span.length:,}",
            path=archive.display,
        )
    if (problem := broadcast_problem(ref.shape, ref.stride, ref.dtype)) is not None:
        raise CorruptFileError(f"{archive.display}: {problem}", hint=BROADCAST_HINT, path=archive.display)
    return span, extent


def read_tensor(archive: Archive, ref: _unpickle.TensorRef, out: np.ndarray | None = None) -> np.ndarray:
    """The tensor's elements as a C-ordered numpy array of its carrier dtype.

    When ``out`` is given (a C-contiguous array of the right size) the bytes land there directly.
    """
    dt = lookup_dtype(ref.dtype)
    itemsize = dt.itemsize
    numel = math.prod(ref.shape)
    if numel == 0:
        return np.empty(ref.shape, dtype=carrier(ref.dtype)) if out is None else out
    span, extent = check_view(archive, ref)
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


__all__ = ["Archive", "StorageSpan", "read_tensor", "tensor_span"]
