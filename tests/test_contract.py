"""Contracts that must change only on purpose: CLI surface, generated docs, manifest JSON."""

from __future__ import annotations

import json

import pytest

from ckpttool import _docs, registry
from ckpttool.formats.base import Adapter, Detection
from ckpttool.manifest import Manifest
from tests.conftest import DCP_FIXTURES, FIXTURES

CLI_SURFACE = {
    "inspect": {"path", "--json", "--help"},
    "ls": {"path", "--filter", "--json", "--help"},
    "export": {"path", "--output", "--filter", "--kind", "--split-rule", "--force", "--json", "--quiet", "--help"},
    "seal": {"path", "--out", "--hash", "--workers", "--json", "--quiet", "--help"},
    "diff": {"a", "b", "--atol", "--rtol", "--tolerance", "--filter", "--map", "--kind", "--json", "--quiet",
             "--help"},
    "reshard": {"src", "--output", "--tp", "--pp", "--vpp", "--pp-first-layers", "--pp-last-layers", "--pipeline-layout", "--dp", "--ep", "--etp",
                "--to", "--workers", "--device", "--max-memory", "--split-rule", "--vocab-padding", "--distributed-optimizer", "--zero-stage", "--sub-group-size", "--dry-run",
                "--no-seal", "--force", "--json", "--quiet", "--help"},
    "delta create": {"base", "target", "--output", "--workers", "--force", "--json", "--quiet", "--help"},
    "delta apply": {"base", "delta", "--output", "--workers", "--force", "--quiet", "--help"},
    "delta info": {"delta", "--json", "--help"},
    "convert": {"src", "--output", "--to", "--max-shard-size", "--world-size", "--kind", "--filter", "--split-rule", "--force",
                "--no-seal", "--json", "--quiet", "--help"},
    "compress": {"path", "--output", "--workers", "--force", "--json", "--quiet", "--help"},
    "decompress": {"packed", "--output", "--workers", "--force", "--quiet", "--help"},
    "rehearse": {"path", "--harness", "--steps", "--runs", "--tolerance", "--device", "--timeout", "--json", "--help"},
    "verify": {"path", "--manifest", "--deep", "--require", "--fail-on", "--report", "--junit", "--workers", "--json",
               "--quiet", "--help"},
}


def test_cli_surface_is_frozen():
    from typer.main import get_command

    from ckpttool.cli import app

    group = get_command(app)
    surface = {}

    def walk(prefix: str, commands: dict) -> None:
        for name, cmd in commands.items():
            if hasattr(cmd, "commands"):
                walk(f"{prefix}{name} ", cmd.commands)
                continue
            opts = set()
            for p in cmd.params:
                opts |= {o for o in p.opts if o.startswith("--")} if p.opts[0].startswith("-") else {p.name}
            opts.add("--help")
            surface[prefix + name] = opts

    walk("", group.commands)  # type: ignore[attr-defined]
    assert surface == CLI_SURFACE, "a CLI change: update CLI_SURFACE and docs/cli.md on purpose"


@pytest.mark.parametrize("name", sorted(_docs.generated()))
def test_generated_docs_are_current(name):
    text = (_docs.DOCS / name).read_text()
    assert text == _docs.generated()[name], f"docs/{name} is stale: run python -m ckpttool._docs"


@pytest.mark.parametrize("path", [f"dcp/{n}" for n in DCP_FIXTURES] + ["safetensors/sharded", "torch/train_state.pt"])
def test_manifest_json_round_trip(path):
    _, m = registry.describe(FIXTURES / path)
    data = json.loads(json.dumps(m.to_json_dict()))
    assert data["schema_version"] == 1
    assert Manifest.from_json_dict(data) == m


DS_FIXTURES = ["zero0", "zero1", "zero2", "zero2_elastic", "zero2_bf16", "zero3", "bf16_zero0", "bf16_optimizer", "pipeline", "pipeline_tied", "pipeline_bf16", "tp2", "tp2_glu", "autotp", "universal"]
ALL_FIXTURES = [FIXTURES / "dcp" / n for n in DCP_FIXTURES] + [FIXTURES / "deepspeed" / n for n in DS_FIXTURES] + [
    FIXTURES / "rankshards" / "tp_manual" / "step_00000003",
    FIXTURES / "rankshards" / "ddp",
    FIXTURES / "rankshards" / "pipeline",
    *(FIXTURES / "dtensor" / n for n in ("fsdp2_tp", "fsdp2_uneven", "placements", "strided", "submesh")),
    *(FIXTURES / "megatron" / n for n in ("dist_tp2", "dist_tp2pp2", "legacy_tp2pp2", "legacy_tp2pp2_distopt")),
    *(FIXTURES / "megatron" / n for n in ("legacy_pp2vpp2", "legacy_pp2vpp2_distopt", "dist_pp2vpp2")),
    FIXTURES / "megatron" / "legacy_pp2ep2",
    FIXTURES / "megatron" / "legacy_pp2layout",
    FIXTURES / "megatron" / "dist_pp2ep2",
    FIXTURES / "megatron" / "legacy_pp2ep2_distopt",
    FIXTURES / "megatron" / "legacy_tp2ep2etp1",
    FIXTURES / "dcp" / "fsdp2_hf" / "sharded",
    FIXTURES / "dcp" / "fsdp2_hf",
    FIXTURES / "safetensors" / "model.safetensors",
    FIXTURES / "safetensors" / "sharded",
    FIXTURES / "torch" / "train_state.pt",
]
EXPECTED = {
    "megatron/dist_tp2": "megatron-dist",
    "megatron/dist_tp2pp2": "megatron-dist",
    "megatron/dist_pp2vpp2": "megatron-dist",
    "megatron/dist_pp2ep2": "megatron-dist",
    "dcp/fsdp2_hf": "safetensors", "safetensors/model.safetensors": "safetensors",
    "safetensors/sharded": "safetensors", "torch/train_state.pt": "torch",
    **{f"dtensor/{n}": "rankshards" for n in ("fsdp2_tp", "fsdp2_uneven", "placements", "strided", "submesh")}}


@pytest.mark.parametrize("path", ALL_FIXTURES, ids=lambda p: str(p.relative_to(FIXTURES)))
def test_exactly_one_adapter_claims_each_fixture(path):
    claims = [a.name for a in registry.adapters() if a.detect(path).matches]
    rel = str(path.relative_to(FIXTURES))
    expected = EXPECTED.get(rel) or rel.split("/")[0]
    assert claims == [expected]


@pytest.mark.parametrize("adapter", registry.adapters(), ids=lambda a: a.name)
def test_adapter_conformance(adapter, tmp_path):
    assert isinstance(adapter, Adapter)
    verdict = adapter.detect(tmp_path)
    assert isinstance(verdict, Detection) and not verdict.matches and verdict.reason
    for path in ALL_FIXTURES:
        if not adapter.detect(path).matches:
            continue
        m = adapter.describe(path)
        assert m.format == adapter.name and m.items
        with adapter.reader(m) as reader:
            for item in m.items.values():
                for piece in item.pieces:
                    if item.is_tensor:
                        arr = reader.read(piece, item)
                        expected = piece.box.sizes if piece.flat is None else (piece.flat[1],)
                        assert arr.shape == expected and arr.nbytes == piece.nbytes
                if not item.is_tensor and item.error is None:
                    reader.read_object(item)
