"""diff across formats and layouts."""

from __future__ import annotations

import json
import math
import shutil
import struct
import warnings

import pytest

from ckpttool import registry
from ckpttool.diff import diff
from ckpttool.export import export
from tests.conftest import FIXTURES, assert_clean, restamp_crcs, rewritten_copy, run_cli

FSDP2 = FIXTURES / "dcp" / "fsdp2"


def test_itself_and_its_export(tmp_path):
    """An export keeps every tensor bit for bit and none of the training state a safetensors file
    cannot hold: the tensors compare identical, and the step, dataloader and scheduler state it
    lost are said ("equal" hid them)."""
    assert not diff(FSDP2, FSDP2).different
    out = tmp_path / "e.safetensors"
    export(FSDP2, out)
    report = diff(FSDP2, out)
    assert report.identical == report.compared == 54 and not report.values and not report.added
    _, m = registry.describe(FSDP2)
    kinds = {"counter", "dataloader", "scheduler", "rng", "optim"}
    assert report.removed and {m.items[k].kind for k in report.removed} == kinds
    assert "step" in report.removed and "dataloader.seed" in report.removed
    # (the file keeps torch's RNG states and Adam's moments, as tensors, but not Python's RNG state
    # or the param groups' hyperparameters: those went unsaid because the kinds were held)
    assert "rng.rank0.python" in report.removed and "optim.param_groups.0.lr" in report.removed
    assert not [k for k in report.removed if m.items[k].is_tensor]
    r = run_cli("diff", FSDP2, out)
    assert r.code == 1 and "only in A" in r.stdout, r.stdout


def test_a_non_tensor_value_on_one_side_only_is_a_difference(tmp_path):
    """A dataloader cursor, a scheduler or a step that one checkpoint has and the other lacks made
    no difference to diff ("equal", exit 0): only tensors were counted as added or removed."""
    import torch
    import torch.distributed.checkpoint as dcp

    a, b = tmp_path / "a", tmp_path / "b"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (no process group: a single-process save)
        dcp.save({"w": torch.ones(4), "step": 3, "dataloader": {"cursor": 96, "epoch": 0}}, checkpoint_id=a, no_dist=True)
        dcp.save({"w": torch.ones(4), "step": 3, "dataloader": {"epoch": 0}}, checkpoint_id=b, no_dist=True)
    report = diff(a, b)
    assert report.different and report.removed == ["dataloader.cursor"] and report.added == []
    assert diff(b, a).added == ["dataloader.cursor"]
    assert run_cli("diff", a, b).code == 1


def _perturbed(tmp_path):
    """A copy of FSDP2 whose blocks.0.fc2.weight holds 123.0 at [row, 5] of its third piece (the CRCs
    stored again: another save's values, not damage): the copy, its adapter, manifest and item."""
    copy = tmp_path / "ck"
    shutil.copytree(FSDP2, copy)
    adapter, m = registry.describe(copy)
    item = m.items["model.blocks.0.fc2.weight"]
    with adapter.reader(m) as reader:
        off, _ = reader.raw_span(item.pieces[2], item)
    with open(copy / item.pieces[2].file, "r+b") as fh:
        fh.seek(off + 4 * 5)
        fh.write(struct.pack("<f", 123.0))
    restamp_crcs(copy / item.pieces[2].file, item.pieces[2].locator["offset"], item.pieces[2].locator["length"])
    return copy, adapter, m, item


def test_one_perturbed_tensor_is_first_and_largest(tmp_path):
    copy, adapter, m, item = _perturbed(tmp_path)
    report = diff(FSDP2, copy)
    assert report.different
    assert report.first.name == report.largest.name == "blocks.0.fc2.weight"
    assert report.values[0].differing == 1
    row = item.pieces[2].box.offsets[0]
    assert report.values[0].first_index == [row, 5]  # the global index, from the piece's region
    r = run_cli("diff", FSDP2, copy, "--json")
    data = json.loads(r.stdout)
    assert r.code == 1 and data["first_divergence"] == data["largest_divergence"] == "blocks.0.fc2.weight"
    loose = run_cli("diff", FSDP2, copy, "--atol", "1000")
    assert loose.code == 0


def test_each_piece_is_read_once_a_side_and_the_distance_counts_equal_pieces(tmp_path, monkeypatch):
    """Without a seal, every tensor was read and hashed to see whether it was equal, then read again
    to compare it where it was not: every byte of two consecutive steps twice. Each piece is now
    read once a side; a tensor equal but for one piece reads its equal pieces' B side again for its
    relative L2 distance, which is over the whole tensor as before (checked against numpy)."""
    import numpy as np
    import torch

    copy, adapter, m, item = _perturbed(tmp_path)
    reads: dict[tuple[str, int, str], int] = {}
    cls = type(adapter.reader(m))
    plain = cls.read

    def counted(self, piece, it, out=None):
        key = (str(self.manifest.root), id(piece), it.name)
        reads[key] = reads.get(key, 0) + 1
        return plain(self, piece, it, out=out)

    monkeypatch.setattr(cls, "read", counted)
    report = diff(FSDP2, copy)
    assert report.values[0].name == "blocks.0.fc2.weight" and report.identical == report.compared - 1
    again = {k: n for k, n in reads.items() if n > 1}
    # only B's pieces of the one tensor that differs, read again for |B|: its 3 equal pieces
    assert len(again) == 3 and all(k[0] == str(copy) and k[2] == item.name and n == 2 for k, n in again.items()), again
    assert max(reads.values()) == 2
    with adapter.reader(m) as reader:
        from ckpttool.assemble import assemble

        b = assemble(reader, item).astype(np.float64)
    _, m0 = registry.describe(FSDP2)
    with adapter.reader(m0) as reader:
        a = assemble(reader, m0.items[item.name]).astype(np.float64)
    assert report.values[0].rel_l2 == pytest.approx(np.linalg.norm(a - b) / np.linalg.norm(b), rel=1e-12)
    assert torch.equal(torch.from_numpy(a).ne(torch.from_numpy(b)).sum(), torch.tensor(1))


def test_megatron_tp2pp2_legacy_against_torch_dist_same_state():
    # the two fixtures were saved from the same live model: different formats, same tensors
    report = diff(FIXTURES / "megatron" / "legacy_tp2pp2", FIXTURES / "megatron" / "dist_tp2pp2",
                  pattern=r"^(embedding|decoder|output_layer)\.")
    assert report.compared == 108 and not report.different, report.to_json()


def test_different_layouts_of_one_model(tmp_path):
    # FSDP2 (Shard(0)) and the rank-local save of the same state: pieces differ, values do not
    report = diff(FSDP2, FIXTURES / "dcp" / "fsdp2_ranklocal")
    assert not report.different


