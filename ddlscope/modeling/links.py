"""A cluster as an emulated network puts it, for predicting runs on emulated links.

:func:`over_links` rewrites a calibrated :class:`~ddlscope.modeling.cluster.ClusterSpec` so that
its workers are peers on links of given rates (:mod:`ddlscope.network.emulated`), at the share of
the rate a link carries each way with both ways busy; :func:`links_goodput` measures that share
(:mod:`ddlscope.network.duplex`). Used by ``ddlscope validate`` (the grids' ``bandwidths_mbit_per_s``
cells) and ``ddlscope recommend --swarm`` (a run config's emulated links). :func:`averaging_goodput`
measures what hivemind's own averaging rounds reach on such links (:mod:`ddlscope.network.averaging_probe`),
:func:`fsdp_goodput` what FSDP's unit collectives reach on them (:mod:`ddlscope.network.collective_probe`).
"""

from __future__ import annotations

import sys

from ddlscope.errors import UserError
from ddlscope.modeling.cluster import ClusterSpec, LinkSpec, PeerSpec
from ddlscope.modeling.collectives import contention
from ddlscope.network.emulated import BUCKET_MS, bucket_bytes


def over_links(cluster: ClusterSpec, rates_mbit_per_s: float | list[float], workers: int,
               both_ways: float = 1.0, averaging_share: float | None = None,
               fsdp_share: float | None = None, bucket_ms: float | None = BUCKET_MS) -> ClusterSpec:
    """``cluster`` as an emulated network of ``workers`` workers puts it: each worker a peer with a
    link of its rate (a list: worker i's at the i-th; latency as calibrated) and the devices' links
    at the slowest rate (a ring is as fast as its slowest link), for predicting a cell run on
    emulated links. Collectives send both ways at once, so the ring's and the peers' links carry
    ``both_ways`` of their rate each way (:func:`ddlscope.network.duplex.measure_duplex_goodput`);
    the pipelines' point-to-point link keeps the full rate (their activations and gradients take
    turns) and the links' token bucket: ``bucket_ms`` at the slowest rate, at least
    :data:`~ddlscope.network.emulated.BUCKET_MIN_BYTES` (``LinkSpec.burst_bytes``, as
    :mod:`ddlscope.network.emulated` sizes tbf's bucket; of two buckets in a row, the slower link's
    binds); None: no bucket. The peers keep the cluster's listed compute shares; where the cluster lists none they
    share this machine's cores, so each computes at ``1 / contention`` of a device alone
    (:func:`ddlscope.modeling.collectives.contention`). ``averaging_share``: the share of the rate
    that hivemind's averaging rounds reach on these links (:func:`averaging_goodput`); the
    collaborative model's rounds then hold the links at it (``ClusterSpec.averaging_efficiency`` =
    ``averaging_share / both_ways``, at most 1); None keeps the cluster's efficiency.
    ``fsdp_share``: the share of the slowest link's rate that FSDP's unit collectives reach on these
    links (:func:`fsdp_goodput`); fsdp's cost model then prices their wire time over
    ``ClusterSpec.fsdp_link`` at it; None keeps the cluster's ``fsdp_link``.

    Raises:
        ValueError: ``both_ways``, ``averaging_share`` or ``fsdp_share`` outside (0, 1], or ``bucket_ms`` <= 0.
    """
    if bucket_ms is not None and not bucket_ms > 0:
        raise ValueError(f"bucket_ms = {bucket_ms}; allowed: milliseconds > 0, or None for links without a bucket")
    if not 0 < both_ways <= 1 or not all(x is None or 0 < x <= 1 for x in (averaging_share, fsdp_share)):
        raise ValueError(f"both_ways = {both_ways}, averaging_share = {averaging_share}, fsdp_share = {fsdp_share}; "
                         "allowed: a share of the link's rate in (0, 1]")
    rates = rates_mbit_per_s if isinstance(rates_mbit_per_s, list) else [rates_mbit_per_s] * workers
    latency = cluster.intra_node.latency_s
    link = LinkSpec(bandwidth_gb_per_s=min(rates) * both_ways / 8e3, latency_s=latency)
    burst = 0.0 if bucket_ms is None else bucket_bytes(min(rates), bucket_ms)
    p2p = LinkSpec(bandwidth_gb_per_s=min(rates) / 8e3, latency_s=latency, burst_bytes=burst)
    shared = 1.0 / contention(cluster, min(workers, cluster.devices_per_node))
    shares = [p.compute_share for p in cluster.peers[:workers]] if len(cluster.peers) >= workers else [shared] * workers
    peers = [PeerSpec(compute_share=c, bandwidth_gb_per_s=r * both_ways / 8e3, latency_s=latency)
             for c, r in zip(shares, rates)]
    efficiency = cluster.averaging_efficiency if averaging_share is None else min(1.0, averaging_share / both_ways)
    fsdp = cluster.fsdp_link if fsdp_share is None else \
        LinkSpec(bandwidth_gb_per_s=min(rates) * fsdp_share / 8e3, latency_s=latency)
    return cluster.model_copy(update={"intra_node": link, "p2p_link": p2p, "peers": peers,
                                      "inter_node": link if cluster.inter_node is not None else None,
                                      "averaging_efficiency": efficiency, "fsdp_link": fsdp})


