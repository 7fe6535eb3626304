"""Steps' loss and hits read from the device in groups (issue 16's overhead): every step keeps its
own values, the loop writes a group's rows once the device is past it, and waits only when too many
groups are in flight."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ddlscope.measure.step_values import DeviceValues, ValuesInFlight
from ddlscope.measure.timeline import Stopwatch
from ddlscope.strategies.base import BatchResult, Strategy
from ddlscope.train import loop
from ddlscope.workloads.step import IGNORE_INDEX, correct_samples


def _step(batch: int, classes: int = 5, seed: int = 0, positions: int | None = None):
    g = torch.Generator().manual_seed(seed)
    shape = (batch,) if positions is None else (batch, positions)
    logits = torch.randn(*shape, classes, generator=g)
    y = torch.randint(0, classes, shape, generator=g)
    if positions is not None:
        y[0, :2] = IGNORE_INDEX  # not scored
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, classes), y.reshape(-1), ignore_index=IGNORE_INDEX)
    return loss, logits, y


def test_a_group_reads_every_steps_own_loss_and_hits_in_order():
    # class logits of two batch sizes (a short last batch) and per-position logits with ignored targets
    steps = [_step(8, seed=0), _step(8, seed=1), _step(3, seed=2), _step(4, seed=3, positions=6), _step(8, seed=4)]
    flight = ValuesInFlight([DeviceValues.of(*s) for s in steps])
    read = flight.read()
    assert len(read) == len(steps)
    for (loss, logits, y), (got_loss, got_correct, got_scored) in zip(steps, read):
        assert got_loss == pytest.approx(loss.item())
        assert got_scored == int((y != IGNORE_INDEX).sum())
        hits = ((logits.argmax(-1) == y) & (y != IGNORE_INDEX)).sum()
        assert got_correct == int(hits)


def test_a_taken_value_is_the_accuracy_that_correct_samples_gives():
    for s in (_step(8), _step(4, positions=6)):
        loss, logits, y = s
        res = BatchResult(len(y), None, None, 0.0, 0.0, device_values=DeviceValues.of(*s),
                          per_position=logits.dim() > 2)
        res.take_values(ValuesInFlight([res.device_values]).read()[0])
        assert res.device_values is None and res.loss == pytest.approx(loss.item())
        assert res.correct == pytest.approx(correct_samples(logits, y))


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_forward_backward_adds_one_kernel_per_step_to_the_plain_step():
    """The loss and hits cost the step one argmax (the rest is launched once per group): the ops that
    forward_backward runs beyond a plain forward, loss and backward are an argmax and detaches."""
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))

    def ops_of(step) -> list[str]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        with _CountOps() as counter:
            step(model)
        return counter.ops

    plain = ops_of(lambda m: torch.nn.functional.cross_entropy(m(x), y).backward())
    ours = ops_of(lambda m: Strategy(None, None).forward_backward(m, x, y, torch.nn.functional.cross_entropy))
    extra = list(ours)
    for op in plain:
        extra.remove(op)
    assert sorted(extra) == ["argmax", "detach", "detach", "detach"]


class _NeverReached:
    """A device clock whose marks the device never reaches by itself (a slow GPU); waits are logged."""

    def __init__(self):
        self.marks, self.waits = 0, []

    def mark(self):
        self.marks += 1
        return self.marks

    def wait(self, mark):
        self.waits.append(mark)

    def reached(self, mark):
        return False

    def seconds_between(self, start, end):
        return 0.001 * (end - start)


class _Writer:
    def __init__(self):
        self.steps: list[dict] = []

    def add_step(self, run_id, wi, row):
        self.steps.append(row)


def _add_steps(rows, clock, first: int, count: int) -> None:
    for step in range(first, first + count):
        watch = Stopwatch(clock=clock)
        laps = (watch.mark(), watch.mark(), watch.mark())
        loss, logits, y = _step(4, seed=step)
        res = BatchResult(4, None, None, 0.0, 0.0, device_values=DeviceValues.of(loss, logits, y))
        rows.add(dict(step=step, comm_wait_s=0.0, bubble_s=0.0), res, laps)


def test_rows_wait_for_the_device_only_beyond_the_groups_in_flight(monkeypatch):
    monkeypatch.setattr(ValuesInFlight, "reached", lambda self: False)
    clock, writer = _NeverReached(), _Writer()
    rows = loop._StepRows(writer, "r", 0, group_steps=4, group_s=3600.0)
    groups = loop.MAX_GROUPS_IN_FLIGHT
    _add_steps(rows, clock, 0, 4 * groups)
    assert writer.steps == [] and clock.waits == []  # the device is behind: nothing read, nothing waited for
    _add_steps(rows, clock, 4 * groups, 4)  # one group too many: the oldest is read
    assert [r["step"] for r in writer.steps] == [0, 1, 2, 3]
    rows.drain()
    assert [r["step"] for r in writer.steps] == list(range(4 * groups + 4))
    assert all(r["loss"] is not None and r["accuracy"] is not None for r in writer.steps)


def test_rows_are_written_as_soon_as_the_device_is_past_them():
    writer = _Writer()
    rows = loop._StepRows(writer, "r", 0, group_steps=3, group_s=3600.0)
    _add_steps(rows, Stopwatch("cpu").clock, 0, 5)  # the host clock: every mark is reached
    assert [r["step"] for r in writer.steps] == [0, 1, 2]  # the group of 3 is written, 2 steps are open
    rows.drain()
    assert [r["step"] for r in writer.steps] == [0, 1, 2, 3, 4]


def test_a_group_is_launched_after_its_time_whatever_its_size():
    writer = _Writer()
    rows = loop._StepRows(writer, "r", 0, group_steps=1000, group_s=0.0)
    _add_steps(rows, Stopwatch("cpu").clock, 0, 2)
    assert [r["step"] for r in writer.steps] == [0, 1]
