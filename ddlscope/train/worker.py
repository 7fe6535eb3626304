"""Entry point of one worker process: ``python -m ddlscope.train.worker --db ... --run-id ...``.

The launcher starts one of these per worker/peer, each in its own process group (so the group,
hivemind's daemons included, can be ended as one), pinned to its cores. For the torch.distributed
distribution models, torch's elastic launcher starts them instead (``torchrun ... -m
ddlscope.train.worker --core-sets 0;1 ...``): the worker then takes its index, the number of
workers and its local rank from ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``, and its cores from
``--core-sets`` (one comma-separated set per local rank, separated by ``;``). The worker reads the
run's config from the results store, trains, and records its own status there: ``completed``,
``failed`` (with the reason) or ``interrupted`` (SIGTERM/SIGINT).

Exit codes: 0 completed, 1 failed, 2 bad input (UserError), 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
import traceback

from ddlscope.launch.processes import die_with_parent

GRACE_S = 5.0


class Interrupted(BaseException):
    """Raised in the main thread when the worker is asked to stop (SIGTERM or SIGINT)."""


def _stop_handler(on_deadline):
    """A signal handler that raises :class:`Interrupted` and, as a backstop, ends the process group.

    Libraries may swallow the exception (hivemind catches BaseException around averaging
    rounds) or block in C code; so the first signal also arms a timer that, after ``GRACE_S``,
    calls ``on_deadline`` (records the status) and SIGKILLs this worker's own process group —
    hivemind's averager processes and p2pd daemon included.
    """
    fired = threading.Event()
    owner_pid = os.getpid()

    def _deadline():
        try:
            on_deadline()
        finally:
            os.killpg(os.getpgrp(), signal.SIGKILL)

    def handler(signum, frame):
        if os.getpid() != owner_pid:  # a forked child (hivemind's averager) inherited this handler
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if not fired.is_set():
            fired.set()
            timer = threading.Timer(GRACE_S, _deadline)
            timer.daemon = True
            timer.start()
        raise Interrupted(signal.Signals(signum).name)

    handler.stop_requested = fired
    return handler


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
    p.add_argument("--die-with-parent", action="store_true")
    return p.parse_args(argv)


def serve_worker(db: str, run_id: str, worker_index: int, num_workers: int, cores: list[int],
                 initial_peers: list[str], listen: list[str] | None = None, local_rank: int = 0) -> int:
    """Run one worker in this process and return its exit code (see the module docstring)."""
    from ddlscope.config import RunConfig
    from ddlscope.errors import UserError
    from ddlscope.store.db import ResultsStore
    from ddlscope.strategies import WorkerContext
    from ddlscope.train.loop import run_worker

    os.sched_setaffinity(0, cores)
    store = ResultsStore(db)

    def record_interrupted():
        with ResultsStore(db) as late:
            late.upsert_worker(run_id, worker_index, status="interrupted", reason="stopped by signal (forced after grace period)")

    handler = _stop_handler(record_interrupted)
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    store.upsert_worker(run_id, worker_index, hostname=socket.gethostname(), pid=os.getpid(),
                        cores=",".join(map(str, cores)), status="starting")
    cfg = RunConfig(**store.run_config(run_id))
    ctx = WorkerContext(
        run_id=run_id, worker_index=worker_index, num_workers=num_workers, cores=cores,
        initial_peers=initial_peers, listen_maddrs=listen, local_rank=local_rank, store=store,
        announce=lambda maddrs: store.upsert_worker(run_id, worker_index, maddrs=json.dumps(maddrs)),
    )
    try:
        reason = run_worker(cfg, ctx, store)
        store.upsert_worker(run_id, worker_index, status="completed", reason=reason)
        return 0
    except (Interrupted, KeyboardInterrupt) as e:
        store.upsert_worker(run_id, worker_index, status="interrupted", reason=f"stopped by {e or 'SIGINT'}")
        return 130
    except UserError as e:
        store.upsert_worker(run_id, worker_index, status="failed", reason=str(e))
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # record every other failure with its reason, then exit non-zero
        traceback.print_exc()
        if handler.stop_requested.is_set():  # a library turned our stop into its own error
            store.upsert_worker(run_id, worker_index, status="interrupted", reason=f"stopped by signal ({e})")
            return 130
        store.upsert_worker(run_id, worker_index, status="failed", reason=f"{type(e).__name__}: {e}")
        return 1


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.die_with_parent:  # SIGTERM when the launcher dies: the worker records its status and stops (no orphans)
        die_with_parent(signal.SIGTERM)
    env = os.environ
    local_rank = int(env.get("LOCAL_RANK", 0))
    index = args.worker_index if args.worker_index is not None else int(env["RANK"])
    num_workers = args.num_workers if args.num_workers is not None else int(env["WORLD_SIZE"])
    cores = args.cores if args.cores is not None else args.core_sets.split(";")[local_rank]
    code = serve_worker(args.db, args.run_id, index, num_workers, [int(c) for c in cores.split(",")],
                        args.initial_peers, args.listen, local_rank)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # hivemind may leave non-daemon threads; the launcher ends the process group anyway


if __name__ == "__main__":
    main()
