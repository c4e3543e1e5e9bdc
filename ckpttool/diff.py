"""``diff``: what changed between two checkpoints, whatever their formats and layouts.

Items are matched by :func:`ckpttool.naming.canonical` (plus optional renames). Tensors whose
pieces have the same geometry are compared piece by piece through their raw-byte digests first, so
equal checkpoints diff at read speed; others are compared region by region (memory: a few pieces,
whatever the tensor size): max abs difference, relative L2, elements that differ, first differing
index.
"""

from __future__ import annotations

import datetime
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ckpttool import _unpickle, registry
from ckpttool import io as ckio
from ckpttool.assemble import assemble, regions
from ckpttool.dtypes import as_numbers, carrier, float32_to_bf16
from ckpttool.dtypes import dtype as lookup_dtype
from ckpttool.errors import CkptError, UsageError
from ckpttool.formats.base import Adapter, PieceReader
from ckpttool.geometry import Box
from ckpttool.hashing import new_hasher
from ckpttool.manifest import KEPT_BESIDE, KINDS, SCHEMA_VERSION, STATE_KINDS, Item, Manifest
from ckpttool.naming import RANK_LABEL, canonical
from ckpttool.values import check_tolerance, native_array, same_value

Tolerance = Literal["strict", "standard", "relaxed"]
TOLERANCES: dict[str, tuple[float, float]] = {"strict": (0.0, 0.0), "standard": (1e-8, 1e-5), "relaxed": (1e-5, 1e-3)}
"""(atol, rtol): ``|a - b| <= atol + rtol * |b|`` counts as equal."""


@dataclass(slots=True, kw_only=True)
class TensorDiff:
    name: str
    a: str
    b: str
    max_abs: float
    rel_l2: float
    differing: int
    numel: int
    first_index: list[int] | None
    within_tolerance: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "a": self.a,
            "b": self.b,
            "max_abs_diff": self.max_abs,
            "rel_l2": self.rel_l2,
            "differing": self.differing,
            "numel": self.numel,
            "first_differing_index": self.first_index,
            "within_tolerance": self.within_tolerance,
        }


@dataclass(slots=True, kw_only=True)
class DiffReport:
    a: str
    b: str
    formats: tuple[str, str]
    atol: float
    rtol: float
    added: list[str] = field(default_factory=list)
    """items only in B: tensors, and non-tensor values (:func:`_one_sided_objects`)"""
    removed: list[str] = field(default_factory=list)
    """items only in A, likewise"""
    changed_meta: list[dict[str, Any]] = field(default_factory=list)
    """shape or dtype changes"""
    values: list[TensorDiff] = field(default_factory=list)
    """tensors whose values differ (within tolerance or not)"""
    objects: list[dict[str, Any]] = field(default_factory=list)
    """non-tensor values present on both sides that differ"""
    opaque: list[str] = field(default_factory=list)
    """RNG tensors of one side that the other side keeps inside opaque records (Megatron
    ``torch_dist``'s ``rng_state`` objects): not compared, and not a difference"""
    unread: list[dict[str, Any]] = field(default_factory=list)
    """non-tensor values on both sides that one side could not give (a refused pickle, damaged
    bytes): not compared, so the two are not shown equal"""
    notes: list[str] = field(default_factory=list)
    """the same state kept differently on the two sides, compared and found equal (the optimizer's
    step kept per param group on one side, per parameter on the other)"""
    not_compared: list[str] = field(default_factory=list)
    """state the two sides keep where diff does not read it (Adam's per-parameter steps in Megatron's
    legacy rank files), said so that "equal" is not taken to cover it"""
    copies: list[dict[str, Any]] = field(default_factory=list)
    """copies of a replicated tensor (a TP-replicated norm on another rank, a DP copy) whose values
    differ from the other side's, where the first copies compare equal: each rank loads its own
    copy, so this is a difference (``name``, ``side`` holding the copy, its ``file`` and ``rank``)"""
    identical: int = 0
    compared: int = 0

    @property
    def different(self) -> bool:
        return bool(
            self.added
            or self.removed
            or self.changed_meta
            or self.objects
            or self.copies
            or any(not v.within_tolerance for v in self.values)
        )

    @property
    def first(self) -> TensorDiff | None:
        """The first tensor out of tolerance, in A's checkpoint order."""
        return next((v for v in self.values if not v.within_tolerance), None)

    @property
    def largest(self) -> TensorDiff | None:
        out = [v for v in self.values if not v.within_tolerance]
        return max(out, key=lambda v: (v.rel_l2, v.max_abs)) if out else None

    def to_json(self) -> dict[str, Any]:
        first, largest = self.first, self.largest
        return {
            "schema_version": SCHEMA_VERSION,
            "a": self.a,
            "b": self.b,
            "formats": list(self.formats),
            "atol": self.atol,
            "rtol": self.rtol,
            "equal": not self.different and not self.unread,
            "compared": self.compared,
            "identical": self.identical,
            "added": self.added,
            "removed": self.removed,
            "changed": self.changed_meta,
            "values": [v.to_json() for v in self.values],
            "objects": self.objects,
            "not_compared_rng": self.opaque,
            "not_read": self.unread,
            "notes": self.notes,
            "not_compared": self.not_compared,
            "copies": self.copies,
            "first_divergence": first.name if first else None,
            "largest_divergence": largest.name if largest else None,
        }


