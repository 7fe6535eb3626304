"""The one training loop. Every distribution model plugs in through its strategy.

Per step (micro-batch) it records, into the results store as it goes:
``data_load_s`` (time blocked waiting for the batch), ``forward_s`` (forward + loss),
``backward_s``, ``comm_wait_s`` (blocked on communication after compute), ``bubble_s`` (pipeline
stages idle waiting for a neighbour), ``optimizer_s`` (the strategy's step, including
hivemind's averaging), ``averaging_s`` (the part of it spent averaging with others), ``comm_s``
and ``comm_bytes`` (collectives in flight, overlapped or not), loss, training-batch accuracy,
samples and samples/s. ``step_s`` is the step's wall time. With gradient accumulation (GAS > 1) the optimizer runs on every GAS-th step, and the
loss is divided by GAS so that the accumulated gradient is the mean over GAS x batch_size samples.

Rows are queued to a writer thread that commits them every ``store_flush_interval_s`` (run
config, default 1 s), when training ends and on SIGTERM/SIGINT; a worker killed with SIGKILL
loses at most the steps of the last flush interval (half of it to read a group of steps from the
device, :class:`_StepRows`, half to commit them). A peer that a churn schedule kills (``kill_at_s``)
commits each step as it ends, so the store keeps every step it made. On a GPU the phase times are
CUDA events and the loss and hits stay on the device until a group of steps is read, so timing adds
no synchronization (:mod:`ddlscope.measure.timeline`, :mod:`ddlscope.measure.step_values`).

Stop conditions, whichever comes first: the sample budget (each peer's max steps =
budget / (peers x batch size), thesis 000), the target accuracy on the held-out split, the
wall-clock limit, or the strategy saying the swarm is gone.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import time
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.utils.data import DataLoader

from ddlscope.config import RunConfig
from ddlscope.measure.host import UNKNOWN_EVENT, HostSampler
from ddlscope.measure.memory import (cuda_runtime_bytes, peak_memory_bytes, peak_rss_bytes, reset_peak_rss,
                                     rss_bytes, rss_without_model_bytes)
from ddlscope.measure.step_values import ValuesInFlight
from ddlscope.measure.timeline import Stopwatch
from ddlscope.measure.torch_profile import StepProfiler, profile_dir, record_profile
from ddlscope.store.db import ResultsStore
from ddlscope.strategies import WorkerContext, strategy_class
from ddlscope.strategies.base import Strategy
from ddlscope.workloads.datasets import USER, default_data_root, open_dataset
from ddlscope.workloads.factories import build_loss, build_optimizer_from, is_import_string
from ddlscope.workloads.models import build_model
from ddlscope.workloads.preprocessing import eval_transform, train_transform
from ddlscope.workloads.step import optimizer_for


@dataclass
class Workload:
    """Model, optimizer and data of one worker, built from a :class:`RunConfig`."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    train_loader: DataLoader
    eval_loader: DataLoader
    device: torch.device


