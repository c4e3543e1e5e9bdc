"""The ``ckpttool`` command line: parse options, call the library, render, pick the exit code.

Exit codes: 0 ran and found nothing wrong; 1 ran and found problems; 2 usage error; 3 could not
evaluate (missing path, unknown format, unsafe pickle, damaged file, internal error); 130 on
Ctrl-C. Library modules (and torch) are imported inside the commands so ``--help`` stays fast.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.markup import escape

from ckpttool.cli._output import Output, dumps
from ckpttool.errors import CkptError
from ckpttool.ranks import torchrun_world

if TYPE_CHECKING:
    from ckpttool.manifest import Item
    from ckpttool.verify import Severity, VerifyReport

app = typer.Typer(
    name="ckpttool",
    help="Inspect, verify, diff, compress and reshard distributed training checkpoints "
    "(PyTorch DCP, safetensors, torch.save, ...).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)

F = TypeVar("F", bound=Callable[..., Any])
ForceDirOpt = Annotated[
    bool,
    typer.Option(
        "--force",
        help="Replace OUTPUT if it exists: an earlier output (a directory holding a checkpoint and nothing else) "
        "or an empty directory, never other data.",
    ),
]

JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress or notes on stderr.")]
ContainerForceOpt = Annotated[
    bool,
    typer.Option(
        "--force", help="Replace OUTPUT if it exists: an earlier container or an empty file, never other data."
    ),
]
SplitRuleOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--split-rule",
        help="REGEX=DIM (or REGEX=none): how TP splits parameters matching REGEX, in a legacy Megatron source and a "
        "Megatron output (a legacy output keeps it).",
    ),
]


def _a_path(value: str) -> Path:
    """A path argument as typed: an empty one is refused (``Path("")`` would be the working
    directory, which the command would then walk)."""
    if not value.strip():
        raise typer.BadParameter("an empty path names nothing")
    return Path(value)


def _a_count(value: str) -> int:
    """A whole number as DeepSpeed configs write it too: ``1e9``, ``1_000_000_000``, ``1000000000``.
    Only parsed here (finite, whole, within 64 bits): the command checks its range (a
    ``sub_group_size`` of 0 gives DeepSpeed one parameter per sub-group)."""
    from decimal import Decimal, InvalidOperation

    try:
        number = Decimal(value.strip().replace("_", ""))  # (exact: 1e9, and 10**30 as typed)
    except InvalidOperation:
        raise typer.BadParameter(f"{value!r} is not a number") from None
    if not number.is_finite() or number != number.to_integral_value() or abs(number) > 2**63:
        raise typer.BadParameter(f"{value!r}: expected a whole number, such as 1e9")
    return int(number)


PathArg = Annotated[Path, typer.Argument(help="Checkpoint directory or file.", show_default=False, parser=_a_path)]


def _and_others(exc: CkptError) -> str:
    """The other files the same look found damaged, named after the first: "likewise" where each
    is what the first is (missing, cut short), else each with its rule."""
    if not exc.others:
        return ""
    alike = all(o.rule == exc.rule for o in exc.others)
    names = [(o.path or o.message) + ("" if alike else f" ({o.rule or 'unreadable'})") for o in exc.others]
    shown = ", ".join(names[:5]) + (" …" if len(names) > 5 else "")
    s = "s" if len(names) > 1 else ""
    return f" (and {len(names)} more {'file' + s + ' likewise' if alike else 'damaged file' + s}: {shown})"


def _handles_errors(fn: F, *, json_errors: bool = True) -> F:
    """Turn library errors into one message on stderr and the contract's exit code; under --json,
    also a JSON document on stdout (``json_errors``; verify writes its own, a report that says why
    it could not judge)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # a command holds one manifest (10^5..10^6 small records) for its whole run: collect
        # cycles far less often than the default, which would rescan it every few thousand
        # allocations (the library itself leaves the collector alone)
        gc.set_threshold(100_000, 50, 100)
        out = Output()
        # with --json, an error is also a JSON document on stdout (a script reading it found nothing
        # there); rank 0 alone reports for all under torchrun
        doc = json_errors and bool(kwargs.get("json_out")) and ((w := torchrun_world()) is None or w[0] == 0)
        try:
            return fn(*args, **kwargs)
        except CkptError as exc:
            if os.environ.get("CKPTTOOL_DEBUG"):
                traceback.print_exc()
            _say_error(out, exc.message + _and_others(exc), exc.hint, doc and exc.exit_code)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt as exc:
            # typer turns Ctrl-C into exit 130 by itself, silently; say what happened (outputs in
            # flight were removed on the way out); SIGTERM likewise, as the shell's 128 + 15
            code, word = _stopped(exc)
            sys.stderr.write(word + "\n")
            raise typer.Exit(code) from None
        except (typer.Exit, typer.Abort, typer.BadParameter):
            raise
        except OSError as exc:
            gone = [s for s in (sys.stdout, sys.stderr) if _pipe_gone(s)] if isinstance(exc, BrokenPipeError) else []
            if gone:
                # the reader of our output went away (``ckpttool ls … | head``, or of the messages on
                # stderr): nothing to say, the shell's status of a command stopped by SIGPIPE; the
                # stream pointed at /dev/null so that the interpreter's last flush does not fail again
                for stream in gone:
                    os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
                raise typer.Exit(141) from None
            # the file system refused (permissions, a full or read-only disk, a path that changed
            # under us): the environment's answer, not a bug; say which path and why
            if os.environ.get("CKPTTOOL_DEBUG"):
                traceback.print_exc()
            from ckpttool.io import OS_ERROR_HINT, os_error_line

            _say_error(out, os_error_line(exc, kwargs.get("output")), OS_ERROR_HINT, doc and 3)
            raise typer.Exit(3) from None
        except MemoryError as exc:
            if os.environ.get("CKPTTOOL_DEBUG"):
                traceback.print_exc()
            _say_error(out, *_out_of_memory(exc), doc and 3)
            raise typer.Exit(3) from None
        except Exception as exc:
            if os.environ.get("CKPTTOOL_DEBUG"):
                traceback.print_exc()
            _say_error(
                out,
                f"internal error: {type(exc).__name__}: {exc}",
                "this is a bug in ckpttool; rerun with CKPTTOOL_DEBUG=1 for the traceback and report it",
                doc and 3,
            )
            raise typer.Exit(3) from None

    return wrapper  # type: ignore[return-value]


