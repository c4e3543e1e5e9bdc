"""DeepSpeed 0.19.8 checkpoints made on CPU with the real library, against DeepSpeed's own tools.

References (fixtures/deepspeed/<name>.reference.pt): ``fp32.*`` from zero_to_fp32 where it runs
(zero1, zero2, zero2_bf16, zero3; otherwise the engine's live master weights), ``exp_avg*.*`` from
ds_to_universal where it runs (otherwise the live optimizer), ``module.*`` the engine's module.
"""

from __future__ import annotations

import shutil
from functools import partial
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ckpttool import registry
from ckpttool.diff import diff
from ckpttool.export import export
from tests._compare import same_bits
from tests.conftest import AUTOTP_METADATA, FIXTURES, autotp_copy, rewritten_copy, run_cli

DS = FIXTURES / "deepspeed"
MODEL_STATES = "global_step3/mp_rank_*_model_states.pt"
ALL = [
    "zero0", "zero1", "zero2", "zero2_bf16", "zero3", "bf16_zero0", "bf16_optimizer", "pipeline", "pipeline_tied", "tp2", "tp2_glu",
    "autotp", "pipeline_bf16", "zero2_elastic",
]
ZERO_TO_FP32 = ["zero1", "zero2", "zero2_bf16", "zero3", "zero2_elastic"]


def _ref(name: str, prefix: str) -> dict[str, torch.Tensor]:
    ref = torch.load(DS / f"{name}.reference.pt", weights_only=True)
    return {k[len(prefix) :]: v for k, v in ref.items() if k.startswith(prefix)}


def _export(name: str, kind: str, tmp_path) -> dict[str, torch.Tensor]:
    return _export_path(DS / name, kind, tmp_path)


def _export_path(path, kind: str, tmp_path) -> dict[str, torch.Tensor]:
    out = tmp_path / f"{path.name}-{kind}.safetensors"
    export(path, out, kind=kind)
    return load_file(out)


@pytest.mark.parametrize("name", ALL)
def test_master_weights(name, tmp_path):
    got = _export(name, "master", tmp_path)
    want = _ref(name, "fp32.")
    assert want
    bad = [k for k in want if k not in got or not same_bits(got[k], want[k])]
    assert bad == []
    extra = set(got) - set(want)
    if name == "zero1":  # zero_to_fp32 drops frozen params at ZeRO-1; ckpttool keeps them
        assert extra == {"frozen.weight", "frozen.bias"}
    elif name in ZERO_TO_FP32:
        assert extra == set()
    elif name in ("pipeline", "pipeline_tied", "pipeline_bf16", "tp2", "tp2_glu", "autotp"):  # no buffers in their models
        assert extra == set()
    else:  # references from the live optimizer hold no buffers; the export completes them
        assert extra == {"seen_tokens"}


@pytest.mark.parametrize("name", ALL)
def test_adam_moments(name, tmp_path):
    got = _export(name, "optim", tmp_path)
    for state in ("exp_avg", "exp_avg_sq"):
        want = _ref(name, f"{state}.")
        assert want
        bad = [k for k in want if not same_bits(got[f"{k}.{state}"], want[k])]
        assert bad == [], state


@pytest.mark.parametrize("name", [n for n in ALL if n != "zero3"])  # ZeRO-3 keeps no module weights
def test_module_weights(name, tmp_path):
    got = _export(name, "param", tmp_path)
    want = _ref(name, "module.")
    bad = [k for k in want if k not in got or not same_bits(got[k], want[k])]
    assert bad == []


