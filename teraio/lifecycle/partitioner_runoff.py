"""The partitioner search's finalists, timed against each other in turns.

Note: [The search's finalists are timed against each other]
    The partitioner search (Note: [The partitioner's budget is part of the plan] in
    teraio.lifecycle.partitioner_search) compares candidates on their calibrated times, taken minutes
    apart: each candidate is profiled in its own round. On a shared machine the speed drifts by more than
    the 5-10% that often separates the candidates, so the fastest predicted was not always the fastest
    (the built-in GPT at torch's 0.5 peak on Inductor: four runs of the same search ran at 0.95-1.13x
    torch's step; benchmarks/results/vs_torch_budget_2c24g-virtio_202611.md).

    So the fitting candidates predicted within RUNOFF_MARGIN of the fastest (at most MAX_FINALISTS, the
    fastest predicted first) are compiled with their plans and run the training steps in turns: one step
    per turn, round after round, ``Solver.runoff_rounds`` rounds; the first step of each finalist is its
    compile's and is not timed. Turns interleave, so a drift of the machine falls on every finalist alike.
    The finalist with the smallest median timed step runs from then on; a finalist that was never timed
    (steps that compiled, abandoned a forward or were not the graphs' final code) cannot win, and a round
    without any timed step ends the trial (a loop that abandons a forward every step, such as a metric
    computed with gradients enabled, is never timed: its fastest predicted runs). Each finalist
    is compiled once: a later turn puts its compilation back (teraio.lifecycle.runner.Compilation), between
    steps, so a forward waiting for its backward keeps the code it ran with.

    A timed step is the measurement's (forward start to backward end, on a GPU from CUDA events:
    teraio.lifecycle.measurement), the same for every finalist. While the finalists are on trial, steps are
    not memory-measured (the profiler slows the step it records, and the memory outside the graphs is
    planned for the winner's plans) and their times stay out of ``stats()["step_s"]``. Every finalist's
    plan meets the budget, so every step of the trial does too. With ``runoff_rounds=0`` the fastest
    predicted runs at once.
"""

from __future__ import annotations

import statistics
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from teraio.lifecycle.partitioner_search import Candidate
    from teraio.lifecycle.runner import Compilation, GraphRunner

#: Candidates predicted within this fraction of the fastest prediction are timed against it: the drift
#: between candidates calibrated minutes apart measured 5-10% on the project's VM, and predictions of
#: moving plans 6-12% below their measured steps.
RUNOFF_MARGIN = 0.15
#: At most this many finalists: each one costs a compile and its turns.
MAX_FINALISTS = 3
#: A turn ends after this many steps even when none of them was timed (a loop whose steps abandon a
#: forward or compile a new graph), and the trial ends after a round in which no step was timed: it never
#: holds the run for long.
MAX_TURN_STEPS = 4


def trial_steps_at_most(rounds: int) -> int:
    """The steps a trial of ``rounds`` rounds can take at most (every turn untimed to its end)."""
    return rounds * MAX_FINALISTS * MAX_TURN_STEPS


def finalists(fitting: list[Candidate]) -> list[Candidate]:
    """The candidates to time: the fitting ones predicted within RUNOFF_MARGIN of the fastest, fastest
    predicted first, at most MAX_FINALISTS."""
    ranked = sorted(fitting, key=lambda c: c.predicted_step_s or 0.0)
    if not ranked:
        return []
    fastest = ranked[0].predicted_step_s or 0.0
    return [c for c in ranked if (c.predicted_step_s or 0.0) <= fastest * (1 + RUNOFF_MARGIN)][:MAX_FINALISTS]


@dataclass
class Finalist:
    candidate: Candidate
    #: Its graphs' compilations, once it has run (None: never compiled yet).
    compilations: dict[GraphRunner, Compilation] | None = None
    times_s: list[float] = field(default_factory=list)
    started: bool = False  # ran a step (its first is its compile's)

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.times_s) if self.times_s else None


class RunOff:
    """The turns of Note: [The search's finalists are timed against each other]: which finalist runs each
    step, and which one wins. Torch-free bookkeeping; the search switches the graphs."""

    def __init__(self, candidates: list[Candidate], rounds: int) -> None:
        assert len(candidates) >= 2 and rounds >= 1
        self.finalists = [Finalist(c) for c in candidates]
        self._schedule = [f for _ in range(rounds) for f in self.finalists]
        self._turn = 0
        self._turn_steps = 0
        self._timed_in_turn = False
        self._timed_in_round = False
        self._step_of: dict[int, Finalist] = {}  # step index -> the finalist that ran it (until timed)
        self._warmup: set[int] = set()  # the first step of each finalist: its compile's
        self.active: Finalist | None = None
        self.done = False
        self.steps = 0
        # Times arrive in a backward hook: on a GPU, on autograd's device thread, while the training
        # thread may be at a step boundary.
        self._lock = threading.Lock()

    def next_finalist(self, step_index: int) -> Finalist | None:
        """At a step boundary: the finalist that runs step ``step_index`` (None: the trial is over)."""
        with self._lock:
            return self._next_finalist(step_index)

    def _next_finalist(self, step_index: int) -> Finalist | None:
        if self.done:
            return None
        if self.active is not None and (self._timed_in_turn or self._turn_steps >= MAX_TURN_STEPS):
            self._turn += 1
            self._turn_steps, self._timed_in_turn = 0, False
            if self._turn % len(self.finalists) == 0:  # a round ended
                if not self._timed_in_round:  # a loop whose steps are never timed: stop trying
                    self._turn = len(self._schedule)
                self._timed_in_round = False
            if self._turn >= len(self._schedule):
                self.done = True
                return None
        f = self._schedule[self._turn]
        if not f.started:
            f.started = True
            self._warmup.add(step_index)
        self._step_of[step_index] = f
        self._turn_steps += 1
        self.steps += 1
        self.active = f
        return f

    def timed(self, step_index: int, seconds: float) -> None:
        """Step ``step_index`` took ``seconds`` (a clean step of final code; steps never timed are not
        counted)."""
        with self._lock:
            f = self._step_of.pop(step_index, None)
            if f is None or step_index in self._warmup:
                return
            f.times_s.append(seconds)
            self._timed_in_round = True
            if not self.done and f is self.active:
                self._timed_in_turn = True

    def winner(self) -> Finalist:
        """The finalist with the smallest median timed step; the fastest predicted when none was timed."""
        timed = [f for f in self.finalists if f.times_s]
        if not timed:
            return self.finalists[0]
        return min(timed, key=lambda f: f.median_s or 0.0)


__all__ = [
    "MAX_FINALISTS",
    "MAX_TURN_STEPS",
    "RUNOFF_MARGIN",
    "Finalist",
    "RunOff",
    "finalists",
    "trial_steps_at_most",
]
