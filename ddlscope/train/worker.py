"""Entry point of one worker process: ``python -m ddlscope.train.worker --db ... --run-id ...``.

The launcher starts one of these per worker/peer, each in its own process group (so the group,
hivemind's daemons included, can be ended as one), pinned to its cores. For the torch.distributed
distribution models, torch's elastic launcher starts them instead (``torchrun ... -m
ddlscope.train.worker --core-sets 0;1 ...``): the worker then takes its index, the number of
workers and its local rank from ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``, and its cores from
``--core-sets`` (one comma-separated set per local rank, separated by ``;``). The worker reads the
run's config from the results store, trains, and records its own status there: ``completed``,
``failed`` (with the reason) or ``interrupted`` (SIGTERM/SIGINT/SIGHUP).

With ``--die-with-parent`` (every worker a launcher starts) the worker watches its launcher: Linux
sends it SIGTERM when its parent dies (``PR_SET_PDEATHSIG``), and a thread checks the launcher's
pid recorded with the run (torchrun's workers' parent is the agent). A worker whose launcher is
gone stops, ends its children, and records the run as ``interrupted`` with "launcher (pid N)
died ..." (the first worker to see it wins), since a launcher killed by SIGKILL records nothing.
When the results store's disk is full it stops with one line ``error: disk full writing <db>``.

Exit codes: 0 completed, 1 failed, 2 bad input (UserError), 3 the store's disk is full, 130 interrupted.
"""

from __future__ import annotations

import argparse
import errno
import faulthandler
import json
import os
import signal
import socket
import sqlite3
import sys
import threading
import time
import traceback

from ddlscope.launch.processes import (die_with_parent, end_children, remove_run_temp_dir, route_hivemind_sockets,
                                       shut_tcp_connections)

GRACE_S = 5.0
LAUNCHER_POLL_S = 0.5
"""Seconds between two checks that the launcher is alive."""
EXIT_DISK_FULL = 3
CLEANUP_WAIT_S = 10.0
"""Seconds the worker that cleans up after a dead launcher waits for the run's other workers to end."""


class Interrupted(KeyboardInterrupt):
    """Raised in the main thread when the worker is asked to stop (SIGTERM, SIGINT or SIGHUP).

    A ``KeyboardInterrupt``, as Ctrl-C would raise: hivemind 1.1.12's ``Optimizer.load_state_from_peers``
    retries its download of the swarm's state on every other exception (read in its source), so a
    stop that landed there was swallowed and retried until the grace period ran out (one way a peer
    is "forced after grace period"). Its other loops catch even this one; the strategy then stops at
    the end of the step (:meth:`Strategy.check_stop`).
    """


def _stop_handler(on_deadline):
    """A signal handler that raises :class:`Interrupted` and, as a backstop, ends the process group.

    Only the first signal raises; later ones are ignored, so that they cannot break the stop.
    Libraries may swallow the exception (hivemind catches BaseException around averaging
    rounds; the strategy then stops at its next step, :meth:`Strategy.check_stop`) or block in C
    code; so the first signal also arms a timer that, after ``GRACE_S``, writes where the main
    thread is to the worker's log, calls ``on_deadline`` (records the status) and SIGKILLs this
    worker's own process group — hivemind's averager processes and p2pd daemon included.

    The handler carries ``stop_requested`` (an Event, set by the first signal), ``signal_name`` and
    ``stopped_at`` (``time.monotonic()`` of the first signal, None before).
    """
    fired = threading.Event()
    owner_pid = os.getpid()

    def _deadline():
        try:
            _say(f"the worker did not stop within {GRACE_S:g} s of {handler.signal_name}; its main thread was at:\n"
                 + main_thread_stack())
            on_deadline()
        finally:
            os.killpg(os.getpgrp(), signal.SIGKILL)

    def handler(signum, frame):
        if os.getpid() != owner_pid:  # a forked child (hivemind's averager) inherited this handler
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if fired.is_set():  # already stopping: a second signal (the parent's death seen twice) must not break the stop
            return
        handler.signal_name = signal.Signals(signum).name
        handler.stopped_at = time.monotonic()
        fired.set()
        timer = threading.Timer(GRACE_S, _deadline)
        timer.daemon = True
        timer.start()
        raise Interrupted(signal.Signals(signum).name)

    handler.stop_requested = fired
    handler.signal_name = None
    handler.stopped_at = None
    return handler


