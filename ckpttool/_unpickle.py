"""A pickle reader that runs no code from the checkpoint.

Pickles can call any importable function. This reader resolves every global through an explicit
allowlist of ``(module, name) -> stand-in``: a stand-in is a harmless function or stub class of
ours (``torch.Size`` becomes ``tuple``, a DCP ``Metadata`` becomes a plain record). Anything else
raises :class:`~ckpttool.errors.UnsafePickleError` naming the global, before it is resolved, so
nothing from the file is imported or called. torch is never imported here.

Each format module builds its allowlist from :data:`PLAIN` plus its own stubs.
"""

from __future__ import annotations

import collections
import contextvars
import dataclasses
import datetime
import io
import math
import ntpath
import os
import pickle
import posixpath
import queue
import reprlib
import struct
import sys
import threading
import types
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from ckpttool.dtypes import BY_NAME, BY_STORAGE_CLASS
from ckpttool.errors import CorruptFileError, UnsafePickleError

Allowlist = Mapping[tuple[str, str], Any]


class _Brief(reprlib.Repr):
    """``repr`` cut to a few levels and members: a pickle's values can be tuples shared through its
    memo at every level, whose full repr would take longer than the age of the universe."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxtuple = self.maxlist = self.maxset = self.maxfrozenset = 6
        self.maxdict = 4
        self.maxstring = self.maxother = 60

    def repr1(self, x: Any, level: int) -> str:
        # (reprlib picks a method by the exact type's name: subclasses of containers and our records
        # would fall back to their full repr)
        if isinstance(x, dict):
            return self.repr_dict(x, level)
        if isinstance(x, tuple):
            return self.repr_tuple(x, level)
        if isinstance(x, list):
            return self.repr_list(x, level)
        if isinstance(x, Record | Fields):
            return f"{type(x).__name__}(...)"
        if isinstance(x, int) and x.bit_length() > 256:
            return f"<int of {x.bit_length():,} bits>"
        return super().repr1(x, level)


_BRIEF = _Brief()


def brief(value: Any, width: int = 80) -> str:
    """``repr(value)`` for a message, at most ``width`` characters, in bounded time whatever the
    value (see :class:`_Brief`)."""
    text = _BRIEF.repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


_BUDGET: contextvars.ContextVar[list[Any]] = contextvars.ContextVar("ckpttool_unpickle_budget")
"""What the stand-ins may still spend in the current load: [hashing (what the walk left of
MAX_HASHED), values copied (MAX_COPIED and four per byte of the pickle), the complex numbers made
and their hashes (see :func:`_complex`)]."""
MAX_COPIED = 100_000
"""Most values the stand-ins may copy in one load (``set(list)``, ``OrderedDict(pairs)``, ``bytearray``),
beyond four per byte of the pickle (a pickle's own values take at least a byte each)."""


def _hashed(values: Iterable[Any]) -> None:
    """Charge hashing ``values`` (what ``set()``, ``frozenset()`` or a dict built from a pickle's
    pairs is about to hash) to the load's budget: raises UnpicklingError past it. The unpickler's
    own hashing is charged before it runs (:func:`_walk`); a call's is known only here. A tuple
    costs its members and theirs, however often it recurs; each distinct one is looked into once."""
    budget = _budget()
    costs: dict[int, int] = {}
    for value in values:
        if isinstance(value, tuple):
            budget[0] -= _tuple_cost(value, costs)
        elif type(value) is int:
            budget[0] -= value.bit_length() >> 6  # (an int's hash is not cached: it costs its digits)
        if budget[0] < 0:
            raise pickle.UnpicklingError(_HASH_BOMB)


def _tuple_cost(root: tuple[Any, ...], costs: dict[int, int]) -> int:
    """The members hashing ``root`` visits, nested tuples' included (``costs``: those known, by id)."""
    todo: list[tuple[Any, ...]] = [root]
    while todo:
        t = todo[-1]
        if id(t) in costs:
            todo.pop()
            continue
        pending = [m for m in t if isinstance(m, tuple) and id(m) not in costs]
        if pending:
            todo.extend(pending)
            continue
        todo.pop()
        cost = len(t)
        for m in t:
            if isinstance(m, tuple):
                cost += costs[id(m)]
            elif type(m) is int:
                cost += m.bit_length() >> 6  # (an int's hash is not cached: it costs its digits)
        costs[id(t)] = min(_CAP, cost)
    return costs[id(root)]


_BUILT_ON_GLOBAL = (
    "sets state on a class, function or constant it names (BUILD), which would change it for every later read in "
    "this process: no library writes that"
)


def _refuse_state(*_: Any) -> None:
    """``__setstate__`` of the stand-ins a pickle names and of the records that take no state: a
    BUILD on a global would otherwise change our stand-in for the rest of the process (the
    ``dtype`` of ``torch.FloatStorage``, a function's ``__defaults__``)."""
    raise pickle.UnpicklingError(_BUILT_ON_GLOBAL)


def _copied(count: int) -> None:
    """Charge ``count`` values a stand-in copies to the load's budget (a set() of a 100 000-item list,
    called 300 times through the memo, made 1.2 GB of a 500 KB pickle)."""
    budget = _budget()
    budget[1] -= count
    if budget[1] < 0:
        raise pickle.UnpicklingError(
            "makes more copies of values than it holds (set(), OrderedDict() or a state given again and again)"
        )


def _budget() -> list[Any]:
    """The current load's budget (see _BUDGET); a fresh one where a stand-in is called outside a load."""
    return _BUDGET.get(None) or _fresh_budget(MAX_HASHED, MAX_COPIED)


def _fresh_budget(hashing: int, copies: int) -> list[Any]:
    return [hashing, copies, (set(), set())]


def _dict_again(d: dict[Any, Any]) -> dict[Any, Any]:
    """``d``, whose items a stand-in is about to copy and whose keys it hashes again (a state dict
    set on a record, ``OrderedDict(d)``), both charged; the same dict can be given again and again."""
    _copied(len(d))
    _hashed(d.keys())
    return d


def _members(args: tuple[Any, ...]) -> list[Any]:
    """The members ``set(*args)`` or ``frozenset(*args)`` is given, their copying and hashing charged."""
    if len(args) > 1:
        raise pickle.UnpicklingError(f"a set made of {len(args)} arguments")
    items = list(args[0]) if args else []
    _copied(len(items))
    _hashed(items)
    return items


def _set(*args: Any) -> set[Any]:
    return set(_members(args))


def _frozenset(*args: Any) -> frozenset[Any]:
    return frozenset(_members(args))


def _bytes(*args: Any) -> bytes:
    # protocol-2 pickles spell b"" as bytes() and bytearrays as bytearray(bytes)
    if not args:
        return b""
    if len(args) == 1 and isinstance(args[0], bytes | bytearray):
        return bytes(args[0])
    raise pickle.UnpicklingError(f"bytes{brief(args)} is not a plain bytes value")


def _bytearray(*args: Any) -> bytearray:
    data = _bytes(*args)
    _copied(len(data) >> 3)  # (a copy of the pickle's bytes)
    return bytearray(data)


def _codecs_encode(text: Any, encoding: str = "utf-8") -> bytes:
    # protocol-2 pickles spell bytes as _codecs.encode(str, "latin1")
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"_codecs.encode({type(text).__name__}, {brief(encoding, 40)}) is not plain bytes")
    return text.encode("latin1")