def _out_of_memory(exc: MemoryError) -> tuple[str, str]:
    """Message and hint for memory the machine would not give: the environment's answer (or a
    tensor larger than any memory), not a bug in ckpttool."""
    return (
        f"not enough memory: {exc or 'an allocation failed'}",
        "the machine could not give what this needed; free memory, run it on a larger machine, or give "
        "--max-memory where the command takes it",
    )


def _stopped(exc: KeyboardInterrupt) -> tuple[int, str]:
    """Exit code and word for a command stopped by Ctrl-C or by SIGTERM."""
    from ckpttool.interrupt import Terminated

    return (143, "terminated") if isinstance(exc, Terminated) else (130, "interrupted")


def _say_error(out: Output, message: str, hint: str | None, json_code: int | bool = False) -> None:
    """The error on stderr; where stderr's reader has gone, nothing (the exit code still says it).
    ``json_code``: the exit code, under --json, where the error is also a document on stdout
    (``{"schema_version": 1, "error": {"message", "hint", "exit_code"}}``)."""
    if json_code:
        import json

        doc = {"schema_version": 1, "error": {"message": message, "hint": hint, "exit_code": int(json_code)}}
        try:
            sys.stdout.write(json.dumps(doc, indent=2) + "\n")
            sys.stdout.flush()
        except (BrokenPipeError, ValueError):
            pass
    try:
        out.error(message, hint)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stderr.fileno())


def _pipe_gone(stream: Any) -> bool:
    """Whether ``stream`` is a pipe whose reader has closed it (poll reports an error on it)."""
    import select

    try:
        poll = select.poll()
        poll.register(stream.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poll.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def _version(value: bool) -> None:
    if value:
        from ckpttool import __version__

        typer.echo(f"ckpttool {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version and exit.")
    ] = False,
) -> None:
    """ckpttool: answers about distributed training checkpoints."""


@app.command(epilog="Examples:  ckpttool inspect ckpt/step_1000  ·  ckpttool inspect ckpt/step_1000 --json")
@_handles_errors
def inspect(path: PathArg, json_out: JsonOpt = False) -> None:
    """Format, step, layout, items by kind and dtype, and the training state that is missing.

    Reads metadata only: no tensor data, no torch. Exits 1 when some item cannot be loaded safely
    (e.g. a pickle that would run code) or the format's reader found an error beside the items (a
    hostile file of training state; each finding shown as a warning), 3 when the checkpoint, or a
    file an item or its training state is read from, cannot be read (damaged, cut short, no
    permission, a rank's file missing).
    """
    from ckpttool.cli import _render
    from ckpttool.inspect import inspect as run

    out = Output(json_mode=json_out)
    report = run(path)
    if json_out:
        out.json(report.to_json())
    else:
        _render.inspect_report(out, report)
    for f in report.findings if not json_out else ():  # (the JSON holds them in extras.findings)
        out.warning(f"{f['rule']}: {f['message']}")
    if report.unloadable:
        out.warning(
            f"{len(report.unloadable)} item(s) cannot be loaded safely: "
            + "; ".join(f"{i.name}: {i.error}" for i in report.unloadable[:5])
        )
    if report.unloadable or any(f["severity"] == "error" for f in report.findings):
        raise typer.Exit(1)


@app.command(
    epilog="Examples:  ckpttool ls ckpt/  ·  ckpttool ls ckpt/ --filter 'exp_avg$'  ·  "
    "ckpttool ls model.safetensors --json"
)
@_handles_errors
def ls(
    path: PathArg,
    filter_: Annotated[
        str | None, typer.Option("--filter", "-f", help="Only items whose name matches this regular expression.")
    ] = None,
    json_out: JsonOpt = False,
) -> None:
    """One row per item: name, kind, dtype, global shape, pieces, bytes."""
    from ckpttool.cli import _render
    from ckpttool.inspect import item_row
    from ckpttool.inspect import ls as run

    out = Output(json_mode=json_out)
    manifest, items = run(path, _regex(filter_))
    if json_out:
        out.json(
            {
                "schema_version": manifest.schema_version,
                "format": manifest.format,
                "items": [item_row(i) for i in items],
            }
        )
    else:
        _render.item_table(out, items)


def _not_written(skipped: Sequence[tuple[Item, str]]) -> str:
    """The note on the items a safetensors output left out: how many for each reason, three named
    (``--json`` lists every one)."""
    by: dict[str, list[str]] = {}
    for item, why in skipped:
        by.setdefault(why, []).append(item.name)
    said = [
        f"{len(names):,} ({why}): {', '.join(names[:3])}" + (f" and {len(names) - 3:,} more" if len(names) > 3 else "")
        for why, names in by.items()
    ]
    return f"not written: {'; '.join(said)}"


def _skipped_json(skipped: Sequence[tuple[Item, str]]) -> list[dict[str, str]]:
    return [{"name": i.name, "reason": why} for i, why in skipped]