@pytest.mark.parametrize("name", ALL)
def test_layout_step_and_files(name):
    _, m = registry.describe(DS / name)
    ref = torch.load(DS / f"{name}.reference.pt", weights_only=True)
    assert m.format == "deepspeed" and m.step == ref["step"]
    roles = {f.path: f.role for f in m.files}
    assert roles["latest"] == "tracker"
    if "zero_to_fp32.py" in roles:
        assert roles["zero_to_fp32.py"] == roles["zero_to_torch.py"] == "aux"
    assert "rng" in m.missing_state()  # DeepSpeed saves no RNG state
    if name == "pipeline":
        assert (m.layout.pp, m.layout.tp, m.layout.dp, m.layout.world_size) == (2, 2, 2, 8)
    if name in ("tp2", "tp2_glu", "autotp"):
        assert (m.layout.pp, m.layout.tp, m.layout.dp, m.layout.world_size) == (1, 2, 2, 4)
    if name == "pipeline_tied":
        assert (m.layout.pp, m.layout.tp, m.layout.dp, m.layout.world_size) == (2, 1, 2, 4)
    # BF16_Optimizer records no zero_stage: its config's (ZeRO-1 with fp32 gradient accumulation)
    stages = {"zero0": 0, "bf16_zero0": 0, "zero1": 1, "bf16_optimizer": 1, "zero2": 2, "zero3": 3, "pipeline": 1}
    if name in stages:
        assert m.layout.zero_stage == stages[name]
    assert (m.extras.get("variant") == "BF16_Optimizer") == (name in ("bf16_optimizer", "pipeline_bf16"))
    if name == "pipeline_bf16":
        assert (m.layout.pp, m.layout.tp, m.layout.dp, m.layout.zero_stage) == (2, 1, 2, 1)


def test_a_layer_is_named_after_a_tied_module_only_when_it_fits_it(tmp_path):
    """A layer file whose tensors the optimizer does not know by number (a frozen layer, say) is not
    taken for the tied module unless all its tensors have the tied module's names and shapes: an
    extra layer holding an ``emb.weight`` of another shape stays ``<layer>.emb.weight``."""
    import shutil

    src = tmp_path / "tied"
    shutil.copytree(DS / "pipeline_tied", src)
    torch.save({"emb.weight": torch.zeros(16)}, src / "global_step3" / "layer_06-model_00-model_states.pt")
    _, m = registry.describe(src)
    assert m.items["6.emb.weight"].shape == (16,)
    assert [p.file for p in m.items["tied_modules.embed.emb.weight"].pieces] == [
        "global_step3/layer_00-model_00-model_states.pt"
    ]


def test_a_module_tied_across_pipeline_stages():
    """pipeline_tied (PP=2 x DP=2, the embedding tied to the output layer across the stages, as
    Megatron-DeepSpeed's GPTModelPipe ties them): the layer file that holds the tied module (layer
    0; the output layer reusing it has no file) is read under the name the module and the
    optimizer give it, ``tied_modules.embed.emb.weight``; each stage's optimizer holds a copy of
    its master and moments, the second stage's a replica of the first's."""
    _, m = registry.describe(DS / "pipeline_tied")
    assert "0.emb.weight" not in m.items
    states = ("fp32", "exp_avg", "exp_avg_sq")
    assert m.extras["stage_copies"] == sorted(f"tied_modules.embed.emb.weight.{s}" for s in states)
    assert "stage_copies" not in registry.describe(DS / "pipeline")[1].extras  # TP copies, not stages'
    assert [p.file for p in m.items["tied_modules.embed.emb.weight"].pieces] == [
        "global_step3/layer_00-model_00-model_states.pt"
    ]
    for state in ("fp32", "exp_avg", "exp_avg_sq"):
        pieces = m.items[f"tied_modules.embed.emb.weight.{state}"].pieces
        assert sorted((p.file.split("/")[-1], p.replica) for p in pieces) == [
            ("zero_pp_rank_0_mp_rank_00_optim_states.pt", 0),
            ("zero_pp_rank_0_mp_rank_01_optim_states.pt", 1),
        ]


