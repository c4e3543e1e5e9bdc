"""A pickle reader that runs no code from the checkpoint.

Pickles can call any importable function. This reader resolves every global through an explicit
allowlist of ``(module, name) -> stand-in``: a stand-in is a harmless function or stub class of
ours (``torch.Size`` becomes ``tuple``, a DCP ``Metadata`` becomes a plain record). Anything else
raises :class:`~ckpttool.errors.UnsafePickleError` naming the global, before it is resolved, so
nothing from the file is imported or called. torch is never imported here.

Each format module builds its allowlist from :data:`PLAIN` plus its own stubs.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import io
import math
import os
import pickle
import queue
import re
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from ckpttool.dtypes import BY_NAME, BY_STORAGE_CLASS
from ckpttool.errors import CorruptFileError, UnsafePickleError

Allowlist = Mapping[tuple[str, str], Any]


def _bytes(*args: Any) -> bytes:
    # protocol-2 pickles spell b"" as bytes() and bytearrays as bytearray(bytes)
    if not args:
        return b""
    if len(args) == 1 and isinstance(args[0], bytes | bytearray):
        return bytes(args[0])
    raise pickle.UnpicklingError(f"bytes{args!r} is not a plain bytes value")


def _bytearray(*args: Any) -> bytearray:
    return bytearray(_bytes(*args))


def _codecs_encode(text: Any, encoding: str = "utf-8") -> bytes:
    # protocol-2 pickles spell bytes as _codecs.encode(str, "latin1")
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"_codecs.encode({type(text).__name__}, {encoding!r}) is not plain bytes")
    return text.encode("latin1")


class OrderedDictStandIn(dict[Any, Any]):
    """``collections.OrderedDict``: a dict that also takes the attributes a pickle may set on it
    (``module.state_dict()`` carries ``_metadata``)."""


_BUILTINS: dict[str, Any] = {
    "set": set,
    "frozenset": frozenset,
    "complex": complex,
    "slice": slice,
    "bytes": _bytes,
    "bytearray": _bytearray,
}
PLAIN: dict[tuple[str, str], Any] = {
    # protocol <= 2 pickles written by Python 3 spell builtins the Python 2 way
    **{(module, name): fn for module in ("builtins", "__builtin__") for name, fn in _BUILTINS.items()},
    ("_codecs", "encode"): _codecs_encode,
    ("collections", "OrderedDict"): OrderedDictStandIn,
}
"""Globals that plain Python values (containers, numbers, bytes) need: safe for any format."""


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
    if module in ("builtins", "__builtin__"):
        return name in _RUNS_CODE_BUILTINS
    return module.split(".")[0] in _RUNS_CODE_MODULES or f"{module}.".startswith(_RUNS_CODE_PREFIXES)


# -- torch tensors inside a torch.save archive ---------------------------------------------------


class TorchDType(str):
    """A torch dtype named in a pickle (``torch.float32``), kept as its name."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class StorageType:
    """A legacy typed-storage class (``torch.FloatStorage``) or ``torch.UntypedStorage``."""

    dtype: str | None


def _by_fields(self: Any) -> tuple[Any, ...]:
    """``__reduce__`` of a record a pickle names (storage, tensor): copied and pickled as a call
    with its fields, every one of them (a BUILD on it is refused: see ``__setstate__``)."""
    return (type(self), tuple(getattr(self, f.name) for f in dataclasses.fields(self)))


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
            raise pickle.UnpicklingError(f"tensor dtype {explicit!r:.40} is not a torch dtype")
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
            f"a tensor saved as a lazy {' and '.join(bits)} view (torch's tensor metadata {meta!r:.80}), which "
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
        and len(size) == len(stride)
        and all(isinstance(v, int) and v >= 0 for v in (*size, *stride))
        and storage_offset >= 0
        and all(v <= MAX_DIM for v in (*size, *stride, storage_offset))
        and math.prod(size) <= MAX_DIM
    ):
        raise pickle.UnpicklingError(f"malformed tensor geometry: size={size!r:.80} stride={stride!r:.80}")
    return TensorRef(storage, storage_offset, size, stride, _dtype_of(storage, dtype))


def _rebuild_parameter(data: Any, *_rest: Any) -> Any:
    if isinstance(data, TensorRef):
        data.is_parameter = True
    return data


class _TensorType:
    """``torch.Tensor`` / ``torch.nn.Parameter`` named as the ``new_type`` of a rebuild."""


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    # plain tensors with Python attributes are pickled through here; subclasses are refused by
    # the allowlist (new_type must be one of the two stand-ins above)
    if new_type is not _TensorType:
        raise pickle.UnpicklingError("tensor subclass")
    result = func(*args)
    if isinstance(result, TensorRef) and isinstance(state, dict):
        result.extra.update({k: v for k, v in state.items() if isinstance(v, int | float | str | bool)})
    return result


