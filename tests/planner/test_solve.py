"""The solver registry, ``solve``, the baselines and greedy on cases whose best plans are known by hand."""

from __future__ import annotations

import pytest

from teraio.planner.budget import BudgetError
from teraio.planner.hardware import HardwareModel
from teraio.planner.lifetimes import analyse
from teraio.planner.plan import Plan, SolverStats
from teraio.planner.profile import make_profile
from teraio.planner.simulate import simulate
from teraio.planner.solve import (
    Problem,
    SolverBugError,
    UnknownSolverError,
    get_solver,
    make_plan,
    register_solver,
    solve,
    solver_names,
)
from teraio.planner.synth import synth_profile
from tests.planner.planner_cases import MB, act, ops_rows, pyramid, ssd_only

FAST = ssd_only(write_bw=1e12, read_bw=1e12)  # 100 MB in 0.1 ms: every move hides behind 1 ms ops
SLOW = ssd_only(write_bw=1e9, read_bw=0.5e9)  # 100 MB in 0.1 / 0.2 s: nothing hides


def test_registry_has_the_builtin_solvers():
    names = solver_names()
    assert {"none", "all", "greedy"} <= set(names)
    assert callable(get_solver("greedy"))
    with pytest.raises(UnknownSolverError, match="unknown solver 'magic'; choose one of: .*greedy"):
        get_solver("magic")


def test_none_keeps_the_unplanned_peak():
    plan = solve(pyramid(), "100%", "none", FAST)
    assert plan.decisions == () and plan.predicted_peak_bytes == 400 * MB and plan.predicted_stall_s == 0
    assert plan.stats.status == "BASELINE" and plan.budget_bytes == 400 * MB


def test_all_baseline_moves_everything_and_saves_nothing():
    # Waiting at the end of forward and prefetching at the start of backward leaves no op without the tensor.
    plan = solve(pyramid(), "50%", "all", SLOW)
    assert {d.name for d in plan.decisions} == {"t0", "t1", "t2"}
    assert all(d.wait_before_idx == 4 and d.prefetch_before_idx == 4 for d in plan.decisions)
    assert plan.predicted_peak_bytes == 400 * MB and plan.stats.status == "INFEASIBLE"
    # 300 MB written at 1 GB/s before backward starts (0.3 s), then reads of 0.2 s each in FIFO order.
    assert plan.predicted_stall_s > 0.3


@pytest.mark.parametrize(
    ("budget", "moved_mb", "peak_mb"),
    [
        ("100%", 0, 400),  # nothing over budget: nothing moves
        ("300MB", 100, 300),  # ops 3 and 4 are 100 MB over: one tensor (t0 or t1) is the optimum
        ("75%", 100, 300),
        ("250MB", 200, 200),  # op 2 is only fixable by t0, op 3 needs t0 and t1: 200 MB
        ("200MB", 200, 200),  # the smallest achievable peak, still stall-free on fast hardware
    ],
)
def test_greedy_hand_optimal_when_io_hides(budget, moved_mb, peak_mb):
    p = pyramid()
    plan = solve(p, budget, "greedy", FAST)
    assert plan.moved_bytes == moved_mb * MB
    assert plan.predicted_peak_bytes == peak_mb * MB
    assert plan.predicted_stall_s == 0
    assert plan.predicted_step_s == pytest.approx(0.008)  # 8 ops of 1 ms, no interference
    assert simulate(p, plan).ok


def test_budget_below_the_floor_names_the_smallest_peak():
    with pytest.raises(BudgetError, match=r"smallest achievable peak is 191 MiB \(200000000 bytes\)"):
        solve(pyramid(), "199MB", "greedy", FAST)
    with pytest.raises(BudgetError, match="does not parse"):
        solve(pyramid(), "lots", "greedy", FAST)


def test_greedy_io_bound_accepts_stall_but_meets_the_budget():
    p = pyramid()
    plan = solve(p, "200MB", "greedy", SLOW)
    assert plan.predicted_peak_bytes <= 200 * MB and plan.predicted_stall_s > 0
    assert plan.stats.extra["repairs"] >= 1  # phase 1 alone cannot place anything stall-free here
    all_plan = solve(p, "200MB", "all", SLOW)
    assert plan.predicted_step_s < all_plan.predicted_step_s
    assert simulate(p, plan).ok


@pytest.mark.parametrize("budget", ["50%", "30%"])
def test_greedy_repairs_grow_linearly_with_the_layers(budget):
    # Counted, not timed. I/O-bound, nothing hides, so greedy's repair pass does most of the work: at
    # most two repairs per candidate (one per pass), so doubling the layers about doubles them. (Worst op
    # first, they had grown with the square of the layers: 1,115 -> 3,905 at 50%, 2,786 -> 13,571 at 30%.)
    io_bound = HardwareModel().with_overrides("ssd", write_bw_bytes_per_s=0.3e9, read_bw_bytes_per_s=0.2e9)
    repairs = {}
    for layers in (24, 48):
        profile = synth_profile(layers=layers)
        lt = analyse(profile)
        plan = solve(profile, budget, "greedy", io_bound, lifetimes=lt)
        repairs[layers] = plan.stats.extra["repairs"]
        assert 0 < repairs[layers] <= 2 * len(lt.candidates)
        assert plan.predicted_peak_bytes <= plan.budget_bytes
    assert repairs[48] <= 2.5 * repairs[24], repairs


