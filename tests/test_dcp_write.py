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


def test_an_empty_dict_is_not_written_so_dcp_load_of_the_same_state_dict_works(tmp_path):
    """A torch.save state dict holding an empty dict (a disabled GradScaler's state_dict(), {}):
    convert --to dcp wrote it as an entry, which torch's dcp.save never does, and dcp.load of the
    same nested state dict then failed ("Missing key in checkpoint state_dict: optim.param_groups").
    It is left out, as torch leaves it, and the plan says so."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from tests.conftest import run_cli

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()

    def state():
        return {"model": model.state_dict(), "optim": opt.state_dict(), "scaler": {}, "step": 1}

    torch.save(state(), tmp_path / "ckpt.pt")
    r = run_cli("convert", tmp_path / "ckpt.pt", "-o", tmp_path / "dcp", "--to", "dcp")
    assert r.code == 0 and "not written: scaler (an empty dict" in r.stdout + r.stderr, r.stdout + r.stderr
    target = state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=str(tmp_path / "dcp"))
    assert torch.equal(target["model"]["weight"], model.weight) and target["step"] == 1
    assert run_cli("diff", tmp_path / "ckpt.pt", tmp_path / "dcp").code == 0
