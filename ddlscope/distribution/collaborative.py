"""``collaborative``: peers of a hivemind swarm accumulate a target batch size, then average
(``hivemind.Optimizer``; thesis 000, DeDLOC — Diskin et al. 2021).

Its config table is ``[collaborative]`` (:class:`CollaborativeConfig`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ddlscope.distribution import DistributionModel, register
from ddlscope.errors import UserError
from ddlscope.modeling.cluster import ClusterSpec, HivemindFit
from ddlscope.modeling.collectives import butterfly_allreduce_s, contention, serial_comm
from ddlscope.modeling.memory import MemoryEstimate, hivemind_runtime_bytes, replicas
from ddlscope.modeling.prediction import Prediction, Setting, make_prediction, split_compute
from ddlscope.modeling.profile import WorkloadProfile
from ddlscope.modeling.progress import (
    DHT_LATENCY_S, METADATA_EXPIRATION_S, EpochDraws, TrackerSettings, simulate_overshoot)

if TYPE_CHECKING:
    from ddlscope.network.emulated import NetworkConfig
    from ddlscope.config import RunConfig

DEFAULT_MATCHMAKING_TIME_S = 10.0
"""Thesis 000's fixed matchmaking time: the one default everywhere (runs, predictions, recommendations)."""
DEFAULT_AVERAGING_TIMEOUT_S = 300.0
"""hivemind's ``averaging_timeout`` by default (seconds), thesis 000's."""
DEFAULT_LOAD_STATE_TIMEOUT_S = 120.0
"""Seconds one attempt to download the swarm's state may take before hivemind gives it up and
tries again (``load_state_timeout``, whose own default is 600 s): a ResNet-50's parameters and
momentum, about 200 MB, take 80 s over 20 Mbit/s."""


class ChurnEvent(BaseModel):
    """When one peer of a swarm joins, leaves, dies and comes back (``[[collaborative.churn]]``).

    Times are seconds since the swarm's first training step (start-up, joining the DHT, excluded). ``join_at_s`` starts the
    peer this late (it joins a running swarm and loads the swarm's state: hivemind's
    ``load_state_from_peers``); ``leave_at_s`` asks it to leave cleanly (it ends its step, says
    goodbye to the swarm and exits); ``kill_at_s`` ends its process group with SIGKILL (a crashed or
    disconnected volunteer: what it accumulated since the last averaging round is lost);
    ``rejoin_at_s`` starts a new process for the peer after it left or was killed, which continues
    the peer's step count and sample budget. At most one of ``leave_at_s`` and ``kill_at_s``.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    peer: int = Field(ge=0, le=1023, description="the peer's index, 0..peers-1")
    join_at_s: float = Field(0.0, ge=0, le=86_400, description="start the peer this late (0: with the run)")
    leave_at_s: float | None = Field(None, gt=0, le=86_400, description="the peer leaves the swarm cleanly")
    kill_at_s: float | None = Field(None, gt=0, le=86_400, description="SIGKILL the peer's processes")
    rejoin_at_s: float | None = Field(None, gt=0, le=86_400, description="start the peer again after it left or died")

    @model_validator(mode="after")
    def _in_order(self) -> "ChurnEvent":
        if self.leave_at_s is not None and self.kill_at_s is not None:
            raise ValueError(f"churn of peer {self.peer}: leave_at_s and kill_at_s both given; allowed: one of them")
        gone = self.leave_at_s if self.leave_at_s is not None else self.kill_at_s
        if gone is not None and gone <= self.join_at_s:
            raise ValueError(f"churn of peer {self.peer}: it goes at {gone:g} s, not after it joins at "
                             f"{self.join_at_s:g} s; allowed: leave_at_s or kill_at_s > join_at_s")
        if self.rejoin_at_s is not None and (gone is None or self.rejoin_at_s <= gone):
            raise ValueError(f"churn of peer {self.peer}: rejoin_at_s = {self.rejoin_at_s:g} needs an earlier "
                             f"leave_at_s or kill_at_s; allowed: rejoin_at_s > leave_at_s or kill_at_s")
        return self

    @property
    def gone_at_s(self) -> float | None:
        """When the peer leaves or is killed (None: it stays)."""
        return self.leave_at_s if self.leave_at_s is not None else self.kill_at_s

    @property
    def ends_absent(self) -> bool:
        """The peer leaves or dies and does not come back."""
        return self.gone_at_s is not None and self.rejoin_at_s is None


class RandomChurn(BaseModel):
    """Churn drawn at random, reproducibly (``[collaborative.random_churn]``): ``joins`` peers start
    late, ``leaves`` peers leave and ``kills`` peers are killed, each at a time drawn uniformly from
    ``window_s``; those that leave or are killed rejoin ``rejoin_after_s`` later (never, if it is
    not given). Peers are drawn from those without a ``[[collaborative.churn]]`` table; peer 0
    never joins late (it bootstraps the swarm). The same ``seed`` and peers give the same schedule.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    seed: int = Field(0, ge=0, description="seed of the draw")
    joins: int = Field(0, ge=0, le=1024, description="peers that start late")
    leaves: int = Field(0, ge=0, le=1024, description="peers that leave cleanly")
    kills: int = Field(0, ge=0, le=1024, description="peers that are killed (SIGKILL)")
    window_s: tuple[float, float] = Field((10.0, 60.0), description="[earliest, latest] time of an event, seconds")
    rejoin_after_s: float | None = Field(None, gt=0, le=86_400, description="seconds after leaving or dying that "
                                         "a peer comes back (none: it does not)")

    @model_validator(mode="after")
    def _window(self) -> "RandomChurn":
        a, b = self.window_s
        if not 0 < a <= b <= 86_400:
            raise ValueError(f"random_churn.window_s = [{a:g}, {b:g}]; allowed: 0 < earliest <= latest <= 86400")
        return self

    def events(self, peers: int, taken: set[int]) -> list[ChurnEvent]:
        """The drawn schedule for a swarm of ``peers`` whose peers ``taken`` have schedules already.

        Raises:
            ValueError: more joins + leaves + kills than peers to draw from.
        """
        import random

        rng = random.Random(self.seed)
        free = [p for p in range(peers) if p not in taken]
        late_ok = [p for p in free if p != 0]
        if self.joins > len(late_ok) or self.joins + self.leaves + self.kills > len(free):
            raise ValueError(f"random_churn: {self.joins} joins + {self.leaves} leaves + {self.kills} kills need that "
                             f"many peers without a churn table ({len(free)} here, peer 0 never joins late); allowed: "
                             f"at most {len(free)} in all")
        joiners = rng.sample(late_ok, self.joins)
        rest = rng.sample([p for p in free if p not in joiners], self.leaves + self.kills)
        draw = lambda: round(rng.uniform(*self.window_s), 1)  # noqa: E731
        out = [ChurnEvent(peer=p, join_at_s=draw()) for p in joiners]
        for i, p in enumerate(rest):
            gone = draw()
            back = None if self.rejoin_after_s is None else gone + self.rejoin_after_s
            out.append(ChurnEvent(peer=p, leave_at_s=gone, rejoin_at_s=back) if i < self.leaves else
                       ChurnEvent(peer=p, kill_at_s=gone, rejoin_at_s=back))
        return sorted(out, key=lambda e: e.peer)


