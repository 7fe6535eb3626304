"""GPU check (issue 16): what ddlscope predicts from a profile against what a real run does, on
the CUDA GPU of this machine.

For every ``--workload model:dataset:batch`` (default: ResNet-18/CIFAR-10 b64 and b256,
ResNet-50/ImageNet b64, VGG-11 and MobileNetV2 on CIFAR-10 b64; synthetic data of the dataset's
shape where no local copy exists):

1. **Profile vs run.** The workload is profiled on ``cuda`` (``ddlscope profile --device cuda``),
   the ``single`` model predicts its step time and its per-worker memory split into the allocator
   peak and the runtime (CUDA context and libraries), and a real ``single`` run of the same
   workload measures both (``max_memory_allocated`` and device memory beyond torch's allocator).
   Target (issue 16): allocator peak within +-10 %.
2. **Scaling band, CPU -> GPU.** A CPU profile of the ``--cpu-workload``s (on ``--cpu-threads``
   cores) scaled to this GPU's kind (``modeling.devices.compute_scale``, a stated rough estimate)
   against the step measured in 1: is it inside the band (``check_band``)?
3. **Scaling band, GPU -> GPU.** ``--from-profiles DIR``: GPU profiles measured on another GPU kind
   (written by an earlier pass with ``--profiles-out``) scaled to this GPU's kind, against the steps
   measured here.
4. **Fit search.** ``--big model:dataset:batch`` (default ResNet-152/Highres b128, which needs more
   than an 80 GB GPU holds): the profile finds the largest batch that fits and extrapolates the
   asked-for one, and says so.

Prints a table per part, writes ``benchmarks/results/gpu-<kind>.json`` and rewrites the block
``gpu-<kind>`` of ``docs/validation.md`` (``--no-docs`` to leave it; ``--docs-from FILE`` renders
a result written elsewhere, e.g. on a lent GPU machine, without measuring).

    python benchmarks/gpu.py [--workload resnet18:cifar10:64 ...] [--cpu-workload resnet18:cifar10:64]
                             [--big resnet152:highres:128] [--from-profiles DIR] [--profiles-out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ddlscope.config import available_cores, validate_config
from ddlscope.errors import UserError
from ddlscope.experiments.results import memory_split
from ddlscope.launch.local import prepare_dataset
from ddlscope.modeling.cluster import parse_cluster
from ddlscope.modeling.devices import check_band, compute_scale, profiled_kind
from ddlscope.modeling.memory import peak_split_bytes
from ddlscope.modeling.prediction import Setting, predict
from ddlscope.modeling.profile import WorkloadProfile
from ddlscope.profiling.profile import load_or_profile
from ddlscope.store.db import ResultsStore
from ddlscope.strategies import WorkerContext
from ddlscope.train.loop import run_worker
from ddlscope.workloads.datasets import write_synthetic

from _docs import (DOCS_PAGE, add_docs_from_arguments, check_docs_block, docs_from, git_commit,
                   gpu_markdown, machine_description, update_docs_block)
from overhead import parse_workload

WORKLOADS = ("resnet18:cifar10:64", "resnet18:cifar10:256", "resnet50:imagenet:64", "vgg11:cifar10:64",
             "mobilenet_v2:cifar10:64")
MEMORY_TARGET = 0.10
LOADER_WORKERS = 4  # DataLoader workers of the runs and of the profiles' loading times
LOCAL_GPU = {"name": "this-gpu", "device": {"kind": "local"},
             "intra_node": {"bandwidth_gb_per_s": 1.0, "latency_s": 0.0}}  # one device: no link is used


def _single(profile: WorkloadProfile, batch_size: int) -> Setting:
    return Setting("single", 1, batch_size, epoch_samples=batch_size, loader_workers=LOADER_WORKERS)


def predicted(profile: WorkloadProfile, batch_size: int) -> dict:
    """The ``single`` model's step time and memory split (allocator, runtime) from ``profile``."""
    setting = _single(profile, batch_size)
    pred = predict(profile, parse_cluster(LOCAL_GPU), setting)
    allocator, runtime = peak_split_bytes(profile, setting)
    return dict(step_s=pred.step_s, compute_step_s=profile.step_at(batch_size).step_s,
                allocator_bytes=allocator, runtime_bytes=runtime)


