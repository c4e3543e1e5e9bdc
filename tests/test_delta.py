"""Lossless delta and compression: every file restored byte for byte, wrong bases refused."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import pytest

from ckpttool import delta, registry
from ckpttool.delta import DeltaMismatchError
from ckpttool.errors import CkptError, IncompleteCheckpointError
from tests.conftest import FIXTURES, assert_clean, run_cli, tree_digests

RUN = FIXTURES / "run"


def _files(path: Path) -> dict[str, str]:
    """sha256 of every file the user gave: a whole save directory (tracker, iteration folder and
    scripts) or one file (key: its name)."""
    if path.is_file():
        return {path.name: hashlib.sha256(path.read_bytes()).hexdigest()}
    return tree_digests(path)


def _restored(out: Path, names: dict[str, str]) -> dict[str, str]:
    if out.is_file():
        (only,) = names
        return {only: hashlib.sha256(out.read_bytes()).hexdigest()}
    return tree_digests(out)


PAIRS = [
    ("run/step_10", "run/step_11"),
    ("run/step_10", "run/step_20"),
    ("dcp/fsdp2", "dcp/mesh2x2"),
    ("dcp/fsdp2_zstd", "dcp/fsdp2_zstd"),
    ("dcp/fsdp2", "dcp/fsdp2_ranklocal"),
    ("dcp/fsdp2_hf/sharded", "dcp/fsdp2_hf/sharded"),
    ("deepspeed/zero1", "deepspeed/zero2"),
    ("deepspeed/zero2", "deepspeed/zero3"),
    ("deepspeed/zero2", "deepspeed/universal"),
    ("megatron/legacy_tp2pp2", "megatron/legacy_tp2pp2_distopt"),
    ("megatron/dist_tp2", "megatron/dist_tp2pp2"),
    ("rankshards/ddp", "rankshards/tp_manual/step_00000003"),
    ("safetensors/sharded", "safetensors/sharded"),
    ("torch/train_state.pt", "torch/train_state.pt"),
]


@pytest.mark.parametrize(("base", "target"), PAIRS)
def test_delta_round_trip(base, target, tmp_path):
    d = tmp_path / "d.delta"
    delta.create(FIXTURES / target, d, base=FIXTURES / base)
    out = tmp_path / "out"
    delta.apply(d, out, base=FIXTURES / base)
    want = _files(FIXTURES / target)
    assert _restored(out, want) == want


@pytest.mark.parametrize("rel", ["dcp/fsdp2", "deepspeed/zero3", "deepspeed/universal", "megatron/legacy_tp2pp2",
                                 "megatron/dist_tp2", "rankshards/ddp", "safetensors/model.safetensors",
                                 "torch/train_state.pt"])
def test_compress_round_trip(rel, tmp_path):
    packed = tmp_path / "p.ckz"
    r = run_cli("compress", FIXTURES / rel, "-o", packed)
    assert r.code == 0, r.stderr
    out = tmp_path / "out"
    assert run_cli("decompress", packed, "-o", out).code == 0
    want = _files(FIXTURES / rel)
    assert _restored(out, want) == want


def test_a_sealed_legacy_megatron_save_directory_comes_back_sealed(tmp_path):
    """A legacy Megatron save directory's manifest lists its rank files and tracker only: its seal
    and a note beside them were left out of the container, and it came back unsealed. Files of the
    folder the container does not hold (a DeepSpeed save's logs/) are now named on stderr."""
    src = tmp_path / "L"
    shutil.copytree(FIXTURES / "megatron" / "legacy_tp2pp2", src)
    assert run_cli("seal", src, "-q").code == 0
    (src / "README.txt").write_text("note\n")
    r = run_cli("compress", src, "-o", tmp_path / "L.ckz", "-q")
    assert r.code == 0 and "not in the container" not in r.stderr, r.stderr
    assert run_cli("decompress", tmp_path / "L.ckz", "-o", tmp_path / "back").code == 0
    assert tree_digests(tmp_path / "back") == tree_digests(src)
    assert "seal: " in run_cli("verify", tmp_path / "back").stdout
    ds = tmp_path / "D"
    shutil.copytree(FIXTURES / "deepspeed" / "zero2", ds)
    (ds / "logs").mkdir()
    (ds / "logs" / "run.txt").write_text("x\n")
    r = run_cli("compress", ds, "-o", tmp_path / "D.ckz", "-q")
    assert r.code == 0 and "not in the container (not part of the checkpoint): logs/ (1 file)" in r.stderr, r.stderr


def test_consecutive_steps_code_better_than_alone(tmp_path):
    alone = tmp_path / "alone.ckz"
    delta.create(RUN / "step_11", alone)
    d1 = tmp_path / "d1.delta"
    delta.create(RUN / "step_11", d1, base=RUN / "step_10")
    d10 = tmp_path / "d10.delta"
    delta.create(RUN / "step_20", d10, base=RUN / "step_10")
    r_alone, r1, r10 = (delta.info(p)["ratio"] for p in (alone, d1, d10))
    assert r1 > 1.1 * r_alone
    assert r10 >= 0.99 * r_alone  # far-apart steps never much worse than coding alone


def test_chain(tmp_path):
    d1, d2 = tmp_path / "d1", tmp_path / "d2"
    delta.create(RUN / "step_11", d1, base=RUN / "step_10")
    delta.create(RUN / "step_20", d2, base=RUN / "step_11")
    t1 = tmp_path / "t1"
    delta.apply(d1, t1, base=RUN / "step_10")
    t2 = tmp_path / "t2"
    delta.apply(d2, t2, base=t1)
    assert _restored(t2, _files(RUN / "step_20")) == _files(RUN / "step_20")


def test_wrong_base_is_refused_before_writing(tmp_path):
    d = tmp_path / "d"
    delta.create(RUN / "step_11", d, base=RUN / "step_10")
    out = tmp_path / "out"
    with pytest.raises(DeltaMismatchError, match="refused before writing"):
        delta.apply(d, out, base=RUN / "step_20")
    assert not out.exists() and list(tmp_path.iterdir()) == [d]
    r = run_cli("delta", "apply", RUN / "step_20", d, "-o", out)
    assert r.code == 1 and "not the file the delta was made against" in r.stderr


def test_stored_hash_mismatch_publishes_nothing(tmp_path):
    d = tmp_path / "d"
    delta.create(RUN / "step_11", d, base=RUN / "step_10")
    want = delta.read_header(d)["files"]["__0_0.distcp"]["xxh3"]
    wrong = ("0" if want[0] != "0" else "1") + want[1:]
    # (the header made anew with its own digest: a damaged header alone is caught by that digest)
    _edit_header(d, lambda h: h["files"]["__0_0.distcp"].update(xxh3=wrong))
    out = tmp_path / "out"
    r = run_cli("delta", "apply", RUN / "step_10", d, "-o", out)
    # the base matched its recorded hashes, so the delta is what is damaged: exit 3 (it was 1, the
    # code of a wrong base, where decompress said 3 of the same damage)
    assert r.code == 3 and "does not give the stored xxh3-128" in r.stderr and "the delta is damaged" in r.stderr
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]  # no temp directory left behind


