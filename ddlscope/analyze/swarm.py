"""A swarm run peer by peer: what each peer contributed, and how the swarm changed under churn.

For a ``collaborative`` run this module reads the steps, evaluations and events of every peer and
gives:

- **per peer** (:class:`PeerFigures`): samples contributed and their share of the swarm's, the
  averaging rounds it took part in and those of them that failed (hivemind then stepped with the
  peer's own gradients or kept its own parameters), the seconds it spent in them (its waits:
  matchmaking and the all-reduce), the bytes it sent (its processes' TCP payload,
  :mod:`ddlscope.measure.host`; each process of a peer that rejoined counted to its end) and
  their share of all peers' bytes, its
  joins, leaves and kills, the samples lost when it was killed, and how long loading the swarm's
  state took when it (re)joined (hivemind's ``load_state_from_peers``), and how many of those loads
  were *futile* (its epoch did not advance: the swarm's progress record named a global epoch that
  no live peer could give it — hivemind keeps a departed peer's progress for its
  ``metadata_expiration``, ``collaborative.progress_expiration_s``, 60 s by default, so a peer
  killed just after it moved on to a new epoch leaves the others loading state at every step
  until the record expires) or cut short by the peer's leave, and the samples *discarded*: those
  of the steps in which hivemind loaded the swarm's state, whose gradients it dropped instead of
  accumulating (``steps.samples_discarded``; "-" for a run from before they were counted);
- **the swarm's size over time** (:func:`swarm_size_timeline`): peers training at each moment,
  measured from the steps themselves — a peer trains from its first step to its last within one
  *segment*; segments end where the peer left or was killed (``peer_leave``/``peer_kill``
  events, :mod:`ddlscope.launch.churn`) or where it stored no step for :func:`gap_s` seconds;
- **the swarm's global epochs** (:func:`global_epochs`): each whole epoch's samples and seconds,
  and how far the peers ran past the target batch size. A peer learns of the swarm's progress from
  hivemind's ``ProgressTracker`` only between its steps, and a step in flight when the target is
  reached still counts, so an epoch holds more samples than the target (issue 14 measured 0.15-0.58
  steps per peer beyond it, 2 one-core peers, 2 steps each per epoch): the batch the optimizer
  steps with is larger than the one asked for;
- **where hivemind's own work lands** (:attr:`PeerFigures.background_cpu_training_s` and
  ``background_cpu_rounds_s``): the CPU seconds of hivemind's processes and threads in the steps
  that only trained and in the steps that ended a global epoch (their averaging round's wait). On a
  peer whose cores training keeps busy, the first slows forward and backward by about as much;
  the second is spent while the peer waits anyway. Issue 14's emulated links (2 one-core peers,
  MobileNetV2): a post-round step holding 0.7-1.0 CPU-s of it took 1.5-1.8 s where one holding
  0.15 took 0.8 s, and the slower the link, the more of it moved into the rounds' wait;
- **partial rounds** (:func:`partial_rounds`): rounds in which hivemind dropped a peer from a part
  of the tensors because its next chunk did not arrive within ``next_chunk_timeout`` and averaged
  that part without it, or a peer got back only part of the averaged tensors. hivemind logs such a
  round as averaged with every peer, and says otherwise only in its averagers' warnings
  (:class:`ddlscope.strategies.collaborative.AveragerLog`, stored as ``partial_average``
  events). hivemind's default ``next_chunk_timeout`` is the matchmaking time;
- **join timeouts** (:func:`join_timeouts`): rounds that began ``request_timeout`` (3 s) late because
  the peer's request to a potential leader went unanswered, hivemind's way out of two peers asking
  each other to lead (a DEBUG message of its averagers, caught by the same handler, stored as
  ``join_timeout`` events). On 50 Mbit/s links (2 one-core peers, MobileNetV2, issue 14) 9 of 128
  global epochs ran 3 s (one 6 s) long so, none of 54 at 200 Mbit/s (docs/validation.md, stop 68);
- **when gradient rounds were pre-scheduled** (:func:`gradient_prescheduling`): rounds whose
  matchmaking hivemind started before the epoch's last step against those it did not, and what
  each kind waited;
- **parameter rounds** (:func:`state_rounds`): how long each background parameter round took from
  its epoch's transition to its end, and how many epochs skipped theirs because the previous one
  still ran (hivemind 1.1.12 averages state only when no such round is in progress), from the
  ``state_round`` / ``state_round_skipped`` events of
  :class:`ddlscope.strategies.collaborative.CollaborativeStrategy`;
- a figure (:func:`plot_swarm`) of the swarm's size with each peer's held-out accuracy on the same
  time axis (seconds since the swarm's first step, the clock of ``collaborative.churn``), and the
  churn events marked.

**Samples lost** with a killed peer are the samples of its steps after its last averaging round
and before the kill: hivemind counted them toward the target batch size (the swarm's progress),
but the gradients (or, with ``use_local_updates``, the local updates) they produced died with the
process before any averaging carried them to the others.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddlscope.analyze.epoch_rule import EpochRuleCheck, check_epoch_rule
from ddlscope.modeling.progress import METADATA_EXPIRATION_S

GAP_FLOOR_S = 5.0
"""Shortest pause, seconds, that splits a peer's steps into two training segments."""
GAP_STEPS = 10
"""...or this many median step times, if longer (an averaging round may pause a peer for a while)."""
CHURN_KINDS = ("peer_join", "peer_rejoin", "peer_leave", "peer_kill")


