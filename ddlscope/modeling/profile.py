"""Workload profiles: what one device measured about a network, a dataset shape and a batch size.

The data classes only (torch-free): a profile is measured once per workload, device and
optimizer by :mod:`ddlscope.profiling.profile` and cached as JSON; every prediction reads it.
Per-layer times are taken at several batch sizes (the requested batch and its halvings), so
that the per-worker batches of data parallelism and the micro-batches of pipelines are read off
measurements rather than assumed to scale linearly.
"""

from __future__ import annotations

import bisect
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


def interpolate(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear value at ``x`` of the points ``(xs[i], ys[i])`` (``xs`` ascending, len >= 1).

    Outside ``[xs[0], xs[-1]]`` the nearest segment is extended linearly; the result is never
    below zero. One point: ``ys[0] * x / xs[0]`` (proportional).
    """
    if len(xs) == 1:
        return max(0.0, ys[0] * x / xs[0])
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def gib_text(nbytes: int) -> str:
    """Bytes as GiB with 3 significant digits, for messages: ``"57.6 GiB"``, ``"0.00063 GiB"``."""
    return f"{nbytes / 2**30:.3g} GiB"


def step_peak_bytes(param_bytes: int, buffer_bytes: int, optimizer_state_bytes: int, activation_bytes: int) -> int:
    """Peak bytes of one training step on one device: parameters, buffers, gradients (one per
    parameter byte), optimizer state and the step's activation peak (``2 P + Bf + O + A``, the
    notation of :mod:`ddlscope.modeling.memory`); the worker's runtime is not included."""
    return 2 * param_bytes + buffer_bytes + optimizer_state_bytes + activation_bytes


class LayerProfile(BaseModel):
    """One top-level layer (a child of the zoo's ``SequentialNet``, i.e. a possible stage boundary).

    ``forward_s`` / ``backward_s`` have one entry per :attr:`WorkloadProfile.batch_sizes`; at a
    batch size whose step is :attr:`StepProfile.extrapolated` they are extrapolated too.
    """

    model_config = ConfigDict(extra="forbid")

    name: str
    param_bytes: int = Field(ge=0)
    forward_s: list[float]
    backward_s: list[float]
    output_bytes_per_sample: int = Field(ge=0, description="activation this layer outputs, per sample (what a stage sends)")
    saved_bytes_per_sample: int = Field(ge=0, description="activations autograd keeps for this layer's backward, per sample")
    forward_flops_per_sample: float = Field(ge=0)
    buffer_bytes: int = Field(0, ge=0, description="buffers of this layer (BatchNorm running statistics)")
    input_saved_bytes_per_sample: int = Field(
        0, ge=0, description="the part of saved_bytes_per_sample that is this layer's input (0 when an earlier layer "
                             "saved that tensor already, or this layer does not save its input)")


class StepProfile(BaseModel):
    """A whole training step at one batch size, data already in memory (seconds, bytes).

    ``extrapolated``: the batch did not fit the device, so it was not run; its times are a
    least-squares line through the measured batch sizes (:func:`ddlscope.profiling.profile.fit_line`),
    its activation peak comes from fake tensors as at every batch size, and nothing was measured
    with real tensors (``measured_activation_peak_bytes`` is None).
    """

    model_config = ConfigDict(extra="forbid")

    batch_size: int = Field(ge=1)
    forward_s: float = Field(ge=0, description="forward pass and loss")
    backward_s: float = Field(ge=0)
    optimizer_s: float = Field(ge=0, description="optimizer step and zero_grad")
    step_s: float = Field(ge=0, description="the whole compute step (forward + backward + optimizer)")
    activation_peak_bytes: int = Field(ge=0, description="peak of activation/temporary memory in one step, from fake tensors")
    measured_activation_peak_bytes: int | None = Field(
        None, ge=0, description="the same quantity measured with real tensors on the device (kernels' work buffers "
                                "included); None where it could not be measured")
    extrapolated: bool = Field(False, description="not run (the batch does not fit the device): times extrapolated "
                                                  "from the measured batch sizes")
    retained_bytes: int | None = Field(
        None, ge=0, description="CPU: how far a fresh process's resident set grew over its first training steps at "
                                "glibc's default allocator settings beyond the memory the steps held live and the "
                                "optimizer's state (freed heap memory that glibc keeps, and what first steps add "
                                "whatever the batch); measured at the smallest and the largest measured batch size "
                                "(before 2026-12-04: the largest only), None elsewhere, on GPUs and where it could "
                                "not be measured")

    @property
    def activation_bytes(self) -> int:
        """``measured_activation_peak_bytes`` when measured, else ``activation_peak_bytes``.

        Both are the step's peak memory minus parameters, buffers, all gradients and optimizer
        state, so ``params + buffers + grads + optimizer state + activation_bytes`` is the
        step's peak on one device.
        """
        return self.activation_peak_bytes if self.measured_activation_peak_bytes is None \
            else self.measured_activation_peak_bytes


