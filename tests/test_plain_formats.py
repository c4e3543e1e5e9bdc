"""safetensors files and sets, and single torch.save files, against their writers."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file

from ckpttool import registry
from ckpttool._torchzip import Archive
from ckpttool.errors import CorruptFileError, IncompleteCheckpointError
from ckpttool.export import export
from tests._compare import flatten_nested, tensor_mismatches
from tests.conftest import FIXTURES, assert_clean, run_cli

ST = FIXTURES / "safetensors"
PT = FIXTURES / "torch" / "train_state.pt"


def test_single_safetensors_file(tmp_path):
    _, m = registry.describe(ST / "model.safetensors")
    assert m.format == "safetensors"
    ref = load_file(ST / "model.safetensors")
    assert set(m.items) == set(ref)
    assert {i.dtype for i in m.items.values()} >= {"float32", "bfloat16", "float16", "int64", "bool"}
    export(ST / "model.safetensors", tmp_path / "o.safetensors")
    assert tensor_mismatches(load_file(tmp_path / "o.safetensors"), ref) == []


def test_sharded_set_with_index(tmp_path):
    _, m = registry.describe(ST / "sharded")
    assert {f.path for f in m.files if f.role == "data"} == {
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    export(ST / "sharded", tmp_path / "o.safetensors")
    ref = torch.load(ST / "sharded.reference.pt", weights_only=True)
    assert tensor_mismatches(load_file(tmp_path / "o.safetensors"), ref) == []


def test_missing_shard(tmp_path):
    shutil.copytree(ST / "sharded", tmp_path / "s")
    (tmp_path / "s" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(IncompleteCheckpointError, match="model-00002-of-00002.safetensors"):
        registry.describe(tmp_path / "s")


def test_every_missing_shard_is_named(tmp_path):
    """Both shards gone: verify names each (it stopped at the first), the CLI's error the other."""
    shutil.copytree(ST / "sharded", tmp_path / "s")
    for f in (tmp_path / "s").glob("*.safetensors"):
        f.unlink()
    r = run_cli("verify", tmp_path / "s", "--json")
    found = [(f["rule"], f["file"]) for f in json.loads(r.stdout)["findings"]]
    assert r.code == 1 and found == [
        ("missing-file", "model-00001-of-00002.safetensors"),
        ("missing-file", "model-00002-of-00002.safetensors"),
    ], found
    r = run_cli("inspect", tmp_path / "s")
    assert r.code == 3 and "(and 1 more file likewise: model-00002-of-00002.safetensors)" in r.stderr, r.stderr


@pytest.mark.parametrize(
    ("shard", "said"),
    [
        (".", "weight_map gives 'pos' the shard '.', not a file name"),  # was: "cannot complete: Is a directory"
        (None, "weight_map gives 'pos' the shard None, not a file name"),
        ("sub", "names 'sub' as the shard of pos, which is a directory, not a file"),
    ],
)
def test_an_index_naming_no_file_says_which_entry(shard, said, tmp_path):
    """An index whose weight_map gives a tensor no file name (or a folder) is refused naming the
    entry (it said "no weight_map of tensor name -> file" of an index that has one, or that the disk
    refused: "Is a directory")."""
    shutil.copytree(ST / "sharded", tmp_path / "s")
    (tmp_path / "s" / "sub").mkdir()
    index = tmp_path / "s" / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    assert "pos" in doc["weight_map"]
    doc["weight_map"]["pos"] = shard
    index.write_text(json.dumps(doc))
    r = run_cli("inspect", tmp_path / "s")
    assert r.code == 3 and f"error: model.safetensors.index.json: {said}\n" in r.stderr, r.stderr
    assert "restore the index from its source" in r.stderr


