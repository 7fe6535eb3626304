"""What an experiment's stored run measured: seconds per step and per epoch, step parts, and speedup.

Seconds per step (thesis 002 ch. 3.4): for models whose workers step together (the registry's
``lockstep``), the mean over measured (non warm-up) steps of the slowest worker's step time. Workers
that step on their own (collaborative peers) are measured over the time every worker trained
(:func:`swarm_window`: not the last peer's wait for rounds after the others left): its length
over the samples all workers processed in it, scaled to one step of every worker. Seconds per epoch: the
step time x the steps in one epoch of the *real* dataset (``train_size / samples per step``).

Speedup (:func:`speedup`, the one definition): the baseline's time for the same work over the
run's (equivalently, the run's throughput over the baseline's); the baseline is the completed run
of the registry's baseline model (:func:`ddlscope.distribution.baseline`) for the same workload.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from ddlscope import distribution
from ddlscope.measure.parts import STEP_PARTS, measured_parts
from ddlscope.store.db import ResultsStore

BREAKDOWN: tuple[str, ...] = (*STEP_PARTS, "other_s")
"""The step parts a measurement reports (:data:`ddlscope.measure.parts.STEP_PARTS`), then ``other_s``:
the step's wall time not covered by them."""

T = TypeVar("T")


@dataclass
class Measurement:
    """A completed run reduced to per-step figures. Seconds, bytes; None where not measured.

    Attributes:
        step_s: seconds per step of all workers together (see the module docstring).
        epoch_s: seconds per epoch of the real dataset (None: the dataset's size is unknown).
        parts_s: :func:`ddlscope.measure.parts.measured_parts` of the measured steps: mean seconds
            of one worker's step by part, with ``step_s`` (its mean wall time).
        breakdown_s: the same parts and ``other_s``, the wall time they do not cover (:data:`BREAKDOWN`).
        comm_s / comm_bytes_per_step: mean communication time and bytes per measured step.
        peak_memory_bytes: the largest per-worker peak (CPU: peak RSS).
        allocator_peak_bytes / runtime_bytes: the worker with the largest training peak, split
            as :func:`ddlscope.modeling.memory.peak_split_bytes` predicts it: what training
            allocated (GPU: ``max_memory_allocated``; CPU: resident peak during training less the
            resident set without the model before its set-up, :func:`ddlscope.measure.memory.rss_without_model_bytes`)
            and the process's memory without the model (GPU: device memory in use beyond torch's
            allocator, the CUDA context; CPU: that resident set; runs stored before 2026-12-04: the
            resident set at the start of training). None where the run did not record them.
        averaging_rounds_failed: averaging rounds that failed among the measured steps (a round
            given up after ``averaging_timeout_s``: the swarm stalled that long), the most any worker
            recorded; 0 for models without averaging rounds.
        averaging_rounds_partial: hivemind's partial averaging rounds of the run (rounds that
            averaged part of the tensors without a peer whose chunks came too late:
            :func:`ddlscope.analyze.swarm.partial_rounds`), the most any worker recorded; None for
            models without hivemind's rounds and where a worker did not count them.
        averaging_rounds_join_timeout: rounds that began ``request_timeout`` late because a join request
            went unanswered (:func:`ddlscope.analyze.swarm.join_timeouts`), the most any worker recorded;
            None as for ``averaging_rounds_partial``.
    """

    step_s: float
    epoch_s: float | None
    parts_s: dict[str, float] = field(default_factory=dict)
    breakdown_s: dict[str, float] = field(default_factory=dict)
    comm_s: float | None = None
    comm_bytes_per_step: float | None = None
    peak_memory_bytes: int | None = None
    allocator_peak_bytes: int | None = None
    runtime_bytes: int | None = None
    averaging_rounds_failed: int = 0
    averaging_rounds_partial: int | None = None
    averaging_rounds_join_timeout: int | None = None


