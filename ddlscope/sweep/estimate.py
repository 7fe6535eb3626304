"""Rough wall-clock estimates of sweep cells, for ``--dry-run``, the progress bar's ETA and presets.

The figures are measurements of ResNet-18 (MNIST variant, thesis 002 Appendix A) on 28x28 inputs
on the 2-core development machine, not a model of the hardware:

- one training step at batch size 32 takes 0.37 s on 2 threads and 0.83 s on 1 thread; other
  batch sizes scale linearly in the number of samples, more threads as 2 threads x 2 / threads;
- a 2-peer collaborative run (1 core each, budget 3,200 samples, target batch size 128,
  matchmaking 2 s) took 89 s, where its 50 steps per peer compute in 50 x 0.83 = 41.5 s: the
  factor 89 / 41.5 = 2.14 covers hivemind's start, matchmaking and averaging;
- starting a run (processes, imports, dataset check, model build, final evaluation) costs about
  ``RUN_START_S`` seconds; this one is an assumption, not a measurement.

Other models and datasets are estimated with the same per-sample figure, so treat their estimates
as a unit, not a prediction; the progress bar's ETA corrects itself with the cells' real times.
"""

from __future__ import annotations

from ddlscope.config import RunConfig

STEP_S_BS32 = {1: 0.83, 2: 0.37}  # measured: ResNet-18 MNIST variant, batch 32, on 1 and 2 threads
COLLABORATIVE_FACTOR = 89.0 / (50 * 0.83)  # measured 2-peer run / its compute time
RUN_START_S = 8.0  # assumption: process start, imports, dataset check, final evaluation


def sample_s(threads: int) -> float:
    """Seconds per training sample of ResNet-18 (28x28) on ``threads`` threads (see module docstring)."""
    if threads in STEP_S_BS32:
        return STEP_S_BS32[threads] / 32
    return STEP_S_BS32[2] / 32 * 2 / max(threads, 1)


def estimate_cell_s(cfg: RunConfig, cores: list[int] | None = None) -> float:
    """Estimated wall-clock seconds of one run: start cost + steps per peer x step time (x the
    collaborative factor for hivemind peers). Runs without a sample budget are estimated from
    ``time_limit_s`` when set, else as 10 minutes.

    Raises:
        UserError: the config's cores do not fit this machine (from :meth:`RunConfig.cores_per_peer`).
    """
    steps = cfg.max_steps_per_peer()
    if steps is None:
        return RUN_START_S + (cfg.time_limit_s or 600.0)
    compute_s = steps * cfg.batch_size * sample_s(cfg.cores_per_peer(cores))
    if cfg.strategy == "collaborative":
        return compute_s * COLLABORATIVE_FACTOR
    return RUN_START_S + compute_s
