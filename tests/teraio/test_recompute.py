"""Recompute in the real graphs: recipes replay bit for bit, plans that recompute run exact and in budget.

A plan may rebuild saved tensors in backward instead of keeping or offloading them (``teraio.graph.recompute``).
These tests check the recipes the profiler extracts (Note: [Only what replays bit for bit is
recomputed]), refuse plans that ask for what cannot be rebuilt, and run recompute-only and joint plans
through the loop that goes through every pattern, on every model, compared bit for bit with the same
compile without teraio's edits and held to the budget, on the FX-only path and under Inductor.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from teraio.graph.capture import CapturedStep, analyse_saved
from teraio.graph.recompute import recipes
from teraio.graph.rewrite import PlanMismatchError, check_plan
from teraio.planner.hardware import HardwareModel
from teraio.planner.lifetimes import analyse
from teraio.planner.plan import Decision, Plan

from .captured import captured_steps
from .loops import CASES
from .loops import check_case as _check

MODELS = ("gpt", "hf-gpt2", "hf-bert", "convnet")


def _captured(case_name: str) -> CapturedStep:
    case = CASES[case_name]
    return captured_steps(
        lambda backend: torch.compile(case.build(), backend=backend)(*case.batch(0, case.sizes[0]))
    )[0]


def test_recipes_never_replay_random_ops_and_stop_at_saved_values() -> None:
    """Dropout's output and mask are drawn from the generator: never rebuilt; what reads the saved mask
    is (Note: [Only what replays bit for bit is recomputed])."""
    step = _captured("gpt")  # the GPT with dropout
    a = analyse_saved(step)
    by_group = recipes(step, a)
    assert by_group, "nothing rebuildable: the test would prove nothing"
    saved = {g.name for g in a.groups}
    seeded = [n for n in step.fw_gm.graph.nodes if n.op == "call_function" and "dropout" in str(n.target)]
    assert seeded, "the GPT case lost its dropout"
    for name, r in by_group.items():
        for n in r.ops:
            assert torch.Tag.nondeterministic_seeded not in getattr(n.target, "tags", ()), (name, n)
        assert set(r.input_groups) <= saved
    # Every dropout's outputs are saved and have no recipe (the seeded op would be in it).
    for node in seeded:
        for g in a.groups:
            if g.producer is not None and node in g.producer.all_input_nodes:
                assert g.name not in by_group, g.name


def test_a_plan_recomputing_what_cannot_be_rebuilt_is_refused() -> None:
    step = _captured("gpt")
    a = analyse_saved(step)
    by_group = recipes(step, a)
    stuck = next(g for g in a.groups if g.producer is not None and g.name not in by_group)
    nf = a.num_fwd_ops
    need = stuck.first_bwd_use_idx if stuck.first_bwd_use_idx >= 0 else nf
    d = Decision(
        stuck.name, "", stuck.nbytes, -1, "", stuck.last_fwd_use_idx + 1, "", need, "", need, "",
        action="recompute",
    )  # fmt: skip
    plan = dataclasses.replace(_empty_plan(a.fingerprint), decisions=(d,))
    with pytest.raises(PlanMismatchError, match="cannot rebuild"):
        check_plan(a, plan, by_group)


def _empty_plan(fingerprint: str) -> Plan:
    from teraio.planner.solve import solve
    from teraio.planner.synth import synth_profile

    plan = solve(synth_profile(layers=1), budget="100%", solver="none")
    return dataclasses.replace(plan, fingerprint=fingerprint, decisions=())


def _on_fixed_times(solve):
    """``solve`` on a profile with fixed op and rebuild times (10 and 20 us). Which rebuilds the pipeline
    tries is ranked by time; a loaded machine times ops unevenly, and on hf-gpt2 at 80% a fresh-clone
    CI run then tried no set that fit (BudgetError), where idle runs found one. What these tests check
    is that the plans run exact and within budget, not how the machine timed them."""

    def fixed(profile, *args, **kw):
        rebuild_us = profile.tensors["recompute_us"]
        profile = dataclasses.replace(
            profile,
            ops=profile.ops.assign(duration_us=10.0),
            tensors=profile.tensors.assign(recompute_us=rebuild_us.where(rebuild_us.isna(), 20.0)),
        )
        return solve(profile, *args, **kw)

    return fixed


@pytest.mark.parametrize("case_name", MODELS)
def test_recompute_only_plans_run_exact_and_within_budget(case_name: str, tmp_path, monkeypatch) -> None:
    """Every loop pattern, with a plan that only rebuilds (no byte leaves memory)."""
    import teraio.planner.solve as solve_mod

    monkeypatch.setattr(solve_mod, "solve", _on_fixed_times(solve_mod.solve))
    _trace, be = _check(case_name, "all-fp32", "eager", tmp_path, "80%", solver="pipeline", recompute="only")
    plans = [r.plan for r in be.runners if r.plan is not None]
    assert any(p.recomputes for p in plans), "nothing was recomputed: the test would prove nothing"
    assert all(p.moved_bytes == 0 for p in plans)


@pytest.mark.parametrize("solver", ["pipeline", "ilp"])
def test_joint_plans_mix_recompute_and_offload_and_run_exact(solver: str, tmp_path, monkeypatch) -> None:
    """On a slow disk rebuilding is cheaper than moving for some tensors and not for others."""
    import teraio.planner.solve as solve_mod

    solve = solve_mod.solve

    def on_a_disk_as_slow_as_the_step_is_long(profile, *args, hardware=None, **kw):
        # The plan weighs profiled times (each op's, each tensor's rebuild) against the disk, and a
        # loaded machine times them unevenly (one rebuild measured 0.3 ms idle and 11 ms loaded): plan
        # on fixed times, 10 us per op and 20 us per rebuild, so what is tested does not depend on the
        # machine. At this bandwidth the unplanned peak moves in the step's compute time: both solvers
        # mix recompute and offload there (pipeline rebuilds 7 tensors, ilp 5).
        rebuild_us = profile.tensors["recompute_us"]
        profile = dataclasses.replace(
            profile,
            ops=profile.ops.assign(duration_us=10.0),
            tensors=profile.tensors.assign(recompute_us=rebuild_us.where(rebuild_us.isna(), 20.0)),
        )
        lt = analyse(profile)
        bw = lt.baseline_peak_bytes / lt.compute_s
        slow = HardwareModel().with_overrides("ssd", write_bw_bytes_per_s=bw, read_bw_bytes_per_s=bw)
        # CP-SAT on its deterministic clock, one worker: the same plan however busy the machine is.
        return solve(profile, *args, hardware=slow, **{**kw, "deterministic_time_s": 0.5, "workers": 1})

    monkeypatch.setattr(solve_mod, "solve", on_a_disk_as_slow_as_the_step_is_long)
    _trace, be = _check(
        "gpt", "all-fp32", "eager", tmp_path, "55%", solver=solver, recompute="joint", time_limit=60
    )
    plan = be.runners[0].plan
    assert plan.recomputes and plan.moved_bytes > 0, "the plan did not mix both: the test would prove nothing"


# By hand (`pytest -m expensive`): minutes of Inductor compiles, and once, on a machine loaded by three
# jobs, its measured peak went 5.3% over the budget (266632 against 253101 bytes): not yet explained.
@pytest.mark.expensive
def test_inductor_bf16_rebuilds_are_exact(deterministic_inductor_recompute, tmp_path) -> None:
    """Rebuilt in backward's kernels, bf16 values still equal what the forward saved, bit for bit."""
    _trace, be = _check(
        "gpt",
        "autocast",
        "inductor",
        tmp_path,
        "90%",
        same_kernels=False,
        solver="pipeline",
        recompute="only",
    )
    assert any(r.plan.recomputes for r in be.runners if r.plan is not None)


@pytest.fixture
def deterministic_inductor_recompute():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with torch._inductor.config.patch(deterministic=True):
        yield
    torch.set_num_threads(threads)
