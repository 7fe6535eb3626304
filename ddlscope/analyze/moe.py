"""The report's view of mixture-of-experts runs: experts, expert servers, faults and a verdict.

:func:`summarize_moe` reduces a run's ``moe_*`` rows (see :mod:`ddlscope.store.db`; what each
column means is in :mod:`ddlscope.strategies.dmoe` and :mod:`ddlscope.moe.server`) to a
:class:`MoESummary`; a run without such rows gets ``None``, so the report adds its section
"Mixture of experts" (:func:`moe_markdown`) and plots (:func:`write_moe_plots`) only for runs that
have them:

- per trainer and over all trainers: mean beam-search, remote forward and remote backward wait per
  step (warm-up steps excluded, as everywhere in the report), calls, failed calls, samples no
  expert answered, call latency and payload;
- per expert: samples routed to it (forward calls), failures, its share of all calls and the
  servers that answered for it (a call's ``peer_id`` is matched with the ``services`` row, index
  and generation, that recorded it);
- per expert-server process (index, generation): calls answered and failed, batches, batch size,
  queue wait, compute seconds and the busy fraction (compute seconds / its lifetime), CPU seconds
  and peak RSS, its final status;
- a throughput timeline (samples/s per trainer in windows of ``window_s`` seconds) with the
  services' start / kill / death events, and per kill or death the throughput, dropped samples and
  held-out accuracy before and after it;
- :class:`MoEVerdict`: the largest share of a trainer's step (trunk compute, beam search, remote
  expert wait, input) and, when the remote wait is largest, whether the servers (busy, queueing)
  or the per-call RPC overhead (idle servers, slow calls) make it.

Times on the timeline are seconds after the run's services started (the origin the launcher's
schedule ``dmoe.server_events`` uses; from the first ``service_started`` event, whose ``at_s`` is
taken when its row is written), or after the first step when the run has no services.

This module reads the store only; it never decides by a distribution model's name (a run "has"
mixture-of-experts figures when it has rows).
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddlscope.measure.parts import measured_parts
from ddlscope.store.db import ResultsStore

WINDOW_S = 2.0
"""Width of a throughput-timeline window (seconds)."""

MIN_WINDOW_COVER = 0.25
"""A trainer's first or last window is on the timeline if it trained at least this share of it."""

SERVICE_EVENTS = {"service_started": "started", "service_killed": "killed", "service_died": "died"}
"""The ``events`` kinds the launcher writes for services (:mod:`ddlscope.launch.services`) -> marker label."""

FAULT_EVENTS = ("killed", "died")
"""Service events whose effect on throughput and accuracy the summary measures."""

BUSY_SERVER_FRACTION = 0.5
"""A server computing at least this share of its lifetime makes requests queue behind its single
compute thread (hivemind's Runtime processes one batch at a time): the verdict calls the servers
the bottleneck of the remote wait."""

SERVER_SHARE_OF_LATENCY = 0.5
"""... or when the servers' queue wait + compute is at least this share of an answered call's mean
latency; below both, the remote wait is per-call RPC overhead (serialization, p2p daemon, network)."""


# ---------------------------------------------------------------------- results
@dataclass
class TrainerMoE:
    """Mixture-of-experts figures of one trainer (``worker_index``), or of all (``worker_index`` None).

    Means are per step over steps that are not warm-up (``timed_steps``); counts and bytes are over
    every step with a ``moe_steps`` row (``steps``). Fields the run did not measure are None
    (in-process experts have no beam search, remote wait, failures or latency).
    """

    worker_index: int | None
    steps: int
    timed_steps: int
    mean_step_s: float | None
    mean_input_s: float | None  # data loading
    mean_trunk_s: float | None  # the trainer's own forward, backward and optimizer (in-process experts included)
    mean_beam_search_s: float | None
    mean_expert_forward_s: float | None
    mean_expert_backward_s: float | None
    samples: int
    samples_dropped: int | None
    dropped_share: float | None  # samples_dropped / samples
    calls: int  # forward + backward calls to experts (in-process: samples routed)
    failed_calls: int | None
    failure_rate: float | None  # failed_calls / calls
    mean_call_latency_s: float | None
    #: 95th percentile over calls, each call given its row's mean latency (the store keeps per step,
    #: expert and direction a sum and a maximum, not single calls; exact where a row holds one call)
    p95_call_latency_s: float | None
    max_call_latency_s: float | None
    #: mean over rows without a failure (failed calls' latency is mostly the timeout they waited for)
    mean_answered_latency_s: float | None
    payload_sent_bytes: int | None
    payload_received_bytes: int | None


@dataclass
class ExpertLoad:
    """The calls one expert got, from every trainer, over the whole run."""

    expert: str
    forward_calls: int  # = samples routed to it (hivemind sends each sample to each chosen expert in its own call)
    backward_calls: int
    failed: int
    share: float  # of all calls of the run, both directions
    servers: list[str]  # labels of the server processes that answered or hosted it; [] for in-process experts
    mean_latency_s: float | None


