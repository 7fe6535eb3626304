"""ddlscope: measure, analyse, predict and recommend distributed deep-learning training.

Python API (docs/api.md): :class:`ddlscope.Recorder` / :func:`ddlscope.record` measure a training loop
you wrote, :func:`ddlscope.run` trains your own model, data, loss and optimizer under any distribution
model, :func:`ddlscope.report` writes the comparison report of stored runs. They are imported on first
use, so ``import ddlscope`` (and the CLI) stays light.
"""

__version__ = "0.1.0"

_API = ("Recorder", "RecorderInterrupted", "RunFailed", "StepRecord", "record", "report", "run")
__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        import ddlscope.api

        return getattr(ddlscope.api, name)
    raise AttributeError(f"module 'ddlscope' has no attribute {name!r}")
