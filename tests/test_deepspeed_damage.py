"""Damaged copies of the real DeepSpeed 0.19.8 fixtures: a rank's file deleted, two ranks' files
swapped, a file left from a save at a larger DP size. The reader knows the layout from what the
files record (``partition_count`` in the optimizer files, ``dp_world_size`` / ``mp_world_size`` in
the model states, each ZeRO-1/2 file's ``param_slice_mappings``, the tied-weight map DeepSpeed
saves in global rank 0's file only): it names the file, and export, seal and reshard refuse
instead of taking the surviving partitions for whole tensors."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from ckpttool import registry
from ckpttool.verify import verify
from tests.conftest import FIXTURES, rewritten_copy, run_cli

DS = FIXTURES / "deepspeed"
TAG = "global_step3"


def _copy(name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copytree(DS / name, dst)  # keeps the files' times (a file newer than `latest` reads as unfinished)
    return dst


def _swap(tag_dir: Path, a: str, b: str) -> None:
    os.rename(tag_dir / a, tag_dir / "swap.tmp")
    os.rename(tag_dir / b, tag_dir / a)
    os.rename(tag_dir / "swap.tmp", tag_dir / b)


def _verify_cli(path: Path) -> tuple[int, list[dict]]:
    r = run_cli("verify", path, "--json", "-q", cwd=path.parent)
    assert "Traceback" not in r.stderr, r.stderr
    return r.code, json.loads(r.stdout)["findings"]


def _refused(path: Path, tmp_path: Path, named: list[str]) -> None:
    """export (one fp32 master), seal and reshard exit 3 naming the file(s) and write nothing."""
    out = tmp_path / "out.safetensors"
    for args, written in (
        (["export", path, "-o", out, "-f", r"^emb\.weight\.fp32$"], out),
        (["seal", path], path / "ckpttool.manifest.json"),
        (["reshard", path, "-o", tmp_path / "resharded", "--dp", "1"], tmp_path / "resharded"),
    ):
        r = run_cli(*args, cwd=tmp_path)
        assert r.code == 3, (args[0], r.stdout, r.stderr)
        assert "Traceback" not in r.stderr
        for name in named:
            assert name in r.stderr, (args[0], r.stderr)
        assert not written.exists(), f"{args[0]} wrote {written}"


# -- a rank's file deleted -------------------------------------------------------------------------

MISSING = [
    ("zero3", ["zero_pp_rank_1_mp_rank_00_optim_states.pt"]),
    ("zero3", ["zero_pp_rank_1_mp_rank_00_model_states.pt"]),
    ("zero3_bf16", ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"]),
    ("zero2", ["zero_pp_rank_1_mp_rank_00_optim_states.pt"]),
    ("zero1", ["zero_pp_rank_0_mp_rank_00_optim_states.pt"]),
    ("bf16_optimizer", ["bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"]),
    ("tp2", ["mp_rank_01_model_states.pt"]),
    ("pipeline", ["zero_pp_rank_0_mp_rank_02_optim_states.pt"]),
    ("autotp", ["zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_01_optim_states.pt"]),
    ("zero2", ["zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]),
    ("zero3", ["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"]),
]


def _rank_in(name: str) -> int:
    m = re.search(r"zero_pp_rank_(\d+)_", name) or re.search(r"mp_rank_(\d+)_", name)
    assert m
    return int(m.group(1))


@pytest.mark.parametrize(("fixture", "gone"), MISSING, ids=[f"{f}-{'+'.join(g)}" for f, g in MISSING])
def test_a_deleted_rank_file_is_named_not_read_around(fixture, gone, tmp_path):
    """Before: a ZeRO-3 save without rank 1's optimizer file read rank 0's partitions as whole
    tensors (33 items gone, wrong values exported); ZeRO-1/2 gave coverage gaps that never named
    the file; a missing ZeRO-3 model-states file was blamed on rank 0's."""
    path = _copy(fixture, tmp_path)
    for name in gone:
        (path / TAG / name).unlink()
    code, findings = _verify_cli(path)
    assert code == 1, findings
    missing = [f for f in findings if f["rule"] == "missing-file"]
    # one finding per file, each naming the rank whose file it is (the rank its pieces name)
    assert [(f["file"], f["rank"]) for f in missing] == [(f"{TAG}/{n}", _rank_in(n)) for n in gone], findings
    assert all(n in f["message"] for n, f in zip(gone, missing))
    assert f"{len(gone)} rank file(s) missing from {TAG}" in missing[0]["message"]
    assert not [f for f in findings if f["rule"] in ("coverage-gap", "corrupt-file", "optimizer-mismatch")], findings


