"""ckpttool writes ``torch.save`` archives and DCP ``.metadata`` without torch: the bytes must be
the ones torch writes for the same content (torch itself is the oracle here)."""

from __future__ import annotations

import collections
import importlib.util
import io
import pickle
import random
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

import ckpttool.formats.dcp_write as dcp_write
from ckpttool import _torchzip, registry
from ckpttool._zipwrite import NameOrder, ZipWriter, hash_combine, std_hash
from ckpttool.formats import _ptwrite
from ckpttool.geometry import Box
from ckpttool.io import RandomAccessFile

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def _torch_bytes(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _trees() -> list[object]:
    shared = torch.arange(6, dtype=torch.int64)
    return [
        1,
        torch.arange(10.0),
        torch.zeros(0),
        {f"t{i}": torch.full((i % 7,), float(i)) for i in range(50)},  # empty records among them
        [torch.ones(3, dtype=torch.bfloat16), shared, shared],
        {f"w{i}": torch.full((3,), float(i)) for i in range(2000)},  # rehashes of the name set
        # data that starts with the data descriptor's signature: torch folds its bytes 4..8 into the id
        {"a": torch.tensor([0x08074B50, 5, 6], dtype=torch.int32)},
    ]


@pytest.mark.parametrize("tree", _trees(), ids=lambda t: type(t).__name__)
def test_zip_writer_equals_torch_save(tree: object) -> None:
    """Every record of a torch.save file written again by ZipWriter: the same file, serialization
    id included (libstdc++'s string hash in unordered_set order, the CRC-32s combined)."""
    ref = _torch_bytes(tree)
    out = io.BytesIO()
    zf = ZipWriter(out)
    with zipfile.ZipFile(io.BytesIO(ref)) as z:
        for info in z.infolist():
            name = info.filename.split("/", 1)[1]
            if name not in ("version", ".data/serialization_id"):
                zf.write_record(name, z.read(info.filename))
    zf.finish()
    assert out.getvalue() == ref


def test_name_hash_matches_libstdcxx() -> None:
    ctypes = pytest.importorskip("ctypes")
    try:
        lib = ctypes.CDLL("libstdc++.so.6")
        fn = lib._ZSt11_Hash_bytesPKvmm
    except (OSError, AttributeError):
        pytest.skip("no libstdc++ here")
    fn.restype = ctypes.c_uint64
    fn.argtypes = [ctypes.c_char_p, ctypes.c_uint64, ctypes.c_uint64]
    rng = random.Random(3)
    for n in range(40):
        data = bytes(rng.randrange(256) for _ in range(n))
        assert std_hash(data) == fn(data, len(data), 0xC70F6907)
    order = NameOrder()
    for name in (b"a", b"b", b"a"):
        order.add(name)
    assert order.combined() in {
        hash_combine(hash_combine(0, std_hash(b"a")), std_hash(b"b")),
        hash_combine(hash_combine(0, std_hash(b"b")), std_hash(b"a")),
    }


def test_the_crc32_is_zlibs() -> None:
    """The CRC-32 the writers and verify use (ISA-L's where installed) gives zlib's values, also
    continued from a previous value and over memoryviews and numpy arrays."""
    import zlib

    from ckpttool import _crc

    rng = np.random.default_rng(11)
    for n in (0, 1, 7, 64, 4095, 1 << 20, (1 << 20) + 17):
        data = rng.integers(0, 256, n, dtype=np.uint8)
        start = int(rng.integers(0, 1 << 32))
        assert _crc.crc32(data) == zlib.crc32(data)
        assert _crc.crc32(memoryview(data.tobytes()), start) == zlib.crc32(data, start)
    if importlib.util.find_spec("isal") is not None:
        assert _crc.crc32.__module__.startswith("isal")


def _out_tensor(t: torch.Tensor) -> _ptwrite.OutTensor:
    data = t.contiguous().view(torch.uint8).numpy().reshape(-1)

    def fill(buf: np.ndarray) -> None:
        buf[:] = data

    return _ptwrite.OutTensor(dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape), fill=fill)