class OrderedDictStandIn(dict[Any, Any]):
    """``collections.OrderedDict``: a dict that also takes the attributes a pickle may set on it
    (``module.state_dict()`` carries ``_metadata``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if args:  # (Python 2 pickled one as OrderedDict([[key, value], ...]): the keys are hashed here)
            first = args[0]
            if isinstance(first, dict):
                _dict_again(first)
            else:
                pairs = list(first)
                if not all(type(p) in (list, tuple) and len(p) == 2 for p in pairs):  # (dict() takes any 2 items)
                    raise pickle.UnpicklingError("OrderedDict made from something other than [key, value] pairs")
                _copied(len(pairs))
                _hashed(p[0] for p in pairs)
        super().__init__(*args, **kwargs)

    def __setstate__(self, state: Any) -> None:
        # (what the unpickler's own BUILD would do: the attributes, from a dict or a (dict, slots) pair)
        for part in state if isinstance(state, tuple) and len(state) == 2 else (state,):
            if isinstance(part, dict):
                # (an attribute named as a method, "items", would stand in for it on this dict)
                if shadowing := [k for k in part if type(k) is not str or hasattr(OrderedDictStandIn, k)]:
                    raise pickle.UnpicklingError(f"OrderedDict attributes named {brief(shadowing, 60)}")
                self.__dict__.update(_dict_again(part))
            elif part is not None:
                raise pickle.UnpicklingError(f"OrderedDict state of type {type(part).__name__}")


class CounterStandIn(collections.Counter[Any]):
    """``collections.Counter`` (which torch's ``weights_only`` load allows): a dict of counts, pickled
    back as one."""

    __setstate__ = _refuse_state  # (a Counter pickles no state)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if len(args) > 1 or kwargs:
            raise pickle.UnpicklingError(f"Counter made of {len(args)} arguments and {len(kwargs)} keywords")
        if args and isinstance(args[0], dict):
            super().__init__(_dict_again(args[0]))
        elif args:  # (elements to count: copied and hashed)
            super().__init__(_members(args))
        else:
            super().__init__()

    def __reduce__(self) -> tuple[Any, ...]:
        return (collections.Counter, (dict(self),))


def _complex(*args: Any) -> complex:
    """``complex(real, imag)``, counting the numbers that share a hash: ``hash(complex(a, b))`` is
    ``hash(a) + 1000003 * hash(b)``, so any number of them can share one (``a = c - 1000003 * b``), and a
    dict of ``k`` of them takes the unpickler ``k**2 / 2`` comparisons (30 000 in 1.3 MB took 5.6 s;
    a million, two hours). As for large ints (see :func:`_colliding`), more than ``_MAX_COLLIDING``
    are refused."""
    return _counted_complex(complex(*args))


def _counted_complex(value: Any) -> Any:
    """``value``, a complex number (Python's or numpy's), counted (see :func:`_complex`); one with a NaN
    part hashes by identity and collides with none: not kept."""
    if value == value and (problem := _colliding(value, _budget()[2], "complex numbers")):
        raise pickle.UnpicklingError(problem)
    return value


class TorchVersion(str):
    """``torch.__version__`` (a ``torch.torch_version.TorchVersion``, a str) kept in a checkpoint: the
    text, which a writer pickles back as torch's class."""

    __slots__ = ()

    def __new__(cls, *args: Any) -> TorchVersion:
        if len(args) != 1 or type(args[0]) is not str or len(args[0]) > 256:
            raise pickle.UnpicklingError(f"torch.torch_version.TorchVersion{brief(args)}")
        return super().__new__(cls, args[0])

    __setstate__ = _refuse_state


def _datetime_args(what: str, args: tuple[Any, ...], most: int) -> tuple[Any, ...]:
    """The arguments of a ``datetime`` class as Python pickles them (the packed bytes, or numbers of
    at most 64 bits, and a fixed-offset time zone): anything else, a ``zoneinfo`` or ``pytz`` zone say,
    or a number of a million digits that ``timedelta`` would work through at every call, is refused.
    The class checks the values as far as Python's own unpickling does (of the packed bytes, the
    month or hour only)."""
    if len(args) > most or not all(
        (type(a) is int and a.bit_length() <= 64)
        or type(a) is float
        or (type(a) in (bytes, str) and len(a) <= 64)
        or type(a) is datetime.timezone
        for a in args
    ):
        raise pickle.UnpicklingError(f"datetime.{what}{brief(args)}")
    return args


def _dt_datetime(*args: Any) -> datetime.datetime:  # (module functions: the allowlists go to spawned workers)
    return datetime.datetime(*_datetime_args("datetime", args, 8))


def _dt_date(*args: Any) -> datetime.date:
    return datetime.date(*_datetime_args("date", args, 3))


def _dt_time(*args: Any) -> datetime.time:
    return datetime.time(*_datetime_args("time", args, 5))


def _dt_timedelta(*args: Any) -> datetime.timedelta:
    return datetime.timedelta(*_datetime_args("timedelta", args, 3))


def _dt_timezone(offset: Any = None, *name: Any) -> datetime.timezone:
    if type(offset) is not datetime.timedelta or not all(type(n) is str and len(n) <= 64 for n in name):
        raise pickle.UnpicklingError(f"datetime.timezone({brief(offset, 40)}, {brief(name, 40)})")
    return datetime.timezone(offset, *name)


DATETIME: dict[tuple[str, str], Any] = {
    ("datetime", "datetime"): _dt_datetime,
    ("datetime", "date"): _dt_date,
    ("datetime", "time"): _dt_time,
    ("datetime", "timedelta"): _dt_timedelta,
    ("datetime", "timezone"): _dt_timezone,
}


_BUILTINS: dict[str, Any] = {
    "set": _set,
    "frozenset": _frozenset,
    "complex": _complex,
    "slice": slice,
    "bytes": _bytes,
    "bytearray": _bytearray,
}
PLAIN: dict[tuple[str, str], Any] = {
    # protocol <= 2 pickles written by Python 3 spell builtins the Python 2 way
    **{(module, name): fn for module in ("builtins", "__builtin__") for name, fn in _BUILTINS.items()},
    ("_codecs", "encode"): _codecs_encode,
    ("collections", "OrderedDict"): OrderedDictStandIn,
    ("collections", "Counter"): CounterStandIn,
    **DATETIME,
    ("torch.torch_version", "TorchVersion"): TorchVersion,
}
"""Globals that plain Python values (containers, numbers, bytes, times, ``torch.__version__``) need:
safe for any format."""


_RUNS_CODE_MODULES = frozenset(
    {
        "os",
        "posix",
        "nt",
        "subprocess",
        "_posixsubprocess",
        "sys",
        "importlib",
        "runpy",
        "shutil",
        "socket",
        "pty",
        "ctypes",
        "code",
        "codeop",
        "pickle",
        "_pickle",
        "marshal",
        "webbrowser",
        "platform",
        "pdb",
        "timeit",
        "cProfile",
        "profile",
        "multiprocessing",
        "asyncio",
        "signal",
        "io",
        "_io",
        "pathlib",
        "urllib",
        "http",
        "requests",
        "types",
        "operator",
        "commands",
        "popen2",
    }
)
_RUNS_CODE_BUILTINS = frozenset(
    {
        "eval",
        "exec",
        "execfile",
        "compile",
        "open",
        "file",
        "__import__",
        "getattr",
        "setattr",
        "delattr",
        "globals",
        "locals",
        "vars",
        "input",
        "breakpoint",
        "apply",
        "reload",
    }
)


_RUNS_CODE_PREFIXES = (
    "pydoc.",
    "bdb.",
    "pip.",
    "venv.",
    "ensurepip.",
    "setuptools.",
    "distutils.",
    "idlelib.",
    "tempfile.",
    "threading.",
    "_thread.",
    "torch.hub.",
    "torch.jit.",
    "torch.package.",
    "torch.serialization.",
    "torch.utils.cpp_extension.",
    "numpy.testing.",
    "numpy.f2py.",
    "numpy.distutils.",
)
"""module prefixes of more well-known ways to run commands or code (``pydoc.pipepager``,
``torch.hub.load``)"""


def hostile(globals_named: Iterable[str]) -> str | None:
    """The first of a pickle's globals (:func:`nested_globals`: every one it names, not only the
    first a reader refuses, which a harmless-looking class placed before it would hide) that runs
    code (:func:`runs_code`), or ``<computed>`` for one whose name is built on the stack, or None."""
    for name in globals_named:
        if name == "<computed>" or runs_code(name):
            return name
    return None


def runs_code(global_name: str) -> bool:
    """Whether a pickle global (``posix.system``) is one of the well-known ways a pickle runs code
    or touches the system: a function or class of a module that runs commands, opens files or
    sockets, imports or evaluates, or reaches attributes (``operator.attrgetter``). Not a proof of
    safety for any other global: the allowlists refuse those too; this only tells the ones that
    are hostile beyond doubt from a class a run keeps of its own."""
    module, _, name = global_name.rpartition(".")
    if (module, name) in PATHS:  # (a path, kept as its text; ``pathlib.Path.write_text`` is not one)
        return False
    if module in ("builtins", "__builtin__"):
        return name in _RUNS_CODE_BUILTINS
    return module.split(".")[0] in _RUNS_CODE_MODULES or f"{module}.".startswith(_RUNS_CODE_PREFIXES)


# -- torch tensors inside a torch.save archive ---------------------------------------------------


class TorchDType(str):
    """A torch dtype named in a pickle (``torch.float32``), kept as its name."""

    __slots__ = ()


def _by_fields(self: Any) -> tuple[Any, ...]:
    """``__reduce__`` of a record a pickle names (storage, tensor): copied and pickled as a call
    with its fields, every one of them (a BUILD on it is refused: see ``__setstate__``)."""
    return (type(self), tuple(getattr(self, f.name) for f in dataclasses.fields(self)))


@dataclass(frozen=True, slots=True)
class StorageType:
    """A legacy typed-storage class (``torch.FloatStorage``) or ``torch.UntypedStorage``."""

    dtype: str | None

    __reduce__ = _by_fields
    __setstate__ = _refuse_state  # (a frozen dataclass with slots would take one, and change this global)


@dataclass(frozen=True, slots=True)
class StorageRef:
    """A storage persisted in the archive as ``data/<key>``."""

    key: str
    dtype: str | None
    numel: int
    location: str

    __reduce__ = _by_fields

    def __setstate__(self, state: Any) -> None:
        _built_after("storage")


@dataclass(slots=True)
class TensorRef:
    """A tensor in a pickle: where its elements are, not the elements."""

    storage: StorageRef
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    is_parameter: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    requires_grad: bool = False

    __reduce__ = _by_fields

    def __setstate__(self, state: Any) -> None:
        _built_after("tensor")


def _built_after(what: str) -> None:
    """A pickle's BUILD on a tensor or storage record: it would set its offset, shape or dtype
    after they were checked (an offset of -8 read the zip's own headers as the tensor's values).
    torch's pickles never do (torch.load refuses them too)."""
    raise pickle.UnpicklingError(f"a {what}'s fields set after it was built (BUILD): torch.save never writes that")


def _dtype_of(storage: Any, explicit: Any = None) -> str:
    if explicit is not None:
        if not isinstance(explicit, TorchDType):
            raise pickle.UnpicklingError(f"tensor dtype {brief(explicit, 40)} is not a torch dtype")
        return str(explicit)
    if isinstance(storage, StorageRef) and storage.dtype is not None:
        return storage.dtype
    raise pickle.UnpicklingError("tensor without a dtype (untyped storage and no dtype argument)")


MAX_DIM = 2**48
"""Largest element count, dimension, stride or offset a tensor may claim (256 T elements)."""


def _rebuild_tensor_v2(storage: Any, storage_offset: Any, size: Any, stride: Any, *rest: Any) -> TensorRef:
    ref = _tensor(storage, storage_offset, size, stride, None)
    ref.requires_grad = bool(rest) and rest[0] is True
    meta = rest[2] if len(rest) > 2 else None  # (torch's set_tensor_metadata: the conj and neg bits)
    if isinstance(meta, dict) and (bits := sorted(k for k in ("conj", "neg") if meta.get(k))):
        # the storage holds the values before the view: read as stored they came out conjugated or
        # negated (export, convert and diff alike), where torch.load gives the view's
        raise pickle.UnpicklingError(
            f"a tensor saved as a lazy {' and '.join(bits)} view (torch's tensor metadata {brief(meta)}), which "
            "ckpttool does not read yet: its stored values are not the tensor's; save t.resolve_conj().resolve_neg()"
        )
    return ref


def _rebuild_tensor_v3(
    storage: Any, storage_offset: Any, size: Any, stride: Any, rg: Any, _hooks: Any, dtype: Any, *_: Any
) -> TensorRef:
    ref = _tensor(storage, storage_offset, size, stride, dtype)
    ref.requires_grad = rg is True
    return ref


def _tensor(storage: Any, storage_offset: Any, size: Any, stride: Any, dtype: Any) -> TensorRef:
    if not isinstance(storage, StorageRef):
        raise pickle.UnpicklingError(f"tensor rebuilt from {type(storage).__name__}, not an archive storage")
    if not (
        isinstance(storage_offset, int)
        and isinstance(size, tuple)
        and isinstance(stride, tuple)
        and len(size) == len(stride) <= 64
        and all(isinstance(v, int) and v >= 0 for v in (*size, *stride))
        and storage_offset >= 0
        and all(v <= MAX_DIM for v in (*size, *stride, storage_offset))
        and math.prod(size) <= MAX_DIM
    ):
        raise pickle.UnpicklingError(f"malformed tensor geometry: size={brief(size)} stride={brief(stride)}")
    return TensorRef(storage, storage_offset, size, stride, _dtype_of(storage, dtype))


def _rebuild_parameter(data: Any, *_rest: Any) -> Any:
    if isinstance(data, TensorRef):
        data.is_parameter = True
    return data


class _TensorType:
    """``torch.Tensor`` / ``torch.nn.Parameter`` named as the ``new_type`` of a rebuild."""

    __setstate__ = _refuse_state


class WrapperType:
    """A tensor subclass a format reads (DTensor: see :mod:`ckpttool._dtensor`), named as the
    ``new_type`` of a rebuild: its ``rebuild(func, args, state)`` makes the value."""

    @classmethod
    def rebuild(cls, func: Any, args: Any, state: Any) -> Any:
        raise NotImplementedError


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    # plain tensors with Python attributes are pickled through here; subclasses are refused by
    # the allowlist (new_type must be one of the two stand-ins above, or a wrapper a format reads)
    if isinstance(new_type, type) and issubclass(new_type, WrapperType):
        return new_type.rebuild(func, args, state)
    if new_type is not _TensorType:
        raise pickle.UnpicklingError("tensor subclass")
    result = func(*args)
    if isinstance(result, TensorRef) and isinstance(state, dict):
        _copied(len(state))
        kept = {k: v for k, v in state.items() if type(k) is str and isinstance(v, int | float | str | bool)}
        result.extra.update(kept)  # (a name that is not a string is not hashed again)
    return result


class TorchSize(tuple[int, ...]):
    """A ``torch.Size`` from a pickle: a tuple that remembers it was one, so that a writer puts
    ``torch.Size`` back (DeepSpeed's tools call ``.numel()`` on the shapes they saved)."""

    __slots__ = ()


def _size(*args: Any) -> TorchSize:
    (values,) = args if args else ((),)
    if not (isinstance(values, tuple) and len(values) <= 64 and all(type(v) is int for v in values)):
        raise pickle.UnpicklingError(f"torch.Size({brief(values)})")  # (torch pickles a tuple of ints)
    return TorchSize(values)


def _device(*args: Any) -> str:
    if len(args) > 2 or not all(type(a) is int or (type(a) is str and len(a) <= 64) for a in args):
        raise pickle.UnpicklingError(f"torch.device{brief(args)}")  # (('cuda', 0): never a container, never long)
    return ":".join(str(a) for a in args)


def _path_parts(parts: tuple[Any, ...]) -> tuple[str, ...]:
    if not all(type(p) is str for p in parts) or sum(len(p) for p in parts) > 1 << 16:
        raise pickle.UnpicklingError(f"a path made of {brief(parts)}")
    return parts


def pathlib_path(*parts: Any) -> str:
    """``pathlib.PosixPath`` and its kin, kept as the path's text (``('/', 'tmp', 'x')``: ``/tmp/x``)."""
    return posixpath.join(*_path_parts(parts)) if parts else ""


def _windows_path(*parts: Any) -> str:
    return ntpath.join(*_path_parts(parts)) if parts else ""  # (('C:\\', 'x'): C:\x, as Windows writes it)


PATHS: dict[tuple[str, str], Any] = {
    (module, f"{pure}{system}Path"): pathlib_path if system == "Posix" else _windows_path
    for module in ("pathlib", "pathlib._local")  # (Python 3.13 moved the classes to pathlib._local)
    for pure in ("", "Pure")
    for system in ("Posix", "Windows")
}
"""``pathlib`` paths as Python 3.11 to 3.12 (``pathlib``) and 3.13 on (``pathlib._local``) pickle them:
kept as their text."""


TORCH_TENSORS: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch", "Tensor"): _TensorType,
    ("torch.nn.parameter", "Parameter"): _TensorType,
    ("torch", "Size"): _size,
    ("torch", "device"): _device,
    ("torch", "UntypedStorage"): StorageType(None),
    ("torch.storage", "UntypedStorage"): StorageType(None),
    **{("torch", cls): StorageType(dt.name) for cls, dt in BY_STORAGE_CLASS.items()},
    **{("torch", name): TorchDType(dt.name) for name, dt in BY_NAME.items()},
}
"""Globals that ``torch.save`` writes for plain tensors and parameters (``data.pkl``)."""


