"""Run the hostile corpus: build every case, run the commands on it in this process (the real CLI
entry, output captured), each under a time limit, the whole run under a memory limit, and write
one JSON record per command run.

    python -m tests.hostile.run --out DIR [--only SUBSTRING] [--no-sweeps] [--results FILE]

A record: ``case``, ``command``, ``exit``, ``stderr``, ``stdout``, ``rules`` (verify's findings),
``seconds``, ``payload_ran`` (the marker file appeared), ``hang`` (the time limit fired) and
``crash`` (an exception escaped the CLI, or it reported an internal error). The judging is in
``tests/test_hostile_corpus.py`` (``judge`` there); this script only observes.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import os
import resource
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from tests.conftest import cli_env
from tests.hostile.corpus import CASES, MARKER, SWEEP_FIXTURES, copy_fixture, sweep

MEMORY_LIMIT = 6 * 2**30
"""Address-space limit for the whole run: a parser that believes a size it read from the file
fails with MemoryError (a crash, judged as such) instead of taking the machine down."""


class Hang(BaseException):
    """The per-command time limit fired (a BaseException: the CLI's handlers must not catch it)."""


def _alarm(_signum: int, _frame: Any) -> None:
    raise Hang()


def argv_for(command: str, target: Path, scratch: Path) -> list[str]:
    if command == "inspect":
        return ["inspect", str(target)]
    if command == "verify":
        return ["verify", str(target), "--json"]
    if command == "export":
        return ["export", str(target), "-o", str(scratch / "out.safetensors")]
    raise ValueError(command)


@functools.cache
def _cli() -> Any:
    """The CLI's click command, built once (typer builds it anew on every call of ``app``)."""
    import typer

    from ckpttool.cli import app

    return typer.main.get_command(app)


def run_command(command: str, target: Path, scratch: Path, limit_s: float) -> dict[str, Any]:

    cwd = scratch / "cwd"
    cwd.mkdir(parents=True, exist_ok=True)
    out, err = io.StringIO(), io.StringIO()
    record: dict[str, Any] = {"command": command, "hang": False, "crash": None}
    old = os.getcwd()
    os.chdir(cwd)
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, limit_s)
    t0 = time.perf_counter()
    code: Any = None
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = _cli().main(args=argv_for(command, target, scratch), prog_name="ckpttool", standalone_mode=False)
    except Hang:
        record["hang"] = True
    except SystemExit as exc:
        code = exc.code
    except BaseException as exc:  # what the corpus exists to catch
        record["crash"] = "".join(traceback.format_exception(exc))[-2000:]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        os.chdir(old)
    record["seconds"] = round(time.perf_counter() - t0, 3)
    record["exit"] = 0 if code is None else code if isinstance(code, int) else 2
    record["stdout"], record["stderr"] = out.getvalue(), err.getvalue()
    if "internal error" in record["stderr"] or "Traceback" in record["stderr"]:
        record["crash"] = record["crash"] or record["stderr"][-2000:]
    record["payload_ran"] = (cwd / MARKER).exists() or Path(MARKER).exists()
    record["rules"] = []
    if command == "verify" and record["stdout"].strip():
        try:
            record["rules"] = sorted({f["rule"] for f in json.loads(record["stdout"])["findings"]})
        except (ValueError, KeyError, TypeError):
            record["crash"] = record["crash"] or "verify --json printed something that is not its report"
    if command == "export" and record["exit"] != 0:
        # a failed export leaves nothing behind
        left = [p.name for p in scratch.iterdir() if p.name != "cwd"]
        if left:
            record["crash"] = record["crash"] or f"a failed export left {left}"
    shutil.rmtree(cwd, ignore_errors=True)
    for p in scratch.iterdir():
        if p.name.startswith("out.safetensors") or p.name.startswith(".out.safetensors"):
            p.unlink()
    return record


def run_cases(out: Path, only: str | None, shard: tuple[int, int]) -> list[dict[str, Any]]:
    records = []
    for i, case in enumerate(CASES):
        if (only and only not in case.name) or i % shard[1] != shard[0]:
            continue
        home = out / "cases" / case.name
        shutil.rmtree(home, ignore_errors=True)
        (home / "data").mkdir(parents=True)
        target = case.build(home / "data")
        for command in case.expect:
            rec = run_command(command, target, home / "scratch", case.limit_s)
            rec["case"] = case.name
            records.append(rec)
        shutil.rmtree(home)
    return records


def run_sweeps(out: Path, only: str | None, shard: tuple[int, int]) -> list[dict[str, Any]]:
    from ckpttool.seal import seal

    records = []
    for fixture in SWEEP_FIXTURES:
        if only and only not in fixture:
            continue
        home = out / "sweeps" / fixture.replace("/", "_")
        shutil.rmtree(home, ignore_errors=True)
        (home / "data").mkdir(parents=True)
        root = copy_fixture(fixture, home / "data")
        unsealed = home / "unsealed"
        unsealed.mkdir()
        plain = copy_fixture(fixture, unsealed)
        seal(root)
        for i, damage in enumerate(sweep(fixture)):
            if i % shard[1] != shard[0]:
                continue
            # a cut file is noticed without a seal; a flipped byte only with one (raw tensor bytes
            # carry no check in most formats), so unsealed flips are judged on crashes and hangs only
            runs = [(plain, "unsealed")] if damage.kind == "trunc" else [(root, "sealed"), (plain, "unsealed")]
            for target, how in runs:
                original = damage.apply(target)
                try:
                    rec = run_command("verify", target, home / "scratch", 20.0)
                finally:
                    damage.undo(target, original)
                rec["case"] = f"{damage.name}:{how}"
                rec["sweep"] = fixture
                rec["must_fail"] = not (damage.kind == "flip" and how == "unsealed")
                records.append(rec)
        shutil.rmtree(home)
    return records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="scratch folder (made, and emptied as cases finish)")
    ap.add_argument("--only", help="run only cases / sweep fixtures whose name contains this")
    ap.add_argument("--no-sweeps", action="store_true")
    ap.add_argument("--no-cases", action="store_true")
    ap.add_argument("--results", type=Path, help="write the records here (JSON list); default: stdout")
    ap.add_argument("--shard", default="0/1", help="K/N: run every N-th case and damage from the K-th (for parallel runs)")
    args = ap.parse_args(argv)
    k, n = (int(v) for v in args.shard.split("/"))
    args.out = args.out / f"shard{k}of{n}"
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    env = cli_env()
    os.environ.clear()
    os.environ.update(env)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    records = [] if args.no_cases else run_cases(args.out, args.only, (k, n))
    if not args.no_sweeps:
        records += run_sweeps(args.out, args.only, (k, n))
    summary = {
        "records": len(records),
        "seconds": round(time.perf_counter() - t0, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    text = json.dumps({"summary": summary, "records": records}, indent=1)
    if args.results:
        args.results.write_text(text)
    else:
        sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
