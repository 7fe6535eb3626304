"""Results store: one SQLite file (WAL) that every worker writes to while the run goes.

Each process opens its own connection; rows are committed as they are measured, so a run that
crashes or is killed keeps everything measured up to its last step. The training loop's per-step
rows are the exception: they go through a :class:`BatchedWriter`, a thread of the worker with a
connection of its own that commits them every ``store_flush_interval_s`` (run config, default 1 s),
when the loop ends, and on SIGTERM/SIGINT (the loop's ``finally``). A worker killed with SIGKILL
loses at most the steps of the last flush interval (the loop reads its steps' values from the
device within half an interval and commits every half interval: :mod:`ddlscope.train.loop`). Tables:

- ``runs``: one row per run — config (JSON), status (running / completed / failed /
  interrupted), reason, times, group name, the host and pid (with its start time) of the process
  that created it and, for a sweep's cells, ``cell_key`` (the canonical JSON of the cell's
  overrides, see :mod:`ddlscope.sweep.grid`).
- ``workers``: one row per worker/peer — host, pid (with its start time), cores, status, training start/end.
- ``steps``: one row per step (micro-batch) per worker — the step-time breakdown.
- ``evals``: held-out accuracy and loss, per worker, after a step, with the training time so far.
- ``host_samples``: background samples of CPU %, RSS, network, disk, context switches.
- ``events``: averaging rounds and other things that happen between steps.
- ``predictions``: the predictor's figures for a cell, linked to the run that measured it.
- ``services``: processes a run needs besides its workers (dmoe's expert servers): one row per
  process started (a restarted server is a new ``generation``), with pid, multiaddrs, status.
- ``moe_steps``: per step of a dmoe trainer — beam-search time, remote forward / backward wait,
  calls, failed calls, samples no expert answered, payload bytes.
- ``moe_calls``: per step, trainer, expert and direction (forward/backward) — calls, failures,
  summed and largest latency, bytes sent and received, and the server (peer id) that answered.
- ``moe_server_batches``: every batch an expert server processed — expert, direction, samples,
  queue wait of its oldest request, compute seconds.
- ``moe_server_samples``: background samples of an expert server's CPU seconds and memory
  (proportional set size of its process tree).
- ``network_links``: a run on an emulated network (``[network] emulate = true``): each peer's
  namespace, address, configured upload/download limits (Mbit/s; NULL unlimited), the bytes its
  interface sent and received and the packets its rate limits dropped, read when the run ended.

A run whose processes were killed stays ``running`` in the file; :meth:`ResultsStore.mark_stale_runs`
(called by the read-only commands) marks such runs ``interrupted`` once every process recorded for
them on this host is gone, and removes the run's temporary folder (``runs.tmp_dir``). A write that
fails because the disk is full raises :class:`StoreFullError` where the caller asks for it
(:func:`is_disk_full`). :meth:`ResultsStore.delete_runs` removes runs with every row linked to them.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil
import socket
import sqlite3
import queue
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import psutil

from ddlscope.errors import UserError
from ddlscope.launch.processes import RUN_TMP_PREFIX, remove_run_temp_dir

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY, name TEXT NOT NULL, strategy TEXT NOT NULL, config_json TEXT NOT NULL,
    status TEXT NOT NULL, reason TEXT, created_at REAL NOT NULL, ended_at REAL, host TEXT, group_name TEXT
);
CREATE TABLE IF NOT EXISTS workers (
    run_id TEXT NOT NULL, worker_index INTEGER NOT NULL, hostname TEXT, pid INTEGER, cores TEXT,
    status TEXT NOT NULL, reason TEXT, maddrs TEXT, train_start_time REAL, train_end_time REAL, eval_s REAL,
    peak_memory_bytes INTEGER, failed_at REAL,
    PRIMARY KEY (run_id, worker_index)
);
CREATE TABLE IF NOT EXISTS steps (
    run_id TEXT NOT NULL, worker_index INTEGER NOT NULL, step INTEGER NOT NULL, wall_time REAL NOT NULL,
    samples INTEGER NOT NULL, data_load_s REAL, forward_s REAL, backward_s REAL, optimizer_s REAL,
    averaging_s REAL, step_s REAL, loss REAL, accuracy REAL, samples_per_s REAL, warmup INTEGER NOT NULL,
    optimizer_stepped INTEGER NOT NULL, global_epoch INTEGER, averaging_round INTEGER NOT NULL DEFAULT 0,
    averaging_group_size INTEGER, averaging_succeeded INTEGER, comm_s REAL, comm_wait_s REAL, bubble_s REAL,
    comm_bytes INTEGER, background_cpu_s REAL, samples_discarded INTEGER,
    PRIMARY KEY (run_id, worker_index, step)
);
CREATE TABLE IF NOT EXISTS evals (
    run_id TEXT NOT NULL, worker_index INTEGER NOT NULL, step INTEGER NOT NULL, wall_time REAL NOT NULL,
    train_time_s REAL NOT NULL, accuracy REAL NOT NULL, loss REAL NOT NULL, samples INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS host_samples (
    run_id TEXT NOT NULL, worker_index INTEGER NOT NULL, wall_time REAL NOT NULL, cpu_percent REAL,
    rss_bytes INTEGER, net_sent_bytes INTEGER, net_recv_bytes INTEGER, disk_read_bytes INTEGER,
    disk_write_bytes INTEGER, ctx_switches INTEGER
);
CREATE TABLE IF NOT EXISTS events (
    run_id TEXT NOT NULL, worker_index INTEGER, wall_time REAL NOT NULL, kind TEXT NOT NULL, detail_json TEXT
);
CREATE TABLE IF NOT EXISTS predictions (
    prediction_id TEXT PRIMARY KEY, group_name TEXT, cell_key TEXT NOT NULL, strategy TEXT NOT NULL,
    workers INTEGER NOT NULL, batch_size INTEGER NOT NULL, microbatches INTEGER, predicted_step_s REAL,
    predicted_epoch_s REAL, memory_bytes INTEGER, capacity_bytes INTEGER, fits INTEGER, dominant_cost TEXT,
    detail_json TEXT, run_id TEXT, created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS services (
    run_id TEXT NOT NULL, kind TEXT NOT NULL, service_index INTEGER NOT NULL, generation INTEGER NOT NULL,
    pid INTEGER, pid_started_at REAL, cores TEXT, maddrs TEXT, peer_id TEXT, experts TEXT, status TEXT NOT NULL,
    reason TEXT, started_at REAL, ended_at REAL,
    PRIMARY KEY (run_id, kind, service_index, generation)
);
CREATE TABLE IF NOT EXISTS moe_steps (
    run_id TEXT NOT NULL, worker_index INTEGER NOT NULL, step INTEGER NOT NULL, wall_time REAL NOT NULL,
    samples INTEGER NOT NULL, beam_search_s REAL, expert_forward_s REAL, expert_backward_s REAL,
    forward_calls INTEGER, backward_calls INTEGER, failed_calls INTEGER, samples_dropped INTEGER,
    bytes_sent INTEGER, bytes_received INTEGER, experts_chosen INTEGER,
    PRIMARY KEY (run_id, worker_index, step)
);
CREATE TABLE IF NOT EXISTS moe_calls (
    run_id TEXT NOT NULL, worker_index INTEGER NOT NULL, step INTEGER NOT NULL, expert TEXT NOT NULL,
    direction TEXT NOT NULL, peer_id TEXT, calls INTEGER NOT NULL, failed INTEGER NOT NULL, latency_s_sum REAL,
    latency_s_max REAL, bytes_sent INTEGER, bytes_received INTEGER
);
CREATE TABLE IF NOT EXISTS moe_server_batches (
    run_id TEXT NOT NULL, service_index INTEGER NOT NULL, generation INTEGER NOT NULL, wall_time REAL NOT NULL,
    expert TEXT NOT NULL, direction TEXT NOT NULL, batch_size INTEGER NOT NULL, queue_wait_s REAL, compute_s REAL
);
CREATE TABLE IF NOT EXISTS moe_server_samples (
    run_id TEXT NOT NULL, service_index INTEGER NOT NULL, generation INTEGER NOT NULL, wall_time REAL NOT NULL,
    cpu_s REAL, pss_bytes INTEGER
);
CREATE TABLE IF NOT EXISTS network_links (
    run_id TEXT NOT NULL, worker_index INTEGER NOT NULL, namespace TEXT, address TEXT,
    upload_mbit_per_s REAL, download_mbit_per_s REAL, bytes_sent INTEGER, bytes_received INTEGER,
    drops_upload INTEGER, drops_download INTEGER, PRIMARY KEY (run_id, worker_index)
);
CREATE INDEX IF NOT EXISTS moe_calls_by_run ON moe_calls (run_id, worker_index, step);
CREATE INDEX IF NOT EXISTS moe_batches_by_run ON moe_server_batches (run_id, service_index);
CREATE INDEX IF NOT EXISTS steps_by_run ON steps (run_id, worker_index);
CREATE INDEX IF NOT EXISTS host_by_run ON host_samples (run_id, worker_index);
"""

