"""reshard / convert from Megatron ``torch_dist`` to the legacy layout (``--to megatron``): the files
Megatron-LM's own legacy save of the same training state writes, and Megatron-LM's
``load_checkpoint`` as the oracle at new layouts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ckpttool import registry
from ckpttool.diff import diff
from ckpttool.errors import UsageError
from ckpttool.reshard import Target, reshard
from ckpttool.verify import verify
from tests.conftest import FIXTURES, load_pt, rewritten_copy
from tests.test_reshard import STATE_KINDS, _megatron_lm, _oracle, _rank_files, _ref, _tree

MEGATRON = FIXTURES / "megatron"


_RUN_ARGS = ("save", "dist_ckpt_optim_fully_reshardable")
"""args that differ between two saves of one state: the folder, the torch_dist layout asked for"""


def _blind(tree: Any) -> Any:
    """A :func:`_tree` without the modules' ``_metadata`` (torch_dist keeps none) and the args of
    :data:`_RUN_ARGS`."""
    if isinstance(tree, tuple) and len(tree) == 3 and tree[0] == "dict":
        return ("dict", [(k, _blind(v)) for k, v in tree[1] if k not in _RUN_ARGS], None)
    if isinstance(tree, tuple) and len(tree) == 2 and isinstance(tree[1], list):
        return (tree[0], [_blind(v) for v in tree[1]])
    if isinstance(tree, tuple) and len(tree) == 2 and isinstance(tree[1], tuple):
        return (tree[0], _blind(tree[1]))
    return tree


def _same_files(ours: Path, theirs: Path) -> None:
    """Every rank file of ``ours`` holds ``theirs``' tree (model, optimizer, RNG, scheduler, args),
    and every ``distrib_optim.pt`` is theirs byte for byte."""
    a, b = _rank_files(ours), _rank_files(theirs)
    assert list(a) == list(b)
    for name in b:
        assert _blind(_tree(a[name])) == _blind(_tree(b[name])), name
    distrib = sorted(p.relative_to(theirs) for p in theirs.glob("iter_*/*/distrib_optim.pt"))
    assert distrib == sorted(p.relative_to(ours) for p in ours.glob("iter_*/*/distrib_optim.pt"))
    for rel in distrib:
        assert (ours / rel).read_bytes() == (theirs / rel).read_bytes(), rel


@pytest.mark.parametrize(
    ("source", "theirs"),
    [
        ("dist_tp2pp2", "legacy_tp2pp2"),
        ("dist_pp2vpp2", "legacy_pp2vpp2"),
        ("dist_tp2ep2etp1", "legacy_tp2ep2etp1"),
        ("dist_pp2ep2_distopt", "legacy_pp2ep2_distopt"),
        ("dist_pp2ep2_distopt_fr", "legacy_pp2ep2_distopt"),
    ],
)
def test_is_what_megatron_lm_saves(source, theirs, tmp_path):
    """torch_dist -> legacy at the same layout: Megatron-LM's own legacy save of the same training
    state (one run saved both, or two runs of the same seeds): every rank file's model entries in
    Megatron's module order, ``_extra_state``, optimizer (Float16 ids and fp32 copies, the MoE
    chain; the distributed optimizer's distrib_optim.pt byte for byte, from dp_reshardable and from
    fully_reshardable), RNG, scheduler and args; only the modules' ``_metadata`` is left out."""
    out = tmp_path / "out"
    result = reshard(MEGATRON / source, out, Target(to="megatron"))
    assert result.plan.format == "megatron"
    assert any("written from a torch_dist checkpoint" in n for n in result.plan.notes)
    _same_files(out, MEGATRON / theirs)
    for path in _rank_files(out).values():
        tree = load_pt(path)
        assert tree["args"].ckpt_format == "torch" and tree["args"].use_dist_ckpt is False
        assert not hasattr(tree.get("model", tree.get("model0")), "_metadata")
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert not diff(MEGATRON / theirs, out).different
    across = diff(MEGATRON / source, out)  # torch_dist keeps its RNG in opaque records: listed, not compared
    assert not across.different and across.compared == across.identical > 0
    assert across.opaque and all(n.startswith("rng_state.") for n in across.opaque)
    report = verify(out)
    assert report.failing() == [] and report.seal is not None


