"""The ``teraio`` torch.compile backend: warm up, profile, plan, recompile, run.

Every graph torch.compile hands us (graph breaks and shape recompiles give several) gets its own
:class:`GraphRunner` with its own lifecycle:

1. *profiling*: the first ``profile_steps`` steps run AOTAutograd's partitioned graphs through a timing
   interpreter (``teraio.profiler``); the first step is warm-up.
2. *planning*: the Profile is written to the run directory and, when a memory budget is set and
   migration is enabled, handed to the planner.
3. *running*: the graphs are compiled with the inner compiler (Inductor or the FX-only path), rewritten
   to carry the plan's migration ops, and every later step runs them.

Switching happens only at a forward call, after the previous step's backward has run, so a step never
mixes two compilations.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import fx
from torch._dynamo.backends.common import aot_autograd

from teraio.capture import CapturedStep, capturing_partition
from teraio.planner.hardware import HardwareModel
from teraio.planner.plan import Plan
from teraio.planner.profile import Profile
from teraio.profiler import StepProfiler
from teraio.rewrite import PlanMismatchError, RewriteResult, apply_plan

log = logging.getLogger("teraio")

INNER_COMPILERS = ("inductor", "eager")


@dataclass
class BackendConfig:
    """Options of ``teraio.backend(...)`` (see the README's option table)."""

    memory_budget: str | int | float | None = None
    offload_dirs: list[str] | None = None
    tiers: list[str] = field(default_factory=lambda: ["ssd"])
    solver: str = "ilp"
    time_limit: float = 30.0
    profile_steps: int = 3
    plan: str | None = None
    inner: str = "inductor"
    run_dir: str | None = None
    enabled: bool = True
    on_plan_mismatch: str = "error"  # "error" | "reprofile"
    hardware: str | None = None  # HardwareModel JSON (teraio calibrate); default: built-in model
    io_backend: str | None = None  # auto|posix|kvikio|host; None: TERAIO_IO_BACKEND or auto
    checksum: bool = False
    measure_memory: bool = True  # measure one running step's peak with the torch profiler
    runtime_options: dict[str, Any] = field(default_factory=dict)  # extra RuntimeConfig fields (tests)

    def __post_init__(self) -> None:
        from teraio.errors import UserInputError

        if self.inner not in INNER_COMPILERS:
            raise UserInputError(f"inner must be one of {INNER_COMPILERS}, not {self.inner!r}")
        if int(self.profile_steps) < 1:
            raise UserInputError(f"profile_steps must be at least 1, not {self.profile_steps}")
        if self.on_plan_mismatch not in ("error", "reprofile"):
            raise UserInputError("on_plan_mismatch must be 'error' or 'reprofile'")
        if isinstance(self.offload_dirs, (str, os.PathLike)):
            self.offload_dirs = [str(self.offload_dirs)]


def _decompositions(inner: str) -> dict[Any, Any] | None:
    # Profile with the decompositions the inner compiler will use, so profiling and the final compile
    # trace the same joint graph (same nodes, same names, same fingerprint).
    if inner == "inductor":
        from torch._inductor.decomposition import select_decomp_table

        return select_decomp_table()
    return None


def fx_only_compiler(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    """The FX-only inner compiler: run the GraphModule as it is (bit-identical to eager aten).

    Boxed calling convention: the generated code clears its argument list, so saved tensors are freed
    after their last use in backward instead of living until the call returns.
    """
    from torch.fx.graph import _BoxedCodeGen

    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()
    return gm


def boxed(fn: Callable[..., Any], after: Callable[[], None] | None = None) -> Callable[[list[Any]], Any]:
    """Wrap a compiled graph in AOTAutograd's boxed convention, with an optional hook after each call."""
    is_boxed = bool(getattr(fn, "_boxed_call", False))

    def run(args: list[Any]) -> Any:
        if is_boxed:
            out = fn(args)
        else:
            vals = list(args)
            args.clear()
            out = fn(*vals)
        if after is not None:
            after()
        return out

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def inner_compiler(inner: str, is_backward: bool) -> Callable[..., Any]:
    if inner == "eager":
        return fx_only_compiler
    from torch._inductor.compile_fx import compile_fx_inner

    def compile_inductor(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        return compile_fx_inner(gm, example_inputs, is_backward=is_backward)

    return compile_inductor


def write_trace(profile: Profile, plan: Plan, path: Path) -> None:
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
    path.write_text(
        json.dumps(
            {
                "traceEvents": events,
                "displayTimeUnit": "ms",
                "otherData": {"predicted_step_s": sim.step_s, "peak_bytes": sim.peak_bytes},
            }
        )
    )


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def load_plans(path: str | os.PathLike) -> list[Plan]:
    """A plan file, or a run directory holding graph*/plan.json (one plan per captured graph)."""
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("graph*/plan.json")) or sorted(p.glob("*.json"))
        if not files:
            from teraio.planner.plan import PlanError

            raise PlanError(f"plan directory '{p}' holds no graph*/plan.json")
        return [Plan.load(f) for f in files]
    return [Plan.load(p)]


class GraphRunner:
    """The lifecycle of one captured graph (see module docstring)."""

    def __init__(self, backend: TeraioBackend, graph_id: int, gm: fx.GraphModule, example_inputs: list[Any]):
        self.backend = backend
        self.cfg = backend.cfg
        self.graph_id = graph_id
        self.gm = gm
        self.example_inputs = example_inputs
        self.profiler: StepProfiler | None = None
        self.profile: Profile | None = None
        self.plan: Plan | None = None
        self.rewrite: RewriteResult | None = None
        self.measured_peak_bytes: int | None = None
        self._measure_next = False
        self._mem_prof: Any = None
        self._pending_error: Exception | None = None
        self.phase = "profiling"
        self.steps = 0
        self.step_times_s: list[float] = []
        self._fwd_start: float | None = None
        self._lock = threading.Lock()
        self._compiled = self._compile_profiling()

    # ----------------------------------------------------------------------------------- compiling
    def _compile_profiling(self) -> Callable[..., Any]:
        def on_partition(step: CapturedStep) -> None:
            self.profiler = StepProfiler(step, graph_id=self.graph_id)
            if self.backend._plans_from_file:
                fingerprint = self.profiler.analysis.fingerprint
                plan = self.backend.plan_for_fingerprint(fingerprint)
                if plan is not None:
                    self.plan = plan
                    self.phase = "compile_pending"  # no profiling: the plan says what to do
                elif self.cfg.on_plan_mismatch == "error":
                    have = ", ".join(p.fingerprint[:12] for p in self.backend._plans_from_file)
                    self._pending_error = PlanMismatchError(
                        f"plan '{self.cfg.plan}' was made for graph(s) {have}, not this graph "
                        f"({fingerprint[:12]}); re-profile and re-plan, or pass on_plan_mismatch='reprofile'"
                    )
                else:
                    log.warning(
                        "graph %d: no plan in %s matches fingerprint %s; re-profiling",
                        self.graph_id,
                        self.cfg.plan,
                        fingerprint[:12],
                    )

        def run_fwd(args: list[Any]) -> Any:
            return self.profiler.run_fwd(args)

        def run_bwd(args: list[Any]) -> Any:
            return self.profiler.run_bwd(args)

        run_fwd._boxed_call = run_bwd._boxed_call = True  # type: ignore[attr-defined]

        def fw_compiler(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
            return boxed(run_fwd)

        def bw_compiler(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
            return boxed(run_bwd, after=self._after_bwd)

        return aot_autograd(
            fw_compiler=fw_compiler,
            bw_compiler=bw_compiler,
            partition_fn=capturing_partition(on_partition),
            decompositions=_decompositions(self.cfg.inner),
        )(self.gm, self.example_inputs)

    def _compile_final(self) -> Callable[..., Any]:
        inner = self.cfg.inner

        def on_partition(step: CapturedStep) -> CapturedStep | None:
            if self.plan is None or not self.cfg.enabled or not self.plan.decisions:
                return None
            engine_id = self.backend.engine_id_for(self.plan)
            self.rewrite = apply_plan(step, self.plan, engine_id, key_prefix=f"g{self.graph_id}")
            return self.rewrite.step

        def bw(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
            return boxed(inner_compiler(inner, is_backward=True)(gm, example_inputs), after=self._after_bwd)

        return aot_autograd(
            fw_compiler=inner_compiler(inner, is_backward=False),
            bw_compiler=bw,
            partition_fn=capturing_partition(on_partition),
            decompositions=_decompositions(inner),
        )(self.gm, self.example_inputs)

    # ------------------------------------------------------------------------------------- running
    def _after_bwd(self) -> None:
        if self._mem_prof is not None:
            self._mem_prof.mark_end()  # stopped at the next call: Note: [Profiler state inside backward]
        elif self._fwd_start is not None:
            self.step_times_s.append(time.perf_counter() - self._fwd_start)
            self.backend._on_step(self, self.step_times_s[-1])
        self._fwd_start = None
        if self.phase == "profiling" and self.profiler.steps_recorded >= self.cfg.profile_steps:
            self._finish_profiling()

    def _finish_profiling(self) -> None:
        self.profile = self.profiler.build_profile({"inner": self.cfg.inner})
        self.backend._on_profile(self)
        self.phase = "compile_pending"  # planned and compiled at the next forward, outside backward

    # Peak memory of one running step, measured with the torch profiler (not the runtime's books).
    def _start_memory_measurement(self) -> None:
        from teraio.measure import MemoryRecorder

        self._mem_prof = MemoryRecorder(self.cfg_device())
        self._mem_prof.start()

    def finish_memory_measurement(self) -> None:
        """Stop a measurement whose step has ended (call outside backward)."""
        if self._mem_prof is not None and self._mem_prof._wall_s is not None:
            rec, self._mem_prof = self._mem_prof, None
            self.measured_peak_bytes = rec.stop().peak_bytes

    def cfg_device(self) -> str:
        return self.profile.meta.get("device", "cpu") if self.profile is not None else "cpu"

    def __call__(self, *args: Any) -> Any:
        if self._pending_error is not None:
            raise self._pending_error
        self.finish_memory_measurement()
        with self._lock:
            if self.phase == "compile_pending":
                if self.cfg.enabled and self.plan is None and self.cfg.memory_budget is not None:
                    self.plan = self.backend._make_plan(self)
                self._compiled = self._compile_final()
                self.phase = "running"
                self.step_times_s.clear()
                # The first running step warms caches; measure memory on the second.
                self._measure_next = False
            elif self.phase == "running" and self.measured_peak_bytes is None and self.cfg.measure_memory:
                if self._measure_next and torch.is_grad_enabled():
                    self._start_memory_measurement()
                self._measure_next = True
            self.steps += 1
            if torch.is_grad_enabled():
                self._fwd_start = time.perf_counter()
        return self._compiled(*args)


class TeraioBackend:
    """A configured backend: ``torch.compile(model, backend=teraio.backend(**options))``."""

    def __init__(self, **options: Any) -> None:
        self.cfg = BackendConfig(**options)
        self.runners: list[GraphRunner] = []
        self.engine: Any = None
        self._engine_id: int | None = None
        self._tmp_offload_dir: str | None = None
        self._plans_from_file: list[Plan] = []
        self.run_dir = Path(self.cfg.run_dir) if self.cfg.run_dir else None
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            cfg = {k: v for k, v in asdict(self.cfg).items() if k != "runtime_options"}
            (self.run_dir / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
        if self.cfg.plan is not None:
            self._plans_from_file = load_plans(self.cfg.plan)

    # ------------------------------------------------------------------------------------ planning
    def hardware_model(self) -> HardwareModel:
        hw = HardwareModel.load(self.cfg.hardware) if self.cfg.hardware else HardwareModel()
        tiers = set(self.cfg.tiers)
        if "host" in tiers and hw.tiers["host"].capacity_bytes == 0:
            hw = hw.with_overrides("host", capacity_bytes=None)
        if "ssd" not in tiers:
            hw = hw.with_overrides("ssd", capacity_bytes=0)
        return hw

    def _make_plan(self, runner: GraphRunner) -> Plan:
        from teraio.planner.solve import solve

        plan = solve(
            runner.profile,
            budget=self.cfg.memory_budget,
            solver=self.cfg.solver,
            hardware=self.hardware_model(),
            time_limit_s=float(self.cfg.time_limit),
        )
        if self.run_dir is not None:
            d = self.run_dir / f"graph{runner.graph_id}"
            d.mkdir(parents=True, exist_ok=True)
            plan.save(d / "plan.json")
            write_trace(runner.profile, plan, d / "trace.json")
        log.info(
            "graph %d: plan by %s moves %d tensors (%d bytes); predicted peak %d, step %.3f s",
            runner.graph_id,
            plan.solver,
            len(plan.decisions),
            plan.moved_bytes,
            plan.predicted_peak_bytes,
            plan.predicted_step_s,
        )
        return plan

    def plan_for_fingerprint(self, fingerprint: str) -> Plan | None:
        for p in self._plans_from_file:
            if p.fingerprint == fingerprint:
                return p
        return None

    def engine_id_for(self, plan: Plan) -> int:
        """The runtime engine the graphs' ops call; started (and space reserved) on first use."""
        if self.engine is None:
            import tempfile

            from teraio.ops import register_engine
            from teraio.runtime import Engine, RuntimeConfig

            dirs = self.cfg.offload_dirs
            if not dirs:
                self._tmp_offload_dir = tempfile.mkdtemp(prefix="teraio-offload-")
                dirs = [self._tmp_offload_dir]
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
        if self.engine is not None:
            from teraio.ops import unregister_engine

            self.engine.close()
            unregister_engine(self._engine_id)
            self.engine = None
        if self._tmp_offload_dir is not None:
            import shutil

            shutil.rmtree(self._tmp_offload_dir, ignore_errors=True)
            self._tmp_offload_dir = None

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        runner = GraphRunner(self, len(self.runners), gm, list(example_inputs))
        self.runners.append(runner)
        return runner

    # ------------------------------------------------------------------------------------- results
    @property
    def profiles(self) -> list[Profile]:
        return [r.profile for r in self.runners if r.profile is not None]

    def _on_profile(self, runner: GraphRunner) -> None:
        if self.run_dir is not None:
            runner.profile.save(self.run_dir / f"graph{runner.graph_id}" / "profile")

    def _on_step(self, runner: GraphRunner, step_s: float) -> None:
        if self.run_dir is None or runner.phase != "running":
            return
        with open(self.run_dir / "stats.jsonl", "a") as f:
            f.write(
                json.dumps(
                    {"graph": runner.graph_id, "step": runner.steps, "step_s": step_s, **self._io_stats()}
                )
                + "\n"
            )

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
        """Totals since the backend started; ``step_s`` is the median of the running (non-profiling) steps."""
        for r in self.runners:
            r.finish_memory_measurement()
        steps = max((r.steps for r in self.runners), default=0)
        times = [t for r in self.runners for t in r.step_times_s]
        plans = [r.plan for r in self.runners if r.plan is not None]
        peaks = [r.measured_peak_bytes for r in self.runners if r.measured_peak_bytes is not None]
        return {
            "steps": steps,
            "graphs": len(self.runners),
            "step_s": statistics.median(times) if times else None,
            "measured_peak_bytes": max(peaks) if peaks else None,
            "predicted_peak_bytes": max(p.predicted_peak_bytes for p in plans) if plans else None,
            "predicted_step_s": sum(p.predicted_step_s for p in plans) if plans else None,
            "moved_bytes_per_step": sum(p.moved_bytes for p in plans),
            "phase": [r.phase for r in self.runners],
            **self._io_stats(),
        }


def backend(**options: Any) -> TeraioBackend:
    """A configured teraio backend object for ``torch.compile(model, backend=...)``."""
    return TeraioBackend(**options)


_default: TeraioBackend | None = None


def default_backend() -> TeraioBackend:
    """The backend used by ``torch.compile(model, backend="teraio")`` (default options)."""
    global _default
    if _default is None:
        _default = TeraioBackend()
    return _default


def teraio_backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    """Entry point registered as torch_dynamo_backends 'teraio'."""
    return default_backend()(gm, example_inputs)
