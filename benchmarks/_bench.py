"""What the benchmark scripts share: running one command the way a user does and measuring it."""

from __future__ import annotations

import os
import subprocess
import time


def run(cmd: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes, ``ru_maxrss`` of the child) of one command in a fresh
    process; exits with its stderr if it fails."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr.read().decode() if proc.stderr else ''}")
    return wall, usage.ru_maxrss * 1024
