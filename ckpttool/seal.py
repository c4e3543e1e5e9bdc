"""``seal``: checksums of every file and every piece, written beside the checkpoint.

The seal (``ckpttool.manifest.json``) holds the manifest with ``FileRecord.checksum`` and
``Piece.checksum`` filled in, plus where each piece's bytes lie in its file, so ``verify`` can
re-hash a checkpoint in one pass and name the tensor a flipped byte belongs to.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import datetime as _dt
import functools
import json
import os
import posixpath
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from itertools import chain, repeat
from pathlib import Path
from typing import Any, Literal, NamedTuple, get_args

from ckpttool import __version__, _torchzip, registry
from ckpttool import io as ckio
from ckpttool._unpickle import hostile
from ckpttool.dtypes import carrier
from ckpttool.errors import CkptError, CorruptFileError, IncompleteCheckpointError, UsageError, raise_together
from ckpttool.formats import _pt
from ckpttool.formats.base import Adapter, PieceReader
from ckpttool.hashing import Algo, FileDigest, Span, Written, hash_bytes, hash_files
from ckpttool.io import atomic_output
from ckpttool.manifest import SEAL_NAME, Item, Manifest, Piece, is_seal_name
from ckpttool.naming import param_state
from ckpttool.values import gc_paused, is_count

SEAL_KIND = "ckpttool.seal"


def default_seal_path(path: str | Path) -> Path:
    p = Path(path)
    return p / SEAL_NAME if p.is_dir() else p.with_name(p.name + "." + SEAL_NAME)


@dataclass(slots=True)
class PieceRecord:
    item: str
    index: int
    file: str
    offset: int | None
    """where the piece's raw bytes start in ``file``; None when stored compressed or strided"""
    length: int | None
    checksum: str


SEAL_SCHEMA = 2
"""Version 2 stores items and pieces as columns (one JSON list per field, checksums once): a
seal of 400 000 pieces is a third of version 1's size and loads in a fraction of its time.
Version 1 seals (the whole manifest as objects, plus a list of piece records) still load."""

_ITEM_FIELDS = ("name", "kind", "dtype", "shape", "value", "summary", "error")
_PIECE_FIELDS = ("file", "locator_set", "ndim", "flat", "replica", "rank", "nbytes", "checksum", "offset", "length")
"""One entry per piece; ``locator_values`` and ``box`` hold each piece's locator values (in the
order of its key set) and box (offsets, then sizes) one after another, flattened."""


@dataclass(slots=True, kw_only=True)
class Seal:
    """A seal: the hash algorithm, the manifest's head (``head``: root, format, step, layout,
    files with their checksums; no items) and every hashed piece. ``manifest`` (items and pieces
    too) is built from the stored columns on first use; ``verify`` needs only the head."""

    algo: Algo
    head: Manifest
    _records: list[PieceRecord] | None = None
    created: str = ""
    tool: str = ""
    folders: dict[str, list[str]] | None = None
    """The subfolders each folder holding data files had when sealed (other saves' folders, a
    logs folder): ``verify`` reports a subfolder that came after as an extra file. None in seals
    written before ckpttool kept it."""
    _manifest: Manifest | None = None
    _columns: dict[str, Any] | None = None
    _path: str = ""

    @property
    def pieces(self) -> list[PieceRecord]:
        """Every hashed piece: its item, index, file, byte span and checksum."""
        if self._records is None:
            with gc_paused():  # hundreds of thousands of records
                self._records = _records(self._columns or {})
        return self._records

    @property
    def manifest(self) -> Manifest:
        if self._manifest is None:
            self._manifest = _materialise(self.head, self._columns or {}, self._path)
        return self._manifest

    def to_json(self) -> dict[str, Any]:
        m = self.manifest
        head = self.head.to_json_dict()
        head.pop("items")
        names = list(m.items)
        files: dict[str, int] = {}
        keysets: dict[tuple[str, ...], int] = {}
        where = {(p.item, p.index): p for p in self.pieces}
        items: dict[str, list[Any]] = {k: [] for k in (*_ITEM_FIELDS, "pieces")}
        pieces: dict[str, list[Any]] = {k: [] for k in _PIECE_FIELDS}
        locator_values: list[Any] = []
        boxes: list[int] = []
        for name in names:
            item = m.items[name]
            for k in _ITEM_FIELDS:
                items[k].append(_plain_value(getattr(item, k)))
            items["pieces"].append(len(item.pieces))
            for i, p in enumerate(item.pieces):
                keys = tuple(p.locator)
                pieces["file"].append(files.setdefault(p.file, len(files)))
                pieces["locator_set"].append(keysets.setdefault(keys, len(keysets)))
                locator_values.extend(p.locator.values())
                pieces["ndim"].append(len(p.box.offsets))
                boxes.extend(p.box.offsets)
                boxes.extend(p.box.sizes)
                pieces["flat"].append(list(p.flat) if p.flat is not None else None)
                pieces["replica"].append(p.replica)
                pieces["rank"].append(p.rank)
                pieces["nbytes"].append(p.nbytes)
                rec = where.get((name, i))
                pieces["checksum"].append(rec.checksum if rec else p.checksum)
                pieces["offset"].append(rec.offset if rec else None)
                pieces["length"].append(rec.length if rec else None)
        return {
            "schema_version": SEAL_SCHEMA,
            "kind": SEAL_KIND,
            "tool": self.tool,
            "created": self.created,
            "hash": self.algo,
            "manifest": head,
            **({"folders": self.folders} if self.folders is not None else {}),
            "piece_files": list(files),
            "locator_keys": [list(k) for k in keysets],
            "items": items,
            "pieces": pieces | {"locator_values": locator_values, "box": boxes},
        }

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Seal:
        path = Path(path)
        try:
            with gc_paused():  # a seal of 10^5 items is millions of JSON values
                return cls._load(path)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError) as exc:
            raise _corrupt(path, exc) from None

    @classmethod
    def _load(cls, path: Path) -> Seal:
        data = json.loads(path.read_bytes())
        if not isinstance(data, dict):
            raise ValueError(f"a JSON {type(data).__name__}, where a seal is an object with kind {SEAL_KIND!r}")
        if data.get("kind") != SEAL_KIND:
            raise ValueError(f"its kind is {data.get('kind')!r:.40}, where a seal's is {SEAL_KIND!r}")
        version = data.get("schema_version")
        if version not in (1, SEAL_SCHEMA):  # (before any other field: a later schema may spell them otherwise)
            newer = isinstance(version, int) and not isinstance(version, bool) and version > SEAL_SCHEMA
            raise ValueError(
                f"schema_version {version!r:.20}: this ckpttool reads seals of schema 1 and {SEAL_SCHEMA}"
                + ("; a newer ckpttool wrote it: upgrade to read it" if newer else "")
            )
        algo = data["hash"]
        if algo not in get_args(Algo):
            raise ValueError(f"unknown hash {algo!r:.40}")
        created, tool = data.get("created", ""), data.get("tool", "")
        if version == 1:
            manifest = Manifest.from_json_dict(data["manifest"])
            pieces = [
                PieceRecord(item=i, index=n, file=f, offset=o, length=ln, checksum=c)
                for i, n, f, o, ln, c in data["pieces"]
            ]
            _check_records(pieces)
            _check_paths(chain((f.path for f in manifest.files), (r.file for r in pieces)))
            return cls(algo=algo, head=_head(manifest), _records=pieces, created=created, tool=tool, _manifest=manifest)
        if version != SEAL_SCHEMA:
            raise ValueError(f"schema_version {version!r:.20} (this ckpttool reads 1 and {SEAL_SCHEMA})")
        head_json = data["manifest"]
        if not isinstance(head_json, dict):
            raise TypeError("manifest is not an object")
        head = Manifest.from_json_dict({**head_json, "items": {}})
        columns = {k: data[k] for k in ("piece_files", "locator_keys", "items", "pieces")}
        _validate(columns)
        _check_paths(chain((f.path for f in head.files), columns["piece_files"]))
        folders = data.get("folders")
        if folders is not None and not (
            isinstance(folders, dict)
            and all(isinstance(k, str) and isinstance(v, list) and _only(v, str) for k, v in folders.items())
        ):
            raise TypeError("folders is not an object of name lists")
        return cls(algo=algo, head=head, created=created, tool=tool, folders=folders, _columns=columns, _path=str(path))


