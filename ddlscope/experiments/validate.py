"""Validation: predict every cell of a grid, run it for real on this machine, and compare.

For each dataset x network the workload is profiled once (cached), every distribution model is
predicted and its memory checked by the recommender, each prediction is stored in the results
database (with whether the recommender chose it), and then the same settings are trained for real
by the experiment runner (:mod:`ddlscope.experiments.runner`: synthetic copies of the datasets, a
few warm-up and measured batches, seconds per epoch extrapolated to the real dataset by
:func:`ddlscope.experiments.results.measure_run`). The prediction row is linked to its run, so
validating is a join. Rerunning skips cells whose real run completed.

A predicted setting becomes a run config in one place, :func:`validation_cell`: the setting's
workers, batch, micro-batches (and, for pipelines, the predicted stage cut), and the fields of the
model's own config table taken from the setting's attributes of the same name, else from the
grid's (e.g. ``collaborative.target_batch_size`` / ``averaging_timeout_s``). What a measurement of
a model needs comes from its registry descriptor: the steps its start-up costs once
(``startup_steps``, excluded like a warm-up) and how many steps it must measure (``measured_steps``).

Grid files are TOML with one ``[validation]`` table (:class:`ValidationGrid`), or a preset:
``local`` (MNIST and CIFAR-10 shapes x ResNet-18, VGG-11, MobileNetV2 x every distribution model
with a cost model, on 2 workers of one core each), ``moe`` (the zoo's ``moe_cnn`` as ``dmoe`` with
2 trainers and 2 expert servers, next to ``single`` training it with its experts in-process) and
``links`` (every model that runs on emulated networks, MobileNetV2 on links of 200 and 50 Mbit/s
and an uneven pair of 200 and 20 Mbit/s, where communication dominates: root only), ``moe-links``
(dmoe's trainers and expert servers on emulated links) and ``tiny`` (for tests). A grid's
``bandwidths_mbit_per_s`` adds, for the models that run on emulated networks, cells per entry: the
run's workers each in a network namespace with links of that rate (or, for a list, worker i's link
at the i-th rate), predicted with the cluster's links at those rates (:func:`ddlscope.modeling.links.over_links`);
``loopback = false`` leaves out the loopback cells. A grid's ``churn`` runs its collaborative cells
with that churn schedule (``collaborative.churn``; preset ``churn``) and predicts each for the
churn that happened (:func:`churn_outcome`).
"""

from __future__ import annotations

import json
import re
import sqlite3
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, computed_field, field_validator, model_validator

from ddlscope import distribution
from ddlscope.config import (MAX_BATCH_SIZE, MAX_PEERS, _bad_numbers, _format_validation_error, available_cores,
                             read_toml)
from ddlscope.errors import UserError
from ddlscope.experiments import check_known
from ddlscope.distribution.collaborative import DEFAULT_MATCHMAKING_TIME_S, ChurnEvent
from ddlscope.experiments.results import churn_window, measure_run
from ddlscope.experiments.runner import Cell, RunFn, run_cells
from ddlscope.modeling.links import averaging_goodput, fsdp_goodput, links_goodput, over_links
from ddlscope.network.emulated import BUCKET_MS, emulated_models
from ddlscope.store.db import ResultsStore

if TYPE_CHECKING:
    from ddlscope.modeling.cluster import ClusterSpec
    from ddlscope.modeling.prediction import Setting
    from ddlscope.modeling.recommend import Candidate
    from ddlscope.predict.validation_report import StrategyOutcome, ValidationCell


def predicted_models() -> list[str]:
    """Every registered distribution model with a cost model (a newly registered one joins by itself)."""
    return [m.name for m in distribution.all_models() if m.cost_model is not None]


def _network_problem(model: str, network: str, dataset: str) -> str | None:
    """Why distribution model ``model`` cannot train ``network`` on ``dataset`` (None: it can, or the
    dataset is not a built-in one): the registry's ``network_problem``."""
    from ddlscope.workloads.datasets import DATASETS

    check = distribution.get(model).network_problem
    return None if check is None or dataset not in DATASETS else check(network, DATASETS[dataset].family)


