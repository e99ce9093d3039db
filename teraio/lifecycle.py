"""The ``teraio`` torch.compile backend: profile the first steps, plan, recompile with migration ops, run.

Every graph torch.compile hands the backend gets a :class:`GraphRunner` (a graph whose shapes change
gets one per shape, up to ``max_shapes``: :class:`ShapeDispatch`). A runner moves through phases, in one
place (:meth:`TeraioBackend._advance`), always at a forward call and never inside a backward:

- ``PROFILING``: its training forward and backward run through a timing interpreter
  (``teraio.profiler``) for ``profile_steps`` complete forward+backward pairs (the first is warm-up),
  and with ``hardware="calibrate"`` on a short CPU step, ``teraio.probe.PROBE_STEPS`` more that price
  moving tensors under the graph's own compute;
- ``PLANNING``: profiled; at the next forward the backend plans every profiled graph of the step
  together (one budget for the step: ``teraio.step_budget``) and recompiles them;
- ``RUNNING``: the compiled graphs carry the plan's ``teraio::`` migration ops (or none: no budget,
  ``enabled=False``, or a shape beyond ``max_shapes``);
- ``INFERENCE``: a graph without a backward (under ``no_grad``/``inference_mode``, or no input requires
  grad) is compiled as it is; it is never profiled, planned or measured.

Invocations in flight and step boundaries come from ``teraio.steps``; a switch of compilation never
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
from dataclasses import asdict
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from torch import fx

from teraio.capture import CapturedStep, analyse_saved
from teraio.clock import Clock
from teraio.compilers import compile_graph
from teraio.config import CALIBRATE, BackendConfig
from teraio.outside import OutsideTimer
from teraio.planner.hardware import HardwareModel
from teraio.planner.plan import Plan
from teraio.planner.profile import Profile
from teraio.probe import PROBE_STEPS, TransferPrice, TransferProbe, probe_variants, round_trips_for
from teraio.profiler import StepProfiler, classify_inputs, profiling_split
from teraio.recompute import recipes
from teraio.rewrite import PlanMismatchError, RewriteResult, apply_plan, check_plan
from teraio.run_dir import RunDir, RunDirError
from teraio.segments import Segmentation, coarsen, granularity_for, plan_fingerprint
from teraio.steps import InvocationEnd, StepRecord, StepTracker

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


def _is_dynamic(example_inputs: list[Any]) -> bool:
    for a in example_inputs:
        if isinstance(a, torch.SymInt):
            return True
        if isinstance(a, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in a.shape):
            return True
    return False


def _static_examples(args: tuple[Any, ...]) -> list[Any]:
    """Example inputs for compiling one concrete shape: fakes of the call's tensors (no data kept)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            f = mode.from_tensor(a, static_shapes=True)
            out.append(f)
        else:
            out.append(a)
    return out


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
        self.rewrite: RewriteResult | None = None
        self.invocations = 0
        self.step_budget_bytes: int | None = None  # the step budget this graph was planned under
        self._pending_error: Exception | None = None
        self._call_params: frozenset[int] | None = None  # inputs of the first call that are parameters
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
            # calibrates on the FX graph, and its profile says so in ``calibrated_on``).
            calibration_kernels=profiling_split(self.cfg.profile_steps)[1] > 0
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

    # ----------------------------------------------------------------------------------- compiling
    def _on_profiling_partition(self, step: CapturedStep) -> None:
        self._training = True
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
        if kernels is not None:  # Note: [Calibrating on the compiler's own code] in teraio.compilers
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
        teraio.profiler)."""
        prof = self.profiler
        assert prof is not None
        instrumented, calibration = profiling_split(self.cfg.profile_steps)
        return (
            prof.steps_recorded >= instrumented
            and prof.steps_calibrated >= calibration
            and (prof.probe.done() if prof.probe is not None else not self._may_probe())
        )

    def _may_probe(self) -> bool:
        """Whether this graph's calibration steps may go on to price a transfer (Note: [Pricing transfers
        under the model's own compute] in teraio.probe): the backend wants the price, the steps run the
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
        if self.profile is None and self.profiler.steps_recorded > 0:
            self.profile = self.profiler.build_profile({"inner": self.cfg.inner})
            self.backend._save_profile(self)

    def _param_positions(self) -> frozenset[int]:
        """Which forward inputs are parameters: as profiled, else as the first call passed them."""
        if self.profile is not None and "param_positions" in self.profile.meta:
            return frozenset(int(i) for i in self.profile.meta["param_positions"])
        return self._call_params or frozenset()

    def compile_final(self) -> None:
        """Recompile with the plan's migration ops (or none), for every later forward."""
        plan = self.plan if self.cfg.enabled and self.plan is not None and self.plan.decisions else None

        def on_partition(step: CapturedStep) -> CapturedStep | None:
            if plan is None:
                return None
            analysis = analyse_saved(step)
            # Note: [Migration ops sit between kernels] in teraio.segments
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

        identity = "final:" + (hashlib.sha256(plan.to_json().encode()).hexdigest() if plan else "no-plan")
        self._compiled = compile_graph(
            self.gm,
            self.example_inputs,
            self.cfg.inner,
            on_partition,
            identity=identity,
            inductor_options=self.backend.inductor_options,
        )
        self.phase = Phase.RUNNING
        self.profiler = None if self.profile is not None else self.profiler
        log.info("running %s with %s", self.name, describe_plan(plan) if plan else "no migration")

    # ------------------------------------------------------------------------------------- calling
    def __call__(self, *args: Any) -> Any:
        if self._pending_error is not None:
            raise self._pending_error
        if self._call_params is None:
            self._call_params = frozenset(
                i for i, kind in enumerate(classify_inputs(list(args))) if kind == "param"
            )
        if self.phase is Phase.INFERENCE or not torch.is_grad_enabled():
            return self._compiled(*args)
        if self.phase is Phase.PROFILING:
            self._before_profiled_forward()
        self.backend._advance(self)
        tracker = self.backend.tracker
        step = tracker.begin_forward(self)
        calibrating = (
            self.phase is Phase.PROFILING and self.profiler is not None and self.profiler.calibrate_next
        )
        self.backend.outside.forward_starts(step.index, not step.calls, calibrating)
        self.backend._maybe_start_measurement()
        out = self._compiled(*args)
        inv = tracker.end_forward(self, out)
        self.invocations += 1
        if self.phase is Phase.PROFILING and self.profiler is not None and inv is not None:
            self.profiler.bind_last_forward(inv.id, abandoned=inv.end is InvocationEnd.ABANDONED)
        return out

    def _before_profiled_forward(self) -> None:
        prof = self.profiler
        if prof is None:
            return
        instrumented, calibration = profiling_split(self.cfg.profile_steps)
        if prof.steps_recorded >= instrumented:
            if prof.steps_calibrated >= calibration and prof.probe is None and self._may_probe():
                self._start_probe()
            probing = prof.probe is not None and not prof.probe.done()
            # Probed and plain steps alternate, so drift falls on both kinds alike; the plain ones
            # calibrate the op times too.
            prof.probe_next = prof.probe.next_variant if probing else 0
            prof.calibrate_next = probing or prof.steps_calibrated < calibration
        if self.invocations >= 2 * self.cfg.profile_steps + 2 and prof.steps_recorded == 0:
            # Called with grad enabled again and again, never backpropagated (a validation loss in
            # train mode): profiling would never finish, and interpreting every call is slow.
            log.info(
                "%s: %d forwards and no backward; running it without a plan", self.name, self.invocations
            )
            prof.discard_pending()
            self.phase = Phase.PLANNING


