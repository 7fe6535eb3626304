"""Known device kinds, and scaling a profile measured on one device to another.

A profile (:class:`~ddlscope.modeling.profile.WorkloadProfile`) is measured on the device at
hand (``ddlscope profile/recommend/validate --device cpu|cuda``). A cluster description may name
another kind of device (``[cluster.device] kind = "v100-16gb"``); :func:`compute_scale` then
estimates how much faster or slower that device runs the same training step, from a per-layer
roofline model, and states how uncertain that is: from a GPU profile it scales the measured
per-layer times with a launch-overhead floor; from a CPU profile it is a rough estimate (a CPU
cannot show a GPU's launch overheads). :func:`check_band` says whether a step time measured on
the target lies inside the stated band.

Figures in :data:`DEVICE_KINDS` are vendor datasheet peaks (float32 without tensor cores, memory
bandwidth, memory capacity); each entry names its source. The band of a scaling has been checked
against a measured step only for the pairs in :data:`BAND_CHECKS` (``compute_scale`` states the
check, or that there is none): use the scaling to rank options, not to promise a time.
"""

from __future__ import annotations

import math
import re
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
    "h200-141gb": DeviceKind(67.0, 4800.0, 141.0, "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM (2024)"),
}

#: How a GPU's name (``torch.cuda.get_device_name``, a profile's ``device.name``) identifies a kind
#: of :data:`DEVICE_KINDS`: the lower-case alphanumeric tokens of the name must include every
#: token of the first set and none of the second (e.g. "NVIDIA H100 80GB HBM3" -> ``h100-80gb``;
#: "NVIDIA H100 PCIe", a slower variant than the SXM datasheet's, matches no kind).
GPU_NAME_TOKENS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "t4": (frozenset({"t4"}), frozenset()),
    "titan-rtx": (frozenset({"titan", "rtx"}), frozenset()),
    "rtx-2080-ti": (frozenset({"2080", "ti"}), frozenset()),
    "v100-16gb": (frozenset({"v100", "16gb"}), frozenset({"pcie"})),
    "v100-32gb": (frozenset({"v100", "32gb"}), frozenset({"pcie"})),
    "rtx-3090": (frozenset({"3090"}), frozenset({"ti"})),
    "a100-40gb": (frozenset({"a100", "40gb"}), frozenset()),
    "a100-80gb": (frozenset({"a100", "80gb"}), frozenset({"pcie"})),
    "l4": (frozenset({"l4"}), frozenset()),
    "h100-80gb": (frozenset({"h100", "80gb"}), frozenset({"pcie", "nvl"})),
    "h200-141gb": (frozenset({"h200"}), frozenset({"nvl"})),  # torch names the SXM part "NVIDIA H200"
}

#: Multiplicative half-width of the stated band: the true factor is taken to lie within
#: ``[factor / UNCERTAINTY, factor * UNCERTAINTY]``. Checked only where :data:`BAND_CHECKS` says;
#: see :func:`compute_scale` for why it is this wide.
UNCERTAINTY = 2.0

#: What a measurement on the target said about the band, per (profiled kind, target kind); the
#: profiled kind of a CPU profile is ``"cpu"``. Each entry is one pass of ``benchmarks/gpu.py``
#: (docs/validation.md, "Profile, memory and scaling on a GPU"): the measured compute step on the
#: target over the estimate. :func:`compute_scale` puts the entry of its pair into its method.
BAND_CHECKS: dict[tuple[str, str], str] = {
    ("h100-80gb", "h200-141gb"): "checked once (2026-11-28, benchmarks/gpu.py): 4 of 4 workloads inside, the measured "
                                 "step x0.80-x1.39 of the estimate (ResNet-18/CIFAR-10 b64 and b256, ResNet-50/ImageNet "
                                 "b64, VGG-11/CIFAR-10 b64, the last host-bound)",
    ("cpu", "h100-80gb"): "checked once (2026-11-27, benchmarks/gpu.py): OUTSIDE, ResNet-18/CIFAR-10 b64 from 8 Xeon "
                          "cores measured x2.7 of the estimate (launch-bound on the GPU)",
}

#: Training FLOPs per forward FLOP: backward ~ 2 x forward (input and weight gradients), so a
#: training step ~ 3 x forward (the usual rule, e.g. Kaplan et al. 2020, "Scaling laws", sec. 2.1).
TRAIN_FLOPS_PER_FORWARD_FLOP = 3.0

