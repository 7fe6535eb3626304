"""Run summaries and comparisons with thesis 000's rules, and the bottleneck verdict.

Comparison rules (thesis 000, final version; seeds README):

- a run's **runtime** is the maximum over its workers of their training time (first step start
  to last step end, minus the time spent in held-out evaluations);
- its **accuracy** is the maximum over its peers of their final held-out accuracy;
- **system metrics** (CPU %, RSS, network bytes) are averaged over its peers; network bytes per
  peer are unknown (None, with the reason) when any peer's could not be counted
  (:mod:`ddlscope.measure.host`) or a peer stored no host sample, never 0;
- **speedup** = baseline runtime / run runtime (the same sample budget, so the same work);
- **accuracy decrease** = baseline accuracy - run accuracy (fraction; > 0 means worse);
- **time-to-accuracy**: training seconds (evaluations excluded) until any peer's held-out
  accuracy first reaches the threshold (None if it never does).

- **training seconds**, the x axis of every curve: wall time since the worker's training start,
  the held-out evaluations before that point excluded (an evaluation's ``train_time_s``; for a
  step, its end minus the training start minus the evaluation time recorded before it). Curves
  are per peer (:attr:`RunSummary.eval_curves`, :attr:`RunSummary.loss_curves`).

Step-time shares exclude warm-up steps; a worker's step parts are
:func:`ddlscope.measure.parts.measured_parts` (``optimizer_s`` without the averaging it contains
in the store). The **bottleneck** is the largest share among input (``data_load_s``), compute
(forward + backward + local optimizer work), communication (``averaging_s`` + ``comm_wait_s``:
averaging and collectives the worker waited for), for pipelines the bubble (``bubble_s``:
stages idle waiting for a neighbour) and, where measured, **background** work: the CPU seconds
per step of the worker's other threads and child processes (collaborative: hivemind's DHT, p2pd
and averagers) over the step time. Background work runs beside the step rather than inside it,
so the shares then sum to more than 100 %; on busy cores it takes its CPU from forward and backward.

The **baseline** of a comparison is the first completed run of the registry's baseline model
(:func:`ddlscope.distribution.baseline`, ``single``). Without one among the runs there is no
speedup and no accuracy decrease (None), and time-to-accuracy only with an explicit threshold.

**Chance level**: a run's accuracy is *near chance* when it is below ``chance + NEAR_CHANCE_MARGIN
x (1 - chance)``, chance = 1 / the dataset's classes (:data:`ddlscope.workloads.datasets.DATASETS`;
unknown for a dataset given by path). Comparisons flag it (:attr:`Comparison.notes`), and a
time-to-accuracy threshold at or below that level is not used: reaching it says nothing.

Pipeline stages all process the same batches, so a pipeline run's samples and throughput are
those of one stage (the slowest), not the sum over workers.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from ddlscope import distribution
from ddlscope.analyze.moe import MoESummary, summarize_moe
from ddlscope.analyze.swarm import SwarmAnalysis, analyze_swarm
from ddlscope.measure.host import UNKNOWN_EVENT
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
    #: TCP bytes of the worker's last host sample; None when they could not be counted (``net_unknown_reason``)
    net_sent_bytes: int | None
    net_recv_bytes: int | None
    averaging_rounds: int
    averaging_rounds_failed: int
    mean_group_size: float | None
    mean_comm_s: float = 0.0
    mean_comm_bytes: float = 0.0
    peak_memory_bytes: int | None = None
    #: CPU seconds per step of the worker's background work (collaborative: hivemind's processes
    #: and threads); None when not measured
    mean_background_cpu_s: float | None = None
    #: why ``net_sent_bytes``/``net_recv_bytes`` are unknown; None when they were counted
    net_unknown_reason: str | None = None


@dataclass
class Verdict:
    """The bottleneck of a run: ``kind`` is one of :data:`VERDICT_LABELS`' values, ``shares`` the
    fractions of the mean step time behind it (``background`` only when measured)."""

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
    #: mean over peers of sent + received TCP bytes; None when any peer's are unknown (``net_unknown_reason``)
    mean_net_bytes_per_peer: float | None
    workers: list[WorkerSummary]
    verdict: Verdict | None
    #: (training seconds, accuracy) of every peer's evaluations, sorted by time: for time-to-accuracy only
    eval_curve: list[tuple[float, float]] = field(default_factory=list)
    #: per peer (worker index): its (training seconds, held-out accuracy), in time order
    eval_curves: dict[int, list[tuple[float, float]]] = field(default_factory=dict)
    #: per peer (worker index): its (training seconds at the step's end, training loss), in step order
    loss_curves: dict[int, list[tuple[float, float]]] = field(default_factory=dict)
    moe: MoESummary | None = None  # mixture-of-experts figures (ddlscope.analyze.moe), for runs with such rows
    swarm: SwarmAnalysis | None = None  # per-peer figures and churn (ddlscope.analyze.swarm), collaborative runs
    #: accuracy of guessing, 1 / classes of the run's dataset; None when the dataset is not a known name
    chance_accuracy: float | None = None
    #: why ``mean_net_bytes_per_peer`` is unknown (the peers' reasons); None when it was counted
    net_unknown_reason: str | None = None

    @property
    def label(self) -> str:
        """``name (run id)``: how plots and tables name the run (names need not be unique)."""
        return f"{self.name} ({self.run_id})"

    @property
    def near_chance(self) -> bool:
        """True when the run's accuracy is near chance (see the module docstring); False when unknown."""
        return is_near_chance(self.accuracy, self.chance_accuracy)

    def time_to_accuracy_s(self, threshold: float) -> float | None:
        """Seconds until any peer's held-out accuracy first reached ``threshold`` (0..1), else None."""
        return next((t for t, acc in self.eval_curve if acc >= threshold), None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


NEAR_CHANCE_MARGIN = 0.1
"""An accuracy below ``chance + NEAR_CHANCE_MARGIN x (1 - chance)`` is near chance (0.19 for 10 classes)."""


def is_near_chance(accuracy: float | None, chance: float | None) -> bool:
    """True when ``accuracy`` (0..1) is below the near-chance level of ``chance`` (0..1); False when either is None."""
    return accuracy is not None and chance is not None and accuracy < near_chance_level(chance)


def near_chance_level(chance: float) -> float:
    """The accuracy (0..1) below which a run counts as near chance: ``chance + NEAR_CHANCE_MARGIN x (1 - chance)``."""
    return chance + NEAR_CHANCE_MARGIN * (1.0 - chance)


def chance_accuracy(config: dict[str, Any]) -> float | None:
    """1 / classes of the stored config's ``dataset`` when it is a known dataset name, else None."""
    from ddlscope.workloads.datasets import DATASETS

    spec = DATASETS.get(str(config.get("dataset")))
    return 1.0 / spec.num_classes if spec is not None else None


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def summarize_worker(index: int, status: str, start: float | None, end: float | None, eval_s: float,
                     steps: list[dict], evals: list[dict], host: list[dict], peak_memory_bytes: int | None = None,
                     net_unknown_reason: str | None = None) -> WorkerSummary:
    """Reduce one worker's stored rows to a :class:`WorkerSummary`.

    ``net_unknown_reason``: the reason the worker's sampler stored for not counting TCP bytes
    (:data:`ddlscope.measure.host.UNKNOWN_EVENT`), used when its last host sample has none.
    """
    timed = [s for s in steps if not s["warmup"]]
    parts = measured_parts(timed)
    phases = {p: parts.get(p, 0.0) for p in STEP_PARTS}
    span = sum(s["step_s"] for s in timed)
    samples = sum(s["samples"] for s in steps)
    rounds = [s for s in steps if s["averaging_round"]]
    sizes = [s["averaging_group_size"] for s in rounds if s["averaging_group_size"] is not None]
    last = host[-1] if host else {}
    sent, received = last.get("net_sent_bytes"), last.get("net_recv_bytes")
    net_reason = None
    if not host:
        net_reason = "no host sample stored"
    elif sent is None or received is None:
        net_reason = net_unknown_reason or "not counted (no reason stored)"
    return WorkerSummary(
        worker_index=index, status=status,
        runtime_s=(end - start - eval_s) if start is not None and end is not None else None,
        steps=len(steps), samples=samples,
        throughput_samples_per_s=sum(s["samples"] for s in timed) / span if span > 0 else None,
        mean_phase_s=phases,
        final_accuracy=evals[-1]["accuracy"] if evals else None,
        mean_cpu_percent=_mean([h["cpu_percent"] for h in host[1:] if h["cpu_percent"] is not None]),
        peak_rss_bytes=max((h["rss_bytes"] or 0 for h in host), default=None),
        net_sent_bytes=None if net_reason else int(sent), net_recv_bytes=None if net_reason else int(received),
        averaging_rounds=len(rounds), averaging_rounds_failed=sum(1 for s in rounds if s["averaging_succeeded"] == 0),
        mean_group_size=_mean(sizes),
        mean_comm_s=_mean([s["comm_s"] or 0.0 for s in timed]) or 0.0,
        mean_comm_bytes=_mean([s["comm_bytes"] or 0 for s in timed]) or 0.0,
        peak_memory_bytes=peak_memory_bytes,
        mean_background_cpu_s=_mean([s["background_cpu_s"] for s in timed if s.get("background_cpu_s") is not None]),
        net_unknown_reason=net_reason,
    )


def loss_curve(steps: list[dict], evals: list[dict], train_start: float | None) -> list[tuple[float, float]]:
    """One worker's (training seconds at the step's end, loss), on the x axis of its evaluations.

    Training seconds = step end (``wall_time + step_s``) - ``train_start`` - the evaluation time
    before the step's end. An evaluation's row is written when it ends (``wall_time``), after
    ``train_time_s`` training seconds, so the evaluation time up to then is ``wall_time -
    train_start - train_time_s``. Steps without a loss are left out; no ``train_start``: empty.

    Args:
        steps: the worker's step rows, in step order.
        evals: the worker's evaluation rows.
        train_start: the worker's ``train_start_time`` (s since the epoch).
    """
    if train_start is None:
        return []
    ends = sorted((e["wall_time"], e["wall_time"] - train_start - e["train_time_s"]) for e in evals)
    points, k, eval_s = [], 0, 0.0
    for s in steps:
        end = s["wall_time"] + (s["step_s"] or 0.0)
        while k < len(ends) and ends[k][0] <= end:
            eval_s = max(eval_s, ends[k][1])
            k += 1
        if s["loss"] is not None:
            points.append((end - train_start - eval_s, s["loss"]))
    return points


VERDICT_LABELS = {"input": "input-bound", "compute": "compute-bound", "communication": "communication/averaging-bound",
                  "bubble": "pipeline-bubble-bound", "background": "background-work-bound"}
"""The verdict's ``kind`` for each share that can be the largest."""


def bottleneck(workers: list[WorkerSummary]) -> Verdict | None:
    """Classify where the step time of a run goes (mean over workers, warm-up excluded).

    The verdict names the largest of the shares (fractions of the mean step time): ``input``,
    ``compute``, ``communication``, ``bubble`` and, when any worker measured it, ``background``
    (background CPU seconds per step over the step time; see the module docstring). None when no
    worker measured a step.
    """
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
    background = [w.mean_background_cpu_s for w in measured if w.mean_background_cpu_s is not None]
    if background:
        shares["background"] = statistics.fmean(background) / total
    kind = max(shares, key=shares.get)
    label = VERDICT_LABELS[kind]
    parts = ", ".join(f"{k} {v:.0%}" for k, v in shares.items() if k != "background")
    explanation = f"{label}: of a mean step of {total * 1000:.1f} ms, {parts}."
    if kind != "input" and shares["input"] >= 0.10:
        explanation += f" The data pipeline still stalls training {shares['input']:.0%} of the time."
    if background and (kind == "background" or shares["background"] >= 0.10):
        explanation += (f" Background work (hivemind's DHT, p2pd and averagers) used {statistics.fmean(background) * 1000:.0f} "
                        f"CPU-ms per step, {shares['background']:.0%} of the step"
                        + (", more than any part of the step: " if kind == "background" else ": ")
                        + "on busy cores it slows forward and backward by about as much.")
    runtimes = [w.runtime_s for w in workers if w.runtime_s]
    if len(runtimes) > 1 and max(runtimes) > 1.2 * min(runtimes):
        explanation += f" Peers differ: runtime {min(runtimes):.1f}-{max(runtimes):.1f} s (stragglers)."
    return Verdict(label, shares, explanation)


def _unknown_metric_reasons(events: list[dict]) -> dict[tuple[int, str], str]:
    """``{(worker index, metric): reason}`` from a run's :data:`ddlscope.measure.host.UNKNOWN_EVENT` events (first reason kept)."""
    out: dict[tuple[int, str], str] = {}
    for e in events:
        if e["kind"] == UNKNOWN_EVENT and e["worker_index"] is not None:
            detail = json.loads(e["detail_json"] or "{}")
            out.setdefault((int(e["worker_index"]), str(detail.get("metric"))), str(detail.get("reason")))
    return out


def summarize_run(store: ResultsStore, run_id: str) -> RunSummary:
    """Reduce a stored run with the comparison rules. Works on failed/interrupted runs too.

    Raises:
        KeyError: no run ``run_id`` in the store.
    """
    run = store.run(run_id)
    if run is None:
        raise KeyError(f"no run {run_id!r} in {store.path}")
    cfg = store.run_config(run_id)
    steps, evals, host = (store.rows(t, run_id) for t in ("steps", "evals", "host_samples"))
    unknown = _unknown_metric_reasons(store.rows("events", run_id))
    workers, eval_curves, loss_curves = [], {}, {}
    for w in store.rows("workers", run_id):
        i = w["worker_index"]
        end = w["train_end_time"]
        w_steps = [s for s in steps if s["worker_index"] == i]
        w_evals = [e for e in evals if e["worker_index"] == i]
        if end is None and w_steps:  # killed mid-way: training time up to its last stored step
            end = w_steps[-1]["wall_time"] + (w_steps[-1]["step_s"] or 0.0)
        workers.append(summarize_worker(i, w["status"], w["train_start_time"], end, w["eval_s"] or 0.0, w_steps,
                                        w_evals, [h for h in host if h["worker_index"] == i], w["peak_memory_bytes"],
                                        unknown.get((i, "net_sent_bytes")) or unknown.get((i, "net_recv_bytes"))))
        if w_evals:
            eval_curves[i] = sorted((e["train_time_s"], e["accuracy"]) for e in w_evals)
        losses = loss_curve(w_steps, w_evals, w["train_start_time"])
        if losses:
            loss_curves[i] = losses
    runtimes = [w.runtime_s for w in workers if w.runtime_s is not None]
    accs = [w.final_accuracy for w in workers if w.final_accuracy is not None]
    throughputs = [w.throughput_samples_per_s for w in workers if w.throughput_samples_per_s]
    pipeline = not distribution.get(run["strategy"]).data_parallel  # stages share the batches: count them once
    curve = sorted((e["train_time_s"], e["accuracy"]) for e in evals)
    net_unknown = [f"peer {w.worker_index}: {w.net_unknown_reason}" for w in workers if w.net_unknown_reason]
    return RunSummary(
        run_id=run_id, name=run["name"], strategy=run["strategy"], status=run["status"], reason=run["reason"],
        peers=int(cfg.get("peers", 1)), config=cfg,
        runtime_s=max(runtimes) if runtimes else None,
        throughput_samples_per_s=(min(throughputs) if pipeline else sum(throughputs)) if throughputs else None,
        accuracy=max(accs) if accs else None,
        samples=(max((w.samples for w in workers), default=0) if pipeline else sum(w.samples for w in workers)),
        mean_cpu_percent=_mean([w.mean_cpu_percent for w in workers if w.mean_cpu_percent is not None]),
        mean_net_bytes_per_peer=None if net_unknown or not workers else _mean(
            [w.net_sent_bytes + w.net_recv_bytes for w in workers]),
        net_unknown_reason="; ".join(net_unknown) or None,
        workers=workers, verdict=bottleneck(workers), eval_curve=curve, eval_curves=eval_curves,
        loss_curves=loss_curves, moe=summarize_moe(store, run_id), chance_accuracy=chance_accuracy(cfg),
        swarm=analyze_swarm(store, run_id) if distribution.get(run["strategy"]).per_peer_report and steps else None,
    )


@dataclass
class Comparison:
    """A run against the baseline. ``speedup`` > 1 means faster than the baseline; ``speedup`` and
    ``accuracy_decrease`` are None without a baseline run (:func:`is_baseline_run`); ``notes`` are
    warnings on the figures (near-chance accuracy, network bytes that could not be counted)."""

    run: RunSummary
    speedup: float | None
    accuracy_decrease: float | None
    time_to_accuracy_s: float | None
    notes: list[str] = field(default_factory=list)


def default_threshold(baseline: RunSummary | None) -> float | None:
    """The default time-to-accuracy threshold: 90 % of a baseline run's final accuracy; None without one
    (``baseline`` None or not a :func:`is_baseline_run`) or without its accuracy."""
    if baseline is None or not is_baseline_run(baseline) or baseline.accuracy is None:
        return None
    return 0.9 * baseline.accuracy


def compare(baseline: RunSummary | None, runs: list[RunSummary], accuracy_threshold: float | None = None
            ) -> list[Comparison]:
    """Compare each run (``baseline`` first when given) with the baseline.

    Speedup and accuracy decrease need a baseline run (:func:`is_baseline_run`): with ``baseline``
    None or not such a run (then it is just listed first), they are None.

    Args:
        baseline: from :func:`find_baseline` (or :func:`pick_baseline`), or None.
        runs: the runs; the baseline among them is not repeated.
        accuracy_threshold: for time-to-accuracy (0..1); default :func:`default_threshold`. A
            threshold at or below a run's near-chance level (see the module docstring) gives that run
            no time-to-accuracy, with a note.
    """
    real = baseline is not None and is_baseline_run(baseline)
    if accuracy_threshold is None:
        accuracy_threshold = default_threshold(baseline)
    out = []
    for r in ([baseline] if baseline is not None else []) + [r for r in runs if baseline is None or r.run_id != baseline.run_id]:
        speedup = baseline.runtime_s / r.runtime_s if real and baseline.runtime_s and r.runtime_s else None
        dec = baseline.accuracy - r.accuracy if real and baseline.accuracy is not None and r.accuracy is not None else None
        tta, notes = None, []
        if r.near_chance:
            notes.append(f"accuracy {r.accuracy:.3f} is near chance ({r.chance_accuracy:.3f} = 1/"
                         f"{round(1 / r.chance_accuracy)} classes): the model has barely learned; its time-to-accuracy "
                         f"and accuracy decrease say little")
        if accuracy_threshold is not None:
            if r.chance_accuracy is not None and accuracy_threshold <= near_chance_level(r.chance_accuracy):
                notes.append(f"time-to-accuracy threshold {accuracy_threshold:.3f} is near chance "
                             f"({r.chance_accuracy:.3f}): not used")
            else:
                tta = r.time_to_accuracy_s(accuracy_threshold)
        if r.net_unknown_reason:
            notes.append(f"network bytes per peer unknown ({r.net_unknown_reason})")
        out.append(Comparison(r, speedup, dec, tta, notes))
    return out


def is_baseline_run(summary: RunSummary) -> bool:
    """True for a completed run of the registry's baseline model (:func:`ddlscope.distribution.baseline`)."""
    return summary.strategy == distribution.baseline().name and summary.status == "completed"


def find_baseline(summaries: list[RunSummary]) -> RunSummary | None:
    """The first completed run of the baseline model (``single``) among ``summaries``, else None."""
    return next((s for s in summaries if is_baseline_run(s)), None)


def pick_baseline(summaries: list[RunSummary]) -> RunSummary:
    """The run to list first: :func:`find_baseline`, else the first run (which :func:`compare` then
    does not use as a baseline: no speedup, no accuracy decrease)."""
    return find_baseline(summaries) or summaries[0]
