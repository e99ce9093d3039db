"""What a plan means for the machine (planner/whatif.py): fraction of ideal, bytes moved, and the SSD
bandwidth that hides a plan's I/O, each checked against the simulator that judges every plan."""

from __future__ import annotations

import pytest

from teraio.planner.hardware import HardwareModel
from teraio.planner.lifetimes import analyse
from teraio.planner.simulate import simulate_decisions
from teraio.planner.solve import solve
from teraio.planner.synth import synth_profile
from teraio.planner.whatif import (
    HIDDEN_STALL_SHARE,
    _with_ssd_bandwidth,
    ideal_step_s,
    needed_ssd_bandwidth,
    plan_outcomes,
)

# A slow disk: at 40% the plan stalls, so the bandwidth that hides it lies above the model's.
SLOW = HardwareModel().with_overrides(
    "ssd", write_bw_bytes_per_s=0.2e9, read_bw_bytes_per_s=0.15e9, cpu_s_per_byte=0.0
)


@pytest.fixture(scope="module")
def profile():
    return synth_profile(layers=4, hidden=256, seq=256, batch=4, recompute=False)


def test_ideal_is_compute_only(profile):
    assert ideal_step_s(profile) == pytest.approx(profile.ops["duration_us"].sum() / 1e6)


def test_needed_bandwidth_is_where_the_stall_disappears(profile):
    lt = analyse(profile)
    ideal = ideal_step_s(profile, lt)
    plan = solve(profile, "40%", "greedy", SLOW)
    assert plan.predicted_stall_s > HIDDEN_STALL_SHARE * ideal  # the slow disk does stall
    need = needed_ssd_bandwidth(plan, lt, ideal)
    assert need is not None and need > SLOW.tier("ssd").total_write_bw_bytes_per_s

    def stall(bw: float) -> float:
        return simulate_decisions(lt, list(plan.decisions), _with_ssd_bandwidth(plan.hardware, bw)).stall_s

    assert stall(need) <= HIDDEN_STALL_SHARE * ideal
    assert stall(need * 0.97) > HIDDEN_STALL_SHARE * ideal  # the smallest such bandwidth, within 3%


def test_a_plan_that_moves_nothing_needs_no_bandwidth(profile):
    plan = solve(profile, "100%", "greedy", SLOW)
    assert not plan.offloads
    assert needed_ssd_bandwidth(plan, analyse(profile), ideal_step_s(profile)) == 0.0


def test_outcomes_per_solver(profile):
    out = plan_outcomes(profile, SLOW, "40%", ("greedy", "pipeline"), time_limit_s=10)
    assert [o.solver for o in out] == ["greedy", "pipeline"]
    for o in out:
        assert o.plan is not None and 0 < o.fraction_of_ideal <= 1
        s = o.summary()
        assert s["planned_peak_bytes"] <= s["budget_bytes"] < s["unplanned_peak_bytes"]
        assert s["activation_written_bytes"] == o.plan.moved_bytes
        assert s["fraction_of_ideal"] == pytest.approx(s["ideal_step_s"] / s["step_s"])


def test_a_budget_one_solver_cannot_meet_is_an_outcome_not_an_error(profile):
    floor = analyse(profile).min_feasible_peak_bytes
    out = plan_outcomes(profile, SLOW, floor - 1, ("greedy",), bandwidth=False)
    assert out[0].plan is None and out[0].status == "NO_PLAN"
    assert "smallest achievable peak" in out[0].error
    assert out[0].summary()["error"] == out[0].error
