"""Hand-rolled per-rank shard layouts (fixtures written with torch.save under torchrun)."""

from __future__ import annotations

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
    shutil.copytree(RS / "ddp", tmp_path / "ddp")
    (tmp_path / "ddp" / "shard_00001_of_00002.pt").unlink()
    with pytest.raises(IncompleteCheckpointError, match=r"1 of 2 rank shards missing \(ranks 1\)"):
        registry.describe(tmp_path / "ddp")
    r = run_cli("inspect", tmp_path / "ddp")
    assert r.code == 3 and "rank shards missing" in r.stderr


def test_two_files_claiming_one_rank(tmp_path):
    shutil.copytree(TP, tmp_path / "s")
    shutil.copy(tmp_path / "s" / "shard_00001.pt", tmp_path / "s" / "shard_00001_of_00002.pt")
    with pytest.raises(CorruptFileError, match="both claim rank 1"):
        registry.describe(tmp_path / "s")
