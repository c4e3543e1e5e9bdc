"""Checksums of files and of pieces, computed in one pass over each file.

Every file is read once, front to back, in chunks of ``CHUNK`` bytes read straight into a buffer.
Each chunk feeds the file's hasher and the hashers of the pieces whose raw bytes it
overlaps, so sealing a checkpoint costs one read of its bytes. Files are spread over a pool of
threads: reads, xxh3, SHA-256 and CRC-32 all release the GIL. Where the pool has more threads than
files (a checkpoint of a few large files on a machine of many cores), a large file gets several
(:func:`_hash_in_lanes`): threads reading its chunks ahead into a ring of buffers, one feeding them
in order to the file's hasher, others to the pieces' hashers, split between them.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import xxhash

from ckpttool import io as ckio
from ckpttool._crc import crc32
from ckpttool._directwrite import open_direct

Algo = Literal["xxh3-128", "sha256", "crc32"]
CHUNK = 1 << 20
LANE_MIN = 64 << 20
"""A file this large or larger is hashed by several threads where the pool has threads to spare."""
MAX_LANES = 6
"""Threads for one file at most: one core's xxh3 of the file's digest, which no other can share,
is the limit before that."""


class _Hasher(Protocol):
    def update(self, data: Any, /) -> None: ...

    def hexdigest(self) -> str: ...


class _Crc32:
    """The CRC-32 that zip archives store, as a hasher; hexdigest is 8 hex digits."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any, /) -> None:
        self.value = crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def new_hasher(algo: Algo) -> _Hasher:
    if algo == "xxh3-128":
        return xxhash.xxh3_128()
    if algo == "sha256":
        return hashlib.sha256()
    if algo == "crc32":
        return _Crc32()
    raise ValueError(f"unknown hash {algo!r}")


@dataclass(frozen=True, slots=True)
class Span:
    """Bytes ``[offset, offset + length)`` of one file, hashed under ``key`` (with ``algo``, or
    the algorithm of the whole pass)."""

    key: Any
    offset: int
    length: int
    algo: Algo | None = None


@dataclass(slots=True)
class FileDigest:
    path: str
    size: int
    digest: str | None
    """None when the file could not be read"""
    error: str | None = None
    changed: bool = False
    """the file changed while it was read (its size or modification time; bytes missing short
    of the size it had when opened): a writer is at work on it, no digest is taken"""


class Cancelled(Exception):
    """The caller stopped a hashing pass it no longer needs."""


class SpanFeeder:
    """Hashers of byte ranges of a stream that is fed in order: :meth:`feeds` says which part of
    each next stretch of bytes goes to which range's hasher. Ranges may overlap."""

    def __init__(self, ranges: Iterable[tuple[int, int, Any]]) -> None:
        """``ranges``: (offset, length, hasher)."""
        self.ranges = sorted(ranges, key=lambda r: r[0])
        self.active: list[tuple[int, int, Any]] = []
        self.next = 0

    def feeds(self, view: Any, pos: int) -> list[tuple[Any, Any]]:
        """(hasher, part of ``view``) for ``view``, the stream's bytes from ``pos`` on (each call
        continuing where the last ended)."""
        end = pos + len(view)
        while self.next < len(self.ranges) and self.ranges[self.next][0] < end:
            self.active.append(self.ranges[self.next])
            self.next += 1
        out, still = [], []
        for r in self.active:
            lo, hi = max(r[0], pos), min(r[0] + r[1], end)
            if lo < hi:
                out.append((r[2], view[lo - pos : hi - pos]))
            if r[0] + r[1] > end:
                still.append(r)
        self.active = still
        return out


