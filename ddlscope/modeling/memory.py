"""Peak memory per worker of a distribution model, computed from a :class:`WorkloadProfile`.

Each model's formula is its memory model, in its own module ``ddlscope/distribution/<model>.py``
(:attr:`~ddlscope.distribution.DistributionModel.memory_model`); this module holds what they share
(:class:`MemoryEstimate`, the full replica, the activations) and dispatches through the registry
(:func:`predict_memory`, :func:`setting_memory`).

Nothing here allocates a model: every figure comes from the profile, whose bytes were taken
from fake tensors (``torch._subclasses.FakeTensorMode``: parameter, output, saved-for-backward
bytes per layer; the peak of a whole training step from torch's ``MemTracker``) and, where the
device allowed it, from one real training step (:attr:`StepProfile.measured_activation_peak_bytes`).

Notation (bytes; the profile's fields):

* ``P`` parameters, ``Bf`` buffers (BatchNorm statistics), ``G = P`` gradients (every parameter
  trains), ``O`` optimizer state (the profile's optimizer: SGD momentum one copy of the
  parameters, Adam two);
* ``A(b)`` activations at batch ``b``: :attr:`StepProfile.activation_bytes` interpolated
  linearly between the profiled batch sizes (:meth:`WorkloadProfile.step_at`). It is the step's
  peak minus ``P + Bf + G + O``, so ``P + Bf + G + O + A(b)`` is the peak of one training step
  on one device (input batch, saved activations, activation gradients and kernel work buffers
  included);
* per layer ``l``: ``p_l`` parameter bytes, ``bf_l`` buffer bytes, ``s_l`` / ``i_l`` / ``o_l``
  saved / saved-input / output bytes per sample (:class:`LayerProfile`);
* ``R`` runtime: the resident memory of a worker process before any model
  (:attr:`DeviceProfile.runtime_bytes`), the same for every worker; a worker that imports hivemind
  adds what that import adds (:func:`hivemind_runtime_bytes`);
* ``K`` (CPU profiles) what a worker's resident set keeps beyond its live tensors. glibc keeps
  memory a process has freed, and a process's first training steps add memory whatever the batch
  (kernels' code pages, JIT-compiled kernels, the libraries' caches). The profile measures both,
  with glibc's defaults, in fresh processes at its smallest and largest batch
  (:attr:`StepProfile.retained_bytes`) and fits ``F + k (P + A(b))``
  (:meth:`WorkloadProfile.retained_fit`); every worker of every model gets
  ``K = F + k (grads + activations + transient)`` of its own estimate (:func:`setting_memory`):
  ``F`` once per process, ``k`` of what its own steps allocate and free. ``transient``
  (:attr:`MemoryEstimate.step_transient_bytes`) is what a step allocates and frees beyond its
  gradients and activations: FSDP's gathered units, 0 for the other models.

Every figure is a peak during training steps (steady state); one-off peaks before training
(DDP's initial broadcast of the parameters, hivemind's first state download) are not included,
and neither are DataLoader worker processes.

Checked against measurements (``tests/test_memory_model.py``: ResNet-18, MNIST shape, batch 8,
CPU, gloo, 2 workers, resident memory with glibc's mmap threshold fixed at 64 KiB): predicted
memory added by training was 4-5% below the measured for single and ddp, 1% for fsdp, 2-4% for
the two gpipe stages. Two terms were found by those measurements and then traced to their
mechanism (gloo's flat working copies for FSDP; gradient accumulation over micro-batches for
pipelines). With glibc's default allocator settings, as runs have them, a process also keeps
freed heap memory: without ``K`` the validation runs' resident growth was 12-40 % above the
prediction (docs/validation.md). Torch-free.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, computed_field

from ddlscope.errors import UserError
from ddlscope.modeling.prediction import Setting, check_setting
from ddlscope.modeling.profile import WorkloadProfile


class MemoryEstimate(BaseModel):
    """Predicted peak memory of one worker (one pipeline stage, one peer), in bytes.

    ``params_bytes`` includes the buffers the worker holds; ``comm_buffers_bytes`` is memory the
    distribution model adds for communication (DDP buckets, FSDP's gathered parameters and
    reduce-scatter buffers, pipeline send/receive buffers, hivemind's averaging copies);
    ``retained_bytes`` (CPU profiles) the freed heap memory glibc keeps resident (``k (grads +
    activations)`` of ``K`` in the module docstring) and ``first_training_bytes`` what a process's
    first training steps add whatever the batch (``F``), each None where the profile did not
    measure it (GPU profiles, older profiles; ``F`` also where the profile could not separate it).
    ``step_transient_bytes`` is what one training step allocates and frees beyond its gradients
    and activations (FSDP's all-gathered units, their gradients and gloo's flat copies): none of
    it is held at the peak (``comm_buffers_bytes`` holds what is), but the freed heap that glibc
    keeps is a share of it as of the rest (:func:`setting_memory`).
    """

    model_config = ConfigDict(extra="forbid")

    worker: int = Field(0, ge=0, description="worker index (pipelines: stage index)")
    params_bytes: int = Field(ge=0)
    grads_bytes: int = Field(ge=0)
    optimizer_bytes: int = Field(ge=0)
    activations_bytes: int = Field(ge=0)
    comm_buffers_bytes: int = Field(ge=0)
    runtime_bytes: int = Field(ge=0)
    retained_bytes: int | None = Field(None, ge=0)
    first_training_bytes: int | None = Field(None, ge=0)
    step_transient_bytes: int = Field(0, ge=0)
    notes: str = ""

    @computed_field  # type: ignore[prop-decorator]
    @property
    def total_bytes(self) -> int:
        """Sum of all parts: the predicted peak resident memory of the worker."""
        return (self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes
                + self.comm_buffers_bytes + (self.retained_bytes or 0) + (self.first_training_bytes or 0)
                + self.runtime_bytes)

    @property
    def training_bytes(self) -> int:
        """``total_bytes`` without the runtime: what training adds to a worker process."""
        return self.total_bytes - self.runtime_bytes


def activation_bytes(profile: WorkloadProfile, batch: float) -> int:
    """``A(b)``: the activation bytes of one training step at batch ``b`` (interpolated)."""
    return profile.step_at(batch).activation_bytes


def replicas(profile: WorkloadProfile, setting: Setting, comm_buffers_bytes: int, note: str) -> list[MemoryEstimate]:
    """A full replica on every worker: ``params = P + Bf``, ``grads = G``, ``optimizer = O``,
    ``activations = A(b)`` at the setting's per-worker batch, plus ``comm_buffers_bytes``."""
    p = profile.param_bytes
    return [MemoryEstimate(worker=w, params_bytes=p + profile.buffer_bytes, grads_bytes=p,
                           optimizer_bytes=profile.optimizer_state_bytes,
                           activations_bytes=activation_bytes(profile, setting.batch_size),
                           comm_buffers_bytes=comm_buffers_bytes, runtime_bytes=profile.device.runtime_bytes,
                           notes=note) for w in range(setting.workers)]


def hivemind_runtime_bytes(profile: WorkloadProfile) -> int:
    """``R`` of a worker that imports hivemind (a collaborative peer, a dmoe trainer or expert
    server): :attr:`DeviceProfile.runtime_bytes` plus what importing hivemind adds
    (:attr:`DeviceProfile.hivemind_runtime_bytes`, 53 MiB on CPU; nothing where not measured)."""
    return profile.device.runtime_bytes + (profile.device.hivemind_runtime_bytes or 0)


def setting_memory(profile: WorkloadProfile, setting: Setting) -> list[MemoryEstimate]:
    """Peak memory of every worker of a setting, from its model's memory model (the registry's
    ``memory_model``; each formula is documented there), plus, for a CPU profile that measured it,
    what each worker keeps beyond its live tensors, ``K = F + k (grads + activations + transient)``
    of its own estimate (:meth:`WorkloadProfile.retained_fit`; ``F`` where the profile separated
    it; transient: :attr:`MemoryEstimate.step_transient_bytes`).

    Returns:
        one :class:`MemoryEstimate` per worker (pipelines: per stage, in stage order).

    Raises:
        UserError: an impossible setting (:func:`~ddlscope.modeling.prediction.check_setting`), or a
            model without a memory model.
    """
    from ddlscope import distribution

    model = check_setting(profile, setting)
    if model.memory_model is None:
        known = [m.name for m in distribution.all_models() if m.memory_model is not None]
        raise UserError(f"ddlscope has no memory model for {model.name!r}; allowed: {', '.join(known)}")
    estimates = model.memory_model(profile, setting)
    fit = profile.retained_fit()
    if fit is None:
        return estimates
    fixed, share = fit
    return [e.model_copy(update={"retained_bytes": round(share * (e.grads_bytes + e.activations_bytes
                                                                    + e.step_transient_bytes)),
                                 "first_training_bytes": None if fixed is None else round(fixed)})
            for e in estimates]


def peak_memory_bytes(profile: WorkloadProfile, setting: Setting) -> int:
    """The largest per-worker peak (bytes) of a setting (:func:`setting_memory`)."""
    return max(e.total_bytes for e in setting_memory(profile, setting))


def peak_split_bytes(profile: WorkloadProfile, setting: Setting) -> tuple[int, int]:
    """The worker with the largest predicted peak, split as a measurement sees it: ``(allocator
    bytes, runtime bytes)``. The allocator part (:attr:`MemoryEstimate.training_bytes`) is what
    training allocates: on a GPU it compares with ``torch.cuda.max_memory_allocated``, on CPU with
    the resident peak during training less the resident set without the model. The runtime part is the
    process's memory before any model (CUDA context and libraries on a GPU, interpreter and
    libraries on CPU), which the allocator's peak does not contain.

    Raises:
        UserError: as :func:`setting_memory`.
    """
    top = max(setting_memory(profile, setting), key=lambda e: e.total_bytes)
    return top.training_bytes, top.runtime_bytes


def predict_memory(profile: WorkloadProfile, strategy: str, workers: int, batch_size: int,
                   microbatches: int | None = None, stage_bounds: list[int] | None = None,
                   bucket_cap_mb: float = 25.0, reshard_after_forward: bool = True,
                   use_local_updates: bool = False, **options) -> list[MemoryEstimate]:
    """Peak memory of every worker of a distribution model, from the profile alone.

    :func:`setting_memory` of the :class:`~ddlscope.modeling.prediction.Setting` made of these
    arguments (``batch_size`` as in a run config: per worker for data-parallel models, the whole
    batch for pipelines; ``options``: a model's further settings). The formulas: each model's
    memory model (``memory_single``, ``memory_ddp``, ``memory_fsdp``, ``memory_pipeline``,
    ``memory_collaborative`` in ``ddlscope/distribution/<model>.py``).

    Raises:
        UserError: unknown strategy; workers < 1 (or a count the model does not run on, more
            stages than layers for pipelines); batch_size < 1; microbatches that do not divide
            the batch; stage_bounds that are not ``[0, ..., L]`` strictly increasing with
            ``workers + 1`` entries.
    """
    setting = Setting(strategy, workers, batch_size, epoch_samples=1,  # memory does not depend on the epoch
                      microbatches=microbatches, stage_bounds=stage_bounds, bucket_cap_mb=bucket_cap_mb,
                      reshard_after_forward=reshard_after_forward, use_local_updates=use_local_updates,
                      options=options)
    return setting_memory(profile, setting)
