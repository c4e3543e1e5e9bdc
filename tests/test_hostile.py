"""Hostile and damaged DCP checkpoints: nothing executes, one clear line, the right exit code."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import FIXTURES, assert_clean, run_cli, tree_digests

HOSTILE = FIXTURES / "hostile"
MARKER = "CKPTTOOL_PWNED"


def _no_marker(tmp_path) -> None:
    assert not (tmp_path / MARKER).exists(), "a payload ran"
    assert not (FIXTURES / MARKER).exists()


@pytest.mark.parametrize(
    ("case", "fragments"),
    [
        ("dcp_metadata_os_system", [".metadata", "posix.system", "refused without running it"]),
        ("dcp_metadata_tmp_only", ["without .metadata", ".metadata.tmp", "interrupted"]),
        ("dcp_truncated_distcp", ["__1_0.distcp is 51,753 bytes", "through byte 103,506", "cut short"]),
        ("dcp_path_escape", [".metadata names the data file '../../outside.distcp'", "outside the checkpoint"]),
    ],
)
@pytest.mark.parametrize("command", [["inspect"], ["ls"], ["inspect", "--json"]])
def test_unreadable_checkpoints_exit_3_with_one_clear_line(case, fragments, command, tmp_path):
    r = run_cli(*command[:1], HOSTILE / case, *command[1:], cwd=tmp_path)
    _no_marker(tmp_path)
    assert r.code == 3
    if "--json" in command:  # (the error as a document too: a script reading stdout learns why)
        assert json.loads(r.stdout)["error"]["exit_code"] == 3
    else:
        assert r.stdout == ""
    assert "Traceback" not in r.stderr
    first = r.stderr.splitlines()[0]
    assert first.startswith("error: ")
    for fragment in fragments:
        assert fragment in r.stderr
    assert len([ln for ln in r.stderr.splitlines() if ln.startswith("error:")]) == 1


def test_export_of_hostile_metadata_writes_nothing(tmp_path):
    out = tmp_path / "out.safetensors"
    r = run_cli("export", HOSTILE / "dcp_metadata_os_system", "-o", out, cwd=tmp_path)
    assert r.code == 3 and not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_bad_bytes_item_is_unloadable_and_the_rest_inspected(tmp_path):
    r = run_cli("inspect", HOSTILE / "dcp_bytes_item_os_system", "--json", cwd=tmp_path)
    _no_marker(tmp_path)
    assert r.code == 1
    data = json.loads(r.stdout)
    assert data["unloadable"] == [{"name": "dataloader.cursor", "error": "unsafe pickle: refers to posix.system"}]
    assert data["step"] == 3 and len(data["items"]) == 82
    assert "dataloader.cursor" in r.stderr and "posix.system" in r.stderr
    human = run_cli("ls", HOSTILE / "dcp_bytes_item_os_system", "-f", "dataloader", cwd=tmp_path)
    assert human.code == 0 and "unsafe pickle: refers to posix.system" in human.stdout
    _no_marker(tmp_path)


def test_seal_refuses_a_bytes_item_whose_pickle_runs_code(tmp_path):
    """seal vouched for a DCP checkpoint whose dataloader bytes item pickles os.system (exit 0;
    verify then failed it): a seal is what a CI gate publishes on, and a hostile pickle is not
    sealed. Nothing is written, nothing run."""
    ck = tmp_path / "ck"
    shutil.copytree(HOSTILE / "dcp_bytes_item_os_system", ck)
    before = tree_digests(ck)
    r = run_cli("seal", ck, cwd=tmp_path)
    assert_clean(r, 3, "dataloader.cursor's pickle refers to posix.system", "not sealed")
    assert tree_digests(ck) == before
    _no_marker(tmp_path)


def test_export_skips_the_bad_bytes_item_and_writes_the_tensors(tmp_path):
    out = tmp_path / "out.safetensors"
    r = run_cli("export", HOSTILE / "dcp_bytes_item_os_system", "-o", out, cwd=tmp_path)
    assert r.code == 0 and out.exists()
    _no_marker(tmp_path)


def test_missing_rank_file(tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / "dcp" / "fsdp2", ck)
    (ck / "__2_0.distcp").unlink()
    r = run_cli("inspect", ck)
    assert r.code == 3
    assert "__2_0.distcp: data file named by .metadata is missing" in r.stderr


def test_symlink_escaping_the_root_is_refused(tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / "dcp" / "fsdp2", ck)
    outside = tmp_path / "elsewhere.distcp"
    (ck / "__1_0.distcp").rename(outside)
    (ck / "__1_0.distcp").symlink_to(outside)
    r = run_cli("export", ck, "-o", tmp_path / "x.safetensors")
    assert r.code == 3 and "outside the checkpoint directory" in r.stderr
    assert not (tmp_path / "x.safetensors").exists()


def test_inputs_are_never_modified(tmp_path):
    for case in sorted(HOSTILE.iterdir()):
        before = tree_digests(case)
        run_cli("inspect", case, cwd=tmp_path)
        run_cli("export", case, "-o", tmp_path / f"{case.name}.safetensors", cwd=tmp_path)
        assert tree_digests(case) == before
    _no_marker(tmp_path)


LINKED = [
    ("deepspeed/zero1", "global_step3/zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    ("megatron/legacy_tp2pp2", "iter_0000003/mp_rank_01_001/model_optim_rng.pt"),
    ("megatron/legacy_tp2pp2", "iter_0000003/mp_rank_01_001"),  # a rank directory
    ("rankshards/ddp", "shard_00001_of_00002.pt"),
    ("deepspeed/universal", "global_step3_universal/zero/blocks.0.fc2.weight/exp_avg.pt"),
    ("deepspeed/zero1", "global_step3"),  # the tag folder `latest` names
    ("megatron/dist_tp2", "iter_0000003"),  # the iteration folder the tracker names
    # the trackers (read through the link, without a word: a torch_dist save directory, and a
    # universal checkpoint's latest_universal)
    ("megatron/dist_tp2", "latest_checkpointed_iteration.txt"),
    ("deepspeed/universal", "latest_universal"),
    ("deepspeed/zero1", "latest"),
]


@pytest.mark.parametrize(("fixture", "rel"), LINKED, ids=lambda v: v.replace("/", "-"))
def test_a_link_out_of_a_sealed_checkpoint_is_never_followed(fixture, rel, tmp_path):
    """A file (or rank directory) swapped after `seal` for a link to elsewhere: every command
    refuses it by name, sealed `verify` too (it read the data through the link and said OK)."""
    from ckpttool.seal import seal

    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / fixture, ck)
    assert (ck / rel).exists(), rel
    seal(ck)
    outside = tmp_path / "elsewhere"
    (ck / rel).rename(outside)
    (ck / rel).symlink_to(outside)
    # other bytes behind the link than the seal's: a verify that hashed through it would say so
    victim = outside if outside.is_file() else sorted(p for p in outside.rglob("*") if p.is_file())[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    before = tree_digests(outside)

    for command in (["inspect"], ["compress", "-o", tmp_path / "c.ckz"], ["diff", FIXTURES / fixture]):
        r = run_cli(command[0], ck, *command[1:], cwd=tmp_path)
        assert r.code == 3, (command, r.stderr)
        assert "Traceback" not in r.stderr
        assert "/".join(rel.split("/")[-2:]) in r.stderr and f"is a link to {outside}" in r.stderr
        assert "outside the checkpoint directory" in r.stderr
    assert not (tmp_path / "c.ckz").exists()

    r = run_cli("verify", ck, "--json", cwd=tmp_path)
    assert r.code == 1, r.stderr
    findings = json.loads(r.stdout)["findings"]
    assert {f["rule"] for f in findings if f["severity"] == "error"} == {"unsafe-path"}, findings
    assert any(f["file"].endswith(rel.split("/", 1)[-1]) for f in findings if f["rule"] == "unsafe-path")
    assert not [f for f in findings if f["rule"] in ("missing-file", "changed-file")]
    (ck / "ckpttool.manifest.json").unlink()  # and without the seal
    r = run_cli("verify", ck, "--json", cwd=tmp_path)
    assert r.code == 1, r.stderr
    assert {f["rule"] for f in json.loads(r.stdout)["findings"] if f["severity"] == "error"} == {"unsafe-path"}
    assert tree_digests(outside) == before


TWO_LINKED = [
    ("dcp/fsdp2", ["__1_0.distcp", "__3_0.distcp"]),
    ("safetensors/sharded", ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]),
    ("deepspeed/zero2", [f"global_step3/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]),
    ("megatron/legacy_tp2pp2", [f"iter_0000003/mp_rank_0{t}_001/model_optim_rng.pt" for t in (0, 1)]),
    ("megatron/legacy_tp2pp2", ["iter_0000003/mp_rank_00_000", "iter_0000003/mp_rank_01_001"]),
    ("megatron/dist_tp2", ["iter_0000003/__0_0.distcp", "iter_0000003/__1_1.distcp"]),
    ("rankshards/ddp", ["shard_00000_of_00002.pt", "shard_00001_of_00002.pt"]),
    # the tracker and a rank file (in different top folders; the tracker stopped detection itself)
    ("megatron/legacy_tp2pp2", ["latest_checkpointed_iteration.txt", "iter_0000003/mp_rank_01_001/model_optim_rng.pt"]),
    ("deepspeed/zero2", ["latest", "global_step3/zero_pp_rank_1_mp_rank_00_optim_states.pt"]),
]


@pytest.mark.parametrize(("fixture", "rels"), TWO_LINKED, ids=lambda v: v.replace("/", "-") if isinstance(v, str) else "")
def test_every_link_out_is_named_not_the_first(fixture, rels, tmp_path):
    """Two files (or rank folders) linked out of the checkpoint: the reader stopped at the first
    and named it alone, so a user fixed one link per run. verify reports each; the other
    commands name the rest after the first."""
    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / fixture, ck)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for i, rel in enumerate(rels):
        (ck / rel).rename(elsewhere / str(i))
        (ck / rel).symlink_to(elsewhere / str(i))
    r = run_cli("verify", ck, "--json", cwd=tmp_path)
    assert r.code == 1, r.stderr
    unsafe = sorted(f["file"] for f in json.loads(r.stdout)["findings"] if f["rule"] == "unsafe-path")
    assert unsafe == sorted(rels), unsafe
    r = run_cli("inspect", ck, cwd=tmp_path)
    assert r.code == 3 and "Traceback" not in r.stderr
    # (a torch_dist reader names its files from the iteration folder)
    assert all(rel.rsplit("/", 1)[-1] in r.stderr for rel in rels) and "1 more file likewise" in r.stderr, r.stderr


BESIDE_A_LINK = [
    ("dcp/fsdp2", "__0_0.distcp", "__2_0.distcp"),
    ("safetensors/sharded", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"),
    ("deepspeed/zero2", *(f"global_step3/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1))),
    ("megatron/legacy_tp2pp2", *(f"iter_0000003/mp_rank_0{t}_001/model_optim_rng.pt" for t in (0, 1))),
    ("megatron/legacy_tp2pp2", "iter_0000003/mp_rank_00_000", "iter_0000003/mp_rank_01_001/model_optim_rng.pt"),
    ("megatron/dist_tp2", "iter_0000003/__0_0.distcp", "iter_0000003/__1_1.distcp"),
]


@pytest.mark.parametrize(("fixture", "linked", "deleted"), BESIDE_A_LINK, ids=lambda v: v.replace("/", "-"))
def test_a_missing_file_beside_a_link_out_is_named_too(fixture, linked, deleted, tmp_path):
    """One rank file (or folder) linked out of the checkpoint and another deleted: verify named
    the link and stopped there, so the missing file came to light only once the link was mended.
    It names both; the link is not called missing, and nothing behind it is read."""
    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / fixture, ck)
    elsewhere = tmp_path / "elsewhere"
    (ck / linked).rename(elsewhere)
    (ck / linked).symlink_to(elsewhere)
    (ck / deleted).unlink()
    before = tree_digests(elsewhere)
    r = run_cli("verify", ck, "--json", cwd=tmp_path)
    assert r.code == 1, r.stderr
    found = [(f["rule"], f["file"]) for f in json.loads(r.stdout)["findings"] if f["severity"] == "error"]
    assert found == [("unsafe-path", linked), ("missing-file", deleted)], found
    assert tree_digests(elsewhere) == before
    r = run_cli("verify", ck, cwd=tmp_path)  # (the human report likewise)
    assert r.code == 1 and "2 errors" in r.stdout and deleted in r.stdout, r.stdout


@pytest.mark.parametrize(
    ("fixture", "linked"),
    [
        ("rankshards/tp_manual/step_00000003", "metadata.json"),
        ("safetensors/sharded", "model.safetensors.index.json"),
        ("dcp/fsdp2", ".metadata"),  # (verify's second look said "the save was interrupted" of it)
        ("megatron/dist_tp2/iter_0000003", "metadata.json"),
    ],
)
def test_metadata_linked_out_is_never_read(fixture, linked, tmp_path):
    """A checkpoint's metadata file swapped for a link to a file outside that says something else
    (a world size of 7777, an index of other shards): its words reached the report, read through
    the link (the safetensors index at once; rankshards' metadata.json when verify looked again
    past the link); the link is named, and nothing behind it is read."""
    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / fixture, ck)
    lure = tmp_path / "lure.json"
    lure.write_text(
        json.dumps({"world_size": 7777, "step": 7777, "weight_map": {"x": "LEAKED.safetensors"}, "sharded_backend": "x"})
    )
    (ck / linked).unlink()
    (ck / linked).symlink_to(lure)
    for command in (["verify", "--json"], ["inspect"]):
        r = run_cli(command[0], ck, *command[1:], cwd=tmp_path)
        assert r.code in (1, 3) and "Traceback" not in r.stderr, r.stderr
        assert "7777" not in r.stdout + r.stderr and "LEAKED" not in r.stdout + r.stderr, r.stdout + r.stderr
        assert f"'{linked}' is a link to {lure}" in r.stdout + r.stderr, (command, r.stdout, r.stderr)
    findings = json.loads(run_cli("verify", ck, "--json", cwd=tmp_path).stdout)["findings"]
    assert [(f["rule"], f["file"]) for f in findings] == [("unsafe-path", linked)], findings  # (nothing else said)


def test_a_link_that_stays_inside_the_checkpoint_is_read(tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / "rankshards" / "ddp", ck)
    (ck / "store").mkdir()
    (ck / "shard_00001_of_00002.pt").rename(ck / "store" / "s1.pt")
    (ck / "shard_00001_of_00002.pt").symlink_to("store/s1.pt")
    r = run_cli("diff", ck, FIXTURES / "rankshards" / "ddp", cwd=tmp_path)
    assert r.code == 0, r.stderr


def test_a_single_file_named_by_a_link_is_read_where_it_leads(tmp_path):
    """links/ckpt.pt -> ../data/x.pt: the user named the link, so the file behind it is the
    checkpoint (it was refused as a link out of links/); sealed beside the link, verified there."""
    (tmp_path / "data").mkdir()
    (tmp_path / "links").mkdir()
    shutil.copy(FIXTURES / "torch" / "train_state.pt", tmp_path / "data" / "x.pt")
    link = tmp_path / "links" / "ckpt.pt"
    link.symlink_to("../data/x.pt")
    assert run_cli("inspect", link, cwd=tmp_path).code == 0
    assert run_cli("seal", link, cwd=tmp_path).code == 0
    assert (tmp_path / "links" / "ckpt.pt.ckpttool.manifest.json").is_file()
    r = run_cli("verify", link, cwd=tmp_path)
    assert r.code == 0, r.stdout + r.stderr
    data = bytearray((tmp_path / "data" / "x.pt").read_bytes())
    data[-200] ^= 1
    (tmp_path / "data" / "x.pt").write_bytes(bytes(data))
    r = run_cli("verify", link, "--json", cwd=tmp_path)
    assert r.code == 1 and "checksum-mismatch" in {f["rule"] for f in json.loads(r.stdout)["findings"]}


def test_storage_entries_naming_files_outside_are_never_opened(tmp_path):
    """A DCP .metadata with extra storage entries (no item uses them) naming files outside the
    checkpoint by absolute path, and a data file longer than its records reach: the search for
    whose data that file holds compared it byte for byte with those outside files, opening them.
    Only files the listing holds are compared."""
    import pickle
    import sys

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from ckpttool.verify import verify

    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / "dcp" / "fsdp2", ck)
    md = pickle.loads((ck / ".metadata").read_bytes())
    size = (ck / "__0_0.distcp").stat().st_size
    outside = []
    for k in range(2):
        p = tmp_path / f"outside{k}.distcp"
        p.write_bytes((ck / "__0_0.distcp").read_bytes() + bytes(16))
        outside.append(str(p))
        # (a record said to start where the file's own end, and to end where the longer file does)
        md.storage_data[MetadataIndex(f"nobody.{k}")] = _StorageInfo(str(p), size, 16)
    (ck / ".metadata").write_bytes(pickle.dumps(md))
    with open(ck / "__0_0.distcp", "ab") as fh:
        fh.write(b"PK\x03\x04" + bytes(12))  # (what looks like a record there)
    opened: list[str] = []

    def hook(event: str, args: tuple) -> None:
        if event == "open" and args and str(args[0]) in outside and watching:
            opened.append(str(args[0]))

    watching = True
    sys.addaudithook(hook)
    try:
        report = verify(ck)
    finally:
        watching = False
    assert report.findings, report
    assert opened == [], opened


def _deep_key(levels: int) -> bytes:
    """A pickle of one dict whose key is a tuple nested ``levels`` deep (one byte a level)."""
    return b"\x80\x02}(" + b")" + b"\x85" * levels + b"K\x01u."


def test_a_pickle_nesting_a_key_deeper_than_the_stack_is_refused_not_a_crash(tmp_path):
    """300 KB of pickle nesting a dict key 300 000 tuples deep: the unpickler hashes the key in C,
    recursing through every level, and ran out of stack: a segmentation fault (exit 139), no
    message, no --junit report, in every command. Now read on a stack deep enough, then refused by
    the depth check as any other nesting too deep: exit 3, or verify's finding with its reports."""
    dcp = tmp_path / "dcp"
    shutil.copytree(FIXTURES / "dcp" / "fsdp2", dcp)
    (dcp / ".metadata").write_bytes(_deep_key(300_000))
    said = "DCP metadata pickle nests containers more than 200 levels deep"
    assert_clean(run_cli("inspect", dcp), 3, said)
    r = run_cli("verify", dcp, "--junit", tmp_path / "j.xml")  # (a finding on the damaged file: exit 1)
    assert r.code == 1 and said in r.stdout and not r.stderr, (r.code, r.stderr)
    assert said in (tmp_path / "j.xml").read_text()
    pt = _with_pickle(tmp_path / "deep.pt", _deep_key(300_000))
    assert_clean(run_cli("inspect", pt), 3, "nests containers more than 200 levels deep")


