"""``diloco``: local training with rare outer steps — DiLoCo (Douillard et al. 2023, "DiLoCo:
Distributed Low-Communication Training of Language Models", arXiv 2311.08105; OpenDiLoCo,
Jaghouar et al. 2024, arXiv 2407.07852).

Every worker trains its own replica on its own batches with the run's optimizer (the *inner*
optimizer; the paper's is AdamW) for ``H = diloco.inner_steps`` optimizer steps, without any
communication. Then the workers all-reduce the *pseudo-gradient* ``Δ = θ_start - θ_local`` (the
outer parameters at the start of the round minus the worker's parameters now), and apply an
*outer* optimizer step to ``θ_start`` with the averaged ``Δ`` as its gradient: SGD with Nesterov
momentum (paper: outer learning rate 0.7, momentum 0.9). The next round starts from the new
``θ``. Communication is one all-reduce of the parameters every ``H`` steps instead of one of the
gradients every step (ddp): ``H`` times fewer bytes.

This module holds the descriptor, the ``[diloco]`` config table (:class:`DiLoCoConfig`), the
pre-flight check, the cost model (:func:`predict_diloco`) and the memory model
(:func:`diloco_memory`); it is torch-free. The worker's side is
:class:`ddlscope.strategies.diloco.DiLoCoStrategy`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ddlscope.distribution import DistributionModel, register
from ddlscope.distribution.single import predict_single
from ddlscope.errors import UserError
from ddlscope.modeling.cluster import ClusterSpec
from ddlscope.modeling.collectives import busy_per_node, contention, ring_allreduce_s
from ddlscope.modeling.memory import MemoryEstimate, replicas
from ddlscope.modeling.prediction import Prediction, Setting, make_prediction
from ddlscope.modeling.profile import WorkloadProfile

if TYPE_CHECKING:
    from ddlscope.config import RunConfig

DEFAULT_INNER_STEPS = 10
"""Inner steps per outer round when none are given. The paper uses H = 500 over ~88k steps
(1-in-500 communication); ddlscope's runs are a few dozen to a few hundred steps (the default
sample budget is 3,200 samples: 50 steps per worker at 2 workers x 32), so H = 10 gives several
outer rounds per run — enough to measure the outer all-reduce and see it converge — while still
communicating 10x less than ddp."""

MEASURED_STEPS = 2 * DEFAULT_INNER_STEPS
"""Steps per worker a measurement of DiLoCo needs (``validate``): a whole number of outer rounds at
the default ``H``, so that the measured mean ``averaging_s`` per step is the round's ``/ H`` as
predicted (any ``k H`` consecutive steps hold exactly ``k`` rounds, wherever the warm-up ends)."""

PSEUDO_GRADIENT_PASSES = 3
"""Memory passes (in parameter-sized tensors, reads + writes) of ``Δ = θ_start - θ``: read two, write one."""
AVERAGE_PASSES = 2
"""Of dividing the all-reduced sum by the workers in place: read one, write one."""
RESTORE_PASSES = 2
"""Of copying the new outer parameters into the model: read one, write one."""
SGD_PASSES = 3
"""Of ``θ -= lr * g`` (``torch.optim.SGD``'s ``param.add_(grad, alpha=-lr)``): read two, write one."""
MOMENTUM_PASSES = 5
"""What momentum adds to it (PyTorch 2.x ``torch.optim.sgd._single_tensor_sgd``):
``buf.mul_(m)`` (read one, write one) then ``.add_(g)`` (read two, write one)."""
NESTEROV_PASSES = 3
"""What Nesterov adds to that: ``g = g.add(buf, alpha=m)`` (read two, write one, a temporary)."""


class DiLoCoConfig(BaseModel):
    """Settings of the ``diloco`` distribution model (``[diloco]`` table of a run config).

    Defaults follow the paper (Douillard et al. 2023, sec. 3 and table 5: outer Nesterov SGD,
    learning rate 0.7, momentum 0.9) except ``inner_steps`` (:data:`DEFAULT_INNER_STEPS`: the
    paper's H = 500 is longer than most ddlscope runs). The inner optimizer is the run's own
    ``optimizer`` (the paper's is ``"adamw"``).
    """

    model_config = ConfigDict(extra="forbid")

    inner_steps: int = Field(DEFAULT_INNER_STEPS, ge=1, le=100_000,
                             description="H: optimizer steps each worker takes alone between two outer steps")
    outer_learning_rate: float = Field(
        0.7, gt=0, le=10, description="learning rate of the outer SGD step on the averaged pseudo-gradient")
    outer_momentum: float = Field(0.9, ge=0, lt=1, description="momentum of the outer SGD step (0: none)")
    nesterov: bool = Field(True, description="Nesterov momentum for the outer step (needs outer_momentum > 0)")

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> "DiLoCoConfig":
        if self.nesterov and self.outer_momentum == 0:
            raise ValueError("nesterov = true needs outer_momentum > 0 (torch.optim.SGD); "
                             "allowed: outer_momentum in (0, 1) with nesterov, or nesterov = false")
        return self


def check_outer_round(cfg: "RunConfig") -> None:
    """A sample budget reaches at least one outer step (otherwise the workers never communicate
    and the run measures nothing of DiLoCo).

    Raises:
        ValueError: ``sample_budget / (peers x batch_size x gradient_accumulation_steps)`` optimizer
            steps per worker is fewer than ``diloco.inner_steps``.
    """
    steps = cfg.max_steps_per_peer()
    if steps is None:
        return
    optimizer_steps = steps // cfg.gradient_accumulation_steps
    h = cfg.diloco.inner_steps
    if optimizer_steps < h:
        need = h * cfg.gradient_accumulation_steps * cfg.data_parallel_size * cfg.batch_size
        fewer = f"inner_steps <= {optimizer_steps} or " if optimizer_steps else ""
        raise ValueError(
            f"diloco.inner_steps = {h} but sample_budget = {cfg.sample_budget} gives each worker only "
            f"{optimizer_steps} optimizer step(s) (budget / (peers x batch_size x gradient_accumulation_steps)), "
            f"so no outer step would run; allowed: {fewer}sample_budget >= {need}")


def options_of(setting: Setting) -> DiLoCoConfig:
    """The ``[diloco]`` values of a prediction :class:`~ddlscope.modeling.prediction.Setting`: its
    ``options`` (the model's table, as :meth:`~ddlscope.config.RunConfigBase.model_options` gives
    it; other models' options in it are ignored), the defaults where it has none.

    Raises:
        UserError: values outside the table's ranges (one message naming each field).
    """
    mine = {k: v for k, v in setting.options.items() if k in DiLoCoConfig.model_fields}
    try:
        return DiLoCoConfig(**mine)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(['diloco', *map(str, e['loc'])])}: "
                             f"{e['msg'].removeprefix('Value error, ')} (got {e.get('input')!r})" for e in err.errors())
        raise UserError(f"invalid setting: {problems}") from None


