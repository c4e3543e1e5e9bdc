"""The output layer tied to the word embeddings (Megatron-LM's default: no
``--untie-embeddings-and-output-weights``) at PP > 1, in checkpoints Megatron-LM core_v0.16.1 wrote:
``legacy_tp2pp2_tied`` and ``dist_tp2pp2_tied`` (TP=2 x PP=2, Float16, one run's two saves), and
``legacy_tp2pp2dp2_tied_distopt`` and ``dist_tp2pp2dp2_tied_distopt`` (TP=2 x PP=2 x DP=2, the
distributed optimizer; the torch_dist one ``dp_reshardable``). The last stage keeps a copy of the
embeddings as its ``output_layer.weight`` (zero-filled at build, synced with the first stage's
through the embedding group; its own optimizer state, in a grad-buffer bucket of its own under the
distributed optimizer); torch_dist saves it under the embeddings' key, as a replica. ckpttool reads
the legacy copy as a replica of the embeddings too, so the two saves of one run are the same
checkpoint, and verify compares the copy with the embeddings. The references are the runs' own
sharded state dicts, gathered before the saves.

With multi-token prediction layers too (``--mtp-num-layers 1``, the 2-layer MTP model):
``legacy_pp4_mtpstage_tied`` and ``dist_pp4_mtpstage_tied`` (PP=4, layout ``Et|t|m|L``: the MTP stage's
copy of the embeddings and the last stage's output layer, both synced copies) and
``legacy_pp2_mtp_tied`` (PP=2, the MTP layer on the last stage: megatron-core ties the output to that
stage's MTP copy of the embeddings, and its ``output_layer.weight`` is a parameter it allocates but
never uses: random init, zero moments; megatron-core cannot make the sharded state dict of that
stage, so the run saved legacy files only)."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from ckpttool import registry
from ckpttool.diff import diff
from ckpttool.export import export
from ckpttool.reshard import Target, reshard
from ckpttool.verify import verify
from tests._compare import same_bits
from tests.conftest import FIXTURES, megatron_enums
from tests.test_megatron import _expected
from tests.test_reshard import STATE_KINDS, _drop_rng, _megatron_lm, _oracle, _rank_files, _ref, _tree
from tests.test_reshard_dist import _megatron_core_load, _same_records
from tests.test_reshard_from_dist import _same_files

MG = FIXTURES / "megatron"
TIED, TIED_DIST = MG / "legacy_tp2pp2_tied", MG / "dist_tp2pp2_tied"
TIED_DISTOPT, TIED_DP = MG / "legacy_tp2pp2dp2_tied_distopt", MG / "dist_tp2pp2dp2_tied_distopt"
EMB = "embedding.word_embeddings.weight"
MTP_STAGE, MTP_STAGE_DIST = MG / "legacy_pp4_mtpstage_tied", MG / "dist_pp4_mtpstage_tied"
MTP_LAST = MG / "legacy_pp2_mtp_tied"
STAGE_LAYOUT = "Et|t|m|L"


@pytest.mark.parametrize(
    ("source", "ref"),
    [
        (TIED, "legacy_tp2pp2_tied"),
        (TIED_DIST, "legacy_tp2pp2_tied"),
        (TIED_DISTOPT, "dist_tp2pp2dp2_tied_distopt"),
        (TIED_DP, "dist_tp2pp2dp2_tied_distopt"),
    ],
)
def test_tied_reads_as_megatron_saved_it(source, ref, tmp_path):
    """Every tensor (params, fp32 mains, moments) equals the run's own gather, which has no output
    layer of its own; the legacy last stage's copy is a replica of the embeddings (before, it was an
    item of its own, ``output_layer.weight``, which torch_dist does not have: a diff of one run's two
    saves was not empty). The dp_reshardable buckets and distrib_optim.pt are placed by replaying the
    grad buffers, the copy in a bucket of its own."""
    _, m = registry.describe(source)
    assert not [n for n in m.items if n.startswith("output_layer.weight")]
    assert not [n for n in m.items if n.startswith("optimizer.distributed.") and m.items[n].is_tensor]
    export(source, tmp_path / "o.safetensors")
    got = load_file(tmp_path / "o.safetensors")
    want = _expected(ref)
    assert len(want) == 4 * 26 and not [k for k in want if k.startswith("output_layer.")]
    assert [k for k, v in want.items() if k not in got or not same_bits(got[k], v)] == []
    assert verify(source).failing() == []
    if source.name.startswith("legacy"):  # the copy: the last stage's pieces, replicas of the first's
        pieces = m.items[EMB].pieces
        assert len(pieces) == 4 and sorted(p.replica for p in pieces) == [0, 0, 1, 1]
        assert {p.file.split("/")[1] for p in pieces if p.replica} == {"mp_rank_00_001", "mp_rank_01_001"}


@pytest.mark.parametrize(("a", "b"), [(TIED, TIED_DIST), (TIED_DISTOPT, TIED_DP)])
def test_one_runs_two_saves_diff_equal(a, b):
    """The legacy and the torch_dist save of one run are the same checkpoint: the copy is no entry
    of its own in either."""
    result = diff(a, b, kinds=STATE_KINDS)
    assert not result.different and result.compared == 4 * 26


def test_a_copy_that_drifted_is_found(tmp_path):
    """The last stage's copy of the embeddings differs from the first stage's (an embedding group
    that did not sync, a bad restore): verify names both files; a legacy reshard would otherwise keep
    one and drop the other silently."""
    root = tmp_path / "c"
    shutil.copytree(TIED, root)
    path = root / "iter_0000003" / "mp_rank_01_001" / "model_optim_rng.pt"
    with megatron_enums():
        obj = torch.load(path, weights_only=False)
        obj["model"]["output_layer.weight"][0, 0] += 1
        torch.save(obj, path)
    shutil.copystat(TIED / path.relative_to(root), path)  # (a file newer than the tracker: another finding)
    found = verify(root, deep=True).failing()
    assert [f.rule for f in found] == ["replica-mismatch"], found
    assert "mp_rank_01_000" in found[0].message and "mp_rank_01_001" in found[0].message, found[0].message
    assert "its own copy of the tied word embeddings (its output_layer.weight)" in (found[0].hint or "")


@pytest.mark.parametrize(("source", "via"), [(TIED, Target(tp=1, pp=1)), (TIED_DISTOPT, Target(tp=1, pp=1))])
def test_tied_round_trip_is_exact(source, via, tmp_path):
    """TP=2 x PP=2 -> TP=1 x PP=1 (no copy: Megatron's model at PP=1 has no output layer weight) ->
    TP=2 x PP=2: the rank files come back as Megatron-LM wrote them, the last stage's copy (its
    optimizer state, its place in the model and in the grad buffer's buckets) included."""
    one, back = tmp_path / "one", tmp_path / "back"
    reshard(source, one, via)
    model = dict(_tree(_rank_files(one)["mp_rank_00"])[1])["model"][1]
    assert not [k for k, _ in model if k.startswith("output_layer.weight")]
    reshard(one, back, Target(tp=2, pp=2))
    original, again = _rank_files(source), _rank_files(back)
    assert list(original) == list(again)
    for name in original:
        assert _drop_rng(_tree(original[name])) == _drop_rng(_tree(again[name])), name
    for rel in sorted(p.relative_to(source) for p in source.glob("iter_*/*/distrib_optim.pt")):
        assert (back / rel).read_bytes() == (source / rel).read_bytes(), rel
    for out in (one, back):
        assert not diff(source, out, kinds=STATE_KINDS).different
        assert verify(out).failing() == []


@pytest.mark.parametrize(("source", "theirs"), [(TIED_DIST, TIED), (TIED_DP, TIED_DISTOPT)])
def test_torch_dist_to_legacy_is_what_megatron_lm_saves(source, theirs, tmp_path):
    """torch_dist -> legacy at the same layout: the run's own legacy save, every rank file's tree (the
    last stage's output_layer.weight made from the embeddings, with their optimizer state) and
    distrib_optim.pt byte for byte; and legacy -> torch_dist: the run's torch_dist save, record for
    record (the Float16 run; the distributed optimizer's is dp_reshardable, which ckpttool does not
    write)."""
    out = tmp_path / "out"
    reshard(source, out, Target(to="megatron"))
    _same_files(out, theirs)
    if source == TIED_DIST:
        back = tmp_path / "back"
        reshard(theirs, back, Target(to="megatron-dist"))
        _same_records(back, source, rng=False)


def test_tied_through_other_layouts(tmp_path):
    """PP=2 -> PP=4 with the first and last stages uneven, VPP=2, and back: the copy follows the
    output layer to the last chunk of the last stage each time; the state stays the same."""
    out = tmp_path / "pp4"
    reshard(TIED, out, Target(tp=1, pp=4))
    last = dict(_tree(_rank_files(out)["mp_rank_00_003"])[1])["model"][1]
    assert [k for k, _ in last][-2:] == ["output_layer.weight", "output_layer._extra_state"]
    vpp = tmp_path / "vpp"
    reshard(TIED, vpp, Target(tp=1, pp=2, vpp=2))
    chunks = dict(_tree(_rank_files(vpp)["mp_rank_00_001"])[1])
    assert "output_layer.weight" in dict(chunks["model1"][1]) and "output_layer.weight" not in dict(chunks["model0"][1])
    for o in (out, vpp):
        assert not diff(TIED, o, kinds=STATE_KINDS).different
        assert verify(o).failing() == []
        back = tmp_path / f"{o.name}-back"
        reshard(o, back, Target(tp=2, pp=2, vpp=1))
        for name, path in _rank_files(TIED).items():
            assert _drop_rng(_tree(path)) == _drop_rng(_tree(_rank_files(back)[name])), name


@pytest.mark.slow
@pytest.mark.parametrize(
    ("source", "target", "ref"),
    [
        (TIED, Target(tp=1, pp=1), "legacy_tp2pp2_tied"),
        (TIED_DIST, Target(to="megatron", tp=1, pp=2), "legacy_tp2pp2_tied"),
        (TIED_DP, Target(to="megatron", tp=2, pp=2), "dist_tp2pp2dp2_tied_distopt"),
        (TIED_DISTOPT, Target(tp=1, pp=4, distributed_optimizer=False), "dist_tp2pp2dp2_tied_distopt"),
    ],
    ids=["pp1", "dist-to-pp2", "dp_reshardable-to-legacy-distopt", "distopt-to-pp4-float16"],
)
def test_megatron_lm_loads_the_tied_checkpoint(source, target, ref, tmp_path):
    """Oracle: Megatron-LM's load_checkpoint, building the tied model at the new layout (its embedding
    group the first and last stage), loads our output: every tensor each rank holds equals the
    reference (the last stage's copy too, under the embeddings' key), the RNG states are the ones
    written, and it trains the next step."""
    mlm = _megatron_lm()
    if mlm is None:
        pytest.skip("needs megatron-core and a Megatron-LM source (set MEGATRON_LM)")
    out = tmp_path / "out"
    reshard(source, out, target)
    args = ["--tp", str(target.tp), "--pp", str(target.pp), "--tied", "--padded-vocab", "128"]
    distopt = target.distributed_optimizer or (target.distributed_optimizer is None and "distopt" in source.name)
    args += ["--distopt"] if distopt else []
    proc = _oracle(mlm, out, *args, *_ref(ref))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("source", "tp", "pp", "distopt"),
    [
        (TIED, 1, 2, None),
        (TIED, 2, 1, None),
        (TIED_DP, 1, 4, None),
        (TIED_DISTOPT, 2, 2, False),
        (MTP_STAGE, 2, 1, True),
    ],
    ids=["legacy-tp1pp2", "legacy-tp2pp1", "dp_reshardable-pp4", "distopt-to-float16", "mtp-stage-tp2-distopt"],
)
def test_megatron_core_loads_the_tied_output(source, tp, pp, distopt, tmp_path):
    """Oracle: megatron-core's dist_checkpointing.load (the wheel alone), building the tied model (and
    the MTP model of the standalone MTP stage's save, at PP=1) at the new TP x PP, loads our torch_dist output: every tensor each rank holds (the last stage's copy
    under the embeddings' key) equals the reference slice, the main replicas cover each reference
    tensor exactly once, and from the Float16 legacy source each rank's RNG is the source rank's."""
    pytest.importorskip("megatron.core")
    out = tmp_path / "out"
    reshard(source, out, Target(to="megatron-dist", tp=tp, pp=pp, distributed_optimizer=distopt))
    ref = {TIED: "legacy_tp2pp2_tied", MTP_STAGE: "legacy_pp4_mtpstage_tied"}.get(source, "dist_tp2pp2dp2_tied_distopt")
    padded = registry.describe(source)[1].items[EMB].shape[0]
    args = ["--ckpt", str(out), "--tp", str(tp), "--pp", str(pp), "--tied", "--padded-vocab", str(padded)]
    args += ["--mtp"] if source == MTP_STAGE else []
    args += ["--reference", str(MG / f"{ref}.reference.pt")]
    if distopt or (distopt is None and source != TIED):
        args += ["--distopt"]
    if source in (TIED, MTP_STAGE):
        layout = registry.describe(source)[1].layout
        args += ["--rng-source", str(source), "--rng-source-layout", str(layout.tp), str(layout.pp)]
    result = _megatron_core_load(*args, nproc=tp * pp)
    assert len(result["ranks"]) == tp * pp
    for rank in result["ranks"]:
        assert rank["problems"] == [] and rank["checked"] >= 20
        assert rank["rng_matches"] is (True if source in (TIED, MTP_STAGE) else None)


