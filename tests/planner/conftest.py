"""Planner test fixtures.

Every ILP solve of the suite checks its model's own plans against the simulator inside the solver
(``TERAIO_CHECK_OWN_PLANS``, set in tests/conftest.py); ``ilp_own_plans`` additionally collects the
records of the solves a test makes, for tests that look at them.
"""

from __future__ import annotations

import dataclasses

import pytest

from teraio.planner import solve as solve_mod


@pytest.fixture
def ilp_own_plans(monkeypatch) -> list[dict]:
    """The ``stats.extra["own_plans"]`` records of every ILP solve of the test, in order."""
    info = solve_mod.solver_info("ilp")
    seen: list[dict] = []

    def recorded(problem):
        plan = info.fn(problem)
        seen.extend(plan.stats.extra.get("own_plans", []))
        return plan

    monkeypatch.setitem(solve_mod._REGISTRY, "ilp", dataclasses.replace(info, fn=recorded))
    return seen
