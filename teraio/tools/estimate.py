"""Estimate a training step on hardware this machine does not have, without materialising a weight.

Users decide before they buy SSDs or book GPUs: with this model, batch and hardware, what peak, what
step time, how many drives. ``teraio estimate`` answers from the real training graph: the model and its
batch are built inside a ``FakeTensorMode`` (every tensor is metadata: a 70B-parameter model costs a few
hundred MB of Python objects), torch.compile traces it, and the captured graphs go through AOTAutograd
and the very partitioner hook the backend uses (``teraio.graph.compilers.capture_step``), stopped before code
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
import logging
import os
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

import torch
import torch.nn.functional as F
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from teraio.errors import CaptureError, UserInputError
from teraio.graph.capture import CapturedStep, StepAnalysis
from teraio.graph.compilers import InnerCompiler, capture_step
from teraio.graph.kernel_boundaries import granularity_for
from teraio.planner.costmodel import ComputeModel, Preset
from teraio.planner.hardware import HardwareModel
from teraio.planner.lifetimes import analyse
from teraio.planner.model_states import OPTIMIZERS, ModelStates, Optimizer, Precision
from teraio.planner.profile import Profile
from teraio.planner.whatif import PlanOutcome
from teraio.profiling.op_timing import GraphRun, StepProfiler, classify_inputs
from teraio.tools.workloads import BUILTIN_PREFIX

log = logging.getLogger("teraio")

HF_PREFIX = "hf:"
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
DType = Literal["float32", "bfloat16", "float16"]
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

#: Published dimensions of the Hugging Face models a target may name (their config.json files), built
#: from transformers config objects: nothing is downloaded.
HF_MODELS: dict[str, dict[str, Any]] = {
    # meta-llama/Meta-Llama-3-8B
    "llama-8b": {
        "family": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    },
    # meta-llama/Meta-Llama-3-70B
    "llama-70b": {
        "family": "llama",
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    },
    # openai-community/gpt2-xl
    "gpt2-xl": {
        "family": "gpt2",
        "n_embd": 1600,
        "n_layer": 48,
        "n_head": 25,
        "n_positions": 1024,
        "vocab_size": 50257,
    },
    # google-t5/t5-3b (DeepSpeed's memory-estimator example)
    "t5-3b": {
        "family": "t5",
        "d_model": 1024,
        "d_ff": 16384,
        "num_layers": 24,
        "num_heads": 32,
        "d_kv": 128,
        "vocab_size": 32128,
        "decoder_start_token_id": 0,
        "pad_token_id": 0,
    },
}
#: The config key holding each family's layer count (for ``layers=``) and its default sequence length.
_LAYER_KEY = {"llama": "num_hidden_layers", "gpt2": "n_layer", "t5": "num_layers"}
_DEFAULT_SEQ = {"llama": 4096, "gpt2": 1024, "t5": 512}


@dataclass
class EstimateTarget:
    """A model and its batch, built as fake tensors (metadata only), and how the step computes its loss."""

    name: str
    model: torch.nn.Module
    batch: Any
    fake_mode: Any
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    #: What was built: the config's dimensions, batch, sequence length, dtype (for the estimate's meta).
    settings: dict[str, Any] = field(default_factory=dict)


class _CausalLMLoss(torch.nn.Module):
    """A causal LM returning the mean next-token cross-entropy from its logits, in one graph (the model's
    own loss path can break the graph: a logging call in GPT-2's); logits in fp32, as HF's loss does."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=input_ids, use_cache=False).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class _Seq2SeqLoss(torch.nn.Module):
    """An encoder-decoder model whose loss comes from ``labels`` (T5 captures in one graph with them)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels, use_cache=False).loss


def _positive(value: int | None, option: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise UserInputError(f"{option} must be a positive integer, got {value!r}")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build parameters in ``dtype`` directly (``Module.to`` cannot swap fake parameters in place)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def hf_config(name: str, *, layers: int | None = None) -> Any:
    """The transformers config object of a named model (``HF_MODELS``), optionally with fewer layers.

    Raises:
        UserInputError: an unknown name (the message lists the known ones), or transformers missing.
    """
    if name not in HF_MODELS:
        raise UserInputError(
            f"unknown Hugging Face model 'hf:{name}'; choose one of: {', '.join('hf:' + n for n in HF_MODELS)}"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # config objects only: never reach for the Hub
    try:
        import transformers
    except ImportError:
        raise UserInputError("hf: targets need the transformers package: pip install transformers") from None
    spec = dict(HF_MODELS[name])
    family = spec.pop("family")
    if layers is not None:
        spec[_LAYER_KEY[family]] = layers
    cls = {"llama": "LlamaConfig", "gpt2": "GPT2Config", "t5": "T5Config"}[family]
    return getattr(transformers, cls)(**spec)


def _hf_model(name: str, config: Any) -> torch.nn.Module:
    import transformers

    family = HF_MODELS[name]["family"]
    cls = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel", "t5": "T5ForConditionalGeneration"}[family]
    model = getattr(transformers, cls)(config)
    return _Seq2SeqLoss(model) if family == "t5" else _CausalLMLoss(model)


def build_target(
    target: str,
    *,
    batch: int | None = None,
    seq: int | None = None,
    dtype: DType | None = None,
    layers: int | None = None,
) -> EstimateTarget:
    """Build ``target`` inside a fresh FakeTensorMode: ``builtin:NAME``, ``hf:NAME`` or ``file.py:fn``.

    ``batch``, ``seq``, ``dtype`` and ``layers`` override the target's own (built-in and hf: targets; a
    file target builds its own model and batch, so they are refused for it).

    Raises:
        UserInputError: an unknown target or an option it does not take, with the remedy.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    for value, option in ((batch, "--batch"), (seq, "--seq"), (layers, "--layers")):
        _positive(value, option)
    if dtype is not None and dtype not in DTYPES:
        raise UserInputError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    torch_dtype = DTYPES[dtype or "float32"]
    if target.startswith(BUILTIN_PREFIX):
        from teraio.tools.models import CONFIGS, GPT, synthetic_batch

        name = target[len(BUILTIN_PREFIX) :]
        if name not in CONFIGS:
            raise UserInputError(
                f"unknown built-in workload '{target}'; choose from "
                + ", ".join(f"builtin:{c}" for c in CONFIGS)
            )
        cfg = replace(
            CONFIGS[name],
            **{k: v for k, v in (("batch", batch), ("seq", seq), ("layers", layers)) if v is not None},
        )
        with mode, _default_dtype(torch_dtype):
            model = GPT(cfg)
            tokens = synthetic_batch(cfg)
        settings = {**cfg.to_dict(), "dtype": str(torch_dtype).removeprefix("torch.")}
        return EstimateTarget(target, model, tokens, mode, settings=settings)
    if target.startswith(HF_PREFIX):
        name = target[len(HF_PREFIX) :]
        config = hf_config(name, layers=layers)
        family = HF_MODELS[name]["family"]
        b, s = batch or 1, seq or _DEFAULT_SEQ[family]
        max_positions = getattr(config, "max_position_embeddings", getattr(config, "n_positions", None))
        if family != "t5" and max_positions is not None and s > max_positions:
            raise UserInputError(
                f"--seq {s} exceeds hf:{name}'s {max_positions} positions; choose --seq {max_positions} or less"
            )
        with mode, _default_dtype(torch_dtype):
            model = _hf_model(name, config)
            ids = torch.randint(0, config.vocab_size, (b, s))
            labels = torch.randint(0, config.vocab_size, (b, s))
        settings = {
            **{k: v for k, v in HF_MODELS[name].items() if k != "family"},
            "family": family,
            **({_LAYER_KEY[family]: layers} if layers is not None else {}),
            "batch": b,
            "seq": s,
            "dtype": str(torch_dtype).removeprefix("torch."),
        }
        return EstimateTarget(target, model, (ids, labels), mode, settings=settings)
    given = [
        o for v, o in ((batch, "--batch"), (seq, "--seq"), (dtype, "--dtype"), (layers, "--layers")) if v
    ]
    if given:
        raise UserInputError(
            f"{', '.join(given)} apply to builtin: and hf: targets; '{target}' builds its own model and batch"
        )
    from teraio.tools.workloads import load_workload

    with mode:
        work = load_workload(target)  # the user's function runs inside the fake mode: nothing is allocated
    return EstimateTarget(target, work.model, work.batch, mode, loss_fn=work.loss_fn, settings={})


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(parameters, parameters of the largest module on its own): shared parameters once, as DeepSpeed's
    estimator counts them (``model_to_params``), by identity rather than address (fake tensors have none)."""
    total = sum(p.numel() for p in model.parameters())  # parameters() yields a shared one once
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return int(total), int(largest)


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
    gradients that stream off the device as backward produces them.
    """
    nodes = list(gm.graph.nodes)
    last_user: dict[fx.Node, fx.Node] = {}
    for node in reversed(nodes):
        for inp in node.all_input_nodes:
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


