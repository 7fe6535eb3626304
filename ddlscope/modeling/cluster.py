"""The cluster a prediction is for: nodes, devices, links, and (collaborative) peers.

Written by hand as TOML (see ``examples/cluster-*.toml``) or measured by ``ddlscope calibrate``.
Units are in the field names: seconds, GB/s (1e9 bytes/s), GiB.

- :func:`load_cluster` reads a file (errors name the field path, e.g.
  ``cluster.intra_node.bandwidth_gb_per_s: field required``); :func:`parse_cluster` validates a
  ``[cluster]`` table already in memory; :func:`write_cluster` writes one atomically.
- Device kinds and their datasheet figures: :mod:`ddlscope.modeling.devices`.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from ddlscope.errors import UserError
from ddlscope.modeling.progress import check_whole_epochs

GIB = 1024**3

# sane ranges of a cluster description: beyond them a prediction means nothing (or overflows)
MAX_NODES = 100_000
MAX_DEVICES_PER_NODE = 4096
MAX_LATENCY_S = 60.0
MAX_MEMORY_GIB = 1e6


class LinkSpec(BaseModel):
    """A link between two workers: time to send B bytes = ``latency_s + B / (bandwidth_gb_per_s * 1e9)``."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # finite numbers only

    bandwidth_gb_per_s: float = Field(gt=0, description="1e9 bytes per second")
    latency_s: float = Field(ge=0, le=MAX_LATENCY_S)
    burst_bytes: float = Field(0.0, ge=0, le=1e12, description=(
        "a token bucket's depth: bytes a link idle long enough lets through at once (emulated links, tc tbf, "
        "have one; a real link has none). The pipelines' simulation takes it into account"))

    def transfer_s(self, nbytes: float) -> float:
        """Seconds to send ``nbytes`` bytes over this link (Hockney's alpha-beta model)."""
        return self.latency_s + nbytes / (self.bandwidth_gb_per_s * 1e9)

    @property
    def burst_s(self) -> float:
        """:attr:`burst_bytes` in seconds of wire time at the link's rate."""
        return self.burst_bytes / (self.bandwidth_gb_per_s * 1e9)


class DeviceSpec(BaseModel):
    """One device (a GPU, or on CPU clusters a set of cores). ``kind`` must be a known kind
    (:data:`ddlscope.modeling.devices.DEVICE_KINDS`); ``local`` is the device the profile ran on."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # finite numbers only

    kind: str
    memory_gib: float | None = Field(None, gt=0, le=MAX_MEMORY_GIB, description="capacity per device; default: the kind's")

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, kind: str) -> str:
        from ddlscope.modeling.devices import DEVICE_KINDS, known_kinds

        if kind not in DEVICE_KINDS:
            raise ValueError(f"unknown device kind {kind!r}; allowed: {known_kinds()}")
        return kind

    def memory_bytes(self, profile_device_memory_bytes: int) -> int:
        """Capacity of one device in bytes: ``memory_gib`` if given, else the kind's datasheet
        capacity, else (kind ``local``) the profiled device's ``profile_device_memory_bytes``."""
        from ddlscope.modeling.devices import DEVICE_KINDS

        if self.memory_gib is not None:
            return int(self.memory_gib * GIB)
        default_gib = DEVICE_KINDS[self.kind].memory_gib
        return int(default_gib * GIB) if default_gib is not None else int(profile_device_memory_bytes)