@dataclass
class PeerFigures:
    """One peer of a swarm run (see the module docstring for what each figure means)."""

    peer: int
    cores: int | None  # CPU cores it was pinned to (peer_vcpus); None when not recorded
    samples: int  # 0 for an auxiliary peer: it averages, it does not train
    samples_share: float
    averaging_rounds: int
    averaging_s: float
    sent_bytes: int | None
    traffic_share: float | None
    joins: int = 0
    leaves: int = 0
    kills: int = 0
    samples_lost: int = 0
    state_load_s: list[float] = field(default_factory=list)
    futile_state_loads: int = 0
    #: state loads the peer's leave cut short, with their seconds (not in ``state_load_s``): a peer asked to leave
    #: has no use for the swarm's state (:class:`ddlscope.strategies.collaborative.LeaveRequest`)
    abandoned_state_load_s: list[float] = field(default_factory=list)
    #: samples of its steps that hivemind computed and dropped: the peer was out of sync and loaded the swarm's
    #: state instead of accumulating them; None for a run from before they were counted
    samples_discarded: int | None = 0
    background_cpu_training_s: float | None = None  # hivemind's CPU-s in its steps without a round; None: unmeasured
    background_cpu_rounds_s: float | None = None  # ... in its steps that ended a global epoch (the round's wait)
    #: rounds in which the peer averaged only part of the tensors (:func:`partial_rounds`), per round kind
    #: ("gradients" / "parameters"); None where they were not counted (a run from before they were)
    partial_rounds: dict[str, int] | None = None
    #: rounds in which a join request of the peer's timed out (:func:`join_timeouts`), per round kind; None where
    #: they were not counted
    join_timeouts: dict[str, int] | None = None
    #: seconds its averagers waited on those requests (hivemind's ``request_timeout`` each)
    join_timeout_s: float = 0.0
    #: the parameter rounds hivemind's state averager ran in the background, seconds each from the epoch's
    #: transition to the round's end (``state_round`` events); None for a run from before they were timed
    state_round_s: list[float] | None = None
    #: epochs whose parameter round hivemind skipped because the previous one still ran (``state_round_skipped``)
    state_rounds_skipped: int = 0
    #: its gradient rounds by when hivemind pre-scheduled their matchmaking (:func:`gradient_prescheduling`):
    #: ``{"early": [averaging_s, ...], "late": [...]}``; None for a run from before it was recorded
    gradient_rounds_by_scheduling: dict[str, list[float]] | None = None
    #: its round steps in which an averaging failed (hivemind logged that averaging gradients or parameters failed;
    #: the peer then stepped with its own gradients, or kept its own parameters), and their seconds in rounds
    failed_rounds: int = 0
    failed_rounds_s: float = 0.0

    def background_cpu_per_round_s(self) -> tuple[float, float] | None:
        """hivemind's CPU seconds per averaging round of this peer: ``(in steps that only trained,
        in the steps that ended an epoch)``; None where unmeasured or the peer took part in no round."""
        if self.background_cpu_training_s is None or self.background_cpu_rounds_s is None or not self.averaging_rounds:
            return None
        return self.background_cpu_training_s / self.averaging_rounds, self.background_cpu_rounds_s / self.averaging_rounds


@dataclass
class GlobalEpochs:
    """The swarm's whole global epochs: those whose start and end a stored step shows (the first,
    which holds the swarm's start-up, and the last, cut by the run's end, are left out).

    Attributes:
        target_batch_size: samples the swarm accumulates per epoch before its averaging round.
        batch_size: samples per step of each peer.
        samples: per whole epoch, the samples of every peer's steps that began in it.
        seconds: per whole epoch, from the first peer's step that entered it to the first that left it.
        trainers: per whole epoch, the peers that stepped in it.
    """

    target_batch_size: int
    batch_size: int
    samples: list[int]
    seconds: list[float]
    trainers: list[int]

    @property
    def overshoot_steps(self) -> float:
        """Mean steps per peer per epoch beyond the target batch size (negative: short of it)."""
        return statistics.fmean((n - self.target_batch_size) / (self.batch_size * k)
                                for n, k in zip(self.samples, self.trainers))


@dataclass
class SwarmAnalysis:
    """The per-peer figures, training segments and swarm size of one run.

    Attributes:
        origin: wall time (Unix seconds) that the ``*_s`` times count from: the swarm's first step.
        segments: per peer, ``(start_s, end_s)`` intervals in which it trained.
        timeline: ``(times_s, sizes)``: the swarm's size from each time on (a step function).
        churn: ``(peer, kind, at_s)`` of every churn event, in time order.
        evals: per peer, ``(at_s, accuracy)`` of its held-out evaluations.
        epochs: the whole global epochs (:func:`global_epochs`); None where the run shows fewer than one.
        epoch_rule: hivemind's epoch-ending rule replayed and simulated on the run's steps
            (:func:`ddlscope.analyze.epoch_rule.check_epoch_rule`); None with churn (its peers
            change) or where the run lacks what the check needs.
        next_chunk_timeout_s: the run's hivemind ``next_chunk_timeout`` (its
            ``collaborative.next_chunk_timeout_s``, else the matchmaking time); None where the
            config does not say.
        progress_expiration_s: how long hivemind kept a departed peer's progress record (the run's
            ``collaborative.progress_expiration_s``; hivemind's default, 60 s, for a run from before
            the setting existed).
        held_rounds: failed averaging rounds that waited while another peer downloaded the swarm's
            state (:func:`rounds_held_by_state_loads`), their ``at_s`` counted from ``origin``.
    """

    run_id: str
    origin: float
    peers: list[PeerFigures]
    segments: dict[int, list[tuple[float, float]]]
    timeline: tuple[list[float], list[int]]
    churn: list[tuple[int, str, float]]
    evals: dict[int, list[tuple[float, float]]]
    epochs: GlobalEpochs | None = None
    epoch_rule: EpochRuleCheck | None = None
    next_chunk_timeout_s: float | None = None
    progress_expiration_s: float = METADATA_EXPIRATION_S
    held_rounds: list[dict] = field(default_factory=list)

    @property
    def has_churn(self) -> bool:
        return bool(self.churn)


