"""File access: confined paths, positional reads, atomic publication.

Every byte ckpttool reads from a checkpoint goes through :func:`pread` (tests count them there),
and every output is published by one rename of a fully written and fsync'd temporary sibling.
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import errno
import os
import re
import secrets
import shutil
import socket
import stat
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Container, Iterator
from pathlib import Path
from typing import Any, BinaryIO, cast

from ckpttool import _crc
from ckpttool.errors import (
    CkptError,
    CorruptFileError,
    IncompleteCheckpointError,
    NotFoundError,
    PathEscapeError,
    UsageError,
    raise_together,
)
from ckpttool.manifest import SEAL_NAME
from ckpttool.naming import printable

TMP_MARKER = ".ckpttool-tmp-"


def pread(fd: int, length: int, offset: int) -> bytes:
    """Read ``length`` bytes at ``offset``; the one place checkpoint bytes are read."""
    if _CAN_PROBE and length <= _PROBE_MAX and _PROBING.get():
        return _probe(fd, length, offset)
    return os.pread(fd, length, offset)


_PROBING: contextvars.ContextVar[bool] = contextvars.ContextVar("ckpttool_probing", default=False)
_PROBE_MAX = 1 << 20
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_CAN_PROBE = hasattr(os, "RWF_NOWAIT") and hasattr(os, "posix_fadvise")


@contextlib.contextmanager
def probing() -> Iterator[None]:
    """Small scattered reads made in this block (locating pieces before one sequential pass over
    the files) leave the page cache as they found it.

    Pages such reads bring in sit in the cache as islands, and a sequential reader that meets them
    loses the kernel's readahead: measured on a cold 1.2 GB DCP checkpoint, two plain readers ran
    25 % slower after the piece headers had been read, and as fast as before once those pages were
    dropped again. Where the kernel and the file system take it (Linux 6.14+: ext4, xfs, btrfs),
    such a read is an uncached buffered read (``RWF_DONTCACHE``): cached pages serve it and stay,
    pages it brings in are dropped when it completes. Elsewhere it is first tried with
    ``RWF_NOWAIT`` (served from the cache: nothing changes); when its bytes were not cached, it is
    read with readahead off (``POSIX_FADV_RANDOM``: only its own pages come in, nothing is left in
    flight) and those pages are dropped at once. That drop is best effort: on Linux 6.18 the
    kernel kept the just-read page in about a third of 30 runs of 31 such reads (the folio not yet
    let go by the read that brought it in), where ``RWF_DONTCACHE`` left none in 30."""
    token = _PROBING.set(True)
    try:
        yield
    finally:
        _PROBING.reset(token)


_RWF_DONTCACHE = getattr(os, "RWF_DONTCACHE", 0x80)  # <linux/fs.h>; Python 3.14 names it
_NO_DONTCACHE: set[int] = set()
"""devices (``st_dev``) on which ``RWF_DONTCACHE`` was refused (a file system without it, or a
kernel before 6.14: then each device is tried once)"""


def _probe(fd: int, length: int, offset: int) -> bytes:
    if not _NO_DONTCACHE or os.fstat(fd).st_dev not in _NO_DONTCACHE:
        buf = bytearray(length)
        view = memoryview(buf)
        done = 0
        try:
            while done < length:
                n = os.preadv(fd, [view[done:]], offset + done, _RWF_DONTCACHE)
                if n == 0:
                    break
                done += n
            return bytes(view[:done])
        except OSError as exc:  # EOPNOTSUPP: not this kernel or file system (EINVAL: a bad flag)
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            _NO_DONTCACHE.add(os.fstat(fd).st_dev)
        finally:
            view.release()
    buf = bytearray(length)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead: only the pages asked for come in
    try:
        try:
            if os.preadv(fd, [buf], offset, os.RWF_NOWAIT) == length:
                return bytes(buf)
        except BlockingIOError:  # EAGAIN: not cached (the pages are on their way in)
            pass
        except OSError as exc:  # EOPNOTSUPP: no RWF_NOWAIT here, so no telling: leave the cache be
            if exc.errno != errno.EOPNOTSUPP:
                raise
            return os.pread(fd, length, offset)
        data = os.pread(fd, length, offset)
    finally:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_NORMAL)
    start = offset - offset % _PAGE
    end = -(-(offset + length) // _PAGE) * _PAGE  # whole pages: fadvise keeps a partial last one
    os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)
    return data


def preadinto(fd: int, buf: memoryview, offset: int) -> int:
    """Fill ``buf`` from ``offset`` without an intermediate copy; returns the bytes read (short only
    at end of file). The other place checkpoint bytes are read."""
    total = len(buf)
    if _CAN_PROBE and total <= _PROBE_MAX and _PROBING.get():
        data = _probe(fd, total, offset)
        buf[: len(data)] = data
        return len(data)
    done = 0
    while done < total:
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


def open_regular_fd(path: str | os.PathLike[str], display: str) -> int:
    """A descriptor of the regular file at ``path``, opened for reading without blocking: a FIFO in
    a file's place would wait for a writer forever, a directory opens and fails at its first read.
    Anything but a regular file is an IncompleteCheckpointError (``missing-file``: the file the
    checkpoint needs is not there) naming what stands there; OSError as ``os.open`` raises it."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise IncompleteCheckpointError(
            f"{display}: {not_a_file(mode)} stands at that path, not a file",
            hint="a copy or a script put it there; restore the file from its source",
            path=display,
            rule="missing-file",
        )
    return fd


def open_regular(path: str | os.PathLike[str], display: str) -> BinaryIO:
    """:func:`open_regular_fd` as a file object (``open(path, "rb")`` for checkpoint files)."""
    return os.fdopen(open_regular_fd(path, display), "rb")


def not_a_file(mode: int) -> str:
    """What stands at a path where a regular file was expected: ``a directory``, ``a FIFO``, …"""
    for test, what in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return what
    return "something other than a regular file"


