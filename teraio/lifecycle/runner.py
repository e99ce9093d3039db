"""One captured graph at one set of input shapes, from its first call to its final compilation.

torch.compile hands the backend each graph it captures; the backend gives each a :class:`GraphRunner`,
which Dynamo then calls at every forward. The runner is profiled (its profiling half:
:mod:`teraio.lifecycle.runner_profiling`), waits for the step's plan (``PLANNING``), is recompiled with
the plan's migration ops (``RUNNING``), or runs as it is when nothing backpropagates through it
(``INFERENCE``); phases move in one place, the backend's ``advance``, always at a forward call.

A runner talks to its backend through :class:`RunnerHost`, a small set of public methods and attributes.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor

from teraio.errors import UserInputError
from teraio.graph.capture import CapturedStep, analyse_saved
from teraio.graph.compilers import RetainedTraining, compile_graph
from teraio.graph.kernel_boundaries import Segmentation, coarsen, granularity_for
from teraio.graph.recompute import recipes
from teraio.graph.rewrite import RewriteResult, apply_plan, check_plan
from teraio.lifecycle.discarded_forwards import SiteMemory, call_site
from teraio.lifecycle.partitioner_search import profile_steps
from teraio.lifecycle.phases import Phase
from teraio.lifecycle.runner_profiling import RunnerProfiling
from teraio.lifecycle.shapes import frame_of, placeholder_sources, shape_key
from teraio.lifecycle.steps import Invocation, InvocationEnd, backward_node
from teraio.planner.plan import Plan
from teraio.planner.profile import Profile
from teraio.profiling import forward_count
from teraio.profiling.op_timing import StepProfiler, classify_inputs, profiling_split
from teraio.sizes import format_size
from teraio.states.guarded import unguarded

if TYPE_CHECKING:
    from teraio.config import BackendConfig
    from teraio.lifecycle.outside_time import OutsideTimer
    from teraio.lifecycle.steps import StepTracker
    from teraio.states.offload import StateOffload

log = logging.getLogger("teraio")


class RunnerHost(Protocol):
    """What a runner asks of its backend (teraio.lifecycle.backend.TeraioBackend)."""

    cfg: BackendConfig
    inductor_options: dict[str, Any]  # torch.compile's mode and options, for inner="inductor"
    plans_from_file: list[Plan]
    tracker: StepTracker
    outside: OutsideTimer
    states: StateOffload | None

    def advance(self, runner: GraphRunner) -> None:
        """Move phases at a forward call (outside any backward)."""

    def note_forward(self) -> None:
        """One more training or inference forward of this backend."""

    def maybe_start_measurement(self) -> None:
        """A training forward is about to run: time its step, and measure it when one is wanted."""

    def save_profile(self, runner: GraphRunner) -> None:
        """Record a finished profile (run_dir)."""

    def engine_id_for(self, plan: Plan) -> int:
        """The runtime engine the plan's ops call."""

    def wants_transfer_price(self) -> bool:
        """Whether calibration steps should price transfers under the graph's own compute."""

    def probe_engine_id(self) -> int:
        """The engine transfer probes use."""

    def measuring_kernel_memory(self) -> bool:
        """Whether one of its graphs measures its kernels' memory now (its forward ran, its backward not yet)."""


def _device_of(example_inputs: list[Any]) -> str:
    """The device a graph computes on: its first non-CPU tensor input's (a leading CPU index or scalar
    tensor does not make a CUDA graph "cpu"), else the first tensor's, else "cpu"."""
    devices = [a.device for a in example_inputs if isinstance(a, torch.Tensor)]
    return str(next((d for d in devices if d.type != "cpu"), devices[0] if devices else "cpu"))


def step_device(runners: list[GraphRunner]) -> str:
    """The device a step of these graphs computes on (their inputs'): step times and the peak recorder."""
    return _device_of([p for r in runners for p in r.example_inputs])