def gap_s(steps: list[dict]) -> float:
    """Pause between two stored steps of a peer, seconds, that ends a training segment:
    ``max(GAP_FLOOR_S, GAP_STEPS x median step_s)``."""
    durations = [s["step_s"] for s in steps if s.get("step_s")]
    return max(GAP_FLOOR_S, GAP_STEPS * statistics.median(durations)) if durations else GAP_FLOOR_S


def peer_segments(steps: list[dict], ends: list[float]) -> list[tuple[float, float]]:
    """Training intervals of one peer, wall-clock seconds.

    Args:
        steps: the peer's step rows (``wall_time`` = step start, ``step_s``).
        ends: wall times at which the peer left or was killed.

    Returns:
        ``(start, end)`` per segment: from a segment's first step start to its last step's end.
    """
    ordered = sorted(steps, key=lambda s: s["wall_time"])
    limit, segments = gap_s(ordered), []
    start = prev_end = None
    for s in ordered:
        t, end = s["wall_time"], s["wall_time"] + (s.get("step_s") or 0.0)
        split = start is not None and (t - prev_end > limit or any(prev_end <= e <= t for e in ends))
        if start is None or split:
            if start is not None:
                segments.append((start, prev_end))
            start = t
        prev_end = end
    if start is not None:
        segments.append((start, prev_end))
    return segments


def swarm_size_timeline(segments: dict[int, list[tuple[float, float]]]) -> tuple[list[float], list[int]]:
    """The number of peers training from each change on: ``(times, sizes)``, times ascending,
    ``sizes[i]`` holding from ``times[i]`` until ``times[i + 1]`` (0 after the last)."""
    changes: dict[float, int] = {}
    for intervals in segments.values():
        for a, b in intervals:
            changes[a] = changes.get(a, 0) + 1
            changes[b] = changes.get(b, 0) - 1
    times, sizes, size = [], [], 0
    for t in sorted(changes):
        size += changes[t]
        times.append(t)
        sizes.append(size)
    return times, sizes


def counter_total(values: list[int | None]) -> int | None:
    """Total of a cumulative counter sampled in time order across processes that restart it (a
    rejoined peer's new process counts from 0): the sum of each run of non-decreasing values' last
    value. None when no value is known."""
    known = [v for v in values if v is not None]
    if not known:
        return None
    total, prev = 0, known[0]
    for v in known[1:]:
        if v < prev:
            total += prev
        prev = v
    return total + prev


def samples_lost(steps: list[dict], killed_at: float) -> int:
    """Samples of a peer's steps after its last averaging round before ``killed_at`` (wall time):
    counted toward the swarm's target batch size, never averaged (module docstring)."""
    before = sorted((s for s in steps if s["wall_time"] < killed_at), key=lambda s: s["wall_time"])
    last_round = max((i for i, s in enumerate(before) if s.get("averaging_round")), default=-1)
    return sum(int(s["samples"]) for s in before[last_round + 1:])


def global_epochs(steps: list[dict], target_batch_size: int, batch_size: int) -> GlobalEpochs | None:
    """The whole global epochs of a swarm run from its step rows (all peers).

    A step belongs to the global epoch its peer was in when the step began: the ``global_epoch``
    its previous step ended in (a step that ran an averaging round ends in the next epoch). An
    epoch starts where the first peer's step moved into it (``wall_time + step_s``) and ends where
    the first peer moved on, so only epochs entered and left during the run are whole. A step whose
    epoch moved on without a round (its peer loaded the swarm's state, having fallen behind or
    rejoined) counts toward no epoch: hivemind drops such a step's gradients.

    Args:
        steps: step rows with ``worker_index``, ``step``, ``wall_time`` (step start, s),
            ``step_s``, ``samples``, ``global_epoch`` and ``averaging_round``.
        target_batch_size, batch_size: the run's ``collaborative.target_batch_size`` and samples per step.

    Returns:
        the figures, or None where no epoch is whole (or the steps carry no epoch).
    """
    by_peer: dict[int, list[dict]] = {}
    for s in steps:
        if s.get("global_epoch") is not None:
            by_peer.setdefault(int(s["worker_index"]), []).append(s)
    entered: dict[int, float] = {}
    samples: dict[int, int] = {}
    peers: dict[int, set[int]] = {}
    for p, rows in by_peer.items():
        rows.sort(key=lambda r: r["step"])
        for i, r in enumerate(rows):
            after = int(r["global_epoch"])
            before = int(rows[i - 1]["global_epoch"]) if i else after - int(bool(r.get("averaging_round")))
            if after > before and not r.get("averaging_round"):
                continue  # its peer caught up by loading the swarm's state: hivemind dropped the step's gradients
            samples[before] = samples.get(before, 0) + int(r["samples"])
            peers.setdefault(before, set()).add(p)
            if after > before:
                end = float(r["wall_time"]) + float(r.get("step_s") or 0.0)
                entered[after] = min(entered.get(after, end), end)
    whole = sorted(e for e in entered if e + 1 in entered)
    if not whole:
        return None
    return GlobalEpochs(target_batch_size=target_batch_size, batch_size=batch_size,
                        samples=[samples.get(e, 0) for e in whole],
                        seconds=[entered[e + 1] - entered[e] for e in whole],
                        trainers=[len(peers.get(e, ())) or 1 for e in whole])


