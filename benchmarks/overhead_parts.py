"""Where ddlscope's instrumented loop loses time against a plain loop (issue 16's overhead target):
the same workload timed by the plain loop and by ddlscope's loop with one part of its
instrumentation turned down at a time, then the host-side operations of both under torch.profiler.

Variants (each a ``single`` run of ``benchmarks/overhead.py``'s ``ddlscope_loop_s``):

- ``ddlscope``: as a user runs it;
- ``host_sample_60s``: the host-metrics thread samples every 60 s instead of every second;
- ``commit_60s``: the step rows are committed every 60 s instead of every second;
- ``loader_0``: no DataLoader worker processes (shows whether the loader limits the step);
- ``no_values``: no loss and hits kept on the device (the rows' loss and accuracy stay empty);
- ``host_clock``: the phases timed by the host clock instead of CUDA events (wrong on a GPU: it
  shows what the events cost).

The last two change ddlscope's code for the diagnosis; no run of a user does that. Every repeat
also times the host (the training thread) per part of the step: waiting for the loader, issuing
forward and backward, the optimizer, and the loop's bookkeeping of the step's row (``rows``), for
the plain loop and for ``ddlscope``; what a loop spends beyond its parts is ``other``.

Then ``--profile-steps`` steps of each loop run under ``torch.profiler`` (CPU and, on a GPU, CUDA
activities), and the host operations' call counts and self CPU time are compared: waits on the
device (``cudaEventSynchronize``, ``cudaStreamSynchronize``) and the ops both loops share.

    python benchmarks/overhead_parts.py [--device cuda] [--workload resnet18:cifar10:256] [--steps 200]
                                        [--repeats 3] [--profile-steps 60]

Prints both tables and writes ``benchmarks/results/overhead-parts-<device>.json``. It measures, it
does not judge: ``benchmarks/overhead.py`` holds the target.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from ddlscope.config import validate_config
from ddlscope.errors import UserError
from ddlscope.launch.local import prepare_dataset

from _docs import git_commit, machine_description
from overhead import DEFAULT_LOADER_WORKERS, check_device, ddlscope_loop_s, parse_workload, plain_loop_s

VARIANTS = {"ddlscope": {}, "host_sample_60s": dict(host_sample_interval_s=60.0),
            "commit_60s": dict(store_flush_interval_s=60.0), "loader_0": dict(loader_workers=0),
            "no_values": {}, "host_clock": {}}
#: host operations always listed (waits on the device, copies), whether or not they are in the top
WATCHED_OPS = ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventQuery",
               "cudaMemcpyAsync", "cudaLaunchKernel", "aten::copy_", "aten::to")


@contextlib.contextmanager
def changed_loop(variant: str, warmup: int, sections: dict[str, float]):
    """ddlscope's loop with ``variant``'s code change (``no_values``, ``host_clock``; none for the
    others), timing the training thread's host seconds per part of the timed steps into ``sections``."""
    from ddlscope.measure import step_values, timeline
    from ddlscope.strategies.base import Strategy
    from ddlscope.strategies.single import SingleStrategy
    from ddlscope.train import loop

    timing = {"on": False}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if timing["on"]:
                    sections[name] = sections.get(name, 0.0) + time.perf_counter() - t0
        return wrapper

    original_batches = loop.batches_forever

    def timed_batches(loader):
        inner, take = original_batches(loader), timed("data_wait", next)
        for step in itertools.count():
            timing["on"] = step >= warmup
            yield take(inner)

    with contextlib.ExitStack() as undo:
        def patch(owner, name, value):
            undo.callback(setattr, owner, name, vars(owner)[name])  # the descriptor itself (a classmethod)
            setattr(owner, name, value)

        patch(loop, "batches_forever", timed_batches)
        patch(Strategy, "forward_backward", timed("forward_backward", Strategy.forward_backward))
        patch(SingleStrategy, "step", timed("optimizer", SingleStrategy.step))
        patch(Strategy, "zero_grad", timed("optimizer", Strategy.zero_grad))
        patch(loop._StepRows, "add", timed("rows", loop._StepRows.add))
        if variant == "no_values":
            patch(step_values.DeviceValues, "of", classmethod(lambda cls, *args: None))
        elif variant == "host_clock":
            patch(timeline, "clock_for", lambda device: timeline.HostClock())
        yield


