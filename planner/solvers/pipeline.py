"""The ``pipeline`` solver: a constructive plan that keeps the write queue and the read queue streaming.

Where I/O is the bottleneck, what matters is that the write channel starts early and never idles in
forward, and the read channel likewise in backward. TERAIO's greedy (``planner.solvers.greedy``) picks
tensors by memory-time saved per I/O second and places each transfer in the channels' free time; when
bandwidth runs out, its repair pass patches op after op. This solver instead builds the plan from the
two orders a transformer step suggests:

- Backward pass (last op first): at each over-budget backward op, keep away the tensors needed latest
  (largest first backward use) until the op fits. A tensor first kept away at op ``k`` is prefetched
  before op ``k + 1``: reads come back as early as the budget allows.
- Forward pass (first op first): at each over-budget forward op, move the earliest-produced tensors
  still present until the op fits. A tensor first needed away at op ``k`` is waited before op ``k``:
  writes are waited as late as the budget allows.
- Every write is issued right after its producer, so the write queue runs in production order; writes
  issued together go earliest deadline first, reads issued together earliest use first.

In a transformer the earliest-produced tensors are the latest needed in backward, so both passes pick
from the same end and a tensor moved once serves both. Only positions decide memory, so the plan meets
the budget by construction (any budget at or above the smallest achievable peak); the simulator then
says how much it stalls. It runs in O(candidates log candidates + ops) plus numpy slices. The exact solver uses it as a start.

Recompute (``Problem.recompute``):

- ``"only"``: while some op is over the budget, take the op of largest excess and recompute the
  recomputable tensors idle there that rebuild cheapest per byte until their bytes cover it; then
  re-count memory (rebuilds extend their inputs and hold intermediates) and repeat. No I/O at all.
  Which rebuilds fit depends on the order they are taken in (a rebuild extends its inputs' lives and
  holds its intermediates), and the cheapest-first order follows the measured rebuild times, so the
  noise of one profiling run can decide whether it fits. Where cheapest-first does not fit, orders that do
  not depend on timing are tried (latest producer first, earliest first, longest idle first), so
  whether a budget can be met does not turn on the noise of one profiling run.
- ``"joint"``: rebuilding a tensor costs its ``recompute_us`` of compute; offloading it costs its write
  and read on the channels plus their CPU time. Tensors are ranked by that ratio (rebuild seconds per
  second of I/O and CPU it replaces), and the plan recomputes every tensor whose ratio is below a
  threshold and offloads the rest as above, on the residual step (``Lifetimes.with_recompute``). Where
  I/O hides behind compute a rebuild only costs time, where it does not a cheap rebuild removes stall;
  which threshold wins depends on the profile and the hardware, so a short grid of thresholds, the k
  best-ranked tensors for k = 1, 2, 4, ... (on a slow disk every ratio is small and every threshold
  takes the whole set, which may not fit the budget), offload only and the recompute-only plan are
  judged by the simulator and the fastest plan within the budget is kept: about twenty-five
  simulations.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from teraio.planner.budget import BudgetError
from teraio.planner.execution import Candidate
from teraio.planner.lifetimes import Lifetimes
from teraio.planner.plan import Decision, Plan, SolverStats
from teraio.planner.simulate import SimResult
from teraio.planner.solve import Problem, make_plan, register_solver

#: Thresholds of the joint plan's grid: recompute where rebuild time / I/O time replaced is below one.
JOINT_THRESHOLDS = (0.0, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0, 10.0, float("inf"))


def pipeline_decisions(problem: Problem, budget_bytes: int) -> list[Decision]:
    """The pipeline plan's decisions for ``budget_bytes`` (see the module docstring)."""
    lt = problem.lifetimes
    n, nf = lt.num_ops, lt.num_fwd_ops
    tier = problem.default_tier
    cands = lt.candidate_list
    mem = lt.baseline_memory_bytes.astype(np.int64).copy()
    wait: dict[int, int] = {}  # candidate index -> wait_before_idx
    pref: dict[int, int] = {}  # candidate index -> prefetch_before_idx

    # Backward pass: candidates idle at backward op k are those first used after k; taking them latest
    # use first, the eligible ones form a growing prefix of that order as k falls.
    by_last_use = sorted(
        range(len(cands)), key=lambda j: (-cands[j].first_bwd_use_idx, cands[j].producer_idx)
    )
    ptr = 0
    for k in range(n - 1, nf - 1, -1):
        while mem[k] > budget_bytes and ptr < len(by_last_use):
            j = by_last_use[ptr]
            if cands[j].first_bwd_use_idx <= k:
                break  # nobody else is idle here (the order is by first use)
            ptr += 1
            wait[j], pref[j] = nf, k + 1
            mem[nf : k + 1] -= cands[j].nbytes

    # Forward pass: candidates become idle after their last forward use; take the earliest produced.
    by_idle = sorted(range(len(cands)), key=lambda j: cands[j].inactive_start_idx)
    heap: list[tuple[int, int]] = []
    ptr = 0
    for k in range(nf):
        while ptr < len(by_idle) and cands[by_idle[ptr]].inactive_start_idx <= k:
            j = by_idle[ptr]
            heapq.heappush(heap, (cands[j].producer_idx, j))
            ptr += 1
        while mem[k] > budget_bytes and heap:
            _, j = heapq.heappop(heap)
            old_wait = wait.get(j, nf)
            wait[j] = k
            pref.setdefault(j, nf)
            mem[k:old_wait] -= cands[j].nbytes

    decisions = [
        lt.decision(
            cands[j].name,
            tier=tier,
            offload_after_idx=cands[j].producer_idx,
            wait_before_idx=wait[j],
            prefetch_before_idx=pref[j],
        )
        for j in sorted(wait)
    ]
    # Queue orders: writes issued after one op go earliest wait first; reads before one op earliest use.
    w_order = sorted(
        range(len(decisions)), key=lambda i: (decisions[i].offload_after_idx, decisions[i].wait_before_idx, i)
    )
    r_order = sorted(
        range(len(decisions)),
        key=lambda i: (decisions[i].prefetch_before_idx, decisions[i].fetch_before_idx, i),
    )
    w_rank = {i: r for r, i in enumerate(w_order)}
    r_rank = {i: r for r, i in enumerate(r_order)}
    return [
        dataclasses.replace(d, write_rank=w_rank[i], read_rank=r_rank[i]) for i, d in enumerate(decisions)
    ]


