"""seal and verify of a >= 1 GB checkpoint against plain readers and sha256sum on the same files.

    python benchmarks/bench_seal_verify.py [--ckpt benchmarks/_data/dcp_2048x24] [--repeat 3]

Uses the DCP checkpoint bench_export.py makes (run that first). Hot page cache for everyone (the
files are read once first), or with ``--cold`` the page cache dropped before every run (root only).
Measures, each a median of ``--repeat``:

- two parallel readers: two threads reading the files (split between them) into a buffer;
- ``sha256sum`` over the files;
- ``ckpttool seal`` and ``ckpttool verify`` (against that seal): the library call in-process
  (throughput of the work) and the CLI in a fresh process (what a user waits, start-up included);
- the bytes ``verify`` reads (its hashing pass, plus what goes through ``ckpttool.io``) against
  the checkpoint's size: without ``--deep`` every byte once, plus metadata.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


COLD = [False]


def drop_caches() -> None:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
    except OSError as exc:
        raise SystemExit(f"--cold needs root to drop the page cache ({exc})") from None


def timed(fn) -> float:
    if COLD[0]:
        drop_caches()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", default=str(HERE / "_data" / "dcp_2048x24"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cold", action="store_true", help="drop the page cache before every run (needs root)")
    args = ap.parse_args()
    COLD[0] = args.cold
    ckpt = Path(args.ckpt)
    if not (ckpt / ".metadata").exists():
        raise SystemExit(f"{ckpt}: run benchmarks/bench_export.py first (it makes the checkpoint)")
    files = sorted(str(p) for p in ckpt.iterdir() if p.is_file() and p.name != "ckpttool.manifest.json")
    size = sum(os.path.getsize(f) for f in files)
    for f in files:
        subprocess.run(["cat", f], stdout=subprocess.DEVNULL, check=True)

    def read_all(paths: list[str]) -> None:
        buf = bytearray(8 << 20)
        for path in paths:
            with open(path, "rb", buffering=0) as fh:
                while fh.readinto(buf):
                    pass

    def two_readers() -> None:
        # two threads reading into a buffer (cat to /dev/null is short-circuited by the kernel)
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(2) as pool:
            list(pool.map(read_all, [files[0::2], files[1::2]]))

    def sha() -> None:
        subprocess.run(["sha256sum", *files], stdout=subprocess.DEVNULL, check=True)

    from ckpttool import io as ckio
    from ckpttool.seal import seal
    from ckpttool.verify import verify

    seal_path = ckpt / "ckpttool.manifest.json"
    counted = [0]
    real_pread, real_into = ckio.pread, ckio.preadinto

    def count_pread(fd: int, n: int, off: int) -> bytes:
        data = real_pread(fd, n, off)
        counted[0] += len(data)
        return data

    results: dict[str, list[float]] = {"two readers": [], "sha256sum": [], "seal (library)": [],
                                       "verify (library)": [], "seal (CLI)": [], "verify (CLI)": []}
    for _ in range(args.repeat):
        results["two readers"].append(timed(two_readers))
        results["sha256sum"].append(timed(sha))
        results["seal (library)"].append(timed(lambda: seal(ckpt)))
        results["verify (library)"].append(timed(lambda: verify(ckpt)))
        results["seal (CLI)"].append(timed(lambda: subprocess.run(
            [sys.executable, "-m", "ckpttool", "seal", str(ckpt), "-q"], stdout=subprocess.DEVNULL, check=True)))
        results["verify (CLI)"].append(timed(lambda: subprocess.run(
            [sys.executable, "-m", "ckpttool", "verify", str(ckpt), "-q"], stdout=subprocess.DEVNULL, check=True)))
    def count_into(fd: int, buf: memoryview, off: int) -> int:
        n = real_into(fd, buf, off)
        counted[0] += n
        return n

    ckio.pread, ckio.preadinto = count_pread, count_into
    try:
        report = verify(ckpt)
    finally:
        ckio.pread, ckio.preadinto = real_pread, real_into
    med = {k: statistics.median(v) for k, v in results.items()}
    gbs = {k: size / v / 1e9 for k, v in med.items()}
    for k in results:
        print(f"{k:18s} {med[k]:6.2f} s  {gbs[k]:6.2f} GB/s")
    ratios = {
        "seal vs two readers": gbs["seal (library)"] / gbs["two readers"],
        "verify vs two readers": gbs["verify (library)"] / gbs["two readers"],
        "seal vs sha256sum": gbs["seal (library)"] / gbs["sha256sum"],
        "verify vs sha256sum": gbs["verify (library)"] / gbs["sha256sum"],
        "verify bytes read / checkpoint bytes": counted[0] / size,
    }
    for k, v in ratios.items():
        print(f"{k:38s} {v:5.2f}")
    print(f"checkpoint {size / 1e9:.2f} GB in {len(files)} files; verify found {len(report.findings)} findings")
    (HERE / "_data" / f"seal_verify{'_cold' if args.cold else ''}.json").write_text(json.dumps({"bytes": size, "median_s": med, "ratios": ratios},
                                                                 indent=2))
    seal_path.unlink(missing_ok=True)
    ok = (ratios["seal vs two readers"] >= 0.8 and ratios["verify vs two readers"] >= 0.8
          and ratios["seal vs sha256sum"] >= 4 and ratios["verify vs sha256sum"] >= 4)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
