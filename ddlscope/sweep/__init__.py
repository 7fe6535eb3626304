"""Sweeps: a grid of runs over any run parameter, run one after another and stored as a group.

- :mod:`ddlscope.sweep.grid`: read a grid (TOML or preset), expand it into cells, validate them;
- :mod:`ddlscope.sweep.presets`: thesis 000's grids scaled to this machine, and a local one;
- :mod:`ddlscope.sweep.runner`: run the cells with the experiment runner
  (:mod:`ddlscope.experiments.runner`: skip finished ones, store failures and go on; time
  estimates from :mod:`ddlscope.experiments.estimate`).
"""
