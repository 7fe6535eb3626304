"""Rough wall-clock estimates of experiment cells, for ``sweep --dry-run``, the progress bar's ETA and presets.

The figures are measurements of ResNet-18 (MNIST variant, thesis 002 Appendix A) on 28x28 inputs
on the 2-core development machine, not a model of the hardware:

- one training step at batch size 32 takes 0.37 s on 2 threads and 0.83 s on 1 thread; other
  batch sizes scale linearly in the number of samples, more threads as 2 threads x 2 / threads;
- a distribution model whose steps take longer than their compute (hivemind's matchmaking and
  averaging) gives the measured ratio as its ``estimate_factor`` (see
  :class:`ddlscope.distribution.DistributionModel`; collaborative: 1.95, from a measured 2-peer run);
- starting a run (processes, imports, dataset check, model build, final evaluation) costs about
  ``RUN_START_S`` seconds; this one is an assumption, not a measurement.

Other models and datasets are estimated with the same per-sample figure, so treat their estimates
as a unit, not a prediction; the progress bar's ETA corrects itself with the cells' real times.
"""

from __future__ import annotations

from ddlscope.config import RunConfig
from ddlscope.distribution import get as get_model

STEP_S_BS32 = {1: 0.83, 2: 0.37}  # measured: ResNet-18 MNIST variant, batch 32, on 1 and 2 threads
RUN_START_S = 8.0  # assumption: process start, imports, dataset check, final evaluation


def sample_s(threads: int) -> float:
    """Seconds per training sample of ResNet-18 (28x28) on ``threads`` threads (see module docstring)."""
    if threads in STEP_S_BS32:
        return STEP_S_BS32[threads] / 32
    return STEP_S_BS32[2] / 32 * 2 / max(threads, 1)


def estimate_cell_s(cfg: RunConfig, cores: list[int] | None = None) -> float:
    """Estimated wall-clock seconds of one run: start cost + steps per peer x step time x its
    distribution model's ``estimate_factor``. Runs without a sample budget are estimated from
    ``time_limit_s`` when set, else as 10 minutes.

    Raises:
        UserError: the config's cores do not fit this machine (from :meth:`RunConfig.cores_per_peer`).
    """
    steps = cfg.max_steps_per_peer()
    if steps is None:
        return RUN_START_S + (cfg.time_limit_s or 600.0)
    compute_s = steps * cfg.batch_size * sample_s(cfg.cores_per_peer(cores))
    return RUN_START_S + compute_s * get_model(cfg.strategy).estimate_factor
