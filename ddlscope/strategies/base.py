"""The strategy interface: what a distribution model plugs into the one training loop.

The loop owns data loading, the step timeline and the store; a strategy owns how a batch turns
into gradients and what happens to them: a local optimizer step (``single``), an all-reduce
overlapping the backward pass (``ddp``), sharded parameters gathered per unit (``fsdp``), a
pipeline schedule over stages (``gpipe``, ``1f1b``), an averaging round with other peers
(``collaborative``). The loop never asks which strategy it runs; it calls these methods in
this order::

    model = strategy.build_model(name, family, num_classes)       # once, before the optimizer
    model = strategy.setup(model, optimizer)                      # once
    for each step:  result = strategy.forward_backward(model, x, y, loss_fn, loss_scale, sync)
                    every GAS steps: outcome = strategy.step(samples); strategy.zero_grad()
    strategy.evaluate(model, loader, device, max_samples)         # held-out accuracy, when asked
    strategy.close()                                              # always, also on errors
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from ddlscope.measure.step_values import DeviceValues, ValuesInFlight
from ddlscope.measure.timeline import Lap, Stopwatch
from ddlscope.workloads.step import correct_in_samples

if TYPE_CHECKING:
    from ddlscope.config import RunConfig


@dataclass
class WorkerContext:
    """Where a worker runs: its index among the run's workers, its cores, how to find its peers.

    Attributes:
        run_id: the run's id in the results store (also the swarm's name for hivemind).
        worker_index: 0 .. peers-1; worker 0 bootstraps the swarm.
        num_workers: workers expected in the run.
        cores: CPU core ids the worker is pinned to.
        initial_peers: multiaddrs of peers already in the swarm (models launched as a swarm only).
        announce: callback the strategy calls with its own multiaddrs once it listens.
        listen_maddrs: multiaddrs to listen on (swarm models); default loopback, any free port.
        local_rank: the worker's index on its host (selects ``cuda:<local_rank>``).
        store: the results store (:class:`~ddlscope.store.db.ResultsStore`) for strategies that
            record measurements of their own (dmoe's expert calls); None outside a run.
        stop_requested: set once the worker was asked to stop (SIGTERM/SIGINT); a strategy whose
            library may swallow the stop (hivemind catches it around averaging rounds) raises
            :class:`StopRequested` at its next step (:meth:`Strategy.check_stop`). None outside a run.
        writer: while the loop trains, its :class:`~ddlscope.store.db.BatchedWriter`: a strategy's
            per-step rows go there, committed off the training thread with the steps'; None otherwise.
    """

    run_id: str
    worker_index: int
    num_workers: int
    cores: list[int]
    initial_peers: list[str]
    announce: "Callable[[list[str]], None] | None" = None
    listen_maddrs: list[str] | None = None
    local_rank: int = 0
    store: Any = None
    stop_requested: "threading.Event | None" = None
    writer: Any = None


class StopRequested(BaseException):
    """Raised at a step boundary when the worker was asked to stop but the signal's own exception was
    swallowed on the way (the worker records ``interrupted``)."""


@dataclass
class BatchResult:
    """What forward and backward of one batch did on this worker (times in seconds).

    The parts are disjoint: ``forward_s + backward_s + comm_wait_s + bubble_s`` is the wall
    time of :meth:`Strategy.forward_backward` up to the strategy's own bookkeeping.

    Attributes:
        samples: samples in the batch (pipelines: the whole batch, split into micro-batches).
        loss: mean loss over the batch; None on a pipeline stage that does not compute it.
        correct: correctly classified samples; None where the worker sees no logits.
        forward_s: forward compute (including the loss).
        backward_s: backward compute, without the communication that it waited for.
        comm_s: seconds during which collectives/transfers were in flight (union), overlapped
            with compute or not.
        comm_wait_s: seconds the worker was blocked on communication after its compute was done
            (ddp/fsdp: the tail after the last gradient bucket was launched; pipelines: the
            transfer time of the stage's sends and receives).
        bubble_s: pipelines: seconds idle waiting for the neighbouring stage (the schedule's bubble).
        comm_bytes: payload bytes this worker handed to collectives/transfers.
        pending: laps timed on the device and not read yet (CUDA events, see
            :mod:`ddlscope.measure.timeline`): ``{"forward_s": Lap, ...}``; :meth:`resolve` adds
            their seconds to those fields. Code that reads the times calls :meth:`resolve` first.
        device_values: the loss and predictions left on the device
            (:class:`~ddlscope.measure.step_values.DeviceValues`), so that reading them neither makes
            the step wait for the device between forward and backward nor costs the host a
            dozen launches per step: the training loop reads them for a group of steps at once
            (:class:`~ddlscope.measure.step_values.ValuesInFlight`, :meth:`take_values`);
            :meth:`resolve` reads them for this step alone.
        per_position: the logits were per position (``[batch, T, classes]``): ``correct`` is then
            ``samples`` times the share of scored positions predicted right.
    """

    samples: int
    loss: float | None
    correct: int | None
    forward_s: float
    backward_s: float
    comm_s: float = 0.0
    comm_wait_s: float = 0.0
    bubble_s: float = 0.0
    comm_bytes: int = 0
    pending: dict[str, Lap] = field(default_factory=dict, repr=False)
    device_values: DeviceValues | None = field(default=None, repr=False)
    per_position: bool = False

    def resolve(self) -> "BatchResult":
        """Add the seconds of the :attr:`pending` laps to their fields and read this step's loss and
        hits (:attr:`device_values`); on a GPU waits for the last of them to be reached (nothing to
        wait for once the device has passed it). Returns self."""
        for name, lap in self.pending.items():
            setattr(self, name, getattr(self, name) + lap.seconds())
        self.pending = {}
        if self.device_values is not None:
            self.take_values(ValuesInFlight([self.device_values]).read()[0])
        return self

    def take_values(self, values: tuple[float, float, float]) -> None:
        """Set ``loss`` and ``correct`` from this step's ``(loss, correct, scored)`` as read by a
        :class:`~ddlscope.measure.step_values.ValuesInFlight`; the device values are then dropped."""
        loss, correct, scored = values
        self.loss = loss
        self.correct = correct_in_samples(int(correct), int(scored), self.per_position, self.samples)
        self.device_values = None


@dataclass
class StepOutcome:
    """What one optimizer step did besides updating the parameters.

    Attributes:
        averaging_s: seconds of this step spent averaging with other workers (0 if none).
        averaging_round: an averaging round (global epoch / all-reduce) took place in this step.
        group_size: workers that the round gathered (1 = averaged alone), None if no round.
        succeeded: whether the round succeeded, None if no round.
        global_epoch: the swarm's epoch after the step (collaborative), else None.
        background_cpu_s: CPU seconds of the worker's background work (other threads, child
            processes: hivemind's) since the previous step's end, None if not measured.
        comm_s / comm_bytes: collectives the step itself ran (diloco's outer all-reduce): seconds
            in flight and payload bytes, added to the step's :class:`BatchResult` figures.
        param_checksum: after a round, the sum of the peer's parameters (collaborative; equal
            across peers whose parameters agree), else None.
        samples_discarded: samples the step computed but did not train on: hivemind found the
            peer out of sync with the swarm and loaded the swarm's state instead of accumulating
            the step's gradients (collaborative: all of the step's samples, else 0).
    """

    averaging_s: float = 0.0
    averaging_round: bool = False
    group_size: int | None = None
    succeeded: bool | None = None
    global_epoch: int | None = None
    background_cpu_s: float | None = None
    comm_s: float = 0.0
    comm_bytes: int = 0
    param_checksum: float | None = None
    samples_discarded: int = 0


class Strategy:
    """Base class of every distribution model. Subclasses set :attr:`name`.

    Args:
        cfg: the validated run config.
        ctx: where this worker runs.
    """

    name = "base"
    uses_network = False  # the host sampler counts TCP bytes when True

    def __init__(self, cfg: "RunConfig", ctx: WorkerContext):
        self.cfg = cfg
        self.ctx = ctx
        self.optimizer: torch.optim.Optimizer | None = None

    @classmethod
    def preflight(cls, cfg: "RunConfig") -> None:
        """Checks of a run config that need torch or the network, run before any worker of a
        torchrun model starts (:func:`ddlscope.launch.torchrun.preflight`; the torch-free checks of
        every model are the registry's ``check_config``). None by default.

        Raises:
            UserError: naming what does not fit and what is allowed.
        """

    def build_model(self, name: str, family: str, num_classes: int) -> torch.nn.Module:
        """The network this worker trains, before the optimizer is made from its parameters.

        Default: the zoo's :func:`~ddlscope.workloads.models.build_model`. A strategy whose network
        depends on its own settings or connections (dmoe: mixture-of-experts layers whose experts
        live on servers) overrides it.
        """
        from ddlscope.workloads.models import build_model

        return build_model(name, family, num_classes=num_classes)

    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.nn.Module:
        """Wrap the model and optimizer; return the module the loop trains."""
        self.optimizer = optimizer
        return model

    def gradient_sync(self, model: torch.nn.Module, sync: bool) -> contextlib.AbstractContextManager:
        """Context for a backward pass; ``sync=False`` during gradient accumulation (no communication)."""
        return contextlib.nullcontext()

    def forward_backward(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn,
                         loss_scale: float = 1.0, sync: bool = True) -> BatchResult:
        """Forward ``x`` (shape ``[batch, C, H, W]``, or ``[batch, T]`` byte ids), loss against ``y``
        (``[batch]``, or ``[batch, T]`` per-position targets), backward.

        Args:
            loss_fn: ``(logits [batch, classes] or [batch, T, classes], y) -> scalar mean loss``.
            loss_scale: factor on the loss before backward (``1 / GAS`` when accumulating).
            sync: False while accumulating gradients without an optimizer step.

        ``correct`` is in samples' worth (:func:`~ddlscope.workloads.step.correct_samples`), so
        ``correct / samples`` is the accuracy also for per-position targets; both it and ``loss``
        are read by :meth:`BatchResult.resolve` (in the training loop: with a group of steps, once the
        device is past them).
        """
        watch = Stopwatch(x.device)
        with self.gradient_sync(model, sync):
            logits = model(x)
            loss = loss_fn(logits, y)
            values = DeviceValues.of(loss, logits, y)  # read later, with other steps' (no sync here)
            forward = watch.mark()
            (loss * loss_scale if loss_scale != 1.0 else loss).backward()
            backward = watch.mark()  # on a GPU: not waited for here (the caller resolves it)
        return BatchResult(len(y), None, None, 0.0, 0.0, pending=dict(forward_s=forward, backward_s=backward),
                           device_values=values, per_position=logits.dim() > 2)

    def step(self, samples: int) -> StepOutcome:
        """Apply the gradients accumulated over ``samples`` samples (``batch_size x GAS``)."""
        raise NotImplementedError

    def evaluate(self, model: torch.nn.Module, loader, device: torch.device, max_samples: int | None = None
                 ) -> tuple[float, float, int]:
        """Held-out ``(accuracy 0..1, mean loss, samples)``; every worker of a run calls it at the same step."""
        from ddlscope.train.evaluation import evaluate

        return evaluate(model, loader, device, max_samples)

    def details(self) -> dict:
        """What the strategy decided at run time (e.g. pipeline stage boundaries), stored with the run."""
        return {}

    def agree_to_stop(self, stop: bool) -> bool:
        """True if any worker wants to stop (workers that train in lockstep must stop at the same step)."""
        return stop

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def check_stop(self) -> None:
        """Raise :class:`StopRequested` if the worker was asked to stop (see :attr:`WorkerContext.stop_requested`)."""
        if self.ctx.stop_requested is not None and self.ctx.stop_requested.is_set():
            raise StopRequested("stop requested")

    @property
    def assists_only(self) -> bool:
        """True when this worker trains on no batch and only helps the others (hivemind's auxiliary
        peers); the loop then calls :meth:`assist` instead of training."""
        return False

    def assist(self) -> str:
        """Help the other workers until they are done (see :attr:`assists_only`); returns why it stopped.

        Raises:
            NotImplementedError: the strategy has no assisting role.
        """
        raise NotImplementedError(f"{type(self).__name__} has no assisting role")

    def should_stop(self) -> bool:
        """True when the strategy cannot go on (e.g. the swarm is gone); the loop then ends."""
        return False

    def close(self) -> None:
        """Release processes, sockets and daemons. Called once, also after errors."""
