"""``collaborative``: Hivemind parameter/gradient averaging toward a target batch size.

Each peer wraps its local optimizer in ``hivemind.Optimizer`` (hivemind 1.1.12). Peers
accumulate gradients locally; when the swarm together has processed ``target_batch_size``
samples, a *global epoch* happens: peers form groups during ``matchmaking_time_s`` and average
their gradients with an all-reduce (or, with ``use_local_updates``, step locally every batch and
average parameters instead), then step the optimizer. Ryabinin 2023 (seed 003), DeDLOC; thesis
000 ch. 2-5 for the settings used here.

What is measured per step, beyond the loop's timings:

- ``averaging_s``: time inside hivemind's global-epoch update (matchmaking + all-reduce + state
  averaging) minus the local optimizer's own step time;
- whether a round happened, how many peers it gathered and whether it succeeded. hivemind
  reports those only in its status log, so a log handler reads them while the step runs;
- ``background_cpu_s``: CPU seconds that hivemind's processes and threads (DHT, ``p2pd``,
  averagers, progress tracker) used since the previous step ended
  (:func:`ddlscope.measure.host.background_cpu_s`, read through a :class:`~ddlscope.measure.host.BackgroundCpu`
  that lists the processes every 2 s, not every step). On a peer whose cores training keeps busy
  this is time taken from training: the step's compute runs slower by about as much.

Before training, every peer that starts with the run announces itself in the DHT and waits until
all of them are there (or fails after ``join_timeout_s``), so that no peer trains alone by
accident. A peer that joins later (``collaborative.churn``: ``join_at_s``, ``rejoin_at_s``) joins
the running swarm through the peers alive then; hivemind's optimizer sees that it is behind the
swarm's global epoch and loads the swarm's parameters and optimizer state
(``load_state_from_peers``), which is timed and stored as a ``state_loaded`` event. A peer asked
to leave (SIGUSR1 from the launcher, ``leave_at_s``) ends at its next step, as a finished one does;
a state download it is waiting in is cut short (:class:`LeaveRequest`), an averaging round is not.

An **auxiliary peer** (``collaborative.auxiliary_peers``; hivemind's ``auxiliary=True``) trains on
no batch: it calls the optimizer's step every :data:`AUX_POLL_S` seconds, which joins the swarm's
averaging rounds as a reducer with no gradients of its own (its upload and CPU help the trainers),
records each round it took part in as an ``averaging_round`` event, and stops once every training
peer expected at the end is done.

When a peer finishes, it says so in the DHT. A background thread of every other peer watches
that record; once all other peers expected at the end are done (those the churn schedule does not
take away), it cancels the averaging round this peer may be waiting in, instead of letting it
hang until ``averaging_timeout_s`` for peers that have left.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import signal
import tempfile
import threading
import time
from typing import Callable

import torch

from ddlscope.measure.host import BackgroundCpu
from ddlscope.strategies.base import StepOutcome, Strategy, WorkerContext

_GRAD_OK = re.compile(r"Averaged gradients with (\d+) peers")
_STATE_OK = re.compile(r"Averaged parameters with (\d+) peers")
_ALONE = ("Skipped averaging: there are no other peers", "Skipping pre-scheduled averaging round: there are no other peers")
_FAILED = ("Averaging gradients failed", "Averaging failed with")
_EPOCH = re.compile(r"Transitioning to epoch (\d+)")
_PRESCHEDULED = re.compile(r"Pre-scheduling (gradient|state) averaging round in ([0-9.]+) sec")
_PARTIAL = re.compile(r"^(Reducer|Averaging): received ([0-9.]+)% (?:of input tensors|results)")
_JOIN_TIMEOUT = re.compile(r"potential leader \S+ did not respond within ([0-9.]+)")
SHUTDOWN_S = 5.0
AUX_POLL_S = 0.2
"""Seconds between two optimizer steps of an auxiliary peer (each checks whether a round is due)."""
STOP_SHUTDOWN_S = 1.0
"""Seconds hivemind's shutdown may take when the peer was asked to stop (SIGTERM/SIGINT)."""
WATCH_S = 0.5
"""Seconds between two checks of the swarm watcher for a stop request or a dead hivemind process (local, cheap)."""
SWARM_POLL_S = 2.0
"""Seconds between two DHT reads of the watcher for finished peers: each read costs the DHT processes and
``p2pd`` of both peers CPU (0.004-0.011 CPU-s per second of a 2-peer swarm read at 2 Hz, measured on the
2-core development machine), taken from training on one-core peers; a finished swarm is noticed up to this late."""


class LeftDuringCall(KeyboardInterrupt):
    """Raised in the main thread by the leave signal to cut short a hivemind call a leaving peer has no
    use for. A ``KeyboardInterrupt`` because hivemind 1.1.12's ``Optimizer.load_state_from_peers``
    retries on every other exception (read in its source)."""