class TorchSize(tuple[int, ...]):
    """A ``torch.Size`` from a pickle: a tuple that remembers it was one, so that a writer puts
    ``torch.Size`` back (DeepSpeed's tools call ``.numel()`` on the shapes they saved)."""

    __slots__ = ()


def _size(*args: Any) -> TorchSize:
    (values,) = args if args else ((),)
    return TorchSize(values)


def _device(*args: Any) -> str:
    return ":".join(str(a) for a in args)


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
        raise pickle.UnpicklingError(f"unexpected persistent id {pid!r:.80}")
    _, storage_type, key, location, numel = pid
    if not isinstance(storage_type, StorageType) or not isinstance(numel, int) or numel < 0:
        raise pickle.UnpicklingError(f"malformed storage reference {pid!r:.80}")
    if not isinstance(key, str) or not key or "/" in key or key in (".", ".."):
        raise pickle.UnpicklingError(f"malformed storage key {key!r:.40}")
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
                    self.__dict__.update(part)
        elif isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.__dict__["_state"] = state

    def __repr__(self) -> str:
        return f"{self._qualname}({', '.join(f'{k}={v!r:.40}' for k, v in self.__dict__.items())})"


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
        fields = ", ".join(f"{k}={getattr(self, k)!r:.40}" for k in self.__slots__ if hasattr(self, k))
        return f"{type(self).__name__}({fields})"


def record(qualname: str) -> type[Record]:
    """A :class:`Record` subclass standing in for the class ``qualname``."""
    return type(qualname.rsplit(".", 1)[-1], (Record,), {"_qualname": qualname})


@dataclass(frozen=True, slots=True)
class EnumValue:
    """A member of an allowlisted enum, kept as the enum's name and the member's value."""

    enum: str
    value: Any

    def __str__(self) -> str:
        return f"{self.enum.rsplit('.', 1)[-1]}({self.value!r})"


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


def _np_dtype(code: Any, *_: Any) -> Any:
    import numpy as np

    try:
        dt = np.dtype(code) if isinstance(code, str) else None
    except TypeError:
        dt = None
    if dt is None or dt.kind not in _NUMPY_KINDS or dt.fields is not None:
        raise _RefusedValue(f"numpy.dtype({code!r:.40}) (not a plain numeric dtype)")
    return dt


class _NdarrayClass:
    """``numpy.ndarray`` as a pickle names it: accepted only as the class numpy's ``_reconstruct``
    is given. The class itself, called (``ndarray((64,), 'u1')``), made an array of uninitialised
    memory: the process's own bytes written into convert's output, and two reads of one file that
    differed."""

    def __init__(self, *_: Any) -> None:
        raise _RefusedValue("numpy.ndarray(...) (an array of uninitialised memory)")


def _np_reconstruct(cls: Any, shape: Any, typecode: Any) -> Any:
    import numpy as np

    if cls is not _NdarrayClass:
        raise pickle.UnpicklingError("numpy _reconstruct of a class other than ndarray")
    code = typecode.decode("latin-1") if isinstance(typecode, bytes) else typecode
    dt = _np_dtype(code)  # (an object dtype refused here too)
    if not (isinstance(shape, tuple) and all(type(n) is int and 0 <= n <= MAX_DIM for n in shape)):
        raise pickle.UnpicklingError(f"numpy _reconstruct of shape {shape!r:.40}")
    if math.prod(shape) * dt.itemsize > 1 << 20:  # (numpy pickles (0,): the values come with the state)
        raise pickle.UnpicklingError(f"numpy _reconstruct of {math.prod(shape):,} elements")
    return np.zeros(shape, dt)  # (zeros, not uninitialised memory, if no state follows)


def _numpy() -> dict[tuple[str, str], Any]:
    import numpy as np

    table: dict[tuple[str, str], Any] = {("numpy", "ndarray"): _NdarrayClass, ("numpy", "dtype"): _np_dtype}
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        table[(module, "_reconstruct")] = _np_reconstruct
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
    ("pathlib", "PosixPath"): lambda *parts: "/".join(str(p) for p in parts),
    ("pathlib", "WindowsPath"): lambda *parts: "/".join(str(p) for p in parts),
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
            return self._allow[(module, name)]
        except KeyError:
            raise UnsafePickleError(self._source, f"{module}.{name}", what=self._what) from None

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
    problem = _memo_bomb(data)
    if problem:
        raise CorruptFileError(f"{source}: {what} {problem}", hint="the file is damaged or hostile", path=source)
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
    problem = _shape_problem(obj)
    if problem:
        raise CorruptFileError(f"{source}: {what} {problem}", hint="the file is damaged or hostile", path=source)
    return obj


_INLINE = 32 << 10
"""pickles of at most this many bytes are read on the caller's own stack (see :func:`_on_a_deep_stack`)"""
_DEEP_STACK = 1 << 30
"""the stack of each deep reader: address space, committed only as far as it is used (a level of
nested tuples costs 50-80 bytes of it to hash: about 13 million levels fit)"""
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
"""Most strings, bytes and explicit memo stores the opcode walk steps through one at a time (a 75 MB
DCP ``.metadata`` of 400 000 chunks has 610 000; eight million take about five seconds)."""
_BOMB = "stores a value at a memo index far beyond its own length (the reader would allocate gigabytes for it)"


