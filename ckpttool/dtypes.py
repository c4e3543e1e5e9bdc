"""The dtypes ckpttool knows, under every spelling the formats use.

Our canonical name is torch's (``float32``, ``bfloat16``, ...). Tensor bytes are handled as numpy
arrays of a same-width *carrier* dtype: exact bit patterns move through numpy even for dtypes it
lacks (bfloat16 travels as uint16, float8 as uint8), so nothing here needs torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class DType:
    name: str
    """torch's name: ``float32``, ``bfloat16``, ..."""
    itemsize: int
    safetensors: str | None
    """the safetensors header code, e.g. ``F32``; None where safetensors has none"""
    numpy: str
    """the numpy dtype with the same bytes (a same-width carrier for dtypes numpy lacks)"""
    exact_numpy: bool
    """whether ``numpy`` is the real type (so values can be computed with), not only a carrier"""
    storage_class: str | None
    """torch's legacy typed-storage class name in pickles (``FloatStorage``), if any"""

    @property
    def is_floating(self) -> bool:
        return self.name.startswith(("float", "bfloat")) or self.name in ("half", "double")


_TABLE = [
    DType("float64", 8, "F64", "<f8", True, "DoubleStorage"),
    DType("float32", 4, "F32", "<f4", True, "FloatStorage"),
    DType("float16", 2, "F16", "<f2", True, "HalfStorage"),
    DType("bfloat16", 2, "BF16", "<u2", False, "BFloat16Storage"),
    DType("int64", 8, "I64", "<i8", True, "LongStorage"),
    DType("int32", 4, "I32", "<i4", True, "IntStorage"),
    DType("int16", 2, "I16", "<i2", True, "ShortStorage"),
    DType("int8", 1, "I8", "i1", True, "CharStorage"),
    DType("uint8", 1, "U8", "u1", True, "ByteStorage"),
    DType("uint16", 2, "U16", "<u2", True, None),
    DType("uint32", 4, "U32", "<u4", True, None),
    DType("uint64", 8, "U64", "<u8", True, None),
    DType("bool", 1, "BOOL", "?", True, "BoolStorage"),
    DType("complex64", 8, "C64", "<c8", True, "ComplexFloatStorage"),
    DType("complex128", 16, None, "<c16", True, "ComplexDoubleStorage"),
    DType("float8_e4m3fn", 1, "F8_E4M3", "u1", False, None),
    DType("float8_e5m2", 1, "F8_E5M2", "u1", False, None),
    DType("float8_e4m3fnuz", 1, "F8_E4M3FNUZ", "u1", False, None),  # (safetensors ≥ 0.6 writes them)
    DType("float8_e5m2fnuz", 1, "F8_E5M2FNUZ", "u1", False, None),  # (safetensors ≥ 0.6 writes them)
    DType("float8_e8m0fnu", 1, "F8_E8M0", "u1", False, None),
]

BY_NAME: dict[str, DType] = {d.name: d for d in _TABLE}
# torch's aliases as they appear in pickles (torch.float is pickled as "float32", but old code and
# users write the short names).
for _alias, _name in {
    "float": "float32",
    "double": "float64",
    "half": "float16",
    "long": "int64",
    "int": "int32",
    "short": "int16",
    "cfloat": "complex64",
    "cdouble": "complex128",
}.items():
    BY_NAME[_alias] = BY_NAME[_name]
BY_SAFETENSORS: dict[str, DType] = {d.safetensors: d for d in _TABLE if d.safetensors}
BY_STORAGE_CLASS: dict[str, DType] = {d.storage_class: d for d in _TABLE if d.storage_class}


def dtype(name: str) -> DType:
    """Look a dtype up by torch name (``float32`` or ``torch.float32``)."""
    key = name.removeprefix("torch.")
    try:
        return BY_NAME[key]
    except KeyError:
        raise KeyError(f"unknown dtype {name!r}") from None


def carrier(name: str) -> np.dtype:
    """The numpy dtype that carries this dtype's bytes unchanged."""
    return np.dtype(dtype(name).numpy)


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 values (carried as uint16 bit patterns) widened to float32, exactly."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _float8_table(exp_bits: int, bias: int, *, ieee: bool, fnuz: bool, e8m0: bool = False) -> np.ndarray:
    """The float32 value of each of the 256 codes of a float8 format (the OCP and the AMD "fnuz"
    variants as torch defines them): ``ieee``, the top exponent is Inf (zero mantissa) or NaN;
    else only the all-ones code is NaN (e4m3fn); ``fnuz``, no negative zero: 0x80 is the NaN."""
    codes = np.arange(256, dtype=np.int64)
    if e8m0:  # exponent only, no sign: 2 ** (code - 127), 0xFF NaN
        out = np.ldexp(np.float64(1.0), codes - 127)
        out[255] = np.nan
        return out.astype(np.float32)
    man_bits = 7 - exp_bits
    sign = np.where(codes & 0x80, -1.0, 1.0)
    e = (codes >> man_bits) & ((1 << exp_bits) - 1)
    m = codes & ((1 << man_bits) - 1)
    normal = np.ldexp(1.0 + m / (1 << man_bits), e - bias)
    sub = np.ldexp(m / (1 << man_bits), 1 - bias)
    out = sign * np.where(e == 0, sub, normal)
    top = e == (1 << exp_bits) - 1
    if ieee:
        out[top & (m == 0)] = sign[top & (m == 0)] * np.inf
        out[top & (m != 0)] = np.nan
    elif fnuz:
        out[0x80] = np.nan
    else:
        out[(codes & 0x7F) == 0x7F] = np.nan
    return out.astype(np.float32)


_FLOAT8 = {
    "float8_e4m3fn": _float8_table(4, 7, ieee=False, fnuz=False),
    "float8_e5m2": _float8_table(5, 15, ieee=True, fnuz=False),
    "float8_e4m3fnuz": _float8_table(4, 8, ieee=False, fnuz=True),
    "float8_e5m2fnuz": _float8_table(5, 16, ieee=False, fnuz=True),
    "float8_e8m0fnu": _float8_table(8, 127, ieee=False, fnuz=False, e8m0=True),
}


def as_float(values: np.ndarray, name: str) -> np.ndarray | None:
    """Values of a floating-point dtype ``name`` as numbers numpy computes with (bfloat16 and the
    float8 formats, carried as bit patterns, decoded exactly to float32); None for other dtypes."""
    if name == "bfloat16":
        return bf16_to_float32(values)
    table = _FLOAT8.get(name)
    if table is not None:
        return table[values.view(np.uint8)]
    if name in ("float16", "float32", "float64", "half", "float", "double"):
        return values
    return None


def as_numbers(values: np.ndarray, name: str) -> np.ndarray:
    """Values as numbers numpy computes with: bfloat16 and float8 decoded from their bit patterns
    (float8 compared as its codes said 448 and 416 were 1 apart), complex kept complex (its
    imaginary part was dropped), anything else widened to float64."""
    decoded = as_float(values, name)
    if decoded is not None:
        return decoded
    if values.dtype.kind in "fc":
        return values
    return values.astype(np.float64)


def float32_to_bf16(values: np.ndarray) -> np.ndarray:
    """float32 values narrowed to bfloat16 bit patterns (uint16) as torch's ``.to(torch.bfloat16)``
    rounds them on the CPU: to nearest, ties to even; a NaN becomes 0xFFFF (ATen's vectorised
    conversion; its scalar one gives 0x7FC0)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((bits + (((bits >> 16) & 1) + np.uint32(0x7FFF))) >> 16).astype(np.uint16)
    rounded[np.isnan(values)] = 0xFFFF
    return rounded
