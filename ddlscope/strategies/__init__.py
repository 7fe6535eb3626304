"""Distribution models, one module each, all behind :class:`~ddlscope.strategies.base.Strategy`."""

from __future__ import annotations

from ddlscope.strategies.base import StepOutcome, Strategy, WorkerContext


def strategy_class(name: str) -> type[Strategy]:
    """The :class:`Strategy` subclass for a distribution model name (imported lazily).

    Raises:
        ValueError: unknown name (config validation catches this earlier for users).
    """
    import importlib

    if name not in _CLASSES:
        raise ValueError(f"unknown distribution model {name!r}; allowed: {', '.join(_CLASSES)}")
    module, cls = _CLASSES[name]
    return getattr(importlib.import_module(f"ddlscope.strategies.{module}"), cls)


# name -> (module, class); imported on demand (hivemind and torch.distributed are heavy)
_CLASSES = {
    "single": ("single", "SingleStrategy"),
    "ddp": ("ddp", "DDPStrategy"),
    "fsdp": ("fsdp", "FSDPStrategy"),
    "gpipe": ("pipeline", "GPipeStrategy"),
    "1f1b": ("pipeline", "OneFOneBStrategy"),
    "collaborative": ("collaborative", "CollaborativeStrategy"),
}


__all__ = ["StepOutcome", "Strategy", "WorkerContext", "strategy_class"]
