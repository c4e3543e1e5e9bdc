"""Hand-rolled per-rank shard layouts (fixtures written with torch.save under torchrun)."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file

from ckpttool import registry
from ckpttool.errors import CorruptFileError, IncompleteCheckpointError
from ckpttool.export import export
from tests._compare import tensor_mismatches
from tests.conftest import FIXTURES, run_cli

RS = FIXTURES / "rankshards"
TP = RS / "tp_manual" / "step_00000003"


def _anonymous(path):
    """Each rank file of ``path`` saved again into an open file, as a trainer that opens its files
    itself saves: torch names the archive inside ``archive``, not after the file, so a file renamed
    or copied is told only by what it holds (times kept: a newer file reads as an unfinished save)."""
    import os

    for f in sorted(path.glob("*.pt")):
        st = f.stat()
        obj = torch.load(f, weights_only=False)
        with open(f, "wb") as fh:
            torch.save(obj, fh)
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_sharded_embedding_and_moments_assemble(tmp_path):
    adapter, m = registry.describe(TP)
    assert adapter.name == "rankshards" and m.step == 3 and m.layout.world_size == 2
    emb = m.items["model.emb.weight"]
    assert [p.box.offsets for p in emb.pieces] == [(0, 0), (8, 0)]
    export(TP, tmp_path / "o.safetensors")
    got = load_file(tmp_path / "o.safetensors")
    ref = torch.load(RS / "tp_manual.reference.pt", weights_only=True)
    assert tensor_mismatches({k: v for k, v in got.items() if k in ref}, ref) == []
    assert m.missing_state() == ["scheduler"]  # this trainer keeps no LR scheduler


def test_ddp_replicas_and_per_rank_rng():
    _, m = registry.describe(RS / "ddp")
    assert m.layout.world_size == 2
    w = m.items["model.body.0.weight"]
    assert [p.replica for p in w.pieces] == [0, 1]
    assert {"rng.torch_cpu[rank=0]", "rng.torch_cpu[rank=1]", "dataloader.cursor[rank=1]"} <= set(m.items)


def test_pipeline_stages_union():
    _, m = registry.describe(RS / "pipeline")
    params = {n for n, i in m.items.items() if i.kind == "param"}
    assert {"model.body.0.weight", "model.body.2.weight"} <= params
    assert m.step == 3


def test_missing_rank_shard(tmp_path):
    """The missing rank's file is named as its rank would have saved it (the finding named the
    folder, as typed on the command line)."""
    shutil.copytree(RS / "ddp", tmp_path / "ddp")
    (tmp_path / "ddp" / "shard_00001_of_00002.pt").unlink()
    said = "shard_00001_of_00002.pt: rank 1's shard is missing (1 of 2 ranks have no file here)"
    with pytest.raises(IncompleteCheckpointError, match=re.escape(said)) as caught:
        registry.describe(tmp_path / "ddp")
    assert caught.value.path == "shard_00001_of_00002.pt" and caught.value.rule == "missing-file"
    r = run_cli("inspect", tmp_path / "ddp")
    assert r.code == 3 and said in r.stderr
    shutil.copytree(RS / "pipeline", tmp_path / "pipe")
    (tmp_path / "pipe" / "checkpoint_step3_stage0.pt").unlink()
    r = run_cli("verify", tmp_path / "pipe", "--json")
    assert [(f["rule"], f["file"]) for f in json.loads(r.stdout)["findings"]] == [
        ("missing-file", "checkpoint_step3_stage0.pt")
    ]


def test_two_files_claiming_one_rank(tmp_path):
    shutil.copytree(TP, tmp_path / "s")
    shutil.copy(tmp_path / "s" / "shard_00001.pt", tmp_path / "s" / "shard_00001_of_00002.pt")
    with pytest.raises(CorruptFileError, match="both claim rank 1"):
        registry.describe(tmp_path / "s")


@pytest.mark.parametrize(
    ("src", "a", "b", "said"),
    [
        (TP, "shard_00000.pt", "shard_00001.pt", "shard_00001.pt holds rank 0's blocks, shard_00000.pt holds rank 1's"),
        (RS / "pipeline", "checkpoint_step3_stage0.pt", "checkpoint_step3_stage1.pt",
         "checkpoint_step3_stage1.pt holds rank 0's layers, checkpoint_step3_stage0.pt holds rank 1's"),
    ],
)  # fmt: skip
def test_swapped_rank_files_are_misplaced(src, a, b, said, tmp_path):
    """Hand-rolled shards carry no rank, but their tensor-parallel blocks (by global_offset) and
    their pipeline stages' layers (by number) run in rank order: swapped, they run backwards."""
    path = tmp_path / "s"
    shutil.copytree(src, path)
    _anonymous(path)  # (a file's archive name tells its rank: test_a_file_saved_under_another_ranks_name_is_named)
    (path / a).rename(path / "x")
    (path / b).rename(path / a)
    (path / "x").rename(path / b)
    r = run_cli("verify", path)
    assert r.code == 1 and "misplaced-file" in r.stdout and said in r.stdout, r.stdout
    seal = run_cli("seal", path)
    assert seal.code == 3 and "not sealed" in seal.stderr and "put each file back" in seal.stderr
    assert not (path / "ckpttool.manifest.json").exists()
    # the data itself is whole: each block is placed by its own offsets (a copy of the swap
    # is refused all the same: its per-rank RNG and dataloader state would go to the wrong ranks)
    assert run_cli("convert", path, "-o", tmp_path / "o", "--to", "safetensors").code == 3


