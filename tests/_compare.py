"""Helpers that compare our outputs with torch's own, bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def flatten_nested(obj: Any, prefix: str = "") -> dict[str, Any]:
    """DCP's flattening of a nested state dict (mappings and tensor-holding lists are walked)."""
    out: dict[str, Any] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten_nested(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, list | tuple) and not _terminal(obj):
        for i, v in enumerate(obj):
            out.update(flatten_nested(v, f"{prefix}.{i}" if prefix else str(i)))
    else:
        out[prefix] = obj
    return out


def _terminal(seq: list | tuple) -> bool:
    # torch's _traverse rule: a sequence is a leaf unless it holds a mapping or tensor at any depth
    return not any(isinstance(v, dict | torch.Tensor) or (isinstance(v, list | tuple) and not _terminal(v))
                   for v in seq)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.contiguous(), b.contiguous()
    if a.numel() == 0:
        return True
    return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def tensor_mismatches(got: dict[str, torch.Tensor], expected: dict[str, Any]) -> list[str]:
    """Names whose tensors differ (dtype, shape or any bit), plus tensors missing on either side."""
    want = {k: v for k, v in expected.items() if isinstance(v, torch.Tensor)}
    bad = sorted(set(want) ^ set(got))
    bad += [k for k in sorted(set(want) & set(got)) if not same_bits(got[k], want[k])]
    return bad


def dcp_load_mismatches(ckpt: Path, source: Path, ranks: int, tmp: Path) -> list[str]:
    """Load the DCP checkpoint ``ckpt`` with torch's ``dcp.load`` at ``ranks`` gloo ranks
    (tests/_ranks.py) and compare the gathered tensors with ckpttool's export of ``source``."""
    from safetensors.torch import load_file

    from ckpttool.export import export
    from tests._ranks import DCP, run_ranks

    loaded = tmp / "loaded.pt"
    worker, args = Path(__file__).with_name("_dcp_load_worker.py"), [str(ckpt), str(loaded)]
    proc = run_ranks(worker, args, ranks, preload=DCP, timeout=300)
    if proc.returncode != 0:  # once seen failing and never again: a launch flake is retried, a bug fails twice
        print(f"dcp.load run failed once (rc {proc.returncode}), retrying:\n{proc.stderr[-2000:]}")
        proc = run_ranks(worker, args, ranks, preload=DCP, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    export(source, tmp / "ref.safetensors")
    return tensor_mismatches(load_file(tmp / "ref.safetensors"), torch.load(loaded, weights_only=True))