def _head(manifest: Manifest) -> Manifest:
    """The manifest without its items (sharing its files, layout and extras)."""
    return dataclasses.replace(manifest, items={})


def _corrupt(path: Path, exc: BaseException) -> CorruptFileError:
    return CorruptFileError(
        f"{path}: not a readable ckpttool seal ({_reason(exc)})",
        hint="re-create it with 'ckpttool seal', or pass the right file with --manifest",
        path=str(path),
    )


def _reason(exc: BaseException) -> str:
    """What is wrong, on one line. pydantic's errors (``errors()``) are named field by field, as
    ``manifest.files.0.size: Input should be a valid integer (found 'abc')``, without the several
    lines and documentation links of their ``str``."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            listed = [
                f"manifest.{'.'.join(map(str, e['loc']))}: {e['msg']} (found {e.get('input')!r:.60})"
                for e in errors(include_url=False)
            ]
        except (TypeError, KeyError):
            listed = []
        if listed:
            more = f"; and {len(listed) - 3} more" if len(listed) > 3 else ""
            return "; ".join(listed[:3]) + more
    return f"{type(exc).__name__}: {exc}"


def _plain_value(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def _check_paths(paths: Iterable[str]) -> None:
    """Every file a seal names is spelled as seal writes it: relative to the checkpoint, below it,
    without ``.`` or empty parts (``./x`` or ``../ckpt/x`` named a file on disk twice, once
    as extra; ``../x`` one outside)."""
    for p in paths:
        if ckio.escapes(p) or posixpath.normpath(p) != p:
            raise ValueError(f"it names the file {p!r:.200}, not a path below the checkpoint as seal writes them")


def _check_records(pieces: list[PieceRecord]) -> None:
    for r in pieces:
        if not (
            isinstance(r.item, str)
            and isinstance(r.file, str)
            and isinstance(r.checksum, str)
            and is_count(r.index)
            and all(v is None or is_count(v) for v in (r.offset, r.length))  # None: not one byte run
        ):
            raise ValueError(f"malformed piece record for {r.item!r:.60}")


def _column(table: Any, name: str, n: int | None, what: str) -> list[Any]:
    col = table[name] if isinstance(table, dict) else None
    if not isinstance(col, list) or (n is not None and len(col) != n):
        raise ValueError(f"{what}.{name} is not a list of {n if n is not None else 'the'} entries")
    return col


def _validate(columns: dict[str, Any]) -> None:
    """Type checks of the columns the piece records are built from (on load; the records
    themselves are built on first use)."""
    items, pieces, files, keysets = (columns[k] for k in ("items", "pieces", "piece_files", "locator_keys"))
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        raise ValueError("piece_files is not a list of paths")
    if not isinstance(keysets, list) or not all(
        isinstance(k, list) and all(isinstance(x, str) for x in k) for k in keysets
    ):
        raise ValueError("locator_keys is not a list of key lists")
    names = _column(items, "name", None, "items")
    counts = _column(items, "pieces", len(names), "items")
    if not _only(names, str) or not _counts(counts):
        raise ValueError("items.name or items.pieces holds a value of the wrong type")
    total = sum(counts)
    for name in _PIECE_FIELDS:
        _column(pieces, name, total, "pieces")
    for name in ("locator_values", "box"):
        _column(pieces, name, None, "pieces")
    for name, bound in (("file", len(files)), ("locator_set", len(keysets))):
        if not _counts(pieces[name], below=bound):
            raise ValueError(f"pieces.{name} holds an index outside its table")
    if not _only(pieces["checksum"], str, type(None)):
        raise ValueError("pieces.checksum holds a value that is not a string")
    if not _counts(pieces["offset"], nullable=True) or not _counts(pieces["length"], nullable=True):
        raise ValueError("pieces.offset or pieces.length holds a value that is not a byte count")


def _only(column: list[Any], *types: type) -> bool:
    """Every value is of exactly one of ``types`` (a subclass, such as bool for int, is not)."""
    return set(map(type, column)) <= set(types)


def _counts(column: list[Any], *, below: int | None = None, nullable: bool = False) -> bool:
    """Every value is a count (:func:`~ckpttool.values.is_count`), below ``below`` if given, or
    None if ``nullable``. Checked column-wide, at C speed (400 000 pieces: 0.5 s by value)."""
    kinds = set(map(type, column))
    if not kinds <= ({int, type(None)} if nullable else {int}):
        return False
    values = [v for v in column if v is not None] if type(None) in kinds else column
    return not values or (min(values) >= 0 and (below is None or max(values) < below))


def _records(columns: dict[str, Any]) -> list[PieceRecord]:
    """The hashed pieces, from validated columns: each piece with a checksum, under its item's name."""
    items, pieces, files = columns["items"], columns["pieces"], columns["piece_files"]
    names, counts = items["name"], items["pieces"]
    every = map(
        PieceRecord,
        chain.from_iterable(map(repeat, names, counts)),  # the item of each piece
        chain.from_iterable(map(range, counts)),  # its index in the item
        [files[i] for i in pieces["file"]],
        pieces["offset"],
        pieces["length"],
        pieces["checksum"],
    )
    return [r for r in every if r.checksum is not None]


