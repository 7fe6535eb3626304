"""When a hivemind swarm ends its global epoch: the progress tracker's rule, as a model.

``hivemind.Optimizer`` (1.1.12) checks after every step of a peer whether its ``ProgressTracker``
is ``ready_to_update_epoch``, and if so the peer leaves training for the epoch's averaging round.
The tracker says so when

1. another peer's record already names the next epoch,
2. the samples it knows of reach the target batch size, or
3. the estimated time of the epoch's end (ETA) has passed.

A peer knows its own samples at once; the others' only from its last *fetch* of the swarm's
records in the DHT. Each record holds a peer's epoch, its samples so far, the time it was written
and the peer's throughput: an exponential moving average (alpha 0.1, bias-corrected) of seconds
per sample between its reports, the averaging rounds left out. A fetch sums the records of the
newest epoch, extrapolates each at its throughput to the fetch's time, and sets the ETA where the
swarm's summed throughput reaches the target; the next fetch follows after
``clip(ETA_s x n / max(n + 3, 1.2 n), 0.5, 10)`` seconds for ``n`` records (hivemind's
``_parse_swarm_progress_data`` with its default refresh periods and expected drift).

So a swarm runs past the target whenever a peer finishes its share before the ETA has passed
and before it has fetched the others' last steps: it starts another step, and those samples
count. With 2 one-core peers of 2 steps each per epoch (issue 14's emulated links), the peer
whose steps after the round were faster (hivemind's parameter round's CPU lands on one of the
two) finishes first, and whether it starts a third step depends on how its step times compare
with the throughputs in the records. :func:`replay_transitions` checks the rule against a stored
run (the decisions it gives at every step end against the ones the peers took);
:func:`simulate_overshoot` runs it on modelled step times to predict the mean overshoot; :class:`EpochDraws`
makes such step times from whole measured epochs.

The model leaves out what does not decide the race on these swarms: matchmaking (every peer that
transitions joins the same round), records expiring (60 s) and client-mode or auxiliary peers.
"""

from __future__ import annotations

import bisect
import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

EPS = 1e-20
"""hivemind's floor on a throughput (samples/s) and its seed for the swarm's summed throughput."""
DHT_LATENCY_S = 0.05
"""Seconds from a progress record's write to other peers' reads of it, taken for hivemind's DHT
between peers on one machine or a LAN. Replays of six runs of issue 14 gave 95.1 % of the peers'
decisions at 0 s and 95.2 % at 0.05 and 0.2 s; on the runs with a 20 Mbit/s link 91 % up to 0.2 s
and 93-95 % at 1 s, where a record seems to wait behind the rounds' bytes (not modelled)."""
METADATA_EXPIRATION_S = 60.0
"""hivemind 1.1.12's ``ProgressTracker`` default ``metadata_expiration``, seconds: how long a peer's
progress record stays in the DHT after its last report (``collaborative.progress_expiration_s``)."""


@dataclass(frozen=True)
class TrackerSettings:
    """The ``ProgressTracker`` parameters the rule uses (hivemind 1.1.12's defaults).

    Attributes:
        target_batch_size: samples per global epoch (>= 1).
        ema_alpha: smoothing of each peer's seconds per sample (``performance_ema_alpha``).
        min_refresh_s, max_refresh_s: bounds of the time between two fetches, seconds.
        default_refresh_s: time to the next fetch while no record is found, seconds.
        drift_peers, drift_rate: peers expected to join between epochs (``expected_drift_*``).
        latency_s: seconds from a record's write to when other peers' fetches can read it.
    """

    target_batch_size: int
    ema_alpha: float = 0.1
    min_refresh_s: float = 0.5
    max_refresh_s: float = 10.0
    default_refresh_s: float = 3.0
    drift_peers: float = 3.0
    drift_rate: float = 0.2
    latency_s: float = 0.0

    def __post_init__(self):
        if self.target_batch_size < 1:
            raise ValueError(f"target_batch_size must be >= 1, got {self.target_batch_size}")
        if not 0 < self.ema_alpha <= 1:
            raise ValueError(f"ema_alpha must be in (0, 1], got {self.ema_alpha}")
        if not 0 < self.min_refresh_s <= self.max_refresh_s:
            raise ValueError(f"need 0 < min_refresh_s <= max_refresh_s, got {self.min_refresh_s}, {self.max_refresh_s}")
        if self.latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {self.latency_s}")