def _memo_bomb(data: bytes) -> str | None:
    """Whether a pickle stores into a memo index larger than the pickle itself. Python's unpickler
    grows its memo table to the index it is given, so ten bytes can make it allocate gigabytes;
    a real pickle numbers its memo entries from 0, one per stored object.

    The opcodes are walked up to STOP, skipping strings and bytes by their lengths, and every PUT's
    index is looked at (a byte search for candidates does not help: torch's pickles spell ``torch``
    and ``storage``, an ``r`` and four bytes that read as a huge index). Runs of opcodes whose
    arguments have a fixed size (most of any pickle: MEMOIZE, BINGET, BININT1, MARK, TUPLE2...) are
    skipped by one regular-expression match, so Python steps only through strings, bytes and
    4-byte PUTs: a 75 MB DCP ``.metadata`` of 30 million opcodes is walked in about a tenth of the
    time it takes to unpickle. A pickle that does not parse is not a bomb: the unpickler reports it.
    One made of nothing but tiny strings would make the walk slow (a microsecond a step, against the
    unpickler's tenth): more than MAX_WALK_STEPS such steps is refused. Returns what is wrong, or None."""
    limit = len(data)
    table = _arg_skip()
    run = _fixed_run()
    i = steps = 0
    while i < limit:
        i = run.match(data, i).end()  # type: ignore[union-attr]  # the pattern matches the empty string
        if i >= limit:
            return None
        steps += 1
        if steps > MAX_WALK_STEPS:
            return (
                f"holds more than {MAX_WALK_STEPS:,} strings, bytes and memo stores (checkpoint pickles hold far "
                "fewer); it is not read"
            )
        code = data[i]
        i += 1
        skip = table[code]
        if skip is None:
            return None
        kind, n = skip
        if kind == 0:
            if code == 0x72 and i + 4 <= limit and int.from_bytes(data[i : i + 4], "little") > limit:  # LONG_BINPUT
                return _BOMB
            if code == 0x2E:  # STOP
                return None
            i += n
        elif kind == 1:
            for _ in range(n):
                j = data.find(b"\n", i)
                if j < 0:
                    return None
                if code == 0x70:  # PUT: its index as the unpickler parses it (sign, spaces, underscores)
                    try:
                        index = int(data[i:j])
                    except ValueError:
                        return None
                    if index > limit:
                        return _BOMB
                i = j + 1
        else:
            length = int.from_bytes(data[i : i + n], "little", signed=kind == 3)
            if length < 0:
                return None
            if i + n + length > limit:  # (the unpickler allocates the length it is told before reading)
                return (
                    f"gives a string or bytes of {length:,} bytes at byte {i - 1:,}, past its end ({limit:,} bytes): "
                    "it is cut short or damaged"
                )
            i += n + length
    return None


@functools.cache
def _fixed_run() -> re.Pattern[bytes]:
    """A run of opcodes with fixed-size arguments, LONG_BINPUT (whose index is checked) and STOP
    left out. Every opcode is one distinct byte, so the alternatives never overlap and the match
    is possessive (no backtracking state kept)."""
    by_size: dict[int, list[int]] = {}
    for code, skip in enumerate(_arg_skip()):
        if skip is not None and skip[0] == 0 and code not in (0x72, 0x2E):
            by_size.setdefault(skip[1], []).append(code)
    parts = [
        b"[" + b"".join(re.escape(bytes([c])) for c in codes) + b"]" + b"." * n for n, codes in sorted(by_size.items())
    ]
    return re.compile(b"(?:" + b"|".join(parts) + b")*+", re.DOTALL)


@functools.cache
def _arg_skip() -> tuple[tuple[int, int] | None, ...]:
    """Per opcode byte: None (not an opcode), (0, n) a fixed n-byte argument, (1, n) n newline-ended
    lines, (2, n) an n-byte length then that many bytes ((3, 4): a signed 4-byte length)."""
    import pickletools

    table: list[tuple[int, int] | None] = [None] * 256
    for op in pickletools.opcodes:
        arg = op.arg
        if arg is None:
            table[ord(op.code)] = (0, 0)
        elif arg.n >= 0:
            table[ord(op.code)] = (0, arg.n)
        elif arg.n == pickletools.UP_TO_NEWLINE:
            table[ord(op.code)] = (1, 2 if arg.name == "stringnl_noescape_pair" else 1)
        else:
            table[ord(op.code)] = {
                pickletools.TAKEN_FROM_ARGUMENT1: (2, 1),
                pickletools.TAKEN_FROM_ARGUMENT4: (3, 4),
                pickletools.TAKEN_FROM_ARGUMENT4U: (2, 4),
                pickletools.TAKEN_FROM_ARGUMENT8U: (2, 8),
            }[arg.n]
    return tuple(table)


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
