"""``ddlscope calibrate``: measure a cluster description among local workers.

Thesis 002 (ch. 5.1.2) took the latency and bandwidth between GPUs from NVIDIA's
p2pBandwidthLatencyTest. Here ``workers`` local processes (gloo over loopback, each pinned to its
own cores with ``threads`` intra-op threads) run four microbenchmarks:

1. **all-reduce** of float32 tensors from 4 KiB to 64 MiB (mean of ``repeats``, see below; one
   repeat's time is the slowest worker's) -> least-squares fit of the ring all-reduce cost (Patarasuk &
   Yuan 2009; the communication term of thesis 002 eq. 5.1)
   ``t = collective_fixed_s + 2(W-1) latency_s + 2(W-1)/W x bytes / bandwidth``.
2. **point-to-point ping-pong** between workers 0 and 1 -> ``t_oneway = latency_s + bytes /
   bandwidth`` (Hockney's alpha-beta model). A fixed cost of one send/recv pair cannot be told
   apart from the latency with a ping-pong alone, so the whole intercept is the latency and
   ``p2p_fixed_s`` is 0.
3. **concurrent compute slowdown**: a convolution timed on each worker alone and on all workers
   at once (shared memory bandwidth, caches, clocks) -> ratio, at least 1.
4. **communication overlap**: compute alone (Tc), an all-reduce alone (Tm), and the all-reduce
   launched asynchronously while the same compute runs (Tb) ->
   ``overlap = clamp((Tc + Tm - Tb) / min(Tc, Tm), 0, 1)``.

The fit gives the latency from (2) and puts the rest of the all-reduce intercept into
``collective_fixed_s`` (the two are not separable from all-reduce timings alone). Fits weight
every size equally in relative terms (robust least squares on log times, :func:`fit_alpha_beta`), so
that the small sizes that set the intercept are not drowned by the large ones, and a size disturbed
by other load on the machine does not drag the fit.

Every figure is a 10 %-trimmed mean of the repeats (:func:`ddlscope.measure.stats.trimmed_mean`; a
repeat of a collective lasts as long as its slowest worker). Not the median: with gloo over loopback, mid-size messages (64 KiB to
1 MiB) take one of two times, ~0.5 or ~3.5 ms for 1 MiB, in varying proportions even on an idle
machine; a prediction sums many calls, so it needs the mean, and the median flips between the two
modes from run to run. The trimming drops single wild repeats (a preemption).

Two optional measurements follow: ``--hivemind`` trains a reference network in short hivemind
swarms among the workers (:mod:`ddlscope.profiling.swarm`, the collaborative model's overhead), and
``--dmoe``, after the workers are done, times hivemind's beam searches and remote expert calls
between an expert server and a client pinned to two cores (:mod:`ddlscope.profiling.dmoe_rpc`, the
``cluster.dmoe`` fit of the dmoe model).

Every worker is a child process (``python -m ddlscope.profiling.calibrate --rank R``) that dies with
its parent (Linux ``PR_SET_PDEATHSIG``) and is terminated, then killed, when calibration ends,
fails or is interrupted. Workers exchange nothing with the parent but files in a temporary folder
(plan, progress, results, errors).
"""

from __future__ import annotations

import os
import platform
import signal
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ddlscope.errors import UserError
from ddlscope.launch.processes import (die_with_parent, log_tail, sigterm_as_interrupt, start_process, stop_processes,
                                       stop_signals_held)
from ddlscope.measure.stats import time_call, trimmed_mean
from ddlscope.modeling.cluster import ClusterSpec, CollectiveFit, DeviceSpec, HivemindFit, LinkSpec
from ddlscope.profiling.dmoe_rpc import DMoECalibration
from ddlscope.profiling.dmoe_rpc import describe as describe_dmoe

KIB = 1024
MIB = 1024**2
#: 4 KiB, 16 KiB, ..., 64 MiB (log-spaced by 4x).
DEFAULT_SIZES_BYTES = [4 * KIB * 4**k for k in range(8)]
DEFAULT_REPEATS = 20
#: ``--quick``: fewer sizes and repeats (a few seconds of measuring; used by tests), and shorter swarms.
QUICK_SIZES_BYTES = [4 * KIB, 64 * KIB, 1 * MIB, 8 * MIB]
QUICK_REPEATS = 10  # the fewest at which the 10 %-trimmed mean cuts a wild repeat from each end
#: ``--quick``: global epochs timed per hivemind swarm (the full calibration's: ``swarm.EPOCHS``)
QUICK_SWARM_EPOCHS = 4
#: all-reduce size of the overlap test (a DDP bucket is 25 MiB by default; smaller keeps it short).
OVERLAP_BYTES = 4 * MIB
FSDP_UNITS, FSDP_WIDTH = 8, 32
"""The FSDP microbenchmark: this many linear units of this width (4 KiB of parameters each)."""
FSDP_LARGE_UNITS, FSDP_LARGE_WIDTH, FSDP_LARGE_BATCH = 2, 2048, 32
"""FSDP in a training step: units of 16 MiB (ResNet-18's largest blocks are 14 and 18 MiB)."""
DDP_UNITS, DDP_WIDTH, DDP_BATCH = 8, 1024, 256
"""DDP in a training step: 32 MiB of gradients in 3 buckets, behind ~0.1 s of compute per step."""
#: the reference training steps are repeated this many times ``repeats``: their rates come from a
#: difference of two step times, and with 20 repeats three calibrations' FSDP rate spread by
#: +-7 %, with 60 by +-3 %
IN_STEP_REPEATS_FACTOR = 3


class CalibrationError(RuntimeError):
    """A calibration worker failed or timed out (the message names the worker and why)."""


# ------------------------------------------------------------------------------------ fitting
class SizeFit(BaseModel):
    """Measured and fitted seconds per message size; ``residuals`` = (fitted - measured) / measured."""

    model_config = ConfigDict(extra="forbid")

    sizes_bytes: list[int]
    measured_s: list[float]
    fitted_s: list[float]
    min_s: list[float] | None = Field(None, description="fastest repeat per size (for reference; the fit uses measured_s)")

    @property
    def residuals(self) -> list[float]:
        return [(f - m) / m for f, m in zip(self.fitted_s, self.measured_s)]

    @property
    def max_abs_residual(self) -> float:
        return max(abs(r) for r in self.residuals)


class P2PFit(BaseModel):
    """Ping-pong fit ``t_oneway = latency_s + bytes / (bandwidth_gb_per_s * 1e9)``."""

    model_config = ConfigDict(extra="forbid")

    latency_s: float
    bandwidth_gb_per_s: float
    table: SizeFit


class AllReduceFit(BaseModel):
    """Ring all-reduce fit ``t = intercept_s + 2(W-1)/W x bytes / (bandwidth_gb_per_s * 1e9)``,
    ``intercept_s = collective_fixed_s + 2(W-1) x latency_s`` (Patarasuk & Yuan 2009; thesis 002 eq. 5.1).

    ``collective_fixed_s`` is clamped at 0 when the latency alone explains more than the intercept.
    """

    model_config = ConfigDict(extra="forbid")

    workers: int
    intercept_s: float
    latency_s: float
    collective_fixed_s: float
    bandwidth_gb_per_s: float
    table: SizeFit


#: Scale of the robust fit's Cauchy loss: log-residuals well beyond ~10 % barely pull on the fit.
ROBUST_F_SCALE = 0.1


