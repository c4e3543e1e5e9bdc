"""``rehearse``: restore a checkpoint into a real training harness and prove replay is exact.

Each run is a fresh process (``python -m ckpttool.rehearse worker ...``) that builds the harness,
restores the checkpoint, reports what it restored and the digest of every component, then runs K
steps, reporting each step's loss bits and component digests. The parent compares:

1. the restore: every component restored, and equal to the uninterrupted run's state at the save
   (from ``ckpttool.trajectory.json`` beside the checkpoint, when present);
2. the runs against each other (determinism) and against the recorded trajectory, step by step;
3. on a divergence nobody is blamed for yet, re-runs with one component at a time forced to the
   uninterrupted run's state (``ckpttool.trajectory.pt``): the one that makes replay match is named.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpttool.errors import CkptError, CorruptFileError, UsageError
from ckpttool.harness import COMPONENTS, TRAJECTORY, TRAJECTORY_STATES
from ckpttool.manifest import SCHEMA_VERSION
from ckpttool.values import check_tolerance

_WORDS = {
    "model": "model weights",
    "optimizer": "optimizer state",
    "scheduler": "LR scheduler state",
    "rng": "RNG state",
    "dataloader": "dataloader position",
}


class HarnessError(CkptError):
    """The harness could not be imported, or could not restore the checkpoint (exit 3)."""


@dataclass(slots=True, kw_only=True)
class Blame:
    component: str | None
    """the state blamed (None: the replay itself); the message does not repeat it"""
    message: str
    step: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"component": self.component, "message": self.message, "step": self.step}


@dataclass(slots=True, kw_only=True)
class RehearseReport:
    path: str
    harness: str
    steps: int
    runs: list[dict[str, Any]] = field(default_factory=list)
    trajectory: bool = False
    tolerance: float | None = None
    """the relative loss tolerance after the first step (None: bit for bit)"""
    findings: list[Blame] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """what was not compared, and why (the verdict does not depend on them)"""

    @property
    def ok(self) -> bool:
        return not self.findings

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "path": self.path,
            "harness": self.harness,
            "steps": self.steps,
            "runs": len(self.runs),
            "trajectory": self.trajectory,
            "tolerance": self.tolerance,
            "ok": self.ok,
            "restored": self.runs[0]["restored"] if self.runs else None,
            "losses": [[s["loss"] for s in r["steps"]] for r in self.runs],
            "findings": [f.to_json() for f in self.findings],
            "notes": self.notes,
        }


def _run(
    path: Path,
    harness: str,
    steps: int,
    force: str | None = None,
    device: str | None = None,
    timeout: float | None = None,
) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "ckpttool.rehearse",
        "worker",
        "--harness",
        harness,
        "--path",
        str(path),
        "--steps",
        str(steps),
    ]
    if force:
        cmd += ["--force", force]
    if device:
        cmd += ["--device", device]
    # the result comes back in a file of its own, not on stdout, which is the harness's (a line it
    # printed at exit, or bytes that are not UTF-8, made a healthy run an internal error); its output
    # goes to a file, not a pipe, so that a process it leaves running (a metrics service holding
    # the pipe open) does not keep this one waiting
    with tempfile.TemporaryDirectory(prefix="ckpttool-rehearse-") as tmp:
        result_path, log_path = Path(tmp) / "result.json", Path(tmp) / "output.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [*cmd, "--result", str(result_path)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONHASHSEED": "0"},
                # (in this command's process group, as before: a terminal's Ctrl-C or hang-up and a CI
                # runner's kill of the job's group reach the harness and its workers too; in a session
                # of its own, a SIGHUP or SIGKILL of the group left a hung harness running)
            )
            _wait(proc, timeout, log_path, cmd)
        try:
            result: dict[str, Any] = json.loads(result_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raise HarnessError(
                f"the harness process failed (exit {proc.returncode}): {_last_line(log_path) or 'no output'}",
                hint="run it by hand: PYTHONHASHSEED=0 " + " ".join(cmd),
            ) from None
    if "error" in result:
        stage, error = result.get("stage"), result["error"]
        if stage == "harness":
            raise HarnessError(
                f"cannot build the harness {harness}: {error}",
                hint="--harness takes module:factory, importable from the current directory",
            )
        if stage == "force":
            raise HarnessError(f"cannot force the {force} state of {TRAJECTORY_STATES} into the harness: {error}")
        if stage == "restore":
            raise HarnessError(
                f"{path}: the harness cannot restore this checkpoint: {error}",
                hint="the checkpoint does not fit the harness's model, or is incomplete",
            )
        raise HarnessError(
            f"{path}: the harness failed after restoring the checkpoint, in {stage}: {error}",
            hint="the harness's own code failed (ckpttool.harness.Harness says what each method returns)",
        )
    return result


def _wait(proc: subprocess.Popen[bytes], timeout: float | None, log: Path, cmd: list[str]) -> None:
    """Wait for a harness process; past ``timeout`` seconds (a harness stuck in a collective, a data
    loader that never yields), or on Ctrl-C, end it and every process it started
    (:func:`_kill_tree`). Without a limit a hung harness held the command, and a CI job, for ever."""
    import signal

    try:
        proc.wait(timeout=timeout)
    except BaseException as exc:
        _kill_tree(proc.pid, signal.SIGKILL)
        proc.wait()
        if not isinstance(exc, subprocess.TimeoutExpired):
            raise
        raise HarnessError(
            f"the harness process did not finish within --timeout {timeout:g} s and was stopped; its last "
            f"output: {_last_line(log) or 'none'}",
            hint="a harness waiting on a collective or a data loader that never yields; run it by hand: "
            "PYTHONHASHSEED=0 " + " ".join(cmd),
        ) from None


def _last_line(log: Path) -> str:
    """The harness's last line of output (its first 300 characters), or ''."""
    lines = log.read_bytes().decode("utf-8", "replace").strip().splitlines()
    return lines[-1][:300] if lines else ""