@pytest.mark.parametrize("first", ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"])
def test_an_index_naming_a_tensor_twice_is_corrupt(first, tmp_path):
    """An index giving one tensor two entries read as the last one (json keeps it without a word):
    verify exit 0, or the wrong shard named where the wrong entry came last."""
    shutil.copytree(ST / "sharded", tmp_path / "s")
    index = tmp_path / "s" / "model.safetensors.index.json"
    text = index.read_text()
    entry = next(ln for ln in text.splitlines() if ln.strip().startswith('"pos":'))
    index.write_text(text.replace(entry, f'    "pos": "{first}",\n{entry}', 1))
    said = "model.safetensors.index.json: not a readable JSON index (names 'pos' twice)"
    assert_clean(run_cli("inspect", tmp_path / "s"), 3, said, "restore the index from its source")
    r = run_cli("verify", tmp_path / "s", "--json")
    assert r.code == 1 and [f["rule"] for f in json.loads(r.stdout)["findings"]] == ["corrupt-file"], r.stdout
    assert run_cli("seal", tmp_path / "s").code == 3


def test_an_index_placing_no_tensor_is_corrupt_and_not_sealed(tmp_path):
    """An index whose weight_map is empty read as a checkpoint of 0 items: verify exit 0 and seal
    vouched for 0 pieces, while the shards beside it hold every tensor (a loader opens none)."""
    shutil.copytree(ST / "sharded", tmp_path / "s")
    index = tmp_path / "s" / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"] = {}
    index.write_text(json.dumps(doc))
    r = run_cli("verify", tmp_path / "s", "--json")
    found = [(f["rule"], f["severity"], f["file"]) for f in json.loads(r.stdout)["findings"]]
    assert r.code == 1 and found == [("corrupt-file", "error", "model.safetensors.index.json")], r.stdout
    assert "an empty weight_map, which places no tensor in any shard" in r.stdout
    assert_clean(run_cli("seal", tmp_path / "s"), 3, "empty weight_map")
    assert not (tmp_path / "s" / "ckpttool.manifest.json").exists()


def test_an_index_that_disagrees_with_its_shards_is_named_entry_by_entry(tmp_path):
    """A tensor the index leaves out ("which the index places in None") and one it places in a
    shard that lacks it (named as file '.', the checkpoint): each named, in the file at fault, in
    one report (it stopped at the first)."""
    shutil.copytree(ST / "sharded", tmp_path / "s")
    index = tmp_path / "s" / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    assert doc["weight_map"].pop("pos") == "model-00001-of-00002.safetensors"
    doc["weight_map"]["ghost.weight"] = "model-00002-of-00002.safetensors"
    index.write_text(json.dumps(doc))
    r = run_cli("verify", tmp_path / "s", "--json")
    found = [(f["rule"], f["file"], f["message"]) for f in json.loads(r.stdout)["findings"]]
    assert r.code == 1 and found == [
        (
            "corrupt-file",
            "model-00001-of-00002.safetensors",
            "model-00001-of-00002.safetensors: holds 1 tensor(s) model.safetensors.index.json does not place there: "
            "pos (not in the index)",
        ),
        (
            "corrupt-file",
            "model.safetensors.index.json",
            "model.safetensors.index.json: places 1 tensor(s) in shards that do not hold them: "
            "ghost.weight in model-00002-of-00002.safetensors",
        ),
    ], found


def _rewrite_header(path, edit):
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    edit(header)
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data[8 + n :])


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: p.write_bytes(p.read_bytes()[:-10]), "cut short"),
        (lambda p: p.write_bytes(struct.pack("<Q", 10**12) + p.read_bytes()[8:]), "header length field"),
        (lambda p: p.write_bytes(b"\x05\0\0\0\0\0\0\0{bad}"), "not valid JSON"),
        (lambda p: _rewrite_header(p, lambda h: h[next(k for k in h if k != "__metadata__")].update(
            dtype="Q9")), "unknown dtype"),
        (lambda p: _rewrite_header(p, lambda h: h[next(k for k in h if k != "__metadata__")].update(
            shape=[10**9, 10**9])), "data_offsets span"),
    ],
)
def test_safetensors_header_validation(tmp_path, damage, message):
    p = tmp_path / "m.safetensors"
    shutil.copy(ST / "model.safetensors", p)
    damage(p)
    with pytest.raises(CorruptFileError, match=message):
        registry.describe(p)
    r = run_cli("inspect", p)
    assert r.code == 3 and message in r.stderr and "Traceback" not in r.stderr


