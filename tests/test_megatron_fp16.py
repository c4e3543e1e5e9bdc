"""Megatron fp16 with a dynamic loss scale: the optimizer also keeps the grad scaler's state
(``scale``, a tensor; ``growth_tracker``, ``hysteresis_tracker``). One Megatron-LM run (DP=2, the
distributed optimizer) saved it three ways: legacy (in ``model_optim_rng.pt``'s optimizer),
torch_dist ``dp_reshardable`` (a ShardedObject record, ``optimizer.distributed.dp_group_idx_0.
grad_scaler``, whose tensor lives in that record, not in ``common.pt``) and ``fully_reshardable``
(in ``common.pt``'s optimizer)."""

from __future__ import annotations

from typing import Any

import pytest

from ckpttool import registry
from ckpttool.diff import diff
from ckpttool.reshard import Target, reshard
from ckpttool.verify import verify
from tests.conftest import FIXTURES, load_pt
from tests.test_megatron import _distopt_reads_as
from tests.test_reshard import _megatron_lm, _oracle, _ref
from tests.test_reshard_dist import ITER, _same, _same_records
from tests.test_reshard_from_dist import _same_files

LEGACY = FIXTURES / "megatron" / "legacy_dp2_fp16_distopt"
DIST_DP = FIXTURES / "megatron" / "dist_dp2_fp16_distopt"
DIST_FR = FIXTURES / "megatron" / "dist_dp2_fp16_distopt_fr"


def _scaler(optimizer: Any) -> dict[str, Any]:
    import torch

    scaler = optimizer["grad_scaler"]
    assert set(scaler) == {"scale", "growth_tracker", "hysteresis_tracker"}
    assert isinstance(scaler["scale"], torch.Tensor) and scaler["scale"].tolist() == [1024.0]
    return scaler


def _legacy_scaler(out: Any) -> dict[str, Any]:
    return _scaler(load_pt(next(out.glob("iter_*/mp_rank_00*/model_optim_rng.pt")))["optimizer"])


@pytest.mark.parametrize("name", ["dist_dp2_fp16_distopt", "dist_dp2_fp16_distopt_fr"])
def test_torch_dist_reads_as_its_gather(name, tmp_path):
    """The fp16 parameters, fp32 main copies and moments read (de-bucketed from dp_reshardable) as
    the run's own gather before it saved, bit for bit."""
    m = _distopt_reads_as(name, "dist_dp2_fp16_distopt", 60, tmp_path)
    assert {i.dtype for i in m.items.values() if i.kind == "param"} == {"float16"}


def test_the_three_saves_hold_one_state():
    """The three layouts read equal; each verifies clean."""
    for a, b in ((LEGACY, DIST_DP), (DIST_DP, DIST_FR)):
        d = diff(a, b)
        assert not d.different and d.compared == d.identical > 0
    assert registry.describe(LEGACY)[1].format == "megatron"
    _scaler(load_pt(DIST_FR / ITER / "common.pt")["optimizer"])
    _legacy_scaler(LEGACY)
    for source in (LEGACY, DIST_DP, DIST_FR):
        assert verify(source, deep=True).failing() == []


@pytest.mark.parametrize("source", [DIST_DP, DIST_FR, LEGACY], ids=["dp_reshardable", "fully_reshardable", "legacy"])
def test_torch_dist_output_is_megatron_s_fully_reshardable_save(source, tmp_path):
    """Each save written as torch_dist at its layout is Megatron-LM's own fully_reshardable save,
    record for record, with common.pt's optimizer (the grad scaler's tensor included) equal: from
    dp_reshardable the scaler is carried out of its ShardedObject record, not looked up in
    common.pt (which holds no tensor of that name)."""
    out = tmp_path / "out"
    reshard(source, out, Target(to="megatron-dist"))
    _same_records(out, DIST_FR, rng=source is not LEGACY)
    common, theirs = load_pt(out / ITER / "common.pt"), load_pt(DIST_FR / ITER / "common.pt")
    assert _same(common["optimizer"], theirs["optimizer"])
    _scaler(common["optimizer"])
    assert verify(out).failing() == []


