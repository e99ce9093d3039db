"""Planner test fixtures: every ILP solve in this suite checks the model's own plan against the simulator.

The ILP returns greedy's (or another start's) plan when its own simulates worse, which would hide a model
that disagrees with the simulator. So each solve records its own plan's simulation before any fallback
(``stats.extra["own_plans"]``, one record per model solution) and this fixture asserts, for every solve: the own plan is within budget, the
model never predicts a faster step than the simulator finds (the model is pessimistic, never optimistic),
and where the model is proven optimal on exact units (whole-microsecond times, no CPU interference) its
step equals the simulated step.
"""

from __future__ import annotations

import dataclasses

import pytest

from teraio.planner import solve as solve_mod

#: The model rounds each op and transfer up to whole microseconds.
_US = 1e-6


def check_own_plan(own: dict) -> None:
    """The assertions above, on one ``own_plan`` record."""
    if own["auto"]:
        return  # "auto" fixes op times; its objective is the peak, not the step
    assert own["budget_bytes"] is None or own["sim_peak_bytes"] <= own["budget_bytes"], own
    assert own["sim_step_s"] <= own["model_step_s"] + 1e-9, own
    if own["status"] == "OPTIMAL" and own["exact_units"]:
        assert abs(own["sim_step_s"] - own["model_step_s"]) < 1e-9, own


@pytest.fixture(autouse=True)
def _check_every_ilp_solve(monkeypatch):
    info = solve_mod.solver_info("ilp")
    seen: list[dict] = []

    def checked(problem):
        plan = info.fn(problem)
        for own in plan.stats.extra.get("own_plans", []):
            check_own_plan(own)
            seen.append(own)
        return plan

    monkeypatch.setitem(solve_mod._REGISTRY, "ilp", dataclasses.replace(info, fn=checked))
    yield seen