def test_a_base_that_is_not_there_is_exit_3(tmp_path):
    """A base path that does not exist said "'.metadata' is not there; refused" with exit 1."""
    d = tmp_path / "d"
    delta.create(RUN / "step_11", d, base=RUN / "step_10")
    r = run_cli("delta", "apply", tmp_path / "nonexistent", d, "-o", tmp_path / "out")
    assert r.code == 3 and "nonexistent: no such file or directory" in r.stderr, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_truncated_delta_is_a_clear_error(tmp_path):
    d = tmp_path / "d"
    delta.create(RUN / "step_11", d, base=RUN / "step_10")
    d.write_bytes(d.read_bytes()[:-100])
    r = run_cli("delta", "apply", RUN / "step_10", d, "-o", tmp_path / "out")
    assert r.code == 3 and "cut short or damaged" in r.stderr and "Traceback" not in r.stderr
    assert "hint: the copy or the write was interrupted" in r.stderr
    r = run_cli("delta", "apply", RUN / "step_10", RUN / "step_10" / ".metadata", "-o", tmp_path / "out")
    assert r.code == 3 and "not a ckpttool delta or compressed checkpoint" in r.stderr and "hint:" in r.stderr
    assert not (tmp_path / "out").exists()


def test_info_and_cli(tmp_path):
    d = tmp_path / "d"
    r = run_cli("delta", "create", RUN / "step_10", RUN / "step_11", "-o", d)
    assert r.code == 0 and "ratio" in r.stdout
    info = run_cli("delta", "info", d)
    assert info.code == 0 and "param" in info.stdout and "optim" in info.stdout
    assert run_cli("delta", "create", RUN / "step_10", RUN / "step_11", "-o", d).code == 2  # exists
    shutil.rmtree(tmp_path / "nothing", ignore_errors=True)


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_codec_decodes_in_place_every_method(width):
    import numpy as np

    from ckpttool import codec

    rng = np.random.default_rng(width)
    base = rng.integers(0, 256, 4096 * width, dtype=np.uint8).tobytes()
    near = bytearray(base)
    for i in range(0, len(near), 7):
        near[i] ^= 1
    target = bytes(near)
    for method in ("planes", "xor", "idiff"):
        for floating in (True, False):
            planes = codec.transform(method, target, base, width, floating)
            frames = codec.compress_planes(planes)
            sizes = [len(p) for p in planes]
            out = bytearray(len(target) + 1)  # decoded one byte in: an unaligned view
            codec.decode_into(memoryview(out)[1:], method, frames, sizes, base, width, floating)
            assert bytes(out[1:]) == target, (method, floating)
            with pytest.raises(ValueError):  # one byte short of the piece: refused, not a wrong result
                codec.decode_into(memoryview(bytearray(len(target) - width)), method, frames, sizes, base, width, floating)
            if method != "planes":
                with pytest.raises(ValueError, match="base"):
                    codec.decode_into(memoryview(out)[1:], method, frames, sizes, base[:-width], width, floating)
    method, frames, sizes = codec.encode(target, base, width, True)
    out = bytearray(len(target))
    codec.decode_into(memoryview(out), method, frames, sizes, base, width, True)
    assert bytes(out) == target


def test_adam_second_moment_coded_against_its_prediction(tmp_path, monkeypatch):
    """One AdamW step apart, exp_avg_sq is predicted from exp_avg (decoded first) and the base: the
    fitted decays are AdamW's own (0.9, 0.999, fixtures/make_run_fixtures.py), the optimizer state
    codes far smaller than without the prediction, and every file comes back byte for byte."""
    from ckpttool import codec

    d = tmp_path / "d"
    header = delta.create(RUN / "step_11", d, base=RUN / "step_10", workers=1)
    moments = [t for f in header["files"].values() for t in f["tensors"] if t["item"].endswith("exp_avg_sq")]
    predicted = [t for t in moments if t["predict"] is not None]
    assert len(predicted) >= len(moments) - 3
    for t in predicted:
        b1, b2, _ = t["predict"]["ema2"]
        assert abs(b1 - 0.9) < 1e-6 and abs(b2 - 0.999) < 1e-6
    with_prediction = delta.info(d)["by_kind"]["optim"]["ratio"]
    monkeypatch.setattr(codec, "ema2_fit", lambda *a: None)
    plain = tmp_path / "plain"
    delta.create(RUN / "step_11", plain, base=RUN / "step_10", workers=1)
    assert with_prediction > 1.3 * delta.info(plain)["by_kind"]["optim"]["ratio"]
    monkeypatch.undo()
    out = tmp_path / "out"
    delta.apply(d, out, base=RUN / "step_10", workers=1)
    assert _restored(out, _files(RUN / "step_11")) == _files(RUN / "step_11")


def _edit_header(path, edit):
    from tests.test_fuzz import join_container, split_container

    body, header = split_container(path.read_bytes())
    edit(header)
    path.write_bytes(join_container(body, json.dumps(header).encode()))


