"""verify on damaged copies of real saves: Megatron-LM rank files swapped or copied over each other,
one rank's file from another step, torch_dist without common.pt; a plain copy's timestamps against
a save rewriting the checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest

from ckpttool import registry
from tests._zips import replace_member
from tests.conftest import FIXTURES, assert_clean, data_pkl, megatron_enums, run_cli, set_stored_crc, tree_digests

MG = FIXTURES / "megatron"


def _findings(path, *extra):
    r = run_cli("verify", path, "--json", *extra)
    assert "Traceback" not in r.stderr
    return r.code, json.loads(r.stdout)


def _rewrite_iteration(f, step: int) -> None:
    """Set a rank file's iteration, its modification time kept (a file from another save is not
    necessarily newer than the metadata: verify's in-flight check is another matter). The pickle is
    edited where it stores ``iteration``: torch.load would need megatron-core for the enums in
    ``args``, which CI does not install."""
    import pickletools
    import struct

    def change(pkl: bytes) -> bytes:
        ops = list(pickletools.genops(pkl))
        for i, (_, arg, _) in enumerate(ops):
            if arg == "iteration":
                at, end = next((o[2], ops[j + 1][2]) for j, o in enumerate(ops[i + 1 :], i + 1) if "INT" in o[0].name)
                return pkl[:at] + b"J" + struct.pack("<i", step) + pkl[end:]  # BININT
        raise AssertionError(f"{f}: no iteration in its pickle")

    st = os.stat(f)
    f.write_bytes(replace_member(f.read_bytes(), "/data.pkl", change))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))


def _rules(report):
    return [(f["rule"], f["file"]) for f in report["findings"] if f["severity"] == "error"]


@pytest.mark.parametrize("how", ["swapped", "copied"])
def test_a_rank_file_in_another_ranks_place_is_named(tmp_path, how):
    """Each legacy file's args record the rank that saved it; the rank layout says which rank saves
    each directory. Swapped TP rank directories (or one rank's file copied over another's) read as
    a valid checkpoint with the wrong tensors, and verify --deep said nothing."""
    ck = tmp_path / "ck"
    shutil.copytree(MG / "legacy_tp2pp2", ck)
    it = ck / "iter_0000003"
    if how == "swapped":
        (it / "mp_rank_00_000").rename(it / "x")
        (it / "mp_rank_01_000").rename(it / "mp_rank_00_000")
        (it / "x").rename(it / "mp_rank_01_000")
    else:
        shutil.copy(it / "mp_rank_00_000" / "model_optim_rng.pt", it / "mp_rank_01_000" / "model_optim_rng.pt")
    code, report = _findings(ck, "--deep")
    assert code == 1
    misplaced = [f for f in report["findings"] if f["rule"] == "misplaced-file"]
    files = sorted(f["file"] for f in misplaced)
    if how == "swapped":
        assert files == [
            "iter_0000003/mp_rank_00_000/model_optim_rng.pt",
            "iter_0000003/mp_rank_01_000/model_optim_rng.pt",
        ]
        assert "saved by rank 1 (which saves mp_rank_01_000)" in misplaced[0]["message"] + misplaced[1]["message"]
    else:
        assert files == ["iter_0000003/mp_rank_01_000/model_optim_rng.pt"]
        assert "saved by rank 0 (which saves mp_rank_00_000)" in misplaced[0]["message"]


@pytest.mark.parametrize("how", ["swapped", "copied"])
def test_sealed_files_swapped_or_copied_over_each_other_are_misplaced_not_corrupted(tmp_path, how):
    """Against a seal, two files swapped (or one copied over another) were each a checksum-mismatch
    with the hint "storage or transfer corruption", and the swapped Megatron rank file listed one
    weight twice among its changed bytes. Each file's bytes are another's sealed ones: said so."""
    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / "dcp" / "fsdp2_per_item", ck)
    assert run_cli("seal", ck).code == 0
    a, b = ck / "__0_26.distcp", ck / "__0_27.distcp"
    if how == "swapped":
        a.rename(ck / "x")
        b.rename(a)
        (ck / "x").rename(b)
    else:
        shutil.copy2(a, b)
    code, report = _findings(ck)
    found = sorted((f["rule"], f["file"]) for f in report["findings"])
    want = [("misplaced-file", "__0_26.distcp")] if how == "swapped" else [("misplaced-file", "__0_27.distcp")]
    assert code == 1 and found == want, report["findings"]  # (a swap: one finding naming both)
    said = " ".join(f["message"] for f in report["findings"])
    assert ("were swapped" if how == "swapped" else "__0_26.distcp was copied over __0_27.distcp") in said, said
    assert "storage or transfer" not in str(report["findings"])


@pytest.mark.parametrize(
    ("fixture", "copy_to"),
    [
        ("legacy_tp2ep2etp1_distopt", "mp_rank_01_001"),  # two rank files: one rank left in the args
        ("legacy_tp2ep2etp1", "mp_rank_01_001"),
        ("legacy_tp2pp2_distopt", "mp_rank_00_001"),  # its distrib_optim.pt, intact, was blamed
    ],
)
def test_a_rank_file_copied_over_the_other_is_named_where_few_or_distributed(tmp_path, fixture, copy_to):
    """With two rank files, one copied over the other left one rank in the args, which the check
    took for Megatron-LM's checkpoint saver (one process writes every file) and skipped: a warning
    naming the intact file, exit 0, and clean once sealed. The saver keeps no optimizer or RNG
    state, so files that do are the training ranks' own. With the distributed optimizer, the rank's
    intact distrib_optim.pt was blamed ("restore this rank's distrib_optim.pt"): the copied rank
    file is named, and seal refuses."""
    ck = tmp_path / "ck"
    shutil.copytree(MG / fixture, ck)
    it = ck / "iter_0000003"
    shutil.copy2(it / "mp_rank_00_000" / "model_optim_rng.pt", it / copy_to / "model_optim_rng.pt")
    code, report = _findings(ck)
    errors = [(f["rule"], f["file"]) for f in report["findings"] if f["severity"] == "error"]
    assert code == 1 and errors == [("misplaced-file", f"iter_0000003/{copy_to}/model_optim_rng.pt")], report
    assert "saved by rank 0 (which saves mp_rank_00_000)" in report["findings"][0]["message"]
    assert_clean(run_cli("seal", ck), 3, f"{copy_to}/model_optim_rng.pt was saved by rank 0")


def test_a_copied_rank_file_does_not_hide_a_missing_distrib_optim(tmp_path):
    """A rank file copied over another's, whose distrib_optim.pt was also gone: the missing file was
    reported as one that "does not fit the parameters the copied file gives it". Both are said."""
    ck = tmp_path / "ck"
    shutil.copytree(MG / "legacy_pp2_mtp_distopt", ck)
    it = ck / "iter_0000003"
    shutil.copy2(it / "mp_rank_00_001" / "model_optim_rng.pt", it / "mp_rank_00_000" / "model_optim_rng.pt")
    (it / "mp_rank_00_000" / "distrib_optim.pt").unlink()
    code, report = _findings(ck)
    found = sorted((f["rule"], f["file"]) for f in report["findings"] if f["severity"] == "error")
    assert code == 1 and found == [
        ("misplaced-file", "iter_0000003/mp_rank_00_000/model_optim_rng.pt"),
        ("missing-file", "iter_0000003/mp_rank_00_000/distrib_optim.pt"),
    ], report["findings"]


def test_every_clean_legacy_fixture_has_its_ranks_in_place():
    """No misplaced-file on any real save (layouts with PP, VPP, EP, ETP, CP-free, distributed optimizer)."""
    for ck in sorted(p for p in MG.iterdir() if p.is_dir() and p.name.startswith("legacy_")):
        _, report = _findings(ck)
        assert not [f for f in report["findings"] if f["rule"] == "misplaced-file"], ck.name


def test_a_rank_file_from_another_step_is_named(tmp_path):
    pytest.importorskip("torch")
    ck = tmp_path / "ck"
    shutil.copytree(MG / "legacy_tp2pp2", ck)
    _rewrite_iteration(ck / "iter_0000003" / "mp_rank_00_000" / "model_optim_rng.pt", 2)
    code, report = _findings(ck)
    assert code == 1
    assert _rules(report) == [("step-mismatch", "iter_0000003/mp_rank_00_000/model_optim_rng.pt")]
    assert report["step"] == 3  # what the other files, the directory and the tracker say


def test_every_file_of_another_step_disagrees_with_the_directory(tmp_path):
    """All rank files say 2 under iter_0000003/ (named by the tracker): the directory and the tracker
    are the odd ones out, and the step mismatch is still reported."""
    pytest.importorskip("torch")
    ck = tmp_path / "ck"
    shutil.copytree(MG / "legacy_tp2pp2", ck)
    for f in (ck / "iter_0000003").glob("mp_rank_*/model_optim_rng.pt"):
        _rewrite_iteration(f, 2)
    code, report = _findings(ck)
    assert code == 1
    assert sorted(_rules(report)) == [
        ("step-mismatch", "iter_0000003/"),
        ("step-mismatch", "latest_checkpointed_iteration.txt"),
    ]


def test_torch_dist_without_common_pt_is_a_missing_file(tmp_path):
    """megatron-core 0.16.1 saves common.pt with every torch_dist checkpoint and its load stops
    without it; the tensors alone verified clean before."""
    ck = tmp_path / "ck"
    shutil.copytree(MG / "dist_tp2", ck)
    (ck / "iter_0000003" / "common.pt").unlink()
    code, report = _findings(ck)
    assert code == 1
    assert _rules(report) == [("missing-file", "common.pt")]


@pytest.mark.parametrize("given", ["save", "iteration"])
def test_a_damaged_common_pt_is_named_from_the_path_given(given, tmp_path):
    """A report whose checkpoint could not be read (``root`` null) names files from the path given:
    a truncated common.pt of a save directory given was ``common.pt`` (as if beside the tracker),
    while the same report's incomplete-save named it ``iter_0000003/common.pt``."""
    ck = tmp_path / "ck"
    shutil.copytree(MG / "dist_tp2", ck)
    f = ck / "iter_0000003" / "common.pt"
    st = f.stat()
    f.write_bytes(f.read_bytes()[:5000])
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    code, report = _findings(ck if given == "save" else ck / "iter_0000003")
    rel = "iter_0000003/common.pt" if given == "save" else "common.pt"
    assert code == 1 and report["root"] is None
    assert [(f["rule"], f["file"]) for f in report["findings"]] == [("truncated-file", rel)], report["findings"]
    assert report["findings"][0]["message"].startswith(f"{rel}: cut short")


def _stamp(ck, order, start, step):
    """Give the files named in ``order`` modification times ``start``, ``start + step``, …"""
    import os

    for k, rel in enumerate(order):
        t = start + k * step
        os.utime(ck / rel, (t, t))


def test_a_plain_copy_is_not_an_incomplete_save(tmp_path):
    """cp -r without -p (or a download) writes .metadata first and the data files one after
    another, each seconds after the last: one stream of writes, not a save over an old checkpoint."""
    import time

    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / "dcp" / "fsdp2", ck)
    files = [".metadata", *sorted(p.name for p in ck.glob("*.distcp"))]
    _stamp(ck, files, time.time() - 600, 4.0)  # 16 s from the metadata to the last data file
    code, report = _findings(ck)
    assert code == 0, report["findings"]
    said = [f for f in report["findings"] if f["rule"] == "incomplete-save"]
    assert [f["severity"] for f in said] == ["warning"] and "a copy" in said[0]["message"]


def test_data_written_long_after_its_metadata_is_still_an_incomplete_save(tmp_path):
    """The first data file newer than the metadata came a minute after it, far longer than writing
    its bytes takes: a save rewriting the checkpoint, as before."""
    import time

    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / "dcp" / "fsdp2", ck)
    data = sorted(p.name for p in ck.glob("*.distcp"))
    now = time.time()
    _stamp(ck, [".metadata"], now - 600, 0)
    _stamp(ck, data, now - 540, 1.0)
    code, report = _findings(ck)
    assert code == 1 and [r for r, _ in _rules(report)] == ["incomplete-save"]


@pytest.mark.parametrize("how", ["rewritten", "tmp", "step"])
def test_seal_refuses_a_save_in_flight_or_of_mixed_steps(how, tmp_path):
    """seal sealed (exit 0) what verify fails as incomplete-save or step-mismatch, and verify
    against that seal then passed: with a seal it compares bytes and no longer reads times. seal
    now refuses such a checkpoint, naming every such file, and writes no seal."""
    import time

    ck = tmp_path / "ck"
    if how == "step":
        shutil.copytree(MG / "legacy_tp2pp2", ck)
        for rel in ("mp_rank_00_000", "mp_rank_01_001"):
            _rewrite_iteration(ck / "iter_0000003" / rel / "model_optim_rng.pt", 2)
        said = [
            "iter_0000003/mp_rank_00_000/model_optim_rng.pt claims step 2",
            "(and 1 more file likewise: iter_0000003/mp_rank_01_001/model_optim_rng.pt)",
            "a file of another save is mixed in",
        ]
    else:
        shutil.copytree(FIXTURES / "dcp" / "fsdp2", ck)
        if how == "tmp":
            (ck / ".metadata.tmp").write_bytes(b"")
            said = [".metadata.tmp: a writer's temporary metadata is present"]
        else:
            now = time.time()
            # every file saved at one time (not the checkout's: a fresh clone's are minutes old), one later
            _stamp(ck, sorted(p.name for p in ck.iterdir()), now - 600, 0)
            _stamp(ck, ["__2_0.distcp"], now - 60, 0)
            said = ["1 data file(s) were written after the metadata that describes them, by up to 540 s (__2_0.distcp)"]
    code, report = _findings(ck)
    assert code == 1, report
    r = run_cli("seal", ck)
    assert r.code == 3 and not (ck / "ckpttool.manifest.json").exists(), r.stdout
    assert all(s in " ".join(r.stderr.split()) for s in said), r.stderr
    assert "not sealed" in r.stderr and ("seal once the save has finished" in r.stderr) == (how != "step")
    assert run_cli("verify", ck).code == 1


def test_a_copys_seal_is_checked_against_the_copy_not_the_original(tmp_path):
    """The seal records the folder as `seal` was given it (relative to where it ran). Verifying a
    copy, with a file missing (the checkpoint then cannot be described), hashed the original's
    folder instead and reported it as an unsafe path: the copy's own damage went unseen."""
    src = tmp_path / "C"
    shutil.copytree(FIXTURES / "dcp" / "fsdp2", src)
    assert run_cli("seal", "C", cwd=tmp_path).code == 0
    copy = tmp_path / "D"
    shutil.copytree(src, copy)
    (copy / "__1_0.distcp").unlink()
    with open(copy / "__0_0.distcp", "r+b") as f:
        f.seek(5000)
        b = f.read(1)
        f.seek(5000)
        f.write(bytes([b[0] ^ 0xFF]))
    r = run_cli("verify", "D", "--json", cwd=tmp_path)
    assert r.code == 1
    found = sorted((f["rule"], f["file"]) for f in json.loads(r.stdout)["findings"] if f["severity"] == "error")
    assert found == [("checksum-mismatch", "__0_0.distcp"), ("missing-file", "__1_0.distcp")]