class CollaborativeConfig(BaseModel):
    """Settings of ``hivemind.Optimizer`` for the ``collaborative`` distribution model (``[collaborative]``).

    Defaults follow thesis 000 (matchmaking_time 10 s, averaging_timeout 300 s, no gradient
    compression) except where a field says otherwise.
    """

    model_config = ConfigDict(extra="forbid")

    target_batch_size: int = Field(256, ge=1, description="samples all peers accumulate per global epoch (TBS)")
    use_local_updates: bool = Field(False, description="step the local optimizer every batch and average parameters (LU)")
    matchmaking_time_s: float = Field(DEFAULT_MATCHMAKING_TIME_S, gt=0,
                                      description="seconds peers wait to form an averaging group")
    averaging_timeout_s: float = Field(DEFAULT_AVERAGING_TIMEOUT_S, gt=0, description="give up an averaging round after this many seconds")
    next_chunk_timeout_s: float | None = Field(
        None, gt=0, le=3600, description="hivemind's next_chunk_timeout: in a round, a peer whose next chunk of a part "
        "does not arrive within this many seconds is dropped from that part, which is then averaged without it "
        "(a partial round, stored as a partial_average event); default: hivemind's, matchmaking_time_s. On a slow "
        "link a chunk can wait behind the other round's bytes for longer than a short matchmaking time")
    request_timeout_s: float | None = Field(
        None, gt=0, le=3600, description="hivemind's request_timeout: a peer that asks another to lead its averaging "
        "group waits this many seconds for the answer before it looks again. Two peers that ask each other at once "
        "(on stale expiration times, e.g. behind a busy slow link) both wait it out (a join timeout, stored as a "
        "join_timeout event); hivemind recommends it below matchmaking_time_s. Default: hivemind's, 3 s")
    progress_expiration_s: float = Field(
        METADATA_EXPIRATION_S, gt=0, le=3600, description="hivemind's metadata_expiration: how long a peer's progress record (its "
        "epoch and samples) stays in the DHT after its last report; peers report every half of it. A peer killed "
        "just after it moved to a new epoch leaves its record naming that epoch, and the others, behind it, load the "
        "swarm's state at every step, training nothing (samples_discarded), until the record expires. Default: "
        "hivemind's 60 s")
    load_state_timeout_s: float = Field(
        DEFAULT_LOAD_STATE_TIMEOUT_S, gt=0, le=3600, description="hivemind's load_state_timeout: a peer that (re)joins "
        "or falls behind gives up one attempt to download the swarm's state after this many seconds, and hivemind "
        "starts another at once (until one returns). With hivemind's default, 600 s, one hung attempt held a 40 s "
        "churn run for 10 minutes and past a peer's leave time (issue 14, CI); the retry then returned at once. "
        "Raise it for a state that needs longer over its link (parameters and optimizer state, bytes / link rate)")
    gradient_compression: Literal["none", "float16", "scaled-float16", "uniform8bit"] = "none"
    average_state_every: int = Field(1, ge=1, description="average parameters and optimizer state every N global epochs")
    listen_host: str = Field("127.0.0.1", description="address peers listen on; loopback unless you ask")
    nat_traversal: bool = Field(False, description="let p2pd map ports (UPnP/NAT-PMP), run AutoNAT and relay: peers "
                                "behind NATs on public networks; needs a non-loopback listen_host")
    join_timeout_s: float = Field(60.0, gt=0, description="a peer that cannot join the swarm in this time fails")
    initial_peers: list[str] = Field(default_factory=list, description="multiaddrs of a running swarm or bootstrap peer to join")
    target_group_size: int | None = Field(None, ge=2, le=1024, description="Moshpit-style groups: each averaging round "
                                          "averages in groups of at most this many peers, re-formed every round "
                                          "(hivemind's target_group_size); default: all peers in one group")
    initial_group_bits: str = Field("", pattern=r"^[01]{0,32}$", description="hivemind's initial group key bits "
                                    "(Moshpit SGD's grid coordinates), e.g. \"01\"; peers with other bits start apart")
    client_mode_peers: list[int] = Field(default_factory=list, description="peers that accept no incoming "
                                         "connections (behind a firewall): they send and receive, never aggregate")

    auxiliary_peers: list[int] = Field(default_factory=list, description="peers that train on no batch and only "
                                       "help average (hivemind's auxiliary peers: their upload and CPU, e.g. "
                                       "a CPU-only machine beside GPU trainers)")
    declared_bandwidths_mbit_per_s: list[float] | Literal["network"] = Field(
        default_factory=list, description="each peer's bandwidth told to hivemind's averagers (DecentralizedAverager's "
        "bandwidth), so that its load balancing gives slow peers smaller parts of a round (DeDLOC's LP): one value "
        "per peer in Mbit/s, or \"network\" for each peer's emulated link (the smaller of its upload and download; "
        "an unlimited link declares none); default: none declared, equal parts")
    churn: list[ChurnEvent] = Field(default_factory=list, description="peers that join late, leave, are killed and "
                                    "rejoin, at given times ([[collaborative.churn]] tables, one per peer)")

    random_churn: RandomChurn | None = Field(None, description="churn drawn at random with a seed "
                                             "([collaborative.random_churn])")

    def declared_bandwidth_mbit_per_s(self, peer: int, network: "NetworkConfig") -> float | None:
        """What ``peer`` tells hivemind's averagers its bandwidth is, Mbit/s (None: nothing declared;
        see ``declared_bandwidths_mbit_per_s``)."""
        if self.declared_bandwidths_mbit_per_s == "network":
            up, down = network.peer_rate(peer)
            return None if up is None or down is None else min(up, down)
        values = self.declared_bandwidths_mbit_per_s
        return values[peer] if peer < len(values) else None

    def churn_events(self, peers: int) -> list[ChurnEvent]:
        """Every peer's churn schedule in a swarm of ``peers``: the ``churn`` tables, then the drawn ones.

        Raises:
            ValueError: ``random_churn`` asks for more peers than there are without a table.
        """
        drawn = self.random_churn.events(peers, {e.peer for e in self.churn}) if self.random_churn else []
        return [*self.churn, *drawn]

    def churn_of(self, peer: int, peers: int) -> ChurnEvent | None:
        """The churn schedule of ``peer`` in a swarm of ``peers`` (None: with the run from start to end)."""
        return next((c for c in self.churn_events(peers) if c.peer == peer), None)

    def peers_at_start(self, peers: int) -> int:
        """Peers that start with the run (``join_at_s = 0``)."""
        late = {e.peer for e in self.churn_events(peers) if e.join_at_s > 0}
        return peers - len(late)

    def peers_at_end(self, peers: int) -> int:
        """Training peers still in the swarm at the end of their schedules (they say they are done;
        auxiliary peers do not count: they stop once the trainers are done)."""
        gone = {e.peer for e in self.churn_events(peers) if e.ends_absent}
        return sum(1 for p in range(peers) if p not in gone and p not in self.auxiliary_peers)

    @model_validator(mode="after")
    def _nat_traversal_needs_public_host(self) -> "CollaborativeConfig":
        from ddlscope.launch.network import check_nat_traversal

        check_nat_traversal(self.nat_traversal, self.listen_host)
        return self


def check_target_batch(cfg: "RunConfig") -> None:
    """The target batch size holds at least one optimizer step of a peer; client-mode and auxiliary
    peers exist, leave someone to connect to and someone to train; churn schedules are sound.

    Raises:
        ValueError: ``target_batch_size < batch_size x gradient_accumulation_steps``; a client-mode
            or auxiliary peer index >= peers; peer 0 in client mode when it bootstraps the swarm (no
            ``initial_peers``); every peer in client mode, or auxiliary; a peer both; a bad churn
            schedule (:func:`_check_churn`).
    """
    c = cfg.collaborative
    bad = [i for i in c.client_mode_peers if not 0 <= i < cfg.peers]
    if bad:
        raise ValueError(f"collaborative.client_mode_peers: {bad} are not peers; allowed: 0..{cfg.peers - 1}")
    if 0 in c.client_mode_peers and not c.initial_peers:
        raise ValueError("collaborative.client_mode_peers: peer 0 bootstraps the swarm (no initial_peers), so the others "
                         "must connect to it; allowed: peers 1..{}".format(cfg.peers - 1))
    bad = [i for i in c.auxiliary_peers if not 0 <= i < cfg.peers]
    if bad:
        raise ValueError(f"collaborative.auxiliary_peers: {bad} are not peers; allowed: 0..{cfg.peers - 1}")
    both = sorted(set(c.auxiliary_peers) & set(c.client_mode_peers))
    if both:
        raise ValueError(f"collaborative.auxiliary_peers: {both} are also client_mode_peers; allowed: an auxiliary peer "
                         f"accepts connections (hivemind: client-mode peers cannot serve as auxiliaries)")
    if len(set(c.auxiliary_peers)) >= cfg.peers:
        raise ValueError("collaborative.auxiliary_peers: every peer auxiliary leaves no one to train; allowed: at most "
                         "peers - 1 of them")
    if len(set(c.client_mode_peers)) >= cfg.peers:
        raise ValueError("collaborative.client_mode_peers: every peer in client mode leaves no one to aggregate; "
                         "allowed: at most peers - 1 of them")
    _check_churn(cfg)
    declared = c.declared_bandwidths_mbit_per_s
    if declared == "network" and not cfg.network.emulate:
        raise ValueError('collaborative.declared_bandwidths_mbit_per_s = "network" needs network.emulate = true; '
                         "allowed on real hosts: one value per peer in Mbit/s")
    if declared != "network" and declared and (len(declared) != cfg.peers or not all(0 < b <= 400_000 for b in declared)):
        raise ValueError(f"collaborative.declared_bandwidths_mbit_per_s = {declared}: allowed: one value per peer "
                         f"({cfg.peers}), each > 0 and <= 400000 Mbit/s, or \"network\"")
    per_step = cfg.batch_size * cfg.gradient_accumulation_steps
    if cfg.collaborative.target_batch_size < per_step:
        raise ValueError(
            f"collaborative.target_batch_size = {cfg.collaborative.target_batch_size} is below one optimizer "
            f"step of a peer (batch_size x gradient_accumulation_steps = {per_step}); allowed: >= {per_step}")


