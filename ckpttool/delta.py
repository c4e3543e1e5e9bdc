"""Lossless delta (``delta create/apply/info``) and compression (``compress``/``decompress``).

Every file of the target checkpoint is cut into *tensor segments* (the raw bytes of each piece the
adapter can locate) and *other bytes* (zip headers, pickles, metadata, whole non-tensor files).
A tensor segment is coded with :mod:`ckpttool.codec` against the matching piece of the base
(same canonical item, same box, same size) when there is one, or alone; the other bytes of a file
are one zstd frame that uses the base file of the same name as its dictionary. ``apply`` rebuilds
every file, checks its xxh3-128 against the one stored, and publishes the output directory by one
rename, or nothing.

Container (one file): ``MAGIC``, the coded blobs, the header (JSON), the header's xxh3-128 (16
bytes), the header's length (8 bytes, little endian), ``MAGIC``. Version 1 (``CKPTDELTA1``, still
read) had no digest of its header: a flipped bit in a name or a mode was restored as it read.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import stat
import struct
import threading
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import zstandard

from ckpttool import codec, registry
from ckpttool import io as ckio
from ckpttool.dtypes import dtype as lookup_dtype
from ckpttool.errors import CkptError, CorruptFileError, IncompleteCheckpointError, NotFoundError, UsageError
from ckpttool.hashing import default_workers, hash_bytes, hash_files, new_hasher
from ckpttool.io import (
    WriterGate,
    atomic_output,
    check_output,
    escapes,
    fsync_dir,
    fsync_tree,
    publish_dir,
    put_in_place,
    refuse_overlap,
    replacing,
    staged_dir,
)
from ckpttool.manifest import Manifest
from ckpttool.naming import canonical, plural
from ckpttool.values import is_count, unique_keys

MAGIC = b"CKPTDELTA2\n"
VERSION = 2
_MAGICS = {b"CKPTDELTA1\n": (1, 0), MAGIC: (VERSION, 16)}
"""the containers this ckpttool reads, by their magic: their version, and the bytes of the header's
xxh3-128 in their trailer (version 1 had none)"""
_FIRST, _SECOND = "exp_avg", "exp_avg_sq"  # Adam's moments, as adapters name them (suffixes)
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
    item: str
    width: int
    floating: bool
    key: tuple[Any, Any]  # (box, flat) of the piece
    base: tuple[str, int] | None = None
    partner: _Segment | None = None  # for an Adam second moment: the first moment of the same piece


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
                key = (piece.box, piece.flat)
                seg = _Segment(span[0], span[1], item.kind, item.name, dt.itemsize, dt.is_floating, key)
                out.setdefault(piece.file, []).append(seg)
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
    with ckio.RandomAccessFile(path) as f:
        return b"".join(f.read(off, n) for off, n in ranges)


def _view(path: Path, offset: int, length: int, slot: str) -> memoryview:
    """``length`` bytes of ``path`` at ``offset``, read into a buffer this thread reuses under
    ``slot`` (valid until its next read into that slot). Read, not mapped: a file cut short under a
    mapping kills the process with SIGBUS at the first touch of a page past its new end, where a
    read comes back short and is an error that names the file."""
    buf = codec.scratch("read-" + slot, length)
    with ckio.RandomAccessFile(path) as f:
        f.read_into(offset, buf)
    return buf


def _digests(paths: list[Path], workers: int, moved: Callable[[], None] | None = None) -> dict[Path, str]:
    """The xxh3-128 of each file, files spread over ``workers`` threads. A file that changed while
    it was read calls ``moved()`` first, which may raise the caller's own error."""
    found, _ = hash_files(Path(), list(dict.fromkeys(str(p) for p in paths)), {}, workers=workers)
    out = {}
    for path in paths:
        d = found[str(path)]
        if d.digest is None:
            if d.changed and moved is not None:
                moved()
            raise CorruptFileError(
                f"{path}: cannot be read ({d.error}); nothing was written",
                hint="something is writing to that file: let it finish, then run the command again"
                if d.changed
                else "check the file's permissions and the disk it is on",
                path=str(path),
            )
        out[path] = d.digest
    return out


def is_container_head(head: bytes) -> bool:
    """Whether bytes begin as a compress or delta container of any version does (``MAGIC`` less
    its version)."""
    return head.startswith(MAGIC[: MAGIC.index(b"DELTA") + 5])


def _checkpoint_files(manifest: Manifest, *, base: bool = False) -> list[tuple[str, int]]:
    """The files a container holds of a checkpoint (its seal with them: a sealed checkpoint comes
    back sealed), or, of a base, those a delta reads and checks: not its seal, nor its tracker,
    which a save directory's next save moves on (the base's iteration is what the delta needs)."""
    skip = ("seal", "tracker") if base else ()
    return [(f.path, f.size) for f in manifest.files if f.role not in skip]


