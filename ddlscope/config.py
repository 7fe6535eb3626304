"""Run configuration: one validated object that says what to train, how, and when to stop.

A run is a workload (model + dataset + preprocessing + loss + optimizer hyperparameters) trained
under one distribution model by one or more workers/peers. Every field is checked here, before
anything starts, so that bad input gives one message naming the field and what is allowed.

Configs come from TOML files (``[run]`` table plus optional ``[distributed]`` and the distribution
models' own tables such as ``[collaborative]``), from CLI flags, or from Python. Field names carry their units (``_s`` seconds, ``_bytes``).
"""

from __future__ import annotations

import math
import os
import sys
import tomllib
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from ddlscope import distribution
from ddlscope.errors import UserError
from ddlscope.measure.torch_profile import check_profile_steps
from ddlscope.network.emulated import NetworkConfig, emulated_models, run_rates


MAX_BATCH_SIZE = 1 << 20
"""Largest ``batch_size`` (samples per worker per step) a config may ask for."""
MAX_SAMPLE_BUDGET = 10**12
"""Largest ``sample_budget``: a million times ImageNet's training split."""
MAX_TIME_LIMIT_S = 366 * 24 * 3600.0
"""Largest ``time_limit_s``: a year."""
MAX_PEERS = 256
"""Most workers/peers one run may train."""
MAX_SEED = 2**32 - 1
"""Largest ``seed`` (NumPy's and most libraries' 32-bit seed range)."""
_FACTORY_FIELDS = ("model", "dataset", "loss", "optimizer")
"""Fields that may name a user factory (``module:attribute``) or be given as a callable in Python."""


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
    dataset: str = Field("digits", description="dataset name, path to a local copy, or 'package.module:factory'")
    data_root: Path | None = Field(None, description="folder holding datasets; default $DDLSCOPE_DATA or ~/.cache/ddlscope/data")
    batch_size: int = Field(32, ge=1, le=MAX_BATCH_SIZE, description="samples per worker per step")
    learning_rate: float = Field(0.01, gt=0, le=10)
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0, le=1)
    optimizer: str = Field("sgd", description="sgd (with momentum), adam, adamw, or 'package.module:factory' "
                                              "called as factory(params, lr=learning_rate)")
    loss: str = Field("cross_entropy", description="cross_entropy, or 'package.module:attribute': a function "
                                                   "loss(logits, labels) or a class instantiated without arguments")
    gradient_accumulation_steps: int = Field(1, ge=1, le=1024, description="micro-steps per optimizer step (GAS)")
    loader_workers: int = Field(1, ge=0, le=64, description="DataLoader worker processes per peer")
    augment: bool = True
    seed: int = Field(0, ge=0, le=MAX_SEED, description="model init and data shuffling (worker i shuffles with seed + i)")
    device: Literal["cpu", "cuda"] = "cpu"

    peers: int = Field(1, ge=1, le=MAX_PEERS, description="workers/peers trained at once (1 for single; stages for gpipe/1f1b)")
    vcpus_per_peer: int | None = Field(None, ge=1, description="CPU cores pinned to each peer; default all cores / peers")
    peer_vcpus: list[int] | None = Field(None, description="cores of each peer in order, for peers of different "
                                         "speeds (e.g. [2, 1, 1]: one fast, two slow); instead of vcpus_per_peer")
    share_cores: bool = Field(False, description="more peers than cores: peers share cores round-robin (their compute "
                                                 "contends, e.g. a many-peer swarm of tiny models); else refused")

    sample_budget: int | None = Field(3200, ge=1, le=MAX_SAMPLE_BUDGET,
                                      description="samples shared by all peers; each peer runs budget/(peers*batch_size) steps")
    target_accuracy: float | None = Field(None, gt=0, le=1, description="stop when held-out accuracy reaches this")
    time_limit_s: float | None = Field(None, gt=0, le=MAX_TIME_LIMIT_S, description="stop training after this many seconds")
    eval_every_steps: int | None = Field(None, ge=1, description="evaluate on the held-out split every N steps (and at the end)")
    eval_max_samples: int | None = Field(None, ge=1, description="evaluate on at most this many held-out samples")
    final_eval: bool = Field(True, description="evaluate once more after the last step (benchmarks that time steps only turn it off)")
    warmup_steps: int = Field(2, ge=0, description="first steps are recorded but flagged and excluded from rates")
    host_sample_interval_s: float = Field(1.0, gt=0, le=60)
    store_flush_interval_s: float = Field(
        1.0, gt=0, le=3600, description="seconds between commits of the training loop's step rows (a thread writes "
                                        "them); a worker killed with SIGKILL loses at most this much of its steps")
    profile_steps: list[int] | None = Field(
        None, description="[a, b]: record torch.profiler traces of each worker's steps a..b (0-based, both "
                          "included); `ddlscope export --to trace` merges them")

    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    network: NetworkConfig = Field(default_factory=NetworkConfig,
                                   description="loopback, or each peer in a namespace with rate-limited links")
    # the distribution models' own tables ([collaborative], ...) are added from the registry: see RunConfig

    @field_validator("profile_steps")
    @classmethod
    def _step_range(cls, v: list[int] | None) -> list[int] | None:
        check_profile_steps(v)  # ValueError: not two ints with 0 <= a <= b
        return v

    @field_validator("strategy")
    @classmethod
    def _registered(cls, v: str) -> str:
        if v not in distribution.names():
            raise ValueError(f"unknown distribution model {v!r}; allowed: {', '.join(distribution.names())}")
        return v

    @field_validator("optimizer")
    @classmethod
    def _known_optimizer(cls, v: str) -> str:
        from ddlscope.workloads.step import OPTIMIZERS

        if v not in OPTIMIZERS and not _is_factory(v):
            raise ValueError(f"unknown optimizer {v!r}; allowed: {', '.join(OPTIMIZERS)} or 'package.module:factory'")
        return v

    @field_validator("loss")
    @classmethod
    def _known_loss(cls, v: str) -> str:
        if v != "cross_entropy" and not _is_factory(v):
            raise ValueError(f"unknown loss {v!r}; allowed: cross_entropy or 'package.module:attribute'")
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
        if self.peer_vcpus is not None:
            if len(self.peer_vcpus) != self.peers or min(self.peer_vcpus) < 1:
                raise ValueError(f"peer_vcpus = {self.peer_vcpus}: allowed: one core count >= 1 per peer "
                                 f"({self.peers} of them)")
            if self.vcpus_per_peer is not None:
                raise ValueError("peer_vcpus and vcpus_per_peer both given; allowed: one of them")
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
        if model.launcher == "torchrun" and self.distributed.backend == "nccl" and self.device != "cuda":
            raise ValueError(f'distributed.backend = "nccl" with device = "{self.device}": nccl runs collectives on '
                             f'CUDA tensors only; allowed: device = "cuda", or backend "gloo" or "auto"')
        if self.network.emulate:
            emulated = emulated_models()
            if self.strategy not in emulated:
                raise ValueError(f"network.emulate: not built yet for {self.strategy}; allowed: {', '.join(emulated)}")
            run_rates(self)  # a link of a peer or expert server that does not exist
        if self.profile_steps is not None:
            check_profile_steps(self.profile_steps, self.max_steps_per_peer())  # b beyond the steps trained
        if self.target_accuracy is not None and self.eval_every_steps is None:
            self.eval_every_steps = 10
        if self.loss != "cross_entropy" and not model.data_parallel:
            fitting = ", ".join(m.name for m in distribution.all_models() if m.data_parallel)
            raise ValueError(f"loss = {self.loss!r}: {self.strategy} computes its stages' cross-entropy itself; allowed "
                             f"with a user loss: a data-parallel model ({fitting})")
        return self

    # ------------------------------------------------------------------ derived values
    @property
    def data_parallel_size(self) -> int:
        """Workers that each train on their own batch: ``peers``, or 1 for pipelines (all stages share a batch),
        less the model's auxiliary peers (they train on no batch: collaborative's ``auxiliary_peers``)."""
        return self.distribution_model.data_parallel_size(self.peers) - len(self.model_options().get("auxiliary_peers", ()))

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
        """Cores each peer gets: ``vcpus_per_peer`` or an equal share of the available cores (with
        ``peer_vcpus``: the fewest any peer gets, the slowest peer's)."""
        if self.peer_vcpus is not None:
            return min(self.peer_vcpus)
        cores = cores if cores is not None else available_cores()
        return self.vcpus_per_peer or max(1, len(cores) // (local_workers or self.peers))

    def core_sets(self, cores: list[int] | None = None, local_workers: int | None = None) -> list[list[int]]:
        """Disjoint core ids for each worker on this host, in order.

        Args:
            local_workers: workers started on this host (default ``peers``; fewer on a cluster node).

        With ``share_cores`` and more workers x vcpus_per_peer than cores, the sets overlap: worker
        ``i`` takes the next ``vcpus_per_peer`` cores round-robin.

        Raises:
            UserError: workers x vcpus_per_peer exceeds the cores this process may use (without
                ``share_cores``), or a worker would get more cores than there are.
        """
        cores = cores if cores is not None else available_cores()
        n = local_workers or self.peers
        if self.peer_vcpus is not None:
            return self._uneven_core_sets(cores, self.peer_vcpus[:n])
        per_peer = self.cores_per_peer(cores, n)
        if per_peer * n > len(cores):
            if not self.share_cores or per_peer > len(cores):
                raise UserError(
                    f"vcpus_per_peer = {per_peer} x {n} workers on this host needs {per_peer * n} cores, but this "
                    f"machine gives ddlscope {len(cores)} ({cores}); allowed: workers x vcpus_per_peer <= {len(cores)}, "
                    f"or share_cores = true to let peers share cores (vcpus_per_peer <= {len(cores)})")
            return [sorted({cores[(i * per_peer + k) % len(cores)] for k in range(per_peer)}) for i in range(n)]
        return [cores[i * per_peer:(i + 1) * per_peer] for i in range(n)]

    def _uneven_core_sets(self, cores: list[int], sizes: list[int]) -> list[list[int]]:
        """Consecutive core sets of the given sizes (``peer_vcpus``); round-robin with ``share_cores``.

        Raises:
            UserError: they need more cores than there are (without ``share_cores``), or one peer
                more cores than there are.
        """
        if max(sizes) > len(cores) or (sum(sizes) > len(cores) and not self.share_cores):
            raise UserError(f"peer_vcpus = {sizes} needs {sum(sizes)} cores, but this machine gives ddlscope "
                            f"{len(cores)} ({cores}); allowed: a sum <= {len(cores)}, or share_cores = true "
                            f"(each at most {len(cores)})")
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [sorted({cores[(s + k) % len(cores)] for k in range(size)}) for s, size in zip(starts, sizes)]

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
CONFIG_TABLES: tuple[str, ...] = ("run", "distributed", "network", *distribution.config_tables())
"""The tables a run-config file may have."""


def _table_model(root: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model of the table that holds the field at ``loc`` (None: not a table of ``root``)."""
    cls = root
    for part in loc:
        field = cls.model_fields.get(part) if isinstance(part, str) else None
        annotation = field.annotation if field is not None else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        cls = annotation
    return cls


def _format_validation_error(err: ValidationError, root: type[BaseModel] | None = None) -> str:
    """One line naming every bad field and what is allowed; an unknown field's message lists the
    fields its table allows (``root``: the model validated, default :data:`RunConfig`)."""
    root = root or RunConfig
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "config"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            table = _table_model(root, tuple(e["loc"])[:-1])
            msg = "unknown field" + (f"; allowed: {', '.join(table.model_fields)}" if table is not None else "")
        got = e.get("input")
        got_text = "" if e["type"] in ("extra_forbidden",) or isinstance(got, dict) else f" (got {got!r})"
        lines.append(f"{field}: {msg}{got_text}")
    return "invalid run config: " + "; ".join(lines)


def _is_factory(value: str) -> bool:
    from ddlscope.workloads.factories import is_import_string

    return is_import_string(value)


def validate_config(values: dict[str, Any], nnodes: int = 1) -> RunConfig:
    """Build a :class:`RunConfig` and check the names and resources it refers to.

    Checks, besides the field ranges: every number is finite (no ``inf``/``nan``) and no boolean
    stands for a number; ``listen_host`` fields are IPv4 addresses and ``initial_peers`` entries
    look like multiaddrs; the model is a zoo network or ``module:factory``; the
    dataset is a known name, an existing path or ``module:factory``; no factory names ``__main__``;
    the workers started on this host (``peers / nnodes``) x vCPUs fit the available cores.

    ``model``, ``dataset``, ``loss`` and ``optimizer`` may also be Python callables (functions or
    classes) that a worker process can import by name; they are stored as their import strings
    (:func:`ddlscope.workloads.factories.import_string_of`). Nothing is imported or built here for
    strings; :func:`check_runnable` builds and tries them.

    Raises:
        UserError: with one message naming each bad field and what is allowed; for a callable that a
            worker cannot import (defined in ``__main__``, a lambda or closure, a model instance), naming
            it and saying what is allowed.
    """
    if isinstance(values, dict) and any(not isinstance(values.get(f), (str, type(None))) for f in _FACTORY_FIELDS):
        from ddlscope.workloads.factories import import_string_of

        values = dict(values)
        for f in _FACTORY_FIELDS:
            if f in values and not isinstance(values[f], str) and values[f] is not None:
                values[f] = import_string_of(f, values[f])
    bad = _bad_numbers(values, RunConfig)
    if bad:
        raise UserError("invalid run config: " + "; ".join(bad))
    try:
        cfg = RunConfig(**values)
    except ValidationError as err:
        raise UserError(_format_validation_error(err)) from None
    _check_addresses(cfg)
    from ddlscope.workloads.datasets import DATASETS
    from ddlscope.workloads.factories import check_import_string, is_import_string
    from ddlscope.workloads.models import NETWORKS

    if ":" not in cfg.model and cfg.model not in NETWORKS:
        raise UserError(f"model: unknown network {cfg.model!r}; allowed: {', '.join(NETWORKS)} or 'package.module:factory'")
    user_dataset = cfg.dataset not in DATASETS and not Path(cfg.dataset).exists() and is_import_string(cfg.dataset)
    if cfg.dataset not in DATASETS and not Path(cfg.dataset).exists() and not user_dataset:
        raise UserError(
            f"dataset: unknown dataset {cfg.dataset!r} and no such path; allowed: {', '.join(DATASETS)}, a folder with a "
            f"local copy, or a factory 'package.module:factory'"
        )
    for f in _FACTORY_FIELDS:
        value = getattr(cfg, f)
        if ":" in value and (f != "dataset" or user_dataset):
            check_import_string(f, value)
    if cfg.dataset in DATASETS:
        from ddlscope.workloads.models import network_takes

        why = network_takes(cfg.model, DATASETS[cfg.dataset].family)
        if why:
            raise UserError(f"{why} (dataset = {cfg.dataset!r})")
    if nnodes > 1 and cfg.peers % nnodes:
        raise UserError(f"peers = {cfg.peers} cannot be spread evenly over {nnodes} nodes; allowed: a multiple of {nnodes}")
    cfg.core_sets(local_workers=cfg.peers // nnodes)
    return cfg


def _bad_numbers(values: Any, model: type[BaseModel] | None, path: str = "") -> list[str]:
    """Problems of the numbers in ``values`` (nested tables and lists included), one text each:
    ``inf`` or ``nan`` anywhere, and a boolean given for a numeric field of ``model``."""
    out: list[str] = []
    if isinstance(values, float) and not math.isfinite(values):
        return [f"{path or 'config'}: {values!r} is not a finite number; allowed: a finite number"]
    if isinstance(values, list):
        for i, v in enumerate(values):
            out += _bad_numbers(v, None, f"{path}[{i}]")
        return out
    if not isinstance(values, dict):
        return out
    for key, value in values.items():
        name = f"{path}.{key}" if path else str(key)
        field = model.model_fields.get(key) if model is not None and isinstance(key, str) else None
        annotation = field.annotation if field is not None else None
        if isinstance(value, bool) and _numeric(annotation):
            out.append(f"{name}: expected a number, got {str(value).lower()}")
            continue
        sub = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
        out += _bad_numbers(value, sub, name)
    return out


def _numeric(annotation: Any) -> bool:
    """True for ``int``, ``float`` and their optional forms (``int | None``)."""
    if annotation in (int, float):
        return True
    if get_origin(annotation) not in (Union, types.UnionType):
        return False
    args = [a for a in get_args(annotation) if a is not type(None)]
    return bool(args) and all(a in (int, float) for a in args)


def _check_addresses(cfg: RunConfigBase) -> None:
    """Every ``listen_host`` of the config's tables is an IPv4 address (hivemind listens on
    ``/ip4/<listen_host>/tcp/0``) and every ``initial_peers`` entry looks like a multiaddr
    (``/<protocol>/<address>/<transport>/<port>...``; hivemind parses it when the peer starts).

    Raises:
        UserError: naming the field, the value and what is allowed.
    """
    import ipaddress

    for table in type(cfg).model_fields:
        options = getattr(cfg, table)
        if not isinstance(options, BaseModel):
            continue
        host = getattr(options, "listen_host", None)
        if isinstance(host, str):
            try:
                ipaddress.IPv4Address(host)
            except ValueError:
                raise UserError(f"{table}.listen_host = {host!r} is not an IPv4 address; allowed: e.g. \"127.0.0.1\" "
                                f"(this machine only) or \"0.0.0.0\" (every interface)") from None
        for addr in getattr(options, "initial_peers", None) or []:
            if not (isinstance(addr, str) and addr.startswith("/") and len(addr.split("/")) >= 5):
                raise UserError(f"{table}.initial_peers: {addr!r} is not a multiaddr; allowed: e.g. "
                                f"\"/ip4/10.0.0.5/tcp/31337/p2p/Qm...\" as printed by the first peer")


def read_toml(path: Path, what: str) -> dict[str, Any]:
    """Parse a TOML file; ``what`` names it in errors (e.g. "config file", "grid file").

    Raises:
        UserError: the file is missing, a folder, unreadable, not UTF-8 text, or not valid TOML
            (the message has the path).
    """
    from ddlscope.examples import resolve_example

    path = resolve_example(path)  # examples/NAME that is not here: the copy that ships with ddlscope
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise UserError(f"{what} not found: {path}") from None
    except IsADirectoryError:
        raise UserError(f"{what} {path} is a folder; allowed: a TOML file") from None
    except UnicodeDecodeError as err:
        raise UserError(f"{what} {path} is not UTF-8 text (byte {err.start}); allowed: a TOML file") from None
    except OSError as err:
        raise UserError(f"{what} {path} cannot be read: {err.strerror or err}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise UserError(f"{what} {path} is not valid TOML: {err}") from None


def load_config(path: Path, overrides: dict[str, Any] | None = None, nnodes: int = 1) -> RunConfig:
    """Read a TOML run config (``[run]``, optional ``[distributed]`` and model tables) and validate it.

    Raises:
        UserError: missing, unreadable or empty file, TOML syntax error, a ``run`` that is not a
            table, or invalid values.
    """
    data = read_toml(path, "config file")
    if not data:
        raise UserError(f"config file {path} sets nothing; a run config needs a [run] table with at least the "
                        f"model and dataset, e.g. [run] model = \"resnet18\" dataset = \"digits\" (plus the "
                        f"{', '.join(f'[{t}]' for t in CONFIG_TABLES[1:])} tables where needed)")
    unknown = set(data) - set(CONFIG_TABLES)
    if unknown:
        raise UserError(f"config file {path}: unknown table(s) {sorted(unknown)}; allowed: "
                        f"{', '.join(f'[{t}]' for t in CONFIG_TABLES)}")
    if not isinstance(data.get("run", {}), dict):
        raise UserError(f"config file {path}: run = {data['run']!r} is not a table; allowed: a [run] table of "
                        f"fields, e.g. [run] model = \"resnet18\"")
    values = dict(data.get("run", {}))
    for table in CONFIG_TABLES[1:]:
        if table in data:
            values[table] = data[table]
    return validate_config(merged(values, overrides or {}), nnodes)


def merged(values: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``values`` with ``overrides`` laid over them, table by table: an override of one field of a table
    (``--set collaborative.next_chunk_timeout_s=5``) keeps the table's other fields; a value replaces
    whatever was there. Neither argument is changed."""
    out = dict(values)
    for key, value in overrides.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def check_runnable(cfg: RunConfigBase, local_workers: int | None = None) -> None:
    """Checks of a valid config against this machine, its data and its network, run by the CLI
    before any run row or process exists (what :func:`validate_config` cannot tell from the values).

    - ``device = "cuda"``: CUDA is available, with a GPU per worker this host starts for models
      launched by torchrun (``local_workers``, default ``peers``), else at least one
      (:func:`check_device`); ``distributed.backend = "nccl"``: torch has NCCL;
    - ``data_root``: when it exists, a folder;
    - the dataset's train and test splits open (``digits`` is written there on first use) and are
      not empty, and ``batch_size`` is at most the training split (each step takes a full batch);
    - every label of the first batch (and, for datasets held in memory, of the split) is a class
      the model predicts;
    - a user factory ``module:function``, or any network on a dataset folder or a user dataset or
      with a user loss, is built once on the CPU (the factory imported from the working folder, as a
      worker does, and called with ``num_classes`` and ``in_channels``, and ``image_size`` when it
      takes it), and trained-mode forward and loss run on the first
      ``min(batch_size, 2)`` training samples, preprocessed as a worker does: the output must be
      logits ``(N, classes)`` (``(N, T, classes)`` for text) with at least the dataset's classes.
      A zoo network on a named dataset is not built: the zoo gives every named dataset's
      geometry its logits (tests/test_models.py). The loss must return a scalar tensor; a user
      optimizer factory is called once on the model's parameters.

    Cost: opening the dataset; a factory or folder adds one build and one forward of two samples
    (docs/config.md has figures).

    Raises:
        UserError / DatasetError: naming the field or file and what is allowed.
    """
    import torch

    from ddlscope.workloads.step import OPTIMIZERS

    _check_device(cfg, local_workers)
    train_set, spec = _open_splits(cfg)
    if len(train_set) < cfg.batch_size:
        raise UserError(f"batch_size = {cfg.batch_size} is larger than the training split of dataset {cfg.dataset!r} "
                        f"({len(train_set)} samples); allowed: 1..{len(train_set)}")
    from torch.utils.data import default_collate

    from ddlscope.workloads.datasets import DATASETS, USER
    from ddlscope.workloads.factories import build_loss
    from ddlscope.workloads.models import NETWORKS, build_model
    from ddlscope.workloads.preprocessing import train_transform

    transform = (lambda image: image) if spec.format == USER else train_transform(spec, augment=cfg.augment)
    n = min(cfg.batch_size, 2)
    try:
        x, y = default_collate([(transform(image), label) for image, label in (train_set[i] for i in range(n))])
    except Exception as err:  # a user dataset's items that do not stack into a batch
        raise UserError(f"dataset = {cfg.dataset!r}: its first {n} samples do not form a batch: {type(err).__name__}: "
                        f"{err}; allowed: items (tensor of one shape, int label)") from None
    what = f"model = {cfg.model!r}"
    loss_fn = build_loss(cfg.loss)
    if cfg.model in NETWORKS and cfg.dataset in DATASETS and cfg.loss == "cross_entropy":
        _check_labels(train_set, y, spec.num_classes, spec, cfg, what, "logits (N, classes)")
        return
    torch.manual_seed(cfg.seed)
    search_path = list(sys.path)
    sys.path.insert(0, os.getcwd())  # where a worker (python -m ...) imports a factory 'module:function' from
    try:
        model = build_model(cfg.model, spec.family, num_classes=spec.num_classes, input_shape=spec.image_shape)
    except UserError:
        raise
    except Exception as err:  # a user factory's own error: the user's to fix
        raise UserError(f"{what}: the factory failed when called with num_classes={spec.num_classes}, "
                        f"in_channels={spec.channels} (image_size=({spec.height}, {spec.width}) if it takes it): "
                        f"{type(err).__name__}: {err}") from None
    finally:
        sys.path[:] = search_path
    model.train()
    try:
        with torch.no_grad():
            out = model(x)
    except Exception as err:
        raise UserError(f"{what} fails on the first batch of dataset {cfg.dataset!r} (input {tuple(x.shape)}): "
                        f"{type(err).__name__}: {err}; allowed: a network taking {tuple(x.shape[1:])} samples") from None
    expected = f"logits (N, {spec.num_classes})" if y.dim() == 1 else f"logits (N, T, {spec.num_classes})"
    if not isinstance(out, torch.Tensor) or out.dim() != y.dim() + 1 or tuple(out.shape[:-1]) != tuple(y.shape):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise UserError(f"{what} returns {got} for a batch of {n} samples of dataset {cfg.dataset!r}; "
                        f"allowed: {expected}")
    _check_labels(train_set, y, out.shape[-1], spec, cfg, what, expected)
    try:
        loss = loss_fn(out, y)
    except Exception as err:
        raise UserError(f"{what}: the loss {cfg.loss!r} fails on its output {tuple(out.shape)} for labels "
                        f"{tuple(y.shape)}: {type(err).__name__}: {err}; allowed: {expected}") from None
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
        got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise UserError(f"loss = {cfg.loss!r} returns {got}; allowed: a scalar (0-dim) tensor, e.g. a mean")
    if cfg.optimizer not in OPTIMIZERS:
        from ddlscope.train.loop import build_run_optimizer

        build_run_optimizer(cfg, model.parameters())


def _check_labels(train_set, y, classes: int, spec, cfg: RunConfigBase, what: str, expected: str) -> None:
    """The model predicts ``classes`` classes: at least the dataset's, and every label of the first
    batch ``y`` (of the whole split when it is held in memory) is one of them or ignored."""
    import torch

    from ddlscope.workloads.step import IGNORE_INDEX

    labels = getattr(train_set, "labels", None)
    labels = labels if isinstance(labels, torch.Tensor) and labels.dim() == 1 else y
    scored = labels[labels != IGNORE_INDEX]
    if classes < spec.num_classes or (scored.numel() and (int(scored.min()) < 0 or int(scored.max()) >= classes)):
        span = f"{int(scored.min())}..{int(scored.max())}" if scored.numel() else "none"
        raise UserError(f"{what} predicts {classes} classes, but dataset {cfg.dataset!r} has {spec.num_classes} "
                        f"(labels {span}); allowed: {expected}")


DEVICE_FORMS = "cpu, cuda, cuda:N (N a visible GPU's index), mps"
"""The device strings :func:`check_device` accepts."""


def _visible_devices_note() -> str:
    """``CUDA_VISIBLE_DEVICES=...`` as this process has it (``unset`` when it is not set), for messages about GPUs."""
    return f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}"