def _first_predicted(h):
    return next(t for f in h["files"].values() for t in f["tensors"] if t.get("predict"))


def _source_after(h):
    """Point the first prediction at a plain piece of the same size that lies after it: a source
    apply has not written yet when it decodes the prediction."""
    t = _first_predicted(h)
    f = next(f for f in h["files"].values() if t in f["tensors"])
    later = next(
        u for u in f["tensors"] if u["offset"] > t["offset"] and u["length"] == t["length"] and not u.get("predict")
    )
    t["predict"]["m_new"] = later["offset"]


def _frames_swapped(h):
    """A piece's first two frames given in each other's place: each lies inside the coded data,
    and apply read each from where the header said (create writes a piece's frames end to end)."""
    t = next(t for f in h["files"].values() for t in f["tensors"] if len(t["frames"]) > 1)
    t["frames"][0], t["frames"][1] = t["frames"][1], t["frames"][0]


def _on_first(edit):
    return lambda h: edit(_first_predicted(h))


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (_on_first(lambda t: t["predict"].update(m_new=t["offset"])), "not a tensor decoded before it"),
        (_on_first(lambda t: t["predict"].update(m_new=t["predict"]["m_new"] + 4)), "not a tensor decoded"),
        (_source_after, "not a tensor decoded before it"),
        (_on_first(lambda t: t["predict"].update(m_old=["../../etc/passwd", 0])), "unrecorded base file"),
        (_on_first(lambda t: t["predict"].update(ema2=[0.9, float("nan"), 1.0])), "prediction coefficients"),
        (_on_first(lambda t: t.update(width=2)), "non-float32"),
        (_on_first(lambda t: t.update(base=[["a"], 0])), "base piece reference"),
        (lambda h: next(iter(h["files"].values()))["other"].update(dict_file="../../etc/passwd"), "a dictionary file"),
        (_frames_swapped, "frames do not lie end to end"),
    ],
)
def test_forged_prediction_is_refused_before_writing(edit, reason, tmp_path):
    d = tmp_path / "d"
    delta.create(RUN / "step_11", d, base=RUN / "step_10", workers=1)
    _edit_header(d, edit)
    out = tmp_path / "out"
    r = run_cli("delta", "apply", RUN / "step_10", d, "-o", out)
    assert r.code == 3 and reason in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_ema2_fit_recovers_the_decays():
    import numpy as np

    from ckpttool import codec

    rng = np.random.default_rng(0)
    n = 50_000
    m0, g = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    v0 = np.abs(rng.standard_normal(n)).astype(np.float32)
    m1 = (np.float32(0.8) * m0 + np.float32(0.2) * g).astype(np.float32)
    v1 = (np.float32(0.98) * v0 + np.float32(0.02) * g * g).astype(np.float32)
    coef = codec.ema2_fit(v1.tobytes(), m1.tobytes(), m0.tobytes(), v0.tobytes())
    assert coef is not None and abs(coef[0] - 0.8) < 1e-4 and abs(coef[1] - 0.98) < 1e-4
    pred = np.frombuffer(codec.ema2_predict(m1.tobytes(), m0.tobytes(), v0.tobytes(), coef), np.float32)
    assert np.median(np.abs(pred.view(np.int32) - v1.view(np.int32))) <= 2  # a few ulps off, not more
    assert codec.ema2_fit(b"", b"", b"", b"") is None


def test_ctrl_c_inside_thread_start_waits_for_the_unrecorded_worker(tmp_path, monkeypatch):
    """A Ctrl-C that lands inside ``Thread.start`` (it waits for the new thread to run) leaves a pool
    thread that ``shutdown(wait=True)`` never joins. ``apply`` must still not return while that thread
    writes into the staged directory, and must leave nothing behind (a CI run once found such a
    thread's ``__0_0.distcp`` in a temp directory the cleanup could not remove)."""
    import threading
    import time

    d = tmp_path / "d"
    delta.create(RUN / "step_11", d, base=RUN / "step_10")
    inside, running = threading.Event(), []
    real_rebuild, real_start = delta._rebuild_file, threading.Thread.start

    def slow_rebuild(*args, **kwargs):
        running.append(True)
        inside.set()
        time.sleep(0.3)  # long enough for the cleanup to run (and fail) before this returns
        try:
            return real_rebuild(*args, **kwargs)
        finally:
            running.pop()

    def interrupted_start(self):
        real_start(self)
        if self.name.startswith("ckpttool-apply"):  # (a thread of the pool that rebuilds the files)
            monkeypatch.setattr(threading.Thread, "start", real_start)
            assert inside.wait(5)
            raise KeyboardInterrupt  # as the signal handler would, inside start()

    monkeypatch.setattr(delta, "_rebuild_file", slow_rebuild)
    monkeypatch.setattr(threading.Thread, "start", interrupted_start)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        delta.apply(d, out, base=RUN / "step_10", workers=1)
    assert not running, "apply returned while a worker was still writing"
    time.sleep(0.4)  # a worker left running would now have created its file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_a_save_directory_is_packed_whole_and_old_deltas_still_apply(tmp_path, monkeypatch):
    """Megatron torch_dist given its save directory: the container restores the tracker and the
    iteration folder (it used to restore the folder's files flattened, tracker lost). A delta made
    that old way, against the iteration folder's paths, still applies to the save directory."""
    src, base = FIXTURES / "megatron" / "dist_tp2pp2", FIXTURES / "megatron" / "dist_tp2"
    d = tmp_path / "d.delta"
    delta.create(src, d, base=base)
    assert "latest_checkpointed_iteration.txt" in delta.read_header(d)["files"]
    delta.apply(d, tmp_path / "new", base=base)
    assert tree_digests(tmp_path / "new") == tree_digests(src)

    monkeypatch.setattr(delta, "_pack_root", lambda path, m: (Path(m.root), ""))
    delta.create(src, tmp_path / "old.delta", base=base)
    monkeypatch.undo()
    assert "latest_checkpointed_iteration.txt" not in delta.read_header(tmp_path / "old.delta")["files"]
    delta.apply(tmp_path / "old.delta", tmp_path / "old", base=base)
    assert tree_digests(tmp_path / "old") == tree_digests(src / "iter_0000003")


