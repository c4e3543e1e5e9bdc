"""Writing a PyTorch DCP checkpoint at a chosen world size, from any manifest.

Every tensor the source holds in several pieces is cut along its first dimension into
``world_size`` chunks the way ``torch.chunk`` (and FSDP2's ``Shard(0)``) cuts it; rank ``r``'s
chunks go to ``__r_0.distcp`` as ``torch.save`` archives, as torch's ``FileSystemWriter`` writes
them. A tensor the source holds whole (replicated, or unsharded state such as RNG) is written
whole by rank 0, as DCP's de-duplication saves a replicated tensor. Non-tensor values go to rank 0's file.
``.metadata`` is torch's own ``Metadata`` with the ``_StorageInfo`` index, pickled as DCP pickles
it. The result is what ``dcp.load`` reads at that world size (or any other).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckpttool.assemble import assemble, check_coverage
from ckpttool.dtypes import carrier
from ckpttool.errors import UsageError
from ckpttool.formats.base import Adapter, PieceReader, PlannedFile
from ckpttool.geometry import Box
from ckpttool.io import fsync_tree, publish_dir, staged_dir
from ckpttool.manifest import Item, Manifest


def chunk_boxes(shape: tuple[int, ...], parts: int) -> list[Box | None]:
    """The dim-0 chunk each rank holds, as ``torch.chunk`` makes them (None: that rank holds none)."""
    if not shape:
        return [Box((), ())] + [None] * (parts - 1)
    size = -(-shape[0] // parts) if shape[0] else 0
    out: list[Box | None] = []
    for r in range(parts):
        lo, hi = r * size, min(shape[0], (r + 1) * size)
        out.append(Box((lo, *([0] * (len(shape) - 1))), (hi - lo, *shape[1:])) if hi > lo else None)
    if shape[0] == 0:
        out[0] = Box.whole(shape)
    return out


class DcpWriter:
    """Writes rank files one at a time (``write``: any process may write any rank) and then the
    ``.metadata`` index of all of them (``finish``)."""

    def __init__(self, root: Path, manifest: Manifest, world_size: int, items: list[Item]) -> None:
        if world_size < 1:
            raise UsageError("--world-size must be at least 1")
        self.root, self.manifest, self.world = root, manifest, world_size
        self.items = items
        self.cuts: dict[str, list[tuple[int, Box]]] = {}
        for item in items:
            if not item.is_tensor:
                continue
            assert item.shape is not None
            sharded = sum(1 for p in item.pieces if p.replica == 0) > 1
            boxes = chunk_boxes(item.shape, world_size if sharded else 1)
            self.cuts[item.name] = [(r, b) for r, b in enumerate(boxes) if b is not None]

    def files(self) -> list[PlannedFile]:
        sizes: list[list[int]] = [[] for _ in range(self.world)]
        for item in self.items:
            if item.is_tensor:
                assert item.dtype is not None
                for r, box in self.cuts[item.name]:
                    sizes[r].append(box.volume * carrier(item.dtype).itemsize)
            else:
                sizes[0].append(0)
        return [PlannedFile.of(f"__{r}_0.distcp", (r,), s) for r, s in enumerate(sizes)]

    def write(
        self, rank: int, out: Path, reader: PieceReader, progress: Callable[[int], None] | None
    ) -> list[tuple[str, tuple[int, ...] | None, int, int]]:
        """Write rank ``rank``'s ``.distcp`` file; returns (item, chunk offsets or None for bytes,
        byte offset, length) for each record, for ``finish``."""
        import torch

        entries: list[tuple[str, tuple[int, ...] | None, int, int]] = []
        with open(out, "wb") as f:
            for item in self.items:
                if not item.is_tensor:
                    if rank != 0:
                        continue
                    buf = io.BytesIO()
                    torch.save(reader.read_object(item), buf)
                    data = buf.getvalue()
                    entries.append((item.name, None, f.tell(), len(data)))
                    f.write(data)
                    continue
                assert item.dtype is not None
                mine = [box for r, box in self.cuts[item.name] if r == rank]
                if mine:
                    check_coverage(item)
                for box in mine:
                    values = assemble(reader, item, box=box)
                    tensor = torch.from_numpy(values).view(getattr(torch, item.dtype)).reshape(box.sizes)
                    start = f.tell()
                    torch.save(tensor, f)  # as DCP's FileSystemWriter: straight into the file
                    entries.append((item.name, box.offsets, start, f.tell() - start))
                    del tensor
                    if progress is not None:
                        progress(values.nbytes)
        return entries

    def finish(self, tmp: Path, results: list[list[tuple[str, tuple[int, ...] | None, int, int]]]) -> None:
        """Write ``.metadata`` for the rank files whose ``write`` results are given, in rank order."""
        tensors = {}
        for item in self.items:
            if item.is_tensor:
                assert item.shape is not None and item.dtype is not None
                tensors[item.name] = (item.dtype, item.shape, [b for _, b in self.cuts[item.name]])
        names = [item.name for item in self.items]
        write_metadata(
            tmp / ".metadata",
            tensors=tensors,
            objects=[item.name for item in self.items if not item.is_tensor],
            records={f"__{rank}_0.distcp": entries for rank, entries in enumerate(results)},
            # one flat level: names such as `w` and `w.exp_avg` cannot both be paths of one tree
            planner_data={name: (name,) for name in names},
            checkpoint_id=str(tmp),
        )


Record = tuple[str, tuple[int, ...] | None, int, int]
"""(state-dict key, chunk offsets or None for a bytes item, byte offset in its file, length)"""


def write_metadata(
    path: Path,
    *,
    tensors: dict[str, tuple[str, tuple[int, ...], list[Box]]],
    objects: list[str],
    records: dict[str, list[Record]],
    planner_data: Any,
    checkpoint_id: str,
) -> None:
    """Write a DCP ``.metadata`` file: torch's own ``Metadata`` (``tensors``: key -> dtype, global
    shape, chunk boxes; ``objects``: bytes keys; ``records``: for each data file, where each chunk
    or object lies in it), pickled as DCP pickles it. Keys keep their insertion order."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    storage: dict[Any, Any] = {}
    # the keys' own string objects (pickled once, referenced after): the same bytes whether the
    # records were made in this process or came from other ranks
    same = {name: name for name in [*tensors, *objects]}
    for rel, entries in records.items():
        for name, offsets, at, length in entries:
            name = same.get(name, name)
            index = MetadataIndex(name) if offsets is None else MetadataIndex(name, offsets)
            storage[index] = _StorageInfo(rel, at, length)
    sd_meta: dict[str, Any] = {}
    for name, (dtype, shape, boxes) in tensors.items():
        sd_meta[name] = TensorStorageMetadata(
            properties=TensorProperties(dtype=getattr(torch, dtype)),
            size=torch.Size(shape),
            chunks=[ChunkStorageMetadata(offsets=torch.Size(b.offsets), sizes=torch.Size(b.sizes)) for b in boxes],
        )
    for name in objects:
        sd_meta[name] = BytesStorageMetadata()
    md = Metadata(
        state_dict_metadata=sd_meta,
        planner_data=planner_data,
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=checkpoint_id, modules=[]),
        version="1.0.0",
    )
    with open(path, "wb") as fh:
        pickle.dump(md, fh)


def write_dcp(
    adapter: Adapter,
    manifest: Manifest,
    dst: Path,
    *,
    world_size: int,
    items: list[Item],
    progress: Callable[[int], None] | None = None,
) -> list[str]:
    """Write ``items`` of ``manifest`` as a DCP checkpoint of ``world_size`` ranks at ``dst``
    (published atomically). Returns the files written."""
    writer = DcpWriter(Path(manifest.root), manifest, world_size, items)
    with staged_dir(dst) as tmp:
        results = []
        with adapter.reader(manifest) as reader:
            for r in range(world_size):
                results.append(writer.write(r, tmp / f"__{r}_0.distcp", reader, progress))
        writer.finish(tmp, results)
        fsync_tree(tmp)
        publish_dir(tmp, dst)
    return [".metadata"] + [f"__{r}_0.distcp" for r in range(world_size)]


__all__ = ["DcpWriter", "Record", "chunk_boxes", "write_dcp", "write_metadata"]
