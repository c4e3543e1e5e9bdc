"""Outputs written around the page cache (ckpttool._directwrite), and temporaries named before
they are made (ckpttool.io.atomic_output, staged_dir)."""

from __future__ import annotations

import errno
import filecmp
import os
import random
import subprocess
import sys

import pytest

from ckpttool import _directwrite, io
from ckpttool._directwrite import STAGE, DirectFile, direct_ok, open_direct

SIZES = [0, 1, 4095, 4096, STAGE - 1, STAGE, STAGE + 1, 3 * STAGE, 2 * STAGE + 12345]


def _write(path, total: int, seed: int) -> bytes:
    """Write ``total`` bytes in writes of mixed sizes (1 byte to several buffers); returns them."""
    rng = random.Random(seed)
    out = bytearray()
    with DirectFile(path) as f:
        while len(out) < total:
            n = min(total - len(out), rng.choice([1, 63, 4096, 1 << 20, STAGE + 7, 3 * STAGE]))
            chunk = rng.randbytes(min(n, 4096)) * (n // 4096) + rng.randbytes(n % 4096)
            assert f.write(memoryview(chunk)) == n
            out += chunk
            assert f.tell() == len(out)
    return bytes(out)


@pytest.mark.parametrize("total", SIZES)
def test_the_file_holds_every_byte_written(tmp_path, total):
    data = _write(tmp_path / "f", total, total)
    assert (tmp_path / "f").read_bytes() == data


def test_direct_writes_are_used_from_the_first_full_buffer(tmp_path):
    """A file of a buffer or more goes with O_DIRECT where the file system takes it (so
    start_writeback skips it), a smaller one is a plain write."""
    if not direct_ok(tmp_path):
        pytest.skip("the temporary directory's file system is not one direct writes are used on")
    with DirectFile(tmp_path / "small") as f:
        f.write(b"x" * (STAGE - 1))
        assert not f.direct and not f.writeback  # nothing handed to the kernel yet
    with DirectFile(tmp_path / "big") as f:
        f.write(b"x" * (STAGE + 1))
        assert f.direct and not f.writeback
    assert (tmp_path / "big").read_bytes() == b"x" * (STAGE + 1)


def test_a_refused_o_direct_writes_through_the_cache(tmp_path, monkeypatch):
    real = _directwrite.fcntl.fcntl

    def refuse(fd, cmd, arg=0):
        if cmd == _directwrite.fcntl.F_SETFL and arg & _directwrite._O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, cmd, arg)

    monkeypatch.setattr(_directwrite.fcntl, "fcntl", refuse)
    with DirectFile(tmp_path / "f") as f:
        f.write(b"ab" * STAGE)
        assert not f.direct and f.writeback
    assert (tmp_path / "f").read_bytes() == b"ab" * STAGE


def test_a_failed_write_is_raised_and_nothing_is_leaked(tmp_path, monkeypatch):
    """A write error on the helper thread (a full disk) comes back to the writer, the descriptor is
    closed and the staging buffers go back to the pool."""

    def full(fd, view, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_directwrite.os, "pwrite", full)
    pooled = len(_directwrite._pool)
    f = DirectFile(tmp_path / "f")
    with pytest.raises(OSError, match="No space"), f:
        f.write(b"x" * (3 * STAGE))
    assert f.fd == -1 and f.closed
    assert len(_directwrite._pool) == max(pooled, _directwrite.DEPTH + 1)  # the buffers it took, back