@dataclass(frozen=True)
class _Record:
    visible_s: float
    written_s: float
    epoch: int
    samples: int
    samples_per_s: float


@dataclass
class _Peer:
    timestamp_s: float  # the throughput average's clock: the last report or the last round's end
    epoch: int = 0
    samples: int = 0
    ema_s_per_sample: float = 0.0
    updates: int = 0
    samples_per_s: float = EPS
    records: list[_Record] = field(default_factory=list)
    visible: list[float] = field(default_factory=list)  # the records' visible_s, for bisection
    view_epoch: int = 0
    view_samples: int = 0
    eta_s: float = math.inf
    next_fetch_s: float = -math.inf


@dataclass(frozen=True)
class Decision:
    """What the rule says at one step end of one peer.

    Attributes:
        peer, at_s: the peer and its step's end (its report), seconds.
        ready: the rule's answer: end the epoch now.
        reason: ``"epoch"`` (another peer is in the next epoch), ``"samples"`` (the target is
            known to be reached), ``"eta"`` (the estimate passed) or ``"wait"`` (not ready).
        known_samples: the samples the peer knows of in its epoch, its own included.
        eta_s: the ETA of its last fetch (inf before one), seconds on the same clock.
    """

    peer: int
    at_s: float
    ready: bool
    reason: str
    known_samples: int
    eta_s: float


class ProgressModel:
    """The trackers of a swarm of ``peers`` peers, driven by their step ends and rounds.

    Calls must come in time order across peers (a step end at ``t`` after every event before
    ``t``), so that a fetch sees exactly the records written before it. Times are seconds on any
    one clock; ``start_s`` is when the trackers were made (the throughput average's first clock).

    Raises:
        ValueError: fewer than 1 peer, or an unknown peer index in a call.
    """

    def __init__(self, settings: TrackerSettings, peers: int, start_s: float = 0.0):
        if peers < 1:
            raise ValueError(f"peers must be >= 1, got {peers}")
        self.settings = settings
        self.peers = [_Peer(timestamp_s=start_s) for _ in range(peers)]

    def _peer(self, index: int) -> _Peer:
        if not 0 <= index < len(self.peers):
            raise ValueError(f"peer {index} is not in this swarm of {len(self.peers)} peers")
        return self.peers[index]

    def _write(self, p: _Peer, at_s: float) -> None:
        p.records.append(_Record(at_s + self.settings.latency_s, at_s, p.epoch, p.samples, p.samples_per_s))
        p.visible.append(at_s + self.settings.latency_s)

    def _visible(self, at_s: float) -> list[_Record]:
        out = []
        for q in self.peers:
            i = bisect.bisect_right(q.visible, at_s)
            if i:
                out.append(q.records[i - 1])
        return out

    def _fetch(self, p: _Peer, at_s: float) -> None:
        s = self.settings
        records = self._visible(at_s)
        if not records:
            p.view_epoch, p.view_samples = p.epoch, p.samples
            p.eta_s = at_s + max(0, s.target_batch_size - p.samples) / p.samples_per_s
            p.next_fetch_s = at_s + s.default_refresh_s
            return
        epoch = max([p.epoch] + [r.epoch for r in records])
        current = [r for r in records if r.epoch == epoch]
        estimated = sum(r.samples + max(0.0, at_s - r.written_s) * r.samples_per_s for r in current)
        rate = EPS + sum(r.samples_per_s for r in records)
        to_end_s = max(0.0, s.target_batch_size - estimated) / rate
        n = len(records)
        expected = max(n + s.drift_peers, n * (1 + s.drift_rate))
        p.view_epoch, p.view_samples = epoch, sum(r.samples for r in current)
        p.eta_s = at_s + to_end_s
        p.next_fetch_s = at_s + min(s.max_refresh_s, max(s.min_refresh_s, to_end_s * n / expected))

    def _fetch_until(self, p: _Peer, at_s: float) -> None:
        while p.next_fetch_s <= at_s:
            self._fetch(p, p.next_fetch_s)

    def step_end(self, peer: int, at_s: float, samples: int) -> Decision:
        """Peer ``peer`` finished a step of ``samples`` samples at ``at_s``: its tracker fetches
        what was due before, the peer reports, and the rule decides (:class:`Decision`). The peer
        stays in its epoch until :meth:`round_end`."""
        p = self._peer(peer)
        if p.next_fetch_s == -math.inf:  # the tracker's first fetch runs at its start
            p.next_fetch_s = p.timestamp_s
        self._fetch_until(p, at_s)
        if samples > 0:
            interval = at_s - p.timestamp_s
            p.timestamp_s = at_s
            a = self.settings.ema_alpha
            p.ema_s_per_sample = a * interval / samples + (1 - a) * p.ema_s_per_sample
            p.updates += 1
            p.samples_per_s = 1 / max(p.ema_s_per_sample / (1 - (1 - a) ** p.updates), EPS)
        if p.epoch == p.view_epoch:
            p.view_samples += samples
        p.samples += samples
        self._write(p, at_s)
        if p.view_epoch > p.epoch:
            reason = "epoch"
        elif p.view_samples >= self.settings.target_batch_size:
            reason = "samples"
        elif at_s >= p.eta_s:
            reason = "eta"
        else:
            reason = "wait"
        return Decision(peer, at_s, reason != "wait", reason, p.view_samples, p.eta_s)

    def round_end(self, peer: int, at_s: float) -> None:
        """Peer ``peer`` finished its averaging round at ``at_s``: it moves to the next epoch with
        no samples, restarts its throughput clock, and its tracker (paused during the round)
        fetches at once if a fetch fell due meanwhile."""
        p = self._peer(peer)
        p.epoch += 1
        if p.epoch > p.view_epoch:
            p.view_epoch, p.view_samples, p.eta_s = p.epoch, 0, math.inf
        p.samples = 0
        p.timestamp_s = at_s
        self._write(p, at_s)
        if p.next_fetch_s <= at_s:
            self._fetch(p, at_s)