def _materialise(head: Manifest, columns: dict[str, Any], path: str) -> Manifest:
    """The whole manifest from a version 2 seal's columns, validated as a version 1 one is."""
    try:
        items, pieces, files, keysets = (
            columns["items"],
            columns["pieces"],
            columns["piece_files"],
            columns["locator_keys"],
        )
        # the columns passed _validate on load; the item fields it does not check are checked by
        # the manifest's validator below
        names = items["name"]
        cols = {k: _column(items, k, len(names), "items") for k in (*_ITEM_FIELDS, "pieces")}
        pcols, values, boxes = pieces, pieces["locator_values"], pieces["box"]
        out_items: dict[str, Any] = {}
        k = at_value = at_box = 0
        for j, name in enumerate(names):
            plist = []
            for _ in range(cols["pieces"][j]):
                keys = keysets[pcols["locator_set"][k]]
                ndim = pcols["ndim"][k]
                if not is_count(ndim) or at_value + len(keys) > len(values) or at_box + 2 * ndim > len(boxes):
                    raise ValueError(f"pieces.locator_values or pieces.box ends before piece {k}")
                plist.append(
                    {
                        "file": files[pcols["file"][k]],
                        "locator": dict(zip(keys, values[at_value : at_value + len(keys)], strict=True)),
                        "box": {
                            "offsets": boxes[at_box : at_box + ndim],
                            "sizes": boxes[at_box + ndim : at_box + 2 * ndim],
                        },
                        "flat": pcols["flat"][k],
                        "replica": pcols["replica"][k],
                        "rank": pcols["rank"][k],
                        "nbytes": pcols["nbytes"][k],
                        "checksum": pcols["checksum"][k],
                    }
                )
                at_value += len(keys)
                at_box += 2 * ndim
                k += 1
            out_items[name] = {f: cols[f][j] for f in _ITEM_FIELDS} | {"pieces": plist}
        if at_value != len(values) or at_box != len(boxes):
            raise ValueError("pieces.locator_values or pieces.box holds more values than the pieces use")
        return Manifest.from_json_dict({**head.to_json_dict(), "items": out_items})
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError) as exc:
        raise _corrupt(Path(path), exc) from None


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


Expected = dict[Any, tuple[int, str, str | None]]
"""CRC-32 span key -> (the CRC-32 its archive stores, member name, the item the archive holds)"""


