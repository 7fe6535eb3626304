"""What a worker does under each distribution model, one module each, all behind
:class:`~ddlscope.strategies.base.Strategy`. Which class serves which model is the registry's
(:mod:`ddlscope.distribution`)."""

from __future__ import annotations

from ddlscope.strategies.base import StepOutcome, Strategy, WorkerContext


def strategy_class(name: str) -> type[Strategy]:
    """The :class:`Strategy` subclass for a distribution model name (imported lazily).

    Raises:
        UserError: unknown name (config validation catches this earlier for users).
    """
    from ddlscope import distribution

    return distribution.get(name).strategy_class()


__all__ = ["StepOutcome", "Strategy", "WorkerContext", "strategy_class"]
