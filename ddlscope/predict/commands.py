"""CLI commands of the predictor: ``profile``, ``calibrate``, ``recommend``, ``validate``.

:func:`register` adds them to the main ``ddlscope`` app (kept here so that the predictor's
commands read together). User errors raise :class:`~ddlscope.errors.UserError`.
"""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add the predictor's commands to ``app``."""
    # ---- profile (predict/profile.py)

    # ---- calibrate (predict/calibrate.py)

    # ---- recommend (predict/recommend.py)

    # ---- validate (predict/validate.py)
