"""reshard / convert to Megatron ``torch_dist``: the layout Megatron's own save writes, exact round
trips, megatron-core's ``dist_checkpointing.load`` as the oracle at new TP/PP."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ckpttool import registry
from ckpttool.diff import diff
from ckpttool.errors import UsageError
from ckpttool.reshard import Target, reshard
from ckpttool.verify import verify
from tests._compare import same_bits
from tests._ranks import run_ranks
from tests.conftest import FIXTURES, cli_env, load_pt

LEGACY = FIXTURES / "megatron" / "legacy_tp2pp2"
DIST = FIXTURES / "megatron" / "dist_tp2pp2"
DISTOPT = FIXTURES / "megatron" / "legacy_tp2pp2_distopt"
DIST_DP = FIXTURES / "megatron" / "dist_tp2pp2dp2_distopt"  # distributed optimizer, dp_reshardable
DIST_FR = FIXTURES / "megatron" / "dist_tp2pp2dp2_distopt_fr"  # the same state, fully_reshardable
MOE_DP = FIXTURES / "megatron" / "dist_pp2ep2_distopt"  # MoE PP=2 EP=2, chained distributed optimizers
MOE_FR = FIXTURES / "megatron" / "dist_pp2ep2_distopt_fr"  # the same state, fully_reshardable
MOE_LEGACY_DISTOPT = FIXTURES / "megatron" / "legacy_pp2ep2_distopt"
ETP_DP = FIXTURES / "megatron" / "dist_tp2ep2etp1_distopt"  # MoE TP=2 DP=2, experts ETP=1 EP=2, distopt
ETP_FR = FIXTURES / "megatron" / "dist_tp2ep2etp1_distopt_fr"  # the same state, fully_reshardable
ETP_LEGACY = FIXTURES / "megatron" / "legacy_tp2ep2etp1_distopt"  # the same state, legacy distrib_optim.pt
ITER = "iter_0000003"


def _metadata(root: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(root / ITER)).read_metadata()


def _chunks(md: Any) -> dict[str, Any]:
    """key -> (dtype, global shape, sorted chunks) for tensors, None for objects."""
    out: dict[str, Any] = {}
    for key, meta in md.state_dict_metadata.items():
        if hasattr(meta, "chunks"):
            chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks)
            out[key] = (meta.properties.dtype, tuple(meta.size), chunks)
        else:
            out[key] = None
    return out


def _record(root: Path, md: Any, key: str, offsets: Any = None) -> bytes:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    info = md.storage_data[MetadataIndex(key) if offsets is None else MetadataIndex(key, offsets)]
    with open(root / ITER / info.relative_path, "rb") as f:
        f.seek(info.offset)
        return f.read(info.length)


def _same(a: Any, b: Any) -> bool:
    import numpy as np
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and same_bits(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def test_from_legacy_is_what_megatron_saves(tmp_path):
    """Legacy TP=2 x PP=2 -> torch_dist at the same layout: the keys, global shapes, dtypes and
    chunks are those of Megatron's own torch_dist save of the same training state, and every tensor
    chunk and every ShardedObject (RNG, _extra_state) record is Megatron's byte for byte."""
    out = tmp_path / "dist"
    result = reshard(LEGACY, out, Target(to="megatron-dist"))
    assert result.plan.format == "megatron-dist" and result.plan.layout == {"tp": 2, "pp": 2}
    ours, megatron = _metadata(out), _metadata(DIST)
    assert _chunks(ours) == _chunks(megatron)
    for key, meta in megatron.state_dict_metadata.items():
        if hasattr(meta, "chunks"):
            for c in meta.chunks:
                assert _record(out, ours, key, c.offsets) == _record(DIST, megatron, key, c.offsets), key
        else:
            assert _record(out, ours, key) == _record(DIST, megatron, key), key
    assert json.loads((out / ITER / "metadata.json").read_text()) == json.loads(
        (DIST / ITER / "metadata.json").read_text()
    )

    common = load_pt(out / ITER / "common.pt")
    theirs = load_pt(DIST / ITER / "common.pt")
    assert list(common) == list(theirs)
    assert (
        _same(common["optimizer"], theirs["optimizer"])
        and common["opt_param_scheduler"] == theirs["opt_param_scheduler"]
    )
    assert common["content_metadata"] == theirs["content_metadata"] and common["iteration"] == 3
    assert common["args"].ckpt_format == "torch_dist" and common["args"].tensor_model_parallel_size == 2
    assert common["args"].use_dist_ckpt is True  # (Megatron-LM derives it from ckpt_format: it was left False)
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert not diff(DIST, out).different
    across = diff(LEGACY, out)  # the RNG and _extra_state entries are named differently in the two layouts
    assert across.identical == across.compared == 108 and not across.values and not across.changed_meta
    report = verify(out)
    assert report.failing() == [] and report.seal is not None


def test_round_trip_is_exact(tmp_path):
    """torch_dist TP=2 x PP=2 -> TP=1 x PP=1 -> TP=2 x PP=2: every tensor record, ShardedObject
    record of _extra_state and RNG of rank (0, 0) equal Megatron's original byte for byte."""
    one, back = tmp_path / "tp1", tmp_path / "tp2pp2"
    reshard(DIST, one, Target(tp=1, pp=1))
    reshard(one, back, Target(tp=2, pp=2))
    assert registry.describe(one)[1].layout.tp == 1 and registry.describe(back)[1].layout.pp == 2
    ours, megatron = _metadata(back), _metadata(DIST)
    assert _chunks(ours) == _chunks(megatron)
    lost = 0
    for key, meta in megatron.state_dict_metadata.items():
        if hasattr(meta, "chunks"):
            for c in meta.chunks:
                assert _record(back, ours, key, c.offsets) == _record(DIST, megatron, key, c.offsets), key
        elif key.startswith("rng_state/") and key != "rng_state/shard_0.0_2.2":
            lost += 1  # a TP=1 x PP=1 checkpoint keeps one rank's RNG: the others cannot come back
        else:
            assert _record(back, ours, key) == _record(DIST, megatron, key), key
    assert lost == 3
    assert not diff(DIST, one).different and not diff(DIST, back).different


def test_rng_a_legacy_source_carries_comes_back_to_its_ranks_in_torch_dist(tmp_path):
    """legacy TP=2 x PP=2 -> legacy TP=1 x PP=1 (which carries the other three ranks' RNG under
    ckpttool_rng_state) -> torch_dist TP=2 x PP=2: each rank's RNG record is the one the legacy
    source's rank had, as the direct legacy -> torch_dist output writes it. Every rank got rank
    (0, 0)'s, the plan said the carried states were not written, and common.pt held them all."""
    one, back, direct = tmp_path / "tp1", tmp_path / "dist", tmp_path / "direct"
    reshard(LEGACY, one, Target(tp=1, pp=1))
    result = reshard(one, back, Target(to="megatron-dist", tp=2, pp=2))
    reshard(LEGACY, direct, Target(to="megatron-dist", tp=2, pp=2))
    assert any("which get their own back" in n for n in result.plan.notes), result.plan.notes
    assert not any("is not written" in n or "RNG streams" in n for n in result.plan.notes), result.plan.notes
    ours, theirs = _metadata(back), _metadata(direct)
    keys = sorted(k for k in theirs.state_dict_metadata if k.startswith("rng_state/"))
    assert len(keys) == 4 and keys == sorted(k for k in ours.state_dict_metadata if k.startswith("rng_state/"))
    records = {key: _record(back, ours, key) for key in keys}
    assert records == {key: _record(direct, theirs, key) for key in keys}
    assert len(set(records.values())) == 4  # (four states, not one four times)
    common = load_pt(back / ITER / "common.pt")
    assert not [k for k in common if k.startswith("ckpttool_")] and list(common) == list(load_pt(direct / ITER / "common.pt"))
    # to fewer ranks: the states dropped are named (from either source)
    for source in (LEGACY, one, DIST):
        plan = reshard(source, tmp_path / f"{source.name}-1", Target(to="megatron-dist", tp=1, pp=1)).plan
        said = [n for n in plan.notes if "is not written: torch_dist keeps the RNG of its own ranks only" in n]
        assert len(said) == 1 and "([tp=0,pp=1], [tp=1,pp=0], [tp=1,pp=1])" in said[0], plan.notes


