"""Scale (issue 8): inspect, verify and diff of a 10 000-file, 100 000-item DCP checkpoint.

    python benchmarks/bench_scale.py                 # --files 10000 --items 100000, and 1000 / 10000
    python benchmarks/bench_scale.py --check-full    # also dcp.load a sample of the full-size one

Writes (once, cached under ``benchmarks/_data/``) a synthetic but format-valid PyTorch DCP
checkpoint in the layout torch 2.13's ``FileSystemWriter`` writes: ``__{rank}_0.distcp`` files
that are concatenations of ``torch.save`` archives (one per stored chunk, each archive byte for
byte what torch writes; offset and length in ``_StorageInfo``) and a ``.metadata`` pickled with
torch's own classes. The order of the archives inside a file differs from a real save's (torch
writes every ``model.*`` chunk before the ``optim.*`` ones; here each parameter's three tensors
sit together), so the files are not byte-identical to a real save of the same state. A real ``dcp.save``
from 10 000 ranks cannot run on one machine, so the files are written directly.

Geometry (default): ``--items`` items = one ``step`` counter (a bytes item in rank 0's file) and
``items - 1`` fp32 tensors of ``--rows x --cols`` (32 x 64: 8 KiB), in triples parameter /
``exp_avg`` / ``exp_avg_sq`` as an AdamW state dict flattens, each tensor row-sharded into
``--shards`` (4) chunks on 4 different ranks' files (as FSDP or TP over 4 ranks would store it),
so every file holds about ``4 x items / files`` chunks (40). Small tensors keep the bytes modest
(about 1.5 GB for 400 000 chunk archives; torch.save adds about 1.6 KB of zip structure to each)
while the metadata has the full count of files, items and pieces the issue asks about.

Validity is checked every run on a small checkpoint from the same generator (20 files, 301
items): ``dcp_to_torch_save`` must rebuild every tensor with the expected values, and ``dcp.load``
must load a sample into freshly allocated tensors; ``--check-full`` also runs the ``dcp.load``
check on the full-size checkpoint.

Then, each in a fresh process through the CLI (wall time and peak RSS of the child), at both
sizes: ``inspect``, ``inspect --json`` (to a file), ``verify`` without a seal (zip CRC32s),
``seal``, ``verify`` against the seal, ``diff`` against a copy (hard links, one file copied for
real with one element of one tensor changed; diff must name exactly that tensor), and loading the
seal (``ckpttool.manifest.json``) with ``json.load`` and with ckpttool's own ``Seal.load``
(target < 1 s), next to torch's own ``pickle.load`` of the ``.metadata`` for reference. Building
and the torch checks run in a child process so that this one stays small: on Linux a child's
peak RSS starts from its parent's, which would otherwise raise every figure. ``--nofile 1024``
runs the commands under that open-file limit (a common default). Prints a Markdown table, the
ckpttool the commands imported and its git state, and writes ``benchmarks/_data/scale.json``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE / "_data"
STEP = 1000
SEAL = "ckpttool.manifest.json"

_LOAD_PROBE = r"""
import json, sys, time
from pathlib import Path
kind, path = sys.argv[1], Path(sys.argv[2])
if kind == "torch":  # reference: torch's own classes unpickling DCP's .metadata (what dcp.load does first)
    import pickle
    import torch.distributed.checkpoint  # noqa: F401
t = time.perf_counter()
if kind == "json":
    with open(path, "rb") as fh:
        doc = json.load(fh)
    n = len(doc["pieces"]["checksum"] if isinstance(doc["pieces"], dict) else doc["pieces"])  # version 2 or 1
elif kind == "seal":
    from ckpttool.seal import Seal
    t = time.perf_counter()
    n = len(Seal.load(path).pieces)
else:
    with open(path, "rb") as fh:
        n = sum(len(v.chunks) for v in pickle.load(fh).state_dict_metadata.values() if hasattr(v, "chunks"))