def test_an_untied_copy_is_not_taken_for_the_embeddings(tmp_path):
    """The same files with args saying the output layer is untied: the last stage's
    output_layer.weight is a parameter of its own again (read as such, no replica)."""
    from tests.test_reshard import _with_args

    src = _with_args(tmp_path / "u", TIED, untie_embeddings_and_output_weights=True)
    _, m = registry.describe(src)
    assert "output_layer.weight" in m.items and len(m.items[EMB].pieces) == 2


@pytest.mark.parametrize("source", [MTP_STAGE, MTP_STAGE_DIST])
def test_tied_with_a_standalone_mtp_stage_reads_as_megatron_saved_it(source, tmp_path):
    """PP=4, ``Et|t|m|L``, tied: the MTP stage's copy of the embeddings and the last stage's output
    layer are both replicas of the embeddings; every tensor equals the run's gather; verify is clean."""
    _, m = registry.describe(source)
    assert not [n for n in m.items if n.startswith("output_layer.weight")]
    export(source, tmp_path / "o.safetensors")
    got = load_file(tmp_path / "o.safetensors")
    want = _expected("legacy_pp4_mtpstage_tied")
    assert len(want) == 96 and sum(k.startswith("mtp.") for k in want) == 40
    assert [k for k, v in want.items() if k not in got or not same_bits(got[k], v)] == []
    assert verify(source, deep=True).failing() == []
    if source == MTP_STAGE:  # stage 0's embeddings; copies in stage 2 (the MTP layer's) and 3 (the output's)
        assert sorted((p.file.split("/")[1], p.replica) for p in m.items[EMB].pieces) == [
            ("mp_rank_00_000", 0), ("mp_rank_00_002", 1), ("mp_rank_00_003", 2)
        ]  # fmt: skip