class RandomAccessFile:
    """An open checkpoint file read by offset; closes on exit."""

    def __init__(self, path: str | os.PathLike[str], display: str | None = None, *, check: bool | None = None) -> None:
        """``check``: whether the zip members read are checked against their CRC-32s; by default,
        whether this process checks them now (:func:`checking_crcs`). Every reader opened while a
        command checks does so, not only a :class:`FileCache`'s: the pickles an adapter reads while
        describing the source (``_pt.load``) become the new checkpoint's names and values too."""
        self.path = os.fspath(path)
        self.display = display or self.path
        self.fd = -1
        self.size = -1
        self.cache: FileCache | None = None
        """the cache that keeps it (under its ``display`` name): a re-open goes through it, so the
        cache's open-file limit holds even for readers that kept a reference to this file"""
        self.crcs: MemberCrcs | None = None
        """when set, the bytes read of the zip members registered there are checked against the
        CRC-32s the archive stores (:func:`checking_crcs`)"""
        if checking() if check is None else check:
            self.crcs = MemberCrcs(self.display, self.path)
            with _READ_LOCK:
                _READ.append(self.crcs)  # (its members read in part are finished before publishing)
        self._open()

    def _open(self) -> int:
        """Open (or, after :class:`FileCache` closed it to stay under the open-file limit,
        re-open) the file; a file whose size changed in between is reported, not read."""
        try:
            fd = open_regular_fd(self.path, self.display)
        except FileNotFoundError:
            raise NotFoundError(f"{self.display}: file not found", path=self.display) from None
        except OSError as exc:
            raise NotFoundError(f"{self.display}: cannot open ({exc.strerror})", path=self.display) from None
        size = os.fstat(fd).st_size
        if self.size >= 0 and size != self.size:
            os.close(fd)
            raise CorruptFileError(f"{self.display} changed size while being read", path=self.display)
        self.fd, self.size = fd, size
        return fd

    def _fd(self) -> int:
        if self.fd >= 0:
            return self.fd
        if self.cache is not None and self.cache.holds(self):
            return self.cache.get(self.display).fd  # re-opened by the cache, which may close another first
        return self._open()

    def read(self, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes at ``offset``, or a CorruptFileError naming the shortfall."""
        if offset < 0 or length < 0 or offset + length > self.size:
            raise CorruptFileError(
                f"{self.display} is {self.size:,} bytes but the checkpoint needs bytes "
                f"{offset:,}..{offset + length:,}: cut short (a copy or save interrupted), or another file in its "
                "place",
                hint="restore the file from its source, or run 'ckpttool verify' to list every damaged file",
                path=self.display,
                rule="truncated-file",
            )
        data = pread(self._fd(), length, offset)
        if len(data) != length:
            raise CorruptFileError(f"{self.display}: short read at {offset:,}", path=self.display)
        if self.crcs is not None:
            self.crcs.saw(offset, data)
        return data

    def read_into(self, offset: int, buf: memoryview) -> None:
        if offset < 0 or offset + len(buf) > self.size:
            self.read(offset, len(buf))  # raises the truncation message
        if preadinto(self._fd(), buf, offset) != len(buf):
            raise CorruptFileError(f"{self.display}: short read at {offset:,}", path=self.display)
        if self.crcs is not None:
            self.crcs.saw(offset, buf)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> RandomAccessFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Member:
    """A zip member being read, perhaps in parts: the CRC-32 of each part read, by where it starts."""

    __slots__ = ("crc", "length", "parts", "seen", "what")

    def __init__(self, length: int, crc: int, what: str) -> None:
        self.length, self.crc, self.what = length, crc, what
        self.parts: dict[int, dict[int, int]] = {}  # start in the member -> {length: crc}
        self.seen = 0  # bytes recorded, counting a part read twice twice

    def add(self, start: int, length: int, crc: int) -> int | None:
        """Record a part; the CRC-32 of the whole member once the parts recorded tile it, else None."""
        if start == 0 and length == self.length:
            return crc
        known = self.parts.setdefault(start, {})
        if length in known:  # (a part read again, as diff reads a tensor that differs twice: nothing new;
            return None  # counted again, every later part re-walked them all, quadratic in the parts)
        known[length] = crc
        self.seen += length
        if self.seen < self.length:
            return None
        reach = {0: 0}  # each position reached from 0 by parts end to end: CRC of the bytes before it
        stack = [0]
        while stack:
            pos = stack.pop()
            for n, c in self.parts.get(pos, {}).items():
                end = pos + n
                if end not in reach:
                    reach[end] = _crc.combine(reach[pos], c, n)
                    if end == self.length:
                        return reach[end]
                    stack.append(end)
        return None


class MemberCrcs:
    """The zip members of one file whose bytes are checked as they are read: each read's part of
    a registered member has its CRC-32 taken, and once the parts read tile the member, their
    combined CRC must be the one its archive stores. torch never checks these CRCs; this is how
    ``reshard``, ``convert`` and ``export`` refuse to carry a flipped bit into a new checkpoint.
    A member read only in part (its bytes no tensor uses unread: bucket or alignment padding, an
    unused tail) is finished by :func:`finish_partial` before the output is published."""

    def __init__(self, display: str, path: str | None = None) -> None:
        self.display = display
        self.path = path or display
        self._members: dict[int, _Member] = {}  # by the file offset of the member's first byte
        self._starts: list[int] = []  # sorted (those of finished members included)
        self._pending: list[int] = []  # registered since _starts was last sorted
        self._lock = threading.Lock()

    def expect(self, start: int, length: int, crc: int, what: str) -> None:
        """Bytes ``[start, start + length)`` of the file are a member whose CRC-32 is ``crc``.
        A CRC of 0 is torch's "not computed" (``set_crc32_options(False)``): not checked."""
        if length <= 0 or crc == 0:
            return
        with self._lock:
            if start not in self._members:
                self._members[start] = _Member(length, crc, what)
                self._pending.append(start)

    def saw(self, offset: int, data: Any) -> None:
        """``data`` was read at ``offset``; raises CorruptFileError when it completes a member whose
        bytes do not have the stored CRC."""
        if not self._members:
            return
        view = memoryview(data).cast("B")
        end = offset + len(view)
        for start, member in self._overlapping(offset, end):
            lo, hi = max(offset, start), min(end, start + member.length)
            crc = _crc.crc32(view[lo - offset : hi - offset])  # releases the GIL
            with self._lock:
                if self._members.get(start) is not member:
                    continue  # finished by another thread meanwhile
                whole = member.add(lo - start, hi - lo, crc)
                if whole is None:
                    continue
                del self._members[start]
            if whole != member.crc:
                raise crc_mismatch(member.what, self.display, start, member.length, member.crc, whole)

    def _overlapping(self, offset: int, end: int) -> list[tuple[int, _Member]]:
        with self._lock:
            member = self._members.get(offset)
            if member is not None and offset + member.length >= end:
                return [(offset, member)]  # the usual read: one member from its start
            if self._pending:
                self._starts.extend(self._pending)
                self._starts.sort()
                self._pending.clear()
            i = max(0, bisect.bisect_right(self._starts, offset) - 1)
            found = []
            while i < len(self._starts) and self._starts[i] < end:
                start = self._starts[i]
                member = self._members.get(start)
                if member is not None and start + member.length > offset:
                    found.append((start, member))
                i += 1
            return found


_READ: list[MemberCrcs] = []
"""the checkers of the files opened in this process while it checks CRC-32s"""
_READ_LOCK = threading.Lock()

PartRead = tuple[str, str, int, int, int, str, list[tuple[int, int, int]]]
"""a member read in part: (file path, display name, its file offset, length, stored CRC-32, what
it is, its parts read as (offset in the member, length, CRC-32))"""


def drain_partial() -> list[PartRead]:
    """The zip members the files opened while checking read in part and never whole, with their
    parts' CRC-32s, taken out of this process's record (a worker's, for its parent to finish)."""
    with _READ_LOCK:
        checkers = list(_READ)
        _READ.clear()
    out: list[PartRead] = []
    for c in checkers:
        with c._lock:
            for start, m in c._members.items():
                if m.parts:
                    parts = [(at, n, crc) for at, by_len in m.parts.items() for n, crc in by_len.items()]
                    out.append((c.path, c.display, start, m.length, m.crc, m.what, parts))
    return out


def finish_partial(extra: list[PartRead] | tuple[PartRead, ...] = ()) -> int:
    """Judge every zip member read only in part (by this process, and ``extra``: by its workers,
    whose parts join this process's): the bytes no one read (padding, an unused tail: usually a
    few) are read now, and the member's CRC-32 must be the stored one, else CorruptFileError. A
    flipped bit in a tensor that shares its member with unread bytes was never judged, and was
    sealed into the output. Returns the bytes read here."""
    merged: dict[tuple[str, int], tuple[_Member, str]] = {}
    done: set[tuple[str, int]] = set()
    for path, display, start, length, crc, what, parts in [*drain_partial(), *extra]:
        key = (path, start)
        if key in done:
            continue
        member, _ = merged.setdefault(key, (_Member(length, crc, what), display))
        for at, n, c in parts:
            whole = member.add(at, n, c)
            if whole is not None:
                done.add(key)
                if whole != member.crc:
                    raise _located(crc_mismatch(what, display, start, length, crc, whole), path)
                break
    read = 0
    for (path, start), (member, display) in merged.items():
        if (path, start) in done:
            continue
        with open(path, "rb") as fh:
            whole = None
            for at, n in _uncovered(member):
                whole = member.add(at, n, _crc_of(fh, start + at, n, display))
                read += n
            if whole is None:  # parts read twice at other boundaries: the member whole, once
                whole = _crc_of(fh, start, member.length, display)
                read += member.length
        if whole != member.crc:
            raise _located(crc_mismatch(member.what, display, start, member.length, member.crc, whole), path)
    return read


def _located(exc: CorruptFileError, path: str) -> CorruptFileError:
    """``exc`` with the file's own path (``file_path``): ``diff`` tells by it which side's file it is."""
    exc.file_path = path  # type: ignore[attr-defined]
    return exc


def _crc_of(fh: Any, offset: int, n: int, display: str) -> int:
    """The CRC-32 of ``n`` bytes of ``fh`` at ``offset``, read 16 MiB at a time (a distributed
    optimizer's buffer of which a --filter kept little can be gigabytes: memory stays bounded)."""
    fh.seek(offset)
    crc, left = 0, n
    while left:
        chunk = fh.read(min(left, 16 << 20))
        if not chunk:
            raise CorruptFileError(f"{display}: short read at {offset + n - left:,}", path=display)
        crc = _crc.crc32(chunk, crc)
        left -= len(chunk)
    return crc


def _uncovered(member: _Member) -> list[tuple[int, int]]:
    """The (offset, length) spans of a member no part read covers."""
    spans = sorted((at, at + n) for at, by_len in member.parts.items() for n in by_len)
    out, pos = [], 0
    for lo, hi in spans:
        if lo > pos:
            out.append((pos, lo - pos))
        pos = max(pos, hi)
    if pos < member.length:
        out.append((pos, member.length - pos))
    return out


def crc_mismatch(
    what: str, display: str, start: int, length: int, stored: int, found: int, *, path: str | None = None
) -> CorruptFileError:
    """The error of a zip member ``what`` at ``start`` of file ``display`` (``path``, when that
    names a part of a file) whose bytes do not have the CRC-32 its archive stores."""
    return CorruptFileError(
        f"{what}: its {length:,} bytes (at {start:,} of {display}) do not match the CRC-32 its archive "
        f"stores (stored {stored:08x}, read {found:08x}): the file changed after it was saved",
        hint="nothing was written; run 'ckpttool verify' on the source to list every damaged file, and "
        "restore them from a good copy",
        path=display if path is None else path,
        rule="checksum-mismatch",
    )


_CHECKING = [0]
_CHECKING_LOCK = threading.Lock()


@contextlib.contextmanager
def checking_crcs() -> Iterator[None]:
    """While active, every :class:`RandomAccessFile` opened (and those a :class:`FileCache` made
    meanwhile opens later) checks the bytes read of zip members against the CRC-32s their archives
    store (:class:`MemberCrcs`): the pickles read to describe the source as well as the tensors
    read to write the output. The commands that write new checkpoints from old ones run inside it,
    and so do ``seal`` and ``verify`` while they describe and locate (``verify`` reports what fails
    as a finding), and ``diff`` (a tensor that fails is "not read", never equal or different)."""
    with _CHECKING_LOCK:
        _CHECKING[0] += 1
        if _CHECKING[0] == 1:
            with _READ_LOCK:
                _READ.clear()
    try:
        yield
    finally:
        with _CHECKING_LOCK:
            _CHECKING[0] -= 1
            if not _CHECKING[0]:
                with _READ_LOCK:
                    _READ.clear()


def checking() -> bool:
    """Whether this process checks CRC-32s now (inside :func:`checking_crcs`, or a worker of a
    command that does)."""
    return _CHECKING[0] > 0


def check_crcs_from_now() -> None:
    """Check CRCs in this process from now on (a worker process of a command that does)."""
    with _CHECKING_LOCK:
        _CHECKING[0] += 1


class FileCache:
    """Keeps files open across many piece reads; one per command run. At most ``max_open`` stay
    open (least recently used closed first, re-opened on their next read), so a checkpoint of
    10 000 files, or two of them in ``diff``, stays under the process's open-file limit."""

    def __init__(self, root: str | os.PathLike[str], max_open: int | None = None) -> None:
        self.root = os.fspath(root)
        self.max_open = max_open or default_max_open()
        self.check_crcs = checking()
        """the files check the CRC-32s of the zip members read (:func:`checking_crcs`)"""
        self._files: dict[str, RandomAccessFile] = {}
        self._lru: OrderedDict[str, RandomAccessFile] = OrderedDict()  # the ones with an open fd

    def holds(self, f: RandomAccessFile) -> bool:
        return self._files.get(f.display) is f

    def get(self, rel: str) -> RandomAccessFile:
        f = self._files.get(rel)
        if f is None:
            self._make_room()
            f = RandomAccessFile(confine(self.root, rel), display=rel, check=self.check_crcs)
            f.cache = self
            self._files[rel] = f
        elif f.fd < 0:
            self._make_room()
            f._open()
        self._lru[rel] = f
        self._lru.move_to_end(rel)
        return f

    def _make_room(self) -> None:
        while len(self._lru) >= self.max_open:
            _, old = self._lru.popitem(last=False)
            old.close()

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        self._lru.clear()

    def __enter__(self) -> FileCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def default_max_open() -> int:
    """A quarter of the soft open-file limit, between 16 and 256 (hashing threads, outputs and a
    second checkpoint need the rest)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, ValueError, OSError):
        return 256
    if soft == resource.RLIM_INFINITY:
        return 256
    return max(16, min(256, soft // 4))


def read_tracker(root: str | os.PathLike[str], display: str) -> str:
    """The text of the small tracker file ``display`` of the save directory ``root`` (``latest``,
    ``latest_checkpointed_iteration.txt``); a link out of ``root`` is refused, as a data file's is."""
    path = confine(root, display, named_by="the save directory", kind="tracker file")
    try:
        with open_regular(path, display) as fh:
            data = fh.read(4097)
    except OSError as exc:
        raise NotFoundError(f"{display}: cannot read ({exc.strerror})", path=display) from None
    try:
        if len(data) > 4096:
            raise ValueError("longer than 4 KiB")
        return data.decode("utf-8").strip()
    except ValueError as exc:
        raise CorruptFileError(
            f"{display}: not a tracker file ({exc})",
            hint="it should hold one tag or iteration number; the file is damaged",
            path=display,
            rule="incomplete-save",
        ) from None


def escapes(rel: object) -> bool:
    """Whether a relative path named by a file (metadata, a delta header) could leave the directory
    it is joined to, by its spelling alone: empty, absolute, ``..``, or a NUL byte."""
    if not isinstance(rel, str) or not rel or "\x00" in rel:
        return True
    parts = rel.replace("\\", "/").split("/")
    return os.path.isabs(rel) or rel.startswith(("/", "\\")) or ".." in parts


def outside(root: str | os.PathLike[str], full: str | os.PathLike[str]) -> str | None:
    """Where ``full`` (a path below ``root``) really leads when a symbolic link on the way takes it
    out of ``root``; None when it stays inside."""
    real_root = os.path.realpath(root)
    real = os.path.realpath(full)
    if real != real_root and not real.startswith(real_root.rstrip(os.sep) + os.sep):
        return real
    return None


def _link_refusal(rel: str, real: str, root: str | os.PathLike[str]) -> PathEscapeError:
    refusal = PathEscapeError(
        f"{rel!r} is a link to {real}, outside the checkpoint directory {os.path.realpath(root)}",
        hint="copy the data into the checkpoint directory instead of linking to it",
        path=rel,
    )
    refusal.link_out = True
    return refusal


def followed(path: str | os.PathLike[str]) -> Path:
    """``path``, or where it leads when it is a link to a single file: the user named that file
    (links inside a checkpoint directory stay confined to it: :func:`confine`)."""
    p = Path(path)
    return Path(os.path.realpath(p)) if p.is_symlink() and p.is_file() else p


def confine(
    root: str | os.PathLike[str],
    rel: str,
    *,
    named_by: str = "the checkpoint metadata",
    kind: str = "data file",
    holder: str | None = None,
    listed: Container[str] | None = None,
) -> str:
    """The absolute path of ``rel`` under ``root``; refuses absolute paths, ``..`` and symlinks
    that lead outside the root. ``named_by`` says where the path came from and ``kind`` what it
    names, for the message; ``holder``, the file holding the path, is the refusal's file (the one
    to mend) where it is known, else the path itself. ``listed``: the files :func:`list_files`
    gave, from a caller that reports a path not among them as missing and opens none of those;
    under :func:`links_out_left_out`, a link out that the listing left out is then not refused
    again (its name still is, if it leads out)."""
    root_s = os.fspath(root)
    if escapes(rel):
        raise PathEscapeError(
            f"{named_by} names the {kind} {rel!r}, which is outside the checkpoint directory {root_s}",
            hint="the metadata is damaged or hostile; ckpttool only reads files below the checkpoint root",
            path=holder if holder is not None else rel,
        )
    full = os.path.join(root_s, *rel.replace("\\", "/").split("/"))
    if listed is not None and rel not in listed and _LINKS_OUT_LEFT_OUT.get():
        return full  # (left out of the listing: the caller says it is missing)
    real = outside(root_s, full)
    if real is not None:
        raise _link_refusal(rel, real, root_s)
    return full


_LINKS_OUT_LEFT_OUT: contextvars.ContextVar[bool] = contextvars.ContextVar("ckpttool_links_out", default=False)


@contextlib.contextmanager
def links_out_left_out() -> Iterator[None]:
    """Inside this block :func:`list_files` leaves out the links that lead out of the checkpoint
    instead of refusing them: ``verify``, having reported each link, looks for what else is wrong
    (a rank file missing beside it) with the checkpoint's own files. Readers that keep a listing
    of their own ask :func:`left_out` (or pass ``listed`` to :func:`confine`), so that nothing
    behind such a link is opened here either."""
    token = _LINKS_OUT_LEFT_OUT.set(True)
    try:
        yield
    finally:
        _LINKS_OUT_LEFT_OUT.reset(token)


def left_out(root: str | os.PathLike[str], rel: str) -> bool:
    """Whether ``rel`` below ``root`` leads out of it through a link and :func:`links_out_left_out`
    is on: a reader with a listing of its own counts it absent, as :func:`list_files` does."""
    if not _LINKS_OUT_LEFT_OUT.get() or escapes(rel):  # (a name that leads out is confine's to refuse)
        return False
    return outside(root, os.path.join(os.fspath(root), rel)) is not None


def list_files(
    root: str | os.PathLike[str], *, relative_to: str | os.PathLike[str] | None = None
) -> list[tuple[str, int]]:
    """Every regular file below ``root`` as ``(relative posix path, size)``, sorted.

    A symbolic link that stays inside ``relative_to`` (default: ``root``) is listed with its
    target's size; one that leads out of it, to a file or a directory, is refused
    (:class:`PathEscapeError`, naming every such link: the others in its ``others``): ckpttool
    reads nothing outside the checkpoint (under :func:`links_out_left_out`, such a link is left
    out of the list). Links to directories are not followed.
    """
    root_s = os.fspath(root)
    confine_to = os.fspath(relative_to) if relative_to is not None else root_s
    out: list[tuple[str, int]] = []
    refused: list[CkptError] = []
    leave_out = _LINKS_OUT_LEFT_OUT.get()
    for dirpath, dirnames, filenames in os.walk(root_s):
        dirnames[:] = sorted(d for d in dirnames if not is_temp_name(d))
        links_out = set()
        for name in sorted([*filenames, *dirnames]):
            full = os.path.join(dirpath, name)
            if os.path.islink(full) and (real := outside(confine_to, full)) is not None:
                links_out.add(name)
                if not leave_out:
                    rel = os.path.relpath(full, confine_to).replace(os.sep, "/")
                    refused.append(_link_refusal(rel, real, confine_to))
        if refused:
            continue
        for name in filenames:
            if is_temp_name(name) or name in links_out:
                continue  # a writer's temporary (in flight, or left by a killed run), or a link left out
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root_s).replace(os.sep, "/")
            try:
                st = os.stat(full)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                out.append((rel, st.st_size))
    raise_together(refused)
    out.sort()
    return out