def describe_plan(plan: Plan) -> str:
    """What a plan does per step, in words: "offloads 12 tensors (1.2 MiB), recomputes 3 (96 KiB, 4 ms)"."""
    offloaded = len(plan.decisions) - len(plan.recomputes)
    parts = []
    if offloaded or not plan.recomputes:
        parts.append(f"offloads {offloaded} tensors ({format_size(plan.moved_bytes)})")
    if plan.recomputes:
        parts.append(
            f"recomputes {len(plan.recomputes)} ({format_size(plan.recomputed_bytes)}, "
            f"{plan.recompute_s * 1e3:.1f} ms)"
        )
    return ", ".join(parts) + " per step"


@dataclass
class Compilation:
    """What a running graph runs, with the profile and plans it was compiled from: kept per finalist by
    the partitioner search's run-off (Note: [The search's finalists are timed against each other] in
    teraio.lifecycle.partitioner_runoff) and put back without compiling again."""

    partitioner_budget: float | None
    profile: Profile | None
    plan: Plan | None
    plans: dict[int, Plan]
    step_budget_bytes: int | None
    computation_fingerprint: str | None
    compiled: Callable[..., Any]
    compiled_for: dict[int, Callable[..., Any]]
    rewrite: RewriteResult | None
    plain: Callable[..., Any] | None


