"""``collaborative``: peers of a hivemind swarm accumulate a target batch size, then average
(``hivemind.Optimizer``; thesis 000, DeDLOC — Diskin et al. 2021).

Its config table is ``[collaborative]`` (:class:`CollaborativeConfig`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ddlscope.distribution import DistributionModel, register
from ddlscope.modeling.cluster import ClusterSpec
from ddlscope.modeling.collectives import butterfly_allreduce_s, contention, serial_comm
from ddlscope.modeling.memory import MemoryEstimate, replicas
from ddlscope.modeling.prediction import Prediction, Setting, make_prediction, split_compute
from ddlscope.modeling.profile import WorkloadProfile

if TYPE_CHECKING:
    from ddlscope.config import RunConfig

DEFAULT_MATCHMAKING_TIME_S = 10.0
"""Thesis 000's fixed matchmaking time: the one default everywhere (runs, predictions, recommendations)."""


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
    averaging_timeout_s: float = Field(300.0, gt=0, description="give up an averaging round after this many seconds")
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
    churn: list[ChurnEvent] = Field(default_factory=list, description="peers that join late, leave, are killed and "
                                    "rejoin, at given times ([[collaborative.churn]] tables, one per peer)")

    random_churn: RandomChurn | None = Field(None, description="churn drawn at random with a seed "
                                             "([collaborative.random_churn])")

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


def collaborative_candidate(s: Setting, global_batch_size: int, options: dict[str, Any]) -> Setting:
    """A collaborative candidate for a job: the peers accumulate the global batch as their target
    batch size (unless ``options["target_batch_size"]`` is given), at ``options["matchmaking_time_s"]``
    (default :data:`DEFAULT_MATCHMAKING_TIME_S`), with ``options["use_local_updates"]``."""
    return replace(s, target_batch_size=options.get("target_batch_size") or global_batch_size,
                   matchmaking_time_s=options.get("matchmaking_time_s") or DEFAULT_MATCHMAKING_TIME_S,
                   use_local_updates=bool(options.get("use_local_updates")))