def _check_churn(cfg: "RunConfig") -> None:
    """Churn schedules name peers of the run, once each, and leave someone to start the swarm.

    Raises:
        ValueError: a peer index >= peers, a peer with two schedules, a late peer 0 when it
            bootstraps the swarm (no ``initial_peers``), a run with fewer than 2 peers, or an event
            at or after the end of a run that only a time limit ends.
    """
    c = cfg.collaborative
    if not c.churn and c.random_churn is None:
        return
    if cfg.peers < 2:
        raise ValueError(f"collaborative.churn needs a swarm; peers = {cfg.peers}, allowed: peers >= 2")
    bad = sorted({e.peer for e in c.churn if e.peer >= cfg.peers})
    if bad:
        raise ValueError(f"collaborative.churn: peers {bad} are not in the run; allowed: 0..{cfg.peers - 1}")
    seen = [e.peer for e in c.churn]
    twice = sorted({p for p in seen if seen.count(p) > 1})
    if twice:
        raise ValueError(f"collaborative.churn: peers {twice} have more than one schedule; allowed: one "
                         f"[[collaborative.churn]] table per peer")
    events = c.churn_events(cfg.peers)  # a draw that asks for more peers than there are raises here
    if cfg.time_limit_s is not None and cfg.sample_budget is None and cfg.target_accuracy is None:
        late = [(e.peer, name, t) for e in events for name, t in (("join_at_s", e.join_at_s), ("leave_at_s", e.leave_at_s),
                ("kill_at_s", e.kill_at_s), ("rejoin_at_s", e.rejoin_at_s)) if t is not None and t >= cfg.time_limit_s]
        if late:
            peer, name, t = late[0]
            raise ValueError(f"collaborative.churn: peer {peer}'s {name} = {t:g} s is at or after the run's end "
                             f"(time_limit_s = {cfg.time_limit_s:g}); allowed: < time_limit_s")
    first = c.churn_of(0, cfg.peers)
    if first is not None and first.join_at_s > 0 and not c.initial_peers:
        raise ValueError("collaborative.churn: peer 0 bootstraps the swarm (no initial_peers), so it starts with the "
                         "run; allowed: join_at_s = 0 for peer 0")


def _global_batch(batch_size: int, workers: int, options: Mapping[str, Any]) -> int:
    return int(options.get("target_batch_size", CollaborativeConfig.model_fields["target_batch_size"].default))


def _startup_steps(batch_size: int, workers: int, options: Mapping[str, Any]) -> int:
    """The first global epoch plus its overshoot step: hivemind's peer discovery and first
    matchmaking, which a long run pays once (a measurement excludes them like a warm-up)."""
    return math.ceil(_global_batch(batch_size, workers, options) / (workers * batch_size)) + 1


MEASURED_STEPS = 48
"""Steps per peer a measurement needs: enough for many averaging rounds (a peer's steps per global
epoch are a whole number that varies from epoch to epoch)."""

ESTIMATE_FACTOR = (89.0 - 8.0) / (50 * 0.83)
"""Wall time over compute time of a run, for rough estimates: a 2-peer run (1 core each, budget
3,200 samples, target batch size 128, matchmaking 2 s) took 89 s, of which about 8 s is any run's
start cost, where its 50 steps per peer compute in 50 x 0.83 s (measured on the 2-core development
machine; :mod:`ddlscope.experiments.estimate`)."""


HIVEMIND_PART_SIZE_BYTES = 2**19
"""hivemind 1.1.12 ``averaging.partition.DEFAULT_PART_SIZE_BYTES``: all-reduce chunk size."""


SWARM_OPTIONS: tuple[str, ...] = ("target_group_size", "auxiliary_peers", "client_mode_peers",
                                   "declared_bandwidths_mbit_per_s", "churn", "run_s", "progress_expiration_s")
"""Options of a collaborative candidate that describe the swarm (:func:`predict_collaborative`)."""


def collaborative_candidate(s: Setting, global_batch_size: int, options: dict[str, Any]) -> Setting:
    """A collaborative candidate for a job: the peers accumulate the global batch as their target
    batch size (unless ``options["target_batch_size"]`` is given), at ``options["matchmaking_time_s"]``
    (default :data:`DEFAULT_MATCHMAKING_TIME_S`), with ``options["use_local_updates"]``; the swarm's
    options (:data:`SWARM_OPTIONS`) that are set go to the setting's ``options``."""
    swarm = {k: options[k] for k in SWARM_OPTIONS if options.get(k) not in (None, [], "")}
    return replace(s, target_batch_size=options.get("target_batch_size") or global_batch_size,
                   matchmaking_time_s=options.get("matchmaking_time_s") or DEFAULT_MATCHMAKING_TIME_S,
                   use_local_updates=bool(options.get("use_local_updates")), options={**s.options, **swarm})


def swarm_options(cfg: "RunConfig") -> dict[str, Any]:
    """A run config's swarm as prediction options: its ``[collaborative]`` table's target batch size,
    matchmaking time, local updates and :data:`SWARM_OPTIONS` (churn as drawn, ``run_s`` from
    ``time_limit_s``), for predicting that run before it starts (``recommend --swarm``)."""
    c = cfg.collaborative
    return {"target_batch_size": c.target_batch_size, "matchmaking_time_s": c.matchmaking_time_s,
            "use_local_updates": c.use_local_updates, "target_group_size": c.target_group_size,
            "auxiliary_peers": c.auxiliary_peers, "client_mode_peers": c.client_mode_peers,
            "declared_bandwidths_mbit_per_s": c.declared_bandwidths_mbit_per_s,
            "churn": [e.model_dump() for e in c.churn_events(cfg.peers)], "run_s": cfg.time_limit_s,
            "averaging_timeout_s": c.averaging_timeout_s, "progress_expiration_s": c.progress_expiration_s}


