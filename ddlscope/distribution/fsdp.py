"""``fsdp``: sharded data parallelism, one FSDP2 unit per top-level layer (ZeRO-3, or ZeRO-2 without
``reshard_after_forward``)."""

from __future__ import annotations

import math

from ddlscope.distribution import DistributionModel, register
from ddlscope.modeling.cluster import ClusterSpec, CollectiveFit, LinkSpec
from ddlscope.modeling.collectives import (busy_per_node, contention, exposed_loading_s, fsdp_unit_traffic_bytes,
                                           gloo_reduce_scatter_s, ring_allgather_s, serial_comm)
from ddlscope.modeling.memory import MemoryEstimate, activation_bytes
from ddlscope.modeling.prediction import Prediction, Setting, make_prediction
from ddlscope.modeling.profile import WorkloadProfile


def predict_fsdp(profile: WorkloadProfile, cluster: ClusterSpec, s: Setting, scale: float = 1.0) -> Prediction:
    """Fully sharded data parallel (FSDP2, one unit per top-level layer), simulated unit by unit.

    Forward: unit i's parameters are all-gathered (:func:`ring_allgather_s` of its full bytes,
    with the cluster's calibrated all-gather / reduce-scatter fits when it has them)
    before its compute. Backward (reverse order): the parameters are gathered again (ZeRO-3,
    ``reshard_after_forward``) and each unit's gradients are reduce-scattered after its
    backward. The optimizer updates 1/W of the parameters, and every unit costs the cluster's
    calibrated ``fsdp_unit_fixed_s`` of FSDP's own work per step (``inputs["fsdp_overhead_s"]``);
    that work accompanies the unit's collectives, so it is split between ``forward_s`` and
    ``backward_s`` like them (ZeRO-3: one all-gather in the forward, an all-gather and a
    reduce-scatter in the backward, 1/3 : 2/3; ZeRO-2: 1/2 : 1/2).

    On GPUs FSDP2 runs its collectives on their own streams and prefetches one unit ahead: the
    all-gather of unit i+1 is issued when unit i starts computing, reduce-scatters queue behind
    it on one communication stream, and overlapped communication costs ``(1 - comm_overlap)`` of
    its time in compute, as for ddp (in ``backward_s``; ``inputs["comm_interference_s"]``). On
    CPU devices (the profiled device is a CPU and the cluster's kind is ``local``) there are no
    streams: each all-gather is waited for right before its unit computes, and the
    reduce-scatter's copies and reduction run on the worker's own cores, so every collective adds
    to the step (measured on this machine: the forward of an FSDP step is the profiled forward
    plus the all-gathers). There, when the cluster has a calibrated ``fsdp_step_gb_per_s``, a
    unit's collectives cost its :func:`fsdp_unit_traffic_bytes` at that rate, measured inside
    real FSDP steps of 16 MiB units (FSDP's copies into and out of its flat buffers and fresh
    allocations included: 1.4x the same collectives alone on this machine). Waiting for
    collectives is ``comm_wait_s``. The rate was measured on the calibrated links; over a slower
    link (an emulated network's) a collective's wire time beyond the calibrated collective's
    (``all_gather`` / ``reduce_scatter`` fits) adds to it: FSDP's copies and the transfer follow
    each other (measured on emulated 50 Mbit/s links: taking the larger of the two predicted
    MobileNetV2's epoch 29 % too fast). On CPU workers (gloo) a reduce-scatter's wire time is an
    all-reduce's: torch's gloo backend reduces the whole tensor and keeps its shard (counted on an
    emulated link: 2 workers each send the full tensor's bytes per reduce-scatter, half of it per
    all-gather; :func:`~ddlscope.modeling.collectives.gloo_reduce_scatter_s`).

    Where the cluster has an ``fsdp_link`` (CPU workers; the collectives measured over an emulated
    network's links by :mod:`ddlscope.network.collective_probe`), a collective costs the larger of
    its wire time over that link and its share of the in-step time plus FSDP's own work: the fsdp
    runs' step time beyond their compute matched the probe's steps alone within 5 % on 200, 50
    and 200/20 Mbit/s links (MobileNetV2; the in-step time and FSDP's work hide behind the wire).
    """
    w = s.workers
    slow = contention(cluster, busy_per_node(cluster, w)) * scale
    fwd, bwd = profile.layer_times_s(s.batch_size)
    link, fixed = cluster.ring_link(w), cluster.collective_fixed_s
    sizes = [layer.param_bytes for layer in profile.layers]
    prefetch = not serial_comm(profile, cluster)
    in_step = None if prefetch else cluster.fsdp_step_gb_per_s
    per_call = 3 if s.reshard_after_forward else 2  # collectives per unit and step
    probed = cluster.fsdp_link if in_step else None
    if probed is not None:  # gloo's unit collectives measured over these links: a collective takes the wire time they
        # reached there, or its in-step time and FSDP's own work where those are longer (the work hides behind the wire)
        work = [fsdp_unit_traffic_bytes(b, w, s.reshard_after_forward) / (in_step * 1e9)
                + (cluster.fsdp_unit_fixed_s if b > 0 else 0.0) for b in sizes]
        ag = [max(t / per_call, ring_allgather_s(b, w, probed, 0.0)) for t, b in zip(work, sizes)]
        rs = [max(t / per_call, gloo_reduce_scatter_s(b, w, probed, 0.0)) for t, b in zip(work, sizes)]
    elif in_step:  # measured inside FSDP steps on these workers; a unit's collectives share its traffic. The rate was
        # measured on the calibrated links: where the cluster's link is slower, the wire time beyond theirs adds
        share = [fsdp_unit_traffic_bytes(b, w, s.reshard_after_forward) / (in_step * 1e9) for b in sizes]

        def in_step_s(t: float, wire: float, nbytes: float, fit: CollectiveFit | None) -> float:
            """A collective's share ``t`` of the in-step time, plus its ``wire`` time beyond the calibrated
            collective's (without a fit: at least the wire's)."""
            if fit is None:
                return max(t, wire)
            calibrated = LinkSpec(bandwidth_gb_per_s=fit.bandwidth_gb_per_s, latency_s=link.latency_s)
            return t + max(0.0, wire - ring_allgather_s(nbytes, w, calibrated, fit.fixed_s))

        ag = [in_step_s(t / per_call, ring_allgather_s(b, w, link, fixed), b, cluster.all_gather)
              for t, b in zip(share, sizes)]
        rs = [in_step_s(t / per_call, gloo_reduce_scatter_s(b, w, link, fixed), b, cluster.reduce_scatter)
              for t, b in zip(share, sizes)]
    else:
        ag = [ring_allgather_s(b, w, link, fixed, cluster.all_gather) for b in sizes]
        rs = [ring_allgather_s(b, w, link, fixed, cluster.reduce_scatter) for b in sizes]
        if not prefetch:  # CPU workers: gloo's reduce-scatter moves an all-reduce's bytes
            rs = [max(r, gloo_reduce_scatter_s(b, w, link, fixed)) for r, b in zip(rs, sizes)]
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
    overhead = 0.0 if probed is not None else units * cluster.fsdp_unit_fixed_s  # probed: in the collectives
    interference = (1.0 - cluster.comm_overlap) * overlapped
    parts = {"forward_s": sum(fwd) * slow + overhead / per_call,
             "backward_s": sum(bwd) * slow + interference + overhead * (per_call - 1) / per_call,
             "comm_wait_s": waits + exposed,
             "optimizer_s": step.optimizer_s * slow / w}
    parts["data_load_s"] = exposed_loading_s(profile, s.batch_size, s.loader_workers, sum(parts.values()))
    return make_prediction(s, parts, s.global_batch_size,
                           inputs={"units": len(sizes), "comm_s": comm_total, "contention": slow / scale,
                                   "prefetch": prefetch, "in_step_rate": bool(in_step), "fsdp_overhead_s": overhead,
                                   "comm_interference_s": interference, "compute_scale": scale,
                                   "link_gb_per_s": (probed or link).bandwidth_gb_per_s, "probed_link": probed is not None})


