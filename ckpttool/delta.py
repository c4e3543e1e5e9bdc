"""Lossless delta (``delta create/apply/info``) and compression (``compress``/``decompress``).

Every file of the target checkpoint is cut into *tensor segments* (the raw bytes of each piece the
adapter can locate) and *other bytes* (zip headers, pickles, metadata, whole non-tensor files).
A tensor segment is coded with :mod:`ckpttool.codec` against the matching piece of the base
(same canonical item, same box, same size) when there is one, or alone; the other bytes of a file
are one zstd frame that uses the base file of the same name as its dictionary. ``apply`` rebuilds
every file, checks its xxh3-128 against the one stored, and publishes the output directory by one
rename, or nothing.

Container (one file): ``MAGIC``, the coded blobs, the header (JSON), the header's length (8 bytes,
little endian), ``MAGIC``.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import zstandard

from ckpttool import codec, registry
from ckpttool.dtypes import dtype as lookup_dtype
from ckpttool.errors import CkptError, CorruptFileError, UsageError
from ckpttool.hashing import hash_bytes
from ckpttool.io import atomic_output, fsync_dir, temp_dir_beside
from ckpttool.manifest import Manifest
from ckpttool.naming import canonical

MAGIC = b"CKPTDELTA1\n"
DELTA_KIND = "ckpttool.delta"
PACK_KIND = "ckpttool.compressed"


class DeltaMismatchError(CkptError):
    """The delta does not fit the base it is applied to, or does not reproduce its target (exit 1)."""

    exit_code = 1


@dataclass(slots=True)
class _Segment:
    offset: int
    length: int
    kind: str
    item: str | None = None
    width: int = 1
    floating: bool = False
    base: tuple[str, int] | None = None


def _file_layout(adapter: Any, manifest: Manifest) -> dict[str, list[_Segment]]:
    """Tensor segments of every file, by file, sorted by offset (non-overlapping)."""
    out: dict[str, list[_Segment]] = {}
    with adapter.reader(manifest) as reader:
        for item in manifest.items.values():
            if not item.is_tensor or item.dtype is None:
                continue
            dt = lookup_dtype(item.dtype)
            for piece in item.pieces:
                try:
                    span = reader.raw_span(piece, item)
                except CkptError:
                    span = None
                if span is None or span[1] == 0:
                    continue
                out.setdefault(piece.file, []).append(
                    _Segment(span[0], span[1], item.kind, item.name, dt.itemsize, dt.is_floating)
                )
    for rel, segs in out.items():
        segs.sort(key=lambda s: s.offset)
        kept: list[_Segment] = []
        for s in segs:  # shared storage can make two items view the same bytes: keep the first
            if not kept or s.offset >= kept[-1].offset + kept[-1].length:
                kept.append(s)
        out[rel] = kept
    return out


def _gaps(size: int, segments: list[_Segment]) -> list[tuple[int, int]]:
    gaps, pos = [], 0
    for s in segments:
        if s.offset > pos:
            gaps.append((pos, s.offset - pos))
        pos = s.offset + s.length
    if pos < size:
        gaps.append((pos, size - pos))
    return gaps


def _read(path: Path, ranges: list[tuple[int, int]]) -> bytes:
    with open(path, "rb") as fh:
        parts = []
        for off, n in ranges:
            fh.seek(off)
            parts.append(fh.read(n))
    return b"".join(parts)


class _Mapped:
    """Files mapped read-only for the duration of a create/apply: segments are zero-copy views."""

    def __init__(self) -> None:
        self._maps: dict[Path, Any] = {}

    def view(self, path: Path, offset: int, length: int) -> memoryview:
        mm = self._maps.get(path)
        if mm is None:
            with open(path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
            self._maps[path] = mm
        if offset + length > len(mm):
            raise CorruptFileError(f"{path}: {len(mm):,} bytes, needs {offset + length:,}: cut short", path=str(path))
        return memoryview(mm)[offset : offset + length]

    def digest(self, path: Path) -> str:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
        return hash_bytes(self.view(path, 0, size)) if size else hash_bytes(b"")

    def close(self) -> None:
        for mm in self._maps.values():
            if not isinstance(mm, bytes):
                try:
                    mm.close()
                except BufferError:  # a view is still alive somewhere; the mapping goes with it
                    pass
        self._maps.clear()


def _checkpoint_files(manifest: Manifest) -> list[tuple[str, int]]:
    return [(f.path, f.size) for f in manifest.files if f.role != "seal"]


def create(
    target: str | Path,
    output: str | Path,
    *,
    base: str | Path | None = None,
    workers: int | None = None,
    force: bool = False,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Code ``target`` (against ``base`` when given) into the container ``output``."""
    out_path = Path(output)
    if out_path.exists() and not force:
        raise UsageError(f"{out_path} exists", hint="choose another -o path or pass --force")
    t_adapter, tm = registry.describe(target)
    t_root = Path(tm.root)
    t_layout = _file_layout(t_adapter, tm)
    t_files = _checkpoint_files(tm)
    b_root: Path | None = None
    b_pieces: dict[tuple[str, Any, Any, int], tuple[str, int]] = {}
    b_layout: dict[str, list[_Segment]] = {}
    b_files: dict[str, int] = {}
    if base is not None:
        b_adapter, bm = registry.describe(base)
        b_root = Path(bm.root)
        b_layout = _file_layout(b_adapter, bm)
        b_files = dict(_checkpoint_files(bm))
        for rel, segs in b_layout.items():
            for s in segs:
                assert s.item is not None
                item = bm.items[s.item]
                for piece in item.pieces:
                    if piece.file == rel:
                        b_pieces.setdefault((canonical(s.item), piece.box, piece.flat, s.length), (rel, s.offset))
    # match target segments to base pieces
    for rel, segs in t_layout.items():
        for s in segs:
            assert s.item is not None
            item = tm.items[s.item]
            piece = next(p for p in item.pieces if p.file == rel)
            s.base = b_pieces.get((canonical(s.item), piece.box, piece.flat, s.length))

    jobs: list[tuple[str, str, _Segment | None, list[tuple[int, int]]]] = []
    for rel, size in t_files:
        segs = t_layout.get(rel, [])
        jobs.append((rel, "other", None, _gaps(size, segs)))
        jobs += [(rel, "tensor", s, []) for s in segs]

    def code(job: tuple[str, str, _Segment | None, list[tuple[int, int]]]) -> tuple[Any, list[bytes]]:
        rel, what, seg, gaps = job
        if what == "other":
            data = _read(t_root / rel, gaps)
            cctx_args: dict[str, Any] = {"level": 3}
            dict_ranges = None
            if b_root is not None and rel in b_files:
                dict_ranges = _gaps(b_files[rel], b_layout.get(rel, []))
                raw = _read(b_root / rel, dict_ranges)
                if raw:
                    cctx_args["dict_data"] = zstandard.ZstdCompressionDict(
                        raw, dict_type=zstandard.DICT_TYPE_RAWCONTENT
                    )
                else:
                    dict_ranges = None
            frame = zstandard.ZstdCompressor(**cctx_args).compress(data) if data else b""
            meta: dict[str, Any] = {"gaps": gaps, "dict": dict_ranges, "nbytes": len(data)}
            return meta, [frame]
        assert seg is not None
        values = maps.view(t_root / rel, seg.offset, seg.length)
        base_bytes = maps.view(b_root / seg.base[0], seg.base[1], seg.length) if seg.base and b_root else None
        method, frames, sizes = codec.encode(values, base_bytes, seg.width, seg.floating)
        meta = {
            "offset": seg.offset,
            "length": seg.length,
            "item": seg.item,
            "kind": seg.kind,
            "width": seg.width,
            "floating": seg.floating,
            "method": method,
            "sizes": sizes,
            "base": [seg.base[0], seg.base[1]] if seg.base and method in ("xor", "idiff") else None,
        }
        return meta, frames

    maps = _Mapped()
    header_files: dict[str, dict[str, Any]] = {
        rel: {"size": size, "xxh3": maps.digest(t_root / rel), "other": None, "tensors": []} for rel, size in t_files
    }
    try:
        with (
            ThreadPoolExecutor(max_workers=workers or min(8, os.cpu_count() or 2)) as pool,
            atomic_output(out_path) as fh,
        ):
            fh.write(MAGIC)
            pos = len(MAGIC)
            for (rel, what, _, _), (meta, frames) in zip(jobs, pool.map(code, jobs), strict=True):
                spans = []
                for frame in frames:
                    fh.write(frame)
                    spans.append([pos, len(frame)])
                    pos += len(frame)
                meta["frames"] = spans
                if what == "other":
                    header_files[rel]["other"] = meta
                else:
                    header_files[rel]["tensors"].append(meta)
                if progress is not None:
                    progress(meta.get("length") or meta.get("nbytes") or 0)
            header = {
                "kind": DELTA_KIND if base is not None else PACK_KIND,
                "version": 1,
                "format": tm.format,
                "target_is_file": Path(target).is_file(),
                "target_name": Path(target).name,
                "base": {"files": {rel: {"size": n, "xxh3": maps.digest(b_root / rel)} for rel, n in b_files.items()}}
                if b_root is not None
                else None,
                "files": header_files,
                "coded_bytes": pos - len(MAGIC),
            }
            blob = json.dumps(header, separators=(",", ":")).encode()
            fh.write(blob)
            fh.write(struct.pack("<Q", len(blob)))
            fh.write(MAGIC)
    finally:
        maps.close()
    return header


