"""ckpttool.io: the open-file limit of FileCache, and which writers count as gone."""

from __future__ import annotations

import numpy as np
import pytest

from ckpttool import registry
from ckpttool.assemble import assemble
from ckpttool.io import FileCache
from tests.conftest import FIXTURES


def test_the_limit_holds_for_kept_references(tmp_path):
    """A reader that kept a file object (an archive does) and reads it after the cache closed it to
    make room: the re-open goes through the cache, which closes another, so at most max_open stay
    open; reading after the cache is closed still works."""
    for i in range(40):
        (tmp_path / f"f{i}").write_bytes(bytes([i]) * 10)
    cache = FileCache(tmp_path, max_open=4)
    kept = [cache.get(f"f{i}") for i in range(40)]
    for _ in range(2):
        for i, f in enumerate(kept):
            assert f.read(0, 10) == bytes([i]) * 10
            assert sum(g.fd >= 0 for g in kept) <= 4
    cache.close()
    assert sum(g.fd >= 0 for g in kept) == 0
    assert kept[7].read(3, 2) == bytes([7]) * 2
    kept[7].close()


def test_a_reader_under_a_small_limit_reads_the_same_values():
    """Megatron legacy: four rank files read through kept archives with room for one open file."""
    adapter, m = registry.describe(FIXTURES / "megatron" / "legacy_tp2pp2")
    tensors = [i for i in m.items.values() if i.is_tensor and len(i.pieces) > 1]
    with adapter.reader(m) as reader:
        want = [assemble(reader, item).copy() for item in tensors]
    with adapter.reader(m) as reader:
        reader.files.max_open = 1
        for item, values in zip(tensors, want, strict=True):
            assert np.array_equal(assemble(reader, item), values)
            assert sum(f.fd >= 0 for f in reader.files._files.values()) <= 1


def test_a_killed_writer_not_yet_reaped_counts_as_gone(tmp_path):
    """A zombie (killed, its parent has not waited for it yet) writes nothing more: its temporaries
    are swept by the next run (under torchrun the dead ranks stay zombies until the launcher
    reaps them)."""
    import os
    import subprocess
    import sys
    import time

    from ckpttool import io as ckio

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    for _ in range(200):  # wait until it has exited, without reaping it
        with open(f"/proc/{child.pid}/stat", "rb") as fh:
            if fh.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                break
        time.sleep(0.01)
    else:
        pytest.fail("the child never became a zombie")
    try:
        assert not ckio._alive(child.pid)
        assert ckio._alive(os.getppid())
    finally:
        child.wait()
