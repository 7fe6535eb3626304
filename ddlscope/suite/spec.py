"""The benchmark suite's definition: datasets x networks x distribution models x worker counts.

A suite file is TOML with one ``[suite]`` table (see :class:`SuiteSpec` for the fields), or a
preset name. Defaults follow thesis 002 (ch. 3, Table 3.3): per-dataset batch sizes for the
one-device baseline, ddp/fsdp (per worker, like Horovod) and 1f1b (PipeDream's column), and a
larger batch with its micro-batch count for gpipe. Every cell trains ``warmup_batches`` +
``measured_batches`` batches on synthetic copies of the datasets (as the thesis did) and
extrapolates seconds per epoch to the real dataset's size.

Presets:

- ``local``: MNIST and CIFAR-10 shapes, ResNet-18, VGG-11 and MobileNetV2, every distribution
  model on 2 workers, small batches — sized to finish within 30 minutes on a 2-core machine.
- ``thesis``: the full thesis suite (4 datasets, 6 networks, 2 and 4 workers, Table 3.3 batch
  sizes, on GPUs) for a real cluster.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ddlscope import distribution
from ddlscope.config import RunConfig, _format_validation_error, available_cores
from ddlscope.errors import UserError

SUITE_DATASETS = ("mnist", "cifar10", "imagenet", "highres")
SUITE_STRATEGIES = ("ddp", "fsdp", "gpipe", "1f1b")

# thesis 002, Table 3.3: batch size per dataset (PyTorch = Horovod = PipeDream), and GPipe's batch (micro-batches)
TABLE_3_3_BATCH_SIZE = {"mnist": 128, "cifar10": 64, "imagenet": 32, "highres": 32}
TABLE_3_3_GPIPE = {"mnist": (3072, 24), "cifar10": (2048, 32), "imagenet": (384, 12), "highres": (48, 12)}


class SuiteSpec(BaseModel):
    """One benchmark suite. Every field is checked before any cell runs.

    Attributes:
        name: the suite's name; its runs are stored under this group name.
        datasets / networks / strategies: the grid (the one-device ``single`` baseline of each
            dataset x network is always included).
        workers: worker counts for every distribution model (pipelines: number of stages).
        warmup_batches / measured_batches: batches per cell; warm-up batches are excluded from
            the timing.
        batch_size / gpipe_batch_size / microbatches: per-dataset overrides of Table 3.3
            (``microbatches`` applies to gpipe and 1f1b; 1f1b uses at least one per stage).
        device: ``cpu`` (a device is a set of cores: all cores / the largest worker count) or ``cuda``.
        data_root: where the synthetic copies are written (default: ``<results>/suite-data``).
        synthetic_train_size: images written per synthetic training split.
    """

    model_config = ConfigDict(extra="forbid")

    name: str = "suite"
    datasets: list[str] = Field(default_factory=lambda: list(SUITE_DATASETS), min_length=1)
    networks: list[str] = Field(default_factory=lambda: ["resnet18"], min_length=1)
    strategies: list[str] = Field(default_factory=lambda: list(SUITE_STRATEGIES))
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
        bad = [d for d in v if d not in SUITE_DATASETS]
        if bad:
            raise ValueError(f"unknown dataset(s) {bad}; allowed: {', '.join(SUITE_DATASETS)}")
        return v

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
        bad = [s for s in v if s not in SUITE_STRATEGIES]
        if bad:
            raise ValueError(f"unknown distribution model(s) {bad}; allowed: {', '.join(SUITE_STRATEGIES)} "
                             f"(the single baseline is always included)")
        return v

    @field_validator("workers")
    @classmethod
    def _worker_counts(cls, v: list[int]) -> list[int]:
        if any(w < 2 for w in v):
            raise ValueError(f"worker counts {v}; allowed: integers >= 2 (one worker is the single baseline)")
        return sorted(set(v))

    @field_validator("batch_size", "gpipe_batch_size", "microbatches")
    @classmethod
    def _positive_per_dataset(cls, v: dict[str, int]) -> dict[str, int]:
        bad = {k: n for k, n in v.items() if k not in SUITE_DATASETS or n < 1}
        if bad:
            raise ValueError(f"{bad}: keys must be datasets ({', '.join(SUITE_DATASETS)}) and values >= 1")
        return v


@dataclass(frozen=True)
class Cell:
    """One suite cell: a network trained on a dataset under a distribution model by ``workers`` workers."""

    dataset: str
    network: str
    strategy: str
    workers: int
    batch_size: int
    microbatches: int | None

    @property
    def label(self) -> str:
        return f"{self.strategy}-{self.network}-{self.dataset}-{self.workers}w"

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step over all workers (pipelines: the batch, shared by the stages)."""
        return distribution.get(self.strategy).global_batch_size(self.batch_size, self.workers)