def stored_global_epochs(run: dict, steps: list[dict]) -> GlobalEpochs | None:
    """:func:`global_epochs` of a stored run (its ``runs`` row and step rows), at the target batch size
    and batch size of its config; None where the config has no target batch size."""
    config = json.loads(run["config_json"] or "{}")
    target = (config.get("collaborative") or {}).get("target_batch_size")
    return global_epochs(steps, int(target), int(config["batch_size"])) if target and config.get("batch_size") else None


def partial_rounds(events: list[dict], peer: int) -> dict[str, int] | None:
    """Partial averaging rounds of ``peer`` from a run's event rows, per round kind.

    A round is one ``(round, epoch)`` of the peer's ``partial_average`` events (a round can warn
    twice: its reducer got part of the inputs, and the peer got back part of the results). None
    where the peer's ``strategy_details`` event does not say they were counted
    (``partial_rounds_counted``).
    """
    return rounds_with(events, peer, "partial_average")


def join_timeouts(events: list[dict], peer: int) -> dict[str, int] | None:
    """Rounds of ``peer`` that lost a join request to hivemind's ``request_timeout``, per round kind, from a
    run's event rows: one ``(round, epoch)`` of its ``join_timeout`` events (:class:`ddlscope.strategies.
    collaborative.AveragerLog`). None where its ``strategy_details`` do not say they were counted
    (``join_timeouts_counted``: runs from before they were)."""
    return rounds_with(events, peer, "join_timeout")


def join_timeout_s(events: list[dict], peer: int) -> float:
    """Seconds ``peer``'s averagers waited on join requests that timed out (the sum of their ``timeout_s``)."""
    return sum(float(json.loads(e["detail_json"] or "{}").get("timeout_s") or 0.0) for e in events
               if e["kind"] == "join_timeout" and e["worker_index"] == peer)


#: the averagers' events a peer counts (:class:`ddlscope.strategies.collaborative.AveragerLog`) -> the key of its
#: ``strategy_details`` that says it counted them
COUNTED_EVENTS = {"partial_average": "partial_rounds_counted", "join_timeout": "join_timeouts_counted"}


def rounds_with(events: list[dict], peer: int, kind: str) -> dict[str, int] | None:
    """Distinct ``(round, epoch)`` of ``peer``'s ``kind`` events (a key of :data:`COUNTED_EVENTS`), counted per
    round kind; None where no ``strategy_details`` event of the peer says it counted them."""
    details = [json.loads(e["detail_json"] or "{}") for e in events
               if e["kind"] == "strategy_details" and e["worker_index"] == peer]
    if not any(d.get(COUNTED_EVENTS[kind]) for d in details):
        return None
    seen: dict[str, set] = {}
    for e in events:
        if e["kind"] == kind and e["worker_index"] == peer:
            d = json.loads(e["detail_json"] or "{}")
            seen.setdefault(d.get("round", "unknown"), set()).add(d.get("epoch"))
    return {k: len(epochs) for k, epochs in sorted(seen.items())}


def state_rounds(events: list[dict], peer: int) -> dict[str, Any]:
    """``peer``'s parameter rounds from a run's event rows, as :class:`PeerFigures` fields:
    ``state_round_s`` (seconds of each ``state_round`` event, in time order; None where the peer has
    none and skipped none: a run from before they were timed, or one without rounds) and
    ``state_rounds_skipped`` (its ``state_round_skipped`` events)."""
    mine = [(e["kind"], json.loads(e["detail_json"] or "{}")) for e in events
            if e["worker_index"] == peer and e["kind"] in ("state_round", "state_round_skipped")]
    seconds = [float(d["seconds"]) for k, d in mine if k == "state_round" and d.get("seconds") is not None]
    skipped = sum(k == "state_round_skipped" for k, _ in mine)
    return {"state_round_s": seconds if seconds or skipped else None, "state_rounds_skipped": skipped}


HELD_SHARE = 0.5
"""Share of a failed round's seconds that another peer's state download must overlap for
:func:`rounds_held_by_state_loads` to count the round as held by it."""