# ------------------------------------------------------------------------------------------ the whole
StatesMode = Literal["auto", "resident", "streamed"]
STATES_MODES: tuple[str, ...] = get_args(StatesMode)
#: Model-state precision for each compute dtype (teraio.planner.model_states).
_PRECISION_OF_DTYPE: dict[str, Precision] = {
    "float32": "fp32",
    "bfloat16": "bf16-mixed",
    "float16": "fp16-mixed",
}
ESTIMATE_SCHEMA_VERSION = 1


@dataclass
class EstimateResult:
    """Everything ``teraio estimate`` found: the estimated profiles, the model states, each graph's plans."""

    target: str
    preset: Preset
    #: The HardwareModel planned for: the preset's, with ``ssds`` / ``ssd_bw_bytes_per_s`` applied.
    hardware: HardwareModel
    settings: dict[str, Any]
    num_params: int
    largest_layer_params: int
    #: This device's share of the model states.
    states: ModelStates
    states_mode: str
    states_note: str
    #: The activation budget as planned: bytes, or the text given ("40%", "auto").
    budget: int | str
    budget_note: str
    graphs: list[EstimatedGraph]
    outcomes: list[list[PlanOutcome]]  # per graph, one per solver
    capture_s: float
    profile_s: float
    plan_s: float

    def state_traffic(self) -> dict[str, Any]:
        """Per step, the model-state bytes this device reads and writes where they live (streamed only)."""
        from teraio.planner.model_states import streamed_traffic

        if self.states_mode != "streamed":
            return {}
        return {
            k: {"read_bytes": t.read_nbytes, "write_bytes": t.write_nbytes}
            for k, t in streamed_traffic(self.states).items()
        }

    def summary(self) -> dict[str, Any]:
        """The JSON ``teraio estimate --json`` prints (and writes as estimate.json)."""
        traffic = self.state_traffic()
        state_bytes = sum(v["read_bytes"] + v["write_bytes"] for v in traffic.values())
        ssd = self.hardware.tier("ssd")
        graphs = []
        for g, outcomes in zip(self.graphs, self.outcomes):
            p = g.profile
            lt = analyse(p)
            rows = []
            for o in outcomes:
                row = o.summary()
                if o.plan is not None:
                    moved = o.plan.moved_bytes
                    io_s = io_seconds(moved, moved, traffic, ssd)
                    row["total_ssd_bytes_per_step"] = 2 * moved + state_bytes
                    row["total_io_s"] = io_s
                    # Streamed states' transfers are not scheduled by the plan: the step cannot be shorter
                    # than the SSDs take to move everything, so this bounds the fraction of ideal from above.
                    row["fraction_of_ideal_bound_with_states"] = (
                        o.ideal_step_s / max(o.plan.predicted_step_s, io_s)
                        if o.plan.predicted_step_s > 0
                        else None
                    )
                    row["average_ssd_bw_needed_bytes_per_s"] = (
                        (2 * moved + state_bytes) / o.ideal_step_s if o.ideal_step_s > 0 else None
                    )
                rows.append(row)
            graphs.append(
                {
                    "graph_id": p.meta.get("graph_id", 0),
                    "fwd_ops": p.num_fwd_ops,
                    "bwd_ops": len(p.ops) - p.num_fwd_ops,
                    "fx_ops": g.ops,
                    "saved_tensors": len(p.tensors),
                    "activation_bytes": p.activation_bytes(),
                    "unplanned_peak_bytes": int(lt.baseline_peak_bytes),
                    "smallest_peak_bytes": int(lt.min_feasible_peak_bytes),
                    "flops": g.flops,
                    "compute_s": float(p.ops["duration_us"].sum()) / 1e6,
                    "plans": rows,
                }
            )
        return {
            "estimate_schema_version": ESTIMATE_SCHEMA_VERSION,
            "target": self.target,
            "hardware": self.preset.name,
            "hardware_model": self.hardware.name,
            "device": f"estimate:{self.preset.name}",
            "settings": self.settings,
            "num_params": self.num_params,
            "largest_layer_params": self.largest_layer_params,
            "model_states": self.states.to_dict(),
            "states_mode": self.states_mode,
            "states_note": self.states_note,
            "state_traffic_per_step": traffic,
            "budget": self.budget,
            "budget_note": self.budget_note,
            "ssd_aggregate_bw_bytes_per_s": ssd.total_write_bw_bytes_per_s,
            "graphs": graphs,
            "capture_s": self.capture_s,
            "profile_s": self.profile_s,
            "plan_s": self.plan_s,
        }

    def write(self, out: str | os.PathLike, *, force: bool = False) -> Any:
        """Write estimate.json, hardware.json, profile/ and one plan per solver into ``out`` through the
        safe writer (``planner.safe_io.replace_dir``: built aside, renamed into place)."""
        import json
        from pathlib import Path

        from teraio.planner.safe_io import replace_dir

        summary = self.summary()
        plan_files = []
        for gi, outcomes in enumerate(self.outcomes):
            for o in outcomes:
                if o.plan is not None:
                    suffix = f"-graph{gi}" if len(self.graphs) > 1 else ""
                    plan_files.append((f"plan-{o.solver}{suffix}.json", o.plan))
        summary["plan_files"] = [name for name, _ in plan_files]

        def populate(staged: Path) -> None:
            prof_dir = staged / "profile"
            prof_dir.mkdir()
            if len(self.graphs) == 1:
                self.graphs[0].profile.validate().write_files(prof_dir)
            else:
                names = []
                for g in self.graphs:
                    sub = prof_dir / f"graph{g.profile.meta['graph_id']}"
                    sub.mkdir()
                    g.profile.validate().write_files(sub)
                    names.append(sub.name)
                (prof_dir / "index.json").write_text(json.dumps({"graphs": names}))
            (staged / "hardware.json").write_text(json.dumps(self.hardware.to_dict(), indent=2))
            for name, plan in plan_files:
                (staged / name).write_text(plan.to_json())
            (staged / "estimate.json").write_text(json.dumps(summary, indent=2, default=str))

        return replace_dir(out, "estimate", populate, force=force)


