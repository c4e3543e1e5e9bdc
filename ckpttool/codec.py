"""Lossless coding of tensor bytes: byte planes + zstd, optionally against a base.

A tensor's elements are split into byte planes (all most-significant bytes, then the next, ...):
exponent bytes of floats are low-entropy and compress well on their own, mantissa bytes do not
(research/perf.md §2.3). Floats are first rotated left by one bit so the whole exponent sits in
the top plane (ZipNN's ``reorder_signbit``). Against a base of the same shape the planes hold the
XOR, or the zigzagged integer difference, of the two tensors (§2.4: consecutive training steps
differ in few low bits). Every method is exactly invertible.

Speed comes from two things. The transforms run in per-thread scratch arrays that are reused from
piece to piece: fresh memory costs a page fault per page, which on a virtual machine is dearer
than the transform itself. And zstd runs with a 64-entry hash table and a minimum match of 7:
below the exponent plane a byte plane is close to noise, where level 1's match finder spends its
time on short matches that also spoil the literals' statistics. With these settings it leaves the
noise to the entropy coder: on the benchmark run's planes, 0.4 % smaller output, encoding 1.3-2x
and decoding 2x faster than plain level 1 (docs/benchmarks.md).

Adam's second moment has a better base than its own previous value. One optimizer step updates
``m' = b1 m + (1 - b1) g`` and ``v' = b2 v + (1 - b2) g^2``; with ``m'`` known (the piece that
codes the first moment, decoded first) the gradient is ``(m' - b1 m) / (1 - b1)``, so
``v'`` is predicted from ``m'``, ``m`` and ``v`` up to rounding. ``ema2_fit`` fits ``b1``, ``b2``
and ``c = (1 - b2) / (1 - b1)^2`` on a sample of the piece (no optimizer settings are read, so any
format and any Adam-like optimizer works); ``ema2_predict`` computes the prediction with the same
float32 operations on both sides, so encoder and decoder get the same bits, and the piece is coded
as its difference with the prediction. Ten steps apart the prediction is poor and the plain base
wins the choice.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Literal

import numpy as np
import zstandard

Method = Literal["stored", "planes", "xor", "idiff"]
METHODS: tuple[Method, ...] = ("stored", "planes", "xor", "idiff")
LEVEL = 1  # zstd level 1 beats 3 and 9 on exponent planes (perf.md §2.3)
PARAMS = zstandard.ZstdCompressionParameters.from_level(LEVEL, hash_log=6, min_match=7)
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_INT = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


class _Scratch(threading.local):
    """Arrays each thread reuses from piece to piece; they grow to the largest piece seen and die
    with the thread (the pool threads of one create/apply)."""

    def __init__(self) -> None:
        self.buffers: dict[str, np.ndarray] = {}
        self.cctx = zstandard.ZstdCompressor(compression_params=PARAMS)
        self.dctx = zstandard.ZstdDecompressor()

    def get(self, name: str, nbytes: int, dtype: Any = np.uint8) -> np.ndarray:
        buf = self.buffers.get(name)
        if buf is None or len(buf) < nbytes:
            buf = self.buffers[name] = np.empty(max(nbytes, 1 << 16), np.uint8)
        return buf[:nbytes].view(dtype)


_scratch = _Scratch()


def scratch(name: str, nbytes: int) -> memoryview:
    """A writable buffer of ``nbytes`` this thread reuses under ``name`` (for callers' own pieces)."""
    return _scratch.get("x-" + name, nbytes).data


def _words(data: memoryview | bytes, width: int) -> np.ndarray:
    return np.frombuffer(data, dtype=_UINT[width])


def _rotl1(words: np.ndarray, tmp: np.ndarray) -> None:
    """Rotate every word left by one bit, in place (``tmp``: scratch of the same shape)."""
    np.right_shift(words, np.asarray(8 * words.dtype.itemsize - 1, words.dtype), out=tmp)
    np.left_shift(words, np.asarray(1, words.dtype), out=words)
    np.bitwise_or(words, tmp, out=words)


def _rotr1(words: np.ndarray, tmp: np.ndarray) -> None:
    np.left_shift(words, np.asarray(8 * words.dtype.itemsize - 1, words.dtype), out=tmp)
    np.right_shift(words, np.asarray(1, words.dtype), out=words)
    np.bitwise_or(words, tmp, out=words)


_TBLOCK = 1 << 15  # elements transformed at a time: the temporaries are two blocks, not two pieces


def _forward(method: Method, t: np.ndarray, b: Any, w: np.ndarray, tmp: np.ndarray, floating: bool) -> None:
    """One block of ``method``'s transform of ``t`` (against ``b``) into ``w``."""
    if method == "planes":
        w[:] = t
    elif method == "xor":
        np.bitwise_xor(t, b, out=w)
    else:  # idiff: the wrapping integer difference, zigzagged so small changes either way are small
        np.subtract(t, b, out=w)
        s, sign = w.view(_INT[w.dtype.itemsize]), tmp.view(_INT[w.dtype.itemsize])
        np.right_shift(s, np.asarray(8 * w.dtype.itemsize - 1, s.dtype), out=sign)
        np.left_shift(s, np.asarray(1, s.dtype), out=s)
        np.bitwise_xor(s, sign, out=s)
        return
    if floating:
        _rotl1(w, tmp)


def transform(
    method: Method, target: bytes | memoryview, base: bytes | memoryview | None, width: int, floating: bool
) -> list[Any]:
    """The byte planes a method codes (before zstd), most significant first; views of this thread's
    scratch (valid until its next transform) for every method but stored."""
    if method == "stored":
        return [bytes(target)]
    if method != "planes" and base is None:
        raise ValueError(f"method {method} needs a base")
    t = _words(target, width)
    b = _words(base, width) if method != "planes" and base is not None else None
    count = len(t)
    rows = _scratch.get("planes", width * count).reshape(width, count)
    blk = max(1, min(count, _TBLOCK))
    w_buf, tmp_buf = _scratch.get("a", blk * width, _UINT[width]), _scratch.get("b", blk * width, _UINT[width])
    for i in range(0, count, blk):
        j = min(i + blk, count)
        w = w_buf[: j - i]
        _forward(method, t[i:j], b[i:j] if b is not None else None, w, tmp_buf[: j - i], floating)
        lanes = w.view(np.uint8)
        for k in range(width):  # little-endian: byte width-1 of each word is the most significant
            rows[width - 1 - k, i:j] = lanes[k::width]
    return [rows[r].data for r in range(width)]


def compress_planes(planes: list[Any]) -> list[bytes]:
    cctx = _scratch.cctx
    return [cctx.compress(p) for p in planes]


def decompress_bounded(dctx: zstandard.ZstdDecompressor, frame: bytes | memoryview, n: int) -> bytes:
    """A zstd frame of at most ``n`` bytes, decompressed; ValueError for a frame that declares more
    (zstd would allocate what the frame declares before checking)."""
    declared = zstandard.frame_content_size(frame)
    if declared > n:
        raise ValueError(f"a frame declares {declared:,} bytes where {n:,} are expected")
    return dctx.decompress(frame, max_output_size=n)


def decompress_into(frame: bytes | memoryview, out: memoryview) -> None:
    """Decompress one frame straight into ``out``; ValueError unless it holds exactly ``len(out)``
    bytes. Streams, so a frame declaring a huge size allocates nothing."""
    n, got = len(out), 0
    with _scratch.dctx.stream_reader(frame, read_across_frames=False) as reader:
        while got < n:
            k = reader.readinto(out[got:])
            if not k:
                raise ValueError(f"a frame of {got:,} bytes where {n:,} are expected")
            got += k
        if reader.read(1):
            raise ValueError(f"a frame of more than the {n:,} bytes expected")


_BLOCK = 16 << 10  # bytes per sample block
_BLOCKS = 4  # sample blocks spread over a piece


def _sample(data: bytes | memoryview, width: int) -> bytes:
    """``_BLOCKS`` blocks of whole elements, spread evenly from the first byte to the last."""
    view, n = memoryview(data), len(data)
    block = _BLOCK - _BLOCK % width
    stride = (n - block) // (_BLOCKS - 1)
    starts = [i * stride - (i * stride) % width for i in range(_BLOCKS)]
    return b"".join(view[s : s + block] for s in starts)


def _coded_size(method: Method, target: bytes | memoryview, base: bytes | memoryview | None, w: int, f: bool) -> int:
    return sum(map(len, compress_planes(transform(method, target, base, w, f))))


def encode(
    target: bytes | memoryview, base: bytes | memoryview | None, width: int, floating: bool
) -> tuple[Method, list[bytes], list[int]]:
    """Code a tensor's bytes with the method that comes out smallest (see ``encode_best``).
    Returns (method, zstd frames, plane sizes)."""
    _, method, frames, sizes = encode_best(target, [base], width, floating)
    return method, frames, sizes


def encode_best(
    target: bytes | memoryview, bases: list[bytes | memoryview | None], width: int, floating: bool
) -> tuple[int | None, Method, list[bytes], list[int]]:
    """Code a tensor's bytes with the method, and the base among ``bases``, that come out smallest.
    A piece larger than ``2 * _BLOCKS * _BLOCK`` bytes chooses on four 16 KiB blocks spread over it,
    then codes the whole piece once; a smaller one is coded whole by every candidate.
    Returns (index of the base used or None, method, zstd frames, plane sizes)."""
    n = len(target)
    if width not in _UINT or n % width or n == 0:
        return None, "stored", [bytes(target)], [n]
    candidates: list[tuple[Method, int | None]] = [("planes", None)]
    for i, base in enumerate(bases):
        if base is not None and len(base) == n:
            candidates += [("xor", i), ("idiff", i)]
    if len(candidates) > 1 and n > 2 * _BLOCKS * _BLOCK:
        st = _sample(target, width)
        samples = [_sample(b, width) if b is not None and len(b) == n else None for b in bases]
        sizes = {
            c: _coded_size(c[0], st, samples[c[1]] if c[1] is not None else None, width, floating) for c in candidates
        }
        candidates = [min(candidates, key=lambda c: sizes[c])]
    best: tuple[int | None, Method, list[bytes], list[int]] | None = None
    for m, used in candidates:
        planes = transform(m, target, bases[used] if used is not None else None, width, floating)
        frames = compress_planes(planes)
        if best is None or sum(map(len, frames)) < sum(map(len, best[2])):
            best = (used, m, frames, [len(p) for p in planes])
    assert best is not None
    if sum(map(len, best[2])) >= n:
        return None, "stored", [bytes(target)], [n]
    return best


_FIT_SAMPLE = 1 << 12  # elements the second-moment predictor is fitted on
_B1 = (0.9, 0.95, 0.8, 0.85, 0.98, 0.99, 0.5)  # first-moment decays tried besides the fitted one


def _ema2_into(out: np.ndarray, tmp: np.ndarray, m_new: Any, m_old: Any, v_old: Any, coef: tuple[float, ...]) -> None:
    """out = b2 * v_old + c * (m_new - b1 * m_old)^2, in float32, one rounding per operation."""
    b1, b2, c = (np.float32(x) for x in coef)
    with np.errstate(all="ignore"):
        np.multiply(m_old, b1, out=tmp)
        np.subtract(m_new, tmp, out=tmp)
        np.multiply(tmp, tmp, out=tmp)
        np.multiply(tmp, c, out=tmp)
        np.multiply(v_old, b2, out=out)
        np.add(out, tmp, out=out)


def ema2_fit(
    v_new: bytes | memoryview, m_new: bytes | memoryview, m_old: bytes | memoryview, v_old: bytes | memoryview
) -> tuple[float, float, float] | None:
    """(b1, b2, c) of the float32 second-moment predictor that fits the piece best, judged by the
    bits of the integer differences it leaves on a sample; None if no fit is usable."""
    arrays = [np.frombuffer(x, np.float32) for x in (v_new, m_new, m_old, v_old)]
    n = len(arrays[0])
    if n == 0 or any(len(a) != n for a in arrays):
        return None
    # four runs of consecutive elements, spread over the piece: few pages touched
    run = min(n, _FIT_SAMPLE) // 4 or 1
    starts = np.linspace(0, n - run, 4).astype(np.intp)
    idx = np.unique((starts[:, None] + np.arange(run)).ravel())
    V1, M1, M0, V0 = (a[idx] for a in arrays)
    with np.errstate(all="ignore"):
        X = [x.astype(np.float64) for x in (V1, M1, M0, V0)]
        ok = np.all([np.isfinite(x) for x in X], axis=0)
        if ok.sum() < 2:
            return None
        v1, m1, m0, v0 = (x[ok] for x in X)
        b1s = list(_B1)
        # v1 ~ b2 v0 + c m1^2 - 2 c b1 m1 m0 + c b1^2 m0^2 is linear in four features: its fit
        # gives one more b1 to try (normal equations by einsum: no BLAS threads left spinning)
        k = _lsq(np.stack([v0, m1 * m1, m1 * m0, m0 * m0], 1), v1)
        if k is not None and k[1] != 0 and 0 < -k[2] / (2 * k[1]) < 1:
            b1s.insert(0, float(-k[2] / (2 * k[1])))
        best: tuple[float, tuple[float, float, float]] | None = None
        pred, tmp = np.empty_like(V1), np.empty_like(V1)
        for b1 in b1s:
            bc = _lsq(np.stack([v0, (m1 - b1 * m0) ** 2], 1), v1)
            if bc is None:
                continue
            coef = (float(np.float32(b1)), float(np.float32(bc[0])), float(np.float32(bc[1])))
            if not all(np.isfinite(coef)):
                continue
            _ema2_into(pred, tmp, M1, M0, V0, coef)
            diff = V1.view(np.uint32) - pred.view(np.uint32)
            bits = float(np.log2(np.minimum(diff, -diff).astype(np.float64) + 1).mean())
            if best is None or bits < best[0]:
                best = (bits, coef)
    return best[1] if best is not None else None


def _lsq(x: np.ndarray, y: np.ndarray) -> list[float] | None:
    """Least-squares coefficients of ``y ~ x @ k`` by the normal equations, solved in Python: a
    LAPACK call would leave OpenBLAS threads spinning on the other cores. None if singular."""
    a = np.einsum("ij,ik->jk", x, x).tolist()
    r = np.einsum("ij,i->j", x, y).tolist()
    n = len(r)
    for col in range(n):  # Gaussian elimination with partial pivoting
        piv = max(range(col, n), key=lambda i: abs(a[i][col]))
        if not math.isfinite(a[piv][col]) or a[piv][col] == 0:
            return None
        a[col], a[piv], r[col], r[piv] = a[piv], a[col], r[piv], r[col]
        for i in range(col + 1, n):
            f = a[i][col] / a[col][col]
            a[i] = [u - f * v for u, v in zip(a[i], a[col], strict=True)]
            r[i] -= f * r[col]
    k = [0.0] * n
    for i in reversed(range(n)):
        k[i] = (r[i] - sum(a[i][j] * k[j] for j in range(i + 1, n))) / a[i][i]
    return k if all(math.isfinite(v) for v in k) else None


def ema2_predict(
    m_new: bytes | memoryview, m_old: bytes | memoryview, v_old: bytes | memoryview, coef: tuple[float, ...]
) -> memoryview:
    """The predicted second moment (float32 bytes, in this thread's scratch until its next call)."""
    n = len(m_new)
    if len(coef) != 3 or n % 4 or len(m_old) != n or len(v_old) != n:
        raise ValueError(f"a second-moment prediction over pieces of {n:,}, {len(m_old):,}, {len(v_old):,} bytes")
    out = _scratch.get("pred", n, np.float32)
    tmp = _scratch.get("pred-tmp", n, np.float32)
    f32 = [np.frombuffer(x, np.float32) for x in (m_new, m_old, v_old)]
    _ema2_into(out, tmp, f32[0], f32[1], f32[2], tuple(coef))
    return out.view(np.uint8).data


def decode_into(
    out: memoryview,
    method: Method,
    frames: list[Any],
    sizes: list[int],
    base: bytes | memoryview | None,
    width: int,
    floating: bool,
) -> None:
    """Decode a piece straight into ``out`` (its bytes in the file being rebuilt): the planes are
    decompressed into scratch, interleaved into ``out``, and the inverse transform runs there in
    place. Raises ValueError when the frames do not decode to ``len(out)`` bytes."""
    nbytes = len(out)
    if method == "stored":
        if len(frames) != 1 or len(frames[0]) != nbytes:
            raise ValueError(f"a stored piece of {sum(map(len, frames)):,} bytes where {nbytes:,} are expected")
        out[:] = frames[0]
        return
    if method not in METHODS:
        raise ValueError(f"unknown coding method {method!r}")
    if width not in _UINT or nbytes % width or len(frames) != width or len(sizes) != width:
        raise ValueError(f"{len(frames)} planes of a {width}-byte type do not make {nbytes:,} bytes")
    count = nbytes // width
    if any(s != count for s in sizes):
        raise ValueError(f"planes of {sizes} bytes where {count:,} each are expected")
    if method != "planes":
        base = _need_base(base, nbytes)
    rows = _scratch.get("planes", nbytes).reshape(width, count)
    for j, frame in enumerate(frames):
        decompress_into(frame, rows[j].data)
    words = np.frombuffer(out, dtype=_UINT[width])  # writable: out is a writable view
    bw = _words(base, width) if method != "planes" else None  # type: ignore[arg-type]
    blk = max(1, min(count, _TBLOCK))
    tmp_buf = _scratch.get("b", blk * width, _UINT[width])
    for i in range(0, count, blk):
        j = min(i + blk, count)
        w, tmp = words[i:j], tmp_buf[: j - i]
        lanes = w.view(np.uint8)
        for k in range(width):  # plane 0 holds the most significant bytes (little-endian: last)
            lanes[width - 1 - k :: width] = rows[k, i:j]
        _inverse(method, w, bw[i:j] if bw is not None else None, tmp, floating)


def _inverse(method: Method, w: np.ndarray, b: Any, tmp: np.ndarray, floating: bool) -> None:
    one = np.asarray(1, w.dtype)
    if method == "idiff":
        np.bitwise_and(w, one, out=tmp)
        np.right_shift(w, one, out=w)
        np.negative(tmp, out=tmp)
        np.bitwise_xor(w, tmp, out=w)
        np.add(w, b, out=w)
        return
    if floating:
        _rotr1(w, tmp)
    if method == "xor":
        np.bitwise_xor(w, b, out=w)


def _need_base(base: bytes | memoryview | None, nbytes: int) -> bytes | memoryview:
    if base is None or len(base) != nbytes:
        raise ValueError(f"a piece coded against a base of {nbytes:,} bytes, and no such base")
    return base
