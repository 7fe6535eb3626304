"""``fsdp``: sharded data parallelism — FSDP2 (``torch.distributed.fsdp.fully_shard``).

Each worker stores 1/N of every parameter, gradient and optimizer state (ZeRO-3). Each
top-level child of the network (stem, every residual block, the classifier ...) is one FSDP
unit: its parameters are all-gathered before its forward (and again before its backward when
``distributed.reshard_after_forward``), and its gradients are reduce-scattered after its
backward, so that each worker keeps the averaged gradient of its own shard. FSDP prefetches the
next unit's all-gather to overlap it with compute. Like ``ddp``, N workers with batch b equal
one worker with batch N x b.

The all-gathers and reduce-scatters go through timed replacements of FSDP's default
communication objects (``set_custom_all_gather`` / ``set_custom_reduce_scatter``), recording
``comm_s`` and ``comm_bytes``; the exposed tail after the last reduce-scatter is ``comm_wait_s``.
All-gather waits in the forward pass stay inside ``forward_s``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from ddlscope.strategies.torch_dist import CollectiveStrategy


class _PlainAlloc:
    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class _TimedAllGather(_PlainAlloc, AllGather):
    def __init__(self, strategy: "FSDPStrategy"):
        self.strategy = strategy

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        done = self.strategy.timer.launch(input_tensor.numel() * input_tensor.element_size())
        work = dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
        return self.strategy.when_done(work, done)


class _TimedReduceScatter(_PlainAlloc, ReduceScatter):
    def __init__(self, strategy: "FSDPStrategy"):
        self.strategy = strategy

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        done = self.strategy.timer.launch(input_tensor.numel() * input_tensor.element_size())
        work = dist.reduce_scatter_single(output=output_tensor, input=input_tensor, op=op, group=group,
                                         async_op=async_op)
        return self.strategy.when_done(work, done)


class FSDPStrategy(CollectiveStrategy):
    """Fully sharded data parallelism, one FSDP unit per top-level child of the network."""

    name = "fsdp"

    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.nn.Module:
        self.init_process_group()
        mesh = init_device_mesh(self.device.type, (dist.get_world_size(),))
        reshard = self.cfg.distributed.reshard_after_forward
        for child in model.children():
            if any(p.requires_grad for p in child.parameters()):
                fully_shard(child, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_all_gather(_TimedAllGather(self))
                module.set_custom_reduce_scatter(_TimedReduceScatter(self))
        # the parameters are now sharded DTensors: the optimizer must hold those
        self.optimizer = type(optimizer)(model.parameters(), **optimizer.defaults)
        return model

    def gradient_sync(self, model, sync: bool):
        model.set_requires_gradient_sync(sync)
        return super().gradient_sync(model, sync)