def check_setting(profile: WorkloadProfile, setting: Setting) -> None:
    """The prediction setting's ``[diloco]`` options are valid (see :func:`options_of`).

    Raises:
        UserError: values outside the table's ranges.
    """
    options_of(setting)


def outer_state_bytes(param_bytes: int, float_buffer_bytes: int, outer_momentum: float) -> dict[str, int]:
    """What the outer optimizer adds to a worker (bytes), as :class:`~ddlscope.strategies.diloco.DiLoCoStrategy`
    allocates it.

    * ``start``: the outer parameters ``θ_start`` (a copy of the parameters, ``P``);
    * ``momentum``: the outer SGD's momentum buffer (``P``; 0 without momentum);
    * ``exchange``: the flat buffer the pseudo-gradient is computed into and all-reduced in
      place, which also carries the floating-point buffers (BatchNorm statistics) to be averaged
      (``P + Bf``); the outer parameters' ``.grad`` are views into it.
    """
    return {"start": param_bytes, "momentum": param_bytes if outer_momentum > 0 else 0,
            "exchange": param_bytes + float_buffer_bytes}


def outer_local_passes(options: DiLoCoConfig) -> int:
    """Parameter-sized memory passes (reads + writes) of one outer round's local work: pseudo-gradient,
    averaging division, outer SGD step, restore. 18 with Nesterov momentum (the paper's), 15 with
    heavy-ball momentum, 10 without (the ``*_PASSES`` constants)."""
    passes = PSEUDO_GRADIENT_PASSES + AVERAGE_PASSES + SGD_PASSES + RESTORE_PASSES
    if options.outer_momentum > 0:
        passes += MOMENTUM_PASSES + (NESTEROV_PASSES if options.nesterov else 0)
    return passes