def is_temp_name(name: str) -> bool:
    """Whether ``name`` is a ckpttool writer's temporary (``.<dest>.ckpttool-tmp-<owner><random>``):
    a hidden name with the marker after its first character. A file that merely holds the marker
    (``notes.ckpttool-tmp-1``) is a file of the checkpoint; it was left out of listings without a word."""
    return name.startswith(".") and TMP_MARKER in name[1:]


def _owner_tag() -> str:
    """``host-pid``: who made a temporary (so a later run can tell a dead writer's leftovers from
    a live one's)."""
    return f"{socket.gethostname()}-{os.getpid()}-"


def _temp_prefix(dest: Path) -> str:
    return f".{dest.name}{TMP_MARKER}"


def published_as(path: str) -> str | None:
    """The path a writer's temporary ``path`` (or a file inside a temporary directory) is published
    as, for a message about it: the user named that one, not the hidden sibling; None for any other
    path."""
    parts = path.split(os.sep)
    found = False
    for k, part in enumerate(parts):  # (every one: a seal's own temporary inside the staging directory)
        if is_temp_name(part):
            parts[k] = part[1 : part.index(TMP_MARKER, 1)]
            found = True
    return os.sep.join(parts) if found else None


def _temp_name(dest: Path) -> str:
    """A fresh temporary sibling's name for ``dest``: prefix, owner, 8 random characters."""
    return f"{_temp_prefix(dest)}{_owner_tag()}{secrets.token_hex(4)}"


