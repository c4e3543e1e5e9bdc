"""Helpers for the non-tensor values found in checkpoints."""

from __future__ import annotations

import contextlib
import gc
import math
import re
import struct
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ckpttool.errors import UsageError
from ckpttool.manifest import Item
from ckpttool.naming import STEP_NAMES

_MAX_ELEMENTS = 16


def plain_value(value: Any) -> Any:
    """``value`` if it is small and JSON-plain (for display in ``inspect``/``ls``), else None; numpy's
    booleans and real numbers (``np.int64(12)``) as Python's."""
    if isinstance(value, np.generic) and value.dtype.kind in "biuf":
        value = value.item()
    if value is None or isinstance(value, bool | int | str):
        return value if not isinstance(value, str) or len(value) <= 200 else None
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, list | tuple) and len(value) <= _MAX_ELEMENTS:
        inner = [plain_value(v) for v in value]
        if all(i is not None or v is None for i, v in zip(inner, value, strict=True)):
            return inner
    if isinstance(value, dict) and len(value) <= _MAX_ELEMENTS and all(isinstance(k, str) for k in value):
        inner_d = {k: plain_value(v) for k, v in value.items()}
        if all(inner_d[k] is not None or value[k] is None for k in value):
            return inner_d
    return None


def describe_value(value: Any) -> str:
    """A short text for any value: its plain form, or its type and size."""
    p = plain_value(value)
    if p is not None or value is None:
        return repr(p)
    if isinstance(value, list | tuple | dict | set):
        return f"{type(value).__name__} of {len(value)}"
    from ckpttool._unpickle import NumpyDType

    if isinstance(value, NumpyDType):
        return repr(value)  # (dtype('>i4'))
    return type(value).__name__


def set_value(item: Item, value: Any) -> None:
    """Record a non-tensor value on its item: the value itself when small and plain, else a summary;
    and whether a float in it is NaN or Inf."""
    item.value = plain_value(value)
    if item.value is None and value is not None:
        item.summary = describe_value(value)
    # (a learning rate's list is read whole: a scheduler of 24 parameter groups keeps 24; another
    # long list, a loss history say, may hold the NaN of an overflow step fp16 training skipped)
    longest = _LR_ELEMENTS if LEARNING_RATE.search(item.name) else _MAX_ELEMENTS
    found = set(_nonfinite(value, longest))
    item.nonfinite = "NaN" if "NaN" in found else "Inf" if found else None


LEARNING_RATE = re.compile(r"(?:^|\.)[^.]*lrs?(?:\.\d+)*$")
"""a learning rate's name: its last part (list indices aside) ends in ``lr`` or ``lrs``"""

_LR_ELEMENTS = 1 << 16
"""the longest list of learning rates :func:`set_value` looks through for NaN or Inf"""


def _nonfinite(value: Any, longest: int, depth: int = 0) -> Iterator[str]:
    """``"NaN"`` and ``"Inf"`` for each such float ``value`` is or holds (in containers of at most
    ``longest`` elements, four deep)."""
    if isinstance(value, float | np.floating) and not math.isfinite(value):  # (numpy's np.float32 too)
        yield "NaN" if math.isnan(value) else "Inf"
    elif depth < 4 and isinstance(value, list | tuple) and len(value) <= longest:
        for v in value:
            yield from _nonfinite(v, longest, depth + 1)
    elif depth < 4 and isinstance(value, dict) and len(value) <= longest:
        for v in value.values():
            yield from _nonfinite(v, longest, depth + 1)


def find_step(items: dict[str, Item]) -> int | None:
    """The training step a checkpoint claims: the first of the usual top-level entries that holds
    an integer."""
    for name in STEP_NAMES:
        item = items.get(name)
        if item is not None and isinstance(item.value, int) and not isinstance(item.value, bool):
            return item.value
    return None