def _pack_root(path: str | Path, manifest: Manifest) -> tuple[Path, str]:
    """The directory a container's paths start from, and the manifest root's path below it.

    Given a save directory whose manifest covers one iteration folder inside it (Megatron
    ``torch_dist``, a DeepSpeed universal checkpoint), that is the save directory: the container
    then restores the folder under its own name, with the tracker beside it."""
    root, given = Path(manifest.root), Path(path)
    if given.is_dir() and root.resolve() != given.resolve() and root.resolve().is_relative_to(given.resolve()):
        return given, root.resolve().relative_to(given.resolve()).as_posix() + "/"
    return root, ""


def _packed(
    path: str | Path, adapter: Any, manifest: Manifest, *, beside: bool = True
) -> tuple[Path, dict[str, list[_Segment]], list[tuple[str, int]]]:
    """Root, tensor segments by file and files (path, size) of a checkpoint as a container holds it
    (``beside``: with the files beside its iteration folder; a base's are not needed, and its
    tracker may move on after the delta is made)."""
    root, prefix = _pack_root(path, manifest)
    layout = {prefix + rel: segs for rel, segs in _file_layout(adapter, manifest).items()}
    files = [(prefix + rel, size) for rel, size in _checkpoint_files(manifest, base=not beside)]
    # the files beside the iteration folder(s) of a save directory: its tracker, its seal, scripts
    # and notes a save leaves (a legacy Megatron save directory's manifest lists its rank files and
    # tracker only: its seal was left out, and the checkpoint came back unsealed)
    if beside and (prefix or (Path(path).is_dir() and root.resolve() == Path(path).resolve())):
        held = {rel for rel, _ in files}
        for entry in sorted(root.iterdir(), key=lambda e: e.name):
            name = entry.name
            if name in held or ckio.is_temp_name(name) or not entry.is_file():
                continue
            files.append((name, os.stat(ckio.confine(root, name, named_by="the listing")).st_size))
    return root, layout, files


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
    refuse_overlap(out_path, checkpoint=target, base=base)
    if out_path.exists() and not force:
        raise UsageError(f"{out_path} exists", hint="choose another -o path or pass --force")
    replaces = check_output(
        out_path, force=force, directory=False, example="step_1000.delta" if base else "step_1000.ckz"
    )
    if replaces:  # --force replaces an earlier container (or an empty file), never other data (a checkpoint's file)
        ckio.refuse_replacing_other_file(out_path, f"-o {out_path}", "a ckpttool container", is_container_head)
    t_adapter, tm = registry.describe(target)
    t_root, t_layout, t_files = _packed(target, t_adapter, tm)
    b_root: Path | None = None
    b_pieces: dict[tuple[str, Any, Any, int], tuple[str, int]] = {}
    b_layout: dict[str, list[_Segment]] = {}
    b_files: dict[str, int] = {}
    if base is not None:
        b_adapter, bm = registry.describe(base)
        b_root, b_layout, b_listing = _packed(base, b_adapter, bm, beside=False)
        b_files = dict(b_listing)
        for rel, segs in b_layout.items():
            for s in segs:
                b_pieces.setdefault((canonical(s.item), *s.key, s.length), (rel, s.offset))
    t_prefix = _pack_root(target, tm)[1]
    b_prefix = _pack_root(base, bm)[1] if base is not None else ""

    b_tops = sorted({r.split("/", 1)[0] for r in b_files if "/" in r}, reverse=True)  # (the newest iteration first)

    def twin(rel: str) -> str | None:
        """The base's file of the same name and place as the target's ``rel``, when one of the
        two was given as a save directory and the other as its iteration folder."""
        tail = rel[len(t_prefix) :] if rel.startswith(t_prefix) else rel
        # (a legacy Megatron save directory's manifest is rooted at it, with no prefix to strip:
        # its files are the iteration folder's one folder down, or up; a twin found only codes
        # better, the bytes restored are checked by their digests whatever it is)
        deeper = [rel.split("/", 1)[1]] if "/" in rel else []
        return next(
            (r for r in (rel, b_prefix + tail, *deeper, *(f"{top}/{rel}" for top in b_tops)) if r in b_files), None
        )

    # match target segments to base pieces
    for segs in t_layout.values():
        for s in segs:
            s.base = b_pieces.get((canonical(s.item), *s.key, s.length))
    # an Adam second moment is predicted from its first moment, found earlier in the same file
    # (apply decodes a file front to back: codec.ema2_*)
    by_piece = {(rel, s.item, s.key): s for rel, segs in t_layout.items() for s in segs}
    for rel, segs in t_layout.items():
        for s in segs:
            if s.base is not None and s.item.endswith(_SECOND) and s.width == 4 and s.floating:
                m = by_piece.get((rel, s.item[: -len(_SECOND)] + _FIRST, s.key))
                if m is not None and m.base is not None and m.length == s.length and m.offset + m.length <= s.offset:
                    s.partner = m

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
            other_rel = twin(rel) if b_root is not None else None
            if b_root is not None and other_rel is not None:
                dict_ranges = _gaps(b_files[other_rel], b_layout.get(other_rel, []))
                raw = _read(b_root / other_rel, dict_ranges)
                if raw:
                    cctx_args["dict_data"] = zstandard.ZstdCompressionDict(
                        raw, dict_type=zstandard.DICT_TYPE_RAWCONTENT
                    )
                else:
                    dict_ranges = None
            frame = zstandard.ZstdCompressor(**cctx_args).compress(data) if data else b""
            meta: dict[str, Any] = {"gaps": gaps, "dict": dict_ranges, "nbytes": len(data)}
            if dict_ranges is not None and other_rel != rel:
                meta["dict_file"] = other_rel  # (absent: the base's file of the same path)
            return meta, [frame]
        assert seg is not None
        values = _view(t_root / rel, seg.offset, seg.length, "target")
        base_bytes = _view(b_root / seg.base[0], seg.base[1], seg.length, "base") if seg.base and b_root else None
        bases: list[Any] = [base_bytes]
        predict: dict[str, Any] | None = None
        m = seg.partner
        if m is not None and m.base is not None and base_bytes is not None and b_root is not None:
            m_new = _view(t_root / rel, m.offset, m.length, "m_new")
            m_old = _view(b_root / m.base[0], m.base[1], m.length, "m_old")
            coef = codec.ema2_fit(values, m_new, m_old, base_bytes)
            if coef is not None:
                bases.append(codec.ema2_predict(m_new, m_old, base_bytes, coef))
                predict = {"ema2": list(coef), "m_new": m.offset, "m_old": [m.base[0], m.base[1]]}
        used, method, frames, sizes = codec.encode_best(values, bases, seg.width, seg.floating)
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
            "predict": predict if used == 1 else None,
        }
        return meta, frames

    def refuse_changed() -> None:
        """Refuse files that changed since the run began: their stamps (size, time) moved."""
        if changed := _changed(t_root, before):  # the container would hold a mix of two saves
            raise IncompleteCheckpointError(
                f"{target}: {', '.join(changed[:4])} changed while being packed; nothing was written",
                hint="a save is still writing to it: wait for it to finish, or give the iteration folder",
                path=changed[0],
                rule="incomplete-save",
            )
        if moved := _changed(b_root, b_before):  # coded against bytes its digests do not vouch for
            raise CkptError(
                f"{base}: {', '.join(moved[:4])} changed while the delta was coded against it; nothing was written",
                hint="something is writing to the base checkpoint: let it finish (or copy the base), then run "
                "'ckpttool delta create' again",
                path=moved[0],
            )

    threads = workers or default_workers()
    before = _stamps(t_root, [rel for rel, _ in t_files])
    b_before = _stamps(b_root, list(b_files)) if b_root else {}
    # (both sides' files in one pass; one that changes while it is hashed has moved its stamps)
    digests = _digests(
        [t_root / r for r, _ in t_files] + [b_root / r for r in b_files if b_root], threads, refuse_changed
    )
    base_files = {rel: {"size": n, "xxh3": digests[b_root / rel]} for rel, n in b_files.items()} if b_root else {}
    header_files: dict[str, dict[str, Any]] = {
        rel: {
            "size": size,
            "xxh3": digests[t_root / rel],
            "mode": stat.S_IMODE(os.stat(t_root / rel).st_mode),  # (its execute bits are restored)
            "other": None,
            "tensors": [],
        }
        for rel, size in t_files
    }
    with (
        ThreadPoolExecutor(max_workers=threads) as pool,
        atomic_output(out_path, replace=replaces) as fh,
    ):
        fh.write(MAGIC)
        pos = len(MAGIC)
        try:
            for (rel, what, _, _), (meta, frames) in zip(jobs, _in_order(pool, code, jobs, 2 * threads), strict=True):
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
        except (CkptError, OSError):
            refuse_changed()  # a file cut short or removed under the run: say that, not what its read met
            raise
        refuse_changed()
        header = {
            "kind": DELTA_KIND if base is not None else PACK_KIND,
            "version": VERSION,
            "format": tm.format,
            "target_is_file": Path(target).is_file(),
            "target_name": Path(target).name,
            "base": {"files": base_files} if b_root is not None else None,
            "files": header_files,
            "coded_bytes": pos - len(MAGIC),
        }
        blob = json.dumps(header, separators=(",", ":")).encode()
        try:  # what decompress and apply will accept, checked before anything is published
            _check_header(json.loads(blob), pos)
        except _BadHeader as exc:
            raise CkptError(
                f"{target}: cannot be packed: {exc}; nothing was written",
                hint="a file name with a backslash, or an entry ckpttool's containers cannot carry: rename or "
                "leave out that file",
            ) from None
        fh.write(trailer(blob))
    header["left_out"] = _left_out(target, t_root, {rel for rel, _ in t_files})
    return header