def _same_records(out: Path, theirs: Path, *, rng: bool = True) -> None:
    """``out``'s keys, dtypes, global shapes and chunks are ``theirs``', and every record (tensor
    chunk, ShardedObject; ``rng`` False: the RNG states aside) is theirs byte for byte."""
    ours, megatron = _metadata(out), _metadata(theirs)
    assert _chunks(ours) == _chunks(megatron)
    for key, meta in megatron.state_dict_metadata.items():
        if not rng and key.startswith("rng_state/"):
            continue
        for offsets in [c.offsets for c in meta.chunks] if hasattr(meta, "chunks") else [None]:
            assert _record(out, ours, key, offsets) == _record(theirs, megatron, key, offsets), key


@pytest.mark.parametrize("source", [DIST_DP, DIST_FR], ids=["dp_reshardable", "fully_reshardable"])
def test_distributed_optimizer_is_written_as_megatron_saves_it_fully_reshardable(source, tmp_path):
    """A torch_dist checkpoint saved with the distributed optimizer, in Megatron-LM's default
    dp_reshardable layout (bucket space, which megatron-core reshards only across DP) or in
    fully_reshardable, rewritten at the same TP=2 x PP=2: every key, chunk and record is
    Megatron's own fully_reshardable save of the same state, byte for byte, and so are common.pt's
    optimizer part and content metadata."""

    out = tmp_path / "out"
    result = reshard(source, out, Target(to="megatron-dist"))
    assert any("fully_reshardable" in n and "--use-distributed-optimizer" in n for n in result.plan.notes)
    _same_records(out, DIST_FR)
    common = load_pt(out / ITER / "common.pt")
    theirs = load_pt(DIST_FR / ITER / "common.pt")
    assert list(common) == list(theirs) and _same(common["optimizer"], theirs["optimizer"])
    assert common["content_metadata"] == theirs["content_metadata"]
    assert common["args"].use_distributed_optimizer is True
    assert not diff(source, out).different and verify(out).failing() == []


def test_distributed_optimizer_round_trip_is_exact(tmp_path):
    """dp_reshardable TP=2 x PP=2 -> TP=1 x PP=1 -> TP=2 x PP=2: Megatron's fully_reshardable save
    of the same state, record for record (the RNG of the ranks a TP=1 x PP=1 file cannot keep aside)."""
    one, back = tmp_path / "tp1", tmp_path / "back"
    reshard(DIST_DP, one, Target(tp=1, pp=1))
    reshard(one, back, Target(tp=2, pp=2))
    _, m = registry.describe(one)
    assert (m.layout.tp, m.layout.pp) == (1, 1) and m.extras["distrib_optim_sharding_type"] == "fully_reshardable"
    ours, megatron = _metadata(back), _metadata(DIST_FR)
    assert _chunks(ours) == _chunks(megatron)
    for key, meta in megatron.state_dict_metadata.items():
        if key.startswith("rng_state/") and key != "rng_state/shard_0.0_2.2":
            continue
        for offsets in [c.offsets for c in meta.chunks] if hasattr(meta, "chunks") else [None]:
            assert _record(back, ours, key, offsets) == _record(DIST_FR, megatron, key, offsets), key
    assert not diff(DIST_DP, one).different and not diff(DIST_FR, back).different


@pytest.mark.parametrize("source", [MOE_DP, MOE_FR], ids=["dp_reshardable", "fully_reshardable"])
def test_experts_with_the_distributed_optimizer_are_written_as_megatron_saves_them(source, tmp_path):
    """The MoE fixture (PP=2 x EP=2) saved with the distributed optimizer: megatron-core chains a dense
    and an expert optimizer, whose dp_reshardable buckets (``chained_0.`` / ``chained_1.``, each with
    its own dp_group_idx) are de-bucketed and written at the same layout as Megatron-LM's own
    fully_reshardable save of the same run, record for record; common.pt's optimizer is the chain
    ``{0: dense, 1: experts}`` as Megatron saves it."""
    out = tmp_path / "out"
    result = reshard(source, out, Target(to="megatron-dist"))
    assert any("fully_reshardable" in n for n in result.plan.notes)
    _same_records(out, MOE_FR)
    common = load_pt(out / ITER / "common.pt")
    theirs = load_pt(MOE_FR / ITER / "common.pt")
    assert sorted(common["optimizer"]) == [0, 1]
    assert [g["is_expert_parallel"] for g in common["optimizer"][1]["optimizer"]["param_groups"]] == [True]
    assert _same(common["optimizer"], theirs["optimizer"])
    assert common["content_metadata"] == theirs["content_metadata"]
    assert not diff(source, out).different and verify(out).failing() == []


def test_experts_with_the_distributed_optimizer_round_trip(tmp_path):
    """dp_reshardable PP=2 x EP=2 -> TP=2 x PP=1 x EP=4 -> TP=1 x PP=2 x EP=2: Megatron's own
    fully_reshardable save again, record for record (the RNG of the ranks the middle layout cannot
    keep aside)."""
    wide, back = tmp_path / "wide", tmp_path / "back"
    reshard(MOE_DP, wide, Target(tp=2, pp=1, ep=4))
    reshard(wide, back, Target(tp=1, pp=2, ep=2))
    _, m = registry.describe(wide)
    assert (m.layout.tp, m.layout.pp, m.layout.ep) == (2, 1, 4)
    _same_records(back, MOE_FR, rng=False)  # (the RNG of the ranks the middle layout cannot keep aside)
    assert not diff(MOE_DP, wide).different and not diff(MOE_FR, back).different


@pytest.mark.parametrize(
    ("source", "legacy", "theirs", "pp"),
    [
        ("dist_pp2ep2", "legacy_pp2ep2", "dist_pp2ep2", 2),
        ("dist_pp2ep2_distopt", "legacy_pp2ep2_distopt", "dist_pp2ep2_distopt_fr", 2),
        ("dist_tp2ep2_mtp", "legacy_tp2ep2_mtp", "dist_tp2ep2_mtp", 1),
    ],
    ids=["float16", "dp_reshardable", "mtp"],
)
def test_experts_move_between_the_dense_and_the_expert_optimizer(source, legacy, theirs, pp, tmp_path):
    """torch_dist at EP=2 -> EP=1 -> EP=2. megatron-core puts the routed experts in param groups of
    their own, in an expert optimizer chained after the dense one, only under expert parallelism;
    neither torch_dist optimizer layout names the groups' members, so ckpttool infers them by
    megatron-core's standard rule. At EP=1 common.pt holds one optimizer, and the output is, record
    for record and in common.pt's optimizer, what the legacy save of the same run gives there
    (whose files name each group's parameters); back at EP=2 it is Megatron-LM's own save again,
    record for record (the RNG of the ranks EP=1 cannot keep aside) and in common.pt's optimizer
    chain."""
    src, one, back, via = FIXTURES / "megatron" / source, tmp_path / "ep1", tmp_path / "back", tmp_path / "via"
    reshard(src, one, Target(pp=1, ep=1))
    reshard(FIXTURES / "megatron" / legacy, via, Target(to="megatron-dist", pp=1, ep=1))
    _same_records(one, via, rng=False)
    common = load_pt(one / ITER / "common.pt")
    assert common["args"].expert_model_parallel_size == 1
    assert "param_groups" in common["optimizer"].get("optimizer", {})  # one optimizer, not a chain
    assert [g["is_expert_parallel"] for g in common["optimizer"]["optimizer"]["param_groups"]] == [False, False]
    assert _same(common["optimizer"], load_pt(via / ITER / "common.pt")["optimizer"])
    assert not diff(src, one).different and verify(one).failing() == []
    reshard(one, back, Target(pp=pp, ep=2))
    _same_records(back, FIXTURES / "megatron" / theirs, rng=False)
    ours, megatron = load_pt(back / ITER / "common.pt"), load_pt(FIXTURES / "megatron" / theirs / ITER / "common.pt")
    assert sorted(ours["optimizer"]) == [0, 1] and _same(ours["optimizer"], megatron["optimizer"])
    assert not diff(src, back).different and verify(back).failing() == []