def test_ptwrite_save_equals_torch_save(tmp_path: Path) -> None:
    """A tree of OutTensors (shared ones pickled once), ints, strings, None, OrderedDicts: the same
    bytes as torch.save of the real tree, into a buffer and into a named file (the archive is
    named after the file)."""
    w, b = torch.randn(3, 4), torch.ones(2, dtype=torch.bfloat16)
    real = {"w": w, "e": torch.zeros(0), "step": 7, "h": [b, 1.5, "x", None, b], "od": collections.OrderedDict(a=w)}
    ow, ob = _out_tensor(w), _out_tensor(b)
    mine = {
        "w": ow,
        "e": _out_tensor(real["e"]),  # type: ignore[arg-type]
        "step": 7,
        "h": [ob, 1.5, "x", None, ob],
        "od": collections.OrderedDict(a=ow),
    }
    buf = io.BytesIO()
    _ptwrite.save(mine, buf)
    assert buf.getvalue() == _torch_bytes(real)
    torch.save(real, tmp_path / "model_optim_rng.pt")
    (tmp_path / "mine").mkdir()
    _ptwrite.save(mine, tmp_path / "mine" / "model_optim_rng.pt")
    assert (tmp_path / "mine" / "model_optim_rng.pt").read_bytes() == (tmp_path / "model_optim_rng.pt").read_bytes()


@pytest.mark.parametrize(
    "dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64, torch.bool]
)
def test_ptwrite_dtypes_without_a_storage_class(dtype: torch.dtype) -> None:
    """float8 and unsigned dtypes have no typed-storage class: torch names the untyped storage and
    rebuilds with _rebuild_tensor_v3; so does ckpttool."""
    t = torch.arange(6, dtype=torch.int64).reshape(3, 2).to(torch.float32).to(dtype)
    buf = io.BytesIO()
    _ptwrite.save({"t": _out_tensor(t)}, buf)
    assert buf.getvalue() == _torch_bytes({"t": t})


@pytest.mark.parametrize("n", [999, 1000, 1001, 2000, 2001])
def test_ptwrite_batches_like_the_c_pickler(n: int) -> None:
    """Dicts and lists of 1000 entries and more are written in the C pickler's batches."""
    tree = [{f"k{i}": i for i in range(n)}, list(range(n))]
    buf = io.BytesIO()
    _ptwrite.save(tree, buf)
    assert buf.getvalue() == _torch_bytes(tree)


def test_dcp_records_round_trip_byte_for_byte() -> None:
    """Every record of every uncompressed DCP fixture (tensors, and bytes items holding ints,
    lists, RNG tensors), read through the restricted unpickler and written back: the same bytes."""
    count = 0
    for md in sorted(FIXTURES.glob("dcp/*/.metadata")):
        _, manifest = registry.describe(md.parent)
        for item in manifest.items.values():
            for piece in item.pieces:
                loc = piece.locator
                if "offset" not in loc or loc.get("transforms"):
                    continue
                with RandomAccessFile(md.parent / piece.file, display=piece.file) as f:
                    raw = f.read(loc["offset"], loc["length"])
                archive = _torchzip.Archive(raw, display=piece.file)
                tree = _ptwrite.carry(archive.load(), lambda archive=archive: archive)
                out = io.BytesIO()
                _ptwrite.save(tree, out)
                assert out.getvalue() == raw, (md.parent.name, item.name)
                count += 1
    assert count > 500


def _random_value(rng: random.Random, depth: int = 0) -> object:
    r = rng.random()
    if depth > 3 or r < 0.3:
        return rng.choice([None, True, False, 0, 255, 256, 65535, 65536, -1, -(2**31), 2**31, 2**70, 1.5, "x", "y" * 300])
    if r < 0.5:
        return tuple(_random_value(rng, depth + 1) for _ in range(rng.choice([0, 1, 2, 3, 4, 7])))
    if r < 0.7:
        n = rng.choice([0, 1, 2, 5, 1000, 1001]) if depth < 1 else rng.choice([0, 1, 3])
        return [_random_value(rng, depth + 1) for _ in range(n)]
    n = rng.choice([0, 1, 2, 5, 1000, 2000, 1500]) if depth < 1 else rng.choice([0, 1, 2])
    return {f"k{i}": _random_value(rng, depth + 1) for i in range(n)}