class LauncherWatch:
    """Watches the launcher of a run (its pid and start time as recorded with the run) from a worker.

    Args:
        launcher_pid / launcher_started_at: from the run's row; None (another host, or not recorded):
            nothing is watched.
    """

    def __init__(self, launcher_pid: int | None, launcher_started_at: float | None):
        self.pid = launcher_pid
        self.started_at = launcher_started_at
        self.gone = threading.Event()

    def alive(self) -> bool:
        """False once the launcher's process is gone (a later process under its pid counts as gone)."""
        if self.pid is None:
            return True
        from ddlscope.store.db import _process_alive

        if not _process_alive(self.pid, self.started_at, None):
            self.gone.set()
        return not self.gone.is_set()

    def start(self) -> None:
        """Check every ``LAUNCHER_POLL_S`` in a daemon thread; when the launcher is gone, SIGTERM this worker
        (the same stop as the launcher's own)."""
        def loop() -> None:
            while self.alive():
                self.gone.wait(LAUNCHER_POLL_S)
            os.kill(os.getpid(), signal.SIGTERM)

        if self.pid is not None:
            threading.Thread(target=loop, name="ddlscope-launcher-watch", daemon=True).start()

    def reason(self) -> str:
        """The run's reason when the launcher is gone."""
        return (f"launcher (pid {self.pid}) died without stopping the run (killed by SIGKILL, or it crashed); "
                f"its workers stopped themselves")


