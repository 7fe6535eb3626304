"""Mixture-of-experts layers that run in the trainer's own process.

:class:`LocalMixtureOfExperts` computes what hivemind 1.1.12's ``RemoteMixtureOfExperts``
(``hivemind/moe/client/moe.py``) computes when every expert of the grid is alive and answers:
the same gate (``proj``), the same expert choice and the same softmax-weighted average, with the
experts held in-process instead of on servers. :class:`DenseExpert` is the dense baseline: one
expert applied to every sample.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from ddlscope.distribution.dmoe import UID_PREFIX


def grid_uids(grid_size: Sequence[int], uid_prefix: str = UID_PREFIX) -> list[str]:
    """Every expert id of a grid in grid order (row-major: the last index varies fastest),
    ``uid_prefix + "i0.i1..."``, as :meth:`~ddlscope.distribution.dmoe.DMoEConfig.expert_uids`."""
    uids = [""]
    for size in grid_size:
        uids = [f"{u}.{i}" if u else str(i) for u in uids for i in range(size)]
    return [uid_prefix + u for u in uids]


def module_key(uid: str) -> str:
    """The ``nn.ModuleDict`` key of an expert id (``nn.Module`` names cannot contain '.')."""
    return uid.replace(".", "_")


class LocalMixtureOfExperts(nn.Module):
    """hivemind's mixture-of-experts gating over experts held in this process.

    For an input ``x`` ``[batch, ..., in_features]`` (extra arguments ``args`` / ``kwargs``
    batch-first, e.g. the transformer's ``[batch, T]`` padding mask):

    1. gate input ``g`` = ``x`` averaged over every dimension but the first and the last;
    2. grid scores ``proj(g)`` ``[batch, sum(grid_size)]``, split into one ``[batch, n_d]`` block
       per grid dimension ``d``; expert ``(i_0, i_1, ...)`` scores ``sum_d s_d[b, i_d]``
       (``RemoteMixtureOfExperts.compute_expert_scores``);
    3. each sample takes the ``k_best`` highest-scoring experts of the whole grid. hivemind finds
       them with a beam search over the DHT (``MoEBeamSearcher``, one dimension at a time, beam
       ``k_best``), which returns the exact top ``k_best`` when every expert is alive, since the
       scores add over dimensions; here all experts are present, so the top-k is taken directly;
    4. output = ``sum_j softmax(chosen scores)_j * expert_j(x, *args, **kwargs)``.

    Each expert runs once per forward on the samples routed to it (gathered, then scattered back).
    Gradients reach ``proj`` through the softmax weights and only the chosen experts.

    Args:
        in_features: width of the gate's input (the last dimension of ``x``).
        grid_size: expert-id grid; ``experts`` must hold exactly its ids.
        experts: expert id (``uid_prefix + "i0.i1..."``) -> module, as a mapping or as a function
            called once per id in grid order after ``proj`` is made (so the gate draws its
            parameters first, as hivemind's does). Each maps ``x`` ``[n, ...]`` (and the sliced
            extra arguments) to an output ``[n, ...]``, the same for all experts.
        k_best: experts per sample, ``1 .. number of experts``.
        uid_prefix: common prefix of the ids (hivemind's ``uid_prefix``).

    Attributes:
        proj: ``nn.Linear(in_features, sum(grid_size))``, named and shaped as hivemind's, so the
            gate's parameters can be handed to a ``RemoteMixtureOfExperts``.
        uids: the expert ids in grid order; ``experts``: ``nn.ModuleDict`` keyed by
            :func:`module_key` of each id.
        last_load: samples each expert got in the last forward (``{uid: count}``, every uid).
        last_choice: the last forward's chosen experts, int64 ``[batch, k_best]`` indices into
            ``uids`` (detached).

    Raises:
        ValueError: ``experts`` not exactly the grid's ids, or ``k_best`` out of range.
    """

    def __init__(self, in_features: int, grid_size: Sequence[int],
                 experts: Mapping[str, nn.Module] | Callable[[str], nn.Module], k_best: int, uid_prefix: str = UID_PREFIX):
        super().__init__()
        self.grid_size = tuple(int(n) for n in grid_size)
        self.uids = grid_uids(self.grid_size, uid_prefix)
        if isinstance(experts, Mapping) and set(experts) != set(self.uids):
            missing, extra = sorted(set(self.uids) - set(experts)), sorted(set(experts) - set(self.uids))
            raise ValueError(f"experts must be exactly the ids of grid {list(self.grid_size)}; "
                             f"missing {missing[:4]}, unexpected {extra[:4]}")
        if not 1 <= k_best <= len(self.uids):
            raise ValueError(f"k_best = {k_best}; allowed: 1..{len(self.uids)}")
        self.k_best = k_best
        self.proj = nn.Linear(in_features, sum(self.grid_size))
        make = experts.__getitem__ if isinstance(experts, Mapping) else experts
        self.experts = nn.ModuleDict({module_key(uid): make(uid) for uid in self.uids})
        self.last_load: dict[str, int] = {uid: 0 for uid in self.uids}
        self.last_choice: torch.Tensor | None = None

    def expert_scores(self, grid_scores: Sequence[torch.Tensor]) -> torch.Tensor:
        """Scores of every expert, ``[batch, experts]`` in grid order: ``sum_d s_d[b, i_d]`` over
        the per-dimension scores ``grid_scores[d]`` ``[batch, grid_size[d]]``."""
        batch, dims = grid_scores[0].shape[0], len(grid_scores)
        total = grid_scores[0].new_zeros((batch,) + (1,) * dims)
        for d, scores in enumerate(grid_scores):
            total = total + scores.view((batch,) + tuple(-1 if e == d else 1 for e in range(dims)))
        return total.reshape(batch, -1)

    def forward(self, input: torch.Tensor, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        """Gate, choose ``k_best`` experts per sample, average their outputs (see the class).

        Args:
            input: ``[batch, ..., in_features]``; args / kwargs: further batch-first tensors
                every expert receives after ``input``.

        Returns:
            ``[batch, *expert output shape]`` (the experts' output dtype).
        """
        gate_input = input if input.dim() == 2 else input.mean(dim=tuple(range(1, input.dim() - 1)))
        grid_scores = self.proj(gate_input).split_with_sizes(self.grid_size, dim=-1)
        top_scores, top_index = self.expert_scores(grid_scores).topk(self.k_best, dim=1)
        weights = torch.softmax(top_scores, dim=1)  # [batch, k_best]
        rows_all, parts = [], []
        for e, rows, slots in self._routes(top_index):
            out = self.experts[module_key(self.uids[e])](
                input[rows], *(a[rows] for a in args), **{k: v[rows] for k, v in kwargs.items()})
            parts.append(weights[rows, slots].view((-1,) + (1,) * (out.dim() - 1)).to(out.dtype) * out)
            rows_all.append(rows)
        contributions = torch.cat(parts)
        output = contributions.new_zeros((input.shape[0],) + contributions.shape[1:])
        return output.index_add(0, torch.cat(rows_all), contributions)

    def _routes(self, top_index: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """``(expert index, rows, slots)`` for every expert that gets samples: the samples (rows of
        the batch) routed to it and the position (``0 .. k_best - 1``) it has among their chosen.

        A fake or meta input (the profiler's shape-and-memory pass, whose tensors have no values)
        cannot be routed by its scores; it is routed evenly instead (slot ``j`` of sample ``i`` to
        expert ``(i * k_best + j) mod E``), which costs what a balanced routing costs. Real inputs
        record :attr:`last_load` and :attr:`last_choice`.
        """
        from torch._subclasses.fake_tensor import FakeTensor

        batch, k, n = top_index.shape[0], self.k_best, len(self.uids)
        if isinstance(top_index, FakeTensor) or top_index.device.type == "meta":
            pairs = [(i, j) for i in range(batch) for j in range(k)]
            routed = {e: [p for p in pairs if (p[0] * k + p[1]) % n == e] for e in range(n)}
            return [(e, torch.tensor([p[0] for p in ps]), torch.tensor([p[1] for p in ps]))
                    for e, ps in routed.items() if ps]
        self.last_choice = top_index.detach()
        load = torch.bincount(top_index.flatten(), minlength=n).tolist()
        self.last_load = dict(zip(self.uids, load))
        return [(e, *(top_index == e).nonzero(as_tuple=True)) for e, m in enumerate(load) if m]

    def chosen_uids(self) -> list[list[str]]:
        """The last forward's chosen expert ids per sample, best first."""
        if self.last_choice is None:
            return []
        return [[self.uids[i] for i in row] for row in self.last_choice.tolist()]

    def extra_repr(self) -> str:
        return f"grid_size={list(self.grid_size)}, k_best={self.k_best}"


class DenseExpert(nn.Module):
    """One expert applied to every sample, no gate: the dense equivalent of a mixture layer.

    ``forward(input, *args, **kwargs)`` is ``expert(input, *args, **kwargs)``.

    Attributes:
        expert: the block; ``last_load``: ``{"dense": batch}`` of the last forward.
    """

    def __init__(self, expert: nn.Module):
        super().__init__()
        self.expert = expert
        self.last_load: dict[str, int] = {}

    def forward(self, input: torch.Tensor, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        self.last_load = {"dense": int(input.shape[0])}
        return self.expert(input, *args, **kwargs)
