"""reshard: new TP/PP (Megatron legacy) and world sizes (DCP), exact round trips, refusals, atomicity."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckpttool import _torchzip, _unpickle, registry
from ckpttool.diff import diff
from ckpttool.errors import UsageError
from ckpttool.formats import _pt, _ptwrite
from ckpttool.formats.megatron import ALLOWLIST
from ckpttool.hashing import hash_bytes
from ckpttool.io import list_files
from ckpttool.reshard import Target, parse_split_rules, reshard
from ckpttool.verify import verify
from tests._compare import dcp_load_mismatches
from tests.conftest import AUTOTP_METADATA, autotp_copy
from tests.conftest import FIXTURES, OnFirstProgress, assert_clean, load_pt, rewritten_copy, run_cli, tree_digests

LEGACY = FIXTURES / "megatron" / "legacy_tp2pp2"
STATE_KINDS = ["param", "optim", "master", "scheduler", "counter"]


def _tree(path: Path, allow: Any = ALLOWLIST) -> Any:
    """A rank file's tree with every tensor replaced by (dtype, shape, requires_grad, digest): read by
    ckpttool's restricted unpickler, so Megatron or DeepSpeed need not be installed."""
    archive, obj, _ = _pt.load(path.parent, path.name, allow)

    def walk(v: Any) -> Any:
        if isinstance(v, _unpickle.TensorRef):
            values = _torchzip.read_tensor(archive, v)
            digest = hash_bytes(np.ascontiguousarray(values).view(np.uint8).data)
            return ("tensor", v.dtype, v.shape, v.requires_grad, digest)
        if isinstance(v, _unpickle.Record):
            return (type(v)._qualname, walk(dict(v.__dict__)))
        if isinstance(v, dict):
            meta = getattr(v, "__dict__", {}).get("_metadata")  # (an OrderedDict, as torch makes it)
            return ("dict", [(k, walk(x)) for k, x in v.items()], meta and (type(meta).__name__, meta))
        if isinstance(v, list | tuple):
            return (type(v).__name__, [walk(x) for x in v])
        if isinstance(v, np.ndarray):
            return ("array", v.dtype.str, v.shape, v.tobytes())
        return v

    if isinstance(obj, dict) and "ckpttool_rng_state" in obj:
        # the RNG of another layout's ranks that ckpttool keeps for a reshard back (asserted where it
        # matters: test_megatron_round_trip_is_exact); no Megatron save has it
        obj = {k: v for k, v in obj.items() if k != "ckpttool_rng_state"}
    try:
        return walk(obj)
    finally:
        archive.close()


def _padding_blind(tree: Any) -> Any:
    """A :func:`_tree` with the ZeRO-3 ``fp32_flat_groups`` tensors as dtype and shape only (their
    values, padding aside, are compared by ``diff``)."""
    if isinstance(tree, tuple) and tree and tree[0] == "dict":
        return (
            "dict",
            [
                (k, ("list", [t[:3] for t in v[1]]) if k == "fp32_flat_groups" else _padding_blind(v))
                for k, v in tree[1]
            ],
            tree[2],
        )
    if isinstance(tree, tuple) and len(tree) == 2 and isinstance(tree[1], list | tuple):
        return (tree[0], [_padding_blind(x) for x in tree[1]])
    return tree


