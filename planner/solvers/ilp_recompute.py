"""The ILP solver with recompute (``Problem.recompute`` "only" or "joint"): a search over recompute sets,
each set's offloads planned on its residual step, the best set's offloads improved by the CP-SAT model.

What is exact and what is searched:

- Exact, for a fixed recompute set: the set turns the step into a residual offload problem
  (``Lifetimes.with_recompute``: rebuild compute in the ops' durations, dropped tensors, extended inputs
  and intermediates in the memory, inputs of rebuilds needed earlier), and the model of
  :mod:`planner.solvers.ilp_model` plans it unchanged, with all the checks of
  :mod:`planner.solvers.ilp_search` against the simulator.
- Searched: the recompute set. Starts: the pipeline's plans in the mode (offload only, recompute only,
  and its threshold grid, ``planner.solvers.pipeline``). Then large-neighbourhood moves over layers
  (:mod:`planner.layers`): per layer (and the ops outside layers), recompute all of its recomputable
  tensors, none of them, or the cheaper or the dearer half by rebuild time per I/O time; then, with
  time left, drop single tensors from the set, dearest first. Each candidate set is planned with the
  pipeline on its residual step and judged by the simulator; a move is kept when the plan is better.
  Finally the model improves the offloads of the best set (the "polish").
- Never worse than the modes it contains: "joint" also runs the recompute-only search and the whole
  offload-only search as ``recompute="off"`` would (the same deterministic budget; of the wall clock,
  everything left when no recompute set beats the offload-only start, else a share), and returns the
  best plan of all. ``stats.extra["recompute"]`` says which won and what every source reached.
"""

from __future__ import annotations

import dataclasses
import time

from teraio.planner.budget import BudgetError
from teraio.planner.layers import find_layers
from teraio.planner.plan import Plan, SolverStats
from teraio.planner.solve import Problem, make_plan
from teraio.planner.solvers.ilp_search import RESERVE_SHARE, _solve_offload
from teraio.planner.solvers.pipeline import Evaluated, better, evaluate, rebuild_ratio, recompute_plans

#: Shares of the time limit in a recompute search: the recompute-only search, the joint set search, and
#: the offload-only run when recomputing wins (else it gets all that is left); the rest polishes the
#: best set's offloads with the model.
OFFLOAD_SHARE = 0.35
ONLY_SHARE = 0.1
SET_SEARCH_SHARE = 0.2
#: Recompute sets evaluated per deterministic second of a search share (Note: [The set search counts sets
#: when the clock must not decide]).
SETS_PER_DETERMINISTIC_S = 200

# Note [The set search counts sets when the clock must not decide]
# The search over recompute sets is not CP-SAT: each set is judged by the pipeline's offloads and the
# simulator, so CP-SAT's deterministic clock does not reach it. With a deterministic time limit it stops
# after a number of evaluated sets proportional to that limit (its share of it, times
# SETS_PER_DETERMINISTIC_S), so a loaded machine evaluates the same sets and returns the same plan as a
# quiet one; the wall-clock deadline still caps it. Without one, the wall clock alone stops it.