def cell_batch(spec: SuiteSpec, dataset: str, strategy: str, workers: int) -> tuple[int, int | None]:
    """Batch size per worker and micro-batches of a cell (Table 3.3 unless the suite overrides it)."""
    base = spec.batch_size.get(dataset, TABLE_3_3_BATCH_SIZE[dataset])
    if strategy == "gpipe":
        gpipe_bs, gpipe_mb = TABLE_3_3_GPIPE[dataset]
        return spec.gpipe_batch_size.get(dataset, gpipe_bs), spec.microbatches.get(dataset, gpipe_mb)
    if strategy == "1f1b":
        mb = max(spec.microbatches.get(dataset, 2 * workers), workers)
        return base, mb
    return base, None


def expand(spec: SuiteSpec) -> list[Cell]:
    """All cells, the single baselines first, then dataset x network x strategy x workers in order."""
    cells = []
    for ds in spec.datasets:
        for net in spec.networks:
            cells.append(Cell(ds, net, "single", 1, cell_batch(spec, ds, "single", 1)[0], None))
    for ds in spec.datasets:
        for net in spec.networks:
            for strategy in spec.strategies:
                for w in spec.workers:
                    bs, mb = cell_batch(spec, ds, strategy, w)
                    cells.append(Cell(ds, net, strategy, w, bs, mb))
    return cells


def cell_config(spec: SuiteSpec, cell: Cell, data_root: Path) -> RunConfig:
    """The run config of a cell.

    Raises:
        UserError: the cell's settings are invalid (e.g. micro-batches that do not divide the batch);
            the suite stores that cell as failed with this message.
    """
    cores_per_device = max(1, len(available_cores()) // max(spec.workers)) if spec.device == "cpu" else None
    values = dict(
        name=cell.label, strategy=cell.strategy, model=cell.network, dataset=cell.dataset, data_root=str(data_root),
        batch_size=cell.batch_size, peers=cell.workers, vcpus_per_peer=cores_per_device, device=spec.device,
        loader_workers=spec.loader_workers, augment=False, final_eval=False,
        warmup_steps=spec.warmup_batches,
        sample_budget=(spec.warmup_batches + spec.measured_batches) * cell.global_batch_size,
    )
    if cell.microbatches is not None:
        values["distributed"] = dict(microbatches=cell.microbatches)
    try:
        return RunConfig(**values)
    except ValidationError as err:
        raise UserError(_format_validation_error(err)) from None


PRESETS: dict[str, dict] = {
    "local": dict(
        name="local", datasets=["mnist", "cifar10"], networks=["resnet18", "vgg11", "mobilenet_v2"],
        strategies=list(SUITE_STRATEGIES), workers=[2], warmup_batches=2, measured_batches=8,
        batch_size={"mnist": 32, "cifar10": 32}, gpipe_batch_size={"mnist": 32, "cifar10": 32},
        microbatches={"mnist": 4, "cifar10": 4}, device="cpu", synthetic_train_size=128,
    ),
    "thesis": dict(
        name="thesis", datasets=list(SUITE_DATASETS),
        networks=["resnet18", "resnet50", "resnet152", "vgg11", "vgg16", "mobilenet_v2"],
        strategies=list(SUITE_STRATEGIES), workers=[2, 4], warmup_batches=5, measured_batches=50,
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
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"suite file not found: {path}; allowed: a TOML file or a preset ({', '.join(PRESETS)})") from None
    except tomllib.TOMLDecodeError as err:
        raise UserError(f"suite file {path} is not valid TOML: {err}") from None
    if set(data) != {"suite"}:
        raise UserError(f"suite file {path}: expected exactly one [suite] table, got {sorted(data) or 'none'}")
    values = dict(data["suite"])
    if "preset" in values:  # start from a preset and change some fields
        preset = values.pop("preset")
        if preset not in PRESETS:
            raise UserError(f"suite.preset = {preset!r}; allowed: {', '.join(PRESETS)}")
        values = {**PRESETS[preset], **values}
    try:
        return SuiteSpec(**values)
    except ValidationError as err:
        raise UserError(_format_validation_error(err).replace("invalid run config", f"invalid suite {path}")) from None