@dataclass
class ServerMoE:
    """One expert-server process (``service_index``, ``generation``: 0, then +1 per restart)."""

    label: str
    service_index: int
    generation: int
    status: str
    reason: str | None
    peer_id: str | None
    experts: list[str]
    started_at_s: float | None  # on the timeline (see the module docstring)
    ended_at_s: float | None
    lifetime_s: float | None  # start to end, or to its last record while it still ran
    calls: int  # calls the trainers addressed to it
    answered: int
    failed: int
    payload_bytes: int  # tensor bytes of its calls, both ways, as the trainers counted them
    batches: int
    batch_samples: int
    mean_batch_size: float | None
    mean_queue_wait_s: float | None  # over batches: the oldest request's wait when the batch was taken
    p95_queue_wait_s: float | None
    compute_s: float
    busy_fraction: float | None  # compute_s / lifetime_s
    cpu_s: float | None  # CPU seconds of its process tree (last sample)
    peak_pss_bytes: int | None


@dataclass
class ServiceEvent:
    """A service started, was killed, or died, ``at_s`` seconds on the timeline."""

    what: str  # started / killed / died
    kind: str
    service_index: int
    generation: int
    at_s: float

    @property
    def label(self) -> str:
        return f"s{self.service_index}" + (f".{self.generation}" if self.generation else "") + f" {self.what}"


@dataclass
class TrainerTimeline:
    """``points``: (window middle on the timeline in s, samples/s of the trainer in that window)."""

    worker_index: int
    points: list[tuple[float, float]]


@dataclass
class FaultEffect:
    """Figures before and after a service was killed or died (all trainers together).

    *Before* is from the previous service event (or the first step) to this one, *after* from this
    one to the next (or the end of the last step). Accuracy: each trainer's last held-out
    evaluation before and first after (by the end of the step it followed), averaged over trainers.
    """

    event: ServiceEvent
    samples_per_s_before: float | None
    samples_per_s_after: float | None
    lowest_window_samples_per_s_after: float | None  # all trainers, windows of the timeline after the event
    dropped_share_before: float | None
    dropped_share_after: float | None
    failed_calls_after: int | None
    accuracy_before: float | None
    accuracy_after: float | None


@dataclass
class MoEVerdict:
    """Where a trainer's step goes; ``shares`` of the mean step time (fractions)."""

    kind: str
    shares: dict[str, float]
    explanation: str


@dataclass
class MoESummary:
    """A run's mixture-of-experts figures (see the module docstring)."""

    run_id: str
    name: str
    remote: bool  # experts answered from other processes (calls carry a server's peer id or beam search ran)
    trainers: list[TrainerMoE]
    overall: TrainerMoE
    experts: list[ExpertLoad]
    load_imbalance: float | None  # max / mean forward calls over the experts listed
    servers: list[ServerMoE]
    mean_server_s_per_call: float | None  # servers' queue wait + compute per sample they answered
    events: list[ServiceEvent]
    window_s: float
    timeline: list[TrainerTimeline]
    faults: list[FaultEffect]
    verdict: MoEVerdict | None = None
    unattributed_calls: int = 0  # remote calls whose peer id no services row recorded
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------- helpers
def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def weighted_quantile(pairs: list[tuple[float, float]], q: float) -> float | None:
    """Nearest-rank quantile ``q`` (0..1) of values with weights (``[(value, weight)]``, weights >= 0).

    The smallest value whose cumulative weight reaches ``q`` x the total weight (the nearest-rank
    definition, Hyndman & Fan 1996 type 1, with weights). None when the total weight is 0.
    """
    pairs = sorted((v, w) for v, w in pairs if w > 0)
    total = sum(w for _, w in pairs)
    if total <= 0:
        return None
    cum = 0.0
    for v, w in pairs:
        cum += w
        if cum >= q * total - 1e-12:
            return v
    return pairs[-1][0]


def _sum_or_none(rows: list[dict], key: str) -> int | float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return sum(values) if values else None


def _label(kind: str, index: int, generation: int) -> str:
    return f"{kind} {index}" + (f" (gen {generation})" if generation else "")


def _origin(events: list[dict], steps: list[dict]) -> float | None:
    """Unix time of 0 on the timeline: when the services started, else the first step."""
    for e in events:
        detail = json.loads(e["detail_json"] or "{}")
        if e["kind"] == "service_started" and detail.get("at_s") is not None:
            return float(e["wall_time"]) - float(detail["at_s"])
    return min((s["wall_time"] for s in steps), default=None)