def measured(model: str, dataset: str, batch_size: int, steps: int, warmup: int, db: Path,
             device: str = "cuda") -> dict:
    """A real ``single`` run on ``device``: median step seconds after ``warmup`` and the memory split its
    worker recorded (allocator peak = ``max_memory_allocated``; runtime = the CUDA context)."""
    root = db.parent / "data"
    if dataset != "digits":  # digits ships with scikit-learn; the others: a synthetic copy of their shape
        write_synthetic(dataset, root, train_size=max(512, 2 * batch_size), test_size=32, seed=0)
    cfg = validate_config(dict(model=model, dataset=dataset, batch_size=batch_size, device=device, data_root=root,
                               sample_budget=steps * batch_size, warmup_steps=warmup, loader_workers=LOADER_WORKERS,
                               final_eval=False))
    prepare_dataset(cfg)
    if device == "cuda":
        torch.cuda.empty_cache()
    with ResultsStore(db) as store:
        run_id = store.create_run("gpu-check", "single", cfg.model_dump(mode="json"))
        ctx = WorkerContext(run_id=run_id, worker_index=0, num_workers=1, cores=available_cores(), initial_peers=[])
        store.upsert_worker(run_id, 0, status="starting")
        run_worker(cfg, ctx, store)
        steps_s = [s["step_s"] for s in store.rows("steps", run_id) if not s["warmup"]]
        compute_s = [s["forward_s"] + s["backward_s"] + s["optimizer_s"]
                     for s in store.rows("steps", run_id) if not s["warmup"]]
        allocator, runtime = memory_split(store, run_id)
    return dict(step_s=statistics.median(steps_s), compute_step_s=statistics.median(compute_s),
                steps=len(steps_s), allocator_bytes=allocator, runtime_bytes=runtime)


def _error(pred: float | None, meas: float | None) -> float | None:
    return pred / meas - 1.0 if pred is not None and meas else None


def band_row(source: WorkloadProfile, batch_size: int, kind: str, measured_step_s: float, what: str) -> dict:
    """``source`` scaled to ``kind`` against the compute step measured on it (``check_band``)."""
    est = compute_scale(source, batch_size, kind)
    profiled_s = source.step_at(batch_size).step_s
    check = check_band(est, profiled_s, measured_step_s)
    return dict(what=what, workload=f"{source.network} / {source.dataset}", source=source.device.name, target=kind,
                batch_size=batch_size,
                profiled_step_s=profiled_s, predicted_step_s=profiled_s * est.factor, measured_step_s=measured_step_s,
                factor=est.factor, low=est.low, high=est.high, measured_factor=check.measured_factor,
                inside=check.inside, error=check.error, method=est.method, warnings=list(est.warnings))