def load_map(path: str | Path | None) -> dict[str, str]:
    """Renames from A's canonical names to B's: JSON ``{"old": "new"}`` or ``old=new`` lines, where
    ``old`` may be a regular expression (``re.sub`` replacement syntax)."""
    if path is None:
        return {}
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise UsageError(
            f"--map {path}: cannot be read ({reason})", hint="give a readable JSON or old=new file"
        ) from None
    try:
        data = json.loads(text)
        if not (isinstance(data, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in data.items())):
            raise UsageError(f"{path}: --map JSON must map strings to strings")
        renames: dict[str, str] = data
    except ValueError:
        pairs = [ln.split("=", 1) for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
        if any(len(p) != 2 for p in pairs):
            raise UsageError(f"{path}: --map lines must read old=new") from None
        renames = {a.strip(): b.strip() for a, b in pairs}
    for old in renames:
        if _is_pattern(old):
            try:
                re.compile(rf"^{old}$")
            except re.error as exc:
                raise UsageError(
                    f"--map {path}: {old!r} is not a regular expression ({exc})",
                    hint="escape the characters ^$()[]*+?\\ of a plain name with a backslash",
                ) from None
    return renames


def _is_pattern(old: str) -> bool:
    """Whether a ``--map`` name is a regular expression (else a name matched as it is)."""
    return any(c in old for c in "^$()[]*+?\\")


def _rules(renames: dict[str, str]) -> list[tuple[str, str, re.Pattern[str] | frozenset[str]]]:
    """``--map``'s renames as (old, new, what ``old`` matches): a compiled pattern, or a name as diff
    gives it and as ``ls`` prints it (``model.fc1.weight``, canonically ``fc1.weight``)."""
    return [
        (old, new, re.compile(old) if _is_pattern(old) else frozenset({old, canonical(old)}))
        for old, new in renames.items()
    ]


def _renamed(key: str, old: str, new: str, match: re.Pattern[str] | frozenset[str], into: set[str]) -> str | None:
    """``key`` after the ``--map`` rename ``old`` -> ``new``, None where ``old`` does not name it (a
    pattern matches the whole name). The result is named as diff names B's items: as given where B
    has that name, else canonical (``model.fc1.w`` is ``fc1.w``)."""
    if isinstance(match, frozenset):
        if key not in match:
            return None
        out = new
    else:
        if (m := match.fullmatch(key)) is None:
            return None
        try:
            out = m.expand(new)
        except re.error as exc:  # (a replacement naming a group the pattern has not: known once it matches)
            raise UsageError(
                f"--map: the replacement {new!r} of {old!r} cannot be applied to {key!r} ({exc})",
                hint="a replacement refers to the pattern's groups as \\1, \\2 ... (or \\g<name>): use groups it has",
            ) from None
    return out if out in into else canonical(out)


def _keyed(
    manifest: Manifest,
    renames: dict[str, str],
    pattern: re.Pattern[str] | None,
    kinds: set[str] | None = None,
    used: set[str] | None = None,
    into: set[str] | None = None,
) -> dict[str, Item]:
    """The items of ``manifest`` by canonical name after the ``--map`` renames into the names
    ``into`` (B's), filtered (``used`` gathers the renames that matched a name). Two items that the
    renames give one name are refused: one of them would drop out of the comparison unseen (A's
    ``layer.1.w`` gone, and "equal", under ``layer\\.(\\d+)\\.w=blk.0.w``)."""
    rules = _rules(renames)
    out: dict[str, Item] = {}
    for item in manifest.items.values():
        if kinds is not None and item.kind not in kinds:
            continue
        key = canonical(item.name)
        for old, new, match in rules:
            if (renamed := _renamed(key, old, new, match, into or set())) is not None:
                key = renamed
                if used is not None:
                    used.add(old)
        if pattern is not None and not pattern.search(key):
            continue
        if key in out and renames and canonical(out[key].name) != canonical(item.name):
            raise UsageError(
                f"--map gives {out[key].name!r} and {item.name!r} of A the one name {key!r}: "
                "one of them would not be compared",
                hint="map each of A's names to a name of its own",
            )
        out.setdefault(key, item)
    return out


def diff(
    a: str | Path,
    b: str | Path,
    *,
    atol: float | None = None,
    rtol: float | None = None,
    tolerance: Tolerance = "strict",
    pattern: str | None = None,
    renames: dict[str, str] | None = None,
    kinds: list[str] | None = None,
    progress: Callable[[int], None] | None = None,
) -> DiffReport:
    if tolerance not in TOLERANCES:
        raise UsageError(f"--tolerance {tolerance!r}: expected strict, standard or relaxed")
    base_atol, base_rtol = TOLERANCES[tolerance]
    atol = base_atol if atol is None else atol
    rtol = base_rtol if rtol is None else rtol
    for flag, value in (("--atol", atol), ("--rtol", rtol)):
        check_tolerance(flag, value)
    # (the bytes read checked against the CRC-32s their archives store: a flipped bit was shown as
    # a small difference in values, and "equal within tolerance" under --tolerance)
    with ckio.checking_crcs():
        return _diff(a, b, atol, rtol, pattern, renames, kinds, progress)


def _diff(
    a: str | Path,
    b: str | Path,
    atol: float,
    rtol: float,
    pattern: str | None,
    renames: dict[str, str] | None,
    kinds: list[str] | None,
    progress: Callable[[int], None] | None,
) -> DiffReport:
    adapter_a, ma = _described("A", a)
    adapter_b, mb = _described("B", b)
    rx = re.compile(pattern) if pattern else None
    wanted = None
    if kinds:
        wanted = set(kinds)
        unknown = sorted(wanted - set(KINDS))
        if unknown:
            raise UsageError(f"--kind {', '.join(unknown)}: expected kinds among {', '.join(KINDS)}")
    used: set[str] = set()
    kb = _keyed(mb, {}, rx, wanted)
    ka = _keyed(ma, renames or {}, rx, wanted, used, into={canonical(i.name) for i in mb.items.values()})
    if (rx or wanted) and not ka and not kb:  # (two checkpoints are not shown equal by comparing nothing)
        chosen = " and ".join(
            ([f"--filter {pattern!r}"] if rx else []) + ([f"--kind {','.join(sorted(wanted))}"] if wanted else [])
        )
        raise UsageError(
            f"{chosen} selects no item of either checkpoint: nothing to compare",
            hint="'ckpttool ls' lists the items and their kinds",
        )
    report = DiffReport(a=str(a), b=str(b), formats=(ma.format, mb.format), atol=atol, rtol=rtol)
    if unused := [old for old in renames or {} if old not in used]:  # (a typo renamed nothing, unseen)
        report.not_compared.append(
            f"--map {', '.join(repr(o) for o in unused)}: no name of A{' (of the kinds selected)' if wanted else ''} "
            "matches, so nothing was renamed by it (a pattern is matched against names as diff gives them: "
            "without a model. or module. prefix)"
        )
    report.removed = [k for k, i in ka.items() if i.is_tensor and k not in kb]
    report.added = [k for k, i in kb.items() if i.is_tensor and k not in ka]
    report.removed += _one_sided_objects(ma, mb, ka, kb)
    report.added += _one_sided_objects(mb, ma, kb, ka)
    _unused_one_side(report, ma, ka, mb, kb)
    # RNG state one side splits into tensors and the other keeps in opaque records (named otherwise)
    if _opaque_rng(mb):
        report.opaque += [k for k in report.removed if ka[k].kind == "rng"]
        report.removed = [k for k in report.removed if ka[k].kind != "rng"]
    if _opaque_rng(ma):
        report.opaque += [k for k in report.added if kb[k].kind == "rng"]
        report.added = [k for k in report.added if kb[k].kind != "rng"]
    with adapter_a.reader(ma) as ra, adapter_b.reader(mb) as rb:
        _regrouped_steps(report, ka, kb, ra, rb)
        _extra_masters(report, ka, kb, ra, rb)
        _weights_as_masters(report, ka, kb, ra, rb)
        _rng_copies(report, ka, kb, ra, rb)
        # a tensor one side names on its own and the other keeps inside an object item (megatron-core's
        # grad scaler: a ShardedObject in torch_dist, its scale a tensor once written as torch.save)
        for mine, other, theirs, r_mine, r_theirs, mine_is_a in (
            (report.added, ka, kb, ra, rb, False),
            (report.removed, kb, ka, rb, ra, True),
        ):
            objects: dict[str, Any] = {}  # each object item read once
            for key in list(mine):
                inner = _inside_object(key, other, r_mine, objects)
                if inner is None:
                    continue
                item = theirs[key]
                values = assemble(r_theirs, item)
                mine.remove(key)
                report.compared += 1
                va, vb = (values, inner) if mine_is_a else (inner, values)
                if va.dtype != vb.dtype or va.shape != vb.shape:
                    report.changed_meta.append(
                        {
                            "name": key,
                            "a": {"dtype": str(va.dtype), "shape": list(va.shape)},
                            "b": {"dtype": str(vb.dtype), "shape": list(vb.shape)},
                        }
                    )
                    continue
                dtype = item.dtype or str(values.dtype)  # the carrier of both: bfloat16 read as uint16
                acc = _Accumulator(atol, rtol)
                acc.add(va.reshape(-1), vb.reshape(-1), dtype, dtype, Box.whole(va.shape))
                d = acc.result(key, key, key, va.size)
                if d.differing == 0:
                    report.identical += 1
                else:
                    report.values.append(d)
        for key, ia in ka.items():
            ib = kb.get(key)
            if ib is None:
                continue
            if not ia.is_tensor or not ib.is_tensor:
                if ia.error or ib.error:  # (its value reads as None: not one to compare)
                    report.unread.append({"name": key, "a": ia.error, "b": ib.error})
                elif ia.is_tensor or ib.is_tensor:
                    _tensor_and_value(report, key, ra, ia, rb, ib)
                elif ia.summary is not None or ib.summary is not None or ia.nonfinite or ib.nonfinite:
                    # (too large to keep, or holding a NaN or an Inf, which the manifest keeps as its text
                    # ('inf', the string's own spelling) and without its sign bit: both read)
                    _compare_large_objects(report, key, ra, ia, rb, ib)
                elif not same_value(ia.value, ib.value):
                    report.objects.append({"name": key, "a": ia.value, "b": ib.value})
                continue
            report.compared += 1
            if ia.shape != ib.shape or ia.dtype != ib.dtype:
                report.changed_meta.append(
                    {
                        "name": key,
                        "a": {"dtype": ia.dtype, "shape": list(ia.shape or ())},
                        "b": {"dtype": ib.dtype, "shape": list(ib.shape or ())},
                    }
                )
                continue
            try:
                if _same_pieces(ia, ib):
                    report.identical += 1
                    continue
                d = _compare(key, ra, ia, rb, ib, atol, rtol)
                # (the first copies agree: the others must too; a damaged copy is not read)
                copies = _copies_that_differ(key, ra, ia, rb, ib, atol, rtol) if d.within_tolerance else []
            except _Unread as exc:  # (damaged bytes on a side: not read, never shown equal or different)
                said = exc.error.message
                if exc.error.rule == "checksum-mismatch":  # (the read that completed the member: the damage
                    said += " (the bytes of this tensor or of another that shares its zip member)"  # may be another's)
                report.unread.append({"name": key, exc.side: said, exc.other: None})
                continue
            if d.differing == 0:
                report.identical += 1
            else:
                report.values.append(d)
            report.copies += copies
            if progress is not None:
                progress(ia.nbytes)
    _unfinished_members(report, ma, mb)
    _state_in_pickles(report, ma, mb, wanted, rx, {i.kind for i in (*ka.values(), *kb.values())})
    _safetensors_metadata(report, ma, mb, wanted, rx)
    _state_beside(report, ma, mb, wanted, rx)  # (last: the steps above look up what they list by item name)
    return report


def _unused_one_side(report: DiffReport, ma: Manifest, ka: dict[str, Item], mb: Manifest, kb: dict[str, Item]) -> None:
    """A parameter the source format knows nothing trains (megatron-core's output layer on a tied
    model's MTP last stage, ``extras["unused"]``), with its optimizer state, held on one side only:
    a note, not a difference. A reshard or conversion leaves it out where the target has no such
    stage (docs/reshard.md: it does not change training), and diff called the result different."""
    from ckpttool.export import unused_states

    for side, listed, manifest, keyed in (("A", report.removed, ma, ka), ("B", report.added, mb, kb)):
        unused = set(unused_states(manifest))
        gone = [k for k in listed if keyed[k].name in unused]
        if not gone:
            continue
        for k in gone:
            listed.remove(k)
        report.not_compared.append(
            f"{', '.join(sorted(gone))} of {side} only: a parameter megatron-core allocates on a tied model's "
            "MTP last stage but never uses, with its optimizer state (left out where the other layout has no "
            "such stage; training is the same)"
        )


def _unfinished_members(report: DiffReport, ma: Manifest, mb: Manifest) -> None:
    """The zip members read only in part (a distributed optimizer's or a ZeRO partition's buffer,
    with padding no tensor covers; what a --filter left out) judged whole, as convert does before
    it publishes: a flipped bit there was never checked, and a damaged copy diffed "equal within
    tolerance". A member that fails is "not read", on the side whose file it is."""
    try:
        ckio.finish_partial()
    except CkptError as exc:
        where = Path(getattr(exc, "file_path", "") or "").resolve()
        sides = [s for s, m in (("a", ma), ("b", mb)) if where.is_relative_to(Path(m.root).resolve())] or ["a", "b"]
        entry: dict[str, Any] = {"name": f"(bytes of {exc.path})", "a": None, "b": None}
        for side in sides:
            entry[side] = exc.message
        report.unread.append(entry)


class _Unread(Exception):
    """A side's bytes could not be read (they fail their CRC-32, the file is cut short)."""

    def __init__(self, side: str, error: CkptError) -> None:
        super().__init__(error.message)
        self.side, self.other, self.error = side, "b" if side == "a" else "a", error


def _from(side: str, read: Callable[[], np.ndarray]) -> np.ndarray:
    """``read()``, an error naming the side that could not give the bytes."""
    try:
        return read()
    except CkptError as exc:
        raise _Unread(side, exc) from None


def _tensor_and_value(report: DiffReport, key: str, ra: PieceReader, ia: Item, rb: PieceReader, ib: Item) -> None:
    """An item that is a tensor on one side and a value on the other (Adam's step: a tensor in
    current torch, a number in older torch and other frameworks; it was skipped, and diff said
    "equal" whatever the two held). The same state when the tensor holds one element equal to the
    number: then compared, identical, and a note. Otherwise a value that differs, the tensor shown
    by its dtype and shape (and its one element)."""
    tensor, reader, value = (ia, ra, ib) if ia.is_tensor else (ib, rb, ia)
    shown = f"tensor {tensor.dtype}{list(tensor.shape or ())}"
    number = value.summary is None and isinstance(value.value, bool | int | float)
    if tensor.dtype is not None and math.prod(tensor.shape or ()) == 1:
        try:
            element = as_numbers(assemble(reader, tensor).reshape(-1), tensor.dtype)[0].item()
        except CkptError:
            report.unread.append(
                {"name": key, "a": shown if ia.is_tensor else ia.value, "b": shown if ib.is_tensor else ib.value}
            )
            return
        shown = f"{shown} {element!r}"
        if number and element == value.value:
            report.compared += 1
            report.identical += 1
            where = "A" if ia.is_tensor else "B"
            report.notes.append(f"{key}: a tensor on {where}, a number on the other side; both {element:g}")
            return
    theirs = value.value if value.summary is None else value.summary
    report.objects.append({"name": key, "a": shown if ia.is_tensor else theirs, "b": shown if ib.is_tensor else theirs})


def _compare_large_objects(report: DiffReport, key: str, ra: PieceReader, ia: Item, rb: PieceReader, ib: Item) -> None:
    """Non-tensor values too large for the manifest to keep (a Python RNG state, a scheduler's list
    of more than 16 learning rates, a long string, a set, an ``io.BytesIO``): read from both sides
    and compared as the small ones are (:func:`_comparable`); a difference shown by their
    summaries. A value holding what diff cannot compare (a tensor inside a tuple, which DCP keeps
    in one pickle; a whole state dict, which DCP saved with ``flatten_state_dict=False``) is said
    not to be compared, and is not shown equal: it was left out, and "equal" covered it (two such
    state dicts whose weights differed were "equal", exit 0)."""
    # (RNG state kept as a value holding tensors, torch_dist's rng_state objects: not compared, as
    # before; a layout between the two may keep fewer ranks' states, whose places then hold copies)
    rng = ia.kind == "rng" or ib.kind == "rng"
    try:
        a, b = ra.read_object(ia), rb.read_object(ib)
        a = _comparable(a, tensor=None if rng else _tensors_in(ra, ia))
        b = _comparable(b, tensor=None if rng else _tensors_in(rb, ib))
    except (CkptError, NotImplementedError, KeyError):
        report.unread.append({"name": key, "a": ia.summary, "b": ib.summary})
        return
    except _NotComparable as exc:
        report.not_compared.append(f"{key}: it holds {exc}, which diff does not compare inside a value")
        if not rng:
            report.unread.append({"name": key, "a": ia.summary, "b": ib.summary})
        return
    if not same_value(a, b):
        shown_a = ia.value if ia.summary is None else f"{ia.summary} ({_digest_of(a)})"
        shown_b = ib.value if ib.summary is None else f"{ib.summary} ({_digest_of(b)})"
        if shown_a == shown_b:  # (inf against 'inf', a NaN against the other NaN: told apart)
            shown_a, shown_b = _typed(a), _typed(b)
        report.objects.append({"name": key, "a": shown_a, "b": shown_b})


def _typed(value: Any) -> str:
    """A value's text with its type, a NaN's with its sign (``float -nan``, ``str 'inf'``)."""
    if isinstance(value, float) and math.isnan(value):
        return f"float {'-' if math.copysign(1.0, value) < 0 else ''}nan"
    if isinstance(value, list | tuple | dict):
        return f"{type(value).__name__} {_unpickle.brief(value, 120)}"
    return f"{type(value).__name__} {value!r}"


class _NotComparable(Exception):
    """A value holds something :func:`_comparable` has no plain form of (its args: what)."""


_MAX_TENSOR_IN_VALUE = 64 << 20
"""largest tensor inside a value (an RNG state, a pickled state dict) diff reads to compare"""


def _tensors_in(reader: PieceReader, item: Item) -> Callable[[Any], np.ndarray] | None:
    """How to read a tensor inside ``item``'s value, where the reader can (a torch.save file's, a
    DCP record's): None elsewhere."""
    read_in = getattr(reader, "read_in_object", None)
    return partial(read_in, item) if read_in is not None else None


def _comparable(value: Any, depth: int = 0, tensor: Callable[[Any], np.ndarray] | None = None) -> Any:
    """``value`` as the plain data :func:`~ckpttool.values.same_value` compares: Python's plain
    values, NumPy arrays (NumPy's RNG state), sets (in an order of their own), ``bytearray`` as
    bytes, an ``io.BytesIO`` by its bytes, an allowlisted class's stand-in by its name and
    attributes, a numpy number as a 0-d array, arrays in the machine's byte order, times by their
    ``repr``, a tensor (read with ``tensor``, up to 64 MB) by its dtype, shape and bytes.
    _NotComparable for anything else (a tensor where there is no way to read it, nesting past 32)."""
    if isinstance(value, np.generic | np.ndarray):
        return native_array(value)
    if value is None or isinstance(value, bool | int | float | complex | str | bytes):
        return value
    if isinstance(value, datetime.date | datetime.time | datetime.timedelta | datetime.tzinfo):
        return (type(value).__name__, repr(value))  # (an aware time equals the same instant elsewhere: not here)
    if isinstance(value, _unpickle.NumpyDType):
        return ("numpy.dtype", value.dtype.str)
    if depth > 32:
        raise _NotComparable("values nested more than 32 deep")
    if isinstance(value, bytearray):
        return ("bytearray", bytes(value))
    if isinstance(value, _unpickle.OpaqueBytes):
        return ("io.BytesIO", value.data)
    if isinstance(value, set | frozenset):
        return ("set", sorted((_comparable(v, depth + 1, tensor) for v in value), key=repr))
    if isinstance(value, list | tuple):
        return [_comparable(v, depth + 1, tensor) for v in value]
    if isinstance(value, dict):
        return {k: _comparable(v, depth + 1, tensor) for k, v in value.items()}
    if isinstance(value, _unpickle.Record):
        return (type(value)._qualname, _comparable(dict(value.__dict__), depth + 1, tensor))
    if isinstance(value, _unpickle.EnumValue):
        return ("enum", value.enum, value.value)
    if isinstance(value, _unpickle.TensorRef):
        nbytes = math.prod(value.shape) * lookup_dtype(value.dtype).itemsize
        if tensor is None or nbytes > _MAX_TENSOR_IN_VALUE:
            raise _NotComparable("a tensor")
        return ("tensor", value.dtype, tuple(value.shape), np.ascontiguousarray(tensor(value)).tobytes())
    raise _NotComparable(f"a {type(value).__name__}")


def _digest_of(value: Any) -> str:
    """A short digest of a value :func:`_comparable` gave, to tell two large values apart in a
    report: of every element (an array's ``repr`` leaves out all but its ends, so two arrays that
    differ in the middle showed one digest)."""
    h = new_hasher("sha256")
    _feed(h, value)
    return "sha256 " + h.hexdigest()[:12]


def _feed(h: Any, value: Any, depth: int = 0) -> None:
    if isinstance(value, np.ndarray):
        h.update(f"array {value.dtype.str} {value.shape} ".encode())
        h.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, list | tuple) and depth < 64:
        h.update(b"[" if isinstance(value, list) else b"(")
        for v in value:
            _feed(h, v, depth + 1)
            h.update(b",")
        h.update(b"]")
    elif isinstance(value, dict) and depth < 64:
        h.update(b"{")
        for k, v in value.items():
            h.update(repr(k).encode(errors="surrogatepass") + b":")
            _feed(h, v, depth + 1)
            h.update(b",")
        h.update(b"}")
    else:
        h.update(repr(value).encode(errors="surrogatepass"))


