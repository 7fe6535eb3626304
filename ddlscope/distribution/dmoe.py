"""``dmoe``: the Decentralized Mixture-of-Experts — Ryabinin & Gusev 2020, "Towards Crowdsourced
Training of Large Neural Networks using Decentralized Mixture-of-Experts" (NeurIPS 2020; seed 003).

A network's mixture-of-experts layer keeps its experts on *expert servers* (processes that each
host some of the experts, train them, and announce them in a DHT); *trainers* hold the rest of
the network (a trunk) and a gating function. For each input a trainer scores the grid of expert
ids, finds the ``k_best`` experts that are alive with a beam search over the DHT (one look-up round
per grid dimension), sends the input to each chosen expert over the network, and averages the
answers weighted by a softmax over the chosen experts' scores. Experts that fail or miss
``forward_timeout_s`` are left out as long as ``k_min`` answer (hivemind 1.1.12
``hivemind.moe.RemoteMixtureOfExperts``). Several trainers may share one set of experts; each
trainer keeps its own trunk and gating (no averaging between trainers).

``placement`` runs the same network three ways, so a report can say what decentralization costs:
``remote`` (experts on the servers, the model above), ``local`` (the same experts with the same
gating in the trainer's own process, no servers) and ``dense`` (one expert of the same type
applied to every sample, no gating).

This module holds the descriptor, the ``[dmoe]`` config table (:class:`DMoEConfig`, with its
server schedule :class:`ServerEvent`), the pre-flight checks, the expert servers the launcher
starts (:func:`expert_servers`) and the cost and memory models (:func:`predict_dmoe`,
:func:`memory_dmoe`, :func:`server_memory_bytes`: a trainer's trunk compute from the profile of the
zoo's network, :func:`zoo_config`, plus beam search and remote calls from the cluster's
:class:`~ddlscope.modeling.cluster.DMoEFit`, ``calibrate --dmoe``); it is torch-free. The trainer's side is
:class:`ddlscope.strategies.dmoe.DMoEStrategy`, the server process :mod:`ddlscope.moe.server`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ddlscope.distribution import DistributionModel, Service, register

if TYPE_CHECKING:
    from ddlscope.config import RunConfig
    from ddlscope.modeling.cluster import ClusterSpec, LinkSpec
    from ddlscope.modeling.memory import MemoryEstimate
    from ddlscope.modeling.prediction import Prediction, Setting
    from ddlscope.modeling.profile import LayerProfile, WorkloadProfile

BUILTIN_EXPERTS: tuple[str, ...] = ("ffn", "transformer")
"""hivemind's expert blocks (``hivemind.moe.server.layers.name_to_block``) a config may name; or a
user factory ``"package.module:factory"`` called as ``factory(hidden_dim)``."""

UID_PREFIX = "expert."
"""The common prefix of expert ids: an expert's id is ``expert.<i0>.<i1>...`` over the grid."""

TRANSFORMER_SEQUENCE_LENGTH = 128
"""Sequence length hivemind's ``transformer`` expert is declared with (its sample input is
``[batch, 128, hidden]`` plus a ``[batch, 128]`` padding mask): networks that use it feed
sequences of exactly this length."""

TRANSFORMER_HEADS = 16
"""Attention heads of hivemind's ``transformer`` expert: its ``hidden_dim`` must be a multiple."""


class ServerEvent(BaseModel):
    """When an expert server starts, is killed, or comes back (``[[dmoe.server_events]]``).

    Times are seconds after the run's first stored step (as a swarm's churn schedule counts them,
    so that start-up, 3-20 s, does not shift them); ``start_at_s = 0`` starts the server with the
    run, before the trainers. A server without an event starts with the run and runs to the end. ``kill_at_s`` ends the server's process with SIGKILL (what a crashed or
    disconnected volunteer looks like); ``restart_at_s`` then starts a new process hosting the
    same expert ids (fresh parameters, a new peer id), which trainers find through the DHT.
    """

    model_config = ConfigDict(extra="forbid")

    server: int = Field(ge=0, description="index of the server, 0 .. servers - 1")
    start_at_s: float = Field(0.0, ge=0, le=86_400, description="start the server this long after the first step (0: with the run)")
    kill_at_s: float | None = Field(None, gt=0, le=86_400, description="SIGKILL the server this long after the first step")
    restart_at_s: float | None = Field(None, gt=0, le=86_400,
                                       description="start a new server with the same experts this long after the first step")

    @model_validator(mode="after")
    def _ordered(self) -> "ServerEvent":
        if self.kill_at_s is not None and self.kill_at_s <= self.start_at_s:
            raise ValueError(f"server {self.server}: kill_at_s = {self.kill_at_s:g} is not after start_at_s = "
                             f"{self.start_at_s:g}; allowed: kill_at_s > start_at_s")
        if self.restart_at_s is not None and (self.kill_at_s is None or self.restart_at_s <= self.kill_at_s):
            raise ValueError(f"server {self.server}: restart_at_s needs an earlier kill_at_s; allowed: "
                             f"restart_at_s > kill_at_s")
        return self