@dataclass(frozen=True)
class TracedStep:
    """One stored step of a peer, for :func:`replay_transitions`.

    Attributes:
        report_s: when the step's samples were reported (its compute's end), seconds.
        end_s: when the step ended (after its averaging round, if it had one), seconds.
        samples: the step's samples.
        ended_epoch: whether the peer left the epoch after this step (the step held a round).
    """

    report_s: float
    end_s: float
    samples: int
    ended_epoch: bool


def replay_transitions(steps: dict[int, list[TracedStep]], settings: TrackerSettings,
                       start_s: float) -> list[tuple[Decision, bool]]:
    """The rule's decision at every stored step end of a swarm, with the decision the peer took.

    The trackers follow the stored run (a peer moves to the next epoch where it did), so each
    decision is the rule's answer given what happened before; comparing them tests the model on
    the run. Args: ``steps``: per peer index (``0 .. n-1``), its steps in order; ``start_s``: when
    the trackers started (e.g. the swarm's first step's start), on the steps' clock. Returns
    ``(Decision, took)`` pairs in time order.

    Raises:
        ValueError: a peer index outside ``0 .. len(steps)-1``, or a step reported before ``start_s``.
    """
    if sorted(steps) != list(range(len(steps))):
        raise ValueError(f"peers must be numbered 0..{len(steps) - 1}, got {sorted(steps)}")
    if any(s.report_s <= start_s for ss in steps.values() for s in ss):
        raise ValueError(f"every step must be reported after the trackers' start ({start_s} s)")
    model = ProgressModel(settings, len(steps), start_s=start_s)
    events = sorted((s.report_s, peer, i) for peer, ss in steps.items() for i, s in enumerate(ss))
    rounds: list[tuple[float, int]] = []  # (end, peer) of rounds still running
    out = []
    for at, peer, i in events:
        for end, q in sorted(r for r in rounds if r[0] <= at):
            model.round_end(q, end)
            rounds.remove((end, q))
        step = steps[peer][i]
        decision = model.step_end(peer, at, step.samples)
        out.append((decision, step.ended_epoch))
        if step.ended_epoch:
            rounds.append((max(step.end_s, at), peer))
    return out