def predict_collaborative(profile: WorkloadProfile, cluster: ClusterSpec, s: Setting, scale: float = 1.0) -> Prediction:
    """Hivemind collaborative training: accumulate the target batch, then an averaging round.

    Peers (``cluster.peers``, or the cluster's first ``workers`` devices with compute share 1)
    each train at their own speed: ``step_p = data + compute(b) * contention / share_p``. The swarm
    reaches the target batch size after ``T_acc = TBS / sum_p(b / step_p)`` seconds (DeDLOC's
    global progress tracking, Ryabinin 2023). The step that ends a global epoch then waits for
    the gradient round (unless ``use_local_updates``), a :func:`butterfly_allreduce_s` of the
    gradients over the peers' links, in equal parts (ddlscope's peers declare no bandwidth to
    hivemind). With Moshpit-style groups (``options["target_group_size"]`` = g < peers) a round
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
    network trained in a local swarm) a global epoch lasts ``overshoot_steps`` more steps of the
    slowest peer and holds their samples, and the measured overhead, ``epoch_overhead_s +
    overhead_steps x`` the slowest peer's step, replaces the two rounds on these devices, plus
    the rounds' extra time for parameters beyond the reference's and, for listed peers, the wire
    time over their links. The matchmaking wait leaves the peer's cores to hivemind's work, so
    the two overlap: ``max(wait, overhead)``. Both
    figures depend on the matchmaking time (:mod:`ddlscope.profiling.swarm`); a setting at another
    matchmaking time than the fit's gets a note. Without a fit both are left out and CPU peers are
    predicted too fast (see the README's validation figures), which a note says too.

    The step is a global epoch. Its parts: ``averaging_s`` (the rounds, matchmaking included),
    ``optimizer_s`` (the slowest peer's optimizer step after the round), and ``T_acc`` split as
    the slowest peer's step is made: its data loading into ``data_load_s``, its local optimizer
    steps (``use_local_updates``) into ``optimizer_s``, and its compute into ``forward_s`` and
    ``backward_s`` in the profiled forward : backward proportion.
    """
    peers = cluster.peers[: s.workers] if cluster.peers else []
    busy = s.workers if not cluster.peers else 1
    slow = contention(cluster, min(busy, cluster.devices_per_node)) * scale
    step = profile.step_at(s.batch_size)
    if peers:
        shares = [p.compute_share for p in peers]
        bws = [p.bandwidth_gb_per_s for p in peers]
        lats = [p.latency_s for p in peers]
    else:
        link = cluster.ring_link(s.workers)
        shares, bws, lats = [1.0] * s.workers, [link.bandwidth_gb_per_s] * s.workers, [link.latency_s] * s.workers
    compute = step.forward_s + step.backward_s
    local_opt = step.optimizer_s if s.use_local_updates else 0.0
    load = profile.data_load_s(s.batch_size, s.loader_workers)
    peer_steps = [(compute + local_opt) * slow / share + load for share in shares]
    throughput = sum(s.batch_size / t for t in peer_steps)
    hm = cluster.hivemind
    t_acc = s.target_batch_size / throughput + (hm.overshoot_steps * max(peer_steps) if hm else 0.0)
    alone = len(shares) < 2
    on_cpu = serial_comm(profile, cluster)
    fixed = cluster.collective_fixed_s
    # Moshpit-style groups (target_group_size): a round averages within groups; the slowest group sets its time
    group = min(len(bws), s.options.get("target_group_size") or len(bws))
    order = sorted(range(len(bws)), key=lambda i: bws[i])[:group]
    bws, lats = [bws[i] for i in order], [lats[i] for i in order]
    # the peers declare no bandwidth to their averagers: hivemind splits the vector equally
    one_round = 0.0 if alone else butterfly_allreduce_s(float(profile.param_bytes), bws, lats, fixed, balanced=False)
    wait = 0.0 if alone else max(0.0, s.matchmaking_time_s - max(0.0, t_acc - max(peer_steps)))
    grad_round = 0.0 if s.use_local_updates or alone else wait + one_round
    state_round = one_round / s.average_state_every
    state_exposed = state_round if on_cpu else max(0.0, state_round - t_acc)
    averaging = grad_round + state_exposed
    overhead = 0.0
    if hm and not alone:  # measured on these devices: replaces the two rounds
        reference = butterfly_allreduce_s(float(hm.reference_param_bytes), bws, lats, fixed, balanced=False)
        beyond = 2 * max(0.0, one_round - reference)
        # while a peer waits for matchmaking its cores are free for hivemind's own work: they overlap
        overhead = hm.epoch_overhead_s + hm.overhead_steps * max(peer_steps)
        averaging = (max(wait, overhead) if not s.use_local_updates else overhead) \
            + beyond + (one_round if peers else 0.0)
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
    slowest = max(peer_steps)  # the accumulation split as the slowest peer's step is made
    parts = split_compute(profile, s.batch_size, t_acc * (slowest - load - local_opt * slow / min(shares)) / slowest)
    parts["data_load_s"] = t_acc * load / slowest
    parts["optimizer_s"] = t_acc * local_opt * slow / min(shares) / slowest \
        + (0.0 if s.use_local_updates else step.optimizer_s * slow / min(shares))
    parts["averaging_s"] = averaging
    return make_prediction(s, parts, throughput * t_acc,
                           inputs={"peers": len(shares), "averaging_group_size": group, "compute_shares": shares,
                                   "peer_step_s": peer_steps,
                                   "swarm_samples_per_s": throughput, "accumulate_s": t_acc,
                                   "samples_per_global_epoch": throughput * t_acc, "matchmaking_wait_s": wait,
                                   "grad_round_s": grad_round, "state_round_s": state_round,
                                   "state_round_on_cores": on_cpu, "hivemind_epoch_overhead_s": overhead,
                                   "hivemind_fit_matchmaking_time_s": (hm.matchmaking_time_s or 0.0) if hm else 0.0,
                                   "contention": slow / scale, "compute_scale": scale}, notes=notes)


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
    interpreters are not counted (forked; their private memory is not profiled).
    """
    p = profile.param_bytes
    work = max(layer.param_bytes for layer in profile.layers) + HIVEMIND_PART_SIZE_BYTES
    if s.use_local_updates:
        return replicas(profile, s, 2 * p + work,
                        "replica + state averager's parameter copy + delta-rule copy (local updates)")
    return replicas(profile, s, p + 2 * p + work,
                    "replica + state averager's parameter copy + gradient accumulators + averaged gradients")


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
