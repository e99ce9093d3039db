"""The ILP solver's offload search: CP-SAT on the model of :mod:`planner.solvers.ilp_model`, started from
the best constructive plan, every solution judged by the simulator and checked against the model's claims.

Search, within ``time_limit_s`` (:data:`RESERVE_SHARE` kept in reserve):

1. Starts: the ``pipeline`` and ``greedy`` plans (greedy only for "auto"); the better one simulated is
   the incumbent.
2. Whole step: for steps of at most :data:`FULL_MODEL_MAX_CANDIDATES` candidates (and for "auto"), the
   model hinted with the incumbent (ending once it stops improving: Note: [A solve that stopped improving
   ends] in :mod:`planner.solvers.ilp_model`), then a second solve for the fewest bytes at that step time.
3. Large-neighbourhood search: layer windows (:mod:`planner.layers`, :data:`LNS_WIDTH` layers each, most
   simulated stall first) re-solved with every tensor outside the window held to the incumbent's choice.

The incumbent changes only when the simulator says a solution is better, so the plan returned is never
worse than its starts. Each solution's record (``stats.extra["own_plans"]``) is checked by
:func:`own_plan_problems` against the relations argued in :mod:`planner.solvers.ilp` when
:data:`CHECK_OWN_PLANS_ENV` is set.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from ortools.sat.python import cp_model

from teraio.planner.budget import BudgetError, infeasible
from teraio.planner.layers import find_layers
from teraio.planner.plan import Decision, Plan, SolverStats
from teraio.planner.simulate import STALL_TOLERANCE_S, SimResult, Violation
from teraio.planner.solve import Problem, SolverBugError, get_solver, make_plan
from teraio.planner.solvers.ilp_model import _STATUS, _complete_hint, _IlpModel, _run
from teraio.planner.solvers.pipeline import better

#: Is one simulated plan better than another (within budget first, then step time, then bytes): the
#: pipeline's judgement, shared so every solver ranks plans alike.
_better = better

#: Share of the time limit kept for the second (fewest bytes) solve.
PHASE2_SHARE = 0.25
#: Share of the time limit kept in reserve for CP-SAT's overrun and the simulations after it.
RESERVE_SHARE = 0.15
#: Set to "1" to check every model solution against the simulator (:mod:`planner.solvers.ilp`); tests set it.
CHECK_OWN_PLANS_ENV = "TERAIO_CHECK_OWN_PLANS"
#: Float slack of the checks: the simulator sums op times in seconds, the model whole microseconds.
CHECK_TOLERANCE_S = 1e-9


def own_plan_problems(own: dict) -> list[Violation]:
    """What is wrong with one record of ``stats.extra["own_plans"]`` (empty when nothing is): the plan the
    model found is over the budget, or its step or peak breaks the relations argued in :mod:`planner.solvers.ilp`."""
    out: list[Violation] = []
    label = own["label"]
    if own["budget_bytes"] is not None and own["sim_peak_bytes"] > own["budget_bytes"]:
        out.append(
            Violation(
                "budget",
                "",
                f"{label}: simulated peak {own['sim_peak_bytes']} bytes over the budget of "
                f"{own['budget_bytes']} bytes",
            )
        )
    if own["auto"]:
        # "auto" fixes op times and minimises the peak: the model's peak bounds the simulated one.
        if own["model_peak_bytes"] is not None and own["sim_peak_bytes"] > own["model_peak_bytes"]:
            out.append(
                Violation(
                    "model_optimistic",
                    "",
                    f"{label}: model peak {own['model_peak_bytes']} bytes below the simulated peak "
                    f"{own['sim_peak_bytes']} bytes",
                )
            )
        return out
    model_s, sim_s = own["model_step_s"], own["sim_step_s"]
    if sim_s > model_s + CHECK_TOLERANCE_S:
        out.append(
            Violation(
                "model_optimistic",
                "",
                f"{label}: model step {model_s:.9f} s below the simulated {sim_s:.9f} s",
            )
        )
    allowance_s = own["rounding_allowance_s"] + own["cpu_charge_s"]
    if own["status"] == "OPTIMAL" and model_s - sim_s > allowance_s + CHECK_TOLERANCE_S:
        out.append(
            Violation(
                "model_pessimistic",
                "",
                f"{label}: optimal model step {model_s:.9f} s exceeds the simulated {sim_s:.9f} s by more than "
                f"rounding {own['rounding_allowance_s']:.9f} s + CPU charge {own['cpu_charge_s']:.9f} s",
            )
        )
    return out


def _better_auto(a: SimResult, b: SimResult) -> bool:
    a_ok, b_ok = a.stall_s <= STALL_TOLERANCE_S, b.stall_s <= STALL_TOLERANCE_S
    if a_ok != b_ok:
        return a_ok
    if a.peak_bytes != b.peak_bytes:
        return a.peak_bytes < b.peak_bytes
    return a.step_s < b.step_s


#: Problems with at most this many candidates get the whole-step model first; larger ones go straight to
#: the layer-window search (on large steps CP-SAT finds no whole-step solution in useful time, even
#: hinted).
FULL_MODEL_MAX_CANDIDATES = 300
#: Layers per window of the large-neighbourhood search, and the CP-SAT time per window (seconds). On
#: steps at real op granularity a window's presolve and propagation can take seconds while CP-SAT's
#: deterministic clock counts hundredths, so this wall-clock cap, not ``deterministic_time_s``, ends each
#: window there: such runs are not reproducible across machines.
LNS_WIDTH = 4
LNS_WINDOW_S = 4.0


@dataclass
class _Search:
    """The incumbent and what every model solution looked like (``own``: one record per solution, checked
    by :func:`own_plan_problems` when the environment asks, see :mod:`planner.solvers.ilp`)."""

    problem: Problem
    model: _IlpModel
    decisions: list[Decision]
    sim: SimResult
    source: str
    status: str = "HEURISTIC"
    own: list[dict] = dataclasses.field(default_factory=list)
    improvements: int = 0
    #: CP-SAT's deterministic time over every solve so far (its own work units, see ``Problem``).
    cpsat_deterministic_s: float = 0.0

    def offer(self, solver: cp_model.CpSolver, status: int, label: str) -> bool:
        """Extract the solution, judge it in the simulator, keep it when better. True when kept."""
        decisions = self.model.extract(solver)
        sim = self.problem.simulate(decisions)
        m = self.model
        own = {
            "label": label,
            "model_step_s": None if m.auto else solver.value(m.E[-1] + m.cpu_us) / 1e6,
            "model_peak_bytes": solver.value(m.peak) * m.unit if m.auto else None,
            "sim_step_s": sim.step_s,
            "sim_peak_bytes": sim.peak_bytes,
            "budget_bytes": self.problem.budget_bytes,
            "status": _STATUS.get(status, str(status)),
            "auto": m.auto,
            "exact_units": m.exact_units,
            "rounding_allowance_s": m.rounding_allowance_us(decisions) / 1e6,
            "cpu_charge_s": m.cpu_charge_us(decisions) / 1e6,
        }
        self.own.append(own)
        if os.environ.get(CHECK_OWN_PLANS_ENV) == "1":
            problems = own_plan_problems(own)
            if problems:
                raise SolverBugError(
                    f"ilp: the model's own plan ({label}) disagrees with the simulator: {problems[0]}",
                    problems,
                )
        better = _better_auto if m.auto else _better
        if better(sim, self.sim) or (label == "whole step" and not better(self.sim, sim)):
            self.decisions, self.sim, self.source = decisions, sim, label
            self.status = "OPTIMAL" if status == cp_model.OPTIMAL and label == "whole step" else "FEASIBLE"
            self.improvements += 1
            return True
        return False


def _lns(search: _Search, windows: list[tuple[int, ...]], layers, deadline: float, det: float | None) -> int:
    """Re-solve the model with only one layer window's tensors free, the rest fixed to the incumbent.

    Windows are visited worst first (most simulated stall in their ops), the incumbent hinted in full.
    Returns the number of windows solved.
    """
    model, problem = search.model, search.problem
    spans = layers.layers

    def stall_in(window: tuple[int, ...]) -> float:
        st = search.sim.stall_s_per_op
        return sum(
            float(st[s.fwd_start_idx : s.fwd_stop_idx].sum() + st[s.bwd_start_idx : s.bwd_stop_idx].sum())
            for s in (spans[i] for i in window)
        )

    order = sorted(windows, key=lambda w: -stall_in(w))
    solved = 0
    for window in order:
        left = deadline - time.perf_counter()
        if left < 0.5:
            break
        free = {name for i in window for name in spans[i].tensor_names}
        chosen = {d.name: d for d in search.decisions}
        m = model.m
        m.clear_hints()
        model.add_hint(search.decisions)
        sub = m.clone()
        for c in model.cands:
            if c.name in free:
                continue
            d = chosen.get(c.name)
            for r in model.tiers:
                var = sub.get_bool_var_from_proto_index(model.o[c.name, r].index)
                sub.add(var == int(d is not None and d.tier == r))
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = max(0.2, min(LNS_WINDOW_S, left))
        if det is not None:
            solver.parameters.max_deterministic_time = max(0.01, det / max(1, len(order)))
        solver.parameters.num_workers = max(1, problem.workers)
        solver.parameters.random_seed = 0
        status = solver.solve(sub)
        search.cpsat_deterministic_s += solver.deterministic_time
        solved += 1
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            search.offer(solver, status, f"window {window[0]}-{window[-1]}")
    return solved


def _solve_offload(problem: Problem) -> Plan:
    """The offload-only solver of the module docstring (CP-SAT around the pipeline and greedy starts)."""
    t0 = time.perf_counter()
    lt = problem.lifetimes
    if problem.budget_bytes is not None and problem.hardware.available_tiers():
        if problem.budget_bytes < lt.min_feasible_peak_bytes:
            raise infeasible(problem.budget_bytes, lt.min_feasible_peak_bytes)
    auto = problem.budget_bytes is None
    better = _better_auto if auto else _better
    # CP-SAT overruns its limit a little (presolve, shutdown) and the simulations after it take time:
    # keep a reserve so the whole call stays within the time limit.
    deadline = t0 + problem.time_limit_s * (1 - RESERVE_SHARE)
    det = problem.deterministic_time_s

    def left_s() -> float:
        return max(0.05, deadline - time.perf_counter())

    problem.report(0.0, "ilp: starts")
    starts, best_start = _starts(problem, better)

    layers = find_layers(problem.profile)
    extra: dict = {
        "layers": layers.summary(),
        "starts": {k: v[1].step_s for k, v in starts.items()},
        "warm_start": best_start or "none",
        # Whether each model solution was checked against the simulator (:mod:`planner.solvers.ilp`).
        "own_plans_checked": os.environ.get(CHECK_OWN_PLANS_ENV) == "1",
    }
    if not len(lt.candidates) or (not auto and lt.baseline_peak_bytes <= problem.budget_bytes):
        # Nothing needs to move (or nothing can): the empty plan has no stall and moves no byte.
        stats = SolverStats(
            solver="ilp",
            status="OPTIMAL",
            objective=lt.compute_s,
            bound=lt.compute_s,
            wall_s=time.perf_counter() - t0,
            extra={**extra, "chosen": "empty plan (already within budget)"},
        )
        if not auto or not len(lt.candidates):
            return make_plan(problem, [], stats)

    build_t0 = time.perf_counter()
    model = _IlpModel(problem)
    extra["model"] = {
        "candidates": len(model.cands),
        "ops": model.n,
        "tiers": model.tiers,
        "memory_unit_nbytes": model.unit,
        "build_s": round(time.perf_counter() - build_t0, 3),
        "variables": len(model.m.proto.variables),
        "constraints": len(model.m.proto.constraints),
        "bandwidth_cuts": getattr(model, "num_bandwidth_cuts", 0),
    }
    extra["proven_for"] = "the model: op and transfer times rounded up to whole us, CPU cost of I/O in full"
    if best_start is None:
        empty_sim = problem.simulate([])
        search = _Search(problem, model, [], empty_sim, "none", status="UNKNOWN")
    else:
        search = _Search(problem, model, starts[best_start][0], starts[best_start][1], best_start)
    objective = bound = None

    if auto or len(model.cands) <= FULL_MODEL_MAX_CANDIDATES:
        # Half the time on the whole step (all of it for "auto").
        share = 1.0 if auto or not layers.num_layers else 0.5
        objective, bound = _whole_step(search, share, left_s, extra)
    if not auto and layers.num_layers >= 2 and search.decisions and left_s() > 0.5:
        problem.report(0.6, "ilp: layer windows")
        extra["lns_windows_solved"] = _lns(
            search, layers.windows(LNS_WIDTH), layers, deadline, det * 0.5 if det else None
        )
    if model.auto:
        extra["objective_unit"] = "peak bytes"
        if objective is not None:
            objective, bound = objective * model.unit, bound * model.unit
    else:
        extra["objective_unit"] = "model step time s (compute + stall + full CPU cost of I/O)"
        if objective is not None:
            objective, bound = objective / 1e6, bound / 1e6
    extra["chosen"] = search.source
    extra["own_plans"] = search.own
    extra["improvements"] = search.improvements
    extra["cpsat_deterministic_s"] = search.cpsat_deterministic_s
    status_out = search.status
    if search.sim.budget_bytes is not None and not search.sim.within_budget:
        status_out = "INFEASIBLE"
    stats = SolverStats(
        solver="ilp",
        status=status_out,
        objective=objective,
        bound=bound,
        wall_s=time.perf_counter() - t0,
        extra=extra,
    )
    problem.report(1.0, "ilp: done")
    return make_plan(problem, search.decisions, stats)


def _starts(problem: Problem, better) -> tuple[dict[str, tuple[list[Decision], SimResult]], str | None]:
    """The constructive plans the search starts from (``pipeline`` and ``greedy``, greedy alone for
    "auto"), each simulated, and the name of the best by ``better`` (None when no start meets the budget)."""
    starts: dict[str, tuple[list[Decision], SimResult]] = {}
    for name in ("greedy",) if problem.budget_bytes is None else ("pipeline", "greedy"):
        try:
            plan = get_solver(name)(dataclasses.replace(problem, progress=None))
        except BudgetError:
            continue
        starts[name] = (list(plan.decisions), problem.simulate(plan.decisions))
    best_start = None
    for name, (_, sim) in starts.items():
        if best_start is None or better(sim, starts[best_start][1]):
            best_start = name
    return starts, best_start


def _whole_step(
    search: _Search, share: float, left_s: Callable[[], float], extra: dict
) -> tuple[float | None, float | None]:
    """The model of the whole step, hinted with the incumbent, for ``share`` of the time left (phase 1);
    then, holding phase 1's objective at its best value, the fewest bytes (phase 2). Every solution is
    offered to ``search``; the phases' statuses go to ``extra``. Returns phase 1's objective and bound in
    model units (None when it found no solution)."""
    model, problem = search.model, search.problem
    det = problem.deterministic_time_s
    objective = bound = None
    problem.report(0.1, f"ilp: whole step ({len(model.cands)} candidates, {model.n} ops)")
    if search.decisions:
        model.add_hint(search.decisions)
    # A hint on every variable when CP-SAT finds nothing from the hint alone.
    phase1_s = left_s() * share * (1 - PHASE2_SHARE)
    solver, status = _run(model, phase1_s * 0.5, problem.workers, det * 0.25 if det else None, patience=True)
    search.cpsat_deterministic_s += solver.deterministic_time
    if search.decisions and status not in (cp_model.OPTIMAL, cp_model.FEASIBLE, cp_model.INFEASIBLE):
        hinted_ok, used_s = _complete_hint(model.m, min(0.1 * phase1_s, left_s()), det * 0.1 if det else None)
        search.cpsat_deterministic_s += used_s
        if hinted_ok:
            solver, status = _run(
                model, phase1_s * 0.5, problem.workers, det * 0.25 if det else None, patience=True
            )
            search.cpsat_deterministic_s += solver.deterministic_time
    extra["phase1_status"] = _STATUS.get(status, str(status))
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        objective, bound = solver.objective_value, solver.best_objective_bound
        search.offer(solver, status, "whole step")
        # Phase 2: hold the first objective at its best value, move the fewest units.
        best1 = int(round(solver.objective_value))
        model.m.add(model.primary <= best1)
        model.m.clear_hints()
        hinted = [
            *model.o.values(),
            *model.pe.values(),
            *model.p.values(),
            *model.ws.values(),
            *model.rs.values(),
            *model.moved.values(),
        ]
        if not model.auto:
            hinted += [*model.E, *model.R[1 : model.nf + 1]]
        for var in hinted:
            model.m.add_hint(var, solver.value(var))
        model.m.minimize(model.moved_units)
        problem.report(0.5, "ilp: fewest bytes at that step time")
        solver2, status2 = _run(
            model, left_s() * share * PHASE2_SHARE, problem.workers, det * 0.25 if det else None
        )
        search.cpsat_deterministic_s += solver2.deterministic_time
        extra["phase2_status"] = _STATUS.get(status2, str(status2))
        if status2 in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            search.offer(solver2, status, "whole step")  # optimal in phase 1's objective
        model.m.minimize(model.primary)
    return objective, bound
