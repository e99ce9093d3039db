"""The exact solver: an OR-Tools CP-SAT model of the step, searched from the best constructive plan.

Which tensors move, to which tier, and when each write and read runs, so that memory stays within the
budget at every op and the predicted step (compute + stall + the CPU cost of I/O) is smallest, then the
fewest bytes move. Every plan is re-judged by the simulator; ``ilp`` returns the best plan it has seen,
so it is never worse than its starts (``pipeline`` and ``greedy``).

This module registers the solver and holds the argument that ties its parts together; the parts are
split where they change for different reasons:

- :mod:`planner.solvers.ilp_model`: the CP-SAT model of one Problem (its legend and formulation: memory
  as a cumulative resource, cuts, objective), hints from a plan, and reading a plan back from a solution.
- :mod:`planner.solvers.ilp_search`: the offload search around the model (starts, the whole step, the
  fewest bytes, layer windows) and the check of every model solution against the simulator.
- :mod:`planner.solvers.ilp_recompute`: with ``Problem.recompute`` "only" or "joint", the search over
  recompute sets, each set's residual step planned exactly by the model.

Notation (the legend of :mod:`planner.solvers.ilp_model`): ``d[k]`` the duration of op ``k`` rounded up to
whole microseconds, ``E[k]`` its end in the model, ``E[last]`` the model's step.

How the model's step relates to the simulated step of the plan read back from it (``sim``):

    sim  <=  model  <=  sim + rounding + cpu        (the upper half for OPTIMAL solutions)

- Floor (every solution): the model's times are the simulator's with each op and transfer rounded up,
  no CPU cost, and its memory is at least the simulator's; the plan read back issues, waits and fetches
  no later than the model's schedule, so its replay ends no later than ``E[last]``, and interference adds
  at most the CPU cost the model charges in full.
- Ceiling (OPTIMAL, for the whole step or within a layer window): the read-back plan, replayed in model
  units, is itself a solution of the (sub)model, so the optimum is at most its replayed end plus its CPU
  charge. Rounding each duration up by ``delta`` moves any end by at most the sum of the deltas (each
  time is a longest path through ops and transfers, each on it at most once, and FIFO orders are fixed
  by issue order, not by times), and the simulator's interference only delays. Hence
  ``rounding = sum over ops (d[k] - duration) + sum over moved tensors (write_us - write time) +
  (read_us - read time)`` and ``cpu`` = the model's CPU charge of the moved tensors. On exact units
  (whole-microsecond times, no CPU cost) both are zero and an optimal model step equals the simulated
  step. A FEASIBLE solution may hold slack CP-SAT has not removed yet: no ceiling.

With ``TERAIO_CHECK_OWN_PLANS=1`` in the environment (the test suite sets it for every test, subprocesses
included) every model solution is checked against these relations, and against the budget, the moment it
is found (before any fallback to a start can hide it): a failure raises ``SolverBugError`` whose
violations say which (``budget``, ``model_optimistic``, ``model_pessimistic``). Each solution's record
is in ``stats.extra["own_plans"]`` either way.
"""

from __future__ import annotations

from teraio.planner.plan import Plan
from teraio.planner.solve import Problem, register_solver
from teraio.planner.solvers.ilp_model import MAX_CUTS, MAX_UNIT_NBYTES
from teraio.planner.solvers.ilp_recompute import (
    OFFLOAD_SHARE,
    ONLY_SHARE,
    SET_SEARCH_SHARE,
    SETS_PER_DETERMINISTIC_S,
    _solve_with_recompute,
)
from teraio.planner.solvers.ilp_search import (
    CHECK_OWN_PLANS_ENV,
    CHECK_TOLERANCE_S,
    FULL_MODEL_MAX_CANDIDATES,
    LNS_WIDTH,
    LNS_WINDOW_S,
    PHASE2_SHARE,
    RESERVE_SHARE,
    _solve_offload,
    own_plan_problems,
)

__all__ = [
    "CHECK_OWN_PLANS_ENV",
    "CHECK_TOLERANCE_S",
    "FULL_MODEL_MAX_CANDIDATES",
    "LNS_WIDTH",
    "LNS_WINDOW_S",
    "MAX_CUTS",
    "MAX_UNIT_NBYTES",
    "OFFLOAD_SHARE",
    "ONLY_SHARE",
    "PHASE2_SHARE",
    "RESERVE_SHARE",
    "SETS_PER_DETERMINISTIC_S",
    "SET_SEARCH_SHARE",
    "own_plan_problems",
    "solve_ilp",
]


@register_solver("ilp", supports_auto=True, recompute_modes=("off", "only", "joint"))
def solve_ilp(problem: Problem) -> Plan:
    """The exact solver: the best of the ``pipeline`` and ``greedy`` plans, improved with CP-SAT (the whole
    step when it is small, then a large-neighbourhood search over layer windows), judged by the simulator;
    with recompute, a search over recompute sets around that model (:mod:`planner.solvers.ilp_recompute`).

    Raises:
        BudgetError: the budget is below the smallest achievable peak (or, recompute only, no recompute set
            meets it).
    """
    if problem.plans_recompute:
        return _solve_with_recompute(problem)
    return _solve_offload(problem)
