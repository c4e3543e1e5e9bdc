"""What checking the source's CRC-32s costs a reshard, measured inside the run.

    python benchmarks/bench_crc_check.py [--ckpt benchmarks/_data/dcp_2048x24] [--repeat 5]

Uses the 1.2 GB DCP checkpoint bench_export.py makes (run that first); hot page cache. Each run is
``reshard --dp 4`` in this process (one worker, sealed, fsynced, published), its output removed
before the next. The time spent in ``MemberCrcs.saw`` (the whole check: finding the member, the
CRC-32, combining parts), summed over every thread, is set against the run's wall time, with the
bytes it checked. An A/B of whole runs with and without the checks was tried first: on this
virtual disk the page-cache writes of the output alone vary by 0.3-1.5 s from run to run, twenty
times the cost being measured.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", default=str(HERE / "_data" / "dcp_2048x24"))
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    ckpt = Path(args.ckpt)
    if not (ckpt / ".metadata").exists():
        raise SystemExit(f"{ckpt}: run benchmarks/bench_export.py first (it makes the checkpoint)")
    from ckpttool import io as ckio
    from ckpttool.reshard import Target, reshard

    size = sum(p.stat().st_size for p in ckpt.iterdir() if p.is_file())
    spent = [0.0, 0]
    lock = threading.Lock()
    real_saw = ckio.MemberCrcs.saw

    def saw(self, offset, data):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        try:
            real_saw(self, offset, data)
        finally:
            with lock:
                spent[0] += time.perf_counter() - t
                spent[1] += memoryview(data).nbytes

    ckio.MemberCrcs.saw = saw  # type: ignore[method-assign]
    out = HERE / "_data" / "crc_check_out"
    runs = []
    for _ in range(args.repeat):
        shutil.rmtree(out, ignore_errors=True)
        os.sync()
        spent[:] = [0.0, 0]
        t = time.perf_counter()
        reshard(ckpt, out, Target(dp=4))
        runs.append((time.perf_counter() - t, spent[0], spent[1]))
    shutil.rmtree(out, ignore_errors=True)
    for wall, check, n in runs:
        print(
            f"wall {wall:5.2f} s   checking {check * 1000:4.0f} ms over {n / 1e9:.2f} GB ({n / check / 1e9:5.1f} GB/s)"
            f"   {check / wall:6.1%} of the wall time"
        )
    wall = statistics.median(r[0] for r in runs)
    check = statistics.median(r[1] for r in runs)
    print(
        f"median: wall {wall:.2f} s, checking {check * 1000:.0f} ms ({check / wall:.1%}); checkpoint {size / 1e9:.2f} GB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