def member_crcs(
    reader: Any,
    piece: Piece,
    item: Item,
    seen: set[tuple[str, int]],
    spans: list[Span],
    expected: Expected,
    damage: list[CkptError] | None = None,
) -> list[str]:
    """The CRC-32 spans of the zip members of the archive holding ``piece`` (once per archive:
    ``seen``), added to ``spans`` with what each must give in ``expected``; returns the members of
    an archive held in memory (a decompressed DCP item) that fail theirs. torch writes a CRC-32 for
    every member and never checks one. A member the zip index misplaces is the archive's damage,
    not ``item``'s (it is any member of the archive): added to ``damage`` when given, else the first
    is raised, once the other members' spans are added."""
    arch = reader.archive_of(piece) if hasattr(reader, "archive_of") else None
    if arch is None:
        return []
    # an archive in memory (a decompressed DCP item) starts at its own 0: known by its record's place
    where = piece.locator.get("offset", arch.base) if isinstance(arch.source, bytes) else arch.base
    if (piece.file, where) in seen:
        return []
    seen.add((piece.file, where))
    owner = item.name if "offset" in piece.locator else None
    if isinstance(arch.source, bytes):
        return list(arch.crc_errors())
    damaged: list[CkptError] = [] if damage is None else damage
    _crc_spans(arch, piece.file, owner, spans, expected, damaged)
    if damaged and damage is None:
        raise damaged[0]
    return []


def _crc_spans(
    arch: Any, file: str, owner: str | None, spans: list[Span], expected: Expected, damaged: list[CkptError]
) -> None:
    """The CRC-32 span of every member of archive ``arch`` of ``file``, added to ``spans`` with what
    each must give in ``expected``; a member the zip index misplaces, and bytes after the archive's
    end in a file that is one archive, added to ``damaged``."""
    if (added := bytes_added(arch, file)) is not None:
        damaged.append(added)
    for name, info in arch.members.items():
        if (info.CRC == 0 and info.file_size > 0) or info.compress_type != 0:
            continue  # torch wrote no CRCs, or a member we do not inflate
        try:
            mspan = arch.member_span(name, info)
        except CkptError as exc:  # the other members are still checked
            damaged.append(exc)
            continue
        key = ("crc", file, mspan.offset)
        spans.append(Span(key, mspan.offset, mspan.length, algo="crc32"))
        expected[key] = (info.CRC, name, owner)


def bytes_added(arch: Any, file: str) -> CorruptFileError | None:
    """Bytes after the end of a file that is one torch.save archive ``arch``: added after the save.
    torch.load reads past them, so verify says it as a warning; seal refuses to vouch for them."""
    if arch.base != 0 or not (extra := arch.bytes_after()):
        return None
    added = CorruptFileError(
        f"{file} is {arch.length:,} bytes, {extra:,} more than its torch.save archive reaches: bytes were added "
        "after the save (torch.load reads past them)",
        hint="restore the file from the save, or cut it to its archive's end",
        path=file,
        rule="corrupt-file",
    )
    added.severity = "warning"
    return added


def _aux_crcs(root: Path, rel: str, spans: list[Span], expected: Expected) -> None:
    """The CRC-32 spans of a torch.save archive the checkpoint keeps beside the state its format
    reads (a Hugging Face Trainer's ``optimizer.pt``): no reader reads it, but a seal vouches for its
    bytes too. A file that is not a zip archive (a pre-1.6 torch.save file, other bytes) has none;
    an archive whose zip index does not read is refused."""
    path = ckio.confine(root, rel, named_by="the listing")
    f = ckio.RandomAccessFile(path, display=rel)
    try:
        if bytes(f.read(0, min(4, f.size))) != _pt.ZIP_MAGIC or _pt.foreign_zip(path):
            return  # (a TorchScript file, a zip of assets: its bytes are sealed, not judged as torch.save's)
        damaged: list[CkptError] = []
        _crc_spans(_torchzip.Archive(f, display=rel, allow={}), rel, None, spans, expected, damaged)
        if damaged:
            raise damaged[0]
    finally:
        f.close()


def piece_spans(adapter: Adapter, manifest: Manifest) -> tuple[dict[str, list[Span]], list[tuple[str, int]], Expected]:
    """Raw byte spans of every tensor piece, by file, keyed ``(item, index)``, with the CRC-32
    spans of every zip member that holds a piece (what each must give in the third value); and
    the pieces without a span (compressed or strided), which must be read through the reader to
    be hashed. A pickle read to locate them is checked against its CRC-32 as it is read
    (:func:`ckpttool.io.checking_crcs`); an archive held in memory that fails one is refused here.

    Locating a piece reads its headers, small reads scattered over the files; they leave the page
    cache as they found it (``io.probing``) for the sequential pass that follows. (Locating with
    several threads, each its own reader, gained nothing cold and cost 60 ms hot: the parsing
    holds the GIL.)"""
    spans: dict[str, list[Span]] = {}
    other: list[tuple[str, int]] = []
    expected: Expected = {}
    seen: set[tuple[str, int]] = set()
    with _not_sealing_damage(every=True), ckio.probing(), ckio.checking_crcs(), adapter.reader(manifest) as reader:
        for item, i, piece in in_file_order(manifest):
            if item.is_tensor:
                span = reader.raw_span(piece, item)
                if span is None:
                    other.append((item.name, i))
                else:
                    spans.setdefault(piece.file, []).append(Span((item.name, i), span[0], span[1]))
            failed = member_crcs(reader, piece, item, seen, spans.setdefault(piece.file, []), expected)
            if failed:
                raise CorruptFileError(
                    f"{piece.file}: member {failed[0]} of {item.name} fails its zip CRC-32: the bytes changed "
                    "after the save",
                    path=piece.file,
                    rule="checksum-mismatch",
                )
        for rec in manifest.files:
            if rec.role == "aux" and rec.path.endswith(_pt.SUFFIXES):
                _aux_crcs(Path(manifest.root), rec.path, spans.setdefault(rec.path, []), expected)
    return spans, other, expected