def test_the_switch_and_the_file_systems(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTTOOL_DIRECT_WRITE", "0")
    assert not direct_ok(tmp_path)
    with open_direct(tmp_path / "f") as f:
        assert not isinstance(f, DirectFile)
    monkeypatch.setenv("CKPTTOOL_DIRECT_WRITE", "1")
    assert direct_ok(tmp_path) == bool(_directwrite._O_DIRECT)
    monkeypatch.delenv("CKPTTOOL_DIRECT_WRITE")
    if os.path.isdir("/dev/shm") and sys.platform.startswith("linux"):
        assert _directwrite._fs_type(os.stat("/dev/shm").st_dev) == "tmpfs"
        assert not direct_ok("/dev/shm")


def test_the_writers_outputs_go_through_direct_files(tmp_path, monkeypatch):
    """open_output (every reshard and convert writer) and atomic_output (export, compress, delta,
    seal) give DirectFiles where direct writes are on, plain files where off: the reshard below
    compares the two paths, which would be one path without this wiring."""
    from ckpttool.hashing import collecting_written, open_output

    if not _directwrite._O_DIRECT:
        pytest.skip("no O_DIRECT on this system")
    for mode, want in (("1", True), ("0", False)):
        monkeypatch.setenv("CKPTTOOL_DIRECT_WRITE", mode)
        with open_output(tmp_path / f"a{mode}") as f:
            assert isinstance(f, DirectFile) is want
        with collecting_written(), open_output(tmp_path / f"b{mode}") as f:
            assert isinstance(f.fh, DirectFile) is want  # (a HashingFile around it)
        with io.atomic_output(tmp_path / f"c{mode}") as f:
            assert isinstance(f, DirectFile) is want


def test_reshard_writes_the_same_bytes_either_way(tmp_path):
    """A reshard whose rank files span several staging buffers, written with direct writes forced
    on and off: the same files."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    # (a one-rank source: at --dp 2 its parameters are cut in two, each half 16.8 MB)
    state = {"w": torch.randn(4096, 2048, generator=g), "b": torch.randn(777, generator=g).half()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=tmp_path / "src")
    outs = []
    for mode in ("0", "1"):
        out = tmp_path / f"out{mode}"
        env = {**os.environ, "CKPTTOOL_DIRECT_WRITE": mode}
        cmd = [sys.executable, "-m", "ckpttool", "reshard", str(tmp_path / "src"), "-o", str(out), "--dp", "2", "-q"]
        subprocess.run(cmd, check=True, env=env, cwd=tmp_path)
        outs.append(out)
    names = sorted(p.name for p in outs[0].iterdir() if p.name != "ckpttool.manifest.json")  # (names its path)
    assert names == sorted(p.name for p in outs[1].iterdir() if p.name != "ckpttool.manifest.json")
    assert max((outs[1] / n).stat().st_size for n in names) > 1.5 * STAGE
    _, mismatch, errors = filecmp.cmpfiles(outs[0], outs[1], names, shallow=False)
    assert not mismatch and not errors
    # the seal took its digests as the bytes went out: a full check against it finds them
    verify = [sys.executable, "-m", "ckpttool", "verify", str(outs[1]), "-q"]
    assert subprocess.run(verify, cwd=tmp_path).returncode == 0


def test_an_interrupt_right_after_the_temporary_is_made_leaves_nothing(tmp_path, monkeypatch):
    """Ctrl-C landing after the temporary file or directory exists but before the call that made
    it returns: the temporary is still removed (it is named before it is made)."""
    real_open, real_mkdir = os.open, os.mkdir

    def open_then_interrupt(path, flags, mode=0o777):
        fd = real_open(path, flags, mode)
        if str(path).startswith(str(tmp_path)):
            os.close(fd)
            raise KeyboardInterrupt
        return fd

    def mkdir_then_interrupt(path, mode=0o777):
        real_mkdir(path, mode)
        raise KeyboardInterrupt

    monkeypatch.setattr(io.os, "open", open_then_interrupt)
    with pytest.raises(KeyboardInterrupt), io.atomic_output(tmp_path / "out.bin") as f:
        f.write(b"never")
    monkeypatch.setattr(io.os, "open", real_open)
    monkeypatch.setattr(io.os, "mkdir", mkdir_then_interrupt)
    with pytest.raises(KeyboardInterrupt), io.staged_dir(tmp_path / "outdir"):
        pass
    assert list(tmp_path.iterdir()) == []


def test_temporaries_get_the_modes_plain_ones_would(tmp_path):
    umask = os.umask(0o022)
    try:
        with io.atomic_output(tmp_path / "f") as f:
            f.write(b"x")
        with io.staged_dir(tmp_path / "d") as d:
            io.publish_dir(d, tmp_path / "d")
    finally:
        os.umask(umask)
    assert (tmp_path / "f").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "d").stat().st_mode & 0o777 == 0o755


def test_flush_hands_every_byte_to_the_kernel(tmp_path):
    """flush writes what is staged (then fsync makes it durable); writes after it go on through
    the cache, at unaligned offsets."""
    with DirectFile(tmp_path / "f") as f:
        f.write(b"a" * (STAGE + 100))
        f.flush()
        assert (tmp_path / "f").read_bytes() == b"a" * (STAGE + 100)
        assert not f.direct and f.writeback
        f.write(b"b" * (2 * STAGE))
    assert (tmp_path / "f").read_bytes() == b"a" * (STAGE + 100) + b"b" * (2 * STAGE)


def test_atomic_output_writes_large_files_whole(tmp_path):
    data = random.Random(3).randbytes(3 * STAGE + 5)
    with io.atomic_output(tmp_path / "out.bin") as f:
        f.write(data[:100])
        f.write(data[100:])
    assert (tmp_path / "out.bin").read_bytes() == data
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]


def test_a_forked_child_never_writes_into_the_parents_buffers(tmp_path):
    """Anonymous mappings are shared across fork unless private: a child's file held the parent's
    bytes."""
    with DirectFile(tmp_path / "warm") as f:  # the pool holds buffers from now on
        f.write(b"w" * (STAGE + 1))
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        try:
            with DirectFile(tmp_path / "child") as f:
                f.write(b"C" * (2 * STAGE))
        finally:
            os._exit(0)
    with DirectFile(tmp_path / "parent") as f:
        f.write(b"P" * (2 * STAGE))
    os.waitpid(pid, 0)
    assert (tmp_path / "child").read_bytes() == b"C" * (2 * STAGE)
    assert (tmp_path / "parent").read_bytes() == b"P" * (2 * STAGE)


def test_an_interrupt_while_a_write_is_in_flight_is_raised_and_nothing_leaks(tmp_path, monkeypatch):
    """Ctrl-C lands while the writer waits for a write: the interrupt comes through (not a
    BufferError from releasing a view the kernel still reads), and the descriptor is closed."""
    import threading

    gate = threading.Event()
    real = _directwrite._pwrite_all

    def slow(fd, view, offset):
        gate.wait(5)
        real(fd, view, offset)

    monkeypatch.setattr(_directwrite, "_pwrite_all", slow)
    f = DirectFile(tmp_path / "f")
    real_result = type(_directwrite.helper("write").submit(lambda: None)).result
    calls = [0]

    def interrupted(self, timeout=None):
        calls[0] += 1
        if calls[0] == 1:
            threading.Timer(0.2, gate.set).start()
            raise KeyboardInterrupt
        return real_result(self, timeout)

    monkeypatch.setattr(type(_directwrite.helper("write").submit(lambda: None)), "result", interrupted)
    with pytest.raises(KeyboardInterrupt), f:
        f.write(b"x" * (3 * STAGE))
    assert f.fd == -1 and not f._pending


def test_multidimensional_byte_views_are_written_whole(tmp_path):
    import numpy as np

    a = np.arange(3 * 5000, dtype=np.uint8).reshape(3, 5000)
    with DirectFile(tmp_path / "f") as f:
        assert f.write(memoryview(a)) == a.nbytes
        f.write(np.arange(10, dtype=np.float32))
    assert (tmp_path / "f").read_bytes() == a.tobytes() + np.arange(10, dtype=np.float32).tobytes()
