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

from planner.profile import Profile
from teraio.capture import CapturedStep, capturing_partition
from teraio.profiler import StepProfiler

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
        self.phase = "profiling"
        self.steps = 0
        self.fwd_calls = 0
        self.bwd_calls = 0
        self.step_times_s: list[float] = []
        self._fwd_start: float | None = None
        self._lock = threading.Lock()
        self._compiled = self._compile_profiling()

    # ----------------------------------------------------------------------------------- compiling
    def _compile_profiling(self) -> Callable[..., Any]:
        def on_partition(step: CapturedStep) -> None:
            self.profiler = StepProfiler(step, graph_id=self.graph_id)

        def fw_compiler(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
            return boxed(lambda *args: self.profiler.run_fwd(*args))

        def bw_compiler(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
            return boxed(lambda *args: self.profiler.run_bwd(*args), after=self._after_bwd)

        return aot_autograd(
            fw_compiler=fw_compiler,
            bw_compiler=bw_compiler,
            partition_fn=capturing_partition(on_partition),
            decompositions=_decompositions(self.cfg.inner),
        )(self.gm, self.example_inputs)

    def _compile_final(self) -> Callable[..., Any]:
        inner = self.cfg.inner

        def bw(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
            return boxed(inner_compiler(inner, is_backward=True)(gm, example_inputs), after=self._after_bwd)

        return aot_autograd(
            fw_compiler=inner_compiler(inner, is_backward=False),
            bw_compiler=bw,
            partition_fn=capturing_partition(lambda step: None),
            decompositions=_decompositions(inner),
        )(self.gm, self.example_inputs)

    # ------------------------------------------------------------------------------------- running
    def _after_bwd(self) -> None:
        self.bwd_calls += 1
        if self._fwd_start is not None:
            self.step_times_s.append(time.perf_counter() - self._fwd_start)
            self._fwd_start = None
        if self.phase == "profiling" and self.profiler.steps_recorded >= self.cfg.profile_steps:
            self._finish_profiling()

    def _finish_profiling(self) -> None:
        self.profile = self.profiler.build_profile({"inner": self.cfg.inner})
        self.backend._on_profile(self)
        self.phase = "compile_pending"

    def __call__(self, *args: Any) -> Any:
        with self._lock:
            if self.phase == "compile_pending":
                self._compiled = self._compile_final()
                self.phase = "running"
                self.step_times_s.clear()
            self.fwd_calls += 1
            self.steps += 1
            if torch.is_grad_enabled():
                self._fwd_start = time.perf_counter()
        return self._compiled(*args)


class TeraioBackend:
    """A configured backend: ``torch.compile(model, backend=teraio.backend(**options))``."""

    def __init__(self, **options: Any) -> None:
        self.cfg = BackendConfig(**options)
        self.runners: list[GraphRunner] = []
        self.run_dir = Path(self.cfg.run_dir) if self.cfg.run_dir else None
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.json").write_text(json.dumps(asdict(self.cfg), indent=2, default=str))

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

    def stats(self) -> dict[str, Any]:
        steps = max((r.steps for r in self.runners), default=0)
        times = [t for r in self.runners for t in r.step_times_s]
        return {
            "steps": steps,
            "graphs": len(self.runners),
            "step_s": statistics.median(times) if times else None,
            "phase": [r.phase for r in self.runners],
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