def test_pickle4_equals_the_c_pickler() -> None:
    """Opcodes, memo, batches and 64 KiB frames as CPython's C pickler writes them, on random values
    with shared objects, and on values of several frames whose boundaries fall on every kind of
    opcode (strings, memo references, atoms, tuples, containers)."""
    rng = random.Random(1)
    mixed = [
        {f"key{i}": (f"v{i}", i, None, i * 0.5, [i] if i % 3 else (), {"s": "shared"}) for i in range(2000)},
        [(i, f"s{i % 7}", -(2**40) + i) for i in range(6000)],
        {f"k{i}": [f"x{i}"] * (i % 5) for i in range(3001)},
    ]
    big = 0
    for i in range(30 + len(mixed)):
        value = mixed[i - 30] if i >= 30 else _random_value(rng)
        shared = "shared" * 3
        obj = [value, shared, shared, (shared,), value] if i % 2 else value
        ref = pickle.dumps(obj)  # the default protocol, as DCP's .metadata
        big += len(ref) > 1 << 16
        assert dcp_write._Pickle4().dumps(obj) == ref, i
    assert big >= 3


def _metadata_inputs(n: int) -> dict:
    dtypes = ["float32", "bfloat16", "int64", "bool"]
    tensors = {}
    for i in range(n):
        if i % 3:
            tensors[f"layers.{i}.w"] = (dtypes[i % 4], (128, 64), [Box((r * 32, 0), (32, 64)) for r in range(4)])
        else:
            tensors[f"layers.{i}.w"] = (dtypes[i % 4], (), [Box((), ())])
    records = {
        f"__{r}_0.distcp": [(k, v[2][r].offsets if v[1] else (), i * 100, 100) for i, (k, v) in enumerate(tensors.items()) if v[1] or r == 0]
        for r in range(4)
    }
    records["__0_0.distcp"] += [("step", None, 5, 6), ("rng", None, 7, 8)]
    keys = {**tensors, "step": None}
    keys = {**dict(list(keys.items())[:7]), "rng": None, **dict(list(keys.items())[7:])}  # objects among tensors
    return dict(keys=keys, records=records, checkpoint_id="ckpt/step_3")


@pytest.mark.parametrize("planner_data", ["flat", None])
def test_metadata_equals_torch_pickle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, planner_data: str | None) -> None:
    """The torch-free ``.metadata`` is byte for byte what pickling torch's own classes gives (and the
    torch-free pickler wrote it, not the fallback to torch's classes)."""
    inputs = _metadata_inputs(1500)
    pd = {k: (k,) for k in inputs["keys"]} if planner_data else None
    with monkeypatch.context() as m:
        m.setattr(dcp_write, "_torch_metadata", lambda *a: pytest.fail("fell back to torch's classes"))
        dcp_write.write_metadata(tmp_path / "mine", planner_data=pd, **inputs)
    monkeypatch.setattr(dcp_write, "TORCH_PICKLE_FROM", 0)
    dcp_write.write_metadata(tmp_path / "torch", planner_data=pd, **inputs)
    mine, ref = (tmp_path / "mine").read_bytes(), (tmp_path / "torch").read_bytes()
    assert len(ref) > 1 << 16  # several frames
    assert mine == ref
    assert pickle.loads(mine) == pickle.loads(ref)


def test_carry_keeps_shared_records_ordered_dicts_and_tensors_shared() -> None:
    """A source that holds one Namespace, one OrderedDict and one tensor twice (DeepSpeed's args, a
    module's _metadata) is written back as torch writes it: the second use a memo reference."""
    import argparse

    from ckpttool import _unpickle

    ns, od, t = argparse.Namespace(lr=1.0), collections.OrderedDict(a=1), torch.arange(3.0)
    ref = _torch_bytes({"a": ns, "b": ns, "c": od, "d": od, "e": t, "f": [t, ns]})
    allow = {**_unpickle.PLAIN, **_unpickle.TORCH_TENSORS, **_unpickle.NAMESPACES}
    archive = _torchzip.Archive(ref, display="t.pt", allow=allow)
    out = io.BytesIO()
    _ptwrite.save(_ptwrite.carry(archive.load(), lambda: archive), out)
    assert out.getvalue() == ref


