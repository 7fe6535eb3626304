"""The benchmark suite's definition: datasets x networks x distribution models x worker counts.

A suite file is TOML with one ``[suite]`` table (see :class:`SuiteSpec` for the fields), or a
preset name. Defaults follow thesis 002 (ch. 3, Table 3.3): per-dataset batch sizes for the
one-device baseline, ddp/fsdp (per worker, like Horovod) and 1f1b (PipeDream's column), and a
larger batch with its micro-batch count for gpipe. Every cell trains ``warmup_batches`` +
``measured_batches`` batches on synthetic copies of the datasets (as the thesis did) and
extrapolates seconds per epoch to the real dataset's size.

Presets:

- ``local``: MNIST and CIFAR-10 shapes, ResNet-18, VGG-11 and MobileNetV2, every suite model
  (:func:`suite_models`) on 2 workers, small batches — sized to finish within 30 minutes on a
  2-core machine.

A suite's cells are :class:`ddlscope.experiments.runner.Cell` s (key and label
``<model>-<network>-<dataset>-<N>w``), run by the experiment runner.
- ``thesis``: the full thesis suite (4 datasets, 6 networks, 2 and 4 workers, Table 3.3 batch
  sizes, on GPUs) for a real cluster.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ddlscope import distribution
from ddlscope.config import MAX_PEERS, _bad_numbers, _format_validation_error, available_cores, read_toml
from ddlscope.errors import UserError
from ddlscope.experiments import check_known
from ddlscope.experiments.runner import Cell

SUITE_DATASETS = ("mnist", "cifar10", "imagenet", "highres")
MAX_WORKERS = MAX_PEERS
"""Largest worker count of a cell (a run's ``peers``)."""

# thesis 002, Table 3.3: batch size per dataset (PyTorch = Horovod = PipeDream); a model with its own
# column (GPipe) gives it as its descriptor's table_3_3_batch
TABLE_3_3_BATCH_SIZE = {"mnist": 128, "cifar10": 64, "imagenet": 32, "highres": 32}


def suite_models() -> list[str]:
    """The distribution models a suite compares with the baseline: every registered model whose
    workers are one torch.distributed job (``launcher = "torchrun"``: thesis 002's synchronous
    models, and DiLoCo); swarms whose peers join on their own (collaborative, dmoe) are measured by
    sweeps and ``validate``. A newly registered model joins by itself."""
    return [m.name for m in distribution.all_models() if m.multi_worker and m.launcher == "torchrun" and not m.baseline]


class SuiteSpec(BaseModel):
    """One benchmark suite. Every field is checked before any cell runs.

    Attributes:
        name: the suite's name; its runs are stored under this group name.
        datasets / networks / strategies: the grid (the one-device baseline of each
            dataset x network is always included; ``strategies`` default: :func:`suite_models`).
        workers: worker counts for every distribution model (pipelines: number of stages).
        warmup_batches / measured_batches: batches per cell; warm-up batches are excluded from
            the timing.
        batch_size / gpipe_batch_size / microbatches: per-dataset overrides of Table 3.3
            (``gpipe_batch_size``: the batch of models with their own Table 3.3 column, GPipe;
            ``microbatches`` applies to the pipelines, each using at least the micro-batches per
            stage its descriptor asks for: 1F1B one).
        device: ``cpu`` (a device is a set of cores: all cores / the largest worker count) or ``cuda``.
        data_root: where the synthetic copies are written (default: ``<results>/suite-data``).
        synthetic_train_size: images written per synthetic training split.
    """

    model_config = ConfigDict(extra="forbid")

    name: str = "suite"
    datasets: list[str] = Field(default_factory=lambda: list(SUITE_DATASETS), min_length=1)
    networks: list[str] = Field(default_factory=lambda: ["resnet18"], min_length=1)
    strategies: list[str] = Field(default_factory=suite_models)
    workers: list[int] = Field(default_factory=lambda: [2], min_length=1)
    warmup_batches: int = Field(2, ge=0, le=1000)
    measured_batches: int = Field(5, ge=1, le=100_000)
    batch_size: dict[str, int] = Field(default_factory=dict)
    gpipe_batch_size: dict[str, int] = Field(default_factory=dict)
    microbatches: dict[str, int] = Field(default_factory=dict)
    device: Literal["cpu", "cuda"] = "cpu"
    loader_workers: int = Field(0, ge=0, le=64)
    data_root: Path | None = None
    synthetic_train_size: int = Field(256, ge=1)

    @field_validator("datasets")
    @classmethod
    def _known_datasets(cls, v: list[str]) -> list[str]:
        return check_known(v, SUITE_DATASETS, "dataset")

    @field_validator("networks")
    @classmethod
    def _known_networks(cls, v: list[str]) -> list[str]:
        from ddlscope.workloads.models import NETWORKS

        bad = [n for n in v if n not in NETWORKS and ":" not in n]
        if bad:
            raise ValueError(f"unknown network(s) {bad}; allowed: {', '.join(NETWORKS)} or 'package.module:factory'")
        return v

    @field_validator("strategies")
    @classmethod
    def _known_strategies(cls, v: list[str]) -> list[str]:
        return check_known(v, suite_models(), "distribution model",
                           f" (the {distribution.baseline().name} baseline is always included)")

    @field_validator("workers")
    @classmethod
    def _worker_counts(cls, v: list[int]) -> list[int]:
        if any(w < 2 or w > MAX_WORKERS for w in v):
            raise ValueError(f"worker counts {v}; allowed: integers >= 2 (one worker is the one-device baseline) "
                             f"and <= {MAX_WORKERS}")
        return sorted(set(v))

    @field_validator("batch_size", "gpipe_batch_size", "microbatches")
    @classmethod
    def _positive_per_dataset(cls, v: dict[str, int]) -> dict[str, int]:
        bad = {k: n for k, n in v.items() if k not in SUITE_DATASETS or n < 1}
        if bad:
            raise ValueError(f"{bad}: keys must be datasets ({', '.join(SUITE_DATASETS)}) and values >= 1")
        return v


def cell_batch(spec: SuiteSpec, dataset: str, strategy: str, workers: int) -> tuple[int, int | None]:
    """Batch size per worker and micro-batches (None: not a pipeline) of a cell: Table 3.3 unless
    the suite overrides it. Pipelines (models whose workers share one batch) default to
    ``2 x workers`` micro-batches, or their own Table 3.3 column's."""
    model = distribution.get(strategy)
    base = spec.batch_size.get(dataset, TABLE_3_3_BATCH_SIZE[dataset])
    if model.data_parallel:
        return base, None
    batch, microbatches = base, 2 * workers
    if dataset in model.table_3_3_batch:
        own_batch, microbatches = model.table_3_3_batch[dataset]
        batch = spec.gpipe_batch_size.get(dataset, own_batch)
    return batch, max(spec.microbatches.get(dataset, microbatches), model.min_microbatches_per_worker * workers)


def expand(spec: SuiteSpec, data_root: Path | None = None) -> list[Cell]:
    """All cells, the baselines first, then dataset x network x model x workers in order.

    Args:
        data_root: where the cells read their synthetic datasets (None: the run config's default).
    """
    combos = [(ds, net, distribution.baseline().name, 1) for ds in spec.datasets for net in spec.networks]
    combos += [(ds, net, strategy, w) for ds in spec.datasets for net in spec.networks
               for strategy in spec.strategies for w in spec.workers]
    cores_per_device = max(1, len(available_cores()) // max(spec.workers)) if spec.device == "cpu" else None
    cells = []
    for ds, net, strategy, workers in combos:
        batch, microbatches = cell_batch(spec, ds, strategy, workers)
        label = f"{strategy}-{net}-{ds}-{workers}w"
        values = dict(
            name=label, strategy=strategy, model=net, dataset=ds, batch_size=batch, peers=workers,
            vcpus_per_peer=cores_per_device, device=spec.device, loader_workers=spec.loader_workers, augment=False,
            final_eval=False, warmup_steps=spec.warmup_batches,
            sample_budget=(spec.warmup_batches + spec.measured_batches)
            * distribution.get(strategy).global_batch_size(batch, workers))
        if data_root is not None:
            values["data_root"] = str(data_root)
        if microbatches is not None:
            values["distributed"] = dict(microbatches=microbatches)
        cells.append(Cell(key=label, label=label, values=values))
    return cells


PRESETS: dict[str, dict] = {
    "local": dict(
        name="local", datasets=["mnist", "cifar10"], networks=["resnet18", "vgg11", "mobilenet_v2"],
        workers=[2], warmup_batches=2, measured_batches=8,
        batch_size={"mnist": 32, "cifar10": 32}, gpipe_batch_size={"mnist": 32, "cifar10": 32},
        microbatches={"mnist": 4, "cifar10": 4}, device="cpu", synthetic_train_size=128,
    ),
    "thesis": dict(
        name="thesis", datasets=list(SUITE_DATASETS),
        networks=["resnet18", "resnet50", "resnet152", "vgg11", "vgg16", "mobilenet_v2"],
        workers=[2, 4], warmup_batches=5, measured_batches=50,
        device="cuda", loader_workers=4, synthetic_train_size=4096,
    ),
}


def load_suite(path_or_preset: str) -> SuiteSpec:
    """A suite from a TOML file with a ``[suite]`` table, or a preset name (``local``, ``thesis``).

    Raises:
        UserError: no such file or preset, invalid TOML, unknown tables or invalid fields.
    """
    if path_or_preset in PRESETS:
        return SuiteSpec(**PRESETS[path_or_preset])
    path = Path(path_or_preset)
    if not path.exists():
        raise UserError(f"suite file not found: {path}; allowed: a TOML file or a preset ({', '.join(PRESETS)})")
    data = read_toml(path, "suite file")
    if set(data) != {"suite"} or not isinstance(data["suite"], dict):
        got = sorted(data) if set(data) != {"suite"} else f"suite = {data['suite']!r}"
        raise UserError(f"suite file {path}: expected exactly one [suite] table, got {got or 'none'}")
    values = dict(data["suite"])
    if "preset" in values:  # start from a preset and change some fields
        preset = values.pop("preset")
        if preset not in PRESETS:
            raise UserError(f"suite.preset = {preset!r}; allowed: {', '.join(PRESETS)}")
        values = {**PRESETS[preset], **values}
    bad = _bad_numbers(values, SuiteSpec, "suite")
    if bad:
        raise UserError(f"invalid suite {path}: " + "; ".join(bad))
    try:
        return SuiteSpec(**values)
    except ValidationError as err:
        raise UserError(_format_validation_error(err, SuiteSpec).replace("invalid run config",
                                                                         f"invalid suite {path}")) from None
