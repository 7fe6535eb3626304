"""Run summaries and comparisons with thesis 000's rules, and the bottleneck verdict.

Comparison rules (thesis 000, final version; seeds README):

- a run's **runtime** is the maximum over its workers of their training time (first step start
  to last step end, minus the time spent in held-out evaluations);
- its **accuracy** is the maximum over its peers of their final held-out accuracy;
- **system metrics** (CPU %, RSS, network bytes) are averaged over its peers;
- **speedup** = baseline runtime / run runtime (the same sample budget, so the same work);
- **accuracy decrease** = baseline accuracy - run accuracy (fraction; > 0 means worse);
- **time-to-accuracy**: training seconds (evaluations excluded) until any peer's held-out
  accuracy first reaches the threshold (None if it never does).

Step-time shares exclude warm-up steps; a worker's step parts are
:func:`ddlscope.measure.parts.measured_parts` (``optimizer_s`` without the averaging it contains
in the store). The **bottleneck** is the largest share among input (``data_load_s``), compute
(forward + backward + local optimizer work), communication (``averaging_s`` + ``comm_wait_s``:
averaging and collectives the worker waited for) and, for pipelines, the bubble (``bubble_s``:
stages idle waiting for a neighbour), with the numbers behind it.

The **baseline** of a comparison is the first completed run of the registry's baseline model
(:func:`ddlscope.distribution.baseline`, ``single``).

Pipeline stages all process the same batches, so a pipeline run's samples and throughput are
those of one stage (the slowest), not the sum over workers.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from ddlscope import distribution
from ddlscope.analyze.moe import MoESummary, summarize_moe
from ddlscope.measure.parts import STEP_PARTS, measured_parts
from ddlscope.store.db import ResultsStore


@dataclass
class WorkerSummary:
    """Per-worker figures. Times in seconds, rates in samples/s, bytes in bytes."""

    worker_index: int
    status: str
    runtime_s: float | None
    steps: int
    samples: int
    throughput_samples_per_s: float | None
    mean_phase_s: dict[str, float]  # {step part (ddlscope.measure.parts.STEP_PARTS): mean seconds per step}
    final_accuracy: float | None
    mean_cpu_percent: float | None
    peak_rss_bytes: int | None
    net_sent_bytes: int
    net_recv_bytes: int
    averaging_rounds: int
    averaging_rounds_failed: int
    mean_group_size: float | None
    mean_comm_s: float = 0.0
    mean_comm_bytes: float = 0.0
    peak_memory_bytes: int | None = None
    #: CPU seconds per step of the worker's background work (collaborative: hivemind's processes
    #: and threads); None when not measured
    mean_background_cpu_s: float | None = None


@dataclass
class Verdict:
    """The bottleneck of a run: ``kind`` is input-bound / compute-bound / communication-bound."""

    kind: str
    shares: dict[str, float]
    explanation: str


@dataclass
class RunSummary:
    """A run reduced by the comparison rules (see the module docstring)."""

    run_id: str
    name: str
    strategy: str
    status: str
    reason: str | None
    peers: int
    config: dict[str, Any]
    runtime_s: float | None
    throughput_samples_per_s: float | None
    accuracy: float | None
    samples: int
    mean_cpu_percent: float | None
    mean_net_bytes_per_peer: float
    workers: list[WorkerSummary]
    verdict: Verdict | None
    eval_curve: list[tuple[float, float]] = field(default_factory=list)  # (training seconds, accuracy)
    loss_curve: list[tuple[float, float]] = field(default_factory=list)  # (seconds since start, training loss)
    moe: MoESummary | None = None  # mixture-of-experts figures (ddlscope.analyze.moe), for runs with such rows

    def time_to_accuracy_s(self, threshold: float) -> float | None:
        """Seconds until any peer's held-out accuracy first reached ``threshold`` (0..1), else None."""
        return next((t for t, acc in self.eval_curve if acc >= threshold), None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def summarize_worker(index: int, status: str, start: float | None, end: float | None, eval_s: float,
                     steps: list[dict], evals: list[dict], host: list[dict], peak_memory_bytes: int | None = None
                     ) -> WorkerSummary:
    """Reduce one worker's stored rows to a :class:`WorkerSummary`."""
    timed = [s for s in steps if not s["warmup"]]
    parts = measured_parts(timed)
    phases = {p: parts.get(p, 0.0) for p in STEP_PARTS}
    span = sum(s["step_s"] for s in timed)
    samples = sum(s["samples"] for s in steps)
    rounds = [s for s in steps if s["averaging_round"]]
    sizes = [s["averaging_group_size"] for s in rounds if s["averaging_group_size"] is not None]
    last = host[-1] if host else {}
    return WorkerSummary(
        worker_index=index, status=status,
        runtime_s=(end - start - eval_s) if start is not None and end is not None else None,
        steps=len(steps), samples=samples,
        throughput_samples_per_s=sum(s["samples"] for s in timed) / span if span > 0 else None,
        mean_phase_s=phases,
        final_accuracy=evals[-1]["accuracy"] if evals else None,
        mean_cpu_percent=_mean([h["cpu_percent"] for h in host[1:] if h["cpu_percent"] is not None]),
        peak_rss_bytes=max((h["rss_bytes"] or 0 for h in host), default=None),
        net_sent_bytes=int(last.get("net_sent_bytes") or 0), net_recv_bytes=int(last.get("net_recv_bytes") or 0),
        averaging_rounds=len(rounds), averaging_rounds_failed=sum(1 for s in rounds if s["averaging_succeeded"] == 0),
        mean_group_size=_mean(sizes),
        mean_comm_s=_mean([s["comm_s"] or 0.0 for s in timed]) or 0.0,
        mean_comm_bytes=_mean([s["comm_bytes"] or 0 for s in timed]) or 0.0,
        peak_memory_bytes=peak_memory_bytes,
        mean_background_cpu_s=_mean([s["background_cpu_s"] for s in timed if s.get("background_cpu_s") is not None]),
    )


def _loss_curve(steps: list[dict]) -> list[tuple[float, float]]:
    """(the worker's summed step time at the end of the step, loss) for every step of every worker."""
    points, elapsed = [], {}
    for s in steps:
        elapsed[s["worker_index"]] = elapsed.get(s["worker_index"], 0.0) + (s["step_s"] or 0.0)
        points.append((elapsed[s["worker_index"]], s["loss"]))
    return sorted(points)


def bottleneck(workers: list[WorkerSummary]) -> Verdict | None:
    """Classify where the step time of a run goes (mean over workers, warm-up excluded)."""
    measured = [w for w in workers if w.steps > 0 and sum(w.mean_phase_s.values()) > 0]
    if not measured:
        return None
    mean = {p: statistics.fmean(w.mean_phase_s[p] for w in measured) for p in STEP_PARTS}
    total = sum(mean.values())
    shares = {
        "input": mean["data_load_s"] / total,
        "compute": (mean["forward_s"] + mean["backward_s"] + mean["optimizer_s"]) / total,
        "communication": (mean["averaging_s"] + mean["comm_wait_s"]) / total,
        "bubble": mean["bubble_s"] / total,
    }
    kind = max(shares, key=shares.get)
    label = {"input": "input-bound", "compute": "compute-bound", "communication": "communication/averaging-bound",
             "bubble": "pipeline-bubble-bound"}[kind]
    parts = ", ".join(f"{k} {v:.0%}" for k, v in shares.items())
    explanation = f"{label}: of a mean step of {total * 1000:.1f} ms, {parts}."
    if kind != "input" and shares["input"] >= 0.10:
        explanation += f" The data pipeline still stalls training {shares['input']:.0%} of the time."
    background = [w.mean_background_cpu_s for w in measured if w.mean_background_cpu_s is not None]
    if background and statistics.fmean(background) >= 0.10 * total:
        explanation += (f" Background work (hivemind's DHT, p2pd and averagers) used {statistics.fmean(background) * 1000:.0f} "
                        f"CPU-ms per step, {statistics.fmean(background) / total:.0%} of the step: on busy cores it "
                        f"slows forward and backward by about as much.")
    runtimes = [w.runtime_s for w in workers if w.runtime_s]
    if len(runtimes) > 1 and max(runtimes) > 1.2 * min(runtimes):
        explanation += f" Peers differ: runtime {min(runtimes):.1f}-{max(runtimes):.1f} s (stragglers)."
    return Verdict(label, shares, explanation)


def summarize_run(store: ResultsStore, run_id: str) -> RunSummary:
    """Reduce a stored run with the comparison rules. Works on failed/interrupted runs too."""
    run = store.run(run_id)
    if run is None:
        raise KeyError(f"no run {run_id!r} in {store.path}")
    cfg = store.run_config(run_id)
    steps, evals, host = (store.rows(t, run_id) for t in ("steps", "evals", "host_samples"))
    workers = []
    for w in store.rows("workers", run_id):
        i = w["worker_index"]
        end = w["train_end_time"]
        w_steps = [s for s in steps if s["worker_index"] == i]
        if end is None and w_steps:  # killed mid-way: training time up to its last stored step
            end = w_steps[-1]["wall_time"] + (w_steps[-1]["step_s"] or 0.0)
        workers.append(summarize_worker(i, w["status"], w["train_start_time"], end, w["eval_s"] or 0.0, w_steps,
                                        [e for e in evals if e["worker_index"] == i],
                                        [h for h in host if h["worker_index"] == i], w["peak_memory_bytes"]))
    runtimes = [w.runtime_s for w in workers if w.runtime_s is not None]
    accs = [w.final_accuracy for w in workers if w.final_accuracy is not None]
    throughputs = [w.throughput_samples_per_s for w in workers if w.throughput_samples_per_s]
    pipeline = not distribution.get(run["strategy"]).data_parallel  # stages share the batches: count them once
    curve = sorted((e["train_time_s"], e["accuracy"]) for e in evals)
    losses = _loss_curve(steps)
    return RunSummary(
        run_id=run_id, name=run["name"], strategy=run["strategy"], status=run["status"], reason=run["reason"],
        peers=int(cfg.get("peers", 1)), config=cfg,
        runtime_s=max(runtimes) if runtimes else None,
        throughput_samples_per_s=(min(throughputs) if pipeline else sum(throughputs)) if throughputs else None,
        accuracy=max(accs) if accs else None,
        samples=(max((w.samples for w in workers), default=0) if pipeline else sum(w.samples for w in workers)),
        mean_cpu_percent=_mean([w.mean_cpu_percent for w in workers if w.mean_cpu_percent is not None]),
        mean_net_bytes_per_peer=_mean([w.net_sent_bytes + w.net_recv_bytes for w in workers]) or 0.0,
        workers=workers, verdict=bottleneck(workers), eval_curve=curve, loss_curve=losses,
        moe=summarize_moe(store, run_id),
    )


@dataclass
class Comparison:
    """A run against the baseline. ``speedup`` > 1 means faster than the baseline."""

    run: RunSummary
    speedup: float | None
    accuracy_decrease: float | None
    time_to_accuracy_s: float | None


def compare(baseline: RunSummary, runs: list[RunSummary], accuracy_threshold: float | None = None) -> list[Comparison]:
    """Compare each run (the baseline included, first) with the baseline.

    Args:
        accuracy_threshold: for time-to-accuracy; default 90 % of the baseline's final accuracy.
    """
    if accuracy_threshold is None and baseline.accuracy is not None:
        accuracy_threshold = 0.9 * baseline.accuracy
    out = []
    for r in [baseline, *[r for r in runs if r.run_id != baseline.run_id]]:
        speedup = baseline.runtime_s / r.runtime_s if baseline.runtime_s and r.runtime_s else None
        dec = baseline.accuracy - r.accuracy if baseline.accuracy is not None and r.accuracy is not None else None
        tta = r.time_to_accuracy_s(accuracy_threshold) if accuracy_threshold is not None else None
        out.append(Comparison(r, speedup, dec, tta))
    return out


def is_baseline_run(summary: RunSummary) -> bool:
    """True for a completed run of the registry's baseline model (:func:`ddlscope.distribution.baseline`)."""
    return summary.strategy == distribution.baseline().name and summary.status == "completed"


def pick_baseline(summaries: list[RunSummary]) -> RunSummary:
    """The baseline among runs: the first completed run of the baseline model (``single``), else the first run."""
    return next((s for s in summaries if is_baseline_run(s)), summaries[0])