class DMoEConfig(BaseModel):
    """Settings of the ``dmoe`` distribution model (``[dmoe]`` table of a run config).

    Expert ids form a grid (``grid_size``, e.g. ``[2, 2]`` -> ``expert.0.0 .. expert.1.1``); the
    grid's experts are dealt to ``servers`` in turn (server ``s`` of ``S`` hosts experts ``s, s + S,
    s + 2S, ...`` in grid order: :meth:`server_uids`). Servers train their experts with
    the run's own optimizer and learning rate, one optimizer step per batch they process (hivemind's
    ``ModuleBackend.on_backward``). Timeouts follow ``RemoteMixtureOfExperts``'s arguments.
    """

    model_config = ConfigDict(extra="forbid")

    placement: Literal["remote", "local", "dense"] = Field(
        "remote", description="remote: experts on servers; local: the same experts in-process; dense: one expert, no gating")
    expert: str = Field("ffn", description="expert block: 'ffn', 'transformer' (hivemind's) or 'package.module:factory'")
    hidden_dim: int = Field(64, ge=1, le=8192, description="width of the experts' input and output")
    grid_size: list[int] = Field(default_factory=lambda: [2, 2], min_length=1, max_length=4,
                                 description="expert-id grid; experts = product of its sizes")
    servers: int = Field(2, ge=1, le=64, description="expert servers ddlscope starts (placement remote)")
    vcpus_per_server: int = Field(1, ge=1, le=256, description="CPU cores each server is pinned to")
    k_best: int = Field(2, ge=1, description="experts each sample is sent to")
    k_min: int = Field(1, ge=1, description="a sample needs at least this many experts to answer")
    forward_timeout_s: float = Field(10.0, gt=0, le=3600, description="give up waiting for experts' forward answers")
    backward_timeout_s: float = Field(10.0, gt=0, le=3600, description="give up waiting for experts' backward answers")
    timeout_after_k_min_s: float = Field(
        1.0, gt=0, le=3600, description="once k_min experts answered every sample, wait this long for the others")
    max_batch_size: int = Field(1024, ge=1, le=1_000_000, description="samples a server batches into one forward/backward")
    update_period_s: float = Field(
        5.0, gt=0, le=3600, description="servers re-announce their experts this often; an expert vanishes after 2x")
    server_events: list[ServerEvent] = Field(default_factory=list, description="servers that start late, die, come back")
    listen_host: str = Field("127.0.0.1", description="address servers and trainers listen on; loopback unless you ask")
    nat_traversal: bool = Field(False, description="let p2pd map ports (UPnP/NAT-PMP), run AutoNAT and relay: peers "
                                "behind NATs on public networks; needs a non-loopback listen_host")
    join_timeout_s: float = Field(60.0, gt=0, le=3600, description="servers must be up and experts found within this")
    initial_peers: list[str] = Field(default_factory=list,
                                     description="multiaddrs of running expert servers to use instead of starting them")

    @model_validator(mode="after")
    def _nat_traversal_needs_public_host(self) -> "DMoEConfig":
        from ddlscope.launch.network import check_nat_traversal

        check_nat_traversal(self.nat_traversal, self.listen_host)
        return self

    @field_validator("grid_size")
    @classmethod
    def _grid(cls, v: list[int]) -> list[int]:
        if any(n < 1 or n > 1024 for n in v):
            raise ValueError(f"{v}: allowed: 1 to 4 sizes, each 1..1024")
        return v

    @field_validator("expert")
    @classmethod
    def _expert(cls, v: str) -> str:
        module, sep, attr = v.partition(":")
        if v not in BUILTIN_EXPERTS and not (sep and module and attr and ":" not in attr):
            raise ValueError(f"{v!r}: allowed: {', '.join(BUILTIN_EXPERTS)} or 'package.module:factory'")
        return v

    @property
    def num_experts(self) -> int:
        """Experts in the grid: the product of ``grid_size``."""
        return math.prod(self.grid_size)

    def expert_uids(self) -> list[str]:
        """Every expert id of the grid in grid order (``expert.0.0``, ``expert.0.1``, ...)."""
        uids = [""]
        for size in self.grid_size:
            uids = [f"{u}.{i}" if u else str(i) for u in uids for i in range(size)]
        return [UID_PREFIX + u for u in uids]

    def server_uids(self, server: int) -> list[str]:
        """The expert ids server ``server`` hosts: every ``servers``-th id of :meth:`expert_uids`
        from the ``server``-th on (strided, so that the experts of one grid row, which a sample's
        ``k_best`` often share, sit on different servers and one lost server leaves them some)."""
        return self.expert_uids()[server::self.servers]

    @model_validator(mode="after")
    def _consistent(self) -> "DMoEConfig":
        e = self.num_experts
        if self.k_best > e:
            raise ValueError(f"k_best = {self.k_best} exceeds the {e} experts of grid_size = {self.grid_size}; "
                             f"allowed: k_best <= {e}")
        if self.k_min > self.k_best:
            raise ValueError(f"k_min = {self.k_min} exceeds k_best = {self.k_best}; allowed: k_min <= k_best")
        if self.placement == "remote" and not self.initial_peers and self.servers > e:
            raise ValueError(f"servers = {self.servers} but grid_size = {self.grid_size} has only {e} experts: "
                             f"a server would host nothing; allowed: servers <= {e}")
        for event in self.server_events:
            if event.server >= self.servers:
                raise ValueError(f"server_events: server {event.server} does not exist; allowed: 0..{self.servers - 1}")
        if len({ev.server for ev in self.server_events}) < len(self.server_events):
            raise ValueError("server_events: one event per server; allowed: each server index at most once")
        if self.expert == "transformer" and self.hidden_dim % TRANSFORMER_HEADS:
            raise ValueError(f"hidden_dim = {self.hidden_dim}: hivemind's transformer expert has "
                             f"{TRANSFORMER_HEADS} heads; allowed: a multiple of {TRANSFORMER_HEADS}")
        return self


def check_dmoe(cfg: "RunConfig") -> None:
    """Checks of a dmoe run that involve the run's other fields.

    Raises:
        ValueError: a server event after the run's time limit, a schedule that leaves a sample
            no expert server at the start, or servers outside an emulated network.
    """
    d = cfg.dmoe
    limit = cfg.time_limit_s
    for ev in d.server_events:
        latest = max(t for t in (ev.start_at_s, ev.kill_at_s, ev.restart_at_s) if t is not None)
        if limit is not None and latest >= limit:
            raise ValueError(f"dmoe.server_events: server {ev.server} has an event at {latest:g} s, after the run's "
                             f"time_limit_s = {limit:g}; allowed: times < time_limit_s")
    if d.placement == "remote" and d.initial_peers and cfg.network.emulate:
        raise ValueError("dmoe.initial_peers with network.emulate = true: the emulated network's namespaces have no "
                         "route out, so the trainers could not reach those servers; allowed: leave initial_peers "
                         "empty (ddlscope starts dmoe.servers, each in a namespace of its own)")
    if d.placement == "remote" and not d.initial_peers and d.server_events:
        late = {ev.server for ev in d.server_events if ev.start_at_s > 0}
        if len(late) == d.servers:
            raise ValueError("dmoe.server_events: every server starts late, so the trainers would start with no "
                             "experts; allowed: at least one server with start_at_s = 0")


