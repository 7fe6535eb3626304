"""Data-pipeline analysis (``ddlscope datapipe``): which preprocessing strategy keeps training fed.

Named *datapipe* to keep it apart from pipeline *parallelism*. Modules:

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

from ddlscope.datapipe.analysis import DatapipeOptions, DatapipeResult, parse_workers, run_datapipe
from ddlscope.datapipe.caches import STRATEGIES

__all__ = ["STRATEGIES", "DatapipeOptions", "DatapipeResult", "parse_workers", "run_datapipe"]