def storage_persistent_load(pid: Any) -> StorageRef:
    """``persistent_load`` for torch.save archives: ``('storage', type, key, location, numel)``."""
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
        raise pickle.UnpicklingError(f"unexpected persistent id {brief(pid)}")
    _, storage_type, key, location, numel = pid
    if not isinstance(storage_type, StorageType) or not isinstance(numel, int) or numel < 0:
        raise pickle.UnpicklingError(f"malformed storage reference {brief(pid)}")
    if not isinstance(key, str) or not key or "/" in key or key in (".", ".."):
        raise pickle.UnpicklingError(f"malformed storage key {brief(key, 40)}")
    if not isinstance(location, str):
        raise pickle.UnpicklingError(f"malformed storage location {brief(location, 40)}")
    return StorageRef(key=key, dtype=storage_type.dtype, numel=numel, location=str(location))


# -- stand-ins for classes that training frameworks pickle -----------------------------------------


class Record:
    """An instance of an allowlisted class from a pickle: its attributes, no behaviour."""

    _qualname = "record"

    def __setstate__(self, state: Any) -> None:
        if type(state) is dict and not self.__dict__:
            # adopted, not copied: the unpickler's memo keeps ``state`` alive until the load ends,
            # so a copy would hold every record's attributes twice (DCP metadata: 2x at 400 000 chunks)
            self.__dict__ = state
        elif isinstance(state, tuple) and len(state) == 2:  # (dict, slots) from __reduce_ex__
            for part in state:
                if isinstance(part, dict):
                    self.__dict__.update(_dict_again(part))
        elif isinstance(state, dict):
            self.__dict__.update(_dict_again(state))
        else:
            self.__dict__["_state"] = state

    def __repr__(self) -> str:
        return f"{self._qualname}({', '.join(f'{k}={brief(v, 40)}' for k, v in self.__dict__.items())})"


