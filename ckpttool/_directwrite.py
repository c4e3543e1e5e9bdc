"""Output files written around the page cache (``O_DIRECT``), where the file system takes it.

A reshard writes gigabytes it will not read again. Written through the page cache, every byte is
first copied by the kernel into freshly allocated cache pages, and on the virtual machines these
tools run on that copy is the slowest part of the whole command: measured on a 1.2 GB output,
buffered writes spent 0.4–1.9 s of kernel time (two-valued from run to run, the host handing
memory back slowly), direct writes 0.1 s, for the same bytes made durable (see
docs/benchmarks.md).

:class:`DirectFile` takes the writers' bytes (any sizes, any offsets) into page-aligned staging
buffers and writes each full buffer at an aligned offset on a helper thread while the next one
fills. The file is opened normally and ``O_DIRECT`` switched on (``fcntl``) only when the first
buffer is full, so small files (metadata, ``common.pt``) are plain buffered writes; the tail of a
large file is written with ``O_DIRECT`` switched off again. Where ``O_DIRECT`` is refused the same
buffers are written through the cache.

Used only on local file systems known to handle it (:func:`direct_ok`: ext4, xfs); elsewhere (tmpfs,
NFS, parallel file systems, other systems than Linux) outputs are plain files.
``CKPTTOOL_DIRECT_WRITE=0`` turns it off, ``=1`` on wherever the kernel accepts it.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import sys
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

from ckpttool.io import helper

STAGE = 8 << 20
"""bytes of one staging buffer: each write of a full one is one aligned ``O_DIRECT`` write"""

_FILE_SYSTEMS = frozenset({"ext4", "xfs"})
"""where direct writes are used by default: local block file systems that take aligned direct
writes as they are (tmpfs gains nothing; NFS would make each write a synchronous round trip)"""

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_pool: list[mmap.mmap] = []  # staging buffers handed back, reused (fresh pages cost a fault each)
_pool_lock = threading.Lock()
_POOL_MAX = 4
DEPTH = 1
"""full buffers handed to the write thread before the writer waits for the oldest (a ring of
``DEPTH + 1`` buffers: the writer fills one while up to ``DEPTH`` are written). One is enough
here: a 1.2 GB reshard ran no faster with three in flight (1.72 s against 1.48 s, other runs of
the same script), and the device takes 8 MiB writes one at a time at ``cp``'s speed."""
_fs_types: dict[int, str | None] = {}  # st_dev -> file system type, from /proc/self/mountinfo


def _after_fork() -> None:
    global _pool_lock
    _pool_lock = threading.Lock()
    _pool.clear()  # (private mappings, copied on write: the child's are its own, but start afresh)


os.register_at_fork(after_in_child=_after_fork)


def _fs_type(dev: int) -> str | None:
    """The type of the file system mounted from device ``dev`` (Linux's mountinfo), or None."""
    if dev not in _fs_types:
        found = None
        want = f"{os.major(dev)}:{os.minor(dev)}"
        try:
            with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    fields = line.split()
                    if len(fields) > 2 and fields[2] == want and " - " in line:
                        found = line.split(" - ", 1)[1].split()[0]
                        break
        except OSError:
            found = None
        _fs_types[dev] = found
    return _fs_types[dev]


def direct_ok(directory: str | os.PathLike[str]) -> bool:
    """Whether outputs in ``directory`` are written with :class:`DirectFile`."""
    forced = os.environ.get("CKPTTOOL_DIRECT_WRITE", "").strip()
    if forced in {"0", "1"}:
        return forced == "1" and bool(_O_DIRECT)
    if not _O_DIRECT or not sys.platform.startswith("linux"):
        return False
    try:
        dev = os.stat(directory).st_dev
    except OSError:
        return False
    return _fs_type(dev) in _FILE_SYSTEMS