def predict_collaborative(profile: WorkloadProfile, cluster: ClusterSpec, s: Setting, scale: float = 1.0) -> Prediction:
    """Hivemind collaborative training: accumulate the target batch, then an averaging round.

    Peers (``cluster.peers``, or the cluster's first ``workers`` devices with compute share 1)
    each train at their own speed: ``step_p = data + compute(b) * contention / share_p``. The swarm
    reaches the target batch size after ``T_acc = TBS / sum_p(b / step_p)`` seconds (DeDLOC's
    global progress tracking, Ryabinin 2023). The step that ends a global epoch then waits for
    the gradient round (unless ``use_local_updates``), a :func:`butterfly_allreduce_s` of the
    gradients over the peers' links, in equal parts (ddlscope's peers declare no bandwidth to
    hivemind). The rounds hold the links at ``cluster.averaging_efficiency`` of their bandwidths
    (what hivemind's rounds reach, measured on emulated links by
    :mod:`ddlscope.network.averaging_probe`; 1 otherwise): without a hivemind fit the rounds take
    that long; with one, the fit's overhead already holds their work on the peers' cores, so the
    round adds its wire time at the full bandwidth and the efficiency counts in ``link_busy_s``.
    With Moshpit-style groups (``options["target_group_size"]`` = g < peers) a round
    averages within groups of g; the g slowest links make the slowest group, whose round is timed. hivemind pre-schedules it
    (``Optimizer._maybe_schedule_gradient_averaging``): once the epoch's end is less than
    ``matchmaking_time_s`` away, matchmaking starts and the group is ready at ``max(estimated
    end, now + matchmaking_time_s)``, so the round also waits ``max(0, matchmaking_time_s - (T_acc
    - slowest peer step))``, once per epoch.

    Every ``average_state_every`` epochs the parameters (only: hivemind's default
    ``average_opt_statistics=()``) are averaged too. hivemind runs that round in the background
    after the epoch's transition (its log reports it during the next steps). On GPUs it overlaps
    the next steps' compute; only what exceeds ``T_acc`` is exposed. On CPU devices (the profiled
    device is a CPU and the cluster's kind is ``local``) its work runs on the cores that train,
    so it adds to the epoch in full. With ``use_local_updates`` peers step locally every batch and
    only the state round remains.

    hivemind's own processes and threads (DHT, ``p2pd``, averagers, progress tracker) also run
    on the peers' cores: 1.0-1.6 CPU-seconds per global epoch on one-core CPU peers whatever the
    model (the steps' ``background_cpu_s``), and peers overshoot the target batch because they
    see the swarm's progress late. With a ``hivemind`` fit (``calibrate --hivemind``: a reference
    network trained in a local swarm) a global epoch lasts the overshoot more steps of the slowest
    peer and holds their samples: hivemind's epoch-ending rule run on the peers' steps as the
    fit measured hivemind's work in them, its epochs drawn whole (``step_epochs_s``, or
    ``step_pattern_s`` for a fit without them; :func:`rule_overshoot`; ``inputs["overshoot_from"]``
    is ``"rule"``), or for a fit without either its overshoot at the slowest peer's compute step
    (:meth:`HivemindFit.overshoot_at`, ``"fit"``), and the measured overhead, ``epoch_overhead_s +
    overhead_steps x`` the slowest peer's step, replaces the two rounds on these devices. Of that
    overhead, the fit's ``compute_overhead_s`` (what hivemind's work on the peer's cores added to
    its steps' compute in the reference swarm) goes to forward and backward, where a run measures
    it (``inputs["hivemind_in_steps_s"]``), and the rest to averaging. That work is mostly the
    parameter round's, which runs while the next epoch accumulates: the fit measures it on
    loopback, where that round's transfer takes no time. Over listed links (``cluster.peers``) whose
    parameter round, its matchmaking and then its transfer at the link's averaging share, outlasts
    the accumulation, only the share the accumulation covers goes to the steps and the rest to the
    rounds' wait: ``inputs["state_round_overlap"] = c(round) / c(0)``, ``c(x) = min(1, (T_acc +
    compute_overhead_s) / (matchmaking_time_s + x))`` (relative to the fit's loopback, so a fit's
    own conditions read 1). On emulated links (issue 14, 2 one-core peers, MobileNetV2, 2026-11-29) hivemind's CPU in
    the steps that only trained was 1.10, 0.66 and 0.62 CPU-s per round at 200, 50 and 200/20
    Mbit/s, and the runs' forward and backward exceeded the profile's by 0.65 s per epoch at
    200/20 (the fit: 1.40 s); a post-round step holding 0.7-1.0 CPU-s of it took 1.5-1.8 s
    where one holding 0.15 took 0.8 s. Where the link is the bottleneck the epoch's length
    does not change (the link's wait absorbs it); the parts do. The fit's overhead beyond that goes
    to averaging, plus
    the rounds' extra time for parameters beyond the reference's and, for listed peers, the
    gradient round's wire time over their links at their full rate (``inputs["grad_round_wire_s"]``;
    none with ``use_local_updates``): the fit measured its rounds on loopback, where bytes take no
    time, and the round's bytes do not flow under its CPU work. On 200 Mbit/s links (2 one-core
    peers, MobileNetV2, 2026-12-02) the gradient round's wait was 0.94-1.06 s per epoch against
    0.64-0.68 s on loopback the same hour, its wire time 0.37 s; an earlier form that hid the wire
    time under half of hivemind's CPU per epoch predicted 200 Mbit/s as fast as loopback (-13.4 %;
    ``docs/validation.md``, stop 51). The overshoot depends on the network: a fit of another
    network than the profile's gets a note. The matchmaking wait leaves the peer's cores to hivemind's work, so
    the two overlap: ``max(wait, overhead - compute_overhead_s)``. Both
    figures depend on the matchmaking time (:mod:`ddlscope.profiling.swarm`); a setting at another
    matchmaking time than the fit's gets a note. Without a fit both are left out and CPU peers are
    predicted too fast (see the README's validation figures), which a note says too.

    **The link carries both rounds.** Each epoch the slowest group's links carry the gradient round
    and then, in the background while the next epoch accumulates, the parameter round, after that
    round's own matchmaking (link idle). So an epoch lasts at least ``link_busy_s = grad round +
    state round + matchmaking_time_s / average_state_every``; where that exceeds the epoch as
    computed above the difference (``link_wait_s``) is added to ``averaging_s``: the gradient
    round starts while the parameter round still holds the link. Seen on emulated links: with
    MobileNetV2 on 2 one-core peers the 20 Mbit/s link of a 200/20 pair was busy both ways for
    all but ~1 s of each 10.6 s epoch (``docs/validation.md``, issue 14).

    The step is a global epoch. Its parts: ``averaging_s`` (the rounds, matchmaking included),
    ``optimizer_s`` (the slowest peer's optimizer step after the round), and ``T_acc`` split as
    the slowest peer's step is made: its data loading into ``data_load_s``, its local optimizer
    steps (``use_local_updates``) into ``optimizer_s``, and its compute (plus the fit's
    ``compute_overhead_s``) into ``forward_s`` and ``backward_s`` in the profiled forward :
    backward proportion.

    **Peer roles** (the ``[collaborative]`` table's ``auxiliary_peers`` and ``client_mode_peers``
    as options): an auxiliary peer trains on nothing and takes part in the rounds as a reducer; a
    client-mode peer trains and reduces nothing (:func:`butterfly_allreduce_s` with roles). With
    ``declared_bandwidths_mbit_per_s`` set the peers declare their links and the round's parts come
    from hivemind's LP (taken to declare the cluster's link rates); otherwise equal parts.

    **Churn** (the option ``churn``: :class:`ChurnEvent` tables; ``run_s``: the run's length in
    seconds from the swarm's first step, needed with churn): the run is cut where a peer joins,
    leaves, dies or rejoins, and each stretch is predicted for the peers present in it (a global
    epoch of that swarm). A peer that joins or rejoins first starts (its process, hivemind's DHT
    and optimizer: the calibrated ``hivemind.peer_startup_s``, 0 with a note where the cluster file
    lacks it), then computes one step whose gradients hivemind discards when that step loads the
    swarm's state (``load_state_from_peers``: parameters and optimizer state over its link at the
    share of its rate hivemind's transfers reach, ``averaging_efficiency``, plus the collective's
    fixed cost) and trains only after all three; a killed peer loses on average half of what it
    contributes to a global epoch (its samples since the last round). A peer left alone (no other
    peer to average with: hivemind's averager needs a group of at least 2) trains to the end of its
    global epoch, half an epoch of its own on average, and then waits in the round for a partner
    until another peer arrives or the option ``averaging_timeout_s`` (default 300 s) runs out, epoch
    after epoch (:func:`lone_peer_samples`; seen in validation: a survivor of a pair stalled from its
    next round until the killed peer was back). A peer that arrives while the one left alone waits
    (:func:`lone_peer_waits_at_end`) ends that wait only after a *reunion*: the newcomer's step,
    the gradient round, then the waiting peer's parameter round, pending since the kill, which
    needs the newcomer too; so for ``reunion_s = newcomer's step + 2 x the swarm's averaging_s``
    the waiting peer trains nothing and the newcomer trains outside its gradient round, at most
    the swarm's samples of a global epoch (it then waits in its next round too). Measured
    in the churn validation (stop 66, a MobileNetV2 pair on a 2-core Xeon): from the newcomer's
    first kept step to the waiting peer's next, 2.3-4.3 s on loopback and 5.7-5.9 s at 50 Mbit/s,
    where this gives 2.6 and 6.4 s; the rejoining peer's state load took 0.4-0.5 s on loopback
    (hivemind's serialization, not modelled) and 4.7 s at 50 Mbit/s (4.0 s here, 3.1 s at the
    link's both-ways share). A kill that lands inside a gradient round the
    killed peer takes part in stalls the swarm until that round's ``averaging_timeout_s``
    (:func:`kill_in_round_risk`): the prediction is the more likely of the two outcomes (the stall
    where its probability is at least 1/2; with several kills, the stalled outcome has every kill
    stall) and ``inputs`` and a note give the other. A kill can also leave a stale progress record
    that stalls the others for up to the option ``progress_expiration_s`` (:func:`stale_record_stall`):
    that depends on a failed round before it, which is not predicted, so a note gives the epoch
    it would make and the figure leaves it out. The prediction is then the run's mean global
    epoch: ``run_s x TBS / samples trained``; ``inputs["churn_stretches"]`` lists each stretch.

    Raises:
        UserError: churn without ``run_s``, churn naming a peer outside the setting, or a schedule
            that leaves no trainer.
    """
    churn = [e if isinstance(e, ChurnEvent) else ChurnEvent(**e) for e in s.options.get("churn") or []]
    if not churn:
        return _predict_swarm(profile, cluster, s, scale, list(range(s.workers)))
    run_s = s.options.get("run_s")
    if not run_s or run_s <= 0:
        raise UserError("collaborative prediction with churn needs the run's length: option run_s > 0 (seconds from "
                        "the swarm's first step)")
    bad = sorted({e.peer for e in churn if e.peer >= s.workers})
    if bad:
        raise UserError(f"churn names peers {bad}; allowed: 0..{s.workers - 1} ({s.workers} peers)")
    return _predict_churn(profile, cluster, s, scale, churn, float(run_s))


