"""Seconds per step and per epoch of a distribution model: :class:`Setting`, :class:`Prediction`, :func:`predict`.

Every model's cost model lives in its own module, ``ddlscope/distribution/<model>.py``, and is
reached through the registry (:attr:`~ddlscope.distribution.DistributionModel.cost_model`). Each
starts from the same measured inputs — the profile's per-layer forward/backward seconds at the
batch each worker really processes, its whole-step times, parameter and activation bytes
(:class:`~ddlscope.modeling.profile.WorkloadProfile`) — and the cluster's links, fixed per-call
costs and contention factors (:class:`~ddlscope.modeling.cluster.ClusterSpec`), built from the
shared blocks of :mod:`ddlscope.modeling.collectives`. Where the thesis had a closed form, the
model reports it as a named reference next to its own (``Prediction.reference_epoch_s``), so the
validation report can compare the two:

=============  ==========================================================  ====================
model          ddlscope                                                     reference
=============  ==========================================================  ====================
single         measured step at the batch, data loading, contention         ch. 4 extrapolation
ddp            bucketed ring all-reduce overlapping the per-layer backward  eq. 5.1
fsdp           per-unit all-gather / reduce-scatter with one-unit prefetch  —
gpipe, 1f1b    event simulation of the schedule, per-stage micro-batches    eq. 6.1 + eq. 6.2
collaborative  accumulate the target batch + averaging rounds (hivemind)    —
=============  ==========================================================  ====================

A prediction's parts are the step parts of a run (:data:`ddlscope.measure.parts.STEP_PARTS`), so a
prediction and a run of the same cell print side by side (:func:`ddlscope.measure.parts.side_by_side`).

Units: seconds, bytes. Batch sizes: per worker for data-parallel models, the whole batch (split
into micro-batches) for pipelines (:attr:`ddlscope.distribution.DistributionModel.data_parallel`).
Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ddlscope.errors import UserError
from ddlscope.measure import parts as step_parts
from ddlscope.modeling.cluster import ClusterSpec
from ddlscope.modeling.profile import WorkloadProfile

if TYPE_CHECKING:
    from ddlscope.distribution import DistributionModel


def _default_matchmaking_time_s() -> float:
    from ddlscope.distribution.collaborative import DEFAULT_MATCHMAKING_TIME_S

    return DEFAULT_MATCHMAKING_TIME_S


@dataclass
class Setting:
    """What to predict: a distribution model on ``workers`` workers.

    Attributes:
        strategy: a registered distribution model (:func:`ddlscope.distribution.names`).
        workers: workers (devices; pipeline stages; collaborative peers), >= 1.
        batch_size: per worker (data-parallel models) or the whole batch (pipelines), >= 1.
        epoch_samples: samples in one epoch (the real dataset's training split), >= 1.
        microbatches: pipelines: micro-batches the batch is split into; must divide ``batch_size``
            (None: the run config's default, :data:`ddlscope.distribution.pipeline.DEFAULT_MICROBATCHES`).
        stage_bounds: pipelines: the stage cut ``[0, ..., layers]`` (None: balanced by the
            profiled layer times, as the strategy cuts).
        loader_workers: DataLoader workers per worker (0: loading is on the critical path).
        bucket_cap_mb: ddp gradient bucket size (MiB).
        reshard_after_forward: fsdp ZeRO-3 (True) or ZeRO-2 (False).
        target_batch_size / matchmaking_time_s / use_local_updates / average_state_every:
            collaborative (hivemind.Optimizer) settings; the matchmaking time defaults to
            :data:`ddlscope.distribution.collaborative.DEFAULT_MATCHMAKING_TIME_S`.
        options: settings of a model's config table that have no field here (a new model's),
            read by its cost and memory model.
    """

    strategy: str
    workers: int
    batch_size: int
    epoch_samples: int
    microbatches: int | None = None
    loader_workers: int = 0
    bucket_cap_mb: float = 25.0
    reshard_after_forward: bool = True
    target_batch_size: int = 256
    matchmaking_time_s: float = field(default_factory=_default_matchmaking_time_s)
    use_local_updates: bool = False
    average_state_every: int = 1
    stage_bounds: list[int] | None = None
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def model(self) -> "DistributionModel":
        """The registry's descriptor of :attr:`strategy`.

        Raises:
            UserError: unknown distribution model.
        """
        from ddlscope import distribution

        return distribution.get(self.strategy)

    def model_options(self) -> dict[str, Any]:
        """Every field and option of the setting as one mapping (what the registry's rules read)."""
        return {**{k: v for k, v in vars(self).items() if k != "options"}, **self.options}

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step over all workers (the model's rule in the registry)."""
        return self.model.global_batch_size(self.batch_size, self.workers, self.model_options())


@dataclass
class Prediction:
    """A cost model's answer for one :class:`Setting`.

    Attributes:
        step_s: seconds per optimizer step (collaborative: per global epoch of the target batch).
        epoch_s: seconds per epoch of ``setting.epoch_samples`` samples.
        breakdown_s: the step's parts, ``{part: seconds}`` for every part of
            :data:`ddlscope.measure.parts.STEP_PARTS` (0 for parts the model does not have); they
            add up to ``step_s``.
        reference_epoch_s: the thesis's closed form for the same setting, by name (e.g. ``eq5.1``).
        inputs: every number the model used, so a wrong prediction can be traced.
        notes: what makes this prediction less certain than the model's validation suggests.
    """

    setting: Setting
    step_s: float
    epoch_s: float
    breakdown_s: dict[str, float]
    reference_epoch_s: dict[str, float] = field(default_factory=dict)
    inputs: dict[str, float | int | str | list] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def dominant_cost(self) -> str:
        """The largest part of ``breakdown_s``: a step part name (e.g. ``"comm_wait_s"``)."""
        return max(self.breakdown_s, key=self.breakdown_s.get) if self.breakdown_s else "forward_s"


def make_prediction(setting: Setting, parts: dict[str, float], samples_per_step: float, **extra: Any) -> Prediction:
    """The :class:`Prediction` of a step made of ``parts`` (``{step part: seconds}``), covering
    ``samples_per_step`` samples: ``step_s`` is the sum of the parts and ``epoch_s`` is ``step_s x
    epoch_samples / samples_per_step``. ``extra`` goes to the Prediction's other fields.

    Raises:
        ValueError: a part that is not a step part (a cost model's bug).
    """
    step_parts.check_parts(parts)
    breakdown = step_parts.empty_parts()
    breakdown.update(parts)
    step = sum(parts.values())
    return Prediction(setting, step, step * setting.epoch_samples / samples_per_step, breakdown, **extra)


def split_compute(profile: WorkloadProfile, batch: float, compute_s: float) -> dict[str, float]:
    """``{"forward_s": ..., "backward_s": ...}``: ``compute_s`` seconds of training compute split in
    the profiled forward : backward proportion of a step at ``batch`` (for models whose compute
    is not simulated pass by pass, e.g. a collaborative peer's accumulation)."""
    step = profile.step_at(batch)
    total = step.forward_s + step.backward_s
    forward = compute_s * step.forward_s / total if total > 0 else 0.0
    return {"forward_s": forward, "backward_s": compute_s - forward}


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{name} = {value!r}; allowed: an integer >= 1")


def check_setting(profile: WorkloadProfile, setting: Setting) -> "DistributionModel":
    """The checks of a setting that cost and memory predictions share; returns its model's descriptor.

    A known model, integer ``workers`` and ``batch_size`` >= 1, a worker count the model runs on
    (:meth:`~ddlscope.distribution.DistributionModel.check_workers`), then the model's own checks
    (its ``check_setting``, e.g. a pipeline's micro-batches and stages).

    Raises:
        UserError: the first problem found, naming the field and what is allowed.
    """
    model = setting.model
    _positive_int("workers", setting.workers)
    _positive_int("batch_size", setting.batch_size)
    reason = model.check_workers(setting.workers, noun="workers")
    if reason:
        raise UserError(f"workers = {setting.workers}: {reason}")
    if model.check_setting is not None:
        model.check_setting(profile, setting)
    return model


def predict(profile: WorkloadProfile, cluster: ClusterSpec, setting: Setting, compute_scale: float = 1.0) -> Prediction:
    """Predict one setting with the cost model of its distribution model (the registry's ``cost_model``).

    Args:
        compute_scale: factor on every compute time (1 on the profiled device; see
            :func:`ddlscope.modeling.devices.compute_scale` for another device).

    Raises:
        UserError: an impossible setting (:func:`check_setting`: unknown model, a worker count
            it does not run on, micro-batches that do not divide the batch, more stages than
            layers; ``epoch_samples`` < 1; more workers than the cluster's devices for a model
            whose workers take the cluster's devices), or a model ddlscope cannot predict.
        ValueError: the cost model returned a part that is not a step part (a bug).
    """
    from ddlscope import distribution

    model = check_setting(profile, setting)
    _positive_int("epoch_samples", setting.epoch_samples)
    if model.cost_model is None:
        predictable = [m.name for m in distribution.all_models() if m.cost_model is not None]
        raise UserError(f"ddlscope has no cost model for {model.name!r}; allowed: {', '.join(predictable)}")
    if model.uses_cluster_devices and setting.workers > cluster.workers:
        raise UserError(f"{setting.workers} workers but the cluster {cluster.name!r} has {cluster.workers} devices; "
                        f"allowed: workers <= {cluster.workers}")
    prediction = model.cost_model(profile, cluster, setting, compute_scale)
    step_parts.check_parts(prediction.breakdown_s)
    return prediction


def predict_all(profile: WorkloadProfile, cluster: ClusterSpec, settings: list[Setting],
                compute_scale: float = 1.0) -> list[Prediction | UserError]:
    """:func:`predict` for each setting; an impossible setting yields its :class:`UserError`."""
    out: list[Prediction | UserError] = []
    for s in settings:
        try:
            out.append(predict(profile, cluster, s, compute_scale))
        except UserError as err:
            out.append(err)
    return out
