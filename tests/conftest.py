from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
DCP_FIXTURES = ["fsdp2", "fsdp2_threads2", "fsdp2_per_item", "fsdp2_zstd", "fsdp2_ranklocal", "mesh2x2"]


@dataclass
class Run:
    code: int
    stdout: str
    stderr: str


def run_cli(*args: str | os.PathLike[str], cwd: str | os.PathLike[str] | None = None,
            env: dict[str, str] | None = None, timeout: float = 120) -> Run:
    """Run ``python -m ckpttool`` in a fresh process, as a user would."""
    full_env = {**os.environ, "COLUMNS": "120", "NO_COLOR": "1", "TERM": "dumb", **(env or {})}
    full_env.pop("CKPTTOOL_DEBUG", None)
    proc = subprocess.run([sys.executable, "-m", "ckpttool", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=full_env, timeout=timeout)
    return Run(proc.returncode, proc.stdout, proc.stderr)


@pytest.fixture
def cli():
    return run_cli


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip)
