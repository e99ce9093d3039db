"""Note: [An offloaded tensor leaves a token] in planner.lifetimes: what each offload's tokens hold is in
the plan's figures, and the budget holds with them."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from teraio.planner.budget import BudgetError
from teraio.planner.lifetimes import analyse
from teraio.planner.plan import Plan, SolverStats
from teraio.planner.profile import ProfileError, make_profile
from teraio.planner.simulate import simulate
from teraio.planner.solve import solve
from tests.planner.planner_cases import MB, act, ops_rows, pyramid, ssd_only

TOKEN = 8
FAST = ssd_only(write_bw=1e12, read_bw=1e12)


def _with_tokens(profile, token_bytes: int = TOKEN):
    return make_profile(profile.ops, profile.tensors, {**profile.meta, "offload_token_bytes": token_bytes})


def test_a_token_lives_from_the_op_after_the_offload_to_the_fetch():
    p = _with_tokens(pyramid())
    lt = analyse(p)
    # t0: offloaded after op 0, away over [2, 5), fetched before op 7 (its first backward use).
    d = lt.decision("t0", offload_after_idx=0, wait_before_idx=2, prefetch_before_idx=5)
    plan = Plan(
        fingerprint=p.fingerprint,
        budget_bytes=10**12,
        budget_spec="",
        hardware=FAST,
        stats=SolverStats(solver="hand", status="HEURISTIC"),
        decisions=(d,),
        baseline_peak_bytes=lt.baseline_peak_bytes,
        predicted_peak_bytes=0,
        predicted_step_s=0.0,
        predicted_stall_s=0.0,
        compute_s=0.0,
    )
    r = simulate(p, plan)
    untokened = lt.memory_with([d])
    assert (r.memory_bytes - untokened).tolist() == [0, TOKEN, TOKEN, TOKEN, TOKEN, TOKEN, TOKEN, 0]
    assert r.peak_bytes == 300 * MB + TOKEN and r.peak_idx == 3


def test_a_recomputed_tensor_holds_no_token():
    lt = analyse(_with_tokens(pyramid()))
    d = lt.decision("t0", offload_after_idx=0, wait_before_idx=2, prefetch_before_idx=5)
    assert lt.token_bytes_with([d]).max() == TOKEN
    assert not lt.token_bytes_with([dataclasses.replace(d, action="recompute")]).any()


def test_the_budget_holds_with_the_tokens_and_the_floor_names_their_room():
    p = _with_tokens(pyramid())
    lt = analyse(p)
    reserve = TOKEN * (len(lt.candidates) + 1)
    assert (
        lt.token_reserve_bytes == reserve and lt.smallest_peak_bytes == lt.min_feasible_peak_bytes + reserve
    )
    # The floor without the tokens' room is refused, naming the floor with it.
    with pytest.raises(BudgetError, match=rf"\({lt.min_feasible_peak_bytes + reserve} bytes\)"):
        solve(p, lt.min_feasible_peak_bytes, "greedy", FAST)
    for solver in ("greedy", "ilp", "pipeline"):
        plan = solve(p, lt.smallest_peak_bytes, solver, FAST, deterministic_time_s=5.0, workers=1)
        tokened = lt.memory_with(plan.decisions, tokens=True)
        assert plan.budget_bytes == lt.smallest_peak_bytes
        assert plan.predicted_peak_bytes == int(tokened.max()) <= plan.budget_bytes, solver
        assert plan.decisions and lt.token_bytes_with(plan.decisions).max() > 0, solver
        assert simulate(p, plan).ok, solver


def test_without_the_meta_key_nothing_changes():
    p = pyramid()
    lt = analyse(p)
    assert lt.token_bytes == 0 and lt.token_reserve_bytes == 0
    plan = solve(p, "200MB", "greedy", FAST)
    assert plan.predicted_peak_bytes == int(np.max(lt.memory_with(plan.decisions)))


@pytest.mark.parametrize("bad", [-8, 8.0, "8", True])
def test_a_bad_token_size_is_refused(bad):
    p = pyramid()
    with pytest.raises(ProfileError, match="offload_token_bytes"):
        make_profile(p.ops, p.tensors, {**p.meta, "offload_token_bytes": bad})


def test_a_profile_keeps_its_token_size_through_save_and_load(tmp_path):
    p = _with_tokens(make_profile(ops_rows([1000.0] * 4, 2), [act("x", MB, 0, 0, 3)], {"fingerprint": "t"}))
    p.save(tmp_path / "p")
    assert analyse(type(p).load(tmp_path / "p")).token_bytes == TOKEN


def test_a_budget_the_unplanned_step_meets_needs_no_room_for_tokens():
    p = _with_tokens(pyramid())
    lt = analyse(p)
    plan = solve(p, lt.baseline_peak_bytes, "greedy", FAST)
    assert not plan.decisions and plan.predicted_peak_bytes == plan.budget_bytes == lt.baseline_peak_bytes
    # A graph whose movable tensors cannot lower its peak: its smallest peak is its unplanned one.
    flat = _with_tokens(
        make_profile(ops_rows([1000.0] * 4, 2), [act("x", MB, 0, 0, 3)], {"fingerprint": "f"})
    )
    assert analyse(flat).smallest_peak_bytes == analyse(flat).baseline_peak_bytes