def _kill_tree(pid: int, sig: int) -> None:
    """Signal ``pid`` and every process it started, found by their parents in ``/proc`` (a data
    loader's workers, a metrics service), the descendants first; where there is no ``/proc``, the
    process alone."""
    children: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    with open(f"/proc/{entry.name}/stat", "rb") as fh:
                        ppid = int(fh.read().rsplit(b")", 1)[1].split()[1])
                except (OSError, ValueError, IndexError):
                    continue
                children.setdefault(ppid, []).append(int(entry.name))
    order, todo = [], [pid]
    while todo:
        p = todo.pop()
        order.append(p)
        todo += children.get(p, [])
    for p in reversed(order):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, sig)


def _diverge(run: list[dict[str, Any]], ref: list[dict[str, Any]], tolerance: float | None) -> tuple[int, str] | None:
    """First step (1-based) where a run differs from a reference, and what differs. Within a
    ``tolerance``: the first step's loss bit for bit, the later ones within it, and no digest after
    the restore (the state after a nondeterministic update differs in its last bits)."""
    for i, (a, b) in enumerate(zip(run, ref, strict=False), start=1):
        la, lb = float.fromhex(a["loss"]), float.fromhex(b["loss"])
        if tolerance is not None and i > 1:
            # (a NaN or Inf loss is within no tolerance of anything but its own bits: abs(la - lb) >
            # tol * ... is False for a NaN, and "replay matches within --tolerance" was said of NaN losses)
            same = a["loss"] == b["loss"]
            if not same and not (
                math.isfinite(la) and math.isfinite(lb) and abs(la - lb) <= tolerance * max(abs(lb), 1e-12)
            ):
                return i, f"loss {la!r} vs {lb!r}"
            continue
        if a["loss"] != b["loss"]:
            return i, f"loss {la!r} vs {lb!r}"
        bad = sorted(k for k in b.get("digests", {}) if a["digests"].get(k) != b["digests"][k])
        if bad and tolerance is None:
            return i, f"{', '.join(bad)} differ"
    return None