def expert_servers(cfg: "RunConfig") -> list[Service]:
    """The expert servers the launcher starts for a run (none unless ``placement = "remote"`` and
    no ``initial_peers`` name servers that already run), with their schedules."""
    d = cfg.dmoe
    if d.placement != "remote" or d.initial_peers:
        return []
    events = {ev.server: ev for ev in d.server_events}
    services = []
    for s in range(d.servers):
        ev = events.get(s)
        services.append(Service(kind="expert server", index=s, module="ddlscope.moe.server", cores=d.vcpus_per_server,
                                start_at_s=ev.start_at_s if ev else 0.0, kill_at_s=ev.kill_at_s if ev else None,
                                restart_at_s=ev.restart_at_s if ev else None))
    return services


# ------------------------------------------------------------------------------------ prediction
MOE_LAYER = "moe"
"""Name of the mixture-of-experts layer among a profile's layers (the zoo's ``net.moe`` child)."""

ZOO_EXPERTS: dict[str, str] = {"moe_cnn": "ffn", "moe_lm": "transformer"}
"""The expert type of each zoo network with a mixture-of-experts layer
(:data:`ddlscope.workloads.models.MOE_NETWORKS`)."""

WITHOUT_FIT_NOTE = ("dmoe: no remote-call fit in the cluster file (calibrate --dmoe): the beam search and the remote "
                    "expert calls are costed from the cluster's link alone (latency and bytes), without hivemind's "
                    "own per-call cost, which is milliseconds per call on CPUs; this predicts remote experts too fast")
"""The note of every remote prediction made without a :class:`~ddlscope.modeling.cluster.DMoEFit`."""


def zoo_config(network: str) -> DMoEConfig:
    """The ``[dmoe]`` settings the model zoo builds ``network`` with, so what its profile measured:
    the table's defaults with the experts in-process (``placement = "local"``) and the network's
    expert type (:data:`ZOO_EXPERTS`).

    Raises:
        UserError: ``network`` is not one of the zoo's mixture-of-experts networks.
    """
    from ddlscope.errors import UserError

    if network not in ZOO_EXPERTS:
        raise UserError(f"network {network!r} has no mixture-of-experts layer of the zoo; allowed: "
                        f"{', '.join(ZOO_EXPERTS)}")
    return DMoEConfig(placement="local", expert=ZOO_EXPERTS[network])


def options_of(setting: "Setting", profile: "WorkloadProfile | None" = None) -> DMoEConfig:
    """The ``[dmoe]`` values of a prediction :class:`~ddlscope.modeling.prediction.Setting`: its
    ``options`` (other models' options in it are ignored), and where it has none the defaults of
    the table, or with ``profile`` of a zoo network (:func:`zoo_config`) that network's expert
    type and width (placement stays the table's default, ``remote``).

    Raises:
        UserError: values outside the table's ranges or inconsistent (one message naming each field).
    """
    from pydantic import ValidationError

    from ddlscope.errors import UserError

    base = {}
    if profile is not None and profile.network in ZOO_EXPERTS:
        zoo = zoo_config(profile.network)
        base = {"expert": zoo.expert, "hidden_dim": zoo.hidden_dim}
    mine = {**base, **{k: v for k, v in setting.options.items() if k in DMoEConfig.model_fields}}
    try:
        return DMoEConfig(**mine)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(['dmoe', *map(str, e['loc'])])}: {e['msg'].removeprefix('Value error, ')}"
                             + (f" (got {e.get('input')!r})" if e["loc"] else "") for e in err.errors())
        raise UserError(f"invalid setting: {problems}") from None


def _moe_layer(profile: "WorkloadProfile") -> tuple[int, "LayerProfile", DMoEConfig]:
    """The index and profile of the mixture-of-experts layer and the settings the profile was taken with.

    Raises:
        UserError: the profile is not of a zoo network with a mixture-of-experts layer.
    """
    from ddlscope.errors import UserError

    zoo = zoo_config(profile.network)
    for i, layer in enumerate(profile.layers):
        if layer.name == MOE_LAYER:
            return i, layer, zoo
    raise UserError(f"the profile of {profile.network!r} has no layer named {MOE_LAYER!r} (layers: "
                    f"{', '.join(x.name for x in profile.layers)}); profile it again with this ddlscope")


def check_setting(profile: "WorkloadProfile", setting: "Setting") -> None:
    """A dmoe prediction's setting: valid ``[dmoe]`` options (:func:`options_of`), a profile of a
    zoo network with a mixture-of-experts layer, and the experts that profile measured.

    Raises:
        UserError: bad options; a profile of another network; ``dmoe.expert`` or
            ``dmoe.hidden_dim`` other than the profiled network's (the experts' compute comes
            from the profile).
    """
    from ddlscope.errors import UserError

    d = options_of(setting, profile)
    _, _, zoo = _moe_layer(profile)
    for name in ("expert", "hidden_dim"):
        if getattr(d, name) != getattr(zoo, name):
            raise UserError(f"dmoe.{name} = {getattr(d, name)!r}, but the profile of {profile.network!r} measured "
                            f"{name} = {getattr(zoo, name)!r} (the zoo's; the experts' compute comes from the "
                            f"profile); allowed: {getattr(zoo, name)!r}")


def gate_flops_per_sample(hidden_dim: int, grid_size: list[int]) -> float:
    """FLOPs of the gate per sample: ``proj = Linear(hidden, sum(grid_size))``, ``2 x hidden x sum(grid)``
    (multiply-adds counted as 2, as ``torch.utils.flop_counter`` counts them)."""
    return 2.0 * hidden_dim * sum(grid_size)


def gate_param_bytes(hidden_dim: int, grid_size: list[int]) -> int:
    """Bytes of the gate's float32 parameters: ``(hidden + 1) x sum(grid_size) x 4``."""
    return 4 * (hidden_dim + 1) * sum(grid_size)


def _busiest_share(d: DMoEConfig) -> tuple[float, int]:
    """(share of all expert calls the busiest server gets, experts it hosts), with the gate spreading
    samples evenly over the grid's experts and the servers hosting :meth:`DMoEConfig.server_uids`."""
    hosted = max(len(d.server_uids(s)) for s in range(d.servers))
    return hosted / d.num_experts, hosted