def memory_split(store: ResultsStore, run_id: str) -> tuple[int | None, int | None]:
    """``(allocator peak, runtime)`` bytes of the run's worker with the largest allocator peak, from
    its ``memory`` events (see :class:`Measurement`); ``(None, None)`` when no worker recorded one."""
    best: tuple[int | None, int | None] = (None, None)
    for e in store.rows("events", run_id):
        if e["kind"] != "memory":
            continue
        d = json.loads(e["detail_json"] or "{}")
        if d.get("allocator_peak_bytes") is not None:
            pair = (int(d["allocator_peak_bytes"]), d.get("runtime_bytes"))
        elif d.get("train_peak_rss_bytes") is not None and d.get("rss_before_model_bytes") is not None:
            pair = (int(d["train_peak_rss_bytes"]) - int(d["rss_before_model_bytes"]), int(d["rss_before_model_bytes"]))
        elif d.get("train_peak_rss_bytes") is not None and d.get("rss_at_train_start_bytes") is not None:  # before 2026-12-04
            pair = (int(d["train_peak_rss_bytes"]) - int(d["rss_at_train_start_bytes"]), int(d["rss_at_train_start_bytes"]))
        else:
            continue
        if best[0] is None or pair[0] > best[0]:
            best = pair
    return best


def swarm_window(steps: list[dict]) -> tuple[float, float] | None:
    """``(seconds, samples)`` of the time every worker was training: from the last worker's first
    measured step to the first worker's last, and the samples trained in it (a step that straddles
    an end counts with the share of its time inside). Workers that step on their own have a tail in
    which the peers that are done have left and the last one waits for rounds that nobody joins (up
    to the averaging timeout), and a head in which a late peer has not started: neither is the
    swarm's pace. None when the workers' measured steps do not overlap in time.
    """
    spans: dict[int, tuple[float, float]] = {}
    for s in steps:
        start, end = s["wall_time"], s["wall_time"] + s["step_s"]
        a, b = spans.get(s["worker_index"], (start, end))
        spans[s["worker_index"]] = (min(a, start), max(b, end))
    start = max(a for a, _ in spans.values())
    end = min(b for _, b in spans.values())
    if end <= start:
        return None
    return end - start, samples_within(steps, start, end)


def samples_within(steps: list[dict], start: float, end: float) -> float:
    """Samples of ``steps`` trained between Unix times ``start`` and ``end``; a step across either
    end counts with the share of its time inside. A step's ``samples_discarded`` (hivemind loaded
    the swarm's state in it and dropped its gradients) are not trained; where a step does not say
    (a run stored before they were counted) none are taken off."""
    samples = 0.0
    for s in steps:
        inside = min(end, s["wall_time"] + s["step_s"]) - max(start, s["wall_time"])
        if inside > 0:
            trained = s["samples"] - (s.get("samples_discarded") or 0)
            samples += trained * (inside / s["step_s"] if s["step_s"] > 0 else 1.0)
    return samples


@dataclass
class ChurnWindow:
    """A swarm run with churn, measured where its churn schedule applies (:func:`churn_window`).

    Attributes:
        start_wall: Unix time of the window's start: the last initial peer's first measured step.
        run_s: the window's length, seconds: to the first end of a peer that finished its own
            work (later, the peers left would train alone: not the schedule's swarm).
        samples: samples of every peer's steps inside the window (pro rata for a step across an end),
            less those hivemind discarded (``samples_discarded``: steps that loaded the swarm's state).
        samples_lost: samples of killed peers' steps after their last averaging round
            (:func:`ddlscope.analyze.swarm.samples_lost`): counted by hivemind, never averaged.
        schedule: each peer's churn as it happened, seconds from ``start_wall``: the launcher's
            ``peer_join`` / ``peer_leave`` / ``peer_kill`` / ``peer_rejoin`` events as
            :class:`~ddlscope.distribution.collaborative.ChurnEvent` fields (``peer``,
            ``join_at_s``, ``leave_at_s`` / ``kill_at_s``, ``rejoin_at_s``); events after the
            window are left out.
    """

    start_wall: float
    run_s: float
    samples: float
    samples_lost: int
    schedule: list[dict] = field(default_factory=list)

    @property
    def samples_trained(self) -> float:
        """Samples that reached an averaging round: ``samples - samples_lost``."""
        return self.samples - self.samples_lost


