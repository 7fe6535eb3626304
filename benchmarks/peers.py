"""Multi-worker distribution models: ``ddlscope run`` against the plain scripts a user would write instead.

For each model (``--models``, default ddp, fsdp, gpipe, 1f1b, collaborative) the same workload
(``--workload model:dataset:batch``, default ``resnet18:digits:32``) is trained by a plain script
of ``benchmarks/plain/`` and by ``ddlscope run`` of a run config with the same settings,
alternating, ``--repeats`` times each, on ``--device cpu`` or ``cuda``:

* ddp, fsdp, gpipe, 1f1b: ``plain_ddp.py``, ``plain_fsdp.py``, ``plain_pipeline.py`` (``--schedule``)
  under torchrun, 2 workers; pipelines cut at the same ``stage_bounds`` on both sides (measured
  once here with ddlscope's balancing, or ``--stage-bounds``) with ``--microbatches`` micro-batches;
* collaborative: ``plain_hivemind.py``, 2 peers as 2 processes (the second joins through the
  first's multiaddrs) with the same ``target_batch_size``, ``matchmaking_time_s`` and
  ``averaging_timeout_s``, and the optimizer given to hivemind as an instance on both sides (params
  and a factory turn on hivemind's ``offload_optimizer`` and ``reuse_tensors``: on CPU that used less
  CPU in hivemind's state executor and averagers, a difference of configuration, not of
  instrumentation; docs/validation.md, stop 55).

Both sides: the same network (same seed), data, preprocessing, shuffling and DataLoader (one
loader process per worker), plain SGD with the same learning rate and momentum, each worker pinned
to one core with one math thread (``OMP_NUM_THREADS=1``), the same warm-up steps left out.

What is compared, in samples per second of all workers together:

* plain: the scripts' timed window, from a barrier after the warm-up to a barrier after the last
  timed step; the plain swarm: :func:`ddlscope.experiments.results.swarm_window` over its peers'
  timed steps (the time every peer trained), as ddlscope measures its own swarms;
* ddlscope (reported): what ddlscope reports for the stored run,
  :func:`ddlscope.experiments.results.measure_run` (lockstep models: the mean over measured steps
  of the slowest worker's step time; swarms: the swarm window);
* ddlscope (wall): the stored run's wall-clock window, from the start of the first measured step
  of the earliest worker to the end of the last step of the latest (:func:`wall_window`) —
  like the plain window, it includes whatever ddlscope does between steps.

The ratios are ddlscope's over plain's, read per pair of repeats (the two sides run next to each
other, in turns which goes first) and given as the median pair; target (issue 16): both >= 0.97
for every model. The verdict reads the 95 % interval of the median pair's lower ratio
(``_paired``): met when it lies at or above 0.97, missed when below, else unsettled (then the
machine's noise is larger than the gap; more ``--repeats`` narrow it, at least 6 for an interval).

    python benchmarks/peers.py [--models ddp,fsdp,gpipe,1f1b,collaborative] [--workload resnet18:digits:32]
                               [--steps 30] [--warmup 5] [--repeats 7] [--device cpu|cuda] [--no-docs]

Prints a table, writes ``benchmarks/results/peers.json`` and rewrites the ``peers`` block of
``docs/validation.md`` (``--no-docs`` leaves it); ``--keep DIR`` keeps every run's config, logs and
database. With ``--device cuda`` a torchrun model needs a GPU per worker; where there are fewer,
its row says so and has no figures. Every process it starts (torchrun agents and
their workers, hivemind peers and daemons, ddlscope's launcher and its workers) is ended with it,
also on Ctrl-C or SIGTERM.
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
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from ddlscope import distribution
from ddlscope.errors import UserError
from ddlscope.experiments.results import measure_run, swarm_window
from ddlscope.launch.processes import log_tail, start_process, stop_processes
from ddlscope.store.db import ResultsStore

from _docs import DOCS_PAGE, check_docs_block, peers_markdown, update_docs_block
from _paired import CONFIDENCE, interval_text, median_interval, verdict
from overhead import check_device, parse_workload

TARGET = 0.97
MODELS = ("ddp", "fsdp", "gpipe", "1f1b", "collaborative")
WORKLOAD = "resnet18:digits:32"
WORKERS = 2
ROUND_STEPS = 10
"""collaborative: the target batch size is the samples of this many steps of every peer (a global epoch)."""
MATCHMAKING_TIME_S = 1.0
AVERAGING_TIMEOUT_S = 30.0
LEARNING_RATE = 0.01
MOMENTUM = 0.9
STOP_GRACE_S = 12.0
"""Seconds a process gets after SIGTERM before its process group is killed (``ddlscope run`` itself gives its
workers 8 s)."""
LINGER_S = 15.0
"""Seconds a process may go on after every result file was written (hivemind's shutdown waiting for a round)."""
PLAIN = Path(__file__).resolve().parent / "plain"
SCRIPTS = {"ddp": "plain_ddp.py", "fsdp": "plain_fsdp.py", "gpipe": "plain_pipeline.py", "1f1b": "plain_pipeline.py",
           "collaborative": "plain_hivemind.py"}
NOTES = {
    "ddp": "ddlscope averages each gradient bucket in its own timed communication hook; plain DDP uses its built-in one",
    "fsdp": "ddlscope's all-gathers and reduce-scatters go through timed replacements of FSDP's; plain uses FSDP's own",
    "gpipe": "same cut on both sides; ddlscope probes its links before training and times every micro-batch",
    "1f1b": "same cut on both sides; ddlscope probes its links before training and times every micro-batch",
    "collaborative": "both give hivemind an optimizer instance; plain: verbose=False and no end-of-swarm handling "
                     "(its tail is outside the window; on a GPU it synchronises at each step's end); ddlscope reads "
                     "hivemind's log, the CPU of its daemons every step and a DHT record of finished peers every 2 s",
}


# ---------------------------------------------------------------------------- settings

def parse_models(text: str) -> list[str]:
    """``"ddp,1f1b"`` -> ``["ddp", "1f1b"]``, in the order given, without repeats.

    Raises:
        UserError: an unknown or empty name.
    """
    names = [n.strip() for n in text.split(",")]
    bad = [n for n in names if n not in MODELS]
    if bad or not names:
        raise UserError(f"--models {text!r}: unknown {', '.join(map(repr, bad)) or 'empty list'}; allowed: a "
                        f"comma-separated list of {', '.join(MODELS)}")
    return list(dict.fromkeys(names))


def samples_per_step(model: str, batch_size: int, workers: int = WORKERS) -> int:
    """Samples all workers of ``model`` train in one step: every worker's batch, or one batch for pipelines."""
    return distribution.get(model).data_parallel_size(workers) * batch_size


def run_tables(model: str, args: argparse.Namespace, bounds: list[int] | None) -> dict[str, dict]:
    """The run config of ddlscope's side, as TOML tables (``run``, ``distributed``, ``collaborative``)."""
    name, dataset, batch = parse_workload(args.workload)
    steps = args.warmup + args.steps
    run = dict(name=f"peers-{model}", strategy=model, model=name, dataset=dataset, batch_size=batch, peers=WORKERS,
               vcpus_per_peer=1, device=args.device, optimizer="sgd", learning_rate=LEARNING_RATE, momentum=MOMENTUM,
               loader_workers=1, seed=0, sample_budget=steps * samples_per_step(model, batch),
               warmup_steps=args.warmup, final_eval=False)
    tables: dict[str, dict] = {"run": run}
    if bounds is not None:
        tables["distributed"] = dict(microbatches=args.microbatches, stage_bounds=bounds)
    if model == "collaborative":
        tables["collaborative"] = dict(target_batch_size=target_batch_size(batch), matchmaking_time_s=MATCHMAKING_TIME_S,
                                       averaging_timeout_s=AVERAGING_TIMEOUT_S)
    return tables


def target_batch_size(batch_size: int) -> int:
    """collaborative's target batch size: :data:`ROUND_STEPS` steps of every peer."""
    return ROUND_STEPS * WORKERS * batch_size


def toml_text(tables: Mapping[str, Mapping[str, object]]) -> str:
    """TOML of tables of scalars and lists of scalars (strings, ints, floats, booleans).

    Raises:
        ValueError: a value of another type (a nested table, None).
    """
    def value(v: object) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float, str)):
            return json.dumps(v)  # JSON's numbers and basic strings are TOML's
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        raise ValueError(f"cannot write {v!r} ({type(v).__name__}) as TOML here; allowed: str, int, float, bool, lists")

    return "\n".join(f"[{name}]\n" + "".join(f"{k} = {value(v)}\n" for k, v in table.items())
                     for name, table in tables.items())