def _peer_roles(s: Setting) -> list[str]:
    """Each peer's role (:data:`PEER_ROLES`) from the setting's ``auxiliary_peers`` and ``client_mode_peers``."""
    aux, clients = set(s.options.get("auxiliary_peers") or []), set(s.options.get("client_mode_peers") or [])
    return ["auxiliary" if i in aux else "client" if i in clients else "trainer" for i in range(s.workers)]


def _peer_links(cluster: ClusterSpec, s: Setting) -> tuple[list[float], list[float], list[float]]:
    """Every peer's (compute share, bandwidth GB/s, latency s): ``cluster.peers`` or the cluster's devices."""
    peers = cluster.peers[: s.workers] if cluster.peers else []
    if peers:
        return [p.compute_share for p in peers], [p.bandwidth_gb_per_s for p in peers], [p.latency_s for p in peers]
    link = cluster.ring_link(s.workers)
    return [1.0] * s.workers, [link.bandwidth_gb_per_s] * s.workers, [link.latency_s] * s.workers


RULE_EPOCHS = (30, 300)
"""Fewest and most global epochs the overshoot's simulation counts (most where each has few steps)."""
RULE_STEPS = 20_000
"""Steps of all peers the overshoot's simulation aims at: its epochs are this over the steps per epoch,
within :data:`RULE_EPOCHS`."""


def rule_overshoot(hm: HivemindFit, peer_steps: list[float], s: Setting) -> float | None:
    """Steps per peer per global epoch beyond the target batch, from hivemind's epoch-ending rule
    (:func:`ddlscope.modeling.progress.simulate_overshoot`) on steps made as the fit measured
    hivemind's work in them: trainer ``q``'s step at position ``i`` after the round takes
    ``peer_steps[q]`` plus what that work added there. With the fit's ``step_epochs_s``, whole
    epochs of the reference swarms are drawn (:class:`ddlscope.modeling.progress.EpochDraws`: the
    peers of one epoch together); for a fit without them, each step from ``step_pattern_s``
    (normal draws of the position's mean and standard deviation, its last entry for later
    positions). Steps are at least a tenth of ``peer_steps[q]``; the rule runs at the setting's
    target batch size, batch size and trainers, rounds of ``matchmaking_time_s``. None without
    epochs or a pattern.

    Over emulated links the peer with the clean first step ended the round later than the other,
    by 0.035-0.038 s at 200 Mbit/s, 0.08-0.15 s at 50 Mbit/s and 0.13-0.19 s on a 200/20 pair (2 peers
    of MobileNetV2/MNIST, 2026-12-02), about one all-reduce part (512 KiB) at the link's rate, and
    on the runs' own epochs that lag explains their lower overshoot
    (:func:`ddlscope.analyze.epoch_rule.check_epoch_rule`). Taken into the prediction as one part at
    the slowest link's rate it predicted 0.18, 0.13 and 0.06 steps where those runs had 0.21, 0.19
    and 0.33, and 0.21 on every link without it, so the prediction leaves it out
    (``docs/validation.md``, stop 50).

    The fit measures at 2 steps per peer; the rule carries it to other steps per peer, where one
    fixed overshoot does not (issue 14, 2026-11-29: 2 one-core peers of MobileNetV2 on loopback
    overshot 0.38 steps at 2 steps each and 0.70 at 6; the rule on the first run's step times gave
    0.60 at 6). The steps are the reference swarms' on loopback; where a link moves hivemind's
    work between positions the rule does not follow (``docs/validation.md``, stop 46).
    """
    if not peer_steps or not (hm.step_epochs_s or hm.step_pattern_s):
        return None
    measured = tuple(tuple(tuple(peer) for peer in epoch) for epoch in hm.step_epochs_s) or None
    return _simulated_overshoot(measured, tuple(map(tuple, hm.step_pattern_s)), tuple(round(x, 4) for x in peer_steps),
                                s.batch_size, s.target_batch_size, s.matchmaking_time_s)


@functools.lru_cache(maxsize=256)
def _simulated_overshoot(epochs: tuple[tuple[tuple[float, ...], ...], ...] | None,
                         pattern: tuple[tuple[float, float], ...], peer_steps: tuple[float, ...], batch_size: int,
                         target_batch_size: int, round_s: float) -> float:
    per_epoch = max(1.0, target_batch_size / batch_size)
    count = int(min(RULE_EPOCHS[1], max(RULE_EPOCHS[0], RULE_STEPS / per_epoch)))

    def from_pattern(q: int, epoch: int, position: int, rng) -> float:
        extra, sd = pattern[min(position, len(pattern) - 1)]
        return max(0.1 * peer_steps[q], rng.gauss(peer_steps[q] + extra, sd))

    step = EpochDraws(epochs, base_s=peer_steps) if epochs else from_pattern
    return max(0.0, simulate_overshoot(step, len(peer_steps), batch_size,
                                       TrackerSettings(target_batch_size, latency_s=DHT_LATENCY_S),
                                       round_s=round_s, epochs=count, seed=0))


