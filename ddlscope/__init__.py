"""ddlscope: measure, analyse, predict and recommend distributed deep-learning training."""

__version__ = "0.1.0"