#: Below this predicted time per layer on a GPU, kernel-launch and framework overheads (a few
#: microseconds per kernel) dominate, which a roofline does not model. Also the cap of the
#: launch floor :func:`launch_floors_s` takes from the cheapest layer of a GPU profile that has a
#: single measured batch size.
LAUNCH_BOUND_LAYER_S = 20e-6


def known_kinds() -> str:
    """The known kinds as a comma-separated list (for error messages)."""
    return ", ".join(DEVICE_KINDS)


#: The devices a profile can be measured on (``--device`` of ``profile``, ``recommend``, ``validate``).
PROFILE_DEVICES = ("cpu", "cuda")


def check_profile_device(device: str) -> None:
    """Pre-flight check of a ``--device`` to profile on, before anything starts.

    Raises:
        UserError: one line: ``device`` is not one of :data:`PROFILE_DEVICES`, or it is ``cuda`` and
            torch sees no CUDA GPU (:func:`ddlscope.config.check_device`'s message).
    """
    from ddlscope.config import check_device

    if device not in PROFILE_DEVICES:
        raise UserError(f"--device {device!r}; allowed: {', '.join(PROFILE_DEVICES)}")
    check_device(device, what=f"--device {device}")


def profiled_kind(device_name: str) -> str | None:
    """The key of :data:`DEVICE_KINDS` whose GPU ``device_name`` is (:data:`GPU_NAME_TOKENS`), or None."""
    tokens = set(re.findall(r"[a-z0-9]+", device_name.lower()))
    for kind, (required, excluded) in GPU_NAME_TOKENS.items():
        if required <= tokens and not excluded & tokens:
            return kind
    return None


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


def compute_scale(profile: WorkloadProfile, batch_size: int, target_kind: str) -> ScaleEstimate:
    """Factor by which the profiled compute time changes on ``target_kind`` (per-layer roofline).

    Per layer ``i`` of the profile at ``batch_size``:

    - ``F_i = 3 x forward_flops_per_sample x batch`` (forward + backward, see
      :data:`TRAIN_FLOPS_PER_FORWARD_FLOP`);
    - ``B_i = 3 x param_bytes + 2 x (output_bytes_per_sample + saved_bytes_per_sample) x batch``
      (weights read in forward and backward and gradients written; activations written in
      forward and read back in backward);
    - roofline time on a device ``r(d) = max(F_i / peak_flops(d), B_i / bandwidth(d))``
      (Williams et al. 2009), the target's from its datasheet peaks (:data:`DEVICE_KINDS`);
    - the layer's roofline ratio ``q_i = r(target) / r(profiled)``.

    The profiled device's peaks and the target layer times ``T_i`` depend on what was profiled
    (``t_i``: the layer's measured forward + backward seconds at ``batch_size``,
    :meth:`~ddlscope.modeling.profile.WorkloadProfile.layer_times_s`):

    - a GPU (``device.type == "cuda"``, :func:`_scale_from_gpu`): ``T_i = max(floor_i, t_i x q_i)``,
      where ``floor_i`` is the layer's launch and framework overhead estimated from the profile
      (:func:`launch_floors_s`): a layer at its floor does not speed up on a faster GPU. The
      profiled GPU's peaks are its kind's datasheet figures when its name matches a kind
      (:func:`profiled_kind`, so that both sides of the ratio are datasheet numbers), else the
      profile's measured ``peak_tflops`` and ``memory_bandwidth_gb_per_s``;
    - a CPU (:func:`_scale_from_cpu`): ``T_i = t_i x q_i`` with the CPU's measured peaks, a ROUGH
      estimate, and ``method`` says so: a CPU profile cannot show a GPU's kernel-launch
      overheads, so small layers come out too fast (flagged in ``warnings`` below
      :data:`LAUNCH_BOUND_LAYER_S`), and CPU caches hold small layers that a DRAM-bandwidth
      roofline treats as memory-bound.

    The optimizer step is memory-bound (it streams parameters, gradients and state once), so it
    scales by the bandwidth ratio. ``factor = (sum T_i + optimizer_s x bandwidth ratio) /
    (sum t_i + optimizer_s)``, so the result multiplies the profiled step time.

    Uncertainty: the band is ``[factor / 2, factor x 2]`` (:data:`UNCERTAINTY`). Reasons: a
    roofline assumes every kernel reaches the same fraction of peak on both devices, but
    datasheet peaks are not reached alike (cuBLAS SGEMM reaches roughly 70-90 % of them,
    convolutions and element-wise kernels less, and differently per architecture), and the
    launch floor is an estimate. The band is a judgement, checked against a measured step only for
    the pairs of :data:`BAND_CHECKS` (:func:`check_band` checks it where a step time on the target
    was measured); ``method`` states the check of its pair, or that there is none.

    Every non-``local`` kind is a GPU, so a GPU profile is never scaled to a CPU: a CPU cluster is
    the profiled CPU itself (kind ``local``).

    Args:
        profile: the measured workload.
        batch_size: per-device batch size the estimate is for (samples).
        target_kind: a key of :data:`DEVICE_KINDS`; ``local`` (the profiled device, CPU or GPU)
            gives factor 1, band [1, 1].

    Raises:
        UserError: unknown ``target_kind``, ``batch_size < 1``, or a factor that is not a
            positive finite number (a profile without times or FLOPs).
    """
    target = device_kind(target_kind)
    if batch_size < 1:
        raise UserError(f"batch_size = {batch_size}; allowed: >= 1")
    if target_kind == "local":
        return ScaleEstimate(1.0, 1.0, 1.0, "target is the profiled device (kind 'local'): no scaling")
    scale = _scale_from_gpu if profile.device.type == "cuda" else _scale_from_cpu
    factor, method, warnings = scale(profile, batch_size, target_kind, target)
    if not math.isfinite(factor) or factor <= 0:
        raise UserError(f"cannot scale profile of {profile.network} to {target_kind}: factor {factor!r}")
    check = BAND_CHECKS.get((profiled_kind(profile.device.name) if profile.device.type == "cuda" else "cpu",
                             target_kind))
    method += f"; band x/÷ {UNCERTAINTY:g}, " + (check or f"a judgement not validated on a {target_kind}")
    return ScaleEstimate(factor, factor / UNCERTAINTY, factor * UNCERTAINTY, method, tuple(warnings))


