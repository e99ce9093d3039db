"""A graph's profiling phase: when its steps are timed, measured, probed, and when it has seen enough.

A runner in ``PROFILING`` (teraio.lifecycle.phases) runs its forward and backward through a timing
interpreter (:class:`teraio.profiling.op_timing.StepProfiler`): a census step, a step timed op by op,
uninstrumented steps that calibrate those times, a step whose kernels' memory timeline is recorded (on
Inductor), and on a short CPU step the probes that price a transfer under the graph's own compute. This
module decides which of those the next step is, reads what ended, and builds the profile; the runner
(:mod:`teraio.lifecycle.runner`) owns the phase and the compiled code.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import fx

from teraio.graph.capture import CapturedStep, computation_fingerprint
from teraio.graph.kernel_boundaries import granularity_for, plan_fingerprint
from teraio.graph.rewrite import PlanMismatchError
from teraio.lifecycle.partitioner_search import profile_steps
from teraio.lifecycle.phases import Phase
from teraio.lifecycle.steps import Invocation, InvocationEnd
from teraio.profiling.op_timing import StepProfiler, profiling_split
from teraio.profiling.transfer_probe import PROBE_STEPS, TransferProbe, probe_variants, round_trips_for
from teraio.sizes import format_size
from teraio.states.residency import add_fetched_parameters

if TYPE_CHECKING:
    from teraio.lifecycle.runner import GraphRunner

log = logging.getLogger("teraio")


class RunnerProfiling:
    """The profiling half of one :class:`~teraio.lifecycle.runner.GraphRunner`: it sets the runner's
    ``profiler``, ``profile``, ``plan`` (from a plan file), ``phase`` (to ``PLANNING`` once profiled)
    and ``pending_error``."""

    def __init__(self, runner: GraphRunner, device: str) -> None:
        self.runner = runner
        self.cfg = runner.cfg
        self.device = device
        #: The offloaded parameters of each call while profiling (Note: [Fetched parameters are the graph's
        #: memory] in teraio.states.residency).
        self.param_calls: set[tuple[int, ...]] = set()
        self._memory_invocation: Any = None  # the invocation of a kernel-memory step in progress
        self._told_memory_note = False  # the warning that a measuring step fell back on the census

    # ----------------------------------------------------------------------------------- compiling
    def on_partition(self, step: CapturedStep) -> None:
        """The partitioner's hook of the profiling compilation: the graph trains; start its profiler."""
        runner = self.runner
        runner.training = True
        runner.computation_fingerprint = computation_fingerprint(step)
        runner.profiler = StepProfiler(
            step,
            graph_id=runner.graph_id,
            device=self.device,
            granularity=granularity_for(self.cfg.inner),
        )
        a = runner.profiler.analysis
        fingerprint = plan_fingerprint(a, runner.profiler.segmentation.granularity)
        saved_bytes = sum(g.nbytes for g in a.groups if g.producer is not None)
        log.info(
            "profiling %s: %d forward and %d backward ops, %d saved tensors (%s of activations)",
            runner.name,
            len(a.fw_ops),
            len(a.bw_ops),
            len(a.groups),
            format_size(saved_bytes),
        )
        plans = runner.backend.plans_from_file
        if plans:
            plan = next((p for p in plans if p.fingerprint == fingerprint), None)
            if plan is not None:
                runner.plan = plan
                runner.phase = Phase.PLANNING  # the plan says what to do: no profiling
            elif self.cfg.on_plan_mismatch == "error":
                have = ", ".join(p.fingerprint[:12] for p in plans)
                runner.pending_error = PlanMismatchError(
                    f"plan '{self.cfg.plan}' was made for graph(s) {have}, not {runner.name} "
                    f"({fingerprint[:12]}); re-profile and re-plan, or pass on_plan_mismatch='reprofile'"
                )
            else:
                log.warning("%s: no plan in %s matches; profiling it", runner.name, self.cfg.plan)

    def compiler(
        self,
        gm: fx.GraphModule,
        example_inputs: list[Any],
        is_backward: bool,
        kernels: Callable[..., Any] | None,
    ):
        """The profiling compilation's graph compiler: forward and backward through the profiler."""
        runner = self.runner
        prof = runner.profiler
        assert prof is not None
        if kernels is not None:  # Note: [Calibrating on the compiler's own code] in teraio.graph.compilers
            prof.set_kernels(kernels, is_backward)

        tracker = runner.backend.tracker
        outside = runner.backend.outside

        def run_fwd(args: list[Any]) -> Any:
            t0 = time.perf_counter()
            out = prof.run_fwd(args)
            if prof.last_forward_calibrated:
                step = tracker.current_step
                outside.graph_ran(step.index if step else None, runner, time.perf_counter() - t0)
            return out

        def run_bwd(args: list[Any]) -> Any:
            t0 = time.perf_counter()
            inv = tracker.invocation_of_current_backward()
            out = prof.run_bwd(args, invocation=inv.id if inv is not None else None)
            if prof.last_backward_calibrated and inv is not None:
                outside.graph_ran(inv.step, runner, time.perf_counter() - t0)
            if runner.phase is Phase.PROFILING and self._profiled_enough():
                runner.phase = Phase.PLANNING  # planned and compiled at the next forward, outside backward
            return out

        fn = run_bwd if is_backward else run_fwd
        fn._boxed_call = True  # type: ignore[attr-defined]
        return fn

    # ----------------------------------------------------------------------------------- the steps
    def _profiled_enough(self) -> bool:
        """``profile_steps`` steps done: the first takes the census, the second is timed op by op, and the
        rest (from three on) run uninstrumented to calibrate the op times (Note: [Calibrated times] in
        teraio.profiling.op_timing)."""
        prof = self.runner.profiler
        assert prof is not None
        instrumented, calibration = profiling_split(profile_steps(self.cfg))
        return (
            prof.steps_recorded >= instrumented
            and prof.kernel_memory_settled
            and prof.steps_calibrated >= calibration
            and (prof.probe.done() if prof.probe is not None else not self._may_probe())
        )

    def _may_probe(self) -> bool:
        """Whether this graph's calibration steps may go on to price a transfer (Note: [Pricing transfers
        under the model's own compute] in teraio.profiling.transfer_probe): the backend wants the price,
        the steps run the graph's own Python code on the CPU, and its step is short enough."""
        prof = self.runner.profiler
        if prof is None or prof.has_kernels or prof.device != "cpu" or not prof.calibrations:
            return False
        f, b = prof.calibrations[-1]
        return self.runner.backend.wants_transfer_price() and round_trips_for(f.wall_s + b.wall_s) is not None

    def _start_probe(self) -> None:
        prof = self.runner.profiler
        assert prof is not None and prof.calibrations
        f, b = prof.calibrations[-1]
        round_trips = round_trips_for(f.wall_s + b.wall_s)
        assert round_trips is not None
        prof.probe = TransferProbe(self.runner.backend.probe_engine_id(), probe_variants(round_trips))
        # The last plain step is the first probed one's pair.
        prof.probe.record(0, f.wall_s + b.wall_s)
        if prof.outside_samples_s:
            prof.probe.record_outside(prof.outside_samples_s[-1])
        log.info(
            "%s: pricing transfers under its own compute: %d more calibration steps, every other one "
            "making page round trips (%s)",
            self.runner.name,
            PROBE_STEPS,
            ", ".join(v.label for v in prof.probe.variants),
        )

    def before_forward(self) -> None:
        """Before a profiled training forward: read what ended, and say what the next step records."""
        runner = self.runner
        prof = runner.profiler
        if prof is None:
            return
        self.finish_kernel_memory()
        instrumented, calibration = profiling_split(profile_steps(self.cfg))
        step = runner.backend.tracker.current_step
        # Note: [A graph that is never the step's first measures inside the step]
        #     A graph measures its kernels' memory from its forward to its backward, and keeps the timeline
        #     only when no other forward ran in between. At the step's first forward nothing else is in
        #     flight; but the graph after a graph break (or a later DDP piece) is never the step's first,
        #     and waiting for that left it profiling for ever while the first graph, which never runs alone
        #     to its backward, gave up and was planned alone. So a graph may also start inside the step,
        #     when no other graph of its backend is measuring (the profiler takes one session at a time:
        #     starting beside one would spend its attempts on a busy profiler).
        if (
            prof.steps_recorded >= instrumented
            and prof.wants_kernel_memory
            and (step is None or step.complete or not runner.backend.measuring_kernel_memory())
        ):
            prof.memory_next = True
            prof.calibrate_next = False
            return
        if prof.steps_recorded >= instrumented:
            if prof.steps_calibrated >= calibration and prof.probe is None and self._may_probe():
                self._start_probe()
            probing = prof.probe is not None and not prof.probe.done()
            # Probed and plain steps alternate, so drift falls on both kinds alike; the plain ones
            # calibrate the op times too.
            prof.probe_next = prof.probe.next_variant if probing else 0
            prof.calibrate_next = probing or prof.steps_calibrated < calibration
        if runner.abandoned_forwards >= 2 * self.cfg.profiling.steps + 2 and prof.steps_recorded == 0:
            # Called with grad enabled again and again, never backpropagated (a validation loss in
            # train mode): profiling would never finish, and interpreting every call is slow. Counted by
            # forwards whose autograd graph was freed without a backward, not by calls: a block compiled
            # on its own runs once per block before the step's first backward.
            log.info(
                "%s: %d forwards and no backward; running it without a plan",
                runner.name,
                runner.abandoned_forwards,
            )
            prof.discard_pending()
            runner.phase = Phase.PLANNING

    def forward_ended(self, inv: Invocation) -> None:
        """A profiled forward returned: pair the profiler's record with its invocation."""
        prof = self.runner.profiler
        if prof is None:
            return
        if prof.memory_step_running:
            self._memory_invocation = inv
        prof.bind_last_forward(inv.id, abandoned=inv.end is InvocationEnd.ABANDONED)

    def finish_kernel_memory(self) -> None:
        """Read a kernel-memory step's timeline (outside backward), if one ran; keep it only when that step
        ran this graph alone: no other forward of any backend in between (Note: [The budget is of the graph
        that runs] in teraio.graph.kernel_memory)."""
        prof = self.runner.profiler
        if prof is None:
            return
        inv = self._memory_invocation
        if inv is not None and inv.end is InvocationEnd.ABANDONED and not prof.kernel_memory_ended:
            # Its autograd graph was freed without a backward (a forward whose output was detached at once):
            # stop the recorder, which holds the process's profiler session, and measure on a later step.
            self._memory_invocation = None
            prof.finish_kernel_memory(abandoned=True)
            return
        if not prof.kernel_memory_ended:
            return
        self._memory_invocation = None
        prof.finish_kernel_memory()
        if prof.kernel_memory is not None:
            log.info(
                "%s: the kernels' memory peaks at %s (the op-by-op census: %s)",
                self.runner.name,
                format_size(prof.kernel_memory.peak_bytes),
                format_size(
                    max((b for r in prof.fwd_runs[:1] + prof.bwd_runs[:1] for b in r.live_bytes), default=0)
                ),
            )
        elif prof.kernel_memory_note is not None:
            self._told_memory_note = True
            log.warning(
                "%s: planning on the op-by-op census of memory, not the kernels' own timeline: %s",
                self.runner.name,
                prof.kernel_memory_note,
            )

    # ----------------------------------------------------------------------------------- the profile
    def finish(self) -> None:
        """Build the profile (once), count the parameters the graph fetches into it, and record it."""
        runner = self.runner
        assert runner.profiler is not None
        self.finish_kernel_memory()
        if runner.profile is None and runner.profiler.steps_recorded > 0:
            # The partitioner's ratio the graph was partitioned at (None: the process's setting): a plan
            # made from this profile is for that partition (Note: [The partitioner's budget is part of the
            # plan] in teraio.lifecycle.partitioner_search).
            extra: dict[str, Any] = {"inner": self.cfg.inner, "partitioner_budget": runner.partitioner_budget}
            states = runner.backend.states
            if states is not None:  # states="offload": the step's other tensors, by kind
                extra["model_states"] = states.model_states()
            runner.profile = runner.profiler.build_profile(extra)
            note = runner.profiler.kernel_memory_note
            if note is not None and not self._told_memory_note:
                # Not a warning: a model compiled piece by piece gets it for every piece but the last.
                log.info("%s: planned on the op-by-op census of memory: %s", runner.name, note)
            self._count_fetched_parameters()
            runner.backend.save_profile(runner)

    def _count_fetched_parameters(self) -> None:
        """Note: [Fetched parameters are the graph's memory] in teraio.states.residency: the offloaded
        parameters a call of this graph fetches (and, when it runs once per block, the next call's read
        ahead) are memory every op of the graph runs with."""
        states = self.runner.backend.states
        residency = states.residency if states is not None else None
        if residency is not None and self.runner.profile is not None:
            add_fetched_parameters(self.runner.profile, residency, self.param_calls)
