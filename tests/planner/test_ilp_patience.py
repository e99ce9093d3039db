"""Note: [A solve that stopped improving ends] in teraio.planner.solvers.ilp_model: a solve given patience
stops once it finds nothing better, never before its first solution, and never under a deterministic limit."""

from __future__ import annotations

import threading
import time

import pytest
from ortools.sat.python import cp_model

from teraio.planner.solvers import ilp_model
from teraio.planner.solvers.ilp_model import PATIENCE_MIN_S, _solve_with_patience


class FakeSolver:
    """Stands in for CP-SAT: reports the given solutions at once, then searches until stopped or ``run_s``."""

    def __init__(self, solutions: int, run_s: float) -> None:
        self.solutions = solutions
        self.run_s = run_s
        self.stopped = threading.Event()
        self.searched_s = 0.0

    def stop_search(self) -> None:
        self.stopped.set()

    def solve(self, _model, callback) -> int:
        t0 = time.perf_counter()
        for _ in range(self.solutions):
            callback.on_solution_callback()
        self.stopped.wait(self.run_s)
        self.searched_s = time.perf_counter() - t0
        return cp_model.FEASIBLE if self.solutions else cp_model.UNKNOWN


def test_a_solve_that_found_nothing_better_is_stopped() -> None:
    fake = FakeSolver(solutions=2, run_s=60.0)
    assert _solve_with_patience(fake, None) == cp_model.FEASIBLE
    assert fake.stopped.is_set(), "the solve ran to its own end"
    assert fake.searched_s >= PATIENCE_MIN_S  # it waited at least the shortest patience


def test_a_solve_without_a_solution_is_never_stopped() -> None:
    fake = FakeSolver(solutions=0, run_s=2 * PATIENCE_MIN_S + 0.3)
    assert _solve_with_patience(fake, None) == cp_model.UNKNOWN
    assert not fake.stopped.is_set()


def _tiny_model() -> ilp_model._IlpModel:
    class Model:  # what _run reads of an _IlpModel
        m = cp_model.CpModel()

    x = Model.m.new_int_var(0, 10, "x")
    Model.m.add(x >= 3)
    Model.m.minimize(x)
    return Model()  # type: ignore[return-value]


def test_a_deterministic_limit_keeps_the_solve_reproducible(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_args) -> int:
        raise AssertionError("a solve with a deterministic limit was given a wall-clock patience")

    monkeypatch.setattr(ilp_model, "_solve_with_patience", refuse)
    solver, status = ilp_model._run(_tiny_model(), 5.0, 1, deterministic_s=1.0, patience=True)
    assert status == cp_model.OPTIMAL and solver.objective_value == 3


def test_patience_on_a_real_model_returns_its_optimum() -> None:
    solver, status = ilp_model._run(_tiny_model(), 5.0, 1, patience=True)
    assert status == cp_model.OPTIMAL and solver.objective_value == 3