def crc_failures(
    digests: dict[Any, str],
    expected: Expected,
    spans: Mapping[str, Iterable[Span]] | None = None,
    reader: PieceReader | None = None,
) -> list[tuple[str, str, str | None]]:
    """The members whose bytes, as hashed into ``digests``, fail the CRC-32 their archive stores
    (``expected``, from :func:`member_crcs`): (file, message, the item its archive holds, or the
    one tensor the member holds), in file order. ``spans``: the hashing's spans, which name the
    tensors in a member of an archive of many (a torch.save file), read only when one fails;
    ``reader``: names, from the file's pickle, a member that holds no piece (an Adam step)."""
    out = []
    inside: dict[tuple[str, int], list[str]] | None = None
    for key, (crc, member, owner) in sorted(expected.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        got = digests.get(key)
        if got is None or int(got, 16) == crc:
            continue
        of = f" (of {owner})" if owner else ""
        if owner is None:
            if inside is None:
                inside = _tensors_in_members(spans or {})
            names = inside.get((key[1], key[2]), [])
            owner = names[0] if len(names) == 1 else None
            if not names and reader is not None:  # (values beside the items: named by their paths)
                names = reader.values_in_member(key[1], member)
            if names:
                of = f" ({', '.join(names[:3])}{f' and {len(names) - 3} more' if len(names) > 3 else ''})"
        message = (
            f"{key[1]}: {member}{of} fails its zip CRC-32 (stored {crc:08x}, computed {got}): the bytes changed "
            "after the save"
        )
        out.append((key[1], message, owner))
    return out


def _tensors_in_members(spans: Mapping[str, Iterable[Span]]) -> dict[tuple[str, int], list[str]]:
    """(file, member offset) -> the tensors whose bytes lie in that member, from the hashing's spans
    by file (a member's CRC span keyed ``("crc", file, offset)``; a piece's keyed by its item name
    and index, last but one)."""
    out: dict[tuple[str, int], list[str]] = {}
    for file, listed in spans.items():
        members, pieces = [], []
        for sp in listed:
            if sp.algo == "crc32":
                members.append((sp.offset, sp.offset + sp.length))
            elif sp.algo is None:
                pieces.append((sp.offset, sp.key[-2]))
        pieces.sort(key=lambda x: x[0])
        starts = [at for at, _ in pieces]
        for start, end in members:  # (each member's pieces by bisection: files of 10^5 tensors)
            inside = pieces[bisect.bisect_left(starts, start) : bisect.bisect_left(starts, end)]
            out[(file, start)] = list(dict.fromkeys(name for _, name in inside))
    return out


def _refuse_unfinished(path: Path, manifest: Manifest) -> None:
    """Refuse a checkpoint a save is still writing, or one that mixes saves' files
    (:func:`ckpttool.verify.unfinished`): every such finding named."""
    from ckpttool.verify import unfinished

    raise_together(
        [
            IncompleteCheckpointError(
                f"{f.message}; not sealed",
                hint=(
                    "a file of another save is mixed in: restore this step's file, then seal"
                    if f.rule == "step-mismatch"
                    else "seal once the save has finished; 'ckpttool verify' says the same of it"
                ),
                path=f.file,
                rule=f.rule,
            )
            for f in unfinished(ckio.followed(path), manifest)
        ]
    )


_NOT_SEALED = (
    "a seal vouches for the bytes it hashes: restore the damaged file from a good copy and seal again "
    "('ckpttool verify' lists every damaged member)"
)


@contextlib.contextmanager
def _not_sealing_damage(*, every: bool = False) -> Iterator[None]:
    """A CRC-32 that fails while sealing (a pickle read to describe or locate, a member hashed)
    stops the seal, said as such; with ``every``, any damage found (bytes added after an archive,
    a zip index that misplaces a member: while locating what the seal hashes), with its own hint."""
    try:
        yield
    except CorruptFileError as exc:
        crc = exc.rule == "checksum-mismatch"
        if exc.message.endswith("not sealed") or not (crc or every):
            raise
        hint = _NOT_SEALED if crc else exc.hint
        raise CorruptFileError(f"{exc.message}; not sealed", hint=hint, path=exc.path, rule=exc.rule) from None


def hash_pieces(
    adapter: Adapter,
    manifest: Manifest,
    algo: Algo,
    *,
    files: list[str] | None = None,
    workers: int | None = None,
    progress: Callable[[int], None] | None = None,
    known: dict[str, Written] | None = None,
) -> tuple[dict[str, Any], dict[tuple[str, int], str], dict[tuple[str, int], tuple[str, int, int] | None]]:
    """One pass: digests of ``files`` (default: every file of the manifest but a seal) and of every
    tensor piece. Returns (file digests, piece digests, piece spans). A file in ``known`` (by
    absolute path: what its writer hashed as it wrote it) is not read when its size and the spans
    of its pieces are the ones hashed (xxh3-128 only)."""
    root = Path(manifest.root)
    targets = files if files is not None else [f.path for f in manifest.files if f.role != "seal"]
    spans, other, expected = piece_spans(adapter, manifest)
    trusted: dict[str, Written] = {}
    known = known if algo == "xxh3-128" else None  # the writers take xxh3-128 digests
    for rel in targets if known else []:
        w = known.get(os.path.abspath(root / rel)) if known else None
        if w is None or (root / rel).stat().st_size != w.size:
            continue
        # (its members' CRC-32s are the writer's own, taken of the same bytes)
        if all(s.algo == "crc32" or (s.offset, s.length) in w.spans for s in spans.get(rel, [])):
            trusted[rel] = w
    with adapter.reader(manifest) as reader:
        to_read = [rel for rel in targets if rel not in trusted]
        file_digests, span_digests = hash_files(root, to_read, spans, algo, workers=workers, progress=progress)
        # (the first is enough to refuse)
        for file, message, _ in crc_failures(span_digests, expected, spans, reader)[:1]:
            raise CorruptFileError(message, path=file, rule="checksum-mismatch")
        for rel, w in trusted.items():
            file_digests[rel] = FileDigest(rel, w.size, w.digest)
            span_digests.update({s.key: w.spans[(s.offset, s.length)] for s in spans.get(rel, []) if s.algo is None})
        for name, i in other:
            item = manifest.items[name]
            span_digests[(name, i)] = hash_bytes(reader.read(item.pieces[i], item).reshape(-1).view("u1").data, algo)
    where: dict[tuple[str, int], tuple[str, int, int] | None] = {k: None for k in other}
    for rel, lst in spans.items():
        for s in lst:
            if s.algo is None:
                where[s.key] = (rel, s.offset, s.length)
    return file_digests, span_digests, where


class Copy(NamedTuple):
    """Data files with the same bytes that the metadata says hold different pieces."""

    files: tuple[str, ...]
    message: str
    severity: Literal["error", "warning"]
    hint: str = "restore the files from the save (a seal taken when it was written names the copy)"


def copied_files(adapter: Adapter, manifest: Manifest, digests: Mapping[str, FileDigest]) -> list[Copy]:
    """Data files with the same bytes (``digests``: each file's) where the metadata places
    different pieces, not replicas of one another: one was copied over another. Nothing else tells
    without a seal: a DCP file or a ``torch_dist`` one copied over another of its size and record
    structure reads as well-formed, each record where the metadata looks for one.

    An error where the two hold different parts of one tensor, not all one value, whose other
    parts (in files outside the group) differ from them: a shard copied over its neighbour's. A
    warning where nothing rules out a save that wrote them equal: different tensors only (tied or
    cloned weights), or parts of a tensor whose parts are all equal as far as can be seen (experts
    upcycled from one MLP, a tensor cut in two). Files whose tensors are all one value (zeros,
    ones) may hold the same bytes in a clean save and are let be."""
    groups: dict[tuple[int, str], list[str]] = {}
    for rel, d in digests.items():
        if d.digest is not None and d.size > 0:
            groups.setdefault((d.size, d.digest), []).append(rel)
    held: dict[str, list[tuple[Item, Piece]]] = {}
    parts: dict[str, list[tuple[Item, Piece]]] = {}  # a saved tensor's pieces (_parts_differ)
    found: list[Copy] = []
    root = Path(manifest.root)
    for (size, _), rels in sorted(groups.items(), key=lambda kv: sorted(kv[1])):
        if len(rels) < 2:
            continue
        if not held:
            for item in manifest.items.values():
                for p in item.pieces:
                    held.setdefault(p.file, []).append((item, p))
                if item.is_tensor:
                    parts.setdefault(item.saved_in or item.name, []).extend((item, p) for p in item.pieces)
        rels = sorted(rels)
        keys = {rel: {(i.name, p.box, p.flat) for i, p in held.get(rel, ())} for rel in rels}
        first = rels[0]
        other = next((r for r in rels[1:] if keys[r] != keys[first]), None)
        if other is None:
            continue  # replicas of one another (a DP copy each rank saved)
        theirs = {i.name: p for i, p in held.get(other, ())}
        with adapter.reader(manifest) as reader:
            raw = functools.partial(_raw_bytes, reader, root)
            proof = _parts_differ(raw, held.get(first, ()), held.get(other, ()), set(rels), parts)
            telling = (
                None
                if proof is not None
                else next(((i, p) for i, p in held.get(first, ()) if _not_one_value(raw(i, p), i)), None)
            )
        if proof is not None:
            item, p, (their_item, their_piece) = proof
            named = "" if their_item.name == item.name else f"{their_item.name} "
            example = f"{item.name} {_region(p)} in one, {named}{_region(their_piece)} in the other"
            severity: Literal["error", "warning"] = "error"
            unless = ""
        elif telling is not None:
            mine = {i.name for i, _ in held.get(first, ())}
            only = next((i.name for i, _ in held.get(other, ()) if i.name not in mine), None)
            q = theirs.get(telling[0].name)
            example = (
                f"{telling[0].name} {_region(telling[1])} in one, {_region(q)} in the other"
                if q is not None
                else f"{telling[0].name} in one, {only or 'other tensors'} in the other"
            )
            severity = "warning"
            unless = ", unless the save wrote them equal (tied, cloned or upcycled weights)"
            if (pair := _one_parameters_states(held.get(first, ()), held.get(other, ()))) is not None:
                severity, unless = "error", ""  # (no save writes a parameter's two states equal)
                example = f"{pair[0]} in one, {pair[1]} in the other, two states of one parameter"
        else:
            continue
        listed = ", ".join(rels[:-1]) + " and " + rels[-1] if len(rels) < 5 else ", ".join(rels[:4]) + " …"
        found.append(
            Copy(
                tuple(rels),
                f"{listed} hold the same {size:,} bytes, where the metadata places different pieces in them "
                f"({example}): one was copied over another{unless}; which, nothing in the checkpoint tells",
                severity,
            )
        )
    return found


def _one_parameters_states(
    mine: Iterable[tuple[Item, Piece]], theirs: Iterable[tuple[Item, Piece]]
) -> tuple[str, str] | None:
    """Two different optimizer states of one parameter (its ``exp_avg`` in one file, its
    ``exp_avg_sq`` in the other) held by two files of the same bytes: a moment file copied over its
    sibling, for no save writes them equal (``exp_avg_sq`` is a mean of squares, ``exp_avg`` one of
    signed values; a step is one count). None where the two files share no parameter so."""

    states = ("exp_avg", "exp_avg_sq", "fp32", "step")
    bases: dict[str, tuple[str, str]] = {}
    for item, _ in mine:
        if (got := param_state(item.name, states)) is not None:
            bases.setdefault(got[0], (item.name, got[1]))
    for item, _ in theirs:
        got = param_state(item.name, states)
        if got is not None and got[0] in bases and bases[got[0]][1] != got[1]:
            return bases[got[0]][0], item.name
    return None


def _parts_differ(
    raw: Callable[[Item, Piece], bytes | None],
    mine: Iterable[tuple[Item, Piece]],
    theirs: Iterable[tuple[Item, Piece]],
    group: set[str],
    parts: Mapping[str, list[tuple[Item, Piece]]],
) -> tuple[Item, Piece, tuple[Item, Piece]] | None:
    """A piece of ``mine`` that is a part of a tensor the other file holds another part of, not
    all one value, and unlike a third part of that tensor of its size in a file outside ``group``:
    the tensor's parts are not all equal, so two equal ones are a copy (looked at for a few). The
    tensor is the one the format saves an item's values in (``Item.saved_in``: megatron-core's
    stacked layers and experts, which ckpttool reads one item each); the pieces of all its items are
    its parts (``parts``, by that tensor's name). Returns the piece and the other file's (item, piece)."""

    def key(item: Item) -> str:
        return item.saved_in or item.name

    other = {key(i): (i, q) for i, q in theirs}
    looked = 0
    for item, p in mine:
        found = other.get(key(item))
        if found is None or not item.is_tensor or looked >= 8:
            continue
        their_item, q = found
        if their_item.name == item.name and (q.box, q.flat) == (p.box, p.flat):
            continue
        data = raw(item, p)
        if not _not_one_value(data, item):
            continue
        looked += 1
        places = {(item.name, p.box, p.flat), (their_item.name, q.box, q.flat)}
        thirds = [
            (i, r)
            for i, r in parts.get(key(item), ())
            if r.file not in group and r.nbytes == p.nbytes and (i.name, r.box, r.flat) not in places
        ]
        if any((b := raw(i, r)) is not None and b != data for i, r in thirds[:4]):
            return item, p, found
    return None


_LOOK = 4 << 20
"""Bytes of a piece the copy check reads (its first ones): a multi-GB shard is not held whole. A
prefix that is one value, or equal to another part's, gives the milder verdict, never a wrong one."""


def _raw_bytes(reader: PieceReader, root: Path, item: Item, piece: Piece) -> bytes | None:
    """A tensor piece's first :data:`_LOOK` bytes, read from its file where it is stored raw; None
    otherwise."""
    if not item.is_tensor or piece.nbytes == 0:
        return None
    try:
        span = reader.raw_span(piece, item)
    except CkptError:
        return None
    if span is None:
        return None
    with open(root / piece.file, "rb") as fh:
        fh.seek(span[0])
        return fh.read(min(span[1], _LOOK))


def _not_one_value(data: bytes | None, item: Item) -> bool:
    """Whether a tensor piece's bytes hold more than one element value (bytes two files hold the
    same only by being copies, or by the save writing them equal)."""
    if data is None or item.dtype is None:
        return False
    width = carrier(item.dtype).itemsize
    return len(data) > width and data[width:] != data[:-width]


def _region(p: Piece) -> str:
    return p.box.text() + (f" elements {p.flat[0]}..{p.flat[0] + p.flat[1]}" if p.flat is not None else "")


def _subfolders(root: Path, manifest: Manifest) -> dict[str, list[str]]:
    """The subfolders of each folder (relative to ``root``, "" for it) that holds data files:
    where a folder the checkpoint did not have when sealed is an extra file. Not the save directory
    above a tag or iteration folder, where later saves add theirs."""
    out: dict[str, list[str]] = {}
    for folder in sorted(
        {f.path.rsplit("/", 1)[0] if "/" in f.path else "" for f in manifest.files if f.role == "data"}
    ):
        try:
            out[folder] = sorted(p.name for p in (root / folder).iterdir() if p.is_dir())
        except OSError:
            continue
    return out


def _refuse_replacing_data(target: Path, out: str | Path) -> None:
    """``--out`` replaces an earlier seal (by its name, or by its first bytes: a seal's kind) or an
    empty file, never other data: a mistyped path would lose it without a word."""
    if is_seal_name(target.name):
        return
    kind = re.compile(rb'"kind"\s*:\s*"' + re.escape(SEAL_KIND.encode()) + rb'"')
    ckio.refuse_replacing_other_file(target, f"--out {out}", "a seal", kind.search)


def seal(
    path: str | Path,
    *,
    out: str | Path | None = None,
    algo: Algo = "xxh3-128",
    workers: int | None = None,
    progress: Callable[[int], None] | None = None,
    published_as: str | Path | None = None,
    known: dict[str, Written] | None = None,
) -> tuple[Seal, Path]:
    """Hash every file and piece of the checkpoint at ``path`` and write the seal atomically.
    ``published_as``: the path the directory will be renamed to (a writer sealing its staging
    directory), recorded as the seal's root instead of ``path``. ``known``: digests a writer took
    of the bytes it wrote (see :func:`hash_pieces`), so that those files are not read back."""
    if algo not in ("xxh3-128", "sha256"):
        raise UsageError(f"--hash {algo!r}: expected xxh3-128 or sha256")
    if out is None and default_seal_path(path).is_dir():  # (before any work)
        raise UsageError(
            f"{default_seal_path(path)}: a directory stands where the seal is written",
            hint="move it out of the way, or give --out",
        )
    with _not_sealing_damage(), ckio.checking_crcs():  # the pickles it reads are bytes it vouches for too
        adapter, manifest = registry.describe(path)
    _pt.hostile_beside(Path(manifest.root), manifest)
    for f in manifest.extras.get("findings") or ():  # damage the format's reader found and read past
        code_running = (f["rule"], f.get("severity")) == ("unsafe-pickle", "error")
        lacking = f["rule"] == "missing-file" and f.get("severity", "error") == "error"  # (an index: a warning)
        if f["rule"] in ("corrupt-file", "misplaced-file") or code_running or lacking:
            hint = f.get("hint") or _NOT_SEALED  # (with the finding's own hint, where it has one)
            raise CorruptFileError(f"{f['message']}; not sealed", hint=hint, path=f["file"], rule=f["rule"])
    # an item's pickle that runs code: the seal command does not vouch for it (a writer sealing its
    # output has carried such a record unread, as it carries a run's own class, and said so)
    for item in manifest.items.values() if known is None and published_as is None else ():
        named = item.refused_global
        if named is not None and hostile([named]):
            file = item.pieces[0].file if item.pieces else None
            raise CorruptFileError(
                f"{file}: {item.name}'s pickle refers to {named}, which runs code or reaches the system; not sealed",
                hint="the checkpoint may be hostile: do not load it with torch.load(weights_only=False); "
                "'ckpttool verify' names every such item",
                path=file,
                rule="unsafe-pickle",
            )
    if known is None and published_as is None:  # (not a writer sealing what it has just written)
        _refuse_unfinished(Path(path), manifest)
    target = Path(out) if out is not None else default_seal_path(path)
    replaces = os.path.lexists(target)  # (what the checks below judged, not a file made since)
    if out is not None:  # --out must not replace the checkpoint or one of its files
        data = {(Path(manifest.root) / f.path).resolve() for f in manifest.files if f.role != "seal"}
        resolved = ckio.resolved(target, f"--out {out}")
        if resolved in data | {Path(path).resolve()} or Path(path).resolve().is_relative_to(resolved):
            raise UsageError(
                f"--out {out} is, or holds, the checkpoint or one of its files", hint="write the seal elsewhere"
            )
        ckio.check_output_file(out, "--out")
        _refuse_replacing_data(target, out)
        inside = Path(path).is_dir() and target.resolve().is_relative_to(Path(manifest.root).resolve())
        if inside and not is_seal_name(target.name):
            # inside the checkpoint a file is checkpoint data unless its name says it is a seal
            raise UsageError(
                f"--out {out} lies inside the checkpoint, where {target.name} would count as one of its files",
                hint=f"name it {target.stem}.{SEAL_NAME}, or write it outside the checkpoint",
            )
    with _not_sealing_damage():
        file_digests, piece_digests, where = hash_pieces(
            adapter, manifest, algo, workers=workers, progress=progress, known=known
        )
    for f in manifest.files:
        d = file_digests.get(f.path)
        if d is not None:
            if d.changed or (d.digest is not None and d.size != f.size):
                how = d.error or f"{f.size:,} bytes when the checkpoint was read, {d.size:,} when hashed"
                raise CkptError(
                    f"{f.path} changed while it was sealed ({how}): not sealed",
                    hint="a writer is changing the checkpoint; seal it once the save has finished",
                    path=f.path,
                    rule="incomplete-save",
                )
            if d.digest is None:
                raise CorruptFileError(f"{f.path}: cannot be read ({d.error})", path=f.path)
            f.checksum = d.digest
    data_files = {f.path for f in manifest.files if f.role == "data"}
    for copy in copied_files(adapter, manifest, {rel: d for rel, d in file_digests.items() if rel in data_files}):
        if copy.severity == "error":  # (a warning's files may be what the save wrote: sealed)
            raise CorruptFileError(
                f"{copy.message}; not sealed", hint=copy.hint, path=copy.files[0], rule="misplaced-file"
            )
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
    folders = _subfolders(Path(manifest.root), manifest) if Path(path).is_dir() else None
    if published_as is not None:  # (with the folder inside it the reader went into: a save's iteration)
        manifest.root = os.path.normpath(Path(published_as) / os.path.relpath(manifest.root, path))
    result = Seal(
        algo=algo,
        head=_head(manifest),
        folders=folders,
        _manifest=manifest,
        _records=records,
        tool=f"ckpttool {__version__}",
        created=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    )
    # --out replaces what it was checked against above, not a file made since (the seal beside the
    # checkpoint is ckpttool's own: sealed again, it is replaced)
    with atomic_output(target, replace=out is None or replaces) as fh:
        fh.write(json.dumps(result.to_json(), separators=(",", ":")).encode())
    return result, target