@pytest.mark.parametrize(
    ("source", "theirs", "target"),
    [
        ("dist_tp2pp2", "legacy_tp2pp2", Target(to="megatron", tp=1, pp=1)),
        ("dist_tp2pp2", "legacy_tp2pp2", Target(to="megatron", tp=1, pp=4, distributed_optimizer=True)),
        ("dist_pp2vpp2", "legacy_pp2vpp2", Target(to="megatron", pp=1)),
        ("dist_pp2ep2_distopt", "legacy_pp2ep2_distopt", Target(to="megatron", pp=1, ep=1)),
        ("dist_pp2ep2_distopt_fr", "legacy_pp2ep2_distopt", Target(to="megatron", ep=2, distributed_optimizer=False)),
    ],
    ids=["tp1pp1", "tp1pp4-distopt", "vpp-pp1", "moe-distopt-ep1", "moe-float16"],
)
def test_new_layouts_are_the_legacy_run_resharded(source, theirs, target, tmp_path):
    """torch_dist -> legacy at a new layout (and optimizer) holds what ckpttool writes from
    Megatron-LM's legacy save of the same state: the module order, the param groups inferred by
    megatron-core's rule and the grad-buffer layouts all agree."""
    ours, legacy = tmp_path / "ours", tmp_path / "legacy"
    reshard(MEGATRON / source, ours, target)
    reshard(MEGATRON / theirs, legacy, target)
    _same_files(ours, legacy)
    assert not diff(MEGATRON / source, ours, kinds=STATE_KINDS).different


def test_module_order_is_megatron_s():
    """The module order the torch_dist source is given is the order of every legacy rank file
    Megatron-LM saved (dense, MoE with SequentialMLP experts, virtual stages, pipeline layouts)."""
    from ckpttool.formats.megatron_write import load_source, module_order

    for root in sorted(p for p in MEGATRON.glob("legacy_*") if p.is_dir()):
        _, m = registry.describe(root)
        order = load_source(Path(m.root), m).model_order
        assert module_order(list(reversed(order))) == order, root.name


def test_an_unknown_module_is_refused(monkeypatch, tmp_path):
    """A module whose place in megatron-core's order ckpttool does not know is named and refused
    before anything is written: a guessed order would give one parameter's optimizer state to
    another of the same shape."""
    from ckpttool.formats import megatron_write

    order = {k: v for k, v in megatron_write._CHILD_ORDER.items() if k != "router"}
    monkeypatch.setattr(megatron_write, "_CHILD_ORDER", order)
    out = tmp_path / "out"
    with pytest.raises(UsageError, match=r"decoder\.layers\.0\.mlp\.router\.weight: .* module 'router'"):
        reshard(MEGATRON / "dist_pp2ep2", out, Target(to="megatron"))
    assert not out.exists()


def test_an_unknown_record_is_refused(monkeypatch, tmp_path):
    """A torch_dist ShardedObject with no place in a legacy rank file is named, never dropped."""
    from ckpttool.formats import megatron_dist_write

    monkeypatch.setattr(megatron_dist_write, "_legacy_object_name", lambda name, local_spec: None)
    out = tmp_path / "out"
    with pytest.raises(
        UsageError, match=r"no rule to place 16 torch_dist records .*linear_proj._extra_state/shard_0_4"
    ):
        reshard(MEGATRON / "dist_tp2", out, Target(to="megatron"))
    assert not out.exists()


def test_experts_join_an_expert_optimizer_from_a_save_at_ep1(tmp_path):
    """A save at EP=1 whose param groups name no members (legacy distrib_optim.pt, or torch_dist)
    going to EP > 1: the groups that hold routed experts are found by megatron-core's standard rule,
    and the expert optimizer of the chain gets copies of them. Megatron-LM's legacy save of the
    PP=2 x EP=2 distributed-optimizer run, through EP=1 (legacy, and torch_dist from the run's own
    dp_reshardable save) and back to PP=2 x EP=2, is that save again: every rank file's tree (RNG
    aside: EP=1 keeps one EP rank's), distrib_optim.pt byte for byte; likewise the Float16 MoE + MTP
    run's torch_dist save through EP=1 gives its legacy save's model entries and optimizer. With
    --no-distributed-optimizer the way through EP=1 gives what the direct reshard gives."""
    theirs = MEGATRON / "legacy_pp2ep2_distopt"
    legacy, dist = tmp_path / "legacy1", tmp_path / "dist1"
    reshard(theirs, legacy, Target(pp=1, ep=1))
    reshard(MEGATRON / "dist_pp2ep2_distopt", dist, Target(pp=1, ep=1))
    for one in (legacy, dist):
        back = tmp_path / f"{one.name}-back"
        reshard(one, back, Target(to="megatron", pp=2, ep=2))
        a, b = _rank_files(back), _rank_files(theirs)
        assert list(a) == list(b)
        for name in b:
            ours, megatron = dict(_blind(_tree(a[name]))[1]), dict(_blind(_tree(b[name]))[1])
            if one == dist:  # (torch_dist keeps no module _metadata; its args say torch_dist)
                ours, megatron = {k: ours[k] for k in ("model", "optimizer")}, {
                    k: megatron[k] for k in ("model", "optimizer")
                }
                ours["model"], megatron["model"] = ours["model"][1], megatron["model"][1]
            ours.pop("rng_state", None)
            megatron.pop("rng_state", None)
            assert ours == megatron, name
        for f in theirs.glob("iter_*/*/distrib_optim.pt"):
            assert (back / f.relative_to(theirs)).read_bytes() == f.read_bytes(), f
    # the Float16 optimizer's torch_dist save of the TP=2 x EP=2 MoE + MTP run, through EP=1: its
    # legacy save's model entries and optimizer (the chain's two members, each group's parameters)
    mtp, mtp_back = tmp_path / "mtp1", tmp_path / "mtp-back"
    reshard(MEGATRON / "dist_tp2ep2_mtp", mtp, Target(ep=1))
    reshard(mtp, mtp_back, Target(to="megatron", ep=2))
    a, b = _rank_files(mtp_back), _rank_files(MEGATRON / "legacy_tp2ep2_mtp")
    assert list(a) == list(b)
    for name in b:
        ours, megatron = dict(_tree(a[name])[1]), dict(_tree(b[name])[1])
        assert ours["model"][1] == megatron["model"][1] and ours["optimizer"] == megatron["optimizer"], name
    float16, direct = tmp_path / "float16", tmp_path / "direct"
    reshard(legacy, float16, Target(pp=2, ep=2, distributed_optimizer=False))
    reshard(theirs, direct, Target(distributed_optimizer=False))
    for name, path in _rank_files(direct).items():
        ours, again = dict(_tree(_rank_files(float16)[name])[1]), dict(_tree(path)[1])
        assert ours["optimizer"] == again["optimizer"] and ours["model"] == again["model"], name