_STATE_KINDS = ("dataloader", "scheduler", "counter", "rng")
_USERS_OWN = ("torch", "dcp", "safetensors")
"""Formats whose every value is the training loop's own (no layout keeps objects of its own in
them): between two of one of these, any value one side lacks is a difference."""


def _one_sided_objects(mine: Manifest, theirs: Manifest, keyed: dict[str, Item], other: dict[str, Item]) -> list[str]:
    """Non-tensor training state of ``mine`` the other side lacks (a dataloader cursor, a
    scheduler, the step, an optimizer hyperparameter lost: ``diff`` said "equal"). Of two
    checkpoints of one format, each such item (state kinds, and param groups' hyperparameters;
    every value in a format of the user's own state dict, ``_USERS_OWN``);
    across formats, whose names for the same state differ, those of a kind the other side holds
    none of at all (a DCP checkpoint converted to safetensors: its step, dataloader and scheduler
    are gone), param groups' hyperparameters where the other side keeps none (its moments, which
    are tensors, do not keep them), and RNG states kept as values (Python's, NumPy's) where the
    other side keeps its RNG as tensors only. Objects that describe how a layout stores its data
    (a distributed optimizer's bucket sizes, a stacked layer's ``_extra_state`` shards) differ
    with the layout, not the state."""
    one_sided = [k for k, i in keyed.items() if not i.is_tensor and k not in other]
    if mine.format == theirs.format in _USERS_OWN:  # (a config value, a token count, a tag removed)
        return one_sided
    if mine.format == theirs.format:
        return [k for k in one_sided if keyed[k].kind in _STATE_KINDS or ".param_groups." in k]
    held = {i.kind for i in other.values()}
    held_as_values = {i.kind for i in other.values() if not i.is_tensor}
    # (param groups kept as items, in an object item holding the optimizer's state dict, in pickles)
    groups = "optim" in held_as_values or bool(theirs.extras.get("unread_state"))

    def lost(key: str) -> bool:
        kind = keyed[key].kind
        if ".param_groups." in key:  # (the other side's moments are tensors: its hyperparameters gone)
            return not groups
        if kind == "rng":  # (Python's and NumPy's RNG states are values; torch's are tensors)
            return kind not in held_as_values
        return kind in _STATE_KINDS and kind not in held

    return [k for k in one_sided if lost(k)]


