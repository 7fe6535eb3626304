"""The pure part of benchmarks/overhead.py: how many steps a repeat times (no loop is run here)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import overhead  # noqa: E402


def test_small_steps_run_long_enough_to_fill_the_window_and_large_ones_keep_the_minimum():
    assert overhead.timed_steps_for(0.025, 37, 10.0) == 400   # tiny_cnn: 25 ms steps, a 10 s window
    assert overhead.timed_steps_for(0.97, 37, 10.0) == 37     # resnet18: 37 steps already last 36 s
    assert overhead.timed_steps_for(0.001, 37, 10.0, max_steps=2000) == 2000
    assert overhead.timed_steps_for(0.0, 37, 10.0, max_steps=2000) == 2000  # a step too fast to time: the cap
    assert overhead.timed_steps_for(0.025, 37, 0.0) == 37      # no window asked for: the minimum