def predict_diloco(profile: WorkloadProfile, cluster: ClusterSpec, setting: Setting,
                   compute_scale: float = 1.0) -> Prediction:
    """Seconds per inner (optimizer) step of DiLoCo, the outer round amortised over its ``H`` steps.

    Per inner step each worker computes one plain training step at its own batch ``b``
    (``setting.batch_size``): ``single``'s prediction (:func:`~ddlscope.distribution.single.predict_single`:
    ``forward_s``, ``backward_s``, ``optimizer_s`` from the profile at ``b``, the data loading
    prefetching does not hide) with every compute time slowed by the contention of the busy
    devices of the node (:func:`~ddlscope.modeling.collectives.contention`, as ddp uses it). Every
    ``H`` steps one outer round:

    * one ring all-reduce (Patarasuk & Yuan 2009; :func:`~ddlscope.modeling.collectives.ring_allreduce_s`)
      of ``P + Bf`` bytes (the pseudo-gradient and the buffers) over the cluster's ring link, plus
      the per-collective fixed cost. Unlike ddp's buckets it is a stand-alone collective, neither
      overlapping nor interleaved with autograd, so the link fit of stand-alone all-reduces is
      used, not the in-step rate ``ddp_step_gb_per_s``; all of it is waited for;
    * the round's local work, memory-bound: :func:`outer_local_passes` parameter-sized passes over
      the device's measured copy bandwidth (:attr:`~ddlscope.modeling.profile.DeviceProfile.memory_bandwidth_gb_per_s`,
      reads + writes as STREAM counts them), times the contention slowdown.

    ``averaging_s = (all-reduce + local work) / H`` per step (a run stores the whole round on the
    step that ends it, so its mean per step over whole rounds is the same). ``comm_wait_s`` and
    ``bubble_s`` are 0. Samples per step: ``W x b`` (every worker its own batch).

    Returns:
        a :class:`~ddlscope.modeling.prediction.Prediction` over the step parts; ``inputs`` has
        ``inner_steps``, ``round_comm_s``, ``round_local_s``, ``exchange_bytes`` and
        ``comm_bytes_per_step`` (what a worker hands to collectives per step, ``(P + Bf) / H``;
        ddp's is ``P``).

    Raises:
        UserError: ``setting.options`` outside the ``[diloco]`` ranges.
    """
    opts = options_of(setting)
    h, w = opts.inner_steps, setting.workers
    slow = contention(cluster, busy_per_node(cluster, w))
    inner = predict_single(profile, cluster, setting, compute_scale * slow)
    exchange = profile.param_bytes + profile.buffer_bytes
    link = cluster.ring_link(w)
    round_comm_s = ring_allreduce_s(exchange, w, link, cluster.collective_fixed_s)
    round_local_s = (outer_local_passes(opts) * profile.param_bytes
                     / (profile.device.memory_bandwidth_gb_per_s * 1e9) * slow * compute_scale)
    parts = dict(inner.breakdown_s, averaging_s=(round_comm_s + round_local_s) / h)
    return make_prediction(
        setting, parts, setting.batch_size * w,
        inputs={"inner_steps": h, "round_comm_s": round_comm_s, "round_local_s": round_local_s,
                "exchange_bytes": exchange, "comm_bytes_per_step": exchange / h if w > 1 else 0.0,
                "link_gb_per_s": link.bandwidth_gb_per_s, "link_latency_s": link.latency_s,
                "contention": slow, "compute_scale": compute_scale},
        notes=[CONVERGENCE_NOTE] if h > 1 and w > 1 else [])