#: The orders :func:`recompute_only_set` takes rebuilds in, the first that fits winning: cheapest per
#: byte (the plan's time), then orders that do not depend on the profiled times (module docstring).
_ONLY_ORDERS: tuple[Callable[[Candidate], tuple[float, ...]], ...] = (
    lambda c: (c.recompute_us / c.nbytes, c.producer_idx),
    lambda c: (-c.producer_idx,),
    lambda c: (c.producer_idx,),
    lambda c: (c.inactive_start_idx - c.inactive_end_idx, c.producer_idx),
)


def recompute_only_set(problem: Problem, budget_bytes: int) -> list[str] | None:
    """The recompute-only plan's set (module docstring), or None when recomputing cannot meet the budget
    in any of the orders tried."""
    for key in _ONLY_ORDERS:
        chosen = _only_set_in_order(
            problem.lifetimes, sorted(problem.lifetimes.recomputable, key=key), budget_bytes
        )
        if chosen is not None:
            return chosen
    return None


def _only_set_in_order(lt: Lifetimes, rec: list[Candidate], budget_bytes: int) -> list[str] | None:
    """Rebuilds taken in the order of ``rec`` at the op of largest excess, pass after pass (module
    docstring), or None when they cannot cover it."""
    chosen: dict[str, None] = {}
    mem = lt.baseline_memory_bytes
    # Every pass covers the worst op's excess at least once more: at most one pass per recomputable.
    for _ in range(len(rec) + 1):
        over = mem - budget_bytes
        k = int(np.argmax(over))
        if over[k] <= 0:
            return list(chosen)
        left = int(over[k])
        for c in rec:
            if c.name not in chosen and c.inactive_start_idx <= k <= c.inactive_end_idx:
                chosen[c.name] = None
                left -= c.nbytes
                if left <= 0:
                    break
        else:
            if left > 0:
                return None  # nothing left to rebuild at the worst op
        needs = lt.effective_needs(chosen)
        mem = lt.memory_with([lt.recompute_decision(n, needs) for n in needs.order])
        # A rebuild whose effective need moved before the worst op frees nothing there; the next pass
        # adds more, or gives up when none is left.
    return None


def rebuild_ratio(problem: Problem) -> dict[str, float]:
    """Per recomputable tensor: its rebuild time over the I/O and CPU time offloading it would take on
    the default tier (the joint plan's ranking)."""
    tier = problem.hardware.tier(problem.default_tier)
    out = {}
    for c in problem.lifetimes.recomputable:
        io_s = tier.write_s(c.nbytes) + tier.read_s(c.nbytes) + 2 * tier.cpu_s(c.nbytes)
        out[c.name] = c.recompute_us / 1e6 / io_s if io_s > 0 else float("inf")
    return out


@dataclass
class Evaluated:
    """One recompute set with the offload plan of its residual step, judged by the simulator."""

    recomputed: tuple[str, ...]
    decisions: list[Decision]
    sim: SimResult
    label: str


def better(a: SimResult, b: SimResult) -> bool:
    """Within budget first, then the faster step, then fewer bytes moved and rebuilt."""
    if a.within_budget != b.within_budget:
        return a.within_budget
    if not a.within_budget:
        return a.peak_bytes < b.peak_bytes
    if abs(a.step_s - b.step_s) > 1e-9:
        return a.step_s < b.step_s
    return a.written_bytes + a.recomputed_bytes < b.written_bytes + b.recomputed_bytes