class Fields:
    """An instance of an allowlisted class whose attributes are known: kept in slots, the rest of
    its pickled state dropped. For the records a checkpoint holds one of per chunk (DCP's storage
    index): a slotted object is a third of a record with a ``__dict__``, and the pickled state
    dict, which the unpickler's memo keeps until the load ends, is emptied once read. A field the
    pickle did not set is absent (reading it raises AttributeError, as for a record)."""

    __slots__: tuple[str, ...] = ()

    def __setstate__(self, state: Any) -> None:
        parts = state if isinstance(state, tuple) and len(state) == 2 else (state,)  # (dict, slots) form
        for part in parts:
            if part is None:
                continue
            if not isinstance(part, dict):
                raise pickle.UnpicklingError(f"{type(self).__name__} state of type {type(part).__name__}")
            kept = 0
            for name in self.__slots__:
                if name in part:
                    object.__setattr__(self, name, part[name])
                    kept += 1
            if kept < len(part):  # fields it does not keep: each must still be named by a string
                for k in part:
                    if type(k) is not str:  # (a damaged memo reference; torch fails on it too)
                        what = f"{type(self).__name__} state with a {type(k).__name__} as a field name"
                        raise pickle.UnpicklingError(what)
            part.clear()

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={brief(getattr(self, k), 40)}" for k in self.__slots__ if hasattr(self, k))
        return f"{type(self).__name__}({fields})"


def record(qualname: str) -> type[Record]:
    """A :class:`Record` subclass standing in for the class ``qualname``."""
    return type(qualname.rsplit(".", 1)[-1], (Record,), {"_qualname": qualname})


@dataclass(frozen=True, slots=True)
class EnumValue:
    """A member of an allowlisted enum, kept as the enum's name and the member's value."""

    enum: str
    value: Any

    __reduce__ = _by_fields  # (copied and pickled with its fields; a BUILD on one is refused)
    __setstate__ = _refuse_state

    def __str__(self) -> str:
        return f"{self.enum.rsplit('.', 1)[-1]}({brief(self.value, 40)})"


def enum(qualname: str) -> Callable[..., EnumValue]:
    """A stand-in for calling the enum class ``qualname`` with a value (how enums unpickle)."""

    def make(value: Any = None, *_: Any) -> EnumValue:
        if not isinstance(value, int | str | float | bool | None):
            raise pickle.UnpicklingError(f"{qualname} member with a {type(value).__name__} value")
        return EnumValue(qualname, value)

    return make


class OpaqueBytes:
    """``io.BytesIO`` from a pickle (e.g. old TransformerEngine extra state): its bytes are kept,
    never parsed."""

    def __init__(self, *args: Any) -> None:
        self.data = bytes(args[0]) if args and isinstance(args[0], bytes | bytearray) else b""

    def __setstate__(self, state: Any) -> None:
        # BytesIO.__getstate__ is (value, position, __dict__)
        if isinstance(state, tuple) and state and isinstance(state[0], bytes | bytearray):
            self.data = bytes(state[0])

    def __repr__(self) -> str:
        return f"BytesIO({len(self.data)} bytes)"


_NUMPY_KINDS = set("biufc?")  # bool, ints, unsigned, floats, complex; never objects or structured


class _RefusedValue(pickle.UnpicklingError):
    """An allowed global called with a value that would make it unsafe (numpy's ``dtype('O')``:
    an object array, whose elements are arbitrary pickled objects); :func:`loads` reports it as an
    unsafe pickle naming ``name``."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class NumpyDType:
    """``numpy.dtype(code, align, copy)`` as a pickle makes it, for a plain numeric ``code``; the BUILD
    numpy writes after it sets its byte order (``>i4`` is pickled as ``dtype('i4', False, True)`` and the
    state ``(3, '>', None, None, None, -1, -1, 0)``). A stand-in, not numpy's object: numpy's own
    ``__setstate__`` takes field lists, sizes and flags, and ignores the state on its shared ``dtype('i4')``,
    which read a big-endian array's bytes as little-endian. The arrays, scalars and buffers made from one
    hold the real dtype (:attr:`dtype`, which also makes numpy take it as one); pickled again it is
    numpy's."""

    __slots__ = ("_dtype", "_ordered")

    def __init__(self, dtype: Any) -> None:
        self._dtype = dtype
        self._ordered = False

    @property
    def dtype(self) -> Any:
        return self._dtype

    def __eq__(self, other: object) -> bool:
        import numpy as np

        other = other._dtype if isinstance(other, NumpyDType) else other
        if not isinstance(other, np.dtype):  # (never numpy's conversion of an arbitrary value)
            return NotImplemented
        return bool(self._dtype == other)

    def __hash__(self) -> int:
        return hash(self._dtype)

    def __setstate__(self, state: Any) -> None:
        plain = (None, None, None)  # (no subarray, names or fields: what numpy writes for a numeric dtype)
        if not (
            not self._ordered
            and type(state) is tuple
            and (len(state), state[0]) in ((8, 3), (9, 4))
            and state[1] in ("<", ">", "=", "|")
            and state[2:5] == plain
            and all(type(n) is int and n in (-1, self._dtype.itemsize) for n in state[5:7])
            and type(state[7]) is int
            and state[7] == 0
            and (len(state) == 8 or state[8] is None)
        ):
            raise pickle.UnpicklingError(f"numpy dtype state {brief(state, 80)} (not a plain numeric dtype's)")
        import numpy as np

        self._dtype = np.dtype(self._dtype.newbyteorder(state[1]).str)  # (the native order as numpy's '=')
        self._ordered = True

    def __reduce__(self) -> Any:
        return self._dtype.__reduce__()

    def __repr__(self) -> str:
        return repr(self._dtype)

    def __str__(self) -> str:
        return str(self._dtype)


def _np_dtype(code: Any, *_: Any) -> NumpyDType:
    import numpy as np

    try:
        dt = np.dtype(code) if isinstance(code, str) else None
    except TypeError:
        dt = None
    if dt is None or dt.kind not in _NUMPY_KINDS or dt.fields is not None:
        raise _RefusedValue(f"numpy.dtype({brief(code, 40)}) (not a plain numeric dtype)")
    return NumpyDType(dt)


class _NdarrayClass:
    """``numpy.ndarray`` as a pickle names it: accepted only as the class numpy's ``_reconstruct``
    is given. The class itself, called (``ndarray((64,), 'u1')``), made an array of uninitialised
    memory: the process's own bytes written into convert's output, and two reads of one file that
    differed."""

    def __init__(self, *_: Any) -> None:
        raise _RefusedValue("numpy.ndarray(...) (an array of uninitialised memory)")

    __setstate__ = _refuse_state


def _np_shape(shape: Any, what: str) -> int:
    """The element count of a pickled array's ``shape``, which must be a tuple of at most 64 sizes."""
    if not (
        isinstance(shape, tuple)
        and len(shape) <= 64
        and all(type(n) is int and 0 <= n <= MAX_DIM for n in shape)
        and math.prod(max(n, 1) for n in shape) <= MAX_DIM  # (numpy refuses to copy an empty (0, 2**48, 2**48))
    ):
        raise pickle.UnpicklingError(f"{what} of shape {brief(shape, 40)}")
    return math.prod(shape)


def _np_reconstruct(cls: Any, shape: Any, typecode: Any) -> Any:
    import numpy as np

    if cls is not _NdarrayClass:
        raise pickle.UnpicklingError("numpy _reconstruct of a class other than ndarray")
    code = typecode.decode("latin-1") if isinstance(typecode, bytes) else typecode
    dt = _np_dtype(code).dtype  # (an object dtype refused here too)
    count = _np_shape(shape, "numpy _reconstruct")
    if count * dt.itemsize > 1 << 20:  # (numpy pickles (0,): the values come with the state)
        raise pickle.UnpicklingError(f"numpy _reconstruct of {count:,} elements")
    _copied(count * dt.itemsize >> 3)  # (made again and again through the memo: see _copied)
    return np.zeros(shape, dt).view(_pickled_array())  # (zeros, not uninitialised memory, if no state follows)


def _np_values(what: str, data: Any, dtype: Any, count: int) -> Any:
    """The real dtype of a pickled array or scalar, once its bytes are checked to hold ``count`` values."""
    if type(dtype) is not NumpyDType:
        raise pickle.UnpicklingError(f"{what} of dtype {brief(dtype, 40)} (not a plain numeric dtype)")
    dt = dtype.dtype
    if type(data) not in (bytes, bytearray) or len(data) != count * dt.itemsize:
        size = count * dt.itemsize
        raise pickle.UnpicklingError(f"{what}: {brief(data, 40)} is not the {size:,} bytes of {count:,} {dt}")
    return dt


def _np_scalar(dtype: Any, data: Any = None) -> Any:
    """``numpy._core.multiarray.scalar(dtype, bytes)``: a numpy number (``np.int64(5)`` in a cursor)."""
    import numpy as np

    value = np.frombuffer(data, _np_values("numpy scalar", data, dtype, 1))[0]
    return _counted_complex(value) if value.dtype.kind == "c" else value  # (complex: see _complex)