def links_goodput(rates_mbit_per_s: float | list[float], workers: int, bucket_ms: float = BUCKET_MS) -> float:
    """The share of its rate an emulated link of a grid entry carries each way with both ways busy:
    measured on the entry's two slowest links (:func:`ddlscope.network.duplex.measure_duplex_goodput`),
    or 1.0 (the full rate, with a warning on stderr) where emulated networks cannot be built.
    ``bucket_ms``: the links' token bucket (``[network] bucket_ms``)."""
    from ddlscope.network.duplex import measure_duplex_goodput

    rates = sorted(rates_mbit_per_s if isinstance(rates_mbit_per_s, list) else [rates_mbit_per_s] * workers)
    try:
        return measure_duplex_goodput(rates[0], rates[1] if len(rates) > 1 else rates[0], bucket_ms=bucket_ms).both_ways
    except UserError as err:
        print(f"validate: links of {rates} predicted at their full rate both ways ({err})", file=sys.stderr)
        return 1.0


def averaging_goodput(rates_mbit_per_s: float | list[float], workers: int, param_bytes: float) -> float | None:
    """The share of its rate that hivemind's averaging rounds reach over an emulated link entry, each
    peer on one core of this process's in turn (as a run places them), or None (with a warning on
    stderr) where emulated networks cannot be built or the probe fails: rounds among ``workers``
    peers (:func:`ddlscope.network.averaging_probe.measure_averaging_goodput`) of ``param_bytes``,
    or more where that would take less than :data:`~ddlscope.network.averaging_probe.WIRE_S` at the
    slowest link's rate. The share is the throughput of the rounds: a round's fixed costs
    (matchmaking left out, hivemind's per-round work) belong to the hivemind fit, and in short
    rounds they made it read 0.66-0.71 on 200 Mbit/s links, where the TCP share was 0.95."""
    from ddlscope.network.averaging_probe import WIRE_S, measure_averaging_goodput, one_core_each

    rates = (rates_mbit_per_s if isinstance(rates_mbit_per_s, list) else [rates_mbit_per_s] * workers)[:workers]
    megabytes = max(1.0, param_bytes / 2**20, WIRE_S * min(rates) * 1e6 / 8 / 2**20)
    try:
        return measure_averaging_goodput(rates, megabytes=megabytes,
                                         cores=one_core_each(workers)).share
    except (UserError, RuntimeError) as err:
        print(f"links of {rates}: hivemind's rounds priced at the TCP share ({err})", file=sys.stderr)
        return None


def fsdp_goodput(rates_mbit_per_s: float | list[float], workers: int, unit_bytes: list[int],
                 reshard: bool = True, bucket_ms: float = BUCKET_MS) -> float | None:
    """The share of the slowest link's rate that FSDP's unit collectives of ``unit_bytes`` (a
    profile's layers' parameter bytes) reach over an emulated link entry on gloo, each worker on one
    core of this process's in turn (as a run places them), or None (with a warning on stderr) where
    emulated networks cannot be built or the probe fails
    (:func:`ddlscope.network.collective_probe.measure_fsdp_goodput`). ``reshard``:
    ``reshard_after_forward`` (an all-gather in the backward too); ``bucket_ms``: the links' token
    bucket."""
    from ddlscope.network.averaging_probe import one_core_each
    from ddlscope.network.collective_probe import measure_fsdp_goodput

    rates = (rates_mbit_per_s if isinstance(rates_mbit_per_s, list) else [rates_mbit_per_s] * workers)[:workers]
    try:
        return measure_fsdp_goodput(rates, unit_bytes, reshard=reshard, cores=one_core_each(workers),
                                    bucket_ms=bucket_ms).share
    except (UserError, RuntimeError) as err:
        print(f"links of {rates}: fsdp's collectives priced at the TCP share ({err})", file=sys.stderr)
        return None
