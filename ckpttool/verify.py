"""``verify``: is this checkpoint complete, consistent and intact?

The library returns a :class:`VerifyReport` of :class:`Finding` s, each with a stable rule id; the
CLI renders it (human, JSON, JUnit, GitHub) and picks the exit code. Checks:

- against a seal (``ckpttool.manifest.json``): missing, extra, truncated files; file and piece
  checksums (a flipped byte is reported with the tensor it belongs to);
- without a seal: the CRC32s every ``torch.save`` archive carries (DCP items, ``.pt`` files),
  which torch itself never checks;
- from the manifest: interrupted saves, unsafe pickles, coverage gaps and overlaps, replicas that
  differ, steps that disagree across files, optimizer state that does not match the parameters,
  missing training state;
- with ``deep``: every value read, NaN/Inf counted, per-tensor statistics.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import re
import shlex
import stat
import threading
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
from typing_extensions import TypedDict  # pydantic needs this one on Python < 3.12

from ckpttool import registry
from ckpttool._torchzip import Archive, record_crc_errors, record_start
from ckpttool._unpickle import TensorRef
from ckpttool.assemble import assemble, regions
from ckpttool.dtypes import as_float, as_numbers, float32_to_bf16
from ckpttool.errors import (
    CkptError,
    CorruptFileError,
    FormatNotRecognizedError,
    NotFoundError,
    PathEscapeError,
    UnsupportedError,
)
from ckpttool.formats import _pt
from ckpttool.formats.base import Adapter
from ckpttool.formats.rankshards import LOCAL_KEYS
from ckpttool.geometry import Box, coverage, flat_range_boxes, intersect
from ckpttool.hashing import FileDigest, Span, default_workers, hash_bytes, hash_file, hash_files, lanes_for
from ckpttool.io import (
    RandomAccessFile,
    checking_crcs,
    followed,
    is_temp_name,
    list_files,
    not_a_file,
    not_found,
    outside,
)
from ckpttool.manifest import SCHEMA_VERSION, Item, Manifest, Piece, StateName, is_seal_name
from ckpttool.naming import classify, param_state, plural
from ckpttool.seal import (
    Expected,
    PieceRecord,
    Seal,
    bytes_added,
    copied_files,
    crc_failures,
    default_seal_path,
    in_file_order,
    member_crcs,
)
from ckpttool.values import LEARNING_RATE, flatten

Severity = Literal["error", "warning", "info"]
SEVERITY_ORDER = {"info": 0, "warning": 1, "error": 2}


@dataclass(frozen=True, slots=True)
class Rule:
    id: str
    severity: Severity
    summary: str
    hint: str


RULES: dict[str, Rule] = {
    r.id: r
    for r in [
        Rule(
            "missing-file",
            "error",
            "a file the checkpoint needs is absent",
            "a rank did not finish writing or the file was deleted; restore it or use another checkpoint",
        ),
        Rule(
            "extra-file",
            "warning",
            "a file not in the seal",
            "something was added after sealing; remove it or re-seal if it belongs",
        ),
        Rule(
            "truncated-file",
            "error",
            "a file shorter than its metadata says",
            "the copy or save was interrupted; restore the file from its source",
        ),
        Rule(
            "checksum-mismatch",
            "error",
            "bytes differ from the seal or from the file's own CRC",
            "storage or transfer corruption; restore the file from a good copy",
        ),
        Rule(
            "incomplete-save",
            "error",
            "the save never finished",
            "use the previous checkpoint; this one cannot be loaded",
        ),
        Rule(
            "step-mismatch",
            "error",
            "files claim different steps",
            "files from two saves were mixed (an overwrite that did not finish?)",
        ),
        Rule(
            "misplaced-file",
            "error",
            "a rank's file is where another rank's belongs",
            "files were renamed, copied over each other or mixed from another run; restore them from the save",
        ),
        Rule(
            "coverage-gap",
            "error",
            "parts of a tensor are in no piece",
            "a rank's data is missing or the metadata is inconsistent",
        ),
        Rule(
            "coverage-overlap",
            "error",
            "parts of a tensor are in two pieces",
            "the metadata is inconsistent; the writer or a tool that edited it is at fault",
        ),
        Rule(
            "replica-mismatch",
            "error",
            "copies of the same values differ",
            "ranks diverged (non-deterministic op, a bad node) or a file was corrupted",
        ),
        Rule(
            "optimizer-mismatch",
            "error",
            "optimizer state does not match the parameters",
            "the optimizer state was dropped or saved from a different model",
        ),
        Rule(
            "missing-state",
            "warning",
            "training state a resume needs is absent",
            "save it with the checkpoint, or pass --require only for what you need",
        ),
        Rule("nonfinite", "error", "NaN or Inf values", "training diverged before the save"),
        Rule(
            "unsafe-pickle",
            "error",
            "a pickle refers to a global outside the format's allowlist",
            "do not load this file with torch.load(weights_only=False) or pickle.load",
        ),
        Rule("unsafe-path", "error", "metadata names a path outside the checkpoint", "the metadata is hostile"),
        Rule("corrupt-file", "error", "a file's structure is damaged", "restore the file from its source"),
    ]
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Finding:
    rule: str
    severity: Severity
    message: str
    file: str | None = None
    item: str | None = None
    rank: int | None = None
    hint: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "severity": self.severity,
            "message": self.message,
            "file": self.file,
            "item": self.item,
            "rank": self.rank,
            "hint": self.hint,
        }


class FindingJSON(TypedDict):
    rule: str
    """a stable rule id (see RULES / docs/ci-gate.md)"""
    severity: Severity
    message: str
    file: str | None
    """the file the finding is about, relative to ``root`` (else to the checkpoint given); null
    for a finding of no one file (several copies that disagree, a tensor's coverage)"""
    item: str | None
    """the tensor or value the finding is about, by the checkpoint's own name"""
    rank: int | None
    """the rank whose file ``file`` is, numbered as the format numbers its files: the writing rank
    (DCP, Megatron torch_dist, per-rank shards), the data-parallel rank of a ZeRO partition or ZeRO-3 model states and
    the model-parallel rank of model states or a pipeline layer file (DeepSpeed), the tensor-parallel
    rank (Megatron legacy); null where the format names none"""
    hint: str | None
    """what to do about it"""


class ErrorJSON(TypedDict):
    message: str
    """why the checkpoint could not be evaluated (exit 3): the line verify printed on stderr"""
    hint: str | None


class TensorStatsJSON(TypedDict):
    """One tensor's values, read by ``--deep``. A figure that is not finite is the string
    ``"inf"``, ``"-inf"`` or ``"nan"``; the figures are of the finite values only."""

    numel: int
    nan: int
    inf: int
    first_nonfinite: list[int] | None
    """the index of the first NaN or Inf in the whole tensor (C order); null when there is none"""
    min: float | str | None
    max: float | str | None
    mean: float | str | None
    std: float | str | None
    absmax: float | str | None
    """null when the tensor holds no finite value"""


class ReportJSON(TypedDict):
    """What ``verify --json`` prints and ``--report`` writes (docs/verify-report.schema.json)."""

    schema_version: int
    inputs: dict[str, Any]
    format: str | None
    step: int | None
    root: str | None
    """the folder the findings' files are named from, where it is not ``inputs.path``: the
    iteration a save directory's tracker names (torch_dist). null otherwise"""
    layout: dict[str, int | None]
    ok: bool
    fail_on: Literal["error", "warning"]
    """the least severe finding that fails the check (``--fail-on``)"""
    summary: dict[Severity, int]
    checked: dict[str, int]
    findings: list[FindingJSON]
    stats: dict[str, TensorStatsJSON]
    """per tensor, by name (``--deep`` only)"""
    error: ErrorJSON | None
    """set when nothing could be evaluated (exit 3: no such path, an unknown format, damaged
    metadata; or exit 2: the request itself was refused, such as an unknown ``--require`` state);
    then ``ok`` is false and there are no findings. null otherwise"""


def report_schema() -> dict[str, Any]:
    from pydantic import TypeAdapter

    for typed in (FindingJSON, ErrorJSON, TensorStatsJSON, ReportJSON):  # (the fields' words in the schema)
        setattr(typed, "__pydantic_config__", {"use_attribute_docstrings": True})  # noqa: B010

    schema: dict[str, Any] = TypeAdapter(ReportJSON).json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "ckpttool verify report"
    return schema


def finding(rule: str, message: str, *, severity: Severity | None = None, **where: Any) -> Finding:
    r = RULES[rule]
    # a hint of None is the rule's
    return Finding(
        rule=rule, severity=severity or r.severity, message=message, hint=where.pop("hint", None) or r.hint, **where
    )


@dataclass(slots=True, kw_only=True)
class VerifyReport:
    path: str
    format: str | None = None
    step: int | None = None
    root: str | None = None
    """the folder findings name files from, where it is not ``path`` (a save directory's iteration)"""
    layout: dict[str, Any] = field(default_factory=dict)
    seal: str | None = None
    deep: bool = False
    findings: list[Finding] = field(default_factory=list)
    stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    checked: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    """why nothing could be evaluated (the command exits 3), with ``error_hint``"""
    error_hint: str | None = None
    seal_nearby: str | None = None
    """without a seal: a seal in the folder above that covers this checkpoint, or in a folder of it
    (a save directory's and its tag's), which ``verify`` of that folder checks against"""
    own_files: frozenset[str] = frozenset()
    """the checkpoint's data and metadata files, resolved (not in the JSON): what a seal nearby must name"""

    def failing(self, fail_on: Severity = "error") -> list[Finding]:
        return [f for f in self.findings if SEVERITY_ORDER[f.severity] >= SEVERITY_ORDER[fail_on]]

    def summary(self) -> dict[str, int]:
        out = {"error": 0, "warning": 0, "info": 0}
        for f in self.findings:
            out[f.severity] += 1
        return out

    def to_json(self, fail_on: Severity = "error") -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "inputs": {"path": self.path, "seal": self.seal, "deep": self.deep}
            | ({"seal_nearby": self.seal_nearby} if self.seal_nearby else {}),
            "format": self.format,
            "step": self.step,
            "root": self.root,
            "layout": self.layout,
            "ok": self.error is None and not self.failing(fail_on),
            "fail_on": fail_on,
            "summary": self.summary(),
            "checked": self.checked,
            "findings": [f.to_json() for f in self.findings],
            "stats": self.stats,
            "error": None if self.error is None else {"message": self.error, "hint": self.error_hint},
        }


