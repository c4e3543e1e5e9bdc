"""reshard of a real Megatron legacy checkpoint of about 1 GB (TP=2 x PP=2 -> TP=1 x PP=1), and of
the torch_dist save of the same state to legacy, against ``cp -r`` of the same bytes.

    MEGATRON_LM=/path/to/Megatron-LM python benchmarks/bench_megatron.py [--layers 6] [--repeat 3]

The checkpoint is made once under benchmarks/_data/ (git-ignored) by the fixtures' own worker
(``fixtures/_megatron_worker.py``: megatron-core 0.16.1 and Megatron-LM's ``save_checkpoint`` at
tag core_v0.16.1, on CPU under torchrun with 4 gloo ranks), with the fixtures' GPT model
made bigger: hidden 1024, SwiGLU FFN 4096, 8 heads in 2 query groups, ``--layers`` layers; bf16
weights with fp32 main copies and both Adam moments (14 bytes per parameter). Each command then
runs in a fresh process, alternating, hot page cache, ``sync`` before each run:

* ``cp -r`` followed by ``sync``;
* ``ckpttool reshard --tp 1 --pp 1`` (Megatron legacy, optimizer and RNG carried, sealed);
* ``ckpttool reshard --tp 1 --pp 1 --to megatron-dist`` (torch_dist);
* ``cp -r`` of the run's torch_dist save, and ``ckpttool reshard --tp 1 --pp 1 --to megatron`` of it
  (torch_dist -> legacy: module order, param groups and RNG records rebuilt).

Wall time and peak RSS, medians printed and written to benchmarks/_data/megatron.json. Targets
(issue 6): >= 0.5x the throughput of cp; peak RSS <= 2x the largest tensor + 300 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _bench import alternate, as_json, warm  # the folder beside this script

HERE = Path(__file__).resolve().parent
DATA = HERE / "_data"
FIXTURES = HERE.parent / "fixtures"
HIDDEN, FFN = 1024, 4096
MODEL = f"hidden-size={HIDDEN},ffn-hidden-size={FFN},num-attention-heads=8,num-query-groups=2,kv-channels=128"


def make(layers: int) -> tuple[Path, Path]:
    """The run's legacy and torch_dist saves (one run saves both)."""
    ckpt = DATA / f"megatron_tp2pp2_{HIDDEN}x{layers}"
    dist = DATA / f"megatron_dist_tp2pp2_{HIDDEN}x{layers}"
    if all((d / "latest_checkpointed_iteration.txt").exists() for d in (ckpt, dist)):
        return ckpt, dist
    shutil.rmtree(ckpt, ignore_errors=True)
    shutil.rmtree(dist, ignore_errors=True)
    sys.path.insert(0, str(FIXTURES))
    from make_megatron_fixtures import resolve_megatron_lm  # the fixtures' own Megatron-LM set-up

    with tempfile.TemporaryDirectory(prefix="ckpttool-bench-megatron-") as scratch:
        mlm = resolve_megatron_lm(os.environ.get("MEGATRON_LM"), scratch)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
               "CKPTTOOL_MEGATRON_MODEL": f"num-layers={layers},{MODEL}"}  # fmt: skip
        t = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
             str(FIXTURES / "_megatron_worker.py"), "--mode", "train", "--megatron-lm", mlm, "--scratch", scratch,
             "--tag", "bench", "--tp", "2", "--pp", "2", "--save", f"torch={ckpt}", f"torch_dist={dist}"],
            check=True, env=env, cwd=scratch,
        )  # fmt: skip
        print(f"made {ckpt} and {dist} in {time.perf_counter() - t:.1f} s")
    return ckpt, dist