CHURN_EVENT_FIELDS = {"peer_join": "join_at_s", "peer_leave": "leave_at_s", "peer_kill": "kill_at_s",
                      "peer_rejoin": "rejoin_at_s"}
"""The launcher's churn events (:mod:`ddlscope.launch.churn`) and the schedule field each one is."""


def churn_window(store: ResultsStore, run_id: str) -> ChurnWindow | None:
    """Where a swarm run's churn schedule applies, and what the swarm trained in it.

    The window starts when every peer present from the start has taken its first measured step and
    ends when the first peer ends on its own (its work done; a peer that left or was killed for
    good does not end it). Each peer's churn is read from the events the launcher stored when it
    acted, so a prediction of the window (:func:`ddlscope.distribution.collaborative.predict_collaborative`
    with ``churn = schedule`` and ``run_s``) is given what happened, not what was asked for.

    Returns:
        None when the run has no churn events, a peer left, was killed or rejoined before the
        window starts (the schedule would start inside a change), a peer has more than one
        change of a kind, or the window is empty.
    """
    from ddlscope.analyze.swarm import samples_lost

    events = [e for e in store.rows("events", run_id) if e["kind"] in CHURN_EVENT_FIELDS]
    steps = [dict(s) for s in store.rows("steps", run_id)]
    if not events or not steps:
        return None
    by_peer: dict[int, list[dict]] = {}
    for s in steps:
        by_peer.setdefault(int(s["worker_index"]), []).append(s)
    changes: dict[int, dict[str, float]] = {}
    for e in events:
        mine = changes.setdefault(int(e["worker_index"]), {})
        name = CHURN_EVENT_FIELDS[e["kind"]]
        if name in mine:
            return None
        mine[name] = float(e["wall_time"])
    initial = [p for p in by_peer if "join_at_s" not in changes.get(p, {})]
    measured = {p: [s for s in rows if not s["warmup"]] or rows for p, rows in by_peer.items()}
    start = max(min(s["wall_time"] for s in measured[p]) for p in initial) if initial else None
    if start is None or any(t <= start for c in changes.values() for k, t in c.items() if k != "join_at_s"):
        return None
    gone_for_good = {p for p, c in changes.items() if ("leave_at_s" in c or "kill_at_s" in c) and "rejoin_at_s" not in c}
    ends = [max(s["wall_time"] + s["step_s"] for s in rows) for p, rows in by_peer.items() if p not in gone_for_good]
    end = min(ends) if ends else None
    if end is None or end <= start:
        return None
    samples = samples_within(steps, start, end)
    lost = sum(samples_lost(by_peer.get(p, []), c["kill_at_s"]) for p, c in changes.items()
               if "kill_at_s" in c and c["kill_at_s"] < end)
    schedule = []
    for p, c in sorted(changes.items()):
        entry = {"peer": p, **{k: round(max(0.0, t - start), 3) for k, t in c.items() if t < end}}
        if len(entry) > 1 and not (set(entry) == {"peer", "rejoin_at_s"}):
            schedule.append(entry)
    return ChurnWindow(start_wall=start, run_s=end - start, samples=samples, samples_lost=lost, schedule=schedule)


