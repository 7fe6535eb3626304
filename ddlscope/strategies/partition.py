"""Splitting a sequential network into pipeline stages balanced by measured per-layer cost.

A pipeline runs as fast as its slowest stage, so stages are chosen to minimise the largest
stage cost (the classic linear-partition problem, solved exactly by dynamic programming in
O(S x L^2) for S stages and L layers). GPipe's own partitioner balanced by profiled layer
times too (thesis 002 ch. 3.4.2); balancing by layer count is kept as the naive reference.
"""

from __future__ import annotations

import contextlib
import time

import torch

from ddlscope.distribution.pipeline import balanced_partition  # noqa: F401  (pure: the cost model cuts the same way)
from ddlscope.errors import UserError


def equal_layer_partition(n_layers: int, stages: int) -> list[int]:
    """Boundaries that give every stage the same number of layers (±1), ignoring their cost."""
    if not 1 <= stages <= n_layers:
        raise UserError(f"cannot split a network with {n_layers} top-level layers into {stages} pipeline stages; "
                        f"allowed: 1 <= stages (workers) <= {n_layers}")
    return [round(i * n_layers / stages) for i in range(stages + 1)]


@contextlib.contextmanager
def _unchanged(layers: list[torch.nn.Module]):
    """Restore the layers' buffers (BatchNorm running statistics) and drop their gradients on exit."""
    saved = [[b.detach().clone() for b in layer.buffers()] for layer in layers]
    try:
        yield
    finally:
        for layer, buffers in zip(layers, saved):
            layer.zero_grad(set_to_none=True)
            with torch.no_grad():
                for b, s in zip(layer.buffers(), buffers):
                    b.copy_(s)


WARMUP_PASSES = 3
"""Untimed forward + backward passes through all layers before layers are timed one by one."""


def warm_up_layers(layers: list[torch.nn.Module], sample: torch.Tensor, passes: int = WARMUP_PASSES) -> None:
    """Run ``passes`` untimed forward + backward passes of ``sample`` through ``layers`` in order.

    A fresh process pays first-touch costs (memory pages, kernel setup) during its first passes;
    timed layer by layer without this, they land on the layers timed first. Measured on
    MobileNetV2 (micro-batch 16, 2 stages, this machine): its first 6 of 21 layers took 55-60 %
    of the measured cost without warm-up passes and 50-52 % after three, so the cut fell at
    layer 4 or 5 instead of 6; with the cut at 4, 1F1B's second stage ran 26-34 % slower than
    with the cut at 6 (MNIST and CIFAR-10 shapes, this machine).
    Buffers (BatchNorm running statistics) are restored and gradients dropped afterwards.
    """
    with _unchanged(layers):
        for _ in range(passes):
            out = sample
            for layer in layers:
                out = layer(out)
            out.backward(torch.ones_like(out))


def measure_layer_costs_s(layers: list[torch.nn.Module], sample: torch.Tensor, repeats: int = 3) -> list[float]:
    """Forward + backward seconds of each layer on ``sample`` (a micro-batch, ``[mb, C, H, W]``), length L.

    After :func:`warm_up_layers`, ``repeats`` rounds go through the network, timing each layer
    on the activation the previous layers produce; each layer keeps its minimum over the rounds.
    Rounds rather than repeats layer by layer, so that a slow spell of the machine is spread
    over all layers instead of landing on a few and moving the cut. Runs on the sample's device
    and synchronises CUDA before reading the clock. Buffers (BatchNorm running statistics) are
    restored and gradients dropped afterwards, so measuring does not change the model.
    """
    sync = torch.cuda.synchronize if sample.device.type == "cuda" else (lambda: None)
    warm_up_layers(layers, sample)
    costs = [float("inf")] * len(layers)
    with _unchanged(layers):
        for _ in range(repeats):
            x = sample
            for i, layer in enumerate(layers):
                inp = x.detach().requires_grad_(x.is_floating_point())
                sync()
                t0 = time.perf_counter()
                out = layer(inp)
                out.backward(torch.ones_like(out))
                sync()
                costs[i] = min(costs[i], time.perf_counter() - t0)
                x = out.detach()
    return costs
