"""Splitting a sequential network into pipeline stages balanced by measured per-layer cost.

A pipeline runs as fast as its slowest stage, so stages are chosen to minimise the largest
stage cost (the classic linear-partition problem, solved exactly by dynamic programming in
O(S x L^2) for S stages and L layers). GPipe's own partitioner balanced by profiled layer
times too (thesis 002 ch. 3.4.2); balancing by layer count is kept as the naive reference.
"""

from __future__ import annotations

import time

import torch

from ddlscope.errors import UserError


def balanced_partition(costs: list[float], stages: int) -> list[int]:
    """Contiguous split of layers into ``stages`` non-empty stages minimising the largest stage cost.

    Args:
        costs: cost of each layer, in order (seconds, or any non-negative unit), length L.
        stages: number of stages S, 1 <= S <= L.

    Returns:
        boundaries ``[0, b1, ..., L]`` of length S + 1: stage s holds layers ``b[s]:b[s+1]``.

    Raises:
        UserError: more stages than layers (each stage needs at least one layer).
    """
    n = len(costs)
    if not 1 <= stages <= n:
        raise UserError(f"cannot split a network with {n} top-level layers into {stages} pipeline stages; "
                        f"allowed: 1 <= stages (workers) <= {n}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[s][i]: minimal largest-stage cost of splitting the first i layers into s stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                cand = max(best[s - 1][j], prefix[i] - prefix[j])
                if cand < best[s][i]:
                    best[s][i], cut[s][i] = cand, j
    bounds = [n]
    for s in range(stages, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    return bounds[::-1]


def equal_layer_partition(n_layers: int, stages: int) -> list[int]:
    """Boundaries that give every stage the same number of layers (±1), ignoring their cost."""
    if not 1 <= stages <= n_layers:
        raise UserError(f"cannot split a network with {n_layers} top-level layers into {stages} pipeline stages; "
                        f"allowed: 1 <= stages (workers) <= {n_layers}")
    return [round(i * n_layers / stages) for i in range(stages + 1)]


def measure_layer_costs_s(layers: list[torch.nn.Module], sample: torch.Tensor, repeats: int = 2) -> list[float]:
    """Forward + backward seconds of each layer on ``sample`` (a micro-batch, ``[mb, C, H, W]``).

    Each layer is timed on the activation the previous layers produce; the minimum of
    ``repeats`` runs (after one warm-up run) is kept. Runs on the sample's device and
    synchronises CUDA before reading the clock. Buffers (BatchNorm running statistics) are
    restored afterwards, so measuring does not change the model.
    """
    sync = torch.cuda.synchronize if sample.device.type == "cuda" else (lambda: None)
    costs = []
    x = sample
    for layer in layers:
        saved = [b.detach().clone() for b in layer.buffers()]
        times = []
        for r in range(repeats + 1):
            inp = x.detach().requires_grad_(x.is_floating_point())
            sync()
            t0 = time.perf_counter()
            out = layer(inp)
            out.backward(torch.ones_like(out))
            sync()
            if r:
                times.append(time.perf_counter() - t0)
        layer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for b, s in zip(layer.buffers(), saved):
                b.copy_(s)
        costs.append(min(times))
        x = out.detach()
    return costs