def _with_pickle(path, pkl: bytes, extra: dict[str, bytes] | None = None):
    """A torch.save file of one float32 tensor of 4 elements (storage ``0``) whose data.pkl is
    ``pkl``, with ``extra`` members written after torch's."""
    import io
    import zipfile

    import torch

    from tests._zips import replace_member

    buf = io.BytesIO()
    torch.save({"w": torch.arange(4, dtype=torch.float32)}, buf)
    path.write_bytes(replace_member(buf.getvalue(), "/data.pkl", lambda _: pkl))
    if extra:
        with zipfile.ZipFile(path) as z:
            top = z.namelist()[0].split("/")[0]
        with zipfile.ZipFile(path, "a") as z:
            for name, data in extra.items():
                z.writestr(f"{top}/{name}", data)
    return path


def _tensor_pickle(build: bytes = b"", storage_build: bytes = b"") -> bytes:
    """torch's pickle of {"w": tensor} by hand; ``build``: a BUILD's state applied to the tensor
    record after it is made, ``storage_build`` one applied to the storage record."""
    import struct

    def u(s: str) -> bytes:
        return b"X" + struct.pack("<I", len(s)) + s.encode()

    def g(m: str, n: str) -> bytes:
        return f"c{m}\n{n}\n".encode()

    def i8(n: int) -> bytes:
        return b"\x8a\x08" + n.to_bytes(8, "little", signed=True)

    storage = b"(" + u("storage") + g("torch", "FloatStorage") + u("0") + u("cpu") + i8(4) + b"tQ" + storage_build
    tensor = g("torch._utils", "_rebuild_tensor_v2") + b"(" + storage + i8(0) + b"(" + i8(4) + b"t(" + i8(1) + b"t\x89"
    tensor += g("collections", "OrderedDict") + b")RtR" + build
    return b"\x80\x02}(" + u("w") + tensor + b"u."


