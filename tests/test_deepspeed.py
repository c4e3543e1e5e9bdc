"""DeepSpeed 0.19.8 checkpoints made on CPU with the real library, against DeepSpeed's own tools.

References (fixtures/deepspeed/<name>.reference.pt): ``fp32.*`` from zero_to_fp32 where it runs
(zero1, zero2, zero2_bf16, zero3; otherwise the engine's live master weights), ``exp_avg*.*`` from
ds_to_universal where it runs (otherwise the live optimizer), ``module.*`` the engine's module.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from ckpttool import registry
from ckpttool.export import export
from tests._compare import same_bits
from tests.conftest import FIXTURES, run_cli

DS = FIXTURES / "deepspeed"
ALL = ["zero0", "zero1", "zero2", "zero2_bf16", "zero3", "bf16_zero0", "bf16_optimizer", "pipeline"]
ZERO_TO_FP32 = ["zero1", "zero2", "zero2_bf16", "zero3"]


def _ref(name: str, prefix: str) -> dict[str, torch.Tensor]:
    ref = torch.load(DS / f"{name}.reference.pt", weights_only=True)
    return {k[len(prefix):]: v for k, v in ref.items() if k.startswith(prefix)}


def _export(name: str, kind: str, tmp_path) -> dict[str, torch.Tensor]:
    out = tmp_path / f"{name}-{kind}.safetensors"
    export(DS / name, out, kind=kind)
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
    elif name == "pipeline":  # its layers hold no buffers
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