def hash_file(
    root: Path,
    rel: str,
    spans: list[Span],
    algo: Algo,
    progress: Callable[[int], None] | None = None,
    cancel: threading.Event | None = None,
    lanes: int = 1,
) -> tuple[FileDigest, dict[Any, str]]:
    """Digest of a whole file and of each span inside it, reading the file once. Raises
    Cancelled soon after ``cancel`` is set. ``lanes``: threads it may use (this one included),
    given to a file of ``LANE_MIN`` bytes or more (:func:`_hash_in_lanes`)."""
    path = root / rel
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        return FileDigest(rel, -1, None, exc.strerror), {}
    try:
        opened = os.fstat(fd)
        size = opened.st_size
        whole = new_hasher(algo)
        hashers = {s.key: new_hasher(s.algo or algo) for s in spans}
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        if lanes > 1 and size >= LANE_MIN:
            pos = _hash_in_lanes(fd, size, whole, spans, hashers, min(lanes, MAX_LANES), rel, progress, cancel)
        else:
            pos = _hash_in_one(fd, size, whole, spans, hashers, rel, progress, cancel)
        now = os.fstat(fd)
        if pos < size or (now.st_size, now.st_mtime_ns) != (size, opened.st_mtime_ns):
            how = (
                f"it ended after {pos:,} of the {size:,} bytes it had when opened"
                if pos < size
                else f"{size:,} bytes when opened, {now.st_size:,} once read"
                if now.st_size != size
                else "written to while it was read (its modification time moved)"
            )
            return FileDigest(rel, -1, None, how, changed=True), {}
        digests = {s.key: hashers[s.key].hexdigest() for s in spans if s.offset + s.length <= size}
        return FileDigest(rel, size, whole.hexdigest()), digests
    except (OSError, ValueError) as exc:
        return FileDigest(rel, -1, None, str(exc)), {}
    finally:
        os.close(fd)


def _hash_in_one(
    fd: int,
    size: int,
    whole: _Hasher,
    spans: list[Span],
    hashers: dict[Any, _Hasher],
    rel: str,
    progress: Callable[[int], None] | None,
    cancel: threading.Event | None,
) -> int:
    """Reads the file into one buffer, feeding every hasher; returns the bytes read."""
    feed = _feeding(spans, hashers)
    buf = bytearray(min(CHUNK, max(size, 1)))
    view = memoryview(buf)
    pos = 0
    while pos < size:
        if cancel is not None and cancel.is_set():
            raise Cancelled(rel)
        n = ckio.preadinto(fd, view[: min(len(buf), size - pos)], pos)
        if n == 0:
            break
        chunk = view[:n]
        whole.update(chunk)
        feed(chunk, pos)
        if progress is not None:
            progress(n)
        pos += n
    return pos


def _span_groups(spans: list[Span], groups: int) -> list[list[Span]]:
    """``spans`` split into at most ``groups`` lists of about the same cost to hash (a CRC-32 costs
    about half an xxh3), each in file order."""
    out: list[list[Span]] = [[] for _ in range(max(1, min(groups, len(spans))))]
    load = [0.0] * len(out)
    for s in sorted(spans, key=lambda s: -s.length):
        k = load.index(min(load))
        out[k].append(s)
        load[k] += s.length * (0.5 if s.algo == "crc32" else 1.0)
    return [sorted(g, key=lambda s: s.offset) for g in out if g]