def rounds_held_by_state_loads(steps: list[dict], events: list[dict]) -> list[dict]:
    """The failed averaging rounds of a run that waited while another peer downloaded the swarm's state.

    A peer one epoch or more behind the swarm downloads its state (hivemind's ``load_state_from_peers``)
    instead of averaging. In a CI run of the 2-peer integration test (2026-12-05) peer 0 fell two epochs
    behind at the start; its download took 20.0 s while peer 1's gradient round found no group and failed
    after 20.0 s (its ``averaging_timeout_s``), and the pair trained nothing in between. A round counts
    here when a ``state_loaded`` event of another peer (its ``at`` and ``seconds``: the download's end
    and length) overlaps at least :data:`HELD_SHARE` of the round's seconds. The round is taken to end
    with its step (``wall_time`` + ``step_s``: hivemind averages at the end of the step) and to last its
    ``averaging_s``.

    Args:
        steps: the run's step rows (``worker_index``, ``wall_time``, ``step_s``, ``averaging_round``,
            ``averaging_succeeded``, ``averaging_s``).
        events: the run's event rows (``worker_index``, ``kind``, ``detail_json``).

    Returns:
        ``{"peer", "at" (the round's start, Unix s), "round_s", "loading_peer", "load_s"}`` per held
        round, in time order; a round overlapping several downloads names the longest overlap.
    """
    loads = []
    for e in events:
        if e["kind"] == "state_loaded" and e["worker_index"] is not None:
            d = json.loads(e["detail_json"] or "{}")
            if d.get("seconds") is not None and d.get("at") is not None and not d.get("abandoned_for_leave"):
                loads.append((int(e["worker_index"]), float(d["at"]) - float(d["seconds"]), float(d["at"])))
    held = []
    for s in steps:
        if not s.get("averaging_round") or s.get("averaging_succeeded") != 0 or not s.get("averaging_s"):
            continue
        end = float(s["wall_time"]) + float(s["step_s"])
        begin = end - float(s["averaging_s"])
        overlaps = [(min(end, b) - max(begin, a), peer, b - a) for peer, a, b in loads if peer != int(s["worker_index"])]
        best = max(overlaps, default=None)
        if best is not None and best[0] >= HELD_SHARE * (end - begin):
            held.append(dict(peer=int(s["worker_index"]), at=begin, round_s=end - begin, loading_peer=best[1],
                             load_s=best[2]))
    return sorted(held, key=lambda h: h["at"])


def gradient_prescheduling(events: list[dict], steps: list[dict], peer: int) -> dict[str, list[float]] | None:
    """``peer``'s gradient rounds split by when hivemind started their matchmaking, each as the
    seconds its round step waited (``averaging_s``): ``"early"``, pre-scheduled in a step before
    the one that ended the epoch (the group can be ready when the epoch ends), or ``"late"``, not
    before that step (the group forms a matchmaking time after the epoch's end). hivemind 1.1.12
    pre-schedules only between steps, once the epoch's estimated end is within the matchmaking
    time (``Optimizer._maybe_schedule_gradient_averaging``), so with few steps per epoch whether a
    round is early is nearly a coin toss. From the peer's ``round_prescheduled`` events
    (:class:`ddlscope.strategies.collaborative.CollaborativeStrategy`) and its non-warm-up round
    steps (a round step's ``global_epoch`` is the epoch it moved to, so it ended the one before);
    None where the peer stored none (a run from before they were recorded, or without rounds)."""
    early: dict[int, bool] = {}
    for e in events:
        if e["kind"] == "round_prescheduled" and e["worker_index"] == peer:
            d = json.loads(e["detail_json"] or "{}")
            if d.get("round") == "gradients" and d.get("epoch") is not None:
                early[int(d["epoch"])] = early.get(int(d["epoch"]), False) or not d.get("in_last_step")
    if not early:
        return None
    split: dict[str, list[float]] = {"early": [], "late": []}
    for s in steps:
        if s.get("averaging_round") and not s.get("warmup") and s.get("global_epoch") and s.get("averaging_s") is not None:
            split["early" if early.get(int(s["global_epoch"]) - 1) else "late"].append(float(s["averaging_s"]))
    return split


def _known_sum(values) -> float | None:
    """The sum of ``values`` (seconds); None when any is None (a step that did not measure it) or there are none."""
    values = list(values)
    return None if not values or any(v is None for v in values) else float(sum(values))


