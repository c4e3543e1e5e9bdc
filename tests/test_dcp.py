"""DCP: every writer variant torch 2.13 makes, read without torch and exported bit for bit."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from ckpttool import registry
from ckpttool.export import export
from tests._compare import flatten_nested, tensor_mismatches
from tests.conftest import DCP_FIXTURES, FIXTURES

DCP = FIXTURES / "dcp"


def _reference(name: str) -> dict:
    return torch.load(DCP / f"{name}.reference.pt", weights_only=True)


@pytest.mark.parametrize("name", DCP_FIXTURES)
def test_export_equals_full_reference(name, tmp_path):
    out = tmp_path / "full.safetensors"
    result = export(DCP / name, out)
    got = load_file(out)
    ref = _reference(name)
    assert tensor_mismatches(got, ref) == []
    # every moment and every parameter is there
    assert any(k.endswith("exp_avg_sq") for k in got) and any(k.startswith("model.") for k in got)
    skipped = {i.name for i, _ in result.skipped}
    assert skipped == {k for k, v in ref.items() if not isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("name", [n for n in DCP_FIXTURES if n != "fsdp2_ranklocal"])
def test_export_equals_dcp_to_torch_save(name, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    theirs = tmp_path / "theirs.pt"
    dcp_to_torch_save(DCP / name, theirs)
    expected = flatten_nested(torch.load(theirs, weights_only=True))
    export(DCP / name, tmp_path / "ours.safetensors")
    assert tensor_mismatches(load_file(tmp_path / "ours.safetensors"), expected) == []


@pytest.mark.parametrize("name", DCP_FIXTURES)
def test_manifest_matches_reference_keys_and_values(name):
    _, m = registry.describe(DCP / name)
    ref = _reference(name)
    assert m.format == "dcp"
    assert set(m.items) == set(ref)
    for key, value in ref.items():
        item = m.items[key]
        if isinstance(value, torch.Tensor):
            assert item.shape == tuple(value.shape)
            assert item.dtype == str(value.dtype).removeprefix("torch.")
        elif isinstance(value, int | float | str | bool) or value is None:
            assert item.value == value, key
    assert m.step == ref["step"]
    assert m.layout.world_size == 4
    assert m.missing_state() == []


def test_rank_local_pieces_are_merged_with_replicas():
    _, m = registry.describe(DCP / "fsdp2_ranklocal")
    assert sorted(f.path for f in m.files if f.role == "metadata") == [f"__{r}.metadata" for r in range(4)]
    # a plain (non-DTensor) tensor is written by every rank: one first copy, three replicas
    replicated = [i for i in m.items.values() if i.is_tensor and len(i.pieces) == 4
                  and {p.box for p in i.pieces} == {i.pieces[0].box}]
    assert replicated
    assert sorted(p.replica for p in replicated[0].pieces) == [0, 1, 2, 3]


def test_mesh_pieces_are_boxes_of_the_2x2_mesh():
    _, m = registry.describe(DCP / "mesh2x2")
    two_d = [i for i in m.items.values() if i.kind == "param" and len({p.box.offsets for p in i.pieces}) == 4
             and all(o != 0 for o in i.pieces[-1].box.offsets)]
    assert two_d, "expected a tensor sharded along both mesh dimensions"


def test_hf_storage_writer_shards(tmp_path):
    _, m = registry.describe(DCP / "fsdp2_hf" / "sharded")
    assert m.format == "dcp" and m.layout.world_size == 4
    export(DCP / "fsdp2_hf" / "sharded", tmp_path / "a.safetensors")
    ref = torch.load(DCP / "fsdp2_hf.reference.pt", weights_only=True)
    assert tensor_mismatches(load_file(tmp_path / "a.safetensors"), ref) == []
    # the consolidated file + index next to it is a safetensors set with the same tensors
    _, consolidated = registry.describe(DCP / "fsdp2_hf")
    assert consolidated.format == "safetensors"
    export(DCP / "fsdp2_hf", tmp_path / "b.safetensors")
    assert tensor_mismatches(load_file(tmp_path / "b.safetensors"), ref) == []


def test_zstd_pieces_carry_the_transform():
    _, m = registry.describe(DCP / "fsdp2_zstd")
    assert all(p.locator.get("transforms") == ["stream.zstd/1"] for i in m.items.values() for p in i.pieces)


def test_part_of_a_piece_reads_only_its_bytes(monkeypatch):
    """A box that is a contiguous part of a stored piece (a reshard's row range) is read straight
    from the file: its bytes, not the whole piece's, and the values equal the full read's."""

    from ckpttool import registry
    from ckpttool.geometry import Box

    adapter, manifest = registry.describe(FIXTURES / "dcp" / "fsdp2")
    item = max((i for i in manifest.items.values() if i.is_tensor and i.shape and len(i.pieces) > 1),
               key=lambda i: i.pieces[0].box.sizes[0])
    piece = item.pieces[0]
    rows = piece.box.sizes[0] // 2
    assert rows >= 1
    box = Box(piece.box.offsets, (rows, *piece.box.sizes[1:]))
    _assert_reads_only_the_box(adapter, manifest, item, box, monkeypatch)


def test_part_of_a_piece_checks_the_chunk_like_a_whole_read(tmp_path):
    """.metadata says int32 where the chunk is float32: reading part of the piece fails as reading
    all of it does, instead of handing back float bits as integers."""
    import pickle
    import shutil

    from ckpttool import registry
    from ckpttool.assemble import assemble
    from ckpttool.errors import CorruptFileError
    from ckpttool.geometry import Box

    src = tmp_path / "fsdp2"
    shutil.copytree(FIXTURES / "dcp" / "fsdp2", src)
    md = pickle.loads((src / ".metadata").read_bytes())
    md.state_dict_metadata["model.pos"].properties.dtype = torch.int32
    (src / ".metadata").write_bytes(pickle.dumps(md))
    adapter, manifest = registry.describe(src)
    item = manifest.items["model.pos"]
    piece = item.pieces[0]
    half = Box(piece.box.offsets, (max(1, piece.box.sizes[0] // 2), *piece.box.sizes[1:]))
    with adapter.reader(manifest) as reader:
        with pytest.raises(CorruptFileError, match="metadata says int32"):
            assemble(reader, item)
        with pytest.raises(CorruptFileError, match="metadata says int32"):
            assemble(reader, item, box=half)


def _assert_reads_only_the_box(adapter, manifest, item, box, monkeypatch):
    """assemble of ``box`` gives the whole tensor's values there, and reads exactly its bytes."""
    import numpy as np

    from ckpttool import io as ckio
    from ckpttool.assemble import assemble

    with adapter.reader(manifest) as reader:
        whole = assemble(reader, item)
        read: list[int] = []
        real = ckio.preadinto

        def counting(fd, buf, offset):
            read.append(len(buf))
            return real(fd, buf, offset)

        monkeypatch.setattr(ckio, "preadinto", counting)
        part = assemble(reader, item, box=box)
    assert np.array_equal(part, whole[box.slices()])
    assert sum(read) == part.nbytes


def test_rows_of_a_column_sharded_tensor_read_only_their_bytes(monkeypatch):
    """A box of whole rows over pieces cut by columns (2-D mesh): each piece's part is contiguous in
    the piece but strided in the output, so it goes through a temporary of its own size; the bytes
    read are the box's, not the pieces'."""

    from ckpttool import registry
    from ckpttool.geometry import Box

    adapter, manifest = registry.describe(FIXTURES / "dcp" / "mesh2x2")
    item = next(i for i in manifest.items.values()
                if i.is_tensor and len(i.shape or ()) == 2 and any(p.box.offsets[1] for p in i.pieces))
    rows = min(p.box.sizes[0] for p in item.pieces) // 2
    assert rows >= 1
    box = Box((0, 0), (rows, item.shape[1]))
    _assert_reads_only_the_box(adapter, manifest, item, box, monkeypatch)


def _many_chunk_metadata(root, items: int, shards: int = 4) -> int:
    """A DCP checkpoint of ``items`` fp32[shards] tensors, each cut into one-element chunks on
    ``shards`` ranks' files, pickled by torch's own classes (what FileSystemWriter writes)."""
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    root.mkdir()
    sd, storage = {}, {}
    for r in range(shards):
        (root / f"__{r}_0.distcp").write_bytes(b"\0" * 4)
    for i in range(items):
        fqn = f"layers.{i}.weight"
        chunks = [ChunkStorageMetadata(torch.Size([r]), torch.Size([1])) for r in range(shards)]
        sd[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([shards]), chunks)
        for r in range(shards):
            storage[MetadataIndex(fqn, torch.Size([r]))] = _StorageInfo(f"__{r}_0.distcp", 0, 4)
    (root / ".metadata").write_bytes(pickle.dumps(Metadata(sd, storage_data=storage)))
    return items * shards


def test_describe_memory_per_chunk_and_shared_objects(tmp_path):
    """At scale the metadata dominates memory: the unpickled records are slotted (their state dicts
    emptied as read), the tree check keeps no table of every container, and pieces share one object
    per distinct box and file name. Before these, describing this checkpoint peaked at 2 463 B per
    chunk; now about 1 500."""
    import gc
    import tracemalloc

    from ckpttool.manifest import ReplicaCounter

    chunks = _many_chunk_metadata(tmp_path / "ckpt", 5000)
    gc.collect()
    tracemalloc.start()
    try:
        adapter, manifest = registry.describe(tmp_path / "ckpt")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    pieces = [p for item in manifest.items.values() for p in item.pieces]
    assert len(pieces) == chunks
    print(f"\ndescribe of {chunks:,} chunks: peak {peak / chunks:.0f} B per chunk (traced)")
    assert peak / chunks < 1900, f"{peak / chunks:.0f} B per chunk"
    assert len({id(p.box) for p in pieces}) == 4 and len({id(p.file) for p in pieces}) == 4
    assert len({id(p.box.offsets) for p in pieces}) == 4 and len({id(p.box.sizes) for p in pieces}) == 1
    # the per-chunk replica table is dropped after describe: the adapter keeps no table of the chunks
    assert not [v for v in vars(adapter).values() if isinstance(v, ReplicaCounter) and v._seen]


def test_locating_a_piece_reads_its_archive_once(monkeypatch, tmp_path):
    """raw_span (seal, verify) parses the chunk's torch.save archive: central directory, data.pkl,
    the storage's local header. A small archive is read whole in one read, a larger one in two
    windows (head and tail); before, each of the four lookups was its own read, and under
    ``io.probing`` its own trip to the disk."""
    from ckpttool import _torchzip
    from ckpttool import io as ckio

    adapter, manifest = registry.describe(FIXTURES / "dcp" / "fsdp2")
    calls: list[int] = []
    real = ckio.pread

    def spy(fd, length, offset):
        calls.append(length)
        return real(fd, length, offset)

    monkeypatch.setattr(ckio, "pread", spy)
    small = 0
    with adapter.reader(manifest) as reader:
        for item in manifest.items.values():
            for piece in item.pieces if item.is_tensor else ():
                calls.clear()
                assert reader.raw_span(piece, item) is not None
                assert piece.locator["length"] <= _torchzip._SMALL and calls == [piece.locator["length"]]
                small += 1
    assert small == 162
    # a larger archive: the tail and the head, then nothing more for data.pkl and the storage's header
    big = tmp_path / "big.pt"
    torch.save(torch.arange(8192, dtype=torch.float32), big)
    calls.clear()
    with ckio.RandomAccessFile(big) as f:
        archive = _torchzip.Archive(f, display="big.pt")
        span = _torchzip.tensor_span(archive, archive.load())
    assert span is not None and span[1] == 8192 * 4
    assert calls == [_torchzip._TAIL, _torchzip._HEAD], calls
    assert big.read_bytes()[span[0] : span[0] + 8] == torch.arange(2, dtype=torch.float32).numpy().tobytes()


def test_selected_span_of_a_stacked_chunk():
    """The bytes of chunk[i] / chunk[i, j] inside a stored C-ordered chunk (Megatron's stacked
    layers and experts), against numpy's own indexing of the same bytes; out-of-range is None."""
    import numpy as np

    from ckpttool.formats.dcp import selected_span

    chunk = np.arange(3 * 4 * 5, dtype=np.int32).reshape(3, 4, 5)
    raw = chunk.tobytes()
    for index in [(0,), (2,), (0, 0), (1, 2), (2, 3)]:
        start, length = selected_span((100, len(raw)), chunk.shape, index)
        got = np.frombuffer(raw[start - 100 : start - 100 + length], dtype=np.int32)
        assert np.array_equal(got, chunk[index].reshape(-1)), index
    assert selected_span((0, len(raw)), chunk.shape, (3,)) is None
    assert selected_span((0, len(raw)), chunk.shape, (0, 4)) is None