def _expert_figures(profile: "WorkloadProfile", batch: float) -> dict[str, float]:
    """What the profile says about the mixture layer at ``batch`` samples (seconds, bytes):
    the gate's share of its compute, its forward/backward seconds, one expert's seconds per
    sample forward and backward, one expert's parameter bytes and saved bytes per sample, and
    the bytes of one sample's hidden tensor."""
    i, layer, zoo = _moe_layer(profile)
    fwd, bwd = profile.layer_times_s(batch)
    gate_share = min(1.0, gate_flops_per_sample(zoo.hidden_dim, zoo.grid_size) / layer.forward_flops_per_sample) \
        if layer.forward_flops_per_sample > 0 else 0.0
    routed = batch * zoo.k_best  # the local layer runs k_best experts per sample
    gate_bytes = gate_param_bytes(zoo.hidden_dim, zoo.grid_size)
    return {"layer_forward_s": fwd[i], "layer_backward_s": bwd[i], "gate_share": gate_share,
            "expert_forward_s_per_sample": fwd[i] * (1 - gate_share) / routed,
            "expert_backward_s_per_sample": bwd[i] * (1 - gate_share) / routed,
            "expert_param_bytes": max(0, layer.param_bytes - gate_bytes) / zoo.num_experts,
            "expert_saved_bytes_per_sample": layer.saved_bytes_per_sample * (1 - gate_share) / zoo.k_best,
            "hidden_bytes_per_sample": float(layer.output_bytes_per_sample),
            "layer_param_bytes": float(layer.param_bytes), "layer_buffer_bytes": float(layer.buffer_bytes),
            "layer_saved_bytes_per_sample": float(layer.saved_bytes_per_sample)}


def _link(cluster: "ClusterSpec", workers: int) -> "LinkSpec":
    """The link between a trainer and the servers: the slowest of the first ``workers`` listed
    peers' links, else the cluster's inter-node link when it has several nodes, else its intra-node link."""
    from ddlscope.modeling.cluster import LinkSpec

    if cluster.peers:
        peers = cluster.peers[:workers]
        return LinkSpec(bandwidth_gb_per_s=min(p.bandwidth_gb_per_s for p in peers),
                        latency_s=max(p.latency_s for p in peers))
    return cluster.inter_node if cluster.nodes > 1 and cluster.inter_node is not None else cluster.intra_node


@dataclass(frozen=True)
class CorePlacement:
    """Where a remote setting's trainers and expert servers run on the first node of a cluster of
    kind ``local`` (this machine's cores), as the launcher places them: trainer ``i`` on device
    ``i`` of the node-major order (``threads`` cores each, ``ddlscope.config.RunConfig.core_sets``),
    every server on this node, taking ``vcpus_per_server`` cores first from the cores no trainer
    uses, then round-robin over all of them (``ddlscope.launch.local.service_core_sets``).

    Attributes:
        cores: cores of the node (``devices_per_node x threads``).
        trainer_cores: per trainer on this node, its cores.
        server_cores: per server, its cores.
        shared: True when some server shares a core with a trainer.
    """

    cores: int
    trainer_cores: tuple[tuple[int, ...], ...]
    server_cores: tuple[tuple[int, ...], ...]
    shared: bool

    def loads(self, trainer_cpu_s: float, server_cpu_s: list[float]) -> list[float]:
        """CPU seconds each core runs while every trainer takes one step: a trainer's
        ``trainer_cpu_s`` and each server's ``server_cpu_s[s]`` spread evenly over their cores."""
        load = [0.0] * self.cores
        for cores in self.trainer_cores:
            for core in cores:
                load[core] += trainer_cpu_s / len(cores)
        for cores, cpu in zip(self.server_cores, server_cpu_s):
            for core in cores:
                load[core] += cpu / len(cores)
        return load

    def contended_step_s(self, critical_s: float, trainer_cpu_s: float, server_cpu_s: list[float],
                         trainers: int, wire_s: float = 0.0) -> float:
        """A trainer's step when its critical path ``L = critical_s`` (alone) meets the other
        processes' CPU on the cores it runs on (mean value analysis, Reiser & Lavenberg 1980: a
        job's time at a processor-sharing station is its demand times one plus the others found
        there, Lazowska et al. 1984 ch. 6, with the others' presence taken as their utilization).

        The trainer's own CPU per step on core ``c``, ``w_c`` (its own work on its cores, and
        ``1 / T`` of each server's on the server's), tells where the path's ``P = L - W`` seconds
        off the wire run (``W = wire_s``, seconds of ``L`` spent waiting for a link, which no core
        stretches): a share ``w_c / sum(w)`` of ``P``, stretched there by the others' utilization
        ``u_c = (load_c - w_c) / R``: ``R = W + P (1 + sum_c w_c u_c / sum(w))``, so
        ``R = (L + sqrt(L^2 + 4 P A)) / 2`` with ``A = sum_c w_c (load_c - w_c) / sum(w)``.
        Trainers on this node are taken alike (trainer 0's cores); the result is the harmonic
        mean over all ``trainers`` (those on other nodes take ``L``: they share no core with a
        server), as independent trainers' samples per second add up.
        """
        if critical_s <= 0 or not self.trainer_cores:
            return critical_s
        load = self.loads(trainer_cpu_s, server_cpu_s)
        mine = [0.0] * self.cores
        for core in self.trainer_cores[0]:
            mine[core] += trainer_cpu_s / len(self.trainer_cores[0])
        for cores, cpu in zip(self.server_cores, server_cpu_s):
            for core in cores:
                mine[core] += cpu / len(cores) / trainers
        total = sum(mine)
        if total <= 0:
            return critical_s
        a = sum(w * max(0.0, load_c - w) for w, load_c in zip(mine, load)) / total
        off_wire = max(0.0, critical_s - wire_s)
        here = (critical_s + math.sqrt(critical_s ** 2 + 4 * off_wire * a)) / 2
        on_node = len(self.trainer_cores)
        return trainers / (on_node / here + (trainers - on_node) / critical_s)


def core_placement(cluster: "ClusterSpec", threads: int, trainers: int, d: DMoEConfig) -> CorePlacement:
    """The :class:`CorePlacement` of ``trainers`` trainers of ``threads`` cores each and ``d.servers``
    servers on the first node of ``cluster`` (trainers beyond the cluster's devices wrap around,
    as if each device ran several)."""
    devices = cluster.nodes * cluster.devices_per_node
    cores = cluster.devices_per_node * threads
    trainer_cores = tuple(tuple(range((i % devices) * threads, (i % devices + 1) * threads))
                          for i in range(trainers) if i % devices < cluster.devices_per_node)
    used = {core for cs in trainer_cores for core in cs}
    order = [core for core in range(cores) if core not in used] + [core for core in range(cores) if core in used]
    server_cores, at = [], 0
    for _ in range(d.servers):
        take = [order[(at + j) % len(order)] for j in range(min(d.vcpus_per_server, len(order)))]
        at += len(take)
        server_cores.append(tuple(sorted(set(take))))
    shared = any(core in used for cs in server_cores for core in cs)
    return CorePlacement(cores=cores, trainer_cores=trainer_cores, server_cores=tuple(server_cores), shared=shared)