def _predict_swarm(profile: WorkloadProfile, cluster: ClusterSpec, s: Setting, scale: float,
                   present: list[int]) -> Prediction:
    """A global epoch of the swarm made of the peers ``present`` (indices), see :func:`predict_collaborative`."""
    roles_all = _peer_roles(s)
    trainers = [i for i in present if roles_all[i] != "auxiliary"]
    busy = s.workers if not cluster.peers else 1
    slow = contention(cluster, min(busy, cluster.devices_per_node)) * scale
    step = profile.step_at(s.batch_size)
    shares_all, bws_all, lats_all = _peer_links(cluster, s)
    shares = [shares_all[i] for i in trainers]
    compute = step.forward_s + step.backward_s
    local_opt = step.optimizer_s if s.use_local_updates else 0.0
    load = profile.data_load_s(s.batch_size, s.loader_workers)
    peer_steps = [(compute + local_opt) * slow / share + load for share in shares]
    throughput = sum(s.batch_size / t for t in peer_steps)
    hm = cluster.hivemind
    # peers overshoot the target batch: hivemind's epoch-ending rule on steps made as the fit measured them, or (a
    # fit from before the pattern was kept) the calibrated steps at their compute step (the swarms' compute alone)
    overshoot, overshoot_from = 0.0, "none"
    if hm and shares:
        overshoot, overshoot_from = rule_overshoot(hm, peer_steps, s), "rule"
        if overshoot is None:
            overshoot, overshoot_from = hm.overshoot_at(compute * slow / min(shares)), "fit"
    t_acc = s.target_batch_size / throughput + overshoot * max(peer_steps)
    alone = len(shares) < 2
    on_cpu = serial_comm(profile, cluster)
    fixed = cluster.collective_fixed_s
    # Moshpit-style groups (target_group_size): a round averages within groups; the slowest group sets its time
    group = min(len(present), s.options.get("target_group_size") or len(present))
    order = sorted(present, key=lambda i: bws_all[i])[:group]
    bws, lats, roles = [bws_all[i] for i in order], [lats_all[i] for i in order], [roles_all[i] for i in order]
    balanced = bool(s.options.get("declared_bandwidths_mbit_per_s"))

    def round_s(nbytes: float, efficiency: float = 1.0) -> float:
        return butterfly_allreduce_s(nbytes, [b * efficiency for b in bws], lats, fixed, balanced=balanced, roles=roles)

    # what hivemind's rounds carry of each link (measured on emulated links: network.averaging_probe) holds the
    # link; with a hivemind fit the rounds' own work on the peers' cores is already in the fit's overhead, so the
    # round adds its wire time at the link's rate, and the efficiency counts where the link is the bottleneck
    link_round = 0.0 if alone else round_s(float(profile.param_bytes), cluster.averaging_efficiency)
    one_round = link_round if hm is None or alone else round_s(float(profile.param_bytes))
    overhead = hm.epoch_overhead_s + hm.overhead_steps * max(peer_steps) if hm and not alone else 0.0
    # of it, what hivemind's background work adds to the steps' compute (measured on loopback, where the parameter
    # round ends within the next accumulation): forward and backward hold it, as far as the parameter round (after
    # its own matchmaking) overlaps the accumulation; the rest of that work lands in the rounds' wait
    in_steps_fit = min(hm.compute_overhead_s, overhead) if hm else 0.0

    def covered(transfer_s: float) -> float:  # the share of the parameter round's span the accumulation covers
        return min(1.0, (t_acc + in_steps_fit) / (s.matchmaking_time_s + transfer_s))

    state_overlap = covered(link_round) / covered(0.0) if cluster.peers and not alone and t_acc > 0 else 1.0
    in_steps = in_steps_fit * state_overlap
    # matchmaking starts once the epoch's end (steps slowed by that work) is matchmaking_time_s away
    wait = 0.0 if alone else max(0.0, s.matchmaking_time_s - max(0.0, t_acc + in_steps - max(peer_steps)))
    grad_round = 0.0 if s.use_local_updates or alone else wait + one_round
    state_round = one_round / s.average_state_every
    state_exposed = state_round if on_cpu else max(0.0, state_round - t_acc)
    averaging = grad_round + state_exposed
    wire = 0.0
    if hm and not alone:  # measured on these devices: replaces the two rounds
        reference = round_s(float(hm.reference_param_bytes))
        beyond = 2 * max(0.0, one_round - reference)
        # over listed links the gradient round's wire time adds to what the fit measured on loopback: its bytes
        # do not flow under the round's CPU work (issue 14, stop 51: the round's wait grew by 0.26-0.38 s from
        # loopback to 200 Mbit/s, where its wire time is 0.37 s)
        wire = one_round if cluster.peers and not s.use_local_updates else 0.0
        # while a peer waits for matchmaking its cores are free for hivemind's own work: they overlap
        rounds = overhead - in_steps
        averaging = (max(wait, rounds) if not s.use_local_updates else rounds) + beyond + wire
    # every epoch the slowest group's links carry the gradient round and the parameter round that hivemind
    # runs in the background, after the parameter round's matchmaking: the epoch lasts no less
    optimizer_after_round = 0.0 if s.use_local_updates else step.optimizer_s * slow / min(shares)
    link_busy = 0.0 if alone else (0.0 if s.use_local_updates else link_round) \
        + link_round / s.average_state_every + s.matchmaking_time_s / s.average_state_every
    link_wait = max(0.0, link_busy - (t_acc + in_steps + averaging + optimizer_after_round))
    averaging += link_wait
    notes = []
    if hm is None and not alone:
        notes.append("collaborative: no hivemind fit in the cluster file (calibrate --hivemind), so hivemind's own "
                     "work and overshoot are left out; on CPU peers this predicts too fast")
    elif hm is not None and not alone and (hm.matchmaking_time_s is None or
                                           not math.isclose(hm.matchmaking_time_s, s.matchmaking_time_s, rel_tol=0.05)):
        at = "an unrecorded matchmaking time" if hm.matchmaking_time_s is None else f"matchmaking {hm.matchmaking_time_s:g} s"
        notes.append(f"collaborative: hivemind's overhead and overshoot were calibrated at {at}, this setting uses "
                     f"{s.matchmaking_time_s:g} s; both depend on it (calibrate --hivemind --matchmaking-time-s "
                     f"{s.matchmaking_time_s:g} measures them there)")
    if link_wait > 0 and not s.use_local_updates:
        notes.append("collaborative: the link bounds the epoch, so the peers' gradient matchmaking starts together "
                     "when the parameter round frees it; two peers that ask each other to lead wait hivemind's "
                     "request_timeout (3 s) before the round forms, which this prediction does not price (seen in "
                     "9 of 128 epochs at 50 Mbit/s: docs/swarms.md, join timeouts)")
    if hm is not None and not alone and hm.reference_network not in (None, profile.network):
        notes.append(f"collaborative: hivemind's overshoot was calibrated on {hm.reference_network}, not "
                     f"{profile.network}; it depends on the network (calibrate --hivemind --swarm-network "
                     f"{profile.network} --swarm-batch-sizes {s.batch_size} measures it for this workload)")
    slowest = max(peer_steps)  # the accumulation split as the slowest peer's step is made
    parts = split_compute(profile, s.batch_size,
                          t_acc * (slowest - load - local_opt * slow / min(shares)) / slowest + in_steps)
    parts["data_load_s"] = t_acc * load / slowest
    parts["optimizer_s"] = t_acc * local_opt * slow / min(shares) / slowest + optimizer_after_round
    parts["averaging_s"] = averaging
    return make_prediction(s, parts, throughput * t_acc,
                           inputs={"peers": len(present), "trainers": len(trainers), "averaging_group_size": group,
                                   "peer_roles": roles_all, "load_balanced": int(balanced), "compute_shares": shares,
                                   "peer_step_s": peer_steps, "hivemind_in_steps_s": in_steps,
                                   "state_round_overlap": state_overlap,
                                   "swarm_samples_per_s": throughput, "accumulate_s": t_acc,
                                   "samples_per_global_epoch": throughput * t_acc, "matchmaking_wait_s": wait,
                                   "grad_round_s": grad_round, "state_round_s": state_round,
                                   "link_busy_s": link_busy, "link_wait_s": link_wait,
                                   "state_round_on_cores": on_cpu, "hivemind_epoch_overhead_s": overhead,
                                   "overshoot_steps": overshoot, "overshoot_from": overshoot_from,
                                   "grad_round_wire_s": wire,
                                   "hivemind_fit_matchmaking_time_s": (hm.matchmaking_time_s or 0.0) if hm else 0.0,
                                   "contention": slow / scale, "compute_scale": scale}, notes=notes)


