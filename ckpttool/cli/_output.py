"""The one output sink: data on stdout (human tables or JSON), everything else on stderr."""

from __future__ import annotations

import errno
import json
import math
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from rich.cells import cell_len
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from ckpttool.naming import RUNNER_HASH, printable, utf8


def strict(value: Any) -> Any:
    """``value`` with every infinite or NaN float spelled as the string ``"inf"``, ``"-inf"`` or
    ``"nan"`` (``float()`` reads them back): JSON has no such numbers, and ``Infinity`` breaks
    strict parsers (jq, JavaScript). Likewise each byte of a file name that is not UTF-8 is spelled
    ``\\xNN`` (:func:`~ckpttool.naming.utf8`), in keys as in values; a key whose spelling is another
    key's own name (``"a\\udcff"`` beside ``"a\\\\xff"``) has its lone surrogates spelled ``\\uNNNN``
    instead, and neither is lost."""
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, str):
        return utf8(value)
    if isinstance(value, dict):
        return {_key(k, value): strict(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strict(v) for v in value]
    return value


_RUNNER_HASH = re.compile(RUNNER_HASH)


def _key(key: Any, within: dict[Any, Any]) -> Any:
    if not isinstance(key, str):
        return key
    spelled = utf8(key)
    return utf8(key, bytes_as_x=False) if spelled != key and spelled in within else spelled


def dumps(payload: Any) -> str:
    """The JSON text of a command's payload: indented, strict (no ``Infinity``/``NaN``). A ``#``
    that starts what a CI runner reads as a command anywhere in a line of its log (``##[name]``,
    ``##vso[name]``: see :func:`ckpttool.naming.no_commands`) is written ``\\u0023``, which JSON
    reads back as ``#``; ``#`` occurs in JSON text only inside strings."""
    return _RUNNER_HASH.sub(r"\\u0023", json.dumps(strict(payload), indent=2, default=str, allow_nan=False))


def _reader_gone() -> None:
    """rich's answer to a closed pipe is a silent exit 1 (which reads as "findings" here, or hides
    an error's exit 3); the commands' error handler answers it as the shell does a SIGPIPE instead."""
    raise BrokenPipeError(errno.EPIPE, "the reader of the output went away")


def _for_a_reader(console: Console) -> bool:
    """Whether ``console`` writes to a terminal a person reads, where lines may wrap at its width:
    rich says so (as it does for a CI log when ``FORCE_COLOR`` or ``TTY_COMPATIBLE`` ask for colour)
    and the stream is one. In a log, a line wrapped at 80 columns would start with whatever word
    came next, a checkpoint's name among them."""
    try:
        return console.is_terminal and console.file.isatty()
    except (AttributeError, ValueError, OSError):
        return False


_FINDING_ROOM = 20
"""the fewest columns a wrapped FINDING may have; a narrower terminal gets each finding on one line"""


class Output:
    def __init__(self, *, json_mode: bool = False, quiet: bool = False) -> None:
        self.json_mode = json_mode
        self.quiet = quiet
        self.out = Console(highlight=False, soft_wrap=False, emoji=False)
        self.out.on_broken_pipe = _reader_gone  # type: ignore[method-assign]
        self.err = Console(stderr=True, highlight=False, emoji=False)
        self.err.on_broken_pipe = _reader_gone  # type: ignore[method-assign]

    # -- data (stdout) --------------------------------------------------------------------------

    def json(self, payload: Any) -> None:
        sys.stdout.write(dumps(payload) + "\n")
        sys.stdout.flush()

    def line(self, text: str, *, markup: bool = False) -> None:
        """A line of human data output, plain text unless ``markup`` (then rich markup, every name in
        it escaped by the caller; plain by default, so that a path holding ``[/]`` is shown as it is
        and never ends the command with a MarkupError): wrapped at a terminal's width, never
        elsewhere (a pipe, a file, a CI log). Like every human output here, it is one line with no
        control characters (:func:`ckpttool.naming.printable`): the names in it are the
        checkpoint's to choose, and a newline or an escape sequence in one must neither forge a
        line nor reach the terminal."""
        if not self.json_mode:
            self.out.print(printable(text), soft_wrap=not _for_a_reader(self.out), markup=markup)

    def table(
        self,
        columns: Sequence[str],
        rows: Sequence[Sequence[Any]],
        *,
        title: str | None = None,
        empty: str = "No items.",
        right: Sequence[str] = (),
        squeeze: str | None = None,
    ) -> None:
        """A table; cells never wrap. ``squeeze`` names the one column cut short (with an ellipsis)
        when the terminal is too narrow; off a terminal (a pipe, a file, a CI log) nothing is cut:
        the lines grow as long as the cells."""
        if self.json_mode:
            return
        if not rows:
            self.out.print(empty)
            return
        table = Table(title=title, title_justify="left", box=None, header_style="bold", pad_edge=False)
        cells = [[printable(str(c)) for c in row] for row in rows]
        widths = [max(len(col), *(len(r[i]) for r in cells)) for i, col in enumerate(columns)]
        if squeeze in columns and _for_a_reader(self.out):
            # cut the squeezable column to what the terminal leaves; the others are never cut
            k = columns.index(squeeze)
            room = self.out.width - sum(w for i, w in enumerate(widths) if i != k) - 2 * (len(columns) - 1)
            room = max(room, 24)
            if widths[k] > room:
                for r in cells:
                    if len(r[k]) > room:
                        r[k] = r[k][: room - 1] + "…"
                widths[k] = room
        for col in columns:
            table.add_column(col, justify="right" if col in right else "left", no_wrap=True)
        for row in cells:
            table.add_row(*(escape(c) for c in row))
        self._unwrapped(table, sum(widths) + 2 * (len(columns) - 1))

    def findings(self, rows: Sequence[tuple[str, str, str, Sequence[str]]]) -> None:
        """``verify``'s findings: (severity, rule, finding, hints) rows under SEVERITY, RULE and
        FINDING, each hint on a line of its own below its finding. A finding is never cut: on a
        terminal the FINDING column wraps at the terminal's width (if that leaves it
        ``_FINDING_ROOM`` columns); elsewhere (a pipe, a file, a CI log) each finding and each hint
        stays on one line however long, for grep and for log viewers that wrap by themselves."""
        if self.json_mode or not rows:
            return
        widths = [len("SEVERITY"), len("RULE"), len("FINDING")]
        cells = []
        for severity, rule, text, hints in rows:
            text, hints = printable(text), [printable(h) for h in hints]
            cell = Text(text)
            for hint in hints:
                cell.append("\n")
                cell.append(f"hint: {hint}", style="dim")
            cells.append((severity, rule, cell))
            lines = [text, *(f"hint: {h}" for h in hints)]
            for i, w in enumerate((cell_len(severity), cell_len(rule), max(map(cell_len, lines)))):
                widths[i] = max(widths[i], w)
        wrap = _for_a_reader(self.out) and self.out.width >= widths[0] + widths[1] + 4 + _FINDING_ROOM
        table = Table(box=None, header_style="bold", pad_edge=False)
        table.add_column("SEVERITY", no_wrap=True)
        table.add_column("RULE", no_wrap=True)
        table.add_column("FINDING", no_wrap=not wrap, overflow="fold")
        for row in cells:
            table.add_row(*row)
        if wrap:
            self.out.print(table)
            return
        self._unwrapped(table, sum(widths) + 2 * (len(widths) - 1))

    def _unwrapped(self, table: Table, width: int) -> None:
        """Print ``table`` at ``width`` columns or the console's, the wider, without the blanks
        that pad each line to the full width."""
        saved = self.out.width
        self.out.width = max(saved, width)
        try:
            with self.out.capture() as captured:
                self.out.print(table, crop=False)
        finally:
            self.out.width = saved
        text = "\n".join(ln.rstrip(" ") for ln in captured.get().split("\n"))
        self.out.file.write(text)
        self.out.file.flush()

    # -- diagnostics (stderr) -------------------------------------------------------------------

    def note(self, text: str) -> None:
        """Plain text on stderr (a rank label ``[tp=1,pp=0]`` or an item ``x[rank=0]`` in it is
        text, not markup: rich dropped them)."""
        if not self.quiet:
            self.err.print(escape(printable(text)), soft_wrap=not _for_a_reader(self.err))

    def warning(self, text: str) -> None:
        self.err.print(f"[yellow]warning:[/yellow] {escape(printable(text))}", soft_wrap=not _for_a_reader(self.err))

    def error(self, text: str, hint: str | None = None) -> None:
        self.err.print(f"[red]error:[/red] {escape(printable(text))}", soft_wrap=True)
        if hint:
            self.err.print(f"[dim]hint:[/dim] {escape(printable(hint))}", soft_wrap=True)

    @contextmanager
    def progress(self, description: str) -> Iterator[Callable[[int, int], None]]:
        """A byte progress bar on stderr, only on a terminal and outside quiet mode; yields an
        ``update(done, total)`` callable."""
        show = self.err.is_terminal and not self.quiet and not os.environ.get("CI")
        if not show:
            yield lambda done, total: None
            return
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=self.err,
            transient=True,
        ) as bar:
            task = bar.add_task(description, total=None)
            yield lambda done, total: bar.update(task, completed=done, total=total)
