"""verify: one test per rule on corruptions of real fixtures, clean fixtures pass, every output mode."""

from __future__ import annotations

import json
import re
import os
import shutil
import struct
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from ckpttool import registry
from ckpttool.errors import NotFoundError
from ckpttool.seal import seal
from ckpttool.verify import verify
from tests.conftest import DCP_FIXTURES, FIXTURES, OnFirstProgress, assert_clean, run_cli, set_stored_crc, tree_digests

CLEAN = [
    *(f"dcp/{n}" for n in DCP_FIXTURES),
    "dcp/fsdp2_hf/sharded",
    *(
        f"deepspeed/{n}"
        for n in (
            "zero0",
            "zero1",
            "zero2",
            "zero2_elastic",
            "zero2_bf16",
            "zero3",
            "bf16_zero0",
            "bf16_optimizer",
            "pipeline",
            "pipeline_tied",
            "pipeline_bf16",
            "tp2",
            "tp2_glu",
            "autotp",
            "universal",
        )
    ),
    # every one but legacy_pp2_mtpfirst and legacy_pp2_mtp_decoupled, whose runs trained two word
    # embeddings (megatron-core never syncs the MTP chunk's copy on the first pipeline rank; it gives the
    # MTP stage's copy the default LR, not --decoupled-lr): test_reshard_mtp checks what verify says of them
    *(
        f"megatron/{p.name}"
        for p in sorted((FIXTURES / "megatron").iterdir())
        if p.is_dir() and p.name not in ("legacy_pp2_mtpfirst", "legacy_pp2_mtp_decoupled")
    ),
    "rankshards/tp_manual/step_00000003",
    "rankshards/ddp",
    "rankshards/pipeline",
    *(f"dtensor/{n}" for n in ("fsdp2_tp", "fsdp2_uneven", "placements", "strided", "submesh")),
    "safetensors/sharded",
    "safetensors/model.safetensors",
    "torch/train_state.pt",
]


def _copy(rel: str, tmp_path: Path) -> Path:
    src = FIXTURES / rel
    dst = tmp_path / src.name
    (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)
    return dst


def _rules(report) -> set[str]:
    return {f.rule for f in report.findings if f.severity == "error"}


def _raw(path: Path, item_name: str, index: int = 0) -> tuple[Path, int, int]:
    adapter, m = registry.describe(path)
    item = m.items[item_name]
    with adapter.reader(m) as reader:
        span = reader.raw_span(item.pieces[index], item)
    assert span is not None
    return Path(m.root) / item.pieces[index].file, span[0], span[1]


def _patch(file: Path, offset: int, data: bytes) -> None:
    with open(file, "r+b") as fh:
        fh.seek(offset)
        fh.write(data)


@pytest.mark.parametrize("rel", CLEAN)
def test_clean_fixtures_verify(rel):
    report = verify(FIXTURES / rel, deep=True)
    assert report.failing() == [], [f.message for f in report.failing()]


FLIPS = [
    ("dcp/fsdp2", "model.blocks.0.fc1.weight", True),
    ("deepspeed/zero2", "blocks.0.fc1.weight.exp_avg", True),
    ("megatron/legacy_tp2pp2", "decoder.layers.0.mlp.linear_fc2.weight", True),
    ("megatron/dist_tp2", "embedding.word_embeddings.weight", True),
    ("torch/train_state.pt", "model.blocks.0.fc1.weight", True),
    ("rankshards/ddp", "model.body.0.weight", True),
    ("safetensors/sharded", None, False),  # safetensors carries no integrity data: only the seal sees it
]


@pytest.mark.parametrize(("rel", "item", "crc"), FLIPS)
def test_flipped_byte_caught_with_and_without_seal(rel, item, crc, tmp_path):
    path = _copy(rel, tmp_path)
    adapter, m = registry.describe(path)
    item = item or next(n for n, i in m.items.items() if i.is_tensor and i.nbytes > 64)
    _, sealed_at = seal(path, out=tmp_path / "seal.json")
    file, off, n = _raw(path, item)
    byte = file.read_bytes()[off + n // 2]
    _patch(file, off + n // 2, bytes([byte ^ 0x40]))
    with_seal = verify(path, manifest_path=sealed_at)
    assert "checksum-mismatch" in _rules(with_seal)
    named = [f for f in with_seal.findings if f.rule == "checksum-mismatch"]
    assert item in named[0].message  # the seal names the tensor the byte belongs to
    # the rank whose file it is (the first tensor lies in rank 0's); none for a file no rank wrote
    # alone (a plain torch.save file said rank 0)
    rank = None if rel.startswith(("torch/", "safetensors/")) else 0
    assert [f.rank for f in with_seal.findings if f.file] == [rank] * len(named)
    without = verify(path)
    assert ("checksum-mismatch" in _rules(without)) == crc
    if crc:  # the member's CRC fails: the tensors in it are named, not only the member
        (named,) = [f for f in without.findings if f.rule == "checksum-mismatch"]
        assert item in named.message and named.rank == rank
        # (a flat buffer of several, as DeepSpeed's optimizer partition: no one item)
        assert named.item == (item if "," not in named.message.split("(")[1].split(")")[0] else None)


def test_a_file_saved_again_with_the_same_values_is_named_as_such(tmp_path):
    """A sealed rank file saved again by torch.save with the same tensors in another order: the
    pieces were hashed at the offsets the seal recorded, not where they lie now, so five unchanged
    tensors were "the changed bytes" and five replica-mismatch errors said their two copies
    differ. Now one checksum-mismatch, which says the tensors hold their sealed bytes."""
    path = _copy("rankshards/ddp", tmp_path)
    seal(path)
    f = path / "shard_00001_of_00002.pt"
    was = os.stat(f)
    state = torch.load(f, weights_only=True)
    state["model"] = dict(reversed(list(state["model"].items())))
    torch.save(state, f)
    os.utime(f, ns=(was.st_atime_ns, was.st_mtime_ns))
    report = verify(path)
    errors = [x for x in report.findings if x.severity == "error"]
    assert [(x.rule, x.file) for x in errors] == [("checksum-mismatch", "shard_00001_of_00002.pt")], errors
    assert "every tensor in it holds its sealed bytes, described as when sealed: the file was written again" in (
        errors[0].message
    )
    assert "saved again after the seal" in (errors[0].hint or "")


def _member_start(file: Path, member: str) -> int:
    """Where zip member ``member``'s bytes start in ``file`` (past its local header's own extra field,
    which torch pads for alignment)."""
    import zipfile

    with zipfile.ZipFile(file) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(member))
    head = file.read_bytes()[info.header_offset : info.header_offset + 30]
    n, extra = struct.unpack("<HH", head[26:30])
    return info.header_offset + 30 + n + extra


@pytest.mark.parametrize("how", ["safetensors name", "safetensors shape", "pickle", "byteorder"])
def test_a_sealed_file_damaged_outside_its_tensors_is_not_called_written_again(how, tmp_path):
    """A flipped bit in a safetensors header (a tensor renamed, a shape that no longer fits its
    bytes) or in a torch.save archive's pickle or byteorder record left every tensor's sealed bytes
    in place: verify said "the file was written again" and told the user to seal again, which
    would have vouched for the damage. Now the damage is named and the hint is to restore."""
    if how.startswith("safetensors"):
        path = tmp_path / "st"
        path.mkdir()
        f = path / "model.safetensors"
        shutil.copy2(FIXTURES / "safetensors" / "model.safetensors", f)
        seal(path)
        data = bytearray(f.read_bytes())
        if how.endswith("name"):
            data[data.index(b'"pos"') + 2] ^= 1  # pos -> pns
            said = "it describes them otherwise than when sealed (pos is no longer in it; pns is new)"
        else:
            at = data.index(b'"shape":[', data.index(b'"ln_f.weight"')) + len(b'"shape":[')
            data[at] ^= 2  # a digit of the shape: the tensor's bytes no longer fit it
            said = "ln_f.weight"
        f.write_bytes(data)
    else:
        path = _copy("rankshards/ddp", tmp_path)
        seal(path)
        f = path / "shard_00001_of_00002.pt"
        member = "data.pkl" if how == "pickle" else "byteorder"
        at = _member_start(f, member)
        at += f.read_bytes()[at:].find(b"model") + 1 if how == "pickle" else 0  # (a key's letter: mOdel)
        _patch(f, at, bytes([f.read_bytes()[at] ^ 0x20]))
        said = f"shard_00001_of_00002/{member}"
    errors = [x for x in verify(path).findings if x.severity == "error"]
    assert [x.rule for x in errors] == ["checksum-mismatch"], errors
    assert "so the damage is outside them: " in errors[0].message and said in errors[0].message, errors[0].message
    assert "written again" not in errors[0].message and "sealing it again would vouch" in (errors[0].hint or "")
    assert errors[0].message.count(said) == 1, errors[0].message  # (not again as what reading it met)


def _zero_with_crc(file: Path, offset: int, length: int) -> None:
    """Zeros over ``length`` bytes at ``offset`` of a DCP rank file, the CRC-32 of the zip member
    holding them (one chunk's torch.save archive) stored again: as a save of zeros would be."""
    import zlib

    was, data = os.stat(file), bytearray(file.read_bytes())
    data[offset : offset + length] = bytes(length)
    head = data.rfind(b"PK\x03\x04", 0, offset)
    n, extra = struct.unpack("<HH", data[head + 26 : head + 30])
    name, start = bytes(data[head + 30 : head + 30 + n]), head + 30 + n + extra
    entry = data.find(b"PK\x01\x02", offset)
    while bytes(data[entry + 46 : entry + 46 + struct.unpack("<H", data[entry + 28 : entry + 30])[0]]) != name:
        entry = data.find(b"PK\x01\x02", entry + 4)
    size = struct.unpack("<I", data[entry + 20 : entry + 24])[0]
    crc = struct.pack("<I", zlib.crc32(bytes(data[start : start + size])))
    data[head + 14 : head + 18] = crc
    data[entry + 16 : entry + 20] = crc
    file.write_bytes(data)
    os.utime(file, ns=(was.st_atime_ns, was.st_mtime_ns))


def test_one_ranks_optimizer_state_reset_is_named(tmp_path):
    """Every Adam moment of one FSDP2 rank zeroed at step 3, its CRCs valid (a rank that resumed
    from nothing and saved): no tensor is all zeros, so verify passed, with and without --deep.
    Now an optimizer-mismatch error names that rank's file, with a seal and without."""
    path = _copy("dcp/fsdp2", tmp_path)
    _, m = registry.describe(path)
    for name, item in m.items.items():
        if name.endswith(("exp_avg", "exp_avg_sq")):
            for i, piece in enumerate(item.pieces):
                if piece.file == "__1_0.distcp":
                    _zero_with_crc(*_raw(path, name, i))
    for report in (verify(path), verify(path, deep=True)):
        found = [(f.rule, f.file, f.rank) for f in report.findings if f.severity == "error"]
        assert found == [("optimizer-mismatch", "__1_0.distcp", 1)], report.findings
        assert "every optimizer moment it holds (24 pieces) is all zeros at step 3" in report.findings[0].message
    seal(path)
    assert [(f.rule, f.file) for f in verify(path).findings if f.severity == "error"] == [
        ("optimizer-mismatch", "__1_0.distcp")
    ]


def test_truncated_file(tmp_path):
    path = _copy("dcp/fsdp2", tmp_path)
    seal(path, out=tmp_path / "seal.json")
    f = path / "__2_0.distcp"
    f.write_bytes(f.read_bytes()[:-5000])
    for report in (verify(path), verify(path, manifest_path=tmp_path / "seal.json")):
        assert "truncated-file" in _rules(report)
        assert any("__2_0.distcp" in (x.file or x.message) for x in report.findings)


def test_rank_file_deleted(tmp_path):
    """A deleted rank file is a missing-file finding naming the file and the rank whose file it
    is (the rank its pieces name), with a seal or without."""
    path = _copy("megatron/legacy_tp2pp2", tmp_path)
    shutil.rmtree(path / "iter_0000003" / "mp_rank_01_000")
    report = verify(path)
    missing = [(f.file, f.rank) for f in report.findings if f.rule == "missing-file"]
    assert missing == [("iter_0000003/mp_rank_01_000/model_optim_rng.pt", 1)], report.findings
    path2 = _copy("dcp/fsdp2", tmp_path / "b")
    (path2 / "__3_0.distcp").unlink()
    unsealed = verify(path2)
    assert [(f.file, f.rank) for f in unsealed.findings if f.rule == "missing-file"] == [("__3_0.distcp", 3)]
    shutil.rmtree(path2)
    path2 = _copy("dcp/fsdp2", tmp_path / "b")
    seal(path2)
    (path2 / "__3_0.distcp").unlink()
    report = verify(path2)
    assert "missing-file" in _rules(report)
    assert all(f.rank == 3 for f in report.findings if f.rule == "missing-file")


def test_a_sealed_save_directory_names_each_missing_file_once(tmp_path):
    """torch_dist, sealed, two data files deleted: the reader stops (no manifest), and its
    findings named the files from the save directory, the seal's from the iteration folder: each
    file was reported twice, under two paths."""
    path = _copy("megatron/dist_tp2", tmp_path)
    seal(path)
    gone = ["iter_0000003/__0_1.distcp", "iter_0000003/__1_1.distcp"]
    for rel in gone:
        (path / rel).unlink()
    os.truncate(path / "iter_0000003" / "__1_0.distcp", 10_000)
    report = verify(path)
    assert sorted((f.file, f.rank) for f in report.findings if f.rule == "missing-file") == [(gone[0], 0), (gone[1], 1)]
    cut = [f.file for f in report.findings if f.rule == "truncated-file"]
    assert cut == ["iter_0000003/__1_0.distcp"], report.findings


def test_step_rewritten_in_one_rank(tmp_path):
    path = _copy("rankshards/ddp", tmp_path)
    f = path / "shard_00001_of_00002.pt"
    state = torch.load(f, weights_only=True)
    state["step"] = 4
    torch.save(state, f)
    report = verify(path)
    steps = [x for x in report.findings if x.rule == "step-mismatch"]
    # two ranks, one step each: no majority to call either right, and the finding says so
    assert steps and "shard_00001_of_00002.pt claim 4" in steps[0].message and "no majority" in steps[0].message


def test_a_pipeline_stage_file_named_for_another_step_is_said(tmp_path):
    """checkpoint_step<s>_stage<p>.pt: a stage's file from another save, renamed into this one (its
    pickle says step 3, its name 4), passed: the step in the names was never compared. Names that
    disagree with no content to say otherwise are compared with each other."""
    path = _copy("rankshards/pipeline", tmp_path)
    (path / "checkpoint_step3_stage1.pt").rename(path / "checkpoint_step4_stage1.pt")
    report = verify(path)
    assert [(f.rule, f.file, f.message) for f in report.findings if f.severity == "error"] == [
        ("step-mismatch", "checkpoint_step4_stage1.pt", "checkpoint_step4_stage1.pt is named for step 4 but holds step 3")
    ]
    assert report.step == 3


def test_interrupted_dcp_save(tmp_path):
    """One finding, naming the temporary file (there were two: the format's, naming the folder as
    typed, and the in-flight check's); torch_dist's likewise, given its save directory."""
    report = verify(FIXTURES / "hostile" / "dcp_metadata_tmp_only")
    assert [(f.rule, f.file) for f in report.findings] == [("incomplete-save", ".metadata.tmp")], report.findings
    assert "without .metadata (found .metadata.tmp)" in report.findings[0].message
    path = _copy("megatron/dist_tp2", tmp_path)
    assert verify(path).root == str(path / "iter_0000003")  # (the folder its findings name files from)
    r = run_cli("verify", path)
    assert r.code == 0 and f"\nfiles named from {path / 'iter_0000003'}\n" in r.stdout, r.stdout
    (path / "iter_0000003" / ".x.ckpttool-tmp-1").touch()  # named from the root, and from it, the one outside
    (path / ".y.ckpttool-tmp-1").touch()
    assert [f.file for f in verify(path).findings if f.rule == "incomplete-save"] == [
        "../.y.ckpttool-tmp-1",
        ".x.ckpttool-tmp-1",
    ]
    (path / "iter_0000003" / ".x.ckpttool-tmp-1").unlink()
    (path / ".y.ckpttool-tmp-1").unlink()
    (path / "iter_0000003" / ".metadata").rename(path / "iter_0000003" / ".metadata.tmp")
    report = verify(path)  # (no root: the describe failed; named from the save directory)
    assert report.root is None
    assert [(f.rule, f.file) for f in report.findings] == [("incomplete-save", "iter_0000003/.metadata.tmp")]


def test_another_saves_temporaries_below_the_checkpoint_fail_neither_verify_nor_seal(tmp_path):
    """verify walked every folder below the path given: an earlier iteration's save that stopped half
    way (its .metadata.tmp), or a folder of old runs kept beside a model, failed the checkpoint the
    tracker names with an incomplete-save error, and seal refused it. The checkpoint's own folders
    are looked at: its temporaries, and the tracker's beside it, still fail it."""
    path = _copy("megatron/dist_tp2", tmp_path)
    other = path / "iter_0000002"
    other.mkdir()
    shutil.copy2(path / "iter_0000003" / "__0_0.distcp", other)
    shutil.copy2(path / "iter_0000003" / ".metadata", other / ".metadata.tmp")
    assert verify(path).findings == []
    assert_clean(run_cli("seal", path), 0)
    (path / "ckpttool.manifest.json").unlink()
    (path / "iter_0000003" / ".metadata.tmp").touch()
    assert [(f.rule, f.file) for f in verify(path).findings] == [("incomplete-save", ".metadata.tmp")]
    (path / "iter_0000003" / ".metadata.tmp").unlink()
    (path / "latest_checkpointed_iteration.txt.tmp").touch()
    assert [(f.rule, f.file) for f in verify(path).findings] == [
        ("incomplete-save", "../latest_checkpointed_iteration.txt.tmp")
    ]
    assert_clean(run_cli("seal", path), 3, "latest_checkpointed_iteration.txt.tmp", "not sealed")
    beside = tmp_path / "model"
    (beside / "old_runs").mkdir(parents=True)
    shutil.copy2(FIXTURES / "safetensors" / "model.safetensors", beside)
    shutil.copytree(FIXTURES / "hostile" / "dcp_metadata_tmp_only", beside / "old_runs" / "dcp")
    assert [f for f in verify(beside).findings if f.severity == "error"] == []


def test_files_this_user_may_not_open_are_said_once_and_not_evaluated(tmp_path, monkeypatch):
    """A DCP data file without read permission gave 45 corrupt-file findings, one per item it holds
    (exit 1), with "Permission denied" only in the JSON; DeepSpeed's and safetensors' readers said it
    once, exit 3. Said once for every format, naming the files."""
    path = _copy("dcp/fsdp2", tmp_path)
    real_access = os.access
    blocked = {str(path / "__2_0.distcp"), str(path / "__3_0.distcp")}

    def no_read(file, mode, *args, **kwargs):  # (as for a user the files' permissions shut out)
        return False if str(file) in blocked else real_access(file, mode, *args, **kwargs)

    monkeypatch.setattr(os, "access", no_read)
    with pytest.raises(NotFoundError) as raised:
        verify(path)
    assert raised.value.message == "__2_0.distcp: cannot open (Permission denied) (and 1 more: __3_0.distcp)"
    assert raised.value.exit_code == 3


def test_a_seal_of_the_folder_above_or_below_is_pointed_to(tmp_path):
    """A DeepSpeed save directory sealed, then its tag verified (or the tag sealed and the directory
    verified): "no seal", with no word of the seal one folder away, which verify of that folder
    would check against. It is named, in the report and its JSON."""
    path = _copy("deepspeed/zero2", tmp_path)
    assert verify(path).seal_nearby is None
    assert run_cli("seal", path).code == 0
    report = verify(path / "global_step3")
    assert report.seal is None and report.seal_nearby == str(path / "ckpttool.manifest.json")
    r = run_cli("verify", path / "global_step3")
    assert r.code == 0 and f"seals the folder {path}: 'ckpttool verify {path}'" in " ".join(r.stdout.split())
    (path / "ckpttool.manifest.json").unlink()
    assert run_cli("seal", path / "global_step3").code == 0
    r = run_cli("verify", path, "--json")
    assert json.loads(r.stdout)["inputs"]["seal_nearby"] == str(path / "global_step3" / "ckpttool.manifest.json")
    dist = _copy("megatron/dist_tp2", tmp_path)  # (its iteration, the folder the findings are named from)
    assert run_cli("seal", dist / "iter_0000003").code == 0
    assert verify(dist).seal_nearby == str(dist / "iter_0000003" / "ckpttool.manifest.json")
    (dist / "iter_0000003" / "ckpttool.manifest.json").unlink()  # the save directory sealed, its iteration given
    assert run_cli("seal", dist).code == 0
    assert verify(dist / "iter_0000003").seal_nearby == str(dist / "ckpttool.manifest.json")
    r = run_cli("verify", ".", cwd=dist / "iter_0000003")  # (named as given: "..", not ".")
    assert "../ckpttool.manifest.json seals the folder ..: 'ckpttool verify ..'" in " ".join(r.stdout.split())
    model = tmp_path / "m"  # a seal of another checkpoint in a folder of this one: not this one's
    (model / "draft").mkdir(parents=True)
    for folder in (model, model / "draft"):
        shutil.copy2(FIXTURES / "safetensors" / "model.safetensors", folder)
    assert run_cli("seal", model / "draft").code == 0
    assert verify(model).seal_nearby is None
    assert run_cli("seal", model).code == 0  # the folder sealed, its one file given
    assert verify(model / "model.safetensors").seal_nearby == str(model / "ckpttool.manifest.json")


def test_a_file_its_permissions_shut_out_stops_verify_once(tmp_path):
    """The same as the user meets it, by the file's own permissions (as root, with the capability to
    read past them dropped): one exit-3 error naming the file, not a corrupt-file per item it holds."""
    import subprocess
    import sys

    from tests.conftest import cli_env

    path = _copy("dcp/fsdp2", tmp_path)
    (path / "__2_0.distcp").chmod(0)
    command = [sys.executable, "-m", "ckpttool", "verify", str(path)]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root reads every file; dropping that capability needs setpriv")
        command = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *command]
    r = subprocess.run(command, capture_output=True, text=True, env=cli_env(), timeout=120)
    assert r.returncode == 3 and r.stdout == "", (r.returncode, r.stdout, r.stderr)
    assert r.stderr.startswith("error: __2_0.distcp: cannot open (Permission denied)\n"), r.stderr


