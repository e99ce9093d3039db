"""Planning a training step: one memory budget for every graph the step calls, and each graph's plan.

A step may call several graphs (graph breaks, a model and its loss), one graph several times (a block
compiled on its own), and hold memory no graph allocates (Note: [Memory outside the graphs is measured
and planned for] in teraio.lifecycle.measurement) or the model's states (teraio.states). The budget is of
the whole step; the torch-free search for each graph's share is ``teraio.planner.budget_split``. This
module turns the backend's runners and their profiles into that search's nodes, solves each graph's plan
for the share it is given, and predicts the step's peak under the plans (which the measured step is
compared with).

Note: [A graph called several times per step is planned per call]
    One graph may run several times in a step with its invocations in flight together: each block of
    a model compiled on its own (``block.compile()``, torchtitan's way, with or without FSDP2) gives
    Dynamo one graph that runs once per block. The first block's saved tensors are held from its
    forward to the end of the backward; the last block's backward follows its forward at once. So
    each call of a step (its ordinal among the graph's forwards in the step) is a node of the step's
    composition with a plan of its own: the calls start with everything offloadable moved, and from
    the latest forward back, each gets the largest budget that still composes within the step's
    (teraio.planner.budget_split.split_budget's ``relax``). The last calls keep what they save; the first,
    idle longest, move it. At most MAX_PLANS_PER_GRAPH plans per graph (consecutive calls share one)
    bound the compilations. A call beyond those planned (a step with more calls) takes the first
    call's plan, which holds the least. Each plan's own time model still sees its forward followed
    by its backward: the I/O of the early calls hides behind the other blocks' compute in practice,
    which the prediction does not count (it is pessimistic there).

Note: [The step is planned once every graph it calls is profiled]
    A graph's profiling counts its calls, so a graph called once per block (``backend.compile(model)``,
    teraio.lifecycle.model_compile) finishes profiling steps before the embeddings' and the head's
    graphs, called once a step. Planned then, alone, it took the whole budget; the others, planned a
    step later beside its fixed plans, found none left (the README's tiny GPT at 50%: refused with a
    smallest peak of 1.59 MiB for a 1.52 MiB budget). So while a training graph is still profiling that
    the last step of some kind called together with a graph ready to plan, the graphs ready to plan wait
    (at most MAX_WAIT_STEPS steps, in case a graph never finishes) and the step is planned at once. A
    graph only another kind of step calls (the smaller last batch of an epoch) does not hold them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from teraio.lifecycle.phases import Phase
from teraio.lifecycle.runner import GraphRunner, describe_plan
from teraio.lifecycle.steps import invocation_ordinals
from teraio.planner.budget_split import GraphMemory, held_at_forward_calls, step_peak
from teraio.planner.plan import Plan
from teraio.planner.profile import Profile
from teraio.sizes import format_size
from teraio.states.residency import held_by_graphs, whole_step_budget_error

if TYPE_CHECKING:
    from teraio.config import BackendConfig
    from teraio.lifecycle.measurement import OutsideMemory
    from teraio.lifecycle.ranks import RankAgreement
    from teraio.lifecycle.step_stats import StepStats
    from teraio.planner.hardware import HardwareModel
    from teraio.planner.lifetimes import Lifetimes
    from teraio.states.residency import WholeStepStates

log = logging.getLogger("teraio")

#: Plans per graph at most, for a graph called several times per step (Note: [A graph called several
#: times per step is planned per call]): each distinct plan is one more compilation.
MAX_PLANS_PER_GRAPH = 4

#: Steps the graphs ready to plan wait at most for the step's other graphs to finish profiling (Note:
#: [The step is planned once every graph it calls is profiled]).
MAX_WAIT_STEPS = 4

Node = tuple[GraphRunner, int]  # a graph and the group of its calls in a step that share one plan
Call = tuple[Any, str, int]  # (graph or node, "fwd" | "bwd", invocation id)


def held_bytes(r: GraphRunner, plan: Plan | None) -> int:
    """What a call of ``r`` holds between its forward and its backward under ``plan`` (None: none)."""
    after = int(r.profile.meta.get("census_after_fwd_bytes", 0))
    if plan is None:
        return after
    # Note: [An offloaded tensor leaves a token] in planner.lifetimes
    tokens = int(r.profile.meta.get("offload_token_bytes", 0)) * len(plan.offloads)
    return max(0, after - plan.moved_bytes + tokens)


class StepPlanner:
    """Plans the steps of one backend and predicts their peaks."""

    def __init__(
        self,
        cfg: BackendConfig,
        runners: list[GraphRunner],
        step_stats: StepStats,
        ranks: RankAgreement,
        outside: OutsideMemory,
        whole_step: WholeStepStates | None,
        hardware_model: Callable[[], HardwareModel],
        save_plan: Callable[[GraphRunner], None],
    ) -> None:
        self.cfg = cfg
        self.runners = runners  # the backend's, as they come
        self.step_stats = step_stats
        self.ranks = ranks
        self.outside = outside
        self.whole_step = whole_step
        self.hardware_model = hardware_model
        self.save_plan = save_plan
        self.predicted_step_peak_bytes: int | None = None
        self._waiting_since_step: int | None = None
        #: The step budget in bytes of the last plan, and the whole step's unplanned peak it was resolved
        #: against (Note: [The partitioner's budget is part of the plan] in teraio.lifecycle.partitioner_search).
        self.last_budget_bytes: int | None = None
        self.last_unplanned_bytes: int | None = None
        #: When set, the step budget in bytes, instead of resolving ``memory_budget`` against this step's
        #: unplanned peak (the partitioner search's later candidates: a fraction is of the default partition).
        self.budget_bytes_override: int | None = None

    def waits_for_profiles(self, step_index: int) -> bool:
        """Whether the graphs ready to plan wait at step ``step_index`` for a graph still profiling that a
        step calls with them (Note: [The step is planned once every graph it calls is profiled])."""
        profiling = False
        for kind in self.step_stats.kinds.values():  # a graph another kind of step calls is planned alone
            called = {g for g, _, _ in kind.last_calls}
            if any(r.phase is Phase.PLANNING for r in called):
                profiling |= any(r.phase is Phase.PROFILING and r.is_training for r in called)
        if not profiling:
            self._waiting_since_step = None
            return False
        if self._waiting_since_step is None:
            self._waiting_since_step = step_index
        return step_index - self._waiting_since_step < MAX_WAIT_STEPS

    def plan(self, ready: list[GraphRunner]) -> None:
        """Plan the graphs in ``ready`` for one step budget, with the step's other graphs as planned."""
        _StepComposition(self, ready).plan()

    # ---------------------------------------------------------------------------------- the calls
    def step_calls(self, graphs: list[GraphRunner], absent_too: bool = True) -> list[Call]:
        """The calls among ``graphs`` of every kind of step seen (teraio.lifecycle.step_stats), one kind after
        the other: a kind's invocations all end within it, so the composed peak of the sequence is the
        largest of any kind's (a discriminator's step with two forwards, and its other step with one, are
        both bounded). With ``absent_too``, graphs that no complete step called are appended as one
        forward and backward each (planned as if they ran alone)."""
        calls = [
            (g, k, i) for kind in self.step_stats.kinds.values() for g, k, i in kind.last_calls if g in graphs
        ]
        if not absent_too:
            return calls
        seen = {g for g, _, _ in calls}
        for n, r in enumerate(g for g in graphs if g not in seen):
            calls += [(r, "fwd", -1 - n), (r, "bwd", -1 - n)]
        return calls

    def solve(
        self,
        runner: GraphRunner,
        budget: int | str,
        solver: str | None = None,
        quiet: bool = False,
        profile: Profile | None = None,
    ) -> Plan:
        """One graph's plan for ``budget`` (bytes, or "auto"), by ``solver`` (default: the configured), from
        ``profile`` (default: the runner's; Note: [A call's saved tensors leave while the next blocks run]
        in teraio.planner.budget_split gives it another)."""
        from teraio.planner.solve import default_recompute, solve

        name = solver or self.cfg.solver.name
        t0 = time.perf_counter()
        plan = solve(
            profile if profile is not None else runner.profile,
            budget=budget,
            solver=name,
            hardware=self.hardware_model(),
            time_limit_s=float(self.cfg.solver.time_limit),
            deterministic_time_s=self.cfg.solver.deterministic_time_limit,
            workers=self.cfg.solver.workers,
            # The fast plans of the budget search are greedy's: offload only.
            recompute="off" if solver == "greedy" else (self.cfg.solver.recompute or default_recompute(name)),
        )
        log.log(
            logging.DEBUG if quiet else logging.INFO,
            "%s: plan by %s in %.1f s %s; predicted peak %s, step %.3f s",
            runner.name,
            plan.solver,
            time.perf_counter() - t0,
            describe_plan(plan),
            format_size(plan.predicted_peak_bytes),
            plan.predicted_step_s,
        )
        return plan

    # -------------------------------------------------------------------------------- predictions
    def graph_memory(self, r: GraphRunner, ordinal: int = 0) -> GraphMemory | None:
        """A graph's peak and what its ``ordinal``-th call of a step holds between forward and backward,
        under its plan (or unplanned, from its profile; None when it was never profiled)."""
        if r.profile is None:
            return None
        plan = r.plan_for(ordinal)
        held = held_bytes(r, plan if plan else None)
        if plan is not None and self.cfg.enabled and plan.decisions:
            return GraphMemory(plan.predicted_peak_bytes, held)
        return GraphMemory(r.unplanned_peak_bytes(), held)

    def predicted_peak(self, calls: list[Call]) -> int | None:
        """The composed prediction for a step with these calls (teraio.planner.budget_split), None when a
        graph of it has no profile to predict from."""
        ordinals = invocation_ordinals(calls)
        nodes = [((g, ordinals.get(i, 0)), k, i) for g, k, i in calls]
        memory = {n: self.graph_memory(*n) for n, _, _ in nodes}
        if any(m is None for m in memory.values()):
            return None
        return step_peak(nodes, memory)[0] + self.outside.bytes - self.kept_held_bytes()

    def kept_held_bytes(self) -> int:
        """Note: [Two moments bound the kept states] in teraio.planner.kept_states."""
        return self.whole_step.kept_held_bytes if self.whole_step is not None else 0


