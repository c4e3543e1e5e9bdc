"""The hostile corpus: damaged and malicious copies of the real fixtures, each with the verdict it
must get.

Most cases are built from a fixture that a real writer made (``fixtures/``), by a function that
copies it into a scratch folder and then lies, truncates or plants a payload. A few cannot be:
the safetensors header bomb and the million-item file are written from nothing; the deep, cyclic
and billion-laughs pickles replace a real archive's ``data.pkl`` whole; the TransformerEngine
``_extra_state`` case rewrites a real Megatron rank file with ckpttool's own torch.save writer
(``formats/_ptwrite.py``, which tests compare with ``torch.save``). Those cases carry the tag
``synthetic``. Each case lists the
commands to run on it and, for each, the exit code and the words its one message must contain.

The sweeps (truncation at every 1/64th of every file, 64 single-byte flips) are generated too:
the verdict for those is "exit 1 or 3 with one clear message" rather than a fixed text.

Run by hand: ``python -m tests.hostile.run --out DIR`` (see ``run.py``); in the suite by
``tests/test_hostile_corpus.py``.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests._zips import replace_member
from tests.conftest import FIXTURES

MARKER = "CKPTTOOL_PWNED"
"""A payload's proof of life: ``touch CKPTTOOL_PWNED`` in the working directory (the runner
changes into a fresh one per command and looks for it afterwards)."""


@dataclass(frozen=True)
class Expect:
    """What one command must do on a case."""

    exit: int | tuple[int, ...]
    says: tuple[str, ...] = ()
    """fragments the output must contain (stderr, or stdout for a JSON report)"""
    rule: str | None = None
    """for ``verify --json``: a finding with this rule id"""


@dataclass
class Case:
    name: str
    build: Callable[[Path], Path]
    """makes the case under the given folder, returns the path to pass to the commands"""
    expect: dict[str, Expect]
    """command (``inspect``, ``verify``, ``export``, ...) -> verdict"""
    limit_s: float = 20.0
    tags: tuple[str, ...] = field(default_factory=tuple)


# -- building blocks -------------------------------------------------------------------------------


def copy_fixture(rel: str, dest: Path) -> Path:
    src = FIXTURES / rel
    out = dest / src.name
    if src.is_dir():
        shutil.copytree(src, out, symlinks=True)
    else:
        shutil.copy2(src, out)
    return out


def payload(module: str, name: str, arg: str = f"touch {MARKER}") -> bytes:
    """Pickle opcodes that call ``module.name(arg)`` and drop the result (GLOBAL, REDUCE, POP)."""
    a = arg.encode()
    return b"c" + f"{module}\n{name}\n".encode() + b"X" + struct.pack("<I", len(a)) + a + b"\x85R0"


def inject(pkl: bytes, code: bytes) -> bytes:
    """Put ``code`` first in a pickle (after its PROTO opcode): it runs before anything else loads,
    and the rest of the pickle still builds the original object."""
    if pkl[:1] == b"\x80":
        return pkl[:2] + code + pkl[2:]
    return code + pkl


def rewrite_zip_member(path: Path, suffix: str, change: Callable[[bytes], bytes]) -> None:
    """Rewrite a torch.save archive with the member ending in ``suffix`` changed."""
    path.write_bytes(replace_member(path.read_bytes(), suffix, change))


def _pt(fixture: str, member: str | None, change: Callable[[bytes], bytes]) -> Callable[[Path], Path]:
    """A case: ``fixture`` copied, the ``data.pkl`` of ``member`` (a file inside it, or the
    fixture itself) changed."""

    def go(dest: Path) -> Path:
        root = copy_fixture(fixture, dest)
        rewrite_zip_member(root / member if member else root, "/data.pkl", change)
        return root

    return go


def _file(fixture: str, member: str, change: Callable[[bytes], bytes]) -> Callable[[Path], Path]:
    """A case: ``fixture`` copied, the bytes of ``member`` changed."""

    def go(dest: Path) -> Path:
        root = copy_fixture(fixture, dest)
        f = root / member
        f.write_bytes(change(f.read_bytes()))
        return root

    return go


def _existing(name: str) -> Callable[[Path], Path]:
    """A case the fixture generators made with the real writers (``fixtures/hostile/``)."""
    return lambda dest: copy_fixture(f"hostile/{name}", dest)


def _dcp_metadata(change: Callable[[object], None], fixture: str = "dcp/fsdp2") -> Callable[[Path], Path]:
    """A case: a DCP fixture whose ``.metadata`` is loaded with torch's classes, changed, and
    pickled again as ``FileSystemWriter`` does."""

    def go(dest: Path) -> Path:
        import torch.distributed.checkpoint  # noqa: F401  (the classes the pickle names)

        root = copy_fixture(fixture, dest)
        with open(root / ".metadata", "rb") as f:
            md = pickle.load(f)  # a fixture written by torch itself: trusted
        change(md)
        with open(root / ".metadata", "wb") as f:
            pickle.dump(md, f)
        return root

    return go


def _first_tensor(md: object, sharded: bool = True) -> tuple[str, object]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    for fqn, meta in md.state_dict_metadata.items():  # type: ignore[attr-defined]
        if isinstance(meta, TensorStorageMetadata) and (len(meta.chunks) > 1) == sharded:
            return fqn, meta
    raise AssertionError("no such tensor in the fixture")


def _set_relative_path(path: str) -> Callable[[object], None]:
    def change(md: object) -> None:
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        sd = md.storage_data  # type: ignore[attr-defined]
        key = next(iter(sd))
        info = sd[key]
        sd[key] = _StorageInfo(path, info.offset, info.length)

    return change


def _overlap_chunks(md: object) -> None:
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    fqn, meta = _first_tensor(md)
    c1 = meta.chunks[1]  # type: ignore[attr-defined]
    # the second chunk starts one row early: rows overlap, and the last row is left uncovered
    off = torch.Size([c1.offsets[0] - 1, *c1.offsets[1:]])
    meta.chunks[1] = ChunkStorageMetadata(offsets=off, sizes=c1.sizes)  # type: ignore[attr-defined]
    sd = md.storage_data  # type: ignore[attr-defined]
    old = next(k for k in sd if k.fqn == fqn and tuple(k.offset) == tuple(c1.offsets))
    sd[MetadataIndex(fqn, off, old.index)] = sd.pop(old)


def _gap_chunks(md: object) -> None:
    _, meta = _first_tensor(md)
    del meta.chunks[-1]  # type: ignore[attr-defined]


def _storage_past_end(md: object) -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    sd = md.storage_data  # type: ignore[attr-defined]
    key = next(iter(sd))
    info = sd[key]
    sd[key] = _StorageInfo(info.relative_path, 10**9, info.length)


def _huge_shape(md: object) -> None:
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    _, meta = _first_tensor(md, sharded=False)
    big = torch.Size([2**62] * len(meta.size))  # type: ignore[attr-defined]
    meta.size = big  # type: ignore[attr-defined]
    c0 = meta.chunks[0]  # type: ignore[attr-defined]
    meta.chunks[0] = ChunkStorageMetadata(offsets=c0.offsets, sizes=big)  # type: ignore[attr-defined]


def _deep_pickle(depth: int) -> bytes:
    """A pickle of ``depth`` nested lists: ``[[[...]]]`` (MARK/LIST pairs, no recursion to write)."""
    return b"\x80\x02" + b"(" * depth + b"l" * depth + b"."


def _cycle_pickle() -> bytes:
    """A list that contains itself: EMPTY_LIST, MEMOIZE, GET 0, APPEND."""
    return b"\x80\x04]\x94h\x00a."


def _laughs_pickle(levels: int) -> bytes:
    """``x0 = [1, 1]; x(k+1) = [xk, xk]``: 200 bytes that expand to 2**levels values."""
    out = b"\x80\x02]q\x00(K\x01K\x01e"
    for k in range(1, levels + 1):
        out += b"]q" + bytes([k]) + b"(h" + bytes([k - 1]) + b"h" + bytes([k - 1]) + b"e"
    return out + b"."


def _safetensors(header: dict | bytes, data: bytes = b"", claim: int | None = None) -> Callable[[Path], Path]:
    def go(dest: Path) -> Path:
        raw = header if isinstance(header, bytes) else json.dumps(header).encode()
        out = dest / "model.safetensors"
        out.write_bytes(struct.pack("<Q", len(raw) if claim is None else claim) + raw + data)
        return out

    return go


def _many_items(n: int) -> Callable[[Path], Path]:
    def go(dest: Path) -> Path:
        out = dest / "model.safetensors"
        parts = [f'"t{i}":{{"dtype":"U8","shape":[1],"data_offsets":[{i},{i + 1}]}}' for i in range(n)]
        raw = ("{" + ",".join(parts) + "}").encode()
        raw += b" " * (-len(raw) % 8)
        out.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(n))
        return out

    return go


def _st_fixture(change: Callable[[dict], None]) -> Callable[[Path], Path]:
    """The real ``safetensors/model.safetensors`` with its header changed (same data)."""

    def go(dest: Path) -> Path:
        blob = (FIXTURES / "safetensors" / "model.safetensors").read_bytes()
        (n,) = struct.unpack("<Q", blob[:8])
        header = json.loads(blob[8 : 8 + n])
        change(header)
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        out = dest / "model.safetensors"
        out.write_bytes(struct.pack("<Q", len(raw)) + raw + blob[8 + n :])
        return out

    return go


def _st_first(header: dict) -> dict:
    return next(v for k, v in header.items() if k != "__metadata__")


def _symlink_outside(fixture: str, member: str) -> Callable[[Path], Path]:
    def go(dest: Path) -> Path:
        root = copy_fixture(fixture, dest)
        outside = dest / ("outside-" + Path(member).name)
        (root / member).rename(outside)
        (root / member).symlink_to(outside)
        return root

    return go


def _duplicate(fixture: str, member: str, alias: str) -> Callable[[Path], Path]:
    def go(dest: Path) -> Path:
        root = copy_fixture(fixture, dest)
        shutil.copy2(root / member, root / alias)
        return root

    return go


def _megatron_extra_state(value: bytes) -> Callable[[Path], Path]:
    """The Megatron legacy fixture with one ``_extra_state`` set to a uint8 tensor holding
    ``value``, as TransformerEngine stores its pickled FP8 metadata. The rank file is re-written
    by ckpttool's own torch.save writer from what its restricted reader read (Megatron's classes
    are not needed to build the case)."""

    def go(dest: Path) -> Path:
        import numpy as np

        from ckpttool.formats import _pt, _ptwrite
        from ckpttool.formats.megatron import ALLOWLIST

        root = copy_fixture("megatron/legacy_tp2pp2", dest)
        rel = "iter_0000003/mp_rank_00_000/model_optim_rng.pt"
        archive, obj, _ = _pt.load(root, rel, ALLOWLIST)
        try:
            tree = _ptwrite.carry(obj, lambda: archive)
            model = tree["model"]
            key = next(k for k in model if k.endswith("_extra_state"))

            def fill(buf: np.ndarray) -> None:
                buf[:] = np.frombuffer(value, dtype=np.uint8)

            model[key] = _ptwrite.OutTensor(dtype="uint8", shape=(len(value),), fill=fill)
            tmp = root / (rel + ".new")
            _ptwrite.save(tree, tmp)
        finally:
            archive.close()
        tmp.replace(root / rel)
        return root

    return go


# -- the cases -------------------------------------------------------------------------------------

_TOUCH = f"touch {MARKER}"
EVIL = {
    "os_system": ("posix", "system", _TOUCH),
    "subprocess": ("subprocess", "getoutput", _TOUCH),
    "eval": ("builtins", "eval", f"__import__('os').system('{_TOUCH}')"),
    "py2_eval": ("__builtin__", "eval", f"__import__('os').system('{_TOUCH}')"),
    "importlib": ("importlib", "import_module", "os"),
    "torch_load": ("torch", "load", "model.pt"),
    "dotted_attr": ("collections", "OrderedDict.__class__", "X"),
    "allowlisted_elsewhere": ("torch.serialization", "_rebuild_tensor_v2", "X"),
}
"""Globals a hostile pickle asks for, with the argument it passes. The last two are spelling
tricks: an attribute path reached through an allowlisted class, and an allowlisted function's name
under another module."""
LIVE = ("os_system", "subprocess", "eval", "py2_eval")
"""The payloads that touch the marker when plain ``pickle.loads`` runs them (a test proves it); the
others are refused by name only (importing a module or loading a file proves nothing here)."""


def _glob(tag: str) -> tuple[str, str]:
    return EVIL[tag][0], EVIL[tag][1]


def _counted(op: bytes, text: str) -> bytes:
    return op + struct.pack("<I", len(text)) + text.encode()


OPCODE_TRICKS = {
    # INST and OBJ build an object from a global without REDUCE (both live)
    "inst": b"(" + _counted(b"X", _TOUCH) + b"iposix\nsystem\n0",
    "obj": b"(cposix\nsystem\n" + _counted(b"X", _TOUCH) + b"o0",
    # BUILD on an allowlisted class with a state naming posix.system (refused by name)
    "build": b"ccollections\nOrderedDict\n)R}" + _counted(b"X", "__setstate__") + b"cposix\nsystem\nsb0",
}
LIVE_TRICKS = ("inst", "obj")
PROTOCOL0 = b"cposix\nsystem\n(V" + _TOUCH.encode() + b"\ntR."
"""``os.system("touch ...")`` as a protocol-0 (text) pickle: no header byte to recognise it by."""


_REFUSED = "refused without running it"


def _unsafe(where: str, glob: tuple[str, str]) -> dict[str, Expect]:
    name = f"{glob[0]}.{glob[1]}"
    return {
        "inspect": Expect(3, (where, name)),
        "verify": Expect(1, (where, name), rule="unsafe-pickle"),
        "export": Expect(3, (where,)),
    }


def _cases() -> Iterator[Case]:
    # real-writer hostile fixtures (made by the fixture generators)
    yield Case("dcp.metadata.os_system.real", _existing("dcp_metadata_os_system"), _unsafe(".metadata", _glob("os_system")))
    yield Case(
        "dcp.bytes_item.os_system.real",
        _existing("dcp_bytes_item_os_system"),
        {"inspect": Expect(1, ("dataloader.cursor", "posix.system")), "verify": Expect(1, ("posix.system",), rule="unsafe-pickle")},
    )
    yield Case(
        "dcp.metadata_tmp_only.real",
        _existing("dcp_metadata_tmp_only"),
        {"inspect": Expect(3, (".metadata.tmp", "interrupted")), "verify": Expect(1, (".metadata.tmp",), rule="incomplete-save")},
    )
    yield Case(
        "dcp.path_escape.real",
        _existing("dcp_path_escape"),
        {"inspect": Expect(3, ("../../outside.distcp", "outside the checkpoint")), "verify": Expect(1, ("../../outside.distcp",), rule="unsafe-path")},
    )
    yield Case(
        "dcp.truncated.real",
        _existing("dcp_truncated_distcp"),
        {"inspect": Expect(3, ("__1_0.distcp", "cut short")), "verify": Expect(1, ("__1_0.distcp",), rule="truncated-file")},
    )
    yield Case(
        "deepspeed.latest_missing_tag.real",
        _existing("ds_latest_missing_tag"),
        {"inspect": Expect(3, ("latest",)), "verify": Expect(1, ("latest",), rule="incomplete-save")},
    )
    yield Case("deepspeed.optim.os_system.real", _existing("ds_optim_os_system"), _unsafe("zero_pp_rank_1_mp_rank_00_optim_states.pt", _glob("os_system")))
    yield Case("megatron.args.os_system.real", _existing("megatron_args_evil_class"), _unsafe("mp_rank_00_000/model_optim_rng.pt", _glob("os_system")))
    yield Case(
        "megatron.missing_rank.real",
        _existing("megatron_missing_mp_rank"),
        {"inspect": Expect(3, ("mp_rank",)), "verify": Expect(1, ("mp_rank",), rule="missing-file")},
    )

    # payloads in every pickle each format carries
    for tag, (module, name, arg) in EVIL.items():
        glob, code = (module, name), payload(module, name, arg)
        yield Case(f"dcp.metadata.{tag}", _file("dcp/fsdp2", ".metadata", lambda b, c=code: inject(b, c)), _unsafe(".metadata", glob))
        yield Case(
            f"megatron.rank_pt.{tag}",
            _pt("megatron/legacy_tp2pp2", "iter_0000003/mp_rank_01_001/model_optim_rng.pt", lambda b, c=code: inject(b, c)),
            _unsafe("mp_rank_01_001/model_optim_rng.pt", glob),
        )
        yield Case(
            f"deepspeed.optim_pt.{tag}",
            _pt("deepspeed/zero2", "global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt", lambda b, c=code: inject(b, c)),
            _unsafe("zero_pp_rank_0_mp_rank_00_optim_states.pt", glob),
        )
    for tag in ("os_system", "eval"):
        glob, code = _glob(tag), payload(*EVIL[tag])
        yield Case(f"torch.pt.{tag}", _pt("torch/train_state.pt", None, lambda b, c=code: inject(b, c)), _unsafe("train_state.pt", glob))
        yield Case(
            f"deepspeed.model_states.{tag}",
            _pt("deepspeed/zero3", "global_step3/zero_pp_rank_0_mp_rank_00_model_states.pt", lambda b, c=code: inject(b, c)),
            _unsafe("zero_pp_rank_0_mp_rank_00_model_states.pt", glob),
        )
        yield Case(
            f"rankshards.pt.{tag}",
            _pt("rankshards/ddp", "shard_00001_of_00002.pt", lambda b, c=code: inject(b, c)),
            _unsafe("shard_00001_of_00002.pt", glob),
        )
        yield Case(
            f"megatron_dist.common_pt.{tag}",
            _pt("megatron/dist_tp2", "iter_0000003/common.pt", lambda b, c=code: inject(b, c)),
            _unsafe("common.pt", glob),
        )
        yield Case(
            f"megatron_dist.metadata.{tag}",
            _file("megatron/dist_tp2", "iter_0000003/.metadata", lambda b, c=code: inject(b, c)),
            _unsafe(".metadata", glob),
        )
    # a nested pickle: TransformerEngine's FP8 metadata is a pickle inside a uint8 tensor; a
    # protocol-0 (text) pickle has no header byte, so it must be recognised by parsing
    nested = {
        4: b"\x80\x04" + payload(*EVIL["os_system"]) + b"N.",
        0: PROTOCOL0,
    }
    for proto, blob in nested.items():
        yield Case(
            f"megatron.te_extra_state.protocol{proto}",
            _megatron_extra_state(blob),
            {
                "inspect": Expect(1, ("_extra_state", "posix.system")),
                "verify": Expect(1, ("_extra_state", "posix.system"), rule="unsafe-pickle"),
            },
            tags=("synthetic",),
        )
    for tag, code in OPCODE_TRICKS.items():
        yield Case(f"dcp.metadata.opcode_{tag}", _file("dcp/fsdp2", ".metadata", lambda b, c=code: inject(b, c)), _unsafe(".metadata", _glob("os_system")))

    # paths that leave the checkpoint
    yield Case(
        "dcp.path_absolute",
        _dcp_metadata(_set_relative_path("/etc/passwd")),
        {"inspect": Expect(3, ("/etc/passwd", "outside the checkpoint")), "verify": Expect(1, ("/etc/passwd",), rule="unsafe-path")},
    )
    yield Case(
        "dcp.path_dotdot",
        _dcp_metadata(_set_relative_path("../../../etc/passwd")),
        {"inspect": Expect(3, ("../../../etc/passwd", "outside the checkpoint")), "verify": Expect(1, ("etc/passwd",), rule="unsafe-path")},
    )
    yield Case(
        "dcp.symlink_outside",
        _symlink_outside("dcp/fsdp2", "__1_0.distcp"),
        {"inspect": Expect(3, ("__1_0.distcp", "outside the checkpoint")), "verify": Expect(1, ("__1_0.distcp",), rule="unsafe-path")},
    )
    yield Case(
        "safetensors.index_symlink_outside",
        _symlink_outside("safetensors/sharded", "model-00001-of-00002.safetensors"),
        {"inspect": Expect(3, ("model-00001-of-00002.safetensors", "outside the checkpoint"))},
    )
    yield Case(
        "deepspeed.latest_dotdot",
        _file("deepspeed/zero2", "latest", lambda b: b"../../etc"),
        {"inspect": Expect(3, ("latest", "../../etc")), "verify": Expect((1, 3), ("latest",))},
    )
    yield Case(
        "megatron.tracker_dotdot",
        _file("megatron/legacy_tp2pp2", "latest_checkpointed_iteration.txt", lambda b: b"../../etc"),
        {"inspect": Expect(3, ("latest_checkpointed_iteration.txt",)), "verify": Expect((1, 3), ("latest_checkpointed_iteration.txt",))},
    )

    # resource bombs
    yield Case(
        "safetensors.header_claims_10GB",
        _safetensors(b"{}", claim=10 * 10**9),
        {"inspect": Expect(3, ("model.safetensors", "10,000,000,000")), "verify": Expect((1, 3), ("model.safetensors",))},
        tags=("synthetic",),
    )
    yield Case(
        "safetensors.shape_overflow",
        _safetensors({"w": {"dtype": "F32", "shape": [2**62, 2**62], "data_offsets": [0, 16]}}, bytes(16)),
        {"inspect": Expect(3, ("model.safetensors", "w")), "verify": Expect((1, 3), ("w",))},
        tags=("synthetic",),
    )
    yield Case(
        "safetensors.million_items",
        _many_items(1_000_000),
        {"inspect": Expect(0, ("items: 1000000",))},
        limit_s=120,
        tags=("valid", "synthetic"),
    )
    yield Case(
        "torch.pt.member_claims_huge_size",
        _torch_zip_lie(),
        {"inspect": Expect(3, ("train_state.pt",)), "verify": Expect((1, 3), ("train_state.pt",))},
    )
    yield Case(
        "torch.pt.nested_100k",
        _pt("torch/train_state.pt", None, lambda b: _deep_pickle(100_000)),
        {"inspect": Expect(3, ("train_state.pt", "nests containers more than 200 levels")), "verify": Expect(1, ("train_state.pt",), rule="corrupt-file")},
        tags=("synthetic",),
    )
    yield Case(
        "dcp.metadata.nested_100k",
        _file("dcp/fsdp2", ".metadata", lambda b: _deep_pickle(100_000)),
        {"inspect": Expect(3, (".metadata",)), "verify": Expect((1, 3), (".metadata",))},
        tags=("synthetic",),
    )
    yield Case(
        "dcp.metadata.cycle",
        _file("dcp/fsdp2", ".metadata", lambda b: _cycle_pickle()),
        {"inspect": Expect(3, (".metadata", "cycle")), "verify": Expect(1, (".metadata",), rule="corrupt-file")},
        tags=("synthetic",),
    )
    yield Case(
        "torch.pt.billion_laughs",
        _pt("torch/train_state.pt", None, lambda b: _laughs_pickle(64)),
        {"inspect": Expect(3, ("train_state.pt", "expands to more than")), "verify": Expect(1, ("train_state.pt",), rule="corrupt-file")},
        tags=("synthetic",),
    )
    yield Case(
        "megatron.rank_pt.nested_100k",
        _pt("megatron/legacy_tp2pp2", "iter_0000003/mp_rank_00_001/model_optim_rng.pt", lambda b: _deep_pickle(100_000)),
        {"inspect": Expect(3, ("mp_rank_00_001", "nests containers more than 200 levels")), "verify": Expect(1, ("mp_rank_00_001",), rule="corrupt-file")},
        tags=("synthetic",),
    )
    yield Case(
        "dcp.shape_overflow",
        _dcp_metadata(_huge_shape),
        {"inspect": Expect(3, ("4,611,686,018,427,387,904 bytes", "storage in __0_0.distcp")), "verify": Expect(1, (), rule="corrupt-file")},
    )

    # structural lies
    yield Case(
        "safetensors.offsets_past_end",
        _st_fixture(lambda h: _st_first(h).update(data_offsets=[0, 10**7])),
        {"inspect": Expect(3, ("model.safetensors",)), "verify": Expect((1, 3), ("model.safetensors",))},
    )
    yield Case(
        "safetensors.dtype_length_disagree",
        _st_fixture(_st_dtype_lie),
        {"inspect": Expect(3, ("model.safetensors",)), "verify": Expect((1, 3), ("model.safetensors",))},
    )
    yield Case(
        "safetensors.overlapping_tensors",
        _st_fixture(_st_overlap),
        {"inspect": Expect(3, ("model.safetensors",)), "verify": Expect((1, 3), ("model.safetensors",))},
    )
    yield Case(
        "dcp.chunks_overlap",
        _dcp_metadata(_overlap_chunks),
        {"verify": Expect(1, (), rule="coverage-overlap"), "export": Expect(3, ("in two pieces",))},
    )
    yield Case(
        "dcp.chunks_gap",
        _dcp_metadata(_gap_chunks),
        {"verify": Expect(1, (), rule="coverage-gap"), "export": Expect(3, ("16 of 160 elements are in no piece",))},
    )
    yield Case(
        "dcp.offset_past_end",
        _dcp_metadata(_storage_past_end),
        {"inspect": Expect(3, ("__0_0.distcp is 81,434 bytes", "cut short")), "verify": Expect(1, (), rule="truncated-file")},
    )
    yield Case(
        "rankshards.two_files_one_rank",
        _duplicate("rankshards/ddp", "shard_00000_of_00002.pt", "shard_0_of_2.pt"),
        {"inspect": Expect(3, ("both claim rank 0",)), "verify": Expect((1, 3), ("rank 0",))},
    )
    yield Case(
        "deepspeed.two_files_one_rank",
        _duplicate("deepspeed/zero2", "global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt",
                   "global_step3/zero_pp_rank_00_mp_rank_00_optim_states.pt"),
        {"inspect": Expect(3, ("rank 0",)), "verify": Expect((1, 3), ("rank 0",))},
    )
    yield Case(
        "megatron.two_dirs_one_rank",
        _megatron_same_rank(),
        {"inspect": Expect(3, ("mp_rank_00",)), "verify": Expect((1, 3), ("mp_rank_00",))},
    )


def _st_dtype_lie(header: dict) -> None:
    entry = next(v for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F32" and v["shape"])
    entry["dtype"] = "F64"


def _st_overlap(header: dict) -> None:
    names = [k for k in header if k != "__metadata__"]
    a, b = header[names[0]], header[names[1]]
    if b["data_offsets"][1] - b["data_offsets"][0] >= a["data_offsets"][1] - a["data_offsets"][0]:
        b["data_offsets"] = [a["data_offsets"][0], a["data_offsets"][0] + b["data_offsets"][1] - b["data_offsets"][0]]
    else:
        a["data_offsets"] = [b["data_offsets"][0], b["data_offsets"][0] + a["data_offsets"][1] - a["data_offsets"][0]]


def _torch_zip_lie() -> Callable[[Path], Path]:
    """``data.pkl``'s central-directory entry claims 2**40 bytes."""

    def go(dest: Path) -> Path:
        out = copy_fixture("torch/train_state.pt", dest)
        blob = bytearray(out.read_bytes())
        at = blob.rfind(b"PK\x01\x02")
        while at >= 0:
            (nlen,) = struct.unpack_from("<H", blob, at + 28)
            name = bytes(blob[at + 46 : at + 46 + nlen])
            if name.endswith(b"data.pkl"):
                struct.pack_into("<I", blob, at + 24, 0xFFFFFFF0)  # uncompressed size
                struct.pack_into("<I", blob, at + 20, 0xFFFFFFF0)  # compressed size
                break
            at = blob.rfind(b"PK\x01\x02", 0, at)
        out.write_bytes(bytes(blob))
        return out

    return go


