"""Training loops as users write them, and small models to run them on, for the exactness matrix.

A *case* is a model builder plus a batch function; a *pattern* is what one optimizer step does with the
compiled model (validation between steps, a forward never backpropagated, two forwards then one
backward, gradient accumulation, changing shapes, autocast). ``run`` trains a fresh copy with a backend
and records what must be bit-identical across backends: every loss and every gradient, and the
parameters at the end. The last step's forward+backward is measured with the torch profiler (outside
the backend's own books), to compare with the step budget the backend planned for: memory that
exists before the step (parameters, gradients, optimizer state) is not part of what a budget bounds.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import io
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import teraio
from teraio.lifecycle.backend import Phase, TeraioBackend
from teraio.profiling.measure import MemoryRecorder
from teraio.tools.models.gpt import GPT, GPTConfig

from .shared import once_per_run


# ------------------------------------------------------------------------------------------- models
class GPTLoss(nn.Module):
    """The built-in GPT's blocks with options a user's model might have."""

    def __init__(self, dropout: float = 0.0, graph_break: bool = False, checkpointed: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gpt = GPT(GPTConfig(layers=2, hidden=32, heads=2, seq=32, batch=2, vocab=64, dropout=dropout))
        self.graph_break = graph_break
        self.checkpointed = checkpointed
        self.log = io.StringIO()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        g = self.gpt
        x = g.tok(idx) + g.pos(torch.arange(idx.shape[1], device=idx.device))
        first, second = g.blocks
        x = first(x)
        if self.graph_break:  # a logged metric: .item() and print break the graph here
            print(f"norm {x.norm().item():.4f}", file=self.log)
        x = checkpoint(second, x, use_reentrant=False) if self.checkpointed else second(x)
        logits = g.head(g.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class ConvNet(nn.Module):
    """A small CNN with BatchNorm (running statistics updated in place) and in-place ReLUs."""

    def __init__(self, dropout: float = 0.1, graph_break: bool = False, checkpointed: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True))
        self.second = nn.Sequential(
            nn.Conv2d(8, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.AdaptiveAvgPool2d(2),
        )
        self.head = nn.Linear(64, 10)
        self.graph_break = graph_break
        self.checkpointed = checkpointed
        self.log = io.StringIO()

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.first(images)
        if self.graph_break:  # a logged metric: .item() and print break the graph here
            print("mean", x.mean().item(), file=self.log)
        if self.checkpointed:
            # The convolution is recomputed, BatchNorm is not: AOTAutograd's FX-only path (torch alone,
            # no teraio) fails when a checkpointed region updates BatchNorm's running statistics in place.
            conv, rest = self.second[0], self.second[1:]
            return F.cross_entropy(
                self.head(rest(checkpoint(conv, x, use_reentrant=False)).flatten(1)), labels
            )
        return F.cross_entropy(self.head(self.second(x).flatten(1)), labels)


class HFLoss(nn.Module):
    """An HF transformers model with its LM loss computed outside the model (one graph, no labels)."""

    def __init__(
        self, kind: str, dropout: float = 0.1, graph_break: bool = False, checkpointed: bool = False
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        if kind == "gpt2":
            from transformers import GPT2Config, GPT2LMHeadModel

            cfg = GPT2Config(
                n_layer=2,
                n_embd=32,
                n_head=2,
                n_positions=64,
                vocab_size=64,
                bos_token_id=0,
                eos_token_id=0,
                resid_pdrop=dropout,
                embd_pdrop=dropout,
                attn_pdrop=dropout,
            )
            self.model = GPT2LMHeadModel(cfg)
        else:
            from transformers import BertConfig, BertForMaskedLM

            cfg = BertConfig(
                num_hidden_layers=2,
                hidden_size=32,
                num_attention_heads=2,
                intermediate_size=64,
                vocab_size=64,
                max_position_embeddings=64,
                hidden_dropout_prob=dropout,
                attention_probs_dropout_prob=dropout,
            )
            self.model = BertForMaskedLM(cfg)
        if checkpointed:  # HF's own activation checkpointing of every layer
            enable = getattr(self.model, "activation_checkpointing_enable", None)
            if enable is not None:  # its name from transformers 5 on (the old one warns)
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                self.model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False}
                )
        self.kind = kind
        self.graph_break = graph_break
        self.log = io.StringIO()

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=ids).logits
        if self.graph_break:  # a logged metric: .item() and print break the graph here
            print(f"logits {logits.abs().mean().item():.4f}", file=self.log)
        if self.kind == "gpt2":
            logits, labels = logits[:, :-1], labels[:, 1:]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


class AdapterNet(nn.Module):
    """What fine-tuning code looks like: a frozen base with low-rank adapters, the head tied to the
    embedding, in-place ops, BatchNorm (running statistics, train/eval switches) and one checkpointed
    block."""

    def __init__(self, layers: int = 3, hidden: int = 48, rank: int = 4, vocab: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, hidden)
        self.base = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))
        self.down = nn.ModuleList(nn.Linear(hidden, rank, bias=False) for _ in range(layers))
        self.up = nn.ModuleList(nn.Linear(rank, hidden, bias=False) for _ in range(layers))
        self.bn = nn.BatchNorm1d(hidden)
        self.ln = nn.LayerNorm(hidden)
        for p in self.base.parameters():  # the frozen base: only the adapters, norms and embedding train
            p.requires_grad_(False)

    def _block(self, i: int, x: torch.Tensor) -> torch.Tensor:
        h = self.base[i](x)
        h.add_(self.up[i](self.down[i](x)))  # in place on a fresh tensor
        return x + torch.relu_(h)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for i in range(len(self.base)):
            x = checkpoint(self._block, i, x, use_reentrant=False) if i == 1 else self._block(i, x)
        b, t, h = x.shape
        x = self.bn(x.reshape(b * t, h)).reshape(b, t, h)
        logits = self.ln(x) @ self.emb.weight.t()  # tied weights
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@dataclass(frozen=True)
class Case:
    """A model and its batches: ``batch(step, size)`` with ``size`` the sequence length / image side."""

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
    sizes: tuple[int, ...]  # for the changing-shapes pattern; sizes[0] is the default


def _tokens(vocab: int, batch: int) -> Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]:
    def make(step: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + step)
        t = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    return make


def _images(step: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randn(4, 3, side, side, generator=g), torch.randint(0, 10, (4,), generator=g)


CASES: dict[str, Case] = {
    "gpt": Case("gpt", lambda: GPTLoss(dropout=0.1), _tokens(64, 2), (32, 24, 16)),
    "gpt-graph-break": Case("gpt-graph-break", lambda: GPTLoss(graph_break=True), _tokens(64, 2), (32,)),
    "gpt-checkpoint": Case("gpt-checkpoint", lambda: GPTLoss(checkpointed=True), _tokens(64, 2), (32,)),
    "hf-gpt2": Case("hf-gpt2", lambda: HFLoss("gpt2"), _tokens(64, 2), (32, 24)),
    "hf-gpt2-graph-break": Case(
        "hf-gpt2-graph-break", lambda: HFLoss("gpt2", graph_break=True), _tokens(64, 2), (32,)
    ),
    "hf-gpt2-checkpoint": Case(
        "hf-gpt2-checkpoint", lambda: HFLoss("gpt2", dropout=0.0, checkpointed=True), _tokens(64, 2), (32,)
    ),
    "hf-bert": Case("hf-bert", lambda: HFLoss("bert"), _tokens(64, 2), (32, 24)),
    "hf-bert-graph-break": Case(
        "hf-bert-graph-break", lambda: HFLoss("bert", graph_break=True), _tokens(64, 2), (32,)
    ),
    "hf-bert-checkpoint": Case(
        "hf-bert-checkpoint", lambda: HFLoss("bert", dropout=0.0, checkpointed=True), _tokens(64, 2), (32,)
    ),
    "adapters": Case("adapters", AdapterNet, _tokens(64, 8), (64,)),
    "convnet": Case("convnet", ConvNet, _images, (16, 12)),
    "convnet-graph-break": Case("convnet-graph-break", lambda: ConvNet(graph_break=True), _images, (16,)),
    "convnet-checkpoint": Case(
        "convnet-checkpoint", lambda: ConvNet(dropout=0.0, checkpointed=True), _images, (16,)
    ),
}


# ----------------------------------------------------------------------------------------- patterns
StepFn = Callable[[Any, nn.Module, Case, int, bool], torch.Tensor]


def _plain(compiled, model, case, step, last) -> torch.Tensor:
    loss = compiled(*case.batch(step, case.sizes[0]))
    loss.backward()
    return loss


def _mixed(compiled, model, case, step, last) -> torch.Tensor:
    """Validation under no_grad (eval mode) and a validation loss computed with grad enabled and never
    backpropagated, between steps of two accumulated micro-batches."""
    model.eval()
    with torch.no_grad():
        compiled(*case.batch(10_000 + step, case.sizes[0]))
    model.train()
    unused = compiled(*case.batch(20_000 + step, case.sizes[0]))  # grad enabled, never backpropagated
    del unused
    total = torch.zeros(())
    for micro in range(2):
        loss = compiled(*case.batch(2 * step + micro, case.sizes[0])) / 2
        loss.backward()
        total = total + loss.detach()
    return total


def _two_forwards(compiled, model, case, step, last) -> torch.Tensor:
    a = compiled(*case.batch(2 * step, case.sizes[0]))
    b = compiled(*case.batch(2 * step + 1, case.sizes[0]))
    loss = a + b
    loss.backward()
    return loss


def _changing_shapes(compiled, model, case, step, last) -> torch.Tensor:
    size = case.sizes[0] if last else case.sizes[(step // 2) % len(case.sizes)]
    loss = compiled(*case.batch(step, size))
    loss.backward()
    return loss


def _autocast(compiled, model, case, step, last) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = compiled(*case.batch(step, case.sizes[0]))
    loss.backward()
    return loss


# Every loop pattern in one training run (one compile of each graph shared by all of them): plain steps
# (profiling, then planning), validation under no_grad, a forward never backpropagated, gradient
# accumulation, two forwards then one backward, bf16 autocast (another graph: profiled, planned, run),
# and a last plain step, the one measured against the budget.
ALL_SCHEDULE = ("plain", "plain", "mixed", "two-forwards", "autocast", "autocast", "autocast", "plain")
# The same without autocast, for the model variants (a graph break, checkpointing): autocast is covered
# on each model's default variant.
FP32_SCHEDULE = ("plain", "plain", "mixed", "two-forwards", "plain")


def _all(compiled, model, case, step, last) -> torch.Tensor:
    name = ALL_SCHEDULE[step % len(ALL_SCHEDULE)] if not last else "plain"
    return PATTERNS[name](compiled, model, case, step, last)


def _all_fp32(compiled, model, case, step, last) -> torch.Tensor:
    name = FP32_SCHEDULE[step % len(FP32_SCHEDULE)] if not last else "plain"
    return PATTERNS[name](compiled, model, case, step, last)


PATTERNS: dict[str, StepFn] = {
    "all": _all,
    "all-fp32": _all_fp32,
    "plain": _plain,
    "mixed": _mixed,
    "two-forwards": _two_forwards,
    "changing-shapes": _changing_shapes,
    "autocast": _autocast,
}


def record_peak(pattern: str, inner: str, measured_bytes: int | None, budget_bytes: int) -> None:
    """With TERAIO_TEST_PEAKS=<file>, append one line per checked loop: the figures a closing note
    quotes (measured step peak against its budget, per pattern and inner compiler)."""
    path = os.environ.get("TERAIO_TEST_PEAKS")
    if path and measured_bytes is not None:
        with open(path, "a") as f:
            f.write(
                f"{pattern}\t{inner}\t{measured_bytes}\t{budget_bytes}\t{measured_bytes / budget_bytes:.3f}\n"
            )


@dataclass
class Trace:
    losses: list[torch.Tensor] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    last_step_peak_bytes: int | None = None
    measured_calls: Any = None  # the calls of the step measured for last_step_peak_bytes, where recorded
    planned_detached_calls: int = 0  # GAN: generator forwards detached at once while it had a plan


def run(
    case: Case,
    pattern: str,
    backend: Any,
    steps: int,
    model: nn.Module | None = None,
    **compile_options: Any,
) -> Trace:
    """Train a fresh copy of the case's model for ``steps`` optimizer steps with ``pattern``
    (``compile_options``: torch.compile's, such as ``dynamic=True`` or ``fullgraph=True``)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = model if model is not None else case.build()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    compiled = torch.compile(model, backend=backend, **compile_options)
    step_fn = PATTERNS[pattern]
    trace = Trace()
    for step in range(steps):
        last = step == steps - 1
        # Gradients stay allocated between steps (zeroed in place), so the measured last step counts
        # what the step allocates, not the .grad tensors, which persist like parameters.
        opt.zero_grad(set_to_none=False)
        rec = MemoryRecorder() if last else None
        with rec_ctx(rec):
            loss = step_fn(compiled, model, case, step, last)
        if rec is not None:
            trace.last_step_peak_bytes = rec.stop().peak_bytes
        trace.losses.append(loss.detach().clone())
        trace.grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
    trace.params = {n: p.detach().clone() for n, p in model.named_parameters()}
    trace.params.update({f"buffer:{n}": b.clone() for n, b in model.named_buffers()})
    return trace


@contextlib.contextmanager
def rec_ctx(rec: MemoryRecorder | None):
    if rec is None:
        yield
        return
    rec.start()
    try:
        yield
    finally:
        rec.mark_end()


def assert_bit_identical(a: Trace, b: Trace) -> None:
    assert len(a.losses) == len(b.losses)
    for step, (la, lb) in enumerate(zip(a.losses, b.losses)):
        assert torch.equal(la, lb), f"loss differs at step {step}: {la} vs {lb}"
    for step, (ga, gb) in enumerate(zip(a.grads, b.grads)):
        assert ga and ga.keys() == gb.keys(), f"different gradients at step {step}"
        for name in ga:
            assert torch.equal(ga[name], gb[name]), f"gradient of {name} differs at step {step}"
    assert a.params.keys() == b.params.keys()
    for name in a.params:
        assert torch.equal(a.params[name], b.params[name]), f"{name} differs after training"


KERNEL_SOURCE = re.compile(r"(cpp_fused\w*) = async_compile\.cpp_pybinding\((.*?)'''\)", re.DOTALL)


#: A kernel's buffer arguments by role: read, written, or read and overwritten in place.
BUFFER_ARG = re.compile(r"\b(?:in_out_ptr|in_ptr|out_ptr)\d+\b")


def kernels(codes: list[str]) -> list[str]:
    """Every generated C++ kernel's source, its name left out (numbering may differ between compiles)
    and its buffers' names too. Which input a kernel overwrites in place (``in_out_ptr``) depends on
    which buffers are still needed after it, and a plan's offload keeps the tensor it writes alive
    until the write is done, so Inductor may overwrite another input instead (seen once in CI: a
    residual add's kernel overwrote its first operand's buffer with the plan, its third without).
    The loops, loads, operations in their order, conversions and stores are still compared: what
    the kernel computes and how it rounds."""
    return sorted(BUFFER_ARG.sub("ptr", src) for code in codes for _name, src in KERNEL_SOURCE.findall(code))


def compiled_twice(ref_codes: list[str]) -> list[str]:
    """The kernels a planned run compiles where the same run without a plan compiled ``ref_codes``: each
    training graph's unplanned kernels while profiling (the calibration's, the only ones the run without
    a plan compiles: Note: [A graph that runs without a plan keeps its calibration kernels] in
    teraio.graph.compilers) and again with its plan, which must leave them as they are."""
    return sorted(kernels(ref_codes) * 2)


@contextlib.contextmanager
def capture_inductor_code(codes: list[str]):
    """Collect the output code of every graph Inductor compiles (its own run_and_get_code resets Dynamo)."""
    from unittest import mock

    from torch._inductor.graph import GraphLowering

    with mock.patch.object(GraphLowering, "save_output_code", codes.append):
        yield codes


def fresh(case: Case) -> nn.Module:
    return copy.deepcopy(case.build())


# ------------------------------------------------------------------------------------- the matrix
STEPS = 4  # 1 profiled step, then the plan runs for 3
BUDGET = "50%"
# Budgets a little above each tiny model's floor (the smallest achievable step peak, from the backend's
# own error message). These models' floors are high: the logits and loss, BatchNorm's and autocast's
# temporaries cannot be offloaded, and with a graph break one graph's tensors stay while the other runs.
BUDGETS = {
    "gpt-graph-break": "60%",
    "gpt-checkpoint": "65%",
    "hf-gpt2": "70%",
    "hf-gpt2-graph-break": "70%",
    "hf-bert": "60%",
    "hf-bert-graph-break": "60%",
    "convnet": "70%",
    "convnet-graph-break": "85%",
    "convnet-checkpoint": "95%",
}
# Checkpointed HF models save little besides each layer's input, which backward reads at once: their
# floor is the unplanned peak, so nothing can move. They still run exact and unchanged with teraio on.
NOTHING_TO_MOVE = {"hf-gpt2-checkpoint": "100%", "hf-bert-checkpoint": "100%"}
PEAK_SLACK = 1.05

MODELS = ("gpt", "hf-gpt2", "hf-bert", "convnet")
VARIANTS = ("", "-graph-break", "-checkpoint")
# Every model in every variant (dropout, a graph break, activation checkpointing inside the model) runs
# the loop that goes through every pattern (``loops.ALL_SCHEDULE``); changing shapes compile one graph per
# shape, so they run on their own.
FX_MATRIX = [(m + v, "all" if not v else "all-fp32") for m in MODELS for v in VARIANTS] + [
    (m, "changing-shapes") for m in MODELS
]


def loop_backend(
    enabled: bool,
    inner: str = "eager",
    budget: str = BUDGET,
    *,
    solver: str = "greedy",
    recompute: str | None = None,
    time_limit: float = 30.0,
    profile_steps: int = 1,
    **kw,
) -> TeraioBackend:
    return TeraioBackend(
        memory_budget=budget,
        enabled=enabled,
        inner=inner,
        solver=teraio.Solver(name=solver, recompute=recompute, time_limit=time_limit),
        profiling=teraio.Profiling(
            steps=profile_steps, measure_memory=False
        ),  # the test measures the step itself
        io_backend="posix",
        **kw,
    )


# Note: [One reference run per configuration]
#     With ``enabled=False`` the backend still profiles and plans, but every graph runs without the plan
#     (``GraphRunner.compile_final``): the budget and the planner's options change what it computes on
#     the side, never what runs. Tests that differ only in those (the Inductor convnet with the greedy's
#     plan and with every tensor moved; the recompute tests on the GPT) compare with the same reference,
#     made once per test run (``tests.teraio.shared``) by whichever test needs it first.
PLANNING_ONLY = frozenset({"solver", "recompute", "time_limit"})


def reference_run(
    case_name: str,
    pattern: str,
    inner: str,
    steps: int,
    budget: str,
    compile_options: dict[str, Any] | None,
    options: dict[str, Any],
) -> tuple[Trace, list[str]]:
    """The run with ``enabled=False`` a check compares with, and the code Inductor generated for it."""
    runs_as = {k: v for k, v in sorted(options.items()) if k not in PLANNING_ONLY}
    key = f"loops-reference-{case_name}-{pattern}-{inner}-{steps}-{sorted((compile_options or {}).items())}-{runs_as}"

    def compute() -> tuple[Trace, list[str]]:
        ref_be = loop_backend(False, inner, budget, **options)
        ref_codes: list[str] = []
        try:
            with capture_inductor_code(ref_codes):
                reference = run(CASES[case_name], pattern, ref_be, steps, **(compile_options or {}))
        finally:
            ref_be.close()
        return reference, ref_codes

    return once_per_run(key, compute)


def check_case(
    case_name: str,
    pattern: str,
    inner: str,
    tmp_path,
    budget: str | None = None,
    same_kernels: bool = True,
    within_budget: bool = True,
    compile_options: dict[str, Any] | None = None,
    **options,
) -> tuple[Trace, TeraioBackend]:
    case = CASES[case_name]
    steps = {
        # Every shape is profiled (on Inductor one step more, its kernels' memory) and then runs its plan.
        "changing-shapes": STEPS
        + 2 * (len(case.sizes) - 1)
        + (2 * len(case.sizes) if inner == "inductor" else 0),
        "all": len(ALL_SCHEDULE),
        "all-fp32": len(FP32_SCHEDULE),
    }.get(pattern, STEPS)
    budget = budget or NOTHING_TO_MOVE.get(case_name) or BUDGETS.get(case_name, BUDGET)
    reference, ref_codes = reference_run(case_name, pattern, inner, steps, budget, compile_options, options)
    codes: list[str] = []
    be = loop_backend(True, inner, budget, offload_dirs=[str(tmp_path)], **options)
    try:
        with capture_inductor_code(codes):
            trace = run(case, pattern, be, steps, **(compile_options or {}))
        assert_bit_identical(trace, reference)
        if inner == "inductor" and same_kernels:
            # Notes: [Migration ops sit between kernels], [Outputs are realised where they are computed]
            assert any("teraio.offload" in c for c in codes)
            assert kernels(codes) == compiled_twice(ref_codes), "the plan changed Inductor's kernels"
        training = [r for r in be.runners if r.is_training and r.plan is not None]
        assert training, "no training graph was planned"
        if case_name not in NOTHING_TO_MOVE:
            assert any(r.plan.decisions for r in training), (
                "the plan moved nothing: the test would prove nothing"
            )
        assert all(r.phase is Phase.RUNNING for r in training)
        budget = max(r.step_budget_bytes for r in training)
        gc.collect()
        assert be.engine is None or be.engine.keys() == [], f"runtime still holds {be.engine.keys()}"
        if case_name in NOTHING_TO_MOVE:
            # The budget is then the composed prediction of the unplanned step, which this model's three
            # graphs exceed by about 7% (tensors passed between graphs; an open modelling gap): what
            # must hold is that teraio adds nothing to the step.
            limit = PEAK_SLACK * reference.last_step_peak_bytes
            assert trace.last_step_peak_bytes <= limit, f"{trace.last_step_peak_bytes} > {limit}"
            return trace, be
        record_peak(f"{case_name}/{pattern}", inner, trace.last_step_peak_bytes, budget)
        over = trace.last_step_peak_bytes > PEAK_SLACK * budget
        assert not (over and within_budget), (
            f"measured step peak {trace.last_step_peak_bytes} > {PEAK_SLACK} x budget {budget}"
        )
        if within_budget:
            # The prediction describes the graph that runs (Note: [The budget is of the graph that runs] in
            # teraio.graph.kernel_memory): the measured step is within 5% of what was predicted for it.
            predicted = be._predicted_peak(be.tracker.last_complete.calls)
            assert abs(trace.last_step_peak_bytes - predicted) <= (PEAK_SLACK - 1) * predicted, (
                f"measured step peak {trace.last_step_peak_bytes} is not within 5% of the predicted {predicted}"
            )
    finally:
        be.close()
    return trace, be