def fit_alpha_beta(x: Sequence[float], t_s: Sequence[float]) -> tuple[float, float]:
    """Fit ``t = a + b x`` (``a >= 0``, ``b > 0``) robustly, every size weighing the same in relative terms.

    First the non-negative least-squares fit of the relative errors ``(a + b x_i - t_i) / t_i``
    (:func:`scipy.optimize.nnls`); from there, as M-estimators usually start, the robust fit
    ``min sum rho(log(a + b x_i) - log t_i)`` with the Cauchy loss ``rho`` (scale
    :data:`ROBUST_F_SCALE`; :func:`scipy.optimize.least_squares`). The Cauchy loss is not convex:
    from a start pulled flat by one wild small size it can settle on a flat line that writes the
    largest sizes off as outliers, so the robust fit also starts from the line through the two
    largest sizes and from the line through the smallest and the largest, and the fit with the
    lowest robust cost wins. Log residuals make a size measured
    2x too slow and one 2x too fast count alike; the Cauchy loss keeps a few sizes disturbed by
    other load on the machine (a scheduler delay of milliseconds on a 40-microsecond message) from
    dragging the fit. When most sizes are disturbed no fit can tell; the residuals show it.

    Args:
        x: abscissae (e.g. bytes), all > 0, at least 2 distinct values.
        t_s: measured seconds, all > 0, same length as ``x``.

    Returns:
        ``(a, b)``: intercept in seconds and slope in seconds per unit of ``x``.

    Raises:
        ValueError: fewer than 2 distinct ``x``, lengths differ, an ``x`` or time that is not > 0.
    """
    from scipy.optimize import least_squares, nnls

    xs = np.asarray(x, dtype=float)
    ts = np.asarray(t_s, dtype=float)
    if xs.shape != ts.shape or xs.ndim != 1:
        raise ValueError(f"x and t_s must be 1-D of equal length (got {xs.shape} and {ts.shape})")
    if len(np.unique(xs)) < 2:
        raise ValueError("need at least 2 distinct sizes to fit a latency and a bandwidth")
    if not (np.all(ts > 0) and np.all(np.isfinite(ts)) and np.all(xs > 0)):
        raise ValueError(f"sizes and times must be finite and > 0 (got sizes {xs.tolist()}, times {ts.tolist()})")
    scale = np.array([ts.min(), ts.max() / xs.max()])  # work in units where both parameters are ~1
    design = np.stack([np.ones_like(xs), xs], axis=1) * scale / ts[:, None]
    starts = [np.maximum(nnls(design, np.ones_like(ts))[0], 1e-6)]
    order = np.argsort(xs)
    for i, j in ((order[-2], order[-1]), (order[0], order[-1])):  # two-point lines (distinct x: sorted ends)
        if xs[j] > xs[i]:
            slope = max((ts[j] - ts[i]) / (xs[j] - xs[i]), 1e-12 * scale[1])
            starts.append(np.maximum([max(ts[j] - slope * xs[j], 0.0) / scale[0], slope / scale[1]], 1e-6))

    def log_residuals(p: np.ndarray) -> np.ndarray:
        return np.log(p[0] * scale[0] + p[1] * scale[1] * xs) - np.log(ts)

    fits = [least_squares(log_residuals, start, bounds=([0.0, 1e-12], [np.inf, np.inf]), loss="cauchy",
                          f_scale=ROBUST_F_SCALE) for start in starts]
    a, b = min(fits, key=lambda f: f.cost).x * scale
    return float(a), float(b)


def fit_p2p(sizes_bytes: Sequence[int], oneway_s: Sequence[float]) -> P2PFit:
    """Latency and bandwidth from one-way point-to-point times (Hockney's alpha-beta model).

    Raises:
        ValueError: as :func:`fit_alpha_beta`, or the times do not grow with size (the bandwidth
            term is under 1 % of the largest size's time: no bandwidth can be fitted).
    """
    a, b = fit_alpha_beta(sizes_bytes, oneway_s)
    if b * max(sizes_bytes) < 0.01 * max(oneway_s):
        raise ValueError("point-to-point times do not grow with message size: no bandwidth can be fitted; "
                         "use larger sizes")
    fitted = [a + b * s for s in sizes_bytes]
    return P2PFit(latency_s=a, bandwidth_gb_per_s=1.0 / b / 1e9,
                  table=SizeFit(sizes_bytes=list(sizes_bytes), measured_s=list(oneway_s), fitted_s=fitted))


def fit_allreduce(sizes_bytes: Sequence[int], times_s: Sequence[float], workers: int, latency_s: float) -> AllReduceFit:
    """Fixed cost and bandwidth of a ring all-reduce from its times, given the link latency.

    Model (Patarasuk & Yuan 2009; thesis 002 eq. 5.1's communication term):
    ``t = collective_fixed_s + 2(W-1) latency_s + 2(W-1)/W x bytes / bandwidth``. The intercept and
    the slope are fitted (:func:`fit_alpha_beta` on ``x = 2(W-1)/W x bytes``); ``latency_s`` (from the
    point-to-point test) is subtracted from the intercept, the rest is ``collective_fixed_s``.

    Args:
        sizes_bytes: message sizes (bytes per worker, input side).
        times_s: seconds of one all-reduce at each size.
        workers: W >= 2.
        latency_s: link latency (seconds), >= 0.

    Raises:
        ValueError: W < 2, negative latency, bad times (see :func:`fit_alpha_beta`), or times that
            do not grow with size.
    """
    if workers < 2:
        raise ValueError(f"workers = {workers}; an all-reduce fit needs >= 2")
    if latency_s < 0:
        raise ValueError(f"latency_s = {latency_s}; must be >= 0")
    traffic = 2.0 * (workers - 1) / workers
    a, b = fit_alpha_beta([traffic * s for s in sizes_bytes], times_s)
    if b * traffic * max(sizes_bytes) < 0.01 * max(times_s):
        raise ValueError("all-reduce times do not grow with message size: no bandwidth can be fitted; use larger sizes")
    fitted = [a + b * traffic * s for s in sizes_bytes]
    return AllReduceFit(workers=workers, intercept_s=a, latency_s=latency_s,
                        collective_fixed_s=max(0.0, a - 2 * (workers - 1) * latency_s),
                        bandwidth_gb_per_s=1.0 / b / 1e9,
                        table=SizeFit(sizes_bytes=list(sizes_bytes), measured_s=list(times_s), fitted_s=fitted))


def fit_half_ring(sizes_bytes: Sequence[int], times_s: Sequence[float], workers: int, latency_s: float) -> CollectiveFit:
    """Fixed cost and bandwidth of a ring all-gather or reduce-scatter from its times.

    Model: ``t = fixed_s + (W-1) latency_s + (W-1)/W x full_bytes / bandwidth`` (half of a ring
    all-reduce; Patarasuk & Yuan 2009), fitted like :func:`fit_allreduce`.

    Raises:
        ValueError: W < 2, or times that do not grow with size (see :func:`fit_alpha_beta`).
    """
    if workers < 2:
        raise ValueError(f"workers = {workers}; a collective fit needs >= 2")
    traffic = (workers - 1) / workers
    a, b = fit_alpha_beta([traffic * x for x in sizes_bytes], times_s)
    if b * traffic * max(sizes_bytes) < 0.01 * max(times_s):
        raise ValueError("collective times do not grow with message size: no bandwidth can be fitted")
    return CollectiveFit(fixed_s=_sig(max(0.0, a - (workers - 1) * latency_s)), bandwidth_gb_per_s=_sig(1.0 / b / 1e9))


def overlap_fraction(compute_s: float, comm_s: float, both_s: float) -> float:
    """Fraction of the shorter of compute and communication hidden when both run at once:
    ``clamp((Tc + Tm - Tb) / min(Tc, Tm), 0, 1)`` (1: fully hidden, 0: serialised or worse)."""
    shorter = min(compute_s, comm_s)
    if shorter <= 0:
        return 1.0
    return min(1.0, max(0.0, (compute_s + comm_s - both_s) / shorter))


# ------------------------------------------------------------------------------------ result
def _linear_bytes(width: int) -> int:
    """Parameter bytes of one ``torch.nn.Linear(width, width)`` of the reference stacks (float32)."""
    return 4 * (width * width + width)


