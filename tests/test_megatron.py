"""Megatron checkpoints written by Megatron-LM core_v0.16.1's own save_checkpoint on CPU.

References (fixtures/megatron/<name>.reference.pt) are the full TP=1 tensors gathered by
megatron-core itself (dist_checkpointing.load into a TP=1 model): ``param.*`` (bf16), ``fp32.*``,
``exp_avg.*``, ``exp_avg_sq.*``, with SwiGLU fc1 as [all gates; all ups] and QKV group-interleaved.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckpttool import registry
from ckpttool.export import export
from ckpttool.manifest import Manifest
from tests._compare import same_bits
from tests.conftest import FIXTURES, run_cli

MG = FIXTURES / "megatron"
SUFFIX = {"param.": "", "exp_avg.": ".exp_avg", "exp_avg_sq.": ".exp_avg_sq", "fp32.": ".fp32"}


def _expected(name: str) -> dict[str, torch.Tensor]:
    ref = torch.load(MG / f"{name}.reference.pt", weights_only=True)
    out = {}
    for key, value in ref.items():
        if isinstance(value, torch.Tensor):
            prefix = max((p for p in SUFFIX if key.startswith(p)), key=len)
            out[key[len(prefix) :] + SUFFIX[prefix]] = value
    return out


def _distopt_reads_as(name: str, ref: str, count: int, tmp_path: Path) -> Manifest:
    """A torch_dist save with the distributed optimizer: no bucket is left as a tensor item, and the
    export equals the reference ``ref`` (``count`` tensors) bit for bit. Returns its manifest."""
    _, m = registry.describe(MG / name)
    buckets = [n for n, i in m.items.items() if i.is_tensor and (n.startswith("optimizer.") or ".optimizer." in n)]
    assert buckets == []
    export(MG / name, tmp_path / "o.safetensors")
    got = load_file(tmp_path / "o.safetensors")
    want = _expected(ref)
    assert len(want) == count
    assert [k for k, v in want.items() if k not in got or not same_bits(got[k], v)] == []
    return m


@pytest.mark.parametrize(
    ("name", "fmt"),
    [
        ("dist_tp2", "megatron-dist"),
        ("dist_tp2pp2", "megatron-dist"),
        ("legacy_tp2pp2", "megatron"),
        ("legacy_tp2pp2_distopt", "megatron"),
    ],
)
def test_export_equals_megatron_core_tp1_load(name, fmt, tmp_path):
    adapter, m = registry.describe(MG / name)
    assert adapter.name == fmt and m.step == 3
    assert (m.layout.tp, m.layout.pp) == ((2, 1) if name == "dist_tp2" else (2, 2))
    export(MG / name, tmp_path / "o.safetensors")
    got = load_file(tmp_path / "o.safetensors")
    want = _expected(name)
    assert len(want) == 108
    bad = [k for k, v in want.items() if k not in got or not same_bits(got[k], v)]
    assert bad == []


@pytest.mark.parametrize(("name", "fmt"), [("legacy_pp2vpp2", "megatron"), ("dist_pp2vpp2", "megatron-dist")])
def test_virtual_pipeline_stages_read_as_megatron_core_loads_them(name, fmt, tmp_path):
    """Megatron-LM's interleaved-schedule checkpoint (TP=1 PP=2 VPP=2: model0 and model1 in each rank
    file, layers numbered from 0 in each chunk): every tensor (params, fp32 copies, moments) equals
    megatron-core's own TP=1 load of the torch_dist checkpoint saved from the same model chunks."""
    adapter, m = registry.describe(MG / name)
    assert adapter.name == fmt and m.step == 3
    assert (m.layout.tp, m.layout.pp) == (1, 2)
    if fmt == "megatron":
        assert m.layout.vpp == 2
    export(MG / name, tmp_path / "o.safetensors")
    got = load_file(tmp_path / "o.safetensors")
    want = _expected("legacy_pp2vpp2")
    assert len(want) == 108
    bad = [k for k, v in want.items() if k not in got or not same_bits(got[k], v)]
    assert bad == []


def test_experts_read_as_megatron_core_shards_them(tmp_path):
    """Megatron-LM's mixture-of-experts checkpoint (PP=2 EP=2, 4 experts: rank files
    mp_rank_00_<pp>_<ep>, each with its EP rank's 2 local experts and a chained optimizer list,
    dense then experts): every tensor, experts under their global numbers, equals the run's own
    sharded state dict; the dense entries each EP rank repeats are replicas, and the RNG state of
    every (PP, EP) rank is kept apart."""
    adapter, m = registry.describe(MG / "legacy_pp2ep2")
    assert adapter.name == "megatron" and m.step == 3
    assert (m.layout.tp, m.layout.pp, m.layout.ep) == (1, 2, 2)
    export(MG / "legacy_pp2ep2", tmp_path / "o.safetensors")
    got = load_file(tmp_path / "o.safetensors")
    want = _expected("legacy_pp2ep2")
    assert len(want) == 116  # 29 parameters x (param, fp32, exp_avg, exp_avg_sq)
    assert [k for k, v in want.items() if k not in got or not same_bits(got[k], v)] == []
    expert = m.items["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight.exp_avg"]
    assert [p.file.split("/")[1] for p in expert.pieces] == ["mp_rank_00_001_001"]  # local expert 1 of EP rank 1
    router = m.items["decoder.layers.1.mlp.router.weight"]
    assert sorted((p.file.split("/")[1], p.replica) for p in router.pieces) == [
        ("mp_rank_00_001_000", 0),
        ("mp_rank_00_001_001", 1),
    ]
    assert sum(1 for n in m.items if n.startswith("rng_state.0.torch_rng_state")) == 4


