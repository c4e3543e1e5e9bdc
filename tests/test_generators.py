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