def fit_in_step_rates(workers: int, fsdp_unit_fixed_s: float, collective_fixed_s: float,
                      fsdp_large: tuple[float, float], ddp: tuple[float, float],
                      notes: list[str] | None = None) -> tuple[float | None, float | None]:
    """In-step communication rates (GB/s of traffic per worker) of FSDP and DDP training steps.

    A collective inside a training step costs more than the same collective alone: FSDP copies
    every unit into and out of flat buffers and allocates the unsharded parameters afresh, DDP
    copies gradients into buckets, and on CPU devices gloo's threads take turns with autograd on
    the worker's cores. So the reference steps are timed plain and wrapped (seconds per step;
    :func:`_reference_steps`) and the difference, less the fixed per-unit or per-bucket costs, is
    divided into the bytes each worker moves:

    * fsdp: ``(wrapped - plain) / FSDP_LARGE_UNITS - fsdp_unit_fixed_s`` seconds per unit for
      :func:`~ddlscope.modeling.collectives.fsdp_unit_traffic_bytes` (two all-gathers and a reduce-scatter);
    * ddp: ``wrapped - plain - buckets x collective_fixed_s`` seconds per step for
      :func:`~ddlscope.modeling.collectives.ddp_step_traffic_bytes` of the 32 MiB of gradients.

    Args:
        fsdp_large / ddp: (plain, wrapped) seconds per step of the reference stacks.
        notes: where a rate that cannot be fitted (wrapping made no step slower) is explained.

    Returns:
        ``(fsdp_step_gb_per_s, ddp_step_gb_per_s)``, each None when it cannot be fitted.
    """
    from ddlscope.distribution.ddp import DDP_DEFAULT_BUCKET_CAP_BYTES, ddp_buckets
    from ddlscope.modeling.collectives import ddp_step_traffic_bytes, fsdp_unit_traffic_bytes

    fsdp_extra = (fsdp_large[1] - fsdp_large[0]) / FSDP_LARGE_UNITS - fsdp_unit_fixed_s
    buckets = ddp_buckets([_linear_bytes(DDP_WIDTH)] * DDP_UNITS, DDP_DEFAULT_BUCKET_CAP_BYTES)
    ddp_extra = ddp[1] - ddp[0] - len(buckets) * collective_fixed_s
    rates: list[float | None] = []
    for name, extra, traffic in (
            ("fsdp", fsdp_extra, fsdp_unit_traffic_bytes(_linear_bytes(FSDP_LARGE_WIDTH), workers, reshard=True)),
            ("ddp", ddp_extra, ddp_step_traffic_bytes(_linear_bytes(DDP_WIDTH) * DDP_UNITS, workers))):
        if extra > 0:
            rates.append(traffic / extra / 1e9)
        else:
            rates.append(None)
            if notes is not None:
                notes.append(f"{name} reference steps were no slower than plain ones ({extra * 1e3:+.1f} ms beyond the "
                             f"fixed costs, noise): {name}_step_gb_per_s left unset")
    return rates[0], rates[1]


class CalibrationResult(BaseModel):
    """What :func:`calibrate` measured and fitted (seconds, bytes, GB/s = 1e9 bytes/s).

    Attributes:
        cluster: the fitted description: 1 node of ``workers`` devices of kind ``local``; its
            ``intra_node`` link has the point-to-point latency and the all-reduce bandwidth
            (what eq. 5.1 needs), ``collective_fixed_s`` the rest of the all-reduce intercept.
        allreduce / p2p: the fits with their measured and fitted times per size.
        compute_alone_s / compute_concurrent_s: mean seconds of the compute kernel on one worker
            alone / on all at once (averaged over workers); their ratio is the raw slowdown.
        overlap_*: seconds of compute alone, an ``overlap_bytes`` all-reduce alone, and both at
            once; ``comm_overlap_raw`` is the unclamped overlap fraction.
        fsdp_* / ddp_*: seconds per training step of the reference linear stacks, plain and under
            FSDP2 (tiny units: :data:`FSDP_UNITS`; large: :data:`FSDP_LARGE_UNITS`) or DDP
            (:data:`DDP_UNITS`), from which :func:`fit_in_step_rates` fits the in-step rates.
        hivemind_swarms: with ``hivemind``, every timed global epoch of each reference swarm
            (:func:`ddlscope.profiling.swarm.swarm_epochs`), from which the hivemind fit comes.
        dmoe: with ``dmoe``, the beam searches and remote expert calls measured and their fit
            (:mod:`ddlscope.profiling.dmoe_rpc`); None without, or when it failed (a note says why).
    """

    model_config = ConfigDict(extra="forbid")

    cluster: ClusterSpec
    workers: int
    threads: int
    cores: list[list[int]]
    repeats: int
    allreduce: AllReduceFit
    p2p: P2PFit
    compute_kernel: str
    compute_alone_s: float
    compute_concurrent_s: float
    concurrent_compute_slowdown_raw: float
    overlap_bytes: int
    overlap_compute_s: float
    overlap_allreduce_s: float
    overlap_both_s: float
    comm_overlap_raw: float
    fsdp_plain_step_s: float = 0.0
    fsdp_sharded_step_s: float = 0.0
    fsdp_large_plain_step_s: float = 0.0
    fsdp_large_sharded_step_s: float = 0.0
    ddp_plain_step_s: float = 0.0
    ddp_step_s: float = 0.0
    hivemind_swarms: list[dict[str, Any]] = Field(default_factory=list)
    dmoe: DMoECalibration | None = None
    hostname: str
    cpu: str
    torch_version: str
    created_at: float
    elapsed_s: float
    notes: list[str] = Field(default_factory=list)


# ------------------------------------------------------------------------------------ workers
def _compute_kernel():
    """A convolution forward of a few milliseconds on one core: 16x32x32x32 input, 32->32 3x3 filters."""
    import torch

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 32, 32, 32, generator=gen)
    conv = torch.nn.Conv2d(32, 32, 3, padding=1)

    def run() -> None:
        with torch.no_grad():
            conv(x)

    return run


COMPUTE_KERNEL = "conv2d forward, input 16x32x32x32, 32->32 channels 3x3 (0.30 GFLOP)"


