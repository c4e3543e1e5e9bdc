"""Writing the zip container of a ``torch.save`` file without torch, byte for byte as torch does.

torch's ``PyTorchStreamWriter`` (miniz underneath) stores every record uncompressed under
``<archive>/``, pads each local header with an ``FB`` extra field so the record's data starts on a
64-byte boundary, follows the data with a data descriptor (CRC-32 and sizes), and ends the file with
a central directory, a zip64 end record and locator (always) and the classic end record. Sizes and
offsets that do not fit 32 bits go to zip64 extra fields.

The last record, ``.data/serialization_id``, is 40 decimal digits: a combined hash of the record
names (libstdc++'s ``std::hash<std::string>``, combined in the iteration order of the
``std::unordered_set`` torch keeps them in) followed by a combined hash of the records' CRC-32s.
Both are reproduced here, so a file written by :class:`ZipWriter` equals what ``torch.save`` writes
for the same records, which the tests check. CRC-32 comes from :mod:`ckpttool._crc` (ISA-L), computed for big records on
a helper thread while the record is written; the disk is told to start writing big records at once
(:func:`ckpttool.io.start_writeback`).
"""

from __future__ import annotations

import bisect
import struct
from collections.abc import Iterator
from typing import Any, BinaryIO

import xxhash

from ckpttool._crc import crc32
from ckpttool.hashing import SpanFeeder
from ckpttool.io import helper, start_writeback

_M64 = (1 << 64) - 1
_MUL = 0xC6A4A7935BD1E995
_U32 = 0xFFFFFFFF
_ALIGN = 64
_LOCAL = struct.Struct("<IHHHHHIIIHH")  # local file header, 30 bytes
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory header, 46 bytes
_ZIP64_END = struct.Struct("<IQHHIIQQQQ")  # zip64 end of central directory record, 56 bytes
_ZIP64_LOCATOR = struct.Struct("<IIQI")
_END = struct.Struct("<IHHHHIIH")


def std_hash(data: bytes, seed: int = 0xC70F6907) -> int:
    """libstdc++'s ``std::_Hash_bytes`` on 64-bit (what ``std::hash<std::string>`` returns)."""

    def mix(v: int) -> int:
        return v ^ (v >> 47)

    n = len(data)
    whole = n & ~7
    h = (seed ^ (n * _MUL)) & _M64
    for i in range(0, whole, 8):
        h ^= (mix((int.from_bytes(data[i : i + 8], "little") * _MUL) & _M64) * _MUL) & _M64
        h = (h * _MUL) & _M64
    if n & 7:
        h ^= int.from_bytes(data[whole:], "little")
        h = (h * _MUL) & _M64
    return mix((mix(h) * _MUL) & _M64)


def hash_combine(seed: int, value: int) -> int:
    """``c10::hash_combine`` on 64-bit ``size_t``."""
    return (seed ^ ((value + 0x9E3779B9 + (seed << 6) + (seed >> 2)) & _M64)) & _M64


# libstdc++'s _Prime_rehash_policy: bucket counts for small sizes, then the first entries of
# its prime list (enough for 10**7 records).
_FAST_BUCKETS = (2, 2, 2, 3, 5, 5, 7, 7, 11, 11, 11, 11, 13, 13)
_PRIMES = (
    13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89, 97, 103, 109, 113,
    127, 137, 139, 149, 157, 167, 179, 193, 199, 211, 227, 241, 257, 277, 293, 313, 337, 359, 383,
    409, 439, 467, 503, 541, 577, 619, 661, 709, 761, 823, 887, 953, 1031, 1109, 1193, 1289, 1381,
    1493, 1613, 1741, 1879, 2029, 2179, 2357, 2549, 2753, 2971, 3209, 3469, 3739, 4027, 4349, 4703,
    5087, 5503, 5953, 6427, 6949, 7517, 8123, 8783, 9497, 10273, 11113, 12011, 12983, 14033, 15173,
    16411, 17749, 19183, 20753, 22447, 24281, 26267, 28411, 30727, 33223, 35933, 38873, 42043,
    45481, 49201, 53201, 57557, 62233, 67307, 72817, 78779, 85229, 92203, 99733, 107897, 116731,
    126271, 136607, 147793, 159871, 172933, 187091, 202409, 218971, 236897, 256279, 277261,
    299951, 324503, 351061, 379787, 410857, 444487, 480881, 520241, 562841, 608903, 658753,
    712697, 771049, 834181, 902483, 976369, 1056323, 1142821, 1236397, 1337629, 1447153,
    1565659, 1693859, 1832561, 1982627, 2144977, 2320627, 2510653, 2716249, 2938679, 3179303,
    3439651, 3721303, 4026031, 4355707, 4712381, 5098259, 5515729, 5967347, 6456007, 6984629,
    7556579, 8175383, 8844859, 9569143, 10352717,
)  # fmt: skip


