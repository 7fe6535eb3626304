"""Validation: predict every cell of a grid, run it for real on this machine, and compare.

For each dataset x network the workload is profiled once (cached), every distribution model is
predicted and its memory checked (:func:`ddlscope.predict.recommend.recommend`), the prediction
is stored in the results database, and then the same setting is trained for real through the
ordinary launcher (the suite's machinery: synthetic copies of the datasets, a few warm-up and
measured batches, seconds per epoch extrapolated to the real dataset). The prediction row is
linked to its run, so validating is a join. Rerunning skips cells whose real run completed.

Grid files are TOML with one ``[validation]`` table (:class:`ValidationGrid`), or a preset:
``local`` (MNIST and CIFAR-10 shapes x ResNet-18, VGG-11, MobileNetV2 x all six distribution
models on 2 workers of one core each) and ``tiny`` (for tests).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ddlscope.config import RunConfig, _format_validation_error, available_cores, read_toml
from ddlscope.errors import UserError
from ddlscope.predict.cluster import ClusterSpec
from ddlscope.predict.costs import MODELS, Setting
from ddlscope.predict.recommend import Candidate, candidate_settings, recommend
from ddlscope.predict.validation_report import StrategyOutcome, ValidationCell
from ddlscope.store.db import ResultsStore
from ddlscope.suite.runner import CellProgress


class ValidationGrid(BaseModel):
    """A validation grid: datasets x networks, each with every distribution model in ``strategies``.

    Every cell trains the same global ``batch_size`` per optimizer step (see
    :mod:`ddlscope.predict.recommend`); ``workers`` devices of ``threads_per_device`` cores each
    (default: all cores / workers), ``warmup_batches`` excluded from the timing, then
    ``measured_batches`` (collaborative peers: ``collaborative_measured_batches``, so that the
    measurement spans several averaging rounds). Collaborative peers also exclude the steps of
    their first global epoch plus one (hivemind's start-up: peer discovery and the first
    matchmaking, which a long run pays once), as the other models exclude their allocator's warm-up.
    """

    model_config = ConfigDict(extra="forbid")

    name: str = "validation"
    datasets: list[str] = Field(min_length=1)
    networks: list[str] = Field(min_length=1)
    strategies: list[str] = Field(default_factory=lambda: list(MODELS), min_length=1)
    workers: int = Field(2, ge=2)
    batch_size: int = Field(64, ge=1, description="global batch: samples per optimizer step")
    microbatches: int = Field(4, ge=1)
    warmup_batches: int = Field(2, ge=0)
    measured_batches: int = Field(8, ge=1)
    collaborative_measured_batches: int = Field(
        48, ge=1, description="collaborative cells: batches per peer, enough for many averaging rounds (a "
        "peer's steps per global epoch are a whole number that varies from epoch to epoch)")
    loader_workers: int = Field(0, ge=0)
    threads_per_device: int | None = Field(None, ge=1)
    target_batch_size: int | None = Field(None, ge=1, description="collaborative; default: the global batch")
    matchmaking_time_s: float = Field(1.0, gt=0)
    use_local_updates: bool = False
    synthetic_train_size: int = Field(128, ge=1)

    @field_validator("strategies")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        bad = [s for s in v if s not in MODELS]
        if bad:
            raise ValueError(f"unknown distribution model(s) {bad}; allowed: {', '.join(MODELS)}")
        return v

    @property
    def threads(self) -> int:
        return self.threads_per_device or max(1, len(available_cores()) // self.workers)


PRESETS: dict[str, dict] = {
    # collaborative peers accumulate 2 global batches per averaging round: with a round after every
    # step hivemind 1.1.12 sometimes fails cancelling a pre-scheduled round (InvalidStateError)
    "local": dict(name="validation-local", datasets=["mnist", "cifar10"],
                  networks=["resnet18", "vgg11", "mobilenet_v2"], workers=2, batch_size=64, microbatches=4,
                  target_batch_size=128),
    "tiny": dict(name="validation-tiny", datasets=["mnist"], networks=["tiny_cnn"],
                 strategies=["single", "ddp", "gpipe"], workers=2, batch_size=16, microbatches=2,
                 warmup_batches=1, measured_batches=3, synthetic_train_size=64),
}


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
    if set(data) != {"validation"}:
        raise UserError(f"validation grid {path}: expected exactly one [validation] table, got {sorted(data) or 'none'}")
    try:
        return ValidationGrid(**data["validation"])
    except ValidationError as err:
        raise UserError(_format_validation_error(err).replace("invalid run config", f"invalid grid {path}")) from None


def cell_key(setting: Setting, network: str, dataset: str) -> str:
    """The label of a cell's real run (and the key its prediction is stored under)."""
    mb = f"-mb{setting.microbatches}" if setting.microbatches else ""
    return f"{setting.strategy}-{network}-{dataset}-{setting.workers}w-b{setting.global_batch_size}{mb}"


