"""``ddp``: data parallelism with bucketed ring all-reduce overlapping the backward pass (torch DDP;
thesis 002 ch. 5)."""

from __future__ import annotations

from ddlscope.distribution import DistributionModel, register


def _cost(profile, cluster, setting, compute_scale: float = 1.0):
    from ddlscope.predict.costs import predict_ddp

    return predict_ddp(profile, cluster, setting, compute_scale)


def _memory(profile, setting):
    from ddlscope.predict.memory import predict_memory

    return predict_memory(profile, "ddp", setting.workers, setting.batch_size, bucket_cap_mb=setting.bucket_cap_mb)


MODEL = register(DistributionModel(
    name="ddp",
    summary="data parallel: a replica per worker, gradients ring-all-reduced in buckets (torch DDP)",
    strategy="ddp:DDPStrategy",
    launcher="torchrun",
    measures="all-reduce time and bytes per step, the wait after the last bucket",
    predicts="bucketed ring all-reduce over the per-layer backward (ddlscope) and eq. 5.1 (thesis 002)",
    order=10,
    min_workers=1,
    cost_model=_cost,
    memory_model=_memory,
    reference_models=("eq5.1",),
))