def verify(
    path: str | Path,
    *,
    manifest_path: str | Path | None = None,
    deep: bool = False,
    require: Iterable[str] = (),
    workers: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Check the checkpoint at ``path``; raises only when it cannot be evaluated at all."""
    root = Path(path)
    if not root.exists():
        raise not_found(root)
    required = set(require)
    unknown = required - {"optimizer", "rng", "dataloader", "scheduler", "step"}
    if unknown:
        from ckpttool.errors import UsageError

        raise UsageError(
            f"--require {', '.join(sorted(unknown))}: expected optimizer, rng, dataloader, scheduler or step"
        )
    report = VerifyReport(path=str(root), deep=deep)
    seal_file = Path(manifest_path) if manifest_path else default_seal_path(root)
    if seal_file.exists() and not seal_file.is_file():  # (not "no seal": one may have been meant)
        raise CorruptFileError(
            f"{seal_file}: expected a seal (a JSON file), found a "
            f"{'directory' if seal_file.is_dir() else 'special file'}",
            hint="move it out of the way and seal the checkpoint again, or give the seal's file with --manifest",
            path=str(seal_file),
        )
    sealed = Seal.load(seal_file) if seal_file.is_file() else None
    if manifest_path and sealed is None:
        raise NotFoundError(f"{seal_file}: no such seal", hint="create one with 'ckpttool seal'", path=str(seal_file))
    report.seal = str(seal_file) if sealed else None
    root = followed(root)  # a file named by a link: checked where it leads, as it is read
    early: _SealedBytes | None = None
    if sealed is not None and root.is_dir():
        # hash while the checkpoint is described, in the folder the seal was made in when that is
        # this one or inside it (a save directory and its iteration); else in this one
        early = _hash_sealed_files(_sealed_folder(root, sealed) or root, sealed, workers, progress, within=root)
    try:
        _verify(root, report, sealed, early, required, deep, workers, progress)
    finally:
        if early is not None:
            early.cancel()
    if sealed is None:
        report.seal_nearby = _seal_nearby(Path(path), report)
    bases = [Path(report.root)] if report.root else [root, root.parent]
    report.findings = [_not_a_file(bases, f) for f in report.findings]
    return report


def _beside_links_out(root: Path, links: set[str]) -> list[Finding]:
    """What else is wrong with a checkpoint holding ``links``, links that lead out of it (each
    already reported): it is read again without them, and what that finds of its own files (a rank
    file missing beside the link, a damaged one) is reported too; what it says of the links
    themselves (now absent) is not."""
    from ckpttool.io import links_out_left_out

    try:
        with links_out_left_out(), checking_crcs():
            registry.describe(root)
    except CkptError as exc:
        found = [_from_error(e) for e in (exc, *exc.others)]
        return [f for f in found if not (f.file and _under_any(f.file, links))]
    return []


def _under_any(file: str, links: set[str]) -> bool:
    """Whether ``file`` is one of ``links`` or lies in one (a linked folder); both are named from
    the checkpoint given."""
    return any(file == link or file.startswith(f"{link}/") for link in links if link)


def _describe_as_sealed(root: Path, sealed: Seal, exc: FormatNotRecognizedError) -> tuple[Adapter, Manifest]:
    """A sealed checkpoint that no longer reads as one (a file added beside a directory's single
    ``torch.save`` file): its one data file, where the seal lists one, is described alone; else
    refused, as a finding, for only its bytes could be checked against the seal (every seal is of a
    checkpoint that read as one)."""
    data = [f.path for f in sealed.head.files if f.role == "data"]
    if root.is_dir() and len(data) == 1 and (root / data[0]).is_file():
        return registry.describe(root / data[0])
    said = sealed.head.format or "checkpoint"
    why = exc.reasons.get(said) or "; ".join(f"{k}: {v}" for k, v in exc.reasons.items())
    raise FormatNotRecognizedError(
        str(root),
        exc.reasons,
        message=f"{root}: no longer reads as the {said} checkpoint its seal describes ({why}); "
        "only its bytes were checked against the seal",
        hint="take away what was added since the seal (the extra files named) or restore what is missing",
    )


def _seal_nearby(given: Path, report: VerifyReport) -> str | None:
    """A seal one folder away that names the checkpoint's own files (``report.own_files``): of its
    own folder (a save directory's iteration, given the save directory), of the folder above (the
    save directory, given its iteration or tag; the folder, given its one file), or of a folder of
    it (a DeepSpeed tag's). The checkpoint was sealed from there, and is checked against it only
    when that folder is verified. Named as the path given spells it; None where there is none."""
    if not report.own_files:
        return None
    here = given if given.is_dir() else given.parent
    candidates = [Path(report.root)] if report.root else []
    candidates.append(Path(os.path.normpath(os.path.join(given, ".."))) if given.is_dir() else here)
    with contextlib.suppress(OSError), os.scandir(here) as entries:
        candidates += sorted(Path(here, e.name) for e in entries if e.is_dir(follow_symlinks=False))
    for folder in dict.fromkeys(candidates):
        at = default_seal_path(folder)
        if not at.is_file():
            continue
        with contextlib.suppress(Exception):  # (a seal that does not read: none to point to)
            sealed = Seal.load(at)
            base = _sealed_folder(folder, sealed) or folder
            named = {os.path.realpath(base / f.path) for f in sealed.head.files if f.role in ("data", "metadata")}
            if named & report.own_files:
                return str(at)
    return None


def _refuse_unopenable(manifest: Manifest) -> None:
    """Files of the checkpoint that exist but that this user may not open (their permissions): the
    checkpoint cannot be evaluated, which is said once, naming them (exit 3). Each reader would
    otherwise fail on every item such a file holds, as so many damaged items."""
    base = _folder_of(manifest)
    # (access(2), not an open: one metadata call a file, which a parallel file system answers cheaply)
    effective = os.access in os.supports_effective_ids
    blocked = [
        rec.path  # (the files verify reads: not a file kept beside them, a lock or a README)
        for rec in manifest.files
        if rec.role not in ("seal", "aux")
        and not os.access(base / rec.path, os.R_OK, effective_ids=effective)
        and (base / rec.path).exists()
    ]
    if blocked:
        named = ", ".join(blocked[1:4]) + (" …" if len(blocked) > 4 else "")
        more = f" (and {len(blocked) - 1} more: {named})"
        raise NotFoundError(
            f"{blocked[0]}: cannot open ({os.strerror(errno.EACCES)}){more if len(blocked) > 1 else ''}",
            hint="give the user running ckpttool read access to the checkpoint's files, or run it as their owner",
            path=blocked[0],
        )


def _folder_of(manifest: Manifest) -> Path:
    """The folder a manifest's file paths are relative to (its root, or the folder of a one-file root)."""
    root = Path(manifest.root)
    return root if root.is_dir() else root.parent


def _verify(
    root: Path,
    report: VerifyReport,
    sealed: Seal | None,
    early: _SealedBytes | None,
    required: set[str],
    deep: bool,
    workers: int | None,
    progress: Callable[[int], None] | None,
) -> VerifyReport:
    adapter: Adapter | None = None
    manifest: Manifest | None = None
    try:
        with checking_crcs():  # a flipped bit in a pickle is damage, named as such (not a hostile pickle)
            try:
                adapter, manifest = registry.describe(root)
            except FormatNotRecognizedError as exc:
                if sealed is None:
                    raise
                adapter, manifest = _describe_as_sealed(root, sealed, exc)
    except FormatNotRecognizedError as exc:
        if sealed is None:
            raise
        report.findings.append(_from_error(exc))
    except (NotFoundError, UnsupportedError):
        raise
    except CkptError as exc:
        report.findings += [_from_error(e) for e in (exc, *exc.others)]
        known: Adapter | None = None
        with contextlib.suppress(CkptError):  # the format was known (by names) though its files did not read
            known = registry.detect(root)
            report.format = known.name
        if sealed is None and not isinstance(exc, PathEscapeError) and root.is_dir():
            report.findings += _archive_damage(root, report.findings, getattr(known, "record_owners", None))
        elif isinstance(exc, PathEscapeError) and all(getattr(e, "link_out", False) for e in (exc, *exc.others)):
            report.findings += _beside_links_out(root, {e.path or "" for e in (exc, *exc.others)})
    if manifest is not None:
        _refuse_unopenable(manifest)
        _pt.hostile_beside(Path(manifest.root), manifest)
        report.own_files = frozenset(
            os.path.realpath(_folder_of(manifest) / f.path) for f in manifest.files if f.role in ("data", "metadata")
        )
        report.format, report.step = manifest.format, manifest.step
        report.root = _findings_root(root, manifest)
        report.layout = {
            k: getattr(manifest.layout, k) for k in ("world_size", "tp", "pp", "dp", "ep", "vpp", "zero_stage")
        }
    elif sealed is not None:
        report.format, report.step = sealed.head.format, sealed.head.step

    piece_digests: dict[tuple[str, int], str] = {}
    file_digests: dict[str, FileDigest] = {}  # (without a seal: a seal's mismatches name the files)
    besides = _Besides(manifest) if manifest is not None else None
    if sealed is not None and manifest is not None and (stale := _stale_seal(report, sealed, manifest)) is not None:
        report.findings.append(stale)
        if early is not None:
            early.cancel()
        sealed = None  # (the files checked as without one)
    if sealed is not None:
        piece_digests = _check_seal(report, root, sealed, manifest, adapter, workers, progress, early)
        if manifest is not None:
            _check_seal_is_this_saves(report, sealed, manifest)
            if besides is not None and (beside := (manifest.extras.get("state_files") or {}).get("optimizer")):
                _check_optimizer_beside(report, besides, beside, sealed=True)
    elif manifest is not None and adapter is not None:
        piece_digests, file_digests = _check_integrity(report, manifest, adapter, workers, progress)
        if besides is not None:
            _check_aux_archives(report, manifest, besides)
    if manifest is not None and adapter is not None:
        _check_misplaced(report, manifest, adapter)
    _check_in_flight(report, root, manifest, sealed is not None)
    if sealed is None:
        _check_metadata_of_all(report, root, manifest)
    if manifest is not None and adapter is not None:
        _check_manifest(report, manifest, required)
        _check_given_alone(report, manifest)
        _check_replicas(report, manifest, adapter, piece_digests, deep)
        _check_steps(report, manifest)
        _check_format_findings(report, manifest)
        _check_copies(report, manifest, adapter, file_digests)  # (once the format has named what it can)
        _check_optimizer(report, manifest, adapter, piece_digests, sealed.algo if sealed else "xxh3-128")
        if deep:
            _check_values(report, manifest, adapter, besides)
    report.findings = _one_per_changed_file(_dedupe([_within(f, root, Path(report.path)) for f in report.findings]))
    if manifest is not None:
        report.findings = _ranked(report.findings, manifest)
    return report


def _ranked(findings: list[Finding], manifest: Manifest) -> list[Finding]:
    """Findings naming a file but no rank (a format's check that names files alone, as the
    misplaced-file ones do) given the rank the manifest records for that file, as the rest are."""
    ranks = {rec.path: r for rec in manifest.files if (r := _rank_of(rec)) is not None}
    return [replace(f, rank=ranks[f.file]) if f.rank is None and f.file in ranks else f for f in findings]


def _within(f: Finding, root: Path, given: Path) -> Finding:
    """A finding whose file a reader named by the path it was given (absolute, or as typed)
    renamed relative to the checkpoint, as every other finding's is."""
    if not f.file or (not os.path.isabs(f.file) and (not f.file.startswith(str(given)) or (root / f.file).exists())):
        return f
    for base in dict.fromkeys((given, root, root.resolve())):
        try:
            rel = Path(f.file).relative_to(base)
        except ValueError:
            continue
        name = str(rel) if str(rel) != "." else base.name if base.is_file() else "."
        return replace(f, file=name)
    return f


COMMIT_NAMES = {
    ".metadata",
    "metadata.json",
    "latest",
    "latest_checkpointed_iteration.txt",
    "model.safetensors.index.json",
}
"""Files a save writes last, when the checkpoint's files cannot be read for their roles."""
AUX_NAMES = {"zero_to_fp32.py", "zero_to_torch.py"}
"""Files beside a checkpoint that hold no state (DeepSpeed's scripts), when it cannot be read for roles."""
COMMIT_SLACK_S = 5.0
"""Data files written more than this after the metadata that describes them were not written by
the save that committed it (files a copy or a checkout writes within a few seconds are not)."""


def _findings_root(root: Path, manifest: Manifest) -> str | None:
    """The folder a report's findings name files from where it is not the path given (a save
    directory's iteration or tag folder, which its reader went into)."""
    return manifest.root if root.is_dir() and Path(manifest.root).resolve() != root.resolve() else None


def unfinished(root: Path, manifest: Manifest) -> list[Finding]:
    """The errors verify finds from names, times and the files' own claims alone: a save still
    being written or stopped half way (``incomplete-save``), files of different saves mixed
    (``step-mismatch``). ``seal`` refuses such a checkpoint: verify against a seal compares bytes
    and no longer looks at times, so a seal made now would vouch for it."""
    report = VerifyReport(path=str(root), root=_findings_root(root, manifest))
    _check_in_flight(report, root, manifest, sealed=False)
    _check_steps(report, manifest)
    return [f for f in report.findings if f.severity == "error"]


def _own_entries(root: Path, manifest: Manifest | None) -> Iterator[tuple[str, str]]:
    """(folder, name) of every entry in the folders of the checkpoint read from ``root``: the folder
    given, the checkpoint's own (a save directory's iteration or tag), and each folder its data or
    metadata files are in. Other folders below (other saves of the run, other runs) are not its files: a save of
    another iteration that stopped half way does not fail this one. Where the checkpoint did not
    read, every folder below ``root``."""
    if manifest is None:
        for dirpath, dirnames, filenames in os.walk(root):
            yield from ((dirpath, name) for name in [*dirnames, *filenames])
        return
    own = Path(manifest.root) if Path(manifest.root).is_dir() else root
    folders = {os.path.normpath(root), os.path.normpath(own)}
    for f in manifest.files:
        if f.role in ("aux", "seal"):
            continue  # (a folder of other files the listing took in: another save's, kept beside)
        parts = f.path.split("/")[:-1]
        folders.update(os.path.normpath(own.joinpath(*parts[:n])) for n in range(1, len(parts) + 1))
    for folder in sorted(folders):
        try:
            with os.scandir(folder) as entries:
                names = sorted(e.name for e in entries)
        except OSError:
            continue
        yield from ((folder, name) for name in names)


def _check_in_flight(report: VerifyReport, root: Path, manifest: Manifest | None, sealed: bool) -> None:
    """Signs of a save that is still running, or that stopped half way: a writer's temporary
    files, and data files rewritten after the metadata that describes them (a save over an
    existing checkpoint keeps the old metadata until its very end)."""
    from ckpttool.io import list_files

    if not root.is_dir():
        return  # a single file is written whole by its own writer (or atomically by ckpttool)
    named = {f.file for f in report.findings if f.rule == "incomplete-save" and f.file}  # (by the format's reader)
    within = Path(report.root) if report.root else root  # where the findings name files from
    for dirpath, name in _own_entries(root, manifest):
        rel = os.path.relpath(os.path.join(dirpath, name), within).replace(os.sep, "/")  # (../ outside it)
        if rel in named:
            continue
        if name.endswith(".metadata.tmp") or (name.endswith(".tmp") and name[: -len(".tmp")] in COMMIT_NAMES):
            report.findings.append(
                finding(
                    "incomplete-save",
                    f"{rel}: a writer's temporary metadata is present: a save is running or was interrupted",
                    file=rel,
                )
            )
        elif is_temp_name(name):  # (a file that merely holds the marker is the checkpoint's: sealed as such)
            report.findings.append(
                finding(
                    "incomplete-save",
                    f"{rel}: a temporary of an interrupted ckpttool write",
                    severity="warning",
                    file=rel,
                )
            )
    if sealed:
        return  # with a seal, every byte is compared instead
    if manifest is not None:
        roles = {f.path: f.role for f in manifest.files}
    else:  # the checkpoint could not be read (a file being rewritten is often cut short): by name
        try:
            names = {rel: rel.rsplit("/", 1)[-1] for rel, _ in list_files(root)}
        except PathEscapeError:
            return  # a link out of the checkpoint: reported as unsafe-path by the read that failed
        roles = {
            rel: "metadata" if name in COMMIT_NAMES else "aux" if name in AUX_NAMES else "data"
            for rel, name in names.items()
        }
    base = Path(manifest.root) if manifest is not None else root  # a save directory's iteration folder
    times: dict[str, float] = {}
    sizes: dict[str, int] = {}
    for rel in roles:
        try:
            st = (base / rel).stat()
        except OSError:
            continue
        times[rel], sizes[rel] = st.st_mtime, st.st_size
    committed = [times[rel] for rel, role in roles.items() if role in ("metadata", "tracker") and rel in times]
    if not committed:
        return
    commit = max(committed)
    after = [rel for rel, role in roles.items() if role == "data" and times.get(rel, 0.0) > commit]
    newer = sorted((rel for rel in after if times[rel] > commit + COMMIT_SLACK_S), key=lambda p: -times[p])
    if not newer:
        return
    listed = _others(sorted(newer))
    if _one_stream(commit, [(times[rel], sizes[rel]) for rel in after]):
        # most likely a copy that wrote the metadata first and the data files one after another;
        # a save rewriting big files soon after the last commit looks the same: said, not failed
        report.findings.append(
            finding(
                "incomplete-save",
                f"{len(newer)} data file(s) were written after the metadata, one after another as a copy writes "
                f"them ({listed}): a copy that gave the files new times, or a save rewriting this checkpoint",
                severity="warning",
                file=newer[0],
                hint="if no save is writing here, it is a copy: copy with times (cp -p, rsync -a) or seal the "
                "checkpoint where it was written, and verify against the seal",
            )
        )
        return
    report.findings.append(
        finding(
            "incomplete-save",
            f"{len(newer)} data file(s) were written after the metadata that describes them, by up to "
            f"{times[newer[0]] - commit:,.0f} s ({listed}): "
            "a save is rewriting this checkpoint now, or one stopped before it committed",
            file=newer[0],
            hint="wait for the save to finish; if the files were copied without their timestamps, copy them "
            "with their times (cp -p, rsync -a) or seal the checkpoint where it was written",
        )
    )


COPY_RATE_MIN = 10e6
"""bytes per second a copy of a checkpoint is assumed to write at least (a slow network copy)"""


def _one_stream(commit: float, written: list[tuple[float, int]]) -> bool:
    """Whether data files written after the metadata (``(mtime, size)`` each) read as one copy
    that began with the metadata: in time order, each file finished no later after the one before
    (the metadata first) than writing its bytes at :data:`COPY_RATE_MIN` and the slack take. A
    plain copy (``cp -r``, a download: new timestamps, ``.metadata`` often first) writes so; a save
    rewriting the checkpoint starts its first file a training interval after the old metadata."""
    last = commit
    for mtime, size in sorted(written):
        if mtime - last > COMMIT_SLACK_S + size / COPY_RATE_MIN:
            return False
        last = mtime
    return True


_DAMAGE = ("corrupt-file", "checksum-mismatch", "truncated-file")


def _check_misplaced(report: VerifyReport, manifest: Manifest, adapter: Adapter) -> None:
    """Files whose bytes did not read as their metadata places them, explained by the format where
    it can (DCP: each holds another file's records, files of one size swapped): one misplaced-file
    in place of their damage findings."""
    explain = getattr(adapter, "misplaced", None)
    # (with a seal, files holding others' sealed bytes are already misplaced: the format says better)
    said = (*_DAMAGE, "misplaced-file")
    damaged = {f.file for f in report.findings if f.file and f.rule in said}
    damaged |= _named_misplaced(report) & {rec.path for rec in manifest.files}  # (a swap's other file)
    if explain is None or not damaged or (found := explain(manifest, damaged)) is None:
        return
    exc, moved = found
    report.findings = [f for f in report.findings if not (f.file in moved and f.rule in said)]
    report.findings.append(_from_error(exc))


def _named_misplaced(report: VerifyReport) -> set[str]:
    """Every word of the misplaced-file findings' messages that could be a file's path: the files a
    finding names beside its own (the other file of a swap, the file copied over it)."""
    return {w for f in report.findings if f.rule == "misplaced-file" for w in re.findall(r"[\w./-]+", f.message)}


def _check_metadata_of_all(report: VerifyReport, root: Path, manifest: Manifest | None) -> None:
    """Every data file (two or more) found damaged against the metadata that places their pieces
    (DCP's ``.metadata``, megatron-core's): the metadata is the one file they all disagree with, so
    it is named first, a likely cause (another save's metadata copied in, or its own damaged), the
    data files' findings kept. Not where a file's own CRC-32s found its bytes changed. Where the
    checkpoint did not read, its ``.metadata`` and ``.distcp`` files are found by name (in the
    folder given, or one below it: a save directory's iteration), named as the findings name them."""
    if manifest is not None:
        data = [f.path for f in manifest.files if f.role == "data"]
        meta = [f.path for f in manifest.files if f.role == "metadata" and f.path.rsplit("/", 1)[-1] == ".metadata"]
    elif root.is_dir():
        found = [rel for rel, _ in _listed(root) if rel.count("/") <= 1]
        meta = [rel for rel in found if rel.rsplit("/", 1)[-1] == ".metadata"]
        top = meta[0].rsplit("/", 1)[0] + "/" if meta and "/" in meta[0] else ""
        data = [
            rel for rel in found if rel.endswith(".distcp") and rel.startswith(top) and rel.count("/") == top.count("/")
        ]
    else:
        return
    if len(data) < 2 or len(meta) != 1:
        return
    hurt = {f.file for f in report.findings if f.severity == "error" and f.rule in ("truncated-file", "corrupt-file")}
    crc = {f.file for f in report.findings if f.rule == "checksum-mismatch"}
    # (or it names more data files that are not here than the folder holds: another save's layout)
    absent = {f.file for f in report.findings if f.rule == "missing-file" and f.file and f.file.endswith(".distcp")}
    every = all(rel in hurt for rel in data)
    if crc & set(data) or not (every or (len(absent) > len(data) and not _whole_ranks_gone(data, absent))):
        return
    # each data file still ends as torch writes one, with its last record's zip end record: whole
    # files the metadata misplaces, not files cut short (an interrupted copy, a full disk)
    base = Path(manifest.root) if manifest is not None else root
    if not all(_ends_as_written(base / rel) for rel in data):
        return
    said = (
        f"all {len(data)} data files disagree with it (each is named below)"
        if all(rel in hurt for rel in data)
        else f"it names {len(absent)} data files that are not here, where the folder holds {len(data)}"
    )
    report.findings.insert(
        0,
        finding(
            "corrupt-file",
            f"{meta[0]}: {said}: it is likely another save's metadata copied in, or damaged, rather than so many "
            "data files at once",
            file=meta[0],
            hint=f"restore {meta[0]} from the save the data files were written by; 'ckpttool inspect' of that save's "
            "folder shows its metadata",
        ),
    )


def _whole_ranks_gone(present: list[str], absent: set[str]) -> bool:
    """Whether the data files the metadata names and the folder lacks are whole ranks' (every file
    of a rank gone, the others' all here, by FileSystemWriter's ``__<rank>_<n>.distcp`` names): a
    partial copy, a node's files lost, not another save's metadata (which names files of ranks
    that are here, or leaves some of a rank's)."""
    from ckpttool.formats.dcp import writer_rank

    held: dict[int, set[bool]] = defaultdict(set)
    for rels, here in ((present, True), (absent, False)):
        for rel in rels:
            if (rank := writer_rank(rel)) is not None:
                held[rank].add(here)
    return bool(held) and all(len(v) == 1 for v in held.values())


def _ends_as_written(path: Path) -> bool:
    """Whether a DCP data file ends as torch writes one: with a whole record, found from its end
    records (:func:`~ckpttool._torchzip.record_start`)."""
    try:
        with RandomAccessFile(path, display=path.name) as f:
            return record_start(f, f.size) is not None
    except (CkptError, OSError):
        return False


def _listed(root: Path) -> list[tuple[str, int]]:
    """The files below ``root`` (relative paths and sizes), or none where it does not list."""
    try:
        return list_files(root)
    except CkptError:
        return []


def _check_copies(report: VerifyReport, manifest: Manifest, adapter: Adapter, digests: dict[str, FileDigest]) -> None:
    """Data files with the same bytes where the metadata places different pieces
    (:func:`ckpttool.seal.copied_files`), except those a finding already names (the format's own
    misplaced-file says which is the copy)."""
    named = {f.file for f in report.findings if f.file} | _named_misplaced(report)
    for copy in copied_files(adapter, manifest, {rel: d for rel, d in digests.items() if rel not in named}):
        report.findings.append(
            finding("misplaced-file", copy.message, severity=copy.severity, file=copy.files[0], hint=copy.hint)
        )


def _archive_damage(
    root: Path, found: list[Finding], record_owners: Callable[[Path], dict[str, dict[int, str]]] | None = None
) -> list[Finding]:
    """Where reading stopped at damaged files (no seal): the other torch.save files beside them
    (the top folders the damaged ones are in; files directly in ``root`` for those there) checked
    against the CRC-32s their zip archives carry, so that a flipped byte elsewhere is named in the
    same run; DCP ``.distcp`` files too, their records found from their ends, last to first, each
    damaged record named with its item where the format's ``record_owners`` can still say (the
    metadata read though a data file did not). Files that are not torch.save archives are left alone."""
    named = {f.file for f in found if f.file}
    owners: dict[str, dict[int, str]] | None = None
    tops = {rel.split("/", 1)[0] if "/" in rel else "" for rel in named if not os.path.isabs(rel)}
    out: list[Finding] = []
    for top in sorted(tops):
        try:
            if top:
                rels = [f"{top}/{rel}" for rel, _ in list_files(root / top, relative_to=root)]
            else:  # (the checkpoint directory's own files: not the other saves beside them)
                with os.scandir(root) as entries:
                    rels = sorted(e.name for e in entries if e.is_file(follow_symlinks=False))
        except (CkptError, OSError):
            continue
        for rel in rels:
            records = rel.endswith(".distcp")  # (torch.save records back to back, walked without .metadata)
            if records and owners is None:
                owners = record_owners(root) if record_owners is not None else {}
            if rel not in named and (records or rel.endswith(_pt.SUFFIXES)):
                out += _zip_damage(root, rel, records=records, owners=(owners or {}).get(rel))
    return out


def _zip_damage(
    root: Path, rel: str, *, records: bool = False, whole: bool = False, owners: dict[int, str] | None = None
) -> list[Finding]:
    """File ``rel``'s members checked against the CRC-32s its zip archive stores (``records``: a
    DCP file's torch.save records back to back). A file that does not start as a zip is left alone;
    ``whole``: one that does is a torch.save that must read whole (cut short: said), and a ``.pt``
    or ``.pth`` file empty or starting with zeros is one never written (said). ``owners``: the
    item each of a DCP file's records holds, by the byte it starts at, named with its damage. Bytes
    after a torch.save file's archive: a warning."""
    added: list[Finding] = []
    try:
        with RandomAccessFile(root / rel, display=rel) as f:
            head = bytes(f.read(0, min(4, f.size)))
            if whole and not head.strip(b"\0") and rel.endswith((".pt", ".pth")):
                _pt.check_head(rel, head, f.size)  # (raises: empty, or zeros)
            if head != _pt.ZIP_MAGIC:
                return []
            if records:
                damaged, held = record_crc_errors(f, rel), owners or {}
                of = {held.get(start) for _, start in damaged}
                bad = [f"{name} of the record at byte {start:,}" + (f" (of {held[start]})" if start in held else "")
                       for name, start in damaged]  # fmt: skip
            else:
                arch = Archive(f, display=rel)
                bad, of = arch.crc_errors(), {None}
                if (appended := bytes_added(arch, rel)) is not None:
                    added.append(_from_error(appended))
    except CkptError as exc:
        # (it starts as DCP's writer writes, or as torch.save: a chain or archive that breaks is damage)
        return [_from_error(exc)] if records or whole else []
    if not bad:
        return added
    return [
        *added,
        finding(
            "checksum-mismatch",
            f"{rel}: {', '.join(bad[:3])}{' …' if len(bad) > 3 else ''} fail(s) the zip CRC-32 stored "
            "with them: the bytes changed after the save",
            file=rel,
            item=next(iter(of)) if len(of) == 1 else None,  # (one item's records: the finding's item)
        ),
    ]


def _check_aux_archives(report: VerifyReport, manifest: Manifest, besides: _Besides) -> None:
    """The torch.save files a checkpoint holds beside the state its format reads (a Hugging Face
    Trainer's ``optimizer.pt``, ``scheduler.pt`` and ``rng_state.pth`` beside ``model.safetensors``):
    not read as state, but checked as archives (cut short, empty, CRC-32s), so that their damage
    does not pass unsaid. Without a seal (a seal hashes them)."""
    optimizer = (manifest.extras.get("state_files") or {}).get("optimizer")
    for f in manifest.files:
        if f.role != "aux" or not f.path.endswith(_pt.SUFFIXES) or _pt.foreign_zip(Path(manifest.root) / f.path):
            continue  # (a TorchScript file, a zip of assets: not judged as a torch.save file)
        if f.path == optimizer and _check_optimizer_beside(report, besides, f.path, sealed=False):
            continue  # (its CRC-32s checked in the same read)
        report.findings += _zip_damage(Path(manifest.root), f.path, whole=True)
        report.checked["files"] = report.checked.get("files", 0) + 1
        report.checked["bytes"] = report.checked.get("bytes", 0) + f.size


class _Besides:
    """The torch.save files beside a checkpoint's state, each read once in a run (:func:`_beside`):
    the optimizer check and --deep's values both need a Trainer's ``optimizer.pt``."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self.read: dict[str, Manifest | None] = {}

    def __call__(self, rel: str) -> Manifest | None:
        if rel not in self.read:
            self.read[rel] = _beside(self.manifest, rel)
        return self.read[rel]


def _beside(manifest: Manifest, rel: str) -> Manifest | None:
    """The torch.save file ``rel`` a checkpoint keeps beside its format's state (a Hugging Face
    Trainer's ``optimizer.pt``) read as the single file it is, its items named from the file
    (``optimizer.state.0.exp_avg``) and its step the checkpoint's; None where it does not read (its
    damage is said by the archive check)."""
    from ckpttool.formats.torchsave import ADAPTER

    root = Path(manifest.root)
    try:
        with checking_crcs():
            beside = ADAPTER.describe(root / rel)
    except CkptError:
        return None
    stem = rel.rsplit(".", 1)[0]
    renamed = Manifest(
        root=str(root), format=beside.format, step=manifest.step, layout=beside.layout, extras=beside.extras
    )
    for item in beside.items.values():
        pieces = [replace(p, file=rel, rank=None) for p in item.pieces]
        name = f"{stem}.{item.name}"  # (optimizer.state.0.step: optimizer state by its new name)
        renamed.add(replace(item, name=name, pieces=pieces, kind=classify(name, is_tensor=item.is_tensor)))
    renamed.files = [replace(r, path=rel) for r in beside.files]
    return renamed


def _check_optimizer_beside(report: VerifyReport, besides: _Besides, rel: str, *, sealed: bool) -> bool:
    """The optimizer state a checkpoint keeps in a torch.save file beside its format's (a Hugging
    Face Trainer's ``optimizer.pt``, keyed by parameter index) checked as any optimizer state is:
    a parameter without its state, steps that disagree with each other or the checkpoint's,
    moments all zero after a step. Without a seal its CRC-32s are checked in the same read (the
    digests the zero check needs). False where it does not read as optimizer state."""
    from ckpttool.formats.torchsave import ADAPTER

    beside = besides(rel)
    if beside is None or not any(i.kind == "optim" for i in beside.items.values()):
        return False
    # the pieces' digests the step and zero checks compare, and (without a seal) the CRC-32s, in one
    # read of the file; with a seal, which vouches for the file's bytes as a whole and holds no
    # digests of its pieces, that read comes on top of the seal's (a seal never hides a finding)
    found = VerifyReport(path=report.path)
    digests, _ = _check_integrity(found, beside, ADAPTER, None, None)
    if not sealed:
        report.findings += found.findings
        for key in ("files", "bytes"):
            report.checked[key] = report.checked.get(key, 0) + found.checked.get(key, 0)
    _check_optimizer(report, beside, ADAPTER, digests, "xxh3-128")
    return True


def _one_per_changed_file(findings: list[Finding]) -> list[Finding]:
    """A file whose bytes are found changed (against the seal or its zip CRC-32s) that its reader
    could not read either: one finding, the change's, saying what reading the file met (the
    reader's failure is what the change did, not a second fault)."""
    read = {f.file: f for f in findings if f.rule == "corrupt-file" and f.file and f.item is None}
    merged: set[str] = set()
    out: list[Finding] = []
    for f in findings:
        bad = read.get(f.file) if f.file and f.item is None else None
        if f.rule in ("checksum-mismatch", "truncated-file") and bad is not None:
            said = bad.message.removeprefix(f"{f.file}: ")
            own = f.message.removeprefix(f"{f.file}: ")
            if said in own:  # (the change's finding says it already)
                message = f.message
            elif said.startswith(own):  # (the reader met what the change is: only what it adds)
                tail = said[len(own) :].lstrip("; ")
                message = f"{f.message}; {tail}" if tail else f.message
            else:
                message = f"{f.message}; reading it: {said}"
            rank = f.rank if bad.rank is None else bad.rank
            out.append(replace(f, message=message, rank=rank))
            merged.add(bad.file or "")
        else:
            out.append(f)
    return [f for f in out if not (f.rule == "corrupt-file" and f.item is None and f.file in merged)]


def _dedupe(findings: list[Finding]) -> list[Finding]:
    """One finding per (rule, file, item) (of no file: per message and item): the metadata walk and
    the seal may both see a missing file. The one that knows the rank wins, else the later: the
    seal's, which knows the file's sealed size."""
    best: dict[tuple[str, str | None, str | None], Finding] = {}
    for f in findings:
        key = (f.rule, f.file, f.item) if f.file else (f.rule, f.message, f.item)  # (a finding of no file: its words)
        old = best.get(key)
        if old is None or f.rank is not None or old.rank is None:
            best[key] = f
    return list(best.values())


def _from_error(exc: CkptError, item: str | None = None) -> Finding:
    """The finding for what stopped a file or ``item`` from being read. A CRC-32 that fails is
    damage to report, whatever the command that found it would have said to do about it."""
    rule = exc.rule if exc.rule in RULES else "corrupt-file"
    hint = None if rule == "checksum-mismatch" else exc.hint
    message = exc.message if item is None or item in exc.message else f"{item}: {exc.message}"
    return finding(rule, message, file=exc.path, item=item, rank=exc.rank, hint=hint, severity=exc.severity)


def _not_a_file(bases: list[Path], found: Finding) -> Finding:
    """A file the layout or the seal expects, said missing where a folder (or another non-file)
    stands at its path: said as such, it is not deleted but replaced (a copy that made a folder of
    it). ``bases``: the folders the report's files may be named from, the first that has it wins."""
    if found.rule != "missing-file" or not found.file or os.path.isabs(found.file):
        return found
    for base in bases:
        with contextlib.suppress(OSError):
            st = os.lstat(base / found.file)
            if not stat.S_ISREG(st.st_mode) and not stat.S_ISLNK(st.st_mode):
                if "stands at that path" in found.message:  # (said by the reader that opened it)
                    return found
                what = not_a_file(st.st_mode)
                return replace(found, message=f"{found.message} ({what} stands at that path, not a file)")
            return found
    return found


# -- files and bytes -------------------------------------------------------------------------------


@dataclass
class _SealedBytes:
    """The files a seal lists, as found under ``scope``, and their digests being computed."""

    scope: Path
    on_disk: dict[str, int]
    digests: Future[tuple[dict[str, FileDigest], dict[Any, str]]]
    runner: ThreadPoolExecutor
    stop: threading.Event
    escaping: dict[str, str] = field(default_factory=dict)
    """Links among the seal's folders that lead out of ``scope`` (not read): path → target."""
    added: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Folders made in a folder of data files after the seal: path → (files, bytes) below it."""
    special: dict[str, str] = field(default_factory=dict)
    """What stands among the seal's folders that is neither file nor folder (a FIFO, a socket),
    the seal not listing it: path → what it is (:func:`~ckpttool.io.not_a_file`)."""

    def result(self) -> dict[str, FileDigest]:
        try:
            return self.digests.result()[0]
        finally:
            self.runner.shutdown()

    def cancel(self) -> None:
        """Stop hashing (verify failed or was interrupted before it needed the digests)."""
        self.stop.set()
        self.runner.shutdown()


def _sealed_folder(root: Path, sealed: Seal) -> Path | None:
    """The folder the seal was made over, found in the checkpoint being verified: ``root`` itself,
    or a folder inside it (a save directory's iteration folder). The seal records it as it was
    given (relative to where ``seal`` ran), so it is looked for as written when that lies inside
    ``root``, else by its name below ``root``; never outside ``root`` (a copy's seal names the
    original, which is not what is being verified)."""
    if not root.is_dir():
        return None
    recorded = Path(sealed.head.root)
    top = Path(os.path.normpath(root.absolute()))
    for candidate in (recorded, root / recorded.name):
        # by the path as written, not where links lead: a folder linked out of the checkpoint is
        # still this checkpoint's, and the hashing reports the link (unsafe-path) instead of reading it
        if Path(os.path.normpath(candidate.absolute())).is_relative_to(top) and candidate.is_dir():
            return candidate
    return None


def _seal_scope(root: Path, sealed: Seal, manifest: Manifest | None) -> Path:
    if manifest is not None:
        return Path(manifest.root)
    return _sealed_folder(root, sealed) or (root if root.is_dir() else root.parent)


def _hash_sealed_files(
    scope: Path,
    sealed: Seal,
    workers: int | None,
    progress: Callable[[int], None] | None,
    *,
    one_file: bool = False,
    within: Path | None = None,
) -> _SealedBytes:
    """List the seal's folders under ``scope`` and start hashing the files it names that are
    there, in the background: the hashing threads read while the caller describes the checkpoint.

    Nothing whose real path leaves ``within`` (default ``scope``: the directory the user gave) is
    read: a link out, the seal's folder itself being one, is an ``unsafe-path`` finding. With
    ``one_file`` (the checkpoint is a single file) the files beside it are not looked at."""
    limit = within or scope
    expected = {f.path for f in sealed.head.files if f.role != "seal"}
    # look for extra files only in the folders of the checkpoint's data (so the other tags or
    # iterations of a save directory, and the logs a run keeps there, are not "extra"); for missing
    # ones wherever the seal has files
    looked = _folders_of_the_data(sealed, expected)
    on_disk: dict[str, int] = {}
    escaping: dict[str, str] = {}
    added: dict[str, tuple[int, int]] = {}
    special: dict[str, str] = {}
    # (the subfolders it was sealed with, those holding its files among them)
    had = {} if one_file or sealed.folders is None else sealed.folders
    for folder in sorted({_folder(rel) for rel in expected} | looked):
        d = scope / folder if folder else scope
        if (real := outside(limit, d)) is not None:
            escaping[folder] = real  # the folder is (or lies in) a link out: nothing in it is read
            continue
        if d.is_dir():
            names = (p.name for p in d.iterdir()) if folder in looked else _names_in(expected, folder)
            for p in (d / name for name in names):
                if folder not in looked and not p.is_symlink() and not p.exists():
                    continue
                rel = f"{folder}/{p.name}" if folder else p.name
                tmp = is_temp_name(p.name)  # (a ckpttool writer's temporary folder is incomplete-save's)
                if one_file and rel not in expected:
                    continue
                if p.is_symlink() and (real := outside(limit, p)) is not None:
                    escaping[rel] = real
                elif p.is_file():
                    on_disk[rel] = p.stat().st_size
                elif p.is_dir():
                    if p.name not in had.get(folder, [p.name]) and not tmp:
                        added[rel] = _size_below(p)
                elif rel not in expected:  # (one the seal lists: missing, said with what stands there)
                    with contextlib.suppress(OSError):  # (a dangling link: neither, and nothing)
                        special[rel] = not_a_file(p.stat().st_mode)
    present = [f.path for f in sealed.head.files if f.path in expected and f.path in on_disk]
    runner, stop = ThreadPoolExecutor(max_workers=1), threading.Event()
    future = runner.submit(hash_files, scope, present, {}, sealed.algo, workers=workers, progress=progress, cancel=stop)
    return _SealedBytes(scope, on_disk, future, runner, stop, escaping, added, special)


def _folder(rel: str) -> str:
    return rel.rsplit("/", 1)[0] if "/" in rel else ""


def _names_in(files: set[str], folder: str) -> list[str]:
    return sorted(rel.rsplit("/", 1)[-1] for rel in files if _folder(rel) == folder)


def _folders_of_the_data(sealed: Seal, expected: set[str]) -> set[str]:
    """The folders a sealed checkpoint's data lies in, those between them and the one they share (a
    Megatron iteration's folder above its ranks') and the seal's folders below that one; not the
    save directory above a tag or iteration, which holds only its tracker and what the run keeps
    beside its saves. Every folder of the seal where it lists no data file (a seal of an older
    ckpttool)."""
    data = {_folder(f.path) for f in sealed.head.files if f.role == "data" and f.path in expected}
    if not data:
        return {_folder(rel) for rel in expected}
    common = os.path.commonpath([f"/{d}" for d in data]).lstrip("/")
    out = set()
    for d in data:
        while True:
            out.add(d)
            if d == common or not d:
                break
            d = _folder(d)
    # and every folder of the seal's below that one (a DCP save's sharded/ Hugging Face files)
    return out | {f for f in map(_folder, expected) if not common or f == common or f.startswith(f"{common}/")}


def _size_below(folder: Path) -> tuple[int, int]:
    """(files, bytes) below ``folder``, links not followed."""
    files = size = 0
    for dirpath, _, filenames in os.walk(folder):
        for name in filenames:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(dirpath, name))
                files, size = files + 1, size + (st.st_size if stat.S_ISREG(st.st_mode) else 0)
    return files, size


def _check_seal(
    report: VerifyReport,
    root: Path,
    sealed: Seal,
    manifest: Manifest | None,
    adapter: Adapter | None,
    workers: int | None,
    progress: Callable[[int], None] | None,
    early: _SealedBytes | None = None,
) -> dict[tuple[str, int], str]:
    """Files and pieces against the seal: every present file hashed once (by ``early`` when it
    hashed the right folder); a file that differs is read again to name the pieces that changed."""
    expected = {f.path: f for f in sealed.head.files if f.role != "seal"}
    ours = len(report.findings)  # (the findings from here on are the seal's)
    uncovered = _unsealed(report, sealed, manifest, expected)
    scope = _seal_scope(root, sealed, manifest)
    if early is None or early.scope.resolve() != scope.resolve():
        if early is not None:
            early.cancel()  # the checkpoint's files lie elsewhere than guessed: hash them there
        within = root if root.is_dir() else root.parent
        early = _hash_sealed_files(scope, sealed, workers, progress, one_file=not root.is_dir(), within=within)
    file_digests = early.result()
    on_disk = early.on_disk
    given = (root if root.is_dir() else root.parent).resolve()
    for rel, real in sorted(early.escaping.items()):
        shown = rel or os.path.relpath(scope, root if root.is_dir() else root.parent)
        report.findings.append(
            finding(
                "unsafe-path",
                f"{shown!r} is a link to {real}, outside the checkpoint directory {given}: not read",
                file=shown,
                hint="copy the data into the checkpoint directory instead of linking to it",
            )
        )
    missing = sorted(
        rel
        for rel in set(expected) - set(on_disk)
        if not any(e == "" or rel == e or rel.startswith(e + "/") for e in early.escaping)
    )
    for rel in missing:
        report.findings.append(
            finding("missing-file", f"{rel}: in the seal but not on disk", file=rel, rank=_rank_of(expected[rel]))
        )
    extra = sorted(rel for rel in set(on_disk) - set(expected) if not is_seal_name(rel.rsplit("/", 1)[-1]))
    for rel in extra:
        report.findings.append(
            finding("extra-file", f"{rel}: on disk but not in the seal ({on_disk[rel]:,} bytes)", file=rel)
        )
    for rel, what in sorted(early.special.items()):
        report.findings.append(finding("extra-file", f"{rel}: on disk but not in the seal ({what})", file=rel))
    for rel in sorted(set(uncovered) - set(extra)):  # (in a folder the seal has no file in)
        report.findings.append(finding("extra-file", f"{rel}: in the checkpoint but not in the seal", file=rel))
    for rel, (n, size) in sorted(early.added.items()):
        report.findings.append(
            finding(
                "extra-file",
                f"{rel}/: a folder made after the seal beside the checkpoint's data files ({n:,} file"
                f"{'' if n == 1 else 's'}, {size:,} bytes)",
                file=rel,
            )
        )
    present = [rel for rel in expected if rel in on_disk]
    # a file whose digest matches holds the bytes the seal's piece digests were taken from
    report.checked["files"] = len(present)
    report.checked["bytes"] = sum(on_disk[rel] for rel in present)
    changed = {
        rel
        for rel in present
        if file_digests[rel].size != expected[rel].size or file_digests[rel].digest != expected[rel].checksum
    }
    piece_digests: dict[tuple[str, int], str] = {}
    suspects: dict[str, list[PieceRecord]] = defaultdict(list)  # the seal's records of changed files
    spans: dict[str, list[Span]] = defaultdict(list)
    unspanned: list[tuple[str, int]] = []
    for rec in sealed.pieces:
        if rec.file in changed:
            suspects[rec.file].append(rec)
            if rec.offset is not None and rec.length is not None:
                spans[rec.file].append(Span((rec.item, rec.index), rec.offset, rec.length))
            else:
                unspanned.append((rec.item, rec.index))
        elif rec.file in on_disk and rec.file in expected:
            piece_digests[(rec.item, rec.index)] = rec.checksum
    if spans:
        _, again = hash_files(scope, sorted(spans), spans, sealed.algo, workers=workers)
        piece_digests.update(again)
        differ = [
            r for recs in suspects.values() for r in recs if again.get((r.item, r.index)) not in (None, r.checksum)
        ]
        if differ and manifest is not None and adapter is not None and (moved := _moved(adapter, manifest, differ)):
            _, there = hash_files(scope, sorted(moved), moved, sealed.algo, workers=workers)
            piece_digests.update(there)
    if manifest is not None and adapter is not None and unspanned:
        with adapter.reader(manifest) as reader:
            for name, i in unspanned:
                item = manifest.items.get(name)
                if item is not None and i < len(item.pieces):
                    try:
                        values = reader.read(item.pieces[i], item)
                        piece_digests[(name, i)] = hash_bytes(values.reshape(-1).view("u1").data, sealed.algo)
                    except CkptError:
                        pass  # reported through the file checks
    swapped: set[str] = set()
    for rel in (rel for rel in present if rel in changed):
        want, got = expected[rel], file_digests[rel]
        if got.digest is None:  # (not read to its end: no digest to compare)
            report.findings.append(_unread(rel, got, _rank_of(want)))
            continue
        inside = [r for r in suspects[rel] if r.offset is not None and (r.length or 0) + r.offset <= got.size]
        # shorter, but the pieces it still holds are the sealed ones: cut short. Pieces that differ
        # too: another file in its place (another rank's, a later save's), said below
        if got.size < want.size and all(piece_digests.get((r.item, r.index)) in (None, r.checksum) for r in inside):
            report.findings.append(
                finding(
                    "truncated-file",
                    f"{rel} is {got.size:,} bytes, the seal says {want.size:,}: cut short",
                    file=rel,
                    rank=_rank_of(want),
                )
            )
            continue
        if rel in swapped:
            continue  # (named with the file it was swapped with)
        if (placed := _sealed_elsewhere(rel, expected, file_digests)) is not None:
            report.findings.append(placed[0])
            swapped.update(placed[1:])
            continue
        culprits = [r.item for r in suspects[rel] if piece_digests.get((r.item, r.index)) not in (None, r.checksum)]
        culprits = list(dict.fromkeys(culprits))  # (an item of several pieces in the file: named once)
        same = bool(suspects[rel]) and all(piece_digests.get((r.item, r.index)) == r.checksum for r in suspects[rel])
        # (the tensors' bytes are the sealed ones: a save again, unless what describes them changed)
        damaged = (
            _beside_sealed_bytes(rel, sealed, manifest, adapter, workers, report.findings[:ours])
            if same and not culprits
            else None
        )
        what = (
            f"; the changed bytes are in {', '.join(culprits[:5])}" + (" …" if len(culprits) > 5 else "")
            if culprits
            else f"; every tensor in it holds its sealed bytes, so the damage is outside them: {damaged}"
            if damaged
            else "; every tensor in it holds its sealed bytes, described as when sealed: the file was written "
            "again (its other bytes differ: the pickle, the tensors' order), or bytes no reader uses changed"
            if same
            else ""
        )
        size_note = f" (size {got.size:,}, sealed {want.size:,})" if got.size != want.size else ""
        if got.size < want.size:
            size_note += ": not cut short, its bytes differ too; another file in its place?"
        report.findings.append(
            finding(
                "checksum-mismatch",
                f"{rel}: {sealed.algo} differs from the seal{size_note}{what}",
                file=rel,
                item=culprits[0] if len(culprits) == 1 else None,
                rank=_rank_of(want),
                hint=_DAMAGED_BESIDE if damaged else _SAVED_AGAIN if same and not culprits else None,
            )
        )
    report.checked["pieces"] = len(piece_digests)
    if uncovered and manifest is not None and adapter is not None:
        # what the seal does not vouch for is checked as without one: a seal never hides damage
        before = dict(report.checked)
        more, _ = _check_integrity(report, manifest, adapter, workers, progress, only=set(uncovered))
        piece_digests.update(more)
        for key, n in before.items():
            report.checked[key] = report.checked.get(key, 0) + n
    if manifest is None and root.is_dir() and scope.resolve() != root.resolve():
        # an unreadable save directory's findings name files from it, the seal's from its
        # iteration: named from the directory given, as the reader's are (one finding per file)
        prefix = os.path.relpath(scope, root).replace(os.sep, "/")
        report.findings[ours:] = [
            replace(f, file=f"{prefix}/{f.file}") if f.file and f.file != prefix else f for f in report.findings[ours:]
        ]
    return piece_digests


_SAVED_AGAIN = (
    "the file was saved again after the seal (or bytes between its records changed, zip padding): seal the "
    "checkpoint again if that save was meant, or restore the sealed file"
)


_DAMAGED_BESIDE = "restore the file from the save or its source; sealing it again would vouch for the damage"


def _beside_sealed_bytes(
    rel: str,
    sealed: Seal,
    manifest: Manifest | None,
    adapter: Adapter | None,
    workers: int | None,
    read: list[Finding],
) -> str | None:
    """Why a changed file whose every tensor still holds its sealed bytes is damaged rather than
    written again, or None: it could not be read (``read``: what reading the checkpoint found), it
    describes its tensors otherwise than when sealed (a flipped bit in a safetensors header renames
    a tensor, or makes its shape not fit its bytes), or a zip member fails its CRC-32 (a flipped
    byte in a pickle)."""
    if manifest is None or adapter is None:
        said = [f.message for f in read if f.severity == "error" and f.file and Path(f.file).name == Path(rel).name]
        return said[0].removeprefix(f"{rel}: ") if said else "the checkpoint could not be read"
    then, now = _described(sealed.manifest, rel), _described(manifest, rel)
    if then != now:
        gone = sorted({name for name, *_ in then - now})
        new = sorted({name for name, *_ in now - then})
        moved = [n for n in gone if n in new]
        said = [
            *(f"{n} is described otherwise" for n in moved),
            *(f"{n} is no longer in it" for n in gone if n not in moved),
            *(f"{n} is new" for n in new if n not in moved),
        ]
        more = f" and {len(said) - 4} more" if len(said) > 4 else ""
        return "it describes them otherwise than when sealed (" + "; ".join(said[:4]) + more + ")"
    found = VerifyReport(path=manifest.root)
    with contextlib.suppress(CkptError, OSError):
        _check_integrity(found, manifest, adapter, workers, None, only={rel})
    errors = [f for f in found.findings if f.severity == "error" and f.file in (rel, None)]
    if errors:
        first = errors[0].message.removeprefix(f"{rel}: ")
        return first + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else "")
    return None


def _described(manifest: Manifest, rel: str) -> set[tuple[Any, ...]]:
    """What ``manifest`` says of the tensors in file ``rel``: each piece's item name, dtype, shape
    and place in the tensor."""
    return {
        (item.name, item.dtype, tuple(item.shape or ()), tuple(p.box.offsets), tuple(p.box.sizes), p.flat)
        for item in manifest.items.values()
        if item.is_tensor
        for p in item.pieces
        if p.file == rel
    }


def _moved(adapter: Adapter, manifest: Manifest, records: list[PieceRecord]) -> dict[str, list[Span]]:
    """Of the pieces whose bytes at the seal's offsets differ from it (``records``), those that lie
    elsewhere in their file now, with their spans there: a file saved again with the same values
    may hold them at other offsets. Hashed only where the seal put them, they were "the changed
    bytes", and their copies in other files "differed". Only these pieces are located (their
    headers read): a flipped byte costs no more than before."""
    moved: dict[str, list[Span]] = {}
    try:
        with adapter.reader(manifest) as reader:
            for rec in records:
                item = manifest.items.get(rec.item)
                if item is None or not item.is_tensor or rec.index >= len(item.pieces):
                    continue
                piece = item.pieces[rec.index]
                if piece.file != rec.file:
                    continue
                try:
                    at = reader.raw_span(piece, item)
                except (CkptError, OSError, ValueError):
                    continue  # (cut short or damaged there: the seal's offsets said it)
                if at is not None and at != (rec.offset, rec.length):
                    moved.setdefault(rec.file, []).append(Span((rec.item, rec.index), *at))
    except (CkptError, OSError):
        return {}
    return moved


def _sealed_elsewhere(
    rel: str, expected: dict[str, Any], digests: dict[str, FileDigest]
) -> tuple[Finding] | tuple[Finding, str] | None:
    """A file that differs from its seal but holds exactly the bytes the seal gives another file of
    the checkpoint: a copy of that file over it, or the two swapped (not damage to its bytes), with
    the file it was swapped with (its finding is this one). None where it holds no other sealed
    file's bytes."""
    got, own = digests[rel], expected[rel].checksum
    others = sorted(
        other
        for other, rec in expected.items()
        if other != rel and rec.size == got.size and rec.checksum == got.digest and rec.checksum != own
    )
    if not others:
        return None
    first = others[0]
    back = digests.get(first)
    swapped = back is not None and back.digest == expected[rel].checksum and back.size == expected[rel].size
    how = f"{rel} and {first} were swapped" if swapped else f"{first} was copied over {rel}"
    more = f" (and {len(others) - 1} more files' alike)" if len(others) > 1 else ""
    found = finding(
        "misplaced-file",
        f"{rel} holds the bytes the seal gives {first}{more}: {how}",
        file=rel,
        rank=_rank_of(expected[rel]),
        hint="put each file back under its own name, or restore this one from the save",
    )
    return (found, first) if swapped else (found,)