def evaluate(problem: Problem, recomputed, budget_bytes: int, label: str = "") -> Evaluated | None:
    """Recompute ``recomputed``, offload the residual step's excess with the pipeline (mode "joint") or
    nothing (mode "only"); None when the residual step cannot meet the budget."""
    names = tuple(recomputed)
    if not names:
        if not problem.plans_offload:
            sim = problem.simulate([])
            return Evaluated((), [], sim, label) if sim.peak_bytes <= budget_bytes else None
        decisions = pipeline_decisions(problem, budget_bytes)
        return Evaluated((), decisions, problem.simulate(decisions), label)
    res = problem.residual(names)
    if any(d.fetch_before_idx <= d.wait_before_idx for d in res.lifetimes.recompute_decisions):
        # A rebuild needed by the first backward op reads a recomputed tensor last used by the last
        # forward op: that tensor would be rebuilt where it was never absent, which no plan may do
        # (planner.simulate's order rule). Not a plan of this set; another set leaves it saved.
        return None
    if problem.plans_offload:
        if budget_bytes < res.lifetimes.min_feasible_peak_bytes or (
            not problem.hardware.available_tiers() and budget_bytes < res.lifetimes.baseline_peak_bytes
        ):
            return None
        moved = pipeline_decisions(res, budget_bytes) if problem.hardware.available_tiers() else []
    else:
        if budget_bytes < res.lifetimes.baseline_peak_bytes:
            return None
        moved = []
    decisions = [*res.lifetimes.recompute_decisions, *moved]
    return Evaluated(names, decisions, problem.simulate(decisions), label)


def recompute_plans(problem: Problem, budget_bytes: int) -> list[Evaluated]:
    """Every plan the pipeline judges in its mode (module docstring)."""
    if not problem.hardware.available_tiers():
        problem = dataclasses.replace(problem, recompute="only")  # nowhere to offload to
    out = []
    if problem.plans_offload:
        out.append(evaluate(problem, (), budget_bytes, "offload only"))
    only = recompute_only_set(problem, budget_bytes)
    if only is not None:
        out.append(
            evaluate(dataclasses.replace(problem, recompute="only"), only, budget_bytes, "recompute only")
        )
    if problem.recompute == "joint":
        ratio = rebuild_ratio(problem)
        seen = {(), tuple(sorted(only or ()))}
        ranked = sorted(problem.lifetimes.recomputable, key=lambda c: (ratio[c.name], c.producer_idx))
        # Thresholds on the ratio, and the k best-ranked tensors for k = 1, 2, 4, ...: on a slow disk
        # every ratio is small, so every threshold takes the whole recomputable set, which may not fit
        # (rebuilds hold their inputs and intermediates), and only the prefixes find the mixed plans.
        grid = [
            (f"rebuild/io <= {th:g}", tuple(c.name for c in ranked if ratio[c.name] <= th))
            for th in JOINT_THRESHOLDS
        ]
        k = 1
        while k < len(ranked):
            grid.append((f"{k} best rebuild/io", tuple(c.name for c in ranked[:k])))
            k *= 2
        for label, names in grid:
            key = tuple(sorted(names))
            if key in seen:
                continue
            seen.add(key)
            out.append(evaluate(problem, names, budget_bytes, label))
    return [e for e in out if e is not None]


def best_recompute_plan(problem: Problem, budget_bytes: int) -> Evaluated:
    """The pipeline's plan in the problem's recompute mode (module docstring).

    Raises:
        BudgetError: recompute only, and recomputing every tensor it can still exceeds the budget.
    """
    best = None
    for e in recompute_plans(problem, budget_bytes):
        if best is None or better(e.sim, best.sim):
            best = e
    if best is None:
        raise BudgetError(
            f"recomputing cannot bring the peak within {budget_bytes} bytes (recompute=only); allow "
            f"offloading (recompute=joint) or a larger budget"
        )
    return best


@register_solver("pipeline", recompute_modes=("off", "only", "joint"))
def solve_pipeline(problem: Problem) -> Plan:
    """The constructive plan of the module docstring. For "auto" it plans the smallest achievable peak
    (``solve`` bisects over budgets instead)."""
    t0 = time.perf_counter()
    lt = problem.lifetimes
    budget = problem.budget_bytes if problem.budget_bytes is not None else problem.floor_bytes()
    extra = {}
    if problem.plans_recompute:
        chosen = best_recompute_plan(problem, budget)
        decisions = chosen.decisions
        extra["recompute"] = {
            "mode": problem.recompute,
            "chosen": chosen.label,
            "recomputed": len(chosen.recomputed),
        }
    elif problem.recompute == "only":
        if budget < lt.baseline_peak_bytes:
            raise BudgetError(
                f"nothing can be recomputed (the profile has no rebuild recipes), so no plan of recompute=only "
                f"meets a budget below the unplanned peak of {lt.baseline_peak_bytes} bytes"
            )
        decisions = []
    else:
        decisions = pipeline_decisions(problem, budget)
    problem.report(1.0, f"pipeline: {len(decisions)} decisions")
    stats = SolverStats(solver="pipeline", status="HEURISTIC", wall_s=time.perf_counter() - t0, extra=extra)
    return make_plan(problem, decisions, stats)
