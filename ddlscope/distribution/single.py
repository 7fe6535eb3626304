"""``single``: one worker on one device, the baseline every speedup is measured against (thesis 002 ch. 4)."""

from __future__ import annotations

from ddlscope.distribution import DistributionModel, register


def _cost(profile, cluster, setting, compute_scale: float = 1.0):
    from ddlscope.predict.costs import predict_single

    return predict_single(profile, cluster, setting, compute_scale)


def _memory(profile, setting):
    from ddlscope.predict.memory import predict_memory

    return predict_memory(profile, "single", setting.workers, setting.batch_size)


MODEL = register(DistributionModel(
    name="single",
    summary="one worker, one device: the baseline",
    strategy="single:SingleStrategy",
    launcher="process",
    measures="step parts (data loading, forward, backward, optimizer)",
    predicts="the profiled step at the batch plus exposed data loading (thesis 002 ch. 4)",
    order=0,
    min_workers=1,
    max_workers=1,
    cost_model=_cost,
    memory_model=_memory,
))
