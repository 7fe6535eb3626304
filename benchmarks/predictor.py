"""Predictor accuracy and speed on the local validation grid (issue 4's targets).

1. Speed: profile ResNet-18 on CIFAR-10 shapes from scratch (empty cache) and predict every
   distribution model with memory; then time one more prediction on another cluster and for
   one more distribution model. Targets: profile + prediction <= 60 s, each further <= 1 s.
2. Accuracy: ``ddlscope validate`` on the grid (default preset ``local``: MNIST and CIFAR-10
   shapes x ResNet-18, VGG-11, MobileNetV2 x single, ddp, fsdp, gpipe, 1f1b, collaborative on 2
   workers of one core): predicted vs. measured seconds per epoch. Targets: median absolute
   error <= 10 % for every distribution model, top-1 recommendation correct in >= 90 % of
   cells, median regret <= 5 %.

    python benchmarks/predictor.py [--grid local] [--cluster FILE] [--db DB] [--repeats N]
    sudo python benchmarks/predictor.py --grid links     # emulated links (root): every model that runs on them
    sudo python benchmarks/predictor.py --grid churn     # a collaborative pair with a peer killed and back, 3 runs each

``--repeats N`` (or the grid's ``repeats``) runs every cell N times, interleaved; each cell shows
its median run and the tables the median run-to-run spread per model, so that an error can be
told from the noise of this machine.

With ``--grid links`` (or ``moe-links``) the errors are also reported per distribution model and
emulated link (``"ddp @ 50 Mbit/s"``), each such cell group against the same <= 10 % target, and
the thesis references' errors there show where eq. 5.1 and eq. 6.1/6.2 break. Another grid than
``local`` writes ``benchmarks/results/predictor-<grid>.json`` and the ``predictor-<grid>`` block.

Prints a table, writes ``benchmarks/results/predictor.json`` (and the validation report next
to the database) and rewrites the results block of ``docs/validation.md`` (``--docs``; ``--no-docs``
to leave it, e.g. on a machine the docs do not describe). Real runs are stored in the database,
so a second invocation with the same ``--db`` reuses them (pass ``--rerun`` to measure again).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from ddlscope.errors import UserError
from ddlscope.experiments.validate import calibration_options, load_grid, missing_fits, run_validation
from ddlscope.modeling.cluster import load_cluster
from ddlscope.modeling.recommend import candidate_settings, recommend
from ddlscope.predict.validation_report import summarize, write_validation_report
from ddlscope.profiling.calibrate import CalibrationError
from ddlscope.workloads.datasets import DATASETS

from _docs import DOCS_PAGE, check_docs_block, predictor_markdown, update_docs_block

HERE = Path(__file__).parent
SPEED_TARGET_S, FURTHER_TARGET_S = 60.0, 1.0


def speed(grid, cluster, other_cluster, cache_dir: Path, data_root: Path) -> dict:
    """Seconds to profile ResNet-18 from scratch and predict, and for each further prediction."""
    from ddlscope.profiling.profile import load_or_profile
    from ddlscope.workloads.datasets import write_synthetic

    write_synthetic("cifar10", data_root, train_size=max(128, grid.batch_size), test_size=32, seed=0)
    t0 = time.perf_counter()
    profile = load_or_profile("resnet18", "cifar10", grid.batch_size, threads=grid.threads,
                              loader_workers=(grid.loader_workers,), data_root=data_root, cache_dir=cache_dir)
    t1 = time.perf_counter()
    settings = candidate_settings(grid.strategies_for("resnet18", "cifar10"), grid.workers, grid.batch_size,
                                  DATASETS["cifar10"].train_size, microbatches=grid.microbatches,
                                  matchmaking_time_s=grid.matchmaking_time_s)
    recommend(profile, cluster, settings)
    t2 = time.perf_counter()
    recommend(profile, other_cluster, settings)
    t3 = time.perf_counter()
    recommend(profile, cluster, settings[:1])
    t4 = time.perf_counter()
    return {"profile_s": t1 - t0, "predict_all_s": t2 - t1, "profile_and_predict_s": t2 - t0,
            "further_cluster_s": t3 - t2, "further_strategy_s": t4 - t3,
            "distribution_models": len(settings)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grid", default="local")
    ap.add_argument("--cluster", type=Path, help="cluster TOML of this machine (default: calibrate now)")
    ap.add_argument("--other-cluster", type=Path, default=HERE.parent / "ddlscope" / "examples" / "cluster-4xv100-nvlink.toml")
    ap.add_argument("--db", type=Path, help="results database (default: a fresh temporary one)")
    ap.add_argument("--rerun", action="store_true")
    ap.add_argument("--repeats", type=int, choices=range(1, 11), metavar="1-10",
                    help="real runs per cell (default: the grid's); a cell shows its median run")
    ap.add_argument("--docs", type=Path, default=DOCS_PAGE, help="docs page whose 'predictor' block is rewritten")
    ap.add_argument("--no-docs", action="store_true", help="leave the docs page as it is")
    args = ap.parse_args()
    block = "predictor" if args.grid == "local" else f"predictor-{Path(args.grid).stem}"
    if not args.no_docs:
        check_docs_block(args.docs, block)

    grid = load_grid(args.grid)
    if args.repeats is not None:
        grid = grid.model_copy(update={"repeats": args.repeats})
    tmp = Path(tempfile.mkdtemp(prefix="ddlscope-predictor-"))
    db = args.db or tmp / "ddlscope.db"
    if args.cluster:
        cluster = load_cluster(args.cluster)
        lacking = missing_fits(grid, cluster, args.cluster)
        if lacking:
            print(f"warning: {lacking}", file=sys.stderr)
    else:
        from ddlscope.profiling.calibrate import calibrate

        # the fits the grid's models read; hivemind's swarms train the grid's own network when it has one
        cluster = calibrate(workers=grid.workers, threads=grid.threads, **calibration_options(grid)).cluster
        from ddlscope.modeling.cluster import write_cluster

        kept = write_cluster(cluster, db.parent / "cluster.toml", header="calibrated by benchmarks/predictor.py")
        print(f"calibrated this machine: {kept} (pass it as --cluster to reuse)")
    data_root = db.parent / "suite-data"
    fast = speed(grid, cluster, load_cluster(args.other_cluster), tmp / "fresh-profiles", data_root)
    # those profiles were only for the speed figure; with --db given the folder holds nothing else
    shutil.rmtree(tmp if args.db else tmp / "fresh-profiles", ignore_errors=True)
    t0 = time.perf_counter()
    cells = run_validation(grid, cluster, db, data_root=data_root, profile_dir=db.parent / "profiles",
                           rerun=args.rerun)
    wall = time.perf_counter() - t0
    from ddlscope.store.db import ResultsStore

    with ResultsStore(db) as store:  # the grid's runs, also those an earlier invocation stored and this one reused
        runs_s = sum(r["ended_at"] - r["created_at"] for r in store.runs(grid.name) if r["ended_at"])
    summary = summarize(cells)
    report = write_validation_report(cells, db.parent / "validation" / grid.name, f"Predictor validation: {grid.name}",
                                     extra={"speed": fast, "cluster": cluster.model_dump()})

    rows = [("profile + predict ResNet-18 (s)", fast["profile_and_predict_s"], f"<= {SPEED_TARGET_S:.0f}",
             fast["profile_and_predict_s"] <= SPEED_TARGET_S),
            ("further cluster (s)", fast["further_cluster_s"], f"<= {FURTHER_TARGET_S:.0f}",
             fast["further_cluster_s"] <= FURTHER_TARGET_S),
            ("further distribution model (s)", fast["further_strategy_s"], f"<= {FURTHER_TARGET_S:.0f}",
             fast["further_strategy_s"] <= FURTHER_TARGET_S)]
    rows += [(t.name, t.value, f"{t.comparison} {t.threshold:g}", t.passed) for t in summary.targets]
    print(f"\n{'measure':48s} {'value':>10s} {'target':>10s}  pass")
    for name, value, target, ok in rows:
        shown = "-" if value is None else f"{value:.3f}"
        print(f"{name:48s} {shown:>10s} {target:>10s}  {'yes' if ok else 'NO'}")
    print(f"\nvalidation wall time {wall / 60:.1f} min (its real runs, reused ones included: {runs_s / 60:.1f} min); "
          f"report {report}")
    out = {"grid": grid.model_dump(), "cluster": cluster.model_dump(), "speed": fast, "validation_wall_s": wall,
           "runs_s": runs_s,
           "summary": summary.to_dict(), "cells": [asdict(c) for c in cells], "db": str(db),
           "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
           "speed_targets_s": {"profile_and_predict_s": SPEED_TARGET_S, "further_s": FURTHER_TARGET_S}}
    result_file = HERE / "results" / ("predictor.json" if block == "predictor" else f"{block}.json")
    result_file.parent.mkdir(exist_ok=True)
    result_file.write_text(json.dumps(out, indent=2, default=str))
    print(f"wrote {result_file}")
    if not args.no_docs:           # the docs show what the JSON holds, read back
        update_docs_block(args.docs, block, predictor_markdown(json.loads(result_file.read_text())))
        print(f"rewrote the {block!r} block of {args.docs}")


if __name__ == "__main__":
    try:
        main()
    except UserError as e:          # bad input (a grid, a cluster file, the docs page): one line, no traceback
        raise SystemExit(f"error: {e}") from None
    except CalibrationError as e:   # the calibration of this machine failed or timed out: where it stood, in one line
        raise SystemExit(f"error: {e} (pass --cluster FILE to reuse an earlier calibration)") from None
