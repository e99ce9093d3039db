"""How a captured graph is compiled: the FX-only path and Inductor, both with teraio's partitioner hook.

A training graph goes through AOTAutograd, which traces forward and backward together (the joint graph)
and hands it to a partitioner that splits it into a forward and a backward graph. teraio's work
(profiling what the forward saves, inserting migration ops) happens on the partitioned graphs, so both
paths put teraio's hook at the partitioner and leave everything else to the compiler:

- ``eager`` (the FX-only path): AOTAutograd with the default min-cut partitioner; the partitioned
  graphs run as plain GraphModules, bit-identical to eager aten.
- ``inductor``: Inductor's own ``compile_fx``, with the hook installed as Inductor's
  ``custom_partitioner_fn``. Inductor's joint-graph passes (random-op replacement, pattern passes) run
  before the hook exactly as with ``backend="inductor"``, so the graph teraio profiles and rewrites is
  the one Inductor compiles. Profiling passes an ``inner_compile`` that interprets the partitioned
  graphs instead of generating code.

Note: [Partitioner identity in compile caches]
    Inductor and AOTAutograd cache compiled code across processes, keyed by the graph and the
    partitioner's ``uuid()``. A uuid that did not change with the plan would serve yesterday's code
    (with yesterday's migration ops, or none) without calling the partitioner at all. The uuid hashes
    the plan's digest, the phase, and the source of the modules that shape the rewritten graph.
    Profiling compiles never use the AOTAutograd cache: their "compiled" functions are interpreters.

Note: [teraio's compiles bypass the compile caches]
    Inductor's FX graph cache pickles its config into the cache key, and the partitioner holds the
    backend's live hook, which does not pickle: each compile logged a traceback ("Failed to pickle
    cache key") and then bypassed the cache, so no teraio compile was ever served from it (nor from
    the AOTAutograd cache, whose entries point at FX graph cache entries). teraio now turns both off
    for its own compiles, which keeps that behaviour without the traceback. Caching them would need
    more than a picklable partitioner: a hit skips the partitioner, and with it the hook that checks
    the plan against the graph and records the rewrite the runner's invocations rely on.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from torch import fx

from teraio.graph.capture import CapturedStep

InnerCompiler = Literal["inductor", "eager"]
INNER_COMPILERS: tuple[InnerCompiler, ...] = ("inductor", "eager")

#: Called with the partitioned graphs; returns rewritten ones or None to keep them.
OnPartition = Callable[[CapturedStep], CapturedStep | None]
#: Compiles one partitioned graph: (graph, example inputs, is_backward, kernels) -> boxed callable, where
#: ``kernels`` is the same graph as the compiler's own code (boxed), for the calibration steps, or None
#: (the FX-only path runs the graph itself). Note: [Calibrating on the compiler's own code]
GraphCompiler = Callable[[fx.GraphModule, list[Any], bool, Callable[..., Any] | None], Callable[..., Any]]

#: The modules whose code decides what a rewritten graph contains, by import name: the compile-cache
#: identity follows a module wherever its file lives, and a name that no longer resolves is an error.
_REWRITE_MODULES = (
    "teraio.graph.capture",
    "teraio.graph.rewrite",
    "teraio.graph.ops",
    "teraio.graph.compilers",
    "teraio.graph.buffer_reuse",
    "teraio.graph.kernel_boundaries",
    "teraio.graph.recompute",
    "teraio.lifecycle.steps",
)

# Note: [Inductor keeps the profiled order] Inductor may reorder a graph's nodes to lower its peak
# memory. teraio plans memory on the order it profiled, and a plan changes the lifetimes Inductor's
# estimate sees, so the reorder would move kernels across migration ops and fuse differently with a plan
# than without. teraio's plan is the memory schedule; a torch.compile mode does not change these, a
# user's explicit option still wins.
TERAIO_INDUCTOR_OPTIONS: dict[str, Any] = {"reorder_for_peak_memory": False}


def mode_options(mode: str | None) -> dict[str, Any]:
    """Inductor's options for torch.compile's ``mode``, without those teraio sets itself.

    torch.compile hands a custom backend its ``mode`` and applies it only to its own Inductor backend, so
    teraio translates it as Inductor does (``torch._inductor.list_mode_options``).

    Raises:
        RuntimeError: Inductor does not know ``mode``.
    """
    if not mode or mode == "default":
        return {}
    from torch._inductor import list_mode_options

    return {k: v for k, v in list_mode_options(mode).items() if k not in TERAIO_INDUCTOR_OPTIONS}


def source_digest() -> str:
    """A hash of the modules whose code decides what a rewritten graph contains."""
    h = hashlib.sha256()
    for name in _REWRITE_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise RuntimeError(f"source_digest: module {name} not found; update _REWRITE_MODULES")
        h.update(name.encode())
        h.update(Path(spec.origin).read_bytes())
    return h.hexdigest()


def fx_only_compiler(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    """The FX-only inner compiler: run the GraphModule as it is (bit-identical to eager aten).

    Boxed calling convention: the generated code clears its argument list, so saved tensors are freed
    after their last use in backward instead of living until the call returns.
    """
    from torch.fx.graph import _BoxedCodeGen

    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()
    return gm


class _GraphCode:
    """The code AOTAutograd calls for one partitioned training graph (boxed), replaceable later."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        # An instance attribute: Dynamo wraps the backward's code in a function that copies its __dict__.
        self._boxed_call = True

    def __call__(self, args: list[Any]) -> Any:
        return self.fn(args)


