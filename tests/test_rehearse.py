"""rehearse with the reference harness: exact replay, and each kind of broken resume named."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from ckpttool.rehearse import HarnessError, rehearse
from tests.conftest import assert_clean, run_cli

H = "ckpttool.harness.tinygpt:factory"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from ckpttool.harness.tinygpt import train

    out = tmp_path_factory.mktemp("run")
    train(out, steps=30, save_every=10, k=5, omit=None, device="cpu")
    return out


@pytest.mark.parametrize("step", [10, 20])
def test_clean_checkpoints_replay_bit_for_bit(trained, step):
    r = run_cli("rehearse", trained / f"step_{step}", "--harness", H, "--json")
    assert r.code == 0, r.stdout + r.stderr
    data = json.loads(r.stdout)
    assert data["ok"] and data["trajectory"] and data["runs"] == 2
    assert data["losses"][0] == data["losses"][1]  # two fresh processes, same bits
    traj = json.loads((trained / f"step_{step}" / "ckpttool.trajectory.json").read_text())
    assert data["losses"][0] == [s["loss"] for s in traj["steps"]]  # and the recorded run's bits


@pytest.mark.parametrize("omit", ["rng", "dataloader", "scheduler", "optimizer"])
def test_each_missing_component_is_named(omit, tmp_path):
    from ckpttool.harness.tinygpt import train

    (ckpt,) = train(tmp_path, steps=10, save_every=10, k=3, omit=omit, device="cpu")
    r = run_cli("rehearse", ckpt, "--harness", H, "--steps", "3", "--json")
    assert r.code == 1
    findings = json.loads(r.stdout)["findings"]
    assert [f["component"] for f in findings] == [omit]
    assert findings[0]["step"] == 1


def test_rank_shard_layout(tmp_path):
    from ckpttool import registry
    from ckpttool.harness.tinygpt import train

    (ckpt,) = train(tmp_path, steps=10, save_every=10, k=3, omit=None, device="cpu", layout="rankshards")
    adapter, m = registry.describe(ckpt)
    assert adapter.name == "rankshards" and m.step == 10 and m.missing_state() == []
    assert rehearse(ckpt, H, steps=3).ok


def test_restore_that_silently_skips_a_component(trained):
    report = rehearse(trained / "step_10", "tests._buggy_harness:forgets_rng", steps=3)
    assert [f.component for f in report.findings] == ["rng"]
    assert "differs from the saved run" in report.findings[0].message


def test_blame_by_forcing_each_component(trained):
    report = rehearse(trained / "step_10", "tests._buggy_harness:loader_skips", steps=3)
    assert [f.component for f in report.findings] == ["dataloader"]
    assert "forcing it to the saved run's state makes replay match" in report.findings[0].message


def test_nondeterministic_runs_are_reported(trained):
    """Runs that do not replay each other are named; no component is blamed for the divergence from
    the recorded trajectory (a forced run, itself nondeterministic, would prove nothing), and no
    forced run is started."""
    report = rehearse(trained / "step_10", "tests._buggy_harness:hidden_stream", steps=2)
    assert not report.ok
    assert any("not deterministic" in f.message for f in report.findings)
    assert [f.component for f in report.findings] == [None, None]
    assert "no component is blamed, as the runs do not replay each other" in report.findings[-1].message
    assert len(report.runs) == 2


def test_missing_parameter_exits_3_naming_it(trained, tmp_path):
    import torch.distributed.checkpoint as dcp

    from ckpttool.harness.tinygpt import TinyGPTHarness

    h = TinyGPTHarness()
    state = h.state()
    del state["model"]["head.weight"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=tmp_path / "ck")
    with pytest.raises(HarnessError, match="model.head.weight"):
        rehearse(tmp_path / "ck", H, steps=1, runs=2)
    r = run_cli("rehearse", tmp_path / "ck", "--harness", H)
    assert r.code == 3 and "model.head.weight" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("where", ["metadata", "bytes item"])
def test_a_hostile_checkpoint_never_reaches_the_harness(where, trained, tmp_path):
    """The harness loads with torch (real unpickling): ckpttool's own reader goes first, whether the
    payload is in ``.metadata`` (the reader refuses the file) or in a bytes item (the reader marks
    the item unloadable and rehearse refuses it)."""
    import shutil

    from tests.conftest import FIXTURES
    from tests.hostile.corpus import EVIL, MARKER, inject, payload

    ck = tmp_path / "ck"
    if where == "metadata":
        shutil.copytree(trained / "step_10", ck)
        md = ck / ".metadata"
        md.write_bytes(inject(md.read_bytes(), payload(*EVIL["os_system"])))
    else:
        shutil.copytree(FIXTURES / "hostile" / "dcp_bytes_item_os_system", ck)
    r = run_cli("rehearse", ck, "--harness", H, cwd=tmp_path)
    assert r.code == 3 and "posix.system" in r.stderr and "refused without running it" in r.stderr
    assert not (tmp_path / MARKER).exists()


def test_bad_harness_spec(trained):
    assert run_cli("rehearse", trained / "step_10", "--harness", "no_colon").code == 2
    r = run_cli("rehearse", trained / "step_10", "--harness", "no.such.module:factory")
    assert r.code == 3 and "cannot build the harness no.such.module:factory" in r.stderr


@pytest.mark.gpu
def test_cuda_replay(tmp_path):
    from ckpttool.harness.tinygpt import train

    (ckpt,) = train(tmp_path, steps=10, save_every=10, k=3, omit=None, device="cuda")
    assert rehearse(ckpt, H, steps=3, device="cuda").ok


def test_a_tolerance_is_checked_and_named_in_the_verdict(trained, tmp_path):
    """--tolerance nan passed every comparison and a negative one failed two equal losses; a
    replay within a tolerance was called "bit-identical" though its losses differed."""
    import shutil

    for bad in ("nan", "-1", "inf"):
        r = run_cli("rehearse", trained / "step_20", "--harness", H, "--tolerance", bad)
        assert r.code == 2 and "a tolerance is a finite number" in r.stderr, (bad, r.stderr)
    ckpt = tmp_path / "step_20"
    shutil.copytree(trained / "step_20", ckpt)
    traj_file = ckpt / "ckpttool.trajectory.json"
    traj = json.loads(traj_file.read_text())
    traj["steps"][2]["loss"] = (float.fromhex(traj["steps"][2]["loss"]) * (1 + 1e-4)).hex()
    for s in traj["steps"][1:]:
        s["digests"] = {}  # (past step 1 a tolerance compares losses only)
    traj_file.write_text(json.dumps(traj))
    assert run_cli("rehearse", ckpt, "--harness", H, "--runs", "1").code == 1
    r = run_cli("rehearse", ckpt, "--harness", H, "--runs", "1", "--tolerance", "0.01")
    assert r.code == 0 and "replay matches within --tolerance 0.01" in r.stdout and "bit-identical" not in r.stdout, r.stdout
    data = json.loads(run_cli("rehearse", ckpt, "--harness", H, "--runs", "1", "--tolerance", "0.01", "--json").stdout)
    assert data["ok"] and data["tolerance"] == 0.01


@pytest.mark.parametrize(
    "text", ['{"components": ', '{"steps": []}', '[1, 2]', '{"components": {}, "steps": [{"loss": "x"}]}']
)
def test_a_damaged_trajectory_is_named(text, trained, tmp_path):
    """A trajectory file cut short or of another shape was an internal error (JSONDecodeError,
    KeyError 'components')."""
    import shutil

    ckpt = tmp_path / "step_20"
    shutil.copytree(trained / "step_20", ckpt)
    (ckpt / "ckpttool.trajectory.json").write_text(text)
    r = run_cli("rehearse", ckpt, "--harness", H, "--runs", "1")
    assert r.code == 3 and "ckpttool.trajectory.json: not a trajectory ckpttool can read" in r.stderr, r.stderr
    assert "internal error" not in r.stderr


def test_a_trajectory_with_decimal_losses_or_a_folder_in_its_place_is_named(trained, tmp_path):
    """A loss written as a decimal ("1.5") passed the shape check: float.fromhex reads it as hex
    digits (1.3125), so a run that replayed the same loss was said to diverge. A folder standing
    where the trajectory is kept was taken for no trajectory: the runs were compared with each
    other only, the saved run never. Both are named, exit 3."""
    import shutil

    ckpt = tmp_path / "step_20"
    shutil.copytree(trained / "step_20", ckpt)
    traj_file = ckpt / "ckpttool.trajectory.json"
    traj = json.loads(traj_file.read_text())
    traj["steps"][0]["loss"] = repr(float.fromhex(traj["steps"][0]["loss"]))
    traj_file.write_text(json.dumps(traj))
    r = run_cli("rehearse", ckpt, "--harness", H, "--runs", "1")
    assert_clean(r, 3, "ckpttool.trajectory.json: not a trajectory ckpttool can read", "as float.hex writes it")
    traj_file.unlink()
    traj_file.mkdir()
    r = run_cli("rehearse", ckpt, "--harness", H)
    assert_clean(r, 3, "ckpttool.trajectory.json: expected the recorded trajectory, a JSON file; found a directory")


def test_findings_name_their_component_once_and_steps_past_the_trajectory_are_noted(trained, tmp_path):
    """The CLI printed "rng: rng: RNG state not restored" and "replay: replay differs"; --steps
    past the recorded trajectory compared those steps with nothing and said nothing of it."""
    from ckpttool.harness.tinygpt import train

    (ckpt,) = train(tmp_path, steps=10, save_every=10, k=3, omit="rng", device="cpu")
    r = run_cli("rehearse", ckpt, "--harness", H, "--steps", "3", "--runs", "1")
    assert r.code == 1 and "rng: RNG state not restored" in r.stdout and "rng: rng:" not in r.stdout, r.stdout
    (found,) = json.loads(run_cli("rehearse", ckpt, "--harness", H, "--steps", "3", "--runs", "1", "--json").stdout)["findings"]
    assert found["component"] == "rng" and found["message"].startswith("RNG state not restored"), found
    r = run_cli("rehearse", trained / "step_20", "--harness", H, "--steps", "7", "--runs", "1")
    assert r.code == 0 and "note: the saved run recorded 5 steps after the save: steps 6-7 are compared" in r.stdout, r.stdout


def test_a_nan_loss_is_within_no_tolerance(trained):
    """With --tolerance, a NaN loss matched the recorded finite one ("replay matches within
    --tolerance 0.01", exit 0): abs(nan - x) > tol * x is False."""
    report = rehearse(trained / "step_10", "tests._buggy_harness:NanLater", steps=3, tolerance=0.01)
    assert not report.ok and "at step 2 (loss nan vs" in report.findings[-1].message, report.findings


def test_with_a_tolerance_the_state_after_a_step_may_differ_in_its_last_bits(trained):
    """An update with noise in its last bits (GPU atomics) failed at step 1 even with --tolerance 0.5:
    the digests after the step were compared bit for bit. The losses are what the tolerance is for."""
    assert not rehearse(trained / "step_10", "tests._buggy_harness:NoisyUpdate", steps=3).ok
    assert rehearse(trained / "step_10", "tests._buggy_harness:NoisyUpdate", steps=3, tolerance=1e-3).ok


def test_what_a_harness_prints_is_no_part_of_the_result(trained):
    """The result was the last line of the run's stdout: a line the harness printed at exit made a
    healthy run "the harness process failed" or an internal error, and bytes that are not UTF-8 an
    internal UnicodeDecodeError."""
    assert rehearse(trained / "step_10", "tests._buggy_harness:Chatty", steps=2).ok


def test_a_harness_that_does_not_keep_the_protocol_is_named(trained):
    """restore() returning {} passed (every component counted as restored); a failure in a step was
    "the harness cannot restore this checkpoint", with a hint blaming the checkpoint."""
    with pytest.raises(HarnessError, match=r"restore\(\) returned \{\}; expected a dict giving True or False"):
        rehearse(trained / "step_10", "tests._buggy_harness:RestoresNothing", steps=1)
    r = run_cli("rehearse", trained / "step_10", "--harness", "tests._buggy_harness:FailsAtStep2", "-k", "3")
    assert r.code == 3 and "failed after restoring the checkpoint, in step 2: RuntimeError: out of memory" in r.stderr
    assert "cannot restore" not in r.stderr, r.stderr


def test_a_hung_harness_is_stopped_at_the_timeout_with_its_children(trained, tmp_path):
    """A harness that never returns (a collective whose peer died) held rehearse, and a CI job, for
    ever. With --timeout the run is stopped: exit 3 naming the limit and the harness's last output,
    and the processes it started are gone too. A limit that is no number of seconds is refused."""
    import os
    import time

    pidfile = tmp_path / "child.pid"
    start = time.monotonic()
    r = run_cli(
        "rehearse", trained / "step_10", "--harness", "tests._buggy_harness:HangsAtStep2", "-k", "3",
        "--timeout", "20", env={"HANG_PIDFILE": str(pidfile)}, timeout=240,
    )  # fmt: skip
    assert_clean(r, 3, "did not finish within --timeout 20 s", "waiting for the other ranks")
    assert time.monotonic() - start < 120
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:  # (gone, or a zombie nobody reaps: a container's first process may not)
            if Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                break
        except FileNotFoundError:
            break
        time.sleep(0.1)
    else:
        os.kill(child, 9)
        raise AssertionError("the harness's child process outlived the timeout")
    for bad in ("0", "-1", "nan"):
        assert_clean(run_cli("rehearse", trained / "step_10", "--harness", H, "--timeout", bad), 2, "--timeout")


def test_a_blame_that_cannot_be_tried_keeps_the_divergence(trained):
    """A harness without force() (optional, the docs say) turned a divergence found into exit 3,
    "the harness cannot restore this checkpoint: AttributeError: force"."""
    report = rehearse(trained / "step_10", "tests._buggy_harness:LoaderSkipsNoForce", steps=3)
    assert not report.ok and [f.component for f in report.findings] == [None]
    assert any("no component could be blamed" in n and "no force() method" in n for n in report.notes), report.notes


def test_one_run_and_no_trajectory_compares_nothing(trained, tmp_path):
    """--runs 1 without a recorded trajectory said "replay is bit-identical", exit 0, having
    compared nothing."""
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(trained / "step_10", ck)
    (ck / "ckpttool.trajectory.json").unlink()
    r = run_cli("rehearse", ck, "--harness", H, "--runs", "1")
    assert r.code == 2 and "--runs 1 with no recorded trajectory compares nothing" in r.stderr, r.stderr


def test_a_hostile_training_state_file_never_reaches_the_harness(trained, tmp_path):
    """A pickle beside the state that runs code (a Trainer's optimizer.pt, training_args.bin, which
    the resume loads with torch.load) reached the harness: only the items' pickles were checked."""
    import os
    import shutil

    import torch

    class _Runs:
        def __reduce__(self):
            return (os.system, ("true",))

    ck = tmp_path / "ck"
    shutil.copytree(trained / "step_10", ck)
    torch.save({"x": _Runs()}, ck / "training_args.bin")
    r = run_cli("rehearse", ck, "--harness", H, "-k", "1")
    assert r.code == 3 and "training_args.bin" in r.stderr and "the harness was not run" in r.stderr, r.stderr