def test_the_unused_output_layer_of_an_mtp_last_stage(tmp_path):
    """PP=2, the MTP layer on the last stage, tied: the last stage's output_layer.weight is read as a
    parameter of its own (it is not a copy of the embeddings), its all-zero moments are not reported
    (megatron-core never gives it a gradient), and the MTP stage's copy is a replica of the embeddings."""
    _, m = registry.describe(MTP_LAST)
    assert m.extras["unused"] == ["output_layer.weight"]
    assert {"output_layer.weight", "output_layer.weight.exp_avg"} <= set(m.items)
    assert len(m.items[EMB].pieces) == 2
    assert verify(MTP_LAST, deep=True).failing() == []
    # the same checkpoint without the format's word: its moments read as reset
    assert "output_layer.weight.exp_avg is all zeros" in "".join(
        f.message for f in verify(_without_unused(tmp_path, MTP_LAST), deep=True).failing()
    )


def _without_unused(tmp_path, source):
    from tests.test_reshard import _with_args

    # (args saying untied: the reader no longer knows the output layer unused; a negative control, not a save)
    return _with_args(tmp_path / "u", source, untie_embeddings_and_output_weights=True)


@pytest.mark.parametrize(
    ("source", "via", "back"),
    [
        (MTP_STAGE, Target(tp=1, pp=1), Target(pp=4, pipeline_layout=STAGE_LAYOUT)),
        (MTP_STAGE, Target(tp=2, pp=2), Target(tp=1, pp=4, pipeline_layout=STAGE_LAYOUT)),
        (MTP_LAST, Target(tp=2, pp=2), Target(tp=1, pp=2)),
    ],
    ids=["mtp-stage-pp1", "mtp-stage-tp2pp2", "mtp-last-tp2"],
)
def test_tied_mtp_round_trip_is_exact(source, via, back, tmp_path):
    """Through another layout and back, the rank files are Megatron-LM's: the MTP stage's copy of the
    embeddings and the last stage's tied output layer made from the embeddings (and their optimizer
    state), or, with the MTP layer on the last stage, its unused output layer carried as it is. (Through
    TP=2 the args keep the divisor that pads the 64 rows at TP=2, 32, which pads them alike at TP=1.)"""
    one, again = tmp_path / "one", tmp_path / "again"
    reshard(source, one, via)
    reshard(one, again, back)
    original, out = _rank_files(source), _rank_files(again)
    assert list(original) == list(out)
    for name in original:
        a, b = _tree(original[name]), _tree(out[name])
        assert _drop_rng(a, "args") == _drop_rng(b, "args"), name
        args = [dict(dict(t[1])["args"][1][1]) for t in (a, b)]
        assert {k for k in args[0] if args[0][k] != args[1].get(k)} <= (
            {"make_vocab_size_divisible_by"} if via.tp == 2 else set()
        )
    for o in (one, again):
        report = diff(source, o, kinds=STATE_KINDS)
        # (the MTP stage at TP=2 x PP=2, no layout given: the MTP layer on the last stage, whose unused
        # output layer the writer adds as a copy of the embeddings: a note, not a difference)
        unused = source == MTP_STAGE and o == one and via.pp == 2
        noted = [n for n in report.not_compared if n.startswith("output_layer.weight, ")]
        names = "output_layer.weight, output_layer.weight.exp_avg, output_layer.weight.exp_avg_sq, output_layer.weight.fp32"
        assert [n.startswith(f"{names} of B only: ") for n in noted] == ([True] if unused else [])
        assert not report.added and not report.values and not report.removed and report.identical == report.compared
        assert verify(o, deep=True).failing() == []


