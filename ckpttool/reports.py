"""Verify reports for CI systems: JUnit XML, GitHub Actions annotations and step summary, and the
grouping the human output uses ("12 ranks missing: 3, 5, 7 …", not twelve lines)."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from dataclasses import dataclass

from ckpttool.naming import plural, printable
from ckpttool.verify import RULES, SEVERITY_ORDER, Finding, Severity, VerifyReport

_GROUP_AT = 4


@dataclass(frozen=True, slots=True)
class Group:
    rule: str
    severity: Severity
    findings: tuple[Finding, ...]

    @property
    def line(self) -> str:
        """One line for the group: the finding itself, or a count with what the findings are about
        (their items, files or, for findings that name neither, what their messages say)."""
        if len(self.findings) == 1:
            return self.findings[0].message
        what = RULES[self.rule].summary
        shown = _listing(self.findings)
        if all(f.rank is not None for f in self.findings):
            ranks = sorted({f.rank for f in self.findings if f.rank is not None})
            listed = ", ".join(map(str, ranks[:12])) + (" …" if len(ranks) > 12 else "")
            return f"{len(self.findings)} findings ({what}), ranks {listed}: {shown}"
        return f"{len(self.findings)} findings ({what}): {shown}"

    @property
    def hints(self) -> list[str]:
        """The findings' hints, each once, in order."""
        return list(dict.fromkeys(f.hint for f in self.findings if f.hint))


_SHOWN = 6


def _listing(findings: tuple[Finding, ...]) -> str:
    """What a group of findings is about, in one line: the item or file of each (each once, the
    first few), else their messages, with the words all of them start and end with said once
    ("no optimizer state, RNG state in the checkpoint")."""
    named = [f.item or f.file for f in findings]
    if all(named):
        # (an item found in several files, such as each rank's copy of one tensor: with its file,
        # or the files would vanish from the line)
        seen = Counter(f.item for f in findings if f.item)
        names = list(
            dict.fromkeys(
                f"{f.item} in {f.file}" if f.item and f.file and seen[f.item] > 1 else n
                for f, n in zip(findings, named, strict=True)
            )
        )
        return ", ".join(map(str, names[:_SHOWN])) + _more(len(names))
    texts = list(dict.fromkeys(f.item or f.file or f.message for f in findings))
    more = _more(len(texts))
    if all(f.item is None and f.file is None for f in findings) and len(texts) > 1:
        words = [t.split(" ") for t in texts]
        head = 0
        while all(len(w) > head + 1 and w[head] == words[0][head] for w in words):
            head += 1
        tail = 0
        while all(len(w) > head + tail + 1 and w[-1 - tail] == words[0][-1 - tail] for w in words):
            tail += 1
        middles = [" ".join(w[head : len(w) - tail]) for w in words]
        if (head or tail) and not any("," in m or ";" in m for m in middles):
            start, end = " ".join(words[0][:head]), " ".join(words[0][len(words[0]) - tail :])
            listed = ", ".join(middles[:_SHOWN]) + more
            return " ".join(part for part in (start, listed, end) if part)
    return "; ".join(texts[:_SHOWN]) + more


def _more(listed: int) -> str:
    """What a listing of ``listed`` names showing the first ``_SHOWN`` leaves out."""
    return f" … ({listed - _SHOWN} more; --json lists every finding)" if listed > _SHOWN else ""


def groups(report: VerifyReport) -> list[Group]:
    """Findings grouped by rule and severity when a rule fires ``_GROUP_AT`` times or more at one
    severity (its errors grouped, and its one warning beside them); most severe first."""
    by_rule: dict[tuple[str, Severity], list[Finding]] = defaultdict(list)
    for f in report.findings:
        by_rule[(f.rule, f.severity)].append(f)
    out: list[Group] = []
    for (rule, severity), found in by_rule.items():
        if len(found) >= _GROUP_AT:
            out.append(Group(rule, severity, tuple(found)))
        else:
            out += [Group(rule, severity, (f,)) for f in found]
    out.sort(key=lambda g: -SEVERITY_ORDER[g.severity])
    return out