def _rewrite(f, change) -> None:
    """Apply ``change`` to a rank file's saved dict, its modification time kept."""
    import os

    import torch

    st = os.stat(f)
    with warnings.catch_warnings(), megatron_enums():
        warnings.simplefilter("ignore")
        obj = torch.load(f, weights_only=False)
        change(obj)
        torch.save(obj, f)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_files_one_process_saved_are_not_misplaced(tmp_path):
    """Megatron-LM's tools/checkpoint saver writes every rank's file from one process: args.rank is
    0 in all of them, and it saves no optimizer or RNG state (``--no-save-optim --no-save-rng``
    in saver_base.py at core_v0.16.1). No rank file is in another's place. Files that do hold that
    state are the training ranks' own: one rank recorded in them all is a copy."""
    pytest.importorskip("torch")
    ck = tmp_path / "ck"
    shutil.copytree(MG / "legacy_tp2pp2", ck)

    def saver(o):
        o["args"].rank = 0
        o.pop("optimizer", None)
        o.pop("rng_state", None)

    for f in (ck / "iter_0000003").glob("mp_rank_*/model_optim_rng.pt"):
        _rewrite(f, saver)
    code, report = _findings(ck)
    assert code == 0 and not [f for f in report["findings"] if f["rule"] == "misplaced-file"], report["findings"]
    for f in (ck / "iter_0000003").glob("mp_rank_*/model_optim_rng.pt"):
        _rewrite(f, lambda o: o.update(rng_state=[{"random_rng_state": None}]))
    code, report = _findings(ck)
    misplaced = sorted(f["file"] for f in report["findings"] if f["rule"] == "misplaced-file")
    assert code == 1 and len(misplaced) == 3 and "mp_rank_00_000" not in str(misplaced), report["findings"]


def test_megatron_optimizer_steps_of_another_save_are_found(tmp_path):
    """The distributed optimizer keeps Adam's step in each rank file's param groups, a pickle value
    no item holds: one rank's set to 7 at iteration 3 (another save's state mixed in), or every
    rank's, passed with exit 0. One file off the others is an optimizer-mismatch error naming it;
    all ahead of the iteration, a step-mismatch warning."""
    pytest.importorskip("torch")
    ck = tmp_path / "ck"
    shutil.copytree(MG / "legacy_tp2pp2_distopt", ck)

    def seven(o):
        for g in o["optimizer"]["optimizer"]["param_groups"]:
            g["step"] = 7.0

    files = sorted((ck / "iter_0000003").glob("mp_rank_*/model_optim_rng.pt"))
    _rewrite(files[1], seven)
    code, report = _findings(ck)
    found = [(f["rule"], f["severity"], f["file"]) for f in report["findings"]]
    assert code == 1 and found == [("optimizer-mismatch", "error", "iter_0000003/mp_rank_00_001/model_optim_rng.pt")]
    assert "1 of 4 files keep optimizer steps other than the others' (3)" in report["findings"][0]["message"]
    for f in files:
        _rewrite(f, seven)
    code, report = _findings(ck)
    found = [(f["rule"], f["severity"]) for f in report["findings"]]
    assert code == 0 and found == [("step-mismatch", "warning")], report["findings"]
    assert "ahead of the checkpoint's step 3" in report["findings"][0]["message"]


@pytest.mark.parametrize("how", ["cp2", "tp-pp-dp mapping"])
def test_reshard_outputs_record_the_ranks_megatron_core_would(how, tmp_path):
    """The writer named each file's saving rank t + TP*e + TP*DP*p, which is megatron-core's only
    without context parallelism and without --use-tp-pp-dp-mapping: its outputs of such runs were
    then misplaced-file to verify (and refused by a second reshard)."""
    pytest.importorskip("torch")
    from ckpttool.formats.megatron import rank_of, saving_ranks

    src = "legacy_tp2pp2" if how == "cp2" else "legacy_tp2pp2dp2_tied_distopt"
    ck = tmp_path / "ck"
    shutil.copytree(MG / src, ck)
    files = sorted((ck / "iter_0000003").glob("mp_rank_*/model_optim_rng.pt"))
    args0 = None

    def redo(o):
        nonlocal args0
        a = o["args"]
        if how == "cp2":
            a.context_parallel_size, a.world_size = 2, a.world_size * 2
        else:
            a.use_tp_pp_dp_mapping = True
        args0 = a

    for f in files:
        _rewrite(f, redo)
    tp, pp = args0.tensor_model_parallel_size, args0.pipeline_model_parallel_size
    savers = saving_ranks(
        tp=tp, etp=tp, ep=1, pp=pp, cp=args0.context_parallel_size, world=args0.world_size,
        tp_pp_dp=bool(getattr(args0, "use_tp_pp_dp_mapping", False)),
    )  # fmt: skip
    for f in files:  # the ranks megatron-core itself would have recorded
        key = rank_of(f.parent.name, pp)
        _rewrite(f, lambda o, r=savers[key].rank: setattr(o["args"], "rank", r))
    assert _findings(ck)[0] == 0
    out = tmp_path / "out"
    r = run_cli("reshard", ck, "-o", out, "--tp", "1")
    assert r.code == 0, r.stderr
    code, report = _findings(out)
    assert code == 0, report["findings"]
    import torch

    outs = sorted((out / "iter_0000003").glob("mp_rank_*/model_optim_rng.pt"))
    with warnings.catch_warnings(), megatron_enums():
        warnings.simplefilter("ignore")
        got = {f.parent.name: torch.load(f, weights_only=False)["args"] for f in outs}
    a = next(iter(got.values()))
    opp = a.pipeline_model_parallel_size
    want = saving_ranks(
        tp=1, etp=1, ep=1, pp=opp, cp=a.context_parallel_size, world=a.world_size,
        tp_pp_dp=bool(getattr(a, "use_tp_pp_dp_mapping", False)),
    )  # fmt: skip
    assert {d: g.rank for d, g in got.items()} == {d: want[rank_of(d, opp)].rank for d in got}


def _patch_small_int(f, key: bytes, old: int, new: int) -> None:
    """Rewrite the small int (pickle BININT1) saved under ``key`` in a torch.save file's data.pkl
    from ``old`` to ``new``, with the member's CRC-32 made right again: a valid re-save, as a tool
    that edits a file in place leaves it (no deepspeed needed to unpickle it)."""
    import zlib

    data = bytearray(f.read_bytes())
    info, start = data_pkl(data)
    pkl = bytes(data[start : start + info.file_size])
    at = pkl.index(key)
    k = pkl.index(bytes([0x4B, old]), at)  # BININT1 old
    assert k - at < 24, "the value is not right after its key"
    data[start + k + 1] = new
    set_stored_crc(data, info, start, zlib.crc32(bytes(data[start : start + info.file_size])))
    f.write_bytes(bytes(data))


DS = FIXTURES / "deepspeed"


@pytest.mark.parametrize("where", ["subfolder", "save directory"])
def test_a_deepspeed_rank_file_moved_out_of_its_tag_is_missing(where, tmp_path):
    """DeepSpeed reads rank files from the tag directory only; one moved into a subfolder (or up
    into the save directory) was still read from there, and verify and seal passed."""
    ck = tmp_path / "ck"
    shutil.copytree(DS / "zero2", ck)
    name = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    to = ck / "global_step3" / "sub" if where == "subfolder" else ck
    to.mkdir(exist_ok=True)
    (ck / "global_step3" / name).rename(to / name)
    code, report = _findings(ck)
    assert code == 1 and _rules(report) == [("missing-file", f"global_step3/{name}")], report
    assert "found at" in report["findings"][0]["message"]
    assert run_cli("seal", ck).code == 3


def test_rank_0s_zero3_model_states_copied_over_another_ranks_is_misplaced(tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(DS / "zero3", ck)
    tag = ck / "global_step3"
    shutil.copy2(tag / "zero_pp_rank_0_mp_rank_00_model_states.pt", tag / "zero_pp_rank_1_mp_rank_00_model_states.pt")
    code, report = _findings(ck)
    assert code == 1
    assert _rules(report) == [("misplaced-file", "global_step3/zero_pp_rank_1_mp_rank_00_model_states.pt")], report


def test_a_deepspeed_step_rewritten_disagrees_with_its_tag(tmp_path):
    """global_steps rewritten in the model states (3 -> 4) verified clean: the tag DeepSpeed names a
    save by (global_step3) is a claim of its own. One file against the tag has no majority, and the
    finding says so rather than pick one."""
    ck = tmp_path / "ck"
    shutil.copytree(DS / "zero2", ck)
    _patch_small_int(ck / "global_step3" / "mp_rank_00_model_states.pt", b"global_steps", 3, 4)
    code, report = _findings(ck)
    assert code == 1
    (f,) = [f for f in report["findings"] if f["rule"] == "step-mismatch"]
    assert "no majority" in f["message"] and "global_step3/ claim 3" in f["message"], f


def test_torch_dist_common_pt_from_another_step_is_the_odd_one_out(tmp_path):
    """common.pt claiming 4 against the iteration directory and the tracker that named it (3): the
    step is 3 and common.pt is named. Before, the tracker was no claim, and the tie of directory
    and common.pt went to common.pt. Given the iteration directory itself, no tracker: no
    majority, said as such, and the step is the directory's."""
    ck = tmp_path / "ck"
    shutil.copytree(MG / "dist_tp2pp2", ck)
    _patch_small_int(ck / "iter_0000003" / "common.pt", b"\x00\x00iterationr", 3, 4)
    code, report = _findings(ck)
    assert code == 1 and report["step"] == 3
    assert _rules(report) == [("step-mismatch", "common.pt")], report
    code, report = _findings(ck / "iter_0000003")
    assert code == 1 and report["step"] == 3
    assert [f["message"] for f in report["findings"] if f["rule"] == "step-mismatch"] == [
        "the files disagree on the step, with no majority: iter_0000003/ claim 3; common.pt claim 4"
    ]


def test_torch_dist_without_metadata_json_is_a_missing_file(tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(MG / "dist_tp2pp2", ck)
    (ck / "iter_0000003" / "metadata.json").unlink()
    code, report = _findings(ck)
    assert code == 1 and _rules(report) == [("missing-file", "iter_0000003/metadata.json")], report


def test_a_rank_shard_metadata_step_that_disagrees_is_named(tmp_path):
    ck = tmp_path / "step_00000003"
    shutil.copytree(FIXTURES / "rankshards" / "tp_manual" / "step_00000003", ck)
    meta = json.loads((ck / "metadata.json").read_text())
    (ck / "metadata.json").write_text(json.dumps({**meta, "step": 4}))
    code, report = _findings(ck)
    assert code == 1 and report["step"] == 3
    assert _rules(report) == [("step-mismatch", "metadata.json")], report


def test_a_sealed_file_replaced_by_a_smaller_one_is_not_called_cut_short(tmp_path):
    """Another rank's (smaller) file copied over one was 'cut short (copy or save interrupted?)':
    the seal's piece digests show the bytes it still holds differ too; its digest is the other
    file's sealed one, which names the copy."""
    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / "dcp" / "fsdp2", ck)
    assert run_cli("seal", ck).code == 0
    shutil.copy2(ck / "__2_0.distcp", ck / "__1_0.distcp")
    code, report = _findings(ck)
    sealed = [f for f in report["findings"] if f["file"] == "__1_0.distcp" and f["rule"] == "misplaced-file"]
    assert code == 1 and sealed and "__2_0.distcp was copied over __1_0.distcp" in sealed[0]["message"], report
    with open(ck / "__1_0.distcp", "ab") as f:  # (not any sealed file's bytes: its pieces tell)
        f.write(b"\0")
    code, report = _findings(ck)
    sealed = [f for f in report["findings"] if f["file"] == "__1_0.distcp" and f["rule"] == "checksum-mismatch"]
    assert code == 1 and sealed and "another file in its place" in sealed[0]["message"], report
    assert not any("the seal says" in f["message"] for f in report["findings"])
    # one really cut short still is
    shutil.copytree(FIXTURES / "dcp" / "fsdp2", tmp_path / "t")
    assert run_cli("seal", tmp_path / "t").code == 0
    os.truncate(tmp_path / "t" / "__1_0.distcp", 20_000)
    code, report = _findings(tmp_path / "t")
    assert ("truncated-file", "__1_0.distcp") in _rules(report)
    assert any("the seal says 103,506: cut short" in f["message"] for f in report["findings"]), report


MASTERED = [  # fp32, bf16 and fp16 parameters, distributed optimizer or not, ZeRO-1/2/3 and universal
    "megatron/legacy_tp2pp2_distopt",
    "megatron/legacy_dp2_fp16_distopt",
    "megatron/dist_tp2pp2dp2_distopt",
    "megatron/dist_tp2_fp32_distopt",
    "megatron/legacy_tp2ep2_mtp_distopt",
    "deepspeed/zero2",
    "deepspeed/zero2_bf16",
    "deepspeed/zero3_bf16",
    "deepspeed/bf16_optimizer",
    "deepspeed/universal",
    "deepspeed/pipeline_tied",
    "deepspeed/pipeline_bf16",
]


@pytest.mark.parametrize("rel", MASTERED)
def test_every_fp32_master_rounds_to_its_parameter_in_real_checkpoints(rel):
    from ckpttool.verify import verify

    report = verify(FIXTURES / rel, deep=True)
    assert not [f for f in report.findings if "does not round to" in f.message], report.findings


def test_another_ranks_distributed_optimizer_file_is_found_with_deep(tmp_path):
    """mp_rank_00_001/distrib_optim.pt copied over mp_rank_01_001's (a TP swap inside one stage)
    verified clean: the file records no rank and its CRC-32s are its own. With --deep, the fp32
    masters it holds no longer round to the parameters of that rank's model file."""
    ck = tmp_path / "ck"
    shutil.copytree(MG / "legacy_tp2pp2_distopt", ck)
    it = ck / "iter_0000003"
    shutil.copy2(it / "mp_rank_00_001" / "distrib_optim.pt", it / "mp_rank_01_001" / "distrib_optim.pt")
    code, report = _findings(ck, "--deep")
    found = [f for f in report["findings"] if f["rule"] == "optimizer-mismatch"]
    assert code == 1 and found, report
    assert all("does not round to" in f["message"] for f in found)
    # the second stage's parameters that TP rank 1 holds: its layers and its share of the output layer
    assert {f["item"] for f in found} >= {"decoder.layers.2.mlp.linear_fc1.weight", "output_layer.weight"}


def test_a_temporary_of_any_commit_file_is_an_incomplete_save(tmp_path):
    """Only DCP's .metadata.tmp and metadata.json.tmp were named: a safetensors index left as
    model.safetensors.index.json.tmp (its shards then read as separate files) verified clean."""
    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / "safetensors" / "sharded", ck)
    (ck / "model.safetensors.index.json").rename(ck / "model.safetensors.index.json.tmp")
    code, report = _findings(ck)
    assert code == 1 and ("incomplete-save", "model.safetensors.index.json.tmp") in _rules(report), report


# offsets into dcp/fsdp2's .metadata where one flipped bit makes torch fail, found by flipping every
# fifth byte and comparing with torch's own unpickling: a memo reference that makes a _StorageInfo
# a dict key, planner_data paths that no longer spell their keys, a layout name, a memory format
@pytest.mark.parametrize(
    ("offset", "fragment"),
    [
        (29477, "unhashable type: '_StorageInfo'"),
        (15057, "planner_data"),
        (14431, "planner_data"),
        (245, "unknown torch layout"),
        (1245, "memory_format"),
    ],
)
def test_a_bit_flip_torch_fails_on_in_dcp_metadata_is_found(offset, fragment, tmp_path):
    """These verified clean, and seal sealed them; dcp_to_torch_save fails on each."""
    import pickle

    pytest.importorskip("torch.distributed.checkpoint")
    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / "dcp" / "fsdp2", ck)
    md = ck / ".metadata"
    st = os.stat(md)
    data = bytearray(md.read_bytes())
    data[offset] ^= 1
    md.write_bytes(data)
    os.utime(md, ns=(st.st_atime_ns, st.st_mtime_ns))
    try:  # the oracle: torch's classes, and torch's use of planner_data (keys are paths joined by dots)
        meta = pickle.loads(bytes(data))
        paths = meta.planner_data
        assert any(".".join(map(str, paths.get(k, ()))) != k for k in meta.state_dict_metadata)
    except AssertionError:
        raise
    except Exception:
        pass
    code, report = _findings(ck)
    errors = [f for f in report["findings"] if f["severity"] == "error"]
    assert code == 1 and [(f["rule"], f["file"]) for f in errors] == [("corrupt-file", ".metadata")], errors
    assert fragment in errors[0]["message"], errors[0]["message"]
    r = run_cli("seal", ck)
    assert r.code == 3 and ".metadata" in r.stderr and not (ck / "ckpttool.manifest.json").exists(), r.stderr