@pytest.mark.parametrize("blocks", [[0, 0, 1, 1], [0, 1, 0, 1], [1, 1, 0, 0]])
def test_ranks_whose_blocks_are_replicated_have_no_order_to_break(blocks, tmp_path):
    """Tensor parallelism inside data parallelism: two ranks per block, in either mesh order (or
    any other), is not a rank file out of place; nor are clean fixtures."""
    path = tmp_path / "s"
    path.mkdir()
    full = torch.arange(32.0).reshape(8, 4)
    for rank, block in enumerate(blocks):
        local = full[4 * block : 4 * block + 4].clone()
        torch.save({"w": {"local": local, "global_shape": [8, 4], "global_offset": [4 * block, 0]}, "step": 1},
                   path / f"shard_{rank:05d}.pt")  # fmt: skip
    assert "findings" not in registry.describe(path)[1].extras
    for clean in (RS / "ddp", RS / "pipeline", TP):
        assert "findings" not in registry.describe(clean)[1].extras
    # one rank per block, backwards: out of place
    for rank in range(2):
        local = full[4 * (1 - rank) : 4 * (2 - rank)].clone()
        torch.save({"w": {"local": local, "global_shape": [8, 4], "global_offset": [4 * (1 - rank), 0]}, "step": 1},
                   tmp_path / f"shard_{rank:05d}.pt")  # fmt: skip
    (found,) = registry.describe(tmp_path)[1].extras["findings"]
    assert found["rule"] == "misplaced-file" and found["file"] == "shard_00001.pt"


@pytest.mark.parametrize("major", ["rows follow the fast rank index", "rows follow the slow rank index"])
def test_a_2d_mesh_has_its_rank_orders(major, tmp_path):
    """Blocks cut along two dimensions follow the ranks with either mesh dimension the fast rank
    index: both are clean, and files swapped break both."""
    full = torch.arange(64.0).reshape(8, 8)
    for rank in range(4):
        fast, slow = rank % 2, rank // 2
        r, c = (fast, slow) if major.endswith("fast rank index") else (slow, fast)
        local = full[4 * r : 4 * r + 4, 4 * c : 4 * c + 4].clone()
        torch.save({"w": {"local": local, "global_shape": [8, 8], "global_offset": [4 * r, 4 * c]}, "step": 1},
                   tmp_path / f"shard_{rank:05d}.pt")  # fmt: skip
    _anonymous(tmp_path)
    assert "findings" not in registry.describe(tmp_path)[1].extras
    # two files swapped: the ranks follow the grid in neither order, and the two are named (ranks 1
    # and 2 swapped in a 2×2 grid make it the other order: no finding tells those apart)
    for a, b in ((0, 3), (0, 1), (2, 3)):
        x, y = tmp_path / f"shard_{a:05d}.pt", tmp_path / f"shard_{b:05d}.pt"
        x.rename(tmp_path / "x")
        y.rename(x)
        (tmp_path / "x").rename(y)
        (found,) = registry.describe(tmp_path)[1].extras["findings"]
        assert found["rule"] == "misplaced-file", found
        assert f"{y.name} holds rank {a}'s blocks, {x.name} holds rank {b}'s blocks" in found["message"], found
        assert "the 2×2 grid of w's blocks (cut along dimensions [0, 1]) holds, row by row, ranks" in found["message"]
        y.rename(tmp_path / "x")
        x.rename(y)
        (tmp_path / "x").rename(x)
    assert "findings" not in registry.describe(tmp_path)[1].extras