def analyze_swarm(store, run_id: str) -> SwarmAnalysis:
    """Per-peer figures, segments and the swarm's size for run ``run_id`` of ``store``
    (:class:`~ddlscope.store.db.ResultsStore`).

    Raises:
        ValueError: no such run.
    """
    run = store.run(run_id)
    if run is None:
        raise ValueError(f"no run {run_id!r} in {store.path}")
    steps = store.rows("steps", run_id)
    origin = min((float(s["wall_time"]) for s in steps), default=float(run["created_at"]))
    events = store.rows("events", run_id)
    by_peer: dict[int, list[dict]] = {}
    for s in steps:
        by_peer.setdefault(int(s["worker_index"]), []).append(s)
    churn = [(int(e["worker_index"]), e["kind"], float(e["wall_time"])) for e in events if e["kind"] in CHURN_KINDS]
    segments = {p: peer_segments(rows, [t for q, k, t in churn if q == p and k in ("peer_leave", "peer_kill")])
                for p, rows in by_peer.items()}
    total = sum(int(s["samples"]) for s in steps) or 1
    host: dict[int, list[int | None]] = {}
    for h in store.rows("host_samples", run_id):
        host.setdefault(int(h["worker_index"]), []).append(h["net_sent_bytes"])
    sent_by_peer = {p: counter_total(values) for p, values in host.items()}
    known = [v for v in sent_by_peer.values() if v is not None]
    total_bytes = sum(known) if known else None
    aux_rounds: dict[int, list[dict]] = {}
    for e in events:
        if e["kind"] == "averaging_round" and json.loads(e["detail_json"] or "{}").get("auxiliary"):
            aux_rounds.setdefault(int(e["worker_index"]), []).append(json.loads(e["detail_json"]))
    pinned = {int(w["worker_index"]): len(w["cores"].split(",")) for w in store.workers(run_id) if w["cores"]}
    figures = []
    for p in sorted(set(by_peer) | set(aux_rounds)):
        rows = by_peer.get(p, [])
        rounds = [s for s in rows if s.get("averaging_round")] or [
            dict(averaging_s=r.get("averaging_s"), averaging_succeeded=r.get("succeeded")) for r in aux_rounds.get(p, [])]
        failed = [s for s in rounds if s.get("averaging_succeeded") is not None and not s["averaging_succeeded"]]
        sent = sent_by_peer.get(p)
        mine = [(k, t) for q, k, t in churn if q == p]
        stored_loads = [json.loads(e["detail_json"] or "{}") for e in events
                        if e["kind"] == "state_loaded" and e["worker_index"] == p]
        loads = [d for d in stored_loads if not d.get("abandoned_for_leave")]
        figures.append(PeerFigures(
            peer=p, cores=pinned.get(p), samples=sum(int(s["samples"]) for s in rows),
            samples_share=sum(int(s["samples"]) for s in rows) / total, averaging_rounds=len(rounds),
            averaging_s=sum(s.get("averaging_s") or 0.0 for s in rounds),
            failed_rounds=len(failed), failed_rounds_s=sum(s.get("averaging_s") or 0.0 for s in failed),
            sent_bytes=sent, traffic_share=sent / total_bytes if sent is not None and total_bytes else None,
            joins=sum(k in ("peer_join", "peer_rejoin") for k, _ in mine), leaves=sum(k == "peer_leave" for k, _ in mine),
            kills=sum(k == "peer_kill" for k, _ in mine),
            samples_lost=sum(samples_lost(rows, t) for k, t in mine if k == "peer_kill"),
            samples_discarded=None if any(s.get("samples_discarded") is None for s in rows)
            else sum(int(s["samples_discarded"]) for s in rows),
            state_load_s=[d["seconds"] for d in loads if d.get("seconds") is not None],
            abandoned_state_load_s=[d["seconds"] for d in stored_loads if d.get("abandoned_for_leave")],
            futile_state_loads=sum(1 for d in loads if d.get("epoch_after") is not None
                                   and d.get("epoch_before") is not None and d["epoch_after"] <= d["epoch_before"]),
            background_cpu_training_s=_known_sum(s.get("background_cpu_s") for s in rows if not s.get("averaging_round")),
            background_cpu_rounds_s=_known_sum(s.get("background_cpu_s") for s in rows if s.get("averaging_round")),
            partial_rounds=partial_rounds(events, p), **state_rounds(events, p),
            join_timeouts=join_timeouts(events, p), join_timeout_s=join_timeout_s(events, p),
            gradient_rounds_by_scheduling=gradient_prescheduling(events, rows, p)))
    times, sizes = swarm_size_timeline(segments)
    epochs = stored_global_epochs(run, steps)
    rule = check_epoch_rule(steps, epochs.target_batch_size, epochs.batch_size) if epochs and not churn else None
    evals: dict[int, list[tuple[float, float]]] = {}
    for e in store.rows("evals", run_id):
        evals.setdefault(int(e["worker_index"]), []).append((float(e["wall_time"]) - origin, float(e["accuracy"])))
    swarm = json.loads(run["config_json"] or "{}").get("collaborative") or {}
    chunk_s = swarm.get("next_chunk_timeout_s") or swarm.get("matchmaking_time_s")
    return SwarmAnalysis(
        run_id=run_id, origin=origin, peers=figures, next_chunk_timeout_s=float(chunk_s) if chunk_s else None,
        progress_expiration_s=float(swarm.get("progress_expiration_s") or METADATA_EXPIRATION_S),
        segments={p: [(a - origin, b - origin) for a, b in seg] for p, seg in segments.items()},
        timeline=([t - origin for t in times], sizes), churn=[(p, k, t - origin) for p, k, t in churn], evals=evals,
        epochs=epochs, epoch_rule=rule,
        held_rounds=[dict(h, at=h["at"] - origin) for h in rounds_held_by_state_loads(steps, events)])