def build_workload(cfg: RunConfig, worker_index: int = 0, local_rank: int = 0,
                   build_model_fn=None) -> Workload:
    """Build the workload of one worker.

    ``build_model_fn(name, family, num_classes) -> nn.Module`` builds the network (default the
    zoo's :func:`~ddlscope.workloads.models.build_model`, which gives a user factory the dataset's
    channels and image size; a strategy's :meth:`Strategy.build_model` when it builds its own, e.g.
    remote experts). The optimizer is the config's (a user factory ``module:attribute`` is called as
    ``factory(params, lr=learning_rate)``). A user dataset factory's items are used as they come (no
    preprocessing).

    All workers initialise the model from the same seed (``cfg.seed``); each data-parallel
    worker shuffles its data with its own seed (``cfg.seed + worker_index``) so peers see
    different batches, while pipeline stages share one stream (they process the same batch).

    Raises:
        UserError / DatasetError: unknown model or dataset, missing or corrupt files.
    """
    root = cfg.data_root or default_data_root()
    train_set, spec = open_dataset(cfg.dataset, root, "train")
    eval_set, _ = open_dataset(cfg.dataset, root, "test")
    if spec.format != USER:  # a user factory's items come preprocessed
        train_set = Transformed(train_set, train_transform(spec, augment=cfg.augment))
        eval_set = Transformed(eval_set, eval_transform(spec))
    device = torch.device(f"cuda:{local_rank}") if cfg.device == "cuda" else torch.device("cpu")
    torch.manual_seed(cfg.seed)
    if build_model_fn is None:
        model = build_model(cfg.model, spec.family, num_classes=spec.num_classes, input_shape=spec.image_shape)
    else:
        model = build_model_fn(cfg.model, spec.family, num_classes=spec.num_classes)
    model = model.to(device)
    optimizer = build_run_optimizer(cfg, model.parameters())
    gen = torch.Generator().manual_seed(cfg.seed + cfg.data_rank(worker_index))
    loader_kw = dict(num_workers=cfg.loader_workers, persistent_workers=cfg.loader_workers > 0,
                     pin_memory=device.type == "cuda")
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size, shuffle=True, drop_last=True, generator=gen,
                              **loader_kw)
    if len(train_loader) == 0:
        from ddlscope.errors import UserError

        raise UserError(f"batch_size = {cfg.batch_size} is larger than the training split ({len(train_set)} samples) "
                        f"of dataset {cfg.dataset!r}; allowed: <= {len(train_set)}")
    eval_loader = DataLoader(eval_set, batch_size=max(cfg.batch_size, 64), shuffle=False, num_workers=0)
    return Workload(model, optimizer, train_loader, eval_loader, device)


def build_run_optimizer(cfg: RunConfig, params) -> torch.optim.Optimizer:
    """The run's optimizer: a built-in one (:func:`~ddlscope.workloads.step.optimizer_for`) or a user factory
    ``module:attribute`` called as ``factory(params, lr=cfg.learning_rate)``.

    Raises:
        UserError: a user factory that cannot be imported, fails, or returns no optimizer.
    """
    if is_import_string(cfg.optimizer):
        return build_optimizer_from(cfg.optimizer, params, cfg.learning_rate)
    return optimizer_for(cfg, params)


class Transformed(torch.utils.data.Dataset):
    """A dataset of ``(uint8 CHW image, label)`` with a preprocessing function applied to the image.

    The function runs in the DataLoader's worker processes, where decoding runs too.
    """

    def __init__(self, base: torch.utils.data.Dataset, transform):
        self.base, self.transform = base, transform

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        image, label = self.base[i]
        return self.transform(image), label


def batches_forever(loader: DataLoader) -> Iterator:
    """Batches of the loader, epoch after epoch."""
    for _ in itertools.count():
        yield from loader


def run_worker(cfg: RunConfig, ctx: WorkerContext, store: ResultsStore) -> str:
    """Train one worker to its stop condition, storing every measurement as it goes.

    Returns:
        why training stopped: ``"sample_budget"``, ``"target_accuracy"``, ``"time_limit"``, or the
        strategy's ``stop_reason`` (``"strategy"`` when it gives none).

    Raises:
        whatever the workload or strategy raises; the caller records the failure. Measurements
        stored before the error stay in the store (the steps queued for writing are committed first).
        ``torch.OutOfMemoryError`` becomes a one-line UserError (needed and free memory,
        :func:`ddlscope.profiling.profile.out_of_memory_message`).
    """
    run_id, wi = ctx.run_id, ctx.worker_index
    torch.set_num_threads(max(1, len(ctx.cores)))
    strategy = strategy_class(cfg.strategy)(cfg, ctx)
    profiler = StepProfiler(cfg.profile_steps, profile_dir(store.path, run_id), wi, cfg.device)
    try:
        own_builder = type(strategy).build_model is not Strategy.build_model  # e.g. dmoe's remote experts
        wl = build_workload(cfg, wi, ctx.local_rank, strategy.build_model if own_builder else None)
        rss_before_model = rss_without_model_bytes(wl.model) if cfg.device == "cpu" else None  # the runtime part
        model = strategy.setup(wl.model, wl.optimizer)
        sampler = HostSampler(store.host_sample_writer(run_id, wi), cfg.host_sample_interval_s,
                              network=strategy.uses_network,
                              note=lambda **why: store.add_event(run_id, wi, UNKNOWN_EVENT, **why))
        with sampler:
            if strategy.assists_only:  # e.g. an auxiliary hivemind peer: it averages, it does not train
                store.upsert_worker(run_id, wi, status="training", train_start_time=time.time())
                reason = strategy.assist()
                store.upsert_worker(run_id, wi, train_end_time=time.time())
                return reason
            return _train(cfg, ctx, store, wl, model, strategy, profiler, rss_before_model)
    except BaseException as exc:
        # when it failed, before closing connections: the peers it takes down fail after it
        store.upsert_worker(run_id, wi, failed_at=time.time())
        if isinstance(exc, torch.OutOfMemoryError):  # one line for the run's failure reason, not a traceback
            from ddlscope.errors import UserError
            from ddlscope.profiling.profile import out_of_memory_message

            device = torch.device(f"cuda:{ctx.local_rank}" if cfg.device == "cuda" else "cpu")
            raise UserError(f"{out_of_memory_message(exc, device)} training {cfg.model} at batch size "
                            f"{cfg.batch_size}; try a smaller batch size, gradient accumulation, or a distribution "
                            "model that splits the model (ddlscope recommend)") from None
        raise
    finally:
        strategy.close()
        # a run that stopped early keeps the trace of the profiled steps it got to (done already when it
        # completed); the error that stopped it is what is reported, not one writing the trace
        with contextlib.suppress(Exception):
            record_profile(store, run_id, wi, profiler)