def test_tensor_parallel_slices_are_joined_by_the_models_rules():
    """tp2 (Megatron-style TP=2, saved with the model's universal_checkpoint_info): every TP slice
    has the same shape as its partner, and the items are the whole tensors ds_to_universal makes
    (the reference's TP slices joined, which the generator checked against ds_to_universal):
    column-parallel and vocabulary weights joined on dim 0 (32 padded rows), row-parallel fc2 on
    dim 1, norms and fc2's bias one tensor with a replica per TP rank. The tests above compare
    every exported value with the reference."""
    _, m = registry.describe(DS / "tp2")
    assert m.extras["tp_split"] == "universal_checkpoint_info"
    want = {
        "emb.weight": (32, 16),
        "blocks.0.fc1.weight": (32, 16),
        "blocks.0.fc1.bias": (32,),
        "blocks.0.fc2.weight": (16, 32),
        "blocks.0.norm.weight": (16,),
        "head.weight.exp_avg": (32, 16),
    }
    assert {n: m.items[n].shape for n in want} == want
    fc2 = m.items["blocks.1.fc2.weight.fp32"]
    assert sorted((p.box.offsets, p.replica) for p in fc2.pieces) == [((0, 0), 0), ((0, 16), 0)]
    norm = m.items["blocks.1.norm.weight.exp_avg_sq"]
    assert sorted((p.box.offsets, p.replica) for p in norm.pieces) == [((0,), 0), ((0,), 1)]
    assert not [n for n in m.items if "[tp=" in n]


def test_sub_parameters_and_averaged_copies():
    """tp2_glu (TP=2 x DP=2, Megatron-DeepSpeed's ``--swiglu`` layout): each TP rank's fused fc1
    holds its slice of the gate and then of the up projection, ``[gate_t; up_t]``; the item is the
    whole tensor ds_to_universal makes, ``[gate_0; gate_1; up_0; up_1]`` (the tests above compare
    its values with the reference, which the generator checked against ds_to_universal), each rank
    holding two regions of it, in its model states and in its flat partitions alike. The position
    embedding the patterns average keeps one item per TP rank (its copies differ by design), and
    no replica of it is compared."""
    from ckpttool.verify import verify

    _, m = registry.describe(DS / "tp2_glu")
    for name in ("blocks.0.fc1.weight", "blocks.1.fc1.bias.exp_avg"):
        item = m.items[name]
        assert item.shape[0] == 64 and {p.box.sizes[0] for p in item.pieces} == {16}
        by_rank: dict[bool, set[int]] = {}
        for p in item.pieces:
            by_rank.setdefault("mp_rank_01" in p.file, set()).add(p.box.offsets[0])
        assert by_rank == {False: {0, 32}, True: {16, 48}}, name
    assert "pos.weight" not in m.items
    assert m.items["pos.weight[tp=0].fp32"].shape == m.items["pos.weight[tp=1]"].shape == (8, 16)
    assert verify(DS / "tp2_glu").failing() == []


def _rows_by_rank(item) -> dict[int, list[tuple[int, int]]]:
    """Each TP rank's regions of ``item`` as (first row, rows), from the files the pieces are in."""
    out: dict[int, set[tuple[int, int]]] = {}
    for p in item.pieces:
        out.setdefault(int("mp_rank_01" in p.file), set()).add((p.box.offsets[0], p.box.sizes[0]))
    return {t: sorted(v) for t, v in out.items()}