def test_zero3_without_a_rank_refuses_to_export_seal_or_reshard(tmp_path):
    path = _copy("zero3", tmp_path)
    gone = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    (path / TAG / gone).unlink()
    _refused(path, tmp_path, [gone])


def test_zero2_without_a_rank_refuses_to_export(tmp_path):
    path = _copy("zero2", tmp_path)
    gone = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    (path / TAG / gone).unlink()
    r = run_cli("export", path, "-o", tmp_path / "e.safetensors", "--kind", "master", cwd=tmp_path)
    assert r.code == 3 and gone in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "e.safetensors").exists()


# -- two ranks' files swapped ----------------------------------------------------------------------


def test_zero3_swapped_ranks_are_named_by_the_tied_weight_map(tmp_path):
    """Before: verify passed and ``head.weight.fp32`` vanished (the alias map was read from the
    file named rank 0, and DeepSpeed saves it in global rank 0's file only). A ZeRO-3 optimizer
    file records no rank; the model-states files give the swap away when the model ties weights."""
    path = _copy("zero3", tmp_path)
    for kind in ("model", "optim"):
        _swap(path / TAG, f"zero_pp_rank_0_mp_rank_00_{kind}_states.pt", f"zero_pp_rank_1_mp_rank_00_{kind}_states.pt")
    code, findings = _verify_cli(path)
    assert code == 1, findings
    (f,) = [f for f in findings if f["rule"] == "misplaced-file"]
    assert f["file"] == f"{TAG}/zero_pp_rank_1_mp_rank_00_model_states.pt"
    assert "zero_pp_rank_0_mp_rank_00_model_states.pt" in f["message"] and "shared_params" in f["message"]
    _refused(path, tmp_path, ["zero_pp_rank_1_mp_rank_00_model_states.pt"])


SWAPPED = [
    ("zero1", ""),
    ("zero2", ""),
    ("zero2_bf16", "bf16_"),
    ("bf16_optimizer", "bf16_"),
]


@pytest.mark.parametrize(("fixture", "prefix"), SWAPPED, ids=[f for f, _ in SWAPPED])
def test_zero12_swapped_optimizer_files_are_named_by_their_slice_mappings(fixture, prefix, tmp_path):
    """Before: verify passed and every partitioned tensor was read with its halves swapped."""
    path = _copy(fixture, tmp_path)
    a, b = (f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1))
    _swap(path / TAG, a, b)
    code, findings = _verify_cli(path)
    assert code == 1, findings
    (f,) = [f for f in findings if f["rule"] == "misplaced-file"]
    assert f["file"] == f"{TAG}/{a}"
    assert a in f["message"] and b in f["message"] and "DP rank 1's" in f["message"]
    r = run_cli("export", path, "-o", tmp_path / "e.safetensors", "--kind", "master", cwd=tmp_path)
    assert r.code == 3 and a in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "e.safetensors").exists()


def test_pipeline_swapped_optimizer_files_of_one_stage(tmp_path):
    path = _copy("pipeline", tmp_path)
    a, b = (f"zero_pp_rank_{r}_mp_rank_02_optim_states.pt" for r in (0, 1))
    _swap(path / TAG, a, b)
    rules = {(f.rule, f.file) for f in verify(path).findings}
    assert ("misplaced-file", f"{TAG}/{a}") in rules, rules


# -- files of two saves ----------------------------------------------------------------------------


