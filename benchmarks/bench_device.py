"""reshard --device cuda against --device cpu and ``cp -r``, on the same >= 1 GB DCP checkpoints, in
one run (needs a CUDA device; on the H200 machine of docs/benchmarks.md).

    python benchmarks/bench_device.py [--layers 24] [--repeat 3] [--json PATH]

Two real checkpoints (``_make_big_dcp.py``: FSDP2 over 2 gloo ranks, one AdamW step, dcp.save;
2048 x 2048 fp32 weights): ``rows``, sharded along dim 0 as FSDP2 does by default, and ``cols``,
sharded along dim 1, so that writing them at 4 ranks (rows) cuts every source piece across and
places it into strided columns. For each, hot page cache, each command in a fresh process, taking
turns, ``sync`` before each:

* ``cp -r`` followed by ``sync``;
* ``ckpttool reshard --dp 4`` with ``--device cpu`` and ``--device cuda`` (``--workers 1`` and 2);
* ``python -c "import torch; torch.zeros(1, device='cuda')"``: the fixed cost of ``--device cuda``
  (the CPU path does not import torch), subtracted for a second ratio.

Then, in this process, the assembly alone: every tensor of ``cols`` built as the 4 row boxes a
world of 4 holds, from the page cache, by numpy and by the GPU (``ckpttool.device``), into the same
pinned buffer; GB/s of tensor bytes. The outputs of both devices are compared file by file.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from _bench import alternate, as_json, make_once, warm  # the folder beside this script

HERE = Path(__file__).resolve().parent
DATA = HERE / "_data"
WIDTH = 2048


def make(layers: int, placement: str) -> Path:
    name = f"dcp_{WIDTH}x{layers}" + ("_cols" if placement == "cols" else "")
    return make_once(DATA / name, ".metadata", HERE / "_make_big_dcp.py", WIDTH, layers, placement)


def bench(ckpt: Path, repeat: int) -> dict[str, object]:
    size = warm(ckpt)
    outs = {d: DATA / f"device_out_{d}" for d in ("cpu", "cuda")}
    sink = DATA / "device_cp"
    cmds: dict[str, list[str]] = {
        "cp -r": ["sh", "-c", 'cp -r "$0" "$1" && sync', str(ckpt), str(sink)],
        # what --device cuda pays before any work: importing torch (the CPU path never does) and
        # starting CUDA
        "torch + CUDA start": [sys.executable, "-c", "import torch; torch.zeros(1, device='cuda')"],
    }
    for dev in ("cpu", "cuda"):
        for w in (1, 2):
            cmds[f"{dev} --workers {w}"] = [
                sys.executable, "-m", "ckpttool", "reshard", str(ckpt), "-o", str(outs[dev]), "--dp", "4", "-q",
                "--device", dev, "--workers", str(w),
            ]  # fmt: skip

    def reset(_: str) -> None:
        for p in (*outs.values(), sink):
            shutil.rmtree(p, ignore_errors=True)

    results, med = alternate(cmds, repeat, reset)
    # one more of each device, kept, to compare their files
    reset("")
    for dev in ("cpu", "cuda"):
        subprocess.run(cmds[f"{dev} --workers 1"], check=True)
    same = _same_files(outs["cpu"], outs["cuda"])
    reset("")
    for name, (wall, rss) in med.items():
        print(f"  {name:18s} wall {wall:6.2f} s   peak RSS {rss / 1e6:8.1f} MB   {size / wall / 1e9:5.2f} GB/s")
    return {
        "checkpoint_bytes": size,
        **as_json(results, med),
        "cuda_vs_cpu": med["cpu --workers 1"][0] / med["cuda --workers 1"][0],
        "cuda_vs_cpu_workers2": med["cpu --workers 2"][0] / med["cuda --workers 2"][0],
        "cuda_vs_cp": med["cp -r"][0] / med["cuda --workers 1"][0],
        "cuda_start_s": med["torch + CUDA start"][0],
        "cuda_less_start_vs_cpu": med["cpu --workers 1"][0]
        / (med["cuda --workers 1"][0] - med["torch + CUDA start"][0]),
        "cpu_vs_cp": med["cp -r"][0] / med["cpu --workers 1"][0],
        "same_files": same,
    }


def _same_files(a: Path, b: Path) -> bool:
    """The two outputs hold the same files, byte for byte, their seals aside (which carry a time)."""
    names = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file() and p.name != "ckpttool.manifest.json")
    theirs = sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file() and p.name != "ckpttool.manifest.json")
    _, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    return names == theirs and not mismatch and not errors


def assembly(ckpt: Path, rounds: int = 3) -> dict[str, float]:
    """GB/s of building every tensor's 4 row boxes, numpy against the GPU (best of ``rounds``)."""
    import numpy as np

    from ckpttool import device, registry
    from ckpttool.assemble import assemble
    from ckpttool.dtypes import carrier
    from ckpttool.geometry import Box

    adapter, manifest = registry.describe(ckpt)
    items = [i for i in manifest.items.values() if i.is_tensor and i.shape and i.pieces]
    jobs = []
    for item in items:
        rows = item.shape[0]
        for r in range(4):
            lo, hi = rows * r // 4, rows * (r + 1) // 4
            if hi > lo:
                jobs.append((item, Box((lo, *[0] * (len(item.shape) - 1)), (hi - lo, *item.shape[1:]))))
    total = sum(b.volume * carrier(i.dtype).itemsize for i, b in jobs)
    biggest = max(b.volume * carrier(i.dtype).itemsize for i, b in jobs)
    best: dict[str, float] = {}
    with adapter.reader(manifest) as reader:
        for name in ("cpu", "cuda"):
            with device.using(device.resolve(name)) as on:
                buf = on.host_empty(biggest) if on is not None else np.empty(biggest, dtype=np.uint8)
                times = []
                for _ in range(rounds):
                    t = time.perf_counter()
                    for item, box in jobs:
                        n = box.volume * carrier(item.dtype).itemsize
                        out = buf[:n].view(carrier(item.dtype)).reshape(box.sizes)
                        assemble(reader, item, out=out, box=box)
                    times.append(time.perf_counter() - t)
                best[name] = total / min(times) / 1e9
    print(f"  assembly alone ({total / 1e9:.2f} GB): numpy {best['cpu']:.2f} GB/s, GPU {best['cuda']:.2f} GB/s")
    return {"bytes": total, "numpy_gb_s": best["cpu"], "cuda_gb_s": best["cuda"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", type=Path, default=DATA / "device.json")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    DATA.mkdir(exist_ok=True)
    report: dict[str, object] = {
        "cpus": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "checkpoints": {},
    }
    for placement in ("rows", "cols"):
        ckpt = make(args.layers, placement)
        print(f"{ckpt.name}:")
        s = bench(ckpt, args.repeat)
        if placement == "cols":
            s["assembly"] = assembly(ckpt)
        report["checkpoints"][placement] = s  # type: ignore[index]
        print(
            f"  cuda {s['cuda_vs_cpu']:.2f}x cpu (workers 2: {s['cuda_vs_cpu_workers2']:.2f}x), "
            f"cuda {s['cuda_vs_cp']:.2f}x cp, cpu {s['cpu_vs_cp']:.2f}x cp, same files: {s['same_files']}; "
            f"less torch's import and CUDA's start ({s['cuda_start_s']:.2f} s), "
            f"cuda is {s['cuda_less_start_vs_cpu']:.2f}x cpu"
        )
    args.json.write_text(json.dumps(report, indent=2))
    return 0 if all(s["same_files"] for s in report["checkpoints"].values()) else 1  # type: ignore[attr-defined]


if __name__ == "__main__":
    sys.exit(main())