@pytest.mark.parametrize("name", ["legacy_tp2ep2_gg", "dist_tp2ep2_gg"])
def test_grouped_gemm_experts_read_as_megatron_core_shards_them(name, tmp_path):
    """Megatron-LM's MoE run with --moe-grouped-gemm (the local spec's GroupedMLP; TP=2 EP=2, 4
    experts): each legacy rank file keeps its 2 local experts in mlp.experts.weight1 [hidden, 2 x 2
    ffn/TP] and weight2 [2 x ffn/TP, hidden], and the optimizer's fp32 copies and moments in the same
    shapes. Read as one item per expert, named as SequentialMLP's: every tensor equals the run's own
    sharded state dict (megatron-core's transform of those weights, expert by expert, on the global
    axis), and diff of the legacy and torch_dist saves of the same state is empty."""
    adapter, m = registry.describe(MG / name)
    assert m.step == 3 and (m.layout.tp, m.layout.ep) == (2, 2)
    assert not [n for n in m.items if ".weight1" in n or ".weight2" in n]
    export(MG / name, tmp_path / "o.safetensors")
    got = load_file(tmp_path / "o.safetensors")
    want = _expected("legacy_tp2ep2_gg")
    assert len(want) == 116  # 29 parameters x (param, fp32, exp_avg, exp_avg_sq)
    assert [k for k, v in want.items() if k not in got or not same_bits(got[k], v)] == []
    if name.startswith("legacy"):
        fc1 = m.items["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight.exp_avg_sq"]
        assert sorted(p.file.split("/")[1] for p in fc1.pieces) == ["mp_rank_00_001"] * 2 + ["mp_rank_01_001"] * 2
        r = run_cli("diff", MG / name, MG / "dist_tp2ep2_gg", "--json")
        assert r.code == 0 and json.loads(r.stdout)["equal"], r.stdout[-2000:]