def test_experts_change_optimizer_only_when_the_groups_fit_megatron_s_rule(tmp_path):
    """Between EP=1 and EP > 1 from torch_dist, param groups the standard rule cannot tell apart, an
    expert group with no like dense group, or a dense and an expert optimizer whose steps differ are
    refused, naming what does not fit, and nothing is written."""
    from tests.conftest import rewritten_copy

    def lr_mult(obj: Any) -> None:
        obj["optimizer"][1]["optimizer"]["param_groups"][0]["lr_mult"] = 2.0

    def step(obj: Any) -> None:  # (as floats: the restricted unpickler's tree holds the tensors by reference)
        for k, value in ((0, 3.0), (1, 4.0)):
            obj["optimizer"][k]["optimizer"]["state"]["common_step"] = value

    def extra_group(obj: Any) -> None:
        groups = obj["optimizer"]["optimizer"]["param_groups"]
        groups.append({**groups[0], "wd_mult": 0.5})

    one = tmp_path / "one"
    reshard(FIXTURES / "megatron" / "dist_pp2ep2", one, Target(pp=1, ep=1))
    for name, source, change, message in [
        ("lr", "dist_pp2ep2", lr_mult, r"the expert optimizer's param group \(wd_mult=1.0, lr_mult=2.0, is_decoup"),
        ("step", "dist_pp2ep2", step, "the dense and the expert optimizer's states differ beside their param groups"),
        ("extra", one, extra_group, "1 of its param groups would hold no parameter under megatron-core's standard"),
    ]:
        changed = rewritten_copy(
            tmp_path / name, FIXTURES / "megatron" / source if isinstance(source, str) else source, change,
            "iter_*/common.pt",
        )
        with pytest.raises(UsageError, match=message) as caught:
            reshard(changed, tmp_path / "out", Target(pp=1, ep=2 if source == one else 1))
        assert caught.value.args[0].startswith(f"EP {1 if source == one else 2} -> {2 if source == one else 1} from")
        assert not (tmp_path / "out").exists()

    def same_step(obj: Any) -> None:  # the control: the same step, as floats too, merges
        for k in (0, 1):
            obj["optimizer"][k]["optimizer"]["state"]["common_step"] = 3.0

    changed = rewritten_copy(tmp_path / "same", FIXTURES / "megatron" / "dist_pp2ep2", same_step, "iter_*/common.pt")
    reshard(changed, tmp_path / "out", Target(pp=1, ep=1))
    assert load_pt(tmp_path / "out" / ITER / "common.pt")["optimizer"]["optimizer"]["state"]["common_step"] == 3.0

    def empty_experts(obj: Any) -> None:  # rank 0 held no experts: megatron-core saves no step for them
        obj["optimizer"][1]["optimizer"]["state"].pop("common_step")

    changed = rewritten_copy(tmp_path / "empty", FIXTURES / "megatron" / "dist_pp2ep2", empty_experts, "iter_*/common.pt")
    reshard(changed, tmp_path / "merged", Target(pp=1, ep=1))
    assert _same(load_pt(tmp_path / "merged" / ITER / "common.pt")["optimizer"], load_pt(one / ITER / "common.pt")["optimizer"])

    def no_optimizer(obj: Any) -> None:  # saved without optimizer state: nothing to move
        obj.pop("optimizer")

    for source, ep in (("dist_pp2ep2", 1), (one, 2)):
        bare = rewritten_copy(
            tmp_path / f"bare{ep}", FIXTURES / "megatron" / source if isinstance(source, str) else source,
            no_optimizer, "iter_*/common.pt",
        )
        reshard(bare, tmp_path / f"bare{ep}-out", Target(pp=1, ep=ep))
        assert "optimizer" not in load_pt(tmp_path / f"bare{ep}-out" / ITER / "common.pt")


@pytest.mark.parametrize(
    "source", [ETP_DP, ETP_FR, ETP_LEGACY], ids=["dp_reshardable", "fully_reshardable", "legacy"]
)
def test_expert_tensor_parallelism_with_the_distributed_optimizer_is_written_as_megatron_saves_it(source, tmp_path):
    """The MoE model at TP=2 with the experts whole (ETP=1, EP=2) and the distributed optimizer: the
    experts' buckets (chained_1, dp_group_idx the expert TP x EP rank), or the legacy save's
    distrib_optim.pt of the same run, de-bucketed and written at the same layout are Megatron-LM's own
    fully_reshardable save of the run, record for record, and common.pt's optimizer chain too;
    through TP=1 EP=4 (experts one a rank) and back, likewise."""
    out = tmp_path / "out"
    reshard(source, out, Target(to="megatron-dist"))
    _same_records(out, ETP_FR)
    common, theirs = load_pt(out / ITER / "common.pt"), load_pt(ETP_FR / ITER / "common.pt")
    assert list(common) == list(theirs) and _same(common["optimizer"], theirs["optimizer"])
    assert common["content_metadata"] == theirs["content_metadata"]
    assert common["args"].expert_tensor_parallel_size == 1
    assert not diff(source, out).different and verify(out).failing() == []
    if source != ETP_DP:
        return
    wide, back = tmp_path / "wide", tmp_path / "back"
    reshard(source, wide, Target(tp=1, ep=4))
    reshard(wide, back, Target(tp=2, ep=2, etp=1))
    assert load_pt(wide / ITER / "common.pt")["args"].expert_tensor_parallel_size == 1
    _same_records(back, ETP_FR, rng=False)  # (the RNG of the ranks the middle layout cannot keep aside)
    assert not diff(source, wide).different and not diff(ETP_FR, back).different
    # the PP=2 EP=2 run's legacy distrib_optim.pt (ETP = TP = 1) at this layout: the keys and chunks
    # of Megatron-LM's save at it (the vocabulary aside: that run padded it to 64 rows, this one 128)
    legacy = tmp_path / "legacy"
    reshard(FIXTURES / "megatron" / "legacy_pp2ep2_distopt", legacy, Target(to="megatron-dist", tp=2, pp=1, etp=1))
    ours, megatron = _chunks(_metadata(legacy)), _chunks(_metadata(ETP_FR))
    vocab = {k for k in megatron if k.endswith(("embedding.word_embeddings.weight", "output_layer.weight"))}
    assert len(vocab) == 8 and {k: v for k, v in ours.items() if k not in vocab} == {
        k: v for k, v in megatron.items() if k not in vocab
    }


def test_expert_tensor_parallel_legacy_save_to_torch_dist_is_what_megatron_saves(tmp_path):
    """Megatron-LM's legacy save of the TP=2 EP=2 ETP=1 run (world 2: mp_rank_00_000 and
    mp_rank_01_001 only) written as torch_dist is the run's own torch_dist save, record for
    record, RNG included: the RNG shard of TP rank 1 comes from the file TP rank 1 saved
    (mp_rank_01_001, EP rank 1), not from the EP rank 0 file of another TP rank."""
    out = tmp_path / "out"
    reshard(FIXTURES / "megatron" / "legacy_tp2ep2etp1", out, Target(to="megatron-dist"))
    _same_records(out, FIXTURES / "megatron" / "dist_tp2ep2etp1")
    assert verify(out).failing() == []


