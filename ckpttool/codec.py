"""Lossless coding of tensor bytes: byte planes + zstd, optionally against a base.

A tensor's elements are split into byte planes (all most-significant bytes, then the next, ...):
exponent bytes of floats are low-entropy and compress well on their own, mantissa bytes do not
(research/perf.md §2.3). Floats are first rotated left by one bit so the whole exponent sits in
the top plane (ZipNN's ``reorder_signbit``). Against a base of the same shape the planes hold the
XOR, or the zigzagged integer difference, of the two tensors (§2.4: consecutive training steps
differ in few low bits). Every method is exactly invertible.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import zstandard

Method = Literal["stored", "planes", "xor", "idiff"]
METHODS: tuple[Method, ...] = ("stored", "planes", "xor", "idiff")
LEVEL = 1  # zstd level 1 beats 3 and 9 on exponent planes (perf.md §2.3)
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_INT = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def _words(data: memoryview | bytes, width: int) -> np.ndarray:
    return np.frombuffer(data, dtype=_UINT[width])


def _rotl(words: np.ndarray, bits: int) -> np.ndarray:
    return (words << np.asarray(1, words.dtype)) | (words >> np.asarray(bits - 1, words.dtype))


def _planes(words: np.ndarray) -> list[Any]:
    width = words.dtype.itemsize
    # one transposing copy; little-endian, so byte width-1 (the most significant) comes first
    rows = np.ascontiguousarray(words.view(np.uint8).reshape(-1, width)[:, ::-1].T)
    return [rows[i].data for i in range(width)]


def _zigzag(d: np.ndarray, width: int) -> np.ndarray:
    """(d << 1) ^ (d >> bits-1), computed in place on ``d`` (a fresh difference array)."""
    s = d.view(_INT[width])
    sign = s >> np.asarray(8 * width - 1, s.dtype)
    np.left_shift(s, np.asarray(1, s.dtype), out=s)
    np.bitwise_xor(s, sign, out=s)
    return s.view(_UINT[width])


def transform(
    method: Method, target: bytes | memoryview, base: bytes | memoryview | None, width: int, floating: bool
) -> list[bytes]:
    """The byte planes a method codes (before zstd)."""
    if method == "stored":
        return [bytes(target)]
    t = _words(target, width)
    if method == "planes":
        words = _rotl(t, 8 * width) if floating else t
    else:
        assert base is not None
        b = _words(base, width)
        xor = t ^ b
        # idiff: the wrapping integer difference, zigzagged so small changes either way are small
        words = (_rotl(xor, 8 * width) if floating else xor) if method == "xor" else _zigzag(t - b, width)
    return _planes(words)


def compress_planes(planes: list[Any]) -> list[bytes]:
    cctx = zstandard.ZstdCompressor(level=LEVEL)
    return [cctx.compress(p) for p in planes]


def decompress_planes(frames: list[bytes], sizes: list[int]) -> list[bytes]:
    dctx = zstandard.ZstdDecompressor()
    return [decompress_bounded(dctx, f, n) for f, n in zip(frames, sizes, strict=True)]


def decompress_bounded(dctx: zstandard.ZstdDecompressor, frame: bytes, n: int) -> bytes:
    """A zstd frame of at most ``n`` bytes, decompressed; ValueError for a frame that declares more
    (zstd would allocate what the frame declares before checking)."""
    declared = zstandard.frame_content_size(frame)
    if declared > n:
        raise ValueError(f"a frame declares {declared:,} bytes where {n:,} are expected")
    return dctx.decompress(frame, max_output_size=n)


_SAMPLE = 1 << 20


def encode(
    target: bytes | memoryview, base: bytes | memoryview | None, width: int, floating: bool
) -> tuple[Method, list[bytes], list[int]]:
    """Code a tensor's bytes with the method that comes out smallest. Candidates are tried on a
    sample of up to 1 MiB (whole elements) first; the winner codes the whole tensor.
    Returns (method, zstd frames, plane sizes)."""
    n = len(target)
    if width not in _UINT or n % width or n == 0:
        return "stored", [bytes(target)], [n]
    candidates: list[Method] = ["planes"]
    if base is not None and len(base) == n:
        candidates += ["xor", "idiff"]
    if n > _SAMPLE:
        cut = _SAMPLE - _SAMPLE % width
        sample_t = memoryview(target)[:cut]
        sample_b = memoryview(base)[:cut] if base is not None else None
        sizes = {
            m: sum(map(len, compress_planes(transform(m, sample_t, sample_b, width, floating)))) for m in candidates
        }
        candidates = [min(sizes, key=lambda m: sizes[m])]
    best: tuple[Method, list[bytes], list[int]] | None = None
    for m in candidates:
        planes = transform(m, target, base, width, floating)
        frames = compress_planes(planes)
        if best is None or sum(map(len, frames)) < sum(map(len, best[1])):
            best = (m, frames, [len(p) for p in planes])
    assert best is not None
    if sum(map(len, best[1])) >= n:
        return "stored", [bytes(target)], [n]
    return best


def decode_into(
    out: memoryview,
    method: Method,
    frames: list[bytes],
    sizes: list[int],
    base: bytes | memoryview | None,
    width: int,
    floating: bool,
) -> None:
    """Decode a piece straight into ``out`` (its bytes in the file being rebuilt): the planes are
    interleaved into ``out`` and the inverse transform runs there in place, with no copy of the
    piece in between. Raises ValueError when the frames do not decode to ``len(out)`` bytes."""
    nbytes = len(out)
    if method == "stored":
        if len(frames) != 1 or len(frames[0]) != nbytes:
            raise ValueError(f"a stored piece of {sum(map(len, frames)):,} bytes where {nbytes:,} are expected")
        out[:] = frames[0]
        return
    planes = decompress_planes(frames, sizes)
    if width not in _UINT or nbytes % width or len(planes) != width:
        raise ValueError(f"{len(planes)} planes of a {width}-byte type do not make {nbytes:,} bytes")
    count = nbytes // width
    if any(len(p) != count for p in planes):
        raise ValueError(f"planes of {[len(p) for p in planes]} bytes where {count:,} each are expected")
    words = np.frombuffer(out, dtype=_UINT[width])  # writable: out is a writable view
    lanes = words.view(np.uint8).reshape(count, width)
    for j, plane in enumerate(planes):  # plane 0 holds the most significant bytes (little-endian: last)
        lanes[:, width - 1 - j] = np.frombuffer(plane, dtype=np.uint8)
    bits = 8 * width
    if method == "idiff":
        low = words & np.asarray(1, words.dtype)
        np.right_shift(words, np.asarray(1, words.dtype), out=words)
        np.negative(low, out=low)
        np.bitwise_xor(words, low, out=words)
        np.add(words, _words(_need_base(base, nbytes), width), out=words)
        return
    if floating:
        top = words << np.asarray(bits - 1, words.dtype)
        np.right_shift(words, np.asarray(1, words.dtype), out=words)
        np.bitwise_or(words, top, out=words)
    if method == "xor":
        np.bitwise_xor(words, _words(_need_base(base, nbytes), width), out=words)
    elif method != "planes":
        raise ValueError(f"unknown coding method {method!r}")


def _need_base(base: bytes | memoryview | None, nbytes: int) -> bytes | memoryview:
    if base is None or len(base) != nbytes:
        raise ValueError(f"a piece coded against a base of {nbytes:,} bytes, and no such base")
    return base
