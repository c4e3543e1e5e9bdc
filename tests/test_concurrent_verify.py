"""``verify`` while a DCP save is still being written (issue 8): never ``ok`` before the save commits.

A real ``torch.distributed.checkpoint.save`` (one process, no process group) runs in a subprocess
with a ``FileSystemWriter`` slowed down at each stage of a real save: a pause after it creates the
directory, one before each item it writes, one after the data files are written (where rank 0 of a
real save waits for the other ranks' results) and one (at least 2.5 s) before it renames
``.metadata.tmp`` to ``.metadata`` (the commit). Meanwhile ``ckpttool verify DIR --json`` runs in a loop. Every verdict
that ended before the commit must be non-ok: exit 3 (nothing to evaluate yet: no directory, an
empty one) or exit 1 with the rule ``incomplete-save``. Verdicts that began after the commit must
be exit 0. Each test prints how many verdicts it took in each state of the directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, cli_env, run_cli

# argv: checkpoint dir, marker prefix, items, pause (s), seed, single file per rank (1/0), threads,
# settle (s: the pause after the data files are written; default 8 pauses).
# It creates <prefix>.started just before it opens its first data file and <prefix>.committed just
# after the rename of .metadata.tmp to .metadata.
WRITER = r"""
import sys, time, warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

ckpt, marker, items, pause, seed, single, threads, settle = sys.argv[1:9]
items, pause, seed, threads, settle = int(items), float(pause), int(seed), int(threads), float(settle)
warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process", overwrite


class SlowPlanner:
    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def resolve_data(self, write_item):  # called once per item, while its file is open
        time.sleep(pause)
        return self._inner.resolve_data(write_item)


class SlowWriter(FileSystemWriter):
    def prepare_local_plan(self, plan):
        plan = super().prepare_local_plan(plan)  # creates the directory
        time.sleep(8 * pause)
        return plan

    def write_data(self, plan, planner):
        open(marker + ".started", "w").close()
        return super().write_data(plan, SlowPlanner(planner))

    def finish(self, metadata, results):
        rename = self.fs.rename

        def commit(src, dst):  # .metadata.tmp is written; the rename commits the save
            time.sleep(max(8 * pause, 2.5))  # long enough for whole verify runs to see this state
            rename(src, dst)
            open(marker + ".committed", "w").close()

        self.fs.rename = commit
        time.sleep(settle)  # as rank 0 waits for the other ranks' write results
        super().finish(metadata, results)