def _check_seal_is_this_saves(report: VerifyReport, sealed: Seal, manifest: Manifest) -> None:
    """A seal of another save (another step, or another format; given with ``--manifest``, or left
    beside a later save): most files differ from it, which is not storage corruption. Said once, as
    a step mismatch between the seal and the checkpoint, and the files' mismatches say why instead
    of blaming the disk. A seal whose step alone differs, with most files alike, is this save's own
    and its step field damaged: left to the mismatches."""
    theirs, ours = sealed.head, manifest
    # the id a DCP save gives its .metadata (a fresh uuid each save): told apart at the same step too
    ids = (theirs.extras.get("save_id"), ours.extras.get("save_id"))
    other_id = None not in ids and ids[0] != ids[1] and theirs.format == ours.format
    same_step = theirs.step is None or ours.step is None or theirs.step == ours.step
    if theirs.format == ours.format and same_step and not other_id:
        return
    # (most of its files changed: a step field damaged in this save's own seal leaves the rest alike)
    changed = {f.file for f in report.findings if f.rule in ("checksum-mismatch", "truncated-file") and f.file}
    if theirs.format == ours.format and len(changed) * 2 <= len([f for f in theirs.files if f.role != "seal"]):
        return
    what = f"a {theirs.format} checkpoint" if theirs.format != ours.format else f"step {theirs.step}"
    here = f"a {ours.format} checkpoint" if theirs.format != ours.format else f"step {ours.step}"
    if theirs.format == ours.format and same_step:
        what, here = f"save id {ids[0]}", f"save id {ids[1]}, of step {ours.step}"
    because = f"the seal is of another save ({what}; this checkpoint is {here})"
    report.findings = [
        replace(f, message=f"{f.message} ({because})", hint="verify against this save's own seal")
        if f.rule in ("checksum-mismatch", "truncated-file", "missing-file", "extra-file")
        else f
        for f in report.findings
    ]
    report.findings.insert(
        0,
        finding(
            "step-mismatch",
            f"{report.seal or 'the seal'}: {because}",
            hint="give the seal written for this checkpoint (ckpttool.manifest.json beside it), or seal it anew "
            "once you trust it",
        ),
    )