def test_an_empty_torch_save_file_is_a_truncated_file(tmp_path):
    """A save killed before its first write leaves a 0-byte file: it was 'not a checkpoint format'
    (exit 3), where a file cut short later is a finding (exit 1)."""
    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / "torch", ck)
    (ck / "train_state.pt").write_bytes(b"")
    code, report = _findings(ck / "train_state.pt")
    assert code == 1 and [(f["rule"], f["file"]) for f in report["findings"]] == [("truncated-file", "train_state.pt")]


@pytest.mark.parametrize(
    ("src", "rel", "rank"),
    [
        ("deepspeed/zero2", "global_step3/mp_rank_00_model_states.pt", 0),
        ("megatron/legacy_tp2pp2", "iter_0000003/mp_rank_01_001/model_optim_rng.pt", 1),
        ("rankshards/ddp", "shard_00001_of_00002.pt", 1),
        ("torch", "train_state.pt", None),
    ],
)
@pytest.mark.parametrize("zeros", [0, 70_000])
def test_a_rank_file_never_written_is_said_so(src, rel, rank, zeros, tmp_path):
    """A rank's torch.save file left empty (the save killed before its first write) or zeros (space
    allocated but never written: a crash, a full disk) was 'not a zip-format torch.save file (legacy
    pickle or something else)', hint 're-save it with a current torch'; a zeroed plain torch.save
    file was no checkpoint at all (exit 3). Its modification time is kept: only the bytes say it."""
    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / src, ck)
    f = ck / rel
    st = f.stat()
    f.write_bytes(bytes(zeros))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    code, report = _findings(ck / rel if src == "torch" else ck)
    found = [(x["rule"], x["file"], x["rank"]) for x in report["findings"] if x["severity"] == "error"]
    assert code == 1 and found == [("corrupt-file" if zeros else "truncated-file", rel, rank)], found
    said = report["findings"][0]["message"]
    assert ("starts with zero bytes" if zeros else "the file is empty (0 bytes)") in said, said


@pytest.mark.parametrize(("at", "rule"), [(0, "corrupt-file"), (28, "checksum-mismatch"), (70, "unsafe-pickle"),
                                          (1384, "corrupt-file")])  # fmt: skip
def test_a_damaged_dcp_record_names_its_file_and_the_message_its_offset(at, rule, tmp_path):
    """A DCP file holds a torch.save archive per record: the finding's file is the file (what a
    report groups and a user restores), the message says which record (``file@offset``)."""
    from ckpttool import registry

    path = tmp_path / "fsdp2"
    shutil.copytree(FIXTURES / "dcp" / "fsdp2", path)
    _, m = registry.describe(path)
    records = sorted({(p.file, p.locator["offset"]) for i in m.items.values() for p in i.pieces})
    file, offset = records[3]
    data = bytearray((path / file).read_bytes())
    data[offset + at] ^= 0x40
    (path / file).write_bytes(data)
    code, report = _findings(path)
    assert code == 1
    found = [f for f in report["findings"] if f["rule"] == rule]
    assert found and all(f["file"] == file for f in report["findings"] if f["file"]), report["findings"]
    assert f"{file}@{offset}" in found[0]["message"]


@pytest.mark.parametrize("how", ["swapped", "larger copied over", "smaller copied over", "renamed in a ring"])
def test_dcp_rank_files_in_each_others_places_are_named(how, tmp_path):
    path = tmp_path / "fsdp2"
    shutil.copytree(FIXTURES / "dcp" / "fsdp2", path)
    f = [path / f"__{r}_0.distcp" for r in range(4)]  # 81 434, 103 506, 89 572, 103 502 bytes
    data = [x.read_bytes() for x in f]
    moved = {"swapped": {0: 1, 1: 0}, "larger copied over": {0: 1}, "smaller copied over": {1: 0},
             "renamed in a ring": {0: 2, 2: 3, 3: 0}}[how]  # fmt: skip
    for dst, src in moved.items():
        times = os.stat(f[dst])
        f[dst].write_bytes(data[src])
        os.utime(f[dst], ns=(times.st_atime_ns, times.st_mtime_ns))  # (a file newer than .metadata: unfinished)
    code, report = _findings(path)
    assert code == 1
    (found,) = report["findings"]
    assert found["rule"] == "misplaced-file", found
    for dst, src in moved.items():
        if len(data[dst]) != len(data[src]):  # (3 and 1 are not told apart by their sizes)
            assert f"__{dst}_0.distcp ({len(data[src]):,} bytes) holds what the metadata places in __{src}_0" in found[
                "message"
            ]
    assert run_cli("seal", path).code == 3 and not (path / "ckpttool.manifest.json").exists()


def test_dcp_zstd_files_swapped_are_misplaced_and_a_file_cut_to_anothers_size_is_cut_short(tmp_path):
    """Compressed records start with zstd's magic, not a zip header. A file cut short exactly where
    another rank's records end (ranks 1 and 3 of fsdp2 have the same structure) has records where
    that rank's start too: only the places where the two differ tell a file in another's place."""
    z = tmp_path / "zstd"
    shutil.copytree(FIXTURES / "dcp" / "fsdp2_zstd", z)
    a, b = z / "__0_0.distcp", z / "__1_0.distcp"
    a_bytes, times = a.read_bytes(), os.stat(a)
    a.write_bytes(b.read_bytes())
    b.write_bytes(a_bytes)
    for x in (a, b):  # (a file newer than .metadata reads as unfinished)
        os.utime(x, ns=(times.st_atime_ns, times.st_mtime_ns))
    code, report = _findings(z)
    assert code == 1 and [f["rule"] for f in report["findings"]] == ["misplaced-file"]
    cut = tmp_path / "cut"
    shutil.copytree(FIXTURES / "dcp" / "fsdp2", cut)
    f = cut / "__1_0.distcp"
    assert len(f.read_bytes()) == 103_506 and (cut / "__3_0.distcp").stat().st_size == 103_502
    times = os.stat(f)
    f.write_bytes(f.read_bytes()[:103_502])
    os.utime(f, ns=(times.st_atime_ns, times.st_mtime_ns))
    code, report = _findings(cut)
    assert code == 1 and [f["rule"] for f in report["findings"]] == ["truncated-file"]


def test_every_zstd_item_of_a_dcp_file_is_checked_not_only_its_first(tmp_path):
    """Each zstd-framed item of a DCP file is a little archive of its own, held in memory once
    decoded, each starting at its own 0: they were once told apart by that start, so only a file's
    first item had its CRC-32s checked. A bit flipped in a later item's frame (one zstd still
    decodes, into other bytes: the frames carry no checksum of their own) passed verify and seal."""
    import zstandard

    from ckpttool import registry

    _, clean = _findings(FIXTURES / "dcp" / "fsdp2_zstd")
    _, plain = _findings(FIXTURES / "dcp" / "fsdp2")
    counts = ("files", "pieces", "items")  # every file and piece, as uncompressed
    assert clean["ok"] and [clean["checked"][k] for k in counts] == [plain["checked"][k] for k in counts]
    z = tmp_path / "z"
    shutil.copytree(FIXTURES / "dcp" / "fsdp2_zstd", z)
    f = z / "__1_0.distcp"
    _, m = registry.describe(z)
    pieces = [(p.locator["offset"], i.name) for i in m.items.values() for p in i.pieces if p.file == f.name]
    offset, name = sorted(pieces)[len(pieces) // 2]  # an item in the middle of the file
    length = next(p.locator["length"] for p in m.items[name].pieces if p.file == f.name)
    data, times = bytearray(f.read_bytes()), os.stat(f)
    good = zstandard.ZstdDecompressor().decompress(bytes(data[offset : offset + length]), max_output_size=1 << 20)
    # a flip the frame still decodes, to an archive of the same members whose bytes differ
    for k in range(offset + 16, offset + length):
        data[k] ^= 1
        try:
            out = zstandard.ZstdDecompressor().decompress(bytes(data[offset : offset + length]), max_output_size=1 << 20)
        except zstandard.ZstdError:
            out = good
        if len(out) == len(good) and out != good and _zip_index(out) == _zip_index(good):
            break
        data[k] ^= 1
    else:
        pytest.fail(f"no flip in {name}'s frame decodes to other bytes")
    f.write_bytes(bytes(data))
    os.utime(f, ns=(times.st_atime_ns, times.st_mtime_ns))
    code, report = _findings(z)
    assert code == 1 and [(x["rule"], x["file"], x["item"]) for x in report["findings"]] == [
        ("checksum-mismatch", f.name, name)
    ], report["findings"]
    r = run_cli("seal", z)
    assert r.code == 3 and name in r.stderr and not (z / "ckpttool.manifest.json").exists()


def test_every_dcp_file_cut_short_or_missing_is_named_not_only_the_first(tmp_path):
    """verify stopped at the first data file cut short (its hint says verify lists every damaged
    file): two ranks' files cut and a third deleted are three findings, each with where its records
    end; the CLI's one error names the others; JUnit skips the rules that could not run."""
    path = tmp_path / "ck"
    shutil.copytree(FIXTURES / "dcp" / "fsdp2", path)
    for name in ("__1_0.distcp", "__2_0.distcp"):
        f = path / name
        times = os.stat(f)
        os.truncate(f, 50_000)
        os.utime(f, ns=(times.st_atime_ns, times.st_mtime_ns))
    (path / "__3_0.distcp").unlink()
    code, report = _findings(path, "--junit", tmp_path / "j.xml")
    assert code == 1 and [(f["rule"], f["file"]) for f in report["findings"]] == [
        ("truncated-file", "__1_0.distcp"),
        ("truncated-file", "__2_0.distcp"),
        ("missing-file", "__3_0.distcp"),
    ], report["findings"]
    assert "50,000 bytes but .metadata places data through byte 89,572" in report["findings"][1]["message"]
    junit = (tmp_path / "j.xml").read_text()
    assert 'failures="2"' in junit and 'skipped="14"' in junit and "could not be read past its damage" in junit
    r = run_cli("inspect", path)
    said = "(and 2 more damaged files: __2_0.distcp (truncated-file), __3_0.distcp (missing-file))"
    assert r.code == 3 and said in r.stderr, r.stderr


def _cut_to(f, size: int) -> None:
    """Truncate ``f`` to ``size`` bytes, its modification time kept (``_cut`` below cuts bytes off
    the end: this one was shadowed by it, and cut 3000 bytes off where 3000 were to be kept)."""
    times = os.stat(f)
    os.truncate(f, size)
    os.utime(f, ns=(times.st_atime_ns, times.st_mtime_ns))


@pytest.mark.parametrize(
    "fixture, cut, flipped, deleted",
    [
        (
            MG / "legacy_tp2pp2",
            ["iter_0000003/mp_rank_00_000/model_optim_rng.pt", "iter_0000003/mp_rank_01_001/model_optim_rng.pt"],
            [],
            ["iter_0000003/mp_rank_01_000/model_optim_rng.pt"],
        ),
        (
            FIXTURES / "deepspeed" / "zero2",
            ["global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt"],
            ["global_step3/zero_pp_rank_1_mp_rank_00_optim_states.pt"],
            [],
        ),
        (
            FIXTURES / "deepspeed" / "universal",
            ["zero/blocks.0.fc1.weight/exp_avg.pt"],
            ["zero/blocks.1.fc2.bias/fp32.pt"],
            [],
        ),
        (FIXTURES / "rankshards" / "tp_manual" / "step_00000003", ["shard_00000.pt"], ["shard_00001.pt"], []),
        (FIXTURES / "safetensors" / "sharded", ["model-00001-of-00002.safetensors"], [], ["model-00002-of-00002.safetensors"]),
    ],
    ids=["megatron-legacy", "deepspeed", "deepspeed-universal", "rankshards", "safetensors"],
)
def test_every_damaged_rank_file_is_named_not_only_the_first(fixture, cut, flipped, deleted, tmp_path):
    """Megatron legacy, DeepSpeed and per-rank shards read every rank file's pickle to know the
    checkpoint, and
    stopped at the first that did not read: a second rank's file cut short, damaged or deleted
    showed only once the first was restored. Each is now a finding of its own (the flipped byte a
    checksum-mismatch of the pickle's CRC-32), and the CLI's one error names the others."""
    path = tmp_path / "ck"
    shutil.copytree(fixture, path)
    tag = "global_step3_universal/" if fixture.name == "universal" else ""  # (the tag latest_universal names)
    root = path / tag
    for rel in cut:
        _cut_to(root / rel, 3000)
    for rel in flipped:  # one byte of the pickle
        f = root / rel
        st = os.stat(f)
        data = bytearray(f.read_bytes())
        data[data.find(b"data.pkl") + 60] ^= 0xFF
        f.write_bytes(bytes(data))
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    for rel in deleted:
        (root / rel).unlink()
    code, report = _findings(path)
    found = sorted((f["rule"], f["file"]) for f in report["findings"] if f["severity"] == "error")
    expected = sorted(
        [("truncated-file", tag + r) for r in cut]
        + [("checksum-mismatch", tag + r) for r in flipped]
        + [("missing-file", tag + r) for r in deleted]
    )
    assert code == 1 and found == expected, report["findings"]
    r = run_cli("inspect", path)
    n = len(expected) - 1
    alike = len({rule for rule, _ in expected}) == 1
    said = f"(and {n} more file{'s' * (n > 1)} likewise: " if alike else f"(and {n} more damaged file{'s' * (n > 1)}: "
    assert r.code == 3 and said in r.stderr, r.stderr  # (each named with what is wrong with it where they differ)
    assert all(rel in r.stderr for _, rel in expected), r.stderr


def _zip_index(data: bytes) -> list[tuple[str, int, int]] | None:
    import io
    import zipfile

    try:
        return [(i.filename, i.header_offset, i.file_size) for i in zipfile.ZipFile(io.BytesIO(data)).infolist()]
    except zipfile.BadZipFile:
        return None


@pytest.mark.parametrize("sealed", [False, True])
def test_dcp_files_of_one_size_swapped_are_misplaced_not_damaged(sealed, tmp_path):
    """Two files of the same size (megatron-core's DP ranks 1's two files here) cannot be told by
    their sizes: their records did not read, 19 corrupt-file findings (or, sealed, two checksum
    mismatches). Where each holds records where the other's start and its own do not, the damage
    is one misplaced-file."""
    path = tmp_path / "ck"
    shutil.copytree(MG / "dist_dp2_fp16_distopt", path)
    seal = tmp_path / "seal.json"
    if sealed:
        assert run_cli("seal", path, "--out", seal).code == 0
    a, b = path / "iter_0000003" / "__1_0.distcp", path / "iter_0000003" / "__1_1.distcp"
    assert a.stat().st_size == b.stat().st_size
    times = os.stat(a)
    a_bytes = a.read_bytes()
    a.write_bytes(b.read_bytes())
    b.write_bytes(a_bytes)
    for x in (a, b):  # (a file newer than the metadata reads as unfinished)
        os.utime(x, ns=(times.st_atime_ns, times.st_mtime_ns))
    code, report = _findings(path, *(["--manifest", seal] if sealed else []))
    errors = [f for f in report["findings"] if f["severity"] == "error"]
    assert code == 1 and [f["rule"] for f in errors] == ["misplaced-file"], errors
    assert "__1_0.distcp (59,403 bytes) holds what the metadata places in __1_1.distcp" in errors[0]["message"]
    assert "__1_1.distcp (59,403 bytes) holds what the metadata places in __1_0.distcp" in errors[0]["message"]


@pytest.mark.parametrize(
    ("fixture", "data"),
    [(FIXTURES / "dcp" / "fsdp2", "__1_0.distcp"), (FIXTURES / "dcp" / "fsdp2_ranklocal", "__1_0.distcp"),
     (MG / "dist_tp2", "iter_0000003/__0_0.distcp")],
)  # fmt: skip
def test_bytes_added_after_a_dcp_files_records_are_a_warning(fixture, data, tmp_path):
    """torch writes a file's records back to back and nothing after them: a longer file that holds
    no other file's records had bytes added after the save. Its data reads intact (a warning; a
    convert goes on), but a seal vouches for the bytes the writer wrote."""
    path = tmp_path / "ck"
    shutil.copytree(fixture, path)
    f = path / data
    size, times = f.stat().st_size, os.stat(f)
    clean = _findings(path)[1]["findings"]  # (megatron-core's: no dataloader position)
    with f.open("ab") as out:
        out.write(b"\0" * 100)
    os.utime(f, ns=(times.st_atime_ns, times.st_mtime_ns))
    code, report = _findings(path)
    assert code == 0, report
    (found,) = [x for x in report["findings"] if x not in clean]
    assert (found["rule"], found["severity"], found["file"]) == ("corrupt-file", "warning", f.name), found
    assert f"{size + 100:,} bytes, 100 more than its records reach" in found["message"]
    assert f"truncate -s {size} {path / data}" in found["hint"]
    assert run_cli("verify", path, "--fail-on", "warning").code == 1
    seal = run_cli("seal", path)
    assert seal.code == 3 and "not sealed" in seal.stderr and "truncate -s" in seal.stderr, seal.stderr
    assert run_cli("convert", path, "-o", tmp_path / "o", "--to", "safetensors").code == 0
    os.truncate(f, size)  # cut back as the hint says: clean, and it seals
    os.utime(f, ns=(times.st_atime_ns, times.st_mtime_ns))
    assert _findings(path)[1]["findings"] == clean
    assert run_cli("seal", path).code == 0


@pytest.mark.parametrize(
    "how", ["swapped", "larger copied over", "spliced from two", "renamed in a ring", "metadata swapped"]
)
def test_rank_local_dcp_files_in_each_others_places_are_named(how, tmp_path):
    """use_collectives=False: each rank's __R.metadata places only its own file, so a file's size
    is compared with where every rank's records end. Ranks 0..2 end at one byte (one structure):
    a file holding data of that structure is the copy of the one it equals byte for byte, or, where
    it equals none, one of them."""
    path = tmp_path / "rl"
    shutil.copytree(FIXTURES / "dcp" / "fsdp2_ranklocal", path)
    f = [path / f"__{r}_0.distcp" for r in range(4)]  # 134 032 bytes (ranks 0..2) and 133 712
    data, times = [x.read_bytes() for x in f], os.stat(f[0])
    if how == "swapped":
        f[2].write_bytes(data[3])
        f[3].write_bytes(data[2])
        said = ("__2_0.distcp (133,712 bytes) holds what the metadata places in __3_0.distcp; "
                "__3_0.distcp (134,032 bytes) holds what the metadata places in __2_0.distcp (or, if more than "
                "two files moved, one of __0_0.distcp, __1_0.distcp)")  # fmt: skip
    elif how == "metadata swapped":  # (each names the other rank's files: a load at rank 0 reads rank 1's)
        m0, m1 = path / "__0.metadata", path / "__1.metadata"
        m0.rename(path / "x")
        m1.rename(m0)
        (path / "x").rename(m1)
        said = "__0.metadata places its data in rank 1's files; __1.metadata places its data in rank 0's files"
    elif how == "renamed in a ring":  # (sizes as a swap of 1 and 3 gives: that is named, and the doubt)
        f[3].write_bytes(data[0])
        f[1].write_bytes(data[3])
        f[0].write_bytes(data[1])
        said = ("__3_0.distcp (134,032 bytes) holds what the metadata places in __1_0.distcp (or, if more than "
                "two files moved, one of __0_0.distcp, __2_0.distcp)")  # fmt: skip
    elif how == "larger copied over":
        f[3].write_bytes(data[2])
        said = "__3_0.distcp (134,032 bytes) holds what the metadata places in __2_0.distcp: its size is where"
    else:
        f[3].write_bytes(data[0][:100_000] + data[1][100_000:])
        said = "holds what the metadata places in one of __0_0.distcp, __1_0.distcp, __2_0.distcp"
    for x in f:
        os.utime(x, ns=(times.st_atime_ns, times.st_mtime_ns))
    code, report = _findings(path)
    assert code == 1
    (found,) = report["findings"]
    assert found["rule"] == "misplaced-file" and said in found["message"], found
    # the rank whose file (or metadata) it names, by the __R_N / __R naming (it was null)
    assert found["rank"] == int(found["file"].split("_")[2].split(".")[0]), found


@pytest.mark.parametrize(
    ("fixture", "a", "b"),
    [
        ("deepspeed/zero2", "global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt",
         "global_step3/zero_pp_rank_1_mp_rank_00_optim_states.pt"),
        ("megatron/legacy_tp2pp2", "iter_0000003/mp_rank_00_000", "iter_0000003/mp_rank_01_000"),
        ("dcp/fsdp2", "__0_0.distcp", "__1_0.distcp"),
    ],
)  # fmt: skip
def test_files_swapped_between_ranks_are_named_with_their_ranks(fixture, a, b, tmp_path):
    """misplaced-file findings named the file but no rank (null in the JSON), where every other
    finding about a rank's file names the rank."""
    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / fixture, ck)
    (ck / a).rename(ck / "swap")
    (ck / b).rename(ck / a)
    (ck / "swap").rename(ck / b)
    code, report = _findings(ck)
    assert code == 1
    found = [(f["rule"], f["rank"]) for f in report["findings"] if f["severity"] == "error"]
    assert found and all(rule == "misplaced-file" and rank in (0, 1) for rule, rank in found), report["findings"]