#: How far a measured step peak may exceed the prediction before the user is told (the budget tests hold
#: measured peaks to 5% over the budget).
PREDICTION_SLACK = 1.05


def _warn_unplanned_memory(measured_bytes: int, predicted_bytes: int | None) -> None:
    """Say so when the step used clearly more memory than every graph's plan accounts for."""
    if predicted_bytes is None or measured_bytes <= PREDICTION_SLACK * predicted_bytes:
        return
    log.warning(
        "measured step peak %s is %.0f%% above the predicted %s: memory outside teraio's graphs, such as "
        "code torch.compile runs eagerly (a graph break it could not compile: TORCH_LOGS=graph_breaks "
        "shows them) or tensors the loop keeps between steps; the budget cannot cover what it cannot see",
        _fmt(measured_bytes),
        100 * (measured_bytes / predicted_bytes - 1),
        _fmt(predicted_bytes),
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


class ShapeDispatch:
    """A graph with dynamic shapes: one GraphRunner (profile, plan) per concrete shape, bounded.

    Plans are exact for the shapes they were made for (sizes, offsets, bytes moved), so each shape
    gets its own; after ``max_shapes`` shapes, further shapes run the captured graph as it is, without
    compiling or migration (logged once).
    """

    def __init__(self, backend: TeraioBackend, gm: fx.GraphModule, example_inputs: list[Any]) -> None:
        self.backend = backend
        self.gm = gm
        self.example_inputs = example_inputs
        self.by_shape: dict[tuple[Any, ...], GraphRunner] = {}
        self._warned = False
        self._lock = threading.Lock()

    @staticmethod
    def _key(args: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(
            (tuple(a.shape), tuple(a.stride()), a.dtype, str(a.device), a.requires_grad)
            if isinstance(a, torch.Tensor)
            else a
            for a in args
        )

    def __call__(self, *args: Any) -> Any:
        key = self._key(args)
        with self._lock:
            runner = self.by_shape.get(key)
            if runner is None:
                if len(self.by_shape) < self.backend.cfg.max_shapes:
                    runner = self.backend._new_runner(self.gm, _static_examples(args))
                    self.by_shape[key] = runner
                else:
                    if not self._warned:
                        self._warned = True
                        log.warning(
                            "a graph has seen more than max_shapes=%d shapes; further shapes run uncompiled "
                            "and without migration (raise max_shapes to plan them)",
                            self.backend.cfg.max_shapes,
                        )
                    return self.gm(*args)
        return runner(*args)


class TeraioBackend:
    """A configured backend: ``torch.compile(model, backend=teraio.backend(**options))``."""

    def __init__(self, **options: Any) -> None:
        _ensure_log_handler()
        self.cfg = BackendConfig(**options)
        self.runners: list[GraphRunner] = []
        self.engine: Any = None
        self._engine_id: int | None = None
        self.plans_from_file: list[Plan] = []
        self.inductor_options: dict[str, Any] = {}  # torch.compile's mode and options, for inner="inductor"
        self.tracker = StepTracker(on_step_end=self._on_step_end)
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
        # Note: [Pricing transfers under the model's own compute] in teraio.probe
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
        self.cfg.check_run_dir()  # before anything is written: never replace another program's files
        #: Made once per backend: in config.json and on every stats.jsonl line (runs may share a run_dir).
        self.run_id = secrets.token_hex(8)
        self.run_dir = Path(self.cfg.run_dir) if self.cfg.run_dir else None
        # Every write into run_dir goes through it: Note: [Run-directory files are by-products].
        self._run: RunDir | None = None
        if self.run_dir is not None:
            self._run = RunDir.open(self.run_dir, self.run_id)
            cfg = {k: v for k, v in asdict(self.cfg).items() if k != "runtime_options"}
            self._run.write_config(json.loads(json.dumps(cfg, default=str)))
        if self.cfg.plan is not None:
            self.plans_from_file = load_plans(self.cfg.plan)

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
        if _is_dynamic(examples):
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
        """Move phases at a forward call (outside any backward): finish a measurement, plan, compile."""
        self.tracker.settle()  # forwards abandoned since the last call end (Note: [Invocations are autograd nodes])
        self._finish_measurement()
        self._read_step_times(wait=False)
        if runner.phase is not Phase.PLANNING:
            return
        with self._lock:
            if runner.phase is not Phase.PLANNING:
                return
            self._collect_probes()  # Note: [Pricing transfers under the model's own compute] in teraio.probe
            ready = [r for r in self.runners if r.phase is Phase.PLANNING]
            for r in ready:
                if r.plan is None:
                    r._finish_profiling()
            unplanned = [r for r in ready if r.plan is None and r.profile is not None]
            if unplanned and self.cfg.enabled and self.cfg.memory_budget is not None:
                self._plan_step(unplanned)
            elif unplanned and self.cfg.enabled and self.cfg.memory_budget is None:
                self._tell_profile_only()
            for r in ready:
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

    def _plan_step(self, ready: list[GraphRunner]) -> None:
        from teraio import step_budget
        from teraio.planner.budget import resolve_budget
        from teraio.planner.lifetimes import analyse
        from teraio.step_budget import GraphMemory, step_peak

        graphs = [r for r in self.runners if r.profile is not None and r.is_training]
        calls = self._step_calls(graphs)
        lifetimes = {r: analyse(r.profile) for r in graphs}

        def held(r: GraphRunner, plan: Plan | None) -> int:
            after = int(r.profile.meta.get("census_after_fwd_bytes", 0))
            return max(0, after - (plan.moved_bytes if plan is not None else 0))

        unplanned = {r: GraphMemory(lifetimes[r].baseline_peak_bytes, held(r, None)) for r in graphs}
        fixed = {r: r.plan for r in graphs if r not in ready and r.plan is not None}
        memory = {
            r: GraphMemory(p.predicted_peak_bytes, held(r, p)) if (p := fixed.get(r)) else unplanned[r]
            for r in graphs
        }
        step_unplanned, _ = step_peak(calls, unplanned)
        budget_bytes = resolve_budget(self.cfg.memory_budget, step_unplanned)
        for r in ready:
            r.step_budget_bytes = budget_bytes
        if budget_bytes is None:  # "auto": each graph's own smallest stall-free peak
            for r in ready:
                r.plan = self._solve(r, "auto")
            return
        plans: dict[GraphRunner, Plan] = {}

        def plan_graph(r: GraphRunner, b: int, fast: bool) -> GraphMemory:
            if r not in ready:
                return memory[r]
            plans[r] = self._solve(r, b, solver="greedy" if fast else None, quiet=fast)
            return GraphMemory(plans[r].predicted_peak_bytes, held(r, plans[r]))

        log.info(
            "planning %d graph(s) for a step budget of %s (%s; solver %s, time limit %.0f s per graph)",
            len(ready),
            _fmt(budget_bytes),
            self.cfg.memory_budget,
            self.cfg.solver,
            self.cfg.time_limit,
        )

        def min_held(r: GraphRunner) -> int:
            if r not in ready:
                return memory[r].held_bytes
            t = r.profile.tensors
            movable = int(t.loc[t["offloadable"] & (t["first_bwd_use_idx"] >= 0), "nbytes"].sum())
            return max(0, held(r, None) - movable)

        step_budget.split_budget(
            calls,
            budget_bytes,
            memory,
            plan_graph,
            {r: lifetimes[r].min_feasible_peak_bytes for r in graphs},
            {r: min_held(r) for r in graphs},
            lambda r: r.name,
        )
        for r, p in plans.items():
            r.plan = p
            self._save_plan(r)
        self.predicted_step_peak_bytes = step_peak(
            calls,
            {
                r: GraphMemory(r.plan.predicted_peak_bytes, held(r, r.plan)) if r.plan else memory[r]
                for r in graphs
            },
        )[0]
        log.info("predicted step peak %s", _fmt(self.predicted_step_peak_bytes))

    def _step_calls(self, graphs: list[GraphRunner], absent_too: bool = True) -> list[tuple[Any, str, int]]:
        """The last complete step's calls among ``graphs``; with ``absent_too``, graphs that were not
        called in it are appended as one forward and backward each (planned as if they ran alone)."""
        step = self.tracker.last_complete
        calls = []
        if step is not None:
            calls = [(g, k.value, i) for g, k, i in step.calls if g in graphs]
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
        if started is not None and clean and self._all_final():
            clock, t0 = started
            self._step_ends.append((step, clock, t0, clock.mark()))
            self._read_step_times(wait=False)
        if self._measure is MeasureState.ACTIVE and self._measured_step == step.index:
            if clean:
                self._recorder.mark_end()  # Note: [Profiler state inside backward] in teraio.measure
                self._measure = MeasureState.ENDED
            else:
                self._measure = MeasureState.ENDED
                self._measured_step = None  # discard: not a clean step
        elif (
            self._measure is MeasureState.WAITING and clean and self._all_final() and self.cfg.measure_memory
        ):
            self._measure = MeasureState.ARMED

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
                self._append_stats(step)

    def _compute_device(self) -> str:
        """The device the step computes on (its graphs' inputs): step times and the peak recorder."""
        return _device_of([p for r in self.runners for p in r.example_inputs])

    def _all_final(self) -> bool:
        return all(r.phase in (Phase.RUNNING, Phase.INFERENCE) for r in self.runners)

    def _maybe_start_measurement(self) -> None:
        step = self.tracker.current_step
        if step is None:
            return
        if step.index not in self._step_t0 and not step.calls:
            clock = Clock(self._compute_device())
            self._step_t0[step.index] = (clock, clock.mark())
        if self._measure is not MeasureState.ARMED or step.calls:
            return
        from teraio.measure import MemoryRecorder, ProfilerBusyError

        recorder = MemoryRecorder(self._compute_device())
        try:
            recorder.start()
        except ProfilerBusyError:
            return  # another measurement is recording: try on a later step
        self._recorder = recorder
        self._measured_step = step.index
        self._measure = MeasureState.ACTIVE

    def _finish_measurement(self) -> None:
        """Stop a measurement whose step ended; call from outside any backward."""
        if self._measure is not MeasureState.ENDED:
            return
        rec, self._recorder = self._recorder, None
        result = rec.stop()
        if self._measured_step is not None:
            self.measured_peak_bytes = result.peak_bytes
            self._measure = MeasureState.DONE
            log.info("measured step peak %s", _fmt(self.measured_peak_bytes))
            _warn_unplanned_memory(self.measured_peak_bytes, self.predicted_step_peak_bytes)
        else:
            self._measure = MeasureState.ARMED

    # ------------------------------------------------------------------------------------ planning
    def hardware_model(self) -> HardwareModel:
        """What plans assume of the storage: the ``hardware`` file, a quick calibration of the offload
        directory (``hardware="calibrate"``, made once, before the first plan), or the built-in model;
        with ``"calibrate"``, the price of moving tensors measured under the graphs' own compute once a
        probe has it (Note: [Pricing transfers under the model's own compute] in teraio.probe)."""
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
        if self._run is not None and self.cfg.hardware == CALIBRATE and hw != self._saved_hardware:
            self._run.save_hardware(hw.to_dict())  # what the plans were made with
            self._saved_hardware = hw
        tiers = set(self.cfg.tiers)
        if "host" in tiers and hw.tiers["host"].capacity_bytes == 0:
            hw = hw.with_overrides("host", capacity_bytes=None)
        if "ssd" not in tiers:
            hw = hw.with_overrides("ssd", capacity_bytes=0)
        return hw

    def _calibration_directory(self) -> str:
        from teraio.runtime import RuntimeConfig
        from teraio.runtime.space import make_base_dirs

        directory = RuntimeConfig(dirs=self.cfg.offload_dirs or (), backend="posix").resolved().dirs[0]
        make_base_dirs(directory)
        return directory

    def wants_transfer_price(self) -> bool:
        """Whether a graph's calibration steps should price moving tensors under its own compute (Note:
        [Pricing transfers under the model's own compute] in teraio.probe): plans are made from a
        calibration of the offload directory, for a CPU that computes, and no probe has the price yet."""
        from teraio.calibrate import accelerator_computes

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
            from teraio.ops import register_engine
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
            from teraio.ops import unregister_engine

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
        """Time the runtime engine on the directory offloads will go to (teraio.calibrate, small sizes)."""
        if "ssd" not in self.cfg.tiers:
            return HardwareModel()
        from teraio.calibrate import QUICK_NBYTES, calibrate

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
            from teraio.ops import register_engine
            from teraio.runtime import Engine, RuntimeConfig

            # None: TERAIO_OFFLOAD_DIRS, else the runtime's per-user directory, where a killed run's
            # leftovers are found and removed by the next start.
            dirs = self.cfg.offload_dirs or ()
            io_backend = self.cfg.io_backend
            if set(self.cfg.tiers) == {"host"}:
                io_backend = "host"
            reserve = sum(r.plan.moved_bytes for r in self.runners if r.plan is not None)
            # One subdirectory per process and rank (DDP, torchrun): the runtime names them by both.
            dist = torch.distributed
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
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

    def close(self) -> None:
        """Stop the engine and remove its files (also done at interpreter exit)."""
        self._close_probes()
        if self._recorder is not None:
            with contextlib.suppress(Exception):
                self._recorder.stop()
            self._recorder = None
        if self.engine is not None:
            from teraio.ops import unregister_engine

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

    def _append_stats(self, step: StepRecord) -> None:
        # In a backward hook: a failure is warned once, never raised (Note: [Run-directory files are
        # by-products] in teraio.run_dir).
        if self._run is not None:
            self._run.append_stats({"step": step.index, "step_s": self.step_times_s[-1], **self._io_stats()})

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
        """What the backend did: per step (``steps``, ``step_s``, peaks, bytes moved) and per graph.

        ``steps`` counts complete training steps (a step runs every forward in flight to its backward or
        its end); ``step_s`` is the median wall time of the steps that ran every graph's final
        compilation (no profiling or compile inside); the I/O figures are totals since the start.
        """
        self.tracker.settle()
        self._finish_measurement()
        self._read_step_times(wait=True)
        plans = [(r, r.plan) for r in self.runners if r.plan is not None and r.is_training]
        calls = self._step_calls(
            [r for r in self.runners if r.is_training and r.profile is not None], absent_too=False
        )
        fwd_calls = [g for g, k, _ in calls if k == "fwd"]
        graphs = [
            {
                "graph": r.graph_id,
                "phase": r.phase.value,
                "invocations": r.invocations,
                "moved_bytes_per_invocation": r.plan.moved_bytes if r.plan else 0,
                "predicted_peak_bytes": r.plan.predicted_peak_bytes if r.plan else None,
                "predicted_step_s": r.plan.predicted_step_s if r.plan else None,
                "profiled_s": r.profile.meta.get("step_s") if r.profile is not None else None,
            }
            for r in self.runners
        ]
        return {
            "steps": self.tracker.completed_steps,
            "running_steps": len(self.step_times_s),
            "graphs": len(self.runners),
            "step_s": statistics.median(self.step_times_s) if self.step_times_s else None,
            "measured_peak_bytes": self.measured_peak_bytes,
            "predicted_peak_bytes": self.predicted_step_peak_bytes
            if self.predicted_step_peak_bytes is not None
            else (max(p.predicted_peak_bytes for _, p in plans) if plans else None),
            "predicted_step_s": sum(r.plan.predicted_step_s for r in fwd_calls if r.plan is not None)
            if plans
            else None,
            "moved_bytes_per_step": sum(r.plan.moved_bytes for r in fwd_calls if r.plan is not None),
            "phase": [r.phase.value for r in self.runners],
            "per_graph": graphs,
            **self._io_stats(),
        }


_CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")


def check_compile_mode(mode: str | None, options: dict[str, Any] | None, inner: str) -> dict[str, Any]:
    """The Inductor options to compile with: ``mode``'s (``teraio.compilers.mode_options``) under the
    explicit ``options``. Refuses CUDA graphs (one line, what to do instead).

    A CUDA graph replays recorded kernels without running Python: teraio's migration ops are host-side
    I/O calls, so a replay would skip every offload and prefetch and compute on stale buffers.

    Raises:
        UserInputError: ``mode`` or ``options`` ask for CUDA graphs, Inductor's config has them on, or
            ``mode`` is not one of torch.compile's.
    """
    from teraio.compilers import mode_options
    from teraio.errors import UserInputError

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