def test_stages_of_different_stacks_have_no_order_to_break(tmp_path):
    """A vision tower's blocks 12..13 on stage 0 and a language model's layers 0..1 on stage 1
    are two stacks: their numbers are not compared."""
    for p, names in enumerate([["vision.blocks.12.w", "vision.blocks.13.w"], ["llm.layers.0.w", "llm.layers.1.w"]]):
        torch.save({"model": {n: torch.ones(2) for n in names}, "iteration": 3},
                   tmp_path / f"checkpoint_step3_stage{p}.pt")  # fmt: skip
    assert "findings" not in registry.describe(tmp_path)[1].extras


def _stage_files(path, *, tie=True):
    """What a hand-rolled pipeline trainer saves: each stage's own ``nn.Sequential`` (numbered from
    0), its Adam optimizer's state dict (parameters numbered from 0), its RNG, and on the first and
    last stage a tied embedding."""
    torch.manual_seed(0)
    emb = torch.randn(6, 8)
    stages = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)),
              torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))]  # fmt: skip
    path.mkdir()
    for p, stage in enumerate(stages):
        opt = torch.optim.Adam(stage.parameters())
        stage(torch.randn(2, 8)).sum().backward()
        opt.step()
        sd = {"model": {**stage.state_dict(), **({"embed.weight": emb} if tie else {})},
              "optimizer": opt.state_dict(), "iteration": 3, "rng": torch.get_rng_state()}  # fmt: skip
        torch.save(sd, path / f"checkpoint_step3_stage{p}.pt")
    return stages


def test_stages_numbering_their_layers_from_0_are_numbered_across_stages(tmp_path):
    """Each stage's own Sequential and optimizer number from 0: the same name on two stages is two
    layers (of other shapes, or other values), not one replicated; names go on across stages."""
    path = tmp_path / "s"
    stages = _stage_files(path)
    _, m = registry.describe(path)
    assert "stage_numbering" in m.extras
    model = {n for n, i in m.items.items() if n.startswith("model.")}
    assert model == {"model.embed.weight", *(f"model.{i}.{w}" for i in range(5) for w in ("weight", "bias"))}
    assert len(m.items["model.embed.weight"].pieces) == 2  # the tied embedding: a replica on each
    assert m.items["model.4.weight"].shape == (4, 8) and m.items["optimizer.state.9.exp_avg"].shape == (4,)
    assert {"optimizer.param_groups.0.params", "optimizer.param_groups.1.params", "rng[rank=1]"} <= set(m.items)
    r = run_cli("verify", "--deep", path, "--fail-on", "error", "--json")
    assert r.code == 0, r.stdout
    export(path, tmp_path / "o.safetensors")
    got = load_file(tmp_path / "o.safetensors")
    want = {f"model.{n // 2}.{k.split('.')[-1]}": v for n, (k, v) in enumerate(
        (k, v) for s in stages for k, v in s.state_dict().items())}  # fmt: skip
    assert tensor_mismatches({k: got[k] for k in want}, want) == []
    second = torch.load(path / "checkpoint_step3_stage1.pt", weights_only=True)
    assert torch.equal(got["optimizer.state.6.exp_avg_sq"], second["optimizer"]["state"][2]["exp_avg_sq"])


def test_a_tied_embedding_altered_on_one_stage_still_differs(tmp_path):
    path = tmp_path / "s"
    _stage_files(path)
    sd = torch.load(path / "checkpoint_step3_stage1.pt", weights_only=True)
    sd["model"]["embed.weight"][0, 0] += 1
    torch.save(sd, path / "checkpoint_step3_stage1.pt")
    r = run_cli("verify", path)
    assert r.code == 1 and "replica-mismatch" in r.stdout and "model.embed.weight" in r.stdout, r.stdout