@pytest.mark.parametrize(
    ("fixture", "src", "dst", "severity", "said"),
    [
        # rank-local DCP: ranks 0..2 have one structure and one size
        (FIXTURES / "dcp" / "fsdp2_ranklocal", "__0_0.distcp", "__1_0.distcp", "error",
         "(model.pos [0:3, 0:16] in one, [3:6, 0:16] in the other)"),
        # one item a file: rank 0's shard of qkv copied over rank 1's
        (FIXTURES / "dcp" / "fsdp2_per_item", "__0_3.distcp", "__1_4.distcp", "error",
         "(model.blocks.0.qkv.weight [0:12, 0:16] in one, [12:24, 0:16] in the other)"),
        # over every other part too: the parts are all equal, as experts upcycled from one MLP are
        (FIXTURES / "dcp" / "fsdp2_per_item", "__0_3.distcp", ("__1_4.distcp", "__2_4.distcp", "__3_3.distcp"),
         "warning", "(model.blocks.0.qkv.weight [0:12, 0:16] in one, [12:24, 0:16] in the other)"),
        # torch_dist, PP stage 0's TP-1 file over stage 1's: parts of the same tensors, which megatron-core
        # stacks over a stage's layers (it was a warning, as different tensors a save may write equal)
        (MG / "dist_tp2pp2", "iter_0000003/__1_1.distcp", "iter_0000003/__3_1.distcp", "error",
         "(decoder.layers.1.self_attention.linear_proj.weight [0:16, 16:32] in one, "
         "decoder.layers.3.self_attention.linear_proj.weight [0:16, 16:32] in the other)"),
    ],
)  # fmt: skip
def test_a_file_copied_over_another_of_its_size_and_structure_is_named_without_a_seal(
    fixture, src, dst, severity, said, tmp_path
):
    """Each record of the copy sits where the metadata looks for one, and reads: without a seal
    verify said nothing. Two files with the same bytes that the metadata says hold different pieces
    are named: an error where they are two parts of one tensor whose other parts differ, a warning
    where the save may have written them equal (different tensors, or all of a tensor's parts)."""
    path = tmp_path / "ck"
    shutil.copytree(fixture, path)
    clean = _findings(path)[1]["findings"]
    dsts = (dst,) if isinstance(dst, str) else dst
    for d in dsts:
        times = os.stat(path / d)
        (path / d).write_bytes((path / src).read_bytes())
        os.utime(path / d, ns=(times.st_atime_ns, times.st_mtime_ns))
    code, report = _findings(path)
    (found,) = [f for f in report["findings"] if f not in clean]
    names = sorted(rel.split("/")[-1] for rel in (src, *dsts))  # (relative to the iteration's folder)
    assert (found["rule"], found["severity"], found["file"]) == ("misplaced-file", severity, names[0])
    assert found["message"].startswith(f"{', '.join(names[:-1])} and {names[-1]} hold the same ")
    assert said in found["message"] and "one was copied over another" in found["message"]
    assert code == (1 if severity == "error" else 0)
    sealed = run_cli("seal", path)  # a seal vouches for its bytes: not for a copy
    if severity == "error":
        assert sealed.code == 3 and "one was copied over another" in sealed.stderr and "not sealed" in sealed.stderr
        assert not list(path.rglob("ckpttool.manifest.json"))
    else:  # (different tensors: what the save may have written)
        assert sealed.code == 0, sealed.stderr


def test_files_a_save_wrote_equal_are_not_called_copies(tmp_path):
    """Two files of one save may hold the same bytes: tensors of one value (zeros: nothing to say)
    or tensors the save wrote equal (tied weights: a warning that says so, never an error)."""
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    for name, value in (("zeros", torch.zeros(64)), ("tied", torch.arange(64.0))):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (no process group: torch warns that it saves as one rank)
            writer = dcp.FileSystemWriter(tmp_path / name, thread_count=2)
            dcp.save({"a": value, "b": value.clone()}, storage_writer=writer, no_dist=True)
        a, b = (tmp_path / name / f"__0_{t}.distcp" for t in (0, 1))
        assert a.read_bytes() == b.read_bytes()  # one item a file, the same bytes
        code, report = _findings(tmp_path / name)
        copies = [f for f in report["findings"] if f["rule"] == "misplaced-file"]
        assert code == 0
        if name == "zeros":
            assert not copies
        else:
            (found,) = copies
            assert found["severity"] == "warning" and "(a in one, b in the other)" in found["message"]


def test_a_hostile_pickle_after_a_damaged_rank_file_names_both(tmp_path):
    """A hostile pickle stops the read at once, and dropped the damage found before it: rank 0's
    file cut short went unsaid beside rank 1's posix.system. Both are findings now, and the CLI's
    one error names the cut file after the hostile one."""
    path = tmp_path / "ck"
    shutil.copytree(FIXTURES / "hostile" / "ds_optim_os_system", path)
    _cut_to(path / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt", 3000)
    code, report = _findings(path)
    found = sorted((f["rule"], f["file"]) for f in report["findings"] if f["severity"] == "error")
    assert found == [
        ("truncated-file", "global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt"),
        ("unsafe-pickle", "global_step3/zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    ], report["findings"]
    assert code == 1  # (as for the unsafe pickle alone: a finding)
    r = run_cli("inspect", path)
    assert r.code == 3 and "posix.system" in r.stderr and "zero_pp_rank_0_mp_rank_00_optim_states.pt" in r.stderr, r.stderr


def _cut(f, n: int) -> None:
    """Cut ``n`` bytes off the end of ``f``, its modification time kept (a save cut short, not a
    later write)."""
    st = os.stat(f)
    f.write_bytes(f.read_bytes()[:-n])
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))


def _damaged_copy(fixture, tmp_path, *, gone=(), cut=(), flipped=()):
    """A copy of ``fixture`` (``tmp_path/ck``) with the files ``gone`` deleted, those ``cut`` 100
    bytes short and a tensor byte ``flipped`` in each of those, every time kept."""
    ck = tmp_path / "ck"
    shutil.copytree(fixture, ck)
    for rel in flipped:
        _flip_tensor(ck / rel)
    for rel in gone:
        (ck / rel).unlink()
    for rel in cut:
        _cut(ck / rel, 100)
    return ck


STOPPED = [
    # (fixture, file deleted, file cut short, the findings: (rule, file, rank))
    (
        "megatron/legacy_tp2pp2_distopt",
        "iter_0000003/mp_rank_00_000/distrib_optim.pt",
        "iter_0000003/mp_rank_01_001/distrib_optim.pt",
        [
            ("missing-file", "iter_0000003/mp_rank_00_000/distrib_optim.pt", 0),
            ("truncated-file", "iter_0000003/mp_rank_01_001/distrib_optim.pt", 1),
        ],
    ),
    (  # (a rank file that does not read stopped the read before the distrib_optim.pt files)
        "megatron/legacy_tp2pp2_distopt",
        "iter_0000003/mp_rank_01_001/model_optim_rng.pt",
        "iter_0000003/mp_rank_00_000/distrib_optim.pt",
        [
            ("missing-file", "iter_0000003/mp_rank_01_001/model_optim_rng.pt", 1),
            ("truncated-file", "iter_0000003/mp_rank_00_000/distrib_optim.pt", 0),
        ],
    ),
    (
        "megatron/legacy_tp2pp2_distopt",
        "iter_0000003/mp_rank_00_001/distrib_optim.pt",
        "iter_0000003/mp_rank_01_000/model_optim_rng.pt",
        [
            ("truncated-file", "iter_0000003/mp_rank_01_000/model_optim_rng.pt", 1),
            ("missing-file", "iter_0000003/mp_rank_00_001/distrib_optim.pt", 0),
        ],
    ),
    (
        "dcp/fsdp2_ranklocal",
        "__0.metadata",
        "__3.metadata",
        [("missing-file", "__0.metadata", 0), ("corrupt-file", "__3.metadata", 3)],
    ),
    (
        "deepspeed/zero2",
        "global_step3/mp_rank_00_model_states.pt",
        "global_step3/zero_pp_rank_1_mp_rank_00_optim_states.pt",
        [
            ("truncated-file", "global_step3/zero_pp_rank_1_mp_rank_00_optim_states.pt", 1),
            ("missing-file", "global_step3/mp_rank_00_model_states.pt", 0),
        ],
    ),
    (
        "megatron/legacy_tp2pp2",
        "iter_0000003/mp_rank_00_000/model_optim_rng.pt",
        "iter_0000003/mp_rank_01_001/model_optim_rng.pt",
        [
            ("missing-file", "iter_0000003/mp_rank_00_000/model_optim_rng.pt", 0),
            ("truncated-file", "iter_0000003/mp_rank_01_001/model_optim_rng.pt", 1),
        ],
    ),
    (
        "rankshards/ddp",
        "shard_00000_of_00002.pt",
        "shard_00001_of_00002.pt",
        [("missing-file", "shard_00000_of_00002.pt", 0), ("truncated-file", "shard_00001_of_00002.pt", 1)],
    ),
    (
        "megatron/dist_tp2pp2",
        "iter_0000003/common.pt",
        "iter_0000003/__3_1.distcp",
        [("truncated-file", "iter_0000003/__3_1.distcp", 3), ("missing-file", "iter_0000003/common.pt", None)],
    ),
    (  # (a metadata.json that does not read stopped at once, "no mp_rank_* directories either")
        "megatron/dist_tp2pp2",
        "iter_0000003/__2_0.distcp",
        "iter_0000003/metadata.json",
        [("corrupt-file", "iter_0000003/metadata.json", None), ("missing-file", "iter_0000003/__2_0.distcp", 2)],
    ),
]


@pytest.mark.parametrize(("fixture", "gone", "cut", "expected"), STOPPED, ids=[s[0] for s in STOPPED])
def test_every_damaged_file_is_named_where_reading_stops(fixture, gone, cut, expected, tmp_path):
    """One file deleted and another cut short: where the reader stops, each is named with its rank.
    Before, only one of them was (the other went unsaid until the first was restored): Megatron's
    distrib_optim.pt (the first rank's error raised at once), DCP rank-local metadata (a deleted
    __R.metadata was not looked for: coverage gaps), DeepSpeed (the missing model states were looked
    for only once every file read), rank shards (a missing rank raised before the others were read),
    torch_dist (common.pt not looked at once the DCP files failed)."""
    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / fixture, ck)
    (ck / gone).unlink()
    _cut(ck / cut, 100 if cut.endswith((".pt", ".distcp")) else 10)
    code, report = _findings(ck)
    assert code == 1, report
    errors = [(f["rule"], f["file"], f["rank"]) for f in report["findings"] if f["severity"] == "error"]
    assert errors == expected, errors
    # the CLI's other commands stop on the first and name the rest
    r = run_cli("inspect", ck)
    assert r.code == 3 and "Traceback" not in r.stderr, r.stderr
    assert all(name.rsplit("/", 1)[-1] in r.stderr for name in (gone, cut)), r.stderr