class RetainedTraining:
    """A training compile's partitioned graphs, as AOTAutograd holds them, and the code it calls for each,
    so that a plan can be put into them later without tracing the joint graph again (FX-only path).

    Note: [One trace per graph on the FX path]
        AOTAutograd traces a graph's forward and backward together and partitions them; the profiling
        compile and the compile with the plan each did that, and the trace and the partition are most
        of a planned graph's compile time (measured: benchmarks/results/suite_time_*). The plan is written into the partitioned graphs in place, and never changes the forward's
        outputs in number (Note in teraio.graph.rewrite), which is all AOTAutograd's runtime wrapper
        knows of them. So the profiling compile keeps the graphs AOTAutograd holds and hands it, for
        forward and backward, a :class:`_GraphCode` whose function the final compile replaces: the plan
        is applied to the same graph objects (AOTAutograd's lazily compiled backward and compiled
        autograd, which retraces AOTAutograd's own backward graph, see it too), each graph is compiled
        again as the FX-only compiler does, and the profiling compile's function is the final one. Used
        once, and only when no forward of the graph still waits for its backward (it saved what the
        profiling code saves, and its backward runs the code in place then: a loop with two forwards
        before one backward); the caller compiles anew whenever it cannot be used (that, several plans
        for one graph, a backward that never ran, a second plan, a plan for another partitioner ratio
        (the partitioner search may choose a ratio it profiled before the last), Inductor, which
        compiles with contexts of its own).

    Note: [A graph that runs without a plan keeps its calibration kernels]
        On Inductor, profiling compiles each training graph to the kernels the step would run without a
        plan (Note: [Calibrating on the compiler's own code]). A graph whose final plan moves nothing
        (``enabled=False``, or a budget it meets as it is) would be traced, partitioned and compiled again
        to the same kernels: with a plan, the compile is needed (the plan's ops go between kernels);
        without one, the profiling compile's code is pointed at those kernels instead (about 40% of such
        a run's CPU on the tiny GPT). Under the same conditions as the FX path's reuse: one plan for the
        graph, both graphs compiled, the same partitioner ratio, and no forward of the profiling code
        waiting for its backward (Inductor's kernels may save tensors in layouts of their own).
    """

    def __init__(self, partitioned_at: float | None = None) -> None:
        #: The partitioner's ``activation_memory_budget`` the graphs were partitioned at (None: the
        #: process's setting): a plan made at another ratio is for other graphs.
        self.partitioned_at = partitioned_at
        self.step: CapturedStep | None = None
        self.code: dict[bool, _GraphCode] = {}  # is_backward -> the code AOTAutograd calls
        #: is_backward -> Inductor's kernels for the unplanned graph (the calibration's), on Inductor.
        self.kernels: dict[bool, Callable[..., Any]] = {}
        self.used = False

    def wrap(self, is_backward: bool, fn: Callable[..., Any]) -> Callable[..., Any]:
        code = self.code[is_backward] = _GraphCode(fn)
        return code

    @property
    def ready(self) -> bool:
        """Both graphs compiled once (the backward is compiled at its first run) and not used yet."""
        return not self.used and self.step is not None and len(self.code) == 2

    @property
    def kernels_ready(self) -> bool:
        """Inductor: both graphs compiled, with their unplanned kernels, and not used yet."""
        return not self.used and len(self.code) == 2 and len(self.kernels) == 2

    def run_kernels(self) -> None:
        """From now on run Inductor's unplanned kernels, compiled while profiling, instead of the profiling
        code. Note: [A graph that runs without a plan keeps its calibration kernels]"""
        assert self.kernels_ready
        self.used = True
        for is_backward, code in self.code.items():
            code.fn = self.kernels[is_backward]
        self.kernels = {}

    def apply(self, on_partition: OnPartition) -> None:
        """Rewrite the graphs with ``on_partition`` (in place) and compile them again, FX-only."""
        assert self.ready and self.step is not None
        self.used = True  # also when the hook raises: the graphs may be half rewritten
        step = self.step
        result = on_partition(step)
        if result is not None and (result.fw_gm is not step.fw_gm or result.bw_gm is not step.bw_gm):
            raise RuntimeError("RetainedTraining: the partition hook must rewrite the graphs in place")
        self.code[False].fn = fx_only_compiler(step.fw_gm, [])
        # AOTAutograd compiles a copy of its backward graph, and keeps its own for compiled autograd.
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            bw = copy.deepcopy(step.bw_gm)
        self.code[True].fn = fx_only_compiler(bw, [])
        self.step = None