def test_a_rank_file_beyond_the_recorded_dp_size_is_named(tmp_path):
    """A file of DP rank 2 in a 2-rank save (left by an earlier save at DP 4): DeepSpeed's
    zero_to_fp32 refuses it; the reader would have cut every tensor in three."""
    path = _copy("zero2", tmp_path)
    stale = "zero_pp_rank_2_mp_rank_00_optim_states.pt"
    shutil.copy2(path / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt", path / TAG / stale)
    code, findings = _verify_cli(path)
    assert code == 1
    (f,) = [f for f in findings if f["rule"] == "misplaced-file"]
    assert f["file"] == f"{TAG}/{stale}" and "partition_count 2" in f["message"]


def test_optimizer_files_recording_two_dp_sizes_are_refused(tmp_path):
    from ckpttool.formats.deepspeed import ALLOWLIST

    def edit(tree):
        tree["optimizer_state_dict"]["partition_count"] = [4, 4]

    rel = f"{TAG}/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    path = rewritten_copy(tmp_path / "mixed", DS / "zero2", edit, rel, ALLOWLIST)
    rules = {(f.rule, f.file) for f in verify(path).findings}
    assert ("misplaced-file", rel) in rules, rules


FOREIGN = [
    ("bf16_optimizer", "zero2_bf16", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", "ZeRO-2's optimizer state"),
    ("zero2_bf16", "bf16_optimizer", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", "BF16_Optimizer's optimizer state"),
    ("pipeline_bf16", "pipeline", "zero_pp_rank_1_mp_rank_00_optim_states.pt", "ZeRO-1's optimizer state"),
]


@pytest.mark.parametrize(("fixture", "donor", "name", "said"), FOREIGN, ids=[f"{f}-from-{d}" for f, d, _, _ in FOREIGN])
def test_an_optimizer_file_of_another_run_is_named(fixture, donor, name, said, tmp_path):
    """A rank's optimizer file of another run (another optimizer, same model) put in its place:
    before, verify passed and reshard wrote a sealed output with a parameter's fragments from the
    wrong layout (BF16_Optimizer's partitions are not ZeRO-2's with alignment padding), which
    DeepSpeed loaded without a word; now the file is a misplaced-file and reshard refuses it."""
    path = _copy(fixture, tmp_path)
    target = path / TAG / ("bf16_" + name if not name.startswith("bf16_") else name)
    shutil.copy2(DS / donor / TAG / name, target)
    os.utime(target, (os.path.getmtime(path / "latest"),) * 2)
    code, findings = _verify_cli(path)
    assert code == 1, findings
    (f,) = [f for f in findings if f["rule"] == "misplaced-file"]
    assert f["file"] == f"{TAG}/{target.name}" and said in f["message"], f
    r = run_cli("reshard", path, "-o", tmp_path / "out", "--dp", "1", cwd=tmp_path)
    assert r.code == 3 and target.name in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_pipeline_stages_swapped_optimizer_files_are_named(tmp_path):
    """Two pipeline stages' optimizer files swapped: before, an error about a tensor's shape that
    named no file; now the file and the stage whose parameters it holds."""
    path = _copy("pipeline_bf16", tmp_path)
    a, b = (f"bf16_zero_pp_rank_0_mp_rank_0{m}_optim_states.pt" for m in (0, 1))
    _swap(path / TAG, a, b)
    code, findings = _verify_cli(path)
    assert code == 1, findings
    (f,) = [f for f in findings if f["rule"] == "misplaced-file"]
    assert f["file"] == f"{TAG}/{a}" and "model-parallel rank 1's" in f["message"], f
    r = run_cli("reshard", path, "-o", tmp_path / "out", "--dp", "1", cwd=tmp_path)
    assert r.code == 3 and a in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("how", ["swapped", "copied"])
def test_layer_files_of_one_shape_swapped_or_copied_are_named(how, tmp_path):
    """Two pipeline layer files of the same shapes swapped (or one copied over the other) read as
    valid layers with the wrong weights: verify said replica-mismatch against the other
    model-parallel rank's copy, naming no file. torch.save named the archive inside each file after
    the file, and the rename or copy kept it."""
    path = _copy("pipeline", tmp_path)
    a, b = "layer_02-model_00-model_states.pt", "layer_03-model_00-model_states.pt"
    if how == "swapped":
        _swap(path / TAG, a, b)
        said = f"{TAG}/{a} and {TAG}/{b} were swapped: each was saved under the other's name"
    else:
        shutil.copy2(path / TAG / b, path / TAG / a)
        said = f"{TAG}/{a} is a copy of {TAG}/{b}: {TAG}/{b} was copied over it"
    code, findings = _verify_cli(path)
    assert code == 1, findings
    (f,) = [f for f in findings if f["severity"] == "error"]
    assert f["rule"] == "misplaced-file" and f["file"] == f"{TAG}/{a}", f
    assert f["message"].startswith(said), f
    r = run_cli("reshard", path, "-o", tmp_path / "out", "--dp", "1", cwd=tmp_path)
    assert r.code == 3 and a in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_reshard_refuses_a_source_whose_pieces_leave_a_gap(tmp_path, monkeypatch):
    """A tensor whose pieces do not cover it (here: one partition's piece dropped from the
    manifest, as a rank file read for another's would leave): the DeepSpeed writers would fill the
    gap with zeros and seal it; reshard and --to deepspeed-universal refuse it before writing."""
    from ckpttool.errors import CorruptFileError
    from ckpttool.formats.deepspeed import DeepSpeedAdapter
    from ckpttool.reshard import Target, reshard

    real = DeepSpeedAdapter.describe

    def holed(self, path):
        m = real(self, path)
        item = m.items["blocks.0.fc2.bias.exp_avg"]
        item.pieces = item.pieces[:-1]
        return m

    monkeypatch.setattr(DeepSpeedAdapter, "describe", holed)
    for target in (Target(dp=1), Target(to="deepspeed-universal")):
        with pytest.raises(CorruptFileError, match="blocks.0.fc2.bias.exp_avg: .* elements are in no piece"):
            reshard(DS / "bf16_optimizer", tmp_path / "out", target)
        assert not (tmp_path / "out").exists()


# -- what must not change --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fixture",
    ["zero1", "zero2", "zero2_bf16", "bf16_optimizer", "zero3", "zero3_bf16", "pipeline", "pipeline_tied",
     "pipeline_bf16", "tp2", "tp2_glu", "autotp", "universal", "universal3"],
)  # fmt: skip
def test_every_clean_fixture_reads_with_its_alias(fixture):
    _, m = registry.describe(DS / fixture)
    if fixture in ("zero2", "zero3", "zero3_bf16", "universal", "universal3"):
        assert "head.weight.fp32" in m.items  # the tied alias, from global rank 0's file
    assert m.layout.dp in (2, None)


def test_a_resharded_zero2_at_an_odd_dp_is_not_taken_for_swapped(tmp_path):
    """The slice-mapping check follows DeepSpeed's layout (groups padded to 2 x DP): ckpttool's own
    writer's files at DP 3 (uneven cuts, padding on the last rank) read as they are."""
    out = tmp_path / "dp3"
    r = run_cli("reshard", DS / "zero2", "-o", out, "--dp", "3", "-q", cwd=tmp_path)
    assert r.code == 0, r.stderr
    assert not [f for f in verify(out).findings if f.rule in ("misplaced-file", "missing-file")]


# -- a zip member's local header damaged -----------------------------------------------------------


def test_a_damaged_local_header_is_its_own_items_not_the_first_read(tmp_path):
    """The CRC-32 pass walks every member of an archive when it meets the archive's first piece; a
    member whose local header was gone was reported as that first item's (`seen_tokens` for a
    parameter's frozen fragment) and stopped the other members' checks. Now the damage is the item
    whose storage it is, and members no item's piece holds (ZeRO-3's empty placeholders, `version`)
    are the file's, in one finding."""
    import zipfile

    path = _copy("zero3", tmp_path)
    f = path / TAG / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    with zipfile.ZipFile(f) as z:
        at = {i.filename.rsplit("/", 1)[-1]: i.header_offset for i in z.infolist()}
        sizes = {i.filename.rsplit("/", 1)[-1]: i.file_size for i in z.infolist()}
    empty = next(k for k, n in sizes.items() if k.isdigit() and n == 0)
    owned = max((k for k in sizes if k.isdigit()), key=int)  # the frozen bias fragment's storage
    stat = f.stat()
    data = bytearray(f.read_bytes())
    for member in (owned, "version", empty):
        data[at[member]] ^= 0xFF
    f.write_bytes(bytes(data))
    os.utime(f, ns=(stat.st_atime_ns, stat.st_mtime_ns))

    code, findings = _verify_cli(path)
    damage = [x for x in findings if x["rule"] == "corrupt-file"]
    assert code == 1
    assert [x["item"] for x in damage] == ["frozen.bias.fp32", None], damage
    assert f"data/{owned} at byte {at[owned]:,}" in damage[0]["message"]
    assert f"data/{empty} at byte {at[empty]:,}" in damage[1]["message"]
    assert "(and 1 more of its members likewise)" in damage[1]["message"]
    assert all(x["file"] == f"{TAG}/{f.name}" for x in damage)


def _cut(f: Path) -> None:
    st = os.stat(f)
    f.write_bytes(f.read_bytes()[:-100])
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))


