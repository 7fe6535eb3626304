"""Cost models: seconds per step and per epoch of each distribution model, from a profile and a cluster.

Every model starts from the same measured inputs — the profile's per-layer forward/backward
seconds at the batch each worker really processes, its whole-step times, parameter and
activation bytes (:class:`~ddlscope.predict.profile.WorkloadProfile`) — and the cluster's
links, fixed per-call costs and contention factors (:class:`~ddlscope.predict.cluster.ClusterSpec`).
Where the thesis had a closed form, it is kept as a named reference model next to ours so the
validation report can compare the two:

=============  ==========================================================  ====================
model          ddlscope                                                     reference
=============  ==========================================================  ====================
single         measured step at the batch, data loading, contention         ch. 4 extrapolation
ddp            bucketed ring all-reduce overlapping the per-layer backward  eq. 5.1
fsdp           per-unit all-gather / reduce-scatter with one-unit prefetch  —
gpipe, 1f1b    event simulation of the schedule, per-stage micro-batches    eq. 6.1 + eq. 6.2
collaborative  accumulate the target batch + averaging rounds (hivemind)    —
=============  ==========================================================  ====================

Units: seconds, bytes. Batch sizes follow the suite (``ddlscope/suite/spec.py``): per worker for
single/ddp/fsdp/collaborative; the whole batch (split into micro-batches) for gpipe/1f1b.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ddlscope.errors import UserError
from ddlscope.predict.cluster import ClusterSpec, CollectiveFit, LinkSpec
from ddlscope.predict.profile import WorkloadProfile

DDP_FIRST_BUCKET_BYTES = 1024 * 1024  # torch DDP's first bucket (dist._DEFAULT_FIRST_BUCKET_BYTES) is 1 MiB
DDP_DEFAULT_BUCKET_CAP_BYTES = 25 * 1024 * 1024  # DistributedDataParallel(bucket_cap_mb=25)
MODELS = ("single", "ddp", "fsdp", "gpipe", "1f1b", "collaborative")


@dataclass
class Setting:
    """What to predict: a distribution model on ``workers`` workers.

    Attributes:
        batch_size: per worker (single/ddp/fsdp/collaborative) or the whole batch (gpipe/1f1b).
        microbatches: gpipe/1f1b only; must divide ``batch_size``.
        epoch_samples: samples in one epoch (the real dataset's training split).
        loader_workers: DataLoader workers per worker (0: loading is on the critical path).
        bucket_cap_mb: ddp gradient bucket size (MiB).
        reshard_after_forward: fsdp ZeRO-3 (True) or ZeRO-2 (False).
        target_batch_size / matchmaking_time_s / use_local_updates / average_state_every:
            collaborative (hivemind.Optimizer) settings.
    """

    strategy: str
    workers: int
    batch_size: int
    epoch_samples: int
    microbatches: int | None = None
    loader_workers: int = 0
    bucket_cap_mb: float = 25.0
    reshard_after_forward: bool = True
    target_batch_size: int = 256
    matchmaking_time_s: float = 10.0
    use_local_updates: bool = False
    average_state_every: int = 1

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step over all workers."""
        if self.strategy in ("gpipe", "1f1b"):
            return self.batch_size
        if self.strategy == "collaborative":
            return self.target_batch_size
        return self.batch_size * self.workers


@dataclass
class Prediction:
    """A cost model's answer for one :class:`Setting`.

    Attributes:
        step_s: seconds per optimizer step (collaborative: per global epoch of the target batch).
        epoch_s: seconds per epoch of ``setting.epoch_samples`` samples.
        breakdown_s: the step's parts (compute, data loading, exposed communication, bubble, ...);
            they add up to ``step_s``.
        dominant_cost: the largest part of ``breakdown_s``.
        reference_epoch_s: the thesis's closed form for the same setting, by name (e.g. ``eq5.1``).
        inputs: every number the model used, so a wrong prediction can be traced.
        notes: what makes this prediction less certain than the model's validation suggests.
    """

    setting: Setting
    step_s: float
    epoch_s: float
    breakdown_s: dict[str, float]
    reference_epoch_s: dict[str, float] = field(default_factory=dict)
    inputs: dict[str, float | int | str | list] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def dominant_cost(self) -> str:
        return max(self.breakdown_s, key=self.breakdown_s.get) if self.breakdown_s else "compute"


# ----------------------------------------------------------------------------- building blocks
def ring_allreduce_s(nbytes: float, workers: int, link: LinkSpec, fixed_s: float) -> float:
    """Seconds of one ring all-reduce of ``nbytes`` over ``workers`` workers.

    ``fixed_s + 2(W-1) * (latency + nbytes / (W * bandwidth))``: 2(W-1) steps each moving
    ``nbytes / W`` over the slowest link (Patarasuk & Yuan 2009; thesis 002 eq. 5.1's
    communication term, with the per-call fixed cost of ch. 5.2 added). 0 for one worker.
    """
    if workers < 2 or nbytes <= 0:
        return 0.0
    return fixed_s + 2 * (workers - 1) * (link.latency_s + nbytes / (workers * link.bandwidth_gb_per_s * 1e9))


def ring_allgather_s(nbytes: float, workers: int, link: LinkSpec, fixed_s: float,
                     fit: CollectiveFit | None = None) -> float:
    """Seconds of a ring all-gather (or reduce-scatter) whose *full* tensor is ``nbytes``.

    ``fixed_s + (W-1) * (latency + nbytes / (W * bandwidth))`` — half of a ring all-reduce; with a
    calibrated ``fit`` its own fixed cost and bandwidth replace the all-reduce's.
    """
    if workers < 2 or nbytes <= 0:
        return 0.0
    if fit is not None:
        fixed_s, link = fit.fixed_s, LinkSpec(bandwidth_gb_per_s=fit.bandwidth_gb_per_s, latency_s=link.latency_s)
    return fixed_s + (workers - 1) * (link.latency_s + nbytes / (workers * link.bandwidth_gb_per_s * 1e9))


def contention(cluster: ClusterSpec, busy_devices_per_node: int) -> float:
    """Compute slowdown (>= 1) with ``busy_devices_per_node`` devices of a node computing at once.

    Linear between 1 (one busy device) and the calibrated ``concurrent_compute_slowdown`` (all
    devices of the node busy).
    """
    d = cluster.devices_per_node
    if busy_devices_per_node <= 1 or d <= 1:
        return 1.0
    share = min(1.0, (busy_devices_per_node - 1) / (d - 1))
    return 1.0 + (cluster.concurrent_compute_slowdown - 1.0) * share


def ddp_step_traffic_bytes(gradient_bytes: float, workers: int) -> float:
    """Bytes each worker sends in a ring all-reduce of ``gradient_bytes``: ``2(W-1)/W x bytes``
    (Patarasuk & Yuan 2009)."""
    return 2 * (workers - 1) / workers * gradient_bytes


def fsdp_unit_traffic_bytes(unit_bytes: float, workers: int, reshard: bool = True) -> float:
    """Bytes each worker sends per FSDP unit and step: ``(W-1)/W x bytes`` for each all-gather
    (two with ``reshard_after_forward``, else one) and for the reduce-scatter."""
    return (workers - 1) / workers * unit_bytes * (3 if reshard else 2)


def serial_comm(profile: WorkloadProfile, cluster: ClusterSpec) -> bool:
    """True where communication cannot overlap compute: the profiled device is a CPU and the
    cluster is its own local workers (kind ``local``). There are no streams or DMA engines, so a
    collective's copies and reductions run on the worker's own cores, in turn with autograd."""
    return cluster.device.kind == "local" and profile.device.type == "cpu"


def _busy_per_node(cluster: ClusterSpec, workers: int) -> int:
    return min(workers, cluster.devices_per_node)


def _exposed_loading_s(profile: WorkloadProfile, batch: float, loader_workers: int, compute_s: float) -> float:
    """Data loading on the critical path: all of it in the main process, or what prefetching
    workers cannot hide behind ``compute_s``."""
    load = profile.data_load_s(batch, loader_workers)
    return load if loader_workers == 0 else max(0.0, load - compute_s)


def _check(profile: WorkloadProfile, cluster: ClusterSpec, s: Setting) -> None:
    if s.strategy not in MODELS:
        raise UserError(f"unknown distribution model {s.strategy!r}; allowed: {', '.join(MODELS)}")
    if s.workers < 1 or s.batch_size < 1 or s.epoch_samples < 1:
        raise UserError(f"workers, batch_size and epoch_samples must be >= 1 (got {s.workers}, {s.batch_size}, "
                        f"{s.epoch_samples})")
    if s.strategy == "single" and s.workers != 1:
        raise UserError("the single distribution model runs on exactly 1 worker")
    if s.strategy in ("gpipe", "1f1b"):
        mb = s.microbatches or 1
        if s.workers < 2 or s.batch_size % mb:
            raise UserError(f"{s.strategy}: needs >= 2 stages and micro-batches ({mb}) that divide the batch "
                            f"({s.batch_size})")
        if s.workers > len(profile.layers):
            raise UserError(f"{s.strategy}: {s.workers} stages but the network has {len(profile.layers)} layers")
    if s.strategy != "collaborative" and s.workers > cluster.workers:
        raise UserError(f"{s.workers} workers but the cluster {cluster.name!r} has {cluster.workers} devices")


def predict(profile: WorkloadProfile, cluster: ClusterSpec, setting: Setting, compute_scale: float = 1.0) -> Prediction:
    """Predict one setting with the cost model of its distribution model.

    Args:
        compute_scale: factor on every compute time (1 on the profiled device; see
            :func:`ddlscope.predict.devices.compute_scale` for another device).

    Raises:
        UserError: an impossible setting (unknown model, more workers than devices, micro-batches
            that do not divide the batch, more stages than layers).
    """
    _check(profile, cluster, setting)
    fn = {"single": predict_single, "ddp": predict_ddp, "fsdp": predict_fsdp, "gpipe": predict_pipeline,
          "1f1b": predict_pipeline, "collaborative": predict_collaborative}[setting.strategy]
    return fn(profile, cluster, setting, compute_scale)


def _finish(setting: Setting, parts: dict[str, float], samples_per_step: float, **extra) -> Prediction:
    step = sum(parts.values())
    epoch = step * setting.epoch_samples / samples_per_step
    return Prediction(setting, step, epoch, dict(parts), **extra)


# ----------------------------------------------------------------------------- single (ch. 4)
def predict_single(profile: WorkloadProfile, cluster: ClusterSpec, s: Setting, scale: float = 1.0) -> Prediction:
    """One device: the measured compute step at the batch, plus exposed data loading.

    Thesis 002 ch. 4 extrapolates a few measured batches to the epoch; here the step is read
    off the profile at the batch size (interpolated between measured sizes) and multiplied by
    batches per epoch = ``epoch_samples / batch_size``.
    """
    step = profile.step_at(s.batch_size)
    compute = step.forward_s + step.backward_s
    parts = {"compute": compute * scale, "optimizer": step.optimizer_s * scale}
    parts["data_load"] = _exposed_loading_s(profile, s.batch_size, s.loader_workers, sum(parts.values()))
    return _finish(s, parts, s.batch_size, inputs={"step_s": step.step_s, "compute_scale": scale})


# ----------------------------------------------------------------------------- ddp (ch. 5)
def ddp_buckets(param_bytes: list[int], bucket_cap_bytes: float) -> list[tuple[int, float]]:
    """Gradient buckets as DDP forms them: layers in reverse order, the first bucket capped at
    1 MiB and the rest at ``bucket_cap_bytes``; a layer larger than the cap spans several buckets.

    Args:
        param_bytes: gradient bytes of each layer, in forward order (length L).

    Returns:
        ``[(ready_after_layer, bucket_bytes), ...]`` in launch order, ``ready_after_layer`` being
        the index (forward order) of the layer whose backward completes the bucket.
    """
    buckets: list[tuple[int, float]] = []
    cap, filled = float(DDP_FIRST_BUCKET_BYTES), 0.0
    for i in reversed(range(len(param_bytes))):
        left = float(param_bytes[i])
        while left > 0:
            take = min(left, cap - filled)
            filled += take
            left -= take
            if filled >= cap:
                buckets.append((i, filled))
                cap, filled = float(bucket_cap_bytes), 0.0
        if i == 0 and filled > 0:
            buckets.append((0, filled))
    return buckets


def predict_ddp(profile: WorkloadProfile, cluster: ClusterSpec, s: Setting, scale: float = 1.0) -> Prediction:
    """Data parallel with bucketed ring all-reduce overlapping the backward pass.

    The backward pass runs the layers in reverse with their measured times (per-worker batch,
    times the contention factor); a bucket's all-reduce (:func:`ring_allreduce_s`, slowest
    ring link, plus the fixed per-collective cost) can start once its last gradient is ready and
    the previous all-reduce is done (one communication stream). The step waits for the last
    all-reduce (``comm_wait``). Overlapped communication still costs ``(1 - comm_overlap)`` of
    its time in compute (on CPU the collective's threads share the cores). This captures both
    failure modes of eq. 5.1 (thesis 002 ch. 5.2): communication that compute cannot hide (VGG)
    and per-collective fixed costs that dominate small buckets (MobileNetV2).

    Where communication is serial (:func:`serial_comm`: CPU workers of this machine) and the
    cluster has a calibrated ``ddp_step_gb_per_s``, nothing is hidden: each bucket costs
    ``collective_fixed_s + ddp_step_traffic_bytes / ddp_step_gb_per_s``, the rate measured inside
    real DDP steps (bucket copies and gloo's work sharing the core with autograd), and all of
    it adds to the step (measured on this machine: a DDP step of 32 MiB of gradients behind
    0.16 s of compute was 40 ms slower than plain, 1.5x the same all-reduce alone).
    """
    w = s.workers
    slow = contention(cluster, _busy_per_node(cluster, w)) * scale
    fwd, bwd = profile.layer_times_s(s.batch_size)
    step = profile.step_at(s.batch_size)
    link = cluster.ring_link(w)
    # backward completion time of each layer, last layer first
    done_at, t = [0.0] * len(bwd), 0.0
    for i in reversed(range(len(bwd))):
        t += bwd[i] * slow
        done_at[i] = t
    backward_end = t
    free, comm_total = 0.0, 0.0
    buckets = ddp_buckets([layer.param_bytes for layer in profile.layers], s.bucket_cap_mb * 1024 * 1024)
    in_step = cluster.ddp_step_gb_per_s if serial_comm(profile, cluster) else None
    for ready_after, nbytes in buckets:
        if in_step:  # measured inside DDP steps on these workers: the bucket's share of the step
            d = cluster.collective_fixed_s + ddp_step_traffic_bytes(nbytes, w) / (in_step * 1e9)
        else:
            d = ring_allreduce_s(nbytes, w, link, cluster.collective_fixed_s)
        free = max(free, done_at[ready_after]) + d
        comm_total += d
    exposed = max(0.0, free - backward_end)
    overlapped = comm_total - exposed
    parts = {
        "compute": sum(fwd) * slow + backward_end,
        "comm_interference": 0.0 if in_step else (1.0 - cluster.comm_overlap) * overlapped,
        "comm_wait": comm_total if in_step else exposed,
        "optimizer": step.optimizer_s * slow,
    }
    parts["data_load"] = _exposed_loading_s(profile, s.batch_size, s.loader_workers, sum(parts.values()))
    ref = eq_5_1_epoch_s(profile, cluster, s, scale)
    return _finish(s, parts, s.global_batch_size, reference_epoch_s={"eq5.1": ref},
                   inputs={"buckets": len(buckets), "comm_s": comm_total, "gradient_bytes": profile.param_bytes,
                           "serial_comm": bool(in_step),
                           "link_gb_per_s": link.bandwidth_gb_per_s, "link_latency_s": link.latency_s,
                           "contention": slow / scale, "compute_scale": scale})


def eq_5_1_epoch_s(profile: WorkloadProfile, cluster: ClusterSpec, s: Setting, scale: float = 1.0) -> float:
    """Thesis 002 eq. 5.1 (Horovod), per epoch — the reference model.

    ``T = T_seq / W + 2(W-1) * max_i(L_i + min(G, th) / (W * BW_i))`` per batch, where ``T_seq/W``
    (the one-device time of the global batch shared by W workers) is taken as the profiled
    one-device step at the per-worker batch, ``G`` the gradient bytes and ``th`` the bucket cap
    (tensor-fusion threshold). Only the last all-reduce is exposed; no fixed cost, no contention.
    """
    w = s.workers
    link = cluster.ring_link(w)
    g = min(float(profile.param_bytes), s.bucket_cap_mb * 1024 * 1024)
    per_batch = profile.step_at(s.batch_size).step_s * scale
    per_batch += 2 * (w - 1) * (link.latency_s + g / (w * link.bandwidth_gb_per_s * 1e9))
    return per_batch * s.epoch_samples / s.global_batch_size


# ----------------------------------------------------------------------------- fsdp
def predict_fsdp(profile: WorkloadProfile, cluster: ClusterSpec, s: Setting, scale: float = 1.0) -> Prediction:
    """Fully sharded data parallel (FSDP2, one unit per top-level layer), simulated unit by unit.

    Forward: unit i's parameters are all-gathered (:func:`ring_allgather_s` of its full bytes,
    with the cluster's calibrated all-gather / reduce-scatter fits when it has them)
    before its compute. Backward (reverse order): the parameters are gathered again (ZeRO-3,
    ``reshard_after_forward``) and each unit's gradients are reduce-scattered after its
    backward. The optimizer updates 1/W of the parameters, and every unit costs the cluster's
    calibrated ``fsdp_unit_fixed_s`` of FSDP's own work per step.

    On GPUs FSDP2 runs its collectives on their own streams and prefetches one unit ahead: the
    all-gather of unit i+1 is issued when unit i starts computing, reduce-scatters queue behind
    it on one communication stream, and overlapped communication costs ``(1 - comm_overlap)`` of
    its time in compute, as for ddp. On CPU devices (the profiled device is a CPU and the
    cluster's kind is ``local``) there are no streams: each all-gather is waited for right before
    its unit computes, and the reduce-scatter's copies and reduction run on the worker's own
    cores, so every collective adds to the step (measured on this machine: the forward of an
    FSDP step is the profiled forward plus the all-gathers). There, when the cluster has a
    calibrated ``fsdp_step_gb_per_s``, a unit's collectives cost its
    :func:`fsdp_unit_traffic_bytes` at that rate, measured inside real FSDP steps of 16 MiB units
    (FSDP's copies into and out of its flat buffers and fresh allocations included: 1.4x the
    same collectives alone on this machine).
    """
    w = s.workers
    slow = contention(cluster, _busy_per_node(cluster, w)) * scale
    fwd, bwd = profile.layer_times_s(s.batch_size)
    link, fixed = cluster.ring_link(w), cluster.collective_fixed_s
    sizes = [layer.param_bytes for layer in profile.layers]
    prefetch = not serial_comm(profile, cluster)
    in_step = None if prefetch else cluster.fsdp_step_gb_per_s
    if in_step:  # measured inside FSDP steps on these workers; a unit's 3 collectives share its traffic
        share = [fsdp_unit_traffic_bytes(b, w, s.reshard_after_forward) / (in_step * 1e9) for b in sizes]
        per_call = 3 if s.reshard_after_forward else 2
        ag = rs = [t / per_call for t in share]
    else:
        ag = [ring_allgather_s(b, w, link, fixed, cluster.all_gather) for b in sizes]
        rs = [ring_allgather_s(b, w, link, fixed, cluster.reduce_scatter) for b in sizes]
    comm_free, compute_t, comm_total = 0.0, 0.0, 0.0
    gathered_at: dict[int, float] = {}

    def gather(i: int, issue_at: float) -> None:
        nonlocal comm_free, comm_total
        if i in gathered_at or not (0 <= i < len(sizes)):
            return
        comm_free = max(comm_free, issue_at) + ag[i]
        comm_total += ag[i]
        gathered_at[i] = comm_free

    for i in range(len(sizes)):  # forward
        gather(i, compute_t)
        start = max(compute_t, gathered_at[i])
        if prefetch:
            gather(i + 1, start)
        compute_t = start + fwd[i] * slow
    if s.reshard_after_forward:
        gathered_at = {}
    rs_end = 0.0
    for i in reversed(range(len(sizes))):  # backward
        gather(i, compute_t)
        start = max(compute_t, gathered_at[i])
        if s.reshard_after_forward and prefetch:
            gather(i - 1, start)
        compute_t = start + bwd[i] * slow
        comm_free = max(comm_free, compute_t) + rs[i]
        comm_total += rs[i]
        rs_end = comm_free
        if not prefetch:  # the worker's cores reduce it before the next unit's backward
            compute_t = comm_free
    compute_only = (sum(fwd) + sum(bwd)) * slow
    waits = compute_t - compute_only
    exposed = max(0.0, rs_end - compute_t)
    overlapped = max(0.0, comm_total - exposed - waits)
    step = profile.step_at(s.batch_size)
    units = sum(1 for b in sizes if b > 0)  # the strategy shards every layer that has parameters
    parts = {"compute": compute_only, "comm_wait": waits + exposed,
             "comm_interference": (1.0 - cluster.comm_overlap) * overlapped,
             "fsdp_overhead": units * cluster.fsdp_unit_fixed_s,
             "optimizer": step.optimizer_s * slow / w}
    parts["data_load"] = _exposed_loading_s(profile, s.batch_size, s.loader_workers, sum(parts.values()))
    return _finish(s, parts, s.global_batch_size,
                   inputs={"units": len(sizes), "comm_s": comm_total, "contention": slow / scale, "prefetch": prefetch,
                           "in_step_rate": bool(in_step),
                           "compute_scale": scale, "link_gb_per_s": link.bandwidth_gb_per_s})


# ----------------------------------------------------------------------------- pipelines (ch. 6)
def pipeline_ops(schedule: str, stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """The order in which one stage runs its forward (``"F"``) and backward (``"B"``) passes.

    gpipe: every forward, then every backward (Huang et al. 2019). 1f1b: ``min(M, S - s - 1)``
    warm-up forwards, then one forward and one backward alternately, then the remaining
    backwards (Narayanan et al. 2019, PipeDream-Flush), as torch's ``Schedule1F1B`` runs them.

    Returns:
        ``[(kind, microbatch), ...]`` of length ``2 * microbatches``.
    """
    m = microbatches
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warm = min(m, stages - stage - 1)
    ops = [("F", i) for i in range(warm)]
    f, b = warm, 0
    while f < m:
        ops.append(("F", f))
        f += 1
        ops.append(("B", b))
        b += 1
    ops += [("B", i) for i in range(b, m)]
    return ops


def simulate_pipeline(schedule: str, fwd_s: list[float], bwd_s: list[float], transfer_s: list[float],
                      microbatches: int, send_block_s: list[float] | None = None) -> tuple[float, list[float]]:
    """Event simulation of one pipeline step.

    Args:
        fwd_s / bwd_s: forward / backward seconds of one micro-batch on each stage (length S).
        transfer_s: seconds to move one micro-batch's activation (forward) or its gradient
            (backward) across the boundary after stage s (length S - 1).
        send_block_s: seconds the *sending* stage is blocked per transfer (default 0).

    Returns:
        ``(step_s, busy_s per stage)``: the time the last stage finishes, and each stage's compute.

    A stage runs its :func:`pipeline_ops` in order; F(s, m) needs F(s-1, m) plus the transfer,
    B(s, m) needs B(s+1, m) plus the transfer and F(s, m).
    """
    n = len(fwd_s)
    send_block_s = send_block_s or [0.0] * max(0, n - 1)
    orders = [pipeline_ops(schedule, s, n, microbatches) for s in range(n)]
    pos, free = [0] * n, [0.0] * n
    end: dict[tuple[str, int, int], float] = {}
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(n):
            while pos[s] < len(orders[s]):
                kind, m = orders[s][pos[s]]
                if kind == "F":
                    dep = 0.0 if s == 0 else end.get(("F", s - 1, m))
                    dep = dep if s == 0 or dep is None else dep + transfer_s[s - 1]
                    dur = fwd_s[s] + (send_block_s[s] if s < n - 1 else 0.0)
                else:
                    dep = end.get(("F", s, m)) if s == n - 1 else end.get(("B", s + 1, m))
                    dep = dep if s == n - 1 or dep is None else dep + transfer_s[s]
                    dur = bwd_s[s] + (send_block_s[s - 1] if s > 0 else 0.0)
                if dep is None:
                    break
                start = max(free[s], dep)
                free[s] = end[(kind, s, m)] = start + dur
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # cannot happen for valid schedules; guards against an endless loop
            raise RuntimeError(f"pipeline simulation deadlocked ({schedule}, {n} stages, {microbatches} micro-batches)")
    busy = [microbatches * (fwd_s[s] + bwd_s[s]) for s in range(n)]
    return max(free), busy


def stage_bounds(profile: WorkloadProfile, stages: int, microbatch: float) -> list[int]:
    """Stage boundaries as the pipeline strategies cut them: balanced by per-layer forward+backward
    seconds at the micro-batch (:func:`ddlscope.strategies.partition.balanced_partition`)."""
    from ddlscope.strategies.partition import balanced_partition

    fwd, bwd = profile.layer_times_s(microbatch)
    return balanced_partition([f + b for f, b in zip(fwd, bwd)], stages)


def boundary_link(cluster: ClusterSpec, boundary: int) -> LinkSpec:
    """The link between pipeline stage ``boundary`` and the next (stages placed node-major): the
    inter-node link where the boundary crosses nodes, else the point-to-point link of a node."""
    if (boundary + 1) % cluster.devices_per_node == 0 and cluster.inter_node is not None:
        return cluster.inter_node
    return cluster.p2p_link or cluster.intra_node


def predict_pipeline(profile: WorkloadProfile, cluster: ClusterSpec, s: Setting, scale: float = 1.0) -> Prediction:
    """GPipe or 1F1B: the schedule simulated with per-stage micro-batch times and activation transfers.

    Stages are cut like the strategies cut them (:func:`stage_bounds`); a stage's micro-batch
    forward/backward time is the sum of its layers' profiled times at the micro-batch size
    (times contention). Each boundary moves ``microbatch * output_bytes_per_sample`` bytes per
    micro-batch each way at ``p2p_fixed_s + latency + bytes / bandwidth``; the sender is blocked
    for the fixed part and ``(1 - comm_overlap)`` of the rest. The step ends when the slowest
    stage has run its :func:`pipeline_ops`, then every stage steps its optimizer on its share of
    the parameters. ``bubble`` is the step minus the busiest stage's compute.
    """
    w, m = s.workers, s.microbatches or 1
    mb = s.batch_size / m
    slow = contention(cluster, _busy_per_node(cluster, w)) * scale
    bounds = stage_bounds(profile, w, mb)
    fwd, bwd = profile.layer_times_s(mb)
    f_stage = [sum(fwd[a:b]) * slow for a, b in zip(bounds, bounds[1:])]
    b_stage = [sum(bwd[a:b]) * slow for a, b in zip(bounds, bounds[1:])]
    transfer, block = [], []
    for k in range(w - 1):
        nbytes = mb * profile.layers[bounds[k + 1] - 1].output_bytes_per_sample
        link = boundary_link(cluster, k)
        wire = link.transfer_s(nbytes) - link.latency_s
        transfer.append(cluster.p2p_fixed_s + link.latency_s + wire)
        block.append(cluster.p2p_fixed_s + (1.0 - cluster.comm_overlap) * wire)
    span, busy = simulate_pipeline(s.strategy, f_stage, b_stage, transfer, m, block)
    step = profile.step_at(s.batch_size)
    stage_params = [sum(layer.param_bytes for layer in profile.layers[a:b]) for a, b in zip(bounds, bounds[1:])]
    opt = max(step.optimizer_s * slow * p / max(1, profile.param_bytes) for p in stage_params)
    parts = {"compute": max(busy), "bubble": span - max(busy), "optimizer": opt}
    parts["data_load"] = _exposed_loading_s(profile, s.batch_size, s.loader_workers, sum(parts.values()))
    ref = eq_6_epoch_s(profile, cluster, s, bounds, scale)
    return _finish(s, parts, s.batch_size, reference_epoch_s={"eq6.1+6.2": ref},
                   inputs={"stage_bounds": bounds, "stage_forward_s": f_stage, "stage_backward_s": b_stage,
                           "transfer_s": transfer, "microbatch": mb, "contention": slow / scale,
                           "compute_scale": scale})


def eq_6_epoch_s(profile: WorkloadProfile, cluster: ClusterSpec, s: Setting, bounds: list[int],
                 scale: float = 1.0) -> float:
    """Thesis 002 eq. 6.1 + eq. 6.2 (GPipe), per epoch — the reference model.

    eq. 6.1: ``T_comp = T_seq * (W + #mb - 1) / (W * #mb)``, with ``T_seq`` the one-device time of
    the batch as ``#mb`` micro-batches (``#mb`` x the profiled step at the micro-batch size), so
    that one micro-batch gives ``T_seq`` as the thesis says.
    eq. 6.2: ``T_comm = 2 * (sum_{i=1}^{W-2} max_{j<=i} c_j + (#mb - (W-2)) * max_j c_j
    + sum_{i=2}^{W-1} max_{j>=i} c_j)`` with ``c_j = L_j + mb * A_j / BW_j`` over the stage
    boundaries j (``A_j``: activation bytes per sample at boundary j).
    """
    w, m = s.workers, s.microbatches or 1
    mb = s.batch_size / m
    t_seq = m * profile.step_at(mb).step_s * scale
    t_comp = t_seq * (w + m - 1) / (w * m)
    c = []
    for k in range(w - 1):
        link = boundary_link(cluster, k)
        c.append(link.transfer_s(mb * profile.layers[bounds[k + 1] - 1].output_bytes_per_sample))
    fill = sum(max(c[:i]) for i in range(1, w - 1))
    full = (m - (w - 2)) * max(c)
    drain = sum(max(c[i - 1:]) for i in range(2, w))
    t_comm = 2 * (fill + full + drain)
    return (t_comp + t_comm) * s.epoch_samples / s.batch_size


# ----------------------------------------------------------------------------- collaborative
def butterfly_allreduce_s(nbytes: float, bandwidths_gb_per_s: list[float], latencies_s: list[float],
                          fixed_s: float = 0.0) -> float:
    """Seconds of hivemind's butterfly all-reduce of ``nbytes`` among peers with these links.

    Peer i reduces a fraction ``x_i`` of the vector: it sends the other ``1 - x_i`` of its own
    vector and returns its averaged part to the N-1 others, ``nbytes * (1 + (N-2) x_i)`` bytes
    out (and as many in). hivemind chooses the fractions by a linear program that minimises the
    slowest peer's time (``hivemind.averaging.load_balancing``); the same LP is solved here
    (scipy ``linprog``). One peer: 0.
    """
    n = len(bandwidths_gb_per_s)
    if n < 2 or nbytes <= 0:
        return 0.0
    bw = [b * 1e9 for b in bandwidths_gb_per_s]
    if n == 2:
        wire = nbytes / min(bw)
    else:
        from scipy.optimize import linprog

        # variables x_1..x_n, T: minimise T s.t. nbytes (1 + (n-2) x_i) / bw_i <= T, sum x = 1, x >= 0
        c = [0.0] * n + [1.0]
        a_ub = [[(nbytes * (n - 2) / bw[i]) if j == i else 0.0 for j in range(n)] + [-1.0] for i in range(n)]
        b_ub = [-nbytes / bw[i] for i in range(n)]
        res = linprog(c, A_ub=a_ub, b_ub=b_ub, A_eq=[[1.0] * n + [0.0]], b_eq=[1.0],
                      bounds=[(0, 1)] * n + [(0, None)], method="highs")
        wire = float(res.x[-1]) if res.success else 2 * nbytes * (n - 1) / n / min(bw)
    return fixed_s + 2 * max(latencies_s) + wire


def predict_collaborative(profile: WorkloadProfile, cluster: ClusterSpec, s: Setting, scale: float = 1.0) -> Prediction:
    """Hivemind collaborative training: accumulate the target batch, then an averaging round.

    Peers (``cluster.peers``, or the cluster's first ``workers`` devices with compute share 1)
    each train at their own speed: ``step_p = data + compute(b) * contention / share_p``. The swarm
    reaches the target batch size after ``T_acc = TBS / sum_p(b / step_p)`` seconds (DeDLOC's
    global progress tracking, Ryabinin 2023). The step that ends a global epoch then waits for
    the gradient round (unless ``use_local_updates``), a :func:`butterfly_allreduce_s` of the
    gradients over the peers' links. hivemind pre-schedules it
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
    figures depend on the matchmaking time (:mod:`ddlscope.predict.swarm`); a setting at another
    matchmaking time than the fit's gets a note. Without a fit both are left out and CPU peers are
    predicted too fast (see the README's validation figures), which a note says too.
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
    peer_steps = [(compute + local_opt) * slow / share + profile.data_load_s(s.batch_size, s.loader_workers)
                  for share in shares]
    throughput = sum(s.batch_size / t for t in peer_steps)
    hm = cluster.hivemind
    t_acc = s.target_batch_size / throughput + (hm.overshoot_steps * max(peer_steps) if hm else 0.0)
    alone = len(shares) < 2
    on_cpu = cluster.device.kind == "local" and profile.device.type == "cpu"
    fixed = cluster.collective_fixed_s
    one_round = 0.0 if alone else butterfly_allreduce_s(float(profile.param_bytes), bws, lats, fixed)
    wait = 0.0 if alone else max(0.0, s.matchmaking_time_s - max(0.0, t_acc - max(peer_steps)))
    grad_round = 0.0 if s.use_local_updates or alone else wait + one_round
    state_round = one_round / s.average_state_every
    state_exposed = state_round if on_cpu else max(0.0, state_round - t_acc)
    averaging = grad_round + state_exposed
    overhead = 0.0
    if hm and not alone:  # measured on these devices: replaces the two rounds
        reference = butterfly_allreduce_s(float(hm.reference_param_bytes), bws, lats, fixed)
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
                     f"{s.matchmaking_time_s:g} s; both depend on it (calibrate --hivemind --matchmaking-time "
                     f"{s.matchmaking_time_s:g} measures them there)")
    parts = {"compute": t_acc, "averaging": averaging,
             "optimizer": 0.0 if s.use_local_updates else step.optimizer_s * slow / min(shares)}
    return _finish(s, parts, throughput * t_acc,
                   inputs={"peers": len(shares), "compute_shares": shares, "peer_step_s": peer_steps,
                           "swarm_samples_per_s": throughput, "accumulate_s": t_acc,
                           "samples_per_global_epoch": throughput * t_acc, "matchmaking_wait_s": wait,
                           "grad_round_s": grad_round, "state_round_s": state_round, "state_round_on_cores": on_cpu,
                           "hivemind_epoch_overhead_s": overhead,
                           "hivemind_fit_matchmaking_time_s": (hm.matchmaking_time_s or 0.0) if hm else 0.0,
                           "contention": slow / scale, "compute_scale": scale}, notes=notes)


def predict_all(profile: WorkloadProfile, cluster: ClusterSpec, settings: list[Setting],
                compute_scale: float = 1.0) -> list[Prediction | UserError]:
    """:func:`predict` for each setting; an impossible setting yields its :class:`UserError`."""
    out: list[Prediction | UserError] = []
    for s in settings:
        try:
            out.append(predict(profile, cluster, s, compute_scale))
        except UserError as err:
            out.append(err)
    return out

