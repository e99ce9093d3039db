"""A captured training step's Profile estimated from its graph alone: op costs from FLOPs and bytes, memory
from the graph's own bookkeeping.

The target's step is traced by torch.compile on fake tensors and each graph goes through AOTAutograd and
the very partitioner hook the backend uses (``teraio.graph.compilers.capture_step``), stopped before code
generation. So the saved tensors, their sizes, their producers and uses are exactly those a real profile
of the same model, batch and inner compiler records (``teraio.graph.capture.analyse_saved`` on the same
graphs; the graph fingerprint is the same too).

What a real profile measures is estimated instead:

- op durations: torch's flop counter gives each op's FLOPs (matmuls, convolutions, attention; with the
  CPU flash-attention kernels added, which it does not list), the tensors' shapes its bytes read and
  written, and ``planner.costmodel`` turns the two into a roofline duration on the chosen preset
  (assumptions in that module's docstring);
- the memory timeline: a census of the storages alive after each op, computed from the graph exactly as
  the profiling interpreter's census counts them (values freed after their last use, graph inputs not
  counted), without the memory an op allocates and frees inside itself (the interpreter measures that
  with the torch profiler; here it is 0).

The Profile is then built by the profiler's own code (``StepProfiler.build_profile``: segments, rebuild
recipes, every column), so it has the same schema as a measured one; its meta says ``device:
"estimate:<preset>"`` and carries the estimate's settings under ``estimate``.

The graph is traced for the CPU (fake CPU tensors): on a GPU, attention would run CUDA's flash or
memory-efficient kernel instead of the CPU flash kernel. Both save the same output and log-sum-exp (the
CUDA kernels also save two 8-byte RNG words), so the saved bytes agree to within those words.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from teraio.errors import CaptureError
from teraio.graph.capture import CapturedStep, StepAnalysis
from teraio.graph.compilers import InnerCompiler, capture_step
from teraio.graph.kernel_boundaries import granularity_for
from teraio.graph.ops import offload_token_bytes
from teraio.planner.costmodel import ComputeModel
from teraio.planner.profile import Profile
from teraio.profiling.op_timing import GraphRun, StepProfiler, classify_inputs, is_incoming_gradient
from teraio.tools.estimate_target import EstimateTarget

#: The columns of a Profile's ``tensors`` table that an estimate has exactly as a real profile of the same
#: model, batch and inner compiler has them (module docstring): what the tests and the benchmark compare.
SAVED_TENSOR_COLUMNS: tuple[str, ...] = (
    "name",
    "nbytes",
    "dtype",
    "kind",
    "offloadable",
    "producer_idx",
    "last_fwd_use_idx",
    "first_bwd_use_idx",
    "last_use_idx",
    "aliases",
)


# --------------------------------------------------------------------------------------------- capture
@dataclass
class CapturedGraph:
    """One graph torch.compile captured from the target, partitioned as the backend's hook sees it."""

    graph_id: int
    step: CapturedStep
    input_kinds: list[str]


@contextlib.contextmanager
def _dynamo_quiet() -> Iterator[None]:
    """A fresh Dynamo (no cached frames of earlier compiles in this process), reset again afterwards."""
    torch._dynamo.reset()
    try:
        yield
    finally:
        torch._dynamo.reset()


def capture_graphs(target: EstimateTarget, inner: InnerCompiler = "inductor") -> list[CapturedGraph]:
    """Trace one training step of ``target`` and capture each graph's partitioned forward and backward.

    Each graph Dynamo hands over is traced by AOTAutograd with ``inner``'s joint-graph passes and
    partitioned (``teraio.graph.compilers.capture_step``); its forward then runs on fake tensors so the step goes
    on to the next graph (after a graph break). Nothing runs backward: the backward graph is captured.

    Raises:
        CaptureError: no graph with a backward pass was captured.
    """
    captured: list[CapturedGraph] = []

    def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        step = capture_step(gm, example_inputs, inner)
        if step is not None:
            captured.append(CapturedGraph(len(captured), step, classify_inputs(list(example_inputs))))
        return gm.forward

    from teraio.tools.workloads import Workload, compute_loss

    with _dynamo_quiet():
        compiled = torch.compile(target.model, backend=backend)
        work = Workload(name=target.name, model=compiled, batch=target.batch, loss_fn=target.loss_fn)
        with target.fake_mode:
            compute_loss(compiled, work)
    if not captured:
        raise CaptureError(
            f"{target.name}: no graph was captured with a backward pass; does the loss require grad?"
        )
    return captured


