"""torchrun worker for bench_deepspeed.py: a real DeepSpeed ZeRO-2 (or ZeRO-3) fp32 checkpoint of about 1 GB.

    DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node 2 _make_big_ds.py OUT WIDTH LAYERS [STAGE]

A stack of LAYERS Linear(WIDTH, WIDTH) layers trained for one real step with DeepSpeed 0.19.x on CPU
(gloo, torch AdamW), saved with ``engine.save_checkpoint(OUT, tag="global_step1")``: fp32 module
weights in ``mp_rank_00_model_states.pt``, and per rank the flat fp32 partition with both Adam
moments in ``zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` (16 bytes per parameter in all). STAGE 3:
ZeRO-3 (DeepSpeed's default sub-group size), the module as placeholders: 12 bytes per parameter.
"""

from __future__ import annotations

import logging
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("DS_BUILD_OPS", "0")

import torch
import torch.nn as nn


def main() -> None:
    out, width, layers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    stage = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    import deepspeed
    import deepspeed.comm.torch as ds_comm_torch
    import torch.distributed as dist
    from deepspeed.utils import logger as ds_logger

    ds_comm_torch.build_shm_op = lambda: None  # no JIT build of the optional shared-memory op
    ds_logger.setLevel(logging.WARNING)
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "train_batch_size": 2 * dist.get_world_size(),
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    x = torch.randn(2, width)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(out, tag="global_step1")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
