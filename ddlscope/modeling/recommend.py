"""The recommender: rank every distribution model by predicted seconds per epoch, among those that fit.

Thesis 002 ch. 8: predict each distribution model, drop those whose memory exceeds the
device's, recommend the fastest. One difference, on purpose: every candidate trains the *same
global batch* (the samples per optimizer step), so the ranking compares ways of running one
training job rather than different jobs — data parallel workers each take ``global / W``,
pipelines split the global batch into micro-batches, collaborative peers accumulate it as their
target batch size unless one is given. Each model's candidate comes from the registry (its
``candidate`` rule, :func:`candidate_settings`).

The rule itself — fastest predicted among those predicted to fit — is :func:`rank` and
:func:`fastest_that_fits`; the validation report applies the same functions to its records.
Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ddlscope.errors import UserError
from ddlscope.modeling.cluster import ClusterSpec
from ddlscope.modeling.memory import peak_split_bytes
from ddlscope.modeling.prediction import Prediction, Setting, predict
from ddlscope.modeling.profile import WorkloadProfile

T = TypeVar("T")

MAX_WORKERS = 1 << 16
"""Most workers a recommendation considers (a pipeline candidate searches its micro-batch count down from 2 x workers)."""
MAX_GLOBAL_BATCH_SIZE = 1 << 24
"""Largest global batch (samples per optimizer step) a recommendation considers."""


def rank(items: Sequence[T], epoch_s: Callable[[T], float | None], fits: Callable[[T], bool | None]) -> list[T]:
    """``items`` in the recommender's order: predicted to fit first (``fits(item) is True``), then
    those with a prediction, each group fastest predicted ``epoch_s`` first; ties keep their order.

    Items whose fit is unknown (None) rank with those that do not fit: a model is never
    recommended on an unknown fit (thesis 002 ch. 8 filters by memory first).
    """
    def key(item: T) -> tuple[bool, bool, float]:
        t = epoch_s(item)
        return fits(item) is not True, t is None, t if t is not None else float("inf")

    return sorted(items, key=key)


def fastest_that_fits(items: Sequence[T], epoch_s: Callable[[T], float | None],
                      fits: Callable[[T], bool | None]) -> T | None:
    """The recommendation among ``items``: the first of :func:`rank` if it is predicted to fit and
    has a predicted time, else None (nothing fits)."""
    ranked = rank(items, epoch_s, fits)
    if ranked and fits(ranked[0]) is True and epoch_s(ranked[0]) is not None:
        return ranked[0]
    return None


@dataclass
class Candidate:
    """One distribution model for the job: its prediction and memory, or why it is impossible.

    ``memory_bytes`` is the largest per-worker peak (bytes); ``capacity_bytes`` one device's memory;
    ``memory_split_bytes`` that worker's peak as ``(allocator, runtime)`` bytes
    (:func:`~ddlscope.modeling.memory.peak_split_bytes`).
    """

    setting: Setting
    prediction: Prediction | None
    memory_bytes: int | None
    capacity_bytes: int
    invalid_reason: str | None = None
    memory_split_bytes: tuple[int, int] | None = None

    @property
    def fits(self) -> bool:
        """True when the setting is valid and its largest per-worker peak is within one device's memory."""
        return self.invalid_reason is None and self.memory_bytes is not None and self.memory_bytes <= self.capacity_bytes

    @property
    def epoch_s(self) -> float | None:
        """Predicted seconds per epoch, or None without a prediction."""
        return self.prediction.epoch_s if self.prediction else None

    @property
    def shortfall_bytes(self) -> int | None:
        """Bytes per worker beyond the capacity (None when the setting is invalid)."""
        if self.memory_bytes is None:
            return None
        return max(0, self.memory_bytes - self.capacity_bytes)

    @property
    def label(self) -> str:
        """E.g. ``ddp x2``, or ``gpipe x2, 4 micro-batches, stages [0, 6, 21]`` for a pipeline (the cut
        that was predicted; run it with ``distributed.stage_bounds``)."""
        s = self.setting
        mb = f", {s.microbatches} micro-batches" if s.microbatches else ""
        bounds = self.prediction.inputs.get("stage_bounds") if self.prediction else None
        cut = f", stages {bounds}" if bounds else ""
        return f"{s.strategy} x{s.workers}{mb}{cut}"