def sweep_stale(dest: str | os.PathLike[str]) -> None:
    """Remove the temporaries that writers killed before they finished left beside ``dest``
    (made on this host by a process that no longer runs)."""
    dest_p = Path(dest)
    parent = dest_p.parent if str(dest_p.parent) else Path(".")
    prefix = _temp_prefix(dest_p)
    host = socket.gethostname()
    try:
        siblings = [p for p in parent.iterdir() if p.name.startswith(prefix)]
    except OSError:
        return
    for p in siblings:
        owner = p.name[len(prefix) :].rsplit("-", 2)
        if len(owner) != 3 or owner[0] != host or not owner[1].isdigit():
            continue  # not ours to judge (another host, or an old naming)
        if _alive(int(owner[1])) or _held(p):
            continue  # (a pid of another PID namespace, a container on this host, reads as dead: its lock says)
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()


WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})
"""the errors of a write refused for space or a read-only file system, which ``os.write`` gives
without naming the file"""


OS_ERROR_HINT = "check the path, its permissions and the free space, then rerun"


def os_error_line(exc: OSError, output: Any = None) -> str:
    """One line for an error the operating system gave: the path(s) and its reason. A write that
    names no file (``os.write``: a full disk) is said of the command's output, when it has one."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    if exc.filename is None and output is not None and exc.errno in WRITE_ERRNOS:
        return f"{output}: {reason} while writing it (nothing was published)"
    if exc.filename is None:
        return f"cannot complete: {reason}"
    if reason[:1].isupper() and reason[1:2].islower():  # "No such file" -> "no such file"
        reason = reason[0].lower() + reason[1:]
    where = os.fsdecode(exc.filename)
    if (dest := published_as(where)) is not None:  # (a writer's hidden temporary: said of what it writes)
        return f"{dest}: {reason} while writing it (nothing was published)"
    if exc.errno == errno.EACCES and (shut := _shut_folder(where)) is not None:
        # (a file looked for inside a folder that cannot be opened: the folder is what to fix)
        return f"{shut}: {reason} (the folder cannot be opened, nor anything in it)"
    if exc.filename2 is not None:
        where += f" -> {os.fsdecode(exc.filename2)}"
    return f"{where}: {reason}"


def _shut_folder(path: str) -> str | None:
    """The outermost folder above ``path`` that this process may not enter, if any."""
    parts = Path(path).parts
    for i in range(1, len(parts)):
        folder = os.path.join(*parts[:i])
        if os.path.isdir(folder) and not os.access(folder, os.X_OK):
            return folder
    return None


def _name_the_write(exc: BaseException, tmp: str | os.PathLike[str]) -> None:
    """A write error that names no file (:data:`WRITE_ERRNOS`) named after the temporary it was
    writing, which messages say as the output it is published as (:func:`published_as`): the user
    learns which output did not fit."""
    if isinstance(exc, OSError) and exc.filename is None and exc.errno in WRITE_ERRNOS:
        exc.filename = os.fspath(tmp)


_HOLDS: dict[str, int] = {}
"""Temporaries this process writes, each with the descriptor holding its lock (:func:`_hold`)."""


def _hold(path: str | os.PathLike[str]) -> None:
    """Lock the temporary ``path`` (``flock``, exclusive) for as long as this process writes it: the
    lock goes with the process, so :func:`sweep_stale` in another process tells a live writer from
    a dead one where the pid cannot (another PID namespace: containers sharing a host name). Where
    the file system takes no lock, the pid alone judges, as before."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return
    _HOLDS[os.fspath(path)] = fd