def _stale_seal(report: VerifyReport, sealed: Seal, manifest: Manifest) -> Finding | None:
    """A save directory's seal left from an earlier save: it names the files of one of the
    directory's tags or iterations, the tracker now another's, laid out alike. Not a checkpoint
    that cannot be checked (exit 3): the save is checked as without a seal, and the seal's being of
    another save is a step-mismatch, as the rule says of a seal of another step."""
    own = [f.path for f in manifest.files if f.role in ("data", "metadata")]
    expected = {f.path for f in sealed.head.files if f.role != "seal"}
    if not own or sealed.head.format != manifest.format or any(rel in expected for rel in own):
        return None
    mine = [rel.split("/", 1) for rel in own if "/" in rel]
    theirs = [rel.split("/", 1) for rel in expected if "/" in rel]
    here, there = {m[0] for m in mine}, {t[0] for t in theirs}
    if len(here) != 1 or len(there) != 1 or not {m[1] for m in mine} & {t[1] for t in theirs}:
        return None
    steps = (sealed.head.step, manifest.step)
    said = (
        f" (step {steps[0]}; this checkpoint is step {steps[1]})" if None not in steps and len(set(steps)) > 1 else ""
    )
    return finding(
        "step-mismatch",
        f"{report.seal or 'the seal'}: the seal is of {there.pop()}, another save in this directory{said}, and names "
        f"none of {here.pop()}'s files, the save the directory points to now: they were checked as without a seal",
        hint="seal the directory again once you trust its new save (ckpttool seal DIR), or verify the save the seal "
        "is of: ckpttool verify DIR/<that save> --manifest SEAL",
    )