def _take() -> mmap.mmap:
    with _pool_lock:
        if _pool:
            return _pool.pop()
    # anonymous: page-aligned, as O_DIRECT needs; private, so a forked child never writes into a
    # parent's buffer (the default anonymous mapping is shared across fork)
    return mmap.mmap(-1, STAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def _give(buf: mmap.mmap) -> None:
    with _pool_lock:
        if len(_pool) < _POOL_MAX:
            _pool.append(buf)
            return
    buf.close()


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(f"write returned {n}")
        view, offset = view[n:], offset + n


class DirectFile:
    """A binary file written front to back (``write``, ``tell``) through staging buffers, each
    full one written with ``O_DIRECT`` on a helper thread while the next ones fill (up to
    :data:`DEPTH` in flight); ``flush`` and ``close`` write the rest."""

    def __init__(self, target: str | os.PathLike[str] | int) -> None:
        """Opens ``target`` for writing (created or truncated), or takes over a descriptor opened
        for writing at its start (closed with the file)."""
        if isinstance(target, int):
            self.fd = target
        else:
            self.fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o666)
        self._flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        self.direct = False  # O_DIRECT on (from the first full buffer, where the kernel takes it)
        self._tried = False
        self._bufs: list[mmap.mmap] = []
        self._views: list[memoryview] = []
        self._fill = 0
        self._offset = 0  # bytes handed to the kernel (written, or in flight)
        self._pending: deque[Future[None]] = deque()  # writes in flight, oldest first
        self.closed = False

    @property
    def writeback(self) -> bool:
        """Whether :func:`ckpttool.io.start_writeback` has anything to do: not before the first
        buffer is written, nor for direct writes."""
        return self._tried and not self.direct

    def fileno(self) -> int:
        return self.fd

    def tell(self) -> int:
        return self._offset + self._fill

    def write(self, data: Any) -> int:
        if self.closed:
            raise ValueError(f"write to a closed file (descriptor {self.fd})")
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")  # (C-contiguous, as every writer's buffer is)
        size = len(view)
        if not self._views:
            self._bufs = [_take() for _ in range(DEPTH + 1)]
            self._views = [memoryview(b) for b in self._bufs]
        while len(view):
            n = min(len(view), STAGE - self._fill)
            self._views[0][self._fill : self._fill + n] = view[:n]
            self._fill += n
            view = view[n:]
            if self._fill == STAGE:
                self._submit()
        return size

    def _submit(self) -> None:
        """Write the full staging buffer (on the helper thread) and fill the next one, waiting for
        the oldest write only when ``DEPTH`` are in flight (its error, if any, raised here)."""
        self._drain(DEPTH - 1)
        if not self._tried:
            self._tried = True
            try:
                fcntl.fcntl(self.fd, fcntl.F_SETFL, self._flags | _O_DIRECT)
                self.direct = True
            except OSError:  # the file system refuses it: the same writes, through the cache
                self.direct = False
        self._pending.append(helper("write").submit(_pwrite_all, self.fd, self._views[0], self._offset))
        self._offset += STAGE
        self._fill = 0
        self._views.append(self._views.pop(0))  # the next one: not in flight (at most DEPTH are)

    def _drain(self, keep: int) -> None:
        """Wait until at most ``keep`` writes are in flight (their errors raised here)."""
        while len(self._pending) > keep:
            self._pending[0].result()  # dropped only once done: an interrupt here leaves it to _abandon
            self._pending.popleft()

    def flush(self) -> None:
        """Hand every byte written to the kernel (then ``os.fsync`` makes them durable). What is
        staged is not a whole buffer, so it goes through the cache, and so does what follows."""
        self._drain(0)
        if self._fill:
            self._tried = True
            if self.direct:  # an unaligned length, and the offsets after it unaligned too
                fcntl.fcntl(self.fd, fcntl.F_SETFL, self._flags)
                self.direct = False
            _pwrite_all(self.fd, self._views[0][: self._fill], self._offset)
            self._offset += self._fill
            self._fill = 0

    def close(self) -> None:
        """Write what is staged and close; the buffers go back to the pool either way."""
        if self.closed:
            return
        self.closed = True
        try:
            self.flush()
        finally:
            self._abandon()

    def _abandon(self) -> None:
        try:
            while self._pending:  # not handed back while the kernel still reads them
                with contextlib.suppress(BaseException):  # (its error, or a second Ctrl-C: wait on)
                    self._pending[0].result()
                if self._pending[0].done():
                    self._pending.popleft()
        finally:
            for v in self._views:
                v.release()
            for b in self._bufs:
                _give(b)
            self._views, self._bufs = [], []
            fd, self.fd = self.fd, -1
            if fd >= 0:
                os.close(fd)

    def __enter__(self) -> DirectFile:
        return self

    def __exit__(self, kind: Any, *_: Any) -> None:
        if kind is None:
            self.close()
        else:  # a failed write: the file is abandoned with its staging directory
            self.closed = True
            self._abandon()


@contextlib.contextmanager
def open_direct(path: str | os.PathLike[str]) -> Iterator[Any]:
    """``open(path, "wb")``, or a :class:`DirectFile` where :func:`direct_ok` says so."""
    if direct_ok(os.path.dirname(os.path.abspath(path)) or "."):
        with DirectFile(path) as fh:
            yield fh
    else:
        with open(path, "wb") as fh:
            yield fh


__all__ = ["STAGE", "DirectFile", "direct_ok", "open_direct"]
