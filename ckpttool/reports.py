"""Verify reports for CI systems: JUnit XML, GitHub Actions annotations and step summary, and the
grouping the human output uses ("12 ranks missing: 3, 5, 7 …", not twelve lines)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import dataclass

from ckpttool.verify import RULES, SEVERITY_ORDER, Finding, Severity, VerifyReport

_GROUP_AT = 4


@dataclass(frozen=True, slots=True)
class Group:
    rule: str
    severity: Severity
    findings: tuple[Finding, ...]

    @property
    def line(self) -> str:
        """One line for the group: the finding itself, or a count with the files/items/ranks."""
        if len(self.findings) == 1:
            return self.findings[0].message
        names = [f.item or f.file or "" for f in self.findings]
        what = RULES[self.rule].summary
        shown = ", ".join(n for n in names[:6] if n) + (" …" if len(names) > 6 else "")
        if all(f.rank is not None for f in self.findings):
            ranks = sorted({f.rank for f in self.findings if f.rank is not None})
            listed = ", ".join(map(str, ranks[:12])) + (" …" if len(ranks) > 12 else "")
            return f"{len(self.findings)} findings ({what}), ranks {listed}: {shown}"
        return f"{len(self.findings)} findings ({what}): {shown}"


def groups(report: VerifyReport) -> list[Group]:
    """Findings grouped by rule when a rule fires ``_GROUP_AT`` times or more; most severe first."""
    by_rule: dict[str, list[Finding]] = defaultdict(list)
    for f in report.findings:
        by_rule[f.rule].append(f)
    out: list[Group] = []
    for rule, found in by_rule.items():
        severities = {f.severity for f in found}
        if len(found) >= _GROUP_AT and len(severities) == 1:
            out.append(Group(rule, found[0].severity, tuple(found)))
        else:
            out += [Group(rule, f.severity, (f,)) for f in found]
    out.sort(key=lambda g: -SEVERITY_ORDER[g.severity])
    return out


def junit(report: VerifyReport, fail_on: Severity = "error") -> str:
    """One testsuite, one testcase per rule (passing rules included), a failure per finding at or
    above ``fail_on``."""
    suite = ET.Element("testsuite", name="ckpttool verify", tests=str(len(RULES)))
    failures = 0
    by_rule: dict[str, list[Finding]] = defaultdict(list)
    for f in report.findings:
        by_rule[f.rule].append(f)
    for rule in RULES.values():
        case = ET.SubElement(suite, "testcase", classname=f"ckpttool.{rule.id}", name=f"{rule.id}: {report.path}")
        found = by_rule.get(rule.id, [])
        failing = [f for f in found if SEVERITY_ORDER[f.severity] >= SEVERITY_ORDER[fail_on]]
        if failing:
            failures += 1
            el = ET.SubElement(case, "failure", type=rule.id, message=failing[0].message)
            el.text = "\n".join(f"[{f.severity}] {f.message}" for f in failing)
        elif found:
            ET.SubElement(case, "system-out").text = "\n".join(f"[{f.severity}] {f.message}" for f in found)
    suite.set("failures", str(failures))
    return ET.tostring(suite, encoding="unicode", xml_declaration=True) + "\n"


def _escape(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def github_annotations(report: VerifyReport, limit: int = 50) -> str:
    """``::error``/``::warning`` workflow commands (GitHub caps how many it shows per step)."""
    lines = []
    for g in groups(report)[:limit]:
        level = {"error": "error", "warning": "warning", "info": "notice"}[g.severity]
        lines.append(f"::{level} title=ckpttool {g.rule}::{_escape(g.line)}")
    return "\n".join(lines) + ("\n" if lines else "")


def github_summary(report: VerifyReport, fail_on: Severity = "error") -> str:
    """A Markdown table for ``$GITHUB_STEP_SUMMARY``."""
    ok = not report.failing(fail_on)
    s = report.summary()
    out = [
        f"### ckpttool verify: {'passed' if ok else 'FAILED'}",
        "",
        f"`{report.path}` · "
        + (f"format `{report.format}`" if report.format else "format not read")
        + f" · step {report.step if report.step is not None else 'unknown'} · "
        f"{s['error']} errors, {s['warning']} warnings",
        "",
    ]
    if report.findings:
        out += ["| severity | rule | finding |", "|---|---|---|"]
        for g in groups(report)[:100]:
            text = g.line.replace("|", "\\|")
            out.append(f"| {g.severity} | `{g.rule}` | {text} |")
        out.append("")
    return "\n".join(out)