def _predict_churn(profile: WorkloadProfile, cluster: ClusterSpec, s: Setting, scale: float,
                   churn: list[ChurnEvent], run_s: float) -> Prediction:
    """The run's mean global epoch under ``churn`` (see :func:`predict_collaborative`)."""
    roles = _peer_roles(s)
    _, bws, _ = _peer_links(cluster, s)
    timeout_s = float(s.options.get("averaging_timeout_s") or DEFAULT_AVERAGING_TIMEOUT_S)
    state_bytes = float(profile.param_bytes + profile.optimizer_state_bytes)
    events = {e.peer: e for e in churn}
    full = _predict_swarm(profile, cluster, s, scale, list(range(s.workers)))
    trainers_all = [j for j in range(s.workers) if roles[j] != "auxiliary"]

    acc = full.inputs["accumulate_s"]
    in_steps = (acc + full.inputs["hivemind_in_steps_s"]) / acc if acc > 0 else 1.0

    def own_step_s(i: int) -> float:
        """A trainer's step in the whole swarm, with hivemind's work inside the steps (0 for an auxiliary peer)."""
        return full.inputs["peer_step_s"][trainers_all.index(i)] * in_steps if roles[i] != "auxiliary" else 0.0

    # when each peer trains: [start, end) spans, a (re)join's start moved past its start-up, the step whose
    # gradients the state load discards, and the load itself
    startup_s = cluster.hivemind.peer_startup_s if cluster.hivemind is not None else None
    spans: dict[int, list[tuple[float, float]]] = {}
    load_s: list[float] = []
    kills: list[tuple[float, int]] = []
    for i in range(s.workers):
        e = events.get(i)
        load_s.append(cluster.collective_fixed_s + state_bytes / (bws[i] * cluster.averaging_efficiency * 1e9))
        if e is None:
            spans[i] = [(0.0, run_s)]
            continue
        ready_s = (startup_s or 0.0) + own_step_s(i) + load_s[i]
        mine = [(e.join_at_s + (ready_s if e.join_at_s > 0 else 0.0), e.gone_at_s if e.gone_at_s is not None else run_s)]
        if e.rejoin_at_s is not None:
            mine.append((e.rejoin_at_s + ready_s, run_s))
        if e.kill_at_s is not None and e.kill_at_s < run_s:
            kills.append((e.kill_at_s, i))
        spans[i] = [(a, min(b, run_s)) for a, b in mine if a < min(b, run_s)]
    cuts = sorted({0.0, run_s, *(t for w in spans.values() for span in w for t in span if 0.0 < t < run_s)})
    stretches: list[dict[str, Any]] = []
    swarms: list[Prediction | None] = []
    for a, b in zip(cuts, cuts[1:]):
        present = [i for i in range(s.workers) if any(x <= a and b <= y for x, y in spans[i])]
        p = _predict_swarm(profile, cluster, s, scale, present) if any(roles[i] != "auxiliary" for i in present) \
            else None
        per_s = p.inputs["samples_per_global_epoch"] / p.step_s if p else 0.0
        swarms.append(p)
        reunion_s = 0.0
        if p is not None and len(present) < 2:  # nobody to average with: the round waits
            samples = lone_peer_samples(b - a, per_s, p.step_s, timeout_s)
        else:
            samples = (b - a) * per_s
            before = stretches[-1] if stretches else None
            arrivals = [i for i in present if before is not None and i not in before["peers"]
                        and roles[i] != "auxiliary"]
            if p is not None and arrivals and before["alone"] and before["waiting_at_end"]:
                # the peer left alone waits in its round until the newcomer ends a step and the gradient round,
                # then in its parameter round, pending since the kill, which needs the newcomer too; the newcomer
                # trains outside the gradient round, at most the next epoch's samples (then its round waits too)
                round_s = p.breakdown_s.get("averaging_s", 0.0)
                reunion_s = min(b - a, max(own_step_s(i) for i in arrivals) + 2 * round_s)
                newcomers = min(p.inputs["samples_per_global_epoch"],
                                max(0.0, reunion_s - round_s) * sum(s.batch_size / own_step_s(i) for i in arrivals))
                samples = newcomers + (b - a - reunion_s) * per_s
        waiting = p is not None and len(present) < 2 and lone_peer_waits_at_end(b - a, p.step_s, timeout_s)
        stretches.append({"from_s": a, "to_s": b, "peers": present, "epoch_s": p.step_s if p else None,
                          "samples": samples, "alone": len(present) < 2, "waiting_at_end": waiting,
                          "reunion_s": reunion_s})
    samples = sum(st["samples"] for st in stretches)
    lost = 0.0
    for t, i in kills:  # the killed peer's samples since the last round: half an epoch's share on average
        k = _stretch_of(stretches, t, i)
        p = swarms[k] if k is not None else None
        if p is not None and roles[i] != "auxiliary":
            trainers = [j for j in stretches[k]["peers"] if roles[j] != "auxiliary"]
            lost += 0.5 * s.batch_size / p.inputs["peer_step_s"][trainers.index(i)] * p.inputs["accumulate_s"]
    trained = samples - lost
    if trained <= 0:
        raise UserError(f"the churn schedule leaves no peer training in {run_s:g} s; allowed: at least one trainer "
                        f"present for part of the run")
    risk = kill_in_round_risk(stretches, swarms, kills, roles, timeout_s, run_s)
    stalled = trained - risk["stall_samples"]
    in_round = risk["probability"] >= 0.5 and stalled > 0  # the more likely outcome is the prediction
    epoch_s = run_s * s.target_batch_size / (stalled if in_round else trained)
    # a stale record's stall starts at the kill, as the predicted in-round stall does: the longer of the two counts
    expiration_s = float(s.options.get("progress_expiration_s") or METADATA_EXPIRATION_S)
    in_round_s = risk["stall_s"] if in_round else 0.0
    stale = stale_record_stall(stretches, kills, roles, max(expiration_s, in_round_s), run_s) \
        if expiration_s > in_round_s else 0.0
    left = trained - stale
    stale_epoch_s = run_s * s.target_batch_size / left if stale > 0 and left > 0 else None
    parts = {k: v * epoch_s / full.step_s for k, v in full.breakdown_s.items() if v}
    other_s = run_s * s.target_batch_size / (trained if in_round else stalled) if stalled > 0 else None
    inputs = {**full.inputs, "run_s": run_s, "churn_stretches": stretches, "state_load_s": load_s,
              "peer_startup_s": startup_s,
              "samples_trained": stalled if in_round else trained, "samples_lost_to_kills": lost,
              "epoch_s_without_churn": full.step_s, "kill_in_round_probability": risk["probability"],
              "kill_in_round_stall_s": risk["stall_s"], "predicted_kill_in_round": in_round,
              "epoch_s_other_outcome": other_s, "stale_record_stall_s": expiration_s if stale > 0 else 0.0,
              "epoch_s_with_stale_record": stale_epoch_s}
    joins = any(e.join_at_s > 0 or e.rejoin_at_s is not None for e in churn)
    unknown = ["collaborative: the cluster file has no hivemind.peer_startup_s (calibrate --hivemind measures it), so "
               "joining peers are taken to train right after loading the swarm's state"] \
        if joins and startup_s is None else []
    risky = []
    if risk["probability"] > 0:
        other = "-" if other_s is None else f"{other_s:.1f} s"
        risky.append(f"collaborative: a kill inside a gradient round (probability {risk['probability']:.0%}) stalls the "
                     f"swarm until the round's averaging_timeout_s ({risk['stall_s']:.0f} s more); predicted: "
                     + (f"that stall (mean epoch without it: {other})" if in_round else
                        f"no stall, the more likely outcome (mean epoch with it: {other})"))
    if stale > 0:
        worst = "no sample trained" if stale_epoch_s is None else f"mean epoch {stale_epoch_s:.1f} s"
        risky.append(f"collaborative: not in this figure: a peer killed just after it moved alone to a later epoch "
                     f"(after a round it averaged alone) leaves its progress record naming that epoch for up to "
                     f"progress_expiration_s ({expiration_s:g} s); the others load the swarm's state at every step "
                     f"and train nothing until it expires ({worst} if every kill did)")
    return make_prediction(s, parts, s.target_batch_size, inputs=inputs, notes=full.notes + unknown + risky + [
        f"collaborative: churn over {run_s:g} s: {len(stretches)} stretches of constant swarm, {lost:.0f} samples "
        f"lost to kills; the step is the run's mean global epoch"])


def kill_in_round_risk(stretches: list[dict[str, Any]], swarms: list[Prediction | None], kills: list[tuple[float, int]],
                       roles: list[str], timeout_s: float, run_s: float) -> dict[str, float]:
    """What a kill costs when it lands inside a gradient round the killed peer takes part in.

    hivemind's all-reduce does not notice a member that died in the middle of it: the others wait
    for its parts until the round's ``averaging_timeout_s``, then step with their local gradients
    (seen in the churn validation: a survivor's round failed after the 60 s timeout with 48.6 % of
    its results, and the rejoined peer waited 38.8 s in its own round meanwhile). The group is
    fixed once matchmaking formed it, at the epoch's estimated end (the round is pre-scheduled);
    the killed peer reaches it when its step in progress ends, half its step on average, and then
    the all-reduce runs. So a kill lands in such a round with probability ``window / epoch``,
    ``window = grad_round_s + peer step / 2`` of the swarm it leaves (its slowest peer's step; the
    parameter round where there is no gradient round, ``use_local_updates``); the swarm then trains
    nothing for the rest of the round's timeout, ``timeout_s - window / 2`` on average. The window
    is a reasoned estimate, not a fitted one: of six validation runs one kill landed in a round.

    Args:
        stretches / swarms: per stretch of constant swarm (``from_s``, ``to_s``, ``peers``,
            ``samples``) and its prediction (None: nobody trains), as :func:`_predict_churn` makes them.
        kills: ``(seconds from the run's start, peer)`` per kill; roles: per peer; timeout_s, run_s: seconds.

    Returns:
        ``probability`` that at least one kill lands in a round (0 without kills of a trainer in a
        swarm of 2 or more), ``stall_s`` (the longest stall, seconds) and ``stall_samples`` (the
        stretches' samples inside every kill's stall window, where nobody trains then).
    """
    miss, stall_s, stall_samples = 1.0, 0.0, 0.0
    for t, i in kills:
        k = _stretch_of(stretches, t, i)
        p = swarms[k] if k is not None else None
        if p is None or roles[i] == "auxiliary" or len(stretches[k]["peers"]) < 2:
            continue
        round_s = p.inputs.get("grad_round_s") or p.inputs.get("state_round_s") or 0.0
        window = min(p.step_s, round_s + max(p.inputs.get("peer_step_s") or [0.0]) / 2)
        miss *= 1.0 - window / p.step_s
        wait = max(0.0, timeout_s - window / 2)
        stall_s = max(stall_s, wait)
        stall_samples += _samples_between(stretches, t, min(run_s, t + wait))
    return {"probability": 1.0 - miss, "stall_s": stall_s, "stall_samples": stall_samples}