def test_a_save_directory_changing_while_packed_writes_nothing(tmp_path, monkeypatch):
    """A save still running moves the tracker on while compress reads the iteration it named: the
    container would restore a tracker naming an iteration it does not hold. It is refused instead,
    and a delta made against a save directory applies to its iteration folder too."""
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "megatron" / "dist_tp2", src)
    real_read, moved = delta._read, []

    def read_and_save(path, ranges):
        if not moved:
            (src / "latest_checkpointed_iteration.txt").write_text("4")
            moved.append(path)
        return real_read(path, ranges)

    monkeypatch.setattr(delta, "_read", read_and_save)
    out = tmp_path / "p.ckz"
    with pytest.raises(IncompleteCheckpointError, match="changed while being packed"):
        delta.create(src, out)
    assert moved and not out.exists() and not list(tmp_path.glob(".p.ckz*"))
    monkeypatch.undo()

    base = FIXTURES / "megatron" / "dist_tp2"
    d = tmp_path / "d.delta"
    delta.create(FIXTURES / "megatron" / "dist_tp2pp2", d, base=base)
    delta.apply(d, tmp_path / "from_iter", base=base / "iter_0000003")
    assert tree_digests(tmp_path / "from_iter") == tree_digests(FIXTURES / "megatron" / "dist_tp2pp2")



def test_a_base_changing_while_coded_against_writes_nothing(tmp_path, monkeypatch):
    """A base rewritten while the delta was coded against it gave a delta that applied to neither
    the old base nor the new one, published with exit 0 (a user deletes the target after that)."""
    base = tmp_path / "base"
    shutil.copytree(FIXTURES / "dcp" / "fsdp2", base)
    real_read, touched = delta._read, []

    def read_and_write_base(path, ranges):
        if not touched:
            with open(base / "__1_0.distcp", "r+b") as f:
                f.seek(1000)
                f.write(b"U" * 64)
            touched.append(path)
        return real_read(path, ranges)

    monkeypatch.setattr(delta, "_read", read_and_write_base)
    out = tmp_path / "d.delta"
    with pytest.raises(CkptError, match=r"__1_0.distcp changed while the delta was coded against it"):
        delta.create(FIXTURES / "dcp" / "fsdp2", out, base=base)
    assert touched and not out.exists() and not list(tmp_path.glob(".d.delta*"))


def test_force_replaces_an_earlier_single_file_output_never_other_data(tmp_path):
    """A single-file container restored with --force over any file (a text file) replaced it,
    where --force promises to replace an earlier output, never other data."""
    packed = tmp_path / "m.ckz"
    model = FIXTURES / "safetensors" / "model.safetensors"
    delta.create(model, packed)
    notes = tmp_path / "notes.txt"
    notes.write_text("hi")
    r = run_cli("decompress", packed, "-o", notes, "--force")
    assert r.code == 2 and "is a file that holds no checkpoint" in r.stderr, r.stderr
    assert notes.read_text() == "hi"
    earlier = tmp_path / "earlier.safetensors"
    shutil.copyfile(model, earlier)
    assert run_cli("decompress", packed, "-o", earlier, "--force").code == 0
    assert earlier.read_bytes() == model.read_bytes()


def _flip_in_header(path: Path, needle: bytes, bit: int) -> None:
    data = bytearray(path.read_bytes())
    at = data.rindex(needle)
    data[at + 3] ^= bit
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("needle", "bit"),
    [(b'"__1_0.distcp":{', 0x02), (b'"__1_0.distcp":{', 0x04), (b'"mode":420', 0x01)],
    ids=["name-made-a-duplicate", "name-changed", "mode-changed"],
)
def test_a_bit_flipped_in_a_container_header_is_caught(needle, bit, tmp_path):
    """The header (names, modes, ranges) had no digest: a bit flipped in a name restored the file
    under another name, or dropped it (a duplicate name: JSON keeps the last), a flipped mode bit
    restored the mode, each with exit 0 and "every file's xxh3-128 checked"."""
    packed = tmp_path / "p.ckz"
    assert run_cli("compress", FIXTURES / "dcp" / "fsdp2", "-o", packed).code == 0
    _flip_in_header(packed, needle, bit)
    r = run_cli("decompress", packed, "-o", tmp_path / "out")
    assert_clean(r, 3, "p.ckz", "does not match the xxh3-128 stored after it")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.ckz"]


def test_a_forged_header_naming_a_file_twice_is_refused(tmp_path):
    """A header made anew with its digest (as a forger would) that names one file twice: refused,
    where json kept the last entry and the other file was dropped."""
    packed = tmp_path / "p.ckz"
    delta.create(FIXTURES / "dcp" / "fsdp2", packed)
    from tests.test_fuzz import join_container, split_container

    body, header = split_container(packed.read_bytes())
    text = json.dumps(header)
    entry = '"__1_0.distcp": ' + json.dumps(header["files"]["__1_0.distcp"])
    twice = text.replace(entry, entry + ", " + entry, 1)
    assert twice != text
    packed.write_bytes(join_container(body, twice.encode()))
    r = run_cli("decompress", packed, "-o", tmp_path / "out")
    assert_clean(r, 3, "p.ckz", "names '__1_0.distcp' twice")
    assert not (tmp_path / "out").exists()


def test_a_container_the_version_1_writer_wrote_is_restored(tmp_path):
    """A container ckpttool wrote before the header carried its digest (commit 8f97bfb, kept in
    tests/containers) restores byte for byte."""
    old = Path(__file__).parent / "containers" / "v1_model_safetensors.ckz"
    assert old.read_bytes()[:11] == b"CKPTDELTA1\n" and delta.read_header(old)["version"] == 1
    out = tmp_path / "model.safetensors"
    assert run_cli("decompress", old, "-o", out).code == 0
    assert out.read_bytes() == (FIXTURES / "safetensors" / "model.safetensors").read_bytes()


