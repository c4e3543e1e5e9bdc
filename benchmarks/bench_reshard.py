"""reshard of >= 1 GB DCP checkpoints (FSDP2, 2 ranks -> 4) against `cp -r` of the same bytes and
torch's dcp_to_torch_save, and peak memory as the checkpoint grows.

    python benchmarks/bench_reshard.py [--layers 24 96] [--repeat 3] [--keep] [--buffered]
                                       [--workers 1 2] [--out-dir DIR]

For each size (``--layers``: 24 -> 1.2 GB, 96 -> 4.8 GB; same 2048x2048 tensors, so the largest
tensor stays 16.8 MB), the checkpoint is made under benchmarks/_data/ (git-ignored) by
``_make_big_dcp.py`` (real FSDP2 + dcp.save), read once to warm the page cache, then each command
runs in a fresh process, alternating, with ``sync`` before each run and no old output:

* ``cp -r`` of the checkpoint followed by ``sync`` (the machine's durable copy speed for these
  bytes: ckpttool fsyncs its output before publishing it);
* ``ckpttool reshard --dp 4`` with ``--workers 1`` and ``--workers 2`` (or each of ``--workers``;
  output sealed, fsynced, published by rename: the product's defaults);
* ``dcp_to_torch_save`` (torch's offline conversion; on the smallest size only);
* with ``--buffered``, ``--workers 1`` again with ``CKPTTOOL_DIRECT_WRITE=0``: outputs written
  through the page cache instead of around it (ckpttool/_directwrite.py).

Outputs (the copy's too) go to ``--out-dir`` (default benchmarks/_data/): on a tmpfs such as
/dev/shm the disk drops out and what is left is the processes' own work.

Wall time and peak RSS (``ru_maxrss`` of the child; with ``--workers 2`` the largest process).
Medians and ratios are printed and written to benchmarks/_data/reshard.json. Targets (issue 6):
reshard >= 0.5x the throughput of cp; peak RSS <= 2x largest tensor + 300 MB at every size;
>= 2x faster than dcp_to_torch_save at <= 1/4 its memory; --workers 2 >= 1.6x --workers 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from _bench import alternate, as_json, make_once, warm  # the folder beside this script

HERE = Path(__file__).resolve().parent
DATA = HERE / "_data"
WIDTH = 2048


def make(layers: int) -> Path:
    return make_once(DATA / f"dcp_{WIDTH}x{layers}", ".metadata", HERE / "_make_big_dcp.py", WIDTH, layers)


def bench(
    ckpt: Path, repeat: int, peer: bool, buffered: bool = False, workers: tuple[int, ...] = (1, 2), into: Path = DATA
) -> dict[str, object]:
    size = warm(ckpt)
    out = into / "reshard_out"
    peer_out = into / "reshard_peer.pt"
    ours = [sys.executable, "-m", "ckpttool", "reshard", str(ckpt), "-o", str(out), "--dp", "4", "-q"]
    cmds = {
        # ckpttool fsyncs what it publishes; the copy is made as durable with a sync after it
        "cp -r": ["sh", "-c", 'cp -r "$0" "$1" && sync', str(ckpt), str(out)],
        **{f"reshard --workers {w}": [*ours, "--workers", str(w)] for w in sorted({1, 2, *workers})},
    }
    if buffered:  # the same as --workers 1, its outputs written through the page cache
        cmds["reshard, buffered writes"] = ["env", "CKPTTOOL_DIRECT_WRITE=0", *ours, "--workers", "1"]
    if peer:
        cmds["dcp_to_torch_save"] = [
            sys.executable, "-c",
            "import sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
            "dcp_to_torch_save(sys.argv[1], sys.argv[2])", str(ckpt), str(peer_out),
        ]
    def reset(_: str) -> None:
        shutil.rmtree(out, ignore_errors=True)
        peer_out.unlink(missing_ok=True)

    results, med = alternate(cmds, repeat, reset)
    reset("")
    for name, (wall, rss) in med.items():
        print(f"  {name:22s} wall {wall:6.2f} s   peak RSS {rss / 1e6:8.1f} MB   {size / wall / 1e9:5.2f} GB/s")
    largest = WIDTH * WIDTH * 4
    bound = 2 * largest + 300e6
    summary: dict[str, object] = {
        "checkpoint_bytes": size,
        "largest_tensor_bytes": largest,
        "rss_bound": bound,
        **as_json(results, med),
        "vs_cp": med["cp -r"][0] / med["reshard --workers 1"][0],
        "vs_cp_workers2": med["cp -r"][0] / med["reshard --workers 2"][0],
        "workers2_speedup": med["reshard --workers 1"][0] / med["reshard --workers 2"][0],
        "rss_workers1": med["reshard --workers 1"][1],
    }
    for w in workers:
        if w > 2:
            summary[f"workers{w}_speedup"] = med["reshard --workers 1"][0] / med[f"reshard --workers {w}"][0]
    if buffered:
        summary["direct_speedup"] = med["reshard, buffered writes"][0] / med["reshard --workers 1"][0]
    if peer:
        summary["vs_peer_speed"] = med["dcp_to_torch_save"][0] / med["reshard --workers 1"][0]
        summary["vs_peer_memory"] = med["reshard --workers 1"][1] / med["dcp_to_torch_save"][1]
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[24, 96])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="keep the larger checkpoints")
    ap.add_argument("--buffered", action="store_true", help="also --workers 1 with CKPTTOOL_DIRECT_WRITE=0")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="the --workers to time (1 and 2 always)")
    ap.add_argument("--out-dir", type=Path, default=DATA, help="where the outputs go (a tmpfs leaves the disk out)")
    args = ap.parse_args()
    DATA.mkdir(exist_ok=True)
    report: dict[str, object] = {"cpus": os.cpu_count(), "sizes": {}}
    ok = True
    for k, layers in enumerate(args.layers):
        ckpt = make(layers)
        print(f"{ckpt.name}:")
        s = bench(ckpt, args.repeat, peer=k == 0, buffered=args.buffered, workers=tuple(args.workers),
                  into=args.out_dir)
        report["sizes"][ckpt.name] = s  # type: ignore[index]
        print(f"  {s['checkpoint_bytes'] / 1e9:.2f} GB: reshard {s['vs_cp']:.2f}x cp (workers 2: "
              f"{s['vs_cp_workers2']:.2f}x), --workers 2 {s['workers2_speedup']:.2f}x --workers 1, peak RSS "
              f"{s['rss_workers1'] / 1e6:.0f} MB (bound {s['rss_bound'] / 1e6:.0f} MB)"
              + (f", {s['vs_peer_speed']:.1f}x faster than dcp_to_torch_save at {s['vs_peer_memory']:.2f}x its memory"
                 if "vs_peer_speed" in s else "")
              + (f"; direct writes {s['direct_speedup']:.2f}x buffered" if "direct_speedup" in s else "")
              + "".join(f"; --workers {w} {s[f'workers{w}_speedup']:.2f}x --workers 1" for w in args.workers if w > 2))
        ok &= s["vs_cp"] >= 0.5 and s["rss_workers1"] <= s["rss_bound"]  # type: ignore[operator]
        ok &= s["workers2_speedup"] >= 1.6  # type: ignore[operator]
        if "vs_peer_speed" in s:
            ok &= s["vs_peer_speed"] >= 2 and s["vs_peer_memory"] <= 0.25  # type: ignore[operator]
        if not args.keep and k > 0:
            shutil.rmtree(ckpt)
    (DATA / "reshard.json").write_text(json.dumps(report, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