class _Ring:
    """Chunks of one file read ahead into ``slots`` buffers by reader threads, each chunk handed to
    every consumer in turn; a buffer is read into again once every consumer is done with it.
    Chunk ``i`` lies in buffer ``i % slots``; reader ``j`` of ``r`` reads chunks ``j, j + r, ...``."""

    def __init__(self, fd: int, size: int, chunk: int, slots: int, consumers: int) -> None:
        self.fd, self.size, self.chunk, self.consumers = fd, size, chunk, consumers
        self.chunks = -(-size // chunk)
        self.bufs = [memoryview(bytearray(chunk)) for _ in range(min(slots, self.chunks))]
        n = len(self.bufs)
        self.loaded = [-1] * n  # the chunk each buffer holds, once read
        self.length = [0] * n
        self.left = [0] * n  # consumers not done with it
        self.released = [s - n for s in range(n)]  # the last chunk each buffer was done with
        self.cv = threading.Condition()
        self.end = size  # where the file turned out to end, if short of size
        self.failed: BaseException | None = None

    def _free(self, i: int, s: int) -> bool:  # buffer s may take chunk i, or chunk i lies past the file's end
        return self.released[s] == i - len(self.bufs) or i * self.chunk >= self.end

    def _loaded(self, i: int, s: int) -> bool:  # chunk i is in buffer s, or lies past the file's end
        return self.loaded[s] == i or i * self.chunk >= self.end

    def _wait(self, ready: Callable[[int, int], bool], i: int, s: int, cancel: threading.Event | None) -> bool:
        """Waits (holding ``cv``) until ``ready(i, s)``; False once the pass failed or was cancelled."""
        while True:
            if cancel is not None and cancel.is_set() and self.failed is None:
                self.failed = Cancelled()
                self.cv.notify_all()
            if self.failed is not None:
                return False
            if ready(i, s):
                return True
            self.cv.wait(0.05)

    def fail(self, exc: BaseException) -> None:
        with self.cv:
            if self.failed is None:
                self.failed = exc
            self.cv.notify_all()

    def read(self, first: int, step: int, cancel: threading.Event | None) -> None:
        n = len(self.bufs)
        try:
            for i in range(first, self.chunks, step):
                s = i % n
                with self.cv:
                    if not self._wait(self._free, i, s, cancel) or i * self.chunk >= self.end:
                        return
                want = min(self.chunk, self.size - i * self.chunk)
                got = ckio.preadinto(self.fd, self.bufs[s][:want], i * self.chunk)
                with self.cv:
                    if got < want:  # the file ended early: no chunk past this one is read
                        self.end = min(self.end, i * self.chunk + got)
                    self.loaded[s], self.length[s], self.left[s] = i, got, self.consumers
                    self.cv.notify_all()
        except BaseException as exc:
            self.fail(exc)

    def consume(self, feed: Callable[[memoryview, int], None], cancel: threading.Event | None) -> None:
        """Hands every chunk, in order, to ``feed(bytes, offset)``; stops at the file's end."""
        n = len(self.bufs)
        try:
            for i in range(self.chunks):
                s = i % n
                with self.cv:
                    if not self._wait(self._loaded, i, s, cancel):
                        return
                    if self.loaded[s] != i:  # (the file ended before this chunk)
                        return
                    length = self.length[s]
                if length:
                    feed(self.bufs[s][:length], i * self.chunk)
                with self.cv:
                    self.left[s] -= 1
                    if self.left[s] == 0:
                        self.released[s] = i
                        self.cv.notify_all()
        except BaseException as exc:
            self.fail(exc)


def _feeding(spans: list[Span], hashers: dict[Any, _Hasher]) -> Callable[[memoryview, int], None]:
    """A feed of a file's bytes, in order, to the hashers of ``spans`` (by key in ``hashers``)."""
    feeds = SpanFeeder((s.offset, s.length, hashers[s.key]) for s in spans).feeds

    def feed(data: memoryview, at: int) -> None:
        for h, part in feeds(data, at):
            h.update(part)

    return feed


def _hash_in_lanes(
    fd: int,
    size: int,
    whole: _Hasher,
    spans: list[Span],
    hashers: dict[Any, _Hasher],
    lanes: int,
    rel: str,
    progress: Callable[[int], None] | None,
    cancel: threading.Event | None,
) -> int:
    """:func:`_hash_in_one` with ``lanes`` threads, this one feeding the file's hasher: of the
    others, half read ahead and the rest feed the spans' hashers, the spans split between them by
    bytes (with two lanes: one reads, this one feeds the spans too). Returns the bytes read (short
    of ``size`` where the file ended early)."""
    groups = _span_groups(spans, (lanes - 1) // 2) if spans and lanes > 2 else []
    readers = max(1, lanes - 1 - len(groups))
    ring = _Ring(fd, size, CHUNK, 2 * (readers + 1), 1 + len(groups))
    feed_spans = _feeding(spans, hashers) if spans and not groups else None

    def feed_whole(data: memoryview, at: int) -> None:
        whole.update(data)
        if feed_spans is not None:
            feed_spans(data, at)
        if progress is not None:
            progress(len(data))

    threads = [threading.Thread(target=ring.read, args=(j, readers, cancel), daemon=True) for j in range(readers)]
    threads += [threading.Thread(target=ring.consume, args=(_feeding(g, hashers), cancel), daemon=True) for g in groups]
    started = []
    try:
        for t in threads:
            t.start()
            started.append(t)
    except BaseException as exc:  # (can't start new thread: those started are told to stop)
        ring.fail(exc)
        for t in started:
            t.join()
        raise
    ring.consume(feed_whole, cancel)
    for t in threads:
        t.join()
    if isinstance(ring.failed, Cancelled):
        raise Cancelled(rel)
    if ring.failed is not None:
        raise ring.failed
    return ring.end


@dataclass(slots=True)
class Written:
    """What a writer hashed as it wrote a file (see :func:`open_output`): its size, the xxh3-128
    digest of all its bytes, and digests of spans in it, by ``(offset, length)``."""

    size: int
    digest: str
    spans: dict[tuple[int, int], str]


class HashingFile:
    """A binary file being written from its start, front to back, that hashes (xxh3-128) every byte
    written and keeps the digests of spans its writer reports (``add_span``): the seal of a
    reshard output then reads back none of the files written so (:func:`ckpttool.seal.seal`'s
    ``known``)."""

    def __init__(self, fh: Any) -> None:
        self.fh = fh
        self.whole = xxhash.xxh3_128()
        self.size = 0
        self.spans: dict[tuple[int, int], str] = {}

    def write(self, data: Any) -> int:
        n = self.fh.write(data)
        self.whole.update(data)
        self.size += len(data) if isinstance(data, bytes) else memoryview(data).nbytes
        return int(n)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self.fh.flush()

    @property
    def writeback(self) -> bool:
        """Whether the file's writes go through the page cache (see :func:`ckpttool.io.start_writeback`)."""
        return bool(getattr(self.fh, "writeback", True))

    def fileno(self) -> int:
        return int(self.fh.fileno())

    def add_span(self, offset: int, length: int, digest: str) -> None:
        """The xxh3-128 digest of bytes ``[offset, offset + length)``, already written."""
        self.spans[(offset, length)] = digest

    def written(self) -> Written:
        return Written(self.size, self.whole.hexdigest(), self.spans)


_WRITTEN: dict[str, Any] = {}
_WRITTEN_LOCK = threading.Lock()


@contextlib.contextmanager
def collecting_written() -> Iterator[dict[str, Written]]:
    """While active, files written through :func:`open_output` in this process are hashed as they
    are written; the dict maps each one's absolute path to what was hashed."""
    found: dict[str, Written] = {}
    with _WRITTEN_LOCK:
        previous = _WRITTEN.get("into")
        _WRITTEN["into"] = found
    try:
        yield found
    finally:
        with _WRITTEN_LOCK:
            _WRITTEN["into"] = previous


@contextlib.contextmanager
def open_output(path: str | os.PathLike[str]) -> Iterator[Any]:
    """``open(path, "wb")`` (written around the page cache where :func:`ckpttool._directwrite.direct_ok`
    says so); while :func:`collecting_written` is active, wrapped in a
    :class:`HashingFile` whose digests are recorded once the file is complete."""
    into = _WRITTEN.get("into")
    with open_direct(path) as fh:
        if into is None:
            yield fh
            return
        hashed = HashingFile(fh)
        yield hashed
    with _WRITTEN_LOCK:
        into[os.path.abspath(path)] = hashed.written()


def hash_files(
    root: Path,
    files: Iterable[str],
    spans: dict[str, list[Span]],
    algo: Algo = "xxh3-128",
    *,
    workers: int | None = None,
    progress: Callable[[int], None] | None = None,
    cancel: threading.Event | None = None,
) -> tuple[dict[str, FileDigest], dict[Any, str]]:
    """Hash ``files`` (relative to ``root``) and the spans inside them, files spread over threads."""
    files = list(files)
    workers = workers or default_workers()
    file_digests: dict[str, FileDigest] = {}
    span_digests: dict[Any, str] = {}
    sizes = {rel: _size(root / rel) for rel in files}
    lanes = lanes_for(sizes.values(), workers)
    with ThreadPoolExecutor(max_workers=min(workers, max(1, len(files)))) as pool:
        order = sorted(files, key=lambda r: -sizes[r])  # largest first: the workers finish together
        futures = [
            pool.submit(hash_file, root, rel, spans.get(rel, []), algo, progress, cancel, lanes) for rel in order
        ]
        for fut in futures:
            fd, sd = fut.result()
            file_digests[fd.path] = fd
            span_digests.update(sd)
    return file_digests, span_digests


def default_workers() -> int:
    """Threads of a hashing pass: one a core, between 2 and 8 (more ran slower on 16 cores: the
    memory's bandwidth is spent by then; docs/benchmarks.md)."""
    return min(8, max(2, os.cpu_count() or 2))


def lanes_for(sizes: Iterable[int], workers: int) -> int:
    """Threads that each file of ``LANE_MIN`` bytes or more may take when ``workers`` threads hash
    files of these ``sizes``: those beyond one a file, shared evenly by the large files."""
    sizes = list(sizes)
    large = sum(1 for n in sizes if n >= LANE_MIN)
    return max(1, (workers - (len(sizes) - large)) // large) if large else 1


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def hash_bytes(data: Any, algo: Algo = "xxh3-128") -> str:
    h = new_hasher(algo)
    h.update(data)
    return h.hexdigest()