# ---------------------------------------------------------------------- summary
def _trainer(index: int | None, moe_rows: list[dict], calls: list[dict], step_by_key: dict) -> TrainerMoE:
    keys = [(r["worker_index"], r["step"]) for r in moe_rows]
    timed_keys = {k for k in keys if k in step_by_key and not step_by_key[k]["warmup"]}
    timed = [r for r in moe_rows if (r["worker_index"], r["step"]) in timed_keys]
    parts = measured_parts([step_by_key[k] for k in sorted(timed_keys)])
    samples = sum(r["samples"] for r in moe_rows)
    dropped = _sum_or_none(moe_rows, "samples_dropped")
    n_calls = sum(c["calls"] for c in calls)
    has_failures = any(r.get("failed_calls") is not None for r in moe_rows)
    failed = sum(c["failed"] for c in calls) if has_failures else None
    timed_calls = [c for c in calls if c.get("latency_s_sum") is not None and c["calls"] > 0]
    latency_calls = sum(c["calls"] for c in timed_calls)
    answered = [c for c in timed_calls if not c["failed"]]
    answered_calls = sum(c["calls"] for c in answered)

    def mean_of(key: str) -> float | None:
        values = [r[key] for r in timed if r.get(key) is not None]
        return statistics.fmean(values) if values else None

    return TrainerMoE(
        worker_index=index, steps=len(moe_rows), timed_steps=len(timed),
        mean_step_s=parts.get("step_s"), mean_input_s=parts.get("data_load_s"),
        mean_trunk_s=(parts["forward_s"] + parts["backward_s"] + parts["optimizer_s"]) if parts else None,
        mean_beam_search_s=mean_of("beam_search_s"), mean_expert_forward_s=mean_of("expert_forward_s"),
        mean_expert_backward_s=mean_of("expert_backward_s"),
        samples=samples, samples_dropped=dropped,
        dropped_share=dropped / samples if dropped is not None and samples else None,
        calls=n_calls, failed_calls=failed, failure_rate=failed / n_calls if failed is not None and n_calls else None,
        mean_call_latency_s=(sum(c["latency_s_sum"] for c in timed_calls) / latency_calls) if latency_calls else None,
        p95_call_latency_s=weighted_quantile([(c["latency_s_sum"] / c["calls"], c["calls"]) for c in timed_calls], 0.95),
        max_call_latency_s=max((c["latency_s_max"] for c in calls if c.get("latency_s_max") is not None), default=None),
        mean_answered_latency_s=(sum(c["latency_s_sum"] for c in answered) / answered_calls) if answered_calls else None,
        payload_sent_bytes=_sum_or_none(moe_rows, "bytes_sent"),
        payload_received_bytes=_sum_or_none(moe_rows, "bytes_received"),
    )


def _timeline(steps: list[dict], origin: float, window_s: float) -> list[TrainerTimeline]:
    """Samples/s per trainer and window: samples of the steps that started in the window / the part of
    the window the trainer was training (first step's start to last step's end), so the first and
    last windows are not diluted; windows it trained less than :data:`MIN_WINDOW_COVER` of are left out."""
    out = []
    for wi in sorted({s["worker_index"] for s in steps}):
        mine = [s for s in steps if s["worker_index"] == wi]
        active_from = min(s["wall_time"] for s in mine) - origin
        active_to = max(s["wall_time"] + (s["step_s"] or 0.0) for s in mine) - origin
        bins: dict[int, int] = defaultdict(int)
        for s in mine:
            bins[math.floor((s["wall_time"] - origin) / window_s)] += s["samples"]
        points = []
        for b in range(min(bins), max(bins) + 1):
            covered = min((b + 1) * window_s, active_to) - max(b * window_s, active_from)
            if covered >= MIN_WINDOW_COVER * window_s:
                points.append(((b + 0.5) * window_s, bins.get(b, 0) / covered))
        out.append(TrainerTimeline(wi, points))
    return out


def _fault_effects(events: list[ServiceEvent], steps: list[dict], moe_rows: list[dict], calls: list[dict],
                   evals: list[dict], timeline: list[TrainerTimeline], origin: float, window_s: float
                   ) -> list[FaultEffect]:
    if not steps:
        return []
    rel = {(s["worker_index"], s["step"]): s["wall_time"] - origin for s in steps}
    start = min(rel.values())
    end = max(s["wall_time"] - origin + (s["step_s"] or 0.0) for s in steps)
    ends = {(s["worker_index"], s["step"]): s["wall_time"] - origin + (s["step_s"] or 0.0) for s in steps}
    # all trainers' samples/s per window (windows share the origin, so they line up)
    total: dict[float, float] = defaultdict(float)
    for tl in timeline:
        for t, v in tl.points:
            total[t] += v
    times = sorted(e.at_s for e in events)
    out = []
    for ev in events:
        if ev.what not in FAULT_EVENTS:
            continue
        before_from = max([t for t in times if t < ev.at_s] + [start])
        after_to = min([t for t in times if t > ev.at_s] + [end])

        def in_span(key, lo, hi) -> bool:
            return key in rel and lo <= rel[key] < hi

        def rate(lo: float, hi: float) -> float | None:
            if hi <= lo:
                return None
            return sum(s["samples"] for s in steps if in_span((s["worker_index"], s["step"]), lo, hi)) / (hi - lo)

        def dropped(lo: float, hi: float) -> float | None:
            rows = [r for r in moe_rows if in_span((r["worker_index"], r["step"]), lo, hi)
                    and r.get("samples_dropped") is not None]
            n = sum(r["samples"] for r in rows)
            return sum(r["samples_dropped"] for r in rows) / n if n else None

        after_keys = {k for k in rel if ev.at_s <= rel[k] < after_to}
        failed_after = [c["failed"] for c in calls if (c["worker_index"], c["step"]) in after_keys]
        acc_before, acc_after = [], []
        for wi in sorted({e["worker_index"] for e in evals}):
            timed_evals = sorted((ends.get((wi, e["step"]), e["wall_time"] - origin), e["accuracy"])
                                 for e in evals if e["worker_index"] == wi)
            b = [a for t, a in timed_evals if t <= ev.at_s]
            a = [a for t, a in timed_evals if t > ev.at_s]
            if b:
                acc_before.append(b[-1])
            if a:
                acc_after.append(a[0])
        lows = [v for t, v in total.items()
                if ev.at_s <= t - window_s / 2 + 1e-9 and t + window_s / 2 <= after_to + 1e-9]
        out.append(FaultEffect(
            event=ev, samples_per_s_before=rate(before_from, ev.at_s), samples_per_s_after=rate(ev.at_s, after_to),
            lowest_window_samples_per_s_after=min(lows) if lows else None,
            dropped_share_before=dropped(before_from, ev.at_s), dropped_share_after=dropped(ev.at_s, after_to),
            failed_calls_after=sum(failed_after) if calls else None,
            accuracy_before=_mean(acc_before), accuracy_after=_mean(acc_after)))
    return out


