"""Start, schedule and end a run's services: the processes a swarm model needs besides its workers.

A distribution model's ``services`` (:class:`ddlscope.distribution.Service`; dmoe's expert
servers) are started by :class:`ServiceSupervisor` before the workers: the first service that
starts at time 0 alone, until it has recorded its multiaddrs in the store's ``services`` table; then
the others with those multiaddrs as initial peers. While the run goes, :meth:`ServiceSupervisor.tick`
carries out each service's schedule (start late, SIGKILL, start again as a new process — a new
*generation* of the same service), whose clock starts at the run's first stored step, as a swarm's
churn schedule does: start-up (hivemind's server start took 3-20 s on 2 busy cores) does not shift
it, so a kill at 5 s always falls into training and records what happens in the store (``services`` rows and
``service_started`` / ``service_killed`` / ``service_died`` events). A service that dies is not a
failure of the run: the workers decide whether they can go on. When the run ends every service's
process group is ended like the workers' (:func:`ddlscope.launch.processes.stop_processes`).

On an emulated network (:class:`~ddlscope.network.emulated.EmulatedNetwork`) each service runs in
a network namespace of its own, ``first_namespace + position`` (after the workers'), listening on
that namespace's address; every generation of a service starts in the same namespace.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ddlscope.distribution import Service
from ddlscope.launch.processes import log_tail, signal_group, start_process, stop_signals_held, wait_group_gone
from ddlscope.network.emulated import EmulatedNetwork
from ddlscope.store.db import ResultsStore


class _Silent(RuntimeError):
    """A service did not record its multiaddrs in time (it may hang rather than fail)."""


@dataclass
class _Process:
    service: Service
    generation: int
    popen: subprocess.Popen
    log_path: Path
    ended: bool = False


@dataclass
class ServiceSupervisor:
    """The services of one run on this machine.

    Args:
        services: what to start (each with its schedule).
        db_path / run_id: the results store and the run.
        log_dir: where each process's log goes (``<kind>-<index>[-<generation>].log``).
        core_sets: the cores of each service, by position in ``services``.
        join_timeout_s: how long the first service may take to record its multiaddrs.
        initial_peers: multiaddrs of a running swarm to join (empty: the first service bootstraps).
        env_extra: environment variables of every service process (the run's ``TMPDIR``).
        network / first_namespace: the run's emulated network, if any; service ``position`` then
            runs in its namespace ``first_namespace + position``.
    """

    services: list[Service]
    db_path: Path
    run_id: str
    log_dir: Path
    core_sets: list[list[int]]
    join_timeout_s: float
    initial_peers: list[str] = field(default_factory=list)
    env_extra: dict[str, str] = field(default_factory=dict)
    network: EmulatedNetwork | None = None
    first_namespace: int = 0
    processes: list[_Process] = field(default_factory=list)
    t0: float = 0.0
    schedule_t0: float | None = None
    _done: set[tuple[int, str]] = field(default_factory=set)

    # ------------------------------------------------------------------ start
    def start(self, store: ResultsStore) -> list[str]:
        """Start every service due at time 0 and return the swarm's multiaddrs for the workers.

        Raises:
            RuntimeError: the first service exited, or did not record its multiaddrs within
                ``join_timeout_s`` (the message has its log's last lines).
        """
        self.t0 = time.monotonic()
        first = next((i for i, s in enumerate(self.services) if s.start_at_s == 0), None)
        if first is None:
            return self.initial_peers
        proc = self._spawn(store, first, 0)
        if not self.initial_peers:
            self.initial_peers = self._first_maddrs(store, first, proc)
        for i, s in enumerate(self.services):
            if i != first and s.start_at_s == 0:
                self._spawn(store, i, 0)
        return self.initial_peers

    def _spawn(self, store: ResultsStore, position: int, generation: int) -> _Process:
        s = self.services[position]
        cores = self.core_sets[position]
        suffix = f"-{generation}" if generation else ""
        log_path = self.log_dir / f"{s.kind.replace(' ', '-')}-{s.index}{suffix}.log"
        cmd = [sys.executable, "-m", s.module, "--db", str(self.db_path), "--run-id", self.run_id,
               "--index", str(s.index), "--generation", str(generation), "--cores", ",".join(map(str, cores)),
               "--die-with-parent"]
        if self.initial_peers:
            cmd += ["--initial-peers", *self.initial_peers]
        if self.network is not None:  # inside its own namespace, listening on its address
            cmd = self.network.peer_command(self.first_namespace + position, cmd)
        with stop_signals_held():
            proc = _Process(s, generation, start_process(cmd, log_path, threads=len(cores), env_extra=self.env_extra),
                            log_path)
            self.processes.append(proc)
        store.add_event(self.run_id, None, "service_started", service=s.kind, index=s.index, generation=generation,
                        at_s=round(time.monotonic() - self.t0, 3), pid=proc.popen.pid)
        return proc

    def _first_maddrs(self, store: ResultsStore, position: int, proc: _Process) -> list[str]:
        """The first service's multiaddrs. hivemind's server start can hang (rarely; seen on a busy
        machine: the server logged its start and never became ready), so a first service silent for
        half of ``join_timeout_s`` is killed and started once more, as a new generation."""
        try:
            return self._wait_for_maddrs(store, proc, self.join_timeout_s / 2)
        except _Silent:
            s = proc.service
            signal_group(proc.popen.pid, signal.SIGKILL)
            proc.popen.wait()
            proc.ended = True
            store.upsert_service(self.run_id, s.kind, s.index, proc.generation, status="failed", ended_at=time.time(),
                                 reason=f"did not start listening within {self.join_timeout_s / 2:g} s; started again")
            return self._wait_for_maddrs(store, self._spawn(store, position, proc.generation + 1),
                                         self.join_timeout_s / 2)

    def _wait_for_maddrs(self, store: ResultsStore, proc: _Process, timeout_s: float) -> list[str]:
        deadline = time.monotonic() + timeout_s
        s = proc.service
        while time.monotonic() < deadline:
            row = next((r for r in store.services(self.run_id) if r["kind"] == s.kind and r["service_index"] == s.index
                        and r["generation"] == proc.generation), None)
            if row is not None and row["maddrs"]:
                return json.loads(row["maddrs"])
            if row is not None and row["status"] == "failed":
                raise RuntimeError(f"{s.kind} {s.index} failed before listening: {row['reason']}")
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{s.kind} {s.index} exited (code {proc.popen.returncode}) before listening: "
                                   f"{log_tail(proc.log_path) or '(empty log)'} (log: {proc.log_path})")
            time.sleep(0.1)
        raise _Silent(f"{s.kind} {s.index} did not start listening within {timeout_s:g} s (twice, of "
                      f"join_timeout_s = {self.join_timeout_s:g} s); see {proc.log_path}")

    # ------------------------------------------------------------------ schedule
    def tick(self, store: ResultsStore) -> None:
        """Carry out what the schedules say is due now (seconds since the run's first stored step;
        nothing before it), and record services that died on their own."""
        now = time.monotonic() - self.t0
        if self.schedule_t0 is None and store.step_counts(self.run_id):
            self.schedule_t0 = time.monotonic()
        scheduled = time.monotonic() - self.schedule_t0 if self.schedule_t0 is not None else -1.0
        for position, s in enumerate(self.services):
            if s.start_at_s > 0 and scheduled >= s.start_at_s and self._once(position, "start"):
                self._spawn(store, position, 0)
            if s.kill_at_s is not None and scheduled >= s.kill_at_s and self._once(position, "kill"):
                self._kill(store, position, now, scheduled)
            if s.restart_at_s is not None and scheduled >= s.restart_at_s and self._once(position, "restart"):
                self._spawn(store, position, 1 + max(p.generation for p in self.processes if p.service is s))
        for proc in self.processes:
            if not proc.ended and proc.popen.poll() is not None:
                proc.ended = True
                s = proc.service
                reason = (f"{s.kind} {s.index} exited on its own with code {proc.popen.returncode}: "
                          f"{log_tail(proc.log_path) or '(empty log)'}")
                store.upsert_service(self.run_id, s.kind, s.index, proc.generation, status="died", reason=reason,
                                     ended_at=time.time())
                store.add_event(self.run_id, None, "service_died", service=s.kind, index=s.index,
                                generation=proc.generation, at_s=round(now, 3), code=proc.popen.returncode)

    def _once(self, position: int, what: str) -> bool:
        key = (position, what)
        if key in self._done:
            return False
        self._done.add(key)
        return True

    def _kill(self, store: ResultsStore, position: int, now: float, scheduled: float) -> None:
        s = self.services[position]
        for proc in self.processes:
            if proc.service is s and not proc.ended:
                signal_group(proc.popen.pid, signal.SIGKILL)
                proc.popen.wait()
                wait_group_gone(proc.popen.pid, 5.0)
                proc.ended = True
                store.upsert_service(self.run_id, s.kind, s.index, proc.generation, status="killed",
                                     reason=f"killed with SIGKILL {scheduled:.1f} s after the first step, as scheduled", ended_at=time.time())
                store.add_event(self.run_id, None, "service_killed", service=s.kind, index=s.index,
                                generation=proc.generation, at_s=round(now, 3))

    # ------------------------------------------------------------------ end
    def popens(self) -> list[subprocess.Popen]:
        """Every process started (for :func:`ddlscope.launch.processes.stop_processes`)."""
        return [p.popen for p in self.processes]

    def record_stopped(self, store: ResultsStore) -> None:
        """After the run: services still marked starting/serving that ended get their final status."""
        for row in store.services(self.run_id):
            if row["status"] in ("starting", "serving"):
                store.upsert_service(self.run_id, row["kind"], row["service_index"], row["generation"],
                                     status="stopped", reason="stopped at the end of the run", ended_at=time.time())