def memory_fsdp(profile: WorkloadProfile, s: Setting) -> list[MemoryEstimate]:
    """FSDP2 ``fully_shard`` on every top-level layer (notation of :mod:`ddlscope.modeling.memory`, ``N`` workers).

    ``params = P / N + Bf`` (buffers are not sharded), ``grads = G / N``, ``optimizer = O / N``,
    ``activations = A(b)``, and the gathered units in ``comm``. With ``reshard_after_forward``
    (ZeRO-3): a unit's backward holds its unsharded parameters, their unsharded gradients and
    the flat reduce-scatter input (``3 p_l``) while the previous unit's all-gather (its output
    buffer, then its unsharded copy: ``2 p_(l-1)``) is prefetched, so ``gathered = max_l (3 p_l +
    2 p_(l-1))``. Without it (ZeRO-2) every unit stays gathered from its forward to its backward:
    ``gathered = P + max_l 2 p_l``. On CPU (gloo) ``comm = gathered + max_l p_l``: gloo's
    all-gather and reduce-scatter each work on a flat copy of the whole unit (measured: a 40 MB
    all-gather or reduce-scatter raises the resident peak by 40 MB, an all-reduce by 2 MB); NCCL
    (CUDA) works in place, ``comm = gathered``.

    What a step allocates and frees beyond its sharded gradients and activations
    (:attr:`~ddlscope.modeling.memory.MemoryEstimate.step_transient_bytes`, of which glibc's heap
    keeps a share, :func:`~ddlscope.modeling.memory.setting_memory`): each all-gather of a unit
    (twice a step with ``reshard_after_forward``, once without) its output and the unsharded
    parameters copied out of it, ``2 p_l``; the backward the unsharded gradients and the
    reduce-scatter's flat input, ``2 p_l``; on CPU each collective also gloo's flat copy, ``p_l``.
    So ``transient = P (passes (2 + c) + 2 + c)``, ``c`` = 1 on CPU, 0 on CUDA: ``9 P`` on CPU with
    ``reshard_after_forward``. Measured (validation grid of ddp and fsdp, MNIST and CIFAR-10 shapes x
    ResNet-18, VGG-11, MobileNetV2, 2 one-core gloo workers, global batch 64, 10 steps; Xeon,
    2026-12-06): the fsdp workers' allocator part was -33.7 % (median; -31.5 to -51.4 % on ResNet-18
    and VGG-11) without the term and +3.3 % with it (-6.9 to +25.0 %); ddp's on the same runs -3.5 %.
    The heap keeps growing past those steps: VGG-11 at batch 32 per worker held 374 MiB above its
    runtime after 10 steps and 482 MiB after 80 (ddp: 240 and 249), so a long fsdp run on CPU holds
    more than this predicts (docs/validation.md, stop 66).
    """
    n, p_all = s.workers, profile.param_bytes
    layer_p = [layer.param_bytes for layer in profile.layers]
    if s.reshard_after_forward:
        gathered = max(3 * p + 2 * (layer_p[i - 1] if i else 0) for i, p in enumerate(layer_p))
        note = "sharded state / N; one unit gathered (+ prefetch) at a time (reshard_after_forward)"
    else:
        gathered = p_all + max(2 * p for p in layer_p)
        note = "sharded state / N; all units stay gathered between forward and backward (ZeRO-2)"
    gloo = profile.device.type == "cpu"
    if gloo:
        gathered += max(layer_p)
        note += "; gloo's flat working copy of one unit"
    passes = 2 if s.reshard_after_forward else 1
    transient = p_all * (passes * (2 + gloo) + 2 + gloo)
    return [MemoryEstimate(worker=w, params_bytes=math.ceil(p_all / n) + profile.buffer_bytes,
                           grads_bytes=math.ceil(p_all / n), optimizer_bytes=math.ceil(profile.optimizer_state_bytes / n),
                           activations_bytes=activation_bytes(profile, s.batch_size), comm_buffers_bytes=gathered,
                           runtime_bytes=profile.device.runtime_bytes, step_transient_bytes=transient, notes=note)
            for w in range(n)]


MODEL = register(DistributionModel(
    name="fsdp",
    summary="sharded data parallel: parameters, gradients and optimizer state split over workers (FSDP2)",
    strategy="fsdp:FSDPStrategy",
    compute_parts_alone=False,
    launcher="torchrun",
    measures="all-gather and reduce-scatter time and bytes per step",
    predicts="per-unit all-gather / reduce-scatter with prefetch, simulated unit by unit",
    order=20,
    min_workers=1,
    gathers_units=True,
    cost_model=predict_fsdp,
    memory_model=memory_fsdp,
))