@pytest.mark.parametrize("metadata", list(AUTOTP_METADATA))
def test_autotp_pieces_are_placed_in_the_whole_tensors(metadata, tmp_path):
    """autotp (DeepSpeed's AutoTP, TP=2 x DP=2): every parameter is one whole tensor, each TP rank's
    copy placed by the split rules, whichever form they take (AutoTP 0.19.8's affine maps; the
    sub-parameter patterns with their widths; the form before universal version 0.4): the fused
    GQA qkv ``[q; k; v]`` (16, 8 and 8 rows) with rank t's ``[q_t; k_t; v_t]`` as three regions, in
    its model states and its flat partitions alike; gate_up's two halves; lm_head's 31 rows split
    16 + 15; o_proj's weight on dim 1 and its bias whole on both ranks (a replica each). The values
    are the reference's (DeepSpeed's own ParamAffineMap joined the live slices); the copy verifies
    clean."""
    from ckpttool.verify import verify

    src = autotp_copy(tmp_path, metadata)
    _, m = registry.describe(src)
    assert not [n for n in m.items if "[tp=" in n]
    qkv = {0: [(0, 8), (16, 4), (24, 4)], 1: [(8, 8), (20, 4), (28, 4)]}
    for name in ("layers.0.self_attn.qkv_proj.weight", "layers.1.self_attn.qkv_proj.bias.exp_avg"):
        assert m.items[name].shape[0] == 32 and _rows_by_rank(m.items[name]) == qkv, name
    assert _rows_by_rank(m.items["layers.1.mlp.gate_up_proj.weight.fp32"]) == {
        0: [(0, 16), (32, 16)],
        1: [(16, 16), (48, 16)],
    }
    assert _rows_by_rank(m.items["lm_head.weight.exp_avg_sq"]) == {0: [(0, 16)], 1: [(16, 15)]}
    o = m.items["layers.0.self_attn.o_proj.weight"]
    assert o.shape == (16, 16) and sorted(p.box.offsets for p in o.pieces) == [(0, 0), (0, 8)]
    bias = m.items["layers.0.self_attn.o_proj.bias.fp32"]
    assert sorted((p.box.offsets, p.replica) for p in bias.pieces) == [((0,), 0), ((0,), 1)]
    ref = _ref("autotp", "exp_avg.")
    got = _export_path(src, "optim", tmp_path)
    assert [k for k in ref if not same_bits(got[f"{k}.exp_avg"], ref[k])] == []
    assert verify(src).failing() == []


def test_autotp_recorded_widths_place_the_sub_parameters(tmp_path):
    """sub_param_shard_widths are followed, not an even split assumed: a copy of autotp (edited by
    ckpttool, not DeepSpeed's output) whose layer-0 qkv widths say k is cut 5 + 3 and v 3 + 5 (each
    rank still 16 rows) places rank 0's copy as q[0:8], k[0:5], v[0:3] and rank 1's as q[8:16],
    k[5:8], v[3:8]."""
    from ckpttool.formats.deepspeed import ALLOWLIST

    def widths(tree: Any) -> None:
        info = tree["universal_checkpoint_info"]
        info.pop("affine_map")
        info["sub_param_shard_widths"][r"^layers\.0\.self_attn\.qkv_proj\.weight$"] = [[8, 8], [5, 3], [3, 5]]

    src = rewritten_copy(
        tmp_path / "w", FIXTURES / "deepspeed" / "autotp", widths, "global_step3/mp_rank_*_model_states.pt", ALLOWLIST
    )
    _, m = registry.describe(src)
    assert _rows_by_rank(m.items["layers.0.self_attn.qkv_proj.weight"]) == {
        0: [(0, 8), (16, 5), (24, 3)],
        1: [(8, 8), (21, 3), (27, 5)],
    }
    # the other layer keeps its even widths
    assert _rows_by_rank(m.items["layers.1.self_attn.qkv_proj.weight"]) == {
        0: [(0, 8), (16, 4), (24, 4)],
        1: [(8, 8), (20, 4), (28, 4)],
    }


