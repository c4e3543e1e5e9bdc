"""The dtype conversions ckpttool does itself, against torch's."""

from __future__ import annotations

import json

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


def test_a_torch_dtype_ckpttool_does_not_read_is_named_as_such_not_as_hostile(tmp_path):
    """A torch.save file holding a float4_e2m1fn_x2 or complex32 tensor (torch.load with
    weights_only=True reads both) was refused as "the file may be hostile": it is a dtype ckpttool
    has no table entry for, and the message now says that."""
    import warnings

    import torch

    from tests.conftest import run_cli

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (complex32 is "experimental")
        torch.save({"w": torch.ones(4).view(torch.uint8).view(torch.float4_e2m1fn_x2)}, tmp_path / "f4.pt")
        torch.save({"w": torch.ones(2, dtype=torch.complex32)}, tmp_path / "c32.pt")
    for name, dtype in (("f4.pt", "float4_e2m1fn_x2"), ("c32.pt", "complex32")):
        torch.load(tmp_path / name, weights_only=True)
        r = run_cli("inspect", tmp_path / name)
        assert r.code == 3 and f"holds a tensor of dtype torch.{dtype}, which ckpttool does not read yet" in r.stderr
        assert "hostile" not in r.stderr, r.stderr


def test_safetensors_fnuz_float8_reads_converts_and_exports_bit_for_bit(tmp_path):
    """safetensors (≥ 0.6) writes torch's float8_e4m3fnuz and float8_e5m2fnuz as F8_E4M3FNUZ and
    F8_E5M2FNUZ; ckpttool refused the file as holding an unknown dtype. Now it reads them: inspect
    names the dtypes, convert --to dcp gives what dcp.load reads back bit for bit, and export
    writes a safetensors file safetensors' own loader reads back bit for bit."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file, save_file

    from tests.conftest import run_cli

    torch.manual_seed(0)
    tensors = {
        "a": torch.randn(4, 3).to(torch.float8_e4m3fnuz),
        "b": torch.randn(5).to(torch.float8_e5m2fnuz),
        "c": torch.randn(2),
    }
    save_file(tensors, tmp_path / "model.safetensors")
    r = run_cli("inspect", tmp_path / "model.safetensors")
    assert r.code == 0 and "float8_e4m3fnuz" in r.stdout and "float8_e5m2fnuz" in r.stdout, r.stderr
    r = run_cli("convert", tmp_path / "model.safetensors", "-o", tmp_path / "out", "--to", "dcp")
    assert r.code == 0, r.stderr
    back = {k: torch.empty_like(v) for k, v in tensors.items()}
    dcp.load(back, checkpoint_id=str(tmp_path / "out"))
    r = run_cli("export", tmp_path / "out", "-o", tmp_path / "again.safetensors")
    assert r.code == 0, r.stderr
    again = load_file(tmp_path / "again.safetensors")
    for k, v in tensors.items():
        for got in (back[k], again[k]):
            assert got.dtype == v.dtype and torch.equal(got.view(torch.uint8), v.view(torch.uint8)), k


def test_a_lazy_conj_or_neg_view_is_refused_not_read_as_its_storage(tmp_path):
    """torch.save of ``c.conj()`` (or of a real tensor carrying the neg bit, ``c.conj().imag``)
    keeps the storage's values and a metadata bit; ckpttool read the storage, so export, convert
    and diff gave conjugated or negated values where torch.load gives the view's. Such tensors are
    refused by name (exit 3), in torch.save files and in DCP records alike."""
    import torch
    import torch.distributed.checkpoint as dcp

    from tests.conftest import assert_clean, run_cli

    c = torch.tensor([1 + 2j, 3 - 4j])
    torch.save({"freqs": c.conj(), "w": torch.ones(2)}, tmp_path / "conj.pt")
    torch.save({"x": c.conj().imag}, tmp_path / "neg.pt")
    dcp.save({"c": c.conj()}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert_clean(run_cli("inspect", tmp_path / "conj.pt"), 3, "a tensor saved as a lazy conj view")
    assert_clean(run_cli("inspect", tmp_path / "neg.pt"), 3, "a tensor saved as a lazy neg view")
    out = tmp_path / "c.safetensors"
    assert_clean(run_cli("export", tmp_path / "dcp", "-o", out), 3, "a tensor saved as a lazy conj view")
    assert not out.exists()


def test_exported_tensors_start_at_a_multiple_of_their_element_size(tmp_path):
    """export wrote tensors in the checkpoint's order, so after an odd-sized bf16, bool or uint8
    tensor the fp32 and int64 ones lay misaligned (48 of 63 in the ZeRO-2 bf16 fixture), which a
    zero-copy loader viewing a memory map as the dtype refuses; safetensors' own writer never
    does. Every tensor now starts at a multiple of its element size, and the values are kept."""
    import struct

    import torch
    from safetensors.torch import load_file

    from tests.conftest import FIXTURES, run_cli

    torch.save({"flag": torch.ones(3, dtype=torch.bool), "half": torch.ones(5, dtype=torch.bfloat16),
                "w": torch.arange(6.0), "n": torch.arange(3)}, tmp_path / "odd.pt")  # fmt: skip
    for src in (tmp_path / "odd.pt", FIXTURES / "deepspeed" / "zero2_bf16"):
        out = tmp_path / f"{src.stem}.safetensors"
        r = run_cli("export", src, "-o", out)
        assert r.code == 0, r.stderr
        raw = out.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        header.pop("__metadata__", None)
        width = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2}
        bad = [k for k, v in header.items() if (8 + n + v["data_offsets"][0]) % width.get(v["dtype"], 1)]
        assert not bad, bad
        assert len(load_file(out)) == len(header)
    got = load_file(tmp_path / "odd.safetensors")
    assert torch.equal(got["w"], torch.arange(6.0)) and torch.equal(got["n"], torch.arange(3))


def test_a_tensor_name_a_safetensors_header_cannot_hold_is_refused(tmp_path):
    """A tensor named ``__metadata__`` replaced the header's metadata (neither safetensors nor
    ckpttool could read the file, exit 0), and a name holding a lone surrogate was written as a
    JSON escape safetensors refuses. Both are refused by name, exit 3, nothing written."""
    import torch

    from tests.conftest import assert_clean, run_cli

    for i, name in enumerate(("__metadata__", "w\udcff")):
        torch.save({name: torch.ones(2), "ok": torch.zeros(2)}, tmp_path / f"{i}.pt")
        out = tmp_path / f"{i}.safetensors"
        assert_clean(run_cli("export", tmp_path / f"{i}.pt", "-o", out), 3, "cannot be written to a safetensors file")
        assert not out.exists()
