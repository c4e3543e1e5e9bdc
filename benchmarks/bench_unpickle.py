"""The cost of reading a pickle safely: ckpttool's walk over the opcodes, its whole load, and torch's.

    python benchmarks/bench_unpickle.py                    # 20 000 x 8 and 100 000 x 4 chunks
    python benchmarks/bench_unpickle.py --sizes 5000x4     # a quick one

Each size is a DCP ``.metadata`` pickled with torch's own classes (tensors x chunks, FSDP-like
names, a ``_StorageInfo`` per chunk), written once under ``benchmarks/_data/``. For each, best
of ``--repeat`` runs in this process:

* ``walk``: :func:`ckpttool._unpickle._opcode_problem`, the pass over the opcodes that refuses
  memo-index bombs, lengths past the end and keys whose hashing would never finish, before the
  unpickler sees the bytes;
* ``load``: ``_unpickle.loads`` with the DCP allowlist (the walk, the C unpickler with stand-ins,
  the tree check), what ``inspect`` spends on the metadata;
* ``torch``: ``pickle.load`` with torch's classes, what ``dcp.load`` spends on it.

Prints a Markdown table with the ratios walk / load and load / torch. At a commit before session
77 the walk is the memo-index check it replaced (``_memo_bomb``), for an A/B of the two.
"""

from __future__ import annotations

import argparse
import pickle
import pickletools
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from ckpttool import _unpickle  # noqa: E402
from ckpttool.formats import dcp  # noqa: E402


def metadata(tensors: int, chunks: int) -> bytes:
    path = HERE / "_data" / f"metadata_{tensors}x{chunks}.pkl"
    if path.exists():
        return path.read_bytes()
    from ckpttool.formats.dcp_write import _torch_metadata
    from ckpttool.geometry import Box

    keys: dict = {"step": None}
    records: dict = {}
    planner: dict = {"step": ("step",)}
    for t in range(tensors):
        name = f"model.layers.{t // 12}.mlp.w{t % 12}.weight"
        planner[name] = tuple(name.split("."))
        keys[name] = ("float32", (64 * chunks, 64), [Box((s * 64, 0), (64, 64)) for s in range(chunks)])
        for s in range(chunks):
            records.setdefault(f"__{(t * chunks + s) % 1000}_0.distcp", []).append(
                (name, (s * 64, 0), t * 1000, 1000, s)
            )
    data = pickle.dumps(_torch_metadata(keys, records, planner, "/ckpt"))  # (as FileSystemWriter.finish: pickle.dump)
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(data)
    return data


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="20000x8,100000x4", help="tensors x chunks, comma-separated")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    import torch.distributed.checkpoint.filesystem  # noqa: F401  (torch's classes, for its pickle.loads)

    check = getattr(_unpickle, "_opcode_problem", None) or _unpickle._memo_bomb  # (_memo_bomb: before session 77)
    rows = []
    for size in args.sizes.split(","):
        tensors, chunks = (int(v) for v in size.split("x"))
        data = metadata(tensors, chunks)
        assert check(data) is None
        walk = best(lambda data=data: check(data), args.repeat)
        load = best(lambda data=data: _unpickle.loads(data, allow=dcp.METADATA_ALLOWLIST, source="x"), args.repeat)
        ref = best(lambda data=data: pickle.loads(data), args.repeat)
        ops = sum(1 for _ in pickletools.genops(data)) if len(data) < (40 << 20) else None
        assert walk < load, (walk, load)  # (the check is a fraction of the load it guards: a walk gone quadratic)
        rows.append((tensors * chunks, len(data), ops, walk, load, ref))
    print("| chunks | .metadata | opcodes | walk | load (ckpttool) | walk / load | torch pickle.load | load / torch |")
    print("|---|---|---|---|---|---|---|---|")
    for n, size, ops, walk, load, ref in rows:
        count = f"{ops / 1e6:.1f} M" if ops else "-"
        print(
            f"| {n:,} | {size / 1e6:.1f} MB | {count} | {walk:.2f} s | {load:.2f} s | {walk / load:.2f} | "
            f"{ref:.2f} s | {load / ref:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
