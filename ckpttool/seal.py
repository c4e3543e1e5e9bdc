"""``seal``: checksums of every file and every piece, written beside the checkpoint.

The seal (``ckpttool.manifest.json``) holds the manifest with ``FileRecord.checksum`` and
``Piece.checksum`` filled in, plus where each piece's bytes lie in its file, so ``verify`` can
re-hash a checkpoint in one pass and name the tensor a flipped byte belongs to.
"""

from __future__ import annotations

import datetime as _dt
import gc
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

from ckpttool import __version__, registry
from ckpttool.errors import CorruptFileError, UsageError
from ckpttool.formats.base import Adapter, PieceReader
from ckpttool.hashing import Algo, Span, hash_bytes, hash_files
from ckpttool.io import atomic_output
from ckpttool.manifest import SEAL_NAME, Item, Manifest, Piece
from ckpttool.values import is_count

SEAL_KIND = "ckpttool.seal"


def default_seal_path(path: str | Path) -> Path:
    p = Path(path)
    return p / SEAL_NAME if p.is_dir() else p.with_name(p.name + "." + SEAL_NAME)


@dataclass(slots=True, kw_only=True)
class PieceRecord:
    item: str
    index: int
    file: str
    offset: int | None
    """where the piece's raw bytes start in ``file``; None when stored compressed or strided"""
    length: int | None
    checksum: str


@dataclass(slots=True, kw_only=True)
class Seal:
    algo: Algo
    manifest: Manifest
    pieces: list[PieceRecord] = field(default_factory=list)
    created: str = ""
    tool: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": 1,
            "kind": SEAL_KIND,
            "tool": self.tool,
            "created": self.created,
            "hash": self.algo,
            "pieces": [[p.item, p.index, p.file, p.offset, p.length, p.checksum] for p in self.pieces],
            "manifest": self.manifest.to_json_dict(),
        }

    @classmethod
    def load(cls, path: Path) -> Seal:
        enabled = gc.isenabled()
        gc.disable()  # a seal of 10^5 items is millions of JSON values, none of them cyclic garbage
        try:
            return cls._load(path)
        finally:
            if enabled:
                gc.enable()

    @classmethod
    def _load(cls, path: Path) -> Seal:
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict) or data.get("kind") != SEAL_KIND:
                raise ValueError(f"kind is {data.get('kind') if isinstance(data, dict) else type(data).__name__!r}")
            pieces = [
                PieceRecord(item=i, index=n, file=f, offset=o, length=ln, checksum=c)
                for i, n, f, o, ln, c in data["pieces"]
            ]
            for r in pieces:
                if not (
                    isinstance(r.item, str)
                    and isinstance(r.file, str)
                    and isinstance(r.checksum, str)
                    and is_count(r.index)
                    and all(v is None or is_count(v) for v in (r.offset, r.length))  # None: not one byte run
                ):
                    raise ValueError(f"malformed piece record for {r.item!r:.60}")
            algo = data["hash"]
            if algo not in get_args(Algo):
                raise ValueError(f"unknown hash {algo!r:.40}")
            return cls(
                algo=algo,
                manifest=Manifest.from_json_dict(data["manifest"]),
                pieces=pieces,
                created=data.get("created", ""),
                tool=data.get("tool", ""),
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise CorruptFileError(
                f"{path}: not a readable ckpttool seal ({type(exc).__name__}: {exc})",
                hint="re-create it with 'ckpttool seal', or pass the right file with --manifest",
                path=str(path),
            ) from None


def in_file_order(manifest: Manifest, *, tensors_only: bool = False) -> list[tuple[Item, int, Piece]]:
    """Every (item, index, piece) sorted by file and position, so that locating pieces reads each
    file forwards (the kernel's readahead then serves it) instead of seeking back and forth."""
    out = [
        (item, i, piece)
        for item in manifest.items.values()
        if item.is_tensor or not tensors_only
        for i, piece in enumerate(item.pieces)
    ]
    out.sort(key=lambda t: (t[2].file, t[2].locator.get("offset", t[2].locator.get("begin", 0))))
    return out


def piece_spans(reader: PieceReader, manifest: Manifest) -> tuple[dict[str, list[Span]], list[tuple[str, int]]]:
    """Raw byte spans of every tensor piece, by file, keyed ``(item, index)``; and the pieces
    without one (compressed or strided), which must be read through the reader to be hashed."""
    spans: dict[str, list[Span]] = {}
    other: list[tuple[str, int]] = []
    for item, i, piece in in_file_order(manifest, tensors_only=True):
        span = reader.raw_span(piece, item)
        if span is None:
            other.append((item.name, i))
        else:
            spans.setdefault(piece.file, []).append(Span((item.name, i), span[0], span[1]))
    return spans, other


def hash_pieces(
    adapter: Adapter,
    manifest: Manifest,
    algo: Algo,
    *,
    files: list[str] | None = None,
    workers: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> tuple[dict[str, Any], dict[tuple[str, int], str], dict[tuple[str, int], tuple[str, int, int] | None]]:
    """One pass: digests of ``files`` (default: every file of the manifest but a seal) and of every
    tensor piece. Returns (file digests, piece digests, piece spans)."""
    root = Path(manifest.root)
    targets = files if files is not None else [f.path for f in manifest.files if f.role != "seal"]
    with adapter.reader(manifest) as reader:
        spans, other = piece_spans(reader, manifest)
        file_digests, span_digests = hash_files(root, targets, spans, algo, workers=workers, progress=progress)
        for name, i in other:
            item = manifest.items[name]
            span_digests[(name, i)] = hash_bytes(reader.read(item.pieces[i], item).reshape(-1).view("u1").data, algo)
    where: dict[tuple[str, int], tuple[str, int, int] | None] = {k: None for k in other}
    for rel, lst in spans.items():
        for s in lst:
            where[s.key] = (rel, s.offset, s.length)
    return file_digests, span_digests, where


def seal(
    path: str | Path,
    *,
    out: str | Path | None = None,
    algo: Algo = "xxh3-128",
    workers: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> tuple[Seal, Path]:
    """Hash every file and piece of the checkpoint at ``path`` and write the seal atomically."""
    if algo not in ("xxh3-128", "sha256"):
        raise UsageError(f"--hash {algo!r}: expected xxh3-128 or sha256")
    adapter, manifest = registry.describe(path)
    file_digests, piece_digests, where = hash_pieces(adapter, manifest, algo, workers=workers, progress=progress)
    for f in manifest.files:
        d = file_digests.get(f.path)
        if d is not None:
            if d.digest is None:
                raise CorruptFileError(f"{f.path}: cannot be read ({d.error})", path=f.path)
            f.checksum = d.digest
    records = []
    for item in manifest.items.values():
        for i, piece in enumerate(item.pieces):
            digest = piece_digests.get((item.name, i))
            if digest is None:
                continue
            piece.checksum = digest
            loc = where.get((item.name, i))
            records.append(
                PieceRecord(
                    item=item.name,
                    index=i,
                    file=piece.file,
                    offset=loc[1] if loc else None,
                    length=loc[2] if loc else None,
                    checksum=digest,
                )
            )
    result = Seal(
        algo=algo,
        manifest=manifest,
        pieces=records,
        tool=f"ckpttool {__version__}",
        created=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    )
    target = Path(out) if out is not None else default_seal_path(path)
    with atomic_output(target) as fh:
        fh.write(json.dumps(result.to_json(), separators=(",", ":")).encode())
    return result, target
