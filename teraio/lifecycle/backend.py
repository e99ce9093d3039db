"""The ``teraio`` torch.compile backend: profile the first steps, plan, recompile with migration ops, run.

Every graph torch.compile hands the backend gets a :class:`GraphRunner` (a graph whose shapes change
gets one per shape, up to ``max_shapes``: :class:`ShapeDispatch`). A runner moves through phases, in one
place (:meth:`TeraioBackend._advance`), always at a forward call and never inside a backward:

- ``PROFILING``: its training forward and backward run through a timing interpreter
  (``teraio.profiling.op_timing``) for ``profile_steps`` complete forward+backward pairs (the first is warm-up),
  and with ``hardware="calibrate"`` on a short CPU step, ``teraio.profiling.transfer_probe.PROBE_STEPS`` more that price
  moving tensors under the graph's own compute;
- ``PLANNING``: profiled; at the next forward the backend plans every profiled graph of the step
  together (one budget for the step: ``teraio.planner.budget_split``) and recompiles them;
- ``RUNNING``: the compiled graphs carry the plan's ``teraio::`` migration ops (or none: no budget,
  ``enabled=False``, or a shape beyond ``max_shapes``);
- ``INFERENCE``: a graph without a backward (under ``no_grad``/``inference_mode``, or no input requires
  grad) is compiled as it is; it is never profiled, planned or measured.

Invocations in flight and step boundaries come from ``teraio.lifecycle.steps``; a switch of compilation never
affects an invocation already in flight (its backward belongs to the compilation that ran its forward).
One running step per backend is measured for its memory peak with the torch profiler, only when the
process's single profiler session is free, and only a step whose every forward got its backward counts.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import secrets
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor

from teraio.config import CALIBRATE, BackendConfig, make_config
from teraio.errors import UserInputError
from teraio.graph.capture import CapturedStep, analyse_saved, computation_fingerprint
from teraio.graph.compilers import compile_graph
from teraio.graph.kernel_boundaries import Segmentation, coarsen, granularity_for, plan_fingerprint
from teraio.graph.recompute import recipes
from teraio.graph.rewrite import PlanMismatchError, RewriteResult, apply_plan, check_plan
from teraio.lifecycle import registry as process
from teraio.lifecycle.discarded_forwards import SiteMemory, call_site
from teraio.lifecycle.outside_time import OutsideTimer
from teraio.lifecycle.ranks import RankAgreement, disk_sharers, rank_info
from teraio.lifecycle.run_dir import RunDir, RunDirError, refuse_foreign_run_dir
from teraio.lifecycle.shapes import ShapeDispatch, frame_of, is_dynamic, placeholder_sources, shape_key
from teraio.lifecycle.step_stats import Measurement, StepStats
from teraio.lifecycle.steps import CallKind, InvocationEnd, StepRecord, StepTracker, invocation_ordinals
from teraio.planner.budget import parse_budget
from teraio.planner.hardware import HardwareModel
from teraio.planner.plan import Plan
from teraio.planner.profile import Profile
from teraio.platform.mkl_vml import warm_up_mkl_vml
from teraio.profiling import forward_count
from teraio.profiling.clock import Clock
from teraio.profiling.op_timing import StepProfiler, classify_inputs, profiling_split
from teraio.profiling.transfer_probe import (
    PROBE_STEPS,
    TransferPrice,
    TransferProbe,
    probe_variants,
    round_trips_for,
)
from teraio.states import attach_states, io_bytes_by_kind
from teraio.states.residency import (
    WholeStepStates,
    add_fetched_parameters,
    held_by_graphs,
    whole_step_budget_error,
)

log = logging.getLogger("teraio")


class Phase(Enum):
    PROFILING = "profiling"
    PLANNING = "planning"
    RUNNING = "running"
    INFERENCE = "inference"


class MeasureState(Enum):
    WAITING = "waiting"  # for every graph of the step to run its final compilation for a full step
    ARMED = "armed"  # the next step that starts is measured
    ACTIVE = "active"  # the profiler records the current step
    ENDED = "ended"  # the step ended (inside a backward); stopped at the next call from outside
    DONE = "done"


def _ensure_log_handler() -> None:
    """INFO messages reach the user unless the application configured logging itself."""
    root = logging.getLogger()
    if log.handlers or root.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("teraio: %(message)s"))
    log.addHandler(handler)
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)


class GraphRunner:
    """The lifecycle of one captured graph at one set of input shapes (see the module docstring)."""

    def __init__(
        self,
        backend: TeraioBackend,
        graph_id: int,
        gm: fx.GraphModule,
        example_inputs: list[Any],
    ) -> None:
        self.backend = backend
        self.cfg = backend.cfg
        self.graph_id = graph_id
        self.gm = gm
        self.example_inputs = example_inputs
        self.profiler: StepProfiler | None = None
        self.profile: Profile | None = None
        self.plan: Plan | None = None
        # Note: [A graph called several times per step is planned per call]: the plan of each call of a
        # step (by its ordinal), when they differ; ``plan`` is the first call's, and serves calls beyond.
        self.plans: dict[int, Plan] = {}
        self.plan_before_outside: Plan | None = None
        self.plans_before_outside: dict[int, Plan] = {}
        self._compiled_for: dict[int, Callable[..., Any]] = {}  # ordinal -> compilation with its plan
        self.saved_call_plans = 0  # run_dir: plan_call<j>.json written for j < this
        self.rewrite: RewriteResult | None = None
        self.invocations = 0
        self.abandoned_forwards = 0  # forwards whose autograd graph was freed without a backward
        self.step_budget_bytes: int | None = None  # the step budget this graph was planned under
        self._pending_error: Exception | None = None
        self._call_params: frozenset[int] | None = None  # inputs of the first call that are parameters
        #: The offloaded parameters of each call while profiling (Note: [Fetched parameters are the graph's
        #: memory] in teraio.states.residency).
        self._param_calls: set[tuple[int, ...]] = set()
        self._param_idxs: tuple[int, ...] | None = (
            None  # inputs that are offloaded parameters (teraio.states)
        )
        # Note: [A graph Dynamo replaced keeps its shape] in teraio.lifecycle.shapes: which Dynamo frame the graph
        # was traced from, its inputs' sources, the shapes it was compiled for, and what it computes.
        self.frame = frame_of(gm)
        self.sources = placeholder_sources(gm)
        self.signature = shape_key(example_inputs)
        self.computation_fingerprint: str | None = None
        self.compiles = 1  # compilations so far (a new plan is a new compilation)
        #: The parameters' storages the graph computes with (which model it belongs to: teraio.lifecycle.step_stats).
        self.parameter_ids: frozenset[int] = frozenset()
        self._memory_invocation: Any = None  # the invocation of a kernel-memory step in progress
        self.sites = (
            SiteMemory()
        )  # Note: [Forwards never backpropagated move nothing] in teraio.lifecycle.discarded_forwards
        self._plain: Callable[..., Any] | None = None
        self.unplanned_calls = 0
        self._unplanned_peak_bytes: int | None = None
        self._training = False
        self.phase = Phase.PROFILING
        self._compiled = compile_graph(
            gm,
            example_inputs,
            self.cfg.inner,
            self._on_profiling_partition,
            identity="profiling",
            graph_compiler=self._profiling_compiler,
            inductor_options=backend.inductor_options,
            # Not with plans from a file: a graph they cover is never profiled (one that is not then
            # calibrates on the FX graph, and its profile says so in ``calibrated_on``). On Inductor the
            # kernels also give the memory timeline: Note: [The budget is of the graph that runs] in
            # teraio.graph.kernel_memory.
            calibration_kernels=(
                profiling_split(self.cfg.profile_steps)[1] > 0 or self.cfg.inner == "inductor"
            )
            and not backend.plans_from_file,
        )
        if not self._training:
            self.phase = Phase.INFERENCE

    @property
    def name(self) -> str:
        return f"graph {self.graph_id}"

    @property
    def is_training(self) -> bool:
        return self._training

    def plan_for(self, ordinal: int) -> Plan | None:
        """The plan of this graph's ``ordinal``-th call in a step (Note: [A graph called several times per
        step is planned per call])."""
        return self.plans.get(ordinal, self.plan)

    # ----------------------------------------------------------------------------------- compiling
    def _on_profiling_partition(self, step: CapturedStep) -> None:
        self._training = True
        self.computation_fingerprint = computation_fingerprint(step)
        self.profiler = StepProfiler(
            step,
            graph_id=self.graph_id,
            device=_device_of(self.example_inputs),
            granularity=granularity_for(self.cfg.inner),
        )
        a = self.profiler.analysis
        fingerprint = plan_fingerprint(a, self.profiler.segmentation.granularity)
        saved_bytes = sum(g.nbytes for g in a.groups if g.producer is not None)
        log.info(
            "profiling %s: %d forward and %d backward ops, %d saved tensors (%s of activations)",
            self.name,
            len(a.fw_ops),
            len(a.bw_ops),
            len(a.groups),
            _fmt(saved_bytes),
        )
        plans = self.backend.plans_from_file
        if plans:
            plan = next((p for p in plans if p.fingerprint == fingerprint), None)
            if plan is not None:
                self.plan = plan
                self.phase = Phase.PLANNING  # the plan says what to do: no profiling
            elif self.cfg.on_plan_mismatch == "error":
                have = ", ".join(p.fingerprint[:12] for p in plans)
                self._pending_error = PlanMismatchError(
                    f"plan '{self.cfg.plan}' was made for graph(s) {have}, not {self.name} "
                    f"({fingerprint[:12]}); re-profile and re-plan, or pass on_plan_mismatch='reprofile'"
                )
            else:
                log.warning("%s: no plan in %s matches; profiling it", self.name, self.cfg.plan)

    def _profiling_compiler(
        self,
        gm: fx.GraphModule,
        example_inputs: list[Any],
        is_backward: bool,
        kernels: Callable[..., Any] | None,
    ):
        prof = self.profiler
        assert prof is not None
        if kernels is not None:  # Note: [Calibrating on the compiler's own code] in teraio.graph.compilers
            prof.set_kernels(kernels, is_backward)

        tracker = self.backend.tracker
        outside = self.backend.outside

        def run_fwd(args: list[Any]) -> Any:
            t0 = time.perf_counter()
            out = prof.run_fwd(args)
            if prof.last_forward_calibrated:
                step = tracker.current_step
                outside.graph_ran(step.index if step else None, self, time.perf_counter() - t0)
            return out

        def run_bwd(args: list[Any]) -> Any:
            t0 = time.perf_counter()
            inv = tracker.invocation_of_current_backward()
            out = prof.run_bwd(args, invocation=inv.id if inv is not None else None)
            if prof.last_backward_calibrated and inv is not None:
                outside.graph_ran(inv.step, self, time.perf_counter() - t0)
            if self.phase is Phase.PROFILING and self._profiled_enough():
                self.phase = Phase.PLANNING  # planned and compiled at the next forward, outside backward
            return out

        fn = run_bwd if is_backward else run_fwd
        fn._boxed_call = True  # type: ignore[attr-defined]
        return fn

    def _profiled_enough(self) -> bool:
        """``profile_steps`` steps done: the first takes the census, the second is timed op by op, and the
        rest (from three on) run uninstrumented to calibrate the op times (Note: [Calibrated times] in
        teraio.profiling.op_timing)."""
        prof = self.profiler
        assert prof is not None
        instrumented, calibration = profiling_split(self.cfg.profile_steps)
        return (
            prof.steps_recorded >= instrumented
            and prof.kernel_memory_settled
            and prof.steps_calibrated >= calibration
            and (prof.probe.done() if prof.probe is not None else not self._may_probe())
        )

    def _may_probe(self) -> bool:
        """Whether this graph's calibration steps may go on to price a transfer (Note: [Pricing transfers
        under the model's own compute] in teraio.profiling.transfer_probe): the backend wants the price, the steps run the
        graph's own Python code on the CPU, and its step is short enough."""
        prof = self.profiler
        if prof is None or prof.has_kernels or prof.device != "cpu" or not prof.calibrations:
            return False
        f, b = prof.calibrations[-1]
        return self.backend.wants_transfer_price() and round_trips_for(f.wall_s + b.wall_s) is not None

    def _start_probe(self) -> None:
        prof = self.profiler
        assert prof is not None and prof.calibrations
        f, b = prof.calibrations[-1]
        round_trips = round_trips_for(f.wall_s + b.wall_s)
        assert round_trips is not None
        prof.probe = TransferProbe(self.backend.probe_engine_id(), probe_variants(round_trips))
        # The last plain step is the first probed one's pair.
        prof.probe.record(0, f.wall_s + b.wall_s)
        if prof.outside_samples_s:
            prof.probe.record_outside(prof.outside_samples_s[-1])
        log.info(
            "%s: pricing transfers under its own compute: %d more calibration steps, every other one "
            "making page round trips (%s)",
            self.name,
            PROBE_STEPS,
            ", ".join(v.label for v in prof.probe.variants),
        )

    def _finish_profiling(self) -> None:
        assert self.profiler is not None
        self._finish_kernel_memory()
        if self.profile is None and self.profiler.steps_recorded > 0:
            extra: dict[str, Any] = {"inner": self.cfg.inner}
            if self.backend.states is not None:  # states="offload": the step's other tensors, by kind
                extra["model_states"] = self.backend.states.model_states()
            self.profile = self.profiler.build_profile(extra)
            self._count_fetched_parameters()
            self.backend._save_profile(self)

    def _count_fetched_parameters(self) -> None:
        """Note: [Fetched parameters are the graph's memory] in teraio.states.residency: the offloaded
        parameters a call of this graph fetches (and, when it runs once per block, the next call's read
        ahead) are memory every op of the graph runs with."""
        residency = self.backend.states.residency if self.backend.states is not None else None
        if residency is not None and self.profile is not None:
            add_fetched_parameters(self.profile, residency, self._param_calls)

    def _param_positions(self) -> frozenset[int]:
        """Which forward inputs are parameters: as profiled, else as the first call passed them."""
        if self.profile is not None and "param_positions" in self.profile.meta:
            return frozenset(int(i) for i in self.profile.meta["param_positions"])
        return self._call_params or frozenset()

    def compile_final(self) -> None:
        """Recompile with the plan's migration ops (or none), for every later forward; one compilation per
        distinct plan when the calls of a step have plans of their own."""
        by_ordinal = self.plans or {0: self.plan}
        compiled: dict[str, Callable[..., Any]] = {}
        self._compiled_for = {}
        for ordinal, p in sorted(by_ordinal.items()):
            plan = p if self.cfg.enabled and p is not None and p.decisions else None
            identity = "final:" + (hashlib.sha256(plan.to_json().encode()).hexdigest() if plan else "no-plan")
            if identity not in compiled:
                compiled[identity] = self._compile_with(plan, identity)
            self._compiled_for[ordinal] = compiled[identity]
        self._compiled = self._compiled_for[min(self._compiled_for)]
        if len(self._compiled_for) == 1:
            self._compiled_for = {}
        self.phase = Phase.RUNNING
        self.compiles += 1
        if self.profile is not None and self.profiler is not None:
            self.profiler.abandon_kernel_memory()  # never leave a profiler session running unowned
            self.profiler = None
        if len(compiled) > 1:
            log.info(
                "running %s with a plan per call of the step: %s",
                self.name,
                "; ".join(f"call {j}: {describe_plan(p)}" for j, p in sorted(self.plans.items())),
            )
        else:
            plan = self.plan if self.cfg.enabled and self.plan is not None and self.plan.decisions else None
            log.info("running %s with %s", self.name, describe_plan(plan) if plan else "no migration")

    def _compile_with(self, plan: Plan | None, identity: str) -> Callable[..., Any]:
        """The graph compiled with ``plan``'s migration ops (None: without any)."""

        def on_partition(step: CapturedStep) -> CapturedStep | None:
            if plan is None:
                return None
            analysis = analyse_saved(step)
            # Note: [Migration ops sit between kernels] in teraio.graph.kernel_boundaries
            segmentation = Segmentation.of(analysis, granularity_for(self.cfg.inner))
            rebuild = recipes(step, analysis, self._param_positions()) if plan.recomputes else None
            # Completely, before a byte is reserved.
            check_plan(coarsen(analysis, segmentation, step.saved_nodes), plan, rebuild)
            engine_id = self.backend.engine_id_for(plan)
            self.rewrite = apply_plan(
                step,
                plan,
                engine_id,
                key_prefix=f"g{self.graph_id}",
                analysis=analysis,
                segmentation=segmentation,
                recipe_by_group=rebuild,
            )
            return self.rewrite.step

        return compile_graph(
            self.gm,
            self.example_inputs,
            self.cfg.inner,
            on_partition,
            identity=identity,
            inductor_options=self.backend.inductor_options,
        )

    def _without_plan(self) -> Callable[..., Any]:
        """The graph compiled without migration ops, for calls whose outputs are never backpropagated
        (compiled once, when first needed)."""
        if self._plain is None:
            log.info(
                "%s: forwards from one line of the loop are never backpropagated; they run without "
                "migration (their saved tensors are freed with their autograd graph)",
                self.name,
            )
            self._plain = compile_graph(
                self.gm,
                self.example_inputs,
                self.cfg.inner,
                lambda step: None,
                identity="final:no-plan",
                inductor_options=self.backend.inductor_options,
            )
        return self._plain

    # ------------------------------------------------------------------------------------- calling
    def __call__(self, *args: Any) -> Any:
        if self._pending_error is not None:
            raise self._pending_error
        if any(isinstance(a, FakeTensor) for a in args):
            # Note: [DDP's fake first call] DDP's graph optimizer runs each compiled piece once on fake
            # tensors while it compiles, to learn its outputs' strides, and AOTAutograd answers that first
            # call with fake outputs without running the compiled graphs. It is not a step: nothing is
            # profiled or counted. Answered any other way, AOTAutograd's first *real* call returned fakes.
            return self._compiled(*args)
        forward_count.note_forward()
        self.backend.forward_calls += 1
        if self._call_params is None:
            self._call_params = frozenset(
                i for i, kind in enumerate(classify_inputs(list(args))) if kind == "param"
            )
            self.parameter_ids = frozenset(args[i].untyped_storage().data_ptr() for i in self._call_params)
        resident = self._resident_params(args)  # Note: [When a parameter is resident] in teraio.states.params
        if resident and self.phase is Phase.PROFILING:
            self._param_calls.add(resident)
        if self.phase is Phase.INFERENCE or not torch.is_grad_enabled():
            if not resident:
                return self._compiled(*args)
            residency = self.backend.states.residency
            residency.acquire(resident)
            try:
                return self._compiled(*args)
            finally:
                residency.release(resident)
        if self.phase is Phase.PROFILING:
            self._before_profiled_forward()
        self.backend._advance(self)
        tracker = self.backend.tracker
        step = tracker.begin_forward(self)
        calibrating = (
            self.phase is Phase.PROFILING and self.profiler is not None and self.profiler.calibrate_next
        )
        self.backend.outside.forward_starts(step.index, not step.calls, calibrating)
        # Note: [Forwards never backpropagated move nothing] in teraio.lifecycle.discarded_forwards: such a forward neither
        # runs the plan nor starts a step measurement (which would hold the process's one profiler
        # session through the loop's code until the forward is found abandoned).
        site = call_site() if self.phase is Phase.RUNNING else None
        never_backpropagated = site is not None and self.sites.skip_plan(site)
        if not never_backpropagated:
            self.backend._maybe_start_measurement()
        compiled = self._compiled
        if self._compiled_for:  # Note: [A graph called several times per step is planned per call]
            ordinal = sum(1 for g, k, _ in step.calls if g is self and k is CallKind.FWD)
            compiled = self._compiled_for.get(ordinal, compiled)
        if never_backpropagated and self.rewrite is not None:
            compiled = self._without_plan()
            self.unplanned_calls += 1
        if resident:
            out = self._call_with_parameters(compiled, args, resident, first_of_step=len(step.calls) == 0)
        else:
            out = compiled(*args)
        inv = tracker.end_forward(self, out, site)
        self.invocations += 1
        if self.phase is Phase.PROFILING and self.profiler is not None and inv is not None:
            if self.profiler.memory_step_running:
                self._memory_invocation = inv
            self.profiler.bind_last_forward(inv.id, abandoned=inv.end is InvocationEnd.ABANDONED)
        return out

    def _resident_params(self, args: tuple[Any, ...]) -> tuple[int, ...]:
        """This call's inputs that are offloaded parameters (by index in the optimizer). Per call: one
        graph compiled for a block runs with every block's parameters."""
        states = self.backend.states
        if states is None or states.residency is None:
            return ()
        return states.residency.indices(args)

    def _call_with_parameters(
        self, compiled: Callable[..., Any], args: tuple[Any, ...], idxs: tuple[int, ...], first_of_step: bool
    ) -> Any:
        """Note: [When a parameter is resident] in teraio.states.params: fetched for the forward, freed
        after it, fetched again for the backward."""
        from teraio.lifecycle.steps import backward_node

        residency = self.backend.states.residency
        residency.around_forward(idxs, first_of_step)
        try:
            out = compiled(*args)
            node = backward_node(out)
            if node is not None:
                residency.hook_backward(node, idxs)
        finally:
            residency.release(idxs)
        return out

    def _finish_kernel_memory(self) -> None:
        """Read a kernel-memory step's timeline (outside backward), if one ran; keep it only when that step
        ran this graph alone: no other forward of any backend in between (Note: [The budget is of the graph
        that runs] in teraio.graph.kernel_memory)."""
        prof = self.profiler
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
                self.name,
                _fmt(prof.kernel_memory.peak_bytes),
                _fmt(
                    max((b for r in prof.fwd_runs[:1] + prof.bwd_runs[:1] for b in r.live_bytes), default=0)
                ),
            )
        elif prof.kernel_memory_note is not None:
            log.warning(
                "%s: planning on the op-by-op census of memory, not the kernels' own timeline: %s",
                self.name,
                prof.kernel_memory_note,
            )

    def _before_profiled_forward(self) -> None:
        prof = self.profiler
        if prof is None:
            return
        self._finish_kernel_memory()
        instrumented, calibration = profiling_split(self.cfg.profile_steps)
        step = self.backend.tracker.current_step
        if (
            prof.steps_recorded >= instrumented
            and prof.wants_kernel_memory
            and (step is None or step.complete)  # the step's first forward: nothing else in flight
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
        if self.abandoned_forwards >= 2 * self.cfg.profile_steps + 2 and prof.steps_recorded == 0:
            # Called with grad enabled again and again, never backpropagated (a validation loss in
            # train mode): profiling would never finish, and interpreting every call is slow. Counted by
            # forwards whose autograd graph was freed without a backward, not by calls: a block compiled
            # on its own runs once per block before the step's first backward.
            log.info(
                "%s: %d forwards and no backward; running it without a plan",
                self.name,
                self.abandoned_forwards,
            )
            prof.discard_pending()
            self.phase = Phase.PLANNING


#: How far a measured step peak may exceed the prediction before the user is told (the budget tests hold
#: measured peaks to 5% over the budget).
PREDICTION_SLACK = 1.05

#: Measured steps whose peaks must all exceed the prediction before the excess is taken as memory outside
#: the graphs (Note: [Memory outside the graphs is measured and planned for]); the smallest excess counts.
OUTSIDE_CONFIRMING_STEPS = 2

#: Plans per graph at most, for a graph called several times per step (Note: [A graph called several
#: times per step is planned per call]): each distinct plan is one more compilation.
MAX_PLANS_PER_GRAPH = 4


def _warn_unplanned_memory(measured_bytes: int, predicted_bytes: int | None, graphs: int) -> None:
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
        _fmt(measured_bytes),
        100 * (measured_bytes / predicted_bytes - 1),
        _fmt(predicted_bytes),
        cause,
    )