@pytest.mark.parametrize("deep", [False, True])
def test_a_damaged_tensor_member_is_one_finding(deep, tmp_path):
    """A tensor's zip member whose local header is damaged: one corrupt-file finding naming the file
    and the tensor. --deep reported it twice, the second time without the tensor's name (its value
    read found the same damage)."""
    import struct
    import zipfile

    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / "rankshards" / "ddp", ck)
    f = ck / "shard_00000_of_00002.pt"
    with zipfile.ZipFile(f) as z:
        info = z.getinfo("shard_00000_of_00002/data/1")
    data = bytearray(f.read_bytes())
    assert data[info.header_offset : info.header_offset + 4] == struct.pack("<I", 0x04034B50)
    data[info.header_offset] ^= 0xFF
    st = os.stat(f)
    f.write_bytes(data)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    code, report = _findings(ck, *(["--deep"] if deep else []))
    assert code == 1
    damage = [(x["rule"], x["file"], x["item"]) for x in report["findings"] if x["rule"] == "corrupt-file"]
    assert damage == [("corrupt-file", "shard_00000_of_00002.pt", "model.body.0.bias")], report["findings"]


RANK_LOCAL = [
    # (deleted, cut short, the error findings: (rule, file, rank))
    (["__1_0.distcp", "__2_0.distcp"], [], [("missing-file", "__1_0.distcp", 1), ("missing-file", "__2_0.distcp", 2)]),
    (["__1_0.distcp"], ["__2_0.distcp"], [("missing-file", "__1_0.distcp", 1), ("truncated-file", "__2_0.distcp", 2)]),
    (
        ["__2.metadata"],
        ["__1.metadata", "__0_0.distcp"],
        [
            ("missing-file", "__2.metadata", 2),
            ("truncated-file", "__0_0.distcp", 0),
            ("corrupt-file", "__1.metadata", 1),
        ],
    ),
]


@pytest.mark.parametrize(("gone", "cut", "expected"), RANK_LOCAL)
def test_every_damaged_file_of_a_rank_local_dcp_save_is_named(gone, cut, expected, tmp_path):
    """use_collectives=False: each rank's __R.metadata places only its own files. A missing data
    file stopped the read of the other ranks' (only the first named), and a rank's metadata cut
    short was met again by the check for swapped files, which then named it alone, without rank."""
    ck = _damaged_copy(FIXTURES / "dcp" / "fsdp2_ranklocal", tmp_path, gone=gone, cut=cut)
    code, report = _findings(ck)
    assert code == 1, report
    assert [(f["rule"], f["file"], f["rank"]) for f in report["findings"] if f["severity"] == "error"] == expected


@pytest.mark.parametrize(("rank", "said"), [
    (3, "__3.metadata and __3_*.distcp are missing: 36 tensor(s) have parts that no rank here places (model.pos, "
        "model.tok.weight, model.blocks.0.ln1.weight …), and this save without collectives has the files of ranks 0 "
        "to 2 only"),
    (1, "__1.metadata and __1_*.distcp are missing: rank(s) 1 of this save without collectives left no files beside "
        "those of ranks 0, 2, 3; 36 tensor(s) have parts"),
])  # fmt: skip
def test_a_rank_local_dcp_save_without_a_whole_rank_is_incomplete(rank, said, tmp_path):
    """Before: with every file of one rank of a use_collectives=False save gone, nothing named a
    missing file: inspect and ls described a checkpoint of 3 ranks (exit 0) and verify found 36
    coverage gaps. Now the rank is named (the last one: by the parts no rank here places), exit 3
    from inspect and a missing-file finding from verify."""
    ck = tmp_path / "rl"
    shutil.copytree(FIXTURES / "dcp" / "fsdp2_ranklocal", ck)
    for f in (ck / f"__{rank}.metadata", ck / f"__{rank}_0.distcp"):
        f.unlink()
    code, report = _findings(ck)
    assert code == 1, report
    [found] = report["findings"]
    assert (found["rule"], found["file"], found["rank"]) == ("missing-file", f"__{rank}.metadata", rank)
    assert said in found["message"], found["message"]
    for command in ("inspect", "ls"):
        assert_clean(run_cli(command, str(ck)), 3, said)


@pytest.mark.parametrize("fixture", ["legacy_pp2vpp2", "dist_tp2"])
def test_a_save_directory_without_its_tracker_is_an_unfinished_save(fixture, tmp_path):
    """Megatron-LM writes latest_checkpointed_iteration.txt once every rank has saved. Without it
    the save directory was "not a checkpoint format ckpttool reads" (exit 3), as if the
    iteration directory beside it were not there; DeepSpeed's without `latest` was already an
    unfinished save."""
    ck = tmp_path / "ck"
    shutil.copytree(MG / fixture, ck)
    (ck / "latest_checkpointed_iteration.txt").unlink()
    code, report = _findings(ck)
    assert code == 1, report
    [found] = report["findings"]
    assert (found["rule"], found["file"]) == ("incomplete-save", "latest_checkpointed_iteration.txt"), found
    assert "iteration directory iter_0000003 but no latest_checkpointed_iteration.txt" in found["message"]
    assert f"ckpttool verify {ck / 'iter_0000003'}" in found["hint"]
    code, report = _findings(ck / "iter_0000003")  # the iteration itself reads
    assert code == 0, report


def _flip_tensor(f) -> None:
    """One byte flipped in the middle of the largest tensor member of a torch.save file (its
    stored CRC-32 left as it was), the modification time kept."""
    import zipfile

    with zipfile.ZipFile(f) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    data = bytearray(f.read_bytes())
    at = info.header_offset
    name, extra = int.from_bytes(data[at + 26 : at + 28], "little"), int.from_bytes(data[at + 28 : at + 30], "little")
    data[at + 30 + name + extra + info.file_size // 2] ^= 0xFF
    st = os.stat(f)
    f.write_bytes(bytes(data))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_the_findings_on_one_file_name_one_rank(tmp_path):
    """A DeepSpeed pipeline optimizer file with a flipped byte was rank 7 (its global rank) in the
    checksum-mismatch and rank 1 (its pieces' DP rank) in the replica-mismatch of the same bytes: a
    CI job grouping findings by rank split one bad file into two ranks. Every finding now gives its
    DP rank, as the report schema documents for a ZeRO partition, and as the missing-file and
    truncated-file findings (named from the file's name) always did; the file name tells its
    model-parallel rank."""
    import zipfile

    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / "deepspeed" / "pipeline", ck)
    f = ck / "global_step3" / "zero_pp_rank_1_mp_rank_03_optim_states.pt"
    data = bytearray(f.read_bytes())
    info = next(i for i in zipfile.ZipFile(f).infolist() if i.filename.endswith("/data/0"))  # (a replicated step)
    at = info.header_offset
    data[at + 30 + int.from_bytes(data[at + 26 : at + 28], "little") + int.from_bytes(data[at + 28 : at + 30], "little") + 2] ^= 8
    f.write_bytes(bytes(data))
    code, report = _findings(ck)
    on_file = {(f["rule"], f["rank"]) for f in report["findings"] if f["file"] and "mp_rank_03_optim" in f["file"]}
    assert code == 1 and {r for _, r in on_file} == {1}, on_file  # (its DP rank, in every finding)
    assert {("checksum-mismatch", 1), ("replica-mismatch", 1)} <= on_file, on_file
    f.unlink()  # (and so does its absence)
    code, report = _findings(ck)
    assert {f["rank"] for f in report["findings"] if f["file"] and "mp_rank_03_optim" in f["file"]} == {1}


BESIDE = [
    # (fixture, tensor byte flipped, deleted, cut short, the error findings: (rule, file))
    (
        "deepspeed/zero1",
        ["global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt", "global_step3/zero_pp_rank_1_mp_rank_00_optim_states.pt"],
        [],
        ["global_step3/mp_rank_00_model_states.pt"],
        [
            ("truncated-file", "global_step3/mp_rank_00_model_states.pt"),
            ("checksum-mismatch", "global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt"),
            ("checksum-mismatch", "global_step3/zero_pp_rank_1_mp_rank_00_optim_states.pt"),
        ],
    ),
    (
        "rankshards/ddp",
        ["shard_00000_of_00002.pt"],
        ["shard_00001_of_00002.pt"],
        [],
        [("missing-file", "shard_00001_of_00002.pt"), ("checksum-mismatch", "shard_00000_of_00002.pt")],
    ),
    (
        "megatron/legacy_tp2pp2_distopt",
        ["iter_0000003/mp_rank_01_001/distrib_optim.pt"],
        ["iter_0000003/mp_rank_00_000/model_optim_rng.pt"],
        [],
        [
            ("missing-file", "iter_0000003/mp_rank_00_000/model_optim_rng.pt"),
            ("checksum-mismatch", "iter_0000003/mp_rank_01_001/distrib_optim.pt"),
        ],
    ),
    (
        "deepspeed/universal",
        ["global_step3_universal/zero/head.weight/fp32.pt"],
        [],
        ["global_step3_universal/mp_rank_00_model_states.pt"],
        [
            ("truncated-file", "global_step3_universal/mp_rank_00_model_states.pt"),
            ("checksum-mismatch", "global_step3_universal/zero/head.weight/fp32.pt"),
        ],
    ),
    (  # (.distcp files: torch.save records back to back, found from the file's end without .metadata)
        "dcp/fsdp2",
        ["__1_0.distcp"],
        [],
        [".metadata", "__3_0.distcp"],
        [("corrupt-file", ".metadata"), ("checksum-mismatch", "__1_0.distcp"), ("corrupt-file", "__3_0.distcp")],
    ),
    (
        "megatron/dist_tp2",
        ["iter_0000003/__0_1.distcp"],
        ["iter_0000003/metadata.json"],
        [],
        [("missing-file", "iter_0000003/metadata.json"), ("checksum-mismatch", "iter_0000003/__0_1.distcp")],
    ),
]


@pytest.mark.parametrize(("fixture", "flipped", "gone", "cut", "expected"), BESIDE, ids=[b[0] for b in BESIDE])
def test_a_flipped_tensor_byte_beside_a_damaged_file_is_named(fixture, flipped, gone, cut, expected, tmp_path):
    """A file that stops the read leaves no manifest, so no tensor's bytes were checked: a flipped
    byte in another rank's tensor showed only once the first damage was mended. The torch.save
    files beside the damaged ones are now checked against their zip CRC-32s."""
    ck = _damaged_copy(FIXTURES / fixture, tmp_path, gone=gone, cut=cut, flipped=flipped)
    code, report = _findings(ck)
    assert code == 1, report
    assert [(f["rule"], f["file"]) for f in report["findings"] if f["severity"] == "error"] == expected


@pytest.mark.parametrize(
    ("index", "shard", "expected"),
    [
        ("garbage", "cut", [("corrupt-file", "model.safetensors.index.json"), ("truncated-file", "model-00002-of-00002.safetensors")]),
        ("garbage", "deleted", [("corrupt-file", "model.safetensors.index.json"), ("missing-file", "model-00001-of-00002.safetensors")]),
        ("deleted", "deleted", [("missing-file", "model-00001-of-00002.safetensors")]),
    ],
)
def test_a_damaged_safetensors_index_leaves_the_shards_checked(index, shard, expected, tmp_path):
    """An index that did not read stopped there (a shard cut short or deleted beside it went
    unsaid); without an index, a deleted shard was not missed at all. The shards' own numbering
    (model-NNNNN-of-MMMMM.safetensors) says which exist."""
    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / "safetensors" / "sharded", ck)
    idx = ck / "model.safetensors.index.json"
    if index == "garbage":
        idx.write_bytes(b"this is not a checkpoint \x00 garbage\n")
    else:
        idx.unlink()
    target = ck / ("model-00002-of-00002.safetensors" if shard == "cut" else "model-00001-of-00002.safetensors")
    if shard == "cut":
        _cut(target, 100)
    else:
        target.unlink()
    code, report = _findings(ck)
    assert code == 1, report
    assert [(f["rule"], f["file"]) for f in report["findings"] if f["severity"] == "error"] == expected


@pytest.mark.parametrize(
    ("overwrite", "rule"),
    [(lambda b: b"garbage here", "truncated-file"), (lambda b: b[:100] + bytes([b[100] ^ 0x55]) + b[101:], "checksum-mismatch")],
    ids=["shorter garbage", "a flipped byte"],
)
def test_a_sealed_file_that_changed_and_does_not_read_is_one_finding(overwrite, rule, tmp_path):
    """A sealed .metadata overwritten: the seal named the change and the reader, separately, the
    file it could not read; two errors for one damaged file. Now one, the change's, saying what
    reading it met."""
    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / "dcp" / "fsdp2", ck)
    assert run_cli("seal", ck).code == 0
    meta = ck / ".metadata"
    meta.write_bytes(overwrite(meta.read_bytes()))
    code, report = _findings(ck)
    assert code == 1
    found = [(f["rule"], f["file"]) for f in report["findings"] if f["severity"] == "error"]
    assert found == [(rule, ".metadata")], report["findings"]
    assert "; reading it: " in report["findings"][0]["message"]