def keep_gpu_profiles(cache: Path, to: Path) -> None:
    """Copy the CUDA profiles in ``cache`` to ``to`` (for ``--from-profiles`` on another GPU kind)."""
    to.mkdir(parents=True, exist_ok=True)
    for f in cache.glob("*.json"):
        if WorkloadProfile.model_validate_json(f.read_text()).device.type == "cuda":
            shutil.copy(f, to / f.name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", action="append", default=None,
                        help=f"model:dataset:batch_size, repeatable (default: {' '.join(WORKLOADS)})")
    parser.add_argument("--cpu-workload", action="append", default=None,
                        help="also profiled on the CPU and scaled to this GPU (default: resnet18:cifar10:64; '' for none)")
    parser.add_argument("--cpu-threads", type=int, default=8, help="cores of the CPU profile")
    parser.add_argument("--big", default="resnet152:highres:128", help="a workload too big for the GPU ('' skips)")
    parser.add_argument("--steps", type=int, default=40, help="steps of each real run (warm-up included)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--from-profiles", type=Path, default=None,
                        help="GPU profiles of another GPU kind to scale to this one")
    parser.add_argument("--profiles-out", type=Path, default=None, help="copy this GPU's profiles here")
    parser.add_argument("--out", type=Path, default=None, help="default benchmarks/results/gpu-<kind>.json")
    parser.add_argument("--docs", type=Path, default=DOCS_PAGE)
    parser.add_argument("--no-docs", action="store_true")
    add_docs_from_arguments(parser)
    args = parser.parse_args()
    if args.docs_from is not None:
        docs_from(args.docs_from, args.docs, args.block, lambda r: f"gpu-{r['kind']}", gpu_markdown)
        return
    workloads = [parse_workload(w) for w in (args.workload or WORKLOADS)]
    cpu_workloads = [parse_workload(w) for w in (args.cpu_workload or ["resnet18:cifar10:64"]) if w]
    big = parse_workload(args.big) if args.big else None
    if not torch.cuda.is_available():
        raise UserError("benchmarks/gpu.py needs a CUDA GPU; torch sees none here")
    gpu = torch.cuda.get_device_name(0)
    kind = profiled_kind(gpu)
    if kind is None:
        raise UserError(f"{gpu!r} matches no known device kind (ddlscope.modeling.devices.DEVICE_KINDS); "
                        "the scaling bands need one")
    out = args.out or Path(__file__).parent / "results" / f"gpu-{kind}.json"
    if not args.no_docs:
        check_docs_block(args.docs, f"gpu-{kind}")
    result = dict(gpu=gpu, kind=kind, machine=machine_description(), commit=git_commit(), torch=torch.__version__,
                  runs=[], bands=[], big=None, measured_at=time.strftime("%Y-%m-%d %H:%M:%S"))

    def save() -> None:  # after every part: a killed pass keeps what it measured
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))

    cache = Path(tempfile.mkdtemp(prefix="ddlscope-gpu-"))
    try:
        for model, dataset, batch in workloads:
            t0 = time.perf_counter()
            prof = load_or_profile(model, dataset, batch, device="cuda", cache_dir=cache, loader_workers=(LOADER_WORKERS,))
            p = predicted(prof, batch)
            m = measured(model, dataset, batch, args.steps, args.warmup, cache / f"{model}-{dataset}-{batch}.db")
            row = dict(model=model, dataset=dataset, batch_size=batch, predicted=p, measured=m,
                       step_error=_error(p["step_s"], m["step_s"]),
                       compute_error=_error(p["compute_step_s"], m["compute_step_s"]),
                       allocator_error=_error(p["allocator_bytes"], m["allocator_bytes"]),
                       runtime_error=_error(p["runtime_bytes"], m["runtime_bytes"]), seconds=time.perf_counter() - t0)
            row["allocator_within_target"] = row["allocator_error"] is not None and \
                abs(row["allocator_error"]) <= MEMORY_TARGET
            result["runs"].append(row)
            save()
            if args.profiles_out is not None:  # after every workload too: a pass cut short keeps its profiles
                keep_gpu_profiles(cache, args.profiles_out)
            print(f"{model}/{dataset} b{batch}: step {p['step_s'] * 1e3:.2f} predicted, {m['step_s'] * 1e3:.2f} ms "
                  f"measured; allocator {p['allocator_bytes'] / 2**20:.0f} / {m['allocator_bytes'] / 2**20:.0f} MiB; "
                  f"runtime {p['runtime_bytes'] / 2**20:.0f} / {(m['runtime_bytes'] or 0) / 2**20:.0f} MiB", flush=True)
        steps_here = {(r["model"], r["dataset"], r["batch_size"]): r["measured"]["compute_step_s"]
                      for r in result["runs"]}
        for model, dataset, batch in cpu_workloads:
            if (model, dataset, batch) not in steps_here:
                raise UserError(f"--cpu-workload {model}:{dataset}:{batch} needs the same --workload (its GPU step)")
            cpu = load_or_profile(model, dataset, batch, device="cpu", threads=args.cpu_threads, cache_dir=cache,
                                  loader_workers=(0,))
            result["bands"].append(band_row(cpu, batch, kind, steps_here[(model, dataset, batch)], "cpu -> gpu"))
            save()
        for path in sorted(args.from_profiles.glob("*.json")) if args.from_profiles else []:
            other = WorkloadProfile.model_validate_json(path.read_text())
            key = (other.network, other.dataset, other.batch_sizes[-1])
            if other.device.type == "cuda" and key in steps_here:
                result["bands"].append(band_row(other, key[2], kind, steps_here[key], "gpu -> gpu"))
                save()
        if big is not None:
            t0 = time.perf_counter()
            prof = load_or_profile(*big, device="cuda", cache_dir=cache, loader_workers=(0,))
            asked = prof.step_at(big[2])
            result["big"] = dict(model=big[0], dataset=big[1], batch_size=big[2],
                                 largest_fitting_batch_size=prof.largest_fitting_batch_size,
                                 memory_available_bytes=prof.memory_available_bytes,
                                 measured_batch_sizes=prof.measured_batch_sizes, extrapolated=asked.extrapolated,
                                 step_s=asked.step_s, fit_note=prof.fit_note(),
                                 predicted_peak_bytes=sum(peak_split_bytes(prof, _single(prof, big[2]))),
                                 seconds=time.perf_counter() - t0)
            save()
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    print()
    print(gpu_markdown(result))
    print(f"\nwrote {out}")
    if not args.no_docs:
        update_docs_block(args.docs, f"gpu-{kind}", gpu_markdown(result))
        print(f"rewrote the 'gpu-{kind}' block of {args.docs}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    try:
        main()
    except UserError as e:
        raise SystemExit(f"error: {e}") from None
