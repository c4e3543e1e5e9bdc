from __future__ import annotations

import contextlib
import enum
import os
import subprocess
import sys
import threading
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
DCP_FIXTURES = ["fsdp2", "fsdp2_threads2", "fsdp2_per_item", "fsdp2_zstd", "fsdp2_ranklocal", "mesh2x2"]


@dataclass
class Run:
    code: int
    stdout: str
    stderr: str


def cli_env(**extra: str) -> dict[str, str]:
    """The environment the CLI runs in under test: this one, with the terminal pinned (width 120,
    no colour) and no debug tracebacks or GitHub annotations."""
    base = {k: v for k, v in os.environ.items() if k not in ("CKPTTOOL_DEBUG", "GITHUB_ACTIONS")}
    return {**base, "COLUMNS": "120", "NO_COLOR": "1", "TERM": "dumb", **extra}


class OnFirstProgress:
    """A ``progress`` callback that runs ``action`` the first time it is called (by whichever
    thread reports first): something done to the files while a command runs, as a writer at work
    or another run's output appearing would. ``ran`` says whether it did."""

    def __init__(self, action: Callable[[], None]) -> None:
        self.action = action
        self.ran = False
        self._lock = threading.Lock()

    def __call__(self, n: int) -> None:
        with self._lock:
            if self.ran:
                return
            self.ran = True
        self.action()


def fixture_copy(src: Path, dst: Path) -> Path:
    """A copy at ``dst`` of a fixture checkpoint: a folder copied whole, a file into folder ``dst``."""
    import shutil

    if src.is_dir():
        shutil.copytree(src, dst)
    else:
        dst.mkdir(parents=True)
        shutil.copy2(src, dst / src.name)
    return dst


def tree_digests(root: Path, skip: Callable[[str], bool] = lambda rel: False) -> dict[str, str]:
    """sha256 of every file below ``root`` (or of ``root`` itself, a file: key ``""``), by
    relative posix path; ``skip(rel)`` leaves files out."""
    import hashlib

    if root.is_file():
        return {"": hashlib.sha256(root.read_bytes()).hexdigest()}
    return {
        rel: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not skip(rel := p.relative_to(root).as_posix())
    }


class _Missing:
    """An object of a class this machine cannot import (Megatron's enums in ``args``), as
    :func:`load_pt` rebuilds it: its constructor arguments and state, equal to another of the same
    class name with the same arguments and state."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._args = args
        self.__dict__.update(kwargs)

    def __setstate__(self, state: Any) -> None:
        self.__dict__.update(state if isinstance(state, dict) else {"_state": state})

    def __eq__(self, other: object) -> bool:
        return type(self).__qualname__ == type(other).__qualname__ and self.__dict__ == other.__dict__

    __hash__ = None  # type: ignore[assignment]


def load_pt(path: Path) -> Any:
    """``torch.load`` of a file that pickles classes of a library that need not be installed
    (a Megatron ``common.pt``): such a class comes back as a :class:`_Missing` stand-in, tensors
    and everything else as torch gives them."""
    import pickle
    import types

    import torch

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            try:
                return super().find_class(module, name)
            except (ImportError, AttributeError):
                return type(name, (_Missing,), {"__qualname__": f"{module}.{name}", "__module__": module})

    stand_in = types.SimpleNamespace(Unpickler=Unpickler, load=pickle.load, __name__="pickle")
    return torch.load(path, weights_only=False, pickle_module=stand_in)


def data_pkl(data: bytes | bytearray) -> tuple[Any, int]:
    """The ``data.pkl`` member of a torch.save file's bytes: its zip info and where its bytes start."""
    import io
    import zipfile

    with zipfile.ZipFile(io.BytesIO(bytes(data))) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data.pkl"))
    head = info.header_offset
    name_len = int.from_bytes(data[head + 26 : head + 28], "little")
    extra_len = int.from_bytes(data[head + 28 : head + 30], "little")
    return info, head + 30 + name_len + extra_len


