"""Pure, torch-free modelling: what a workload costs under each distribution model, and which to choose.

- :mod:`.profile`: the profile data classes (what one device measured about a workload);
- :mod:`.cluster` / :mod:`.devices`: the cluster description (TOML) and known device kinds,
  scaling a profile to another device;
- :mod:`.collectives`: the building blocks of the cost models (ring and butterfly collectives,
  contention, traffic, exposed data loading);
- :mod:`.prediction`: :class:`~.prediction.Setting`, :class:`~.prediction.Prediction` and
  :func:`~.prediction.predict`, which dispatches to the model's cost model in
  ``ddlscope/distribution/<model>.py`` (the registry); a prediction's parts are the step parts
  of :mod:`ddlscope.measure.parts`;
- :mod:`.memory`: :class:`~.memory.MemoryEstimate` and :func:`~.memory.predict_memory`, which
  dispatches to the model's memory model;
- :mod:`.recommend`: rank the candidates of a job, never recommending one that does not fit.

Nothing here imports torch (``tests/test_modeling.py`` checks it); measuring is
:mod:`ddlscope.profiling`'s.
"""