def _set_search(problem: Problem, start, deadline: float, budget: int, counter: list[int], share: float):
    """Layer moves, then single-tensor drops, over recompute sets from ``start`` (module docstring).

    Stops at a local optimum, at ``deadline`` (wall clock), or, with a deterministic time limit, after
    ``share`` of its evaluations (Note: [The set search counts sets when the clock must not decide])."""
    det = problem.deterministic_time_s
    max_evals = None if det is None else counter[0] + max(1, int(det * share * SETS_PER_DETERMINISTIC_S))
    lt = problem.lifetimes
    rec = {c.name: c for c in lt.recomputable}
    ratio = (
        rebuild_ratio(problem)
        if problem.hardware.available_tiers()
        else {n: c.recompute_us for n, c in rec.items()}
    )
    layers = find_layers(problem.profile)
    groups: list[list[str]] = []
    in_layer: set[str] = set()
    for span in layers.layers:
        names = [n for n in span.tensor_names if n in rec]
        if names:
            groups.append(names)
            in_layer.update(names)
    rest = [n for n in rec if n not in in_layer]
    if rest:
        groups.append(rest)
    best = start

    def out_of_time() -> bool:
        if max_evals is not None and counter[0] >= max_evals:
            return True
        return time.perf_counter() > deadline

    def attempt(names: set[str], label: str) -> bool:
        nonlocal best
        key = tuple(n for n in rec if n in names)  # profile order: one key per set
        if key == best.recomputed or out_of_time():
            return False
        counter[0] += 1
        e = evaluate(problem, key, budget, label)
        if e is not None and better(e.sim, best.sim):
            best = e
            return True
        return False

    improved = True
    while improved and not out_of_time():
        improved = False
        for g in groups:
            cur = set(best.recomputed)
            by_ratio = sorted(g, key=lambda n: ratio[n])
            half = max(1, len(g) // 2)
            for names, label in (
                (cur | set(g), "add layer"),
                (cur - set(g), "drop layer"),
                (cur | set(by_ratio[:half]), "add cheap half"),
                (cur - set(by_ratio[half:]), "drop dear half"),
            ):
                if attempt(names, label):
                    improved = True
                    break
    for name in sorted(best.recomputed, key=lambda n: -rec[n].recompute_us):
        if out_of_time():
            break
        if name in best.recomputed:
            attempt(set(best.recomputed) - {name}, "drop one")
    return best


def _solve_with_recompute(problem: Problem) -> Plan:
    """Recompute "only" or "joint" (module docstring)."""
    t0 = time.perf_counter()
    limit = problem.time_limit_s * (1 - RESERVE_SHARE)
    budget = problem.budget_bytes
    counter = [0]
    pool: list = []
    extra: dict = {
        "exact": "the offload schedule of a fixed recompute set (CP-SAT on the residual step)",
        "searched": "the recompute set: the pipeline's plans, then layer add/drop moves and single drops, "
        "each set's offloads by the pipeline, judged by the simulator",
    }
    problem.report(0.0, "ilp: recompute sets")
    starts = recompute_plans(problem, budget)
    pool += starts
    only_problem = dataclasses.replace(problem, recompute="only")
    only_starts = [e for e in starts if e.label == "recompute only"]
    if only_starts:
        found = _set_search(
            only_problem,
            only_starts[0],
            time.perf_counter() + limit * ONLY_SHARE,
            budget,
            counter,
            ONLY_SHARE,
        )
        pool.append(dataclasses.replace(found, label="ilp recompute only"))
    joint_best = None
    offloading = problem.plans_offload and bool(problem.hardware.available_tiers())
    if problem.recompute == "joint" and offloading:
        with_sets = [e for e in starts if e.recomputed]
        if with_sets:
            start = with_sets[0]
            for e in with_sets[1:]:
                if better(e.sim, start.sim):
                    start = e
            joint_best = _set_search(
                problem,
                start,
                time.perf_counter() + limit * SET_SEARCH_SHARE,
                budget,
                counter,
                SET_SEARCH_SHARE,
            )
            pool.append(joint_best)
    # Whether rebuilding anything beats the offload-only start decides where the rest of the time goes:
    # to the offload-only model alone when it does not (then "joint" plans as well as "off" would in
    # the same time), else a share to it and the rest to the best set's offloads.
    off_start = next((e for e in starts if not e.recomputed and e.label == "offload only"), None)
    recompute_wins = joint_best is not None and (off_start is None or better(joint_best.sim, off_start.sim))
    if offloading:
        problem.report(0.4, "ilp: offload only")
        left_s = max(0.5, limit - (time.perf_counter() - t0))
        off_s = min(left_s, problem.time_limit_s * OFFLOAD_SHARE) if recompute_wins else left_s
        # Same deterministic budget as recompute="off" (so "joint" is never worse under it), the rest of
        # the wall clock or a share of it.
        off = _solve_offload(
            dataclasses.replace(
                problem, recompute="off", time_limit_s=off_s / (1 - RESERVE_SHARE), progress=None
            )
        )
        pool.append(Evaluated((), list(off.decisions), problem.simulate(off.decisions), "ilp offload only"))
        extra["offload_only"] = {"status": off.stats.status, "chosen": off.stats.extra.get("chosen")}
    if recompute_wins and joint_best.recomputed and joint_best.sim.within_budget:
        problem.report(0.7, "ilp: offloads of the best recompute set")
        res = problem.residual(joint_best.recomputed)
        left = max(0.5, limit - (time.perf_counter() - t0)) / (1 - RESERVE_SHARE)
        try:
            polished = _solve_offload(dataclasses.replace(res, time_limit_s=left, progress=None))
        except BudgetError:
            polished = None
        if polished is not None:
            decisions = [*res.lifetimes.recompute_decisions, *polished.decisions]
            pool.append(Evaluated(joint_best.recomputed, decisions, problem.simulate(decisions), "ilp joint"))
            extra["polish"] = {"status": polished.stats.status, "chosen": polished.stats.extra.get("chosen")}
    if not pool:
        raise BudgetError(
            f"no recompute set brings the peak within {budget} bytes (recompute={problem.recompute}); "
            f"allow offloading or a larger budget"
        )
    best = pool[0]
    for e in pool[1:]:
        if better(e.sim, best.sim):
            best = e
    extra["recompute"] = {
        "mode": problem.recompute,
        "chosen": best.label,
        "sources": {e.label: e.sim.step_s if e.sim.within_budget else None for e in pool},
        "sets_evaluated": counter[0],
        "recomputed": len(best.recomputed),
        "recomputed_bytes": best.sim.recomputed_bytes,
        "recompute_s": best.sim.recompute_s,
    }
    stats = SolverStats(
        solver="ilp",
        status="FEASIBLE" if best.sim.within_budget else "INFEASIBLE",
        wall_s=time.perf_counter() - t0,
        extra=extra,
    )
    problem.report(1.0, "ilp: done")
    return make_plan(problem, best.decisions, stats)
