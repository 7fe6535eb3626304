"""Peak memory per worker for each distribution model, computed from a :class:`WorkloadProfile`.

Nothing here allocates a model: every figure comes from the profile, whose bytes were taken
from fake tensors (``torch._subclasses.FakeTensorMode``: parameter, output, saved-for-backward
bytes per layer; the peak of a whole training step from torch's ``MemTracker``) and, where the
device allowed it, from one real training step (:attr:`StepProfile.measured_activation_peak_bytes`).

Notation (bytes; the profile's fields):

* ``P`` parameters, ``Bf`` buffers (BatchNorm statistics), ``G = P`` gradients (every parameter
  trains), ``O`` optimizer state (SGD momentum: one copy of the parameters);
* ``A(b)`` activations at batch ``b``: :attr:`StepProfile.activation_bytes` interpolated
  linearly between the profiled batch sizes (:meth:`WorkloadProfile.step_at`). It is the step's
  peak minus ``P + Bf + G + O``, so ``P + Bf + G + O + A(b)`` is the peak of one training step
  on one device (input batch, saved activations, activation gradients and kernel work buffers
  included);
* per layer ``l``: ``p_l`` parameter bytes, ``bf_l`` buffer bytes, ``s_l`` / ``i_l`` / ``o_l``
  saved / saved-input / output bytes per sample (:class:`LayerProfile`);
* ``R`` runtime: the resident memory of a worker process before any model
  (:attr:`DeviceProfile.runtime_bytes`).

The formula of each distribution model is documented at :func:`predict_memory`. Every figure is
a peak during training steps (steady state); one-off peaks before training (DDP's initial
broadcast of the parameters, hivemind's first state download) are not included, and neither
are DataLoader worker processes.

Checked against measurements (``tests/test_memory_model.py``: ResNet-18, MNIST shape, batch 8,
CPU, gloo, 2 workers, resident memory with glibc's mmap threshold fixed at 64 KiB): predicted
memory added by training was 4-5% below the measured for single and ddp, 1% for fsdp, 2-4% for
the two gpipe stages. Two terms were found by those measurements and then traced to their
mechanism (gloo's flat working copies for FSDP; gradient accumulation over micro-batches for
pipelines). With glibc's default allocator settings a
process also keeps freed heap memory, so its resident peak can be higher than predicted.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, computed_field

from ddlscope.errors import UserError
from ddlscope.predict.costs import stage_bounds as balanced_stage_bounds
from ddlscope.predict.profile import WorkloadProfile

MEMORY_STRATEGIES = ("single", "ddp", "fsdp", "gpipe", "1f1b", "collaborative")
DEFAULT_MICROBATCHES = 4
"""Micro-batches of a pipeline when none are given (``DistributedConfig.microbatches``' default)."""
HIVEMIND_PART_SIZE_BYTES = 2**19
"""hivemind 1.1.12 ``averaging.partition.DEFAULT_PART_SIZE_BYTES``: all-reduce chunk size."""


class MemoryEstimate(BaseModel):
    """Predicted peak memory of one worker (one pipeline stage, one peer), in bytes.

    ``params_bytes`` includes the buffers the worker holds; ``comm_buffers_bytes`` is memory the
    distribution model adds for communication (DDP buckets, FSDP's gathered parameters and
    reduce-scatter buffers, pipeline send/receive buffers, hivemind's averaging copies).
    """

    model_config = ConfigDict(extra="forbid")

    worker: int = Field(0, ge=0, description="worker index (pipelines: stage index)")
    params_bytes: int = Field(ge=0)
    grads_bytes: int = Field(ge=0)
    optimizer_bytes: int = Field(ge=0)
    activations_bytes: int = Field(ge=0)
    comm_buffers_bytes: int = Field(ge=0)
    runtime_bytes: int = Field(ge=0)
    notes: str = ""

    @computed_field  # type: ignore[prop-decorator]
    @property
    def total_bytes(self) -> int:
        """Sum of all parts: the predicted peak resident memory of the worker."""
        return (self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes
                + self.comm_buffers_bytes + self.runtime_bytes)

    @property
    def training_bytes(self) -> int:
        """``total_bytes`` without the runtime: what training adds to a worker process."""
        return self.total_bytes - self.runtime_bytes


def _check(profile: WorkloadProfile, strategy: str, workers: int, batch_size: int,
           microbatches: int | None) -> None:
    if strategy not in MEMORY_STRATEGIES:
        raise UserError(f"unknown distribution model {strategy!r}; allowed: {', '.join(MEMORY_STRATEGIES)}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise UserError(f"workers = {workers!r}; allowed: an integer >= 1")
    if strategy == "single" and workers != 1:
        raise UserError(f"workers = {workers} but 'single' trains on exactly 1 worker; allowed: workers = 1")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise UserError(f"batch_size = {batch_size!r}; allowed: an integer >= 1")
    if strategy in ("gpipe", "1f1b"):
        if workers > len(profile.layers):
            raise UserError(f"{workers} pipeline stages, but {profile.network} has {len(profile.layers)} top-level "
                            f"layers; allowed: workers <= {len(profile.layers)}")
        if microbatches is not None and (isinstance(microbatches, bool) or not isinstance(microbatches, int)
                                         or not 1 <= microbatches <= batch_size):
            raise UserError(f"microbatches = {microbatches!r}; allowed: an integer in 1..batch_size ({batch_size})")


def _activations(profile: WorkloadProfile, batch: float) -> int:
    return profile.step_at(batch).activation_bytes


def predict_memory(profile: WorkloadProfile, strategy: str, workers: int, batch_size: int,
                   microbatches: int | None = None, stage_bounds: list[int] | None = None,
                   bucket_cap_mb: float = 25.0, reshard_after_forward: bool = True,
                   use_local_updates: bool = False) -> list[MemoryEstimate]:
    """Peak memory of every worker of a distribution model, from the profile alone.

    ``batch_size`` means what it means in a run config (:mod:`ddlscope.suite.spec`): samples
    per worker for ``single``, ``ddp``, ``fsdp`` and ``collaborative``; the whole batch, split
    into ``microbatches`` micro-batches of ``m = ceil(batch_size / microbatches)``, for ``gpipe``
    and ``1f1b``. Notation as in the module docstring; ``N`` = workers.

    * ``single``: full replica. ``params = P + Bf``, ``grads = G``, ``optimizer = O``,
      ``activations = A(b)``, no communication buffers.
    * ``ddp``: the same replica on every worker, plus ``comm = G``: with
      ``gradient_as_bucket_view=False`` (our strategy keeps torch's default) the reducer copies
      the gradients into flat bucket tensors of ``bucket_cap_mb`` MiB, which together are as
      large as all gradients and live for the whole run (torch's DistributedDataParallel
      documentation: a bucket view "can reduce peak memory usage, where the saved memory size
      will be equal to the total gradients size"). ``bucket_cap_mb`` changes how they are
      split, not their total.
    * ``fsdp`` (FSDP2 ``fully_shard`` on every top-level layer, ZeRO-3): ``params = P / N + Bf``
      (buffers are not sharded), ``grads = G / N``, ``optimizer = O / N``, ``activations = A(b)``,
      and the gathered units in ``comm``. With ``reshard_after_forward``: a unit's backward holds
      its unsharded parameters, their unsharded gradients and the flat reduce-scatter input
      (``3 p_l``) while the previous unit's all-gather (its output buffer, then its unsharded
      copy: ``2 p_(l-1)``) is prefetched, so ``gathered = max_l (3 p_l + 2 p_(l-1))``. Without it
      (ZeRO-2) every unit stays gathered from its forward to its backward:
      ``gathered = P + max_l 2 p_l``. On CPU (gloo) ``comm = gathered + max_l p_l``: gloo's
      all-gather and reduce-scatter each work on a flat copy of the whole unit (measured: a 40 MB
      all-gather or reduce-scatter raises the resident peak by 40 MB, an all-reduce by 2 MB);
      NCCL (CUDA) works in place, ``comm = gathered``.
    * ``gpipe`` / ``1f1b`` (``torch.distributed.pipelining``, one stage per worker, stage ``s``
      holding layers ``[k_s, k_(s+1))`` of ``stage_bounds``; default
      :func:`~ddlscope.strategies.partition.balanced_partition` of the profiled per-layer
      forward + backward times at the micro-batch size, as the strategy partitions):
      ``params = sum (p_l + bf_l)``, ``grads = sum p_l`` and ``optimizer = O * sum p_l / P``
      over the stage's own layers (the strategy frees the other stages' layers in place).
      Micro-batches in flight: GPipe runs every forward before any backward, so ``k = M``
      (Huang et al. 2019); 1F1B holds at most ``k = min(M, S - s)`` (Narayanan et al. 2021,
      PipeDream-flush). ``activations = k * m * a_s + t_s + b * sample_bytes``, where
      ``a_s = sum s_l`` (minus the first layer's saved input ``i_k``: that is the receive
      buffer, counted below, or on the first stage a slice of the input batch; plus the stage's output
      ``o_last`` when only the next stage saves it, since the stage keeps its outputs until
      their backward), ``t_s`` the transient memory of one micro-batch's backward
      (``m * (A(m) / m - sum_all s_l - sample_bytes)`` scaled by the stage's largest ``s_l``
      over the model's largest), and ``b * sample_bytes`` the whole input batch, which every
      stage loads. ``comm = M * m * (i_in + o_out)``: torch allocates one receive buffer per
      micro-batch for the activations coming in (stages after the first, ``i_in`` = previous
      layer's ``o``) and for the gradients coming back (stages before the last,
      ``o_out`` = last layer's ``o``), and keeps them. With ``M > 1`` the stage's gradients
      accumulate over micro-batches: autograd computes a layer's weight gradients before adding
      them into ``.grad``, so ``grads`` adds the stage's largest ``p_l``.
    * ``collaborative`` (``hivemind.Optimizer`` as :mod:`ddlscope.strategies.collaborative`
      configures it: a pre-built optimizer, so ``offload_optimizer=False``; no optimizer
      statistics or extra tensors averaged): the replica of ``single`` plus, in ``comm``, the
      TrainingStateAverager's host copy of the parameters (``P``); without local updates the
      GradientAverager's gradient accumulators (``G``, ``reuse_grad_buffers=False``) and its
      averaged-gradient buffers (``G``, shared memory); with ``use_local_updates`` no gradient
      averager, but the delta rule of background state averaging (``delay_state_averaging``
      defaults to True) keeps a copy of the averaged tensors from before the round (``P``).
      Plus an all-reduce's working set: the largest layer's parameter bytes plus one
      ``HIVEMIND_PART_SIZE_BYTES`` part in flight. So ``comm = P + 2G + w`` (default) or
      ``2P + w`` (local updates), ``w = max p_l + 512 KiB``. The DHT and averager processes'
      own interpreters are not counted (forked; their private memory is not profiled).

    ``runtime_bytes = R`` for every worker.

    Returns:
        one :class:`MemoryEstimate` per worker (pipelines: per stage, in stage order).

    Raises:
        UserError: unknown strategy; workers < 1 (or != 1 for single, more than the layers for
            pipelines); batch_size < 1; microbatches outside 1..batch_size; stage_bounds that
            are not ``[0, ..., L]`` strictly increasing with ``workers + 1`` entries.
    """
    _check(profile, strategy, workers, batch_size, microbatches)
    P, Bf, O = profile.param_bytes, profile.buffer_bytes, profile.optimizer_state_bytes
    G, R = P, profile.device.runtime_bytes
    layer_p = [layer.param_bytes for layer in profile.layers]
    if strategy in ("single", "ddp"):
        comm = G if strategy == "ddp" else 0
        note = ("full replica" if strategy == "single"
                else f"full replica + flat gradient buckets ({bucket_cap_mb:g} MiB each; gradient_as_bucket_view=False)")
        return [MemoryEstimate(worker=w, params_bytes=P + Bf, grads_bytes=G, optimizer_bytes=O,
                               activations_bytes=_activations(profile, batch_size), comm_buffers_bytes=comm,
                               runtime_bytes=R, notes=note) for w in range(workers)]
    if strategy == "fsdp":
        n = workers
        if reshard_after_forward:
            gathered = max(3 * p + 2 * (layer_p[i - 1] if i else 0) for i, p in enumerate(layer_p))
            note = "sharded state / N; one unit gathered (+ prefetch) at a time (reshard_after_forward)"
        else:
            gathered = P + max(2 * p for p in layer_p)
            note = "sharded state / N; all units stay gathered between forward and backward (ZeRO-2)"
        if profile.device.type == "cpu":
            gathered += max(layer_p)
            note += "; gloo's flat working copy of one unit"
        return [MemoryEstimate(worker=w, params_bytes=math.ceil(P / n) + Bf, grads_bytes=math.ceil(G / n),
                               optimizer_bytes=math.ceil(O / n), activations_bytes=_activations(profile, batch_size),
                               comm_buffers_bytes=gathered, runtime_bytes=R, notes=note) for w in range(workers)]
    if strategy == "collaborative":
        w_set = max(layer_p) + HIVEMIND_PART_SIZE_BYTES
        if use_local_updates:
            comm = 2 * P + w_set
            note = "replica + state averager's parameter copy + delta-rule copy (local updates)"
        else:
            comm = P + 2 * G + w_set
            note = "replica + state averager's parameter copy + gradient accumulators + averaged gradients"
        return [MemoryEstimate(worker=w, params_bytes=P + Bf, grads_bytes=G, optimizer_bytes=O,
                               activations_bytes=_activations(profile, batch_size), comm_buffers_bytes=comm,
                               runtime_bytes=R, notes=note) for w in range(workers)]
    return _pipeline(profile, strategy, workers, batch_size, microbatches or DEFAULT_MICROBATCHES, stage_bounds)


def _pipeline(profile: WorkloadProfile, strategy: str, stages: int, batch_size: int, microbatches: int,
              stage_bounds: list[int] | None) -> list[MemoryEstimate]:
    layers = profile.layers
    n_layers = len(layers)
    m = math.ceil(batch_size / microbatches)
    bounds = list(stage_bounds) if stage_bounds is not None else balanced_stage_bounds(profile, stages, m)
    if (len(bounds) != stages + 1 or bounds[0] != 0 or bounds[-1] != n_layers
            or any(b1 <= b0 for b0, b1 in zip(bounds, bounds[1:]))):
        raise UserError(f"stage_bounds {bounds}: allowed: {stages + 1} strictly increasing layer indices "
                        f"from 0 to {n_layers} (one stage per worker)")
    P, O, R = profile.param_bytes, profile.optimizer_state_bytes, profile.device.runtime_bytes
    saved_all = sum(layer.saved_bytes_per_sample for layer in layers)
    max_saved = max((layer.saved_bytes_per_sample for layer in layers), default=0) or 1
    # backward transient per sample of the whole model: what the step's peak holds beyond saved activations
    transient_per_sample = max(0.0, _activations(profile, m) / m - saved_all - profile.sample_bytes)
    out = []
    for s in range(stages):
        lo, hi = bounds[s], bounds[s + 1]
        mine = layers[lo:hi]
        p = sum(layer.param_bytes for layer in mine)
        # the first layer's saved input is the receive buffer (or, on the first stage, the batch): counted apart
        per_sample = sum(layer.saved_bytes_per_sample for layer in mine) - mine[0].input_saved_bytes_per_sample
        if s < stages - 1 and layers[hi].input_saved_bytes_per_sample > 0:
            per_sample += mine[-1].output_bytes_per_sample  # kept for backward; only the next stage saves it
        in_flight = microbatches if strategy == "gpipe" else min(microbatches, stages - s)
        transient = m * transient_per_sample * max(layer.saved_bytes_per_sample for layer in mine) / max_saved
        activations = in_flight * m * per_sample + transient + batch_size * profile.sample_bytes
        recv_in = layers[lo - 1].output_bytes_per_sample if s > 0 else 0
        recv_grad = mine[-1].output_bytes_per_sample if s < stages - 1 else 0
        comm = microbatches * m * (recv_in + recv_grad)
        out.append(MemoryEstimate(
            worker=s, params_bytes=p + sum(layer.buffer_bytes for layer in mine),
            grads_bytes=p + (max(layer.param_bytes for layer in mine) if microbatches > 1 else 0),
            optimizer_bytes=round(O * p / P) if P else 0, activations_bytes=round(activations),
            comm_buffers_bytes=comm, runtime_bytes=R,
            notes=f"stage {s}: layers {lo}..{hi - 1} ({mine[0].name}..{mine[-1].name}), {in_flight} of "
                  f"{microbatches} micro-batches of {m} in flight"))
    return out