def predict_dmoe(profile: "WorkloadProfile", cluster: "ClusterSpec", setting: "Setting",
                 scale: float = 1.0) -> "Prediction":
    """Seconds per step of one dmoe trainer (Ryabinin & Gusev 2020; hivemind 1.1.12 ``hivemind.moe``).

    ``placement = "local"`` or ``"dense"``: no servers, no network; each of the ``T`` trainers is a
    plain single process training the profiled network, so the step is ``single``'s
    (:func:`~ddlscope.distribution.single.predict_single`) with its compute slowed by the
    contention of ``T`` busy devices; ``T x b`` samples per step. (The profile is of the zoo's
    ``local`` network; ``dense`` applies one expert instead of ``k_best`` and no gate, which a note
    says.)

    ``placement = "remote"``, a trainer at batch ``b`` with ``k = k_best`` (notation: ``L`` the
    profile's mixture layer, ``g`` the gate's share of its FLOPs, ``2 hidden sum(grid)`` over the
    layer's, ``k0`` the profiled network's ``k_best``; times at ``b`` from
    :meth:`~ddlscope.modeling.profile.WorkloadProfile.layer_times_s`):

    * trunk compute: ``forward_s = F(b) - L_f(b) + g L_f(b) x sum(grid) / sum(grid0)`` (the whole
      step's forward without the local experts, with the setting's gate), ``backward_s`` likewise;
    * one expert's seconds per sample: ``e_f = (1 - g) L_f(b) / (b k0)``, ``e_b = (1 - g) L_b(b) / (b k0)``
      (the profiled layer ran ``k0`` experts per sample; the gate's other work, top-k and the
      weighted sum, is counted as the experts', a small error for these networks);
    * beam search (``MoEBeamSearcher.batch_find_best_experts``): ``fit.beam_search_s(b, dims)`` =
      ``fixed + b x max(1, dims - 1) x lookup`` (one DHT look-up round per grid dimension but the
      last, every sample's search its own coroutine);
    * remote forward: ``C = b k`` calls (``_RemoteCallMany``: one RPC per sample per chosen
      expert) of ``2 h`` bytes (input and output, ``h`` the mixture layer's output bytes per
      sample); the trainer waits ``max(client, server)`` where ``client = fit.round_s("forward", C,
      2h)`` (measured on these machines) and ``server`` is the busiest server's work per step: the
      ``T`` trainers send it ``n = T b k x E_s / E`` samples (``E_s`` of the grid's ``E`` experts on
      it, the gate spreading samples evenly), which take ``n e_f`` of compute plus hivemind's own
      CPU, ``fit.cpu_s("server", "forward", n, 2h, B)``: a cost per call and one per batch, ``B =
      T E_s x (1 - (1 - k / E)^b)`` batches (each expert's task pool batches what one trainer's
      round sends it: an expert gets a sample of a round with probability ``1 - (1 - k/E)^b``);
    * remote backward: the same with ``3 h`` bytes (input and output gradient out, input gradient
      back), ``e_f + e_b`` per sample on the server (``ModuleBackend.backward`` re-runs the forward)
      plus one optimizer step of each of its ``E_s`` experts per trainer (``on_backward`` after
      every batch, one batch per expert per trainer's burst): ``T E_s x o_e``, ``o_e`` the profiled
      optimizer step scaled to one expert's parameters;
    * optimizer: the profiled step scaled to the trainer's parameters (trunk and gate);
    * data loading as ``single`` (what prefetching does not hide).

    Parts: ``forward_s``, ``backward_s``, ``optimizer_s`` (trunk compute, times the compute scale
    and the contention of the busy devices, :func:`~ddlscope.modeling.collectives.contention`),
    ``data_load_s``, and ``comm_wait_s`` = beam search + remote forward + remote backward (what
    the strategy stores there). Their sum is the trainer's critical path ``L``. On a cluster whose
    device is another kind than ``local``, or that lists its peers' links (an emulated network's),
    the calls also cross that link: ``2 x latency + max(C, N) x bytes / bandwidth`` per round, ``C``
    the trainer's own calls and ``N`` those the busiest server gets from all trainers on its link,
    ``bytes`` the payload of both directions (``2 h``, ``3 h``). That time waits for the link,
    not a core, so the stretch below leaves it out. Measured on links of 50, 10 and 5 Mbit/s
    (``moe-links``-style grid, 3 runs each, 2026-11-28): the median step was 50 ms longer at 5
    than at 50 Mbit/s; predicted 56 ms longer, 72 ms when the wire was stretched with the cores,
    and 33 ms when each round's directions were taken to overlap (the busier direction's bytes,
    ``h`` and ``2 h``). hivemind's framing of each call and the DHT's traffic are not counted
    separately (over a run, the trainers' links carried 2.3x the payload they sent, 3.1-3.4x what
    they received). Without a fit (:attr:`~ddlscope.modeling.cluster.ClusterSpec.dmoe`,
    ``calibrate --dmoe``) the client side is that link term alone and a beam search ``rounds x 2 x
    latency``, with a note.

    Trainers and servers share this machine's cores when the device is the profiled CPU (cluster
    kind ``local``, :func:`~ddlscope.modeling.collectives.serial_comm`). Every process's CPU per
    step of every trainer is placed on the cores as the launcher places the processes
    (:class:`CorePlacement`, :func:`core_placement`): a trainer's own, ``threads x`` its compute
    parts plus its beam search plus ``fit.cpu_s("client", ...)`` for its two rounds (one round
    each: a cost per round and per call), on its cores; each server's, its experts' compute plus
    hivemind's CPU for its share ``T b k x E_s / E`` of the calls in its batches, on its cores.
    Where a server shares a core with a trainer, hivemind's CPU (server and client) is multiplied
    by ``fit.colocated_cpu_ratio`` (measured with a second client on the server's core). The step
    is then the longest of

    * ``L``;
    * the busiest core's CPU seconds (every trainer takes a step in that time at best);
    * ``L`` stretched by the other processes' CPU on the cores the trainer's path runs on
      (:meth:`CorePlacement.contended_step_s`, mean value analysis with the others present as
      much as they are busy; the wire time on the path, ``W``, waits for the link, not a core);

    and when it is longer than ``L`` every part but ``W`` is stretched by the same factor (a note says so).
    On this 2-core machine (2 trainers and 2 servers of ``moe_cnn``, batch 16, ``k_best`` 2) the
    critical path, the busiest core and the stretched path were 89, 108 and 124 ms against 124 ms
    measured in steady state.

    Not modelled: the gate's routing (samples are taken as spread evenly over the experts; a
    trained gate may send most of them to the experts of one server, e.g. 70 % to one of two
    servers, which makes that server's core the bottleneck), timeouts and failed calls (a dead
    server's calls wait ``forward_timeout_s``; a note says so when the setting has server events),
    batches capped at ``max_batch_size`` (one batch per expert per round is assumed), several
    servers on one core paying more per call than the calibration's one (their processes take
    turns), and the first steps' cold DHT look-ups and garbage collections (a measurement leaves
    out :data:`STARTUP_CALLS`).

    Raises:
        UserError: bad ``[dmoe]`` options or a profile without the zoo's mixture layer (:func:`check_setting`).
    """
    from ddlscope.distribution.single import predict_single
    from ddlscope.modeling.collectives import busy_per_node, contention, exposed_loading_s, serial_comm
    from ddlscope.modeling.cluster import beam_search_rounds
    from ddlscope.modeling.prediction import make_prediction

    check_setting(profile, setting)
    d = options_of(setting, profile)
    t, b = setting.workers, setting.batch_size
    on_cpu = serial_comm(profile, cluster)
    notes: list[str] = []
    if d.placement != "remote":
        slow = contention(cluster, busy_per_node(cluster, t))
        alone = predict_single(profile, cluster, setting, scale * slow)
        if d.placement == "dense":
            notes.append("dmoe dense: predicted from the profile of the zoo's local mixture (k_best experts per "
                         "sample and a gate); the dense network applies one expert, so this overestimates its layer")
        return make_prediction(setting, dict(alone.breakdown_s), t * b,
                               inputs={**alone.inputs, "placement": d.placement, "trainers": t, "contention": slow},
                               notes=notes)

    _, layer, zoo = _moe_layer(profile)
    ex = _expert_figures(profile, b)
    step = profile.step_at(b)
    k, dims = d.k_best, len(d.grid_size)
    gate_ratio = sum(d.grid_size) / sum(zoo.grid_size)
    gate_f = ex["layer_forward_s"] * ex["gate_share"] * gate_ratio
    gate_b = ex["layer_backward_s"] * ex["gate_share"] * gate_ratio
    trunk_f = max(0.0, step.forward_s - ex["layer_forward_s"]) + gate_f
    trunk_b = max(0.0, step.backward_s - ex["layer_backward_s"]) + gate_b
    trainer_params = profile.param_bytes - layer.param_bytes + gate_param_bytes(d.hidden_dim, d.grid_size)
    opt_trainer = step.optimizer_s * trainer_params / profile.param_bytes if profile.param_bytes else 0.0
    opt_expert = step.optimizer_s * ex["expert_param_bytes"] / profile.param_bytes if profile.param_bytes else 0.0

    servers = d.servers
    busy = t + servers if on_cpu else t
    slow = contention(cluster, busy_per_node(cluster, busy))
    c = scale * slow  # compute factor, trainers and servers alike
    calls = b * k
    hbytes = ex["hidden_bytes_per_sample"]
    fwd_bytes, bwd_bytes = 2 * hbytes, 3 * hbytes  # payload per call, both ways together
    share, hosted = _busiest_share(d)
    n_busiest = t * calls * share  # samples (calls) the busiest server gets per trainer step
    fit = cluster.dmoe
    link = _link(cluster, t)
    rounds = beam_search_rounds(dims)
    threads = profile.device.threads
    placement = core_placement(cluster, threads, t, d) if on_cpu else None
    colocated = placement is not None and placement.shared
    ratio = fit.colocated_cpu_ratio if fit is not None and colocated else 1.0
    wire_f = wire_b = 0.0
    if fit is None or cluster.device.kind != "local" or cluster.peers:
        # the calls cross the cluster's link (loopback is in the fit; listed peers' links, e.g. an emulated
        # network's, are not): the trainer's own calls, or all trainers' calls to the busiest server on its link
        carried = max(calls, n_busiest)
        wire_f = 2 * link.latency_s + carried * fwd_bytes / (link.bandwidth_gb_per_s * 1e9)
        wire_b = 2 * link.latency_s + carried * bwd_bytes / (link.bandwidth_gb_per_s * 1e9)

    def server_hm_cpu(n_calls: float, n_batches: float) -> tuple[float, float]:
        """hivemind's own CPU seconds (forward, backward) on a server for ``n_calls`` calls in ``n_batches`` batches."""
        if fit is None:
            return 0.0, 0.0
        return (ratio * fit.cpu_s("server", "forward", n_calls, fwd_bytes, n_batches),
                ratio * fit.cpu_s("server", "backward", n_calls, bwd_bytes, n_batches))

    reached = 1 - (1 - k / d.num_experts) ** b  # chance that one trainer's round sends a given expert a sample
    if fit is not None:
        beam = fit.beam_search_s(b, dims) + (rounds * 2 * link.latency_s if cluster.device.kind != "local" else 0.0)
        client_f = fit.round_s("forward", calls, fwd_bytes) + wire_f
        client_b = fit.round_s("backward", calls, bwd_bytes) + wire_b
        client_cpu = ratio * (fit.cpu_s("client", "forward", calls, fwd_bytes, 1)
                              + fit.cpu_s("client", "backward", calls, bwd_bytes, 1))
    else:
        beam = rounds * 2 * link.latency_s
        client_f, client_b = wire_f, wire_b
        client_cpu = 0.0
        notes.append(WITHOUT_FIT_NOTE)
    hm_server_f, hm_server_b = server_hm_cpu(n_busiest, t * hosted * reached)
    server_f = n_busiest * ex["expert_forward_s_per_sample"] * c + hm_server_f
    server_b = (n_busiest * (ex["expert_forward_s_per_sample"] + ex["expert_backward_s_per_sample"])
                + t * hosted * opt_expert) * c + hm_server_b
    remote_f, remote_b = max(client_f, server_f), max(client_b, server_b)
    # the part of the remote rounds that only waits for the link (not stretched by busy cores)
    wire_s = remote_f - max(client_f - wire_f, server_f) + remote_b - max(client_b - wire_b, server_b)

    parts = {"forward_s": trunk_f * c, "backward_s": trunk_b * c, "optimizer_s": opt_trainer * c,
             "comm_wait_s": beam + remote_f + remote_b}
    parts["data_load_s"] = exposed_loading_s(profile, b, setting.loader_workers,
                                             parts["forward_s"] + parts["backward_s"] + parts["optimizer_s"])
    critical = sum(parts.values())
    stretch, busiest_core_s, waited_s, trainer_cpu = 1.0, 0.0, 0.0, 0.0
    server_cpu: list[float] = []
    if placement is not None:  # trainers and servers take turns on this machine's cores
        trainer_cpu = (parts["forward_s"] + parts["backward_s"] + parts["optimizer_s"] + parts["data_load_s"]) \
            * threads + beam + client_cpu
        for s_index in range(servers):
            s_share = len(d.server_uids(s_index)) / d.num_experts
            s_calls = t * calls * s_share
            f_cpu, b_cpu = server_hm_cpu(s_calls, t * len(d.server_uids(s_index)) * reached)
            server_cpu.append(f_cpu + b_cpu + (s_calls * (2 * ex["expert_forward_s_per_sample"]
                                                          + ex["expert_backward_s_per_sample"])
                                               + t * len(d.server_uids(s_index)) * opt_expert) * c * threads)
        loads = placement.loads(trainer_cpu, server_cpu)
        busiest_core_s = max(loads)
        waited_s = placement.contended_step_s(critical, trainer_cpu, server_cpu, t, wire_s)
        bound = max(busiest_core_s, waited_s)
        if critical > wire_s and bound > critical:
            stretch = (bound - wire_s) / (critical - wire_s)
            parts = {p: v * stretch for p, v in parts.items()}
            parts["comm_wait_s"] -= wire_s * (stretch - 1)  # the wire time as it was
            why = (f"the busiest core runs {busiest_core_s * 1e3:.3g} ms of CPU per step of every trainer"
                   if busiest_core_s >= waited_s else
                   f"a trainer's critical path shares its cores with the other processes' CPU "
                   f"({waited_s * 1e3:.3g} ms)")
            notes.append(f"dmoe: {t} trainer(s) and {servers} server(s) on {placement.cores} core(s): {why}; every "
                         f"part stretched x{stretch:.2f}" + (f" but the {wire_s * 1e3:.3g} ms on the wire" if wire_s else ""))
    if d.server_events:
        notes.append("dmoe: server events (late starts, kills) are not modelled: calls to a missing server wait up to "
                     "forward_timeout_s / backward_timeout_s, and its experts' samples go to fewer servers")
    if d.vcpus_per_server != profile.device.threads:
        notes.append(f"dmoe: servers have {d.vcpus_per_server} core(s), the profile measured the experts at "
                     f"{profile.device.threads} thread(s): their compute is taken as profiled")
    memory = server_memory_bytes(profile, setting)
    return make_prediction(
        setting, parts, t * b, notes=notes,
        inputs={"placement": "remote", "trainers": t, "servers": servers, "k_best": k, "grid_dims": dims,
                "beam_search_rounds": rounds, "calls_per_step": calls, "forward_bytes_per_call": fwd_bytes,
                "backward_bytes_per_call": bwd_bytes, "busiest_server_share": share,
                "busiest_server_experts": hosted, "busiest_server_samples_per_step": n_busiest,
                "beam_search_s": beam, "client_forward_s": client_f, "client_backward_s": client_b,
                "server_forward_s": server_f, "server_backward_s": server_b, "remote_forward_s": remote_f,
                "remote_backward_s": remote_b, "wire_s": wire_s, "gate_share": ex["gate_share"],
                "expert_forward_s_per_sample": ex["expert_forward_s_per_sample"],
                "expert_backward_s_per_sample": ex["expert_backward_s_per_sample"],
                "expert_optimizer_s": opt_expert, "trainer_param_bytes": trainer_params,
                "expert_param_bytes": ex["expert_param_bytes"], "server_memory_bytes": memory,
                "dmoe_fit": fit is not None, "trainer_cpu_s": trainer_cpu, "server_cpu_s": server_cpu,
                "cpu_s_per_step": t * trainer_cpu + sum(server_cpu), "busiest_core_s": busiest_core_s,
                "contended_step_s": waited_s,
                "cores": placement.cores if placement else 0, "colocated": colocated, "colocated_cpu_ratio": ratio,
                "core_stretch": stretch, "contention": slow, "compute_scale": scale})