U = "global_step3_universal"
IMPLIED = [
    # (fixture, deleted, cut short, the error findings: (rule, file, rank))
    (  # a layer file beside a damaged one was looked for only once every file read
        "pipeline",
        [f"{TAG}/layer_02-model_00-model_states.pt"],
        [f"{TAG}/mp_rank_03_model_states.pt"],
        [
            ("truncated-file", f"{TAG}/mp_rank_03_model_states.pt", 3),
            ("missing-file", f"{TAG}/layer_02-model_00-model_states.pt", 0),
        ],
    ),
    (  # two layer files: one finding, its file named without the tag folder
        "pipeline",
        [f"{TAG}/layer_01-model_00-model_states.pt", f"{TAG}/layer_02-model_01-model_states.pt"],
        [],
        [
            ("missing-file", f"{TAG}/layer_01-model_00-model_states.pt", 0),
            ("missing-file", f"{TAG}/layer_02-model_01-model_states.pt", 1),
        ],
    ),
    # a universal checkpoint without the model states DeepSpeed's universal load reads: verify said OK
    ("universal", [f"{U}/mp_rank_00_model_states.pt"], [], [("missing-file", f"{U}/mp_rank_00_model_states.pt", 0)]),
    (
        "universal",
        [f"{U}/mp_rank_00_model_states.pt", f"{U}/zero/emb.weight/exp_avg.pt"],
        [],
        [("missing-file", f"{U}/mp_rank_00_model_states.pt", 0), ("missing-file", f"{U}/zero/emb.weight/exp_avg.pt", None)],
    ),
    (
        "universal3",
        [f"{U}/zero_pp_rank_0_mp_rank_00_model_states.pt", f"{U}/zero_pp_rank_1_mp_rank_00_model_states.pt"],
        [],
        [("missing-file", f"{U}/zero_pp_rank_0_mp_rank_00_model_states.pt", 0)],
    ),
    # the param groups DeepSpeed's universal load asserts on, and a ZeRO-3 rank's model states (its
    # fragments of the frozen parameters): verify said OK, reshard --to dcp dropped the param groups
    ("universal", [f"{U}/zero/optimizer_state.pt"], [], [("missing-file", f"{U}/zero/optimizer_state.pt", None)]),
    ("universal3", [f"{U}/zero/optimizer_state.pt"], [], [("missing-file", f"{U}/zero/optimizer_state.pt", None)]),
    (
        "universal3",
        [f"{U}/zero_pp_rank_0_mp_rank_00_model_states.pt"],
        [],
        [("missing-file", f"{U}/zero_pp_rank_0_mp_rank_00_model_states.pt", 0)],
    ),
    (
        "universal3",
        [f"{U}/zero_pp_rank_1_mp_rank_00_model_states.pt"],
        [],
        [("missing-file", f"{U}/zero_pp_rank_1_mp_rank_00_model_states.pt", 1)],
    ),
    # the fp32.pt ds_to_universal copies from the module for a tied alias and a frozen parameter
    ("universal", [f"{U}/zero/head.weight/fp32.pt"], [], [("missing-file", f"{U}/zero/head.weight/fp32.pt", None)]),
    (
        "universal",
        [f"{U}/zero/frozen.weight/fp32.pt"],
        [f"{U}/zero/emb.weight/fp32.pt"],
        [("truncated-file", f"{U}/zero/emb.weight/fp32.pt", None), ("missing-file", f"{U}/zero/frozen.weight/fp32.pt", None)],
    ),
]


