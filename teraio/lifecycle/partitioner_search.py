"""The partitioner's own recompute as part of the step's plan: which ``activation_memory_budget`` to run at.

Note: [The partitioner's budget is part of the plan]
    Before teraio sees a training graph, AOTAutograd's min-cut partitioner decides what the forward saves.
    Its ``activation_memory_budget`` (``torch._functorch.config``, a ratio: 1 keeps what the min-cut keeps,
    0 recomputes everything it may) makes it recompute saved activations in the backward instead, and
    Inductor fuses what it recomputes into the backward kernels that read it: cheaper than the same
    recompute as separate ops, which is what a plan's recompute or offload costs. teraio plans on the
    partitioned graphs, so the ratio is a dimension of the plan that the plan's own solver cannot see.

    With ``Solver(partitioner_budget="search")`` and a memory budget, the step is first profiled and planned
    at the default partition (the process's ratio, 1.0 unless set). When that plan moves or rebuilds
    nothing, it stands. Otherwise the step's graphs are profiled and planned again at up to three more
    ratios (MAX_ROUNDS in all), and the step runs the candidate whose plans predict the fastest step (the
    sum of the predicted times of the step's forward calls) within the budget, or, when others are predicted
    close to it, the fastest of them timed in turns (Note: [The search's finalists are timed against each
    other] in teraio.lifecycle.partitioner_runoff):

    - ``fit``: the largest ratio at which the partitioner alone is estimated to bring the step's peak
      within the budget (teraio's plan then has little or nothing left to do), or 0 when none is;
    - once, a lower ``fit`` when the first one met the budget only with teraio's plan on top (its own
      peak without a plan, now measured, is over the budget): the recompute of a low ratio adds working
      memory to the backward that the saved bytes do not show (the built-in GPT at ratio 0.39 saved 364
      MiB and peaked at 467), so the next ratio is the secant through the default's and that candidate's
      measured peaks. Not below a fit that cannot meet the budget at all: lower ratios then help less
      (the built-in GPT's smallest step peak was 314 MiB at 0.29, 348 at 0.07, 946 at 0);
    - ``between``: halfway from the first ``fit`` to the default ratio (the partitioner's recompute and
      teraio's plan sharing the work).

    Each candidate is profiled from scratch: its own census, timing and calibration steps on the kernels
    Inductor generates for that partition (Note: [Calibrating on the compiler's own code] in
    teraio.graph.compilers), so the fused recompute is priced as it runs, and its memory is measured on its
    own kernels. Only the choice of ratios is estimated. The candidates are compared on their calibrated
    times, so each is timed on at least SEARCH_CALIBRATION_STEPS calibration steps whatever
    ``Profiling.steps`` says (:func:`profile_steps`): with the default one, the comparison was of single
    steps, each the first run of its kernels, and a slow one made the search pick a plan 13% slower than
    the partitioner alone (the demo GPT at torch's 0.5 peak). More steps narrow each candidate's spread,
    not the drift of a shared machine between candidates calibrated minutes apart, which still misordered
    candidates within 5-10% of each other (benchmarks/results/vs_torch_budget_2c24g-virtio_202611.md): the
    trial of the finalists settles those.
    torch defines the ratio over the saved bytes between its two ends, which measured linear on the
    built-in GPT (0.5 kept 519 MiB of 989 MiB, 0.2 kept 239, 0 kept 53), so one capture at ratio 0 (the
    partitioner run on the joint graph, no code generated) per graph gives each ratio's saved bytes; the
    first ``fit`` takes the step's unplanned peak at a ratio as the default's less the saved bytes it
    removes from each forward call of the step.

    The budget is resolved once, on the default partition: a fraction is of the step as it runs without
    teraio, and every candidate is planned for the same bytes. A candidate whose plan cannot meet the
    budget is dropped; when none can, the smallest achievable peak among them is the error's. The search
    runs on one process and without ``states="offload"`` (elsewhere the default partition is kept, and
    the log says so): ranks would have to agree on each candidate, and the whole-step plan of states holds
    decisions across rounds that this search does not yet restore.

    The step's graphs may change during the search: a batch of another size makes Dynamo compile the frame
    again with dynamic shapes, a new graph serves a shape never seen. A graph first seen starts at the
    partition of the round under way (of the finalist whose turn it is during a trial, of the chosen
    candidate after), and a graph's state is restored with the partition it was profiled at, never a
    candidate's ratio over another partition's profile (the compile would refuse the plan). At the end,
    only the graphs about to be compiled are restored (one still profiling for a later round keeps that
    round's partition and is planned by itself), and a candidate that did not plan every one of them
    (planned on a graph the step no longer calls) is left out of the choice, and the log says so.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from teraio.graph.capture import analyse_saved
from teraio.graph.compilers import capture_step
from teraio.lifecycle.partitioner_runoff import Finalist, RunOff, finalists
from teraio.planner.budget import BudgetError
from teraio.profiling.op_timing import INSTRUMENTED_STEPS
from teraio.sizes import format_size
from teraio.states.guarded import unguarded

if TYPE_CHECKING:
    from teraio.config import BackendConfig
    from teraio.lifecycle.runner import GraphRunner
    from teraio.lifecycle.step_planner import StepPlanner
    from teraio.planner.plan import Plan
    from teraio.planner.profile import Profile

log = logging.getLogger("teraio")

#: Ratios are rounded down to this step: a partition is a discrete choice, and a ratio printed in the
#: log is one a user can pass to ``torch._functorch.config.activation_memory_budget``.
RATIO_STEP = 0.01
#: Rounds of profiling and planning at most, the default partition's included: ``fit``, one lower
#: ``fit`` when the first still peaks over the budget, ``between``.
MAX_ROUNDS = 4
#: The calibration steps each candidate is timed on at least (the median of them is its time).
SEARCH_CALIBRATION_STEPS = 3


def profile_steps(cfg: BackendConfig) -> int:
    """The steps each graph is profiled for: ``Profiling.steps``, and with the search at least enough for
    SEARCH_CALIBRATION_STEPS calibration steps (Note: [The partitioner's budget is part of the plan])."""
    steps = cfg.profiling.steps
    if cfg.enabled and cfg.solver.partitioner_budget == "search" and cfg.states is None:
        return max(steps, INSTRUMENTED_STEPS + SEARCH_CALIBRATION_STEPS)
    return steps


@dataclass
class _GraphState:
    """What one graph's round produced, restored when its candidate wins."""

    partitioner_budget: float | None  # the partition the profile and plans are of
    profile: Profile | None
    profiler: Any
    profiling: Any
    plan: Plan | None
    plans: dict[int, Plan]
    step_budget_bytes: int | None
    computation_fingerprint: str | None


@dataclass
class Candidate:
    """One partitioner ratio, planned: the step's predicted time, or why it failed."""

    ratio: float
    predicted_step_s: float | None = None
    predicted_peak_bytes: int | None = None
    #: The whole step's peak at this ratio without a plan (teraio.lifecycle.step_planner).
    unplanned_bytes: int | None = None
    failure: BudgetError | None = None
    graphs: dict[GraphRunner, _GraphState] = field(default_factory=dict)
    #: Its median timed step and how many steps were timed, when it was a finalist (Note: [The search's
    #: finalists are timed against each other] in teraio.lifecycle.partitioner_runoff).
    measured_step_s: float | None = None
    timed_steps: int = 0

    def describe(self) -> str:
        if self.failure is not None:
            smallest = self.failure.smallest_peak_bytes
            return f"ratio {self.ratio:g}: cannot meet the budget" + (
                f" (smallest step peak {format_size(smallest)})" if smallest else ""
            )
        measured = f", measured {self.measured_step_s:.3f} s" if self.measured_step_s is not None else ""
        return f"ratio {self.ratio:g}: predicted step {self.predicted_step_s:.3f} s{measured}"


def saved_bytes(runner: GraphRunner, ratio: float | None) -> int:
    """The bytes ``runner``'s forward saves for backward when partitioned at ``ratio`` (None: its profile's
    partition, from its profiler's analysis; else a capture of the partitioner alone)."""
    if ratio is None and runner.profiler is not None:
        analysis = runner.profiler.analysis
    else:
        with unguarded(runner.example_inputs):  # Note in teraio.states.guarded.unguarded
            step = capture_step(
                runner.gm,
                runner.example_inputs,
                runner.cfg.inner,
                inductor_options=runner.backend.inductor_options,
                partitioner_budget=ratio,
            )
        if step is None:
            return 0
        analysis = analyse_saved(step)
    return sum(g.nbytes for g in analysis.groups if g.producer is not None)


def ratio_to_fit(removable_bytes: int, need_bytes: int, default_ratio: float) -> float:
    """The largest ratio (on the RATIO_STEP grid) at which removing ``need_bytes`` of the
    ``removable_bytes`` the partitioner can remove between ``default_ratio`` and 0 is estimated to happen
    (Note: [The partitioner's budget is part of the plan]: linear in the ratio); 0 when it cannot."""
    if removable_bytes <= 0 or need_bytes >= removable_bytes:
        return 0.0
    ratio = default_ratio * (1.0 - need_bytes / removable_bytes)
    return max(0.0, int(ratio / RATIO_STEP) * RATIO_STEP)


def predicted_step_s(runners: list[GraphRunner], calls: list[tuple[Any, str, int]]) -> float:
    """The step's predicted forward and backward time: each forward call's plan's (its graph's profile
    time when it has no plan)."""
    seen: Counter[GraphRunner] = Counter()
    total = 0.0
    for g, kind, _ in calls:
        if kind != "fwd" or g not in runners:
            continue
        plan = g.plan_for(seen[g])
        seen[g] += 1
        if plan is not None:
            total += plan.predicted_step_s
        elif g.profile is not None:
            total += float(g.profile.ops["duration_us"].sum()) / 1e6
    return total


class PartitionerSearch:
    """Note: [The partitioner's budget is part of the plan]: the rounds of one step's planning."""

    def __init__(
        self, planner: StepPlanner, runoff_rounds: int = 0, step_index: Callable[[], int] = lambda: 0
    ) -> None:
        self.planner = planner
        self.runoff_rounds = runoff_rounds
        self._step_index = step_index  # the step in progress, or the next one between steps
        #: Note: [The search's finalists are timed against each other] (None: no trial, or over).
        self.runoff: RunOff | None = None
        self.candidates: list[Candidate] = []
        self._stage: Literal["fit", "between", "done"] = "fit"
        self._fit = 1.0
        self._ratio: float | None = None  # the ratio the current round profiles at
        self._chosen_ratio: float | None = None  # the candidate running since the search ended
        self._done = False
        self._told_skip = False

    def applies(self, runners: list[GraphRunner], ranks_active: bool, states: bool) -> bool:
        """Whether the search runs for this step (logged once when it does not)."""
        if self._done:
            return False
        if ranks_active or states:
            if not self._told_skip:
                self._told_skip = True
                log.info(
                    "partitioner_budget='search' keeps the default partition %s; the search runs on one "
                    "process without states='offload'",
                    "under torchrun" if ranks_active else "with states='offload'",
                )
            self._done = True
            return False
        return any(r.is_training for r in runners)

    def ratio_for_new_graph(self) -> float | None:
        """The partition a graph first seen now starts at (None: the process's setting): the round's, the
        finalist's whose turn it is, or the chosen candidate's (Note: [The partitioner's budget is part of
        the plan])."""
        if self.runoff is not None and self.runoff.active is not None:
            return self.runoff.active.candidate.ratio
        if self._done:
            return self._chosen_ratio
        return self._ratio

    def plan(self, ready: list[GraphRunner]) -> bool:
        """Plan ``ready`` at the current ratio and record the candidate; True when another round of
        profiling has started (the caller compiles nothing now). When the search ends, the winning
        candidate's profiles and plans are back in the runners. Raises the BudgetError of the best
        failed candidate when none meets the budget."""
        planner = self.planner
        if self._ratio is None:  # the first round: the process's own ratio
            self._ratio = float(torch._functorch.config.activation_memory_budget)
        candidate = Candidate(self._ratio)
        try:
            planner.plan(ready)
        except BudgetError as exc:
            candidate.failure = exc
        candidate.unplanned_bytes = planner.last_unplanned_bytes
        if candidate.failure is None:
            calls = planner.step_calls(ready)
            candidate.predicted_step_s = predicted_step_s(ready, calls)
            candidate.predicted_peak_bytes = planner.predicted_step_peak_bytes
        candidate.graphs = {r: self._state_of(r) for r in ready}
        self.candidates.append(candidate)
        log.info("partitioner search: %s", candidate.describe())
        if len(self.candidates) == 1:
            if candidate.failure is None and not any(r.plan is not None and r.plan.decisions for r in ready):
                self._done = True  # the default partition fits as it is: nothing to search
                return False
            if planner.last_budget_bytes is None or planner.last_unplanned_bytes is None:
                self._done = True
                return self._end(ready)
            planner.budget_bytes_override = planner.last_budget_bytes
        nxt = self._next_ratio(ready) if len(self.candidates) < MAX_ROUNDS else None
        if nxt is not None:
            log.info("partitioner search: profiling the step again at activation_memory_budget %g", nxt)
            self._ratio = nxt
            for r in ready:
                if r.is_training:
                    r.profile_at(nxt)
            return True
        self._done = True
        return self._end(ready)

    def _next_ratio(self, ready: list[GraphRunner]) -> float | None:
        """The next ratio to try (Note: [The partitioner's budget is part of the plan]): the ``fit``
        estimate after the default; one lower when that fit met the budget only with a plan on top (its
        own unplanned peak over the budget: the secant through the default's and its measured peaks);
        then ``between``."""
        budget = self.planner.budget_bytes_override
        assert budget is not None
        first, last = self.candidates[0], self.candidates[-1]
        tried = {c.ratio for c in self.candidates}
        if len(self.candidates) == 1:
            self._fit = self._fit_estimate(ready, first.ratio)
            return self._fit if self._fit < first.ratio else None
        if self._stage == "fit":
            self._stage = "between"
            p0, p = first.unplanned_bytes, last.unplanned_bytes
            # Only once, and only below a fit whose plan met the budget: one that cannot is lower than the
            # partitioner helps (its smallest peak rises as the ratio falls: 314 MiB at 0.29, 348 at 0.07,
            # 946 at 0 on the built-in GPT).
            if (
                last.failure is None
                and p is not None
                and p0 is not None
                and p > budget
                and p0 > p
                and last.ratio > 0
            ):
                slope = (p0 - p) / (first.ratio - last.ratio)  # bytes per unit of ratio
                lower = max(0.0, int((last.ratio - (p - budget) / slope) / RATIO_STEP) * RATIO_STEP)
                lower = round(lower, 6)
                if lower < last.ratio and lower not in tried:
                    log.info(
                        "partitioner search: ratio %g still peaks at %s without a plan, over the budget %s",
                        last.ratio,
                        format_size(p),
                        format_size(budget),
                    )
                    return lower
        if self._stage == "between":
            self._stage = "done"
            between = round(int((self._fit + first.ratio) / 2 / RATIO_STEP) * RATIO_STEP, 6)
            if self._fit < between < first.ratio and between not in tried:
                return between
        return None

    def _fit_estimate(self, ready: list[GraphRunner], default_ratio: float) -> float:
        """The ``fit`` ratio of Note: [The partitioner's budget is part of the plan], from the saved bytes
        of the default partition and of ratio 0."""
        planner = self.planner
        assert planner.last_budget_bytes is not None and planner.last_unplanned_bytes is not None
        need = planner.last_unplanned_bytes - planner.last_budget_bytes
        forwards = Counter(g for g, k, _ in planner.step_calls(ready) if k == "fwd")
        removable = 0
        for r in ready:
            if r.is_training and forwards[r]:
                removable += forwards[r] * max(0, saved_bytes(r, None) - saved_bytes(r, 0.0))
        fit = round(ratio_to_fit(removable, need, default_ratio), 6)
        log.info(
            "partitioner search: the step needs %s less; the partitioner can remove %s between ratios %g "
            "and 0: trying %g",
            format_size(max(need, 0)),
            format_size(removable),
            default_ratio,
            fit,
        )
        return fit

    @staticmethod
    def _state_of(r: GraphRunner) -> _GraphState:
        return _GraphState(
            # None is the process's setting: its ratio now, which a restored graph then states.
            partitioner_budget=r.partitioner_budget
            if r.partitioner_budget is not None
            else float(torch._functorch.config.activation_memory_budget),
            profile=r.profile,
            profiler=r.profiler,
            profiling=r.profiling,
            plan=r.plan,
            plans=dict(r.plans),
            step_budget_bytes=r.step_budget_bytes,
            computation_fingerprint=r.computation_fingerprint,
        )

    def _end(self, ready: list[GraphRunner]) -> bool:
        """Put the best candidate back in the runners (or raise when none fits), or the first finalist of
        a trial; False: compile now."""
        # The override stays: a later plan of the step (memory outside the graphs grew) is for the same
        # bytes, not a fraction of the chosen partition's smaller peak.
        # Only the graphs compiled next are restored: one profiling for a later round keeps its partition.
        for c in self.candidates:
            c.graphs = {r: st for r, st in c.graphs.items() if r in ready}
        step_graphs = {r for r in ready if r.is_training}
        comparable = [c for c in self.candidates if step_graphs <= set(c.graphs)]
        if len(comparable) < len(self.candidates):
            log.info(
                "partitioner search: ratio(s) %s were planned on graphs the step no longer calls (Dynamo "
                "compiled it again); left out of the choice",
                ", ".join(f"{c.ratio:g}" for c in self.candidates if c not in comparable),
            )
        fitting = [c for c in comparable if c.failure is None]
        if not fitting:
            failures = [c.failure for c in comparable if c.failure is not None]
            raise min(failures, key=lambda e: e.smallest_peak_bytes or 1 << 62)
        chosen = finalists(fitting) if self.runoff_rounds > 0 else []
        if len(chosen) < 2:
            best = min(fitting, key=lambda c: c.predicted_step_s or 0.0)
            self._restore(best)
            self._chosen(best, "the fastest predicted")
            return False
        self.runoff = RunOff(chosen, self.runoff_rounds)
        log.info(
            "partitioner search: timing ratios %s against each other, one step each in turns, %d rounds",
            ", ".join(f"{c.ratio:g}" for c in chosen),
            self.runoff_rounds,
        )
        for c in self.candidates:  # the candidates out of the trial: let their profilers go
            if c not in chosen:
                c.graphs = {}
        first = self.runoff.next_finalist(self._step_index())
        assert first is not None
        self._restore(first.candidate)
        return False

    def _restore(self, c: Candidate) -> None:
        """Put ``c``'s profiles and plans back in its runners (they compile next)."""
        for r, st in c.graphs.items():
            r.partitioner_budget = st.partitioner_budget
            r.profile, r.profiler, r.profiling = st.profile, st.profiler, st.profiling
            r.plan, r.plans, r.step_budget_bytes = st.plan, st.plans, st.step_budget_bytes
            r.computation_fingerprint = st.computation_fingerprint
        self.planner.predicted_step_peak_bytes = c.predicted_peak_bytes

    def _chosen(self, best: Candidate, why: str) -> None:
        """``best`` runs from now on (or ran last, at close): log the choice, save its profiles and plans,
        drop the others'."""
        self._chosen_ratio = best.ratio
        log.info(
            "partitioner search: running at activation_memory_budget %g, %s (%s)",
            best.ratio,
            why,
            "; ".join(c.describe() for c in self.candidates),
        )
        for r in best.graphs:
            if r.profile is not None:
                r.backend.save_profile(r)
                self.planner.save_plan(r)
        for c in self.candidates:  # the losers' profilers hold their runs: let them go
            c.graphs = {}

    # ---------------------------------------------------------------------------------- the trial
    @property
    def on_trial(self) -> bool:
        """Whether the finalists are being timed (Note: [The search's finalists are timed against each
        other] in teraio.lifecycle.partitioner_runoff)."""
        return self.runoff is not None

    def at_step_boundary(self, step_index: int) -> None:
        """Between steps, before step ``step_index`` starts: switch to the finalist whose turn it is, or
        to the winner when the trial ends."""
        runoff = self.runoff
        assert runoff is not None
        before = runoff.active
        nxt = runoff.next_finalist(step_index)
        if nxt is None:
            for f in runoff.finalists:
                f.candidate.measured_step_s, f.candidate.timed_steps = f.median_s, len(f.times_s)
            winner = runoff.winner()
            self._switch(before, winner)
            self.runoff = None
            self._chosen(winner.candidate, f"the fastest timed ({runoff.steps} steps in turns)")
            return
        self._switch(before, nxt)

    def at_close(self) -> None:
        """The backend closes: when the loop ended during the trial, keep the times so far and save the
        plans of the finalist that ran last (the graphs hold its state and code) to the run directory,
        which otherwise had no plan of these graphs."""
        runoff = self.runoff
        if runoff is None:
            return
        self.runoff = None
        for f in runoff.finalists:
            f.candidate.measured_step_s, f.candidate.timed_steps = f.median_s, len(f.times_s)
        if runoff.active is not None:
            self._chosen(
                runoff.active.candidate,
                f"the last to run: the loop ended during the trial, after {runoff.steps} steps in turns",
            )

    def step_timed(self, step_index: int, seconds: float) -> None:
        """A step's time (the measurement's), for the finalist that ran it."""
        if self.runoff is not None:
            self.runoff.timed(step_index, seconds)

    def _switch(self, current: Finalist | None, nxt: Finalist) -> None:
        """Keep ``current``'s compilations and run ``nxt``'s (compiled now when it never ran: its first
        step, the trial's warm-up for it, is not timed)."""
        if nxt is current:
            return
        if current is not None:
            current.compilations = {r: r.compilation() for r in current.candidate.graphs}
        if nxt.compilations is not None:
            for r, c in nxt.compilations.items():
                r.use_compilation(c)
            self.planner.predicted_step_peak_bytes = nxt.candidate.predicted_peak_bytes
            return
        self._restore(nxt.candidate)
        for r in nxt.candidate.graphs:
            r.compile_final()

    def summary(self) -> list[dict[str, Any]]:
        """The candidates, for the run's stats."""
        return [
            {
                "ratio": c.ratio,
                "predicted_step_s": c.predicted_step_s,
                "predicted_peak_bytes": c.predicted_peak_bytes,
                "unplanned_peak_bytes": c.unplanned_bytes,
                "fits": c.failure is None,
                "measured_step_s": c.measured_step_s,
                "timed_steps": c.timed_steps,
            }
            for c in self.candidates
        ]


__all__ = ["Candidate", "PartitionerSearch", "predicted_step_s", "ratio_to_fit", "saved_bytes"]
