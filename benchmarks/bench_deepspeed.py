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

``--stage 3`` does the same on a ZeRO-3 checkpoint of the same model (``deepspeed3.json``), with
two more pairs: ``reshard --to deepspeed-universal`` against DeepSpeed's ``ds_to_universal`` (its
default workers; the peak RSS is the largest of its processes), and ``reshard --zero-stage 2 --dp
1`` (the ZeRO-3 run as ZeRO-2 files, which DeepSpeed has no tool for) against cp.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from _bench import alternate, as_json, make_once, warm  # the folder beside this script

HERE = Path(__file__).resolve().parent
DATA = HERE / "_data"
WIDTH = 2048


def make(layers: int, stage: int) -> Path:
    env = {"DS_ACCELERATOR": "cpu", "DS_BUILD_OPS": "0"}
    ckpt = DATA / f"ds_zero{stage}_{WIDTH}x{layers}"
    return make_once(ckpt, "latest", HERE / "_make_big_ds.py", WIDTH, layers, stage, env=env)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--stage", type=int, choices=(2, 3), default=2)
    args = ap.parse_args()
    DATA.mkdir(exist_ok=True)
    ckpt = make(args.layers, args.stage)
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
    if args.stage == 3:
        tag = (ckpt / "latest").read_text().strip()
        cmds["reshard --zero-stage 2 --dp 1"] = [*env_py, "-m", "ckpttool", "reshard", str(ckpt), "-o", str(out),
                                                 "--zero-stage", "2", "--dp", "1", "-q"]
        cmds["reshard --to deepspeed-universal"] = [*env_py, "-m", "ckpttool", "reshard", str(ckpt), "-o", str(out),
                                                    "--to", "deepspeed-universal", "-q"]
        cmds["ds_to_universal"] = [
            "env", "DS_ACCELERATOR=cpu", *env_py, "-m", "deepspeed.checkpoint.ds_to_universal",
            "--input_folder", str(ckpt / tag), "--output_folder", str(out / f"{tag}_universal"),
            "--inject_missing_state",
        ]

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
        **as_json(results, med),
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
    if args.stage == 3:
        u, d = med["reshard --to deepspeed-universal"], med["ds_to_universal"]
        summary["universal_vs_ds_to_universal_speed"] = d[0] / u[0]
        summary["universal_vs_ds_to_universal_memory"] = u[1] / d[1]
        summary["zero_stage_2_vs_cp"] = med["cp -r"][0] / med["reshard --zero-stage 2 --dp 1"][0]
        print(
            f"  against ds_to_universal: {summary['universal_vs_ds_to_universal_speed']:.1f}x faster at "
            f"{summary['universal_vs_ds_to_universal_memory']:.2f}x its memory; --zero-stage 2 "
            f"{summary['zero_stage_2_vs_cp']:.2f}x cp"
        )
    (DATA / ("deepspeed.json" if args.stage == 2 else "deepspeed3.json")).write_text(json.dumps(summary, indent=2))
    ok = summary["export_vs_zero_to_fp32_speed"] >= 2 and summary["export_vs_zero_to_fp32_memory"] <= 0.25
    return 0 if ok and summary["reshard_vs_cp"] >= 0.5 else 1


if __name__ == "__main__":
    raise SystemExit(main())