print(json.dumps({"load_s": time.perf_counter() - t, "pieces": n}))
"""


# -- the checkpoint --------------------------------------------------------------------------------


class Geometry:
    """Names, shapes, values and placement of the synthetic checkpoint's items."""

    def __init__(self, files: int, items: int, rows: int, cols: int, shards: int) -> None:
        if items < 2 or files < 1 or shards < 1 or rows % shards:
            raise SystemExit("need --items >= 2, --files >= 1 and --rows divisible by --shards")
        self.files, self.items, self.rows, self.cols, self.shards = files, items, rows, cols, shards
        self.tensors = items - 1  # plus the step counter
        self.chunk_rows = rows // shards
        self.stride = max(1, files // shards)

    def path(self, t: int) -> tuple[str, ...]:
        """Where tensor ``t`` sits in the nested state dict (DCP's ``planner_data`` mapping)."""
        group, role = divmod(t, 3)
        param = f"layers.{group // 64}.mlp.w{group % 64}"
        if role == 0:
            return ("model", param)
        return ("optim", "state", param, ("exp_avg", "exp_avg_sq")[role - 1])

    def name(self, t: int) -> str:
        return ".".join(self.path(t))

    def rank(self, t: int, s: int) -> int:
        """The file chunk ``s`` of tensor ``t`` goes to: the chunks of one tensor on different ranks."""
        return (t + s * self.stride) % self.files

    def full(self, t: int):  # -> torch.Tensor
        import torch

        base = torch.arange(self.rows * self.cols, dtype=torch.float32).reshape(self.rows, self.cols) / 4096
        return base + float(t % 4096)

    def chunk(self, base, t: int, s: int):  # base: full(0)
        r = self.chunk_rows
        return base[s * r : (s + 1) * r] + float(t % 4096)


def sidecar(root: Path) -> Path:
    return root.with_name(root.name + ".build.json")


def make(root: Path, g: Geometry) -> dict:
    """Write the checkpoint (unless a complete one is there) and return its build record."""
    import torch
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    record_path = sidecar(root)
    if (root / ".metadata").exists() and record_path.exists():
        return json.loads(record_path.read_text())
    if root.exists():
        shutil.rmtree(root)  # an interrupted build: start again
    root.mkdir(parents=True)
    t0 = time.perf_counter()
    per_rank: list[list[tuple[int, int]]] = [[] for _ in range(g.files)]
    for t in range(g.tensors):
        for s in range(g.shards):
            per_rank[g.rank(t, s)].append((t, s))
    step_bytes = io.BytesIO()
    torch.save(STEP, step_bytes)  # what DCP stores for a non-tensor value: its torch.save bytes
    base = g.full(0)
    storage: dict = {}
    target = g.tensors // 2 - (g.tensors // 2) % 3  # a parameter in the middle: the one diff must find
    where = None
    for rank in range(g.files):
        rel = f"__{rank}_0.distcp"
        with open(root / rel, "wb") as fh:
            if rank == 0:  # FileSystemWriter writes a file's bytes items first, then its tensors
                storage[MetadataIndex("step")] = _StorageInfo(rel, 0, fh.write(step_bytes.getbuffer()))
            for t, s in per_rank[rank]:
                offset = fh.tell()
                torch.save(g.chunk(base, t, s), fh)
                length = fh.tell() - offset
                storage[MetadataIndex(g.name(t), (s * g.chunk_rows, 0), index=s)] = _StorageInfo(rel, offset, length)
                if t == target and s == 0:
                    where = {"item": g.name(t), "file": rel, "offset": offset, "length": length}
        per_rank[rank] = []
    sdm: dict = {"step": BytesStorageMetadata()}
    planner: dict = {"step": ("step",)}
    for t in range(g.tensors):
        name = g.name(t)
        planner[name] = g.path(t)
        sdm[name] = TensorStorageMetadata(
            properties=TensorProperties(dtype=torch.float32),
            size=torch.Size([g.rows, g.cols]),
            chunks=[
                ChunkStorageMetadata(
                    offsets=torch.Size([s * g.chunk_rows, 0]), sizes=torch.Size([g.chunk_rows, g.cols])
                )
                for s in range(g.shards)
            ],
        )
    md = Metadata(
        state_dict_metadata=sdm,
        planner_data=planner,
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=root, save_id=str(uuid.uuid4())),
        version=CURRENT_DCP_VERSION,
    )
    with open(root / ".metadata.tmp", "wb") as fh:  # as FileSystemWriter.finish: pickle.dump, rename
        pickle.dump(md, fh)
    os.rename(root / ".metadata.tmp", root / ".metadata")
    record = {
        "files": g.files,
        "items": g.items,
        "tensors": g.tensors,
        "pieces": g.tensors * g.shards,
        "rows": g.rows,
        "cols": g.cols,
        "shards": g.shards,
        "bytes": sum(p.stat().st_size for p in root.iterdir()),
        "metadata_bytes": (root / ".metadata").stat().st_size,
        "build_s": time.perf_counter() - t0,
        "changed": where,
    }
    patched_chunk(root, g, where)  # type: ignore[arg-type]
    record_path.write_text(json.dumps(record, indent=2))
    return record