def test_a_new_layout_and_back_keeps_the_grad_scaler(tmp_path):
    """dp_reshardable DP=2 -> TP=2 (each rank file of its own) -> TP=1: Megatron-LM's
    fully_reshardable save again, record for record, the grad scaler with it."""
    wide, back = tmp_path / "tp2", tmp_path / "back"
    reshard(DIST_DP, wide, Target(tp=2))
    _scaler(load_pt(wide / ITER / "common.pt")["optimizer"])
    reshard(wide, back, Target(tp=1))
    _same_records(back, DIST_FR, rng=False)
    assert _same(load_pt(back / ITER / "common.pt")["optimizer"], load_pt(DIST_FR / ITER / "common.pt")["optimizer"])
    assert not diff(DIST_DP, wide).different and not diff(DIST_FR, back).different


@pytest.mark.parametrize("source", [DIST_DP, DIST_FR], ids=["dp_reshardable", "fully_reshardable"])
def test_legacy_output_is_megatron_s_legacy_save(source, tmp_path):
    """torch_dist -> legacy at the same layout: Megatron-LM's legacy save of the same state, rank
    file and distrib_optim.pt (byte for byte), the grad scaler in the rank file's optimizer."""
    out = tmp_path / "out"
    reshard(source, out, Target(to="megatron"))
    _same_files(out, LEGACY)
    _legacy_scaler(out)


@pytest.mark.parametrize("to", ["megatron", "megatron-dist"])
def test_the_float16_optimizer_keeps_the_grad_scaler(to, tmp_path):
    """--no-distributed-optimizer from dp_reshardable (legacy at TP=2, torch_dist at TP=1): the
    Float16 optimizer's state carries the scaler, as Megatron's Float16OptimizerWithFloat16Params
    saves it, beside the per-parameter state; the same written from the legacy save agrees."""
    ours, legacy = tmp_path / "ours", tmp_path / "legacy"
    target = Target(to=to, tp=2 if to == "megatron" else 1, distributed_optimizer=False)
    reshard(DIST_DP, ours, target)
    reshard(LEGACY, legacy, target)
    if to == "megatron":
        _same_files(ours, legacy)
        _legacy_scaler(ours)
    else:
        _same_records(ours, legacy, rng=False)
        mine, theirs = load_pt(ours / ITER / "common.pt"), load_pt(legacy / ITER / "common.pt")
        assert _same(mine["optimizer"], theirs["optimizer"])
        _scaler(mine["optimizer"])
    assert not diff(DIST_DP, ours).different


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "distopt"), [(2, False), (1, True)], ids=["float16-tp2", "distopt"])
def test_megatron_lm_loads_the_grad_scaler(tp, distopt, tmp_path):
    """Oracle: Megatron-LM's load_checkpoint, in fp16 with another initial loss scale (4096), loads
    our legacy files written from the dp_reshardable save (Float16 optimizer at TP=2, or the
    distributed optimizer): every tensor equals the run's reference, the loss scaler is the run's
    (1024, growth tracker 3, hysteresis tracker 2) and it trains the next step."""
    mlm = _megatron_lm()
    if mlm is None:
        pytest.skip("needs megatron-core and a Megatron-LM source (set MEGATRON_LM)")
    out = tmp_path / "out"
    reshard(DIST_DP, out, Target(to="megatron", tp=tp, distributed_optimizer=distopt))
    scaler = _legacy_scaler(LEGACY)
    want = f"{float(scaler['scale'])},{scaler['growth_tracker']},{scaler['hysteresis_tracker']}"
    assert want == "1024.0,3,2"
    flags = ["--distopt", "--dp", "2"] if distopt else []
    args = ("--tp", str(tp), "--pp", "1", "--padded-vocab", "64", "--fp16", "4096", "--grad-scaler", want, *flags)
    proc = _oracle(mlm, out, *args, *_ref("dist_dp2_fp16_distopt"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