def check_device(device: str, workers_on_host: int = 1, what: str | None = None) -> None:
    """Pre-flight check that ``device`` is there, before anything starts.

    Args:
        device: ``cpu``, ``cuda``, ``cuda:N`` or ``mps``.
        workers_on_host: processes this host starts that each need a GPU of their own (torchrun's
            models: ddp, fsdp, gpipe, 1f1b, ...); 1 for a device shared by all of them.
        what: how the message names the job, e.g. ``ddp with peers = 2``; default ``device = "..."``.

    Raises:
        UserError: one line naming the device and what torch sees: an unknown device string; CUDA
            asked for where torch has none (built without CUDA, or no GPU visible); ``cuda:N`` beyond
            the visible GPUs; fewer visible GPUs than ``workers_on_host``; ``mps`` where it is not
            available. Messages about GPUs quote ``CUDA_VISIBLE_DEVICES``.
    """
    import torch

    kind, _, index = device.partition(":")
    if kind not in ("cpu", "cuda", "mps") or (index and (kind != "cuda" or not index.isdigit())):
        raise UserError(f"unknown device {device!r}; allowed: {DEVICE_FORMS}")
    job = what or f'device = "{device}"'
    if kind == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise UserError(f"{job}: torch sees no MPS (Apple GPU) device here; allowed here: cpu")
    if kind != "cuda":
        return
    if not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else f"torch sees no CUDA GPU ({_visible_devices_note()})"
        raise UserError(f"{job} needs CUDA, but {why}; allowed here: device = \"cpu\"")
    count = torch.cuda.device_count()
    gpus = f"torch sees {count} GPU{'s' if count != 1 else ''} ({_visible_devices_note()})"
    if index and int(index) >= count:
        raise UserError(f"{job}: there is no {device}, {gpus}; allowed: cuda:0..cuda:{count - 1}")
    if workers_on_host > count:
        raise UserError(f"{job} needs {workers_on_host} GPUs on this host (one per worker); {gpus}; allowed: "
                        f"at most {count} workers on this host (fewer peers, --local-peers, or more nodes)")