def pipeline_cut(args: argparse.Namespace) -> list[int]:
    """``--stage-bounds``, or the cut ddlscope's ``balance = "measured"`` would choose: the network's
    top-level layers timed on one micro-batch (``batch / microbatches`` samples) in this process on the
    CPU, one thread, and split into 2 stages with the least slowest stage.

    Raises:
        UserError: the bounds are not 3 increasing integers from 0, or the dataset is not a named one
            (then give ``--stage-bounds``).
    """
    from ddlscope.strategies.partition import balanced_partition, measure_layer_costs_s
    from ddlscope.workloads.datasets import DATASETS
    from ddlscope.workloads.models import build_model

    name, dataset, batch = parse_workload(args.workload)
    if args.stage_bounds:
        try:
            bounds = [int(b) for b in args.stage_bounds.split(",")]
        except ValueError:
            bounds = []
        if len(bounds) != WORKERS + 1 or bounds[0] != 0 or any(a >= b for a, b in zip(bounds, bounds[1:])):
            raise UserError(f"--stage-bounds {args.stage_bounds!r}; allowed: {WORKERS + 1} strictly increasing "
                            f"comma-separated layer indices from 0 to the network's top-level layers, e.g. 0,6,11")
        return bounds
    if dataset not in DATASETS:
        raise UserError(f"--workload {args.workload!r}: the pipeline cut is measured on a named dataset's shape "
                        f"({', '.join(DATASETS)}); allowed: one of those, or give --stage-bounds")
    spec = DATASETS[dataset]
    torch.manual_seed(0)
    net = build_model(name, spec.family, num_classes=spec.num_classes, input_shape=spec.image_shape)
    sample = torch.randn(max(1, batch // args.microbatches), *spec.image_shape)
    return balanced_partition(measure_layer_costs_s(list(net.children()), sample), WORKERS)


# ---------------------------------------------------------------------------- processes

class Processes:
    """The processes this benchmark started, each in a session of its own (logs in ``folder``).

    :meth:`stop` ends them and every process they started: torchrun's workers lead sessions of their
    own, so the process groups of all descendants are found first and ended with them.
    """

    def __init__(self, folder: Path):
        self.folder = folder
        self.popens: list[subprocess.Popen] = []
        self.logs: dict[int, Path] = {}

    def start(self, cmd: Sequence[str], name: str, env: Mapping[str, str] | None = None) -> subprocess.Popen:
        """Start ``cmd`` with one math thread, output to ``<folder>/<name>.log``."""
        log = self.folder / f"{name}.log"
        popen = start_process(cmd, log, threads=1, env_extra={"TMPDIR": str(self.folder), **(env or {})})
        self.popens.append(popen)
        self.logs[popen.pid] = log
        return popen

    def finish(self, popens: list[subprocess.Popen], timeout_s: float, results: Sequence[Path] = ()) -> None:
        """Wait until every process of ``popens`` exited with code 0, or every file of ``results`` exists
        and :data:`LINGER_S` more passed (the rest are then stopped); the processes are ended either way.

        Raises:
            RuntimeError: one exited non-zero, or not done within ``timeout_s`` (with the tail of its log).
        """
        deadline, written_at = time.monotonic() + timeout_s, None
        try:
            while True:
                codes = [p.poll() for p in popens]
                failed = [p for p, c in zip(popens, codes) if c not in (None, 0)]
                if failed:
                    raise RuntimeError(f"{self.describe(failed[0])} exited with code {failed[0].returncode}: "
                                       f"{log_tail(self.logs[failed[0].pid], 6)}")
                if all(c == 0 for c in codes):
                    return
                if results and written_at is None and all(Path(r).exists() for r in results):
                    written_at = time.monotonic()
                if written_at is not None and time.monotonic() - written_at > LINGER_S:
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.describe(popens[0])} did not finish within {timeout_s:g} s: "
                                       f"{log_tail(self.logs[popens[0].pid], 6)}")
                time.sleep(0.2)
        finally:
            self.stop(popens)

    def describe(self, popen: subprocess.Popen) -> str:
        return f"{self.logs[popen.pid].stem} (pid {popen.pid}, log {self.logs[popen.pid]})"

    def stop(self, popens: list[subprocess.Popen] | None = None) -> None:
        """End ``popens`` (default: all still tracked) and their descendants' process groups."""
        popens = list(self.popens if popens is None else popens)
        stop_processes(popens, STOP_GRACE_S, other_groups=descendant_groups(popens))
        self.popens = [p for p in self.popens if p not in popens]