def test_a_version_1_container_is_still_read(tmp_path):
    """Containers written before the header had its digest (CKPTDELTA1) restore as before."""
    packed = tmp_path / "p.ckz"
    delta.create(FIXTURES / "dcp" / "fsdp2", packed)
    from tests.test_fuzz import split_container

    body, header = split_container(packed.read_bytes())
    header["version"] = 1
    blob = json.dumps(header).encode()
    old = b"CKPTDELTA1\n"
    packed.write_bytes(old + body[len(old) :] + blob + struct.pack("<Q", len(blob)) + old)
    assert delta.read_header(packed)["version"] == 1
    assert run_cli("decompress", packed, "-o", tmp_path / "out").code == 0
    assert tree_digests(tmp_path / "out") == tree_digests(FIXTURES / "dcp" / "fsdp2")
    packed.write_bytes(b"CKPTDELTA3\n" + packed.read_bytes()[11:])
    assert_clean(run_cli("decompress", packed, "-o", tmp_path / "o3"), 3, "a container of a newer ckpttool (CKPTDELTA3)")


@pytest.mark.parametrize("fixture", ["dist_tp2", "legacy_tp2pp2"])
def test_a_base_given_at_another_level_codes_as_well(tmp_path, fixture):
    """Target as a save directory, base as its iteration folder (or the other way round): the
    non-tensor bytes are coded against the base's file of the same place (a ``dict_file``), and
    the tensors against its pieces, as well as when both are given alike. (A legacy save
    directory's manifest is rooted at it, with no prefix to strip: its files found no twin, and
    its delta was twice the size.)"""
    save = FIXTURES / "megatron" / fixture
    alike, across, back = (tmp_path / n for n in ("alike.delta", "across.delta", "back.delta"))
    delta.create(save, alike, base=save)
    delta.create(save, across, base=save / "iter_0000003")
    delta.create(save / "iter_0000003", back, base=save)
    same = delta.info(alike)["coded"]
    assert delta.info(across)["coded"] <= same + 64 and delta.info(back)["coded"] <= same + 64
    assert delta.info(across)["methods"] == delta.info(alike)["methods"]
    files = delta.read_header(across)["files"]
    twin = "common.pt" if fixture.startswith("dist") else "mp_rank_00_000/model_optim_rng.pt"
    assert files[f"iter_0000003/{twin}"]["other"]["dict_file"] == twin
    delta.apply(across, tmp_path / "out", base=save / "iter_0000003")
    assert tree_digests(tmp_path / "out") == tree_digests(save)
    delta.apply(back, tmp_path / "out_back", base=save)
    assert tree_digests(tmp_path / "out_back") == tree_digests(save / "iter_0000003")


def test_execute_bits_survive_and_a_container_cannot_grant_more(tmp_path):
    """DeepSpeed saves its recovery scripts executable beside the checkpoint (zero_to_fp32.py):
    compress and delta kept their bytes but dropped the bit. They keep it now, as cp does (under
    the umask); a container's set-uid, set-gid or sticky bits are never applied."""
    import os
    import stat

    src = FIXTURES / "deepspeed" / "zero2"
    scripts = [p.name for p in src.iterdir() if p.is_file() and os.access(p, os.X_OK)]
    assert "zero_to_fp32.py" in scripts
    packed, out = tmp_path / "p.ckz", tmp_path / "out"
    delta.create(src, packed)
    delta.apply(packed, out)
    for p in out.iterdir():
        if p.is_file():
            assert os.access(p, os.X_OK) == (p.name in scripts), p.name
    d, out2 = tmp_path / "d.delta", tmp_path / "out2"
    delta.create(src, d, base=FIXTURES / "deepspeed" / "zero1")
    delta.apply(d, out2, base=FIXTURES / "deepspeed" / "zero1")
    assert os.access(out2 / "zero_to_fp32.py", os.X_OK) and not os.access(out2 / "latest", os.X_OK)

    def grant(h):
        for spec in h["files"].values():
            spec["mode"] = 0o7777
    _edit_header(packed, grant)
    out3 = tmp_path / "out3"
    delta.apply(packed, out3)
    for p in out3.rglob("*"):
        if p.is_file():
            mode = stat.S_IMODE(p.stat().st_mode)
            assert not mode & (stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX), (p, oct(mode))

    def forget(h):  # a container made before modes were kept

        for spec in h["files"].values():
            del spec["mode"]
    _edit_header(packed, forget)
    out4 = tmp_path / "out4"
    delta.apply(packed, out4)
    assert tree_digests(out4) == tree_digests(src) and not os.access(out4 / "zero_to_fp32.py", os.X_OK)


def test_a_null_mode_in_a_container_header_is_no_mode(tmp_path):
    """The header check takes "mode": null (as absent); apply then did None & 0o111, an internal error."""
    packed = tmp_path / "p.ckz"
    delta.create(FIXTURES / "deepspeed" / "zero1", packed)

    def null(h):
        for spec in h["files"].values():
            spec["mode"] = None

    _edit_header(packed, null)
    out = tmp_path / "out"
    r = run_cli("decompress", packed, "-o", out)
    assert r.code == 0, r.stderr
    assert tree_digests(out) == tree_digests(FIXTURES / "deepspeed" / "zero1")


def test_a_complex128_tensor_packs_and_comes_back(tmp_path):
    """A 16-byte element (complex128) was written stored with width 16, which the reader's header
    check refused: the archive could never be read, and with --force it had replaced a good one."""
    import torch

    src = tmp_path / "c.pt"
    torch.save({"a": torch.randn(1000, dtype=torch.complex128), "b": torch.randn(100)}, src)
    packed = tmp_path / "c.ckz"
    assert run_cli("compress", src, "-o", packed).code == 0
    r = run_cli("decompress", packed, "-o", tmp_path / "back.pt")
    assert r.code == 0 and (tmp_path / "back.pt").read_bytes() == src.read_bytes(), r.stderr
    target = tmp_path / "c2.pt"
    torch.save({"a": torch.randn(1000, dtype=torch.complex128), "b": torch.randn(100)}, target)
    d = tmp_path / "c.delta"
    assert run_cli("delta", "create", src, target, "-o", d).code == 0
    r = run_cli("delta", "apply", src, d, "-o", tmp_path / "back2.pt")
    assert r.code == 0 and (tmp_path / "back2.pt").read_bytes() == target.read_bytes(), r.stderr