def _partition_base(
    joint: fx.GraphModule, joint_inputs: Any, partitioner_budget: float | None, **kwargs: Any
) -> tuple[Any, Any]:
    """The min-cut partitioner; at ``partitioner_budget`` (its ``activation_memory_budget``) when given,
    else at the process's setting. Note: [The partitioner's budget is part of the plan] in
    teraio.lifecycle.partitioner_search."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    if partitioner_budget is None:
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
    with torch._functorch.config.patch(activation_memory_budget=partitioner_budget):
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)


def _hooked(
    on_partition: OnPartition,
    partitioner_budget: float | None,
    joint: fx.GraphModule,
    joint_inputs: Any,
    retain: RetainedTraining | None = None,
    **kwargs: Any,
):
    fw_gm, bw_gm = _partition_base(joint, joint_inputs, partitioner_budget, **kwargs)
    step = CapturedStep(fw_gm, bw_gm, int(kwargs["num_fwd_outputs"]))
    result = on_partition(step) or step
    if retain is not None:  # Note: [One trace per graph on the FX path]
        retain.step = result
    return result.fw_gm, result.bw_gm


def _inductor_partitioner(on_partition: OnPartition, partitioner_budget: float | None, uuid: str) -> Any:
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    class TeraioPartitioner(CustomPartitionerFn):
        """Inductor's default partitioner followed by teraio's hook. Note: [Partitioner identity ...]"""

        def __call__(
            self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
        ) -> tuple[fx.GraphModule, fx.GraphModule]:
            return _hooked(on_partition, partitioner_budget, gm, joint_inputs, **kwargs)

        def uuid(self) -> str:
            return uuid

    return TeraioPartitioner()


def compile_graph(
    gm: fx.GraphModule,
    example_inputs: list[Any],
    inner: InnerCompiler,
    on_partition: OnPartition,
    *,
    identity: str,
    graph_compiler: GraphCompiler | None = None,
    inductor_options: dict[str, Any] | None = None,
    calibration_kernels: bool = False,
    partitioner_budget: float | None = None,
    retain: RetainedTraining | None = None,
) -> Callable[..., Any]:
    """Compile a Dynamo graph for training and inference with teraio's partitioner hook.

    Args:
        inner: "eager" (FX-only) or "inductor".
        on_partition: the hook; sees (and may rewrite) the partitioned training graphs.
        identity: what distinguishes this compile in compile caches (phase and plan digest).
        graph_compiler: replaces code generation for training graphs (profiling: an interpreter).
            Inference graphs (no_grad, no input requiring grad) are always compiled normally.
        inductor_options: Inductor config patches (``torch.compile``'s mode and options), for "inductor";
            they override ``TERAIO_INDUCTOR_OPTIONS``.
        calibration_kernels: with ``graph_compiler`` on "inductor", also compile each training graph to
            Inductor's kernels and hand them to ``graph_compiler``.
        partitioner_budget: the min-cut partitioner's ``activation_memory_budget`` (the share of the
            saved activations it keeps, recomputing the rest in backward); None: the process's setting.
        retain: keeps the training graphs' code for later: on "eager" with the graphs, for a plan (Note:
            [One trace per graph on the FX path]); on "inductor" with the calibration kernels, for running
            without a plan (Note: [A graph that runs without a plan keeps its calibration kernels]).

    Note: [Calibrating on the compiler's own code]
        The calibration steps time the partitioned graphs as the step will run them (Note: [Calibrated times]
        in teraio.profiling.op_timing). On the FX-only path that is the GraphModule itself. Inductor fuses the
        same graph into kernels that take a fraction of the GraphModule's time, so a profile calibrated on the
        GraphModule predicts the FX path's step, not Inductor's. So profiling with calibration steps compiles
        each training graph once more, to the kernels the step would run without a plan (a copy: Inductor's
        passes change the graph they compile, and the profile describes the graph as partitioned). A plan's
        migration ops leave those kernels as they are (Note: [Migration ops sit between kernels] in
        teraio.graph.kernel_boundaries).
    """
    if inner == "eager":
        from torch._dynamo.backends.common import aot_autograd

        def compile_train(is_backward: bool) -> Callable[..., Any]:
            def compile_one(g: fx.GraphModule, ex: list[Any]) -> Callable[..., Any]:
                if graph_compiler is not None:
                    fn = graph_compiler(g, ex, is_backward, None)
                else:
                    fn = fx_only_compiler(g, ex)
                return retain.wrap(is_backward, fn) if retain is not None else fn

            return compile_one

        return aot_autograd(
            fw_compiler=compile_train(False),
            bw_compiler=compile_train(True),
            inference_compiler=fx_only_compiler,
            partition_fn=lambda joint, inputs, **kw: _hooked(
                on_partition, partitioner_budget, joint, inputs, retain, **kw
            ),
        )(gm, example_inputs)

    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    from teraio.graph import buffer_reuse

    buffer_reuse.install()  # Note: [A dead buffer is not kept across a migration op]

    def inner_compile(g: fx.GraphModule, ex: Sequence[Any], **kwargs: Any) -> Any:
        if graph_compiler is None or kwargs.get("is_inference"):
            return compile_fx_inner(g, ex, **kwargs)
        kernels = None
        if calibration_kernels:  # Note: [Calibrating on the compiler's own code]
            kernels = compile_fx_inner(copy.deepcopy(g), ex, **kwargs)
        is_backward = bool(kwargs.get("is_backward"))
        fn = graph_compiler(g, list(ex), is_backward, kernels)
        if retain is None or kernels is None:
            return fn
        retain.kernels[is_backward] = kernels
        return retain.wrap(is_backward, fn)

    uuid = hashlib.sha256(f"{identity}:{partitioner_budget}:{source_digest()}".encode()).hexdigest()
    patches: dict[str, Any] = {
        **TERAIO_INDUCTOR_OPTIONS,  # Note: [Inductor keeps the profiled order]
        **(inductor_options or {}),
        "custom_partitioner_fn": _inductor_partitioner(on_partition, partitioner_budget, uuid),
        # Note: [teraio's compiles bypass the compile caches]
        "fx_graph_cache": False,
        "fx_graph_remote_cache": False,
    }
    with inductor_config.patch(patches), torch._functorch.config.patch(enable_autograd_cache=False):
        return compile_fx(gm, example_inputs, inner_compile=inner_compile)


class _Captured(Exception):  # noqa: N818 - control flow, never seen by a user
    def __init__(self, step: CapturedStep) -> None:
        super().__init__("captured")
        self.step = step


def capture_step(
    gm: fx.GraphModule,
    example_inputs: list[Any],
    inner: InnerCompiler,
    *,
    inductor_options: dict[str, Any] | None = None,
    partitioner_budget: float | None = None,
) -> CapturedStep | None:
    """The partitioned training graphs ``compile_graph`` would profile, without compiling them: tracing
    and the compiler's joint-graph passes run, code generation does not (the partitioner stops it).
    None when the graph has no backward (nothing requires grad)."""

    def stop(step: CapturedStep) -> CapturedStep | None:
        raise _Captured(step)

    try:
        compile_graph(
            gm,
            example_inputs,
            inner,
            stop,
            identity="capture",
            inductor_options=inductor_options,
            partitioner_budget=partitioner_budget,
        )
    except _Captured as done:
        return done.step
    except Exception as exc:  # torch wraps what a partitioner raises in its own errors on some paths
        cause: BaseException | None = exc
        while cause is not None:
            if isinstance(cause, _Captured):
                return cause.step
            cause = cause.__cause__ or cause.__context__
        raise
    return None
