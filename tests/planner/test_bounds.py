"""The bandwidth-window lower bound (``planner.bounds``): a hand-computed case, and a property: no plan of
any solver, within its budget, simulates faster than the bound. ``make_plan`` no longer clamps the bound
to the step beyond float noise, so a wrong bound is an error, not a silently smaller number."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from teraio.planner import solve as solve_mod
from teraio.planner.bounds import StepBound, Window, step_lower_bound
from teraio.planner.budget import BudgetError
from teraio.planner.hardware import HardwareModel, TierModel
from teraio.planner.lifetimes import analyse
from teraio.planner.plan import SolverStats
from teraio.planner.simulate import simulate
from teraio.planner.solve import Problem, SolverBugError, make_plan, solve, solver_names
from teraio.planner.synth import ATTENTION_KINDS, split_ops, synth_profile
from tests.planner.planner_cases import MB, pyramid, ssd_only


def test_hand_computed_bound_on_the_pyramid():
    # Ops of 1 ms, memory (MB) 100 200 300 400 | 400 300 200 100, budget 300 MB: 100 MB must be away
    # at op3 and at op4. Writes 1 GB/s (100 MB: 0.1 s), reads 0.5 GB/s (0.2 s).
    # - Away at op3: only t0 and t1 are idle there, and t1 is produced by op1, so 100 MB produced at or
    #   after op0 must be written between the end of op0 and the start of op3: 0.1 s - 2 ms = 0.098 s.
    # - Away at op4: read after op4 ends, before its first use; the 100 MB needed last (t0, op7) are
    #   read between the end of op4 and the start of op7: 0.2 s - 2 ms = 0.198 s.
    # The windows share no boundary, so they add: 0.008 s compute + 0.296 s.
    lt = analyse(pyramid())
    bound = step_lower_bound(lt, ssd_only(write_bw=1e9, read_bw=0.5e9), 300 * MB)
    assert bound.compute_s == pytest.approx(0.008)
    assert bound.overhead_s == pytest.approx(0.296)
    assert [(w.direction, w.after_idx, w.before_idx, w.nbytes) for w in bound.windows] == [
        ("write", 0, 3, 100 * MB),
        ("read", 4, 7, 100 * MB),
    ]
    assert [w.overhead_s for w in bound.windows] == pytest.approx([0.098, 0.198])
    # Moving t0 (written after op0, waited before op3, read before op5) reaches it: the gap is zero.
    plan = solve(pyramid(), 300 * MB, "pipeline", ssd_only(write_bw=1e9, read_bw=0.5e9))
    assert plan.predicted_step_s == pytest.approx(bound.step_s) and plan.stats.gap == pytest.approx(0.0)
    # At or above the unplanned peak, and for "auto", nothing must move: compute time.
    assert step_lower_bound(lt, ssd_only(), 400 * MB).step_s == pytest.approx(0.008)
    assert step_lower_bound(lt, ssd_only(), None).overhead_s == 0.0


def _problem_with_bound(bound_s: float) -> tuple[Problem, list]:
    p = pyramid()
    lt = analyse(p)
    problem = Problem(
        profile=p, lifetimes=lt, hardware=ssd_only(), budget_bytes=300 * MB, budget_spec="300MB"
    )
    decisions = list(solve(p, 300 * MB, "pipeline", ssd_only()).decisions)
    compute_s = lt.compute_s
    problem._bound = StepBound(compute_s, bound_s - compute_s, (Window("write", 0, 3, 1, 0.0, 0.0),))
    return problem, decisions


def test_make_plan_refuses_a_bound_above_the_step():
    problem, decisions = _problem_with_bound(0.0)
    step_s = problem.simulate(decisions).step_s
    # Float noise (the bound sums op times in another order) is clamped to the step ...
    problem._bound = dataclasses.replace(problem.lower_bound(), overhead_s=step_s * (1 + 1e-12) - 0.008)
    plan = make_plan(problem, decisions, SolverStats(solver="x", status="HEURISTIC"))
    assert plan.stats.lower_bound_s == step_s and plan.stats.gap == 0.0
    # ... anything more is a bug, never a bound quietly lowered to the step.
    problem._bound = dataclasses.replace(problem.lower_bound(), overhead_s=step_s * (1 + 1e-6) - 0.008)
    with pytest.raises(SolverBugError) as e:
        make_plan(problem, decisions, SolverStats(solver="x", status="HEURISTIC"))
    assert [v.kind for v in e.value.violations] == ["bound_above_step"]


@st.composite
def synth_cases(draw):
    """Small synthetic GPT steps (1-2 layers, some split to a finer op granularity), random hardware from
    I/O-bound to compute-bound, a budget between the floor and the unplanned peak, and a solver."""
    profile = synth_profile(
        layers=draw(st.integers(1, 2)),
        hidden=draw(st.sampled_from([64, 128])),
        seq=draw(st.sampled_from([32, 64, 128])),
        batch=draw(st.integers(1, 2)),
        vocab=256,
        attention=draw(st.sampled_from(ATTENTION_KINDS)),
    )
    profile = split_ops(profile, draw(st.sampled_from([1, 1, 3])))
    ssd = TierModel(
        write_bw_bytes_per_s=draw(st.floats(2e7, 2e10)),
        read_bw_bytes_per_s=draw(st.floats(2e7, 2e10)),
        write_latency_s=draw(st.sampled_from([0.0, 1e-5])),
        read_latency_s=draw(st.sampled_from([0.0, 1e-5])),
        count=draw(st.integers(1, 2)),
        shared_channel=draw(st.booleans()),
        cpu_s_per_byte=draw(st.sampled_from([0.0, 0.15e-9])),
    )
    host = TierModel(4e9, 4e9, capacity_bytes=draw(st.sampled_from([0, 200_000, None])))
    hw = HardwareModel(tiers={"ssd": ssd, "host": host}, name="rand")
    frac = draw(st.floats(0.0, 1.0))
    return profile, hw, frac, draw(st.sampled_from(solver_names()))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(synth_cases())
def test_no_plan_within_budget_beats_the_lower_bound(case):
    profile, hw, frac, solver = case
    lt = analyse(profile)
    budget = int(lt.min_feasible_peak_bytes + frac * (lt.baseline_peak_bytes - lt.min_feasible_peak_bytes))
    try:
        plan = solve(profile, budget, solver, hw, lifetimes=lt, time_limit_s=30, deterministic_time_s=0.3)
    except BudgetError:
        return  # a heuristic that gives up at this budget has no plan to compare
    sim = simulate(profile, plan, lifetimes=lt)
    raw = step_lower_bound(lt, hw, budget)
    assert raw.overhead_s >= 0
    if not sim.within_budget:
        assert solve_mod.solver_info(solver).baseline  # only baselines ignore the budget
        return
    # The raw bound, not the one stored in the plan (which make_plan clamps within float noise).
    assert raw.step_s <= sim.step_s * (1 + solve_mod.BOUND_REL_TOLERANCE), (raw, sim.step_s)
    assert plan.stats.lower_bound_s == pytest.approx(raw.step_s, rel=1e-9)