def test_a_tensors_fields_set_after_it_was_built_are_refused(tmp_path):
    """A BUILD after torch's _rebuild_tensor_v2 set the tensor's storage offset to -8 after its
    geometry was checked: verify --deep passed and export wrote the zip's own header bytes as the
    tensor's values (torch.load refuses the file). The same on the storage record. The first file
    is read as the plain pickle it stands for, to show the construction."""
    import struct

    plain = _with_pickle(tmp_path / "plain.pt", _tensor_pickle())
    assert run_cli("verify", plain, "--deep").code == 0
    offset = b"N}X\x0e\x00\x00\x00storage_offset\x8a\x08" + struct.pack("<q", -8) + b"s\x86b"
    numel = b"N}X\x05\x00\x00\x00numel\x8a\x08" + struct.pack("<q", 1 << 40) + b"s\x86b"
    for name, pkl in (("offset", _tensor_pickle(build=offset)), ("numel", _tensor_pickle(storage_build=numel))):
        pt = _with_pickle(tmp_path / f"{name}.pt", pkl)
        what = "tensor" if name == "offset" else "storage"
        for argv in (("inspect", pt), ("export", pt, "-o", tmp_path / f"{name}.safetensors")):
            assert_clean(run_cli(*argv), 3, f"a {what}'s fields set after it was built (BUILD)")
        assert not (tmp_path / f"{name}.safetensors").exists()