def stale_record_stall(stretches: list[dict[str, Any]], kills: list[tuple[float, int]], roles: list[str],
                       expiration_s: float, run_s: float) -> float:
    """Samples the swarm would not train if every kill left a stale progress record (an upper bound).

    hivemind keeps a departed peer's progress record (its epoch and samples) in the DHT for
    ``metadata_expiration`` after its last report. A peer killed just after it moved alone to a later
    epoch (after a round it averaged alone) leaves a record naming an epoch no live peer has; until
    it expires, the others load the swarm's state at every step, which drops that step's gradients,
    and train nothing (seen in a 4-peer test run on a 2-core EPYC, 2026-11-27: 316 steps after the
    kill, all futile; docs/swarms.md). Whether a kill does this depends on a failed round before it,
    which the cost model does not predict, so this is a bound for a note, not part of the figure.

    Args:
        stretches: per stretch of constant swarm (``from_s``, ``to_s``, ``peers``, ``samples``), as
            :func:`_predict_churn` makes them. kills: ``(seconds from the run's start, peer)``.
        roles: per peer. expiration_s: ``progress_expiration_s`` (> 0). run_s: the run's seconds.

    Returns:
        the stretches' samples inside the union of ``[kill, kill + expiration_s]`` (cut at
        ``run_s``) over the kills of trainers that had another peer to be ahead of; 0 without such kills.
    """
    windows = sorted((t, min(run_s, t + expiration_s)) for t, i in kills
                     if (k := _stretch_of(stretches, t, i)) is not None and roles[i] != "auxiliary"
                     and len(stretches[k]["peers"]) >= 2)
    merged: list[list[float]] = []
    for a, b in windows:  # overlapping stalls count once
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return sum(_samples_between(stretches, a, b) for a, b in merged)


def _samples_between(stretches: list[dict[str, Any]], start_s: float, end_s: float) -> float:
    """The stretches' samples inside ``[start_s, end_s]``, each stretch's spread evenly over its time."""
    return sum(st["samples"] * max(0.0, min(end_s, st["to_s"]) - max(start_s, st["from_s"]))
               / (st["to_s"] - st["from_s"]) for st in stretches if st["to_s"] > st["from_s"])


def _stretch_of(stretches: list[dict[str, Any]], t: float, peer: int) -> int | None:
    """Index of the stretch in which ``peer`` trained at ``t`` seconds (its kill time), or None."""
    return next((k for k, st in enumerate(stretches) if st["from_s"] < t <= st["to_s"] and peer in st["peers"]), None)


def _lone_peer_schedule(stretch_s: float, epoch_s: float, timeout_s: float) -> tuple[float, bool]:
    """A peer alone for ``stretch_s`` seconds (see :func:`lone_peer_samples`): the seconds it trains,
    and whether the stretch ends while it waits in a round; all in seconds (``epoch_s`` > 0)."""
    trained_s, t, train_s = 0.0, 0.0, epoch_s / 2
    while t < stretch_s:
        run = min(train_s, stretch_s - t)
        trained_s += run
        if t + run >= stretch_s:  # the stretch ends while it trains
            return trained_s, False
        t += run + timeout_s
        train_s = epoch_s
    return trained_s, stretch_s > 0


def lone_peer_waits_at_end(stretch_s: float, epoch_s: float, timeout_s: float) -> bool:
    """Whether a peer alone for ``stretch_s`` seconds is waiting in a round at its end (see
    :func:`lone_peer_samples`: half an epoch of training, then waits of ``timeout_s`` between whole
    epochs); all three in seconds (``epoch_s`` > 0)."""
    return _lone_peer_schedule(stretch_s, epoch_s, timeout_s)[1]


def lone_peer_samples(stretch_s: float, samples_per_s: float, epoch_s: float, timeout_s: float) -> float:
    """Samples a peer alone in the swarm trains in ``stretch_s`` seconds (see :func:`predict_collaborative`).

    It trains at ``samples_per_s`` to the end of the global epoch it is in (half an epoch,
    ``epoch_s / 2``, on average), then waits ``timeout_s`` in a round nobody joins, then trains a
    whole epoch, and so on; the stretch ends when another peer arrives (which ends the wait).

    Args:
        stretch_s / epoch_s / timeout_s: seconds (>= 0, > 0, >= 0); samples_per_s: its pace alone.
    """
    return _lone_peer_schedule(stretch_s, epoch_s, timeout_s)[0] * samples_per_s


def memory_collaborative(profile: WorkloadProfile, s: Setting) -> list[MemoryEstimate]:
    """The replica of ``single`` plus hivemind's copies (notation of :mod:`ddlscope.modeling.memory`).

    ``hivemind.Optimizer`` as :mod:`ddlscope.strategies.collaborative` configures it: a pre-built
    optimizer, so ``offload_optimizer=False``; no optimizer statistics or extra tensors averaged.
    In ``comm``: the TrainingStateAverager's host copy of the parameters (``P``); without local
    updates the GradientAverager's gradient accumulators (``G``, ``reuse_grad_buffers=False``) and
    its averaged-gradient buffers (``G``, shared memory); with ``use_local_updates`` no gradient
    averager, but the delta rule of background state averaging (``delay_state_averaging``
    defaults to True) keeps a copy of the averaged tensors from before the round (``P``). Plus an
    all-reduce's working set: the largest layer's parameter bytes plus one
    :data:`HIVEMIND_PART_SIZE_BYTES` part in flight. So ``comm = P + 2G + w`` (default) or
    ``2P + w`` (local updates), ``w = max p_l + 512 KiB``. The DHT and averager processes' own
    interpreters are not counted (forked; their private memory is not profiled). The runtime is a
    hivemind peer's (:func:`~ddlscope.modeling.memory.hivemind_runtime_bytes`).
    """
    p = profile.param_bytes
    work = max(layer.param_bytes for layer in profile.layers) + HIVEMIND_PART_SIZE_BYTES
    if s.use_local_updates:
        peers = replicas(profile, s, 2 * p + work,
                         "replica + state averager's parameter copy + delta-rule copy (local updates)")
    else:
        peers = replicas(profile, s, p + 2 * p + work,
                         "replica + state averager's parameter copy + gradient accumulators + averaged gradients")
    return [e.model_copy(update={"runtime_bytes": hivemind_runtime_bytes(profile)}) for e in peers]


MODEL = register(DistributionModel(
    name="collaborative",
    summary="hivemind peers accumulate a target batch size, then average gradients or parameters",
    strategy="collaborative:CollaborativeStrategy",
    launcher="swarm",
    measures="averaging rounds (group size, success, wait), hivemind's background CPU, TCP bytes per peer",
    predicts="time to accumulate the target batch + butterfly all-reduce (hivemind's LP) + calibrated overhead",
    order=50,
    min_workers=1,
    config_table="collaborative",
    config_class=CollaborativeConfig,
    check_config=check_target_batch,
    churn=lambda cfg: cfg.collaborative.churn_events(cfg.peers),
    per_peer_report=True,
    averages_with_hivemind=True,
    calibrations=("hivemind",),
    global_batch=_global_batch,
    candidate=collaborative_candidate,
    uses_cluster_devices=False,
    lockstep=False,
    startup_steps=_startup_steps,
    measured_steps=MEASURED_STEPS,
    estimate_factor=ESTIMATE_FACTOR,
    cost_model=predict_collaborative,
    memory_model=memory_collaborative,
))
