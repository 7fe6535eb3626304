"""Instrumentation overhead: ddlscope's measured ``single`` run vs. a plain PyTorch loop.

Both train the same workload (model, data, preprocessing, DataLoader, optimizer; built by the
same code) for the same steps in this process, alternating, ``--repeats`` times each. The plain
loop does forward, backward and optimizer step and nothing else. The ddlscope run is the real
training loop: per-phase timers, a SQLite row committed per step, the host-metrics thread.
Both time from the end of the warm-up steps to the end of the last step.

Target (design.md section 5): median overhead < 3 %.

    python benchmarks/overhead.py [--model resnet18] [--steps 40] [--repeats 5]

Prints a table, writes ``benchmarks/results/overhead.json`` and rewrites the results block of
``docs/validation.md`` (``--docs``; ``--no-docs`` to leave it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ddlscope.config import available_cores, validate_config
from ddlscope.errors import UserError
from ddlscope.launch.local import prepare_dataset
from ddlscope.store.db import ResultsStore
from ddlscope.strategies import WorkerContext
from ddlscope.train.loop import batches_forever, build_workload, run_worker

from _docs import DOCS_PAGE, check_docs_block, overhead_markdown, update_docs_block

TARGET = 0.03


def plain_loop_s(cfg, warmup: int, steps: int) -> float:
    """Seconds for ``steps - warmup`` steps of a bare PyTorch loop on the same workload."""
    wl = build_workload(cfg)
    batches = batches_forever(wl.train_loader)
    loss_fn = torch.nn.CrossEntropyLoss()
    wl.model.train()
    start = None
    for step in range(steps):
        if step == warmup:
            start = time.perf_counter()
        x, y = next(batches)
        loss = loss_fn(wl.model(x), y)
        loss.backward()
        wl.optimizer.step()
        wl.optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def ddlscope_loop_s(cfg, warmup: int, db: Path) -> float:
    """Seconds for the same steps in ddlscope's instrumented loop, measured from its own records."""
    with ResultsStore(db) as store:
        run_id = store.create_run("overhead", "single", cfg.model_dump(mode="json"))
        ctx = WorkerContext(run_id=run_id, worker_index=0, num_workers=1, cores=available_cores(), initial_peers=[])
        store.upsert_worker(run_id, 0, status="starting")
        run_worker(cfg, ctx, store)
        first = next(s for s in store.rows("steps", run_id) if s["step"] == warmup)
        end = store.workers(run_id)[0]["train_end_time"]
        return end - first["wall_time"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "overhead.json")
    parser.add_argument("--docs", type=Path, default=DOCS_PAGE, help="docs page whose 'overhead' block is rewritten")
    parser.add_argument("--no-docs", action="store_true", help="leave the docs page as it is")
    args = parser.parse_args()
    if not args.no_docs:
        check_docs_block(args.docs, "overhead")

    cores = available_cores()
    torch.set_num_threads(len(cores))
    cfg = validate_config(dict(model=args.model, dataset=args.dataset, batch_size=args.batch_size,
                               sample_budget=args.steps * args.batch_size, warmup_steps=args.warmup, loader_workers=1))
    prepare_dataset(cfg)
    plain, instrumented = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            plain.append(plain_loop_s(cfg, args.warmup, args.steps))
            instrumented.append(ddlscope_loop_s(cfg, args.warmup, Path(tmp) / f"r{r}.db"))
            print(f"repeat {r + 1}/{args.repeats}: plain {plain[-1]:.3f} s, ddlscope {instrumented[-1]:.3f} s", flush=True)
    p, i = statistics.median(plain), statistics.median(instrumented)
    overhead = i / p - 1.0
    timed_steps = args.steps - args.warmup
    result = dict(
        model=args.model, dataset=args.dataset, batch_size=args.batch_size, timed_steps=timed_steps,
        repeats=args.repeats, cores=len(cores), torch=torch.__version__, host=os.uname().nodename,
        plain_s=plain, ddlscope_s=instrumented, plain_median_s=p, ddlscope_median_s=i,
        plain_step_ms=1000 * p / timed_steps, ddlscope_step_ms=1000 * i / timed_steps,
        overhead_fraction=overhead, target_fraction=TARGET, meets_target=overhead < TARGET,
        measured_at=time.strftime("%Y-%m-%d %H:%M:%S"),
    )
    print()
    print(f"{'workload':<28}{'plain ms/step':>15}{'ddlscope ms/step':>18}{'overhead':>10}{'target':>8}")
    print(f"{args.model + '/' + args.dataset + ' bs' + str(args.batch_size):<28}{result['plain_step_ms']:>15.1f}"
          f"{result['ddlscope_step_ms']:>18.1f}{overhead:>10.2%}{'< 3%':>8}  {'PASS' if overhead < TARGET else 'FAIL'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")
    if not args.no_docs:
        update_docs_block(args.docs, "overhead", overhead_markdown(result))
        print(f"rewrote the 'overhead' block of {args.docs}")


if __name__ == "__main__":
    try:
        main()
    except UserError as e:          # bad input (a model, a dataset, the docs page): one line, no traceback
        raise SystemExit(f"error: {e}") from None
