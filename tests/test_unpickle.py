"""The restricted unpickler: plain values load, every other global is refused unexecuted."""

from __future__ import annotations

import io
import os
import pickle
import random
import re
import struct
import subprocess
from collections import OrderedDict

import pytest

from ckpttool import _torchzip, _unpickle
from ckpttool.errors import CorruptFileError, UnsafePickleError


class Evil:
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


def _loads(data: bytes):
    return _unpickle.loads(data, allow=_unpickle.PLAIN, source="x.pkl")


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_plain_values_round_trip(protocol):
    value = {
        "int": 3,
        "float": 1.5,
        "str": "s",
        "bytes": b"\x00\xff",
        "empty": b"",
        "none": None,
        "list": [1, (2, 3)],
        "set": {1, 2},
        "fs": frozenset({4}),
        "od": OrderedDict(a=1),
        "c": 1 + 2j,
        "ba": bytearray(b"xy"),
        "rng": random.getstate(),
    }
    got = _loads(pickle.dumps(value, protocol=protocol))
    assert got == {**value, "od": {"a": 1}}


@pytest.mark.parametrize(
    ("fn", "args", "name"),
    [
        (os.system, ("touch PWNED",), "posix.system"),
        (subprocess.call, (["touch", "PWNED"],), "subprocess.call"),
        (eval, ("1+1",), "builtins.eval"),
        (__import__, ("os",), "builtins.__import__"),
    ],
)
def test_code_execution_is_refused_with_the_global_named(fn, args, name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for protocol in (2, 4):
        data = pickle.dumps({"ok": 1, "bad": Evil(fn, *args)}, protocol=protocol)
        with pytest.raises(UnsafePickleError) as err:
            _loads(data)
        if protocol == 4:  # protocol 2 spells some modules the Python 2 way (commands.call)
            assert err.value.global_name == name
            assert name in str(err.value)
    assert not (tmp_path / "PWNED").exists()


def test_inst_and_obj_opcodes_go_through_the_allowlist():
    # protocol 0 INST opcode: "i" module\nname\n
    data = b"(S'touch PWNED'\nios\nsystem\n."
    with pytest.raises(UnsafePickleError, match="os.system"):
        _loads(data)


def test_module_spelling_matters():
    # allowlisted as collections.OrderedDict; the same class under another module is refused
    data = b"\x80\x02ccollections.abc\nOrderedDict\n)R."
    with pytest.raises(UnsafePickleError, match="collections.abc.OrderedDict"):
        _loads(data)


def test_garbage_is_a_corrupt_file_not_a_crash():
    with pytest.raises(CorruptFileError, match="x.pkl"):
        _loads(b"\x80\x04not a pickle")
    with pytest.raises(CorruptFileError):
        _loads(pickle.dumps(list(range(100)))[:-20])


def test_torch_save_archive_without_torch_matches_torch():
    torch = pytest.importorskip("torch")
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    obj = {
        "w": t,
        "wt": t.t(),
        "view": t[1:3],
        "bf": t.to(torch.bfloat16),
        "u16": t.to(torch.uint16),
        "p": torch.nn.Parameter(torch.ones(2)),
        "step": 7,
    }
    buf = io.BytesIO()
    torch.save(obj, buf)
    archive = _torchzip.Archive(buf.getvalue(), display="mem")
    loaded = archive.load()
    assert loaded["step"] == 7
    for key in ("w", "wt", "view", "bf", "u16", "p"):
        ref = loaded[key]
        arr = _torchzip.read_tensor(archive, ref)
        expected = obj[key].detach()
        assert ref.dtype == str(expected.dtype).removeprefix("torch.")
        assert tuple(arr.shape) == tuple(expected.shape)
        assert arr.tobytes() == expected.contiguous().view(torch.uint8).numpy().tobytes()
    assert loaded["p"].is_parameter


def test_tensor_subclass_is_refused():
    torch = pytest.importorskip("torch")
    from tests._subclass import MyTensor

    buf = io.BytesIO()
    torch.save({"x": torch.ones(2).as_subclass(MyTensor)}, buf)
    with pytest.raises(UnsafePickleError, match="MyTensor"):
        _torchzip.Archive(buf.getvalue(), display="mem").load()


def test_fast_central_directory_matches_zipfile():
    import zipfile

    from tests.conftest import FIXTURES

    files = sorted(FIXTURES.rglob("*.pt"))[:40]
    assert files
    for path in files:
        data = path.read_bytes()
        fast = _torchzip._central_directory(lambda off, n, d=data: d[off : off + n], len(data))
        assert fast is not None, path
        with zipfile.ZipFile(path) as zf:
            slow = {i.filename: (i.header_offset, i.file_size, i.compress_size, i.CRC) for i in zf.infolist()}
        assert {k: (m.header_offset, m.file_size, m.compress_size, m.CRC) for k, m in fast.items()} == slow


def _damaged_zip_index(data: bytearray, how: str) -> None:
    """Damage a torch.save archive's zip index in place, the way a flipped bit would."""
    import struct

    eocd64 = struct.unpack_from("<Q", data, len(data) - 22 - 20 + 8)[0]  # (from the zip64 locator)
    cd = struct.unpack_from("<Q", data, eocd64 + 48)[0]
    if how == "zip64 directory offset":
        data[eocd64 + 48] ^= 0xFF
    elif how == "stored sizes":
        data[cd + 22] ^= 0xFF  # data.pkl's compressed size, high byte
    else:  # data.pkl's local-header offset, moved onto the next member's header
        name_len = struct.unpack_from("<H", data, cd + 28)[0]
        local = struct.unpack_from("<L", data, cd + 42)[0]
        size = struct.unpack_from("<L", data, cd + 24)[0]
        nxt = data.index(b"PK\x03\x04", local + 30 + name_len + size)
        struct.pack_into("<L", data, cd + 42, nxt)


@pytest.mark.parametrize("how", ["zip64 directory offset", "stored sizes", "local header"])
def test_a_damaged_zip_index_is_refused_as_torch_refuses_it(how):
    """zipfile reads past damage to a zip's index that torch's reader (miniz) fails on: a zip64 end
    record that disagrees with the plain one (miniz goes by the zip64 one, ckpttool went by the
    other), a stored member whose two sizes differ, a directory entry pointing at another member's
    local header. verify and seal passed such files; torch.load fails on each."""
    torch = pytest.importorskip("torch")
    buf = io.BytesIO()
    torch.save({"x": torch.arange(3)}, buf)
    data = bytearray(buf.getvalue())
    _damaged_zip_index(data, how)
    with pytest.raises(Exception):  # noqa: B017 - the oracle: torch's own reader fails
        torch.load(io.BytesIO(bytes(data)), weights_only=True)
    with pytest.raises(CorruptFileError, match="zip index"):
        _torchzip.Archive(bytes(data), display="mem").load()


def test_zip_with_a_comment_falls_back_to_zipfile():
    torch = pytest.importorskip("torch")
    buf = io.BytesIO()
    torch.save({"x": torch.arange(3)}, buf)
    data = bytearray(buf.getvalue())
    data[-2:] = (4).to_bytes(2, "little")  # comment length 4
    data += b"note"
    assert _torchzip._central_directory(lambda off, n: bytes(data[off : off + n]), len(data)) is None
    archive = _torchzip.Archive(bytes(data), display="mem")
    assert archive.load()["x"].shape == (3,)


def test_unwalkable_trees_are_refused_before_anything_walks_them():
    cycle: list = []
    cycle.append(cycle)
    laughs: list = [1]
    for _ in range(70):
        laughs = [laughs, laughs]
    deep: list = []
    for _ in range(_unpickle.MAX_DEPTH + 5):
        deep = [deep]
    for obj, words in ((cycle, "cycle"), (laughs, "expands to more than"), (deep, "levels deep")):
        with pytest.raises(CorruptFileError, match=words):
            _unpickle.loads(pickle.dumps(obj, protocol=2), allow=_unpickle.PLAIN, source="f.pt")
    shared = [1, 2]
    ok = {"a": [shared, shared, {"b": (shared,)}], "c": [[[]]]}
    assert _unpickle.loads(pickle.dumps(ok, protocol=2), allow=_unpickle.PLAIN, source="f.pt") == ok


@pytest.mark.parametrize("protocol", [0, 1, 2, 3, 4, 5])
def test_memo_index_bombs_are_found_by_walking_the_opcodes(protocol):
    import pickletools

    # a real pickle full of text that looks like a huge LONG_BINPUT index ('r' and four letters)
    words = {f"torch.storage.{i}": ["layers", b"rrrrr" * 9, 1.5, i, None] for i in range(300)}
    data = pickle.dumps(words, protocol=protocol)
    assert not _unpickle._opcode_problem(data)
    assert _loads(data) == words
    # the same with one memo index pushed past the pickle's length, in the opcode the protocol uses
    ops = list(pickletools.genops(data))
    op, _arg, pos = next(o for o in ops if o[0].name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"))
    if op.name == "MEMOIZE":  # protocol 4+: put one explicit LONG_BINPUT in its place
        bomb = data[:pos] + b"r" + (2**31 - 1).to_bytes(4, "little") + data[pos + 1 :]
    elif op.name == "PUT":
        end = data.index(b"\n", pos)
        bomb = data[:pos] + b"p9999999999" + data[end:]
    else:
        width = 1 if op.name == "BINPUT" else 4
        bomb = data[:pos] + b"r" + (2**31 - 1).to_bytes(4, "little") + data[pos + 1 + width :]
    assert _unpickle._opcode_problem(bomb)
    with pytest.raises(CorruptFileError, match="memo index far beyond"):
        _loads(bomb)
    # torn inside the index: not a bomb, but cut short
    index_end = pos + (len(b"p9999999999\n") if op.name == "PUT" else 5)
    for cut in range(pos + 1, index_end):
        assert "cut short" in (_unpickle._opcode_problem(bomb[:cut]) or ""), cut
        with pytest.raises(CorruptFileError, match="cut short"):
            _loads(bomb[:cut])
    # cut anywhere after the index: still a bomb, refused before the unpickler sees it
    for cut in range(index_end, len(bomb), max(1, len(bomb) // 97)):
        assert _unpickle._opcode_problem(bomb[:cut]), cut
        with pytest.raises(CorruptFileError, match="memo index far beyond"):
            _loads(bomb[:cut])


@pytest.mark.parametrize("opcode", [b"\x96", b"\x8e", b"\x8d", b"T", b"B"])  # BYTEARRAY8, BINBYTES8, BINUNICODE8, …
def test_a_length_past_the_end_of_the_pickle_is_refused_before_the_unpickler_allocates_it(opcode):
    """One flipped bit turned a DCP .metadata's MEMOIZE into BYTEARRAY8, whose next eight bytes
    then claimed terabytes: CPython allocates the length it is told before reading, and verify
    printed a SystemError traceback beside its finding. A string, bytes or bytearray longer than
    what is left of the pickle is damage, said without unpickling."""
    width = 8 if opcode in (b"\x96", b"\x8e", b"\x8d") else 4
    data = b"\x80\x04" + opcode + (1 << 30).to_bytes(width, "little") + b"x" * 20 + b"."
    assert "past its end" in (_unpickle._opcode_problem(data) or "")
    with pytest.raises(CorruptFileError, match="past its end"):
        _loads(data)
    ok = b"\x80\x04" + opcode + (3).to_bytes(width, "little") + b"abc."
    assert _unpickle._opcode_problem(ok) is None


def test_memo_index_bombs_are_found_in_large_pickles_too():
    # a DCP .metadata can be tens of MB: the walk has no size cut-off (one used to skip pickles over
    # 4 MB), and runs of fixed-size opcodes are skipped in one step
    import pickletools

    big = {f"model.layers.{i}.weight": [(i, i + 1), (0, 64), "__0_0.distcp", i * 4096, 1.5] for i in range(120_000)}
    data = pickle.dumps(big, protocol=4)
    assert len(data) > 6 << 20
    assert not _unpickle._opcode_problem(data)
    pos = [pos for op, _arg, pos in pickletools.genops(data) if op.name == "MEMOIZE"][-3]
    bomb = data[:pos] + b"r" + (2**31 - 1).to_bytes(4, "little") + data[pos + 1 :]
    assert _unpickle._opcode_problem(bomb)
    with pytest.raises(CorruptFileError, match="memo index far beyond"):
        _loads(bomb)
    # the same index spelled as text (PUT) deep in a protocol-0 pickle
    text = pickle.dumps(big, protocol=0)
    put = text.rindex(b"\np", 0, len(text) - 100) + 1
    end = text.index(b"\n", put)
    assert _unpickle._opcode_problem(text[:put] + b"p9999999999" + text[end:])


@pytest.mark.parametrize("index", [b"1000000", b" 1000000", b"+1000000", b"1_000_000", b"99999999999999"])
def test_a_text_memo_index_is_read_as_the_unpickler_reads_it(index):
    # the C unpickler parses PUT's argument as int() does: spaces, a sign and underscores are allowed
    bomb = b"Np" + index + b"\n."
    assert _unpickle._opcode_problem(bomb)
    with pytest.raises(CorruptFileError, match="memo index far beyond"):
        _loads(bomb)
    assert not _unpickle._opcode_problem(b"Np0\n.") and _loads(b"Np0\n.") is None


def test_a_pickle_of_countless_tiny_strings_is_refused_not_walked_for_minutes(monkeypatch):
    # the walk steps through strings one by one (the unpickler is ten times faster at them); past
    # MAX_WALK_STEPS the pickle is refused, so a 1 GB pickle of empty strings cannot take minutes
    tiny = pickle.dumps([str(i) for i in range(2000)], protocol=4)
    monkeypatch.setattr(_unpickle, "MAX_WALK_STEPS", 1000)
    with pytest.raises(CorruptFileError, match="holds more than 1,000 strings"):
        _loads(tiny)
    assert _loads(pickle.dumps([str(i) for i in range(500)], protocol=4)) == [str(i) for i in range(500)]


@pytest.mark.parametrize("protocol", [0, 1, 2, 4, 5])
def test_nested_pickles_are_judged_from_their_opcodes(protocol):
    torch = pytest.importorskip("torch")

    fp8_meta = {"scale_fwd": torch.ones(3), "amax_history": [torch.zeros(2, 2)], "recipe": None}
    assert _unpickle.nested_refusal(pickle.dumps(fp8_meta, protocol=protocol)) is None  # what TE stores
    evil = pickle.dumps({"x": Evil(os.system, "true")}, protocol=protocol)
    assert _unpickle.nested_refusal(evil) == "posix.system"  # protocols 0 and 1 have no header byte
    assert _unpickle.nested_refusal(b"\x80\x04\x95garbage") == "<unreadable>"
    assert _unpickle.nested_refusal(b"not a pickle") is None  # opaque bytes: nothing to load
    assert _unpickle.nested_refusal(bytes(range(256))) is None


def test_shared_containers_are_counted_wherever_they_appear(monkeypatch):
    """The tree check remembers only shared containers, yet counts each wherever it appears: the
    limit falls exactly where the expanded tree passes it."""
    shared = list(range(10))
    tree = [shared, [shared, shared], list(range(5))]  # root 1 + its 3 + 2 + 3 * 10 + 5: 41 values
    monkeypatch.setattr(_unpickle, "MAX_NODES", 41)
    assert _unpickle._shape_problem(tree) is None
    monkeypatch.setattr(_unpickle, "MAX_NODES", 40)
    assert "expands to more than 40" in (_unpickle._shape_problem(tree) or "")
    cyclic: list = [shared]
    cyclic.append([cyclic, cyclic])
    assert "cycle" in (_unpickle._shape_problem(cyclic) or "")


def test_fields_keep_their_slots_and_empty_the_pickled_state():
    class Info(_unpickle.Fields):
        __slots__ = ("path", "length")

    a, state = Info.__new__(Info), {"path": "f", "length": 4, "other": [1]}
    a.__setstate__(state)
    assert (a.path, a.length) == ("f", 4) and state == {}  # emptied: the memo holds it to the end
    b = Info.__new__(Info)
    b.__setstate__((None, {"path": "g"}))  # the (dict, slots) form of a slotted class
    assert b.path == "g" and not hasattr(b, "length")
    with pytest.raises(pickle.UnpicklingError):
        Info.__new__(Info).__setstate__([1, 2])


def test_the_globals_that_run_code_are_told_from_a_runs_own_class():
    """A Trainer file or a DCP bytes item naming a class of the run's own is a warning; one naming a
    global that runs code is an error, whichever global the reader refused first."""
    from ckpttool._unpickle import hostile, runs_code

    for name in ("posix.system", "os.system", "subprocess.Popen", "builtins.eval", "builtins.getattr",
                 "operator.attrgetter", "pydoc.pipepager", "torch.hub.load", "torch.jit.load", "runpy.run_path"):  # fmt: skip
        assert runs_code(name), name
    for name in ("argparse.Namespace", "collections.OrderedDict", "torch._utils._rebuild_tensor_v2",
                 "numpy.core.multiarray._reconstruct", "mylib.Scheduler", "builtins.set", "torch.hubble.Thing"):  # fmt: skip
        assert not runs_code(name), name
    assert hostile(["mylib.Plain", "collections.OrderedDict", "posix.system"]) == "posix.system"
    assert hostile(["mylib.Plain", "<computed>"]) == "<computed>"
    assert hostile(["mylib.Plain", "argparse.Namespace"]) is None


# -- pickles that hang the unpickler: hashing, and what our stand-ins do with their arguments --------

_HANG_SCRIPT = r"""
import pickle, sys, time
from ckpttool import _unpickle
from ckpttool.errors import CorruptFileError, UnsafePickleError
data = sys.stdin.buffer.read()
allow = {**_unpickle.PLAIN, **_unpickle.TORCH_TENSORS, **_unpickle.NAMESPACES, **_unpickle.BYTES_IO}
if sys.argv[1] == "dcp":
    from ckpttool.formats import dcp
    allow = dcp.METADATA_ALLOWLIST
elif sys.argv[1] == "numpy":
    allow = {**_unpickle.PLAIN, **_unpickle.numpy_arrays()}
persistent = _unpickle.storage_persistent_load if sys.argv[2] == "persistent" else None
t = time.perf_counter()
try:
    _unpickle.loads(data, allow=allow, source="f.pkl", persistent_load=persistent)
    print("LOADED")
except (CorruptFileError, UnsafePickleError) as exc:
    print(f"REFUSED {time.perf_counter() - t:.2f} {exc}")
"""


def _refused_in_time(data: bytes, allow: str = "plain", persistent: bool = False) -> str:
    """What a load of ``data`` says, from a child process killed if it takes a minute (the pickles
    here hung the process, Ctrl-C and SIGTERM included, before they were checked)."""
    import sys

    args = [sys.executable, "-c", _HANG_SCRIPT, allow, "persistent" if persistent else "-"]
    done = subprocess.run(args, input=data, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    out = done.stdout.decode().strip()
    assert out.startswith("REFUSED"), out
    return out


def _dag(levels: int, proto: int = 2) -> bytes:
    """Opcodes leaving on the stack t(levels), where t(0) = () and t(k+1) = (t(k), t(k)) through
    memo entry 0: 2**levels tuples to hash, in six bytes a level."""
    if proto == 0:
        return b"(tp0\n0" + b"(g0\ng0\ntp0\n0" * levels + b"g0\n"
    return b")q\x000" + b"h\x00h\x00\x86q\x000" * levels + b"h\x00"


_DEEP = 100
_HASHED_BOMBS = {
    # the unpickler hashes a dict key: SETITEMS, SETITEM, DICT
    "setitems": b"\x80\x02}(" + _dag(_DEEP) + b"K\x01u.",
    "setitem": b"\x80\x02}" + _dag(_DEEP) + b"K\x01s.",
    "dict (protocol 0)": b"(" + _dag(_DEEP, 0) + b"I1\nd.",
    # a set member: FROZENSET, ADDITEMS
    "frozenset": b"\x80\x04(" + _dag(_DEEP) + b"\x91.",
    "additems": b"\x80\x04\x8f(" + _dag(_DEEP) + b"\x90.",
    # the same tuple made by DUP instead of the memo
    "dup": b"\x80\x02}()" + b"2\x86" * _DEEP + b"K\x01u.",
    # a million-member key is fine once; twenty times over, its hashing is what the DAG's was
    "one key hashed often": b"\x80\x02}q\x01" + _dag(20) + b"q\x02" + b"h\x01h\x02K\x01s0" * 20 + b".",
    # Python's own hashing of a call's arguments: set([...]), frozenset([...]), OrderedDict([[k, v]])
    "set()": b"\x80\x02c__builtin__\nset\n]" + _dag(_DEEP) + b"a\x85R.",
    "frozenset()": b"\x80\x02c__builtin__\nfrozenset\n]" + _dag(_DEEP) + b"a\x85R.",
    "OrderedDict pairs": b"\x80\x02ccollections\nOrderedDict\n]](" + _dag(_DEEP) + b"K\x01ea\x85R.",
    # a record's state set twice: its keys hashed again by Python
    "record state again": b"\x80\x02cargparse\nNamespace\n)\x81}(" + _dag(_DEEP) + b"K\x01u\x94N\x86b.",
    # a text memo index the unpickler reads to its first NUL (it parses a C string): the walk did not
    "NUL in a text GET": b"\x80\x02})p0\ng0\x00\n00" + _dag(_DEEP)[4:] + b"Ns.",
    # an int's hash is not cached either: a 1 MB number as a key a hundred times over
    "one large number hashed often": b"\x80\x04}q\x01\x8b" + (1 << 20).to_bytes(4, "little") + b"\x07" * (1 << 20)
    + b"q\x020" + b"h\x01h\x02Ns0" * 100 + b".",
}


@pytest.mark.parametrize("name", list(_HASHED_BOMBS))
def test_a_key_that_takes_forever_to_hash_is_refused_before_it_is_hashed(name):
    """CPython does not cache a tuple's hash, and hashes a dict key or set member in C holding the
    GIL: ``t(k+1) = (t(k), t(k))`` through the memo is 2**100 tuples in 600 bytes, and the process
    hung for good (SIGTERM and Ctrl-C wait for the GIL). The walk over the opcodes charges what each
    hashing visits before the unpickler runs; Python's own hashing is charged where it happens."""
    out = _refused_in_time(_HASHED_BOMBS[name])
    assert "would take more than 10,000,000 steps to hash" in out, out
    assert float(out.split()[1]) < 20, out  # (seconds: the walk or the charge, never the hashing)


def test_what_else_makes_the_unpickler_or_a_stand_in_run_for_minutes_is_refused():
    """A helper's review of the walk found these (each took 12 s to minutes, or gigabytes, before)."""
    P = (1 << 61) - 1  # ints this far apart share a hash: a dict of k of them costs k**2/2 comparisons

    def long1(v: int) -> bytes:
        raw = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
        return b"\x8a" + bytes([len(raw)]) + raw

    colliding = b"\x80\x04}(" + b"".join(long1(1 + i * P) + b"N" for i in range(2000)) + b"u."
    assert "share a hash" in _refused_in_time(colliding)
    # complex numbers share a hash as easily (hash(a + bj) = hash(a) + 1000003 * hash(b)): 30 000 took 5.6 s
    pairs = [(float(5_000_000_000 - 1000003 * b), float(b)) for b in range(100_000)]
    assert len({hash(complex(*p)) for p in pairs}) == 1
    made = b"".join(b"h\x00G" + struct.pack(">d", a) + b"G" + struct.pack(">d", b) + b"\x86RN" for a, b in pairs)
    assert "complex numbers that share a hash" in _refused_in_time(b"\x80\x02c__builtin__\ncomplex\nq\x00}(" + made + b"u.")
    scalar = b"\x80\x04cnumpy._core.multiarray\nscalar\nq\x00cnumpy\ndtype\nX\x03\x00\x00\x00c16\x85Rq\x01}("
    made = b"".join(b"h\x00h\x01C\x10" + struct.pack("<dd", a, b) + b"\x86RN" for a, b in pairs)
    assert "complex numbers that share a hash" in _refused_in_time(scalar + made + b"u.", "numpy")  # (numpy's)
    nans = b"\x80\x02c__builtin__\ncomplex\nq\x00G\x7f\xf8" + bytes(6) + b"q\x01(" + b"h\x00h\x01\x85R" * 5000 + b"l."
    assert len(_unpickle.loads(nans, allow=_unpickle.PLAIN, source="f")) == 5000  # (NaNs collide with nothing)
    few = {complex(*p): None for p in pairs[:900]} | {complex(i, -i): i for i in range(5000)}
    assert _unpickle.loads(pickle.dumps(few, 2), allow=_unpickle.PLAIN, source="f") == few
    assert _unpickle._opcode_problem(pickle.dumps({1 + i * 7: None for i in range(5000)} | {2**100: 1})) is None
    # OrderedDict([p] * n): dict() takes the key of any two-item iterable, a dict's first key too
    odict = b"\x80\x02ccollections\nOrderedDict\n]}(" + _dag(8) + b"NK\x00Nua\x85R."
    assert "[key, value] pairs" in _refused_in_time(odict)
    # set(list) called again and again through the memo: 1.2 GB from 500 KB
    items = b"".join(b"J" + i.to_bytes(4, "little") for i in range(100_000))
    sets = b"\x80\x04c__builtin__\nset\nq\x01](" + items + b"e\x85q\x03](" + b"h\x01h\x03R" * 300 + b"e."
    assert "more copies" in _refused_in_time(sets)
    # a big dict given again and again to OrderedDict(d), or as a state set again: copied each time
    keys = b"".join(b"\x8c" + bytes([len(k)]) + k + b"N" for k in (b"%x" % i for i in range(50_000)))
    odicts = b"\x80\x02ccollections\nOrderedDict\nq\x00}(" + keys + b"u\x85q\x010" + b"h\x00h\x01R0" * 2000 + b"N."
    assert "more copies" in _refused_in_time(odicts)
    states = b"\x80\x02ccollections\nOrderedDict\nq\x00}(" + keys + b"uq\x010](" + b"h\x00)Rh\x01b" * 600 + b"e."
    assert "more copies" in _refused_in_time(states)
    # torch.device(s, s, ...) and a path of a 1 MiB string repeated: joined, 1.5 GB
    big = b"\x8d" + (1 << 20).to_bytes(8, "little") + b"a" * (1 << 20) + b"q\x00"
    _refused_in_time(b"\x80\x04ctorch\ndevice\n(" + big + b"h\x00" * 1500 + b"tR.")
    _refused_in_time(b"\x80\x04cpathlib\nPosixPath\n(" + big + b"h\x00" * 1500 + b"tR.", "dcp")
    # a shape of 200 000 dimensions of 2**48: math.prod of it took 48 s
    dims = b"\x80\x02cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\n\x8a\x07" + (2**48).to_bytes(7, "little")
    dims += b"q\x000(" + b"h\x00" * 200_000 + b"tC\x01b\x87R."
    assert "shape" in _refused_in_time(dims, "numpy")
    assert _unpickle.pathlib_path("/", "tmp", "x") == "/tmp/x"  # (PosixPath('/tmp/x') pickles its parts)
    assert "bits" in _unpickle.brief(10**5000)


def test_the_hashing_a_walk_charges_is_what_the_unpickler_does(monkeypatch):
    """Dicts keyed by tuples that share parts, sets and frozensets of them, in every protocol: the
    walk's charge is exactly the tuple members the unpickler hashes beyond one per key or member,
    counted here from what it built (a shared dict counted once: it is filled once)."""
    rng = random.Random(7)

    def excess(v):
        return sum(1 + excess(m) for m in v) if type(v) is tuple else 0

    def expected(obj, seen):
        if id(obj) in seen or not isinstance(obj, dict | list | tuple | set | frozenset):
            return 0
        seen.add(id(obj))
        members = list(obj) + (list(obj.values()) if isinstance(obj, dict) else [])
        own = sum(excess(k) for k in obj) if isinstance(obj, dict | set | frozenset) else 0
        return own + sum(expected(m, seen) for m in members)

    for protocol in range(6):
        for trial in range(12):
            parts = [rng.choice(["a", 7, -3, 2**40, 1.5, None, True])]  # (ints past 2**61 cost their digits)
            for _ in range(12):
                parts.append(tuple(rng.choice(parts) for _ in range(rng.randint(0, 3))))
                if protocol >= 4 and rng.random() < 0.2:
                    parts.append(frozenset(p for p in rng.sample(parts, 2) if type(p) is not frozenset))
            shared = {p: i for i, p in enumerate(parts)}
            tree = {"d": shared, "again": [shared, {rng.choice(parts): 1 for _ in range(5)}], rng.choice(parts): "v"}
            if protocol >= 4:  # (older protocols spell a set as a call to set(): hashed by Python, charged there)
                tree["s"] = {rng.choice(parts) for _ in range(4)}
            data = pickle.dumps(tree, protocol=protocol)
            problem, spent = _unpickle._walk(data)
            assert problem is None
            loaded = _loads(data)
            assert loaded == tree
            assert spent == expected(loaded, set()), (protocol, trial)
            if spent:  # the budget falls exactly there
                monkeypatch.setattr(_unpickle, "MAX_HASHED", spent - 1)
                assert _unpickle._opcode_problem(data) == _unpickle._HASH_BOMB
                monkeypatch.setattr(_unpickle, "MAX_HASHED", spent)
                assert _unpickle._opcode_problem(data) is None
                monkeypatch.undo()


def test_the_walks_shortcuts_for_torchs_opcode_runs_count_as_the_opcodes_do(monkeypatch):
    """Two runs of opcodes make up half a DCP .metadata (a dataclass made with no arguments and its
    state dict opened; torch.Size((a, b))) and are stepped over at once: the walk must end where the
    opcode-by-opcode walk ends, with the same charge, on real metadata and on pickles built to
    look like them with tuple keys and a memo slot skipped."""
    from pathlib import Path

    samples = [p.read_bytes() for p in Path(__file__).parent.parent.joinpath("fixtures").rglob(".metadata")]
    assert len(samples) >= 4
    size = b"\x80\x04ctorch\nSize\n\x94(K\x01K\x02\x86\x94\x85\x94R\x94"
    samples.append(b"\x80\x04}\x94(" + size[2:] + b"K\x01" + b"(K\x02K\x03\x86\x94\x85\x94R\x94K\x05\x86\x94K\x06u.")
    samples.append(b"\x80\x04}\x94(K\x01K\x02\x86\x94\x85\x94R\x94K\x05u\x94q\x09h\x00h\x00\x86\x94\x85\x94R\x94.")
    fused = [_unpickle._walk(d) for d in samples]
    monkeypatch.setattr(_unpickle, "_NEW_RECORD", b"never")
    monkeypatch.setattr(_unpickle, "_SIZE_CALL", b"never")
    assert [_unpickle._walk(d) for d in samples] == fused
    assert any(spent for _, spent in fused[-2:])


_STAND_IN_ARGS = [
    # (allowlist, global, how many of the DAG it is called with, what its refusal says) - each formats
    # its arguments in a message, or joined them (torch.Size(t) loaded, refused only by the tree check)
    ("plain", b"torch\ndevice", 1, "torch.device("),
    ("plain", b"torch\nSize", 1, "torch.Size("),
    ("plain", b"__builtin__\nbytes", 2, "is not a plain bytes value"),
    ("plain", b"_codecs\nencode", 2, "is not plain bytes"),
    ("plain", b"pathlib\nPosixPath", 2, "a path made of"),
    ("dcp", b"torch.serialization\n_get_layout", 1, "unknown torch layout"),
    ("dcp", b"torch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING", 1, "_MEM_FORMAT_ENCODING"),
    ("dcp", b"pathlib\nPurePosixPath", 1, "a path made of"),
    ("plain", b"pathlib._local\nPureWindowsPath", 2, "a path made of"),
    ("plain", b"datetime\ndatetime", 2, "datetime.datetime("),
    ("plain", b"datetime\ntimezone", 2, "datetime.timezone("),
    ("plain", b"torch.torch_version\nTorchVersion", 1, "torch.torch_version.TorchVersion("),
    ("numpy", b"numpy._core.multiarray\nscalar", 2, "numpy scalar of dtype"),
    ("numpy", b"numpy._core.numeric\n_frombuffer", 5, "numpy array of shape"),
]


@pytest.mark.parametrize(("allow", "name", "count", "says"), _STAND_IN_ARGS)
def test_a_stand_in_given_a_shared_tuple_says_so_in_bounded_time(allow, name, count, says):
    """Our stand-ins check their arguments and name the bad one in the message: ``repr`` or ``str``
    of t(100) (see _dag) would take longer than the age of the universe, so they are cut short."""
    args = b"(" + b"h\x00" * count + b"t" if count > 1 else b"h\x00\x85"
    data = b"\x80\x02c" + name + b"\n" + _dag(_DEEP) + b"0" + args + b"R."
    out = _refused_in_time(data, allow)
    assert "could not be read" in out and says in out, out  # (the stand-in's own refusal, in the load)
    assert float(out.split()[1]) < 20, out


def test_a_persistent_id_made_of_shared_tuples_is_named_in_bounded_time():
    out = _refused_in_time(b"\x80\x02" + _dag(_DEEP) + b"Q.", persistent=True)
    assert "unexpected persistent id" in out, out
    pid = b"(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000h\x00K\x01tQ."
    out = _refused_in_time(b"\x80\x02" + _dag(_DEEP) + b"0" + pid, persistent=True)
    assert "storage location" in out, out
    # a tensor on a real storage, with t(100) for its size and stride
    storage = b"(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x04tQ"
    tensor = b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n" + _dag(_DEEP) + b"0(" + storage + b"K\x00h\x00h\x00tR."
    out = _refused_in_time(tensor, persistent=True)
    assert "malformed tensor geometry" in out, out


def test_a_value_numpy_would_convert_forever_is_never_given_to_it():
    """A SETITEM on a numpy array from a pickle (``a[slice(None)] = t(36)``, see _dag) has numpy
    convert the value, walking the shared tuple 2**36 times in C: the process hung. Arrays from a
    pickle refuse item assignment (none is ever pickled with one), and pickle back as plain arrays."""
    np = pytest.importorskip("numpy")

    allow = {**_unpickle.PLAIN, **_unpickle.numpy_arrays()}
    array = np.zeros((1,) * 40, dtype=np.uint32)
    plain = pickle.dumps(array, protocol=2)
    loaded = _unpickle.loads(plain, allow=allow, source="f.pkl")
    assert np.array_equal(loaded, array) and type(pickle.loads(pickle.dumps(loaded))) is np.ndarray
    out = _refused_in_time(plain[:-1] + b"c__builtin__\nslice\nN\x85R" + _dag(36) + b"s.", "numpy")
    assert "item assignment on a numpy array" in out, out


def _allowlists() -> dict[str, dict]:
    from ckpttool.formats import dcp, deepspeed, megatron, torchsave

    return {
        "dcp metadata": dcp.METADATA_ALLOWLIST,
        "dcp objects": dcp.OBJECT_ALLOWLIST,
        "deepspeed": deepspeed.ALLOWLIST,
        "megatron": megatron.ALLOWLIST,
        "torch.save": torchsave.ALLOWLIST,
    }


@pytest.mark.parametrize("which", ["dcp metadata", "dcp objects", "deepspeed", "megatron", "torch.save"])
def test_a_build_on_a_global_changes_nothing(which):
    """BUILD sets a pickle's state on the value below it; on a global that is our stand-in itself.
    It was done: ``torch.FloatStorage`` given dtype int8 (a frozen dataclass with slots takes a
    state), a function's ``__defaults__`` replaced, an attribute added to a class, each for every
    later read in the process. Every global of every allowlist refuses it, in every state form."""
    allow = _allowlists()[which]
    states = [
        b"}X\x03\x00\x00\x00zzzK\x07s",  # {"zzz": 7}
        b"N}X\x03\x00\x00\x00zzzK\x07s\x86",  # (None, {"zzz": 7})
        b"N}X\x0c\x00\x00\x00__defaults__K\x07\x85s\x86",  # (None, {"__defaults__": (7,)})
        b"X\x04\x00\x00\x00int8\x85",  # ("int8",): a dataclass's fields
    ]
    for (module, name), value in allow.items():
        before = (repr(value), dict(getattr(value, "__dict__", {})), getattr(value, "__defaults__", None))
        for state in states:
            data = b"\x80\x02c" + module.encode() + b"\n" + name.encode() + b"\n" + state + b"b."
            with pytest.raises(CorruptFileError):
                _unpickle.loads(data, allow=allow, source="f.pkl")
        after = (repr(value), dict(getattr(value, "__dict__", {})), getattr(value, "__defaults__", None))
        before[1].pop("__setstate__", None)  # (a function's refusal of BUILD is the one attribute it gains)
        after[1].pop("__setstate__", None)
        assert after == before, (module, name)
        assert not hasattr(value, "zzz"), (module, name)


# -- numpy values and paths as the libraries that write checkpoints pickle them ----------------------


def _numpy_values():
    np = pytest.importorskip("numpy")
    return np, [
        np.arange(6, dtype=">i4").reshape(2, 3),  # (big-endian: its byte order comes in the dtype's BUILD)
        np.arange(6, dtype="<f8").reshape(3, 2).T,  # (Fortran order)
        np.arange(24, dtype="u2").reshape(2, 3, 4).transpose(2, 0, 1),  # (protocol 5: order 'K', axes)
        np.array([True, False]),
        np.zeros((0, 3), "c8"),
        np.arange(4, dtype=">f2"),
        np.random.RandomState(7).get_state(),
        np.int64(5),
        np.float32(0.1),
        np.bool_(True),
        np.complex64(1 + 2j),
        np.uint8(200),
        np.float16(1.5),
        {"cursor": np.int64(2**40 + 3), "lr": np.float64(3e-4)},
        np.dtype(">i4"),
        np.dtype("f4"),
        np.float32("nan"),
    ]


@pytest.mark.parametrize("protocol", [0, 1, 2, 3, 4, 5])
def test_numpy_values_read_as_numpy_reads_them(protocol):
    """numpy scalars (a data loader's ``np.int64`` cursor), arrays of protocol 5 (``_frombuffer``) and
    big-endian arrays: the first two were refused as unsafe pickles; the third was read with its bytes
    swapped, because numpy ignores a BUILD on the shared ``dtype('i4')`` our stand-in returned."""
    np, values = _numpy_values()
    allow = {**_unpickle.PLAIN, **_unpickle.numpy_arrays()}

    def same(ours, theirs):
        if isinstance(theirs, tuple | dict):
            if type(ours) is not type(theirs) or len(ours) != len(theirs):
                return False
            if isinstance(theirs, dict):
                return ours.keys() == theirs.keys() and all(same(ours[k], theirs[k]) for k in theirs)
            return all(same(a, b) for a, b in zip(ours, theirs, strict=True))
        if isinstance(theirs, np.dtype):
            return repr(ours) == repr(theirs) and pickle.loads(pickle.dumps(ours)) == theirs
        ours_a, theirs_a = np.asarray(ours), np.asarray(theirs)
        return (
            type(ours).__name__ == type(theirs).__name__
            and ours_a.dtype.str == theirs_a.dtype.str
            and ours_a.dtype.byteorder == theirs_a.dtype.byteorder  # ('=' for the machine's: numpy's spelling)
            and ours_a.shape == theirs_a.shape
            and ours_a.tobytes(order="A") == theirs_a.tobytes(order="A")
        )

    for value in values:
        data = pickle.dumps(value, protocol=protocol)
        ours = _unpickle.loads(data, allow=allow, source="f.pkl")
        assert same(ours, pickle.loads(data)), (value, ours)


def test_a_numpy_file_with_scalars_verifies_clean(tmp_path):
    """What a user saw: a torch.save file keeping a step counter as ``np.int64`` failed verify as an
    unsafe pickle, and inspect stopped with exit 3."""
    np = pytest.importorskip("numpy")
    import torch

    from ckpttool import verify as verify_mod
    from ckpttool.cli import app
    from typer.testing import CliRunner

    path = tmp_path / "run.pt"
    torch.save({"w": torch.ones(3), "step": np.int64(12), "rng": np.random.get_state()}, path)
    torch.save({"w": torch.ones(3), "a": np.arange(4)}, tmp_path / "p5.pt", pickle_protocol=5)
    for file in (path, tmp_path / "p5.pt"):
        report = verify_mod.verify(file)
        assert {f.rule for f in report.findings} == {"missing-state"}, [f.message for f in report.findings]
        assert CliRunner().invoke(app, ["inspect", str(file)]).exit_code == 0
    assert verify_mod.verify(path).step == 12  # (np.int64(12))


_DTYPE = b"\x80\x02cnumpy\ndtype\nX\x02\x00\x00\x00i4\x89\x88\x87R"


@pytest.mark.parametrize(
    "state",
    [
        b"(K\x03X\x01\x00\x00\x00>NX\x01\x00\x00\x00a\x85}J\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00t",  # names
        b"(K\x03X\x01\x00\x00\x00>NNNK\x10J\xff\xff\xff\xffK\x00t",  # an item size of 16
        b"(K\x03X\x01\x00\x00\x00>NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x3ft",  # object flags
        b"(K\x03X\x01\x00\x00\x00?NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00t",  # no byte order
        b"(K\x03X\x01\x00\x00\x00>NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb"
        b"(K\x03X\x01\x00\x00\x00<NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00t",  # set twice
        b"(K\x03X\x01\x00\x00\x00>" + _dag(_DEEP) + b"NNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00t",  # t(100)
    ],
)
def test_a_numpy_dtype_takes_a_byte_order_and_nothing_else(state):
    """numpy's own dtype ``__setstate__`` takes fields, sizes and flags (an object dtype over bytes
    from the file is pointers made up by the file); the stand-in takes the byte order only, once."""
    out = _refused_in_time(_DTYPE + state + b"b.", "numpy")
    assert "not a plain numeric dtype's" in out, out


class _Reduced:
    """Pickles as ``fn(*args)`` with an optional BUILD ``state``: what numpy writes, with other values."""

    def __init__(self, fn, args, state=None):
        self.fn, self.args, self.state = fn, args, state

    def __reduce__(self):
        return (self.fn, self.args) if self.state is None else (self.fn, self.args, self.state)


def test_numpy_arrays_and_scalars_hold_exactly_their_bytes():
    """The bytes a pickle gives an array (its BUILD, protocol 5's buffer) or a scalar must be its
    size in its dtype, its dtype the stand-in's, and its order one numpy writes."""
    np = pytest.importorskip("numpy")
    from numpy._core import multiarray, numeric

    allow = {**_unpickle.PLAIN, **_unpickle.numpy_arrays()}
    i2, empty = np.dtype("i2"), (np.ndarray, (0,), b"b")
    for value, says in (
        (_Reduced(multiarray.scalar, (np.dtype("i8"), b"\x05" * 7)), "is not the 8 bytes of 1 int64"),
        (_Reduced(multiarray.scalar, ("i8", b"\x05" * 8)), "scalar of dtype 'i8' .not a plain numeric dtype"),
        (_Reduced(numeric._frombuffer, (bytearray(4), i2, (3,), "C")), "is not the 6 bytes of 3 int16"),
        (_Reduced(numeric._frombuffer, (bytearray(6), i2, (3,), "X")), "in order 'X'"),
        (_Reduced(numeric._frombuffer, (bytearray(6), i2, (3, 1), "K", (0, 0))), "in order 'K'"),
        (_Reduced(multiarray._reconstruct, empty, (1, (3,), i2, False, b"\x00" * 4)), "not the 6 bytes of 3"),
        (_Reduced(multiarray._reconstruct, empty, (1, (3,), i2, 0, b"\x00" * 6)), "with order 0"),
        (_Reduced(multiarray._reconstruct, empty, (2, (3,), i2, False, b"\x00" * 6)), "numpy array state"),
        (_Reduced(multiarray._reconstruct, empty, (1, (3,), "i2", False, b"\x00" * 6)), "of dtype 'i2'"),
        (_Reduced(multiarray._reconstruct, empty, (1, (0, 2**48, 2**48), i2, False, b"")), r"of shape \(0, 2"),
    ):
        data = pickle.dumps(value, protocol=4)
        with pytest.raises(CorruptFileError, match=says):
            _unpickle.loads(data, allow=allow, source="f.pkl")


def test_paths_pickled_by_any_python_are_read_as_their_text():
    """Python 3.13 pickles ``pathlib.PosixPath`` as ``pathlib._local.PosixPath``: a DCP ``.metadata``
    or Megatron ``args`` holding one, written by 3.13, was refused as an unsafe pickle. Windows paths
    keep their separators."""
    from ckpttool.formats import dcp

    py313 = b"\x80\x02cpathlib._local\n%s\nX\x04\x00\x00\x00/a/b\x85R."
    py311 = b"\x80\x02cpathlib\n%s\nX\x03\x00\x00\x00C:\\X\x01\x00\x00\x00x\x86R."
    for allow in (dcp.METADATA_ALLOWLIST, {**_unpickle.PLAIN, **_unpickle.NAMESPACES}):
        for cls in (b"PosixPath", b"PurePosixPath", b"WindowsPath", b"PureWindowsPath"):
            assert _unpickle.loads(py313 % cls, allow=allow, source="f") == "/a/b"
        assert _unpickle.loads(py311 % b"PureWindowsPath", allow=allow, source="f") == "C:\\x"
        assert _unpickle.loads(py311 % b"PurePosixPath", allow=allow, source="f") == "C:\\/x"


def test_times_and_torch_version_read_as_python_reads_them(tmp_path):
    """``datetime`` values (a save's time stamp) and ``torch.__version__`` (a ``TorchVersion``) kept
    in a checkpoint were refused as unsafe pickles. They read as Python reads them, and a converted
    checkpoint keeps them as they were."""
    import datetime as dt

    import torch

    east = dt.timezone(dt.timedelta(hours=-5), "EST")
    values = [
        dt.datetime(2026, 11, 26, 3, 0, 5, 7, tzinfo=east),
        dt.datetime(2026, 1, 1, fold=1),
        dt.date(2026, 1, 1),
        dt.time(3, 4, tzinfo=dt.timezone.utc),
        dt.timedelta(days=-1, seconds=3, microseconds=5),
        dt.timezone(dt.timedelta(minutes=30)),
    ]
    for protocol in range(6):
        for value in values + ([torch.__version__] if protocol >= 2 else []):  # (torch.save: protocol 2)
            data = pickle.dumps(value, protocol=protocol)
            ours, theirs = _unpickle.loads(data, allow=_unpickle.PLAIN, source="f.pkl"), pickle.loads(data)
            assert ours == theirs and type(ours).__name__ == type(theirs).__name__, (protocol, value, ours)
            assert hash(ours) == hash(theirs)
            assert getattr(ours, "fold", 0) == getattr(theirs, "fold", 0) and str(ours) == str(theirs)

    kept = {"w": torch.ones(2), "v": torch.__version__, "at": values[0], "fold": values[1], "t": dt.time(1, fold=1)}
    torch.save(kept, tmp_path / "a.pt", pickle_protocol=4)  # (the fold is pickled from protocol 4 on)
    from ckpttool.convert import convert

    convert(tmp_path / "a.pt", tmp_path / "out", to="torch")  # (which pickles with protocol 2)
    back = torch.load(tmp_path / "out" / "model.pt", weights_only=False)  # (our own output)
    assert back["at"] == values[0] and back["v"] == torch.__version__
    assert type(back["v"]) is type(torch.__version__) and back["fold"].fold == 1 and back["t"].fold == 1


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (b"cdatetime\ntimezone\nK\x05\x85R", "datetime.timezone(5"),
        (b"cdatetime\ndatetime\n(K\x01]tR", "datetime.datetime(1, []"),
        (b"cdatetime\ndatetime\nC\n\x07\xea\x0b\x1a\x03\x00\x00\x00\x00\x00czoneinfo\nZoneInfo\n\x86R", "zoneinfo"),
        (b"ctorch.torch_version\nTorchVersion\nK\x02\x85\x81", "TorchVersion(2,)"),
        (b"ctorch.torch_version\nTorchVersion\nX\x01\x00\x00\x002\x85\x81}b", "sets state on"),
        (b"cdatetime\ntimedelta\n)R}b", "object has no attribute '__dict__'"),
        (b"cdatetime\ntimedelta\n\x8a\x09" + bytes(8) + b"\x01\x85R", "datetime.timedelta(18446744073709551616"),
    ],
)
def test_times_and_versions_take_what_python_writes_only(value, says):
    with pytest.raises((CorruptFileError, UnsafePickleError), match=re.escape(says)):
        _unpickle.loads(b"\x80\x02" + value + b".", allow=_unpickle.PLAIN, source="f.pkl")


def test_numpy_values_cost_what_they_copy():
    """numpy copies an array's bytes to swap a big-endian state into the machine's order: one 1 MB
    state given to 3 000 arrays through the memo (a 1.1 MB file) took 3.1 GB. Each BUILD is charged
    as a copy, and so are the zeros ``_reconstruct`` makes."""
    np = pytest.importorskip("numpy")
    from numpy._core import multiarray

    state = (1, (1 << 17,), np.dtype(">i8"), False, bytes(1 << 20))
    data = pickle.dumps([_Reduced(multiarray._reconstruct, (np.ndarray, (0,), b"b"), state) for _ in range(3000)], 2)
    assert len(data) < 1_200_000
    assert "more copies of values" in _refused_in_time(data, "numpy")
    zeros = pickle.dumps([_Reduced(multiarray._reconstruct, (np.ndarray, (1 << 17,), b"d")) for _ in range(3000)], 2)
    assert "more copies of values" in _refused_in_time(zeros, "numpy")


def test_numpy_values_compare_and_show_as_numbers(tmp_path):
    """numpy numbers and dtypes from a pickle, where ckpttool looks at them: a NaN in an ``np.float32``
    is found, two lists of ``np.float32`` that differ are different (they were "equal", not compared),
    a big-endian array saved at protocol 5 and at 2 is the same, and a dtype equals numpy's."""
    np = pytest.importorskip("numpy")
    import torch

    from ckpttool.diff import diff
    from ckpttool.manifest import Item
    from ckpttool.values import describe_value, same_value, set_value

    item = Item(name="loss_scale", kind="counter")
    set_value(item, np.float32("nan"))
    assert item.nonfinite == "NaN"
    assert same_value(np.float32("nan"), np.float32("nan")) and not same_value(np.int64(1), np.float32(1))
    torch.save({"w": torch.ones(2), "hist": [np.float32(i) for i in range(20)]}, tmp_path / "a.pt")
    torch.save({"w": torch.ones(2), "hist": [np.float32(i + (i == 7)) for i in range(20)]}, tmp_path / "b.pt")
    assert diff(tmp_path / "a.pt", tmp_path / "b.pt").different
    for protocol in (2, 5):
        torch.save({"w": torch.ones(2), "a": np.arange(4, dtype=">i4")}, tmp_path / f"p{protocol}.pt", pickle_protocol=protocol)
    assert not diff(tmp_path / "p2.pt", tmp_path / "p5.pt").different

    allow = {**_unpickle.PLAIN, **_unpickle.numpy_arrays()}
    dtype = _unpickle.loads(pickle.dumps(np.dtype(">i4"), 2), allow=allow, source="f")
    assert dtype == np.dtype(">i4") and hash(dtype) == hash(np.dtype(">i4")) and dtype != np.dtype("<i4")
    assert np.dtype(dtype) == np.dtype(">i4") and np.zeros(2, dtype).dtype == np.dtype(">i4")
    assert dtype != (1, 2) and describe_value(dtype) == "dtype('>i4')" and str(dtype) == ">i4"


def test_a_path_is_not_taken_for_a_global_that_runs_code():
    """A ``pathlib`` path refused where paths are not allowed (a file of the run's own beside a DCP
    checkpoint) was named hostile: a path is a value; ``pathlib.Path.write_text`` is not."""
    assert not _unpickle.runs_code("pathlib.PosixPath") and not _unpickle.runs_code("pathlib._local.WindowsPath")
    assert _unpickle.runs_code("pathlib.Path.write_text") and _unpickle.runs_code("pathlib.Path")


def test_a_counter_reads_as_torchs_weights_only_load_reads_it():
    """``collections.Counter``, which torch.load(weights_only=True) allows, was refused as an unsafe
    pickle. It reads as a Counter at every protocol, and one that asks for state, or for more than
    one argument, is refused as torch's own would be."""
    from collections import Counter

    for protocol in range(6):
        for value in (Counter({"a": 3, "b": 1}), Counter(), {"seen": Counter([1, 1, 2])}):
            data = pickle.dumps(value, protocol=protocol)
            ours = _unpickle.loads(data, allow=_unpickle.PLAIN, source="f.pkl")
            assert ours == pickle.loads(data), (protocol, value)
    assert isinstance(_unpickle.loads(pickle.dumps(Counter(a=1)), allow=_unpickle.PLAIN, source="f.pkl"), Counter)
    for bad, says in [
        (b"ccollections\nCounter\n)R}X\x01\x00\x00\x00xK\x01sb", "sets state on"),
        (b"ccollections\nCounter\n}}\x86R", "Counter made of 2 arguments"),
    ]:
        with pytest.raises((CorruptFileError, UnsafePickleError), match=re.escape(says)):
            _unpickle.loads(b"\x80\x02" + bad + b".", allow=_unpickle.PLAIN, source="f.pkl")


def test_a_counter_is_written_back_as_a_counter():
    from collections import Counter

    from ckpttool.formats import _ptwrite

    tree = _unpickle.loads(pickle.dumps({"n": Counter(a=2)}, protocol=2), allow=_unpickle.PLAIN, source="f.pkl")
    data, _ = _ptwrite.dumps(_ptwrite.carry(tree, lambda: None))
    assert b"ccollections\nCounter\n" in data
    back = pickle.loads(data)
    assert type(back["n"]) is Counter and back["n"] == Counter(a=2)


def test_an_ordered_dict_attribute_may_not_stand_in_for_a_method():
    """A module state dict's ``_metadata`` is an attribute; one named ``items`` would stand in for the
    dict's own method wherever ckpttool walks the state (an internal error, exit 3): refused."""
    od = OrderedDict(w=1)
    od._metadata = {"": {"version": 1}}
    data = pickle.dumps(od, protocol=2)
    assert _unpickle.loads(data, allow=_unpickle.PLAIN, source="f.pkl").__dict__ == {"_metadata": {"": {"version": 1}}}
    shadowing = data.replace(b"X\t\x00\x00\x00_metadata", b"X\x05\x00\x00\x00items")
    assert shadowing != data
    with pytest.raises(CorruptFileError, match=re.escape("OrderedDict attributes named ['items']")):
        _unpickle.loads(shadowing, allow=_unpickle.PLAIN, source="f.pkl")


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("sparse", "holds a sparse tensor (torch._utils._rebuild_sparse_tensor), which ckpttool does not read yet"),
        ("meta", "holds a tensor on the meta device (saved without its values)"),
    ],
)
def test_torchs_own_values_not_read_are_named_not_called_hostile(value, says, tmp_path):
    """A sparse or a meta tensor (which torch.load(weights_only=True) reads) was refused with the hint
    "the file may be hostile". It is still refused, but said to be what it is."""
    import torch

    from tests.conftest import assert_clean, run_cli

    t = torch.eye(3).to_sparse() if value == "sparse" else torch.empty(2, 3, device="meta")
    torch.save({"w": torch.ones(2), "x": t}, tmp_path / "a.pt")
    r = run_cli("inspect", tmp_path / "a.pt")
    assert_clean(r, 3, says)
    assert "hostile" not in r.stderr
