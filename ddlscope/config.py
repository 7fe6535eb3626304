"""Run configuration: one validated object that says what to train, how, and when to stop.

A run is a workload (model + dataset + preprocessing + loss + optimizer hyperparameters) trained
under one distribution model by one or more workers/peers. Every field is checked here, before
anything starts, so that bad input gives one message naming the field and what is allowed.

Configs come from TOML files (``[run]`` table plus optional ``[distributed]`` and the distribution
models' own tables such as ``[collaborative]``), from CLI flags, or from Python. Field names carry their units (``_s`` seconds, ``_bytes``).
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from ddlscope import distribution
from ddlscope.errors import UserError


def available_cores() -> list[int]:
    """CPU core ids this process may run on (its affinity mask), sorted."""
    return sorted(os.sched_getaffinity(0))


class DistributedConfig(BaseModel):
    """Settings of the distribution models launched with torchrun (``[distributed]``: the registry's
    ``torchrun`` launcher, e.g. ``ddp``, ``fsdp``, ``gpipe``, ``1f1b``).

    ``backend`` "auto" picks gloo on CPU and nccl on GPU. ``rendezvous_port`` 0 lets the local
    launcher pick a free port for torchrun's c10d rendezvous.
    """

    model_config = ConfigDict(extra="forbid")

    backend: Literal["auto", "gloo", "nccl"] = "auto"
    rendezvous_port: int = Field(0, ge=0, le=65535, description="port of torchrun's rendezvous on this host; 0 = any free port")
    timeout_s: float = Field(300.0, gt=0, description="a collective that waits longer than this fails the run")
    bucket_cap_mb: float = Field(25.0, gt=0, description="ddp: gradient bucket size in MiB (one all-reduce per bucket)")
    reshard_after_forward: bool = Field(True, description="fsdp: free gathered parameters after forward (ZeRO-3) or keep them (ZeRO-2)")
    microbatches: int = Field(4, ge=1, le=4096, description="gpipe/1f1b: micro-batches each batch is split into")
    balance: Literal["measured", "layers"] = Field(
        "measured", description="gpipe/1f1b: split stages by measured per-layer time, or by equal layer counts")
    stage_bounds: list[int] | None = Field(
        None, min_length=2, description="gpipe/1f1b: the cut itself, [0, b1, ..., L] (stage s holds top-level layers "
                                        "b[s]:b[s+1]; one more entry than stages); replaces balance, e.g. the cut "
                                        "`ddlscope recommend` predicted")

    @field_validator("stage_bounds")
    @classmethod
    def _increasing_from_zero(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (v[0] != 0 or any(b >= a for b, a in zip(v, v[1:]))):
            raise ValueError(f"{v}: allowed: strictly increasing layer indices starting at 0, e.g. [0, 6, 21]")
        return v


class RunConfigBase(BaseModel):
    """Everything one run needs but the distribution models' own tables (see :data:`RunConfig`).

    Raises:
        pydantic.ValidationError: on bad values (wrapped into :class:`UserError` by
            :func:`validate_config`, which is what the CLI uses).
    """

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, description="human label; defaults to strategy-model-dataset")
    strategy: str = Field("single", description="distribution model: a name in the registry (`ddlscope models`)")
    model: str = Field("resnet18", description="zoo network name or 'package.module:factory'")
    dataset: str = Field("digits", description="dataset name or path to a local copy")
    data_root: Path | None = Field(None, description="folder holding datasets; default $DDLSCOPE_DATA or ~/.cache/ddlscope/data")
    batch_size: int = Field(32, ge=1, description="samples per worker per step")
    learning_rate: float = Field(0.01, gt=0)
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    optimizer: Literal["sgd", "adam", "adamw"] = Field("sgd", description="sgd (with momentum), adam or adamw")
    gradient_accumulation_steps: int = Field(1, ge=1, le=1024, description="micro-steps per optimizer step (GAS)")
    loader_workers: int = Field(1, ge=0, le=64, description="DataLoader worker processes per peer")
    augment: bool = True
    seed: int = 0
    device: Literal["cpu", "cuda"] = "cpu"

    peers: int = Field(1, ge=1, le=256, description="workers/peers trained at once (1 for single; stages for gpipe/1f1b)")
    vcpus_per_peer: int | None = Field(None, ge=1, description="CPU cores pinned to each peer; default all cores / peers")

    sample_budget: int | None = Field(3200, ge=1, description="samples shared by all peers; each peer runs budget/(peers*batch_size) steps")
    target_accuracy: float | None = Field(None, gt=0, le=1, description="stop when held-out accuracy reaches this")
    time_limit_s: float | None = Field(None, gt=0, description="stop training after this many seconds")
    eval_every_steps: int | None = Field(None, ge=1, description="evaluate on the held-out split every N steps (and at the end)")
    eval_max_samples: int | None = Field(None, ge=1, description="evaluate on at most this many held-out samples")
    final_eval: bool = Field(True, description="evaluate once more after the last step (benchmarks that time steps only turn it off)")
    warmup_steps: int = Field(2, ge=0, description="first steps are recorded but flagged and excluded from rates")
    host_sample_interval_s: float = Field(1.0, gt=0, le=60)

    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    # the distribution models' own tables ([collaborative], ...) are added from the registry: see RunConfig

    @field_validator("strategy")
    @classmethod
    def _registered(cls, v: str) -> str:
        if v not in distribution.names():
            raise ValueError(f"unknown distribution model {v!r}; allowed: {', '.join(distribution.names())}")
        return v

    @property
    def distribution_model(self) -> distribution.DistributionModel:
        """The registry's descriptor of :attr:`strategy`."""
        return distribution.get(self.strategy)

    def model_options(self) -> dict[str, Any]:
        """The values of the distribution model's own config table (empty when it has none)."""
        table = self.distribution_model.config_table
        return getattr(self, table).model_dump() if table else {}

    @model_validator(mode="after")
    def _check_cross_fields(self) -> "RunConfigBase":
        model = self.distribution_model
        bad_workers = model.check_workers(self.peers)
        if bad_workers:
            raise ValueError(f"peers = {self.peers}: {bad_workers}")
        if self.sample_budget is None and self.target_accuracy is None and self.time_limit_s is None:
            raise ValueError("no stop condition: set at least one of sample_budget, target_accuracy, time_limit_s")
        per_step = self.data_parallel_size * self.batch_size
        if self.sample_budget is not None and self.sample_budget < per_step:
            raise ValueError(
                f"sample_budget = {self.sample_budget} is smaller than one step of all workers "
                f"({per_step} samples); allowed: >= {per_step}"
            )
        if model.check_config is not None:
            model.check_config(self)
        if self.target_accuracy is not None and self.eval_every_steps is None:
            self.eval_every_steps = 10
        return self

    # ------------------------------------------------------------------ derived values
    @property
    def data_parallel_size(self) -> int:
        """Workers that each train on their own batch: ``peers``, or 1 for pipelines (all stages share a batch)."""
        return self.distribution_model.data_parallel_size(self.peers)

    def data_rank(self, worker_index: int) -> int:
        """Which data stream a worker reads (its shuffle seed offset): its index, or 0 for pipeline stages."""
        return self.distribution_model.data_rank(worker_index)

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step over all workers (the registry's rule for the model)."""
        return self.distribution_model.global_batch_size(
            self.batch_size * self.gradient_accumulation_steps, self.peers, self.model_options())

    @property
    def run_label(self) -> str:
        """The name, or ``strategy-model-dataset[-Npeers]`` when none was given."""
        if self.name:
            return self.name
        suffix = f"-{self.peers}p" if self.peers > 1 else ""
        return f"{self.strategy}-{self.model}-{Path(self.dataset).name}{suffix}"

    def cores_per_peer(self, cores: list[int] | None = None, local_workers: int | None = None) -> int:
        """Cores each peer gets: ``vcpus_per_peer`` or an equal share of the available cores."""
        cores = cores if cores is not None else available_cores()
        return self.vcpus_per_peer or max(1, len(cores) // (local_workers or self.peers))

    def core_sets(self, cores: list[int] | None = None, local_workers: int | None = None) -> list[list[int]]:
        """Disjoint core ids for each worker on this host, in order.

        Args:
            local_workers: workers started on this host (default ``peers``; fewer on a cluster node).

        Raises:
            UserError: workers x vcpus_per_peer exceeds the cores this process may use.
        """
        cores = cores if cores is not None else available_cores()
        n = local_workers or self.peers
        per_peer = self.cores_per_peer(cores, n)
        if per_peer * n > len(cores):
            raise UserError(
                f"vcpus_per_peer = {per_peer} x {n} workers on this host needs {per_peer * n} cores, "
                f"but this machine gives ddlscope {len(cores)} ({cores}); allowed: workers x vcpus_per_peer <= {len(cores)}"
            )
        return [cores[i * per_peer:(i + 1) * per_peer] for i in range(n)]

    def max_steps_per_peer(self) -> int | None:
        """Steps (micro-batches) each peer runs under the sample budget: budget / (peers x batch_size).

        For pipelines all stages process the same batch, so it is budget / batch_size.
        """
        if self.sample_budget is None:
            return None
        return self.sample_budget // (self.data_parallel_size * self.batch_size)


def _build_run_config() -> type[RunConfigBase]:
    tables = {name: (cls, Field(default_factory=cls)) for name, cls in distribution.config_tables().items()}
    return create_model("RunConfig", __base__=RunConfigBase, __module__=__name__,
                        __doc__="""Everything one run needs. Validated on construction; see :func:`load_config`.

    The fields of :class:`RunConfigBase` plus one table per distribution model that has one
    (``collaborative``, ``diloco``, ...: :func:`ddlscope.distribution.config_tables`).

    Raises:
        pydantic.ValidationError: on bad values (wrapped into :class:`UserError` by
            :func:`validate_config`, which is what the CLI uses).
    """, **tables)


RunConfig = _build_run_config()
CONFIG_TABLES: tuple[str, ...] = ("run", "distributed", *distribution.config_tables())
"""The tables a run-config file may have."""


def _format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "config"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        got = e.get("input")
        got_text = "" if e["type"] in ("extra_forbidden",) or isinstance(got, dict) else f" (got {got!r})"
        lines.append(f"{field}: {msg}{got_text}")
    return "invalid run config: " + "; ".join(lines)


def validate_config(values: dict[str, Any], nnodes: int = 1) -> RunConfig:
    """Build a :class:`RunConfig` and check the names and resources it refers to.

    Checks, besides the field ranges: the model is a zoo network or ``module:factory``; the
    dataset is a known name or an existing path; the workers started on this host
    (``peers / nnodes``) x vCPUs fit the available cores.

    Raises:
        UserError: with one message naming each bad field and what is allowed.
    """
    try:
        cfg = RunConfig(**values)
    except ValidationError as err:
        raise UserError(_format_validation_error(err)) from None
    from ddlscope.workloads.datasets import DATASETS
    from ddlscope.workloads.models import NETWORKS

    if ":" not in cfg.model and cfg.model not in NETWORKS:
        raise UserError(f"model: unknown network {cfg.model!r}; allowed: {', '.join(NETWORKS)} or 'package.module:factory'")
    if cfg.dataset not in DATASETS and not Path(cfg.dataset).exists():
        raise UserError(
            f"dataset: unknown dataset {cfg.dataset!r} and no such path; allowed: {', '.join(DATASETS)} or a folder with a local copy"
        )
    if cfg.dataset in DATASETS:
        from ddlscope.workloads.models import network_takes

        why = network_takes(cfg.model, DATASETS[cfg.dataset].family)
        if why:
            raise UserError(f"{why} (dataset = {cfg.dataset!r})")
    if nnodes > 1 and cfg.peers % nnodes:
        raise UserError(f"peers = {cfg.peers} cannot be spread evenly over {nnodes} nodes; allowed: a multiple of {nnodes}")
    cfg.core_sets(local_workers=cfg.peers // nnodes)
    return cfg


def read_toml(path: Path, what: str) -> dict[str, Any]:
    """Parse a TOML file; ``what`` names it in errors (e.g. "config file", "grid file").

    Raises:
        UserError: the file is missing or not valid TOML (the message has the path).
    """
    try:
        return tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"{what} not found: {path}") from None
    except tomllib.TOMLDecodeError as err:
        raise UserError(f"{what} {path} is not valid TOML: {err}") from None


def load_config(path: Path, overrides: dict[str, Any] | None = None, nnodes: int = 1) -> RunConfig:
    """Read a TOML run config (``[run]``, optional ``[distributed]`` and model tables) and validate it.

    Raises:
        UserError: missing file, TOML syntax error, or invalid values.
    """
    data = read_toml(path, "config file")
    values = dict(data.get("run", {}))
    unknown = set(data) - set(CONFIG_TABLES)
    if unknown:
        raise UserError(f"config file {path}: unknown table(s) {sorted(unknown)}; allowed: "
                        f"{', '.join(f'[{t}]' for t in CONFIG_TABLES)}")
    for table in CONFIG_TABLES[1:]:
        if table in data:
            values[table] = data[table]
    values.update(overrides or {})
    return validate_config(values, nnodes)