class _EvalClock:
    """Runs held-out evaluations and keeps their time out of the training time."""

    def __init__(self, store, run_id, worker_index, model, wl: Workload, strategy, max_samples, train_start: float):
        self.store, self.run_id, self.wi, self.model, self.wl = store, run_id, worker_index, model, wl
        self.strategy = strategy
        self.max_samples, self.train_start = max_samples, train_start
        self.eval_s, self.last_eval_step = 0.0, None

    def train_time_s(self) -> float:
        return time.time() - self.train_start - self.eval_s

    def evaluate(self, step: int) -> float:
        t0 = time.perf_counter()
        train_time_s = self.train_time_s()
        acc, loss, n = self.strategy.evaluate(self.model, self.wl.eval_loader, self.wl.device, self.max_samples)
        self.store.add_eval(self.run_id, self.wi, step, train_time_s, acc, loss, n)
        self.eval_s += time.perf_counter() - t0
        self.last_eval_step = step
        return acc


def _train(cfg, ctx, store, wl: Workload, model, strategy, profiler: StepProfiler,
           rss_before_model: int | None = None) -> str:
    """Train to the stop condition; returns why it stopped.

    The steps' rows go through a :class:`~ddlscope.store.db.BatchedWriter` (committed every
    ``cfg.store_flush_interval_s``), which is closed, everything committed, before the worker's end
    is recorded, and also when an error or SIGTERM/SIGINT (:class:`~ddlscope.train.worker.Interrupted`)
    stops training; a SIGKILL loses at most the steps of the last flush interval. A step's phases
    are :class:`~ddlscope.measure.timeline.Lap` s (on a GPU, CUDA events) and its loss and hits stay on
    the device; both are read for a group of steps once the device is past them (:class:`_StepRows`),
    so neither the timer nor the values make the training wait for the device.

    On CPU the ``memory`` event holds the resident set without the model before the distribution
    model set it up (``rss_before_model``, the runtime part,
    :func:`~ddlscope.measure.memory.rss_without_model_bytes`), the resident set at the start of
    training, and its peak during training.
    """
    run_id, wi, gas = ctx.run_id, ctx.worker_index, cfg.gradient_accumulation_steps
    max_steps = cfg.max_steps_per_peer()
    loss_fn = build_loss(cfg.loss)
    watch = Stopwatch(wl.device)
    batches = batches_forever(wl.train_loader)
    train_start = time.time()
    store.upsert_worker(run_id, wi, status="training", train_start_time=train_start)
    model.train()
    train_rss = rss_bytes() if wl.device.type == "cpu" else None
    rss_peak_reset = train_rss is not None and reset_peak_rss()  # training-phase peak, see measure/memory.py
    cuda_runtime = cuda_runtime_bytes(wl.device)  # the CUDA context and libraries: the runtime part of the peak
    if cuda_runtime is not None:
        torch.cuda.reset_peak_memory_stats(wl.device)  # the allocator's training-phase peak
    clock = _EvalClock(store, run_id, wi, model, wl, strategy, cfg.eval_max_samples, train_start)
    reason, steps_done = "sample_budget", 0
    first_step = store.step_counts(run_id).get(wi, 0)  # a peer that rejoins a swarm continues its count and budget
    # half an interval to read a group of steps from the device, half to commit it: a SIGKILL loses at
    # most one flush interval of steps
    writer = ctx.writer = store.batched_writer(cfg.store_flush_interval_s / 2)
    # a peer that a churn schedule kills commits every step at once, so that the kill loses none of them
    durable = any(e.peer == wi and e.kill_at_s is not None for e in
                  (cfg.distribution_model.churn(cfg) if cfg.distribution_model.churn else []))
    rows = _StepRows(writer, run_id, wi, 1 if durable else VALUES_GROUP_STEPS, cfg.store_flush_interval_s / 2)
    try:
        for step in itertools.count(first_step):
            if max_steps is not None and step >= max_steps:
                break
            if cfg.time_limit_s is not None and strategy.agree_to_stop(clock.train_time_s() >= cfg.time_limit_s):
                reason = "time_limit"
                break
            if strategy.should_stop():
                reason = getattr(strategy, "stop_reason", None) or "strategy"
                break
            profiler.step_started(step)  # before the step's clock: starting the profiler is not the step's time
            wall = time.time()
            watch.start()
            x, y = next(batches)
            x, y = x.to(wl.device, non_blocking=True), y.to(wl.device, non_blocking=True)
            data_load = watch.mark()
            stepped = (step + 1) % gas == 0
            res = strategy.forward_backward(model, x, y, loss_fn, 1.0 / gas, sync=stepped)
            compute = watch.mark()
            outcome = None
            if stepped:
                outcome = strategy.step(res.samples * gas)
                strategy.zero_grad()
            optimizer = watch.mark()
            profiler.step_ended(step)
            rows.add(_step_row(cfg, step, wall, res, outcome, stepped), res, (data_load, compute, optimizer))
            if durable:
                rows.drain()
            if outcome is not None and outcome.averaging_round:
                writer.add_event(run_id, wi, "averaging_round", step=step, group_size=outcome.group_size,
                                 succeeded=outcome.succeeded, averaging_s=outcome.averaging_s,
                                 epoch=outcome.global_epoch, param_checksum=outcome.param_checksum)
            if durable:
                writer.flush()
            steps_done = step + 1
            if cfg.eval_every_steps and (step + 1) % cfg.eval_every_steps == 0:
                acc = clock.evaluate(step)
                if cfg.target_accuracy is not None and acc >= cfg.target_accuracy:
                    reason = "target_accuracy"
                    break
        rows.drain()
        ctx.writer = None
        writer.close()
    except BaseException:
        ctx.writer = None
        with contextlib.suppress(Exception):  # keep the completed steps; the error that stopped training is reported
            rows.drain()
        with contextlib.suppress(Exception):
            writer.close()  # waits for the commit also when a signal came during the close above
        raise
    store.upsert_worker(run_id, wi, train_end_time=time.time(), eval_s=clock.eval_s,
                        peak_memory_bytes=peak_memory_bytes(wl.device))
    record_profile(store, run_id, wi, profiler)  # writes the trace, outside the training time
    if rss_peak_reset:
        store.add_event(run_id, wi, "memory", rss_at_train_start_bytes=train_rss,
                        train_peak_rss_bytes=peak_rss_bytes(),
                        rss_before_model_bytes=rss_before_model)
    if cuda_runtime is not None:
        store.add_event(run_id, wi, "memory", allocator_peak_bytes=int(torch.cuda.max_memory_allocated(wl.device)),
                        runtime_bytes=cuda_runtime)
    if strategy.details():
        store.add_event(run_id, wi, "strategy_details", **strategy.details())
    if cfg.final_eval and steps_done and clock.last_eval_step != steps_done - 1:  # outside the training time
        clock.evaluate(steps_done - 1)
    return reason