def test_autotp_split_rules_that_contradict_the_files(tmp_path):
    """An affine map whose rank holds another shape than the file's copy: exit 3 naming the
    parameter, both shapes, no traceback; a map whose pieces do not make its rank's shard, or do not
    tile the tensor, likewise. String rank keys (a map through JSON) are read as DeepSpeed reads them.
    A scaled piece (a row-parallel bias pre-divided by the TP size, which ckpttool cannot hold as a
    region): that parameter stays one item per TP rank, compared with nothing."""
    from ckpttool.formats.deepspeed import ALLOWLIST
    from ckpttool.verify import verify

    src = DS / "autotp"
    key = r"^layers\.0\.self_attn\.o_proj\.bias$"

    def shard(tree, piece=False):
        ranks = tree["universal_checkpoint_info"]["affine_map"]["params"][key]["ranks"]
        ranks[1]["shard_shape"] = [15]
        if piece:  # a map that tiles the bias, 8 + 8, where the files hold it whole on both ranks
            for t, rank in ranks.items():
                rank["shard_shape"] = [8]
                rank["pieces"] = [{"shape": [8], "source": [8 * t, [1]], "dest": [0, [1]], "locations": [t]}]

    for piece, says in (
        (False, "affine_map rank 1's pieces hold 16 elements, its shard_shape [15] 15"),
        (True, "layers.0.self_attn.o_proj.bias: TP rank 0 holds a [16] tensor; universal_checkpoint_info's map of it says [8]"),
    ):  # fmt: skip
        bad = rewritten_copy(tmp_path / f"shape{piece}", src, partial(shard, piece=piece), MODEL_STATES, ALLOWLIST)
        r = run_cli("ls", bad, cwd=tmp_path)
        assert r.code == 3 and "Traceback" not in r.stderr
        assert says in r.stderr
        # verify reports it, and nothing else (DeepSpeed's scripts, copied later than the save, are no data)
        assert [(f.rule, says in f.message) for f in verify(bad).failing()] == [("corrupt-file", True)]

    def overlap(tree):  # rank 1's columns of down_proj said to be rank 0's: columns 16-31 held by no rank
        down = tree["universal_checkpoint_info"]["affine_map"]["params"][r"^layers\.0\.mlp\.down_proj\.weight$"]
        down["ranks"][1]["pieces"][0]["source"][0] = 0

    bad = rewritten_copy(tmp_path / "overlap", src, overlap, MODEL_STATES, ALLOWLIST)
    r = run_cli("ls", bad, cwd=tmp_path)
    assert r.code == 3 and "Traceback" not in r.stderr
    assert "affine_map of a [16, 32] tensor: its pieces leave 256 elements uncovered" in r.stderr

    def json_keys(tree):  # a map that went through JSON: its ranks keyed "0", "1" (DeepSpeed takes int(rank))
        for entry in tree["universal_checkpoint_info"]["affine_map"]["params"].values():
            entry["ranks"] = {str(k): v for k, v in entry["ranks"].items()}

    _, m = registry.describe(rewritten_copy(tmp_path / "json", src, json_keys, MODEL_STATES, ALLOWLIST))
    assert not [n for n in m.items if "[tp=" in n] and m.items["lm_head.weight"].shape == (31, 16)

    def scaled(tree):
        for rank in tree["universal_checkpoint_info"]["affine_map"]["params"][key]["ranks"].values():
            rank["pieces"][0]["scale"] = 0.5

    half = rewritten_copy(tmp_path / "scaled", src, scaled, MODEL_STATES, ALLOWLIST)
    _, m = registry.describe(half)
    assert "layers.0.self_attn.o_proj.bias" not in m.items
    assert {n.split("]")[0] + "]" for n in m.items if "[tp=" in n} == {
        "layers.0.self_attn.o_proj.bias[tp=0]",
        "layers.0.self_attn.o_proj.bias[tp=1]",
    }
    assert verify(half).failing() == []


def test_tensor_parallel_without_split_rules_keeps_each_rank(tmp_path):
    """A TP run saved without universal_checkpoint_info (DeepSpeed records no split rule of its
    own): nothing says whether the TP ranks' same-shaped copies are slices or replicas, so each
    rank's copy is an item of its own, ``<param>[tp=R]``; none is compared with another, the
    values are those of the rank's files, and --dp still round-trips."""
    from ckpttool.diff import diff
    from ckpttool.formats.deepspeed import ALLOWLIST
    from ckpttool.reshard import Target, reshard
    from ckpttool.verify import verify

    src = rewritten_copy(
        tmp_path / "tp2", DS / "tp2", lambda t: t.pop("universal_checkpoint_info"), MODEL_STATES, ALLOWLIST
    )
    _, m = registry.describe(src)
    assert m.extras["tp_split"].startswith("unknown")
    assert "emb.weight" not in m.items and m.items["emb.weight[tp=1]"].shape == (16, 16)
    ref = _ref("tp2", "exp_avg.")
    got = _export_path(src, "optim", tmp_path)
    for t in (0, 1):
        assert same_bits(got[f"blocks.0.fc2.weight[tp={t}].exp_avg"], ref["blocks.0.fc2.weight"].chunk(2, 1)[t])
        assert same_bits(got[f"blocks.0.norm.weight[tp={t}].exp_avg"], ref["blocks.0.norm.weight"])
    assert verify(src).failing() == []
    one = tmp_path / "dp1"
    reshard(src, one, Target(dp=1))
    assert not diff(src, one).different