def _np_frombuffer(buf: Any, dtype: Any, shape: Any, order: Any, axis_order: Any = None) -> Any:
    """``numpy._core.numeric._frombuffer``: an array pickled with protocol 5, its bytes in band."""
    import numpy as np

    dt = _np_values("numpy array", buf, dtype, _np_shape(shape, "numpy array"))
    axes = isinstance(axis_order, tuple) and all(type(a) is int for a in axis_order)
    if order == "K" and axes and sorted(axis_order) == list(range(len(shape))):
        array = np.frombuffer(buf, dt).reshape(shape, order="C").transpose(axis_order)
    elif order in ("C", "F") and axis_order is None:
        array = np.frombuffer(buf, dt).reshape(shape, order=order)
    else:
        raise pickle.UnpicklingError(f"numpy array in order {brief(order, 20)} {brief(axis_order, 40)}")
    return array.view(_pickled_array())


_ARRAY_CLASS: list[type] = []


def _pickled_array() -> type:
    """The class of the numpy arrays a pickle makes (made on first use: numpy is imported only then).
    Item assignment is refused: a SETITEM on one has numpy convert the value, and a tuple shared
    through the memo at every level (see :func:`_walk`) takes that longer than the age of the
    universe, in C. No library pickles one. Its state (numpy's BUILD) must be a plain numeric dtype's
    bytes, of the right length. Pickled again, it is a plain ``numpy.ndarray``."""
    if not _ARRAY_CLASS:
        import numpy as np

        class ndarray(np.ndarray):  # (named as numpy's: summaries and messages print the type's name)
            def __setitem__(self, key: Any, value: Any) -> None:
                raise pickle.UnpicklingError("item assignment on a numpy array from a pickle: no library writes that")

            def __setstate__(self, state: Any) -> None:
                if type(state) is not tuple or len(state) not in (4, 5) or (len(state) == 5 and state[0] != 1):
                    raise pickle.UnpicklingError(f"numpy array state {brief(state, 80)}")
                shape, dtype, fortran, raw = state[-4:]
                dt = _np_values("numpy array", raw, dtype, _np_shape(shape, "numpy array"))
                if type(fortran) is not bool:
                    raise pickle.UnpicklingError(f"numpy array state with order {brief(fortran, 40)}")
                _copied(len(raw) >> 3)  # (numpy copies the bytes to swap them: one state given to many arrays)
                np.ndarray.__setstate__(self, (1, shape, dt, fortran, raw))  # type: ignore[arg-type]

            def __reduce__(self) -> Any:
                return self.view(np.ndarray).__reduce__()

        _ARRAY_CLASS.append(ndarray)
    return _ARRAY_CLASS[0]


def _numpy() -> dict[tuple[str, str], Any]:
    import numpy as np

    table: dict[tuple[str, str], Any] = {("numpy", "ndarray"): _NdarrayClass, ("numpy", "dtype"): _np_dtype}
    for core in ("numpy.core", "numpy._core"):  # (numpy 1 and numpy 2)
        table[(f"{core}.multiarray", "_reconstruct")] = _np_reconstruct
        table[(f"{core}.multiarray", "scalar")] = _np_scalar
        table[(f"{core}.numeric", "_frombuffer")] = _np_frombuffer
    for name in (
        "Bool",
        "Int8",
        "Int16",
        "Int32",
        "Int64",
        "UInt8",
        "UInt16",
        "UInt32",
        "UInt64",
        "Float16",
        "Float32",
        "Float64",
    ):
        cls = getattr(getattr(np, "dtypes", None), f"{name}DType", None)
        if cls is not None:
            table[("numpy.dtypes", f"{name}DType")] = cls
    return table


def numpy_arrays() -> dict[tuple[str, str], Any]:
    """Globals numpy pickles plain numeric arrays with (``np.random.get_state()``, ...)."""
    return _numpy()


BYTES_IO: dict[tuple[str, str], Any] = {("io", "BytesIO"): OpaqueBytes, ("_io", "BytesIO"): OpaqueBytes}
"""``io.BytesIO``, a state-dict value DCP and torch.save keep as it is: its bytes kept, nothing run."""

NAMESPACES: dict[tuple[str, str], Any] = {
    ("argparse", "Namespace"): record("argparse.Namespace"),
    ("types", "SimpleNamespace"): record("types.SimpleNamespace"),
    **PATHS,
    **BYTES_IO,
}
"""Configuration containers (``argparse.Namespace`` of Megatron ``args``) and opaque byte blobs."""


# -- the reader ----------------------------------------------------------------------------------


class _Unpickler(pickle.Unpickler):
    def __init__(
        self,
        data: bytes,
        allow: Allowlist,
        source: str,
        what: str,
        persistent_load: Callable[[Any], Any] | None,
    ) -> None:
        super().__init__(io.BytesIO(data))
        self._allow = allow
        self._source = source
        self._what = what
        self._persistent = persistent_load

    def find_class(self, module: str, name: str) -> Any:
        try:
            found = self._allow[(module, name)]
        except KeyError:
            raise UnsafePickleError(self._source, f"{module}.{name}", what=self._what) from None
        if type(found) is types.FunctionType and "__setstate__" not in found.__dict__:
            found.__setstate__ = _refuse_state  # type: ignore[attr-defined]  # (see _refuse_state)
        return found

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise pickle.UnpicklingError("persistent id in a pickle that may not have one")
        return self._persistent(pid)


def loads(
    data: bytes,
    *,
    allow: Allowlist,
    source: str,
    what: str = "pickle",
    persistent_load: Callable[[Any], Any] | None = None,
) -> Any:
    """Unpickle ``data`` resolving globals only through ``allow``.

    ``source`` names the file (and item) in error messages. Raises UnsafePickleError for a global
    outside the allowlist and CorruptFileError for anything else that goes wrong.
    """
    problem, spent = _walk(data)
    if problem:
        raise CorruptFileError(f"{source}: {what} {problem}", hint="the file is damaged or hostile", path=source)
    budget = _BUDGET.set(_fresh_budget(MAX_HASHED - spent, MAX_COPIED + 4 * len(data)))  # (for _hashed, _copied)
    try:
        obj = _on_a_deep_stack(len(data), _Unpickler(data, allow, source, what, persistent_load).load)
    except (UnsafePickleError, _RefusedValue) as exc:
        refused = exc if isinstance(exc, UnsafePickleError) else UnsafePickleError(source, exc.name, what=what)
        refused.hostile = hostile([refused.global_name, *nested_globals(data)])  # (the bytes are in hand)
        raise refused from None
    except RecursionError:
        raise CorruptFileError(
            f"{source}: {what} is nested too deeply to read", hint="the file is damaged or hostile", path=source
        ) from None
    except Exception as exc:  # pickle raises many types on damaged input
        raise CorruptFileError(
            f"{source}: {what} could not be read ({type(exc).__name__}: {exc})",
            hint="the file is damaged or was not written by the library the format expects",
            path=source,
        ) from None
    finally:
        _BUDGET.reset(budget)
    problem = _shape_problem(obj)
    if problem:
        raise CorruptFileError(f"{source}: {what} {problem}", hint="the file is damaged or hostile", path=source)
    return obj


_INLINE = 32 << 10
"""pickles of at most this many bytes are read on the caller's own stack (see :func:`_on_a_deep_stack`)"""
_DEEP_STACK = 1 << 30
"""the stack of each deep reader: address space, committed only as far as it is used (a level of
nested tuples costs 50-80 bytes of it to hash: about 13 million levels fit, and MAX_HASHED keeps a
hashed key to 10 million)"""
_DEEP_READERS = 4
_STACK_LOCK = threading.Lock()
_deep: dict[str, Any] = {"queue": None, "pid": None}


def _on_a_deep_stack(size: int, load: Callable[[], Any]) -> Any:
    """``load()`` (the unpickling of ``size`` bytes) where its C stack cannot run out. A pickle can
    nest tuples a level a byte, and the unpickler hashes each dict key and set member as it reads
    it, recursing through every level in C with no depth check: 150 KB nesting 150 000 levels
    crashed the process on its 8 MB stack (a segmentation fault, no message, no report), before
    the depth check that follows the load could refuse it. A pickle larger than ``_INLINE`` is read
    by one of ``_DEEP_READERS`` threads with a stack of ``_DEEP_STACK``, started once (the stack
    size is one setting for the whole process, changed only while they start: a thread another part
    of the process started meanwhile would get one as large). Where they cannot be had (an address
    space limit), it is read here as before."""
    if size <= _INLINE:
        return load()
    readers = _deep_readers()
    if readers is None:
        return load()
    done: Future[Any] = Future()
    readers.put((contextvars.copy_context(), load, done))  # (the caller's context: a thread starts with none)
    return done.result()


def _deep_readers() -> queue.SimpleQueue[Any] | None:
    """The deep readers' queue, their threads started on first use (again in a forked child, which
    has none of its parent's threads); None where no thread with such a stack can be started."""
    with _STACK_LOCK:
        if _deep["pid"] != os.getpid():
            _deep["pid"], _deep["queue"] = os.getpid(), None
            tasks: queue.SimpleQueue[Any] = queue.SimpleQueue()
            before = threading.stack_size()
            started = 0
            try:
                threading.stack_size(_DEEP_STACK)
                for k in range(_DEEP_READERS):
                    name = f"ckpttool-unpickle-{k}"
                    threading.Thread(target=_deep_reader, args=(tasks,), name=name, daemon=True).start()
                    started += 1
            except (RuntimeError, ValueError, MemoryError, OverflowError):
                pass
            finally:
                threading.stack_size(before)
            _deep["queue"] = tasks if started else None
        queue_: queue.SimpleQueue[Any] | None = _deep["queue"]
        return queue_


