"""One expert server of a ``dmoe`` run: ``python -m ddlscope.moe.server --db DB --run-id RUN --index I``.

The launcher starts one of these per server (:func:`ddlscope.distribution.dmoe.expert_servers`),
each in its own process group and pinned to its cores, before the trainers. A server

1. joins the run's DHT (the first server bootstraps it; the others get its multiaddrs), listening
   on ``dmoe.listen_host`` (on an emulated network: its namespace's address, ``--listen``);
2. builds its block of the grid's experts (:meth:`~ddlscope.distribution.dmoe.DMoEConfig.server_uids`)
   with the run's optimizer, and serves them with hivemind 1.1.12's ``Server`` (one connection
   handler process, one Runtime thread that batches requests per expert, up to
   ``dmoe.max_batch_size`` samples), re-announcing them in the DHT every ``dmoe.update_period_s``
   seconds (they expire after twice that, so a dead server's experts disappear from beam search);
3. records in the store: its row in ``services`` (pid, multiaddrs, peer id, experts, status), every
   batch it processed (``moe_server_batches``: expert, forward/backward, samples, queue wait,
   compute seconds) and its CPU and memory (PSS) every ``host_sample_interval_s`` (``moe_server_samples``);
4. runs until SIGTERM/SIGINT (the launcher stops it when the trainers are done) or its parent dies.

The queue wait of a batch is the time from the arrival of its oldest sampled request (one in
:data:`STAMP_ONE_IN`) to the start of its compute (:func:`_measured_pool`): how long requests wait
for their batch to form and for the server's one compute thread.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from typing import Any

STOP_GRACE_S = 5.0
READY_TIMEOUT_S = 15.0
"""Seconds hivemind's ``Server`` gets to become ready (its runtime, task pools and connection-handler
process started) before this server gives up on that start and makes a fresh one. A start that never
became ready was seen in CI (2026-11-28, 11-29, 12-01): the server logged "Server started" and waited on
its connection handler forever, deaf to SIGINT, since hivemind 1.1.12 waits without a time limit.
Starts that did become ready took 1.6-2.2 s here (20 starts in the dmoe tests, 2026-12-01; 4-8 s
with the DHT's join on a busy machine, 2026-11-28); 30 s (until 2026-12-01) retried a restarted
server too late to serve the rest of a 30 s run."""
START_ATTEMPTS = 2
"""Starts of hivemind's ``Server`` (each with its own DHT) before the expert server fails."""
FLUSH_EVERY_S = 1.0
KIND = "expert server"


class _BatchLog:
    """Batches the Runtime thread processed, buffered and written to the store every second by the
    sampler thread (through its own connection: an SQLite connection belongs to its thread)."""

    def __init__(self, run_id: str, index: int, generation: int):
        self.run_id, self.index, self.generation = run_id, index, generation
        self.rows: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def add(self, expert: str, direction: str, batch_size: int, queue_wait_s: float | None, compute_s: float) -> None:
        with self.lock:
            self.rows.append(dict(run_id=self.run_id, service_index=self.index, generation=self.generation,
                                  wall_time=time.time(), expert=expert, direction=direction, batch_size=batch_size,
                                  queue_wait_s=queue_wait_s, compute_s=compute_s))

    def flush(self, store) -> None:
        with self.lock:
            rows, self.rows = self.rows, []
        store.add_rows("moe_server_batches", rows)


def _instrumented_backend(log: _BatchLog):
    """A hivemind ``ModuleBackend`` subclass that records each batch it processes into ``log``,
    with task pools that time their requests (:func:`_measured_pool`)."""
    from hivemind.moe.server import ModuleBackend

    pool_cls = _measured_pool()

    class MeasuredBackend(ModuleBackend):
        def __init__(self, *args, max_batch_size: int, **kwargs):
            super().__init__(*args, max_batch_size=max_batch_size, **kwargs)
            # the same pools hivemind makes, measured (not started yet: the Runtime starts them)
            self.forward_pool = pool_cls(self.forward, max_batch_size=max_batch_size, name=f"{self.name}_forward")
            self.backward_pool = pool_cls(self.backward, max_batch_size=max_batch_size, name=f"{self.name}_backward")

        def _timed(self, direction: str, pool, run, inputs):
            t0, started = time.perf_counter(), time.time()
            out = run(*inputs)
            oldest = pool.oldest_request()
            log.add(self.name, direction, int(inputs[0].shape[0]), None if oldest is None else max(0.0, started - oldest),
                    time.perf_counter() - t0)
            return out

        def forward(self, *inputs):
            return self._timed("forward", self.forward_pool, super().forward, inputs)

        def backward(self, *inputs):
            return self._timed("backward", self.backward_pool, super().backward, inputs)

    return MeasuredBackend


STAMP_ONE_IN = 8
"""Requests whose arrival is stamped for the queue wait: one in this many, chosen by request id
(passing every stamp between processes cost the server measurably more CPU per call)."""

PSS_EVERY_S = 10.0
"""Seconds between two reads of a server's memory (PSS: reading it walks every process's page
map, milliseconds per process); its CPU seconds are read every ``host_sample_interval_s``."""


def _measured_pool():
    """hivemind's ``TaskPool`` that also knows, for each batch it hands to the Runtime, when the
    oldest of its sampled requests arrived: the queue wait of a batch is the time from that arrival
    to the start of the batch's compute (requests wait for the batch to form and for the server's
    one Runtime thread). One request in :data:`STAMP_ONE_IN` (by its id) is stamped where hivemind
    stamps requests (``submit_task``, in the connection handler's process); the stamps travel with
    the request's id through a queue of their own to the pool's process, which matches them to the
    requests of each batch. A batch without a sampled request has no queue wait (NULL)."""
    import multiprocessing as mp

    from hivemind.moe.server.task_pool import TaskPool

    class MeasuredPool(TaskPool):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._arrivals = mp.SimpleQueue()  # connection handler -> pool process: one stamp per request
            self._oldest = mp.SimpleQueue()    # pool process -> Runtime: one stamp per batch

        def submit_task(self, *args):
            future = super().submit_task(*args)
            if not future.done() and future._uid % STAMP_ONE_IN == 0:  # (refused at once: it forms no batch)
                self._arrivals.put((future._uid, time.time()))
            return future

        def iterate_minibatches(self, *args, **kwargs):
            arrived: dict = {}  # request id -> arrival; requests cancelled before batching stay here
            for batch in super().iterate_minibatches(*args, **kwargs):
                sampled = [t.future._uid for t in batch if t.future._uid % STAMP_ONE_IN == 0]
                for uid in sampled:
                    while uid not in arrived:
                        got, stamp = self._arrivals.get()
                        arrived[got] = stamp
                self._oldest.put(min((arrived.pop(uid) for uid in sampled), default=None))
                yield batch

        def oldest_request(self) -> float | None:
            return self._oldest.get()

    return MeasuredPool


def _sample_forever(db: str, run_id: str, index: int, generation: int, interval_s: float, log: _BatchLog,
                    stop: threading.Event) -> None:
    """Every ``interval_s``: this server's process tree's CPU seconds; every :data:`PSS_EVERY_S`
    also its memory (the sum of its processes' proportional set sizes: hivemind's task pools are
    forked and share the server's pages, which RSS would count once per process); every second: flush
    the batch log. Ends after a last flush once ``stop`` is set."""
    import psutil

    from ddlscope.store.db import ResultsStore

    store = ResultsStore(db)
    me = psutil.Process()
    next_sample = next_pss = 0.0
    while True:
        stopping = stop.wait(FLUSH_EVERY_S)
        try:
            log.flush(store)
            if stopping:
                store.close()
                return
            if time.monotonic() >= next_sample:
                next_sample = time.monotonic() + interval_s
                with_pss = time.monotonic() >= next_pss
                next_pss = next_pss if not with_pss else time.monotonic() + PSS_EVERY_S
                cpu, pss = 0.0, 0 if with_pss else None
                for p in [me, *me.children(recursive=True)]:
                    try:
                        t = p.cpu_times()
                        cpu += t.user + t.system
                        if with_pss:  # forked task pools share pages: PSS splits them
                            pss += p.memory_full_info().pss
                    except (psutil.Error, AttributeError):
                        continue
                # bytes per server are counted where they are known exactly: per call, on the trainers
                store.add_rows("moe_server_samples", [dict(run_id=run_id, service_index=index, generation=generation,
                                                           wall_time=time.time(), cpu_s=cpu, pss_bytes=pss)])
        except Exception as e:  # measuring must never take the server down; the log says what was lost
            print(f"expert server {index}: measurement not stored: {type(e).__name__}: {e}", file=sys.stderr)
            if stopping:
                return


def build_backends(cfg, uids: list[str], log: _BatchLog) -> dict[str, Any]:
    """The ``ModuleBackend`` of each expert this server hosts, each with its own optimizer (the run's).

    Every expert is initialised from ``cfg.seed`` and its id (:func:`~ddlscope.moe.experts.expert_seed`),
    so a server restarted with the same experts starts them as the first one did, and as the same
    experts in-process (``placement = "local"``) start.
    """
    import torch
    from hivemind.moe.server.layers import name_to_block  # noqa: F401  (registers hivemind's experts)

    from ddlscope.moe.experts import args_schema, expert_seed, make_expert
    from ddlscope.workloads.step import optimizer_for

    d = cfg.dmoe
    backend_cls = _instrumented_backend(log)
    schema = args_schema(d.expert, d.hidden_dim)
    backends = {}
    for uid in uids:
        torch.manual_seed(expert_seed(cfg.seed, uid))
        expert = make_expert(d.expert, d.hidden_dim)
        backends[uid] = backend_cls(name=uid, module=expert, args_schema=schema,
                                    optimizer=optimizer_for(cfg, expert.parameters()), max_batch_size=d.max_batch_size)
    return backends


def serve(db: str, run_id: str, index: int, generation: int, cores: list[int], initial_peers: list[str],
          listen: list[str] | None = None) -> int:
    """Serve this server's experts until stopped; returns the exit code (0 stopped, 1 failed).

    ``listen``: multiaddrs to listen on (an emulated network's namespace address); default
    ``dmoe.listen_host``, any free port.
    """
    import hivemind
    import torch
    from hivemind.moe.server import Server

    from ddlscope.config import RunConfig
    from ddlscope.launch.network import p2p_options
    from ddlscope.launch.processes import end_children, route_hivemind_sockets
    from ddlscope.store.db import ResultsStore

    os.sched_setaffinity(0, cores)
    route_hivemind_sockets()  # its sockets in the run's own folder (TMPDIR), removed with it
    torch.set_num_threads(len(cores))
    store = ResultsStore(db)
    store.upsert_service(run_id, KIND, index, generation, pid=os.getpid(), cores=",".join(map(str, cores)),
                         status="starting", started_at=time.time())
    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server = dht = None
    try:
        cfg = RunConfig(**store.run_config(run_id))
        d = cfg.dmoe
        uids = d.server_uids(index)
        log = _BatchLog(run_id, index, generation)
        def make():
            made = hivemind.DHT(initial_peers=initial_peers or None, host_maddrs=listen or [f"/ip4/{d.listen_host}/tcp/0"],
                                start=True, startup_timeout=d.join_timeout_s, **p2p_options(d.nat_traversal))
            # the peer id as soon as it exists: hivemind's server declares its experts in the DHT before it is ready
            # (and a start that hangs at its connection handler may get calls until it is killed), so the trainers'
            # failed calls to a server killed while starting are still its own (CI, stop 67)
            store.upsert_service(run_id, KIND, index, generation, peer_id=made.peer_id.to_base58())
            hm_server = Server(made, build_backends(cfg, uids, log), num_connection_handlers=1,
                               update_period=d.update_period_s, expiration=2 * d.update_period_s, start=False)
            hm_server.run_in_background(await_ready=False)
            return hm_server, made

        t_start = time.monotonic()
        server, dht = start_until_ready(make, stop, lambda msg: print(f"expert server {index}: {msg}", file=sys.stderr,
                                                                      flush=True), end_children)
        if stop.is_set():  # stopped while starting
            store.upsert_service(run_id, KIND, index, generation, status="stopped", ended_at=time.time())
            return 0
        maddrs = [str(a) for a in dht.get_visible_maddrs()]
        store.upsert_service(run_id, KIND, index, generation, status="serving", experts=json.dumps(uids),
                             peer_id=dht.peer_id.to_base58(), maddrs=json.dumps(maddrs))
        print(f"expert server {index}, ready after {time.monotonic() - t_start:.1f} s, serves {', '.join(uids)} "
              f"at {' '.join(maddrs)}", file=sys.stderr, flush=True)  # the addresses last: users copy them
        sampler = threading.Thread(target=_sample_forever, args=(db, run_id, index, generation,
                                                                 cfg.host_sample_interval_s, log, stop), daemon=True)
        sampler.start()
        while not stop.wait(0.5):
            # the launcher's SIGTERM reaches hivemind's forked children too; the server thread can end
            # from that before this thread has run the handler: only a thread ended with no stop is a failure
            if not server.is_alive() and not stop.wait(STOP_GRACE_S):
                raise RuntimeError("hivemind's server thread ended on its own (see the log)")
        sampler.join(2 * FLUSH_EVERY_S)
        store.upsert_service(run_id, KIND, index, generation, status="stopped", ended_at=time.time())
        return 0
    except Exception as e:
        store.upsert_service(run_id, KIND, index, generation, status="failed", reason=f"{type(e).__name__}: {e}",
                             ended_at=time.time())
        print(f"expert server {index} failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        _close(server, dht)
        end_children()  # what hivemind's shutdown left (or all of it, when it timed out)


def start_until_ready(make, stop: threading.Event, say, clean, attempts: int = START_ATTEMPTS,
                      timeout_s: float = READY_TIMEOUT_S):
    """``(server, dht)`` from ``make()`` (a hivemind ``Server`` started in the background and its DHT)
    once the server is ready or ``stop`` is set; a start not ready within ``timeout_s`` seconds is
    said (``say``), shut down, its processes ended (``clean``) and made again, ``attempts`` times in all.

    Raises:
        RuntimeError: no start was ready; the message names what was not.
    """
    for attempt in range(1, attempts + 1):
        server, dht = make()
        not_ready = _await_ready(server, stop, timeout_s)
        if not_ready is None:
            return server, dht
        say(f"{not_ready} (start {attempt} of {attempts})")
        _close(server, dht)
        clean()  # the handler that never started, and this start's DHT and p2pd
    raise RuntimeError(f"{not_ready}, in each of {attempts} starts")


def _await_ready(server, stop: threading.Event, timeout_s: float) -> str | None:
    """Wait until hivemind's ``server`` is ready, ``stop`` is set, or ``timeout_s`` seconds pass; None when
    ready or stopped, else what was not ready (its connection-handler processes, or its runtime)."""
    deadline = time.monotonic() + timeout_s
    while not server.ready.wait(0.25):
        if stop.is_set():
            return None
        if not server.is_alive():
            return "hivemind's server thread ended before it was ready"
        if time.monotonic() > deadline:
            waiting = [h.pid for h in server.conn_handlers if not h.ready.done()]
            what = (f"its connection handler process (pid {', '.join(map(str, waiting))}) did not start serving"
                    if waiting else "its runtime did not start")
            return f"hivemind's server was not ready after {timeout_s:g} s: {what}"
    return None


def _close(server, dht) -> None:
    """Shut hivemind's server (or its DHT alone) down, waiting at most :data:`STOP_GRACE_S` seconds."""
    closer = threading.Thread(target=_shutdown, args=(server, dht), daemon=True)
    closer.start()
    closer.join(STOP_GRACE_S)


def _shutdown(server, dht) -> None:
    if server is not None:
        server.shutdown()
    elif dht is not None:
        dht.shutdown()


def main(argv: list[str] | None = None) -> None:
    from ddlscope.launch.processes import die_with_parent

    p = argparse.ArgumentParser(prog="python -m ddlscope.moe.server")
    p.add_argument("--db", required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--generation", type=int, default=0, help="0 for the first process of this server, +1 per restart")
    p.add_argument("--cores", required=True, help="comma-separated core ids")
    p.add_argument("--initial-peers", nargs="*", default=[])
    p.add_argument("--listen", nargs="*", default=None, help="multiaddrs to listen on (default: dmoe.listen_host)")
    p.add_argument("--die-with-parent", action="store_true")
    args = p.parse_args(argv)
    if args.die_with_parent:
        die_with_parent(signal.SIGTERM)
    code = serve(args.db, args.run_id, args.index, args.generation, [int(c) for c in args.cores.split(",")],
                 args.initial_peers, args.listen)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # hivemind leaves non-daemon threads; the launcher ends the process group anyway


if __name__ == "__main__":
    main()
