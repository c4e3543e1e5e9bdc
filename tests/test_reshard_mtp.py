"""Multi-token prediction layers (megatron-core's MultiTokenPredictionBlock, DeepSeek-V3's MTP) in
checkpoints Megatron-LM core_v0.16.1 wrote: ``legacy_tp2_mtp`` and ``dist_tp2_mtp`` (TP=2, saved from
the same state), ``legacy_pp2_mtp`` (PP=2: the MTP layer in the last stage, which keeps its own
copy of the word embeddings) and ``dist_tp2pp2_mtp_distopt`` (TP=2 x PP=2, the distributed
optimizer's ``dp_reshardable`` buckets); and with routed experts in the MTP layer too (DeepSeek-V3's),
TP=2 x EP=2: ``legacy_tp2ep2_mtp`` and ``dist_tp2ep2_mtp`` (Float16), ``legacy_tp2ep2_mtp_distopt`` and
``dist_tp2ep2_mtp_distopt`` (the distributed optimizer; ``dp_reshardable``); and PP=4 with the layout
``Et|t|m|L``, the MTP layer in a stage of its own before the loss's (DeepSeek-V3's, megatron-core's
"standalone MTP"): ``legacy_pp4_mtpstage`` and ``dist_pp4_mtpstage`` (Float16), ``legacy_pp4_mtpstage_distopt``
and ``dist_pp4_mtpstage_distopt_fr`` (the distributed optimizer), and the same layout string at PP=2,
which puts the MTP layer on the first pipeline rank: ``legacy_pp2_mtpfirst``. Their references are the
runs' own sharded state dicts, gathered before the saves."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from ckpttool import registry
from ckpttool.diff import diff
from ckpttool.errors import UsageError
from ckpttool.export import export
from ckpttool.reshard import Target, reshard
from ckpttool.verify import verify
from tests._compare import same_bits
from tests.conftest import FIXTURES, assert_clean, run_cli
from tests.test_megatron import _expected
from tests.test_reshard import STATE_KINDS, _drop_rng, _megatron_lm, _oracle, _rank_files, _ref, _tree, _with_args
from tests.test_reshard_dist import ITER, _chunks, _megatron_core_load, _metadata, _record, _same_records
from tests.test_reshard_from_dist import _same_files

MG = FIXTURES / "megatron"
MTP_TP2, MTP_DIST, MTP_PP2 = MG / "legacy_tp2_mtp", MG / "dist_tp2_mtp", MG / "legacy_pp2_mtp"
MTP_DISTOPT = MG / "dist_tp2pp2_mtp_distopt"
MTP_PP2_DISTOPT = MG / "legacy_pp2_mtp_distopt"  # the same state as MTP_PP2, the distributed optimizer's
# the MoE model (4 routed experts) with an MTP layer, TP=2 x EP=2: the Float16 run's two saves, and the
# distributed-optimizer run's (its torch_dist one dp_reshardable, Megatron-LM's default)
MOE_MTP, MOE_MTP_DIST = MG / "legacy_tp2ep2_mtp", MG / "dist_tp2ep2_mtp"
MOE_MTP_DISTOPT, MOE_MTP_DIST_DP = MG / "legacy_tp2ep2_mtp_distopt", MG / "dist_tp2ep2_mtp_distopt"
# PP=4, layout Et|t|m|L: the MTP layer (and a copy of the embeddings) in stage 2, the output layer alone in
# stage 3; one run's Float16 saves, and another run's distributed-optimizer saves of the same state
STAGE, STAGE_DIST = MG / "legacy_pp4_mtpstage", MG / "dist_pp4_mtpstage"
STAGE_DISTOPT, STAGE_FR = MG / "legacy_pp4_mtpstage_distopt", MG / "dist_pp4_mtpstage_distopt_fr"
STAGE_LAYOUT = "Et|t|m|L"


@pytest.mark.parametrize(
    ("source", "ref"),
    [
        (MTP_TP2, "legacy_tp2_mtp"),
        (MTP_DIST, "legacy_tp2_mtp"),
        (MTP_PP2, "legacy_pp2_mtp"),
        (MTP_DISTOPT, "dist_tp2pp2_mtp_distopt"),
        (MTP_PP2_DISTOPT, "legacy_pp2_mtp"),
        (STAGE, "legacy_pp4_mtpstage"),
        (STAGE_DIST, "legacy_pp4_mtpstage"),
        (STAGE_DISTOPT, "legacy_pp4_mtpstage"),
        (STAGE_FR, "legacy_pp4_mtpstage"),
    ],
)
def test_mtp_reads_as_megatron_saved_it(source, ref, tmp_path):
    """Every tensor (params, fp32 copies, moments) of the MTP layer and the rest equals the run's own
    gather; eh_proj is split by rows at TP=2 (read as a whole copy before, it was half of the tensor,
    and verify saw the two halves as copies that differ). The MTP stage's embedding copy agrees. The
    dp_reshardable buckets are placed by replaying the grad buffers with the MTP block and the
    embedding copy in the last stage (before, they were refused as modules of unknown order). A
    standalone MTP stage (``Et|t|m|L``) is read at megatron-core's own layer offsets of the layout, its
    embedding copy and grad buffer too (before, the layout was refused)."""
    if source == MTP_DISTOPT:
        _, m = registry.describe(source)
        assert not [n for n in m.items if n.startswith("optimizer.distributed.") and m.items[n].is_tensor]
    export(source, tmp_path / "o.safetensors")
    got = load_file(tmp_path / "o.safetensors")
    want = _expected(ref)
    assert len(want) == 100 and sum(k.startswith("mtp.") for k in want) == 40
    assert [k for k, v in want.items() if k not in got or not same_bits(got[k], v)] == []
    assert got["mtp.layers.0.eh_proj.weight"].shape == (16, 32)
    assert verify(source).failing() == []


@pytest.mark.parametrize(("source", "via"), [(MTP_TP2, Target(tp=1, pp=2)), (MTP_PP2, Target(tp=1, pp=1))])
def test_mtp_round_trip_is_exact(source, via, tmp_path):
    """TP=2 -> TP=1 x PP=2 -> TP=2, and PP=2 -> PP=1 -> PP=2: the rank files' trees come back as
    Megatron-LM wrote them (every tensor, the param groups and their order, args), the PP=2 last
    stage with the embedding copy first, its optimizer state included; the state stays the same."""
    one, back = tmp_path / "one", tmp_path / "back"
    layout = registry.describe(source)[1].layout
    reshard(source, one, via)
    reshard(one, back, Target(tp=layout.tp, pp=layout.pp))
    original, again = _rank_files(source), _rank_files(back)
    assert list(original) == list(again)
    for name in original:
        assert _drop_rng(_tree(original[name])) == _drop_rng(_tree(again[name])), name
    stages = _rank_files(one if via.pp == 2 else source)
    model = dict(_tree(stages["mp_rank_00_001"])[1])["model"][1]
    assert model[0][0] == "embedding.word_embeddings.weight" and model[-1][0].startswith("output_layer.")
    assert any(k.startswith("mtp.layers.0.") for k, _ in model)
    for out in (one, back):
        assert not diff(source, out, kinds=STATE_KINDS).different
        assert verify(out).failing() == []


@pytest.mark.parametrize(
    ("source", "ref"),
    [
        (MOE_MTP, "legacy_tp2ep2_mtp"),
        (MOE_MTP_DIST, "legacy_tp2ep2_mtp"),
        (MOE_MTP_DISTOPT, "dist_tp2ep2_mtp_distopt"),
        (MOE_MTP_DIST_DP, "dist_tp2ep2_mtp_distopt"),
    ],
    ids=["legacy", "torch_dist", "legacy-distopt", "dp_reshardable"],
)
def test_mtp_with_routed_experts_reads_as_megatron_saved_it(source, ref, tmp_path):
    """An MTP layer whose transformer layer is a mixture of experts (DeepSeek-V3's), TP=2 x EP=2: each
    legacy EP rank file keeps its 2 local experts of the MTP layer (local_experts.0/1) as of the decoder
    layers; torch_dist stacks them on an expert axis of their own (no layer axis: [experts, ...]); the
    dp_reshardable buckets are placed by replaying the grad buffers with each EP rank's MTP experts.
    Every tensor (params, fp32 mains, moments) equals the run's own gather; verify is clean."""
    _, m = registry.describe(source)
    assert (m.layout.tp, m.layout.ep) == (2, 2)
    export(source, tmp_path / "o.safetensors")
    got = load_file(tmp_path / "o.safetensors")
    want = _expected(ref)
    assert len(want) == 184 and sum(k.startswith("mtp.") for k in want) == 68
    assert [k for k, v in want.items() if k not in got or not same_bits(got[k], v)] == []
    fc1 = m.items["mtp.layers.0.transformer_layer.mlp.experts.local_experts.3.linear_fc1.weight.exp_avg"]
    if source in (MOE_MTP, MOE_MTP_DISTOPT):  # global expert 3: local expert 1 of EP rank 1, split over TP
        assert sorted(p.file.split("/")[1] for p in fc1.pieces) == ["mp_rank_00_001"] * 2 + ["mp_rank_01_001"] * 2
    assert verify(source).failing() == []


def test_mtp_with_routed_experts_is_written_as_megatron_saves_it(tmp_path):
    """At the layout it was saved at, each save of the MoE + MTP runs written in the other format is
    Megatron-LM's own: legacy -> torch_dist every key, chunk and record (the MTP experts' expert axis,
    their _extra_state records, RNG); torch_dist -> legacy the rank files' model entries (the MTP experts
    under local numbers, each EP rank its own), optimizer and RNG; with the distributed optimizer, both
    saves -> legacy give Megatron-LM's distrib_optim.pt byte for byte."""
    dist, legacy = tmp_path / "dist", tmp_path / "legacy"
    reshard(MOE_MTP, dist, Target(to="megatron-dist"))
    _same_records(dist, MOE_MTP_DIST)
    reshard(MOE_MTP_DIST, legacy, Target(to="megatron"))
    theirs = _rank_files(MOE_MTP)
    assert list(_rank_files(legacy)) == list(theirs) == [f"mp_rank_0{t}_00{e}" for t in (0, 1) for e in (0, 1)]
    for name, path in _rank_files(legacy).items():
        ours, megatron = dict(_tree(path)[1]), dict(_tree(theirs[name])[1])
        assert [k for k, _ in ours["model"][1]] == [k for k, _ in megatron["model"][1]], name
        assert ours["model"][1] == megatron["model"][1], name  # (torch_dist keeps no module _metadata)
        assert ours["optimizer"] == megatron["optimizer"] and ours["rng_state"] == megatron["rng_state"], name
    for source in (MOE_MTP_DIST_DP, MOE_MTP_DISTOPT):
        out = tmp_path / source.name
        reshard(source, out, Target(to="megatron"))
        assert sorted(p.relative_to(out) for p in out.glob("iter_*/*/distrib_optim.pt")) == sorted(
            p.relative_to(MOE_MTP_DISTOPT) for p in MOE_MTP_DISTOPT.glob("iter_*/*/distrib_optim.pt")
        )
        for f in MOE_MTP_DISTOPT.glob("iter_*/*/distrib_optim.pt"):
            assert (out / f.relative_to(MOE_MTP_DISTOPT)).read_bytes() == f.read_bytes(), f
    _same_files(tmp_path / MOE_MTP_DISTOPT.name, MOE_MTP_DISTOPT)


def _model_entries(root, name: str) -> list:
    return dict(_tree(_rank_files(root)[name])[1])["model"][1]


def _model_meta(root, name: str) -> dict:
    return dict(_tree(_rank_files(root)[name])[1])["model"][2][1]  # ((type name, the OrderedDict))


def test_mtp_with_routed_experts_round_trips(tmp_path):
    """TP=2 x EP=2 -> TP=1 x EP=1 -> TP=2 x EP=2, and through TP=1 x PP=2 x EP=2 (the MTP layer's experts
    in the last stage's files only), gives Megatron-LM's rank files back: every tensor, the
    param groups, the module _metadata (each EP rank's MTP experts under local numbers, in their
    layer's block); RNG aside (one TP=1 file keeps one rank's). diff of source and TP=1 is empty."""
    one, back = tmp_path / "one", tmp_path / "back"
    reshard(MOE_MTP, one, Target(tp=1, ep=1))
    reshard(one, back, Target(tp=2, ep=2))
    assert not diff(MOE_MTP, one, kinds=STATE_KINDS).different
    for name, path in _rank_files(MOE_MTP).items():
        assert _drop_rng(_tree(_rank_files(back)[name])) == _drop_rng(_tree(path)), name
    staged, back = tmp_path / "pp2", tmp_path / "back2"  # through PP=2: the MTP experts in the last stage
    reshard(MOE_MTP, staged, Target(tp=1, pp=2, ep=2))
    reshard(staged, back, Target(tp=2, pp=1, ep=2))
    for e in (0, 1):
        assert not any(k.startswith("mtp.") for k, _ in _model_entries(staged, f"mp_rank_00_000_00{e}"))
        last = [k for k, _ in _model_entries(staged, f"mp_rank_00_001_00{e}")]
        mtp_experts = {k.split(".")[7] for k in last if k.startswith("mtp.") and ".local_experts." in k}
        assert mtp_experts == {"0", "1"}, (e, mtp_experts)  # each EP rank's own two, numbered locally
    for name, path in _rank_files(MOE_MTP).items():
        assert _drop_rng(_tree(_rank_files(back)[name])) == _drop_rng(_tree(path)), name
        for out in (back, tmp_path / "back"):  # module _metadata in Megatron's order too (a dict compares unordered)
            assert list(_model_meta(out, name)) == list(_model_meta(MOE_MTP, name)), name
    (_, _, (_, meta)) = dict(_tree(_rank_files(one)["mp_rank_00"])[1])["model"]
    modules = list(meta)  # megatron-core's module order: the MTP layer's 4 experts where its block stands
    block = [m for m in modules if m.startswith("mtp.layers.0.transformer_layer.mlp.experts.local_experts.")]
    assert block == modules[modules.index(block[0]) : modules.index(block[0]) + 12] and len(block) == 12
    assert modules.index(block[-1]) < modules.index("mtp.layers.0.final_layernorm")


def test_mtp_changes_optimizer_as_megatron_saves_it(tmp_path):
    """The Float16-optimizer PP=2 save with --distributed-optimizer is Megatron-LM's own
    distributed-optimizer save of the same state: distrib_optim.pt byte for byte (the last stage's
    grad buffer: the embedding copy, the decoder's layer, the final norm, the MTP layer, the output
    layer), the rank files' trees equal but for args.save; and back with --no-distributed-optimizer,
    the Float16 save's trees."""
    distopt, float16 = tmp_path / "distopt", tmp_path / "float16"
    reshard(MTP_PP2, distopt, Target(distributed_optimizer=True))
    reshard(MTP_PP2_DISTOPT, float16, Target(distributed_optimizer=False))
    for ours, theirs in ((distopt, MTP_PP2_DISTOPT), (float16, MTP_PP2)):
        assert list(_rank_files(ours)) == ["mp_rank_00_000", "mp_rank_00_001"]
        _same_files(ours, theirs)  # every rank file's tree but args.save, every distrib_optim.pt byte for byte
        for name, path in _rank_files(theirs).items():  # the modules' _metadata too, which _same_files leaves out
            assert _drop_rng(_tree(_rank_files(ours)[name]), "args") == _drop_rng(_tree(path), "args"), name
    assert len(list(distopt.glob("iter_*/*/distrib_optim.pt"))) == 2


def test_mtp_pipeline_layout(tmp_path):
    """A pipeline layout that puts the MTP layer with the loss (``Et|tmL``): read, resharded to another
    (``E|t|t|mL``: two virtual stages per rank, the MTP layer and the embedding copy in rank 1's second)
    and back to the rank files it came from. Megatron-LM's own save of
    the PP=2 run with ``--pipeline-model-parallel-layout Et|tmL`` is ``legacy_pp2_mtp`` but for its
    args' ``save`` and layout (compared once, 2026-11-23), so the fixture with the layout in its args
    stands for it."""
    source = _with_args(tmp_path / "src", MTP_PP2, pipeline_model_parallel_layout="Et|tmL")
    assert registry.describe(source)[1].layout.pp == 2
    assert [n for n, i in registry.describe(source)[1].items.items() if i.kind == "param"] == [
        n for n, i in registry.describe(MTP_PP2)[1].items.items() if i.kind == "param"
    ]
    wide, back = tmp_path / "wide", tmp_path / "back"
    reshard(source, wide, Target(pp=2, pipeline_layout="E|t|t|mL"))
    reshard(wide, back, Target(pp=2, pipeline_layout="Et|tmL"))
    files = _rank_files(wide)
    last = dict(_tree(files["mp_rank_00_001"])[1])
    assert next(k for k, _ in last["model1"][1]) == "embedding.word_embeddings.weight"
    assert any(k.startswith("mtp.layers.0.") for k, _ in last["model1"][1])
    assert not any(k.startswith("mtp.") for k, _ in last["model0"][1])
    # with MTP layers the final norm is built with the last decoder layer: rank 0's second chunk
    first = dict(_tree(files["mp_rank_00_000"])[1])
    assert [k for k, _ in first["model1"][1] if not k.endswith("_extra_state")][-1] == "decoder.final_layernorm.weight"
    assert not any(k.startswith("decoder.final_layernorm") for k, _ in last["model1"][1])
    for name, path in _rank_files(source).items():
        assert _drop_rng(_tree(path)) == _drop_rng(_tree(_rank_files(back)[name])), name
    for out in (wide, back):
        assert not diff(MTP_PP2, out, kinds=STATE_KINDS).different
        assert verify(out).failing() == []


@pytest.mark.parametrize("layout", ["Et|tL", "Etm|tL", "E|t|t|mL|"])
def test_a_layout_that_misplaces_the_mtp_layer_is_refused_with_one_that_fits(layout, tmp_path):
    """A --pipeline-layout that leaves out the MTP layer, puts it before a transformer layer or
    has stages that do not divide over PP was refused with a hint that did not say how a layout
    is written; it now gives one for this model (MTP layer and loss in the last stage) that fits."""
    with pytest.raises(UsageError) as refused:
        reshard(MTP_PP2, tmp_path / "out", Target(pp=2, pipeline_layout=layout))
    hint = refused.value.hint
    assert "its 1 MTP layer as m in one stage that is a rank's last chunk" in hint, hint
    example = hint.rsplit("--pipeline-layout ", 1)[1].strip("'")
    assert example == ("Et|t||mL" if layout.count("|") == 4 else "Et|tmL"), hint  # (5 stages: PP=2 x VPP=2)
    reshard(MTP_PP2, tmp_path / "out", Target(pp=2, pipeline_layout=example))
    assert not diff(MTP_PP2, tmp_path / "out", kinds=STATE_KINDS).different


def test_standalone_mtp_stage_round_trips(tmp_path):
    """PP=4 with the MTP layer in a stage of its own (``Et|t|m|L``) -> PP=1 -> the same layout gives
    Megatron-LM's rank files back (RNG aside): stage 2 holds its copy of the embeddings first, then the
    MTP layer (model, param groups, optimizer state), stage 1 ends with the final norm (built with the
    last decoder layer), stage 3 holds the output layer alone; diff of source and both outputs is empty."""
    one, back = tmp_path / "one", tmp_path / "back"
    reshard(STAGE, one, Target(tp=1, pp=1))
    reshard(one, back, Target(pp=4, pipeline_layout=STAGE_LAYOUT))
    original, again = _rank_files(STAGE), _rank_files(back)
    assert list(original) == list(again) == [f"mp_rank_00_00{p}" for p in range(4)]
    for name in original:
        assert _drop_rng(_tree(original[name])) == _drop_rng(_tree(again[name])), name
    model = {name: [k for k, _ in _model_entries(back, name) if not k.endswith("_extra_state")] for name in again}
    assert model["mp_rank_00_002"][0] == "embedding.word_embeddings.weight"
    assert all(k.startswith("mtp.layers.0.") for k in model["mp_rank_00_002"][1:]) and len(model["mp_rank_00_002"]) == 11
    assert model["mp_rank_00_001"][-1] == "decoder.final_layernorm.weight"
    assert model["mp_rank_00_003"] == ["output_layer.weight"]
    for out in (one, back):
        assert not diff(STAGE, out, kinds=STATE_KINDS).different
        assert verify(out).failing() == []


@pytest.mark.parametrize(
    ("layout", "pp"),
    [("E||tt||m|L", 3), ("Et|tm|L", 3), ("E|t|t||m|L", 3), ("Ettm|L", 2)],
    ids=["mtp-before-the-layers", "mtp-with-the-last-layer", "last-layer-on-a-later-rank", "mtp-in-the-first-chunk"],
)
def test_standalone_mtp_stage_through_other_layouts(layout, pp, tmp_path):
    """The PP=4 ``Et|t|m|L`` save through other layouts megatron-core accepts: MTP layers on a rank read
    before any decoder layer's (``E||tt||m|L``: read first, they must still register after the layers
    when a chunk holds both), with the last decoder layer in one chunk, on a rank after the last
    decoder layer's, and in the first chunk, with the embeddings themselves (no copy). Each is the
    same state; from each, PP=1 is what PP=4 gives directly, and ``Et|t|m|L`` gives Megatron-LM's rank
    files back, distributed optimizer included."""
    direct, via = tmp_path / "direct", tmp_path / "via"
    reshard(STAGE, direct, Target(tp=1, pp=1))
    reshard(STAGE_DISTOPT, via, Target(pp=pp, pipeline_layout=layout))
    assert not diff(STAGE, via, kinds=STATE_KINDS).different
    copies = [n for n, f in _rank_files(via).items() if "embedding.word_embeddings.weight" in str(_tree(f))]
    assert len(copies) == (1 if layout == "Ettm|L" else 2)
    for out, target in ((tmp_path / "one", Target(tp=1, pp=1, distributed_optimizer=False)),
                        (tmp_path / "back", Target(pp=4, pipeline_layout=STAGE_LAYOUT))):  # fmt: skip
        reshard(via, out, target)
        if target.pp == 1:
            ours, theirs = (_tree(_rank_files(root)["mp_rank_00"]) for root in (out, direct))
            assert _drop_rng(ours, "args") == _drop_rng(theirs, "args")  # (args.save: the two runs')
        else:  # (RNG aside: PP=3 has no fourth rank's)
            for name, path in _rank_files(STAGE_DISTOPT).items():
                assert _drop_rng(_tree(_rank_files(out)[name]), "args") == _drop_rng(_tree(path), "args"), name
            for f in STAGE_DISTOPT.glob("iter_*/*/distrib_optim.pt"):
                assert (out / f.relative_to(STAGE_DISTOPT)).read_bytes() == f.read_bytes(), f


@pytest.mark.parametrize(
    ("source", "target", "theirs"),
    [
        (STAGE_DIST, Target(to="megatron"), STAGE),
        (STAGE, Target(distributed_optimizer=True), STAGE_DISTOPT),
        (STAGE_DIST, Target(to="megatron", distributed_optimizer=True), STAGE_DISTOPT),
        (STAGE_FR, Target(to="megatron"), STAGE_DISTOPT),
        (STAGE_DISTOPT, Target(distributed_optimizer=False), STAGE),
        (STAGE, Target(to="megatron-dist"), STAGE_DIST),
        (STAGE_DISTOPT, Target(to="megatron-dist"), STAGE_FR),
        (STAGE_FR, Target(distributed_optimizer=False), STAGE_DIST),
    ],
    ids=[
        "dist-to-legacy",
        "float16-to-distopt",
        "dist-to-distopt",
        "fully_reshardable-to-legacy",
        "distopt-to-float16",
        "legacy-to-dist",
        "distopt-to-fully_reshardable",
        "fully_reshardable-to-float16-dist",
    ],
)
def test_standalone_mtp_stage_is_written_as_megatron_saves_it(source, target, theirs, tmp_path):
    """At the layout it was saved at (``Et|t|m|L``, PP=4), each save written in another format or with
    the other optimizer is Megatron-LM's own save of the same state: legacy rank files' trees (args.save
    aside) and every ``distrib_optim.pt`` byte for byte (the MTP stage's grad buffer: the MTP layer,
    then its embedding copy in a bucket of its own, 64 elements of padding apart), torch_dist every key,
    chunk and record."""
    out = tmp_path / "out"
    reshard(source, out, target)
    if theirs in (STAGE_DIST, STAGE_FR):
        _same_records(out, theirs)
    else:
        _same_files(out, theirs)


def test_mtp_torch_dist_from_legacy_is_what_megatron_saves(tmp_path):
    """Legacy TP=2 -> torch_dist: every key, chunk and tensor record of Megatron's own torch_dist save
    of the same state, the MTP layer's local-spec norms under megatron-core's TransformerEngine keys
    (``mtp.layers.0.transformer_layer.self_attention.linear_qkv.layer_norm_weight``)."""
    out = tmp_path / "dist"
    reshard(MTP_TP2, out, Target(to="megatron-dist"))
    ours, megatron = _metadata(out), _metadata(MTP_DIST)
    assert _chunks(ours) == _chunks(megatron)
    assert "mtp.layers.0.transformer_layer.self_attention.linear_qkv.layer_norm_weight" in megatron.state_dict_metadata
    for key, meta in megatron.state_dict_metadata.items():
        if hasattr(meta, "chunks"):
            for c in meta.chunks:
                assert _record(out, ours, key, c.offsets) == _record(MTP_DIST, megatron, key, c.offsets), key
    assert not diff(MTP_DIST, out, kinds=STATE_KINDS).different
    assert (out / ITER / "common.pt").exists()


def test_mtp_torch_dist_to_legacy_at_pp2(tmp_path):
    """torch_dist TP=2 -> legacy TP=1 x PP=2 (the order megatron-core registers the MTP block's
    modules in, which torch_dist does not keep): the same state, and the rank files of the legacy run
    resharded to that layout."""
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    reshard(MTP_DIST, ours, Target(to="megatron", tp=1, pp=2))
    reshard(MTP_TP2, theirs, Target(tp=1, pp=2))
    assert not diff(MTP_TP2, ours, kinds=STATE_KINDS).different
    for name, path in _rank_files(theirs).items():
        a, b = dict(_tree(path)[1]), dict(_tree(_rank_files(ours)[name])[1])
        assert [k for k, _ in a["model"][1]] == [k for k, _ in b["model"][1]], name
        assert a["optimizer"] == b["optimizer"], name


@pytest.mark.parametrize(
    ("args", "target", "message", "hint"),
    [
        ({}, Target(pp=2, pipeline_layout="Et|tL"), "the pipeline layout places 0 MTP layers", "its 1 MTP layer as m in one stage"),
        (
            {},
            Target(pp=2, pipeline_layout="Et|t|m|L"),
            "the target pipeline layout puts the MTP layers on the first",
            "another pipeline rank (--pipeline-layout); '--to megatron-dist' writes torch_dist",
        ),
        (
            {"decoupled_lr": 0.003},
            Target(tp=1, pp=2),
            "--decoupled-lr at PP > 1: megatron-core would give the MTP stage's copy",
            "'--to megatron-dist' writes torch_dist",
        ),
    ],
)
def test_mtp_refusals(args, target, message, hint, tmp_path):
    """What is not valid is refused before anything is written: a pipeline layout without the model's
    MTP layers, or with them on the first pipeline rank (whose embedding copy
    megatron-core never syncs), --decoupled-lr at PP > 1 (megatron-core leaves the MTP stage's embedding
    copy in the default group, so a run resumed at PP > 1 trains two embeddings)."""
    base = MTP_TP2 if "decoupled_lr" in args else MTP_PP2  # (a legacy source at PP = 2 trained its copy: below)
    source = _with_args(tmp_path / "src", base, **args) if args else base
    out = tmp_path / "out"
    with pytest.raises(UsageError, match=message) as refused:
        reshard(source, out, target)
    assert hint in (refused.value.hint or "")
    assert not out.exists()


def test_mtp_with_decoupled_lr_needs_no_copy_in_the_first_chunk(tmp_path):
    """With --decoupled-lr only a copy of the embeddings drifts (below); MTP layers in the first
    stage's first chunk (``Ettm|L``) use the embeddings themselves, so that layout is written (the
    decoupled group: the embedding and the output layer), and ``Et|tmL`` is refused."""
    source = _with_args(tmp_path / "src", MTP_TP2, decoupled_lr=0.003)
    out = tmp_path / "out"
    reshard(source, out, Target(tp=1, pp=2, pipeline_layout="Ettm|L"))
    assert not diff(source, out, kinds=STATE_KINDS).different
    files = _rank_files(out)
    assert sum("embedding.word_embeddings.weight" in str(_tree(f)) for f in files.values()) == 1
    with pytest.raises(UsageError, match="--decoupled-lr at PP > 1: megatron-core would give the MTP stage's copy"):
        reshard(source, tmp_path / "refused", Target(tp=1, pp=2, pipeline_layout="Et|tmL"))


def test_mtp_with_decoupled_lr_at_pp2_trained_two_embeddings(tmp_path):
    """Megatron-LM's PP=2 save of the MTP model with --decoupled-lr: megatron-core marks only the first
    stage's embedding for the decoupled LR, so the MTP stage's copy takes the same (synced) gradients
    at the default LR: equal moments, other weights. verify --deep names the weights and fp32 copies
    that differ, not the moments, with the cause; reshard refuses it, to either format."""
    source = MG / "legacy_pp2_mtp_decoupled"
    report = verify(source, deep=True)
    base = "embedding.word_embeddings.weight"
    assert sorted(f.item for f in report.failing()) == [base, base + ".fp32"]
    assert all(f.rule == "replica-mismatch" and "--decoupled-lr" in (f.hint or "") for f in report.failing())
    assert "mp_rank_00_001/model_optim_rng.pt" in report.failing()[0].message
    for target in (Target(tp=1, pp=1), Target(to="megatron-dist")):
        with pytest.raises(UsageError, match="the source's MTP stage trained its own copy") as refused:
            reshard(source, tmp_path / "out", target)
        assert "trained two word embeddings" in (refused.value.hint or "")
        assert not (tmp_path / "out").exists()


def test_mtp_on_the_first_pipeline_rank_trained_two_embeddings(tmp_path):
    """Megatron-LM's PP=2 save with the layout ``Et|t|m|L`` (valid for megatron-core: the MTP layer in
    rank 0's second model chunk): that chunk's copy of the embeddings is never synced with the
    embeddings (pretrain_gpt.py's embedding group is rank 0 alone), so the run trained two. It is read
    (the two copies of rank 0's file, and their optimizer state); verify --deep names each pair that
    differs, with the cause; reshard refuses it, to either format, and leaves it as it was."""
    source = MG / "legacy_pp2_mtpfirst"
    before = {p: p.read_bytes() for p in source.rglob("*") if p.is_file()}
    report = verify(source, deep=True)
    mismatched = sorted(f.item for f in report.findings if f.rule == "replica-mismatch")
    base = "embedding.word_embeddings.weight"
    assert mismatched == sorted(base + s for s in ("", ".exp_avg", ".exp_avg_sq", ".fp32"))
    finding = next(f for f in report.findings if f.item == base)
    assert "two copies in iter_0000003/mp_rank_00_000/model_optim_rng.pt (rank 0) differ" in finding.message
    assert "never syncs" in (finding.hint or "")
    assert [f.rule for f in report.failing()] == ["replica-mismatch"] * 4
    for target in (Target(tp=1, pp=1), Target(to="megatron-dist")):
        with pytest.raises(UsageError, match="the source's pipeline layout puts the MTP layers on the first"):
            reshard(source, tmp_path / "out", target)
        assert not (tmp_path / "out").exists()
    assert {p: p.read_bytes() for p in source.rglob("*") if p.is_file()} == before


@pytest.mark.slow
@pytest.mark.parametrize(
    ("source", "target", "padded", "ref"),
    [
        (MTP_TP2, Target(tp=1, pp=2, distributed_optimizer=True), 128, "legacy_tp2_mtp"),
        (MTP_PP2, Target(tp=2, pp=1), 64, "legacy_pp2_mtp"),
        (MTP_DIST, Target(to="megatron", tp=1, pp=2), 128, "legacy_tp2_mtp"),
        (MTP_PP2, Target(to="megatron-dist", tp=2, pp=1), 64, "legacy_pp2_mtp"),
        (MTP_DISTOPT, Target(to="megatron", tp=1, pp=2), 128, "dist_tp2pp2_mtp_distopt"),
        (MTP_DISTOPT, Target(to="megatron", tp=2, pp=1, distributed_optimizer=False), 128, "dist_tp2pp2_mtp_distopt"),
    ],
    ids=[
        "tp2-to-pp2-distopt",
        "pp2-to-tp2",
        "dist-to-legacy-pp2",
        "pp2-to-dist-tp2",
        "dp_reshardable-to-legacy-pp2",
        "dp_reshardable-to-float16-tp2",
    ],
)
def test_megatron_lm_loads_the_mtp_checkpoint(source, target, padded, ref, tmp_path):
    """Oracle: Megatron-LM's load_checkpoint, building the MTP model at the new layout, loads our
    output (legacy, the distributed optimizer's too, or torch_dist); every tensor equals the
    reference; it trains the next step."""
    mlm = _megatron_lm()
    if mlm is None:
        pytest.skip("needs megatron-core and a Megatron-LM source (set MEGATRON_LM)")
    out = tmp_path / "out"
    reshard(source, out, target)
    args = ["--tp", str(target.tp), "--pp", str(target.pp), "--mtp", "--padded-vocab", str(padded)]
    distopt = target.distributed_optimizer or (source == MTP_DISTOPT and target.distributed_optimizer is None)
    args += ["--distopt"] if distopt else []
    args += ["--no-load-rng"] if target.to == "megatron-dist" else []  # (its RNG checks read legacy rank files)
    proc = _oracle(mlm, out, *args, *_ref(ref))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("source", "tp", "pp", "distopt", "ref"),
    [
        (MTP_DISTOPT, 1, 2, None, "dist_tp2pp2_mtp_distopt"),
        (MTP_DIST, 1, 2, None, "legacy_tp2_mtp"),
        (MTP_PP2, 2, 1, True, "legacy_pp2_mtp"),
    ],
    ids=["dp_reshardable-tp1pp2", "dist-tp1pp2", "legacy-pp2-distributed-optimizer-tp2"],
)
def test_megatron_core_loads_the_mtp_output(source, tp, pp, distopt, ref, tmp_path):
    """Oracle: megatron-core's dist_checkpointing.load (the wheel alone), building the MTP model at the
    new TP x PP, loads our torch_dist output with the DistributedOptimizer (fully_reshardable, from the
    dp_reshardable save or the Float16 legacy one) or the Float16 optimizer: every tensor each rank
    holds, the MTP stage's embedding copy included, equals the reference slice, main replicas cover
    each reference tensor exactly once, and from the legacy source each rank's RNG is the intended one."""
    pytest.importorskip("megatron.core")
    out = tmp_path / "out"
    reshard(source, out, Target(to="megatron-dist", tp=tp, pp=pp, distributed_optimizer=distopt))
    padded = registry.describe(source)[1].items["embedding.word_embeddings.weight"].shape[0]
    args = ["--ckpt", str(out), "--tp", str(tp), "--pp", str(pp), "--mtp", "--padded-vocab", str(padded)]
    args += ["--reference", str(MG / f"{ref}.reference.pt")]
    if distopt or source == MTP_DISTOPT:
        args += ["--distopt"]
    if source == MTP_PP2:
        args += ["--rng-source", str(source), "--rng-source-layout", "1", "2"]
    result = _megatron_core_load(*args, nproc=tp * pp)
    assert len(result["ranks"]) == tp * pp and result["groups"] == 2
    for rank in result["ranks"]:
        assert rank["problems"] == [] and rank["checked"] >= 32
        assert rank["rng_matches"] is (True if source == MTP_PP2 else None)


