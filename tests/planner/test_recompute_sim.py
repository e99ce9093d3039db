"""Recompute in the execution model and the simulator, on hand-computed cases (``planner_cases.chain``):
rebuild time in the step, memory with dropped tensors, extended inputs and intermediates, effective needs
of chains, and every rule a recompute decision can break, as typed violations."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from teraio.planner.execution import effective_needs
from teraio.planner.lifetimes import analyse
from teraio.planner.plan import Plan, PlanError, SolverStats, validate_plan, with_ranks
from teraio.planner.profile import Profile
from teraio.planner.simulate import simulate_decisions
from tests.planner.planner_cases import MB, chain, ssd_only


def _sim(lt, decisions, budget=None):
    return simulate_decisions(lt, decisions, ssd_only(), budget_bytes=budget)


def _rec(lt, names):
    needs = lt.effective_needs(names)
    return [lt.recompute_decision(n, needs) for n in needs.order]


@pytest.mark.parametrize(
    "names, memory_mb, step_ms, needs, extended",
    [
        # b alone: dropped before op 3, rebuilt before op 6 from a (resident: a is used at 7), holding
        # 50 MB of intermediates at op 6.
        (["b"], [200, 300, 300, 200, 200, 200, 250, 100], 8.3, {"b": 6, "a": 6}, {}),
        # c alone: its rebuild reads x, which died after op 1: x now lives to op 5 (the peak grows).
        (["c"], [200, 300, 400, 400, 300, 400, 200, 100], 8.2, {"c": 5, "b": 5, "x": 5}, {"x": 5}),
        # The chain b -> c: c needs b at 5, so b is rebuilt at 5 (first), then c.
        (
            ["b", "c"],
            [200, 300, 400, 300, 200, 450, 200, 100],
            8.5,
            {"b": 5, "c": 5, "a": 5, "x": 5},
            {"x": 5},
        ),
        # a and b: b needs a at 6 (before its own first use at 7): a is rebuilt at 6, before b.
        (["a", "b"], [200, 300, 200, 100, 100, 100, 250, 100], 8.8, {"a": 6, "b": 6}, {}),
    ],
)
def test_recompute_timelines_by_hand(names, memory_mb, step_ms, needs, extended):
    lt = analyse(chain())
    eff = lt.effective_needs(names)
    assert eff.first_need_idx == needs and eff.last_use_idx == extended and eff.cycle == ()
    decisions = _rec(lt, names)
    r = _sim(lt, decisions)
    assert r.violations == []
    assert (r.memory_bytes // MB).tolist() == memory_mb
    assert r.step_s == pytest.approx(step_ms / 1e3, abs=1e-12)
    assert r.recompute_s == pytest.approx(sum(d.recompute_us for d in decisions) / 1e6)
    assert r.stall_s == 0 and r.written_bytes == 0 and r.recomputed_bytes == 100 * MB * len(names)
    assert r.step_s == pytest.approx(r.compute_s + r.recompute_s + r.stall_s + r.interference_s)
    # The residual step of the same choice has the same memory and the same step.
    res = lt.with_recompute(names)
    assert res.baseline_memory_bytes.tolist() == r.memory_bytes.tolist()
    assert _sim(res, []).step_s == pytest.approx(r.step_s, rel=1e-12)


def test_rebuild_order_puts_inputs_first():
    lt = analyse(chain())
    assert lt.effective_needs(["c", "b", "a"]).order == ("a", "b", "c")
    d = {x.name: x for x in _rec(lt, ["a", "b", "c"])}
    assert [d[n].fetch_before_idx for n in "abc"] == [5, 5, 5]


def test_rebuilds_start_after_the_reads_they_wait_for():
    # a offloaded (fetched at 6, where b's rebuild needs it), b recomputed at 6: op 6 waits for a's read,
    # then rebuilds b (0.3 ms), then runs.
    lt = analyse(chain())
    needs = lt.effective_needs(["b"])
    off = lt.decision("a", offload_after_idx=0, wait_before_idx=2, fetch_before_idx=6, prefetch_before_idx=4)
    hw = ssd_only(write_bw=1e12, read_bw=0.05e9)  # write of 100 MB: 0.1 ms; read: 2 s
    r = simulate_decisions(lt, [off, lt.recompute_decision("b", needs)], hw)
    assert r.violations == []
    # Read issued at the start of op 4 (t = 4 ms), ends 2 s later; op 6's stall covers the rest.
    assert r.op_start_s[6] == pytest.approx(0.004 + 2.0 + 0.0003)
    assert r.stall_s == pytest.approx(2.0 + 0.004 - 0.006)
    assert r.step_s == pytest.approx(r.op_start_s[6] + 0.002)


def test_an_offloaded_input_must_be_fetched_by_the_rebuild_that_reads_it():
    lt = analyse(chain())
    needs = lt.effective_needs(["b"])
    late = lt.decision("a", offload_after_idx=0, wait_before_idx=2)  # fetched at 7, its own first use
    r = _sim(lt, [late, lt.recompute_decision("b", needs)])
    kinds = {(v.kind, v.tensor) for v in r.violations}
    assert kinds == {("fetch_not_at_need", "a"), ("input_not_resident", "b")}
    ok = lt.decision("a", offload_after_idx=0, wait_before_idx=2, fetch_before_idx=6)
    assert _sim(lt, [ok, lt.recompute_decision("b", needs)]).violations == []


@pytest.mark.parametrize(
    "change, kind",
    [
        (
            {
                "fetch_before_idx": 6,
                "prefetch_before_idx": 6,
                "fetch_before_name": "op6",
                "prefetch_before_name": "op6",
            },
            "fetch_not_at_need",
        ),
        ({"wait_before_idx": 3, "wait_before_name": "op3"}, "used_while_away"),
        ({"tier": "ssd"}, "recompute_fields"),
        ({"write_rank": 0}, "recompute_fields"),
        ({"recompute_us": 1.0}, "recompute_cost"),
        ({"nbytes": 5}, "nbytes"),
        ({"prefetch_before_idx": 4, "prefetch_before_name": "op4"}, "order"),
        ({"fetch_before_name": "zz"}, "name_mismatch"),
    ],
)
def test_every_rule_a_recompute_decision_can_break(change, kind):
    lt = analyse(chain())
    b, c = _rec(lt, ["b", "c"])  # c is rebuilt before op 5, its own first backward use
    r = _sim(lt, [b, dataclasses.replace(c, **change)])
    assert kind in {v.kind for v in r.violations}
    assert all(v.tensor in ("b", "c") for v in r.violations)


def test_what_cannot_be_recomputed():
    lt = analyse(chain())
    needs = lt.effective_needs(["b"])
    x = dataclasses.replace(lt.recompute_decision("b", needs), name="x")  # no candidate
    w = dataclasses.replace(lt.recompute_decision("b", needs), name="w")  # a param
    r = _sim(lt, [x, w])
    assert [(v.kind, v.tensor) for v in r.violations] == [
        ("not_recomputable", "x"),
        ("not_recomputable", "w"),
    ]
    both = [lt.decision("b"), lt.recompute_decision("b", needs)]
    assert [v.kind for v in _sim(lt, both).violations] == ["duplicate"]


def test_a_chain_that_needs_itself_is_a_cycle():
    # Validation refuses such a profile; a profile built around it still cannot fool the simulator.
    p = chain()
    t = p.tensors.copy()
    t.loc[t["name"] == "a", "recompute_inputs"] = pd_obj([("b",)])
    lt = analyse(Profile(ops=p.ops, tensors=t, meta=p.meta))
    a, b = _rec(analyse(p), ["a", "b"])
    r = _sim(lt, [a, b])
    assert {(v.kind, v.tensor) for v in r.violations} == {("recompute_cycle", "a"), ("recompute_cycle", "b")}
    assert effective_needs([lt.candidate_of("a"), lt.candidate_of("b")], lt.tensor_uses).order == ()


def pd_obj(values):
    import pandas as pd

    return pd.Series(values, dtype=object).values


def test_plan_schema_3_round_trip_and_show_fields():
    p = chain()
    lt = analyse(p)
    decisions = [
        *_rec(lt, ["b"]),
        lt.decision("a", offload_after_idx=0, wait_before_idx=2, fetch_before_idx=6),
    ]
    sim = _sim(lt, decisions)
    plan = Plan(
        fingerprint=p.fingerprint,
        budget_bytes=10**12,
        budget_spec="x",
        hardware=ssd_only(),
        stats=SolverStats(solver="hand", status="HEURISTIC"),
        decisions=tuple(decisions),
        baseline_peak_bytes=lt.baseline_peak_bytes,
        predicted_peak_bytes=sim.peak_bytes,
        predicted_step_s=sim.step_s,
        predicted_stall_s=sim.stall_s,
        compute_s=sim.compute_s,
    )
    d = json.loads(plan.to_json())
    assert d["schema_version"] == 3
    assert d["moved_bytes"] == 100 * MB and d["recomputed_bytes"] == 100 * MB
    assert d["recompute_s"] == pytest.approx(300e-6)
    rec = next(x for x in d["decisions"] if x["action"] == "recompute")
    assert (rec["tier"], rec["offload_after_idx"], rec["write_rank"], rec["read_rank"]) == ("", -1, -1, -1)
    assert rec["recompute_us"] == 300.0 and rec["prefetch_before_idx"] == rec["fetch_before_idx"] == 6
    back = Plan.from_dict(d)
    assert back.decisions == tuple(with_ranks(plan.decisions)) and back.recomputes == (decisions[0],)
    validate_plan(back, p)
    # Schema 2: no action, every decision an offload.
    old = json.loads(plan.to_json())
    old["schema_version"] = 2
    old["decisions"] = [x for x in old["decisions"] if x["action"] == "offload"]
    for x in old["decisions"]:
        del x["action"], x["recompute_us"]
    assert all(x.action == "offload" for x in Plan.from_dict(old).decisions)
    # A recompute decision that claims a tier or a write is refused on load, with one line.
    bad = json.loads(plan.to_json())
    bad["decisions"][0]["offload_after_idx"] = 0
    with pytest.raises(PlanError, match=r"decisions\[0\].offload_after_idx is 0, expected -1"):
        Plan.from_dict(bad)
    bad = json.loads(plan.to_json())
    bad["decisions"][0]["action"] = "delete"
    with pytest.raises(PlanError, match="expected one of offload, recompute"):
        Plan.from_dict(bad)
    # validate_plan runs the simulator's rules: a rebuild at the wrong op is refused.
    wrong = dataclasses.replace(
        plan,
        decisions=(
            dataclasses.replace(
                decisions[0],
                fetch_before_idx=5,
                prefetch_before_idx=5,
                fetch_before_name="op5",
                prefetch_before_name="op5",
            ),
            decisions[1],
        ),
    )
    with pytest.raises(PlanError, match="effective first backward need"):
        validate_plan(wrong, p)


def test_rebuild_compute_takes_cpu_interference_like_an_op():
    # A write overlapping op 6's window (rebuild + op) is charged over the whole window.
    lt = analyse(chain())
    needs = lt.effective_needs(["b"])
    hw = ssd_only(write_bw=1e9, cpu_s_per_byte=1e-11)
    off = lt.decision("c", offload_after_idx=2, wait_before_idx=4)
    r = simulate_decisions(lt, [off, lt.recompute_decision("b", needs)], hw)
    assert r.violations == []
    assert np.isclose(r.step_s, r.compute_s + r.recompute_s + r.stall_s + r.interference_s)