def _scale_from_gpu(profile: WorkloadProfile, batch_size: int, target_kind: str,
                    target: DeviceKind) -> tuple[float, str, list[str]]:
    """:func:`compute_scale` of a GPU profile: measured layer times x roofline ratio, floored at
    each layer's launch overhead. Returns (factor, method, warnings)."""
    src = profile.device
    matched = profiled_kind(src.name)
    if matched is not None:
        kind = DEVICE_KINDS[matched]
        peak_tflops, bandwidth, peaks = (kind.peak_tflops, kind.memory_bandwidth_gb_per_s,
                                         f"datasheet of {matched} (matched by name)")
    else:
        peak_tflops, bandwidth, peaks = src.peak_tflops, src.memory_bandwidth_gb_per_s, \
            "measured (name matches no known kind: measured matmul vs datasheet peaks)"
    fwd_s, bwd_s = profile.layer_times_s(batch_size)
    measured = [f + b for f, b in zip(fwd_s, bwd_s)]
    ratios = _layer_ratios(profile, batch_size, peak_tflops, bandwidth, target)
    floors, floor_rule = launch_floors_s(profile, batch_size, bandwidth)
    scaled = [max(floor, t * q) for floor, t, q in zip(floors, measured, ratios)]
    floored = [layer.name for layer, floor, t, q in zip(profile.layers, floors, measured, ratios) if 0 < t * q < floor]
    factor = _step_factor(profile, batch_size, measured, scaled, ratios, bandwidth / target.memory_bandwidth_gb_per_s)
    method = (f"measured per-layer times on {src.name} x per-layer roofline ratio (Williams et al. 2009), each "
              f"floored at its launch overhead ({floor_rule}; {len(floored)} of {len(profile.layers)} layers at "
              f"their floor): profiled GPU {peak_tflops:.3g} TFLOP/s, {bandwidth:.3g} GB/s, {peaks}, vs "
              f"{target_kind} datasheet {target.peak_tflops:.3g} TFLOP/s, {target.memory_bandwidth_gb_per_s:.3g} "
              f"GB/s ({target.source}); batch {batch_size}")
    return factor, method, []