def test_a_container_its_reader_would_refuse_is_never_written(tmp_path):
    """A file named with a backslash (legal on POSIX; a separator to the reader, which refuses
    names that could leave the output): compress wrote the archive, and decompress refused it. The
    header is now checked as the reader will before anything is published: nothing is written, and
    an earlier output given --force stays."""
    src = tmp_path / "odd"
    shutil.copytree(RUN / "step_10", src)
    (src / "\\lead").write_text("a")
    out = tmp_path / "odd.ckz"
    assert run_cli("compress", RUN / "step_10", "-o", out).code == 0  # (an earlier output)
    earlier = out.read_bytes()
    r = run_cli("compress", src, "-o", out, "--force")
    assert r.code == 3 and "odd: cannot be packed: file name '\\\\lead' leaves the output directory" in r.stderr
    assert "Traceback" not in r.stderr and out.read_bytes() == earlier
    assert sorted(p.name for p in tmp_path.iterdir()) == ["odd", "odd.ckz"]


def _other_as_tensors(spec):
    """No "other" entry, its gaps given to stored tensors instead: the file is still tiled (the
    check that caught a plain removal), and only the entry's absence is left to refuse."""
    other = spec.pop("other")
    (start, _), *_ = other["frames"]
    for off, n in other["gaps"]:
        spec["tensors"].append(
            {"offset": off, "length": n, "method": "stored", "width": 1, "floating": False, "sizes": [n],
             "kind": "other", "base": None, "frames": [[start, n]]}
        )  # fmt: skip


@pytest.mark.parametrize(
    "edit",
    [
        lambda h: h["files"]["__0_0.distcp"]["tensors"][0].pop("base"),
        lambda h: h["files"][".metadata"]["other"].pop("dict"),
        lambda h: _other_as_tensors(h["files"]["__0_0.distcp"]),
    ],
    ids=["tensor-base", "other-dict", "other"],
)
def test_a_header_missing_a_field_is_refused_not_an_internal_error(edit, tmp_path):
    packed = tmp_path / "p.ckz"
    delta.create(RUN / "step_10", packed)
    _edit_header(packed, edit)
    r = run_cli("decompress", packed, "-o", tmp_path / "out")
    assert r.code == 3 and "damaged or forged container header" in r.stderr, r.stderr
    assert "internal error" not in r.stderr and not (tmp_path / "out").exists()


def test_damaged_coded_bytes_of_a_compressed_checkpoint_are_damage_exit_3(tmp_path):
    """Without a base, a rebuilt file that misses its stored hash can only be damage to the
    container (it exited 1, the code of a delta applied to the wrong base)."""
    packed = tmp_path / "p.ckz"
    delta.create(RUN / "step_10", packed)
    data = bytearray(packed.read_bytes())
    size = len(data)
    coded = delta.read_header(packed)["files"]["__0_0.distcp"]["tensors"]
    stored = [t for t in coded if t["method"] == "stored"]  # (its bytes as they are: no frame to fail)
    off = stored[0]["frames"][0][0] + 8
    data[off] ^= 0xFF
    packed.write_bytes(bytes(data))
    assert len(data) == size
    r = run_cli("decompress", packed, "-o", tmp_path / "out")
    assert r.code == 3 and "rebuilding __0_0.distcp does not give the stored xxh3-128" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()


def test_a_delta_against_a_save_directory_outlives_its_next_save(tmp_path):
    """A base given as a Megatron legacy or DeepSpeed save directory: the delta recorded the
    tracker's bytes as part of the base, so the next save into that directory (tracker 3 -> 4, the
    iteration folder untouched) made the delta refuse its base. The tracker is not a base file now;
    the iteration's files still are."""
    for kind, tracker in (("megatron/legacy_tp2pp2", "latest_checkpointed_iteration.txt"), ("deepspeed/zero2", "latest")):
        base, target = tmp_path / "base", tmp_path / "target"
        shutil.copytree(FIXTURES / kind, base)
        shutil.copytree(FIXTURES / kind, target)
        d = tmp_path / "d.delta"
        delta.create(target, d, base=base)
        assert tracker not in delta.read_header(d)["base"]["files"] and delta.read_header(d)["base"]["files"]
        (base / tracker).write_text((base / tracker).read_text().replace("3", "4"))
        out = tmp_path / "out"
        r = run_cli("delta", "apply", base, d, "-o", out)
        assert r.code == 0, r.stderr
        assert tree_digests(out) == tree_digests(FIXTURES / kind)
        victim = next(p for p in base.rglob("*.pt"))
        data = bytearray(victim.read_bytes())
        data[-1] ^= 1
        victim.write_bytes(bytes(data))  # the iteration's own files are still checked
        r = run_cli("delta", "apply", base, d, "-o", tmp_path / "out2")
        assert r.code == 1 and "is not the file the delta was made against" in r.stderr, r.stderr
        for p in (base, target, out, d):
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def test_a_sealed_checkpoint_comes_back_sealed_and_its_modes_kept(tmp_path):
    """compress left the seal out (a restored milestone could no longer be verified against it),
    and gave every file the umask's modes (a private 0600 file came back world-readable)."""
    import os
    import stat

    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "deepspeed" / "zero2", src)
    assert run_cli("seal", src).code == 0
    private = src / "global_step3" / "mp_rank_00_model_states.pt"
    private.chmod(0o600)
    (src / "latest").chmod(0o444)
    packed, out = tmp_path / "p.ckz", tmp_path / "out"
    assert run_cli("compress", src, "-o", packed).code == 0
    r = run_cli("decompress", packed, "-o", out)
    assert r.code == 0, r.stderr
    assert tree_digests(out) == tree_digests(src) and (out / "ckpttool.manifest.json").is_file()
    modes = {p.relative_to(out): stat.S_IMODE(p.stat().st_mode) for p in out.rglob("*") if p.is_file()}
    umask = os.umask(0)
    os.umask(umask)
    for p in src.rglob("*"):
        if p.is_file():
            assert modes[p.relative_to(src)] == stat.S_IMODE(p.stat().st_mode) & ~umask, p
    r = run_cli("verify", out, "--json")
    assert r.code == 0 and json.loads(r.stdout)["inputs"]["seal"], r.stdout
    # a sealed base is a base all the same: its seal is not a file the delta depends on
    d = tmp_path / "d.delta"
    delta.create(FIXTURES / "deepspeed" / "zero1", d, base=src)
    assert not any("manifest" in rel for rel in delta.read_header(d)["base"]["files"])


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (lambda h: h.update(version=3), "container version 3 in a version 2 container"),
        (lambda h: h.pop("version"), "container version None in a version 2 container"),
        (lambda h: h["files"].update({".": h["files"].pop(".metadata")}), "is not a plain relative path"),
        (lambda h: h["files"].update({"a//b": h["files"].pop(".metadata")}), "is not a plain relative path"),
        (
            lambda h: h["files"].update({"x": h["files"].pop(".metadata"), "x/y": h["files"].pop("__0_0.distcp")}),
            "'x' is both a file and the folder of another file",
        ),
    ],
    ids=["newer", "none", "dot", "empty-part", "file-and-folder"],
)
def test_a_header_a_reader_cannot_honour_is_refused_by_name(edit, reason, tmp_path):
    """A container from a newer ckpttool was read as if it were version 1; members named '.' or
    'a' beside 'a/x' failed on the file system half way through (an OS error, not the header)."""
    packed = tmp_path / "p.ckz"
    delta.create(RUN / "step_10", packed)
    _edit_header(packed, edit)
    r = run_cli("decompress", packed, "-o", tmp_path / "out")
    assert r.code == 3 and "damaged or forged container header" in r.stderr and reason in r.stderr, r.stderr
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["p.ckz"]