def _described(side: str, path: str | Path) -> tuple[Adapter, Manifest]:
    """``registry.describe``, its errors saying which of the two checkpoints they are about (they
    name a file inside it, which both may have)."""
    try:
        return registry.describe(path)
    except CkptError as exc:
        where = side if exc.message.startswith(str(path)) else f"{side} ({path})"
        exc.message = f"{where}: {exc.message}"
        exc.args = (exc.message,)
        raise


_GROUP_STEP = re.compile(r"^(?:optim|optimizer)\.param_groups\.(\d+)\.step$")


def _regrouped_steps(
    report: DiffReport, ka: dict[str, Item], kb: dict[str, Item], ra: PieceReader, rb: PieceReader
) -> None:
    """The optimizer's step kept once per param group on one side (``optimizer.param_groups.<g>.step``:
    a ZeRO checkpoint, torch's optimizer state dict) and once per parameter on the other
    (``<param>.step``: DeepSpeed's universal checkpoint, torch's per-parameter Adam state): the two
    are the same state when every step on both sides holds one value, which is then one tensor
    compared and identical per key, and a note. Steps that differ stay unmatched (which parameter
    belongs to which group is not known here), and so does a side holding both kinds."""

    def kinds(keyed: dict[str, Item], keys: list[str]) -> tuple[list[str], list[str]]:
        groups = [k for k in keys if _GROUP_STEP.match(k)]
        params = [
            k
            for k in keys
            if k.endswith(".step")
            and keyed[k].kind == "optim"
            and (k[: -len(".step")] in keyed or f"{k[: -len('.step')]}.fp32" in keyed)  # (a universal one: no weights)
        ]
        return groups, params

    a_groups, a_params = kinds(ka, report.removed)
    b_groups, b_params = kinds(kb, report.added)
    if a_groups and b_params and not a_params and not b_groups:
        groups, params, side = (a_groups, ra, ka), (b_params, rb, kb), ("A", "B")
    elif b_groups and a_params and not b_params and not a_groups:
        groups, params, side = (b_groups, rb, kb), (a_params, ra, ka), ("B", "A")
    else:
        return
    values: set[float] = set()
    for keys, reader, keyed in (groups, params):
        for k in keys:
            item = keyed[k]
            if item.shape not in ((), (1,)):
                return
            try:
                v = assemble(reader, item).reshape(-1)
            except CkptError:
                return
            values.add(float(v[0]))
            if len(values) > 1:
                return
    (value,) = values
    _same_state(
        report,
        [*groups[0], *params[0]],
        f"optimizer step: {side[0]} keeps it per param group ({len(groups[0])}), {side[1]} per parameter "
        f"({len(params[0])}); all hold {value:g}",
    )