def test_a_checkpoint_folder_its_permissions_shut_names_the_folder(tmp_path):
    """A checkpoint folder that cannot be opened was said of a file inside it that the format
    would look for ("c/latest_checkpointed_iteration.txt: permission denied", a DCP checkpoint)."""
    import subprocess
    import sys

    from tests.conftest import cli_env

    path = _copy("dcp/fsdp2", tmp_path)
    path.chmod(0)
    try:
        for command in ("verify", "inspect"):
            argv = [sys.executable, "-m", "ckpttool", command, str(path)]
            if os.geteuid() == 0:
                if shutil.which("setpriv") is None:
                    pytest.skip("root opens every folder; dropping that capability needs setpriv")
                argv = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *argv]
            r = subprocess.run(argv, capture_output=True, text=True, env=cli_env(), timeout=120)
            assert r.returncode == 3, (command, r.stderr)
            assert r.stderr.startswith(f"error: {path}: permission denied (the folder cannot be opened"), r.stderr
    finally:
        path.chmod(0o755)


def test_deepspeed_latest_missing_tag():
    report = verify(FIXTURES / "hostile" / "ds_latest_missing_tag")
    assert "incomplete-save" in _rules(report)
    assert "global_step999" in report.findings[0].message


def test_deepspeed_latest_deleted_is_an_unfinished_save(tmp_path):
    path = _copy("deepspeed/zero2", tmp_path)
    (path / "latest").unlink()
    report = verify(path)
    assert _rules(report) == {"incomplete-save"}
    assert "global_step3" in report.findings[0].message and "no 'latest' file" in report.findings[0].message
    assert f"ckpttool verify {path / 'global_step3'}" in (report.findings[0].hint or "")
    assert not verify(path / "global_step3").failing()  # the tag itself is whole
    out = run_cli("verify", str(path))
    assert out.code == 1 and "incomplete-save" in out.stdout


def test_a_universal_save_without_latest_universal_names_that_file(tmp_path):
    path = _copy("deepspeed/universal", tmp_path)
    (path / "latest_universal").unlink()
    (found,) = verify(path).findings
    assert found.rule == "incomplete-save" and "no 'latest_universal' file" in found.message
    # a tracker naming an empty folder: that folder is the unfinished tag (no internal error)
    (path / "empty").mkdir()
    (path / "latest_universal").write_text("empty")
    (found,) = verify(path).findings
    assert found.rule == "incomplete-save" and "empty" in found.message and "model_states" in found.message


@pytest.mark.parametrize("tracker", ["latest", "latest_universal"])
@pytest.mark.parametrize("tag", ["../../etc", "/etc", "..", "global_step3/../.."])
def test_deepspeed_tracker_naming_a_tag_outside_the_save_is_an_unsafe_path(tracker, tag, tmp_path):
    path = _copy("deepspeed/zero2" if tracker == "latest" else "deepspeed/universal", tmp_path)
    (path / tracker).write_text(tag)
    report = verify(path)
    assert _rules(report) == {"unsafe-path"}, report.findings
    # the file to mend is the tracker (it named the tag as its file: a path that is not there)
    assert report.findings[0].file == tracker and "outside the checkpoint" in report.findings[0].message


@pytest.mark.parametrize("tracker", ["latest", "latest_universal"])
def test_deepspeed_tracker_naming_its_tag_with_a_trailing_slash_is_read(tracker, tmp_path):
    """DeepSpeed joins the tracker's text to the save directory, so 'global_step3/' resumes; it was
    called a corrupt file naming no tag directory."""
    path = _copy("deepspeed/zero2" if tracker == "latest" else "deepspeed/universal", tmp_path)
    tag = (path / tracker).read_text().strip()
    before = os.path.getmtime(path / tracker)
    (path / tracker).write_text(tag + "/\n")
    os.utime(path / tracker, (before, before))
    report = verify(path)
    assert report.format == "deepspeed" and not report.failing("error"), report.findings
    (path / tracker).write_text(tag + "/x")
    (found,) = verify(path).findings
    assert (found.rule, found.file) == ("corrupt-file", tracker) and "not a tag directory" in found.message



@pytest.mark.parametrize("tracker", ["latest", "latest_universal"])
def test_deepspeed_tracker_naming_its_tag_the_long_way_round_is_read(tracker, tmp_path):
    """'global_step3/../global_step3' leads where DeepSpeed's join leads, into the save: it was
    refused as a path outside the checkpoint. One that leads to no folder is said as such."""
    path = _copy("deepspeed/zero2" if tracker == "latest" else "deepspeed/universal", tmp_path)
    tag = (path / tracker).read_text().strip()
    (path / tracker).write_text(f"{tag}/../{tag}\n")
    report = verify(path)
    assert report.format == "deepspeed" and not report.failing("error"), report.findings
    assert report.step == 3
    (path / tracker).write_text(f"gone/../{tag}")
    (found,) = verify(path).findings
    assert (found.rule, found.file) == ("incomplete-save", tracker) and "leads to no tag directory" in found.message

def test_replicated_norm_altered_on_one_tp_rank(tmp_path):
    path = _copy("megatron/legacy_tp2pp2", tmp_path)
    _, m = registry.describe(path)
    norm = m.items["decoder.layers.0.input_layernorm.weight"]
    other = next(i for i, p in enumerate(norm.pieces) if p.replica == 1)
    file, off, n = _raw(path, norm.name, other)
    _patch(file, off, b"\x00\x40")  # one bf16 value becomes 2.0
    report = verify(path)
    found = [f for f in report.findings if f.rule == "replica-mismatch"]
    assert found and found[0].item == norm.name


@pytest.mark.parametrize(("fixture", "name"), [
    ("megatron/legacy_tp2pp2", "decoder.layers.0.input_layernorm.weight"),  # two copies: TP ranks 0 and 1
    ("megatron/legacy_tp2ep2_gg", "decoder.layers.1.pre_mlp_layernorm.weight"),  # four: TP 2 x EP 2
])  # fmt: skip
def test_the_copy_altered_is_the_one_blamed(fixture, name, tmp_path):
    """The first copy was taken as right: rank 0's copy altered, the finding named rank 1's file,
    the one left alone. Where more copies agree than not, the odd one is named; where two differ,
    both are, and neither is blamed (the finding names no file)."""
    path = _copy(fixture, tmp_path)
    _, m = registry.describe(path)
    pieces = m.items[name].pieces
    file, off, _ = _raw(path, name, 0)
    _patch(file, off, b"\x00\x40")  # rank 0's first value becomes 2.0
    found = [f for f in verify(path).findings if f.rule == "replica-mismatch"]
    if len(pieces) > 2:
        assert [(f.item, f.file) for f in found] == [(name, pieces[0].file)], found
        assert found[0].message.startswith(f"{name}: the copy in {pieces[0].file} (rank 0) differs")
    else:
        assert [(f.item, f.file, f.rank) for f in found] == [(name, None, None)], found
        said = f"its 2 copies ({pieces[0].file} (rank 0), {pieces[1].file} (rank 1)) differ, and no majority"
        assert said in found[0].message, found[0].message