class ValidationGrid(BaseModel):
    """A validation grid: datasets x networks, each with every distribution model in ``strategies``.

    Every cell trains the same global ``batch_size`` per optimizer step (see
    :mod:`ddlscope.modeling.recommend`); ``workers`` devices of ``threads_per_device`` cores each
    (default: all cores / workers), ``warmup_batches`` excluded from the timing, then
    ``measured_batches`` (or the model's own ``measured_steps``, collaborative: 48, so that the
    measurement spans several averaging rounds; ``model_measured_batches`` overrides either per
    model). Models whose runs pay a start-up once (collaborative: the first global epoch plus
    one, hivemind's peer discovery and first matchmaking) exclude those steps too, as the other
    models exclude their allocator's warm-up. The workloads are profiled, and the cells run, on
    ``device`` (cpu or cuda). ``strategies`` defaults to every model with a cost model that can
    train the grid's networks (each network only with the models that train it,
    :meth:`strategies_for`); a grid that names a model with a network it cannot train (the
    registry's ``network_problem``: dmoe and a network without a mixture-of-experts layer) is
    refused.
    """

    model_config = ConfigDict(extra="forbid")

    name: str = "validation"
    datasets: list[str] = Field(min_length=1)
    networks: list[str] = Field(min_length=1)
    strategies: list[str] = Field(default_factory=predicted_models, min_length=1)
    workers: int = Field(2, ge=2, le=MAX_PEERS)
    batch_size: int = Field(64, ge=1, le=MAX_BATCH_SIZE, description="global batch: samples per optimizer step")
    microbatches: int = Field(4, ge=1)
    warmup_batches: int = Field(2, ge=0)
    measured_batches: int = Field(8, ge=1)
    model_measured_batches: dict[str, int] = Field(
        default_factory=dict, description="measured batches per worker of some models, e.g. {collaborative = 48}")
    loader_workers: int = Field(0, ge=0)
    threads_per_device: int | None = Field(None, ge=1)
    target_batch_size: int | None = Field(None, ge=1, description="collaborative; default: the global batch")
    matchmaking_time_s: float = Field(1.0, gt=0)
    use_local_updates: bool = False
    averaging_timeout_s: float = Field(60.0, gt=0, description="collaborative: a stuck averaging round fails the "
                                       "measured run after this long")
    next_chunk_timeout_s: float | None = Field(None, gt=0, le=3600, description="collaborative: hivemind's "
                                               "next_chunk_timeout (default: the grid's matchmaking time, as "
                                               "hivemind derives it); rounds that drop a late peer's chunks end "
                                               "sooner than the whole rounds predicted")
    synthetic_train_size: int = Field(128, ge=1)
    bandwidths_mbit_per_s: list[float | list[float]] = Field(
        default_factory=list, description="emulated links, Mbit/s each way: a rate for every peer, or a list of one "
                                          "rate per worker (an uneven swarm); each gets cells of its own for the "
                                          "models that run on emulated networks")
    bucket_ms: float = Field(BUCKET_MS, gt=0, le=1_000, description="the emulated links' token bucket, ms at their "
                             "rate ([network] bucket_ms)")
    loopback: bool = Field(True, description="also run every model over loopback (the cells without emulated links)")
    device: Literal["cpu", "cuda"] = Field("cpu", description="where the workloads are profiled and every cell runs "
                                           "(its run config's device); `ddlscope validate --device` overrides it")
    churn: list[ChurnEvent] = Field(
        default_factory=list, description="the cells of swarm models (collaborative) run with this churn schedule "
                                          "(seconds from the swarm's first step) and are predicted for the churn "
                                          "that happened")
    repeats: int = Field(1, ge=1, le=10, description="real runs per cell, interleaved (every cell once, then "
                                                     "again); a cell's measured figures are its median run's, "
                                                     "and every repeat's seconds per epoch is kept for the spread")
    profile_each_repeat: bool = Field(
        False, description="profile again right before each repeat's runs and predict them from that profile: on a "
                           "machine whose speed drifts over the hours a grid takes, each prediction is then compared "
                           "with runs made right after its profile, as a user's would be")
    hivemind_each_repeat: bool = Field(
        False, description="with profile_each_repeat: also measure the cluster's hivemind fit (calibrate --hivemind's "
                           "swarms, about a minute) and hivemind's averaging share over each link again before each "
                           "round, and predict the round from them; off: the cluster's fit and one probe per link "
                           "serve every round. Off by default: in the one pass that tried it (docs/validation.md, stop "
                           "41) a fit's 10 epochs read overshoots of 0.05-0.35 steps within 30 minutes, noise larger "
                           "than the drift it was meant to follow, and the collaborative cells missed by more")
    hivemind_per_workload: bool = Field(
        True, description="a grid of several networks or datasets with a model that averages with hivemind: measure "
                          "hivemind's fit for each network and dataset at the grid's batch per peer (calibrate "
                          "--hivemind --swarm-network, a minute or two each, kept with the profiles) and predict each "
                          "workload's swarm cells from its own fit, as a user calibrates for their workload; off: "
                          "every workload from the cluster's one fit, of calibrate's reference network (VGG-11 "
                          "predicted from ResNet-18's fit: +29 and +41 %, docs/validation.md, stop 66)")

    @field_validator("bandwidths_mbit_per_s")
    @classmethod
    def _positive_rates(cls, v: list[float | list[float]]) -> list[float | list[float]]:
        flat = [b for entry in v for b in (entry if isinstance(entry, list) else [entry])]
        bad = [b for b in flat if not 0 < b <= 400_000] + [e for e in v if isinstance(e, list) and not e]
        if bad:
            raise ValueError(f"{bad}: allowed: rates in Mbit/s, > 0 and <= 400000, or non-empty lists of them")
        return v

    @model_validator(mode="after")
    def _one_rate_per_worker(self) -> "ValidationGrid":
        bad = [e for e in self.bandwidths_mbit_per_s if isinstance(e, list) and len(e) != self.workers]
        if bad:
            raise ValueError(f"bandwidths_mbit_per_s: {bad} must list one rate per worker ({self.workers})")
        if not self.loopback and not self.bandwidths_mbit_per_s:
            raise ValueError("loopback = false with no bandwidths_mbit_per_s leaves no cell; allowed: loopback = true "
                             "or at least one link rate")
        churning = [m for m in self.strategies if distribution.get(m).churn is not None]
        if self.churn and not churning:
            raise ValueError("churn applies to the cells of swarm models, and the grid has none; allowed: churn with "
                             f"one of {', '.join(m.name for m in distribution.all_models() if m.churn is not None)} "
                             f"among the strategies")
        bad = sorted({e.peer for e in self.churn if e.peer >= self.workers} |
                     {e.peer for e in self.churn if [f.peer for f in self.churn].count(e.peer) > 1})
        if bad:
            raise ValueError(f"churn: peers {bad} are outside 0..{self.workers - 1} or have two schedules; allowed: "
                             f"one schedule per peer of the {self.workers} workers")
        untrainable = {(m, net, ds): why for m in self.strategies for net in self.networks for ds in self.datasets
                       if (why := _network_problem(m, net, ds))}
        if untrainable and "strategies" in self.model_fields_set:
            (m, net, ds), why = next(iter(untrainable.items()))
            raise ValueError(f"strategies: {m} cannot train {net} on {ds} ({why}); allowed: leave {m} out of this "
                             f"grid's strategies, or give it a grid of networks it trains")
        pairs = len(self.networks) * len(self.datasets)  # no strategies named: models that train none are left out
        self.strategies = [m for m in self.strategies if sum(k[0] == m for k in untrainable) < pairs]
        return self

    def strategies_for(self, network: str, dataset: str) -> list[str]:
        """The grid's distribution models that can train ``network`` on ``dataset`` (a grid that names
        its strategies has only such models; one that names none leaves each model's other pairs out)."""
        return [m for m in self.strategies if _network_problem(m, network, dataset) is None]

    @field_validator("strategies")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        return check_known(v, predicted_models(), "distribution model")

    @field_validator("model_measured_batches")
    @classmethod
    def _known_models(cls, v: dict[str, int]) -> dict[str, int]:
        bad = {k: n for k, n in v.items() if k not in distribution.names() or n < 1}
        if bad:
            raise ValueError(f"{bad}: keys must be distribution models ({', '.join(distribution.names())}) "
                             f"and values >= 1")
        return v

    @property
    def threads(self) -> int:
        return self.threads_per_device or max(1, len(available_cores()) // self.workers)

    def measured_batches_of(self, model: str) -> int:
        """Measured batches per worker of ``model``'s cells (see the class docstring)."""
        own = distribution.get(model).measured_steps
        return self.model_measured_batches.get(model, own or self.measured_batches)

    @computed_field
    @property
    def measured_batches_by_model(self) -> dict[str, int]:
        """:meth:`measured_batches_of` every model of the grid (reports show it with the grid)."""
        return {m: self.measured_batches_of(m) for m in self.strategies}


PRESETS: dict[str, dict] = {
    # collaborative peers accumulate 2 global batches per averaging round: with a round after every
    # step hivemind 1.1.12 sometimes fails cancelling a pre-scheduled round (InvalidStateError)
    "local": dict(name="validation-local", datasets=["mnist", "cifar10"],
                  networks=["resnet18", "vgg11", "mobilenet_v2"], workers=2, batch_size=64, microbatches=4,
                  target_batch_size=128),
    # the Decentralized Mixture-of-Experts next to its in-process baseline (single trains the zoo's
    # moe_cnn with its experts in-process): 2 trainers, 2 expert servers sharing the 2 cores
    "moe": dict(name="validation-moe", datasets=["mnist", "cifar10"], networks=["moe_cnn"],
                strategies=["single", "dmoe"], workers=2, batch_size=32, warmup_batches=3, measured_batches=20,
                synthetic_train_size=256),
    # every model that runs on emulated networks where communication dominates: each worker in a network
    # namespace, links limited to 200 and 50 Mbit/s, and an uneven pair (200 and 20 Mbit/s); needs root
    # (docs/emulated-networks.md). MobileNetV2: 9 MB of parameters in many small tensors. collaborative
    # measures its default 48 steps per peer: 16 (~7 global epochs) left its samples per epoch to chance.
    # Three runs per cell: single runs of one cell moved by 10-20 % between passes (gpipe +14 % then +5 %,
    # fsdp at 200 Mbit/s +17 % then -3 %; the uneven pair's collaborative epoch 3,727 s to 5,302 s)
    # Each round profiled anew: in pass 5 every median run computed 6-23 % slower than the one profile taken
    # before the first of its 90 runs (the last ones ran 4.5 hours after it).
    # The chunk timeout a run at the default matchmaking time (10 s) gets: hivemind derives it from the
    # matchmaking time, and at the grid's 1 s, kept short for short runs, the uneven pair's peers cut about
    # half their rounds short (partial rounds, docs/swarms.md), which a user's run at the defaults does not
    "links": dict(name="validation-links", datasets=["mnist"], networks=["mobilenet_v2"],
                  strategies=["ddp", "fsdp", "gpipe", "1f1b", "collaborative", "diloco"], workers=2, batch_size=64,
                  target_batch_size=128, bandwidths_mbit_per_s=[200.0, 50.0, [200.0, 20.0]], loopback=False,
                  repeats=3, profile_each_repeat=True, next_chunk_timeout_s=DEFAULT_MATCHMAKING_TIME_S),
    # the Decentralized Mixture-of-Experts over emulated links: trainers and expert servers each in a namespace
    # with links of the same rate (a per-worker list would leave the servers' links unlimited). A bucket of 1 ms:
    # a step's remote calls (24 KiB out, 16 KiB back) fit in the default one and would not wait for the rate
    "moe-links": dict(name="validation-moe-links", datasets=["mnist"], networks=["moe_cnn"], strategies=["dmoe"],
                      workers=2, batch_size=32, warmup_batches=3, measured_batches=20, synthetic_train_size=256,
                      bandwidths_mbit_per_s=[50.0, 10.0], bucket_ms=1.0, loopback=False, repeats=3,
                      profile_each_repeat=True),
    # churn measured and predicted: peer 1 of a collaborative pair killed and back (seconds from the swarm's
    # first stored step: after the warm-up and start-up steps), on loopback and on 50 Mbit/s links (needs root).
    # Three runs per cell: two runs of one such cell differed by 36 % on 2 cores, more than the model's error
    "churn": dict(name="validation-churn", datasets=["mnist"], networks=["mobilenet_v2"], strategies=["collaborative"],
                  workers=2, batch_size=64, target_batch_size=128, model_measured_batches={"collaborative": 64},
                  bandwidths_mbit_per_s=[50.0], churn=[dict(peer=1, kill_at_s=20.0, rejoin_at_s=30.0)], repeats=3),
    "tiny": dict(name="validation-tiny", datasets=["mnist"], networks=["tiny_cnn"],
                 strategies=["single", "ddp", "gpipe"], workers=2, batch_size=16, microbatches=2,
                 warmup_batches=1, measured_batches=3, synthetic_train_size=64),
}


GRID_SWARM_EPOCHS = 30
"""Global epochs a grid's own hivemind swarm times (``calibrate``'s default: 10). A peer overshoots the
target batch by whole steps, so the overshoot is a mean of small counts: fits of 10 epochs of the same
network within 30 minutes read 0.05-0.40 steps (stop 41), and on a link-bound collaborative cell the
overshoot's error passes whole into the time per sample. Three times the epochs cut that noise by
sqrt(3), for about a minute more of calibration (MobileNetV2 at batch 32 on one-core peers)."""


def calibration_options(grid: ValidationGrid) -> dict[str, Any]:
    """The keyword arguments of :func:`ddlscope.profiling.calibrate.calibrate` that ``grid`` needs
    beyond workers and threads: ``hivemind`` and ``dmoe`` (the fits its models' cost models read,
    their registry entries' ``calibrations``), ``matchmaking_time_s`` (the grid's), and, for a
    grid of one network and dataset with a model that averages with hivemind, ``swarm_reference``
    ``(network, dataset shape)`` and ``swarm_batch_sizes`` ``[batch per peer]``: how far peers
    overshoot the target batch depends on the network (:mod:`ddlscope.profiling.swarm`), so its
    swarms train the grid's own network (the default reference otherwise), for
    :data:`GRID_SWARM_EPOCHS` global epochs."""
    models = [distribution.get(name) for name in grid.strategies]
    options: dict[str, Any] = {fit: any(fit in m.calibrations for m in models) for fit in distribution.CALIBRATIONS}
    options["matchmaking_time_s"] = grid.matchmaking_time_s
    if any(m.averages_with_hivemind for m in models) and len(grid.networks) == 1 and len(grid.datasets) == 1:
        options.update(workload_swarm_options(grid, grid.networks[0], grid.datasets[0]))
    return options


def missing_fits(grid: ValidationGrid, cluster: ClusterSpec, source: str) -> str | None:
    """What a given cluster file lacks for ``grid``: one line naming each fit
    (:data:`ddlscope.distribution.CALIBRATIONS`) that the grid's models read (their ``calibrations``)
    and ``cluster`` (read from ``source``) does not have, the models it leaves uncosted and how to
    add it; None when nothing is missing.

    Without its fit a model is predicted from the cluster's links alone (its prediction says so in
    a note), which the validation then measures as the model's error: a dmoe pass with a cluster
    file that had no dmoe fit read -92 % and -81 % where the next pass, calibrated, read single
    digits (docs/validation.md, stop 70).
    """
    lacking = {fit: names for fit in distribution.CALIBRATIONS if getattr(cluster, fit) is None
               if (names := sorted(n for n in grid.strategies if fit in distribution.get(n).calibrations))}
    if not lacking:
        return None
    what = "; ".join(f"no {fit} fit, which {', '.join(names)} read{'s' if len(names) == 1 else ''}"
                     for fit, names in lacking.items())
    flags = " ".join(f"--{fit}" for fit in lacking)
    return (f"the cluster file {source} has {what}: a model's prediction without its fit leaves out what the "
            f"fit measures, and the validation counts that as the model's error; measure it with "
            f"`ddlscope calibrate {flags} --out FILE` and pass that file, or leave out --cluster to calibrate this "
            f"machine now")


def workload_swarm_options(grid: ValidationGrid, network: str, dataset: str) -> dict[str, Any]:
    """The swarm options of :func:`ddlscope.profiling.calibrate.calibrate_hivemind` for a hivemind fit
    of one workload of ``grid``: ``swarm_reference`` ``(network, dataset)``, ``swarm_batch_sizes`` the
    batch per peer of the grid's models that average with hivemind, :data:`GRID_SWARM_EPOCHS` global
    epochs, the grid's matchmaking time."""
    swarm = [distribution.get(name) for name in grid.strategies if distribution.get(name).averages_with_hivemind]
    return {"matchmaking_time_s": grid.matchmaking_time_s, "swarm_reference": (network, dataset),
            "swarm_batch_sizes": sorted({max(1, grid.batch_size // m.data_parallel_size(grid.workers)) for m in swarm}),
            "swarm_epochs": GRID_SWARM_EPOCHS}


def fits_per_workload(grid: ValidationGrid) -> bool:
    """Whether ``grid`` predicts each workload's swarm cells from a hivemind fit of its own
    (:attr:`ValidationGrid.hivemind_per_workload`, several networks or datasets, a model that
    averages with hivemind); a grid of one workload calibrates its cluster's fit on it instead
    (:func:`calibration_options`)."""
    return grid.hivemind_per_workload and (len(grid.networks) > 1 or len(grid.datasets) > 1) \
        and any(distribution.get(name).averages_with_hivemind for name in grid.strategies)


def load_grid(path_or_preset: str) -> ValidationGrid:
    """A grid from a preset name or a TOML file with a ``[validation]`` table.

    Raises:
        UserError: no such file or preset, invalid TOML or fields.
    """
    if path_or_preset in PRESETS:
        return ValidationGrid(**PRESETS[path_or_preset])
    path = Path(path_or_preset)
    if not path.exists():
        raise UserError(f"validation grid not found: {path}; allowed: a TOML file or a preset ({', '.join(PRESETS)})")
    data = read_toml(path, "validation grid")
    if set(data) != {"validation"} or not isinstance(data["validation"], dict):
        got = sorted(data) if set(data) != {"validation"} else f"validation = {data['validation']!r}"
        raise UserError(f"validation grid {path}: expected exactly one [validation] table, got {got or 'none'}")
    bad = _bad_numbers(data["validation"], ValidationGrid, "validation")
    if bad:
        raise UserError(f"invalid grid {path}: " + "; ".join(bad))
    try:
        return ValidationGrid(**data["validation"])
    except ValidationError as err:
        raise UserError(_format_validation_error(err, ValidationGrid).replace("invalid run config",
                                                                              f"invalid grid {path}")) from None


def link_label(rates: float | list[float]) -> str:
    """A grid entry of ``bandwidths_mbit_per_s`` as shown in reports: ``"50 Mbit/s"``, ``"200/20 Mbit/s"``."""
    return "/".join(f"{r:g}" for r in (rates if isinstance(rates, list) else [rates])) + " Mbit/s"


def cell_key(setting: Setting, network: str, dataset: str, rates: float | list[float] | None = None) -> str:
    """The key and label of a cell's real run (and the key its prediction is stored under);
    ``rates``: the cell runs on an emulated network with links of this rate (a list: per worker)."""
    mb = f"-mb{setting.microbatches}" if setting.microbatches else ""
    link = "-" + "+".join(f"{r:g}" for r in (rates if isinstance(rates, list) else [rates])) + "mbit" \
        if rates is not None else ""
    return f"{setting.strategy}-{network}-{dataset}-{setting.workers}w-b{setting.global_batch_size}{mb}{link}"


def _churns(grid: ValidationGrid, strategy: str) -> bool:
    """Whether ``strategy``'s cells of ``grid`` run with the grid's churn schedule (a model whose
    registry descriptor carries churn out: a swarm)."""
    return bool(grid.churn) and distribution.get(strategy).churn is not None


def _key(grid: ValidationGrid, setting: Setting, network: str, dataset: str, rates: float | list[float] | None,
         repeat: int = 0) -> str:
    """:func:`cell_key`, with ``-churn`` for a cell run with the grid's churn schedule and ``-r2``,
    ``-r3``, ... for its second, third ... run (``repeat`` counts from 0; the first keeps the plain
    key, so a grid's stored runs are found again when its ``repeats`` grows)."""
    return (cell_key(setting, network, dataset, rates) + ("-churn" if _churns(grid, setting.strategy) else "")
            + (f"-r{repeat + 1}" if repeat else ""))


def _table_values(grid: ValidationGrid, model: distribution.DistributionModel, setting: Setting) -> dict[str, Any]:
    """The model's own config table for a setting: each field from the setting's field or option of
    the same name, else the grid's (when set); fields neither has keep their defaults."""
    if model.config_class is None:
        return {}
    options = setting.model_options()
    out = {}
    for name in model.config_class.model_fields:
        value = options[name] if options.get(name) is not None else getattr(grid, name, None)
        if value is not None:
            out[name] = value
    return out


def validation_cell(grid: ValidationGrid, setting: Setting, network: str, dataset: str, data_root: Path,
                    stage_bounds: list[int] | None = None, mbit_per_s: float | list[float] | None = None,
                    repeat: int = 0) -> Cell:
    """The real run of a predicted setting, as an experiment cell: same batch, micro-batches, workers
    and cores per device, the model's table from the setting (see the module docstring), and for
    pipelines the predicted stage cut (``stage_bounds``), so that the run is the configuration that
    was predicted rather than a cut re-measured at start-up. Its ``config`` raises UserError when
    the values are invalid (the runner then stores the cell as failed). ``mbit_per_s``: the run's
    peers each in a network namespace with links of this rate, or per worker for a list
    (:mod:`ddlscope.network.emulated`). The run's device is the grid's ``device``; a collaborative
    cell of a grid with ``churn`` runs that schedule. ``repeat``: which of the grid's ``repeats`` runs
    of the cell this is (0: the first; see :func:`_key`)."""
    model = distribution.get(setting.strategy)
    table = _table_values(grid, model, setting)
    warmup = grid.warmup_batches + model.startup_steps_of(setting.batch_size, setting.workers, table)
    measured = grid.measured_batches_of(model.name)
    key = _key(grid, setting, network, dataset, mbit_per_s, repeat)
    table.pop("churn", None)  # the grid's schedule, when it applies, as plain tables
    if _churns(grid, setting.strategy):
        table["churn"] = [e.model_dump(exclude_none=True) for e in grid.churn]
    values: dict[str, Any] = dict(
        name=key, strategy=setting.strategy, model=network, dataset=dataset, data_root=str(data_root),
        batch_size=setting.batch_size, peers=setting.workers, vcpus_per_peer=grid.threads, device=grid.device,
        loader_workers=grid.loader_workers, augment=False, final_eval=False, warmup_steps=warmup,
        sample_budget=(warmup + measured) * setting.batch_size * model.data_parallel_size(setting.workers),
    )
    if setting.microbatches:
        values["distributed"] = dict(microbatches=setting.microbatches, stage_bounds=stage_bounds)
    if model.config_table:
        values[model.config_table] = table
    if mbit_per_s is not None:
        rates = dict(links=[dict(peer=i, bandwidth_mbit_per_s=r) for i, r in enumerate(mbit_per_s)]) \
            if isinstance(mbit_per_s, list) else dict(bandwidth_mbit_per_s=mbit_per_s)
        values["network"] = dict(emulate=True, bucket_ms=grid.bucket_ms, **rates)
    return Cell(key=key, label=key, values=values)


def run_validation(grid: ValidationGrid, cluster: ClusterSpec, db_path: Path, data_root: Path | None = None,
                   profile_dir: Path | None = None, progress: bool = True, rerun: bool = False,
                   run_real: bool = True, run_fn: RunFn | None = None) -> list[ValidationCell]:
    """Profile, predict, store and (unless ``run_real`` is False) run every cell of ``grid``.

    Returns one :class:`ValidationCell` per dataset x network with an outcome per distribution
    model. Predictions are stored in the ``predictions`` table under the grid's name (``detail``
    says whether the recommender chose it: ``recommended``); real runs are ordinary runs in the
    group of the same name, run by :func:`ddlscope.experiments.runner.run_cells` (``run_fn``: its
    stand-in for tests).

    With ``repeats`` > 1 the cells run in rounds (every cell once, then again). A grid with
    ``profile_each_repeat`` profiles again before each round and predicts that round's runs from
    it (each prediction stored under its run's key, cached profiles in ``profile_dir/repeat-N``);
    otherwise (and with ``run_real`` False) one profile and one prediction per cell serve every round.
    ``rerun`` runs every cell again and, where each round has its profile, profiles again too.
    With the grid's ``hivemind_each_repeat``, such a grid with a model whose cost model reads the
    hivemind fit (its ``calibrations``) and a cluster with that fit also measures that fit
    again right before each round (:func:`round_hivemind_fit`, cached next to the round's profile;
    a store from before these were kept measures them when it is re-rendered), so that hivemind's
    overhead and overshoot follow the machine's state as the profile does; each cell's
    ``hivemind_fits`` lists the fit every round was predicted with. Its averaging share over each
    link is probed before each round too (``averaging_goodput_rounds``).

    Raises:
        KeyboardInterrupt: after the running cell was stopped and stored as interrupted.
    """
    from ddlscope.predict.validation_report import ValidationCell
    from ddlscope.workloads.datasets import write_synthetic

    root = Path(data_root or Path(db_path).parent / "suite-data")
    profile_dir = Path(profile_dir or Path(db_path).parent / "profiles")
    for ds in grid.datasets:
        write_synthetic(ds, root, train_size=max(grid.synthetic_train_size, grid.batch_size), test_size=32, seed=0)
    links = _Links(grid, db_path, measure=run_real and run_fn is None, rerun=rerun, progress=progress)
    # a round per repeat only where runs follow: predicting alone, one profile serves them all
    each = grid.profile_each_repeat and run_real
    rounds = [[r] for r in range(grid.repeats)] if each else [list(range(grid.repeats))]
    plans: list[list[_Planned]] = []
    runs: dict[str, tuple[str | None, str, str | None]] = {}
    refit = each and grid.hivemind_each_repeat and cluster.hivemind is not None and any("hivemind" in distribution.get(name).calibrations
                                                           for name in grid.strategies)
    per_workload = fits_per_workload(grid) and cluster.hivemind is not None
    fits: list[dict[str, Any]] = []
    for repeats in rounds:
        here = profile_dir if repeats[0] == 0 else profile_dir / f"repeat-{repeats[0] + 1}"
        at = cluster
        if refit and not per_workload:
            fit, row = round_hivemind_fit(grid, cluster, here, repeats[0], refresh=rerun, progress=progress)
            fits.append(row)
            at = cluster.model_copy(update={"hivemind": fit})
        cluster_for = None
        if per_workload:  # each workload's swarm cells from its own fit: measured once, or before each round
            fit_dir, remeasure = (here, rerun) if refit else (profile_dir, rerun and repeats[0] == 0)

            def cluster_for(net: str, ds: str, at: ClusterSpec = at, fit_dir: Path = fit_dir,
                            remeasure: bool = remeasure, first: int = repeats[0]) -> ClusterSpec:
                fit, row = round_hivemind_fit(grid, at, fit_dir / f"hivemind-{net}-{ds}", first if refit else 0,
                                              refresh=remeasure, progress=progress, workload=(net, ds))
                if refit or first == 0:
                    fits.append(row)
                return at.model_copy(update={"hivemind": fit})
        plans.append(_predict(grid, at, db_path, root, here, repeats, links, progress, refresh=rerun and each,
                              cluster_for=cluster_for))
        if run_real:
            # repeats interleaved: every cell once, then every cell again, so that a drift of the machine
            # (another load, thermal state) spreads over all cells rather than biasing some
            cells = [entry.cells[i] for i in range(len(repeats)) for plan in plans[-1] for entry in plan.entries]
            for o in run_cells(cells, db_path, grid.name, progress=progress, rerun=rerun, run_fn=run_fn,
                               what="validate"):
                runs[o.cell.key] = (o.run_id, o.status, o.reason)
    out = []
    for i, first in enumerate(plans[0]):
        outcomes = []
        for entry in first.entries:
            tries = [_Try(same.candidate, same.prediction_id, cell.key, runs.get(cell.key), plan[i].profile,
                          plan[i].cluster)
                     for plan in plans for same in plan[i].entries if same.key == entry.key for cell in same.cells]
            outcomes.append(_repeated_outcome(grid, db_path, tries))
        out.append(ValidationCell(dataset=first.dataset, network=first.label, workers=grid.workers, outcomes=outcomes,
                                  predict_s=first.predict_s, link=first.link, link_goodput=first.link_goodput,
                                  averaging_goodput=first.averaging_goodput, fsdp_goodput=first.fsdp_goodput,
                                  hivemind_fits=[f for f in fits
                                                 if f.get("workload") in (None, f"{first.label.split(' @ ')[0]} on "
                                                                                f"{first.dataset}")],
                                  averaging_goodput_rounds=[plan[i].averaging_goodput for plan in plans]
                                  if len(plans) > 1 and grid.hivemind_each_repeat and first.averaging_goodput is not None
                                  else []))
    return out


def round_hivemind_fit(grid: ValidationGrid, cluster: ClusterSpec, cache_dir: Path, round_index: int,
                       refresh: bool = False, progress: bool = True, workload: tuple[str, str] | None = None
                       ) -> tuple[Any, dict[str, Any]]:
    """The hivemind fit a round of ``grid`` (or, with ``workload`` ``(network, dataset)``, that
    workload's cells in it: :attr:`ValidationGrid.hivemind_per_workload`) is predicted with:
    measured on the grid's workers (:func:`ddlscope.profiling.calibrate.load_or_calibrate_hivemind`,
    the swarm options of :func:`calibration_options`, or :func:`workload_swarm_options`), kept in
    ``cache_dir`` so that a re-render predicts from the same fit (``refresh``: measured again).
    Where the swarms fail, the cluster's own fit, with the reason printed and recorded.

    Returns:
        (the :class:`~ddlscope.modeling.cluster.HivemindFit`, or None where the swarms failed and the
        cluster has none; a row for the report: ``round`` (from 1), ``workload`` (``"<network> on
        <dataset>"``, None for the grid's one fit), ``epoch_overhead_s``, ``overhead_steps``,
        ``compute_overhead_s``, ``overshoot_steps`` (each None without a fit) and ``measured``:
        ``"now"``, ``"cached"`` or why the cluster's fit was kept).
    """
    from ddlscope.profiling.calibrate import CalibrationError, load_or_calibrate_hivemind

    options = workload_swarm_options(grid, *workload) if workload else \
        {k: v for k, v in calibration_options(grid).items()
         if k in ("matchmaking_time_s", "swarm_reference", "swarm_batch_sizes", "swarm_epochs")}
    what = f"round {round_index + 1}" + (f", {workload[0]} on {workload[1]}" if workload else "")

    def say(line: str) -> None:
        print(f"validate {grid.name}: {line}", file=sys.stderr, flush=True)

    if progress:
        say(f"measuring hivemind's overhead and overshoot for {what} (hivemind swarms)")
    try:
        fit, cached = load_or_calibrate_hivemind(cache_dir, refresh=refresh, workers=grid.workers,
                                                 threads=grid.threads, progress=say if progress else None, **options)
        measured = "cached" if cached else "now"
    except CalibrationError as e:
        fit, measured = cluster.hivemind, f"kept the cluster's fit: {e}"
        say(f"{what}: hivemind's fit not measured ({e}); predicting with the cluster's")
    row = {"round": round_index + 1, "workload": f"{workload[0]} on {workload[1]}" if workload else None,
           **{k: getattr(fit, k) if fit is not None else None
              for k in ("epoch_overhead_s", "overhead_steps", "compute_overhead_s", "overshoot_steps")},
           "measured": measured}
    if progress and fit is not None:
        say(f"{what}: hivemind adds {fit.epoch_overhead_s:.3g} s + {fit.overhead_steps:.3g} x step per global "
            f"epoch, {fit.compute_overhead_s:.3g} s of it in the steps, peers overshoot by "
            f"{fit.overshoot_steps:.3g} steps ({measured})")
    return fit, row


@dataclass
class _Entry:
    """One candidate of a planned cell: its base cell ``key``, stored prediction and real runs."""
    key: str
    candidate: Candidate
    prediction_id: str
    cells: list[Cell]


@dataclass
class _Planned:
    """A dataset x network (x link entry) predicted from one profile, with the cells to run."""
    dataset: str
    label: str
    link: str | None
    predict_s: float
    entries: list[_Entry]
    link_goodput: float | None
    profile: Any
    cluster: ClusterSpec
    averaging_goodput: float | None = None
    fsdp_goodput: float | None = None


@dataclass
class _Try:
    """One real run of a candidate next to the prediction made for it (and its profile and cluster)."""
    candidate: Candidate
    prediction_id: str
    key: str
    run: tuple[str | None, str, str | None] | None
    profile: Any
    cluster: ClusterSpec


class _Links:
    """The shares of each link entry's rate that ddlscope prices communication at, each measured
    once and read back from the grid's earlier predictions (:func:`_stored_link_goodputs`) unless
    ``rerun``: the both-ways TCP share (``ddlscope.network.duplex``; once per validation, 1.0 when
    ``measure`` is False: no real runs, or stand-in runs), the share hivemind's averaging rounds reach
    (once per network and round of runs) and the share fsdp's unit collectives reach (once per
    network). The last two depend on the workload's sizes (parameter bytes, unit bytes), so they are
    kept per (link, network, dataset): a grid with two networks prices each at its own."""

    def __init__(self, grid: ValidationGrid, db_path: Path, measure: bool, rerun: bool, progress: bool):
        self.grid, self.db_path, self.measure, self.rerun, self.progress = grid, db_path, measure, rerun, progress
        self.stored: dict[str, dict[tuple[str, str | None, str | None, int], float]] = {}
        self.measured: dict[tuple[str, str, tuple[str, str] | None, int], float | None] = {}

    def share(self, mbit: float | list[float]) -> float:
        """The both-ways TCP share of the entry's links (``links.links_goodput``); 1.0 without real runs."""
        return self._probe("link_goodput", mbit, None, 0,
                           lambda: links_goodput(mbit, self.grid.workers, self.grid.bucket_ms),
                           lambda label, v: f"links {label} carry {v:.3f} of their rate each way with both ways busy",
                           unmeasured=1.0)

    def averaging(self, mbit: float | list[float], param_bytes: float, round_index: int = 0,
                  workload: tuple[str, str] | None = None) -> float | None:
        """The share hivemind's averaging rounds reach on the entry's links (``links.averaging_goodput``,
        rounds of ``param_bytes``), measured once per ``workload`` (network, dataset) and round of
        runs (``round_index``, from 0: each peer's one core is as busy as the machine is then; two
        passes' probes of the same 50 Mbit/s links read 0.709 and 0.773 and moved the link-bound
        collaborative cell by 7 %); None without real runs or where it cannot be measured (the rounds
        are then priced at the TCP share)."""
        return self._probe("averaging_goodput", mbit, workload, round_index,
                           lambda: averaging_goodput(mbit, self.grid.workers, param_bytes),
                           lambda label, v: f"hivemind's averaging rounds over links {label} carry {v:.3f} of their "
                                            f"rate, one core per peer" + (f" (round {round_index + 1})" if round_index else ""))

    def fsdp(self, mbit: float | list[float], unit_bytes: list[int], workload: tuple[str, str] | None = None) -> float | None:
        """The share of the slowest link's rate that fsdp's unit collectives of ``unit_bytes`` (the
        profile's layers) reach over the entry's links on gloo (``links.fsdp_goodput``), measured once
        per ``workload`` (network, dataset); None without real runs or where it cannot be measured
        (the collectives are then priced at the TCP share and FSDP's in-step rate)."""
        return self._probe("fsdp_goodput", mbit, workload, 0,
                           lambda: fsdp_goodput(mbit, self.grid.workers, unit_bytes, bucket_ms=self.grid.bucket_ms),
                           lambda label, v: f"fsdp's unit collectives (gloo) over links {label} carry {v:.3f} of "
                                            f"their rate, one core per worker")

    def _probe(self, field: str, mbit: float | list[float], workload: tuple[str, str] | None, round_index: int,
               measure: Callable[[], float | None], says: Callable[[str, float], str],
               unmeasured: float | None = None) -> float | None:
        """One share (``field``, as stored in a prediction's detail): the one this validation already
        has, else the one stored with the grid's earlier predictions, else ``measure()`` (when real
        runs measure; ``unmeasured`` otherwise); a progress line says which."""
        label = link_label(mbit)
        key = (field, label, workload, round_index)
        if key not in self.measured:
            stored = self._stored(field, label, workload, round_index)
            self.measured[key] = stored if stored is not None else (measure() if self.measure else unmeasured)
            if self.progress and self.measured[key] is not None:
                how = "" if stored is None else " (as measured before their stored runs; --rerun measures again)"
                print(f"validate {self.grid.name}: {says(label, self.measured[key])}{how}", file=sys.stderr, flush=True)
        return self.measured[key]

    def _stored(self, field: str, label: str, workload: tuple[str, str] | None, round_index: int) -> float | None:
        """The share stored for ``field`` with the grid's earlier predictions on link entry ``label``
        in round ``round_index``: of ``workload`` (network, dataset) where given (else of any), or of a
        prediction stored before shares were kept per workload; None without one (or with ``rerun``)."""
        if self.rerun:
            return None
        if field not in self.stored:
            self.stored[field] = _stored_link_goodputs(self.db_path, self.grid.name, field)
        shares = self.stored[field]
        if workload is None:
            return next((v for (link, _, _, r), v in shares.items() if link == label and r == round_index), None)
        return shares.get((label, *workload, round_index), shares.get((label, None, None, round_index)))


def _predict(grid: ValidationGrid, cluster: ClusterSpec, db_path: Path, root: Path, profile_dir: Path,
             repeats: list[int], links: _Links, progress: bool, refresh: bool = False,
             cluster_for: Callable[[str, str], ClusterSpec] | None = None) -> list[_Planned]:
    """Profile every dataset x network (cached in ``profile_dir``; ``refresh``: measured again even so),
    predict every candidate on loopback and on each link entry, store the predictions (under the key
    of the first of ``repeats``) and plan a cell per repeat in ``repeats``. ``cluster_for(network,
    dataset)``: the cluster a workload is predicted on (its own hivemind fit), else ``cluster``."""
    from ddlscope.modeling.recommend import candidate_settings, recommend
    from ddlscope.profiling.profile import load_or_profile
    from ddlscope.workloads.datasets import DATASETS

    planned = []
    for ds in grid.datasets:
        for net in grid.networks:
            if progress:
                print(f"validate {grid.name}: profiling {net} on {ds} and predicting"
                      + (f" (round {repeats[0] + 1})" if repeats[0] else ""), file=sys.stderr, flush=True)
            at = cluster_for(net, ds) if cluster_for is not None else cluster  # this workload's
            t0 = time.perf_counter()
            profile = load_or_profile(net, ds, grid.batch_size, grid.device, threads=grid.threads,
                                      loader_workers=(grid.loader_workers,), data_root=root, cache_dir=profile_dir,
                                      refresh=refresh)
            settings = candidate_settings(
                grid.strategies_for(net, ds), grid.workers, grid.batch_size, DATASETS[ds].train_size,
                microbatches=grid.microbatches, loader_workers=grid.loader_workers,
                target_batch_size=grid.target_batch_size, matchmaking_time_s=grid.matchmaking_time_s,
                use_local_updates=grid.use_local_updates)
            first = True
            for mbit in [None, *grid.bandwidths_mbit_per_s] if grid.loopback else grid.bandwidths_mbit_per_s:
                here = settings if mbit is None else [s for s in settings if s.strategy in emulated_models()]
                if not here:
                    continue
                goodput = None if mbit is None else links.share(mbit)  # measured once per link entry, not timed
                averaging = None if mbit is None or not any(distribution.get(s.strategy).averages_with_hivemind
                                                            for s in here) \
                    else links.averaging(mbit, profile.param_bytes, repeats[0] if grid.hivemind_each_repeat else 0,
                                         (net, ds))
                gloo = links.fsdp(mbit, [layer.param_bytes for layer in profile.layers], (net, ds)) \
                    if mbit is not None and profile.device.type == "cpu" \
                    and any(distribution.get(s.strategy).gathers_units for s in here) else None
                t1 = time.perf_counter()
                over = None if mbit is None else over_links(at, mbit, grid.workers, goodput, averaging, gloo,
                                                            bucket_ms=grid.bucket_ms)
                rec = recommend(profile, at if mbit is None else over, here)
                link = None if mbit is None else link_label(mbit)
                stored_link = None if mbit is None else {"link": link, "network": net, "dataset": ds,
                                                         "link_goodput": goodput,
                                                         "averaging_goodput": averaging, "fsdp_goodput": gloo}
                with ResultsStore(db_path) as store:
                    entries = [_Entry(_key(grid, c.setting, net, ds, mbit), c,
                                      _store_prediction(store, grid.name, c, c is rec.best, net, ds,
                                                        _key(grid, c.setting, net, ds, mbit, repeats[0]), stored_link),
                                      [validation_cell(grid, c.setting, net, ds, root,
                                                       c.prediction.inputs.get("stage_bounds") if c.prediction else None,
                                                       mbit, repeat) for repeat in repeats])
                               for c in rec.candidates]
                # the profile's time counts once, with the first cell of this network
                planned.append(_Planned(ds, net if link is None else f"{net} @ {link}", link,
                                        (t1 - t0 if first else 0.0) + time.perf_counter() - t1, entries, goodput,
                                        profile, over or at, averaging, gloo))
                first = False
    return planned


def _stored_link_goodputs(db_path: Path, group: str, field: str = "link_goodput"
                          ) -> dict[tuple[str, str | None, str | None, int], float]:
    """Per link entry (e.g. ``"200 Mbit/s"``), network, dataset and round of runs (from 0: a
    prediction's key ends in ``-r2`` for the second), the share (``field`` ``link_goodput``: both-ways
    TCP; ``averaging_goodput``: hivemind's rounds; ``fsdp_goodput``: fsdp's unit collectives) that the
    grid ``group``'s first predictions for them were made with (stored in their ``detail``; network
    and dataset None for a prediction stored before they were kept); empty without a store.

    Runs reused from the store are predicted again with the share measured before they ran:
    measured anew, the share of the same links moved by up to 6 % between measurements on this
    project's machine (200/20 Mbit/s: 0.81, 0.78, 0.83), which moved the predictions of their
    cells as much.
    """
    shares: dict[tuple[str, str | None, str | None, int], float] = {}
    if not Path(db_path).exists():
        return shares
    with ResultsStore(db_path) as store:
        for pred in store.predictions(group):
            detail = json.loads(pred["detail_json"] or "{}")
            if detail.get("link") is not None and detail.get(field) is not None:
                repeat = re.search(r"-r(\d+)$", pred["cell_key"])
                shares.setdefault((detail["link"], detail.get("network"), detail.get("dataset"),
                                   int(repeat.group(1)) - 1 if repeat else 0), float(detail[field]))
    return shares


def _store_prediction(store: ResultsStore, group: str, cand: Candidate, recommended: bool, net: str, ds: str,
                      key: str, link_goodput: dict[str, Any] | None = None) -> str:
    """Store one candidate's prediction under its cell's ``key`` (with the link entry and the share
    of its rate it was predicted at, ``link_goodput``, for a cell on emulated links); return the
    prediction id."""
    s, p = cand.setting, cand.prediction
    return store.add_prediction(
        key, s.strategy, s.workers, s.batch_size, group_name=group, microbatches=s.microbatches,
        predicted_step_s=p.step_s if p else None, predicted_epoch_s=p.epoch_s if p else None,
        memory_bytes=cand.memory_bytes, capacity_bytes=cand.capacity_bytes, fits=cand.fits,
        dominant_cost=p.dominant_cost if p else None,
        detail={"breakdown_s": p.breakdown_s if p else None, "inputs": p.inputs if p else None,
                "reference_epoch_s": p.reference_epoch_s if p else None, "invalid": cand.invalid_reason,
                "recommended": recommended, **(link_goodput or {})})


def _repeated_outcome(grid: ValidationGrid, db_path: Path, tries: list[_Try]) -> StrategyOutcome:
    """A candidate's predictions next to its cell's real runs, one :class:`_Try` per repeat (its run:
    id, runner status, reason; None: not run).

    Each repeat gets :func:`_outcome` against the prediction made for it (and, for a cell run with
    churn, :func:`churn_outcome`: its own prediction for the churn that happened in it). The cell's
    outcome is its **median run**'s: of the completed repeats ordered by measured seconds per epoch,
    the middle one (of an even number, the faster of the middle two); without a completed repeat,
    the first repeat's. A prediction made for one run (a grid that profiles each repeat) is linked
    to that run; one prediction for every repeat is linked to the median run. With more than one
    repeat the outcome also keeps every completed repeat's measured seconds per epoch (and, where
    each had a prediction of its own, the predicted), in run order, and says in ``reason`` how many failed and why the first did.
    """
    tried = []
    for t in tries:
        o = _outcome(db_path, t.candidate, t.run)
        if _churns(grid, t.candidate.setting.strategy) and t.run is not None and o.measured:
            o = churn_outcome(o, db_path, t.run[0], t.profile, t.cluster, t.candidate.setting, grid.name, t.key)
        tried.append((o, t))
    done = sorted((x for x in tried if x[0].measured), key=lambda x: x[0].measured_epoch_s)
    outcome, median = done[(len(done) - 1) // 2] if done else tried[0]
    own = len({t.prediction_id for t in tries}) == len(tries)  # a prediction per run
    with ResultsStore(db_path) as store:
        for _, t in tried if own else [(outcome, median)]:
            if t.run is not None and t.run[0] is not None:
                store.link_prediction(t.prediction_id, t.run[0])
    if len(tried) > 1:
        outcome.measured_repeats_epoch_s = [o.measured_epoch_s for o, _ in tried if o.measured]
        outcome.failed_rounds_per_run = [n for o, _ in tried if o.measured for n in o.failed_rounds_per_run]
        outcome.partial_rounds_per_run = [n for o, _ in tried if o.measured for n in o.partial_rounds_per_run]
        outcome.join_timeouts_per_run = [n for o, _ in tried if o.measured for n in o.join_timeouts_per_run]
        outcome.overshoot_steps_per_run = [x for o, _ in tried if o.measured for x in o.overshoot_steps_per_run]
        if own or _churns(grid, tries[0].candidate.setting.strategy):
            outcome.predicted_repeats_epoch_s = [o.predicted_epoch_s for o, _ in tried if o.measured]
        failed = [o for o, _ in tried if not o.measured]
        if failed and done:
            outcome.reason = f"{len(failed)} of {len(tried)} repeats did not complete: {failed[0].status}: {failed[0].reason}"
    return outcome


def _outcome(db_path: Path, cand: Candidate, run: tuple[str | None, str, str | None] | None) -> StrategyOutcome:
    """A candidate's prediction next to one real run (``run``: id, runner status, reason; None: not run)."""
    from ddlscope.predict.validation_report import StrategyOutcome

    p = cand.prediction
    outcome = StrategyOutcome(
        strategy=cand.setting.strategy, predicted_epoch_s=p.epoch_s if p else None,
        predicted_memory_bytes=cand.memory_bytes, fits=cand.fits if p else None, measured_epoch_s=None,
        status="not-run", reason=cand.invalid_reason, reference_epoch_s=dict(p.reference_epoch_s) if p else {},
        dominant_cost=p.dominant_cost if p else None, predicted_parts_s=dict(p.breakdown_s) if p else {},
        predicted_overshoot_steps=p.inputs.get("overshoot_steps") if p else None,
        **dict(zip(("predicted_allocator_bytes", "predicted_runtime_bytes"), cand.memory_split_bytes or (None, None))))
    if run is None:
        return outcome
    run_id, status, reason = run
    if run_id is None:  # interrupted before the launcher stored anything
        outcome.status, outcome.reason = "failed", reason or status
        return outcome
    with ResultsStore(db_path) as store:
        row = store.run(run_id)
        measured = measure_run(store, run_id)
        swarm = measured is not None and measured.epoch_s and distribution.get(cand.setting.strategy).averages_with_hivemind
        overshoot = _overshoot_steps(store, row) if swarm else None
    if measured is not None and measured.epoch_s:
        outcome.status, outcome.measured_epoch_s = "completed", measured.epoch_s
        outcome.measured_memory_bytes, outcome.measured_parts_s = measured.peak_memory_bytes, measured.parts_s
        outcome.measured_allocator_bytes, outcome.measured_runtime_bytes = measured.allocator_peak_bytes, \
            measured.runtime_bytes
        outcome.failed_rounds_per_run = [measured.averaging_rounds_failed]
        if measured.averaging_rounds_partial is not None or swarm:
            outcome.partial_rounds_per_run = [measured.averaging_rounds_partial]
            outcome.join_timeouts_per_run = [measured.averaging_rounds_join_timeout]
        if swarm:
            outcome.overshoot_steps_per_run = [] if overshoot is None else [overshoot]
    else:  # failed, interrupted, or completed without a measured step
        outcome.status = "failed"
        outcome.reason = row["reason"] or f"run {run_id} ended {row['status']} without measured steps"
    return outcome


def _overshoot_steps(store: ResultsStore, run_row: sqlite3.Row) -> float | None:
    """Steps per peer per global epoch past the target batch size in the stored swarm run ``run_row``
    of ``store`` (:func:`ddlscope.analyze.swarm.stored_global_epochs`); None without a whole global
    epoch or a target batch size."""
    from ddlscope.analyze.swarm import stored_global_epochs

    epochs = stored_global_epochs(run_row, store.rows("steps", run_row["run_id"]))
    return None if epochs is None else epochs.overshoot_steps


def churn_outcome(outcome: StrategyOutcome, db_path: Path, run_id: str, profile, cluster: ClusterSpec,
                  setting: Setting, group: str, key: str) -> StrategyOutcome:
    """A collaborative cell run with churn: measured and predicted over its churn window.

    The measurement is :func:`ddlscope.experiments.results.churn_window` of the run: seconds per
    epoch of the real dataset = ``run_s x epoch_samples / samples trained`` (the samples that
    reached an averaging round) in the window where the schedule applies. The prediction is the
    collaborative cost model with the churn that happened (the launcher's events) and the window's
    length (``churn`` and ``run_s`` options, with the run's ``averaging_timeout_s`` and ``progress_expiration_s``,
    :func:`ddlscope.distribution.collaborative.predict_collaborative`):
    what it predicts is how many samples the swarm trains in that time. It is stored as a prediction
    of its own under ``key``, linked to the run. A run whose window cannot be measured (see
    :func:`churn_window`) becomes ``failed`` with the reason.
    """
    import dataclasses

    from ddlscope.modeling.prediction import predict

    with ResultsStore(db_path) as store:
        window = churn_window(store, run_id)
        if window is None or window.samples_trained <= 0:
            outcome.status, outcome.measured_epoch_s = "failed", None
            outcome.reason = (f"run {run_id}: its churn could not be measured (no churn events, a change before every "
                              f"peer trained, or no common time)")
            return outcome
        table = store.run_config(run_id).get(distribution.get(setting.strategy).config_table or "", {})
        options = {**setting.options, "churn": window.schedule, "run_s": window.run_s,
                   **{k: table[k] for k in ("averaging_timeout_s", "progress_expiration_s") if k in table}}
        try:
            p = predict(profile, cluster, dataclasses.replace(setting, options=options))
        except UserError as err:
            outcome.predicted_epoch_s, outcome.reason = None, f"churn prediction: {err}"
            return outcome
        pid = store.add_prediction(
            key, setting.strategy, setting.workers, setting.batch_size, group_name=group, predicted_step_s=p.step_s,
            predicted_epoch_s=p.epoch_s, dominant_cost=p.dominant_cost,
            detail={"breakdown_s": p.breakdown_s, "inputs": p.inputs, "churn_window": dataclasses.asdict(window),
                    "recommended": False})
        store.link_prediction(pid, run_id)
    outcome.predicted_epoch_s, outcome.predicted_parts_s = p.epoch_s, dict(p.breakdown_s)
    outcome.measured_epoch_s = window.run_s * setting.epoch_samples / window.samples_trained
    return outcome