def test_torch_save_nested_dict(tmp_path):
    _, m = registry.describe(PT)
    assert m.format == "torch"
    ref = flatten_nested(torch.load(PT, weights_only=True))
    assert set(m.items) == set(ref)
    assert m.step == ref["step"]
    assert m.missing_state() == ["dataloader"]  # the nanoGPT-style file keeps no loader cursor
    export(PT, tmp_path / "o.safetensors")
    got = load_file(tmp_path / "o.safetensors")
    # strided views and storage-sharing tensors come out as their own values
    assert tensor_mismatches(got, ref) == []
    strided = [i for i in m.items.values() if i.is_tensor and i.pieces[0].locator["stride"][-1:] not in ([], [1])]
    assert strided, "fixture should hold a non-contiguous tensor"


def test_torch_save_of_a_list_or_tuple_at_the_top_is_walked(tmp_path):
    """A file holding a tuple or list of tensors at its top was one object item "value": its
    tensors hidden from ls, and export found "nothing to write"; under a key it was walked."""
    cases = {
        "tuple.pt": (torch.ones(2), torch.zeros(3)),
        "list.pt": [torch.ones(2), {"a": torch.arange(3), "n": 5}],
        "plain.pt": [1, 2, 3],
    }
    for name, obj in cases.items():
        torch.save(obj, tmp_path / name)
    _, m = registry.describe(tmp_path / "tuple.pt")
    assert sorted(m.items) == ["0", "1"] and all(i.is_tensor for i in m.items.values())
    _, m = registry.describe(tmp_path / "list.pt")
    assert sorted(m.items) == ["0", "1.a", "1.n"] and m.items["1.n"].value == 5
    _, m = registry.describe(tmp_path / "plain.pt")
    assert sorted(m.items) == ["value"]  # (plain data stays one value)
    export(tmp_path / "list.pt", tmp_path / "o.safetensors")
    got = load_file(tmp_path / "o.safetensors")
    assert tensor_mismatches(got, {"0": torch.ones(2), "1.a": torch.arange(3)}) == []


def test_torch_save_hostile_global(tmp_path):
    import os
    import pickle

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch CKPTTOOL_PWNED",))

    p = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "x": Evil()}, p, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    r = run_cli("inspect", p, cwd=tmp_path)
    assert r.code == 3 and "posix.system" in r.stderr
    assert not (tmp_path / "CKPTTOOL_PWNED").exists()


def test_torch_save_with_numpy_rng_state(tmp_path):
    """A training loop's RNG file (Hugging Face's rng_state.pth: Python's, numpy's and torch's RNG
    states) is read and verifies clean: numpy's state is a plain uint32 array. An object array
    (whose elements would be arbitrary pickles) is still refused, and nothing it names runs."""
    import random

    import numpy as np

    np.random.seed(7)
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    torch.save(state, tmp_path / "rng_state.pth")
    r = run_cli("verify", tmp_path / "rng_state.pth", "--json")
    assert r.code == 0 and not [f for f in json.loads(r.stdout)["findings"] if f["severity"] == "error"], r.stdout
    adapter, m = registry.describe(tmp_path / "rng_state.pth")
    with adapter.reader(m) as reader:
        got = reader.read_object(m.items["numpy"])
    want = state["numpy"]
    assert got[0] == "MT19937" and got[2:] == want[2:] and got[1].tobytes() == want[1].tobytes()
    torch.save({"w": torch.ones(2), "x": np.array([1, "a"], dtype=object)}, tmp_path / "objects.pt")
    r = run_cli("inspect", tmp_path / "objects.pt")
    assert r.code == 3 and "not a plain numeric dtype" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("verify", tmp_path / "objects.pt", "--json")  # reported as what it is: an unsafe pickle
    rules = {f["rule"] for f in json.loads(r.stdout)["findings"] if f["severity"] == "error"}
    assert r.code == 1 and rules == {"unsafe-pickle"}, r.stdout