def test_copies_that_differ_with_no_majority_are_each_named_once_per_region(tmp_path):
    """legacy_tp2ep2_gg's word embeddings: two TP slices, each held by two EP ranks. One copy altered
    in each slice is two findings, one per slice (they collapsed into one: findings of no file were
    told apart by item alone), each naming its two copies; a weight held four times, two and two
    alike, is one finding naming the four (not "no other copy")."""
    path = _copy("megatron/legacy_tp2ep2_gg", tmp_path)
    _, m = registry.describe(path)
    name = "embedding.word_embeddings.weight"
    pieces = m.items[name].pieces
    slices = sorted({p.box for p in pieces}, key=str)
    assert len(pieces) == 4 and len(slices) == 2
    for box in slices:
        index = next(i for i, p in enumerate(pieces) if p.box == box)
        file, off, _ = _raw(path, name, index)
        _patch(file, off, b"\x00\x40")
    norm = "decoder.layers.1.pre_mlp_layernorm.weight"
    for index in (0, 1):  # two of its four copies alike, the other two alike
        file, off, _ = _raw(path, norm, index)
        _patch(file, off, b"\x00\x40")
    found = [f for f in verify(path).findings if f.rule == "replica-mismatch"]
    assert sorted(f.item for f in found) == sorted([name, name, norm]), found
    assert all(f.file is None and "its 2 copies" in f.message for f in found if f.item == name), found
    (four,) = [f for f in found if f.item == norm]
    assert four.file is None and "its 4 copies" in four.message and all(p.file in four.message for p in m.items[norm].pieces)


@pytest.mark.parametrize(
    ("fixture", "name", "finds"),
    [
        ("tp2", "blocks.0.norm.weight", True),
        ("tp2", "blocks.0.fc2.bias.exp_avg", True),
        ("tp2", "blocks.0.fc1.weight", False),
        ("autotp", "layers.0.self_attn.o_proj.bias", True),
        ("autotp", "layers.1.input_layernorm.weight.exp_avg", True),
        ("autotp", "layers.0.self_attn.qkv_proj.weight", False),
    ],
)
def test_deepspeed_tensor_parallel_copies(fixture, name, finds, tmp_path):
    """Real TP=2 DeepSpeed runs (tp2, with a Megatron-style model's universal_checkpoint_info;
    autotp, with AutoTP's affine maps): a replicated norm or bias, or a replicated parameter's
    moment, altered on TP rank 1 is a replica-mismatch; a column-parallel weight's rank-1 slice
    (of a fused qkv: its three regions), same shape as rank 0's, is its own region and is not
    compared (before the TP rules it was, and every TP slice was a false replica-mismatch)."""
    path = _copy(f"deepspeed/{fixture}", tmp_path)
    _, m = registry.describe(path)
    item = m.items[name]
    index = next(i for i, p in enumerate(item.pieces) if "mp_rank_01" in p.file)
    assert (item.pieces[index].replica == 1) is finds
    file, off, _ = _raw(path, name, index)
    _patch(file, off, b"\x00\x00\x00\x40")  # the first float32 becomes 2.0
    found = [f for f in verify(path).findings if f.rule == "replica-mismatch"]
    assert [f.item for f in found] == ([name] if finds else [])


@pytest.mark.parametrize("nan", [False, True], ids=["value", "nan"])
@pytest.mark.parametrize("stage", [0, 1])
def test_deepspeed_tied_copies_cut_at_other_boundaries(stage, nan, tmp_path):
    """The embedding tied across the pipeline_tied fixture's two stages, resharded to DP=4: stage 0's
    optimizer holds its master whole in DP rank 0's partition, stage 1's cuts it at element 380
    (its groups are smaller). Clean, the copies verify equal; a value altered in either stage's copy
    (stage 1: inside DP rank 1's part) is found, the copies compared range by range: a
    replica-mismatch, a warning (DeepSpeed keeps only a tied module's tied_weight_attr in sync: a
    tied module's other weights may differ by design). Of two copies neither is taken as right: the
    finding names both (it blamed stage 1's whichever was altered), or the one holding a NaN."""
    from ckpttool.reshard import Target, reshard

    path = tmp_path / "dp4"
    reshard(FIXTURES / "deepspeed" / "pipeline_tied", path, Target(dp=4))
    (path / "ckpttool.manifest.json").unlink()  # the seal would name the altered file by itself
    name = "tied_modules.embed.emb.weight.fp32"
    _, m = registry.describe(path)
    pieces = m.items[name].pieces
    assert [(p.file.rsplit("/", 1)[1], p.flat, p.replica) for p in pieces] == [
        ("zero_pp_rank_0_mp_rank_00_optim_states.pt", (0, 496), 0),
        ("zero_pp_rank_0_mp_rank_01_optim_states.pt", (0, 380), 1),
        ("zero_pp_rank_1_mp_rank_01_optim_states.pt", (380, 116), 1),
    ]
    assert not [f for f in verify(path).findings if f.rule == "replica-mismatch"]
    index = 0 if stage == 0 else 2
    file, off, _ = _raw(path, name, index)
    value = b"\x00\x00\xc0\x7f" if nan else b"\x00\x00\x00\x40"  # element 400 becomes NaN or 2.0
    _patch(file, off + 4 * (400 if stage == 0 else 20), value)
    found = [f for f in verify(path).findings if f.rule == "replica-mismatch"]
    blamed = pieces[index].file if nan else None
    assert [(f.item, f.severity, f.file) for f in found] == [(name, "warning", blamed)], found
    assert pieces[0].file in found[0].message and pieces[2].file in found[0].message, found[0].message
    assert "tied across pipeline stages" in found[0].message
    assert ("holds 1 NaN or Inf values" in found[0].message) == nan, found[0].message


@pytest.mark.parametrize(
    ("fixture", "name"),
    [
        ("megatron/legacy_pp2ep2", "decoder.layers.0.mlp.router.weight"),
        ("megatron/legacy_pp2ep2", "decoder.layers.1.self_attention.linear_qkv.weight.exp_avg"),
    ],
)
def test_dense_entry_altered_in_one_expert_parallel_rank_file(fixture, name, tmp_path):
    """Every EP rank's file repeats the dense entries (router, attention, their optimizer state): a
    copy that differs in one of them is a replica-mismatch naming the entry."""
    path = _copy(fixture, tmp_path)
    _, m = registry.describe(path)
    item = m.items[name]
    other = next(i for i, p in enumerate(item.pieces) if p.replica == 1)
    assert "_001/" in item.pieces[other].file  # the EP rank 1 file's copy
    file, off, n = _raw(path, name, other)
    _patch(file, off, b"\x00\x40")
    report = verify(path)
    found = [f for f in report.findings if f.rule == "replica-mismatch"]
    assert found and found[0].item == name


def test_adam_moment_zeroed(tmp_path):
    path = _copy("dcp/fsdp2", tmp_path)
    _, m = registry.describe(path)
    name = "optim.state.blocks.0.fc1.weight.exp_avg_sq"
    for i in range(len(m.items[name].pieces)):
        file, off, n = _raw(path, name, i)
        _patch(file, off, bytes(n))
    report = verify(path)
    assert any(f.rule == "optimizer-mismatch" and f.item == name for f in report.findings)