def _scale_from_cpu(profile: WorkloadProfile, batch_size: int, target_kind: str,
                    target: DeviceKind) -> tuple[float, str, list[str]]:
    """:func:`compute_scale` of a CPU profile to a GPU kind: a rough estimate without launch
    overheads. Returns (factor, method, warnings)."""
    src = profile.device
    fwd_s, bwd_s = profile.layer_times_s(batch_size)
    measured = [f + b for f, b in zip(fwd_s, bwd_s)]
    ratios = _layer_ratios(profile, batch_size, src.peak_tflops, src.memory_bandwidth_gb_per_s, target)
    scaled = [t * q for t, q in zip(measured, ratios)]
    factor = _step_factor(profile, batch_size, measured, scaled, ratios,
                          target_bandwidth_ratio(src.memory_bandwidth_gb_per_s, target))
    warnings = []
    fast = [layer.name for layer, t in zip(profile.layers, scaled) if 0 < t < LAUNCH_BOUND_LAYER_S]
    if fast:
        warnings.append(f"{len(fast)} of {len(profile.layers)} layers would take < {LAUNCH_BOUND_LAYER_S * 1e6:.0f} us "
                        f"on {target_kind} ({', '.join(fast[:4])}{', ...' if len(fast) > 4 else ''}): kernel-launch "
                        f"overheads dominate there, so the factor is a lower bound")
    method = (f"CPU -> GPU scaling is a ROUGH ESTIMATE: a CPU profile cannot show {target_kind}'s kernel-launch "
              f"overheads (profile on a GPU, --device cuda, for a measured basis); per-layer roofline (Williams et al. "
              f"2009): profiled {src.name} measured {src.peak_tflops:.3g} TFLOP/s, {src.memory_bandwidth_gb_per_s:.3g} "
              f"GB/s vs {target_kind} datasheet {target.peak_tflops:.3g} TFLOP/s, "
              f"{target.memory_bandwidth_gb_per_s:.3g} GB/s ({target.source}); layers weighted by measured time at "
              f"batch {batch_size}")
    return factor, method, warnings


def launch_floors_s(profile: WorkloadProfile, batch_size: int, bandwidth_gb_per_s: float) -> tuple[list[float], str]:
    """Per-layer launch floor (seconds, forward + backward) of a GPU profile, and the rule used, in words.

    The floor is what a layer's kernels take whatever the FLOP/s: kernel launches and framework
    (dispatcher, autograd) overhead, which a faster GPU does not shorten. Estimated from the
    profile itself, not a constant:

    - with 2 or more measured batch sizes: a least-squares line ``t_i(b) = a_i + c_i b`` through
      the layer's measured forward + backward seconds (:meth:`~ddlscope.modeling.profile.WorkloadProfile.
      layer_times_s` at each measured batch size); the intercept ``a_i`` (clamped to
      ``[0, min_b t_i(b)]``) is the batch-independent part, less the time its batch-independent
      bytes take (``3 x param_bytes / bandwidth_gb_per_s``: weights are work that scales with
      bandwidth, not overhead);
    - with one measured batch size: the cheapest layer's time at it, at most
      :data:`LAUNCH_BOUND_LAYER_S`, for every layer (a lower bound for layers with more kernels).

    Each floor is at most the layer's own time at ``batch_size``, so a floor never makes a layer
    slower than measured.

    Args:
        profile: a profile measured on a GPU.
        batch_size: the batch the layer times are scaled at (samples).
        bandwidth_gb_per_s: the profiled GPU's memory bandwidth (1e9 bytes/s).
    """
    fwd_s, bwd_s = profile.layer_times_s(batch_size)
    at_batch = [f + b for f, b in zip(fwd_s, bwd_s)]
    sizes = profile.measured_batch_sizes
    if len(sizes) < 2:
        times = [f + b for f, b in zip(*profile.layer_times_s(sizes[0] if sizes else batch_size))]
        cheapest = min((t for t in times if t > 0), default=0.0)
        floor = min(cheapest, LAUNCH_BOUND_LAYER_S)
        return ([min(floor, t) for t in at_batch],
                f"the cheapest layer's time, {floor * 1e6:.3g} us, at most {LAUNCH_BOUND_LAYER_S * 1e6:.0f} us")
    per_size = [[f + b for f, b in zip(*profile.layer_times_s(s))] for s in sizes]
    mean_b = sum(sizes) / len(sizes)
    var_b = sum((s - mean_b) ** 2 for s in sizes)
    floors = []
    for i, layer in enumerate(profile.layers):
        ts = [times[i] for times in per_size]
        mean_t = sum(ts) / len(ts)
        slope = sum((s - mean_b) * (t - mean_t) for s, t in zip(sizes, ts)) / var_b
        intercept = min(max(0.0, mean_t - slope * mean_b), min(ts))
        weights_s = 3.0 * layer.param_bytes / (bandwidth_gb_per_s * 1e9)
        floors.append(min(max(0.0, intercept - weights_s), at_batch[i]))
    return floors, (f"intercept of each layer's time over measured batches {sizes[0]}..{sizes[-1]}, less its "
                    f"weights' bytes")


