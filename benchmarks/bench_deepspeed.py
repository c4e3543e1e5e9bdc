"""ckpttool on a real DeepSpeed ZeRO-2 checkpoint of about 1 GB, against DeepSpeed's zero_to_fp32 and
``cp -r`` of the same bytes.

    pip install deepspeed   # benchmark-only (DS_ACCELERATOR=cpu, DS_BUILD_OPS=0)
    python benchmarks/bench_deepspeed.py [--layers 16] [--repeat 3]

The checkpoint is made under benchmarks/_data/ (git-ignored) by ``_make_big_ds.py``: ``--layers``
Linear(2048, 2048) layers, one real AdamW step under DeepSpeed on 2 gloo ranks (16 bytes per
parameter: fp32 weights, fp32 partitions and both moments; 16 layers give 1.07 GB). It is read
once to warm the page cache; then each command runs in a fresh process, alternating, with ``sync``
before each run and no old output:

* ``cp -r`` followed by ``sync`` (ckpttool fsyncs what it publishes);
* ``ckpttool reshard --dp 1``: the whole training state at DP=1 (ZeRO-2 files DeepSpeed's
  ``load_checkpoint`` resumes from), sealed and published;
* ``ckpttool export --kind master``: the fp32 weights the optimizer holds, as one safetensors
  file: what zero_to_fp32 produces;
* DeepSpeed's ``convert_zero_checkpoint_to_fp32_state_dict`` (zero_to_fp32; it does not fsync).

Wall time and peak RSS (``ru_maxrss`` of the child), medians printed and written to
benchmarks/_data/deepspeed.json. Targets (issue 6): against zero_to_fp32 >= 2x faster at <= 1/4 of
its peak memory; reshard >= 0.5x the throughput of cp.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from _bench import alternate, make_once, warm  # the folder beside this script

HERE = Path(__file__).resolve().parent
DATA = HERE / "_data"
WIDTH = 2048


def make(layers: int) -> Path:
    env = {"DS_ACCELERATOR": "cpu", "DS_BUILD_OPS": "0"}
    return make_once(DATA / f"ds_zero2_{WIDTH}x{layers}", "latest", HERE / "_make_big_ds.py", WIDTH, layers, env=env)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    DATA.mkdir(exist_ok=True)
    ckpt = make(args.layers)
    size = warm(ckpt)
    out = DATA / "ds_out"
    env_py = [sys.executable]
    cmds = {
        "cp -r": ["sh", "-c", 'cp -r "$0" "$1" && sync', str(ckpt), str(out)],
        "reshard --dp 1": [*env_py, "-m", "ckpttool", "reshard", str(ckpt), "-o", str(out), "--dp", "1", "-q"],
        "export --kind master": [*env_py, "-m", "ckpttool", "export", str(ckpt), "-o", str(out / "model.safetensors"),
                                 "--kind", "master", "-q"],
        "zero_to_fp32": [
            *env_py, "-c",
            "import os, sys; os.environ.setdefault('DS_ACCELERATOR', 'cpu'); "
            "from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict as c; "
            "c(sys.argv[1], sys.argv[2])", str(ckpt), str(out),
        ],
    }  # fmt: skip
    def reset(name: str) -> None:
        shutil.rmtree(out, ignore_errors=True)
        if name == "export --kind master":
            out.mkdir()

    results, med = alternate(cmds, args.repeat, reset)
    shutil.rmtree(out, ignore_errors=True)
    print(f"{ckpt.name}: {size / 1e9:.2f} GB")
    for name, (wall, rss) in med.items():
        print(f"  {name:22s} wall {wall:6.2f} s   peak RSS {rss / 1e6:8.1f} MB   {size / wall / 1e9:5.2f} GB/s")
    z = med["zero_to_fp32"]
    summary = {
        "checkpoint_bytes": size,
        "runs": {k: [{"wall_s": w, "peak_rss": r} for w, r in v] for k, v in results.items()},
        "median": {k: {"wall_s": w, "peak_rss": r} for k, (w, r) in med.items()},
        "reshard_vs_cp": med["cp -r"][0] / med["reshard --dp 1"][0],
        "export_vs_zero_to_fp32_speed": z[0] / med["export --kind master"][0],
        "export_vs_zero_to_fp32_memory": med["export --kind master"][1] / z[1],
        "reshard_vs_zero_to_fp32_speed": z[0] / med["reshard --dp 1"][0],
        "reshard_vs_zero_to_fp32_memory": med["reshard --dp 1"][1] / z[1],
    }
    print(
        f"  reshard {summary['reshard_vs_cp']:.2f}x cp; against zero_to_fp32: export "
        f"{summary['export_vs_zero_to_fp32_speed']:.1f}x faster at {summary['export_vs_zero_to_fp32_memory']:.2f}x "
        f"its memory, reshard {summary['reshard_vs_zero_to_fp32_speed']:.1f}x at "
        f"{summary['reshard_vs_zero_to_fp32_memory']:.2f}x"
    )
    (DATA / "deepspeed.json").write_text(json.dumps(summary, indent=2))
    ok = summary["export_vs_zero_to_fp32_speed"] >= 2 and summary["export_vs_zero_to_fp32_memory"] <= 0.25
    return 0 if ok and summary["reshard_vs_cp"] >= 0.5 else 1


if __name__ == "__main__":
    raise SystemExit(main())