def _unsealed(report: VerifyReport, sealed: Seal, manifest: Manifest | None, expected: dict[str, Any]) -> list[str]:
    """The checkpoint's data and metadata files the seal does not name. A seal that names none of
    them is another checkpoint's (a file's seal given for a file beside it, a seal edited): the
    checkpoint cannot be checked against it, which is said rather than a clean result."""
    if manifest is None:
        return []
    own = [f.path for f in manifest.files if f.role in ("data", "metadata")]
    uncovered = [rel for rel in own if rel not in expected]
    if own and len(uncovered) == len(own):
        sealed_names = sorted(expected)
        named = ", ".join(sealed_names[:3]) + (" …" if len(sealed_names) > 3 else "") if sealed_names else "no file"
        hint = (
            "give the seal made of this checkpoint with --manifest, or verify without a seal "
            "(move it aside); 'ckpttool seal' makes a new one"
        )
        what = "it is the seal of another checkpoint, or it was edited"
        root = Path(manifest.root)
        if (inner := _named_from_below(own, expected)) is not None:
            what = f"its files are named from {root / inner}, a folder of this checkpoint: it is that folder's seal"
            hint = f"verify that folder with it: ckpttool verify {root / inner} --manifest {report.seal}"
        elif (outer := _named_from_below(list(expected), own)) is not None:
            above = Path(os.path.normpath(root / os.path.relpath(".", outer)))
            what = f"its files are named from {above}, the folder above this checkpoint: it is that folder's seal"
            hint = f"verify that folder with it: ckpttool verify {above} --manifest {report.seal}"
        raise CkptError(
            f"{report.seal}: none of this checkpoint's {plural(len(own), 'file')} ({', '.join(own[:3])}"
            f"{' …' if len(own) > 3 else ''}) is in the seal, which names {named}: {what}",
            hint=hint,
            path=report.seal,
        )
    return uncovered


def _named_from_below(files: Iterable[str], names: Iterable[str]) -> str | None:
    """The folder ``P`` (a tag or iteration of a save directory) such that ``names``, named from
    ``P``, are most of ``files``: a seal of that folder given for the save directory. None if none."""
    files, names = set(files), set(names)
    firsts = {f.split("/", 1)[0] for f in files if "/" in f}
    for first in sorted(firsts):
        if sum(1 for n in names if f"{first}/{n}" in files) * 2 > len([f for f in files if f.startswith(f"{first}/")]):
            return first
    return None


def _unread(rel: str, got: FileDigest, rank: int | None) -> Finding:
    """The finding for a data file whose bytes could not be hashed to their end: one a writer
    changed while verify read it (a save at work on the checkpoint now), or one the system
    failed to read."""
    if got.changed:
        return finding(
            "incomplete-save",
            f"{rel} changed while verify read it ({got.error}): a save is writing this checkpoint now",
            file=rel,
            rank=rank,
            hint="wait for the save to finish, then verify again",
        )
    return finding("corrupt-file", f"{rel}: cannot be read ({got.error})", file=rel, rank=rank)


def _rank_of(record: Any) -> int | None:
    return record.ranks[0] if getattr(record, "ranks", None) else None


def _check_integrity(
    report: VerifyReport,
    manifest: Manifest,
    adapter: Adapter,
    workers: int | None,
    progress: Callable[[int], None] | None,
    only: set[str] | None = None,
) -> tuple[dict[tuple[str, int], str], dict[str, FileDigest]]:
    """No seal: the CRC32 of every zip member the format carries, and piece digests for the
    replica and optimizer checks, in one read of every data file; returns those and the files'.
    ``only``: just these files (those a seal does not name).

    File by file: the pieces and zip members of one file are located, the file is handed to a
    hashing thread, and what was located is dropped once its digests are checked, so memory holds
    the piece digests and a few files' spans, not an archive object per piece."""
    root = Path(manifest.root)
    hashable = {f.path for f in manifest.files if f.role in ("data", "metadata")}
    by_path = {f.path: f for f in manifest.files}
    pieces: dict[tuple[str, int], str] = {}
    files: dict[str, FileDigest] = {}
    counted = {"files": 0, "bytes": 0}
    pool_size = workers or default_workers()
    lanes = lanes_for(
        (f.size for f in manifest.files if f.path in hashable and (only is None or f.path in only)), pool_size
    )

    def check(fut: Future[tuple[FileDigest, dict[Any, str]]], rel: str, spans: list[Span], expected: Expected) -> None:
        digest, digests = fut.result()
        if digest.digest is None:
            report.findings.append(_unread(rel, digest, _rank_of(by_path.get(rel))))
        files[rel] = digest
        counted["files"] += 1
        counted["bytes"] += max(digest.size, 0)
        for file, message, owner in crc_failures(digests, expected, {rel: spans}, reader):
            rank = _rank_of(by_path.get(file))
            report.findings.append(finding("checksum-mismatch", message, file=file, item=owner, rank=rank))
        for key, value in digests.items():
            if key[0] == "piece":
                pieces[(key[1], key[2])] = value

    archive_damage: list[CkptError] = []
    pending: deque[tuple[Future[tuple[FileDigest, dict[Any, str]]], str, list[Span], Expected]] = deque()
    # the pickles and headers read to locate the pieces are checked against their CRC-32s as they
    # are read: a flipped bit in one is damage (checksum-mismatch), not a hostile pickle
    with (
        checking_crcs(),
        adapter.reader(manifest) as reader,
        ThreadPoolExecutor(max_workers=pool_size) as pool,
    ):

        def submit(rel: str | None, spans: list[Span], expected: Expected) -> None:
            # (a file of compressed items has no spans: its members were checked as they were
            # decompressed, and it is still read for its digest, which the copy check compares)
            if rel is None or rel not in hashable:
                return
            fut = pool.submit(hash_file, root, rel, spans, "xxh3-128", progress, None, lanes)
            pending.append((fut, rel, spans, expected))
            while len(pending) > 2 * pool_size:
                check(*pending.popleft())

        current: str | None = None
        spans: list[Span] = []
        expected: Expected = {}
        seen: set[tuple[str, int]] = set()
        for item, i, piece in in_file_order(manifest):
            if only is not None and piece.file not in only:
                continue
            if piece.file != current:
                submit(current, spans, expected)
                current, spans, expected = piece.file, [], {}
            span: tuple[int, int] | None = None
            if item.is_tensor:
                try:
                    span = reader.raw_span(piece, item)
                except CkptError as exc:
                    report.findings.append(_from_error(exc, item.name))
                    continue
                if span is not None:
                    spans.append(Span(("piece", item.name, i), span[0], span[1]))
            try:
                failed = member_crcs(reader, piece, item, seen, spans, expected, archive_damage)
            except CkptError as exc:
                report.findings.append(_from_error(exc, item.name))
                continue
            owner = item.name if "offset" in piece.locator else None
            if item.is_tensor and span is None and not failed:
                _digest_in_memory(reader, item, i, piece, pieces)
            for name in failed:  # decompressed (zstd) item: checked in memory
                report.findings.append(
                    finding(
                        "checksum-mismatch",
                        f"{piece.file}: member {name} of {owner or 'the archive'} fails its CRC32",
                        file=piece.file,
                        item=owner,
                    )
                )
        submit(current, spans, expected)
        while pending:
            check(*pending.popleft())
    # the damage an item's own piece also found is reported as that item's
    named = {f.message for f in report.findings}
    unnamed: dict[str | None, list[CkptError]] = {}
    for damage in archive_damage:  # members of an archive not one item's piece found damaged
        if not any(m.endswith(": " + damage.message) for m in named):
            unnamed.setdefault(damage.path, []).append(damage)
    for excs in unnamed.values():  # one finding a file
        found = _from_error(excs[0])
        more = f" (and {len(excs) - 1} more of its members likewise)" if len(excs) > 1 else ""
        report.findings.append(replace(found, message=found.message + more))
    for f in manifest.files:  # metadata with no pieces (DCP's .metadata) and trackers: read whole by describe
        if f.role in ("metadata", "tracker") and f.path not in files and (only is None or f.path in only):
            counted["files"] += 1
            counted["bytes"] += f.size
    report.checked["files"] = counted["files"]
    report.checked["bytes"] = counted["bytes"]
    report.checked["pieces"] = len(pieces)
    return pieces, files


def _digest_in_memory(reader: Any, item: Item, i: int, piece: Piece, pieces: dict[tuple[str, int], str]) -> None:
    """The digest of a piece whose archive is held in memory (a decompressed DCP item), for the
    replica and optimizer checks: its bytes are there already. A piece that would need another
    read of its file (a strided view) is left to those checks' own reading."""
    arch = reader.archive_of(piece) if hasattr(reader, "archive_of") else None
    if arch is None or not isinstance(arch.source, bytes):
        return
    try:
        values = reader.read(piece, item)
    except CkptError:
        return  # what is wrong with it is reported by the checks that read it
    pieces[(item.name, i)] = hash_bytes(values.reshape(-1).view("u1").data, "xxh3-128")