@pytest.mark.parametrize(
    ("fixture", "flipped"),
    [
        ("dcp/fsdp2", {"__1_0.distcp": 1, "__3_0.distcp": 3}),
        ("deepspeed/zero2", {"global_step3/zero_pp_rank_1_mp_rank_00_optim_states.pt": 1}),
        ("rankshards/ddp", {"shard_00001_of_00002.pt": 1}),
        ("megatron/legacy_tp2pp2", {"iter_0000003/mp_rank_01_001/model_optim_rng.pt": 1}),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_a_crc_finding_names_the_rank_of_its_file(fixture, flipped, tmp_path):
    """A tensor byte flipped (no seal): the zip CRC-32 finding named the file but no rank, where
    a seal's finding on the same file names it."""
    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / fixture, ck)
    for rel in flipped:
        _flip_tensor(ck / rel)
    code, report = _findings(ck)
    assert code == 1
    found = {f["file"]: f["rank"] for f in report["findings"] if f["rule"] == "checksum-mismatch"}
    assert found == flipped, report["findings"]


@pytest.mark.parametrize("stray", ["mp_rank_02_000", "mp_rank_00_002", "mp_rank_03_001"])
def test_a_rank_directory_left_from_another_layout_is_named(stray, tmp_path):
    """A TP rank directory past the args' TP (a save at a larger TP left it): reshard and convert
    failed with an internal error ("box (128, 0)+(64, 16) outside a tensor of shape (128, 16)") and
    verify read it as more copies. It is a misplaced-file, as DeepSpeed's file of a DP rank the
    save did not have, named in every command; a stray PP rank likewise."""
    ck = tmp_path / "ck"
    shutil.copytree(MG / "legacy_tp2pp2", ck)
    shutil.copytree(ck / "iter_0000003" / "mp_rank_00_000", ck / "iter_0000003" / stray)
    code, report = _findings(ck)
    assert code == 1
    assert [(f["rule"], f["file"]) for f in report["findings"] if f["severity"] == "error"] == [
        ("misplaced-file", f"iter_0000003/{stray}/model_optim_rng.pt")
    ], report["findings"]
    for argv in (("reshard", ck, "-o", tmp_path / "out", "--tp", "1", "--pp", "1"), ("convert", ck, "-o", tmp_path / "out")):
        r = run_cli(*argv)
        assert r.code == 3 and f"iter_0000003/{stray}: no rank saves this directory" in r.stderr, r.stderr
        assert "internal error" not in r.stderr and not (tmp_path / "out").exists()
    # a rank directory missing beside it is named in the same run
    shutil.rmtree(ck / "iter_0000003" / "mp_rank_01_001")
    code, report = _findings(ck)
    assert [(f["rule"], f["file"]) for f in report["findings"] if f["severity"] == "error"] == [
        ("misplaced-file", f"iter_0000003/{stray}/model_optim_rng.pt"),
        ("missing-file", "iter_0000003/mp_rank_01_001/model_optim_rng.pt"),
    ], report["findings"]


HF_TRAINER = FIXTURES / "hf" / "trainer" / "checkpoint-3"


def test_torch_save_files_beside_safetensors_are_checked_as_archives(tmp_path):
    """A Hugging Face Trainer checkpoint keeps optimizer.pt, scheduler.pt and rng_state.pth beside
    model.safetensors. verify read the folder as safetensors and passed it (exit 0) with those
    files damaged; and one of them given alone was refused as 'one file of the safetensors
    checkpoint: give that'. Each is checked as an archive."""
    ck = tmp_path / "hf"
    shutil.copytree(HF_TRAINER, ck)
    code, report = _findings(ck)
    assert code == 0 and _rules(report) == [], report["findings"]
    assert report["checked"]["files"] == 5  # (the model and the four torch.save files)
    data = bytearray((ck / "optimizer.pt").read_bytes())
    at = data.find(b"exp_avg_sq")  # (in the pickle: a key it names, changed)
    data[at + 4] ^= 1
    (ck / "optimizer.pt").write_bytes(data)
    (ck / "scheduler.pt").write_bytes((ck / "scheduler.pt").read_bytes()[:1000])
    (ck / "rng_state.pth").write_bytes(b"")
    code, report = _findings(ck)
    assert code == 1 and _rules(report) == [
        ("checksum-mismatch", "optimizer.pt"),
        ("truncated-file", "rng_state.pth"),
        ("truncated-file", "scheduler.pt"),
    ], report["findings"]
    code, report = _findings(ck / "optimizer.pt")  # given alone: read, and its damage said
    assert code == 1 and "checksum-mismatch" in [f["rule"] for f in report["findings"]], report["findings"]


def test_a_hugging_face_trainer_checkpoint_holds_its_training_state(tmp_path):
    """transformers' Trainer keeps the optimizer, the scheduler, the RNG and the step in files
    beside model.safetensors. verify warned that all five were missing, so a gate with --require
    optimizer,rng,scheduler failed a complete checkpoint. They are found, each read as what it
    should hold (a file that is not is said, and its state counted missing); inspect names them."""
    every = "optimizer,rng,scheduler,dataloader,step"
    code, report = _findings(HF_TRAINER, "--require", every, "--fail-on", "warning")
    assert code == 0 and report["findings"] == [] and report["step"] == 3, report
    r = run_cli("inspect", HF_TRAINER)
    assert r.code == 0 and "step: 3" in r.stdout, r.stdout
    assert (
        "training state in: optimizer.pt (optimizer), rng_state.pth (rng), scheduler.pt (scheduler), "
        "trainer_state.json (step, dataloader)" in r.stdout
    ), r.stdout
    assert "training state: optimizer, rng, dataloader, scheduler and step all present" in r.stdout
    import torch
    from safetensors.torch import load_file

    from ckpttool.export import export
    from tests._compare import tensor_mismatches

    export(HF_TRAINER, tmp_path / "model.safetensors")  # (the run's model, as it had it at the end)
    ref = torch.load(FIXTURES / "hf" / "trainer.reference.pt", weights_only=True)
    assert tensor_mismatches(load_file(tmp_path / "model.safetensors"), ref["model"]) == []

    ck = tmp_path / "hf"
    shutil.copytree(HF_TRAINER, ck)
    (ck / "optimizer.pt").unlink()
    torch.save([1, 2], ck / "scheduler.pt")  # (a torch.save file, not a scheduler's state_dict)
    (ck / "trainer_state.json").write_text('{"global_step": "three"}')
    code, report = _findings(ck, "--require", "optimizer")
    found = sorted((f["rule"], f["severity"], f["file"] or f["message"]) for f in report["findings"])
    assert code == 1 and found == [
        ("corrupt-file", "error", "scheduler.pt"),
        ("corrupt-file", "error", "trainer_state.json"),
        ("missing-state", "error", "no optimizer state in the checkpoint"),
        ("missing-state", "warning", "no LR scheduler state in the checkpoint"),
        ("missing-state", "warning", "no dataloader position in the checkpoint"),
        ("missing-state", "warning", "no training step in the checkpoint"),
    ], found
    said = {f["file"]: f["message"] for f in report["findings"] if f["file"]}
    assert said["scheduler.pt"].startswith("scheduler.pt: expected a dict (scheduler state), found list"), said
    assert "expected a global_step (a count of steps), found 'three'" in said["trainer_state.json"], said
    # sealed, then changed: the seal says the bytes changed, one finding for the file
    shutil.rmtree(ck)
    shutil.copytree(HF_TRAINER, ck)
    assert run_cli("seal", ck).code == 0
    (ck / "trainer_state.json").write_text("{")
    code, report = _findings(ck)
    assert code == 1 and _rules(report) == [("truncated-file", "trainer_state.json")], report["findings"]


def test_trainer_state_files_are_read_within_bounds_each_one(tmp_path):
    """A long run's trainer_state.json (its log grows with every step) was parsed whole, up to 64
    MiB (1.45 GB of memory for 57 MiB of empty dicts): global_step is found where Trainer writes
    it, in the first MiB, and nothing more is read. Every rank's rng_state_N.pth is read (the first
    one that read stood for all); a scheduler whose pickle names the run's own class is held but
    unchecked (a warning), not a corrupt file."""
    import torch

    ck = tmp_path / "hf"
    shutil.copytree(HF_TRAINER, ck)
    text = (HF_TRAINER / "trainer_state.json").read_text()
    head, tail = text.split('"log_history": [', 1)
    (ck / "trainer_state.json").write_text(head + '"log_history": [' + "{}, " * 3_000_000 + tail)
    assert (ck / "trainer_state.json").stat().st_size > 8 << 20
    shutil.copy2(HF_TRAINER / "rng_state.pth", ck / "rng_state_0.pth")
    (ck / "rng_state.pth").rename(ck / "rng_state_1.pth")
    (ck / "rng_state_1.pth").write_bytes((ck / "rng_state_1.pth").read_bytes()[:5000])

    import argparse

    # (a scheduler state holding a class the plain allowlist lacks, as a run's own would)
    torch.save({"last_epoch": 3, "schedule": argparse.Namespace(warmup=1)}, ck / "scheduler.pt")
    code, report = _findings(ck, "--require", "step,rng,scheduler")
    found = sorted((f["rule"], f["severity"], f["file"]) for f in report["findings"])
    assert code == 1 and report["step"] == 3 and found == [
        ("truncated-file", "error", "rng_state_1.pth"),
        ("unsafe-pickle", "warning", "scheduler.pt"),
    ], report["findings"]
    said = next(f["message"] for f in report["findings"] if f["rule"] == "unsafe-pickle")
    assert "argparse.Namespace" in said and "not checked" in said, said
    (ck / "trainer_state.json").write_text('{"log_history": [' + "{}, " * 400_000 + '{}], "global_step": 4}')
    code, report = _findings(ck)
    assert "global_step where Trainer writes it, in the first 1,048,576 bytes" in str(report["findings"]), report


class _RunsTrue:
    def __reduce__(self):  # (a pickle calling os.system; "true" does nothing if anything ran it)
        import os

        return (os.system, ("true",))


def test_a_trainer_state_file_whose_pickle_runs_code_is_an_error_and_not_sealed(tmp_path):
    """A hostile pickle in a Trainer's scheduler.pt (optimizer.pt, rng_state.pth) was an
    unsafe-pickle warning, its state counted as present: exit 0, --require scheduler passed, and
    seal vouched for it. A global that runs code is an error there, the state is missing, and seal
    refuses; a class of the run's own stays a warning (the test above)."""
    import torch

    for name in ("scheduler.pt", "optimizer.pt", "rng_state.pth"):
        ck = tmp_path / name / "hf"
        shutil.copytree(HF_TRAINER, ck)
        state = torch.load(ck / name, weights_only=False)
        state["x"] = _RunsTrue()
        torch.save(state, ck / name)
        before = tree_digests(ck)
        code, report = _findings(ck)
        found = [(f["rule"], f["severity"], f["file"]) for f in report["findings"] if f["rule"] != "missing-state"]
        assert code == 1 and found == [("unsafe-pickle", "error", name)], report["findings"]
        assert any("system, which runs code" in f["message"] for f in report["findings"]), report["findings"]
        want = {"scheduler.pt": "scheduler", "optimizer.pt": "optimizer", "rng_state.pth": "rng"}[name]
        code, report = _findings(ck, "--require", want)
        assert code == 1 and any(
            f["rule"] == "missing-state" and f["severity"] == "error" for f in report["findings"]
        ), report["findings"]
        r = run_cli("seal", ck)
        assert_clean(r, 3, name, "not sealed")
        assert tree_digests(ck) == before
    # a harmless-looking class of the run's own placed first hid os.system (the reader stops at the
    # first global it refuses): a warning, exit 0, and sealed. Every global the pickle names counts.
    import sys
    import types

    module = types.ModuleType("ckpttool_test_runlib")
    module.Plain = type("Plain", (), {"__module__": "ckpttool_test_runlib"})
    sys.modules["ckpttool_test_runlib"] = module
    try:
        ck = tmp_path / "hidden" / "hf"
        shutil.copytree(HF_TRAINER, ck)
        state = torch.load(ck / "scheduler.pt", weights_only=False)
        torch.save({"first": module.Plain(), **state, "last": _RunsTrue()}, ck / "scheduler.pt")
    finally:
        del sys.modules["ckpttool_test_runlib"]
    code, report = _findings(ck)
    found = [(f["rule"], f["severity"]) for f in report["findings"] if f["rule"] == "unsafe-pickle"]
    assert code == 1 and found == [("unsafe-pickle", "error")], report["findings"]
    assert_clean(run_cli("seal", ck), 3, "system, which runs code", "not sealed")


@pytest.mark.parametrize("how", ["zip", "legacy", "pickle", "protocol 0", "protocol 1 cut short"])
def test_a_pickle_beside_the_state_that_runs_code_is_an_error_and_not_sealed_nor_converted(how, tmp_path):
    """A file no reader loads (a Trainer's training_args.bin, a .pkl dropped into a DCP folder) whose
    pickle runs code passed verify, --deep too, with exit 0, and seal vouched for it: whoever loads it
    with torch.load(weights_only=False) runs it. Found in a torch.save archive, a pre-1.6 torch.save
    file (its object is its fourth pickle) and a plain pickle; the run's own TrainingArguments class
    (the fixture's) is no finding."""
    import pickle

    import torch

    ck = tmp_path / "hf"
    shutil.copytree(HF_TRAINER, ck)
    target = ck / "training_args.bin"
    if how == "zip":
        torch.save({"args": _RunsTrue()}, target)
    elif how == "legacy":
        torch.save({"args": _RunsTrue(), "w": torch.ones(2)}, target, _use_new_zipfile_serialization=False)
    elif how == "pickle":
        target = ck / "extra.pkl"
        target.write_bytes(pickle.dumps([1, _RunsTrue()], protocol=4))
    elif how == "protocol 0":  # (no PROTO opcode: pickle.load runs it all the same)
        target.write_bytes(pickle.dumps(_RunsTrue(), protocol=0))
    else:  # (cut after the call: the load runs it before it fails)
        target = ck / "extra.pkl"
        whole = pickle.dumps([_RunsTrue(), list(range(100))], protocol=1)
        target.write_bytes(whole[: len(whole) // 2 + 30])
    before = tree_digests(ck)
    for deep in ((), ("--deep",)):
        code, report = _findings(ck, *deep)
        found = [(f["rule"], f["severity"], f["file"]) for f in report["findings"]]
        assert code == 1 and found == [("unsafe-pickle", "error", target.name)], report["findings"]
        assert "posix.system, which runs code" in report["findings"][0]["message"], report["findings"]
    assert_clean(run_cli("seal", ck), 3, target.name, "not sealed")
    r = run_cli("convert", ck, "-o", tmp_path / "out", "--to", "dcp")
    assert_clean(r, 3, target.name, "nothing was written")
    assert not (tmp_path / "out").exists() and tree_digests(ck) == before


def test_a_long_pickle_beside_the_state_is_not_checked_and_other_bytes_are_no_pickle(tmp_path):
    """A pickle beside the state longer than ckpttool reads (its call past the 64 MiB once read) passed
    as checked and was sealed: it is an unsafe-pickle warning, not checked. A file of other bytes
    that begins like a pickle (PROTO of no protocol, a STACK_GLOBAL of nothing) was an unsafe-pickle
    error "refers to <computed>": no pickle, no finding."""
    import pickle

    ck = tmp_path / "hf"
    shutil.copytree(HF_TRAINER, ck)
    (ck / "history.pkl").write_bytes(pickle.dumps([b"\0" * (17 << 20), _RunsTrue()], protocol=4))
    (ck / "embeddings.bin").write_bytes(bytes([0x80, 0x3C, 0x93]) + bytes(range(256)) * 4)
    (ck / "raw.bin").write_bytes(bytes([0x93, 0x80]) + bytes(range(256)) * 4)
    code, report = _findings(ck)
    found = [(f["rule"], f["severity"], f["file"]) for f in report["findings"]]
    assert code == 0 and found == [("unsafe-pickle", "warning", "history.pkl")], report["findings"]
    assert "longer than the 16 MiB ckpttool reads of one: not checked" in report["findings"][0]["message"]


def test_a_torchscript_file_or_a_zip_of_assets_beside_a_model_is_sealed_not_judged(tmp_path):
    """A TorchScript .pt (torch.jit.save compresses members beside constants.pkl and code/) or a
    deflated zip named .bin kept beside a model was a corrupt-file "the zip index is damaged
    (compression method 8; torch.save stores every member)" with the hint "torch.load fails on it
    too", which loads it; seal refused the checkpoint. They are no torch.save files: hashed and
    sealed, not judged."""
    import zipfile

    import torch

    ck = tmp_path / "m"
    ck.mkdir()
    shutil.copy2(FIXTURES / "safetensors" / "model.safetensors", ck)
    torch.jit.save(torch.jit.script(torch.nn.Linear(3, 3)), str(ck / "scripted.pt"))
    with zipfile.ZipFile(ck / "assets.bin", "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("vocab.txt", "hello " * 100)
    code, report = _findings(ck)
    assert code == 0 and not [f for f in report["findings"] if f["rule"] != "missing-state"], report["findings"]
    assert_clean(run_cli("seal", ck), 0)
    assert _findings(ck)[0] == 0


def _flip_member(path, member):
    """One bit flipped in the middle of zip ``member``'s bytes (stored, as torch.save writes them)."""
    import struct
    import zipfile

    info = zipfile.ZipFile(path).getinfo(member)
    data = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26 : info.header_offset + 30])
    data[info.header_offset + 30 + name_len + extra_len + info.file_size // 2] ^= 1
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "name, member",
    [
        ("optimizer.pt", "optimizer/data/1"),
        ("rng_state.pth", "rng_state/data/0"),
        ("training_args.bin", "training_args/data.pkl"),
        ("extra.pt", "train_state/data/50"),
    ],
)
def test_seal_refuses_damage_in_a_torch_save_file_beside_the_state(name, member, tmp_path):
    """A torch.save file kept beside the state the format reads (a Trainer's optimizer.pt or
    rng_state.pth, its training_args.bin, any .pt dropped beside a model) whose bytes fail a zip
    CRC-32: verify said so, but seal vouched for it (it checked the CRC-32s of the archives holding
    pieces only), and verify against that seal passed. seal refuses it, naming the member."""
    ck = tmp_path / "ck"
    if name == "extra.pt":
        shutil.copytree(FIXTURES / "safetensors" / "sharded", ck)
        shutil.copy2(FIXTURES / "torch" / "train_state.pt", ck / name)
    else:
        shutil.copytree(HF_TRAINER, ck)
    _flip_member(ck / name, member)
    code, report = _findings(ck)
    found = [(f["rule"], f["file"]) for f in report["findings"] if f["severity"] == "error"]
    assert code == 1 and found == [("checksum-mismatch", name)], report["findings"]
    before = tree_digests(ck)
    assert_clean(run_cli("seal", ck), 3, f"{name}: {member}", "fails its zip CRC-32", "not sealed")
    assert tree_digests(ck) == before


@pytest.mark.parametrize(
    "fixture, rel",
    [
        ("megatron/legacy_tp2pp2", "iter_0000003/mp_rank_01_001/model_optim_rng.pt"),
        ("megatron/dist_tp2", "iter_0000003/common.pt"),
        ("deepspeed/zero2", "global_step3/zero_pp_rank_1_mp_rank_00_optim_states.pt"),
        ("rankshards/ddp", "shard_00000_of_00002.pt"),
        ("hf/trainer/checkpoint-3", "optimizer.pt"),
        ("torch/train_state.pt", "train_state.pt"),
    ],
)
def test_bytes_appended_to_a_torch_save_file_are_said_and_not_sealed(fixture, rel, tmp_path):
    """Bytes added after a torch.save file's archive (a copy or an append gone wrong) passed verify
    with no word and were sealed, in every format of .pt files; a DCP file's were a corrupt-file
    warning that seal refuses. Now likewise: torch.load reads past them, so a warning."""
    from tests.conftest import fixture_copy

    ck = fixture_copy(FIXTURES / fixture, tmp_path / "ck")
    times = (ck / rel).stat()
    with open(ck / rel, "ab") as f:
        f.write(b"\x00junk" * 20)
    os.utime(ck / rel, ns=(times.st_atime_ns, times.st_mtime_ns))  # (not a file rewritten after the commit)
    before = tree_digests(ck)
    code, report = _findings(ck)
    found = [(f["rule"], f["severity"], f["file"]) for f in report["findings"] if f["rule"] != "missing-state"]
    named = rel.removeprefix("iter_0000003/") if fixture.endswith("dist_tp2") else rel  # (from the iteration)
    assert code == 0 and found == [("corrupt-file", "warning", named)], report["findings"]
    assert "100 more than its torch.save archive reaches" in report["findings"][0]["message"], report["findings"]
    assert_clean(run_cli("seal", ck), 3, named, "100 more than its torch.save archive reaches")
    assert tree_digests(ck) == before


def test_a_trainer_process_rng_file_missing_between_others_is_named(tmp_path):
    """Trainer saves rng_state_N.pth for each process N; with rng_state_1.pth gone from 0, 2 and 3,
    verify passed and seal vouched for it (the process resumes with fresh RNG state, logged only).
    A missing-file error, seal refuses; convert, which leaves the RNG files behind, still writes."""
    ck = tmp_path / "checkpoint-3"
    shutil.copytree(HF_TRAINER, ck)
    (ck / "rng_state.pth").rename(ck / "rng_state_0.pth")
    for n in (1, 2, 3):
        shutil.copy2(ck / "rng_state_0.pth", ck / f"rng_state_{n}.pth")
    assert _findings(ck)[0] == 0
    (ck / "rng_state_2.pth").unlink()
    code, report = _findings(ck)
    assert code == 1 and _rules(report) == [("missing-file", "rng_state_2.pth")], report["findings"]
    assert "rng_state_2.pth is missing: Trainer saves one RNG state per process, and those of processes 0 to 3" in (
        report["findings"][0]["message"]
    )
    assert_clean(run_cli("seal", ck), 3, "rng_state_2.pth is missing", "not sealed")
    assert run_cli("convert", ck, "-o", tmp_path / "out", "--to", "dcp", "--kind", "param").code == 0
    # a node's own disk under save_on_each_node: its processes' files alone (4 to 7), no gap
    node = tmp_path / "node1" / "checkpoint-3"
    shutil.copytree(HF_TRAINER, node)
    for n in (4, 5, 6, 7):
        shutil.copy2(node / "rng_state.pth", node / f"rng_state_{n}.pth")
    (node / "rng_state.pth").unlink()
    assert _findings(node)[0] == 0


def test_a_trainer_file_copied_over_another_is_not_its_state(tmp_path):
    """scheduler.pt replaced by optimizer.pt or rng_state.pth (any dict read as a scheduler's)
    passed with its state present: LambdaLR.load_state_dict takes such a dict silently and the
    schedule starts again. A dict that is another Trainer file's state is a corrupt-file, and the
    scheduler state missing."""
    for source, what in (("optimizer.pt", "optimizer state"), ("rng_state.pth", "rng state")):
        ck = tmp_path / source / "hf"
        shutil.copytree(HF_TRAINER, ck)
        shutil.copy2(ck / source, ck / "scheduler.pt")
        code, report = _findings(ck, "--require", "scheduler")
        found = sorted((f["rule"], f["severity"], f["file"]) for f in report["findings"])
        assert code == 1 and found == [
            ("corrupt-file", "error", "scheduler.pt"),
            ("missing-state", "error", None),
        ], report["findings"]
        said = next(f["message"] for f in report["findings"] if f["rule"] == "corrupt-file")
        assert f"expected scheduler state, found {what}" in said, said


@pytest.mark.parametrize("size", [0, 5, 20, 600])
def test_a_safetensors_file_cut_inside_its_header_is_truncated_not_corrupt(size, tmp_path):
    """A safetensors file cut before the end of its header (a save or copy that stopped early) was
    a corrupt-file "truncated or not a safetensors file"; the length field is sane and the JSON
    begun, so it is a truncated-file. A length field that is garbage stays corrupt. The human
    report counts "1 file", not "1 files"."""
    ck = tmp_path / "model.safetensors"
    shutil.copy2(FIXTURES / "safetensors" / "model.safetensors", ck)
    _cut_to(ck, size)
    code, report = _findings(ck)
    assert code == 1 and _rules(report) == [("truncated-file", "model.safetensors")], report
    data = bytearray((FIXTURES / "safetensors" / "model.safetensors").read_bytes())
    data[8] = ord("x")  # the JSON's first byte gone: not a header cut short
    ck.write_bytes(bytes(data[:600]))
    code, report = _findings(ck)
    assert code == 1 and _rules(report) == [("corrupt-file", "model.safetensors")], report
    shutil.copy2(FIXTURES / "safetensors" / "model.safetensors", ck)
    r = run_cli("verify", ck, cwd=tmp_path)
    assert r.code == 0 and "checked: 1 file, " in r.stdout and "0 errors, 5 warnings" in r.stdout, r.stdout


@pytest.mark.parametrize("sealed", [False, True], ids=["no seal", "sealed"])
@pytest.mark.parametrize(
    ("fixture", "rel"),
    [
        ("deepspeed/zero2", "global_step3/zero_pp_rank_1_mp_rank_00_optim_states.pt"),
        ("megatron/legacy_tp2pp2", "iter_0000003/mp_rank_01_001/model_optim_rng.pt"),
        ("dcp/fsdp2", "__1_0.distcp"),
    ],
)
def test_a_folder_standing_where_a_rank_file_should_be_is_said(fixture, rel, sealed, tmp_path):
    """A rank's file replaced by a folder of its name (a copy that went wrong) was reported as
    simply missing: the user looks for a deleted file and finds one there."""
    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / fixture, ck)
    if sealed:
        assert run_cli("seal", ck, "-q").code == 0
    (ck / rel).unlink()
    (ck / rel).mkdir()
    code, report = _findings(ck)
    assert code == 1 and _rules(report) == [("missing-file", rel)], report
    assert report["findings"][0]["message"].endswith("(a directory stands at that path, not a file)"), report


def test_a_storage_entry_missing_a_field_beside_a_missing_file_is_no_internal_error(tmp_path):
    """The walk of a DCP file's records where describe stopped (a data file missing) read each
    storage entry's fields as attributes: an entry whose pickle lacks one ended verify with an
    internal error instead of the findings."""
    import pickle

    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / "dcp" / "fsdp2", ck)
    md = pickle.loads((ck / ".metadata").read_bytes())
    key = next(iter(md.storage_data))
    object.__delattr__(md.storage_data[key], "relative_path")
    (ck / ".metadata").write_bytes(pickle.dumps(md))
    (ck / "__3_0.distcp").unlink()
    code, report = _findings(ck)
    assert code == 1 and _rules(report) == [("corrupt-file", ".metadata"), ("missing-file", "__3_0.distcp")], report
    assert "has relative_path None" in report["findings"][0]["message"]