def _same_state(report: DiffReport, keys: list[str], note: str) -> None:
    """``keys``, kept on one side only, found to hold the same state as the other side keeps
    otherwise: no longer added or removed, counted compared and identical, and ``note`` said.
    The lists are filtered in place, once (removing key by key is quadratic)."""
    matched = set(keys)
    report.removed[:] = [k for k in report.removed if k not in matched]
    report.added[:] = [k for k in report.added if k not in matched]
    report.compared += len(keys)
    report.identical += len(keys)
    report.notes.append(note)


def _shown(names: list[str]) -> str:
    """The first five of ``names``, for a note ("a, b, c, d, e …")."""
    return ", ".join(names[:5]) + (" …" if len(names) > 5 else "")


def _same_listed(report: DiffReport, keys: list[str], note: str) -> None:
    """:func:`_same_state` of ``keys`` (none: nothing), ``note``'s ``{shown}`` the first five."""
    if keys:
        _same_state(report, keys, note.format(shown=_shown(keys)))


def _extra_masters(
    report: DiffReport, ka: dict[str, Item], kb: dict[str, Item], ra: PieceReader, rb: PieceReader
) -> None:
    """An fp32 copy (``<param>.fp32``) that one side keeps of a tensor both sides hold and the
    other keeps only as the tensor itself (DeepSpeed's universal checkpoint writes ``fp32.pt`` for
    buffers and frozen parameters too): the same state when it holds the tensor's own values
    exactly, which is then compared and identical, and a note. Any other is left unmatched."""
    for mine, keyed, reader, other, side in ((report.removed, ka, ra, kb, "A"), (report.added, kb, rb, ka, "B")):
        same = []
        for k in list(mine):
            base = k[: -len(".fp32")]
            item = keyed[k]
            if not k.endswith(".fp32") or item.kind != "master" or base not in keyed or base not in other:
                continue
            param = keyed[base]
            if not param.is_tensor or param.shape != item.shape or item.dtype != "float32":
                continue
            try:
                copy = assemble(reader, item).reshape(-1)
                values = as_numbers(assemble(reader, param).reshape(-1), param.dtype or "float32")
            except CkptError:
                continue
            if np.array_equal(copy.view(np.uint32), values.astype(np.float32).view(np.uint32)):
                same.append(k)
        if same:
            shown = _shown([k[: -len(".fp32")] for k in same])
            _same_state(
                report,
                same,
                f"fp32 copies: {side} keeps one of {len(same)} tensor(s) the other side keeps only as themselves "
                f"({shown}); each holds its tensor's values exactly",
            )


def _state_in_pickles(
    report: DiffReport,
    ma: Manifest,
    mb: Manifest,
    wanted: set[str] | None,
    rx: re.Pattern[str] | None,
    selected: set[str],
) -> None:
    """State checkpoints keep in their files' pickles, not as items: two Megatron checkpoints' data
    position (``args.consumed_train_samples``) is compared, a difference is a value that differs
    (it said "equal" with the samples changed), and one held on one side only is noted; the
    optimizer state there (Megatron's param groups and Adam's steps, DeepSpeed's fp16 loss scaler:
    ``extras["unread_state"]``) is not read, and the report says so, whatever the other side's
    format (against a conversion that dropped it, diff said "equal" with no word). Under
    ``--kind`` or ``--filter`` (``rx``), the data position only when they select its name or kind,
    the note only when the items compared (of ``selected`` kinds) hold optimizer state."""
    da, db = ((m.extras.get("state_in_metadata") or {}).get("dataloader") for m in (ma, mb))
    name = "args.consumed_train_samples"
    chosen = (wanted is None or "dataloader" in wanted) and (rx is None or rx.search(name))
    if da is not None and db is not None and da != db and chosen:
        report.objects.append({"name": name, "a": da, "b": db})
    elif (da is None) != (db is None) and chosen:  # (a Megatron checkpoint against its conversion: "equal", no word)
        side, value, other = ("A", da, "B") if da is not None else ("B", db, "A")
        said = value if isinstance(value, str) and value.startswith(name) else f"{name} ({value})"
        report.not_compared.append(f"{said} of {side}, its data position: {other} keeps none")
    optim = (wanted is None or "optim" in wanted) and (rx is None or "optim" in selected)
    ga, gb = (m.extras.get("param_groups") for m in (ma, mb))
    groups = bool(optim and isinstance(ga, dict) and isinstance(gb, dict) and ga and gb)
    if groups:
        _param_groups(report, ga, gb)  # type: ignore[arg-type]
    unread = [(side, m.extras["unread_state"]) for side, m in (("A", ma), ("B", mb)) if m.extras.get("unread_state")]
    from ckpttool.formats.megatron import GROUPS_UNREAD

    for side, what in unread if optim else ():
        if groups:  # (their lr, betas and eps were compared above)
            what = [_GROUPS_LEFT if w == GROUPS_UNREAD else w for w in what]
        report.not_compared.append(
            f"{'; '.join(what)} of {side}, kept in its rank files' optimizer pickles (not read as items)"
        )


_GROUPS_LEFT = "the param groups' weight decay and other settings (their lr, betas and eps are compared)"


def _param_groups(report: DiffReport, ga: dict[str, Any], gb: dict[str, Any]) -> None:
    """Two Megatron checkpoints' param groups (``extras["param_groups"]``: file -> the groups'
    lr, betas and eps: ``formats.megatron.GROUP_HYPER``), kept in the rank files' pickles: each
    one's values over every group of every file, compared as sets, whatever the layouts (a reshard
    changes how the groups fall into files, not the learning rates and betas they hold). One that
    differs is a value that differs, ``optimizer.param_groups.*.<key>`` (diff said "equal" of two
    saves whose lr and betas differed)."""

    def values(held: dict[str, Any]) -> dict[str, list[Any]]:
        out: dict[str, dict[str, Any]] = {}
        for groups in held.values():
            for group in groups if isinstance(groups, list) else ():
                for k, v in group.items() if isinstance(group, dict) else ():
                    out.setdefault(k, {})[json.dumps(v, sort_keys=True)] = v
        return {k: [vs[j] for j in sorted(vs)] for k, vs in out.items()}

    va, vb = values(ga), values(gb)
    for key in sorted(set(va) | set(vb)):
        if va.get(key) != vb.get(key):
            report.objects.append({"name": f"optimizer.param_groups.*.{key}", "a": va.get(key), "b": vb.get(key)})