def test_legacy_distributed_optimizer_to_torch_dist_is_what_megatron_saves(tmp_path):
    """The legacy save of the MoE distributed-optimizer run (distrib_optim.pt, chained) written as
    torch_dist keeps the distributed optimizer: every key, chunk and record (params, fp32 mains,
    moments, RNG, _extra_state) and common.pt's optimizer chain and content metadata are Megatron-LM's
    own fully_reshardable save of the same run, byte for byte. The Float16 run's legacy save with
    --distributed-optimizer gives the same keys, chunks and common.pt optimizer (its values differ
    by rounding: another run)."""
    out = tmp_path / "out"
    result = reshard(FIXTURES / "megatron" / "legacy_pp2ep2_distopt", out, Target(to="megatron-dist"))
    assert any("fully_reshardable" in n for n in result.plan.notes)
    _same_records(out, MOE_FR)
    common, theirs = load_pt(out / ITER / "common.pt"), load_pt(MOE_FR / ITER / "common.pt")
    assert list(common) == list(theirs) and _same(common["optimizer"], theirs["optimizer"])
    assert common["content_metadata"] == theirs["content_metadata"]

    asked = tmp_path / "asked"
    reshard(FIXTURES / "megatron" / "legacy_pp2ep2", asked, Target(to="megatron-dist", distributed_optimizer=True))
    assert _chunks(_metadata(asked)) == _chunks(_metadata(MOE_FR))
    assert _same(load_pt(asked / ITER / "common.pt")["optimizer"], theirs["optimizer"])
    state = ["param", "optim", "master", "scheduler", "counter"]  # (RNG: named per rank file in legacy)
    assert not diff(FIXTURES / "megatron" / "legacy_pp2ep2", asked, kinds=state).different
    assert verify(asked).failing() == []


def test_torch_dist_changes_optimizer_both_ways(tmp_path):
    """Between torch_dist checkpoints, --distributed-optimizer and --no-distributed-optimizer move
    only the step (the Float16 optimizer's common_step <-> a float in each of the distributed
    optimizer's param groups; neither layout names the groups' members) and rename the fp32 state
    (``fp32_param`` <-> ``param``). Megatron-LM's own Float16 save (TP=2 x PP=2) through the
    distributed optimizer and back is itself again, every record byte for byte and common.pt's
    optimizer equal; its distributed-optimizer saves (dense dp_reshardable and fully_reshardable,
    MoE chained) through the Float16 optimizer and back are its fully_reshardable save."""
    f16 = FIXTURES / "megatron" / "dist_tp2pp2"
    there, back = tmp_path / "there", tmp_path / "back"
    reshard(f16, there, Target(to="megatron-dist", distributed_optimizer=True))
    common = load_pt(there / ITER / "common.pt")
    assert common["optimizer"]["param_state_sharding_type"] == "fully_reshardable"
    assert {g["step"] for g in common["optimizer"]["optimizer"]["param_groups"]} == {3.0}
    assert common["content_metadata"]["distrib_optim_sharding_type"] == "fully_reshardable"
    assert common["args"].use_distributed_optimizer
    assert not diff(f16, there).different and verify(there).failing() == []
    reshard(there, back, Target(to="megatron-dist", distributed_optimizer=False))
    _same_records(back, f16)
    ours, theirs = load_pt(back / ITER / "common.pt"), load_pt(f16 / ITER / "common.pt")
    assert list(ours) == list(theirs) and _same(ours["optimizer"], theirs["optimizer"])
    assert ours["content_metadata"] == theirs["content_metadata"] and not ours["args"].use_distributed_optimizer
    for source, fr in [(DIST_DP, DIST_FR), (DIST_FR, DIST_FR), (MOE_DP, MOE_FR)]:
        plain, again = tmp_path / f"{source.name}-f16", tmp_path / f"{source.name}-again"
        reshard(source, plain, Target(to="megatron-dist", distributed_optimizer=False))
        optimizer = load_pt(plain / ITER / "common.pt")["optimizer"]
        for member in optimizer.values() if source == MOE_DP else [optimizer]:
            assert list(member) == ["optimizer"] and list(member["optimizer"]) == ["state", "param_groups"]
        assert not diff(source, plain).different and verify(plain).failing() == []
        reshard(plain, again, Target(to="megatron-dist", distributed_optimizer=True))
        _same_records(again, fr)
        ours, theirs = load_pt(again / ITER / "common.pt"), load_pt(fr / ITER / "common.pt")
        assert _same(ours["optimizer"], theirs["optimizer"]) and ours["content_metadata"] == theirs["content_metadata"]


FP32 = FIXTURES / "megatron" / "dist_tp2_fp32"  # an fp32 model: megatron-core's FP32Optimizer
FP32_LEGACY = FIXTURES / "megatron" / "legacy_tp2_fp32"  # the same state saved legacy
FP32_DISTOPT = FIXTURES / "megatron" / "dist_tp2_fp32_distopt"  # the same state, distributed optimizer (dp_reshardable)


def _rank_trees(root: Path, rng: bool = True) -> dict[str, Any]:
    """Each legacy rank file's entries (args aside, and the RNG unless ``rng``; the model's entries
    without the modules' _metadata, which torch_dist does not keep), tensors by their digest."""
    from tests.test_reshard import _rank_files, _tree

    out = {}
    for name, path in _rank_files(root).items():
        entries = dict(_tree(path)[1])
        drop = {"args"} if rng else {"args", "rng_state"}
        out[name] = {k: v[1] if k == "model" else v for k, v in entries.items() if k not in drop}
    return out


def test_fp32_model_is_written_as_megatron_saves_it(tmp_path):
    """An fp32 model (no --bf16): megatron-core's FP32Optimizer keeps no main copy and saves its
    torch optimizer's state dict bare in common.pt (``{'state': {'common_step'}, 'param_groups'}``).
    Its legacy save -> torch_dist at the same layout is Megatron's own torch_dist save of the same
    state: every record byte for byte, common.pt's optimizer equal. Before, the state dict was
    wrapped as the Float16 optimizer's (``{'optimizer': ...}``), which FP32Optimizer cannot load.
    Its torch_dist save -> legacy is its legacy save: every entry of every rank file."""
    out, back = tmp_path / "dist", tmp_path / "legacy"
    reshard(FP32_LEGACY, out, Target(to="megatron-dist"))
    _same_records(out, FP32)
    ours, theirs = load_pt(out / ITER / "common.pt"), load_pt(FP32 / ITER / "common.pt")
    assert list(ours["optimizer"]) == ["state", "param_groups"]
    assert _same(ours["optimizer"], theirs["optimizer"]) and ours["content_metadata"] == theirs["content_metadata"]
    reshard(FP32, back, Target(to="megatron"))
    assert _rank_trees(back) == _rank_trees(FP32_LEGACY)