def run_config_for(grid: ValidationGrid, setting: Setting, network: str, dataset: str, data_root: Path,
                   stage_bounds: list[int] | None = None) -> RunConfig:
    """The real run of a predicted setting: same batch, micro-batches, workers and cores per device,
    and for pipelines the predicted stage cut (``stage_bounds``), so that the run is the configuration
    that was predicted rather than a cut re-measured at start-up.

    Raises:
        UserError: the run config is invalid (stored as a failed cell by :func:`run_validation`).
    """
    dp = 1 if setting.strategy in ("gpipe", "1f1b") else setting.workers
    measured = grid.collaborative_measured_batches if setting.strategy == "collaborative" else grid.measured_batches
    warmup = grid.warmup_batches
    if setting.strategy == "collaborative":  # and the first global epoch: hivemind's start-up, once per run
        warmup += math.ceil(setting.target_batch_size / (setting.workers * setting.batch_size)) + 1
    values = dict(
        name=cell_key(setting, network, dataset), strategy=setting.strategy, model=network, dataset=dataset,
        data_root=str(data_root), batch_size=setting.batch_size, peers=setting.workers,
        vcpus_per_peer=grid.threads, device="cpu", loader_workers=grid.loader_workers, augment=False,
        final_eval=False, warmup_steps=warmup, sample_budget=(warmup + measured) * setting.batch_size * dp,
    )
    if setting.microbatches:
        values["distributed"] = dict(microbatches=setting.microbatches, stage_bounds=stage_bounds)
    if setting.strategy == "collaborative":
        values["collaborative"] = dict(target_batch_size=setting.target_batch_size,
                                       matchmaking_time_s=setting.matchmaking_time_s,
                                       use_local_updates=setting.use_local_updates, averaging_timeout_s=60.0)
    try:
        return RunConfig(**values)
    except ValidationError as err:
        raise UserError(_format_validation_error(err)) from None