def _deep_reader(tasks: queue.SimpleQueue[Any]) -> None:
    while True:
        context, load, done = tasks.get()
        try:
            done.set_result(context.run(load))
        except BaseException as exc:  # (raised again in the caller)
            done.set_exception(exc)
        # (let go before waiting for the next: ``load`` is the unpickler's bound method, whose memo
        # holds every object it made, which stayed alive while the caller went on: 45% more memory
        # at the peak of describing a DCP checkpoint of 20 000 chunks)
        del context, load, done


MAX_WALK_STEPS = 8_000_000
"""Most strings, bytes and explicit memo stores a pickle may hold (a 75 MB DCP ``.metadata`` of
400 000 chunks has 610 000): past it the pickle is refused rather than walked for minutes."""
MAX_HASHED = 10_000_000
"""Most tuple members the unpickler may hash over a whole pickle, beyond one per dict key and set
member (checkpoints' keys are strings, ints and short tuples: a DCP ``.metadata`` of 400 000 chunks
hashes about 400 000). Hashing recurses in C, a level of the reader's stack per nested tuple, so
this also bounds how deep a hashed key can nest: ten million levels fit in ``_DEEP_STACK``."""
_BOMB = "stores a value at a memo index far beyond its own length (the reader would allocate gigabytes for it)"
_HASH_BOMB = (
    f"makes dict keys or set members that would take more than {MAX_HASHED:,} steps to hash (tuples or large "
    "numbers repeated through its memo): reading it would not finish"
)
_CAP = 1 << 40  # (a hashing cost past any budget: keeps the walk's sums small integers)
_NEW_RECORD = b"\x81\x94}\x94("  # (after EMPTY_TUPLE: NEWOBJ MEMOIZE EMPTY_DICT MEMOIZE MARK)
_SIZE_CALL = b"\x94\x85\x94R\x94"  # (after TUPLE2: MEMOIZE TUPLE1 MEMOIZE REDUCE MEMOIZE)


def _opcode_problem(data: bytes) -> str | None:
    """What makes a pickle unsafe to hand to the unpickler, found from its opcodes alone, or None
    (see :func:`_walk`)."""
    return _walk(data)[0]