StepTime = Callable[[int, int, int, random.Random], float]
"""``(peer, epoch, position in the epoch (0: first after the round), rng) -> seconds`` from the
step's start to its report. Epochs count from 0, warm-up epochs included; every peer's first
step of an epoch is asked for before any later step of it."""


def check_whole_epochs(epochs: Sequence[Sequence[Sequence[float]]]) -> None:
    """Check that ``epochs`` (per epoch, per peer, its steps' seconds) have the same number of peers
    (>= 1) in every epoch and at least one step per peer; no epochs pass.

    Raises:
        ValueError: they do not.
    """
    if epochs and (not epochs[0] or any(len(e) != len(epochs[0]) for e in epochs)
                   or any(not steps for e in epochs for steps in e)):
        raise ValueError("every epoch needs the same number of peers (>= 1), each with at least one step")


class EpochDraws:
    """A :data:`StepTime` that draws whole epochs of a swarm: every simulated epoch takes one of
    ``epochs`` at random, and peer ``q`` takes its peer ``q mod n``'s steps there, position by position.

    An epoch's peers are not independent. In issue 14's swarms (2 one-core peers, MobileNetV2/MNIST)
    hivemind's work after a round landed on one peer's first step and left the other's clean (0.9-1.0
    s against 0.65-0.72 s), and which peer took it changed from epoch to epoch. Draws per peer and
    position (the means and spreads of a pattern) lose that; on one loopback run they gave an
    overshoot of 0.12 steps where the run had 0.24, and its own epochs drawn whole 0.20 (2026-12-02).

    Args:
        epochs: per epoch, per peer, seconds of each of its steps in order (``[[[s0, s1], [s0, s1, s2]],
            ...]``); every epoch has the same number of peers (>= 1), each with at least one step.
        base_s: per simulated peer, seconds added to each drawn step (None: 0); with
            ``floor_share``, a step is never shorter than ``floor_share x base_s[q]``.
        lags_s: per epoch, seconds by which the round before it ended later for the peer with the
            shortest first step than for the others (None: 0); :meth:`round_end_lag_s` gives the
            drawn epoch's, for :func:`simulate_overshoot`.

    Positions beyond the drawn peer's steps in its epoch: position 1 from that peer's position 1 in
    any epoch (position 0's where it has none), later ones from every peer's steps at positions 2
    and later (position 1's where there are none). Needs the simulation's order: each epoch's position 0 of
    every peer before its later positions (:func:`simulate_overshoot` asks so).

    Raises:
        ValueError: no epochs, epochs of different peer counts, a peer without steps, or lags not
            one per epoch.
    """

    def __init__(self, epochs: Sequence[Sequence[Sequence[float]]], base_s: Sequence[float] | None = None,
                 floor_share: float = 0.1, lags_s: Sequence[float] | None = None):
        if not epochs:
            raise ValueError("need at least one epoch to draw from")
        check_whole_epochs(epochs)
        n = len(epochs[0])
        if lags_s is not None and len(lags_s) != len(epochs):
            raise ValueError(f"need one lag per epoch: {len(lags_s)} lags for {len(epochs)} epochs")
        self.epochs, self.base_s, self.floor_share, self.lags_s, self.peers = epochs, base_s, floor_share, lags_s, n
        self.second = [[e[q][1] for e in epochs if len(e[q]) > 1] or [e[q][0] for e in epochs] for q in range(n)]
        self.later = [x for e in epochs for steps in e for x in steps[2:]] or [x for pool in self.second for x in pool]
        self.drawn: tuple[int, int] = (-1, 0)  # (simulated epoch, index of the epoch drawn for it)

    def __call__(self, q: int, epoch: int, position: int, rng: random.Random) -> float:
        if self.drawn[0] != epoch:
            self.drawn = (epoch, rng.randrange(len(self.epochs)))
        mine = self.epochs[self.drawn[1]][q % self.peers]
        if position < len(mine):
            seconds = mine[position]
        else:
            seconds = rng.choice(self.second[q % self.peers] if position == 1 else self.later)
        base = self.base_s[q] if self.base_s is not None else 0.0
        return max(self.floor_share * base, base + seconds)

    def round_end_lag_s(self, epoch: int) -> float:
        """The lag of the epoch drawn for simulated epoch ``epoch`` (after its first steps were drawn)."""
        return 0.0 if self.lags_s is None or self.drawn[0] != epoch else float(self.lags_s[self.drawn[1]])