RUN_STATUSES = ("running", "completed", "failed", "interrupted")
STEP_COLUMNS = (
    "step", "wall_time", "samples", "data_load_s", "forward_s", "backward_s", "optimizer_s", "averaging_s",
    "step_s", "loss", "accuracy", "samples_per_s", "warmup", "optimizer_stepped", "global_epoch",
    "averaging_round", "averaging_group_size", "averaging_succeeded", "comm_s", "comm_wait_s", "bubble_s",
    "comm_bytes", "background_cpu_s", "samples_discarded",
)
# columns added after the first release: (table, column, type); older databases get them on open
ADDED_COLUMNS = (
    ("workers", "peak_memory_bytes", "INTEGER"), ("steps", "comm_s", "REAL"), ("steps", "comm_wait_s", "REAL"),
    ("steps", "bubble_s", "REAL"), ("steps", "comm_bytes", "INTEGER"), ("runs", "cell_key", "TEXT"),
    ("workers", "failed_at", "REAL"), ("steps", "background_cpu_s", "REAL"),
    ("runs", "launcher_pid", "INTEGER"), ("runs", "launcher_started_at", "REAL"), ("workers", "pid_started_at", "REAL"),
    ("moe_server_samples", "pss_bytes", "INTEGER"), ("runs", "tmp_dir", "TEXT"),
    ("steps", "samples_discarded", "INTEGER"),
)
MEASUREMENT_TABLES = ("moe_steps", "moe_calls", "moe_server_batches", "moe_server_samples", "network_links")
"""Tables written with :meth:`ResultsStore.add_rows` (rows as dicts of their columns)."""


