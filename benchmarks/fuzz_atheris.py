"""The long fuzzing campaign (issue 8): atheris (libFuzzer for Python) against every ckpttool parser.

The bounded hypothesis tests of ``tests/test_fuzz.py`` run in CI; this is the campaign behind
them. It uses the same targets (one per parser: ``unpickle``, ``torchzip``, ``torchsave``, ``dcp``,
``safetensors``, ``megatron``, ``deepspeed``, ``rankshards``, ``delta``, ``seal``; see
``TARGETS`` there), the same input format (first byte: which fixture file the rest replaces) and
the same rule: only CkptError may escape, no hang, no unbounded memory. libFuzzer's coverage-guided
byte mutations are mixed with the structure-aware ones of the tests (pickled trees with hostile
values, JSON documents, generated safetensors headers and pickles), through a custom mutator.

An input that raises anything else, hangs (CPU time past ``--hang``), runs into the address-space
limit (MemoryError) or grows the process past the memory budget of the tests (a ``memory``
finding, located by running it again in a fresh process with less room) is a *finding*: kept, the
smallest per signature (exception type and innermost ckpttool line), under
``benchmarks/_data/fuzz/findings/<target>/`` with its traceback, and the campaign goes on.
``minimize`` shrinks a finding (its pickled tree or JSON document first, then its bytes) keeping
the signature; ``promote`` copies it to ``tests/fuzz_regressions/<target>/<name>.bin``, which
``tests/test_fuzz.py`` replays.

Run from the repository root (``pip install atheris``; Linux)::

    python benchmarks/fuzz_atheris.py list
    python benchmarks/fuzz_atheris.py run dcp --time 300           # one target, 5 minutes
    python benchmarks/fuzz_atheris.py run unpickle --runs 200000    # or a number of inputs
    python benchmarks/fuzz_atheris.py all --time 120                # every target in turn
    python benchmarks/fuzz_atheris.py run dcp --time 60 -- -jobs=2  # more libFuzzer flags after --
    python benchmarks/fuzz_atheris.py findings                      # what was found, by target
    python benchmarks/fuzz_atheris.py minimize dcp benchmarks/_data/fuzz/findings/dcp/<sig>.bin
    python benchmarks/fuzz_atheris.py promote dcp <minimized.bin> <short-name>
    python benchmarks/fuzz_atheris.py sweep --time 60               # no atheris: random structure-aware inputs

Everything it writes goes under ``benchmarks/_data/fuzz/`` (git-ignored): ``corpus/<target>/``
(seeded from the fixtures, grown by libFuzzer), ``findings/<target>/``, ``logs/`` (of ``all``) and
``crashes/`` (what libFuzzer itself stops on: its own timeout or RSS limit).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "benchmarks" / "_data" / "fuzz"
sys.path.insert(0, str(ROOT))

fz: Any = None  # tests.test_fuzz, imported by _load() (under atheris's instrumentation when fuzzing)


def _load(instrument: bool = False) -> Any:
    global fz
    if fz is None:
        if instrument:
            import atheris

            with atheris.instrument_imports(include=["ckpttool"]):
                import tests.test_fuzz as module
        else:
            import tests.test_fuzz as module
        fz = module
    return fz


# -- findings -------------------------------------------------------------------------------------------


def signature(exc: BaseException) -> str:
    """Exception type and the innermost line of ckpttool that raised it; hangs and memory by kind."""
    text = str(exc)
    if isinstance(exc, AssertionError) and ": hang in " in text:
        return "hang@" + text.split(": hang in ", 1)[1].split(":", 1)[0]
    if isinstance(exc, AssertionError) and ": memory: " in text:
        return "memory"
    if isinstance(exc, MemoryError):
        return "MemoryError@" + (fz.library_line(exc) or "harness").split(":")[0]
    return f"{type(exc).__name__}@{fz.library_line(exc) or 'harness'}"


def _slug(sig: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", sig).strip("_")


def outcome(target: Any, data: bytes, hang_s: float, cpu_clock: bool = True) -> tuple[str | None, str]:
    """(signature or None, traceback text) of one input."""
    try:
        fz.check(target, data, seconds=hang_s, cpu_clock=cpu_clock)
    except Exception as exc:
        sig, text = signature(exc), "".join(traceback.format_exception(exc))
        if sig == "memory":
            sig, where = _where_memory_goes(target, data, hang_s)
            text += f"\nRun again with room for only {fz.RSS_BUDGET >> 21} MiB more:\n{where}"
        return sig, text
    return None, ""


def _where_memory_goes(target: Any, data: bytes, hang_s: float) -> tuple[str, str]:
    """Signature of an input that used too much memory: where its allocation fails when the
    address space allows half the budget (also when the parser catches the MemoryError). In a
    fresh process: this one may still hold the freed memory, and reuse it."""
    with tempfile.NamedTemporaryFile(suffix=".bin") as fh:
        fh.write(data)
        fh.flush()
        proc = subprocess.run([sys.executable, __file__, "_memory", target.name, fh.name, "--hang", str(hang_s)],
                              capture_output=True, text=True, check=False)
    lines = proc.stdout.splitlines()
    return (lines[0], "\n".join(lines[1:])) if lines else ("memory", proc.stderr)


def cmd_memory(args: argparse.Namespace) -> int:
    _load()
    try:
        with fz.limits(args.hang, memory=fz.RSS_BUDGET // 2):
            fz.TARGETS[args.target].run(Path(args.file).read_bytes())
    except BaseException as exc:
        cause: BaseException | None = exc
        while cause is not None and not isinstance(cause, MemoryError):
            cause = cause.__context__
        if cause is not None:
            print(f"memory@{fz.library_line(cause) or 'harness'}\n" + "".join(traceback.format_exception(cause)))
            return 0
    print("memory\n(no allocation failed under the limit)")
    return 0


def record(target: str, data: bytes, sig: str, text: str) -> bool:
    """Keep ``data`` as the finding for ``sig`` if it is new or smaller; True when new."""
    out = DATA / "findings" / target
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{_slug(sig)}.bin"
    new = not path.exists()
    if new or len(data) < path.stat().st_size:
        path.write_bytes(data)
        path.with_suffix(".txt").write_text(f"{sig}\n\n{text}")
    return new


# -- fuzzing --------------------------------------------------------------------------------------------


def _corpus(target: Any) -> Path:
    d = DATA / "corpus" / target.name
    d.mkdir(parents=True, exist_ok=True)
    for i, seed in enumerate(target.seeds):
        path = d / f"seed-{i}.bin"
        if not path.exists():
            path.write_bytes(seed)
    return d


def _structured(target: Any, rng: random.Random, data: bytes) -> bytes:
    ch = fz.Rolls(rng)
    if target.name == "unpickle" and rng.random() < 0.4:
        i = rng.randrange(len(target.slots))
        body = fz.pickle_program(ch, fz.ALLOWLISTS[target.slots[i].allow], fz.WORK.root / fz._TOUCH)
        return bytes([i]) + b"\x80\x02" + body + b"."
    if target.name == "safetensors" and rng.random() < 0.3:
        out, _ = fz.safetensors_file(ch)
        return bytes([rng.randrange(2)]) + out
    out, _ = target.mutate(ch, data)
    return out


def cmd_run(args: argparse.Namespace) -> int:
    import atheris

    _load(instrument=True)
    target = fz.TARGETS[args.target]
    corpus = _corpus(target)
    seen: dict[str, int] = {}
    counts = {"inputs": 0, "findings": 0}

    start = last = time.monotonic()

    def report(final: bool) -> None:
        print(f"\n[fuzz_atheris] {target.name}: {'done, ' if final else ''}{counts['inputs']} inputs in "
              f"{time.monotonic() - start:.0f} s, {len(seen)} signatures ({counts['findings']} new): "
              + ", ".join(f"{s} x{n}" for s, n in sorted(seen.items())), file=sys.stderr, flush=True)

    def one_input(data: bytes) -> None:
        nonlocal last
        counts["inputs"] += 1
        sig, text = outcome(target, data, args.hang)
        if sig is not None:
            seen[sig] = seen.get(sig, 0) + 1
            if record(target.name, data, sig, text):
                counts["findings"] += 1
                print(f"\n[fuzz_atheris] {target.name}: new finding {sig}", file=sys.stderr, flush=True)
        now = time.monotonic()
        if (args.time and now - start >= args.time) or (args.runs and counts["inputs"] >= args.runs):
            report(final=True)
            os._exit(0)  # libFuzzer's own exit skips Python's atexit: the budget is enforced here
        if now - last >= 60:
            last = now
            report(final=False)

    def mutator(data: bytes, max_size: int, seed: int) -> bytes:
        rng = random.Random(seed)
        if rng.random() < 0.5:
            return atheris.Mutate(data, max_size)
        try:  # parsing a mutated input for its tree is parsing untrusted input: same limits
            with fz.limits(args.hang, cpu_clock=True):
                out = _structured(target, rng, data)
        except BaseException:  # the generators' own failure on odd input: fall back
            return atheris.Mutate(data, max_size)
        return out[:max_size]

    max_len = max(map(len, target.seeds)) + (64 << 10)
    flags = [f"-max_len={max_len}", "-timeout=120", f"-rss_limit_mb={args.rss_mb}",
             f"-artifact_prefix={DATA / 'crashes' / target.name}-"]
    (DATA / "crashes").mkdir(parents=True, exist_ok=True)
    atheris.Setup([sys.argv[0], *flags, *args.libfuzzer, str(corpus)], one_input, custom_mutator=mutator)
    atheris.Fuzz()
    return 0


def cmd_all(args: argparse.Namespace) -> int:
    logs = DATA / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    names = args.targets or list(_load().TARGETS)
    for name in names:
        cmd = [sys.executable, __file__, "run", name, "--time", str(args.time), "--hang", str(args.hang)]
        log = logs / f"{name}.log"
        print(f"== {name}: {' '.join(cmd[1:])} (log: {log.relative_to(ROOT)})", flush=True)
        with open(log, "w") as fh:
            subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, check=False)
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if "[fuzz_atheris]" in ln and "inputs" in ln]
        print(tail[-1] if tail else "   (no summary: see the log)", flush=True)
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    """Random structure-aware inputs, no coverage guidance (for machines without atheris)."""
    _load()
    names = args.targets or list(fz.TARGETS)
    rng = random.Random(args.seed)
    for name in names:
        target = fz.TARGETS[name]
        seen: dict[str, int] = {}
        n, start = 0, time.monotonic()
        while time.monotonic() - start < args.time:
            data = _structured(target, rng, rng.choice(target.seeds))
            n += 1
            sig, text = outcome(target, data, args.hang, cpu_clock=False)
            if sig is not None:
                seen[sig] = seen.get(sig, 0) + 1
                record(name, data, sig, text)
        print(f"{name}: {n} inputs in {args.time} s, {len(seen)} signatures: "
              + ", ".join(f"{s} x{c}" for s, c in sorted(seen.items())), flush=True)
    return 0


def cmd_findings(args: argparse.Namespace) -> int:
    for d in sorted((DATA / "findings").glob("*")):
        for f in sorted(d.glob("*.bin")):
            sig = f.with_suffix(".txt").read_text().splitlines()[0]
            print(f"{d.name:12} {f.stat().st_size:8} bytes  {sig}")
    return 0


# -- minimizing -----------------------------------------------------------------------------------------


class _Budget:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> bool:
        return time.monotonic() < self.end


def _ddmin(items: list[Any], keeps: Any, budget: _Budget) -> list[Any]:
    """The smallest sublist of ``items`` for which ``keeps(sublist)`` holds (delta debugging)."""
    n = 2
    while len(items) >= 2 and budget.left():
        chunk = -(-len(items) // n)
        for i in range(0, len(items), chunk):
            candidate = items[:i] + items[i + chunk :]
            if keeps(candidate):
                items, n = candidate, max(n - 1, 2)
                break
        else:
            if n >= len(items):
                break
            n = min(len(items), n * 2)
    if len(items) == 1 and keeps([]):
        items = []
    return items


def _shrink_containers(root: Any, keeps_root: Any, budget: _Budget) -> None:
    """Delete what the failure does not need from every dict, list and record of ``root`` (in
    place), breadth first; ``keeps_root()`` tells whether the failure is still there."""
    done: set[int] = set()
    progress = True
    while progress and budget.left():
        progress = False
        for container, _, _ in [(root, None, ""), *fz.edges(root)]:
            obj = container
            if id(obj) in done or not budget.left():
                continue
            done.add(id(obj))
            if isinstance(obj, dict) or fz._is_record(obj):
                d = fz._attrs(obj) if fz._is_record(obj) else obj
                items = list(d.items())

                def keeps(sub: list[Any], d: Any = d) -> bool:
                    d.clear()
                    d.update(sub)
                    return keeps_root()

                kept = _ddmin(items, keeps, budget)
                d.clear()
                d.update(kept)
                progress |= len(kept) < len(items)
            elif isinstance(obj, list):
                items = list(obj)

                def keeps_list(sub: list[Any], obj: Any = obj) -> bool:
                    obj[:] = sub
                    return keeps_root()

                kept = _ddmin(items, keeps_list, budget)
                obj[:] = kept
                progress |= len(kept) < len(items)
        if progress:
            done.clear()


def minimize(target: Any, data: bytes, budget_s: float, hang_s: float, force_bytes: bool = False) -> bytes:
    """The smallest input found that fails with the same signature: the pickled tree or JSON
    document shrunk first (the result stays readable), then the bytes when that did not apply
    (or with ``force_bytes``)."""
    sig, _ = outcome(target, data, hang_s, cpu_clock=False)
    if sig is None:
        raise SystemExit("the input does not fail: nothing to minimize")
    budget = _Budget(budget_s)
    i, payload = target.split(data)
    head = bytes([i])

    def same(candidate: bytes) -> bool:
        return outcome(target, candidate, hang_s, cpu_clock=False)[0] == sig

    structured = False
    if i in target.tree_slots():  # the pickled tree first
        try:
            with fz.limits(hang_s):
                tree, _ = target.tree_of(i, payload)
            if same(head + fz.repickle(tree)):
                _shrink_containers(tree, lambda: same(head + fz.repickle(tree)), budget)
                payload, structured = fz.repickle(tree), True
        except BaseException as exc:  # not a tree we can pickle back: bytes only
            print(f"(tree minimization skipped: {type(exc).__name__}: {exc})")
    elif target.name == "delta" and fz.split_container(payload) is not None:
        body, header = fz.split_container(payload)

        def rebuilt() -> bytes:
            return fz.join_container(body, fz.json_dumps(header))

        if same(head + rebuilt()):
            _shrink_containers(header, lambda: same(head + rebuilt()), budget)
            payload, structured = rebuilt(), False  # the coded blobs before the header can go too
    elif i in target.json_slots():
        doc = fz.json.loads(payload)
        if same(head + fz.json_dumps(doc)):
            _shrink_containers(doc, lambda: same(head + fz.json_dumps(doc)), budget)
            payload, structured = fz.json_dumps(doc), True
    if force_bytes or not structured:
        kept = _ddmin(list(payload), lambda sub: same(head + bytes(sub)), budget)
        payload = bytes(kept)
    scratch = str(fz.WORK.root).encode()  # no machine paths in a regression file
    if scratch in payload and same(head + payload.replace(scratch, b".")):
        payload = payload.replace(scratch, b".")
    return head + payload


def cmd_minimize(args: argparse.Namespace) -> int:
    _load()
    target = fz.TARGETS[args.target]
    src = Path(args.file)
    data = src.read_bytes()
    out = Path(args.output) if args.output else src.with_suffix(".min.bin")
    result = minimize(target, data, args.budget, args.hang, force_bytes=args.bytes)
    out.write_bytes(result)
    sig, _ = outcome(target, result, args.hang, cpu_clock=False)
    print(f"{src}: {len(data)} -> {len(result)} bytes, {sig}\n-> {out}")
    return 0


def cmd_promote(args: argparse.Namespace) -> int:
    _load()
    target = fz.TARGETS[args.target]
    data = Path(args.file).read_bytes()
    sig, _ = outcome(target, data, args.hang, cpu_clock=False)
    if sig is None:
        raise SystemExit(f"{args.file} does not fail in {target.name}: not a regression case")
    dest = ROOT / "tests" / "fuzz_regressions" / target.name / f"{args.name}.bin"
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(args.file, dest)
    print(f"{dest.relative_to(ROOT)}: {len(data)} bytes, {sig}")
    return 0


def main() -> int:
    argv = sys.argv[1:]
    libfuzzer = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the targets and their slots")
    r = sub.add_parser("run", help="fuzz one target with atheris")
    r.add_argument("target")
    r.add_argument("--time", type=int, default=300, help="seconds to fuzz (0: no limit)")
    r.add_argument("--runs", type=int, default=0, help="inputs to run (0: no limit)")
    r.add_argument("--rss-mb", type=int, default=6144, help="libFuzzer's RSS limit, a backstop (MiB)")
    a = sub.add_parser("all", help="fuzz every target (or those named) in turn, one process each")
    a.add_argument("targets", nargs="*")
    a.add_argument("--time", type=int, default=120, help="seconds per target")
    s = sub.add_parser("sweep", help="random structure-aware inputs without atheris")
    s.add_argument("targets", nargs="*")
    s.add_argument("--time", type=int, default=30, help="seconds per target")
    s.add_argument("--seed", type=int, default=0)
    sub.add_parser("findings", help="list the findings kept so far")
    mem = sub.add_parser("_memory")  # internal: where an input's memory goes, in a fresh process
    mem.add_argument("target")
    mem.add_argument("file")
    m = sub.add_parser("minimize", help="shrink a finding, keeping its signature")
    m.add_argument("target")
    m.add_argument("file")
    m.add_argument("-o", "--output")
    m.add_argument("--budget", type=float, default=180, help="seconds to spend")
    m.add_argument("--bytes", action="store_true", help="shrink the bytes even after the tree or document")
    pr = sub.add_parser("promote", help="copy a (minimized) finding to tests/fuzz_regressions/<target>/")
    pr.add_argument("target")
    pr.add_argument("file")
    pr.add_argument("name")
    for parser in (r, a, s, m, pr, mem):
        parser.add_argument("--hang", type=float, default=10, help="seconds of CPU (wall when minimizing) per input")
    args = p.parse_args(argv)
    args.libfuzzer = libfuzzer
    if args.cmd == "list":
        for name, target in _load().TARGETS.items():
            print(name)
            for i, slot in enumerate(target.slots):
                print(f"  {i}: {slot} ({slot.kind}{', tree: ' + slot.allow if slot.allow else ''})")
        return 0
    return {"run": cmd_run, "all": cmd_all, "sweep": cmd_sweep, "findings": cmd_findings, "minimize": cmd_minimize,
            "promote": cmd_promote, "_memory": cmd_memory}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