def server_memory_bytes(profile: "WorkloadProfile", setting: "Setting") -> int:
    """Peak memory (bytes) of the busiest expert server of a remote setting, from the profile.

    ``E_s x p_e x (2 + O / P)`` (each hosted expert's parameters, gradients and optimizer state,
    ``p_e`` one expert's parameter bytes, the optimizer's state in the profile's proportion) plus
    one batch's activations, ``min(max_batch_size, T b k / E) x s_e`` (hivemind's Runtime runs one
    batch at a time; ``s_e`` one expert's saved bytes per sample, from the profiled mixture layer,
    twice: the backward re-runs the forward), plus the input and output of that batch (``2 h``
    per sample), plus the runtime of a worker that imports hivemind ``R``
    (:func:`~ddlscope.modeling.memory.hivemind_runtime_bytes`; hivemind's task pools, connection
    handler, DHT and ``p2pd`` are processes of their own and not counted).
    0 for placements other than ``remote``.

    Raises:
        UserError: as :func:`check_setting`.
    """
    from ddlscope.modeling.memory import hivemind_runtime_bytes

    check_setting(profile, setting)
    d = options_of(setting, profile)
    if d.placement != "remote":
        return 0
    ex = _expert_figures(profile, setting.batch_size)
    _, hosted = _busiest_share(d)
    state = profile.optimizer_state_bytes / profile.param_bytes if profile.param_bytes else 0.0
    per_expert_batch = min(d.max_batch_size, setting.workers * setting.batch_size * d.k_best / d.num_experts)
    activations = per_expert_batch * (2 * ex["expert_saved_bytes_per_sample"] + 2 * ex["hidden_bytes_per_sample"])
    return int(hosted * ex["expert_param_bytes"] * (2 + state) + activations + hivemind_runtime_bytes(profile))


