"""How ``ddlscope report`` scales with the number of runs: seconds and plot sizes for N runs.

The runs are SYNTHETIC, made up for timing only: every run is named ``synthetic-<i>`` in the group
``synthetic-report-scale`` and has made-up steps, evaluations and host samples (a fixed random
seed) shaped like a real run's rows, none of them measured. Nothing here is a training result.

For each N the script builds a fresh store of N runs (workers each, steps per worker), runs the
real ``ddlscope report --group synthetic-report-scale`` on it in a subprocess (import time
included) and records the wall time and the largest PNG it drew.

    python benchmarks/report_scale.py [--runs 10 50 200] [--workers 2] [--steps 60] [--profile]

Prints a table and writes ``benchmarks/results/report_scale.json``. ``--profile`` also prints
cProfile's top functions of an in-process report of the largest N.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ddlscope.store.db import ResultsStore

GROUP = "synthetic-report-scale"
STRATEGIES = ("single", "ddp", "collaborative")


def build_synthetic_store(db: Path, runs: int, workers: int = 2, steps: int = 60, evals: int = 4,
                          seed: int = 0) -> list[str]:
    """Write ``runs`` SYNTHETIC completed runs (made-up rows, for timing and layout only) into ``db``.

    The first run is a ``single`` (the baseline), the others cycle through ``ddp`` and
    ``collaborative`` with ``workers`` workers, each with ``steps`` steps, ``evals`` held-out
    evaluations and one host sample every 10 steps. Returns the run ids, in order.
    """
    rng = random.Random(seed)
    ids = []
    with ResultsStore(db) as store:
        for i in range(runs):
            strategy = STRATEGIES[0] if i == 0 else STRATEGIES[1 + i % 2]
            n = 1 if strategy == "single" else workers
            config = dict(model="tiny_cnn", dataset="digits", strategy=strategy, peers=n, batch_size=16)
            run_id = store.create_run(f"synthetic-{i}", strategy, config, GROUP)
            t0 = 1_700_000_000.0 + i * 100
            step_rows, host_rows = [], []
            for w in range(n):
                store.upsert_worker(run_id, w, status="completed", reason="sample_budget", train_start_time=t0,
                                    train_end_time=t0 + steps * 0.05, eval_s=0.0)
                for s in range(steps):
                    fwd, bwd = rng.uniform(0.005, 0.02), rng.uniform(0.01, 0.04)
                    step_rows.append(dict(run_id=run_id, worker_index=w, step=s, wall_time=t0 + s * 0.05, samples=16,
                                          data_load_s=0.002, forward_s=fwd, backward_s=bwd, optimizer_s=0.003,
                                          averaging_s=0.0, step_s=fwd + bwd + 0.005, loss=2.3 * (1 - s / (2 * steps)),
                                          warmup=int(s == 0), optimizer_stepped=1, comm_s=0.0, comm_wait_s=0.0,
                                          bubble_s=0.0, comm_bytes=0))
                    if s % 10 == 0:
                        host_rows.append(dict(cpu_percent=rng.uniform(50, 100), rss_bytes=300_000_000 + s,
                                              net_sent_bytes=1000 * s, net_recv_bytes=1000 * s, wall_time=t0 + s * 0.05))
                for e in range(evals):
                    store.add_eval(run_id, w, (e + 1) * steps // evals, (e + 1) * steps * 0.05 / evals,
                                   min(1.0, 0.5 + 0.1 * e + rng.uniform(0, 0.05)), 1.0, 300)
                for h in host_rows:
                    store.add_host_sample(run_id, w, h)
                host_rows.clear()
            store.conn.execute("BEGIN")
            for r in step_rows:
                store.add_step(run_id, r["worker_index"], r)
            store.conn.execute("COMMIT")
            store.finish_run(run_id, "completed")
            ids.append(run_id)
    return ids


def png_sizes(folder: Path) -> dict[str, tuple[int, int]]:
    """``{file name: (width, height)}`` in pixels of every PNG in ``folder`` (read from the PNG header)."""
    sizes = {}
    for png in sorted(folder.glob("*.png")):
        head = png.read_bytes()[:24]
        sizes[png.name] = (int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big"))
    return sizes


def time_report(runs: int, workers: int, steps: int, tmp: Path) -> dict:
    """Build a store of ``runs`` synthetic runs and time the ``ddlscope report`` command on it."""
    db = tmp / f"runs-{runs}" / "ddlscope.db"
    db.parent.mkdir(parents=True)
    build_synthetic_store(db, runs, workers, steps)
    out = db.parent / "report"
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "ddlscope", "report", "--group", GROUP, "--db", str(db),
                             "--out", str(out)], capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"ddlscope report failed on {runs} runs: {result.stderr[-2000:]}")
    sizes = png_sizes(out)
    widest = max(sizes.items(), key=lambda kv: kv[1][0])
    return dict(runs=runs, workers=workers, steps_per_worker=steps, report_s=seconds, pngs=sizes,
                widest_png=widest[0], widest_px=widest[1][0], tallest_px=max(h for _, h in sizes.values()))


def profile_report(runs: int, workers: int, steps: int, tmp: Path) -> None:
    """cProfile of an in-process report of ``runs`` synthetic runs: prints the top functions by cumulative time."""
    import cProfile
    import pstats

    from ddlscope.cli import _report

    db = tmp / f"profile-{runs}" / "ddlscope.db"
    db.parent.mkdir(parents=True)
    ids = build_synthetic_store(db, runs, workers, steps)
    profiler = cProfile.Profile()
    profiler.runcall(_report, db, ids, db.parent / "report", None)
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, nargs="+", default=[10, 50, 200])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "report_scale.json")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="ddlscope-report-scale-") as tmp:
        rows = [time_report(n, args.workers, args.steps, Path(tmp)) for n in args.runs]
        if args.profile:
            profile_report(max(args.runs), args.workers, args.steps, Path(tmp))
    print("SYNTHETIC runs (made-up rows, timing only)")
    print(f"{'runs':>6} {'report s':>9} {'widest PNG':>22} {'px wide':>8} {'px tall':>8}")
    for r in rows:
        print(f"{r['runs']:>6} {r['report_s']:>9.2f} {r['widest_png']:>22} {r['widest_px']:>8} {r['tallest_px']:>8}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(note="synthetic runs, made up for timing only; not training results",
                                        machine_cores=len(__import__("os").sched_getaffinity(0)), results=rows),
                                   indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
