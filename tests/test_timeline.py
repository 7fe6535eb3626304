"""The step timer with a fake device clock: phases are marked without waiting for the device and
read afterwards, in the training loop once the device is past them (issue 16: no synchronize between phases)."""

from __future__ import annotations

import pytest
import torch

from ddlscope.config import validate_config
from ddlscope.measure import timeline
from ddlscope.measure.timeline import CudaEventClock, HostClock, Stopwatch, clock_for
from ddlscope.store.db import ResultsStore
from ddlscope.strategies import WorkerContext
from ddlscope.strategies.base import Strategy
from ddlscope.train.loop import run_worker
from tests.conftest import tiny_run


class FakeDeviceClock:
    """A GPU-like clock: a mark is an event id whose time is set by the test; waits are logged.

    ``log`` lists ``("mark", id)`` and ``("wait", id)`` in call order; ``times[id]`` is the
    device time (seconds) at which the event is reached.
    """

    def __init__(self, step_s: float = 0.5):
        self.log: list[tuple[str, int]] = []
        self.times: dict[int, float] = {}
        self.step_s = step_s

    def mark(self) -> int:
        i = len(self.times)
        self.times[i] = i * self.step_s + 0.01 * i * i  # distinct gaps: lap i -> i+1 is step_s + 0.01 (2i + 1)
        self.log.append(("mark", i))
        return i

    def wait(self, mark: int) -> None:
        self.log.append(("wait", mark))

    def reached(self, mark: int) -> bool:
        return False

    def seconds_between(self, start: int, end: int) -> float:
        return self.times[end] - self.times[start]


def test_marks_never_wait_and_laps_read_the_device_time_between_them():
    clock = FakeDeviceClock()
    watch = Stopwatch("cpu", clock=clock)
    watch.start()
    laps = [watch.mark() for _ in range(3)]
    assert [kind for kind, _ in clock.log] == ["mark"] * 5  # the constructor's, start's and 3 laps': no wait
    assert not any(lap.reached() for lap in laps)
    assert [lap.seconds() for lap in laps] == pytest.approx([0.5 + 0.01 * (2 * i + 1) for i in (1, 2, 3)])
    assert clock.log[5:] == [("wait", 2), ("wait", 3), ("wait", 4)]  # each lap waits for its own end only
    assert laps[0].reached() and laps[0].seconds() == pytest.approx(0.53)
    assert len(clock.log) == 8  # read once: no second wait


def test_lap_waits_for_its_end_at_once():
    clock = FakeDeviceClock()
    watch = Stopwatch(clock=clock)
    assert watch.lap() == pytest.approx(0.51)
    assert clock.log == [("mark", 0), ("mark", 1), ("wait", 1)]


def test_clock_for_picks_events_on_cuda_and_the_host_clock_elsewhere():
    assert isinstance(clock_for("cpu"), HostClock)
    assert isinstance(clock_for(torch.device("cuda", 0)), CudaEventClock)  # made without touching a GPU
    watch = Stopwatch("cpu")
    lap = watch.mark()
    assert lap.reached() and lap.seconds() >= 0.0 and watch.lap() >= 0.0


def test_forward_backward_leaves_its_laps_to_the_caller(monkeypatch):
    clock = FakeDeviceClock()
    monkeypatch.setattr(timeline, "clock_for", lambda device: clock)
    model = torch.nn.Linear(4, 3)
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    result = Strategy(None, None).forward_backward(model, x, y, torch.nn.functional.cross_entropy)
    assert model.weight.grad is not None
    assert [kind for kind, _ in clock.log] == ["mark"] * 3
    assert set(result.pending) == {"forward_s", "backward_s"}
    assert result.resolve() is result and not result.pending
    assert (result.forward_s, result.backward_s) == pytest.approx((0.51, 0.53))
    assert clock.log[3:] == [("wait", 1), ("wait", 2)]


def test_forward_backward_leaves_the_loss_and_hits_on_the_device_until_resolved(monkeypatch):
    model = torch.nn.Linear(4, 3)
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))

    def no_read(self, *a, **k):  # a read between forward and backward would make a GPU step wait
        raise AssertionError("forward_backward read a tensor")

    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "item", no_read)
        m.setattr(torch.Tensor, "tolist", no_read)
        result = Strategy(None, None).forward_backward(model, x, y, torch.nn.functional.cross_entropy)
    assert result.loss is None and result.correct is None
    result.resolve()
    logits = model(x)  # the weights are unchanged: no optimizer step
    assert result.loss == pytest.approx(torch.nn.functional.cross_entropy(logits, y).item())
    assert result.correct == int((logits.argmax(1) == y).sum())


def test_the_loop_reads_a_steps_laps_only_after_the_next_step_ran(env_data, db_path, monkeypatch):
    """The device clock's log over a run: every wait is for a step that is already over, and the stored
    phase times are the fake device's."""
    steps, clock = 3, FakeDeviceClock()
    monkeypatch.setattr(timeline, "clock_for", lambda device: clock)
    cfg = validate_config(tiny_run(sample_budget=16 * steps, final_eval=False))
    with ResultsStore(db_path) as store:
        run_id = store.create_run("timeline", "single", cfg.model_dump(mode="json"))
        run_worker(cfg, WorkerContext(run_id=run_id, worker_index=0, num_workers=1, cores=[0], initial_peers=[]),
                   store)
        rows = store.rows("steps", run_id)
    # per step: the loop's start mark, data lap, (forward_backward: its watch, forward, backward), compute, optimizer
    marks_per_step = 7
    waits = [(position, mark) for position, (kind, mark) in enumerate(clock.log) if kind == "wait"]
    assert len(waits) == 5 * steps
    for position, mark in waits:
        step = (mark - 1) // marks_per_step  # mark 0 is the constructor's
        if step < steps - 1:  # read after the next step's last mark was made
            next_step_end = 1 + (step + 2) * marks_per_step - 1
            assert ("mark", next_step_end) in clock.log[:position], (step, mark)
    assert [r["step"] for r in rows] == list(range(steps))
    gap = [clock.times[i + 1] - clock.times[i] for i in range(len(clock.times) - 1)]
    for step, row in enumerate(rows):
        first = 1 + step * marks_per_step  # the step's start mark
        assert row["data_load_s"] == pytest.approx(gap[first])
        assert row["forward_s"] == pytest.approx(gap[first + 2])
        assert row["backward_s"] == pytest.approx(gap[first + 3])
        assert row["optimizer_s"] == pytest.approx(gap[first + 5])
        assert row["step_s"] == pytest.approx(clock.times[first + 6] - clock.times[first])


def test_step_values_off_a_gpu_are_read_without_an_event():
    from ddlscope.measure.step_values import DeviceValues, ValuesInFlight

    logits, y = torch.tensor([[0.1, 0.9], [0.8, 0.2]]), torch.tensor([1, 1])
    flight = ValuesInFlight([DeviceValues.of(torch.tensor(0.25), logits, y)])
    assert flight.reached() and flight.read() == [(0.25, 1.0, 2.0)]
