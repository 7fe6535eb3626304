"""Plain data parallelism: torch DistributedDataParallel under torchrun, what ``ddlscope run`` with ``strategy = "ddp"`` replaces.

    torchrun --standalone --nproc-per-node 2 benchmarks/plain/plain_ddp.py --out ddp.json [--model resnet18 ...]

Every worker trains a replica on its own batch; DDP all-reduces the gradients in buckets during
the backward pass (gloo on CPU, nccl on CUDA; torch's default 25 MiB buckets). Rank 0 writes the
timed window (see ``common.timed_window``) and the samples trained in it.
"""

from __future__ import annotations


import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import common


def main() -> None:
    args = common.parser(__doc__).parse_args()
    rank, local_rank, world = common.start_worker(args)
    model, batches, device = common.workload(args, data_rank=rank, local_rank=local_rank)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = common.sgd(ddp.parameters(), args)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        x, y = next(batches)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss_fn(ddp(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    seconds = common.timed_window(step, args.warmup, args.steps, device, dist.barrier)
    if rank == 0:
        common.write_result(args.out, seconds=seconds, steps=args.steps, samples=args.steps * world * args.batch_size)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
