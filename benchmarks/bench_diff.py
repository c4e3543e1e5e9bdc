"""diff of two consecutive saves, every tensor changed, against the script a user would write.

    python benchmarks/bench_diff.py [--repeat 3] [--mb 640]

Makes two DCP checkpoints in benchmarks/_data/diff_{a,b} (once): fp32 tensors of 32 MiB, about
``--mb`` MB each, the second the first plus small noise on every element (a training step: every
value differs). Hot page cache for both tools (the files are read first). Times, each a median of
``--repeat`` in fresh processes, taking turns:

- ``ckpttool diff A B`` (exit 1: they differ);
- the peer: ``dcp.load`` of both into state dicts shaped from the metadata, then for every tensor
  (in its dtype) torch's own count of differing elements, max |a - b| and ||a - b|| / ||b|| (what
  ``diff`` reports), the obvious script for the question.

Writes benchmarks/_data/diff.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import _bench  # the folder beside this script

HERE = Path(__file__).resolve().parent
DATA = HERE / "_data"

PEER = """
import sys, warnings, torch, torch.distributed.checkpoint as dcp
warnings.simplefilter("ignore")
def load(path):
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()}
    dcp.load(sd, checkpoint_id=path, no_dist=True)
    return sd
a, b = load(sys.argv[1]), load(sys.argv[2])
for k in a:
    d = a[k] - b[k]
    print(k, int((a[k] != b[k]).sum()), float(d.abs().max()), float(d.norm() / b[k].norm()))
"""

MAKER = """
import sys, warnings, torch, torch.distributed.checkpoint as dcp
warnings.simplefilter("ignore")  # (no process group: a single-process save)
torch.manual_seed(0)
sd = {f"layers.{i}.weight": torch.randn(1024, 8192) for i in range(max(1, int(sys.argv[3]) // 32))}
dcp.save(sd, checkpoint_id=sys.argv[1], no_dist=True)
for t in sd.values():
    t.add_(torch.randn_like(t), alpha=1e-3)
dcp.save(sd, checkpoint_id=sys.argv[2], no_dist=True)
"""


def make(mb: int) -> tuple[Path, Path]:
    a, b = DATA / "diff_a", DATA / "diff_b"
    if not ((a / ".metadata").exists() and (b / ".metadata").exists()):
        shutil.rmtree(a, ignore_errors=True)
        shutil.rmtree(b, ignore_errors=True)
        # (in a process of its own: Linux keeps a process's peak RSS across exec, and every command
        # this script starts would count the tensors made here in its own peak)
        subprocess.run([sys.executable, "-c", MAKER, str(a), str(b), str(mb)], check=True)
    return a, b


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--mb", type=int, default=640, help="size of each checkpoint, MB")
    args = ap.parse_args()
    a, b = make(args.mb)
    size = _bench.warm(a) + _bench.warm(b)
    cmds = {
        "ckpttool diff": [sys.executable, "-m", "ckpttool", "diff", str(a), str(b)],
        "peer (dcp.load + torch)": [sys.executable, "-c", PEER, str(a), str(b)],
    }
    # (diff exits 1: the checkpoints differ; the peer must exit 0)
    results, med = _bench.alternate(cmds, args.repeat, lambda name: None, ok={"ckpttool diff": (0, 1)})
    for name, (wall, rss) in med.items():
        print(f"{name:26s} wall {wall:6.2f} s   peak RSS {rss / 1e6:8.1f} MB   {size / wall / 1e9:5.2f} GB/s")
    ours, peer = med["ckpttool diff"], med["peer (dcp.load + torch)"]
    print(f"diff: {peer[0] / ours[0]:.2f}x the peer's speed at {ours[1] / peer[1]:.2f}x its memory "
          f"({size / 1e9:.2f} GB)")
    DATA.mkdir(exist_ok=True)
    (DATA / "diff.json").write_text(json.dumps({"bytes": size, **_bench.as_json(results, med)}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