def test_map_renames(tmp_path):
    out = tmp_path / "e.safetensors"
    export(FSDP2, out, pattern=r"^model\.")
    renamed = tmp_path / "r.safetensors"
    from safetensors.torch import load_file, save_file

    save_file({k.replace("blocks.0.", "layers.0."): v for k, v in load_file(out).items()}, renamed)
    assert diff(out, renamed).different
    mapping = tmp_path / "map.txt"
    mapping.write_text("blocks\\.0\\.(.*)=layers.0.\\1\n")
    assert not diff(out, renamed, renames={"blocks\\.0\\.(.*)": "layers.0.\\1"}).different
    assert run_cli("diff", out, renamed, "--map", mapping).code == 0


def test_a_tensor_kept_inside_an_object_on_one_side_is_compared(tmp_path):
    """megatron-core's grad scaler is one ShardedObject in torch_dist; written as torch.save its
    scale is a tensor of its own. diff finds that tensor inside the other side's object and compares
    it, both ways: equal as converted, a value difference (with its figures and the tolerances) once
    the scale changes."""
    import torch

    src = FIXTURES / "megatron" / "dist_dp2_fp16_distopt"
    out = tmp_path / "out"
    assert run_cli("convert", src, "-o", out, "--to", "torch").code == 0
    key = "optimizer.distributed.dp_group_idx_0.grad_scaler/shard_0_1.0.scale"
    for a, b in ((src, out / "model.pt"), (out / "model.pt", src)):
        report = diff(a, b)
        assert not report.different and key not in report.added + report.removed, report.to_json()
    tree = torch.load(out / "model.pt", weights_only=False)
    scaler = tree[key.removesuffix(".0.scale")]  # a flat file: [{"scale": tensor, ...}] under the record's key
    scale = float(scaler[0]["scale"])
    scaler[0]["scale"] = scaler[0]["scale"] * 2
    torch.save(tree, tmp_path / "changed.pt")
    for a, b, rel_l2 in ((src, tmp_path / "changed.pt", 0.5), (tmp_path / "changed.pt", src, 1.0)):
        report = diff(a, b)  # strict: found, compared, named among the values that differ
        assert report.different and not report.added and not report.removed, report.to_json()
        [d] = [v for v in report.values if v.name == key]
        assert (d.differing, d.numel, d.max_abs, d.within_tolerance) == (1, 1, scale, False)
        assert d.rel_l2 == rel_l2  # |a - b| / |b|
        # the tolerances apply as to any tensor: |a - b| = scale is within rtol 1 of either side
        assert not diff(a, b, atol=0.0, rtol=1.0).different


def test_a_value_become_nan_is_the_largest_difference_not_zero(tmp_path):
    """One element turned NaN: max abs was reported 0 (nanmax skipped it), so the tensor ranked
    below any finite change and looked equal by its figures."""
    copy = tmp_path / "ck"
    shutil.copytree(FSDP2, copy)
    adapter, m = registry.describe(copy)
    for name, value in (("model.blocks.0.fc2.weight", float("nan")), ("model.blocks.0.fc1.weight", 123.0)):
        item = m.items[name]
        with adapter.reader(m) as reader:
            off, _ = reader.raw_span(item.pieces[0], item)
        with open(copy / item.pieces[0].file, "r+b") as fh:
            fh.seek(off)
            fh.write(struct.pack("<f", value))
        restamp_crcs(copy / item.pieces[0].file, item.pieces[0].locator["offset"], item.pieces[0].locator["length"])
    report = diff(FSDP2, copy, atol=1e9)
    by_name = {v.name: v for v in report.values}
    assert by_name["blocks.0.fc2.weight"].max_abs == float("inf")
    assert not by_name["blocks.0.fc2.weight"].within_tolerance
    assert by_name["blocks.0.fc1.weight"].within_tolerance
    assert report.largest.name == "blocks.0.fc2.weight"
    r = run_cli("diff", FSDP2, copy, "--json")
    assert r.code == 1
    assert {v["name"]: v for v in json.loads(r.stdout)["values"]}["blocks.0.fc2.weight"]["max_abs_diff"] == "inf"


def test_a_value_become_infinite_is_never_within_a_relative_tolerance(tmp_path):
    """finite -> inf and inf -> -inf were "within tolerance" under any rtol > 0 (inf <= atol +
    rtol * inf), exit 0, with rel L2 nan; an infinity is close only to itself, as in numpy.isclose."""
    import torch
    from safetensors.torch import save_file

    inf = float("inf")
    for name, w, x in (("a", [1.0, 2.0, 3.0], [1.0, inf]), ("b", [1.0, inf, 3.0], [1.0, -inf]), ("c", [1.0, 2.0, 3.0], [1.0, inf])):
        (tmp_path / name).mkdir()
        save_file({"w": torch.tensor(w), "x": torch.tensor(x)}, tmp_path / name / "model.safetensors")
    for a, b in (("a", "b"), ("b", "a")):
        report = diff(tmp_path / a, tmp_path / b, atol=1e-8, rtol=1e-5)
        assert report.different, a
        assert all(not v.within_tolerance and v.rel_l2 == inf for v in report.values), report.to_json()
    r = run_cli("diff", tmp_path / "a", tmp_path / "b", "--tolerance", "relaxed")
    assert r.code == 1 and "different" in r.stdout and "nan" not in r.stdout, r.stdout
    assert not diff(tmp_path / "a", tmp_path / "c", atol=1e-8, rtol=1e-5).different  # (the same inf is the same)


def test_a_map_that_is_no_regular_expression_is_a_usage_error(tmp_path):
    """A --map pattern that does not compile, or a replacement naming a group the pattern lacks,
    was an "internal error" (exit 3), where a bad --filter is exit 2."""
    for name, text, says in (
        ("set.json", '{"[": "x"}', "'[' is not a regular expression"),
        ("group.json", '{"(.*)": "\\\\9"}', "invalid group reference 9"),
        ("lines.txt", "a(b=c\n", "'a(b' is not a regular expression"),
    ):
        (tmp_path / name).write_text(text)
        r = run_cli("diff", FSDP2, FSDP2, "--map", tmp_path / name)
        assert r.code == 2 and says in r.stderr and "internal error" not in r.stderr, (name, r.stderr)
    (tmp_path / "ok.json").write_text('{"(.*)": "\\\\1"}')
    assert run_cli("diff", FSDP2, FSDP2, "--map", tmp_path / "ok.json").code == 0