def test_fp32_model_changes_optimizer_both_ways(tmp_path):
    """An fp32 model between the FP32 and the distributed optimizer. The distributed optimizer's
    main params are the parameters themselves (the fixture driver checks it on the live run), which
    the FP32 optimizer keeps no copy of. From the distributed-optimizer run (dp_reshardable),
    --no-distributed-optimizer gives the FP32 run's own torch_dist save, every record byte for byte
    and common.pt's optimizer equal, and with --to megatron its own legacy save. The FP32 run (either
    save) with --distributed-optimizer gives what resharding the distributed-optimizer run writes
    (fully_reshardable): every record, the main params being the parameters' bytes; legacy
    distrib_optim.pt too, and back."""
    plain, legacy = tmp_path / "plain", tmp_path / "legacy"
    reshard(FP32_DISTOPT, plain, Target(to="megatron-dist", distributed_optimizer=False))
    _same_records(plain, FP32)
    ours, theirs = load_pt(plain / ITER / "common.pt"), load_pt(FP32 / ITER / "common.pt")
    assert _same(ours["optimizer"], theirs["optimizer"]) and ours["content_metadata"] == theirs["content_metadata"]
    reshard(FP32_DISTOPT, legacy, Target(to="megatron", distributed_optimizer=False))
    assert _rank_trees(legacy) == _rank_trees(FP32_LEGACY)
    kept = tmp_path / "kept"
    reshard(FP32_DISTOPT, kept, Target(to="megatron-dist"))
    for source in (FP32, FP32_LEGACY):
        there = tmp_path / f"{source.name}-there"
        reshard(source, there, Target(to="megatron-dist", distributed_optimizer=True))
        _same_records(there, kept)
        ours, theirs = load_pt(there / ITER / "common.pt"), load_pt(kept / ITER / "common.pt")
        assert _same(ours["optimizer"], theirs["optimizer"]) and ours["content_metadata"] == theirs["content_metadata"]
        assert verify(there).failing() == []
    # legacy: the distributed optimizer's distrib_optim.pt from the FP32 run, at TP=1, and back
    one, again = tmp_path / "one", tmp_path / "again"
    result = reshard(FP32_LEGACY, one, Target(tp=1, distributed_optimizer=True))
    assert not any("megatron-core 0.19" in n for n in result.plan.notes)
    assert len(list(one.glob("iter_*/mp_rank_00/distrib_optim.pt"))) == 1
    assert not diff(FP32_DISTOPT, one, kinds=["param", "optim", "master"]).different
    reshard(one, again, Target(tp=2, distributed_optimizer=False))
    assert _rank_trees(again, rng=False) == _rank_trees(FP32_LEGACY, rng=False)  # (TP=1 kept rank 0's RNG only)
    # an fp32 run's distributed optimizer with a grad scaler (--loss-scale): the FP32 optimizer keeps
    # torch's state dict alone, so that is refused, from legacy and from torch_dist
    from tests.conftest import rewritten_copy

    def scaled(obj: Any) -> None:
        obj["optimizer"]["grad_scaler"] = {"scale": 1024.0}

    for source, files, target in [
        (one, "iter_*/mp_rank_*/model_optim_rng.pt", Target(distributed_optimizer=False)),
        (kept, "iter_*/common.pt", Target(to="megatron-dist", distributed_optimizer=False)),
    ]:
        copy = rewritten_copy(tmp_path / f"{source.name}-scaled", source, scaled, files)
        with pytest.raises(UsageError, match="fp32 model whose distributed optimizer also saved grad_scaler"):
            reshard(copy, tmp_path / "no", target)
        assert not (tmp_path / "no").exists()


def test_distributed_optimizer_refusals(tmp_path):
    from tests.conftest import rewritten_copy

    # buckets whose layout does not replay (the args changed to tied embeddings) are not rewritten
    changed = rewritten_copy(
        tmp_path / "tied",
        DIST_DP,
        lambda obj: obj["args"].__dict__.update(untie_embeddings_and_output_weights=False),
        "iter_*/common.pt",
    )
    with pytest.raises(UsageError, match="kept as the distributed optimizer's buckets: replaying"):
        reshard(changed, tmp_path / "b", Target(tp=1, pp=1))
    assert not (tmp_path / "b").exists()
    # the FP32 optimizer's checkpoint with args of a bf16 run: its parameters are not the main params
    # a bf16 run's distributed optimizer keeps, and there is no fp32 copy to take them from
    fp32 = rewritten_copy(
        tmp_path / "fp32", FP32, lambda obj: obj["args"].__dict__.update(bf16=True), "iter_*/common.pt"
    )
    with pytest.raises(UsageError, match="has no float32 main param .its args say a bf16 or fp16 run, whose optim"):
        reshard(fp32, tmp_path / "b", Target(to="megatron-dist", distributed_optimizer=True))
    assert not (tmp_path / "b").exists()
    kept = rewritten_copy(
        tmp_path / "fp32fr", DIST_FR, lambda obj: obj["args"].__dict__.update(bf16=False), "iter_*/common.pt"
    )
    reshard(kept, tmp_path / "kept", Target(to="megatron-dist", tp=1))  # keeping its optimizer needs no change
    # groups without megatron-core's identifier keys cannot be matched by the distributed optimizer
    def strip(obj: Any) -> None:
        for group in obj["optimizer"]["optimizer"]["param_groups"]:
            del group["wd_mult"]

    keyless = rewritten_copy(tmp_path / "keyless", DIST, strip, "iter_*/common.pt")
    with pytest.raises(UsageError, match="the param groups of common.pt's optimizer 0 lack wd_mult"):
        reshard(keyless, tmp_path / "b", Target(to="megatron-dist", distributed_optimizer=True))
    assert not (tmp_path / "b").exists()


def test_refusals(tmp_path):
    out = tmp_path / "out"
    for target, message in [
        (Target(to="megatron-dist", tp=3), "does not divide the 4 attention heads"),
        (Target(to="megatron-dist", pp=3), "PP=3 does not divide the 4 layers"),
        (Target(to="megatron", tp=3), "does not divide the 4 attention heads"),
    ]:
        with pytest.raises(UsageError, match=message):
            reshard(DIST if target.to == "megatron" else LEGACY, out, target)
        assert not out.exists()
    for to in ("megatron-dist", "megatron"):
        with pytest.raises(UsageError, match=f"--to {to} reshards Megatron legacy or torch_dist"):
            reshard(FIXTURES / "dcp" / "fsdp2", out, Target(to=to))


def test_a_model_entry_without_a_rule_is_refused(monkeypatch):
    """A non-tensor entry of a legacy model state dict that is not ``_extra_state`` has no place in
    torch_dist: it is named and refused, never silently dropped."""
    from ckpttool.formats.megatron_dist_write import DistWriter
    from ckpttool.formats.megatron_write import LegacyWriter, MegatronTarget, load_source
    from ckpttool.manifest import Item

    _, m = registry.describe(LEGACY)
    like = m.items["decoder.layers.0.mlp.linear_fc1._extra_state"]
    odd = Item(name="decoder.layers.0.mlp.odd_flag", kind="object", pieces=like.pieces)
    m.items[odd.name] = odd

    def source(self: Any, root: Path, manifest: Any) -> Any:
        src = load_source(root, manifest)
        src.model_order.append(odd.name)
        return src

    monkeypatch.setattr(LegacyWriter, "_source", source)
    with pytest.raises(
        UsageError, match=r"no rule to place 1 non-tensor entries .*: decoder\.layers\.0\.mlp\.odd_flag$"
    ):
        DistWriter(Path(m.root), m, MegatronTarget(tp=1, pp=1))
    del m.items[odd.name]
    monkeypatch.undo()
    assert DistWriter(Path(m.root), m, MegatronTarget(tp=1, pp=1)).objects  # the rest has a place


