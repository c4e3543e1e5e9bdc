"""The dtype conversions ckpttool does itself, against torch's."""

from __future__ import annotations

import numpy as np

from ckpttool.dtypes import bf16_to_float32, float32_to_bf16


def test_float32_to_bf16_rounds_as_torch():
    """Every kind of float32 (random bit patterns: normals, subnormals, infinities, NaNs with any
    payload and sign, ties) narrows to the bfloat16 bits torch's ``.to(torch.bfloat16)`` gives on
    the CPU, and widening them back is exact."""
    import torch

    rng = np.random.default_rng(7)
    bits = rng.integers(0, 2**32, size=1 << 20, dtype=np.uint64).astype(np.uint32)
    ties = (rng.integers(0, 2**16, size=4096, dtype=np.uint64).astype(np.uint32) << 16) | 0x8000
    special = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F7FFFFF, 1], np.uint32)
    values = np.concatenate([bits, ties, special]).view(np.float32)
    ours = float32_to_bf16(values)
    theirs = torch.from_numpy(values.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(ours, theirs)
    wide = torch.from_numpy(theirs.view(np.int16).copy()).view(torch.bfloat16).float().numpy()
    assert np.array_equal(bf16_to_float32(ours).view(np.uint32), wide.view(np.uint32))