def _layer_ratios(profile: WorkloadProfile, batch_size: int, peak_tflops: float, bandwidth_gb_per_s: float,
                  target: DeviceKind) -> list[float]:
    """Per layer ``r(target) / r(profiled)`` (:func:`compute_scale`); the bandwidth ratio for a
    layer without FLOPs or bytes."""
    ratios = []
    for layer in profile.layers:
        flops = TRAIN_FLOPS_PER_FORWARD_FLOP * layer.forward_flops_per_sample * batch_size
        nbytes = 3.0 * layer.param_bytes + 2.0 * (layer.output_bytes_per_sample + layer.saved_bytes_per_sample) * batch_size
        r_src = _roofline_s(flops, nbytes, peak_tflops, bandwidth_gb_per_s)
        r_tgt = _roofline_s(flops, nbytes, target.peak_tflops, target.memory_bandwidth_gb_per_s)
        ratios.append(r_tgt / r_src if r_src > 0 else target_bandwidth_ratio(bandwidth_gb_per_s, target))
    return ratios


def _step_factor(profile: WorkloadProfile, batch_size: int, measured_s: list[float], scaled_s: list[float],
                 ratios: list[float], optimizer_ratio: float) -> float:
    """Target step seconds / profiled step seconds (layers + optimizer step); the mean ratio when the
    profile measured no time at all."""
    optimizer_s = profile.step_at(batch_size).optimizer_s
    total = sum(measured_s) + optimizer_s
    if total > 0:
        return (sum(scaled_s) + optimizer_s * optimizer_ratio) / total
    return (sum(ratios) + optimizer_ratio) / (len(ratios) + 1)


def _roofline_s(flops: float, nbytes: float, peak_tflops: float, bandwidth_gb_per_s: float) -> float:
    """Williams, Waterman & Patterson 2009 ("Roofline"): time >= max(FLOPs / peak, bytes / bandwidth)."""
    return max(flops / (peak_tflops * 1e12), nbytes / (bandwidth_gb_per_s * 1e9))


def target_bandwidth_ratio(profiled_bandwidth_gb_per_s: float, target: DeviceKind) -> float:
    """Time factor of a purely memory-bound kernel: profiled bandwidth / target bandwidth."""
    return profiled_bandwidth_gb_per_s / target.memory_bandwidth_gb_per_s


class BandCheck(NamedTuple):
    """A measured step time on the target next to a :class:`ScaleEstimate` (:func:`check_band`).

    Attributes:
        measured_factor: measured step seconds on the target / profiled step seconds.
        inside: ``low <= measured_factor <= high``.
        error: ``factor / measured_factor - 1`` (> 0: the estimate is too slow).
    """

    measured_factor: float
    inside: bool
    error: float


def check_band(estimate: ScaleEstimate, profiled_step_s: float, measured_step_s: float) -> BandCheck:
    """Whether a step time measured on the target device lies inside ``estimate``'s band.

    Args:
        estimate: :func:`compute_scale`'s estimate for the target.
        profiled_step_s: the step time it multiplies (the profile's, same batch), seconds.
        measured_step_s: the same step measured on the target, seconds.

    Raises:
        ValueError: a time that is not a positive finite number.
    """
    for name, value in (("profiled_step_s", profiled_step_s), ("measured_step_s", measured_step_s)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} = {value!r}; allowed: seconds > 0")
    measured = measured_step_s / profiled_step_s
    return BandCheck(measured, estimate.low <= measured <= estimate.high, estimate.factor / measured - 1.0)