@app.command(
    epilog="Examples:  ckpttool export ckpt/ -o full.safetensors  ·  "
    "ckpttool export ckpt/ -o model.safetensors --kind param  ·  "
    "ckpttool export ckpt/ -o moments.safetensors --filter 'exp_avg'"
)
@_handles_errors
def export(
    path: PathArg,
    output: Annotated[
        Path, typer.Option("--output", "-o", help="The .safetensors file to write.", show_default=False, parser=_a_path)
    ],
    filter_: Annotated[
        str | None, typer.Option("--filter", "-f", help="Only items whose name matches this regular expression.")
    ] = None,
    kind: Annotated[str, typer.Option("--kind", "-k", help="param, optim, master, rng, ... or all.")] = "all",
    split_rule: SplitRuleOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Replace OUTPUT if it exists.")] = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Write the full, unsharded logical tensors to one safetensors file.

    Tensors are assembled piece by piece (memory bounded by the largest tensor) and the file is
    published atomically. Non-tensor items are listed on stderr, not written.
    """
    from ckpttool.export import export as run
    from ckpttool.reshard import parse_split_rules

    out = Output(json_mode=json_out, quiet=quiet)
    rules = parse_split_rules(split_rule or [])
    with out.progress("export") as update:
        result = run(path, output, kind=kind, pattern=_regex(filter_), force=force, progress=update, split_rules=rules)
    if result.skipped and not quiet:
        out.note(_not_written(result.skipped))
    if json_out:
        out.json(
            {
                "output": result.output,
                "tensors": len(result.written),
                "nbytes": result.nbytes,
                "written": [i.name for i in result.written],
                "skipped": _skipped_json(result.skipped),
            }
        )
    else:
        from rich.filesize import decimal

        out.line(f"wrote {len(result.written)} tensors ({decimal(result.nbytes)}) to {result.output}")


@app.command(
    epilog="Examples:  ckpttool seal ckpt/step_1000  ·  ckpttool seal ckpt/ --hash sha256  ·  "
    "ckpttool seal ckpt/ --out /archive/step_1000.seal.json"
)
@_handles_errors
def seal(
    path: PathArg,
    out_file: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="Write the seal here instead of beside the checkpoint (replacing an earlier seal, never other data).",
            parser=_a_path,
        ),
    ] = None,
    hash_: Annotated[str, typer.Option("--hash", help="xxh3-128 (fast) or sha256 (to match external digests).")] = (
        "xxh3-128"
    ),
    workers: Annotated[
        int | None, typer.Option("--workers", min=1, help="Hashing threads (a large file may take several).")
    ] = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Hash every file and every piece and write ckpttool.manifest.json beside the checkpoint.

    One read of every byte, files in parallel; the seal is written atomically. 'ckpttool verify'
    then checks the checkpoint against it and names the tensor behind any changed byte.
    """
    from ckpttool.seal import seal as run

    out = Output(json_mode=json_out, quiet=quiet)
    with out.progress("seal") as update:
        done = [0]

        def advance(n: int) -> None:
            done[0] += n
            update(done[0], 0)

        result, target = run(path, out=out_file, algo=hash_, workers=workers, progress=advance)  # type: ignore[arg-type]
    # (another seal lying in the checkpoint is listed with role "seal" and not hashed: not counted)
    sealed = [f for f in result.manifest.files if f.role != "seal"]
    if json_out:
        out.json(
            {
                "seal": str(target),
                "hash": result.algo,
                "files": len(sealed),
                "pieces": len(result.pieces),
                "bytes": sum(f.size for f in sealed),
            }
        )
    else:
        from rich.filesize import decimal

        from ckpttool.naming import plural

        size = decimal(sum(f.size for f in sealed))
        out.line(
            f"sealed {plural(len(sealed), 'file')} ({size}) and {plural(len(result.pieces), 'piece')} "
            f"with {result.algo}: {target}"
        )


@app.command(
    epilog="Examples:  ckpttool verify ckpt/step_1000  ·  ckpttool verify ckpt/ --deep --json  ·  "
    "ckpttool verify ckpt/ --require rng,dataloader --junit report.xml"
)
@functools.partial(_handles_errors, json_errors=False)  # (its own JSON: a report saying why it could not judge)
def verify(
    path: PathArg,
    manifest: Annotated[
        Path | None,
        typer.Option("--manifest", help="The seal to check against (default: beside the checkpoint).", parser=_a_path),
    ] = None,
    deep: Annotated[
        bool,
        typer.Option(
            "--deep",
            help="Read every value: NaN/Inf census and statistics, fp32 masters against their parameters, "
            "moments all zero.",
        ),
    ] = False,
    require: Annotated[
        list[str] | None,
        typer.Option(
            "--require",
            help="Training state that must be present (error, not warning): optimizer,rng,dataloader,scheduler,step "
            "(a list, or the option repeated).",
        ),
    ] = None,
    fail_on: Annotated[str, typer.Option("--fail-on", help="Lowest severity that fails: error or warning.")] = "error",
    report_file: Annotated[
        Path | None, typer.Option("--report", help="Also write the JSON report here.", parser=_a_path)
    ] = None,
    junit_file: Annotated[
        Path | None, typer.Option("--junit", help="Also write a JUnit XML report here.", parser=_a_path)
    ] = None,
    workers: Annotated[
        int | None, typer.Option("--workers", min=1, help="Reading threads (a large file may take several).")
    ] = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Completeness, checksums, step consistency, coverage, replicas, optimizer state, missing
    training state (and NaN/Inf with --deep).

    Exit 0: nothing at or above --fail-on; 1: findings; 3: could not evaluate. On GitHub Actions
    findings also become annotations and a step summary.
    """
    from ckpttool import interrupt

    # a Ctrl-C or SIGTERM during the imports and the checks below (a second or so) is raised once
    # they are done, in the try further down, where the reports say the checkpoint was not judged:
    # it stopped the command with the last run's passing report left in place
    holding = contextlib.ExitStack()
    holding.enter_context(interrupt.held())
    try:
        checked, out, needed, severity = _verify_checks(
            path, manifest, report_file, junit_file, fail_on, require, json_out, quiet
        )
    except BaseException as exc:
        holding.close()
        if json_out and isinstance(exc, CkptError):  # (its report on stdout says why, as for any error)
            refused = _unjudged(path, manifest, deep, exc.message, exc.hint)
            Output(json_mode=True).json(refused.to_json(_failing_severity(fail_on)))
        raise
    from ckpttool.errors import UsageError
    from ckpttool.verify import verify as run

    with out.progress("verify") as update:
        done = [0]

        def advance(n: int) -> None:
            done[0] += n
            update(done[0], 0)

        try:
            holding.close()  # (a signal held since the function began: raised here)
            if fail_on not in ("error", "warning"):
                raise UsageError(f"--fail-on {fail_on!r}: expected error or warning")
            report = run(path, manifest_path=manifest, deep=deep, require=needed, workers=workers, progress=advance)
        except KeyboardInterrupt as exc:
            # Ctrl-C or SIGTERM (a CI job cancelled, a scheduler's time limit): the reports say so,
            # not the last run's verdict (a passing one was left in place, and uploaded `if:
            # always()`); written whole before the command stops (a second signal waits for it)
            from ckpttool import interrupt

            said = f"verify was {_stopped(exc)[1]} before it finished: the checkpoint was not judged"
            stopped = _unjudged(path, manifest, deep, said, "run verify again to the end")
            with interrupt.held():
                _verify_outputs(out, stopped, severity, report_file, junit_file, checked)
            raise
        except Exception as exc:
            if isinstance(exc, typer.Exit | typer.Abort):
                raise
            # could not evaluate (a usage error, exit 2, or exit 3, whatever stopped it): the
            # reports a CI gate reads still say so (a JUnit error, "ok": false with the reason),
            # never absent or left from the last run; the message and the exit code come from
            # _handles_errors as for any command
            if isinstance(exc, CkptError):
                message, hint = exc.message, exc.hint
            elif isinstance(exc, OSError):
                from ckpttool.io import os_error_line

                message, hint = os_error_line(exc), None
            elif isinstance(exc, MemoryError):
                message, hint = _out_of_memory(exc)
            else:
                message, hint = f"internal error: {type(exc).__name__}: {exc}", "this is a bug in ckpttool"
            failed = _unjudged(path, manifest, deep, message, hint)
            _verify_outputs(out, failed, severity, report_file, junit_file, checked)
            raise
    _verify_outputs(out, report, severity, report_file, junit_file, checked)
    if report.failing(severity):
        raise typer.Exit(1)


def _verify_checks(
    path: Path,
    manifest: Path | None,
    report_file: Path | None,
    junit_file: Path | None,
    fail_on: str,
    require: list[str] | None,
    json_out: bool,
    quiet: bool,
) -> tuple[set[Path], Output, list[str], Severity]:
    """verify's checks of its report paths, before any work: the reports that may be replaced (those
    there before it ran: one made while it ran is kept), its output, the state required, and the
    severity that fails."""
    from ckpttool.errors import UsageError
    from ckpttool.io import check_output_file, refuse_overlap, refuse_replacing_other_file
    from ckpttool.seal import default_seal_path

    # (without --manifest, the seal is the one beside the checkpoint: a report written there would
    # replace it, or be taken for it by the next verify)
    seal = manifest if manifest is not None else default_seal_path(path)
    for flag, given in (("--report", report_file), ("--junit", junit_file)):
        if given is not None:  # a report never replaces what it reports on
            refuse_overlap(given, flag=flag, checkpoint=path, seal=seal)
            check_output_file(given, flag)
            refuse_replacing_other_file(given, f"{flag} {given}", *_REPORT_HEADS[flag])
    checked = {p for p in (report_file, junit_file) if p is not None and os.path.lexists(p)}
    if report_file is not None and junit_file is not None and report_file.resolve() == junit_file.resolve():
        raise UsageError(
            f"--report and --junit both name {junit_file}: the JUnit XML would replace the JSON report",
            hint="give each report a file of its own",
        )
    needed = [s.strip() for given in require or () for s in given.split(",") if s.strip()]
    return checked, Output(json_mode=json_out, quiet=quiet), needed, _failing_severity(fail_on)


def _failing_severity(fail_on: str) -> Severity:
    return "warning" if fail_on == "warning" else "error"


def _unjudged(path: Path, manifest: Path | None, deep: bool, message: str, hint: str | None) -> VerifyReport:
    """verify's report of a checkpoint it could not judge (a refused option, a signal, an error),
    saying why."""
    from ckpttool.verify import VerifyReport

    seal = str(manifest) if manifest else None
    return VerifyReport(path=str(path), seal=seal, deep=deep, error=message, error_hint=hint)


_REPORT_HEADS = {
    "--report": (
        "a ckpttool verify JSON report",
        re.compile(rb'^\s*\{\s*"schema_version"\s*:\s*\d+\s*,\s*"inputs"').match,
    ),
    "--junit": ("a JUnit XML report", re.compile(rb"^\s*(<\?xml[^>]*>\s*)?<testsuites?[\s>]").match),
}
"""what an earlier report of each option is, and the test of its first bytes: ``--report`` and
``--junit`` replace one (or an empty file), never other data, as ``seal --out`` replaces a seal
(:func:`~ckpttool.io.refuse_replacing_other_file`)"""


def _verify_outputs(
    out: Output,
    report: VerifyReport,
    severity: Severity,
    report_file: Path | None,
    junit_file: Path | None,
    replaceable: set[Path] | frozenset[Path],
) -> None:
    """verify's report on stdout (human or ``--json``), in ``--report`` and ``--junit``, and on
    GitHub Actions as annotations and a step summary."""
    from ckpttool import reports
    from ckpttool.cli import _render
    from ckpttool.io import atomic_output

    payload = report.to_json(severity)
    if out.json_mode:
        out.json(payload)
    elif report.error is None:  # (the error itself is _handles_errors' line)
        _render.verify_report(out, report, severity)
    if report_file is not None:
        with atomic_output(report_file, replace=report_file in replaceable) as fh:
            fh.write((dumps(payload) + "\n").encode())
    if junit_file is not None:
        with atomic_output(junit_file, replace=junit_file in replaceable) as fh:
            fh.write(reports.junit(report, severity).encode())
    if os.environ.get("GITHUB_ACTIONS") == "true":
        sys.stderr.write(reports.github_annotations(report))
        summary = os.environ.get("GITHUB_STEP_SUMMARY")
        inside = summary and _inside_the_checkpoint(summary, report)
        if inside:  # (appended to, it would be a file of the checkpoint modified)
            out.warning(f"the step summary was not written: GITHUB_STEP_SUMMARY {inside}; the report above stands")
        elif summary:
            try:
                with open(summary, "a", encoding="utf-8") as summary_fh:
                    summary_fh.write(reports.github_summary(report, severity) + "\n")
            except OSError as exc:  # the runner's file, not an output asked for: the verdict stands
                from ckpttool.io import os_error_line

                out.warning(f"the step summary was not written ({os_error_line(exc)}); the report above stands")


def _inside_the_checkpoint(summary: str, report: VerifyReport) -> str | None:
    """Why the step summary file may not be appended to (inside the checkpoint or its seal)."""
    from ckpttool.io import refuse_overlap
    from ckpttool.seal import default_seal_path

    try:
        refuse_overlap(summary, flag="is", checkpoint=report.path, seal=report.seal or default_seal_path(report.path))
    except CkptError as exc:
        return exc.message.removeprefix(f"is {summary} ")
    try:
        st = os.stat(summary)
    except OSError:
        return None
    if st.st_nlink < 2:
        return None
    if not os.path.isdir(report.path):  # (a checkpoint of one file: that file)
        with contextlib.suppress(OSError):
            if os.path.samestat(st, os.stat(report.path)):
                return f"is a hard link to {report.path}, the checkpoint"
        return None
    for dirpath, _, names in os.walk(report.path):  # (a hard link to a checkpoint file: the same file)
        for name in names:
            with contextlib.suppress(OSError):
                other = os.stat(os.path.join(dirpath, name), follow_symlinks=False)
                if (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
                    return f"is a hard link to {os.path.join(dirpath, name)}, a file of the checkpoint"
    return None


@app.command(
    epilog="Examples:  ckpttool diff ckpt/step_1000 ckpt/step_1100  ·  "
    "ckpttool diff megatron_tp2/ resharded_tp1/ --tolerance standard  ·  ckpttool diff a/ b/ --json"
)
@_handles_errors
def diff(
    a: Annotated[Path, typer.Argument(help="The first checkpoint.", show_default=False, parser=_a_path)],
    b: Annotated[Path, typer.Argument(help="The second checkpoint.", show_default=False, parser=_a_path)],
    atol: Annotated[float | None, typer.Option("--atol", help="Absolute tolerance.")] = None,
    rtol: Annotated[float | None, typer.Option("--rtol", help="Relative tolerance.")] = None,
    tolerance: Annotated[
        str,
        typer.Option(
            "--tolerance", help="strict (bit for bit), standard (1e-8 + 1e-5·|b|) or relaxed (1e-5 + 1e-3·|b|)."
        ),
    ] = "strict",
    filter_: Annotated[
        str | None, typer.Option("--filter", "-f", help="Only items whose canonical name matches this regex.")
    ] = None,
    map_file: Annotated[
        Path | None,
        typer.Option("--map", help="Renames of A's names to B's: JSON {old: new} or old=new lines.", parser=_a_path),
    ] = None,
    kinds: Annotated[
        list[str] | None,
        typer.Option("--kind", "-k", help="Only items of these kinds (repeat): param, master, optim, rng, ..."),
    ] = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Compare the logical tensors of two checkpoints, whatever their formats and layouts.

    Reports added, removed, shape/dtype changes and value changes (max abs difference, relative L2,
    elements that differ, first differing index), naming the first diverging tensor in A's order
    and the largest divergence (a value that became NaN on one side differs by inf; JSON spells
    such numbers "inf" and "nan"). RNG state that one side keeps in opaque records (Megatron
    torch_dist) is listed as not compared. An item that is a tensor on one side and a number on the
    other (Adam's step in older torch) is the same when the tensor's one element equals the number.
    --filter also chooses among the state files kept beside a model (a Trainer's optimizer.pt) by
    their names. Exit 0 equal within tolerance, 1 different, 3 could not evaluate (a value one side
    could not give, such as a refused pickle, and nothing else different).
    """
    from ckpttool.cli import _render
    from ckpttool.diff import diff as run
    from ckpttool.diff import load_map

    out = Output(json_mode=json_out, quiet=quiet)
    report = run(
        a,
        b,
        atol=atol,
        rtol=rtol,
        tolerance=tolerance,  # type: ignore[arg-type]  # checked by diff()
        pattern=_regex(filter_),
        renames=load_map(map_file),
        kinds=kinds,
    )
    if json_out:
        out.json(report.to_json())
    else:
        _render.diff_report(out, report)
    if report.different:
        raise typer.Exit(1)
    if report.unread:  # nothing differs, but what could not be read was not compared
        raise typer.Exit(3)


@app.command(
    epilog="Examples:  ckpttool convert ckpt/step_1000 -o hf/ --to safetensors  ·  "
    "ckpttool convert ckpt/ -o hf/ --kind param --max-shard-size 2GB"
)
@_handles_errors
def convert(
    src: PathArg,
    output: Annotated[
        Path, typer.Option("--output", "-o", help="The directory to write.", show_default=False, parser=_a_path)
    ],
    to: Annotated[
        str,
        typer.Option(
            "--to",
            help="Target format: safetensors, dcp, torch, megatron, megatron-dist, deepspeed or deepspeed-universal.",
        ),
    ] = "safetensors",
    max_shard_size: Annotated[
        str | None,
        typer.Option("--max-shard-size", help="Largest shard (safetensors), e.g. 5GB, 500MB, 2GiB.  [default: 5GB]"),
    ] = None,
    world_size: Annotated[
        int | None, typer.Option("--world-size", help="Ranks of the DCP checkpoint (default: the source's).")
    ] = None,
    kind: Annotated[str, typer.Option("--kind", "-k", help="param, optim, master, ... or all.")] = "all",
    filter_: Annotated[
        str | None, typer.Option("--filter", "-f", help="Only items whose name matches this regular expression.")
    ] = None,
    split_rule: SplitRuleOpt = None,
    force: ForceDirOpt = False,
    no_seal: Annotated[bool, typer.Option("--no-seal", help="Do not write ckpttool.manifest.json.")] = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """The same state in another format: sharded safetensors with an index (the Hugging Face
    layout), a PyTorch DCP checkpoint at --world-size ranks, one torch.save file (model.pt, nested
    as the DCP source was saved: what dcp_to_torch_save writes), or a framework's own layout
    (megatron, megatron-dist, deepspeed, deepspeed-universal) at the source's parallel sizes, optimizer and training
    state kept ('ckpttool reshard' changes the sizes). Streams one tensor at a time; the output
    directory appears complete or not at all, sealed (ckpttool.manifest.json) unless --no-seal."""
    from rich.filesize import decimal

    from ckpttool.convert import convert as run
    from ckpttool.reshard import parse_split_rules

    out = Output(json_mode=json_out, quiet=quiet)
    result = run(
        src,
        output,
        to=to,
        max_shard_size=max_shard_size,
        world_size=world_size,
        kind=kind,
        pattern=_regex(filter_),
        force=force,
        split_rules=parse_split_rules(split_rule or []),
        seal_output=not no_seal,
    )
    ranks = torchrun_world()
    if ranks is not None and ranks[0] != 0:  # --to a framework under torchrun: rank 0 reports for all
        return
    if not quiet:
        for note in result.notes:
            out.note(note)
        if result.skipped:
            out.note(_not_written(result.skipped))
    if json_out:
        out.json(
            {
                "output": result.output,
                "files": result.files,
                "tensors": result.tensors,
                "objects": result.objects,
                "nbytes": result.nbytes,
                "notes": result.notes,
                "skipped": _skipped_json(result.skipped),
                "sealed": result.sealed,
            }
        )
    else:
        others = f" and {result.objects} other items" if result.objects else ""
        out.line(
            f"wrote {result.tensors} tensors ({decimal(result.nbytes)}){others} in {len(result.files)} "
            f"file{'s' if len(result.files) != 1 else ''} to {result.output}"
        )


@app.command(
    epilog="Examples:  ckpttool reshard ckpt/iter_0001000 -o tp1/ --tp 1 --pp 1  ·  "
    "ckpttool reshard dcp/step_100 -o dcp2/ --dp 2  ·  ckpttool reshard ckpt/ -o out/ --tp 4 --dry-run"
)
@_handles_errors
def reshard(
    src: PathArg,
    output: Annotated[
        Path, typer.Option("--output", "-o", help="The directory to write.", show_default=False, parser=_a_path)
    ],
    tp: Annotated[int | None, typer.Option("--tp", help="Tensor-parallel size (default: the source's).")] = None,
    pp: Annotated[int | None, typer.Option("--pp", help="Pipeline-parallel size (default: the source's).")] = None,
    vpp: Annotated[
        int | None,
        typer.Option(
            "--vpp",
            help="Megatron: virtual pipeline stages (model chunks) per pipeline rank, the interleaved schedule's "
            "layout. Default: the source's when --pp is not given, else 1.",
        ),
    ] = None,
    pp_first_layers: Annotated[
        int | None,
        typer.Option(
            "--pp-first-layers",
            help="Megatron: layers on the first pipeline stage (uneven pipeline; the middle stages split the "
            "rest evenly). Default: even stages, or the source's split when --pp is not given.",
        ),
    ] = None,
    pp_last_layers: Annotated[
        int | None, typer.Option("--pp-last-layers", help="Megatron: layers on the last pipeline stage.")
    ] = None,
    pipeline_layout: Annotated[
        str | None,
        typer.Option(
            "--pipeline-layout",
            help="Megatron: the layers of every (virtual) stage, as --pipeline-model-parallel-layout, e.g. "
            "'E|tt|tt|L' (E embedding, t layer, L loss; stages split by |, virtual stage by virtual stage). "
            "Default: the source's when --pp, --vpp and the first/last layers are not given.",
        ),
    ] = None,
    dp: Annotated[
        int | None, typer.Option("--dp", help="Data-parallel size; for DCP, the world size of the new checkpoint.")
    ] = None,
    ep: Annotated[
        int | None, typer.Option("--ep", help="Megatron: expert-parallel ranks (routed experts split over them).")
    ] = None,
    etp: Annotated[
        int | None,
        typer.Option(
            "--etp",
            help="Megatron: expert tensor-parallel ranks (each routed expert split over them). Default: the "
            "source's when it differs from its TP, else the new TP.",
        ),
    ] = None,
    to: Annotated[
        str | None,
        typer.Option(
            "--to",
            help="Output format: megatron, megatron-dist, deepspeed, deepspeed-universal or dcp (default: the "
            "source's).",
        ),
    ] = None,
    workers: Annotated[int, typer.Option("--workers", min=1, help="Output files written at once (processes).")] = 1,
    device: Annotated[
        str,
        typer.Option(
            "--device",
            help="Where tensors are assembled: cpu, or cuda / cuda:N (pinned buffers, the GPU cutting and "
            "placing pieces; under torchrun, cuda is each rank's local GPU).",
        ),
    ] = "cpu",
    max_memory: Annotated[
        str | None, typer.Option("--max-memory", help="Bound on the memory of all workers, e.g. 8GB.")
    ] = None,
    split_rule: SplitRuleOpt = None,
    vocab_padding: Annotated[
        str,
        typer.Option("--vocab-padding", help="keep (the padded rows, lossless) or megatron (re-pad for the new TP)."),
    ] = "keep",
    distributed_optimizer: Annotated[
        bool | None,
        typer.Option(
            "--distributed-optimizer/--no-distributed-optimizer",
            help="--to megatron, megatron-dist: write the optimizer state as Megatron's distributed optimizer "
            "saves it (distrib_optim.pt; torch_dist: its fully_reshardable layout) or as the Float16/FP32 "
            "optimizer does, per parameter (default: as the source).",
            show_default=False,
        ),
    ] = None,
    zero_stage: Annotated[
        int | None,
        typer.Option(
            "--zero-stage",
            help="--to deepspeed: the ZeRO stage of the output, 1, 2 or 3 (default: the source's).",
        ),
    ] = None,
    sub_group_size: Annotated[
        int | None,
        typer.Option(
            "--sub-group-size",
            parser=_a_count,
            metavar="<int>",
            help="--zero-stage 3 from ZeRO-1/2: zero_optimization.sub_group_size of the run that resumes "
            "(default: DeepSpeed's, 1e9).",
        ),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the plan (files, bytes, peak memory) only.")
    ] = False,
    no_seal: Annotated[bool, typer.Option("--no-seal", help="Do not write ckpttool.manifest.json.")] = False,
    force: ForceDirOpt = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """The same training state at a new parallel layout: parameters, optimizer moments, fp32 master
    copies, scheduler, step and RNG carried. Invalid layouts are refused before anything is
    written; the output is written beside OUTPUT, sealed, and published by one rename."""
    from rich.filesize import decimal

    from ckpttool.manifest import SEAL_NAME
    from ckpttool.reshard import Target, parse_split_rules
    from ckpttool.reshard import reshard as run

    ranks = torchrun_world()
    if ranks is not None and ranks[0] != 0:  # under torchrun, rank 0 reports for all
        quiet, json_out = True, False
    out = Output(json_mode=json_out, quiet=quiet)
    target = Target(
        tp=tp,
        pp=pp,
        vpp=vpp,
        dp=dp,
        ep=ep,
        etp=etp,
        to=to,
        split_rules=parse_split_rules(split_rule or []),
        vocab_padding=vocab_padding,
        distributed_optimizer=distributed_optimizer,
        pp_first=pp_first_layers,
        pp_last=pp_last_layers,
        pipeline_layout=pipeline_layout,
        zero_stage=zero_stage,
        sub_group_size=sub_group_size,
    )
    done = [0]
    with out.progress("reshard") as update:

        def advance(n: int) -> None:
            done[0] += n
            update(done[0], 0)

        result = run(
            src,
            output,
            target,
            workers=workers,
            max_memory=max_memory,
            dry_run=dry_run,
            force=force,
            seal_output=not no_seal,
            progress=advance,
            on=device,
        )
    plan = result.plan
    if ranks is not None and ranks[0] != 0:
        return
    if not quiet:
        for note in plan.notes:
            out.note(note)
    if json_out:
        report = {**plan.to_json(), "output": result.output, "written": result.written, "sealed": result.sealed}
        if result.sealed or (dry_run and not no_seal):  # (the seal is written last, as the dry run says)
            report["last_files"] = [*plan.last, SEAL_NAME]
        if result.ranks:
            report["ranks"] = result.ranks
        out.json(report)
        return
    layout = " ".join(f"{k}={v}" for k, v in plan.layout.items())
    if dry_run:
        out.table(
            ["FILE", "TENSORS", "BYTES", "PEAK"],
            [[f.path, str(f.tensors), decimal(f.nbytes), decimal(f.peak)] for f in plan.files],
            right=["TENSORS", "BYTES", "PEAK"],
            squeeze="FILE",
        )
        last = [*plan.last, *([] if no_seal else [SEAL_NAME])]
        then = f"; then {len(last)} small files: {', '.join(last)}" if last else ""
        written_as = " ".join(filter(None, (plan.format, layout)))
        out.line(
            f"plan: {len(plan.files)} files, {decimal(plan.nbytes)} of tensors, {written_as}, "
            f"{plan.workers} workers, peak memory about {decimal(plan.peak)}{then}; nothing written"
        )
        return
    from ckpttool.io import list_files

    # what is there now, metadata and seal included (the plan counts the tensor files' tensor bytes)
    written = list_files(result.output) if os.path.isdir(result.output) else [("", os.path.getsize(result.output))]
    out.line(
        f"wrote {len(written)} files ({decimal(sum(n for _, n in written))}) as "
        f"{' '.join(filter(None, (plan.format, layout)))} "
        f"to {result.output}"
        + (" (sealed)" if result.sealed else "")
        + (f" from {len(result.ranks)} ranks" if result.ranks else "")
    )


delta_app = typer.Typer(
    name="delta",
    help="Lossless delta compression of one checkpoint against another (restores every file byte for byte).",
    no_args_is_help=True,
)
app.add_typer(delta_app, name="delta")


def _said_left_out(out: Output, header: dict[str, Any]) -> None:
    """A note of what the container does not hold of the folder given (not part of the checkpoint)."""
    if left := header.get("left_out"):
        shown = ", ".join(left[:6]) + (f" and {len(left) - 6} more" if len(left) > 6 else "")
        out.warning(f"not in the container (not part of the checkpoint): {shown}")


def _coded_summary(out: Output, target: Path) -> None:
    from rich.filesize import decimal

    from ckpttool.delta import info

    stats = info(target)
    ratio = stats["ratio"]
    out.line(
        f"{stats['files']} files, {decimal(int(stats['bytes']))} -> {decimal(int(stats['container_bytes']))}"
        + (f" (ratio {ratio:.3f})" if ratio else "")
        + f": {target}"
    )


@delta_app.command("create", epilog="Example:  ckpttool delta create ckpt/step_1000 ckpt/step_1010 -o step_1010.delta")
@_handles_errors
def delta_create(
    base: Annotated[Path, typer.Argument(help="The checkpoint to code against.", show_default=False, parser=_a_path)],
    target: Annotated[Path, typer.Argument(help="The checkpoint to code.", show_default=False, parser=_a_path)],
    output: Annotated[
        Path, typer.Option("--output", "-o", help="The delta file to write.", show_default=False, parser=_a_path)
    ],
    workers: Annotated[int | None, typer.Option("--workers", min=1, help="Pieces coded at once.")] = None,
    force: ContainerForceOpt = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Code TARGET against BASE: each tensor piece by XOR or integer difference with the matching
    BASE piece in byte planes (or alone, or stored: the smallest), other bytes with zstd using the
    BASE file as dictionary. Adam's exp_avg_sq is coded against its prediction from exp_avg when
    that is smaller (one optimizer step apart). The BASE fingerprint goes into the delta."""
    from ckpttool.delta import create, info

    out = Output(json_mode=json_out, quiet=quiet)
    _said_left_out(out, create(target, output, base=base, workers=workers, force=force))
    if json_out:
        out.json(info(output))
    else:
        _coded_summary(out, output)


@delta_app.command(
    "apply", epilog="Example:  ckpttool delta apply ckpt/step_1000 step_1010.delta -o restored/step_1010"
)
@_handles_errors
def delta_apply(
    base: Annotated[
        Path, typer.Argument(help="The checkpoint the delta was made against.", show_default=False, parser=_a_path)
    ],
    delta: Annotated[Path, typer.Argument(help="The delta file.", show_default=False, parser=_a_path)],
    output: Annotated[
        Path, typer.Option("--output", "-o", help="Where to restore TARGET.", show_default=False, parser=_a_path)
    ],
    workers: Annotated[int | None, typer.Option("--workers", min=1, help="Files rebuilt at once.")] = None,
    force: ForceDirOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Restore TARGET from BASE and DELTA. Refuses a BASE that is not the one the delta was made
    against (exit 1, before writing anything); every restored file is checked against the hash
    stored in the delta before OUTPUT appears (a damaged delta: exit 3, nothing published)."""
    from ckpttool.delta import apply

    out = Output(quiet=quiet)
    header = apply(delta, output, base=base, workers=workers, force=force)
    out.line(f"restored {len(header['files'])} files to {output} (every file's xxh3-128 checked)")


@delta_app.command("info", epilog="Example:  ckpttool delta info step_1010.delta --json")
@_handles_errors
def delta_info(
    delta: Annotated[
        Path, typer.Argument(help="A delta or compressed checkpoint.", show_default=False, parser=_a_path)
    ],
    json_out: JsonOpt = False,
) -> None:
    """Bytes before and after coding, per item kind, and the coding methods used."""
    from rich.filesize import decimal

    from ckpttool.delta import info

    out = Output(json_mode=json_out)
    stats = info(delta)
    if json_out:
        out.json(stats)
        return
    out.line(
        f"{stats['kind']} of a {stats['format']} checkpoint: {stats['files']} files, "
        f"{decimal(int(stats['bytes']))} -> {decimal(int(stats['coded']))}"
    )
    rows = [
        (k, decimal(v["bytes"]), decimal(v["coded"]), f"{v['ratio']:.3f}" if v["ratio"] else "-")
        for k, v in stats["by_kind"].items()
    ]
    out.table(["KIND", "BYTES", "CODED", "RATIO"], rows, right=("BYTES", "CODED", "RATIO"))
    out.line("methods: " + ", ".join(f"{m} {n}" for m, n in stats["methods"].items()))


@app.command(epilog="Example:  ckpttool compress ckpt/step_1000 -o step_1000.ckz")
@_handles_errors
def compress(
    path: PathArg,
    output: Annotated[
        Path, typer.Option("--output", "-o", help="The file to write.", show_default=False, parser=_a_path)
    ],
    workers: Annotated[int | None, typer.Option("--workers", min=1, help="Pieces coded at once.")] = None,
    force: ContainerForceOpt = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Lossless compression of a checkpoint (byte-plane zstd for tensors, zstd for the rest)."""
    from ckpttool.delta import create, info

    out = Output(json_mode=json_out, quiet=quiet)
    _said_left_out(out, create(path, output, workers=workers, force=force))
    if json_out:
        out.json(info(output))
    else:
        _coded_summary(out, output)


@app.command(epilog="Example:  ckpttool decompress step_1000.ckz -o restored/step_1000")
@_handles_errors
def decompress(
    packed: Annotated[
        Path, typer.Argument(help="A file written by 'ckpttool compress'.", show_default=False, parser=_a_path)
    ],
    output: Annotated[
        Path, typer.Option("--output", "-o", help="Where to restore it.", show_default=False, parser=_a_path)
    ],
    workers: Annotated[int | None, typer.Option("--workers", min=1, help="Files rebuilt at once.")] = None,
    force: ForceDirOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Restore a compressed checkpoint byte for byte (every file's hash checked before publishing)."""
    from ckpttool.delta import apply

    out = Output(quiet=quiet)
    header = apply(packed, output, workers=workers, force=force)
    out.line(f"restored {len(header['files'])} files to {output} (every file's xxh3-128 checked)")


@app.command(
    epilog="Examples:  ckpttool rehearse run/step_20 --harness ckpttool.harness.tinygpt:factory  ·  "
    "ckpttool rehearse ckpt/ --harness mytrain.harness:factory --steps 3 --json"
)
@_handles_errors
def rehearse(
    path: PathArg,
    harness: Annotated[
        str, typer.Option("--harness", help="module:factory returning your training harness.", show_default=False)
    ],
    steps: Annotated[int, typer.Option("--steps", "-k", help="Training steps per run.")] = 5,
    runs: Annotated[int, typer.Option("--runs", help="Fresh processes that restore and replay.")] = 2,
    tolerance: Annotated[
        float | None,
        typer.Option(
            "--tolerance",
            help="Relative loss tolerance after the first step (for hardware known to be "
            "nondeterministic); off: bit for bit.",
        ),
    ] = None,
    device: Annotated[str | None, typer.Option("--device", help="Passed to the factory (cpu, cuda).")] = None,
    timeout: Annotated[
        float | None,
        typer.Option(
            "--timeout",
            help="Seconds each harness process may run (restore and replay); past it the process and its "
            "children are stopped and the command exits 3. Off: no limit.",
        ),
    ] = None,
    json_out: JsonOpt = False,
) -> None:
    """Restore the checkpoint into your training harness in fresh processes, replay K steps and
    prove they are bit-identical to each other and to the saved run, or name the state that breaks
    replay (RNG, dataloader position, scheduler, optimizer moments).

    Exit 0 bit-identical (or within --tolerance), 1 diverged or a component not restored, 3 could not
    run.
    """
    from ckpttool.rehearse import rehearse as run

    out = Output(json_mode=json_out)
    report = run(path, harness, steps=steps, runs=runs, tolerance=tolerance, device=device, timeout=timeout)
    if json_out:
        out.json(report.to_json())
    else:
        losses = [float.fromhex(s["loss"]) for s in report.runs[0]["steps"]]
        out.line(
            f"{report.path}: {len(report.runs)} runs of {report.steps} steps with {report.harness}"
            + ("" if report.trajectory else " (no recorded trajectory: runs compared with each other only)")
        )
        out.line("losses: " + ", ".join(f"{v:.6g}" for v in losses))
        for f in report.findings:
            if f.component:
                out.line(f"[red]{escape(f.component)}[/red]: {escape(f.message)}", markup=True)
            else:
                out.line(f.message)
        for note in report.notes:
            out.line(f"note: {note}")
        if not report.ok:
            out.line("[red]replay is NOT exact[/red]", markup=True)
        elif report.tolerance is None:
            out.line("[green]replay is bit-identical[/green]", markup=True)
        else:
            out.line(
                f"[green]replay matches within --tolerance {report.tolerance:g}[/green] (the first step bit for bit)",
                markup=True,
            )
    if not report.ok:
        raise typer.Exit(1)


def _regex(pattern: str | None) -> str | None:
    if pattern is None:
        return None
    import re

    try:
        re.compile(pattern)
    except re.error as exc:
        raise typer.BadParameter(f"not a regular expression: {exc}", param_hint="--filter") from None
    return pattern


def main() -> None:
    """Console-script entry point."""
    from ckpttool import _release_start, interrupt

    _release_start()
    interrupt.install()  # Ctrl-C that never leaves a thread pool's lock held (see there)
    try:
        app()
    except KeyboardInterrupt as exc:
        code, word = _stopped(exc)
        sys.stderr.write(word + "\n")
        sys.exit(code)
    finally:
        interrupt.disarm()  # (the exit status is chosen)