def memory_dmoe(profile: "WorkloadProfile", setting: "Setting") -> list["MemoryEstimate"]:
    """Peak memory of every trainer (bytes), from the profile (notation of :mod:`ddlscope.modeling.memory`).

    ``placement = "local"`` or ``"dense"``: ``single``'s full replica on every trainer
    (:func:`~ddlscope.modeling.memory.replicas`). ``remote``: the trainer holds the trunk and the
    gate, ``P_t = P - p_L + p_gate`` (``p_L`` the profiled mixture layer's parameters, the gate
    ``Linear(hidden, sum(grid))`` of the setting): ``params = P_t + Bf - bf_L``, ``grads = P_t``,
    ``optimizer = O x P_t / P``; ``activations = A(b) - b s_L + b (k + 1) h`` (the experts' saved
    activations live on the servers; ``_RemoteCallMany`` keeps the layer's input, ``b h``, and the
    weighted sum keeps the ``b k`` expert outputs, ``h`` bytes each); ``comm_buffers = 3 b k h``
    (the serialized requests and answers of a backward round in flight, the largest round); the
    runtime is that of a worker that imports hivemind. hivemind's DHT process and ``p2pd`` are
    processes of their own and not counted. The busiest server's memory
    (:func:`server_memory_bytes`) is in the notes: servers are not trainers.

    Raises:
        UserError: as :func:`check_setting`.
    """
    from ddlscope.modeling.memory import MemoryEstimate, activation_bytes, hivemind_runtime_bytes, replicas

    check_setting(profile, setting)
    d = options_of(setting, profile)
    if d.placement != "remote":
        return replicas(profile, setting, 0, f"full replica (dmoe placement {d.placement}: no servers)")
    _, layer, _ = _moe_layer(profile)
    b, k = setting.batch_size, d.k_best
    h = layer.output_bytes_per_sample
    trunk = profile.param_bytes - layer.param_bytes + gate_param_bytes(d.hidden_dim, d.grid_size)
    state = profile.optimizer_state_bytes * trunk / profile.param_bytes if profile.param_bytes else 0
    acts = max(0, activation_bytes(profile, b) - b * layer.saved_bytes_per_sample + b * (k + 1) * h)
    server = server_memory_bytes(profile, setting)
    note = (f"trunk + gate replica (experts on {d.servers} server(s)); the busiest server needs about "
            f"{server / 2**20:.1f} MiB")
    return [MemoryEstimate(worker=w, params_bytes=trunk + max(0, profile.buffer_bytes - layer.buffer_bytes),
                           grads_bytes=trunk, optimizer_bytes=int(state), activations_bytes=int(acts),
                           comm_buffers_bytes=int(3 * b * k * h), runtime_bytes=hivemind_runtime_bytes(profile),
                           notes=note)
            for w in range(setting.workers)]


