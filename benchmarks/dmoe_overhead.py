"""Instrumentation overhead of dmoe: ddlscope's trainer and expert servers vs. plain hivemind.

What ddlscope's measurement costs a Decentralized Mixture-of-Experts run, against what a user
would write with hivemind 1.1.12 alone. Two kinds of expert servers, each a set of ``servers``
processes pinned to cores as ``ddlscope run`` pins them (:func:`ddlscope.launch.local.service_core_sets`):

* plain: hivemind's ``Server`` with plain ``ModuleBackend`` objects of the same experts
  (:func:`ddlscope.moe.experts.make_expert`, the same seeds, schemas, optimizer, batch size,
  one connection handler, the same announce period) — this file's ``plain-server`` mode;
* ddlscope: the real expert servers, ``python -m ddlscope.moe.server``, started by the launcher's
  own :class:`~ddlscope.launch.services.ServiceSupervisor` (measured backends and task pools, the
  batch log, the 1-second flush and CPU/memory sampler writing to the results store).

Two kinds of trainer, each a fresh process pinned to the trainer's core:

* plain: ``RemoteMixtureOfExperts`` in the same network (:func:`ddlscope.moe.networks.build_moe_network`),
  the same data loader, optimizer and seeds (:func:`ddlscope.train.loop.build_workload`); per step
  forward, loss, backward, optimizer step, nothing else — this file's ``plain-trainer`` mode;
* ddlscope: the real worker, ``python -m ddlscope.train.worker`` (the one training loop with
  ``DMoEStrategy``: wrapped hivemind calls, ``moe_steps`` / ``moe_calls`` rows, per-phase timers,
  a ``steps`` row per step, the host sampler).

Both server sets are started once and live through the benchmark; the set not in use is paused
(SIGSTOP of its process trees), so its background work does not run beside the measured one.
Each repeat visits both sets (the order alternating between repeats) and runs both trainers
against each (the order alternating too), so each repeat gives all four pairings. A trainer's
steps are timed from the start of its first step after ``--warmup`` to the end of its last (the
ddlscope worker from its own ``steps`` rows, stamped at each step's start, and its
``train_end_time``, as ``benchmarks/overhead.py`` does). Per run: the mean step (timed seconds /
timed steps: every cost counts, periodic ones too) and the median step (robust to bursts of load
from other processes, but blind to costs that hit few steps). The overhead is the median over
repeats of ddlscope trainer + ddlscope servers against plain trainer + plain servers, by mean
steps; the trainer's and the servers' parts are the two mixed pairings. The spread of the plain
pairing's repeats ((max - min) / median) is the noise to read it against. Besides, the CPU
seconds the server set (whole process trees) used while each trainer ran (its start-up
included), per trainer step.

Target (as for ``single``, design.md section 5): median overhead < 3 %.

    python benchmarks/dmoe_overhead.py [--steps 40] [--repeats 4] [--batch-size 16]

Prints a table, writes ``benchmarks/results/dmoe_overhead.json`` and rewrites the
``dmoe-overhead`` block of ``docs/validation.md`` (``--docs``; ``--no-docs`` to leave it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ddlscope.errors import UserError
from ddlscope.launch.processes import log_tail

from _docs import DOCS_PAGE, check_docs_block, dmoe_overhead_markdown, update_docs_block

TARGET = 0.03
KINDS = ("plain", "ddlscope")
"""The two kinds of trainer and of expert server compared."""
TRAINER_TIMEOUT_S = 300.0
"""A trainer process that runs longer than this is ended and the benchmark fails."""
STOP_GRACE_S = 5.0


# ------------------------------------------------------------------------------- plain hivemind

def _on_stop(stop: threading.Event) -> None:
    def handler(signum, frame):
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def plain_server(cfg, index: int, cores: list[int], initial_peers: list[str], maddrs_out: Path) -> int:
    """Serve expert server ``index``'s experts with hivemind alone until SIGTERM; returns the exit code.

    The experts, their seeds, schema and optimizer, the batch size, the DHT's listen address, one
    connection handler and the announce period are those of :func:`ddlscope.moe.server.serve`; no
    batch log, no pools of ddlscope's, no sampler, no store. Writes the DHT's multiaddrs to
    ``maddrs_out`` (a JSON list) once it serves.
    """
    import hivemind
    import torch
    from hivemind.moe.server import ModuleBackend, Server

    from ddlscope.moe.experts import args_schema, expert_seed, make_expert
    from ddlscope.workloads.step import optimizer_for

    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    stop = threading.Event()
    _on_stop(stop)
    d = cfg.dmoe
    dht = hivemind.DHT(initial_peers=initial_peers or None, host_maddrs=[f"/ip4/{d.listen_host}/tcp/0"], start=True,
                       startup_timeout=d.join_timeout_s)
    schema = args_schema(d.expert, d.hidden_dim)
    backends = {}
    for uid in d.server_uids(index):
        torch.manual_seed(expert_seed(cfg.seed, uid))
        expert = make_expert(d.expert, d.hidden_dim)
        backends[uid] = ModuleBackend(name=uid, module=expert, args_schema=schema,
                                      optimizer=optimizer_for(cfg, expert.parameters()), max_batch_size=d.max_batch_size)
    server = Server(dht, backends, num_connection_handlers=1, update_period=d.update_period_s,
                    expiration=2 * d.update_period_s, start=True)
    part = maddrs_out.with_suffix(".part")
    part.write_text(json.dumps([str(a) for a in dht.get_visible_maddrs()]))
    part.rename(maddrs_out)
    code = 0
    while not stop.wait(0.5):
        if not server.is_alive():
            code = 1
            break
    closer = threading.Thread(target=server.shutdown, daemon=True)
    closer.start()
    closer.join(STOP_GRACE_S)
    return code


def _wait_for_experts(dht, d) -> None:
    """Wait until every expert of the grid is announced (before any timing; as the strategy does)."""
    from hivemind.moe.server.dht_handler import get_experts

    uids = d.expert_uids()
    deadline = time.monotonic() + d.join_timeout_s
    while sum(e is not None for e in get_experts(dht, uids)) < len(uids):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the {len(uids)} experts were not all announced within {d.join_timeout_s:g} s")
        time.sleep(0.25)


def plain_trainer(cfg, cores: list[int], initial_peers: list[str], result_out: Path) -> None:
    """Train ``cfg.max_steps_per_peer()`` steps against the servers with hivemind's mixture and a
    bare loop; write ``{"step_s": [...]}`` to ``result_out``: the wall time of each step from step
    ``cfg.warmup_steps`` on (start of one step to the start of the next, the last to its end)."""
    import hivemind
    import torch
    from hivemind.moe import RemoteMixtureOfExperts

    from ddlscope.distribution.dmoe import UID_PREFIX
    from ddlscope.moe.networks import build_moe_network
    from ddlscope.train.loop import batches_forever, build_workload
    from ddlscope.workloads.step import loss_function

    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    d = cfg.dmoe
    dht = hivemind.DHT(initial_peers=initial_peers, client_mode=True, start=True, startup_timeout=d.join_timeout_s)
    _wait_for_experts(dht, d)

    def network(name: str, family: str, num_classes: int) -> torch.nn.Module:
        # built where the strategy builds it, after build_workload seeds torch: the same gate and trunk
        mixture = RemoteMixtureOfExperts(
            in_features=d.hidden_dim, grid_size=tuple(d.grid_size), dht=dht, uid_prefix=UID_PREFIX, k_best=d.k_best,
            k_min=d.k_min, backward_k_min=d.k_min, forward_timeout=d.forward_timeout_s,
            backward_timeout=d.backward_timeout_s, timeout_after_k_min=d.timeout_after_k_min_s)
        return build_moe_network(name, family, num_classes, d, mixture=mixture, seed=cfg.seed)

    wl = build_workload(cfg, 0, 0, network)
    batches = batches_forever(wl.train_loader)
    loss_fn = loss_function()
    wl.model.train()
    starts = []
    for _ in range(cfg.max_steps_per_peer()):
        starts.append(time.time())  # the clock the training loop stamps its steps with
        x, y = next(batches)
        loss = loss_fn(wl.model(x), y)
        loss.backward()
        wl.optimizer.step()
        wl.optimizer.zero_grad(set_to_none=True)
    starts.append(time.time())
    timed = starts[cfg.warmup_steps:]
    result_out.write_text(json.dumps({"step_s": [b - a for a, b in zip(timed, timed[1:])]}))
    closer = threading.Thread(target=dht.shutdown, daemon=True)
    closer.start()
    closer.join(STOP_GRACE_S)


def _child(argv: list[str]) -> None:
    """``plain-server`` / ``plain-trainer`` modes (started by :func:`main`, never by hand)."""
    from ddlscope.config import validate_config
    from ddlscope.launch.processes import die_with_parent, route_hivemind_sockets

    p = argparse.ArgumentParser(prog=f"dmoe_overhead.py {argv[0]}")
    p.add_argument("--config", type=Path, required=True)
    p.add_argument("--cores", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--initial-peers", nargs="*", default=[])
    args = p.parse_args(argv[1:])
    die_with_parent(signal.SIGTERM)
    # harness hygiene, not part of the plain side's work: hivemind 1.1.12 leaves its clients' socket files in
    # /tmp; they go to the benchmark's run folder (TMPDIR, see main), removed with it, as ddlscope's own do
    route_hivemind_sockets()
    cfg = validate_config(json.loads(args.config.read_text()))
    cores = [int(c) for c in args.cores.split(",")]
    code = 0
    try:
        if argv[0] == "plain-server":
            code = plain_server(cfg, args.index, cores, args.initial_peers, args.out)
        else:
            plain_trainer(cfg, cores, args.initial_peers, args.out)
    except Exception as e:
        print(f"{argv[0]} failed: {type(e).__name__}: {e}", file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # hivemind leaves non-daemon threads; the parent ends the process group anyway


# ------------------------------------------------------------------------------- the benchmark

class Bench:
    """The processes of one benchmark: starts server sets and trainers, ends them all in :meth:`close`.

    Args:
        cfg: the dmoe run config both trainers train (``peers = 1``).
        tmp: a scratch folder (config file, logs, the results store, multiaddr files).
    """

    def __init__(self, cfg, tmp: Path):
        from ddlscope.distribution.dmoe import expert_servers
        from ddlscope.launch.local import service_core_sets
        from ddlscope.store.db import ResultsStore

        self.cfg, self.tmp = cfg, tmp
        self.config_path = tmp / "config.json"
        self.config_path.write_text(cfg.model_dump_json())
        self.db = tmp / "bench.db"
        self.store = ResultsStore(self.db)
        self.trainer_cores = cfg.core_sets()[0]
        self.services = expert_servers(cfg)
        self.server_cores = service_core_sets([s.cores for s in self.services], [self.trainer_cores])
        self.popens: list[subprocess.Popen] = []
        self.n = 0

    def _start(self, cmd: list[str], name: str, threads: int) -> subprocess.Popen:
        from ddlscope.launch.processes import start_process

        popen = start_process(cmd, self.tmp / f"{name}.log", threads=threads)
        self.popens.append(popen)
        return popen

    def start_servers(self, kind: str) -> tuple[list[subprocess.Popen], list[str]]:
        """Start a set of expert servers of ``kind`` and wait until every one serves; returns their
        processes and the DHT's multiaddrs.

        Raises:
            RuntimeError: a server failed or did not serve within ``dmoe.join_timeout_s`` (with its log's tail).
        """
        self.n += 1
        deadline = time.monotonic() + self.cfg.dmoe.join_timeout_s
        if kind == "ddlscope":
            from ddlscope.launch.services import ServiceSupervisor

            run_id = self.store.create_run(f"servers-{self.n}", self.cfg.strategy, self.cfg.model_dump(mode="json"))
            log_dir = self.tmp / f"servers-{self.n}"
            log_dir.mkdir()
            sup = ServiceSupervisor(self.services, self.db, run_id, log_dir, self.server_cores,
                                    self.cfg.dmoe.join_timeout_s)
            try:
                peers = sup.start(self.store)
            finally:
                self.popens += sup.popens()
            self._wait(sup.popens(), log_dir, deadline, lambda: sum(
                r["status"] == "serving" for r in self.store.services(run_id)) == len(self.services))
            return sup.popens(), peers
        popens, peers = [], []
        for s, cores in zip(self.services, self.server_cores):
            out = self.tmp / f"maddrs-{self.n}-{s.index}.json"
            cmd = [sys.executable, __file__, "plain-server", "--config", str(self.config_path), "--index", str(s.index),
                   "--cores", ",".join(map(str, cores)), "--out", str(out)]
            popen = self._start(cmd + (["--initial-peers", *peers] if peers else []), out.stem, len(cores))
            popens.append(popen)
            self._wait([popen], self.tmp / f"{out.stem}.log", deadline, out.exists)  # written once it serves
            peers = peers or json.loads(out.read_text())  # the first server bootstraps the DHT; the others join it
        return popens, peers

    @staticmethod
    def _wait(popens: list[subprocess.Popen], logs: Path, deadline: float, serving) -> None:
        """Wait until ``serving()``; raise if a process ends or the deadline passes (``logs``: a log or their folder)."""
        while not serving():
            if any(p.poll() is not None for p in popens) or time.monotonic() > deadline:
                tails = [f"{log.name}: {log_tail(log, 8) or '(empty)'}"
                         for log in (sorted(logs.iterdir()) if logs.is_dir() else [logs])]
                raise RuntimeError(f"expert servers did not all serve; {'; '.join(tails)}")
            time.sleep(0.1)

    def stop(self, popens: list[subprocess.Popen], grace_s: float = STOP_GRACE_S) -> None:
        """End these processes and their process groups (paused ones are resumed first)."""
        from ddlscope.launch.processes import stop_processes

        pause(popens, False)
        stop_processes(popens, grace_s)

    def run_trainer(self, kind: str, peers: list[str]) -> list[float]:
        """Run one trainer of ``kind`` against the servers at ``peers``; the wall seconds of each of
        its steps after the warm-up (start of a step to the start of the next; the last to its end).

        Raises:
            RuntimeError: the trainer failed or ran past :data:`TRAINER_TIMEOUT_S` (with its log's tail).
        """
        self.n += 1
        cores = ",".join(map(str, self.trainer_cores))
        if kind == "plain":
            out = self.tmp / f"trainer-{self.n}.json"
            cmd = [sys.executable, __file__, "plain-trainer", "--config", str(self.config_path), "--cores", cores,
                   "--out", str(out), "--initial-peers", *peers]
        else:
            run_id = self.store.create_run(f"trainer-{self.n}", self.cfg.strategy, self.cfg.model_dump(mode="json"))
            cmd = [sys.executable, "-m", "ddlscope.train.worker", "--db", str(self.db), "--run-id", run_id,
                   "--worker-index", "0", "--num-workers", "1", "--cores", cores, "--die-with-parent",
                   "--initial-peers", *peers]
        popen = self._start(cmd, f"trainer-{self.n}", len(self.trainer_cores))
        try:
            code = popen.wait(TRAINER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
        self.stop([popen])
        if code != 0:
            raise RuntimeError(f"{kind} trainer ended with code {code}: "
                               f"{log_tail(self.tmp / f'trainer-{self.n}.log', 8) or '(empty log)'}")
        if kind == "plain":
            return json.loads(out.read_text())["step_s"]
        # the loop's own records: each step row's wall_time is stamped at the step's start
        starts = [r["wall_time"] for r in sorted(self.store.rows("steps", run_id), key=lambda r: r["step"])
                  if r["step"] >= self.cfg.warmup_steps]
        starts.append(self.store.workers(run_id)[0]["train_end_time"])
        return [b - a for a, b in zip(starts, starts[1:])]

    def close(self) -> None:
        """End every process this benchmark started (servers and trainers, whole process groups)."""
        self.stop(self.popens)
        self.store.close()


def _trees(popens: list[subprocess.Popen]) -> list:
    import psutil

    procs = []
    for popen in popens:
        try:
            root = psutil.Process(popen.pid)
            procs += [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
    return procs


def pause(popens: list[subprocess.Popen], stop: bool = True) -> None:
    """SIGSTOP (``stop``) or SIGCONT these processes and all their descendants: the server set not
    in use is paused, so that its background work (announcing, ddlscope's sampler) does not run
    beside the set being measured."""
    import psutil

    for p in _trees(popens):
        try:
            p.send_signal(signal.SIGSTOP if stop else signal.SIGCONT)
        except psutil.Error:
            continue


def cpu_seconds(popens: list[subprocess.Popen]) -> float:
    """User + system CPU seconds so far of these processes and all their descendants."""
    import psutil

    total = 0.0
    for p in _trees(popens):
        try:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            continue
    return total


def summarize(step_s: dict[str, dict[str, list[list[float]]]], server_cpu_s: dict[str, dict[str, list[float]]],
              steps: int) -> dict:
    """Per pairing and overall figures of the repeats.

    Args:
        step_s: ``step_s[servers][trainer]``: per repeat, the wall seconds of each timed step.
        server_cpu_s: ``server_cpu_s[servers][trainer]``: per repeat, CPU seconds of the server set
            while that trainer ran.
        steps: steps per trainer run, warm-up included (the servers' CPU is per such step).

    Returns:
        ``pairs``: per pairing (servers, trainer) ``step_ms`` (median over repeats of the run's mean
        step, i.e. its timed seconds / timed steps), ``step_ms_min`` / ``step_ms_max`` (of those
        means), ``median_step_ms`` (median over repeats of the run's median step: blind to
        occasional slow steps, so to periodic costs, but robust to bursts of load), ``vs_plain_fraction``
        and ``median_step_vs_plain_fraction`` (against plain trainer + plain servers),
        ``server_cpu_ms_per_step``; ``overhead_fraction`` (ddlscope trainer + servers against plain,
        mean steps: the target's figure), ``trainer_overhead_fraction`` / ``server_overhead_fraction``
        (the mixed pairings), ``median_step_overhead_fraction``, ``paired_overhead_fractions`` (per
        repeat, mean steps) and ``plain_spread_fraction`` ((max - min) / median of the plain
        pairing's run means: the noise).
    """
    mean_ms = {(s, t): [1000 * sum(r) / len(r) for r in runs] for s, by in step_s.items() for t, runs in by.items()}
    median_ms = {(s, t): [1000 * statistics.median(r) for r in runs] for s, by in step_s.items()
                 for t, runs in by.items()}
    med = {k: statistics.median(v) for k, v in mean_ms.items()}
    med_step = {k: statistics.median(v) for k, v in median_ms.items()}
    base, base_step = med[("plain", "plain")], med_step[("plain", "plain")]
    plain = mean_ms[("plain", "plain")]
    pairs = [dict(servers=s, trainer=t, step_ms=med[(s, t)], step_ms_min=min(mean_ms[(s, t)]),
                  step_ms_max=max(mean_ms[(s, t)]), median_step_ms=med_step[(s, t)],
                  vs_plain_fraction=med[(s, t)] / base - 1.0,
                  median_step_vs_plain_fraction=med_step[(s, t)] / base_step - 1.0,
                  server_cpu_ms_per_step=1000 * statistics.median(server_cpu_s[s][t]) / steps)
             for s in KINDS for t in KINDS]
    return dict(
        pairs=pairs,
        overhead_fraction=med[("ddlscope", "ddlscope")] / base - 1.0,
        trainer_overhead_fraction=med[("plain", "ddlscope")] / base - 1.0,
        server_overhead_fraction=med[("ddlscope", "plain")] / base - 1.0,
        median_step_overhead_fraction=med_step[("ddlscope", "ddlscope")] / base_step - 1.0,
        paired_overhead_fractions=[d / p - 1.0 for d, p in zip(mean_ms[("ddlscope", "ddlscope")], plain)],
        plain_spread_fraction=(max(plain) - min(plain)) / base,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=40, help="steps per trainer run, warm-up included")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "dmoe_overhead.json")
    parser.add_argument("--docs", type=Path, default=DOCS_PAGE, help="docs page whose 'dmoe-overhead' block is rewritten")
    parser.add_argument("--no-docs", action="store_true", help="leave the docs page as it is")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        raise UserError(f"--steps {args.steps}: allowed: more than --warmup ({args.warmup})")
    if args.repeats < 1:
        raise UserError(f"--repeats {args.repeats}: allowed: 1 or more")
    if not args.no_docs:
        check_docs_block(args.docs, "dmoe-overhead")

    import torch

    from ddlscope.config import available_cores, validate_config
    from ddlscope.launch.local import prepare_dataset
    from ddlscope.launch.processes import make_run_temp_dir, remove_run_temp_dir

    cfg = validate_config(dict(
        strategy="dmoe", model="moe_cnn", dataset=args.dataset, batch_size=args.batch_size, peers=1, vcpus_per_peer=1,
        sample_budget=args.steps * args.batch_size, warmup_steps=args.warmup, loader_workers=0, final_eval=False,
        dmoe=dict(grid_size=[2, 2], servers=2, k_best=2)))
    prepare_dataset(cfg)
    step_s = {s: {t: [] for t in KINDS} for s in KINDS}
    server_cpu_s = {s: {t: [] for t in KINDS} for s in KINDS}
    started = time.monotonic()
    # every process this benchmark starts, on both sides, inherits a run folder as TMPDIR (as the launcher gives
    # a run's processes): multiprocessing's pymp-* folders and hivemind's socket files go there, removed with it
    run_tmp = make_run_temp_dir()
    os.environ["TMPDIR"] = str(run_tmp)
    with contextlib.ExitStack() as cleanup, tempfile.TemporaryDirectory(prefix="dmoe-overhead-") as tmp:
        cleanup.callback(remove_run_temp_dir, run_tmp)
        bench = Bench(cfg, Path(tmp))
        try:
            sets = {}
            for servers in KINDS:  # both sets live through the benchmark; the one not in use is paused
                sets[servers] = bench.start_servers(servers)
                pause(sets[servers][0])
            visit = 0
            for r in range(args.repeats):
                for servers in (KINDS if r % 2 == 0 else KINDS[::-1]):
                    popens, peers = sets[servers]
                    pause(popens, False)
                    for trainer in (KINDS if visit % 2 == 0 else KINDS[::-1]):
                        cpu0 = cpu_seconds(popens)
                        step_s[servers][trainer].append(bench.run_trainer(trainer, peers))
                        server_cpu_s[servers][trainer].append(cpu_seconds(popens) - cpu0)
                        run = step_s[servers][trainer][-1]
                        print(f"repeat {r + 1}/{args.repeats}: {servers} servers, {trainer} trainer: "
                              f"{1000 * sum(run) / len(run):.1f} ms/step (median step "
                              f"{1000 * statistics.median(run):.1f})", flush=True)
                    pause(popens)
                    visit += 1
        finally:
            bench.close()
    summary = summarize(step_s, server_cpu_s, args.steps)
    d = cfg.dmoe
    result = dict(
        model=cfg.model, dataset=cfg.dataset, batch_size=cfg.batch_size, expert=d.expert, hidden_dim=d.hidden_dim,
        grid_size=d.grid_size, k_best=d.k_best, servers=d.servers, steps=args.steps,
        timed_steps=args.steps - args.warmup,
        repeats=args.repeats, cores=len(available_cores()), trainer_cores=bench.trainer_cores,
        server_cores=bench.server_cores, torch=torch.__version__, hivemind=_hivemind_version(),
        host=os.uname().nodename, step_s=step_s, server_cpu_s=server_cpu_s, **summary,
        target_fraction=TARGET, meets_target=summary["overhead_fraction"] < TARGET,
        wall_s=time.monotonic() - started, measured_at=time.strftime("%Y-%m-%d %H:%M:%S"),
    )
    print()
    print(f"{'servers':<10}{'trainer':<10}{'ms/step':>9}{'min .. max':>18}{'vs plain':>10}{'median step':>13}"
          f"{'vs plain':>10}{'server CPU ms/step':>20}")
    for p in result["pairs"]:
        print(f"{p['servers']:<10}{p['trainer']:<10}{p['step_ms']:>9.1f}{p['step_ms_min']:>9.1f} .. "
              f"{p['step_ms_max']:<6.1f}{p['vs_plain_fraction']:>+10.1%}{p['median_step_ms']:>13.1f}"
              f"{p['median_step_vs_plain_fraction']:>+10.1%}{p['server_cpu_ms_per_step']:>20.1f}")
    print(f"\noverhead, ddlscope trainer + servers vs. plain (median of {args.repeats} repeats' mean steps): "
          f"{result['overhead_fraction']:+.1%}; target < {TARGET:.0%}: {'PASS' if result['meets_target'] else 'FAIL'}")
    print(f"  trainer's part {result['trainer_overhead_fraction']:+.1%}, servers' part "
          f"{result['server_overhead_fraction']:+.1%}; per repeat "
          f"{', '.join(f'{v:+.1%}' for v in result['paired_overhead_fractions'])}; by median steps "
          f"{result['median_step_overhead_fraction']:+.1%}")
    print(f"  noise: the plain pairing's repeats spread {result['plain_spread_fraction']:.1%} of their median; "
          f"benchmark wall time {result['wall_s']:.0f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")
    if not args.no_docs:
        update_docs_block(args.docs, "dmoe-overhead", dmoe_overhead_markdown(result))
        print(f"rewrote the 'dmoe-overhead' block of {args.docs}")


def _hivemind_version() -> str:
    import hivemind

    return hivemind.__version__


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("plain-server", "plain-trainer"):
        _child(sys.argv[1:])
    try:
        main()
    except UserError as e:          # bad input (the docs page, the arguments): one line, no traceback
        raise SystemExit(f"error: {e}") from None