class GraphRunner:
    """The lifecycle of one captured graph at one set of input shapes (see the module docstring)."""

    def __init__(
        self,
        backend: RunnerHost,
        graph_id: int,
        gm: fx.GraphModule,
        example_inputs: list[Any],
        partitioner_budget: float | None = None,
    ) -> None:
        self.backend = backend
        self.cfg = backend.cfg
        self.graph_id = graph_id
        self.gm = gm
        self.example_inputs = example_inputs
        self.profiler: StepProfiler | None = None
        self.profile: Profile | None = None
        self.plan: Plan | None = None
        # Note: [A graph called several times per step is planned per call] in teraio.lifecycle.step_planner:
        # the plan of each call of a step (by its ordinal), when they differ; ``plan`` is the first call's,
        # and serves calls beyond.
        self.plans: dict[int, Plan] = {}
        self.plan_before_outside: Plan | None = None
        self.plans_before_outside: dict[int, Plan] = {}
        self._compiled_for: dict[int, Callable[..., Any]] = {}  # ordinal -> compilation with its plan
        self.saved_call_plans = 0  # run_dir: plan_call<j>.json written for j < this
        self.rewrite: RewriteResult | None = None
        self.invocations = 0
        self.abandoned_forwards = 0  # forwards whose autograd graph was freed without a backward
        self.step_budget_bytes: int | None = None  # the step budget this graph was planned under
        #: Raised at the next call: an error found where raising would not reach the user (a hook).
        self.pending_error: Exception | None = None
        self._call_params: frozenset[int] | None = None  # inputs of the first call that are parameters
        # Note: [A graph Dynamo replaced keeps its shape] in teraio.lifecycle.shapes: which Dynamo frame the
        # graph was traced from, its inputs' sources, the shapes it was compiled for, and what it computes.
        self.frame = frame_of(gm)
        self.sources = placeholder_sources(gm)
        self.signature = shape_key(example_inputs)
        self.computation_fingerprint: str | None = None
        self.compiles = 1  # compilations so far (a new plan is a new compilation)
        #: The parameters' storages the graph computes with (which model it belongs to:
        #: teraio.lifecycle.step_stats).
        self.parameter_ids: frozenset[int] = frozenset()
        # Note: [Forwards never backpropagated move nothing] in teraio.lifecycle.discarded_forwards
        self.sites = SiteMemory()
        self._plain: Callable[..., Any] | None = None
        self._plain_partition: float | None = None  # the partitioner budget _plain was compiled at
        self.unplanned_calls = 0
        # The unplanned peak and the profile it was computed from (a graph profiled again has another).
        self._unplanned_peak: tuple[Profile, int] | None = None
        self.training = False  # set by the partitioner's hook: the graph has a backward
        #: The min-cut partitioner's activation_memory_budget this graph is partitioned at (None: the
        #: process's setting; the backend passes ``Solver.partitioner_budget`` or the search's ratio).
        #: Note: [The partitioner's budget is part of the plan] in teraio.lifecycle.partitioner_search.
        self.partitioner_budget: float | None = partitioner_budget
        self.phase = Phase.PROFILING
        self.profiling = RunnerProfiling(self, _device_of(example_inputs))
        #: The profiling compile's graphs and code, for the plan (Note: [One trace per graph on the FX
        #: path] in teraio.graph.compilers).
        self._retained: RetainedTraining | None = None
        self._compiled = self._compile_for_profiling()
        if not self.training:
            self.phase = Phase.INFERENCE

    def _compile_for_profiling(self) -> Callable[..., Any]:
        self._retained = RetainedTraining(partitioned_at=self.partitioner_budget)
        return compile_graph(
            self.gm,
            self.example_inputs,
            self.cfg.inner,
            self.profiling.on_partition,
            identity="profiling",
            graph_compiler=self.profiling.compiler,
            inductor_options=self.backend.inductor_options,
            # Not with plans from a file: a graph they cover is never profiled (one that is not then
            # calibrates on the FX graph, and its profile says so in ``calibrated_on``). On Inductor the
            # kernels also give the memory timeline: Note: [The budget is of the graph that runs] in
            # teraio.graph.kernel_memory.
            calibration_kernels=(
                profiling_split(profile_steps(self.cfg))[1] > 0 or self.cfg.inner == "inductor"
            )
            and not self.backend.plans_from_file,
            partitioner_budget=self.partitioner_budget,
            retain=self._retained,
        )

    def profile_at(self, partitioner_budget: float) -> None:
        """Profile the graph again from its first step, partitioned at ``partitioner_budget`` (Note: [The
        partitioner's budget is part of the plan] in teraio.lifecycle.partitioner_search). Outside any
        backward; the previous profile and plans are the caller's to keep."""
        if self.profiler is not None:
            self.profiler.abandon_kernel_memory()  # never leave a profiler session running unowned
        self.partitioner_budget = partitioner_budget
        self.profiler, self.profile, self.plan, self.plans = None, None, None, {}
        self.step_budget_bytes = None
        self.profiling = RunnerProfiling(self, _device_of(self.example_inputs))
        self.phase = Phase.PROFILING
        with unguarded(self.example_inputs):  # Note in teraio.states.guarded.unguarded
            self._compiled = self._compile_for_profiling()
        self.compiles += 1

    @property
    def name(self) -> str:
        return f"graph {self.graph_id}"

    @property
    def is_training(self) -> bool:
        return self.training

    @property
    def param_calls(self) -> set[tuple[int, ...]]:
        """The offloaded parameters of each call while profiling (Note: [Fetched parameters are the graph's
        memory] in teraio.states.residency)."""
        return self.profiling.param_calls

    def plan_for(self, ordinal: int) -> Plan | None:
        """The plan of this graph's ``ordinal``-th call in a step (Note: [A graph called several times per
        step is planned per call] in teraio.lifecycle.step_planner)."""
        return self.plans.get(ordinal, self.plan)

    def finish_profiling(self) -> None:
        """Build the profile from what profiling recorded (outside any backward)."""
        self.profiling.finish()

    def finish_kernel_memory(self) -> None:
        """Read a kernel-memory step that ended (outside any backward)."""
        self.profiling.finish_kernel_memory()

    def unplanned_peak_bytes(self) -> int:
        """The graph's peak without a plan, from its profile (computed once)."""
        from teraio.planner.lifetimes import analyse

        assert self.profile is not None
        if self._unplanned_peak is None or self._unplanned_peak[0] is not self.profile:
            self._unplanned_peak = (self.profile, analyse(self.profile).baseline_peak_bytes)
        return self._unplanned_peak[1]

    # ----------------------------------------------------------------------------------- compiling
    def param_positions(self) -> frozenset[int]:
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
        plan_by_identity: dict[str, Plan | None] = {}
        identity_of: dict[int, str] = {}
        for ordinal, p in sorted(by_ordinal.items()):
            plan = p if self.cfg.enabled and p is not None and p.decisions else None
            identity = "final:" + (hashlib.sha256(plan.to_json().encode()).hexdigest() if plan else "no-plan")
            plan_by_identity[identity], identity_of[ordinal] = plan, identity
        retained, self._retained = self._retained, None
        if self._plain is not None and self._plain_partition != self.partitioner_budget:
            # Compiled at another partition (the search's trial switched it): it saves other tensors.
            self._plain = None
        if (
            len(plan_by_identity) == 1
            and retained is not None
            # The partitioner search may choose a ratio it profiled before the last one.
            and retained.partitioned_at == self.partitioner_budget
            # A forward that ran the profiling code saved what that code saves: its backward must too.
            and self.backend.tracker.in_flight_of(self) == 0
        ):
            ((identity, plan),) = plan_by_identity.items()
            if retained.ready:  # Note: [One trace per graph on the FX path] in teraio.graph.compilers
                retained.apply(self._on_partition_with(plan))
                compiled[identity] = self._compiled
            elif plan is None and retained.kernels_ready:
                # Note: [A graph that runs without a plan keeps its calibration kernels] (same module)
                retained.run_kernels()
                compiled[identity] = self._compiled
        for ordinal, identity in identity_of.items():
            if identity not in compiled:
                compiled[identity] = self._compile_with(plan_by_identity[identity], identity)
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

    def compilation(self) -> Compilation:
        """The running compilation, to be put back later with :meth:`use_compilation`."""
        assert self.phase is Phase.RUNNING, f"{self.name} is not running ({self.phase})"
        return Compilation(
            partitioner_budget=self.partitioner_budget,
            profile=self.profile,
            plan=self.plan,
            plans=dict(self.plans),
            step_budget_bytes=self.step_budget_bytes,
            computation_fingerprint=self.computation_fingerprint,
            compiled=self._compiled,
            compiled_for=dict(self._compiled_for),
            rewrite=self.rewrite,
            plain=self._plain,
        )

    def use_compilation(self, c: Compilation) -> None:
        """Run ``c`` from the next forward on (between steps: a forward waiting for its backward keeps the
        compilation it ran with). A new generation of plans for the step's measurements."""
        self.partitioner_budget, self.profile = c.partitioner_budget, c.profile
        self.plan, self.plans, self.step_budget_bytes = c.plan, dict(c.plans), c.step_budget_bytes
        self.computation_fingerprint = c.computation_fingerprint
        self._compiled, self._compiled_for = c.compiled, dict(c.compiled_for)
        self.rewrite, self._plain, self._plain_partition = c.rewrite, c.plain, c.partitioner_budget
        self.phase = Phase.RUNNING
        self.compiles += 1

    def _compile_with(self, plan: Plan | None, identity: str) -> Callable[..., Any]:
        """The graph compiled with ``plan``'s migration ops (None: without any)."""
        with unguarded(self.example_inputs):  # Note in teraio.states.guarded.unguarded
            return compile_graph(
                self.gm,
                self.example_inputs,
                self.cfg.inner,
                self._on_partition_with(plan),
                identity=identity,
                inductor_options=self.backend.inductor_options,
                partitioner_budget=self.partitioner_budget,
            )

    def _on_partition_with(self, plan: Plan | None) -> Callable[[CapturedStep], CapturedStep | None]:
        """The partitioner's hook that writes ``plan``'s migration ops into the graphs (None: nothing)."""

        def on_partition(step: CapturedStep) -> CapturedStep | None:
            if plan is None:
                return None
            analysis = analyse_saved(step)
            # Note: [Migration ops sit between kernels] in teraio.graph.kernel_boundaries
            segmentation = Segmentation.of(analysis, granularity_for(self.cfg.inner))
            rebuild = recipes(step, analysis, self.param_positions()) if plan.recomputes else None
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

        return on_partition

    def _without_plan(self) -> Callable[..., Any]:
        """The graph compiled without migration ops, for calls whose outputs are never backpropagated
        (compiled once, when first needed)."""
        if self._plain is None:
            log.info(
                "%s: forwards from one line of the loop are never backpropagated; they run without "
                "migration (their saved tensors are freed with their autograd graph)",
                self.name,
            )
            self._plain_partition = self.partitioner_budget
            with unguarded(self.example_inputs):  # Note in teraio.states.guarded.unguarded
                self._plain = compile_graph(
                    self.gm,
                    self.example_inputs,
                    self.cfg.inner,
                    lambda step: None,
                    identity="final:no-plan",
                    inductor_options=self.backend.inductor_options,
                    partitioner_budget=self.partitioner_budget,
                )
        return self._plain

    # ------------------------------------------------------------------------------------- calling
    def __call__(self, *args: Any) -> Any:
        if self.pending_error is not None:
            raise self.pending_error
        if any(isinstance(a, FakeTensor) for a in args):
            # Note: [DDP's fake first call] DDP's graph optimizer runs each compiled piece once on fake
            # tensors while it compiles, to learn its outputs' strides, and AOTAutograd answers that first
            # call with fake outputs without running the compiled graphs. It is not a step: nothing is
            # profiled or counted. Answered any other way, AOTAutograd's first *real* call returned fakes.
            return self._compiled(*args)
        forward_count.note_forward()
        self.backend.note_forward()
        if self._call_params is None:
            self._call_params = frozenset(
                i for i, kind in enumerate(classify_inputs(list(args))) if kind == "param"
            )
            self.parameter_ids = frozenset(args[i].untyped_storage().data_ptr() for i in self._call_params)
        resident = self._resident_params(args)  # Note: [When a parameter is resident] in teraio.states.params
        if resident and self.phase is Phase.PROFILING:
            self.profiling.param_calls.add(resident)
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
            self.profiling.before_forward()
        self.backend.advance(self)
        tracker = self.backend.tracker
        step = tracker.begin_forward(self)
        calibrating = (
            self.phase is Phase.PROFILING and self.profiler is not None and self.profiler.calibrate_next
        )
        self.backend.outside.forward_starts(step.index, not step.calls, calibrating)
        # Note: [Forwards never backpropagated move nothing] in teraio.lifecycle.discarded_forwards: such a
        # forward neither runs the plan nor starts a step measurement (which would hold the process's one
        # profiler session through the loop's code until the forward is found abandoned).
        site = call_site() if self.phase is Phase.RUNNING else None
        never_backpropagated = site is not None and self.sites.skip_plan(site)
        if not never_backpropagated:
            self.backend.maybe_start_measurement()
        compiled = self._compiled
        if (
            self._compiled_for
        ):  # Note: [A graph called several times per step is planned per call] (step_planner)
            ordinal = sum(1 for g, k, _ in step.calls if g is self and k == "fwd")
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
        if self.phase is Phase.PROFILING and inv is not None:
            self.profiling.forward_ended(inv)
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

    def invocation_ended(self, inv: Invocation) -> None:
        """One of this graph's forward invocations ended (its backward ran, or its autograd graph was
        freed). In a backward hook or a finalizer: only notes what happened (Note: [Forwards never
        backpropagated move nothing] in teraio.lifecycle.discarded_forwards)."""
        if inv.site is not None:
            self.sites.ended(inv.site, inv.end is InvocationEnd.ABANDONED)
        if inv.end is InvocationEnd.ABANDONED:
            self.abandoned_forwards += 1
        if (
            inv.end is InvocationEnd.BACKWARD
            and self.phase is Phase.PROFILING
            and self.pending_error is None
            and torch._dynamo.compiled_autograd.in_compiled_autograd_region
        ):
            # Note: [Compiled autograd runs its own copy of the backward] Compiled autograd traces the
            # partitioned backward graph into a graph of its own and runs that, never the backward teraio
            # compiled: the profiler, which runs inside that backward, never sees it, and profiling would
            # never end (a silent run without a plan). Plans survive it (they are written into the
            # partitioned graphs, which it copies), so only profiling must run without it.
            self.pending_error = UserInputError(
                f"{self.name}: compiled autograd ran its backward while teraio was profiling it, which teraio "
                "cannot time; run the training steps without compiled autograd until teraio logs 'running "
                f"{self.name}' (the first {profile_steps(self.cfg)} or a few more; plans survive compiled "
                "autograd after that), or pass plan= a plan made without it"
            )