def flatten(obj: Any, prefix: str = "", leaf: Callable[[Any], Any] | None = None) -> list[tuple[str, Any]]:
    """Leaves of a nested state dict under dotted names, as DCP flattens them: mappings and the
    lists/tuples that hold mappings or tensors are walked into (keys and indices become name
    segments); any other value, tensors included, is a leaf. ``leaf(value)`` may claim a mapping
    as a leaf by returning what to record for it (None: walk into it)."""
    out: list[tuple[str, Any]] = []
    _flatten(obj, prefix, out, leaf)
    return out


def is_container_leaf(value: Any) -> bool:
    """Whether a list/tuple is a leaf value: it holds (at any depth) no mapping and no tensor."""
    return not any(
        isinstance(v, dict) or _is_tensor(v) or (isinstance(v, list | tuple) and not is_container_leaf(v))
        for v in value
    )


def _is_tensor(value: Any) -> bool:
    from ckpttool._dtensor import DTensorRef
    from ckpttool._unpickle import TensorRef

    return isinstance(value, TensorRef | DTensorRef)


def _flatten(obj: Any, prefix: str, out: list[tuple[str, Any]], leaf: Callable[[Any], Any] | None) -> None:
    claimed = leaf(obj) if leaf is not None else None
    if claimed is not None:
        out.append((prefix, claimed))
    elif isinstance(obj, dict) and obj:
        for key, value in obj.items():
            _flatten(value, f"{prefix}.{key}" if prefix else str(key), out, leaf)
    elif isinstance(obj, list | tuple) and obj and not is_container_leaf(obj):
        for i, value in enumerate(obj):
            _flatten(value, f"{prefix}.{i}" if prefix else str(i), out, leaf)
    else:
        out.append((prefix, obj))


def is_count(v: object) -> bool:
    """A non-negative int (not a bool): a size, an offset or an index read from a file."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cycle collection while building 10^5..10^6 small records none of which is cyclic garbage
    (the collector would rescan them all, again and again); restored as it was on the way out."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def same_value(a: Any, b: Any) -> bool:
    """Two non-tensor values the same, as strictly as tensors are compared: a bool is not the int
    it equals (``True`` against ``1``), nor an int the float (``1`` against ``1.0``), and floats
    are the same only bit for bit (``0.0`` against ``-0.0`` differ; a NaN is the same NaN). A
    tuple and a list of the same values are the same (formats keep sequences either way). A numpy
    number is a 0-d array, and arrays are compared in the machine's byte order (numpy reads a
    big-endian array pickled with protocol 5 as it is, with 2 swapped)."""
    a, b = (native_array(v) if isinstance(v, np.generic | np.ndarray) else v for v in (a, b))
    if isinstance(a, float) and isinstance(b, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):  # (NumPy's RNG state holds one)
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and (a.dtype, a.shape) == (b.dtype, b.shape)
            and a.tobytes() == b.tobytes()
        )
    if isinstance(a, bool | int | float) or isinstance(b, bool | int | float):
        return type(a) is type(b) and a == b
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    return bool(a == b)


def native_array(value: Any) -> np.ndarray:
    """A numpy array or number as an array in the machine's byte order (numpy reads ``>i4`` pickled
    with protocol 2 as ``<i4``, with protocol 5 as it is)."""
    array = np.asarray(value)
    return array if array.dtype.isnative else array.astype(array.dtype.newbyteorder("="))


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``'s ``object_pairs_hook`` that refuses an object naming a key twice (``json``
    keeps the last one without a word: a tensor of a safetensors header, a file of a container)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"names {dup!r:.60} twice")
    return out


def check_tolerance(flag: str, value: float) -> None:
    """Refuse a tolerance that is not a finite number, 0 or more: a negative bound makes equal
    values "different", NaN makes every difference "within"."""
    if not (math.isfinite(value) and value >= 0):
        raise UsageError(f"{flag} {value}: a tolerance is a finite number, 0 or more")
