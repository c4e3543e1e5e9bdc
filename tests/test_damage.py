"""Damaged checkpoints of every format: truncations and bit flips in every file give a finding or
one clear error, never an unexpected exception (a traceback)."""

from __future__ import annotations

import random
import shutil

import pytest

from ckpttool.errors import CkptError
from ckpttool.export import export
from ckpttool.inspect import inspect
from ckpttool.verify import verify
from tests.conftest import FIXTURES

CASES = ["dcp/fsdp2_per_item", "deepspeed/zero3", "megatron/legacy_tp2pp2", "megatron/dist_tp2", "rankshards/ddp",
         "safetensors/sharded", "torch/train_state.pt"]


@pytest.mark.parametrize("rel", CASES)
def test_truncations_and_flips_never_escape(rel, tmp_path):
    src = FIXTURES / rel
    files = sorted(p for p in (src.rglob("*") if src.is_dir() else [src]) if p.is_file())
    rng = random.Random(rel)
    unexpected: list[str] = []
    runs = 0
    for f in files[:6]:
        size = f.stat().st_size
        for mode, k in (("trunc", 3), ("flip", 0)):
            work = tmp_path / f"{f.name}-{mode}-{k}"
            dst = work / src.name
            work.mkdir()
            (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)
            target = dst / f.relative_to(src) if src.is_dir() else dst
            data = bytearray(target.read_bytes())
            if mode == "trunc":
                data = data[: size * k // 7]
            elif data:
                for _ in range(3):
                    data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            target.write_bytes(bytes(data))
            for name, call in (("inspect", lambda: inspect(dst)), ("verify", lambda: verify(dst)),
                               ("export", lambda: export(dst, work / "o.safetensors"))):
                runs += 1
                try:
                    call()
                except CkptError:
                    pass
                except Exception as exc:  # what this test exists to catch
                    unexpected.append(f"{name} {f.name} {mode}{k}: {type(exc).__name__}: {exc}")
            shutil.rmtree(work)
    print(f"{rel}: {runs} runs on damaged copies, {len(unexpected)} unexpected exceptions")
    assert unexpected == []