def test_adam_moment_multiplied_by_zero_is_found_with_deep(tmp_path):
    """A first moment reset by multiplying by 0 keeps -0.0 where it was negative: its bytes are
    not all 0 (the digest check misses it), its values are, which --deep reads."""
    path = _copy("dcp/fsdp2", tmp_path)
    _, m = registry.describe(path)
    name = "optim.state.blocks.0.fc1.weight.exp_avg"
    for i in range(len(m.items[name].pieces)):
        file, off, n = _raw(path, name, i)
        _patch(file, off, b"\x00\x00\x00\x80\x00\x00\x00\x00" * (n // 8))
    zeroed = [f for f in verify(path).findings if f.rule == "optimizer-mismatch" and f.item == name]
    assert zeroed == []
    report = verify(path, deep=True)
    zeroed = [f for f in report.findings if f.rule == "optimizer-mismatch" and f.item == name]
    assert len(zeroed) == 1 and "all zeros at step" in zeroed[0].message


def test_nan_in_a_weight(tmp_path):
    """A NaN in the last rank's shard of a weight: --deep counts it and names the element's
    global index, and the file and rank holding it (in the message and in the JSON)."""
    path = _copy("dcp/mesh2x2", tmp_path)
    _, m = registry.describe(path)
    pieces = m.items["model.head.weight"].pieces
    last = max(range(len(pieces)), key=lambda i: pieces[i].rank or 0)
    piece = pieces[last]
    assert piece.rank and piece.file != pieces[0].file and piece.flat is None
    file, off, n = _raw(path, "model.head.weight", last)
    _patch(file, off + 8, struct.pack("<f", float("nan")))  # the piece's element 2
    assert "nonfinite" not in _rules(verify(path))  # values are only read with --deep
    report = verify(path, deep=True)
    nan = [f for f in report.findings if f.rule == "nonfinite"]
    assert nan and nan[0].item == "model.head.weight" and "1 NaN" in nan[0].message
    local = np.unravel_index(2, piece.box.sizes)
    index = [int(o + i) for o, i in zip(piece.box.offsets, local)]
    assert (nan[0].file, nan[0].rank) == (piece.file, piece.rank), nan[0]
    assert f"first at index {index} (in {piece.file}, rank {piece.rank})" in nan[0].message
    assert report.stats["model.head.weight"]["nan"] == 1
    assert report.stats["model.head.weight"]["first_nonfinite"] == index
    assert report.stats["model.tok.weight"]["first_nonfinite"] is None


def test_unsafe_pickle_is_a_finding():
    report = verify(FIXTURES / "hostile" / "dcp_bytes_item_os_system")
    assert "unsafe-pickle" in _rules(report)
    report = verify(FIXTURES / "hostile" / "dcp_metadata_os_system")
    assert "unsafe-pickle" in _rules(report)


def test_require_turns_missing_state_into_an_error():
    report = verify(FIXTURES / "deepspeed" / "zero2", require=["rng"])
    assert any(f.rule == "missing-state" and f.severity == "error" for f in report.findings)
    assert not verify(FIXTURES / "deepspeed" / "zero2").failing()


def test_require_repeated_or_listed_requires_each():
    """``--require scheduler --require rng`` once kept only the last: a CI gate written so passed
    without the state it named first."""
    path = FIXTURES / "deepspeed" / "zero2"
    for args in (["--require", "rng", "--require", "step"], ["--require", "step,rng"]):
        r = run_cli("verify", path, "--json", *args)
        missing = [f for f in json.loads(r.stdout)["findings"] if f["rule"] == "missing-state"]
        assert r.code == 1 and any(f["severity"] == "error" and "rng" in f["message"].lower() for f in missing), args


def test_extra_file_against_the_seal(tmp_path):
    path = _copy("dcp/fsdp2", tmp_path)
    seal(path)
    (path / "notes.txt").write_text("added later")
    report = verify(path)
    assert [f.file for f in report.findings if f.rule == "extra-file"] == ["notes.txt"]
    assert not report.failing()  # a warning
    assert report.failing("warning")


@pytest.mark.parametrize(
    ("fixture", "inside", "later_saves"),
    [
        ("dcp/fsdp2", "", []),
        ("deepspeed/zero2", "global_step3", ["global_step4"]),
        ("megatron/legacy_tp2pp2", "iter_0000003/mp_rank_01_001", ["iter_0000004"]),
    ],
)
def test_a_folder_added_after_the_seal_is_an_extra_file(fixture, inside, later_saves, tmp_path):
    """A folder made after `seal` among the checkpoint's data files (a file in it, or none) went
    unreported: only files were compared with the seal. A folder that was there when sealed (a
    logs folder) is not extra, nor is a later save's tag or iteration in the save directory."""
    path = _copy(fixture, tmp_path)
    where = path / inside if inside else path
    (where / "logs").mkdir()
    seal(path)
    (where / "logs" / "events").write_text("written after the seal")
    (where / "stray" / "deeper").mkdir(parents=True)
    (where / "stray" / "deeper" / "x.pt").write_bytes(b"12345")
    for name in later_saves:
        (path / name).mkdir()
        (path / name / "file").write_text("a later save")
    report = verify(path)
    stray = f"{inside}/stray" if inside else "stray"
    extra = [f for f in report.findings if f.rule == "extra-file"]
    assert [f.file for f in extra] == [stray], report.findings
    assert "(1 file, 5 bytes)" in extra[0].message and extra[0].severity == "warning"
    # a seal written before ckpttool kept the folders says nothing of them
    sealed = path / "ckpttool.manifest.json"
    data = json.loads(sealed.read_text())
    assert data.pop("folders")
    sealed.write_text(json.dumps(data))
    assert not [f for f in verify(path).findings if f.rule == "extra-file"]

@pytest.mark.parametrize(("fixture", "inside"), [("dcp/fsdp2", ""), ("deepspeed/zero2", "global_step3")])
def test_a_fifo_added_after_the_seal_is_an_extra_file(fixture, inside, tmp_path):
    """A named pipe (or a socket) made after `seal` among the data files went unreported: the
    seal's folders were looked at for files and folders only. It is not opened."""
    path = _copy(fixture, tmp_path)
    seal(path)
    where = path / inside if inside else path
    os.mkfifo(where / "pipe")
    extra = [f for f in verify(path).findings if f.rule == "extra-file"]
    named = f"{inside}/pipe" if inside else "pipe"
    assert [(f.file, f.severity) for f in extra] == [(named, "warning")], extra
    assert "a FIFO (named pipe)" in extra[0].message



def test_a_sealed_checkpoint_no_longer_recognised_is_still_checked(tmp_path):
    """A file added beside a directory's one torch.save file makes the directory no checkpoint
    ckpttool recognises: with a seal, only the bytes were compared and every other check (--deep,
    --require, the optimizer's) was skipped with exit 0. The seal's data file is described alone;
    a seal whose checkpoint is gone is an error, not a pass."""
    path = tmp_path / "ck"
    path.mkdir()
    shutil.copy(FIXTURES / "torch" / "train_state.pt", path / "model.pt")
    seal(path)
    (path / "training_args.bin").write_text("added after the seal")
    report = verify(path, require=["dataloader"])
    assert report.format == "torch" and report.step == 3
    assert {(f.rule, f.severity) for f in report.findings} == {("missing-state", "error"), ("extra-file", "warning")}
    (path / "model.pt").rename(path / "model.old")
    (path / "training_args.bin").unlink()
    report = verify(path)
    errors = [f for f in report.findings if f.severity == "error"]
    assert sorted(f.rule for f in errors) == ["corrupt-file", "missing-file"], report.findings
    assert "no longer reads as the torch checkpoint its seal describes" in errors[0].message


def test_a_sealed_single_file_owns_nothing_beside_it(tmp_path):
    """A file checkpoint's folder holds other things (a config, other checkpoints): none of them
    is an extra file of its seal; the file itself still is checked."""
    path = _copy("torch/train_state.pt", tmp_path)
    (tmp_path / "config.json").write_text("{}")
    seal(path)
    (tmp_path / "notes.txt").write_text("added later")
    report = verify(path)
    assert not [f for f in report.findings if f.rule in ("extra-file", "missing-file")], report.findings
    assert report.checked["files"] == 1
    data = bytearray(path.read_bytes())
    data[-100] ^= 1
    path.write_bytes(bytes(data))
    assert "checksum-mismatch" in {f.rule for f in verify(path).findings}


def test_a_seal_of_another_checkpoint_is_refused_not_passed(tmp_path):
    """A file's seal given for the file beside it used to check the sealed file, not the given one,
    and pass whatever the given one held; a seal naming none of the files (an edited one) checked
    nothing. Both are said (exit 3): nothing was verified."""
    (tmp_path / "a").mkdir()
    shutil.copy2(FIXTURES / "torch" / "train_state.pt", tmp_path / "a" / "train_state.pt")
    shutil.copy2(FIXTURES / "safetensors" / "model.safetensors", tmp_path / "a" / "model.safetensors")
    other = tmp_path / "a" / "model.safetensors"
    seal(tmp_path / "a" / "train_state.pt")
    r = run_cli("verify", other, "--manifest", tmp_path / "a" / "train_state.pt.ckpttool.manifest.json")
    assert r.code == 3 and "Traceback" not in r.stderr
    assert "none of this checkpoint's 1 file (model.safetensors) is in the seal, which names train_state.pt" in r.stderr
    path = _copy("dcp/fsdp2", tmp_path)
    seal(path, out=tmp_path / "seal.json")
    doc = json.loads((tmp_path / "seal.json").read_text())
    doc["manifest"]["files"] = []
    (tmp_path / "empty.json").write_text(json.dumps(doc))
    r = run_cli("verify", path, "--manifest", tmp_path / "empty.json")
    assert r.code == 3 and "is in the seal, which names no file" in r.stderr


def test_a_directory_where_the_seal_belongs_is_said_not_taken_for_no_seal(tmp_path):
    """A directory named ckpttool.manifest.json in the checkpoint: verify said "no seal" (a CI gate
    that meant to check against the seal checked without one) and seal failed after all its work
    with "is a directory". Both now refuse it up front, nothing written."""
    path = _copy("dcp/fsdp2", tmp_path)
    (path / "ckpttool.manifest.json").mkdir()
    before = tree_digests(tmp_path)
    r = run_cli("verify", path, "--json")
    assert r.code == 3 and "ckpttool.manifest.json: expected a seal (a JSON file), found a directory" in r.stderr
    assert json.loads(r.stdout)["ok"] is False
    r = run_cli("seal", path)
    assert r.code == 2 and "ckpttool.manifest.json: a directory stands where the seal is written" in r.stderr
    assert tree_digests(tmp_path) == before


def test_a_file_the_seal_does_not_name_is_checked_as_without_one(tmp_path):
    """A seal never turns damage verify finds without it into a clean result: a checkpoint file it
    does not name (an edited seal) is an extra file, and its CRC-32s are still checked."""
    path = _copy("dcp/fsdp2", tmp_path)
    seal(path, out=tmp_path / "seal.json")
    doc = json.loads((tmp_path / "seal.json").read_text())
    doc["manifest"]["files"] = [f for f in doc["manifest"]["files"] if f["path"] != "__1_0.distcp"]
    (tmp_path / "part.json").write_text(json.dumps(doc))
    clean = verify(path, manifest_path=tmp_path / "part.json")
    assert [(f.rule, f.file) for f in clean.findings] == [("extra-file", "__1_0.distcp")]
    assert clean.checked["files"] == 5 and clean.checked["pieces"] == verify(path).checked["pieces"]
    f = path / "__1_0.distcp"
    data, times = bytearray(f.read_bytes()), os.stat(f)
    data[33_000] ^= 1  # in model.blocks.0.fc1.weight
    f.write_bytes(bytes(data))
    os.utime(f, ns=(times.st_atime_ns, times.st_mtime_ns))
    report = verify(path, manifest_path=tmp_path / "part.json")
    assert [(f.rule, f.file) for f in report.failing()] == [("checksum-mismatch", "__1_0.distcp")]
    assert "model.blocks.0.fc1.weight" in report.failing()[0].message


@pytest.mark.parametrize(
    ("fixture", "rel", "named"),
    [
        ("deepspeed/pipeline_tied", "global_step3/layer_04-model_00-model_states.pt", "layer_04-model_00"),
        ("deepspeed/universal3", "global_step3_universal/zero/emb.weight/fp32.pt", "zero/emb.weight/fp32.pt"),
        ("deepspeed/universal3", "global_step3_universal/zero/emb.weight/exp_avg_sq.pt", "emb.weight/exp_avg_sq"),
        ("deepspeed/universal", "global_step3_universal/zero/blocks.1.fc1.weight", "blocks.1.fc1.weight/exp_avg.pt"),
        (
            "megatron/legacy_pp2ep2_distopt",
            "iter_0000003/mp_rank_00_000_001/distrib_optim.pt",
            "mp_rank_00_000_001/distrib_optim.pt",
        ),
        ("rankshards/pipeline", "checkpoint_step3_stage0.pt", "rank 0's shard is missing"),
    ],
    ids=lambda v: v.replace("/", "-"),
)
def test_a_deleted_file_only_the_format_knows_of_fails_unsealed_verify(fixture, rel, named, tmp_path):
    """No metadata lists these files by name (a pipeline layer, a universal state file, the
    distributed optimizer's state, a stage): verify without a seal still says which is missing."""
    path = _copy(fixture, tmp_path)
    gone = path / rel
    shutil.rmtree(gone) if gone.is_dir() else gone.unlink()
    report = verify(path)
    assert "missing-file" in _rules(report), report.findings
    assert any(named in f.message for f in report.findings if f.rule == "missing-file"), report.findings
    assert report.failing()


# -- the command line, every output mode --------------------------------------------------------


@pytest.fixture
def broken(tmp_path):
    path = _copy("dcp/fsdp2", tmp_path)
    for rank in (1, 2, 3):
        (path / f"__{rank}_0.distcp").unlink()
    return path


def test_cli_human_json_junit_github(broken, tmp_path):
    clean = run_cli("verify", FIXTURES / "dcp" / "fsdp2")
    assert clean.code == 0 and "OK: 0 errors" in clean.stdout

    human = run_cli("verify", broken)
    assert human.code == 1 and "Traceback" not in human.stderr
    assert "FAILED" in human.stdout and "incomplete-save" not in human.stdout

    r = run_cli("verify", broken, "--json", "--report", tmp_path / "r.json", "--junit", tmp_path / "j.xml")
    data = json.loads(r.stdout)
    assert r.code == 1 and data["ok"] is False and data["schema_version"] == 1
    assert {"inputs", "format", "step", "layout", "summary", "findings"} <= set(data)
    f = data["findings"][0]
    assert set(f) >= {"rule", "severity", "message", "file", "item", "rank", "hint"}
    assert json.loads((tmp_path / "r.json").read_text())["findings"] == data["findings"]
    junit = (tmp_path / "j.xml").read_text()
    assert junit.startswith("<?xml") and 'failures="1"' in junit and "missing-file" in junit

    summary = tmp_path / "summary.md"
    gh = run_cli("verify", broken, env={"GITHUB_ACTIONS": "true", "GITHUB_STEP_SUMMARY": str(summary)})
    assert gh.code == 1
    assert "::error title=ckpttool missing-file::" in gh.stderr
    assert "ckpttool verify: FAILED" in summary.read_text()
    assert "None" not in summary.read_text()  # a checkpoint that did not read has no step
    # its format known by its files' names, as the JSON says (it was null, "format not read")
    assert "format `dcp` · step unknown" in summary.read_text() and data["format"] == "dcp"


def test_cli_groups_many_findings(tmp_path):
    path = _copy("dcp/fsdp2_per_item", tmp_path)
    seal(path)
    removed = sorted(path.glob("__1_*.distcp"))[:12]
    for p in removed:
        p.unlink()
    r = run_cli("verify", path)
    assert r.code == 1
    line = next(ln for ln in r.stdout.splitlines() if "missing-file" in ln)
    assert line.count("findings") == 1 and "ranks 1" in line  # one grouped line, not twelve


def test_cli_exit_3_when_nothing_can_be_evaluated(tmp_path):
    r = run_cli("verify", tmp_path / "nope")
    assert r.code == 3
    (tmp_path / "x").mkdir()
    assert run_cli("verify", tmp_path / "x").code == 3


@pytest.mark.parametrize("case", ["no such path", "unknown format", "not a checkpoint file"])
def test_cli_exit_3_still_writes_every_report(case, tmp_path):
    """A CI gate that reads the JUnit or JSON report must not find it absent, or worse, a stale
    one from the last run, when verify could not evaluate the checkpoint at all."""
    import xml.etree.ElementTree as ET

    if case == "no such path":
        path = tmp_path / "nope"
    elif case == "unknown format":
        path = tmp_path / "x"
        path.mkdir()
        (path / "notes.txt").write_text("hello")
    else:
        path = tmp_path / "model.pt"
        path.write_bytes(b"\x80\x04garbage")
    report, junit_file, summary = tmp_path / "r.json", tmp_path / "j.xml", tmp_path / "summary.md"
    report.write_text(STALE_REPORT)
    r = run_cli(
        "verify", path, "--json", "--report", report, "--junit", junit_file,
        env={"GITHUB_ACTIONS": "true", "GITHUB_STEP_SUMMARY": str(summary)},
    )  # fmt: skip
    assert r.code == 3 and "Traceback" not in r.stderr
    data = json.loads(r.stdout)
    assert data["ok"] is False and data["findings"] == [] and data["format"] is None
    assert data["error"]["message"] and data["error"]["message"] in r.stderr  # the line the user sees
    assert json.loads(report.read_text()) == data
    root = ET.fromstring(junit_file.read_text().split("?>", 1)[1])
    assert root.get("errors") == "1" and root.get("tests") == "1" and root.get("failures") == "0"
    (case_el,) = root
    assert case_el.find("error") is not None and data["error"]["message"] in case_el.find("error").get("message")
    assert "::error title=ckpttool could not evaluate::" in r.stderr
    assert "ckpttool verify: could not evaluate" in summary.read_text()
    # a checkpoint that could be evaluated says so: error is null
    ok = json.loads(run_cli("verify", FIXTURES / "dcp" / "fsdp2", "--json").stdout)
    assert ok["error"] is None and ok["ok"] is True


STALE_REPORT = '{\n  "schema_version": 1,\n  "inputs": {"path": "old"},\n  "ok": true\n}\n'
"""an earlier run's report (verify replaces an earlier report, never other data)"""
STALE_JUNIT = "<?xml version='1.0' encoding='utf-8'?>\n<testsuite name=\"ckpttool verify\" tests=\"16\" failures=\"0\" />\n"


def test_a_usage_error_replaces_a_stale_report(tmp_path):
    report, junit_file = tmp_path / "r.json", tmp_path / "j.xml"
    report.write_text(STALE_REPORT)
    junit_file.write_text(STALE_JUNIT)
    r = run_cli("verify", FIXTURES / "dcp" / "fsdp2", "--fail-on", "bogus", "--report", report, "--junit", junit_file)
    assert r.code == 2 and "--fail-on 'bogus'" in r.stderr
    data = json.loads(report.read_text())
    assert data["ok"] is False and "--fail-on 'bogus'" in data["error"]["message"] and data["fail_on"] == "error"
    assert "--fail-on" in junit_file.read_text()


@pytest.mark.parametrize("clean", [True, False])
def test_an_unwritable_step_summary_leaves_the_verdict(clean, tmp_path):
    path = FIXTURES / "dcp" / "fsdp2"
    if not clean:
        path = _copy("dcp/fsdp2", tmp_path)
        (path / "__1_0.distcp").unlink()
    summary = tmp_path / "no-such-dir" / "summary.md"
    r = run_cli("verify", path, env={"GITHUB_ACTIONS": "true", "GITHUB_STEP_SUMMARY": str(summary)})
    assert r.code == (0 if clean else 1) and "Traceback" not in r.stderr
    assert "warning: the step summary was not written" in r.stderr and str(summary) in r.stderr
    assert ("OK:" in r.stdout) == clean and not summary.exists()


def test_json_report_matches_its_schema(broken):
    from pydantic import TypeAdapter

    from ckpttool.verify import ReportJSON, TensorStatsJSON

    for path in (broken, FIXTURES / "deepspeed" / "zero3"):
        payload = json.loads(run_cli("verify", path, "--json", "--deep").stdout)
        TypeAdapter(ReportJSON).validate_python(payload, strict=False)
        assert set(payload) == set(ReportJSON.__annotations__)
        assert payload["stats"] or path == broken  # (values are read only where files are all there)
        assert all(set(s) == set(TensorStatsJSON.__annotations__) for s in payload["stats"].values())


def test_a_seal_counts_the_data_files_not_other_seals(tmp_path):
    """A second seal of a checkpoint that already holds one said "sealed 6 files" of a 4-file
    checkpoint: the first seal's file, listed but never hashed, was counted."""
    path = _copy("dcp/fsdp2", tmp_path)
    data = sorted(p for p in path.iterdir())
    first = run_cli("seal", path, "--out", path / "old.ckpttool.manifest.json", "--json")
    again = run_cli("seal", path, "--json")
    for r in (first, again):
        assert r.code == 0, r.stderr
        got = json.loads(r.stdout)
        assert (got["files"], got["bytes"]) == (len(data), sum(p.stat().st_size for p in data)), got
    assert f"sealed {len(data)} files" in run_cli("seal", path, "--out", tmp_path / "s.json").stdout


def test_seal_sha256_and_cli(tmp_path):
    import hashlib

    path = _copy("safetensors/sharded", tmp_path)
    r = run_cli("seal", path, "--hash", "sha256", "--json")
    assert r.code == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["hash"] == "sha256" and data["pieces"] == 14
    sealed = json.loads((path / "ckpttool.manifest.json").read_text())
    files = {f["path"]: f["checksum"] for f in sealed["manifest"]["files"]}
    shard = "model-00001-of-00002.safetensors"
    assert files[shard] == hashlib.sha256((path / shard).read_bytes()).hexdigest()  # matches sha256sum
    assert run_cli("verify", path).code == 0


def _count_reads(monkeypatch) -> list[int]:
    """Bytes read through ckpttool.io's two read calls (every file read ckpttool makes), counted in [0]."""
    from ckpttool import io as ckio

    counted = [0]
    real, real_into = ckio.pread, ckio.preadinto

    def spy(fd, n, off):
        data = real(fd, n, off)
        counted[0] += len(data)
        return data

    def spy_into(fd, buf, off):
        n = real_into(fd, buf, off)
        counted[0] += n
        return n

    monkeypatch.setattr(ckio, "pread", spy)
    monkeypatch.setattr(ckio, "preadinto", spy_into)
    return counted


@pytest.mark.parametrize("sealed", [False, True])
def test_verify_reads_each_byte_once(sealed, tmp_path, monkeypatch):
    path = _copy("dcp/fsdp2", tmp_path)
    if sealed:
        seal(path)
    total = sum(p.stat().st_size for p in path.iterdir() if p.name != "ckpttool.manifest.json")
    counted = _count_reads(monkeypatch)
    report = verify(path)
    assert not report.failing()
    # every byte once, plus the zip headers and data.pkl read to locate each piece (a few KiB per
    # piece: a large share of this tiny fixture, 0 % of the 1.2 GB benchmark checkpoint)
    _, m = registry.describe(path)
    pieces = sum(len(i.pieces) for i in m.items.values())
    assert total <= counted[0] <= total + 4096 * pieces


def test_sealed_verify_rereads_only_the_file_that_changed(tmp_path, monkeypatch):
    path = _copy("dcp/fsdp2", tmp_path)
    seal(path)
    counted = _count_reads(monkeypatch)
    assert not verify(path).failing()
    clean = counted[0]
    file, off, n = _raw(path, "model.blocks.0.fc1.weight")
    _patch(file, off + n // 2, bytes([file.read_bytes()[off + n // 2] ^ 1]))
    counted[0] = 0
    report = verify(path)
    named = [f for f in report.findings if f.rule == "checksum-mismatch"]
    assert len(named) == 1 and named[0].file == file.name and "model.blocks.0.fc1.weight" in named[0].message
    # the whole checkpoint once for the file digests, then the one file that differs again, and the
    # headers of the one piece whose bytes differ (is it where the seal found it? a file saved again
    # may hold its pieces elsewhere)
    assert file.stat().st_size < counted[0] - clean <= file.stat().st_size + 4096


def test_a_hashing_pass_stops_when_cancelled(tmp_path):
    import threading

    from ckpttool.hashing import CHUNK, Cancelled, hash_files

    (tmp_path / "big.bin").write_bytes(bytes(64 * CHUNK))
    stop = threading.Event()
    reads: list[int] = []

    def progress(n: int) -> None:  # cancelled while the pass runs, after its first chunk
        reads.append(n)
        stop.set()

    with pytest.raises(Cancelled):
        hash_files(tmp_path, ["big.bin"], {}, progress=progress, cancel=stop)
    assert reads == [CHUNK]


@pytest.mark.parametrize("rel", CLEAN)
def test_seal_columns_round_trip_the_manifest(rel, tmp_path):
    from ckpttool.seal import Seal

    path = _copy(rel, tmp_path)
    made, at = seal(path, out=tmp_path / "seal.json")
    loaded = Seal.load(at)
    assert json.loads(at.read_text())["schema_version"] == 2
    assert loaded.head.files == made.manifest.files and loaded.head.items == {}
    assert loaded.pieces == made.pieces
    assert loaded.manifest == made.manifest  # every item and piece, built from the columns

    # the same manifest describe gives, apart from the checksums that only the seal has
    def without_checksums(m):
        d = m.to_json_dict()
        for f in d["files"]:
            f["checksum"] = None
        for item in d["items"].values():
            for piece in item["pieces"]:
                piece["checksum"] = None
        return d

    described = registry.describe(path)[1]
    assert without_checksums(loaded.manifest) == without_checksums(described)
    assert all(f.checksum for f in loaded.manifest.files if f.role != "seal")
    # a version 1 seal (the manifest as objects and a list of piece records) still loads
    v1 = {
        "schema_version": 1,
        "kind": "ckpttool.seal",
        "tool": made.tool,
        "created": made.created,
        "hash": made.algo,
        "pieces": [[p.item, p.index, p.file, p.offset, p.length, p.checksum] for p in made.pieces],
        "manifest": made.manifest.to_json_dict(),
    }
    (tmp_path / "v1.json").write_text(json.dumps(v1))
    old = Seal.load(tmp_path / "v1.json")
    assert old.pieces == made.pieces and old.manifest == made.manifest and old.head.files == made.manifest.files
    assert not verify(path, manifest_path=tmp_path / "v1.json").failing()


def test_a_damaged_seal_column_is_a_clear_error(tmp_path):
    from ckpttool.errors import CorruptFileError
    from ckpttool.seal import Seal

    path = _copy("dcp/fsdp2", tmp_path)
    _, at = seal(path)
    good = json.loads(at.read_text())
    damages = {
        "a column one entry short": lambda d: d["pieces"]["checksum"].pop(),
        "a file index out of range": lambda d: d["pieces"]["file"].__setitem__(0, 10**6),
        "a negative key set index": lambda d: d["pieces"]["locator_set"].__setitem__(0, -1),
        "a negative offset": lambda d: d["pieces"]["offset"].__setitem__(0, -1),
        "a count of the wrong type": lambda d: d["items"]["pieces"].__setitem__(0, "3"),
        "a count that is a bool": lambda d: d["items"]["pieces"].__setitem__(0, True),
        "a null file index": lambda d: d["pieces"]["file"].__setitem__(0, None),
        "a fractional length": lambda d: d["pieces"]["length"].__setitem__(0, 1.5),
        "a checksum that is a number": lambda d: d["pieces"]["checksum"].__setitem__(0, 7),
        "an item name that is a number": lambda d: d["items"]["name"].__setitem__(0, 7),
        "an unknown version": lambda d: d.__setitem__("schema_version", 3),
    }
    for what, damage in damages.items():
        doc = json.loads(json.dumps(good))
        damage(doc)
        at.write_text(json.dumps(doc))
        with pytest.raises(CorruptFileError, match="not a readable ckpttool seal"):
            Seal.load(at)
        assert run_cli("verify", path).code == 3, what
    # what is wrong said in words: a later schema (before the fields it may spell otherwise), a list,
    # another kind (it was "KeyError: 'hash'", "kind is 'list'")
    for doc, said in (
        ({"schema_version": 99, "kind": "ckpttool.seal"}, "schema_version 99: this ckpttool reads seals of schema 1"),
        ([], "a JSON list, where a seal is an object with kind 'ckpttool.seal'"),
        ({"kind": "other"}, "its kind is 'other', where a seal's is 'ckpttool.seal'"),
    ):
        at.write_text(json.dumps(doc))
        with pytest.raises(CorruptFileError, match=re.escape(said)):
            Seal.load(at)
    # locator values left over: found when the whole manifest is built
    doc = json.loads(json.dumps(good))
    doc["pieces"]["locator_values"].append(7)
    at.write_text(json.dumps(doc))
    with pytest.raises(CorruptFileError, match="more values than the pieces use"):
        Seal.load(at).manifest  # noqa: B018
    # a manifest field of the wrong type: named field by field on one line, without pydantic's
    # multi-line text and its documentation links
    doc = json.loads(json.dumps(good))
    doc["manifest"]["format"] = 5
    doc["manifest"]["files"][0]["size"] = "abc"
    at.write_text(json.dumps(doc))
    r = run_cli("verify", path)
    assert_clean(
        r,
        3,
        "manifest.format: Input should be a valid string (found 5)",
        "manifest.files.0.size: Input should be a valid integer",
        "(found 'abc')",
    )
    assert "pydantic.dev" not in r.stderr and "\\n" not in r.stderr, r.stderr


def test_an_internal_error_still_writes_the_reports(tmp_path, monkeypatch):
    """Exit 3 from any cause (here a bug: an exception verify did not expect) still writes the
    reports asked for, saying why, rather than leave the last run's in place."""
    from typer.testing import CliRunner

    import ckpttool.verify as verify_module
    from ckpttool.cli import app

    def broken(*_, **__):
        raise RuntimeError("boom")

    monkeypatch.setattr(verify_module, "verify", broken)
    report = tmp_path / "r.json"
    report.write_text(STALE_REPORT)
    result = CliRunner().invoke(app, ["verify", str(FIXTURES / "dcp" / "fsdp2"), "--report", str(report)])
    assert result.exit_code == 3
    data = json.loads(report.read_text())
    assert data["ok"] is False and "RuntimeError: boom" in data["error"]["message"]


@pytest.mark.parametrize("signal_class", ["KeyboardInterrupt", "Terminated"])
def test_an_interrupted_verify_replaces_the_last_runs_reports(signal_class, tmp_path, monkeypatch):
    """A verify stopped by SIGTERM (a CI job cancelled or out of time) or Ctrl-C left the last
    run's passing --report and --junit in place, which a workflow uploads `if: always()`. They now
    say the checkpoint was not judged; the command still stops as interrupted (130, 143)."""
    from typer.testing import CliRunner

    import ckpttool.verify as verify_module
    from ckpttool import interrupt
    from ckpttool.cli import app

    report, junit = tmp_path / "r.json", tmp_path / "j.xml"
    ok = CliRunner().invoke(app, ["verify", str(FIXTURES / "dcp" / "fsdp2"), "--report", str(report), "--junit", str(junit)])
    assert ok.exit_code == 0 and json.loads(report.read_text())["ok"] is True
    stop = interrupt.Terminated if signal_class == "Terminated" else KeyboardInterrupt

    def stopped(*_, **__):
        raise stop

    monkeypatch.setattr(verify_module, "verify", stopped)
    result = CliRunner().invoke(app, ["verify", str(FIXTURES / "dcp" / "fsdp2"), "--report", str(report), "--junit", str(junit)])
    assert result.exit_code == (143 if signal_class == "Terminated" else 130), result.output
    data = json.loads(report.read_text())
    word = "terminated" if signal_class == "Terminated" else "interrupted"
    assert data["ok"] is False and f"verify was {word}" in data["error"]["message"], data["error"]
    assert "not judged" in junit.read_text() and 'failures="0" errors="0"' not in junit.read_text()


def test_a_ctrl_c_during_verifys_checks_still_replaces_the_reports(tmp_path, monkeypatch):
    """A Ctrl-C or SIGTERM that came during verify's imports and checks of its report paths (a
    second or so, before the work began) stopped it with the last run's passing reports in place.
    It is now held until the checks are done, and the reports say the checkpoint was not judged."""
    import os
    import signal

    from typer.testing import CliRunner

    from ckpttool import cli

    report, junit = tmp_path / "r.json", tmp_path / "j.xml"
    argv = ["verify", str(FIXTURES / "dcp" / "fsdp2"), "--report", str(report), "--junit", str(junit)]
    assert CliRunner().invoke(cli.app, argv).exit_code == 0 and json.loads(report.read_text())["ok"] is True
    checks = cli._verify_checks

    def interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # (delivered here, in the main thread, while the checks run)
        return checks(*args, **kwargs)

    monkeypatch.setattr(cli, "_verify_checks", interrupted)
    result = CliRunner().invoke(cli.app, argv)
    assert result.exit_code == 130, result.output
    assert json.loads(report.read_text())["ok"] is False and "not judged" in junit.read_text()


@pytest.mark.parametrize("rel", ["deepspeed/universal", "deepspeed/universal3"])
def test_a_universal_checkpoints_frozen_parameters_want_no_moments(rel):
    """ds_to_universal writes a frozen parameter an fp32.pt and no moments, as its source held none:
    not an optimizer-mismatch (frozen.weight was reported as a parameter without moments)."""
    report = verify(FIXTURES / rel, deep=True)
    assert "optimizer-mismatch" not in _rules(report), report.findings
    _, m = registry.describe(FIXTURES / rel)
    assert rel.endswith("3") or {"frozen.weight", "frozen.bias"} <= set(m.extras["frozen"])


@pytest.mark.parametrize("rel", ["deepspeed/universal", "deepspeed/universal3"])
def test_a_stray_file_in_one_universal_parameter_folder_is_an_extra_file_not_a_state_all_others_lack(rel, tmp_path):
    """A file in one parameter's folder under zero/ (a copy, an editor's or a desktop's file) made
    its name a state every other trained parameter lacked: 13 missing-file errors, nothing else
    checked, seal refused. It is one extra-file warning now, naming those of them DeepSpeed's
    universal load would take for a state (it loads every name matching '(.+).pt')."""
    path = _copy(rel, tmp_path)
    folder = next((path / "global_step3_universal" / "zero").glob("*/exp_avg.pt")).parent
    shutil.copy2(folder / "exp_avg.pt", folder / "backup.pt")
    (folder / ".DS_Store").write_bytes(b"x")
    before = tree_digests(path)
    report = verify(path)
    assert not report.failing(), report.findings
    (stray,) = [f for f in report.findings if f.rule == "extra-file"]
    assert stray.severity == "warning" and "2 files in parameter folders" in stray.message, stray.message
    assert f"zero/{folder.name}/backup.pt" in stray.message and "would load 1 of them" in stray.message
    _, m = registry.describe(path)
    assert not any(name.endswith(".backup") for name in m.items)  # never read as a state
    assert_clean(run_cli("seal", path), 0)
    assert_clean(run_cli("verify", path), 0)  # (against the seal: the files are in it)
    (path / "ckpttool.manifest.json").unlink()
    assert tree_digests(path) == before  # verify and seal left every file as it was
    # a state file deleted beside the stray one is still missing
    (folder / "exp_avg_sq.pt").unlink()
    report = verify(path)
    (gone,) = [f for f in report.findings if f.rule == "missing-file"]  # (named from the path given: no manifest)
    assert gone.file == f"global_step3_universal/zero/{folder.name}/exp_avg_sq.pt", gone


def test_a_universal_checkpoint_of_a_zero1_run_knows_its_frozen_parameters(tmp_path):
    """DeepSpeed names the frozen parameters in the model states at ZeRO-2 and 3 only: the universal
    checkpoint of a ZeRO-1 run (ckpttool's) warned that frozen.weight has no moments. They are the
    module's entries that are neither trained nor buffers, as the ZeRO-1 reader finds them."""
    from ckpttool.reshard import Target, reshard

    out = tmp_path / "universal"
    reshard(FIXTURES / "deepspeed" / "zero1", out, Target(to="deepspeed-universal"))
    report = verify(out, deep=True)
    assert "optimizer-mismatch" not in _rules(report), report.findings
    _, m = registry.describe(out)
    _, src = registry.describe(FIXTURES / "deepspeed" / "zero1")
    assert sorted(m.extras["frozen"]) == sorted(src.extras["frozen"]) and "frozen.weight" in m.extras["frozen"]


def test_a_zero_partition_is_named_by_its_dp_rank_in_every_finding(tmp_path):
    """A pipeline run's ZeRO partition zero_pp_rank_1_mp_rank_00 was rank 1 when deleted or cut
    short (by its name) and rank 4 when its bytes changed (DP rank x model-parallel size + MP rank):
    the schema's rank of a ZeRO partition is its DP rank."""
    path = _copy("deepspeed/pipeline", tmp_path)
    name = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    _, m = registry.describe(path)
    (rec,) = [f for f in m.files if f.path.endswith(name)]
    assert rec.ranks == [1]
    item = next(i for i in m.items.values() if i.is_tensor and any(p.file == rec.path for p in i.pieces))
    index = next(k for k, p in enumerate(item.pieces) if p.file == rec.path)
    file, offset, _ = _raw(path, item.name, index)
    _patch(file, offset, bytes([file.read_bytes()[offset] ^ 0x40]))
    found = [f for f in verify(path).failing() if f.file and f.file.endswith(name)]
    assert found and {f.rank for f in found} == {1}, found


def _frozen_embedding_run(path: Path, how: str, drop: str | None = None) -> None:
    """A real save of a model whose embedding is frozen (no moments: the optimizer never held it),
    its optimizer state keyed by parameter names (``get_state_dict``), over 16 parameters (the
    groups' ``params`` are too long to keep as a value). ``drop``: a trained parameter's moments
    dropped from the state."""
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), *(nn.Linear(8, 8) for _ in range(9)))
    model[0].weight.requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for _ in range(2):
        model(torch.arange(4)).sum().backward()
        opt.step()
        opt.zero_grad()
    flat = how == "dcp-flattened"
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=flat))
    if drop is not None:
        osd = {k: v for k, v in osd.items() if not k.startswith(f"state.{drop}.")} if flat else osd
        if not flat:
            osd["state"].pop(drop)
    if how == "shards":
        path.mkdir()
        for r in range(2):
            torch.save({"model": msd, "optimizer": osd, "step": 2}, path / f"shard_{r}.pt")
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (no process group: dcp.save says it saves as one rank)
            dcp.save({"model": msd, "optim": osd, "step": 2}, checkpoint_id=str(path), no_dist=True)