@pytest.mark.parametrize(
    ("stages", "names"),
    [
        # numbered across stages: in turn (the pipeline fixture's way), or interleaved
        ([["layers.0.w", "layers.1.w"], ["layers.2.w", "layers.3.w"]], None),
        ([["layers.0.w", "layers.2.w"], ["layers.1.w", "layers.3.w"]], None),
        # each stage on its own: gaps (a ReLU in a Sequential; an optimizer state of a parameter
        # without a gradient) are kept, the next stage going on after the highest number
        ([["layers.0.w", "layers.2.w"], ["layers.0.w", "layers.1.w"]], ["layers.0.w", "layers.2.w", "layers.3.w", "layers.4.w"]),
        ([["optimizer.state.1.exp_avg"], ["optimizer.state.0.exp_avg", "optimizer.state.1.exp_avg"]],
         ["optimizer.state.1.exp_avg", "optimizer.state.2.exp_avg", "optimizer.state.3.exp_avg"]),
        # a stage's bare state dict ("0.weight"): its stack has no name
        ([["0.w", "2.w"], ["0.w"]], ["0.w", "2.w", "3.w"]),
    ],
)  # fmt: skip
def test_stage_numbering(stages, names, tmp_path):
    """Stages numbered across stages keep their names; stages numbering on their own are numbered
    across (a name on two stages is two layers, of other shapes or other values)."""
    assert "stage_numbering" not in registry.describe(RS / "pipeline")[1].extras
    for p, held in enumerate(stages):
        tree: dict = {}
        for n in held:
            *path, leaf = n.split(".")
            node = tree
            for k in path:
                node = node.setdefault(int(k) if k.isdigit() and path[0] == "optimizer" else k, {})
            node[leaf] = torch.full((p + 2,), float(p))
        torch.save({**tree, "iteration": 3}, tmp_path / f"checkpoint_step3_stage{p}.pt")
    _, m = registry.describe(tmp_path)
    tensors = sorted(n for n, i in m.items.items() if i.is_tensor)
    if names is None:
        assert "stage_numbering" not in m.extras and tensors == sorted(n for s in stages for n in s)
    else:
        assert "stage_numbering" in m.extras and tensors == sorted(names), tensors
        if not names[0].startswith("optimizer"):  # (moments with no parameters: optimizer-mismatch)
            assert run_cli("verify", tmp_path).code == 0


def test_a_swap_between_two_meshes_names_the_two_ranks(tmp_path):
    """Two stages of a pipeline, each a 2×2 mesh on ranks {0, 1, 4, 5} and {2, 3, 6, 7}: ranks 4
    and 7 swapped leave each stage's grid with a rank of the other's, and the exchange that mends
    both names them (not 5 and 7 from the sorted ranks of one grid)."""
    full = torch.arange(64.0).reshape(8, 8)
    stages = {"w0": [0, 1, 4, 5], "w1": [2, 3, 6, 7]}
    files = {r: {"step": 1} for r in range(8)}
    for name, ranks in stages.items():
        for k, rank in enumerate(ranks):
            r, c = divmod(k, 2)
            files[rank][name] = {"local": full[4 * r : 4 * r + 4, 4 * c : 4 * c + 4].clone(), "global_shape": [8, 8],
                                 "global_offset": [4 * r, 4 * c]}  # fmt: skip
    for rank, tree in files.items():
        torch.save(tree, tmp_path / f"shard_{rank:05d}.pt")
    _anonymous(tmp_path)
    assert "findings" not in registry.describe(tmp_path)[1].extras
    a, b = tmp_path / "shard_00004.pt", tmp_path / "shard_00007.pt"
    a.rename(tmp_path / "x")
    b.rename(a)
    (tmp_path / "x").rename(b)
    (found,) = registry.describe(tmp_path)[1].extras["findings"]
    assert "shard_00007.pt holds rank 4's blocks, shard_00004.pt holds rank 7's blocks" in found["message"], found