@dataclass
class Recommendation:
    """The ranked candidates (feasible ones first, fastest first) and the chosen one with a short why."""

    candidates: list[Candidate]
    best: Candidate | None
    why: str
    compute_scale: float = 1.0
    compute_scale_band: tuple[float, float] = (1.0, 1.0)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        """JSON-ready: the recommended model, why, the compute scale and every candidate."""
        def cand(c: Candidate) -> dict:
            p = c.prediction
            return {"strategy": c.setting.strategy, "workers": c.setting.workers,
                    "batch_size": c.setting.batch_size, "microbatches": c.setting.microbatches,
                    "epoch_s": p.epoch_s if p else None, "step_s": p.step_s if p else None,
                    "breakdown_s": p.breakdown_s if p else None, "dominant_cost": p.dominant_cost if p else None,
                    "reference_epoch_s": p.reference_epoch_s if p else None, "inputs": p.inputs if p else None,
                    "memory_bytes": c.memory_bytes, "capacity_bytes": c.capacity_bytes, "fits": c.fits,
                    "shortfall_bytes": c.shortfall_bytes, "invalid_reason": c.invalid_reason}

        return {"recommended": self.best.setting.strategy if self.best else None, "why": self.why,
                "compute_scale": self.compute_scale, "compute_scale_band": list(self.compute_scale_band),
                "notes": self.notes, "candidates": [cand(c) for c in self.candidates]}