def read_header(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        with open(p, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size < 2 * len(MAGIC) + 8:
                raise ValueError("too short")
            fh.seek(size - len(MAGIC) - 8)
            (n,) = struct.unpack("<Q", fh.read(8))
            if fh.read(len(MAGIC)) != MAGIC or n > size:
                raise ValueError("bad trailer")
            fh.seek(size - len(MAGIC) - 8 - n)
            header: dict[str, Any] = json.loads(fh.read(n))
            fh.seek(0)
            if fh.read(len(MAGIC)) != MAGIC:
                raise ValueError("bad magic")
    except (OSError, ValueError) as exc:
        raise CorruptFileError(f"{p}: not a ckpttool delta or compressed checkpoint ({exc})", path=str(p)) from None
    return header


def _frames(fh: BinaryIO, spans: list[list[int]]) -> list[bytes]:
    out = []
    for off, n in spans:
        fh.seek(off)
        out.append(fh.read(n))
    return out


def apply(
    delta: str | Path,
    output: str | Path,
    *,
    base: str | Path | None = None,
    force: bool = False,
    workers: int | None = None,
) -> dict[str, Any]:
    """Rebuild the target of ``delta`` (against ``base``) into ``output``: every file checked
    against its stored hash before the output appears."""
    header = read_header(delta)
    out_path = Path(output)
    if out_path.exists() and not force:
        raise UsageError(f"{out_path} exists", hint="choose another -o path or pass --force")
    b_root: Path | None = None
    if header["kind"] == DELTA_KIND:
        if base is None:
            raise UsageError(f"{delta} is a delta: give the base checkpoint it was made against")
        b_root = _base_root(Path(base))
        for rel, fp in header["base"]["files"].items():
            f = b_root / rel
            if not f.is_file() or f.stat().st_size != fp["size"] or hash_bytes(f.read_bytes()) != fp["xxh3"]:
                raise DeltaMismatchError(
                    f"{base}: {rel} is not the file the delta was made against (size or xxh3 differ); "
                    "refused before writing anything",
                    hint="apply the delta to the exact base checkpoint it was created from (or the chain's previous "
                    "output)",
                    path=str(base),
                )
    elif base is not None:
        raise UsageError(f"{delta} is a compressed checkpoint, not a delta: it takes no base")
    parent = out_path.parent
    tmp = temp_dir_beside(out_path)
    try:

        def rebuild(item: tuple[str, dict[str, Any]]) -> None:
            rel, spec = item
            buf = bytearray(spec["size"])
            with open(delta, "rb") as fh:
                other = spec["other"]
                if other is not None and other["nbytes"]:
                    args: dict[str, Any] = {}
                    if other["dict"] and b_root is not None:
                        raw = _read(b_root / rel, [(int(a), int(n)) for a, n in other["dict"]])
                        args["dict_data"] = zstandard.ZstdCompressionDict(raw, dict_type=zstandard.DICT_TYPE_RAWCONTENT)
                    data = zstandard.ZstdDecompressor(**args).decompress(
                        _frames(fh, other["frames"])[0], max_output_size=other["nbytes"]
                    )
                    pos = 0
                    for off, n in other["gaps"]:
                        buf[off : off + n] = data[pos : pos + n]
                        pos += n
                for t in spec["tensors"]:
                    base_bytes = None
                    if t["base"] is not None and b_root is not None:
                        base_bytes = _read(b_root / t["base"][0], [(t["base"][1], t["length"])])
                    values = codec.decode(
                        t["method"],
                        _frames(fh, t["frames"]),
                        t["sizes"],
                        base_bytes,
                        t["width"],
                        t["floating"],
                        t["length"],
                    )
                    buf[t["offset"] : t["offset"] + t["length"]] = values
            if hash_bytes(buf) != spec["xxh3"]:
                raise DeltaMismatchError(
                    f"{delta}: rebuilding {rel} does not give the stored xxh3-128; nothing was published",
                    hint="the delta or the base is damaged; re-create the delta",
                    path=str(delta),
                )
            dest = tmp / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            with open(dest, "wb") as out:
                out.write(buf)
                out.flush()
                os.fsync(out.fileno())

        with ThreadPoolExecutor(max_workers=workers or min(8, os.cpu_count() or 2)) as pool:
            list(pool.map(rebuild, header["files"].items()))
        if header.get("target_is_file"):
            (only,) = header["files"]
            src = tmp / only
            if out_path.exists():
                out_path.unlink()
            os.replace(src, out_path)
            shutil.rmtree(tmp)
        else:
            for d in sorted({p.parent for p in tmp.rglob("*")}, key=lambda p: -len(p.parts)):
                fsync_dir(d)
            if out_path.exists():
                shutil.rmtree(out_path)
            os.replace(tmp, out_path)
        fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return header


def _base_root(base: Path) -> Path:
    """The directory the base's relative paths start from (the adapter's root for it)."""
    try:
        _, m = registry.describe(base)
        return Path(m.root)
    except CkptError:
        return base if base.is_dir() else base.parent


def info(delta: str | Path) -> dict[str, Any]:
    """Original and coded bytes per item kind (``other`` for non-tensor bytes), and methods used."""
    header = read_header(delta)
    kinds: dict[str, dict[str, int]] = {}
    methods: dict[str, int] = {}
    for spec in header["files"].values():
        other = spec["other"]
        if other is not None:
            k = kinds.setdefault("other", {"bytes": 0, "coded": 0})
            k["bytes"] += other["nbytes"]
            k["coded"] += sum(n for _, n in other["frames"])
        for t in spec["tensors"]:
            k = kinds.setdefault(t["kind"], {"bytes": 0, "coded": 0})
            k["bytes"] += t["length"]
            k["coded"] += sum(n for _, n in t["frames"])
            methods[t["method"]] = methods.get(t["method"], 0) + 1
    total = sum(k["bytes"] for k in kinds.values())
    coded = sum(k["coded"] for k in kinds.values())
    return {
        "kind": header["kind"],
        "format": header["format"],
        "files": len(header["files"]),
        "bytes": total,
        "coded": coded,
        "ratio": total / coded if coded else None,
        "by_kind": {k: {**v, "ratio": v["bytes"] / v["coded"] if v["coded"] else None} for k, v in kinds.items()},
        "methods": methods,
        "base_files": len(header["base"]["files"]) if header.get("base") else 0,
    }
