"""The hashing pass of seal and verify: a large file hashed by several threads (lanes) gives the
digests one thread gives, stops on a cancel, a read error or a file cut short, and never hangs."""

from __future__ import annotations

import os
import random
import threading

import pytest
import xxhash

from ckpttool import hashing
from ckpttool import io as ckio
from ckpttool.hashing import CHUNK, Cancelled, Span, hash_file, hash_files


@pytest.fixture
def big(tmp_path, monkeypatch):
    """A 9.5 MiB file of random bytes, with lanes given to files of 1 MiB and more; each test that
    takes it must hash in lanes (not fall back on one thread, which would pass the checks too)."""
    monkeypatch.setattr(hashing, "LANE_MIN", CHUNK)
    in_lanes: list[int] = []
    real = hashing._hash_in_lanes

    def counted(*args, **kwargs):
        in_lanes.append(args[5])
        return real(*args, **kwargs)

    monkeypatch.setattr(hashing, "_hash_in_lanes", counted)
    data = random.Random(7).randbytes(9 * CHUNK + CHUNK // 2)
    (tmp_path / "big.bin").write_bytes(data)
    yield data
    assert in_lanes and min(in_lanes) > 1, "the file was not hashed in lanes"


def _spans(size: int, rng: random.Random) -> list[Span]:
    """Spans of every kind: overlapping, crossing chunks, inside one chunk, empty, at the end, CRC-32."""
    out = [Span(("whole", 0), 0, size), Span(("tail", 0), size - 5, 5), Span(("empty", 0), 3 * CHUNK, 0)]
    for k in range(40):
        at = rng.randrange(size)
        out.append(Span(("p", k), at, rng.randrange(min(3 * CHUNK, size - at) + 1), "crc32" if k % 3 == 0 else None))
    return out


@pytest.mark.parametrize("lanes", [2, 3, 5, 8, 16])
@pytest.mark.parametrize("algo", ["xxh3-128", "sha256"])
def test_lanes_give_the_digests_of_one_thread(big, tmp_path, lanes, algo):
    spans = _spans(len(big), random.Random(lanes))
    one, one_spans = hash_file(tmp_path, "big.bin", spans, algo)
    many, many_spans = hash_file(tmp_path, "big.bin", spans, algo, lanes=lanes)
    assert many == one and one.digest is not None and one.size == len(big)
    assert many_spans == one_spans and len(one_spans) == len({s.key for s in spans})
    assert one_spans[("tail", 0)] == hashing.hash_bytes(big[-5:], algo)
    if algo == "xxh3-128":
        assert one.digest == xxhash.xxh3_128(big).hexdigest()


def test_lanes_read_each_byte_once(big, tmp_path, monkeypatch):
    read: list[tuple[int, int]] = []
    real = ckio.preadinto

    def counting(fd, buf, offset):
        n = real(fd, buf, offset)
        read.append((offset, n))
        return n

    monkeypatch.setattr(ckio, "preadinto", counting)
    hash_file(tmp_path, "big.bin", _spans(len(big), random.Random(1)), "xxh3-128", lanes=6)
    assert sorted(read) == [(i * CHUNK, min(CHUNK, len(big) - i * CHUNK)) for i in range(10)]


def test_lanes_stop_when_cancelled(big, tmp_path):
    stop = threading.Event()
    seen: list[int] = []
    before = set(threading.enumerate())

    def progress(n: int) -> None:  # cancelled after the first chunk is hashed
        seen.append(n)
        stop.set()

    with pytest.raises(Cancelled):
        hash_files(tmp_path, ["big.bin"], {}, progress=progress, cancel=stop, workers=6)
    assert seen == [CHUNK]
    assert set(threading.enumerate()) <= before  # (no lane left waiting)


def test_lanes_say_a_file_cut_short_while_read(big, tmp_path, monkeypatch):
    real = ckio.preadinto
    path = tmp_path / "big.bin"

    def cutting(fd, buf, offset):
        if offset >= 4 * CHUNK and path.stat().st_size > 4 * CHUNK:
            os.truncate(path, 4 * CHUNK + 100)  # a writer truncates the file under the pass
        return real(fd, buf, offset)

    monkeypatch.setattr(ckio, "preadinto", cutting)
    got, spans = hash_file(tmp_path, "big.bin", _spans(len(big), random.Random(2)), "xxh3-128", lanes=5)
    assert got.changed and got.digest is None and spans == {}
    assert "ended after" in (got.error or "") or "once read" in (got.error or ""), got.error


def test_lanes_say_a_read_error(big, tmp_path, monkeypatch):
    real = ckio.preadinto

    def failing(fd, buf, offset):
        if offset == 6 * CHUNK:
            raise OSError(5, "Input/output error")
        return real(fd, buf, offset)

    monkeypatch.setattr(ckio, "preadinto", failing)
    got, spans = hash_file(tmp_path, "big.bin", _spans(len(big), random.Random(3)), "xxh3-128", lanes=4)
    assert got.digest is None and got.error == "[Errno 5] Input/output error" and spans == {}


def test_threads_go_to_the_large_files(tmp_path, monkeypatch):
    """The pool's threads beyond one a file go to the files of LANE_MIN bytes or more, evenly."""
    monkeypatch.setattr(hashing, "LANE_MIN", 1000)
    for k in range(3):
        (tmp_path / f"large{k}").write_bytes(bytes(2000))
    for k in range(4):
        (tmp_path / f"small{k}").write_bytes(bytes(10))
    given: dict[str, int] = {}
    real = hashing.hash_file

    def recording(root, rel, spans, algo, progress, cancel, lanes=1):
        given[rel] = lanes
        return real(root, rel, spans, algo, progress, cancel, lanes)

    monkeypatch.setattr(hashing, "hash_file", recording)
    files = sorted(p.name for p in tmp_path.iterdir())
    digests, _ = hash_files(tmp_path, files, {}, workers=16)
    assert {rel: d.digest for rel, d in digests.items()} == {
        rel: xxhash.xxh3_128((tmp_path / rel).read_bytes()).hexdigest() for rel in files
    }
    assert given == {**{f"large{k}": 4 for k in range(3)}, **{f"small{k}": 4 for k in range(4)}}
    assert hashing.lanes_for([2000, 2000, 10], 8) == 3 and hashing.lanes_for([10, 10], 8) == 1
    hash_files(tmp_path, files, {}, workers=2)
    assert set(given.values()) == {1}


def test_lanes_end_when_a_file_is_cut_short_under_a_slow_reader(tmp_path, monkeypatch):
    """A reader that had gone ahead waits for a buffer that the chunks past the new end will never
    free: it stops once the end is known (it waited for ever, and the pass with it)."""
    import time

    chunk = 4096
    monkeypatch.setattr(hashing, "CHUNK", chunk)
    monkeypatch.setattr(hashing, "LANE_MIN", chunk)
    path = tmp_path / "f"
    path.write_bytes(random.Random(5).randbytes(40 * chunk))
    real = ckio.preadinto

    def steered(fd, buf, offset):
        if offset // chunk == 3:
            time.sleep(0.3)
            os.truncate(path, 3 * chunk + chunk // 2)
        if offset // chunk == 5:
            time.sleep(0.6)
        return real(fd, buf, offset)

    monkeypatch.setattr(ckio, "preadinto", steered)
    got: list = []
    worker = threading.Thread(target=lambda: got.append(hash_file(tmp_path, "f", [], "xxh3-128", lanes=4)), daemon=True)
    worker.start()
    worker.join(20)
    assert not worker.is_alive(), "the pass hung"
    assert got[0][0].changed and got[0][0].digest is None


@pytest.mark.parametrize("lanes", [2, 3, 4, 6])
def test_lanes_use_the_threads_given(big, tmp_path, monkeypatch, lanes):
    """``lanes`` counts the calling thread: two lanes are one reader beside it, which then feeds the
    spans too."""
    started: list[threading.Thread] = []
    real = threading.Thread.start

    def counting(self):
        started.append(self)
        real(self)

    monkeypatch.setattr(threading.Thread, "start", counting)
    spans = _spans(len(big), random.Random(9))
    one, one_spans = hash_file(tmp_path, "big.bin", spans, "xxh3-128")
    many, many_spans = hash_file(tmp_path, "big.bin", spans, "xxh3-128", lanes=lanes)
    assert (many, many_spans) == (one, one_spans)
    assert len(started) == lanes - 1