def test_torch_dist_experts_read_as_the_legacy_files_name_them(tmp_path):
    """Megatron-LM's torch_dist save of the same MoE state (experts stacked on a global axis after the
    layer's: decoder.layers.mlp.experts.experts.*, [layers, experts, ...]): one item per layer and
    expert, named as the legacy reader names them; every tensor equals the run's own sharded state
    dict, and diff against the legacy files of the same state is empty."""
    adapter, m = registry.describe(MG / "dist_pp2ep2")
    assert adapter.name == "megatron-dist" and (m.layout.pp, m.layout.ep) == (2, 2)
    fc1 = m.items["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert fc1.shape == (64, 16) and sorted(p.box.offsets for p in fc1.pieces) == [(0, 0), (32, 0)]
    assert not any(".experts.experts." in n and "_extra_state" not in n for n in m.items)
    export(MG / "dist_pp2ep2", tmp_path / "o.safetensors")
    got = load_file(tmp_path / "o.safetensors")
    want = _expected("legacy_pp2ep2")
    assert [k for k, v in want.items() if k not in got or not same_bits(got[k], v)] == []
    from ckpttool.diff import diff

    report = diff(MG / "legacy_pp2ep2", MG / "dist_pp2ep2", kinds=["param", "optim", "master"])
    assert not report.different and report.compared == 116


@pytest.mark.parametrize("name", ["legacy_tp2ep2etp1", "dist_tp2ep2etp1"])
def test_experts_split_by_an_expert_tensor_parallelism_of_their_own(name, tmp_path):
    """Megatron-LM at TP=2 EP=2 with --expert-tensor-parallel-size 1 (world 2): the dense layers are
    split over TP, each routed expert is whole on its EP rank. The legacy save has only the
    directories of expert-DP rank 0's ranks (mp_rank_00_000 and mp_rank_01_001, not the 2 x 2 grid);
    both saves read, every tensor equal to the run's own sharded state dict, verify clean."""
    adapter, m = registry.describe(MG / name)
    assert (m.layout.tp, m.layout.ep) == (2, 2) and m.step == 3
    export(MG / name, tmp_path / "o.safetensors")
    got = load_file(tmp_path / "o.safetensors")
    want = _expected("legacy_tp2ep2etp1")
    assert len(want) == 116
    assert [k for k, v in want.items() if k not in got or not same_bits(got[k], v)] == []
    fc1 = m.items["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"]
    # whole: one piece in a legacy file; torch_dist keeps SwiGLU's gate and up halves apart, even whole
    halves = [(0, 0)] if name.startswith("legacy") else [(0, 0), (32, 0)]
    assert fc1.shape == (64, 16) and sorted(p.box.offsets for p in fc1.pieces) == halves
    if name.startswith("legacy"):
        assert sorted({p.file.split("/")[1] for p in fc1.pieces}) == ["mp_rank_01_001"]
        qkv = m.items["decoder.layers.1.self_attention.linear_qkv.weight"]
        assert sorted(p.file.split("/")[1] for p in qkv.pieces) == ["mp_rank_00_000", "mp_rank_01_001"]
    r = run_cli("verify", MG / name, "--json")
    assert r.code == 0 and json.loads(r.stdout)["summary"]["error"] == 0


def test_expert_tensor_parallel_rank_layout_is_megatron_cores():
    """Oracle: the legacy rank directories under ETP != TP, and the ETP rank of each one's experts,
    are the ones megatron-core's own RankGenerator lays out (both rank orders, TP/ETP/EP 1-4, PP and
    CP 1-2, worlds up to 16): the ranks of expert-DP rank 0, by dense TP rank, PP rank and EP rank.
    Layouts where two such ranks share a directory, or that leave a TP part or an expert part
    unsaved (Megatron-LM's legacy save then loses it), are refused."""
    import itertools
    import types

    pytest.importorskip("megatron.core")
    from megatron.core.parallel_state import RankGenerator

    from ckpttool.formats.megatron import expert_tp_ranks, rng_holders

    def coords(gen, world):
        out = {r: {} for r in range(world)}
        for axis in ("tp", "ep", "dp", "pp", "cp"):
            for group in gen.get_ranks(axis):
                for i, r in enumerate(group):
                    out[r][axis] = i
        return out

    cases = refused = 0
    for tp, etp, ep, pp, cp, mapping in itertools.product(
        range(1, 5), range(1, 5), range(1, 5), (1, 2), (1, 2), (0, 1)
    ):
        for world in range(1, 17):
            if tp == etp or world % (tp * cp * pp) or world % (etp * ep * pp):
                continue
            order = "tp-cp-ep-pp-dp" if mapping else "tp-cp-ep-dp-pp"
            dense = coords(RankGenerator(tp=tp, ep=1, dp=world // (tp * cp * pp), pp=pp, cp=cp, order=order), world)
            expert = coords(RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order=order), world)
            want: dict = {}
            clash = False
            for r in range(world):
                if expert[r]["dp"] == 0:
                    key = (dense[r]["tp"], dense[r]["pp"], expert[r]["ep"])
                    dpcp = dense[r]["cp"] + cp * dense[r]["dp"]
                    clash |= want.setdefault(key, (expert[r]["tp"], r, dpcp))[0] != expert[r]["tp"]
            lossy = {(t, q) for t in range(tp) for q in range(pp)} != {k[:2] for k in want} or len(
                {(x, k[1], k[2]) for k, (x, _, _) in want.items()}
            ) != etp * pp * ep
            args = types.SimpleNamespace(
                num_experts=8, tensor_model_parallel_size=tp, expert_tensor_parallel_size=etp,
                pipeline_model_parallel_size=pp, context_parallel_size=cp, expert_model_parallel_size=ep,
                world_size=world, use_tp_pp_dp_mapping=bool(mapping),
            )  # fmt: skip
            cases += 1
            if clash or lossy:  # (two ranks saving one directory lose a part too: named first)
                refused += 1
                with pytest.raises(ValueError, match="overwrote" if clash else "cannot hold this layout"):
                    expert_tp_ranks(args)
            else:
                assert expert_tp_ranks(args) == want, (tp, etp, ep, pp, cp, world, order)
                # every rank that saves a dense optimizer's distrib_optim.pt state (its DP-CP rank 0)
                # also saves a rank file, so that state lands beside it and no file is written twice
                assert all(expert[r]["dp"] == 0 for r in range(world) if dense[r]["dp"] == 0 and dense[r]["cp"] == 0)
                # and RNG: every dense rank's state is found, in the file it saved or one whose saver
                # has the same TP, PP, EP and ETP ranks (its seeds)
                holders, dpcp_size = rng_holders(args)
                assert dpcp_size == world // (tp * pp)
                assert all((t, q, 0) in holders for t in range(tp) for q in range(pp))
                for r in range(world):
                    at = (dense[r]["tp"], dense[r]["pp"], dense[r]["cp"] + cp * dense[r]["dp"])
                    if at not in holders:
                        continue
                    saver = want[holders[at]]
                    assert saver[1] == r or (
                        saver[0] == expert[r]["tp"] and (at[0], at[1], expert[r]["ep"]) == holders[at]
                    )
    assert cases > 300 and 0 < refused < cases


def test_expert_tensor_parallel_args_that_lay_out_no_world(tmp_path):
    """The legacy rank directories follow from the args' ETP layout; args whose world cannot hold it
    are refused by name (exit 3), not read as a grid of missing ranks."""
    from tests.conftest import rewritten_copy

    def edit(obj):
        obj["args"].world_size = 3
        return obj

    ckpt = tmp_path / "c"
    rewritten_copy(ckpt, MG / "legacy_tp2ep2etp1", edit, "**/model_optim_rng.pt", allow=None)
    r = run_cli("ls", ckpt)
    assert r.code == 3 and "expert tensor parallelism cannot be laid out" in r.stderr and "world size 3" in r.stderr


def test_an_expert_piece_is_named_when_its_bytes_change(tmp_path):
    """A seal of the torch_dist MoE checkpoint locates an expert's bytes inside its stored chunk: one
    byte flipped there is reported against that expert, by its global number."""
    import shutil

    from ckpttool.seal import seal
    from ckpttool.verify import verify

    ckpt = tmp_path / "ckpt"
    shutil.copytree(MG / "dist_pp2ep2", ckpt)
    seal(ckpt)
    adapter, m = registry.describe(ckpt)
    name = "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight.exp_avg"
    item = m.items[name]
    with adapter.reader(m) as reader:
        start, length = reader.raw_span(item.pieces[0], item)
        values = reader.read(item.pieces[0], item)
    path = tmp_path / "ckpt" / "iter_0000003" / item.pieces[0].file
    data = bytearray(path.read_bytes())
    assert bytes(data[start : start + length]) == values.tobytes()  # the span holds this expert's values
    data[start + length // 2] ^= 0x40
    path.write_bytes(bytes(data))
    findings = [f for f in verify(ckpt).findings if f.rule == "checksum-mismatch"]
    assert [f.item for f in findings] == [name]


def test_experts_with_the_distributed_optimizer_are_debucketed(tmp_path):
    """Megatron-LM's MoE checkpoint saved by the distributed optimizer (PP=2 EP=2): distrib_optim.pt
    holds the chained optimizers' states, dense (in the EP rank 0 files only) then experts, each
    de-bucketed by its own grad buffer; every tensor equals the run's own sharded state dict."""
    _, m = registry.describe(MG / "legacy_pp2ep2_distopt")
    assert "distrib_optim" in m.extras and m.layout.ep == 2
    export(MG / "legacy_pp2ep2_distopt", tmp_path / "o.safetensors")
    got = load_file(tmp_path / "o.safetensors")
    want = _expected("legacy_pp2ep2_distopt")
    assert len(want) == 116
    assert [k for k, v in want.items() if k not in got or not same_bits(got[k], v)] == []
    dense = m.items["decoder.layers.0.mlp.router.weight.exp_avg"]
    assert [p.file.split("/")[1:] for p in dense.pieces] == [["mp_rank_00_000_000", "distrib_optim.pt"]]


def test_a_chained_optimizer_other_than_dense_then_experts_is_refused():
    from ckpttool.errors import CorruptFileError
    from ckpttool.formats.megatron import optimizer_members

    def member(expert: bool) -> dict:
        return {"optimizer": {"state": {}, "param_groups": [{"params": [0], "is_expert_parallel": expert}]}}

    params = [
        ("decoder.layers.0.mlp.router.weight", (4, 16)),
        ("decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight", (64, 16)),
    ]
    dense, experts = optimizer_members([member(False), member(True)], params, "f.pt")
    assert [n for n, _ in dense[1]] == [params[0][0]] and [n for n, _ in experts[1]] == [params[1][0]]
    for chain in ([member(True), member(False)], [member(False)] * 3, [member(False), member(True), member(True)]):
        with pytest.raises(CorruptFileError, match="expected two, the dense parameters' then the experts'"):
            optimizer_members(chain, params, "f.pt")
    with pytest.raises(CorruptFileError, match="expected two"):  # a chain over a model without experts
        optimizer_members([member(False), member(True)], params[:1], "f.pt")


def test_pipeline_layout_reads_as_megatron_core_loads_it(tmp_path):
    """Megatron-LM's checkpoint of a run split by --pipeline-model-parallel-layout 'E|tt|tt|L' (PP=2:
    two model chunks per rank, rank 0's first holding only the embedding, rank 1's last only the
    final norm and output layer): every tensor, at the global layer megatron-core's layout gives it,
    equals megatron-core's TP=1 load of the torch_dist save of the same state."""
    adapter, m = registry.describe(MG / "legacy_pp2layout")
    assert adapter.name == "megatron" and (m.layout.pp, m.layout.vpp) == (2, 2)
    assert m.extras["args"]["pipeline_model_parallel_layout"] == "E|tt|tt|L"
    export(MG / "legacy_pp2layout", tmp_path / "o.safetensors")
    got = load_file(tmp_path / "o.safetensors")
    want = _expected("legacy_pp2layout")
    assert len(want) == 108
    assert [k for k, v in want.items() if k not in got or not same_bits(got[k], v)] == []
    files = {p.file.split("/")[1] for p in m.items["decoder.layers.3.mlp.linear_fc1.weight"].pieces}
    assert files == {"mp_rank_00_000"}  # rank 0's second chunk holds layers 2 and 3


def test_legacy_split_rules_are_visible_in_the_manifest():
    _, m = registry.describe(MG / "legacy_tp2pp2")
    fc1 = m.items["decoder.layers.3.mlp.linear_fc1.weight"]  # layer 1 of pipeline stage 1
    assert fc1.shape == (64, 16)
    # each TP rank's [gate_r; up_r] becomes two pieces: gates at rows 0/16, ups at rows 32/48
    assert sorted(p.box.offsets[0] for p in fc1.pieces) == [0, 16, 32, 48]
    proj = m.items["decoder.layers.0.self_attention.linear_proj.weight"]
    assert sorted(p.box.offsets for p in proj.pieces) == [(0, 0), (0, 16)]  # row-parallel: dim 1
    norm = m.items["decoder.layers.0.input_layernorm.weight"]
    assert sorted(p.replica for p in norm.pieces) == [0, 1]  # replicated over TP
    assert m.items["embedding.word_embeddings.weight"].shape == (128, 16)  # padded vocab
    roles = {f.path: f.role for f in m.files}
    assert roles["latest_checkpointed_iteration.txt"] == "tracker"


def test_distributed_optimizer_state_is_debucketed(tmp_path):
    _, m = registry.describe(MG / "legacy_tp2pp2_distopt")
    assert "distrib_optim" in m.extras
    export(MG / "legacy_tp2pp2_distopt", tmp_path / "o.safetensors")
    got = load_file(tmp_path / "o.safetensors")
    want = _expected("legacy_tp2pp2_distopt")
    assert len(want) == 108
    assert [k for k, v in want.items() if k not in got or not same_bits(got[k], v)] == []


@pytest.mark.parametrize("name", ["dist_tp2pp2dp2_distopt", "dist_tp2pp2dp2_distopt_fr"])
def test_torch_dist_distributed_optimizer_reads_as_its_gather(name, tmp_path):
    """Megatron-LM's torch_dist save with --use-distributed-optimizer at TP=2 x PP=2 x DP=2: the
    default dp_reshardable layout (each grad-buffer bucket one 1-D tensor per state, cut between
    the two DP ranks, de-bucketed by replaying the buffer layout) and the fully_reshardable one
    (model space) both read as the run's own fully_reshardable gather, bit for bit."""
    m = _distopt_reads_as(name, "dist_tp2pp2dp2_distopt", 108, tmp_path)
    assert (m.layout.tp, m.layout.pp, m.layout.dp) == (2, 2, 2)
    sharding = "fully_reshardable" if name.endswith("_fr") else "dp_reshardable"
    assert m.extras["distrib_optim_sharding_type"] == sharding
    if sharding == "dp_reshardable":
        assert m.extras["distrib_optim"].startswith("de-bucketed")
        # a parameter the DP boundary of its bucket cuts in two: pieces of flat ranges, one per DP rank
        cut = [i for i in m.items.values() if i.kind == "master" and any(p.flat for p in i.pieces)]
        assert cut
        fc1 = m.items["decoder.layers.0.mlp.linear_fc1.weight.exp_avg"]
        assert len({p.box for p in fc1.pieces}) == 4  # SwiGLU: TP rank t holds [gate_t; up_t]
        norm = m.items["decoder.layers.0.input_layernorm.weight.fp32"]
        assert sorted(p.replica for p in norm.pieces) == [0, 1]  # replicated over TP


@pytest.mark.parametrize("name", ["dist_pp2ep2_distopt", "dist_pp2ep2_distopt_fr"])
def test_torch_dist_distributed_optimizer_with_experts_reads_as_its_gather(name, tmp_path):
    """Megatron-LM's MoE torch_dist save with --use-distributed-optimizer at PP=2 x EP=2 (dense DP=2):
    megatron-core chains a dense and an expert distributed optimizer. dp_reshardable saves each
    member's buckets under ``chained_<c>.`` with its own ``dp_group_idx`` (the TP x PP rank for the
    dense member, the expert TP x EP x PP rank for the experts'); both layouts read as the run's own
    gather (the legacy save's reference, one run), bit for bit."""
    m = _distopt_reads_as(name, "legacy_pp2ep2_distopt", 116, tmp_path)
    assert (m.layout.pp, m.layout.ep, m.layout.dp) == (2, 2, 2)
    if not name.endswith("_fr"):
        assert m.extras["distrib_optim"].startswith("de-bucketed")
        # expert 3 of stage 1 is EP rank 1's (expert group rank (1 x 2 + 1) = 3, world rank 3); the
        # router is dense, in the dense member's buckets of stage 1
        expert = m.items["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight.exp_avg"]
        assert [p.file for p in expert.pieces] == ["__3_0.distcp"]
        assert m.items["decoder.layers.1.mlp.router.weight.fp32"].pieces[0].file.startswith("__2_")


@pytest.mark.parametrize(
    "name", ["dist_tp2ep2etp1_distopt", "dist_tp2ep2etp1_distopt_fr", "legacy_tp2ep2etp1_distopt"]
)
def test_distributed_optimizer_with_expert_tensor_parallelism_reads_as_its_gather(name, tmp_path):
    """The same MoE model at TP=2 DP=2 with the experts whole (--expert-tensor-parallel-size 1, EP=2,
    expert DP=2) and the distributed optimizer: in torch_dist the dense member's buckets by TP rank,
    the experts' by expert TP x EP rank (ETP=1: the EP rank), each split between two DP ranks; in
    the legacy save (one run with both) a distrib_optim.pt beside each of the two rank files that
    expert-DP rank 0's ranks save, each holding the dense optimizer's state of its TP rank (both
    savers are dense DP rank 0) and the experts' of its EP rank, whole. All three read as the run's
    own gather, bit for bit, and verify clean."""
    m = _distopt_reads_as(name, "dist_tp2ep2etp1_distopt", 116, tmp_path)
    assert (m.layout.tp, m.layout.ep, m.layout.dp) == (2, 2, 2)
    if name.startswith("legacy"):
        assert m.extras["distrib_optim"].startswith("de-bucketed")
        expert = m.items["decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight.fp32"]
        assert [(p.file.split("/")[1:], p.box and p.box.sizes) for p in expert.pieces] == [
            (["mp_rank_01_001", "distrib_optim.pt"], (16, 32))
        ]
        qkv = m.items["decoder.layers.0.self_attention.linear_qkv.weight.exp_avg"]
        assert [(p.file.split("/")[1], p.box.offsets) for p in qkv.pieces] == [
            ("mp_rank_00_000", (0, 0)),
            ("mp_rank_01_001", (32, 0)),
        ]
        r = run_cli("verify", MG / name, "--json")
        assert r.code == 0 and json.loads(r.stdout)["summary"]["error"] == 0
    elif not name.endswith("_fr"):
        assert m.extras["distrib_optim"].startswith("de-bucketed")
        # an expert whole (ETP=1) in its EP rank's buckets (expert rank 1: world rank 1 of the
        # experts' tp-ep-dp order); a dense column-parallel weight in two TP halves; the dense
        # router replicated over TP
        expert = m.items["decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight.fp32"]
        assert [(p.file, p.box and p.box.sizes) for p in expert.pieces] == [("__1_0.distcp", (16, 32))]
        qkv = m.items["decoder.layers.0.self_attention.linear_qkv.weight.exp_avg"]
        assert [(p.box.offsets, p.box.sizes) for p in qkv.pieces] == [((0, 0), (32, 16)), ((32, 0), (32, 16))]
        router = m.items["decoder.layers.0.mlp.router.weight.fp32"]
        assert sorted(p.replica for p in router.pieces) == [0, 1]


def test_chained_buckets_kept_as_saved_are_optimizer_state(tmp_path):
    """When the replay is not used, the chain's buckets stay as saved, but as optimizer state: verify
    does not report a missing optimizer."""
    from tests.conftest import rewritten_copy

    root = rewritten_copy(
        tmp_path / "c",
        MG / "dist_pp2ep2_distopt",
        lambda obj: obj["args"].__dict__.update(expert_model_parallel_size=4),  # one expert a rank, not two
        "iter_*/common.pt",
    )
    _, m = registry.describe(root)
    assert m.extras["distrib_optim"] == (
        "kept as the distributed optimizer's buckets: replaying the grad-buffer layout of "
        "chained_1.dp_group_idx_0 buffer 0 gives 1536 elements, its buckets hold 3072"
    )
    kept = [i for n, i in m.items.items() if n.startswith("chained_1.optimizer.distributed.") and i.is_tensor]
    assert len(kept) == 12 and {i.kind for i in kept} == {"optim"}
    assert "no optimizer state" not in run_cli("verify", root, cwd=tmp_path).stdout


def test_the_two_distributed_optimizer_layouts_diff_equal(tmp_path):
    r = run_cli("diff", MG / "dist_tp2pp2dp2_distopt", MG / "dist_tp2pp2dp2_distopt_fr", "--json", cwd=tmp_path)
    assert r.code == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["equal"] and report["compared"] == report["identical"] == 108


def test_a_bucket_layout_that_does_not_replay_is_kept_as_buckets(tmp_path):
    """A dp_reshardable checkpoint whose args give another layout (here tied embeddings: the last
    stage would hold a copy of the embedding) is not placed by a wrong replay: its buckets stay as
    they are, with the reason."""
    from tests.conftest import rewritten_copy

    root = rewritten_copy(
        tmp_path / "c",
        MG / "dist_tp2pp2dp2_distopt",
        lambda obj: obj["args"].__dict__.update(untie_embeddings_and_output_weights=False),
        "iter_*/common.pt",
    )
    _, m = registry.describe(root)
    assert m.extras["distrib_optim"].startswith("kept as the distributed optimizer's buckets")
    assert "gives 5392 elements, its buckets hold 4368" in m.extras["distrib_optim"]
    assert sum(n.startswith("optimizer.distributed.") and m.items[n].is_tensor for n in m.items) == 12
    # stage 0's buffers replayed before stage 1's failed: none of their state is left behind
    assert not [n for n, i in m.items.items() if i.kind == "master"]


def test_a_replay_in_another_order_is_caught_by_the_chunk_boundaries(monkeypatch):
    """The sizes alone cannot tell a wrong parameter order: each parameter must also start and end
    on the chunk boundaries megatron-core saved (here linear_qkv's weight laid out before
    linear_proj's, as no megatron-core version registers them). Two parameters of the same size
    swapped would pass both guards: the order is megatron-core's own, checked against its source."""
    from ckpttool.formats import megatron

    order = list(megatron._LAYER_ORDER)
    a, b = order.index("self_attention.linear_proj.weight"), order.index("self_attention.linear_qkv.weight")
    order[a], order[b] = order[b], order[a]
    monkeypatch.setattr(megatron, "_LAYER_ORDER", tuple(order))
    _, m = registry.describe(MG / "dist_tp2pp2dp2_distopt")
    assert "does not start and end on chunk boundaries" in m.extras["distrib_optim"]


def test_hostile_args_class(tmp_path):
    r = run_cli("inspect", FIXTURES / "hostile" / "megatron_args_evil_class", cwd=tmp_path)
    assert r.code == 3 and "posix.system" in r.stderr and "mp_rank_00_000/model_optim_rng.pt" in r.stderr
    assert not (tmp_path / "CKPTTOOL_PWNED").exists()


def test_missing_mp_rank_directory(tmp_path):
    r = run_cli("inspect", FIXTURES / "hostile" / "megatron_missing_mp_rank", cwd=tmp_path)
    assert r.code == 3
    assert "iter_0000003/mp_rank_01_001/model_optim_rng.pt: missing; the args say TP=2 PP=2 EP=1" in r.stderr
    assert "1 of 4 rank directories are missing" in r.stderr


def test_a_missing_rank_directory_is_a_finding_on_the_file_it_lacks(tmp_path):
    """verify named the iteration folder (as given: an absolute path when the user typed one) for
    missing rank directories, and with a seal reported the loss twice, once so and once as the
    rank file. Each missing rank's file is now the finding's file, relative to the checkpoint, once."""
    import shutil

    from ckpttool.seal import seal
    from ckpttool.verify import verify

    ck = tmp_path / "ck"
    shutil.copytree(MG / "legacy_tp2pp2", ck)
    seal(ck)
    for d in ("mp_rank_01_001", "mp_rank_00_001"):
        shutil.rmtree(ck / "iter_0000003" / d)
    missing = [f for f in verify(ck.resolve()).findings if f.rule == "missing-file"]
    assert sorted(f.file for f in missing) == [
        "iter_0000003/mp_rank_00_001/model_optim_rng.pt",
        "iter_0000003/mp_rank_01_001/model_optim_rng.pt",
    ], [(f.file, f.message) for f in missing]


def test_tracker_pointing_at_a_missing_iteration(tmp_path):
    import shutil

    shutil.copytree(MG / "legacy_tp2pp2", tmp_path / "ck")
    (tmp_path / "ck" / "latest_checkpointed_iteration.txt").write_text("7")
    r = run_cli("inspect", tmp_path / "ck")
    assert r.code == 3 and "names iteration 7 but iter_0000007/ does not exist" in r.stderr


def test_moe_local_expert_indices_become_global():
    from ckpttool.formats.megatron import _global_expert, split_rule

    assert _global_expert("decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight", 2, 4) == (
        "decoder.layers.1.mlp.experts.local_experts.9.linear_fc1.weight"
    )
    assert _global_expert("decoder.layers.0.mlp.experts.linear_fc2.weight3", 1, 4) == (
        "decoder.layers.0.mlp.experts.linear_fc2.weight7"
    )
    assert split_rule("decoder.layers.0.mlp.experts.local_experts.9.linear_fc1.weight", gated=True) == ("gated", 0)
    assert split_rule("decoder.layers.0.mlp.experts.linear_fc2.weight7", gated=True) == ("row", 1)
    assert split_rule("language_model.encoder.layers.0.self_attention.dense.weight", gated=False) == ("row", 1)
    assert split_rule("decoder.layers.0.self_attention.linear_proj.bias", gated=False) == ("replicated", None)


def test_torch_dist_without_common_pt_is_not_plain_dcp(tmp_path):
    # newer megatron-core keeps the common state inside the DCP files: metadata.json alone decides
    import shutil

    ck = tmp_path / "iter"
    shutil.copytree(MG / "dist_tp2" / "iter_0000003", ck)
    (ck / "common.pt").unlink()
    claims = [a.name for a in registry.adapters() if a.detect(ck).matches]
    assert claims == ["megatron-dist"]
    _, m = registry.describe(ck)
    # without the args, the layer count is unknown: stacked layers stay one item with the layer axis
    assert m.format == "megatron-dist" and m.step is None
    assert m.items["decoder.layers.mlp.linear_fc1.weight"].shape == (4, 64, 16)


def test_grad_buffer_layout_is_megatron_cores():
    """Oracle: where ``grad_buffer_layout`` puts each parameter in a de-padded ``distrib_optim.pt``
    world tensor equals where megatron-core's own ``_ParamAndGradBuffer`` puts it (its
    ``param_index_map`` with the padding between buckets dropped, as ``get_parameter_state_dp_zero``
    drops it), over random shapes, bucket sizes, DP sizes and shared-embedding flags."""
    import random
    import types
    import warnings
    from unittest import mock

    pytest.importorskip("megatron.core")
    torch = pytest.importorskip("torch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer

    from ckpttool.formats.megatron import grad_buffer_layout

    class Group:  # what the buffer asks of its process groups
        def __init__(self, n: int) -> None:
            self.n = n

        def size(self) -> int:
            return self.n

        def rank(self) -> int:
            return 0

    def megatron(shapes, bucket, shared, dp):
        params = [torch.nn.Parameter(torch.zeros(s, dtype=torch.bfloat16)) for s in shapes]
        for i in shared:
            params[i].shared_embedding = True
        names = {p: f"p{i}" for i, p in enumerate(params)}
        config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
        groups = types.SimpleNamespace(tp=Group(1), dp_cp=Group(dp))
        with (
            mock.patch("torch.cuda.current_device", lambda: "cpu"),
            mock.patch(
                "megatron.core.distributed.param_and_grad_buffer.log_on_each_pipeline_stage", lambda *a, **k: None
            ),
        ):
            buf = _ParamAndGradBuffer(
                config, torch.bfloat16, torch.float32, params, Group(dp), bucket, names, 1.0,
                list(range(len(params))), False, pg_collection=groups,
            )  # fmt: skip
        unpadded = [b.numel_unpadded for b in buf.buckets]
        base = [sum(unpadded[:i]) for i in range(len(unpadded))]
        where = {}
        for p in params:
            start, _end, bucket_id = buf.param_index_map[p]
            where[names[p]] = base[bucket_id] + start - buf.bucket_indices[bucket_id][0]
        return where, buf.numel_unpadded, len(buf.buckets)

    rng = random.Random(0)
    most = 0
    for _ in range(150):
        n = rng.randint(1, 12)
        shapes = [tuple(rng.choice([1, 3, 7, 16, 64, 100]) for _ in range(rng.randint(1, 2))) for _ in range(n)]
        shared = {i for i in (0, n - 1) if rng.random() < 0.3}
        bucket = rng.choice([None, 50, 200, 1000])
        want, total, buckets = megatron(shapes, bucket, shared, rng.choice([1, 2, 3, 8]))
        most = max(most, buckets)
        got, numel = grad_buffer_layout(
            [(f"p{i}", s) for i, s in enumerate(shapes)], bucket_size=bucket, shared=frozenset(f"p{i}" for i in shared)
        )
        assert numel == total
        assert {name: offset for name, _, offset in got} == want
    assert most >= 3  # several buckets were laid out


def _config_accepts(layers, pp, vpp, first, last, emb, loss) -> bool:
    """Whether megatron-core's TransformerConfig takes this pipeline split (its __post_init__ checks)."""
    from megatron.core.transformer import TransformerConfig

    try:
        TransformerConfig(
            num_layers=layers, hidden_size=8, num_attention_heads=1, pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
            num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
            account_for_embedding_in_pipeline_split=emb, account_for_loss_in_pipeline_split=loss,
            pipeline_dtype=torch.float32,
        )  # fmt: skip
    except (ValueError, AssertionError):
        return False
    return True


def test_pipeline_stages_agree_with_megatron_core():
    """Oracle: the pipeline split (even; uneven first/last stages; the embedding or loss counted as a
    layer; each with 1-3 virtual stages per rank) equals megatron-core's own get_num_layers_to_build /
    get_transformer_layer_offset for every split Megatron accepts, and is refused for the ones it
    asserts on, whose stages would not hold the layers, or that its TransformerConfig refuses
    (middle stages left without layers)."""
    import types

    try:
        from megatron.core.transformer.transformer_block import get_num_layers_to_build
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    except ImportError:
        pytest.skip("needs megatron-core")
    from ckpttool.formats.megatron import pipeline_chunks

    checked, refused = collections.Counter(), 0
    for layers in range(1, 13):
        for pp in range(2, 6):
            for vpp in (1, 2, 3):
                for first in (None, 1, 2, 3, 4):
                    for last in (None, 1, 2):
                        for emb, loss in ((False, False), (True, False), (False, True), (True, True)):
                            if (first or last) and (emb or loss):
                                continue  # megatron-core asserts on it; ckpttool refuses it (below)
                            config = types.SimpleNamespace(
                                num_layers=layers, pipeline_model_parallel_size=pp,
                                num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
                                account_for_embedding_in_pipeline_split=emb, account_for_loss_in_pipeline_split=loss,
                                pipeline_model_parallel_layout=None,
                                virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                            )  # fmt: skip
                            stages = [(p, v if vpp > 1 else None) for p in range(pp) for v in range(vpp)]
                            try:
                                theirs = [
                                    (get_transformer_layer_offset(config, v, p), get_num_layers_to_build(config, v, p))
                                    for p, v in stages
                                ]
                            except (AssertionError, ZeroDivisionError):  # megatron-core fails on it
                                theirs = None
                            try:
                                ours = [c for row in pipeline_chunks(layers, pp, vpp, first, last, embedding=emb,
                                                                     loss=loss) for c in row]  # fmt: skip
                            except ValueError:
                                # refused: megatron-core asserts, or its chunks do not tile the layers
                                tiles = (
                                    theirs is not None
                                    and sorted(i for o, n in theirs if n >= 0 for i in range(o, o + n))
                                    == list(range(layers))
                                    and all(n >= 0 for _, n in theirs)
                                )
                                accepted = tiles and _config_accepts(layers, pp, vpp, first, last, emb, loss)
                                assert not accepted, (layers, pp, vpp, first, last, emb, loss, theirs)
                                refused += 1
                                continue
                            assert ours == theirs, (layers, pp, vpp, first, last, emb, loss)
                            checked[vpp] += 1
    assert min(checked.values()) > 20 and refused > 100, (checked, refused)
    with pytest.raises(ValueError, match="cannot be combined"):
        pipeline_chunks(4, 2, 1, 1, embedding=True)


def test_pipeline_layouts_agree_with_megatron_core():
    """Oracle: --pipeline-model-parallel-layout strings (repetitions, groups, commas, empty stages,
    virtual stages) place the layers as megatron-core's own PipelineParallelLayerLayout does
    (get_layer_offset, get_num_layers_to_build), and the layouts megatron-core's
    validate_layer_layout refuses are refused."""
    import random

    try:
        from megatron.core import parallel_state
        from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    except ImportError:
        pytest.skip("needs megatron-core")
    from ckpttool.formats.megatron import layout_chunks

    fixed = ["Et|tL", "E|tt|tt|L", "Ettt|(tt|)*3,L", "E,t*2|t*2|t*2|t*2,L", "Et|(t|)*4tL", "E(tt|)*2,tt,L"]
    rng = random.Random(8)
    cases = [(text, pp) for text in fixed for pp in (1, 2, 4)]
    for _ in range(300):
        pp, vpp = rng.randint(1, 4), rng.randint(1, 3)
        stages = ["t" * rng.randint(0, 3) for _ in range(pp * vpp)]
        stages[0] = "E" + stages[0] if rng.random() < 0.9 else stages[0]
        stages[-1] += "L" if rng.random() < 0.9 else ""
        cases.append(("|".join(stages), pp))
    checked = refused = 0
    for text, pp in cases:
        layers = text.replace(",", "").count("t")  # before unrolling: only for the fixed ones
        try:
            layout = PipelineParallelLayerLayout(text, pp)
            layers = layout.flatten_layout.count(next(t for t in type(layout.flatten_layout[0])
                                                      if t.name == "decoder"))  # fmt: skip
            layout.validate_layer_layout(layers, None)
            # megatron-core reads the virtual stages only when parallel_state says there are some
            vpp = layout.virtual_pipeline_model_parallel_size
            # the class takes several stages at PP=1; initialize_model_parallel then refuses the
            # interleaved schedule ("pipeline-model-parallel size should be greater than 1")
            assert pp > 1 or vpp == 1
            parallel_state.set_virtual_pipeline_model_parallel_world_size(vpp if vpp > 1 else None)
            theirs = [
                [(layout.get_layer_offset(vp_stage=v, pp_rank=p), layout.get_num_layers_to_build(vp_stage=v, pp_rank=p))
                 for v in range(layout.virtual_pipeline_model_parallel_size)]
                for p in range(pp)
            ]  # fmt: skip
        except (AssertionError, StopIteration, IndexError):
            theirs = None
        try:
            ours = layout_chunks(text, pp, layers)
        except ValueError:
            assert theirs is None, (text, pp)
            refused += 1
            continue
        assert ours == theirs, (text, pp)
        checked += 1
    parallel_state.set_virtual_pipeline_model_parallel_world_size(None)
    assert checked > 150 and refused > 20, (checked, refused)
    # MTP layers (m) leave the decoder's placement as megatron-core's, with the loss or in a stage of
    # their own (megatron-core's standalone MTP), and mtp_chunk names the chunk megatron-core builds
    # them in (mtp_on_this_rank: the layout's count of MTP layers in each (rank, chunk))
    from megatron.core.transformer.enums import LayerType

    from ckpttool.formats.megatron import mtp_chunk

    for text, pp, mtp in [
        ("Et|tmL", 2, 1),
        ("E|t|t|mL", 2, 1),
        ("Ett|ttmmL", 2, 2),
        ("E|t|t|tmL", 4, 1),
        ("Et|t|m|L", 4, 1),  # DeepSeek-V3's: the MTP layer alone in the stage before the loss's
        ("Et|tm|L", 3, 1),
        ("Et|t|t|mm|L|", 3, 2),  # rank 0: Et, mm (its last chunk); the MTP stage on rank 0
        ("E|t|tm|L", 2, 1),
    ]:
        layout = PipelineParallelLayerLayout(text, pp)
        layers = text.count("t")
        layout.validate_layer_layout(layers, mtp)
        vpp = layout.virtual_pipeline_model_parallel_size
        parallel_state.set_virtual_pipeline_model_parallel_world_size(vpp if vpp > 1 else None)
        theirs = [
            [(layout.get_layer_offset(vp_stage=v, pp_rank=p), layout.get_num_layers_to_build(vp_stage=v, pp_rank=p))
             for v in range(vpp)]
            for p in range(pp)
        ]  # fmt: skip
        parallel_state.set_virtual_pipeline_model_parallel_world_size(None)
        assert layout_chunks(text, pp, layers) == theirs, text
        builds = [(p, v) for p in range(pp) for v in range(vpp) if layout.layout[p][v].count(LayerType.mtp)]
        assert [mtp_chunk(text, pp, vpp)] == builds, text
    assert mtp_chunk(None, 2, 3) == (1, 2)  # without a layout: the last stage's last chunk
    # what megatron-core's validate_layer_layout refuses of MTP layers is refused
    for text, pp, message in [
        ("Et|m|L|", 2, "model chunk other than its pipeline rank's last"),  # rank 1's first chunk of two
        ("Et|tm|m|L", 2, "over several stages"),
    ]:
        layers = text.count("t")
        with pytest.raises(AssertionError):
            PipelineParallelLayerLayout(text, pp).validate_layer_layout(layers, text.count("m"))
        with pytest.raises(ValueError, match=message):
            layout_chunks(text, pp, layers)
    with pytest.raises(ValueError, match="transformer layers after MTP layers"):
        layout_chunks("Et|mtL", 2, 2)
    with pytest.raises(ValueError, match="letters"):
        layout_chunks("Ex|tL", 2, 1)


def test_describes_do_not_share_replica_state(monkeypatch):
    """The adapter is one shared object: a describe that runs while another is under way (threads,
    diff of two checkpoints) must not disturb the other's count of replicated pieces."""
    from ckpttool.formats import megatron

    src = FIXTURES / "megatron" / "legacy_tp2pp2"

    def replicas(m):
        return {(n, i): p.replica for n, item in m.items.items() for i, p in enumerate(item.pieces)}

    expected = replicas(registry.describe(src)[1])
    real, nested, calls = megatron.MegatronLegacyAdapter._rank, [], [0]

    def rank(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:  # between the first and second rank file of the outer describe
            nested.append(registry.describe(src)[1])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(megatron.MegatronLegacyAdapter, "_rank", rank)
    outer = registry.describe(src)[1]
    assert replicas(outer) == expected and replicas(nested[0]) == expected
    assert sum(1 for r in expected.values() if r) > 0


def _with_args(tmp_path, **changes):
    """A copy of legacy_tp2pp2 whose rank files' args carry ``changes``."""
    from tests.conftest import rewritten_copy

    return rewritten_copy(tmp_path / "c", MG / "legacy_tp2pp2", lambda obj: obj["args"].__dict__.update(changes))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"pipeline_model_parallel_layout": "Et|tL"}, "(the layout places 2 transformer layers, the model has 4)"),
        (
            {"pipeline_model_parallel_layout": "Ett|ttm|m|L"},
            "(the layout spreads the MTP layers over several stages (megatron-core builds them in one))",
        ),
        ({"pipeline_model_parallel_layout": "E|(t*999999)*5000|L"}, "expands past a million layers"),
        ({"decoder_first_pipeline_num_layers": 5}, "in a way Megatron cannot (the first and last stages' 5 layers"),
        ({"virtual_pipeline_model_parallel_size": 3}, "do not split into VPP=3 model chunks"),
    ],
)
def test_layers_the_args_cannot_place_are_an_error_not_a_guess(changes, message, tmp_path):
    """Legacy rank files number their layers locally; args that do not say how megatron-core placed
    them (a layout that does not hold the layers, or spreads MTP layers over stages, a split
    Megatron would refuse) stop the read with the file named, instead of global names that may be
    wrong."""
    r = run_cli("inspect", _with_args(tmp_path, **changes))
    assert r.code == 3 and message in r.stderr and "mp_rank_00_000/model_optim_rng.pt" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_a_record_whose_metadata_does_not_say_its_chunk_is_named_by_its_key():
    """verify names a damaged torch_dist record by the items describe gives (the layer's, the
    expert's), from the metadata alone; where the metadata does not place the record's chunk
    (fields missing, not integers, outside the tensor), it gives megatron-core's own key, and
    does not fail."""
    from types import SimpleNamespace as NS

    from ckpttool.formats.megatron import _named, _record_item

    info = NS(relative_path="__0_0.distcp", offset=0)
    key = NS(fqn="decoder.layers.mlp.linear_fc1.weight", offset=(1, 0, 0))
    props = NS(dtype="torch.bfloat16")

    def names(*chunks, size=(2, 8, 4)):
        md = NS(state_dict_metadata={key.fqn: NS(size=size, properties=props, chunks=list(chunks))})
        return [i.name for i in _named(_record_item(md, key, info), 2, None, False) if i.pieces]

    assert names(NS(offsets=(0, 0, 0), sizes=(1, 8, 4)), NS(offsets=(1, 0, 0), sizes=(1, 8, 4))) == [
        "decoder.layers.1.mlp.linear_fc1.weight"
    ]
    unplaced = (NS(sizes=(1, 8, 4)), NS(offsets=(1, 0, 0), sizes=(1, 8.0, 4)), NS(offsets=(1, 0, 0), sizes=(2, 8, 4)))
    for chunk in unplaced:
        assert names(chunk) == [key.fqn]
    assert names(NS(offsets=(1, 0, 0), sizes=(1, 8, 4)), size=None) == [key.fqn]