def _measure(rank: int, workers: int, plan: dict[str, Any], say: Callable[[str], None]) -> dict[str, Any]:
    """The four microbenchmarks, run by every worker in lockstep; returns this worker's raw times."""
    import torch
    import torch.distributed as dist

    sizes, repeats, warmup = plan["sizes_bytes"], plan["repeats"], plan["warmup"]
    out: dict[str, Any] = {"allreduce": [], "allgather": [], "reducescatter": [], "p2p": []}  # times per size

    def collective(size: int) -> dict[str, Callable[[], Any]]:
        """The collectives the distribution models use, on a tensor of ``size`` bytes in full."""
        full, shard = torch.zeros(size // 4), torch.zeros(max(1, size // 4 // workers))
        gathered = torch.zeros(shard.numel() * workers)
        return {"allreduce": lambda: dist.all_reduce(full),  # ddp
                "allgather": lambda: dist.all_gather_into_tensor(gathered, shard),  # fsdp before compute
                "reducescatter": lambda: dist.reduce_scatter_tensor(shard, gathered)}  # fsdp after backward

    for kind in ("allreduce", "allgather", "reducescatter"):  # 1. collectives
        for size in sizes:
            fn = collective(size)[kind]
            for _ in range(warmup):
                fn()
            times = []
            for _ in range(repeats):
                dist.barrier()
                times.append(time_call(fn))
            out[kind].append(times)
            label = {"allreduce": "all-reduce", "allgather": "all-gather", "reducescatter": "reduce-scatter"}[kind]
            say(f"{label:>14} {_fmt_bytes(size):>9}: {trimmed_mean(times) * 1e3:9.3f} ms (worker 0, mean of {repeats})")

    for size in sizes:  # 2. ping-pong between workers 0 and 1
        buf = torch.zeros(size // 4)
        dist.barrier()
        times = []
        for i in range(warmup + repeats):
            if rank == 0:
                t0 = time.perf_counter()
                dist.send(buf, 1)
                dist.recv(buf, 1)
                if i >= warmup:
                    times.append((time.perf_counter() - t0) / 2)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)
        dist.barrier()
        if rank == 0:
            out["p2p"].append(times)
            say(f"ping-pong  {_fmt_bytes(size):>9}: {trimmed_mean(times) * 1e3:9.3f} ms one way (mean of {repeats})")

    kernel = _compute_kernel()  # 3. compute alone vs all at once
    for _ in range(warmup + 1):
        kernel()
    reps = max(10, repeats)
    alone, together = [], []
    for _ in range(reps):  # interleaved, so that a change in the machine's load hits both alike
        for r in range(workers):
            dist.barrier()
            if rank == r:
                alone.append(time_call(kernel))
        dist.barrier()
        together.append(time_call(kernel))
    out["compute_alone"], out["compute_together"] = alone, together
    say(f"compute kernel: {trimmed_mean(alone) * 1e3:.2f} ms alone, {trimmed_mean(together) * 1e3:.2f} ms "
        f"with {workers} workers at once (worker 0, mean of {reps})")

    buf = torch.zeros(plan["overlap_bytes"] // 4)  # 4. overlap of an async all-reduce with compute
    for _ in range(warmup):
        dist.all_reduce(buf)
    comm = []
    for _ in range(reps):
        dist.barrier()
        comm.append(time_call(lambda: dist.all_reduce(buf)))
    n = torch.tensor([max(1, round(trimmed_mean(comm) / trimmed_mean(together)))])
    dist.broadcast(n, 0)  # every worker runs the same number of kernels
    n_kernels = int(n.item())

    def compute() -> None:
        for _ in range(n_kernels):
            kernel()

    def both() -> None:
        work = dist.all_reduce(buf, async_op=True)
        compute()
        work.wait()

    comp, both_t, comm2 = [], [], []
    for _ in range(reps):  # interleaved, so that a change in load hits all three alike
        dist.barrier()
        comp.append(time_call(compute))
        dist.barrier()
        both_t.append(time_call(both))
        dist.barrier()
        comm2.append(time_call(lambda: dist.all_reduce(buf)))
    out["overlap"] = {"compute": comp, "comm": comm2, "both": both_t, "kernels": n_kernels}
    say(f"overlap: compute {trimmed_mean(comp) * 1e3:.2f} ms, all-reduce {_fmt_bytes(plan['overlap_bytes'])} "
        f"{trimmed_mean(comm2) * 1e3:.2f} ms, both {trimmed_mean(both_t) * 1e3:.2f} ms (worker 0)")

    # 5. FSDP's own cost per unit, on units too small to compute; 6. FSDP and DDP inside training steps
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    wrapper_names = {DistributedDataParallel: "DDP", fully_shard: "FSDP2"}
    for key, wrap, units, width, batch in (("fsdp", fully_shard, FSDP_UNITS, FSDP_WIDTH, 4),
                                           ("fsdp_large", fully_shard, FSDP_LARGE_UNITS, FSDP_LARGE_WIDTH,
                                            FSDP_LARGE_BATCH),
                                           ("ddp", DistributedDataParallel, DDP_UNITS, DDP_WIDTH, DDP_BATCH)):
        out[key] = _reference_steps(wrap, units, width, batch, IN_STEP_REPEATS_FACTOR * reps, warmup)
        plain_ms, wrapped_ms = trimmed_mean(out[key]["plain"]) * 1e3, trimmed_mean(out[key]["wrapped"]) * 1e3
        say(f"{wrapper_names[wrap]}: {units} units of {width}x{width}, batch {batch}: {plain_ms:.2f} ms plain, "
            f"{wrapped_ms:.2f} ms under {wrapper_names[wrap]} per step (worker 0, mean of {IN_STEP_REPEATS_FACTOR * reps})")
    return out


def _reference_steps(wrap, units: int, width: int, batch: int, reps: int, warmup: int) -> dict[str, list[float]]:
    """Training steps of ``units`` linear layers of ``width`` at ``batch``, plain and wrapped with
    ``wrap`` (``fully_shard``: FSDP2 on every layer, as the ``fsdp`` strategy wraps a network; or
    ``DistributedDataParallel``: DDP with its default 25 MiB buckets, as the ``ddp`` strategy does); seconds per step of each (every repeat starts at a barrier). The two
    are timed in turn, repeat by repeat, so that a change in load hits both alike: the rates come
    from their difference. A step is the training step (:func:`ddlscope.workloads.step.train_step`:
    cross-entropy over the last layer's outputs, SGD with momentum 0.9)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from ddlscope.workloads.step import build_optimizer, train_step

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(units)])

    def stepper(model: torch.nn.Module) -> Callable[[], None]:
        opt = build_optimizer(model.parameters(), "sgd")
        x = torch.randn(batch, width)
        y = torch.randint(0, width, (batch,))  # the last layer's outputs taken as class logits

        def step() -> None:
            train_step(model, opt, x, y)

        for _ in range(warmup + 1):
            step()
        return step

    plain_step = stepper(build())
    wrapped = build()
    if wrap is DistributedDataParallel:
        wrapped = DistributedDataParallel(wrapped)
    else:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in wrapped:
            fully_shard(layer, mesh=mesh)
        fully_shard(wrapped, mesh=mesh)
    wrapped_step = stepper(wrapped)
    times: dict[str, list[float]] = {"plain": [], "wrapped": []}
    for _ in range(reps):
        for kind, step in (("plain", plain_step), ("wrapped", wrapped_step)):
            dist.barrier()
            times[kind].append(time_call(step))
    return times


def _worker_main(argv: list[str] | None = None) -> int:
    """Entry point of one calibration worker: ``python -m ddlscope.profiling.calibrate --rank R --dir D``.

    Reads ``D/plan.json``; rank 0 appends progress lines to ``D/progress.log``; writes its raw times
    to ``D/result-R.json`` or the reason it failed to ``D/error-R.txt``. Exit codes: 0 done,
    1 failed, 130 interrupted.
    """
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m ddlscope.profiling.calibrate")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--parent-pid", type=int, required=True)
    args = ap.parse_args(argv)
    die_with_parent(signal.SIGKILL)  # SIGKILL this worker when the calibrating process dies (no orphans)
    if os.getppid() != args.parent_pid:  # the parent died before PR_SET_PDEATHSIG took effect
        return 1
    workdir, rank = args.dir, args.rank
    try:
        with open(os.path.join(workdir, "plan.json")) as f:
            plan = json.load(f)
        workers, threads = plan["workers"], plan["threads"]
        os.sched_setaffinity(0, plan["core_sets"][rank])
        if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(workdir, 'store')}", rank=rank,
                                world_size=workers, timeout=timedelta(seconds=plan["timeout_s"]))

        def say(msg: str) -> None:
            if rank == 0:
                with open(os.path.join(workdir, "progress.log"), "a") as log:
                    log.write(msg + "\n")

        out = _measure(rank, workers, plan, say) if plan.get("collectives", True) else {}
        if plan.get("hivemind"):  # 6. hivemind's own per-epoch cost and overshoot, on a reference network
            from ddlscope.launch.processes import route_hivemind_sockets
            from ddlscope.profiling.swarm import measure_swarm

            route_hivemind_sockets(workdir)  # its socket files go with the calibration's folder

            out["swarm"] = measure_swarm(rank, workers, plan["swarm_epochs"], plan["timeout_s"], say,
                                         plan["matchmaking_time_s"], tuple(plan["swarm_reference"]),
                                         tuple(plan["swarm_batch_sizes"]))
        dist.barrier()
        tmp = os.path.join(workdir, f".result-{rank}.json")
        with open(tmp, "w") as f:
            json.dump(out, f)
        os.replace(tmp, os.path.join(workdir, f"result-{rank}.json"))
        dist.destroy_process_group()
        return 0
    except KeyboardInterrupt:
        return 130
    except BaseException as e:  # the parent reads it, names this worker, and stops the others
        first_line = (str(e).strip().splitlines() or [""])[0]
        with open(os.path.join(workdir, f"error-{rank}.txt"), "w") as f:
            f.write(f"{type(e).__name__}: {first_line}")
        return 1


STOP_GRACE_S = 3.0
"""Seconds a calibration worker gets between SIGTERM and SIGKILL when calibration ends."""


class ProgressWatchdog:
    """Expires once ``timeout_s`` seconds (of ``clock``) pass without :meth:`progress` (or since it was made)."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.timeout_s, self.clock = timeout_s, clock
        self.last = clock()

    def progress(self) -> None:
        self.last = self.clock()

    def expired(self) -> bool:
        return self.clock() - self.last > self.timeout_s


def _run_workers(plan: dict[str, Any], progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """Start ``plan["workers"]`` worker processes, relay rank 0's progress, return every worker's raw times.

    The watchdog is on progress, not on the whole run: the calibration fails when rank 0 reports
    no finished measurement for ``plan["timeout_s"]`` seconds. A slow machine still finishes (a
    whole ``--hivemind`` calibration outlasted a 300 s limit on this 2-core machine on a slow
    evening, stop 32), and a hang still fails within the limit of its last progress.

    Raises:
        CalibrationError: a worker failed, died without a result, or no measurement finished for
            ``plan["timeout_s"]`` seconds. Every worker is stopped before this returns or raises.
    """
    import json
    import subprocess
    import sys

    workers = plan["workers"]
    procs: list[subprocess.Popen] = []
    watchdog = ProgressWatchdog(plan["timeout_s"])
    with tempfile.TemporaryDirectory(prefix="ddlscope-calibrate-") as tmp:
        with open(os.path.join(tmp, "plan.json"), "w") as f:
            json.dump(plan, f)
        # the workers import the same ddlscope as this process, wherever it was imported from
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        pythonpath = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p)
        progress_path, seen, last_line = os.path.join(tmp, "progress.log"), 0, ""

        def relay() -> None:
            """Pass on rank 0's new progress lines; each one restarts the watchdog."""
            nonlocal seen, last_line
            try:
                with open(progress_path) as f:
                    f.seek(seen)
                    chunk = f.read()
            except FileNotFoundError:
                return
            complete = chunk[:chunk.rfind("\n") + 1]
            seen += len(complete.encode())
            for line in complete.splitlines():
                progress(line)
                last_line = line
                watchdog.progress()

        with sigterm_as_interrupt():  # a SIGTERM stops the workers and removes the folder, as Ctrl-C does
            try:
                for rank in range(workers):  # each in a process group of its own (ddlscope.launch.processes)
                    with stop_signals_held():
                        procs.append(start_process(
                            [sys.executable, "-m", "ddlscope.profiling.calibrate", "--rank", str(rank), "--dir", tmp,
                             "--parent-pid", str(os.getpid())], os.path.join(tmp, f"worker-{rank}.log"),
                            plan["threads"],
                            # TMPDIR: what the children's multiprocessing puts in temporary folders (pymp-*) is
                            # removed with this folder, also when a child is killed before it could remove it
                            env_extra={"PYTHONPATH": pythonpath, "TMPDIR": tmp}))
                while True:
                    relay()
                    for rank, p in enumerate(procs):
                        err_path = os.path.join(tmp, f"error-{rank}.txt")
                        if os.path.exists(err_path) and p.poll() is not None:
                            with open(err_path) as f:
                                raise CalibrationError(f"calibration worker {rank} failed: {f.read().strip()}")
                        if p.poll() not in (None, 0):
                            tail = log_tail(os.path.join(tmp, f"worker-{rank}.log"))
                            raise CalibrationError(f"calibration worker {rank} exited with code {p.returncode} without a "
                                                   f"result" + (f": {tail}" if tail else " (killed?)"))
                    if all(p.poll() == 0 for p in procs):
                        break
                    if watchdog.expired():
                        relay()
                        running = [r for r, p in enumerate(procs) if p.poll() is None]
                        tails = "; ".join(f"worker {r}: {log_tail(os.path.join(tmp, f'worker-{r}.log'), 1) or 'no output'}"
                                          for r in running)
                        raise CalibrationError(f"calibration made no progress for {plan['timeout_s']:g} s; workers still "
                                               f"running: {running}; last step: {last_line or 'none'}; {tails}")
                    time.sleep(0.1)
                relay()
                results = []
                for rank in range(workers):
                    path = os.path.join(tmp, f"result-{rank}.json")
                    if not os.path.exists(path):
                        raise CalibrationError(f"calibration worker {rank} exited without writing its result")
                    with open(path) as f:
                        results.append(json.load(f))
                return results
            finally:
                stop_processes(procs, STOP_GRACE_S)


# ------------------------------------------------------------------------------------ calibrate
def _fmt_bytes(n: int) -> str:
    return f"{n / MIB:g} MiB" if n >= MIB else f"{n / KIB:g} KiB"


#: cores busier than this (percent, just before starting) make calibrate note that others interfered
BUSY_PERCENT = 20.0


def _busy_percent(cores: list[int], interval_s: float = 0.5) -> float:
    """Mean utilisation (percent) of ``cores`` over ``interval_s`` seconds (psutil)."""
    import psutil

    per_cpu = psutil.cpu_percent(interval=interval_s, percpu=True)
    return statistics.fmean(per_cpu[c] for c in cores if c < len(per_cpu)) if per_cpu else 0.0


def _sig(value: float, digits: int = 4) -> float:
    """``value`` rounded to ``digits`` significant digits."""
    return float(f"{value:.{digits - 1}e}") if value else 0.0


def _slowest(per_worker: list[list[float]]) -> list[float]:
    """Per repeat, the slowest worker's time (a collective ends when its last worker does)."""
    return [max(ts) for ts in zip(*per_worker)]


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _check_swarm_reference(reference: tuple[str, str]) -> tuple[str, str]:
    """``reference`` as (network, dataset shape) when the zoo can build it, else UserError naming what is allowed."""
    from ddlscope.workloads.models import DATASET_FAMILIES, NETWORKS, network_takes

    network, dataset = reference
    if network not in NETWORKS:
        raise UserError(f"swarm network {network!r}; allowed: a zoo network, one of {', '.join(NETWORKS)}")
    if dataset not in DATASET_FAMILIES:
        raise UserError(f"swarm dataset {dataset!r}; allowed: a dataset shape, one of {', '.join(DATASET_FAMILIES)}")
    why = network_takes(network, dataset)
    if why:
        raise UserError(f"swarm network {network!r} on {dataset!r}: {why}")
    return network, dataset


def _core_sets(workers: int, threads: int) -> list[list[int]]:
    """Each worker's cores: ``threads`` of this process's cores each, in order.

    Raises:
        UserError: workers < 2, threads < 1, or more cores than this process may use.
    """
    from ddlscope.config import available_cores

    if workers < 2:
        raise UserError(f"--workers {workers}: calibrate needs at least 2 workers (all-reduce and ping-pong need a "
                        f"partner); allowed: 2..{len(available_cores()) // max(1, threads)}")
    if threads < 1:
        raise UserError(f"--threads {threads}; allowed: >= 1")
    cores = available_cores()
    if workers * threads > len(cores):
        raise UserError(f"--workers {workers} x --threads {threads} needs {workers * threads} cores, but this process "
                        f"may use {len(cores)} ({cores}); allowed: workers x threads <= {len(cores)}")
    return [cores[i * threads:(i + 1) * threads] for i in range(workers)]


def _swarm_plan(matchmaking_time_s: float | None, swarm_epochs: int | None, swarm_reference: tuple[str, str] | None,
                swarm_batch_sizes: list[int] | None) -> dict[str, Any]:
    """The hivemind swarms' part of a worker plan, defaults filled in (:mod:`ddlscope.profiling.swarm`).

    Raises:
        UserError: see :func:`calibrate` (matchmaking time, swarm epochs, reference, batch sizes).
    """
    from ddlscope.profiling.swarm import BATCH_SIZES, EPOCHS, MATCHMAKING_S, REFERENCE

    swarm_epochs = EPOCHS if swarm_epochs is None else swarm_epochs
    if swarm_epochs < 2:
        raise UserError(f"swarm_epochs = {swarm_epochs}; allowed: >= 2 (the fit needs 2 whole epochs after the first)")
    matchmaking_time_s = MATCHMAKING_S if matchmaking_time_s is None else matchmaking_time_s
    if not matchmaking_time_s > 0:
        raise UserError(f"matchmaking time {matchmaking_time_s:g} s; allowed: > 0 seconds")
    swarm_reference = _check_swarm_reference(swarm_reference or REFERENCE)
    swarm_batch_sizes = list(BATCH_SIZES if swarm_batch_sizes is None else swarm_batch_sizes)
    if not swarm_batch_sizes or min(swarm_batch_sizes) < 1 or len(set(swarm_batch_sizes)) < len(swarm_batch_sizes):
        raise UserError(f"swarm batch sizes {swarm_batch_sizes}; allowed: one or more distinct sizes, each >= 1")
    return dict(matchmaking_time_s=float(matchmaking_time_s), swarm_epochs=int(swarm_epochs),
                swarm_reference=list(swarm_reference), swarm_batch_sizes=[int(b) for b in swarm_batch_sizes])


def _fit_hivemind(raw: list[dict[str, Any]], plan: dict[str, Any]) -> tuple[HivemindFit | None, list[dict[str, Any]],
                                                                           str | None]:
    """The hivemind fit from the workers' swarms (``raw[i]["swarm"]``), rounded to 4 significant digits:
    (fit, every timed global epoch of each swarm, None), or (None, [], why) where it cannot be fitted."""
    from ddlscope.profiling.swarm import fit_peer_startup, fit_swarm, swarm_epochs

    try:
        epochs = swarm_epochs([w["swarm"] for w in raw])
        fit = fit_swarm(epochs, raw[0]["swarm"]["param_bytes"], plan["matchmaking_time_s"],
                        tuple(plan["swarm_reference"]))
    except ValueError as e:
        return None, [], str(e)
    startup = fit_peer_startup([w["swarm"] for w in raw])
    fit = fit.model_copy(update={**{k: _sig(getattr(fit, k)) for k in ("epoch_overhead_s", "overhead_steps",
                                                                       "compute_overhead_s", "overshoot_steps",
                                                                       "epoch_cpu_s")},
                                 "overshoot_points": [(_sig(x), _sig(o)) for x, o in fit.overshoot_points],
                                 "step_pattern_s": [(_sig(m), _sig(d)) for m, d in fit.step_pattern_s],
                                 "step_epochs_s": [[[_sig(x) for x in peer] for peer in epoch]
                                                   for epoch in fit.step_epochs_s],
                                 "peer_startup_s": _sig(startup) if startup is not None else None})
    return fit, epochs, None


def calibrate_hivemind(workers: int = 2, threads: int = 1, timeout_s: float = 300.0,
                       progress: Callable[[str], None] | None = None, matchmaking_time_s: float | None = None,
                       swarm_epochs: int | None = None, swarm_reference: tuple[str, str] | None = None,
                       swarm_batch_sizes: list[int] | None = None) -> HivemindFit:
    """Only the hivemind swarms of :func:`calibrate` (``hivemind=True``): the fit of what hivemind
    adds per global epoch on these workers now, without the collectives (about a minute per swarm
    batch size on this project's 2 cores). The arguments are :func:`calibrate`'s.

    ``validate --hivemind-each-repeat`` measures it again before each round of runs
    (:func:`load_or_calibrate_hivemind`), to follow the machine's state as the profile does (two
    calibrations an hour apart on the same code read 1.94 and 1.50 s of overhead per epoch); each
    fit's overshoot comes from 10 epochs, whose noise (0.05-0.35 steps within 30 minutes) was
    larger than that drift in the one pass that tried it.

    Raises:
        UserError: as :func:`calibrate`.
        CalibrationError: a worker failed, died or timed out, or the swarms cannot be fitted.
    """
    plan = dict(workers=workers, threads=threads, core_sets=_core_sets(workers, threads), timeout_s=timeout_s,
                collectives=False, hivemind=True,
                **_swarm_plan(matchmaking_time_s, swarm_epochs, swarm_reference, swarm_batch_sizes))
    fit, _, why = _fit_hivemind(_run_workers(plan, progress or (lambda msg: None)), plan)
    if fit is None:
        raise CalibrationError(f"hivemind swarm not fitted: {why}")
    return fit


#: the file :func:`load_or_calibrate_hivemind` keeps its fit in, in its cache folder
HIVEMIND_FIT_FILE = "hivemind-fit.json"


def load_or_calibrate_hivemind(cache_dir: Path, refresh: bool = False, **options: Any) -> tuple[HivemindFit, bool]:
    """:func:`calibrate_hivemind` with ``options`` (its keyword arguments but ``progress``, which
    passes through), kept in ``cache_dir/hivemind-fit.json`` with the options it was measured with
    and read from there while they match (``refresh``: measured again even so), as
    :func:`ddlscope.profiling.profile.load_or_profile` keeps profiles.

    Returns:
        (the fit, whether it was read from the cache).

    Raises:
        as :func:`calibrate_hivemind`.
    """
    import json

    progress = options.pop("progress", None)
    key = {k: (list(v) if isinstance(v, (tuple, list)) else v) for k, v in sorted(options.items())}
    path = Path(cache_dir) / HIVEMIND_FIT_FILE
    if path.exists() and not refresh:
        try:
            kept = json.loads(path.read_text())
            if kept.get("options") == key:
                return HivemindFit.model_validate(kept["fit"]), True
        except (ValueError, KeyError, TypeError):
            pass  # an unreadable or older file: measured again
    fit = calibrate_hivemind(progress=progress, **options)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"options": key, "fit": fit.model_dump(mode="json")}, indent=1))
    os.replace(tmp, path)
    return fit, False


