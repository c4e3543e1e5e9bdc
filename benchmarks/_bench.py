"""What the benchmark scripts share: running one command the way a user does and measuring it."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _installed_env() -> dict[str, str]:
    """The environment the timed commands run in: what a user's has, ckpttool as ``pip install``
    leaves it, its modules compiled to bytecode. ``pip`` compiles an installed package; a checkout
    installed with ``-e`` compiles on first use, unless ``PYTHONDONTWRITEBYTECODE`` is set (as on
    the machines these figures come from), and then every run compiled ckpttool's modules afresh:
    0.12 s of a 1.4 s reshard. The modules are compiled here once (``__pycache__`` is git-ignored)
    and the variable is left out; the peers' packages have their bytecode already."""
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", str(REPO / "ckpttool"), str(REPO / "formats")], check=True
    )
    return {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


_ENV: dict[str, str] = {}


def run(cmd: list[str], ok: tuple[int, ...] = (0,)) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes, ``ru_maxrss`` of the child) of one command in a fresh
    process (:func:`_installed_env`); exits with its stderr if it fails (an exit status not in
    ``ok``: diff's 1 says the checkpoints differ)."""
    if not _ENV:
        _ENV.update(_installed_env())
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_ENV)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) not in ok:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr.read().decode() if proc.stderr else ''}")
    return wall, usage.ru_maxrss * 1024


def warm(path: Path) -> int:
    """Read every file below ``path`` once (a hot page cache for every tool alike); their bytes."""
    size = 0
    for p in path.rglob("*"):
        if p.is_file():
            size += p.stat().st_size
            with open(p, "rb") as fh:
                while fh.read(1 << 24):
                    pass
    return size


def make_once(ckpt: Path, done: str, maker: Path, *args: object, env: dict[str, str] | None = None) -> Path:
    """Make ``ckpt`` with ``torchrun --nproc-per-node 2 maker ckpt *args`` unless ``ckpt/done`` is
    there already (a half-made one is removed first)."""
    if not (ckpt / done).exists():
        shutil.rmtree(ckpt, ignore_errors=True)
        t = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
             str(maker), str(ckpt), *map(str, args)],
            check=True, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        )  # fmt: skip
        print(f"made {ckpt} in {time.perf_counter() - t:.1f} s")
    return ckpt


Runs = dict[str, list[tuple[float, int]]]


def alternate(
    cmds: dict[str, list[str]],
    repeat: int,
    reset: Callable[[str], None],
    ok: dict[str, tuple[int, ...]] | None = None,
) -> tuple[Runs, dict[str, tuple[float, float]]]:
    """Each command ``repeat`` times, taking turns, every run starting alike (``reset(name)``
    removes old outputs, then no dirty pages are left by the run before). The order rotates by one
    each round, so that every command runs as often in every position: on the virtual machines of
    docs/benchmarks.md a run that writes right after another big write pays for it (page-cache
    memory just freed by the host comes back slowly), which favoured whichever came later. ``ok``:
    the exit codes a command may end with (by name; 0 alone otherwise). Returns every run and the
    medians (wall seconds, peak RSS bytes) by name."""
    results: Runs = {k: [] for k in cmds}
    names = list(cmds)
    for round_ in range(repeat):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            reset(name)
            os.sync()
            results[name].append(run(cmds[name], (ok or {}).get(name, (0,))))
    med = {k: (statistics.median(w for w, _ in v), statistics.median(r for _, r in v)) for k, v in results.items()}
    return results, med


def as_json(results: Runs, med: dict[str, tuple[float, float]]) -> dict[str, object]:
    """Every run and the medians of :func:`alternate`, as the scripts' JSON reports hold them."""
    return {
        "runs": {k: [{"wall_s": w, "peak_rss": r} for w, r in v] for k, v in results.items()},
        "median": {k: {"wall_s": w, "peak_rss": r} for k, (w, r) in med.items()},
    }