def descendant_groups(popens: Sequence[subprocess.Popen]) -> set[int]:
    """Process-group ids of every live descendant of ``popens`` (which lead groups of their own)."""
    import psutil

    groups: set[int] = set()
    for p in popens:
        try:
            children = psutil.Process(p.pid).children(recursive=True)
        except psutil.Error:
            continue
        for child in children:
            try:
                groups.add(os.getpgid(child.pid))
            except OSError:
                continue
    return groups - {p.pid for p in popens}


_stopping = False


def _raise_interrupt(signum, frame):
    """SIGINT, SIGTERM, SIGHUP: raise KeyboardInterrupt once (the processes are ended on the way out);
    further signals are ignored, so that nothing interrupts the ending."""
    global _stopping
    if _stopping:
        return
    _stopping = True
    raise KeyboardInterrupt(signal.Signals(signum).name)


# ---------------------------------------------------------------------------- the two sides

def plain_args(args: argparse.Namespace, core_sets: list[list[int]], out: Path) -> list[str]:
    """The arguments every plain script gets: the workload, the optimizer, the steps, the cores."""
    name, dataset, batch = parse_workload(args.workload)
    return ["--model", name, "--dataset", dataset, "--batch-size", str(batch), "--learning-rate", str(LEARNING_RATE),
            "--momentum", str(MOMENTUM), "--loader-workers", "1", "--seed", "0", "--device", args.device,
            "--warmup", str(args.warmup), "--steps", str(args.steps),
            "--core-sets", ";".join(",".join(map(str, c)) for c in core_sets), "--out", str(out)]


