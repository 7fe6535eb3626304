"""The distribution-model registry: the one list of distribution models, and everything about each.

A distribution model (``single``, ``ddp``, ``fsdp``, ``gpipe``, ``1f1b``, ``collaborative``,
``diloco``, ...) has one home: a module in this package that registers a
:class:`DistributionModel` descriptor — its name, the strategy class a worker runs, how its
workers are launched, its data-parallel size and global batch, its pre-flight checks, its config
table, and its cost and memory models — plus its strategy in :mod:`ddlscope.strategies`. Every
list, rule and check elsewhere asks the registry; no module outside a model's own files names a
model in an ``if``. Adding a model is one module here, one strategy module and its tests: the
modules of this package are discovered on first use.

The modules here are torch-free (pydantic and the pure modelling code only), so the registry can
be read by the config validation, the CLI and the predictor without importing torch.

Example::

    from ddlscope import distribution
    model = distribution.get("ddp")
    model.launcher            # "torchrun"
    model.data_parallel_size(4)   # 4
    [m.name for m in distribution.all_models()]
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel

if TYPE_CHECKING:
    from ddlscope.config import RunConfig

Launcher = Literal["process", "torchrun", "swarm"]
"""How a run's workers are started: ``process`` (ddlscope's own worker processes, one per worker,
no process group), ``torchrun`` (torch's elastic launcher, a torch.distributed process group),
``swarm`` (ddlscope's worker processes joining a hivemind swarm: the first peer listens, the
others are given its addresses).

The swarm launcher's protocol: a ``swarm`` model has a config table with the fields of
:data:`SWARM_OPTIONS`: ``initial_peers`` (multiaddrs of a running swarm to join; empty: the
launcher starts the first peer, waits until it has recorded its multiaddrs in the store, and gives
them to the others) and ``join_timeout_s`` (how long that wait may take). Registration checks it."""

LAUNCHERS: tuple[str, ...] = ("process", "torchrun", "swarm")

SWARM_OPTIONS: tuple[str, ...] = ("initial_peers", "join_timeout_s")
"""Config-table fields every ``swarm`` model has (see :data:`Launcher`)."""

CALIBRATIONS: tuple[str, ...] = ("hivemind", "dmoe")
"""The fits of ``ddlscope calibrate`` beyond the collectives' (its ``--hivemind`` and ``--dmoe``) that a
cost model may read: :attr:`DistributionModel.calibrations`."""

MATCHMAKING_OPTION = "matchmaking_time_s"
"""The config-table field of models whose averaging groups are formed by matchmaking (hivemind):
:attr:`DistributionModel.has_matchmaking`; ``ddlscope matchmaking`` analyzes their runs."""


@dataclass(frozen=True)
class Service:
    """A process a swarm model needs besides its workers (``dmoe``: an expert server).

    The launcher starts ``python -m <module> --db DB --run-id RUN --index I --cores C
    [--initial-peers ...]`` for each service of :attr:`DistributionModel.services`, before the
    workers: the first service to start bootstraps the swarm (it records its multiaddrs in the
    store's ``services`` table), the others and every worker join it. The schedule lets a service
    start late, be killed (SIGKILL) and come back as a new process; a service that dies does not
    fail the run (the workers decide whether they can go on).

    Attributes:
        kind: what it is, for people (``"expert server"``).
        index: its index among the run's services of that kind.
        module: the Python module it runs (``python -m``).
        cores: CPU cores it is pinned to.
        start_at_s / kill_at_s / restart_at_s: seconds after the run's start (None: never).
    """

    kind: str
    index: int
    module: str
    cores: int = 1
    start_at_s: float = 0.0
    kill_at_s: float | None = None
    restart_at_s: float | None = None


@dataclass(frozen=True)
class DistributionModel:
    """Everything ddlscope knows about one distribution model.

    Attributes:
        name: the ``strategy`` value in a run config (e.g. ``"ddp"``).
        summary: one line: what the model does.
        strategy: ``"module:Class"`` of its :class:`~ddlscope.strategies.base.Strategy` under
            ``ddlscope.strategies`` (imported only when a worker needs it: torch.distributed
            and hivemind are heavy).
        launcher: how its workers are started (see :data:`Launcher`).
        measures: one line: what a run of it measures beyond the common step parts.
        predicts: one line: what its cost model predicts and from what (with the source of the
            formula).
        order: position in listings (``ddlscope models``, reports).
        data_parallel: True when every worker trains on its own batch (the global batch is
            workers x batch size); False when the workers share one batch (pipeline stages).
        min_workers / max_workers: how many workers it runs on (``max_workers`` None: no limit).
        config_table: the name of its own TOML table / RunConfig field (e.g. ``"collaborative"``),
            None when it has none; ``config_class`` is the pydantic model of that table.
        check_config: pre-flight checks of a whole :class:`~ddlscope.config.RunConfig` that only
            this model needs; raises ``ValueError`` with a message naming the field and what is
            allowed (pydantic turns it into the config's validation error).
        global_batch: ``(batch_size, workers, options) -> samples per optimizer step`` where
            ``options`` are the values of its config table; None: the default rule
            (``data_parallel_size(workers) * batch_size``).
        cost_model: ``(profile, cluster, setting, compute_scale) -> Prediction``, or None when
            ddlscope cannot predict it.
        memory_model: ``(profile, setting) -> list[MemoryEstimate]`` (one per worker), or None.
        reference_models: names of the closed-form reference models its prediction also
            reports (e.g. ``("eq5.1",)``, thesis 002).
        baseline: True for the one model every speedup is measured against (reports, sweeps:
            the first completed run of it is the baseline; :func:`baseline`).
        lockstep: True when the workers step together (a step lasts as long as the slowest
            worker's); False when they step on their own (collaborative peers, dmoe trainers,
            DiLoCo's inner steps between outer rounds): a measured step is then the time all
            workers trained over the samples they processed in it
            (:mod:`ddlscope.experiments.results`).
        startup_steps: ``(batch_size, workers, options) -> steps`` a measurement of a run excludes
            besides its warm-up, because the run pays them once at its start (collaborative: the
            first global epoch plus one, hivemind's peer discovery and first matchmaking); None: 0.
        measured_steps: steps per worker a measurement of it needs at least (collaborative: enough
            for several averaging rounds); None: the experiment's own count.
        estimate_factor: a run's wall time per step over its compute time, for the rough run-time
            estimates of :mod:`ddlscope.experiments.estimate` (a measured ratio, not a model).
        min_microbatches_per_worker: micro-batches a pipeline needs per stage (1F1B: 1); 0: none.
        table_3_3_batch: ``{dataset: (batch size, micro-batches)}`` when the model has its own
            column in thesis 002's Table 3.3 (GPipe); empty: the common column (the benchmark
            suite's defaults, :mod:`ddlscope.suite.spec`).
        network_problem: ``(network, dataset family) -> str | None``: why this model cannot train
            the zoo network on a dataset of that family (None: it can; dmoe: networks with a
            mixture-of-experts layer only); None: every network the zoo builds for the dataset.
            ``ddlscope validate`` leaves such pairs out of a grid that names no strategies and
            refuses a grid that names them.
        check_setting: ``(profile, setting) -> None``: checks of a prediction's
            :class:`~ddlscope.modeling.prediction.Setting` that only this model needs (pipelines:
            micro-batches that divide the batch, no more stages than layers); raises ``UserError``
            naming the field and what is allowed. The checks every model shares (known model,
            workers and batch >= 1, :meth:`check_workers`) are
            :func:`ddlscope.modeling.prediction.check_setting`'s.
        candidate: ``(setting, global_batch_size, options) -> Setting``: this model's candidate for
            a job of ``global_batch_size`` samples per step, given the default one (all workers,
            ``global / data_parallel_size`` samples each) and the job's options (``microbatches``,
            ``target_batch_size``, ``matchmaking_time_s``, ``use_local_updates``, each None when not
            given); None: the default candidate (:func:`ddlscope.modeling.recommend.candidate_settings`).
        uses_cluster_devices: True when every worker takes one device of the cluster, so a setting
            has at most the cluster's devices as workers; False when the workers are peers that
            bring their own devices (collaborative: ``[[cluster.peers]]``).
        services: ``(RunConfig) -> list[Service]``: processes the launcher starts besides the
            workers (swarm models only; dmoe's expert servers). When set, the services bootstrap
            the swarm and the workers never wait for worker 0's multiaddrs; None: no services.
        churn: ``(RunConfig) -> list[ChurnEvent]``: when the run's peers join late, leave, are
            killed and rejoin (swarm models; :mod:`ddlscope.launch.churn` carries it out); None:
            every peer runs from start to end.
        per_peer_report: True when a report shows its runs peer by peer (samples, averaging
            rounds, bytes, churn: :mod:`ddlscope.analyze.swarm`).
        compute_parts_alone: True when a run's measured ``forward_s``, ``backward_s`` and
            ``optimizer_s`` hold the work its cost model puts there, so that the prediction can be
            taken at the run's own compute (:attr:`~ddlscope.predict.validation_report.StrategyOutcome.error_at_run_compute`);
            False where a run's compute parts also hold work the cost model predicts in another
            part (fsdp: the all-gathers waited for inside the forward on CPU). dmoe's are alone:
            its trainers take the beam searches and remote calls out of the forward and backward
            (``comm_wait_s``), as its cost model does. collaborative's are alone since its model
            puts hivemind's background work during the steps in them, as measured
            (``HivemindFit.compute_overhead_s``); a cluster file from before that was measured puts
            it in the averaging overhead instead.
        calibrations: the fits of ``ddlscope calibrate`` its cost model reads beyond the
            collectives': ``"hivemind"`` (``--hivemind``, ``ClusterSpec.hivemind``) and ``"dmoe"``
            (``--dmoe``, ``ClusterSpec.dmoe``); ``validate`` and ``benchmarks/predictor.py``
            calibrate those a grid's models read (:func:`ddlscope.experiments.validate.calibration_options`).
        averages_with_hivemind: True when the model's rounds are hivemind's averaging rounds over
            the peers' links (collaborative): on emulated links ``validate`` and ``recommend
            --swarm`` then measure what such rounds carry (:func:`ddlscope.modeling.links.averaging_goodput`)
            and price them at it (``ClusterSpec.averaging_efficiency``).
        gathers_units: True when the workers all-gather and reduce-scatter the parameters unit by
            unit (fsdp): on emulated links with CPU workers ``validate`` and ``recommend --swarm``
            then measure what those collectives carry on gloo at the profile's unit sizes
            (:func:`ddlscope.modeling.links.fsdp_goodput`) and price them at it
            (``ClusterSpec.fsdp_link``).
    """

    name: str
    summary: str
    strategy: str
    launcher: Launcher
    measures: str
    predicts: str
    order: int = 100
    data_parallel: bool = True
    min_workers: int = 1
    max_workers: int | None = None
    config_table: str | None = None
    config_class: type[BaseModel] | None = None
    check_config: Callable[["RunConfig"], None] | None = None
    global_batch: Callable[[int, int, Mapping[str, Any]], int] | None = None
    cost_model: Callable[..., Any] | None = None
    memory_model: Callable[..., Any] | None = None
    reference_models: tuple[str, ...] = field(default_factory=tuple)
    baseline: bool = False
    lockstep: bool = True
    startup_steps: Callable[[int, int, Mapping[str, Any]], int] | None = None
    measured_steps: int | None = None
    estimate_factor: float = 1.0
    min_microbatches_per_worker: int = 0
    table_3_3_batch: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    check_setting: Callable[..., None] | None = None
    network_problem: Callable[[str, str], str | None] | None = None
    candidate: Callable[..., Any] | None = None
    uses_cluster_devices: bool = True
    services: Callable[["RunConfig"], list[Service]] | None = None
    churn: Callable[["RunConfig"], list[Any]] | None = None
    per_peer_report: bool = False
    compute_parts_alone: bool = True
    calibrations: tuple[str, ...] = field(default_factory=tuple)
    averages_with_hivemind: bool = False
    gathers_units: bool = False

    def __post_init__(self) -> None:
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"{self.name}: launcher {self.launcher!r}; allowed: {', '.join(LAUNCHERS)}")
        unknown = sorted(set(self.calibrations) - set(CALIBRATIONS))
        if unknown:
            raise ValueError(f"{self.name}: calibrations {unknown}; allowed: {', '.join(CALIBRATIONS)}")
        if (self.config_table is None) != (self.config_class is None):
            raise ValueError(f"{self.name}: config_table and config_class go together")
        missing = [f for f in SWARM_OPTIONS if not self.has_option(f)] if self.launcher == "swarm" else []
        if missing:
            raise ValueError(f"{self.name}: a swarm model's config table needs the field(s) {', '.join(missing)} "
                             f"(the swarm launcher's protocol; see ddlscope.distribution.Launcher)")

    # ------------------------------------------------------------------ config table
    def has_option(self, option: str) -> bool:
        """True when the model's config table has the field ``option``."""
        return self.config_class is not None and option in self.config_class.model_fields

    def option_default(self, option: str) -> Any:
        """The default of a field of the model's config table.

        Raises:
            KeyError: the model's table has no such field (or it has no table).
        """
        if not self.has_option(option):
            raise KeyError(f"{self.name} has no config option {option!r}")
        return self.config_class.model_fields[option].get_default(call_default_factory=True)

    @property
    def has_matchmaking(self) -> bool:
        """True when its averaging groups are formed by matchmaking: its table has :data:`MATCHMAKING_OPTION`."""
        return self.has_option(MATCHMAKING_OPTION)

    # ------------------------------------------------------------------ rules
    def data_parallel_size(self, workers: int) -> int:
        """Workers that each train on their own batch: ``workers``, or 1 when they share one batch."""
        return workers if self.data_parallel else 1

    def data_rank(self, worker_index: int) -> int:
        """Which data stream a worker reads (its shuffle seed offset): its index, or 0 when the
        workers share one batch."""
        return worker_index if self.data_parallel else 0

    def global_batch_size(self, batch_size: int, workers: int, options: Mapping[str, Any] | None = None) -> int:
        """Samples per optimizer step over all workers (``batch_size`` per worker per step)."""
        if self.global_batch is not None:
            return self.global_batch(batch_size, workers, options or {})
        return self.data_parallel_size(workers) * batch_size

    def startup_steps_of(self, batch_size: int, workers: int, options: Mapping[str, Any] | None = None) -> int:
        """Steps per worker a measurement excludes besides its warm-up (see ``startup_steps``); 0 by default."""
        if self.startup_steps is None:
            return 0
        return self.startup_steps(batch_size, workers, options or {})

    @property
    def multi_worker(self) -> bool:
        """True when it runs on more than one worker."""
        return self.max_workers is None or self.max_workers > 1

    def check_workers(self, workers: int, noun: str = "peers") -> str | None:
        """None if the model runs on ``workers`` workers, else the reason, naming what is allowed
        as ``noun`` (``peers`` in a run config, ``workers`` in a prediction's setting)."""
        if workers < self.min_workers or (self.max_workers is not None and workers > self.max_workers):
            allowed, cond = ((f"exactly {self.min_workers}", f"= {self.min_workers}")
                             if self.max_workers == self.min_workers
                             else (f">= {self.min_workers}",) * 2 if self.max_workers is None
                             else (f"{self.min_workers}..{self.max_workers}", f"in {self.min_workers}..{self.max_workers}"))
            return f"{self.name} runs on {allowed} worker(s), not {workers}; allowed: {noun} {cond}"
        return None

    def strategy_class(self) -> type:
        """The :class:`~ddlscope.strategies.base.Strategy` subclass (imported here, lazily)."""
        module, cls = self.strategy.split(":")
        return getattr(importlib.import_module(f"ddlscope.strategies.{module}"), cls)


_REGISTRY: dict[str, DistributionModel] = {}
_DISCOVERED = False


def register(model: DistributionModel) -> DistributionModel:
    """Add a model to the registry (called by the modules of this package at import).

    Raises:
        ValueError: a model of the same name is registered already, or a second baseline.
    """
    if model.name in _REGISTRY and _REGISTRY[model.name] is not model:
        raise ValueError(f"distribution model {model.name!r} is registered twice")
    other_baseline = next((m.name for m in _REGISTRY.values() if m.baseline and m.name != model.name), None)
    if model.baseline and other_baseline:
        raise ValueError(f"distribution model {model.name!r} is a baseline, but {other_baseline!r} is already")
    _REGISTRY[model.name] = model
    return model


def _discover() -> None:
    global _DISCOVERED
    if _DISCOVERED:
        return
    _DISCOVERED = True
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")


def all_models() -> list[DistributionModel]:
    """Every registered distribution model, in listing order."""
    _discover()
    return sorted(_REGISTRY.values(), key=lambda m: (m.order, m.name))


def names() -> tuple[str, ...]:
    """The registered model names, in listing order."""
    return tuple(m.name for m in all_models())


def get(name: str) -> DistributionModel:
    """The descriptor of a model.

    Raises:
        UserError: unknown name (the message lists the registered ones).
    """
    _discover()
    if name not in _REGISTRY:
        from ddlscope.errors import UserError

        raise UserError(f"unknown distribution model {name!r}; allowed: {', '.join(names())}")
    return _REGISTRY[name]


def baseline() -> DistributionModel:
    """The model every speedup is measured against (the one with ``baseline=True``).

    Raises:
        LookupError: no registered model is the baseline.
    """
    found = next((m for m in all_models() if m.baseline), None)
    if found is None:
        raise LookupError("no distribution model is registered with baseline=True")
    return found


def with_launcher(launcher: Launcher) -> tuple[str, ...]:
    """Names of the models started by ``launcher``."""
    return tuple(m.name for m in all_models() if m.launcher == launcher)


def config_tables() -> dict[str, type[BaseModel]]:
    """Model-specific config tables: ``{table name: pydantic class}`` (one class may serve several models)."""
    out: dict[str, type[BaseModel]] = {}
    for m in all_models():
        if m.config_table:
            out.setdefault(m.config_table, m.config_class)
    return out


__all__ = ["DistributionModel", "LAUNCHERS", "Launcher", "MATCHMAKING_OPTION", "SWARM_OPTIONS", "all_models", "baseline",
           "config_tables", "get", "names", "register", "with_launcher"]