def test_megatron_state_kept_in_pickles_is_compared_or_said_not_to_be(tmp_path):
    """Two Megatron checkpoints whose data position differed said "equal", exit 0: it is no item.
    The optimizer state kept in the rank files' pickles (param groups, Adam's steps) is not read,
    and the report now says so instead of letting "equal" cover it."""
    src = FIXTURES / "megatron" / "legacy_tp2pp2"
    b = rewritten_copy(tmp_path / "b", src, lambda t: setattr(t["args"], "consumed_train_samples", 99999))
    report = diff(src, b)
    assert report.different and [o["name"] for o in report.objects] == ["args.consumed_train_samples"], report.to_json()
    assert run_cli("diff", src, b).code == 1
    same = diff(src, src)
    assert not same.different
    assert len(same.not_compared) == 2 and "Adam's step" in same.not_compared[0], same.not_compared
    r = run_cli("diff", src, src)
    assert r.code == 0 and "not compared: Adam's step" in r.stdout, r.stdout
    # --filter selects items by name: a data position or optimizer pickles it does not name are not
    # its business (only layers.3 asked for, all equal: it said "different", exit 1)
    chosen = diff(src, b, pattern=r"layers\.3\.")
    assert chosen.compared and not chosen.different, chosen.to_json()
    assert diff(src, b, pattern=r"layers\.3\..*weight$").not_compared == []  # (no optimizer state chosen)
    assert diff(src, b, pattern="layers|consumed").objects  # (named: compared)


def test_filter_leaves_out_the_training_state_files_it_does_not_name():
    """A Hugging Face Trainer folder against its model file, --filter wte: one identical tensor, yet
    "only in A: optimizer.pt …, rng_state.pth …, scheduler.pt …" and exit 1."""
    folder = FIXTURES / "hf" / "trainer" / "checkpoint-3"
    report = diff(folder, folder / "model.safetensors", pattern="wte")
    assert report.compared == 1 and not report.different, report.to_json()
    report = diff(folder, folder / "model.safetensors", pattern="wte|optimizer")
    assert [r.split(" ")[0] for r in report.removed] == ["optimizer.pt"], report.to_json()


def test_a_tensor_on_one_side_and_a_number_on_the_other_is_compared(tmp_path):
    """An item that was a tensor on one side and a plain value on the other was skipped: a step
    tensor(3) against 999 and a learning rate 0.1 against tensor([0.5, 0.7]) diffed "equal", exit 0.
    (Adam's step is a tensor in current torch, a number in older torch.)"""
    import torch

    torch.save({"w": torch.ones(2), "step": torch.tensor(3), "lr": 0.1}, tmp_path / "a.pt")
    torch.save({"w": torch.ones(2), "step": 999, "lr": torch.tensor([0.5, 0.7])}, tmp_path / "b.pt")
    torch.save({"w": torch.ones(2), "step": 3, "lr": 0.1}, tmp_path / "c.pt")
    report = diff(tmp_path / "a.pt", tmp_path / "b.pt")
    assert report.different
    assert {o["name"]: (o["a"], o["b"]) for o in report.objects} == {
        "step": ("tensor int64[] 3.0", 999),
        "lr": (0.1, "tensor float32[2]"),
    }, report.objects
    r = run_cli("diff", tmp_path / "a.pt", tmp_path / "b.pt")
    assert r.code == 1 and "value: step: 'tensor int64[] 3.0' -> 999" in r.stdout, r.stdout
    same = diff(tmp_path / "a.pt", tmp_path / "c.pt")  # the same step, kept as a tensor and as a number
    assert not same.different and same.identical == same.compared == 2, same.to_json()
    assert same.notes == ["step: a tensor on A, a number on the other side; both 3"], same.notes


def test_two_large_values_that_differ_in_the_middle_show_two_digests(tmp_path):
    """Two NumPy arrays of 2,000 values that differ in one were shown with one digest on both sides
    ("ndarray (sha256 c780…)" -> the same): it was taken of the value's repr, which leaves out all
    but an array's ends past 1,000 elements."""
    import numpy as np
    import torch
    import torch.distributed.checkpoint as dcp

    values = [np.arange(2000.0), np.arange(2000.0)]
    values[1][1000] = -1.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, v in zip("ab", values, strict=True):
            dcp.save({"w": torch.ones(2), "np": (v, 5)}, checkpoint_id=tmp_path / name, no_dist=True)
    report = diff(tmp_path / "a", tmp_path / "b")
    [shown] = report.objects
    assert shown["name"] == "np" and shown["a"] != shown["b"], shown


def test_values_that_are_not_plain_data_are_compared_or_said_not_to_be(tmp_path):
    """NumPy's RNG state, a set, a complex number, a bytearray and an io.BytesIO that differed
    diffed "equal", exit 0, in DCP and torch.save alike: values that were not plain data were
    skipped without a word. They are compared now; a tensor inside a tuple (one DCP pickle) is said
    not to be. The io.BytesIO value also made a DCP checkpoint "may be hostile" to seal, verify
    and convert (DCP saves it as a state-dict value of its own)."""
    import io

    import numpy as np
    import torch
    import torch.distributed.checkpoint as dcp

    np.random.seed(0)
    first = np.random.get_state()
    np.random.seed(1)
    states = [
        {"w": torch.ones(2), "extra": io.BytesIO(b"aaa"), "np": first, "s": {1, 2}, "c": 1 + 2j, "ba": bytearray(b"x"),
         "tup": (torch.ones(2), 5)},
        {"w": torch.ones(2), "extra": io.BytesIO(b"bbb"), "np": np.random.get_state(), "s": {1, 3}, "c": 1 + 3j,
         "ba": bytearray(b"y"), "tup": (torch.zeros(2), 5)},
    ]  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, state in zip("ab", states, strict=True):
            dcp.save(state, checkpoint_id=tmp_path / f"d{name}", no_dist=True)
    changed = ["extra", "np", "s", "c", "ba", "tup"]  # (the tuple's tensor read from its record and compared)
    report = diff(tmp_path / "da", tmp_path / "db")
    assert report.different and [o["name"] for o in report.objects] == changed, report.to_json()
    assert report.not_compared == []
    same = diff(tmp_path / "da", tmp_path / "da")
    assert not same.different and not same.objects
    for args in (("seal", tmp_path / "da"), ("verify", tmp_path / "da")):
        r = run_cli(*args)
        assert r.code == 0, r.stdout + r.stderr
    r = run_cli("convert", tmp_path / "da", "-o", tmp_path / "t", "--to", "torch")
    assert r.code == 0, r.stderr
    assert torch.load(tmp_path / "t" / "model.pt", weights_only=False)["extra"].getvalue() == b"aaa"
    assert not diff(tmp_path / "da", tmp_path / "t").different


def test_any_value_one_side_lacks_is_a_difference_between_two_state_dicts(tmp_path):
    """Between two torch.save files (or two DCP checkpoints), a config value, a token count or a
    tag removed diffed "equal", exit 0: only training-state kinds were counted as removed."""
    import torch

    state = {"w": torch.ones(2), "config": {"lr": 0.1}, "tokens_seen": 1024, "tag": "run-7"}
    torch.save(state, tmp_path / "a.pt")
    torch.save({"w": torch.ones(2), "config": {}}, tmp_path / "b.pt")
    report = diff(tmp_path / "a.pt", tmp_path / "b.pt")
    assert report.different and sorted(report.removed) == ["config.lr", "tag", "tokens_seen"], report.to_json()
    assert diff(tmp_path / "b.pt", tmp_path / "a.pt").added == report.removed