def test_a_zip_member_listed_twice_is_refused(tmp_path):
    """torch.load read the first archive/data/0 of a file that holds two, ckpttool the last: verify
    --deep passed, and export wrote values no load of the file gives."""
    import numpy as np

    second = (np.arange(4, dtype=np.float32) * 100).tobytes()
    pt = _with_pickle(tmp_path / "dup.pt", _tensor_pickle(), {"data/0": second})
    for argv in (("inspect", pt), ("export", pt, "-o", tmp_path / "e.safetensors")):
        r = run_cli(*argv)
        assert_clean(r, 3, "archive/data/0 is listed twice in the zip directory")
        assert "hint: torch.load reads one of the copies, and nothing says which was saved" in r.stderr
    assert not (tmp_path / "e.safetensors").exists()


def test_numpy_ndarray_called_from_a_pickle_is_refused(tmp_path):
    """numpy.ndarray was allowed as a global that could be called: ndarray((64,), 'u1') made an
    array of uninitialised memory, which convert wrote out (a heap pointer), and diff of a file
    against itself said "different". _reconstruct took any typecode, an object array's among them.
    A real numpy array (NumPy's RNG state) still reads, with its values."""
    import struct

    import numpy as np

    def u(s: str) -> bytes:
        return b"X" + struct.pack("<I", len(s)) + s.encode()

    called = b"\x80\x02}(" + u("rng_state") + b"cnumpy\nndarray\n((K@tX\x02\x00\x00\x00u1tR" + b"u."
    reconstruct = b"cnumpy.core.multiarray\n_reconstruct\n(cnumpy\nndarray\n(K\x00tC\x01OtR"
    objects = b"\x80\x02}(" + u("a") + reconstruct + b"u."
    for name, pkl, said in (("called", called, "numpy.ndarray(...) (an array of uninitialised memory)"),
                            ("objects", objects, "numpy.dtype('O') (not a plain numeric dtype)")):  # fmt: skip
        pt = _with_pickle(tmp_path / f"{name}.pt", pkl)
        assert_clean(run_cli("inspect", pt), 3, said)
    import torch

    torch.save({"w": torch.ones(2), "arr": np.arange(5, dtype=np.float32)}, tmp_path / "ok.pt")
    out = tmp_path / "out"
    assert run_cli("convert", tmp_path / "ok.pt", "--to", "torch", "-o", out).code == 0
    assert torch.load(out / "model.pt", weights_only=False)["arr"].tolist() == [0, 1, 2, 3, 4]