def check_measurement_table(table: str) -> None:
    """Raises ValueError unless ``table`` is one of :data:`MEASUREMENT_TABLES`."""
    if table not in MEASUREMENT_TABLES:
        raise ValueError(f"unknown table {table!r}; allowed: {', '.join(MEASUREMENT_TABLES)}")


UNFINISHED_WORKER_STATUSES = ("starting", "training")
RESERVE_FILE = ".disk-reserve"
"""File in a run's log folder (``<db folder>/logs/<run id>/``) holding space to record the run's end on a full disk."""
PID_START_TOLERANCE_S = 1.0
"""Seconds two start times of one process may differ by (clock ticks, rounding); more means the pid was reused."""
HOST_COLUMNS = (
    "wall_time", "cpu_percent", "rss_bytes", "net_sent_bytes", "net_recv_bytes", "disk_read_bytes",
    "disk_write_bytes", "ctx_switches",
)


class StoreFullError(UserError):
    """The results store could not be written because its disk is full; the message names the file."""


class TrainingDiverged(RuntimeError):
    """A figure to store is not finite (NaN or infinite loss): the training diverged; the message names the worker and step."""


DISK_FULL_FREE_BYTES = 1 << 20
"""Free bytes below which SQLite's ``disk I/O error`` (it cannot grow its ``-shm``/``-wal`` files) counts as a full disk."""


def is_disk_full(err: BaseException, path: Path | str | None = None) -> bool:
    """Whether ``err`` says that the disk is full: SQLite's ``database or disk is full`` (SQLITE_FULL), an
    ``OSError`` with ``ENOSPC``/``EDQUOT``, or SQLite's ``disk I/O error`` while the disk of ``path`` (the
    database) has less than :data:`DISK_FULL_FREE_BYTES` free."""
    if isinstance(err, sqlite3.OperationalError):
        if "disk is full" in str(err) or getattr(err, "sqlite_errorname", "") == "SQLITE_FULL":
            return True
        if "disk I/O error" in str(err) and path is not None:
            try:
                return shutil.disk_usage(Path(path).parent).free < DISK_FULL_FREE_BYTES
            except OSError:
                return False
        return False
    return isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)


def disk_full_message(path: Path | str, what: str = "") -> str:
    """``disk full writing <path>`` and, if given, what could not be written."""
    return f"disk full writing {path}" + (f": {what}" if what else "")


def process_start_time(pid: int) -> float | None:
    """Start time of process ``pid`` on this host (Unix seconds), or None if there is none or it cannot be read."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError, ValueError, OverflowError):
        return None


def _process_alive(pid: int, started_at: float | None, started_before: float | None) -> bool:
    """Whether the process recorded as ``pid`` still runs on this host (pid reuse told apart by start time).

    ``started_at``: the start time recorded with the pid (Unix seconds); the process alive under that pid
    now must have started then. Without it (older databases), it must have started before
    ``started_before`` (the last time the run recorded anything), as a process that reused the pid of a
    dead one started after it died. A zombie counts as dead; a process we may not inspect counts as alive.
    """
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        created = proc.create_time()
    except (psutil.NoSuchProcess, ValueError, OverflowError):  # gone, or not a valid pid
        return False
    except (psutil.AccessDenied, OSError):
        return True
    if started_at is not None:
        return abs(created - started_at) <= PID_START_TOLERANCE_S
    if started_before is not None:
        return created <= started_before + PID_START_TOLERANCE_S
    return True


def default_db_path() -> Path:
    """``./ddlscope-results/ddlscope.db`` in the user's working directory."""
    return Path.cwd() / "ddlscope-results" / "ddlscope.db"