# -- the manifest ----------------------------------------------------------------------------------


def _check_manifest(report: VerifyReport, manifest: Manifest, required: set[str]) -> None:
    for item in manifest.items.values():
        if item.refused:
            report.findings.append(
                finding(
                    "unsafe-pickle",
                    f"{item.name}: {item.error}",
                    item=item.name,
                    file=item.pieces[0].file if item.pieces else None,
                )
            )
        if not item.is_tensor or item.shape is None:
            continue
        try:
            boxes = [b for p in item.pieces if p.replica == 0 for b in regions(p)]
        except ValueError as exc:
            report.findings.append(finding("corrupt-file", f"{item.name}: {exc}", item=item.name))
            continue
        try:
            cov = coverage(item.shape, boxes)
        except ValueError as exc:
            report.findings.append(finding("coverage-overlap", f"{item.name}: {exc}", item=item.name))
            continue
        if cov.gaps:
            gap = cov.first_gap
            spans = ", ".join(f"{o}:{o + n}" for o, n in zip(gap.offsets, gap.sizes, strict=True)) if gap else ""
            where = f" (the first at [{spans}])" if gap else ""
            report.findings.append(
                finding(
                    "coverage-gap",
                    f"{item.name}: {cov.gaps:,} of {cov.total:,} elements are in no piece{where}",
                    item=item.name,
                )
            )
        if cov.overlapping:
            report.findings.append(
                finding(
                    "coverage-overlap", f"{item.name}: {cov.overlapping:,} elements are in two pieces", item=item.name
                )
            )
    report.checked["items"] = len(manifest.items)
    for state in manifest.missing_state():
        severity: Severity = "error" if state in required else "warning"
        report.findings.append(
            finding("missing-state", f"no {_STATE_WORDS[state]} in the checkpoint", severity=severity)
        )


_STATE_WORDS: dict[StateName, str] = {
    "optimizer": "optimizer state",
    "rng": "RNG state",
    "dataloader": "dataloader position",
    "scheduler": "LR scheduler state",
    "step": "training step",
}


def _most_held(sizes: dict[Any, int]) -> Any:
    """The key of ``sizes`` (how many hold each value) that more hold than any other: the value
    taken as right where copies, files or parameters disagree. None where two are held by as many,
    or there is none: no majority says which is right."""
    ranked = sorted(sizes, key=lambda k: -sizes[k])
    if not ranked or (len(ranked) > 1 and sizes[ranked[0]] == sizes[ranked[1]]):
        return None
    return ranked[0]


def _check_replicas(
    report: VerifyReport, manifest: Manifest, adapter: Adapter, digests: dict[tuple[str, int], str], deep: bool
) -> None:
    """Copies of the same box (TP-replicated norms, DP copies) must hold the same bytes. With
    ``deep``, a further copy that differs from the first is read for NaN/Inf (:func:`_nonfinite_copy`)."""
    with adapter.reader(manifest) as reader:
        for item in manifest.items.values():
            if not item.is_tensor or not any(p.replica for p in item.pieces):
                continue
            groups: dict[Any, list[int]] = defaultdict(list)
            for i, p in enumerate(item.pieces):
                groups[(p.box, p.flat)].append(i)
            for idxs in groups.values():
                if len(idxs) < 2:
                    continue
                values = []
                for i in idxs:
                    d = digests.get((item.name, i))
                    if d is None:
                        try:
                            d = hash_bytes(reader.read(item.pieces[i], item).reshape(-1).view("u1").data)
                        except CkptError:
                            continue
                    values.append((i, d))
                held = Counter(d for _, d in values)
                if len(held) < 2:
                    continue
                if deep:  # (the first copy's values are the tensor's census)
                    zero = next((d for i, d in values if item.pieces[i].replica == 0), None)
                    for i, d in values:
                        if item.pieces[i].replica and d != zero:
                            _nonfinite_copy(report, reader, item, item.pieces[i])
                # the copies most hold are taken as right; with no majority (two copies) none is blamed
                most = _most_held(held)
                blame = most is not None
                base, right = next((i, d) for i, d in values if d == most) if blame else values[0]
                odd = [i for i, d in values if d != right]
                bad: dict[int, int] = {}
                if not blame and len(odd) == 1:  # two copies: one holding NaN or Inf is the damaged one
                    bad = {i: _nonfinite(reader, item, item.pieces[i]) for i in (base, odd[0])}
                    if bad[base] and not bad[odd[0]]:
                        base, odd, blame = odd[0], [base], True
                    elif bad[odd[0]] and not bad[base]:
                        blame = True
                if not blame:  # one finding naming every copy: none can be called the damaged one
                    _replica_mismatch(report, manifest, item, [item.pieces[i] for i, _ in values])
                    continue
                for i in odd:
                    p, first = item.pieces[i], item.pieces[base]
                    _replica_mismatch(report, manifest, item, [p, first], blame=True, nonfinite=bad.get(i, 0))
            # a region no piece of the first copy holds as such: a copy cut at other boundaries
            lone = [
                idxs[0]
                for idxs in groups.values()
                if all(item.pieces[i].replica for i in idxs) and item.pieces[idxs[0]].flat is not None
            ]
            if lone:
                _compare_ranges(report, manifest, item, reader, lone)


def _nonfinite(reader: Any, item: Item, piece: Piece) -> int:
    """How many of one piece's values are NaN or Inf (0 for a piece that does not read or holds no
    floating-point values)."""
    try:
        return _nonfinite_in(reader.read(piece, item), item)
    except CkptError:
        return 0


def _nonfinite_in(values: Any, item: Item) -> int:
    """How many of ``values`` (of ``item``'s dtype) are NaN or Inf."""
    floats = as_float(values, item.dtype or "")
    return 0 if floats is None else int((~np.isfinite(floats)).sum())


def _replica_mismatch(
    report: VerifyReport,
    manifest: Manifest,
    item: Item,
    copies: list[Piece],
    *,
    blame: bool = False,
    nonfinite: int = 0,
) -> None:
    """Copies of one region that differ. ``blame``: ``copies`` is the wrong one and one holding the
    bytes most copies hold (or the only one without NaN or Inf: ``nonfinite`` counts the wrong
    one's), and the finding names the wrong one's file. Else ``copies`` are all the region's copies,
    with no majority: the finding names each and no file."""
    p, first = copies[0], copies[-1]
    # each file named with the rank its record gives, as the other findings on it (a DeepSpeed
    # pipeline file's pieces carry its DP rank, the file its global one)
    files = {c.file for c in copies}
    by_file = {f.path: r for f in manifest.files if f.path in files and (r := _rank_of(f)) is not None}

    def rank(c: Piece) -> int | None:
        return by_file.get(c.file, c.rank)

    one_file = len(files) == 1  # (model chunks of one rank file)
    if one_file:
        many = "two" if len(copies) == 2 else len(copies)
        message = f"{item.name}: {many} copies in {p.file} (rank {rank(p)}) differ"
    elif blame:
        message = f"{item.name}: the copy in {p.file} (rank {rank(p)}) differs from the one in {first.file}"
        message += f" and holds {nonfinite:,} NaN or Inf values where that one holds none" if nonfinite else ""
    else:
        named = ", ".join(f"{c.file} (rank {rank(c)})" for c in copies[:6]) + (" …" if len(copies) > 6 else "")
        message = (
            f"{item.name}: its {len(copies)} copies ({named}) differ, and no majority of them says which hold "
            "the saved bytes"
        )
    where = {"file": p.file, "rank": rank(p)} if blame or one_file else {"file": None, "rank": None}
    if item.name in (manifest.extras.get("stage_copies") or ()):
        # DeepSpeed keeps only a tied module's tied_weight_attr in sync across the stages
        # (Megatron-DeepSpeed: the word embeddings, not the position embeddings it also ties)
        report.findings.append(
            finding(
                "replica-mismatch",
                message + ": the copies of a weight tied across pipeline stages",
                severity="warning",
                item=item.name,
                **where,
                hint="DeepSpeed keeps only the tied_weight_attr of a tied module in sync across the stages; "
                "if this weight is one (it is used in every stage that holds it), the stages diverged",
            )
        )
        return
    hint = (manifest.extras.get("copy_notes") or {}).get(item.name)  # the format's word on why copies may differ
    report.findings.append(
        finding("replica-mismatch", message, item=item.name, **where, **({"hint": hint} if hint else {}))
    )


def _compare_ranges(report: VerifyReport, manifest: Manifest, item: Item, reader: Any, lone: list[int]) -> None:
    """Pieces of a copy cut at other boundaries than the first copy's (a weight tied across
    pipeline stages, each stage's flat groups partitioned their own way): each against the
    overlapping parts of the first copy's pieces, taken in order so that a piece of the first copy
    is read once for the run of pieces it overlaps. These pieces are read a second time. Of two
    copies (a first and a last stage's), neither is taken as right: one holding NaN or Inf where
    the other holds none is blamed, else the finding names both; of more, the first is."""
    two = len({q.replica for q in item.pieces}) == 2
    base = sorted((q for q in item.pieces if q.replica == 0 and q.flat is not None), key=lambda q: q.flat or (0, 0))
    held: tuple[Piece, Any] | None = None  # the last piece of the first copy read, with its values
    for i in sorted(lone, key=lambda i: item.pieces[i].flat or (0, 0)):
        p = item.pieces[i]
        assert p.flat is not None
        a, n = p.flat
        mine = None
        for q in base:
            assert q.flat is not None
            b, m = q.flat
            lo, hi = max(a, b), min(a + n, b + m)
            if q.box != p.box or lo >= hi:
                continue
            try:
                mine = reader.read(p, item).reshape(-1) if mine is None else mine
                if held is None or held[0] is not q:
                    held = (q, reader.read(q, item).reshape(-1))
            except CkptError:
                break
            ours, theirs = mine[lo - a : hi - a], held[1][lo - b : hi - b]
            if not np.array_equal(ours.view("u1"), theirs.view("u1")):
                if not two:
                    _replica_mismatch(report, manifest, item, [p, q], blame=True)
                    break
                bad_p, bad_q = _nonfinite_in(ours, item), _nonfinite_in(theirs, item)
                if bad_p and not bad_q:
                    _replica_mismatch(report, manifest, item, [p, q], blame=True, nonfinite=bad_p)
                elif bad_q and not bad_p:
                    _replica_mismatch(report, manifest, item, [q, p], blame=True, nonfinite=bad_q)
                else:
                    _replica_mismatch(report, manifest, item, [q, p])
                break


def _check_steps(report: VerifyReport, manifest: Manifest) -> None:
    claims: dict[str, int] = manifest.extras.get("step_claims") or {}
    if not claims:
        return
    counts: dict[int, list[str]] = defaultdict(list)
    for rel, step in claims.items():
        counts[step].append(rel)
    if len(counts) > 1:
        majority = _most_held({step: len(files) for step, files in counts.items()})
        if majority is None:  # no step to call right
            said = "; ".join(f"{_others(files)} claim {step}" for step, files in sorted(counts.items()))
            report.findings.append(
                finding("step-mismatch", f"the files disagree on the step, with no majority: {said}", file=None)
            )
            return
        for step, files in sorted(counts.items()):
            if step == majority:
                continue
            for rel in files:
                report.findings.append(
                    finding(
                        "step-mismatch",
                        f"{rel} claims step {step}; {_others(counts[majority])} claim {majority}",
                        file=rel,
                    )
                )


def _check_given_alone(report: VerifyReport, manifest: Manifest) -> None:
    """One rank's file of a checkpoint given alone reads as a torch.save file, and passed as if it
    were the checkpoint: said, a warning (a CI gate pointed at the wrong path fails on warnings)."""
    whole = manifest.extras.get("file_of")
    if not whole:
        return
    rel = next((f.path for f in manifest.files if f.role == "data"), None)
    report.findings.append(
        finding(
            "missing-file",
            f"{rel} is one file of the {whole['format']} checkpoint {whole['folder']}, checked alone (its "
            "bytes and CRC-32s): the other ranks' files, and the checkpoint's steps, coverage and optimizer "
            "state across them, were not",
            file=rel,
            severity="warning",
            hint=f"verify the checkpoint itself: ckpttool verify {shlex.quote(whole['folder'])}",
        )
    )


def _check_format_findings(report: VerifyReport, manifest: Manifest) -> None:
    """What the format's reader found wrong while the rest could still be read
    (``extras["findings"]``: each ``{"rule", "file", "message"}``, a ``"hint"`` where it knows
    better than the rule's, a ``"severity"`` where it is not the rule's, a ``"rank"`` where the
    file's record has none): a file a complete save has
    and this one lacks, a rank's file in another rank's place, bytes added after a file's records."""
    for f in manifest.extras.get("findings") or ():
        report.findings.append(
            finding(
                f["rule"],
                f["message"],
                file=f["file"],
                hint=f.get("hint"),
                severity=f.get("severity"),
                rank=f.get("rank"),
            )
        )


def _others(rels: list[str]) -> str:
    """``rels`` in a few words: three named, the rest counted."""
    named = ", ".join(rels[:3])
    return named + (f" and {len(rels) - 3} more" if len(rels) > 3 else "")


_MOMENTS = ("exp_avg", "exp_avg_sq")


def _param_of(name: str) -> tuple[str, str] | None:
    # (a per-rank shard file read alone as a plain torch.save file keeps each tensor in a dict,
    # {"local": t, "global_shape": ..., ...}: its parameter <p>.local, its moments <p>.exp_avg.local)
    return param_state(name, _MOMENTS, LOCAL_KEYS)


def _check_optimizer(
    report: VerifyReport, manifest: Manifest, adapter: Adapter, digests: dict[tuple[str, int], str], algo: str
) -> None:
    """Every trained parameter has its moments, of its shape; moments are not all zero after a step."""
    moments = _moments(manifest)
    if not moments:
        return
    params = {
        name.removeprefix("model."): item
        for name, item in manifest.items.items()
        if item.kind == "param" and item.is_tensor and (item.dtype or "").startswith(("float", "bfloat"))
    }
    # ds_to_universal cuts a vocabulary parameter's padding rows from its state, not from the module
    cut = set(manifest.extras.get("vocab_cut") or [])
    for name, item in params.items():
        master = _fp32_copy(manifest, item)
        kept = [*(moments.get(name) or {}).values(), *([master] if master else [])]
        for mom in kept:
            shape, want = tuple(mom.shape or ()), tuple(item.shape or ())
            if name in cut and shape[1:] == want[1:] and shape[:1] <= want[:1]:
                continue
            if mom.is_tensor and mom.shape != item.shape:
                report.findings.append(
                    finding(
                        "optimizer-mismatch",
                        f"{mom.name} has shape {list(mom.shape or ())}, its parameter "
                        f"{item.name} {list(item.shape or ())}",
                        item=mom.name,
                    )
                )
    # weight matrices are trained unless the checkpoint says they are frozen or tied to another
    exempt = set(manifest.extras.get("frozen") or []) | set((manifest.extras.get("shared_params") or {}).keys())
    trained = [n for n in moments if n in params]
    untracked = [
        n for n, i in params.items() if n not in moments and trained and len(i.shape or ()) >= 2 and n not in exempt
    ]
    if untracked and len(untracked) < len(params):
        untracked = _in_param_groups(manifest, adapter, untracked, set(trained))
    if untracked and len(untracked) < len(params):
        names = ", ".join(untracked[:5]) + (" …" if len(untracked) > 5 else "")
        report.findings.append(
            finding(
                "optimizer-mismatch",
                f"{len(untracked)} parameters have no optimizer moments: {names}",
                severity="warning",  # (torch's Adam makes none for a parameter that never had a gradient)
                item=untracked[0],
                hint=_NO_STATE_HINT,
            )
        )
    _check_indexed_state(report, manifest, adapter, moments)
    _check_group_steps(report, manifest)
    stepping = _stepping(manifest, moments)
    reset = _zeroed_files(report, manifest, stepping, digests, algo)
    for zeroed in stepping:
        said = {p.file for p in zeroed.pieces} <= reset  # (of its file)
        if zeroed.pieces and not said and all(_zero_piece(zeroed, i, digests, algo) for i in range(len(zeroed.pieces))):
            report.findings.append(_zeroed(zeroed, manifest))
    _check_moment_pairs(report, {n: got for n, got in moments.items() if n not in params})
    _check_optimizer_steps(report, manifest, adapter, digests)