def main_thread_stack() -> str:
    """The main thread's stack as ``traceback`` formats it, innermost call last ("" when it is gone): where a
    worker that ignores its stop is stuck, written to its log before the grace period's SIGKILL."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    return "".join(traceback.format_stack(frame)).rstrip() if frame is not None else ""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ddlscope.train.worker")
    p.add_argument("--db", required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--worker-index", type=int, help="default: $RANK (torchrun)")
    p.add_argument("--num-workers", type=int, help="default: $WORLD_SIZE (torchrun)")
    p.add_argument("--cores", help="comma-separated core ids")
    p.add_argument("--core-sets", help="under torchrun: ';'-separated core sets, one per local rank")
    p.add_argument("--initial-peers", nargs="*", default=[])
    p.add_argument("--listen", nargs="*", default=None)
    p.add_argument("--die-with-parent", action="store_true",
                   help="stop when the parent or the run's launcher dies (a launcher's workers)")
    return p.parse_args(argv)


def serve_worker(db: str, run_id: str, worker_index: int, num_workers: int, cores: list[int],
                 initial_peers: list[str], listen: list[str] | None = None, local_rank: int = 0,
                 watch_launcher: bool = False) -> int:
    """Run one worker in this process and return its exit code (see the module docstring).

    Args:
        watch_launcher: stop when the run's launcher (recorded with the run, on this host) is gone.
    """
    from ddlscope.store.db import ResultsStore, StoreFullError, is_disk_full

    os.sched_setaffinity(0, cores)
    try:
        store = ResultsStore(db)
    except StoreFullError:
        return _store_failed(db, OSError(errno.ENOSPC, "disk full"))
    watch = LauncherWatch(None, None)
    recorded = threading.Event()  # the worker's own final status is in the store

    def record_interrupted():
        if not os.path.isfile(db):  # a removed store is not made again
            return
        if recorded.is_set():  # it stopped in time; only its exit (children, hivemind's threads) overran
            _say(f"the worker recorded its stop within {GRACE_S:g} s; its exit did not end in time")
            return
        with ResultsStore(db) as late:
            late.upsert_worker(run_id, worker_index, status="interrupted", reason=_stop_reason(handler, watch) +
                               " (forced after grace period)")
            if not watch.alive():
                late.end_running_run(run_id, "interrupted", watch.reason())
        if not watch.alive():
            end_children()  # before waiting for the other workers: nothing of this one lingers meanwhile
            clean_up_after_launcher(db, run_id, worker_index)

    handler = _stop_handler(record_interrupted)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, handler)
    try:
        store.upsert_worker(run_id, worker_index, hostname=socket.gethostname(), pid=os.getpid(),
                            cores=",".join(map(str, cores)), status="starting")
        run = store.run(run_id)
        if watch_launcher and run is not None and run["host"] == socket.gethostname():
            watch = LauncherWatch(run["launcher_pid"], run["launcher_started_at"])
            watch.start()
        code = _train(store, run_id, worker_index, num_workers, cores, initial_peers, listen, local_rank, handler,
                      watch)
    except Interrupted:  # a stop before training began
        code = _record(store, db, run_id, worker_index, "interrupted", _stop_reason(handler, watch), 130, watch)
    except (sqlite3.OperationalError, OSError) as e:
        if is_disk_full(e, db):
            return _store_failed(db, e)
        raise
    recorded.set()
    if handler.stopped_at is not None:  # how much of the grace period the stop took, for the log
        _say(f"status recorded {time.monotonic() - handler.stopped_at:.2f} s after {handler.signal_name}")
    return code


def _train(store, run_id: str, worker_index: int, num_workers: int, cores: list[int], initial_peers: list[str],
           listen: list[str] | None, local_rank: int, handler, watch: LauncherWatch) -> int:
    from ddlscope.config import RunConfig
    from ddlscope.errors import UserError
    from ddlscope.store.db import is_disk_full
    from ddlscope.strategies import WorkerContext
    from ddlscope.strategies.base import StopRequested
    from ddlscope.train.loop import run_worker

    db = str(store.path)
    cfg = RunConfig(**store.run_config(run_id))
    if cfg.distribution_model.launcher == "swarm":
        route_hivemind_sockets()
    ctx = WorkerContext(
        run_id=run_id, worker_index=worker_index, num_workers=num_workers, cores=cores,
        initial_peers=initial_peers, listen_maddrs=listen, local_rank=local_rank, store=store,
        announce=lambda maddrs: store.upsert_worker(run_id, worker_index, maddrs=json.dumps(maddrs)),
        stop_requested=handler.stop_requested,
    )
    try:
        reason = run_worker(cfg, ctx, store)
        return _record(store, db, run_id, worker_index, "completed", reason, 0, watch)
    except (KeyboardInterrupt, StopRequested):  # Interrupted, the stop signals' exception, is a KeyboardInterrupt
        return _record(store, db, run_id, worker_index, "interrupted", _stop_reason(handler, watch), 130, watch)
    except UserError as e:
        _say(f"error: {e}")
        return _record(store, db, run_id, worker_index, "failed", str(e), 2, watch)
    except Exception as e:  # record every other failure with its reason, then exit non-zero
        if is_disk_full(e, db):
            return _store_failed(db, e, store, run_id, worker_index)
        _say(traceback.format_exc().rstrip())
        if handler.stop_requested.is_set():  # a library turned our stop into its own error
            return _record(store, db, run_id, worker_index, "interrupted", f"{_stop_reason(handler, watch)} ({e})", 130,
                           watch)
        return _record(store, db, run_id, worker_index, "failed", f"{type(e).__name__}: {e}", 1, watch)


def _stop_reason(handler, watch: LauncherWatch) -> str:
    """Why a worker stopped: its launcher died, or the signal it got."""
    if not watch.alive():
        return f"stopped: {watch.reason()}"
    return f"stopped by {handler.signal_name or 'SIGINT'}"


def _record(store, db: str, run_id: str, worker_index: int, status: str, reason: str | None, code: int,
            watch: LauncherWatch) -> int:
    """Record the worker's final status (and the run's, when its launcher is gone); return ``code``, or the
    disk-full exit code when nothing can be written."""
    from ddlscope.store.db import is_disk_full

    try:
        store.upsert_worker(run_id, worker_index, status=status, reason=reason)
        if not watch.alive():
            store.end_running_run(run_id, "interrupted", watch.reason())
    except sqlite3.OperationalError as e:
        if not is_disk_full(e, db):
            raise
        return _store_failed(db, e)
    return code


def _say(line: str) -> None:
    """Print a line to stderr (the worker's log); nothing when the log's disk is full."""
    try:
        print(line, file=sys.stderr)
    except OSError:
        pass


def _store_failed(db: str, err: BaseException, store=None, run_id: str | None = None, worker_index: int | None = None
                  ) -> int:
    """The store cannot be written (its disk is full): one error line, the reason recorded if that still
    fits, exit code :data:`EXIT_DISK_FULL` (a store that cannot even be opened: the error re-raised)."""
    from ddlscope.store.db import disk_full_message, is_disk_full

    if not is_disk_full(err, db):
        raise err
    message = disk_full_message(db)
    _say(f"error: {message}")
    if store is not None:
        try:
            store.upsert_worker(run_id, worker_index, status="failed", reason=message)
        except sqlite3.OperationalError:
            pass
    return EXIT_DISK_FULL


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # a worker killed by a fatal signal in native code (SIGSEGV, SIGBUS, SIGFPE, SIGABRT, SIGILL) writes every
    # thread's Python stack to its log (stderr) first: the run's reason names the signal and the log, the log
    # says where (a collaborative peer died by SIGSEGV right after a background averaging round: stop 65)
    faulthandler.enable(all_threads=True)
    if args.die_with_parent:  # SIGTERM when the launcher dies: the worker records its status and stops (no orphans)
        die_with_parent(signal.SIGTERM)
    env = os.environ
    local_rank = int(env.get("LOCAL_RANK", 0))
    index = args.worker_index if args.worker_index is not None else int(env["RANK"])
    num_workers = args.num_workers if args.num_workers is not None else int(env["WORLD_SIZE"])
    cores = args.cores if args.cores is not None else args.core_sets.split(";")[local_rank]
    try:
        code = serve_worker(args.db, args.run_id, index, num_workers, [int(c) for c in cores.split(",")],
                            args.initial_peers, args.listen, local_rank, watch_launcher=args.die_with_parent)
    finally:
        end_children()  # hivemind's processes, loader workers: none outlives the worker
    if args.die_with_parent:
        clean_up_after_launcher(args.db, args.run_id, index)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except OSError:  # the log's disk is full
        pass
    os._exit(code)  # hivemind may leave non-daemon threads; the launcher ends the process group anyway


def clean_up_after_launcher(db: str, run_id: str, index: int) -> None:
    """When the run's launcher is gone, the last of its workers removes the run's temporary folder (``$TMPDIR``,
    see :func:`ddlscope.launch.processes.make_run_temp_dir`); see :func:`_last_one_out`."""
    if _last_one_out(db, run_id, index):
        remove_run_temp_dir(os.environ.get("TMPDIR"))


def _last_one_out(db: str, run_id: str, index: int) -> bool:
    """Whether this worker cleans up after a run whose launcher is gone: the launcher is dead, no worker with a
    lower index is alive (that one cleans up), and every worker with a higher index ended within
    :data:`CLEANUP_WAIT_S` (they stop at the same time). False when unsure (the next read of the store cleans up).

    Before it waits, it shuts the sending side of its TCP connections
    (:func:`~ddlscope.launch.processes.shut_tcp_connections`): a higher worker blocked in a collective that this
    one left would otherwise wait for this one to exit, and this one for it, until :data:`CLEANUP_WAIT_S`."""
    import time

    from ddlscope.store.db import ResultsStore, StoreFullError, _process_alive

    if not os.path.isfile(db):  # a removed store is not made again
        return False
    try:
        with ResultsStore(db) as store:
            run = store.run(run_id)
            if run is None or run["host"] != socket.gethostname() or not run["launcher_pid"]:
                return False
            if _process_alive(run["launcher_pid"], run["launcher_started_at"], None):
                return False
            others = [w for w in store.workers(run_id) if w["worker_index"] != index and w["pid"]]
    except (sqlite3.Error, StoreFullError):
        return False
    if any(_process_alive(w["pid"], w["pid_started_at"], None) for w in others if w["worker_index"] < index):
        return False
    shut_tcp_connections()  # a worker blocked in a collective with this one fails now, not when this one exits
    deadline = time.monotonic() + CLEANUP_WAIT_S
    while any(_process_alive(w["pid"], w["pid_started_at"], None) for w in others):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


if __name__ == "__main__":
    main()