def test_universal_checkpoint_matches_its_source(tmp_path):
    a = _export("universal", "master", tmp_path)
    b = _export("zero2", "master", tmp_path)
    assert set(a) == set(b)
    # ds_to_universal stores the int64 buffer as fp32.pt in float32; everything else is the same bits
    assert [k for k in a if k != "seen_tokens" and not same_bits(a[k], b[k])] == []
    assert a["seen_tokens"].dtype == torch.float32 and int(a["seen_tokens"]) == int(b["seen_tokens"])


def test_hostile_optimizer_pickle(tmp_path):
    r = run_cli("inspect", FIXTURES / "hostile" / "ds_optim_os_system", cwd=tmp_path)
    assert r.code == 3 and "posix.system" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "CKPTTOOL_PWNED").exists()


def test_latest_names_a_missing_tag(tmp_path):
    r = run_cli("inspect", FIXTURES / "hostile" / "ds_latest_missing_tag", cwd=tmp_path)
    assert r.code == 3
    assert "latest names tag 'global_step999' but global_step999/ does not exist" in r.stderr


@pytest.mark.parametrize(
    "rules", [{"tp_replicated_parameter_patterns": "blocks"}, {"vocabulary_parameter_patterns": ["("]}]
)
def test_unreadable_split_rules_are_refused(rules, tmp_path):
    """universal_checkpoint_info that is not lists of regular expressions: exit 3 naming the file,
    no traceback (a string would have matched each of its characters as a pattern)."""
    import shutil

    src = tmp_path / "tp2"
    shutil.copytree(DS / "tp2", src)
    path = src / "global_step3" / "mp_rank_00_model_states.pt"
    obj = torch.load(path, weights_only=False)
    obj["universal_checkpoint_info"] = rules
    torch.save(obj, path)
    r = run_cli("ls", src, cwd=tmp_path)
    assert r.code == 3 and "Traceback" not in r.stderr
    assert "mp_rank_00_model_states.pt: universal_checkpoint_info is not the split rules" in r.stderr


SGD = ["sgd_zero0", "sgd_zero1", "sgd_zero3"]


@pytest.mark.parametrize("name", SGD)
def test_sgd_momentum_is_read_under_its_own_parameter(name, tmp_path):
    """A run trained by SGD with momentum (fixtures/make_deepspeed_sgd_fixtures.py). ZeRO-1/3: the
    momentum went unread (only Adam's exp_avg and exp_avg_sq were), and convert, export and diff
    lost it without a word. ZeRO-0: it was named after the wrong parameter (the ids were matched by
    exp_avg's shape alone, and the groups do not follow the module's order), so 0.bias's momentum
    was 1.weight's 3x8. Each is now the engine's own, bit for bit, under its parameter's name."""
    _, m = registry.describe(DS / name)
    momenta = {n[: -len(".momentum_buffer")]: i for n, i in m.items.items() if n.endswith(".momentum_buffer")}
    assert sorted(momenta) == ["0.bias", "0.weight", "1.bias", "1.weight"], sorted(m.items)
    assert {n: tuple(i.shape or ()) for n, i in momenta.items()} == {
        "0.weight": (8, 4), "0.bias": (8,), "1.weight": (3, 8), "1.bias": (3,)
    }  # fmt: skip
    out = tmp_path / "t"
    r = run_cli("convert", DS / name, "--to", "torch", "-o", out)
    assert r.code == 0, r.stderr
    got = torch.load(out / "model.pt", weights_only=True)
    for param, want in _ref(name, "momentum_buffer.").items():
        assert same_bits(got[f"{param}.momentum_buffer"], want), param
    fp32 = _ref(name, "fp32.")
    masters = {k[: -len(".fp32")]: v for k, v in got.items() if k.endswith(".fp32")} or {k: got[k] for k in fp32}
    assert masters.keys() == fp32.keys() and all(same_bits(masters[k], fp32[k]) for k in fp32)
    assert run_cli("verify", DS / name).code == 0