def _let_go(path: str | os.PathLike[str]) -> None:
    fd = _HOLDS.pop(os.fspath(path), None)
    if fd is not None:
        os.close(fd)


def _held(path: Path) -> bool:
    """Whether a live process holds the lock of temporary ``path`` (:func:`_hold`); this one too,
    whose own lock is held through another descriptor, which ``flock`` tells apart."""
    import fcntl

    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:  # (never blocks: a FIFO named like a temporary would hang the open; a link is not followed)
        fd = os.open(path, flags)
    except OSError:
        return False
    try:
        if not (stat.S_ISREG(mode := os.fstat(fd).st_mode) or stat.S_ISDIR(mode)):
            return False  # (only a writer's file or directory is locked)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False  # (no locks on this file system: the pid judged)
    finally:
        os.close(fd)  # (and with it the lock just taken)
    return False


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # an earlier, interrupted call of this very process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed writer that nobody has reaped yet (a zombie) no longer writes
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return True


def _make_parents(directory: Path) -> list[Path]:
    """Make ``directory`` and its missing ancestors (as ``mkdir -p``); returns the ones made, the
    outermost first, for :func:`_unmake` after a failed run."""
    missing = []
    at = directory
    while not at.exists() and at != at.parent:
        missing.append(at)
        at = at.parent
    made: list[Path] = []
    try:
        for d in reversed(missing):  # outermost first; one another process made meanwhile is not ours
            try:
                os.mkdir(d)
                made.append(d)
            except FileExistsError:
                if not d.is_dir():
                    raise
    except BaseException:
        _unmake(made)
        raise
    return made


def _remake_parents(directory: Path, made: list[Path], vanished: int, exc: FileNotFoundError) -> int:
    """Make ``directory`` again after it vanished between :func:`_make_parents` and the temporary's
    creation (another run that had made it and found it empty failed, and removed it with
    :func:`_unmake`); the folders made now are this run's (added to ``made``). ``vanished``: how
    often it did so before; returns the count with this time. The fourth time is an error. ``exc``,
    the creation's error, is raised as it is where the folder is there (a file system that refuses
    new files so, as /proc does)."""
    if directory.is_dir():
        raise exc
    if vanished >= 3:
        gone = "the output's folder keeps being removed by another process"
        raise FileNotFoundError(errno.ENOENT, gone, str(directory))
    made.extend(_make_parents(directory))
    return vanished + 1


def _unmake(made: list[Path]) -> None:
    """Remove the directories a failed run made for its output (innermost first), those still
    empty: an output that is not published leaves nothing behind, not even its parent folders."""
    for d in reversed(made):
        with contextlib.suppress(OSError):
            os.rmdir(d)


_REPLACING: contextvars.ContextVar[bool] = contextvars.ContextVar("ckpttool_replacing", default=False)


@contextlib.contextmanager
def replacing(force: bool) -> Iterator[None]:
    """Within it, :func:`staged_dir` may replace the output it publishes where that output existed
    when it was staged (``--force`` given, and checked then); outside it, never: a directory that
    appears at the output path while a run plans or writes (another run's, a user's) is not
    deleted to make way for this one."""
    token = _REPLACING.set(force)
    try:
        yield
    finally:
        _REPLACING.reset(token)


@contextlib.contextmanager
def atomic_output(dest: str | os.PathLike[str], *, replace: bool = True) -> Iterator[BinaryIO]:
    """Write a file that appears at ``dest`` complete or not at all.

    Yields a binary file in the destination's directory; on success it is flushed, fsync'd and
    renamed over ``dest`` and the directory fsync'd. On any error the temporary file is removed.
    Leftovers of killed earlier runs beside ``dest`` are removed first. ``replace``: an existing
    ``dest`` may be replaced (a report, a seal; ``--force``); without it, or where ``dest`` was not
    there when writing began, one that is there at the end is kept and the write refused
    (:func:`appeared_meanwhile`).
    """
    dest_p = Path(dest)
    parent = dest_p.parent if str(dest_p.parent) else Path(".")
    may_replace = replace and os.path.lexists(dest_p)
    made = _make_parents(parent)  # (as staged_dir; callers refuse a parent they must not make)
    sweep_stale(dest_p)
    tmp: str | None = None
    vanished = 0
    try:
        while True:  # named before it is made: an interrupt landing in between leaves nothing unnamed
            tmp = str(parent / _temp_name(dest_p))
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
                _hold(tmp)
                break
            except FileExistsError:
                continue
            except FileNotFoundError as exc:
                vanished = _remake_parents(parent, made, vanished, exc)
        from ckpttool._directwrite import DirectFile, direct_ok  # (it uses this module's helper threads)

        with DirectFile(fd) if direct_ok(parent) else os.fdopen(fd, "wb") as f:
            yield cast(BinaryIO, f)  # (a DirectFile: write, tell, flush, fileno)
            f.flush()
            os.fsync(f.fileno())
        put_in_place(tmp, dest_p, replace=may_replace)
        fsync_dir(parent)
    except BaseException as exc:
        if tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            _name_the_write(exc, tmp)
        _unmake(made)
        raise
    finally:
        if tmp is not None:
            _let_go(tmp)


@contextlib.contextmanager
def staged_dir(dest: str | os.PathLike[str]) -> Iterator[Path]:
    """A fresh directory next to ``dest`` (same file system, so one rename publishes it), with the
    permissions a plain ``mkdir`` would give. The caller fills it and calls :func:`publish_dir`
    inside the block; on any exception it is removed. Leftovers of killed earlier runs beside
    ``dest`` are removed first. An existing ``dest`` is replaced only within :func:`replacing`."""
    dest_p = Path(dest)
    made = _make_parents(dest_p.parent)
    sweep_stale(dest_p)
    tmp: Path | None = None
    vanished = 0
    try:
        while True:  # named before it is made (as in atomic_output)
            tmp = dest_p.parent / _temp_name(dest_p)
            try:
                os.mkdir(tmp)  # what a plain mkdir gives (0o777 less the umask)
                _hold(tmp)
                break
            except FileExistsError:
                continue
            except FileNotFoundError as exc:
                vanished = _remake_parents(dest_p.parent, made, vanished, exc)
        _STAGED[str(tmp)] = _REPLACING.get() and os.path.lexists(dest_p)
        yield tmp
    except BaseException as exc:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            _name_the_write(exc, tmp)
        _unmake(made)
        raise
    finally:
        if tmp is not None:
            _STAGED.pop(str(tmp), None)
            _let_go(tmp)