def op_table(run, device: str) -> dict[str, dict]:
    """``{op: {"count", "self_cpu_ms"}}`` of the host operations while ``run()`` trains."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        run()
    return {e.key: dict(count=e.count, self_cpu_ms=e.self_cpu_time_total / 1e3) for e in prof.key_averages()}


def host_parts_ms(parts: list[dict[str, float]], totals: list[float], timed: int) -> dict[str, float]:
    """Median host milliseconds per timed step of each part over the repeats, and ``other``: the
    step's time beyond its parts (the host's own work between them, or waits on the device)."""
    names = sorted({name for p in parts for name in p})
    out = {name: statistics.median(p.get(name, 0.0) for p in parts) / timed * 1e3 for name in names}
    out["other"] = statistics.median(t - sum(p.values()) for p, t in zip(parts, totals)) / timed * 1e3
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--workload", default="resnet18:cifar10:256", help="model:dataset:batch_size")
    parser.add_argument("--steps", type=int, default=200, help="steps of each repeat (warm-up included)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile-steps", type=int, default=60, help="steps of each loop under the profiler")
    parser.add_argument("--top", type=int, default=15, help="ops listed by self CPU time")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model, dataset, batch = parse_workload(args.workload)
    if not 0 <= args.warmup < min(args.steps, args.profile_steps) or args.repeats < 1:
        raise UserError(f"--warmup {args.warmup} --steps {args.steps} --profile-steps {args.profile_steps} --repeats "
                        f"{args.repeats}; allowed: 0 <= warmup < steps and profile-steps, repeats >= 1")
    check_device(args.device)
    base = dict(model=model, dataset=dataset, batch_size=batch, device=args.device, warmup_steps=args.warmup,
                sample_budget=args.steps * batch, loader_workers=DEFAULT_LOADER_WORKERS[args.device],
                final_eval=False)
    cfg = validate_config(base)
    prepare_dataset(cfg)
    timed = args.steps - args.warmup
    seconds: dict[str, list[float]] = {k: [] for k in ("plain", *VARIANTS)}
    parts: dict[str, list[dict[str, float]]] = {k: [] for k in seconds}  # host seconds per part, per repeat
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):  # alternating, so that drifts of the machine hit every variant alike
            parts["plain"].append({})
            seconds["plain"].append(plain_loop_s(cfg, args.warmup, args.steps, parts["plain"][-1]))
            for name, change in VARIANTS.items():
                parts[name].append({})
                with changed_loop(name, args.warmup, parts[name][-1]):
                    seconds[name].append(ddlscope_loop_s(validate_config({**base, **change}), args.warmup,
                                                         Path(tmp) / f"{name}-{r}.db"))
            print(f"repeat {r + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in seconds.items()),
                  flush=True)
        short = validate_config({**base, "sample_budget": args.profile_steps * batch})
        ops = {"plain": op_table(lambda: plain_loop_s(short, args.warmup, args.profile_steps), args.device),
               "ddlscope": op_table(lambda: ddlscope_loop_s(short, args.warmup, Path(tmp) / "profiled.db"),
                                    args.device)}
    plain_ms = statistics.median(seconds["plain"]) / timed * 1e3
    variants = {k: dict(seconds=v, step_ms=statistics.median(v) / timed * 1e3,
                        vs_plain=statistics.median(v) / statistics.median(seconds["plain"]) - 1.0,
                        host_ms_per_step=host_parts_ms(parts[k], v, timed))
                for k, v in seconds.items()}
    print(f"\n{args.workload} on {args.device}, {timed} timed steps, median of {args.repeats}:")
    print(f"{'loop':<18}{'ms/step':>10}{'vs plain':>10}   host ms per step, by part")
    for name, v in variants.items():
        print(f"{name:<18}{v['step_ms']:>10.2f}{v['vs_plain']:>10.1%}   "
              + " ".join(f"{part} {ms:.2f}" for part, ms in v["host_ms_per_step"].items()))
    top = sorted(ops["ddlscope"], key=lambda k: -ops["ddlscope"][k]["self_cpu_ms"])[:args.top]
    print(f"\nhost operations, {args.profile_steps} steps each: calls and self CPU ms, plain | ddlscope")
    for op in dict.fromkeys([*top, *WATCHED_OPS]):
        p, d = ops["plain"].get(op, {}), ops["ddlscope"].get(op, {})
        print(f"{op[:58]:<58}{p.get('count', 0):>8}{p.get('self_cpu_ms', 0.0):>10.1f} |"
              f"{d.get('count', 0):>8}{d.get('self_cpu_ms', 0.0):>10.1f}")
    out = args.out or Path(__file__).parent / "results" / f"overhead-parts-{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(
        workload=args.workload, device=args.device, machine=machine_description(), commit=git_commit(),
        gpu=torch.cuda.get_device_name() if args.device == "cuda" else None, timed_steps=timed,
        repeats=args.repeats, plain_step_ms=plain_ms, variants=variants, ops=ops,
        measured_at=time.strftime("%Y-%m-%d %H:%M:%S")), indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        raise SystemExit(f"error: {e}") from None
