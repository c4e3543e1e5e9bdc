"""inspect on a 10 000-file per-rank layout: wall time and the share of bytes read.

    python benchmarks/bench_inspect_scale.py [--ranks 10000] [--kib 256]

Writes ``benchmarks/_data/rankshards_<ranks>/`` with torch.save (one file per rank: a row shard
of two global tensors with its sharding spec, an RNG state, a step), then runs ``ckpttool
inspect --json`` in a fresh process, timing it and counting the bytes it reads (every read goes
through ``ckpttool.io.pread``). Targets (issue 3): < 2 s and <= 1 % of the bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
_PROBE = r"""
import json, sys, time
import ckpttool.io as io
total = [0]
real = io.pread
def counting(fd, n, off):
    data = real(fd, n, off)
    total[0] += len(data)
    return data
io.pread = counting
t = time.perf_counter()
from ckpttool.inspect import inspect
report = inspect(sys.argv[1])
wall = time.perf_counter() - t
print(json.dumps({"wall_s": wall, "bytes_read": total[0], "files": len(report.manifest.files),
                  "items": len(report.manifest.items), "file_bytes": report.file_bytes}))
"""


def make(root: Path, ranks: int, kib: int) -> None:
    import torch

    root.mkdir(parents=True, exist_ok=True)
    cols = 64
    rows = max(1, kib * 1024 // 2 // (cols * 4))  # two fp32 tensors of about kib/2 each
    for r in range(ranks):
        path = root / f"shard_{r:05d}_of_{ranks:05d}.pt"
        if path.exists():
            continue
        shard = {
            "model": {
                name: {"local": torch.full((rows, cols), float(r)), "global_shape": [rows * ranks, cols],
                       "global_offset": [rows * r, 0]}
                for name in ("embed.weight", "head.weight")
            },
            "rng": {"torch_cpu": torch.get_rng_state()},
            "step": 1000,
        }
        torch.save(shard, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=10_000)
    ap.add_argument("--kib", type=int, default=256, help="data per file")
    args = ap.parse_args()
    root = HERE / "_data" / f"rankshards_{args.ranks}"
    t = time.perf_counter()
    make(root, args.ranks, args.kib)
    print(f"layout ready in {time.perf_counter() - t:.1f} s: {root}")
    out = subprocess.run([sys.executable, "-c", _PROBE, str(root)], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    share = result["bytes_read"] / result["file_bytes"]
    print(f"inspect: {result['files']} files, {result['items']} items, {result['wall_s']:.2f} s, "
          f"read {result['bytes_read'] / 1e6:.1f} MB of {result['file_bytes'] / 1e9:.2f} GB ({share:.2%}) "
          "(targets < 2 s, <= 1 %)")
    (HERE / "_data" / "inspect_scale.json").write_text(json.dumps({**result, "share": share}, indent=2))
    return 0 if result["wall_s"] < 2 and share <= 0.01 else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
