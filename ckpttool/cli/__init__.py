"""The ``ckpttool`` command line: parse options, call the library, render, pick the exit code.

Exit codes: 0 ran and found nothing wrong; 1 ran and found problems; 2 usage error; 3 could not
evaluate (missing path, unknown format, unsafe pickle, damaged file, internal error); 130 on
Ctrl-C. Library modules (and torch) are imported inside the commands so ``--help`` stays fast.
"""

from __future__ import annotations

import functools
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from ckpttool.cli._output import Output
from ckpttool.errors import CkptError

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

JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress or notes on stderr.")]
PathArg = Annotated[Path, typer.Argument(help="Checkpoint directory or file.", show_default=False)]


def _handles_errors(fn: F) -> F:
    """Turn library errors into one message on stderr and the contract's exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        out = Output()
        try:
            return fn(*args, **kwargs)
        except CkptError as exc:
            if os.environ.get("CKPTTOOL_DEBUG"):
                traceback.print_exc()
            out.error(exc.message, exc.hint)
            raise typer.Exit(exc.exit_code) from None
        except (typer.Exit, typer.Abort, typer.BadParameter, KeyboardInterrupt):
            raise
        except Exception as exc:
            if os.environ.get("CKPTTOOL_DEBUG"):
                traceback.print_exc()
            out.error(
                f"internal error: {type(exc).__name__}: {exc}",
                "this is a bug in ckpttool; rerun with CKPTTOOL_DEBUG=1 for the traceback and report it",
            )
            raise typer.Exit(3) from None

    return wrapper  # type: ignore[return-value]


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
    (e.g. a pickle that would run code), 3 when the checkpoint cannot be read at all.
    """
    from ckpttool.cli import _render
    from ckpttool.inspect import inspect as run

    out = Output(json_mode=json_out)
    report = run(path)
    if json_out:
        out.json(report.to_json())
    else:
        _render.inspect_report(out, report)
    if report.unloadable:
        out.warning(
            f"{len(report.unloadable)} item(s) cannot be loaded safely: "
            + "; ".join(f"{i.name}: {i.error}" for i in report.unloadable[:5])
        )
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


@app.command(
    epilog="Examples:  ckpttool export ckpt/ -o full.safetensors  ·  "
    "ckpttool export ckpt/ -o model.safetensors --kind param  ·  "
    "ckpttool export ckpt/ -o moments.safetensors --filter 'exp_avg'"
)
@_handles_errors
def export(
    path: PathArg,
    output: Annotated[Path, typer.Option("--output", "-o", help="The .safetensors file to write.", show_default=False)],
    filter_: Annotated[
        str | None, typer.Option("--filter", "-f", help="Only items whose name matches this regular expression.")
    ] = None,
    kind: Annotated[str, typer.Option("--kind", "-k", help="param, optim, master, rng, ... or all.")] = "all",
    force: Annotated[bool, typer.Option("--force", help="Replace OUTPUT if it exists.")] = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Write the full, unsharded logical tensors to one safetensors file.

    Tensors are assembled piece by piece (memory bounded by the largest tensor) and the file is
    published atomically. Non-tensor items are listed on stderr, not written.
    """
    from ckpttool.export import export as run

    out = Output(json_mode=json_out, quiet=quiet)
    with out.progress("export") as update:
        result = run(path, output, kind=kind, pattern=_regex(filter_), force=force, progress=update)
    if result.skipped and not quiet:
        names = ", ".join(f"{i.name} ({why})" for i, why in result.skipped[:20])
        more = f" and {len(result.skipped) - 20} more" if len(result.skipped) > 20 else ""
        out.note(f"not written: {names}{more}")
    if json_out:
        out.json(
            {
                "output": result.output,
                "tensors": len(result.written),
                "nbytes": result.nbytes,
                "written": [i.name for i in result.written],
                "skipped": [{"name": i.name, "reason": why} for i, why in result.skipped],
            }
        )
    else:
        from rich.filesize import decimal

        out.line(f"wrote {len(result.written)} tensors ({decimal(result.nbytes)}) to {result.output}")


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
    try:
        app()
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        sys.exit(130)