def test_the_unused_output_layer_across_layouts(tmp_path):
    """PP=2 with the MTP layer last -> PP=1: the unused output layer is not written (Megatron's PP=1
    model has none), and the plan says so; -> PP=4 with a stage of its own for the MTP layer: the
    last stage's output layer is the embeddings' copy, not the unused one; PP=1 -> PP=2 again: the
    unused output layer is written as a copy of the embeddings, which the plan says."""
    pp1, pp4, pp2 = tmp_path / "pp1", tmp_path / "pp4", tmp_path / "pp2"
    notes = reshard(MTP_LAST, pp1, Target(tp=1, pp=1)).plan.notes
    assert any("output_layer.weight is not written" in n for n in notes), notes
    assert not [
        k for k, _ in dict(_tree(_rank_files(pp1)["mp_rank_00"])[1])["model"][1] if k.startswith("output_layer.w")
    ]
    reshard(MTP_LAST, pp4, Target(tp=1, pp=4, pipeline_layout=STAGE_LAYOUT))
    last = dict(dict(_tree(_rank_files(pp4)["mp_rank_00_003"])[1])["model"][1])
    first = dict(dict(_tree(_rank_files(pp4)["mp_rank_00_000"])[1])["model"][1])
    assert last["output_layer.weight"] == first[EMB]
    assert verify(pp4, deep=True).failing() == []
    notes = reshard(pp1, pp2, Target(tp=1, pp=2)).plan.notes
    assert any("written as a copy of the word embeddings" in n for n in notes), notes
    model = dict(dict(_tree(_rank_files(pp2)["mp_rank_00_001"])[1])["model"][1])
    assert model["output_layer.weight"] == model[EMB] == first[EMB]
    assert verify(pp2, deep=True).failing() == []
    dist = tmp_path / "dist"
    notes = reshard(MTP_LAST, dist, Target(to="megatron-dist")).plan.notes
    assert any("cannot load this model at this pipeline layout" in n for n in notes), notes