@pytest.mark.parametrize("how", ["shards", "dcp", "dcp-flattened"])
def test_a_parameter_no_param_group_names_is_frozen_not_missing_its_moments(how, tmp_path):
    """Optimizer state keyed by parameter names lists each group's parameters: one no group names
    has no moments because it is frozen (`optimizer-mismatch: 1 parameters have no optimizer
    moments: 0.weight` was a false warning). A trained parameter whose moments were dropped is
    still named."""
    _frozen_embedding_run(tmp_path / "clean", how)
    report = verify(tmp_path / "clean")
    assert "optimizer-mismatch" not in [f.rule for f in report.findings], report.findings
    _frozen_embedding_run(tmp_path / "dropped", how, drop="3.weight")
    found = [f for f in verify(tmp_path / "dropped").findings if f.rule == "optimizer-mismatch"]
    # (a warning though the groups name it: torch's Adam makes no state for a parameter that never
    # had a gradient, an unused module)
    assert [(f.item, f.severity) for f in found] == [("3.weight", "warning")], found
    assert "0.weight" not in found[0].message


def test_a_crc_failure_in_a_value_beside_the_items_names_its_path(tmp_path):
    """A Megatron rank file's per-parameter Adam steps are no items of the manifest (the step is
    the checkpoint's): a member holding one that fails its CRC-32 is named by its path in the
    file's pickle, not only as a member."""
    import zipfile

    from ckpttool.formats import _pt
    from ckpttool.formats.megatron import ALLOWLIST
    from ckpttool.values import flatten

    path = _copy("megatron/legacy_tp2pp2", tmp_path)
    rel = "iter_0000003/mp_rank_00_000/model_optim_rng.pt"
    archive, obj, _ = _pt.load(path, rel, ALLOWLIST)
    archive.close()
    steps = {p: v.storage.key for p, v in flatten(obj) if p.endswith(".step") and hasattr(v, "storage")}
    name, key = sorted(steps.items())[0]
    f = path / rel
    with zipfile.ZipFile(f) as z:
        (info,) = [i for i in z.infolist() if i.filename.endswith(f"/data/{key}")]
    with open(f, "rb") as fh:  # the member's data: after its local header (30 bytes, name, extra)
        fh.seek(info.header_offset + 26)
        n, m = struct.unpack("<HH", fh.read(4))
    times = os.stat(f)
    _patch(f, info.header_offset + 30 + n + m, b"\x7f")
    os.utime(f, ns=(times.st_atime_ns, times.st_mtime_ns))
    (found,) = [x for x in verify(path).findings if x.rule == "checksum-mismatch"]
    assert f"{info.filename} ({name}) fails its zip CRC-32" in found.message, found.message
    seal = run_cli("seal", path)
    assert seal.code == 3 and name in seal.stderr, seal.stderr