def read_all(dist: Path, repeat: int = 3) -> float:
    """Seconds (best of ``repeat``, hot cache) to read every tensor of the torch_dist save into
    memory through ckpttool's reader, nothing written: the read side of torch_dist -> legacy."""
    import numpy as np

    from ckpttool.assemble import assemble
    from ckpttool.dtypes import carrier
    from ckpttool.formats.megatron import MegatronDistReader
    from ckpttool.registry import describe

    _, m = describe(dist)
    items = [i for i in m.items.values() if i.is_tensor and i.shape is not None and i.pieces[0].file != "common.pt"]
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        with MegatronDistReader(m) as reader:
            for item in items:
                assemble(reader, item, np.empty(item.shape, dtype=carrier(item.dtype or "")))
        best = min(best, time.perf_counter() - t)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    DATA.mkdir(exist_ok=True)
    ckpt, dist = make(args.layers)
    size = warm(ckpt)
    dist_size = warm(dist)
    out = DATA / "megatron_out"
    ours = [sys.executable, "-m", "ckpttool", "reshard", str(ckpt), "-o", str(out), "--tp", "1", "--pp", "1", "-q"]
    cmds = {
        "cp -r": ["sh", "-c", 'cp -r "$0" "$1" && sync', str(ckpt), str(out)],
        "reshard --tp 1 --pp 1": ours,
        "reshard ... --to megatron-dist": [*ours, "--to", "megatron-dist"],
        "cp -r (torch_dist)": ["sh", "-c", 'cp -r "$0" "$1" && sync', str(dist), str(out)],
        "reshard torch_dist --to megatron": [
            sys.executable, "-m", "ckpttool", "reshard", str(dist), "-o", str(out), "--tp", "1", "--pp", "1",
            "--to", "megatron", "-q",
        ],
    }  # fmt: skip
    results, med = alternate(cmds, args.repeat, lambda _: shutil.rmtree(out, ignore_errors=True))
    shutil.rmtree(out, ignore_errors=True)
    largest = HIDDEN * 2 * FFN * 4  # SwiGLU fc1 at TP=1, fp32 main copy
    bound = 2 * largest + 300e6
    print(f"{ckpt.name}: {size / 1e9:.2f} GB, largest tensor {largest / 1e6:.1f} MB, RSS bound {bound / 1e6:.0f} MB")
    read_s = read_all(dist)
    rate = dist_size / read_s / 1e9
    print(f"{dist.name}: {dist_size / 1e9:.2f} GB; every tensor read in {read_s:.2f} s ({rate:.2f} GB/s)")
    for name, (wall, rss) in med.items():
        nbytes = dist_size if "torch_dist" in name else size
        print(f"  {name:34s} wall {wall:6.2f} s   peak RSS {rss / 1e6:8.1f} MB   {nbytes / wall / 1e9:5.2f} GB/s")
    summary = {
        "checkpoint_bytes": size,
        "torch_dist_bytes": dist_size,
        "torch_dist_read_s": read_s,
        "largest_tensor_bytes": largest,
        "rss_bound": bound,
        **as_json(results, med),
        "legacy_vs_cp": med["cp -r"][0] / med["reshard --tp 1 --pp 1"][0],
        "dist_vs_cp": med["cp -r"][0] / med["reshard ... --to megatron-dist"][0],
        "from_dist_vs_cp": med["cp -r (torch_dist)"][0] / med["reshard torch_dist --to megatron"][0],
    }
    print(
        f"  reshard {summary['legacy_vs_cp']:.2f}x cp (to megatron-dist {summary['dist_vs_cp']:.2f}x; "
        f"torch_dist to megatron {summary['from_dist_vs_cp']:.2f}x its cp)"
    )
    (DATA / "megatron.json").write_text(json.dumps(summary, indent=2))
    worst = max(r for name, (_, r) in med.items() if not name.startswith("cp"))
    ratios = (summary["legacy_vs_cp"], summary["dist_vs_cp"], summary["from_dist_vs_cp"])
    return 0 if min(ratios) >= 0.5 and worst <= bound else 1


if __name__ == "__main__":
    raise SystemExit(main())