def _servers(store: ResultsStore, run_id: str, services: list[dict], calls: list[dict], origin: float | None
             ) -> tuple[list[ServerMoE], dict[str, str]]:
    """Per server process figures, and peer id -> server label."""
    batches, samples = store.rows("moe_server_batches", run_id), store.rows("moe_server_samples", run_id)
    by_peer = {s["peer_id"]: s for s in services if s["peer_id"]}
    label_of_peer = {p: _label(s["kind"], s["service_index"], s["generation"]) for p, s in by_peer.items()}
    per_peer: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])  # peer id -> [calls, failed, payload bytes]
    for c in calls:
        if c["peer_id"]:
            per_peer[c["peer_id"]][0] += c["calls"]
            per_peer[c["peer_id"]][1] += c["failed"]
            per_peer[c["peer_id"]][2] += (c["bytes_sent"] or 0) + (c["bytes_received"] or 0)
    batches_of, samples_of = defaultdict(list), defaultdict(list)
    for b in batches:
        batches_of[(b["service_index"], b["generation"])].append(b)
    for x in samples:
        samples_of[(x["service_index"], x["generation"])].append(x)
    out = []
    for s in services:
        key = (s["service_index"], s["generation"])
        mine, mine_samples = batches_of[key], samples_of[key]
        n_calls, failed, payload = per_peer[s["peer_id"]] if s["peer_id"] else (0, 0, 0)
        last_seen = max([b["wall_time"] for b in mine] + [x["wall_time"] for x in mine_samples], default=None)
        end = s["ended_at"] if s["ended_at"] is not None else last_seen
        lifetime = end - s["started_at"] if end is not None and s["started_at"] is not None else None
        waits = [b["queue_wait_s"] for b in mine if b["queue_wait_s"] is not None]
        compute = sum(b["compute_s"] or 0.0 for b in mine)
        batch_samples = sum(b["batch_size"] for b in mine)
        cpus = [x["cpu_s"] for x in mine_samples if x["cpu_s"] is not None]
        pss = [x["pss_bytes"] for x in mine_samples if x["pss_bytes"] is not None]
        out.append(ServerMoE(
            label=_label(s["kind"], s["service_index"], s["generation"]), service_index=s["service_index"],
            generation=s["generation"], status=s["status"], reason=s["reason"], peer_id=s["peer_id"],
            experts=json.loads(s["experts"]) if s["experts"] else [],
            started_at_s=s["started_at"] - origin if s["started_at"] is not None and origin is not None else None,
            ended_at_s=end - origin if end is not None and origin is not None else None,
            lifetime_s=lifetime, calls=n_calls, answered=n_calls - failed, failed=failed, payload_bytes=payload,
            batches=len(mine), batch_samples=batch_samples, mean_batch_size=batch_samples / len(mine) if mine else None,
            mean_queue_wait_s=_mean(waits), p95_queue_wait_s=weighted_quantile([(w, 1.0) for w in waits], 0.95),
            compute_s=compute, busy_fraction=compute / lifetime if lifetime and lifetime > 0 else None,
            cpu_s=cpus[-1] if cpus else None, peak_pss_bytes=max(pss) if pss else None))
    return out, label_of_peer


