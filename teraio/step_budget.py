"""One memory budget for a whole training step that runs several graphs (graph breaks, accumulation).

Each graph is planned on its own (its Profile, its Plan), but the budget bounds the step. While one
graph runs, every other forward invocation still in flight holds what it keeps between its forward and
its backward: its outputs and the saved tensors its plan leaves in memory. So the step's peak is

    max over the step's graph calls c of  peak(graph of c) + sum of held(i) over invocations i != c in flight

with ``peak`` the graph's (predicted) peak and ``held`` what an invocation keeps after its forward.
This module composes that from the last complete step's call sequence, and divides the step budget:
each graph gets the budget minus what the others hold while it runs, re-planned until the held bytes
settle (offloading more in one graph lowers what it holds during the others).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from teraio.planner.budget import BudgetError, format_size


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
    plan_graph: Callable[[Hashable, int], GraphMemory],
    min_peak: dict[Hashable, int],
    describe: Callable[[Hashable], str],
    rounds: int = 3,
) -> dict[Hashable, int]:
    """Per-graph budgets whose composed step peak fits ``budget_bytes``.

    Args:
        unplanned: each graph's memory without a plan (the start).
        plan_graph: plans one graph for a budget and returns its memory under that plan.
        min_peak: each graph's smallest achievable peak (everything offloadable moved).
        describe: a graph's name for error messages.

    Raises:
        BudgetError: no split fits; names the graph and the smallest achievable step peak.
    """
    memory = dict(unplanned)
    budgets: dict[Hashable, int] = {}
    for _ in range(rounds):
        held = others_held_max(calls, memory)
        changed = False
        for g in memory:
            b = budget_bytes - held.get(g, 0)
            if b < min_peak[g]:
                _raise_infeasible(calls, budget_bytes, memory, min_peak, g, describe)
            if budgets.get(g) != b:
                budgets[g] = b
                memory[g] = plan_graph(g, b)
                changed = True
        if not changed:
            break
    peak, at = step_peak(calls, memory)
    if peak > budget_bytes:
        _raise_infeasible(calls, budget_bytes, memory, min_peak, at, describe)
    return budgets


def _raise_infeasible(calls, budget_bytes, memory, min_peak, graph, describe) -> None:
    floor = {g: GraphMemory(min_peak[g], min(memory[g].held_bytes, min_peak[g])) for g in memory}
    smallest, _ = step_peak(calls, floor)
    raise BudgetError(
        f"memory_budget {format_size(budget_bytes)} cannot be met for the step: {describe(graph)} needs at "
        f"least {format_size(min_peak[graph])} while the step's other graphs hold memory; the smallest "
        f"achievable peak of the step is about {format_size(smallest)} ({smallest} bytes): use a budget "
        "of at least that"
    )
