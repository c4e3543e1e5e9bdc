"""Human renderings of library results (JSON renderings live with the results)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from rich.filesize import decimal
from rich.markup import escape

from ckpttool.cli._output import Output
from ckpttool.diff import DiffReport
from ckpttool.inspect import InspectReport
from ckpttool.manifest import Item
from ckpttool.naming import plural
from ckpttool.values import describe_value
from ckpttool.verify import Severity, VerifyReport


def _shape(item: Item) -> str:
    return "×".join(str(s) for s in item.shape) if item.shape else ("scalar" if item.shape == () else "-")


def inspect_report(out: Output, report: InspectReport) -> None:
    m = report.manifest
    layout = (
        ", ".join(
            f"{k}={v}"
            for k in ("world_size", "tp", "pp", "dp", "ep", "vpp", "zero_stage")
            if (v := getattr(m.layout, k)) is not None
        )
        or "unknown"
    )
    out.line(
        f"[bold]{escape(m.format)}[/bold] checkpoint  {escape(report.path)}"
        + (f"  (format version {escape(m.format_version)})" if m.format_version else ""),
        markup=True,
    )
    out.line(f"step: {m.step if m.step is not None else 'unknown'}   layout: {layout}")
    out.line(
        f"files: {len(m.files)} ({decimal(report.file_bytes)})   items: {len(m.items)} "
        f"({decimal(report.nbytes)} of values)"
    )
    if variant := m.extras.get("variant"):
        out.line(f"variant: {variant}")
    if isinstance(named := m.extras.get("optimizer_names"), str):  # (ids matched by guess: said, not taken as read)
        out.line(f"optimizer state names: {escape(named)}")
    if held := m.extras.get("state_files"):  # (a Hugging Face Trainer's files beside the model)
        by_file: dict[str, list[str]] = {}
        for state, rel in held.items():
            by_file.setdefault(str(rel), []).append(str(state))
        out.line("training state in: " + ", ".join(f"{r} ({', '.join(s)})" for r, s in by_file.items()))
    out.line("")
    out.table(
        ["KIND", "ITEMS", "BYTES"],
        [(k, t.items, decimal(t.nbytes)) for k, t in report.by_kind.items()],
        right=("ITEMS", "BYTES"),
    )
    out.line("")
    out.table(
        ["DTYPE", "ITEMS", "BYTES"],
        [(k, t.items, decimal(t.nbytes)) for k, t in report.by_dtype.items()],
        right=("ITEMS", "BYTES"),
    )
    out.line("")
    if report.missing_state:
        out.line(f"[yellow]missing training state:[/yellow] {escape(', '.join(report.missing_state))}", markup=True)
    else:
        out.line("training state: optimizer, rng, dataloader, scheduler and step all present")
    for item in report.unloadable:
        out.line(f"[red]unloadable:[/red] {escape(item.name)}: {escape(item.error or '')}", markup=True)


def item_table(out: Output, items: Sequence[Item]) -> None:
    rows = []
    for i in items:
        value = "" if i.is_tensor else (f"! {i.error}" if i.error else i.summary or describe_value(i.value))
        rows.append((i.name, i.kind, i.dtype or "object", _shape(i), len(i.pieces), decimal(i.nbytes), value))
    out.table(
        ["NAME", "KIND", "DTYPE", "SHAPE", "PIECES", "BYTES", "VALUE"], rows, right=("PIECES", "BYTES"), squeeze="VALUE"
    )


def verify_report(out: Output, report: VerifyReport, fail_on: Severity) -> None:
    from ckpttool.reports import groups

    s = report.summary()
    ok = not report.failing(fail_on)
    checked = ", ".join(
        plural(v, k.removesuffix("s")) if k.endswith("s") else f"{v:,} {k}" for k, v in report.checked.items()
    )
    fmt = report.format or "unreadable"
    step = "unknown" if report.step is None else report.step
    head = f"[bold]{escape(str(fmt))}[/bold] checkpoint  {escape(report.path)}  step {step}"
    out.line(head, markup=True)
    if report.root:
        out.line(f"files named from {report.root}")
    out.line(
        f"checked: {checked or 'nothing'}"
        + (f"   seal: {report.seal}" if report.seal else "   no seal (zip CRCs used where the format has them)")
    )
    if report.seal_nearby:
        folder = os.path.dirname(report.seal_nearby) or "."
        out.line(
            f"{report.seal_nearby} seals the folder {folder}: 'ckpttool verify {folder}' "
            "checks this checkpoint against it"
        )
    rows = [(g.severity.upper(), g.rule, g.line, list(g.hints)) for g in groups(report)]
    if rows:
        out.line("")
        out.findings(rows)
    out.line("")
    verdict = "[green]OK[/green]" if ok else "[red]FAILED[/red]"
    out.line(
        f"{verdict}: {plural(s['error'], 'error')}, {plural(s['warning'], 'warning')} (failing on {fail_on})",
        markup=True,
    )


def diff_report(out: Output, report: DiffReport) -> None:
    out.line(f"A: {report.a} ({report.formats[0]})   B: {report.b} ({report.formats[1]})")
    out.line(
        f"compared {report.compared} tensors: {report.identical} identical, {len(report.values)} with "
        f"different values; tolerance atol={report.atol:g} rtol={report.rtol:g}"
    )
    if report.removed:
        out.line(
            f"only in A ({len(report.removed)}): {', '.join(report.removed[:10])}"
            + (" …" if len(report.removed) > 10 else "")
        )
    if report.added:
        out.line(
            f"only in B ({len(report.added)}): {', '.join(report.added[:10])}"
            + (" …" if len(report.added) > 10 else "")
        )
    if report.opaque:
        out.line(
            f"RNG not compared ({len(report.opaque)} tensors): one side keeps its RNG state in opaque records "
            "(torch_dist's rng_state)"
        )
    for note in report.notes:
        out.line(f"same: {note}")
    for note in report.not_compared:
        out.line(f"[yellow]not compared[/yellow]: {escape(note)}", markup=True)
    for c in report.changed_meta:
        out.line(f"changed: {c['name']}: {c['a']['dtype']}{c['a']['shape']} -> {c['b']['dtype']}{c['b']['shape']}")
    for o in report.objects:
        out.line(f"value: {o['name']}: {o['a']!r} -> {o['b']!r}")
    for c in report.copies:
        out.line(
            f"copy: {c['name']}: {c['side']}'s copy in {c['file']} (rank {c['rank']}) differs from "
            f"{'B' if c['side'] == 'A' else 'A'}'s values"
            + (
                f" ({c['differing']:,} element(s), first at {c['first_index']}, max abs {c['max_abs_diff']:.4g})"
                if c.get("differing")
                else ""
            )
        )
    for u in report.unread:
        sides = "; ".join(f"{side.upper()}: {u[side]}" for side in ("a", "b") if u[side])
        out.line(f"[yellow]not read[/yellow]: {escape(u['name'])} ({escape(sides)})", markup=True)
    if report.values:
        out.line("")
        rows = [
            (
                v.name,
                f"{v.max_abs:.3g}",
                f"{v.rel_l2:.3g}",
                f"{v.differing:,}/{v.numel:,}",
                str(v.first_index),
                "yes" if v.within_tolerance else "no",
            )
            for v in report.values
        ]
        out.table(
            ["TENSOR", "MAX ABS", "REL L2", "DIFFERING", "FIRST AT", "WITHIN TOL"],
            rows,
            right=("MAX ABS", "REL L2", "DIFFERING"),
            squeeze="TENSOR",
        )
    out.line("")
    if report.different:
        first, largest = report.first, report.largest
        if first is not None and largest is not None:
            out.line(
                f"[red]different[/red]: first divergence {escape(first.name)}, largest {escape(largest.name)} "
                f"(rel L2 {largest.rel_l2:.3g})",
                markup=True,
            )
        else:
            out.line("[red]different[/red]", markup=True)
    elif report.unread:
        n = len(report.unread)
        values = f"{n} value{'s' if n != 1 else ''}"
        out.line(
            f"[yellow]not shown equal[/yellow]: {values} could not be read or compared on one side or both",
            markup=True,
        )
    else:
        out.line("[green]equal[/green]" + (" within tolerance" if report.values else ""), markup=True)
