"""``fsdp``: sharded data parallelism, one FSDP2 unit per top-level layer (ZeRO-3, or ZeRO-2 without
``reshard_after_forward``)."""

from __future__ import annotations

from ddlscope.distribution import DistributionModel, register


def _cost(profile, cluster, setting, compute_scale: float = 1.0):
    from ddlscope.predict.costs import predict_fsdp

    return predict_fsdp(profile, cluster, setting, compute_scale)


def _memory(profile, setting):
    from ddlscope.predict.memory import predict_memory

    return predict_memory(profile, "fsdp", setting.workers, setting.batch_size,
                          reshard_after_forward=setting.reshard_after_forward)


MODEL = register(DistributionModel(
    name="fsdp",
    summary="sharded data parallel: parameters, gradients and optimizer state split over workers (FSDP2)",
    strategy="fsdp:FSDPStrategy",
    launcher="torchrun",
    measures="all-gather and reduce-scatter time and bytes per step",
    predicts="per-unit all-gather / reduce-scatter with prefetch, simulated unit by unit",
    order=20,
    min_workers=1,
    cost_model=_cost,
    memory_model=_memory,
))