STARTUP_CALLS = 1500
"""Remote calls per trainer a measurement of a remote run excludes besides its warm-up: Python's
first full (generation 2) garbage collections in the servers' and trainers' processes, whose
heaps hold torch's and hivemind's import-time objects, take 100-530 ms each (measured with
``gc.callbacks`` in 2-trainer, 2-server runs of ``moe_cnn`` on this 2-core machine) and fall into
about the first 1,000-1,500 calls of each trainer, with the cores partly idle meanwhile: those
steps took 20-60 % longer than the later ones on average, single steps 0.3-0.45 s. A long run
pays them once (an epoch of MNIST at 2 x 16 samples per step is 1,875 steps)."""

MEASURED_STEPS = 40
"""Steps per trainer a measurement of a remote run needs: its steps vary by +-20 % from second to
second (the gate's routing, which server a round waits for)."""


def _startup_steps(batch_size: int, workers: int, options: Mapping[str, Any]) -> int:
    """Steps of :data:`STARTUP_CALLS` remote calls (``batch_size x k_best`` per step); 0 unless
    ``placement = "remote"`` (no hivemind processes otherwise)."""
    fields = DMoEConfig.model_fields
    if options.get("placement", fields["placement"].default) != "remote":
        return 0
    return math.ceil(STARTUP_CALLS / (batch_size * int(options.get("k_best", fields["k_best"].default))))


ESTIMATE_FACTOR = 0.1719 / (0.83 / 2)
"""A remote trainer step over ResNet-18's at the same batch, for rough run-time estimates
(:mod:`ddlscope.experiments.estimate`): 171.9 ms per step of 16 samples with 2 trainers and 2
servers on the 2-core development machine (``examples/dmoe-server-killed.toml``) against 415 ms.
Cells with in-process experts (``placement = "local"`` / ``"dense"``, about 9 ms) are over-estimated."""

def _network_problem(network: str, family: str) -> str | None:
    """Why dmoe cannot train zoo network ``network`` on a dataset of ``family`` (None: it can, or it
    is a user factory, which only building it can tell): :func:`ddlscope.moe.networks.network_family_ok`."""
    from ddlscope.moe.networks import network_family_ok

    return None if ":" in network else network_family_ok(network, family)


MODEL = register(DistributionModel(
    name="dmoe",
    summary="a mixture-of-experts layer whose experts live on expert servers found through a DHT (Ryabinin 2020)",
    strategy="dmoe:DMoEStrategy",
    launcher="swarm",
    measures="beam-search look-ups, remote expert calls (latency, bytes, server, failures), server batches and queues",
    predicts="trunk compute + beam search + remote expert calls (hivemind's measured per-call cost, calibrate --dmoe) "
             "or the busiest server's compute, whichever is longer (Ryabinin & Gusev 2020); on shared cores at "
             "least the busiest core's CPU and the path stretched by the other processes' CPU",
    order=70,
    min_workers=1,
    config_table="dmoe",
    config_class=DMoEConfig,
    check_config=check_dmoe,
    check_setting=check_setting,
    network_problem=_network_problem,
    lockstep=False,  # trainers step on their own; they share only the experts
    calibrations=("dmoe",),
    estimate_factor=ESTIMATE_FACTOR,
    startup_steps=_startup_steps,
    measured_steps=MEASURED_STEPS,
    cost_model=predict_dmoe,
    memory_model=memory_dmoe,
    services=expert_servers,
    uses_cluster_devices=False,
))