def _experts(calls: list[dict], servers: list[ServerMoE], label_of_peer: dict[str, str]) -> list[ExpertLoad]:
    hosted: dict[str, list[str]] = defaultdict(list)
    for s in servers:
        for uid in s.experts:
            hosted[uid].append(s.label)
    def empty() -> dict[str, Any]:
        return {"forward": 0, "backward": 0, "failed": 0, "lat": 0.0, "lat_calls": 0, "servers": []}

    per: dict[str, dict[str, Any]] = defaultdict(empty, {uid: empty() for uid in hosted})  # hosted but never called: 0
    for c in calls:
        p = per[c["expert"]]
        p[c["direction"]] = p.get(c["direction"], 0) + c["calls"]
        p["failed"] += c["failed"]
        if c.get("latency_s_sum") is not None:
            p["lat"] += c["latency_s_sum"]
            p["lat_calls"] += c["calls"]
        label = label_of_peer.get(c["peer_id"]) if c["peer_id"] else None
        if c["peer_id"] and label is None:
            label = f"peer {c['peer_id'][-6:]}"
        if label and label not in p["servers"]:
            p["servers"].append(label)
    total = sum(c["calls"] for c in calls)
    out = []
    for uid in sorted(per):
        p = per[uid]
        servers = list(dict.fromkeys([*hosted.get(uid, []), *p["servers"]]))
        n = p["forward"] + p["backward"]
        out.append(ExpertLoad(uid, p["forward"], p["backward"], p["failed"], n / total if total else 0.0, servers,
                              p["lat"] / p["lat_calls"] if p["lat_calls"] else None))
    return out


def summarize_moe(store: ResultsStore, run_id: str, window_s: float = WINDOW_S) -> MoESummary | None:
    """Reduce a run's mixture-of-experts rows (see the module docstring).

    Args:
        store: the results store.
        run_id: the run.
        window_s: width of the throughput timeline's windows (seconds, > 0).

    Returns:
        The summary, or None when the run has no ``moe_steps`` rows (not a mixture-of-experts run,
        or the ``dense`` baseline, which routes nothing).

    Raises:
        KeyError: no run with that id.
        ValueError: ``window_s`` <= 0.
    """
    if not window_s > 0:
        raise ValueError(f"window_s = {window_s}; allowed: > 0 seconds")
    run = store.run(run_id)
    if run is None:
        raise KeyError(f"no run {run_id!r} in {store.path}")
    moe_rows = store.rows("moe_steps", run_id)
    if not moe_rows:
        return None
    calls = store.rows("moe_calls", run_id)
    steps = store.rows("steps", run_id)
    evals = store.rows("evals", run_id)
    services = store.services(run_id)
    services = [dict(s) for s in services]
    raw_events = [e for e in store.rows("events", run_id) if e["kind"] in SERVICE_EVENTS]
    step_by_key = {(s["worker_index"], s["step"]): s for s in steps}
    origin = _origin(raw_events, steps)
    remote = any(c["peer_id"] for c in calls) or any(r.get("beam_search_s") is not None for r in moe_rows)

    rows_of, calls_of = defaultdict(list), defaultdict(list)
    for r in moe_rows:
        rows_of[r["worker_index"]].append(r)
    for c in calls:
        calls_of[c["worker_index"]].append(c)
    trainers = [_trainer(wi, rows_of[wi], calls_of[wi], step_by_key) for wi in sorted(rows_of)]
    overall = _trainer(None, moe_rows, calls, step_by_key)

    servers, label_of_peer = _servers(store, run_id, services, calls, origin)
    experts = _experts(calls, servers, label_of_peer)
    loads = [e.forward_calls for e in experts]
    mean_load = _mean(loads)
    answered = sum(b.batch_samples for b in servers)
    server_time = sum(b["batch_size"] * ((b["queue_wait_s"] or 0.0) + (b["compute_s"] or 0.0))
                      for b in store.rows("moe_server_batches", run_id))

    events = []
    for e in raw_events:
        d = json.loads(e["detail_json"] or "{}")
        at = float(d["at_s"]) if d.get("at_s") is not None else (e["wall_time"] - origin if origin is not None else 0.0)
        events.append(ServiceEvent(SERVICE_EVENTS[e["kind"]], str(d.get("service", "service")), int(d.get("index", -1)),
                                   int(d.get("generation", 0)), at))
    events.sort(key=lambda e: e.at_s)
    timeline = _timeline(steps, origin, window_s) if origin is not None and steps else []
    faults = _fault_effects(events, steps, moe_rows, calls, evals, timeline, origin, window_s) if origin is not None else []
    notes = []
    unattributed = sum(c["calls"] for c in calls if c["peer_id"] and c["peer_id"] not in label_of_peer)
    if unattributed:
        notes.append(f"{unattributed} calls went to peers no services row of this run recorded (external servers?)")
    summary = MoESummary(
        run_id=run_id, name=run["name"], remote=remote, trainers=trainers, overall=overall, experts=experts,
        load_imbalance=max(loads) / mean_load if mean_load else None, servers=servers,
        mean_server_s_per_call=server_time / answered if answered else None, events=events, window_s=window_s,
        timeline=timeline, faults=faults, unattributed_calls=unattributed, notes=notes)
    summary.verdict = moe_verdict(summary)
    return summary


