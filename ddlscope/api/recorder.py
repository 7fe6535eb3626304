"""Measure a training loop that ddlscope did not write: :class:`Recorder`.

A recorder stores a user's own training (plain ``python`` or one process per rank under ``torchrun``)
as a ddlscope run: the same ``runs``, ``workers``, ``steps``, ``evals``, ``host_samples`` and ``events``
rows the built-in loop writes (:mod:`ddlscope.train.loop`), so ``ddlscope report`` (with its bottleneck
verdict), ``ddlscope runs``, ``ddlscope export`` and :func:`ddlscope.experiments.results.measure_run`
read it like any other run.

Two ways to time the steps, which can be mixed in one script (not in one step):

- **explicit**: ``with rec.step(samples):`` around each step and ``with rec.phase("forward"):`` (or
  ``data_load``, ``backward``, ``comm_wait``, ``optimizer``) around its parts; ``rec.batches(loader)``
  times fetching each batch as the next step's ``data_load_s``;
- **automatic**: ``rec.watch(model, optimizer)`` hooks the model and the optimizer and times every
  training step without a line in the loop (see :meth:`Recorder.watch` for what each part is then).

Each rank records itself: its worker index is ``RANK`` (0 without torchrun), the run's ``peers`` is
``WORLD_SIZE``. All ranks of one job share one run row: rank 0 creates its id and broadcasts it when
``torch.distributed`` is initialised before the recorder starts; otherwise every rank derives the same
id from the job's environment (torchrun's ``TORCHELASTIC_RUN_ID``, ``MASTER_ADDR``/``MASTER_PORT`` and
the pid of the agent that started the ranks), or from ``DDLSCOPE_RUN_ID`` when set. The run becomes
``completed`` when every rank finished, ``failed``/``interrupted`` with the first rank's reason otherwise.

Communication of a model wrapped in ``DistributedDataParallel`` (a DDP communication hook that
all-reduces and averages each gradient bucket like DDP's default, timed from launch to completion) or
in FSDP2's ``fully_shard`` (timed all-gathers and reduce-scatters) is measured: ``comm_s`` (collectives in
flight), ``comm_bytes`` and ``comm_wait_s`` (the exposed tail after the backward compute). Anything else
(FSDP1, a hook the script registered itself, DeepSpeed) is "not hooked": an event says why, and those
columns stay NULL (unknown), never 0.

Step rows are committed by a writer thread every :attr:`Recorder.store_flush_interval_s` (1 s) and when
the recorder finishes (also on SIGTERM/SIGHUP, see ``handle_signals``); a process killed with SIGKILL
loses at most the steps of the last second.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import signal
import socket
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from ddlscope.errors import UserError
from ddlscope.measure.comm import CommTimer, exposed_comm_s
from ddlscope.measure.host import UNKNOWN_EVENT, HostSampler
from ddlscope.measure.memory import peak_memory_bytes
from ddlscope.measure.timeline import Stopwatch
from ddlscope.store.db import BatchedWriter, ResultsStore, default_db_path

PHASES: dict[str, str] = {"data_load": "data_load_s", "forward": "forward_s", "backward": "backward_s",
                          "comm_wait": "comm_wait_s", "optimizer": "optimizer_s"}
"""Phase names :meth:`Recorder.phase` takes and the ``steps`` column each one fills (seconds)."""
SOURCE = "recorder"
"""``config.source`` of a recorded run (runs started by ddlscope have none)."""
COMM_EVENT = "comm_hook"
"""``events.kind`` saying whether (and how) a rank's communication is timed."""


class RecorderInterrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived while a recorder ran (e.g. torchrun ending the other ranks after one
    failed); raised in the main thread so that the run is stored ``interrupted``."""


def _rank_env() -> tuple[int, int, int]:
    """``(rank, world size, local rank)`` from torchrun's environment, ``(0, 1, 0)`` without it."""
    env = os.environ
    try:
        return int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0))
    except ValueError:
        raise UserError(f"RANK / WORLD_SIZE / LOCAL_RANK must be integers, got {env.get('RANK')!r} / "
                        f"{env.get('WORLD_SIZE')!r} / {env.get('LOCAL_RANK')!r}") from None


