"""inspect/ls read metadata only: no tensor byte is touched."""

from __future__ import annotations

import os
import shutil

import pytest

from ckpttool import io as ckio
from ckpttool import registry
from ckpttool.inspect import inspect
from tests.conftest import DCP_FIXTURES, FIXTURES, run_cli


@pytest.fixture
def reads(monkeypatch):
    log: list[tuple[str, int, int]] = []
    real, real_into = ckio.pread, ckio.preadinto

    def spy(fd: int, length: int, offset: int) -> bytes:
        log.append((os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), offset, length))
        return real(fd, length, offset)

    def spy_into(fd: int, buf: memoryview, offset: int) -> int:
        log.append((os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), offset, len(buf)))
        return real_into(fd, buf, offset)

    monkeypatch.setattr(ckio, "pread", spy)
    monkeypatch.setattr(ckio, "preadinto", spy_into)
    return log


@pytest.mark.parametrize("name", DCP_FIXTURES)
def test_inspect_reads_no_tensor_bytes(name, reads):
    path = FIXTURES / "dcp" / name
    report = inspect(path)
    tensor_ranges = [
        (p.file.rsplit("/", 1)[-1], p.locator["offset"], p.locator["offset"] + p.locator["length"])
        for i in report.manifest.items.values() if i.is_tensor for p in i.pieces
    ]
    touched = [
        (f, off, n) for f, off, n in reads for tf, lo, hi in tensor_ranges if f == tf and off < hi and off + n > lo
    ]
    assert touched == []
    data_bytes = sum(f.size for f in report.manifest.files if f.role == "data")
    read_from_data = sum(n for f, _, n in reads if f.endswith(".distcp"))
    assert read_from_data < 0.25 * data_bytes


def test_safetensors_inspect_reads_only_headers(reads):
    inspect(FIXTURES / "safetensors" / "sharded")
    _, m = registry.describe(FIXTURES / "safetensors" / "sharded")
    data = sum(f.size for f in m.files if f.role == "data")
    assert sum(n for _, _, n in reads) < 0.2 * data


def test_unreadable_data_files_still_inspect(tmp_path):
    # the safetensors header lives in the data file, but DCP keeps everything tensor-side in .distcp:
    # with tensor items unreadable (zeroed), inspect of a DCP checkpoint gives the same answer
    import shutil

    src = FIXTURES / "dcp" / "fsdp2"
    dst = tmp_path / "ck"
    shutil.copytree(src, dst)
    before = inspect(dst).to_json()
    _, m = registry.describe(dst)
    for item in m.items.values():
        if not item.is_tensor:
            continue
        for p in item.pieces:
            with open(dst / p.file, "r+b") as f:
                f.seek(p.locator["offset"])
                f.write(b"\0" * p.locator["length"])
    after = inspect(dst).to_json()
    before.pop("path"), after.pop("path")
    assert before == after


def test_an_item_whose_file_does_not_read_is_exit_3_not_unsafe(tmp_path):
    """A DCP bytes item in a damaged or unreadable file was reported as "cannot be loaded safely"
    (the words for a pickle that runs code), inspect exit 1 and ls exit 0; other formats stop
    with exit 3 at such a file. A refused pickle is still reported, the rest described (exit 1)."""
    from ckpttool import registry

    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "dcp" / "fsdp2", ckpt)
    _, m = registry.describe(ckpt)
    item = m.items["rng.rank0.python"]
    piece = item.pieces[0]
    at = piece.locator["offset"] + piece.locator["length"] // 2
    with open(ckpt / piece.file, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))
    for command in ("inspect", "ls"):
        r = run_cli(command, ckpt)
        assert r.code == 3 and "1 item(s) cannot be read: __0_0.distcp@0" in r.stderr, (command, r.stderr)
        assert "loaded safely" not in r.stderr and "__0_0.distcp is damaged or unreadable" in r.stderr


class _RunsTrue:
    def __reduce__(self):  # (a pickle calling os.system; "true" does nothing if anything ran it)
        return (os.system, ("true",))


def test_what_the_reader_found_beside_the_items_is_shown_and_sets_the_exit(tmp_path):
    """A Trainer's optimizer.pt whose pickle runs code, or cut short, was "missing training state:
    optimizer", exit 0: the format's findings were in the JSON's extras only. A hostile one is a
    warning and exit 1 (as a hostile item is), one that does not read exit 3 (as an item's file),
    and a finding of warning severity (a rank file of an earlier save) a warning, exit 0."""
    import torch

    hostile = tmp_path / "hostile"
    shutil.copytree(FIXTURES / "hf/trainer/checkpoint-3", hostile)
    torch.save({"state": {}, "param_groups": [], "x": _RunsTrue()}, hostile / "optimizer.pt")
    r = run_cli("inspect", hostile)
    assert r.code == 1 and "warning: unsafe-pickle: optimizer.pt: its pickle refers to posix.system" in r.stderr, r.stderr
    assert run_cli("inspect", hostile, "--json").code == 1
    cut = tmp_path / "cut"
    shutil.copytree(FIXTURES / "hf/trainer/checkpoint-3", cut)
    os.truncate(cut / "optimizer.pt", 5000)
    r = run_cli("inspect", cut)
    assert r.code == 3 and r.stderr.startswith("error: optimizer.pt: cut short"), r.stderr
    assert run_cli("ls", cut).code == 3
    earlier = tmp_path / "earlier"
    shutil.copytree(FIXTURES / "rankshards/pipeline", earlier)
    shutil.copy(earlier / "checkpoint_step3_stage0.pt", earlier / "checkpoint_step2_stage0.pt")
    r = run_cli("inspect", earlier)
    assert r.code == 0 and "warning: extra-file: 1 file(s) of earlier saves (step 2)" in r.stderr, r.stderr


def test_a_torch_save_file_with_its_trajectory_beside_it_is_read(tmp_path):
    """docs/rehearse.md's own harness keeps state.pt and the trajectory it records in one directory:
    "not a checkpoint format ckpttool reads" (the trajectory's .pt counted as a second file)."""
    import torch

    torch.save({"model": {"w": torch.ones(2)}, "step": 3}, tmp_path / "state.pt")
    (tmp_path / "ckpttool.trajectory.json").write_text('{"components": {}, "steps": []}')
    torch.save({"model": {"w": torch.ones(2)}}, tmp_path / "ckpttool.trajectory.pt")
    report = inspect(tmp_path)
    assert report.manifest.format == "torch" and report.manifest.step == 3


def test_a_safetensors_file_reached_by_a_link_into_the_hub_cache_is_read(tmp_path):
    """The Hugging Face hub cache keeps snapshots/<rev>/model.safetensors as a link to
    blobs/<sha>: "not a checkpoint format" (the adapter judged the name the link leads to)."""
    blob = tmp_path / "blobs" / "ed097b0c"
    blob.parent.mkdir()
    shutil.copy(FIXTURES / "safetensors" / "model.safetensors", blob)
    (tmp_path / "snap").mkdir()
    (tmp_path / "snap" / "model.safetensors").symlink_to(blob)
    want = registry.describe(FIXTURES / "safetensors" / "model.safetensors")[1]
    got = registry.describe(tmp_path / "snap" / "model.safetensors")[1]
    assert got.format == "safetensors" and list(got.items) == list(want.items)
