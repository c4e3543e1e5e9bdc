"""torchrun worker: load a DCP checkpoint at this world size into Shard(0) DTensors and save the
gathered full tensors (rank 0) for the test to compare."""

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor


def main() -> None:
    path, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    md = FileSystemReader(path).read_metadata()
    state = {}
    for key, meta in md.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            empty = torch.zeros(meta.size, dtype=meta.properties.dtype)
            placement = [Shard(0)] if len(meta.size) and meta.size[0] >= dist.get_world_size() else None
            state[key] = distribute_tensor(empty, mesh, placement) if placement else empty
    dcp.load(state, checkpoint_id=path)
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in state.items()}
    if dist.get_rank() == 0:
        torch.save(full, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