def test_a_broadcast_view_of_terabytes_is_named_not_an_out_of_memory_bug(tmp_path):
    """torch.save keeps torch.zeros(1).expand(2**40) lazy: 1.8 kB on disk, 4 TB of values. verify
    --deep, export, convert and diff made room for all of it and stopped on a MemoryError reported
    as "internal error ... a bug in ckpttool". Each now names the tensor and why it is not read;
    the other tensor of the file is still compared, and inspect, which reads no values, works."""
    import torch

    pt = tmp_path / "expand.pt"
    torch.save({"w": torch.zeros(1).expand(2**40), "v": torch.ones(3)}, pt)
    said = "w: tensor of 1,099,511,627,776 elements is a broadcast view of 1 stored ones; ckpttool does not expand it"
    assert run_cli("inspect", pt).code == 0
    r = run_cli("verify", pt, "--deep")
    assert r.code == 1 and said in r.stdout and "internal error" not in r.stdout + r.stderr, (r.stdout, r.stderr)
    for argv in (("export", pt, "-o", tmp_path / "e.safetensors"), *(("convert", pt, "--to", t, "-o", tmp_path / t)
                 for t in ("torch", "dcp", "safetensors"))):  # fmt: skip
        assert_clean(run_cli(*argv), 3, said + "; nothing was written")
    r = run_cli("diff", pt, pt)
    assert r.code == 3 and said in r.stdout and "compared 2 tensors: 1 identical" in r.stdout, r.stdout
    assert not [p for p in tmp_path.iterdir() if p.name != "expand.pt"]


def test_out_of_memory_is_the_machines_answer_not_a_bug(monkeypatch, capsys):
    """A MemoryError was reported as "internal error ... this is a bug in ckpttool"."""
    import typer

    from ckpttool import cli

    @cli._handles_errors
    def command() -> None:
        raise MemoryError("Unable to allocate 4.00 TiB")

    with pytest.raises(typer.Exit) as stop:
        command()
    err = capsys.readouterr().err
    assert stop.value.exit_code == 3 and "not enough memory: Unable to allocate 4.00 TiB" in err and "bug" not in err