def candidate_settings(strategies: list[str], workers: int, global_batch_size: int, epoch_samples: int,
                       microbatches: int | None = None, loader_workers: int = 0,
                       target_batch_size: int | None = None, matchmaking_time_s: float | None = None,
                       use_local_updates: bool = False, bucket_cap_mb: float = 25.0,
                       model_options: dict[str, Any] | None = None) -> list[Setting]:
    """One :class:`Setting` per distribution model for a job of ``global_batch_size`` samples per step.

    The default candidate of a model runs on ``workers`` workers (at most its ``max_workers``:
    ``single`` runs on one) with ``global / data_parallel_size`` samples each (rounded down, at
    least 1): data-parallel workers share the batch, pipeline stages all see the whole batch.
    A model's registry ``candidate`` rule then sets its own fields from the job's options:
    pipelines split the batch into ``microbatches`` (default ``2 x workers``, reduced until it
    divides the batch); collaborative peers accumulate ``target_batch_size`` (default: the global
    batch) at ``matchmaking_time_s`` (default: the ``[collaborative]`` table's,
    :data:`ddlscope.distribution.collaborative.DEFAULT_MATCHMAKING_TIME_S`); ``model_options`` go
    to the candidate rules too (e.g. a swarm's roles and churn:
    :func:`ddlscope.distribution.collaborative.swarm_options`) and override those. A candidate that
    cannot run (e.g. more stages than layers) is kept; :func:`recommend` lists it with its reason.

    Raises:
        UserError: an unknown distribution model, ``workers`` outside 1..:data:`MAX_WORKERS`,
            ``global_batch_size`` outside 1..:data:`MAX_GLOBAL_BATCH_SIZE`, ``microbatches`` or
            ``target_batch_size`` outside 1..the global batch / 1..:data:`MAX_GLOBAL_BATCH_SIZE`.
    """
    from ddlscope import distribution

    models = [distribution.get(name) for name in strategies]
    if not 1 <= global_batch_size <= MAX_GLOBAL_BATCH_SIZE:
        raise UserError(f"batch size {global_batch_size}; allowed: 1..{MAX_GLOBAL_BATCH_SIZE}")
    if not 1 <= workers <= MAX_WORKERS:
        raise UserError(f"workers {workers}; allowed: 1..{MAX_WORKERS}")
    if microbatches is not None and not 1 <= microbatches <= global_batch_size:
        raise UserError(f"microbatches {microbatches}; allowed: 1..{global_batch_size} (the global batch)")
    if target_batch_size is not None and not 1 <= target_batch_size <= MAX_GLOBAL_BATCH_SIZE:
        raise UserError(f"target batch size {target_batch_size}; allowed: 1..{MAX_GLOBAL_BATCH_SIZE}")
    options = {"microbatches": microbatches, "target_batch_size": target_batch_size,
               "matchmaking_time_s": matchmaking_time_s, "use_local_updates": use_local_updates, **(model_options or {})}
    out = []
    for model in models:
        n = workers if model.max_workers is None else min(workers, model.max_workers)
        setting = Setting(model.name, n, max(1, global_batch_size // model.data_parallel_size(n)), epoch_samples,
                          loader_workers=loader_workers, bucket_cap_mb=bucket_cap_mb)
        out.append(model.candidate(setting, global_batch_size, options) if model.candidate else setting)
    return out


def recommend(profile: WorkloadProfile, cluster: ClusterSpec, settings: list[Setting],
              compute_scale: float = 1.0, compute_scale_band: tuple[float, float] = (1.0, 1.0)) -> Recommendation:
    """Predict every setting, check its memory against one device's, and pick the fastest that fits.

    A setting predicted not to fit is never recommended (:func:`fastest_that_fits`). When nothing
    fits, ``best`` is None and ``why`` names the candidate with the smallest shortfall (bytes per
    worker beyond capacity). Invalid settings (e.g. more stages than layers) are listed with their
    reason. The predictions' notes (what makes them less certain) become the recommendation's,
    each once.
    """
    capacity = cluster.device_memory_bytes(profile.device.memory_bytes)
    cands: list[Candidate] = []
    for s in settings:
        try:
            pred = predict(profile, cluster, s, compute_scale)
            split = peak_split_bytes(profile, s)
            cands.append(Candidate(s, pred, sum(split), capacity, memory_split_bytes=split))
        except UserError as err:
            cands.append(Candidate(s, None, None, capacity, invalid_reason=str(err)))
    cands = rank(cands, lambda c: c.epoch_s, lambda c: c.fits)
    best = fastest_that_fits(cands, lambda c: c.epoch_s, lambda c: c.fits)
    if best is not None:
        why = _why(best, [c for c in cands if c.fits and c is not best], [c for c in cands if not c.fits and c.prediction])
    else:
        sized = [c for c in cands if c.shortfall_bytes is not None]
        if sized:
            nearest = min(sized, key=lambda c: c.shortfall_bytes)
            why = (f"nothing fits: the smallest shortfall is {nearest.label}, needing "
                   f"{_gib(nearest.memory_bytes)} per worker of {_gib(capacity)} "
                   f"({_gib(nearest.shortfall_bytes)} short); try a smaller batch or more pipeline stages")
        else:
            why = "nothing can run: " + "; ".join(f"{c.label}: {c.invalid_reason}" for c in cands)
    notes = list(dict.fromkeys(n for c in cands if c.prediction for n in c.prediction.notes))
    return Recommendation(cands, best, why, compute_scale, compute_scale_band, notes)


def _gib(nbytes: int | None) -> str:
    return "?" if nbytes is None else f"{nbytes / 2**30:.2f} GiB"


def _why(best: Candidate, others: list[Candidate], too_big: list[Candidate]) -> str:
    p = best.prediction
    text = f"{best.label} is predicted fastest at {p.epoch_s:.1f} s/epoch (dominant cost: {p.dominant_cost})"
    if others:
        nxt = others[0]
        text += f"; next is {nxt.label} at {nxt.prediction.epoch_s:.1f} s/epoch " \
                f"({nxt.prediction.epoch_s / p.epoch_s - 1:+.0%}, dominant: {nxt.prediction.dominant_cost})"
    faster_but_big = [c for c in too_big if c.prediction.epoch_s < p.epoch_s]
    if faster_but_big:
        text += "; faster but out of memory: " + ", ".join(
            f"{c.label} ({_gib(c.memory_bytes)} > {_gib(c.capacity_bytes)})" for c in faster_but_big)
    return text