def _check_moment_pairs(report: VerifyReport, moments: dict[str, dict[str, Item]]) -> None:
    """A parameter's moments have one shape: checked by themselves, so also where the state is
    keyed by index (torch's optimizer.state_dict()) and no parameter name matches it."""
    for name, got in moments.items():
        shapes = {tuple(m.shape or ()) for m in got.values()}
        if len(shapes) > 1:
            first, *rest = got.values()
            odd = next(m for m in rest if m.shape != first.shape)
            report.findings.append(
                finding(
                    "optimizer-mismatch",
                    f"{odd.name} has shape {list(odd.shape or ())}, {first.name} {list(first.shape or ())}: the "
                    f"moments of parameter {name} disagree",
                    item=odd.name,
                )
            )


def _optimizer_step_value(reader: Any, item: Item) -> float | None:
    try:
        flat = reader.read(item.pieces[0], item).reshape(-1)
    except CkptError:
        return None
    if flat.size != 1:
        return None
    floats = as_float(flat, item.dtype or "")  # (a bfloat16 step is a bit pattern until decoded)
    return float((floats if floats is not None else flat)[0])


def _check_optimizer_steps(
    report: VerifyReport, manifest: Manifest, adapter: Adapter, digests: dict[tuple[str, int], str]
) -> None:
    """Adam's step per parameter: the same for every parameter of a run, but for parameters that
    got no gradient at some steps (unused, an expert no token reached), which lag; one that
    differs otherwise is state of another step mixed in. Compared by the digests already taken,
    one value read per distinct digest. A warning naming the parameters that differ; an error for
    a step ahead of the others and of the checkpoint's own (by more than one: no lag gives that), a
    NaN or Inf one, or one of more than one value (a step is one count: another state's tensor in
    its place). Steps that agree and are ahead of
    the checkpoint's own step are a ``step-mismatch`` warning: the optimizer's state is of a later
    save, or the run's counter was reset."""
    steps = [i for i in manifest.items.values() if i.kind == "optim" and i.is_tensor and i.name.endswith(".step")]
    for item in steps:
        if item.pieces and item.shape is not None and math.prod(item.shape) > 1:
            report.findings.append(
                finding(
                    "optimizer-mismatch",
                    f"{item.name} holds {math.prod(item.shape):,} values (shape {list(item.shape)}), where the "
                    "optimizer keeps one count of its steps: another state's tensor stands in its place",
                    item=item.name,
                    file=item.pieces[0].file,
                    hint="a moment's file copied over the step's, or a save of another optimizer; restore it from "
                    "the save",
                )
            )
    steps = [i for i in steps if i.pieces and i.shape in ((), (1,))]
    by_digest: dict[str, list[Item]] = defaultdict(list)
    for item in steps:
        d = digests.get((item.name, 0))
        if d is None:
            return  # (not hashed: nothing to compare without reading every one)
        by_digest[f"{item.dtype}:{d}"].append(item)
    if not by_digest or (len(by_digest) < 2 and manifest.step is None):
        return
    by_value: dict[str, list[Item]] = defaultdict(list)  # (by the value's exact text: NaN equals no NaN as a float)
    values: dict[str, float | None] = {}
    try:
        with adapter.reader(manifest) as reader:
            for group in by_digest.values():
                v = _optimizer_step_value(reader, group[0])
                said = "?" if v is None else f"{v:g}" if float(f"{v:g}") == v or math.isnan(v) else repr(v)
                values[said] = v
                by_value[said] += group
    except CkptError:
        return
    if len(by_value) < 2:
        where, at = _held_by(steps)
        _steps_ahead(report, manifest, next(iter(values.values())), where, **at)
        return
    # the step most hold, never a NaN, an Inf or one unread; none where two hold as many
    ranked = sorted(by_value, key=lambda k: -len(by_value[k]))
    sound = [k for k in ranked if values[k] is not None and math.isfinite(values[k] or 0.0)]
    common = _most_held({k: len(by_value[k]) for k in sound})
    hint = (
        "parameters that got no gradient at some steps lag behind; otherwise state of another step or run "
        "was mixed into this one"
    )
    broken = [k for k in by_value if k != "?" and k not in sound]  # (NaN or Inf: no step lags to that)
    if broken:
        hint = f"a step of {broken[0]} is damage: Adam's bias correction turns it into NaN updates"
    if common is None:
        sides = "; ".join(
            f"{len(by_value[k])} at {k} ({', '.join(i.name for i in by_value[k][:3])}"
            f"{' …' if len(by_value[k]) > 3 else ''})"
            for k in ranked
        )
        report.findings.append(
            finding(
                "optimizer-mismatch",
                f"the {len(steps)} optimizer steps disagree, no value held by most: {sides}",
                severity="error" if broken else "warning",
                item=by_value[ranked[0]][0].name,
                hint=hint,
            )
        )
        return
    # ahead of the others and of the checkpoint's own step (one more allowed: DeepSpeed's optimizers
    # take a step with zero gradients when they start, and a run may count its steps from 0): no lag
    # gives that. Ahead of the others alone can be right (a body unfrozen after its head trained).
    step = manifest.step
    limit = step + 1 if isinstance(step, int) else None
    ahead = [
        k for k in sound if k != common and limit is not None and (values[k] or 0.0) > max(limit, values[common] or 0.0)
    ]
    if ahead and not broken:
        hint = (
            f"a parameter never takes more optimizer steps than the checkpoint's {step} training steps: the steps "
            "above it are state of a later save or of another run mixed into this one; restore those files from one "
            "save"
        )
    odd = [(k, i) for k in ranked if k != common for i in by_value[k]]
    named = ", ".join(f"{i.name} ({k})" if k != "?" else i.name for k, i in odd[:5])
    report.findings.append(
        finding(
            "optimizer-mismatch",
            f"{len(odd)} of {len(steps)} optimizer steps differ from the others' ({common})"
            + (f", {sum(len(by_value[k]) for k in ahead)} of them ahead" if ahead else "")
            + f": {named}"
            + (" …" if len(odd) > 5 else ""),
            severity="error" if broken or ahead else "warning",
            item=odd[0][1].name,
            hint=hint,
        )
    )
    where, at = _held_by(by_value[common])
    _steps_ahead(report, manifest, values[common], where, **at)


def _check_group_steps(report: VerifyReport, manifest: Manifest) -> None:
    """The optimizer steps a format keeps in its pickles' param groups, file by file
    (``extras["group_steps"]``: Megatron's distributed optimizer and ``torch_dist`` saves): one
    step for the whole run, so a file whose steps differ from the most files' holds another save's
    optimizer state (an error), and steps ahead of the checkpoint's own are a ``step-mismatch``
    warning (see :func:`_steps_ahead`)."""
    held: dict[str, list[float]] = manifest.extras.get("group_steps") or {}
    by_file = {rel: steps[0] for rel, steps in held.items() if steps and len(set(steps)) == 1}
    odd_inside = sorted(rel for rel, steps in held.items() if len(set(steps)) > 1)
    counts: dict[float, int] = defaultdict(int)
    for v in by_file.values():
        counts[v] += 1
    if not counts:
        return
    common = _most_held(counts)
    odd = sorted(rel for rel, v in by_file.items() if v != common) + odd_inside
    if odd:
        said = ", ".join(f"{rel} ({', '.join(f'{v:g}' for v in sorted(set(held[rel])))})" for rel in odd[:5])
        report.findings.append(
            finding(
                "optimizer-mismatch",
                (
                    f"{len(odd)} of {len(held)} files keep optimizer steps other than the others' ({common:g}): "
                    if common is not None
                    else f"the {len(held)} files' optimizer steps disagree, no value held by most: "
                )
                + said
                + (" …" if len(odd) > 5 else ""),
                file=odd[0],  # (its rank: the file's record gives it, _ranked)
                hint="the optimizer takes one step for every rank at once: those files hold optimizer state of "
                "another save or run; restore them from one save",
            )
        )
    if common is not None:
        first = min(rel for rel, v in by_file.items() if v == common)
        more = f" and {counts[common] - 1} more files'" if counts[common] > 1 else ""
        _steps_ahead(report, manifest, common, f"{first}'s param groups{more}", file=first)


def _steps_ahead(
    report: VerifyReport, manifest: Manifest, value: float | None, where: str, *, item: str | None = None,
    file: str | None = None,
) -> None:  # fmt: skip
    """A ``step-mismatch`` warning where the optimizer's steps (``value``, held ``where``: the items
    or files named) are ahead of the checkpoint's step by more than one: Adam steps once per
    training step at most (fewer where fp16 skipped steps, or the optimizer started afresh; one
    more where DeepSpeed's optimizers stepped at start, or the run counts its steps from 0), so its
    state is of a later save, unless the run's counter was reset while the optimizer kept its state."""
    step = manifest.step
    if value is None or not math.isfinite(value) or not isinstance(step, int) or value <= step + 1:
        return
    report.findings.append(
        finding(
            "step-mismatch",
            f"the optimizer's steps are {value:g} ({where}), ahead of the checkpoint's step {step}: the optimizer "
            "takes one step per training step at most",
            severity="warning",
            item=item,
            file=file,
            hint="the optimizer state is another, later save's: restore it from the save of this step; or the "
            "run's step counter was reset while the optimizer kept its state (a new phase), and the step is the "
            "phase's",
        )
    )


def _held_by(items: list[Item]) -> tuple[str, dict[str, str | None]]:
    """How :func:`_steps_ahead` names the step items ``items``: the first and a count of the rest."""
    first = items[0]
    more = f" and {len(items) - 1} more" if len(items) > 1 else ""
    return f"{first.name}{more}", {"item": first.name, "file": first.pieces[0].file if first.pieces else None}


_GROUP_PARAMS = re.compile(r"^(optim|optimizer)\.param_groups\.\d+\.params$")
_NO_STATE_HINT = (
    "a parameter unused in the forward pass (or an expert no token reached) has none; otherwise the optimizer "
    "state lost it"
)


def _group_lists(manifest: Manifest, adapter: Adapter) -> list[Any] | None:
    """The values of the optimizer's ``param_groups.<g>.params`` lists (None: one unreadable)."""
    lists = [i for n, i in manifest.items.items() if _GROUP_PARAMS.match(n)]
    unkept = [i for i in lists if i.value is None and i.summary is not None and not i.error]  # (long lists)
    read: dict[str, Any] = {}
    if unkept:
        try:
            with adapter.reader(manifest) as reader:
                read = {i.name: reader.read_object(i) for i in unkept}
        except CkptError:
            return None
    return [read.get(i.name, i.value) for i in lists]


def _check_indexed_state(
    report: VerifyReport, manifest: Manifest, adapter: Adapter, moments: dict[str, dict[str, Item]]
) -> None:
    """An optimizer state keyed by parameter index (torch's ``optimizer.state_dict()``): every
    index its param groups list has moments once any has: a warning, as torch's Adam makes no state
    for a parameter that never had a gradient (an unused module), and none was lost then."""
    if not moments or not all(n.isdigit() for n in moments):
        return
    lists = _group_lists(manifest, adapter) or []
    listed = [v for value in lists if isinstance(value, list | tuple) for v in value if type(v) is int]
    missing = [v for v in listed if str(v) not in moments]
    if missing and len(missing) < len(listed):
        report.findings.append(
            finding(
                "optimizer-mismatch",
                f"{len(missing)} of the {len(listed)} parameters the optimizer's param groups list have no state: "
                f"indices {', '.join(map(str, missing[:8]))}" + (" …" if len(missing) > 8 else ""),
                severity="warning",
                item=next((n for n in manifest.items if _GROUP_PARAMS.match(n)), None),
                hint=_NO_STATE_HINT,
            )
        )


def _in_param_groups(manifest: Manifest, adapter: Adapter, untracked: list[str], trained: set[str]) -> list[str]:
    """Of the parameters ``untracked`` (no moments), those the optimizer trains, where its param
    groups name its parameters (``get_state_dict``'s FQNs, as ``params`` lists, or DCP's flattened
    ``optim.param_groups.<fqn>.lr``): a parameter no group names is frozen, not dropped. Where the
    groups name parameters otherwise (torch's own indices), all of ``untracked``."""
    flat = [n for n in manifest.items if n.startswith(("optim.param_groups.", "optimizer.param_groups."))]
    listed: set[str] = set()
    if any(_GROUP_PARAMS.match(n) for n in flat):
        values = _group_lists(manifest, adapter)
        if values is None:
            return untracked
        for value in values:
            if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
                return untracked  # indices (torch's optimizer.state_dict()), or unreadable
            listed.update(value)
    else:  # flattened: each parameter's group entries under its name
        for key in (n.split(".param_groups.", 1)[1].split(".") for n in flat):
            listed.update(".".join(key[:i]) for i in range(1, len(key)))
    if not listed & trained:
        return untracked  # the groups do not name these parameters
    return [n for n in untracked if n in listed]


def _moments(manifest: Manifest) -> dict[str, dict[str, Item]]:
    """The optimizer's moments by the name of their parameter: ``{param: {"exp_avg": item, ...}}``."""
    moments: dict[str, dict[str, Item]] = defaultdict(dict)
    for item in manifest.items.values():
        if item.kind == "optim" and item.is_tensor:
            pm = _param_of(item.name)
            if pm:
                moments[pm[0].removeprefix("optim.state.").removeprefix("optimizer.state.")][pm[1]] = item
    return moments


def _stepping(manifest: Manifest, moments: dict[str, dict[str, Item]]) -> list[Item]:
    """The moments that hold values once training has stepped: every one after step 0, but those
    of parameters the format knows nothing trains, and those with no elements (a parameter of
    shape (0, 4): its empty moments are all zeros, and healthy). Checked for all zeros by their
    digests, and by value under ``--deep`` (a moment multiplied by 0 keeps -0.0, whose bytes are not 0)."""
    if not (manifest.step or 0) > 0:
        return []
    unused = set(manifest.extras.get("unused") or ())
    return [m for n, pair in moments.items() if n not in unused for m in pair.values() if math.prod(m.shape or ()) > 0]


def _zeroed(moment: Item, manifest: Manifest) -> Finding:
    return finding(
        "optimizer-mismatch",
        f"{moment.name} is all zeros at step {manifest.step}: the moments were reset or never saved",
        item=moment.name,
    )


def _zeroed_files(
    report: VerifyReport, manifest: Manifest, stepping: list[Item], digests: dict[tuple[str, int], str], algo: str
) -> set[str]:
    """Files in which every piece of every moment is all zeros after a step, where other files hold
    moments that are not: one rank's optimizer state reset (a partition zeroed, a rank restarted
    from nothing) while the others kept theirs. Each is a finding naming the file and its rank;
    returns them. (A piece of zeros alone is no sign: vocabulary padding rows never get a
    gradient. A whole rank's every moment is.)"""
    zero: dict[str, list[bool]] = defaultdict(list)
    for moment in stepping:
        for i, piece in enumerate(moment.pieces):
            if piece.replica == 0 and piece.nbytes:
                zero[piece.file].append(_zero_piece(moment, i, digests, algo))
    reset = {f for f, flags in zero.items() if len(flags) >= 2 and all(flags)}
    if not reset or len(reset) == len(zero):  # (every file: the moments' own findings say it)
        return set()
    ranks = {f.path: _rank_of(f) for f in manifest.files}
    for f in sorted(reset):
        report.findings.append(
            finding(
                "optimizer-mismatch",
                f"{f}: every optimizer moment it holds ({len(zero[f])} pieces) is all zeros at step {manifest.step}, "
                "where the other files' are not: this rank's optimizer state was reset or never saved",
                file=f,
                rank=ranks.get(f),
            )
        )
    return reset


