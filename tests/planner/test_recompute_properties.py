"""Properties with recompute, over random small synthetic profiles and random hand-made steps with random
rebuild chains: every solver's plan in every recompute mode it plans is valid, within its budget when it
says so, never uses a tensor while it is away or before it is rebuilt, has the simulator's figures, and
its step is at least the raw analytic lower bound; ``ilp`` joint is never worse than ``ilp`` offload only
or recompute only."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from teraio.planner.bounds import step_lower_bound
from teraio.planner.budget import BudgetError
from teraio.planner.hardware import HardwareModel, TierModel
from teraio.planner.lifetimes import analyse
from teraio.planner.plan import Plan
from teraio.planner.profile import make_profile
from teraio.planner.simulate import STALL_TOLERANCE_S, simulate
from teraio.planner.solve import solve, solver_info
from teraio.planner.synth import synth_profile
from tests.planner.planner_cases import ops_rows

MODES = ("off", "only", "joint")
SOLVERS = ("none", "all", "greedy", "pipeline")


@st.composite
def synth_cases(draw):
    """A small synthetic GPT, its rebuild times scaled (cheap to dear), on a random SSD."""
    p = synth_profile(
        layers=draw(st.integers(1, 3)),
        hidden=draw(st.sampled_from([32, 64])),
        seq=draw(st.sampled_from([32, 64, 128])),
        batch=draw(st.sampled_from([1, 2, 4])),
        vocab=draw(st.sampled_from([64, 128])),
        attention=draw(st.sampled_from(["fused", "explicit"])),
    )
    scale = draw(st.sampled_from([0.1, 1.0, 10.0, 100.0]))
    if scale != 1.0:
        t = p.tensors.copy()
        t["recompute_us"] = t["recompute_us"] * scale
        p = make_profile(p.ops, t, {**p.meta, "fingerprint": f"{p.fingerprint}/x{scale}"})
    return p, _hardware(draw), draw(st.sampled_from([0.3, 0.45, 0.6, 0.8, 1.0]))


def _weight_row(num_ops: int) -> dict:
    """A weight ``w`` of 1 MB, resident the whole step, which rebuilds may read."""
    return {
        "name": "w",
        "nbytes": 10**6,
        "dtype": "float32",
        "shape": (1,),
        "kind": "param",
        "offloadable": False,
        "producer_idx": -1,
        "last_fwd_use_idx": 0,
        "first_bwd_use_idx": -1,
        "last_use_idx": num_ops - 1,
        "recompute_us": math.nan,
        "recompute_inputs": (),
        "recompute_peak_bytes": 0,
    }


def _activation_row(
    name: str,
    nbytes: int,
    uses: tuple[int, int, int, int],
    recompute_us: float,
    inputs: tuple[str, ...],
    recompute_peak_bytes: int,
    module: str,
) -> dict:
    """A saved activation; ``uses``: its producer, last forward use, first backward use and last use."""
    prod, last_fwd, first_bwd, last = uses
    return {
        "name": name,
        "nbytes": nbytes,
        "dtype": "float32",
        "shape": (1,),
        "kind": "activation",
        "offloadable": True,
        "producer_idx": prod,
        "last_fwd_use_idx": last_fwd,
        "first_bwd_use_idx": first_bwd,
        "last_use_idx": last,
        "recompute_us": recompute_us,
        "recompute_inputs": inputs,
        "recompute_peak_bytes": recompute_peak_bytes,
        "module": module,
    }


@st.composite
def chain_cases(draw):
    """A random step whose activations rebuild from random earlier rows (chains, params, and rows that die
    in forward, whose lifetimes then extend)."""
    nf = draw(st.integers(2, 7))
    nb = draw(st.integers(2, 7))
    n = nf + nb
    durations = draw(st.lists(st.floats(50.0, 20_000.0), min_size=n, max_size=n))
    other = draw(st.lists(st.integers(0, 3 * 10**6), min_size=n, max_size=n))
    tensors = [_weight_row(n)]
    for k in range(draw(st.integers(1, 8))):
        prod = draw(st.integers(0, nf - 1))
        last_fwd = draw(st.integers(prod, nf - 1))
        if draw(st.integers(0, 4)):
            first_bwd = draw(st.integers(nf, n - 1))
            last_use = draw(st.integers(first_bwd, n - 1))
        else:
            first_bwd, last_use = -1, last_fwd
        earlier = [t["name"] for t in tensors]
        inputs = tuple(draw(st.lists(st.sampled_from(earlier), max_size=3, unique=True)))
        tensors.append(
            _activation_row(
                f"t{k}",
                draw(st.integers(10**5, 40 * 10**6)),
                (prod, last_fwd, first_bwd, last_use),
                draw(st.sampled_from([math.nan, 0.0, 100.0, 5_000.0, 200_000.0])),
                inputs,
                draw(st.sampled_from([0, 10**6, 20 * 10**6])),
                f"layers.{k % 2}",
            )
        )
    p = make_profile(ops_rows(durations, nf, other_bytes=other), tensors, {"fingerprint": "chains"})
    return p, _hardware(draw), draw(st.sampled_from([0.3, 0.5, 0.75, 0.9, 1.0]))


def _hardware(draw) -> HardwareModel:
    tier = TierModel(
        write_bw_bytes_per_s=draw(st.sampled_from([5e7, 3e8, 1.3e9, 2e10])),
        read_bw_bytes_per_s=draw(st.sampled_from([5e7, 2e8, 0.8e9, 2e10])),
        write_latency_s=draw(st.sampled_from([0.0, 1e-4])),
        read_latency_s=draw(st.sampled_from([0.0, 1e-4])),
        shared_channel=draw(st.booleans()),
        cpu_s_per_byte=draw(st.sampled_from([0.0, 0.15e-9])),
    )
    host_cap = draw(st.sampled_from([0, 0, None]))
    return HardwareModel(
        tiers={"ssd": tier, "host": TierModel(4e9, 4e9, capacity_bytes=host_cap)}, name="rand"
    )


def _check_plan(profile, lt, plan: Plan, mode: str, solver: str) -> None:
    sim = simulate(profile, plan, lifetimes=lt)
    assert sim.broken_rules() == []
    if not solver_info(solver).baseline:
        assert sim.peak_bytes <= plan.budget_bytes
    assert (plan.predicted_peak_bytes, plan.predicted_step_s) == (sim.peak_bytes, sim.step_s)
    assert sim.step_s == pytest.approx(sim.compute_s + sim.recompute_s + sim.stall_s + sim.interference_s)
    if mode == "off":
        assert not plan.recomputes
    if mode == "only":
        assert not plan.offloads
    # No tensor used while away or before it is rebuilt: on the timeline itself.
    needs = lt.effective_needs(d.name for d in plan.recomputes)
    io = sim.io_timeline.set_index(["name", "direction"])
    for d in plan.decisions:
        c = lt.candidate_of(d.name)
        need = needs.need(d.name, c.first_bwd_use_idx)
        assert c.last_fwd_use_idx < d.wait_before_idx <= lt.num_fwd_ops <= d.prefetch_before_idx
        assert d.prefetch_before_idx <= d.fetch_before_idx <= need <= c.first_bwd_use_idx
        if d.recomputed:
            assert d.fetch_before_idx == need and c.recomputable
            for x in needs.inputs[d.name]:  # every activation it reads is there when it is rebuilt
                xd = plan.decision_for(x)
                assert xd is None or xd.fetch_before_idx <= d.fetch_before_idx
        else:
            assert sim.op_start_s[d.fetch_before_idx] >= io.loc[(d.name, "read"), "end_s"] - STALL_TOLERANCE_S
    # The raw analytic bound (not the one clamped into the stats) is below the simulated step.
    if sim.within_budget:
        raw = step_lower_bound(lt, plan.hardware, plan.budget_bytes, recompute=mode).step_s
        assert raw <= sim.step_s * (1 + 1e-9)
    assert Plan.from_dict(plan.to_dict()) == plan


def _solve_every_way(case, solvers, **kw):
    profile, hw, frac = case
    lt = analyse(profile)
    budget = max(int(frac * lt.baseline_peak_bytes), lt.min_feasible_peak_bytes)
    plans = {}
    for solver in solvers:
        for mode in solver_info(solver).recompute_modes:
            try:
                plan = solve(profile, budget, solver, hw, lifetimes=lt, recompute=mode, **kw.get(solver, {}))
            except BudgetError as e:
                # Only "only" may fail above the offload floor: recomputing cannot take everything away.
                assert mode == "only", str(e)
                continue
            _check_plan(profile, lt, plan, mode, solver)
            plans[solver, mode] = plan
    return plans


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(synth_cases(), chain_cases()))
def test_every_solver_in_every_mode_is_valid_and_above_the_bound(case):
    plans = _solve_every_way(case, SOLVERS)
    # The pipeline's joint plan is never worse than its offload-only and recompute-only plans.
    joint = plans.get(("pipeline", "joint"))
    for mode in ("off", "only"):
        other = plans.get(("pipeline", mode))
        if joint is not None and other is not None:
            assert joint.predicted_step_s <= other.predicted_step_s * (1 + 1e-12)


ILP_KW = {"ilp": {"time_limit_s": 60, "deterministic_time_s": 0.1, "workers": 1}}


def _ilp_joint_never_worse(case):
    plans = _solve_every_way(case, ("ilp",), **ILP_KW)
    joint = plans[("ilp", "joint")]
    for mode in ("off", "only"):
        if ("ilp", mode) in plans:
            assert joint.predicted_step_s <= plans[("ilp", mode)].predicted_step_s * (1 + 1e-12)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chain_cases())
def test_ilp_joint_is_never_worse_than_offload_only_or_recompute_only(case):
    _ilp_joint_never_worse(case)


@pytest.mark.expensive
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(synth_cases(), chain_cases()))
def test_ilp_joint_is_never_worse_many(case):
    _ilp_joint_never_worse(case)


def test_residual_steps_replay_like_their_plans():
    # The residual step of a recompute set is the plain offload problem the solvers see: the same memory
    # and the same step as the plan it stands for, for any offloads.
    p = synth_profile(layers=2, hidden=64, seq=64, batch=2, vocab=128)
    lt = analyse(p)
    names = [c.name for c in lt.recomputable][::3]
    res = lt.with_recompute(names)
    offs = [res.decision(c.name) for c in res.candidate_list[::2]]
    from teraio.planner.simulate import simulate_decisions

    hw = HardwareModel()
    a = simulate_decisions(lt, [*res.recompute_decisions, *offs], hw)
    b = simulate_decisions(res, offs, hw)
    assert a.broken_rules() == [] and b.broken_rules() == []
    assert np.array_equal(a.memory_bytes, b.memory_bytes)
    assert a.step_s == pytest.approx(b.step_s, rel=1e-12)
    assert dataclasses.replace(res, base=None).base is None


def test_the_pipeline_never_rebuilds_a_tensor_where_it_was_never_dropped():
    """Found by the property above (the simulator refused the pipeline's joint plan): t7's rebuild, needed
    by the first backward op, reads t4, last used by the last forward op; with t4 rebuilt too, t4 would be
    rebuilt where it was never absent. The pipeline judges only the sets that are plans, and every
    solver's plan is valid."""
    nf, n = 6, 10
    rows = [  # name, nbytes, producer, last forward use, first backward use, last use, recompute_us, inputs
        ("t0", 100_000, 0, 0, -1, 0, math.nan, ()),
        ("t1", 100_000, 1, 1, -1, 1, math.nan, ()),
        ("t2", 100_000, 0, 0, 6, 6, 100.0, ()),
        ("t3", 100_000, 0, 0, -1, 0, math.nan, ()),
        ("t4", 100_000, 0, 5, 7, 7, 0.0, ()),
        ("t5", 100_000, 0, 0, 6, 6, math.nan, ()),
        ("t6", 200_001, 1, 1, -1, 1, math.nan, ()),
        ("t7", 100_000, 0, 0, 6, 6, 0.0, ("w", "t0", "t4")),
    ]
    tensors = [_weight_row(n)] + [
        _activation_row(name, nbytes, (prod, last_fwd, first_bwd, last), rec_us, inputs, 0, f"layers.{k % 2}")
        for k, (name, nbytes, prod, last_fwd, first_bwd, last, rec_us, inputs) in enumerate(rows)
    ]
    profile = make_profile(ops_rows([50.0] * n, nf, other_bytes=[0] * n), tensors, {"fingerprint": "chains"})
    hw = HardwareModel(
        tiers={"ssd": TierModel(5e7, 5e7), "host": TierModel(4e9, 4e9, capacity_bytes=0)}, name="rand"
    )
    plans = _solve_every_way((profile, hw, 0.3), SOLVERS)
    for d in plans["pipeline", "joint"].decisions:
        assert d.action != "recompute" or d.fetch_before_idx > d.wait_before_idx, d
