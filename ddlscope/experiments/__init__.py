"""Experiments: many runs, one after another, stored as a group and compared.

- :mod:`ddlscope.experiments.runner`: the one experiment runner — a :class:`~ddlscope.experiments.runner.Cell`
  per run, resume by cell key, one progress bar, failures stored and skipped over; sweeps
  (:mod:`ddlscope.sweep`), the benchmark suite (:mod:`ddlscope.suite`) and the validation
  (:mod:`ddlscope.experiments.validate`) each expand their own input format into cells and hand them to it;
- :mod:`ddlscope.experiments.estimate`: rough run-time estimates of cells (dry runs, the ETA);
- :mod:`ddlscope.experiments.results`: a stored run reduced to seconds per step and per epoch, its
  step parts, and the one speedup definition;
- :mod:`ddlscope.experiments.validate`: predict every cell of a grid, run it, compare.
"""

from __future__ import annotations

from collections.abc import Iterable


def check_known(values: list[str], allowed: Iterable[str], what: str, hint: str = "") -> list[str]:
    """``values`` when every one is in ``allowed`` (for pydantic validators of experiment specs).

    Raises:
        ValueError: ``unknown <what>(s) [...]; allowed: ...<hint>``.
    """
    allowed = list(allowed)
    bad = [v for v in values if v not in allowed]
    if bad:
        raise ValueError(f"unknown {what}(s) {bad}; allowed: {', '.join(allowed)}{hint}")
    return values