@pytest.mark.slow
@pytest.mark.parametrize(
    ("source", "target", "ref"),
    [
        (MTP_STAGE, Target(tp=2, pp=1), "legacy_pp4_mtpstage_tied"),
        (MTP_STAGE_DIST, Target(to="megatron", tp=1, pp=4, pipeline_layout=STAGE_LAYOUT), "legacy_pp4_mtpstage_tied"),
        (MTP_LAST, Target(tp=1, pp=4, pipeline_layout=STAGE_LAYOUT, distributed_optimizer=True), None),
        (MTP_LAST, Target(tp=2, pp=1), None),
    ],
    ids=["mtp-stage-to-tp2", "dist-mtp-stage", "mtp-last-to-mtp-stage-distopt", "mtp-last-to-tp2"],
)
def test_megatron_lm_loads_the_tied_mtp_checkpoint(source, target, ref, tmp_path):
    """Oracle: Megatron-LM's load_checkpoint, building the tied MTP model at the new layout (the MTP
    layer in a stage of its own, or PP=1), loads our output of its saves and trains the next step:
    every tensor equals the reference where the run was gathered (with the MTP layer on the last stage
    it could not be; there the load itself, strict, and the step are the check)."""
    mlm = _megatron_lm()
    if mlm is None:
        pytest.skip("needs megatron-core and a Megatron-LM source (set MEGATRON_LM)")
    out = tmp_path / "out"
    reshard(source, out, target)
    args = ["--tp", str(target.tp or 1), "--pp", str(target.pp), "--mtp", "--tied"]
    args += ["--padded-vocab", str(registry.describe(out)[1].items[EMB].shape[0])]
    args += ["--layout", STAGE_LAYOUT] if target.pipeline_layout else []
    args += ["--distopt"] if target.distributed_optimizer else []
    proc = _oracle(mlm, out, *args, *(_ref(ref) if ref else ()))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