def measure_run(store: ResultsStore, run_id: str) -> Measurement | None:
    """The :class:`Measurement` of a stored run, or None when it did not complete with a measured step."""
    from ddlscope.workloads.datasets import DATASETS

    run = store.run(run_id)
    steps = [dict(s) for s in store.rows("steps", run_id) if not s["warmup"]]
    if run is None or run["status"] != "completed" or not steps:
        return None
    cfg = store.run_config(run_id)
    model = distribution.get(cfg["strategy"])
    workers, batch = int(cfg.get("peers", 1)), int(cfg["batch_size"])
    samples_per_step = model.data_parallel_size(workers) * batch
    if model.lockstep:  # every step lasts as long as its slowest worker's
        by_step: dict[int, list[dict]] = {}
        for s in steps:
            by_step.setdefault(s["step"], []).append(s)
        step_s = statistics.fmean(max(r["step_s"] for r in rows) for rows in by_step.values())
    else:  # the time every worker trained, over the samples all of them processed in it
        window = swarm_window(steps)
        if window is None or window[1] <= 0:  # no common time: the slowest worker's own window
            window = (max(sum(s["step_s"] for s in steps if s["worker_index"] == w)
                          for w in {s["worker_index"] for s in steps}), sum(s["samples"] for s in steps))
        step_s = window[0] * samples_per_step / window[1]
    dataset = DATASETS.get(cfg.get("dataset"))
    parts = measured_parts(steps)
    breakdown = {p: parts[p] for p in STEP_PARTS}
    breakdown["other_s"] = max(0.0, parts["step_s"] - sum(breakdown.values()))
    peaks = [w["peak_memory_bytes"] for w in store.workers(run_id) if w["peak_memory_bytes"]]
    return Measurement(
        step_s=step_s, epoch_s=step_s * dataset.train_size / samples_per_step if dataset else None,
        parts_s=parts, breakdown_s=breakdown, comm_s=statistics.fmean(s["comm_s"] or 0.0 for s in steps),
        comm_bytes_per_step=statistics.fmean(s["comm_bytes"] or 0 for s in steps),
        peak_memory_bytes=max(peaks) if peaks else None, **dict(zip(("allocator_peak_bytes", "runtime_bytes"),
                                                                  memory_split(store, run_id))),
        averaging_rounds_failed=max(sum(1 for s in steps if s["worker_index"] == w and s["averaging_succeeded"] == 0)
                                    for w in {s["worker_index"] for s in steps}),
        **(_hivemind_round_counts(store, run_id, steps) if model.averages_with_hivemind else {}))


def _hivemind_round_counts(store: ResultsStore, run_id: str, steps: list[dict]) -> dict[str, int | None]:
    """``averaging_rounds_partial`` and ``averaging_rounds_join_timeout`` of a run: the most partial rounds, and
    rounds with a join timeout, that any worker recorded; None where a worker did not count them."""
    from ddlscope.analyze.swarm import rounds_with

    events = store.rows("events", run_id)
    workers = sorted({s["worker_index"] for s in steps})
    out = {}
    for name, kind in (("averaging_rounds_partial", "partial_average"), ("averaging_rounds_join_timeout", "join_timeout")):
        counts = [rounds_with(events, w, kind) for w in workers]
        out[name] = None if any(c is None for c in counts) else max(sum(c.values()) for c in counts)
    return out


def speedup(baseline_s: float | None, run_s: float | None) -> float | None:
    """The baseline's seconds for some work over the run's seconds for the same work (> 1: faster).

    None when either is missing or not positive.
    """
    if not baseline_s or not run_s or baseline_s <= 0 or run_s <= 0:
        return None
    return baseline_s / run_s


def baseline_times(items: Iterable[T], workload: Callable[[T], Hashable], model: Callable[[T], str],
                   seconds: Callable[[T], float | None]) -> dict[Hashable, float]:
    """The baseline model's (:func:`ddlscope.distribution.baseline`) measured time per workload.

    Args:
        items: e.g. a suite's cell results.
        workload: what must match for a fair comparison (e.g. ``(dataset, network)``).
        model: the item's distribution model name.
        seconds: the item's time for the common work (e.g. seconds per epoch), None if unmeasured.

    Returns:
        ``{workload: seconds}`` of the first measured baseline item of each workload; pass an
        item's workload and seconds to :func:`speedup`.
    """
    base_name = distribution.baseline().name
    out: dict[Hashable, float] = {}
    for it in items:
        if model(it) == base_name and seconds(it):
            out.setdefault(workload(it), seconds(it))
    return out