def _zero_piece(item: Item, i: int, digests: dict[tuple[str, int], str], algo: str) -> bool:
    d = digests.get((item.name, i))
    if d is None:
        return False
    nbytes = item.pieces[i].nbytes
    return d == _zeros_digest(nbytes, algo)


_ZERO_CACHE: dict[tuple[int, str], str] = {}


def _zeros_digest(nbytes: int, algo: str) -> str:
    key = (nbytes, algo)
    if key not in _ZERO_CACHE:
        _ZERO_CACHE[key] = hash_bytes(bytes(nbytes), algo)  # type: ignore[arg-type]
    return _ZERO_CACHE[key]


# -- values (--deep) -------------------------------------------------------------------------------


_ROUNDED: dict[str, Any] = {"float32": np.uint32, "bfloat16": np.uint16, "float16": np.uint16}


def _fp32_copy(manifest: Manifest, item: Item) -> Item | None:
    """The master copy the optimizer keeps of parameter ``item`` (``<param>.fp32``), where it has one."""
    master = manifest.items.get(f"{item.name}.fp32")
    return master if master is not None and master.kind == "master" else None


def _master_of(manifest: Manifest, item: Item) -> Item | None:
    """The fp32 master copy of parameter ``item`` (:func:`_fp32_copy`), when it has one of its shape."""
    master = _fp32_copy(manifest, item)
    if (
        item.kind != "param"
        or item.dtype not in _ROUNDED
        or master is None
        or not master.is_tensor
        or master.dtype != "float32"
        or master.shape != item.shape
    ):
        return None
    return master


def _check_master(report: VerifyReport, item: Item, values: np.ndarray, master: Item, fp32: np.ndarray) -> None:
    """A parameter's fp32 master copy rounds to the parameter itself: Megatron's and DeepSpeed's
    optimizers copy every updated master into the model's weights (``copy_``: round to nearest
    even), so at a save the two agree bit for bit; they do in every real checkpoint of fixtures/
    (fp32, bf16 and fp16, distributed optimizer or not, ZeRO-1/2/3, universal). Masters of another
    rank or another save (optimizer files swapped, copied over each other or mixed) do not."""
    flat = fp32.reshape(-1).view(np.float32)
    if item.dtype == "float32":
        want = flat.view(np.uint32)
    elif item.dtype == "bfloat16":
        want = float32_to_bf16(flat)
    else:
        want = flat.astype(np.float16).view(np.uint16)
    off = want != values.reshape(-1).view(_ROUNDED[item.dtype or ""])
    floats = as_float(values, item.dtype or "")
    if off.any() and floats is not None:
        off &= ~(np.isnan(flat) & np.isnan(floats.reshape(-1)))  # (NaN bits vary)
    n = int(off.sum())
    if not n:
        return
    index = [int(i) for i in np.unravel_index(int(np.argmax(off)), item.shape or ())] if item.shape else []
    with np.errstate(invalid="ignore"):
        odd = ~np.isfinite(flat[off]) | (~np.isfinite(floats.reshape(-1)[off]) if floats is not None else False)
    if odd.all():  # (only where one side is NaN or Inf: a value damaged or diverged, not another save's copy)
        cause = "only where one of them is NaN or Inf (see nonfinite): a value damaged, or a step that diverged"
    else:
        cause = (
            "the optimizer's copy of the weights is not the model's (optimizer files of another rank or another "
            "save: swapped, copied over each other or mixed?)"
        )
    report.findings.append(
        finding(
            "optimizer-mismatch",
            f"{master.name} does not round to {item.name} at {n:,} of {off.size:,} values (first at index "
            f"{index}): {cause}",
            item=item.name,
            hint="restore the optimizer files from the save: resumed as they are, training would continue from "
            "other weights than the model's",
        )
    )


def _check_values(report: VerifyReport, manifest: Manifest, adapter: Adapter, besides: _Besides | None) -> None:
    """--deep: every value read once. NaN/Inf and statistics per tensor, moments all zero by
    value, and each fp32 master against its parameter (read with it, not again on its own turn).
    (The copies of a region that differ from the first: :func:`_check_replicas`.)"""
    stepping = {m.name for m in _stepping(manifest, _moments(manifest))}
    done: set[str] = set()
    with adapter.reader(manifest) as reader:
        for item in manifest.items.values():
            if item.name in done or not item.is_tensor or item.dtype is None or item.shape is None:
                continue
            try:
                values = assemble(reader, item)
            except CkptError as exc:  # (named by the item: the byte walk's finding of it, once)
                report.findings.append(_from_error(exc, item.name))
                continue
            _census(report, item, values, item.name in stepping, manifest)
            master = _master_of(manifest, item)
            if master is None:
                continue
            done.add(master.name)
            try:
                fp32 = assemble(reader, master)
            except CkptError as exc:
                report.findings.append(_from_error(exc, master.name))
                continue
            _census(report, master, fp32, False, manifest)
            _check_master(report, item, values, master, fp32)
        if hasattr(reader, "read_in_object"):
            for item in manifest.items.values():
                if not item.is_tensor and item.summary is not None and item.error is None and item.pieces:
                    _check_tensors_in_value(report, reader, item, manifest)
    for item in manifest.items.values():
        # a NaN among the plain values (a learning rate, a loss); an Inf only in a learning rate, for
        # schedulers keep Infs by design (ReduceLROnPlateau's best and mode_worse)
        if item.nonfinite == "NaN" or (item.nonfinite == "Inf" and LEARNING_RATE.search(item.name)):
            holder = item.pieces[0] if item.pieces else None
            report.findings.append(
                finding(
                    "nonfinite",
                    f"{item.name}: holds {item.value if item.value is not None else item.summary} "
                    "(a NaN or Inf among the training state's plain values)",
                    item=item.name,
                    file=holder.file if holder else None,
                    rank=holder.rank if holder else None,
                )
            )
    if besides is not None:
        _check_values_beside(report, manifest, besides)
    report.checked["values"] = len(report.stats)


def _check_tensors_in_value(report: VerifyReport, reader: Any, item: Item, manifest: Manifest) -> None:
    """--deep: the tensors a value holds, each read and checked as a tensor item is, named under the
    value (``pair.0``): DCP keeps a tuple holding a tensor in one pickle, which ``dcp.load`` gives
    back with the tensor's values."""
    try:
        value = reader.read_object(item)
    except CkptError as exc:
        report.findings.append(_from_error(exc, item.name))
        return
    for path, ref in flatten(value):  # (the walk the readers name nested state by)
        if not isinstance(ref, TensorRef):
            continue
        inner = Item(
            name=f"{item.name}.{path}" if path else item.name,
            kind=item.kind,
            dtype=ref.dtype,
            shape=ref.shape,
            pieces=[replace(item.pieces[0], box=Box((0,) * len(ref.shape), ref.shape))],
        )
        try:
            values = reader.read_in_object(item, ref)
        except CkptError as exc:
            report.findings.append(_from_error(exc, inner.name))
            continue
        _census(report, inner, values, False, manifest)


def _check_values_beside(report: VerifyReport, manifest: Manifest, besides: _Besides) -> None:
    """--deep: the values of the torch.save files a checkpoint keeps beside its format's (a Hugging
    Face Trainer's ``optimizer.pt``), read as the single files they are; their items named from the
    file (``optimizer.state.0.exp_avg`` in ``optimizer.pt``)."""
    from ckpttool.formats.torchsave import ADAPTER

    for f in manifest.files:
        if f.role == "aux" and f.path.endswith(_pt.SUFFIXES) and (renamed := besides(f.path)) is not None:
            _check_values(report, renamed, ADAPTER, None)


def _census(report: VerifyReport, item: Item, values: np.ndarray, stepping: bool, manifest: Manifest) -> None:
    """NaN/Inf count and first index, and min/max/mean/std/absmax, of one tensor's values; a
    moment that should hold values (``stepping``) and is all zero. Computed block by block
    (:class:`_Census`): the float64 temporaries stay in the cache, and the memory is the values'."""
    flat = values.reshape(-1)
    if flat.size == 0 or (as_float(flat[:1], item.dtype or "") is None and flat.dtype.kind != "c"):
        return
    census = _Census()
    for lo in range(0, flat.size, _CENSUS_BLOCK):
        census.add(as_numbers(flat[lo : lo + _CENSUS_BLOCK], item.dtype or ""), lo)
    if census.absmax is not None and math.isfinite(census.absmax) and census.absmax >= 1e150:
        # (std squares them: values near float64's largest are summed again, scaled by their absmax)
        census.rescale(census.absmax)
        for lo in range(0, flat.size, _CENSUS_BLOCK):
            census.moments(as_numbers(flat[lo : lo + _CENSUS_BLOCK], item.dtype or ""))
    n_bad = census.nan + census.inf
    mean, std = census.mean_std()
    stats: dict[str, Any] = {
        "numel": int(flat.size),
        "nan": census.nan,
        "inf": census.inf,
        "min": census.low,
        "max": census.high,
        "mean": mean,
        "std": std,
        "absmax": census.absmax,
    }
    report.stats[item.name] = stats
    if stats["absmax"] == 0 and not n_bad and stepping:
        # (its bytes need not all be 0: a moment multiplied by 0 keeps -0.0 where it was negative)
        report.findings.append(_zeroed(item, manifest))
    stats["first_nonfinite"] = None
    if n_bad:
        assert census.first is not None
        index = [int(i) for i in np.unravel_index(census.first, item.shape or ())] if item.shape else []
        stats["first_nonfinite"] = index
        holder = _piece_at(item, index)
        where = ""
        if holder is not None:
            where = f" (in {holder.file}" + ("" if holder.rank is None else f", rank {holder.rank}") + ")"
        report.findings.append(
            finding(
                "nonfinite",
                f"{item.name}: {stats['nan']:,} NaN and {stats['inf']:,} Inf of {flat.size:,} "
                f"values; first at index {index}{where}",
                item=item.name,
                file=holder.file if holder else None,
                rank=holder.rank if holder else None,
            )
        )


_CENSUS_BLOCK = 1 << 16
"""elements of a tensor :func:`_census` takes at a time (its float64 temporaries: 512 KiB each)"""


class _Census:
    """The figures of :func:`_census`, gathered block by block: counts, the first NaN or Inf, the
    extremes of the finite values (of a complex tensor, of their magnitudes), and their mean and
    variance merged block by block (Chan, Golub and LeVeque's pairwise update), on values divided
    by ``scale``."""

    def __init__(self) -> None:
        self.nan = self.inf = 0
        self.first: int | None = None
        self.low: float | None = None
        self.high: float | None = None
        self.absmax: float | None = None
        self.rescale(1.0)

    def rescale(self, scale: float) -> None:
        """Start the mean and variance again on values divided by ``scale``."""
        self.scale, self.n, self.mean, self.m2 = scale, 0, 0.0, 0.0

    def add(self, floats: np.ndarray, start: int) -> None:
        """The block of values that begins at flat index ``start``."""
        bad = ~np.isfinite(floats)
        n_bad = int(bad.sum())
        if n_bad:
            nan = int(np.isnan(floats).sum())
            self.nan, self.inf = self.nan + nan, self.inf + n_bad - nan
            if self.first is None:
                self.first = start + int(np.argmax(bad))
        f64 = self._finite64(floats, bad if n_bad else None)
        if not f64.size:
            return
        low, high = float(f64.min()), float(f64.max())
        self.low = low if self.low is None else min(self.low, low)
        self.high = high if self.high is None else max(self.high, high)
        # (a complex64 magnitude is computed in complex128, where |3e38 + 3e38j| does not overflow;
        # one past float64's largest, |1.5e308 + 1.5e308j|, is inf)
        top = max(abs(low), abs(high))
        self.absmax = top if self.absmax is None else max(self.absmax, top)
        self._merge(f64)

    def moments(self, floats: np.ndarray) -> None:
        """The same block again, for the mean and variance alone (after :meth:`rescale`)."""
        bad = ~np.isfinite(floats)
        f64 = self._finite64(floats, bad if bad.any() else None)
        if f64.size:
            self._merge(f64)

    @staticmethod
    def _finite64(floats: np.ndarray, bad: np.ndarray | None) -> np.ndarray:
        finite = floats[~bad] if bad is not None else floats
        with np.errstate(over="ignore", invalid="ignore"):
            return np.abs(finite.astype(np.complex128)) if finite.dtype.kind == "c" else finite.astype(np.float64)

    def _merge(self, f64: np.ndarray) -> None:
        with np.errstate(over="ignore", invalid="ignore"):
            x = f64 / self.scale if self.scale != 1.0 else f64
            n, mean = x.size, float(x.mean())
            d = x - mean
            m2 = float(np.dot(d, d))
        total = self.n + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.n * n / total
        self.n = total

    def mean_std(self) -> tuple[float | None, float | None]:
        """Mean and standard deviation of the finite values (None without any, or with a magnitude
        past float64's largest)."""
        if not self.n or self.absmax is None or not math.isfinite(self.absmax):
            return None, None
        return self.mean * self.scale, math.sqrt(max(self.m2, 0.0) / self.n) * self.scale


def _nonfinite_copy(report: VerifyReport, reader: Any, item: Item, piece: Piece) -> None:
    """--deep: NaN/Inf in a further copy of a region (a DP copy, a TP-replicated norm, a tied
    weight's copy on another pipeline stage) whose bytes differ from the first copy's, which the
    census of the tensor does not read: a resumed run reads every rank's own copy. The finding
    names the copy's file and rank and the element's global index."""
    try:
        floats = as_float(reader.read(piece, item), item.dtype or "")
    except CkptError:
        return  # (the byte walk names the damage)
    if floats is None:
        return
    flat = floats.reshape(-1)
    bad = ~np.isfinite(flat)
    if not bad.any():
        return
    at = int(np.argmax(bad)) + (piece.flat[0] if piece.flat is not None else 0)
    index = [int(o + k) for o, k in zip(piece.box.offsets, np.unravel_index(at, piece.box.sizes), strict=True)]
    rank = "" if piece.rank is None else f", rank {piece.rank}"
    report.findings.append(
        finding(
            "nonfinite",
            f"{item.name}: the copy in {piece.file}{rank} holds {int(np.isnan(flat).sum()):,} NaN and "
            f"{int(np.isinf(flat).sum()):,} Inf of its {flat.size:,} values; first at index {index}",
            item=item.name,
            file=piece.file,
            rank=piece.rank,
        )
    )


def _piece_at(item: Item, index: Sequence[int]) -> Piece | None:
    """The piece holding the element at ``index`` of ``item`` (its first copy): the one a
    nonfinite finding names, so that a NaN on one rank's shard is traced to that rank's file."""
    point = Box(tuple(index), (1,) * len(index))
    holders = [
        piece
        for piece in item.pieces
        if piece.box.ndim == point.ndim
        and any(
            intersect(point, box)
            for box in ([piece.box] if piece.flat is None else flat_range_boxes(piece.box, *piece.flat))
        )
    ]
    return min(holders, key=lambda p: p.replica, default=None)


__all__ = ["RULES", "Finding", "Rule", "VerifyReport", "finding", "verify"]
