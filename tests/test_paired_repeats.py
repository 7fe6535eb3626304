"""How the benchmarks read paired repeats against a target (benchmarks/_paired.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import _paired  # noqa: E402


def test_the_median_interval_takes_the_sign_test_order_statistics():
    assert _paired.median_interval(range(1, 10)) == (2, 8)       # n = 9: k = 2, coverage 96.1 %
    assert _paired.median_interval(range(1, 16)) == (4, 12)      # n = 15: k = 4, coverage 96.5 %
    assert _paired.median_interval(range(1, 7)) == (1, 6)        # n = 6: the extremes, coverage 96.9 %
    assert _paired.median_interval(range(1, 6)) is None          # n = 5: even the extremes cover only 93.8 %
    assert _paired.median_interval(range(1, 6), confidence=0.9) == (1, 5)
    assert _paired.median_interval([3.0, 1.0, 2.0] * 3) == (1.0, 3.0)  # sorted first
    with pytest.raises(ValueError, match="allowed: 0 < confidence < 1"):
        _paired.median_interval([1, 2], confidence=1.0)


def test_an_overhead_target_is_met_or_missed_only_by_the_whole_interval():
    assert _paired.verdict((-0.01, 0.015), 0.02) == "met"
    assert _paired.verdict((0.02, 0.05), 0.02) == "missed"
    assert _paired.verdict((-0.04, 0.06), 0.02) == "unsettled"    # the noise is larger than the target
    assert _paired.verdict(None, 0.02) == "unsettled"             # too few pairs for an interval


def test_a_throughput_target_is_read_from_below():
    assert _paired.verdict((0.97, 1.04), 0.97, at_least=True) == "met"
    assert _paired.verdict((0.80, 0.96), 0.97, at_least=True) == "missed"
    assert _paired.verdict((0.90, 1.01), 0.97, at_least=True) == "unsettled"


def test_the_interval_text():
    assert _paired.interval_text([-0.012, 0.041], "+.1%") == "-1.2% .. +4.1%"
    assert _paired.interval_text(None, "+.1%") == "too few pairs"