def _patch_keeping_crc(file: Path, offset: int, data: bytes) -> None:
    """Write ``data`` at ``offset`` of ``file``, the CRC-32 of the zip member holding it set to the
    new bytes' (a .pt file is one zip archive, a .distcp file one per item) and the modification
    time kept: only the rule under test fires."""
    import io
    import re
    import zipfile
    import zlib

    raw = bytearray(file.read_bytes())
    raw[offset : offset + len(data)] = data
    for eocd in re.finditer(b"PK\x05\x06", bytes(raw)):
        at = eocd.start()
        size, where = struct.unpack("<II", raw[at + 12 : at + 20])
        base = at - size - where  # where this archive starts in the file
        if raw[at - 20 : at - 16] == b"PK\x06\x07":  # (torch writes zip64 end records: they lie in between)
            base = raw.rfind(b"PK\x06\x06", 0, at - 20) - int.from_bytes(raw[at - 12 : at - 4], "little")
        if not base <= offset < at:
            continue
        archive = bytearray(raw[base : at + 22 + int.from_bytes(raw[at + 20 : at + 22], "little")])
        for info in zipfile.ZipFile(io.BytesIO(bytes(archive))).infolist():
            head = info.header_offset
            start = head + 30 + int.from_bytes(archive[head + 26 : head + 28], "little")
            start += int.from_bytes(archive[head + 28 : head + 30], "little")
            if start <= offset - base < start + info.file_size:
                set_stored_crc(archive, info, start, zlib.crc32(archive[start : start + info.file_size]))
        raw[base : base + len(archive)] = archive
        break
    st = os.stat(file)
    file.write_bytes(bytes(raw))
    os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns))


_NAN = {"float32": struct.pack("<f", float("nan")), "bfloat16": b"\xc0\x7f", "float16": b"\x00\x7e"}
EVERY_FORMAT = [
    "dcp/fsdp2",
    "megatron/legacy_tp2pp2",
    "megatron/dist_tp2",
    "deepspeed/zero2",
    "deepspeed/zero3",
    "deepspeed/universal",
    "rankshards/tp_manual/step_00000003",
    "safetensors/sharded",
    "torch/train_state.pt",
]




@pytest.mark.parametrize("rel", EVERY_FORMAT)
def test_a_nan_written_into_a_weight_is_found_in_every_format(rel, tmp_path):
    """One NaN in a weight's first piece (its zip CRC-32 kept right, so that nothing else fires):
    --deep finds it, names the weight and counts it; without --deep values are not read. (ZeRO-3
    keeps the weights only as the optimizer's fp32 partitions: one of those.)"""
    path = _copy(rel, tmp_path)
    _, m = registry.describe(path)
    weights = [i for i in m.items.values() if i.is_tensor and i.dtype in _NAN and i.kind in ("param", "master")]
    item = min(weights, key=lambda i: i.kind != "param")
    file, off, _ = _raw(path, item.name, 0)
    _patch_keeping_crc(file, off, _NAN[item.dtype])
    assert "nonfinite" not in _rules(verify(path))
    report = verify(path, deep=True)
    nan = [f for f in report.findings if f.rule == "nonfinite"]
    # (ZeRO-3's tied head.weight shares emb.weight's partition: both name the NaN)
    assert item.name in [f.item for f in nan] and all("1 NaN" in f.message for f in nan), report.findings
    assert len(nan) == 1 or rel == "deepspeed/zero3", report.findings
    ours = next(f for f in nan if f.item == item.name)
    assert ours.file == item.pieces[0].file and ours.rank == item.pieces[0].rank, ours
    assert "checksum-mismatch" not in _rules(report)
    # a weight whose fp32 copy no longer rounds to it only where the NaN is: not blamed on swapped files
    swapped = [f for f in report.findings if f.rule == "optimizer-mismatch" and "swapped" in f.message]
    assert not swapped, swapped


@pytest.mark.parametrize(
    ("rel", "name"),
    [
        # the tied embedding's fp32 master on the last pipeline stage (DeepSpeed keeps it apart)
        ("deepspeed/pipeline_tied", "tied_modules.embed.emb.weight.fp32"),
        ("rankshards/ddp", "model.body.0.weight"),  # rank 1's DDP copy
    ],
)
def test_a_nan_in_a_further_copy_is_found(rel, name, tmp_path):
    """A NaN in a copy other than the first of a replicated region: --deep read only the first
    copy's values, so the stage or rank resuming from the damaged one went unsaid (a
    replica-mismatch at most, a warning for DeepSpeed's stage copies). The finding names that
    copy's file and rank, and the element's global index."""
    path = _copy(rel, tmp_path)
    _, m = registry.describe(path)
    item = m.items[name]
    i = next(k for k, p in enumerate(item.pieces) if p.replica == 1)
    piece = item.pieces[i]
    file, off, _ = _raw(path, name, i)
    _patch_keeping_crc(file, off + 4 * 3, _NAN["float32"])  # the piece's element 3
    report = verify(path, deep=True)
    nan = [f for f in report.findings if f.rule == "nonfinite"]
    assert [(f.item, f.file, f.rank) for f in nan] == [(name, piece.file, piece.rank)], report.findings
    at = 3 + (piece.flat[0] if piece.flat else 0)
    index = [int(o + k) for o, k in zip(piece.box.offsets, np.unravel_index(at, piece.box.sizes))]
    assert "1 NaN and 0 Inf" in nan[0].message and f"first at index {index}" in nan[0].message, nan[0]
    assert report.stats[name]["nan"] == 0  # (the statistics are the first copy's)


@pytest.mark.parametrize("rel", [r for r in EVERY_FORMAT if not r.startswith("safetensors")])
def test_an_adam_moment_zeroed_is_found_in_every_format(rel, tmp_path):
    """Every piece of one parameter's exp_avg_sq zeroed (CRC-32s kept right), at step 3: an
    optimizer-mismatch naming the moment, without --deep."""
    path = _copy(rel, tmp_path)
    _, m = registry.describe(path)
    item = next(
        i for n, i in m.items.items() if n.endswith("exp_avg_sq") and i.is_tensor and len(i.shape or ()) >= 1
    )
    for index in range(len(item.pieces)):
        file, off, n = _raw(path, item.name, index)
        _patch_keeping_crc(file, off, bytes(n))
    report = verify(path)
    found = [f for f in report.findings if f.rule == "optimizer-mismatch"]
    assert [f.item for f in found] == [item.name] and "all zeros" in found[0].message, report.findings
    assert "checksum-mismatch" not in _rules(report)


@pytest.mark.parametrize("copy", [0, 1])
def test_of_two_copies_the_one_holding_a_nan_is_blamed(copy, tmp_path):
    """Two DP ranks' copies of a weight, one with a NaN written in (its CRC-32 kept right): with no
    third copy, the NaN says which one is damaged, with or without --deep."""
    path = _copy("rankshards/ddp", tmp_path)
    _, m = registry.describe(path)
    name = "model.body.0.weight"
    pieces = m.items[name].pieces
    assert len(pieces) == 2 and m.items[name].dtype == "float32"
    file, off, _ = _raw(path, name, copy)
    _patch_keeping_crc(file, off + 4, _NAN["float32"])
    for deep in (False, True):
        found = [f for f in verify(path, deep=deep).findings if f.rule == "replica-mismatch"]
        assert [(f.item, f.file) for f in found] == [(name, pieces[copy].file)], found
        assert "holds 1 NaN or Inf values where that one holds none" in found[0].message


def _edited_train_state(tmp_path: Path, edit) -> Path:
    state = torch.load(FIXTURES / "torch" / "train_state.pt", weights_only=False)
    edit(state["optimizer"]["state"])
    out = tmp_path / "edited.pt"
    torch.save(state, out)
    return out


@pytest.mark.parametrize(
    ("edit", "severity", "words"),
    [
        (lambda st: st[2].__setitem__("exp_avg", torch.ones(3, 3)), "error", "the moments of parameter 2 disagree"),
        (lambda st: st.pop(5), "warning", "have no state: indices 5"),
        (lambda st: st[4].__setitem__("step", torch.tensor(2.0)), "warning", "optimizer.state.4.step (2)"),
    ],
    ids=["moment shape", "state dropped", "one step behind"],
)
def test_an_optimizer_state_keyed_by_index_is_checked(edit, severity, words, tmp_path):
    """torch's optimizer.state_dict() keys its state by parameter index, which matches no parameter
    name: a moment of the wrong shape, a parameter's state dropped from the dict (its index still
    in the param groups) and a step that disagrees passed verify clean. The moments are checked
    against each other, the indices against the groups' lists, and the steps against each other
    (a warning: a parameter that got no gradient at some steps lags)."""
    report = verify(_edited_train_state(tmp_path, edit))
    found = [(f.severity, f.message) for f in report.findings if f.rule == "optimizer-mismatch"]
    assert len(found) == 1 and found[0][0] == severity and words in found[0][1], found
    clean = verify(FIXTURES / "torch" / "train_state.pt")
    assert "optimizer-mismatch" not in _rules(clean), clean.findings