def test_weights_against_a_changed_fp32_copy_are_a_value_difference_not_a_removal(tmp_path):
    """ZeRO-2 against ZeRO-3 of the same run, one element of rank 1's fp32 partition changed:
    besides the fp32 copies' difference, "only in A: emb.weight, head.weight" (ZeRO-3 keeps those
    weights only as the copies, which no longer gave them back), as if the parameters were gone."""
    z3 = tmp_path / "z3"
    shutil.copytree(FIXTURES / "deepspeed" / "zero3", z3)
    adapter, m = registry.describe(z3)
    item = m.items["emb.weight.fp32"]
    with adapter.reader(m) as reader:
        start, _ = reader.raw_span(item.pieces[-1], item)
    path = z3 / item.pieces[-1].file
    raw = bytearray(path.read_bytes())
    struct.pack_into("<f", raw, start, struct.unpack_from("<f", raw, start)[0] + 0.25)
    path.write_bytes(raw)
    restamp_crcs(path)
    report = diff(FIXTURES / "deepspeed" / "zero2", z3)
    assert not report.removed and not report.added, report.to_json()
    found = {v.name: (v.max_abs, v.first_index) for v in report.values}
    assert found == {n: (0.25, [15, 8]) for n in ("emb.weight", "head.weight", "emb.weight.fp32", "head.weight.fp32")}


def test_a_map_that_gives_two_items_one_name_is_refused(tmp_path):
    """layer.0.w and layer.1.w mapped to blk.0.w: one of them dropped out unseen, and "equal"."""
    import torch

    torch.save({"layer.0.w": torch.ones(2), "layer.1.w": torch.full((2,), 5.0)}, tmp_path / "a.pt")
    torch.save({"blk.0.w": torch.ones(2)}, tmp_path / "b.pt")
    (tmp_path / "map.json").write_text(json.dumps({"layer\\.(\\d+)\\.w": "blk.0.w"}))
    r = run_cli("diff", tmp_path / "a.pt", tmp_path / "b.pt", "--map", tmp_path / "map.json")
    assert_clean(r, 2, "'layer.0.w' and 'layer.1.w' of A the one name 'blk.0.w'")


def test_zero_and_its_universal_checkpoint_are_the_same_state(tmp_path):
    """DeepSpeed keeps the optimizer's step per param group in ZeRO files and per parameter in a
    universal checkpoint (which also keeps fp32.pt of buffers): the real ds_to_universal output of
    the ZeRO-2 fixture, and ckpttool's own, diff equal, with notes saying how; a step or a copy
    that differs is still a difference."""
    import torch

    zero2, universal = FIXTURES / "deepspeed" / "zero2", FIXTURES / "deepspeed" / "universal"
    for a, b in ((zero2, universal), (universal, zero2)):
        report = diff(a, b)
        assert not report.different, report.to_json()
        assert report.added == report.removed == [] and len(report.notes) == 2, report.notes
        assert any("per param group (2)" in n for n in report.notes) and any("seen_tokens" in n for n in report.notes)
    r = run_cli("diff", zero2, universal)
    assert r.code == 0 and "same: optimizer step" in r.stdout, r.stdout
    assert len(json.loads(run_cli("diff", zero2, universal, "--json").stdout)["notes"]) == 2

    copy = tmp_path / "u"
    shutil.copytree(universal, copy)
    step = copy / "global_step3_universal" / "zero" / "blocks.0.fc1.bias" / "step.pt"
    torch.save(torch.load(step, weights_only=True) + 1, step)
    off = diff(zero2, copy)
    assert off.different and "blocks.0.fc1.bias.step" in off.added and not any("step" in n for n in off.notes)

    shutil.rmtree(copy)
    shutil.copytree(universal, copy)
    fp32 = copy / "global_step3_universal" / "zero" / "seen_tokens" / "fp32.pt"
    torch.save({"param": torch.load(fp32, weights_only=True)["param"] + 1}, fp32)
    off = diff(zero2, copy)
    assert off.different and off.added == ["seen_tokens.fp32"] and not any("fp32" in n for n in off.notes)


def test_a_pipeline_run_and_its_universal_checkpoint_are_the_same_state(tmp_path):
    """A universal checkpoint of a pipeline run has no layer files (nor has ds_to_universal's): the
    weights are the optimizer's fp32 copies, narrowed to bf16 for a bf16 run. The two diffed
    "different" (every weight only in A, every per-parameter step only in B); they are equal with
    notes, and a weight one ulp off is still a difference."""
    import torch

    src = FIXTURES / "deepspeed" / "pipeline_bf16"
    universal = tmp_path / "u"
    assert run_cli("reshard", src, "-o", universal, "--to", "deepspeed-universal").code == 0
    report = diff(src, universal)
    assert not report.different, report.to_json()
    assert report.identical == report.compared and report.added == report.removed == []
    assert any("weights: A keeps 23 parameter(s)" in n for n in report.notes), report.notes

    copy = tmp_path / "src"
    shutil.copytree(src, copy)
    layer = copy / "global_step3" / "layer_01-model_00-model_states.pt"
    state = torch.load(layer, weights_only=True)
    state["fc1.weight"].view(torch.int16)[0, 0] += 1  # one ulp
    torch.save(state, layer)
    off = diff(copy, universal)
    assert off.different and not off.removed, off.to_json()  # (a value that differs, not a weight gone)
    [(name, differing)] = [(v.name, v.differing) for v in off.values]
    assert (name, differing) == ("1.fc1.weight", 1)


def test_a_value_one_side_cannot_give_is_not_compared_and_not_shown_equal():
    """A refused pickle's item reads as None: it was compared as a value become None (exit 1), and
    the hostile checkpoint against itself came out equal (exit 0), though nothing was compared."""
    clean, hostile = FIXTURES / "dcp" / "fsdp2", FIXTURES / "hostile" / "dcp_bytes_item_os_system"
    r = run_cli("diff", clean, hostile, "--json")
    doc = json.loads(r.stdout)
    assert r.code == 3 and doc["equal"] is False and doc["objects"] == []
    assert doc["not_read"] == [
        {"name": "dataloader.cursor", "a": None, "b": "unsafe pickle: refers to posix.system"}
    ]
    r = run_cli("diff", hostile, hostile)
    assert r.code == 3 and "not read: dataloader.cursor (A: unsafe pickle" in r.stdout
    assert "not shown equal: 1 value could not be read" in r.stdout