# ---------------------------------------------------------------------- verdict
def moe_verdict(s: MoESummary) -> MoEVerdict | None:
    """Name the largest share of a trainer's mean step (all trainers, warm-up excluded), with figures.

    Shares of the mean step time ``step_s``: input (data loading), trunk compute (the trainer's own
    forward, backward and optimizer; in-process experts included), beam search (DHT look-ups) and
    remote expert wait (forward + backward rounds). When the remote wait is largest it is put on the
    servers if the busiest server computed at least :data:`BUSY_SERVER_FRACTION` of its lifetime or
    the servers' queue wait + compute per call is at least :data:`SERVER_SHARE_OF_LATENCY` of the
    mean latency of an answered call (:attr:`TrainerMoE.mean_answered_latency_s`), else on the
    per-call RPC overhead. None when no step outside warm-up was timed.
    """
    o = s.overall
    if not o.timed_steps or not o.mean_step_s:
        return None
    step = o.mean_step_s
    shares = {"input": (o.mean_input_s or 0.0) / step, "trunk compute": (o.mean_trunk_s or 0.0) / step}
    if s.remote:
        shares["beam search"] = (o.mean_beam_search_s or 0.0) / step
        shares["remote expert wait"] = ((o.mean_expert_forward_s or 0.0) + (o.mean_expert_backward_s or 0.0)) / step
    kind = max(shares, key=shares.get)
    names = {"input": "input", "trunk compute": "trunk compute", "beam search": "beam search (DHT look-ups)",
             "remote expert wait": "remote expert wait"}
    parts = ", ".join(f"{names[k]} {v:.0%}" for k, v in shares.items())
    label = {"input": "input-bound", "trunk compute": "trunk-compute-bound", "beam search": "beam-search-bound",
             "remote expert wait": "remote-expert-bound"}[kind]
    if not s.remote:
        label += " (in-process experts)"
    text = f"of a mean trainer step of {step * 1000:.1f} ms, {parts}"
    if s.remote and o.mean_expert_forward_s is not None:
        text += (f" (forward {(o.mean_expert_forward_s or 0) * 1000:.1f} ms, "
                 f"backward {(o.mean_expert_backward_s or 0) * 1000:.1f} ms per step)")
    text += "."
    busiest = max((x for x in s.servers if x.busy_fraction is not None), key=lambda x: x.busy_fraction, default=None)
    latency = o.mean_answered_latency_s if o.mean_answered_latency_s is not None else o.mean_call_latency_s
    if kind == "remote expert wait":
        server_share = (s.mean_server_s_per_call / latency if s.mean_server_s_per_call is not None and latency
                        else None)
        busy = busiest is not None and busiest.busy_fraction >= BUSY_SERVER_FRACTION
        queued = server_share is not None and server_share >= SERVER_SHARE_OF_LATENCY
        if busy:
            label += " (expert compute)"
            text += " The servers' expert compute is the bottleneck:"
        elif queued:
            label += " (server queueing)"
            text += (" Requests wait on the servers while their compute thread is mostly idle: the servers' "
                     "processes (connection handler, task pools, p2pd) lack CPU, e.g. cores shared with trainers:")
        else:
            label += " (per-call RPC overhead)"
            text += " The servers are mostly idle, so the wait is per-call RPC overhead:"
        if busiest is not None:
            text += f" the busiest, {busiest.label}, computed {busiest.busy_fraction:.0%} of its lifetime"
            if busiest.mean_queue_wait_s is not None:
                text += f" (a batch's oldest sampled request waited {busiest.mean_queue_wait_s * 1000:.1f} ms on average)"
            text += ";"
        if latency is not None:
            text += f" an answered call took {latency * 1000:.1f} ms on average"
            if s.mean_server_s_per_call is not None:
                text += (f", a batch's oldest sampled request spent {s.mean_server_s_per_call * 1000:.1f} ms queued and "
                         f"computed on a server")
        text = text.rstrip(";") + "."
    elif busiest is not None:
        text += f" The busiest expert server ({busiest.label}) computed {busiest.busy_fraction:.0%} of its lifetime."
    if o.failed_calls:
        text += f" {o.failed_calls} of {o.calls} expert calls failed ({o.failure_rate:.1%})"
        text += (f"; {o.samples_dropped} of {o.samples} samples ({o.dropped_share:.1%}) got no expert's answer."
                 if o.samples_dropped else ".")
    if s.load_imbalance is not None and len(s.experts) > 1:
        text += f" Expert load max/mean {s.load_imbalance:.2f}."
    return MoEVerdict(label, shares, f"{label}: {text}")


# ---------------------------------------------------------------------- markdown
def _f(value, spec: str = ".1f", scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(r) + " |" for r in rows)]