class ResultsStore:
    """A connection to the results database. Safe to open from many processes at once.

    Args:
        path: the SQLite file; created with its folder if missing.

    Every write commits immediately (WAL, ``synchronous=NORMAL``), so readers in other
    processes see progress and a killed writer loses at most the row it was writing; rows written
    through a :meth:`batched_writer` are committed every flush interval instead.

    Raises:
        StoreFullError: the disk is full (SQLite cannot even open the file in WAL mode then).
    """

    def __init__(self, path: Path | str):
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.conn = sqlite3.connect(self.path, timeout=60.0, isolation_level=None)
            self.conn.row_factory = sqlite3.Row
            self._when_unlocked(lambda: self.conn.execute("PRAGMA journal_mode=WAL"))
            self.conn.execute("PRAGMA synchronous=NORMAL")
            self._when_unlocked(lambda: self.conn.executescript(SCHEMA))
            self._add_missing_columns()
        except (sqlite3.OperationalError, OSError) as err:
            if is_disk_full(err, self.path):
                raise StoreFullError(disk_full_message(self.path, "the results store cannot be opened; free some space")
                                     ) from None
            raise

    @staticmethod
    def _when_unlocked(do: Callable[[], Any], timeout_s: float = 60.0) -> None:
        """Run ``do``, again while SQLite says the database is locked, for up to ``timeout_s``: two
        processes opening a new store at once (torchrun's ranks) race for its switch to WAL, which
        fails at once with "database is locked" instead of waiting for the busy timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                do()
                return
            except sqlite3.OperationalError as err:
                if "locked" not in str(err) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _add_missing_columns(self) -> None:
        """Bring a database written by an older ddlscope up to this schema (keeps all rows)."""
        for table, column, kind in ADDED_COLUMNS:
            have = {row[1] for row in self.conn.execute(f"PRAGMA table_info({table})")}
            if column not in have:
                try:
                    self.conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
                except sqlite3.OperationalError as err:  # another process added it a moment ago
                    if "duplicate column" not in str(err):
                        raise

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> "ResultsStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ runs
    def create_run(self, name: str, strategy: str, config: dict[str, Any], group_name: str | None = None,
                   run_id: str | None = None) -> str:
        """Insert a run in status ``running`` and return its id (a short random hex string).

        The calling process is recorded as the run's launcher (host name, pid and the pid's start
        time), so a later reader can tell a run whose processes are all gone (see :meth:`mark_stale_runs`).
        An existing ``run_id`` is left as it is.
        """
        run_id = run_id or uuid.uuid4().hex[:12]
        pid = os.getpid()
        self.conn.execute(
            "INSERT OR IGNORE INTO runs (run_id, name, strategy, config_json, status, created_at, host, group_name, "
            "launcher_pid, launcher_started_at) VALUES (?, ?, ?, ?, 'running', ?, ?, ?, ?, ?)",
            (run_id, name, strategy, json.dumps(config, default=str), time.time(), socket.gethostname(), group_name,
             pid, process_start_time(pid)),
        )
        return run_id

    def finish_run(self, run_id: str, status: str, reason: str | None = None) -> None:
        """Set a run's final status (one of completed / failed / interrupted) and end time."""
        if status not in RUN_STATUSES:
            raise ValueError(f"status {status!r}; allowed: {RUN_STATUSES}")
        self.conn.execute("UPDATE runs SET status = ?, reason = ?, ended_at = ? WHERE run_id = ?",
                          (status, reason, time.time(), run_id))

    def end_running_run(self, run_id: str, status: str, reason: str) -> bool:
        """Set a run's final status only if it is still ``running`` (the first process to tell wins:
        e.g. the first worker to see its launcher gone; each worker records its own row). Returns
        whether this call ended it.

        Raises:
            ValueError: ``status`` is not a final status.
        """
        if status not in RUN_STATUSES[1:]:
            raise ValueError(f"status {status!r}; allowed: {RUN_STATUSES[1:]}")
        cur = self.conn.execute("UPDATE runs SET status = ?, reason = ?, ended_at = ? WHERE run_id = ? AND status = 'running'",
                                (status, reason, time.time(), run_id))
        return bool(cur.rowcount)

    def update_run(self, run_id: str, *, strategy: str | None = None, config: dict[str, Any] | None = None) -> None:
        """Change a running run's ``strategy`` and/or ``config_json`` (a recorder learns them while the run goes:
        the distribution wrapper when the model is watched, the batch size at the first step)."""
        if strategy is not None:
            self.conn.execute("UPDATE runs SET strategy = ? WHERE run_id = ?", (strategy, run_id))
        if config is not None:
            self.conn.execute("UPDATE runs SET config_json = ? WHERE run_id = ?",
                              (json.dumps(config, default=str), run_id))

    def complete_run_if_workers_completed(self, run_id: str, workers: int) -> bool:
        """Set a ``running`` run ``completed`` once ``workers`` of its worker rows are ``completed`` (the last
        worker of a job to finish ends the run; one SQL statement, so two finishing at once cannot both miss
        it). Returns whether this call ended it."""
        cur = self.conn.execute(
            "UPDATE runs SET status = 'completed', reason = NULL, ended_at = ? WHERE run_id = ? AND status = 'running' "
            "AND (SELECT COUNT(*) FROM workers WHERE run_id = ? AND status = 'completed') >= ?",
            (time.time(), run_id, run_id, workers))
        return bool(cur.rowcount)

    def set_tmp_dir(self, run_id: str, path: Path | str) -> None:
        """Record the run's own temporary folder, removed when the run is found stale (:meth:`mark_stale_runs`)."""
        self.conn.execute("UPDATE runs SET tmp_dir = ? WHERE run_id = ?", (str(path), run_id))

    def run(self, run_id: str) -> sqlite3.Row | None:
        return self.conn.execute("SELECT * FROM runs WHERE run_id = ?", (run_id,)).fetchone()

    def run_record(self, run_id: str) -> dict[str, Any]:
        """A run as a JSON-ready dict: every ``runs`` column, ``config`` (parsed) and its ``workers`` rows.

        Raises:
            KeyError: no run with that id.
        """
        row = self.run(run_id)
        if row is None:
            raise KeyError(f"no run {run_id!r} in {self.path}")
        record = {k: row[k] for k in row.keys() if k != "config_json"}
        record["config"] = json.loads(row["config_json"])
        record["workers"] = [dict(w) for w in self.workers(run_id)]
        return record

    def run_config(self, run_id: str) -> dict[str, Any]:
        row = self.run(run_id)
        if row is None:
            raise KeyError(f"no run {run_id!r} in {self.path}")
        return json.loads(row["config_json"])

    def mark_stale_runs(self) -> list[str]:
        """Mark ``interrupted`` every run still ``running`` whose processes are all gone from this host.

        A run is judged only if it was created on this host (``runs.host``) and none of its workers
        recorded another host (a cluster run is not judged by local pids), and only by the pids it
        recorded: its launcher's (the process that created it) and its workers'. It is stale when none
        of them is alive, a pid now used by a process that started at another time counting as gone.
        A run with no pid recorded (a database written before pids were) is left alone. Its workers
        still ``starting``/``training`` are marked ``interrupted`` with the same reason; ``ended_at`` is
        the last time the run recorded anything. The run's temporary folder (``tmp_dir``) is removed,
        also for runs that ended but whose folder is still there (their last process removes it, or not).

        A database that cannot be written (a full disk, a read-only file) is still read: the stale runs
        are returned, but stay ``running`` in the file.

        Returns:
            The ids of the runs found stale (empty when none was).
        """
        marked = []
        for run in self.conn.execute("SELECT * FROM runs WHERE status = 'running' ORDER BY created_at").fetchall():
            if self.run_processes_alive(run) is not False:
                continue
            host = run["host"]
            reason = (f"its processes are gone (killed?): no worker or launcher alive on host {host} "
                      f"at {time.strftime('%Y-%m-%d %H:%M:%S')}")
            marked.append(run["run_id"])
            try:
                cur = self.conn.execute("UPDATE runs SET status = 'interrupted', reason = ?, ended_at = ? "
                                        "WHERE run_id = ? AND status = 'running'",
                                        (reason, self._last_activity(run), run["run_id"]))
                if cur.rowcount:
                    self.conn.execute(
                        f"UPDATE workers SET status = 'interrupted', reason = ? WHERE run_id = ? AND status IN "
                        f"({', '.join('?' * len(UNFINISHED_WORKER_STATUSES))})",
                        (reason, run["run_id"], *UNFINISHED_WORKER_STATUSES))
            except sqlite3.OperationalError:  # disk full or read-only: nothing can be written, the run is still stale
                pass
            remove_run_temp_dir(run["tmp_dir"])
            (self.path.parent / "logs" / run["run_id"] / RESERVE_FILE).unlink(missing_ok=True)
        self._remove_stale_tmp_dirs()
        return marked

    def _remove_stale_tmp_dirs(self) -> None:
        """Remove the temporary folders of ended runs of this host whose processes are all gone."""
        for run in self.conn.execute("SELECT * FROM runs WHERE tmp_dir IS NOT NULL AND status != 'running'").fetchall():
            path = Path(run["tmp_dir"])
            if path.name.startswith(RUN_TMP_PREFIX) and path.is_dir() and self.run_processes_alive(run) is False:
                shutil.rmtree(path, ignore_errors=True)

    def run_processes_alive(self, run: sqlite3.Row | str) -> bool | None:
        """Whether a process recorded for a run (its launcher or a worker) still runs on this host.

        Args:
            run: a ``runs`` row or a run id.

        Returns:
            True if one is alive; False if every recorded one is gone; None if this host cannot tell:
            the run was created on another host, a worker recorded another host, or no pid is recorded.

        Raises:
            KeyError: no run with that id.
        """
        if isinstance(run, str):
            row = self.run(run)
            if row is None:
                raise KeyError(f"no run {run!r} in {self.path}")
            run = row
        here = socket.gethostname()
        if run["host"] not in (None, here):
            return None
        workers = self.workers(run["run_id"])
        if any(w["hostname"] not in (None, here) for w in workers):
            return None
        checks = []
        if run["launcher_pid"]:
            checks.append((run["launcher_pid"], run["launcher_started_at"], run["created_at"]))
        if any(w["pid"] for w in workers):
            last = self._last_activity(run)
            checks += [(w["pid"], w["pid_started_at"], last) for w in workers if w["pid"]]
        if not checks:
            return None
        return any(_process_alive(pid, started_at, before) for pid, started_at, before in checks)

    def _last_activity(self, run: sqlite3.Row) -> float:
        """The last time (Unix seconds) a run recorded anything: creation, a step, a sample, an event, a worker time."""
        run_id = run["run_id"]
        times = [run["created_at"]]
        for sql in ("SELECT MAX(wall_time) FROM steps WHERE run_id = ?",
                    "SELECT MAX(wall_time) FROM host_samples WHERE run_id = ?",
                    "SELECT MAX(wall_time) FROM events WHERE run_id = ?",
                    "SELECT MAX(MAX(COALESCE(train_start_time, 0), COALESCE(train_end_time, 0), COALESCE(failed_at, 0))) "
                    "FROM workers WHERE run_id = ?"):
            value = self.conn.execute(sql, (run_id,)).fetchone()[0]
            if value:
                times.append(float(value))
        return max(times)

    def delete_runs(self, run_ids: list[str]) -> dict[str, int]:
        """Delete runs and every row linked to them, in one transaction.

        Every table with a ``run_id`` column is cleared of the runs' rows (steps, evals, host samples,
        events, workers, the predictions their runs measured, and any table added later), then the
        ``runs`` rows themselves. Whether a run is still alive is the caller's business
        (:meth:`run_processes_alive`).

        Returns:
            Rows deleted per table (tables with none left out), ``runs`` included.

        Raises:
            KeyError: an id is not in the store (nothing is deleted then).
        """
        ids = list(dict.fromkeys(run_ids))
        missing = [r for r in ids if self.run(r) is None]
        if missing:
            raise KeyError(f"no run(s) {missing} in {self.path}")
        tables = [name for (name,) in self.conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name != 'runs' ORDER BY name")
            if "run_id" in {row[1] for row in self.conn.execute(f"PRAGMA table_info({name})")}]
        deleted: dict[str, int] = {}
        marks = ", ".join("?" * len(ids))
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            for table in [*tables, "runs"]:
                n = self.conn.execute(f"DELETE FROM {table} WHERE run_id IN ({marks})", ids).rowcount
                if n:
                    deleted[table] = n
            self.conn.execute("COMMIT")
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        return deleted

    def runs(self, group_name: str | None = None) -> list[sqlite3.Row]:
        """All runs, newest first; with ``group_name``, only that group's runs, oldest first."""
        if group_name is None:
            return self.conn.execute("SELECT * FROM runs ORDER BY created_at DESC").fetchall()
        return self.conn.execute("SELECT * FROM runs WHERE group_name = ? ORDER BY created_at", (group_name,)).fetchall()

    def set_cell_key(self, run_id: str, cell_key: str) -> None:
        """Tag a run as the run of a sweep cell (``cell_key``: canonical JSON of the cell's overrides)."""
        self.conn.execute("UPDATE runs SET cell_key = ? WHERE run_id = ?", (cell_key, run_id))

    # ------------------------------------------------------------------ workers
    def upsert_worker(self, run_id: str, worker_index: int, **fields: Any) -> None:
        """Create or update a worker row; ``fields`` are columns of ``workers``.

        A ``pid`` (of a process on this host) is stored with its start time (``pid_started_at``),
        so a reader can tell the worker from a later process that reused the pid.
        """
        if fields.get("pid") and "pid_started_at" not in fields:
            fields["pid_started_at"] = process_start_time(int(fields["pid"]))
        self.conn.execute(
            "INSERT OR IGNORE INTO workers (run_id, worker_index, status) VALUES (?, ?, 'starting')",
            (run_id, worker_index),
        )
        if fields:
            cols = ", ".join(f"{k} = ?" for k in fields)
            self.conn.execute(f"UPDATE workers SET {cols} WHERE run_id = ? AND worker_index = ?",
                              (*fields.values(), run_id, worker_index))

    def workers(self, run_id: str) -> list[sqlite3.Row]:
        return self.conn.execute("SELECT * FROM workers WHERE run_id = ? ORDER BY worker_index", (run_id,)).fetchall()

    # ------------------------------------------------------------------ measurements
    def add_step(self, run_id: str, worker_index: int, row: dict[str, Any]) -> None:
        """Store one step; ``row`` has the keys of :data:`STEP_COLUMNS` (missing ones are NULL)."""
        self.conn.execute(
            f"INSERT OR REPLACE INTO steps (run_id, worker_index, {', '.join(STEP_COLUMNS)}) "
            f"VALUES (?, ?, {', '.join('?' * len(STEP_COLUMNS))})",
            (run_id, worker_index, *(row.get(c) for c in STEP_COLUMNS)),
        )

    def add_host_sample(self, run_id: str, worker_index: int, sample: dict[str, Any]) -> None:
        self.conn.execute(
            f"INSERT INTO host_samples (run_id, worker_index, {', '.join(HOST_COLUMNS)}) "
            f"VALUES (?, ?, {', '.join('?' * len(HOST_COLUMNS))})",
            (run_id, worker_index, *(sample.get(c) for c in HOST_COLUMNS)),
        )

    def host_sample_writer(self, run_id: str, worker_index: int) -> Callable[[dict[str, Any]], None]:
        """A sink for :class:`~ddlscope.measure.host.HostSampler` that may be called from any thread: a
        thread other than this connection's own writes through a connection of its own (an SQLite
        connection may only be used by the thread that opened it), opened on its first sample."""
        owner = threading.get_ident()
        local = threading.local()

        def write(sample: dict[str, Any]) -> None:
            if threading.get_ident() == owner:
                self.add_host_sample(run_id, worker_index, sample)
                return
            if getattr(local, "store", None) is None:
                if not self.path.exists():  # removed during the run: never make a new, empty store in its place
                    return
                local.store = ResultsStore(self.path)
            local.store.add_host_sample(run_id, worker_index, sample)

        return write

    def add_eval(self, run_id: str, worker_index: int, step: int, train_time_s: float, accuracy: float, loss: float,
                 samples: int) -> None:
        """Store a held-out evaluation after ``step``; ``train_time_s`` is training time so far, evaluations excluded.

        Raises:
            TrainingDiverged: the loss or accuracy is NaN or infinite (SQLite would store NaN as NULL, which the
                table refuses): the run then fails with this as its reason, not with a constraint error.
        """
        if not (math.isfinite(loss) and math.isfinite(accuracy)):
            raise TrainingDiverged(f"worker {worker_index}: the held-out loss is {loss} (accuracy {accuracy}) after step "
                                   f"{step}: training diverged (its parameters are not finite)")
        self.conn.execute("INSERT INTO evals VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                          (run_id, worker_index, step, time.time(), train_time_s, accuracy, loss, samples))

    def add_event(self, run_id: str, worker_index: int | None, kind: str, **detail: Any) -> None:
        self._insert_event(run_id, worker_index, time.time(), kind, detail)

    def _insert_event(self, run_id: str, worker_index: int | None, wall_time: float, kind: str,
                      detail: dict[str, Any]) -> None:
        self.conn.execute("INSERT INTO events VALUES (?, ?, ?, ?, ?)",
                          (run_id, worker_index, wall_time, kind, json.dumps(detail, default=str)))

    def batched_writer(self, flush_interval_s: float) -> "BatchedWriter":
        """A :class:`BatchedWriter` of steps and events into this store's file (started)."""
        return BatchedWriter(self.path, flush_interval_s)

    # ------------------------------------------------------------------ services (dmoe's expert servers)
    def upsert_service(self, run_id: str, kind: str, index: int, generation: int, **fields: Any) -> None:
        """Create or update the row of one process of a service; ``fields`` are columns of ``services``.

        A ``pid`` is stored with its start time, like a worker's (:meth:`upsert_worker`).
        """
        if fields.get("pid") and "pid_started_at" not in fields:
            fields["pid_started_at"] = process_start_time(int(fields["pid"]))
        self.conn.execute("INSERT OR IGNORE INTO services (run_id, kind, service_index, generation, status) "
                          "VALUES (?, ?, ?, ?, 'starting')", (run_id, kind, index, generation))
        if fields:
            cols = ", ".join(f"{k} = ?" for k in fields)
            self.conn.execute(f"UPDATE services SET {cols} WHERE run_id = ? AND kind = ? AND service_index = ? "
                              f"AND generation = ?", (*fields.values(), run_id, kind, index, generation))

    def services(self, run_id: str) -> list[sqlite3.Row]:
        """The run's service processes, by kind, index and generation."""
        return self.conn.execute("SELECT * FROM services WHERE run_id = ? ORDER BY kind, service_index, generation",
                                 (run_id,)).fetchall()

    def add_rows(self, table: str, rows: list[dict[str, Any]]) -> None:
        """Insert measurement rows into one of :data:`MEASUREMENT_TABLES` in one transaction.

        Raises:
            ValueError: ``table`` is not one of them.
        """
        check_measurement_table(table)
        if not rows:
            return
        self.conn.execute("BEGIN")
        try:
            self._insert_rows(table, rows)
            self.conn.execute("COMMIT")
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise

    def _insert_rows(self, table: str, rows: list[dict[str, Any]]) -> None:
        """:meth:`add_rows` inside the caller's transaction."""
        if rows:
            cols = list(rows[0])
            self.conn.executemany(f"INSERT OR REPLACE INTO {table} ({', '.join(cols)}) VALUES "
                                  f"({', '.join('?' * len(cols))})", [tuple(r.get(c) for c in cols) for r in rows])

    def rows(self, table: str, run_id: str) -> list[dict[str, Any]]:
        """All rows of ``table`` for a run as dicts, ordered by worker and time."""
        if table not in ("steps", "evals", "host_samples", "events", "workers", "services", *MEASUREMENT_TABLES):
            raise ValueError(f"unknown table {table!r}")
        order = {"steps": "worker_index, step", "workers": "worker_index", "moe_steps": "worker_index, step",
                 "moe_calls": "worker_index, step", "services": "kind, service_index, generation",
                 "network_links": "worker_index"}.get(table, "wall_time")
        cur = self.conn.execute(f"SELECT * FROM {table} WHERE run_id = ? ORDER BY {order}", (run_id,))
        return [dict(r) for r in cur.fetchall()]

    # ------------------------------------------------------------------ predictions
    def add_prediction(self, cell_key: str, strategy: str, workers: int, batch_size: int, *,
                       group_name: str | None = None, microbatches: int | None = None,
                       predicted_step_s: float | None = None, predicted_epoch_s: float | None = None,
                       memory_bytes: int | None = None, capacity_bytes: int | None = None, fits: bool | None = None,
                       dominant_cost: str | None = None, detail: dict[str, Any] | None = None,
                       run_id: str | None = None) -> str:
        """Store one prediction (seconds, bytes) next to the measurements; returns its id.

        ``cell_key`` names the cell (the label its real run gets), so validating is a join on it.
        """
        pid = uuid.uuid4().hex[:12]
        self.conn.execute(
            "INSERT INTO predictions VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (pid, group_name, cell_key, strategy, workers, batch_size, microbatches, predicted_step_s,
             predicted_epoch_s, memory_bytes, capacity_bytes, None if fits is None else int(fits), dominant_cost,
             json.dumps(detail or {}, default=str), run_id, time.time()))
        return pid

    def link_prediction(self, prediction_id: str, run_id: str) -> None:
        """Record which real run measured a prediction."""
        self.conn.execute("UPDATE predictions SET run_id = ? WHERE prediction_id = ?", (run_id, prediction_id))

    def predictions(self, group_name: str | None = None) -> list[dict[str, Any]]:
        """Stored predictions (of one group, or all), oldest first."""
        sql, args = "SELECT * FROM predictions", ()
        if group_name is not None:
            sql, args = sql + " WHERE group_name = ?", (group_name,)
        return [dict(r) for r in self.conn.execute(sql + " ORDER BY created_at", args).fetchall()]

    def step_counts(self, run_id: str) -> dict[int, int]:
        """Steps stored so far per worker (for progress bars)."""
        cur = self.conn.execute("SELECT worker_index, COUNT(*) FROM steps WHERE run_id = ? GROUP BY worker_index", (run_id,))
        return {int(w): int(n) for w, n in cur.fetchall()}