def test_a_filter_that_selects_nothing_is_a_usage_error():
    """Two different checkpoints compared through a mistyped filter compared nothing and came out
    equal."""
    a, b = FIXTURES / "dcp" / "fsdp2", FIXTURES / "torch" / "train_state.pt"
    r = run_cli("diff", a, b, "--filter", "no_such_tensor")
    assert r.code == 2 and "--filter 'no_such_tensor' selects no item of either checkpoint" in r.stderr
    r = run_cli("diff", a, a, "--kind", "master")
    assert r.code == 2 and "--kind master selects no item" in r.stderr
    assert run_cli("diff", a, a, "--filter", "head").code == 0


def test_an_error_says_which_checkpoint_it_is_about():
    """Both checkpoints may have a `.metadata` or a `__1_0.distcp`: the file alone does not say
    which side failed."""
    clean, cut = FIXTURES / "dcp" / "fsdp2", FIXTURES / "hostile" / "dcp_truncated_distcp"
    r = run_cli("diff", clean, cut)
    assert r.code == 3 and r.stderr.startswith(f"error: B ({cut}): __1_0.distcp is "), r.stderr
    r = run_cli("diff", cut, clean)
    assert r.code == 3 and r.stderr.startswith(f"error: A ({cut}): __1_0.distcp is "), r.stderr


def test_values_compare_as_their_dtype_says(tmp_path):
    """float8 was compared as its byte codes (448 against 416: 1 apart, "within" --atol 1);
    complex values lost their imaginary part (a change of it: max abs 0, "within tolerance");
    int64 went through float64 (2**53 against 2**53 + 1: max abs 0) and took a relative tolerance
    (1,000,005 seen tokens against 1,000,000: "within" standard)."""
    import torch
    from safetensors.torch import save_file

    def pair(name, a, b, **kw):
        pa, pb = tmp_path / f"{name}_a.safetensors", tmp_path / f"{name}_b.safetensors"
        save_file({"t": a}, pa)
        save_file({"t": b}, pb)
        (d,) = diff(pa, pb, **kw).values
        return d

    e4 = torch.tensor([448.0, 1.0, 2.0]).to(torch.float8_e4m3fn)
    d = pair("f8", e4, torch.tensor([416.0, 1.0, 2.5]).to(torch.float8_e4m3fn), atol=1)
    assert (d.max_abs, d.differing, d.within_tolerance) == (32.0, 2, False)
    e5 = torch.tensor([2.0, float("inf")]).to(torch.float8_e5m2)
    d = pair("e5", e5, torch.tensor([2.5, float("inf")]).to(torch.float8_e5m2), atol=1)
    assert (d.max_abs, d.within_tolerance) == (0.5, True)
    c = torch.tensor([1 + 1j, 2 + 2j], dtype=torch.complex64)
    c2 = c.clone()
    c2[1] = 2 + 5j
    d = pair("c", c, c2, tolerance="standard")
    assert (d.max_abs, d.within_tolerance) == (3.0, False)
    n = torch.tensor([2**53, 1_000_000, 2**62], dtype=torch.int64)
    d = pair("i", n, torch.tensor([2**53 + 1, 1_000_005, 2**62 + 1]), tolerance="standard")
    assert (d.max_abs, d.differing, d.within_tolerance) == (5.0, 3, False)
    d = pair("i1", n, torch.tensor([2**53 + 1, 1_000_000, 2**62]), atol=0.5)
    assert (d.max_abs, d.within_tolerance) == (1.0, False)
    d = pair("i2", n, torch.tensor([2**53 + 1, 1_000_000, 2**62]), atol=1)
    assert (d.max_abs, d.within_tolerance) == (1.0, True)
    u = torch.tensor([0, 2**63 + 5], dtype=torch.uint64)
    d = pair("u", u, torch.tensor([1, 2**63 + 1], dtype=torch.uint64))
    assert (d.max_abs, d.differing) == (4.0, 2)


def test_a_universal_checkpoint_keeps_its_param_groups_and_diff_sees_them(tmp_path):
    """A ZeRO-1/2 universal checkpoint keeps the param groups' hyperparameters in
    zero/optimizer_state.pt, which went unread: an lr changed there showed nowhere."""
    from ckpttool import registry as reg

    u = FIXTURES / "deepspeed" / "universal"
    _, m = reg.describe(u)
    assert "optimizer.param_groups.1.lr" in m.items
    assert not diff(FIXTURES / "deepspeed" / "zero2", u).different


