"""``single``: the one-worker baseline — a plain local optimizer step."""

from __future__ import annotations

from ddlscope.strategies.base import StepOutcome, Strategy


class SingleStrategy(Strategy):
    """Train on one device; the optimizer steps on the local gradients. No communication."""

    name = "single"

    def step(self, samples: int) -> StepOutcome:
        self.optimizer.step()
        return StepOutcome()
