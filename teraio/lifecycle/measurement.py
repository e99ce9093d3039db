"""The measured step: how long running steps take, how much memory one of them holds, and what the
difference from the prediction means.

Every running step whose graphs all ran their final compilation is timed on the device it computes on.
One running step per plan is measured for its memory peak with the torch profiler, only when the
process's single profiler session is free, and only a step whose every forward got its backward counts.
A measured peak is compared with the composed prediction for the same calls
(:meth:`teraio.lifecycle.step_planner.StepPlanner.predicted_peak`); a lasting excess is memory outside
the graphs (:class:`OutsideMemory`), which the next planning counts against the budget.

Note: [Memory outside the graphs is measured and planned for]
    Memory a step holds that no graph of the backend allocates is invisible to the profiles: FSDP2's
    all-gathered parameters (allocated before each block's graph runs and freed after it), tensors
    the loop creates between forward and backward. The measured step (the torch profiler, or the
    device's allocator) shows it: when a running step holds clearly more than its prediction
    (PREDICTION_SLACK) in OUTSIDE_CONFIRMING_STEPS measured steps in a row, the smallest difference
    is taken as memory outside the graphs, held throughout the step (one step's excess can be a
    one-off, such as a collective's transient buffer on a loaded machine, and planning on it would
    over-predict every later step), and the graphs are planned once more: a fraction budget is then of
    the step's peak with that memory, and the graphs get the budget less it. A later excess over the
    prediction is reported, not chased, unless the step is over its budget.

    The memory outside the graphs is planned for as one figure held throughout the step, but what it
    is depends on where in the step the peak falls: a loss computed eagerly over the logits holds more
    at the start of the backward than in the blocks' forwards. Planned again, the graphs free memory
    everywhere, and the step's peak can move to where more is held outside than was measured at the
    old peak (benchmarks/results/outside_memory_2c24g-virtio_202611.md: the built-in demo GPT compiled
    block by block). A measured step over its budget is a promise broken, so it is chased: in
    OUTSIDE_CONFIRMING_STEPS measured steps in a row over the budget, the smallest excess over the
    prediction is added to the memory outside and the graphs are planned again, up to
    MAX_OUTSIDE_ROUNDS plannings in all. Each round adds to the one figure held throughout the step, so
    a round can only lower the graphs' share; the cost is moving more than a plan that knew where in
    the step its outside memory sits would. When a planning cannot fit the memory found (the graphs
    keep their plans, with a warning), nothing more is chased. Under torchrun every rank plans again
    at the start of the same step (any rank that wants it decides: Note: [Ranks agree at the start of
    every step] in teraio.lifecycle.ranks). A whole-step plan of states (``states="offload"``) keeps
    its own measure of the step (teraio.states.residency) and is planned again only for an excess
    over its prediction.

Note: [Step times are read outside backward]
    On CUDA a step's end mark is an event recorded in the backward hook that ends the step, and it
    completes only when the compute stream gets there. Only completed marks are read (at the step's
    end, the next forward, ``stats()``); only ``stats()`` waits (``wait``), so no hook and no training
    step blocks on the device for them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable
from enum import Enum
from typing import TYPE_CHECKING, Any

from teraio.lifecycle.phases import Phase
from teraio.lifecycle.runner import step_device
from teraio.lifecycle.step_stats import Measurement, StepStats
from teraio.lifecycle.steps import StepRecord, StepTracker
from teraio.planner.budget import parse_budget
from teraio.profiling import forward_count
from teraio.profiling.clock import Clock
from teraio.sizes import format_size

if TYPE_CHECKING:
    from teraio.config import BackendConfig
    from teraio.lifecycle.outside_time import OutsideTimer
    from teraio.lifecycle.runner import GraphRunner
    from teraio.states.residency import WholeStepStates

log = logging.getLogger("teraio")

#: How far a measured step peak may exceed the prediction before the user is told (the budget tests hold
#: measured peaks to 5% over the budget).
PREDICTION_SLACK = 1.05

#: Measured steps whose peaks must all exceed the prediction before the excess is taken as memory outside
#: the graphs (Note: [Memory outside the graphs is measured and planned for]); the smallest excess counts.
OUTSIDE_CONFIRMING_STEPS = 2
#: Plannings for memory outside the graphs at most: one for an excess over the prediction, further ones
#: only for a step measured over its budget (Note: [Memory outside the graphs is measured and planned for]).
MAX_OUTSIDE_ROUNDS = 3


class MeasureState(Enum):
    WAITING = "waiting"  # for every graph of the step to run its final compilation for a full step
    ARMED = "armed"  # the next step that starts is measured
    ACTIVE = "active"  # the profiler records the current step
    ENDED = "ended"  # the step ended (inside a backward); stopped at the next call from outside
    DONE = "done"


def warn_unplanned_memory(measured_bytes: int, predicted_bytes: int | None, graphs: int) -> None:
    """Say so when the step used clearly more memory than its graphs' plans account for, naming what can
    cause that in a step of this shape (one graph or several)."""
    if predicted_bytes is None or measured_bytes <= PREDICTION_SLACK * predicted_bytes:
        return
    if graphs > 1:
        cause = (
            "memory the step allocates outside teraio's graphs: code torch.compile runs eagerly between them "
            "(a graph break: TORCH_LOGS=graph_breaks shows where) or tensors the loop creates in the step"
        )
    else:
        cause = (
            "memory the step allocates outside teraio's graph: the loss or other tensors your loop computes "
            "between forward and backward, gradient hooks, or tensors it creates in the step"
        )
    log.warning(
        "measured step peak %s is %.0f%% above the predicted %s: %s; the budget cannot cover what it cannot see",
        format_size(measured_bytes),
        100 * (measured_bytes / predicted_bytes - 1),
        format_size(predicted_bytes),
        cause,
    )


class OutsideMemory:
    """Note: [Memory outside the graphs is measured and planned for]: the memory a step holds beside its
    graphs, confirmed by measured steps, and whether the graphs should be planned again for it."""

    def __init__(self, cfg: BackendConfig) -> None:
        self.cfg = cfg
        self.bytes = 0  # planned for: held throughout the step beside the graphs
        self.rounds = 0  # plannings for it so far (at most MAX_OUTSIDE_ROUNDS)
        self._excess_bytes: list[int] = []  # measured excesses not yet planned for
        self.confirming = False  # an excess awaits a second measured step
        self.replan_wanted = False

    def take_replan(self) -> bool:
        """Whether the graphs should be planned again for this memory (once: the wish is consumed)."""
        wanted, self.replan_wanted = self.replan_wanted, False
        return wanted

    def stop(self) -> None:
        """Chase no further excess: a planning could not fit the memory found (the graphs kept their plans)."""
        self.rounds = MAX_OUTSIDE_ROUNDS
        self._excess_bytes.clear()
        self.confirming = False

    def measured(
        self, peak_bytes: int, predicted: int | None, graphs: int, budget_bytes: int | None = None
    ) -> None:
        """A measured step of ``graphs`` graphs peaked at ``peak_bytes`` against the ``predicted`` peak and,
        when given, the step's ``budget_bytes`` (Note: [Memory outside the graphs is measured and planned
        for]: over the budget, the excess is chased in later rounds too)."""
        over_prediction = predicted is not None and peak_bytes > PREDICTION_SLACK * predicted
        over_budget = (
            predicted is not None
            and budget_bytes is not None
            and peak_bytes > budget_bytes
            and peak_bytes > predicted
        )
        if (
            ((over_prediction and self.rounds < 1) or (over_budget and self.rounds < MAX_OUTSIDE_ROUNDS))
            and self.cfg.enabled
            and self.cfg.memory_budget is not None
            # "auto" plans each graph for its own floor: memory beside the graphs changes no plan.
            and parse_budget(self.cfg.memory_budget, "memory_budget").kind != "auto"
        ):
            assert predicted is not None
            self._excess_bytes.append(peak_bytes - predicted)
            if len(self._excess_bytes) < OUTSIDE_CONFIRMING_STEPS:
                self.confirming = True  # measure the next clean step too before planning on it
                log.info(
                    "measured step peak %s above the predicted %s%s; measuring another step before planning "
                    "for it",
                    format_size(peak_bytes),
                    format_size(predicted),
                    f" and the budget {format_size(budget_bytes)}" if over_budget and budget_bytes else "",
                )
                return
            excess = min(self._excess_bytes)
            self._excess_bytes.clear()
            self.confirming = False
            self.bytes += excess
            self.rounds += 1
            self.replan_wanted = True
            log.info(
                "the step holds %s%s outside teraio's graphs (%s measured, %s predicted): memory its graphs do "
                "not allocate, such as FSDP's all-gathered parameters or tensors the loop creates; planning "
                "again with it counted against the budget",
                format_size(excess),
                f" more (in all {format_size(self.bytes)})" if self.rounds > 1 else "",
                format_size(peak_bytes),
                format_size(predicted),
            )
        elif self.confirming:
            # The step before held more than this one: a one-off (a collective's transient buffer, a
            # late free), not memory every step holds.
            self.confirming = False
            self._excess_bytes.clear()
            log.info(
                "measured step peak %s within the predicted %s; an earlier step's excess was a one-off",
                format_size(peak_bytes),
                format_size(predicted),
            )
        else:
            warn_unplanned_memory(peak_bytes, predicted, graphs)


class StepMeasurement:
    """The timed and measured steps of one backend (see the module docstring)."""

    def __init__(
        self,
        cfg: BackendConfig,
        runners: list[GraphRunner],
        tracker: StepTracker,
        step_stats: StepStats,
        outside_time: OutsideTimer,
        outside_memory: OutsideMemory,
        whole_step: WholeStepStates | None,
        predicted_peak: Callable[[list[tuple[Any, str, int]]], int | None],
        on_step_time: Callable[[StepRecord, float], None],
        on_trial: Callable[[], bool] = lambda: False,
    ) -> None:
        self.cfg = cfg
        self.runners = runners  # the backend's, as they come
        self.tracker = tracker
        self.step_stats = step_stats
        self.outside_time = outside_time
        self.outside_memory = outside_memory
        self.whole_step = whole_step
        self.predicted_peak = predicted_peak
        self.on_step_time = on_step_time  # in step order; may run in a backward hook
        # This backend's forwards (Note: [A measured step belongs to one backend] in teraio.lifecycle.step_stats).
        self.forward_calls = 0
        self._measure_counts_start = self._measure_counts_end = (0, 0)
        self._measured_calls: list[tuple[Any, Any, int]] = []
        self._measure = MeasureState.WAITING
        self._recorder: Any = None
        self._measured_step: int | None = None
        self.measured_peak_bytes: int | None = None
        self._step_t0: dict[int, tuple[Clock, Any]] = {}  # step index -> its clock and start mark
        self._step_ends: deque[tuple[StepRecord, Clock, Any, Any, bool]] = deque()  # not yet read
        self._times_lock = threading.Lock()
        self._compiles_at: dict[int, int] = {}  # step index -> compiles that happened during it
        self.step_times_s: list[float] = []  # complete running steps, every graph in its final phase
        #: Whether the running compilations are on trial (Note: [The search's finalists are timed against
        #: each other] in teraio.lifecycle.partitioner_runoff): steps are timed, not measured, and their
        #: times stay out of the step statistics.
        self.on_trial = on_trial

    def note_forward(self) -> None:
        self.forward_calls += 1

    def compiled_during(self, step: StepRecord | None) -> None:
        """A graph was compiled while ``step`` ran: its time measures the compiler, not the plan."""
        if step is not None and not step.complete:
            self._compiles_at[step.index] = self._compiles_at.get(step.index, 0) + 1

    def compute_device(self) -> str:
        """The device the step computes on (its graphs' inputs): step times and the peak recorder."""
        return step_device(self.runners)

    # ------------------------------------------------------------------------------ step ends
    def on_step_end(self, step: StepRecord) -> None:
        """The tracker's step-end callback. Runs inside a backward hook or a finalizer (tracker lock
        held): only note what happened."""
        started = self._step_t0.pop(step.index, None)
        clean = step.abandoned == 0 and not self._compiles_at.pop(step.index, 0)
        self.outside_time.step_ended(step.index, clean)
        final = self._step_final(step)
        if started is not None and clean and final:
            clock, t0 = started
            self._step_ends.append((step, clock, t0, clock.mark(), self.on_trial()))
            self.read_step_times(wait=False)
        if step.abandoned == 0:
            self.step_stats.step_ended(step.calls, None)
        if self._measure is MeasureState.ACTIVE and self._measured_step == step.index:
            if clean and final:  # a step that profiled a graph measured the interpreter, not the plan
                self._recorder.mark_end()  # Note: [Profiler state inside backward] in teraio.profiling.measure
                self._measure_counts_end = (forward_count.forward_calls(), self.forward_calls)
                self._measured_calls = list(step.calls)
            else:
                self._measured_step = None  # discard: not a clean step
            self._measure = MeasureState.ENDED
        elif (
            self._measure is MeasureState.WAITING
            and clean
            and final
            and not self.on_trial()
            and self.cfg.profiling.measure_memory
            and (self.outside_memory.confirming or self.step_stats.needs_measurement(self.kind_generation))
        ):
            self._measure = MeasureState.ARMED

    def read_step_times(self, wait: bool) -> None:
        """Move ended steps' times into ``step_times_s`` (and ``on_step_time``), in step order (Note: [Step
        times are read outside backward])."""
        with self._times_lock:
            while self._step_ends:
                step, clock, t0, end, trial = self._step_ends[0]
                if not clock.done(end):
                    if not wait:
                        return
                    clock.settle(end)
                self._step_ends.popleft()
                self.step_times_s.append(clock.elapsed_ns(t0, end) / 1e9)
                if not trial:
                    self.step_stats.add_time(StepStats.kind_of(step.calls), self.step_times_s[-1])
                self.on_step_time(step, self.step_times_s[-1])

    @staticmethod
    def _step_final(step: StepRecord) -> bool:
        """Whether every graph the step called ran its final compilation. Graphs the step did not call do
        not count: a graph Dynamo replaced is never called again (Note: [A graph Dynamo replaced keeps its
        shape] in teraio.lifecycle.shapes), and a graph called only in some steps must not keep the others
        from being timed and measured."""
        return bool(step.calls) and all(g.phase in (Phase.RUNNING, Phase.INFERENCE) for g, _, _ in step.calls)

    def kind_generation(self, kind: frozenset[int]) -> int:
        """Changes whenever a graph of ``kind`` is recompiled (a new plan): measurements are per plans."""
        return sum(r.compiles for r in self.runners if r.graph_id in kind)

    # ------------------------------------------------------------------------------ measuring
    def maybe_start(self) -> None:
        """At a training forward: start timing a step that begins, and measure it when one is armed."""
        step = self.tracker.current_step
        if step is None:
            return
        if step.index not in self._step_t0 and not step.calls:
            clock = Clock(self.compute_device())
            self._step_t0[step.index] = (clock, clock.mark())
        if self._measure is not MeasureState.ARMED or step.calls:
            return
        from teraio.profiling.measure import MemoryRecorder, ProfilerBusyError

        recorder = MemoryRecorder(self.compute_device())
        try:
            recorder.start()
        except ProfilerBusyError:
            return  # another measurement is recording: try on a later step
        self._recorder = recorder
        self._measured_step = step.index
        if self.whole_step is not None:
            recorder.live_before = self.whole_step.step_starts()
        # This step's first forward has been counted already (GraphRunner.__call__).
        self._measure_counts_start = (forward_count.forward_calls() - 1, self.forward_calls - 1)
        self._measure = MeasureState.ACTIVE

    def finish(self) -> None:
        """Stop a measurement whose step ended; call from outside any backward.

        Note: [A measured step belongs to one backend] in teraio.lifecycle.step_stats.
        """
        if self._measure is not MeasureState.ENDED or self._recorder is None:
            return
        rec, self._recorder = self._recorder, None
        result = rec.stop()
        self._measure = MeasureState.WAITING
        if self._measured_step is None:
            return
        kind = StepStats.kind_of(self._measured_calls)
        (p0, o0), (p1, o1) = self._measure_counts_start, self._measure_counts_end
        if (p1 - p0) != (o1 - o0):
            self.step_stats.foreign(kind)
            log.debug(
                "discarded the measurement of step %d: another backend's graphs ran in it",
                self._measured_step,
            )
            return
        predicted = self.predicted_peak(self._measured_calls)
        self.step_stats.measurements[kind] = Measurement(
            self._measured_step, kind, result.peak_bytes, predicted, self.kind_generation(kind)
        )
        self.measured_peak_bytes = result.peak_bytes
        if self.whole_step is not None:
            self.whole_step.step_measured(result.peak_bytes, result.to_stop_peak_bytes)
        log.info(
            "measured step peak %s (graphs %s; predicted %s)",
            format_size(result.peak_bytes),
            ", ".join(str(g) for g in sorted(kind)),
            format_size(predicted),
        )
        # A whole-step plan of states keeps its own measure of the step (module Note).
        budgets = [g.step_budget_bytes for g, _, _ in self._measured_calls if g.step_budget_bytes is not None]
        budget = min(budgets) if budgets and self.whole_step is None else None
        self.outside_memory.measured(result.peak_bytes, predicted, len(kind), budget)

    def close(self) -> None:
        """Stop a recorder still running; nothing is measured after this."""
        if self._recorder is not None:
            with contextlib.suppress(Exception):
                self._recorder.stop()
            self._recorder = None
        self._measure = MeasureState.DONE