class PeerSpec(BaseModel):
    """A collaborative peer: its compute in profiled devices and its network link."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # finite numbers only

    compute_share: float = Field(ge=1e-6, le=1e6, description="throughput relative to the profiled device (1 = same device)")
    bandwidth_gb_per_s: float = Field(gt=0)
    latency_s: float = Field(0.0, ge=0, le=MAX_LATENCY_S)
    memory_gib: float | None = Field(None, gt=0, le=MAX_MEMORY_GIB)


class CollectiveFit(BaseModel):
    """Measured cost of one all-gather or reduce-scatter among the cluster's devices, as a ring:
    ``t = fixed_s + (W-1) * latency + (W-1)/W * full_bytes / (bandwidth_gb_per_s * 1e9)``.

    Written by ``ddlscope calibrate``; backends implement these collectives differently from
    all-reduce (gloo's are far slower per byte on CPU), so they get their own fit.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # finite numbers only

    fixed_s: float = Field(ge=0)
    bandwidth_gb_per_s: float = Field(gt=0)


class HivemindFit(BaseModel):
    """What hivemind's own machinery adds on these peers, measured by training a reference network
    in a short local swarm (``ddlscope calibrate --hivemind``, :mod:`ddlscope.profiling.swarm`).

    Attributes:
        epoch_overhead_s, overhead_steps: a peer's global epoch lasts ``epoch_overhead_s +
            overhead_steps x step`` seconds beyond its steps' compute, for peers whose compute step
            takes ``step`` seconds (hivemind's DHT, ``p2pd``, averagers and progress tracker on the
            peer's cores, the rounds, and the wait for the other peers' current step).
        compute_overhead_s: of that overhead, the seconds per global epoch that landed in the
            steps' compute (hivemind's background work taking the peer's cores while it trains;
            the rest is the rounds and the waits). 0: a file from before it was measured.
        overshoot_steps: extra steps per peer per global epoch beyond the target batch, the mean
            over the reference swarms.
        overshoot_points: ``(compute step s, overshoot steps)`` of each reference swarm, by step;
            :meth:`overshoot_at` reads them. Empty: a file from before they were kept.
        step_pattern_s: ``(mean, standard deviation)`` seconds by position in the epoch (the first
            step after the round, the second, later ones) of what hivemind's work added to a
            step's compute in the reference swarms: the cost model runs hivemind's epoch-ending
            rule on steps made so (:mod:`ddlscope.modeling.progress`), which gives the overshoot
            at any steps per peer. Empty: a file from before it was kept (the overshoot is then
            :meth:`overshoot_at`).
        step_epochs_s: the same seconds kept per global epoch of the reference swarms, per peer
            (rank order), its steps in order: ``[[[s0, s1], [s0, s1, s2]], ...]``. The rule runs
            on these epochs drawn whole where they are kept, since an epoch's peers are not
            independent (:class:`ddlscope.modeling.progress.EpochDraws`). Empty: a file from
            before they were kept (the rule then runs on ``step_pattern_s``).
        epoch_cpu_s: CPU seconds hivemind's processes and threads used per epoch (for the record).
        reference: what was trained; reference_param_bytes: its parameter bytes;
            reference_network: the zoo network trained (``None``: a file from before it was kept).
        matchmaking_time_s: the swarm's hivemind ``matchmaking_time`` (seconds). Overhead and
            overshoot depend on it (:mod:`ddlscope.profiling.swarm`); a prediction at another
            matchmaking time says so in its notes. ``None``: a file from before it was recorded.
        peer_startup_s: seconds from starting a peer's process to its first step, beyond loading
            the swarm's state: a fresh interpreter importing torch, hivemind and ddlscope's worker and
            building a network and its first optimizer (:data:`ddlscope.profiling.swarm.PEER_PROCESS`),
            joining the DHT and making the ``hivemind.Optimizer``
            (:func:`ddlscope.profiling.swarm.fit_peer_startup`);
            what a joining or rejoining peer takes before it trains. ``None``: not measured.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # finite numbers only

    epoch_overhead_s: float = Field(ge=0)
    overhead_steps: float = Field(0.0, ge=0)
    compute_overhead_s: float = Field(0.0, ge=0)
    overshoot_steps: float = Field(0.0, ge=0)
    overshoot_points: list[tuple[float, float]] = Field(default_factory=list)
    step_pattern_s: list[tuple[float, float]] = Field(default_factory=list)
    step_epochs_s: list[list[list[float]]] = Field(default_factory=list)
    epoch_cpu_s: float = Field(0.0, ge=0)
    reference: str = ""
    reference_param_bytes: int = Field(0, ge=0)
    reference_network: str | None = None
    matchmaking_time_s: float | None = Field(None, gt=0)
    peer_startup_s: float | None = Field(None, ge=0)

    @field_validator("step_epochs_s")
    @classmethod
    def _whole_epochs(cls, v: list[list[list[float]]]) -> list[list[list[float]]]:
        check_whole_epochs(v)
        return v

    def overshoot_at(self, step_s: float) -> float:
        """Extra steps per peer per global epoch for peers whose compute step takes ``step_s``
        seconds: linear between the reference swarms' ``overshoot_points``, the nearest swarm's
        beyond them (measured: no trend in the step that carries over; resnet18 overshot 0.5 and
        0.6 steps at 0.86 and 0.22 s steps, mobilenet_v2 0.3 and 1.5 at 0.64 and 0.35 s, 2026-11-28),
        ``overshoot_steps`` without points."""
        if not self.overshoot_points:
            return self.overshoot_steps
        import numpy as np

        steps, overshoots = zip(*sorted(self.overshoot_points))
        return float(np.interp(step_s, steps, overshoots))  # linear between, the end values beyond


class DMoEFit(BaseModel):
    """What calling remote experts costs on these machines (hivemind 1.1.12 ``hivemind.moe``),
    measured by ``ddlscope calibrate --dmoe`` (:mod:`ddlscope.profiling.dmoe_rpc`).

    How it is measured: one hivemind expert ``Server`` in a child process pinned to one core (one
    intra-op thread, one connection handler, loopback) hosts a few experts that cost next to
    nothing to compute (``y = w x``, one scalar parameter), and declares further expert ids in its
    DHT; a trainer-like child process pinned to another core joins that DHT in client mode and
    times, in steady state (after a warm-up call of each configuration):

    * ``MoEBeamSearcher.batch_find_best_experts`` for grids of 1, 2 and 3 dimensions at several
      batch sizes: ``t = beam_search_fixed_s + B x rounds x beam_search_lookup_s``, where
      ``rounds = max(1, dimensions - 1)`` is the number of DHT look-up rounds of hivemind's beam
      search (the first dimension's prefixes, then one ``get_many`` per middle dimension;
      ``MoEBeamSearcher._find_best_experts``);
    * forward and backward rounds of ``_RemoteCallMany`` (what ``RemoteMixtureOfExperts`` sends:
      one RPC per sample per chosen expert) at batch sizes 4, 16, 64, ``k_best`` 1 and 2 and two
      payload sizes: per direction a least-squares fit
      ``t = fixed_s + C x (per_call_s + bytes_per_call / (gb_per_s x 1e9))`` over the rounds of
      ``C`` calls, ``bytes_per_call`` being the tensors a call moves (forward: input + output;
      backward: input + output gradient + input gradient);
    * the CPU seconds the server's processes (its own, its task pools', its connection handler,
      its DHT and ``p2pd``) and the client's processes (its own, its DHT and ``p2pd``) spent in
      the rounds (the scheduler's nanosecond counters of every thread), for the load on the
      servers' and trainers' cores: per side a non-negative least-squares fit on relative
      residuals ``cpu = units x unit_cpu_s[direction] + C x (cpu_per_call_s[direction] +
      bytes_per_call / (cpu_gb_per_s x 1e9))`` over both directions' rounds: a cost per batch on
      the server (``units`` = the experts the round reaches, each expert's task pool makes one
      batch of them: the pools, the Runtime and the wake-ups of hivemind's processes), per round on
      the client (autograd around the round, ``_RemoteCallMany``'s bookkeeping), and one per call;
    * ``colocated_cpu_ratio``: the CPU seconds per call of all the processes (server and
      clients) when a second client, pinned to the server's core, calls at the same time as the
      first (25 rounds of 16 samples x ``k_best`` 2, 64-byte samples, each), over the same
      rounds of the first client alone. This is what a run on shared cores pays: there a trainer
      shares each server's core and several trainers call it at once, so that hivemind's
      processes (``p2pd``, connection handler, task pools) are switched in and out more often.

    Units: seconds, GB/s (1e9 bytes/s). A ``gb_per_s`` of None: the payload size made no
    measurable difference (the per-call time alone fits).

    Attributes:
        beam_search_fixed_s / beam_search_lookup_s: see above.
        forward_fixed_s / forward_per_call_s / forward_gb_per_s: a forward round (see above).
        backward_fixed_s / backward_per_call_s / backward_gb_per_s: a backward round (the server
            re-runs the expert's forward, computes the gradients and steps its optimizer).
        server_forward_batch_cpu_s / server_backward_batch_cpu_s: the server's CPU seconds per
            batch (per expert a round reaches), beyond its calls (0: not measured, a cluster file
            from before).
        server_forward_cpu_s / server_backward_cpu_s / server_cpu_gb_per_s: the server's CPU
            seconds per call (the reference experts' compute is negligible) and the payload bytes
            per CPU second beyond them (None: no measurable payload term).
        client_forward_round_cpu_s / client_backward_round_cpu_s, client_forward_cpu_s /
            client_backward_cpu_s / client_cpu_gb_per_s: the same for the client, per round
            instead of per batch.
        colocated_cpu_ratio: see above (1: not measured, e.g. a calibration on one core, or a
            cluster file from before it was measured).
        max_abs_residual: the largest relative residual ``(fitted - measured) / measured`` of
            the round fits (for the record).
        reference: what was measured (experts, payloads, batches).
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # finite numbers only

    beam_search_fixed_s: float = Field(ge=0)
    beam_search_lookup_s: float = Field(ge=0)
    forward_fixed_s: float = Field(ge=0)
    forward_per_call_s: float = Field(ge=0)
    forward_gb_per_s: float | None = Field(None, gt=0)
    backward_fixed_s: float = Field(ge=0)
    backward_per_call_s: float = Field(ge=0)
    backward_gb_per_s: float | None = Field(None, gt=0)
    server_forward_batch_cpu_s: float = Field(0.0, ge=0)
    server_backward_batch_cpu_s: float = Field(0.0, ge=0)
    server_forward_cpu_s: float = Field(0.0, ge=0)
    server_backward_cpu_s: float = Field(0.0, ge=0)
    server_cpu_gb_per_s: float | None = Field(None, gt=0)
    client_forward_round_cpu_s: float = Field(0.0, ge=0)
    client_backward_round_cpu_s: float = Field(0.0, ge=0)
    client_forward_cpu_s: float = Field(0.0, ge=0)
    client_backward_cpu_s: float = Field(0.0, ge=0)
    client_cpu_gb_per_s: float | None = Field(None, gt=0)
    colocated_cpu_ratio: float = Field(1.0, gt=0)
    max_abs_residual: float = Field(0.0, ge=0)
    reference: str = ""

    def round_s(self, direction: str, calls: float, bytes_per_call: float) -> float:
        """Seconds of one ``direction`` (``"forward"`` or ``"backward"``) round of ``calls`` calls of
        ``bytes_per_call`` bytes each, by the fit (0 for no calls).

        Raises:
            ValueError: an unknown direction.
        """
        if direction not in ("forward", "backward"):
            raise ValueError(f"direction {direction!r}; allowed: forward, backward")
        if calls <= 0:
            return 0.0
        fixed, per_call, rate = (getattr(self, f"{direction}_{k}") for k in ("fixed_s", "per_call_s", "gb_per_s"))
        wire = bytes_per_call / (rate * 1e9) if rate else 0.0
        return fixed + calls * (per_call + wire)

    def cpu_s(self, side: str, direction: str, calls: float, bytes_per_call: float, units: float = 0.0) -> float:
        """CPU seconds ``side`` (``"server"`` or ``"client"``) spends on ``calls`` calls of
        ``direction`` moving ``bytes_per_call`` bytes each, in ``units`` batches (server) or rounds
        (client), by the fit: ``units x unit_cpu_s + calls x (cpu_s + bytes_per_call /
        (cpu_gb_per_s x 1e9))``, ``unit_cpu_s`` the side's ``batch_cpu_s`` or ``round_cpu_s``.

        Raises:
            ValueError: an unknown side or direction.
        """
        if side not in ("server", "client") or direction not in ("forward", "backward"):
            raise ValueError(f"side {side!r}, direction {direction!r}; allowed: server or client, forward or backward")
        rate = getattr(self, f"{side}_cpu_gb_per_s")
        per_call = getattr(self, f"{side}_{direction}_cpu_s") + (bytes_per_call / (rate * 1e9) if rate else 0.0)
        unit = getattr(self, f"{side}_{direction}_{'batch' if side == 'server' else 'round'}_cpu_s")
        return max(0.0, units) * unit + max(0.0, calls) * per_call

    def beam_search_s(self, batch: float, grid_dims: int) -> float:
        """Seconds of one ``batch_find_best_experts`` for ``batch`` samples over a grid of
        ``grid_dims`` dimensions: ``fixed + batch x max(1, grid_dims - 1) x lookup``."""
        return self.beam_search_fixed_s + batch * beam_search_rounds(grid_dims) * self.beam_search_lookup_s


def beam_search_rounds(grid_dims: int) -> int:
    """DHT look-up rounds of hivemind 1.1.12's beam search over a grid of ``grid_dims`` dimensions:
    the first dimension's prefixes (``_get_initial_beam``), then one ``get_many`` per middle
    dimension (``MoEBeamSearcher._find_best_experts`` loops over dimensions ``1 .. dims - 2``;
    the last dimension's experts come with the prefixes found before): ``max(1, grid_dims - 1)``."""
    return max(1, int(grid_dims) - 1)


class ClusterSpec(BaseModel):
    """A cluster: ``nodes`` x ``devices_per_node`` identical devices, or a list of collaborative peers.

    Attributes:
        intra_node / inter_node: links between devices of one node / of different nodes
            (``inter_node`` is required when ``nodes > 1``).
        collective_fixed_s: fixed cost of one collective call beyond its latency and bytes
            (negotiation, buffer allocation and copies; thesis 002 ch. 5.2 names it as the reason
            eq. 5.1 fails for MobileNetV2).
        p2p_fixed_s: the same for one point-to-point send/recv pair.
        concurrent_compute_slowdown: factor (>= 1) by which a device computes slower when every
            device of its node computes at once (shared memory bandwidth, caches, clocks).
        comm_overlap: fraction (0..1) of a collective's time that can overlap computation
            (1: DMA engines as on GPUs; less on CPU, where communication threads share the cores).
        peers: collaborative peers; when empty, peers are the cluster's devices.
        p2p_link: point-to-point link between devices of a node as a ping-pong measures it
            (pipeline transfers); when absent, ``intra_node``.
        all_gather / reduce_scatter: measured fits of these collectives (FSDP's); when absent
            they are costed as half a ring all-reduce over ``intra_node`` with ``collective_fixed_s``.
        fsdp_unit_fixed_s: FSDP's own cost per unit per step beyond its collectives (hooks,
            copies into and out of the flat buffers, DTensor bookkeeping); ``calibrate`` measures
            it on units too small to compute.
        fsdp_step_gb_per_s / ddp_step_gb_per_s: bytes each worker moves per second of step time
            that FSDP units / DDP buckets add to a training step on these devices, measured by
            ``calibrate`` inside real steps; used where communication cannot overlap compute
            (CPU workers of the profiled machine, :func:`ddlscope.modeling.collectives.serial_comm`).
        hivemind: what hivemind's own machinery adds per global epoch on these peers, and their
            overshoot of the target batch (collaborative; measured by ``calibrate --hivemind``).
        dmoe: what beam searches and remote expert calls cost here (dmoe; measured by
            ``calibrate --dmoe``, :class:`DMoEFit`).
        averaging_efficiency: the fraction (0..1] of the peers' listed bandwidths that hivemind's
            averaging rounds reach (collaborative); 1 unless measured. On emulated links
            ``ddlscope validate`` and ``recommend --swarm`` measure it with hivemind's own rounds,
            each peer on one core (:mod:`ddlscope.network.averaging_probe`): on a 200/20 Mbit/s
            pair the rounds reached 0.72-0.73 of the rate where the TCP probe read 0.72-0.81.
        fsdp_link: the ring link as FSDP's unit collectives on CPU workers (gloo) reach it, where
            measured: on emulated links ``ddlscope validate`` runs them at the profile's unit sizes
            (:mod:`ddlscope.network.collective_probe`) and fsdp's cost model prices their wire time
            at it (MobileNetV2's reached 0.94, 0.83 and 0.73 of 200, 50 and 20 Mbit/s links, where
            the TCP probe read 0.95, 0.915 and 0.805). None: priced over ``intra_node``.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # finite numbers only

    name: str = "cluster"
    nodes: int = Field(1, ge=1, le=MAX_NODES)
    devices_per_node: int = Field(1, ge=1, le=MAX_DEVICES_PER_NODE)
    device: DeviceSpec
    intra_node: LinkSpec
    inter_node: LinkSpec | None = Field(None, validate_default=True)
    collective_fixed_s: float = Field(0.0, ge=0)
    p2p_fixed_s: float = Field(0.0, ge=0)
    concurrent_compute_slowdown: float = Field(1.0, ge=1)
    comm_overlap: float = Field(1.0, ge=0, le=1)
    peers: list[PeerSpec] = Field(default_factory=list, max_length=MAX_NODES)
    p2p_link: LinkSpec | None = None
    all_gather: CollectiveFit | None = None
    reduce_scatter: CollectiveFit | None = None
    fsdp_unit_fixed_s: float = Field(0.0, ge=0)
    fsdp_step_gb_per_s: float | None = Field(None, gt=0)
    ddp_step_gb_per_s: float | None = Field(None, gt=0)
    hivemind: HivemindFit | None = None
    dmoe: DMoEFit | None = None
    averaging_efficiency: float = Field(1.0, gt=0, le=1)
    fsdp_link: LinkSpec | None = None

    @field_validator("inter_node")
    @classmethod
    def _inter_node_when_several_nodes(cls, link: LinkSpec | None, info: ValidationInfo) -> LinkSpec | None:
        nodes = info.data.get("nodes", 1)
        if link is None and nodes > 1:
            raise ValueError(f"required when nodes > 1 (nodes = {nodes}): a [cluster.inter_node] table with "
                             f"bandwidth_gb_per_s and latency_s")
        return link

    def device_memory_bytes(self, profile_device_memory_bytes: int) -> int:
        """Memory of one device in bytes (see :meth:`DeviceSpec.memory_bytes`)."""
        return self.device.memory_bytes(profile_device_memory_bytes)

    @property
    def workers(self) -> int:
        """Devices in the cluster."""
        return self.nodes * self.devices_per_node

    def ring_link(self, workers: int) -> LinkSpec:
        """The slowest link in a ring over the first ``workers`` devices (node-major placement)."""
        if workers > self.devices_per_node and self.inter_node is not None:
            return self.inter_node
        return self.intra_node


# ---------------------------------------------------------------------------------------- TOML files
_TABLE_MODELS: dict[str, type[BaseModel]] = {"device": DeviceSpec, "intra_node": LinkSpec, "inter_node": LinkSpec,
                                              "peers": PeerSpec, "hivemind": HivemindFit, "dmoe": DMoEFit}
_LAYOUT = ("[cluster] with [cluster.device], [cluster.intra_node], optional [cluster.inter_node] and [[cluster.peers]]")


def _field_path(loc: tuple[Any, ...]) -> str:
    out = "cluster"
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def _parent_model(loc: tuple[Any, ...]) -> type[BaseModel]:
    names = [p for p in loc[:-1] if isinstance(p, str)]
    return _TABLE_MODELS.get(names[-1], ClusterSpec) if names else ClusterSpec


def format_cluster_errors(err: ValidationError) -> str:
    """One line per problem, each naming the field path (``cluster.intra_node.bandwidth_gb_per_s``)
    and what is allowed; in the style of :func:`ddlscope.config._format_validation_error`."""
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        field = _field_path(loc)
        msg = e["msg"].removeprefix("Value error, ")
        got = e.get("input")
        got_text = "" if isinstance(got, dict) or got is None else f" (got {got!r})"
        if e["type"] == "extra_forbidden":
            allowed = ", ".join(_parent_model(loc).model_fields)
            msg, got_text = f"unknown field; allowed: {allowed}", ""
        elif e["type"] == "missing":
            name = loc[-1] if loc else ""
            msg, got_text = "field required", ""
            if name in _TABLE_MODELS and name != "peers":
                keys = ", ".join(k for k, f in _TABLE_MODELS[name].model_fields.items() if f.is_required())
                msg += f" (a [{field}] table with {keys})"
        elif e["type"] == "model_type":
            msg = "expected a table"
        lines.append(f"{field}: {msg}{got_text}")
    return "; ".join(lines)


def parse_cluster(values: dict[str, Any], where: str = "cluster description") -> ClusterSpec:
    """Validate the contents of a ``[cluster]`` table.

    Raises:
        UserError: naming each bad field by its path and what is allowed.
    """
    try:
        return ClusterSpec.model_validate(values)
    except ValidationError as err:
        raise UserError(f"invalid {where}: {format_cluster_errors(err)}") from None


def load_cluster(path: Path) -> ClusterSpec:
    """Read a cluster description from a TOML file (see ``examples/cluster-*.toml``).

    Layout: a ``[cluster]`` table (name, nodes, devices_per_node, collective_fixed_s, p2p_fixed_s,
    concurrent_compute_slowdown, comm_overlap) with ``[cluster.device]`` (kind, memory_gib),
    ``[cluster.intra_node]`` and, when nodes > 1, ``[cluster.inter_node]`` (bandwidth_gb_per_s,
    latency_s), and optionally ``[[cluster.peers]]`` (compute_share, bandwidth_gb_per_s,
    latency_s, memory_gib) and the calibrated fits ``[cluster.hivemind]`` (:class:`HivemindFit`) and
    ``[cluster.dmoe]`` (:class:`DMoEFit`).

    Raises:
        UserError: missing, unreadable or non-UTF-8 file, invalid TOML, unknown or missing
            tables/fields, a number that is not finite or outside its range (e.g. bandwidth
            latency 0..60 s, up to 100,000 nodes of 4,096 devices), unknown device
            kind, nodes > 1 without inter_node; the message
            names the field (e.g. ``cluster.intra_node.bandwidth_gb_per_s: field required``).
    """
    from ddlscope.config import read_toml

    data = read_toml(Path(path), "cluster file")
    unknown = sorted(set(data) - {"cluster"})
    if unknown:
        raise UserError(f"cluster file {path}: unknown table(s) {unknown}; allowed: {_LAYOUT}")
    if "cluster" not in data:
        raise UserError(f"cluster file {path}: no [cluster] table; expected {_LAYOUT}")
    if not isinstance(data["cluster"], dict):
        raise UserError(f"cluster file {path}: cluster must be a table; expected {_LAYOUT}")
    return parse_cluster(data["cluster"], f"cluster file {path}")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)  # Python writes 1e-05, 25.0, inf, nan: all valid TOML floats
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # JSON string escapes are valid TOML basic-string escapes
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def dumps_cluster(spec: ClusterSpec, header: str | None = None) -> str:
    """The TOML text of ``spec`` (what :func:`load_cluster` reads); ``header`` becomes ``#`` comment lines."""
    data = spec.model_dump(exclude_none=True)
    lines = [f"# {line}".rstrip() for line in (header or "").splitlines()]
    lines.append("[cluster]")
    tables: list[tuple[str, dict]] = []
    arrays: list[tuple[str, list[dict]]] = []
    for key, value in data.items():
        if isinstance(value, dict):
            tables.append((key, value))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            arrays.append((key, value))
        elif isinstance(value, list) and not value:
            continue
        else:
            lines.append(f"{key} = {_toml_value(value)}")
    for key, table in tables:
        lines += ["", f"[cluster.{key}]"] + [f"{k} = {_toml_value(v)}" for k, v in table.items()]
    for key, items in arrays:
        for item in items:
            lines += ["", f"[[cluster.{key}]]"] + [f"{k} = {_toml_value(v)}" for k, v in item.items()]
    return "\n".join(lines) + "\n"


def write_cluster(spec: ClusterSpec, path: Path, header: str | None = None) -> Path:
    """Write ``spec`` as TOML to ``path`` atomically (a temporary file renamed over it); return the path.

    The text is read back and compared with ``spec`` before it replaces anything.
    """
    import tomllib

    path = Path(path)
    text = dumps_cluster(spec, header)
    if ClusterSpec.model_validate(tomllib.loads(text)["cluster"]) != spec:  # a writer bug, not bad input
        raise RuntimeError("cluster TOML writer: the written text does not read back to the same description")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
