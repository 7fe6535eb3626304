"""What the torch.distributed distribution models share: the process group and collective timing.

Workers are started by torch's elastic launcher (torchrun), which sets ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``; the process group is
initialised from those (``env://``). gloo on CPU, nccl on GPU, unless
``distributed.backend`` says otherwise.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ddlscope.measure.comm import CommTimer
from ddlscope.strategies.base import BatchResult, StepOutcome, Strategy


_NEVER_FREED: list = []
"""Process groups shut down by :meth:`TorchDistributedStrategy.close`, kept so that their destructor never runs."""


def resolve_backend(backend: str, device: str) -> str:
    """``gloo`` for CPU and ``nccl`` for CUDA when ``backend`` is ``"auto"``; else ``backend``."""
    if backend != "auto":
        return backend
    return "nccl" if device == "cuda" else "gloo"


class TorchDistributedStrategy(Strategy):
    """Base of ``ddp``, ``fsdp``, ``gpipe`` and ``1f1b``: one process group over all workers.

    Attributes:
        timer: communication intervals of the current step (see :class:`CommTimer`).
    """

    uses_network = True

    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        self.timer = CommTimer()
        self.device = torch.device(f"cuda:{ctx.local_rank}") if cfg.device == "cuda" else torch.device("cpu")

    def init_process_group(self) -> None:
        """Join the process group that torchrun set up the rendezvous for (idempotent)."""
        if dist.is_initialized():
            return
        backend = resolve_backend(self.cfg.distributed.backend, self.cfg.device)
        if backend == "nccl":
            torch.cuda.set_device(self.device)
        dist.init_process_group(backend, timeout=timedelta(seconds=self.cfg.distributed.timeout_s))
        if dist.get_world_size() != self.ctx.num_workers:
            raise RuntimeError(f"the process group has {dist.get_world_size()} workers, the run expects {self.ctx.num_workers}")

    def agree_to_stop(self, stop: bool) -> bool:
        flag = torch.tensor([int(stop)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def step(self, samples: int) -> StepOutcome:
        self.optimizer.step()
        return StepOutcome()

    def close(self) -> None:
        """Shut the process group down, and keep its object alive until the process exits.

        gloo joins its worker threads when the process group object is freed. The last reference is
        often the DDP reducer (or an FSDP mesh), freed with the GIL held; a worker thread that is
        still freeing its last finished collective needs the GIL to drop that collective's tensors,
        so both wait for ever (torch 2.13: 2 of 55 runs of ``tests/dist_check.py ddp`` hung in
        ``~ProcessGroupGloo`` → ``std::thread::join``). Workers end with ``os._exit``, so the
        object is never freed and nothing is lost.
        """
        if dist.is_initialized():
            _NEVER_FREED.append(dist.group.WORLD)
            dist.destroy_process_group()


class CollectiveStrategy(TorchDistributedStrategy):
    """Data parallelism (replicated or sharded) with gradients synchronised by collectives.

    The collectives overlap the backward pass. The step records their time in flight
    (``comm_s``, union of intervals) and the *exposed* part: the time between the launch of
    the last collective (when the last gradients were computed) and the end of the backward
    pass, which the worker spent only waiting for communication (``comm_wait_s``). That part
    is taken out of ``backward_s``.
    """

    def forward_backward(self, model, x, y, loss_fn, loss_scale: float = 1.0, sync: bool = True) -> BatchResult:
        self.timer.last_launch = None
        result = super().forward_backward(model, x, y, loss_fn, loss_scale, sync).resolve()  # compared with host times
        end = time.perf_counter()
        stats = self.timer.take()
        if self.timer.last_launch is not None:
            exposed = min(max(0.0, end - self.timer.last_launch), result.backward_s, stats.comm_s)
            result.backward_s -= exposed
            result.comm_wait_s = exposed
        result.comm_s, result.comm_bytes = stats.comm_s, stats.comm_bytes
        return result

    def when_done(self, work: "dist.Work | None", done) -> "dist.Work | None":
        """Call ``done`` (from :meth:`CommTimer.launch`) when ``work`` completes; now if it is None (synchronous)."""
        if work is None:
            done()
        else:
            work.get_future().add_done_callback(done)
        return work