def _in_order(pool: ThreadPoolExecutor, fn: Callable[[Any], Any], jobs: list[Any], window: int) -> Iterator[Any]:
    """``fn`` of each job, in order, with at most ``window`` coded and waiting to be written: the
    frames are written in order, and ``pool.map`` coded every piece at once, so that with a writer
    slower than the coders (a network file system) the whole container sat in memory (667 MiB held
    for a 638 MiB output)."""
    pending: deque[Future[Any]] = deque()
    try:
        for job in jobs:
            pending.append(pool.submit(fn, job))
            if len(pending) >= window:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for f in pending:  # (stopped early: what has not started is not coded for nothing)
            f.cancel()


def _left_out(target: str | Path, root: Path, packed: set[str]) -> list[str]:
    """What a container of the folder ``target`` does not hold of it: each top entry (an older
    iteration, a ``logs/`` folder) once, with how many files it holds, so that the user knows
    before deleting the folder (empty for a file given)."""
    if not Path(target).is_dir():
        return []
    counts: dict[str, int] = defaultdict(int)
    links: list[str] = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not ckio.is_temp_name(d)]
        for d in dirs:  # (os.walk does not go into a link to a folder: it was left out without a word)
            if os.path.islink(os.path.join(folder, d)):
                links.append(Path(folder, d).relative_to(root).as_posix())
        for name in names:
            rel = Path(folder, name).relative_to(root).as_posix()
            if rel not in packed and not ckio.is_temp_name(name):
                top, _, rest = rel.partition("/")
                counts[top + ("/" if rest else "")] += 1
    return [f"{top} ({plural(n, 'file')})" if top.endswith("/") else top for top, n in sorted(counts.items())] + [
        f"{link}/ (a link to a folder)" for link in sorted(links) if link not in packed
    ]