def _flip_byte(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 1
    path.write_bytes(bytes(data))


def test_a_changed_copy_of_a_replicated_tensor_is_a_difference(tmp_path):
    """diff read only the first copy of a replicated tensor: a DDP rank's copy, or a TP rank's
    norm, changed in B said "equal" (each rank loads its own copy). Every copy is compared now;
    a checkpoint against itself stays equal."""
    ddp = FIXTURES / "rankshards" / "ddp"
    b = tmp_path / "ddp"
    shutil.copytree(ddp, b)
    _, m = registry.describe(b)
    item = m.items["model.body.0.weight"]
    copy = next(p for p in item.pieces if p.replica)
    adapter, _ = registry.describe(b)
    with adapter.reader(m) as reader:
        off, n = reader.raw_span(copy, item)
    _flip_byte(b / copy.file, off + n // 2)
    restamp_crcs(b / copy.file)
    report = diff(ddp, b)
    assert report.different and report.identical == report.compared, report.to_json()
    (found,) = report.copies
    assert {k: found[k] for k in ("name", "side", "file", "rank")} == {
        "name": "body.0.weight", "side": "B", "file": copy.file, "rank": copy.rank
    }
    # (how much, and where: the copy's figures were not given)
    assert found["differing"] == 1 and found["max_abs_diff"] > 0 and found["first_index"] is not None
    assert [c["side"] for c in diff(b, ddp).copies] == ["A"]
    r = run_cli("diff", ddp, b)
    assert r.code == 1 and f"B's copy in {copy.file}" in r.stdout, r.stdout
    assert not diff(b, b).different


def test_non_tensor_values_compare_strictly(tmp_path):
    """Objects compared with Python's ==: True against 1, 1.0 against 1 and 0.0 against -0.0 said
    "equal". A NaN is the same NaN, and a tuple the list of the same values."""
    import torch

    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    nan = float("nan")
    torch.save({"w": torch.ones(2), "a": True, "b": 1.0, "c": 0.0, "d": nan, "e": (1, 2), "f": {"x": 2}}, a)
    torch.save({"w": torch.ones(2), "a": 1, "b": 1, "c": -0.0, "d": nan, "e": [1, 2], "f": {"x": 2}}, b)
    report = diff(a, b)
    assert [o["name"] for o in report.objects] == ["a", "b", "c"], report.objects
    assert not diff(a, a).different


def test_training_state_kept_beside_the_model_is_compared(tmp_path):
    """A Hugging Face Trainer checkpoint against its model alone (convert --kind param) was "equal":
    its optimizer, scheduler and RNG, in files beside the model, were not looked at. One side
    without them differs; both with them compare the files' bytes."""
    import torch

    src = FIXTURES / "hf" / "trainer" / "checkpoint-3"
    alone = tmp_path / "alone"
    assert run_cli("convert", src, "-o", alone, "--kind", "param").code == 0
    r = run_cli("diff", src, alone, "--json")
    report = json.loads(r.stdout)
    assert r.code == 1 and not report["equal"], report
    assert sorted(n.split(" ")[0] for n in report["removed"]) == ["optimizer.pt", "rng_state.pth", "scheduler.pt"]
    assert run_cli("diff", src, src).code == 0
    other = tmp_path / "other"
    shutil.copytree(src, other)
    state = torch.load(other / "scheduler.pt", weights_only=False)
    state["last_epoch"] = 99
    torch.save(state, other / "scheduler.pt")
    r = run_cli("diff", src, other, "--json")
    assert r.code == 1 and [o["name"].split(" ")[0] for o in json.loads(r.stdout)["objects"]] == ["scheduler.pt"]


def test_values_too_large_to_keep_are_compared(tmp_path):
    """A Python RNG state, a scheduler's list of 17 learning rates, a long string: values the
    manifest keeps only a summary of were skipped, and two checkpoints differing in them 'equal',
    exit 0, in torch files and in DCP alike."""
    import torch

    for tag in "ab":
        state = torch.load(FIXTURES / "torch" / "train_state.pt", weights_only=True)
        state["scheduler"]["base_lrs"] = [0.01] * 16 + [0.01 if tag == "a" else 0.5]
        state["config"]["name"] = ("x" if tag == "a" else "y") * 201
        torch.save(state, tmp_path / f"{tag}.pt")
        assert run_cli("convert", tmp_path / f"{tag}.pt", "-o", tmp_path / f"{tag}_dcp", "--to", "dcp").code == 0
    for a, b in (("a.pt", "b.pt"), ("a_dcp", "b_dcp")):
        r = run_cli("diff", tmp_path / a, tmp_path / b, "--json")
        report = json.loads(r.stdout)
        assert r.code == 1 and not report["equal"], report
        assert sorted(o["name"] for o in report["objects"]) == ["config.name", "scheduler.base_lrs"]
    r = run_cli("diff", tmp_path / "a.pt", tmp_path / "a_dcp")
    assert r.code == 0 and "equal" in r.stdout


def test_bytes_that_fail_their_crc_are_not_read_never_a_difference_or_equal(tmp_path):
    """A bit flipped in a tensor's bytes of a copy (its zip CRC-32 now fails; verify names the
    damage) was shown as a small difference in values, exit 1, and under --tolerance standard as
    "equal within tolerance", exit 0: a damaged backup checked with a tolerance passed. diff now
    checks the CRC-32s as convert does: the tensor is "not read" on the damaged side, exit 3."""
    import pickle
    import shutil

    src = FIXTURES / "dcp" / "fsdp2"
    copy = tmp_path / "copy"
    shutil.copytree(src, copy)
    (copy / "ckpttool.manifest.json").unlink(missing_ok=True)
    meta = pickle.loads((copy / ".metadata").read_bytes())
    where = next(s for i, s in meta.storage_data.items() if i.fqn == "model.tok.weight")
    data = bytearray((copy / where.relative_path).read_bytes())
    data[where.offset + where.length // 2] ^= 0x40
    (copy / where.relative_path).write_bytes(bytes(data))
    for args, side in (((src, copy), "B"), ((copy, src), "A")):
        for extra in ((), ("--tolerance", "standard")):
            r = run_cli("diff", *args, *extra)
            assert r.code == 3, (r.code, r.stdout, r.stderr)
            assert f"not read: tok.weight ({side}: {where.relative_path}" in r.stdout, r.stdout
            assert "CRC-32" in r.stdout and "equal within" not in r.stdout and "different:" not in r.stdout


def test_state_a_conversion_dropped_is_noted_not_passed_over(tmp_path):
    """A Megatron checkpoint against its conversion to DCP (which convert says drops Adam's step,
    the param groups and the data position) was "equal" with no word of them: only two Megatron
    checkpoints had those noted. The note is now given whatever the other side's format."""
    out = tmp_path / "dcp"
    assert run_cli("convert", FIXTURES / "megatron" / "legacy_tp2pp2", "-o", out, "--to", "dcp").code == 0
    report = diff(FIXTURES / "megatron" / "legacy_tp2pp2", out)
    assert not report.different, report.to_json()
    notes = "\n".join(report.not_compared)
    assert "args.consumed_train_samples (12) of A, its data position: B keeps none" in notes, notes
    assert "Adam's step; the param groups" in notes and "of A" in notes, notes
    back = diff(out, FIXTURES / "megatron" / "legacy_tp2pp2")
    assert "args.consumed_train_samples (12) of B, its data position: A keeps none" in "\n".join(back.not_compared)


@pytest.mark.parametrize(("fixture", "args", "side"), [("legacy_pp2_mtp_tied", ("--pp", "1"), "A"), ("legacy_pp4_mtpstage_tied", ("--pp", "2"), "B")])
def test_the_never_used_output_layer_left_out_or_added_by_a_reshard_is_no_difference(tmp_path, fixture, args, side):
    """A reshard of a tied MTP model leaves out (or adds) megatron-core's output layer of the MTP
    last stage, which nothing uses (docs/reshard.md: training is the same); diff of the source and
    the output said "only in A: output_layer.weight ...", different, exit 1. It is now a note."""
    out = tmp_path / "out"
    assert run_cli("reshard", FIXTURES / "megatron" / fixture, "-o", out, *args).code == 0
    report = diff(FIXTURES / "megatron" / fixture, out)
    assert not report.different and not report.removed and not report.added, report.to_json()
    assert any(n.startswith("output_layer.weight, ") and f"of {side} only" in n for n in report.not_compared)


def test_safetensors_metadata_that_differs_is_a_difference(tmp_path):
    """Two safetensors files identical but for their __metadata__ (a trainer's step 100 and 200)
    were "equal". Each key that differs is now a value that differs; the format tag and ckpttool's
    own keys are not compared."""
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, tmp_path / "a.safetensors", metadata={"format": "pt", "step": "100"})
    save_file({"w": torch.ones(2)}, tmp_path / "b.safetensors", metadata={"format": "pt", "step": "200"})
    save_file({"w": torch.ones(2)}, tmp_path / "c.safetensors", metadata={"format": "np", "step": "100", "ckpttool.source_format": "dcp"})
    report = diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert report.different and report.objects == [{"name": "__metadata__.step", "a": "100", "b": "200"}]
    assert not diff(tmp_path / "a.safetensors", tmp_path / "c.safetensors").different


def test_a_flipped_bit_in_a_member_read_in_part_is_never_equal(tmp_path):
    """A Megatron distributed optimizer's buffer holds many tensors and padding no tensor covers:
    diff read it in part, never judged its CRC-32, and called a copy with a flipped bit "equal
    within tolerance", exit 0. Members read in part are judged whole at the end, as convert does:
    the damage is "not read" on its side, exit 3."""
    import zipfile

    src = FIXTURES / "megatron" / "legacy_tp2pp2_distopt"
    copy = tmp_path / "dopt"
    shutil.copytree(src, copy)
    path = copy / "iter_0000003" / "mp_rank_00_000" / "distrib_optim.pt"
    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data/1"))
    head = info.header_offset
    begin = head + 30 + int.from_bytes(raw[head + 26 : head + 28], "little") + int.from_bytes(raw[head + 28 : head + 30], "little")
    raw[begin + 4 * 1000] ^= 0x01  # (the lowest mantissa bit of one fp32 moment)
    path.write_bytes(bytes(raw))
    r = run_cli("diff", src, copy, "--tolerance", "standard")
    assert r.code == 3 and "equal within" not in r.stdout, (r.code, r.stdout)
    assert "not read: (bytes of iter_0000003/mp_rank_00_000/distrib_optim.pt) (B: " in r.stdout, r.stdout
    assert run_cli("diff", src, src).code == 0


def test_a_part_read_twice_does_not_make_the_crc_check_quadratic():
    """diff reads a tensor that differs twice (its digest, then its values): each part was counted
    again, and past the member's length every later part re-walked all of them (10,000 views of
    one storage: 78 s, where 1.5 s before the check). A part read again is nothing new."""
    from ckpttool.io import _Member

    m = _Member(4 * 2_000, 0, "x")
    for _ in range(2):
        for i in range(2_000):
            assert m.add(4 * i, 4, 0) is None or i == 1_999
    assert m.seen == 4 * 2_000


def test_the_finite_shortcut_gives_the_figures_of_the_full_rules():
    """Blocks whose values are all finite take fewer passes (diff of two steps went 7x faster); the
    figures are those of the NaN- and infinity-aware rules, checked here against numpy over several
    blocks, with and without a square that overflows float64, at tolerances either side of the gap."""
    import numpy as np

    from ckpttool import diff as d
    from ckpttool.geometry import Box

    rng = np.random.default_rng(0)
    n = 3 * d._BLOCK + 5
    a = rng.standard_normal(n)
    b = a + rng.standard_normal(n) * 1e-3
    b[7] = a[7]  # (an equal element in a differing block)
    for big in (False, True):
        x, y = a.copy(), b.copy()
        if big:
            x[d._BLOCK + 1], y[d._BLOCK + 1] = 1e200, -1e200  # (|x - y|^2 overflows: the long way)
        gap = np.abs(x - y)
        for atol in (float(gap.max()) * 0.999, float(gap.max()) * 1.001):
            acc = d._Accumulator(atol, 0.0)
            acc.add(x, y, "float64", "float64", Box((0,), (n,)))
            got = acc.result("w", "w", "w", n)
            assert got.differing == int((x != y).sum()) and got.first_index == [0]
            assert got.max_abs == float(gap.max())
            assert got.within_tolerance == (atol >= gap.max())
            with np.errstate(over="ignore"):
                want = math.sqrt(float((gap**2).sum())) / math.sqrt(float((y**2).sum()))
            assert got.rel_l2 == (math.inf if big else pytest.approx(want, rel=1e-12))


def test_megatron_param_groups_that_differ_are_a_difference(tmp_path):
    """Megatron keeps its param groups (lr, betas, eps, weight decay) in the rank files' optimizer
    pickles, not as items: two saves whose lr and betas differed were "equal" (exit 0) with a "not
    compared" note, where DeepSpeed's were "different". The lr, betas and eps values over every
    group of every file are compared, whatever the layouts: the same state at TP=2 PP=2 legacy and
    torch_dist stays equal."""
    legacy = FIXTURES / "megatron" / "legacy_tp2pp2"

    def edit(tree) -> None:
        for group in tree["optimizer"]["optimizer"]["param_groups"]:
            group["lr"], group["betas"] = 0.5, (0.5, 0.5)

    changed = rewritten_copy(tmp_path / "changed", legacy, edit)
    report = diff(legacy, changed)
    by_name = {o["name"]: o for o in report.objects}
    assert report.different and by_name["optimizer.param_groups.*.lr"]["b"] == [0.5], report.objects
    assert by_name["optimizer.param_groups.*.betas"]["a"] == [[0.9, 0.95]]
    r = run_cli("diff", legacy, changed)
    assert r.code == 1 and "optimizer.param_groups.*.lr" in r.stdout, r.stdout
    noted = " ".join(report.not_compared)
    assert "(lr, betas, eps, weight decay)" not in noted and "weight decay and other settings" in noted, noted
    same = diff(legacy, FIXTURES / "megatron" / "dist_tp2pp2", pattern=r"^(embedding|decoder|output_layer|optimizer)\.")
    assert not same.different, same.to_json()


def test_a_damaged_copy_of_a_replicated_tensor_is_not_read_not_a_crash(tmp_path):
    """A bit flipped in TP rank 1's copy of a replicated layernorm: diff said "not read" for it, exit
    3, with the rest of the report; after reading each tensor once a side, the copies' check ran
    outside the handling of damaged bytes and the whole report was lost ("internal error")."""
    b = tmp_path / "b"
    shutil.copytree(FIXTURES / "megatron" / "legacy_tp2pp2", b)
    adapter, m = registry.describe(b)
    item = m.items["decoder.layers.0.input_layernorm.weight"]
    copy = next(p for p in item.pieces if p.replica)
    with adapter.reader(m) as reader:
        off, n = reader.raw_span(copy, item)
    _flip_byte(b / copy.file, off + n // 2)
    report = diff(FIXTURES / "megatron" / "legacy_tp2pp2", b)
    assert [u["name"] for u in report.unread] == ["decoder.layers.0.input_layernorm.weight"], report.unread
    assert report.identical == report.compared - 1 and not report.values
    r = run_cli("diff", FIXTURES / "megatron" / "legacy_tp2pp2", b)
    assert r.code == 3 and "not read: decoder.layers.0.input_layernorm.weight" in r.stdout and "internal" not in r.stderr
    # against another layout of the same save (torch_dist keeps one copy): the same, not passed over
    # ("equal", exit 0, on damaged bytes)
    across = diff(FIXTURES / "megatron" / "dist_tp2pp2", b)
    assert [u["name"] for u in across.unread] == ["decoder.layers.0.input_layernorm.weight"], across.to_json()


def test_a_map_names_items_as_ls_shows_them_and_says_what_matched_nothing(tmp_path):
    """``--map model.1.bias=model.1.b`` (the names as ``ls`` prints them) renamed nothing, silently:
    renames were matched against canonical names only (``1.bias``), and a rename that matched no
    name of A was dropped without a word, so a typo in a map file read as a real difference."""
    from safetensors.torch import load_file, save_file

    a = tmp_path / "a.safetensors"
    export(FIXTURES / "run" / "step_10", a)
    b = tmp_path / "b.safetensors"
    save_file({("model.1.b" if k == "model.1.bias" else k): v for k, v in load_file(a).items()}, b)
    assert diff(a, b).different
    report = diff(a, b, renames={"model.1.bias": "model.1.b"})
    assert not report.different and not report.not_compared, report.not_compared
    report = diff(a, b, renames={r"(\d+)\.bias": r"model.\1.b"})  # (a pattern's result spelled as ls spells it)
    assert sorted(report.removed) == ["3.b", "4.b", "5.b"], report.removed  # (renamed; 1.b found in B, compared)
    assert sorted(report.added) == ["3.bias", "4.bias", "5.bias"], report.added
    report = diff(a, b, renames={"model.1.bias": "model.1.b", "model.9.bias": "x", r"blk\.(\d+)": r"b.\1"})
    assert not report.different
    assert report.not_compared == [
        r"--map 'model.9.bias', 'blk\\.(\\d+)': no name of A matches, so nothing was renamed by it (a pattern is "
        "matched against names as diff gives them: without a model. or module. prefix)"
    ]
    # names as diff gives them, where canonical() would strip them further (model.model.fc.weight is
    # model.fc.weight in diff's report, fc.weight once more)
    import torch

    save_file({"model.model.fc.weight": torch.ones(2)}, a2 := tmp_path / "a2.safetensors")
    save_file({"model.model.fc.w": torch.ones(2)}, b2 := tmp_path / "b2.safetensors")
    report = diff(a2, b2, renames={"model.fc.weight": "model.fc.w"})
    assert not report.different and not report.not_compared, (report.added, report.removed, report.not_compared)
    mapping = tmp_path / "map.txt"
    mapping.write_text("model.1.bias=model.1.b\nnope=x\n")
    r = run_cli("diff", a, b, "--map", mapping)
    assert r.code == 0 and "--map 'nope': no name of A matches" in r.stdout, (r.code, r.stdout, r.stderr)


def test_copies_within_tolerance_of_their_twins_are_read_once(tmp_path, monkeypatch):
    """Every copy of a replicated tensor one ULP off on the other side (another save's values, the
    same on each rank), compared with a tolerance: each copy was read to pair it with its twin, and,
    not being bit-equal, read again to compare it with the other side's first copy."""
    ddp = FIXTURES / "rankshards" / "ddp"
    b = tmp_path / "ddp"
    shutil.copytree(ddp, b)
    adapter, m = registry.describe(b)
    item = m.items["model.body.0.weight"]
    with adapter.reader(m) as reader:
        spans = [(p.file, *reader.raw_span(p, item)) for p in item.pieces]
    for file, off, _ in spans:
        _flip_byte(b / file, off)  # (the low mantissa bit of the first element, little-endian)
    for file in {f for f, _, _ in spans}:
        restamp_crcs(b / file)
    reads: dict[tuple[str, str], int] = {}
    cls = type(adapter.reader(m))
    plain = cls.read

    def counted(self, piece, it, out=None):
        if it.name == item.name:  # (by file: one rank's copy a file)
            key = (str(self.manifest.root), piece.file)
            reads[key] = reads.get(key, 0) + 1
        return plain(self, piece, it, out=out)

    monkeypatch.setattr(cls, "read", counted)
    assert diff(ddp, b).different  # (strict: one element of each copy differs)
    reads.clear()
    report = diff(ddp, b, atol=1e-3)
    assert not report.different and not report.copies, report.to_json()
    assert len(reads) == 2 * len(item.pieces) and all(n == 1 for n in reads.values()), reads


def test_a_state_dict_saved_whole_is_compared_tensors_and_all(tmp_path):
    """dcp.save with flatten_state_dict=False keeps each top-level value, tensors and all, in one
    pickle: two saves whose weights differed were "equal", exit 0 (0 tensors compared). The tensors
    inside a value are read and compared; one diff cannot read (past 64 MB, or where the format
    gives no way) is not shown equal (exit 3)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner

    m = torch.nn.Linear(3, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in "ab":
            planner = DefaultSavePlanner(flatten_state_dict=False)
            dcp.save({"model": m.state_dict(), "step": 1}, checkpoint_id=tmp_path / name, no_dist=True, planner=planner)
            with torch.no_grad():
                m.weight[0, 0] += 1.0
    report = diff(tmp_path / "a", tmp_path / "b")
    assert report.different and [o["name"] for o in report.objects] == ["model"], report.to_json()
    assert run_cli("diff", tmp_path / "a", tmp_path / "b").code == 1
    assert run_cli("diff", tmp_path / "a", tmp_path / "a").code == 0
    from ckpttool import diff as diff_module

    saved = diff_module._MAX_TENSOR_IN_VALUE
    diff_module._MAX_TENSOR_IN_VALUE = 4  # (a tensor too large to read inside a value)
    try:
        report = diff(tmp_path / "a", tmp_path / "a")
    finally:
        diff_module._MAX_TENSOR_IN_VALUE = saved
    assert not report.different and [u["name"] for u in report.unread] == ["model"], report.to_json()
    assert report.to_json()["equal"] is False and report.not_compared == [
        "model: it holds a tensor, which diff does not compare inside a value"
    ]


@pytest.mark.parametrize(
    ("a", "b", "shown"),
    [
        (float("inf"), "inf", ("float inf", "str 'inf'")),
        (float("nan"), -float("nan"), ("float nan", "float -nan")),
        ([1.0, float("-inf")], [1.0, "-inf"], ("list [1.0, -inf]", "list [1.0, '-inf']")),
    ],
)
def test_a_nonfinite_float_is_not_its_spelling(a, b, shown, tmp_path):
    """The manifest keeps a NaN or an Inf as its text: float('inf') against the string 'inf' (and a
    NaN against one with its sign bit set) were "equal". Both values are read and compared."""
    import torch

    for name, value in (("a", a), ("b", b)):
        torch.save({"w": torch.ones(2), "best": value}, tmp_path / f"{name}.pt")
    report = diff(tmp_path / "a.pt", tmp_path / "b.pt")
    assert report.different and report.objects == [{"name": "best", "a": shown[0], "b": shown[1]}], report.objects
    assert not diff(tmp_path / "a.pt", tmp_path / "a.pt").different