class WriterGate:
    """Admits worker threads into a staged output until :meth:`close`, which then waits for those
    inside to leave, so the caller may remove the staged directory knowing no thread still writes
    to it.

    ``ThreadPoolExecutor.shutdown(wait=True)`` is not enough for that: it joins only the threads
    it has recorded, and a Ctrl-C that lands inside ``Thread.start`` (which waits for the new
    thread to run) leaves one running that was never recorded. Such a thread, let in after the
    directory was emptied, re-creates a file in it and keeps it from being removed."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._inside = 0
        self.cancelled = threading.Event()  # polled by the threads inside, to stop early

    def enter(self) -> bool:
        """Called by a worker before it touches the output; False once closed (do nothing)."""
        with self._cond:
            if self.cancelled.is_set():
                return False
            self._inside += 1
            return True

    def leave(self) -> None:
        with self._cond:
            self._inside -= 1
            self._cond.notify_all()

    def close(self) -> None:
        """Admit no one more, ask those inside to stop, and wait until they have left."""
        with self._cond:
            self.cancelled.set()
            self._cond.wait_for(lambda: self._inside == 0)


_HELPERS: dict[str, Any] = {}
_helpers_lock = threading.Lock()


def helper(name: str) -> Any:
    """The process's one helper thread for ``name`` (a single-thread executor, started on first
    use): the writers compute CRC-32s (``crc``), fill the next tensor (``fill``) and start the
    disk's write-back (``writeback``) beside their main thread. Work that releases the GIL (zlib,
    xxhash, reads, numpy copies, syscalls) then runs on the other core."""
    pool = _HELPERS.get(name)
    if pool is None:
        from concurrent.futures import ThreadPoolExecutor

        with _helpers_lock:  # two threads asking at once get the same one
            pool = _HELPERS.get(name)
            if pool is None:
                pool = _HELPERS[name] = ThreadPoolExecutor(1, thread_name_prefix=f"ckpttool-{name}")
    return pool


_SYNC_FILE_RANGE_WRITE = 2
_writeback_lock = threading.Lock()
_writeback_queued: set[tuple[int, int]] = set()  # files (device, inode) with a write-back job waiting


def _after_fork() -> None:  # a forked child has none of the parent's threads
    global _writeback_lock, _helpers_lock
    _writeback_lock, _helpers_lock = threading.Lock(), threading.Lock()
    _writeback_queued.clear()
    _HELPERS.clear()


os.register_at_fork(after_in_child=_after_fork)


def _sync_file_range() -> Any:
    """libc's ``sync_file_range`` (Linux), or None where there is none."""
    if os.environ.get("CKPTTOOL_NO_WRITEBACK"):
        return None
    return _libc("sync_file_range", "int", "int64", "int64", "uint")


def _libc(name: str, *argtypes: str) -> Any:
    """The Linux libc function ``name`` taking C ``argtypes`` (ctypes names without ``c_``) and
    returning an int, with ``errno`` kept for :func:`_errno`; None elsewhere, or where this libc
    lacks it. Looked up once."""
    if name not in _LIBC:
        fn = None
        if sys.platform.startswith("linux"):
            try:
                import ctypes

                fn = getattr(ctypes.CDLL(None, use_errno=True), name)
                fn.argtypes = [getattr(ctypes, f"c_{t}") for t in argtypes]
                fn.restype = ctypes.c_int
            except (OSError, AttributeError):
                fn = None
        _LIBC[name] = fn
    return _LIBC[name]


_LIBC: dict[str, Any] = {}


def start_writeback(fh: BinaryIO) -> None:
    """Ask the kernel to start writing ``fh``'s dirty pages to disk now, on a helper thread, and
    return at once: an output is fsync'd before it is published, and that fsync then finds little
    left to wait for, the disk having written while ckpttool went on assembling. (A no-op where
    ``sync_file_range`` is missing, for a file object with no descriptor, and while a job for the
    same file is still waiting: that job covers the whole file when it runs.)"""
    fn = _sync_file_range()
    if fn is None or not getattr(fh, "writeback", True):  # (a DirectFile's writes skip the cache)
        return
    try:
        fh.flush()
        fd = fh.fileno()
        st = os.fstat(fd)
    except (AttributeError, OSError, ValueError):
        return
    key = (st.st_dev, st.st_ino)
    with _writeback_lock:
        if key in _writeback_queued:
            return
        _writeback_queued.add(key)
    dup = os.dup(fd)  # its own descriptor: the caller may close the file before the job runs
    try:
        helper("writeback").submit(_writeback, fn, dup, key)
    except BaseException:  # (no job: at interpreter shutdown) nothing left holding the descriptor
        os.close(dup)
        with _writeback_lock:
            _writeback_queued.discard(key)
        raise


def _writeback(fn: Any, fd: int, key: tuple[int, int]) -> None:
    with _writeback_lock:
        _writeback_queued.discard(key)  # what is written from now on needs a job of its own
    try:
        fn(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)  # offset 0, length 0: the whole file; errors ignored (a hint)
    finally:
        os.close(fd)


def fsync_tree(root: Path, *, files: bool = True) -> None:
    """Flush every file (unless ``files`` is False: the writer fsync'd them) and directory below
    ``root``, deepest directories first (for writers that do not fsync what they write, such as
    torch's zip writer)."""
    dirs = [root]
    for path in root.rglob("*"):
        if path.is_dir():
            dirs.append(path)
            continue
        if not files:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    for d in sorted(dirs, key=lambda p: -len(p.parts)):
        fsync_dir(d)


def refuse_overlap(out: str | os.PathLike[str], *, flag: str = "-o", **inputs: str | os.PathLike[str] | None) -> None:
    """Refuse an output path ``out`` (given as option ``flag``) that is one of the ``inputs`` (by
    role: ``source=...``), lies inside one, or holds one: publishing replaces the whole ``out`` path
    (``--force`` deletes what stood there), and inputs are never modified. Symlinks are resolved
    first."""
    o = resolved(out, f"{flag} {out}")
    for role, given in inputs.items():
        if given is None:
            continue
        try:
            i = resolved(given, f"the {role} {given}")
        except UsageError:  # (an input that is a loop of links: its reader says so, exit 3, with the reports)
            i = Path(os.path.abspath(given))
        if o == i or o.is_relative_to(i):
            raise UsageError(f"{flag} {out} is inside the {role} {given}", hint="write the output elsewhere")
        if i.is_relative_to(o):
            raise UsageError(
                f"{flag} {out} holds the {role} {given}: replacing it would delete the {role}",
                hint="write the output elsewhere",
            )


def resolved(path: str | os.PathLike[str], said: str) -> Path:
    """``path`` with its symbolic links resolved, where they end (a loop of links is refused as a
    usage error naming it as ``said``: Python 3.11's ``resolve`` raised RuntimeError, an internal
    error to the user)."""
    try:
        return Path(path).resolve()
    except (RuntimeError, OSError) as exc:
        if isinstance(exc, OSError) and exc.errno != errno.ELOOP:
            raise
        raise UsageError(
            f"{said}: its symbolic links form a loop (too many levels of symbolic links)",
            hint="point the links at a real file or directory, or give another path",
        ) from None


