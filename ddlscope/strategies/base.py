"""The strategy interface: what a distribution model plugs into the one training loop.

The loop owns data loading, forward, backward and timing; a strategy owns what happens to the
gradients: a local optimizer step (``single``), an averaging round with other peers
(``collaborative``), an all-reduce (``ddp``), and so on. The loop never asks which strategy it
runs; it calls these methods in this order::

    model = strategy.setup(model, optimizer)          # once
    for each step:  forward, backward(loss / GAS)
                    every GAS steps: outcome = strategy.step(samples); strategy.zero_grad()
    strategy.close()                                  # always, also on errors
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from ddlscope.config import RunConfig


@dataclass
class WorkerContext:
    """Where a worker runs: its index among the run's workers, its cores, how to find its peers.

    Attributes:
        run_id: the run's id in the results store (also the swarm's name for hivemind).
        worker_index: 0 .. peers-1; worker 0 bootstraps the swarm.
        num_workers: workers expected in the run.
        cores: CPU core ids the worker is pinned to.
        initial_peers: multiaddrs of peers already in the swarm (collaborative only).
        announce: callback the strategy calls with its own multiaddrs once it listens.
        listen_maddrs: multiaddrs to listen on (collaborative); default loopback, any free port.
    """

    run_id: str
    worker_index: int
    num_workers: int
    cores: list[int]
    initial_peers: list[str]
    announce: "Callable[[list[str]], None] | None" = None
    listen_maddrs: list[str] | None = None


@dataclass
class StepOutcome:
    """What one optimizer step did besides updating the parameters.

    Attributes:
        averaging_s: seconds of this step spent averaging with other workers (0 if none).
        averaging_round: an averaging round (global epoch / all-reduce) took place in this step.
        group_size: workers that the round gathered (1 = averaged alone), None if no round.
        succeeded: whether the round succeeded, None if no round.
        global_epoch: the swarm's epoch after the step (collaborative), else None.
    """

    averaging_s: float = 0.0
    averaging_round: bool = False
    group_size: int | None = None
    succeeded: bool | None = None
    global_epoch: int | None = None


class Strategy:
    """Base class of every distribution model. Subclasses set :attr:`name`.

    Args:
        cfg: the validated run config.
        ctx: where this worker runs.
    """

    name = "base"
    uses_network = False  # the host sampler counts TCP bytes when True

    def __init__(self, cfg: "RunConfig", ctx: WorkerContext):
        self.cfg = cfg
        self.ctx = ctx
        self.optimizer: torch.optim.Optimizer | None = None

    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.nn.Module:
        """Wrap the model and optimizer; return the module the loop trains."""
        self.optimizer = optimizer
        return model

    def step(self, samples: int) -> StepOutcome:
        """Apply the gradients accumulated over ``samples`` samples (``batch_size x GAS``)."""
        raise NotImplementedError

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def should_stop(self) -> bool:
        """True when the strategy cannot go on (e.g. the swarm is gone); the loop then ends."""
        return False

    def close(self) -> None:
        """Release processes, sockets and daemons. Called once, also after errors."""
