"""Distribution models, one module each, all behind :class:`~ddlscope.strategies.base.Strategy`."""

from __future__ import annotations

from ddlscope.strategies.base import StepOutcome, Strategy, WorkerContext


def strategy_class(name: str) -> type[Strategy]:
    """The :class:`Strategy` subclass for a distribution model name (imported lazily).

    Raises:
        ValueError: unknown name (config validation catches this earlier for users).
    """
    if name == "single":
        from ddlscope.strategies.single import SingleStrategy

        return SingleStrategy
    if name == "collaborative":
        from ddlscope.strategies.collaborative import CollaborativeStrategy

        return CollaborativeStrategy
    raise ValueError(f"unknown distribution model {name!r}; allowed: single, collaborative")


__all__ = ["StepOutcome", "Strategy", "WorkerContext", "strategy_class"]
