"""The predictor's commands and the validation report (thesis 002 ch. 4-8, and better).

- :mod:`.commands`: ``ddlscope profile``, ``calibrate``, ``recommend``, ``validate``;
- :mod:`.validation_report`: predictions next to real runs, per cell: error, recommendation
  correctness, regret, and the step parts side by side.

The modelling itself is :mod:`ddlscope.modeling` (torch-free: profiles' data classes, cluster,
collectives, prediction, memory, recommend) with each model's cost and memory model in
``ddlscope/distribution/<model>.py``; measuring is :mod:`ddlscope.profiling`; running a grid of
cells is :mod:`ddlscope.experiments`.
"""