def test_auto_finds_the_smallest_stall_free_peak():
    p = pyramid()
    fast = solve(p, "auto", "greedy", FAST)
    assert fast.predicted_peak_bytes == 200 * MB and fast.predicted_stall_s == 0
    assert fast.budget_bytes == 200 * MB and fast.budget_spec == "auto"
    # Slow hardware: no move hides behind 1 ms ops, so the smallest stall-free peak is the unplanned one.
    slow = solve(p, "auto", "greedy", SLOW)
    assert slow.predicted_peak_bytes == 400 * MB and slow.decisions == ()


def test_auto_with_long_ops_by_hand():
    # Ops of 150 ms; a 100 MB write takes 0.1 s, a read 0.2 s (more than one op), reads share one FIFO queue.
    # t0 can hide away over ops 2..4 (read issued at op5 = 0.75 s, done 0.95 s < op7 at 1.05 s) and t1
    # over op3 (read at op4, done 0.80 s, needed at op6 = 0.90 s), but keeping t1 away at op4 or t2 away
    # at all stalls (a read issued at op5 is late for op6), so op4 stays at 300 MB: the smallest
    # stall-free peak is 300 MB, reached by moving t0 alone.
    p = pyramid(duration_us=150_000.0)
    plan = solve(p, "auto", "greedy", SLOW)
    assert plan.predicted_stall_s == 0 and plan.predicted_peak_bytes == 300 * MB
    assert [d.name for d in plan.decisions] == ["t0"]
    tighter = solve(p, "250MB", "greedy", SLOW)
    assert tighter.predicted_peak_bytes <= 250 * MB and tighter.predicted_stall_s > 0


def test_tier_choice_host_when_it_has_room():
    # 20 ms ops: the host tier (10 ms per 100 MB) hides a move, the SSD (0.1 s write) does not.
    hw = SLOW.with_overrides("host", capacity_bytes=10**12)
    plan = solve(pyramid(duration_us=20_000.0), "300MB", "greedy", hw)
    assert [d.tier for d in plan.decisions] == ["host"] and plan.predicted_stall_s == 0
    plan_small_host = solve(
        pyramid(), "200MB", "greedy", SLOW.with_overrides("host", capacity_bytes=100 * MB)
    )
    assert simulate(pyramid(), plan_small_host).tier_peak_bytes.get("host", 0) <= 100 * MB


def test_make_plan_rejects_rule_breaking_decisions():
    p = pyramid()
    lt = analyse(p)
    # Over the budget too: that alone is no bug, so only the broken rule is in the error.
    problem = Problem(profile=p, lifetimes=lt, hardware=FAST, budget_bytes=100 * MB, budget_spec="100MB")
    bad = lt.decision("t0", wait_before_idx=1)
    with pytest.raises(SolverBugError) as e:
        make_plan(problem, [bad], SolverStats(solver="x", status="HEURISTIC"))
    assert [(v.kind, v.tensor) for v in e.value.violations] == [("used_while_away", "t0")]


def test_register_a_solver_and_infeasible_result_is_an_error():
    @register_solver("test-lazy")
    def lazy(problem: Problem) -> Plan:
        return make_plan(problem, [], SolverStats(solver="test-lazy", status="HEURISTIC"))

    try:
        assert "test-lazy" in solver_names()
        with pytest.raises(BudgetError, match="solver 'test-lazy' found no plan within"):
            solve(pyramid(), "300MB", "test-lazy", FAST)
        # auto via bisection: the lazy solver never moves anything, so the unplanned peak is the answer.
        assert solve(pyramid(), "auto", "test-lazy", FAST).predicted_peak_bytes == 400 * MB
    finally:
        from teraio.planner import solve as solve_mod

        solve_mod._REGISTRY.pop("test-lazy")


def test_auto_by_bisection_shares_one_time_limit_across_its_rounds():
    # "auto" for a solver that cannot search budgets itself bisects: the user's time limit (and the
    # deterministic one) bound the whole search, not each of its ~10 rounds.
    seen: list[tuple[float, float | None]] = []

    @register_solver("test-timed")
    def timed(problem: Problem) -> Plan:
        seen.append((problem.time_limit_s, problem.deterministic_time_s))
        return make_plan(problem, [], SolverStats(solver="test-timed", status="HEURISTIC"))

    try:
        solve(pyramid(), "auto", "test-timed", FAST, time_limit_s=10, deterministic_time_s=2)
    finally:
        from teraio.planner import solve as solve_mod

        solve_mod._REGISTRY.pop("test-timed")
    assert len(seen) > 3
    # Each round gets a share of what is left; rounds that return at once leave the rest to the next.
    assert all(limit <= 10 for limit, _ in seen) and seen[0][0] < 10 / 3
    assert sum(det for _, det in seen) <= 2 + 1e-9


def test_progress_is_reported():
    seen = []
    solve(pyramid(), "auto", "greedy", FAST, progress=lambda f, m: seen.append((f, m)))
    assert seen and seen[-1][0] == 1.0 and all(0 <= f <= 1 for f, _ in seen)


def test_one_long_forward_op_cannot_hide_anything():
    # The only long op is in forward, and a wait sits between ops: the write of `a` (0.1 s) cannot finish
    # before op1 or op2 start, so `a` could only be away from op3 on, whose read then stalls. `b` is idle
    # over op2 alone, which its write would have to precede. So "auto" moves nothing.
    ops = ops_rows([1000.0, 1000.0, 300_000.0, 1000.0, 1000.0], 3)
    p = make_profile(ops, [act("a", 100 * MB, 0, 0, 4), act("b", 50 * MB, 1, 1, 3)], {"fingerprint": "g"})
    plan = solve(p, "auto", "greedy", SLOW)
    assert plan.decisions == () and plan.predicted_peak_bytes == analyse(p).baseline_peak_bytes
    assert solve(p, "100MB", "greedy", SLOW).predicted_peak_bytes == 100 * MB
