"""Data-pipeline analysis (``ddlscope datapipe``): which preprocessing strategy keeps training fed.

Named *datapipe* to keep it apart from pipeline *parallelism*. Modules:

* :mod:`~ddlscope.datapipe.options`  what is asked (:class:`DatapipeOptions`), checked before any work;
* :mod:`~ddlscope.datapipe.caches`   the strategies (decode-every-step, cached-decoded-memory,
  cached-decoded-disk, preprocessed) and the caches they read;
* :mod:`~ddlscope.datapipe.measure`  loader throughput and the training step's compute time;
* :mod:`~ddlscope.datapipe.verdict`  input-bound or not, and the recommendation;
* :mod:`~ddlscope.datapipe.analysis` the whole measurement (:func:`run_datapipe`);
* :mod:`~ddlscope.datapipe.report`   table, JSON, Markdown and plot.

Example::

    from ddlscope.datapipe import DatapipeOptions, run_datapipe
    result = run_datapipe(DatapipeOptions("digits", workers=(0, 1), step_time_s=0.4), Path("cache"))
    print(result.recommendation.explanation)
"""

_WHERE = {"DatapipeOptions": "options", "parse_workers": "options", "DatapipeResult": "analysis",
          "run_datapipe": "analysis", "STRATEGIES": "caches"}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    """The names above, imported on first use: ``DatapipeOptions`` and ``parse_workers`` without torch,
    so that the CLI refuses a bad option before it loads the measurement."""
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(f"ddlscope.datapipe.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'ddlscope.datapipe' has no attribute {name!r}")
