"""convert --to safetensors: sharded Hugging Face layout, same tensors, atomic."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from ckpttool.convert import convert, parse_size
from ckpttool.diff import diff
from ckpttool.errors import UsageError
from tests.conftest import FIXTURES, run_cli


@pytest.mark.parametrize("rel", ["dcp/mesh2x2", "megatron/legacy_tp2pp2", "deepspeed/zero3"])
def test_sharded_safetensors_holds_the_same_tensors(rel, tmp_path):
    out = tmp_path / "hf"
    result = convert(FIXTURES / rel, out, max_shard_size="8KB")
    assert len(result.files) > 2 and "model.safetensors.index.json" in result.files
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == result.nbytes
    loaded = {}
    for shard in set(index["weight_map"].values()):
        loaded.update(load_file(out / shard))  # the safetensors library reads every shard
    assert set(loaded) == set(index["weight_map"])
    report = diff(FIXTURES / rel, out)
    assert report.compared == result.tensors and not report.values and not report.changed_meta


def test_single_file_when_it_fits_and_cli(tmp_path):
    r = run_cli("convert", FIXTURES / "dcp" / "fsdp2", "-o", tmp_path / "hf", "--kind", "param")
    assert r.code == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["model.safetensors"]
    assert run_cli("convert", FIXTURES / "dcp" / "fsdp2", "-o", tmp_path / "hf").code == 2  # exists
    assert run_cli("convert", FIXTURES / "dcp" / "fsdp2", "-o", tmp_path / "x", "--to", "megatron").code == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # nothing half-written


def test_sizes():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size("1000") == 1000
    with pytest.raises(UsageError):
        parse_size("lots")
