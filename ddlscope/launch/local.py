"""Start a run's workers as local processes, watch them, and end them all together.

How the workers start is the distribution model's ``launcher`` (:mod:`ddlscope.distribution`):

- ``process``: each worker is ``python -m ddlscope.train.worker`` in its own session/process
  group (:mod:`ddlscope.launch.processes`), pinned to its own cores (the thesis's vCPUs per peer),
  with its DataLoader workers inside the same group;
- ``swarm``: the same worker processes, hivemind's averager and p2pd daemon inside each group,
  joined into one swarm by the swarm protocol (:data:`ddlscope.distribution.SWARM_OPTIONS`): with
  the model's ``initial_peers`` option empty the first peer starts first and bootstraps the swarm,
  and the others get the multiaddrs it recorded in the store (waiting at most ``join_timeout_s``);
  else everyone joins ``initial_peers`` (e.g. a ``ddlscope bootstrap`` messenger);
- ``torchrun``: one torchrun agent starts the workers (:mod:`ddlscope.launch.torchrun`); each
  worker pins itself to its core set by its local rank.

A swarm model with ``services`` (dmoe's expert servers) has them started first by
:class:`~ddlscope.launch.services.ServiceSupervisor`; they bootstrap the swarm, the workers join
them, and their schedules (start late, killed, restarted) run while the workers train. Services
get cores of their own when the workers leave some free, else they share the workers' cores
(:func:`service_core_sets`). On an emulated network each service has a namespace of its own after
the workers' (:meth:`~ddlscope.network.emulated.EmulatedNetwork.for_run`).

A swarm with a churn schedule (``collaborative.churn``, :mod:`ddlscope.launch.churn`) starts its
late peers, asks peers to leave, kills and restarts them while it runs; those scheduled ends are
no failure. It goes on while at least one peer trains: it is ``completed`` when some peer finished
its budget, and ``failed`` when the swarm emptied first (its last peer left or was killed).

The run ends when every worker has ended. If a worker fails, the others are stopped and the run
is stored as ``failed`` with that worker's reason ("peer 1 killed by SIGKILL"); Ctrl-C, SIGTERM
and SIGHUP to the launcher store it as ``interrupted`` naming the signal. Either way every process
group is ended (SIGTERM, then SIGKILL after a grace period), so no worker, peer or daemon outlives
the run. A launcher killed outright (SIGKILL) cannot record anything: its workers notice
(``PR_SET_PDEATHSIG`` and a watch on its pid, :mod:`ddlscope.train.worker`), stop, and record the run
as ``interrupted`` by the launcher's death; a reader marks it so otherwise
(:meth:`~ddlscope.store.db.ResultsStore.mark_stale_runs`).

Every process of a run gets the run's own temporary folder as ``TMPDIR``
(:func:`~ddlscope.launch.processes.make_run_temp_dir`: multiprocessing's, torchelastic's and
hivemind's files), removed when the run ends. A full disk ends the run as ``failed`` with
"disk full writing <db>" where that can still be written, and as one ``error:`` line
(:class:`~ddlscope.store.db.StoreFullError`) either way; a store removed during the run stops it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ddlscope import distribution
from ddlscope.config import RunConfig
from ddlscope.errors import UserError
from ddlscope.launch.churn import ChurnAction, ChurnSchedule
from ddlscope.launch.cores import CoreLease, lease_cores
from ddlscope.launch.processes import (STOP_SIGNALS, describe_exit, handlers_set, log_tail, make_run_temp_dir,
                                       remove_run_temp_dir, start_process, stop_processes, stop_signals_held)
from ddlscope.launch.services import ServiceSupervisor
from ddlscope.launch.torchrun import preflight, torchrun_command
from ddlscope.network.emulated import EmulatedNetwork
from ddlscope.store.db import RESERVE_FILE, ResultsStore, StoreFullError, disk_full_message, is_disk_full

GRACE_S = 8.0
"""Seconds a stopped worker gets to end its children and record its status before SIGKILL."""
EXIT_INTERRUPTED = 130
"""Exit code of a worker stopped by a signal (:mod:`ddlscope.train.worker`)."""
EXIT_DISK_FULL = 3
"""Exit code of a worker that stopped because the results store's disk is full."""
RESERVE_BYTES = 256 * 1024
"""Bytes the launcher sets aside next to the logs while a run goes, freed to record the run's end on a full disk."""