def test_force_replaces_an_earlier_container_never_other_data(tmp_path):
    """compress and delta create --force replaced any file at -o (notes, a checkpoint's own
    torch.save file) where decompress, seal --out and verify --report refuse other data. Now an
    earlier container or an empty file is replaced; anything else is kept, exit 2."""
    src = FIXTURES / "dcp" / "fsdp2"
    notes = tmp_path / "notes.txt"
    notes.write_text("do not lose me\n")
    for args in (("compress", src), ("delta", "create", src, src)):
        r = run_cli(*args, "-o", notes, "--force")
        assert_clean(r, 2, "exists and is not a ckpttool container")
        assert notes.read_text() == "do not lose me\n"
    out = tmp_path / "c.ckz"
    out.write_bytes(b"")
    for _ in range(2):  # (an empty file, then the container written over it)
        assert run_cli("compress", src, "-o", out, "--force").code == 0


def test_a_delta_and_a_container_given_to_the_wrong_command_say_which_command_takes_them(tmp_path):
    """decompress of a delta said "give the base checkpoint", which decompress takes no option
    for; delta apply of a compressed checkpoint said "it takes no base" without naming decompress.
    Each now gives the command that reads it, exit 2."""
    src = FIXTURES / "dcp" / "fsdp2"
    assert run_cli("delta", "create", src, src, "-o", tmp_path / "x.delta").code == 0
    assert run_cli("compress", src, "-o", tmp_path / "x.ckz").code == 0
    assert_clean(run_cli("decompress", tmp_path / "x.delta", "-o", tmp_path / "o1"), 2, "hint: ckpttool delta apply BASE")
    assert_clean(run_cli("delta", "apply", src, tmp_path / "x.ckz", "-o", tmp_path / "o2"), 2, "hint: ckpttool decompress")


def test_a_file_that_merely_holds_the_temporary_marker_is_packed(tmp_path):
    """Any file whose name held ".ckpttool-tmp-" (``notes.ckpttool-tmp-1``) was left out of the
    container without a word, as if it were a writer's temporary; only ckpttool's own hidden
    temporaries (``.<name>.ckpttool-tmp-…``) are left out now."""
    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / "dcp" / "fsdp2", ck)
    (ck / "notes.ckpttool-tmp-1").write_text("kept\n")
    (ck / ".model.ckpttool-tmp-host-1-abcd1234").write_text("a writer's temporary\n")
    assert run_cli("compress", ck, "-o", tmp_path / "c.ckz").code == 0
    assert run_cli("decompress", tmp_path / "c.ckz", "-o", tmp_path / "out").code == 0
    assert (tmp_path / "out" / "notes.ckpttool-tmp-1").read_text() == "kept\n"
    assert not (tmp_path / "out" / ".model.ckpttool-tmp-host-1-abcd1234").exists()


def test_pieces_coded_ahead_of_the_writer_are_bounded():
    """create coded every piece at once (pool.map) while writing the frames in order: with a
    writer slower than the coders the whole container sat in memory. At most a window of pieces
    is now coded ahead of the one being written."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from ckpttool.delta import _in_order

    lock = threading.Lock()
    coded = [0]

    def code(job):
        with lock:
            coded[0] += 1
        return job

    most = 0
    with ThreadPoolExecutor(max_workers=4) as pool:
        for written, got in enumerate(_in_order(pool, code, list(range(200)), 8), start=1):
            time.sleep(0.001)  # (a slow writer)
            with lock:
                most = max(most, coded[0] - written)
            assert got == written - 1  # (in order)
    assert most <= 8, most


def test_create_codes_at_most_a_window_of_pieces_ahead_of_its_writer(tmp_path, monkeypatch):
    """The same, through create itself: when the first frame is written, no more than twice the
    workers' pieces have been handed to the coders (pool.map had handed them all)."""
    import contextlib
    from concurrent.futures import ThreadPoolExecutor

    submitted = [0]
    seen: list[int] = []

    class Counting(ThreadPoolExecutor):
        def submit(self, *args, **kwargs):
            submitted[0] += 1
            return super().submit(*args, **kwargs)

    real = delta.atomic_output

    @contextlib.contextmanager
    def watched(dest, **kwargs):
        with real(dest, **kwargs) as fh:

            class Writer:
                def write(self, data):
                    seen.append(submitted[0])
                    return fh.write(data)

                def __getattr__(self, name):
                    return getattr(fh, name)

            yield Writer()

    monkeypatch.setattr(delta, "ThreadPoolExecutor", Counting)
    monkeypatch.setattr(delta, "atomic_output", watched)
    header = delta.create(FIXTURES / "dcp" / "fsdp2", tmp_path / "c.ckz", workers=2)
    pieces = sum(len(f["tensors"]) + (f["other"] is not None) for f in header["files"].values())
    assert pieces > 8 and submitted[0] == pieces
    assert seen[1] <= 4, seen[:3]  # (seen[0]: the magic, before any piece; seen[1]: the first frame)