def _step_row(cfg, step: int, wall: float, res, outcome, stepped: bool) -> dict:
    """The columns of a step's row known when it ends (the times, loss and accuracy come from the
    device once the next step has run, :func:`_write_step`)."""
    return dict(
        step=step, wall_time=wall, samples=res.samples, comm_wait_s=res.comm_wait_s, bubble_s=res.bubble_s,
        averaging_s=outcome.averaging_s if outcome else 0.0,
        comm_s=res.comm_s + (outcome.comm_s if outcome else 0.0),
        comm_bytes=res.comm_bytes + (outcome.comm_bytes if outcome else 0),
        warmup=int(step < cfg.warmup_steps), optimizer_stepped=int(stepped),
        global_epoch=outcome.global_epoch if outcome else None,
        averaging_round=int(outcome.averaging_round) if outcome else 0,
        averaging_group_size=outcome.group_size if outcome else None,
        averaging_succeeded=None if outcome is None or outcome.succeeded is None else int(outcome.succeeded),
        background_cpu_s=outcome.background_cpu_s if outcome else None,
        samples_discarded=outcome.samples_discarded if outcome else 0,
    )


#: steps whose loss and hits are read from the device together (:mod:`ddlscope.measure.step_values`)
VALUES_GROUP_STEPS = 8
#: groups of steps launched and not read yet, beyond which the loop waits for the oldest
MAX_GROUPS_IN_FLIGHT = 2


