"""``gpipe`` and ``1f1b``: pipeline parallelism with ``torch.distributed.pipelining``.

The network (an ``nn.Sequential``, as every zoo network is) is cut between its top-level
children into one stage per worker, balanced by the measured forward + backward time of each
child (:mod:`ddlscope.strategies.partition`), by layer count with
``distributed.balance = "layers"``, or exactly where ``distributed.stage_bounds`` says (the cut
``ddlscope recommend`` predicted, say). Each batch is split into ``distributed.microbatches``
micro-batches that flow through the stages:

- ``gpipe`` (ScheduleGPipe): all forwards, then all backwards (fill-drain); activations of
  every micro-batch stay in memory until their backward (Huang et al. 2019).
- ``1f1b`` (Schedule1F1B): after a warm-up, each stage alternates one forward and one backward,
  so at most ``stages`` micro-batches are in flight (PipeDream-flush, Narayanan et al. 2021).

Both update the weights once per batch with the gradient of the whole batch, so they match
``single`` on the same batch (up to floating-point order). The loss of each micro-batch is
divided by the number of micro-batches before backward (gradients of a mean loss).

Per step and stage the strategy records: ``forward_s`` / ``backward_s``, the compute inside the
stage's micro-batch forwards (with the loss on the last stage) and backwards; the time blocked
in send/recv, split into ``comm_wait_s`` — the transfer time of the stage's payload at the
link latency and bandwidth measured between neighbouring stages at start-up — and
``bubble_s``, the rest: idle time waiting for the neighbouring stage. Every stage loads the
batch (the first needs the inputs, the last the labels); only the last sees the logits.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from functools import wraps

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining import schedules as _schedules
from torch.utils.data import DataLoader

from ddlscope.errors import UserError
from ddlscope.strategies.base import BatchResult
from ddlscope.strategies.partition import balanced_partition, equal_layer_partition, measure_layer_costs_s
from ddlscope.strategies.torch_dist import TorchDistributedStrategy
from ddlscope.workloads.step import loss_function

LINK_PROBE_BYTES = 4 * 2**20


class _P2PMeter:
    """Counts the bytes a stage hands to send/recv and the time it is blocked waiting on them.

    Installs itself around ``torch.distributed.pipelining.schedules._batch_p2p`` and
    ``_wait_batch_p2p``, the two functions every single-stage schedule uses for its transfers.
    """

    def __init__(self) -> None:
        self.bytes = self.calls = 0
        self.blocked_s = 0.0
        self._originals = (_schedules._batch_p2p, _schedules._wait_batch_p2p)

    def install(self) -> None:
        batch_p2p, wait_batch_p2p = self._originals

        @wraps(batch_p2p)
        def counting(p2p_ops, desc=None):
            for op in p2p_ops:
                self.bytes += op.tensor.numel() * op.tensor.element_size()
            self.calls += len(p2p_ops)
            return batch_p2p(p2p_ops, desc=desc)

        @wraps(wait_batch_p2p)
        def waiting(work):
            t0 = time.perf_counter()
            try:
                return wait_batch_p2p(work)
            finally:
                self.blocked_s += time.perf_counter() - t0

        _schedules._batch_p2p, _schedules._wait_batch_p2p = counting, waiting

    def uninstall(self) -> None:
        _schedules._batch_p2p, _schedules._wait_batch_p2p = self._originals

    def reset(self) -> None:
        self.bytes = self.calls = 0
        self.blocked_s = 0.0


def _one_way_s(peer: int, tensor: torch.Tensor, leader: bool, repeats: int = 3) -> float:
    """Half the fastest round trip of ``tensor`` between this worker and ``peer`` (seconds)."""
    best = float("inf")
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        if leader:
            dist.send(tensor, peer)
            dist.recv(tensor, peer)
        else:
            dist.recv(tensor, peer)
            dist.send(tensor, peer)
        if r:  # the first round trip warms the connection up
            best = min(best, (time.perf_counter() - t0) / 2)
    return best


def check_split(cfg, model: torch.nn.Module, stages: int) -> None:
    """The network can be cut into ``stages`` stages: an ``nn.Sequential`` with at least ``stages``
    top-level layers, and ``distributed.stage_bounds`` (when given) cuts exactly those layers into
    ``stages`` stages.

    Raises:
        UserError: naming what does not fit and what is allowed.
    """
    if not isinstance(model, torch.nn.Sequential):
        raise UserError(f"{cfg.strategy} splits a network between the children of an nn.Sequential, but "
                        f"{cfg.model!r} is a {type(model).__name__}; allowed: zoo networks or a factory "
                        f"returning nn.Sequential")
    n_layers = len(model)
    if stages > n_layers:
        raise UserError(f"peers = {stages} pipeline stages, but {cfg.model!r} has only {n_layers} "
                        f"top-level layers to split between; allowed: peers <= {n_layers}")
    cut = cfg.distributed.stage_bounds
    if cut is not None and (len(cut) != stages + 1 or cut[-1] != n_layers):
        raise UserError(f"distributed.stage_bounds {cut} does not cut {cfg.model!r} ({n_layers} top-level layers) "
                        f"into peers = {stages} stages; allowed: {stages + 1} strictly "
                        f"increasing indices from 0 to {n_layers}")


class PipelineStrategy(TorchDistributedStrategy):
    """One pipeline stage per worker; subclasses choose the schedule."""

    schedule_class: type = ScheduleGPipe

    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        self.meter = _P2PMeter()
        self.stage = self.schedule = self.stage_module = None
        self.full_model = None
        self.bounds: list[int] = []
        self.layer_costs_s: list[float] = []
        self.link_latency_s = 0.0
        self.link_bandwidth_bytes_per_s = float("inf")
        self._forward_s = self._backward_s = 0.0
        self._loss_fn, self._loss_scale = None, 1.0

    # ------------------------------------------------------------------ setup
    @classmethod
    def preflight(cls, cfg) -> None:
        """:func:`check_split` on the network built on the meta device (no memory, no compute)."""
        from ddlscope.workloads.datasets import DATASETS
        from ddlscope.workloads.models import build_model

        family = DATASETS[cfg.dataset].family if cfg.dataset in DATASETS else "imagenet"
        with torch.device("meta"):
            model = build_model(cfg.model, family)
        check_split(cfg, model, cfg.peers)

    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.nn.Module:
        """Join the process group and check the split; the stages are built at the first batch
        (the partition is measured on a real micro-batch)."""
        check_split(self.cfg, model, self.ctx.num_workers)
        self.init_process_group()
        self.rank, self.stages = dist.get_rank(), dist.get_world_size()
        self.full_model, self.optimizer = model, optimizer
        self._measure_links()
        return model

    def _measure_links(self) -> None:
        """Latency (1-element message) and bandwidth (4 MiB message) between neighbouring stages."""
        small = torch.zeros(1, device=self.device)
        large = torch.zeros(LINK_PROBE_BYTES // 4, device=self.device)
        mine = []
        for left in range(self.stages - 1):
            if self.rank in (left, left + 1):
                peer = left + 1 if self.rank == left else left
                latency = _one_way_s(peer, small, self.rank == left)
                transfer = _one_way_s(peer, large, self.rank == left)
                mine.append((latency, LINK_PROBE_BYTES / max(transfer - latency, 1e-9)))
        self.link_latency_s = sum(m[0] for m in mine) / len(mine)
        self.link_bandwidth_bytes_per_s = sum(m[1] for m in mine) / len(mine)

    def _build_stage(self, x: torch.Tensor) -> None:
        named = list(self.full_model.named_children())
        layers = [m for _, m in named]
        micro = x[: max(1, len(x) // self.cfg.distributed.microbatches)]
        bounds = [None]
        if self.cfg.distributed.stage_bounds is not None:
            bounds = [(list(self.cfg.distributed.stage_bounds), [])]
        elif self.rank == 0:
            if self.cfg.distributed.balance == "measured":
                self.layer_costs_s = measure_layer_costs_s(layers, micro)
                bounds = [(balanced_partition(self.layer_costs_s, self.stages), self.layer_costs_s)]
            else:
                bounds = [(equal_layer_partition(len(layers), self.stages), [])]
        dist.broadcast_object_list(bounds, src=0)  # every stage must cut at the same places
        self.bounds, self.layer_costs_s = bounds[0]
        lo, hi = self.bounds[self.rank], self.bounds[self.rank + 1]
        # keep the full model's child names, so a stage's state_dict keys are the full model's keys
        self.stage_module = torch.nn.Sequential(OrderedDict(named[lo:hi])).to(self.device)
        # the other stages' layers are not ours to keep: the training loop still holds the full
        # model and its optimizer, so free their tensors in place rather than only dropping our reference
        for i, (_, layer) in enumerate(named):
            if not lo <= i < hi:
                layer.to_empty(device="meta")
        self.optimizer.param_groups.clear()
        self.optimizer.state.clear()
        self.full_model = None
        self.stage = PipelineStage(self.stage_module, self.rank, self.stages, self.device)
        self._time_compute()
        self.schedule = self.schedule_class(self.stage, n_microbatches=self.cfg.distributed.microbatches,
                                            loss_fn=self._stage_loss, scale_grads=False)
        self.optimizer = type(self.optimizer)(self.stage_module.parameters(), **self.optimizer.defaults)
        self.meter.install()

    def _time_compute(self) -> None:
        """Wrap the stage's micro-batch forward and backward to add up their compute time."""
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        stage = self.stage

        def timed(fn, attr):
            @wraps(fn)
            def run(*args, **kwargs):
                sync()
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    sync()
                    setattr(self, attr, getattr(self, attr) + time.perf_counter() - t0)
            return run

        stage.forward_one_chunk = timed(stage.forward_one_chunk, "_forward_s")
        stage.backward_one_chunk = timed(stage.backward_one_chunk, "_backward_s")

    def _stage_loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Loss of one micro-batch on the last stage, pre-divided so that the micro-batches sum to the batch mean."""
        t0 = time.perf_counter()
        loss = self._loss_fn(logits, y) * (self._loss_scale / self.cfg.distributed.microbatches)
        self._forward_s += time.perf_counter() - t0
        return loss

    # ------------------------------------------------------------------ training
    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.stages - 1

    def _run_schedule(self, run, x: torch.Tensor, y: torch.Tensor, losses: list | None):
        if self.is_first:
            return run(x)
        if self.is_last:
            return run(target=y, losses=losses)
        return run()

    def forward_backward(self, model, x, y, loss_fn, loss_scale: float = 1.0, sync: bool = True) -> BatchResult:
        if self.schedule is None:
            self._build_stage(x)
        self._loss_fn, self._loss_scale = loss_fn, loss_scale
        self._forward_s = self._backward_s = 0.0
        self.meter.reset()
        losses: list = []
        logits = self._run_schedule(self.schedule.step, x, y, losses)
        transfer_s = min(self.meter.blocked_s,
                         self.meter.calls * self.link_latency_s + self.meter.bytes / self.link_bandwidth_bytes_per_s)
        loss = correct = None
        if self.is_last:
            loss = sum(float(v.detach()) for v in losses) / loss_scale
            correct = int((logits.argmax(1) == y).sum().item())
        return BatchResult(len(y), loss, correct, self._forward_s, self._backward_s, comm_s=transfer_s,
                           comm_wait_s=transfer_s, bubble_s=self.meter.blocked_s - transfer_s,
                           comm_bytes=self.meter.bytes)

    def zero_grad(self) -> None:
        if self.schedule is not None:
            self.optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def evaluate(self, model, loader, device, max_samples=None) -> tuple[float, float, int]:
        """Forward-only pass of the held-out split through the pipeline, in training-size batches.

        The stages' receive buffers have the training micro-batch shape, so evaluation uses
        batches of ``batch_size`` and leaves out the last partial batch. The last stage computes
        the accuracy and loss and broadcasts them to every stage.
        """
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)  # correct, loss sum, samples
        mean_loss, summed_loss = loss_function(), loss_function("sum")
        if self.schedule is not None:
            self.stage_module.eval()
            batches = DataLoader(loader.dataset, batch_size=self.cfg.batch_size, shuffle=False, drop_last=True)
            for x, y in batches:
                x, y = x.to(self.device), y.to(self.device)
                self._loss_fn, self._loss_scale = mean_loss, 1.0
                logits = self._run_schedule(self.schedule.eval, x, y, [])
                if self.is_last:
                    totals[0] += (logits.argmax(1) == y).sum()
                    totals[1] += summed_loss(logits, y)
                totals[2] += len(y)
                if max_samples is not None and totals[2] >= max_samples:
                    break
            self.stage_module.train()
        dist.broadcast(totals, src=self.stages - 1)
        seen = max(int(totals[2].item()), 1)
        return totals[0].item() / seen, totals[1].item() / seen, int(totals[2].item())

    def details(self) -> dict:
        return dict(stage_bounds=self.bounds, layer_costs_s=self.layer_costs_s, balance=self.cfg.distributed.balance,
                    microbatches=self.cfg.distributed.microbatches, link_latency_s=self.link_latency_s,
                    link_bandwidth_bytes_per_s=self.link_bandwidth_bytes_per_s)

    def close(self) -> None:
        self.meter.uninstall()
        super().close()


class GPipeStrategy(PipelineStrategy):
    """GPipe's fill-drain schedule: all micro-batch forwards, then all backwards."""

    name = "gpipe"
    schedule_class = ScheduleGPipe


class OneFOneBStrategy(PipelineStrategy):
    """1F1B (PipeDream-flush): one forward, one backward per stage in the steady state."""

    name = "1f1b"
    schedule_class = Schedule1F1B