def set_stored_crc(data: bytearray, info: Any, start: int, crc: int) -> None:
    """Store ``crc`` as member ``info``'s CRC-32 everywhere a zip keeps it: its central directory
    entry, its local header (when it holds one) and its data descriptor (``start``: its bytes')."""
    import re
    import struct

    packed = struct.pack("<I", crc)
    for m in re.finditer(b"PK\x01\x02", bytes(data)):
        o = m.start()
        n = int.from_bytes(data[o + 28 : o + 30], "little")
        if bytes(data[o + 46 : o + 46 + n]).decode(errors="replace") == info.filename:
            data[o + 16 : o + 20] = packed
    head = info.header_offset
    if int.from_bytes(data[head + 14 : head + 18], "little"):
        data[head + 14 : head + 18] = packed
    end = start + info.file_size
    if data[end : end + 4] == b"PK\x07\x08":
        data[end + 4 : end + 8] = packed


def restamp_crcs(path: Path, start: int = 0, length: int | None = None) -> None:
    """Store again the CRC-32s of every member of the zip at bytes ``[start, start + length)`` of
    ``path`` (the whole file by default; a DCP record's span): a test that changed a tensor's bytes
    to stand for a save of other values, not for damage (which diff, convert and verify name)."""
    import io
    import zipfile
    import zlib

    data = bytearray(path.read_bytes())
    end = len(data) if length is None else start + length
    region = bytearray(data[start:end])
    with zipfile.ZipFile(io.BytesIO(bytes(region))) as z:
        infos = z.infolist()
    for info in infos:
        head = info.header_offset
        name_len = int.from_bytes(region[head + 26 : head + 28], "little")
        extra_len = int.from_bytes(region[head + 28 : head + 30], "little")
        begin = head + 30 + name_len + extra_len
        set_stored_crc(region, info, begin, zlib.crc32(bytes(region[begin : begin + info.file_size])))
    data[start:end] = region
    path.write_bytes(bytes(data))