def _safetensors_metadata(
    report: DiffReport, ma: Manifest, mb: Manifest, wanted: set[str] | None, rx: re.Pattern[str] | None
) -> None:
    """Two safetensors checkpoints' ``__metadata__`` (a trainer's step, a model's revision): each
    key that differs, or that one side lacks, is a value that differs, named ``__metadata__.<key>``
    (two files that differed only there were "equal"). The ``format`` tag and ckpttool's own
    ``ckpttool.*`` keys (where a file it wrote came from) are not the checkpoint's state: left out.
    Not under ``--kind``; under ``--filter``, the keys whose names it selects."""
    if not (ma.format == mb.format == "safetensors") or wanted is not None:
        return

    def merged(m: Manifest) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for meta in (m.extras.get("metadata") or {}).values():
            for k, v in meta.items():
                if k != "format" and not k.startswith("ckpttool."):
                    out.setdefault(k, v)
        return out

    a, b = merged(ma), merged(mb)
    for key in sorted(set(a) | set(b)):
        name = f"__metadata__.{key}"
        if a.get(key) != b.get(key) and (rx is None or rx.search(name)):
            report.objects.append({"name": name, "a": a.get(key), "b": b.get(key)})


def _state_beside(
    report: DiffReport, ma: Manifest, mb: Manifest, wanted: set[str] | None, rx: re.Pattern[str] | None
) -> None:
    """Training state a checkpoint keeps in files beside its format's (a Hugging Face Trainer's
    ``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth``: ``extras["state_files"]``), which ckpttool
    reads as state but does not compare value by value: held on one side only, it is a difference
    (a Trainer checkpoint against its model alone was "equal"); on both, the files' bytes are
    compared (a difference names the file, not the values in it). Under ``--filter`` (``rx``),
    only the files whose names it selects."""
    kinds = {s: STATE_KINDS[s] for s in KEPT_BESIDE}
    held_a, held_b = (
        {
            s: f
            for s, f in (m.extras.get("state_files") or {}).items()
            if s in kinds and kinds[s] in (wanted or KINDS) and (rx is None or rx.search(f))
        }
        for m in (ma, mb)
    )
    for state, rel in held_a.items():
        said = f"{rel} ({state} state, kept beside the model)"
        if state not in held_b and not any(i.kind == kinds[state] for i in mb.items.values()):
            report.removed.append(said)
        elif state in held_b:
            ours, theirs = (_file_digest(Path(m.root) / f) for m, f in ((ma, rel), (mb, held_b[state])))
            if ours != theirs:
                report.objects.append({"name": said, "a": f"{rel}: {ours}", "b": f"{held_b[state]}: {theirs}"})
    for state, rel in held_b.items():
        if state not in held_a and not any(i.kind == kinds[state] for i in ma.items.values()):
            report.added.append(f"{rel} ({state} state, kept beside the model)")


def _file_digest(path: Path) -> str:
    """xxh3-128 of a file's bytes, or why it has none."""
    from ckpttool.hashing import hash_file

    got, _ = hash_file(path.parent, path.name, [], "xxh3-128")
    return got.digest or f"unreadable ({got.error})"


def _weights_as_masters(
    report: DiffReport, ka: dict[str, Item], kb: dict[str, Item], ra: PieceReader, rb: PieceReader
) -> None:
    """A parameter's weights that one side keeps beside their fp32 copy and the other keeps only
    as that copy (DeepSpeed's universal checkpoint of a pipeline run: ``ds_to_universal`` writes
    no layer files, whose weights the optimizer's fp32 copies give back): the same state when
    the other side's copy, narrowed to the weights' dtype as the optimizer narrows it after each
    step, gives the weights bit for bit; then compared and identical, and a note. Where the
    narrowed copy differs, the weights are compared with it as values (a changed element of a
    ZeRO-3 partition's fp32 copy read as "only in A: emb.weight", as if the parameter were gone)."""
    for mine, keyed, reader, other, r_other, side in (
        (report.removed, ka, ra, kb, rb, "A"),
        (report.added, kb, rb, ka, ra, "B"),
    ):
        same, differ = [], []
        for k in mine:
            item, copy = keyed[k], other.get(f"{k}.fp32")
            if item.kind != "param" or copy is None or copy.kind != "master":
                continue
            # (a copy of the weights' own dtype: a frozen parameter's, which ZeRO-3 keeps as it trains none)
            if copy.dtype != item.dtype and (copy.dtype != "float32" or item.dtype not in _NARROWED):
                continue
            if f"{k}.fp32" not in keyed or item.shape != copy.shape or item.dtype is None:
                continue
            try:
                weights = assemble(reader, item).reshape(-1)
                kept = assemble(r_other, copy).reshape(-1)
                narrowed = kept if copy.dtype == item.dtype else _NARROWED[item.dtype](kept.view(np.float32))
            except CkptError:
                continue
            if weights.tobytes() == narrowed.tobytes():
                same.append(k)
                continue
            acc = _Accumulator(report.atol, report.rtol)
            va, vb = (weights, narrowed) if side == "A" else (narrowed, weights)
            acc.add(va, vb, item.dtype, item.dtype, Box.whole(tuple(item.shape or ())))
            differ.append(k)
            report.compared += 1
            report.values.append(acc.result(k, item.dtype, item.dtype, weights.size))
        if differ:
            gone = set(differ)
            mine[:] = [k for k in mine if k not in gone]
            report.notes.append(
                f"weights: {side} keeps {len(differ)} parameter(s) beside their fp32 copies, the other side only as "
                f"those copies ({_shown(differ)}): compared with the copies "
                "narrowed to the weights' dtype"
            )
        _same_listed(
            report,
            same,
            f"weights: {side} keeps {len(same)} parameter(s) beside their fp32 copies, the other side only as "
            "those copies ({shown}); each copy gives its weights bit for bit",
        )


def _stream(name: str) -> str | None:
    """The name of a per-rank RNG item without its trailing rank label (None: it has none)."""
    m = RANK_LABEL.search(name)
    return name[: m.start()] if m and m.end() == len(name) else None


def _rng_copies(report: DiffReport, ka: dict[str, Item], kb: dict[str, Item], ra: PieceReader, rb: PieceReader) -> None:
    """RNG state one side holds for a rank the other has none for, equal (tensors byte for byte,
    values as :func:`same_value` has them) to a state the other side holds for another rank of the
    same stream (the name but its rank label: Megatron's ``…torch_rng_state[tp=1,pp=0]``): a larger
    layout's copy of a rank's state (a reshard to more TP or PP ranks gives the new ranks copies),
    or one state under another rank label (expert TP). Nothing of the source is lost: a note, no
    difference. A state equal to none of the other side's is still added or removed."""
    for mine, keyed, reader, other, r_other, side in (
        (report.added, kb, rb, ka, ra, "B"),
        (report.removed, ka, ra, kb, rb, "A"),
    ):
        bases: dict[str, list[Item]] = {}
        for k, item in other.items():
            if item.kind == "rng" and (stream := _stream(k)) is not None:
                bases.setdefault(stream, []).append(item)
        same: list[str] = []
        for k in mine:
            item = keyed[k]
            stream = _stream(k) if item.kind == "rng" else None
            if stream is None:
                continue
            if any(_same_rng(item, reader, o, r_other) for o in bases.get(stream, ())):
                same.append(k)
        _same_listed(
            report,
            same,
            f"rng: {len(same)} RNG state(s) of ranks only {side} has equal states the other side holds for other "
            "ranks of the same stream ({shown}): a layout's copies, or a state under another rank label; nothing lost",
        )