def test_the_unused_output_layer_gets_no_bucket_of_its_own():
    """megatron-core marks ``shared_embedding`` (a grad-buffer bucket of its own) on
    ``shared_embedding_or_output_weight()``: on a tied last stage the output layer, but with the MTP
    layers in that chunk their copy of the embeddings (registered first, so its bucket changes
    nothing), not the unused output layer; a standalone MTP stage leaves the last stage's output
    layer marked."""
    from types import SimpleNamespace

    from ckpttool.formats.megatron import shared_embedding

    def args(**kw):
        base = {"untie_embeddings_and_output_weights": False, "pipeline_model_parallel_layout": None}
        return SimpleNamespace(**{**base, "mtp_num_layers": None, "virtual_pipeline_model_parallel_size": None, **kw})

    assert shared_embedding(args(), 1, 2) == {"output_layer.weight"}
    assert shared_embedding(args(mtp_num_layers=1), 1, 2) == frozenset()
    assert shared_embedding(args(mtp_num_layers=1), 0, 2) == {EMB}
    stage = args(mtp_num_layers=1, pipeline_model_parallel_layout=STAGE_LAYOUT)
    assert [shared_embedding(stage, p, 4) for p in range(4)] == [{EMB}, set(), set(), {"output_layer.weight"}]
