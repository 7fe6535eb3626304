"""Building blocks the cost models share: collectives over links, contention, traffic, data loading.

Each distribution model's cost model (``ddlscope/distribution/<model>.py``) is built from these:
the time of a ring all-reduce / all-gather (Patarasuk & Yuan 2009), a tree broadcast, or of hivemind's butterfly
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
    calibrated ``fit`` its own fixed cost and bandwidth replace the all-reduce's, the bandwidth at
    most the link's (a fit measured on faster links than ``link``, e.g. loopback before an emulated
    slow network, cannot beat the wire).
    """
    if workers < 2 or nbytes <= 0:
        return 0.0
    if fit is not None:
        fixed_s, link = fit.fixed_s, LinkSpec(bandwidth_gb_per_s=min(fit.bandwidth_gb_per_s, link.bandwidth_gb_per_s),
                                              latency_s=link.latency_s)
    return fixed_s + (workers - 1) * (link.latency_s + nbytes / (workers * link.bandwidth_gb_per_s * 1e9))


def tree_broadcast_s(nbytes: float, workers: int, link: LinkSpec, fixed_s: float) -> float:
    """Seconds of a binomial-tree broadcast of ``nbytes`` from one worker to ``workers - 1`` others.

    ``fixed_s + ceil(log2 W) * (latency + nbytes / bandwidth)``: in each of the ``ceil(log2 W)``
    rounds every worker that has the data sends all of it to one that does not (Thakur,
    Rabenseifner & Gropp 2005, binomial tree: ``lg p (alpha + n beta)``). 0 for one worker.
    """
    if workers < 2 or nbytes <= 0:
        return 0.0
    rounds = (workers - 1).bit_length()  # ceil(log2 W)
    return fixed_s + rounds * (link.latency_s + nbytes / (link.bandwidth_gb_per_s * 1e9))


PEER_ROLES = ("trainer", "auxiliary", "client")
"""Roles of a peer in a hivemind averaging round: a ``trainer`` sends its vector and reduces a part;
an ``auxiliary`` peer (``hivemind.Optimizer(auxiliary=True)``) reduces a part and sends no vector of
its own; a ``client`` (``client_mode``: no incoming connections) sends its vector and reduces nothing."""