def _megatron_same_rank() -> Callable[[Path], Path]:
    """``mp_rank_00_000`` copied as ``mp_rank_00``: the legacy names with and without the PP
    suffix, both claiming TP rank 0 (of stage 0)."""

    def go(dest: Path) -> Path:
        root = copy_fixture("megatron/legacy_tp2pp2", dest)
        it = root / "iter_0000003"
        shutil.copytree(it / "mp_rank_00_000", it / "mp_rank_00")
        return root

    return go


CASES: list[Case] = list(_cases())


# -- the sweeps ------------------------------------------------------------------------------------

SWEEP_FIXTURES = [
    "dcp/fsdp2",
    "torch/train_state.pt",
    "safetensors/sharded",
    "megatron/legacy_tp2pp2",
    "megatron/dist_tp2",
    "deepspeed/zero2",
    "rankshards/ddp",
]
"""One fixture per format: every file of it truncated at each 1/64th, and 64 single-byte flips."""


@dataclass(frozen=True)
class Damage:
    fixture: str
    file: str
    """the damaged file, relative to the fixture (``""`` for a single-file fixture)"""
    kind: str  # "trunc" or "flip"
    at: int
    """new length (trunc) or byte offset (flip)"""
    bit: int = 0

    @property
    def name(self) -> str:
        return f"{self.fixture}:{self.file or '.'}:{self.kind}@{self.at}" + (f"^{self.bit}" if self.kind == "flip" else "")

    def apply(self, root: Path) -> bytes:
        """Damage the copy at ``root``; return the file's original bytes (to put back)."""
        f = root / self.file if self.file else root
        original = f.read_bytes()
        st = f.stat()
        if self.kind == "trunc":
            f.write_bytes(original[: self.at])
        else:
            data = bytearray(original)
            data[self.at] ^= 1 << self.bit
            f.write_bytes(bytes(data))
        # damage at rest (bit rot, a cut copy): the file keeps its time, so it does not also look
        # like a save rewriting the checkpoint now (verify watches those for a moment)
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
        return original

    def undo(self, root: Path, original: bytes) -> None:
        f = root / self.file if self.file else root
        st = f.stat()
        f.write_bytes(original)
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))


def data_files(root: Path) -> list[str]:
    """The files of a fixture that the sweeps damage: everything but DeepSpeed's copies of its
    own scripts (placeholders here) and ckpttool's seal."""
    if root.is_file():
        return [""]
    return sorted(
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.is_file() and not p.name.endswith(".py") and p.name != "ckpttool.manifest.json"
    )


def sweep(fixture: str, seed: int = 0) -> list[Damage]:
    root = FIXTURES / fixture
    out: list[Damage] = []
    sizes = {rel: (root / rel if rel else root).stat().st_size for rel in data_files(root)}
    for rel, size in sizes.items():
        for k in range(64):
            out.append(Damage(fixture, rel, "trunc", size * k // 64))
    rng = random.Random(f"{fixture}:{seed}")
    total = sum(sizes.values())
    for _ in range(64):
        pick = rng.randrange(total)
        for rel, size in sizes.items():
            if pick < size:
                out.append(Damage(fixture, rel, "flip", pick, rng.randrange(8)))
                break
            pick -= size
    return out
