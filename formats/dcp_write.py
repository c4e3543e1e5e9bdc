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
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckpttool.assemble import assemble, check_coverage
from ckpttool.errors import UsageError
from ckpttool.formats.base import Adapter
from ckpttool.geometry import Box
from ckpttool.io import fsync_dir, temp_dir_beside
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

    if world_size < 1:
        raise UsageError("--world-size must be at least 1")
    tmp = temp_dir_beside(dst)
    try:
        files = [open(tmp / f"__{r}_0.distcp", "wb") for r in range(world_size)]  # noqa: SIM115
        sd_meta: dict[str, Any] = {}
        storage: dict[Any, Any] = {}
        planner: dict[str, tuple[str, ...]] = {}
        with adapter.reader(manifest) as reader:
            for item in items:
                # one flat level: names such as `w` and `w.exp_avg` cannot both be paths of one tree
                planner[item.name] = (item.name,)
                if not item.is_tensor:
                    value = reader.read_object(item)
                    buf = io.BytesIO()
                    torch.save(value, buf)
                    data = buf.getvalue()
                    f = files[0]
                    storage[MetadataIndex(item.name)] = _StorageInfo("__0_0.distcp", f.tell(), len(data))
                    f.write(data)
                    sd_meta[item.name] = BytesStorageMetadata()
                    continue
                assert item.dtype is not None and item.shape is not None
                check_coverage(item)
                tdtype = getattr(torch, item.dtype)
                chunks = []
                sharded = sum(1 for p in item.pieces if p.replica == 0) > 1
                cuts = chunk_boxes(item.shape, world_size) if sharded else chunk_boxes(item.shape, 1)
                for r, box in enumerate(cuts):
                    if box is None:
                        continue
                    values = assemble(reader, item, box=box)
                    tensor = torch.from_numpy(values.copy()).view(tdtype).reshape(box.sizes)
                    buf = io.BytesIO()
                    torch.save(tensor, buf)
                    data = buf.getvalue()
                    f = files[r]
                    storage[MetadataIndex(item.name, box.offsets)] = _StorageInfo(
                        f"__{r}_0.distcp", f.tell(), len(data)
                    )
                    f.write(data)
                    chunks.append(ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes)))
                    if progress is not None:
                        progress(values.nbytes)
                sd_meta[item.name] = TensorStorageMetadata(
                    properties=TensorProperties(dtype=tdtype), size=torch.Size(item.shape), chunks=chunks
                )
        for f in files:
            f.flush()
            os.fsync(f.fileno())
            f.close()
        md = Metadata(
            state_dict_metadata=sd_meta,
            planner_data=planner,
            storage_data=storage,
            storage_meta=StorageMeta(checkpoint_id=str(dst), modules=[]),
            version="1.0.0",
        )
        with open(tmp / ".metadata", "wb") as fh:
            pickle.dump(md, fh)
            fh.flush()
            os.fsync(fh.fileno())
        fsync_dir(tmp)
        if dst.exists():
            shutil.rmtree(dst)
        os.replace(tmp, dst)
        fsync_dir(dst.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return [".metadata"] + [f"__{r}_0.distcp" for r in range(world_size)]


__all__ = ["chunk_boxes", "write_dcp"]
