"""The two reference schedules every plan is compared with: move nothing, and move everything naively.

``none`` keeps every tensor in memory (the unplanned peak, no I/O). ``all`` offloads every candidate
when its last forward use ends, waits for all writes at the end of forward, and prefetches everything
at the start of backward: the naive schedule (docs/measured_facts.md), which barely lowers the peak because
every tensor is back in memory for the whole backward. Both ignore recompute: ``all`` offloads only, and
``none`` is the same plan in every recompute mode.
"""

from __future__ import annotations

import time

from teraio.planner.plan import Plan, SolverStats
from teraio.planner.solve import Problem, make_plan, register_solver


@register_solver("none", baseline=True, recompute_modes=("off", "only", "joint"))
def solve_none(problem: Problem) -> Plan:
    """Nothing moves."""
    t0 = time.perf_counter()
    return make_plan(
        problem, [], SolverStats(solver="none", status="BASELINE", wall_s=time.perf_counter() - t0)
    )


@register_solver("all", baseline=True)
def solve_all(problem: Problem) -> Plan:
    """Every candidate: offload after its last forward use, wait at the end of forward, prefetch at the
    start of backward, fetch before its first backward use."""
    t0 = time.perf_counter()
    lt = problem.lifetimes
    nf = lt.num_fwd_ops
    tier = problem.default_tier
    decisions = [
        lt.decision(
            c.name,
            tier=tier,
            offload_after_idx=c.last_fwd_use_idx,
            wait_before_idx=nf,
            prefetch_before_idx=nf,
        )
        for c in lt.candidate_list
    ]
    stats = SolverStats(solver="all", status="BASELINE", wall_s=time.perf_counter() - t0)
    return make_plan(problem, decisions, stats)
