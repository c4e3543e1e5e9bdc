"""Peak memory of ``export`` against the bound ``2 × largest tensor + 300 MB`` (issue 3).

    python benchmarks/bench_export_memory.py [--layout benchmarks/_data/rankshards_10000]

Runs ``ckpttool export`` of a per-rank layout (by default the one bench_inspect_scale.py makes:
10 000 files, two global tensors of 1.35 GB assembled from 10 000 row pieces each) in a fresh
process and reports its peak RSS next to the bound.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from _bench import run  # the folder beside this script

HERE = Path(__file__).resolve().parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layout", default=str(HERE / "_data" / "rankshards_10000"))
    args = ap.parse_args()
    from ckpttool import registry
    from ckpttool.dtypes import dtype

    _, m = registry.describe(args.layout)
    largest = max(math.prod(i.shape or ()) * dtype(i.dtype).itemsize for i in m.items.values() if i.is_tensor)
    out = HERE / "_data" / "export_memory.safetensors"
    out.unlink(missing_ok=True)
    os.sync()
    wall, peak = run([sys.executable, "-m", "ckpttool", "export", args.layout, "-o", str(out), "-q"])
    bound = 2 * largest + 300e6
    size = out.stat().st_size
    out.unlink()
    print(f"export of {size / 1e9:.2f} GB in {wall:.1f} s: peak RSS {peak / 1e6:.0f} MB; largest tensor "
          f"{largest / 1e6:.0f} MB; bound 2x largest + 300 MB = {bound / 1e6:.0f} MB "
          f"({'within' if peak <= bound else 'OVER'})")
    return 0 if peak <= bound else 1


if __name__ == "__main__":
    sys.exit(main())