def _preflight(p: Path) -> None:
    """Read the checkpoint with ckpttool's own reader before a harness loads it with torch: the
    harness unpickles ``.metadata`` and bytes items for real, so a pickle that names a global
    outside the allowlist must stop here, before any training code sees the files."""
    from ckpttool import registry
    from ckpttool.errors import UnsafePickleError
    from ckpttool.formats._pt import hostile_beside
    from ckpttool.inspect import format_findings

    _, manifest = registry.describe(p)
    for item in manifest.items.values():
        if (named := item.refused_global) is not None:
            raise UnsafePickleError(
                item.pieces[0].file if item.pieces else str(p),
                named,
                what=f"item {item.name}",
            )
    # the training state's own files (a Trainer's optimizer.pt, which its resume loads with
    # torch.load) and the pickles beside them: a hostile one reached the harness, exit 0
    hostile_beside(Path(manifest.root), manifest)
    for f in format_findings(manifest):
        if f["rule"] == "unsafe-pickle" and f["severity"] == "error":
            raise CkptError(f"{f['message']}; the harness was not run", hint=f.get("hint"), path=f["file"])


def rehearse(
    path: str | Path,
    harness: str,
    *,
    steps: int = 5,
    runs: int = 2,
    tolerance: float | None = None,
    device: str | None = None,
    timeout: float | None = None,
) -> RehearseReport:
    """Restore ``path`` into the harness in ``runs`` fresh processes, replay ``steps`` steps and
    compare (see the module's docstring). ``timeout``: seconds each harness process may take."""
    p = Path(path)
    if not p.exists():
        from ckpttool.errors import NotFoundError

        raise NotFoundError(f"{p}: no such checkpoint", path=str(p))
    if ":" not in harness:
        raise UsageError(f"--harness {harness!r}: expected module:factory")
    if runs < 1 or steps < 1:
        raise UsageError("--runs and --steps must be at least 1")
    if tolerance is not None:  # (NaN passed every comparison, a negative one failed two equal losses)
        check_tolerance("--tolerance", tolerance)
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
        raise UsageError(f"--timeout {timeout}: expected a number of seconds above 0")
    if device is not None and device.partition(":")[0] == "cuda":  # (other names are the harness's to judge)
        from ckpttool.device import resolve

        resolve(device)  # a machine without the GPU is told so, not that the harness failed to build
    _preflight(p)
    report = RehearseReport(path=str(p), harness=harness, steps=steps, tolerance=tolerance)
    traj = _trajectory(p / TRAJECTORY)
    report.trajectory = traj is not None
    if traj is None and runs == 1:  # (one run and nothing recorded: compared with nothing, "bit-identical")
        raise UsageError(
            "--runs 1 with no recorded trajectory compares nothing",
            hint=f"give --runs 2 or more, or record a trajectory ({TRAJECTORY}) beside the checkpoint",
        )
    if traj is None and p.is_file() and (p.parent / TRAJECTORY).is_file():
        report.notes.append(
            f"{p.parent / TRAJECTORY} is not read: a trajectory is kept in the checkpoint's directory, and a "
            "single-file checkpoint has none (put it in a directory of its own with the trajectory)"
        )
    if traj is not None and len(traj["steps"]) < steps:
        report.notes.append(
            f"the saved run recorded {len(traj['steps'])} steps after the save: steps {len(traj['steps']) + 1}-{steps} "
            + ("are compared between the runs only" if runs > 1 else "are compared with nothing (--runs 1)")
        )
    run = functools.partial(_run, p, harness, steps, device=device, timeout=timeout)
    report.runs = [run() for _ in range(runs)]
    first = report.runs[0]
    blamed: set[str] = set()
    for comp in COMPONENTS:
        if comp in first["restored"] and not first["restored"][comp]:
            blamed.add(comp)
            report.findings.append(
                Blame(component=comp, message=f"{_WORDS[comp]} not restored: the checkpoint does not hold it")
            )
    if traj is not None:
        for comp, want in traj["components"].items():
            if comp in blamed or first["components"].get(comp) == want:
                continue
            blamed.add(comp)
            report.findings.append(
                Blame(
                    component=comp,
                    message=f"the restored {_WORDS.get(comp, comp)} "
                    "differs from the saved run's at the moment of the save",
                )
            )
    deterministic = True
    for i, other in enumerate(report.runs[1:], start=2):
        d = _diverge(other["steps"], first["steps"], tolerance)
        if d is not None:
            deterministic = False
            report.findings.append(
                Blame(
                    component=None,
                    step=d[0],
                    message=(f"run {i} differs from run 1 at step {d[0]} ({d[1]}): training is not deterministic here"),
                )
            )
    if traj is not None:
        d = _diverge(first["steps"], traj["steps"][:steps], tolerance)
        if d is not None:
            where = f"replay differs from the saved run at step {d[0]} ({d[1]})"
            if blamed:
                for f in report.findings:
                    if f.component in blamed and f.step is None:
                        f.step = d[0]
                        f.message += f"; {where}"
            elif not deterministic:  # a forced run that matched (or not) would say nothing about the restore
                report.findings.append(
                    Blame(
                        component=None,
                        step=d[0],
                        message=f"{where}; no component is blamed, as the runs do not replay each other",
                    )
                )
            else:
                culprit = _blame(report, p, run, steps, traj, tolerance)
                report.findings.append(
                    Blame(
                        component=culprit,
                        step=d[0],
                        message=(
                            f"{_WORDS.get(culprit, culprit)} not restored exactly: {where}; "
                            "forcing it to the saved run's state makes replay match"
                            if culprit
                            else f"{where}; forcing no single component equal makes it match"
                        ),
                    )
                )
    return report