def test_truncated_torch_save(tmp_path):
    """A torch.save file cut short is said to be (it was "not a readable torch.save archive
    (BadZipFile: File is not a zip file)"): verify's truncated-file, not corrupt-file. One damaged
    elsewhere (its end record overwritten) is still corrupt."""
    p = tmp_path / "t.pt"
    p.write_bytes(PT.read_bytes()[: PT.stat().st_size // 2])
    r = run_cli("inspect", p)
    assert r.code == 3 and "t.pt" in r.stderr and "Traceback" not in r.stderr
    assert "t.pt: cut short: its 39,159 bytes start as a torch.save archive but end before" in r.stderr, r.stderr
    r = run_cli("verify", p, "--json")
    assert r.code == 1 and [(f["rule"], f["file"]) for f in json.loads(r.stdout)["findings"]] == [
        ("truncated-file", "t.pt")
    ]
    data = bytearray(PT.read_bytes())
    end = data.rfind(b"PK\x05\x06")
    data[end + 16 : end + 20] = b"\xff\xff\xff\x7f"  # its central directory's offset
    tail = bytearray(PT.read_bytes())
    tail[-200:] = bytes(200)  # its end records zeroed in place
    for damaged in (data, PT.read_bytes() + bytes(70_000), tail):  # (the second: 70 kB appended)
        p.write_bytes(bytes(damaged))
        r = run_cli("verify", p, "--json")
        assert r.code == 1 and [f["rule"] for f in json.loads(r.stdout)["findings"]] == ["corrupt-file"], r.stdout
    for size in range(40, PT.stat().st_size, 997):  # cut anywhere past its first header: cut short
        with pytest.raises(CorruptFileError, match="cut short") as cut:
            Archive(PT.read_bytes()[:size], display="t.pt").load()
        assert cut.value.rule == "truncated-file"


def test_one_rank_file_of_a_framework_checkpoint_is_pointed_to_its_checkpoint():
    """A Megatron or DeepSpeed rank file given alone was read as a plain torch.save file and its
    framework's classes (argparse.Namespace, DeepSpeed's LossScaler) reported as a pickle that "may
    be hostile": the checkpoint it is part of is named instead."""
    cases = [
        ("megatron/legacy_tp2pp2/iter_0000003/mp_rank_00_000/model_optim_rng.pt", "megatron", 2),
        ("deepspeed/zero2/global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt", "deepspeed", 1),
        ("megatron/dist_tp2/iter_0000003/common.pt", "megatron-dist", 1),
    ]
    for rel, fmt, up in cases:
        path = FIXTURES / rel
        folder = path.parents[up - 1]
        for command in ("inspect", "verify"):
            r = run_cli(command, path)
            assert r.code == 3 and "Traceback" not in r.stderr, (rel, r.stderr)
            assert f"error: {path}: one file of the {fmt} checkpoint {folder}: give that" in r.stderr, r.stderr
            assert f"hint: give the checkpoint it is part of: {folder}" in r.stderr, r.stderr
            assert "may be hostile" not in r.stderr and "not a checkpoint format" not in r.stderr
    # a file that reads alone is still read so (DeepSpeed's module states)
    assert run_cli("inspect", FIXTURES / "deepspeed/zero2/global_step3/mp_rank_00_model_states.pt").code == 0


@pytest.mark.parametrize(
    ("rel", "fmt", "folder"),
    [
        ("deepspeed/zero2/global_step3/mp_rank_00_model_states.pt", "deepspeed", "deepspeed/zero2/global_step3"),
        ("rankshards/ddp/shard_00000_of_00002.pt", "rankshards", "rankshards/ddp"),
        ("rankshards/pipeline/checkpoint_step3_stage1.pt", "rankshards", "rankshards/pipeline"),
        ("rankshards/tp_manual/step_00000003/shard_00001.pt", "rankshards", "rankshards/tp_manual/step_00000003"),
    ],
)
def test_one_rank_file_given_alone_is_said_to_be_one(rel, fmt, folder):
    """One rank's file of a checkpoint, read as a plain torch.save file, verified clean (exit 0 with
    --fail-on warning): a CI gate pointed at the wrong path passed a checkpoint it never saw."""
    from tests.conftest import FIXTURES, run_cli

    r = run_cli("verify", FIXTURES / rel, "--json", "--fail-on", "warning")
    assert r.code == 1, r.stderr
    found = [f for f in json.loads(r.stdout)["findings"] if f["rule"] == "missing-file"]
    assert [(f["severity"], f["file"]) for f in found] == [("warning", rel.rsplit("/", 1)[1])], found
    assert f"one file of the {fmt} checkpoint {FIXTURES / folder}, checked alone" in found[0]["message"]
    assert found[0]["hint"] == f"verify the checkpoint itself: ckpttool verify {FIXTURES / folder}"
    plain = run_cli("verify", FIXTURES / "torch" / "train_state.pt", "--json")
    assert plain.code == 0 and not [f for f in json.loads(plain.stdout)["findings"] if f["rule"] == "missing-file"]


def test_a_model_file_beside_its_variant_is_a_folder_of_two_models(tmp_path):
    """model.safetensors beside model.fp16.safetensors (a Hugging Face variant: the same tensors in
    another dtype, loaded with variant="fp16") read as two shards of one model and failed verify
    with "tensor seen_tokens is also in another shard" (exit 1), naming neither file. The folder is
    said to hold two models (exit 3), each of which verifies; two unindexed files that do hold the
    same tensor name the other file."""
    from safetensors.torch import save_file

    folder = tmp_path / "m"
    folder.mkdir()
    shutil.copy2(FIXTURES / "safetensors" / "model.safetensors", folder)
    tensors = load_file(folder / "model.safetensors")
    save_file({k: v.half() if v.is_floating_point() else v for k, v in tensors.items()}, folder / "model.fp16.safetensors")
    r = run_cli("verify", folder)
    assert_clean(r, 3, "a folder of 2 safetensors models", "model.safetensors, model.fp16.safetensors")
    for name in ("model.safetensors", "model.fp16.safetensors"):
        assert run_cli("verify", folder / name).code == 0
    (folder / "model.fp16.safetensors").rename(folder / "other.safetensors")
    r = run_cli("verify", folder, "--json")
    said = json.loads(r.stdout)["findings"]
    assert r.code == 1 and [(f["rule"], f["file"]) for f in said] == [("corrupt-file", "other.safetensors")], said
    assert "is also in model.safetensors" in said[0]["message"], said


def test_two_entries_of_one_name_are_said_with_their_file(tmp_path):
    """A torch.save dict holding both 'a.b' and {'a': {'b': ...}} (legal in torch) was refused with
    no file named: verify's finding had "file": null, and inspect's message named no file."""
    import json

    import torch

    from tests.conftest import assert_clean, run_cli

    torch.save({"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}}, tmp_path / "coll.pt")
    assert_clean(run_cli("inspect", tmp_path / "coll.pt"), 3, "coll.pt: two entries of the checkpoint are both named 'a.b'")
    r = run_cli("verify", tmp_path / "coll.pt", "--json")
    assert [(f["rule"], f["file"]) for f in json.loads(r.stdout)["findings"]] == [("corrupt-file", "coll.pt")]


def test_a_header_entry_with_a_field_more_reads_as_safetensors_reads_it(tmp_path):
    """A safetensors entry with a field beside dtype, shape and data_offsets (safetensors' own
    loader ignores it) was a corrupt-file error, and export refused the file. It reads now; an
    entry lacking one of the three is still refused."""
    import json
    import struct

    from safetensors.torch import load_file

    from tests.conftest import assert_clean, run_cli

    def write(path, entry):
        head = json.dumps({"w": entry}).encode()
        head += b" " * (-len(head) % 8)
        path.write_bytes(struct.pack("<Q", len(head)) + head + struct.pack("<2f", 1.5, 2.5))

    write(tmp_path / "extra.safetensors", {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "extra": 1})
    assert load_file(tmp_path / "extra.safetensors")["w"].tolist() == [1.5, 2.5]
    assert run_cli("verify", tmp_path / "extra.safetensors").code == 0
    assert run_cli("export", tmp_path / "extra.safetensors", "-o", tmp_path / "o.safetensors").code == 0
    assert load_file(tmp_path / "o.safetensors")["w"].tolist() == [1.5, 2.5]
    write(tmp_path / "lacking.safetensors", {"dtype": "F32", "shape": [2]})
    assert_clean(run_cli("inspect", tmp_path / "lacking.safetensors"), 3, "is not {dtype, shape, data_offsets}")
