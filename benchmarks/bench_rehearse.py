"""Cost of ``rehearse`` (5 steps, 2 runs) against the harness's own 10 training steps.

    python benchmarks/bench_rehearse.py

Target (issue 7): the two runs' restore + 5 steps together cost <= 3x the harness's 10 steps,
start-up (interpreter, imports, building the harness) aside; reported with the start-up too. Both
sides are timed in fresh processes, so both include the first (cold) training step.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    from ckpttool.harness.tinygpt import train
    from ckpttool.rehearse import rehearse

    tmp = Path(tempfile.mkdtemp())
    try:
        (ckpt,) = train(tmp, steps=10, save_every=10, k=5, omit=None, device="cpu")
        # the harness's own 10 steps, in a fresh process like each rehearse run (first step included)
        probe = ("import time; from ckpttool.harness.tinygpt import TinyGPTHarness; h = TinyGPTHarness(); "
                 "t = time.perf_counter(); [h.step() for _ in range(10)]; print(time.perf_counter() - t)")
        own = float(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                                   check=True).stdout.strip())
        t = time.perf_counter()
        report = rehearse(ckpt, "ckpttool.harness.tinygpt:factory", steps=5, runs=2)
        wall = time.perf_counter() - t
        work = sum(r["timing"]["restore_s"] + r["timing"]["steps_s"] for r in report.runs)
        startup = sum(r["timing"]["build_s"] for r in report.runs)
        print(f"harness, 10 steps:                  {own:.3f} s")
        print(f"rehearse 2 x (restore + 5 steps):   {work:.3f} s  = {work / own:.2f} x  (target <= 3 x)")
        print(f"  + building the harness twice:     {startup:.3f} s; wall with interpreter start-up {wall:.2f} s")
        print(f"replay bit-identical: {report.ok}")
        return 0 if work <= 3 * own and report.ok else 1
    finally:
        shutil.rmtree(tmp)


if __name__ == "__main__":
    sys.exit(main())