def run_plain(model: str, args: argparse.Namespace, bounds: list[int] | None, core_sets: list[list[int]],
              procs: Processes, tag: str) -> float:
    """Samples per second of the plain script of ``model`` (see the module docstring).

    Raises:
        RuntimeError: a process failed or timed out.
    """
    script = str(PLAIN / SCRIPTS[model])
    if model == "collaborative":
        return _run_plain_swarm(args, core_sets, procs, tag, script)
    out = procs.folder / f"{tag}.json"
    extra = ["--schedule", model, "--stage-bounds", ",".join(map(str, bounds)),
             "--microbatches", str(args.microbatches)] if bounds is not None else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORKERS}",
           "--max-restarts=0", script, *plain_args(args, core_sets, out), *extra]
    procs.finish([procs.start(cmd, tag, env=_loopback_env())], args.timeout_s)
    result = json.loads(out.read_text())
    return result["samples"] / result["seconds"]


def _loopback_env() -> dict[str, str]:
    """gloo's and nccl's sockets on the loopback interface, as ``ddlscope run`` puts them for a local run."""
    from ddlscope.launch.agent import loopback_interface

    name = loopback_interface()
    return {} if name is None else {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": name}


def _run_plain_swarm(args: argparse.Namespace, core_sets: list[list[int]], procs: Processes, tag: str,
                     script: str) -> float:
    _, _, batch = parse_workload(args.workload)
    maddrs = procs.folder / f"{tag}-maddrs.txt"
    outs = [procs.folder / f"{tag}-peer{i}.json" for i in range(WORKERS)]
    swarm = ["--peers", str(WORKERS), "--target-batch-size", str(target_batch_size(batch)),
             "--matchmaking-time-s", str(MATCHMAKING_TIME_S), "--averaging-timeout-s", str(AVERAGING_TIMEOUT_S)]
    cmd = [sys.executable, script, *swarm]
    popens = [procs.start([*cmd, "--index", "0", "--maddrs-out", str(maddrs), *plain_args(args, core_sets[:1], outs[0])],
                          f"{tag}-peer0")]
    try:
        deadline = time.monotonic() + 120.0
        while not maddrs.exists():
            if popens[0].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the first plain hivemind peer did not start listening: "
                                   f"{log_tail(procs.logs[popens[0].pid], 6)}")
            time.sleep(0.1)
        initial = maddrs.read_text().split()
        for i in range(1, WORKERS):
            popens.append(procs.start([*cmd, "--index", str(i), "--initial-peers", *initial,
                                       *plain_args(args, core_sets[i:i + 1], outs[i])], f"{tag}-peer{i}"))
    except BaseException:
        procs.stop(popens)
        raise
    procs.finish(popens, args.timeout_s, results=outs)
    missing = [o.name for o in outs if not o.exists()]
    if missing:
        raise RuntimeError(f"plain hivemind peers ended without writing {', '.join(missing)}")
    window = swarm_window([row for o in outs for row in json.loads(o.read_text())["steps"]])
    if window is None:
        raise RuntimeError(f"the plain hivemind peers' timed steps do not overlap in time: each ran its steps "
                           f"before the other started; allowed: a workload whose {args.steps} steps last longer than "
                           f"the peers take to start (seconds), e.g. {WORKLOAD}")
    return window[1] / window[0]