def _save_blocks(path, world, tensors):
    """Shard files of ``world`` ranks; ``tensors``: name -> (global shape, {rank: (offsets, sizes)})."""
    files = {r: {"step": 1} for r in range(world)}
    for name, (shape, blocks) in tensors.items():
        full = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
        for rank, (offsets, sizes) in blocks.items():
            local = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))].clone()
            files[rank][name] = {"local": local, "global_shape": list(shape), "global_offset": list(offsets)}
    for rank, tree in files.items():
        with open(path / f"shard_{rank:05d}.pt", "wb") as fh:  # (the archive inside named "archive")
            torch.save(tree, fh)


def test_layouts_no_order_can_be_read_from_are_not_judged(tmp_path):
    """DTensor places an empty block at the end of its dimension (a length of 7 cut in 2 then in
    3: rank 2's block is empty, at offset 7), and a trainer that saves each replicated block once
    picks the rank it likes (TP blocks of a dp=2 × tp=4 mesh saved by ranks 4, 1, 6, 3): neither
    is a file out of place."""
    empty = tmp_path / "empty"
    empty.mkdir()
    blocks = {0: (0, 2), 1: (2, 2), 2: (7, 0), 3: (4, 1), 4: (5, 1), 5: (6, 1)}
    _save_blocks(empty, 6, {"w": ((7,), {r: ((o,), (n,)) for r, (o, n) in blocks.items()})})
    spread = tmp_path / "spread"
    spread.mkdir()
    _save_blocks(spread, 8, {"w": ((8, 4), {r: ((2 * b, 0), (2, 4)) for b, r in enumerate([4, 1, 6, 3])})})
    for path in (empty, spread):
        assert "findings" not in registry.describe(path)[1].extras, path
        assert run_cli("verify", path).code == 0


def test_optimizer_state_keyed_by_parameter_names_follows_them(tmp_path):
    """Stage 0's last layer frozen (no optimizer state): state keyed by the parameters' names
    ('optim.state.2.weight.exp_avg') is numbered as the parameters are, not on its own."""
    torch.manual_seed(0)
    for p, shapes in enumerate([[(8, 8), (8, 8), (4, 8)], [(8, 4), (8, 8)]]):
        model = torch.nn.Sequential(*(torch.nn.Linear(i, o) for o, i in shapes))
        if p == 0:
            model[2].requires_grad_(False)
        named = {n: q for n, q in model.named_parameters() if q.requires_grad}
        opt = torch.optim.Adam(named.values())
        sum((q + 1).pow(2).sum() for q in named.values()).backward()
        opt.step()
        state = {list(named)[i]: v for i, v in opt.state_dict()["state"].items()}
        torch.save({"model": model.state_dict(), "optim": {"state": state}, "step": 1},
                   tmp_path / f"checkpoint_step1_stage{p}.pt")  # fmt: skip
    _, m = registry.describe(tmp_path)
    assert m.items["model.3.weight"].shape == m.items["optim.state.3.weight.exp_avg"].shape == (8, 4)
    assert "optim.state.2.weight.exp_avg" not in m.items  # (the frozen layer's)
    report = json.loads(run_cli("verify", tmp_path, "--json").stdout)
    assert [f["rule"] for f in report["findings"] if f["severity"] == "error"] == [], report["findings"]


def _copy_over(src, dst):
    """``cp -p``: the copy keeps the source's times (no incomplete-save finding from a new file)."""
    shutil.copy2(src, dst)


@pytest.mark.parametrize("saved", ["as torch.save names it", "into an open file"])
def test_a_rank_file_copied_over_another_is_named(saved, tmp_path):
    """Rank 0's file copied over rank 1's reads as a valid rank-1 file holding rank 0's blocks: verify
    said only that half of each sharded tensor was in no piece, naming no file. The archive inside
    the copy is named after rank 0's file; without that name (a file saved into an open file), the
    blocks tell: only rank 1 holding the missing rows keeps them in rank order."""
    ck = tmp_path / "ck"
    shutil.copytree(TP, ck)
    if saved == "into an open file":
        _anonymous(ck)
    _copy_over(ck / "shard_00000.pt", ck / "shard_00001.pt")
    r = run_cli("verify", ck, "--json")
    found = [f for f in json.loads(r.stdout)["findings"] if f["rule"] == "misplaced-file"]
    assert r.code == 1 and len(found) == 1, r.stdout
    assert found[0]["file"] == "shard_00001.pt"
    message = found[0]["message"]
    if saved == "into an open file":
        assert message.startswith("shard_00001.pt holds the same bytes as shard_00000.pt: the block [0:8, 0:8]"), message
        assert "shard_00000.pt was copied over rank 1's file" in message
    else:
        assert message.startswith("shard_00001.pt is a copy of shard_00000.pt: shard_00000.pt was copied over it "
                                  "(torch.save names the archive inside a file after the file; shard_00001.pt's is "
                                  "shard_00000/)"), message  # fmt: skip
    assert run_cli("seal", ck).code == 3 and not (ck / "ckpttool.manifest.json").exists()