def _walk(data: bytes) -> tuple[str | None, int]:
    """What makes a pickle unsafe to hand to the unpickler, found from its opcodes alone, or None;
    and how many tuple members beyond one per key the unpickler's hashing visits (what was charged).

    The C unpickler trusts its input in ways that hang or exhaust the process before any check
    on the result can run:

    * a memo index larger than the pickle (it grows its memo table to the index it is given, so
      ten bytes can make it allocate gigabytes; a real pickle numbers its memo entries from 0);
    * a string or bytes longer than what is left (it allocates the length it is told first);
    * dict keys or set members whose hashing takes longer than the age of the universe. CPython
      does not cache a tuple's hash: ``t(k+1) = (t(k), t(k))``, built through the memo, is 700
      bytes for 100 levels and 2**100 tuples to hash, in C, holding the GIL, so neither Ctrl-C nor
      a signal stops it.

    So every opcode is followed on a model of the unpickler's stack and memo in which a value is
    only the number of objects hashing it visits: 1 for anything but a tuple (a string or number
    caches its hash or is one; a list, dict or set cannot be hashed; what an allowlisted call
    returns is hashed by identity, as a record, or by its arguments, as ``torch.Size(t)`` is by
    ``t``, so it counts one more than them), one more than its members for a tuple. Each dict key
    and set member the unpickler hashes is charged to MAX_HASHED. Hashing that Python code of ours
    does (``set()``, a record's state set again) is charged where it happens (:func:`_hashed`).
    The model follows CPython's ``_pickle.c``; it checks less than the unpickler does (the MARK
    fences, the types), which only matters for a pickle the unpickler refuses anyway. Where it
    cannot go on (a missing memo entry, a truncated pickle) it refuses the pickle itself: it fails
    closed, so that no difference between the model and the unpickler lets a pickle through
    unwalked (a NUL in a text memo index, which the unpickler reads to the NUL, once did)."""
    limit = len(data)
    fixed = _FIXED_PUSH
    counted = _COUNTED
    get4 = _U4
    stack: list[int] = []
    push = stack.append
    pop = stack.pop
    marks: list[int] = []
    memo: list[int] = []
    remember = memo.append
    holes = 0  # memo slots skipped by an explicit index: MEMOIZE stores at the count of filled ones
    large: tuple[set[Any], set[int]] = (set(), set())  # ints past 2**61 and their hashes (see _colliding)
    spent = steps = i = 0
    try:
        while True:
            code = data[i]
            i += 1
            if code == 0x94:  # MEMOIZE
                if holes:
                    holes += _memo_put(memo, len(memo) - holes, stack[-1])
                else:
                    remember(stack[-1])
                continue
            if code == 0x68:  # BINGET
                push(memo[data[i]])
                i += 1
                continue
            n = fixed[code]
            if n >= 0:  # a number, None, a bool, an empty container: pushed, its argument skipped
                if code == 0x29 and data[i : i + 5] == _NEW_RECORD and not holes:
                    # (the opcodes torch's dataclasses pickle as: an instance made with no arguments, and
                    # its state dict opened; a fifth of a DCP .metadata, one step instead of six)
                    stack[-1] = 2
                    remember(2)
                    remember(1)
                    push(1)
                    marks.append(len(stack))
                    i += 5
                    continue
                push(1)
                i += n
                continue
            if code == 0x6A:  # LONG_BINGET
                push(memo[get4(data, i)[0]])
                i += 4
                continue
            if code == 0x28:  # MARK
                marks.append(len(stack))
                continue
            if code == 0x81 or code == 0x52:  # NEWOBJ, REDUCE: a call's result, from class or callable and arguments
                h = pop() + 1
                stack[-1] = h if h < _CAP else _CAP
                continue
            if code == 0x86:  # TUPLE2
                h = pop() + stack[-1] + 1
                if data[i : i + 5] == _SIZE_CALL and not holes:  # (torch.Size((a, b)): another fifth, one step)
                    pop()
                    h = h if h < _CAP else _CAP
                    remember(h)
                    remember(h + 1)
                    remember(h + 2)
                    stack[-1] = h + 2
                    i += 5
                    continue
                stack[-1] = h if h < _CAP else _CAP
                continue
            if code == 0x85:  # TUPLE1
                h = stack[-1] + 1
                stack[-1] = h if h < _CAP else _CAP
                continue
            if code == 0x62:  # BUILD: the state is set on the value below it (by Python: see Record)
                pop()
                continue
            if code == 0x75:  # SETITEMS: keys and values into the dict below the MARK
                x = marks.pop()
                cost = sum(stack[x::2]) - (len(stack) - x) // 2
                if cost:
                    spent += cost
                    if spent > MAX_HASHED:
                        return _HASH_BOMB, spent
                del stack[x:]
                if data[i] == 0x62:  # (and the BUILD that follows a record's state dict)
                    pop()
                    i += 1
                continue
            n = counted[code]
            if n:  # a string, bytes or long: its length, then that many bytes
                if n == 1:
                    length = data[i]
                    i += 1
                else:
                    width = n & 15
                    length = int.from_bytes(data[i : i + width], "little", signed=n > 15)
                    if length < 0 or i + width > limit:
                        return f"gives a length of {length:,} at byte {i - 1:,}: it is cut short or damaged", spent
                    i += width
                if i + length > limit:  # (the unpickler allocates the length it is told before reading)
                    return (
                        f"gives a string or bytes of {length:,} bytes at byte {i - 1 - (n & 15):,}, past its end "
                        f"({limit:,} bytes): it is cut short or damaged"
                    ), spent
                i += length
                if length >= 8 and (code == 0x8A or code == 0x8B):  # LONG1, LONG4 of 8 bytes or more
                    problem = _colliding(int.from_bytes(data[i - length : i], "little", signed=True), large)
                    if problem:
                        return problem, spent
                    push(1 + length // 8)  # (an int's hash is not cached: it costs its digits)
                else:
                    push(1)
                steps += 1
                if steps > MAX_WALK_STEPS:
                    return _too_many(), spent
                continue
            if code == 0x71 or code == 0x72:  # BINPUT, LONG_BINPUT
                if code == 0x71:
                    index = data[i]
                    i += 1
                else:
                    if i + 4 > limit:
                        return f"ends at byte {limit:,} before its STOP opcode: it is cut short or damaged", spent
                    index = get4(data, i)[0]
                    i += 4
                    if index > limit:
                        return _BOMB, spent
                if index == len(memo) and not holes:
                    remember(stack[-1])
                else:
                    holes += _memo_put(memo, index, stack[-1])
                steps += 1
                if steps > MAX_WALK_STEPS:
                    return _too_many(), spent
                continue
            if code == 0x74 or code == 0x91:  # TUPLE; FROZENSET (members hashed, its own hash cached)
                x = marks.pop()
                h = sum(stack[x:]) + 1
                if code == 0x91:
                    spent += h - 1 - (len(stack) - x)
                    if spent > MAX_HASHED:
                        return _HASH_BOMB, spent
                    h = 1
                del stack[x:]
                push(h if h < _CAP else _CAP)
                continue
            if code == 0x65:  # APPENDS: into the list below the MARK (lists are not hashed)
                del stack[marks.pop() :]
                continue
            if code == 0x61 or code == 0x30:  # APPEND; POP: the top value, or the MARK on top
                if code == 0x30 and marks and marks[-1] == len(stack):
                    marks.pop()
                else:
                    pop()
                continue
            if code == 0x73:  # SETITEM
                cost = stack[-2] - 1
                del stack[-2:]
                if cost:
                    spent += cost
                    if spent > MAX_HASHED:
                        return _HASH_BOMB, spent
                continue
            if code == 0x87:  # TUPLE3
                h = pop() + pop() + stack[-1] + 1
                stack[-1] = h if h < _CAP else _CAP
                continue
            if code == 0x51:  # BINPERSID: the persistent id replaced by what it names
                h = stack[-1] + 1
                stack[-1] = h if h < _CAP else _CAP
                continue
            if code == 0x93:  # STACK_GLOBAL
                del stack[-2:]
                push(1)
                continue
            if code == 0x95:  # FRAME: framing only, the opcodes inside follow
                i += 8
                continue
            if code == 0x80:  # PROTO
                i += 1
                continue
            if code == 0x2E:  # STOP
                return None, spent
            if code == 0x67 or code == 0x70:  # GET, PUT: the index as a line of text
                j = data.index(b"\n", i)
                index = _text_int(data[i:j])
                i = j + 1
                if code == 0x67:
                    push(memo[index])
                    continue
                if index > limit:
                    return _BOMB, spent
                if index < 0:
                    return f"stores at memo index {index} at byte {i:,}: it is damaged", spent
                holes += _memo_put(memo, index, stack[-1])
                steps += 1
                if steps > MAX_WALK_STEPS:
                    return _too_many(), spent
                continue
            if code in (0x6C, 0x64, 0x90, 0x6F, 0x69, 0x31):  # LIST, DICT, ADDITEMS, OBJ, INST, POP_MARK
                x = marks.pop()
                if code == 0x64 or code == 0x90:  # DICT's keys, ADDITEMS' members: hashed
                    items = stack[x::2] if code == 0x64 else stack[x:]
                    spent += sum(items) - len(items)
                    if spent > MAX_HASHED:
                        return _HASH_BOMB, spent
                if code == 0x6F or code == 0x69:  # a call's result: OBJ's class is below its arguments
                    h = min(_CAP, sum(stack[x + 1 if code == 0x6F else x :]) + 2)
                    if code == 0x69:  # (INST's class is named by two lines)
                        i = data.index(b"\n", data.index(b"\n", i) + 1) + 1
                del stack[x:]
                if code == 0x6C or code == 0x64:  # a list or dict: hashing one fails at once
                    push(1)
                elif code == 0x6F or code == 0x69:
                    push(h)
                continue
            if code == 0x63:  # GLOBAL: module and name on two lines
                i = data.index(b"\n", data.index(b"\n", i) + 1) + 1
                push(1)
            elif code in (0x82, 0x83, 0x84):  # EXT1, EXT2, EXT4: a global from copyreg's registry
                i += (1, 2, 4)[code - 0x82]
                push(1)
            elif code == 0x92:  # NEWOBJ_EX: class, arguments, keyword arguments
                h = pop() + pop() + 2
                stack[-1] = h if h < _CAP else _CAP
            elif code == 0x32:  # DUP
                push(stack[-1])
            elif code in (0x49, 0x4C):  # INT, LONG: the number as a line of text
                j = data.index(b"\n", i)
                line, i = data[i:j], j + 1
                if len(line) >= 19:  # (past 2**61 a number can share its hash with another)
                    problem = _colliding(_text_int(line.rstrip(b"L")), large)
                    if problem:
                        return problem, spent
                push(1 + len(line) // 19)
            elif code in (0x46, 0x53, 0x56, 0x50):  # FLOAT, STRING, UNICODE, PERSID: a line of text
                i = data.index(b"\n", i) + 1
                push(2 if code == 0x50 else 1)
            elif code != 0x98:  # (READONLY_BUFFER leaves its value)
                return f"holds {code:#04x} at byte {i - 1:,}, which is not a pickle opcode: it is damaged", spent
    except (IndexError, ValueError, struct.error):
        # where the unpickler stops too (a GET of an entry never stored, more taken from the stack than
        # was put on it, an argument cut short): said here, so that no difference between the model
        # and the unpickler can let a pickle through unwalked
        if i >= limit or (data[i - 1] in _LINE_OPS and data.find(b"\n", i) < 0):
            return f"ends at byte {limit:,} before its STOP opcode: it is cut short or damaged", spent
        return f"does not follow the pickle format near byte {i:,} (opcode {data[i - 1]:#04x}): it is damaged", spent


_LINE_OPS = b"FILSVPcigp"  # (the opcodes whose arguments are lines of text)
_MAX_COLLIDING = 1000
"""Most distinct numbers of a kind a pickle may hold that share a hash with another (none in a checkpoint)."""


def _colliding(value: Any, seen: tuple[set[Any], set[int]], what: str = "integers") -> str | None:
    """Note a number that can share its hash with others (``seen``: the distinct ones so far, their
    hashes): an int past 2**61 (``n`` and ``n + 2**61 - 1`` share one: a dict of 100 000 of them in
    1.3 MB took the unpickler 67 s of comparisons, ``k**2 / 2`` in C holding the GIL) or a complex
    number (see :func:`_complex`). Returns why the pickle is refused."""
    values, hashes = seen
    values.add(value)
    hashes.add(hash(value))
    if len(values) - len(hashes) > _MAX_COLLIDING:  # (each distinct value beyond one per hash collides)
        return (
            f"holds more than {_MAX_COLLIDING:,} distinct {what} that share a hash with another (a dict of "
            "them would take the unpickler time quadratic in their number): it is not read"
        )
    return None


def _text_int(text: bytes) -> int:
    """A number written as text, as the C unpickler reads it: to the first NUL (it parses a C string),
    spaces, a sign and underscores allowed."""
    return int(text.split(b"\0", 1)[0])


def _too_many() -> str:
    return (
        f"holds more than {MAX_WALK_STEPS:,} strings, bytes and memo stores (checkpoint pickles hold far fewer); "
        "it is not read"
    )


def _memo_put(memo: list[Any], index: int, value: Any) -> int:
    """Store ``value`` at ``index`` of the walk's memo; returns how many empty slots that made
    (negative: filled). Empty slots are 0, a cost no value has."""
    have = len(memo)
    if index < have:
        empty = memo[index] == 0
        memo[index] = value
        return -1 if empty else 0
    memo.extend([0] * (index - have))
    memo.append(value)
    return index - have


def _tables() -> tuple[list[int], list[int]]:
    """Per opcode byte: the size of the argument of an opcode that pushes one plain value (a
    number, None, a bool, an empty container; -1 for any other), and the width of the length
    before a string's, bytes' or long's bytes (0 for any other; plus 16 where the length is signed)."""
    import pickletools

    fixed, counted = [-1] * 256, [0] * 256
    plain = {"BININT", "BININT1", "BININT2", "BINFLOAT", "NONE", "NEWTRUE", "NEWFALSE", "NEXT_BUFFER"}
    plain |= {"EMPTY_TUPLE", "EMPTY_DICT", "EMPTY_LIST", "EMPTY_SET"}
    widths = {
        pickletools.TAKEN_FROM_ARGUMENT1: 1,
        pickletools.TAKEN_FROM_ARGUMENT4: 4 | 16,
        pickletools.TAKEN_FROM_ARGUMENT4U: 4,
        pickletools.TAKEN_FROM_ARGUMENT8U: 8,
    }
    for op in pickletools.opcodes:
        code = ord(op.code)
        if op.name in plain:
            fixed[code] = op.arg.n if op.arg is not None else 0
        elif op.arg is not None and op.arg.n in widths:
            counted[code] = widths[op.arg.n]
    return fixed, counted


_FIXED_PUSH, _COUNTED = _tables()
_U4 = struct.Struct("<I").unpack_from


MAX_DEPTH = 200
"""Deepest nesting of containers accepted from a pickle (real checkpoints nest a dozen levels;
ckpttool's walkers recurse)."""
MAX_NODES = 20_000_000
"""Most values a pickle may expand to when shared containers are counted at every place they
appear (a pickle can reference one list twice from each of 64 levels: 2**64 values to walk)."""


_CONTAINERS = (dict, list, tuple, set, frozenset, Record, Fields)


def _children(obj: Any) -> list[Any]:
    if isinstance(obj, dict):
        out = [*obj.keys(), *obj.values()]
        if isinstance(obj, OrderedDictStandIn) and obj.__dict__:
            out.extend(obj.__dict__.values())
        return out
    if isinstance(obj, Record):
        return list(obj.__dict__.values())
    if isinstance(obj, Fields):
        return [getattr(obj, name) for name in obj.__slots__ if hasattr(obj, name)]
    return list(obj)


class _Unwalkable(Exception):
    pass


def _shape_problem(root: Any) -> str | None:
    """Why an unpickled tree cannot be walked safely (a cycle, too deep, too many values when
    shared parts are expanded), or None. A shared container is walked once and its count reused
    wherever it appears again; only shared ones are remembered (a table of every container took
    more memory than the tree itself at 400 000 DCP chunks). The recursion is bounded by MAX_DEPTH."""
    if not isinstance(root, _CONTAINERS):
        return None
    try:
        _measure(root, 0, set(), {}, [MAX_NODES - 1])  # the root is one value
    except _Unwalkable as exc:
        return str(exc)
    return None


def _loop_refs() -> int:
    """The reference count a value has inside :func:`_measure`'s loop when only that loop's list
    holds it (measured, not assumed: it depends on the interpreter)."""
    children: list[Any] = [[]]
    for value in children:
        return sys.getrefcount(value)
    raise AssertionError


_UNSHARED = _loop_refs() + 1
"""References to a container in :func:`_measure`'s loop that its one parent explains; more mean
it is shared (another container, or this one twice, holds it too)."""


def _measure(obj: Any, depth: int, active: set[int], shared: dict[int, int], budget: list[int]) -> int:
    """The number of values under ``obj`` (shared containers counted wherever they appear), each
    charged to ``budget`` as it is first counted."""
    key = id(obj)
    if key in active:
        raise _Unwalkable("contains a container that holds itself (a cycle)")
    if depth >= MAX_DEPTH:
        raise _Unwalkable(f"nests containers more than {MAX_DEPTH} levels deep")
    children = _children(obj)
    total = len(children)
    budget[0] -= total
    active.add(key)
    for value in children:
        _check_budget(budget)
        if not isinstance(value, _CONTAINERS):
            continue
        if sys.getrefcount(value) <= _UNSHARED:
            total += _measure(value, depth + 1, active, shared, budget)
            continue
        known = shared.get(id(value))  # shared containers stay alive in the tree: their ids are stable
        if known is None:
            known = shared[id(value)] = _measure(value, depth + 1, active, shared, budget)
        else:
            budget[0] -= known
        total += known
    active.discard(key)
    _check_budget(budget)
    return total


def _check_budget(budget: list[int]) -> None:
    if budget[0] < 0:
        raise _Unwalkable(f"expands to more than {MAX_NODES:,} values (shared containers repeated)")


# -- pickles nested inside values ------------------------------------------------------------------

NESTED_MODULES = ("transformer_engine.common.recipe",)
"""Modules whose classes a nested pickle may name besides the plain and torch-tensor globals:
TransformerEngine pickles its FP8 recipe (dataclasses, enums, a namedtuple) into ``_extra_state``."""
_NESTED_GLOBALS = {*PLAIN, *TORCH_TENSORS, ("torch.storage", "_load_from_bytes"), ("copyreg", "_reconstructor")}
_STRING_OPS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING", "SHORT_BINSTRING"}
_BYTES_OPS = {"SHORT_BINBYTES", "BINBYTES", "BINBYTES8", "BYTEARRAY8"}


def looks_pickled(data: bytes) -> bool:
    """Whether ``data`` starts like a pickle of protocol 2 or later."""
    return len(data) >= 3 and data[0] == 0x80 and 2 <= data[1] <= 5


def _parses(data: bytes) -> bool:
    """Whether ``data`` reads as a whole pickle (every opcode valid, through STOP). Most other
    bytes fail on their first few."""
    import pickletools

    try:
        for op, _arg, pos in pickletools.genops(data):
            if op.name == "STOP":
                return pos == len(data) - 1
    except Exception:
        return False
    return False


def nested_globals(data: bytes, depth: int = 0) -> list[str]:
    """The globals a pickle names, read from its opcodes without running any of them. Byte strings
    inside it that are torch.save archives (what ``torch.storage._load_from_bytes`` loads) are
    scanned too. A global whose name is not a constant (built on the stack) is reported as
    ``<computed>``; a pickle that cannot be parsed as ``<unreadable>``."""
    return _scan(io.BytesIO(data), depth)[0]


class PickleTooLong(Exception):
    """A pickle longer than the scan reads (:func:`stream_globals`' ``limit``): not checked whole."""


def _scan(stream: Any, depth: int = 0) -> tuple[list[str], bool]:
    """The globals of the pickle at ``stream``'s position, read op by op (the stream is left after
    its STOP), and whether it parsed to its STOP: see :func:`nested_globals`."""
    import pickletools

    found: list[str] = []
    recent: list[Any] = []  # the last values pushed, for STACK_GLOBAL
    memo: dict[int, Any] = {}
    whole = False
    try:
        arg: Any
        for op, arg, _pos in pickletools.genops(stream):
            name = op.name
            if name == "GLOBAL" or name == "INST":
                module, _, attr = str(arg).partition(" ")
                found.append(f"{module}.{attr}")
            elif name == "STACK_GLOBAL":
                pair = recent[-2:]
                found.append(
                    f"{pair[0]}.{pair[1]}" if len(pair) == 2 and all(isinstance(s, str) for s in pair) else "<computed>"
                )
            elif name in _STRING_OPS:
                recent.append(str(arg))
            elif name in _BYTES_OPS:
                recent.append(None)
                blob = bytes(arg)
                if depth < 3 and blob[:4] == b"PK\x03\x04":
                    found.extend(_archive_globals(blob, depth + 1))
            elif name in ("BINPUT", "LONG_BINPUT", "PUT") and recent:
                memo[int(arg)] = recent[-1]
            elif name == "MEMOIZE" and recent:
                memo[len(memo)] = recent[-1]
            elif name in ("BINGET", "LONG_BINGET", "GET"):
                recent.append(memo.get(int(arg)))
            elif name == "STOP":
                whole = True
            elif name != "FRAME":
                recent.append(None)
            del recent[:-4]
    except PickleTooLong:
        raise
    except Exception:  # a damaged pickle: not loadable by anyone, but also not proven safe
        found.append("<unreadable>")
    return found, whole


class _Capped:
    """A binary file read through at most ``limit`` bytes: :class:`PickleTooLong` past them."""

    def __init__(self, f: Any, limit: int) -> None:
        self.f, self.left = f, limit

    def _took(self, data: bytes) -> bytes:
        self.left -= len(data)
        if self.left < 0:
            raise PickleTooLong
        return data

    def read(self, n: int = -1) -> bytes:
        return self._took(self.f.read(self.left + 1 if n is None or n < 0 else min(n, self.left + 1)))

    def readline(self) -> bytes:
        return self._took(self.f.readline(self.left + 1))

    def tell(self) -> int:
        return int(self.f.tell())


def stream_globals(f: Any, limit: int, most: int = 5) -> list[str]:
    """The globals of the pickles one after another from the start of binary file ``f``, up to
    ``most`` of them: a plain pickle file's one (of any protocol), or a pre-1.6 torch.save file's
    (magic number, protocol, system info, the object, its storage keys; raw storage bytes after
    them), each of which ``torch.load`` unpickles, running what it names as it goes. Of a pickle
    that does not parse to its end, the globals named before the damage count (they would run before
    the load fails), not ``<computed>`` or ``<unreadable>``: a file of other bytes is no pickle.
    Raises :class:`PickleTooLong` where more than ``limit`` bytes would be read."""
    capped = _Capped(f, limit)
    found: list[str] = []
    for n in range(most):
        at = f.tell()
        head = f.read(2)
        f.seek(at)
        if not head or (n and head[:1] != b"\x80"):  # (a later pickle starts with PROTO; raw bytes follow)
            break
        if head[:1] == b"\x80" and (len(head) < 2 or head[1] > pickle.HIGHEST_PROTOCOL):
            break  # (no protocol a pickler writes: other bytes)
        got, whole = _scan(capped)
        if not whole:
            found += [g for g in got if g not in ("<computed>", "<unreadable>")]
            break
        found += got
    return found


def _archive_globals(blob: bytes, depth: int) -> list[str]:
    """The globals of a torch.save archive held in bytes, read by ckpttool's own zip reader (which
    refuses compressed members, so a nested archive cannot be a decompression bomb)."""
    from ckpttool import _torchzip
    from ckpttool.errors import CkptError

    try:
        data = _torchzip.Archive(blob, display="nested archive").pickle_bytes()
    except CkptError:
        return ["<unreadable>"]
    return nested_globals(data, depth)


def nested_refusal(data: bytes) -> str | None:
    """Why bytes nested in a value (a pickle, or a torch.save archive) must not be loaded: the
    first global they name outside the allowlist for nested pickles, or None (also for bytes that
    are neither). Nothing in them is run."""
    if data[:4] == b"PK\x03\x04":  # a torch.save archive (old TransformerEngine: io.BytesIO)
        globs = _archive_globals(data, 1)
    elif looks_pickled(data) or _parses(data):  # protocols 0 and 1 have no header byte
        globs = nested_globals(data)
    else:
        return None
    for glob in globs:
        module, _, attr = glob.rpartition(".")
        if (module, attr) in _NESTED_GLOBALS or module.startswith(NESTED_MODULES):
            continue
        return glob
    return None
