"""Building blocks the cost models share: collectives over links, contention, traffic, data loading.

Each distribution model's cost model (``ddlscope/distribution/<model>.py``) is built from these:
the time of a ring all-reduce / all-gather (Patarasuk & Yuan 2009) or of hivemind's butterfly
all-reduce over the cluster's links (:class:`~ddlscope.modeling.cluster.LinkSpec`), the compute
slowdown of devices that share a node, the bytes a worker sends per step, whether communication
can overlap compute at all, and the data loading left on the critical path.

Units: seconds, bytes, GB/s (1e9 bytes per second). Torch-free.
"""

from __future__ import annotations

from ddlscope.modeling.cluster import ClusterSpec, CollectiveFit, LinkSpec
from ddlscope.modeling.profile import WorkloadProfile


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


def butterfly_allreduce_s(nbytes: float, bandwidths_gb_per_s: list[float], latencies_s: list[float],
                          fixed_s: float = 0.0, balanced: bool = True) -> float:
    """Seconds of hivemind's butterfly all-reduce of ``nbytes`` among peers with these links.

    Peer i reduces a fraction ``x_i`` of the vector: it sends the other ``1 - x_i`` of its own
    vector and returns its averaged part to the N-1 others, ``nbytes * (1 + (N-2) x_i)`` bytes
    out (and as many in), which take ``nbytes * (1 + (N-2) x_i) / bw_i`` when sending and
    receiving overlap (DeDLOC, Diskin et al. 2021, section 3.2). With ``balanced`` (peers declare
    their bandwidth to the averager, ``DecentralizedAverager(bandwidth=...)``) hivemind chooses the
    fractions by a linear program that minimises the slowest peer's time
    (``hivemind.averaging.load_balancing``); the same LP is solved here (scipy ``linprog``).
    Without (no peer declared one, as ddlscope's collaborative peers: hivemind.Optimizer's
    default) every peer gets ``1/N``.

    A peer the LP gives nothing (``x_i = 0``: with 3 or more peers, one much slower than the
    others) is only a client, and hivemind 1.1.12 sends such a peer its averaged parts only after
    it has sent all of its own (``AllReduceRunner.should_delay_results``): its upload and download
    do not overlap, ``2 * nbytes / bw_i``. Measured on emulated links (benchmarks/averaging_links.py:
    200/100/20 Mbit/s, 16 MiB: 13.7 s measured, 13.4 s so, 6.7 s with overlap).

    Args:
        nbytes: bytes averaged (the vector's size).
        bandwidths_gb_per_s: each peer's link, 1e9 bytes/s (the smaller of its upload and download).
        latencies_s: each peer's one-way latency; the round pays the largest twice.
        fixed_s: per-round fixed cost.
        balanced: fractions from hivemind's LP (True) or equal (False).

    Returns 0 for one peer or nothing to average.
    """
    n = len(bandwidths_gb_per_s)
    if n < 2 or nbytes <= 0:
        return 0.0
    bw = [b * 1e9 for b in bandwidths_gb_per_s]
    fractions = [1.0 / n] * n
    if n > 2 and balanced:
        from scipy.optimize import linprog

        # variables x_1..x_n, T: minimise T s.t. nbytes (1 + (n-2) x_i) / bw_i <= T, sum x = 1, x >= 0
        c = [0.0] * n + [1.0]
        a_ub = [[(nbytes * (n - 2) / bw[i]) if j == i else 0.0 for j in range(n)] + [-1.0] for i in range(n)]
        b_ub = [-nbytes / bw[i] for i in range(n)]
        res = linprog(c, A_ub=a_ub, b_ub=b_ub, A_eq=[[1.0] * n + [0.0]], b_eq=[1.0],
                      bounds=[(0, 1)] * n + [(0, None)], method="highs")
        if res.success:
            fractions = [float(x) for x in res.x[:n]]
    wire = max(2 * nbytes / b if x < 1e-9 else nbytes * (1 + (n - 2) * x) / b for x, b in zip(fractions, bw))
    return fixed_s + 2 * max(latencies_s) + wire


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


def busy_per_node(cluster: ClusterSpec, workers: int) -> int:
    """Devices of one node computing at once when ``workers`` workers are placed node-major."""
    return min(workers, cluster.devices_per_node)


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


def exposed_loading_s(profile: WorkloadProfile, batch: float, loader_workers: int, compute_s: float) -> float:
    """Seconds of data loading on the critical path of a step that computes for ``compute_s``:
    all of the batch's loading when it happens in the main process (``loader_workers == 0``),
    else what prefetching loader workers cannot hide behind the compute."""
    load = profile.data_load_s(batch, loader_workers)
    return load if loader_workers == 0 else max(0.0, load - compute_s)
