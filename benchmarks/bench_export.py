"""export and convert --to torch of a >= 1 GB DCP checkpoint against torch's dcp_to_torch_save on the
same files.

    python benchmarks/bench_export.py [--width 2048] [--layers 24] [--repeat 3] [--keep]

Writes the checkpoint under benchmarks/_data/ (git-ignored), then alternates the three commands, each
in a fresh process (what a user runs), hot page cache for both (the files are read once before
timing), no output file left from an earlier run and no dirty pages (``sync`` before each run).
ckpttool fsyncs its output before publishing it; dcp_to_torch_save does not. Wall time and peak RSS
(ru_maxrss of the child) per run; medians and ratios printed and saved to
benchmarks/_data/export.json. ``convert --to torch`` writes the file dcp_to_torch_save writes: the
script checks the bytes are the same.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from _bench import alternate, make_once, warm  # the folder beside this script

HERE = Path(__file__).resolve().parent
DATA = HERE / "_data"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and outputs")
    args = ap.parse_args()

    DATA.mkdir(exist_ok=True)
    ckpt = make_once(DATA / f"dcp_{args.width}x{args.layers}", ".metadata", HERE / "_make_big_dcp.py", args.width,
                     args.layers)  # fmt: skip
    size = warm(ckpt)  # a hot page cache for both tools alike

    ours_out, theirs_out, pt_dir = DATA / "ours.safetensors", DATA / "theirs" / "model.pt", DATA / "ours_pt"
    theirs_out.parent.mkdir(exist_ok=True)
    ours_cmd = [sys.executable, "-m", "ckpttool", "export", str(ckpt), "-o", str(ours_out), "--force", "-q"]
    # (--no-seal: the same job as the peer's, which hashes nothing; sealed, the file is read back once more)
    pt_cmd = [sys.executable, "-m", "ckpttool", "convert", str(ckpt), "-o", str(pt_dir), "--to", "torch", "-q",
              "--no-seal"]  # fmt: skip
    theirs_cmd = [sys.executable, "-c",
                  "import sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
                  "dcp_to_torch_save(sys.argv[1], sys.argv[2])", str(ckpt), str(theirs_out)]
    cmds = {"dcp_to_torch_save": theirs_cmd, "ckpttool export": ours_cmd, "convert --to torch": pt_cmd}
    outs = {"dcp_to_torch_save": theirs_out, "ckpttool export": ours_out, "convert --to torch": pt_dir}

    def reset(name: str) -> None:  # no old output to replace
        out = outs[name]
        shutil.rmtree(out) if out.is_dir() else out.unlink(missing_ok=True)

    results, med = alternate(cmds, args.repeat, reset)
    same = (pt_dir / "model.pt").read_bytes() == theirs_out.read_bytes()
    print(f"convert --to torch wrote the same bytes as dcp_to_torch_save: {same}")
    out_size = ours_out.stat().st_size
    summary = {
        "checkpoint_bytes": size,
        "output_bytes": out_size,
        "cpus": os.cpu_count(),
        "runs": {k: [{"wall_s": w, "peak_rss": r} for w, r in v] for k, v in results.items()},
    }
    for name, (wall, rss) in med.items():
        print(f"{name:20s} wall {wall:6.2f} s   peak RSS {rss / 1e6:8.1f} MB   {size / wall / 1e9:5.2f} GB/s")
    speed = med["dcp_to_torch_save"][0] / med["ckpttool export"][0]
    mem = med["ckpttool export"][1] / med["dcp_to_torch_save"][1]
    print(f"checkpoint {size / 1e9:.2f} GB: ckpttool is {speed:.1f}x faster at {mem:.2f}x the peak memory "
          f"(target >= 2x faster at <= 0.25x memory)")
    summary["median"] = {k: {"wall_s": w, "peak_rss": r} for k, (w, r) in med.items()}
    summary["speedup"], summary["memory_ratio"] = speed, mem
    pt_speed = med["dcp_to_torch_save"][0] / med["convert --to torch"][0]
    pt_mem = med["convert --to torch"][1] / med["dcp_to_torch_save"][1]
    print(f"convert --to torch (the same file as dcp_to_torch_save): {pt_speed:.1f}x faster at {pt_mem:.2f}x "
          "the peak memory")
    summary["torch_speedup"], summary["torch_memory_ratio"], summary["torch_identical"] = pt_speed, pt_mem, same
    (DATA / "export.json").write_text(json.dumps(summary, indent=2))
    if not args.keep:
        ours_out.unlink(missing_ok=True)
        theirs_out.unlink(missing_ok=True)
        shutil.rmtree(pt_dir, ignore_errors=True)
    return 0 if speed >= 2 and mem <= 0.25 and same else 1


if __name__ == "__main__":
    sys.exit(main())