def junit(report: VerifyReport, fail_on: Severity = "error") -> str:
    """One testsuite, one testcase per rule (passing rules included), a failure per finding at or
    above ``fail_on``. A checkpoint that could not be evaluated is one testcase in error (JUnit's
    "could not run"), not every rule passing; one whose damage stopped the reading (nothing checked)
    has its other rules skipped."""
    if report.error is not None:
        suite = ET.Element("testsuite", name="ckpttool verify", tests="1", failures="0", errors="1")
        name = f"could not evaluate: {printable(report.path)}"
        case = ET.SubElement(suite, "testcase", classname="ckpttool.could-not-evaluate", name=name)
        el = ET.SubElement(case, "error", type="could-not-evaluate", message=printable(report.error))
        el.text = printable(report.error) + (f"\nhint: {printable(report.error_hint)}" if report.error_hint else "")
        return ET.tostring(suite, encoding="unicode", xml_declaration=True) + "\n"
    suite = ET.Element("testsuite", name="ckpttool verify", tests=str(len(RULES)))
    failures = skipped = 0
    # the checkpoint did not read past its damage (the failures say which): the other rules did not
    # run, and do not pass; those of its bytes against a seal did, where it has one
    unread = "items" not in report.checked
    by_seal = {"missing-file", "extra-file", "truncated-file", "checksum-mismatch"} if report.seal else set()
    by_rule: dict[str, list[Finding]] = defaultdict(list)
    for f in report.findings:
        by_rule[f.rule].append(f)
    for rule in RULES.values():
        name = f"{rule.id}: {printable(report.path)}"
        case = ET.SubElement(suite, "testcase", classname=f"ckpttool.{rule.id}", name=name)
        found = by_rule.get(rule.id, [])
        failing = [f for f in found if SEVERITY_ORDER[f.severity] >= SEVERITY_ORDER[fail_on]]
        if failing:
            failures += 1
            el = ET.SubElement(case, "failure", type=rule.id, message=printable(failing[0].message))
            el.text = "\n".join(f"[{f.severity}] {printable(f.message)}" for f in failing)
        elif found:
            ET.SubElement(case, "system-out").text = "\n".join(f"[{f.severity}] {printable(f.message)}" for f in found)
        elif unread and rule.id not in by_seal:
            skipped += 1
            ET.SubElement(case, "skipped", message="not run: the checkpoint could not be read past its damage")
    suite.set("failures", str(failures))
    if skipped:
        suite.set("skipped", str(skipped))
    return ET.tostring(suite, encoding="unicode", xml_declaration=True) + "\n"


_LONGEST = 1000
"""the most characters of one finding's line (a name can be a megabyte long) in an annotation or
a summary cell: GitHub drops a step summary over 1 MiB whole, and the report files keep every line"""


def _short(text: str) -> str:
    """``text`` on one line (:func:`printable`), cut to ``_LONGEST`` characters with an ellipsis."""
    text = printable(text)
    return text if len(text) <= _LONGEST else text[: _LONGEST - 1] + "…"


_MARKDOWN = str.maketrans({c: "\\" + c for c in "\\`*_[]<>|~&"})
"""(``&``: an entity, ``&#8238;``, rendered as the invisible character the cells spell out)"""


def _cell(text: str) -> str:
    """``text`` as one Markdown table cell: on one line and not too long (:func:`_short`), with the characters
    that would end the cell (``|``) or start markup (HTML, code, emphasis, links) escaped, so a
    hostile name cannot split the row or hide the rest of the summary."""
    return _short(text).translate(_MARKDOWN)


def _code(text: str) -> str:
    """``text`` as one Markdown code span, on one line: fenced by one backtick more than the
    longest run of backticks inside it, and padded with a space where it starts or ends with one
    (CommonMark's rule), so a path holding a backtick neither ends the span nor starts another."""
    text = printable(text)
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _escape(text: str) -> str:
    """``text`` as a workflow command's message, on one line as in the other reports: control and
    invisible characters spelled out (:func:`printable`: a hostile name must neither reach the
    log's terminal as an escape sequence nor break the line where GitHub's ``%0A`` would), then
    GitHub's own escape of ``%``; cut to ``_LONGEST`` characters (:func:`_short`)."""
    return _short(text).replace("%", "%25")


def github_annotations(report: VerifyReport, limit: int = 50) -> str:
    """``::error``/``::warning`` workflow commands (GitHub caps how many it shows per step)."""
    lines = []
    if report.error is not None:
        lines.append(f"::error title=ckpttool could not evaluate::{_escape(report.error)}")
    for g in groups(report)[:limit]:
        level = {"error": "error", "warning": "warning", "info": "notice"}[g.severity]
        lines.append(f"::{level} title=ckpttool {g.rule}::{_escape(g.line)}")
    return "\n".join(lines) + ("\n" if lines else "")


def github_summary(report: VerifyReport, fail_on: Severity = "error") -> str:
    """A Markdown table for ``$GITHUB_STEP_SUMMARY``."""
    ok = not report.failing(fail_on)
    s = report.summary()
    if report.error is not None:
        return "\n".join(
            [
                "### ckpttool verify: could not evaluate",
                "",
                f"{_code(report.path)}: {_cell(report.error)}",
                *(["", f"hint: {_cell(report.error_hint)}"] if report.error_hint else []),
                "",
            ]
        )
    out = [
        f"### ckpttool verify: {'passed' if ok else 'FAILED'}",
        "",
        f"{_code(report.path)} · "
        + (f"format `{report.format}`" if report.format else "format not read")
        + f" · step {report.step if report.step is not None else 'unknown'} · "
        f"{plural(s['error'], 'error')}, {plural(s['warning'], 'warning')}",
        "",
    ]
    if report.findings:
        out += ["| severity | rule | finding |", "|---|---|---|"]
        for g in groups(report)[:100]:
            out.append(f"| {g.severity} | `{g.rule}` | {_cell(g.line)} |")
        out.append("")
    return "\n".join(out)