g = torch.Generator().manual_seed(seed)
state = {f"layers.{i}.weight": torch.randn(64, 64, generator=g) for i in range(items)}
state["step"] = 7 + seed
state["extra"] = {"lr": 0.1, "note": "x"}
dcp.save(
    state,
    storage_writer=SlowWriter(
        ckpt, single_file_per_rank=single == "1", per_thread_copy_ahead=0, thread_count=threads, sync_files=False
    ),
)
"""


def _state(ckpt: Path) -> str:
    """What is on disk now, as a reader sees it."""
    if not ckpt.is_dir():
        return "no directory"
    names = set(os.listdir(ckpt))
    has_data = any(n.endswith(".distcp") for n in names)
    if ".metadata.tmp" in names:
        return "data + .metadata.tmp" + (" + old .metadata" if ".metadata" in names else "")
    if ".metadata" in names:
        return "data + .metadata"
    return "data files, no .metadata" if has_data else "empty directory"


def _verify(ckpt: Path) -> tuple[int, list[str], str]:
    r = run_cli("verify", ckpt, "--json", cwd=ROOT)
    rules: list[str] = []
    if r.stdout.strip():
        rules = sorted({f["rule"] for f in json.loads(r.stdout).get("findings", []) if f["severity"] == "error"})
    return r.code, rules, r.stderr.strip()


def _writer(
    ckpt: Path,
    marker: Path,
    *,
    items: int,
    pause: float,
    seed: int,
    single: bool = True,
    threads: int = 1,
    settle: float | None = None,
) -> subprocess.Popen:
    settle = 8 * pause if settle is None else settle
    argv = [str(ckpt), str(marker), str(items), str(pause), str(seed), "1" if single else "0", str(threads)]
    argv.append(str(settle))
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, *argv],
        cwd=ROOT,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _watch_save(ckpt: Path, tmp: Path, *, over_old: bool = False, **save: Any) -> tuple[Counter[str], list[str]]:
    """Run the slow save and verify in a loop until it commits; returns the verdicts counted by
    (when, state seen just before the verify, exit code, error rules) and the violations.

    A verdict is "in progress" when the verify ended before the commit and, over an old checkpoint,
    began after the writer started rewriting it (before that the directory is the old, complete
    checkpoint and ok is right); it must then be exit 3, or exit 1 with incomplete-save. A verdict
    that began after the commit must be exit 0; one that spans the commit may say either."""
    marker = tmp / f"save-{save['seed']}"
    started, committed = Path(f"{marker}.started"), Path(f"{marker}.committed")
    writer = _writer(ckpt, marker, **save)
    tally: Counter[str] = Counter()
    problems: list[str] = []
    try:
        while True:
            state = _state(ckpt)
            began_started, began_committed = started.exists(), committed.exists()
            code, rules, err = _verify(ckpt)
            if began_committed:
                when = "after the commit"
                if code != 0:
                    problems.append(f"after the commit ({state}): exit {code} {rules} {err[-200:]}")
            elif committed.exists():
                when = "across the commit"
            elif over_old and not began_started:
                when = "old checkpoint"
            else:
                when = "in progress"
                if code == 0:
                    problems.append(f"verify said ok while the save was in progress (state before it: {state})")
                elif code == 1 and "incomplete-save" not in rules:
                    problems.append(f"exit 1 without incomplete-save while the save was in progress ({state}): {rules}")
                elif code == 3 and state not in ("no directory", "empty directory"):
                    problems.append(f"exit 3 (could not evaluate) with files to judge ({state}): {err[-200:]}")
                elif code not in (1, 3):
                    problems.append(f"exit {code} while the save was in progress ({state}): {err[-200:]}")
            tally[f"{when:17s} | {state:28s} | exit {code} {','.join(rules)}"] += 1
            if began_committed:
                break
            # one verdict before the writer does anything is enough: wait for its mkdir, or (over an
            # old checkpoint) for it to open its first data file
            waiting = (lambda: not started.exists()) if over_old else (lambda: not ckpt.exists())
            while waiting() and writer.poll() is None:
                time.sleep(0.01)
            if writer.poll() is not None and not committed.exists():
                break
        writer.wait(timeout=120)
    finally:
        if writer.poll() is None:
            writer.kill()
        _, err = writer.communicate()
    assert writer.returncode == 0, err[-2000:]
    return tally, problems


ORDER = ["old checkpoint", "in progress", "across the commit", "after the commit"]


def _print(capsys, title: str, tally: Counter[str]) -> None:
    with capsys.disabled():
        print(f"\n{title}: {sum(tally.values())} verdicts")
        for key, n in sorted(tally.items(), key=lambda kv: (ORDER.index(kv[0].split("|")[0].strip()), kv[0])):
            print(f"  {n:3d}  {key}")


def test_verify_never_ok_during_a_save(tmp_path, capsys):
    """A fresh save (one file per rank): no directory, an empty one, a growing __0_0.distcp, a
    written .metadata.tmp, then the committed .metadata."""
    ckpt = tmp_path / "step_7"
    tally, problems = _watch_save(ckpt, tmp_path, items=12, pause=0.08, seed=0)
    _print(capsys, "verify during a DCP save (single file per rank)", tally)
    assert not problems, "\n".join(problems)
    states = {key.split("|")[1].strip() for key in tally if key.startswith("in progress")}
    assert "data files, no .metadata" in states, tally  # the loop did watch the write
    assert "data + .metadata.tmp" in states, tally  # and the written, uncommitted metadata
    code, rules, err = _verify(ckpt)
    assert code == 0, (rules, err)


@pytest.mark.slow
def test_verify_never_ok_during_a_per_item_threaded_save(tmp_path, capsys):
    """One file per item written by two threads: the directory fills up file by file."""
    ckpt = tmp_path / "step_7"
    tally, problems = _watch_save(ckpt, tmp_path, items=30, pause=0.1, seed=0, single=False, threads=2)
    _print(capsys, "verify during a DCP save (one file per item, two threads)", tally)
    assert not problems, "\n".join(problems)
    assert any(k.startswith("in progress") and "data files, no .metadata" in k for k in tally), tally
    assert _verify(ckpt)[0] == 0


@pytest.mark.slow
def test_verify_never_ok_during_a_save_over_an_old_checkpoint(tmp_path, capsys):
    """DCP saves into a directory that holds an earlier checkpoint (FileSystemWriter overwrites by
    default): the old .metadata stays until the new one is committed, while the data files under it
    are rewritten with other values of the same shapes. Until the commit the directory is neither
    checkpoint, and verify must not call it ok, not even once the new data files have their full
    sizes (held 2.5 s here, as rank 0 of a real save waits for the other ranks). verify tells by
    the files' times: data written well after the metadata that describes them."""
    ckpt = tmp_path / "step_7"
    first = _writer(ckpt, tmp_path / "first", items=20, pause=0.0, seed=0)
    assert first.wait(timeout=120) == 0, first.communicate()[1]
    for f in ckpt.iterdir():  # the earlier save finished ten minutes ago, as between real saves
        st = f.stat()
        os.utime(f, (st.st_atime - 600, st.st_mtime - 600))
    assert _verify(ckpt)[0] == 0
    tally, problems = _watch_save(ckpt, tmp_path, over_old=True, items=20, pause=0.1, seed=1, settle=2.5)
    _print(capsys, "verify during a DCP save over an earlier checkpoint", tally)
    assert not problems, "\n".join(problems)
    assert any(k.startswith("in progress") and "| data + .metadata " in k for k in tally), tally  # watched it
    assert _verify(ckpt)[0] == 0


@pytest.mark.parametrize("sub", ["", "iter_0000003"], ids=["save-dir", "iter-dir"])
def test_data_newer_than_its_metadata_in_a_megatron_save(sub, tmp_path):
    """torch_dist given by its save directory (the manifest's root is then the iteration folder):
    a data file rewritten after the metadata is found just as when the folder is given."""
    import shutil

    from tests.conftest import FIXTURES

    ckpt = tmp_path / "dist"
    shutil.copytree(FIXTURES / "megatron" / "dist_tp2pp2", ckpt)
    now = time.time()
    for f in ckpt.rglob("*"):
        os.utime(f, (now - 600, now - 600))
    assert _verify(ckpt / sub)[0] == 0
    os.utime(ckpt / "iter_0000003" / "__1_0.distcp", (now, now))
    code, rules, err = _verify(ckpt / sub)
    assert code == 1 and "incomplete-save" in rules, (code, rules, err)
