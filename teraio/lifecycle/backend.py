"""The ``teraio`` torch.compile backend: profile the first steps, plan, recompile with migration ops, run.

Every graph torch.compile hands the backend gets a :class:`~teraio.lifecycle.runner.GraphRunner` (a graph
whose shapes change gets one per shape, up to ``max_shapes``: :class:`~teraio.lifecycle.shapes.ShapeDispatch`).
A runner moves through phases (teraio.lifecycle.phases) in one place, :meth:`TeraioBackend.advance`,
always at a forward call and never inside a backward. The backend object holds what the rooms around it
share and wires them together:

- the runners (:mod:`teraio.lifecycle.runner`, their profiling: :mod:`teraio.lifecycle.runner_profiling`);
- the step's planning (:mod:`teraio.lifecycle.step_planner`), priced by :mod:`teraio.lifecycle.pricing`;
- the measured step and the memory outside the graphs (:mod:`teraio.lifecycle.measurement`);
- the runtime engines (:mod:`teraio.lifecycle.engines`) and the run record (:mod:`teraio.lifecycle.run_record`).

Invocations in flight and step boundaries come from ``teraio.lifecycle.steps``; a switch of compilation
never affects an invocation already in flight (its backward belongs to the compilation that ran its
forward).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import fx

from teraio.config import BackendConfig, make_config, partitioner_budget_option
from teraio.errors import UserInputError
from teraio.lifecycle import registry as process
from teraio.lifecycle.engines import round_up, runtime_config
from teraio.lifecycle.measurement import OutsideMemory, StepMeasurement
from teraio.lifecycle.model_compile import compile_model
from teraio.lifecycle.outside_time import OutsideTimer
from teraio.lifecycle.partitioner_search import PartitionerSearch
from teraio.lifecycle.phases import Phase
from teraio.lifecycle.pricing import TransferPricing
from teraio.lifecycle.ranks import RankAgreement
from teraio.lifecycle.results import backend_stats, io_stats
from teraio.lifecycle.run_dir import RunDirError
from teraio.lifecycle.run_record import RunRecord, load_plans
from teraio.lifecycle.runner import GraphRunner
from teraio.lifecycle.shapes import ShapeDispatch, is_dynamic
from teraio.lifecycle.step_planner import StepPlanner
from teraio.lifecycle.step_stats import StepStats
from teraio.lifecycle.steps import Invocation, StepRecord, StepTracker
from teraio.planner.hardware import HardwareModel
from teraio.planner.plan import Plan
from teraio.planner.profile import Profile
from teraio.platform.mkl_vml import warm_up_mkl_vml
from teraio.profiling.transfer_probe import TransferPrice
from teraio.states import attach_states, io_bytes_by_kind
from teraio.states.residency import WholeStepStates

log = logging.getLogger("teraio")


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


class TeraioBackend:
    """A configured backend: ``torch.compile(model, backend=teraio.backend(**options))``."""

    def __init__(self, config: BackendConfig | None = None, /, **options: Any) -> None:
        _ensure_log_handler()
        if config is not None and options:
            raise TypeError("TeraioBackend takes a BackendConfig or keyword options, not both")
        self.cfg = config if config is not None else make_config(**options)
        warm_up_mkl_vml()  # Note: [MKL VML's first concurrent call] in teraio.platform.mkl_vml
        self.runners: list[GraphRunner] = []
        self._engine: Any = None  # teraio.graph.ops.RegisteredEngine: the one the plans' ops call
        self.plans_from_file: list[Plan] = []
        self.inductor_options: dict[str, Any] = {}  # torch.compile's mode and options, for inner="inductor"
        self.backend_id = process.new_id()  # in the process-wide view: teraio.process_stats()
        # Note: [Ranks agree at the start of every step] in teraio.lifecycle.ranks
        self.ranks = RankAgreement()
        self._ranks_ready = False
        self._told_profile_only = False
        self._lock = threading.RLock()
        # A bad hardware file fails here, before the run directory is made.
        self.pricing = TransferPricing(
            self.cfg,
            self.runners,
            self.plans_from_file,
            save_hardware=lambda hw: self.record.save_hardware(hw),
        )
        self.record = RunRecord(self.cfg)
        if self.cfg.plan is not None:
            self.plans_from_file.extend(load_plans(self.cfg.plan))
        self.states = attach_states(self.cfg)  # states="offload": teraio.states
        #: Note: [The whole-step budget keeps some states in memory] in teraio.states.residency.
        self.whole_step = None if self.states is None else WholeStepStates(self.states, self.cfg.states.keep)
        if self.states is not None:
            self.states.overlap_ready = self._overlap_ready
        self.step_stats = StepStats()  # Note: [Models of one backend] in teraio.lifecycle.step_stats
        # Note: [Memory outside the graphs is measured and planned for] in teraio.lifecycle.measurement
        self.outside_memory = OutsideMemory(self.cfg)
        self.planner = StepPlanner(
            self.cfg,
            self.runners,
            self.step_stats,
            self.ranks,
            self.outside_memory,
            self.whole_step,
            hardware_model=self.pricing.hardware_model,
            save_plan=self.record.save_plan,
        )
        #: Note: [The partitioner's budget is part of the plan] in teraio.lifecycle.partitioner_search
        self.partitioner_search = (
            PartitionerSearch(
                self.planner, self.cfg.solver.runoff_rounds, step_index=lambda: self.tracker.step_index_now()
            )
            if self.cfg.solver.partitioner_budget == "search"
            else None
        )
        self.tracker = StepTracker(on_step_end=self._on_step_end, on_invocation_end=self._on_invocation_end)
        #: The time each calibration step spends outside its graphs (teraio.lifecycle.outside_time).
        self.outside = OutsideTimer(on_sample=self._outside_sample)
        self.measurement = StepMeasurement(
            self.cfg,
            self.runners,
            self.tracker,
            self.step_stats,
            self.outside,
            self.outside_memory,
            self.whole_step,
            predicted_peak=self.planner.predicted_peak,
            on_step_time=self._append_stats,
            on_trial=lambda: self.partitioner_search is not None and self.partitioner_search.on_trial,
        )
        process.register(self)

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
        residency = None if self.states is None else self.states.residency
        if residency is not None:  # Note: [Parameters are guarded while no module of the model runs]
            residency.compiled_outside_modules(examples)
        if is_dynamic(examples):
            return ShapeDispatch(self, gm, examples)
        return self.new_runner(gm, examples)

    def compile(self, model: torch.nn.Module, **compile_kwargs: Any) -> torch.nn.Module:
        """Compile ``model`` in place for offload: each block of its block list on its own, and the other
        modules holding parameters (embeddings, final norm, head) as graphs of their own, so that every
        parameter can move (teraio.lifecycle.model_compile). ``compile_kwargs`` go to ``torch.compile``.

        Returns:
            ``model`` itself: keep calling ``model(...)``.
        """
        return compile_model(self, model, **compile_kwargs)

    def new_runner(self, gm: fx.GraphModule, examples: list[Any]) -> GraphRunner:
        """A runner for one graph at one set of shapes (also called by ShapeDispatch per shape)."""
        with self._lock:
            search = self.partitioner_search
            # Note: [The partitioner's budget is part of the plan] in teraio.lifecycle.partitioner_search
            partition = (
                search.ratio_for_new_graph() if search is not None else partitioner_budget_option(self.cfg)
            )
            runner = GraphRunner(self, len(self.runners), gm, examples, partitioner_budget=partition)
            self.runners.append(runner)
            self.measurement.compiled_during(self.tracker.current_step)
            return runner

    # ------------------------------------------------------------------------ what runners call
    def note_forward(self) -> None:
        self.measurement.note_forward()

    def maybe_start_measurement(self) -> None:
        self.measurement.maybe_start()

    def save_profile(self, runner: GraphRunner) -> None:
        self.record.save_profile(runner)

    def wants_transfer_price(self) -> bool:
        return self.pricing.wants_transfer_price()

    def measuring_kernel_memory(self) -> bool:
        """Whether one of its graphs measures its kernels' memory now (RunnerHost)."""
        return any(r.profiler is not None and r.profiler.memory_step_running for r in self.runners)

    def probe_engine_id(self) -> int:
        return self.pricing.probe_engine_id()

    def hardware_model(self) -> HardwareModel:
        """What plans assume of the storage (teraio.lifecycle.pricing)."""
        return self.pricing.hardware_model()

    def engine_id_for(self, plan: Plan) -> int:
        """The runtime engine the graphs' ops call; started (and space reserved) on first use."""
        if self._engine is None:
            from teraio.graph.ops import RegisteredEngine
            from teraio.runtime import Engine

            reserve = sum(
                p.moved_bytes for r in self.runners for p in (r.plans.values() or [r.plan]) if p is not None
            )
            self._engine = RegisteredEngine(
                Engine(runtime_config(self.cfg, reserve_bytes=round_up(reserve, 1 << 20)))
            )
        return self._engine.id

    @property
    def engine(self) -> Any:
        """The runtime engine of the graphs' ops (``teraio.runtime.Engine``), None before the first plan."""
        return self._engine.engine if self._engine is not None else None

    # ---------------------------------------------------------------------------------- lifecycle
    def _overlap_ready(self) -> bool:
        """Note: [The step of offloaded parameters runs in the next forward] in teraio.states.step_pipeline:
        once every graph the step called runs its plan (profiling and planning see the serial step), and
        the whole-step plan leaves room for the step's working set beside the forward."""
        step = self.tracker.current_step
        if step is None or not step.calls:
            return False
        if any(g.phase not in (Phase.RUNNING, Phase.INFERENCE) for g, _, _ in step.calls):
            return False
        return self.whole_step is None or self.whole_step.overlap_fits

    def advance(self, runner: GraphRunner) -> None:
        """Move phases at a forward call (outside any backward): finish measurements, plan, compile."""
        # Forwards abandoned since the last call end (Note: [Invocations are autograd nodes] in
        # teraio.lifecycle.steps).
        self.tracker.settle()
        # The torch profiler's session is the process's one (and holds stderr while it runs): whatever
        # measurement of any backend ended is read now, so none holds it past the next forward.
        process.finish_measurements_everywhere()
        self.measurement.read_step_times(wait=False)
        step = self.tracker.current_step
        search = self.partitioner_search
        if search is not None and search.on_trial and (step is None or step.complete):
            # Note: [The search's finalists are timed against each other] in teraio.lifecycle.partitioner_runoff
            with self._lock:
                search.at_step_boundary(self.tracker.next_step_index)
        if step is None or step.complete:
            replan = self.outside_memory.replan_wanted
            # Note: [Ranks agree at the start of every step] in teraio.lifecycle.ranks
            if self.ranks.active():
                ready_here = any(r.phase is Phase.PLANNING for r in self.runners)
                agreed = self.ranks.reduce([1.0 if ready_here else 0.0, -1.0 if replan else 0.0], "min")
                self._ranks_ready, replan = agreed[0] >= 1.0, agreed[1] < 0
            # Note: [Memory outside the graphs is measured and planned for] in teraio.lifecycle.measurement
            if replan:
                self.outside_memory.take_replan()
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
            # Note: [Pricing transfers under the model's own compute] in teraio.profiling.transfer_probe
            self.pricing.collect_probes()
            for r in self.runners:
                if r.phase is Phase.PLANNING and r.profiler is not None and r.profile is None:
                    r.finish_kernel_memory()
                    if r.profiler.wants_kernel_memory:  # its step did not run alone: measure again
                        r.phase = Phase.PROFILING
            ready = [r for r in self.runners if r.phase is Phase.PLANNING]
            for r in ready:
                if r.plan is None and r.profiler is not None:
                    r.finish_profiling()
            unplanned = [r for r in ready if r.plan is None and r.profile is not None]
            if unplanned and self.cfg.memory_budget is not None:
                # Note: [The step is planned once every graph it calls is profiled] in teraio.lifecycle.step_planner
                # With enabled=False too: a graph waiting to be planned still runs its profiling code (the
                # FX graph op by op, not Inductor's kernels), so a reference run that compiled it at once
                # computed other bits than the run it is the reference of.
                if self.planner.waits_for_profiles(step.index if step is not None else 0):
                    return
                search = self.partitioner_search
                if (
                    self.cfg.enabled
                    and search is not None
                    and search.applies(unplanned, self.ranks.active(), self.states is not None)
                ):
                    # Note: [The partitioner's budget is part of the plan] in teraio.lifecycle.partitioner_search
                    if search.plan(unplanned):
                        self.measurement.compiled_during(self.tracker.current_step)
                        return  # profiling again at another partitioner budget
                elif self.cfg.enabled:
                    self.planner.plan(unplanned)
            elif unplanned and self.cfg.enabled and self.cfg.memory_budget is None:
                self._tell_profile_only()
            for r in ready:
                if r.phase is Phase.PLANNING:
                    r.compile_final()
            self.measurement.compiled_during(self.tracker.current_step)

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

    def finish_recorders(self) -> None:
        """Read this backend's measurements whose steps ended: a measured step's, and any graph's
        kernel-memory step's. Outside any backward only."""
        self.measurement.finish()
        for r in self.runners:
            r.finish_kernel_memory()

    def _on_step_end(self, step: StepRecord) -> None:
        self.measurement.on_step_end(step)

    @staticmethod
    def _on_invocation_end(inv: Invocation) -> None:
        inv.graph.invocation_ended(inv)

    @staticmethod
    def _outside_sample(runner: GraphRunner, outside_s: float) -> None:
        if runner.profiler is not None and runner.profile is None:
            runner.profiler.add_outside_sample(outside_s)

    def close(self, restore_states: bool = True) -> None:
        """Stop the engine and remove its files (also done at interpreter exit). With ``states="offload"``,
        ``restore_states`` says whether the optimizer's offloaded states (and gradients) come back into
        memory first or are dropped (teraio.states.offload.StateOffload.close)."""
        if getattr(self, "states", None) is not None:  # first: it may refuse, before anything is closed
            self.states.close(restore=restore_states)
        search = getattr(self, "partitioner_search", None)
        if search is not None:  # a loop that ended during the search's trial
            search.at_close()
        self.pricing.close()
        for r in self.runners:  # a kernel-memory step that ended and was never read, or never ended
            if r.profiler is not None:
                r.profiler.abandon_kernel_memory()
        self.measurement.close()
        process.unregister(self)
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    # ------------------------------------------------------------------------------------- results
    @property
    def run_id(self) -> str:
        return self.record.run_id

    @property
    def run_dir(self) -> Path | None:
        return self.record.run_dir

    @property
    def run_dir_error(self) -> RunDirError | None:
        """The write into ``run_dir`` that failed, after which the run went on without it (None: none)."""
        return self.record.error

    @property
    def step_times_s(self) -> list[float]:
        """Complete running steps' wall times, every graph in its final phase."""
        return self.measurement.step_times_s

    @property
    def measured_peak_bytes(self) -> int | None:
        return self.measurement.measured_peak_bytes

    @property
    def predicted_step_peak_bytes(self) -> int | None:
        return self.planner.predicted_step_peak_bytes

    @property
    def transfer_price(self) -> TransferPrice | None:
        return self.pricing.transfer_price

    @property
    def transfer_probes(self) -> list[dict[str, Any]]:
        return self.pricing.transfer_probes

    @property
    def _probe_engine(self) -> Any:
        return self.pricing.probe_engine

    def _compute_device(self) -> str:
        return self.measurement.compute_device()

    def _predicted_peak(self, calls: list[tuple[Any, str, int]]) -> int | None:
        return self.planner.predicted_peak(calls)

    @property
    def profiles(self) -> list[Profile]:
        """The profiles of every graph that finished profiling."""
        for r in self.runners:
            if r.phase is Phase.PLANNING and r.profiler is not None:
                r.finish_profiling()
        return [r.profile for r in self.runners if r.profile is not None]

    def _append_stats(self, step: StepRecord, step_s: float) -> None:
        if self.partitioner_search is not None:
            self.partitioner_search.step_timed(step.index, step_s)

        # In a backward hook: a failure is warned once, never raised (Note: [Run-directory files are
        # by-products] in teraio.lifecycle.run_dir).
        def line() -> dict[str, Any]:
            io = io_stats(self.engine)
            return {
                "step": step.index,
                "step_s": step_s,
                **io,
                **io_bytes_by_kind(io, self.states),
                # Note: [The whole-step budget keeps some states in memory] in teraio.states.residency
                **({"whole_step": self.whole_step.stats()} if self.whole_step is not None else {}),
            }

        self.record.append_stats(line)

    @property
    def settled(self) -> bool:
        """Whether the steps from now on run the plans: no graph is profiling or waiting for its plan,
        and the partitioner search is not timing its finalists (Note: [The search's finalists are timed
        against each other] in teraio.lifecycle.partitioner_runoff). A graph compiled later (a new shape,
        a graph break not reached yet) profiles again."""
        if any(r.phase in (Phase.PROFILING, Phase.PLANNING) for r in self.runners):
            return False
        return self.partitioner_search is None or not self.partitioner_search.on_trial

    def stats(self) -> dict[str, Any]:
        """What the backend did, for the model it trained last, per model, and per graph
        (teraio.lifecycle.results.backend_stats)."""
        return backend_stats(self)


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
    "default_backend",
    "teraio_backend",
]
