"""Plain sharded data parallelism: torch FSDP2 (``fully_shard``) under torchrun, what ``ddlscope run``
with ``strategy = "fsdp"`` replaces.

    torchrun --standalone --nproc-per-node 2 benchmarks/plain/plain_fsdp.py --out fsdp.json [--model resnet18 ...]

Each top-level child of the network that has parameters is one FSDP unit, and the whole network
the root (as ddlscope's fsdp wraps it); parameters are resharded after the forward pass (ZeRO-3,
``fully_shard``'s default). The optimizer is built on the sharded parameters. Rank 0 writes the
timed window (see ``common.timed_window``) and the samples trained in it.
"""

from __future__ import annotations


import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import common


def main() -> None:
    args = common.parser(__doc__).parse_args()
    rank, local_rank, world = common.start_worker(args)
    model, batches, device = common.workload(args, data_rank=rank, local_rank=local_rank)
    mesh = init_device_mesh(device.type, (world,))
    for child in model.children():
        if any(p.requires_grad for p in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = common.sgd(model.parameters(), args)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        x, y = next(batches)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss_fn(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    seconds = common.timed_window(step, args.warmup, args.steps, device, dist.barrier)
    if rank == 0:
        common.write_result(args.out, seconds=seconds, steps=args.steps, samples=args.steps * world * args.batch_size)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