def patched_chunk(root: Path, g: Geometry, where: dict) -> None:
    """The archive that replaces the changed chunk in the copy: one element + 1.0, same length."""
    import torch

    t = next(t for t in range(g.tensors) if g.name(t) == where["item"])
    values = g.chunk(g.full(0), t, 0)
    values[0, 0] += 1.0
    buf = io.BytesIO()
    torch.save(values, buf)
    if len(buf.getvalue()) != where["length"]:
        raise SystemExit(f"re-written chunk of {where['item']} changed length; cannot patch in place")
    root.with_name(root.name + ".changed.bin").write_bytes(buf.getvalue())


def copy_with_change(src: Path, dst: Path, record: dict) -> str:
    """``dst``: hard links to ``src``'s files but one, copied, in which one element of one chunk
    differs (the chunk's archive re-written in place, same length, so the copy stays valid)."""
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    changed = record["changed"]
    for p in src.iterdir():
        if p.name == SEAL or p.name == changed["file"]:
            continue
        os.link(p, dst / p.name)
    shutil.copyfile(src / changed["file"], dst / changed["file"])
    with open(dst / changed["file"], "r+b") as fh:
        fh.seek(changed["offset"])
        fh.write(src.with_name(src.name + ".changed.bin").read_bytes())
    return changed["item"]


# -- validity --------------------------------------------------------------------------------------


def _flatten(tree: object, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], object]:
    if isinstance(tree, dict):
        out: dict[tuple[str, ...], object] = {}
        for k, v in tree.items():
            out.update(_flatten(v, (*prefix, k)))
        return out
    return {prefix: tree}