def swarm_markdown(a: SwarmAnalysis, figure: str | None = None) -> str:
    """A Markdown section: the per-peer table, the churn events and the figure (``figure``: its file name)."""
    lines = [f"### Run `{a.run_id}`", "",
             "| peer | cores | samples | share | averaging rounds | partial rounds | join timeouts | in rounds s | "
             "sent MB | traffic share | joins / leaves / kills | samples lost | samples discarded | "
             "state loads (futile) | state load s, median |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in a.peers:
        partial = "-" if p.partial_rounds is None else str(sum(p.partial_rounds.values()))
        joins = "-" if p.join_timeouts is None else str(sum(p.join_timeouts.values()))
        lines.append(
            f"| {p.peer} | {p.cores if p.cores is not None else '-'} | {p.samples:,} | {p.samples_share:.0%} | "
            f"{p.averaging_rounds}{f' ({p.failed_rounds} failed)' if p.failed_rounds else ''} | {partial} | {joins} | "
            f"{p.averaging_s:.1f} | "
            f"{'unknown' if p.sent_bytes is None else f'{p.sent_bytes / 1e6:.1f}'} | "
            f"{'unknown' if p.traffic_share is None else f'{p.traffic_share:.0%}'} | {p.joins} / {p.leaves} / {p.kills} | "
            f"{p.samples_lost:,} | {'-' if p.samples_discarded is None else f'{p.samples_discarded:,}'} | "
            f"{len(p.state_load_s)} ({p.futile_state_loads}) | "
            f"{f'{statistics.median(p.state_load_s):.2f}' if p.state_load_s else '-'} |")
    if a.epochs is not None:
        e = a.epochs
        lines += ["", f"Global epochs: {len(e.samples)} whole (the first, with the swarm's start-up, and the last "
                  f"left out), {statistics.fmean(e.seconds):.2f} s each on average ({min(e.seconds):.2f}-"
                  f"{max(e.seconds):.2f} s), {statistics.fmean(e.samples):.1f} samples each against a target batch "
                  f"size of {e.target_batch_size:,} ({min(e.samples):,}-{max(e.samples):,}): every peer ran "
                  f"{e.overshoot_steps:.2f} steps past the target per epoch on average. A peer sees the swarm's "
                  "progress only between its steps, and a step in flight when the target is reached still counts: "
                  "the optimizer steps with that larger batch."]
    if a.epoch_rule is not None:
        r = a.epoch_rule
        by_position = ", ".join(f"{name} {t:.2f} s" for name, t in zip(("first after the round", "second", "later"),
                                                                      r.step_s_by_position) if t is not None)
        lines += ["", f"Why: hivemind's epoch-ending rule (`ddlscope.modeling.progress`), replayed on these steps, "
                  f"gives what the peer did at {r.agreed} of {r.decisions} step ends. On this run's step times "
                  f"by position in the epoch ({by_position}, from the round's end or the previous step to the "
                  f"report), its epochs drawn whole, each with the lag it had (the round ended a median "
                  f"{r.round_end_lag_s:.2f} s later for the peer with the shortest first step after it), the rule runs "
                  f"{r.simulated_overshoot_steps:.2f} steps past the target per peer. A peer "
                  "that ends its share before the tracker's estimated end starts another step: the shorter the "
                  "last step of a share against the peer's average, the larger the overshoot."]
    split = [(p.peer, cpu) for p in a.peers if (cpu := p.background_cpu_per_round_s()) is not None]
    if split:
        lines += ["", "hivemind's own CPU per averaging round (its processes and threads: DHT, p2pd, averagers, "
                  "progress tracker), in the steps that only trained / in the step that ended the epoch: "
                  + ", ".join(f"peer {peer} {t:.2f} / {r:.2f} CPU-s" for peer, (t, r) in split)
                  + ". On a peer whose cores training keeps busy, the first slows forward and backward by about as "
                  "much; the second runs while the peer waits for its round."]
    timed = [p for p in a.peers if p.state_round_s is not None]
    if timed:
        lines += ["", "Parameter rounds (hivemind averages the parameters in the background after each epoch's "
                  "transition, from there to the round's end, its matchmaking included): " + "; ".join(
                      f"peer {p.peer} {len(p.state_round_s)} rounds"
                      + (f", median {statistics.median(p.state_round_s):.2f} s ({min(p.state_round_s):.2f}-"
                         f"{max(p.state_round_s):.2f} s)" if p.state_round_s else "")
                      + (f", {p.state_rounds_skipped} epochs skipped theirs" if p.state_rounds_skipped else "")
                      for p in timed)
                  + (". An epoch skips its parameter round when the previous one still runs at its transition "
                     "(hivemind averages state only when none is in progress): over a slow link the round can "
                     "outlast an epoch." if any(p.state_rounds_skipped for p in timed) else ".")]
    scheduling = [(p.peer, p.gradient_rounds_by_scheduling) for p in a.peers if p.gradient_rounds_by_scheduling]
    if any(g["early"] or g["late"] for _, g in scheduling):
        def waits(rounds: list[float]) -> str:
            return f"{len(rounds)}" + (f" (wait {statistics.median(rounds):.2f} s median)" if rounds else "")
        lines += ["", "Gradient rounds pre-scheduled before the epoch's last step / not: " + "; ".join(
            f"peer {peer} {waits(g['early'])} / {waits(g['late'])}" for peer, g in scheduling)
            + ". hivemind starts a round's matchmaking only between steps, once the epoch's estimated end is "
            "within the matchmaking time; a round not pre-scheduled by then forms its group a matchmaking time "
            "after the epoch's end."]
    failing = [p for p in a.peers if p.failed_rounds]
    if failing:
        lines += ["", "Failed rounds: " + "; ".join(
            f"peer {p.peer} {p.failed_rounds} of {p.averaging_rounds}, {p.failed_rounds_s:.2f} s in them" for p in failing)
            + " (steps whose hivemind log said that averaging gradients or parameters failed). After a failed "
            "gradient round hivemind steps with the peer's own accumulated gradients (Optimizer."
            "_load_local_gradients_into_optimizer); after a failed parameter round the peer keeps its own parameters. "
            "Either way the round's time is spent and the peers' parameters differ until a later round averages "
            "them. A round that fails fast costs less time than one that succeeds; one that a dead peer holds up "
            "lasts until averaging_timeout_s."]
        if a.held_rounds:
            lines[-1] += (" Held while another peer downloaded the swarm's state: " + "; ".join(
                f"peer {h['peer']}'s round at {h['at']:.1f} s ({h['round_s']:.1f} s; peer {h['loading_peer']} "
                f"loading for {h['load_s']:.1f} s)" for h in a.held_rounds)
                + f". A peer an epoch or more behind downloads the state instead of averaging (hivemind's "
                f"load_state_from_peers); a failed round is listed here when such a download overlaps at least "
                f"{HELD_SHARE:.0%} of it.")
    partial = [p for p in a.peers if p.partial_rounds]
    if partial:
        timeout = f"{a.next_chunk_timeout_s:g} s" if a.next_chunk_timeout_s else "its value"
        lines += ["", "Partial rounds: " + "; ".join(
            f"peer {p.peer} " + ", ".join(f"{n} {kind}" for kind, n in p.partial_rounds.items()) for p in partial)
            + f". In each, hivemind dropped a peer from part of the tensors when its next chunk did not arrive "
            f"within next_chunk_timeout ({timeout}) and averaged that part without it, or the peer got back "
            "only part of the averaged tensors (the rest kept its own values); hivemind logs such a round as "
            "averaged with every peer. Over a slow link a chunk can wait behind the other round's bytes for "
            "longer than a short matchmaking time (collaborative.next_chunk_timeout_s sets it)."]
    elif any(p.partial_rounds is None for p in a.peers):
        lines += ["", "Partial rounds: not counted for every peer (\"-\": a peer still training, whose count is "
                  "stored at its end, a run from before ddlscope counted them, or averagers that were not forked)."]
    stalled = [p for p in a.peers if p.join_timeouts]
    if stalled:
        lines += ["", "Join timeouts: " + "; ".join(
            f"peer {p.peer} " + ", ".join(f"{n} {kind}" for kind, n in p.join_timeouts.items())
            + f" ({p.join_timeout_s:.1f} s)" for p in stalled)
            + ". In each such round the peer asked another to lead its group and heard nothing within hivemind's "
            "request_timeout (3 s by default), then looked again: the round began that much later. hivemind breaks "
            "this way the deadlock of two peers that ask each other to lead at the same moment, as when both "
            "peers' gradient matchmaking starts as a parameter round frees a slow link."]
    futile = [p for p in a.peers if p.futile_state_loads]
    if futile:
        lines += ["", "Futile state loads: " + ", ".join(f"peer {p.peer} {p.futile_state_loads} of "
                                                        f"{len(p.state_load_s)}" for p in futile)
                  + ". A peer loaded the swarm's state without its epoch advancing: the swarm's progress named an "
                  "epoch no live peer had (a departed peer's record, kept by hivemind for "
                  f"{a.progress_expiration_s:g} s: collaborative.progress_expiration_s); those steps "
                  "trained nothing (hivemind drops a step's gradients when it loads state: the samples discarded "
                  "column)."]
    cut = [p for p in a.peers if p.abandoned_state_load_s]
    if cut:
        lines += ["", "State loads cut short by a leave (not in the state-load columns): " + ", ".join(
            f"peer {p.peer} {len(p.abandoned_state_load_s)}, after {max(p.abandoned_state_load_s):.1f} s"
            for p in cut) + ". A peer asked to leave has no use for the swarm's state: the leave ends the download "
            "where it waits instead of after collaborative.load_state_timeout_s."]
    if a.has_churn:
        sizes = a.timeline[1]
        lines += ["", "Churn: " + "; ".join(f"peer {p} {k[5:]} at {t:.1f} s" for p, k, t in a.churn) + ". "
                  f"Peers training: at most {max(sizes, default=0)}, at least "
                  f"{min((s for s in sizes[:-1]), default=0)} while the run went on."]
    if figure:
        lines += ["", f"![swarm size and accuracy of run {a.run_id}]({figure})"]
    return "\n".join(lines) + "\n"


def plot_swarm(a: SwarmAnalysis, path: Path) -> Path:
    """Swarm size (top) and each peer's held-out accuracy (bottom) over seconds since the run was
    created, churn events as vertical lines; written as PNG to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ddlscope.analyze.plots import DPI

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True, height_ratios=[1, 1.3])
    times, sizes = a.timeline
    if times:
        top.step(times, sizes, where="post", color="tab:blue")
    top.set_ylabel("peers training")
    top.set_title(f"Swarm size and accuracy, run {a.run_id}")
    top.yaxis.get_major_locator().set_params(integer=True)
    for peer, points in sorted(a.evals.items()):
        xs, ys = zip(*sorted(points))
        bottom.plot(xs, ys, marker="o", ms=3, label=f"peer {peer}")
    styles = {"peer_kill": ("tab:red", "--"), "peer_leave": ("tab:orange", ":"),
              "peer_join": ("tab:green", "-."), "peer_rejoin": ("tab:green", "-.")}
    for i, (peer, kind, t) in enumerate(a.churn):
        color, style = styles[kind]
        for ax in (top, bottom):
            ax.axvline(t, color=color, linestyle=style, linewidth=1)
        top.annotate(f"peer {peer} {kind[5:]}", (t, 0), xytext=(3, 3 + 10 * (i % 3)), textcoords="offset points",
                     fontsize=7, color=color)
    bottom.set_xlabel("seconds since the swarm's first step")
    bottom.set_ylabel("held-out accuracy")
    if a.evals:
        bottom.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