def _trajectory(path: Path) -> dict[str, Any] | None:
    """The recorded trajectory beside a checkpoint (None if there is none), its shape checked."""
    if not os.path.lexists(path):
        return None
    if not path.is_file():  # (a folder or a dangling link by that name: not "no trajectory", compared with nothing)
        raise CorruptFileError(
            f"{path}: expected the recorded trajectory, a JSON file; found "
            + ("a directory" if path.is_dir() else "no file"),
            hint="move it away to compare the runs with each other only",
            path=str(path),
        )
    why = ""
    try:
        traj = json.loads(path.read_text(encoding="utf-8"))
        steps = traj.get("steps") if isinstance(traj, dict) else None
        ok = (
            isinstance(traj.get("components") if isinstance(traj, dict) else None, dict)
            and isinstance(steps, list)
            and all(
                isinstance(s, dict) and _hex_float(s.get("loss")) and isinstance(s.get("digests", {}), dict)
                for s in steps
            )
        )
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        ok, why = False, f" ({exc})"
    if not ok:
        raise CorruptFileError(
            f"{path}: not a trajectory ckpttool can read{why}: expected a JSON object with 'components' (an object) "
            "and 'steps' (a list of objects with a 'loss' as float.hex writes it and 'digests')",
            hint="the saving run writes it (docs/rehearse.md, 'To record a trajectory'); move the damaged file "
            "away to compare the runs with each other only",
            path=str(path),
        )
    return traj


def _hex_float(value: Any) -> bool:
    """Whether ``value`` is a float exactly as ``float.hex`` writes it (the trajectory's losses, which
    are compared as written). A decimal "1.5" was taken: ``float.fromhex`` reads it as hex digits,
    1.3125, and a run whose loss was 1.5 was said to diverge from it."""
    try:
        return isinstance(value, str) and float.fromhex(value).hex() == value
    except ValueError:
        return False