def refuse_replacing_other_file(target: Path, said: str, what: str, ours: Callable[[bytes], object]) -> None:
    """An output file (``said``: its option and path) replaces an earlier one of its kind (``ours``
    of its first 512 bytes: ``what`` it should be) or an empty file, never other data: a mistyped
    path (a tracker, a config, notes, a checkpoint's file) would be lost without a word. (A
    directory ``--force`` replaces is judged by :func:`_refuse_replacing_other_data`.)"""
    if not target.is_file():
        return
    try:
        with open(target, "rb") as f:
            head = f.read(512)
    except OSError:
        return  # (the atomic write then says what stops it)
    if head and not ours(head):
        raise UsageError(
            f"{said} exists and is not {what} ({target.stat().st_size:,} bytes): not replaced",
            hint="give another path, or remove the file first if it may go",
        )


def not_found(path: Path) -> NotFoundError:
    """The error for an input ``path`` that is not there: said as a dangling symbolic link or a
    loop of them where it is one (it read "no such file or directory" of a link that is there)."""
    if path.is_symlink():
        try:
            resolved(path, str(path))
        except UsageError as loop:
            return NotFoundError(
                loop.message, hint="point the links at the checkpoint, or give its real path", path=str(path)
            )
        return NotFoundError(
            f"{path} is a symbolic link to {os.readlink(path)}, which does not exist",
            hint="point the link at the checkpoint, or give its real path",
            path=str(path),
        )
    return NotFoundError(f"{path}: no such file or directory", hint="check the path", path=str(path))


_NAME_MAX = 255
"""the longest file name (in bytes) of Linux's file systems, macOS's and Windows' (in UTF-16 units)"""


