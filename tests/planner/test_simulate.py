"""The simulator on hand-computed timelines, and every rule it must catch."""

from __future__ import annotations

import dataclasses

import pytest

from teraio.planner.hardware import TierModel
from teraio.planner.lifetimes import analyse
from teraio.planner.plan import Plan, PlanError, SolverStats
from teraio.planner.profile import ProfileError, make_profile
from teraio.planner.simulate import simulate, simulate_decisions
from tests.planner.planner_cases import MB, act, ops_rows, pyramid, ssd_only


def _plan(profile, decisions, hw, budget=10**12):
    lt = analyse(profile)
    return Plan(
        fingerprint=profile.fingerprint,
        budget_bytes=budget,
        budget_spec=str(budget),
        hardware=hw,
        stats=SolverStats(solver="hand", status="HEURISTIC"),
        decisions=tuple(decisions),
        baseline_peak_bytes=lt.baseline_peak_bytes,
        predicted_peak_bytes=0,
        predicted_step_s=0.0,
        predicted_stall_s=0.0,
        compute_s=0.0,
    )


def test_one_tensor_timeline_by_hand():
    # Ops take 1 ms. t0 (100 MB): write 0.1 s issued when op0 ends, waited before op2; read 0.2 s
    # issued before op5, fetched before op7.
    p = pyramid()
    lt = analyse(p)
    d = lt.decision("t0", offload_after_idx=0, wait_before_idx=2, prefetch_before_idx=5)
    r = simulate(p, _plan(p, [d], ssd_only(write_bw=1e9, read_bw=0.5e9)))
    assert r.violations == []
    assert r.stall_s_per_op.round(9).tolist() == [0, 0, 0.099, 0, 0, 0, 0, 0.198]
    assert r.step_s == pytest.approx(0.305, abs=1e-12)
    assert r.stall_s == pytest.approx(0.297, abs=1e-12)
    assert r.compute_s == pytest.approx(0.008) and r.interference_s == 0
    assert (r.memory_bytes // MB).tolist() == [100, 200, 200, 300, 300, 300, 200, 100]
    assert r.peak_bytes == 300 * MB and r.peak_idx == 3
    io = r.io_timeline.set_index("direction")
    assert io.loc["write", ["issue_s", "start_s", "end_s"]].tolist() == pytest.approx([0.001, 0.001, 0.101])
    assert io.loc["read", ["issue_s", "start_s", "end_s"]].tolist() == pytest.approx([0.104, 0.104, 0.304])
    assert io.loc["read", "issue_idx"] == 5 and io.loc["write", "issue_idx"] == 0
    assert r.written_bytes == r.read_bytes == 100 * MB
    assert r.ssd_tb_written_per_day == pytest.approx(100 * MB / 0.305 * 86400 / 1e12)


def test_fifo_queue_two_writes_and_striping_and_latency():
    p = pyramid()
    lt = analyse(p)
    d0 = lt.decision("t0", offload_after_idx=0, wait_before_idx=2, prefetch_before_idx=5)
    d1 = lt.decision("t1", offload_after_idx=1, wait_before_idx=3, prefetch_before_idx=4)
    # One device, 1 GB/s each way: t1's write (issued at 2 ms... but op2 stalls first) queues behind t0's.
    r = simulate(p, _plan(p, [d0, d1], ssd_only(write_bw=1e9, read_bw=1e9)))
    w = r.io_timeline[r.io_timeline.direction == "write"].set_index("name")
    assert w.loc["t0", "end_s"] == pytest.approx(0.101)
    assert w.loc["t1", ["issue_s", "start_s", "end_s"]].tolist() == pytest.approx([0.002, 0.101, 0.201])
    # Two striped devices with 1 ms latency: each transfer takes 1 ms + 0.05 s.
    r2 = simulate(p, _plan(p, [d0, d1], ssd_only(write_bw=1e9, read_bw=1e9, count=2, latency_s=1e-3)))
    dur = (r2.io_timeline.end_s - r2.io_timeline.start_s).tolist()
    assert dur == pytest.approx([0.051] * 4)


def test_shared_channel_cannot_matter_within_a_step():
    # Every write is waited by the end of forward and every read is issued in backward, so reads and
    # writes never overlap: sharing one channel must give the same timeline.
    p = pyramid()
    lt = analyse(p)
    ds = [
        lt.decision("t0", wait_before_idx=4, prefetch_before_idx=4),
        lt.decision("t1", prefetch_before_idx=4),
    ]
    a = simulate(p, _plan(p, ds, ssd_only(shared=False)))
    b = simulate(p, _plan(p, ds, ssd_only(shared=True)))
    assert a.io_timeline.equals(b.io_timeline) and a.step_s == b.step_s


def test_cpu_interference_charged_to_overlapping_ops():
    # A 2 MB write at 1 GB/s takes 2 ms from the end of op0 (1 ms) to 3 ms and costs 2e6 * 1e-10 = 0.2 ms
    # of compute: op1 overlaps 1 of its 2 ms (0.1 ms charged, op1 ends at 2.1 ms), op2's nominal window
    # 2.1..3.1 ms overlaps 0.9 ms (0.09 ms charged).
    p = make_profile(ops_rows([1000.0] * 6, 3), [act("x", 2 * MB, 0, 0, 5)], {"fingerprint": "i"})
    lt = analyse(p)
    d = lt.decision("x", wait_before_idx=3, prefetch_before_idx=5)
    hw = ssd_only(write_bw=1e9, read_bw=1e12, cpu_s_per_byte=1e-10)
    r = simulate(p, _plan(p, [d], hw))
    assert r.violations == []
    assert r.interference_s == pytest.approx(1.9e-4)  # the read runs while op5 waits for it: free
    assert r.step_s == pytest.approx(r.compute_s + r.stall_s + r.interference_s)
    assert r.op_end_s[1] == pytest.approx(2.1e-3)


def test_migration_calls_cost_the_compute_thread_where_the_graph_makes_them():
    """``cpu_s_per_transfer``: the offload call runs after op0 and delays op1 and the write's start;
    the prefetch call runs before op5 and delays the read's start and op5, never counted as stall."""
    p = make_profile(ops_rows([1000.0] * 6, 3), [act("x", 2 * MB, 0, 0, 5)], {"fingerprint": "c"})
    lt = analyse(p)
    d = lt.decision("x", wait_before_idx=3, prefetch_before_idx=5)
    base = simulate(p, _plan(p, [d], ssd_only(write_bw=1e12, read_bw=1e12)))
    r = simulate(p, _plan(p, [d], ssd_only(write_bw=1e12, read_bw=1e12, cpu_s_per_transfer=3e-4)))
    assert r.violations == [] and r.stall_s == pytest.approx(base.stall_s, abs=1e-12)
    assert r.step_s == pytest.approx(base.step_s + 2 * 3e-4)
    assert r.interference_s == pytest.approx(6e-4)
    assert r.op_end_s[0] == pytest.approx(1.3e-3)  # op0 ends with its offload call
    io = r.io_timeline.set_index("direction")
    assert io.loc["write", "issue_s"] == pytest.approx(1.3e-3)
    assert io.loc["read", "issue_s"] == pytest.approx(5.6e-3)  # op4 ended at 5.3 ms, then the call


def test_waking_the_io_path_costs_once_per_step_at_the_first_call():
    """``cpu_s_per_step_with_io``: charged once, with the step's first migration call on the tier (the
    first offload, after op0), however many tensors move; never as stall."""
    p = make_profile(
        ops_rows([1000.0] * 6, 3),
        [act("x", 2 * MB, 0, 0, 5), act("y", 2 * MB, 1, 1, 5)],
        {"fingerprint": "w"},
    )
    lt = analyse(p)
    ds = [lt.decision(n, wait_before_idx=3, prefetch_before_idx=5) for n in ("x", "y")]
    fast = {"write_bw": 1e12, "read_bw": 1e12, "cpu_s_per_transfer": 1e-4}
    base = simulate(p, _plan(p, ds, ssd_only(**fast)))
    r = simulate(p, _plan(p, ds, ssd_only(**fast, cpu_s_per_step_with_io=5e-4)))
    one = simulate(p, _plan(p, ds[:1], ssd_only(**fast, cpu_s_per_step_with_io=5e-4)))
    assert r.violations == [] and r.stall_s == pytest.approx(base.stall_s, abs=1e-12)
    assert r.step_s == pytest.approx(base.step_s + 5e-4)
    assert r.op_end_s[0] == pytest.approx(base.op_end_s[0] + 5e-4)  # with the first offload call
    one_base = simulate(p, _plan(p, ds[:1], ssd_only(**fast)))
    assert one.step_s == pytest.approx(one_base.step_s + 5e-4)  # the same once, for one tensor as for two


@pytest.mark.parametrize(
    ("kwargs", "kind", "fragment"),
    [
        ({"wait_before_idx": 1}, "used_while_away", "used while away: waited"),
        ({"fetch_before_idx": 7, "name": "t1"}, "used_while_away", "used while away: fetched"),
        ({"prefetch_before_idx": 3}, "phase", "read issued before op 3, a forward op"),
        ({"wait_before_idx": 5}, "phase", "after the end of forward"),
        ({"offload_after_idx": 2, "wait_before_idx": 2}, "order", "not after it is issued"),
        ({"prefetch_before_idx": 7, "fetch_before_idx": 6}, "order", "before its read is issued"),
        ({"tier": "tape"}, "unknown_tier", "tier 'tape' is not in the hardware model"),
        ({"tier": "host"}, "tier_unavailable", "unavailable"),
        ({"nbytes": 5}, "nbytes", "nbytes 5 in the plan"),
        ({"wait_before_name": "conv"}, "name_mismatch", "names op 'conv'"),
        ({"name": "t3"}, "not_candidate", "not an offload candidate"),
        ({"name": "ghost"}, "unknown_tensor", "no such tensor"),
        ({"fetch_before_idx": 99}, "index_range", "outside the profile's ops"),
    ],
)
def test_violations(kwargs, kind, fragment):
    p = pyramid()
    lt = analyse(p)
    d = dataclasses.replace(lt.decision("t0"), **kwargs)
    r = simulate(p, _plan(p, [d], ssd_only()))
    # Selected by kind; the message says which rule of that kind (t1 here breaks two "used_while_away").
    of_kind = [v for v in r.violations if v.kind == kind]
    assert {v.tensor for v in of_kind} == {d.name}, r.violations
    assert sum(fragment in v.message for v in of_kind) == 1, r.violations
    assert not [v for v in r.violations if v.kind != kind and fragment in v.message], r.violations
    assert not r.ok


def test_duplicate_budget_and_capacity_violations():
    p = pyramid()
    lt = analyse(p)
    d = lt.decision("t0")
    r = simulate(p, _plan(p, [d, d], ssd_only()), budget_bytes=250 * MB)
    assert [v.kind for v in r.violations] == ["duplicate", "budget"] and not r.within_budget
    assert "more than one decision" in r.violations[0].message and "exceeds the budget" in str(
        r.violations[1]
    )
    hw = ssd_only().with_overrides("host", capacity_bytes=150 * MB)
    ds = [lt.decision("t0", tier="host"), lt.decision("t1", tier="host")]
    r = simulate_decisions(lt, ds, hw)
    assert r.tier_peak_bytes == {"host": 200 * MB}
    assert [(v.kind, v.tensor) for v in r.violations] == [("capacity", "")]
    assert "over its capacity" in r.violations[0].message
    assert r.ssd_tb_written_per_day == 0.0 and r.written_bytes == 200 * MB


def test_read_before_write_completes_is_caught():
    # The wait sits after the prefetch (itself a rule break): the read starts before the write is done.
    p = pyramid()
    lt = analyse(p)
    d = dataclasses.replace(lt.decision("t0", offload_after_idx=3, wait_before_idx=4, prefetch_before_idx=4))
    d = dataclasses.replace(d, wait_before_idx=6, wait_before_name="op6")
    r = simulate(p, _plan(p, [d], ssd_only()))
    assert ("read_before_write", "t0") in [(v.kind, v.tensor) for v in r.violations]


def test_plan_for_another_profile_is_refused():
    p = pyramid()
    with pytest.raises(PlanError, match="re-plan"):
        simulate(pyramid(fingerprint="other"), _plan(p, [], ssd_only()))


def test_what_if_hardware_and_budget():
    p = pyramid()
    lt = analyse(p)
    plan = _plan(
        p,
        [lt.decision("t0", offload_after_idx=0, wait_before_idx=2, prefetch_before_idx=5)],
        ssd_only(write_bw=1e9, read_bw=0.5e9),
        budget=300 * MB,
    )
    slow = simulate(p, plan)
    fast = simulate(p, plan, plan.hardware.with_overrides("ssd", count=4))
    assert fast.stall_s < slow.stall_s and slow.ok
    assert simulate(p, plan, budget_bytes=250 * MB).violations
    tier = TierModel(write_bw_bytes_per_s=1e12, read_bw_bytes_per_s=1e12)
    assert simulate(p, plan, dataclasses.replace(plan.hardware, tiers={"ssd": tier})).stall_s == 0


def test_read_rank_orders_reads_issued_together():
    # t0 and t1 are both prefetched before op 4 (at 4 ms; 1 GB/s: 0.1 s each). t1 is needed first (op 6),
    # t0 at op 7. t0 read first: t1 is in at 204 ms, ops 6 and 7 end at 206 ms. t1 first: op 6 runs at
    # 104 ms, t0 is in at 204 ms, op 7 ends at 205 ms.
    p = pyramid()
    lt = analyse(p)
    d0 = lt.decision("t0", prefetch_before_idx=4)
    d1 = lt.decision("t1", prefetch_before_idx=4)
    hw = ssd_only(write_bw=1e12, read_bw=1e9)
    t0_first = simulate(
        p, _plan(p, [dataclasses.replace(d0, read_rank=0), dataclasses.replace(d1, read_rank=1)], hw)
    )
    t1_first = simulate(
        p, _plan(p, [dataclasses.replace(d0, read_rank=1), dataclasses.replace(d1, read_rank=0)], hw)
    )
    reads = t1_first.io_timeline[t1_first.io_timeline.direction == "read"].set_index("name")
    assert reads.loc["t1", "start_s"] < reads.loc["t0", "start_s"]
    assert (t0_first.step_s, t1_first.step_s) == pytest.approx((0.206, 0.205), abs=1e-9)
    assert t0_first.violations == [] and t1_first.violations == []


def test_ranks_against_issue_positions_are_a_violation():
    p = pyramid()
    lt = analyse(p)
    d0 = dataclasses.replace(lt.decision("t0", offload_after_idx=0), write_rank=1)
    d1 = dataclasses.replace(lt.decision("t1", offload_after_idx=1), write_rank=0)
    r = simulate(p, _plan(p, [d0, d1], ssd_only()))
    assert [(v.kind, v.tensor) for v in r.violations] == [("queue_order", "t0")]


def test_schema_1_plans_load_with_the_ranks_their_order_implied():
    p = pyramid()
    lt = analyse(p)
    plan = _plan(
        p, [lt.decision("t1", prefetch_before_idx=4), lt.decision("t0", prefetch_before_idx=4)], ssd_only()
    )
    old = plan.to_dict()
    old["schema_version"] = 1
    for d in old["decisions"]:
        del d["write_rank"], d["read_rank"], d["action"], d["recompute_us"]
    loaded = Plan.from_dict(old)
    assert loaded.schema_version == 3
    assert [(d.name, d.read_rank) for d in loaded.decisions] == [("t1", 0), ("t0", 1)]
    assert simulate(p, loaded).step_s == simulate(p, plan).step_s
    old["schema_version"] = 0
    with pytest.raises(PlanError, match="schema_version 0 is not supported"):
        Plan.from_dict(old)


def _with_outside(profile, outside_s):
    return make_profile(profile.ops, profile.tensors, {**profile.meta, "outside_s": outside_s})


def test_time_outside_the_graphs_is_compute_at_the_forward_backward_boundary():
    """Note: [Time outside the graphs]: the profile's ``outside_s`` lengthens the step by itself and
    sits between forward and backward, where a write still in flight overlaps it."""
    p0 = pyramid()
    p = _with_outside(p0, 0.2)
    assert p.ops["duration_us"].tolist() == p0.ops["duration_us"].tolist()  # the ops table stays pure
    lt0, lt = analyse(p0), analyse(p)
    assert lt.compute_s == pytest.approx(lt0.compute_s + 0.2)
    assert lt.op_start_us[3] == lt0.op_start_us[3]  # the last forward op starts as before ...
    assert lt.op_start_us[4] == pytest.approx(lt0.op_start_us[4] + 0.2e6)  # ... and ends 0.2 s later
    hw = ssd_only(write_bw=1e9, read_bw=0.5e9)
    # t0's write (0.1 s from the end of op0) is waited for at the end of forward.
    steps = []
    for prof, lts in ((p0, lt0), (p, lt)):
        d = lts.decision("t0", offload_after_idx=0, wait_before_idx=4, prefetch_before_idx=5)
        r = simulate(prof, _plan(prof, [d], hw))
        assert r.violations == []
        steps.append(r)
    assert steps[0].stall_s_per_op[4] == pytest.approx(0.097)
    assert steps[1].stall_s_per_op[4] == 0  # hidden behind the time outside the graphs
    assert steps[1].compute_s == pytest.approx(steps[0].compute_s + 0.2)


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), "1 ms", True, None])
def test_a_bad_outside_time_is_refused(bad):
    with pytest.raises(ProfileError, match="outside_s"):
        _with_outside(pyramid(), bad)