@pytest.mark.parametrize(("fixture", "gone", "cut", "expected"), IMPLIED, ids=[f"{c[0]}-{i}" for i, c in enumerate(IMPLIED)])
def test_files_the_layout_implies_are_named_when_missing(fixture, gone, cut, expected, tmp_path):
    """Files no metadata lists but the layout implies (pipeline layer files, a universal
    checkpoint's model states and per-parameter files): each missing one is its own finding, with
    the other damage, and a universal checkpoint without its model states is no longer clean. Files
    are named from the save directory given (a universal tag's were named from the tag)."""
    path = _copy(fixture, tmp_path)
    for rel in gone:
        (path / rel).unlink()
    for rel in cut:
        _cut(path / rel)
    code, findings = _verify_cli(path)
    assert code == 1, findings
    assert [(f["rule"], f["file"], f["rank"]) for f in findings if f["severity"] == "error"] == expected, findings


@pytest.mark.parametrize(("fixture", "tracker"), [("zero2", "latest"), ("universal", "latest_universal")])
def test_a_tracker_overwritten_with_bytes_is_damage_not_a_path_out(fixture, tracker, tmp_path):
    """`latest` overwritten with binary bytes read as a tag name with a NUL in it: an unsafe-path
    finding whose file was the garbage itself, "outside the checkpoint directory"."""
    path = _copy(fixture, tmp_path)
    (path / tracker).write_bytes(b"this is not a checkpoint \x00\x01\x02 garbage\n")
    code, findings = _verify_cli(path)
    assert code == 1
    assert [(f["rule"], f["file"]) for f in findings] == [("incomplete-save", tracker)], findings
    assert "not a tag name" in findings[0]["message"]