def assert_clean(r: Run, code: int, *fragments: str) -> None:
    """Exit ``code`` with one clear message (each of ``fragments`` on stderr): no traceback, never
    an "internal error … a bug in ckpttool"."""
    assert r.code == code, (r.code, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr
    assert "this is a bug in ckpttool" not in r.stderr, r.stderr
    for f in fragments:
        assert f in r.stderr, (f, r.stderr)


def run_cli(
    *args: str | os.PathLike[str],
    cwd: str | os.PathLike[str] | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 120,
) -> Run:
    """Run ``python -m ckpttool`` in a fresh process, as a user would."""
    proc = subprocess.run(
        [sys.executable, "-m", "ckpttool", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=cli_env(**(env or {})),
        timeout=timeout,
    )
    return Run(proc.returncode, proc.stdout, proc.stderr)


@pytest.fixture
def cli():
    return run_cli


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip)


def rewritten_copy(
    dst: Path,
    source: Path,
    edit: Callable[[Any], None],
    files: str = "iter_*/mp_rank_*/model_optim_rng.pt",
    allow: Any = None,
) -> Path:
    """A copy of a Megatron checkpoint (or another, with ``files`` and ``allow``) with ``edit(tree)``
    applied to the tree of every file matching ``files`` (default: each legacy rank file;
    ``iter_*/common.pt`` for torch_dist), read with the pickle allowlist ``allow`` (default:
    Megatron's): each re-pickled by ckpttool's own writer from the restricted unpickler's tree
    (tensors copied from the original), so neither torch nor Megatron is needed, and given its
    original's times (a DeepSpeed file newer than ``latest`` reads as an incomplete save). For
    edge-case inputs (changed args, param groups), never presented as a library's own output."""
    import shutil

    from ckpttool.formats import _pt, _ptwrite
    from ckpttool.formats.megatron import ALLOWLIST

    allow = ALLOWLIST if allow is None else allow  # Megatron's, unless told

    shutil.copytree(source, dst)
    (dst / "ckpttool.manifest.json").unlink(missing_ok=True)
    for f in dst.glob(files):
        archive, obj, _ = _pt.load(source, str(f.relative_to(dst)), allow)
        try:
            edit(obj)
            _ptwrite.save(_ptwrite.carry(obj, lambda archive=archive: archive), f)
        finally:
            archive.close()
        shutil.copystat(source / f.relative_to(dst), f)
    return dst


def _autotp_without_maps(tree: Any) -> None:
    tree["universal_checkpoint_info"].pop("affine_map")


def _autotp_legacy(tree: Any) -> None:
    info = tree["universal_checkpoint_info"]
    for key in ("affine_map", "sub_param_shard_widths"):
        info.pop(key)
    info["universal_checkpoint_version"] = 0.3
    for spec in info["parameter_with_sub_params"]:
        if "gate_up" in spec["patterns"][0]:
            spec["shape"] = [2, -1]  # a count of equal sub-parameters, as AutoTP's spec says it


AUTOTP_METADATA: dict[str, Callable[[Any], None] | None] = {
    "affine maps": None,
    "sub-parameters": _autotp_without_maps,
    "legacy": _autotp_legacy,
}
"""The autotp fixture's universal_checkpoint_info as DeepSpeed 0.19.8 saves it (affine maps, which
supersede the patterns), and two forms ckpttool reconstructs from it by editing a copy (no
DeepSpeed wrote these files; ds_to_universal, run on the same copies, is the oracle): without the
maps (parameter_with_sub_params with the widths of version 0.4), and as before version 0.4 (no
widths; the gate_up projection's sub-parameters a count). The edit making each, for
:func:`rewritten_copy` of the model states."""


def autotp_copy(tmp_path: Path, metadata: str) -> Path:
    """The autotp fixture with its split rules in the form ``metadata`` (:data:`AUTOTP_METADATA`)."""
    from ckpttool.formats.deepspeed import ALLOWLIST

    edit = AUTOTP_METADATA[metadata]
    src = FIXTURES / "deepspeed" / "autotp"
    if edit is None:
        return src
    return rewritten_copy(tmp_path / "autotp", src, edit, "global_step3/mp_rank_*_model_states.pt", ALLOWLIST)


@contextlib.contextmanager
def megatron_enums() -> Iterator[None]:
    """While the block runs, ``torch.load`` and ``torch.save`` of Megatron-LM rank files work without
    megatron-core (CI does not install it): the two enums its ``args`` pickle
    (``megatron.core.enums.ModelType``, ``megatron.core.transformer.enums.AttnBackend``) are stood
    in for by enums that take any value and pickle back as the same globals. Nothing is stubbed
    where megatron-core is installed, and the stubs are gone after the block (``importorskip`` of
    megatron-core must still skip)."""
    try:
        import megatron.core.enums
        import megatron.core.transformer.enums
    except ImportError:
        pass
    else:
        yield
        return

    class AnyValue(enum.Enum):
        @classmethod
        def _missing_(cls, value: object) -> Any:
            member = object.__new__(cls)
            member._value_, member._name_ = value, f"value_{value}"
            return member

    names = ("megatron", "megatron.core", "megatron.core.enums", "megatron.core.transformer")
    names += ("megatron.core.transformer.enums",)
    modules = {n: types.ModuleType(n) for n in names}
    for module, name in (("megatron.core.enums", "ModelType"), ("megatron.core.transformer.enums", "AttnBackend")):

        class Stub(AnyValue):
            STUB = object()  # (an enum without members refuses every value before _missing_)

        Stub.__module__, Stub.__name__, Stub.__qualname__ = module, name, name
        setattr(modules[module], name, Stub)
    saved = {n: sys.modules.pop(n) for n in names if n in sys.modules}
    sys.modules.update(modules)
    try:
        yield
    finally:
        for n in names:
            sys.modules.pop(n, None)
        sys.modules.update(saved)