def run_ddlscope(model: str, args: argparse.Namespace, bounds: list[int] | None, procs: Processes,
                 tag: str) -> tuple[float, float]:
    """``ddlscope run`` of the same workload: ``(reported, wall)`` samples per second (module docstring).

    Raises:
        RuntimeError: the run failed, timed out, or has no measured step.
    """
    config, db = procs.folder / f"{tag}.toml", procs.folder / f"{tag}.db"
    config.write_text(toml_text(run_tables(model, args, bounds)))
    cmd = [sys.executable, "-m", "ddlscope", "run", str(config), "--db", str(db), "--no-progress"]
    procs.finish([procs.start(cmd, tag)], args.timeout_s)
    with ResultsStore(db) as store:
        (run,) = store.runs()
        measurement = measure_run(store, run["run_id"])
        cfg = store.run_config(run["run_id"])
        steps = [s for s in store.rows("steps", run["run_id"]) if not s["warmup"]]
    if measurement is None:
        raise RuntimeError(f"ddlscope run {run['run_id']} ended {run['status']} ({run['reason']}) without a measured "
                           f"step (log folder {db.parent / 'logs'})")
    per_step = samples_per_step(model, int(cfg["batch_size"]), int(cfg["peers"]))
    seconds, samples = wall_window(steps, per_step, distribution.get(model).lockstep)
    return per_step / measurement.step_s, samples / seconds


def wall_window(steps: list[Mapping], per_step: int, lockstep: bool) -> tuple[float, float]:
    """``(seconds, samples)`` of a stored run's measured steps on the wall clock.

    Args:
        steps: the run's measured (non warm-up) ``steps`` rows: ``worker_index``, ``step``,
            ``wall_time`` (s, at the step's start), ``step_s``, ``samples``.
        per_step: samples of all workers in one step of a lockstep model.
        lockstep: the workers step together (ddp, fsdp, pipelines): from the earliest start of the
            first measured step to the latest end of the last one, ``per_step`` samples per step;
            else (swarms) :func:`~ddlscope.experiments.results.swarm_window`, the time every worker trained.

    Raises:
        ValueError: no steps, or (swarms) the workers' steps do not overlap in time.
    """
    if not steps:
        raise ValueError("no measured steps; allowed: the steps rows of a run that trained past its warm-up")
    if not lockstep:
        window = swarm_window([dict(s) for s in steps])
        if window is None:
            raise ValueError("the workers' measured steps do not overlap in time")
        return window
    first, last = min(s["step"] for s in steps), max(s["step"] for s in steps)
    start = min(s["wall_time"] for s in steps if s["step"] == first)
    end = max(s["wall_time"] + s["step_s"] for s in steps if s["step"] == last)
    return end - start, float((last - first + 1) * per_step)


# ---------------------------------------------------------------------------- one model