@pytest.mark.parametrize(
    ("world", "block_of", "src", "dst", "named"),
    [
        (4, lambda r: r % 2, 0, 3, None),  # TP=2 x DP=2: either mesh dimension may be the TP one
        (4, lambda r: r % 2, 1, 2, None),
        (4, lambda r: r % 2, 0, 1, None),
        (4, lambda r: r, 0, 2, 2),  # TP=4: one rank a block, in rank order only with rank 2 moved back
        (4, lambda r: (r // 2, r % 2), 0, 3, 3),  # a 2x2 grid of blocks
    ],
)
def test_a_copy_among_blocks_names_what_the_blocks_tell(world, block_of, src, dst, named, tmp_path):
    """Files saved into open files (no archive name to go by). Clean, no finding, though replicated
    ranks' files hold the same bytes. A file copied over another leaves a block in one file too
    many and another in one too few (or in none); the copy is named where one file of the same
    bytes alone, moved to the blocks too few hold, lays every tensor out as a mesh does, else the
    files of the same bytes are named together."""
    places = {r: (b, 0) if isinstance(b := block_of(r), int) else b for r in range(world)}
    blocks = {r: ((2 * row, 4 * col), (2, 4)) for r, (row, col) in places.items()}
    shape = (2 * (max(p[0] for p in places.values()) + 1), 4 * (max(p[1] for p in places.values()) + 1))
    _save_blocks(tmp_path, world, {"w": (shape, blocks)})
    assert "findings" not in registry.describe(tmp_path)[1].extras
    assert run_cli("verify", tmp_path).code == 0
    _copy_over(tmp_path / f"shard_{src:05d}.pt", tmp_path / f"shard_{dst:05d}.pt")
    (found,) = registry.describe(tmp_path)[1].extras["findings"]
    assert found["rule"] == "misplaced-file", found
    if named is None:
        assert "hold the same bytes" in found["message"] and "the blocks do not tell" in found["message"], found
        assert f"shard_{dst:05d}.pt" in found["message"] and f"shard_{src:05d}.pt" in found["message"]
    else:
        assert found["file"] == f"shard_{named:05d}.pt", found
        assert f"was copied over rank {named}'s file" in found["message"], found


def test_a_file_saved_under_another_ranks_name_is_named(tmp_path):
    """torch.save names the archive inside a file after the file, and a rename or copy keeps it:
    DDP rank files (replicated weights, each rank its own RNG) swapped verified clean, as nothing
    in their tensors differs. A save to a temporary name renamed into place is no finding."""
    ck = tmp_path / "ddp"
    shutil.copytree(RS / "ddp", ck)
    a, b = ck / "shard_00000_of_00002.pt", ck / "shard_00001_of_00002.pt"
    a.rename(ck / "x")
    b.rename(a)
    (ck / "x").rename(b)
    r = run_cli("verify", ck, "--json")
    (found,) = [f for f in json.loads(r.stdout)["findings"] if f["rule"] == "misplaced-file"]
    assert r.code == 1 and found["file"] == a.name, r.stdout
    assert found["message"].startswith(f"{a.name} and {b.name} were swapped: each was saved under the other's name")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    for rank in range(2):
        torch.save({"w": torch.ones(2), "step": 1}, tmp / f"shard_{rank:05d}.pt.tmp")
        (tmp / f"shard_{rank:05d}.pt.tmp").rename(tmp / f"shard_{rank:05d}.pt")
    assert "findings" not in registry.describe(tmp)[1].extras
    assert run_cli("verify", tmp).code == 0


def test_a_folder_of_saves_side_by_side_reads_the_latest(tmp_path):
    """A run that keeps every save's checkpoint_step<s>_stage<p>.pt files in one folder: two saves'
    files both claimed each stage ("one is a stray copy"), an error on a clean folder. The latest
    save is the checkpoint, the earlier saves' files are listed beside it (a warning), and a stage
    missing from the latest is missing though it was the last one (the earlier save has it)."""
    ck = tmp_path / "run"
    shutil.copytree(FIXTURES / "rankshards" / "pipeline", ck)
    for stage in (0, 1):
        obj = torch.load(ck / f"checkpoint_step3_stage{stage}.pt", weights_only=False)
        obj["iteration"] = 2
        torch.save(obj, ck / f"checkpoint_step2_stage{stage}.pt")
    r = run_cli("verify", ck, "--json")
    report = json.loads(r.stdout)
    assert r.code == 0 and report["step"] == 3, report
    (extra,) = [f for f in report["findings"] if f["rule"] == "extra-file"]
    assert extra["severity"] == "warning" and "2 file(s) of earlier saves (step 2)" in extra["message"], extra
    (ck / "checkpoint_step3_stage1.pt").unlink()
    r = run_cli("verify", ck, "--json")
    errors = [(f["rule"], f["file"]) for f in json.loads(r.stdout)["findings"] if f["severity"] == "error"]
    assert r.code == 1 and errors == [("missing-file", "checkpoint_step3_stage1.pt")], r.stdout


def test_saves_side_by_side_beside_a_file_of_another_naming_is_no_internal_error(tmp_path):
    """A shard_<rank>.pt among several saves' checkpoint_step<s>_stage<p>.pt files: the look for
    each file's step read a group its name has none of (an internal error's text); it is one more
    file claiming a rank."""
    ck = tmp_path / "run"
    shutil.copytree(FIXTURES / "rankshards" / "pipeline", ck)
    shutil.copy2(ck / "checkpoint_step3_stage0.pt", ck / "checkpoint_step2_stage0.pt")
    shutil.copy2(FIXTURES / "rankshards" / "ddp" / "shard_00000_of_00002.pt", ck / "shard_0.pt")
    r = run_cli("verify", ck, "--json")
    said = " ".join(f["message"] for f in json.loads(r.stdout)["findings"])
    assert r.code == 1 and "both claim rank 0" in said and "IndexError" not in said, said


@pytest.mark.parametrize(
    ("fixture", "stray", "like"),
    [
        ("ddp", "shard_00002_of_00003.pt", "shard_00001_of_00002.pt"),  # a 3-rank save's file
        ("ddp", "shard_00002_of_00002.pt", "shard_00001_of_00002.pt"),  # a rank beyond its own world size
        ("ddp", "shard_00000_of_00001.pt", "shard_00000_of_00002.pt"),  # a smaller save's, sorting first
        ("tp_manual/step_00000003", "shard_00002.pt", "shard_00001.pt"),  # beyond metadata.json's world_size
    ],
)
def test_a_rank_file_of_another_layout_is_an_extra_file(fixture, stray, like, tmp_path):
    """A rank file beyond the save's world size (a leftover of a save at more ranks) passed verify
    and was read as one more rank (its tensors a replica, or a replica-mismatch, never named as a
    file of another layout); the world size was the last listed file's. It is now an extra-file
    warning and not read; the save's ranks are what they were."""
    from ckpttool.verify import verify

    path = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "rankshards" / fixture, path)
    shutil.copy2(path / like, path / stray)
    report = verify(path)
    assert not report.failing(), report.findings
    (found,) = [f for f in report.findings if f.rule == "extra-file"]
    assert found.severity == "warning" and stray in found.message and "another layout" in found.message
    _, m = registry.describe(path)
    _, clean = registry.describe(FIXTURES / "rankshards" / fixture)
    assert m.layout.world_size == clean.layout.world_size == 2
    assert {n: [p.file for p in i.pieces] for n, i in m.items.items()} == {
        n: [p.file for p in i.pieces] for n, i in clean.items.items()
    }
    assert next(f for f in m.files if f.path == stray).role == "aux"
