"""Damaged checkpoints of every format: truncations and bit flips in every file give a finding or
one clear error, never an unexpected exception (a traceback)."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from ckpttool import _crc, registry
from ckpttool._torchzip import Archive, read_tensor
from ckpttool.errors import CkptError, CorruptFileError
from ckpttool.export import export
from ckpttool.inspect import inspect
from ckpttool.io import MemberCrcs, RandomAccessFile
from ckpttool.verify import verify
from tests.conftest import FIXTURES, run_cli

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


# -- a flipped bit is never carried into a new checkpoint ------------------------------------------

CARRIED = [  # (fixture, tensor whose bytes are flipped, command that writes a checkpoint from it)
    ("dcp/fsdp2", "model.blocks.0.fc1.weight", ["reshard", "--dp", "2"]),
    ("dcp/fsdp2", "model.blocks.0.fc1.weight", ["export"]),
    # a ZeRO fp32 partition, read one parameter at a time: the parts' CRCs are combined
    ("deepspeed/zero2", "blocks.0.fc1.weight.exp_avg", ["reshard", "--dp", "1"]),
    ("deepspeed/zero2", "blocks.0.fc1.weight.exp_avg", ["reshard", "--dp", "1", "--workers", "2"]),
    # the model states' tensors are views of one flat buffer, read view by view
    ("deepspeed/zero2", "blocks.0.fc1.weight", ["export"]),
    ("megatron/legacy_tp2pp2", "decoder.layers.0.mlp.linear_fc2.weight", ["reshard", "--tp", "1", "--pp", "1"]),
    ("megatron/dist_tp2", "embedding.word_embeddings.weight", ["reshard", "--tp", "1"]),
    ("torch/train_state.pt", "model.blocks.0.fc1.weight", ["convert", "--to", "dcp"]),
    ("rankshards/ddp", "model.body.0.weight", ["convert", "--to", "safetensors"]),
]


def _digests(path):
    files = sorted(p for p in (path.rglob("*") if path.is_dir() else [path]) if p.is_file())
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _flip(path, offset):
    """One bit flipped, as storage corrupts it: the file's times kept (a rewritten file newer than
    its metadata is another finding, which seal refuses on its own)."""
    st = os.stat(path)
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([byte ^ 0x10]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _run(args, cwd):
    return subprocess.run([sys.executable, "-m", "ckpttool", *args], capture_output=True, text=True, cwd=cwd)


def _flipped_copy(rel: str, item: str, tmp_path: Path) -> tuple[Path, str]:
    """A copy of fixture ``rel`` under ``tmp_path/src`` with one bit flipped in the middle of
    ``item``'s first piece: (the copy, the damaged file)."""
    src = tmp_path / "src" / Path(rel).name
    src.parent.mkdir()
    (shutil.copytree if (FIXTURES / rel).is_dir() else shutil.copy)(FIXTURES / rel, src)
    adapter, manifest = registry.describe(src)
    target = manifest.items[item]
    with adapter.reader(manifest) as reader:
        offset, length = reader.raw_span(target.pieces[0], target)
    damaged = target.pieces[0].file
    _flip(Path(manifest.root) / damaged, offset + length // 2)
    return src, damaged


@pytest.mark.parametrize(("rel", "item", "command"), CARRIED, ids=lambda v: "-".join(v) if isinstance(v, list) else v)
def test_a_flipped_bit_is_not_carried_into_a_new_checkpoint(rel, item, command, tmp_path):
    """torch never checks the CRC-32s in its zip archives: reshard, convert and export do, for every
    byte they read of a member (a member read in parts too), and stop with exit 3 naming the
    member and its file; nothing is published (not even the folders made for the output) and the
    source is left as it was."""
    src, damaged = _flipped_copy(rel, item, tmp_path)
    before = _digests(src)
    # in folders that do not exist yet: made for the output, removed with it when it fails
    out = tmp_path / "new" / "deeper" / ("out.safetensors" if command == ["export"] else "out")
    run = _run([command[0], str(src), "-o", str(out), *command[1:]], tmp_path)
    assert run.returncode == 3, run.stdout + run.stderr
    assert "Traceback" not in run.stderr
    assert "CRC-32" in run.stderr and damaged in run.stderr, run.stderr
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no output, no staged leftovers, no folders
    assert _digests(src) == before


def test_crcs_are_checked_in_parts_in_any_order(tmp_path):
    """MemberCrcs judges a member once the parts read tile it, whatever their order and overlaps;
    a member never read whole, or whose stored CRC is 0 (torch's "not computed"), is not judged."""
    original = os.urandom(100_000)
    members = {"a": (1000, 40_000), "b": (41_000, 9_000), "c": (60_000, 30_000), "d": (92_000, 8_000)}
    path = tmp_path / "f"

    def read(data, crc_of=lambda name: zlib.crc32(original[members[name][0] : sum(members[name])])):
        path.write_bytes(data)
        with RandomAccessFile(path) as f:
            f.crcs = MemberCrcs("f")
            for name, (start, n) in members.items():
                f.crcs.expect(start, n, crc_of(name), name)
            f.read(60_000, 10_000)  # c in parts, out of order, overlapping
            f.read(75_000, 15_000)
            f.read(65_000, 15_000)
            f.read(900, 50_000)  # a whole and the head of b, in one read
            f.read(41_000, 9_000)  # b whole
            f.read(70_000, 5_000)  # c's parts now tile it
            f.read(92_000, 4_000)  # d: half only

    read(original)
    for flip, name in ((20_000, "a"), (45_000, "b"), (72_000, "c")):
        data = bytearray(original)
        data[flip] ^= 1
        with pytest.raises(CorruptFileError, match=f"^{name}: ") as caught:
            read(bytes(data))
        assert caught.value.rule == "checksum-mismatch"
    for flip in (500, 94_000):  # outside every member; in d, which is never read whole
        data = bytearray(original)
        data[flip] ^= 1
        read(bytes(data))
    data = bytearray(original)
    data[20_000] ^= 1
    read(bytes(data), crc_of=lambda name: 0)


def _member_span(path: Path, member: str) -> tuple[int, int]:
    """(file offset, length) of the stored zip member whose name ends with ``/member``."""
    import struct
    import zipfile

    info = next(i for i in zipfile.ZipFile(path).infolist() if i.filename.endswith("/" + member))
    with open(path, "rb") as fh:
        fh.seek(info.header_offset + 26)
        n, m = struct.unpack("<HH", fh.read(4))
    return info.header_offset + 30 + n + m, info.file_size


def _torch_with_an_unused_tail(root: Path) -> Path:
    import torch

    flat = torch.arange(1000, dtype=torch.float32)
    torch.save({"a": flat[:400].view(20, 20), "b": flat[400:900]}, root / "t.pt")
    return root / "t.pt"


@pytest.mark.parametrize(
    ("rel", "file", "member", "at", "command"),
    [  # a member some of whose bytes no tensor uses: bucket padding, alignment padding, an unused tail
        ("megatron/legacy_tp2pp2_distopt", "iter_0000003/mp_rank_00_000/distrib_optim.pt", "data/0", 0.0,
         ["reshard", "--tp", "1", "--pp", "1"]),
        ("megatron/legacy_tp2pp2_distopt", "iter_0000003/mp_rank_00_000/distrib_optim.pt", "data/0", 0.0,
         ["reshard", "--tp", "1", "--pp", "1", "--workers", "2"]),
        ("megatron/legacy_tp2pp2_distopt", "iter_0000003/mp_rank_00_000/distrib_optim.pt", "data/0", 0.0,
         ["convert", "--to", "safetensors"]),
        ("deepspeed/zero1", "global_step3/zero_pp_rank_1_mp_rank_00_optim_states.pt", "data/4", 0.5,
         ["reshard", "--dp", "1"]),
        ("deepspeed/zero2", "global_step3/mp_rank_00_model_states.pt", "data/0", 0.5, ["reshard", "--dp", "3"]),
        (None, "t.pt", "data/0", 0.1, ["convert", "--to", "safetensors"]),
        (None, "t.pt", "data/0", 0.1, ["convert", "--to", "torch"]),
        (None, "t.pt", "data/0", 0.1, ["convert", "--to", "dcp"]),
        (None, "t.pt", "data/0", 0.1, ["export"]),
    ],
    ids=["distopt", "distopt-workers", "distopt-safetensors", "zero1-padding", "zero2-model", "tail-safetensors",
         "tail-torch", "tail-dcp", "tail-export"],
)  # fmt: skip
def test_a_flipped_bit_in_a_member_read_in_part_is_not_carried(rel, file, member, at, command, tmp_path):
    """The CRC-32 of a member was judged only once the parts read tiled it: where some of its
    bytes are no tensor's (a distributed optimizer's bucket padding, a ZeRO partition's alignment
    padding, a storage's unused tail), a flipped bit in a tensor it holds went into the output,
    sealed, exit 0 (verify of the source did find it). The bytes no one read are read before
    publishing, and the member is judged whole: exit 3, nothing written."""
    root = tmp_path / "src"
    root.mkdir()
    if rel is None:
        src = _torch_with_an_unused_tail(root)
    else:
        src = root / "ck"
        shutil.copytree(FIXTURES / rel, src)
    path = src / file if src.is_dir() else src
    start, length = _member_span(path, member)
    _flip(path, start + int(length * at))
    before = _digests(root)
    out = tmp_path / ("out.safetensors" if command == ["export"] else "out")
    run = _run([command[0], str(src), "-o", str(out), *command[1:]], tmp_path)
    assert run.returncode == 3, run.stdout + run.stderr
    assert "CRC-32" in run.stderr and member.replace("/", "/") in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    assert _digests(root) == before


def test_a_member_read_in_part_is_judged_whole_before_publishing(tmp_path):
    """finish_partial reads what no part covered, and judges the member: a flip in the part read
    or in the part never read is found; an intact member passes, and its unread bytes are all that
    is read."""
    from ckpttool import io as ckio

    original = os.urandom(20_000)
    path = tmp_path / "f"

    def half(data: bytes) -> int:
        path.write_bytes(data)
        with ckio.checking_crcs(), RandomAccessFile(path) as f:
            assert f.crcs is not None
            f.crcs.expect(1000, 10_000, zlib.crc32(original[1000:11_000]), "m")
            f.read(1000, 3000)
            f.read(7000, 2000)  # (two parts; 5000 bytes of the member unread)
            return ckio.finish_partial()

    assert half(original) == 5000
    for flip in (2000, 5000, 10_500):  # in a part read, in a gap, in the tail
        data = bytearray(original)
        data[flip] ^= 1
        with pytest.raises(CorruptFileError, match="^m: ") as caught:
            half(bytes(data))
        assert caught.value.rule == "checksum-mismatch"


def test_crc_combination_without_isal():
    """The fallback combination (no ISA-L) gives zlib's CRC of the concatenation."""
    rng = random.Random(5)
    for _ in range(50):
        a, b = rng.randbytes(rng.randrange(3000)), rng.randbytes(rng.randrange(3000))
        fallback = _crc._multiply(zlib.crc32(a), _crc._x_to_8n(len(b))) ^ zlib.crc32(b) if b else zlib.crc32(a)
        assert fallback == zlib.crc32(a + b)
        assert _crc.combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_a_flipped_bit_in_a_pickle_or_an_archive_in_memory_is_caught(tmp_path):
    """The pickle of a torch_dist object record copied byte for byte, and a record held in memory
    (a decompressed DCP chunk), are checked too."""
    src = tmp_path / "dist_tp2"
    shutil.copytree(FIXTURES / "megatron/dist_tp2", src)
    adapter, manifest = registry.describe(src)
    piece = next(i.pieces[0] for i in manifest.items.values() if not i.is_tensor and "offset" in i.pieces[0].locator)
    with adapter.reader(manifest) as reader:
        archive = reader.archive_of(piece)
        name = archive.prefix + "data.pkl"
        span = archive.member_span(name, archive.members[name])
    _flip(Path(manifest.root) / piece.file, span.offset + span.length - 3)  # inside the pickle's memo
    run = _run(["reshard", str(src), "-o", str(tmp_path / "out"), "--to", "megatron-dist", "--tp", "2"], tmp_path)
    assert run.returncode == 3 and "data.pkl" in run.stderr and "CRC-32" in run.stderr, run.stderr
    assert not (tmp_path / "out").exists()

    import io as _io

    import torch

    buf = _io.BytesIO()
    torch.save(torch.arange(64, dtype=torch.float32), buf)
    data = bytearray(buf.getvalue())
    probe = Archive(bytes(data), display="chunk")
    start = probe.storage_span(probe.load().storage.key).offset
    data[start + 10] ^= 1
    damaged = Archive(bytes(data), display="chunk", check=True)
    with pytest.raises(CorruptFileError, match="CRC-32"):
        read_tensor(damaged, damaged.load())
    unchecked = Archive(bytes(data), display="chunk")  # verify's reading: judged elsewhere
    read_tensor(unchecked, unchecked.load())


@pytest.mark.parametrize(
    ("rel", "item"),
    [
        ("dcp/fsdp2", "model.blocks.0.fc1.weight"),
        ("torch/train_state.pt", "model.blocks.0.fc1.weight"),
        ("deepspeed/zero2", "blocks.0.fc1.weight.exp_avg"),
    ],
)
def test_seal_refuses_bytes_that_fail_their_crc(rel, item, tmp_path):
    """seal hashed a flipped tensor byte into the seal with exit 0, and verify against that seal
    then passed: the seal trusted, the CRC-32s never read. seal checks every member's CRC-32 in
    its one pass over the bytes and refuses (exit 3, no seal); verify still reports the damage."""
    src, damaged = _flipped_copy(rel, item, tmp_path)
    before = _digests(src.parent)
    run = _run(["seal", str(src)], tmp_path)
    assert run.returncode == 3, run.stdout + run.stderr
    assert "Traceback" not in run.stderr and "CRC-32" in run.stderr and damaged in run.stderr, run.stderr
    assert "not sealed" in run.stderr
    assert _digests(src.parent) == before
    verify = _run(["verify", str(src)], tmp_path)
    assert verify.returncode == 1 and "checksum-mismatch" in verify.stdout, verify.stdout


_INDEX_FIELDS = [  # (field, byte offset in a central-directory entry, bit flipped)
    ("compression method 8 (deflate): torch inflates stored bytes", 10, 0x08),
    ("compression method 1", 10, 0x01),
    ("encryption flag", 8, 0x01),
    ("disk number 2", 34, 0x02),  # (1 reads: miniz takes disk 1 for this one)
    ("DOS folder attribute", 38, 0x10),
]


@pytest.mark.parametrize("rel", ["torch/train_state.pt", "dcp/fsdp2"])
@pytest.mark.parametrize(("field", "at", "bit"), _INDEX_FIELDS, ids=[f[0].split(":")[0] for f in _INDEX_FIELDS])
def test_a_flipped_bit_in_a_zip_index_field_torch_fails_on_is_found(rel, field, at, bit, tmp_path):
    """One flipped bit in a zip directory entry's method, flags, disk number or attributes: torch's
    reader (miniz) fails on the member ("unsupported method", "unsupported encryption", "multidisk")
    or reads garbage for it, but verify said OK and seal vouched for the file: only the signature,
    sizes and offsets were checked. Every field miniz refuses is now judged, in .pt files and in
    the archives inside .distcp files; the damage is an error naming the file."""
    from tests.conftest import fixture_copy

    src = FIXTURES / rel
    root = fixture_copy(src, tmp_path / "ckpt")
    target = next(p for p in sorted(root.iterdir()) if p.is_file() and b"PK\x01\x02" in p.read_bytes())
    data = bytearray(target.read_bytes())
    data[data.index(b"PK\x01\x02") + at] ^= bit
    st = target.stat()
    target.write_bytes(data)
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    if src.is_file():  # the oracle: torch fails on it (or reads other bytes), in a fresh process
        oracle = (
            "import sys, torch\n"
            "a = torch.load(sys.argv[1], weights_only=False)['model']['blocks.0.fc1.weight']\n"
            "b = torch.load(sys.argv[2], weights_only=False)['model']['blocks.0.fc1.weight']\n"
            "sys.exit(0 if torch.equal(a, b) else 9)\n"
        )
        torch_run = subprocess.run([sys.executable, "-c", oracle, str(target), str(src)], capture_output=True)
        assert torch_run.returncode != 0, "torch read the damaged file as the original"
    report = verify(root if src.is_dir() else target)
    errors = [f for f in report.findings if f.severity == "error"]
    assert errors and any(target.name in (f.file or "") + f.message for f in errors), [f.message for f in report.findings]
    run = _run(["seal", str(root if src.is_dir() else target)], tmp_path)
    assert run.returncode == 3 and "Traceback" not in run.stderr, run.stderr


@pytest.mark.parametrize("where", ["torch", "rankshards"])
def test_a_view_past_its_storage_is_damage_without_deep(where, tmp_path):
    """A tensor whose storage offset reaches past its storage (a damaged pickle) passed plain verify,
    which reads no values: only export and verify --deep caught it. The view is checked against its
    storage's size (its zip header only) by verify and by seal."""
    import pickletools
    import zipfile

    import torch

    src = tmp_path / "src.pt"
    torch.save({"w": torch.arange(6.0), "step": 1}, src)
    out = tmp_path / ("a.pt" if where == "torch" else "ck/shard_00000.pt")
    out.parent.mkdir(exist_ok=True)
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(out, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename.endswith("data.pkl"):
                ops = list(pickletools.genops(data))
                at = next(pos for (op, _, pos), (nop, arg, _) in zip(ops, ops[1:]) if op.name == "BINPERSID")
                assert data[at + 1 : at + 3] == b"K\x00"  # (the storage offset, 0)
                data = data[: at + 1] + b"Kd" + data[at + 3 :]  # (100)
            zout.writestr(info.filename, data)
    target = out if where == "torch" else out.parent
    r = run_cli("verify", target)
    assert r.code == 1 and "corrupt-file" in r.stdout and "tensor needs 424 bytes of storage 0 which holds 24" in r.stdout
    r = run_cli("seal", target, "--out", tmp_path / "seal.json")
    assert r.code == 3 and "tensor needs 424 bytes" in r.stderr and not (tmp_path / "seal.json").exists()