def _job_run_id(world: int) -> str | None:
    """The run id every rank of this job computes alike without talking to the others, or None
    (a single process: the recorder makes a fresh one)."""
    given = os.environ.get("DDLSCOPE_RUN_ID")
    if given:
        return given
    if world <= 1:
        return None
    import psutil

    parent = os.getppid()
    try:
        parent_started = psutil.Process(parent).create_time()
    except psutil.Error:
        parent_started = 0.0
    key = "|".join([os.environ.get("TORCHELASTIC_RUN_ID", ""), os.environ.get("MASTER_ADDR", ""),
                    os.environ.get("MASTER_PORT", ""), socket.gethostname(), str(parent), f"{parent_started:.2f}"])
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def _first_tensor(value: Any) -> torch.Tensor | None:
    """The first tensor in a (nested) tuple/list/dict of a module's inputs or outputs."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


class StepRecord:
    """The step in progress (what ``with rec.step(...) as st`` gives): set ``st.loss`` (a float or a
    0-dim tensor, read at the step's end), ``st.accuracy`` (0..1, training batch) and ``st.samples``."""

    def __init__(self, index: int, samples: int | None, wall_time: float):
        self.index = index
        self.samples = samples
        self.wall_time = wall_time
        self.loss: Any = None
        self.accuracy: float | None = None
        self.parts: dict[str, float] = {}
        self.optimizer_stepped = True
        self.comm_s: float | None = None
        self.comm_bytes: int | None = None
        # automatic mode (perf_counter times): the step's start, its open forward and optimizer step, the end of
        # its last backward compute, its wall time once ended
        self.start = 0.0
        self.forward_start: float | None = None
        self.optimizer_start: float | None = None
        self.backward_end: float | None = None
        self.step_s = 0.0

    def add(self, column: str, seconds: float) -> None:
        self.parts[column] = self.parts.get(column, 0.0) + seconds


class Evaluation:
    """What ``with rec.evaluation() as ev`` gives: call :meth:`record` with the held-out result."""

    def __init__(self, recorder: "Recorder"):
        self.recorder = recorder
        self.result: tuple[float, float, int] | None = None

    def record(self, accuracy: float, loss: float, samples: int) -> None:
        """The evaluation's held-out ``accuracy`` (0..1), mean ``loss`` and number of ``samples``.

        Raises:
            UserError: accuracy outside 0..1, a loss that is not a finite number, samples < 1.
        """
        accuracy, loss = float(accuracy), float(loss)
        if not 0.0 <= accuracy <= 1.0:
            raise UserError(f"evaluation accuracy = {accuracy}: allowed: a fraction in 0..1")
        if loss != loss or loss in (float("inf"), float("-inf")):
            raise UserError(f"evaluation loss = {loss}: allowed: a finite number")
        if isinstance(samples, bool) or int(samples) < 1:
            raise UserError(f"evaluation samples = {samples!r}: allowed: a positive integer")
        self.result = (accuracy, loss, int(samples))


class Recorder:
    """Records one process's (one rank's) training as a ddlscope run. See the module docstring.

    Args:
        name: the run's label (default: the script's file name without ``.py``).
        db: the results store (default ``./ddlscope-results/ddlscope.db``); every rank of a job must
            give the same file.
        model, dataset: labels stored in the run's config (free text, e.g. ``"MyCNN"``,
            ``"imagefolder:/data/x"``); reports show them.
        batch_size: samples per rank per step, stored in the config; default: the samples of the first step.
        strategy: the distribution model the run counts as (a name of ``ddlscope models``); default
            ``single`` for one process, ``ddp`` for more, ``fsdp`` once :meth:`watch` sees an FSDP2 model.
        group: label tying runs together for ``ddlscope report --group``.
        warmup_steps: first steps stored but flagged as warm-up (left out of rates and the verdict).
        host_sample_interval_s: seconds between host samples (CPU %, RSS, disk, network bytes).
        device: the training device (CUDA devices are synchronised before each clock reading); default:
            the device of the watched model, else CPU.
        run_id: the run id to use (every rank the same); default see the module docstring.
        config: more JSON-able settings to store with the run (under ``config["user"]``).
        profile_steps: ``(a, b)``: ``torch.profiler`` trace of steps a..b (0-based, both included) of every
            rank, written next to the run's logs (:mod:`ddlscope.measure.torch_profile`).
        handle_signals: while recording, SIGTERM and SIGHUP (when their handler is the default) raise
            :class:`RecorderInterrupted` in the main thread so that the run is stored ``interrupted``.

    Raises:
        UserError: a bad argument (named, with what is allowed), or a store that cannot be written.

    Use as a context manager (``with ddlscope.record(...) as rec:``), or call :meth:`start` and
    :meth:`finish`; a recorder still open when the interpreter exits is finished then (``failed`` with the
    uncaught exception, else ``completed``).

    Steps are queued to a :class:`~ddlscope.store.db.BatchedWriter` that commits them every
    :attr:`store_flush_interval_s` seconds and on :meth:`finish`.
    """

    store_flush_interval_s: float = 1.0
    """Seconds between commits of step rows; a SIGKILL loses at most this much of the steps."""

    def __init__(self, name: str | None = None, db: str | Path | None = None, *, model: str = "user-model",
                 dataset: str = "user-data", batch_size: int | None = None, strategy: str | None = None,
                 group: str | None = None, warmup_steps: int = 2, host_sample_interval_s: float = 1.0,
                 device: str | torch.device | None = None, run_id: str | None = None,
                 config: dict[str, Any] | None = None, profile_steps: tuple[int, int] | None = None,
                 handle_signals: bool = True):
        from ddlscope import distribution

        self.name = name if name is not None else Path(sys.argv[0] or "recorded").stem or "recorded"
        if not isinstance(self.name, str) or not self.name.strip():
            raise UserError(f"name = {name!r}: allowed: a non-empty string")
        self.db_path = Path(db) if db is not None else default_db_path()
        for label, value in (("model", model), ("dataset", dataset)):
            if not isinstance(value, str) or not value:
                raise UserError(f"{label} = {value!r}: allowed: a non-empty string (a label stored with the run)")
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
            raise UserError(f"batch_size = {batch_size!r}: allowed: a positive integer, or None (the first step's samples)")
        if strategy is not None and strategy not in distribution.names():
            raise UserError(f"strategy = {strategy!r}: allowed: {', '.join(distribution.names())} (or None: automatic)")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise UserError(f"warmup_steps = {warmup_steps!r}: allowed: an integer >= 0")
        if not isinstance(host_sample_interval_s, (int, float)) or isinstance(host_sample_interval_s, bool) or \
                not 0 < host_sample_interval_s <= 60:
            raise UserError(f"host_sample_interval_s = {host_sample_interval_s!r}: allowed: 0 < seconds <= 60")
        if config is not None and not isinstance(config, dict):
            raise UserError(f"config = {config!r}: allowed: a dict of JSON-able settings")
        if profile_steps is not None:
            from ddlscope.measure.torch_profile import check_profile_steps

            try:
                profile_steps = check_profile_steps(profile_steps)
            except ValueError as err:
                raise UserError(str(err)) from None
        self.rank, self.world, self.local_rank = _rank_env()
        self.model_label, self.dataset_label = model, dataset
        self.batch_size, self.strategy_given, self.group = batch_size, strategy, group
        self.strategy = strategy or ("single" if self.world == 1 else "ddp")
        self.warmup_steps, self.host_sample_interval_s = warmup_steps, float(host_sample_interval_s)
        self.device = torch.device(device) if device is not None else None
        self.run_id: str | None = run_id
        self.user_config = dict(config or {})
        self.profile_steps = profile_steps
        self.handle_signals = handle_signals
        self.store: ResultsStore | None = None
        self.status: str | None = None
        self.reason: str | None = None
        self.steps = 0
        self.comm_hooked: bool | None = None  # None: nothing to hook (one process)
        self._timer = CommTimer()
        self._watch: Stopwatch | None = None
        self._sampler: HostSampler | None = None
        self._writer: BatchedWriter | None = None
        self._profiler = None
        self._current: StepRecord | None = None  # explicit step in progress
        self._auto: StepRecord | None = None  # automatic step in progress
        self._pending: StepRecord | None = None  # automatic step ended, row not yet written (loss may follow)
        self._phase_open: str | None = None
        self._mark = 0.0  # perf_counter of the last step boundary (automatic mode)
        self._mark_wall = 0.0
        self._fetch_s: float | None = None  # time rec.batches() waited for the next batch
        self._fetch_wall: float | None = None
        self._in_eval = False
        self._eval_s = 0.0
        self._train_start = 0.0
        self._hooks: list[Any] = []
        self._optimizer_watched = False
        self._comm_note: dict[str, Any] | None = None  # watch() before start(): the comm_hook event to write
        self._exc_info: tuple | None = None
        self._previous_signals: dict[int, Any] = {}
        self._previous_excepthook = None

    # ------------------------------------------------------------------ start / finish
    def start(self) -> "Recorder":
        """Create (or join) the run's row and this rank's worker row, start host sampling.

        Raises:
            UserError: already started, or the store cannot be opened.
        """
        if self.store is not None:
            raise UserError("this recorder was already started; allowed: one start per recorder")
        self.run_id = self.run_id or self._agreed_run_id()
        try:
            self.store = ResultsStore(self.db_path)
        except OSError as err:
            raise UserError(f"db = {str(self.db_path)!r} cannot be opened: {err}; allowed: a writable file") from None
        self.store.create_run(self.name, self.strategy, self._config(), self.group, self.run_id)
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self._train_start = time.time()
        self.store.upsert_worker(self.run_id, self.rank, hostname=socket.gethostname(), pid=os.getpid(),
                                 cores=",".join(map(str, cores)), status="training", train_start_time=self._train_start)
        self._writer = self.store.batched_writer(self.store_flush_interval_s)
        self._watch = Stopwatch(self.device or "cpu")
        self._mark, self._mark_wall = time.perf_counter(), time.time()
        self._sampler = HostSampler(self.store.host_sample_writer(self.run_id, self.rank), self.host_sample_interval_s,
                                    network=self.world > 1,
                                    note=lambda **why: self.store.add_event(self.run_id, self.rank, UNKNOWN_EVENT, **why))
        self._sampler.__enter__()
        if self.profile_steps is not None:
            from ddlscope.measure.torch_profile import StepProfiler, profile_dir

            self._profiler = StepProfiler(self.profile_steps, profile_dir(self.db_path, self.run_id), self.rank,
                                          str(self.device or "cpu"))
        if self.world > 1 and self.comm_hooked is None:
            self.comm_hooked = False
        if self._comm_note is not None:  # watch() ran before start()
            self.store.add_event(self.run_id, self.rank, COMM_EVENT, **self._comm_note)
        self._install_exit_handlers()
        return self

    def _agreed_run_id(self) -> str:
        """The run id all ranks share (see the module docstring)."""
        import uuid

        import torch.distributed as dist

        if self.world > 1 and dist.is_available() and dist.is_initialized() and not os.environ.get("DDLSCOPE_RUN_ID"):
            box = [uuid.uuid4().hex[:12] if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(box, src=0)
            return str(box[0])
        return _job_run_id(self.world) or uuid.uuid4().hex[:12]

    def _config(self) -> dict[str, Any]:
        """The run's stored config: what reports and measure_run read (strategy, peers, batch_size ...)."""
        cfg = {"name": self.name, "strategy": self.strategy, "model": self.model_label, "dataset": self.dataset_label,
               "batch_size": self.batch_size, "peers": self.world, "warmup_steps": self.warmup_steps,
               "host_sample_interval_s": self.host_sample_interval_s, "device": str(self.device or "cpu"),
               "source": SOURCE, "script": sys.argv[0] if sys.argv else None}
        if self.profile_steps is not None:
            cfg["profile_steps"] = list(self.profile_steps)
        if self.user_config:
            cfg["user"] = self.user_config
        return cfg

    def _update_run(self) -> None:
        if self.store is not None:
            self.store.update_run(self.run_id, strategy=self.strategy, config=self._config())

    def finish(self, status: str = "completed", reason: str | None = None) -> None:
        """End this rank's recording: write the last step, stop sampling, record the worker's status and
        (the last rank to complete, or the first to fail) the run's. Calling it again changes nothing.

        Args:
            status: ``completed``, ``failed`` or ``interrupted``.
            reason: why, for the latter two (stored with the run).

        Raises:
            UserError: an unknown status.
        """
        if status not in ("completed", "failed", "interrupted"):
            raise UserError(f"status = {status!r}: allowed: completed, failed, interrupted")
        if self.store is None or self.status is not None:
            return
        self.status, self.reason = status, reason
        try:
            self._flush_auto(end_open=status == "completed")
            if self._current is not None:  # an explicit step cut short by the error: not stored
                self._current = None
            if self._sampler is not None:
                self._sampler.__exit__(None, None, None)
            if self._profiler is not None:
                from ddlscope.measure.torch_profile import record_profile

                try:
                    record_profile(self.store, self.run_id, self.rank, self._profiler)
                except OSError as err:
                    self.store.add_event(self.run_id, self.rank, "torch_profile_failed", error=str(err))
            self._writer.close()  # every step committed before the worker's end is
            self.store.upsert_worker(self.run_id, self.rank, train_end_time=time.time(), eval_s=self._eval_s,
                                     peak_memory_bytes=peak_memory_bytes(self.device or torch.device("cpu")),
                                     status=status, reason=reason)
            if status == "completed":
                self.store.complete_run_if_workers_completed(self.run_id, self.world)
            else:
                who = f"worker {self.rank}: " if self.world > 1 else ""
                self.store.end_running_run(self.run_id, status, who + (reason or status))
        finally:
            for hook in self._hooks:
                hook.remove()
            self._hooks = []
            self._restore_exit_handlers()
            with contextlib.suppress(Exception):  # after an error above: still commit the steps queued
                self._writer.close()
            self.store.close()

    def __enter__(self) -> "Recorder":
        return self if self.store is not None else self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish("completed")
        else:
            self.finish(*_outcome(exc))

    # ------------------------------------------------------------------ exit paths
    def _install_exit_handlers(self) -> None:
        atexit.register(self._at_exit)
        self._previous_excepthook = sys.excepthook

        def excepthook(exc_type, exc, tb):
            self._exc_info = (exc_type, exc, tb)
            self._previous_excepthook(exc_type, exc, tb)

        sys.excepthook = excepthook
        if self.handle_signals and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGHUP):
                if signal.getsignal(sig) == signal.SIG_DFL:
                    self._previous_signals[sig] = signal.signal(sig, _raise_interrupted)

    def _restore_exit_handlers(self) -> None:
        atexit.unregister(self._at_exit)
        if self._previous_excepthook is not None and sys.excepthook is not self._previous_excepthook:
            sys.excepthook = self._previous_excepthook
        if threading.current_thread() is threading.main_thread():
            for sig, handler in self._previous_signals.items():
                signal.signal(sig, handler)
        self._previous_signals = {}

    def _at_exit(self) -> None:
        """The interpreter exits with the recorder still open: finish it from the uncaught exception, if any."""
        if self._exc_info is not None:
            self.finish(*_outcome(self._exc_info[1]))
        else:
            self.finish("completed")

    # ------------------------------------------------------------------ explicit steps
    def _started(self) -> ResultsStore:
        if self.store is None:
            raise UserError("the recorder is not started; use `with ddlscope.record(...) as rec:` or rec.start()")
        if self.status is not None:
            raise UserError(f"the recorder already finished ({self.status}); allowed: steps between start and finish")
        return self.store

    def batches(self, iterable: Iterable) -> Iterator:
        """Iterate over ``iterable`` (e.g. a DataLoader), timing each fetch as the next step's ``data_load_s``
        (also inside ``step_s``, which then starts when the fetch started)."""
        iterator = iter(iterable)
        while True:
            wall, t0 = time.time(), time.perf_counter()
            try:
                item = next(iterator)
            except StopIteration:
                return
            self._fetch_s, self._fetch_wall = time.perf_counter() - t0, wall
            yield item

    @contextmanager
    def step(self, samples: int | None = None, *, loss: Any = None, optimizer_stepped: bool = True
             ) -> Iterator[StepRecord]:
        """Time one training step (its wall time is ``step_s``) and store it when the block ends.

        Args:
            samples: samples this rank trained on in the step (default: the recorder's ``batch_size``);
                ``st.samples = n`` inside the block also works.
            loss: the step's training loss (or set ``st.loss`` inside the block).
            optimizer_stepped: False for a gradient-accumulation micro-step without an optimizer step.

        A step that raises is not stored (the recorder ends ``failed`` when the error leaves its block).

        Raises:
            UserError: the recorder is not running, steps are nested, or no sample count is known.
        """
        self._started()
        if self._current is not None:
            raise UserError("rec.step() blocks cannot be nested; allowed: one step at a time")
        self._flush_auto(end_open=True)
        self._watch.start()
        st = StepRecord(self.steps, samples, self._fetch_wall or time.time())
        st.loss, st.optimizer_stepped = loss, optimizer_stepped
        if self._fetch_s is not None:
            st.add("data_load_s", self._fetch_s)
        t0, fetched = time.perf_counter(), self._fetch_s or 0.0
        self._fetch_s = self._fetch_wall = None
        self._current = st
        self._timer.take()
        self._timer.last_launch = None
        if self._profiler is not None:
            self._profiler.step_started(st.index)
        try:
            yield st
        except BaseException:
            self._current = None
            raise
        self._watch.lap()  # synchronises a CUDA device: the step's kernels are done
        step_s = time.perf_counter() - t0 + fetched
        if self._profiler is not None:
            self._profiler.step_ended(st.index)
        self._current = None
        if self.comm_hooked:
            stats = self._timer.take()
            st.comm_s, st.comm_bytes = stats.comm_s, stats.comm_bytes
        self._write(st, step_s)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time one part of the current step; its seconds add to the step's ``<name>_s`` column.

        Args:
            name: one of :data:`PHASES` (``data_load``, ``forward`` (with the loss), ``backward``,
                ``comm_wait``, ``optimizer``).

        With a hooked DDP/FSDP model, the ``backward`` phase's exposed communication tail (after the last
        collective was launched) is moved to ``comm_wait_s``, as the built-in loop does.

        Raises:
            UserError: unknown name, no step in progress, or phases nested.
        """
        if name not in PHASES:
            raise UserError(f"phase {name!r}: allowed: {', '.join(PHASES)}")
        st = self._current
        if st is None:
            raise UserError(f"rec.phase({name!r}) outside a step; allowed: inside `with rec.step(...):`")
        if self._phase_open is not None:
            raise UserError(f"rec.phase({name!r}) inside phase {self._phase_open!r}; allowed: one phase at a time")
        self._phase_open = name
        self._watch.start()
        try:
            yield
        finally:
            self._phase_open = None
        seconds = self._watch.lap()
        if name == "backward" and self.comm_hooked and self._timer.last_launch is not None:
            exposed = exposed_comm_s(time.perf_counter(), self._timer.last_launch, seconds, self._timer.peek().comm_s)
            seconds -= exposed
            st.add("comm_wait_s", exposed)
        if name == "optimizer":
            st.optimizer_stepped = True
        st.add(PHASES[name], seconds)

    def log_step(self, samples: int, *, step_s: float, loss: Any = None, accuracy: float | None = None,
                 **parts: float) -> None:
        """Store a step timed elsewhere (a framework's callback): ``samples``, its wall time ``step_s`` and any
        of ``data_load_s``, ``forward_s``, ``backward_s``, ``comm_wait_s``, ``optimizer_s`` (seconds).

        Raises:
            UserError: an unknown part, or a negative or non-finite time.
        """
        self._started()
        allowed = set(PHASES.values())
        for key, value in {"step_s": step_s, **parts}.items():
            if key != "step_s" and key not in allowed:
                raise UserError(f"log_step: unknown part {key!r}; allowed: {', '.join(sorted(allowed))}")
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < float("inf"):
                raise UserError(f"log_step: {key} = {value!r}; allowed: seconds >= 0")
        st = StepRecord(self.steps, samples, time.time() - step_s)
        st.loss, st.accuracy = loss, accuracy
        for key, value in parts.items():
            st.add(key, float(value))
        if self.comm_hooked:
            stats = self._timer.take()
            st.comm_s, st.comm_bytes = stats.comm_s, stats.comm_bytes
        self._write(st, float(step_s))

    def note(self, loss: Any = None, accuracy: float | None = None) -> None:
        """Attach the training ``loss`` (float or 0-dim tensor) and/or batch ``accuracy`` (0..1) to the step in
        progress, or (automatic mode) to the step that just ended if the next has not begun."""
        st = self._current or self._auto or self._pending
        if st is None:
            return
        if loss is not None:
            st.loss = loss
        if accuracy is not None:
            st.accuracy = accuracy

    # ------------------------------------------------------------------ evaluation
    @contextmanager
    def evaluation(self) -> Iterator[Evaluation]:
        """Time a held-out evaluation: its time is left out of the training time (``eval_s``), forwards inside
        it are not counted as training, and ``ev.record(accuracy, loss, samples)`` stores the result after
        the last step (``evals`` rows: the report's accuracy and time-to-accuracy)."""
        store = self._started()
        self._flush_auto(end_open=True)
        ev = Evaluation(self)
        t0 = time.perf_counter()
        train_time_s = time.time() - self._train_start - self._eval_s
        self._in_eval = True
        try:
            yield ev
        finally:
            self._in_eval = False
            self._eval_s += time.perf_counter() - t0
            self._mark = time.perf_counter()  # the time evaluating is no step's data loading
        if ev.result is not None:
            accuracy, loss, samples = ev.result
            store.add_eval(self.run_id, self.rank, max(0, self.steps - 1), train_time_s, accuracy, loss, samples)

    # ------------------------------------------------------------------ automatic mode
    def watch(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> torch.nn.Module:
        """Hook ``model`` (and ``optimizer``) so that training steps are timed without code in the loop, and
        hook the model's communication where it can (DDP, FSDP2). Returns ``model``.

        In automatic mode a step runs from the end of the previous optimizer step (or, without an
        optimizer, of the previous backward pass) to the end of this one:
        ``data_load_s`` is the time until the model's first forward (loading the batch, moving it to the
        device and whatever else the loop does there), ``forward_s`` runs from the forward's start until the
        backward pass reaches the model's output (the loss is in it), ``backward_s`` until autograd finished,
        ``comm_wait_s`` until the last collective completed after that, and ``optimizer_s`` is
        ``optimizer.step()``. Several forward/backward passes before one optimizer step (gradient
        accumulation) add up. Forwards without gradients (``torch.no_grad``, evaluation) are not counted.
        Samples are the first input tensor's first dimension. Time between the backward pass and
        ``optimizer.step()`` (e.g. gradient clipping) is in ``step_s`` but in no part. Steps timed with
        :meth:`step` are left alone by the hooks (their communication is still timed).

        Call it after wrapping the model in DDP / FSDP and before the first training step; the
        communication hook needs that.

        Raises:
            UserError: ``model`` is not an ``nn.Module`` or ``optimizer`` not a ``torch.optim.Optimizer``.
        """
        if not isinstance(model, torch.nn.Module):
            raise UserError(f"watch(model = {type(model).__name__}): allowed: a torch.nn.Module")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise UserError(f"watch(optimizer = {type(optimizer).__name__}): allowed: a torch.optim.Optimizer or None")
        if self.device is None:
            param = next(model.parameters(), None)
            if param is not None:
                self.device = param.device
                if self._watch is not None:
                    self._watch = Stopwatch(self.device)
        self._hook_comm(model)
        self._hooks.append(model.register_forward_pre_hook(self._forward_started))
        self._hooks.append(model.register_forward_hook(self._forward_ended))
        self._optimizer_watched = optimizer is not None
        if optimizer is not None:
            self._hooks.append(optimizer.register_step_pre_hook(self._optimizer_started))
            self._hooks.append(optimizer.register_step_post_hook(self._optimizer_ended))
        self._update_run()
        return model

    def _auto_active(self) -> bool:
        return (self.store is not None and self.status is None and self._current is None and not self._in_eval
                and torch.is_grad_enabled())

    def _sync(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _forward_started(self, module, args, kwargs=None) -> None:
        if not self._auto_active():
            return
        self._sync()
        now = time.perf_counter()
        st = self._auto
        if st is None:
            self._flush_auto(end_open=False)  # the previous step's row: its writing is in no step
            writing_s = time.perf_counter() - now
            st = self._auto = StepRecord(self.steps, 0, self._mark_wall)
            st.parts = {"forward_s": 0.0, "backward_s": 0.0}
            st.start = self._mark + writing_s
            self._timer.take()
            if self._profiler is not None:
                self._profiler.step_started(st.index)
        st.add("data_load_s", max(0.0, now - self._mark))
        x = _first_tensor(args) if args else _first_tensor(kwargs)
        st.samples += int(x.shape[0]) if x is not None and x.dim() > 0 else 0
        st.forward_start = time.perf_counter()

    def _forward_ended(self, module, args, output) -> None:
        st = self._auto
        if st is None or not self._auto_active() or st.forward_start is None:
            return
        out = _first_tensor(output)
        if out is None or not out.requires_grad:  # nothing to hook the backward on: the forward is the step's
            self._sync()
            st.add("forward_s", time.perf_counter() - st.forward_start)
            st.forward_start = None
            self._mark = time.perf_counter()
            return
        started = st.forward_start

        def backward_started(grad):
            self._sync()
            now = time.perf_counter()
            st.add("forward_s", now - started)
            _queue_autograd_callback(lambda: self._backward_ended(st, now))
            return grad

        out.register_hook(backward_started)
        st.forward_start = None

    def _backward_ended(self, st: StepRecord, started: float) -> None:
        """Autograd finished computing (the first callback at the end of the backward pass)."""
        self._sync()
        end = time.perf_counter()
        st.add("backward_s", end - started)
        st.backward_end = end
        self._mark = end
        # DDP's own end-of-backward callback (it waits for the last all-reduce) was queued after this one;
        # one queued now runs after it
        _queue_autograd_callback(lambda: self._backward_finished(st))

    def _backward_finished(self, st: StepRecord) -> None:
        """``loss.backward()`` is about to return (DDP's wait for its collectives included)."""
        self._mark = time.perf_counter()
        if not self._optimizer_watched and self._auto is st:
            self._end_auto_step(self._mark)

    def _optimizer_started(self, optimizer, args, kwargs) -> None:
        st = self._auto
        if st is None or self._current is not None:
            return
        self._sync()
        st.optimizer_start = time.perf_counter()

    def _optimizer_ended(self, optimizer, args, kwargs) -> None:
        st = self._auto
        if st is None or self._current is not None or st.optimizer_start is None:
            return
        self._sync()
        end = time.perf_counter()
        st.add("optimizer_s", end - st.optimizer_start)
        self._end_auto_step(end)

    def _end_auto_step(self, end: float) -> None:
        st = self._auto
        self._auto = None
        st.step_s = end - st.start
        if self.comm_hooked:
            stats = self._timer.take()
            st.comm_s, st.comm_bytes = stats.comm_s, stats.comm_bytes
            last_done = self._timer.last_done
            if st.backward_end is not None and last_done is not None:
                st.add("comm_wait_s", max(0.0, last_done - st.backward_end))
        st.optimizer_stepped = "optimizer_s" in st.parts or not self._optimizer_watched
        if self._profiler is not None:
            self._profiler.step_ended(st.index)
        self.steps += 1  # the index is taken; the row is written when the next step begins (a loss may follow)
        self._pending = st
        self._mark, self._mark_wall = end, time.time()

    def _flush_auto(self, end_open: bool) -> None:
        """Write the automatic step that ended; with ``end_open``, also end one still in progress (e.g. a
        forward without an optimizer step before an explicit step or the end)."""
        if end_open and self._auto is not None and self._auto.parts.get("forward_s"):
            self._end_auto_step(time.perf_counter())
        self._auto = None if end_open else self._auto
        st, self._pending = self._pending, None
        if st is not None and self.store is not None:
            self.steps -= 1  # _write counts it
            self._write(st, st.step_s)

    # ------------------------------------------------------------------ communication
    def _hook_comm(self, model: torch.nn.Module) -> None:
        """Time the model's collectives: a DDP communication hook, or FSDP2's custom all-gather/reduce-scatter."""
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        if self.world <= 1 and not (dist.is_available() and dist.is_initialized()):
            return
        how, why = None, None
        if isinstance(model, DistributedDataParallel):
            group = model.process_group
            try:
                model.register_comm_hook(group, self._timed_allreduce)
                how = "ddp comm hook (all-reduce + average per bucket)"
            except RuntimeError as err:
                why = f"DDP refused the communication hook ({err}); a hook registered by the script stays"
        else:
            fsdp2 = self._fsdp2_modules(model)
            if fsdp2:
                from ddlscope.strategies.fsdp import _TimedAllGather, _TimedReduceScatter

                for module in fsdp2:
                    module.set_custom_all_gather(_TimedAllGather(self))
                    module.set_custom_reduce_scatter(_TimedReduceScatter(self))
                how = "fsdp2 custom all-gather / reduce-scatter"
                if self.strategy_given is None:
                    self.strategy = "fsdp"
            else:
                why = (f"{type(model).__name__} is neither DistributedDataParallel nor an FSDP2 (fully_shard) module; "
                       f"comm_s, comm_bytes and comm_wait_s stay unknown")
        self.comm_hooked = how is not None
        if self.store is not None:
            self.store.add_event(self.run_id, self.rank, COMM_EVENT, hooked=self.comm_hooked, how=how, reason=why)
        else:
            self._comm_note = dict(hooked=self.comm_hooked, how=how, reason=why)

    @staticmethod
    def _fsdp2_modules(model: torch.nn.Module) -> list:
        try:
            from torch.distributed.fsdp import FSDPModule
        except ImportError:
            return []
        return [m for m in model.modules() if isinstance(m, FSDPModule)]

    @property
    def timer(self) -> CommTimer:
        """The communication timer (the FSDP2 timed collectives call ``timer.launch``)."""
        return self._timer

    def when_done(self, work, done):
        """Call ``done`` when ``work`` completes (now, when it ran synchronously); FSDP2's timed collectives use it."""
        if work is None:
            done()
        else:
            work.get_future().add_done_callback(done)
        return work

    def _timed_allreduce(self, group, bucket):  # no annotations: DDP checks them against the real classes
        """DDP communication hook: average one gradient bucket with an all-reduce and time it."""
        import torch.distributed as dist

        tensor = bucket.buffer()
        tensor.div_(dist.get_world_size(group))
        done = self._timer.launch(tensor.numel() * tensor.element_size())
        fut = dist.all_reduce(tensor, group=group, async_op=True).get_future()

        def finished(f):
            done()
            return f.value()[0]

        return fut.then(finished)

    # ------------------------------------------------------------------ rows
    def _write(self, st: StepRecord, step_s: float) -> None:
        samples = st.samples if st.samples is not None else self.batch_size
        if samples is None or isinstance(samples, bool) or int(samples) < 0:
            raise UserError(f"step {st.index}: samples = {samples!r}; allowed: rec.step(samples) with the samples of "
                            f"the step, or Recorder(batch_size=...)")
        samples = int(samples)
        if self.batch_size is None and samples:
            self.batch_size = samples
            self._update_run()
        loss = st.loss
        if isinstance(loss, torch.Tensor):
            loss = float(loss.detach())
        parts = st.parts
        comm_wait = parts.get("comm_wait_s")
        if comm_wait is None:
            comm_wait = 0.0 if self.world == 1 or self.comm_hooked else None
        if self.world == 1 and self.comm_hooked is None:
            st.comm_s, st.comm_bytes = 0.0, 0
        self._writer.add_step(self.run_id, self.rank, dict(
            step=st.index, wall_time=st.wall_time, samples=samples, data_load_s=parts.get("data_load_s"),
            forward_s=parts.get("forward_s"), backward_s=parts.get("backward_s"), comm_wait_s=comm_wait,
            bubble_s=0.0, optimizer_s=parts.get("optimizer_s"), averaging_s=0.0, comm_s=st.comm_s,
            comm_bytes=st.comm_bytes, step_s=step_s, loss=None if loss is None else float(loss),
            accuracy=None if st.accuracy is None else float(st.accuracy),
            samples_per_s=samples / step_s if step_s > 0 else None, warmup=int(st.index < self.warmup_steps),
            optimizer_stepped=int(st.optimizer_stepped), averaging_round=0,
        ))
        self.steps = st.index + 1


def _queue_autograd_callback(callback) -> None:
    """Run ``callback`` when the running backward pass ends (autograd's final callbacks, as DDP and FSDP
    use them); from inside such a callback, after the callbacks queued before."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def _raise_interrupted(signum, frame):
    raise RecorderInterrupted(f"stopped by {signal.Signals(signum).name}")


def _outcome(exc: BaseException | None) -> tuple[str, str]:
    """``(status, reason)`` of a recording that ended with ``exc``."""
    if isinstance(exc, RecorderInterrupted):
        return "interrupted", str(exc)
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted", "stopped by SIGINT (KeyboardInterrupt)"
    if isinstance(exc, SystemExit):
        return ("completed", None) if exc.code in (0, None) else ("failed", f"SystemExit({exc.code!r})")
    where = traceback.extract_tb(exc.__traceback__)[-1] if exc is not None and exc.__traceback__ else None
    at = f" (at {Path(where.filename).name}:{where.lineno})" if where else ""
    return "failed", f"{type(exc).__name__}: {exc}{at}"


def record(name: str | None = None, db: str | Path | None = None, **options: Any) -> Recorder:
    """A started :class:`Recorder` (same arguments); use it as a context manager or call ``finish()``.

    Raises:
        UserError: see :class:`Recorder`.
    """
    return Recorder(name, db, **options).start()