def test_refusals_say_what_torch_dist_lacks(tmp_path):
    """Edge-case common.pt files (rewritten copies): a run with --decoupled-lr (whose param groups
    the standard rule cannot tell apart) is refused for the Float16 layout with the ways that do
    work; without saved optimizer state the model and the rest are written, and
    --distributed-optimizer is refused."""
    decoupled = rewritten_copy(
        tmp_path / "decoupled",
        MEGATRON / "dist_tp2",
        lambda obj: obj["args"].__dict__.update(decoupled_lr=1e-3),
        "iter_*/common.pt",
    )
    out = tmp_path / "out"
    with pytest.raises(UsageError, match=r"--to megatron from this torch_dist checkpoint .*--decoupled-lr") as err:
        reshard(decoupled, out, Target(to="megatron"))
    assert "--distributed-optimizer" in str(err.value.hint) and not out.exists()

    def drop(obj: Any) -> None:
        del obj["optimizer"]

    bare = rewritten_copy(tmp_path / "bare", MEGATRON / "dist_tp2", drop, "iter_*/common.pt")
    with pytest.raises(UsageError, match="the source has no optimizer state"):
        reshard(bare, out, Target(to="megatron", distributed_optimizer=True))
    assert not out.exists()
    reshard(bare, out, Target(to="megatron", tp=1))
    tree = load_pt(next(out.glob("iter_*/mp_rank_00/model_optim_rng.pt")))
    assert "optimizer" not in tree and "rng_state" in tree
    assert not diff(MEGATRON / "dist_tp2", out, kinds=["param"]).different


def test_convert_to_megatron_on_the_command_line(tmp_path, cli):
    out = tmp_path / "legacy"
    r = cli("convert", MEGATRON / "dist_tp2", "-o", out, "--to", "megatron")
    assert r.code == 0, r.stderr
    _, m = registry.describe(out)
    assert m.format == "megatron" and (m.layout.tp, m.layout.pp) == (2, 1)
    assert not diff(MEGATRON / "dist_tp2", out, kinds=STATE_KINDS).different
    r = cli("diff", MEGATRON / "dist_tp2", out)
    assert r.code == 0 and "RNG not compared (10 tensors)" in r.stdout, r.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    ("source", "tp", "pp", "distopt"),
    [("dist_tp2pp2", 1, 1, False), ("dist_tp2pp2dp2_distopt", 1, 1, True), ("dist_tp2pp2dp2_distopt", 2, 1, False)],
    ids=["float16", "distopt", "distopt-to-float16"],
)
def test_megatron_lm_loads_the_legacy_output(source, tp, pp, distopt, tmp_path):
    """Oracle: Megatron-LM's own load_checkpoint (optimizer and RNG on; with
    --use-distributed-optimizer when the output keeps it) loads our legacy files written from
    torch_dist at a new TP/PP; every tensor equals the run's reference; it trains the next step."""
    mlm = _megatron_lm()
    if mlm is None:
        pytest.skip("needs megatron-core and a Megatron-LM source (set MEGATRON_LM)")
    out = tmp_path / "out"
    reshard(MEGATRON / source, out, Target(to="megatron", tp=tp, pp=pp, distributed_optimizer=distopt))
    flags = ["--distopt"] if distopt else []
    proc = _oracle(mlm, out, "--tp", str(tp), "--pp", str(pp), *flags, *_ref(source))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