def _device_of(example_inputs: list[Any]) -> str:
    """The device a graph computes on: its first non-CPU tensor input's (a leading CPU index or scalar
    tensor does not make a CUDA graph "cpu"), else the first tensor's, else "cpu"."""
    devices = [a.device for a in example_inputs if isinstance(a, torch.Tensor)]
    return str(next((d for d in devices if d.type != "cpu"), devices[0] if devices else "cpu"))


def describe_plan(plan: Plan) -> str:
    """What a plan does per step, in words: "offloads 12 tensors (1.2 MiB), recomputes 3 (96 KiB, 4 ms)"."""
    offloaded = len(plan.decisions) - len(plan.recomputes)
    parts = []
    if offloaded or not plan.recomputes:
        parts.append(f"offloads {offloaded} tensors ({_fmt(plan.moved_bytes)})")
    if plan.recomputes:
        parts.append(
            f"recomputes {len(plan.recomputes)} ({_fmt(plan.recomputed_bytes)}, {plan.recompute_s * 1e3:.1f} ms)"
        )
    return ", ".join(parts) + " per step"


def _ms(seconds: list[float]) -> str:
    return "/".join(f"{s * 1e3:.1f}" for s in seconds) + " ms"


def _fmt(nbytes: int | float | None) -> str:
    from teraio.units import format_bytes

    return format_bytes(nbytes)