def check_output(
    output: str | os.PathLike[str], *, force: bool, directory: bool, example: str, flag: str = "-o"
) -> bool:
    """Refuse, before any work (exit 2), an output path the command could not publish: one that
    names no new entry (``.``, ``..``, ``/``), a directory where one file is written, a directory
    that holds the working directory or is a mount point where ``--force`` would replace it, or a
    path below a file. Missing parent directories are fine: :func:`atomic_output` and
    :func:`staged_dir` create them when writing starts. Returns whether the output may be replaced
    (``--force``, and something stands there now): what ``--force`` was checked against, for
    :func:`replacing` and ``atomic_output(replace=…)``, so that what appears later is not replaced."""
    out = Path(output)
    what = "directory" if directory else "file"
    if os.fspath(output) == "-":  # (a file named "-" appeared in the working directory)
        raise UsageError(
            f"{flag} -: ckpttool writes its outputs to files, not to standard output",
            hint="give a file's path (a file named '-' with its folder: /path/to/-)"
            + ("; --json prints the report on stdout" if flag == "--report" else ""),
        )
    for part in out.parts:  # (before any stat: a longer name raises ENAMETOOLONG from every look at it)
        if len(os.fsencode(part)) > _NAME_MAX:
            raise UsageError(
                f"{flag} {output}: the name {part[:40]}… is {len(os.fsencode(part))} bytes, more than the "
                f"{_NAME_MAX} file systems allow",
                hint="choose a shorter name",
            )
    if out.name in ("", ".", ".."):
        raise UsageError(
            f"{flag} {output}: expected the name of a new {what}, found a reference to an existing directory",
            hint=f"give the path of the {what} to write, such as {example}",
        )
    if out.is_symlink() and not out.exists() and not force:  # (exists() follows it: it said "no")
        raise UsageError(
            f"{flag} {output} is a symbolic link to {os.readlink(out)}, which does not exist: publishing the "
            f"{what} would replace the link",
            hint="pass --force to replace the link, or choose another path",
        )
    if out.exists() and not (out.is_dir() or out.is_file()):
        mode = os.stat(out).st_mode
        kind = next(
            (k for test, k in ((stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                               (stat.S_ISFIFO, "named pipe"), (stat.S_ISSOCK, "socket")) if test(mode)),
            "special file",
        )  # fmt: skip
        raise UsageError(
            f"{flag} {output} is a {kind}: ckpttool replaces only files and directories, with --force or not",
            hint=f"give the path of the {what} to write, such as {example}",
        )
    if force and directory and out.exists() and not out.is_dir():
        raise UsageError(
            f"{flag} {output} is a file; this command writes a directory: --force replaces an earlier output "
            "directory, not a file",
            hint=f"give the path of the directory to write, such as {example}, or remove the file yourself",
        )
    if out.is_dir():
        if not directory:
            raise UsageError(
                f"{flag} {output} is a directory; this command writes one file",
                hint=f"give a file path such as {example}, or remove the directory",
            )
        if force and Path.cwd().resolve().is_relative_to(out.resolve()):
            raise UsageError(
                f"{flag} {output} holds the current working directory: replacing it would delete the "
                "directory you are working in",
                hint="write the output elsewhere",
            )
        if force and os.path.ismount(out):
            raise UsageError(
                f"{flag} {output} is a mount point, which cannot be replaced", hint="write the output elsewhere"
            )
        if force:
            _refuse_replacing_other_data(out, f"{flag} {output}")
    # the nearest ancestor that exists must be a directory this process can create entries in
    ancestor = out.absolute().parent
    while not (ancestor.exists() or ancestor.is_symlink()) and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        found = "a broken symbolic link" if not ancestor.exists() else "a file"
        raise UsageError(
            f"{flag} {output}: {ancestor} is {found}, not a directory",
            hint=f"give a path whose parent is a directory (or does not exist yet), such as {example}",
        )
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UsageError(
            f"{flag} {output}: cannot create entries in {ancestor} (permission denied or read-only)",
            hint="write the output to a directory you can write to",
        )
    try:
        name_max = os.pathconf(ancestor, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    below = out.absolute().relative_to(ancestor).parts
    for part in below[:-1]:
        if len(os.fsencode(part)) > name_max:
            raise UsageError(
                f"{flag} {output}: the folder name {part[:40]}… is {len(os.fsencode(part))} bytes, more than the "
                f"{name_max} this file system allows",
                hint="choose a shorter path",
            )
    longest = len(os.fsencode(_temp_name(out)))  # (written first under its temporary name, beside it)
    if longest > name_max:
        room = name_max - (longest - len(os.fsencode(out.name)))
        raise UsageError(
            f"{flag} {output}: a name of {len(os.fsencode(out.name))} bytes, too long for this file system once "
            f"ckpttool writes it first under a temporary name beside it ({longest} bytes; at most {name_max})",
            hint=f"choose a name of at most {max(room, 1)} bytes",
        )
    return force and os.path.lexists(out)


_TRACKERS = ("latest", "latest_universal", "latest_checkpointed_iteration.txt")
"""files a save directory keeps beside the save they name (DeepSpeed's tags, Megatron's iterations;
see ``formats/deepspeed.py`` and ``formats/megatron.py``): an earlier output's, where its manifest is
rooted in that save"""


_COMPANION = re.compile(
    r"(generation_|adapter_|tokenizer_|ds_)?config\.json|training_args\.bin|scaler\.pt|tokenizer\.(json|model)"
    r"|special_tokens_map\.json|added_tokens\.json|vocab\.(json|txt)|merges\.txt|chat_template\.jinja"
    r"|sharded/shard-\d+-[^/]+\.safetensors"
)
"""files a checkpoint's folder holds beside its data that its writers put there and its reader does
not account for (a Hugging Face save's config and tokenizer, the per-rank shards DCP's Hugging Face
writer keeps beside the consolidated model; a Trainer's state files are the reader's
``extras["state_files"]``, DeepSpeed's scripts its ``RECOVERY_SCRIPTS``): an unsealed earlier output
holding them is still only a checkpoint; anything else there (code, logs, data) is not"""


def _refuse_replacing_other_data(out: Path, said: str) -> None:
    """``--force`` replaces an earlier output or an empty directory, nothing else: a directory
    holding anything the checkpoint in it does not account for (another save's folder, logs, code,
    a dataset beside a model file) is refused, not deleted with the new output's publishing."""
    try:
        with os.scandir(out) as entries:  # (a folder with a slash, as the walk below names them)
            names = sorted(e.name + ("/" if e.is_dir(follow_symlinks=False) else "") for e in entries)
    except OSError:
        return  # (unreadable: the write says why)
    if not names:
        return
    others = _beside_the_checkpoint(out)
    hint = "choose another path, or remove the directory yourself if what it holds may go"
    if isinstance(others, str):
        raise UsageError(
            f"{said} holds a checkpoint ckpttool cannot read whole ({others}): --force replaces an earlier "
            "output, not a checkpoint it cannot account for",
            hint=hint,
        )
    if others == []:
        return
    held = names if others is None else others
    shown = ", ".join(printable(n) for n in held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
    if others is None:
        raise UsageError(
            f"{said} is a directory that holds no checkpoint ckpttool reads ({shown}): --force replaces an earlier "
            "output or an empty directory, not other data",
            hint=hint,
        )
    raise UsageError(
        f"{said} holds {shown} beside the checkpoint in it: --force replaces an earlier output or an empty "
        "directory, not other data",
        hint=hint,
    )


def _beside_the_checkpoint(out: Path) -> list[str] | str | None:
    """What the directory ``out`` holds that is not part of the checkpoint in it: the paths (a
    folder with nothing of the checkpoint below it named once, with a slash); None where it holds no
    checkpoint (its tree not walked: it may be a home directory); or why its checkpoint does not
    read. Its checkpoint: the files its ckpttool
    seal lists where it has one, else those its format's reader accounts for (of the files it keeps
    beside its data, only those its writers put there: :data:`_COMPANION`; and a save directory's
    tracker beside the save)."""
    from ckpttool import registry
    from ckpttool.seal import Seal

    def beside(root: str | os.PathLike[str], files: list[str]) -> list[str]:
        at = Path(os.path.relpath(root, out))
        listed = {os.path.normpath(at / f) for f in files} | {SEAL_NAME}
        if at != Path("."):
            listed.update(name for name in _TRACKERS if (out / name).is_file())
        return _outside(_entries(out), {Path(p).as_posix() for p in listed})

    seal = out / SEAL_NAME
    if seal.is_file():  # (the seal's folder: as recorded where that is inside out, else out itself)
        with contextlib.suppress(CkptError, ValueError):
            head = Seal.load(seal).head
            recorded = Path(head.root)
            folder = out / recorded.name if (out / recorded.name).is_dir() and recorded.name != out.name else out
            # (its files there, some perhaps lost or damaged since: an earlier output to write again;
            # none there: a seal made elsewhere, or one that named its folder wrong)
            if any((folder / f.path).is_file() for f in head.files if f.role != "seal"):
                return beside(folder, [f.path for f in head.files])
    try:
        registry.detect(out)
    except CkptError:
        return None
    try:
        _, manifest = registry.describe(out)
    except CkptError as exc:
        return exc.message
    from ckpttool.formats.deepspeed import RECOVERY_SCRIPTS

    state_files = {str(f) for f in (manifest.extras.get("state_files") or {}).values()}
    return beside(
        manifest.root,
        [
            f.path
            for f in manifest.files
            if f.role != "aux"
            or f.path in state_files
            or f.path.rsplit("/", 1)[-1] in RECOVERY_SCRIPTS
            or _COMPANION.fullmatch(f.path)
        ],
    )


def _entries(out: Path) -> list[str]:
    """Every entry below ``out`` that is not a directory, and every empty directory (with a slash),
    as posix paths relative to it; links are not followed."""
    found: list[str] = []
    for top, dirs, files in os.walk(out):
        rel = Path(top).relative_to(out)
        found += [(rel / name).as_posix() for name in files]
        found += [(rel / d).as_posix() for d in dirs if os.path.islink(os.path.join(top, d))]
        if not dirs and not files and rel != Path("."):
            found.append(rel.as_posix() + "/")
    return sorted(found)


def _outside(found: list[str], listed: set[str]) -> list[str]:
    """``found`` less ``listed``, each folder whose entries are all outside named once (``logs/``)."""
    held = {parent.as_posix() for p in listed for parent in Path(p).parents}
    out: dict[str, None] = {}
    for p in found:
        if p in listed:
            continue
        parts = p.rstrip("/").split("/")
        # the outermost folder of it holding nothing listed stands for all it holds
        top = next(("/".join(parts[:k]) for k in range(1, len(parts)) if "/".join(parts[:k]) not in held), None)
        out[f"{top}/" if top is not None else p] = None
    return list(out)


def check_output_file(out: str | os.PathLike[str], flag: str) -> None:
    """Refuse, before any work, an output file that cannot be published: a directory, or a path
    whose parent directory does not exist."""
    check_output(out, force=False, directory=False, example="report.json", flag=flag)
    o = Path(out)
    parent = resolved(o, f"{flag} {out}").parent
    if not parent.is_dir():
        raise UsageError(f"{flag} {out}: directory {parent} does not exist", hint="create it first")


def publish_dir(tmp: Path, dest: Path) -> None:
    """Put the finished directory ``tmp`` (from :func:`staged_dir`) in place of ``dest``: one
    rename, then the parent's entry flushed. An existing ``dest`` (``--force``) is first renamed
    aside and deleted only after the new one is in place, so a crash leaves the old output, the
    new one, or (between the two renames) none, never a half-deleted one. A ``dest`` that was not
    there when the directory was staged, made since by another run or a user, is never replaced
    (:func:`appeared_meanwhile`). Inside :func:`checking_crcs`, the source's zip members read only
    in part are judged whole first (:func:`finish_partial`): no writer can publish a flipped bit it
    read without judging it."""
    if checking():
        finish_partial()
    old: Path | None = None
    if not _STAGED.pop(str(tmp), True):  # (absent when staged: it may not be replaced now)
        put_in_place(tmp, dest, replace=False)
        fsync_dir(dest.parent)
        return
    if dest.exists() or dest.is_symlink():
        old = dest.parent / (_temp_prefix(dest) + _owner_tag() + "old")
        os.replace(dest, old)
    os.replace(tmp, dest)
    fsync_dir(dest.parent)
    if old is not None:
        shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()


_STAGED: dict[str, bool] = {}
"""Directories :func:`staged_dir` made and not yet published: whether their destination existed then."""


def put_in_place(src: str | os.PathLike[str], dest: Path, *, replace: bool) -> None:
    """Rename the finished ``src`` to ``dest``: over what is there where ``replace`` (what stood at
    ``dest`` when the output was checked, ``--force``), else only while ``dest`` is absent (one that
    appeared since is never replaced: :func:`appeared_meanwhile`)."""
    if replace:
        os.replace(src, dest)
        return
    try:
        rename_noreplace(src, dest)
    except FileExistsError:
        raise appeared_meanwhile(dest) from None


def appeared_meanwhile(dest: Path) -> UsageError:
    return UsageError(
        f"{dest} appeared while the output was being written (another run, or someone, made it): not replaced, "
        "nothing written",
        hint="remove it and run again, pass --force to replace it, or choose another path",
    )


def rename_noreplace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Rename ``src`` to ``dst`` unless ``dst`` exists (FileExistsError): in one step where the
    kernel and file system take ``RENAME_NOREPLACE`` (Linux ``renameat2``), else checked just
    before the rename."""
    fn = _libc("renameat2", "int", "char_p", "int", "char_p", "uint")  # (glibc 2.28+)
    if fn is not None:
        if fn(-100, os.fsencode(src), -100, os.fsencode(dst), 1) == 0:  # AT_FDCWD, RENAME_NOREPLACE
            return
        err = _errno()
        if err == errno.EEXIST:
            raise FileExistsError(err, os.strerror(err), os.fspath(dst))
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(err, os.strerror(err), os.fspath(src))
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fspath(dst))
    os.rename(src, dst)


def _errno() -> int:
    import ctypes

    return ctypes.get_errno()


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