def measure(model: str, args: argparse.Namespace, bounds: list[int] | None, core_sets: list[list[int]],
            procs: Processes) -> dict:
    """Plain and ddlscope samples per second of ``model``, ``args.repeats`` times each, alternating
    (the side that goes first alternates too)."""
    plain, reported, wall = [], [], []
    for r in range(args.repeats):
        for side in (("plain", "ddlscope") if r % 2 == 0 else ("ddlscope", "plain")):
            tag = f"{model}-{side}-{r}"
            if side == "plain":
                plain.append(run_plain(model, args, bounds, core_sets, procs, tag))
            else:
                a, b = run_ddlscope(model, args, bounds, procs, tag)
                reported.append(a)
                wall.append(b)
        print(f"{model} repeat {r + 1}/{args.repeats}: plain {plain[-1]:.1f}, ddlscope {reported[-1]:.1f} "
              f"(wall {wall[-1]:.1f}) samples/s", flush=True)
    return summarize(model, plain, reported, wall, bounds)


def summarize(model: str, plain: list[float], reported: list[float], wall: list[float],
              bounds: list[int] | None = None) -> dict:
    """One model's row: the medians (samples/s), the ratios ddlscope / plain read per pair of repeats
    (their medians), and the verdict against :data:`TARGET` of each pair's lower ratio (reported or
    wall), from the 95 % interval of its median (``_paired``)."""
    p, d, w = statistics.median(plain), statistics.median(reported), statistics.median(wall)
    lower = [min(a, b) / q for a, b, q in zip(reported, wall, plain)]
    interval = median_interval(lower, CONFIDENCE)
    outcome = verdict(interval, TARGET, at_least=True)
    return dict(model=model, plain_samples_per_s=p, ddlscope_samples_per_s=d,
                ratio=statistics.median(a / q for a, q in zip(reported, plain)), ddlscope_wall_samples_per_s=w,
                wall_ratio=statistics.median(b / q for b, q in zip(wall, plain)), plain_runs=plain,
                ddlscope_runs=reported, ddlscope_wall_runs=wall, stage_bounds=bounds, target=TARGET,
                lower_ratio_interval=list(interval) if interval else None, confidence=CONFIDENCE, verdict=outcome,
                meets_target=outcome == "met", note=NOTES[model])


def not_run(model: str, why: str) -> dict:
    """The row of a model this machine cannot run: no figures (None), the reason as its note."""
    return dict(model=model, plain_samples_per_s=None, ddlscope_samples_per_s=None, ratio=None,
                ddlscope_wall_samples_per_s=None, wall_ratio=None, target=TARGET, meets_target=None,
                note=f"not run: {why}")


def gpu_shortage(model: str, device: str) -> str | None:
    """Why ``model`` cannot run on this machine's GPUs (a torchrun model needs one per worker), else None."""
    if device != "cuda" or distribution.get(model).launcher != "torchrun":
        return None
    have = torch.cuda.device_count()
    return None if have >= WORKERS else f"{WORKERS} workers need {WORKERS} GPUs, {have} visible"


# ---------------------------------------------------------------------------- main

