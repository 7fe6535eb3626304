"""Known device kinds, and scaling a profile measured on one device to another.

A profile (:class:`~ddlscope.modeling.profile.WorkloadProfile`) is measured on the device at
hand. A cluster description may name another kind of device (``[cluster.device] kind =
"v100-16gb"``); :func:`compute_scale` then estimates how much faster or slower that device runs
the same training step, from a per-layer roofline model, and states how uncertain that is.

Figures in :data:`DEVICE_KINDS` are vendor datasheet peaks (float32 without tensor cores, memory
bandwidth, memory capacity); each entry names its source. No device kind other than ``local`` has
been measured on this project's machines, so the scaling is not validated: use it to rank
options, not to promise a time.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from ddlscope.errors import UserError
from ddlscope.modeling.profile import WorkloadProfile


class DeviceKind(NamedTuple):
    """Datasheet figures of one kind of device (``None`` for ``local``: the profiled device itself).

    Attributes:
        peak_tflops: float32 peak, 1e12 FLOP/s (CUDA cores, no tensor cores, no sparsity).
        memory_bandwidth_gb_per_s: peak device-memory bandwidth, 1e9 bytes/s.
        memory_gib: device memory as sold (vendors' "GB" of GPU memory are binary GiB); the usable
            amount is a little less (ECC, driver and context reservations).
        source: where the figures come from.
    """

    peak_tflops: float | None
    memory_bandwidth_gb_per_s: float | None
    memory_gib: float | None
    source: str


#: Known device kinds. ``local`` is the device the profile ran on (no scaling; its memory comes
#: from the profile). GPU figures: NVIDIA datasheets and architecture whitepapers, as named.
DEVICE_KINDS: dict[str, DeviceKind] = {
    "local": DeviceKind(None, None, None, "the device the profile was measured on (measured figures)"),
    "t4": DeviceKind(8.1, 320.0, 16.0, "NVIDIA T4 Tensor Core GPU datasheet (2019)"),
    "titan-rtx": DeviceKind(16.3, 672.0, 24.0, "NVIDIA Turing GPU architecture whitepaper, TITAN RTX column (2018); "
                                               "the GPU of thesis 002's cluster"),
    "rtx-2080-ti": DeviceKind(13.4, 616.0, 11.0, "NVIDIA Turing GPU architecture whitepaper, GeForce RTX 2080 Ti "
                                                 "reference clocks (2018)"),
    "v100-16gb": DeviceKind(15.7, 900.0, 16.0, "NVIDIA Tesla V100 datasheet, SXM2 (NVLink) variant (2018)"),
    "v100-32gb": DeviceKind(15.7, 900.0, 32.0, "NVIDIA Tesla V100 datasheet, SXM2 (NVLink) variant (2018)"),
    "rtx-3090": DeviceKind(35.6, 936.0, 24.0, "NVIDIA Ampere GA102 GPU architecture whitepaper, GeForce RTX 3090 (2020)"),
    "a100-40gb": DeviceKind(19.5, 1555.0, 40.0, "NVIDIA A100 Tensor Core GPU datasheet, A100 40GB SXM (2020)"),
    "a100-80gb": DeviceKind(19.5, 2039.0, 80.0, "NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM (2021)"),
    "l4": DeviceKind(30.3, 300.0, 24.0, "NVIDIA L4 Tensor Core GPU datasheet (2023)"),
    "h100-80gb": DeviceKind(67.0, 3350.0, 80.0, "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM (2023)"),
}

#: Multiplicative half-width of the stated band: the true factor is taken to lie within
#: ``[factor / UNCERTAINTY, factor * UNCERTAINTY]``. Not validated (no second device kind here);
#: see :func:`compute_scale` for why it is this wide.
UNCERTAINTY = 2.0

#: Training FLOPs per forward FLOP: backward ~ 2 x forward (input and weight gradients), so a
#: training step ~ 3 x forward (the usual rule, e.g. Kaplan et al. 2020, "Scaling laws", sec. 2.1).
TRAIN_FLOPS_PER_FORWARD_FLOP = 3.0

#: Below this predicted time per layer on a GPU, kernel-launch and framework overheads (a few
#: microseconds per kernel) dominate, which a roofline does not model.
LAUNCH_BOUND_LAYER_S = 20e-6


def known_kinds() -> str:
    """The known kinds as a comma-separated list (for error messages)."""
    return ", ".join(DEVICE_KINDS)


def device_kind(kind: str) -> DeviceKind:
    """The figures of ``kind``.

    Raises:
        UserError: unknown kind (the message lists the known ones).
    """
    try:
        return DEVICE_KINDS[kind]
    except KeyError:
        raise UserError(f"unknown device kind {kind!r}; allowed: {known_kinds()}") from None


class ScaleEstimate(NamedTuple):
    """Profiled compute seconds x ``factor`` = the estimate on the target device.

    Attributes:
        factor: best estimate (< 1: the target is faster).
        low, high: the stated uncertainty band (``low <= factor <= high``).
        method: how it was computed, with the assumptions, in words.
        warnings: conditions under which the estimate is less trustworthy than the band says.
    """

    factor: float
    low: float
    high: float
    method: str
    warnings: tuple[str, ...] = ()


def _roofline_s(flops: float, nbytes: float, peak_tflops: float, bandwidth_gb_per_s: float) -> float:
    """Williams, Waterman & Patterson 2009 ("Roofline"): time >= max(FLOPs / peak, bytes / bandwidth)."""
    return max(flops / (peak_tflops * 1e12), nbytes / (bandwidth_gb_per_s * 1e9))


def compute_scale(profile: WorkloadProfile, batch_size: int, target_kind: str) -> ScaleEstimate:
    """Factor by which the profiled compute time changes on ``target_kind`` (per-layer roofline).

    Method: for each layer ``i`` of the profile at ``batch_size``

    - ``F_i = 3 x forward_flops_per_sample x batch`` (forward + backward, see
      :data:`TRAIN_FLOPS_PER_FORWARD_FLOP`);
    - ``B_i = 3 x param_bytes + 2 x (output_bytes_per_sample + saved_bytes_per_sample) x batch``
      (weights read in forward and backward and gradients written; activations written in
      forward and read back in backward);
    - roofline time on a device ``r(d) = max(F_i / peak_flops(d), B_i / bandwidth(d))``
      (Williams et al. 2009), with the profiled device's MEASURED ``peak_tflops`` and
      ``memory_bandwidth_gb_per_s`` (:class:`~ddlscope.modeling.profile.DeviceProfile`) and the
      target's datasheet peaks (:data:`DEVICE_KINDS`);
    - the layer's factor is ``r(target) / r(profiled)``.

    The optimizer step is memory-bound (it streams parameters, gradients and state once), so its
    factor is the bandwidth ratio. The factors are averaged weighted by the measured seconds
    (layers' forward + backward at ``batch_size``, and the optimizer step), so the result
    multiplies the profiled step time.

    Uncertainty: the band is ``[factor / 2, factor x 2]`` (:data:`UNCERTAINTY`). Reasons: a
    roofline assumes every kernel reaches the same fraction of peak on both devices, but the
    profiled peak is a measured matmul rate while the target's is a datasheet number (cuBLAS
    SGEMM reaches roughly 70-90 % of it, convolutions and element-wise kernels less, and
    differently per architecture); CPU caches hold small layers that a DRAM-bandwidth roofline
    treats as memory-bound. The band is a judgement, NOT validated against a second device.
    Per-layer times below :data:`LAUNCH_BOUND_LAYER_S` on the target are flagged in ``warnings``:
    there launch overheads dominate and the factor is too optimistic (a lower bound).

    Args:
        profile: the measured workload.
        batch_size: per-device batch size the estimate is for (samples).
        target_kind: a key of :data:`DEVICE_KINDS`; ``local`` gives factor 1, band [1, 1].

    Raises:
        UserError: unknown ``target_kind`` or ``batch_size < 1``.
    """
    target = device_kind(target_kind)
    if batch_size < 1:
        raise UserError(f"batch_size = {batch_size}; allowed: >= 1")
    if target_kind == "local":
        return ScaleEstimate(1.0, 1.0, 1.0, "target is the profiled device (kind 'local'): no scaling")
    src = profile.device
    fwd_s, bwd_s = profile.layer_times_s(batch_size)
    weights: list[float] = []
    factors: list[float] = []
    target_layer_s: list[float] = []
    for layer, f_s, b_s in zip(profile.layers, fwd_s, bwd_s):
        flops = TRAIN_FLOPS_PER_FORWARD_FLOP * layer.forward_flops_per_sample * batch_size
        nbytes = 3.0 * layer.param_bytes + 2.0 * (layer.output_bytes_per_sample + layer.saved_bytes_per_sample) * batch_size
        r_src = _roofline_s(flops, nbytes, src.peak_tflops, src.memory_bandwidth_gb_per_s)
        r_tgt = _roofline_s(flops, nbytes, target.peak_tflops, target.memory_bandwidth_gb_per_s)
        factor = r_tgt / r_src if r_src > 0 else target_bandwidth_ratio(src.memory_bandwidth_gb_per_s, target)
        weights.append(f_s + b_s)
        factors.append(factor)
        target_layer_s.append((f_s + b_s) * factor)
    optimizer_s = profile.step_at(batch_size).optimizer_s
    weights.append(optimizer_s)
    factors.append(target_bandwidth_ratio(src.memory_bandwidth_gb_per_s, target))
    total = sum(weights)
    if total > 0:
        factor = sum(w * f for w, f in zip(weights, factors)) / total
    else:
        factor = sum(factors) / len(factors)
    warnings = []
    fast = [layer.name for layer, t in zip(profile.layers, target_layer_s) if 0 < t < LAUNCH_BOUND_LAYER_S]
    if fast:
        warnings.append(f"{len(fast)} of {len(profile.layers)} layers would take < {LAUNCH_BOUND_LAYER_S * 1e6:.0f} us "
                        f"on {target_kind} ({', '.join(fast[:4])}{', ...' if len(fast) > 4 else ''}): kernel-launch "
                        f"overheads dominate there, so the factor is a lower bound")
    method = (f"per-layer roofline (Williams et al. 2009): profiled {src.name} measured {src.peak_tflops:.3g} TFLOP/s, "
              f"{src.memory_bandwidth_gb_per_s:.3g} GB/s vs {target_kind} datasheet {target.peak_tflops:.3g} TFLOP/s, "
              f"{target.memory_bandwidth_gb_per_s:.3g} GB/s ({target.source}); layers weighted by measured time at "
              f"batch {batch_size}; band x/÷ {UNCERTAINTY:g}, a judgement not validated on a {target_kind}")
    if not math.isfinite(factor) or factor <= 0:
        raise UserError(f"cannot scale profile of {profile.network} to {target_kind}: factor {factor!r}")
    return ScaleEstimate(factor, factor / UNCERTAINTY, factor * UNCERTAINTY, method, tuple(warnings))


def target_bandwidth_ratio(profiled_bandwidth_gb_per_s: float, target: DeviceKind) -> float:
    """Time factor of a purely memory-bound kernel: profiled bandwidth / target bandwidth."""
    return profiled_bandwidth_gb_per_s / target.memory_bandwidth_gb_per_s
