"""Run configuration: one validated object that says what to train, how, and when to stop.

A run is a workload (model + dataset + preprocessing + loss + optimizer hyperparameters) trained
under one distribution model by one or more workers/peers. Every field is checked here, before
anything starts, so that bad input gives one message naming the field and what is allowed.

Configs come from TOML files (``[run]`` table plus optional ``[collaborative]`` and ``[distributed]``
tables), from CLI flags, or from Python. Field names carry their units (``_s`` seconds, ``_bytes``).
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ddlscope.errors import UserError

STRATEGIES = ("single", "ddp", "fsdp", "gpipe", "1f1b", "collaborative")
TORCH_STRATEGIES = ("ddp", "fsdp", "gpipe", "1f1b")  # launched with torchrun, torch.distributed process group
PIPELINE_STRATEGIES = ("gpipe", "1f1b")  # every stage sees the same batch: no data parallelism
COMPRESSIONS = ("none", "float16", "scaled-float16", "uniform8bit")


def available_cores() -> list[int]:
    """CPU core ids this process may run on (its affinity mask), sorted."""
    return sorted(os.sched_getaffinity(0))


class CollaborativeConfig(BaseModel):
    """Settings of ``hivemind.Optimizer`` for the ``collaborative`` distribution model.

    Defaults follow thesis 000 (matchmaking_time 10 s, averaging_timeout 300 s, no gradient
    compression) except where a field says otherwise.
    """

    model_config = ConfigDict(extra="forbid")

    target_batch_size: int = Field(256, ge=1, description="samples all peers accumulate per global epoch (TBS)")
    use_local_updates: bool = Field(False, description="step the local optimizer every batch and average parameters (LU)")
    matchmaking_time_s: float = Field(10.0, gt=0, description="seconds peers wait to form an averaging group")
    averaging_timeout_s: float = Field(300.0, gt=0, description="give up an averaging round after this many seconds")
    gradient_compression: Literal["none", "float16", "scaled-float16", "uniform8bit"] = "none"
    average_state_every: int = Field(1, ge=1, description="average parameters and optimizer state every N global epochs")
    listen_host: str = Field("127.0.0.1", description="address peers listen on; loopback unless you ask")
    join_timeout_s: float = Field(60.0, gt=0, description="a peer that cannot join the swarm in this time fails")
    initial_peers: list[str] = Field(default_factory=list, description="multiaddrs of a running swarm or bootstrap peer to join")


class DistributedConfig(BaseModel):
    """Settings of the torch.distributed distribution models (``ddp``, ``fsdp``, ``gpipe``, ``1f1b``).

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


class RunConfig(BaseModel):
    """Everything one run needs. Validated on construction; see :func:`load_config`.

    Raises:
        pydantic.ValidationError: on bad values (wrapped into :class:`UserError` by
            :func:`validate_config`, which is what the CLI uses).
    """

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, description="human label; defaults to strategy-model-dataset")
    strategy: Literal["single", "ddp", "fsdp", "gpipe", "1f1b", "collaborative"] = "single"
    model: str = Field("resnet18", description="zoo network name or 'package.module:factory'")
    dataset: str = Field("digits", description="dataset name or path to a local copy")
    data_root: Path | None = Field(None, description="folder holding datasets; default $DDLSCOPE_DATA or ~/.cache/ddlscope/data")
    batch_size: int = Field(32, ge=1, description="samples per worker per step")
    learning_rate: float = Field(0.01, gt=0)
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    optimizer: Literal["sgd", "adam"] = "sgd"
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

    collaborative: CollaborativeConfig = Field(default_factory=CollaborativeConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)

    @model_validator(mode="after")
    def _check_cross_fields(self) -> "RunConfig":
        if self.strategy == "single" and self.peers != 1:
            raise ValueError(f"peers = {self.peers} but strategy 'single' trains on exactly 1 worker; use peers = 1")
        if self.sample_budget is None and self.target_accuracy is None and self.time_limit_s is None:
            raise ValueError("no stop condition: set at least one of sample_budget, target_accuracy, time_limit_s")
        per_step = self.data_parallel_size * self.batch_size
        if self.sample_budget is not None and self.sample_budget < per_step:
            raise ValueError(
                f"sample_budget = {self.sample_budget} is smaller than one step of all workers "
                f"({per_step} samples); allowed: >= {per_step}"
            )
        if self.strategy in PIPELINE_STRATEGIES:
            self._check_pipeline()
        if self.target_accuracy is not None and self.eval_every_steps is None:
            self.eval_every_steps = 10
        if self.strategy == "collaborative":
            per_step = self.batch_size * self.gradient_accumulation_steps
            if self.collaborative.target_batch_size < per_step:
                raise ValueError(
                    f"collaborative.target_batch_size = {self.collaborative.target_batch_size} is below one optimizer "
                    f"step of a peer (batch_size x gradient_accumulation_steps = {per_step}); allowed: >= {per_step}"
                )
        return self

    def _check_pipeline(self) -> None:
        mb = self.distributed.microbatches
        if self.peers < 2:
            raise ValueError(f"peers = {self.peers} but {self.strategy} splits the model into one stage per worker; allowed: peers >= 2")
        if self.batch_size % mb:
            divisors = [d for d in range(1, self.batch_size + 1) if self.batch_size % d == 0]
            raise ValueError(f"distributed.microbatches = {mb} does not divide batch_size = {self.batch_size}; "
                             f"allowed: a divisor of the batch size ({', '.join(map(str, divisors[:12]))}"
                             f"{', ...' if len(divisors) > 12 else ''})")
        if self.strategy == "1f1b" and mb < self.peers:
            raise ValueError(f"distributed.microbatches = {mb} is fewer than the {self.peers} stages; 1f1b keeps "
                             f"every stage busy only with at least one micro-batch per stage; allowed: microbatches >= peers")

    # ------------------------------------------------------------------ derived values
    @property
    def data_parallel_size(self) -> int:
        """Workers that each train on their own batch: ``peers``, or 1 for pipelines (all stages share a batch)."""
        return 1 if self.strategy in PIPELINE_STRATEGIES else self.peers

    def data_rank(self, worker_index: int) -> int:
        """Which data stream a worker reads (its shuffle seed offset): its index, or 0 for pipeline stages."""
        return 0 if self.strategy in PIPELINE_STRATEGIES else worker_index

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
    """Read a TOML run config (``[run]``, optional ``[collaborative]`` and ``[distributed]`` tables) and validate it.

    Raises:
        UserError: missing file, TOML syntax error, or invalid values.
    """
    data = read_toml(path, "config file")
    values = dict(data.get("run", {}))
    unknown = set(data) - {"run", "collaborative", "distributed"}
    if unknown:
        raise UserError(f"config file {path}: unknown table(s) {sorted(unknown)}; allowed: [run], [collaborative], [distributed]")
    for table in ("collaborative", "distributed"):
        if table in data:
            values[table] = data[table]
    values.update(overrides or {})
    return validate_config(values, nnodes)