class _StepRows:
    """The steps' rows on their way to the store: their laps and values read from the device in groups.

    A step's row is queued to the writer once the device has passed its laps and its loss and hits
    were copied to the host, read for ``group_steps`` steps at once
    (:class:`~ddlscope.measure.step_values.ValuesInFlight`): a group is launched when it holds
    ``group_steps`` steps or its first step ended ``group_s`` seconds ago, and read without waiting once
    the device reached it; only when more than :data:`MAX_GROUPS_IN_FLIGHT` groups are in flight does
    the loop wait for the oldest. So a step's row reaches the writer at most ``group_s`` seconds
    (plus the device's lag) after the step; the loop gives it half a flush interval, and the writer
    commits every half interval.
    """

    def __init__(self, writer, run_id: str, wi: int, group_steps: int, group_s: float):
        self.writer, self.run_id, self.wi = writer, run_id, wi
        self.group_steps, self.group_s = group_steps, group_s
        self._open: list[tuple] = []
        self._opened_at = 0.0
        self._in_flight: collections.deque = collections.deque()

    def add(self, row: dict, res, laps: tuple) -> None:
        """Queue one step: its row's known columns, its :class:`~ddlscope.strategies.base.BatchResult`
        and its ``(data_load, compute, optimizer)`` laps; writes the groups the device is done with."""
        if not self._open:
            self._opened_at = time.monotonic()
        self._open.append((row, res, laps))
        if len(self._open) >= self.group_steps or time.monotonic() - self._opened_at >= self.group_s:
            self._launch()
        self._write(wait=False)

    def drain(self) -> None:
        """Write every queued step, waiting for the device where it is not done yet."""
        if self._open:
            self._launch()
        self._write(wait=True)

    def _launch(self) -> None:
        entries, self._open = self._open, []
        values = [res.device_values for _, res, _ in entries if res.device_values is not None]
        self._in_flight.append((ValuesInFlight(values) if values else None, entries))

    def _write(self, wait: bool) -> None:
        while self._in_flight:
            flight, entries = self._in_flight[0]
            done = (flight is None or flight.reached()) and entries[-1][2][-1].reached()
            if not (wait or done or len(self._in_flight) > MAX_GROUPS_IN_FLIGHT):
                return
            self._in_flight.popleft()
            values = iter(flight.read() if flight is not None else ())
            for row, res, laps in entries:
                if res.device_values is not None:
                    res.take_values(next(values))
                _write_step(self.writer, self.run_id, self.wi, row, res, *laps)


def _write_step(writer, run_id: str, wi: int, row: dict, res, data_load, compute, optimizer) -> None:
    """Read a step's laps (seconds; on a GPU waits for the last one), loss and hits, and queue its row."""
    res.resolve()
    data_load_s, compute_s, optimizer_s = data_load.seconds(), compute.seconds(), optimizer.seconds()
    step_s = data_load_s + compute_s + optimizer_s
    writer.add_step(run_id, wi, dict(
        row, loss=res.loss, accuracy=None if res.correct is None else res.correct / res.samples, data_load_s=data_load_s, forward_s=res.forward_s, backward_s=res.backward_s, optimizer_s=optimizer_s,
        step_s=step_s, samples_per_s=res.samples / step_s if step_s > 0 else None))
