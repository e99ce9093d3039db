"""One memory budget for a whole training step that runs several graphs (graph breaks, accumulation).

Each graph is planned on its own (its Profile, its Plan), but the budget bounds the step. While one
graph runs, every other forward invocation still in flight holds what it keeps between its forward and
its backward: its outputs and the saved tensors its plan leaves in memory. So the step's peak is

    max over the step's graph calls c of  peak(graph of c) + sum of held(i) over invocations i != c in flight

with ``peak`` the graph's (predicted) peak and ``held`` what an invocation keeps after its forward.
This module composes that from the last complete step's call sequence, and divides the step budget:
each graph gets the budget minus what the others hold while it runs (offloading more in one graph
lowers what it holds during the others, so the split is searched, not computed once).

Note: [A call's saved tensors leave while the next blocks run]
    A graph's plan minimises its own step time under its own peak, and its own timeline has its
    backward right after its forward. So what a call holds between the two costs that plan nothing
    unless it raises the graph's own peak: at its smallest peak, a block's plan kept about half of its
    saved tensors (a Llama-shaped model, 3 layers each compiled on its own: 1.75 of 3.3 MiB), and the
    composition, adding the earlier blocks' held bytes to the last block's peak, could not go below 58%
    of the step's unplanned peak, where the same model as one graph ran at 40% (one plan sees the first
    layers' tensors idle while the later layers run, and moves them). When the split above finds no
    fit and some call's forward is followed by other calls before its backward, the split is searched
    again with each such graph also told how much less to hold: its profile gets, at its first backward
    op, ``other_bytes`` that leave that op only the unplanned memory there less ``reduce`` bytes
    (:func:`held_cap_profile`), so its plan must have moved at least that much by then. ``reduce`` goes
    from everything its candidates can free there (at the graph's smallest budget) down to nothing (at
    its largest), with the same scale as the budget. The plan's own timeline still has no gap between
    forward and backward, so the moves it adds may predict stalls that the other calls' compute hides
    in practice (pessimistic, as Note: [A graph called several times per step is planned per call] in
    teraio.lifecycle.step_planner says), and its predicted peak may count the added bytes (at most its
    budget). The first search runs alone whenever it fits, so plans that fit before are unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from teraio.planner.budget import BudgetError, format_size

if TYPE_CHECKING:
    from teraio.planner.lifetimes import Lifetimes
    from teraio.planner.profile import Profile


@dataclass(frozen=True)
class GraphMemory:
    """What the composition needs of one graph under its current plan (or none)."""

    peak_bytes: int  # the graph's own peak while it runs (forward or backward)
    held_bytes: int  # what one invocation keeps between the end of its forward and its backward


Call = tuple[Hashable, str, int]  # (graph, "fwd" | "bwd", invocation id)


def step_peak(calls: Sequence[Call], memory: dict[Hashable, GraphMemory]) -> tuple[int, Hashable | None]:
    """The composed peak of a step and the graph running at that peak."""
    held: dict[int, int] = {}  # invocation -> bytes it holds while others run
    best, at = 0, None
    for graph, kind, inv in calls:
        m = memory[graph]
        others = sum(b for i, b in held.items() if i != inv)
        if m.peak_bytes + others > best:
            best, at = m.peak_bytes + others, graph
        if kind == "fwd":
            held[inv] = m.held_bytes
        else:
            held.pop(inv, None)
    return best, at


def held_at_forward_calls(calls: Sequence[Call], memory: dict[Hashable, GraphMemory]) -> list[int]:
    """The bytes earlier invocations hold when each forward call starts, in call order."""
    held: dict[int, int] = {}
    out: list[int] = []
    for graph, kind, inv in calls:
        if kind == "fwd":
            out.append(sum(b for i, b in held.items() if i != inv))
            held[inv] = memory[graph].held_bytes
        else:
            held.pop(inv, None)
    return out


def others_held_max(calls: Sequence[Call], memory: dict[Hashable, GraphMemory]) -> dict[Hashable, int]:
    """Per graph: the most that other invocations hold during any of its calls."""
    held: dict[int, int] = {}
    out: dict[Hashable, int] = {}
    for graph, kind, inv in calls:
        others = sum(b for i, b in held.items() if i != inv)
        out[graph] = max(out.get(graph, 0), others)
        if kind == "fwd":
            held[inv] = memory[graph].held_bytes
        else:
            held.pop(inv, None)
    return out


def split_budget(
    calls: Sequence[Call],
    budget_bytes: int,
    unplanned: dict[Hashable, GraphMemory],
    plan_graph: Callable[[Hashable, int, bool], GraphMemory],
    min_peak: dict[Hashable, int],
    min_held: dict[Hashable, int],
    describe: Callable[[Hashable], str],
    bisections: int = 7,
    relax: Sequence[Hashable] = (),
) -> dict[Hashable, int]:
    """Per-graph budgets whose composed step peak fits ``budget_bytes``; plans every graph for them.

    When no graph runs while another invocation is in flight (one graph, one forward and its backward),
    each graph simply gets the whole budget. Otherwise each graph's budget lies between its smallest
    achievable peak and the budget minus the least the others can hold; one scale ``s`` in [0, 1]
    places every graph in its range, and the largest ``s`` whose plans compose within the budget is
    found by bisection with fast plans, then planned for real.

    Args:
        plan_graph: ``(graph, budget, fast)`` -> the graph's memory under a plan for that budget;
            ``fast`` plans are for the search, the last call for each graph is the real plan.
        min_peak: each graph's smallest achievable peak (everything offloadable moved).
        min_held: what one invocation of each graph holds at the least after its forward.
        relax: nodes planned per call of a graph that runs several times in a step (Note: [A graph
            called several times per step is planned per call] in teraio.lifecycle.step_planner), latest forward
            first. They start at their smallest peak (everything offloadable moved) while the scale is
            searched for the other graphs, then each in turn gets the largest budget that still
            composes: the calls whose saved tensors are held for the shortest time keep them first.

    Raises:
        BudgetError: no split fits; names the graph and the smallest achievable step peak.
    """
    graphs = list(unplanned)
    floor_held = others_held_max(
        calls, {g: GraphMemory(m.peak_bytes, min_held[g]) for g, m in unplanned.items()}
    )
    top = {g: budget_bytes - floor_held.get(g, 0) for g in graphs}
    for g in graphs:
        if top[g] < min_peak[g]:
            floor = {h: GraphMemory(min_peak[h], min_held[h]) for h in graphs}
            _raise_infeasible(step_peak(calls, floor)[0], budget_bytes, min_peak, g, describe)
    if not _overlapping(calls):  # no graph runs while another invocation is in flight
        for g in graphs:
            plan_graph(g, top[g], False)
        return top

    pinned = set(relax)

    def at(scale: float) -> dict[Hashable, int]:
        return {
            g: min_peak[g] if g in pinned else int(min_peak[g] + scale * (top[g] - min_peak[g]))
            for g in graphs
        }

    def fits(budgets: dict[Hashable, int], fast: bool) -> tuple[bool, int, Hashable | None]:
        memory = {g: plan_graph(g, b, fast) for g, b in budgets.items()}
        peak, worst = step_peak(calls, memory)
        return peak <= budget_bytes, peak, worst

    lo, hi = None, 1.0
    ok, _, worst = fits(at(hi), True)
    if ok:
        lo = hi
    else:
        low = 0.0
        ok0, smallest, worst = fits(at(low), True)
        if not ok0:  # every graph at its smallest peak still composes over the budget
            _raise_infeasible(smallest, budget_bytes, min_peak, worst, describe)
        lo = low
        for _ in range(bisections):
            mid = (lo + hi) / 2
            if fits(at(mid), True)[0]:
                lo = mid
            else:
                hi = mid
    budgets = at(lo)
    for g in relax:
        low_b, high_b = budgets[g], top[g]
        for attempt in range(bisections // 2 + 1):
            trial_b = high_b if attempt == 0 else (low_b + high_b) // 2
            if trial_b <= low_b:
                break
            trial = {**budgets, g: trial_b}
            if fits(trial, True)[0]:
                budgets, low_b = trial, trial_b
                if attempt == 0:
                    break
            else:
                high_b = trial_b
    real = {g: plan_graph(g, b, False) for g, b in budgets.items()}
    if not relax and step_peak(calls, real)[0] <= budget_bytes:
        return budgets
    # The fast plans at these budgets compose within the budget (the search checked it). The real solver
    # spends a budget on time, not on what a call holds, so its plans may compose worse; and with
    # ``relax`` the split of memory between the calls is the fast plans'. So each graph keeps its real
    # plan only where it neither peaks nor holds more than its fast one: the composition then cannot get
    # worse than the fast plans'.
    fast = {g: plan_graph(g, b, True) for g, b in budgets.items()}
    for g in graphs:
        if real[g].held_bytes <= fast[g].held_bytes and real[g].peak_bytes <= fast[g].peak_bytes:
            plan_graph(g, budgets[g], False)
    return budgets


def max_reduce_bytes(lifetimes: Lifetimes) -> int:
    """The most a graph's plan can free at its first backward op: its unplanned memory there less its
    memory with every candidate away over its whole idle interval (0 without a backward)."""
    nf = lifetimes.num_fwd_ops
    if nf >= lifetimes.num_ops:
        return 0
    return max(0, int(lifetimes.baseline_memory_bytes[nf]) - int(lifetimes.min_memory_bytes[nf]))


def held_cap_profile(profile: Profile, lifetimes: Lifetimes, budget_bytes: int, reduce_bytes: int) -> Profile:
    """``profile`` (``lifetimes`` its analysis) with ``other_bytes`` at its first backward op that leave
    that op, within ``budget_bytes``, its unplanned memory less ``reduce_bytes``: a plan for the budget
    then moves at least that much by then (Note: [A call's saved tensors leave while the next blocks run])."""
    nf = lifetimes.num_fwd_ops
    if reduce_bytes <= 0 or nf >= lifetimes.num_ops:
        return profile
    # Against the budget the solvers plan within (Note: [An offloaded tensor leaves a token] in
    # planner.lifetimes), or the tokens' room would be asked of the moved bytes too.
    solver_budget = budget_bytes - lifetimes.token_reserve_bytes
    extra = solver_budget - (int(lifetimes.baseline_memory_bytes[nf]) - reduce_bytes)
    if extra <= 0:  # the budget asks for that much already
        return profile
    ops = profile.ops.copy()
    other = (
        ops["other_bytes"].fillna(0).to_numpy(dtype=np.int64, copy=True)
        if "other_bytes" in ops.columns
        else np.zeros(len(ops), dtype=np.int64)
    )
    other[nf] += extra
    ops["other_bytes"] = other
    return dataclasses.replace(profile, ops=ops)


def waiting_graphs(calls: Sequence[Call]) -> set[Hashable]:
    """The graphs with a call whose forward is followed by other calls before its backward: what they
    hold in between counts in the step's peak."""
    waiting: set[Hashable] = set()
    open_fwd: dict[int, Hashable] = {}
    for graph, kind, inv in calls:
        for i, g in open_fwd.items():
            if i != inv:
                waiting.add(g)
        if kind == "fwd":
            open_fwd[inv] = graph
        else:
            open_fwd.pop(inv, None)
    return waiting


def split_budget_holding_less(
    calls: Sequence[Call],
    budget_bytes: int,
    unplanned: dict[Hashable, GraphMemory],
    plan_graph: Callable[[Hashable, int, bool, int], GraphMemory],
    min_peak: dict[Hashable, int],
    min_held: dict[Hashable, int],
    describe: Callable[[Hashable], str],
    max_reduce: dict[Hashable, int],
    bisections: int = 7,
    relax: Sequence[Hashable] = (),
) -> dict[Hashable, int]:
    """:func:`split_budget`, and when it finds no fit, searched again with the graphs whose calls wait
    for others also told to hold less (Note: [A call's saved tensors leave while the next blocks run]).

    Args:
        plan_graph: ``(graph, budget, fast, reduce_bytes)`` -> the graph's memory under a plan for that
            budget that frees at least ``reduce_bytes`` at its first backward op (0: no such bound).
        max_reduce: per graph, the most ``reduce_bytes`` can be (:func:`max_reduce_bytes`).
        The others: as :func:`split_budget`'s.

    Raises:
        BudgetError: neither search fits; the one naming the smaller achievable step peak.
    """
    try:
        return split_budget(
            calls,
            budget_bytes,
            unplanned,
            lambda g, b, fast: plan_graph(g, b, fast, 0),
            min_peak,
            min_held,
            describe,
            bisections,
            relax,
        )
    except BudgetError as exc:
        first = exc
    waiting = {g for g in waiting_graphs(calls) if max_reduce.get(g, 0) > 0}
    if not waiting:
        raise first
    floor_held = others_held_max(
        calls, {g: GraphMemory(m.peak_bytes, min_held[g]) for g, m in unplanned.items()}
    )
    top = {g: budget_bytes - floor_held.get(g, 0) for g in unplanned}

    def holding_less(g: Hashable, b: int, fast: bool) -> GraphMemory:
        if g not in waiting:
            return plan_graph(g, b, fast, 0)
        span = top[g] - min_peak[g]
        share = 1.0 if span <= 0 else min(1.0, max(0.0, (b - min_peak[g]) / span))
        return plan_graph(g, b, fast, int(max_reduce[g] * (1.0 - share)))

    try:
        return split_budget(
            calls, budget_bytes, unplanned, holding_less, min_peak, min_held, describe, bisections, relax
        )
    except BudgetError as second:
        smaller = (second.smallest_peak_bytes or 0) < (first.smallest_peak_bytes or 0)
        raise (second if smaller else first) from None


def _overlapping(calls: Sequence[Call]) -> bool:
    in_flight: set[int] = set()
    for _graph, kind, inv in calls:
        if in_flight - {inv}:
            return True
        if kind == "fwd":
            in_flight.add(inv)
        else:
            in_flight.discard(inv)
    return False


def _raise_infeasible(smallest: int, budget_bytes: int, min_peak, graph, describe) -> None:
    raise BudgetError(
        f"memory_budget {format_size(budget_bytes)} cannot be met for the step: {describe(graph)} needs at "
        f"least {format_size(min_peak[graph])} while the step's other invocations hold memory; the smallest "
        f"achievable peak of the step is about {format_size(smallest)} ({smallest} bytes): use a budget "
        "of at least that",
        smallest_peak_bytes=int(smallest),
    )
