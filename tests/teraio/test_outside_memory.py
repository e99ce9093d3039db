"""Memory a step holds outside its graphs (teraio.lifecycle.measurement.OutsideMemory): found by measured
steps and planned for, once for an excess over the prediction and again while a step is over its budget
(Note: [Memory outside the graphs is measured and planned for])."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

import teraio
from teraio.lifecycle.measurement import MAX_OUTSIDE_ROUNDS, OUTSIDE_CONFIRMING_STEPS, OutsideMemory
from teraio.tools.workloads import builtin_workload

MIB = 1 << 20


def _outside(budget: str = "50%") -> OutsideMemory:
    return OutsideMemory(SimpleNamespace(enabled=True, memory_budget=budget))


def _measure(outside: OutsideMemory, peak: int, predicted: int, budget: int | None, steps: int) -> None:
    for _ in range(steps):
        outside.measured(peak, predicted, graphs=2, budget_bytes=budget)


def test_an_excess_over_the_prediction_is_planned_for_once() -> None:
    outside = _outside()
    outside.measured(110 * MIB, 100 * MIB, graphs=2, budget_bytes=200 * MIB)
    assert outside.confirming and not outside.replan_wanted  # one step could be a one-off
    outside.measured(108 * MIB, 100 * MIB, graphs=2, budget_bytes=200 * MIB)
    assert outside.take_replan() and not outside.take_replan()
    assert outside.bytes == 8 * MIB and outside.rounds == 1  # the smaller of the two excesses
    # Under the budget, a later excess over the prediction is reported, not chased.
    _measure(outside, 130 * MIB, 100 * MIB, 200 * MIB, OUTSIDE_CONFIRMING_STEPS)
    assert not outside.replan_wanted and outside.bytes == 8 * MIB


def test_a_step_over_its_budget_is_planned_for_again_until_it_fits() -> None:
    outside = _outside()
    _measure(outside, 160 * MIB, 100 * MIB, 120 * MIB, OUTSIDE_CONFIRMING_STEPS)
    assert outside.take_replan() and outside.bytes == 60 * MIB
    # The planned step moved its peak to where more is held outside: 2% over its prediction (under the
    # 5% that starts a first round) but over its budget.
    outside.measured(102 * MIB, 100 * MIB, graphs=2, budget_bytes=101 * MIB)
    assert outside.confirming and not outside.replan_wanted
    outside.measured(103 * MIB, 100 * MIB, graphs=2, budget_bytes=101 * MIB)
    assert outside.take_replan() and outside.bytes == 62 * MIB and outside.rounds == 2
    # A one-off over the budget is not chased: the next step is within it.
    outside.measured(102 * MIB, 100 * MIB, graphs=2, budget_bytes=101 * MIB)
    outside.measured(100 * MIB, 100 * MIB, graphs=2, budget_bytes=101 * MIB)
    assert not outside.confirming and not outside.replan_wanted
    # At most MAX_OUTSIDE_ROUNDS plannings in all.
    for _ in range(MAX_OUTSIDE_ROUNDS + 2):
        _measure(outside, 102 * MIB, 100 * MIB, 101 * MIB, OUTSIDE_CONFIRMING_STEPS)
        outside.take_replan()
    assert outside.rounds == MAX_OUTSIDE_ROUNDS
    assert outside.bytes == 62 * MIB + (MAX_OUTSIDE_ROUNDS - 2) * 2 * MIB


def test_nothing_is_chased_after_a_planning_that_could_not_fit_it_or_without_a_budget_to_keep() -> None:
    outside = _outside()
    _measure(outside, 160 * MIB, 100 * MIB, 120 * MIB, OUTSIDE_CONFIRMING_STEPS)
    outside.take_replan()
    outside.stop()  # the graphs kept their plans: the memory found does not fit beside them
    _measure(outside, 160 * MIB, 100 * MIB, 120 * MIB, OUTSIDE_CONFIRMING_STEPS)
    assert not outside.replan_wanted and outside.bytes == 60 * MIB
    # A whole-step plan of states passes no budget: only the first round's rule applies.
    states = _outside()
    _measure(states, 103 * MIB, 100 * MIB, None, OUTSIDE_CONFIRMING_STEPS)
    assert not states.replan_wanted
    # "auto" plans each graph for its own floor, and without a budget there is nothing to plan for.
    for budget in ("auto", None):
        other = _outside(budget)
        _measure(other, 200 * MIB, 100 * MIB, 101 * MIB, OUTSIDE_CONFIRMING_STEPS)
        assert not other.replan_wanted


def _blocks_loop(enabled: bool, tmp_path, steps: int) -> tuple[list[torch.Tensor], dict, Any, dict]:
    """The README's loop on the FX path: the tiny GPT compiled block by block, its loss computed eagerly
    over the logits outside every graph."""
    torch._dynamo.reset()
    work = builtin_workload("tiny")
    backend = teraio.backend(
        memory_budget="60%",
        inner="eager",
        solver="greedy",
        profiling=teraio.Profiling(steps=1),
        offload_dirs=[str(tmp_path)],
        enabled=enabled,
    )
    model = backend.compile(work.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    try:
        for step in range(steps):
            loss = model(*work.batch_at(step))
            loss.backward()
            losses.append(loss.detach().clone())
            opt.step()
            opt.zero_grad()
        stats = backend.stats()  # ends the last measurement
    finally:
        backend.close()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, backend, stats


def test_the_readme_loop_keeps_its_budget_where_the_peak_moves_to_more_outside_memory(tmp_path) -> None:
    """At 60% the first planning for the memory outside (310 KiB, measured at the first plan's peak) moved
    the step's peak to where the eager loss holds more: with that planning alone, 2,107,544 bytes measured
    for a budget of 2,098,987. The second round plans for the rest: the step is within its budget."""
    ref_losses, ref_params, _, _ = _blocks_loop(False, tmp_path / "ref", 14)
    losses, params, backend, stats = _blocks_loop(True, tmp_path / "run", 14)
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses))
    for n in ref_params:
        assert torch.equal(ref_params[n], params[n]), n
    budget = {r.step_budget_bytes for r in backend.runners if r.is_training}
    assert budget == {stats["step_budget_bytes"]} and (budget_bytes := budget.pop()) is not None
    measured, predicted = stats["measured_peak_bytes"], stats["predicted_peak_bytes"]
    assert measured is not None and predicted is not None
    assert measured <= budget_bytes and predicted <= budget_bytes, (measured, predicted, budget_bytes)
    assert stats["outside_memory_plannings"] == 2, "the scenario needs a second planning"
    assert stats["outside_memory_bytes"] == backend.outside_memory.bytes > 0
    assert stats["moved_bytes_per_step"] > 0
