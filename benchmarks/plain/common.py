"""What the plain scripts of ``benchmarks/peers.py`` share: their arguments, the workload and the timed loop.

The plain scripts are what a user would write instead of ``ddlscope run``: torch (or hivemind)
and nothing else in the training loop. Only the network and the data come from ddlscope
(:func:`ddlscope.train.loop.build_workload`: the zoo network from the same seed, the same dataset,
preprocessing, shuffling seed and DataLoader), so that both sides train on exactly the same work.
The optimizer is plain ``torch.optim.SGD`` with the run's learning rate and momentum, the loss
``torch.nn.CrossEntropyLoss``.

Each process pins itself to its cores (``--core-sets``, one set per local rank, as ``ddlscope run``
pins its workers) and uses one math thread per core.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch


def parser(description: str) -> argparse.ArgumentParser:
    """The arguments every plain script takes (the workload, the steps, the cores, where to write)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--dataset", default="digits")
    p.add_argument("--batch-size", type=int, default=32, help="samples per worker (per stage: per pipeline) per step")
    p.add_argument("--learning-rate", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--loader-workers", type=int, default=1, help="DataLoader processes per worker")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument("--steps", type=int, default=30, help="timed steps after the warm-up")
    p.add_argument("--core-sets", default=None, help="';'-separated core sets, one per local rank (e.g. '0;1')")
    p.add_argument("--out", type=Path, required=True, help="JSON file the result is written to")
    return p


def pin(core_sets: str | None, local_rank: int) -> None:
    """Pin this process to its core set (its DataLoader workers inherit it) with one math thread per core."""
    if core_sets:
        cores = [int(c) for c in core_sets.split(";")[local_rank].split(",")]
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))


def keep_hivemind_sockets_in_tmpdir() -> None:
    """Put hivemind's Unix socket files in ``$TMPDIR`` (the benchmark's folder, removed with it):
    hivemind 1.1.12 names them under ``/tmp`` whatever ``TMPDIR`` says and leaves its clients'
    behind. Harness hygiene, outside the training loop; nothing without ``TMPDIR``."""
    from ddlscope.launch.processes import route_hivemind_sockets

    if os.environ.get("TMPDIR"):
        route_hivemind_sockets(os.environ["TMPDIR"])


def start_worker(args: argparse.Namespace) -> tuple[int, int, int]:
    """``(rank, local rank, world size)`` of this torchrun worker, pinned (:func:`pin`), on its GPU
    when ``--device cuda``, with the default process group started (nccl on CUDA, gloo on CPU)."""
    import torch.distributed as dist

    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    pin(args.core_sets, local_rank)
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    return rank, local_rank, dist.get_world_size()


def workload(args: argparse.Namespace, data_rank: int, local_rank: int
             ) -> tuple[torch.nn.Module, Iterator, torch.device]:
    """``(network, endless batches, device)`` of one worker, built as ddlscope builds them.

    Args:
        data_rank: which data stream the worker reads (its shuffle seed offset): the rank for
            data parallelism, 0 for pipeline stages (they share a batch).
    """
    from ddlscope.config import validate_config
    from ddlscope.train.loop import batches_forever, build_workload

    cfg = validate_config(dict(model=args.model, dataset=args.dataset, batch_size=args.batch_size, device=args.device,
                               loader_workers=args.loader_workers, seed=args.seed))
    wl = build_workload(cfg, data_rank, local_rank)
    return wl.model, batches_forever(wl.train_loader), wl.device


def sgd(params, args: argparse.Namespace) -> torch.optim.SGD:
    """The optimizer of both sides: SGD with heavy-ball momentum."""
    return torch.optim.SGD(params, lr=args.learning_rate, momentum=args.momentum)


def sync(device: torch.device) -> None:
    """Wait for the device (CUDA) to finish what was queued; nothing on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_window(step: Callable[[], None], warmup: int, steps: int, device: torch.device,
                 barrier: Callable[[], None]) -> float:
    """Seconds of ``steps`` calls of ``step`` after ``warmup`` untimed ones, every worker aligned.

    The clock starts after a ``barrier`` that follows the warm-up and stops after a barrier that
    follows the last timed step (on a GPU, after the device finished it): the time from the
    first timed step of the earliest worker to the end of the last step of the latest one.
    """
    for _ in range(warmup):
        step()
    sync(device)
    barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    barrier()
    return time.perf_counter() - start


def write_result(path: Path, **result) -> None:
    """Write the result as JSON (the benchmark reads it)."""
    Path(path).write_text(json.dumps(result, indent=2))