def test_every_per_parameter_state_of_torchs_optimizers_is_named_as_state():
    """The state each of torch's optimizers keeps per parameter, with the parameter's shape, is what
    the DeepSpeed reader reads under ``<param>.<state>`` (and ZeRO-0 matches ids by): every such name
    is one naming.MOMENTS lists, so ``<param>.sum`` (Adagrad) read back from convert's output is the
    optimizer's state, not a parameter (it was: naming knew Adam's and SGD's names only)."""
    from ckpttool.naming import MOMENTS, classify

    seen = set()
    for make in (
        lambda ps: torch.optim.Adam(ps, amsgrad=True),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.Adadelta, torch.optim.Rprop,
    ):  # fmt: skip
        w = torch.nn.Parameter(torch.ones(3, 2))
        opt = make([w])
        w.grad = torch.full((3, 2), 0.5)
        opt.step()
        seen |= {k for k, v in opt.state_dict()["state"][0].items() if torch.is_tensor(v) and v.shape == w.shape}
    assert seen <= MOMENTS, seen - MOMENTS
    assert {classify(f"layers.0.weight.{k}", is_tensor=True) for k in seen} == {"optim"}


@pytest.mark.parametrize("name", ["sgd_zero1", "sgd_zero3"])
def test_a_changed_sgd_momentum_is_a_difference_and_reshard_names_the_optimizer(name, tmp_path):
    """diff of two saves whose momentum differed said "equal", exit 0; reshard stopped on
    "0.weight.exp_avg is not in the source checkpoint", with no reason and no hint."""
    import shutil

    from tests.conftest import restamp_crcs

    copy = tmp_path / "ck"
    shutil.copytree(DS / name, copy)
    adapter, m = registry.describe(copy)
    item = m.items["1.weight.momentum_buffer"]
    piece = item.pieces[0]
    with adapter.reader(m) as reader:
        off, _ = reader.raw_span(piece, item)
    with open(copy / piece.file, "r+b") as fh:
        fh.seek(off)
        fh.write(b"\x00\x00\x80\x7f")  # (an infinity in place of its first value)
    restamp_crcs(copy / piece.file)
    r = run_cli("diff", DS / name, copy)
    assert r.code == 1 and "1.weight.momentum_buffer" in r.stdout, r.stdout
    r = run_cli("reshard", DS / name, "-o", tmp_path / "r", "--dp", "1")
    assert r.code == 2 and "optimizer state ['momentum_buffer'] is not Adam's" in r.stderr, r.stderr
    assert "hint: 'ckpttool convert --to dcp' or '--to torch' carries it" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "r").exists()


def test_inspect_says_zero0_optimizer_names_are_inferred():
    """ZeRO-0 keeps the torch optimizer's integer ids; ckpttool names them by the module's order
    and the state's shapes, which a param group built in another order defeats for parameters of
    one shape. extras said so; no output did."""
    r = run_cli("inspect", DS / "zero0")
    assert r.code == 0 and "optimizer state names: inferred from module parameter order and shapes" in r.stdout
    assert "optimizer state names" not in run_cli("inspect", DS / "zero1").stdout


