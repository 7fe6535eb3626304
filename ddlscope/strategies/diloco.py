"""``diloco``: H local steps, then one all-reduce of the pseudo-gradient and an outer step (DiLoCo).

Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language Models"
(arXiv 2311.08105), algorithm 1; OpenDiLoCo (Jaghouar et al. 2024) over torch.distributed. Every
worker keeps the outer parameters ``θ_start`` of the current round and trains its own replica on
its own batches with the run's optimizer (the *inner* optimizer) for ``H = diloco.inner_steps``
optimizer steps without communicating. The step that completes the ``H``-th inner step runs the
*outer round*:

1. the pseudo-gradient ``Δ = θ_start - θ_local`` is written into one flat exchange buffer (one per
   dtype) together with the floating-point buffers (BatchNorm statistics: averaged at the outer
   step too; integer counters such as ``num_batches_tracked`` are equal on every worker and stay);
2. one ``all_reduce`` (sum, gloo on CPU / nccl on GPU) of that buffer, divided by the workers:
   the mean pseudo-gradient and the mean buffers;
3. an outer ``torch.optim.SGD`` step on ``θ_start`` with the mean ``Δ`` as its gradient
   (``diloco.outer_learning_rate``, ``outer_momentum``, ``nesterov``; paper: 0.7, 0.9, Nesterov);
4. the new ``θ_start`` and the mean buffers are copied into the model: the next round starts there.

With ``H = 1``, plain SGD as the inner optimizer, outer learning rate 1 and no outer momentum this
is exactly ddp with plain SGD: ``θ - mean_i(θ - (θ - lr g_i)) = θ - lr mean_i g_i``.

Measured (through :class:`~ddlscope.strategies.base.StepOutcome`, stored with the step that ends
the round): ``averaging_s`` (the whole outer round: pseudo-gradient, all-reduce, outer step,
restore), ``averaging_round``, ``group_size`` (the workers), ``succeeded``, and the all-reduce's
``comm_s`` and ``comm_bytes``. Inner steps are ordinary steps (forward, backward, optimizer) with
no communication. :meth:`DiLoCoStrategy.details` reports the rounds and the bytes saved vs ddp.

Like ddp, the workers start from rank 0's parameters and buffers (one broadcast at setup, not
counted, as DDP's initial broadcast is not).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ddlscope.strategies.base import StepOutcome
from ddlscope.strategies.torch_dist import TorchDistributedStrategy


class _Exchange:
    """One flat tensor holding, for the tensors of one dtype, the pseudo-gradients then the buffers.

    Attributes:
        flat: the 1-D buffer that is all-reduced in place.
        deltas: views of ``flat`` shaped like the parameters (the outer parameters' ``.grad``).
        buffers: views of ``flat`` shaped like the model's floating-point buffers ``sources``.
    """

    def __init__(self, params: list[torch.Tensor], buffers: list[torch.Tensor]):
        tensors = [*params, *buffers]
        self.flat = torch.zeros(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=tensors[0].device)
        views, offset = [], 0
        for t in tensors:
            views.append(self.flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
        self.deltas, self.buffers, self.sources = views[:len(params)], views[len(params):], buffers

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


class DiLoCoStrategy(TorchDistributedStrategy):
    """Local inner steps; every ``diloco.inner_steps`` optimizer steps an outer round (see module docstring).

    Attributes:
        inner_steps: ``H``.
        inner_steps_done: optimizer steps taken by the inner optimizer so far.
        outer_rounds: outer rounds completed.
        sent_bytes: bytes this worker handed to the outer all-reduces.
    """

    name = "diloco"

    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.nn.Module:
        self.init_process_group()
        self.world = dist.get_world_size()
        self.optimizer = optimizer
        opts = self.cfg.diloco
        self.inner_steps = opts.inner_steps
        self.inner_steps_done = self.outer_rounds = self.sent_bytes = 0
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buffers = [b for b in model.buffers() if b.is_floating_point()]
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t, src=0)
        self.gradient_bytes = sum(p.numel() * p.element_size() for p in self.params)
        # θ_start; its .grad are views into the exchange buffers (one per dtype)
        self.start = [p.detach().clone() for p in self.params]
        self.exchanges: list[_Exchange] = []
        for dtype in dict.fromkeys(t.dtype for t in [*self.params, *self.buffers]):
            idx = [i for i, p in enumerate(self.params) if p.dtype == dtype]
            ex = _Exchange([self.params[i] for i in idx], [b for b in self.buffers if b.dtype == dtype])
            for i, view in zip(idx, ex.deltas):
                self.start[i].grad = view
            self.exchanges.append(ex)
        self.outer_optimizer = torch.optim.SGD(self.start, lr=opts.outer_learning_rate, momentum=opts.outer_momentum,
                                               nesterov=opts.nesterov)
        return model

    def step(self, samples: int) -> StepOutcome:
        """One inner optimizer step; the outer round when it is the ``H``-th since the last."""
        self.optimizer.step()
        self.inner_steps_done += 1
        if self.inner_steps_done % self.inner_steps:
            return StepOutcome()
        return self._outer_round()

    @torch.no_grad()
    def _outer_round(self) -> StepOutcome:
        start_s = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)  # the inner gradients are spent: free them before the outer step
        for ex in self.exchanges:
            for view, b in zip(ex.buffers, ex.sources):
                view.copy_(b)
        for s, p in zip(self.start, self.params):
            torch.sub(s, p, out=s.grad)
        if self.world > 1:
            for ex in self.exchanges:
                done = self.timer.launch(ex.nbytes)
                dist.all_reduce(ex.flat, async_op=True).wait()
                self._sync()
                done()
                ex.flat.div_(self.world)
        self.outer_optimizer.step()
        for s, p in zip(self.start, self.params):
            p.copy_(s)
        for ex in self.exchanges:
            for view, b in zip(ex.buffers, ex.sources):
                b.copy_(view)
        self._sync()
        stats = self.timer.take()
        self.outer_rounds += 1
        self.sent_bytes += stats.comm_bytes
        return StepOutcome(averaging_s=time.perf_counter() - start_s, averaging_round=True, group_size=self.world,
                           succeeded=True, comm_s=stats.comm_s, comm_bytes=stats.comm_bytes)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def evaluate(self, model, loader, device, max_samples=None):
        """Evaluate the outer parameters ``θ_start`` (the model the workers agree on); mid-round the
        worker's own parameters are set aside for it and put back after. BatchNorm statistics are
        the worker's own mid-round (averaged at each outer step)."""
        if self.inner_steps_done % self.inner_steps == 0:
            return super().evaluate(model, loader, device, max_samples)
        local = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, s in zip(self.params, self.start):
                p.copy_(s)
        try:
            return super().evaluate(model, loader, device, max_samples)
        finally:
            with torch.no_grad():
                for p, saved in zip(self.params, local):
                    p.copy_(saved)

    def details(self) -> dict:
        """``inner_steps`` (H), ``inner_steps_done``, ``outer_rounds``, ``comm_bytes`` (sent to the outer
        all-reduces), ``ddp_comm_bytes`` (what ddp's gradient all-reduce would have sent over the same
        optimizer steps: the gradient bytes per step) and ``comm_saved_ratio`` (ddp / diloco, None
        before the first round)."""
        ddp_bytes = self.gradient_bytes * self.inner_steps_done if self.world > 1 else 0
        return dict(inner_steps=self.inner_steps, inner_steps_done=self.inner_steps_done,
                    outer_rounds=self.outer_rounds, comm_bytes=self.sent_bytes, ddp_comm_bytes=ddp_bytes,
                    comm_saved_ratio=ddp_bytes / self.sent_bytes if self.sent_bytes else None,
                    buffers_averaged=len(self.buffers))