def test_a_one_file_base_is_the_file_given_whatever_its_name(tmp_path):
    """A delta made against one file was applied by the file's recorded name: the chain's previous
    output (restored under another name), a renamed copy or a hub blob link was refused as
    "<name> is not there", and a file of the recorded name lying beside the one given was used
    in its place. The file given is the base now; its bytes are still checked (a wrong one: exit 1)."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 64, generator=g)
    for step in ("a", "b", "c"):
        w = w + 1e-3 * torch.randn(64, 64, generator=g)
        save_file({"w": w.contiguous()}, tmp_path / f"step_{step}.safetensors")
    for a, b, d in (("a", "b", "d1"), ("b", "c", "d2")):
        r = run_cli("delta", "create", tmp_path / f"step_{a}.safetensors", tmp_path / f"step_{b}.safetensors", "-o", tmp_path / f"{d}.delta")
        assert r.code == 0, r.stderr
    (tmp_path / "chain").mkdir()
    assert run_cli("delta", "apply", tmp_path / "step_a.safetensors", tmp_path / "d1.delta", "-o", tmp_path / "chain" / "b.safetensors").code == 0
    (tmp_path / "chain" / "step_b.safetensors").write_bytes((tmp_path / "step_a.safetensors").read_bytes())  # (a decoy by the recorded name)
    r = run_cli("delta", "apply", tmp_path / "chain" / "b.safetensors", tmp_path / "d2.delta", "-o", tmp_path / "c.safetensors")
    assert r.code == 0, r.stderr
    assert (tmp_path / "c.safetensors").read_bytes() == (tmp_path / "step_c.safetensors").read_bytes()
    scratch = tmp_path / "tmpdir"
    scratch.mkdir()
    r = run_cli("delta", "apply", tmp_path / "step_a.safetensors", tmp_path / "d2.delta", "-o", tmp_path / "wrong.safetensors", env={"TMPDIR": str(scratch)})
    assert r.code == 1 and not (tmp_path / "wrong.safetensors").exists(), r.stderr
    assert "step_a.safetensors: not the file the delta was made against (step_b.safetensors" in r.stderr, r.stderr
    assert list(scratch.iterdir()) == []  # (the folder naming the file given as the recorded one: removed)


def test_a_link_to_a_folder_inside_is_said_to_be_left_out(tmp_path):
    """A link to a folder inside the checkpoint is not packed (os.walk does not go into it), and
    compress said nothing of it: the warning that lists what the container lacks names it now."""
    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / "dcp" / "fsdp2", ck)
    (ck / "sub").mkdir()
    (ck / "sub" / "b.txt").write_text("y\n")
    (ck / "sub_link").symlink_to("sub")
    r = run_cli("compress", ck, "-o", tmp_path / "c.ckz")
    assert r.code == 0 and "not in the container" in r.stderr and "sub_link/ (a link to a folder)" in r.stderr, r.stderr


_CUT_SHORT = r"""
import os, sys
from pathlib import Path
from ckpttool import codec
victim, hook = Path(sys.argv[1]), sys.argv[2]
real = getattr(codec, hook)
def cut_then(*args, **kwargs):
    if victim.stat().st_size:
        os.truncate(victim, 0)  # as a save that rewrites the file in place ('wb') does
    return real(*args, **kwargs)
setattr(codec, hook, cut_then)
sys.argv = ["ckpttool", *sys.argv[3:]]
from ckpttool.cli import main
main()
"""


@pytest.mark.parametrize(
    "victim, hook, command, said",
    [
        ("step_11", "encode_best", ["compress", "{step_11}", "-o", "{out}"], "step_11: __0_0.distcp changed while being packed"),
        ("step_11", "encode_best", ["delta", "create", "{step_10}", "{step_11}", "-o", "{out}"], "changed while being packed"),
        ("step_10", "encode_best", ["delta", "create", "{step_10}", "{step_11}", "-o", "{out}"], "changed while the delta was coded against it"),
        ("step_10", "decode_into", ["delta", "apply", "{step_10}", "{delta}", "-o", "{out}"], "is 0 bytes but the checkpoint needs bytes"),
    ],
    ids=["compress-target", "create-target", "create-base", "apply-base"],
)
def test_a_file_cut_short_under_a_run_is_an_error_not_a_crash(tmp_path, victim, hook, command, said):
    """A checkpoint file truncated while compress, delta create or delta apply reads it (a save
    rewriting it in place): the files were memory-mapped, and the first touch of a page past the new
    end killed the process with SIGBUS (exit -7, no message). Now the short read is an error naming the file, exit 3, and nothing is written."""
    import subprocess
    import sys

    for step in ("step_10", "step_11"):
        shutil.copytree(RUN / step, tmp_path / step)
    d = tmp_path / "d.delta"
    delta.create(tmp_path / "step_11", d, base=tmp_path / "step_10")
    out = tmp_path / "out"
    args = [a.format(step_10=tmp_path / "step_10", step_11=tmp_path / "step_11", delta=d, out=out) for a in command]
    r = subprocess.run(
        [sys.executable, "-c", _CUT_SHORT, str(tmp_path / victim / "__0_0.distcp"), hook, *args, "--workers", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1"},
    )
    assert r.returncode == 3, (r.returncode, r.stderr)
    assert said in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert victim in r.stderr and "__0_0.distcp" in r.stderr  # (the file, named)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.delta", "step_10", "step_11"]