class NameOrder:
    """The iteration order of a libstdc++ ``std::unordered_set<std::string>`` (default
    constructed, names inserted in order): a singly linked list in which a name joins the front of
    its bucket's run, or the front of the list when its bucket is empty; rehashing rebuilds it."""

    _BEFORE = -1

    def __init__(self) -> None:
        self.codes: list[int] = []
        self.next: list[int] = []
        self.head = -1
        self.buckets: dict[int, int] = {}  # bucket -> the node before its first node (or _BEFORE)
        self.nbuckets = 1
        self.next_resize = 0
        self.seen: set[bytes] = set()

    def _bucket_count(self, n: int) -> int:
        if n < len(_FAST_BUCKETS):
            count = 1 if n == 0 else _FAST_BUCKETS[n]
        else:
            i = bisect.bisect_left(_PRIMES, n)
            if i == len(_PRIMES):
                raise ValueError("too many zip records to reproduce torch's serialization id")
            count = _PRIMES[i]
        self.next_resize = count
        return count

    def _link_after(self, before: int, node: int) -> None:
        if before == self._BEFORE:
            self.next[node], self.head = self.head, node
        else:
            self.next[node], self.next[before] = self.next[before], node

    def _rehash(self, n: int) -> None:
        node, self.head, self.buckets = self.head, -1, {}
        front_bucket = -1
        while node != -1:
            following = self.next[node]
            b = self.codes[node] % n
            if b not in self.buckets:
                self._link_after(self._BEFORE, node)
                self.buckets[b] = self._BEFORE
                if self.next[node] != -1:
                    self.buckets[front_bucket] = node
                front_bucket = b
            else:
                self._link_after(self.buckets[b], node)
            node = following
        self.nbuckets = n

    def add(self, name: bytes) -> None:
        if name in self.seen:
            return
        self.seen.add(name)
        count = len(self.codes)
        if count + 1 > self.next_resize:
            wanted = max(count + 1, 0 if self.next_resize else 11)
            if wanted >= self.nbuckets:
                self._rehash(self._bucket_count(max(wanted + 1, self.nbuckets * 2)))
            else:
                self.next_resize = self.nbuckets
        node = count
        code = std_hash(name)
        self.codes.append(code)
        self.next.append(-1)
        b = code % self.nbuckets
        if b in self.buckets:
            self._link_after(self.buckets[b], node)
        else:
            self._link_after(self._BEFORE, node)
            if self.next[node] != -1:
                self.buckets[self.codes[self.next[node]] % self.nbuckets] = node
            self.buckets[b] = self._BEFORE

    def combined(self) -> int:
        h, node = 0, self.head
        while node != -1:
            h = hash_combine(h, self.codes[node])
            node = self.next[node]
        return h


PARALLEL = 1 << 20
"""record data from this size on: checksums on a helper thread beside the write"""
WRITE_CHUNK = 32 << 20
"""record data is written (and its write-back started) this much at a time"""


def _checksums(chunk: Any, crc: int, feeds: list[tuple[Any, Any]]) -> int:
    """The CRC-32 of ``chunk`` continued from ``crc``; each ``(hasher, bytes)`` of ``feeds`` fed too."""
    for h, data in feeds:
        h.update(data)
    return crc32(chunk, crc)


class _Digests:
    """The xxh3-128 digests a :class:`ckpttool.hashing.HashingFile` takes of one record's data: of
    each ``(offset, length)`` of ``spans`` (byte ranges of the data: the parameters of a ZeRO
    partition), or of the whole data when there are none."""

    def __init__(self, size: int, spans: Any) -> None:
        ranges = sorted((lo, n) for lo, n in spans if n > 0) if spans else [(0, size)]
        self.ranges = [(lo, n, xxhash.xxh3_128()) for lo, n in ranges]
        self.feeds = SpanFeeder(self.ranges).feeds