def trailer(blob: bytes) -> bytes:
    """What follows a container's coded blobs: its header ``blob``, the header's xxh3-128 (so that a
    flipped bit in a file name, a mode or a range is caught, not restored), its length, ``MAGIC``."""
    return blob + bytes.fromhex(hash_bytes(blob)) + struct.pack("<Q", len(blob)) + MAGIC


def _changed(root: Path | None, before: dict[str, tuple[int, int] | None]) -> list[str]:
    """The files of ``before`` (:func:`_stamps` taken earlier) whose size or time is no longer the same."""
    return [rel for rel, stamp in _stamps(root, list(before)).items() if stamp != before[rel]] if root else []


def _stamps(root: Path, rels: list[str]) -> dict[str, tuple[int, int] | None]:
    """(size, modification time in ns) of each file, None for one that is gone."""
    out: dict[str, tuple[int, int] | None] = {}
    for rel in rels:
        try:
            st = os.stat(root / rel)
            out[rel] = (st.st_size, st.st_mtime_ns)
        except OSError:
            out[rel] = None
    return out


_CONTAINER = "a file written by 'ckpttool delta create' or 'ckpttool compress'"


def read_header(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        with open(p, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            magic = fh.read(len(MAGIC))
            known = _MAGICS.get(magic)
            if known is None:
                newer = is_container_head(magic) and magic[9:-1].isdigit()
                raise CorruptFileError(
                    f"{p}: a container of a newer ckpttool ({magic.strip().decode()}); this one reads versions "
                    f"{', '.join(str(v) for v, _ in _MAGICS.values())}"
                    if newer
                    else f"{p}: not a ckpttool delta or compressed checkpoint (it does not start with {MAGIC!r})",
                    hint="upgrade ckpttool to read it"
                    if newer
                    else "give a file written by 'ckpttool delta create' or 'ckpttool compress'",
                    path=str(p),
                )
            version, digest = known
            tail = digest + 8 + len(MAGIC)
            if size < len(MAGIC) + tail:
                raise ValueError(f"{size:,} bytes, shorter than an empty container")
            fh.seek(size - len(MAGIC) - 8)
            (n,) = struct.unpack("<Q", fh.read(8))
            if fh.read(len(MAGIC)) != magic or n > size - len(MAGIC) - tail:
                raise ValueError(f"no container trailer in its last {tail} bytes")
            data_end = size - tail - n
            fh.seek(data_end)
            raw = fh.read(n)
            if digest and fh.read(digest).hex() != hash_bytes(raw):
                raise ValueError("its header does not match the xxh3-128 stored after it")
            header: dict[str, Any] = json.loads(raw, object_pairs_hook=unique_keys)
    except FileNotFoundError:
        raise NotFoundError(f"{p}: no such file", hint=f"check the path; expected {_CONTAINER}", path=str(p)) from None
    except IsADirectoryError:
        raise NotFoundError(
            f"{p}: is a directory; expected {_CONTAINER}",
            hint="give the container file itself ('ckpttool compress' packs a checkpoint directory into one)",
            path=str(p),
        ) from None
    except PermissionError as exc:
        raise NotFoundError(
            f"{p}: cannot read ({exc.strerror})", hint="check the file's permissions", path=str(p)
        ) from None
    except (OSError, ValueError, RecursionError) as exc:
        raise CorruptFileError(
            f"{p}: a ckpttool container cut short or damaged ({exc})",
            hint="the copy or the write was interrupted: copy it again, or re-create it from the checkpoint",
            path=str(p),
        ) from None
    try:
        _check_header(header, data_end, version)
    except _BadHeader as exc:
        raise CorruptFileError(
            f"{p}: damaged or forged container header: {exc}",
            hint="re-create the delta; a header that names paths outside the output or bytes outside the file "
            "is never applied",
            path=str(p),
        ) from None
    return header


class _BadHeader(Exception):
    pass


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise _BadHeader(what)


def _pairs(v: Any, what: str) -> list[tuple[int, int]]:
    _need(isinstance(v, list) and all(isinstance(p, list) and len(p) == 2 and all(map(is_count, p)) for p in v), what)
    return [(int(a), int(b)) for a, b in v]


def _check_header(header: Any, data_end: int, version: int = VERSION) -> None:
    """Every name, number and range a header holds, before anything is read or written by it:
    paths relative and inside, frames inside the coded data, each file tiled exactly by its
    non-tensor gaps and its tensors; its version the one of the container's magic."""
    _need(isinstance(header, dict), "not a JSON object")
    _need(header.get("kind") in (DELTA_KIND, PACK_KIND), f"unknown kind {header.get('kind')!r:.40}")
    _need(
        header.get("version") == version,
        f"container version {header.get('version')!r:.20} in a version {version} container",
    )
    _need(isinstance(header.get("format"), str), "no format name")
    files = header.get("files")
    _need(isinstance(files, dict), "'files' is not an object")
    folders = {
        "/".join(parts[:i])
        for rel in files
        if isinstance(rel, str)
        for parts in [rel.split("/")]
        for i in range(1, len(parts))
    }
    _need(not header.get("target_is_file") or len(files) == 1, "a single-file target with several files")
    base = header.get("base")
    _need(base is None or header["kind"] == DELTA_KIND, "a compressed checkpoint with a base")
    if header["kind"] == DELTA_KIND:
        _need(isinstance(base, dict) and isinstance(base.get("files"), dict), "a delta without its base's files")
        for rel, fp in base["files"].items():
            _need(not escapes(rel), f"base file name {rel!r:.60} leaves the base directory")
            _need(isinstance(fp, dict) and is_count(fp.get("size")) and isinstance(fp.get("xxh3"), str), f"base {rel}")
    for rel, spec in files.items():
        _need(not escapes(rel), f"file name {rel!r:.60} leaves the output directory")
        _need(_plain_name(rel), f"file name {rel!r:.60} is not a plain relative path ('.', '//' or a backslash)")
        _need(rel not in folders, f"{rel!r:.60} is both a file and the folder of another file")
        _need(isinstance(spec, dict) and is_count(spec.get("size")) and isinstance(spec.get("xxh3"), str), rel)
        _need(spec.get("mode") is None or (is_count(spec["mode"]) and spec["mode"] <= 0o7777), f"{rel}: file mode")
        size = spec["size"]
        ranges: list[tuple[int, int]] = []
        _need("other" in spec, f"{rel}: no 'other' entry")
        other = spec.get("other")
        if other is not None:
            _need(isinstance(other, dict) and is_count(other.get("nbytes")), f"{rel}: non-tensor bytes")
            _need("dict" in other and "frames" in other, f"{rel}: non-tensor bytes without their frames")
            gaps = _pairs(other.get("gaps"), f"{rel}: gaps")
            _need(sum(n for _, n in gaps) == other["nbytes"], f"{rel}: gaps do not add up to nbytes")
            _need(other.get("dict") is None or header["kind"] == DELTA_KIND, f"{rel}: a dictionary without a base")
            if other.get("dict") is not None:
                _pairs(other["dict"], f"{rel}: dictionary ranges")
            if "dict_file" in other:  # a base file the delta checks before it reads it
                known = header["base"]["files"] if header["kind"] == DELTA_KIND else {}
                _need(isinstance(other["dict_file"], str) and other["dict_file"] in known, f"{rel}: a dictionary file")
            frames = _pairs(other.get("frames"), f"{rel}: frames")
            _need(len(frames) == 1 or (not frames and not other["nbytes"]), f"{rel}: non-tensor frames")
            ranges += gaps
            _frames_inside(frames, data_end, rel)
        tensors = spec.get("tensors")
        _need(isinstance(tensors, list), f"{rel}: 'tensors' is not a list")
        predicted: list[tuple[tuple[int, int], int]] = []  # ((source offset, length), offset)
        plain: set[tuple[int, int]] = set()
        for t in tensors:
            _need(
                isinstance(t, dict) and is_count(t.get("offset")) and is_count(t.get("length")), f"{rel}: tensor range"
            )
            _need(t.get("method") in codec.METHODS, f"{rel}: unknown method {t.get('method')!r:.20}")
            wide = t.get("width") == 16 and t["method"] == "stored"  # (complex128: stored as it is)
            width_ok = t.get("width") in (1, 2, 4, 8) or wide
            _need(width_ok and isinstance(t.get("floating"), bool), f"{rel}: tensor width")
            _need("base" in t and "frames" in t, f"{rel}: a tensor without its base or frames")
            _need(t["length"] % t["width"] == 0, f"{rel}: tensor length not a multiple of its width")
            _need(isinstance(t.get("sizes"), list) and all(map(is_count, t["sizes"])), f"{rel}: plane sizes")
            _need(isinstance(t.get("kind"), str), f"{rel}: tensor kind")
            ref = t.get("base")
            if t["method"] in ("xor", "idiff"):
                _need(header["kind"] == DELTA_KIND, f"{rel}: {t['method']} needs a base")
                _need(
                    isinstance(ref, list)
                    and len(ref) == 2
                    and isinstance(ref[0], str)
                    and ref[0] in base["files"]
                    and is_count(ref[1]),
                    f"{rel}: a base piece reference to a file the delta does not record",
                )
            _frames_inside(_pairs(t.get("frames"), f"{rel}: frames"), data_end, rel)
            ranges.append((t["offset"], t["length"]))
            if t.get("predict") is not None:
                predicted.append((_check_predict(t, base, rel), t["offset"]))
            else:
                plain.add((t["offset"], t["length"]))
        for (src, n), at in predicted:
            before = (src, n) in plain and src + n <= at
            _need(before, f"{rel}: a prediction from bytes that are not a tensor decoded before it")
        pos = 0
        for off, n in sorted(ranges):
            _need(off == pos, f"{rel}: its pieces do not tile the file (at byte {pos:,})")
            pos = off + n
        _need(pos == size, f"{rel}: its pieces cover {pos:,} of {size:,} bytes")


def _plain_name(rel: str) -> bool:
    """A member name as create writes it: '/'-separated parts, none empty or '.', no backslash."""
    return "\\" not in rel and all(part not in ("", ".") for part in rel.split("/"))


def _check_predict(t: dict[str, Any], base: Any, rel: str) -> tuple[int, int]:
    """A second-moment prediction's fields; returns the (offset, length) it reads in the same file."""
    pred = t["predict"]
    _need(base is not None and t["method"] in ("xor", "idiff"), f"{rel}: a prediction without a base")
    _need(t["width"] == 4 and t["floating"], f"{rel}: a second-moment prediction of a non-float32 tensor")
    _need(isinstance(pred, dict) and set(pred) == {"ema2", "m_new", "m_old"}, f"{rel}: prediction fields")
    coef = pred["ema2"]
    _need(
        isinstance(coef, list)
        and len(coef) == 3
        and all(isinstance(x, float | int) and not isinstance(x, bool) and math.isfinite(x) for x in coef),
        f"{rel}: prediction coefficients",
    )
    m_old = pred["m_old"]
    _need(isinstance(m_old, list) and len(m_old) == 2 and is_count(m_old[1]), f"{rel}: prediction base reference")
    _need(isinstance(m_old[0], str) and m_old[0] in base["files"], f"{rel}: a prediction from an unrecorded base file")
    _need(is_count(pred["m_new"]), f"{rel}: prediction source")
    return pred["m_new"], t["length"]


def _frames_inside(frames: list[tuple[int, int]], data_end: int, rel: str) -> None:
    for off, n in frames:
        _need(len(MAGIC) <= off and off + n <= data_end, f"{rel}: a frame lies outside the coded data")


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
    out_path = Path(output)
    header = read_header(delta)  # (reads the container only; nothing is written before the checks below)
    role = "delta" if header["kind"] == DELTA_KIND else "compressed checkpoint"
    inputs: dict[str, Any] = {role: delta, "base": base}  # (the role named in the refusal)
    refuse_overlap(out_path, **inputs)
    if out_path.exists() and not force:
        raise UsageError(f"{out_path} exists", hint="choose another -o path or pass --force")
    one_file = bool(header.get("target_is_file"))
    may_replace = check_output(
        out_path,
        force=force,
        directory=not one_file,
        example="restored/" + ("model.safetensors" if one_file else "step_1000"),
    )
    if one_file and force and out_path.is_file():
        try:  # --force replaces an earlier output, never other data: a file of a checkpoint format
            registry.detect(out_path)
        except CkptError:
            raise UsageError(
                f"-o {out_path} is a file that holds no checkpoint: --force replaces an earlier output, never "
                "other data",
                hint="choose another -o path, or remove the file yourself",
            ) from None
    based: Callable[[str], Path] | None = None  # a base file's path, by the name the delta records
    threads = workers or default_workers()
    if header["kind"] == DELTA_KIND:
        if base is None:
            raise UsageError(
                f"{delta} is a delta: it is applied to the base checkpoint it was made against",
                hint=f"ckpttool delta apply BASE {shlex.quote(str(delta))} -o OUTPUT",
            )
        if not os.path.lexists(base):
            raise NotFoundError(
                f"{base}: no such file or directory (the base checkpoint the delta is applied to)",
                hint="check the path: give the checkpoint the delta was created against",
                path=str(base),
            )
        based, one = _base_files(Path(base), header["base"]["files"])
        recorded: dict[str, Any] = header["base"]["files"]

        def mismatch(rel: str, there: bool) -> NoReturn:
            how = "is not the file the delta was made against (size or xxh3 differ)" if there else "is not there"
            said = f"not the file the delta was made against ({rel}: size or xxh3 differ)" if one else f"{rel} {how}"
            raise DeltaMismatchError(
                f"{base}: {said}; refused before writing anything",
                hint="apply the delta to the exact base checkpoint it was created from (or the chain's previous "
                "output)",
                path=str(base),
            )

        for rel, fp in recorded.items():
            f = based(rel)
            if not f.is_file() or f.stat().st_size != fp["size"]:
                mismatch(rel, f.is_file())
        digests = _digests([based(rel) for rel in recorded], threads)
        for rel, fp in recorded.items():
            if digests[based(rel)] != fp["xxh3"]:
                mismatch(rel, True)
    elif base is not None:
        raise UsageError(
            f"{delta} is a compressed checkpoint, not a delta: it takes no base",
            hint=f"ckpttool decompress {shlex.quote(str(delta))} -o OUTPUT",
        )
    parent = out_path.parent
    gate = WriterGate()
    with replacing(may_replace), staged_dir(out_path) as tmp:

        def rebuild(item: tuple[str, dict[str, Any]]) -> None:
            if not gate.enter():
                return
            try:
                _rebuild_one(*item)
            finally:
                gate.leave()

        def _rebuild_one(rel: str, spec: dict[str, Any]) -> None:
            dest = tmp / rel
            for d in reversed(dest.relative_to(tmp).parents[:-1]):  # below tmp only: never re-create tmp
                (tmp / d).mkdir(exist_ok=True)
            try:
                digest = _rebuild_file(Path(delta), rel, spec, based, dest, gate.cancelled)
            except (zstandard.ZstdError, ValueError, OverflowError, MemoryError, IndexError) as exc:
                raise CorruptFileError(
                    f"{delta}: the coded bytes of {rel} do not decode ({type(exc).__name__}: {exc}); "
                    "nothing was published",
                    hint=f"the {role} is damaged; re-create it",
                    path=str(delta),
                ) from None
            if digest is not None and digest != spec["xxh3"]:
                # the base's files were checked against their recorded xxh3-128 before any was
                # read: only the container's bytes can be wrong (damage, exit 3; a wrong base is
                # refused before, exit 1), or a base file changed while it was being applied
                raise CorruptFileError(
                    f"{delta}: rebuilding {rel} does not give the stored xxh3-128; nothing was published",
                    hint=f"the {role} is damaged; re-create it"
                    if based is None
                    else "the delta is damaged (its base matched the one it was made against): re-create it; or "
                    "the base changed while the delta was applied: apply it again",
                    path=str(delta),
                    rule="checksum-mismatch",
                )
            if spec.get("mode") is not None:
                # the file's permission bits, as cp gives a new copy: the saved ones the umask lets
                # through (a private 0600 checkpoint stays private, DeepSpeed's zero_to_fp32.py stays
                # executable); never a container's set-uid, set-gid or sticky bits
                now = stat.S_IMODE(os.stat(dest).st_mode)  # 0666 less the umask
                allowed = now | ((now >> 2) & 0o111)
                if (mode := spec["mode"] & 0o777 & allowed) != now:
                    os.chmod(dest, mode)

        pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ckpttool-apply")
        try:
            list(pool.map(rebuild, header["files"].items()))
        except BaseException:
            gate.close()  # the threads inside stop before writing more and leave; then tmp is removed
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        pool.shutdown(wait=True)
        if header.get("target_is_file"):
            (only,) = header["files"]
            if out_path.is_dir() and not out_path.is_symlink():
                raise UsageError(f"{out_path} is a directory; the delta rebuilds a single file")
            put_in_place(tmp / only, out_path, replace=may_replace)
            shutil.rmtree(tmp)
        else:
            fsync_tree(tmp, files=False)  # each file was fsync'd as it was written
            publish_dir(tmp, out_path)
        fsync_dir(parent)
    return header


def _rebuild_file(
    delta: Path,
    rel: str,
    spec: dict[str, Any],
    based: Callable[[str], Path] | None,
    dest: Path,
    cancelled: threading.Event,
) -> str | None:
    """Write one file of the target to ``dest``, front to back, decoded from the container (and
    the base), and return the xxh3-128 of what was written (None if cancelled). Each tensor piece
    is decoded into a buffer this thread reuses: memory is the largest piece. A predicted piece
    reads its source, an earlier piece of the file (checked by ``_check_header``), back from
    ``dest``."""
    regions: list[tuple[int, int, dict[str, Any] | None]] = [(t["offset"], t["length"], t) for t in spec["tensors"]]
    other = spec["other"]
    data = memoryview(b"")
    if other is not None and other["nbytes"]:
        args: dict[str, Any] = {}
        if other["dict"] and based is not None:
            raw = _read(based(other.get("dict_file", rel)), [(int(a), int(n)) for a, n in other["dict"]])
            args["dict_data"] = zstandard.ZstdCompressionDict(raw, dict_type=zstandard.DICT_TYPE_RAWCONTENT)
        ((off, n),) = other["frames"]
        frame = _view(delta, off, n, "other")
        data = memoryview(codec.decompress_bounded(zstandard.ZstdDecompressor(**args), frame, other["nbytes"]))
        if len(data) != other["nbytes"]:
            raise ValueError(f"{len(data):,} non-tensor bytes where {other['nbytes']:,} are expected")
        regions += [(off, n, None) for off, n in other["gaps"]]
    hasher = new_hasher("xxh3-128")
    pos = 0  # in ``data``: the gaps come in file order
    fd = os.open(dest, os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_BINARY", 0), 0o666)
    try:
        for offset, n, t in sorted(regions, key=lambda r: r[0]):  # _check_header: they tile the file
            if cancelled.is_set():
                return None
            if t is None:
                out = data[pos : pos + n]
                pos += n
            else:
                out = _decode_piece(delta, t, fd, based)
            _pwrite(fd, out, offset)
            hasher.update(out)
        os.fsync(fd)
        return hasher.hexdigest()
    finally:
        os.close(fd)


def _decode_piece(delta: Path, t: dict[str, Any], fd: int, based: Callable[[str], Path] | None) -> memoryview:
    """One tensor piece, decoded into this thread's reused buffer."""
    n = t["length"]
    base_bytes: Any = None
    if t["base"] is not None and based is not None:
        base_bytes = _view(based(t["base"][0]), t["base"][1], n, "base")
    pred = t.get("predict")
    if pred is not None and base_bytes is not None and based is not None:
        m_new = codec.scratch("m_new", n)
        if ckio.preadinto(fd, m_new, pred["m_new"]) != n:
            raise ValueError("a prediction source outside the file")
        m_old = _view(based(pred["m_old"][0]), pred["m_old"][1], n, "m_old")
        base_bytes = codec.ema2_predict(m_new, m_old, base_bytes, tuple(pred["ema2"]))
    out = codec.scratch("out", n)
    frames = _frames(delta, t["frames"])
    codec.decode_into(out, t["method"], frames, t["sizes"], base_bytes, t["width"], t["floating"])
    return out


def _frames(delta: Path, spans: list[list[int]]) -> list[memoryview]:
    """A piece's frames, read from the container at once: create writes them end to end (others
    are damage, raised as ValueError)."""
    if not spans:
        return []
    if any(spans[i][0] + spans[i][1] != spans[i + 1][0] for i in range(len(spans) - 1)):
        raise ValueError("a piece's frames do not lie end to end")
    start = spans[0][0]
    whole = _view(delta, start, spans[-1][0] + spans[-1][1] - start, "frames")
    return [whole[off - start : off - start + k] for off, k in spans]


def _pwrite(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        k = os.pwrite(fd, data, offset)
        data, offset = data[k:], offset + k


def _base_files(base: Path, wanted: dict[str, Any]) -> tuple[Callable[[str], Path], bool]:
    """Where each base file the delta names is (by the name it records), and whether the base is
    one file taken whatever its name. A delta made against one file, applied to one file given
    by another name (a renamed copy, the chain's previous output, a hub cache's blob link), reads
    that file: it was refused as "<recorded name> is not there", and a file of the recorded name
    beside it was taken in its place. Its bytes are checked against the recorded digest all the
    same."""
    root = _base_root(base, wanted)
    if base.is_file() and len(wanted) == 1:
        (rel,) = wanted
        there = root / rel
        if not (there.is_file() and there.resolve() == base.resolve()):
            return (lambda _rel: base), True
    return (lambda rel: root / rel), False


def _base_root(base: Path, wanted: dict[str, Any]) -> Path:
    """The directory the base's relative paths start from: the one of its save directory, its
    iteration folder (the adapter's root) or the folder holding what was given that holds every
    file the delta names (a delta made against a save directory, applied to its iteration folder,
    or made before save directories were packed whole)."""
    try:
        _, m = registry.describe(base)
    except CkptError:
        return base if base.is_dir() else base.parent
    packed, _ = _pack_root(base, m)
    candidates = [packed, Path(m.root), base.parent if base.is_dir() else base.parent.parent]
    for root in candidates:
        if all((root / rel).is_file() for rel in wanted):
            return root
    return packed


def info(delta: str | Path) -> dict[str, Any]:
    """Original and coded bytes per item kind (``other`` for non-tensor bytes), and methods used.
    ``ratio`` is the checkpoint's bytes over the container file's (header included); each kind's
    ratio is over its coded frames."""
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
        # the container as stored, its header (the index of files and frames) included
        "container_bytes": (size := os.path.getsize(delta)),
        "ratio": total / size,
        "by_kind": {k: {**v, "ratio": v["bytes"] / v["coded"] if v["coded"] else None} for k, v in kinds.items()},
        "methods": methods,
        "base_files": len(header["base"]["files"]) if header.get("base") else 0,
    }