def test_carry_now_reads_the_tensors_while_their_archive_is_open() -> None:
    """``carry(now=True)`` (a ShardedObject's grad scaler, kept after its reader closes): the tensors'
    bytes are read at once, so writing needs no archive, and carrying the tree again with another
    archive leaves it alone; shared objects stay shared, and the bytes written are torch's."""
    import argparse

    from ckpttool import _unpickle

    ns, t = argparse.Namespace(lr=1.0), torch.tensor([1024.0])
    ref = _torch_bytes({"scaler": {"scale": t, "growth_tracker": 3}, "again": t, "ns": ns, "pair": (t, ns)})
    allow = {**_unpickle.PLAIN, **_unpickle.TORCH_TENSORS, **_unpickle.NAMESPACES}
    opened = [_torchzip.Archive(ref, display="t.pt", allow=allow)]

    def archive_of() -> _torchzip.Archive:
        if not opened:
            raise AssertionError("the archive was asked for after it was closed")
        return opened[0]

    tree = _ptwrite.carry(opened[0].load(), archive_of, now=True)
    opened.clear()
    other = _torchzip.Archive(_torch_bytes({"x": torch.tensor([7.0])}), display="other.pt")
    again = _ptwrite.carry(tree, lambda: other)
    assert again["scaler"]["scale"] is tree["scaler"]["scale"] is tree["again"] is tree["pair"][0]
    out = io.BytesIO()
    _ptwrite.save(again, out)
    assert out.getvalue() == ref


def test_tensor_span_refuses_a_view_past_its_storage() -> None:
    """A pickle whose tensor reaches past the end of its storage (a forged storage_offset) gets no
    raw span: a partial read would otherwise read the bytes of the next record."""
    ref_bytes = _torch_bytes(torch.arange(8.0))
    archive = _torchzip.Archive(ref_bytes, display="t.pt")
    ref = archive.load()
    assert _torchzip.tensor_span(archive, ref) is not None
    ref.storage_offset = 1
    assert _torchzip.tensor_span(archive, ref) is None


def test_a_streamed_tensor_is_written_part_by_part_with_the_same_bytes(tmp_path):
    """``_ptwrite.streamed``: written through ``ZipWriter.write_record_parts`` one part at a time
    (zeros for the gaps), the file equals the one written from the whole tensor filled at once by
    the same object's ``fill``; and torch reads the values back."""
    import numpy as np
    import torch

    from ckpttool.formats import _ptwrite

    values = np.arange(10, dtype=np.float32)

    def part(lo: int, hi: int):
        def fill(buf):
            buf.view(np.float32)[:] = values[lo:hi]

        return fill

    def parts():
        yield 12, part(0, 3)
        yield 8, None
        yield 20, part(5, 10)

    streamed = _ptwrite.streamed("float32", (10,), parts)
    whole = _ptwrite.OutTensor(dtype="float32", shape=(10,), fill=streamed.fill)
    assert streamed.peak == 20 and whole.peak == 40
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _ptwrite.save({"t": streamed}, tmp_path / "a" / "x.pt")  # torch names the archive after the file
    _ptwrite.save({"t": whole}, tmp_path / "b" / "x.pt")
    assert (tmp_path / "a" / "x.pt").read_bytes() == (tmp_path / "b" / "x.pt").read_bytes()
    want = values.copy()
    want[3:5] = 0
    assert torch.equal(torch.load(tmp_path / "a" / "x.pt", weights_only=True)["t"], torch.from_numpy(want))


def test_a_record_given_in_parts_must_add_up(tmp_path):
    import io

    from ckpttool._zipwrite import ZipWriter

    zf = ZipWriter(io.BytesIO())
    with pytest.raises(ValueError, match="3 bytes given, 4 announced"):
        zf.write_record_parts("x", 4, iter([b"ab", b"c"]))
    with pytest.raises(ValueError, match="5 bytes given, 4 announced"):
        zf.write_record_parts("y", 4, iter([b"abc", b"de"]))


