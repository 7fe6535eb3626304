"""benchmarks/overhead.py's steps per repeat (no loop run), and overhead_parts.py's diagnosis of a real run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import overhead  # noqa: E402


def test_small_steps_run_long_enough_to_fill_the_window_and_large_ones_keep_the_minimum():
    assert overhead.timed_steps_for(0.025, 37, 10.0) == 400   # tiny_cnn: 25 ms steps, a 10 s window
    assert overhead.timed_steps_for(0.97, 37, 10.0) == 37     # resnet18: 37 steps already last 36 s
    assert overhead.timed_steps_for(0.001, 37, 10.0, max_steps=2000) == 2000
    assert overhead.timed_steps_for(0.0, 37, 10.0, max_steps=2000) == 2000  # a step too fast to time: the cap
    assert overhead.timed_steps_for(0.025, 37, 0.0) == 37      # no window asked for: the minimum



def test_the_diagnosis_times_the_host_per_part_and_undoes_its_changes(env_data, tmp_path):
    """overhead_parts.changed_loop: a real run under each code variant gets its parts timed from the
    first timed step on, the variant's change shows in the stored rows, and nothing stays patched."""
    import overhead_parts

    from ddlscope.config import validate_config
    from ddlscope.measure import step_values, timeline
    from ddlscope.train import loop
    from tests.conftest import tiny_run

    cfg = validate_config(tiny_run(sample_budget=16 * 8, final_eval=False, warmup_steps=2))
    before = (loop.batches_forever, vars(step_values.DeviceValues)["of"], timeline.clock_for)
    for variant in ("ddlscope", "no_values"):
        parts: dict[str, float] = {}
        with overhead_parts.changed_loop(variant, 2, parts):
            total = overhead.ddlscope_loop_s(cfg, 2, tmp_path / f"{variant}.db")
        assert set(parts) == {"data_wait", "forward_backward", "optimizer", "rows"}
        assert 0 < sum(parts.values()) < total
        from ddlscope.store.db import ResultsStore

        with ResultsStore(tmp_path / f"{variant}.db") as store:
            losses = [r["loss"] for r in store.rows("steps", store.runs()[0]["run_id"])]
        assert len(losses) == 8 and all((x is None) == (variant == "no_values") for x in losses)
    assert (loop.batches_forever, vars(step_values.DeviceValues)["of"], timeline.clock_for) == before
    ms = overhead_parts.host_parts_ms([{"a": 0.2}, {"a": 0.4}, {"a": 0.3}], [1.0, 1.0, 2.0], 100)
    assert ms["a"] == pytest.approx(3.0) and ms["other"] == pytest.approx(8.0)  # medians of 2, 4, 3 and 8, 6, 17 ms
