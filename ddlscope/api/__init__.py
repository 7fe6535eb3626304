"""ddlscope's Python API (what ``import ddlscope`` offers): measure any training script.

- :class:`Recorder` / :func:`record`: record a training loop the user wrote (plain ``python`` or under
  ``torchrun``) as a ddlscope run (:mod:`ddlscope.api.recorder`);
- :func:`run`: train a user's model, dataset, loss and optimizer factories with ddlscope's own loop under
  any distribution model, measured (:mod:`ddlscope.api.runner`); :class:`RunFailed` when the run did not complete;
- :func:`report`: the comparison report of stored runs (:mod:`ddlscope.api.reports`).
"""

from ddlscope.api.recorder import Recorder, RecorderInterrupted, StepRecord, record
from ddlscope.api.reports import report
from ddlscope.api.runner import RunFailed, run

__all__ = ["Recorder", "RecorderInterrupted", "RunFailed", "StepRecord", "record", "report", "run"]
