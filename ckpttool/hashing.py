"""Checksums of files and of pieces, computed in one pass over each file.

Every file is read once, sequentially, in chunks of ``CHUNK`` bytes read straight into one buffer.
Each chunk feeds the file's hasher and the hashers of the pieces whose raw bytes it
overlaps, so sealing a checkpoint costs one read of its bytes. Files are spread over a pool of
threads: reads release the GIL, and one core hashes (xxh3) far faster than storage delivers.
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
) -> tuple[FileDigest, dict[Any, str]]:
    """Digest of a whole file and of each span inside it, reading the file once. Raises
    Cancelled soon after ``cancel`` is set."""
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
        feeder = SpanFeeder((s.offset, s.length, hashers[s.key]) for s in spans)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
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
            for h, part in feeder.feeds(chunk, pos):
                h.update(part)
            if progress is not None:
                progress(n)
            pos += n
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
    workers = workers or min(8, max(2, os.cpu_count() or 2))
    file_digests: dict[str, FileDigest] = {}
    span_digests: dict[Any, str] = {}
    sizes = {rel: _size(root / rel) for rel in files}
    with ThreadPoolExecutor(max_workers=workers) as pool:
        order = sorted(files, key=lambda r: -sizes[r])  # largest first: the workers finish together
        futures = [pool.submit(hash_file, root, rel, spans.get(rel, []), algo, progress, cancel) for rel in order]
        for fut in futures:
            fd, sd = fut.result()
            file_digests[fd.path] = fd
            span_digests.update(sd)
    return file_digests, span_digests


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def hash_bytes(data: Any, algo: Algo = "xxh3-128") -> str:
    h = new_hasher(algo)
    h.update(data)
    return h.hexdigest()