def _check_device(cfg: RunConfigBase, local_workers: int | None) -> None:
    """:func:`check_device` for a run: torchrun's models need a GPU per worker this host starts
    (``local_workers``, default ``peers``), other models one; ``distributed.backend = "nccl"`` needs
    torch's NCCL (the value check, nccl with device cpu, is :class:`RunConfigBase`'s)."""
    torchrun = cfg.distribution_model.launcher == "torchrun"
    workers = (local_workers or cfg.peers) if torchrun and cfg.device == "cuda" else 1
    peers = f"peers = {cfg.peers}" if workers in (1, cfg.peers) else f"{workers} of its peers = {cfg.peers} on this host"
    check_device(cfg.device, workers, f"{cfg.strategy} with {peers} on device {cfg.device}" if torchrun
                 else f"{cfg.strategy} on device {cfg.device}")
    if torchrun and cfg.distributed.backend == "nccl":
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_nccl_available()):
            raise UserError('distributed.backend = "nccl", but this torch has no NCCL; allowed here: "gloo" or "auto"')


def _open_splits(cfg: RunConfigBase):
    """The training split and spec of the run's dataset, after the test split opened too.

    Raises:
        UserError / DatasetError: a data_root that is not a folder, missing or unreadable files, an empty split.
    """
    from ddlscope.workloads.datasets import default_data_root, open_dataset

    root = Path(cfg.data_root) if cfg.data_root is not None else default_data_root()
    if cfg.data_root is not None and cfg.data_root.exists() and not cfg.data_root.is_dir():
        raise UserError(f"data_root = {str(cfg.data_root)!r} is a file; allowed: a folder holding datasets "
                        f"(created when missing)")
    opened = {}
    for split in ("train", "test"):
        try:
            dataset, spec = open_dataset(cfg.dataset, root, split)
        except OSError as err:
            where = err.filename or root
            raise UserError(f"dataset {cfg.dataset!r}: cannot read {where}: {err.strerror or err}") from None
        if len(dataset) == 0:
            raise UserError(f"dataset {cfg.dataset!r} has an empty {split} split under {root}")
        opened[split] = dataset, spec
    return opened["train"]