class LeaveRequest:
    """The launcher's request that this peer leave the swarm (SIGUSR1, ``collaborative.churn`` ``leave_at_s``).

    A peer asked to leave ends at its next step. A hivemind call it has no use for once it leaves (the
    download of the swarm's state, which can wait up to ``load_state_timeout_s``: 600 s by hivemind's
    default held a leave that long in CI) runs through :meth:`unless_leaving`, which the signal cuts short.
    """

    def __init__(self) -> None:
        self._event = threading.Event()
        self._cuttable = False

    def install(self) -> None:
        """Make SIGUSR1 request the leave (main thread only, as Python's signal handlers are)."""
        signal.signal(signal.SIGUSR1, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self._event.set()
        if self._cuttable:
            self._cuttable = False
            raise LeftDuringCall()

    def set(self) -> None:
        """Request the leave from this process (what the signal does, without cutting a call short)."""
        self._event.set()

    def is_set(self) -> bool:
        """True once the leave was requested."""
        return self._event.is_set()

    def unless_leaving(self, call: Callable, *args, **kwargs) -> tuple[object, bool]:
        """``(call(*args, **kwargs), False)``, or ``(None, True)`` when the leave was requested before the
        call or while it ran (then the call was cut short where it waited: the signal's handler raises
        :class:`LeftDuringCall` into it). Only a call on the main thread, where Python runs signal
        handlers, can be cut short; on another thread it runs to its end. Exceptions of ``call`` propagate."""
        if self._event.is_set():
            return None, True
        try:  # two levels: a signal that lands as the inner one ends is still caught by the outer one
            try:
                self._cuttable = threading.current_thread() is threading.main_thread()
                if self._event.is_set():  # the signal came between the check and now
                    return None, True
                return call(*args, **kwargs), False
            finally:
                self._cuttable = False
        except LeftDuringCall:
            return None, True


def _all_finite(tensors) -> bool:
    """Whether every element of every tensor in ``tensors`` is finite (one norm per tensor, one read)."""
    tensors = [t for t in tensors if t.is_floating_point() and t.numel()]
    return not tensors or bool(torch.isfinite(torch.stack(torch._foreach_norm(tensors))).all())


def skip_non_finite_steps(optimizer: torch.optim.Optimizer, on_skip: Callable[[], None]) -> None:
    """Make ``optimizer`` skip a step whose gradients are not all finite, and call ``on_skip`` then.

    hivemind 1.1.12's all-reduce divides each part of the tensors by the total weight of the peers
    that sent it (``TensorPartReducer``). When every sender of a part failed, or those left weighed 0
    (a trainer that joins a round with no samples accumulated), that weight is 0 and the part
    averages to NaN. The optimizer step would then write NaN into every parameter it touches.
    Instead, the step is skipped and the parameters keep their values, as a ``GradScaler`` skips a
    step with infinite gradients: all gradients are set to None for the step (torch's optimizers
    skip such parameters). The check is one norm per tensor and one read; the inner step of
    hivemind's gradient averaging runs once per global epoch.
    """
    def check(opt, args, kwargs):
        grads = [p.grad for group in opt.param_groups for p in group["params"] if p.grad is not None]
        if not _all_finite(grads):
            for group in opt.param_groups:
                for p in group["params"]:
                    p.grad = None
            on_skip()

    optimizer.register_step_pre_hook(check)


def skip_non_finite_state(state_averager, on_skip: Callable[[], None]) -> None:
    """Make hivemind's ``TrainingStateAverager`` keep the local parameters and optimizer statistics
    when a state (parameter) averaging round comes back with a non-finite value, and call ``on_skip``.

    The state round goes through the same all-reduce as the gradient round (see
    :func:`skip_non_finite_steps`), so a part whose senders all failed or weighed 0 comes back NaN
    there too, and ``_apply_averaging_results_`` (hivemind 1.1.12; ``reuse_tensors = False``, as
    hivemind.Optimizer builds it) would copy it into the parameters, or add it as a delta with
    ``delta_rule_averaging``. The wrapped method first checks the averaged tensors; a round with a
    non-finite value is not applied: the peer keeps its own state, as it does after a failed round.
    The next round loads the local tensors into the averager again.

    Raises:
        TypeError: ``state_averager`` has no ``_apply_averaging_results_`` (another hivemind version).
    """
    apply = getattr(state_averager, "_apply_averaging_results_", None)
    if apply is None:
        raise TypeError(f"{type(state_averager).__name__} has no _apply_averaging_results_ (hivemind 1.1.12's "
                        "TrainingStateAverager has): cannot guard its state rounds")

    @torch.no_grad()
    def apply_if_finite() -> None:
        with state_averager.get_tensors() as averaged:
            finite = _all_finite(averaged)
        if finite:
            apply()
        else:
            on_skip()

    state_averager._apply_averaging_results_ = apply_if_finite


def forked(process) -> bool:
    """Whether a started ``multiprocessing.Process`` (a hivemind averager) was forked, so that it inherited
    the logging handlers of the process that started it (another start method, or not started: False)."""
    return getattr(getattr(process, "_popen", None), "method", None) == "fork"


class AveragerLog(logging.Handler):
    """What hivemind's averagers say only in their own processes, caught there: *partial* averaging rounds
    and join requests that timed out.

    hivemind 1.1.12 runs each averager (gradients, parameters) in a process forked from the peer's,
    and says these things only in that process's log, while the peer's optimizer still logs
    "Averaged ... with N peers":

    - ``hivemind.averaging.partition`` (WARNING), a partial round:
      "Reducer: received X% of input tensors": this peer averaged its part of the tensors without
      some other peer's chunks (that sender was dropped when its next chunk did not arrive within
      ``next_chunk_timeout``, hivemind's default: the matchmaking time);
      "Averaging: received X% results": this peer got back only X % of the averaged tensors; the
      rest keep the peer's own values.
    - ``hivemind.averaging.matchmaking`` (DEBUG), a join request that timed out: "potential leader
      P did not respond within T": this peer asked P to lead its group and heard nothing for
      ``request_timeout`` (hivemind's default 3 s) before it looked again. hivemind's matchmaking
      says it breaks this way the deadlock of two peers that each asked the other to lead; on
      50 Mbit/s links (2 one-core peers, MobileNetV2, issue 14) 9 of 128 global epochs ran 3 s longer so.

    :meth:`install` adds the handler to both loggers before the averagers start; their processes
    inherit it and append one JSON line per such message to ``path``: ``at`` (wall time, s),
    ``pid`` (the averager's process) and ``kind``: ``"partial"`` with ``side`` (``"inputs"`` or
    ``"results"``) and ``received_percent``, or ``"join_timeout"`` with ``timeout_s``. To see the
    matchmaking's DEBUG message, :meth:`install` lowers that logger's level to DEBUG and passes only
    its INFO and above on to hivemind's own log (:meth:`remove` undoes both). :meth:`take` reads the
    lines written since its last call. Nothing is caught from averagers started another way than by
    fork (:func:`forked`).
    """

    PARTITION = "hivemind.averaging.partition"
    MATCHMAKING = "hivemind.averaging.matchmaking"

    def __init__(self, path: str) -> None:
        super().__init__(level=logging.DEBUG)
        self.path = path
        self._offset = 0
        self._forward = _ToParentLog(self.MATCHMAKING)
        self._matchmaking_before: tuple[int, bool] | None = None

    def install(self) -> None:
        """Catch both loggers' messages (before the averagers fork)."""
        logging.getLogger(self.PARTITION).addHandler(self)
        mm = logging.getLogger(self.MATCHMAKING)
        if self._matchmaking_before is None:
            self._matchmaking_before = (mm.level, mm.propagate)
        mm.setLevel(logging.DEBUG)
        mm.propagate = False
        mm.addHandler(self)
        mm.addHandler(self._forward)

    def remove(self) -> None:
        """Stop catching; the matchmaking logger's level and propagation as before :meth:`install`."""
        logging.getLogger(self.PARTITION).removeHandler(self)
        mm = logging.getLogger(self.MATCHMAKING)
        mm.removeHandler(self)
        mm.removeHandler(self._forward)
        if self._matchmaking_before is not None:
            mm.setLevel(self._matchmaking_before[0])
            mm.propagate = self._matchmaking_before[1]
            self._matchmaking_before = None

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if record.name == self.PARTITION and (m := _PARTIAL.search(message)) is not None:
            caught = {"kind": "partial", "side": "inputs" if m.group(1) == "Reducer" else "results",
                      "received_percent": float(m.group(2))}
        elif record.name == self.MATCHMAKING and (m := _JOIN_TIMEOUT.search(message)) is not None:
            caught = {"kind": "join_timeout", "timeout_s": float(m.group(1))}
        else:
            return
        line = json.dumps({"at": record.created, "pid": os.getpid(), **caught}) + "\n"
        try:  # one write of a short line with O_APPEND: lines of two averagers never interleave
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        except OSError:  # the measurement must never break a round
            pass

    def take(self) -> list[dict]:
        """The messages written since the last call, oldest first (a line still being written waits)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self._offset += end
        return [json.loads(line) for line in data[:end].splitlines() if line.strip()]


class _ToParentLog(logging.Handler):
    """Passes the INFO-and-above records of a logger that no longer propagates to its parent's handlers, so
    that lowering the logger's level (:class:`AveragerLog`) adds nothing to hivemind's own log."""

    def __init__(self, name: str) -> None:
        super().__init__(level=logging.INFO)
        self.parent = name.rpartition(".")[0]

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger(self.parent).handle(record)


class _RoundLog(logging.Handler):
    """Collects hivemind's status messages about averaging rounds during one step."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def take(self) -> list[str]:
        msgs, self.messages = self.messages, []
        return msgs


def parse_round(messages: list[str]) -> tuple[bool, int | None, bool | None, int | None]:
    """Read hivemind status messages of one step.

    Returns:
        ``(round_happened, group_size, succeeded, new_epoch)``; group_size is the largest group
        any averaging in the step gathered (1 when the peer averaged alone).
    """
    sizes: list[int] = []
    failed = False
    epoch = None
    for msg in messages:
        if m := (_GRAD_OK.search(msg) or _STATE_OK.search(msg)):
            sizes.append(int(m.group(1)))
        elif any(msg.startswith(a) for a in _ALONE):
            sizes.append(1)
        elif any(msg.startswith(f) for f in _FAILED):
            failed = True
        if m := _EPOCH.search(msg):
            epoch = int(m.group(1))
    happened = epoch is not None
    if not happened:
        return False, None, None, None
    return True, (max(sizes) if sizes else None), not failed, epoch


def parse_prescheduling(messages: list[str]) -> list[tuple[str, float]]:
    """The rounds hivemind 1.1.12 pre-scheduled in one step's status messages, in order:
    ``("gradients" | "parameters", eta_s)``. ``Optimizer._maybe_schedule_gradient_averaging``
    (and its state twin) starts a round's matchmaking only between steps, once the epoch's
    estimated end is within ``matchmaking_time``; ``eta_s`` is the time to that end it logged
    (at least the minimum matchmaking time)."""
    return [("gradients" if m.group(1) == "gradient" else "parameters", float(m.group(2)))
            for msg in messages if (m := _PRESCHEDULED.search(msg))]


def _child_processes() -> list:
    """This process's descendants (psutil.Process), e.g. hivemind's DHT and averager processes and p2pd."""
    import psutil

    found = psutil.Process().children(recursive=True)
    for proc in found:
        try:
            proc.info = {"name": proc.name()}
        except psutil.Error:
            proc.info = {"name": None}
    return found


def _first_dead(processes: list, peer: int) -> str | None:
    """Why peer ``peer`` cannot go on when one of ``processes`` ended (exited, killed, a zombie); None while all run."""
    import psutil

    for proc in processes:
        try:
            alive = proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            alive = False
        if not alive:
            name = "p2pd daemon" if proc.info.get("name") == "p2pd" else "hivemind process"
            return f"peer {peer}'s {name} (pid {proc.pid}) ended during training (killed?); the peer cannot average"
    return None


def _compression(name: str):
    from hivemind import compression as c

    return {
        "none": c.NoCompression,
        "float16": c.Float16Compression,
        "scaled-float16": c.ScaledFloat16Compression,
        "uniform8bit": c.Uniform8BitQuantization,
    }[name]()


def param_checksum(param_groups) -> float:
    """Sum of every parameter's elements (float64): peers whose parameters agree have equal checksums,
    so their spread over peers after a round shows how far averaging brought them together."""
    with torch.no_grad():
        return float(sum(p.detach().double().sum() for group in param_groups for p in group["params"]))


def shutdown_hivemind(opt, dht, timeout_s: float = SHUTDOWN_S) -> None:
    """Cancel ``opt``'s pre-scheduled rounds, shut it and then ``dht`` down (either may be None).

    hivemind's shutdown waits for a pending background averaging round, which can wait up to
    ``averaging_timeout`` for peers that already left; training is over, so this gives up after
    ``timeout_s`` and leaves the rest to the daemon thread.
    """

    def close() -> None:
        if opt is not None:
            for control in (opt.scheduled_grads, opt.scheduled_state):
                if control is not None and not control.done():
                    control.cancel()
            opt.shutdown()
        if dht is not None:
            dht.shutdown()

    closer = threading.Thread(target=close, daemon=True)
    closer.start()
    closer.join(timeout=timeout_s)


def tolerate_finished_cancel() -> None:
    """Make cancelling hivemind's averaging ``StepControl`` idempotent (once per process).

    hivemind 1.1.12 ``StepControl.cancel`` sets the result of the round's cancel future and raises
    ``InvalidStateError`` when the averager finished that future first. ``Optimizer`` cancels a
    pre-scheduled gradient round when its progress tracker sees no other peer for a moment, which
    on slow links (DHT records arriving late) races with the averager: the peer's step raised and
    the run failed (seen in ``validate links`` on the 200/20 Mbit/s pair). The patched ``cancel``
    treats a cancel future that is already finished as cancelled and cancels the control itself.
    """
    from hivemind.averaging.control import StepControl
    from hivemind.utils.mpfuture import MPFuture

    if not getattr(StepControl.cancel, "ddlscope_idempotent", False):
        StepControl.cancel = idempotent_cancel(StepControl.cancel, MPFuture.cancel)


def idempotent_cancel(cancel, cancel_future):
    """``cancel`` (a method) that, where it raises ``InvalidStateError`` because a future it
    finishes was finished already, calls ``cancel_future`` (the plain future's cancel) instead."""
    from concurrent.futures import InvalidStateError

    @functools.wraps(cancel)
    def wrapped(self) -> bool:
        try:
            return cancel(self)
        except InvalidStateError:  # the averager finished the cancel future first
            return cancel_future(self)

    wrapped.ddlscope_idempotent = True  # type: ignore[attr-defined]
    return wrapped


class CollaborativeStrategy(Strategy):
    """One Hivemind peer. See the module docstring for what it does and measures."""

    name = "collaborative"
    uses_network = True

    def __init__(self, cfg, ctx: WorkerContext):
        super().__init__(cfg, ctx)
        self.dht = None
        self.hm_opt = None
        self._log = _RoundLog()
        self._averager_log: AveragerLog | None = None
        self._averager_rounds: dict[int, str] = {}  # averager process id -> "gradients" / "parameters"
        self._loggers = [logging.getLogger("hivemind.optim.optimizer"), logging.getLogger("hivemind.optim.state_averager")]
        self._update_s = 0.0
        self._local_step_s = 0.0
        # parameter rounds hivemind's state averager ran (or skipped) since the last step, from its executor thread
        self._state_rounds: list[dict] = []
        # per event kind: optimizer steps skipped for non-finite averaged gradients ("non_finite_average"),
        # state averaging rounds not applied for non-finite averaged parameters ("non_finite_state_average")
        self._skipped = {"non_finite_average": 0, "non_finite_state_average": 0}
        self._stop_watch = threading.Event()
        self.others_done = threading.Event()
        self._background_cpu_s: float | None = None
        self._read_background_cpu = BackgroundCpu()
        self._daemons: list = []  # hivemind's processes (DHT, p2pd, averagers) as psutil.Process, watched while training
        self._daemon_lost: str | None = None
        self._leave = LeaveRequest()
        churn = cfg.collaborative.churn_of(ctx.worker_index, ctx.num_workers)
        # a peer that comes after the start: its schedule says so, or it trained before (a rejoin)
        self.joins_late = bool(churn and churn.join_at_s > 0) or bool(
            ctx.store is not None and ctx.store.step_counts(ctx.run_id).get(ctx.worker_index))

    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.nn.Module:
        import hivemind
        from hivemind.optim.grad_averager import GradientAverager

        from ddlscope.launch.network import p2p_options

        tolerate_finished_cancel()
        c = self.cfg.collaborative
        listen = self.ctx.listen_maddrs or [f"/ip4/{c.listen_host}/tcp/0"]
        client_mode = self.ctx.worker_index in c.client_mode_peers
        auxiliary = self.assists_only
        try:
            self.dht = hivemind.DHT(initial_peers=self.ctx.initial_peers or None, host_maddrs=listen, start=True,
                                    startup_timeout=c.join_timeout_s, client_mode=client_mode,
                                    **p2p_options(c.nat_traversal))
        except hivemind.p2p.P2PDaemonError as e:
            raise RuntimeError(
                f"peer {self.ctx.worker_index} could not join the swarm (initial peers "
                f"{self.ctx.initial_peers or 'none'}, listening on {listen}, join_timeout_s = {c.join_timeout_s:g}): {e}"
            ) from None
        if self.ctx.announce is not None:
            self.ctx.announce([str(a) for a in self.dht.get_visible_maddrs()])
        for lg in self._loggers:
            lg.addHandler(self._log)
            lg.setLevel(logging.INFO)
        self._time_local_optimizer_step(optimizer)
        if not c.use_local_updates:  # the inner step applies averaged gradients once per global epoch
            skip_non_finite_steps(optimizer, functools.partial(
                self._record_non_finite, "non_finite_average", "gradients", "its optimizer step is skipped"))
        comp = _compression(c.gradient_compression)
        fd, path = tempfile.mkstemp(prefix="ddlscope-averager-log-", suffix=".jsonl")  # in the run's folder
        os.close(fd)
        self._averager_log = AveragerLog(path)
        self._averager_log.install()  # before the averagers fork
        # Moshpit-style groups, and the bandwidth this peer declares for hivemind's load balancing
        groups = {"target_group_size": c.target_group_size, "initial_group_bits": c.initial_group_bits,
                  "bandwidth": c.declared_bandwidth_mbit_per_s(self.ctx.worker_index, self.cfg.network),
                  **({"request_timeout": c.request_timeout_s} if c.request_timeout_s is not None else {})}
        self.hm_opt = hivemind.Optimizer(
            dht=self.dht, run_id=f"ddlscope-{self.ctx.run_id}", optimizer=optimizer,
            target_batch_size=c.target_batch_size,
            batch_size_per_step=None if auxiliary else self.cfg.batch_size * self.cfg.gradient_accumulation_steps,
            auxiliary=auxiliary,
            use_local_updates=c.use_local_updates, matchmaking_time=c.matchmaking_time_s,
            averaging_timeout=c.averaging_timeout_s, next_chunk_timeout=c.next_chunk_timeout_s,
            average_state_every=c.average_state_every,
            grad_compression=comp, state_averaging_compression=comp, verbose=True, client_mode=client_mode,
            # both rounds: hivemind 1.1.12 passes averager_opts to the state averager only (its docstring
            # says both), so the gradient averager gets them through its factory
            averager_opts=groups, grad_averager_factory=functools.partial(GradientAverager, **groups),
            tracker_opts={"metadata_expiration": c.progress_expiration_s}, load_state_timeout=c.load_state_timeout_s,
        )
        self._averager_rounds = {a.pid: kind for a, kind in ((self.hm_opt.state_averager, "parameters"),
                                                             (self.hm_opt.grad_averager, "gradients")) if a is not None}
        skip_non_finite_state(self.hm_opt.state_averager, functools.partial(
            self._record_non_finite, "non_finite_state_average", "parameters", "the peer keeps its own"))
        self._time_global_update()
        self._time_state_rounds()
        self._time_state_loading()
        self.optimizer = self.hm_opt
        if threading.current_thread() is threading.main_thread():  # the launcher's "leave now" (leave_at_s)
            self._leave.install()
        self._wait_for_swarm()
        self._background_cpu_s = self._read_background_cpu()
        self._daemons = _child_processes()
        threading.Thread(target=self._watch_swarm, name="ddlscope-swarm-watch", daemon=True).start()
        return model

    def details(self) -> dict:
        """The peer's role and what it told hivemind's averagers (stored as the ``strategy_details`` event)."""
        c = self.cfg.collaborative
        i = self.ctx.worker_index
        averagers = [getattr(self.hm_opt, a, None) for a in ("state_averager", "grad_averager")] if self.hm_opt else []
        caught = self._averager_log is not None and bool(averagers) and all(forked(a) for a in averagers if a is not None)
        return {"role": "auxiliary" if self.assists_only else "client" if i in c.client_mode_peers else "trainer",
                "declared_bandwidth_mbit_per_s": c.declared_bandwidth_mbit_per_s(i, self.cfg.network),
                # what hivemind's averagers hold (read back: the value their load balancing gathers)
                "averager_bandwidths": [a.bandwidth for a in averagers if a is not None],
                # how long a join request waits for a potential leader (read back: hivemind's request_timeout)
                "averager_request_timeouts_s": [a.matchmaking_kwargs.get("request_timeout") for a in averagers
                                                if a is not None],
                "target_group_size": c.target_group_size,
                # how long its progress record outlasts it: read back from hivemind's progress tracker
                "progress_expiration_s": getattr(getattr(self.hm_opt, "tracker", None), "metadata_expiration", None),
                "load_state_timeout_s": getattr(self.hm_opt, "load_state_timeout", None),
                "skipped_non_finite_updates": self._skipped["non_finite_average"],
                "skipped_non_finite_state_rounds": self._skipped["non_finite_state_average"],
                # whether hivemind's partial rounds and join timeouts were caught (partial_average and join_timeout
                # events; False: not counted)
                "partial_rounds_counted": caught, "join_timeouts_counted": caught}

    def _key(self, what: str) -> str:
        return f"ddlscope-{self.ctx.run_id}-{what}"

    def _count(self, what: str) -> int:
        found = self.dht.get(self._key(what), latest=True)
        return len(found.value) if found is not None and isinstance(found.value, dict) else 0

    def _others_at_end(self) -> int:
        """Other peers expected to say they are done: those the churn schedule does not take away."""
        c = self.cfg.collaborative
        mine = c.churn_of(self.ctx.worker_index, self.ctx.num_workers)
        stays = (mine is None or not mine.ends_absent) and not self.assists_only
        return c.peers_at_end(self.ctx.num_workers) - (1 if stays else 0)

    def _announce(self, what: str) -> None:
        from hivemind.utils import get_dht_time

        self.dht.store(self._key(what), subkey=self.ctx.worker_index, value=True, expiration_time=get_dht_time() + 3600)

    def _watch_swarm(self) -> None:
        """Once every other peer is done, cancel averaging rounds that would wait for them; note a hivemind
        process of this peer that died (the next step fails with it)."""
        last_poll = time.monotonic() - SWARM_POLL_S
        while not self._stop_watch.wait(WATCH_S):
            if self._daemon_lost is None:
                self._daemon_lost = _first_dead(self._daemons, self.ctx.worker_index)
            stopping = self.ctx.stop_requested is not None and self.ctx.stop_requested.is_set()
            if stopping or self._daemon_lost:  # let a step waiting in a round return, to stop at its end
                self._cancel_rounds()
                continue
            if time.monotonic() - last_poll < SWARM_POLL_S:
                continue
            last_poll = time.monotonic()
            try:
                if self._count("done") < self._others_at_end():
                    continue
                self.others_done.set()
                self._cancel_rounds()
            except Exception:  # the watcher must never break training
                continue

    def _cancel_rounds(self) -> None:
        """Cancel the averaging rounds hivemind scheduled (the step waiting in one returns)."""
        for control in (self.hm_opt.scheduled_grads, self.hm_opt.scheduled_state):
            try:
                if control is not None and not control.done():
                    control.cancel()
            except Exception:  # a round that ends meanwhile
                continue

    def _record_non_finite(self, kind: str, averaged: str, consequence: str) -> None:
        """Count, log and store (event ``kind``) an averaging round whose averaged ``averaged`` are not finite."""
        self._skipped[kind] += 1
        epoch = self.hm_opt.local_epoch if self.hm_opt is not None else None
        logging.getLogger(__name__).warning(
            "peer %d: the averaged %s of global epoch %s are not finite (hivemind reduced a part from peers that "
            "all failed or weighed 0); %s", self.ctx.worker_index, averaged, epoch, consequence)
        if self.ctx.store is not None:
            self.ctx.store.add_event(self.ctx.run_id, self.ctx.worker_index, kind, epoch=epoch)

    def _store_averager_log(self) -> None:
        """Store what this peer's averagers said since the last call (:class:`AveragerLog`), each with its
        ``round`` (gradients / parameters), ``at`` (when hivemind logged it) and the peer's global epoch when
        it was read: a ``partial_average`` event per partial-round warning (``side``, ``received_percent``),
        a ``join_timeout`` event per join request that timed out (``timeout_s``)."""
        if self._averager_log is None:
            return
        for w in self._averager_log.take():
            if self.ctx.store is None:
                continue
            common = dict(round=self._averager_rounds.get(w["pid"], "unknown"), at=w["at"],
                          epoch=self.hm_opt.local_epoch if self.hm_opt is not None else None)
            if w["kind"] == "partial":
                self.ctx.store.add_event(self.ctx.run_id, self.ctx.worker_index, "partial_average", side=w["side"],
                                         received_percent=w["received_percent"], **common)
            else:
                self.ctx.store.add_event(self.ctx.run_id, self.ctx.worker_index, "join_timeout",
                                         timeout_s=w["timeout_s"], **common)

    def _time_local_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        inner_step = optimizer.step

        def timed_step(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner_step(*args, **kwargs)
            finally:
                self._local_step_s += time.perf_counter() - t0

        optimizer.step = timed_step

    def _time_global_update(self) -> None:
        # hivemind 1.1.12: Optimizer._update_global_epoch runs matchmaking, all-reduce, state averaging
        # and the optimizer step of a global epoch; we time it to separate averaging from local work.
        inner = self.hm_opt._update_global_epoch

        def timed_update(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self._update_s += time.perf_counter() - t0

        self.hm_opt._update_global_epoch = timed_update

    def _time_state_rounds(self) -> None:
        """Time the parameter (state) rounds hivemind 1.1.12 runs in its state averager's background
        executor (``TrainingStateAverager._do`` with ``averaging_round``): each becomes a
        ``state_round`` event with ``epoch`` (the global epoch it averages), ``began_at`` and
        ``ended_at`` (wall time, s: from the epoch's transition, so its matchmaking and the
        optimizer step before it count, to the round's end or failure) and ``seconds``. An epoch
        whose round hivemind skips because the previous one still runs (``Optimizer._update_global_epoch``
        averages state only ``not state_averager.averaging_in_progress``) becomes a
        ``state_round_skipped`` event. Stored by the training thread at its next step."""
        sa = self.hm_opt.state_averager
        inner_do, inner_step = sa._do, sa.step
        every = self.cfg.collaborative.average_state_every

        def timed_do(wait_for_trigger, optimizer_step, zero_grad, averaging_round, *args, **kwargs):
            if not averaging_round:
                return inner_do(wait_for_trigger, optimizer_step, zero_grad, averaging_round, *args, **kwargs)
            epoch, t0 = sa.local_epoch, time.time()
            try:
                return inner_do(wait_for_trigger, optimizer_step, zero_grad, averaging_round, *args, **kwargs)
            finally:
                t1 = time.time()
                self._state_rounds.append({"kind": "state_round", "epoch": epoch, "began_at": t0, "ended_at": t1,
                                           "seconds": t1 - t0})

        def watched_step(*args, **kwargs):
            if (kwargs.get("increment_epoch") and not kwargs.get("averaging_round")
                    and (sa.local_epoch + 1) % every == 0 and sa.averaging_in_progress):
                self._state_rounds.append({"kind": "state_round_skipped", "epoch": sa.local_epoch + 1,
                                           "at": time.time()})
            return inner_step(*args, **kwargs)

        sa._do, sa.step = timed_do, watched_step

    def _store_prescheduling(self, messages: list[str], epoch: int, ended_epoch: bool) -> None:
        """Store a ``round_prescheduled`` event per round hivemind pre-scheduled in this step
        (:func:`parse_prescheduling`): ``round``, ``eta_s``, ``epoch`` (the global epoch being
        accumulated) and ``in_last_step`` (the step also ended that epoch: the group then forms a
        matchmaking time after the epoch's end, as if nothing had been pre-scheduled)."""
        if self.ctx.store is None:
            return
        for kind, eta_s in parse_prescheduling(messages):
            self.ctx.store.add_event(self.ctx.run_id, self.ctx.worker_index, "round_prescheduled", round=kind,
                                     eta_s=eta_s, epoch=epoch, in_last_step=ended_epoch)

    def _store_state_rounds(self) -> None:
        """Store the ``state_round`` / ``state_round_skipped`` events :meth:`_time_state_rounds` collected."""
        while self._state_rounds:  # list.pop is atomic: a round the executor appends meanwhile waits for the next call
            r = self._state_rounds.pop(0)
            if self.ctx.store is not None:
                self.ctx.store.add_event(self.ctx.run_id, self.ctx.worker_index, r.pop("kind"), **r)

    def _time_state_loading(self) -> None:
        """Time hivemind's ``load_state_from_peers`` (a peer behind the swarm downloads its state) and
        store a ``state_loaded`` event: seconds, local epoch before and after. Counts the loads
        (``_state_loads``): hivemind loads inside ``step`` when the peer is out of sync, and then
        returns without accumulating the step's gradients (:meth:`step`'s ``samples_discarded``)."""
        inner = self.hm_opt.load_state_from_peers
        self._state_loads = 0

        def timed_load(*args, **kwargs):
            before, t0 = self.hm_opt.local_epoch, time.perf_counter()
            self._state_loads += 1
            abandoned = False
            try:
                result, abandoned = self._leave.unless_leaving(inner, *args, **kwargs)
                return result
            finally:
                if self.ctx.store is not None:
                    self.ctx.store.add_event(self.ctx.run_id, self.ctx.worker_index, "state_loaded",
                                             seconds=time.perf_counter() - t0, epoch_before=before,
                                             epoch_after=self.hm_opt.local_epoch, at=time.time(),
                                             **({"abandoned_for_leave": True} if abandoned else {}))

        self.hm_opt.load_state_from_peers = timed_load

    @property
    def assists_only(self) -> bool:
        """An auxiliary peer (``collaborative.auxiliary_peers``): it averages, it does not train."""
        return self.ctx.worker_index in self.cfg.collaborative.auxiliary_peers

    def assist(self) -> str:
        """Step hivemind's auxiliary optimizer every :data:`AUX_POLL_S` s until the trainers are done (or
        the peer is asked to leave or stop); store each averaging round it took part in."""
        rounds = 0
        while not (self.others_done.is_set() or self._leave.is_set()):
            self.check_stop()
            if self._daemon_lost:
                raise RuntimeError(self._daemon_lost)
            self._update_s = 0.0
            self.hm_opt.step()
            happened, group, ok, epoch = parse_round(self._log.take())
            self._store_averager_log()
            self._store_state_rounds()
            if happened:
                rounds += 1
                if self.ctx.store is not None:
                    self.ctx.store.add_event(self.ctx.run_id, self.ctx.worker_index, "averaging_round", step=None,
                                             group_size=group, succeeded=ok, averaging_s=self._update_s, epoch=epoch,
                                             auxiliary=True)
            time.sleep(AUX_POLL_S)
        return f"auxiliary: helped average in {rounds} round(s)"

    def should_stop(self) -> bool:
        """True once the launcher asked this peer to leave the swarm (``leave_at_s``)."""
        return self._leave.is_set()

    @property
    def stop_reason(self) -> str | None:
        """Why :meth:`should_stop` ended training, for the worker's record."""
        return "left the swarm as scheduled (collaborative.churn leave_at_s)" if self._leave.is_set() else None

    def _wait_for_swarm(self) -> None:
        if self.joins_late:  # the swarm runs already: the DHT join through its peers was the join
            return
        need = self.cfg.collaborative.peers_at_start(self.ctx.num_workers)
        timeout = self.cfg.collaborative.join_timeout_s
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            self._announce("ready")
            seen = self._count("ready")
            if seen >= need:
                return
            time.sleep(0.2)
        raise RuntimeError(
            f"peer {self.ctx.worker_index} could not join the swarm: saw {seen} of {need} peers within "
            f"join_timeout_s = {timeout:g} s (initial peers: {self.ctx.initial_peers or 'none, this is the first peer'})"
        )

    def step(self, samples: int) -> StepOutcome:
        self.check_stop()
        self._update_s = self._local_step_s = 0.0
        accumulating, loads = self.hm_opt.local_epoch, self._state_loads
        self.hm_opt.step(batch_size=samples)
        self.check_stop()  # hivemind catches the stop signal's exception inside its step: stop here, not at the kill
        if self._daemon_lost:
            raise RuntimeError(self._daemon_lost)
        messages = self._log.take()
        happened, group, ok, epoch = parse_round(messages)
        self._store_prescheduling(messages, accumulating, happened)
        self._store_averager_log()
        self._store_state_rounds()
        averaging_s = max(0.0, self._update_s - self._local_step_s) if happened else 0.0
        before, self._background_cpu_s = self._background_cpu_s, self._read_background_cpu()
        return StepOutcome(averaging_s=averaging_s, averaging_round=happened, group_size=group, succeeded=ok,
                           global_epoch=self.hm_opt.local_epoch,
                           param_checksum=param_checksum(self.hm_opt.param_groups) if happened else None,
                           # the kernel counts CPU in ticks: a short interval can read a tick below zero
                           background_cpu_s=None if before is None else max(0.0, self._background_cpu_s - before),
                           # hivemind loaded the swarm's state in this step and dropped its gradients ("must start over")
                           samples_discarded=samples if self._state_loads > loads else 0)

    def zero_grad(self) -> None:
        self.hm_opt.zero_grad()

    def close(self) -> None:
        self._stop_watch.set()
        if self.dht is not None and self.hm_opt is not None and not self._leave.is_set():
            try:
                self._announce("done")
            except Exception:
                pass
        for lg in self._loggers:
            lg.removeHandler(self._log)
        stopping = self.ctx.stop_requested is not None and self.ctx.stop_requested.is_set()
        # a dead daemon cannot say goodbye, and a stopped run's peers are all stopping: do not wait for them
        shutdown_hivemind(self.hm_opt, self.dht, 0.0 if self._daemon_lost else STOP_SHUTDOWN_S if stopping else SHUTDOWN_S)
        if self._averager_log is not None:  # the rounds that ended since the last step, then the file
            self._averager_log.remove()
            try:
                self._store_averager_log()
                self._store_state_rounds()
            except Exception:  # a store that fails here must not hide why the run ended
                pass
            try:
                os.unlink(self._averager_log.path)
            except OSError:
                pass