def simulate_overshoot(step_s: StepTime, peers: int, batch_size: int, settings: TrackerSettings,
                       round_s: float = 1.0, epochs: int = 200, warmup_epochs: int = 5,
                       seed: int = 0, round_end_lag_s: float | Callable[[int], float] = 0.0) -> float:
    """Mean steps per peer per global epoch beyond the target batch, under the rule.

    Every peer starts each epoch when the previous round ends, steps with the times ``step_s``
    gives, and after each step asks the rule; a peer that is ready waits in the round, which ends
    ``round_s`` seconds after the last peer joined it. The first ``warmup_epochs`` (throughput
    averages still settling) are left out.

    ``round_end_lag_s``: the round ends this much later for the peer whose first step after it is
    the shortest (the others end it together; a negative lag: earlier), seconds, or a function of
    the epoch giving that epoch's lag (asked after the epoch's first steps, e.g.
    :meth:`EpochDraws.round_end_lag_s`). On emulated links that peer ended the round 0.07-0.24 s
    after the other (median 0.13 s at 50 Mbit/s, 2 peers of MobileNetV2/MNIST, 0.01-0.03 s on
    loopback; 2026-12-02), and a later start brings its share's end closer to the swarm's estimate
    of the epoch's end: it runs past the target less often.

    Args:
        step_s: :data:`StepTime`; peers: trainers (>= 1); batch_size: samples per step (>= 1).
        settings: the trackers'; round_s: seconds of each round (>= 0); epochs: epochs counted (>= 1).
        round_end_lag_s: seconds, or a function of the epoch.

    Returns:
        ``mean((samples - target) / (batch_size x peers))`` over the counted epochs.

    Raises:
        ValueError: a count or duration out of range, or a step time <= 0.
    """
    if peers < 1 or batch_size < 1 or epochs < 1 or warmup_epochs < 0 or round_s < 0:
        raise ValueError("need peers >= 1, batch_size >= 1, epochs >= 1, warmup_epochs >= 0, round_s >= 0")
    rng = random.Random(seed)
    model = ProgressModel(settings, peers, start_s=0.0)
    start = 0.0
    extra = []
    for epoch in range(warmup_epochs + epochs):
        firsts = {q: _checked(step_s(q, epoch, 0, rng)) for q in range(peers)}
        begins = dict.fromkeys(range(peers), start)
        lag = round_end_lag_s(epoch) if callable(round_end_lag_s) else round_end_lag_s
        if peers > 1:  # the peer with the shortest first step starts lag later (the others -lag later if < 0)
            fast = min(firsts, key=firsts.get)
            begins = {q: start + (max(0.0, lag) if q == fast else max(0.0, -lag)) for q in range(peers)}
        if epoch > 0:  # the previous round ends for each peer at its start (in time order)
            for q in sorted(begins, key=begins.get):
                model.round_end(q, begins[q])
        # each training peer's step in flight ends at ends[q]; the earliest is the next event
        ends = {q: begins[q] + firsts[q] for q in range(peers)}
        position = [0] * peers
        joined: list[float | None] = [None] * peers
        samples = 0
        while ends:
            q = min(ends, key=ends.get)
            at = ends.pop(q)
            position[q] += 1
            samples += batch_size
            if model.step_end(q, at, batch_size).ready:
                joined[q] = at
            else:
                ends[q] = at + _checked(step_s(q, epoch, position[q], rng))
        start = max(j for j in joined if j is not None) + round_s
        if epoch >= warmup_epochs:
            extra.append((samples - settings.target_batch_size) / (batch_size * peers))
    return statistics.fmean(extra)


def _checked(seconds: float) -> float:
    if not seconds > 0:
        raise ValueError(f"a step time must be > 0 s, got {seconds}")
    return seconds