@pytest.mark.parametrize(
    ("fixture", "gone", "item", "flipped"),
    [
        ("dcp/fsdp2", "__3_0.distcp", "model.blocks.0.fc1.weight", "__1_0.distcp"),
        # torch_dist, given by its save directory (the tracker names the iteration): megatron-core's
        # records hold its stacked keys (decoder.layers.mlp.…, every layer's and every expert's),
        # named as describe names the items (the layer's own, the expert's own)
        ("megatron/dist_tp2pp2", "__1_0.distcp", "decoder.layers.2.mlp.linear_fc1.weight.exp_avg", "__2_0.distcp"),
        (
            "megatron/dist_pp2ep2",
            "__0_0.distcp",
            "decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight",
            "__3_1.distcp",
        ),
        (
            "megatron/dist_tp2ep2_mtp",
            "__0_0.distcp",
            "mtp.layers.0.transformer_layer.mlp.experts.local_experts.1.linear_fc2.weight",
            "__1_0.distcp",
        ),
    ],
)
def test_a_damaged_dcp_record_beside_a_missing_file_is_named_with_its_item(fixture, gone, item, flipped, tmp_path):
    """A DCP save with a data file missing does not describe, so a flipped byte in another rank's
    file was found by walking its records without the metadata: the finding named the record's
    byte but no item, though .metadata read and says which item each record holds."""
    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / fixture, ck)
    dist = fixture.startswith("megatron")
    data = ck / "iter_0000003" if dist else ck
    adapter, manifest = registry.describe(data)
    piece = next(p for p in manifest.items[item].pieces if p.file == flipped)
    with adapter.reader(manifest) as reader:
        start, n = reader.raw_span(piece, manifest.items[item])
    st = os.stat(data / flipped)
    with open(data / flipped, "r+b") as f:  # (its modification time kept: not a save in flight)
        f.seek(start + n // 2)
        byte = f.read(1)[0]
        f.seek(start + n // 2)
        f.write(bytes([byte ^ 0xFF]))
    os.utime(data / flipped, ns=(st.st_atime_ns, st.st_mtime_ns))
    (data / gone).unlink()
    code, report = _findings(ck)
    prefix = "iter_0000003/" if dist else ""
    assert code == 1 and _rules(report) == [
        ("missing-file", prefix + gone),
        ("checksum-mismatch", prefix + flipped),
    ], report
    found = report["findings"][1]
    assert found["item"] == item and f"(of {item})" in found["message"], found
    assert report["format"] == ("megatron-dist" if dist else "dcp")
    # the item is the one the described checkpoint names for that damage, once the missing file is back
    shutil.copy2(FIXTURES / fixture / data.relative_to(ck) / gone, data / gone)
    code, whole = _findings(ck)
    assert [(f["rule"], f["item"]) for f in whole["findings"] if f["severity"] == "error"] == [
        ("checksum-mismatch", item)
    ], whole


@pytest.mark.parametrize(
    ("fixture", "rel", "what"),
    [
        ("safetensors/sharded", "model.safetensors.index.json", "fifo"),
        ("safetensors/sharded", "model-00002-of-00002.safetensors", "fifo"),
        ("safetensors/sharded", "model-00001-of-00002.safetensors", "dir"),
        ("dcp/fsdp2", "__1_0.distcp", "fifo"),
        ("megatron/dist_tp2pp2", "iter_0000003/common.pt", "fifo"),
    ],
)
def test_a_fifo_or_a_folder_in_a_files_place_is_said_not_waited_on(fixture, rel, what, tmp_path):
    """A named pipe where a file should be (a FIFO left by a streaming copy) made verify wait for a
    writer forever: the safetensors index and shards were opened without a look at what they are.
    A folder in a shard's place was blamed on the index, which names the shard rightly."""
    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / fixture, ck)
    (ck / rel).unlink()
    if what == "fifo":
        os.mkfifo(ck / rel)
    else:
        (ck / rel).mkdir()
    r = run_cli("verify", ck, "--json", timeout=30)
    report = json.loads(r.stdout)
    named = rel.removeprefix("iter_0000003/")  # (a described torch_dist save: named from its iteration)
    assert r.code == 1 and _rules(report) == [("missing-file", named)], report
    stands = "a FIFO (named pipe)" if what == "fifo" else "a directory"
    (said,) = [f["message"] for f in report["findings"] if f["severity"] == "error"]
    assert f"{stands} stands at that path, not a file" in said, report
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(
    ("fixture", "flags", "gone"),
    [
        ("megatron/legacy_tp2pp2", ("--to", "megatron-dist"), "iter_0000003/__1_0.distcp"),
        ("deepspeed/zero2", ("--to", "deepspeed-universal"), "global_step3_universal/zero/blocks.0.fc1.weight/exp_avg.pt"),
    ],
)
def test_a_file_deleted_from_a_written_save_directory_is_the_one_missing(fixture, flags, gone, tmp_path):
    """A writer seals its output before publishing it, and the seal recorded the published
    directory as its root, dropping the iteration (or tag) folder its files are named from: with
    a data file deleted, so that the checkpoint no longer describes, verify looked for every
    sealed file in the save directory and called all of them missing."""
    out = tmp_path / "out"
    assert run_cli("reshard", FIXTURES / fixture, "-o", out, *flags).code == 0
    (out / gone).unlink()
    code, report = _findings(out)
    errors = [(f["rule"], f["file"]) for f in report["findings"] if f["severity"] == "error"]
    assert code == 1 and errors == [("missing-file", gone)], report


@pytest.mark.parametrize("damage", ["item lost", "path not a string", "field missing"])
def test_a_dcp_storage_index_that_does_not_match_its_items_is_damage(damage, tmp_path):
    """One flipped bit in a torch_dist .metadata merged two item names: one item's entry was gone
    from state_dict_metadata while its storage entry stayed, and verify and seal passed the save
    (dcp.load fails on it: missing key). A storage entry whose file name is not a string was taken
    for a missing data file named "(3, 0, 0)"; one that lacks a field was an internal error's text."""
    import pickle

    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / "dcp" / "fsdp2", ck)
    md = pickle.loads((ck / ".metadata").read_bytes())
    key = next(k for k in md.storage_data if k.fqn in md.state_dict_metadata)
    if damage == "item lost":
        del md.state_dict_metadata[key.fqn]
        said = "storage entr"
    elif damage == "path not a string":
        object.__setattr__(md.storage_data[key], "relative_path", (3, 0, 0))
        said = "has relative_path (3, 0, 0)"
    else:
        object.__delattr__(md.storage_data[key], "length")
        said = "has length None"
    (ck / ".metadata").write_bytes(pickle.dumps(md))
    code, report = _findings(ck)
    assert code == 1 and _rules(report) == [("corrupt-file", ".metadata")], report
    assert said in report["findings"][0]["message"] and "AttributeError" not in report["findings"][0]["message"]
    assert run_cli("seal", ck).code == 3


