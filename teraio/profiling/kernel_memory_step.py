"""The profiling step that runs a graph's compiled kernels under the torch profiler for their memory.

The census of the op-by-op run measures the partitioned FX graph, which the compiler does not run as such
(Note: [The budget is of the graph that runs] in teraio.graph.kernel_memory). So on the Inductor path one
profiling step of each graph runs the compiler's own kernels with the torch profiler recording every
allocation, and ``teraio.graph.kernel_memory.segment_memory`` maps the recorded timeline onto the graph's
segments. This module holds that step's bookkeeping for one graph: starting the process's one profiler
session (or giving up when another measurement keeps it busy), running the forward and the backward under
their marks, checking that nothing else ran in between, and reading the timeline outside backward.
"""

from __future__ import annotations

from typing import Any

import torch

from teraio.graph.capture import StepAnalysis
from teraio.graph.kernel_boundaries import Segmentation
from teraio.graph.kernel_memory import (
    BWD_MARK,
    FWD_MARK,
    KernelMemory,
    MappingError,
    expected_externs,
    segment_memory,
)
from teraio.profiling import forward_count


class KernelMemoryStep:
    """One graph's measurement of its compiled kernels' memory timeline, over as many steps as it takes.

    ``timeline`` is the measured timeline once a step ran the graph alone to its backward; ``note`` says
    why the census stands instead, once that is known (the profiler stayed busy, the graph never ran
    alone, the timeline did not map onto the segments). Until one of the two is set, a step may measure.
    """

    #: Attempts at measuring the kernels' memory (the profiler may be busy with another measurement)
    #: before the census is used instead.
    MEMORY_ATTEMPTS = 3
    #: Profiled steps that ran the graph with other forwards inside its step, none alone, after which it is
    #: not measured (Note: [A graph the loop never runs alone is not measured]).
    NEVER_ALONE_STEPS = 2

    def __init__(self, analysis: StepAnalysis, segmentation: Segmentation, device: str) -> None:
        self.analysis = analysis
        self.segmentation = segmentation
        self.device = device
        self.timeline: KernelMemory | None = None
        #: Why the kernels' memory is not used (the census is), once that is known; None otherwise.
        self.note: str | None = None
        self._recorder: Any = None  # a measured step's recorder, stopped outside backward
        self._attempts = 0
        # The process's forward count (teraio.lifecycle.registry) when the step's forward began and when its
        # backward ended: equal when no other forward ran in between.
        self._calls = self._calls_end = -1
        self._ran_alone = False  # a profiled step ran the graph with no other forward inside its step
        self._not_alone = 0  # profiled steps that ran other forwards inside the graph's step

    # Note: [A graph the loop never runs alone is not measured]
    #     A measuring step keeps its timeline only when no other forward ran between the graph's forward
    #     and its backward, and the profiler records one graph at a time. In a model compiled piece by piece
    #     (``backend.compile``: each block, the embeddings and the head a graph), every graph but the last
    #     has the later pieces' forwards inside its step in every step of the loop, and a block called
    #     twice a step has its other call's: each spent its attempts, one graph after another, and the
    #     step was planned many steps late (docs/measured_facts.md). The profiling steps before the
    #     measurement (op by op, then calibrating) already show it: a graph that ran with other forwards
    #     inside its step in ``NEVER_ALONE_STEPS`` of them, and never alone, gives up at once, and the
    #     census stands.
    def observe(self, alone: bool) -> None:
        """A profiled step of the graph (op by op or calibrating, not a measuring one) ended: whether it
        ran alone (Note: [A graph the loop never runs alone is not measured])."""
        if alone:
            self._ran_alone = True
            return
        self._not_alone += 1
        if not self._ran_alone and self._not_alone >= self.NEVER_ALONE_STEPS and self.wanted:
            self.note = (
                f"in its {self._not_alone} profiled steps the graph never ran alone to its backward (other "
                "forwards ran inside its step)"
            )

    @property
    def settled(self) -> bool:
        """Measured, given up, or a step that measured it ended and is read when the profile is built."""
        return self.timeline is not None or self.note is not None or self.ended

    @property
    def wanted(self) -> bool:
        """Neither measured nor given up, and no step measuring it is under way."""
        return self.timeline is None and self.note is None and self._recorder is None

    @property
    def running(self) -> bool:
        """A measuring step's forward ran and its backward has not ended yet."""
        return self._recorder is not None and not self._recorder.marked

    @property
    def ended(self) -> bool:
        """A measuring step's backward ended; :meth:`finish` reads it (outside backward)."""
        return self._recorder is not None and self._recorder.marked

    def start(self) -> Any:
        """A started recorder of allocation events, or None when another measurement holds the profiler
        (given up after ``MEMORY_ATTEMPTS``: the census stands)."""
        from teraio.profiling.measure import MemoryRecorder, ProfilerBusyError

        rec = MemoryRecorder(self.device, timeline=True, record_shapes=True)
        try:
            rec.start()
        except ProfilerBusyError:
            self._attempts += 1
            if self._attempts >= self.MEMORY_ATTEMPTS:
                self.note = "the torch profiler was busy with another measurement"
            return None
        return rec

    def run_forward(self, rec: Any, kernels: Any, args_list: list[Any]) -> Any:
        """Run the forward's ``kernels`` under ``rec`` (from :meth:`start`), which stays running until the
        step's backward ended; a forward that fails stops it."""
        self._recorder = rec
        self._calls = forward_count.forward_calls()
        try:
            with torch.profiler.record_function(FWD_MARK):
                return kernels(args_list)
        except BaseException:
            self._recorder = None
            rec.stop()
            raise

    def run_backward(self, kernels: Any, args_list: list[Any]) -> Any:
        """Run the backward's ``kernels`` and mark the end of the measured region; the recorder is stopped
        later, outside backward (Note: [Profiler state inside backward] in teraio.profiling.measure)."""
        with torch.profiler.record_function(BWD_MARK):
            out = kernels(args_list)
        self._recorder.mark_end()
        self._calls_end = forward_count.forward_calls()
        return out

    def abandon(self) -> None:
        """Stop the recorder without reading it (the backend is closing): the process's profiler session
        and stderr go back to the process."""
        rec, self._recorder = self._recorder, None
        if rec is not None:
            rec.stop()

    def finish(self, abandoned: bool = False) -> None:
        """Stop the recorder (outside backward) and map its timeline onto the segments.

        The timeline is kept only when the step ran this graph alone, with no other forward of any
        backend in the process between its forward and its backward (their memory would count as this
        graph's); ``abandoned``: its forward never got its backward. Otherwise the next step measures
        again.
        """
        rec, self._recorder = self._recorder, None
        if rec is None:
            return
        rec.stop()
        if abandoned or not rec.marked or self._calls_end != self._calls:
            self._attempts += 1
            if self._attempts >= self.MEMORY_ATTEMPTS:
                self.note = (
                    f"in {self._attempts} steps the graph never ran alone to its backward (other "
                    "forwards ran inside its step, or its output was dropped without a backward)"
                )
            return
        from teraio.profiling.measure import allocations_under

        seg = self.segmentation
        a = self.analysis
        try:
            self.timeline = segment_memory(
                rec.events,
                allocations_under(rec.events, self.device),
                expected_externs(a.fw_ops, seg.fw_last),
                expected_externs(a.bw_ops, seg.bw_last),
            )
        except MappingError as exc:
            self.note = str(exc)
