"""Run by the correctness tests under torchrun: train tiny_cnn a few steps with one distribution model.

``python -m torch.distributed.run --nproc-per-node 2 tests/dist_check.py STRATEGY OUT.pt [STAGE_BOUNDS]``
(``STAGE_BOUNDS``: pipelines only, comma-separated, e.g. ``0,1,4``)

Data-parallel models (ddp, fsdp) give each of the 2 workers half of a 16-sample batch; pipelines
(gpipe, 1f1b) give every stage the whole batch. Rank 0 saves the full trained state dict and the
per-step losses (of the last stage for pipelines, of rank 0's half batch otherwise) to OUT.pt, to be compared with ``single`` on the whole batch.
"""

import os
import sys

import torch
import torch.distributed as dist

from ddlscope.config import RunConfig
from ddlscope.strategies import WorkerContext, strategy_class
from ddlscope.workloads.models import build_model

STEPS, BATCH, LR = 3, 16, 0.1


def batches():
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 1, 28, 28, generator=gen), torch.randint(0, 10, (BATCH,), generator=gen))
            for _ in range(STEPS)]


def initial_model():
    torch.manual_seed(0)
    return build_model("tiny_cnn", "mnist")


def main(strategy_name: str, out: str, stage_bounds: list[int] | None = None) -> None:
    torch.set_num_threads(1)
    pipeline = strategy_name in ("gpipe", "1f1b")
    per_worker = BATCH if pipeline else BATCH // 2
    cfg = RunConfig(strategy=strategy_name, model="tiny_cnn", dataset="mnist", peers=2, batch_size=per_worker,
                    sample_budget=BATCH * STEPS, distributed=dict(microbatches=2, stage_bounds=stage_bounds))
    model = initial_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    import os

    rank = int(os.environ["RANK"])
    ctx = WorkerContext(run_id="check", worker_index=rank, num_workers=2, cores=[0], initial_peers=[])
    strategy = strategy_class(strategy_name)(cfg, ctx)
    model = strategy.setup(model, optimizer)
    losses = []
    for x, y in batches():
        if not pipeline:
            x, y = x[rank * per_worker:(rank + 1) * per_worker], y[rank * per_worker:(rank + 1) * per_worker]
        result = strategy.forward_backward(model, x, y, torch.nn.CrossEntropyLoss())
        strategy.step(result.samples)
        strategy.zero_grad()
        losses.append(result.resolve().loss)
    if strategy_name == "ddp":
        state = model.module.state_dict()
    elif strategy_name == "fsdp":
        state = {k: v.full_tensor() for k, v in model.state_dict().items()}
    else:
        state = strategy.stage_module.state_dict()
    gathered = [None, None]
    dist.all_gather_object(gathered, ({k: v.detach().cpu() for k, v in state.items()}, losses))
    if rank == 0:
        merged = {}
        for part, _ in gathered:
            merged.update(part)
        losses = gathered[-1][1] if pipeline else losses  # the last stage computes the loss
        torch.save(dict(state=merged, losses=losses, details=strategy.details()), out)
    strategy.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], [int(b) for b in sys.argv[3].split(",")] if len(sys.argv) > 3 else None)
    # skip interpreter teardown: destroying a gloo process group there (the DDP reducer holds the
    # last reference) can deadlock, its worker thread waiting for the GIL the joining thread holds
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
