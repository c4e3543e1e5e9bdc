"""Lossless delta and compression: every file restored byte for byte, wrong bases refused."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from ckpttool import delta, registry
from ckpttool.delta import DeltaMismatchError
from tests.conftest import FIXTURES, run_cli

RUN = FIXTURES / "run"


def _files(path: Path) -> dict[str, str]:
    _, m = registry.describe(path)
    root = Path(m.root)
    return {f.path: hashlib.sha256((root / f.path).read_bytes()).hexdigest() for f in m.files}


def _restored(out: Path, names: dict[str, str]) -> dict[str, str]:
    if out.is_file():
        (only,) = names
        return {only: hashlib.sha256(out.read_bytes()).hexdigest()}
    return {rel: hashlib.sha256((out / rel).read_bytes()).hexdigest() for rel in names}


PAIRS = [
    ("run/step_10", "run/step_11"),
    ("run/step_10", "run/step_20"),
    ("dcp/fsdp2", "dcp/mesh2x2"),
    ("dcp/fsdp2_zstd", "dcp/fsdp2_zstd"),
    ("dcp/fsdp2", "dcp/fsdp2_ranklocal"),
    ("dcp/fsdp2_hf/sharded", "dcp/fsdp2_hf/sharded"),
    ("deepspeed/zero1", "deepspeed/zero2"),
    ("deepspeed/zero2", "deepspeed/zero3"),
    ("deepspeed/zero2", "deepspeed/universal"),
    ("megatron/legacy_tp2pp2", "megatron/legacy_tp2pp2_distopt"),
    ("megatron/dist_tp2", "megatron/dist_tp2pp2"),
    ("rankshards/ddp", "rankshards/tp_manual/step_00000003"),
    ("safetensors/sharded", "safetensors/sharded"),
    ("torch/train_state.pt", "torch/train_state.pt"),
]


@pytest.mark.parametrize(("base", "target"), PAIRS)
def test_delta_round_trip(base, target, tmp_path):
    d = tmp_path / "d.delta"
    delta.create(FIXTURES / target, d, base=FIXTURES / base)
    out = tmp_path / "out"
    delta.apply(d, out, base=FIXTURES / base)
    want = _files(FIXTURES / target)
    assert _restored(out, want) == want


@pytest.mark.parametrize("rel", ["dcp/fsdp2", "deepspeed/zero3", "megatron/legacy_tp2pp2", "rankshards/ddp",
                                 "safetensors/model.safetensors", "torch/train_state.pt"])
def test_compress_round_trip(rel, tmp_path):
    packed = tmp_path / "p.ckz"
    r = run_cli("compress", FIXTURES / rel, "-o", packed)
    assert r.code == 0, r.stderr
    out = tmp_path / "out"
    assert run_cli("decompress", packed, "-o", out).code == 0
    want = _files(FIXTURES / rel)
    assert _restored(out, want) == want


def test_consecutive_steps_code_better_than_alone(tmp_path):
    alone = tmp_path / "alone.ckz"
    delta.create(RUN / "step_11", alone)
    d1 = tmp_path / "d1.delta"
    delta.create(RUN / "step_11", d1, base=RUN / "step_10")
    d10 = tmp_path / "d10.delta"
    delta.create(RUN / "step_20", d10, base=RUN / "step_10")
    r_alone, r1, r10 = (delta.info(p)["ratio"] for p in (alone, d1, d10))
    assert r1 > 1.1 * r_alone
    assert r10 >= 0.99 * r_alone  # far-apart steps never much worse than coding alone


def test_chain(tmp_path):
    d1, d2 = tmp_path / "d1", tmp_path / "d2"
    delta.create(RUN / "step_11", d1, base=RUN / "step_10")
    delta.create(RUN / "step_20", d2, base=RUN / "step_11")
    t1 = tmp_path / "t1"
    delta.apply(d1, t1, base=RUN / "step_10")
    t2 = tmp_path / "t2"
    delta.apply(d2, t2, base=t1)
    assert _restored(t2, _files(RUN / "step_20")) == _files(RUN / "step_20")


def test_wrong_base_is_refused_before_writing(tmp_path):
    d = tmp_path / "d"
    delta.create(RUN / "step_11", d, base=RUN / "step_10")
    out = tmp_path / "out"
    with pytest.raises(DeltaMismatchError, match="refused before writing"):
        delta.apply(d, out, base=RUN / "step_20")
    assert not out.exists() and list(tmp_path.iterdir()) == [d]
    r = run_cli("delta", "apply", RUN / "step_20", d, "-o", out)
    assert r.code == 1 and "not the file the delta was made against" in r.stderr


def test_stored_hash_mismatch_publishes_nothing(tmp_path):
    d = tmp_path / "d"
    delta.create(RUN / "step_11", d, base=RUN / "step_10")
    want = delta.read_header(d)["files"]["__0_0.distcp"]["xxh3"]
    wrong = ("0" if want[0] != "0" else "1") + want[1:]
    data = d.read_bytes()
    assert data.count(want.encode()) == 1
    d.write_bytes(data.replace(want.encode(), wrong.encode()))
    out = tmp_path / "out"
    r = run_cli("delta", "apply", RUN / "step_10", d, "-o", out)
    assert r.code == 1 and "does not give the stored xxh3-128" in r.stderr
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]  # no temp directory left behind


def test_truncated_delta_is_a_clear_error(tmp_path):
    d = tmp_path / "d"
    delta.create(RUN / "step_11", d, base=RUN / "step_10")
    d.write_bytes(d.read_bytes()[:-100])
    r = run_cli("delta", "apply", RUN / "step_10", d, "-o", tmp_path / "out")
    assert r.code == 3 and "not a ckpttool delta" in r.stderr and "Traceback" not in r.stderr


def test_info_and_cli(tmp_path):
    d = tmp_path / "d"
    r = run_cli("delta", "create", RUN / "step_10", RUN / "step_11", "-o", d)
    assert r.code == 0 and "ratio" in r.stdout
    info = run_cli("delta", "info", d)
    assert info.code == 0 and "param" in info.stdout and "optim" in info.stdout
    assert run_cli("delta", "create", RUN / "step_10", RUN / "step_11", "-o", d).code == 2  # exists
    shutil.rmtree(tmp_path / "nothing", ignore_errors=True)


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_codec_decodes_in_place_every_method(width):
    import numpy as np

    from ckpttool import codec

    rng = np.random.default_rng(width)
    base = rng.integers(0, 256, 4096 * width, dtype=np.uint8).tobytes()
    near = bytearray(base)
    for i in range(0, len(near), 7):
        near[i] ^= 1
    target = bytes(near)
    for method in ("planes", "xor", "idiff"):
        for floating in (True, False):
            planes = codec.transform(method, target, base, width, floating)
            frames = codec.compress_planes(planes)
            sizes = [len(p) for p in planes]
            out = bytearray(len(target) + 1)  # decoded one byte in: an unaligned view
            codec.decode_into(memoryview(out)[1:], method, frames, sizes, base, width, floating)
            assert bytes(out[1:]) == target, (method, floating)
            with pytest.raises(ValueError):  # one byte short of the piece: refused, not a wrong result
                codec.decode_into(memoryview(bytearray(len(target) - width)), method, frames, sizes, base, width, floating)
            if method != "planes":
                with pytest.raises(ValueError, match="base"):
                    codec.decode_into(memoryview(out)[1:], method, frames, sizes, base[:-width], width, floating)
    method, frames, sizes = codec.encode(target, base, width, True)
    out = bytearray(len(target))
    codec.decode_into(memoryview(out), method, frames, sizes, base, width, True)
    assert bytes(out) == target
