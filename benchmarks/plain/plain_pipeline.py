"""Plain pipeline parallelism: ``torch.distributed.pipelining`` under torchrun, what ``ddlscope run``
with ``strategy = "gpipe"`` or ``"1f1b"`` replaces.

    torchrun --standalone --nproc-per-node 2 benchmarks/plain/plain_pipeline.py --schedule 1f1b \
        --stage-bounds 0,6,11 --microbatches 4 --out 1f1b.json [--model resnet18 ...]

The network (an ``nn.Sequential``) is cut between its top-level children at ``--stage-bounds``
(stage ``r`` holds children ``bounds[r]`` to ``bounds[r+1] - 1``), one stage per worker. Each
batch is split into ``--microbatches`` micro-batches run by ``ScheduleGPipe`` (``gpipe``) or
``Schedule1F1B`` (``1f1b``); each micro-batch's loss is divided by their number, so the gradient
is that of the batch mean, and the optimizer steps once per batch. Every stage reads the same
batch stream (the first needs the inputs, the last the labels). Rank 0 writes the timed window
(see ``common.timed_window``) and the samples trained in it (one batch per step).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import common

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument("--schedule", choices=tuple(SCHEDULES), required=True)
    p.add_argument("--stage-bounds", required=True, help="comma-separated cut, e.g. 0,6,11")
    p.add_argument("--microbatches", type=int, default=4)
    args = p.parse_args()
    rank, local_rank, stages = common.start_worker(args)
    bounds = [int(b) for b in args.stage_bounds.split(",")]
    model, batches, device = common.workload(args, data_rank=0, local_rank=local_rank)
    mine = torch.nn.Sequential(OrderedDict(list(model.named_children())[bounds[rank]:bounds[rank + 1]])).to(device)
    del model
    loss_fn = torch.nn.CrossEntropyLoss()
    schedule = SCHEDULES[args.schedule](PipelineStage(mine, rank, stages, device), n_microbatches=args.microbatches,
                                        loss_fn=lambda out, y: loss_fn(out, y) / args.microbatches, scale_grads=False)
    optimizer = common.sgd(mine.parameters(), args)

    def step() -> None:
        x, y = next(batches)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if rank == 0:
            schedule.step(x)
        elif rank == stages - 1:
            schedule.step(target=y, losses=[])
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    seconds = common.timed_window(step, args.warmup, args.steps, device, dist.barrier)
    if rank == 0:
        common.write_result(args.out, seconds=seconds, steps=args.steps, samples=args.steps * args.batch_size)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