def run_validation(grid: ValidationGrid, cluster: ClusterSpec, db_path: Path, data_root: Path | None = None,
                   profile_dir: Path | None = None, progress: bool = True, rerun: bool = False,
                   run_real: bool = True) -> list[ValidationCell]:
    """Profile, predict, store and (unless ``run_real`` is False) run every cell of ``grid``.

    Returns one :class:`ValidationCell` per dataset x network with an outcome per distribution
    model. Predictions are stored in the ``predictions`` table under the grid's name; real runs
    are ordinary runs in the group of the same name.

    Raises:
        KeyboardInterrupt: after the running cell was stopped and stored as interrupted.
    """
    from ddlscope.launch.local import run_local
    from ddlscope.predict.profile import load_or_profile
    from ddlscope.workloads.datasets import DATASETS, write_synthetic

    root = Path(data_root or Path(db_path).parent / "suite-data")
    profile_dir = Path(profile_dir or Path(db_path).parent / "profiles")
    for ds in grid.datasets:
        write_synthetic(ds, root, train_size=max(grid.synthetic_train_size, grid.batch_size), test_size=32, seed=0)
    cells: list[ValidationCell] = []
    bar = CellProgress(len(grid.datasets) * len(grid.networks) * len(grid.strategies), "validate") if progress else None
    try:
        for ds in grid.datasets:
            for net in grid.networks:
                if bar:
                    bar.start(f"profiling {net} on {ds}")
                t0 = time.perf_counter()
                profile = load_or_profile(net, ds, grid.batch_size, threads=grid.threads,
                                          loader_workers=(grid.loader_workers,), data_root=root, cache_dir=profile_dir)
                settings = candidate_settings(
                    grid.strategies, grid.workers, grid.batch_size, DATASETS[ds].train_size,
                    microbatches=grid.microbatches, loader_workers=grid.loader_workers,
                    target_batch_size=grid.target_batch_size, matchmaking_time_s=grid.matchmaking_time_s,
                    use_local_updates=grid.use_local_updates)
                rec = recommend(profile, cluster, settings)
                predict_s = time.perf_counter() - t0
                outcomes = []
                for cand in rec.candidates:
                    if bar:
                        bar.start(cell_key(cand.setting, net, ds))
                    outcomes.append(_validate_candidate(grid, cand, net, ds, root, db_path, run_local, rerun, run_real))
                    if bar:
                        bar.advance()
                cells.append(ValidationCell(dataset=ds, network=net, workers=grid.workers, outcomes=outcomes,
                                            predict_s=predict_s))
    finally:
        if bar:
            bar.close()
    return cells


def _validate_candidate(grid: ValidationGrid, cand: Candidate, net: str, ds: str, root: Path, db_path: Path,
                        run_local, rerun: bool, run_real: bool) -> StrategyOutcome:
    from ddlscope.suite.runner import cell_result

    s, p = cand.setting, cand.prediction
    key = cell_key(s, net, ds)
    with ResultsStore(db_path) as store:
        pid = store.add_prediction(
            key, s.strategy, s.workers, s.batch_size, group_name=grid.name, microbatches=s.microbatches,
            predicted_step_s=p.step_s if p else None, predicted_epoch_s=p.epoch_s if p else None,
            memory_bytes=cand.memory_bytes, capacity_bytes=cand.capacity_bytes, fits=cand.fits,
            dominant_cost=p.dominant_cost if p else None,
            detail={"breakdown_s": p.breakdown_s if p else None, "inputs": p.inputs if p else None,
                    "reference_epoch_s": p.reference_epoch_s if p else None, "invalid": cand.invalid_reason})
        done = [r for r in store.runs(grid.name) if r["name"] == key and r["status"] == "completed"]
    outcome = StrategyOutcome(
        strategy=s.strategy, predicted_epoch_s=p.epoch_s if p else None, predicted_memory_bytes=cand.memory_bytes,
        fits=cand.fits if p else None, measured_epoch_s=None, status="not-run", reason=cand.invalid_reason,
        reference_epoch_s=dict(p.reference_epoch_s) if p else {}, dominant_cost=p.dominant_cost if p else None)
    if not run_real:
        return outcome
    if done and not rerun:
        run_id = done[-1]["run_id"]
    else:
        try:
            bounds = p.inputs.get("stage_bounds") if p else None
            run_id = run_local(run_config_for(grid, s, net, ds, root, bounds), db_path, group_name=grid.name,
                               progress=False)
        except UserError as err:
            outcome.status, outcome.reason = "failed", str(err)
            return outcome
    with ResultsStore(db_path) as store:
        store.link_prediction(pid, run_id)
        res = cell_result(store, dict(store.run(run_id)))
    if res.status == "completed" and res.epoch_s:
        outcome.status, outcome.measured_epoch_s = "completed", res.epoch_s
    else:  # failed, interrupted, or completed without a measured step
        outcome.status = "failed"
        outcome.reason = res.reason or f"run {run_id} ended {res.status} without measured steps"
    outcome.measured_memory_bytes = res.peak_memory_bytes
    return outcome