def _fmt(v: float | None, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated (default: {','.join(MODELS)})")
    parser.add_argument("--workload", default=WORKLOAD, help=f"model:dataset:batch_size (default: {WORKLOAD})")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--steps", type=int, default=30, help="measured steps per worker after the warm-up")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=7,
                        help="pairs of runs per model (at least 6 for a 95 %% interval)")
    parser.add_argument("--microbatches", type=int, default=4, help="gpipe, 1f1b: micro-batches per batch")
    parser.add_argument("--stage-bounds", default=None, help="gpipe, 1f1b: the cut, e.g. 0,6,11 (default: measured)")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="longest one run may take")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "peers.json")
    parser.add_argument("--docs", type=Path, default=DOCS_PAGE, help="docs page whose 'peers' block is rewritten")
    parser.add_argument("--no-docs", action="store_true", help="leave the docs page as it is")
    parser.add_argument("--keep", type=Path, default=None,
                        help="keep the runs' configs, logs, results and databases in this (new or empty) folder")
    args = parser.parse_args()
    models = parse_models(args.models)
    _, _, batch = parse_workload(args.workload)
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1 or args.timeout_s <= 0:
        raise UserError(f"--steps {args.steps} --warmup {args.warmup} --repeats {args.repeats} --timeout-s "
                        f"{args.timeout_s:g}; allowed: steps >= 1, warmup >= 0, repeats >= 1, timeout-s > 0")
    if any(m in ("gpipe", "1f1b") for m in models) and (args.microbatches < WORKERS or batch % args.microbatches):
        raise UserError(f"--microbatches {args.microbatches} with batch {batch}; allowed: >= {WORKERS} (1f1b needs "
                        f"one per stage) and dividing the batch size")
    check_device(args.device)
    if not args.no_docs:
        check_docs_block(args.docs, "peers")
    from ddlscope.config import available_cores

    cores = available_cores()
    if len(cores) < WORKERS:
        raise UserError(f"{WORKERS} workers of one core each need {WORKERS} cores; this process may use {cores}")
    core_sets = [[c] for c in cores[:WORKERS]]  # what ddlscope pins with vcpus_per_peer = 1 (RunConfig.core_sets)
    torch.set_num_threads(1)
    bounds = pipeline_cut(args) if any(m in ("gpipe", "1f1b") for m in models) else None

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # also where a shell started it with SIGINT ignored
        signal.signal(sig, _raise_interrupt)
    if args.keep is not None and args.keep.exists() and any(args.keep.iterdir()):
        raise UserError(f"--keep {args.keep} is not empty; allowed: a new or empty folder")
    rows = []
    with contextlib.ExitStack() as stack:
        if args.keep is None:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ddlscope-peers-")))
        else:
            folder = args.keep.resolve()
            folder.mkdir(parents=True, exist_ok=True)
        procs = Processes(folder)
        try:
            for model in models:
                why = gpu_shortage(model, args.device)
                rows.append(not_run(model, why) if why else
                            measure(model, args, bounds if model in ("gpipe", "1f1b") else None, core_sets, procs))
        finally:
            procs.stop()

    name, dataset, _ = parse_workload(args.workload)
    measured = [r["meets_target"] for r in rows if r["meets_target"] is not None]
    import hivemind

    result = dict(device=args.device, gpu=torch.cuda.get_device_name() if args.device == "cuda" else None,
                  model=name, dataset=dataset, batch_size=batch, workers=WORKERS, cores_per_worker=1,
                  warmup_steps=args.warmup, steps=args.steps, repeats=args.repeats, microbatches=args.microbatches,
                  stage_bounds=bounds, target_batch_size=target_batch_size(batch),
                  matchmaking_time_s=MATCHMAKING_TIME_S, averaging_timeout_s=AVERAGING_TIMEOUT_S, models=rows,
                  target=TARGET, meets_target=all(measured) if measured else None,
                  torch=torch.__version__, hivemind=hivemind.__version__, host=os.uname().nodename,
                  measured_at=time.strftime("%Y-%m-%d %H:%M:%S"))
    print()
    print(f"{'model (' + args.device + ')':<16}{'plain/s':>10}{'ddlscope/s':>12}{'ratio':>8}{'wall/s':>10}"
          f"{'wall ratio':>12}{'lower, 95 %':>16}{'target':>9}")
    for r in rows:
        iv = interval_text(r.get("lower_ratio_interval"), ".3f") if r["meets_target"] is not None else ""
        print(f"{r['model']:<16}{_fmt(r['plain_samples_per_s'], '.1f'):>10}{_fmt(r['ddlscope_samples_per_s'], '.1f'):>12}"
              f"{_fmt(r['ratio'], '.3f'):>8}{_fmt(r['ddlscope_wall_samples_per_s'], '.1f'):>10}"
              f"{_fmt(r['wall_ratio'], '.3f'):>12}{iv:>16}{'>= ' + format(TARGET, 'g'):>9}  "
              f"{r.get('verdict', '')}  {r['note']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")
    if not args.no_docs:
        update_docs_block(args.docs, "peers", peers_markdown(result))
        print(f"rewrote the 'peers' block of {args.docs}")


if __name__ == "__main__":
    try:
        main()
    except UserError as e:          # bad input (a model name, the docs page): one line, no traceback
        raise SystemExit(f"error: {e}") from None
    except KeyboardInterrupt as e:  # every process was ended on the way out
        raise SystemExit(f"interrupted ({e.args[0] if e.args else 'SIGINT'}); every process it started was ended") \
            from None