def check_with_torch(root: Path, g: Geometry, *, whole: bool, sample: int = 24) -> str:
    """torch itself reads the checkpoint: ``dcp_to_torch_save`` (``whole``: every item, nested as
    ``planner_data`` says) and ``dcp.load`` of a sample of items into fresh tensors."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore")  # dcp.load without a process group says so
    notes = []
    if whole:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "full.pt"
            dcp_to_torch_save(str(root), str(out))
            loaded = _flatten(torch.load(out, weights_only=True))
        want = {g.path(t): t for t in range(g.tensors)}
        if loaded.pop(("step",), None) != STEP:
            raise SystemExit(f"{root}: dcp_to_torch_save did not give step {STEP}")
        if set(loaded) != set(want):
            raise SystemExit(f"{root}: dcp_to_torch_save gave {len(loaded)} tensors, expected {len(want)}")
        for path, t in want.items():
            if not torch.equal(loaded[path], g.full(t)):  # type: ignore[arg-type]
                raise SystemExit(f"{root}: {'.'.join(path)} has the wrong values after dcp_to_torch_save")
        notes.append(f"dcp_to_torch_save: all {len(want)} tensors and the step exact")
    picks = sorted({(t * 7919) % g.tensors for t in range(sample)} | {0, g.tensors - 1})
    state = {g.name(t): torch.empty(g.rows, g.cols) for t in picks}
    dcp.load(state, checkpoint_id=str(root))
    for t in picks:
        if not torch.equal(state[g.name(t)], g.full(t)):
            raise SystemExit(f"{root}: dcp.load gave wrong values for {g.name(t)}")
    notes.append(f"dcp.load: {len(picks)} sampled tensors exact")
    return "; ".join(notes)


# -- measuring -------------------------------------------------------------------------------------


def measure(cmd: list[str], *, ok: tuple[int, ...] = (0,), stdout: Path | None = None, timeout: float = 3600) -> dict:
    """Wall seconds and peak RSS (``ru_maxrss`` of the child) of one command in a fresh process."""
    with tempfile.TemporaryFile() as err, open(stdout or os.devnull, "wb") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err)
        samples: list[tuple[float, int]] = []  # (seconds since start, resident bytes)
        polls = 0
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - start > timeout:
                proc.kill()
                _, status, usage = os.wait4(proc.pid, 0)
                break
            polls += 1
            if polls % 10 == 0:  # every 50 ms
                rss = _resident(proc.pid)
                if rss is not None:
                    samples.append((time.perf_counter() - start, rss))
            time.sleep(0.005)
        wall = time.perf_counter() - start
        proc.returncode = rc = os.waitstatus_to_exitcode(status)
        err.seek(0)
        tail = err.read().decode(errors="replace")[-2000:]
    result: dict = {"wall_s": wall, "rss": usage.ru_maxrss * 1024, "rc": rc, "ok": rc in ok and wall <= timeout}
    # resident memory at each quarter of the run: flat once the metadata is read means the data
    # phase (reading and hashing every byte) adds nothing
    result["rss_quarters"] = [max((r for t, r in samples if t <= wall * q / 4), default=0) for q in (1, 2, 3, 4)]
    if not result["ok"]:
        result["stderr"] = tail
        print(f"  FAILED (rc {rc}, {wall:.1f} s): {' '.join(cmd)}\n{tail}", flush=True)
    return result


def _resident(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def run_size(root: Path, record: dict, timeout: float) -> dict:
    ck = [sys.executable, "-m", "ckpttool"]
    other = root.with_name(root.name + "_b")
    (root / SEAL).unlink(missing_ok=True)
    changed = copy_with_change(root, other, record)
    os.sync()
    for p in sorted(root.iterdir()):  # hot page cache for everyone
        with open(p, "rb", buffering=0) as fh:
            while fh.read(8 << 20):
                pass
    out: dict = {}
    steps: list[tuple[str, list[str], dict]] = [
        ("inspect", [*ck, "inspect", str(root)], {}),
        ("inspect --json", [*ck, "inspect", str(root), "--json"], {"stdout": DATA / f"{root.name}.inspect.json"}),
        ("verify (no seal: zip CRC32s)", [*ck, "verify", str(root), "-q"], {}),
        ("seal", [*ck, "seal", str(root), "-q"], {}),
        ("verify (against the seal)", [*ck, "verify", str(root), "-q"], {}),
        (
            "diff (one tensor changed)",
            [*ck, "diff", str(root), str(other), "--json", "-q"],
            {"ok": (1,), "stdout": DATA / f"{root.name}.diff.json"},
        ),
    ]
    for label, cmd, kw in steps:
        print(f"  {label} ...", end="", flush=True)
        r = measure(cmd, timeout=timeout, **kw)
        quarters = " / ".join(f"{q / 1e6:.0f}" for q in r["rss_quarters"])
        peak = r["rss"] / 1e6
        print(f" {r['wall_s']:.1f} s, {peak:.0f} MB (by each quarter: {quarters} MB), rc {r['rc']}", flush=True)
        out[label] = r
    d = out["diff (one tensor changed)"]
    if d["ok"]:
        report = json.loads((DATA / f"{root.name}.diff.json").read_text())
        names = [v["a"] for v in report["values"]]
        d["found"] = names
        d["ok"] = names == [changed] and not report["added"] and not report["removed"]
        if not d["ok"]:
            print(f"  diff found {names[:5]}, expected [{changed!r}]", flush=True)
    if out["inspect --json"]["ok"]:
        out["inspect --json"]["json_bytes"] = (DATA / f"{root.name}.inspect.json").stat().st_size
    seal = root / SEAL
    if seal.exists():
        out["seal_bytes"] = seal.stat().st_size
    loads = [("json", seal, "json.load(seal)"), ("seal", seal, "Seal.load(seal)")] if seal.exists() else []
    loads.append(("torch", root / ".metadata", "reference: torch pickle.load(.metadata)"))
    for kind, path, label in loads:
        probe = DATA / "scale_probe.json"
        r = measure([sys.executable, "-c", _LOAD_PROBE, kind, str(path)], timeout=timeout, stdout=probe)
        if r["ok"]:
            r.update(json.loads(probe.read_text()))
        out[label] = r
        print(f"  {label}: {r.get('load_s', float('nan')):.2f} s in-process, {r['rss'] / 1e6:.0f} MB", flush=True)
    shutil.rmtree(other)
    return out


def provenance() -> str:
    """Which ckpttool the commands import (as they will: same interpreter, directory and
    environment) and the state of its git checkout."""
    where = subprocess.run(
        [sys.executable, "-c", "import ckpttool.formats.dcp as m, ckpttool as c; print(c.__file__, m.__file__)"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    try:
        repo = Path(where.split()[0]).resolve().parent.parent
        rev = subprocess.run(
            ["git", "-C", str(repo), "describe", "--always", "--dirty"], capture_output=True, text=True
        ).stdout.strip()
    except (IndexError, OSError):
        rev = ""
    return f"{where} (git {rev or 'unknown'})"


def table(sizes: list[tuple[str, dict, dict]]) -> str:
    head = "| |" + "|".join(f" {label}: wall | peak RSS (by each quarter of the run) " for label, _, _ in sizes) + "|"
    rule = "|---|" + "---|---|" * len(sizes)
    rows = [head, rule]
    labels = [
        "start-up (--version)",
        "inspect",
        "inspect --json",
        "verify (no seal: zip CRC32s)",
        "seal",
        "verify (against the seal)",
        "diff (one tensor changed)",
        "json.load(seal)",
        "Seal.load(seal)",
        "reference: torch pickle.load(.metadata)",
    ]
    for label in labels:
        cells = []
        for _, _, res in sizes:
            r = res.get(label)
            if r is None:
                cells += ["–", "–"]
                continue
            wall = f"{r['wall_s']:.2f} s"
            if "load_s" in r:
                wall = f"{r['load_s']:.2f} s ({r['wall_s']:.2f} s with start-up)"
            if not r["ok"]:
                wall += f" **FAILED (rc {r['rc']})**"
            rss = f"{r['rss'] / 1e6:.0f} MB"
            if any(r.get("rss_quarters", ())) and "load_s" not in r:
                rss += " (" + " / ".join(f"{q / 1e6:.0f}" for q in r["rss_quarters"]) + ")"
            cells += [wall, rss]
        rows.append(f"| `{label}` | " + " | ".join(cells) + " |")
    facts = []
    for label, rec, res in sizes:
        facts.append(
            f"{label}: {rec['files']:,} files, {rec['items']:,} items, {rec['pieces']:,} pieces, "
            f"{rec['bytes'] / 1e9:.2f} GB; .metadata {rec['metadata_bytes'] / 1e6:.1f} MB, "
            f"seal {res.get('seal_bytes', 0) / 1e6:.1f} MB, inspect --json "
            f"{res.get('inspect --json', {}).get('json_bytes', 0) / 1e6:.1f} MB"
        )
    return "\n".join(rows) + "\n\n" + "\n".join(f"* {f}" for f in facts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=10_000)
    ap.add_argument("--items", type=int, default=100_000)
    ap.add_argument("--small-files", type=int, default=1_000, help="the smaller size (0: skip it)")
    ap.add_argument("--small-items", type=int, default=10_000)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--cols", type=int, default=64)
    ap.add_argument("--shards", type=int, default=4, help="chunks (files) per tensor")
    ap.add_argument("--check-full", action="store_true", help="also dcp.load a sample of the full-size checkpoint")
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per command")
    ap.add_argument(
        "--nofile", type=int, help="soft limit on open files for the commands (e.g. 1024, a common default)"
    )
    args = ap.parse_args()
    DATA.mkdir(exist_ok=True)

    def geometry(files: int, items: int) -> tuple[Path, Geometry]:
        g = Geometry(files, items, args.rows, args.cols, args.shards)
        return DATA / f"dcp_scale_{files}x{items}_{args.rows}x{args.cols}x{args.shards}", g

    sizes = [(args.small_files, args.small_items)] if args.small_files else []
    sizes.append((args.files, args.items))
    if not args.build_only:
        # building and the torch checks run in a child: this process stays small (a child's peak RSS
        # on Linux starts from its parent's at the fork, so a parent holding torch would raise every figure)
        subprocess.run([sys.executable, __file__, *sys.argv[1:], "--build-only"], check=True)
        built = [(*geometry(f, n), json.loads(sidecar(geometry(f, n)[0]).read_text())) for f, n in sizes]
    else:
        root, g = geometry(20, 301)
        make(root, g)
        print(f"validity ({root.name}): {check_with_torch(root, g, whole=True)}", flush=True)
        for files, items in sizes:
            root, g = geometry(files, items)
            t = time.perf_counter()
            record = make(root, g)
            print(
                f"{root.name}: ready in {time.perf_counter() - t:.1f} s ({record['bytes'] / 1e9:.2f} GB, "
                f"built in {record['build_s']:.0f} s)",
                flush=True,
            )
        if args.check_full:
            root, g = geometry(args.files, args.items)
            print(f"validity ({root.name}): {check_with_torch(root, g, whole=False)}", flush=True)
        return 0

    if args.nofile:
        resource.setrlimit(resource.RLIMIT_NOFILE, (args.nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    print(f"open-file limit (soft) for the commands: {nofile}; load average before: {os.getloadavg()}", flush=True)
    code = provenance()
    print(f"code measured: {code}", flush=True)
    startup = measure([sys.executable, "-m", "ckpttool", "--version"])
    print(f"start-up (ckpttool --version): {startup['wall_s']:.2f} s, {startup['rss'] / 1e6:.0f} MB", flush=True)
    results = []
    for root, g, record in built:
        print(f"{root.name}:", flush=True)
        res = {"start-up (--version)": startup, **run_size(root, record, args.timeout)}
        results.append((f"{g.files:,} files / {g.items:,} items", record, res))
    print()
    print(table(results))
    print(f"* open-file limit {nofile}; load average after: {os.getloadavg()} on {os.cpu_count()} CPUs")
    record = {
        "code": code,
        "nofile": nofile,
        "loadavg": os.getloadavg(),
        "sizes": [{"size": s, "build": r, "runs": x} for s, r, x in results],
    }
    (DATA / "scale.json").write_text(json.dumps(record, indent=2))
    full = results[-1][2]
    finished = all(r["ok"] for r in full.values() if isinstance(r, dict))
    fast = all(full.get(k, {}).get("load_s", 99) < 1 for k in ("json.load(seal)", "Seal.load(seal)"))
    print(f"\nall commands finished and correct: {finished}; seal loads in < 1 s: {fast}")
    return 0 if finished and fast else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