def test_convert_keeps_the_layout(tmp_path, cli):
    out = tmp_path / "dist"
    r = cli("convert", LEGACY, "-o", out, "--to", "megatron-dist", "--json")
    assert r.code == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["tensors"] == 108 and len([f for f in report["files"] if f.endswith(".distcp")]) == 4
    assert "ckpttool.manifest.json" in report["files"] and f"{ITER}/common.pt" in report["files"]
    assert _chunks(_metadata(out)) == _chunks(_metadata(DIST))
    ds = tmp_path / "ds"
    r = cli("convert", FIXTURES / "deepspeed" / "zero2", "-o", ds, "--to", "deepspeed")
    assert r.code == 0, r.stderr
    assert not diff(FIXTURES / "deepspeed" / "zero2", ds).different and registry.describe(ds)[1].layout.dp == 2
    r = cli("convert", LEGACY, "-o", tmp_path / "no", "--to", "megatron", "--kind", "param")
    assert r.code == 2 and "--kind and --filter apply to safetensors, dcp and torch only" in r.stderr
    assert not (tmp_path / "no").exists()


def _megatron_core_load(*args: str, nproc: int) -> dict[str, Any]:
    """megatron-core's loader on ``nproc`` gloo ranks (forked warm: tests/_ranks.py)."""
    proc = run_ranks(FIXTURES / "_megatron_core_load_worker.py", list(args), nproc)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.slow
def test_megatron_core_loads_each_ranks_own_rng_through_one_rank(tmp_path):
    """Oracle: legacy TP=2 x PP=2 -> TP=1 x PP=1 -> torch_dist TP=2 x PP=2, loaded by megatron-core on
    4 gloo ranks: each rank's RNG is the legacy source rank's own (ranks 1-3 got rank 0's)."""
    pytest.importorskip("megatron.core")
    one, out = tmp_path / "one", tmp_path / "out"
    reshard(LEGACY, one, Target(tp=1, pp=1))
    reshard(one, out, Target(to="megatron-dist", tp=2, pp=2))
    args = ["--ckpt", str(out), "--tp", "2", "--pp", "2", "--rng-source", str(LEGACY)]
    args += ["--reference", str(FIXTURES / "megatron" / f"{LEGACY.name}.reference.pt")]
    result = _megatron_core_load(*args, nproc=4)
    assert len(result["ranks"]) == 4
    for rank in result["ranks"]:
        assert rank["problems"] == [] and rank["rng_matches"] is True, rank


@pytest.mark.slow
@pytest.mark.parametrize(
    ("source", "tp", "pp", "distopt"),
    [
        (LEGACY, 1, 1, None),
        (LEGACY, 2, 2, None),
        (DIST, 1, 2, None),
        (DIST, 2, 1, None),
        (DISTOPT, 2, 1, False),
        (DISTOPT, 1, 2, None),
        (LEGACY, 2, 1, True),
        (DIST_DP, 2, 1, None),
        (DIST_FR, 1, 2, None),
        (DIST, 2, 1, True),
        (DIST_DP, 1, 2, False),
    ],
    ids=[
        "legacy-tp1pp1",
        "legacy-tp2pp2",
        "dist-tp1pp2",
        "dist-tp2pp1",
        "legacy-distopt-no-distributed-optimizer-tp2pp1",
        "legacy-distopt-tp1pp2",
        "legacy-distributed-optimizer-tp2pp1",
        "dist-dp_reshardable-tp2pp1",
        "dist-fully_reshardable-tp1pp2",
        "dist-distributed-optimizer-tp2pp1",
        "dist-dp_reshardable-no-distributed-optimizer-tp1pp2",
    ],
)
def test_megatron_core_loads_the_output(source, tp, pp, distopt, tmp_path):
    """Oracle: megatron-core's dist_checkpointing.load, at the new TP x PP (gloo ranks: tests/_ranks.py), loads
    our torch_dist output into a GPT model and its optimizer; every tensor each rank holds (bf16
    params, fp32 main params, exp_avg, exp_avg_sq) equals the reference slice, the main replicas
    cover each reference tensor exactly once, step and iteration are 3 and, from the legacy
    source, each rank's RNG is the source rank (t mod 2, p mod 2)'s. From the distributed-optimizer
    legacy source, the optimizer state comes out of distrib_optim.pt: kept for the distributed
    optimizer (fully_reshardable, loaded by megatron-core's DistributedOptimizer), or with
    --no-distributed-optimizer per parameter, its members by megatron-core's grouping rule; the
    Float16 legacy source with --distributed-optimizer is loaded by the DistributedOptimizer too.
    From the torch_dist sources saved with the distributed optimizer (DP=2, dp_reshardable or
    fully_reshardable), megatron-core's DistributedOptimizer loads the fully_reshardable output at a
    TP x PP the dp_reshardable source itself cannot be loaded at; between torch_dist sources and
    outputs --distributed-optimizer and --no-distributed-optimizer change the optimizer, each loaded
    by its own megatron-core optimizer."""
    pytest.importorskip("megatron.core")
    out = tmp_path / "out"
    reshard(source, out, Target(to="megatron-dist", tp=tp, pp=pp, distributed_optimizer=distopt))
    args = ["--ckpt", str(out), "--tp", str(tp), "--pp", str(pp)]
    ref = DIST_DP.name if source in (DIST_DP, DIST_FR) else source.name
    args += ["--reference", str(FIXTURES / "megatron" / f"{ref}.reference.pt")]
    legacy = source.name.startswith("legacy")
    if legacy:
        args += ["--rng-source", str(source)]
    if (source in (DIST_DP, DIST_FR) or source == DISTOPT) and distopt is None or distopt:
        content = load_pt(out / ITER / "common.pt")["content_metadata"]
        assert content["distrib_optim_sharding_type"] == "fully_reshardable"
        args += ["--distopt"]
    result = _megatron_core_load(*args, nproc=tp * pp)
    assert len(result["ranks"]) == tp * pp and result["groups"] == 2
    for rank in result["ranks"]:
        assert rank["problems"] == [] and rank["checked"] >= 60
        assert rank["rng_matches"] is (True if legacy else None)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("source", "tp", "distopt"),
    [(FP32_LEGACY, 1, None), (FP32, 1, True), (FP32_DISTOPT, 1, False), (FP32_LEGACY, 2, True)],
    ids=["legacy-fp32", "fp32-to-distopt", "distopt-to-fp32", "legacy-fp32-to-distopt"],
)
def test_megatron_core_loads_the_fp32_model_output(source, tp, distopt, tmp_path):
    """Oracle: megatron-core's dist_checkpointing.load loads our torch_dist output of the fp32
    model, with its FP32Optimizer (from the FP32 run's legacy save; from the distributed-optimizer
    run with --no-distributed-optimizer) or its DistributedOptimizer (from the FP32 run with
    --distributed-optimizer: the main params written from the parameters); every tensor each rank
    holds equals the reference slice, main replicas cover it exactly once, step and iteration are 3."""
    pytest.importorskip("megatron.core")
    out = tmp_path / "out"
    reshard(source, out, Target(to="megatron-dist", tp=tp, distributed_optimizer=distopt))
    args = ["--ckpt", str(out), "--tp", str(tp), "--pp", "1", "--fp32"]
    args += ["--reference", str(FIXTURES / "megatron" / "dist_tp2_fp32_distopt.reference.pt")]
    if distopt:
        args += ["--distopt"]
    result = _megatron_core_load(*args, nproc=tp)
    assert len(result["ranks"]) == tp and result["groups"] == 2
    for rank in result["ranks"]:
        assert rank["problems"] == [] and rank["checked"] >= 45


@pytest.mark.slow
def test_megatron_core_loads_megatron_s_own_fully_reshardable_save():
    """The control for the distributed-optimizer oracle above (its CPU shims included): megatron-core
    loads Megatron-LM's own fully_reshardable save at its TP=2 x PP=2 (the RNG records are there for
    that layout only), every tensor equal to the reference."""
    pytest.importorskip("megatron.core")
    args = ["--ckpt", str(DIST_FR), "--tp", "2", "--pp", "2", "--distopt"]
    args += ["--reference", str(FIXTURES / "megatron" / f"{DIST_DP.name}.reference.pt")]
    result = _megatron_core_load(*args, nproc=4)
    assert [rank["problems"] for rank in result["ranks"]] == [[]] * 4
    assert min(rank["checked"] for rank in result["ranks"]) >= 60


