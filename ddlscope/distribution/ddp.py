"""``ddp``: data parallelism with bucketed ring all-reduce overlapping the backward pass (torch DDP;
thesis 002 ch. 5)."""

from __future__ import annotations

from ddlscope.distribution import DistributionModel, register
from ddlscope.modeling.cluster import ClusterSpec
from ddlscope.modeling.collectives import (busy_per_node, contention, ddp_step_traffic_bytes, exposed_loading_s,
                                           ring_allreduce_s, serial_comm, tree_broadcast_s)
from ddlscope.modeling.memory import MemoryEstimate, replicas
from ddlscope.modeling.prediction import Prediction, Setting, make_prediction
from ddlscope.modeling.profile import WorkloadProfile

DDP_FIRST_BUCKET_BYTES = 1024 * 1024
"""torch DDP's first bucket (``dist._DEFAULT_FIRST_BUCKET_BYTES``) is 1 MiB."""
DDP_DEFAULT_BUCKET_CAP_BYTES = 25 * 1024 * 1024
"""``DistributedDataParallel(bucket_cap_mb=25)``."""


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
    """Data parallel with bucketed ring all-reduce overlapping the backward pass (thesis 002 ch. 5).

    The backward pass runs the layers in reverse with their measured times (per-worker batch,
    times the contention factor); a bucket's all-reduce (:func:`ring_allreduce_s`, slowest
    ring link, plus the fixed per-collective cost) can start once its last gradient is ready and
    the previous all-reduce is done (one communication stream). The step waits for the last
    all-reduce (``comm_wait_s``). Overlapped communication still costs ``(1 - comm_overlap)`` of
    its time in compute (on CPU the collective's threads share the cores): that slowdown is part
    of ``backward_s``, where a run measures it, and is reported as ``inputs["comm_interference_s"]``.
    This captures both failure modes of eq. 5.1 (thesis 002 ch. 5.2): communication that compute
    cannot hide (VGG) and per-collective fixed costs that dominate small buckets (MobileNetV2).

    Where communication is serial (:func:`serial_comm`: CPU workers of this machine) and the
    cluster has a calibrated ``ddp_step_gb_per_s``, nothing is hidden: each bucket costs
    ``collective_fixed_s + ddp_step_traffic_bytes / ddp_step_gb_per_s``, the rate measured inside
    real DDP steps (bucket copies and gloo's work sharing the core with autograd), and all of
    it adds to the step as ``comm_wait_s`` (measured on this machine: a DDP step of 32 MiB of
    gradients behind 0.16 s of compute was 40 ms slower than plain, 1.5x the same all-reduce alone);
    a bucket never costs less than its ring all-reduce over the cluster's link (the in-step rate
    was measured on loopback; over an emulated slow network the wire is the bound).

    Before every training forward DDP broadcasts the module's buffers (BatchNorm running
    statistics) from rank 0 (``broadcast_buffers=True``, torch's default, which our strategy keeps):
    one :func:`tree_broadcast_s` of ``profile.buffer_bytes``, part of ``forward_s`` (where a run
    measures it) and reported as ``inputs["buffer_broadcast_s"]``. Free on fast links, it is
    not on slow ones: MobileNetV2's 137 kB of buffers cost 28 ms per step on 50 Mbit/s links (`validate links`).
    """
    w = s.workers
    slow = contention(cluster, busy_per_node(cluster, w)) * scale
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
        wire = ring_allreduce_s(nbytes, w, link, cluster.collective_fixed_s)
        if in_step:  # measured inside DDP steps on these workers: the bucket's share of the step, at least the wire's
            d = max(cluster.collective_fixed_s + ddp_step_traffic_bytes(nbytes, w) / (in_step * 1e9), wire)
        else:
            d = wire
        free = max(free, done_at[ready_after]) + d
        comm_total += d
    exposed = max(0.0, free - backward_end)
    overlapped = comm_total - exposed
    interference = 0.0 if in_step else (1.0 - cluster.comm_overlap) * overlapped
    buffer_broadcast = tree_broadcast_s(profile.buffer_bytes, w, link, cluster.collective_fixed_s)
    parts = {
        "forward_s": sum(fwd) * slow + buffer_broadcast,
        "backward_s": backward_end + interference,
        "comm_wait_s": comm_total if in_step else exposed,
        "optimizer_s": step.optimizer_s * slow,
    }
    parts["data_load_s"] = exposed_loading_s(profile, s.batch_size, s.loader_workers, sum(parts.values()))
    ref = eq_5_1_epoch_s(profile, cluster, s, scale)
    return make_prediction(s, parts, s.global_batch_size, reference_epoch_s={"eq5.1": ref},
                           inputs={"buckets": len(buckets), "comm_s": comm_total, "gradient_bytes": profile.param_bytes,
                                   "serial_comm": bool(in_step), "comm_interference_s": interference,
                                   "buffer_bytes": profile.buffer_bytes, "buffer_broadcast_s": buffer_broadcast,
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


def memory_ddp(profile: WorkloadProfile, s: Setting) -> list[MemoryEstimate]:
    """The same replica on every worker as ``single``, plus ``comm = G`` (notation of
    :mod:`ddlscope.modeling.memory`).

    With ``gradient_as_bucket_view=False`` (our strategy keeps torch's default) the reducer copies
    the gradients into flat bucket tensors of ``bucket_cap_mb`` MiB, which together are as large
    as all gradients and live for the whole run (torch's DistributedDataParallel documentation:
    a bucket view "can reduce peak memory usage, where the saved memory size will be equal to the
    total gradients size"). ``bucket_cap_mb`` changes how they are split, not their total.
    """
    return replicas(profile, s, profile.param_bytes,
                    f"full replica + flat gradient buckets ({s.bucket_cap_mb:g} MiB each; gradient_as_bucket_view=False)")


MODEL = register(DistributionModel(
    name="ddp",
    summary="data parallel: a replica per worker, gradients ring-all-reduced in buckets (torch DDP)",
    strategy="ddp:DDPStrategy",
    launcher="torchrun",
    measures="all-reduce time and bytes per step, the wait after the last bucket",
    predicts="bucketed ring all-reduce over the per-layer backward (ddlscope) and eq. 5.1 (thesis 002)",
    order=10,
    min_workers=1,
    cost_model=predict_ddp,
    memory_model=memory_ddp,
    reference_models=("eq5.1",),
))