class LauncherSignal(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP arrived at the launcher; handled like Ctrl-C (``args[0]``: the signal's name)."""


class StoreLostError(UserError):
    """The results store file was removed or replaced while a run was writing to it."""


@dataclass
class WorkerProcess:
    """One process this launcher started: a worker (``index`` >= 0) or a torchrun agent (< 0: agent
    ``-1 - index``; one for all workers, or one per worker on an emulated network)."""

    index: int
    cores: list[int]
    popen: subprocess.Popen
    log_path: Path


@dataclass
class LocalLauncher:
    """Launches and supervises the workers of one run on this machine.

    Args:
        cfg: validated run config.
        db_path: results store file.
        group_name: label that ties runs together (e.g. the quickstart's baseline and peers).
        local_workers: how many of ``cfg.peers`` to start here (the rest join by hand with
            ``ddlscope peer``); default all.
        progress: show a progress bar per worker.
        nnodes, rdzv_endpoint, run_id: torch.distributed models on a cluster: this node is one of
            ``nnodes`` that each run the same command with the same ``rdzv_endpoint`` (``host:port``
            of the first node) and ``run_id``; it starts ``peers / nnodes`` workers and stores them in
            its own database. ``local_addr``: this node's address as the other nodes reach it
            (torchrun's ``--local-addr``; the node hosts the rendezvous when it is the endpoint's
            host, and the workers' gloo uses the interface that holds it, unless
            ``GLOO_SOCKET_IFNAME`` is set); default torchrun's guess from the host name.
    """

    cfg: RunConfig
    db_path: Path
    group_name: str | None = None
    local_workers: int | None = None
    progress: bool = True
    workers: list[WorkerProcess] = field(default_factory=list)
    nnodes: int = 1
    rdzv_endpoint: str | None = None
    run_id: str | None = None
    local_addr: str | None = None
    worker_pids: set[int] = field(default_factory=set)
    rdzv_port: int | None = None
    services: ServiceSupervisor | None = None
    network: EmulatedNetwork | None = None
    leased_cores: list[int] | None = None
    tmp_dir: Path | None = None
    reserve_path: Path | None = None
    churn: ChurnSchedule | None = None
    departed: list[WorkerProcess] = field(default_factory=list)
    _churn_start: float | None = None
    _stopping: bool = False

    def run(self) -> str:
        """Run to the end; return the run id.

        Raises:
            KeyboardInterrupt (:class:`LauncherSignal` for SIGINT/SIGTERM/SIGHUP): after every
                process was stopped and the run recorded as ``interrupted``.
            StoreFullError: the store's disk is full (the run recorded as failed if that could be written).
            StoreLostError: the store file was removed during the run (every process stopped).
        """
        cfg = self.cfg
        prepare_dataset(cfg)
        # the cores no other run on this machine holds (else one error line naming the holder)
        with lease_cores(cfg, cfg.run_label, local_workers=self.workers_here if self.nnodes > 1 else None) as lease:
            return self._run(lease)

    def _run(self, lease: CoreLease) -> str:
        cfg = self.cfg
        core_sets, self.leased_cores = lease.core_sets, lease.cores or None
        self.rdzv_port = preflight(cfg, check_port=self.rdzv_endpoint is None)
        self.network = EmulatedNetwork.for_run(cfg, self.workers_here)
        self._stopping = False
        with self._stop_signals():
            store, run_id, log_dir = self._create_run()
            lease.name_run(run_id)
            try:
                status, reason = self._start_and_watch(store, run_id, core_sets, log_dir)
            except KeyboardInterrupt as e:
                self._stop_all()
                self._record_end(store, run_id, "interrupted", _interrupt_reason(e))
                raise
            except StoreLostError:
                self._stop_all()  # nothing is recorded: the file is gone (or another one is in its place)
                self._release_reserve()
                raise
            except BaseException as e:
                self._stop_all()
                if is_disk_full(e, self.db_path):
                    self._record_end(store, run_id, "failed", disk_full_message(self.db_path, "the launcher stopped the run"))
                self._record_end(store, run_id, "failed", f"launcher error: {type(e).__name__}: {e}")
                raise
            finally:
                self._stop_all()
                self._end_services(store)
                self._end_network(store, run_id)
                remove_run_temp_dir(self.tmp_dir)
            self._record_end(store, run_id, status, reason)
        store.close()
        return run_id

    def _create_run(self) -> tuple[ResultsStore, str, Path]:
        """The run's row, its log folder and its temporary folder.

        Raises:
            StoreFullError: the disk is full (nothing is started).
        """
        store = run_id = None
        try:
            store = ResultsStore(self.db_path)
            run_id = store.create_run(self.cfg.run_label, self.cfg.strategy, self.cfg.model_dump(mode="json"),
                                      self.group_name, self.run_id)
            log_dir = self.db_path.parent / "logs" / run_id
            log_dir.mkdir(parents=True, exist_ok=True)
            self.reserve_path = log_dir / RESERVE_FILE
            self.reserve_path.write_bytes(bytes(RESERVE_BYTES))
            self.tmp_dir = make_run_temp_dir()
            store.set_tmp_dir(run_id, self.tmp_dir)
        except (sqlite3.OperationalError, OSError) as err:
            if is_disk_full(err, self.db_path):
                self._release_reserve()
                remove_run_temp_dir(self.tmp_dir)
                raise StoreFullError(disk_full_message(self.db_path, "no run was started")) from None
            raise
        except KeyboardInterrupt as e:  # a stop signal before any worker started
            self._release_reserve()
            remove_run_temp_dir(self.tmp_dir)
            if run_id is not None:
                store.finish_run(run_id, "interrupted", _interrupt_reason(e))
            raise
        return store, run_id, log_dir

    def _release_reserve(self) -> None:
        """Remove the reserve file (its space lets the run's end be recorded on a full disk)."""
        if self.reserve_path is not None:
            self.reserve_path.unlink(missing_ok=True)
            self.reserve_path = None

    @contextlib.contextmanager
    def _stop_signals(self):
        """While the run goes, SIGINT/SIGTERM/SIGHUP raise :class:`LauncherSignal` in the main thread (one
        path for all: stop every process, record ``interrupted``); once one was raised, further ones are
        ignored so that nothing interrupts the stop. One that Python swallowed (it landed in a weakref
        callback or a ``__del__``) is raised again
        (:func:`~ddlscope.launch.processes.swallowed_stops_raised_again`). Outside the main thread nothing
        changes."""
        def handle(signum, frame):
            if self._stopping:
                return
            self._stopping = True
            stop = LauncherSignal(signal.Signals(signum).name)
            stop.on_swallowed = lambda: setattr(self, "_stopping", False)  # it will come again
            raise stop

        with handlers_set(STOP_SIGNALS, handle, resend_swallowed=True):
            yield

    def _record_end(self, store: ResultsStore, run_id: str, status: str, reason: str | None) -> None:
        """Record the run's final status (and its unfinished workers').

        Raises:
            StoreFullError: the disk is full; the message says how the run ended.
        """
        for attempt in range(2):
            try:
                self._mark_unfinished_workers(store, run_id, status, reason)
                store.finish_run(run_id, status, reason)
                break
            except sqlite3.OperationalError as err:
                if not is_disk_full(err, self.db_path):
                    raise
                if attempt == 0 and self.reserve_path is not None:
                    self._release_reserve()  # its space is for this
                    continue
                told = reason if reason and reason.startswith("disk full writing") else disk_full_message(
                    self.db_path, f"run {run_id} ended {status}" + (f" ({reason})" if reason else ""))
                raise StoreFullError(f"{told}; not recorded ('ddlscope runs' shows the run interrupted once its "
                                     f"processes are gone)") from None
        self._release_reserve()
        if reason and reason.startswith("disk full writing"):
            raise StoreFullError(f"{reason}; run {run_id} recorded as {status}")

    def _end_services(self, store: ResultsStore) -> None:
        if self.services is None:
            return
        try:
            self.services.record_stopped(store)
        except sqlite3.OperationalError as err:
            if not is_disk_full(err, self.db_path):
                raise

    def _end_network(self, store: ResultsStore, run_id: str) -> None:
        """Record what the emulated links carried (``network_links``) and remove the network."""
        if self.network is None or not self.network.created:
            return
        try:
            self.network.record(store, run_id)
        except sqlite3.OperationalError as err:
            if not is_disk_full(err, self.db_path):
                raise
        finally:
            self.network.remove()

    # ------------------------------------------------------------------ start
    def _spawn(self, run_id: str, index: int, cores: list[int], initial_peers: list[str], log_dir: Path) -> WorkerProcess:
        cmd = [sys.executable, "-m", "ddlscope.train.worker", "--db", str(self.db_path), "--run-id", run_id,
               "--worker-index", str(index), "--num-workers", str(self.cfg.peers),
               "--cores", ",".join(map(str, cores)), "--die-with-parent"]
        if initial_peers:
            cmd += ["--initial-peers", *initial_peers]
        if self.network is not None:  # inside the peer's namespace, listening on its address
            cmd = self.network.peer_command(index, cmd)
        return self._popen(cmd, index, cores, log_dir / f"worker-{index}.log")

    @property
    def workers_here(self) -> int:
        """Workers this launcher starts: all peers, or this node's share on a cluster.

        Raises:
            UserError: peers is not a multiple of nnodes.
        """
        if self.nnodes == 1:
            return self.local_workers or self.cfg.peers
        if self.cfg.distribution_model.launcher != "torchrun" or self.cfg.peers % self.nnodes:
            raise UserError(f"--nnodes {self.nnodes}: needs a torch.distributed model "
                            f"({', '.join(distribution.with_launcher('torchrun'))}) and "
                            f"peers = {self.cfg.peers} divisible by the number of nodes")
        return self.cfg.peers // self.nnodes

    def _spawn_torchrun(self, run_id: str, core_sets: list[list[int]], log_dir: Path) -> None:
        """One torchrun agent that starts this host's workers (index -1 among :attr:`workers`); on an
        emulated network one agent per worker in the worker's namespace, each a node of a cluster of
        ``peers`` nodes (indices -1, -2, ...), the rendezvous hosted in worker 0's namespace."""
        def worker_args(sets: list[list[int]]) -> list[str]:
            return ["--db", str(self.db_path), "--run-id", run_id, "--die-with-parent",
                    "--core-sets", ";".join(",".join(map(str, c)) for c in sets)]

        if self.network is None:
            endpoint = self.rdzv_endpoint or f"127.0.0.1:{self.rdzv_port}"
            host, env = None, {}
            if self.local_addr is not None:  # the node says where it is reached: hosting and gloo's interface follow
                host = self.local_addr == endpoint.rsplit(":", 1)[0].strip("[]")
                env = {} if os.environ.get("GLOO_SOCKET_IFNAME") else {"GLOO_SOCKET_IFNAME": interface_of(self.local_addr)}
            cmd = torchrun_command(self.workers_here, endpoint, worker_args(core_sets), nnodes=self.nnodes, rdzv_id=run_id,
                                   local_addr=self.local_addr, is_host=host)
            self._popen(cmd, -1, core_sets[0], log_dir / "torchrun.log", env=env)
            return
        endpoint = f"{self.network.address(0)}:{self.rdzv_port}"
        for i in range(self.cfg.peers):  # gloo's pairs on the namespace's link, not the host name's address
            cmd = torchrun_command(1, endpoint, worker_args([core_sets[i]]), nnodes=self.cfg.peers, rdzv_id=run_id,
                                   local_addr=self.network.address(i), is_host=i == 0)
            self._popen(self.network.wrap(i, cmd), -1 - i, core_sets[i], log_dir / f"torchrun-{i}.log",
                        env={"GLOO_SOCKET_IFNAME": self.network.interface})

    def _popen(self, cmd: list[str], index: int, cores: list[int], log_path: Path,
               env: dict[str, str] | None = None) -> WorkerProcess:
        with stop_signals_held():  # a stop now would lose the process before it is in self.workers
            wp = WorkerProcess(index, cores, start_process(cmd, log_path, threads=len(cores),
                                                           env_extra={**self._child_env(), **(env or {})}), log_path)
            self.workers.append(wp)
        return wp

    def _child_env(self) -> dict[str, str]:
        """Environment of every process of the run: its own temporary folder."""
        return {"TMPDIR": str(self.tmp_dir)} if self.tmp_dir is not None else {}

    def _start_and_watch(self, store: ResultsStore, run_id: str, core_sets: list[list[int]], log_dir: Path
                         ) -> tuple[str, str | None]:
        cfg = self.cfg
        if self.network is not None:
            self.network.create()
        if cfg.distribution_model.launcher == "torchrun":
            self._spawn_torchrun(run_id, core_sets, log_dir)
            return self._watch(store, run_id)
        n_local = self.local_workers or cfg.peers
        swarm = cfg.distribution_model.launcher == "swarm"
        initial = list(cfg.model_options()["initial_peers"]) if swarm else []
        if swarm and cfg.distribution_model.services is not None:  # the services bootstrap the swarm
            wanted = cfg.distribution_model.services(cfg)
            self.services = ServiceSupervisor(
                wanted, self.db_path, run_id, log_dir, service_core_sets([s.cores for s in wanted], core_sets, self.leased_cores),
                float(cfg.model_options()["join_timeout_s"]), initial, env_extra=self._child_env(),
                network=self.network, first_namespace=cfg.peers)
            initial = self.services.start(store)
            for i in range(n_local):
                self._spawn(run_id, i, core_sets[i], initial, log_dir)
            return self._watch(store, run_id)
        churn = cfg.distribution_model.churn(cfg) if cfg.distribution_model.churn is not None else []
        self.churn = ChurnSchedule(churn) if churn else None
        if churn:  # the schedule as carried out (random_churn drawn), for the report
            store.add_event(run_id, None, "churn_schedule", events=[e.model_dump(exclude_none=True) for e in churn])
        late = self.churn.late_peers() if self.churn else set()
        first = self._spawn(run_id, 0, core_sets[0], initial, log_dir)
        if swarm and not initial:
            initial = self._wait_for_maddrs(store, run_id, first)
            if n_local < cfg.peers:
                print(f"waiting for {cfg.peers - n_local} remote peer(s); join with:\n  ddlscope peer --run-id {run_id} "
                      f"--strategy {cfg.strategy} --index {n_local} --peers {cfg.peers} --initial-peers {' '.join(initial)} "
                      f"--config <the same run config>", file=sys.stderr)
        for i in range(1, n_local):
            if i not in late:
                self._spawn(run_id, i, core_sets[i], initial, log_dir)
        self._core_sets, self._log_dir = core_sets, log_dir
        return self._watch(store, run_id)

    def _wait_for_maddrs(self, store: ResultsStore, run_id: str, first: WorkerProcess) -> list[str]:
        """The multiaddrs the first peer of a swarm recorded in the store once it listens.

        Raises:
            RuntimeError: it exited first, or did not listen within the model's ``join_timeout_s``.
        """
        join_timeout_s = float(self.cfg.model_options()["join_timeout_s"])
        deadline = time.monotonic() + join_timeout_s
        while time.monotonic() < deadline:
            rows = [r for r in store.workers(run_id) if r["worker_index"] == 0]
            if rows and rows[0]["maddrs"]:
                return json.loads(rows[0]["maddrs"])
            if first.popen.poll() is not None:
                raise RuntimeError(f"the first peer exited (code {first.popen.returncode}) before listening: "
                                   f"{_log_tail(first.log_path)}")
            time.sleep(0.1)
        raise RuntimeError(f"the first peer did not start listening within join_timeout_s = "
                           f"{join_timeout_s:g} s; see {first.log_path}")

    # ------------------------------------------------------------------ watch
    def _watch(self, store: ResultsStore, run_id: str) -> tuple[str, str | None]:
        """Wait for every worker to end; ``(status, reason)`` of the run.

        Raises:
            StoreLostError: the store file was removed or replaced.
        """
        total = self.cfg.max_steps_per_peer()
        n_bars = self.cfg.peers if self.cfg.distribution_model.launcher == "torchrun" or self.churn else len(self.workers)
        bar = _ProgressBars(n_bars, total, self.cfg.run_label) if self.progress and self.nnodes == 1 else None
        store_id = _file_identity(self.db_path)
        try:
            while True:
                codes = {w.index: w.popen.poll() for w in self.workers}
                if _file_identity(self.db_path) != store_id:
                    raise StoreLostError(f"the results store {self.db_path} was removed or replaced during run {run_id}; "
                                         f"every process of the run was stopped, nothing more is stored")
                self._track_worker_pids(store, run_id)
                if self.services is not None:
                    self.services.tick(store)
                if self.churn is not None:
                    self._churn_tick(store, run_id)
                    codes = {w.index: w.popen.poll() for w in self.workers}
                if bar:
                    bar.update(store.step_counts(run_id))
                failed = [i for i, c in codes.items() if c not in (None, 0)]
                if failed:  # one killed by a signal first: the others fail because of it
                    return self._failure(store, run_id, min(failed, key=lambda i: (codes[i] >= 0, i)))
                if all(c == 0 for c in codes.values()):
                    return ("completed", None) if self.churn is None else self._end_of_churn(store, run_id)
                time.sleep(0.5)
        finally:
            if bar:
                bar.update(store.step_counts(run_id))
                bar.close()

    # ------------------------------------------------------------------ churn
    def _churn_tick(self, store: ResultsStore, run_id: str) -> None:
        """Do the churn actions that are due (see :mod:`ddlscope.launch.churn`); the schedule's clock starts
        at the swarm's first stored step, so that start-up time (joining the DHT) does not shift it."""
        if self._churn_start is None:
            if not store.step_counts(run_id):
                return
            self._churn_start = time.monotonic()
        elapsed = time.monotonic() - self._churn_start
        for action in self.churn.due(elapsed):
            current = next((w for w in self.workers if w.index == action.peer), None)
            alive = current is not None and current.popen.poll() is None
            if action.kind in ("join", "rejoin"):
                if alive:
                    self._churn_event(store, run_id, action, "churn_skipped", why="the peer is still running")
                    continue
                initial = self._alive_maddrs(store, run_id)
                if not initial:  # nobody to join: the swarm emptied, the watch ends the run
                    self._churn_event(store, run_id, action, "churn_skipped", why="no peer alive to join")
                    continue
                if current is not None:
                    self.workers.remove(current)
                    self.departed.append(current)
                self._spawn(run_id, action.peer, self._core_sets[action.peer], initial, self._log_dir)
                self._churn_event(store, run_id, action, f"peer_{action.kind}", initial_peers=len(initial))
            elif not alive:
                self._churn_event(store, run_id, action, "churn_skipped", why="the peer had already ended")
            elif action.kind == "leave":
                row = next((r for r in store.workers(run_id) if r["worker_index"] == action.peer), None)
                if row is None or row["status"] != "training":  # its handler is set up once it trains
                    self.churn.defer(action)
                    continue
                os.kill(current.popen.pid, signal.SIGUSR1)
                self._churn_event(store, run_id, action, "peer_leave")
            else:  # kill: the peer's whole process group, as a crash or a pulled cable would
                try:
                    os.killpg(current.popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                current.popen.wait()
                self.workers.remove(current)
                self.departed.append(current)
                store.upsert_worker(run_id, action.peer, status="failed",
                                    reason=f"killed with SIGKILL at {action.at_s:g} s, as scheduled (collaborative.churn)")
                self._churn_event(store, run_id, action, "peer_kill")

    def _churn_event(self, store: ResultsStore, run_id: str, action: ChurnAction, kind: str, **detail) -> None:
        store.add_event(run_id, action.peer, kind, action=action.kind, at_s=action.at_s,
                        elapsed_s=round(time.monotonic() - (self._churn_start or time.monotonic()), 3), **detail)

    def _alive_maddrs(self, store: ResultsStore, run_id: str) -> list[str]:
        """Multiaddrs of the peers whose processes run now (what a joining peer bootstraps from)."""
        alive = {w.index for w in self.workers if w.popen.poll() is None}
        found: list[str] = []
        for row in store.workers(run_id):
            if row["worker_index"] in alive and row["maddrs"]:
                found += json.loads(row["maddrs"])
        return found

    def _end_of_churn(self, store: ResultsStore, run_id: str) -> tuple[str, str | None]:
        """``(status, reason)`` of a churned swarm whose processes have all ended: ``completed`` when some
        peer finished its budget, else ``failed`` (the swarm emptied); pending actions are cancelled."""
        for action in self.churn.cancel():
            self._churn_event(store, run_id, action, "churn_cancelled", why="no peer was running any more")
        finished = [r["worker_index"] for r in store.workers(run_id)
                    if r["status"] == "completed" and not str(r["reason"] or "").startswith("left the swarm")]
        if finished:
            return "completed", None
        gone = [e for e in store.rows("events", run_id) if e["kind"] in ("peer_leave", "peer_kill")]
        last = (f" (last: peer {gone[-1]['worker_index']}, {gone[-1]['kind'][5:]} at "
                f"{json.loads(gone[-1]['detail_json'])['at_s']:g} s)") if gone else ""
        return "failed", f"the swarm emptied: every peer left or was killed before finishing its budget{last}"

    def _track_worker_pids(self, store: ResultsStore, run_id: str) -> None:
        """Remember the pids the workers recorded (torchrun starts them in sessions of their own)."""
        for row in store.workers(run_id):
            if row["pid"]:
                self.worker_pids.add(row["pid"])

    def _failure(self, store: ResultsStore, run_id: str, index: int) -> tuple[str, str]:
        """``(status, reason)`` of a run whose process ``index`` ended with a non-zero code: "peer 1 killed by
        SIGKILL", "worker 0 stopped by SIGTERM" (interrupted), "disk full writing <db>", "worker 0 exited with code
        1: <its recorded reason>". A worker that recorded its own failure and then died by a signal on its way
        out (a library aborting in its shutdown) keeps its recorded reason first: "peer 1 failed: <reason>
        (then killed by SIGABRT on its way out; ...)"; one that recorded a stop and was then killed (its own
        backstop after ``GRACE_S`` in :mod:`ddlscope.train.worker`, when unwinding took longer) is
        ``interrupted``: "peer 1 stopped by SIGTERM (forced after grace period) (not sent by the launcher;
        then killed by SIGKILL on its way out; ...)"."""
        wp = next(w for w in self.workers if w.index == index)
        code = wp.popen.returncode
        if index < 0:  # a torchrun agent: name the worker that failed first
            if code < 0:
                return "failed", f"torchrun agent (pid {wp.popen.pid}) {describe_exit(code)} (log: {wp.log_path})"
            return _first_failure(store.workers(run_id), self.workers_here, wp)
        who = f"{'peer' if self.cfg.distribution_model.launcher == 'swarm' else 'worker'} {index}"
        row = next((r for r in store.workers(run_id) if r["worker_index"] == index), None)
        recorded = row["reason"] if row is not None and row["reason"] else None
        if code < 0 and recorded and row["status"] == "failed":  # it failed first, then died on its way out
            return "failed", f"{who} failed: {recorded} (then {describe_exit(code)} on its way out; log: {wp.log_path})"
        if code < 0 and recorded and row["status"] == "interrupted":  # stopped, then its own backstop (or a
            # library on its way out) ended it: the stop came first, and not from this launcher
            return "interrupted", (f"{who} {recorded} (not sent by the launcher; then {describe_exit(code)} on its way "
                                   f"out; log: {wp.log_path})")
        if code < 0:
            return "failed", f"{who} {describe_exit(code)} (log: {wp.log_path})"
        if code == EXIT_DISK_FULL:
            return "failed", disk_full_message(self.db_path, f"{who} stopped")
        if code == EXIT_INTERRUPTED:
            return "interrupted", f"{who} {recorded or 'was stopped by a signal'} (not sent by the launcher)"
        return "failed", f"{who} exited with code {code}: {recorded or _log_tail(wp.log_path)}"

    # ------------------------------------------------------------------ stop
    def _stop_all(self) -> None:
        """End every worker: SIGTERM to the worker, wait up to GRACE_S, then SIGKILL its whole group.

        SIGTERM goes to the worker process alone so it can stop its DataLoader workers and
        hivemind itself and record its status; the group kill afterwards catches what is left
        (p2pd, loader workers, hivemind's averager, stuck leaders). Workers torchrun started lead
        sessions of their own: they are ended by the pids they recorded.
        """
        self._stopping = True  # a stop signal from now on changes nothing
        services = self.services.popens() if self.services is not None else []
        stop_processes([w.popen for w in self.workers + self.departed] + services, GRACE_S, other_groups=self.worker_pids)

    def _mark_unfinished_workers(self, store: ResultsStore, run_id: str, status: str, reason: str | None) -> None:
        for row in store.workers(run_id):
            if row["status"] in ("starting", "training"):
                store.upsert_worker(run_id, row["worker_index"], status=status if status != "completed" else "failed",
                                    reason=reason or "ended without reporting a status")


def service_core_sets(wanted: list[int], worker_core_sets: list[list[int]], cores: list[int] | None = None
                      ) -> list[list[int]]:
    """Cores for each service: ``wanted[i]`` cores each, taken first from the cores no worker uses,
    then round-robin over all of this process's cores (shared with the workers).

    Args:
        wanted: cores each service asks for (>= 1).
        worker_core_sets: the workers' core sets on this host.
        cores: the cores ddlscope may use (default: this process's affinity).
    """
    from ddlscope.config import available_cores

    cores = cores if cores is not None else available_cores()
    used = {c for cs in worker_core_sets for c in cs}
    order = [c for c in cores if c not in used] + [c for c in cores if c in used]
    sets, at = [], 0
    for n in wanted:
        take = [order[(at + k) % len(order)] for k in range(min(n, len(order)))]
        at += len(take)
        sets.append(sorted(set(take)))
    return sets


def _file_identity(path: Path) -> tuple[int, int] | None:
    """``(device, inode)`` of a file, None if it is gone: tells a removed or replaced store."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _interrupt_reason(err: KeyboardInterrupt) -> str:
    """Why the launcher stopped a run: Ctrl-C, or the signal it received."""
    name = err.args[0] if isinstance(err, LauncherSignal) and err.args else "SIGINT"
    if name == "SIGINT":
        return "interrupted by the user (Ctrl-C)"
    why = {"SIGTERM": "e.g. kill or a scheduler", "SIGHUP": "its terminal closed"}.get(name)
    return f"interrupted: the launcher received {name}" + (f" ({why})" if why else "")


def _first_failure(rows, peers: int, agent: WorkerProcess) -> tuple[str, str]:
    """``(status, reason)`` of a torchrun run whose agent exited non-zero: a worker that died without a word,
    else the agent stopped by a signal from outside (its log says it received one; it stopped every worker),
    else a worker stopped by a signal from outside (the first to stop; the agent stopped the others after it)
    unless a worker failed before it (then torchrun's agent stopped the survivors: a CI run, 2026-12-06, had
    worker 0 stopped by it before it saw worker 1's failure), else the first recorded failure."""
    silent = [r for r in rows if r["status"] in ("starting", "training")]
    def at(row) -> float:
        return row["failed_at"] or float("inf")

    # the first to stop or fail, by the time its training raised (a peer it took down stops or fails later)
    stopped = sorted((r for r in rows if r["status"] == "interrupted"), key=at)
    failed = sorted((r for r in rows if r["status"] == "failed"), key=at)
    code = agent.popen.returncode
    if len(rows) < peers:
        return "failed", f"only {len(rows)} of {peers} workers started: {_log_tail(agent.log_path)}"
    if silent:
        index = silent[0]["worker_index"]
        exit_code = _torchrun_exit_codes(agent.log_path).get(index)
        how = f"{describe_exit(exit_code)}, as torchrun reports" if exit_code is not None else "killed?"
        return "failed", (f"worker {index} died without recording a reason ({how}); torchrun exited with code "
                          f"{code}: {_log_tail(agent.log_path)}")
    if stopped and len(stopped) == len(rows) and _agent_was_signalled(agent.log_path):
        return "interrupted", (f"torchrun agent (pid {agent.popen.pid}) was stopped (exit code {code}, not by the "
                               f"launcher); its workers: {stopped[0]['reason']}")
    # a worker that failed before the first one was stopped is the cause: torchrun then stops the others itself
    if stopped and not (failed and at(failed[0]) < at(stopped[0])):
        return "interrupted", (f"worker {stopped[0]['worker_index']} {stopped[0]['reason']} (not sent by the "
                               f"launcher); the others stopped with it")
    if failed:
        return "failed", f"worker {failed[0]['worker_index']} failed: {failed[0]['reason']}"
    return "failed", f"torchrun exited with code {code}: {_log_tail(agent.log_path)}"


def _agent_was_signalled(log_path: Path) -> bool:
    """Whether torchrun's agent logged that it received a stop signal ("Received SIGTERM death signal,
    shutting down workers", torch.distributed.elastic's agent), rather than stopping its workers because
    one of them stopped first."""
    try:
        return "death signal" in log_path.read_text(errors="replace")
    except OSError:
        return False


def _torchrun_exit_codes(log_path: Path) -> dict[int, int]:
    """Exit codes by rank from torchrun's failure summary in its log (``rank : 1 ...`` then ``exitcode : -9``)."""
    import re

    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return {}
    return {int(rank): int(code) for rank, code in
            re.findall(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)", text)}


def _log_tail(path: Path) -> str:
    """The last lines of a worker's log and where it is, for a run's failure reason."""
    return f"{log_tail(path) or '(empty or no log)'} (log: {path})"


def prepare_dataset(cfg: RunConfig) -> None:
    """Materialize/validate the run's dataset once, before any worker starts.

    Raises:
        UserError / DatasetError: unknown dataset or missing/corrupt files (with the path).
    """
    from ddlscope.workloads.datasets import default_data_root, open_dataset

    root = cfg.data_root or default_data_root()
    for split in ("train", "test"):
        dataset, _ = open_dataset(cfg.dataset, root, split)
        if len(dataset) == 0:
            raise UserError(f"dataset {cfg.dataset!r} has an empty {split} split under {root}")
        dataset[0]  # decode one sample: a corrupt file fails here, with its path, before any worker starts


class _ProgressBars:
    """One rich progress bar per worker, fed with step counts from the store."""

    def __init__(self, n: int, total: int | None, label: str):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TimeRemainingColumn(), transient=False)
        self.tasks = [self.progress.add_task(f"{label} worker {i}", total=total) for i in range(n)]
        self.progress.start()

    def update(self, counts: dict[int, int]) -> None:
        for i, task in enumerate(self.tasks):
            self.progress.update(task, completed=counts.get(i, 0))

    def close(self) -> None:
        self.progress.stop()


def run_local(cfg: RunConfig, db_path: Path, group_name: str | None = None, progress: bool = True,
              local_workers: int | None = None, nnodes: int = 1, rdzv_endpoint: str | None = None,
              run_id: str | None = None, local_addr: str | None = None) -> str:
    """Run ``cfg`` on this machine (this node's share on a cluster) and return its run id. See :class:`LocalLauncher`."""
    return LocalLauncher(cfg, Path(db_path), group_name, local_workers, progress, nnodes=nnodes,
                         rdzv_endpoint=rdzv_endpoint, run_id=run_id, local_addr=local_addr).run()


def interface_of(address: str) -> str:
    """The name of this host's network interface that holds ``address`` (an IPv4 or IPv6 address).

    Raises:
        UserError: no interface of this host (of this network namespace) has it.
    """
    import psutil

    interfaces = psutil.net_if_addrs()
    for name, addrs in interfaces.items():
        if any(a.address.split("%")[0] == address for a in addrs):
            return name
    held = sorted({a.address for addrs in interfaces.values() for a in addrs if a.family.name in ("AF_INET", "AF_INET6")})
    raise UserError(f"--local-addr {address} is not an address of this host; allowed: one of {', '.join(held)}")