@pytest.mark.parametrize("cut", [1, 10, 21, 22, 40, 56, 76, 97])
def test_a_torch_save_file_cut_inside_its_end_records_is_cut_short(cut, tmp_path):
    """torch.save ends an archive with zip64's end record (56 bytes), its locator (20) and the end
    record (22): a file cut inside those 98 bytes was called damaged ("not a readable torch.save
    archive (BadZipFile)") where 100 bytes or more were said to be cut short."""
    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / "megatron" / "legacy_tp2pp2", ck)
    rel = "iter_0000003/mp_rank_01_000/model_optim_rng.pt"
    _cut(ck / rel, cut)
    code, report = _findings(ck)
    assert code == 1 and _rules(report) == [("truncated-file", rel)], report


def test_a_seal_of_another_save_is_said_to_be_one(tmp_path):
    """Verifying step 11 against step 10's seal reported every file as changed with the hint
    "storage or transfer corruption": the seal is another save's, which the seal's own step says."""
    seal = tmp_path / "s10.json"
    assert run_cli("seal", FIXTURES / "run" / "step_10", "--out", seal).code == 0
    code, report = _findings(FIXTURES / "run" / "step_11", "--manifest", seal)
    errors = [f for f in report["findings"] if f["severity"] == "error"]
    assert code == 1 and errors[0]["rule"] == "step-mismatch", report
    assert "the seal is of another save (step 10; this checkpoint is step 11)" in errors[0]["message"]
    assert {f["rule"] for f in errors[1:]} == {"checksum-mismatch"}
    assert all(f["hint"] == "verify against this save's own seal" for f in errors[1:]), errors
    # the save's own seal, with only its step field changed since (one file of several differs): damage
    ck = tmp_path / "ck"
    shutil.copytree(HF_TRAINER, ck)
    assert run_cli("seal", ck).code == 0
    state = ck / "trainer_state.json"
    state.write_text(state.read_text().replace('"global_step": 3', '"global_step": 7'))
    code, report = _findings(ck)
    assert code == 1 and _rules(report) == [("checksum-mismatch", "trainer_state.json")], report
    assert "another save" not in report["findings"][0]["message"]


def test_a_seal_of_another_dcp_save_of_the_same_step_is_said_by_its_save_id(tmp_path):
    """Two DCP saves of the same step (two runs, or the same run saved twice): verifying one against
    the other's seal blamed every file on storage or transfer corruption. DCP gives each save's
    .metadata a fresh save_id, which the seal keeps: the seal is said to be another save's. The
    save's own seal with its .metadata replaced by another save's is left to the file's mismatch."""
    seal = tmp_path / "mesh.json"
    assert run_cli("seal", FIXTURES / "dcp" / "mesh2x2", "--out", seal).code == 0
    code, report = _findings(FIXTURES / "dcp" / "fsdp2", "--manifest", seal)
    errors = [f for f in report["findings"] if f["severity"] == "error"]
    assert code == 1 and errors[0]["rule"] == "step-mismatch", report
    assert "the seal is of another save (save id " in errors[0]["message"], errors[0]
    assert all(f["hint"] == "verify against this save's own seal" for f in errors[1:]), errors
    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / "dcp" / "fsdp2_zstd", ck)
    assert run_cli("seal", ck).code == 0
    shutil.copy2(FIXTURES / "dcp" / "fsdp2" / ".metadata", ck / ".metadata")
    code, report = _findings(ck)
    assert code == 1 and not any("another save" in f["message"] for f in report["findings"]), report


@pytest.mark.parametrize(("fixture", "old", "new", "tracker"), [
    ("megatron/legacy_tp2pp2", "iter_0000003", "iter_0000006", ("latest_checkpointed_iteration.txt", "6")),
    ("deepspeed/zero2", "global_step3", "global_step6", ("latest", "global_step6")),
])  # fmt: skip
def test_a_save_directorys_seal_left_from_an_earlier_save_is_a_step_mismatch(fixture, old, new, tracker, tmp_path):
    """A save directory sealed, then saved again (a new iteration, the tracker moved to it): verify
    of the directory stopped, exit 3, "the seal of another checkpoint, or it was edited". Now the
    new save is checked as without a seal and the stale seal is a step-mismatch finding, exit 1."""
    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / fixture, ck)
    assert run_cli("seal", ck).code == 0
    shutil.copytree(ck / old, ck / new)
    (ck / tracker[0]).write_text(tracker[1])
    code, report = _findings(ck)
    assert code == 1, report
    first = report["findings"][0]
    assert first["rule"] == "step-mismatch", report["findings"]
    assert f"the seal is of {old}, another save in this directory" in first["message"]
    assert f"none of {new}'s files" in first["message"] and "checked as without a seal" in first["message"]


def test_a_partial_copy_of_whole_ranks_blames_no_metadata(tmp_path):
    """A torch_dist save of 8 ranks with the files of ranks 1..6 gone (a node's copy lost): the 12
    missing files outnumber the 4 here, and the .metadata that places the 4 exactly was named
    first as "likely another save's metadata copied in". Whole ranks gone are missing files."""
    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / "megatron" / "dist_tp2pp2dp2_distopt", ck)
    for f in (ck / "iter_0000003").glob("__[1-6]_*.distcp"):
        f.unlink()
    code, report = _findings(ck)
    assert code == 1 and not any("another save" in f["message"] for f in report["findings"]), report["findings"]
    missing = [f for f in report["findings"] if f["rule"] == "missing-file"]
    assert len(missing) == 12 and {f["rank"] for f in missing} == {1, 2, 3, 4, 5, 6}, missing


@pytest.mark.parametrize(("into", "source"), [("mesh2x2", "fsdp2"), ("fsdp2", "mesh2x2")])
def test_another_saves_dcp_metadata_is_named_when_every_data_file_disagrees_with_it(into, source, tmp_path):
    """Another save's .metadata copied into a DCP checkpoint blamed each data file (four cut short,
    or 85 corrupt items), never the one file they all disagree with. It is named first where every
    data file still ends as torch wrote it; the data files' findings stay. One damaged data file of
    several, or every one cut short, names no metadata. (zstd-compressed records end in no zip
    record: not told, the data files are named.)"""
    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / "dcp" / into, ck)
    shutil.copy2(FIXTURES / "dcp" / source / ".metadata", ck / ".metadata")
    code, report = _findings(ck)
    first = report["findings"][0]
    assert code == 1 and (first["rule"], first["file"]) == ("corrupt-file", ".metadata"), report["findings"]
    assert "all 4 data files disagree with it" in first["message"]
    assert {f["file"] for f in report["findings"][1:]} >= {f"__{r}_0.distcp" for r in range(4)}
    ck = tmp_path / "per_item"  # another save's metadata of other files: 186 missing, none named
    shutil.copytree(FIXTURES / "dcp" / into, ck)
    shutil.copy2(FIXTURES / "dcp" / "fsdp2_per_item" / ".metadata", ck / ".metadata")
    code, report = _findings(ck)
    first = report["findings"][0]
    assert code == 1 and (first["rule"], first["file"]) == ("corrupt-file", ".metadata"), report["findings"]
    assert "data files that are not here, where the folder holds 4" in first["message"], first
    ck = tmp_path / "one"
    shutil.copytree(FIXTURES / "dcp" / "fsdp2", ck)
    _cut_to(ck / "__1_0.distcp", 20_000)
    code, report = _findings(ck)
    assert code == 1 and not any(f["file"] == ".metadata" for f in report["findings"]), report["findings"]
    for data in ck.glob("*.distcp"):  # every file cut short (an interrupted copy): the files, not .metadata
        _cut_to(data, data.stat().st_size - 100)
    code, report = _findings(ck)
    assert code == 1 and not any(f["file"] == ".metadata" for f in report["findings"]), report["findings"]


def test_a_trainer_checkpoint_whose_step_is_not_its_folders_is_a_step_mismatch(tmp_path):
    """Trainer names each save checkpoint-N after its global step: a trainer_state.json of step 2 in
    checkpoint-3 (another save's state copied in) passed verify."""
    ck = tmp_path / "checkpoint-3"
    shutil.copytree(HF_TRAINER, ck)
    state = ck / "trainer_state.json"
    state.write_text(state.read_text().replace('"global_step": 3', '"global_step": 2'))
    code, report = _findings(ck)
    assert code == 1 and _rules(report) == [("step-mismatch", "trainer_state.json")], report
    renamed = tmp_path / "copy"  # (a folder not named by Trainer: its name claims nothing)
    ck.rename(renamed)
    assert _findings(renamed)[0] == 0


def test_a_trainer_checkpoint_without_its_model_file_is_missing_it(tmp_path):
    """A Trainer checkpoint whose model.safetensors was deleted was "not a checkpoint format
    ckpttool reads"; a Trainer's output_dir (its own trainer_state.json beside the checkpoint-N
    folders) is still a folder of checkpoints."""
    ck = tmp_path / "checkpoint-3"
    shutil.copytree(HF_TRAINER, ck)
    (ck / "model.safetensors").unlink()
    code, report = _findings(ck)
    assert code == 1 and _rules(report) == [("missing-file", "model.safetensors")], report
    out = tmp_path / "output_dir"
    out.mkdir()
    shutil.copytree(HF_TRAINER, out / "checkpoint-3")
    shutil.copy2(HF_TRAINER / "trainer_state.json", out)
    r = run_cli("verify", out)
    assert r.code == 3 and "a folder holding the checkpoint checkpoint-3" in r.stderr, r.stderr
    # an FSDP Trainer save keeps its model in a DCP folder of its own (pytorch_model_fsdp_0/): not missing
    fsdp = tmp_path / "fsdp" / "checkpoint-3"
    shutil.copytree(FIXTURES / "dcp" / "fsdp2", fsdp / "pytorch_model_fsdp_0")
    shutil.copy2(HF_TRAINER / "trainer_state.json", fsdp)
    r = run_cli("verify", fsdp)
    assert r.code == 3 and "a folder holding the checkpoint pytorch_model_fsdp_0 (dcp)" in r.stderr, r.stderr


def test_a_distrib_optim_copied_from_another_stage_is_said_to_be_anothers(tmp_path):
    """A distrib_optim.pt copied from another pipeline stage into this rank's folder was reported as
    "this distributed-optimizer layout is not supported yet": a limit of ckpttool, not the file."""
    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / "megatron" / "legacy_tp2pp2_distopt", ck)
    rel = "iter_0000003/mp_rank_00_001/distrib_optim.pt"
    shutil.copy2(ck / "iter_0000003/mp_rank_00_000/distrib_optim.pt", ck / rel)
    code, report = _findings(ck)
    assert code == 1 and _rules(report) == [("corrupt-file", rel)], report
    said = report["findings"][0]["message"]
    assert "another rank's or another save's" in said and "not supported" not in said, said


def test_an_empty_state_file_is_said_once(tmp_path):
    """An empty rng_state.pth beside a Trainer model: its finding said the file was empty twice
    ("…first write; reading it: the file is empty (0 bytes): …"), the reader having met the same."""
    ck = tmp_path / "checkpoint-3"
    shutil.copytree(HF_TRAINER, ck)
    (ck / "rng_state.pth").write_bytes(b"")
    code, report = _findings(ck)
    assert code == 1 and _rules(report) == [("truncated-file", "rng_state.pth")], report
    said = report["findings"][0]["message"]
    assert said.count("the file is empty") == 1 and said.endswith("the training state it holds does not read"), said


def test_numbered_shards_without_their_index_are_warned_of(tmp_path):
    """model-0000N-of-0000M.safetensors without model.safetensors.index.json passed in silence,
    though from_pretrained finds the shards through the index: a warning (the tensors read)."""
    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / "safetensors" / "sharded", ck)
    (ck / "model.safetensors.index.json").unlink()
    code, report = _findings(ck, "--fail-on", "warning")
    said = [(f["rule"], f["severity"], f["file"]) for f in report["findings"] if f["rule"] == "missing-file"]
    assert code == 1 and said == [("missing-file", "warning", "model.safetensors.index.json")], report
    assert _findings(ck)[0] == 0


def test_a_torch_save_file_cut_anywhere_in_its_last_records_is_cut_short(tmp_path):
    """Every cut of the last 300 bytes of a torch.save file (its central directory's last entries
    and the end records): cut short, never "damaged" (a cut inside a record's 4-byte signature
    was called damaged)."""
    from ckpttool.verify import verify

    whole = (FIXTURES / "torch" / "train_state.pt").read_bytes()
    f = tmp_path / "t.pt"
    said = {}
    for n in range(1, 301):
        f.write_bytes(whole[:-n])
        said[n] = sorted({x.rule for x in verify(f).findings if x.severity == "error"})
    assert {n: r for n, r in said.items() if r != ["truncated-file"]} == {}


def test_a_coverage_gap_says_where_it_is(tmp_path):
    """A coverage gap said how many elements no piece holds but not where: the first block of them
    is given (a rank's rows, here), so that the rank whose piece is gone can be found."""
    import pickle

    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / "dcp" / "fsdp2", ck)
    md = pickle.loads((ck / ".metadata").read_bytes())
    name, meta = next((n, m) for n, m in md.state_dict_metadata.items() if len(getattr(m, "chunks", ())) > 2)
    dropped = meta.chunks.pop(1)
    (ck / ".metadata").write_bytes(pickle.dumps(md))
    code, report = _findings(ck)
    gaps = [f for f in report["findings"] if f["rule"] == "coverage-gap"]
    spans = ", ".join(f"{o}:{o + n}" for o, n in zip(dropped.offsets, dropped.sizes, strict=True))
    assert code == 1 and [f["item"] for f in gaps] == [name], report
    assert gaps[0]["message"].endswith(f"are in no piece (the first at [{spans}])"), gaps[0]["message"]