def io_seconds(written: int, read: int, traffic: dict[str, Any], ssd: Any) -> float:
    """Seconds the SSD tier needs for a step's bytes: activations written and read, plus streamed states."""
    w = written + sum(v["write_bytes"] for v in traffic.values())
    r = read + sum(v["read_bytes"] for v in traffic.values())
    if ssd.shared_channel:
        return w / ssd.total_write_bw_bytes_per_s + r / ssd.total_read_bw_bytes_per_s
    return max(w / ssd.total_write_bw_bytes_per_s, r / ssd.total_read_bw_bytes_per_s)


def run_estimate(
    target: str,
    hardware: str,
    *,
    batch: int | None = None,
    seq: int | None = None,
    dtype: DType | None = None,
    layers: int | None = None,
    gpus: int = 1,
    zero_stage: int | None = None,
    optimizer: Optimizer = "adamw",
    states: StatesMode = "auto",
    budget: str = "device",
    solvers: tuple[str, ...] = ("greedy", "ilp"),
    time_limit_s: float = 60.0,
    workers: int = 2,
    inner: InnerCompiler = "inductor",
    tf32: bool = False,
    ssds: int | None = None,
    ssd_bw_bytes_per_s: float | None = None,
    deterministic_time_s: float | None = None,
    bandwidth: bool = True,
) -> EstimateResult:
    """Capture ``target`` with fake tensors, estimate its profile on preset ``hardware``, account its model
    states and plan it with each of ``solvers`` (what ``teraio estimate`` runs; docs/cli.md).

    ``budget="device"``: the preset's device memory less what the model states hold there (resident:
    parameters, optimizer states and a gathered layer; streamed: the gathered layer), or "auto" when the
    preset has no device memory figure. ``states="auto"``: resident when this device's share of all model
    states fits in its memory, else streamed (gradients then leave the device as they are produced).

    Raises:
        UserInputError: a bad option, target or budget (one line, with the remedy).
        CostModelError: an unknown preset.
    """
    import time

    from teraio.planner.budget import BudgetError, format_size, resolve_budget
    from teraio.planner.costmodel import load_preset
    from teraio.planner.model_states import STATE_KINDS, ModelStateError, model_states
    from teraio.planner.solve import solver_info
    from teraio.planner.whatif import plan_outcomes

    if states not in STATES_MODES:
        raise UserInputError(f"--states must be one of {', '.join(STATES_MODES)}, got {states!r}")
    if optimizer not in OPTIMIZERS:
        raise UserInputError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    _positive(gpus, "--gpus")
    stage = zero_stage if zero_stage is not None else (3 if gpus > 1 else 0)
    if stage not in (0, 1, 2, 3):
        raise UserInputError(f"--zero-stage must be 0, 1, 2 or 3, got {stage!r}")
    for name in solvers:
        solver_info(name)  # UnknownSolverError (a PlanError: one line) before any tracing
    if budget != "device":
        try:
            resolve_budget(budget, 1)
        except BudgetError as e:
            raise UserInputError(f"--budget: {e}") from None
    preset = load_preset(hardware)
    hw = preset.hardware_with(ssds=ssds, ssd_bw_bytes_per_s=ssd_bw_bytes_per_s)

    t0 = time.perf_counter()
    built = build_target(target, batch=batch, seq=seq, dtype=dtype, layers=layers)
    num_params, largest = count_parameters(built.model)
    captured = capture_graphs(built, inner)
    capture_s = time.perf_counter() - t0

    precision = _PRECISION_OF_DTYPE.get(built.settings.get("dtype", "float32"), "fp32")

    def states_with(offload: tuple[str, ...]) -> ModelStates:
        """This device's share of the model states, ``offload`` kinds kept off the device."""
        try:
            return model_states(
                num_params,
                largest_layer_params=largest,
                precision=precision,
                optimizer=optimizer,
                gpus=gpus,
                zero_stage=stage,
                offload=offload,
            )
        except ModelStateError as e:
            raise UserInputError(str(e)) from None

    all_resident = states_with(())
    device_nbytes = preset.compute.device_memory_bytes
    mode = states
    if mode == "auto":
        mode = (
            "resident" if device_nbytes is None or all_resident.device_nbytes < device_nbytes else "streamed"
        )
    if mode == "resident":
        st = all_resident
        note = (
            "parameters and optimizer states stay on the device; gradients accumulate there as backward "
            "produces them (counted in the profile's memory, in full: a ZeRO reduce-scatter is not modelled)"
        )
    else:
        st = states_with(STATE_KINDS)
        note = (
            "model states live on the SSDs and stream through the device (whole-state offload): the device "
            "holds the largest layer's gathered parameters and gradients, and each gradient leaves as "
            "backward produces it; their transfers are accounted, not scheduled by the plans"
        )
        if states == "auto":
            note = (
                f"this device's share of the model states ({format_size(all_resident.device_nbytes)}) does not "
                f"fit its {format_size(device_nbytes or 0)}: " + note
            )
    held = st.param_nbytes + st.optimizer_state_nbytes + st.gathered_nbytes
    planned_budget: int | str
    if budget == "device":
        if device_nbytes is None:
            planned_budget = "auto"
            budget_note = f"{preset.name} has no device memory figure: the smallest stall-free peak"
        else:
            planned_budget = max(1, device_nbytes - held)
            budget_note = f"the device's {format_size(device_nbytes)} less {format_size(held)} of model states held there"
    else:
        planned_budget, budget_note = budget, "as given"

    t1 = time.perf_counter()
    device = f"estimate:{preset.name}"
    extra = {
        "preset": preset.name,
        "hardware_model": hw.name,
        "target": target,
        "settings": built.settings,
        "compute": preset.compute.to_dict(),
        "num_params": num_params,
        "states_mode": mode,
    }
    graphs = [
        estimated_profile(
            g,
            preset.compute,
            inner,
            device=device,
            tf32=tf32,
            grads_stream=mode == "streamed",
            extra_meta=extra,
        )
        for g in captured
    ]
    profile_s = time.perf_counter() - t1
    if len(graphs) > 1:
        log.warning(
            "%s: %d graphs (graph breaks); each is planned on its own under the whole budget",
            target,
            len(graphs),
        )
    t2 = time.perf_counter()
    outcomes = [
        plan_outcomes(
            g.profile,
            hw,
            planned_budget,
            solvers,
            time_limit_s=time_limit_s,
            workers=workers,
            deterministic_time_s=deterministic_time_s,
            bandwidth=bandwidth,
        )
        for g in graphs
    ]
    plan_s = time.perf_counter() - t2
    settings = {
        **built.settings,
        "inner": inner,
        "gpus": gpus,
        "zero_stage": stage,
        "optimizer": optimizer,
        "precision": precision,
        "tf32": tf32,
        "solvers": list(solvers),
        "time_limit_s": time_limit_s,
    }
    return EstimateResult(
        target=target,
        preset=preset,
        hardware=hw,
        settings=settings,
        num_params=num_params,
        largest_layer_params=largest,
        states=st,
        states_mode=mode,
        states_note=note,
        budget=planned_budget,
        budget_note=budget_note,
        graphs=graphs,
        outcomes=outcomes,
        capture_s=capture_s,
        profile_s=profile_s,
        plan_s=plan_s,
    )