def _written_to_while_hashed(path: Path, how: str) -> OnFirstProgress:
    """A ``progress`` callback that changes ``path`` once the hashing has read its first chunk, as a
    writer at work on the file would (cut short, or bytes overwritten in place)."""

    def change() -> None:
        if how == "cut":
            os.truncate(path, path.stat().st_size // 2)
        else:
            with open(path, "r+b") as fh:
                fh.seek(path.stat().st_size - 4096)
                fh.write(os.urandom(4096))

    return OnFirstProgress(change)


@pytest.mark.parametrize("how", ["cut", "overwritten"])
def test_a_file_that_changes_while_it_is_hashed_is_not_sealed_or_passed(how, tmp_path):
    """seal exited 0 with a seal that vouched for bytes it never read (the pieces past a cut took
    the digest of nothing) or for the bytes before a writer changed them; verify compared such a
    half-read file against the seal. A file whose size or modification time moved while it was
    read, or that ended short of its size, is now refused by seal and an incomplete-save for
    verify."""
    from safetensors.numpy import save_file

    from ckpttool.errors import CkptError

    ck = tmp_path / "ck"
    ck.mkdir()
    rng = np.random.default_rng(0)
    save_file({f"w{i}": rng.standard_normal((256, 1024)).astype(np.float32) for i in range(4)}, ck / "model.safetensors")
    data = ck / "model.safetensors"
    original = data.read_bytes()
    with pytest.raises(CkptError, match=r"model\.safetensors changed while it was sealed .*: not sealed"):
        seal(ck, workers=1, progress=_written_to_while_hashed(data, how))
    assert not (ck / "ckpttool.manifest.json").exists()

    data.write_bytes(original)
    seal(ck)
    report = verify(ck, workers=1, progress=_written_to_while_hashed(data, how))
    found = [(f.rule, f.file) for f in report.findings if f.severity == "error"]
    assert ("incomplete-save", "model.safetensors") in found, report.findings
    assert not [f for f in report.findings if f.rule in ("truncated-file", "checksum-mismatch") and "-1" in f.message]


@pytest.mark.parametrize("spelled", ["./{}", "../ck/{}", "../outside.bin", "/etc/passwd", "{}//"], ids=["dot", "up-and-back", "up", "absolute", "slashes"])
@pytest.mark.parametrize("where", ["files", "piece_files"])
def test_a_seal_naming_a_file_as_seal_never_writes_it_is_refused(spelled, where, tmp_path):
    """"./__0_0.distcp" or "../ck/__0_0.distcp" in a seal named a file on disk twice (6 files
    checked for 5, and each file an extra-file warning, exit 0); "../outside.bin" was an
    unsafe-path finding about a link ('..') that is not there. A seal's paths are written
    canonical: any other spelling is a seal damaged or forged (exit 3)."""
    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / "dcp" / "fsdp2", ck)
    seal_file = tmp_path / "seal.json"
    assert run_cli("seal", ck, "--out", seal_file).code == 0
    data = json.loads(seal_file.read_text())
    if where == "files":
        entry = data["manifest"]["files"][1]
        entry["path"] = spelled.format(entry["path"])
    else:
        data["piece_files"][0] = spelled.format(data["piece_files"][0])
    seal_file.write_text(json.dumps(data))
    r = run_cli("verify", ck, "--manifest", seal_file)
    assert r.code == 3 and "not a readable ckpttool seal" in r.stderr and "not a path below the checkpoint" in r.stderr, (r.code, r.stdout, r.stderr)


def test_deep_reads_the_trainer_state_beside_the_model(tmp_path):
    """--deep read only the model of a Hugging Face Trainer checkpoint: a NaN in optimizer.pt's
    moments passed with exit 0 (the file was only checked as an archive)."""
    import torch

    path = _copy("hf/trainer/checkpoint-3", tmp_path)
    state = torch.load(path / "optimizer.pt", weights_only=True)
    state["state"][0]["exp_avg"].view(-1)[5] = float("nan")
    torch.save(state, path / "optimizer.pt")
    report = verify(path, deep=True)
    (found,) = [f for f in report.findings if f.severity == "error"]
    assert (found.rule, found.item, found.file, found.rank) == (
        "nonfinite", "optimizer.state.0.exp_avg", "optimizer.pt", None
    ), found
    assert report.stats["optimizer.state.0.exp_avg"]["nan"] == 1
    assert not verify(FIXTURES / "hf/trainer/checkpoint-3", deep=True).failing()


def test_deep_finds_nan_in_plain_values_and_complex_tensors(tmp_path):
    """A NaN learning rate, an Inf in a scheduler's list and a complex tensor holding NaN passed
    --deep: only real floating-point tensors were looked at."""
    import torch

    state = torch.load(FIXTURES / "torch/train_state.pt", weights_only=False)
    state["optimizer"]["param_groups"][0]["lr"] = float("nan")
    state["scheduler"]["base_lrs"] = [float("inf")]
    state["phase"] = torch.tensor([1 + 2j, complex(float("nan"), 0.0), 3j], dtype=torch.complex64)
    torch.save(state, tmp_path / "x.pt")
    report = verify(tmp_path / "x.pt", deep=True)
    assert sorted(f.item for f in report.findings if f.rule == "nonfinite") == [
        "optimizer.param_groups.0.lr", "phase", "scheduler.base_lrs"
    ], report.findings
    stats = report.stats["phase"]
    assert (stats["nan"], stats["first_nonfinite"], stats["absmax"]) == (1, [1], 3.0)
    assert not [f for f in verify(FIXTURES / "torch/train_state.pt", deep=True).findings if f.rule == "nonfinite"]


def test_deep_finds_nan_in_a_long_list_of_learning_rates_and_in_a_tensor_dcp_keeps_in_a_value(tmp_path):
    """A scheduler of 21 parameter groups with one NaN learning rate passed --deep (lists were looked
    through up to 16 elements), and so did a NaN in a tensor DCP keeps inside a tuple's pickle. A
    NaN in another long list (a loss history with an fp16 overflow step) is still no finding."""
    import torch
    import torch.distributed.checkpoint as dcp

    state = {
        "w": torch.ones(4),
        "pair": (torch.tensor([1.0, float("nan"), 2.0]), 5),
        "scheduler": {"_last_lr": [0.1] * 20 + [float("nan")]},
        "losses": [2.0] * 20 + [float("nan")],
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=tmp_path / "d", no_dist=True)
    report = verify(tmp_path / "d", deep=True)
    found = {f.item: f for f in report.findings if f.rule == "nonfinite"}
    assert sorted(found) == ["pair.0", "scheduler._last_lr"], report.findings
    assert (found["pair.0"].file, found["pair.0"].rank) == ("__0_0.distcp", 0)
    assert (report.stats["pair.0"]["nan"], report.stats["pair.0"]["first_nonfinite"]) == (1, [1])
    state["pair"] = (torch.tensor([1.0, 2.0]), 5)
    state["scheduler"]["_last_lr"][-1] = 0.1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=tmp_path / "e", no_dist=True)
    report = verify(tmp_path / "e", deep=True)
    assert not [f for f in report.findings if f.rule == "nonfinite"], report.findings
    assert report.stats["pair.0"]["max"] == 2.0


def test_deep_statistics_of_values_near_the_float64_limit(tmp_path):
    """The mean and std of finite values near float64's largest were Inf (the sum overflowed),
    with numpy's overflow warning on stderr."""
    import torch

    torch.save({"w": torch.tensor([1e308, 1e308, -1e308, 1.5e308], dtype=torch.float64)}, tmp_path / "w.pt")
    r = run_cli("verify", tmp_path / "w.pt", "--deep", "--json")
    stats = json.loads(r.stdout)["stats"]["w"]
    assert stats["mean"] == pytest.approx(6.25e307) and stats["std"] == pytest.approx(9.601432184835761e307)
    assert "Warning" not in r.stderr, r.stderr


def test_deep_statistics_of_large_finite_complex64_values(tmp_path):
    """|3e38 + 3e38j| is finite, yet complex64 magnitudes were taken in float32: max and absmax
    "inf", mean and std "nan", and numpy's warning on stderr."""
    import torch

    torch.save({"z": torch.tensor([3e38 + 3e38j, 1 + 0j], dtype=torch.complex64)}, tmp_path / "z.pt")
    r = run_cli("verify", tmp_path / "z.pt", "--deep", "--json")
    stats = json.loads(r.stdout)["stats"]["z"]
    assert stats["absmax"] == stats["max"] == pytest.approx(abs(complex(np.float32(3e38), np.float32(3e38))))
    assert (stats["nan"], stats["inf"], stats["min"]) == (0, 0, 1.0) and stats["mean"] == pytest.approx(stats["max"] / 2)
    assert "Warning" not in r.stderr, r.stderr