class TeraioBackend:
    """A configured backend: ``torch.compile(model, backend=teraio.backend(**options))``."""

    def __init__(self, config: BackendConfig | None = None, /, **options: Any) -> None:
        _ensure_log_handler()
        if config is not None and options:
            raise TypeError("TeraioBackend takes a BackendConfig or keyword options, not both")
        self.cfg = config if config is not None else make_config(**options)
        warm_up_mkl_vml()  # Note: [MKL VML's first concurrent call] in teraio.platform.mkl_vml
        self.runners: list[GraphRunner] = []
        self.engine: Any = None
        self._engine_id: int | None = None
        self.plans_from_file: list[Plan] = []
        self.inductor_options: dict[str, Any] = {}  # torch.compile's mode and options, for inner="inductor"
        self.backend_id = process.register(self)  # the process-wide view: teraio.process_stats()
        self.ranks = (
            RankAgreement()
        )  # Note: [Ranks agree at the start of every step] in teraio.lifecycle.ranks
        self._ranks_ready = False
        self._told_sharing = False
        # Note: [Memory outside the graphs is measured and planned for]
        self._outside_bytes = 0
        self._outside_rounds = 0
        self._outside_excess_bytes: list[int] = []  # measured excesses not yet planned for
        self._outside_confirming = False  # an excess awaits a second measured step
        self._replan_wanted = False
        self.tracker = StepTracker(on_step_end=self._on_step_end, on_invocation_end=self._on_invocation_end)
        self.step_stats = StepStats()  # Note: [Models of one backend] in teraio.lifecycle.step_stats
        self.forward_calls = 0  # this backend's forwards (Note: [A measured step belongs to one backend])
        self._measure_counts_start = self._measure_counts_end = (0, 0)
        self._measured_calls: list[tuple[Any, Any, int]] = []
        self.outside = OutsideTimer(on_sample=self._outside_sample)
        self._lock = threading.RLock()
        self._measure = MeasureState.WAITING
        self._recorder: Any = None
        self._measured_step: int | None = None
        self.measured_peak_bytes: int | None = None
        self.predicted_step_peak_bytes: int | None = None
        self._step_t0: dict[int, tuple[Clock, Any]] = {}  # step index -> its clock and start mark
        self._step_ends: deque[tuple[StepRecord, Clock, Any, Any]] = deque()  # not yet read
        self._times_lock = threading.Lock()
        self._compiles_at: dict[int, int] = {}  # step index -> compiles that happened during it
        self.step_times_s: list[float] = []  # complete running steps, every graph in its final phase
        self._told_profile_only = False
        self._hardware: HardwareModel | None = None
        # Note: [Pricing transfers under the model's own compute] in teraio.profiling.transfer_probe
        self._probe_engine: Any = None
        self._probe_engine_id: int | None = None
        #: Per probed graph: each variant's round trips and page bytes, its probed-minus-plain seconds,
        #: and the price (None: hidden).
        self.transfer_probes: list[dict[str, Any]] = []
        #: The price of moving tensors measured under the graphs' own compute (the first probe's).
        self.transfer_price: TransferPrice | None = None
        self._saved_hardware: HardwareModel | None = None
        if self.cfg.hardware is not None and self.cfg.hardware != CALIBRATE:
            # A bad file fails here, in one line, not when the first plan is made steps later.
            self._hardware = HardwareModel.load(self.cfg.hardware)
        #: Made once per backend: in config.json and on every stats.jsonl line (runs may share a run_dir).
        self.run_id = secrets.token_hex(8)
        self.run_dir = Path(self.cfg.run_dir) if self.cfg.run_dir else None
        info = rank_info()
        if self.run_dir is not None and info.distributed:
            # Under torchrun every rank writes its own: rank0/, rank1/, ... (teraio show reads them all).
            self.run_dir = self.run_dir / f"rank{info.rank}"
        # Before anything is written: never replace another program's files.
        refuse_foreign_run_dir(self.run_dir)
        # Every write into run_dir goes through it: Note: [Run-directory files are by-products].
        self._run: RunDir | None = None
        if self.run_dir is not None:
            self._run = RunDir.open(self.run_dir, self.run_id)
            self._run.write_config(json.loads(json.dumps(self.cfg.recorded(), default=str)))
        if self.cfg.plan is not None:
            self.plans_from_file = load_plans(self.cfg.plan)
        self.states = attach_states(self.cfg)  # states="offload": teraio.states (issue 23)
        #: Note: [The whole-step budget keeps some states in memory] in teraio.states.residency.
        self.whole_step = None if self.states is None else WholeStepStates(self.states, self.cfg.states_keep)

    # ---------------------------------------------------------------------------- torch.compile API
    def __call__(
        self,
        gm: fx.GraphModule,
        example_inputs: list[Any],
        mode: str | None = None,
        options: dict[str, Any] | None = None,
    ) -> Callable[..., Any]:
        self.inductor_options = check_compile_mode(mode, options, self.cfg.inner)
        examples = list(example_inputs)
        if is_dynamic(examples):
            return ShapeDispatch(self, gm, examples)
        return self._new_runner(gm, examples)

    def _new_runner(self, gm: fx.GraphModule, examples: list[Any]) -> GraphRunner:
        with self._lock:
            runner = GraphRunner(self, len(self.runners), gm, examples)
            self.runners.append(runner)
            step = self.tracker.current_step
            if step is not None and not step.complete:
                self._compiles_at[step.index] = self._compiles_at.get(step.index, 0) + 1
            return runner

    # ---------------------------------------------------------------------------------- lifecycle
    def _advance(self, runner: GraphRunner) -> None:
        """Move phases at a forward call (outside any backward): finish measurements, plan, compile."""
        self.tracker.settle()  # forwards abandoned since the last call end (Note: [Invocations are autograd nodes])
        # The torch profiler's session is the process's one (and holds stderr while it runs): whatever
        # measurement of any backend ended is read now, so none holds it past the next forward.
        for b in process.backends():
            b._finish_recorders()
        self._read_step_times(wait=False)
        step = self.tracker.current_step
        if step is None or step.complete:
            replan = self._replan_wanted
            if self.ranks.active():  # Note: [Ranks agree at the start of every step]
                ready_here = any(r.phase is Phase.PLANNING for r in self.runners)
                agreed = self.ranks.reduce([1.0 if ready_here else 0.0, -1.0 if replan else 0.0], "min")
                self._ranks_ready, replan = agreed[0] >= 1.0, agreed[1] < 0
            if replan:  # Note: [Memory outside the graphs is measured and planned for]
                self._replan_wanted = False
                for r in self.runners:
                    if r.is_training and r.profile is not None and r.phase is Phase.RUNNING:
                        # Kept when the budget cannot absorb that memory.
                        r.plan_before_outside, r.plans_before_outside = r.plan, r.plans
                        r.plan, r.plans, r.phase = None, {}, Phase.PLANNING
                self._ranks_ready = True
        if runner.phase is not Phase.PLANNING:
            return
        if self.ranks.active() and not self._ranks_ready:
            return  # another rank is still profiling: plan together at a later step
        with self._lock:
            if runner.phase is not Phase.PLANNING:
                return
            self._collect_probes()  # Note: [Pricing transfers under the model's own compute] in teraio.profiling.transfer_probe
            for r in self.runners:
                if r.phase is Phase.PLANNING and r.profiler is not None and r.profile is None:
                    r._finish_kernel_memory()
                    if r.profiler.wants_kernel_memory:  # its step did not run alone: measure again
                        r.phase = Phase.PROFILING
            ready = [r for r in self.runners if r.phase is Phase.PLANNING]
            for r in ready:
                if r.plan is None and r.profiler is not None:
                    r._finish_profiling()
            unplanned = [r for r in ready if r.plan is None and r.profile is not None]
            if unplanned and self.cfg.enabled and self.cfg.memory_budget is not None:
                self._plan_step(unplanned)
            elif unplanned and self.cfg.enabled and self.cfg.memory_budget is None:
                self._tell_profile_only()
            for r in ready:
                if r.phase is Phase.PLANNING:
                    r.compile_final()
            step = self.tracker.current_step
            if step is not None and not step.complete:
                self._compiles_at[step.index] = self._compiles_at.get(step.index, 0) + 1

    def _tell_profile_only(self) -> None:
        if self._told_profile_only:
            return
        self._told_profile_only = True
        where = f" (profiles in {self.run_dir})" if self.run_dir else ""
        log.info(
            "profiled %d graph(s)%s; no memory_budget was set, so nothing is offloaded. To offload, use "
            "torch.compile(model, backend=teraio.backend(memory_budget='50%%'))",
            len([r for r in self.runners if r.profile is not None]),
            where,
        )

    # Note: [A graph called several times per step is planned per call]
    #     One graph may run several times in a step with its invocations in flight together: each block of
    #     a model compiled on its own (``block.compile()``, torchtitan's way, with or without FSDP2) gives
    #     Dynamo one graph that runs once per block. The first block's saved tensors are held from its
    #     forward to the end of the backward; the last block's backward follows its forward at once. So
    #     each call of a step (its ordinal among the graph's forwards in the step) is a node of the step's
    #     composition with a plan of its own: the calls start with everything offloadable moved, and from
    #     the latest forward back, each gets the largest budget that still composes within the step's
    #     (teraio.planner.budget_split.split_budget's ``relax``). The last calls keep what they save; the first,
    #     idle longest, move it. At most MAX_PLANS_PER_GRAPH plans per graph (consecutive calls share one)
    #     bound the compilations. A call beyond those planned (a step with more calls) takes the first
    #     call's plan, which holds the least. Each plan's own time model still sees its forward followed
    #     by its backward: the I/O of the early calls hides behind the other blocks' compute in practice,
    #     which the prediction does not count (it is pessimistic there).
    def _plan_step(self, ready: list[GraphRunner]) -> None:
        from teraio.planner import budget_split as step_budget
        from teraio.planner.budget import BudgetError, resolve_budget
        from teraio.planner.budget_split import GraphMemory, step_peak
        from teraio.planner.lifetimes import analyse

        graphs = [r for r in self.runners if r.profile is not None and r.is_training]
        calls = self._step_calls(graphs)
        ordinals = invocation_ordinals(calls)
        counts: dict[GraphRunner, int] = {}
        for g, _, i in calls:
            counts[g] = max(counts.get(g, 0), ordinals.get(i, 0) + 1)

        def group(r: GraphRunner, ordinal: int) -> int:
            n = counts.get(r, 1)
            return ordinal * MAX_PLANS_PER_GRAPH // n if n > MAX_PLANS_PER_GRAPH else ordinal

        def node_of(g: GraphRunner, inv: int) -> tuple[GraphRunner, int]:
            return (g, group(g, ordinals.get(inv, 0)))

        node_calls = [(node_of(g, i), k, i) for g, k, i in calls]
        nodes = list(dict.fromkeys(n for n, _, _ in node_calls))
        first_ordinal = {}
        for g, _, i in calls:
            first_ordinal.setdefault(node_of(g, i), ordinals.get(i, 0))
        lifetimes = {r: analyse(r.profile) for r in graphs}

        def held(r: GraphRunner, plan: Plan | None) -> int:
            after = int(r.profile.meta.get("census_after_fwd_bytes", 0))
            return max(0, after - (plan.moved_bytes if plan is not None else 0))

        def memory_of(node: tuple[GraphRunner, int], plan: Plan | None) -> GraphMemory:
            r = node[0]
            if plan is None:
                return GraphMemory(lifetimes[r].baseline_peak_bytes, held(r, None))
            return GraphMemory(plan.predicted_peak_bytes, held(r, plan))

        fixed = {n: n[0].plan_for(first_ordinal[n]) for n in nodes if n[0] not in ready}
        memory = {n: memory_of(n, fixed.get(n)) for n in nodes}
        step_unplanned, _ = step_peak(node_calls, {n: memory_of(n, None) for n in nodes})
        # Note: [Memory outside the graphs is measured and planned for]: a fraction is of the whole step's
        # unplanned peak, outside memory included, and the graphs get the budget less that memory.
        outside = self._outside_bytes
        # Note: [The whole-step budget keeps some states in memory] in teraio.states.residency: with
        # states="offload" a fraction is of the whole step, parameters, gradients and states included.
        whole = (
            self.whole_step.sizes(held_by_graphs([r._param_calls for r in self.runners]))
            if self.whole_step is not None
            else None
        )
        state_total = whole.total_bytes if whole is not None else 0
        fixed = whole.fixed_bytes if whole is not None else 0
        budget_bytes = resolve_budget(self.cfg.memory_budget, step_unplanned + outside + state_total)
        if budget_bytes is not None and self.ranks.active():
            # Note: [Ranks agree at the start of every step]: the smallest rank's budget is everyone's.
            budget_bytes = int(self.ranks.reduce([budget_bytes], "min")[0])
        for r in ready:
            r.step_budget_bytes = budget_bytes
            r.plans = {}
        graphs_budget = None if budget_bytes is None else budget_bytes - outside - fixed
        if budget_bytes is None:  # "auto": each graph's own smallest stall-free peak
            for r in ready:
                r.plan = self._solve(r, "auto")
            return
        plans: dict[tuple[GraphRunner, int], Plan] = {}
        solved: dict[tuple[GraphRunner, int, bool], Plan] = {}  # a graph planned for one budget once

        def plan_graph(n: tuple[GraphRunner, int], b: int, fast: bool) -> GraphMemory:
            r = n[0]
            if r not in ready:
                return memory[n]
            if (r, b, fast) not in solved:
                solved[(r, b, fast)] = self._solve(r, b, solver="greedy" if fast else None, quiet=fast)
            plans[n] = solved[(r, b, fast)]
            return memory_of(n, plans[n])

        log.info(
            "planning %d graph(s) for a step budget of %s (%s; solver %s, time limit %.0f s per graph)",
            len(ready),
            _fmt(budget_bytes),
            self.cfg.memory_budget,
            self.cfg.solver,
            self.cfg.time_limit,
        )

        def min_held(n: tuple[GraphRunner, int]) -> int:
            r = n[0]
            if r not in ready:
                return memory[n].held_bytes
            t = r.profile.tensors
            movable = int(t.loc[t["offloadable"] & (t["first_bwd_use_idx"] >= 0), "nbytes"].sum())
            return max(0, held(r, None) - movable)

        several = {n for n in nodes if n[0] in ready and counts.get(n[0], 1) > 1}
        last_forward = {n: j for j, (n, k, _) in enumerate(node_calls) if k == "fwd"}
        failure: BudgetError | None = None
        try:
            step_budget.split_budget(
                node_calls,
                graphs_budget,
                memory,
                plan_graph,
                {n: lifetimes[n[0]].min_feasible_peak_bytes for n in nodes},
                {n: min_held(n) for n in nodes},
                lambda n: n[0].name + (f" (call {first_ordinal[n]} of the step)" if n in several else ""),
                relax=sorted(several, key=lambda n: -last_forward.get(n, -1)),
            )
        except BudgetError as exc:
            failure = exc
            if fixed:  # Note: [The whole-step budget keeps some states in memory]
                failure = whole_step_budget_error(exc, budget_bytes, fixed, outside)
        if self.ranks.active():  # every rank raises, or none: one rank raising alone hangs the others
            floors = self.ranks.gather(float(failure.smallest_peak_bytes or 1) if failure else 0.0)
            if failure is None and any(floors):
                worst = max(range(len(floors)), key=lambda i: floors[i])
                failure = BudgetError(
                    f"memory_budget {_fmt(budget_bytes)} cannot be met on rank {worst} (its smallest achievable "
                    f"step peak is {_fmt(floors[worst])}); every rank stops here: use a budget of at least that",
                    smallest_peak_bytes=int(floors[worst]),
                )
        if failure is not None and outside and all(r.plan_before_outside is not None for r in ready):
            # Note: [Memory outside the graphs is measured and planned for]: training already runs within
            # the graphs' share; stopping it for memory the loop holds would lose a job that works. Every
            # rank takes this branch together (the failure was gathered above).
            for r in ready:
                r.plan, r.plans, r.phase = r.plan_before_outside, r.plans_before_outside, Phase.RUNNING
            log.warning(
                "the step holds %s outside teraio's graphs, more than memory_budget %s leaves beside them (%s); "
                "the graphs keep their plans and the step peaks above the budget: free what the loop holds "
                "through backward or raise the budget",
                _fmt(outside),
                _fmt(budget_bytes),
                failure,
            )
            kept = {n: memory_of(n, n[0].plan_for(first_ordinal[n])) for n in nodes if n[0] in ready}
            region = step_peak(node_calls, {**memory, **kept})[0] + outside
            if self.whole_step is not None:  # the kept states stay; the whole step peaks higher too
                self.whole_step.predict(region)
            self.predicted_step_peak_bytes = region - self._kept_held_bytes()
            return
        if failure is not None:
            raise failure
        for r in {n[0] for n in plans}:
            mine = {first_ordinal[n]: plans[n] for n in plans if n[0] is r}
            r.plan = mine[min(mine)]
            if len({id(p) for p in mine.values()}) > 1:
                r.plans = {j: plans[(r, group(r, j))] for j in range(counts[r])}
            self._save_plan(r)
        self.predicted_step_peak_bytes = (
            step_peak(node_calls, {n: memory_of(n, n[0].plan_for(first_ordinal[n])) for n in nodes})[0]
            + self._outside_bytes
        )
        log.info("predicted step peak %s", _fmt(self.predicted_step_peak_bytes))
        if self.whole_step is not None:  # Note: [The whole-step budget keeps some states in memory]
            whole_peak = self.whole_step.plan(
                budget_bytes, self.predicted_step_peak_bytes, self.cfg.solver, step_unplanned + outside
            )
            self.predicted_step_peak_bytes -= self._kept_held_bytes()
            kept = self.whole_step.residency
            log.info(
                "whole step: %s of parameters that stay, %s of states kept in memory by the plan, predicted "
                "peak %s (budget %s)",
                _fmt(fixed),
                _fmt(kept.kept_bytes if kept is not None else 0),
                _fmt(whole_peak),
                _fmt(budget_bytes),
            )

    def _step_calls(self, graphs: list[GraphRunner], absent_too: bool = True) -> list[tuple[Any, str, int]]:
        """The calls among ``graphs`` of every kind of step seen (teraio.lifecycle.step_stats), one kind after the
        other: a kind's invocations all end within it, so the composed peak of the sequence is the largest
        of any kind's (a discriminator's step with two forwards, and its other step with one, are both
        bounded). With ``absent_too``, graphs that no complete step called are appended as one forward
        and backward each (planned as if they ran alone)."""
        calls = [
            (g, getattr(k, "value", k), i)
            for kind in self.step_stats.kinds.values()
            for g, k, i in kind.last_calls
            if g in graphs
        ]
        if not absent_too:
            return calls
        seen = {g for g, _, _ in calls}
        for n, r in enumerate(g for g in graphs if g not in seen):
            calls += [(r, "fwd", -1 - n), (r, "bwd", -1 - n)]
        return calls

    def _solve(
        self, runner: GraphRunner, budget: int | str, solver: str | None = None, quiet: bool = False
    ) -> Plan:
        from teraio.planner.solve import default_recompute, solve

        name = solver or self.cfg.solver
        t0 = time.perf_counter()
        plan = solve(
            runner.profile,
            budget=budget,
            solver=name,
            hardware=self.hardware_model(),
            time_limit_s=float(self.cfg.time_limit),
            deterministic_time_s=self.cfg.deterministic_time_limit,
            workers=self.cfg.solver_workers,
            # The fast plans of the budget search are greedy's: offload only.
            recompute="off" if solver == "greedy" else (self.cfg.recompute or default_recompute(name)),
        )
        log.log(
            logging.DEBUG if quiet else logging.INFO,
            "%s: plan by %s in %.1f s %s; predicted peak %s, step %.3f s",
            runner.name,
            plan.solver,
            time.perf_counter() - t0,
            describe_plan(plan),
            _fmt(plan.predicted_peak_bytes),
            plan.predicted_step_s,
        )
        return plan

    # -------------------------------------------------------------------------------- measurement
    def _on_step_end(self, step: StepRecord) -> None:
        # Runs inside a backward hook or a finalizer (tracker lock held): only note what happened.
        started = self._step_t0.pop(step.index, None)
        clean = step.abandoned == 0 and not self._compiles_at.pop(step.index, 0)
        self.outside.step_ended(step.index, clean)
        final = self._step_final(step)
        if started is not None and clean and final:
            clock, t0 = started
            self._step_ends.append((step, clock, t0, clock.mark()))
            self._read_step_times(wait=False)
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
            and self.cfg.measure_memory
            and (self._outside_confirming or self.step_stats.needs_measurement(self._kind_generation))
        ):
            self._measure = MeasureState.ARMED

    @staticmethod
    def _on_invocation_end(inv: Any) -> None:
        # In a backward hook or a finalizer: a dict update only (Note: [Forwards never backpropagated move
        # nothing] in teraio.lifecycle.discarded_forwards).
        if inv.site is not None:
            inv.graph.sites.ended(inv.site, inv.end is InvocationEnd.ABANDONED)
        runner = inv.graph
        if inv.end is InvocationEnd.ABANDONED:
            runner.abandoned_forwards += 1
        if (
            inv.end is InvocationEnd.BACKWARD
            and runner.phase is Phase.PROFILING
            and runner._pending_error is None
            and torch._dynamo.compiled_autograd.in_compiled_autograd_region
        ):
            # Note: [Compiled autograd runs its own copy of the backward] Compiled autograd traces the
            # partitioned backward graph into a graph of its own and runs that, never the backward teraio
            # compiled: the profiler, which runs inside that backward, never sees it, and profiling would
            # never end (a silent run without a plan). Plans survive it (they are written into the
            # partitioned graphs, which it copies), so only profiling must run without it.
            runner._pending_error = UserInputError(
                f"{runner.name}: compiled autograd ran its backward while teraio was profiling it, which teraio "
                "cannot time; run the training steps without compiled autograd until teraio logs 'running "
                f"{runner.name}' (the first {runner.cfg.profile_steps} or a few more; plans survive compiled "
                "autograd after that), or pass plan= a plan made without it"
            )

    @staticmethod
    def _outside_sample(runner: GraphRunner, outside_s: float) -> None:
        if runner.profiler is not None and runner.profile is None:
            runner.profiler.add_outside_sample(outside_s)

    def _read_step_times(self, wait: bool) -> None:
        """Move ended steps' times into ``step_times_s`` (and stats.jsonl), in step order.

        Note: [Step times are read outside backward] On CUDA a step's end mark is an event recorded in
        the backward hook that ends the step, and it completes only when the compute stream gets
        there. Only completed marks are read (at the step's end, the next forward, ``stats()``); only
        ``stats()`` waits (``wait``), so no hook and no training step blocks on the device for them.
        """
        with self._times_lock:
            while self._step_ends:
                step, clock, t0, end = self._step_ends[0]
                if not clock.done(end):
                    if not wait:
                        return
                    clock.settle(end)
                self._step_ends.popleft()
                self.step_times_s.append(clock.elapsed_ns(t0, end) / 1e9)
                self.step_stats.add_time(StepStats.kind_of(step.calls), self.step_times_s[-1])
                self._append_stats(step)

    def _compute_device(self) -> str:
        """The device the step computes on (its graphs' inputs): step times and the peak recorder."""
        return _device_of([p for r in self.runners for p in r.example_inputs])

    @staticmethod
    def _step_final(step: StepRecord) -> bool:
        """Whether every graph the step called ran its final compilation. Graphs the step did not call do
        not count: a graph Dynamo replaced is never called again (Note: [A graph Dynamo replaced keeps its
        shape] in teraio.lifecycle.shapes), and a graph called only in some steps must not keep the others from
        being timed and measured."""
        return bool(step.calls) and all(g.phase in (Phase.RUNNING, Phase.INFERENCE) for g, _, _ in step.calls)

    def _maybe_start_measurement(self) -> None:
        step = self.tracker.current_step
        if step is None:
            return
        if step.index not in self._step_t0 and not step.calls:
            clock = Clock(self._compute_device())
            self._step_t0[step.index] = (clock, clock.mark())
        if self._measure is not MeasureState.ARMED or step.calls:
            return
        from teraio.profiling.measure import MemoryRecorder, ProfilerBusyError

        recorder = MemoryRecorder(self._compute_device())
        try:
            recorder.start()
        except ProfilerBusyError:
            return  # another measurement is recording: try on a later step
        self._recorder = recorder
        self._measured_step = step.index
        if self.whole_step is not None:
            self.whole_step.step_starts()
        # This step's first forward has been counted already (GraphRunner.__call__).
        self._measure_counts_start = (forward_count.forward_calls() - 1, self.forward_calls - 1)
        self._measure = MeasureState.ACTIVE

    # Note: [Memory outside the graphs is measured and planned for]
    #     Memory a step holds that no graph of the backend allocates is invisible to the profiles: FSDP2's
    #     all-gathered parameters (allocated before each block's graph runs and freed after it), tensors
    #     the loop creates between forward and backward. The measured step (the torch profiler, or the
    #     device's allocator) shows it: when a running step holds clearly more than its prediction
    #     (PREDICTION_SLACK) in OUTSIDE_CONFIRMING_STEPS measured steps in a row, the smallest difference
    #     is taken as memory outside the graphs, held throughout the step (one step's excess can be a
    #     one-off: under FSDP2 on a loaded machine one rank once saw three times its usual excess, and
    #     planning on it predicted 13% above every later step), and the graphs are planned once more: a
    #     fraction budget is then of the step's peak with that memory, and the graphs get the budget less
    #     it. Once: a later excess is reported, not chased. Under torchrun every rank plans again at the
    #     start of the same step (any rank that wants it decides: Note: [Ranks agree at the start of every
    #     step] in teraio.lifecycle.ranks).
    def _finish_measurement(self) -> None:
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
        predicted = self._predicted_peak(self._measured_calls)
        self.step_stats.measurements[kind] = Measurement(
            self._measured_step, kind, result.peak_bytes, predicted, self._kind_generation(kind)
        )
        self.measured_peak_bytes = result.peak_bytes
        if self.whole_step is not None:
            self.whole_step.step_measured(result.peak_bytes)
        log.info(
            "measured step peak %s (graphs %s; predicted %s)",
            _fmt(result.peak_bytes),
            ", ".join(str(g) for g in sorted(kind)),
            _fmt(predicted),
        )
        if (
            predicted is not None
            and result.peak_bytes > PREDICTION_SLACK * predicted
            and self.cfg.enabled
            and self.cfg.memory_budget is not None
            # "auto" plans each graph for its own floor: memory beside the graphs changes no plan.
            and parse_budget(self.cfg.memory_budget, "memory_budget").kind != "auto"
            and self._outside_rounds < 1
        ):
            # Note: [Memory outside the graphs is measured and planned for]
            self._outside_excess_bytes.append(result.peak_bytes - predicted)
            if len(self._outside_excess_bytes) < OUTSIDE_CONFIRMING_STEPS:
                self._outside_confirming = True  # measure the next clean step too before planning on it
                log.info(
                    "measured step peak %s above the predicted %s; measuring another step before planning for it",
                    _fmt(result.peak_bytes),
                    _fmt(predicted),
                )
                return
            excess = min(self._outside_excess_bytes)
            self._outside_excess_bytes.clear()
            self._outside_confirming = False
            self._outside_bytes += excess
            self._outside_rounds += 1
            self._replan_wanted = True
            log.info(
                "the step holds %s outside teraio's graphs (%s measured, %s predicted): memory its graphs do not "
                "allocate, such as FSDP's all-gathered parameters or tensors the loop creates; planning again "
                "with it counted against the budget",
                _fmt(excess),
                _fmt(result.peak_bytes),
                _fmt(predicted),
            )
        elif self._outside_confirming:
            # The step before held more than this one: a one-off (a collective's transient buffer, a
            # late free), not memory every step holds.
            self._outside_confirming = False
            self._outside_excess_bytes.clear()
            log.info(
                "measured step peak %s within the predicted %s; an earlier step's excess was a one-off",
                _fmt(result.peak_bytes),
                _fmt(predicted),
            )
        else:
            _warn_unplanned_memory(result.peak_bytes, predicted, len(kind))

    def _finish_recorders(self) -> None:
        """Read this backend's measurements whose steps ended: a measured step's, and any graph's
        kernel-memory step's. Outside any backward only."""
        self._finish_measurement()
        for r in self.runners:
            r._finish_kernel_memory()

    def _kind_generation(self, kind: frozenset[int]) -> int:
        """Changes whenever a graph of ``kind`` is recompiled (a new plan): measurements are per plans."""
        return sum(r.compiles for r in self.runners if r.graph_id in kind)

    def _graph_memory(self, r: GraphRunner, ordinal: int = 0) -> Any:
        """A graph's peak and what its ``ordinal``-th call of a step holds between forward and backward,
        under its plan (or unplanned, from its profile; None when it was never profiled)."""
        from teraio.planner.budget_split import GraphMemory
        from teraio.planner.lifetimes import analyse

        if r.profile is None:
            return None
        plan = r.plan_for(ordinal)
        held = max(
            0, int(r.profile.meta.get("census_after_fwd_bytes", 0)) - (plan.moved_bytes if plan else 0)
        )
        if plan is not None and self.cfg.enabled and plan.decisions:
            return GraphMemory(plan.predicted_peak_bytes, held)
        if r._unplanned_peak_bytes is None:
            r._unplanned_peak_bytes = analyse(r.profile).baseline_peak_bytes
        return GraphMemory(r._unplanned_peak_bytes, held)

    def _predicted_peak(self, calls: list[tuple[Any, Any, int]]) -> int | None:
        """The composed prediction for a step with these calls (teraio.planner.budget_split), None when a graph of
        it has no profile to predict from."""
        from teraio.planner.budget_split import step_peak

        ordinals = invocation_ordinals(calls)
        nodes = [((g, ordinals.get(i, 0)), getattr(k, "value", k), i) for g, k, i in calls]
        memory = {n: self._graph_memory(*n) for n, _, _ in nodes}
        if any(m is None for m in memory.values()):
            return None
        return step_peak(nodes, memory)[0] + self._outside_bytes - self._kept_held_bytes()

    def _kept_held_bytes(self) -> int:
        """Note: [Two moments bound the kept states] in teraio.planner.kept_states."""
        return self.whole_step.kept_held_bytes if self.whole_step is not None else 0

    # ------------------------------------------------------------------------------------ planning
    def hardware_model(self) -> HardwareModel:
        """What plans assume of the storage: the ``hardware`` file, a quick calibration of the offload
        directory (``hardware="calibrate"``, made once, before the first plan), or the built-in model;
        with ``"calibrate"``, the price of moving tensors measured under the graphs' own compute once a
        probe has it (Note: [Pricing transfers under the model's own compute] in teraio.profiling.transfer_probe)."""
        if self._hardware is None:
            self._hardware = self._calibrate_hardware() if self.cfg.hardware == CALIBRATE else HardwareModel()
        hw = self._hardware
        if self.transfer_price is not None:
            hw = hw.with_overrides(
                "ssd",
                cpu_s_per_transfer=self.transfer_price.per_transfer_s,
                cpu_s_per_step_with_io=self.transfer_price.per_step_s,
                cpu_s_per_byte=self.transfer_price.per_byte_s,
            )
        if self._run is not None and hw != self._saved_hardware:
            self._run.save_hardware(hw.to_dict())  # what the plans were made with
            self._saved_hardware = hw
        tiers = set(self.cfg.tiers)
        info = rank_info()
        sharers = disk_sharers(self.cfg.offload_dirs, info) if info.distributed else 1
        if sharers > 1 and "ssd" in tiers:
            # Local ranks writing to the same disk share its bandwidth: each plans with its part of it.
            ssd = hw.tier("ssd")
            hw = hw.with_overrides(
                "ssd",
                write_bw_bytes_per_s=ssd.write_bw_bytes_per_s / sharers,
                read_bw_bytes_per_s=ssd.read_bw_bytes_per_s / sharers,
            )
            if not self._told_sharing:
                self._told_sharing = True
                log.info(
                    "%d local ranks share this rank's offload disk: each plans with 1/%d of its bandwidth",
                    sharers,
                    sharers,
                )
        if "host" in tiers and hw.tiers["host"].capacity_bytes == 0:
            hw = hw.with_overrides("host", capacity_bytes=None)
        if "ssd" not in tiers:
            hw = hw.with_overrides("ssd", capacity_bytes=0)
        return hw

    def _calibration_directory(self) -> str:
        from teraio.runtime import RuntimeConfig
        from teraio.runtime.space import make_base_dirs

        dirs = self.cfg.offload_dirs_for(rank_info()) or ()
        directory = RuntimeConfig(dirs=dirs, backend="posix").resolved().dirs[0]
        make_base_dirs(directory)
        return directory

    def wants_transfer_price(self) -> bool:
        """Whether a graph's calibration steps should price moving tensors under its own compute (Note:
        [Pricing transfers under the model's own compute] in teraio.profiling.transfer_probe): plans are made from a
        calibration of the offload directory, for a CPU that computes, and no probe has the price yet."""
        from teraio.profiling.disk_calibration import accelerator_computes

        return (
            self.cfg.enabled
            and self.cfg.memory_budget is not None
            and self.cfg.hardware == CALIBRATE
            and self.transfer_price is None
            and "ssd" in self.cfg.tiers
            and not self.plans_from_file
            and not accelerator_computes()
        )

    def probe_engine_id(self) -> int:
        """The engine transfer probes use (posix, on the directory being calibrated), while any runs."""
        if self._probe_engine is None:
            from teraio.graph.ops import register_engine
            from teraio.runtime import Engine, RuntimeConfig

            self._probe_engine = Engine(
                RuntimeConfig(
                    dirs=[self._calibration_directory()], backend="posix", checksum=self.cfg.checksum
                )
            )
            self._probe_engine_id = register_engine(self._probe_engine)
            # One round trip before any is timed: the first makes the engine's file and wakes its threads.
            page = torch.zeros(1024)
            self._probe_engine.offload("probe-warm-up", page).wait()
            self._probe_engine.release("probe-warm-up")
            del page
            self._probe_engine.prefetch("probe-warm-up").wait()
            self._probe_engine.fetch("probe-warm-up")
            self._probe_engine.drop("probe-warm-up")
        assert self._probe_engine_id is not None
        return self._probe_engine_id

    def _collect_probes(self) -> None:
        """Take the price of moving tensors from the graphs whose probes have finished (the first time
        one has), close those probes, and the probes' engine once none is running."""
        probes = [
            (r, r.profiler.probe)
            for r in self.runners
            if r.profiler is not None and r.profiler.probe is not None
        ]
        done = [(r, p) for r, p in probes if not p.closed and p.complete()]
        if done:
            measured = self._probed_price(done)
            if measured is not None and self.transfer_price is None:
                self.transfer_price, how = measured
                log.info(
                    "priced moving tensors under the model's own compute: %.0f us per transfer, %.0f us "
                    "per step that moves any and %.3f ns per byte (%s)",
                    self.transfer_price.per_transfer_s * 1e6,
                    self.transfer_price.per_step_s * 1e6,
                    self.transfer_price.per_byte_s * 1e9,
                    how,
                )
            for _, p in done:
                p.close()
        if not any(not p.closed for _, p in probes):
            self._close_probe_engine()

    def _close_probes(self) -> None:
        for r in self.runners:
            if r.profiler is not None and r.profiler.probe is not None:
                r.profiler.probe.close()
        self._close_probe_engine()

    def _close_probe_engine(self) -> None:
        if self._probe_engine is not None:
            from teraio.graph.ops import unregister_engine

            self._probe_engine.close()
            unregister_engine(self._probe_engine_id)
            self._probe_engine, self._probe_engine_id = None, None

    def _probed_price(
        self, done: list[tuple[GraphRunner, TransferProbe]]
    ) -> tuple[TransferPrice, str] | None:
        """The price measured by finished probes (the median over graphs), and how; each recorded in
        ``transfer_probes``."""
        priced: list[tuple[TransferPrice, str]] = []
        for r, p in done:
            price = p.estimate()
            diffs = p.differences_s()
            self.transfer_probes.append(
                {
                    "graph": r.graph_id,
                    # Per variant: round trips per step and the bytes of each page.
                    "round_trips": [v.round_trips for v in p.variants],
                    "page_bytes": [v.page_nbytes for v in p.variants],
                    "differences_s": {p.variants[v - 1].label: d for v, d in sorted(diffs.items())},
                    "per_transfer_s": price.per_transfer_s if price else None,
                    "per_step_s": price.per_step_s if price else None,
                    "per_byte_s": price.per_byte_s if price else None,
                }
            )
            shown = "; ".join(f"{p.variants[v - 1].label}: {_ms(d)}" for v, d in sorted(diffs.items()))
            if price is None:
                log.info(
                    "%s: the probe's round trips did not show above the step's noise (probed minus plain, "
                    "%s); pricing transfers from the calibration's blocks instead",
                    r.name,
                    shown,
                )
            else:
                priced.append((price, f"{r.name}, probed minus plain: {shown}"))
        if not priced:
            return None
        price = TransferPrice(
            statistics.median(p.per_transfer_s for p, _ in priced),
            statistics.median(p.per_step_s for p, _ in priced),
            statistics.median(p.per_byte_s for p, _ in priced),
        )
        return price, " | ".join(how for _, how in priced)

    def _calibrate_hardware(self) -> HardwareModel:
        """Time the runtime engine on the directory offloads will go to (teraio.profiling.disk_calibration, small sizes)."""
        if "ssd" not in self.cfg.tiers:
            return HardwareModel()
        from teraio.profiling.disk_calibration import QUICK_NBYTES, calibrate

        directory = self._calibration_directory()
        t0 = time.perf_counter()
        cal = calibrate(directory, nbytes=QUICK_NBYTES, checksum=bool(self.cfg.checksum))
        log.info(
            "calibrated %s in %.1f s: write %.2f GB/s, read %.2f GB/s, %.0f/%.0f us per request, "
            "%.0f us of compute per transfer%s",
            directory,
            time.perf_counter() - t0,
            cal.write_bw_bytes_per_s / 1e9,
            cal.read_bw_bytes_per_s / 1e9,
            cal.write_latency_s * 1e6,
            cal.read_latency_s * 1e6,
            cal.cpu_s_per_transfer * 1e6,
            " (blocks of synthetic ops; the graph's own price replaces it)" if self.transfer_price else "",
        )
        for w in cal.warnings:
            log.warning("calibration: %s", w)
        return cal.hardware_model()

    def engine_id_for(self, plan: Plan) -> int:
        """The runtime engine the graphs' ops call; started (and space reserved) on first use."""
        if self.engine is None:
            from teraio.graph.ops import register_engine
            from teraio.runtime import Engine, RuntimeConfig

            # None: TERAIO_OFFLOAD_DIRS, else the runtime's per-user directory, where a killed run's
            # leftovers are found and removed by the next start.
            dirs = self.cfg.offload_dirs_for(rank_info()) or ()
            io_backend = self.cfg.io_backend
            if set(self.cfg.tiers) == {"host"}:
                io_backend = "host"
            reserve = sum(
                p.moved_bytes for r in self.runners for p in (r.plans.values() or [r.plan]) if p is not None
            )
            # One subdirectory per process and rank (DDP, torchrun): the runtime names them by both.
            rank = rank_info().rank
            self.engine = Engine(
                RuntimeConfig(
                    dirs=dirs,
                    backend=io_backend,
                    reserve_bytes=_round_up(reserve, 1 << 20),
                    checksum=self.cfg.checksum,
                    **{"rank": rank, **self.cfg.runtime_options},
                )
            )
            self._engine_id = register_engine(self.engine)
        return self._engine_id

    def close(self, restore_states: bool = True) -> None:
        """Stop the engine and remove its files (also done at interpreter exit). With ``states="offload"``,
        ``restore_states`` says whether the optimizer's offloaded states (and gradients) come back into
        memory first or are dropped (teraio.states.offload.StateOffload.close)."""
        if getattr(self, "states", None) is not None:  # first: it may refuse, before anything is closed
            self.states.close(restore=restore_states)
        self._close_probes()
        for r in self.runners:  # a kernel-memory step that ended and was never read, or never ended
            if r.profiler is not None:
                r.profiler.abandon_kernel_memory()
        if self._recorder is not None:
            with contextlib.suppress(Exception):
                self._recorder.stop()
            self._recorder = None
        self._measure = MeasureState.DONE
        process.unregister(self)
        if self.engine is not None:
            from teraio.graph.ops import unregister_engine

            self.engine.close()
            unregister_engine(self._engine_id)
            self.engine = None

    # ------------------------------------------------------------------------------------- results
    @property
    def profiles(self) -> list[Profile]:
        """The profiles of every graph that finished profiling."""
        for r in self.runners:
            if r.phase is Phase.PLANNING and r.profiler is not None:
                r._finish_profiling()
        return [r.profile for r in self.runners if r.profile is not None]

    def _save_profile(self, runner: GraphRunner) -> None:
        if self._run is not None and runner.profile is not None:
            self._run.save_profile(runner.graph_id, runner.profile)

    def _save_plan(self, runner: GraphRunner) -> None:
        if self._run is None or runner.plan is None or self._run.error is not None:
            return  # (no simulation for a trace that would not be written)
        self._run.save_plan(runner.graph_id, runner.plan.to_json(), trace_of(runner.profile, runner.plan))
        # Note: [A graph called several times per step is planned per call]: each later call's own plan,
        # also over the files of an earlier plan with more calls (they then show the plan calls run now).
        calls = max(len(runner.plans), runner.saved_call_plans)
        for j in range(1, calls):
            p = runner.plan_for(j)
            assert p is not None
            self._run.save_plan(runner.graph_id, p.to_json(), trace_of(runner.profile, p), call=j)
        runner.saved_call_plans = calls

    def _append_stats(self, step: StepRecord) -> None:
        # In a backward hook: a failure is warned once, never raised (Note: [Run-directory files are
        # by-products] in teraio.lifecycle.run_dir).
        if self._run is not None:
            io = self._io_stats()
            self._run.append_stats(
                {
                    "step": step.index,
                    "step_s": self.step_times_s[-1],
                    **io,
                    **io_bytes_by_kind(io, self.states),
                    # Note: [The whole-step budget keeps some states in memory] in teraio.states.residency
                    **({"whole_step": self.whole_step.stats()} if self.whole_step is not None else {}),
                }
            )

    @property
    def run_dir_error(self) -> RunDirError | None:
        """The write into ``run_dir`` that failed, after which the run went on without it (None: none)."""
        return self._run.error if self._run is not None else None

    def _io_stats(self) -> dict[str, Any]:
        if self.engine is None:
            return {"offloaded_bytes": 0, "prefetched_bytes": 0, "stall_s": 0.0}
        st = self.engine.stats()
        written = sum(v.nbytes for k, v in st.transfers.items() if k.endswith(".write"))
        read = sum(v.nbytes for k, v in st.transfers.items() if k.endswith(".read"))
        return {
            "offloaded_bytes": written,
            "prefetched_bytes": read,
            "stall_s": st.stall_s,
            "io_backend": st.backend,
            "io_path": st.io_path,
        }

    def stats(self) -> dict[str, Any]:
        """What the backend did, for the model it trained last, per model, and per graph.

        Note: [Models of one backend] in teraio.lifecycle.step_stats. The top-level figures describe the model of
        the latest complete step (``model`` indexes ``models``): ``running_steps`` and ``step_s`` (the
        median wall time of its steps that ran every graph's final compilation), its latest measured
        peak and the prediction for that same step, the bytes it moves per step. ``steps`` counts every
        complete training step of the backend (a step runs every forward in flight to its backward or its
        end), and the I/O figures are the backend's totals since the start. ``models`` has the same
        figures for each model the backend compiled.
        """
        self.tracker.settle()
        self._finish_measurement()
        self._read_step_times(wait=True)
        models = self.step_stats.models(self._parameter_links())
        summaries = [
            {"model": i, **self.step_stats.summary(m, self._moved_bytes_of)} for i, m in enumerate(models)
        ]
        last = self.step_stats.last_kind
        current = next((x for x, m in zip(summaries, models) if last is not None and last <= m), None)
        graphs = [
            {
                "graph": r.graph_id,
                "phase": r.phase.value,
                "invocations": r.invocations,
                "moved_bytes_per_invocation": r.plan.moved_bytes if r.plan else 0,
                # Note: [A graph called several times per step is planned per call]: per call of a step,
                # when its calls have plans of their own (the first is ``moved_bytes_per_invocation``).
                "moved_bytes_by_call": [p.moved_bytes for _, p in sorted(r.plans.items())],
                "predicted_peak_bytes": r.plan.predicted_peak_bytes if r.plan else None,
                "predicted_step_s": r.plan.predicted_step_s if r.plan else None,
                "profiled_s": r.profile.meta.get("step_s") if r.profile is not None else None,
                "memory_from": r.profile.meta.get("memory_from") if r.profile is not None else None,
                # Forwards from lines of the loop whose outputs are never backpropagated, run without the
                # plan (Note: [Forwards never backpropagated move nothing] in teraio.lifecycle.discarded_forwards).
                "unplanned_calls": r.unplanned_calls,
            }
            for r in self.runners
        ]
        if current is not None:
            kind = max(
                (k for k in self.step_stats.kinds if k <= models[current["model"]]),
                key=lambda k: self.step_stats.kinds[k].steps,
            )
            calls = self.step_stats.kinds[kind].last_calls
            top = {k: v for k, v in current.items() if k not in ("graphs", "steps")}
            if top["predicted_peak_bytes"] is None:  # not measured yet: the prediction for its latest step
                top["predicted_peak_bytes"] = self._predicted_peak(calls)
        else:
            calls = []
            top = {
                "model": None,
                "running_steps": 0,
                "step_s": None,
                "measured_peak_bytes": None,
                "predicted_peak_bytes": self.predicted_step_peak_bytes,
                "measured_step": None,
                "measure_note": None,
                "moved_bytes_per_step": 0,
            }
        planned = self._forward_plans(calls)
        io = self._io_stats()
        return {
            "steps": self.tracker.completed_steps,
            "graphs": len(self.runners),
            **top,
            "predicted_step_s": sum(p.predicted_step_s for p in planned) if planned else None,
            "phase": [r.phase.value for r in self.runners],
            "models": summaries,
            "per_graph": graphs,
            **io,
            **io_bytes_by_kind(io, self.states),
            # Note: [The whole-step budget keeps some states in memory] in teraio.states.residency
            "whole_step": self.whole_step.stats() if self.whole_step is not None else None,
        }

    def _parameter_links(self) -> list[frozenset[int]]:
        """Graphs that compute with the same parameters (one model's shapes, a graph Dynamo recompiled)."""
        by_param: dict[int, set[int]] = {}
        for r in self.runners:
            for p in r.parameter_ids:
                by_param.setdefault(p, set()).add(r.graph_id)
        return [frozenset(g) for g in by_param.values() if len(g) > 1]

    def _moved_bytes_of(self, calls: list[tuple[Any, Any, int]]) -> int:
        """Bytes a step with these calls moves: each forward's plan, when the backend runs plans."""
        if not self.cfg.enabled:
            return 0
        return sum(p.moved_bytes for p in self._forward_plans(calls))

    @staticmethod
    def _forward_plans(calls: list[tuple[Any, Any, int]]) -> list[Plan]:
        """The plan each forward of a step with these calls runs (its graph's plan for that call)."""
        ordinals = invocation_ordinals(calls)
        plans = (g.plan_for(ordinals.get(i, 0)) for g, k, i in calls if getattr(k, "value", k) == "fwd")
        return [p for p in plans if p is not None]


_CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")


def check_compile_mode(mode: str | None, options: dict[str, Any] | None, inner: str) -> dict[str, Any]:
    """The Inductor options to compile with: ``mode``'s (``teraio.graph.compilers.mode_options``) under the
    explicit ``options``. Refuses CUDA graphs (one line, what to do instead).

    A CUDA graph replays recorded kernels without running Python: teraio's migration ops are host-side
    I/O calls, so a replay would skip every offload and prefetch and compute on stale buffers.

    Raises:
        UserInputError: ``mode`` or ``options`` ask for CUDA graphs, Inductor's config has them on, or
            ``mode`` is not one of torch.compile's.
    """
    from teraio.graph.compilers import mode_options

    options = dict(options or {})
    asked = (
        mode in _CUDAGRAPH_MODES
        or bool(options.get("triton.cudagraphs"))
        or (inner == "inductor" and bool(torch._inductor.config.triton.cudagraphs))
    )
    if asked:
        what = f"mode={mode!r}" if mode in _CUDAGRAPH_MODES else "Inductor's triton.cudagraphs option"
        raise UserInputError(
            f"teraio cannot run under CUDA graphs ({what}): a graph replay skips teraio's host-side I/O; "
            "use torch.compile's default mode (or mode='max-autotune-no-cudagraphs') with the teraio backend"
        )
    try:
        from_mode = mode_options(mode)
    except RuntimeError as exc:
        raise UserInputError(f"torch.compile mode={mode!r}: {exc}") from None
    return {**from_mode, **options}


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def write_trace(profile: Profile, plan: Plan, path: Path) -> None:
    """The plan's predicted step as a Chrome trace (chrome://tracing, Perfetto) in ``path``."""
    from teraio.planner.safe_io import write_json

    write_json(path, trace_of(profile, plan), overwrite=True, indent=None)