class DataLoadProfile(BaseModel):
    """Throughput of the dataset's input pipeline with ``loader_workers`` DataLoader workers."""

    model_config = ConfigDict(extra="forbid")

    loader_workers: int = Field(ge=0)
    samples_per_s: float = Field(gt=0)


class DeviceProfile(BaseModel):
    """The device the profile was measured on."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["cpu", "cuda"]
    name: str = Field(description="CPU model or GPU name")
    threads: int = Field(ge=1, description="intra-op threads (CPU: cores of one device)")
    peak_tflops: float = Field(gt=0, description="measured float32 matmul throughput, 1e12 FLOP/s")
    memory_bandwidth_gb_per_s: float = Field(gt=0, description="measured copy bandwidth, 1e9 bytes/s")
    memory_bytes: int = Field(gt=0, description="capacity of one device (CPU: host memory / cores * threads)")
    runtime_bytes: int = Field(ge=0, description="memory a worker process uses before any model (interpreter, libraries; CUDA context)")
    hivemind_runtime_bytes: int | None = Field(
        None, ge=0, description="CPU: what importing hivemind adds to runtime_bytes (the workers of collaborative and "
                                "dmoe run it); None on GPUs, without hivemind and in profiles before 2026-12-04")


class OptimizerSetting(BaseModel):
    """The optimizer a profile's training steps ran with: a run config's ``optimizer``,
    ``learning_rate``, ``momentum`` and ``weight_decay`` (:func:`ddlscope.workloads.step.build_optimizer`).

    Its state size is what the memory model charges per worker: Adam and AdamW keep two tensors
    per parameter (plus a scalar step count per parameter tensor), SGD with momentum one, plain
    SGD (``momentum = 0``) none.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="sgd, adam or adamw (ddlscope.workloads.step.OPTIMIZERS)")
    learning_rate: float = Field(gt=0)
    momentum: float = Field(ge=0, lt=1, description="SGD's heavy-ball momentum; unused by adam and adamw")
    weight_decay: float = Field(ge=0)

    def label(self) -> str:
        """For reports, e.g. ``"sgd, lr 0.01, momentum 0.9"`` or ``"adamw, lr 0.001, weight decay 0.01"``."""
        parts = [self.name, f"lr {self.learning_rate:g}"]
        if self.name == "sgd":
            parts.append(f"momentum {self.momentum:g}")
        if self.weight_decay:
            parts.append(f"weight decay {self.weight_decay:g}")
        return ", ".join(parts)

    @classmethod
    def of_config(cls, cfg) -> "OptimizerSetting":
        """The setting of a run config (anything with ``optimizer``, ``learning_rate``, ``momentum``,
        ``weight_decay`` attributes, e.g. :class:`ddlscope.config.RunConfig`)."""
        return cls(name=cfg.optimizer, learning_rate=cfg.learning_rate, momentum=cfg.momentum,
                   weight_decay=cfg.weight_decay)