def test_an_elastic_checkpoint_reads_as_the_same_run_saved_plainly():
    """zero_optimization.elastic_checkpoint keeps each group's partition state in a list: every
    command stopped with an internal AttributeError (exit 3). It reads as the plain ZeRO-2 save of
    the same run: every tensor identical (the param groups it does not save aside); reshard refuses it."""
    report = diff(DS / "zero2_elastic", DS / "zero2")
    assert report.compared == report.identical == 65 and not report.values and not report.objects, report.to_json()
    assert report.added and not report.removed and all(n.startswith("optimizer.param_groups.") for n in report.added)
    r = run_cli("reshard", DS / "zero2_elastic", "-o", "out", "--dp", "1")
    assert r.code == 2 and "an elastic ZeRO checkpoint" in r.stderr, r.stderr


@pytest.mark.parametrize(
    ("name", "only", "said"),
    [
        ("moe_zero2", None, "4 expert files: global_step2/layer_0_expert_0_mp_rank_00_model_states.pt …"),
        ("moe_zero0", "expp_rank_", "2 expert files: global_step2/expp_rank_0_mp_rank_00_optim_states.pt …"),
    ],
)
def test_an_moe_checkpoint_is_refused_not_read_without_its_experts(name, only, said, tmp_path):
    """DeepSpeed's MoE layers keep each expert's weights in a file of its own (and, without ZeRO, each
    expert-parallel rank's optimizer state): ckpttool read none of them, so verify passed, diff said
    "equal" with experts changed and reshard wrote a checkpoint without experts (real saves of
    DeepSpeed 0.19.8, 4 experts, ep_size 2). Every command now refuses it, exit 3, naming a file;
    ``only``: the one kind of expert file left in the copy (each is told alone)."""
    assert only is None or any(f.name.startswith(only) for f in (DS / name / "global_step2").iterdir())
    ck = shutil.copytree(DS / name, tmp_path / name)
    for f in (ck / "global_step2").iterdir():
        if only and f.name.startswith("layer_"):
            f.unlink()
    for args in (("inspect", ck), ("verify", ck), ("diff", ck, DS / "zero2"), ("reshard", ck, "-o", tmp_path / "o", "--dp", "1")):
        r = run_cli(*args)
        assert r.code == 3 and f"a DeepSpeed MoE checkpoint ({said})" in r.stderr, (args, r.stderr)
        assert "Traceback" not in r.stderr
    assert not (tmp_path / "o").exists()


def test_each_zero3_ranks_client_state_is_read(tmp_path):
    """ZeRO-3 has every rank save its own model states file, each with the client state the run
    passed to save_checkpoint: only rank 0's was read (a ZeRO-3 save whose rank 1 cursor differed was
    "equal"; DeepSpeed 0.19.8 runs, 2 ranks). Values the ranks hold alike are one item; a dataloader
    cursor, and what differs, an item a rank."""
    from ckpttool.formats import _pt, _ptwrite
    from ckpttool.formats.deepspeed import ALLOWLIST

    def with_client_state(dst, cursor1):
        ck = shutil.copytree(DS / "zero3", dst)
        for rank in (0, 1):
            rel = f"global_step3/zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
            archive, tree, _ = _pt.load(DS / "zero3", rel, ALLOWLIST)
            tree.update({"dataloader": {"cursor": 100 if rank == 0 else cursor1}, "seed": 7, "salt": rank})
            _ptwrite.save(_ptwrite.carry(tree, lambda archive=archive: archive), ck / rel)
            archive.close()
            shutil.copystat(DS / "zero3" / rel, ck / rel)
        return ck

    a, b = with_client_state(tmp_path / "a", 101), with_client_state(tmp_path / "b", 150)
    _, m = registry.describe(a)
    values = {n: i.value for n, i in m.items.items() if n.startswith(("dataloader", "seed", "salt"))}
    assert values == {
        "dataloader.cursor[rank=0]": 100, "dataloader.cursor[rank=1]": 101, "seed": 7, "salt[rank=0]": 0, "salt[rank=1]": 1
    }  # fmt: skip
    report = diff(a, b)
    assert [o["name"] for o in report.objects] == ["dataloader.cursor[rank=1]"], report.to_json()