def butterfly_allreduce_s(nbytes: float, bandwidths_gb_per_s: list[float], latencies_s: list[float],
                          fixed_s: float = 0.0, balanced: bool = True, roles: list[str] | None = None) -> float:
    """Seconds of hivemind's butterfly all-reduce of ``nbytes`` among peers with these links.

    Of the N peers, T send a vector (trainers and clients). Peer i reduces a fraction ``x_i`` of the
    vector: it receives that part from the T senders and returns their average to them. A sender
    sends the other ``1 - x_i`` of its own vector and returns its averaged part to the T-1 other
    senders, ``nbytes * (1 + (T-2) x_i)`` bytes out (and as many in); an auxiliary peer,
    ``nbytes * T x_i``. They take ``bytes / bw_i`` when sending and receiving overlap (DeDLOC,
    Diskin et al. 2021, section 3.2). With ``balanced`` (peers declare their bandwidth to the
    averager, ``DecentralizedAverager(bandwidth=...)``) hivemind chooses the fractions by a linear
    program that minimises the slowest peer's time as if every peer sent a vector
    (``hivemind.averaging.load_balancing.optimize_parts_lp``: it knows no roles); the same LP is
    solved here (scipy ``linprog``) and the round is then timed with each role's true load. Without
    (no peer declared one: hivemind.Optimizer's default) every peer that may reduce gets an equal
    part. Clients reduce nothing in either case (hivemind gives a ``CLIENT`` peer bandwidth 0).

    A sender that reduces nothing (a client, or with 3 or more peers one much slower than the
    others under the LP) gets its averaged parts only after it has sent all of its own (hivemind
    1.1.12 ``AllReduceRunner.should_delay_results``): its upload and download do not overlap,
    ``2 * nbytes / bw_i``. Measured on emulated links (benchmarks/averaging_links.py: 200/100/20
    Mbit/s, 16 MiB: 13.7 s measured, 13.4 s so, 6.7 s with overlap).

    Args:
        nbytes: bytes averaged (the vector's size).
        bandwidths_gb_per_s: each peer's link, 1e9 bytes/s (the smaller of its upload and download).
        latencies_s: each peer's one-way latency; the round pays the largest twice.
        fixed_s: per-round fixed cost.
        balanced: fractions from hivemind's LP (True) or equal (False).
        roles: each peer's role (:data:`PEER_ROLES`); None: all trainers.

    Returns 0 when fewer than two peers send, or nothing is averaged.

    Raises:
        ValueError: ``roles`` of another length than the bandwidths, an unknown role, or every
            peer a client (nobody could reduce).
    """
    n = len(bandwidths_gb_per_s)
    roles = list(roles) if roles is not None else ["trainer"] * n
    if len(roles) != n or set(roles) - set(PEER_ROLES):
        raise ValueError(f"roles {roles}: allowed: one of {PEER_ROLES} per peer ({n} peers)")
    senders = sum(r != "auxiliary" for r in roles)
    if senders < 2 or nbytes <= 0:
        return 0.0
    reducers = [i for i, r in enumerate(roles) if r != "client"]
    if not reducers:
        raise ValueError("every peer is a client: nobody can reduce the vector; allowed: at least one trainer or "
                         "auxiliary peer")
    bw = [b * 1e9 for b in bandwidths_gb_per_s]
    # bytes out of peer i = nbytes * (const_i + slope_i * x_i)
    const = [0.0 if r == "auxiliary" else 1.0 for r in roles]
    slope = [float(senders) if r == "auxiliary" else float(senders - 2) for r in roles]
    fractions = [1.0 / len(reducers) if i in reducers else 0.0 for i in range(n)]
    if balanced and len(reducers) > 1 and n > 2:
        from scipy.optimize import linprog

        # hivemind's LP (optimize_parts_lp), which knows no roles: every reducer's load taken as
        # nbytes (1 + (n-2) x_i); minimise T s.t. (1 + (n-2) x_i) / bw_i <= T, sum x = 1, clients x = 0
        c = [0.0] * n + [1.0]
        a_ub = [[((n - 2) / bw[i]) if j == i else 0.0 for j in range(n)] + [-1.0] for i in reducers]
        b_ub = [-1.0 / bw[i] for i in reducers]
        bounds = [(0, 1) if i in reducers else (0, 0) for i in range(n)] + [(0, None)]
        res = linprog(c, A_ub=a_ub, b_ub=b_ub, A_eq=[[1.0] * n + [0.0]], b_eq=[1.0], bounds=bounds, method="highs")
        if res.success:
            fractions = [float(x) for x in res.x[:n]]

    def peer_s(i: int) -> float:
        if fractions[i] < 1e-9:
            return 0.0 if roles[i] == "auxiliary" else 2 * nbytes / bw[i]
        return nbytes * (const[i] + slope[i] * fractions[i]) / bw[i]

    return fixed_s + 2 * max(latencies_s) + max(peer_s(i) for i in range(n))


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


def gloo_reduce_scatter_s(nbytes: float, workers: int, link: LinkSpec, fixed_s: float) -> float:
    """Seconds of a reduce-scatter of ``nbytes`` (the full tensor) on torch's gloo backend: an
    all-reduce's (:func:`ring_allreduce_s`), as gloo reduces the whole tensor and each worker keeps
    its shard (torch 2.13; counted on an emulated link, see tests/test_emulated_network.py)."""
    return ring_allreduce_s(nbytes, workers, link, fixed_s)


def gloo_fsdp_step_wire_s(unit_bytes: list[float], workers: int, link: LinkSpec, reshard: bool = True) -> float:
    """Seconds of wire time of one FSDP step's unit collectives on CPU workers (gloo) over ``link``:
    per unit of ``unit_bytes[i]`` bytes, an all-gather in the forward, another in the backward with
    ``reshard`` (``reshard_after_forward``), and a reduce-scatter (:func:`gloo_reduce_scatter_s`);
    no fixed cost per call. What :mod:`ddlscope.network.collective_probe` divides by its measured
    step to read the share of a link's rate such steps reach."""
    gathers = 2 if reshard else 1
    return sum(gathers * ring_allgather_s(b, workers, link, 0.0) + gloo_reduce_scatter_s(b, workers, link, 0.0)
               for b in unit_bytes)


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