def test_the_empty_moments_of_a_parameter_with_no_elements_are_no_finding(tmp_path):
    """A trained parameter of shape (0, 4) has empty Adam moments, whose (no) bytes are all zeros:
    "optimizer.state.1.exp_avg is all zeros at step 2: the moments were reset", an error, exit 1,
    on a healthy checkpoint (with or without --deep)."""
    import torch

    w, e = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.empty(0, 4))
    opt = torch.optim.Adam([w, e], lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        (w.sum() + e.sum()).backward()
        opt.step()
    torch.save({"model": {"w": w.detach(), "e": e.detach()}, "optimizer": opt.state_dict(), "step": 2}, tmp_path / "c.pt")
    for deep in (False, True):
        report = verify(tmp_path / "c.pt", deep=deep)
        assert not [f for f in report.findings if f.rule == "optimizer-mismatch"], report.findings
    opt.state[w]["exp_avg"].zero_()  # (a real parameter's zeroed moment is still one)
    torch.save({"model": {"w": w.detach(), "e": e.detach()}, "optimizer": opt.state_dict(), "step": 2}, tmp_path / "z.pt")
    assert [f.item for f in verify(tmp_path / "z.pt").findings if f.rule == "optimizer-mismatch"] == [
        "optimizer.state.0.exp_avg"
    ]


def test_files_beside_a_megatron_iteration_are_not_extra_after_a_seal(tmp_path):
    """A file the run keeps in the save directory beside its iterations (progress.txt) was an
    extra-file right after sealing, failing --fail-on warning; a file added to the iteration's
    own folder (not a rank's) after the seal went unsaid."""
    path = _copy("megatron/legacy_tp2pp2", tmp_path)
    (path / "progress.txt").write_text("iteration 3 done\n")
    seal(path)
    (path / "progress.txt").write_text("iteration 3 done\niteration 4 started\n")
    assert not [f for f in verify(path).findings if f.rule in ("extra-file", "checksum-mismatch")]
    (path / "iter_0000003" / "extra.pt").write_bytes(b"added")
    extra = [f for f in verify(path).findings if f.rule == "extra-file"]
    assert [f.file for f in extra] == ["iter_0000003/extra.pt"], extra
    (path / "latest_checkpointed_iteration.txt").unlink()  # (sealed where it lies: still missing when gone)
    assert "latest_checkpointed_iteration.txt" in {f.file for f in verify(path).findings if f.rule == "missing-file"}


@pytest.mark.parametrize(("fixture", "inner"), [("megatron/legacy_tp2pp2", "iter_0000003"), ("deepspeed/zero2", "global_step3")])
def test_a_folders_seal_given_for_its_save_directory_names_that_folder(fixture, inner, tmp_path):
    """The seal of an iteration (tag) folder given for its save directory, or the save directory's
    for the folder, was 'the seal of another checkpoint, or it was edited': it says which folder
    it is the seal of, and the command that verifies it."""
    path = _copy(fixture, tmp_path)
    seal(path / inner)
    r = run_cli("verify", path, "--manifest", path / inner / "ckpttool.manifest.json")
    assert r.code == 3 and f"its files are named from {path / inner}, a folder of this checkpoint" in r.stderr, r.stderr
    assert f"ckpttool verify {path / inner} --manifest" in r.stderr
    (path / inner / "ckpttool.manifest.json").unlink()
    seal(path)
    r = run_cli("verify", path / inner, "--manifest", path / "ckpttool.manifest.json")
    assert r.code == 3 and f"its files are named from {path}, the folder above this checkpoint" in r.stderr, r.stderr


def test_junit_of_a_sealed_checkpoint_that_did_not_read(tmp_path):
    """With a seal, a checkpoint whose files were all deleted (nothing read past that) had its
    format's rules (coverage, nonfinite, missing-state) passing in JUnit: they did not run."""
    import xml.etree.ElementTree as ET

    path = _copy("dcp/fsdp2", tmp_path)
    seal(path)
    for f in path.glob("__*.distcp"):
        f.unlink()
    r = run_cli("verify", path, "--deep", "--junit", tmp_path / "j.xml")
    assert r.code == 1
    cases = {c.get("classname").removeprefix("ckpttool."): c for c in ET.parse(tmp_path / "j.xml").getroot()}
    skipped = {rule for rule, c in cases.items() if c.find("skipped") is not None}
    assert {"coverage-gap", "nonfinite", "missing-state"} <= skipped
    assert cases["missing-file"].find("failure") is not None
    assert not skipped & {"missing-file", "extra-file", "truncated-file", "checksum-mismatch"}


def test_a_nan_optimizer_step_is_not_the_step_the_others_are_measured_by(tmp_path):
    """With the steps split evenly (one group's NaN, the other's 3), the NaN was taken as the
    common step and the good one blamed, as a warning; a NaN step is damage."""
    path = _copy("deepspeed/zero2_bf16", tmp_path)
    _, m = registry.describe(path)
    item = m.items["optimizer.param_groups.0.step"]
    for i in range(len(item.pieces)):
        file, off, n = _raw(path, item.name, i)
        _patch_keeping_crc(file, off, np.array([np.nan], dtype=np.float32).tobytes()[:n])
    (found,) = [f for f in verify(path).findings if f.rule == "optimizer-mismatch"]
    assert found.severity == "error" and found.item == "optimizer.param_groups.0.step", found
    assert "differ from the others' (3)" in found.message and "(nan)" in found.message


def test_an_index_leaving_out_a_whole_shard_is_refused(tmp_path):
    """An index naming no tensor of one shard of its own numbered set passed with exit 0 (the
    shard was an aux file, never read; a loader would leave its tensors at their random init), and
    seal vouched for it; one tensor left out was already caught."""
    path = _copy("safetensors/sharded", tmp_path)
    index = path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"] = {k: v for k, v in data["weight_map"].items() if "00001-of" in v}
    index.write_text(json.dumps(data))
    report = verify(path)
    (found,) = report.failing()
    assert (found.rule, found.file) == ("corrupt-file", "model.safetensors.index.json"), found
    assert "names no tensor of model-00002-of-00002.safetensors" in found.message
    r = run_cli("seal", path)
    assert r.code == 3 and not (path / "ckpttool.manifest.json").exists()


@pytest.mark.parametrize("fixture", ["megatron/legacy_tp2pp2", "megatron/dist_tp2pp2"])
def test_megatron_holds_its_dataloader_position_in_its_args(fixture):
    """Megatron-LM resumes its sampler from args.consumed_train_samples: every Megatron checkpoint
    was said to hold no dataloader position (an error under --require dataloader)."""
    report = verify(FIXTURES / fixture, require=["dataloader"])
    assert not [f for f in report.findings if f.rule == "missing-state"], report.findings
    _, m = registry.describe(FIXTURES / fixture)
    assert m.extras["state_in_metadata"] == {"dataloader": "args.consumed_train_samples (12)"}


def test_a_moment_file_copied_over_its_sibling_is_an_error(tmp_path):
    """A universal checkpoint's exp_avg.pt copied over the same parameter's exp_avg_sq.pt was a
    warning ('unless the save wrote them equal'), exit 0, and seal vouched for it: no save writes a
    parameter's two moments equal."""
    path = _copy("deepspeed/universal3", tmp_path)
    where = path / "global_step3_universal" / "zero" / "blocks.0.fc1.weight"
    shutil.copy2(where / "exp_avg.pt", where / "exp_avg_sq.pt")
    (found,) = verify(path).failing()
    assert found.rule == "misplaced-file" and "two states of one parameter" in found.message, found
    r = run_cli("seal", path)
    assert r.code == 3 and "not sealed" in r.stderr


def test_an_fp32_master_of_another_shape_than_its_parameter_is_an_error(tmp_path):
    """A universal fp32.pt cut to 30 of its parameter's 31 rows passed, with and without --deep (its
    moments of that shape were already an error): the master was left out of the check as "not
    its parameter's" instead of being reported."""
    path = _copy("deepspeed/universal", tmp_path)
    f = path / "global_step3_universal" / "zero" / "emb.weight" / "fp32.pt"
    was = os.stat(f)
    state = torch.load(f, weights_only=True)
    state["param"] = state["param"][:30].clone()
    torch.save(state, f)
    os.utime(f, ns=(was.st_atime_ns, was.st_mtime_ns))
    for deep in (False, True):
        (found,) = verify(path, deep=deep).failing()
        assert found.rule == "optimizer-mismatch" and found.item == "emb.weight.fp32", found
        assert "emb.weight.fp32 has shape [30, 16], its parameter emb.weight [31, 16]" in found.message


@pytest.mark.parametrize("sealed", [False, True])
def test_a_trainers_optimizer_file_is_checked_as_optimizer_state(sealed, tmp_path):
    """A Hugging Face Trainer's optimizer.pt (index-keyed, beside model.safetensors) was checked as an
    archive only: every moment zeroed at step 3, one parameter's step at 9 and one parameter's
    state gone verified clean, with --deep too. Now each is an optimizer-mismatch, as in a
    torch.save training state, with a seal too (the zero check then by digest, from a second read)."""
    path = tmp_path / "checkpoint-3"
    shutil.copytree(FIXTURES / "hf" / "trainer" / "checkpoint-3", path)
    f = path / "optimizer.pt"
    was = os.stat(f)
    state = torch.load(f, weights_only=True)
    for moments in state["state"].values():
        moments["exp_avg"].zero_()
        moments["exp_avg_sq"].zero_()
    state["state"][3]["step"].fill_(9)
    del state["state"][5]
    torch.save(state, f)
    os.utime(f, ns=(was.st_atime_ns, was.st_mtime_ns))
    if sealed:  # (the damage sealed: only the optimizer checks can see it, and the seal hides none)
        seal(path)
    report = verify(path)
    found = [x for x in report.findings if x.rule == "optimizer-mismatch"]
    zeroed = [x for x in found if "is all zeros at step 3" in x.message]
    assert len(zeroed) == 56 and all(x.item.startswith("optimizer.state.") for x in zeroed), found
    assert any("steps" in x.message and "optimizer.state.3.step" in x.message for x in found), found
    assert any("have no state: indices 5" in x.message and x.severity == "warning" for x in found), found
    for deep in ([], ["--deep"]):
        r = run_cli("verify", path, *deep)
        assert r.code == 1 and "ERROR     optimizer-mismatch  57 findings" in r.stdout, r.stdout


def test_a_trainers_optimizer_file_is_parsed_once_under_deep(monkeypatch):
    """--deep parsed a Trainer's optimizer.pt twice: once for the optimizer checks, once for its
    values."""
    from ckpttool.formats import torchsave

    parsed: list[str] = []
    describe = torchsave.ADAPTER.describe

    def counted(path, *args, **kwargs):
        parsed.append(Path(path).name)
        return describe(path, *args, **kwargs)

    monkeypatch.setattr(torchsave.ADAPTER, "describe", counted)
    report = verify(FIXTURES / "hf" / "trainer" / "checkpoint-3", deep=True)
    assert not report.failing() and "optimizer.state.0.exp_avg" in report.stats, report.findings
    assert parsed.count("optimizer.pt") == 1, parsed


def test_one_rank_shard_file_given_alone_has_its_moments(tmp_path):
    """A per-rank shard file's {"local": ...} entries read alone as a torch.save file: its
    parameter 'emb.weight.local' was said to have no optimizer moments, which the file holds as
    'emb.weight.exp_avg.local'; a moment taken out is still said."""
    import torch

    shard = FIXTURES / "rankshards" / "tp_manual" / "step_00000003" / "shard_00001.pt"
    report = verify(shard)
    assert not [f for f in report.findings if f.rule == "optimizer-mismatch"], report.findings
    state = torch.load(shard, weights_only=True)
    optim = state["optim"]["state"]
    for key in ("exp_avg", "exp_avg_sq"):
        del optim["emb.weight"][key]
    torch.save(state, tmp_path / "shard_00001.pt")
    found = [f for f in verify(tmp_path / "shard_00001.pt").findings if f.rule == "optimizer-mismatch"]
    assert [f.item for f in found] == ["emb.weight.local"], found


def test_deep_lets_a_schedulers_own_infs_be(tmp_path):
    """ReduceLROnPlateau keeps best = Inf (before its first step) and mode_worse = Inf by design:
    --deep called them NaN/Inf damage, exit 1. An Inf in a learning rate, or a NaN anywhere, still is."""
    import torch

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "lr_scheduler": plateau.state_dict(),
                "step": 1}, tmp_path / "s.pt")  # fmt: skip
    assert not [f for f in verify(tmp_path / "s.pt", deep=True).findings if f.rule == "nonfinite"]
    opt.param_groups[0]["lr"] = float("inf")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1}, tmp_path / "s.pt")
    found = [f.item for f in verify(tmp_path / "s.pt", deep=True).findings if f.rule == "nonfinite"]
    assert found == ["optimizer.param_groups.0.lr"]


def _stepped(tmp_path, steps):
    import torch

    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(len(steps) // 2)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    state = opt.state_dict()
    for (_, s), step in zip(sorted(state["state"].items()), steps, strict=True):
        s["step"] = torch.tensor(step)
    torch.save({"model": model.state_dict(), "optimizer": state, "step": 5}, tmp_path / "t.pt")
    return [f for f in verify(tmp_path / "t.pt").findings if f.rule == "optimizer-mismatch"]


def test_optimizer_steps_compared_exactly_and_a_nan_one_is_an_error_on_a_tie(tmp_path):
    """Steps grouped by their 6-digit text took 1000003 for 1000000; with the finite steps tied, a
    NaN one was a warning (exit 0), where it was an error otherwise."""
    (found,) = _stepped(tmp_path, [1000003.0, 1000003.0, 1000000.0, 1000003.0])
    assert "1000003.0" in found.message and found.severity == "warning", found  # (one lags: a warning)
    (found,) = _stepped(tmp_path, [5.0, 5.0, 3.0, 3.0, float("nan"), float("nan")])
    assert found.severity == "error" and "no value held by most" in found.message, found


def test_an_optimizer_step_ahead_of_the_others_is_an_error(tmp_path):
    """A step ahead of the others was a warning whose hint said it lags ("parameters that got no
    gradient at some steps lag behind"): ahead of the checkpoint's own step too (by more than one),
    no lag gives it, so it is state of a later save mixed in, an error. One behind stays a warning."""
    (found,) = _stepped(tmp_path, [3.0, 3.0, 50.0, 3.0])
    assert found.severity == "error" and found.item == "optimizer.state.2.step", found
    assert "differ from the others' (3), 1 of them ahead: optimizer.state.2.step (50)" in found.message, found
    assert "never takes more optimizer steps than the checkpoint's 5 training steps" in found.hint, found
    (found,) = _stepped(tmp_path, [3.0, 3.0, 1.0, 3.0])
    assert found.severity == "warning" and "lag behind" in found.hint, found
    # a head trained from the start, the body unfrozen later: the head's steps are the checkpoint's
    # own (5), ahead of most, and right: a warning, not an error
    (found,) = _stepped(tmp_path, [3.0, 3.0, 3.0, 3.0, 5.0, 5.0])
    assert found.severity == "warning", found


def test_optimizer_steps_ahead_of_the_checkpoints_step_are_a_step_mismatch(tmp_path):
    """Every Adam step at 7 in a checkpoint of step 5 (the optimizer state of a later save) passed
    without a word: Adam takes one step per training step at most. A warning (a run's counter may
    have been reset while the optimizer kept its state); steps behind it say nothing (fp16 skips
    steps; an optimizer may start afresh)."""
    assert _stepped(tmp_path, [7.0] * 4) == []
    found = [f for f in verify(tmp_path / "t.pt").findings if f.rule == "step-mismatch"]
    assert [(f.severity, f.item) for f in found] == [("warning", "optimizer.state.0.step")], found
    assert "the optimizer's steps are 7 (optimizer.state.0.step and 3 more), ahead of the checkpoint's step 5" in (
        found[0].message
    )
    _stepped(tmp_path, [4.0] * 4)
    assert not [f for f in verify(tmp_path / "t.pt").findings if f.rule == "step-mismatch"]


def test_a_step_file_replaced_by_a_moment_is_an_error(tmp_path):
    """DeepSpeed universal: exp_avg.pt copied over step.pt was a misplaced-file warning ("unless the
    save wrote them equal") and seal vouched for it, the step now a 32-value tensor. A step is a
    state of its parameter too, never written equal to a moment, and one of more than one value is
    an optimizer-mismatch of its own."""
    path = _copy("deepspeed/universal", tmp_path)
    folder = path / "global_step3_universal" / "zero" / "blocks.0.fc1.bias"
    shutil.copy2(folder / "exp_avg.pt", folder / "step.pt")
    found = {(f.rule, f.severity, f.item) for f in verify(path).findings if f.rule != "missing-state"}
    assert found == {
        ("misplaced-file", "error", None),
        ("optimizer-mismatch", "error", "blocks.0.fc1.bias.step"),
    }, found
    r = run_cli("seal", path)
    assert_clean(r, 3, "two states of one parameter", "not sealed")


def test_the_files_checked_are_counted_alike_with_and_without_a_seal(tmp_path):
    """A DCP checkpoint was 4 files checked without a seal and 5 with one: its .metadata, read whole
    (and its pickle checked) by describe, was left out of the count without a seal."""
    path = _copy("dcp/fsdp2", tmp_path)
    before = verify(path).checked
    seal(path)
    after = verify(path).checked
    assert before["files"] == after["files"] == 5 and before["bytes"] == after["bytes"], (before, after)


def test_a_file_added_to_a_sealed_subfolder_below_the_data_is_extra(tmp_path):
    """The scan for extra files was narrowed to the data's folders (not the save directory above
    them), and left out a subfolder of the checkpoint holding only its companion files (a DCP
    save's sharded/ Hugging Face files): files added there after the seal went unsaid."""
    path = _copy("dcp/fsdp2_hf", tmp_path)
    seal(path)
    (path / "sharded" / "junk.bin").write_text("added")
    extra = [f.file for f in verify(path).findings if f.rule == "extra-file"]
    assert extra == ["sharded/junk.bin"], extra


def test_a_file_that_merely_holds_the_temporary_marker_is_no_interrupted_write(tmp_path):
    """seal counts ``notes.ckpttool-tmp-1`` as a file of the checkpoint (only ckpttool's hidden
    temporaries are left out), but verify still warned it was "a temporary of an interrupted
    ckpttool write": --fail-on warning failed a sealed, intact checkpoint."""
    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / "dcp" / "fsdp2", ck)
    (ck / "notes.ckpttool-tmp-1").write_text("kept\n")
    assert run_cli("seal", ck).code == 0
    r = run_cli("verify", ck, "--json")
    assert not [f for f in json.loads(r.stdout)["findings"] if f["rule"] == "incomplete-save"], r.stdout


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "complex64", "float64"])
def test_deep_statistics_block_by_block_are_numpys_over_the_whole(tmp_path, monkeypatch, dtype):
    """--deep took each tensor's statistics over the whole tensor at once, in float64: temporaries of
    twice its size (its peak 3.3x a float32 tensor's bytes above the values, and 2.1x slower than
    block by block: docs/benchmarks.md). They are gathered block by block now; here with blocks of
    7 elements, a NaN and an Inf in later blocks, and values near float64's largest (summed again,
    scaled), the figures are numpy's over the whole tensor."""
    import torch

    from ckpttool import verify as v

    monkeypatch.setattr(v, "_CENSUS_BLOCK", 7)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 9, generator=g, dtype=torch.float64) * 3 + 1
    if dtype == "float64":
        w[1, 1], w[3, 3] = 1.7e308, -1.6e308
    w[2, 4], w[4, 8] = float("nan"), float("inf")
    t = w.to(getattr(torch, dtype)) if dtype != "complex64" else torch.complex(w.float(), w.flip(0).float())
    torch.save({"w": t}, tmp_path / "w.pt")
    report = v.verify(tmp_path / "w.pt", deep=True)
    stats = report.stats["w"]
    whole = t.reshape(-1).to(torch.complex128 if dtype == "complex64" else torch.float64).numpy()
    bad = ~np.isfinite(whole)
    finite = np.abs(whole[~bad]) if dtype == "complex64" else whole[~bad]
    assert (stats["nan"], stats["inf"]) == (int(np.isnan(whole).sum()), int(bad.sum() - np.isnan(whole).sum()))
    assert stats["first_nonfinite"] == [int(i) for i in np.unravel_index(int(np.argmax(bad)), (5, 9))]
    assert (stats["min"], stats["max"]) == (float(finite.min()), float(finite.max()))
    assert stats["absmax"] == float(np.abs(finite).max())
    scale = max(float(np.abs(finite).max()), 1.0)
    assert stats["mean"] == pytest.approx(float((finite / scale).mean()) * scale, rel=1e-12)
    assert stats["std"] == pytest.approx(float((finite / scale).std()) * scale, rel=1e-12)
    assert [f.rule for f in report.findings if f.rule == "nonfinite"] == ["nonfinite"]