def calibrate(workers: int = 2, threads: int = 1, sizes_bytes: list[int] | None = None,
              repeats: int = DEFAULT_REPEATS, warmup: int = 2, timeout_s: float = 300.0,
              progress: Callable[[str], None] | None = None, name: str | None = None,
              hivemind: bool = False, matchmaking_time_s: float | None = None, dmoe: bool = False,
              swarm_epochs: int | None = None, swarm_reference: tuple[str, str] | None = None,
              swarm_batch_sizes: list[int] | None = None) -> CalibrationResult:
    """Measure this machine's workers and fit a :class:`ClusterSpec` (see the module docstring).

    Args:
        workers: local worker processes (W >= 2), each pinned to ``threads`` cores of its own.
        threads: intra-op threads and cores per worker.
        sizes_bytes: message sizes (bytes; rounded up to whole float32 elements); default
            :data:`DEFAULT_SIZES_BYTES` (4 KiB..64 MiB). At least 2 distinct sizes.
        repeats: timed repetitions per size (their trimmed mean is used); ``warmup`` untimed ones first.
        timeout_s: seconds; the calibration fails when no measurement finishes for this long
            (each progress line restarts the clock), and so does any single collective. Each
            hivemind swarm trains for at most this long.
        progress: called with one line of text per finished measurement.
        name: the cluster's name (default ``local-<W>x<threads>core``).
        hivemind: also train a reference network in two short hivemind swarms (each at most
            ``timeout_s``; on 2 cores 45-70 s each with ``--quick``, 110 and 80 s without) and fit
            what hivemind adds per global epoch (:mod:`ddlscope.profiling.swarm`); a swarm that
            cannot be fitted leaves ``hivemind`` unset, with a note.
        swarm_epochs: global epochs timed after the first in each hivemind swarm (>= 2; default
            :data:`ddlscope.profiling.swarm.EPOCHS`, ``--quick`` :data:`QUICK_SWARM_EPOCHS`).
        matchmaking_time_s: the swarm's hivemind matchmaking time (seconds, > 0; default
            :data:`ddlscope.profiling.swarm.MATCHMAKING_S`); use the one the predictions will use.
        swarm_reference: (zoo network, dataset shape) the hivemind swarms train (default
            :data:`ddlscope.profiling.swarm.REFERENCE`); the overshoot depends on the network, so
            the workload's own network predicts it best.
        swarm_batch_sizes: samples per step of each hivemind swarm, one swarm each (default
            :data:`ddlscope.profiling.swarm.BATCH_SIZES`); the workload's batch per peer predicts
            its overshoot best (one size: the overhead's slope is 0).
        dmoe: also time hivemind's beam searches and remote expert calls between an expert
            server and its clients on two cores (about 35 s; :mod:`ddlscope.profiling.dmoe_rpc`) and
            fit what they cost (``cluster.dmoe``); a measurement that fails or cannot be fitted
            leaves it unset, with a note.

    Returns:
        The fitted description and the raw measurements.

    Raises:
        UserError: workers < 2, threads < 1, more cores asked for than this process may use,
            fewer than 2 distinct sizes, a size or repeats < 1, matchmaking_time_s <= 0, swarm_epochs < 2,
            a swarm network or dataset shape the zoo does not have, or swarm batch sizes that are
            empty, repeated or < 1.
        CalibrationError: a worker failed, died or timed out (all workers are stopped first).
    """
    core_sets = _core_sets(workers, threads)
    if repeats < 1 or warmup < 0:
        raise UserError(f"repeats = {repeats}, warmup = {warmup}; allowed: repeats >= 1, warmup >= 0")
    sizes = sorted({max(4, -(-int(s) // 4) * 4) for s in (sizes_bytes or DEFAULT_SIZES_BYTES)})
    if any(int(s) < 1 for s in (sizes_bytes or [])) or len(sizes) < 2:
        raise UserError(f"sizes_bytes = {sizes_bytes}; allowed: at least 2 distinct sizes, each >= 1 byte")
    swarm = _swarm_plan(matchmaking_time_s, swarm_epochs, swarm_reference, swarm_batch_sizes)
    plan = dict(workers=workers, threads=threads, core_sets=core_sets, sizes_bytes=sizes, repeats=repeats,
                warmup=warmup, overlap_bytes=OVERLAP_BYTES, timeout_s=timeout_s, hivemind=hivemind, **swarm)
    say = progress or (lambda msg: None)
    busy_before = _busy_percent(sum(core_sets, []))
    say(f"calibrating {workers} workers x {threads} thread(s) on cores {core_sets} (gloo over loopback)")
    started = time.monotonic()
    raw = _run_workers(plan, say)
    dmoe_cal = None
    if dmoe:  # after the workers: the expert server and its client get the cores to themselves
        from ddlscope.profiling.dmoe_rpc import DEFAULT_TIMEOUT_S, calibrate_dmoe

        try:
            dmoe_cal = calibrate_dmoe(say, min(timeout_s, DEFAULT_TIMEOUT_S))
        except CalibrationError as e:
            dmoe_notes = [f"dmoe not calibrated ({e}): dmoe predictions leave hivemind's per-call cost out"]
        else:
            dmoe_notes = list(dmoe_cal.notes)
    elapsed = time.monotonic() - started

    ar_slowest = [_slowest([w["allreduce"][i] for w in raw]) for i in range(len(sizes))]
    ar_times = [trimmed_mean(ts) for ts in ar_slowest]
    p2p_times = [trimmed_mean(ts) for ts in raw[0]["p2p"]]
    try:
        p2p = fit_p2p(sizes, p2p_times)
        allreduce = fit_allreduce(sizes, ar_times, workers, p2p.latency_s)
    except ValueError as e:
        raise CalibrationError(f"cannot fit the measurements: {e}") from None
    half, half_notes = {}, []
    for kind in ("allgather", "reducescatter"):
        times = [trimmed_mean(_slowest([w[kind][i] for w in raw])) for i in range(len(sizes))]
        try:
            half[kind] = fit_half_ring(sizes, times, workers, p2p.latency_s)
        except ValueError as e:  # a noisy machine; the all-reduce is the same ring twice over
            half[kind] = CollectiveFit(fixed_s=_sig(allreduce.collective_fixed_s / 2),
                                       bandwidth_gb_per_s=_sig(allreduce.bandwidth_gb_per_s))
            half_notes.append(f"{kind} not fitted ({e}; measured {', '.join(f'{t * 1e3:.3g}' for t in times)} ms): "
                              f"it takes half the all-reduce's fixed cost and its bandwidth; calibrate again on a "
                              f"quieter machine for its own fit")
    allreduce.table.min_s = [min(ts) for ts in ar_slowest]
    p2p.table.min_s = [min(ts) for ts in raw[0]["p2p"]]
    alone = statistics.fmean(trimmed_mean(w["compute_alone"]) for w in raw)
    together = statistics.fmean(trimmed_mean(w["compute_together"]) for w in raw)
    slowdown = statistics.fmean(trimmed_mean(w["compute_together"]) / trimmed_mean(w["compute_alone"])
                                for w in raw)
    tc = trimmed_mean(_slowest([w["overlap"]["compute"] for w in raw]))
    tm = trimmed_mean(_slowest([w["overlap"]["comm"] for w in raw]))
    tb = trimmed_mean(_slowest([w["overlap"]["both"] for w in raw]))
    overlap_raw = (tc + tm - tb) / min(tc, tm) if min(tc, tm) > 0 else 1.0
    notes = [
        "intra_node.latency_s is the ping-pong intercept (p2p_fixed_s = 0: not separable from the latency); "
        "intra_node.bandwidth_gb_per_s is the all-reduce fit's (it includes gloo's reduction and copies); "
        f"the ping-pong bandwidth was {p2p.bandwidth_gb_per_s:.3g} GB/s",
    ]
    if allreduce.intercept_s < 2 * (workers - 1) * p2p.latency_s:
        notes.append(f"the all-reduce intercept ({allreduce.intercept_s * 1e6:.1f} us) is below 2(W-1) x latency "
                     f"({2 * (workers - 1) * p2p.latency_s * 1e6:.1f} us): collective_fixed_s clamped to 0")
    if busy_before >= BUSY_PERCENT:
        notes.append(f"other processes kept the workers' cores {busy_before:.0f} % busy just before calibration "
                     f"started: the figures include their interference")
    notes += half_notes
    if dmoe:
        notes += dmoe_notes
    if slowdown < 1:
        notes.append(f"compute ran faster with all workers busy (ratio {slowdown:.3f}, noise): slowdown set to 1")
    from ddlscope.modeling.collectives import ring_allgather_s

    def step_s(key: str, kind: str) -> float:
        return trimmed_mean(_slowest([w[key][kind] for w in raw]))

    unit_bytes = _linear_bytes(FSDP_WIDTH)
    link = LinkSpec(bandwidth_gb_per_s=allreduce.bandwidth_gb_per_s, latency_s=p2p.latency_s)
    unit_collectives_s = (2 * ring_allgather_s(unit_bytes, workers, link, 0.0, half["allgather"])
                          + ring_allgather_s(unit_bytes, workers, link, 0.0, half["reducescatter"]))
    fsdp_unit_fixed = max(0.0, (step_s("fsdp", "wrapped") - step_s("fsdp", "plain")) / FSDP_UNITS - unit_collectives_s)
    fsdp_step_rate, ddp_step_rate = fit_in_step_rates(
        workers, fsdp_unit_fixed, allreduce.collective_fixed_s,
        fsdp_large=(step_s("fsdp_large", "plain"), step_s("fsdp_large", "wrapped")),
        ddp=(step_s("ddp", "plain"), step_s("ddp", "wrapped")), notes=notes)
    swarm, swarm_raw = None, []
    if hivemind:
        swarm, swarm_raw, why = _fit_hivemind(raw, plan)
        if swarm is None:
            notes.append(f"hivemind swarm not fitted ({why}): collaborative predictions leave hivemind's own work out")
    cluster = ClusterSpec(  # 4 significant digits: far more than the measurements' precision
        name=name or f"local-{workers}x{threads}core", nodes=1, devices_per_node=workers,
        device=DeviceSpec(kind="local"),
        intra_node=LinkSpec(bandwidth_gb_per_s=_sig(allreduce.bandwidth_gb_per_s), latency_s=_sig(p2p.latency_s)),
        collective_fixed_s=_sig(allreduce.collective_fixed_s), p2p_fixed_s=0.0,
        concurrent_compute_slowdown=_sig(max(1.0, slowdown)), comm_overlap=_sig(overlap_fraction(tc, tm, tb)),
        p2p_link=LinkSpec(bandwidth_gb_per_s=_sig(p2p.bandwidth_gb_per_s), latency_s=_sig(p2p.latency_s)),
        all_gather=half["allgather"], reduce_scatter=half["reducescatter"], fsdp_unit_fixed_s=_sig(fsdp_unit_fixed),
        fsdp_step_gb_per_s=fsdp_step_rate and _sig(fsdp_step_rate), ddp_step_gb_per_s=ddp_step_rate and _sig(ddp_step_rate),
        hivemind=swarm, dmoe=dmoe_cal.fit if dmoe_cal else None,
    )
    import torch

    return CalibrationResult(
        cluster=cluster, workers=workers, threads=threads, cores=core_sets, repeats=repeats, allreduce=allreduce,
        p2p=p2p, compute_kernel=COMPUTE_KERNEL, compute_alone_s=alone, compute_concurrent_s=together,
        concurrent_compute_slowdown_raw=slowdown, overlap_bytes=OVERLAP_BYTES, overlap_compute_s=tc,
        overlap_allreduce_s=tm, overlap_both_s=tb, comm_overlap_raw=overlap_raw,
        fsdp_plain_step_s=step_s("fsdp", "plain"), fsdp_sharded_step_s=step_s("fsdp", "wrapped"),
        fsdp_large_plain_step_s=step_s("fsdp_large", "plain"), fsdp_large_sharded_step_s=step_s("fsdp_large", "wrapped"),
        ddp_plain_step_s=step_s("ddp", "plain"), ddp_step_s=step_s("ddp", "wrapped"), hivemind_swarms=swarm_raw, dmoe=dmoe_cal,
        hostname=platform.node(),
        cpu=_cpu_name(), torch_version=torch.__version__, created_at=time.time(), elapsed_s=elapsed, notes=notes,
    )


def header_comment(result: CalibrationResult) -> str:
    """The comment written at the top of a calibrated cluster file: how, where and when it was measured."""
    when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(result.created_at))
    ar, p2p = result.allreduce, result.p2p
    return (f"Measured by `ddlscope calibrate --workers {result.workers} --threads {result.threads}` on {when}\n"
            f"host {result.hostname} ({result.cpu}), torch {result.torch_version}, gloo over loopback, cores {result.cores}\n"
            f"sizes {_fmt_bytes(ar.table.sizes_bytes[0])}..{_fmt_bytes(ar.table.sizes_bytes[-1])}, trimmed mean of "
            f"{result.repeats}; all-reduce fit max |residual| {ar.table.max_abs_residual:.0%}, ping-pong "
            f"{p2p.table.max_abs_residual:.0%}\n"
            f"ping-pong: latency {p2p.latency_s * 1e6:.1f} us, bandwidth {p2p.bandwidth_gb_per_s:.3g} GB/s; "
            f"all-reduce: intercept {ar.intercept_s * 1e6:.1f} us, bandwidth {ar.bandwidth_gb_per_s:.3g} GB/s\n"
            + (f"dmoe (hivemind expert server and client on cores {result.dmoe.server_core} and "
               f"{result.dmoe.client_core}): {describe_dmoe(result.dmoe.fit)}\n" if result.dmoe else "")
            + "\n".join(result.notes))


def _rate(gb_per_s: float | None) -> str:
    return "not fitted" if gb_per_s is None else f"{gb_per_s:.3g} GB/s"


def print_calibration(result: CalibrationResult, console=None) -> None:
    """Print the measurements, the fits with their residuals, and the fitted description (rich).

    Args:
        console: a :class:`rich.console.Console`; default one on stdout at the terminal's width
            (columns wrap or fold when it is narrow).
    """
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    ar, p2p = result.allreduce, result.p2p
    table = Table(title=f"ddlscope calibrate: {result.workers} workers x {result.threads} thread(s), "
                        f"trimmed mean of {result.repeats}")
    for col in ("size", "all-reduce ms", "fit ms", "residual", "one-way p2p ms", "fit ms", "residual"):
        table.add_column(col, justify="right", overflow="fold")
    for i, size in enumerate(ar.table.sizes_bytes):
        table.add_row(_fmt_bytes(size), f"{ar.table.measured_s[i] * 1e3:.3f}", f"{ar.table.fitted_s[i] * 1e3:.3f}",
                      f"{ar.table.residuals[i]:+.0%}", f"{p2p.table.measured_s[i] * 1e3:.3f}",
                      f"{p2p.table.fitted_s[i] * 1e3:.3f}", f"{p2p.table.residuals[i]:+.0%}")
    console = console or Console()
    console.print(table)
    c = result.cluster
    rows: list[tuple[str, str]] = [
        ("ping-pong fit", f"latency {p2p.latency_s * 1e6:.1f} us, bandwidth {p2p.bandwidth_gb_per_s:.3g} GB/s"),
        ("all-reduce fit", f"intercept {ar.intercept_s * 1e6:.1f} us = collective_fixed_s {ar.collective_fixed_s * 1e6:.1f} us"
                           f" + 2(W-1) x latency; bandwidth {ar.bandwidth_gb_per_s:.3g} GB/s"),
        *[(f"{name} fit", f"fixed {fit.fixed_s * 1e6:.1f} us + (W-1) x latency; bandwidth {fit.bandwidth_gb_per_s:.3g} GB/s")
          for name, fit in (("all-gather", c.all_gather), ("reduce-scatter", c.reduce_scatter)) if fit is not None],
        ("fsdp", f"{FSDP_UNITS} tiny units: {result.fsdp_plain_step_s * 1e3:.2f} ms plain, {result.fsdp_sharded_step_s * 1e3:.2f} ms "
                 f"sharded per step: fsdp_unit_fixed_s {c.fsdp_unit_fixed_s * 1e3:.2f} ms beyond the fitted collectives"),
        ("fsdp in a step", f"{FSDP_LARGE_UNITS} units of {_fmt_bytes(4 * FSDP_LARGE_WIDTH ** 2)}: "
                           f"{result.fsdp_large_plain_step_s * 1e3:.1f} ms plain, {result.fsdp_large_sharded_step_s * 1e3:.1f} ms "
                           f"sharded: fsdp_step_gb_per_s {_rate(c.fsdp_step_gb_per_s)}"),
        ("ddp in a step", f"{_fmt_bytes(4 * DDP_WIDTH ** 2 * DDP_UNITS)} of gradients: {result.ddp_plain_step_s * 1e3:.1f} ms "
                          f"plain, {result.ddp_step_s * 1e3:.1f} ms under DDP: ddp_step_gb_per_s {_rate(c.ddp_step_gb_per_s)}"),
        ("compute", f"{result.compute_alone_s * 1e3:.2f} ms alone, {result.compute_concurrent_s * 1e3:.2f} ms all at once: "
                    f"concurrent_compute_slowdown {c.concurrent_compute_slowdown:.3f} (raw {result.concurrent_compute_slowdown_raw:.3f})"),
        ("overlap", f"compute {result.overlap_compute_s * 1e3:.2f} ms, all-reduce {_fmt_bytes(result.overlap_bytes)} "
                    f"{result.overlap_allreduce_s * 1e3:.2f} ms, both {result.overlap_both_s * 1e3:.2f} ms: comm_overlap "
                    f"{c.comm_overlap:.2f} (raw {result.comm_overlap_raw:.2f})"),
    ]
    if c.hivemind is not None:
        hm = c.hivemind
        rows.append(("hivemind", f"{hm.reference}: {hm.epoch_overhead_s:.2f} s + {hm.overhead_steps:.2f} steps per "
                                 f"global epoch beyond compute ({hm.compute_overhead_s:.2f} s of it in the steps) "
                                 f"({hm.epoch_cpu_s:.2f} CPU-s of hivemind's processes), overshoot "
                                 + (", ".join(f"{o:.2f} steps at {x:.2f} s steps" for x, o in hm.overshoot_points)
                                    or f"{hm.overshoot_steps:.2f} steps") + f" per peer, at matchmaking "
                                 f"{hm.matchmaking_time_s:g} s"
                                 + ("; in the steps by position after the round: "
                                    + ", ".join(f"{m:+.2f} s (sd {d:.2f})" for m, d in hm.step_pattern_s)
                                    if hm.step_pattern_s else "")
                                 + (f" ({len(hm.step_epochs_s)} global epochs kept whole, every peer's steps, "
                                    "for the epoch-ending rule)"
                                    if hm.step_epochs_s else "")
                                 + (f"; a joining peer starts in {hm.peer_startup_s:.1f} s"
                                    if hm.peer_startup_s is not None else "")))
    if c.dmoe is not None:
        rows.append(("dmoe", describe_dmoe(c.dmoe)))
    for label, text in rows:
        console.print(f"[bold]{escape(label)}[/bold]: {escape(text)}")
    for note in result.notes:
        console.print(f"note: {note}", markup=False)
    console.print(f"took {result.elapsed_s:.1f} s")


if __name__ == "__main__":
    code = _worker_main()
    # no interpreter teardown: hivemind's and gloo's background threads can hang it; the result is written
    os._exit(code)