def _ds_oracle(*args: str, codes: tuple[int, ...] = (0,)) -> str:
    """Run fixtures/oracle_deepspeed_reshard.py with ``args`` (skipped without DeepSpeed, an oracle and
    not a dependency); its report, once it exited with one of ``codes``."""
    try:
        import deepspeed  # noqa: F401
    except Exception:
        pytest.skip("needs deepspeed (an oracle, not a dependency)")
    proc = subprocess.run(
        [sys.executable, str(FIXTURES / "oracle_deepspeed_reshard.py"), *args], capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode in codes, (proc.stdout + proc.stderr)[-3000:]
    return proc.stdout


def _rank_files(root: Path) -> dict[str, Path]:
    return {p.parent.name: p for p in sorted(root.glob("iter_*/mp_rank_*/model_optim_rng.pt"))}


def _drop_rng(tree: Any, *also: str) -> Any:
    kind, entries, meta = tree
    return (kind, [(k, v) for k, v in entries if k != "rng_state" and k not in also], meta)


def test_megatron_round_trip_is_exact(tmp_path):
    """TP=2 x PP=2 -> TP=1 x PP=1 -> TP=2 x PP=2 gives the original files' trees: every tensor
    (params, moments, fp32 copies, steps), param groups, args, scheduler, module metadata."""
    one, back = tmp_path / "tp1pp1", tmp_path / "back"
    reshard(LEGACY, one, Target(tp=1, pp=1))
    reshard(one, back, Target(tp=2, pp=2))
    original, again = _rank_files(LEGACY), _rank_files(back)
    assert list(original) == list(again) == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    for name in original:
        # RNG state included: the TP=1 checkpoint keeps the other ranks' (they got rank 0's back)
        assert _tree(original[name]) == _tree(again[name]), name
    assert (back / "latest_checkpointed_iteration.txt").read_text() == "3"
    for out in (one, back):
        report = diff(LEGACY, out)
        assert not report.different and not report.opaque, report.to_json()
        report = verify(out)
        assert report.failing() == [] and report.seal is not None
    _, m = registry.describe(one)
    kept = {i.name for i in m.items.values() if i.kind == "rng" and i.pieces[0].locator.get("path", "").startswith("ckpttool_rng_state")}
    assert kept and all(n.endswith(("[tp=0,pp=1]", "[tp=1,pp=0]", "[tp=1,pp=1]")) for n in kept), kept


def test_the_routers_expert_bias_buffer_keeps_its_place(tmp_path):
    """``--moe-router-enable-expert-bias`` keeps the router's ``expert_bias`` buffer in the model's
    state dict; having no optimizer state, it was taken for a frozen parameter and moved after
    every other entry of each rank file (DeepSeek-V3-style models; the trees did not come back)."""
    import dataclasses

    def with_bias(tree):
        model = tree["model"]
        entries = list(model.items())
        model.clear()
        for key, value in entries:
            model[key] = value
            if key.endswith(".mlp.router.weight"):  # (a view of its first row's storage: [experts] fp32)
                model[key.replace(".weight", ".expert_bias")] = dataclasses.replace(
                    value, shape=(value.shape[0],), stride=(1,)
                )

    source = rewritten_copy(tmp_path / "src", FIXTURES / "megatron" / "legacy_tp2ep2etp1", with_bias)
    out = tmp_path / "out"
    reshard(source, out, Target())
    theirs, ours = _rank_files(source), _rank_files(out)
    for name in theirs:
        keys = [k for k, _ in dict(_tree(theirs[name])[1])["model"][1]]
        assert any(k.endswith("expert_bias") for k in keys)
        assert [k for k, _ in dict(_tree(ours[name])[1])["model"][1]] == keys, name


def test_megatron_round_trip_through_more_ranks_adds_no_rng_entry(tmp_path):
    """TP=2 x PP=2 -> TP=2 x PP=4 -> TP=2 x PP=2: PP ranks 2 and 3 got copies of PP ranks 0 and
    1's RNG state. The way back keeps none of them (a reshard to PP=4 gives them the same copies again),
    so the files hold no ``ckpttool_rng_state`` the original lacked and ``diff`` lists no RNG state
    added (it listed eight ranks' as "only in B"). A state that is no copy is still kept."""
    four, back = tmp_path / "pp4", tmp_path / "back"
    reshard(LEGACY, four, Target(tp=2, pp=4))
    result = reshard(four, back, Target(tp=2, pp=2))
    assert any("not kept: each equals the state of a rank written" in n for n in result.plan.notes), result.plan.notes
    original, again = _rank_files(LEGACY), _rank_files(back)
    assert list(original) == list(again)
    for name, path in again.items():
        archive, obj, _ = _pt.load(path.parent, path.name, ALLOWLIST)
        archive.close()
        assert "ckpttool_rng_state" not in obj, name
        assert _tree(original[name]) == _tree(path), name
    report = diff(LEGACY, back)
    assert not report.different and not report.added and not report.removed, report.to_json()
    again4 = tmp_path / "again4"
    reshard(back, again4, Target(tp=2, pp=4))
    assert not diff(four, again4).different
    # ranks of their own state are kept as before: TP=2 x PP=4 -> TP=1 x PP=2 keeps TP rank 1's (of
    # PP ranks 2 and 3 too: copies of PP ranks 0 and 1's, but not of TP rank 0's, which are written)
    one = tmp_path / "one"
    reshard(four, one, Target(tp=1, pp=2))
    _, m = registry.describe(one)
    kept = {i.name.rsplit("[", 1)[1] for i in m.items.values() if i.kind == "rng" and "ckpttool_rng_state" in i.pieces[0].locator.get("path", "")}
    assert kept == {"tp=1,pp=0]", "tp=1,pp=1]", "tp=1,pp=2]", "tp=1,pp=3]"}, kept


@pytest.mark.parametrize(
    ("fixture", "target", "side"),
    [("legacy_tp2pp2", Target(tp=1, pp=4), "B"), ("legacy_tp2ep2etp1", Target(tp=2, ep=1, etp=2), "A")],
)
def test_diff_after_a_larger_layout_takes_the_rng_copies_for_what_they_are(fixture, target, side, tmp_path):
    """A reshard to more TP or PP ranks gives the new ranks copies of other ranks' RNG states; one
    that folds expert TP keeps a state under another rank label. diff listed them as only in B (or
    A), exit 1, every tensor identical. They are the same states: a note, and equal."""
    out = tmp_path / "o"
    reshard(FIXTURES / "megatron" / fixture, out, target)
    report = diff(FIXTURES / "megatron" / fixture, out)
    assert not report.different, (report.added, report.removed)
    assert any(n.startswith("rng: ") and f"of ranks only {side} has equal states" in n for n in report.notes)


@pytest.mark.parametrize("to", ["megatron", "megatron-dist"])
def test_a_release_checkpoint_stays_one(to, tmp_path):
    """A ``release`` checkpoint (which Megatron loads as a fresh start at iteration 0, without its
    optimizer or RNG) is written as ``release`` again, though its files record iteration 3; it
    would become a resumable ``iter_0000003`` otherwise. Through torch_dist and back likewise."""
    src = tmp_path / "src"
    shutil.copytree(LEGACY / "iter_0000003", src / "release")
    (src / "latest_checkpointed_iteration.txt").write_text("release")
    out, back = tmp_path / "out", tmp_path / "back"
    reshard(src, out, Target(tp=1, pp=1, to=to))
    reshard(out, back, Target(tp=2, pp=2, to="megatron"))
    for done in (out, back):
        assert sorted(p.name for p in done.iterdir()) == ["ckpttool.manifest.json", "latest_checkpointed_iteration.txt", "release"]
        assert (done / "latest_checkpointed_iteration.txt").read_text() == "release"
        assert verify(done).failing() == []
    # (a torch_dist checkpoint holds the RNG of its own ranks only: the TP=1 one kept one rank's)
    assert not diff(src, back, kinds=None if to == "megatron" else STATE_KINDS).different
    reshard(out / "release", tmp_path / "given", Target(to="megatron"))  # (the iteration folder given)
    assert (tmp_path / "given" / "release").is_dir()


def test_carried_rng_under_expert_tensor_parallelism_comes_back_as_a_direct_reshard_gives_it(tmp_path):
    """TP2 x EP2 at ETP 1 through TP1 x EP1 and back at ETP 2: the rank the source had no file for
    took TP rank 0's model-parallel RNG (the rule's fallback), where a direct reshard gives it the
    state of its own TP rank, which the TP1 x EP1 checkpoint carries from EP rank 1."""
    src = FIXTURES / "megatron" / "legacy_tp2ep2etp1"
    direct, one, back = tmp_path / "direct", tmp_path / "one", tmp_path / "back"
    reshard(src, direct, Target(etp=2))
    reshard(src, one, Target(tp=1, ep=1))
    reshard(one, back, Target(tp=2, ep=2, etp=2))
    report = diff(direct, back)
    assert not report.different, report.to_json()


@pytest.mark.parametrize(("tp", "pp"), [(1, 2), (2, 1), (1, 4), (2, 4)])
def test_megatron_layouts_hold_the_same_state(tp, pp, tmp_path):
    out = tmp_path / "out"
    result = reshard(LEGACY, out, Target(tp=tp, pp=pp))
    _, m = registry.describe(out)
    assert (m.layout.tp, m.layout.pp) == (tp, pp)
    assert len(result.plan.files) == tp * pp == len(_rank_files(out))
    assert not diff(LEGACY, out, kinds=STATE_KINDS).different
    # every rank of the new layout has RNG state, from the source rank it maps to, and the source's
    # ranks this layout lacks keep theirs (for a reshard back): nothing of the source's RNG is lost
    labels = {f"[tp={t},pp={p}]" for t in range(tp) for p in range(pp)} | {f"[tp={t},pp={p}]" for t in (0, 1) for p in (0, 1)}
    held = {i.name[len("rng_state.0.torch_rng_state") :] for i in m.items.values() if i.name.startswith("rng_state.0.torch_rng_state")}
    assert held == labels
    assert not diff(LEGACY, out, kinds=["rng"]).removed


DISTOPT = FIXTURES / "megatron" / "legacy_tp2pp2_distopt"


def _distrib_files(root: Path) -> dict[str, Path]:
    return {p.parent.name: p for p in sorted(root.glob("iter_*/mp_rank_*/distrib_optim.pt"))}


def test_megatron_distributed_optimizer_round_trip_is_byte_exact(tmp_path):
    """The distributed optimizer's checkpoint (Adam state and fp32 main params in distrib_optim.pt,
    laid out as each stage's grad buffer) at TP=2 x PP=2 -> TP=1 x PP=1 -> TP=2 x PP=2: every
    distrib_optim.pt comes back byte for byte, and the rank files' trees (param groups with their
    step, no members) equal the original's."""
    one, back = tmp_path / "tp1pp1", tmp_path / "back"
    reshard(DISTOPT, one, Target(tp=1, pp=1))
    reshard(one, back, Target(tp=2, pp=2))
    assert list(_distrib_files(one)) == ["mp_rank_00"]
    original, again = _distrib_files(DISTOPT), _distrib_files(back)
    assert list(original) == list(again) and len(original) == 4
    for name in original:
        assert original[name].read_bytes() == again[name].read_bytes(), name
    for name, path in _rank_files(DISTOPT).items():
        assert _drop_rng(_tree(path)) == _drop_rng(_tree(_rank_files(back)[name])), name
    for out in (one, back):
        assert not diff(DISTOPT, out, kinds=STATE_KINDS).different
        assert verify(out).failing() == []


@pytest.mark.parametrize(
    ("float16", "distopt", "tp", "pp"),
    [
        ("legacy_tp2pp2", "legacy_tp2pp2_distopt", 1, 1),
        ("legacy_tp2pp2", "legacy_tp2pp2_distopt", 2, 1),
        ("legacy_tp2pp2", "legacy_tp2pp2_distopt", 1, 2),
        ("legacy_pp2_decoupled", "legacy_pp2_decoupled_distopt", 1, 2),
        ("legacy_pp2_decoupled", "legacy_pp2_decoupled_distopt", 2, 1),
    ],
)
def test_megatron_distributed_optimizer_from_float16_optimizer(float16, distopt, tp, pp, tmp_path):
    """--distributed-optimizer from a checkpoint of the Float16 optimizer (the same training state
    as the distributed-optimizer fixture, trained the same way) writes the very bytes resharding the
    distributed-optimizer checkpoint writes: the layout comes from the target model, not the source."""
    a, b = tmp_path / "from_float16", tmp_path / "from_distopt"
    result = reshard(FIXTURES / "megatron" / float16, a, Target(tp=tp, pp=pp, distributed_optimizer=True))
    assert any("resume with --use-distributed-optimizer" in n for n in result.plan.notes), result.plan.notes
    plain = reshard(FIXTURES / "megatron" / distopt, b, Target(tp=tp, pp=pp)).plan.notes
    assert not any("distributed-optimizer" in n for n in plain)
    da, db = _distrib_files(a), _distrib_files(b)
    assert list(da) == list(db) and len(da) == tp * pp
    for name in da:
        assert da[name].read_bytes() == db[name].read_bytes(), name
        tree = _tree(_rank_files(a)[name])
        optimizer = dict(tree[1])["optimizer"]
        assert [k for k, _ in optimizer[1]] == ["optimizer"]  # param groups only, as DistributedOptimizer saves
        assert _tree(_rank_files(a)[name].with_name("distrib_optim.pt")) == _tree(db[name])
    args = _pt.load(
        _rank_files(a)["mp_rank_00" if pp == 1 else "mp_rank_00_000"].parent, "model_optim_rng.pt", ALLOWLIST
    )
    args[0].close()
    assert args[1]["args"].use_distributed_optimizer is True


def _numel_unpadded(path: Path) -> int:
    archive, obj, _ = _pt.load(path.parent, path.name, ALLOWLIST)
    archive.close()
    (state,) = obj[0].values()
    return state["numel_unpadded"]


def _with_buckets(tmp_path: Path, bucket: int) -> Path:
    """A copy of the Float16-optimizer fixture whose args say it trained with --overlap-grad-reduce
    --ddp-bucket-size ``bucket``. Only the args change; the target layout is what the bucket size
    decides."""
    return _with_args(tmp_path / f"bucket{bucket}", LEGACY, overlap_grad_reduce=True, ddp_bucket_size=bucket)


def _with_args(dst: Path, source: Path, **args: Any) -> Path:
    """A copy of a legacy fixture with ``args`` changed in every rank file."""
    return rewritten_copy(dst, source, lambda obj: obj["args"].__dict__.update(args))


def test_megatron_distributed_optimizer_with_several_buckets(tmp_path):
    """With --overlap-grad-reduce and buckets so small that the 16-element norms end theirs, the
    world tensor's parameters no longer start on multiples of 64 (the padding at the end of each
    bucket is dropped): the writer lays them out so, the reader reads them back, and a TP round trip
    gives the same bytes and the source's state."""
    src = _with_buckets(tmp_path, 10)
    a, one, b = tmp_path / "a", tmp_path / "one", tmp_path / "b"
    reshard(src, a, Target(tp=2, pp=1, distributed_optimizer=True))
    reshard(a, one, Target(tp=1, pp=1))
    reshard(one, b, Target(tp=2, pp=1))
    for name, path in _distrib_files(a).items():
        assert path.read_bytes() == _distrib_files(b)[name].read_bytes(), name
    unbucketed = tmp_path / "unbucketed"
    reshard(LEGACY, unbucketed, Target(tp=2, pp=1, distributed_optimizer=True))
    assert _numel_unpadded(_distrib_files(a)["mp_rank_00"]) == 8336  # what Megatron's buffer has (oracle test)
    assert _numel_unpadded(_distrib_files(unbucketed)["mp_rank_00"]) == 8768
    for out in (a, one):
        assert not diff(LEGACY, out, kinds=["param", "optim", "master"]).different


@pytest.mark.parametrize(
    ("source", "float16", "tp", "pp"),
    [
        ("legacy_tp2pp2_distopt", "legacy_tp2pp2", 2, 2),
        ("legacy_tp2pp2_distopt", "legacy_tp2pp2", 1, 1),
        ("legacy_tp2pp2_distopt", "legacy_tp2pp2", 2, 1),
        ("legacy_tp2pp2_distopt", "legacy_tp2pp2", 1, 2),
        ("legacy_pp2vpp2_distopt", "legacy_pp2vpp2", 2, 1),
        ("legacy_pp2vpp2_distopt", "legacy_pp2vpp2", 1, 2),
        ("legacy_pp2_decoupled_distopt", "legacy_pp2_decoupled", 1, 1),
        ("legacy_pp2_decoupled_distopt", "legacy_pp2_decoupled", 2, 1),
        ("legacy_pp2_decoupled_distopt", "legacy_pp2_decoupled", 2, 2),
    ],
)
def test_megatron_no_distributed_optimizer_from_the_distributed_optimizer(source, float16, tp, pp, tmp_path):
    """--no-distributed-optimizer from the distributed-optimizer fixture (the same training state as
    the Float16-optimizer fixture, trained the same way) writes what resharding the Float16 fixture
    writes: every rank file's tree equal (param groups and their members, per-parameter Adam state
    and step, fp32 masters, model, scheduler, metadata), args aside from the save path. The members
    come from megatron-core's standard grouping rule, checked against the saved groups."""
    a, b = tmp_path / "from_distopt", tmp_path / "from_float16"
    result = reshard(FIXTURES / "megatron" / source, a, Target(tp=tp, pp=pp, distributed_optimizer=False))
    assert any("resume without --use-distributed-optimizer" in n for n in result.plan.notes), result.plan.notes
    reshard(FIXTURES / "megatron" / float16, b, Target(tp=tp, pp=pp))
    assert not list(a.glob("iter_*/mp_rank_*/distrib_optim.pt"))
    ra, rb = _rank_files(a), _rank_files(b)
    assert list(ra) == list(rb) and len(ra) == tp * pp
    for name in ra:
        ta, tb = _drop_rng(_tree(ra[name]), "args"), _drop_rng(_tree(rb[name]), "args")
        assert ta == tb, name
        args = [_pt.load(r.parent, r.name, ALLOWLIST) for r in (ra[name], rb[name])]
        for archive, _, _ in args:
            archive.close()
        va, vb = (dict(obj["args"].__dict__) for _, obj, _ in args)
        assert va["use_distributed_optimizer"] is False
        assert {k for k in va.keys() | vb.keys() if va.get(k) != vb.get(k)} == {"save"}
    assert not diff(FIXTURES / "megatron" / source, a, kinds=STATE_KINDS).different
    layout = registry.describe(FIXTURES / "megatron" / source)[1].layout
    if (layout.tp, layout.pp) == (tp, pp):  # the layout kept: every rank keeps its own RNG state
        assert not diff(FIXTURES / "megatron" / source, a, kinds=["rng"]).different
    assert verify(a).failing() == []


DECOUPLED = FIXTURES / "megatron" / "legacy_pp2_decoupled_distopt"


def test_megatron_decoupled_lr_groups_are_megatrons(tmp_path):
    """--decoupled-lr in megatron-core 0.16 puts the embedding and the output layer in param groups
    of their own max_lr and min_lr (not marked is_decoupled_lr, as before 0.16). From the
    distributed-optimizer run, --no-distributed-optimizer at the source layout writes rank files
    whose trees are the Float16 run's own save (param groups, their members, per-parameter state,
    fp32 masters, model, scheduler), the args' optimizer flag and save path aside; the plan says
    that megatron-core before 0.19 cannot tell the decoupled group from the default one."""
    out = tmp_path / "out"
    result = reshard(DECOUPLED, out, Target(distributed_optimizer=False))
    assert any("megatron-core 0.19" in n and "--decoupled-lr" in n for n in result.plan.notes), result.plan.notes
    own = _rank_files(FIXTURES / "megatron" / "legacy_pp2_decoupled")
    ours = _rank_files(out)
    assert list(own) == list(ours) == ["mp_rank_00_000", "mp_rank_00_001"]
    for name, path in own.items():
        assert _drop_rng(_tree(path), "args") == _drop_rng(_tree(ours[name]), "args"), name
        archive, obj, _ = _pt.load(path.parent, path.name, ALLOWLIST)
        archive.close()
        groups = obj["optimizer"]["optimizer"]["param_groups"]
        decoupled = [g for g in groups if g["max_lr"] == 0.003]
        assert len(groups) == 3 and len(decoupled) == 1 and decoupled[0]["min_lr"] == 0.0003
        assert len(decoupled[0]["params"]) == 1 and not decoupled[0]["is_decoupled_lr"]
    # through torch_dist, whose groups name no members, and back to legacy: the rule places them again
    dist, back, direct = tmp_path / "dist", tmp_path / "back", tmp_path / "direct"
    reshard(DECOUPLED, dist, Target(to="megatron-dist", distributed_optimizer=False))
    reshard(dist, back, Target(to="megatron", tp=1, pp=1))
    reshard(FIXTURES / "megatron" / "legacy_pp2_decoupled", direct, Target(tp=1, pp=1))
    (a,), (b,) = _rank_files(back).values(), _rank_files(direct).values()
    assert dict(_tree(a)[1])["optimizer"] == dict(_tree(b)[1])["optimizer"]
    # through torch_dist -> torch_dist (groups read from common.pt) the plan says so too
    notes = reshard(dist, tmp_path / "again", Target(to="megatron-dist", distributed_optimizer=True)).plan.notes
    assert any("megatron-core 0.19" in n for n in notes), notes
    # megatron-core 0.13-0.15 marked the group is_decoupled_lr (and saved no default_config): the same
    # members
    def as_before_016(obj: Any) -> None:
        for group in obj["optimizer"]["optimizer"]["param_groups"]:
            group["is_decoupled_lr"] = group["max_lr"] == 0.003
            del group["default_config"]

    old = rewritten_copy(tmp_path / "old", DECOUPLED, as_before_016)
    reshard(old, tmp_path / "from_old", Target(distributed_optimizer=False))
    for name, path in _rank_files(tmp_path / "from_old").items():
        ours, theirs = (load_pt(p)["optimizer"]["optimizer"]["param_groups"] for p in (path, own[name]))
        assert [g["params"] for g in ours] == [g["params"] for g in theirs]
        assert [g["is_decoupled_lr"] for g in ours] == [False, True, False]
    # a checkpoint without decoupled groups gets no such note
    plain = reshard(DISTOPT, tmp_path / "plain", Target(tp=1, pp=1)).plan.notes
    assert not any("megatron-core 0.19" in n for n in plain)


def test_alike_groups_are_those_only_their_lr_schedule_tells_apart():
    """The plan's note on megatron-core before 0.19: two groups equal on its identifier keys whose
    max_lr or min_lr differ; groups without the keys (older Megatron-LM) are not compared."""
    from ckpttool.formats.megatron_write import _alike_groups

    base = {"wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False}
    assert _alike_groups([{}, {}]) == [] and _alike_groups([{"max_lr": 1.0}, {"max_lr": 2.0}]) == []
    assert _alike_groups([{**base, "max_lr": 0.01}, {**base, "wd_mult": 0.0, "max_lr": 0.003}]) == []
    assert _alike_groups([{**base, "max_lr": 0.01}, {**base, "max_lr": 0.01, "min_lr": 0.0}]) == [0, 1]
    nemo = {"pre_wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False}
    assert _alike_groups([{**base, "max_lr": 0.01}, {**nemo, "max_lr": 0.003}]) == [0, 1]


def test_megatron_dist_from_the_distributed_optimizer(tmp_path):
    """--to megatron-dist from the distributed-optimizer fixture: the per-parameter optimizer state of
    torch_dist, cut out of distrib_optim.pt, equals what the Float16 fixture gives (every record's
    values; only the args' save path and the RNG differ between the two runs)."""
    a, b = tmp_path / "from_distopt", tmp_path / "from_float16"
    reshard(DISTOPT, a, Target(to="megatron-dist", tp=2, pp=1))
    reshard(LEGACY, b, Target(to="megatron-dist", tp=2, pp=1))
    ma, mb = registry.describe(a)[1], registry.describe(b)[1]
    optim = sorted(n for n in ma.items if n.endswith((".exp_avg", ".exp_avg_sq", ".fp32")))
    assert len(optim) >= 3 * 13 and optim == sorted(
        n for n in mb.items if n.endswith((".exp_avg", ".exp_avg_sq", ".fp32"))
    )
    assert not diff(a, b).different
    assert not diff(DISTOPT, a, kinds=STATE_KINDS).different
    assert verify(a).failing() == []


def test_megatron_no_distributed_optimizer_refusals(tmp_path):
    """Where megatron-core's standard grouping rule cannot say which saved group a parameter is in,
    --no-distributed-optimizer is refused before anything is written, naming why."""
    out = tmp_path / "out"
    decoupled = _with_args(tmp_path / "decoupled", DISTOPT, decoupled_lr=0.001)  # groups without its LR
    with pytest.raises(UsageError, match=r"0 of its 2 param groups have wd_mult 1.0 and the --decoupled-lr 0.001"):
        reshard(decoupled, out, Target(tp=1, pp=1, distributed_optimizer=False))
    # the decoupled run's checkpoint read as if trained without it: the default group and the
    # embedding and output layer's are alike to the rule
    undecoupled = _with_args(tmp_path / "undecoupled", DECOUPLED, decoupled_lr=None)
    with pytest.raises(UsageError, match="2 of its 3 param groups have wd_mult 1.0, the group"):
        reshard(undecoupled, out, Target(tp=1, pp=1, distributed_optimizer=False))
    embedding = _with_args(tmp_path / "embedding", DISTOPT, embedding_init_method_std=0.02)
    with pytest.raises(UsageError, match="--embedding-init-method-std"):
        reshard(embedding, out, Target(to="megatron-dist", distributed_optimizer=False))
    reshard(embedding, out, Target(to="megatron-dist"))  # keeping the distributed optimizer needs no rule
    shutil.rmtree(out)
    sgd = _with_args(tmp_path / "sgd", DISTOPT, optimizer="sgd")
    with pytest.raises(UsageError, match="only Adam's state is supported, not sgd's"):
        reshard(sgd, out, Target(tp=1, pp=1, distributed_optimizer=False))

    def groups(edit: Any) -> Any:
        def apply(obj: Any) -> None:
            edit(obj["optimizer"]["optimizer"]["param_groups"])

        return apply

    def int_steps(gs: list[dict[str, Any]]) -> None:
        for g in gs:
            g["step"] = 3

    fused = rewritten_copy(tmp_path / "fused", DISTOPT, groups(int_steps))
    with pytest.raises(UsageError, match="FusedAdam keep the step per group"):
        reshard(fused, out, Target(tp=1, pp=1, distributed_optimizer=False))
    twin = rewritten_copy(tmp_path / "twin", DISTOPT, groups(lambda gs: gs.append({**gs[0], "lr_mult": 2.0})))
    with pytest.raises(UsageError, match="2 of its 3 param groups have wd_mult 1.0"):
        reshard(twin, out, Target(tp=1, pp=1, distributed_optimizer=False))
    idle = rewritten_copy(tmp_path / "idle", DISTOPT, groups(lambda gs: gs.append({**gs[0], "wd_mult": 0.5})))
    with pytest.raises(UsageError, match="1 of its param groups would hold no parameter"):
        reshard(idle, out, Target(to="megatron-dist", distributed_optimizer=False))
    qk = _with_args(tmp_path / "qk", DISTOPT, apply_wd_to_qk_layernorm=True)
    plain = tmp_path / "plain"
    reshard(qk, out, Target(tp=1, pp=1, distributed_optimizer=False))  # no q/k layernorms: the same groups
    reshard(DISTOPT, plain, Target(tp=1, pp=1, distributed_optimizer=False))
    for name, path in _rank_files(plain).items():
        assert _drop_rng(_tree(path), "args") == _drop_rng(_tree(_rank_files(out)[name]), "args"), name


def test_megatron_distributed_optimizer_refusals(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(UsageError, match="applies to --to megatron"):
        reshard(FIXTURES / "dcp" / "fsdp2", out, Target(dp=2, distributed_optimizer=True))
    assert not out.exists()


def test_megatron_distributed_optimizer_flag_on_the_command_line(tmp_path):
    out = tmp_path / "out"
    r = run_cli("reshard", str(LEGACY), "-o", str(out), "--tp", "1", "--pp", "1", "--distributed-optimizer", "-q")
    assert r.code == 0, r.stderr
    assert list(_distrib_files(out)) == ["mp_rank_00"]
    moe = FIXTURES / "megatron" / "legacy_pp2ep2_distopt"
    r = run_cli("reshard", str(moe), "-o", str(tmp_path / "no"), "--no-distributed-optimizer", "-q")
    assert r.code == 0, r.stderr
    assert _rank_files(tmp_path / "no") and not _distrib_files(tmp_path / "no")
    r = run_cli(
        "reshard",
        str(DISTOPT),
        "-o",
        str(tmp_path / "yes"),
        "--tp",
        "1",
        "--pp",
        "1",
        "--no-distributed-optimizer",
        "-q",
    )
    assert r.code == 0, r.stderr
    assert not list((tmp_path / "yes").glob("iter_*/mp_rank_*/distrib_optim.pt"))


def test_megatron_distributed_optimizer_is_written_one_parameter_at_a_time(tmp_path):
    """A distrib_optim.pt world tensor holds a whole stage's parameters; the writer streams it one
    parameter's slice at a time, so the plan's peak is the largest parameter, not the stage."""
    from ckpttool.reshard import plan

    the_plan, _ = plan(DISTOPT, Target(tp=1, pp=1))
    files = {f.path.rsplit("/", 1)[1]: f for f in the_plan.files}
    largest_param = 128 * 16 * 4  # the fp32 embedding at TP=1
    assert files["distrib_optim.pt"].nbytes == 3 * 16960 * 4
    # the largest part held plus the largest source piece read through a temporary
    assert files["distrib_optim.pt"].peak <= 2 * largest_param < 16960 * 4


@pytest.mark.parametrize(
    ("source", "target"),
    [
        ("megatron/legacy_tp2pp2", Target(tp=1, pp=2)),
        ("megatron/legacy_tp2pp2", Target(tp=1, pp=2, to="megatron-dist")),
        ("dcp/fsdp2", Target(dp=2)),  # a writer that keeps no manifest: the workers get the source's
        ("deepspeed/zero2", Target(to="deepspeed-universal")),
    ],
    ids=["legacy", "torch_dist", "dcp", "universal"],
)
def test_workers_write_the_same_bytes(source, target, tmp_path):
    """--workers 2 (files written by spawned worker processes) gives the bytes one process writes,
    for every kind of writer."""
    a, b = tmp_path / "a", tmp_path / "b"
    reshard(FIXTURES / source, a, target, workers=1)
    reshard(FIXTURES / source, b, target, workers=2)
    seal = "ckpttool.manifest.json"
    files = tree_digests(a, skip=lambda rel: rel == seal)
    assert len(files) > 1 and files == tree_digests(b, skip=lambda rel: rel == seal)
    # the seals agree but for their time, each naming the directory it was published as (with the
    # save's tag or iteration folder its files are named from)
    sa, sb = (json.loads((d / seal).read_text()) for d in (a, b))
    inner = {"deepspeed-universal": "global_step3_universal", "megatron-dist": "iter_0000003"}.get(target.to, "")
    assert sa["manifest"]["root"] == os.path.join(a, inner).rstrip("/")
    assert sb["manifest"]["root"] == os.path.join(b, inner).rstrip("/")
    for s in (sa, sb):
        s.pop("created"), s["manifest"].pop("root")
    assert sa == sb


def test_workers_n_is_n_processes_writing(tmp_path, monkeypatch):
    """--workers 3: this process writes files too, beside two spawned ones (each spawned one is
    handed a file before this process starts on the others): it writes some, not all."""
    from ckpttool.formats.dcp_write import DcpWriter

    here: list[str] = []
    real = DcpWriter.write

    def recording(self, *args, **kwargs):  # (a spawned worker imports the module afresh: not its calls)
        here.append(Path(args[-3]).name)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(DcpWriter, "write", recording)
    reshard(FIXTURES / "dcp/fsdp2", tmp_path / "out", Target(dp=8), workers=3)
    written = sorted(p.name for p in (tmp_path / "out").glob("*.distcp"))
    assert len(written) == 8 and 1 <= len(here) <= 6 and set(here) < set(written), here
    assert verify(tmp_path / "out").failing() == []


def _fake_exec(plan):
    """An executor over tests/_fake_writer.py's files: (name, seconds, fails in a worker) each."""
    from ckpttool.reshard import _FileExec
    from tests import _fake_writer

    ex = _FileExec.__new__(_FileExec)
    ex.adapter, ex.manifest, ex.build, ex.args, ex.layout = _fake_writer.Adapter(), "m", _fake_writer.build, (plan,), {}
    ex.writer, ex.notes, ex.known, ex.partial, ex.device = _fake_writer.Writer(plan), [], {}, [], "cpu"
    ex.planned = ex.writer.files()
    return ex


def test_a_workers_failure_is_raised_without_waiting_for_the_others(tmp_path):
    """One spawned worker fails its file while another still writes a slow one: the failure is
    raised at once (the pool stopped), not once the slow file is written."""
    import multiprocessing
    import time

    # this process writes "a"; the workers are handed "c" (slow) and "b" (fails) before it starts
    plan = [("a", 0.0, False), ("b", 0.2, True), ("c", 30.0, False)]
    ex = _fake_exec(plan)
    began = time.monotonic()
    with pytest.raises(ValueError, match="file 1 failed in a worker"):
        ex.write_files(tmp_path, [0, 1, 2], 3, None)
    assert time.monotonic() - began < 20
    assert multiprocessing.active_children() == []


def test_a_workers_failure_stops_the_file_this_process_writes(tmp_path):
    """This process writes a slow file while the pool's worker fails another: the failure is raised
    at the slow file's next progress, not once it is written (a file of many gigabytes)."""
    import multiprocessing
    import time

    plan = [("a", 60.0, False), ("b", 0.2, True)]  # (the worker is handed the last file: "b")
    ex = _fake_exec(plan)
    began = time.monotonic()
    with pytest.raises(ValueError, match="file 1 failed in a worker"):
        ex.write_files(tmp_path, [0, 1], 2, None)
    assert time.monotonic() - began < 30
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize(
    ("source", "target", "parted"),
    [
        ("deepspeed/zero2", Target(dp=1), True),
        ("deepspeed/zero3", Target(dp=1), True),
        ("deepspeed/zero2", Target(dp=3, zero_stage=3), True),
        ("deepspeed/zero3", Target(to="deepspeed-universal"), True),
        ("dcp/fsdp2", Target(dp=4), False),
        ("megatron/legacy_tp2pp2", Target(tp=1, pp=1), False),
        ("megatron/legacy_tp2pp2", Target(tp=1, pp=2, to="megatron-dist"), False),
    ],
    ids=["zero2", "zero3", "zero2-to-3", "universal3", "dcp", "legacy", "torch_dist"],
)
def test_tensors_in_parts_and_filled_ahead_are_the_same_bytes(source, target, parted, tmp_path, monkeypatch):
    """ZeRO partitions and carried flat tensors bigger than CARRY_PART are produced a part at a
    time, and every tensor or part from PIPELINED bytes on is filled one ahead on a helper thread
    while the last is written (within a file and, for DCP and torch_dist, across the archives of a
    rank file). With parts of 256 bytes (every partition of the fixtures cut, across parameters
    and padding) and everything filled ahead, the files are the bytes written whole, one tensor at
    a time."""
    import threading

    from ckpttool.formats import _ptwrite

    a, b = tmp_path / "a", tmp_path / "b"
    reshard(FIXTURES / source, a, target)
    monkeypatch.setattr(_ptwrite, "CARRY_PART", 256)
    monkeypatch.setattr(_ptwrite, "PIPELINED", 0)
    cut: list[int] = []
    ahead: list[int] = []
    filled, fill_into = _ptwrite._filled_ahead, _ptwrite._fill_into

    def counting_parts(tensors, scratch):
        cut.extend(sum(1 for _ in t.parts()) for t in tensors if t.parts is not None)
        return filled(tensors, scratch)

    def counting_ahead(view, fill):
        if threading.current_thread() is not threading.main_thread():
            ahead.append(view.nbytes)
        return fill_into(view, fill)

    monkeypatch.setattr(_ptwrite, "_filled_ahead", counting_parts)
    monkeypatch.setattr(_ptwrite, "_fill_into", counting_ahead)
    _slow_writes(monkeypatch)
    reshard(FIXTURES / source, b, target)
    if parted:
        assert max(cut) > 10
    assert len(ahead) > 10
    _assert_same_files(a, b)


@pytest.mark.parametrize(
    ("source", "target"),
    [
        ("dcp/fsdp2", Target(dp=4)),
        ("megatron/legacy_tp2pp2", Target(tp=1, pp=2)),
        ("megatron/legacy_tp2pp2", Target(tp=1, pp=2, to="megatron-dist")),
        ("deepspeed/zero3", Target(dp=1)),
        ("deepspeed/zero2", Target(to="deepspeed-universal")),
    ],
    ids=["dcp", "legacy", "torch_dist", "zero3", "universal"],
)
def test_the_seal_takes_the_digests_the_writers_took(source, target, tmp_path, monkeypatch):
    """The writers hash what they write (each file whole, each tensor record's data); the seal of
    the output reads back none of those files, only the others (trackers, .metadata, copied
    files). It equals a seal that reads every file, digests and spans alike, and verifies clean."""
    from ckpttool import hashing
    from ckpttool.seal import seal

    read: list[str] = []
    hash_file = hashing.hash_file

    out = tmp_path / "out"

    def counting(root, rel, *args, **kwargs):  # the file's path in the output (the seal's root may be below it)
        parts = Path(root, rel).parts
        staged = next(k for k, part in enumerate(parts) if part.startswith(".out.ckpttool-tmp"))
        read.append(str(Path(*parts[staged + 1 :])))
        return hash_file(root, rel, *args, **kwargs)

    monkeypatch.setattr(hashing, "hash_file", counting)
    reshard(FIXTURES / source, out, target)
    tensors = [rel for rel in tree_digests(out) if rel.endswith((".pt", ".distcp"))]
    copied = {rel for rel in tensors if "_universal/" in rel and rel.endswith("model_states.pt")}  # copied as is
    written = set(tensors) - copied
    assert written and not written & set(read), read
    assert copied <= set(read)  # a copied file is read by the seal: no writer hashed it
    assert bool(copied) == (target.to == "deepspeed-universal")  # only the universal output copies files

    ours = json.loads((out / "ckpttool.manifest.json").read_text())
    monkeypatch.setattr(hashing, "hash_file", hash_file)
    seal(out, out=tmp_path / "again.json")
    again = json.loads((tmp_path / "again.json").read_text())
    assert ours["pieces"] == again["pieces"]

    def files(sealed: dict[str, Any]) -> dict[str, str]:
        return {f["path"]: f["checksum"] for f in sealed["manifest"]["files"] if f["role"] != "seal"}

    assert len(files(ours)) > 1 and files(ours) == files(again)
    assert verify(out).failing() == []


def _slow_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every write of a tensor's bytes waits a little first, so that a fill running ahead on the
    helper thread has finished by then: one that wrote into the buffer being written would show
    in the bytes every time, not only when the threads happen to interleave so."""
    import time

    from ckpttool import _zipwrite

    put = _zipwrite.ZipWriter._put

    def slow(self, data):
        if not isinstance(data, bytes):
            time.sleep(0.002)
        put(self, data)

    monkeypatch.setattr(_zipwrite.ZipWriter, "_put", slow)


def _assert_same_files(a: Path, b: Path) -> None:
    """The two outputs hold the same files, byte for byte, their seals aside (which carry a time)."""
    seal = "ckpttool.manifest.json"
    files = tree_digests(a, skip=lambda rel: rel == seal)
    assert len(files) > 1 and files == tree_digests(b, skip=lambda rel: rel == seal)


def test_vocab_repadding(tmp_path):
    """--vocab-padding megatron: rows re-padded for the new TP, the vocabulary rows kept."""
    out = tmp_path / "out"
    reshard(LEGACY, out, Target(tp=1, pp=1, vocab_padding="megatron"))
    _, m = registry.describe(out)
    emb = m.items["embedding.word_embeddings.weight"]
    assert emb.shape == (64, 16)  # vocab_size 63 padded to a multiple of 64 at TP=1
    assert not diff(LEGACY, out, kinds=STATE_KINDS, pattern=r"^(?!embedding\.word|output_layer\.weight)").different
    archive, obj, _ = _pt.load(out, "iter_0000003/mp_rank_00/model_optim_rng.pt", ALLOWLIST)
    archive.close()
    # what Megatron computes at TP=1 from vocab_size 63 and the source's divisor 64
    assert obj["args"].padded_vocab_size == 64 and obj["args"].make_vocab_size_divisible_by == 64
    _, src = registry.describe(LEGACY)
    with registry.detect(LEGACY).reader(src) as ra, registry.detect(out).reader(m) as rb:
        from ckpttool.assemble import assemble

        for name in ("embedding.word_embeddings.weight", "output_layer.weight.exp_avg"):
            a = assemble(ra, src.items[name])
            b = assemble(rb, m.items[name])
            assert np.array_equal(a[:64], b)  # the first 64 rows (vocabulary and one padding row) kept


def test_dcp_world_size_round_trip(tmp_path):
    src = FIXTURES / "dcp" / "fsdp2"
    two, back = tmp_path / "two", tmp_path / "four"
    reshard(src, two, Target(dp=2))
    reshard(two, back, Target(dp=4))
    _, a = registry.describe(src)
    _, b = registry.describe(back)
    assert b.layout.world_size == 4 and registry.describe(two)[1].layout.world_size == 2
    assert not diff(src, two).different and not diff(src, back).different
    # cut as FSDP2 cut the original: the same chunk boxes per tensor
    for name, item in a.items.items():
        if item.is_tensor:
            boxes = sorted((p.box.offsets, p.box.sizes) for p in item.pieces if p.replica == 0)
            assert boxes == sorted((p.box.offsets, p.box.sizes) for p in b.items[name].pieces if p.replica == 0), name


def _cut_boxes(manifest: Any) -> dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    return {
        name: sorted((p.box.offsets, p.box.sizes) for p in item.pieces if p.replica == 0)
        for name, item in manifest.items.items()
        if item.is_tensor
    }


def test_dcp_through_one_rank_comes_back_cut_as_fsdp2_cut_it(tmp_path):
    """Before: a one-rank DCP (or any one-piece source) written at DP=4 put every tensor whole on
    rank 0, so FSDP2's DP=4 -> DP=1 -> DP=4 never came back as it was. Now it comes back in FSDP2's
    chunks: the 36 parameters and moments it cut in the same chunks; its steps, RNG states,
    counters and its buffer (model.emb_scale: a float tensor the optimizer does not train) whole."""
    src = FIXTURES / "dcp" / "fsdp2"
    one, back = tmp_path / "one", tmp_path / "four"
    reshard(src, one, Target(dp=1))
    reshard(one, back, Target(dp=4))
    a, b = _cut_boxes(registry.describe(src)[1]), _cut_boxes(registry.describe(back)[1])
    assert len([name for name, boxes in a.items() if len(boxes) > 1]) == 36
    assert b == a
    assert not diff(src, back).different


@pytest.mark.parametrize(
    "source", ["torch/train_state.pt", "safetensors/sharded", "dcp/fsdp2_hf"], ids=["torch", "safetensors", "hf"]
)
def test_dcp_from_a_one_piece_source_is_cut_on_dim_0(source, tmp_path):
    """A source of one rank (a torch.save file, safetensors, a one-rank DCP) written as DCP of 4
    ranks: parameters and optimizer state in torch.chunk's dim-0 chunks, one per rank, as FSDP2
    saves them; 0-dim steps whole on rank 0; every rank's file holds a quarter of the bytes or so."""
    from ckpttool.convert import convert
    from ckpttool.formats.dcp_write import chunk_boxes

    src, out = FIXTURES / source, tmp_path / "dcp4"
    convert(src, out, to="dcp", world_size=4)
    _, m = registry.describe(src)
    _, o = registry.describe(out)
    boxes = _cut_boxes(o)
    for name, item in m.items.items():
        if not item.is_tensor:
            continue
        assert item.shape is not None
        if item.shape and item.kind in ("param", "optim"):
            want = [(c.offsets, c.sizes) for c in chunk_boxes(item.shape, 4) if c is not None]
            assert boxes[name] == sorted(want), name
        else:
            assert len(boxes[name]) == 1, name
    sizes = [(out / f"__{r}_0.distcp").stat().st_size for r in range(4)]
    assert min(sizes) > max(sizes) / 3, sizes
    assert not diff(src, out).different


def test_dcp_from_another_format_leaves_what_the_optimizer_does_not_train_whole(tmp_path):
    """Where the source's optimizer state names its parameters (DeepSpeed's ZeRO-2 here), a DCP
    output cuts the parameters it trains, their masters and moments; frozen weights and buffers are
    written whole on rank 0, as FSDP2 keeps buffers."""
    from ckpttool.convert import convert

    out = tmp_path / "dcp4"
    convert(FIXTURES / "deepspeed" / "zero2", out, to="dcp", world_size=4)
    boxes = _cut_boxes(registry.describe(out)[1])
    whole = sorted(name for name, b in boxes.items() if len(b) == 1)
    assert {"frozen.weight", "frozen.bias", "seen_tokens"} <= set(whole), whole
    cut = ("blocks.0.fc1.weight", "blocks.0.fc1.weight.fp32", "blocks.0.fc1.weight.exp_avg")
    assert all(len(boxes[n]) > 1 for n in cut)
    assert not diff(FIXTURES / "deepspeed" / "zero2", out).different


@pytest.mark.slow
def test_dcp_load_reads_a_one_piece_source_cut_on_dim_0(tmp_path):
    """torch's dcp.load at 4 ranks reads the torch.save source's DCP output into Shard(0) tensors,
    every value as the source holds it."""
    from ckpttool.convert import convert

    out = tmp_path / "dcp4"
    convert(FIXTURES / "torch" / "train_state.pt", out, to="dcp", world_size=4)
    assert dcp_load_mismatches(out, FIXTURES / "torch" / "train_state.pt", 4, tmp_path) == []


@pytest.mark.slow
def test_dcp_load_reads_the_new_world_size(tmp_path):
    out = tmp_path / "dcp2"
    reshard(FIXTURES / "dcp" / "fsdp2", out, Target(dp=2))
    assert dcp_load_mismatches(out, FIXTURES / "dcp" / "fsdp2", 2, tmp_path) == []


@pytest.mark.parametrize(
    "variant",
    [
        "zero2", "zero2_bf16", "zero1", "bf16_optimizer", "zero3", "zero3_bf16", "pipeline", "pipeline_tied",
        "pipeline_bf16", "tp2", "autotp",
    ],
)
def test_deepspeed_round_trip_is_exact(variant, tmp_path):
    """ZeRO DP=2 -> DP=1 -> DP=2 gives the original files' trees: flat fp32 partitions (padding
    stripped as DeepSpeed strips it), Adam moments, fragment mappings, paddings, module, config;
    ZeRO-3: per-parameter partitions in sub-groups laid out again, frozen fragments, the
    tied-weight map on rank 0 only; a pipeline run (PP=2 x TP=2, ZeRO-1): each model-parallel
    rank's layout, and its layer files as they were; a TP=2 run (tp2, ZeRO-2; autotp, AutoTP's
    ZeRO-1 with fused qkv and gate_up and an uneven lm_head): each TP rank's partitions made of its
    own regions of the joined items; BF16_Optimizer's files (bf16 + ZeRO-1, fp32 partitions saved
    with their padding, no zero_stage) as that optimizer writes them."""
    from ckpttool.formats.deepspeed import ALLOWLIST as DS

    src = FIXTURES / "deepspeed" / variant
    one, back = tmp_path / "dp1", tmp_path / "dp2"
    reshard(src, one, Target(dp=1))
    reshard(one, back, Target(dp=2), workers=2)
    assert registry.describe(one)[1].layout.dp == 1
    names = sorted(p.name for p in (src / "global_step3").iterdir())
    assert names == sorted(p.name for p in (back / "global_step3").iterdir())
    for name in names:
        a, b = _tree(src / "global_step3" / name, DS), _tree(back / "global_step3" / name, DS)
        if variant == "zero3_bf16":  # DeepSpeed leaves the padding of a bf16 run's flat fp32 groups
            a, b = _padding_blind(a), _padding_blind(b)  # as memory had it; ckpttool writes zeros
        assert a == b, name
    assert (back / "latest").read_text() == "global_step3"
    for out in (one, back):
        assert not diff(src, out).different
        report = verify(out)
        assert report.failing() == [] and report.seal is not None


def test_deepspeed_model_parallel_ranks_keep_their_own_values(tmp_path):
    """Each model-parallel rank's partitions are made from that rank's files, never from a replica
    on another rank: the fixture's model declares its TP copies replicas, and a value changed in
    MP rank 1's files (so no longer equal) is found in rank 1's output only; a change of ZeRO stage
    is refused, naming the file."""
    from ckpttool.formats.deepspeed import ALLOWLIST as DS_ALLOW

    def poked(out: _ptwrite.OutTensor, value: float) -> None:
        """``out`` written with its first element set to ``value``."""
        inner = out.fill

        def fill(buf: np.ndarray) -> None:
            inner(buf)
            buf.reshape(-1).view(np.float32)[0] = value

        out.fill, out.parts = fill, None

    src = FIXTURES / "deepspeed" / "pipeline"
    # (re-pickled by ckpttool's own writer from the restricted unpickler's tree: DeepSpeed, whose
    # classes the files name, need not be installed)
    edited = tmp_path / "src"
    shutil.copytree(src, edited)
    for dp in (0, 1):
        rel = f"global_step3/zero_pp_rank_{dp}_mp_rank_01_optim_states.pt"
        archive, obj, _ = _pt.load(src, rel, DS_ALLOW)
        try:
            tree = _ptwrite.carry(obj, lambda archive=archive: archive, now=True)
        finally:
            archive.close()
        osd = tree["optimizer_state_dict"]
        poked(osd["single_partition_of_fp32_groups"][0], 1234.5)  # first element of the partition
        poked(osd["base_optimizer_state"]["state"][0]["exp_avg"], -7.0)
        _ptwrite.save(tree, edited / rel)
        shutil.copystat(src / rel, edited / rel)  # (newer than ``latest`` reads as an incomplete save)
    out = tmp_path / "dp1"
    reshard(edited, out, Target(dp=1))
    firsts = {}
    for mp in range(4):
        archive, obj, _ = _pt.load(out, f"global_step3/zero_pp_rank_0_mp_rank_{mp:02d}_optim_states.pt", DS_ALLOW)
        try:
            osd = obj["optimizer_state_dict"]
            fp32 = _torchzip.read_tensor(archive, osd["single_partition_of_fp32_groups"][0]).reshape(-1)
            avg = _torchzip.read_tensor(archive, osd["base_optimizer_state"]["state"][0]["exp_avg"]).reshape(-1)
        finally:
            archive.close()
        firsts[mp] = (float(fp32[0]), float(avg[0]), float(fp32[fp32.size // 2]), float(avg[fp32.size // 2]))
    assert firsts[1] == (1234.5, -7.0) * 2  # the first element of each source rank's partition
    for mp in (0, 2, 3):
        assert not {1234.5, -7.0} & set(firsts[mp]), mp
    refusals = {
        2: r"layer_00-model_00-model_states.pt: a pipeline run at ZeRO-2: DeepSpeed's pipeline engine runs ZeRO-1",
        3: r"model_states.pt: a pipeline .* between ZeRO-1 and ZeRO-2 \(not to or from ZeRO-3",
    }
    for stage, refusal in refusals.items():
        with pytest.raises(UsageError, match=refusal):
            reshard(FIXTURES / "deepspeed" / "pipeline", tmp_path / "x", Target(dp=1, zero_stage=stage))
        assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("dp", [1, 3, 4])
def test_deepspeed_zero3_sub_groups_follow_dp(dp, tmp_path):
    """ZeRO-3 sub-groups close where the partitions reach sub_group_size (700 in the fixture), so they
    change with DP: the first param group's 5 weights make 3 sub-groups at DP=1, 2 at DP=2, 1 at DP=3 and 4; every
    rank's flat fp32 group holds ceil(numel/DP) elements of each parameter of its sub-group."""
    import math

    from ckpttool.formats.deepspeed import ALLOWLIST as DS

    out = tmp_path / "out"
    reshard(FIXTURES / "deepspeed" / "zero3", out, Target(dp=dp))
    files = sorted(p.name for p in (out / "global_step3").iterdir())
    assert files == sorted(f"zero_pp_rank_{r}_mp_rank_00_{k}_states.pt" for r in range(dp) for k in ("model", "optim"))
    archive, model, _ = _pt.load(out / "global_step3", "zero_pp_rank_0_mp_rank_00_model_states.pt", DS)
    archive.close()
    shapes = model["param_shapes"]
    want = {1: [2, 2, 1, 9], 3: [5, 9], 4: [5, 9]}[dp]
    assert [len(s) for s in shapes] == want
    assert model["dp_world_size"] == dp and model["shared_params"] == {"head.weight": "emb.weight"}
    for r in range(dp):
        archive, optim, _ = _pt.load(out / "global_step3", f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt", DS)
        archive.close()
        osd = optim["optimizer_state_dict"]
        assert osd["partition_count"] == dp
        flats = [t.shape[0] for t in osd["fp32_flat_groups"]]
        assert flats == [sum(-(-math.prod(v) // dp) for v in s.values()) for s in shapes]
        groups = osd["optimizer_state_dict"]["param_groups"]
        assert [g["params"] for g in groups] == [list(range(len(want) - 1)), [len(want) - 1]]
    _, m = registry.describe(out)
    assert m.layout.dp == dp and not diff(FIXTURES / "deepspeed" / "zero3", out).different
    assert verify(out).failing() == []


def test_deepspeed_zero3_sub_groups_are_deepspeeds():
    """zero3_sub_groups against DeepSpeed's own ZeRO-3 _create_fp16_sub_groups, over random
    parameter sizes, DP sizes and sub-group sizes."""
    try:
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    except Exception:
        pytest.skip("needs deepspeed (an oracle, not a dependency)")
    import random
    import types

    from ckpttool.formats.deepspeed_write import zero3_sub_groups

    class Param:
        def __init__(self, n: int) -> None:
            self.n = n

        def partition_numel(self) -> int:
            return self.n

    rng = random.Random(3)
    for _ in range(500):
        shapes = [(rng.randint(1, 400), rng.randint(1, 3)) for _ in range(rng.randint(1, 12))]
        dp, size = rng.randint(1, 9), rng.choice([1, 50, 300, 700, 10**9])
        params = [Param(-(-(a * b) // dp)) for a, b in shapes]
        fake = types.SimpleNamespace(sub_group_size=size)
        theirs = DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups(fake, params)
        ours = zero3_sub_groups([(str(k), s) for k, s in enumerate(shapes)], dp, size)
        assert [[params.index(p) for p in g] for g in theirs] == ours, (shapes, dp, size)


@pytest.mark.parametrize("dp", [3, 4, 7])
def test_deepspeed_any_dp(dp, tmp_path):
    """Partitions at DP sizes that leave padding on several ranks still hold the same state."""
    from ckpttool.formats.deepspeed_write import group_layout

    out = tmp_path / "out"
    reshard(FIXTURES / "deepspeed" / "zero2", out, Target(dp=dp))
    _, m = registry.describe(out)
    assert m.layout.dp == dp and not diff(FIXTURES / "deepspeed" / "zero2", out).different
    layout = group_layout({"a": (5,), "b": (3,)}, dp)
    assert layout.padded % (2 * dp) == 0 and sum(layout.padding(r) for r in range(dp)) == layout.padded - 8


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (Target(tp=3), "does not divide the 4 attention heads"),
        (Target(pp=3), "PP=3 does not divide the 4 layers"),
        (Target(pp=8), "PP=8 is larger than the 4 layers"),
        (Target(tp=4), "TP=4 does not divide the 2 query groups"),
        (Target(vpp=3), "the 2 layers of pipeline stage 0 do not split into VPP=3 model chunks"),
        (Target(to="deepspeed"), "--to deepspeed reshards DeepSpeed"),
        (Target(to="safetensors"), "--to 'safetensors'"),
        (Target(dp=2), "--dp"),
    ],
)
def test_invalid_targets_are_refused_before_writing(target, message, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        reshard(LEGACY, out, target)
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_unknown_parameters_need_a_split_rule(tmp_path):
    from ckpttool.formats.megatron_write import load_source, validate

    _, m = registry.describe(LEGACY)
    item = m.items.pop("decoder.layers.0.self_attention.linear_qkv.weight")
    item.name = "decoder.layers.0.self_attention.adapter.weight"
    m.items[item.name] = item
    src = load_source(Path(m.root), m)
    from ckpttool.formats.megatron_write import MegatronTarget

    problems = validate(m, src, MegatronTarget(tp=1, pp=1), {})
    assert any("no tensor-parallel split rule" in p and "adapter.weight" in p for p in problems)
    assert validate(m, src, MegatronTarget(tp=1, pp=1), parse_split_rules([r"adapter\.weight$=0"])) == []
    # two rules that disagree on one parameter: the first was taken without a word
    both = parse_split_rules(["adapter=0", r"adapter\.weight$=1"])
    assert validate(m, src, MegatronTarget(tp=1, pp=1), both) == [
        "--split-rule 'adapter=0' and 'adapter\\.weight$=1' both match "
        "decoder.layers.0.self_attention.adapter.weight and disagree on its split: make the patterns exclusive"
    ]
    assert validate(m, src, MegatronTarget(tp=1, pp=1), parse_split_rules(["adapter=0", r"adapter\.weight$=0"])) == []
    with pytest.raises(UsageError, match="expected REGEX=DIM"):
        parse_split_rules(["adapter"])


@pytest.mark.parametrize(
    ("source", "argv"),
    [
        ("megatron/legacy_tp2pp2", ["--tp", "1", "--pp", "1"]),
        ("megatron/legacy_tp2pp2", ["--to", "megatron-dist"]),
        ("megatron/dist_tp2pp2", ["--tp", "1"]),
        ("deepspeed/zero2", ["--dp", "1"]),
        ("deepspeed/zero3", ["--dp", "1"]),
        ("deepspeed/zero2", ["--to", "deepspeed-universal"]),
        ("dcp/fsdp2", ["--to", "dcp", "--dp", "2"]),
    ],
)
@pytest.mark.parametrize("sealed", [True, False])
def test_a_dry_run_names_every_file_the_run_writes(source, argv, sealed, tmp_path, cli):
    """The plan's files, then the small ones written last (metadata, trackers, the seal): the run
    writes those and no other (the tracker, common.pt, metadata.json and .metadata were left out)."""
    out = tmp_path / "out"
    flags = [] if sealed else ["--no-seal"]
    r = cli("reshard", FIXTURES / source, "-o", out, *argv, *flags, "--dry-run", "--json")
    assert r.code == 0, r.stderr
    plan = json.loads(r.stdout)
    planned = [f["path"] for f in plan["files"]] + plan["last_files"]
    assert ("ckpttool.manifest.json" in planned) == sealed and len(set(planned)) == len(planned)
    text = cli("reshard", FIXTURES / source, "-o", out, *argv, *flags, "--dry-run").stdout
    assert f"then {len(plan['last_files'])} small files: {', '.join(plan['last_files'])}; nothing written" in text
    real = cli("reshard", FIXTURES / source, "-o", out, *argv, *flags, "--json")
    assert real.code == 0, real.stderr
    assert sorted(planned) == sorted(rel for rel, _ in list_files(out))
    assert json.loads(real.stdout)["last_files"] == plan["last_files"]  # (the real run's left the seal out)


def _planned_then_written(cli, src, out, argv):
    """The plan ``reshard --dry-run --json`` prints, after which the same command has written ``out``."""
    plan = json.loads(cli("reshard", src, "-o", out, *argv, "--dry-run", "--json").stdout)
    assert cli("reshard", src, "-o", out, *argv).code == 0
    return plan


def _storages(path):
    """(count, bytes) of the tensor storages of a torch.save file."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        sizes = [i.file_size for i in z.infolist() if "/data/" in i.filename]
    return len(sizes), sum(sizes)


@pytest.mark.parametrize(
    ("source", "argv"),
    [
        ("legacy_tp2pp2", ["--tp", "1", "--pp", "1"]),
        ("legacy_tp2pp2", ["--tp", "2", "--pp", "2"]),
        ("legacy_tp2pp2", ["--tp", "1", "--pp", "2"]),
        ("legacy_pp2_decoupled", ["--tp", "1"]),
        ("legacy_dp2_fp16_distopt", ["--tp", "1"]),
        ("legacy_dp2_fp16_distopt", ["--tp", "1", "--no-distributed-optimizer"]),
        ("dist_tp2pp2", ["--to", "megatron", "--tp", "1", "--pp", "1"]),
        ("dist_tp2pp2", ["--to", "megatron"]),
        ("dist_dp2_fp16_distopt", ["--to", "megatron"]),
        ("dist_dp2_fp16_distopt", ["--to", "megatron", "--no-distributed-optimizer"]),
        ("dist_tp2ep2_mtp_distopt", ["--to", "megatron", "--tp", "1"]),
        # (the last stage's embeddings and tied output-layer copy: two steps from one source step)
        ("dist_pp4_mtpstage_tied", ["--to", "megatron", "--pp", "2"]),
        ("legacy_pp4_mtpstage_tied", ["--pp", "2"]),
    ],
)
def test_a_dry_run_counts_every_tensor_of_a_legacy_rank_file(source, argv, tmp_path, cli):
    """Its RNG state, its parameters' Adam steps and its optimizer's loss scaler, carried as the
    source holds them, were left out of the plan's tensors and bytes (108 tensors, 231.4 kB planned;
    140 and 236.6 kB written); from a torch_dist source, the RNG records (objects with tensors
    inside: 135 planned)."""
    out = tmp_path / "out"
    plan = _planned_then_written(cli, FIXTURES / "megatron" / source, out, argv)
    for f in plan["files"]:
        assert (f["tensors"], f["nbytes"]) == _storages(out / f["path"]), f["path"]


@pytest.mark.parametrize("source", ["dist_pp4_mtpstage_tied", "legacy_pp4_mtpstage_tied"])
def test_each_parameter_gets_its_own_adam_step(source, tmp_path, cli):
    """The last stage of a tied MTP model holds the word embeddings and the output layer's copy of
    them, both with the embeddings' step. From a torch_dist source (one step record) both entries
    were one pickled tensor: torch's Adam loads a step as it is and steps it in place, once per
    parameter. Each parameter now has its own, as megatron-core saves them."""
    out = tmp_path / "out"
    assert cli("reshard", FIXTURES / "megatron" / source, "-o", out, "--to", "megatron", "--pp", "2").code == 0
    last = load_pt(out / "iter_0000003" / "mp_rank_00_001" / "model_optim_rng.pt")
    steps = [entry["step"] for entry in last["optimizer"]["optimizer"]["state"].values()]
    assert len(steps) > 2 and all(isinstance(s, torch.Tensor) for s in steps)
    assert len({s.untyped_storage().data_ptr() for s in steps}) == len(steps)
    assert len({float(s) for s in steps}) == 1


@pytest.mark.parametrize(
    ("source", "argv"),
    [
        ("zero2", ["--dp", "1"]),
        ("zero2", ["--dp", "4"]),
        ("zero2_bf16", ["--dp", "1"]),
        ("zero3", ["--dp", "4"]),
        ("zero3", ["--dp", "2", "--zero-stage", "2"]),
        ("zero2", ["--dp", "2", "--zero-stage", "3"]),
        ("universal", ["--dp", "2"]),
        ("universal3", ["--dp", "2"]),
        ("pipeline", ["--dp", "1"]),
        ("zero2", ["--to", "deepspeed-universal"]),
        ("zero3", ["--to", "deepspeed-universal"]),
        ("zero1", ["--to", "deepspeed-universal"]),
        ("pipeline", ["--to", "deepspeed-universal"]),
    ],
)
def test_a_dry_run_counts_every_tensor_of_a_zero_file(source, argv, tmp_path, cli):
    """Each group's Adam step, the fp32 partition without its padding (as ZeRO-1/2 save it), a
    ZeRO-3 rank's module placeholders and a universal step.pt were left out or miscounted (zero2
    --dp 1: 6 tensors, 32,832 bytes planned; 8 and 32,836 written). A file copied as it is plans
    its bytes and its storages (zero1's model states to universal planned 20 tensors: the views
    into its 5 storages)."""
    out = tmp_path / "out"
    src = FIXTURES / "deepspeed" / source
    plan = _planned_then_written(cli, src, out, argv)
    copies = 0
    for f in plan["files"]:
        written = out / f["path"]
        same = [p for p in src.rglob(written.name) if p.read_bytes() == written.read_bytes()]
        if same:
            copies += 1
            assert (f["tensors"], f["nbytes"]) == (_storages(written)[0], written.stat().st_size), f["path"]
            continue
        storages = _storages(written)
        assert (f["tensors"], f["nbytes"]) == storages, f["path"]
        assert 0 < f["peak"] or not storages[0]
    assert copies < len(plan["files"])


@pytest.mark.parametrize(
    ("source", "argv"),
    [
        ("dcp/fsdp2", ["--to", "dcp", "--dp", "2"]),
        ("deepspeed/zero2", ["--to", "dcp"]),
        ("megatron/legacy_tp2pp2", ["--to", "dcp"]),
        ("megatron/legacy_tp2pp2", ["--to", "megatron-dist"]),
    ],
)
def test_a_dry_run_counts_the_tensor_records_of_a_distcp_file(source, argv, tmp_path, cli):
    """Each .distcp file's planned tensors and bytes are the tensor pieces its .metadata records
    (rank 0's object records were counted as tensors of 0 bytes: 82 planned, 54 written)."""
    from collections import Counter

    out = tmp_path / "out"
    plan = _planned_then_written(cli, FIXTURES / source, out, argv)
    _, m = registry.describe(out)
    tensors, nbytes = Counter(), Counter()
    for item in m.items.values():
        for p in item.pieces if item.is_tensor else ():
            tensors[p.file] += 1
            nbytes[p.file] += p.nbytes
    distcp = [f for f in plan["files"] if f["path"].endswith(".distcp")]
    assert distcp
    for f in distcp:
        rel = next(k for k in tensors if f["path"].endswith(k))
        assert (f["tensors"], f["nbytes"]) == (tensors[rel], nbytes[rel]), f["path"]


def test_max_memory_and_dry_run(tmp_path, cli):
    out = tmp_path / "out"
    r = cli("reshard", LEGACY, "-o", out, "--tp", "1", "--dry-run", "--json")
    assert r.code == 0, r.stderr
    plan = json.loads(r.stdout)
    assert not out.exists() and plan["written"] is False
    assert [f["path"] for f in plan["files"]] == [
        "iter_0000003/mp_rank_00_000/model_optim_rng.pt",
        "iter_0000003/mp_rank_00_001/model_optim_rng.pt",
    ]
    assert plan["nbytes"] == sum(f["nbytes"] for f in plan["files"]) > 0
    r = cli("reshard", LEGACY, "-o", out, "--tp", "1", "--max-memory", "1MB")
    assert r.code == 2 and "--max-memory 1MB" in r.stderr and not out.exists()
    r = cli("reshard", LEGACY, "-o", out, "--tp", "1", "--workers", "2", "--max-memory", "350MB")
    assert r.code == 0, r.stderr
    assert "reduced to 1" in r.stderr
    r = cli("reshard", LEGACY, "-o", out, "--tp", "1")
    assert r.code == 2 and "exists" in r.stderr
    # a dry run says what the run would do: refuse the same output, plan it with --force
    r = cli("reshard", LEGACY, "-o", out, "--tp", "1", "--dry-run")
    assert r.code == 2 and "exists" in r.stderr and "--force" in r.stderr
    r = cli("reshard", LEGACY, "-o", out, "--tp", "1", "--dry-run", "--force", "--json")
    assert r.code == 0 and json.loads(r.stdout)["written"] is False
    r = cli("reshard", LEGACY, "-o", LEGACY / "inside", "--tp", "1")
    assert r.code == 2 and "inside the source" in r.stderr


def _megatron_lm() -> str | None:
    """A Megatron-LM source (tree or git mirror) for the oracle tests, when this machine has one."""
    path = os.environ.get("MEGATRON_LM")
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        return None
    return path if path and Path(path).exists() else None


def _ref(name: str) -> tuple[str, str]:
    return "--reference", str(FIXTURES / "megatron" / f"{name}.reference.pt")


def _oracle(mlm: str, ckpt: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run Megatron-LM's own loader on ``ckpt`` (fixtures/oracle_megatron_reshard.py) with ``args``."""
    return subprocess.run(
        [sys.executable, str(FIXTURES / "oracle_megatron_reshard.py"), "--megatron-lm", mlm, "--ckpt", str(ckpt), *args],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip


@pytest.mark.slow
def test_megatron_lm_loads_the_resharded_checkpoint(tmp_path):
    """Oracle: Megatron-LM's own load_checkpoint (optimizer and RNG on) at TP=1 PP=1 loads our
    output; every tensor equals the reference; it trains the next step."""
    mlm = _megatron_lm()
    if mlm is None:
        pytest.skip("needs megatron-core and a Megatron-LM source (set MEGATRON_LM)")
    out = tmp_path / "tp1"
    reshard(LEGACY, out, Target(tp=1, pp=1))
    proc = _oracle(mlm, out, "--tp", "1", "--pp", "1", *_ref("legacy_tp2pp2"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1)])
def test_megatron_lm_loads_the_checkpoint_without_the_distributed_optimizer(tp, pp, tmp_path):
    """Oracle: from the distributed-optimizer fixture, --no-distributed-optimizer; Megatron-LM's
    load_checkpoint with the Float16 optimizer (no --use-distributed-optimizer) loads it at the new
    TP; every tensor equals the reference; it trains the next step."""
    mlm = _megatron_lm()
    if mlm is None:
        pytest.skip("needs megatron-core and a Megatron-LM source (set MEGATRON_LM)")
    out = tmp_path / "out"
    reshard(DISTOPT, out, Target(tp=tp, pp=pp, distributed_optimizer=False))
    proc = _oracle(mlm, out, "--tp", str(tp), "--pp", str(pp), *_ref("legacy_tp2pp2_distopt"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("source", "tp", "pp", "bucket"),
    [("legacy_tp2pp2_distopt", 1, 1, None), ("legacy_tp2pp2", 2, 1, None), ("legacy_tp2pp2", 2, 1, 10)],
)
def test_megatron_lm_loads_the_distributed_optimizer_checkpoint(source, tp, pp, bucket, tmp_path):
    """Oracle: Megatron-LM's load_checkpoint with --use-distributed-optimizer loads our
    distrib_optim.pt at a new TP/PP (resharded, or converted from the Float16 optimizer, or laid out
    in many buckets); every tensor equals the reference; it trains the next step."""
    mlm = _megatron_lm()
    if mlm is None:
        pytest.skip("needs megatron-core and a Megatron-LM source (set MEGATRON_LM)")
    src = FIXTURES / "megatron" / source if bucket is None else _with_buckets(tmp_path, bucket)
    out = tmp_path / "out"
    reshard(src, out, Target(tp=tp, pp=pp, distributed_optimizer=True))
    env = dict(os.environ)
    if bucket is not None:
        env["CKPTTOOL_MEGATRON_EXTRA"] = f"--overlap-grad-reduce --ddp-bucket-size {bucket}"
    proc = _oracle(mlm, out, "--tp", str(tp), "--pp", str(pp), "--distopt", *_ref(source), env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("source", "tp", "pp"), [("legacy_pp2_decoupled", 2, 1), ("legacy_pp2_decoupled_distopt", 1, 1)]
)
def test_megatron_lm_loads_the_decoupled_lr_checkpoint(source, tp, pp, tmp_path):
    """Oracle: from the --decoupled-lr runs (the Float16 one converted, or the distributed-optimizer
    one resharded), --distributed-optimizer at a new TP/PP: Megatron-LM's load_checkpoint with
    --use-distributed-optimizer loads it, every tensor equals the reference, it trains the next step.
    megatron-core 0.16.1's Float16 optimizer cannot load a checkpoint with decoupled-LR groups at all,
    its own run's included (Megatron-LM #4705, fixed in 0.19), so --no-distributed-optimizer is
    checked against that run's own save instead (test_megatron_decoupled_lr_groups_are_megatrons)."""
    mlm = _megatron_lm()
    if mlm is None:
        pytest.skip("needs megatron-core and a Megatron-LM source (set MEGATRON_LM)")
    out = tmp_path / "out"
    reshard(FIXTURES / "megatron" / source, out, Target(tp=tp, pp=pp, distributed_optimizer=True))
    args = ("--tp", str(tp), "--pp", str(pp), "--distopt", "--decoupled", "--padded-vocab", "64")
    proc = _oracle(mlm, out, *args, *_ref("legacy_pp2_decoupled_distopt"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


GROUPED = FIXTURES / "megatron" / "legacy_tp2ep2_gg"
ITER = "iter_0000003"


def _same_tree(a: Any, b: Any, where: str = "") -> list[str]:
    """Where two unpickled rank files differ: keys and their order, tensors bit for bit with their
    strides, other values by equality (``args`` left out: it records the layout)."""
    import torch

    if isinstance(a, dict):
        if list(a) != list(b):
            return [f"{where}: keys {list(a)[:6]} != {list(b)[:6]}"]
        return [d for k in a if k != "args" for d in _same_tree(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, list | tuple):
        if len(a) != len(b):
            return [f"{where}: {len(a)} != {len(b)} entries"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _same_tree(x, y, f"{where}[{i}]")]
    if isinstance(a, torch.Tensor):
        same = a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)
        return [] if same else [f"{where}: tensor {a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}"]
    if isinstance(a, np.ndarray):
        return [] if np.array_equal(a, b) else [f"{where}: array"]
    return [] if a == b else [f"{where}: {a!r:.60} != {b!r:.60}"]


def test_grouped_gemm_experts_written_as_legacy_grouped_mlp(tmp_path):
    """A model trained with --moe-grouped-gemm (legacy GroupedMLP) is written back in its own legacy
    layout: at the source's TP=2 x EP=2 every rank file holds exactly what Megatron-LM saved
    (weight1/weight2 with each expert's block transposed in place, the Float16 optimizer's state
    and fp32 copies composed the same way, same keys in the same order); at other TP/EP, with or
    without the distributed optimizer, and from the torch_dist save, ckpttool reads back the
    source's tensors."""
    same = tmp_path / "same"
    reshard(GROUPED, same, Target(tp=2, pp=1, ep=2))
    for rank in ("mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"):
        theirs, ours = (load_pt(root / ITER / rank / "model_optim_rng.pt") for root in (GROUPED, same))
        assert "decoder.layers.0.mlp.experts.weight1" in ours["model"]
        assert _same_tree(theirs, ours) == [], rank
    for name, target, source in [
        ("tp1ep1", Target(tp=1, pp=1, ep=1), GROUPED),
        ("tp1ep2_distopt", Target(tp=1, pp=1, ep=2, distributed_optimizer=True), GROUPED),
        ("from_dist", Target(to="megatron", tp=1, pp=1, ep=2), FIXTURES / "megatron" / "dist_tp2ep2_gg"),
    ]:
        out = tmp_path / name
        reshard(source, out, target)
        report = diff(GROUPED, out)
        assert report.compared >= 116 and not report.values and not report.changed_meta and not report.objects, name
        assert not [n for n in report.added + report.removed if "rng_state" not in n], name
        first = load_pt(next((out / ITER).glob("mp_rank_*")) / "model_optim_rng.pt")["model"]
        assert not [k for k in first if "local_experts" in k], name  # GroupedMLP's names, no _extra_state


@pytest.mark.slow
@pytest.mark.parametrize(
    ("tp", "ep", "etp", "distopt"), [(1, 2, None, False), (2, 1, None, False), (1, 2, None, True), (2, 2, 1, False)]
)
def test_megatron_lm_loads_the_grouped_gemm_experts(tp, ep, etp, distopt, tmp_path):
    """Oracle: Megatron-LM's load_checkpoint, run with --moe-grouped-gemm (GroupedMLP, its CUDA
    kernel stood in by plain torch), loads our legacy output of the grouped-GEMM fixture at a new
    TP and EP (and an expert TP of its own), with the Float16 or the distributed optimizer; every
    tensor, the experts' through megatron-core's own sharded state dict, equals the reference; it
    trains the next step."""
    mlm = _megatron_lm()
    if mlm is None:
        pytest.skip("needs megatron-core and a Megatron-LM source (set MEGATRON_LM)")
    out = tmp_path / "out"
    reshard(GROUPED, out, Target(tp=tp, pp=1, ep=ep, etp=etp, distributed_optimizer=distopt))
    args = ["--tp", str(tp), "--pp", "1", "--ep", str(ep), "--grouped-gemm", *(["--distopt"] * distopt)]
    args += ["--etp", str(etp)] if etp else []
    proc = _oracle(mlm, out, *args, *_ref("legacy_tp2ep2_gg"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "every check passed" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "distopt"), [(1, True), (1, False)])
def test_megatron_lm_loads_the_fp32_model(tp, distopt, tmp_path):
    """Oracle: from the fp32 model's FP32-optimizer run (legacy_tp2_fp32), at TP=1 with the
    distributed optimizer (distrib_optim.pt's main params written from the parameters, which that
    optimizer keeps no copy of) or without: Megatron-LM's load_checkpoint loads it, every tensor
    equals the reference (the distributed-optimizer run's gather), it trains the next step."""
    mlm = _megatron_lm()
    if mlm is None:
        pytest.skip("needs megatron-core and a Megatron-LM source (set MEGATRON_LM)")
    out = tmp_path / "out"
    reshard(FIXTURES / "megatron" / "legacy_tp2_fp32", out, Target(tp=tp, pp=1, distributed_optimizer=distopt))
    args = ["--tp", str(tp), "--pp", "1", "--fp32", *(["--distopt"] if distopt else [])]
    proc = _oracle(mlm, out, *args, *_ref("dist_tp2_fp32_distopt"))  # (FP32Optimizer: its fp32 entries aside)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


@pytest.mark.slow
def test_deepspeed_resumes_from_the_resharded_checkpoint():
    """Oracle: DeepSpeed's load_checkpoint at DP=1 resumes from our DP=1 output of the DP=2
    ZeRO-2 fixture; the state equals the reference, the next step's loss is bit-identical to the
    uninterrupted DP=2 run's, and DeepSpeed's zero_to_fp32 reads the output."""
    report = _ds_oracle("--variant", "zero2", "--dp", "1")
    assert "step-4 loss: BIT-IDENTICAL" in report


@pytest.mark.slow
@pytest.mark.parametrize(
    ("variant", "dp"),
    [("zero3", 1), ("zero3_bf16", 1), pytest.param("zero3", 4, marks=pytest.mark.long)],  # DP=4: 27 s more
)
def test_deepspeed_resumes_from_the_resharded_zero3_checkpoint(variant, dp):
    """Oracle: DeepSpeed's load_checkpoint at DP=1 resumes from our ZeRO-3 output of the DP=2 fixture
    (sub-groups laid out again: 4 at DP=1 where the fixture has 3): the state after the load equals
    the reference bit for bit, the next step's loss is bit-identical to the uninterrupted DP=2
    run's, and zero_to_fp32 reads it. (DeepSpeed's own route, ds_to_universal + load_universal, is
    not compared here: for ZeRO-3 it leaves the frozen parameters unrestored.)"""
    report = _ds_oracle("--variant", variant, "--dp", str(dp), "--no-native")
    assert "step-4 loss: BIT-IDENTICAL" in report
    assert "zero_to_fp32: 18 tensors, 18 bit-identical to the reference" in report


@pytest.mark.slow
@pytest.mark.parametrize("dp", [1, pytest.param(4, marks=pytest.mark.long)])
def test_deepspeed_resumes_from_a_resharded_bf16_optimizer_checkpoint(dp):
    """Oracle: BF16_Optimizer's checkpoint (bf16 + ZeRO-1 with fp32 gradient accumulation, the
    Megatron-DeepSpeed default) at a new DP size: DeepSpeed's load_checkpoint at that size builds a
    BF16_Optimizer and takes our files; the state equals the reference bit for bit; the files are
    what DeepSpeed's own save at that DP size writes (its ds_to_universal + load_universal route);
    at DP=1 the next step's loss is bit-identical to the uninterrupted DP=2 run's (at DP=4 the
    micro-batches of 2 reduce in another order: equal to DeepSpeed's own route's, bit for bit)."""
    report = _ds_oracle("--variant", "bf16_optimizer", "--dp", str(dp))
    assert "optimizer deepspeed.runtime.bf16_optimizer.BF16_Optimizer" in report
    assert "state after load vs bf16_optimizer.reference.pt" in report and "control after load vs reference: OK" in report
    assert f"files: ckpttool's DP={dp} checkpoint vs DeepSpeed's save_checkpoint at DP={dp}: 0 difference(s)" in report
    if dp == 1:
        assert "step-4 loss: BIT-IDENTICAL" in report
    assert f"native DP={dp} (same layout): step-4 loss" in report and "-> BIT-IDENTICAL; state after step 4" in report


@pytest.mark.slow
def test_deepspeed_universal_of_a_bf16_optimizer_checkpoint_is_ds_to_universals(tmp_path):
    """Oracle: --to deepspeed-universal of BF16_Optimizer's checkpoint gives DeepSpeed's
    ds_to_universal output byte for byte (that tool run with --inject_missing_state, as a client
    without universal_checkpoint_info must, on a copy)."""
    pytest.importorskip("deepspeed", reason="needs deepspeed (an oracle, not a dependency)")
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "deepspeed" / "bf16_optimizer", src)
    theirs = tmp_path / "theirs"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(src / "global_step3"),
         "--output_folder", str(theirs), "--inject_missing_state", "--num_extract_workers", "1",
         "--num_merge_workers", "1"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    out = tmp_path / "ours"
    reshard(FIXTURES / "deepspeed" / "bf16_optimizer", out, Target(to="deepspeed-universal"))
    names, differ = _differing_files(out / "global_step3_universal", theirs)
    assert len(names) == 63 and differ == []
    assert not diff(FIXTURES / "deepspeed" / "bf16_optimizer", out).different


def _differing_files(ours: Path, theirs: Path) -> tuple[list[str], list[str]]:
    """The files under ``theirs`` (asserted to be the files under ``ours``), and those whose bytes
    differ between the two."""
    names = sorted(str(p.relative_to(theirs)) for p in theirs.rglob("*") if p.is_file())
    assert names == sorted(str(p.relative_to(ours)) for p in ours.rglob("*") if p.is_file())
    return names, [n for n in names if (ours / n).read_bytes() != (theirs / n).read_bytes()]


def _ds_to_universal(src: Path, out: Path) -> Path:
    """DeepSpeed's ds_to_universal (a subprocess) of the checkpoint ``src``'s global_step3 into
    ``out``, which it returns."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
         str(src / "global_step3"), "--output_folder", str(out),
         "--num_extract_workers", "1", "--num_merge_workers", "1"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return out


def test_deepspeed_universal_is_ds_to_universal_byte_for_byte(tmp_path):
    """--to deepspeed-universal of the ZeRO-2 fixture: the same files as DeepSpeed's ds_to_universal
    (kept in fixtures/deepspeed/universal), byte for byte, but one. That one is the tied
    head.weight, which ds_to_universal saves with the whole flat buffer its tensor is a view of, and
    ckpttool with the tensor alone (torch.load gives equal values)."""
    import torch

    out = tmp_path / "uni"
    reshard(FIXTURES / "deepspeed" / "zero2", out, Target(to="deepspeed-universal"))
    assert (out / "latest_universal").read_text() == "global_step3_universal"
    ours, theirs = out / "global_step3_universal", FIXTURES / "deepspeed" / "universal" / "global_step3_universal"
    _, differ = _differing_files(ours, theirs)
    assert differ == ["zero/head.weight/fp32.pt"], differ
    a = torch.load(ours / differ[0], weights_only=True)
    b = torch.load(theirs / differ[0], weights_only=True)
    assert list(a) == list(b) == ["param"] and torch.equal(a["param"], b["param"])
    report = verify(out)
    assert report.failing() == [] and report.seal is not None


def test_deepspeed_universal_from_zero3_is_ds_to_universal_byte_for_byte(tmp_path):
    """--to deepspeed-universal of the ZeRO-3 fixture: every file equals DeepSpeed's ds_to_universal
    output (kept in fixtures/deepspeed/universal3) byte for byte: the bare flat tensors (the fp32
    copy requiring grad), rank 0's whole optimizer state with the param groups shared and the flat
    groups' ``ds_id`` attributes, and both ranks' model-states files. It reads back as the source."""
    out = tmp_path / "uni3"
    result = reshard(FIXTURES / "deepspeed" / "zero3", out, Target(to="deepspeed-universal"))
    assert any("ZeRO-3 universal load restores no frozen parameter" in n for n in result.plan.notes)
    assert (out / "latest_universal").read_text() == "global_step3_universal"
    ours, theirs = out / "global_step3_universal", FIXTURES / "deepspeed" / "universal3" / "global_step3_universal"
    names, differ = _differing_files(ours, theirs)
    assert len(names) == 45 and "zero/blocks.0.fc1.weight/fp32.pt" in names
    assert differ == []
    assert verify(out).failing() == []
    assert not diff(FIXTURES / "deepspeed" / "zero3", out).different


def test_ds_to_universal_of_zero3_reads_as_its_source():
    """DeepSpeed's own ZeRO-3 universal output: the flat files take their shapes from the copied
    model states, the frozen parameters come from every rank's fragments, the step from
    optimizer_state.pt; it holds what the ZeRO-3 checkpoint holds."""
    _, m = registry.describe(FIXTURES / "deepspeed" / "universal3")
    _, src = registry.describe(FIXTURES / "deepspeed" / "zero3")
    assert m.step == 3 and m.items["blocks.0.fc1.weight.fp32"].shape == (32, 16)
    assert m.items["frozen.weight.fp32"].shape == src.items["frozen.weight.fp32"].shape
    assert "optimizer.param_groups.1.step" in m.items
    assert not diff(FIXTURES / "deepspeed" / "zero3", FIXTURES / "deepspeed" / "universal3").different


def test_deepspeed_zero3_to_zero2_is_the_zero2_run(tmp_path):
    """--zero-stage 2 of the ZeRO-3 fixture at DP=2 gives, file for file, the trees of the ZeRO-2
    fixture: the two were trained from the same seed on the same batches in fp32, so their states
    are the same bits, and the output holds what DeepSpeed's ZeRO-2 engine saved for that run:
    the module whole (masters, frozen parameters gathered from their fragments, the tied alias),
    one flat group per param group, fragment mappings, paddings, the loss scaler, clip_grad, the
    config at stage 2 without ZeRO-3's settings. Through DP=1 the same."""
    from ckpttool.formats.deepspeed import ALLOWLIST as DS

    zero2 = FIXTURES / "deepspeed" / "zero2" / "global_step3"
    names = sorted(p.name for p in zero2.glob("*.pt"))
    for dp in (2, 1):
        out = tmp_path / f"dp{dp}"
        result = reshard(FIXTURES / "deepspeed" / "zero3", out, Target(to="deepspeed", dp=dp, zero_stage=2))
        assert result.plan.layout == {"dp": dp, "zero_stage": 2}
        assert any("ZeRO-3 -> ZeRO-2" in n for n in result.plan.notes)
        assert any(
            "ZeRO-3's own settings dropped at ZeRO-2" in n
            and "sub_group_size 700, stage3_param_persistence_threshold 0, "
            "stage3_gather_16bit_weights_on_model_save True" in n
            for n in result.plan.notes
        ), result.plan.notes
        assert verify(out).failing() == []  # the module params are items of ZeRO-2 only: the rest is equal
        assert not diff(
            FIXTURES / "deepspeed" / "zero3", out, kinds=["optim", "master", "scheduler", "counter"]
        ).different
        if dp == 2:
            assert names == sorted(p.name for p in (out / "global_step3").glob("*.pt"))
            for name in names:
                assert _tree(zero2 / name, DS) == _tree(out / "global_step3" / name, DS), name
    back = tmp_path / "back"
    reshard(tmp_path / "dp1", back, Target(dp=2))
    for name in names:
        assert _tree(zero2 / name, DS) == _tree(back / "global_step3" / name, DS), name


def test_deepspeed_zero2_to_zero1_and_back(tmp_path):
    """ZeRO-1 and ZeRO-2 save one layout: --zero-stage 1 records stage 1 (the optimizer files' enum,
    the config) and drops the frozen parameters' shapes and values, which DeepSpeed saves from
    ZeRO-2 on; --zero-stage 2 at DP=2 puts them back: the ZeRO-2 fixture's trees again."""
    from ckpttool.formats.deepspeed import ALLOWLIST as DS

    one, back = tmp_path / "z1", tmp_path / "z2"
    reshard(FIXTURES / "deepspeed" / "zero2", one, Target(dp=1, zero_stage=1))
    model = _tree(one / "global_step3" / "mp_rank_00_model_states.pt", DS)
    entries = dict(model[1])
    assert entries["frozen_param_shapes"] is None and entries["frozen_param_fragments"] is None
    assert dict(dict(entries["ds_config"][1])["zero_optimization"][1]) == {"stage": 1}
    optim = _tree(one / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt", DS)
    osd = dict(dict(optim[1])["optimizer_state_dict"][1])
    assert osd["zero_stage"] == _unpickle.EnumValue("deepspeed.runtime.zero.config.ZeroStageEnum", 1)
    assert registry.describe(one)[1].layout.zero_stage == 1
    reshard(one, back, Target(dp=2, zero_stage=2))
    zero2 = FIXTURES / "deepspeed" / "zero2" / "global_step3"
    for name in sorted(p.name for p in zero2.glob("*.pt")):
        assert _tree(zero2 / name, DS) == _tree(back / "global_step3" / name, DS), name


def test_deepspeed_tensor_parallel_zero2_to_zero1_and_back(tmp_path):
    """A model-parallel run changes stage between ZeRO-1 and ZeRO-2 as a plain one does, rank by
    rank: tp2 (TP=2, ZeRO-2) at --dp 1 --zero-stage 1 records stage 1 in every model-parallel rank's
    files (the optimizer's enum, the config); --dp 2 --zero-stage 2 gives the fixture's trees again.
    (DeepSpeed's ZeRO-1 engine at TP=2 resumes from it: the slow oracle above.)"""
    from ckpttool.formats.deepspeed import ALLOWLIST as DS

    src = FIXTURES / "deepspeed" / "tp2"
    one, back = tmp_path / "z1", tmp_path / "z2"
    reshard(src, one, Target(dp=1, zero_stage=1))
    for mp in (0, 1):
        optim = _tree(one / "global_step3" / f"zero_pp_rank_0_mp_rank_0{mp}_optim_states.pt", DS)
        osd = dict(dict(optim[1])["optimizer_state_dict"][1])
        assert osd["zero_stage"] == _unpickle.EnumValue("deepspeed.runtime.zero.config.ZeroStageEnum", 1)
        model = dict(_tree(one / "global_step3" / f"mp_rank_0{mp}_model_states.pt", DS)[1])
        assert dict(dict(model["ds_config"][1])["zero_optimization"][1]) == {"stage": 1}
    assert registry.describe(one)[1].layout.zero_stage == 1
    reshard(one, back, Target(dp=2, zero_stage=2))
    for path in sorted((src / "global_step3").iterdir()):
        assert _tree(path, DS) == _tree(back / "global_step3" / path.name, DS), path.name


def _blind_config(tree: Any) -> Any:
    """A :func:`_tree` of a DeepSpeed file without its saved ``ds_config`` (ZeRO-3's own settings,
    which a ZeRO-1/2 checkpoint does not know, are in it)."""
    return ("dict", [(k, v) for k, v in tree[1] if k != "ds_config"], tree[2])


def test_deepspeed_zero2_to_zero3_is_the_zero3_run(tmp_path):
    """--zero-stage 3 --sub-group-size 700 of the ZeRO-2 fixture at DP=2 gives, file for file, the
    trees of the ZeRO-3 fixture (the same run, see above), the saved config aside: per rank the
    module's placeholders and buffer, sub-groups cut at 700 elements, the rank's part of each
    frozen parameter, the tied-weight map on rank 0 only, flat fp32 groups, moments, steps, param
    groups listing their sub-groups. Through DP=1 and back the same. Without --sub-group-size the
    groups are cut at DeepSpeed's default, and the plan says which size to resume with."""
    from ckpttool.formats.deepspeed import ALLOWLIST as DS

    zero3 = FIXTURES / "deepspeed" / "zero3" / "global_step3"
    names = sorted(p.name for p in zero3.glob("*.pt"))
    out, one, back = tmp_path / "z3", tmp_path / "dp1", tmp_path / "back"
    result = reshard(FIXTURES / "deepspeed" / "zero2", out, Target(zero_stage=3, sub_group_size=700))
    assert result.plan.layout == {"dp": 2, "zero_stage": 3}
    assert any("zero_optimization.sub_group_size 700" in n for n in result.plan.notes)
    reshard(FIXTURES / "deepspeed" / "zero2", one, Target(dp=1, zero_stage=3, sub_group_size=700))
    reshard(one, back, Target(dp=2))
    for root in (out, back):
        assert names == sorted(p.name for p in (root / "global_step3").glob("*.pt"))
        for name in names:
            ours = _tree(root / "global_step3" / name, DS)
            assert _blind_config(_tree(zero3 / name, DS)) == _blind_config(ours), name
        assert verify(root).failing() == []
        assert not diff(FIXTURES / "deepspeed" / "zero2", root, kinds=["optim", "master", "scheduler"]).different
    config = dict(dict(_tree(out / "global_step3" / names[0], DS)[1])["ds_config"][1])
    assert dict(config["zero_optimization"][1]) == {"stage": 3, "sub_group_size": 700}
    default = reshard(FIXTURES / "deepspeed" / "zero2", tmp_path / "d", Target(zero_stage=3))
    assert any("sub_group_size 1000000000" in n for n in default.plan.notes)
    shapes = _tree(tmp_path / "d" / "global_step3" / names[0], DS)
    assert len(dict(shapes[1])["param_shapes"][1]) == 2  # one sub-group per param group


def test_deepspeed_zero2_bf16_through_zero3_and_back(tmp_path):
    """The bf16 ZeRO-2 fixture (trained with zero_optimization.parameter_alignment) at ZeRO-3, DP=3,
    one parameter per sub-group (--sub-group-size 0, as DeepSpeed cuts it), then back at ZeRO-2,
    DP=2: DeepSpeed's own files' trees again: the module in bf16 is the masters rounded as ZeRO
    rounds them, the parameters padded for alignment as the saved config asks, the config as it
    was."""
    from ckpttool.formats.deepspeed import ALLOWLIST as DS

    src = FIXTURES / "deepspeed" / "zero2_bf16"
    three, back = tmp_path / "z3", tmp_path / "z2"
    reshard(src, three, Target(dp=3, zero_stage=3, sub_group_size=0))
    shapes = dict(_tree(three / "global_step3" / "zero_pp_rank_0_mp_rank_00_model_states.pt", DS)[1])
    assert all(len(group[1]) == 1 for group in shapes["param_shapes"][1])
    reshard(three, back, Target(dp=2, zero_stage=2))
    names = sorted(p.name for p in (src / "global_step3").glob("*.pt"))
    assert names == sorted(p.name for p in (back / "global_step3").glob("*.pt"))
    for name in names:
        assert _tree(src / "global_step3" / name, DS) == _tree(back / "global_step3" / name, DS), name


def test_deepspeed_zero3_empty_parameter(tmp_path):
    """DeepSpeed files a parameter with no elements among the frozen ones, with an empty fragment on
    every rank. It reads as an empty tensor and survives a new DP, a new stage and the universal
    layout."""
    from ckpttool.formats.deepspeed import ALLOWLIST as DS

    src = FIXTURES / "deepspeed" / "zero3"
    dst = tmp_path / "empty"
    shutil.copytree(src, dst)

    def nothing(buf: np.ndarray) -> None:
        pass

    for f in dst.glob("global_step3/zero_pp_rank_*_model_states.pt"):
        archive, obj, _ = _pt.load(src, str(f.relative_to(dst)), DS)
        try:
            obj["module"]["empty.weight"] = _ptwrite.OutTensor("float32", (0,), nothing)
            obj["frozen_param_shapes"]["empty.weight"] = _unpickle.TorchSize((0, 16))
            obj["frozen_param_fragments"]["empty.weight"] = _ptwrite.OutTensor("float32", (0,), nothing)
            _ptwrite.save(_ptwrite.carry(obj, lambda archive=archive: archive), f)
        finally:
            archive.close()
    assert registry.describe(dst)[1].items["empty.weight.fp32"].shape == (0, 16)
    for n, target in enumerate([Target(dp=3), Target(zero_stage=2), Target(to="deepspeed-universal")]):
        out = tmp_path / str(n)
        reshard(dst, out, target)
        assert verify(out).failing() == []
        items = registry.describe(out)[1].items
        assert items["empty.weight.fp32"].shape == (0, 16)  # ZeRO-3 and universal: the frozen fragments
        if n == 1:  # ZeRO-2: the module holds it whole, as every other parameter
            assert items["empty.weight"].shape == (0, 16) and items["frozen.weight"].shape == (16, 16)
    assert not diff(dst, tmp_path / "0").different


def test_deepspeed_zero3_to_zero2_without_a_saved_config(tmp_path):
    """DeepSpeed saves the config's path when launched with a file. The ZeRO-3 sub-groups are then
    taken as saved (joining them needs no sub_group_size) and clip_grad, which ZeRO-3 does not
    save, is left out: DeepSpeed keeps the resuming config's."""
    from ckpttool.formats.deepspeed import ALLOWLIST as DS

    def path_config(obj: Any) -> None:
        obj["ds_config"] = "/runs/ds_config.json"

    src = rewritten_copy(
        tmp_path / "src", FIXTURES / "deepspeed" / "zero3", path_config, files="global_step3/*.pt", allow=DS
    )
    out = tmp_path / "z2"
    reshard(src, out, Target(zero_stage=2))
    osd = dict(
        dict(_tree(out / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt", DS)[1])["optimizer_state_dict"][
            1
        ]
    )
    assert "clip_grad" not in osd and "base_optimizer_state" in osd
    reshard(src, tmp_path / "uni", Target(to="deepspeed-universal"))
    assert not diff(FIXTURES / "deepspeed" / "zero3", tmp_path / "uni").different


def test_deepspeed_universal_back_to_zero_files(tmp_path):
    """DeepSpeed's universal checkpoint of the ZeRO-2 run (ds_to_universal's own output) written as
    ZeRO-2 files at DP=2 gives the ZeRO-2 fixture's trees: optimizer partitions, fragment
    mappings, paddings and each group's step rebuilt from the per-parameter files, the model
    states as they were copied. Any DP and ZeRO-1 too; without a DP size, refused."""
    from ckpttool.formats.deepspeed import ALLOWLIST as DS

    universal = FIXTURES / "deepspeed" / "universal"
    zero2 = FIXTURES / "deepspeed" / "zero2" / "global_step3"
    out = tmp_path / "dp2"
    result = reshard(universal, out, Target(to="deepspeed", dp=2))
    assert result.plan.layout == {"dp": 2, "zero_stage": 2} and (out / "latest").read_text() == "global_step3"
    names = sorted(p.name for p in zero2.glob("*.pt"))
    assert names == sorted(p.name for p in (out / "global_step3").glob("*.pt"))
    for name in names:
        assert _tree(zero2 / name, DS) == _tree(out / "global_step3" / name, DS), name
    for n, target in enumerate([Target(to="deepspeed", dp=3), Target(to="deepspeed", dp=1, zero_stage=1)]):
        reshard(universal, tmp_path / str(n), target)
        assert verify(tmp_path / str(n)).failing() == []
        assert not diff(FIXTURES / "deepspeed" / "zero2", tmp_path / str(n)).different  # the run it was made of
    with pytest.raises(UsageError, match="needs the data-parallel size to write"):
        reshard(universal, tmp_path / "a", Target(to="deepspeed"))
    with pytest.raises(UsageError, match="is a universal one already"):  # once named --to deepspeed
        reshard(universal, tmp_path / "a", Target(to="deepspeed-universal"))
    with pytest.raises(UsageError, match="--to deepspeed-universal: from ZeRO stage 0 is not supported"):
        reshard(FIXTURES / "deepspeed" / "zero0", tmp_path / "a", Target(to="deepspeed-universal"))
    assert not (tmp_path / "a").exists()


def test_deepspeed_universal_of_a_bf16_optimizer_run_back_to_its_files(tmp_path):
    """ckpttool's universal checkpoint of the BF16_Optimizer run (the files ds_to_universal writes,
    byte for byte) written as DeepSpeed files at DP=2 gives the fixture's trees again: that
    optimizer's files (no zero_stage or loss scaler, fp32 partitions with their padding), not
    ZeRO-1's; at DP=3 the same state. --zero-stage is refused by name (before: 'zero_stage None')."""
    from ckpttool.formats.deepspeed import ALLOWLIST as DS

    source = FIXTURES / "deepspeed" / "bf16_optimizer"
    universal = tmp_path / "uni"
    reshard(source, universal, Target(to="deepspeed-universal"))
    out = tmp_path / "dp2"
    result = reshard(universal, out, Target(to="deepspeed", dp=2))
    assert result.plan.layout == {"dp": 2, "zero_stage": 1}
    names = sorted(p.name for p in (source / "global_step3").glob("*.pt"))
    assert names == sorted(p.name for p in (out / "global_step3").glob("*.pt"))
    for name in names:
        assert _tree(source / "global_step3" / name, DS) == _tree(out / "global_step3" / name, DS), name
    assert registry.describe(out)[1].extras["variant"] == "BF16_Optimizer"
    reshard(universal, tmp_path / "dp3", Target(to="deepspeed", dp=3))
    assert not diff(source, tmp_path / "dp3").different and verify(tmp_path / "dp3").failing() == []
    with pytest.raises(UsageError, match="--zero-stage 2: .* the universal state of a BF16_Optimizer run"):
        reshard(universal, tmp_path / "a", Target(to="deepspeed", dp=2, zero_stage=2))
    with pytest.raises(UsageError, match="--zero-stage 3: the checkpoint is BF16_Optimizer's"):  # (it wrote
        reshard(universal, tmp_path / "a", Target(to="deepspeed", dp=2, zero_stage=3))  # ZeRO-3 files, no scaler)
    with pytest.raises(UsageError, match="--zero-stage 3: DeepSpeed's BF16_Optimizer saved this checkpoint"):
        reshard(source, tmp_path / "a", Target(to="deepspeed", dp=2, zero_stage=3))
    assert not (tmp_path / "a").exists()
    reshard(universal, tmp_path / "one", Target(to="deepspeed", dp=2, zero_stage=1))  # its stage, as from its files
    assert registry.describe(tmp_path / "one")[1].extras["variant"] == "BF16_Optimizer"


@pytest.mark.slow
def test_deepspeed_resumes_from_bf16_optimizer_files_made_from_a_universal(tmp_path):
    """Oracle: the BF16_Optimizer run's universal checkpoint (ckpttool's) written back as that
    optimizer's files at DP=1: DeepSpeed's load_checkpoint builds a BF16_Optimizer and takes them,
    the state equals the reference, the files are what its own save at DP=1 writes, and the next
    step's loss is bit-identical to the uninterrupted run's."""
    universal, out = tmp_path / "uni", tmp_path / "dp1"
    reshard(FIXTURES / "deepspeed" / "bf16_optimizer", universal, Target(to="deepspeed-universal"))
    reshard(universal, out, Target(to="deepspeed", dp=1))
    report = _ds_oracle("--variant", "bf16_optimizer", "--dp", "1", "--ckpt", str(out))
    assert "files: ckpttool's DP=1 checkpoint vs DeepSpeed's save_checkpoint at DP=1: 0 difference(s)" in report
    assert "step-4 loss: BIT-IDENTICAL" in report


def test_deepspeed_universal_of_zero2_to_zero3(tmp_path):
    """ds_to_universal's output of the ZeRO-2 run written as ZeRO-3 files at DP=2, sub-groups cut
    at 700 elements: the ZeRO-3 fixture's trees (the same run saved by DeepSpeed's ZeRO-3 engine),
    the saved config aside, each sub-group's step from its group's step.pt. At DP=1 it verifies
    clean and holds the run's state."""
    from ckpttool.formats.deepspeed import ALLOWLIST as DS

    universal = FIXTURES / "deepspeed" / "universal"
    zero3 = FIXTURES / "deepspeed" / "zero3" / "global_step3"
    out = tmp_path / "z3"
    result = reshard(universal, out, Target(to="deepspeed", dp=2, zero_stage=3, sub_group_size=700))
    assert result.plan.layout == {"dp": 2, "zero_stage": 3} and (out / "latest").read_text() == "global_step3"
    assert any("zero_optimization.sub_group_size 700" in n for n in result.plan.notes)
    names = sorted(p.name for p in zero3.glob("*.pt"))
    assert names == sorted(p.name for p in (out / "global_step3").glob("*.pt"))
    for name in names:
        ours = _tree(out / "global_step3" / name, DS)
        assert _blind_config(_tree(zero3 / name, DS)) == _blind_config(ours), name
    one = tmp_path / "dp1"
    reshard(universal, one, Target(to="deepspeed", dp=1, zero_stage=3))
    assert verify(one).failing() == []
    assert not diff(FIXTURES / "deepspeed" / "zero2", one, kinds=["optim", "master", "scheduler"]).different


def test_deepspeed_zero3_universal_back_to_zero_files(tmp_path):
    """ds_to_universal's output of the ZeRO-3 run written as ZeRO-3 files at DP=2 gives the ZeRO-3
    fixture's trees (model states from the copied ones, sub-groups cut as the saved config says,
    steps and param groups from optimizer_state.pt); at ZeRO-2 the ZeRO-2 fixture's (the same run)."""
    from ckpttool.formats.deepspeed import ALLOWLIST as DS

    universal3 = FIXTURES / "deepspeed" / "universal3"
    for stage, fixture in ((3, "zero3"), (2, "zero2")):
        out = tmp_path / fixture
        result = reshard(universal3, out, Target(to="deepspeed", dp=2, zero_stage=None if stage == 3 else 2))
        assert result.plan.layout == {"dp": 2, "zero_stage": stage} and (out / "latest").read_text() == "global_step3"
        ours = FIXTURES / "deepspeed" / fixture / "global_step3"
        names = sorted(p.name for p in ours.glob("*.pt"))
        assert names == sorted(p.name for p in (out / "global_step3").glob("*.pt"))
        for name in names:
            assert _tree(ours / name, DS) == _tree(out / "global_step3" / name, DS), name
        assert verify(out).failing() == []
    with pytest.raises(UsageError, match="keeps the sub-group size it had"):
        reshard(universal3, tmp_path / "a", Target(to="deepspeed", dp=1, zero_stage=3, sub_group_size=9))


@pytest.mark.slow
@pytest.mark.parametrize(("universal", "variant"), [("universal", "zero2"), ("universal3", "zero3")])
def test_deepspeed_resumes_from_a_universal_checkpoint_made_zero_files_again(universal, variant, tmp_path):
    """Oracle: ds_to_universal's output of the ZeRO-2 (ZeRO-3) run written as ZeRO-2 (ZeRO-3) files
    at DP=1; DeepSpeed's engine at DP=1 resumes: the state after the load equals the reference,
    frozen parameters and buffer included (which checkpoint.load_universal leaves at their initial
    values; for ZeRO-3 it also gives every param group the first one's hyper-parameters and shares
    one step among the sub-groups), and the next step is bit-identical to the uninterrupted DP=2
    run's."""
    out = tmp_path / "dp1"
    reshard(FIXTURES / "deepspeed" / universal, out, Target(to="deepspeed", dp=1))
    report = _ds_oracle("--variant", variant, "--dp", "1", "--ckpt", str(out), "--no-native")
    loaded = report.split("== state after load", 1)[1].split("==", 1)[0]
    assert "module: 18/18 tensors bit-identical" in loaded
    assert "step-4 loss: BIT-IDENTICAL" in report and "state after step 4 vs control: BIT-IDENTICAL" in report


def test_deepspeed_zero_stage_refusals(tmp_path):
    with pytest.raises(UsageError, match="keeps the sub-group size it was saved with"):
        reshard(FIXTURES / "deepspeed" / "zero3", tmp_path / "a", Target(zero_stage=3, sub_group_size=100))
    with pytest.raises(UsageError, match="--sub-group-size .* applies with --zero-stage 3"):
        reshard(FIXTURES / "deepspeed" / "zero2", tmp_path / "a", Target(zero_stage=2, sub_group_size=100))
    with pytest.raises(UsageError, match="--sub-group-size -1: a count of elements, 0 or more"):  # (not "applies with")
        reshard(FIXTURES / "deepspeed" / "zero2", tmp_path / "a", Target(zero_stage=3, sub_group_size=-1))
    with pytest.raises(UsageError, match="--zero-stage applies to --to deepspeed only"):
        reshard(FIXTURES / "deepspeed" / "zero2", tmp_path / "b", Target(to="dcp", zero_stage=2))
    with pytest.raises(UsageError, match="partitioned stages are 1, 2 and 3"):
        reshard(FIXTURES / "deepspeed" / "zero3", tmp_path / "c", Target(zero_stage=0))
    assert not any((tmp_path / n).exists() for n in "abc")


def test_deepspeed_zero3_bf16_to_zero2_module_is_the_run_s(tmp_path):
    """From a bf16 ZeRO-3 run, --zero-stage 2 writes the module whole in bf16: every parameter
    equals the bf16 module the live engine held (the fixture's reference, gathered by DeepSpeed),
    the trainable ones being their fp32 masters rounded as ZeRO rounds them."""
    import torch

    from ckpttool.assemble import assemble

    out = tmp_path / "z2"
    reshard(FIXTURES / "deepspeed" / "zero3_bf16", out, Target(dp=1, zero_stage=2))
    ref = torch.load(FIXTURES / "deepspeed" / "zero3_bf16.reference.pt", weights_only=True)
    adapter, m = registry.describe(out)
    reader = adapter.reader(m)
    try:
        names = [k[len("module.") :] for k in ref if k.startswith("module.")]
        assert len(names) == 18
        for name in names:
            item = m.items[name]
            want = ref[f"module.{name}"]
            assert item.dtype == str(want.dtype).removeprefix("torch."), name
            got = np.ascontiguousarray(assemble(reader, item))
            assert got.tobytes() == want.contiguous().view(-1).view(torch.uint8).numpy().tobytes(), name
    finally:
        reader.close()
    assert verify(out).failing() == []
    # diff finds the source's state in it: the frozen parameters, which ZeRO-3 keeps as bf16 fragments
    # (no fp32 copy: they are not trained), are the ZeRO-2 module's (was "only in B: frozen.weight …")
    r = run_cli("diff", FIXTURES / "deepspeed" / "zero3_bf16", out)
    assert r.code == 0 and "only in" not in r.stdout, r.stdout


def _pipe_oracle(
    ckpt: Path,
    dp: int,
    result: Path,
    variant: str = "pipeline",
    pp: int = 2,
    tp: int = 2,
    universal: bool = False,
    zero_stage: int | None = None,
) -> dict[tuple[int, ...], Any]:
    """fixtures/_ds_pipe_oracle_worker.py under torchrun at ``dp`` DP ranks (``pp`` x ``tp`` x ``dp``
    processes for the pipeline, ``tp`` x ``dp`` for tp2): each (stage, model rank, DP rank)'s state after
    DeepSpeed's engine (tp2's at ``zero_stage``) loaded ``ckpt`` (a universal checkpoint with
    ``universal``), and after one more step."""
    import torch

    env = {**os.environ, "DS_ACCELERATOR": "cpu", "DS_BUILD_OPS": "0", "OMP_NUM_THREADS": "1"}
    n = (pp * tp if variant.startswith("pipeline") else tp) * dp
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
         str(FIXTURES / "_ds_pipe_oracle_worker.py"), "--ckpt", str(ckpt), "--dp", str(dp), "--result", str(result),
         "--variant", variant, "--pp", str(pp), "--tp", str(tp), *(["--universal"] if universal else []),
         *(["--zero-stage", str(zero_stage)] if zero_stage is not None else [])],
        capture_output=True, text=True, timeout=600, env=env, cwd=FIXTURES,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    ranks = torch.load(result, weights_only=False)["ranks"]
    assert len(ranks) == n and all(r["failed"] is None for r in ranks)
    return {tuple(r["coord"]): r for r in ranks}


@pytest.fixture(scope="session")
def pipe_control(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``pipe_control(variant)``: :func:`_pipe_oracle` on the fixture ``variant`` itself at its own
    layout (DP=2), the uninterrupted run; run once per session for every oracle comparing with it."""

    @functools.cache
    def run(variant: str) -> dict[tuple[int, ...], Any]:
        tp = 1 if variant in ("pipeline_tied", "pipeline_bf16") else 2
        result = tmp_path_factory.mktemp("control") / f"{variant}.pt"
        return _pipe_oracle(FIXTURES / "deepspeed" / variant, 2, result, variant, tp=tp)

    return run


@pytest.mark.slow
def test_deepspeed_pipeline_engine_resumes_at_dp1(tmp_path, pipe_control):
    """Oracle: DeepSpeed's PipelineEngine (PP=2 x model axis 2) at DP=1 loads the DP=2 pipeline
    fixture resharded to --dp 1: on every stage and model rank the fp32 masters, both moments
    and the module equal the fixture's reference and what the same engine at DP=2 loads from the
    fixture itself (the uninterrupted run), bit for bit; the step-4 loss is bit-identical. After
    the step the two differ by float reassociation only: DP=1 accumulates 4 micro-batches in turn
    where DP=2 adds two ranks' sums of 2."""
    pytest.importorskip("deepspeed", reason="needs deepspeed (an oracle, not a dependency)")
    import torch

    out = tmp_path / "dp1"
    reshard(FIXTURES / "deepspeed" / "pipeline", out, Target(dp=1))
    ours = {k[:2]: r for k, r in _pipe_oracle(out, 1, tmp_path / "dp1.pt").items()}
    control = {k[:2]: r for k, r in pipe_control("pipeline").items() if k[2] == 0}
    ref = torch.load(FIXTURES / "deepspeed" / "pipeline.reference.pt", weights_only=False)
    assert sorted(ours) == sorted(control) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    checked = 0
    for key, mine in ours.items():
        theirs = control[key]
        assert mine["counters"] == theirs["counters"] == (3, 24)
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            assert sorted(mine["loaded"][state]) == sorted(theirs["loaded"][state])
            for name, value in mine["loaded"][state].items():
                assert torch.equal(value, theirs["loaded"][state][name]), (key, state, name)
                assert torch.equal(value, ref[f"{state}.{name}"]), (key, state, name)
                checked += 1
            for name, value in mine["after"][state].items():
                assert torch.allclose(value, theirs["after"][state][name], rtol=1e-6, atol=1e-7), (key, state, name)
        assert mine["module"].keys() == theirs["module"].keys()
        assert all(torch.equal(v, theirs["module"][k]) for k, v in mine["module"].items()), key
        assert mine["loss"] == theirs["loss"], key
    assert checked == 3 * 2 * 23  # every parameter of both stages, on both model ranks


@pytest.mark.slow
def test_deepspeed_bf16_pipeline_engine_resumes_at_dp1(tmp_path, pipe_control):
    """Oracle: a bf16 pipeline run (PP=2 x DP=2, ZeRO-1 with fp32 gradient accumulation: DeepSpeed
    trains it with BF16_Optimizer, as Megatron-DeepSpeed's BLOOM-style runs) resharded to --dp 1:
    DeepSpeed's PipelineEngine at DP=1 loads it with every fp32 master and moment equal to the
    reference and to the DP=2 engine's load of the fixture, bit for bit, and the step-4 loss is
    bit-identical. DeepSpeed's own route to DP=1 (ds_to_universal, load_universal) trains that step
    to the same bits as ours; against the DP=2 run, bf16 gradients summed in another order differ."""
    pytest.importorskip("deepspeed", reason="needs deepspeed (an oracle, not a dependency)")
    import torch

    src = FIXTURES / "deepspeed" / "pipeline_bf16"
    out = tmp_path / "dp1"
    reshard(src, out, Target(dp=1))
    ours = {k[:2]: r for k, r in _pipe_oracle(out, 1, tmp_path / "dp1.pt", "pipeline_bf16", tp=1).items()}
    universal = _ds_to_universal(src, tmp_path / "uni" / "global_step3_universal").parent
    (universal / "latest_universal").write_text("global_step3_universal")
    native = _pipe_oracle(universal, 1, tmp_path / "native.pt", "pipeline_bf16", tp=1, universal=True)
    native = {k[:2]: r for k, r in native.items()}
    control = {k[:2]: r for k, r in pipe_control("pipeline_bf16").items() if k[2] == 0}
    ref = torch.load(src.with_name("pipeline_bf16.reference.pt"), weights_only=False)
    assert sorted(ours) == sorted(control) == sorted(native) == [(0, 0), (1, 0)]
    checked = 0
    for key, mine in ours.items():
        assert mine["counters"] == control[key]["counters"] == (3, 24)
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            assert sorted(mine["loaded"][state]) == sorted(control[key]["loaded"][state])
            for name, value in mine["loaded"][state].items():
                assert torch.equal(value, control[key]["loaded"][state][name]), (key, state, name)
                assert torch.equal(value, ref[f"{state}.{name}"]), (key, state, name)
                checked += 1
            for name, value in mine["after"][state].items():
                assert torch.equal(value, native[key]["after"][state][name]), (key, state, name)
        assert all(torch.equal(v, control[key]["module"][k]) for k, v in mine["module"].items()), key
        assert mine["loss"] == control[key]["loss"] == native[key]["loss"], key
    assert checked == 3 * 23  # every parameter of both stages


def _tp_slice(whole: Any, part: Any, t: int) -> Any:
    """TP rank ``t``'s slice of ``whole`` if ``part`` is one (the dim where their shapes differ), or
    ``whole`` itself (a replica)."""
    dims = [d for d, (a, b) in enumerate(zip(whole.shape, part.shape, strict=True)) if a != b]
    return whole if not dims else whole.chunk(whole.shape[dims[0]] // part.shape[dims[0]], dims[0])[t]


@pytest.mark.slow
@pytest.mark.parametrize(("variant", "stage", "params"), [("tp2", None, 14), ("tp2", 1, 14), ("autotp", None, 24)])
def test_deepspeed_tensor_parallel_engine_resumes_at_dp1(variant, stage, params, tmp_path, pipe_control):
    """Oracle: a TP=2 x DP=2 fixture resharded to --dp 1 (tp2: a Megatron-style model, ZeRO-2, also
    to --zero-stage 1; autotp: DeepSpeed's AutoTP, ZeRO-1, a fused GQA qkv, a fused gate_up and an
    lm_head split 16 + 15) is loaded by DeepSpeed's engine at TP=2 x DP=1: on both TP ranks the fp32
    masters, both moments and the module equal what the same engine at DP=2 loads from the fixture
    itself, bit for bit (tp2's also the fixture's reference, its TP slices); the step-4 losses of
    both micro-batches equal those of the DP=2 run's two ranks, bit for bit; the state after the
    step agrees to float reassociation."""
    pytest.importorskip("deepspeed", reason="needs deepspeed (an oracle, not a dependency)")
    import torch

    out = tmp_path / "dp1"
    reshard(FIXTURES / "deepspeed" / variant, out, Target(dp=1, zero_stage=stage))
    ours = _pipe_oracle(out, 1, tmp_path / "dp1.pt", variant, zero_stage=stage)
    control = pipe_control(variant)
    ref = torch.load(FIXTURES / "deepspeed" / f"{variant}.reference.pt", weights_only=False)
    assert sorted(ours) == [(0, 0, 0), (0, 1, 0)] and len(control) == 4
    checked = 0
    for (_, t, _), mine in ours.items():
        theirs = control[(0, t, 0)]
        assert mine["counters"] == theirs["counters"]
        if variant == "tp2":
            assert mine["counters"] == (3, 24)
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            assert sorted(mine["loaded"][state]) == sorted(theirs["loaded"][state])
            for name, value in mine["loaded"][state].items():
                assert torch.equal(value, theirs["loaded"][state][name]), (t, state, name)
                if variant == "tp2":  # autotp's slices are cut by its maps: the control above checks them
                    assert torch.equal(value, _tp_slice(ref[f"{state}.{name}"], value, t)), (t, state, name)
                checked += 1
            for name, value in mine["after"][state].items():
                assert torch.allclose(value, theirs["after"][state][name], rtol=1e-6, atol=1e-7), (t, state, name)
        assert all(torch.equal(v, theirs["module"][k]) for k, v in mine["module"].items()), t
        assert mine["loss"] == [control[(0, t, d)]["loss"][0] for d in (0, 1)], t
    assert checked == 2 * 3 * params


@pytest.mark.slow
@pytest.mark.parametrize("source", ["zero2", "universal"])
def test_deepspeed_zero3_engine_resumes_the_zero2_run(source, tmp_path):
    """Oracle: DeepSpeed's ZeRO-3 engine at DP=1 (sub_group_size 700) resumes from --zero-stage 3
    --sub-group-size 700 of the DP=2 ZeRO-2 fixture (the oracle reshards it), or of ds_to_universal's
    output of it: the state after the load equals the reference (frozen parameters and buffer
    included), and the next step's loss and the whole state after it are bit-identical to the
    uninterrupted ZeRO-2 run's."""
    given: tuple[str, ...] = ()
    if source == "universal":
        out = tmp_path / "z3"
        reshard(FIXTURES / "deepspeed" / source, out, Target(to="deepspeed", dp=1, zero_stage=3, sub_group_size=700))
        given = ("--ckpt", str(out))
    report = _ds_oracle("--variant", "zero2", "--dp", "1", "--into", "zero3", *given)
    assert "DeepSpeedZeroOptimizer_Stage3" in report
    if source == "zero2":
        assert "--zero-stage 3 --sub-group-size 700" in report
    loaded = report.split("== state after load", 1)[1].split("==", 1)[0]
    for state in ("fp32", "exp_avg", "exp_avg_sq"):
        assert f"{state}: 14/14 params bit-identical to the reference" in loaded, loaded
    assert "module: 18/18 tensors bit-identical" in loaded
    assert "step-4 loss: BIT-IDENTICAL" in report
    assert "state after step 4 vs control: BIT-IDENTICAL" in report
    assert "zero_to_fp32: 18 tensors, 18 bit-identical to the reference" in report


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["zero3", "zero3_bf16"])
def test_deepspeed_zero2_engine_resumes_the_zero3_run(variant):
    """Oracle: DeepSpeed's ZeRO-2 engine at DP=1 resumes from --zero-stage 2 of the DP=2 ZeRO-3
    fixture: the state after the load (fp32 masters, moments, the module, in bf16 too) equals the
    reference. In fp32 the next step's loss and the whole state after it are bit-identical to the
    uninterrupted ZeRO-3 run's. In bf16 they are not, and the state is not why: ZeRO-3 replaces
    ``F.linear`` with its own function (matmul, then the bias added: two bf16 roundings), and the
    ZeRO-2 engine gives the same step at DP=1 as at DP=2."""
    into = "zero2" if variant == "zero3" else "zero2_bf16_tied"
    report = _ds_oracle("--variant", variant, "--dp", "1", "--into", into)
    loaded = report.split("== state after load", 1)[1].split("==", 1)[0]
    for state in ("fp32", "exp_avg", "exp_avg_sq"):
        assert f"{state}: 14/14 params bit-identical to the reference" in loaded, loaded
    assert "DeepSpeedZeroOptimizer" in report and "module: 18/18 tensors bit-identical" in loaded
    assert "zero_to_fp32: 18 tensors, 18 bit-identical to the reference" in report
    if variant == "zero3":
        assert "step-4 loss: BIT-IDENTICAL" in report
        assert "state after step 4 vs control: BIT-IDENTICAL" in report


def test_deepspeed_universal_of_a_tensor_parallel_run(tmp_path):
    """--to deepspeed-universal of the tp2 fixture (TP=2 x DP=2, with the model's
    universal_checkpoint_info): one folder per parameter with the whole tensor, as ds_to_universal
    merges it: column-parallel slices joined on dim 0 (``cat_dim`` 0), row-parallel fc2 on dim 1,
    replicated norms and fc2's bias once with no ``cat_dim``, vocabulary parameters cut to 31 rows
    with ``vocab_tensor``; both TP ranks' model states copied as they are. Without the patterns
    the run is refused before anything is written."""
    import torch

    out = tmp_path / "uni"
    reshard(FIXTURES / "deepspeed" / "tp2", out, Target(to="deepspeed-universal"))
    root = out / "global_step3_universal"
    ref = torch.load(FIXTURES / "deepspeed" / "tp2.reference.pt", weights_only=True)
    for state in ("fp32", "exp_avg", "exp_avg_sq"):  # every state's file has its parameter's header
        heads = {}
        for name in [k[len("fp32.") :] for k in ref if k.startswith("fp32.")]:
            got = torch.load(root / "zero" / name / f"{state}.pt", weights_only=True)
            want = ref[f"{state}.{name}"]
            want = want[:31] if name.split(".")[0] in ("emb", "head") else want
            assert torch.equal(got.pop("param"), want), (state, name)
            heads[name] = got
        assert heads["blocks.0.fc1.weight"] == heads["blocks.1.fc1.bias"] == {"cat_dim": 0}, state
        assert heads["blocks.0.fc2.weight"] == {"cat_dim": 1}, state
        assert heads["blocks.0.norm.weight"] == heads["blocks.1.fc2.bias"] == {}, state
        assert heads["emb.weight"] == heads["head.weight"] == {"cat_dim": 0, "vocab_tensor": True}, state
    for t in (0, 1):
        rel = f"mp_rank_0{t}_model_states.pt"
        assert (root / rel).read_bytes() == (FIXTURES / "deepspeed" / "tp2" / "global_step3" / rel).read_bytes()
    report = verify(out)
    assert report.failing() == [] and report.seal is not None
    _, m = registry.describe(out)
    assert m.items["emb.weight"].shape == (32, 16) and m.items["emb.weight.fp32"].shape == (31, 16)

    from ckpttool.formats.deepspeed import ALLOWLIST as DS

    files = "global_step3/mp_rank_*_model_states.pt"
    unset = lambda tree: tree.pop("universal_checkpoint_info")  # noqa: E731
    src = rewritten_copy(tmp_path / "bare", FIXTURES / "deepspeed" / "tp2", unset, files, DS)
    with pytest.raises(UsageError, match="a TP=2 run saved without universal_checkpoint_info"):
        reshard(src, tmp_path / "x", Target(to="deepspeed-universal"))
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("variant", "count"),
    [("tp2", 59), ("tp2_glu", 63), ("autotp", 99), ("pipeline", 97), ("pipeline_tied", 87), ("pipeline_bf16", 95)],
)
def test_deepspeed_universal_of_a_model_parallel_run_is_ds_to_universals(variant, count, tmp_path):
    """Oracle: DeepSpeed's ds_to_universal and ckpttool's --to deepspeed-universal give the same
    files, byte for byte:
    - of a TP run (tp2; tp2_glu, a fused SwiGLU fc1 and an averaged position embedding) all but the
      six of the two vocabulary parameters, which hold the same tensors (ds_to_universal pickles
      its 31-row slice with the 32-row storage under it);
    - of an AutoTP run (autotp: a fused GQA qkv, a fused gate_up, an lm_head split 16 + 15, placed
      by affine maps) all of them;
    - of a pipeline run all of them (pipeline_tied: its embedding, tied across the stages, once, as
      ds_to_universal keeps one of what its pipeline_replicated_parameter_patterns name)."""
    pytest.importorskip("deepspeed", reason="needs deepspeed (an oracle, not a dependency)")
    from ckpttool.formats.deepspeed import ALLOWLIST as DS

    theirs = _ds_to_universal(FIXTURES / "deepspeed" / variant, tmp_path / "theirs")
    out = tmp_path / "ours"
    reshard(FIXTURES / "deepspeed" / variant, out, Target(to="deepspeed-universal"))
    ours = out / "global_step3_universal"
    names, differ = _differing_files(ours, theirs)
    assert len(names) == count
    vocab = [f"zero/{p}.weight/{s}.pt" for p in ("emb", "head") for s in ("exp_avg", "exp_avg_sq", "fp32")]
    assert differ == (sorted(vocab) if variant.startswith("tp2") else [])
    for n in differ:
        assert _tree(ours / n, DS) == _tree(theirs / n, DS), n


def test_deepspeed_universal_of_sub_parameters_and_averaged_copies(tmp_path):
    """--to deepspeed-universal of tp2_glu: each fused SwiGLU fc1 (TP rank t holding
    ``[gate_t; up_t]``) is written whole, gates first, with ``cat_dim`` 0 and
    ``param_n_sub_params`` 2, so that DeepSpeed cuts it per sub-parameter at any TP; the position
    embedding the patterns average is the mean of the two TP ranks' copies (their masters differ),
    with no ``cat_dim``, as ds_to_universal takes it: summed from 0, then divided."""
    import torch

    out = tmp_path / "uni"
    done = reshard(FIXTURES / "deepspeed" / "tp2_glu", out, Target(to="deepspeed-universal"))
    # (said: the output holds the mean, neither rank's own values; it said nothing)
    assert any("copies of pos.weight are written as their mean" in n for n in done.plan.notes), done.plan.notes
    root = out / "global_step3_universal" / "zero"
    ref = torch.load(FIXTURES / "deepspeed" / "tp2_glu.reference.pt", weights_only=True)
    for state in ("fp32", "exp_avg", "exp_avg_sq"):
        for name in ("blocks.0.fc1.weight", "blocks.1.fc1.bias"):
            got = torch.load(root / name / f"{state}.pt", weights_only=True)
            assert torch.equal(got.pop("param"), ref[f"{state}.{name}"]), (state, name)
            assert got == {"cat_dim": 0, "param_n_sub_params": 2}
        copies = [ref[f"{state}.pos.weight[tp={t}]"] for t in (0, 1)]
        assert torch.equal(*copies) is (state != "fp32")  # equal gradients, different values
        got = torch.load(root / "pos.weight" / f"{state}.pt", weights_only=True)
        assert list(got) == ["param"] and torch.equal(got["param"], sum(copies) / 2), state
    report = verify(out)
    assert report.failing() == [] and report.seal is not None


@pytest.mark.parametrize(
    ("variant", "dp", "name"),
    [("tp2_glu", 3, "blocks.0.fc1.weight.fp32"), ("autotp", 5, "layers.0.self_attn.qkv_proj.weight.fp32")],
)
def test_deepspeed_sub_parameters_round_trip_through_an_odd_dp(variant, dp, name, tmp_path):
    """tp2_glu DP=2 -> DP=3 -> DP=2 and autotp DP=2 -> DP=5 -> DP=2 give the original files' trees.
    At the odd DP a partition boundary falls inside a sub-parameter (of tp2_glu's fused fc1, of
    autotp's fused qkv), and a partition's fragment runs from one sub-parameter into the next: the
    reader cuts it in regions, and each rank's partitions are made again from its regions in its
    own order."""
    from ckpttool.formats.deepspeed import ALLOWLIST as DS

    src = FIXTURES / "deepspeed" / variant
    three, back = tmp_path / f"dp{dp}", tmp_path / "dp2"
    reshard(src, three, Target(dp=dp))
    reshard(three, back, Target(dp=2))
    item = registry.describe(three)[1].items[name]
    # a partition boundary inside a sub-parameter: one region's pieces in two files
    assert any(len({p.file for p in item.pieces if p.box == q.box}) > 1 for q in item.pieces)
    # a fragment running from one sub-parameter into the other: two pieces of one file, in two
    # regions, one starting in the file where the other ends
    starts = {(p.file, p.locator["storage"], p.locator["storage_offset"]): p for p in item.pieces}
    assert any(
        (n := starts.get((p.file, p.locator["storage"], p.locator["storage_offset"] + (p.flat or (0, 0))[1])))
        and n.box != p.box
        for p in item.pieces
    )
    for path in sorted((src / "global_step3").iterdir()):
        assert _tree(path, DS) == _tree(back / "global_step3" / path.name, DS), path.name
    assert not diff(src, three).different


def test_deepspeed_universal_of_a_pipeline_run(tmp_path):
    """--to deepspeed-universal of the pipeline fixture (PP=2 x model axis 2 x DP=2, ZeRO-1, its
    model axis declared replicated): one folder per parameter of both stages with the whole tensor
    once (no ``cat_dim``) and its step, the four model-parallel ranks' model states copied as they
    are; the layer files, whose weights the universal load takes from the fp32 masters, are not
    written (as ds_to_universal writes none)."""
    import torch

    out = tmp_path / "uni"
    src = FIXTURES / "deepspeed" / "pipeline"
    reshard(src, out, Target(to="deepspeed-universal"))
    root = out / "global_step3_universal"
    ref = torch.load(FIXTURES / "deepspeed" / "pipeline.reference.pt", weights_only=True)
    names = sorted(k[len("fp32.") :] for k in ref if k.startswith("fp32."))
    assert len(names) == 23 and sorted(p.name for p in (root / "zero").iterdir() if p.is_dir()) == names
    for name in names:
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            got = torch.load(root / "zero" / name / f"{state}.pt", weights_only=True)
            assert got.keys() == {"param"} and torch.equal(got["param"], ref[f"{state}.{name}"]), (state, name)
        assert torch.load(root / "zero" / name / "step.pt", weights_only=True).item() == 3
    models = sorted(p.name for p in root.iterdir() if p.is_file())
    assert models == [f"mp_rank_0{r}_model_states.pt" for r in range(4)]
    assert all((root / m).read_bytes() == (src / "global_step3" / m).read_bytes() for m in models)
    report = verify(out)
    assert report.failing() == [] and report.seal is not None


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["pipeline", "pipeline_tied"])
def test_deepspeed_pipeline_engine_loads_our_universal_at_pp1(variant, tmp_path, pipe_control):
    """Oracle: ckpttool's universal checkpoint of a pipeline fixture (PP=2 x model axis 2 x DP=2;
    pipeline_tied: PP=2 x DP=2, the embedding tied across the stages) is loaded by DeepSpeed's
    PipelineEngine at PP=1 x TP=1 x DP=1 with ``checkpoint.load_universal``: one process holds all
    the layers; its fp32 masters, both moments and module equal the fixture's reference bit for
    bit; its step-4 loss equals the uninterrupted PP=2 run's (bit for bit for pipeline; within
    1e-7 for pipeline_tied, whose engines average the four micro-batch losses in another order);
    the state after the step agrees to float reassociation."""
    pytest.importorskip("deepspeed", reason="needs deepspeed (an oracle, not a dependency)")
    import torch

    out = tmp_path / "uni"
    reshard(FIXTURES / "deepspeed" / variant, out, Target(to="deepspeed-universal"))
    (mine,) = _pipe_oracle(out, 1, tmp_path / "pp1.pt", variant, pp=1, tp=1, universal=True).values()
    control = pipe_control(variant)
    ref = torch.load(FIXTURES / "deepspeed" / f"{variant}.reference.pt", weights_only=False)
    assert mine["coord"] == (0, 0, 0) and mine["counters"] == (3, 24)
    states = ("fp32", "exp_avg", "exp_avg_sq")
    after = {(s, k): v for r in control.values() for s in states for k, v in r["after"][s].items()}
    for state in states:
        assert sorted(mine["loaded"][state]) == sorted(k[len(state) + 1 :] for k in ref if k.startswith(f"{state}."))
        for name, value in mine["loaded"][state].items():
            assert torch.equal(value, ref[f"{state}.{name}"]), (state, name)
            assert torch.allclose(mine["after"][state][name], after[(state, name)], rtol=1e-6, atol=1e-7), (state, name)
    assert mine["module"].keys() == {k[len("module.") :] for k in ref if k.startswith("module.")}
    assert all(torch.equal(v, ref[f"module.{k}"]) for k, v in mine["module"].items())
    (loss,) = {r["loss"] for r in control.values()}
    assert mine["loss"] == loss if variant == "pipeline" else mine["loss"] == pytest.approx(loss, rel=1e-7)


@pytest.mark.slow
def test_deepspeed_tied_pipeline_engine_resumes_at_dp4(tmp_path, pipe_control):
    """Oracle: the pipeline_tied fixture (PP=2 x DP=2, the embedding tied across the stages)
    resharded to --dp 4, where stage 1 cuts the tied weight's partitions at other boundaries than
    stage 0, is loaded by DeepSpeed's PipelineEngine at PP=2 x DP=4: on all eight ranks the fp32
    masters, both moments (the tied weight's in both stages) and the module equal the reference
    bit for bit; the step-4 loss equals the uninterrupted DP=2 run's bit for bit."""
    pytest.importorskip("deepspeed", reason="needs deepspeed (an oracle, not a dependency)")
    import torch

    out = tmp_path / "dp4"
    reshard(FIXTURES / "deepspeed" / "pipeline_tied", out, Target(dp=4))
    ours = _pipe_oracle(out, 4, tmp_path / "dp4.pt", "pipeline_tied", tp=1)
    ref = torch.load(FIXTURES / "deepspeed" / "pipeline_tied.reference.pt", weights_only=False)
    assert sorted(ours) == [(s, 0, d) for s in (0, 1) for d in range(4)]
    checked = 0
    for key, mine in ours.items():
        assert mine["counters"] == (3, 24)
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            for name, value in mine["loaded"][state].items():
                assert torch.equal(value, ref[f"{state}.{name}"]), (key, state, name)
                checked += 1
        assert all(torch.equal(v, ref[f"module.{k}"]) for k, v in mine["module"].items()), key
    assert checked == 4 * 3 * (13 + 9)  # per DP rank: stage 0's 12 and stage 1's 8 parameters, each with the tied one
    (loss,) = {r["loss"] for r in pipe_control("pipeline_tied").values()}
    assert {r["loss"] for r in ours.values()} == {loss}


@pytest.mark.slow
def test_deepspeed_tensor_parallel_engine_loads_our_universal_at_tp1(tmp_path, pipe_control):
    """Oracle: ckpttool's universal checkpoint of the tp2 fixture (a Megatron-style TP=2 x DP=2
    run) is loaded by DeepSpeed's engine with ``checkpoint.load_universal`` at TP=1 x DP=1, one
    process holding the whole model (vocabulary padded to 32 rows again): its fp32 masters, both
    moments and module equal the fixture's reference bit for bit; the step-4 losses of both
    micro-batches equal the uninterrupted run's two DP ranks', bit for bit; the state after the
    step agrees to float reassociation."""
    pytest.importorskip("deepspeed", reason="needs deepspeed (an oracle, not a dependency)")
    import torch

    out = tmp_path / "uni"
    reshard(FIXTURES / "deepspeed" / "tp2", out, Target(to="deepspeed-universal"))
    (mine,) = _pipe_oracle(out, 1, tmp_path / "tp1.pt", "tp2", tp=1, universal=True).values()
    control = pipe_control("tp2")
    ref = torch.load(FIXTURES / "deepspeed" / "tp2.reference.pt", weights_only=False)
    assert mine["coord"] == (0, 0, 0) and mine["counters"] == (3, 24)
    checked = 0
    for state in ("fp32", "exp_avg", "exp_avg_sq"):
        assert sorted(mine["loaded"][state]) == sorted(k[len(state) + 1 :] for k in ref if k.startswith(f"{state}."))
        for name, value in mine["loaded"][state].items():
            assert torch.equal(value, ref[f"{state}.{name}"]), (state, name)
            for t in (0, 1):  # each TP rank's slice of the step's result
                theirs = control[(0, t, 0)]["after"][state][name]
                got = _tp_slice(mine["after"][state][name], theirs, t)
                assert torch.allclose(got, theirs, rtol=1e-6, atol=1e-7), (state, name, t)
            checked += 1
    assert checked == 3 * 14
    assert len(mine["module"]) == 14
    assert all(torch.equal(v, ref[f"module.{k}"]) for k, v in mine["module"].items())
    assert mine["loss"] == [control[(0, 0, d)]["loss"][0] for d in (0, 1)]


@pytest.mark.slow
def test_deepspeed_engine_loads_our_universal_of_sub_parameters_at_tp1(tmp_path, pipe_control):
    """Oracle: DeepSpeed's engine at TP=1 x DP=1 loads ckpttool's universal checkpoint of tp2_glu
    (TP=2 x DP=2, fused SwiGLU fc1, an averaged position embedding): the fused fc1's masters and
    moments are the whole tensors, gates first (DeepSpeed cuts them per sub-parameter), the
    position embedding the mean of the TP copies, all bit for bit; the step-4 losses equal the
    uninterrupted TP=2 run's to float reassociation (TP=2 adds each rank's half of the position
    embedding to its partial sum, TP=1 the mean once)."""
    pytest.importorskip("deepspeed", reason="needs deepspeed (an oracle, not a dependency)")
    import torch

    out = tmp_path / "uni"
    reshard(FIXTURES / "deepspeed" / "tp2_glu", out, Target(to="deepspeed-universal"))
    (mine,) = _pipe_oracle(out, 1, tmp_path / "tp1.pt", "tp2_glu", tp=1, universal=True).values()
    ref = torch.load(FIXTURES / "deepspeed" / "tp2_glu.reference.pt", weights_only=False)
    assert mine["counters"] == (3, 24)
    for state in ("fp32", "exp_avg", "exp_avg_sq"):
        assert len(mine["loaded"][state]) == 15
        for name, value in mine["loaded"][state].items():
            copies = [ref[f"{state}.{name}[tp={t}]"] for t in (0, 1)] if name == "pos.weight" else []
            assert torch.equal(value, sum(copies) / 2 if copies else ref[f"{state}.{name}"]), (state, name)
    control = pipe_control("tp2_glu")
    want = [control[(0, 0, d)]["loss"][0] for d in (0, 1)]
    assert mine["loss"] == pytest.approx(want, rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("metadata", [m for m in AUTOTP_METADATA if AUTOTP_METADATA[m] is not None])
def test_deepspeed_universal_of_autotp_split_rules_is_ds_to_universals(metadata, tmp_path):
    """Oracle: the autotp fixture with its split rules as DeepSpeed wrote them before affine maps
    (``parameter_with_sub_params`` with the widths of universal version 0.4; version 0.3, without
    widths, gate_up's sub-parameters a count): ds_to_universal takes its sub-parameter branch, and
    ckpttool's --to deepspeed-universal writes the same 99 files, byte for byte, the
    ``SubparamShape`` it pickles with each fused parameter included (version 0.3: gate_up's count
    made the sizes, ``((32, 32), -1)``); without a map the lm_head's uneven slices are joined where
    each ends, as torch.cat joins them."""
    pytest.importorskip("deepspeed", reason="needs deepspeed (an oracle, not a dependency)")
    from ckpttool.formats.deepspeed import ALLOWLIST as DS

    src = autotp_copy(tmp_path, metadata)
    theirs = _ds_to_universal(src, tmp_path / "theirs")
    out = tmp_path / "ours"
    reshard(src, out, Target(to="deepspeed-universal"))
    ours = out / "global_step3_universal"
    names, differ = _differing_files(ours, theirs)
    assert len(names) == 99 and differ == []
    archive, tree, _ = _pt.load(ours, "zero/layers.1.mlp.gate_up_proj.weight/exp_avg.pt", DS)
    archive.close()
    shape = tree["sub_param_shape"]
    assert type(shape).__name__ == "SubparamShape" and shape.partition_dim == 0
    assert shape.shape == ([(32, 32), -1] if metadata == "sub-parameters" else ((32, 32), -1))
    assert verify(out).failing() == []


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_deepspeed_autotp_engine_loads_our_universal(tp, tmp_path, pipe_control):
    """Oracle: ckpttool's universal checkpoint of the autotp fixture is loaded by DeepSpeed's engine
    with ``checkpoint.load_universal`` at DP=1: at TP=2 by AutoTP (which cuts each rank's slices by
    its affine maps), every loaded master, moment and module tensor equals what the uninterrupted
    run's engine loads from the fixture, bit for bit, and so do the step-4 losses; at TP=1 (the
    plain model, one process) every loaded tensor equals the reference's whole tensor, bit for bit,
    and the losses agree to float reassociation (TP=2 sums the row-parallel halves)."""
    pytest.importorskip("deepspeed", reason="needs deepspeed (an oracle, not a dependency)")
    import torch

    out = tmp_path / "uni"
    reshard(FIXTURES / "deepspeed" / "autotp", out, Target(to="deepspeed-universal"))
    ours = _pipe_oracle(out, 1, tmp_path / "u.pt", "autotp", tp=tp, universal=True)
    control = pipe_control("autotp")
    ref = torch.load(FIXTURES / "deepspeed" / "autotp.reference.pt", weights_only=False)
    assert sorted(ours) == [(0, t, 0) for t in range(tp)]
    checked = 0
    for (_, t, _), mine in ours.items():
        theirs = control[(0, t, 0)]
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            assert len(mine["loaded"][state]) == 24
            for name, value in mine["loaded"][state].items():
                want = theirs["loaded"][state][name] if tp == 2 else ref[f"{state}.{name}"]
                assert torch.equal(value, want), (t, state, name)
                checked += 1
        want_module = theirs["module"] if tp == 2 else {k: ref[f"module.{k}"] for k in mine["module"]}
        assert all(torch.equal(v, want_module[k]) for k, v in mine["module"].items()), t
        losses = [control[(0, t, d)]["loss"][0] for d in (0, 1)]
        assert mine["loss"] == losses if tp == 2 else mine["loss"] == pytest.approx(losses, rel=1e-6)
    assert checked == tp * 3 * 24


def test_deepspeed_universal_refusals(tmp_path):
    with pytest.raises(UsageError, match="no parallel layout"):
        reshard(FIXTURES / "deepspeed" / "zero2", tmp_path / "a", Target(to="deepspeed-universal", dp=2))
    with pytest.raises(UsageError, match="converts DeepSpeed checkpoints"):
        reshard(FIXTURES / "dcp" / "fsdp2", tmp_path / "b", Target(to="deepspeed-universal"))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    # ZeRO files from the universal checkpoint of a TP run: its zero/ folders hold whole tensors,
    # its model states each TP rank's slices (once written, verify found coverage gaps in them)
    universal = tmp_path / "uni"
    reshard(FIXTURES / "deepspeed" / "tp2", universal, Target(to="deepspeed-universal"))
    for stage in (None, 3):
        with pytest.raises(UsageError, match=r"universal checkpoint of a model-parallel run \(TP=2\)"):
            reshard(universal, tmp_path / "c", Target(to="deepspeed", dp=1, zero_stage=stage))
        assert not (tmp_path / "c").exists()
    # one refusal whatever the flags: --tp 2 was refused as changing "the source's TP=1" (the
    # universal checkpoint recorded no layout), with a hint to write the universal checkpoint it
    # was, and no --dp as lacking one
    assert registry.describe(universal)[1].layout.tp == 2
    for flags in ([], ["--tp", "2"], ["--tp", "1", "--dp", "2"], ["--tp", "2", "--dp", "1"]):
        r = run_cli("reshard", universal, "-o", tmp_path / "c", "--to", "deepspeed", *flags)
        assert_clean(r, 2, "universal checkpoint of a model-parallel run (TP=2)", "at any --tp, --pp or --dp")
        assert "load_universal" in r.stderr and "TP=1" not in r.stderr and "needs the data-parallel" not in r.stderr
        assert not (tmp_path / "c").exists()
    # two ranks' model states whose checkpoint_parallel_dimensions say TP=1: refused as well (only
    # rank 0's were copied)
    from ckpttool.formats.deepspeed import ALLOWLIST as DS_ALLOW

    def tp1(tree: Any) -> None:
        tree["checkpoint_parallel_dimensions"]["tp_degree"] = 1

    said_one = rewritten_copy(tmp_path / "said1", universal, tp1, "global_step3_universal/mp_rank_*_model_states.pt", DS_ALLOW)
    with pytest.raises(UsageError, match=r"model-parallel run \(model-parallel ranks=2\)"):
        reshard(said_one, tmp_path / "c", Target(to="deepspeed", dp=1))
    r = run_cli("reshard", FIXTURES / "deepspeed" / "universal", "-o", tmp_path / "c", "--to", "deepspeed", "--tp", "2")
    assert_clean(r, 2, "--tp 2 would change the source's TP=1", "load_universal loads this universal checkpoint")
    assert "--to deepspeed-universal" not in r.stderr
    # a pattern that leaves a trained parameter one copy per TP rank (a row-parallel pattern naming
    # a 1-D bias) is refused, as ds_to_universal fails on it; only averaged parameters are averaged
    from ckpttool.formats.deepspeed import ALLOWLIST as DS

    def row_bias(tree: Any) -> None:
        info = tree["universal_checkpoint_info"]
        info["tp_replicated_parameter_patterns"].remove(r"blocks\.\d+\.fc2\.bias")
        info["parameter_with_row_parallelism_patterns"].append(r"blocks\.\d+\.fc2\.bias")

    src = rewritten_copy(tmp_path / "rowbias", FIXTURES / "deepspeed" / "tp2", row_bias,
                         "global_step3/mp_rank_*_model_states.pt", DS)  # fmt: skip
    assert "blocks.0.fc2.bias[tp=1].fp32" in registry.describe(src)[1].items
    with pytest.raises(UsageError, match=r"no pattern .* joins the TP ranks' copies of blocks\.0\.fc2\.bias"):
        reshard(src, tmp_path / "d", Target(to="deepspeed-universal"))
    assert not (tmp_path / "d").exists()
    # AutoTP: a map with a scaled piece (ckpttool keeps that parameter one copy per TP rank), and a
    # parameter AutoTP could not describe (ds_to_universal refuses the whole checkpoint)
    key = r"^layers\.1\.self_attn\.o_proj\.bias$"

    def scaled(tree: Any) -> None:
        for rank in tree["universal_checkpoint_info"]["affine_map"]["params"][key]["ranks"].values():
            rank["pieces"][0]["scale"] = 0.5

    def unsupported(tree: Any) -> None:
        tree["universal_checkpoint_info"]["autotp_unsupported_parameter_patterns"][key] = "a layout of its own"

    def qkv_spec(tree: Any, version: float, shape: Any, maps: bool = False) -> None:
        info = tree["universal_checkpoint_info"]
        if not maps:
            info.pop("affine_map")
        info["universal_checkpoint_version"] = version
        info["parameter_with_sub_params"][0]["shape"] = shape  # layer 0's qkv weight

    def shapeless(tree: Any) -> None:  # no view spec at version 0.4
        qkv_spec(tree, 0.4, None)

    def count_at_04(tree: Any) -> None:  # a count with widths at 0.4: ds_to_universal fails on it
        qkv_spec(tree, 0.4, [3, -1])

    def count_of_3(tree: Any) -> None:  # 3 equal sub-parameters of 32 rows, before 0.4 (its widths unread)
        qkv_spec(tree, 0.3, [3, -1])

    for edit, says in (
        (scaled, r"places layers\.1\.self_attn\.o_proj\.bias by a map ckpttool cannot follow"),
        (unsupported, r"AutoTP could not describe how it split .*o_proj.* \(a layout of its own\)"),
        (shapeless, r"sub-parameters of layers\.0\.self_attn\.qkv_proj\.weight .* do not describe its \[32, 16\]"),
        (count_at_04, r"sub-parameters of layers\.0\.self_attn\.qkv_proj\.weight .* do not describe"),
        (count_of_3, r"places layers\.0\.self_attn\.qkv_proj\.weight by a map ckpttool cannot follow"),
    ):
        src = rewritten_copy(tmp_path / edit.__name__, FIXTURES / "deepspeed" / "autotp", edit,
                             "global_step3/mp_rank_*_model_states.pt", DS)  # fmt: skip
        with pytest.raises(UsageError, match=says):
            reshard(src, tmp_path / "e", Target(to="deepspeed-universal"))
        assert not (tmp_path / "e").exists()


@pytest.mark.slow
def test_deepspeed_loads_our_universal_checkpoint():
    """Oracle: DeepSpeed's load_checkpoint with checkpoint.load_universal, at DP=1, loads ckpttool's
    universal checkpoint of the DP=2 ZeRO-2 fixture: the state equals the reference, and the next
    step is bit-identical to the uninterrupted run's."""
    report = _ds_oracle("--variant", "zero2", "--dp", "1", "--universal-by", "ckpttool")
    assert "using ckpttool's universal checkpoint" in report
    assert "native after load vs reference: OK" in report
    assert "native DP=1 (same layout): step-4 loss" in report
    assert "BIT-IDENTICAL; state after step 4 BIT-IDENTICAL" in report


@pytest.mark.slow
def test_deepspeed_loads_our_zero3_universal_checkpoint():
    """Oracle: DeepSpeed's ZeRO-3 load_checkpoint with checkpoint.load_universal, at DP=1, loads
    ckpttool's universal checkpoint of the DP=2 ZeRO-3 fixture: the fp32 masters and both moments
    equal the reference and our direct ZeRO-3 reshard's after its load, bit for bit. (What that
    loader itself gets wrong, frozen parameters, the second group's hyper-parameters, a shared
    step, is DeepSpeed's: the files are ds_to_universal's byte for byte, see above.)"""
    # exit 3: DeepSpeed's own save after that load differs (its loader's doing)
    report = _ds_oracle("--variant", "zero3", "--dp", "1", "--universal-by", "ckpttool", "--no-control", codes=(0, 3))
    native = report.split("using ckpttool's universal checkpoint", 1)[1].split("== step 4", 1)[0]
    after = native.split("resharded-after-load vs native-after-load", 1)[1]
    for state in ("fp32", "exp_avg", "exp_avg_sq"):
        assert f"{state}: 14/14 bit-identical" in after, native
    assert "native after load vs reference: ['module.frozen.bias" in native, native


def test_megatron_grad_scaler_tensors_are_carried(tmp_path):
    """An fp16 run's optimizer also holds ``grad_scaler``, as megatron-core's
    ``DynamicGradScaler.state_dict()`` stores it (``scale`` a tensor, the trackers ints). No fixture
    was trained in fp16, so it is added to the real TP2xPP2 files (by ckpttool's own writer: the
    files pickle Megatron's classes, and neither torch nor Megatron is needed to edit them). The
    output carries the tensor, equal to the source's."""
    from ckpttool.formats import _ptwrite

    def four_thousand(buf: np.ndarray) -> None:
        buf.view(np.float32)[:] = 4096.0

    def add_scaler(obj: Any) -> None:
        scale = _ptwrite.OutTensor("float32", (1,), four_thousand)
        obj["optimizer"]["grad_scaler"] = {"scale": scale, "growth_tracker": 3, "hysteresis_tracker": 2}

    src = rewritten_copy(tmp_path / "fp16", FIXTURES / "megatron" / "legacy_tp2pp2", add_scaler)
    out = tmp_path / "tp1"
    reshard(src, out, Target(tp=1, pp=1))
    (written,) = list(out.rglob("model_optim_rng.pt"))
    archive, obj, _ = _pt.load(out, str(written.relative_to(out)), ALLOWLIST)
    try:
        got = obj["optimizer"]["grad_scaler"]
        assert set(got) == {"scale", "growth_tracker", "hysteresis_tracker"}
        scale = np.empty(1, np.float32)
        _torchzip.read_tensor(archive, got["scale"], scale)
    finally:
        archive.close()
    assert got["scale"].dtype == "float32" and scale.tolist() == [4096.0]
    assert got["growth_tracker"] == 3 and got["hysteresis_tracker"] == 2


def test_a_source_tensor_never_reaches_the_pickle_uncarried():
    ref = _unpickle.TensorRef(_unpickle.StorageRef("0", "float32", 1, "cpu"), 0, (1,), (1,), "float32")
    from ckpttool.formats import _ptwrite

    with pytest.raises(TypeError, match="without carry"):
        _ptwrite.dumps({"x": ref})


def _args(path: Path) -> dict[str, Any]:
    archive, obj, _ = _pt.load(path.parent, path.name, ALLOWLIST)
    archive.close()
    return dict(obj["args"].__dict__)


def _model_keys(path: Path) -> list[str]:
    archive, obj, _ = _pt.load(path.parent, path.name, ALLOWLIST)
    archive.close()
    chunks = [v for k, v in obj.items() if k == "model" or k.startswith("model") and k[5:].isdigit()]
    return [k for model in chunks for k in model if not k.endswith("_extra_state")]


def test_megatron_uneven_pipeline_round_trip(tmp_path):
    """TP=2 x PP=2 -> TP=1 x PP=3 with 2 layers on the first stage (megatron-core's uneven split:
    the other stages share the rest) -> TP=2 x PP=2 gives the original files' trees back; the uneven
    checkpoint holds the same state, each stage numbering its layers from 0, and records the split in
    args as Megatron-LM's --decoder-first-pipeline-num-layers does."""
    uneven, back = tmp_path / "pp3", tmp_path / "back"
    reshard(LEGACY, uneven, Target(tp=1, pp=3, pp_first=2))
    files = _rank_files(uneven)
    assert list(files) == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_00_002"]
    layers = [
        sorted({k.split(".")[2] for k in _model_keys(f) if k.startswith("decoder.layers.")}) for f in files.values()
    ]
    assert layers == [["0", "1"], ["0"], ["0"]]
    keys = [_model_keys(f) for f in files.values()]
    assert "embedding.word_embeddings.weight" in keys[0] and "output_layer.weight" in keys[2]
    assert not any(k.startswith(("embedding.", "output_layer.", "decoder.final")) for k in keys[1])
    for f in files.values():
        args = _args(f)
        assert (args["decoder_first_pipeline_num_layers"], args["decoder_last_pipeline_num_layers"]) == (2, None)
        assert args["pipeline_model_parallel_size"] == 3
    assert not diff(LEGACY, uneven, kinds=STATE_KINDS).different
    assert verify(uneven).failing() == []

    reshard(uneven, back, Target(tp=2, pp=2))
    original, again = _rank_files(LEGACY), _rank_files(back)
    assert list(original) == list(again)
    for name in original:
        assert _drop_rng(_tree(original[name])) == _drop_rng(_tree(again[name])), name


def test_megatron_uneven_pipeline_is_kept_unless_pp_is_given(tmp_path):
    """Without --pp, a reshard keeps the source's uneven split; the last stage's size works too, and
    the torch_dist writer places the layers by the same split."""
    uneven, tp2, last, dist = tmp_path / "pp3", tmp_path / "tp2", tmp_path / "last", tmp_path / "dist"
    reshard(LEGACY, uneven, Target(tp=1, pp=3, pp_first=2))
    reshard(uneven, tp2, Target(tp=2))
    for f in _rank_files(tp2).values():
        args = _args(f)
        assert (args["pipeline_model_parallel_size"], args["decoder_first_pipeline_num_layers"]) == (3, 2)
    assert len(_rank_files(tp2)) == 6
    reshard(uneven, last, Target(pp=2, pp_last=3))
    stages = [
        sorted({k.split(".")[2] for k in _model_keys(f) if k.startswith("decoder.layers.")})
        for f in _rank_files(last).values()
    ]
    assert stages == [["0"], ["0", "1", "2"]]
    both = tmp_path / "both"  # both ends given, the 2 layers between on the one middle stage
    reshard(LEGACY, both, Target(tp=1, pp=3, pp_first=1, pp_last=1))
    stages = [
        sorted({k.split(".")[2] for k in _model_keys(f) if k.startswith("decoder.layers.")})
        for f in _rank_files(both).values()
    ]
    assert stages == [["0"], ["0", "1"], ["0"]]
    assert not diff(LEGACY, both, kinds=STATE_KINDS).different
    reshard(uneven, dist, Target(to="megatron-dist", tp=1, pp=3, pp_first=2))
    for out in (tp2, last, dist):
        assert not diff(LEGACY, out, kinds=STATE_KINDS).different, out
    for out in (tp2, last):  # the distributed optimizer's buffers follow the stages' parameters
        d = tmp_path / f"{out.name}_distopt"
        reshard(out, d, Target(distributed_optimizer=True))
        assert not diff(LEGACY, d, kinds=STATE_KINDS).different, d


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (Target(tp=1, pp=3), "PP=3 does not divide the 4 layers"),
        (Target(pp=3, pp_first=3, pp_last=2), "the first and last stages' 5 layers exceed the 4 layers"),
        (Target(pp=2, pp_first=1, pp_last=1), "PP=2 with both end stages given leaves 2 layers on no stage"),
        (Target(pp=4, pp_first=2, pp_last=1), "the 1 layers between the end stages do not split evenly over 2"),
        (Target(pp=3, pp_first=4), "the first stage takes all 4 layers and leaves the other 2 stage(s) none"),
        (Target(pp=4, pp_first=2, pp_last=2), "the end stages take all 4 layers and leave the 2 stages between"),
        (Target(pp=1, pp_first=2), "needs PP > 1"),
        (Target(pp=2, pp_first=0), "the first stage needs at least one layer"),
        (Target(to="dcp", pp_first=2), "apply to Megatron targets only"),
    ],
)
def test_megatron_uneven_pipeline_refusals(target, message, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        reshard(LEGACY, out, target)
    if "layers" in message and "Megatron targets" not in message:
        assert "--pp-first-layers" in (err.value.hint or "")
    assert not out.exists()


def test_megatron_uneven_pipeline_on_the_command_line(tmp_path, cli):
    out = tmp_path / "out"
    r = cli("reshard", LEGACY, "-o", out, "--tp", "1", "--pp", "3", "--pp-first-layers", "2", "--json")
    assert r.code == 0, r.stderr
    assert json.loads(r.stdout)["layout"]["pp"] == 3
    # the plan says where the layers go, and what a resumed run must be told
    note = "layers by stage: [0-1] [2] [3]; resume with --decoder-first-pipeline-num-layers 2"
    assert note in json.loads(r.stdout)["notes"]
    r = cli("reshard", LEGACY, "-o", tmp_path / "vpp", "--tp", "1", "--vpp", "2", "--dry-run", "--json")
    assert (
        "layers by stage (model chunks joined by +): [0]+[2] [1]+[3]; resume with "
        "--num-virtual-stages-per-pipeline-rank 2" in json.loads(r.stdout)["notes"]
    )
    r = cli("reshard", LEGACY, "-o", tmp_path / "bad", "--pp", "3")
    assert r.code == 2 and "--pp-first-layers" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_megatron_lm_loads_the_uneven_pipeline_checkpoint(tmp_path):
    """Oracle: Megatron-LM's load_checkpoint at TP=1 PP=3 with --decoder-first-pipeline-num-layers 2
    loads our uneven output; every tensor equals the reference; it trains the next step."""
    mlm = _megatron_lm()
    if mlm is None:
        pytest.skip("needs megatron-core and a Megatron-LM source (set MEGATRON_LM)")
    out = tmp_path / "pp3"
    reshard(LEGACY, out, Target(tp=1, pp=3, pp_first=2))
    env = dict(os.environ, CKPTTOOL_MEGATRON_EXTRA="--decoder-first-pipeline-num-layers 2")
    proc = _oracle(mlm, out, "--tp", "1", "--pp", "3", *_ref("legacy_tp2pp2"), env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


VPP = FIXTURES / "megatron" / "legacy_pp2vpp2"


def _chunk_layers(path: Path) -> dict[str, list[str]]:
    archive, obj, _ = _pt.load(path.parent, path.name, ALLOWLIST)
    archive.close()
    return {
        k: sorted({n.split(".")[2] for n in v if n.startswith("decoder.layers.")})
        for k, v in obj.items()
        if k.startswith("model")
    }


def test_megatron_virtual_stages_as_megatron_lm_writes_them(tmp_path):
    """Megatron-LM's own interleaved checkpoint (TP=1 PP=2 VPP=2) resharded to its own layout gives
    Megatron's files' trees back: model0/model1 with their layers, module metadata, the optimizer
    over both chunks (ids chunk by chunk), args, RNG."""
    out = tmp_path / "same"
    reshard(VPP, out, Target(tp=1))
    original, again = _rank_files(VPP), _rank_files(out)
    assert list(original) == list(again) == ["mp_rank_00_000", "mp_rank_00_001"]
    for name in original:
        assert _tree(original[name]) == _tree(again[name]), name
    assert verify(out).failing() == []


def test_megatron_virtual_stages_round_trips(tmp_path):
    """TP=2 x PP=2 -> TP=1 x PP=2 x VPP=2 (chunk v of stage p holds layer 2v + p) -> TP=2 x PP=2
    gives the original trees back; Megatron's VPP checkpoint -> TP=2 x PP=1 -> TP=1 x PP=2 x VPP=2
    gives Megatron's trees back (RNG aside: one rank's states cannot become two)."""
    vpp, back = tmp_path / "vpp", tmp_path / "back"
    reshard(LEGACY, vpp, Target(tp=1, pp=2, vpp=2))
    files = _rank_files(vpp)
    assert [_chunk_layers(f) for f in files.values()] == [
        {"model0": ["0"], "model1": ["0"]},
        {"model0": ["0"], "model1": ["0"]},
    ]
    args = _args(files["mp_rank_00_000"])
    assert (args["virtual_pipeline_model_parallel_size"], args["num_virtual_stages_per_pipeline_rank"]) == (2, 2)
    keys0 = _model_keys(files["mp_rank_00_000"])
    assert keys0[0] == "embedding.word_embeddings.weight" and "output_layer.weight" in _model_keys(
        files["mp_rank_00_001"]
    )
    assert not diff(LEGACY, vpp, kinds=STATE_KINDS).different
    reshard(vpp, back, Target(tp=2, pp=2))
    for name, path in _rank_files(LEGACY).items():
        assert _drop_rng(_tree(path)) == _drop_rng(_tree(_rank_files(back)[name])), name
    assert _args(_rank_files(back)["mp_rank_00_000"])["virtual_pipeline_model_parallel_size"] is None

    flat, again = tmp_path / "tp2pp1", tmp_path / "again"
    reshard(VPP, flat, Target(tp=2, pp=1))
    assert not diff(VPP, flat, kinds=STATE_KINDS).different
    reshard(flat, again, Target(tp=1, pp=2, vpp=2))
    for name, path in _rank_files(VPP).items():
        mine = _rank_files(again)[name]
        assert _drop_rng(_tree(path), "args") == _drop_rng(_tree(mine), "args"), name
        # the 64 vocabulary rows at TP=2 were recorded as divisible-by 32 (at TP=1 that still gives 64,
        # and was kept): the run's own 64, recorded beside it, comes back
        a, b = _args(path), _args(mine)
        assert {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)} == set()


def test_megatron_virtual_stages_to_torch_dist_is_what_megatron_saves(tmp_path):
    """Megatron-LM's interleaved legacy checkpoint -> torch_dist: every tensor chunk and
    ShardedObject record is the one Megatron's own torch_dist save of the same model chunks wrote."""
    from tests.test_reshard_dist import ITER, _chunks, _metadata, _record

    dist = FIXTURES / "megatron" / "dist_pp2vpp2"
    out = tmp_path / "dist"
    reshard(VPP, out, Target(to="megatron-dist"))
    ours, megatron = _metadata(out), _metadata(dist)
    assert _chunks(ours) == _chunks(megatron)
    for key, meta in megatron.state_dict_metadata.items():
        for offsets in [c.offsets for c in meta.chunks] if hasattr(meta, "chunks") else [None]:
            assert _record(out, ours, key, offsets) == _record(dist, megatron, key, offsets), key
    assert (out / ITER / "common.pt").is_file() and not diff(dist, out).different

    # from torch_dist itself: to TP=2 x PP=1 and back to PP=2 x VPP=2 gives Megatron's records again, but
    # for the second stage's RNG (a PP=1 checkpoint holds one stage's)
    flat, again = tmp_path / "flat", tmp_path / "again"
    reshard(dist, flat, Target(tp=2, pp=1))
    reshard(flat, again, Target(tp=1, pp=2, vpp=2))
    mine = _metadata(again)
    assert _chunks(mine) == _chunks(megatron)
    differ = [
        key
        for key, meta in megatron.state_dict_metadata.items()
        for offsets in ([c.offsets for c in meta.chunks] if hasattr(meta, "chunks") else [None])
        if _record(again, mine, key, offsets) != _record(dist, megatron, key, offsets)
    ]
    assert differ == ["rng_state/shard_1.0_2.1"]


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (Target(tp=1, pp=1, vpp=2), "VPP=2 needs PP > 1"),
        (Target(tp=1, pp=2, vpp=3), "the 2 layers of pipeline stage 0 do not split into VPP=3 model chunks"),
        (Target(tp=1, pp=2, vpp=2, pp_first=1), "the 1 layers of pipeline stage 0 do not split into VPP=2"),
        (Target(tp=1, pp=2, vpp=2, pp_first=2, pp_last=2), "virtual stages with both end stages given need"),
        (Target(to="dcp", vpp=2), "--vpp applies to Megatron targets only"),
    ],
)
def test_megatron_virtual_stages_refusals(target, message, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        reshard(LEGACY, out, target)
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("first", [None, 2])
def test_megatron_lm_loads_the_virtual_stages_checkpoint(first, tmp_path):
    """Oracle: Megatron-LM's load_checkpoint at TP=1 PP=2 with 2 virtual stages per rank (the
    interleaved schedule; and with --decoder-first-pipeline-num-layers 2, the uneven split's own
    arithmetic) loads our output; every tensor of both model chunks equals the reference; it trains
    the next step."""
    mlm = _megatron_lm()
    if mlm is None:
        pytest.skip("needs megatron-core and a Megatron-LM source (set MEGATRON_LM)")
    out = tmp_path / "vpp"
    reshard(LEGACY, out, Target(tp=1, pp=2, vpp=2, pp_first=first))
    extra = "" if first is None else f"--decoder-first-pipeline-num-layers {first}"
    env = dict(os.environ, CKPTTOOL_MEGATRON_EXTRA=extra)
    proc = _oracle(mlm, out, "--tp", "1", "--pp", "2", "--vpp", "2", *_ref("legacy_tp2pp2"), env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


VPP_DISTOPT = FIXTURES / "megatron" / "legacy_pp2vpp2_distopt"


def test_megatron_virtual_stages_with_the_distributed_optimizer(tmp_path):
    """Megatron-LM's interleaved checkpoint saved by the distributed optimizer (one grad buffer per
    model chunk in distrib_optim.pt): resharded to its own layout it gives Megatron's files back
    byte for byte; the Float16-optimizer VPP checkpoint of the same training gives those very bytes
    with --distributed-optimizer (the rank files differ only in args.save); and the non-VPP
    distributed-optimizer fixture through VPP=2 and back gives its distrib_optim.pt byte for byte."""
    same, converted, vpp, back = (tmp_path / n for n in ("same", "converted", "vpp", "back"))
    reshard(VPP_DISTOPT, same, Target(tp=1))
    reshard(VPP, converted, Target(tp=1, distributed_optimizer=True))
    theirs = _distrib_files(VPP_DISTOPT)
    assert list(theirs) == ["mp_rank_00_000", "mp_rank_00_001"]
    for out in (same, converted):
        for name, path in theirs.items():
            assert path.read_bytes() == _distrib_files(out)[name].read_bytes(), (out.name, name)
    for name, path in _rank_files(VPP_DISTOPT).items():
        assert _tree(path) == _tree(_rank_files(same)[name]), name
        assert _drop_rng(_tree(path), "args") == _drop_rng(_tree(_rank_files(converted)[name]), "args"), name
    assert not diff(VPP, VPP_DISTOPT, kinds=STATE_KINDS).different  # the reader de-buckets both chunks

    reshard(DISTOPT, vpp, Target(tp=1, pp=2, vpp=2))
    assert not diff(DISTOPT, vpp, kinds=STATE_KINDS).different
    reshard(vpp, back, Target(tp=2, pp=2))
    for name, path in _distrib_files(DISTOPT).items():
        assert path.read_bytes() == _distrib_files(back)[name].read_bytes(), name


@pytest.mark.slow
def test_megatron_lm_loads_virtual_stages_with_the_distributed_optimizer(tmp_path):
    """Oracle: Megatron-LM's load_checkpoint with --use-distributed-optimizer and the interleaved
    schedule (TP=1 PP=2 VPP=2) loads our distrib_optim.pt (a grad buffer per model chunk), resharded
    from the TP=2 x PP=2 distributed-optimizer fixture; every tensor equals the reference; it trains
    the next step."""
    mlm = _megatron_lm()
    if mlm is None:
        pytest.skip("needs megatron-core and a Megatron-LM source (set MEGATRON_LM)")
    out = tmp_path / "vpp"
    reshard(DISTOPT, out, Target(tp=1, pp=2, vpp=2))
    proc = _oracle(mlm, out, "--tp", "1", "--pp", "2", "--vpp", "2", "--distopt", *_ref("legacy_tp2pp2_distopt"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize(("source", "pp"), [("legacy_tp2pp2_distopt", 1), ("legacy_tp2pp2", 2)])
def test_megatron_lm_loads_the_distributed_optimizer_checkpoint_at_dp2(source, pp, tmp_path):
    """Oracle: Megatron-LM's load_checkpoint with --use-distributed-optimizer at DP=2 (TP=1) loads our
    distrib_optim.pt (resharded, or converted from the Float16 optimizer) and scatters it over the
    two data-parallel ranks: each rank's shard of every fp32 main param and Adam moment equals the
    reference's flat range, the shards cover every tensor exactly once; it trains the next step."""
    mlm = _megatron_lm()
    if mlm is None:
        pytest.skip("needs megatron-core and a Megatron-LM source (set MEGATRON_LM)")
    out = tmp_path / "out"
    reshard(FIXTURES / "megatron" / source, out, Target(tp=1, pp=pp, distributed_optimizer=True))
    proc = _oracle(mlm, out, "--tp", "1", "--pp", str(pp), "--dp", "2", "--distopt", *_ref(source))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "DP=2" in proc.stdout and "coverage of the 108 reference tensors by the main replicas: OK" in proc.stdout


LAYOUT = FIXTURES / "megatron" / "legacy_pp2layout"


def test_megatron_pipeline_layout(tmp_path):
    """--pipeline-model-parallel-layout: Megatron-LM's own 'E|tt|tt|L' checkpoint resharded to its
    layout gives its files' trees back; through TP=2 x PP=1 and back with --pipeline-layout gives them
    again (RNG aside); the TP=2 x PP=2 fixture takes the layout (chunk
    layers, args), and another layout at PP=4; all hold the same state."""
    same = tmp_path / "same"
    reshard(LAYOUT, same, Target())
    for name, path in _rank_files(LAYOUT).items():
        assert _tree(path) == _tree(_rank_files(same)[name]), name
    flat, back = tmp_path / "flat", tmp_path / "back"
    reshard(LAYOUT, flat, Target(tp=2, pp=1))
    assert _args(_rank_files(flat)["mp_rank_00"])["pipeline_model_parallel_layout"] is None
    reshard(flat, back, Target(tp=1, pp=2, pipeline_layout="E|tt|tt|L"))
    for name, path in _rank_files(LAYOUT).items():
        assert _drop_rng(_tree(path), "args") == _drop_rng(_tree(_rank_files(back)[name]), "args"), name
        a, b = _args(path), _args(_rank_files(back)[name])
        assert {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)} == set()

    out = tmp_path / "from_tp2pp2"
    result = reshard(LEGACY, out, Target(tp=1, pp=2, pipeline_layout="E|tt|tt|L"))
    assert any(
        "[]+[2-3] [0-1]+[]" in n and "--pipeline-model-parallel-layout 'E|tt|tt|L'" in n for n in result.plan.notes
    )
    files = _rank_files(out)
    assert [_chunk_layers(f) for f in files.values()] == [
        {"model0": [], "model1": ["0", "1"]},
        {"model0": ["0", "1"], "model1": []},
    ]
    args = _args(files["mp_rank_00_000"])
    assert (args["pipeline_model_parallel_layout"], args["virtual_pipeline_model_parallel_size"]) == ("E|tt|tt|L", 2)
    assert args["num_virtual_stages_per_pipeline_rank"] is None
    four = tmp_path / "pp4"
    reshard(LAYOUT, four, Target(pp=4, pipeline_layout="Et|t|t|tL"))
    assert [_chunk_layers(f) for f in _rank_files(four).values()] == [{"model": ["0"]}] * 4
    for path in (same, flat, back, out, four):
        assert not diff(LAYOUT if path != out else LEGACY, path, kinds=STATE_KINDS).different, path
        assert verify(path).failing() == []


def test_example_layout_writes_long_runs_of_layers_compactly():
    """A hint's example layout for a model of 2**40 layers (args are read from the checkpoint)
    spelled each one: a MemoryError traceback. Long runs are x*n, which megatron-core reads."""
    from ckpttool.formats.megatron import example_layout, layout_stages

    assert example_layout(2**40, 2, 1) == "Et*549755813888|t*549755813888mL"
    assert [s.count("t") for s in layout_stages(example_layout(21, 2))] == [11, 10]


@pytest.mark.parametrize(
    ("target", "message", "example"),
    [
        (Target(tp=1, pp=2, pipeline_layout="E|ttt|L"), "the layout's 3 stages do not divide over PP=2", "Ett|ttL"),
        (Target(tp=1, pp=2, pipeline_layout="E|tt|t|L"), "places 3 transformer layers, the model has 4", "Et|t|t|tL"),
        (Target(tp=1, pp=2, pipeline_layout="tE|tt|t|L"), "must start with the embedding", "Et|t|t|tL"),
        (Target(tp=1, pp=2, pipeline_layout="E|tt|tt|mL"), "the pipeline layout places 1 MTP layers", "Et|t|t|tL"),
        (Target(tp=1, pp=2, pipeline_layout="Et|tx|t|tL"), "has letters ['x'] megatron-core does not know", "Ett|ttL"),
        (Target(tp=1, pp=2, vpp=2, pipeline_layout="E|tt|tt|L"), "drop --vpp", None),
        (Target(tp=1, pp=1, pipeline_layout="Et|t|t|tL"), "4 virtual stages on one pipeline rank", "EttttL"),  # as --vpp 4
        (Target(to="dcp", pipeline_layout="E|tt|tt|L"), "Megatron targets only", None),
    ],
)
def test_megatron_pipeline_layout_refusals(target, message, example, tmp_path):
    """A layout that does not fit is refused with the reason, and a hint (it was "choose sizes that
    divide the model's heads, query groups, hidden sizes and layers") that says how a layout is
    written for this model, with one that fits: the same PP, and the given layout's virtual stages
    where they divide over it."""
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace("[", r"\[")) as refused:
        reshard(LEGACY, tmp_path / "out", target)
    assert not (tmp_path / "out").exists()
    if example is None:
        return
    assert refused.value.hint.endswith(f"for example --pipeline-layout '{example}'"), refused.value.hint
    assert "the model's 4 transformer layers as t" in refused.value.hint and "MTP" not in refused.value.hint
    from dataclasses import replace

    reshard(LEGACY, tmp_path / "out", replace(target, pipeline_layout=example))  # the example fits
    assert verify(tmp_path / "out").failing() == []


@pytest.mark.slow
def test_megatron_lm_loads_the_pipeline_layout_checkpoint(tmp_path):
    """Oracle: Megatron-LM's load_checkpoint with --pipeline-model-parallel-layout 'E|tt|tt|L' (PP=2,
    two virtual stages each, two of them empty) loads the TP=2 x PP=2 fixture resharded to that
    layout: every tensor equals the reference, and it trains the next step."""
    mlm = _megatron_lm()
    if mlm is None:
        pytest.skip("needs megatron-core and a Megatron-LM source (set MEGATRON_LM)")
    out = tmp_path / "layout"
    reshard(LEGACY, out, Target(tp=1, pp=2, pipeline_layout="E|tt|tt|L"))
    proc = _oracle(mlm, out, "--tp", "1", "--pp", "2", "--layout", "E|tt|tt|L", *_ref("legacy_tp2pp2"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "coverage of the 108 reference tensors by the main replicas: OK" in proc.stdout


MOE = FIXTURES / "megatron" / "legacy_pp2ep2"


def _optimizer(path: Path) -> Any:
    archive, obj, _ = _pt.load(path.parent, path.name, ALLOWLIST)
    archive.close()
    return obj["optimizer"]


def test_megatron_experts_as_megatron_lm_writes_them(tmp_path):
    """Megatron-LM's mixture-of-experts checkpoint (PP=2 EP=2: rank files mp_rank_00_<pp>_<ep>, two
    local experts each, a chained dense + expert optimizer) resharded to its own layout gives
    Megatron's files' trees back, RNG of every (PP, EP) rank included."""
    out = tmp_path / "same"
    reshard(MOE, out, Target())
    original, again = _rank_files(MOE), _rank_files(out)
    assert list(original) == list(again) == [f"mp_rank_00_00{p}_00{e}" for p in range(2) for e in range(2)]
    for name in original:
        assert _tree(original[name]) == _tree(again[name]), name
    assert verify(out).failing() == []


def test_megatron_experts_round_trips(tmp_path):
    """PP=2 x EP=2 -> PP=1 x EP=1 (all 4 experts in one file, in the one optimizer megatron-core
    builds at EP=1) -> PP=2 x EP=2 gives Megatron's trees back; so does the way through TP=2 x EP=4
    (one expert per rank file, 8 files); every layout holds the same state (RNG aside: the states
    of 4 ranks cannot come back from 1)."""
    one, back = tmp_path / "ep1", tmp_path / "back"
    reshard(MOE, one, Target(pp=1, ep=1))
    (only,) = _rank_files(one).values()
    keys = _model_keys(only)
    assert [k for k in keys if k.startswith("decoder.layers.1.mlp.experts.") and k.endswith("fc1.weight")] == [
        f"decoder.layers.1.mlp.experts.local_experts.{j}.linear_fc1.weight" for j in range(4)
    ]
    opt = _optimizer(only)
    assert isinstance(opt, dict)  # one optimizer: at EP=1 the experts are dense parameters
    groups = opt["optimizer"]["param_groups"]
    assert [(len(g["params"]), g["is_expert_parallel"]) for g in groups] == [(24, False), (5, False)]
    assert _args(only)["expert_model_parallel_size"] == 1
    reshard(one, back, Target(pp=2, ep=2))
    for name, path in _rank_files(MOE).items():
        assert _drop_rng(_tree(path)) == _drop_rng(_tree(_rank_files(back)[name])), name

    wide, again = tmp_path / "tp2ep4", tmp_path / "again"
    reshard(MOE, wide, Target(tp=2, pp=1, ep=4))
    files = _rank_files(wide)
    assert list(files) == [f"mp_rank_0{t}_00{e}" for t in range(2) for e in range(4)]
    opt = _optimizer(files["mp_rank_01_003"])
    assert isinstance(opt, list) and [len(o["optimizer"]["state"]) for o in opt] == [13, 4]
    assert {g["is_expert_parallel"] for g in opt[1]["optimizer"]["param_groups"]} == {True}
    args = _args(files["mp_rank_01_003"])
    assert (args["rank"], args["expert_model_parallel_size"], args["tensor_model_parallel_size"]) == (7, 4, 2)
    assert "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight" in _model_keys(files["mp_rank_01_003"])
    # EP 4 over the source's DP of 2: ranks are written for DP 4 (Megatron needs DP a multiple of EP),
    # so each file names a distinct saving rank of a world of TP x PP x 4; data_parallel_size stays
    # the source run's
    deep = tmp_path / "pp2ep4"
    reshard(MOE, deep, Target(tp=1, pp=2, ep=4))
    every = [_args(f) for f in _rank_files(deep).values()]
    assert len(every) == 8 and len({a["rank"] for a in every}) == 8
    assert {(a["data_parallel_size"], a["world_size"]) for a in every} == {(2, 8)}
    reshard(wide, again, Target(tp=1, pp=2, ep=2))
    for name, path in _rank_files(MOE).items():
        # the 64 vocabulary rows at TP=2 were recorded as divisible-by 32; at TP=1 that still gives 64
        assert _drop_rng(_tree(path), "args") == _drop_rng(_tree(_rank_files(again)[name]), "args"), name
    for out in (one, back, wide, again):
        assert not diff(MOE, out, kinds=STATE_KINDS).different, out
        assert verify(out).failing() == []


@pytest.mark.parametrize(
    ("source", "target", "message"),
    [
        (MOE, Target(ep=3), "EP=3 does not divide the 4 experts"),
        (LEGACY, Target(ep=2), "EP=2: the model has no routed experts"),
    ],
)
def test_megatron_experts_refusals(source, target, message, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        reshard(source, out, target)
    assert not out.exists()


def test_expert_sizes_of_one_are_a_dense_models_own(tmp_path):
    """--ep 1 --etp 1 (a script giving the same sizes for every model) was refused for a model
    without experts ("ETP=1: the model has no routed experts") with a hint about heads and layers.
    Sizes of 1 are its own: the output is the one without them, byte for byte; ETP=2 is refused
    with a hint that names the options."""
    seal = "ckpttool.manifest.json"  # (its own path and time in it)
    for tp in (1, 2):  # (at TP=2, ETP=1 of a model with experts would leave a TP rank unsaved)
        plain, ones = tmp_path / f"plain{tp}", tmp_path / f"ones{tp}"
        reshard(LEGACY, plain, Target(tp=tp, pp=1))
        reshard(LEGACY, ones, Target(tp=tp, pp=1, ep=1, etp=1))
        assert {k: v for k, v in tree_digests(plain).items() if k != seal} == {
            k: v for k, v in tree_digests(ones).items() if k != seal
        }
    r = run_cli("reshard", LEGACY, "-o", tmp_path / "x", "--tp", "1", "--pp", "1", "--etp", "2")
    assert_clean(r, 2, "ETP=2: the model has no routed experts")
    assert "hint: the model has no routed experts: leave out --ep and --etp, or give them as 1" in r.stderr


def test_megatron_experts_to_torch_dist_is_what_megatron_saves(tmp_path):
    """Megatron-LM's MoE legacy checkpoint -> torch_dist: every tensor chunk (experts stacked as
    [layers, experts, ...]) and ShardedObject record (experts' _extra_state per layer and expert,
    RNG per PP x TP x DP rank) is the one Megatron's own torch_dist save of the same state wrote;
    through TP=2 x PP=1 x EP=4 and back (from torch_dist itself) gives those records again."""
    from tests.test_reshard_dist import ITER, _chunks, _metadata, _record

    dist = FIXTURES / "megatron" / "dist_pp2ep2"
    megatron = _metadata(dist)

    def differing(out: Path) -> list[str]:
        ours = _metadata(out)
        assert _chunks(ours) == _chunks(megatron)
        return [
            key
            for key, meta in megatron.state_dict_metadata.items()
            for offsets in ([c.offsets for c in meta.chunks] if hasattr(meta, "chunks") else [None])
            if _record(out, ours, key, offsets) != _record(dist, megatron, key, offsets)
        ]

    out = tmp_path / "dist"
    reshard(MOE, out, Target(to="megatron-dist"))
    assert differing(out) == []
    assert (out / ITER / "common.pt").is_file() and not diff(dist, out).different
    # the non-sharded part too: the chain's param groups and common step, content metadata

    from tests.test_reshard_dist import _same

    common = load_pt(out / ITER / "common.pt")
    theirs = load_pt(dist / ITER / "common.pt")
    assert list(common) == list(theirs) and _same(common["optimizer"], theirs["optimizer"])
    assert common["content_metadata"] == theirs["content_metadata"]
    assert common["opt_param_scheduler"] == theirs["opt_param_scheduler"]
    assert json.loads((out / ITER / "metadata.json").read_text()) == json.loads(
        (dist / ITER / "metadata.json").read_text()
    )
    wide, again = tmp_path / "wide", tmp_path / "again"
    reshard(dist, wide, Target(tp=2, pp=1, ep=4))
    assert _args(wide / ITER / "common.pt")["expert_model_parallel_size"] == 4
    reshard(wide, again, Target(tp=1, pp=2, ep=2))
    # the RNG of the second stage cannot come back from a PP=1 checkpoint
    assert differing(again) == ["rng_state/shard_1.0.0_2.1.2", "rng_state/shard_1.0.1_2.1.2"]
    for path in (wide, again):
        assert not diff(dist, path, kinds=STATE_KINDS).different


def test_model_order_keeps_expert_blocks_whole():
    """Entries gathered from several EP ranks' files go back in megatron-core's registration order:
    a layer's routed experts as one block where the first stood (SequentialMLP expert by expert,
    grouped GEMM weight by weight), shared experts after it."""
    from ckpttool.formats.megatron_write import _canonical

    layer = "decoder.layers.0."

    def sequential(experts: list[int]) -> list[str]:
        names = [f"{layer}input_layernorm.weight", f"{layer}mlp.router.weight"]
        for j in experts:
            names += [f"{layer}mlp.experts.local_experts.{j}.linear_fc{k}.weight" for k in (1, 2)]
        return [*names, f"{layer}mlp.shared_experts.linear_fc1.weight", "decoder.layers.1.input_layernorm.weight"]

    def grouped(experts: list[int]) -> list[str]:
        return [f"{layer}mlp.router.weight"] + [
            f"{layer}mlp.experts.linear_fc{k}.weight{j}" for k in (1, 2) for j in experts
        ]

    assert _canonical(sequential([0, 1]) + sequential([2, 3])) == sequential([0, 1, 2, 3])
    assert _canonical(grouped([0, 1]) + grouped([2, 3])) == grouped([0, 1, 2, 3])


ETP = FIXTURES / "megatron" / "legacy_tp2ep2etp1"


@pytest.mark.parametrize("name", ["legacy_pp2ep2", "legacy_tp2ep2etp1", "legacy_tp2ep2_gg", "legacy_tp2ep2_mtp"])
def test_megatron_experts_module_metadata_keeps_megatrons_order(name, tmp_path):
    """Rewritten at the layout it was saved at, every rank file's module _metadata lists its modules in
    Megatron-LM's own order: before, the EP rank 1 files' experts came after output_layer (the
    modules of every EP rank's experts were gathered in file order, not placed in their layer's block),
    which a dict comparison of the trees does not see."""
    source, out = FIXTURES / "megatron" / name, tmp_path / "out"
    reshard(source, out, Target())
    for rank, path in _rank_files(source).items():
        ours, theirs = (dict(_tree(p)[1])["model"][2][1] for p in (_rank_files(out)[rank], path))
        assert list(ours) == list(theirs), rank


def test_megatron_expert_tensor_parallelism_round_trips(tmp_path):
    """Megatron-LM's TP=2 EP=2 ETP=1 files (mp_rank_00_000 and mp_rank_01_001 only: the ranks of
    expert-DP rank 0; the experts whole) resharded to their own layout give Megatron's trees back,
    args and RNG included. Through TP=1 EP=1 and back with --etp 1, the trees come back (RNG aside);
    without --etp the TP=1 source's experts follow the new TP (Megatron's default): 4 files, the
    experts halved, the same state; and torch_dist from the legacy files holds the same state as
    Megatron-LM's own torch_dist save."""
    same = tmp_path / "same"
    reshard(ETP, same, Target())
    original = _rank_files(ETP)
    assert list(original) == list(_rank_files(same)) == ["mp_rank_00_000", "mp_rank_01_001"]
    for name, path in original.items():
        assert _tree(path) == _tree(_rank_files(same)[name]), name
    one, back, wide = tmp_path / "one", tmp_path / "back", tmp_path / "wide"
    reshard(ETP, one, Target(tp=1, ep=1))
    (only,) = _rank_files(one).values()
    assert (_args(only)["tensor_model_parallel_size"], _args(only)["expert_tensor_parallel_size"]) == (1, 1)
    reshard(one, back, Target(tp=2, ep=2, etp=1))
    for name, path in original.items():
        assert _drop_rng(_tree(path)) == _drop_rng(_tree(_rank_files(back)[name])), name
    reshard(one, wide, Target(tp=2, ep=2))
    files = _rank_files(wide)
    assert list(files) == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    assert {_args(f)["expert_tensor_parallel_size"] for f in files.values()} == {2}
    assert not diff(ETP, wide, kinds=STATE_KINDS).different and verify(wide).failing() == []
    # straight to TP2 x EP2 x ETP2 (the grid): each file gets the RNG that the source rank of its TP
    # rank saved (TP rank 1's is in mp_rank_01_001 alone), not another TP rank's
    grid = tmp_path / "grid"
    reshard(ETP, grid, Target(etp=2))

    def rng(path: Path) -> Any:
        return dict(_tree(path)[1])["rng_state"]

    for name, saved in [("mp_rank_00_000", "mp_rank_00_000"), ("mp_rank_00_001", "mp_rank_00_000"),
                        ("mp_rank_01_000", "mp_rank_01_001"), ("mp_rank_01_001", "mp_rank_01_001")]:  # fmt: skip
        assert rng(_rank_files(grid)[name]) == rng(original[saved]), name
    assert rng(original["mp_rank_00_000"]) != rng(original["mp_rank_01_001"])
    dist = tmp_path / "dist"
    reshard(ETP, dist, Target(to="megatron-dist"))
    assert not diff(FIXTURES / "megatron" / "dist_tp2ep2etp1", dist, kinds=STATE_KINDS).different
    assert verify(dist).failing() == []


def test_megatron_expert_tensor_parallel_targets_refused(tmp_path):
    """--etp on a model without routed experts, an ETP that does not divide the experts' hidden
    size, and a layout whose legacy files would leave a TP rank unsaved (Megatron-LM saves only the
    ranks of expert-DP rank 0), with or without the distributed optimizer, are refused before
    anything is written."""
    for src, target, match in [
        (FIXTURES / "megatron" / "legacy_tp2pp2", Target(etp=2), "no routed experts"),
        (ETP, Target(etp=3, ep=2), "cannot be split evenly"),
        (ETP, Target(ep=1), "a legacy checkpoint cannot hold this layout"),  # ETP x EP < TP: a TP rank unsaved
        (ETP_DISTOPT, Target(ep=1), "a legacy checkpoint cannot hold this layout"),
        (ETP, Target(tp=1, etp=2, ep=2, distributed_optimizer=True), "one rank.s file overwrote the other.s"),
    ]:
        with pytest.raises(UsageError, match=match):
            reshard(src, tmp_path / "out", target)
        assert not (tmp_path / "out").exists()


ETP_DISTOPT = FIXTURES / "megatron" / "legacy_tp2ep2etp1_distopt"


def test_megatron_expert_tensor_parallelism_with_the_distributed_optimizer(tmp_path):
    """Megatron-LM's TP=2 EP=2 ETP=1 run with the distributed optimizer at world 4 (dense DP 2, expert
    DP 2): a distrib_optim.pt beside each of the two rank files, both savers dense DP rank 0, so each
    holds the chain's dense state of its TP rank and the experts' of its EP rank. Resharded to its
    own layout every distrib_optim.pt comes back byte for byte, and the rank files' trees; so they do
    through TP=1 EP=2 (ETP = TP: the experts' own TP gone) and back with --etp 1, and through TP=2
    EP=4 ETP=1 (the saving ranks of dense DP rank 1 get None for the dense state) and back. At TP=1
    EP=1 one optimizer holds the experts in its one buffer. The Float16 ETP fixture converted to the
    distributed optimizer gets the same layout. To torch_dist the legacy save gives Megatron-LM's
    own fully_reshardable save of the same run, and from either torch_dist save of the run the
    legacy output's distrib_optim.pt files are its legacy save's, byte for byte."""
    original = _rank_files(ETP_DISTOPT)
    assert list(original) == ["mp_rank_00_000", "mp_rank_01_001"]
    same, narrow, back, wide, back2 = (tmp_path / n for n in ("same", "narrow", "back", "wide", "back2"))
    reshard(ETP_DISTOPT, same, Target())
    reshard(ETP_DISTOPT, narrow, Target(tp=1, ep=2))
    assert list(_rank_files(narrow)) == ["mp_rank_00_000", "mp_rank_00_001"]
    reshard(narrow, back, Target(tp=2, ep=2, etp=1))
    reshard(ETP_DISTOPT, wide, Target(tp=2, ep=4, etp=1))
    reshard(wide, back2, Target(tp=2, ep=2, etp=1))
    for name, path in original.items():
        for out in (same, back, back2):
            assert (path.parent / "distrib_optim.pt").read_bytes() == (
                _rank_files(out)[name].parent / "distrib_optim.pt"
            ).read_bytes(), (out.name, name)
        assert _tree(path) == _tree(_rank_files(same)[name]), name
        assert _drop_rng(_tree(path), "args") == _drop_rng(_tree(_rank_files(back)[name]), "args"), name
    one = tmp_path / "one"
    reshard(ETP_DISTOPT, one, Target(tp=1, ep=1))
    (only,) = _rank_files(one).values()
    assert isinstance(_distrib(only), dict) and isinstance(_optimizer(only), dict)
    # TP=2 EP=4 ETP=1 at world 4 (DP 2): rank r saves mp_rank_<r mod 2>_<r>; ranks 2 and 3 are dense DP rank 1
    files = _rank_files(wide)
    assert list(files) == ["mp_rank_00_000", "mp_rank_00_002", "mp_rank_01_001", "mp_rank_01_003"]
    dense = {name: _distrib(f)[0] is not None for name, f in files.items()}
    assert dense == {"mp_rank_00_000": True, "mp_rank_00_002": False, "mp_rank_01_001": True, "mp_rank_01_003": False}
    assert all(isinstance(_distrib(f)[1], dict) for f in files.values())

    converted = tmp_path / "converted"
    reshard(ETP, converted, Target(distributed_optimizer=True))
    for name, path in original.items():
        ours, theirs = _distrib(_rank_files(converted)[name]), _distrib(path)
        assert [next(iter(m[0].values()))["numel_unpadded"] for m in ours] == [
            next(iter(m[0].values()))["numel_unpadded"] for m in theirs
        ], name
    for out in (same, narrow, one, back, wide, back2, converted):
        assert not diff(ETP_DISTOPT if out != converted else ETP, out, kinds=STATE_KINDS).different, out
        assert verify(out).failing() == []
    dist = tmp_path / "dist"
    reshard(ETP_DISTOPT, dist, Target(to="megatron-dist"))
    fr = FIXTURES / "megatron" / "dist_tp2ep2etp1_distopt_fr"
    assert not diff(fr, dist).different and verify(dist).failing() == []
    # and back: the run's torch_dist saves (dp_reshardable, fully_reshardable) written as legacy
    # give its own legacy save's distrib_optim.pt, byte for byte
    for source in (fr, FIXTURES / "megatron" / "dist_tp2ep2etp1_distopt"):
        legacy = tmp_path / f"legacy_{source.name}"
        reshard(source, legacy, Target(to="megatron"))
        for name, path in original.items():
            assert (path.parent / "distrib_optim.pt").read_bytes() == (
                _rank_files(legacy)[name].parent / "distrib_optim.pt"
            ).read_bytes(), (source.name, name)
        assert not diff(ETP_DISTOPT, legacy).different and verify(legacy).failing() == []


@pytest.mark.slow
def test_megatron_lm_loads_expert_tensor_parallel_output(tmp_path):
    """Oracle: Megatron-LM's load_checkpoint at TP=2 EP=2 ETP=1 (world 2) loads the ETP fixture
    brought back from TP=1 EP=1: every tensor equals the run's reference, the main replicas cover
    each reference tensor once, and it trains the next step."""
    mlm = _megatron_lm()
    if mlm is None:
        pytest.skip("needs megatron-core and a Megatron-LM source (set MEGATRON_LM)")
    one, back = tmp_path / "one", tmp_path / "back"
    reshard(ETP, one, Target(tp=1, ep=1))
    reshard(one, back, Target(tp=2, ep=2, etp=1))
    args = ("--tp", "2", "--pp", "1", "--ep", "2", "--etp", "1", "--padded-vocab", "128")
    proc = _oracle(mlm, back, *args, *_ref("legacy_tp2ep2etp1"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "coverage of the 116 reference tensors by the main replicas: OK" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("ep", [2, 4])
def test_megatron_lm_loads_expert_tensor_parallel_output_with_the_distributed_optimizer(ep, tmp_path):
    """Oracle: Megatron-LM's load_checkpoint with --use-distributed-optimizer at TP=2 ETP=1, world 4
    (DP=2), loads the distributed-optimizer ETP fixture brought back from TP=1 EP=2 (EP=2), or
    resharded to EP=4 (the saving ranks of dense DP rank 1 hold no dense state): it scatters each
    distrib_optim.pt state over its DP ranks and every shard equals the run's reference, the main
    replicas cover each reference tensor once, the RNG loads, and it trains the next step."""
    mlm = _megatron_lm()
    if mlm is None:
        pytest.skip("needs megatron-core and a Megatron-LM source (set MEGATRON_LM)")
    out = tmp_path / "out"
    if ep == 2:
        reshard(ETP_DISTOPT, tmp_path / "narrow", Target(tp=1, ep=2))
        reshard(tmp_path / "narrow", out, Target(tp=2, ep=2, etp=1))
    else:
        reshard(ETP_DISTOPT, out, Target(tp=2, ep=4, etp=1))
    args = ("--tp", "2", "--pp", "1", "--ep", str(ep), "--etp", "1", "--dp", "2", "--distopt", "--padded-vocab", "128")
    proc = _oracle(mlm, out, *args, *_ref("dist_tp2ep2etp1_distopt"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "coverage of the 116 reference tensors by the main replicas: OK" in proc.stdout
    assert "RNG: loaded by Megatron and checked" in proc.stdout


@pytest.mark.parametrize("source", ["legacy_pp2ep2", "legacy_pp2ep2_distopt"])
def test_megatron_experts_with_stages_that_hold_none(source, tmp_path):
    """A pipeline stage without routed experts (here the layout 'E|t|t|L' puts the embedding and the
    loss on stages of their own) still has the chain's expert optimizer, with empty groups (and an
    empty expert grad buffer), as megatron-core aligns the groups over all ranks; it is written so
    and read back, and the state is the source's."""
    out = tmp_path / "pp4"
    reshard(FIXTURES / "megatron" / source, out, Target(pp=4, pipeline_layout="E|t|t|L"))
    files = _rank_files(out)
    assert len(files) == 8
    chain = _optimizer(files["mp_rank_00_000_001"])
    assert isinstance(chain, list) and len(chain) == 2
    assert [len(g.get("params", [])) for g in chain[1]["optimizer"]["param_groups"]] == [0]
    if source.endswith("distopt"):
        assert _distrib(files["mp_rank_00_000_001"]) == [None, {"buckets_coalesced": True}]
    else:
        assert chain[1]["fp32_from_fp16_params"] == [[]]  # the Float16 optimizer's, though empty
    assert not diff(FIXTURES / "megatron" / source, out, kinds=STATE_KINDS).different
    assert verify(out).failing() == []


@pytest.mark.slow
def test_megatron_lm_loads_experts_with_stages_that_hold_none(tmp_path):
    """Oracle: Megatron-LM's load_checkpoint at PP=4 EP=2 with the layout 'E|t|t|L' loads the MoE
    fixture resharded so: every tensor equals the reference, and it trains the next step."""
    mlm = _megatron_lm()
    if mlm is None:
        pytest.skip("needs megatron-core and a Megatron-LM source (set MEGATRON_LM)")
    out = tmp_path / "pp4"
    reshard(MOE, out, Target(pp=4, pipeline_layout="E|t|t|L"))
    args = ("--tp", "1", "--pp", "4", "--ep", "2", "--layout", "E|t|t|L", "--padded-vocab", "64")
    proc = _oracle(mlm, out, *args, *_ref("legacy_pp2ep2"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "coverage of the 116 reference tensors by the main replicas: OK" in proc.stdout


def test_deepspeed_zero3_needs_the_sub_group_size_it_was_trained_with(tmp_path):
    """DeepSpeed saves the config file's path, not the config, when launched with one: the sub-group
    size is then unknown, and the default does not cut the fixture's groups as its sub-groups are cut,
    so the reshard is refused (not laid out with a guess)."""
    import torch

    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "deepspeed" / "zero3", src)
    for path in (src / "global_step3").glob("*_model_states.pt"):
        model = torch.load(path, weights_only=False)
        model["ds_config"] = "ds_config.json"
        torch.save(model, path)
    with pytest.raises(UsageError, match="gives no sub_group_size"):
        reshard(src, tmp_path / "out", Target(dp=1))
    assert not (tmp_path / "out").exists()


MOE_DISTOPT = FIXTURES / "megatron" / "legacy_pp2ep2_distopt"


def _distrib(path: Path) -> Any:
    archive, obj, _ = _pt.load(path.parent, "distrib_optim.pt", ALLOWLIST)
    archive.close()
    return obj


def test_megatron_experts_with_the_distributed_optimizer(tmp_path):
    """Megatron-LM's MoE checkpoint saved by the distributed optimizer (distrib_optim.pt: the chain's
    dense state in the EP rank 0 files, None in the others, and each EP rank's expert state):
    resharded to its own layout every distrib_optim.pt comes back byte for byte; so it does through
    TP=2 x EP=4 (16 files) and back; at EP=1 one optimizer holds the experts in its one buffer; the
    Float16 MoE fixture converted to the distributed optimizer gets the same chained layout. From
    EP=1 to EP > 1 param groups that megatron-core's standard rule cannot tell apart are refused
    (the files do not say which group each expert is in)."""
    same, wide, back = tmp_path / "same", tmp_path / "tp2ep4", tmp_path / "back"
    reshard(MOE_DISTOPT, same, Target())
    reshard(MOE_DISTOPT, wide, Target(tp=2, pp=1, ep=4))
    reshard(wide, back, Target(tp=1, pp=2, ep=2))
    for name, path in _rank_files(MOE_DISTOPT).items():
        for out in (same, back):
            assert (path.parent / "distrib_optim.pt").read_bytes() == (
                _rank_files(out)[name].parent / "distrib_optim.pt"
            ).read_bytes(), (out.name, name)
        assert _tree(path) == _tree(_rank_files(same)[name]), name
        assert _drop_rng(_tree(path), "args") == _drop_rng(_tree(_rank_files(back)[name]), "args"), name
    states = _distrib(_rank_files(wide)["mp_rank_01_003"])
    assert isinstance(states, list) and states[0] is None
    assert sorted(k for k in states[1] if k != "buckets_coalesced") == [0]

    one = tmp_path / "ep1"
    reshard(MOE_DISTOPT, one, Target(pp=1, ep=1))
    (only,) = _rank_files(one).values()
    state = _distrib(only)
    assert isinstance(state, dict) and isinstance(_optimizer(only), dict)
    (flat,) = state[0].values()
    sizes = [int(np.prod(i.shape)) for n, i in registry.describe(MOE_DISTOPT)[1].items.items() if n.endswith(".fp32")]
    # dense and expert parameters in one buffer, each starting on a multiple of 64 elements
    assert sum(sizes) <= flat["numel_unpadded"] < sum(sizes) + 64 * len(sizes)
    # back to EP > 1 the expert optimizer's groups are found by megatron-core's standard rule
    # (tests/test_reshard_from_dist.py checks the way back); groups it cannot tell apart are refused
    def extra_group(tree: Any) -> None:
        groups = tree["optimizer"]["optimizer"]["param_groups"]
        groups.append({**groups[0], "wd_mult": 0.5})

    custom = rewritten_copy(tmp_path / "custom", one, extra_group)
    why = r"EP=2 from this checkpoint saved at EP=1 by the distributed optimizer .its .*would hold no .*wd_mult=0.5"
    with pytest.raises(UsageError, match=why):
        reshard(custom, tmp_path / "refused", Target(pp=2, ep=2))
    assert not (tmp_path / "refused").exists()

    converted = tmp_path / "converted"
    reshard(MOE, converted, Target(distributed_optimizer=True))
    for name, path in _rank_files(MOE_DISTOPT).items():
        ours, theirs = _distrib(_rank_files(converted)[name]), _distrib(path)
        assert [None if m is None else sorted(map(str, m)) for m in ours] == [
            None if m is None else sorted(map(str, m)) for m in theirs
        ], name
        assert [None if m is None else next(iter(m[0].values()))["numel_unpadded"] for m in ours] == [
            None if m is None else next(iter(m[0].values()))["numel_unpadded"] for m in theirs
        ], name
    for out in (same, wide, back, one, converted):
        assert not diff(MOE_DISTOPT if out != converted else MOE, out, kinds=STATE_KINDS).different, out
        assert verify(out).failing() == []


@pytest.mark.parametrize(("pp", "ep"), [(2, 2), (1, 1), (1, 4)])
def test_megatron_experts_leave_the_distributed_optimizer(pp, ep, tmp_path):
    """--no-distributed-optimizer from the MoE distributed-optimizer fixture: each parameter's
    group by megatron-core's rule (the experts' under EP > 1 the expert optimizer's
    ``is_expert_parallel`` groups). At the source layout the rank files' chained Float16 optimizers
    have the param groups (members included) and state ids that Megatron-LM's own Float16 run of
    the same model saves; every tensor equals the source's; it verifies clean."""
    out = tmp_path / "out"
    reshard(MOE_DISTOPT, out, Target(pp=pp, ep=ep, distributed_optimizer=False))
    assert _rank_files(out) and not _distrib_files(out)
    assert not diff(MOE_DISTOPT, out, kinds=STATE_KINDS).different
    assert verify(out).failing() == []
    if (pp, ep) != (2, 2):
        return

    def shape(opt: Any) -> list[Any]:
        return [
            (
                [{k: v for k, v in g.items() if k != "lr"} for g in m["optimizer"]["param_groups"]],
                {i: sorted(st) for i, st in m["optimizer"]["state"].items()},
                [[tuple(x.shape) for x in group] for group in m["fp32_from_fp16_params"]],
            )
            for m in opt
        ]

    for name, path in _rank_files(MOE).items():
        ours = _optimizer(_rank_files(out)[name])
        assert isinstance(ours, list) and len(ours) == 2, name
        assert shape(ours) == shape(_optimizer(path)), name


@pytest.mark.slow
@pytest.mark.parametrize(
    ("source", "ep"), [("legacy_pp2ep2_distopt", 1), ("legacy_pp2ep2_distopt", 2), ("legacy_pp2ep2", 2)]
)
def test_megatron_lm_loads_the_experts_checkpoint_with_the_distributed_optimizer(source, ep, tmp_path):
    """Oracle: Megatron-LM's load_checkpoint with --use-distributed-optimizer and expert parallelism
    (EP=1: one optimizer, experts in its one grad buffer; EP=2: the chain's dense and expert
    buffers) loads our distrib_optim.pt, resharded from the distributed-optimizer MoE fixture or
    converted from the Float16 one; it scatters each state over the DP ranks and every shard equals
    the reference; it trains the next step."""
    mlm = _megatron_lm()
    if mlm is None:
        pytest.skip("needs megatron-core and a Megatron-LM source (set MEGATRON_LM)")
    out = tmp_path / "out"
    reshard(FIXTURES / "megatron" / source, out, Target(pp=1, ep=ep, distributed_optimizer=True))
    args = ("--tp", "1", "--pp", "1", "--ep", str(ep), "--distopt", "--padded-vocab", "64", *_ref(source))
    proc = _oracle(mlm, out, *args)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "coverage of the 116 reference tensors by the main replicas: OK" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    ("source", "pp", "ep"),
    [(s, 1, ep) for s in ("legacy_pp2ep2", "legacy_pp2ep2_distopt") for ep in (1, 2, 4)],
)
def test_megatron_lm_loads_the_experts_checkpoint(source, pp, ep, tmp_path):
    """Oracle: Megatron-LM's load_checkpoint with expert parallelism (EP=1: one optimizer; EP=2 at
    PP=1: rank files mp_rank_00_<ep>, told from PP ranks by args only; EP=4: one expert per rank)
    loads our output (from the Float16 MoE fixture, or from the distributed-optimizer one with
    --no-distributed-optimizer); every tensor each rank holds equals the reference at the expert's global
    number; the main replicas cover it exactly once; it trains the next step."""
    mlm = _megatron_lm()
    if mlm is None:
        pytest.skip("needs megatron-core and a Megatron-LM source (set MEGATRON_LM)")
    out = tmp_path / "out"
    # from the distributed-optimizer run: --no-distributed-optimizer
    reshard(FIXTURES / "megatron" / source, out, Target(pp=pp, ep=ep, distributed_optimizer=False))
    # DP = EP ranks; at DP=4 the global batch of 4 takes micro-batches of 1
    env = dict(os.environ, CKPTTOOL_MEGATRON_EXTRA="--micro-batch-size 1" if ep == 4 else "")
    args = ("--tp", "1", "--pp", str(pp), "--ep", str(ep), "--padded-vocab", "64", *_ref(source))
    proc = _oracle(mlm, out, *args, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "coverage of the 116 reference tensors by the main replicas: OK" in proc.stdout


def _with_adapter(tree: Any) -> None:
    """Each rank's own part of a parameter no megatron-core rule knows (its linear_proj part,
    split along dim 0 by a user's module), frozen: no optimizer state."""
    model = tree["model"]
    for local in [k for k in model if k.endswith("self_attention.linear_proj.weight")]:
        model[local.replace("linear_proj", "adapter")] = model[local]


def test_a_split_rule_joins_the_sources_parts_and_travels_with_the_output(tmp_path):
    """--split-rule cut the output only: a TP=2 source's parts were read as copies of the whole, so
    TP 2 -> 1 kept rank 0's half (exit 0, sealed) and a TP=2 output the rule had cut failed verify
    (replica-mismatch). The rule now places the source's parts too, and the output keeps it (as
    parameter names, in its first rank file) so that it verifies, and reshards back exactly with
    no --split-rule."""
    import torch

    from ckpttool.formats.megatron import SPLIT_RULES

    src = rewritten_copy(tmp_path / "src", LEGACY, _with_adapter)
    one, back = tmp_path / "tp1", tmp_path / "tp2"
    reshard(src, one, Target(tp=1, split_rules=parse_split_rules([r"adapter\.weight$=0"])))
    reshard(one, back, Target(tp=2))  # (the rule read from tp1's first rank file)
    name = "decoder.layers.0.self_attention.adapter.weight"
    parts = [load_pt(src / f"iter_0000003/mp_rank_0{t}_000/model_optim_rng.pt")["model"][name] for t in (0, 1)]
    whole = load_pt(one / "iter_0000003/mp_rank_00_000/model_optim_rng.pt")
    assert torch.equal(whole["model"][name], torch.cat(parts))
    assert whole[SPLIT_RULES][name] == 0 and len(whole[SPLIT_RULES]) == 4  # (every layer's, both stages)
    for t in (0, 1):
        again = load_pt(back / f"iter_0000003/mp_rank_0{t}_000/model_optim_rng.pt")["model"][name]
        assert torch.equal(again, parts[t])
    for out in (one, back):
        report = verify(out)
        assert not [f for f in report.findings if f.severity == "error"], [f.message for f in report.findings]
    assert registry.describe(back)[1].items[name].shape == (2 * parts[0].shape[0], parts[0].shape[1])
    # every moment stays its parameter's: the frozen adapter (of linear_proj's shape) is written
    # after the trained parameters, so that reading by position and shape gives it none
    from ckpttool.formats.megatron import user_split_rules

    with user_split_rules(parse_split_rules([r"adapter\.weight$=0"])):
        source = registry.describe(src)[1]
    for out in (one, back):
        written = registry.describe(out)[1]
        moments = {n for n, i in written.items.items() if i.kind == "optim" and i.is_tensor}
        assert moments == {n for n, i in source.items.items() if i.kind == "optim" and i.is_tensor}
        assert not any("adapter" in n for n in moments)


def test_a_frozen_parameter_is_refused_for_a_legacy_distributed_optimizer_before_writing(tmp_path):
    """A parameter without optimizer state stays out of megatron-core's grad buffers, as the writer
    had it, but ckpttool's reader replays buffers holding every parameter: the run failed only at
    its seal (exit 3, blaming its own output) and with --no-seal published what verify called
    damaged; the dry run said nothing. Both now refuse first (exit 2), naming a parameter."""
    src = rewritten_copy(tmp_path / "src", LEGACY, _with_adapter)
    out = tmp_path / "out"
    target = Target(tp=1, split_rules=parse_split_rules([r"adapter\.weight$=0"]), distributed_optimizer=True)
    with pytest.raises(UsageError, match=r"no optimizer state \(frozen\), such as decoder\.layers\.0\.self_attention\.adapter"):
        reshard(src, out, target, seal_output=False)
    assert not out.exists()


@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize("made", ["a folder with a file", "an empty folder", "a file"])
def test_an_output_that_appears_during_the_run_is_never_replaced(made, force, tmp_path):
    """-o was checked for existence at the start only: a directory made there while the run wrote
    (another run's output, a user's files) was moved aside and deleted at publication, without
    --force, and the run exited 0. Whatever was not there when the output was staged is now left as
    it is (even with --force, which replaces what stood there at the start), and nothing is
    written."""
    out = tmp_path / "out"

    def make() -> None:
        if made == "a file":
            out.write_text("precious\n")
        else:
            out.mkdir()
            if made == "a folder with a file":
                (out / "precious.txt").write_text("precious\n")

    progress = OnFirstProgress(make)
    before = tree_digests(FIXTURES / "dcp" / "fsdp2")
    with pytest.raises(UsageError, match="appeared while the output was being written"):
        reshard(FIXTURES / "dcp" / "fsdp2", out, Target(dp=2), force=force, progress=progress)
    assert progress.ran, "the run never reported progress"
    if made == "a file":
        assert out.read_text() == "precious\n"
    else:
        assert sorted(p.name for p in out.iterdir()) == (["precious.txt"] if made == "a folder with a file" else [])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # (no staged directory left beside it)
    assert tree_digests(FIXTURES / "dcp" / "fsdp2") == before


@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize("command", ["reshard", "convert --to dcp", "convert --to safetensors", "export"])
def test_an_output_that_appears_before_writing_starts_is_never_replaced(command, force, tmp_path, monkeypatch):
    """-o absent when checked, made while the run planned (hashing a sealed source takes seconds on
    a large one): it was taken for an output --force had cleared, moved aside and deleted, exit 0,
    with or without --force; export replaced a file made there. Now it is kept and nothing is
    written."""
    import ckpttool.convert
    import ckpttool.reshard
    from ckpttool.convert import convert
    from ckpttool.export import export

    one_file = command == "export"
    out = tmp_path / ("out.safetensors" if one_file else "out")

    def make(real: Any) -> Any:
        def planned(*args: Any, **kwargs: Any) -> Any:
            if os.path.lexists(out):  # (the first of the checks planning runs made it)
                pass
            elif one_file:
                out.write_text("precious\n")
            else:
                out.mkdir()
                (out / "precious.txt").write_text("precious\n")
            return real(*args, **kwargs)

        return planned

    # (export checks the sealed source, and the two-embeddings refusal only where it writes embeddings)
    for module, name in (
        (ckpttool.reshard, "refuse_changed_since_sealed"),
        (ckpttool.convert, "refuse_changed_since_sealed"),
        (ckpttool.convert, "refuse_copies_apart"),
    ):
        monkeypatch.setattr(module, name, make(getattr(module, name)))
    src = FIXTURES / "dcp" / "fsdp2"
    with pytest.raises(UsageError, match="appeared while the output was being written"):
        if command == "reshard":
            reshard(src, out, Target(dp=2), force=force)
        elif command == "export":
            export(src, out, force=force)
        else:
            convert(src, out, to=command.rsplit(" ", 1)[1], force=force)
    assert (out.read_text() if one_file else (out / "precious.txt").read_text()) == "precious\n"
    assert one_file or sorted(p.name for p in out.iterdir()) == ["precious.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]  # (no staged output left beside it)


@pytest.mark.parametrize(
    "command",
    [
        ["reshard", "{src}", "-o", "{out}", "--to", "dcp", "--dp", "2"],
        ["convert", "{src}", "-o", "{out}", "--to", "dcp"],
        ["convert", "{src}", "-o", "{out}", "--to", "safetensors"],
        ["convert", "{src}", "-o", "{out}", "--to", "torch"],
        ["export", "{src}", "-o", "{out}.safetensors"],
    ],
    ids=lambda c: "-".join(c[:1] + c[4:6]),
)
def test_a_parameter_no_rule_splits_is_refused_for_every_output_or_joined_by_a_rule(command, tmp_path):
    """A legacy TP=2 source with a parameter no megatron-core rule knows: a Megatron output refused
    it, but --to dcp, safetensors, torch and export read its two TP parts as copies and kept rank
    0's half (exit 0, sealed), and could not be given the rule. They refuse it now, and a
    --split-rule joins the parts, as for a Megatron output."""
    from tests.conftest import run_cli

    src = rewritten_copy(tmp_path / "src", LEGACY, _with_adapter)
    before = tree_digests(src)
    out = tmp_path / "out"
    argv = [a.format(src=src, out=out) for a in command]
    r = run_cli(*argv)
    assert r.code == 2, (r.code, r.stdout, r.stderr)
    assert "no tensor-parallel split rule for 4 parameters" in r.stderr and "adapter.weight" in r.stderr, r.stderr
    assert "--split-rule" in r.stderr and "Traceback" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    r = run_cli(*argv, "--split-rule", r"adapter\.weight$=0")
    assert r.code == 0, r.stderr
    written = Path(argv[argv.index("-o") + 1])
    name = "decoder.layers.0.self_attention.adapter.weight"
    parts = [load_pt(src / f"iter_0000003/mp_rank_0{t}_000/model_optim_rng.pt")["model"][name] for t in (0, 1)]
    assert registry.describe(written)[1].items[name].shape == (2 * parts[0].shape[0], parts[0].shape[1])
    assert tree_digests(src) == before
    # a pattern for a parameter megatron-core splits itself is refused here too, named once
    again = [a.format(src=src, out=tmp_path / "again") for a in command]
    r = run_cli(*again, "--split-rule", r"adapter\.weight$=0", "--split-rule", "layers.0.input_layernorm=none")
    assert r.code == 2 and r.stderr.count("'layers.0.input_layernorm=none'") == 1, r.stderr
    assert "whose tensor-parallel split megatron-core fixes" in r.stderr and not (tmp_path / "again").exists()


def test_a_split_rule_pattern_is_judged_once_as_given(tmp_path):
    """A pattern matching parameters megatron-core splits itself was refused again for each name it
    matched (the reader's record of it, turned into exact-name rules): '.*=none' said so 28 times."""
    from tests.conftest import run_cli as run_cli_here

    r = run_cli_here("reshard", LEGACY, "-o", tmp_path / "out", "--split-rule", ".*=none")
    assert r.code == 2 and r.stderr.count("--split-rule '") == 1, r.stderr
    assert "--split-rule '.*=none' matches 27 parameters whose tensor-parallel split megatron-core fixes" in r.stderr
    # and a rule for a source that records its own splits is refused by every command that takes one
    for argv in (("convert", FIXTURES / "dcp" / "fsdp2", "-o", tmp_path / "c"), ("export", FIXTURES / "dcp" / "fsdp2", "-o", tmp_path / "e.safetensors")):
        r = run_cli_here(*argv, "--split-rule", "w=0")
        assert r.code == 2 and "--split-rule applies to Megatron checkpoints" in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("src", "sizes", "shared"), [
    ("legacy_pp2vpp2", ["--tp", "2"], "2 new rank(s) ([tp=1,pp=0], [tp=1,pp=1])"),
    ("legacy_tp2pp2", ["--tp", "1"], None),  # fewer ranks: each its own
    ("legacy_tp2pp2", ["--pp", "4"], None),  # (PP seeds are per stage; no TP rank added)
])  # fmt: skip
def test_new_tp_ranks_are_told_their_rng_streams_are_copies(src, sizes, shared, tmp_path):
    """A rank TP adds gets the state of source rank t mod TP: its model-parallel stream is a copy
    of another rank's, so dropout in tensor-parallel regions draws the same masks. The plan said
    only 'rank (t, p) gets source rank (t mod 1, p mod 2)'s'; it now says what that means, and how
    Megatron reseeds."""
    r = run_cli("reshard", FIXTURES / "megatron" / src, "-o", tmp_path / "o", *sizes, "--dry-run", "--json")
    notes = " ".join(json.loads(r.stdout)["notes"])
    assert r.code == 0
    if shared is None:
        assert "RNG streams" not in notes
    else:
        assert f"RNG streams: {shared} get the state of a source rank that another output rank gets too" in notes
        assert "resume with --no-load-rng" in notes


_ORPHAN = """
import os, signal, time
from ckpttool import reshard
parent = os.getpid()
pid = os.fork()
if pid == 0:
    null = os.open(os.devnull, os.O_WRONLY)  # (the test reads the parent's output to its end: not held open)
    os.dup2(null, 1)
    os.dup2(null, 2)
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT, signal.SIGTERM])  # (as the pool's workers)
    reshard._init_worker(lambda: None, (), None, None, "cpu", parent)  # (what the pool runs first in each)
    time.sleep(30)
    os._exit(0)
print(pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # (a zombie no one reaps has ended)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_a_worker_ends_when_the_reshard_that_started_it_is_killed():
    """A reshard killed with SIGKILL left its --workers processes for ever (reparented, waiting on
    the pool's pipes, SIGINT and SIGTERM blocked): each watches the process that started it."""
    import time

    r = subprocess.run([sys.executable, "-c", _ORPHAN], capture_output=True, text=True, timeout=60)
    worker = int(r.stdout.split()[0])
    deadline = time.monotonic() + 10
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(worker)


def test_the_pool_tells_each_worker_which_process_started_it(tmp_path, monkeypatch):
    """The --workers pool starts each worker with _init_worker and this process's pid (what the
    worker watches)."""
    from ckpttool import reshard as rs

    started: dict[str, Any] = {}

    class Pool:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            started.update(kwargs)
            raise KeyboardInterrupt  # (nothing to run: the reshard stops here, and publishes nothing)

    monkeypatch.setattr(rs, "ProcessPoolExecutor", Pool)
    with pytest.raises(KeyboardInterrupt):
        reshard(FIXTURES / "dcp" / "fsdp2", tmp_path / "out", Target(dp=2), workers=2)
    assert started["initializer"] is rs._init_worker and started["initargs"][-1] == os.getpid()
    assert not (tmp_path / "out").exists()


def _args_of(root: Path) -> dict[str, Any]:
    first = sorted(root.glob("iter_*/mp_rank_*/model_optim_rng.pt"))[0]
    archive, obj, _ = _pt.load(first.parent, first.name, ALLOWLIST)
    archive.close()
    return dict(vars(obj["args"]))


def test_repadding_after_a_kept_padding_uses_the_run_s_own_divisor(tmp_path):
    """TP=2 -> 1 (padding kept: 128 rows, args' divisor 128, the run's 64 beside it) -> TP=2 with
    --vocab-padding megatron re-padded with ckpttool's 128: 256 rows, which Megatron-LM's load at TP=2
    refused (size mismatch). It re-pads with the run's own 64: the original rows, and the original's
    rank files bit for bit (args included)."""
    one, back = tmp_path / "tp1", tmp_path / "back"
    assert run_cli("reshard", LEGACY, "-o", one, "--tp", "1", "--pp", "1").code == 0
    r = run_cli("reshard", one, "-o", back, "--tp", "2", "--pp", "2", "--vocab-padding", "megatron")
    assert r.code == 0, r.stderr
    assert "stays padded" not in r.stderr  # (the run's own divisor: nothing to pass when resuming)
    ranks = sorted(p.relative_to(LEGACY) for p in LEGACY.glob("iter_*/mp_rank_*/model_optim_rng.pt"))
    assert len(ranks) == 4 and sorted(p.relative_to(back) for p in back.glob("iter_*/mp_rank_*/*.pt")) == ranks
    for rel in ranks:
        assert _tree(back / rel) == _tree(LEGACY / rel), rel
    r = run_cli("reshard", one, "-o", tmp_path / "tp1again", "--tp", "1", "--vocab-padding", "megatron")
    assert r.code == 0 and _args_of(tmp_path / "tp1again")["padded_vocab_size"] == 64, r.stderr


def test_kept_padding_without_a_recorded_vocabulary_records_a_divisor_that_gives_the_rows(tmp_path):
    """Megatron-LM records args.vocab_size only for its null and tiktoken tokenizers (a GPT-2 BPE run
    saves None): a reshard to TP=1 kept the 128 rows and the run's divisor 64, with which Megatron pads
    any vocabulary up to 64 rows to 64 at TP=1 (and checks padded_vocab_size against args: no resume).
    It now records 128 (rows / TP), says so, and names no --vocab-padding megatron, which needs the size."""
    src = rewritten_copy(
        tmp_path / "src", LEGACY, lambda t: t["args"].__dict__.update(vocab_size=None, tokenizer_type="GPT2BPETokenizer")
    )
    out = tmp_path / "tp1"
    r = run_cli("reshard", src, "-o", out, "--tp", "1")
    assert r.code == 0, r.stderr
    args = _args_of(out)
    assert (args["padded_vocab_size"], args["make_vocab_size_divisible_by"]) == (128, 128), args
    assert "resume with --make-vocab-size-divisible-by 128 (recorded in args)" in r.stderr, r.stderr
    assert "--vocab-padding megatron" not in r.stderr
    r = run_cli("reshard", src, "-o", tmp_path / "re", "--tp", "1", "--vocab-padding", "megatron")
    assert_clean(r, 2, "needs args.vocab_size")


def test_given_end_stages_or_a_layout_replace_a_source_s_counted_embedding_and_loss(tmp_path):
    """A source split with --account-for-embedding/loss-in-pipeline-split (PP=3, 4 layers: [0] [1-2]
    [3]): --pp 4 --pp-first-layers 1 was refused (it "cannot be combined with counting the embedding
    or loss", and no flag cleared them), and --pipeline-layout was written with both in args, which
    megatron-core's TransformerConfig refuses. Given ends or a layout now replace the counting: the
    output's args drop it, and the note says to resume without those flags."""
    ends = tmp_path / "ends"
    assert run_cli("reshard", LEGACY, "-o", ends, "--pp", "3", "--pp-first-layers", "1", "--pp-last-layers", "1").code == 0
    flags = ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
    src = rewritten_copy(
        tmp_path / "src",
        ends,
        lambda t: t["args"].__dict__.update(
            decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None, **dict.fromkeys(flags, True)
        ),
    )
    r = run_cli("reshard", src, "-o", tmp_path / "even", "--pp", "4")  # (6 counted layers: no even split)
    assert_clean(r, 2, "PP=4 does not divide the 6 layers (the embedding and loss counted as layers)")
    for how in (("--pp-first-layers", "1"), ("--pipeline-layout", "Et|t|t|tL")):
        out = tmp_path / how[0].strip("-")
        r = run_cli("reshard", src, "-o", out, "--pp", "4", *how)
        assert r.code == 0, r.stderr
        args = _args_of(out)
        assert not any(args[f] for f in flags), args
        assert "and without --account-for-embedding-in-pipeline-split or --account-for-loss-in-pipeline-split" in r.stderr
        back = tmp_path / f"{out.name}-back"
        assert run_cli("reshard", out, "-o", back, "--pp", "1").code == 0
        assert not diff(src, back).different


def test_chunks_the_user_never_asked_for_are_said_to_be_the_source_s(tmp_path):
    """--pp-first-layers 1 on a source with two model chunks a stage was refused with "the 1 layers
    of pipeline stage 0 do not split into VPP=2 model chunks", though no --vpp was given: the hint
    now says the VPP is the source's and that --vpp 1 gives one chunk a stage (which then works)."""
    src = FIXTURES / "megatron" / "legacy_pp2layout"
    r = run_cli("reshard", src, "-o", tmp_path / "a", "--pp-first-layers", "1")
    assert_clean(r, 2, "do not split into VPP=2 model chunks", "VPP=2 is the source's, kept as no --vpp was given: --vpp 1")
    assert run_cli("reshard", src, "-o", tmp_path / "b", "--pp-first-layers", "1", "--vpp", "1").code == 0


def test_a_round_trip_through_a_tp_the_vocab_divisor_cannot_give_restores_it(tmp_path):
    """TP=1 -> 2 -> 1 from a run whose make_vocab_size_divisible_by (64) gives its 64 padded rows
    at TP=1 but not at TP=2: the reshard to TP=2 records 32 (what gives them there), and the one back
    kept 32, so the args were not the run's own. The run's divisor is recorded beside it and restored."""
    src = FIXTURES / "megatron" / "legacy_pp2ep2"
    there, back = tmp_path / "tp2", tmp_path / "tp1"
    assert run_cli("reshard", src, "-o", there, "--tp", "2").code == 0
    assert run_cli("reshard", there, "-o", back, "--tp", "1").code == 0
    mid, first, last = _args_of(there), _args_of(src), _args_of(back)
    assert (mid["make_vocab_size_divisible_by"], mid["ckpttool_make_vocab_size_divisible_by"]) == (32, 64)
    assert last["make_vocab_size_divisible_by"] == first["make_vocab_size_divisible_by"] == 64
    assert "ckpttool_make_vocab_size_divisible_by" not in last
