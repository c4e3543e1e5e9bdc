"""``inspect`` and ``ls``: what a checkpoint holds, from metadata alone."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ckpttool import registry
from ckpttool.errors import CorruptFileError, IncompleteCheckpointError
from ckpttool.manifest import SCHEMA_VERSION, Item, Manifest, StateName


@dataclass(frozen=True, slots=True)
class Tally:
    items: int = 0
    nbytes: int = 0


@dataclass(slots=True, kw_only=True)
class InspectReport:
    path: str
    manifest: Manifest
    by_kind: dict[str, Tally] = field(default_factory=dict)
    by_dtype: dict[str, Tally] = field(default_factory=dict)
    missing_state: list[StateName] = field(default_factory=list)
    unloadable: list[Item] = field(default_factory=list)
    findings: list[dict[str, Any]] = field(default_factory=list)
    """what the format's reader found wrong beside the items (:func:`format_findings`): a hostile
    pickle of training state, a rank's file from an earlier save"""

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.by_kind.values())

    @property
    def file_bytes(self) -> int:
        return sum(f.size for f in self.manifest.files)

    def to_json(self) -> dict[str, Any]:
        m = self.manifest
        return {
            "schema_version": SCHEMA_VERSION,
            "path": self.path,
            "format": m.format,
            "format_version": m.format_version,
            "step": m.step,
            "layout": asdict(m.layout),
            "files": {"count": len(m.files), "bytes": self.file_bytes, "by_role": _count(f.role for f in m.files)},
            "nbytes": self.nbytes,
            "by_kind": {k: asdict(t) for k, t in self.by_kind.items()},
            "by_dtype": {k: asdict(t) for k, t in self.by_dtype.items()},
            "missing_state": list(self.missing_state),
            "items": [item_row(i) for i in m.items.values()],
            "unloadable": [{"name": i.name, "error": i.error} for i in self.unloadable],
            "extras": m.extras,
        }


def _count(values: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def item_row(item: Item) -> dict[str, Any]:
    """One item as ``ls``/``inspect --json`` show it."""
    row: dict[str, Any] = {
        "name": item.name,
        "kind": item.kind,
        "dtype": item.dtype,
        "shape": list(item.shape) if item.shape is not None else None,
        "nbytes": item.nbytes,
        "pieces": len(item.pieces),
    }
    if not item.is_tensor:
        row["value"] = item.value
    if item.error:
        row["error"] = item.error
    return row


def inspect(path: str | Path) -> InspectReport:
    """Detect the format and summarise the checkpoint; reads metadata, never tensor data."""
    _, manifest = registry.describe(path)
    refuse_unreadable(manifest)
    by_kind: dict[str, Tally] = {}
    by_dtype: dict[str, Tally] = {}
    for item in manifest.items.values():
        n = item.nbytes
        t = by_kind.get(item.kind, Tally())
        by_kind[item.kind] = Tally(t.items + 1, t.nbytes + n)
        key = item.dtype or "object"
        t = by_dtype.get(key, Tally())
        by_dtype[key] = Tally(t.items + 1, t.nbytes + n)
    return InspectReport(
        path=str(path),
        manifest=manifest,
        by_kind=by_kind,
        by_dtype=by_dtype,
        missing_state=manifest.missing_state(),
        unloadable=[i for i in manifest.items.values() if i.error],
        findings=format_findings(manifest),
    )


_UNREADABLE = ("corrupt-file", "truncated-file", "missing-file", "incomplete-save")
"""The rules of a format's finding that say a file of the checkpoint does not read (or is not there)"""


def format_findings(manifest: Manifest) -> list[dict[str, Any]]:
    """What the format's reader found wrong while it still read the rest (``extras["findings"]``),
    each with its severity (the rule's where the finding gives none)."""
    found = manifest.extras.get("findings") or ()
    if not found:
        return []  # (verify's rules, and all it imports, only where there is something to judge)
    from ckpttool.verify import RULES

    return [
        {**f, "severity": f.get("severity") or (RULES[f["rule"]].severity if f["rule"] in RULES else "error")}
        for f in found
    ]


def refuse_unreadable(manifest: Manifest) -> None:
    """Stop where an item could not be read for damage or permissions, not for a refused pickle
    (which is reported, the rest described): a file that does not read is exit 3, as with the
    formats whose reader stops at it; it was called "cannot be loaded safely", exit 1 (``ls``: 0).
    Likewise a file of training state beside the items that does not read, or a rank's file that is
    missing, which the format's reader noted and read past (a Trainer's ``optimizer.pt`` cut short
    was called "missing training state: optimizer", exit 0)."""
    unread = [f for f in format_findings(manifest) if f["severity"] == "error" and f["rule"] in _UNREADABLE]
    if unread:
        first = unread[0]
        cls = IncompleteCheckpointError if first["rule"] in ("missing-file", "incomplete-save") else CorruptFileError
        raise cls(
            first["message"]
            + (f" (and {len(unread) - 1} more: 'ckpttool verify' lists them)" if len(unread) > 1 else ""),
            hint=first.get("hint") or "restore the file from a good copy ('ckpttool verify' names every damaged file)",
            path=first.get("file"),
        )
    bad = [i for i in manifest.items.values() if i.error and not i.refused]
    if bad:
        files = sorted({i.pieces[0].file for i in bad if i.pieces})
        by_error: dict[str, list[str]] = {}
        for i in bad:
            by_error.setdefault(i.error or "", []).append(i.name)
        said = [
            f"{error} ({names[0]}" + (f" and {len(names) - 1} more item(s))" if len(names) > 1 else ")")
            for error, names in list(by_error.items())[:3]
        ]
        raise CorruptFileError(
            f"{len(bad)} item(s) cannot be read: {'; '.join(said)}"
            + (f"; {len(by_error) - 3} more reasons" if len(by_error) > 3 else ""),
            hint=f"{', '.join(files[:3])} {'is' if len(files) == 1 else 'are'} damaged or unreadable: check the "
            "permissions, or restore from a good copy ('ckpttool verify' names every damaged file)",
            path=files[0] if files else None,
        )


def ls(path: str | Path, pattern: str | None = None) -> tuple[Manifest, list[Item]]:
    """The items of a checkpoint, optionally those whose name matches ``pattern`` (re.search)."""
    _, manifest = registry.describe(path)
    refuse_unreadable(manifest)
    rx = re.compile(pattern) if pattern else None
    items = [i for i in manifest.items.values() if rx is None or rx.search(i.name)]
    return manifest, items