def _same_rng(a: Item, ra: PieceReader, b: Item, rb: PieceReader) -> bool:
    """Whether two RNG items hold the same state."""
    if a.is_tensor != b.is_tensor:
        return False
    if not a.is_tensor:
        if a.error is not None or b.error is not None:
            return False
        if a.summary is None and b.summary is None:
            return same_value(a.value, b.value)
        try:  # (too large for the manifest to keep: a Python or NumPy generator's state)
            return same_value(ra.read_object(a), rb.read_object(b))
        except (CkptError, NotImplementedError, KeyError):
            return False
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    try:
        return bool(assemble(ra, a).tobytes() == assemble(rb, b).tobytes())
    except CkptError:
        return False


_NARROWED: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "float32": lambda v: v,
    "bfloat16": float32_to_bf16,
    "float16": lambda v: v.astype(np.float16),
}
"""How an optimizer's fp32 copy gives a parameter's weights of each dtype (round to nearest even)."""


def _inside_object(key: str, keyed: dict[str, Item], reader: PieceReader, cache: dict[str, Any]) -> np.ndarray | None:
    """The values of the tensor ``key`` names inside a non-tensor item of ``keyed`` (the item named
    by a prefix of ``key``, the rest of ``key`` the path of dict keys and list indices inside it);
    None when there is no such item, no tensor at that path, or the item cannot be read (``cache``:
    the items read so far, by key)."""
    from ckpttool.formats import _ptwrite

    parts = key.split(".")
    for n in range(len(parts) - 1, 0, -1):
        head = ".".join(parts[:n])
        item = keyed.get(head)
        if item is None:
            continue
        if item.is_tensor or not hasattr(reader, "archive_of"):
            return None
        if head not in cache:
            try:
                cache[head] = _ptwrite.carried(reader, item, now=True)
            except CkptError:  # a damaged record: the tensor stays unmatched
                cache[head] = None
        value: Any = cache[head]
        for seg in parts[n:]:
            if isinstance(value, dict) and seg in value:
                value = value[seg]
            elif isinstance(value, list | tuple) and seg.isdigit() and int(seg) < len(value):
                value = value[int(seg)]
            else:
                return None
        if not isinstance(value, _ptwrite.OutTensor):
            return None
        buf = np.empty(value.nbytes, dtype=np.uint8)
        value.fill(buf)
        return buf.view(carrier(value.dtype)).reshape(value.shape)
    return None


def _opaque_rng(manifest: Manifest) -> bool:
    """Whether the checkpoint keeps its RNG state only as opaque records (no RNG tensors)."""
    rng = [i for i in manifest.items.values() if i.kind == "rng"]
    return bool(rng) and not any(i.is_tensor for i in rng)


def _copies_that_differ(
    name: str, ra: PieceReader, ia: Item, rb: PieceReader, ib: Item, atol: float, rtol: float
) -> list[dict[str, Any]]:
    """The copies (replica > 0) on either side whose values differ from the other side's for
    their region: a TP rank's norm or a DP rank's copy changed, which diff read past (it compared
    the first copies only, "equal"). Where both sides cut the tensor alike, a copy with the bytes
    of the other side's same copy, or values within tolerance of them, is passed after that one read
    of each (as a checkpoint against itself). Damaged bytes raise _Unread, whatever the layouts."""
    passed: set[int] = set()  # (pieces, by id, equal to their twin on the other side, or within tolerance of it)
    assert ia.dtype is not None and ib.dtype is not None
    for p, q in _paired(ia, ib) or ():
        if p.replica:
            va = _from("a", partial(ra.read, p, ia)).reshape(-1)
            vb = _from("b", partial(rb.read, q, ib)).reshape(-1)
            if _equal_bytes(va, vb):
                passed |= {id(p), id(q)}
                continue
            acc = _Accumulator(atol, rtol)  # (as flat values: the box only places a difference)
            acc.add(va, vb, ia.dtype, ib.dtype, Box((0,), (len(va),)))
            if acc.result(name, ia.name, ib.name, 0).within_tolerance:  # (not read again below)
                passed |= {id(p), id(q)}
    out: list[dict[str, Any]] = []
    for side, r_mine, mine, r_other, other in (("A", ra, ia, rb, ib), ("B", rb, ib, ra, ia)):
        assert mine.dtype is not None and other.dtype is not None
        here, there = side.lower(), "b" if side == "A" else "a"
        for p in mine.pieces:
            if not p.replica or id(p) in passed:
                continue
            only = [replace(p, replica=0)]
            alone = Item(name=mine.name, kind=mine.kind, dtype=mine.dtype, shape=mine.shape, pieces=only)
            acc = _Accumulator(atol, rtol)
            for box in regions(p):
                va = _from(here, partial(assemble, r_mine, alone, box=box)).reshape(-1)
                vb = _from(there, partial(assemble, r_other, other, box=box)).reshape(-1)
                acc.add(va, vb, mine.dtype, other.dtype, box)
            res = acc.result(name, mine.name, other.name, 0)
            if not res.within_tolerance:
                out.append(
                    {
                        "name": name,
                        "side": side,
                        "file": p.file,
                        "rank": p.rank,
                        "differing": res.differing,
                        "first_index": res.first_index,
                        "max_abs_diff": res.max_abs,
                    }
                )
    return out


def _paired(ia: Item, ib: Item) -> list[tuple[Any, Any]] | None:
    """Each piece of A with B's of the same region and copy, where both sides cut the tensor the
    same way (every copy of it too); None where they do not."""

    def key(p: Any) -> tuple[Any, ...]:
        return (p.box.offsets, p.box.sizes, p.flat or (-1, -1), p.replica)

    if sorted(map(key, ia.pieces)) != sorted(map(key, ib.pieces)):
        return None
    by_key = {key(q): q for q in ib.pieces}
    return [(p, by_key[key(p)]) for p in ia.pieces]


def _same_pieces(ia: Item, ib: Item) -> bool:
    """Equal by the digests the seals give, piece for piece, when both sides cut the tensor the same
    way and every piece has one (every copy of it too: a rank's copy differing is a difference).
    Nothing is read: a tensor this cannot say is equal is compared by :func:`_compare`, which reads
    each side once (it was read here as well, then again to compare)."""
    if not all(p.checksum for p in (*ia.pieces, *ib.pieces)):
        return False
    pairs = _paired(ia, ib)
    return pairs is not None and all(p.checksum == q.checksum for p, q in pairs)


_INTEGERS = frozenset({"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool"})


def _int_gap(a: np.ndarray, b: np.ndarray) -> np.ndarray | None:
    """|a - b| of two integer arrays, exactly, as uint64 (float64 loses a step's or a token
    count's last units past 2**53); None for a signed and a 64-bit unsigned side."""
    unsigned = a.dtype == np.uint64 or b.dtype == np.uint64
    if unsigned and (a.dtype.kind == "i" or b.dtype.kind == "i"):
        return None
    wide = np.uint64 if unsigned else np.int64
    x, y = a.astype(wide), b.astype(wide)
    # the difference taken modulo 2**64 in the order that makes it the true one (0 <= it < 2**64)
    return np.where(x >= y, x.astype(np.uint64) - y.astype(np.uint64), y.astype(np.uint64) - x.astype(np.uint64))


_BLOCK = 1 << 16  # elements compared at a time: temporaries stay in the cache whatever the tensor size


def _magnitudes(values: np.ndarray) -> np.ndarray:
    """Numbers (:func:`ckpttool.dtypes.as_numbers`) as float64 magnitudes: a complex value's modulus."""
    return (np.abs(values) if values.dtype.kind == "c" else values).astype(np.float64)


def _norm_sq(fb: np.ndarray) -> float:
    """The sum of squares of float64 magnitudes, NaN left out (NaN on both sides of an equal block)."""
    sq = float(np.dot(fb, fb))
    return sq if math.isfinite(sq) else float(np.nansum(fb * fb))


