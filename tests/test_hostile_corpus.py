"""The hostile corpus (``tests/hostile/``): every case and every damaged copy gets its verdict,
no payload runs, nothing exits 0 on a broken checkpoint, no traceback, no hang.

The corpus runs in two processes (``python -m tests.hostile.run --shard K/2``), each under an
address-space limit and a per-command time limit; this module judges what they recorded.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from typing import Any

import pytest

from tests.conftest import ROOT
from tests.hostile.corpus import CASES, EVIL, LIVE, LIVE_TRICKS, MARKER, OPCODE_TRICKS, PROTOCOL0, Case, inject, payload

SHARDS = 2


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("hostile")
    procs = []
    for k in range(SHARDS):
        cmd = [sys.executable, "-m", "tests.hostile.run", "--out", str(out), "--shard", f"{k}/{SHARDS}",
               "--results", str(out / f"records{k}.json")]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    recs: list[dict[str, Any]] = []
    for k, proc in enumerate(procs):
        log, _ = proc.communicate(timeout=1200)
        assert proc.returncode == 0, log[-3000:]
        data = json.loads((out / f"records{k}.json").read_text())
        print(f"shard {k}/{SHARDS}: {data['summary']}")
        recs += data["records"]
    return recs


def _first_errors(rec: dict[str, Any]) -> list[str]:
    return [ln for ln in rec["stderr"].splitlines() if ln.startswith("error:")]


def judge(rec: dict[str, Any], case: Case | None) -> list[str]:
    """What is wrong with one command's outcome (empty: nothing)."""
    problems = []
    if rec["payload_ran"]:
        problems.append("a payload ran")
    if rec["hang"]:
        problems.append(f"no verdict within the time limit ({rec['seconds']} s)")
    if rec["crash"]:
        problems.append(f"crashed: {rec['crash'][-400:]}")
    if rec["exit"] == 3 and len(_first_errors(rec)) != 1:
        problems.append(f"exit 3 with {len(_first_errors(rec))} error lines, not one")
    if case is None:  # a sweep: damage must be noticed (a flip without a seal only never crash)
        if rec["must_fail"] and rec["exit"] not in (1, 3):
            problems.append(f"exit {rec['exit']} on a damaged checkpoint")
        return problems
    want = case.expect[rec["command"]]
    allowed = want.exit if isinstance(want.exit, tuple) else (want.exit,)
    if rec["exit"] not in allowed:
        problems.append(f"exit {rec['exit']}, expected {want.exit}")
    text = rec["stderr"] + rec["stdout"]
    problems += [f"message lacks {s!r}" for s in want.says if s not in text]
    if want.rule and want.rule not in rec["rules"]:
        problems.append(f"no {want.rule} finding (found {rec['rules']})")
    return problems


def test_the_corpus_gets_its_verdicts(records, capsys):
    by_case = {c.name: c for c in CASES}
    failures: list[str] = []
    counts: Counter[str] = Counter()
    for rec in records:
        case = by_case.get(rec["case"])
        broken = rec["must_fail"] if case is None else "valid" not in case.tags
        counts["runs"] += 1
        counts["sweep runs" if case is None else "case runs"] += 1
        counts["payloads executed"] += rec["payload_ran"]
        counts["exit 0 on a broken checkpoint"] += broken and rec["exit"] == 0
        counts["tracebacks or internal errors"] += bool(rec["crash"])
        counts["hangs"] += rec["hang"]
        failures += [f"{rec['case']} [{rec['command']}]: {p}" for p in judge(rec, case)]
    seen = {rec["case"] for rec in records if rec["case"] in by_case}
    assert seen == set(by_case), f"cases that did not run: {sorted(set(by_case) - seen)}"
    summary = (
        f"hostile corpus: {len(by_case)} cases, {counts['case runs']} case runs, {counts['sweep runs']} sweep runs; "
        f"payloads executed {counts['payloads executed']}, exit 0 on broken {counts['exit 0 on a broken checkpoint']}, "
        f"tracebacks {counts['tracebacks or internal errors']}, hangs {counts['hangs']}; "
        f"slowest {max(r['seconds'] for r in records):.1f} s"
    )
    with capsys.disabled():  # in the test output itself, not only in a failure's captured log
        print("\n" + summary)
    assert failures == [], "\n".join(failures[:40])
    assert counts["payloads executed"] == counts["tracebacks or internal errors"] == counts["hangs"] == 0


def test_the_sweeps_cover_every_file_of_one_fixture_per_format(records):
    from tests.hostile.corpus import SWEEP_FIXTURES, sweep

    runs = Counter(rec["sweep"] for rec in records if "sweep" in rec)
    for fixture in SWEEP_FIXTURES:
        damages = sweep(fixture)
        truncations = sum(d.kind == "trunc" for d in damages)
        assert runs[fixture] == truncations + 2 * (len(damages) - truncations), fixture  # flips: sealed + not
        assert len(damages) - truncations == 64


@pytest.mark.parametrize("tag", [*LIVE, *LIVE_TRICKS, "protocol 0"])
def test_the_payloads_are_live(tag, tmp_path, monkeypatch):
    """What the corpus plants would run under plain ``pickle.loads``, so 'no payload ran' means
    ckpttool refused it, not that it was harmless."""
    import pickle

    if tag == "protocol 0":
        blob = PROTOCOL0
    else:
        blob = inject(pickle.dumps(None, protocol=2), payload(*EVIL[tag]) if tag in EVIL else OPCODE_TRICKS[tag])
    monkeypatch.chdir(tmp_path)
    pickle.loads(blob)  # the point of the test: plain pickle runs it
    assert (tmp_path / MARKER).exists()