class BatchedWriter:
    """Writes steps and events from a thread of its own, committing them in batches.

    The training thread only appends to a queue (:meth:`add_step`, :meth:`add_event`); the writer
    thread, through its own :class:`ResultsStore` connection (an SQLite connection belongs to the
    thread that opened it), wakes every ``flush_interval_s`` seconds and commits what has queued up
    in one transaction, and everything at once on :meth:`flush` and :meth:`close`. A row queued does
    not wake it: a thread woken at every step takes the interpreter lock from the training thread
    at every step, which the training loop pays for (issue 16's overhead target). What a SIGKILL
    loses is what had not been committed yet: at most the rows of the last ``flush_interval_s``
    seconds.

    Args:
        path: the results store's SQLite file.
        flush_interval_s: seconds between commits, > 0.

    Raises:
        ValueError: ``flush_interval_s`` is not > 0.
        whatever the writer thread's last write raised (e.g. ``sqlite3.OperationalError`` when the
            disk is full; see :func:`is_disk_full`), from the next :meth:`add_step`,
            :meth:`add_event`, :meth:`flush` or :meth:`close` of the training thread.
    """

    def __init__(self, path: Path | str, flush_interval_s: float):
        if not flush_interval_s > 0:
            raise ValueError(f"flush_interval_s = {flush_interval_s!r}; allowed: a number of seconds > 0")
        self.path, self.flush_interval_s = Path(path), float(flush_interval_s)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()  # set by flush() and close(): commit now, not at the interval's end
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ddlscope-store-writer", daemon=True)
        self._thread.start()

    def add_step(self, run_id: str, worker_index: int, row: dict[str, Any]) -> None:
        """Queue one step (as :meth:`ResultsStore.add_step`)."""
        self._put(("step", run_id, worker_index, row))

    def add_event(self, run_id: str, worker_index: int | None, kind: str, **detail: Any) -> None:
        """Queue one event (as :meth:`ResultsStore.add_event`, timed now, not when it is written)."""
        self._put(("event", run_id, worker_index, time.time(), kind, detail))

    def add_rows(self, table: str, rows: list[dict[str, Any]]) -> None:
        """Queue measurement rows (as :meth:`ResultsStore.add_rows`).

        Raises:
            ValueError: ``table`` is not one of :data:`MEASUREMENT_TABLES` (at once, not when written).
        """
        check_measurement_table(table)
        self._put(("rows", table, rows))

    def flush(self) -> None:
        """Block until everything queued so far is committed."""
        done = threading.Event()
        self._put(("flush", done))
        self._wake.set()
        while not done.wait(0.1):
            if not self._thread.is_alive():
                break
        self._raise_error()

    def close(self) -> None:
        """Commit everything queued and end the writer thread (again: wait for that end)."""
        if not self._closed:
            self._closed = True
            self._queue.put(("close",))
            self._wake.set()
        self._thread.join()
        self._raise_error()

    def __enter__(self) -> "BatchedWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _put(self, item: tuple) -> None:
        self._raise_error()
        if self._closed:
            raise ValueError("the batched writer is closed")
        self._queue.put(item)

    def _raise_error(self) -> None:
        if self._error is not None:  # stays: rows queued after it would never be written
            raise self._error

    def _run(self) -> None:
        store = None
        try:
            store = ResultsStore(self.path)
            while True:
                self._wake.wait(self.flush_interval_s)
                self._wake.clear()  # before draining: a flush queued from now on sets it again
                batch = []
                with contextlib.suppress(queue.Empty):
                    while True:
                        batch.append(self._queue.get_nowait())
                self._write(store, [item for item in batch if item[0] in ("step", "event", "rows")])
                for item in batch:
                    if item[0] == "flush":
                        item[1].set()
                if any(item[0] == "close" for item in batch):
                    return
        except BaseException as err:  # handed to the training thread; flush() waiters see the thread end
            self._error = err
        finally:
            if store is not None:
                store.close()

    @staticmethod
    def _write(store: "ResultsStore", items: list[tuple]) -> None:
        if not items:
            return
        store.conn.execute("BEGIN IMMEDIATE")  # the write lock now (waiting for it), not half-way through
        try:
            for kind, *args in items:
                if kind == "step":
                    store.add_step(*args)
                elif kind == "rows":
                    store._insert_rows(*args)
                else:
                    store._insert_event(*args)
            store.conn.execute("COMMIT")
        except BaseException:
            store.conn.execute("ROLLBACK")
            raise
