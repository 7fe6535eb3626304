"""``gpipe`` and ``1f1b``: pipeline parallelism, one stage per worker (``torch.distributed.pipelining``).

Every stage sees the same batch, split into micro-batches: the workers are not data parallel, so
the global batch is the batch size. GPipe runs every micro-batch's forward before any backward
(Huang et al. 2019); 1F1B interleaves them and holds at most ``stages - s`` micro-batches on stage
``s`` (Narayanan et al. 2021, PipeDream-flush).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddlscope.distribution import DistributionModel, register

if TYPE_CHECKING:
    from ddlscope.config import RunConfig


def check_microbatches(cfg: "RunConfig") -> None:
    """The batch splits into ``distributed.microbatches`` micro-batches, and 1F1B has one per stage.

    Raises:
        ValueError: micro-batches that do not divide the batch, or (1f1b) fewer than the stages.
    """
    mb = cfg.distributed.microbatches
    if cfg.batch_size % mb:
        divisors = [d for d in range(1, cfg.batch_size + 1) if cfg.batch_size % d == 0]
        raise ValueError(f"distributed.microbatches = {mb} does not divide batch_size = {cfg.batch_size}; "
                         f"allowed: a divisor of the batch size ({', '.join(map(str, divisors[:12]))}"
                         f"{', ...' if len(divisors) > 12 else ''})")
    if cfg.strategy == "1f1b" and mb < cfg.peers:
        raise ValueError(f"distributed.microbatches = {mb} is fewer than the {cfg.peers} stages; 1f1b keeps "
                         f"every stage busy only with at least one micro-batch per stage; allowed: microbatches >= peers")


def _cost(profile, cluster, setting, compute_scale: float = 1.0):
    from ddlscope.predict.costs import predict_pipeline

    return predict_pipeline(profile, cluster, setting, compute_scale)


def _memory(profile, setting):
    from ddlscope.predict.memory import predict_memory

    return predict_memory(profile, setting.strategy, setting.workers, setting.batch_size,
                          microbatches=setting.microbatches)


_COMMON = dict(
    launcher="torchrun",
    measures="per-stage bubble, activation transfer time and bytes",
    data_parallel=False,
    min_workers=2,
    check_config=check_microbatches,
    cost_model=_cost,
    memory_model=_memory,
    reference_models=("eq6.1+6.2",),
)

GPIPE = register(DistributionModel(
    name="gpipe",
    summary="pipeline: one stage per worker, all forwards then all backwards (GPipe)",
    strategy="pipeline:GPipeStrategy",
    predicts="the GPipe schedule simulated over per-stage micro-batch times (ddlscope) and eq. 6.1 + 6.2 (thesis 002)",
    order=30,
    **_COMMON,
))

ONE_F_ONE_B = register(DistributionModel(
    name="1f1b",
    summary="pipeline: one stage per worker, one forward then one backward (1F1B, PipeDream-flush)",
    strategy="pipeline:OneFOneBStrategy",
    predicts="the 1F1B schedule simulated over per-stage micro-batch times (ddlscope) and eq. 6.1 + 6.2 (thesis 002)",
    order=40,
    **_COMMON,
))
