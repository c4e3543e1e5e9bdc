"""Lossless delta and compression ratios and speeds on a real training run, against ZipNN.

    pip install zipnn          # benchmark-only dependency
    python benchmarks/bench_delta.py [--steps 110]

Trains a small language model (about 4.2 M fp32 parameters: with both AdamW moments, 50 MB per
checkpoint) with AdamW (lr 1e-3), saving DCP checkpoints at steps 100, 101 and 110 under
benchmarks/_data/run/. Then, on the same data in the same run:

- ckpttool ``delta`` of step 101 against 100 (consecutive) and of 110 against 100 (far apart);
- ckpttool ``compress`` of the target alone (byte-plane zstd: the baseline a delta must beat);
- ZipNN's delta (``delta_compressed_type="byte"``) of every tensor against its step-100 copy;
- bf16 weights: step 101 against 100 cast to bfloat16, through ckpttool's codec;
- speed per core: the codec alone (encode and decode of every tensor piece of step 101 against
  step 100, one thread, warm), and ``delta create`` / ``delta apply`` end to end with one worker
  (describe, hashing, reading, writing and fsync included), next to ``cp -r`` of the same files.

Ratios count tensor bytes only (params and moments), the data both tools code.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

HERE = Path(__file__).resolve().parent
DATA = HERE / "_data"


def train(out: Path, steps: int, saves: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    vocab, dim = 8192, 256
    model = torch.nn.Sequential(
        torch.nn.Embedding(vocab, dim),
        *[torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))
          for _ in range(2)],
        torch.nn.LayerNorm(dim), torch.nn.Linear(dim, vocab),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    # a synthetic Markov "language" so the loss really falls
    gen = torch.Generator().manual_seed(1)
    trans = torch.randint(0, vocab, (vocab, 4), generator=gen)
    for step in range(1, steps + 1):
        start = torch.randint(0, vocab, (32,), generator=gen)
        seq = [start]
        for _ in range(32):
            seq.append(trans[seq[-1], torch.randint(0, 4, (32,), generator=gen)])
        batch = torch.stack(seq, 1)
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), batch[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if step in saves:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step},
                         checkpoint_id=out / f"step_{step}")
            print(f"saved step {step} (loss {loss.item():.3f})", flush=True)


def tensor_ratio(info: dict) -> float:
    kinds = {k: v for k, v in info["by_kind"].items() if k in ("param", "optim")}
    return sum(v["bytes"] for v in kinds.values()) / sum(v["coded"] for v in kinds.values())


def flat_tensors(path: Path) -> dict[str, np.ndarray]:
    from ckpttool import registry
    from ckpttool.assemble import assemble

    adapter, m = registry.describe(path)
    out = {}
    with adapter.reader(m) as reader:
        for name, item in m.items.items():
            if item.is_tensor and item.dtype == "float32" and item.shape:
                out[name] = assemble(reader, item).reshape(-1)
    return out


def codec_speed(target: Path, base: Path) -> tuple[float, float]:
    """GB/s of the codec alone over every tensor piece of ``target`` against ``base``, one thread,
    best of three warm passes (the Adam second moments coded against their prediction, as create
    does)."""
    from ckpttool import codec, delta, registry

    ta, tm = registry.describe(target)
    ba, bm = registry.describe(base)
    tl, bl = delta._file_layout(ta, tm), delta._file_layout(ba, bm)
    maps = delta._Mapped()
    jobs = []
    for rel, segs in tl.items():
        by = {s.item: s for s in bl.get(rel, [])}
        for s in segs:
            b = by.get(s.item)
            jobs.append((maps.view(target / rel, s.offset, s.length),
                         maps.view(base / rel, b.offset, s.length) if b and b.length == s.length else None, s))
    firsts = {s.item: (v, b) for v, b, s in jobs}
    total = sum(len(v) for v, _, _ in jobs)

    enc, dec = [], []
    for _ in range(3):
        t = time.perf_counter()
        coded = []
        for v, b, s in jobs:
            bases, coef = [b], None
            if s.item.endswith("exp_avg_sq") and b is not None:
                m_new, m_old = firsts[s.item[:-3]]
                coef = codec.ema2_fit(v, m_new, m_old, b)
                if coef:
                    bases.append(codec.ema2_predict(m_new, m_old, b, coef))
            coded.append((codec.encode_best(v, bases, s.width, s.floating), coef))
        enc.append(time.perf_counter() - t)
        out = bytearray(total)
        t = time.perf_counter()
        pos = 0
        for (v, b, s), ((used, method, frames, sizes), coef) in zip(jobs, coded):
            base = b if used == 0 else None
            if used == 1:  # the prediction, from the first moment decoded before it
                m_new, m_old = firsts[s.item[:-3]]
                base = codec.ema2_predict(m_new, m_old, b, coef)
            codec.decode_into(memoryview(out)[pos:pos + len(v)], method, frames, sizes, base, s.width, s.floating)
            pos += len(v)
        dec.append(time.perf_counter() - t)
        assert out == b"".join(bytes(v) for v, _, _ in jobs)
    return total / min(enc) / 1e9, total / min(dec) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=110)
    args = ap.parse_args()
    from ckpttool import codec, delta

    run = DATA / "run"
    if not (run / "step_110" / ".metadata").exists():
        shutil.rmtree(run, ignore_errors=True)
        train(run, args.steps, (100, 101, 110))
    s100, s101, s110 = run / "step_100", run / "step_101", run / "step_110"
    size = sum(p.stat().st_size for p in s101.iterdir())
    res: dict[str, float] = {"checkpoint_bytes": size}
    tmp = DATA / "delta_tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)

    # the first call of each (imports, cold caches), then the median of three warm calls
    encode, decode = [], []
    for k in range(4):
        t = time.perf_counter()
        delta.create(s101, tmp / "d1", base=s100, workers=1, force=True)
        encode.append(time.perf_counter() - t)
        shutil.rmtree(tmp / "r1", ignore_errors=True)
        t = time.perf_counter()
        delta.apply(tmp / "d1", tmp / "r1", base=s100, workers=1)
        decode.append(time.perf_counter() - t)
    res["encode_first_s"], res["decode_first_s"] = encode[0], decode[0]
    res["encode_s"], res["decode_s"] = statistics.median(encode[1:]), statistics.median(decode[1:])
    cps = []
    for _ in range(3):
        shutil.rmtree(tmp / "cp", ignore_errors=True)
        t = time.perf_counter()
        subprocess.run(["cp", "-r", str(s101), str(tmp / "cp")], check=True)
        subprocess.run(["sync", "-f", str(tmp / "cp")], check=True)
        cps.append(time.perf_counter() - t)
    res["cp_s"] = statistics.median(cps)
    res["codec_encode_GBps_per_core"], res["codec_decode_GBps_per_core"] = codec_speed(s101, s100)
    delta.create(s101, tmp / "a101", workers=1)
    delta.create(s110, tmp / "d10", base=s100, workers=1)
    delta.create(s110, tmp / "a110", workers=1)
    res["delta_1"] = tensor_ratio(delta.info(tmp / "d1"))
    res["alone_101"] = tensor_ratio(delta.info(tmp / "a101"))
    res["delta_10"] = tensor_ratio(delta.info(tmp / "d10"))
    res["alone_110"] = tensor_ratio(delta.info(tmp / "a110"))

    try:
        import zipnn
    except ImportError:
        print("zipnn not installed: pip install zipnn (benchmark only)")
        return 2
    a, b = flat_tensors(s100), flat_tensors(s101)
    z = zipnn.ZipNN(input_format="byte", bytearray_dtype="float32", delta_compressed_type="byte")
    raw = coded = 0
    for name, tb in b.items():
        data = tb.tobytes()
        raw += len(data)
        coded += len(z.compress(data, delta_second_data=a[name].tobytes()))
    res["zipnn_delta_1"] = raw / coded

    def bf16(x: np.ndarray) -> bytes:  # round to nearest even, as torch does
        u = x.view(np.uint32).astype(np.uint64)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16).tobytes()

    raw = coded = 0
    for name, tb in b.items():
        if not name.startswith("model."):
            continue
        tb16, ta16 = bf16(tb), bf16(a[name])
        _, frames, _ = codec.encode(tb16, ta16, 2, True)
        raw += len(tb16)
        coded += sum(map(len, frames))
    res["bf16_weights_delta_1"] = raw / coded
    res["create_GBps_one_worker"] = size / res["encode_s"] / 1e9
    res["apply_GBps_one_worker"] = size / res["decode_s"] / 1e9
    res["cp_GBps"] = size / res["cp_s"] / 1e9
    shutil.rmtree(tmp)
    checks = {
        "consecutive >= 1.1x ZipNN delta": res["delta_1"] >= 1.1 * res["zipnn_delta_1"],
        "consecutive >= 1.2x target alone": res["delta_1"] >= 1.2 * res["alone_101"],
        "ten apart >= 0.99x target alone": res["delta_10"] >= 0.99 * res["alone_110"],
        "bf16 consecutive >= 2.5x": res["bf16_weights_delta_1"] >= 2.5,
        "encode >= 0.5 GB/s per core (codec)": res["codec_encode_GBps_per_core"] >= 0.5,
        "decode >= 1 GB/s per core (codec)": res["codec_decode_GBps_per_core"] >= 1.0,
    }
    for k, v in res.items():
        print(f"{k:26s} {v:10.3f}" if isinstance(v, float) else f"{k:26s} {v}")
    for k, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {k}")
    (DATA / "delta.json").write_text(json.dumps({"results": res, "checks": checks}, indent=2))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