# ------------------------------------------------------------------------------------------ op costs
def flop_formulas() -> dict[Any, Callable[..., int]]:
    """torch's flop formulas by op packet, plus the CPU flash-attention kernels it does not list (the
    same counts as the CUDA flash kernels': query, key, value lead the forward's arguments, and the
    output gradient, query, key, value the backward's)."""
    from torch.utils.flop_counter import flop_registry

    aten = torch.ops.aten
    formulas = dict(flop_registry)
    formulas[aten._scaled_dot_product_flash_attention_for_cpu] = flop_registry[
        aten._scaled_dot_product_flash_attention
    ]
    formulas[aten._scaled_dot_product_flash_attention_for_cpu_backward] = flop_registry[
        aten._scaled_dot_product_flash_attention_backward
    ]
    return formulas


@dataclass(frozen=True)
class OpWork:
    """What one op does, for the roofline: FLOPs, bytes read and written, the dtype of its math, and
    whether it launches a kernel at all (a view or a tuple access does not)."""

    flops: int
    nbytes: int
    dtype: str
    kernel: bool


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def _tensor_nbytes(t: Any) -> int:
    return int(t.numel() * t.element_size()) if isinstance(t, torch.Tensor) else 0


def _is_view(node: fx.Node) -> bool:
    """The op returns an alias of an input (schema alias info): metadata only, no data moves."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return not isinstance(target, torch._ops.HigherOrderOperator)  # getitem and friends
    # A view's returns alias an input without writing it; an in-place op's alias it and write it (data moves).
    return any(r.alias_info is not None and not r.alias_info.is_write for r in target._schema.returns)


def op_work(node: fx.Node, formulas: dict[Any, Callable[..., int]], *, tf32: bool = False) -> OpWork:
    """The FLOPs and bytes of one call_function node, from its fake values (module docstring)."""
    out_val = _val(node)
    if _is_view(node):
        return OpWork(0, 0, "float32", kernel=False)
    inputs = [v for v in (_val(a) for a in node.all_input_nodes) if isinstance(v, torch.Tensor)]
    outputs = [v for v in tree_leaves(out_val) if isinstance(v, torch.Tensor)]
    nbytes = sum(_tensor_nbytes(t) for t in inputs) + sum(_tensor_nbytes(t) for t in outputs)
    flops = 0
    packet = getattr(node.target, "overloadpacket", None)
    formula = formulas.get(packet) if packet is not None else None
    if formula is not None:
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), _val)
        flops = int(formula(*args, **kwargs, out_val=out_val))
    ref = inputs[0] if inputs else (outputs[0] if outputs else None)
    dtype = str(ref.dtype).removeprefix("torch.") if ref is not None else "float32"
    if dtype == "float32" and tf32 and flops:
        dtype = "tf32"
    elif dtype not in ("float32", "bfloat16", "float16"):
        dtype = "float32"  # integer and other ops have no FLOPs: the dtype only names a rate
    return OpWork(flops, nbytes, dtype, kernel=True)


# ------------------------------------------------------------------------------------------ memory
def storages_of(value: Any) -> list[tuple[StorageWeakRef, int]]:
    out = []
    for t in tree_leaves(value):
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            out.append((StorageWeakRef(st), int(st.nbytes())))
    return out


def static_census(
    gm: fx.GraphModule, excluded: set[StorageWeakRef], passing: frozenset[StorageWeakRef] = frozenset()
) -> list[int]:
    """Bytes of the storages alive after each op of ``gm``, as the profiling interpreter counts them.

    The interpreter (``teraio.profiling.op_timing.TimingInterpreter``, ``garbage_collect_values=True``) keeps each
    value until the node that uses it last has run and counts, after each op, every storage its values
    hold once, without ``excluded`` (the graph's inputs that existed before the step). This replays that
    bookkeeping on the graph's fake values; a value nothing uses stays to the end, as there.

    ``passing`` storages are counted only at the ops whose values hold them and leave right after:
    gradients that stream off the device as backward produces them. A backward's incoming gradients stay
    to its end (Note: [A backward's incoming gradients live until it returns] in
    teraio.profiling.op_timing).
    """
    nodes = list(gm.graph.nodes)
    last_user: dict[fx.Node, fx.Node] = {}
    for node in reversed(nodes):
        for inp in node.all_input_nodes:
            if not is_incoming_gradient(inp):
                last_user.setdefault(inp, node)
    freed_after: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for value, user in last_user.items():
        freed_after[user].append(value)
    holders: dict[StorageWeakRef, int] = defaultdict(int)  # values in the environment per storage
    size: dict[StorageWeakRef, int] = {}
    held: dict[fx.Node, list[StorageWeakRef]] = {}
    live_nbytes = 0
    census: list[int] = []
    for node in nodes:
        refs = []
        passing_nbytes = 0
        for ref, nbytes in dict(storages_of(_val(node))).items():
            if ref in excluded:
                continue
            if ref in passing:
                passing_nbytes += nbytes
                continue
            refs.append(ref)
            if holders[ref] == 0:
                size[ref] = nbytes
                live_nbytes += nbytes
            holders[ref] += 1
        held[node] = refs
        if node.op == "call_function":
            census.append(live_nbytes + passing_nbytes)
        for gone in freed_after.get(node, ()):
            for ref in held.pop(gone, ()):
                holders[ref] -= 1
                if holders[ref] == 0:
                    live_nbytes -= size[ref]
    return census


def gradient_storages(step: CapturedStep, input_kinds: list[str]) -> frozenset[StorageWeakRef]:
    """The storages of the parameters' gradients: backward's outputs, one per forward input in order."""
    out = next(n for n in reversed(step.bw_gm.graph.nodes) if n.op == "output")
    grads = out.args[0] if isinstance(out.args[0], (list, tuple)) else (out.args[0],)
    return frozenset(
        ref
        for grad, kind in zip(grads, input_kinds)
        if kind == "param" and isinstance(grad, fx.Node)
        for ref, _ in storages_of(_val(grad))
    )


def _excluded_storages(
    step: CapturedStep, a: StepAnalysis
) -> tuple[set[StorageWeakRef], set[StorageWeakRef]]:
    """The storages each graph's census leaves out: the forward's inputs, and in backward the saved
    values that are those inputs (parameters, the batch) or views of them."""
    fwd = {ref for n in step.fw_gm.graph.nodes if n.op == "placeholder" for ref, _ in storages_of(_val(n))}
    bwd: set[StorageWeakRef] = set()
    for ph, g in zip(step.bw_saved_placeholders, a.saved_group_of):
        if g is not None and a.groups[g].placeholder is not None:
            bwd.update(ref for ref, _ in storages_of(_val(ph)))
    return fwd, bwd


# ------------------------------------------------------------------------------------------ profile
@dataclass
class EstimatedGraph:
    """One graph's estimated Profile and the totals behind its op durations."""

    profile: Profile
    flops: int
    kernel_nbytes: int
    ops: int


def estimated_profile(
    graph: CapturedGraph,
    compute: ComputeModel,
    inner: InnerCompiler,
    *,
    device: str,
    tf32: bool = False,
    grads_stream: bool = False,
    extra_meta: dict[str, Any] | None = None,
) -> EstimatedGraph:
    """The Profile of one captured graph with roofline op durations on ``compute`` and the static census
    as its memory timeline, built by the profiler's own code (module docstring).

    ``grads_stream``: the parameters' gradients leave the device as backward produces them (whole-state
    offload streams them to the SSDs), so the memory timeline holds each only at the ops that make it;
    otherwise they accumulate on the device until the step ends, as in a measured profile."""
    prof = StepProfiler(graph.step, graph_id=graph.graph_id, device="cpu", granularity=granularity_for(inner))
    prof.input_kinds = graph.input_kinds
    a = prof.analysis
    formulas = flop_formulas()
    works = [op_work(n, formulas, tf32=tf32) for n in (*a.fw_ops, *a.bw_ops)]
    ns = [round(compute.op_seconds(w.flops, w.nbytes, w.dtype, kernel=w.kernel) * 1e9) for w in works]
    fwd_excluded, bwd_excluded = _excluded_storages(graph.step, a)
    nf = len(a.fw_ops)
    fwd_live = static_census(graph.step.fw_gm, fwd_excluded)
    passing = gradient_storages(graph.step, graph.input_kinds) if grads_stream else frozenset()
    bwd_live = static_census(graph.step.bw_gm, fwd_excluded | bwd_excluded, passing)
    fwd = GraphRun(
        duration_ns=ns[:nf], live_bytes=fwd_live, transient_bytes=[0] * nf, wall_s=sum(ns[:nf]) / 1e9
    )
    bwd = GraphRun(
        duration_ns=ns[nf:],
        live_bytes=bwd_live,
        transient_bytes=[0] * len(a.bw_ops),
        wall_s=sum(ns[nf:]) / 1e9,
    )
    prof.record_step(fwd, bwd)
    meta = {
        "inner": inner,
        "device": device,
        # Note: [An offloaded tensor leaves a token] in planner.lifetimes: of the target device.
        "offload_token_bytes": offload_token_bytes(device),
        "memory_from": "census",
        "memory_note": "estimated: the static census of the captured graphs, without in-op temporaries",
        "estimate": {
            **(extra_meta or {}),
            "flops": int(sum(w.flops for w in works)),
            "kernel_nbytes": int(sum(w.nbytes for w in works if w.kernel)),
            "tf32": tf32,
            "grads_stream": grads_stream,
        },
    }
    profile = prof.build_profile(meta)
    return EstimatedGraph(
        profile=profile,
        flops=int(sum(w.flops for w in works)),
        kernel_nbytes=int(sum(w.nbytes for w in works if w.kernel)),
        ops=len(works),
    )