def test_big_records_are_the_bytes_torch_writes(tmp_path, monkeypatch):
    """Records from 1 MiB on have their CRC-32 computed on a helper thread while they are written,
    in 32 MiB chunks, the disk's write-back started after each: the file is still torch's, byte for
    byte, and the write-back was asked for once per chunk."""
    import ckpttool._zipwrite as zw

    started: list[int] = []
    monkeypatch.setattr(zw, "start_writeback", lambda fh: started.append(fh.tell()))
    rng = np.random.default_rng(5)
    tree = {
        "big": torch.from_numpy(rng.standard_normal((70 << 20) // 4).astype(np.float32)),  # three chunks
        "mid": torch.from_numpy(rng.integers(0, 255, (1 << 20) + 3, dtype=np.uint8)),
        "small": torch.arange(100, dtype=torch.int16),
    }

    def out(v: torch.Tensor) -> _ptwrite.OutTensor:
        def fill(buf: np.ndarray) -> None:
            buf.reshape(-1).view(np.uint8)[:] = v.numpy().reshape(-1).view(np.uint8)

        return _ptwrite.OutTensor(str(v.dtype).removeprefix("torch."), tuple(v.shape), fill)

    _ptwrite.save({k: out(v) for k, v in tree.items()}, tmp_path / "x.pt")
    assert len(started) == 4  # three chunks of the big record, one of the 1 MiB one
    (tmp_path / "t").mkdir()
    torch.save(tree, tmp_path / "t" / "x.pt")  # the archive is named after the file
    assert (tmp_path / "x.pt").read_bytes() == (tmp_path / "t" / "x.pt").read_bytes()


def test_a_big_carried_tensor_is_copied_a_part_at_a_time(tmp_path: Path) -> None:
    """A carried tensor over CARRY_PART (a ZeRO flat partition) is copied from its source record in
    parts, holding one part at a time: the file is torch's, from a file and from bytes; a forged
    storage_offset that reaches past the storage is named as damage, not read from the next record."""
    from ckpttool import _unpickle
    from ckpttool.errors import CorruptFileError

    big = torch.from_numpy(np.random.default_rng(1).standard_normal((80 << 20) // 4).astype(np.float32))
    tree = {"flat": big, "small": torch.arange(4.0)}
    (tmp_path / "src").mkdir()
    torch.save(tree, tmp_path / "src" / "x.pt")
    raw = (tmp_path / "src" / "x.pt").read_bytes()
    with RandomAccessFile(tmp_path / "src" / "x.pt") as f:
        for source in (f, raw):
            archive = _torchzip.Archive(source, display="x.pt")
            carried = _ptwrite.carry(archive.load(), lambda a=archive: a)
            assert carried["flat"].peak == _ptwrite.CARRY_PART  # a part at a time, not the whole 80 MiB
            assert carried["small"].parts is None
            _ptwrite.save(carried, tmp_path / "x.pt")
            assert (tmp_path / "x.pt").read_bytes() == raw
    archive = _torchzip.Archive(raw, display="x.pt")
    loaded = archive.load()
    loaded["flat"].storage_offset = 10  # 10 elements past the end of the storage
    assert isinstance(loaded["flat"], _unpickle.TensorRef)
    with pytest.raises(CorruptFileError, match="needs .* bytes of storage"):
        _ptwrite.save(_ptwrite.carry(loaded, lambda: archive), io.BytesIO())


@pytest.mark.parametrize("chunked", [False, True])
def test_span_digests_are_those_of_the_bytes(chunked: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Into a HashingFile, a record's span digests (unordered, repeated, crossing the parts and the
    helper thread's chunks) are the xxh3-128 of those bytes; without spans, the whole data's."""
    import xxhash

    import ckpttool._zipwrite as zw
    from ckpttool.hashing import HashingFile

    if chunked:  # every part through the helper thread, in 7-byte chunks
        monkeypatch.setattr(zw, "PARALLEL", 1)
        monkeypatch.setattr(zw, "WRITE_CHUNK", 7)
    data = bytes(range(256)) * 4
    spans = ((100, 50), (0, 10), (100, 50), (10, 0), (900, 124), (0, 300), (20, 30))  # the last two overlap
    buf = io.BytesIO()
    out = HashingFile(buf)
    zf = ZipWriter(out)
    zf.write_record_parts("data/0", len(data), iter([data[:333], data[333:334], data[334:]]), spans)
    at = next(lo for (lo, n) in out.spans if n == 10)  # where the data starts in the file
    want = {(at + lo, n): xxhash.xxh3_128(data[lo : lo + n]).hexdigest() for lo, n in spans if n}
    assert out.spans == want
    zf.write_record("data/1", data[:40])
    whole = {k: v for k, v in out.spans.items() if k not in want}
    assert list(whole.values()) == [xxhash.xxh3_128(data[:40]).hexdigest()] and next(iter(whole))[1] == 40
    written = buf.getvalue()  # the offsets are the file's: each digest is that of the bytes there
    assert all(xxhash.xxh3_128(written[o : o + n]).hexdigest() == d for (o, n), d in out.spans.items())
