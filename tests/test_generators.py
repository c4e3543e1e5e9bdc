"""The fixture generators still drive the real writers, and ckpttool reads what they write today.

Slow (one torchrun of 4 gloo ranks): marked ``slow``; CI runs it once per submission.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from ckpttool import registry
from ckpttool.export import export
from tests._compare import tensor_mismatches
from tests.conftest import FIXTURES

pytestmark = pytest.mark.slow


def test_dcp_generator_round_trip(tmp_path):
    names = ["fsdp2", "fsdp2_zstd", "fsdp2_ranklocal", "mesh2x2", "hostile"]
    proc = subprocess.run(
        [sys.executable, str(FIXTURES / "make_dcp_fixtures.py"), "--out", str(tmp_path), "--only", *names],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in names[:-1]:
        out = tmp_path / f"{name}.safetensors"
        export(tmp_path / "dcp" / name, out)
        ref = torch.load(tmp_path / "dcp" / f"{name}.reference.pt", weights_only=True)
        assert tensor_mismatches(load_file(out), ref) == [], name
        # the committed fixture and the fresh one describe the same items
        _, fresh = registry.describe(tmp_path / "dcp" / name)
        _, committed = registry.describe(FIXTURES / "dcp" / name)
        assert {k: (i.dtype, i.shape, len(i.pieces)) for k, i in fresh.items.items()} == {
            k: (i.dtype, i.shape, len(i.pieces)) for k, i in committed.items.items()
        }
    assert sorted(p.name for p in (tmp_path / "hostile").iterdir()) == sorted(
        p.name for p in (FIXTURES / "hostile").iterdir() if p.name.startswith("dcp_")
    )


def test_hf_trainer_generator(tmp_path):
    """transformers' Trainer writes the checkpoint ckpttool reads as the committed one: the model
    and the state files beside it, which hold what the run had in memory at the end."""
    pytest.importorskip("transformers", reason="needs transformers and accelerate (a generator, not a dependency)")
    proc = subprocess.run(
        [sys.executable, str(FIXTURES / "make_hf_fixtures.py"), "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    fresh = tmp_path / "hf" / "trainer" / "checkpoint-3"
    ref = torch.load(tmp_path / "hf" / "trainer.reference.pt", weights_only=True)
    export(fresh, tmp_path / "model.safetensors")
    assert tensor_mismatches(load_file(tmp_path / "model.safetensors"), ref["model"]) == []
    optimizer = torch.load(fresh / "optimizer.pt", weights_only=True)
    assert optimizer["param_groups"] == ref["optimizer"]["param_groups"]
    assert all(
        torch.equal(v, ref["optimizer"]["state"][i][k]) for i, s in optimizer["state"].items() for k, v in s.items()
    )
    _, m = registry.describe(fresh)
    _, committed = registry.describe(FIXTURES / "hf" / "trainer" / "checkpoint-3")
    assert m.missing_state() == [] and m.step == committed.step == 3
    assert m.extras["state_files"] == committed.extras["state_files"]
    assert {k: (i.dtype, i.shape) for k, i in m.items.items()} == {
        k: (i.dtype, i.shape) for k, i in committed.items.items()
    }


def test_dtensor_generator_round_trip(tmp_path):
    """torch.save of FSDP2 and tensor-parallel DTensors per rank, under torchrun: the generator checks
    that ckpttool assembles each layout's tensors as full_tensor() gave them, and the fresh files
    describe as the committed ones."""
    proc = subprocess.run(
        [sys.executable, str(FIXTURES / "make_dtensor_shards_fixtures.py"), "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for layout in ("fsdp2_tp", "fsdp2_uneven", "placements", "strided", "submesh"):
        _, fresh = registry.describe(tmp_path / "dtensor" / layout)
        _, committed = registry.describe(FIXTURES / "dtensor" / layout)
        assert {k: (i.dtype, i.shape, [p.box for p in i.pieces]) for k, i in fresh.items.items()} == {
            k: (i.dtype, i.shape, [p.box for p in i.pieces]) for k, i in committed.items.items()
        }