@pytest.mark.slow
@pytest.mark.parametrize(
    ("source", "ep"),
    [("legacy_pp2ep2", 1), ("legacy_pp2ep2", 2), ("dist_pp2ep2", 4), ("dist_pp2ep2", 1), ("dist_pp2ep2@ep1", 2)],
    ids=["legacy-ep1", "legacy-ep2", "dist-ep4", "dist-ep1", "dist-through-ep1-ep2"],
)
def test_megatron_core_loads_the_experts_output(source, ep, tmp_path):
    """Oracle: megatron-core's dist_checkpointing.load of our torch_dist output of the MoE fixtures at
    TP=1 PP=1 with EP=1 (one optimizer), 2 and 4 (DP=EP ranks; the chain's dense and expert
    optimizers): every tensor each rank holds (its experts included, at their global numbers) equals
    the reference slice, the main replicas cover every reference tensor exactly once, and from the
    legacy source each rank's RNG is the one Megatron-LM's data-parallel rank saved. ``@ep1``: the
    torch_dist source through EP=1 first (its one optimizer's groups split into the chain again)."""
    pytest.importorskip("megatron.core")
    out = tmp_path / "out"
    src = FIXTURES / "megatron" / source.split("@")[0]
    if source.endswith("@ep1"):
        src, first = tmp_path / "ep1", src
        reshard(first, src, Target(pp=1, ep=1))
    reshard(src, out, Target(to="megatron-dist", tp=1, pp=1, ep=ep))
    args = ["--ckpt", str(out), "--tp", "1", "--pp", "1", "--ep", str(ep), "--padded-vocab", "64"]
    args += ["--reference", str(FIXTURES / "megatron" / "legacy_pp2ep2.reference.pt")]
    if source.startswith("legacy"):
        args += ["--rng-source", str(FIXTURES / "megatron" / source), "--rng-source-layout", "1", "2"]
        args += ["--rng-source-ep", "2"]
    result = _megatron_core_load(*args, nproc=ep)
    assert len(result["ranks"]) == ep and result["groups"] == (2 if ep == 1 else 3)
    for rank in result["ranks"]:
        assert rank["problems"] == [] and rank["checked"] >= 70
        assert rank["rng_matches"] is (True if source.startswith("legacy") else None)


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "ep"), [(1, 2), (2, 1)], ids=["tp1ep2", "tp2ep1"])
def test_megatron_core_loads_grouped_gemm_experts_output(tp, ep, tmp_path):
    """Oracle: a legacy GroupedMLP checkpoint (--moe-grouped-gemm: each rank's experts in
    mlp.experts.weight1/weight2, TP=2 EP=2) resharded to torch_dist at a new TP and EP loads into
    megatron-core's GroupedMLP model with dist_checkpointing.load (its experts' None _extra_state
    records included, which the legacy files do not keep): every tensor each rank holds, weight1 and
    weight2 through megatron-core's own transform and the optimizer's state with them, equals the
    reference slice."""
    pytest.importorskip("megatron.core")
    src = FIXTURES / "megatron" / "legacy_tp2ep2_gg"
    out = tmp_path / "out"
    reshard(src, out, Target(to="megatron-dist", tp=tp, pp=1, ep=ep))
    assert not diff(src, out).different
    args = ["--ckpt", str(out), "--tp", str(tp), "--pp", "1", "--ep", str(ep), "--grouped-gemm"]
    args += ["--padded-vocab", "128", "--reference", str(FIXTURES / "megatron" / "legacy_tp2ep2_gg.reference.pt")]
    result = _megatron_core_load(*args, nproc=2)
    assert len(result["ranks"]) == 2
    for rank in result["ranks"]:
        assert rank["problems"] == [] and rank["checked"] >= 60
    reshard(src, tmp_path / "legacy", Target(tp=1, ep=1))  # and as legacy GroupedMLP again
    assert not diff(src, tmp_path / "legacy").values


@pytest.mark.slow
@pytest.mark.parametrize(
    ("source", "pp", "ep"),
    [(MOE_DP, 1, 2), (MOE_FR, 1, 4), (None, 2, 2), (MOE_DP, 1, 1)],
    ids=["dp_reshardable-pp1ep2", "fully_reshardable-pp1ep4", "megatron-s-own-save", "dp_reshardable-pp1ep1"],
)
def test_megatron_core_loads_the_experts_output_with_the_distributed_optimizer(source, pp, ep, tmp_path):
    """Oracle: megatron-core's dist_checkpointing.load with its DistributedOptimizers chained (dense,
    experts) loads our fully_reshardable torch_dist output of the MoE distributed-optimizer fixtures at
    a new PP and EP: every tensor each rank holds (fp32 main params and moments of its experts
    included) equals the reference slice, the main replicas cover each reference tensor exactly once,
    step and iteration are 3. The control: Megatron-LM's own fully_reshardable save at its PP=2 x EP=2."""
    pytest.importorskip("megatron.core")
    out = MOE_FR
    if source is not None:
        out = tmp_path / "out"
        reshard(source, out, Target(to="megatron-dist", tp=1, pp=pp, ep=ep))
    args = ["--ckpt", str(out), "--tp", "1", "--pp", str(pp), "--ep", str(ep), "--padded-vocab", "64", "--distopt"]
    args += ["--reference", str(FIXTURES / "megatron" / "legacy_pp2ep2_distopt.reference.pt")]
    nproc = max(ep, pp * 2)
    result = _megatron_core_load(*args, nproc=nproc)
    assert len(result["ranks"]) == nproc and result["groups"] == (2 if ep == 1 else 3)
    for rank in result["ranks"]:
        assert rank["problems"] == [] and rank["checked"] >= 39


@pytest.mark.slow
@pytest.mark.parametrize(
    ("source", "tp", "ep", "etp"),
    [(ETP_DP, 2, 4, 1), (ETP_FR, 1, 2, 2), (MOE_LEGACY_DISTOPT, 2, 2, 1), (ETP_LEGACY, 1, 2, 2)],
    ids=["tp2ep4etp1", "tp1ep2etp2", "legacy-tp2ep2etp1", "legacy-etp1-tp1ep2etp2"],
)
def test_megatron_core_loads_expert_tensor_parallel_output_with_the_distributed_optimizer(source, tp, ep, etp, tmp_path):
    """Oracle: megatron-core's dist_checkpointing.load with the chained DistributedOptimizers at world
    4 loads our torch_dist output of the ETP=1 fixture at a new layout: the experts whole on four EP
    ranks beside TP=2 dense layers (dense DP=2), or split two ways (ETP=2 > TP=1, dense DP=4); and
    of the PP=2 EP=2 run's legacy distrib_optim.pt at TP=2 with the experts whole (ETP=1), and of
    the ETP=1 run's own legacy distrib_optim.pt with the experts split two ways. Every
    tensor each rank holds, its DP shard of the fp32 mains and moments included, equals the
    reference slice; the main replicas cover each reference tensor exactly once."""
    pytest.importorskip("megatron.core")
    out = tmp_path / "out"
    reshard(source, out, Target(to="megatron-dist", tp=tp, pp=1, ep=ep, etp=etp))
    args = ["--ckpt", str(out), "--tp", str(tp), "--pp", "1", "--ep", str(ep), "--etp", str(etp), "--distopt"]
    legacy = source == MOE_LEGACY_DISTOPT  # the PP=2 EP=2 run (ETP = TP = 1): 64 vocabulary rows
    args += ["--padded-vocab", "64" if legacy else "128", "--reference", str(FIXTURES / "megatron" / (
        "legacy_pp2ep2_distopt.reference.pt" if legacy else "dist_tp2ep2etp1_distopt.reference.pt"
    ))]  # fmt: skip
    result = _megatron_core_load(*args, nproc=4)
    assert len(result["ranks"]) == 4 and result["groups"] == 3
    for rank in result["ranks"]:
        assert rank["problems"] == [] and rank["checked"] >= 55