def trace_of(profile: Profile, plan: Plan) -> dict[str, Any]:
    """The plan's predicted step as a Chrome trace (chrome://tracing, Perfetto): ops and transfers."""
    from teraio.planner.simulate import simulate

    sim = simulate(profile, plan)
    events: list[dict[str, Any]] = []
    for i, (name, start_s, end_s) in enumerate(zip(profile.ops["name"], sim.op_start_s, sim.op_end_s)):
        phase = "fwd" if i < profile.num_fwd_ops else "bwd"
        events.append(
            {
                "name": name,
                "cat": phase,
                "ph": "X",
                "pid": 0,
                "tid": "compute",
                "ts": float(start_s) * 1e6,
                "dur": float(end_s - start_s) * 1e6,
                "args": {"idx": i},
            }
        )
    for r in sim.io_timeline.itertuples():
        events.append(
            {
                "name": f"{r.direction} {r.name}",
                "cat": str(r.tier),
                "ph": "X",
                "pid": 0,
                "tid": f"{r.tier} {r.direction}",
                "ts": float(r.start_s) * 1e6,
                "dur": float(r.end_s - r.start_s) * 1e6,
                "args": {"nbytes": int(r.nbytes)},
            }
        )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"predicted_step_s": sim.step_s, "peak_bytes": sim.peak_bytes},
    }


def load_plans(path: str) -> list[Plan]:
    """A plan file, or a run directory holding graph*/plan.json (one plan per captured graph)."""
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("graph*/plan.json")) or sorted(p.glob("*.json"))
        if not files:
            from teraio.planner.plan import PlanError

            raise PlanError(f"plan directory '{p}' holds no graph*/plan.json")
        return [Plan.load(f) for f in files]
    return [Plan.load(p)]


def backend(**options: Any) -> TeraioBackend:
    """A configured teraio backend for ``torch.compile(model, backend=teraio.backend(...))``."""
    return TeraioBackend(**options)


_default: TeraioBackend | None = None


def default_backend() -> TeraioBackend:
    """The backend used by ``torch.compile(model, backend="teraio")`` (default options)."""
    global _default
    if _default is None:
        _default = TeraioBackend()
    return _default


def teraio_backend(gm: fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Callable[..., Any]:
    """Entry point registered as torch_dynamo_backends 'teraio'."""
    return default_backend()(gm, example_inputs, **kwargs)


__all__ = [
    "BackendConfig",
    "GraphRunner",
    "Phase",
    "ShapeDispatch",
    "TeraioBackend",
    "backend",
    "default_backend",
    "teraio_backend",
]
