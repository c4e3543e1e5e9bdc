"""Run an oracle worker on N gloo ranks: forked from one warm process (``fixtures/_fork_ranks.py``,
which imports torch and megatron-core once per test session), or under ``torchrun`` with
``CKPTTOOL_ORACLE_TORCHRUN=1``. The ranks, their environment and the worker are the same either
way; the warm start saves the 5-6 s of imports every rank pays under torchrun."""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
from pathlib import Path

FIXTURES = Path(__file__).parents[1] / "fixtures"

# what the megatron-core oracle workers import, and the CPU shims they install first
MEGATRON_CORE = [
    *("--shims", "_megatron_worker:install_cpu_shims", "--preload", "numpy", "torch", "torch.distributed"),
    *("_megatron_worker", "_megatron_oracle_worker", "megatron.core", "megatron.core.dist_checkpointing"),
    *("megatron.core.models.gpt", "megatron.core.models.gpt.gpt_layer_specs", "megatron.core.optimizer"),
    *("megatron.core.distributed", "megatron.core.transformer", "megatron.core.transformer.module"),
]

# what torch's dcp.load workers import
DCP = ["--preload", "torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.tensor"]

_warm: dict[tuple[str, ...], subprocess.Popen[str]] = {}


def _launcher(preload: tuple[str, ...]) -> subprocess.Popen[str]:
    proc = _warm.get(preload)
    if proc is not None and proc.poll() is None:
        return proc
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(
        [sys.executable, str(FIXTURES / "_fork_ranks.py"), *preload],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
    )  # fmt: skip
    assert proc.stdout is not None
    ready = proc.stdout.readline()
    if not ready.startswith('{"ready"'):
        proc.kill()
        raise RuntimeError(f"the rank launcher did not start (exit {proc.wait()}): {ready!r}")
    _warm[preload] = proc
    return proc


@atexit.register
def _stop() -> None:
    for proc in _warm.values():
        if proc.stdin:
            proc.stdin.close()  # the launcher ends at the end of its input
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_ranks(script: Path, args: list[str], nproc: int, preload: list[str] = MEGATRON_CORE, timeout: int = 600):
    """Run ``script args`` on ``nproc`` gloo ranks; a CompletedProcess with the ranks' output."""
    cmd = [str(script), *args]
    if os.environ.get("CKPTTOOL_ORACLE_TORCHRUN") == "1":
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        return subprocess.run([*launch, *cmd], capture_output=True, text=True, timeout=timeout, env=env)
    proc = _launcher(tuple(preload))
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps({"script": str(script), "args": args, "nproc": nproc, "timeout": timeout}) + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"the rank launcher died (exit {proc.wait()})")
    reply = json.loads(line)
    return subprocess.CompletedProcess(cmd, reply["returncode"], reply["stdout"], reply["stderr"])