class ZipWriter:
    """Writes one ``torch.save`` archive into ``fh`` from its current position; offsets inside the
    archive count from there (as in a DCP ``.distcp`` file, which holds one archive per item)."""

    def __init__(self, fh: BinaryIO, archive: str = "archive") -> None:
        self.fh = fh
        self.prefix = archive.encode() + b"/"
        self.pos = 0
        self.central: list[bytes] = []
        self.names = NameOrder()
        self.crcs = 0

    def _put(self, data: Any) -> None:
        self.fh.write(data)
        self.pos += len(data) if isinstance(data, bytes) else memoryview(data).nbytes

    def write_record(self, name: str, data: Any, spans: Any = None) -> None:
        """Store ``data`` (bytes or any C-contiguous buffer) as ``<archive>/<name>``."""
        view = memoryview(data).cast("B") if not isinstance(data, bytes) else data
        self.write_record_parts(name, len(view), iter((view,)), spans)

    def write_record_parts(self, name: str, size: int, parts: Iterator[Any], spans: Any = None) -> None:
        """Store ``size`` bytes, given as consecutive buffers ``parts``, as ``<archive>/<name>``: a
        record written piece by piece (the CRC-32 goes in the data descriptor that follows it).
        Into a file that takes span digests (``add_span``: a :class:`ckpttool.hashing.HashingFile`),
        the xxh3-128 of the record's data goes too, and of each ``(offset, length)`` of ``spans``
        (byte ranges of the data: the parameters of a ZeRO partition)."""
        full = self.prefix + name.encode()
        if name.encode() in self.names.seen:
            raise ValueError(f"zip record {name!r} written twice")
        at = self.pos
        big_size, big_at = size >= _U32, at >= _U32
        zip64 = b""
        if big_size or big_at:  # miniz: the local header's sizes stay 0; its zip64 field has (size, 0)
            fields = (struct.pack("<QQ", size, 0) if big_size else b"") + (struct.pack("<Q", at) if big_at else b"")
            zip64 = struct.pack("<HH", 1, len(fields)) + fields
        start = at + _LOCAL.size + len(full) + len(zip64) + 4
        pad = -start % _ALIGN
        extra = zip64 + b"FB" + struct.pack("<H", pad) + b"Z" * pad
        flags = 0x0808 if size else 0x0800  # bit 3: a data descriptor follows (not for empty records)
        self._put(_LOCAL.pack(0x04034B50, 0, flags, 0, 0, 0, 0, 0, 0, len(full), len(extra)) + full + extra)
        crc, written, head = 0, 0, b""
        add_span = getattr(self.fh, "add_span", None) if size else None  # a HashingFile: digests too
        digests = _Digests(size, spans) if add_span is not None else None
        data_at = self.fh.tell() if add_span is not None else 0
        for part in parts:
            view = part if isinstance(part, bytes) else memoryview(part).cast("B")
            if len(head) < 8:
                head += bytes(view[: 8 - len(head)])
            done = written  # (``at`` is the local header's offset, for the central directory)
            written += len(view)
            if written > size:
                break
            if len(view) < PARALLEL:
                crc = _checksums(view, crc, digests.feeds(view, done) if digests else [])
                self._put(view)
                continue
            for lo in range(0, len(view), WRITE_CHUNK):  # checksums on a helper thread while this one writes
                chunk = view[lo : lo + WRITE_CHUNK]
                feeds = digests.feeds(chunk, done + lo) if digests else []
                pending = helper("crc").submit(_checksums, chunk, crc, feeds)  # (all release the GIL)
                try:
                    self._put(chunk)
                finally:  # not left reading a buffer its owner reuses once this returns
                    crc = pending.result()
                start_writeback(self.fh)
        if written != size:
            raise ValueError(f"zip record {name!r}: {written} bytes given, {size} announced")
        if add_span is not None and digests is not None:
            for lo, n, h in digests.ranges:
                add_span(data_at + lo, n, h.hexdigest())
        if size:
            if big_size or big_at:
                self._put(struct.pack("<IIQQ", 0x08074B50, crc, size, size))
            else:
                self._put(struct.pack("<IIII", 0x08074B50, crc, size, size))
        cfields = (struct.pack("<QQ", size, size) if big_size else b"") + (struct.pack("<Q", at) if big_at else b"")
        cextra = struct.pack("<HH", 1, len(cfields)) + cfields if cfields else b""
        csize = _U32 if big_size else size
        self.central.append(
            _CENTRAL.pack(
                0x02014B50, 0, 0, flags, 0, 0, 0, crc, csize, csize, len(full), len(cextra), 0, 0, 0, 0,
                _U32 if big_at else at,
            )
            + full
            + cextra
        )  # fmt: skip
        self.names.add(name.encode())
        # torch folds in a "CRC" for every write of 8 bytes or more that starts with the data
        # descriptor's signature: its own descriptors, and a record whose data happens to start so
        if size >= 8 and head[:4] == b"PK\x07\x08":
            self.crcs = hash_combine(self.crcs, int.from_bytes(head[4:8], "little"))
        if size:  # torch combines the CRC-32s of non-empty records only
            self.crcs = hash_combine(self.crcs, crc)

    def finish(self) -> int:
        """Write ``version``, the serialization id and the end records; returns the archive's length."""
        self.write_record("version", b"3\n")
        ident = f"{self.names.combined():020d}{self.crcs:020d}".encode()
        self.write_record(".data/serialization_id", ident)
        cd_at = self.pos
        directory = b"".join(self.central)
        self._put(directory)
        end64_at = self.pos
        n = len(self.central)
        self._put(_ZIP64_END.pack(0x06064B50, 44, 0x031E, 45, 0, 0, n, n, len(directory), cd_at))
        self._put(_ZIP64_LOCATOR.pack(0x07064B50, 0, end64_at, 1))
        self._put(
            _END.pack(0x06054B50, 0, 0, min(n, 0xFFFF), min(n, 0xFFFF), min(len(directory), _U32), min(cd_at, _U32), 0)
        )
        return self.pos


__all__ = ["PARALLEL", "WRITE_CHUNK", "NameOrder", "ZipWriter", "hash_combine", "std_hash"]
