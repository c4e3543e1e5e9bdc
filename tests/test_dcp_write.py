"""convert --to dcp: torch's own DCP loader reads what ckpttool writes, at any world size."""

from __future__ import annotations


import pytest
import torch
from safetensors.torch import load_file

from ckpttool import registry
from ckpttool.convert import convert
from ckpttool.diff import diff
from ckpttool.export import export
from tests._compare import dcp_load_mismatches, flatten_nested, tensor_mismatches
from tests.conftest import FIXTURES


@pytest.mark.parametrize(("rel", "ranks"), [("megatron/legacy_tp2pp2", 3), ("deepspeed/zero2", 2), ("dcp/mesh2x2", 1)])
def test_dcp_to_torch_save_reads_it(rel, ranks, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / "dcp"
    convert(FIXTURES / rel, out, to="dcp", world_size=ranks)
    _, m = registry.describe(out)
    assert m.format == "dcp" and m.layout.world_size == ranks
    assert not diff(FIXTURES / rel, out).different  # every tensor and plain value kept
    export(FIXTURES / rel, tmp_path / "ref.safetensors")
    dcp_to_torch_save(out, tmp_path / "theirs.pt")
    # written by torch in this test from our output (Megatron's numpy RNG state included)
    theirs = flatten_nested(torch.load(tmp_path / "theirs.pt", weights_only=False))
    assert tensor_mismatches(load_file(tmp_path / "ref.safetensors"), theirs) == []


@pytest.mark.slow
def test_dcp_load_at_two_ranks(tmp_path):
    out = tmp_path / "dcp"
    convert(FIXTURES / "megatron" / "legacy_tp2pp2", out, to="dcp", world_size=3)
    assert dcp_load_mismatches(out, FIXTURES / "megatron" / "legacy_tp2pp2", 2, tmp_path) == []


def test_metadata_is_indexed_and_ordered_as_dcp_writes_it(tmp_path):
    """Resharded to the world size FSDP2 saved at, .metadata holds the state-dict keys in the
    source's order (tensors and objects interleaved as saved), every chunk's MetadataIndex.index
    hint is the one DCP's global plan gave it, and two runs write the same bytes (no staging path)."""
    from torch.distributed.checkpoint import FileSystemReader

    from ckpttool.reshard import Target, reshard

    src = FIXTURES / "dcp" / "fsdp2"
    theirs = FileSystemReader(str(src)).read_metadata()
    world = registry.describe(src)[1].layout.world_size
    a, b = tmp_path / "a", tmp_path / "b"
    reshard(src, a, Target(dp=world))
    reshard(src, b, Target(dp=world))
    ours = FileSystemReader(str(a)).read_metadata()
    assert list(ours.state_dict_metadata) == list(theirs.state_dict_metadata)
    assert {(k.fqn, k.offset): k.index for k in ours.storage_data} == {
        (k.fqn, k.offset): k.index for k in theirs.storage_data
    }
    assert (a / ".metadata").read_bytes() == (b / ".metadata").read_bytes()