@pytest.mark.slow
@pytest.mark.parametrize("distopt", [True, False])
def test_megatron_lm_loads_the_mtp_layout_checkpoint(distopt, tmp_path):
    """Oracle: from the PP=2 MTP run with the layout ``Et|tmL`` in its args, written with the layout
    ``E|t|t|mL`` (two chunks per rank: the final norm with the last decoder layer in rank 0's second,
    as megatron-core builds it when the model has MTP layers; the MTP layer, the embedding copy and
    the output layer in rank 1's second): Megatron-LM's load_checkpoint with that layout loads it,
    with the distributed optimizer (whose grad buffers would disagree with a misplaced norm) or
    without, every tensor equals the reference and it trains the next step."""
    mlm = _megatron_lm()
    if mlm is None:
        pytest.skip("needs megatron-core and a Megatron-LM source (set MEGATRON_LM)")
    source = _with_args(tmp_path / "src", MTP_PP2, pipeline_model_parallel_layout="Et|tmL")
    out = tmp_path / "out"
    reshard(source, out, Target(pp=2, pipeline_layout="E|t|t|mL", distributed_optimizer=distopt))
    args = ["--tp", "1", "--pp", "2", "--layout", "E|t|t|mL", "--mtp", "--padded-vocab", "64"]
    args += ["--distopt"] if distopt else []
    proc = _oracle(mlm, out, *args, *_ref("legacy_pp2_mtp"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("source", "target", "ref"),
    [
        (MTP_PP2, Target(pp=4, pipeline_layout=STAGE_LAYOUT, distributed_optimizer=True), "legacy_pp2_mtp"),
        (MTP_DIST, Target(to="megatron", tp=1, pp=4, pipeline_layout=STAGE_LAYOUT), "legacy_tp2_mtp"),
        (STAGE, Target(tp=2, pp=1), "legacy_pp4_mtpstage"),
    ],
    ids=["pp2-to-mtp-stage-distopt", "dist-tp2-to-mtp-stage", "mtp-stage-to-tp2"],
)
def test_megatron_lm_loads_the_standalone_mtp_checkpoint(source, target, ref, tmp_path):
    """Oracle: Megatron-LM's load_checkpoint at PP=4 with the layout ``Et|t|m|L`` (the MTP layer in a
    stage of its own; the embedding group pretrain_gpt.py gives it: the first and the MTP stage) loads
    our output of another run's PP=2 or TP=2 save, with the distributed optimizer or the Float16 one, and
    from Megatron-LM's own save at that layout the TP=2 output: every tensor equals the reference (the
    MTP stage's embedding copy too); it trains the next step."""
    mlm = _megatron_lm()
    if mlm is None:
        pytest.skip("needs megatron-core and a Megatron-LM source (set MEGATRON_LM)")
    out = tmp_path / "out"
    reshard(source, out, target)
    padded = registry.describe(out)[1].items["embedding.word_embeddings.weight"].shape[0]
    args = ["--tp", str(target.tp or 1), "--pp", str(target.pp), "--mtp", "--padded-vocab", str(padded)]
    args += ["--layout", STAGE_LAYOUT] if target.pipeline_layout else []
    args += ["--distopt"] if target.distributed_optimizer else []
    proc = _oracle(mlm, out, *args, *_ref(ref))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("source", "target", "ref"),
    [
        (MOE_MTP, Target(tp=1, ep=1), "legacy_tp2ep2_mtp"),
        (MOE_MTP, Target(tp=1, ep=2, distributed_optimizer=True), "legacy_tp2ep2_mtp"),
        (MOE_MTP, Target(tp=1, pp=2, ep=2), "legacy_tp2ep2_mtp"),
        (MOE_MTP, Target(tp=2, ep=2, etp=1), "legacy_tp2ep2_mtp"),
        (MOE_MTP_DIST_DP, Target(to="megatron", tp=1, ep=2), "dist_tp2ep2_mtp_distopt"),
    ],
    ids=["tp1ep1", "tp1ep2-distopt", "tp1pp2ep2", "tp2ep2etp1", "dp_reshardable-to-legacy-tp1ep2"],
)
def test_megatron_lm_loads_the_mtp_checkpoint_with_routed_experts(source, target, ref, tmp_path):
    """Oracle: Megatron-LM's load_checkpoint, building the MoE + MTP model at the new TP and EP (the
    experts in the dense optimizer at EP=1, in the expert optimizer of the chain at EP=2; at PP=2 the MTP
    layer and its experts in the last stage, with its embedding copy; at ETP=1 the experts, the MTP
    layer's too, whole on their EP rank), loads our legacy output,
    optimizer and RNG on: every tensor equals the reference; it trains the next step."""
    mlm = _megatron_lm()
    if mlm is None:
        pytest.skip("needs megatron-core and a Megatron-LM source (set MEGATRON_LM)")
    out = tmp_path / "out"
    reshard(source, out, target)
    args = [
        "--tp",
        str(target.tp),
        "--pp",
        str(target.pp or 1),
        "--ep",
        str(target.ep),
        "--mtp",
        "--padded-vocab",
        "128",
    ]
    args += ["--distopt"] if target.distributed_optimizer or source == MOE_MTP_DIST_DP else []
    args += ["--etp", str(target.etp)] if target.etp else []
    proc = _oracle(mlm, out, *args, *_ref(ref))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "every check passed" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    ("source", "ep", "distopt", "ref"),
    [
        (MOE_MTP, 1, None, "legacy_tp2ep2_mtp"),
        (MOE_MTP_DIST_DP, 2, None, "dist_tp2ep2_mtp_distopt"),
        (MOE_MTP_DIST_DP, 1, None, "dist_tp2ep2_mtp_distopt"),
    ],
    ids=["legacy-tp1ep1", "dp_reshardable-tp1ep2", "dp_reshardable-tp1ep1"],
)
def test_megatron_core_loads_the_mtp_output_with_routed_experts(source, ep, distopt, ref, tmp_path):
    """Oracle: megatron-core's dist_checkpointing.load (the wheel alone) loads our torch_dist output of
    the MoE + MTP model at TP=1 (the MTP experts' records on their expert axis; from the dp_reshardable
    save, the distributed optimizer's fully_reshardable layout): every tensor each rank holds equals the
    reference slice, and the main replicas cover each reference tensor exactly once."""
    pytest.importorskip("megatron.core")
    out = tmp_path / "out"
    reshard(source, out, Target(to="megatron-dist", tp=1, ep=ep, distributed_optimizer=distopt))
    args = ["--ckpt", str(out), "--tp", "1", "--pp", "1", "--ep", str(ep), "--mtp", "--padded-vocab", "128"]
    args += ["--reference", str(MG / f"{ref}.reference.pt")]
    args += ["--distopt"] if source == MOE_MTP_DIST_DP else []
    result = _megatron_core_load(*args, nproc=ep)
    assert len(result["ranks"]) == ep
    for rank in result["ranks"]:
        assert rank["problems"] == [] and rank["checked"] >= 60


@pytest.mark.parametrize(
    ("fixture", "said"),
    [
        ("legacy_pp2_mtpfirst", "the source and target pipeline layouts put the MTP layers on the first pipeline rank"),
        ("legacy_pp2_mtp_decoupled", "the source's MTP stage trained its own copy of the word embeddings"),
    ],
)
def test_a_refusal_both_layouts_share_is_said_once(fixture, said, tmp_path):
    """convert keeps the source's layout, so a layout refused for the source is refused for the
    target too: the message said the same thing twice, the second time as if about another layout."""
    r = run_cli("convert", FIXTURES / "megatron" / fixture, "-o", tmp_path / "out", "--to", "megatron")
    assert_clean(r, 2, said)
    assert r.stderr.count("copy of the word embeddings") == 1, r.stderr
    assert not (tmp_path / "out").exists()