@pytest.mark.slow
def test_megatron_core_oracle_sees_a_wrong_value(tmp_path):
    """The oracle above can fail: one changed element of the reference is reported."""
    pytest.importorskip("megatron.core")
    import torch

    ref = torch.load(FIXTURES / "megatron" / "legacy_tp2pp2.reference.pt", weights_only=False)
    key = "exp_avg.decoder.layers.2.mlp.linear_fc2.weight"
    ref[key] = ref[key].clone()
    ref[key][3, 5] += 1
    torch.save(ref, tmp_path / "ref.pt")
    out = tmp_path / "out"
    reshard(LEGACY, out, Target(to="megatron-dist", tp=1, pp=1))
    result = _megatron_core_load("--ckpt", str(out), "--tp", "1", "--pp", "1", "--reference", str(tmp_path / "ref.pt"), nproc=1)
    (problem,) = result["ranks"][0]["problems"]
    assert problem.startswith(key) and "1/512 elements" in problem
    shutil.rmtree(out)


# -- the same command under torchrun ---------------------------------------------------------------


def _torchrun_cli(
    *args: str, script: str | None = None, nproc: int = 2, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    target = [str(Path(__file__).parent / script)] if script else ["-m", "ckpttool"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *target]
    env = cli_env(OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parents[1]), **(env or {}))
    return subprocess.run([*cmd, *map(str, args)], capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("source", "options"),
    [(LEGACY, ["--to", "megatron-dist", "--tp", "1", "--pp", "2"]), (LEGACY, ["--tp", "2", "--pp", "1"])],
    ids=["megatron-dist", "megatron-legacy"],
)
def test_torchrun_ranks_split_the_files(source, options, tmp_path):
    """`torchrun --nproc-per-node 2 -m ckpttool reshard ...`: each rank writes its share of the
    files, rank 0 the metadata; the output is byte for byte the one-process output (the seal
    aside, which records when it was made) and verifies clean."""
    from tests.conftest import tree_digests

    out, one = tmp_path / "ranks", tmp_path / "one"
    proc = _torchrun_cli("reshard", source, "-o", out, *options, "--json")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    report = json.loads(proc.stdout[proc.stdout.index("{") :])
    assert len(report["ranks"]) == 2 and all(report["ranks"]), report["ranks"]
    assert sorted(p for files in report["ranks"] for p in files) == sorted(f["path"] for f in report["files"])
    reshard(source, one, Target(**_target(options)))
    seal = "ckpttool.manifest.json"
    assert tree_digests(out, skip=lambda rel: rel == seal) == tree_digests(one, skip=lambda rel: rel == seal)
    report = verify(out)
    assert report.failing() == [] and report.seal is not None


def _target(options: list[str]) -> dict[str, Any]:
    pairs = dict(zip(options[::2], options[1::2], strict=True))
    return {k.lstrip("-"): (v if k == "--to" else int(v)) for k, v in pairs.items()}


@pytest.mark.slow
def test_torchrun_a_failing_rank_fails_all_and_publishes_nothing(tmp_path):
    """Rank 1's files fail (as a damaged source would): rank 0 reports rank 1's error and exits 3,
    the output does not appear and the staging directory is gone."""
    out = tmp_path / "out"
    proc = _torchrun_cli("reshard", LEGACY, "-o", out, "--tp", "1", "--pp", "2", script="_rank_failure_worker.py")
    assert proc.returncode != 0
    # every rank says so (torchrun's own traceback of its failed children aside: none from ckpttool)
    assert proc.stderr.count("error: rank 1: model_optim_rng.pt: injected failure\n") == 2
    assert "ckpttool/reshard.py" not in proc.stderr
    assert "exitcode  : 3" in proc.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("source", "options", "said"),
    [
        ("dcp/fsdp2", ["--dp", "1|3"], "rank 1 has the layout {'world_size': 3} against rank 0's {'world_size': 1}"),
        ("dcp/fsdp2", ["-o", "a|b"], "rank 1 has -o "),
        # (compared since: a Megatron output of two vocabulary sizes, sealed, exit 0; stages from
        # two checkpoints; an internal KeyError; and a dry run on one rank left the other waiting)
        ("megatron/legacy_tp2pp2", ["--tp", "1", "--vocab-padding", "keep|megatron"],
         "rank 1 has vocab_padding='megatron' against rank 0's 'keep'"),
        ("megatron/legacy_tp2pp2|megatron/legacy_tp2pp2_tied", ["--tp", "1"], "rank 1 has another source checkpoint"),
        ("megatron/legacy_tp2pp2", ["--tp", "1", "--pp-first-layers", "1|3"], "rank 1 has pp_first=3 against rank 0's 1"),
        ("dcp/fsdp2", ["--dp", "2", "--json|--dry-run"], "rank 1 has --dry-run on one of them only"),
    ],
    ids=["dp", "output", "vocab-padding", "source", "uneven-stages", "dry-run"],
)  # fmt: skip
def test_torchrun_ranks_given_different_reshards_are_refused(source, options, said, tmp_path):
    """Each rank made its own plan from its own arguments: ranks given --dp 1 and 3 published a
    DCP directory holding data files its .metadata never names, sealed, exit 0 (others an internal
    error), and a rank given another -o wrote its share into rank 0's output."""
    options = [f"{tmp_path / 'a'}|{tmp_path / 'b'}" if o == "a|b" else o for o in options]
    out = [] if "-o" in options else ["-o", str(tmp_path / "a")]
    source = "|".join(str(FIXTURES / s) for s in source.split("|"))
    proc = _torchrun_cli("reshard", source, *out, *options, script="_per_rank_args_worker.py")
    assert proc.returncode != 0 and "exitcode  : 2" in proc.stderr
    assert proc.stderr.count("error: under torchrun every rank must be given the same reshard") == 2, proc.stderr[-2000:]
    assert said in proc.stderr, proc.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_torchrun_a_rank_killed_is_said_so_not_an_internal_error(tmp_path):
    """Rank 1 killed (as the OOM killer would) after writing its share: rank 0 said "internal
    error: RuntimeError: [...gloo...] Connection closed by peer ... this is a bug in ckpttool"."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--monitor-interval",
           "10", str(Path(__file__).parent / "_rank_death_worker.py"), "reshard", str(LEGACY), "-o", str(out), "--tp", "1"]  # fmt: skip
    env = cli_env(OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parents[1]))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode != 0
    assert "error: lost touch with the other torchrun ranks while" in proc.stderr, proc.stderr[-3000:]
    assert "bug in ckpttool" not in proc.stderr and "ckpttool/" not in proc.stderr, proc.stderr[-3000:]
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_torchrun_rank_zero_seals_without_reading_the_other_ranks_files(tmp_path):
    """Rank 0 read back and hashed every other rank's files alone, while they waited on a 30-minute
    timeout (3.6 TB at 2 GB/s); the ranks' own digests now come with their results. The seal is the
    one a single process writes, and verifies clean."""
    out, log = tmp_path / "out", tmp_path / "read.log"
    proc = _torchrun_cli("reshard", LEGACY, "-o", out, "--tp", "1", "--json", script="_seal_reads_worker.py", env={"READ_LOG": str(log)})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    report = json.loads(proc.stdout[proc.stdout.index("{") :])
    theirs = set(report["ranks"][1])
    assert theirs and not theirs & set(json.loads(log.read_text())), (theirs, log.read_text())
    assert verify(out).failing() == []