@dataclass
class _StepComposition:
    """One planning of a step: its calls as nodes of the composition, and the plans made for them."""

    planner: StepPlanner
    ready: list[GraphRunner]
    counts: dict[GraphRunner, int] = field(default_factory=dict)  # calls of each graph in a step
    ordinals: dict[int, int] = field(default_factory=dict)  # invocation -> its graph's calls before it
    node_calls: list[Call] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    first_ordinal: dict[Node, int] = field(default_factory=dict)
    lifetimes: dict[GraphRunner, Lifetimes] = field(default_factory=dict)
    memory: dict[Node, GraphMemory] = field(default_factory=dict)  # as planned before this planning
    plans: dict[Node, Plan] = field(default_factory=dict)
    #: One plan per budget (and bytes it frees at its first backward op).
    solved: dict[tuple[GraphRunner, int, bool, int], Plan] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from teraio.planner.lifetimes import analyse

        graphs = [r for r in self.planner.runners if r.profile is not None and r.is_training]
        calls = self.planner.step_calls(graphs)
        self.ordinals = invocation_ordinals(calls)
        for g, _, i in calls:
            self.counts[g] = max(self.counts.get(g, 0), self.ordinals.get(i, 0) + 1)
        self.node_calls = [(self.node_of(g, i), k, i) for g, k, i in calls]
        self.nodes = list(dict.fromkeys(n for n, _, _ in self.node_calls))
        for g, _, i in calls:
            self.first_ordinal.setdefault(self.node_of(g, i), self.ordinals.get(i, 0))
        self.lifetimes = {r: analyse(r.profile) for r in graphs}
        planned = {n: n[0].plan_for(self.first_ordinal[n]) for n in self.nodes if n[0] not in self.ready}
        self.memory = {n: self.memory_of(n, planned.get(n)) for n in self.nodes}

    # ------------------------------------------------------------------------------- the nodes
    def group(self, r: GraphRunner, ordinal: int) -> int:
        """Which plan of ``r`` its ``ordinal``-th call of a step runs (at most MAX_PLANS_PER_GRAPH)."""
        n = self.counts.get(r, 1)
        return ordinal * MAX_PLANS_PER_GRAPH // n if n > MAX_PLANS_PER_GRAPH else ordinal

    def node_of(self, g: GraphRunner, inv: int) -> Node:
        return (g, self.group(g, self.ordinals.get(inv, 0)))

    def memory_of(self, node: Node, plan: Plan | None) -> GraphMemory:
        r = node[0]
        if plan is None:
            return GraphMemory(self.lifetimes[r].baseline_peak_bytes, held_bytes(r, None))
        return GraphMemory(plan.predicted_peak_bytes, held_bytes(r, plan))

    def plan_graph(self, n: Node, b: int, fast: bool, reduce_bytes: int = 0) -> GraphMemory:
        """Plan ``n``'s graph for ``b`` bytes (greedy when ``fast``), freeing at least ``reduce_bytes`` at
        its first backward op (Note: [A call's saved tensors leave while the next blocks run] in
        teraio.planner.budget_split); graphs not being planned keep theirs."""
        from teraio.planner.budget import BudgetError
        from teraio.planner.budget_split import held_cap_profile

        r = n[0]
        if r not in self.ready:
            return self.memory[n]
        key = (r, b, fast, reduce_bytes)
        if key not in self.solved:
            solver = "greedy" if fast else None
            if reduce_bytes > 0:
                capped = held_cap_profile(r.profile, self.lifetimes[r], b, reduce_bytes)
                try:
                    self.solved[key] = self.planner.solve(r, b, solver=solver, quiet=fast, profile=capped)
                except BudgetError:  # not within the budget that way: the graph's own plan
                    self.solved[key] = self.plan_graph_solved(r, b, fast)
            else:
                self.solved[key] = self.plan_graph_solved(r, b, fast)
        self.plans[n] = self.solved[key]
        return self.memory_of(n, self.plans[n])

    def plan_graph_solved(self, r: GraphRunner, b: int, fast: bool) -> Plan:
        key = (r, b, fast, 0)
        if key not in self.solved:
            self.solved[key] = self.planner.solve(r, b, solver="greedy" if fast else None, quiet=fast)
        return self.solved[key]

    def min_held(self, n: Node) -> int:
        """The least a call of ``n`` can hold between forward and backward (everything movable moved)."""
        r = n[0]
        if r not in self.ready:
            return self.memory[n].held_bytes
        t = r.profile.tensors
        movable = t.loc[t["offloadable"] & (t["first_bwd_use_idx"] >= 0), "nbytes"]
        tokens = int(r.profile.meta.get("offload_token_bytes", 0)) * len(movable)  # Note in held_bytes
        return max(0, held_bytes(r, None) - int(movable.sum()) + tokens)

    def peak_with(self, plan_of: Callable[[Node], Plan | None], nodes: list[Node]) -> int:
        """The composed step peak with ``nodes`` under ``plan_of``'s plans, the others as planned before."""
        return step_peak(
            self.node_calls, {**self.memory, **{n: self.memory_of(n, plan_of(n)) for n in nodes}}
        )[0]

    # ------------------------------------------------------------------------------- planning
    def plan(self) -> None:
        from teraio.planner import budget_split as step_budget
        from teraio.planner.budget import BudgetError, resolve_budget

        planner, ready, nodes = self.planner, self.ready, self.nodes
        step_unplanned, _ = step_peak(self.node_calls, {n: self.memory_of(n, None) for n in nodes})
        # Note: [Memory outside the graphs is measured and planned for] in teraio.lifecycle.measurement: a
        # fraction is of the whole step's unplanned peak, outside memory included, and the graphs get the
        # budget less that memory.
        outside = planner.outside.bytes
        # Note: [The whole-step budget keeps some states in memory] in teraio.states.residency: with
        # states="offload" a fraction is of the whole step, parameters, gradients and states included.
        whole_step = planner.whole_step
        whole = (
            whole_step.sizes(held_by_graphs([r.param_calls for r in planner.runners]))
            if whole_step is not None
            else None
        )
        state_total = whole.total_bytes if whole is not None else 0
        fixed = whole.fixed_bytes if whole is not None else 0
        budget_bytes = resolve_budget(planner.cfg.memory_budget, step_unplanned + outside + state_total)
        if budget_bytes is not None and planner.ranks.active():
            # Note: [Ranks agree at the start of every step] in teraio.lifecycle.ranks: the smallest rank's
            # budget is everyone's.
            budget_bytes = int(planner.ranks.reduce([budget_bytes], "min")[0])
        if planner.budget_bytes_override is not None:
            budget_bytes = planner.budget_bytes_override
        planner.last_budget_bytes = budget_bytes
        planner.last_unplanned_bytes = step_unplanned + outside + state_total
        for r in ready:
            r.step_budget_bytes = budget_bytes
            r.plans = {}
        if budget_bytes is None:  # "auto": each graph's own smallest stall-free peak
            for r in ready:
                r.plan = planner.solve(r, "auto")
            return
        graphs_budget = budget_bytes - outside - fixed
        log.info(
            "planning %d graph(s) for a step budget of %s (%s; solver %s, time limit %.0f s per graph)",
            len(ready),
            format_size(budget_bytes),
            planner.cfg.memory_budget,
            planner.cfg.solver.name,
            planner.cfg.solver.time_limit,
        )
        several = {n for n in nodes if n[0] in ready and self.counts.get(n[0], 1) > 1}
        last_forward = {n: j for j, (n, k, _) in enumerate(self.node_calls) if k == "fwd"}
        failure: BudgetError | None = None
        try:
            # Note: [A call's saved tensors leave while the next blocks run] in teraio.planner.budget_split
            step_budget.split_budget_holding_less(
                self.node_calls,
                graphs_budget,
                self.memory,
                self.plan_graph,
                {n: self.lifetimes[n[0]].smallest_peak_bytes for n in nodes},
                {n: self.min_held(n) for n in nodes},
                lambda n: (
                    n[0].name + (f" (call {self.first_ordinal[n]} of the step)" if n in several else "")
                ),
                {
                    n: step_budget.max_reduce_bytes(self.lifetimes[n[0]]) if n[0] in ready else 0
                    for n in nodes
                },
                relax=sorted(several, key=lambda n: -last_forward.get(n, -1)),
            )
        except BudgetError as exc:
            failure = exc
            if fixed:  # Note: [The whole-step budget keeps some states in memory]
                failure = whole_step_budget_error(exc, budget_bytes, fixed, outside)
        if whole_step is not None:  # Note: [The streamed step's chunks are sized to the budget]
            window_failure = whole_step.fit_step_window(budget_bytes)
            if window_failure is not None and (
                failure is None
                or (window_failure.smallest_peak_bytes or 0) > (failure.smallest_peak_bytes or 0)
            ):
                failure = window_failure
        if planner.ranks.active():  # every rank raises, or none: one rank raising alone hangs the others
            floors = planner.ranks.gather(float(failure.smallest_peak_bytes or 1) if failure else 0.0)
            if failure is None and any(floors):
                worst = max(range(len(floors)), key=lambda i: floors[i])
                failure = BudgetError(
                    f"memory_budget {format_size(budget_bytes)} cannot be met on rank {worst} (its smallest "
                    f"achievable step peak is {format_size(floors[worst])}); every rank stops here: use a "
                    "budget of at least that",
                    smallest_peak_bytes=int(floors[worst]),
                )
        if failure is not None and outside and all(r.plan_before_outside is not None for r in ready):
            self._keep_plans_before_outside(budget_bytes, outside, failure)
            return
        if failure is not None:
            raise failure
        self._take_plans(budget_bytes, fixed, step_unplanned + outside)

    def _keep_plans_before_outside(self, budget_bytes: int, outside: int, failure: Exception) -> None:
        """Note: [Memory outside the graphs is measured and planned for] in teraio.lifecycle.measurement:
        training already runs within the graphs' share; stopping it for memory the loop holds would lose a
        job that works. Every rank takes this branch together (the failure was gathered before)."""
        planner = self.planner
        planner.outside.stop()
        for r in self.ready:
            r.plan, r.plans, r.phase = r.plan_before_outside, r.plans_before_outside, Phase.RUNNING
        log.warning(
            "the step holds %s outside teraio's graphs, more than memory_budget %s leaves beside them (%s); "
            "the graphs keep their plans and the step peaks above the budget: free what the loop holds "
            "through backward or raise the budget",
            format_size(outside),
            format_size(budget_bytes),
            failure,
        )
        kept = [n for n in self.nodes if n[0] in self.ready]
        region = self.peak_with(lambda n: n[0].plan_for(self.first_ordinal[n]), kept) + outside
        if planner.whole_step is not None:  # the kept states stay; the whole step peaks higher too
            planner.whole_step.predict(region)
        planner.predicted_step_peak_bytes = region - planner.kept_held_bytes()

    def _take_plans(self, budget_bytes: int, fixed: int, whole_unplanned: int) -> None:
        """Give each planned graph its plans (one per group of calls when they differ), record them, and
        predict the step's peak."""
        planner, plans = self.planner, self.plans
        for r in {n[0] for n in plans}:
            mine = {self.first_ordinal[n]: plans[n] for n in plans if n[0] is r}
            r.plan = mine[min(mine)]
            if len({id(p) for p in mine.values()}) > 1:
                r.plans = {j: plans[(r, self.group(r, j))] for j in range(self.counts[r])}
            planner.save_plan(r)
        memory = {n: self.memory_of(n, n[0].plan_for(self.first_ordinal[n])) for n in self.nodes}
        planner.predicted_step_peak_bytes = step_peak(self.node_calls, memory)[0] + planner.outside.bytes
        # Note: [The overlapped step's moments] in teraio.states.residency
        forward_held = [b + planner.outside.bytes for b in held_at_forward_calls(self.node_calls, memory)]
        log.info("predicted step peak %s", format_size(planner.predicted_step_peak_bytes))
        if planner.whole_step is not None:  # Note: [The whole-step budget keeps some states in memory]
            whole_peak = planner.whole_step.plan(
                budget_bytes,
                planner.predicted_step_peak_bytes,
                planner.cfg.solver.name,
                whole_unplanned,
                forward_held,
            )
            planner.predicted_step_peak_bytes -= planner.kept_held_bytes()
            kept = planner.whole_step.residency
            log.info(
                "whole step: %s of parameters that stay, %s of states kept in memory by the plan, predicted "
                "peak %s (budget %s)",
                format_size(fixed),
                format_size(kept.kept_bytes if kept is not None else 0),
                format_size(whole_peak),
                format_size(budget_bytes),
            )