def moe_markdown(summaries: list[MoESummary]) -> list[str]:
    """The report's "## Mixture of experts" section (Markdown lines); [] when ``summaries`` is empty."""
    if not summaries:
        return []
    lines = ["", "## Mixture of experts", "",
             "Per trainer: mean ms per step outside warm-up; calls, failures, dropped samples and payload over the "
             "whole run. A call sends one sample to one expert (forward or backward); p95 latency gives each call "
             "its (step, expert) row's mean.", ""]
    head = ["run", "trainer", "steps", "step ms", "trunk ms", "beam search ms", "expert fwd ms", "expert bwd ms",
            "calls", "failed (rate)", "dropped (share)", "latency ms mean / p95 / max", "payload MB"]
    rows = []
    for s in summaries:
        for t in [*s.trainers, s.overall] if len(s.trainers) > 1 else s.trainers:
            payload = (None if t.payload_sent_bytes is None else (t.payload_sent_bytes + (t.payload_received_bytes or 0)))
            rows.append([f"{s.name} ({s.run_id})", "all" if t.worker_index is None else str(t.worker_index),
                         str(t.steps), _f(t.mean_step_s, scale=1e3), _f(t.mean_trunk_s, scale=1e3),
                         _f(t.mean_beam_search_s, scale=1e3), _f(t.mean_expert_forward_s, scale=1e3),
                         _f(t.mean_expert_backward_s, scale=1e3), str(t.calls),
                         "-" if t.failed_calls is None else f"{t.failed_calls} ({t.failure_rate or 0:.1%})",
                         "-" if t.samples_dropped is None else f"{t.samples_dropped} ({t.dropped_share or 0:.1%})",
                         f"{_f(t.mean_call_latency_s, scale=1e3)} / {_f(t.p95_call_latency_s, scale=1e3)} / "
                         f"{_f(t.max_call_latency_s, scale=1e3)}", _f(payload, ".2f", 1e-6)])
    lines += _table(head, rows)
    lines += ["", "### Experts", "", "Forward calls = samples routed to the expert; share = of all calls, both "
              "directions.", ""]
    rows = []
    for s in summaries:
        for e in s.experts:
            rows.append([f"{s.name} ({s.run_id})", e.expert, str(e.forward_calls), str(e.backward_calls), str(e.failed),
                         f"{e.share:.1%}", _f(e.mean_latency_s, scale=1e3), ", ".join(e.servers) or "in-process"])
    lines += _table(["run", "expert", "forward calls", "backward calls", "failed", "share", "mean latency ms",
                     "server"], rows)
    balance = [f"{s.name} ({s.run_id}) {s.load_imbalance:.2f}" for s in summaries if s.load_imbalance is not None]
    if balance:
        lines += ["", "Load balance, max / mean forward calls per expert: " + "; ".join(balance) + "."]
    served = [s for s in summaries if s.servers]
    if served:
        lines += ["", "### Expert servers", "",
                  "One row per server process (a restart is a new generation). Queue wait: the oldest sampled "
                  "(1 in 8) request's wait when its batch was taken; busy = compute seconds / lifetime.", ""]
        rows = []
        for s in served:
            for x in s.servers:
                rows.append([f"{s.name} ({s.run_id})", x.label, x.status, f"{_f(x.started_at_s)} - {_f(x.ended_at_s)}",
                             str(x.calls), str(x.failed), f"{x.payload_bytes / 1e6:.2f}", str(x.batches),
                             _f(x.mean_batch_size),
                             f"{_f(x.mean_queue_wait_s, scale=1e3)} / {_f(x.p95_queue_wait_s, scale=1e3)}",
                             _f(x.compute_s, ".2f"), _f(x.busy_fraction, ".0%"), _f(x.cpu_s),
                             _f(x.peak_pss_bytes, ".0f", 1e-6), (x.reason or "").replace("|", "/")[:80]])
        lines += _table(["run", "server", "status", "alive s", "calls", "failed", "payload MB", "batches", "mean batch",
                         "queue ms mean / p95", "compute s", "busy", "CPU s", "peak PSS MB", "reason"], rows)
    faulted = [s for s in summaries if s.faults]
    if faulted:
        lines += ["", "### Server faults", "",
                  "Before: since the previous service event; after: until the next one. Accuracy: the trainers' "
                  "last held-out evaluation before and first after (mean over trainers).", ""]
        rows = []
        for s in faulted:
            for f in s.faults:
                rows.append([f"{s.name} ({s.run_id})", f.event.label, _f(f.event.at_s),
                             f"{_f(f.samples_per_s_before)} -> {_f(f.samples_per_s_after)}",
                             _f(f.lowest_window_samples_per_s_after),
                             f"{_f(f.dropped_share_before, '.1%')} -> {_f(f.dropped_share_after, '.1%')}",
                             "-" if f.failed_calls_after is None else str(f.failed_calls_after),
                             f"{_f(f.accuracy_before, '.3f')} -> {_f(f.accuracy_after, '.3f')}"])
        lines += _table(["run", "event", "at s", "samples/s before -> after", f"lowest {summaries[0].window_s:g}-s "
                         "window after", "dropped before -> after", "failed calls after", "accuracy before -> after"],
                        rows)
    lines += ["", "### Mixture-of-experts verdicts", ""]
    for s in summaries:
        lines.append(f"- **{s.name}** ({s.run_id}): " + (s.verdict.explanation if s.verdict else "no timed step"))
        lines += [f"  - {n}" for n in s.notes]
    return lines


# ---------------------------------------------------------------------- plots
def _colors(labels: list[str]) -> dict[str, Any]:
    import matplotlib.pyplot as plt

    cmap = plt.get_cmap("tab10")
    return {label: cmap(i % 10) for i, label in enumerate(labels)}