class WorkloadProfile(BaseModel):
    """A network on a dataset shape measured on one device (JSON-serialisable; measured by
    :mod:`ddlscope.profiling.profile`).

    Units: seconds, bytes. ``batch_sizes`` ascending; ``steps`` has one entry per batch size.
    Batch sizes that did not fit the device are in ``batch_sizes`` with extrapolated times
    (:attr:`StepProfile.extrapolated`); :attr:`measured_batch_sizes` are the ones that ran.

    Raises:
        pydantic.ValidationError: ``optimizer_setting`` names another optimizer than ``optimizer``.
    """

    model_config = ConfigDict(extra="forbid")

    network: str
    dataset: str
    input_shape: tuple[int, int, int] = Field(description="(channels, height, width) of one sample")
    num_classes: int
    optimizer: str = Field(description="the optimizer the training steps ran with: sgd, adam or adamw")
    optimizer_setting: OptimizerSetting | None = Field(
        None, description="its hyperparameters (None in profiles written before they were recorded: SGD, lr 0.01, "
                          "momentum 0.9)")
    device: DeviceProfile
    torch_version: str
    batch_sizes: list[int]
    layers: list[LayerProfile]
    steps: list[StepProfile]
    data_loading: list[DataLoadProfile] = Field(default_factory=list)
    param_count: int
    param_bytes: int
    buffer_bytes: int
    optimizer_state_bytes: int = Field(
        description="the optimizer's state after a step (SGD with momentum: one copy of the parameters; "
                    "Adam/AdamW: two, plus a 4-byte step count per parameter tensor; plain SGD: 0)")
    sample_bytes: int = Field(description="bytes of one input sample as the model receives it")
    profile_s: float = Field(ge=0, description="seconds the profile took")
    created_at: float
    memory_limit_bytes: int | None = Field(
        None, gt=0, description="the memory cap the profile was asked to keep to (None: none, the device's memory)")
    memory_available_bytes: int | None = Field(
        None, gt=0, description="the memory the largest batch was judged against (the cap, the device's memory or, "
                                "on CPU, the host's, whichever is smallest); None where every batch size fitted")
    largest_fitting_batch_size: int | None = Field(
        None, ge=1, description="the largest halving of the requested batch that fitted the device (fake-tensor "
                                "estimate against the memory available; on CUDA a real step without running out of "
                                "memory); None where the requested batch fitted (and in profiles written before "
                                "this was recorded)")

    @model_validator(mode="after")
    def _one_optimizer(self) -> "WorkloadProfile":
        if self.optimizer_setting is not None and self.optimizer_setting.name != self.optimizer:
            raise ValueError(f"optimizer {self.optimizer!r} but optimizer_setting names {self.optimizer_setting.name!r}")
        return self

    @property
    def measured_batch_sizes(self) -> list[int]:
        """The batch sizes whose steps ran on the device (ascending): all but the extrapolated ones."""
        return [s.batch_size for s in self.steps if not s.extrapolated]

    def step_at(self, batch_size: float) -> StepProfile:
        """The whole-step times at ``batch_size`` (interpolated between the profile's batch sizes).

        ``measured_activation_peak_bytes`` is interpolated over the steps that measured it: over
        all of them when every step did, else only up to the largest one that did (beyond it,
        None: the fake-tensor peak stands). ``extrapolated`` when ``batch_size`` lies beyond the
        measured batch sizes of a profile that extrapolated some.
        """
        xs = [float(s.batch_size) for s in self.steps]
        pick = lambda attr: interpolate(xs, [float(getattr(s, attr)) for s in self.steps], batch_size)  # noqa: E731
        have = [s for s in self.steps if s.measured_activation_peak_bytes is not None]
        measured = None
        if have and (len(have) == len(self.steps) or batch_size <= have[-1].batch_size):
            measured = round(interpolate([float(s.batch_size) for s in have],
                                         [float(s.measured_activation_peak_bytes) for s in have], batch_size))
        ran = self.measured_batch_sizes
        return StepProfile(batch_size=max(1, round(batch_size)), forward_s=pick("forward_s"),
                           backward_s=pick("backward_s"), optimizer_s=pick("optimizer_s"), step_s=pick("step_s"),
                           activation_peak_bytes=round(pick("activation_peak_bytes")),
                           measured_activation_peak_bytes=measured,
                           extrapolated=len(ran) < len(self.steps) and bool(ran) and batch_size > ran[-1])

    def retained_fit(self) -> tuple[float | None, float] | None:
        """CPU: what a worker's resident set keeps beyond its live tensors, as ``(F, k)``: ``F``
        bytes whatever the batch (what a process's first training steps add: kernels' code pages,
        JIT-compiled kernels, the libraries' caches) plus a share ``k`` of what a training step
        allocates and frees (the gradients ``G = P`` and the activations ``A(b)``: the freed heap
        that glibc keeps), so that ``retained(b) = F + k (P + A(b))``.

        From the steps where the profile measured :attr:`StepProfile.retained_bytes`: through the
        smallest and the largest such batch, ``k = (R_l - R_s) / (A_l - A_s)`` (at least 0) and
        ``F = R_l - k (P + A_l)``; where that ``F`` would be negative, or one batch was measured
        (profiles written before 2026-12-04), ``F`` is not separated (None) and ``k = R / (P + A)``
        at the largest. None where nothing was measured (GPU profiles, older profiles).
        """
        steps = [s for s in self.steps if s.retained_bytes is not None]
        if not steps:
            return None
        small, large = steps[0], steps[-1]
        moved_small, moved_large = self.param_bytes + small.activation_bytes, self.param_bytes + large.activation_bytes
        if moved_large <= 0:
            return None
        if moved_large > moved_small:
            k = max(0.0, (large.retained_bytes - small.retained_bytes) / (moved_large - moved_small))
            fixed = large.retained_bytes - k * moved_large
            if fixed >= 0:
                return fixed, k
        return None, large.retained_bytes / moved_large

    def retained_share(self) -> float | None:
        """CPU: ``k`` of :meth:`retained_fit` (None where nothing was measured)."""
        fit = self.retained_fit()
        return None if fit is None else fit[1]

    def first_training_bytes(self) -> int | None:
        """CPU: ``F`` of :meth:`retained_fit`, bytes (None where it was not separated or measured)."""
        fit = self.retained_fit()
        return None if fit is None or fit[0] is None else round(fit[0])

    @property
    def retained_step(self) -> StepProfile | None:
        """CPU: the largest batch's step where the profile measured the memory a worker keeps
        (:attr:`StepProfile.retained_bytes`); None where it was not measured."""
        return next((s for s in reversed(self.steps) if s.retained_bytes is not None), None)

    def step_peak_bytes(self, step: StepProfile) -> int:
        """Peak bytes of ``step`` (a step of this profile or :meth:`step_at`'s) on one device, without the
        runtime: :func:`step_peak_bytes` with its fake-tensor activation peak (the estimate the profile
        judged the fit with)."""
        return step_peak_bytes(self.param_bytes, self.buffer_bytes, self.optimizer_state_bytes,
                               step.activation_peak_bytes)

    def fit_note(self) -> str | None:
        """One line on the batch sizes that did not fit the device, e.g. ``"batch 128 does not fit (needs
        57.6 GiB, device has 39.5 GiB): times extrapolated from batches 4..32"``; None when all fitted.

        "needs": the fake-tensor estimate of the step's peak (:meth:`step_peak_bytes`, no runtime);
        when it is within the memory available, the device's allocator ran out of memory instead."""
        ran = self.measured_batch_sizes
        if len(ran) == len(self.steps) or not ran:
            return None
        top = self.steps[-1]
        need = gib_text(self.step_peak_bytes(top))
        has = "? GiB" if self.memory_available_bytes is None else gib_text(self.memory_available_bytes)
        capped = self.memory_limit_bytes is not None and self.memory_limit_bytes == self.memory_available_bytes
        if self.memory_available_bytes is not None and self.step_peak_bytes(top) <= self.memory_available_bytes:
            why = f"ran out of memory on the device; fake tensors estimate {need} of {has}"
        else:
            why = f"needs {need}, " + (f"the memory limit is {has}" if capped else f"device has {has}")
        span = f"{ran[0]}..{ran[-1]}" if len(ran) > 1 else f"{ran[0]}"
        return f"batch {top.batch_size} does not fit ({why}): times extrapolated from batches {span}"

    def layer_times_s(self, batch_size: float) -> tuple[list[float], list[float]]:
        """Per-layer (forward seconds, backward seconds) at ``batch_size``.

        Layers timed in isolation carry their own overheads, so they are rescaled to add up to
        the whole-step forward and backward times at that batch size (:meth:`step_at`).
        """
        xs = [float(b) for b in self.batch_sizes]
        fwd = [interpolate(xs, layer.forward_s, batch_size) for layer in self.layers]
        bwd = [interpolate(xs, layer.backward_s, batch_size) for layer in self.layers]
        step = self.step_at(batch_size)
        scale = lambda parts, total: [p * total / sum(parts) for p in parts] if sum(parts) > 0 else parts  # noqa: E731
        return scale(fwd, step.forward_s), scale(bwd, step.backward_s)

    def data_load_s(self, batch_size: float, loader_workers: int) -> float:
        """Seconds to load one batch with ``loader_workers`` workers (the nearest measured count).

        Returns 0.0 when the profile has no data-loading measurement.
        """
        if not self.data_loading:
            return 0.0
        best = min(self.data_loading, key=lambda d: (abs(d.loader_workers - loader_workers), d.loader_workers))
        return batch_size / best.samples_per_s