def _blame(
    report: RehearseReport,
    p: Path,
    run: Callable[..., dict[str, Any]],
    steps: int,
    traj: dict[str, Any],
    tolerance: float | None,
) -> str | None:
    """The component whose forcing to the saved run's state makes replay match, if one does. A
    forced run that fails (a harness without ``force``, a damaged ``ckpttool.trajectory.pt``) is
    noted and blames nothing: the divergence already found stands (exit 1); it was thrown away for
    an exit 3 that blamed the checkpoint."""
    if not (p / TRAJECTORY_STATES).is_file():
        return None
    try:
        for comp in COMPONENTS:
            forced = run(force=comp)
            if _diverge(forced["steps"], traj["steps"][:steps], tolerance) is None:
                return comp
    except HarnessError as exc:
        report.notes.append(f"no component could be blamed: {exc.message}")
    return None


# -- the worker (one fresh process per run) ---------------------------------------------------------


def _worker(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m ckpttool.rehearse worker")
    ap.add_argument("--harness", required=True)
    ap.add_argument("--path", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--force")
    ap.add_argument("--device")
    ap.add_argument("--result", required=True)
    args = ap.parse_args(argv)

    def answer(result: dict[str, Any]) -> int:
        Path(args.result).write_text(json.dumps(result), encoding="utf-8")
        return 0

    module, _, name = args.harness.partition(":")
    t0 = time.perf_counter()
    try:
        factory = getattr(importlib.import_module(module), name)
        h = factory(args.device) if args.device else factory()
        for method in ("restore", "step", "digests", *(("force",) if args.force else ())):
            if not callable(getattr(h, method, None)):
                raise TypeError(f"{name}() returned a {type(h).__name__}, which has no {method}() method")
    except Exception as exc:
        return answer({"error": f"{type(exc).__name__}: {exc}", "stage": "harness"})
    t1 = time.perf_counter()
    stage = "restore"
    try:
        restored = h.restore(args.path)
        _check_restored(restored)
        if args.force:
            stage = "force"
            import torch

            states = torch.load(Path(args.path) / TRAJECTORY_STATES, weights_only=True)
            if not isinstance(states, dict) or args.force not in states:
                raise ValueError(f"{TRAJECTORY_STATES} holds no {args.force} state")
            h.force(args.force, states[args.force])
        stage = "digests()"
        components = _checked_digests(h.digests())
        t2 = time.perf_counter()
        out = []
        for k in range(1, args.steps + 1):
            stage = f"step {k}"
            loss = h.step()
            if not isinstance(loss, int | float) or isinstance(loss, bool):
                raise TypeError(f"step() returned a {type(loss).__name__}, expected the loss as a number")
            out.append({"loss": float(loss).hex(), "digests": _checked_digests(h.digests())})
        t3 = time.perf_counter()
    except Exception as exc:  # reported to the parent, with the stage it failed in
        msg = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else f"{type(exc).__name__}: {exc}"
        return answer({"error": msg, "stage": stage})
    timing = {"build_s": t1 - t0, "restore_s": t2 - t1, "steps_s": t3 - t2}
    return answer({"restored": restored, "components": components, "steps": out, "timing": timing})


def _check_restored(restored: Any) -> None:
    """``restore()``'s answer: True or False for each component (``{}`` passed: every component
    counted as restored)."""
    if not isinstance(restored, dict) or not all(isinstance(restored.get(c), bool) for c in COMPONENTS):
        raise TypeError(
            f"restore() returned {_shown(restored)}; expected a dict giving True or False for each of "
            + ", ".join(COMPONENTS)
        )


def _checked_digests(digests: Any) -> dict[str, str]:
    if not isinstance(digests, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in digests.items()):
        raise TypeError(f"digests() returned {_shown(digests)}; expected a dict of component name to digest text")
    return digests


def _shown(value: Any) -> str:
    return repr(value)[:80] if isinstance(value, dict) else f"a {type(value).__name__}"


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        sys.exit(_worker(sys.argv[2:]))
    sys.exit("usage: python -m ckpttool.rehearse worker --harness M:F --path P --steps K [--force C]")