class _Accumulator:
    """The figures of one tensor's comparison, gathered region by region (blocks of ``_BLOCK``
    elements: bits, then values as float64)."""

    def __init__(self, atol: float, rtol: float) -> None:
        self.atol, self.rtol = atol, rtol
        self.n = 0
        self.first: tuple[int, ...] | None = None
        self.max_abs = self.sq_diff = self.sq_b = 0.0
        self.ok = True

    def add(self, va: np.ndarray, vb: np.ndarray, dtype_a: str, dtype_b: str, box: Box) -> None:
        """Region ``box`` of the tensor: ``va`` and ``vb`` its elements, flat, on either side.
        Non-finite values are compared as they are (numpy's warnings on them are not the report's)."""
        with np.errstate(all="ignore"):
            self._add(va, vb, dtype_a, dtype_b, box)

    def _add(self, va: np.ndarray, vb: np.ndarray, dtype_a: str, dtype_b: str, box: Box) -> None:
        for lo in range(0, va.size, _BLOCK):
            a, b = va[lo : lo + _BLOCK], vb[lo : lo + _BLOCK]
            differs = _bits_differ(a, b)
            count = int(differs.sum())
            nb = as_numbers(b, dtype_b)  # (decoded once: bfloat16 and float8 go through a table)
            fb = _magnitudes(nb)  # (for sq_b)
            if not count:
                self.sq_b += _norm_sq(fb)
                continue
            local = np.unravel_index(lo + int(np.argmax(differs)), box.sizes) if box.sizes else ()
            where = tuple(int(o) + int(i) for o, i in zip(box.offsets, local, strict=True))
            self.first = where if self.first is None or where < self.first else self.first
            self.n += count
            if dtype_a in _INTEGERS and dtype_b in _INTEGERS and (gap := _int_gap(a, b)) is not None:
                self._add_integers(gap, fb)
                continue
            # complex values compared in the complex plane (a change of the imaginary part counts)
            wide = np.complex128 if nb.dtype.kind == "c" or a.dtype.kind == "c" else np.float64
            self._add_values(as_numbers(a, dtype_a).astype(wide), nb.astype(wide))

    def add_norm(self, vb: np.ndarray, dtype_b: str) -> None:
        """A region equal on both sides: its part of |B|, as :meth:`add` counts it."""
        with np.errstate(all="ignore"):
            for lo in range(0, vb.size, _BLOCK):
                self.sq_b += _norm_sq(_magnitudes(as_numbers(vb[lo : lo + _BLOCK], dtype_b)))

    def _add_integers(self, gap: np.ndarray, fb: np.ndarray) -> None:
        """Integers (steps, token counts, masks): exact differences, and within tolerance only
        where no more than ``atol`` apart: a relative tolerance does not apply to counts (5 tokens
        of a million are 5 tokens more than were seen)."""
        self.max_abs = max(self.max_abs, float(gap.max()))
        wide = gap.astype(np.float64)
        self.sq_diff += float(np.dot(wide, wide))
        self.sq_b += float(np.dot(fb, fb))
        self.ok = self.ok and bool(np.all(wide <= self.atol))

    def _add_values(self, fa: np.ndarray, fb: np.ndarray) -> None:
        """Differing floating-point (float64) or complex (complex128) values: distances, and each
        within ``atol + rtol * |b|``."""
        with np.errstate(invalid="ignore", over="ignore"):
            delta = np.abs(fa - fb)
            mag = np.abs(fb)
            sq_diff, sq_b = float(np.dot(delta, delta)), float(np.dot(mag, mag))
            if math.isfinite(sq_diff) and math.isfinite(sq_b):
                # every value finite (a NaN or an infinity would make a sum NaN or infinite; so does a
                # square overflowing, taken the long way below as before): the same figures, fewer passes
                self.max_abs = max(self.max_abs, float(delta.max()) if delta.size else 0.0)
                self.sq_diff += sq_diff
                self.sq_b += sq_b
                self.ok = self.ok and bool(np.all(delta <= self.atol + self.rtol * mag))
                return
            nan_a, nan_b = np.isnan(fa), np.isnan(fb)
            both_nan = nan_a & nan_b
            # NaN on one side only: as far apart as values get (nanmax would skip it: max abs 0)
            finite_delta = np.where(both_nan, 0.0, np.where(nan_a ^ nan_b, np.inf, delta))
            self.max_abs = max(self.max_abs, float(np.nanmax(finite_delta)) if finite_delta.size else 0.0)
            self.sq_diff += float(np.nansum(finite_delta * finite_delta))
            self.sq_b += float(np.nansum(mag * mag))
            # an infinity is close only to itself (as numpy.isclose has it): inf <= atol + rtol * inf held
            finite = np.isfinite(fa) & np.isfinite(fb)
            close = ((delta <= self.atol + self.rtol * mag) & finite) | (fa == fb) | both_nan
            self.ok = self.ok and bool(np.all(close))

    def result(self, name: str, a: str, b: str, numel: int) -> TensorDiff:
        return TensorDiff(
            name=name,
            a=a,
            b=b,
            max_abs=self.max_abs if math.isfinite(self.max_abs) else float("inf"),
            rel_l2=math.sqrt(self.sq_diff) / max(math.sqrt(self.sq_b), 1e-30)
            if math.isfinite(self.sq_diff)
            else math.inf,
            differing=self.n,
            numel=numel,
            first_index=list(self.first) if self.first is not None else None,
            within_tolerance=self.ok and not (self.n and self.atol == 0 and self.rtol == 0),
        )


def _compare(name: str, ra: PieceReader, ia: Item, rb: PieceReader, ib: Item, atol: float, rtol: float) -> TensorDiff:
    """Compare region by region (the regions of A's pieces): each region of A is read as stored and
    the same region of B assembled from whatever pieces hold it, so memory stays at a few pieces
    whatever the tensor size."""
    assert ia.dtype is not None and ia.shape is not None and ib.dtype is not None
    acc = _Accumulator(atol, rtol)
    boxes = [b for p in ia.pieces if p.replica == 0 for b in regions(p)] or [Box.whole(ia.shape)]
    alike: list[Box] = []  # regions equal byte for byte: only |B| is wanted of them, and only if another differs
    for box in boxes:
        va = _from("a", partial(assemble, ra, ia, box=box)).reshape(-1)
        vb = _from("b", partial(assemble, rb, ib, box=box)).reshape(-1)
        if _equal_bytes(va, vb):
            alike.append(box)
            continue
        acc.add(va, vb, ia.dtype, ib.dtype, box)
    if acc.n:  # (the relative L2 distance is over the whole tensor: B's equal regions count in |B|)
        for box in alike:
            acc.add_norm(_from("b", partial(assemble, rb, ib, box=box)).reshape(-1), ib.dtype)
    return acc.result(name, ia.name, ib.name, math.prod(ia.shape))


def _bits_differ(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per element of two flat arrays of one width, whether their bits differ."""
    w = a.itemsize
    if w == b.itemsize and w in (1, 2, 4, 8):
        return np.asarray(a.view(f"u{w}") != b.view(f"u{w}"))
    return np.asarray((a.view(np.uint8).reshape(a.size, -1) != b.view(np.uint8).reshape(b.size, -1)).any(axis=1))


_EQUAL_BLOCK = 1 << 22
"""bytes compared at once by :func:`_equal_bytes` (its temporary is one block of booleans)"""


def _equal_bytes(va: np.ndarray, vb: np.ndarray) -> bool:
    """Whether two flat arrays of one dtype hold the same bytes (compared block by block, to the
    first block that differs)."""
    if va.dtype != vb.dtype or va.size != vb.size:
        return False
    a, b = va.view(np.uint8), vb.view(np.uint8)
    return all(np.array_equal(a[i : i + _EQUAL_BLOCK], b[i : i + _EQUAL_BLOCK]) for i in range(0, a.size, _EQUAL_BLOCK))


__all__ = ["TOLERANCES", "DiffReport", "TensorDiff", "diff", "load_map"]
