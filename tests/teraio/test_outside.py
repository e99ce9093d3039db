"""The time a step spends outside its graphs (teraio.lifecycle.outside_time): measured in the calibration steps, shared
among the step's graphs, and only from steps that were calibration runs from end to end."""

from __future__ import annotations

import time

import pytest
import torch

import teraio
from teraio.lifecycle import outside_time as outside_module
from teraio.lifecycle.backend import TeraioBackend
from teraio.lifecycle.outside_time import OutsideTimer

from .loops import CASES, GPTLoss


class _Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture
def clock(monkeypatch) -> _Clock:
    c = _Clock()
    monkeypatch.setattr(outside_module.time, "perf_counter", c)
    return c


def _timer() -> tuple[OutsideTimer, list[tuple[str, float]]]:
    samples: list[tuple[str, float]] = []
    return OutsideTimer(lambda graph, s: samples.append((graph, s))), samples


def test_one_graph_gets_the_step_minus_its_calls(clock) -> None:
    timer, samples = _timer()
    timer.forward_starts(0, first_call=True, calibrating=True)
    timer.graph_ran(0, "g", 3.0)  # forward
    timer.graph_ran(0, "g", 4.0)  # backward
    clock.now_s = 10.0
    timer.step_ended(0, clean=True)  # outside a backward: sampled at once
    assert samples == [("g", 3.0)]


def test_graphs_share_the_step_by_their_calls(clock) -> None:
    timer, samples = _timer()
    timer.forward_starts(3, first_call=True, calibrating=True)
    timer.graph_ran(3, "a", 1.0)
    timer.forward_starts(3, first_call=False, calibrating=True)
    for graph, s in (("b", 1.0), ("b", 1.0), ("a", 1.0)):
        timer.graph_ran(3, graph, s)
    clock.now_s = 8.0
    timer.step_ended(3, clean=True)
    assert sorted(samples) == [("a", 2.0), ("b", 2.0)]


@pytest.mark.parametrize(
    "spoil",
    ["a forward timed op by op joins", "the first forward is not calibrating", "not clean", "another step"],
)
def test_steps_that_were_not_calibration_runs_throughout_give_no_sample(clock, spoil) -> None:
    timer, samples = _timer()
    timer.forward_starts(0, first_call=True, calibrating=spoil != "the first forward is not calibrating")
    if spoil == "a forward timed op by op joins":
        timer.forward_starts(0, first_call=False, calibrating=False)
    timer.graph_ran(0, "g", 1.0)
    clock.now_s = 5.0
    timer.step_ended(1 if spoil == "another step" else 0, clean=spoil != "not clean")
    assert samples == []


def _train(be: TeraioBackend, steps: int, between=None) -> None:
    torch._dynamo.reset()
    case = CASES["gpt"]
    model = GPTLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    compiled = torch.compile(model, backend=be)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = compiled(*case.batch(step, case.sizes[0]))
        if between is not None:
            between(compiled, case, step)
        loss.backward()
        opt.step()


def test_the_loops_own_time_between_forward_and_backward_is_in_the_profile() -> None:
    """What the loop does between forward and backward (here a 30 ms metric, and a validation call of
    the compiled model under no_grad) is part of the step the user times: the profile's ``outside_s``
    holds it, and the planner's timeline (hence the predicted step) with it."""
    from teraio.planner.lifetimes import analyse

    sleep_s = 0.03

    def between(compiled, case, step) -> None:
        time.sleep(sleep_s)
        with torch.no_grad():
            compiled(*case.batch(step, case.sizes[0]))

    be = TeraioBackend(
        inner="eager", profiling=teraio.Profiling(steps=5, measure_memory=False), enabled=False
    )
    try:
        _train(be, 7, between)
        (runner,) = [r for r in be.runners if r.is_training]
        profile = runner.profile
    finally:
        be.close()
    meta = profile.meta
    assert meta["outside_steps"] == 3  # every calibration step
    assert meta["outside_s"] >= sleep_s  # sleep guarantees at least this much
    graphs_s = float(profile.ops["duration_us"].sum()) / 1e6
    assert analyse(profile).compute_s == pytest.approx(graphs_s + meta["outside_s"])


def test_no_calibration_steps_no_outside_time() -> None:
    be = TeraioBackend(
        inner="eager", profiling=teraio.Profiling(steps=2, measure_memory=False), enabled=False
    )
    try:
        _train(be, 4)
        (runner,) = [r for r in be.runners if r.is_training]
        meta = runner.profile.meta
    finally:
        be.close()
    assert meta["outside_steps"] == 0 and meta["outside_s"] == 0.0
