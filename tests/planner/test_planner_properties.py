"""Properties over random steps: plans stay within budget or the solver says it cannot, no tensor is used
while away or read before its write completes, and the simulator agrees with the lifetime analysis and
with a naive per-op recount straight from the profile's rows."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from teraio.planner.budget import BudgetError
from teraio.planner.hardware import HardwareModel, TierModel
from teraio.planner.lifetimes import analyse
from teraio.planner.plan import Plan
from teraio.planner.profile import make_profile
from teraio.planner.simulate import STALL_TOLERANCE_S, simulate
from teraio.planner.solve import solve
from tests.planner.planner_cases import ops_rows

SOLVERS = ("none", "all", "greedy", "pipeline")
#: The heuristics, which must meet any budget at or above the smallest achievable peak.
HEURISTICS = ("greedy", "pipeline")


@st.composite
def steps(draw):
    nf = draw(st.integers(2, 9))
    nb = draw(st.integers(1, 9))
    n = nf + nb
    durations = draw(st.lists(st.floats(50.0, 50_000.0), min_size=n, max_size=n))
    other = draw(st.lists(st.integers(0, 5 * 10**6), min_size=n, max_size=n))
    tensors = []
    for k in range(draw(st.integers(0, 12))):
        kind = draw(st.sampled_from(["activation", "activation", "activation", "param"]))
        nbytes = draw(st.integers(0, 50 * 10**6))
        if kind == "param":
            row = {
                "producer_idx": -1,
                "last_fwd_use_idx": 0,
                "first_bwd_use_idx": -1,
                "last_use_idx": n - 1,
                "offloadable": False,
            }
        else:
            prod = draw(st.integers(0, nf - 1))
            last_fwd = draw(st.integers(prod, nf - 1))
            if draw(st.integers(0, 5)):
                first_bwd = draw(st.integers(nf, n - 1))
                last_use = draw(st.integers(first_bwd, n - 1))
            else:  # never read by backward: dies in forward
                first_bwd, last_use = -1, last_fwd
            row = {
                "producer_idx": prod,
                "last_fwd_use_idx": last_fwd,
                "first_bwd_use_idx": first_bwd,
                "last_use_idx": last_use,
                "offloadable": draw(st.booleans()) or nbytes > 10**6,
            }
        tensors.append(
            {
                "name": f"t{k}",
                "nbytes": nbytes,
                "dtype": "float32",
                "shape": (1,),
                "kind": kind,
                "module": f"m{k % 3}",
                **row,
            }
        )
    profile = make_profile(ops_rows(durations, nf, other_bytes=other), tensors, {"fingerprint": "rand"})
    tier = TierModel(
        write_bw_bytes_per_s=draw(st.floats(1e8, 2e10)),
        read_bw_bytes_per_s=draw(st.floats(1e8, 2e10)),
        write_latency_s=draw(st.sampled_from([0.0, 1e-4])),
        read_latency_s=draw(st.sampled_from([0.0, 1e-4])),
        count=draw(st.integers(1, 3)),
        shared_channel=draw(st.booleans()),
        cpu_s_per_byte=draw(st.sampled_from([0.0, 1e-10])),
    )
    host_cap = draw(st.sampled_from([0, 0, 30 * 10**6, None]))
    hw = HardwareModel(tiers={"ssd": tier, "host": TierModel(4e9, 4e9, capacity_bytes=host_cap)}, name="rand")
    budget = draw(st.sampled_from(["auto", 0.3, 0.5, 0.75, 0.9, 1.0]))
    return profile, hw, budget


def _naive_memory(profile, plan: Plan) -> list[int]:
    """Memory per op recounted from the profile's rows and the plan, one op and one tensor at a time."""
    n = len(profile.ops)
    moved = {d.name: d for d in plan.decisions}
    out = []
    for i in range(n):
        total = int(profile.ops["other_bytes"].iat[i])
        for row in profile.tensors.itertuples():
            if row.kind != "activation":
                continue  # params and inputs predate the step: not the step's memory
            hi = max(row.producer_idx, row.last_fwd_use_idx, row.first_bwd_use_idx, row.last_use_idx)
            alive = row.producer_idx <= i <= hi
            d = moved.get(row.name)
            away = d is not None and d.wait_before_idx <= i < d.prefetch_before_idx
            total += row.nbytes if alive and not away else 0
        out.append(total)
    return out


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps(), st.sampled_from(SOLVERS))
def test_every_plan_is_valid_and_within_budget_or_reported(case, solver):
    profile, hw, budget = case
    lt = analyse(profile)
    try:
        plan = solve(profile, budget, solver, hw, lifetimes=lt)
    except BudgetError as e:
        # Only a budget below the floor may be refused (greedy's repair always reaches any feasible
        # budget, the pipeline's passes meet it by construction).
        assert "cannot be met: the smallest achievable peak" in str(e)  # the floor, not "found no plan"
        assert budget != "auto" and int(budget * lt.baseline_peak_bytes) < lt.min_feasible_peak_bytes
        return
    sim = simulate(profile, plan, lifetimes=lt)
    assert [v for v in sim.violations if v.kind != "budget"] == []
    if solver != "none" and solver != "all":
        assert sim.peak_bytes <= plan.budget_bytes
    elif sim.peak_bytes > plan.budget_bytes:
        assert plan.stats.status == "INFEASIBLE"
    # The plan's figures are the simulator's.
    assert (plan.predicted_peak_bytes, plan.predicted_step_s, plan.predicted_stall_s) == (
        sim.peak_bytes,
        sim.step_s,
        sim.stall_s,
    )
    assert abs(sim.step_s - (sim.compute_s + sim.stall_s + sim.interference_s)) < 1e-9
    assert (sim.stall_s_per_op >= 0).all()  # a rounding error once made a plan's stall -4e-19 s
    # No tensor read before its write completes, none used while away (checked on the timeline itself).
    io = sim.io_timeline.set_index(["name", "direction"])
    for d in plan.decisions:
        c = lt.candidate_of(d.name)
        w_end, r_start, r_end = (
            io.loc[(d.name, "write"), "end_s"],
            io.loc[(d.name, "read"), "start_s"],
            io.loc[(d.name, "read"), "end_s"],
        )
        assert r_start >= w_end - STALL_TOLERANCE_S
        assert sim.op_start_s[d.wait_before_idx] >= w_end - STALL_TOLERANCE_S
        assert sim.op_start_s[d.fetch_before_idx] >= r_end - STALL_TOLERANCE_S
        assert c.last_fwd_use_idx < d.wait_before_idx <= lt.num_fwd_ops <= d.prefetch_before_idx
        assert d.prefetch_before_idx <= d.fetch_before_idx <= c.first_bwd_use_idx
    assert sim.memory_bytes.tolist() == _naive_memory(profile, plan)
    if solver == "none":
        assert sim.peak_bytes == lt.baseline_peak_bytes and sim.stall_s == 0
    if budget == "auto" and solver in HEURISTICS:
        assert sim.stall_s <= STALL_TOLERANCE_S
    # JSON round trip keeps every field.
    assert Plan.from_dict(plan.to_dict()) == plan


@settings(max_examples=100, deadline=None)
@given(steps(), st.floats(0.0, 1.0), st.sampled_from(HEURISTICS))
def test_heuristics_meet_any_budget_at_or_above_the_floor(case, frac, solver):
    profile, hw, _ = case
    lt = analyse(profile)
    # The floor itself half the time (the hardest budget), else anywhere up to the unplanned peak.
    frac = 0.0 if frac < 0.5 else 2 * (frac - 0.5)
    floor = max(lt.min_feasible_peak_bytes, 1)
    budget = floor + int(frac * max(lt.baseline_peak_bytes - floor, 0))
    plan = solve(profile, budget, solver, hw, lifetimes=lt)
    assert plan.predicted_peak_bytes <= budget
    assert simulate(profile, plan, lifetimes=lt).broken_rules() == []
