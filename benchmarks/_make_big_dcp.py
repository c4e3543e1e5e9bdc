"""Worker for bench_export.py, bench_reshard.py and bench_device.py: an FSDP2 model of WIDTH x WIDTH
Linear layers on 2 gloo ranks, one real AdamW step, saved with dcp.save (params + 2 moments: 1.2 GB
at 2048 x 24). Run under torchrun:

    torchrun --standalone --nproc-per-node 2 _make_big_dcp.py OUT WIDTH LAYERS [rows|cols]

``cols``: the weights sharded along their columns (FSDP2's ``shard_placement_fn`` giving
``Shard(1)``), so that a reshard to rows cuts every piece across."""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard


def main() -> None:
    out, width, layers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    cols = len(sys.argv) > 4 and sys.argv[4] == "cols"
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    placement = (lambda p: Shard(1) if p.ndim == 2 else Shard(0)) if cols else None
    for layer in model:
        fully_shard(layer, mesh=mesh, shard_placement_fn=placement)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).sum().backward()
    opt.step()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt), "step": 1}
    dcp.save(state, checkpoint_id=out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