CONVERGENCE_NOTE = ("diloco: ranked by time per epoch like the others, but H local steps then an averaged outer "
                    "step do not train like H synchronous steps; compare accuracy per sample (a short run of each) "
                    "before choosing it for its speed")
"""The note every multi-worker DiLoCo prediction with ``H > 1`` carries (the recommender lists it)."""


def memory_diloco(profile: WorkloadProfile, setting: Setting) -> list[MemoryEstimate]:
    """Peak memory of every DiLoCo worker (bytes), from the profile alone.

    Each worker holds ddp's replica without its gradient buckets (DiLoCo does not communicate
    gradients; :func:`~ddlscope.modeling.memory.replicas`): ``params = P + Bf``, ``grads = G``,
    ``optimizer = O`` (the inner optimizer's state, AdamW: 2P), ``activations = A(b)`` (notation
    of :mod:`ddlscope.modeling.memory`), plus the outer state of :func:`outer_state_bytes`:
    ``θ_start`` and the outer momentum in ``optimizer`` (``O + P + P``, the momentum only when
    ``outer_momentum > 0``) and the flat pseudo-gradient/exchange buffer in ``comm_buffers``
    (``P + Bf``; the profile's ``Bf`` includes BatchNorm's integer step counters, which are not
    exchanged: 8 bytes per BatchNorm layer too many). The outer round frees the gradients before its Nesterov temporary (``P``) exists
    and runs after the activations are freed, so the training step stays the peak. (An evaluation
    mid-round sets a copy of the local parameters aside, ``P``, outside the training steps; not
    counted, like other one-off peaks.)

    Returns:
        one :class:`~ddlscope.modeling.memory.MemoryEstimate` per worker.

    Raises:
        UserError: ``setting.options`` outside the ``[diloco]`` ranges.
    """
    opts = options_of(setting)
    outer = outer_state_bytes(profile.param_bytes, profile.buffer_bytes, opts.outer_momentum)
    note = (f"replica + outer parameters{' + outer momentum' if outer['momentum'] else ''} "
            f"+ flat pseudo-gradient buffer (H = {opts.inner_steps})")
    return [e.model_copy(update={"optimizer_bytes": e.optimizer_bytes + outer["start"] + outer["momentum"]})
            for e in replicas(profile, setting, outer["exchange"], note)]


MODEL = register(DistributionModel(
    name="diloco",
    summary="local training: H inner steps alone, then all-reduce the pseudo-gradient and take an outer Nesterov step",
    strategy="diloco:DiLoCoStrategy",
    launcher="torchrun",
    measures="inner steps; the outer all-reduce (averaging rounds: time, bytes); bytes saved vs ddp",
    predicts="the single step under contention + one ring all-reduce of the parameters every H steps "
             "(Douillard et al. 2023)",
    order=45,
    min_workers=1,
    config_table="diloco",
    config_class=DiLoCoConfig,
    check_config=check_outer_round,
    check_setting=check_setting,
    cost_model=predict_diloco,
    memory_model=memory_diloco,
    measured_steps=MEASURED_STEPS,
    # the workers wait for each other only at the outer round, every H inner steps: a measured step is the
    # time both trained over the samples they trained in it, not the mean of each step's slower worker
    # (which counted every inner step's jitter as waiting: 1.017 s against 0.965 s of wall clock per step
    # at 200 Mbit/s in docs/validation.md's links pass)
    lockstep=False,
))