def plot_expert_load(summaries: list[MoESummary], path: Path) -> None:
    """Bars: calls per expert (both directions) coloured by the server that hosts it, failures stacked on top."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(summaries), 1, figsize=(7, 2.8 * len(summaries)), squeeze=False)
    for ax, s in zip(axes[:, 0], summaries):
        hosts = [e.servers[0] if e.servers else "in-process" for e in s.experts]
        colors = _colors(list(dict.fromkeys(hosts)))
        xs = range(len(s.experts))
        ok = [e.forward_calls + e.backward_calls - e.failed for e in s.experts]
        for host in colors:
            idx = [i for i in xs if hosts[i] == host]
            ax.bar(idx, [ok[i] for i in idx], color=colors[host], label=host)
        fails = [e.failed for e in s.experts]
        if any(fails):
            ax.bar(list(xs), fails, bottom=ok, color="none", edgecolor="red", hatch="//", label="failed")
        ax.set_xticks(list(xs), [e.expert for e in s.experts] if len(s.experts) <= 40 else [""] * len(s.experts),
                      fontsize=7, rotation=45 if len(s.experts) > 8 else 0)
        ax.set_ylabel("calls (count)")
        ax.set_xlabel("expert")
        imbalance = f", max/mean {s.load_imbalance:.2f}" if s.load_imbalance is not None else ""
        ax.set_title(f"Calls per expert: {s.name} ({s.run_id}){imbalance}", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_servers(summaries: list[MoESummary], path: Path) -> None:
    """Per server process: batches, mean batch size and queue wait (mean, p95)."""
    import matplotlib.pyplot as plt

    bars = [(f"{s.name}\ns{x.service_index}" + (f".{x.generation}" if x.generation else ""), x)
            for s in summaries for x in s.servers]
    fig, axes = plt.subplots(1, 3, figsize=(max(8.0, 0.6 * len(bars) * 3 + 2), 3.4))
    xs = list(range(len(bars)))
    names = [b[0] for b in bars]
    axes[0].bar(xs, [b[1].batches for b in bars], color="tab:blue")
    axes[0].set_ylabel("batches (count)")
    axes[0].set_title("Batches processed", fontsize=9)
    axes[1].bar(xs, [b[1].mean_batch_size or 0.0 for b in bars], color="tab:green")
    axes[1].set_ylabel("mean batch size (samples)")
    axes[1].set_title("Mean batch size", fontsize=9)
    axes[2].bar([x - 0.2 for x in xs], [(b[1].mean_queue_wait_s or 0.0) * 1e3 for b in bars], width=0.4, label="mean")
    axes[2].bar([x + 0.2 for x in xs], [(b[1].p95_queue_wait_s or 0.0) * 1e3 for b in bars], width=0.4, label="p95")
    axes[2].set_ylabel("queue wait (ms)")
    axes[2].set_title("Queue wait per batch", fontsize=9)
    axes[2].legend(fontsize=7)
    for ax in axes:
        ax.set_xticks(xs, names, fontsize=7)
        ax.set_xlabel("server process")
    fig.suptitle("Expert servers (s<index>.<generation> per run: " +
                 ", ".join(f"{s.name} = {s.run_id}" for s in summaries) + ")", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_timeline(summaries: list[MoESummary], path: Path) -> None:
    """Samples/s per trainer over time, with the services' events as labelled vertical lines."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(summaries), 1, figsize=(7, 2.8 * len(summaries)), squeeze=False)
    event_colors = {"started": "tab:green", "killed": "tab:red", "died": "black"}
    for ax, s in zip(axes[:, 0], summaries):
        for tl in s.timeline:
            ax.plot([p[0] for p in tl.points], [p[1] for p in tl.points], marker=".", linewidth=1,
                    label=f"trainer {tl.worker_index}")
        top = max((p[1] for tl in s.timeline for p in tl.points), default=1.0) or 1.0
        for ev in s.events:
            ax.axvline(ev.at_s, color=event_colors.get(ev.what, "grey"), linestyle="--", linewidth=0.8)
            ax.text(ev.at_s, top, f" {ev.label}", rotation=90, fontsize=6, va="top", ha="right",
                    color=event_colors.get(ev.what, "grey"))
        ax.set_xlabel("seconds since the services started" if s.events else "seconds since the first step")
        ax.set_ylabel(f"samples/s ({s.window_s:g}-s windows)")
        ax.set_title(f"Throughput over time: {s.name} ({s.run_id})", fontsize=9)
        ax.set_ylim(0, top * 1.15)
        if s.timeline:
            ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_moe_plots(summaries: list[MoESummary], out_dir: Path) -> list[str]:
    """Write the mixture-of-experts plots of a report into ``out_dir``; returns their file names.

    ``moe_expert_load.png`` and ``moe_timeline.png`` for every run given; ``moe_servers.png``
    only when a run has expert-server processes. Nothing (``[]``) when ``summaries`` is empty.
    """
    if not summaries:
        return []
    names = ["moe_expert_load.png"]
    plot_expert_load(summaries, out_dir / names[0])
    served = [s for s in summaries if s.servers]
    if served:
        names.append("moe_servers.png")
        plot_servers(served, out_dir / "moe_servers.png")
    timed = [s for s in summaries if s.timeline]
    if timed:
        names.append("moe_timeline.png")
        plot_timeline(timed, out_dir / "moe_timeline.png")
    return names
