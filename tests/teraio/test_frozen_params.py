"""Frozen weights as read-only state (teraio.states.frozen): a LoRA-style fine-tune of the tiny GPT, the
base frozen and on disk with ``parameters=True``, the adapters trained by AdamW.

Every comparison is bit for bit against the same loop with ``enabled=False``, never with a tolerance. Each
scenario runs once (module-scoped fixtures) and several tests read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import torch
from torch import nn

import teraio
from teraio.runtime import RuntimeConfig
from teraio.states.offload import StateOffload
from teraio.tools.models.gpt import CONFIGS, GPT, synthetic_batch

STEPS = 4
RANK = 4
#: The tiny GPT with four blocks: with each compiled on its own, a block and the one read ahead are in
#: memory at a time, half of them.
CONFIG = replace(CONFIGS["tiny"], layers=4)


class LoRALinear(nn.Module):
    """``base(x) + (x @ A.T) @ B.T * scale`` with ``base`` frozen and ``A``, ``B`` trained."""

    def __init__(self, base: nn.Linear, rank: int, seed: int) -> None:
        super().__init__()
        self.base = base
        g = torch.Generator().manual_seed(seed)
        # B is not zero (as LoRA starts it): every adapter then gets a gradient from the first step.
        self.A = nn.Parameter(torch.randn(rank, base.in_features, generator=g) * 0.05)
        self.B = nn.Parameter(torch.randn(base.out_features, rank, generator=g) * 0.05)
        self.scale = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.A.T) @ self.B.T * self.scale


def lora_gpt() -> nn.Module:
    """The tiny GPT with every base weight frozen and an adapter on each linear layer of its blocks."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    for p in model.parameters():
        p.requires_grad_(False)
    seed = 0
    for block in model.blocks:
        for name in ("qkv", "proj", "up", "down"):
            setattr(block, name, LoRALinear(getattr(block, name), RANK, seed))
            seed += 1
    return model


@dataclass
class Run:
    losses: list[torch.Tensor] = field(default_factory=list)
    state_dict: dict[str, torch.Tensor] = field(default_factory=dict)
    opt_state: dict[int, dict[str, Any]] = field(default_factory=dict)
    frozen_names: list[str] = field(default_factory=list)
    #: Per step: the frozen weights' bytes written and read (StateOffload.stats()["frozen_parameters"]).
    frozen_written: list[int] = field(default_factory=list)
    frozen_read: list[int] = field(default_factory=list)
    #: Per step: all parameters' bytes written (backend.stats()["written_bytes_by_kind"]["parameter"]).
    param_written: list[int] = field(default_factory=list)
    frozen: dict[str, Any] = field(default_factory=dict)
    trained_offloaded_bytes: int = 0
    stats: dict[str, Any] = field(default_factory=dict)
    #: Frozen weights a backward reads back (Note: [A backward reads the frozen weights it saved]) and
    #: those that moved at all, by name.
    bwd_names: set[str] = field(default_factory=set)
    moved_names: set[str] = field(default_factory=set)
    #: With a memory budget: the whole-step items of the frozen weights, by name: (bytes, moved a step).
    frozen_items: dict[str, tuple[int, int]] = field(default_factory=dict)
    peak_param_bytes: int = 0  # offloaded parameters (frozen and trained) in memory at once, at most
    materialized: dict[str, torch.Tensor] = field(default_factory=dict)
    reload: dict[str, Any] = field(default_factory=dict)


def train(
    tmp_path: Any,
    offload: bool,
    *,
    per_block: bool = True,
    in_backward: bool = False,
    memory_budget: str | None = None,
    reload: bool = False,
    inner: str = "eager",
) -> Run:
    torch._dynamo.reset()
    model = lora_gpt()
    adapters = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(adapters, lr=1e-2)
    if offload:
        be = teraio.backend(
            inner=inner,
            profiling=teraio.Profiling(steps=1, measure_memory=memory_budget is not None),
            memory_budget=memory_budget,
            solver="greedy",
            states=teraio.States(
                opt,
                model=model,
                gradients=not in_backward,
                optimizer_in_backward=in_backward,
                parameters=True,
                min_param_bytes=0,
                chunk_bytes="16KiB",
            ),
            offload_dirs=[str(tmp_path)],
            io_backend="posix",
        )
    else:
        be = teraio.backend(
            inner=inner, profiling=teraio.Profiling(steps=1, measure_memory=False), enabled=False
        )
    if per_block:
        for block in model.blocks:
            block.compile(backend=be)
        compiled = model
    else:
        compiled = torch.compile(model, backend=be)
    run = Run(frozen_names=[n for n, p in model.named_parameters() if not p.requires_grad])
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = compiled(*synthetic_batch(CONFIG, step))
        loss.backward()
        opt.step()
        run.losses.append(loss.detach().clone())
        if offload:
            # The step's update of offloaded parameters runs in the next forward (teraio.states.step_pipeline):
            # finished here, so that each step's bytes are counted in it.
            be.states.settle_step()
            frozen = be.states.stats()["frozen_parameters"]
            run.frozen_written.append(frozen["written_bytes"])
            run.frozen_read.append(frozen["read_bytes"])
            run.param_written.append(be.stats()["written_bytes_by_kind"]["parameter"])
    if offload:
        residency = be.states.residency
        run.frozen = be.states.stats()["frozen_parameters"]
        run.trained_offloaded_bytes = sum(
            r.nbytes for i, r in residency.records.items() if i not in residency.frozen
        )
        run.stats = be.stats()
        run.peak_param_bytes = be.states.stats()["peak_resident_bytes"]["parameter"]
        name_of = {id(p): n for n, p in model.named_parameters()}
        run.bwd_names = {name_of[id(residency.params[i])] for i in residency.frozen.read_in_backward}
        if be.whole_step is not None and be.whole_step.memory is not None:
            run.frozen_items = {
                name_of[id(residency.params[it.param_idx])]: (it.nbytes, it.moved_bytes)
                for it in be.whole_step.memory.items
                if it.kind == "parameter" and it.param_idx in residency.frozen
            }
        run.moved_names = {
            name_of[id(residency.params[i])] for i in residency.records if i in residency.frozen
        }
        with be.states.parameters_materialized():
            run.materialized = {n: p.detach().clone() for n, p in model.named_parameters()}
    run.state_dict = {n: t.detach().clone() for n, t in model.state_dict().items()}
    run.opt_state = {
        i: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
        for i, s in opt.state_dict()["state"].items()
    }
    if offload and reload:
        # A load_state_dict that changes the frozen weights rewrites their one copy on disk.
        changed = {n: (t + 1 if n in run.frozen_names else t) for n, t in run.state_dict.items()}
        before = be.states.stats()["frozen_parameters"]["written_bytes"]
        model.load_state_dict(changed)
        residency = be.states.residency
        saved_keys = {i: r.saved_key for i, r in residency.records.items() if i in residency.frozen}
        run.reload = {
            "written_bytes": be.states.stats()["frozen_parameters"]["written_bytes"] - before,
            "state_dict": {n: t.clone() for n, t in model.state_dict().items()},
            "expected": changed,
            "saved_keys": saved_keys,
        }
    be.close()
    return run


def assert_same(ref: Run, got: Run) -> None:
    assert len(ref.losses) == len(got.losses) == STEPS
    for a, b in zip(ref.losses, got.losses):
        assert torch.equal(a, b)
    assert ref.state_dict.keys() == got.state_dict.keys()
    for n in ref.state_dict:
        assert torch.equal(ref.state_dict[n], got.state_dict[n]), n
    assert ref.opt_state.keys() == got.opt_state.keys() and ref.opt_state
    for i in ref.opt_state:
        for k, v in ref.opt_state[i].items():
            assert (
                torch.equal(v, got.opt_state[i][k])
                if isinstance(v, torch.Tensor)
                else v == got.opt_state[i][k]
            )


def assert_frozen_written_once(run: Run) -> None:
    """The frozen weights moved, were written once in total (the first time they left memory) and were
    read back at every later step for forward, and for backward those the backward saved."""
    moved = run.frozen["offloaded_bytes"]
    assert moved > 0
    assert run.frozen_written == [moved] * STEPS  # written in step 1, never again
    sizes = {n: t.numel() * t.element_size() for n, t in run.state_dict.items()}
    bwd = sum(sizes[n] for n in run.bwd_names & run.moved_names)
    reads = [b - a for a, b in zip([0, *run.frozen_read], run.frozen_read)]
    assert all(r == moved + bwd for r in reads[1:]), (reads, moved, bwd)  # every step
    # Note: [A backward reads the frozen weights it saved]: a bias's gradient needs nothing, and the first
    # block's qkv input (the frozen embeddings) needs no gradient; every other block's weight carries its
    # input's gradient back (the adapters before it need it).
    assert not any(n.endswith(".base.bias") for n in run.bwd_names)
    assert "blocks.0.qkv.base.weight" not in run.bwd_names
    for b in range(1, CONFIG.layers):
        for lin in ("qkv", "proj", "up", "down"):
            assert f"blocks.{b}.{lin}.base.weight" in run.bwd_names


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train(tmp_path_factory.mktemp("ref"), False)


@pytest.fixture(scope="module")
def per_block(tmp_path_factory):
    return train(tmp_path_factory.mktemp("blocks"), True, reload=True)


def assert_blocks_move(run: Run) -> None:
    """With each block compiled on its own, forward and backward hold a block's weights and the next
    one's read ahead: half of the four blocks at the most, frozen weights included."""
    block = sum(t.numel() * t.element_size() for n, t in run.state_dict.items() if n.startswith("blocks.0."))
    assert block < run.peak_param_bytes <= 2 * block + run.trained_offloaded_bytes


def test_lora_per_block_bit_identical(reference, per_block):
    assert_same(reference, per_block)
    for n in reference.state_dict:  # read in place, inside parameters_materialized
        if n in per_block.materialized:
            assert torch.equal(reference.state_dict[n], per_block.materialized[n]), n


def test_frozen_weights_written_once_read_every_step(per_block):
    assert_frozen_written_once(per_block)
    assert_blocks_move(per_block)
    # With each block compiled on its own, the frozen weights of the blocks move (the embeddings and head
    # run eagerly and stay); every byte of them that moves is a frozen weight of a block.
    block_frozen = sum(
        t.numel() * t.element_size()
        for n, t in per_block.state_dict.items()
        if n in per_block.frozen_names and n.startswith("blocks.")
    )
    assert per_block.frozen["offloaded_bytes"] == block_frozen
    # The kind's own count agrees: after step 1, a step writes the adapters once and no frozen byte.
    written = [b - a for a, b in zip(per_block.param_written, per_block.param_written[1:])]
    assert written == [per_block.trained_offloaded_bytes] * (STEPS - 1)
    moved = per_block.stats["moved_bytes_by_kind"]["parameter"]
    assert moved >= per_block.frozen["written_bytes"] + per_block.frozen["read_bytes"]


def test_load_state_dict_rewrites_frozen_copy(per_block):
    r = per_block.reload
    assert r["written_bytes"] == per_block.frozen["offloaded_bytes"]
    for n, t in r["expected"].items():
        assert torch.equal(r["state_dict"][n], t), n
    assert r["saved_keys"] and all(k.endswith("/1") for k in r["saved_keys"].values())


def test_lora_whole_model_one_graph(tmp_path_factory, reference):
    got = train(tmp_path_factory.mktemp("whole"), True, per_block=False)
    assert_same(reference, got)
    assert_frozen_written_once(got)
    frozen_bytes = sum(
        t.numel() * t.element_size() for n, t in got.state_dict.items() if n in got.frozen_names
    )
    assert got.frozen["offloaded_bytes"] == frozen_bytes  # embeddings and head too: one graph takes all


def test_lora_optimizer_in_backward(tmp_path_factory, reference):
    got = train(tmp_path_factory.mktemp("inbwd"), True, in_backward=True)
    assert_same(reference, got)
    assert_frozen_written_once(got)
    assert_blocks_move(got)  # a backward holds a trained weight until its update, a frozen one not


def test_whole_step_budget_counts_frozen_weights(tmp_path_factory, reference):
    got = train(tmp_path_factory.mktemp("budget"), True, per_block=True, memory_budget="60%")
    assert_same(reference, got)
    whole = got.stats["whole_step"]
    frozen_bytes = sum(
        t.numel() * t.element_size() for n, t in got.state_dict.items() if n in got.frozen_names
    )
    trained_bytes = sum(
        t.numel() * t.element_size() for n, t in got.state_dict.items() if n not in got.frozen_names
    )
    # Parameters (frozen and trained), the adapters' gradients and their two AdamW moments.
    assert whole["state_bytes"] == frozen_bytes + 4 * trained_bytes
    kept = whole["kept"]
    params = kept["kept_bytes_by_kind"]["parameter"] + kept["offloaded_bytes_by_kind"]["parameter"]
    # Every parameter is an item or stays (the embeddings and head run eagerly), frozen ones too.
    assert params + whole["fixed_bytes"] == frozen_bytes + trained_bytes
    assert whole["fixed_bytes"] == sum(
        t.numel() * t.element_size() for n, t in got.state_dict.items() if not n.startswith("blocks.")
    )
    assert whole["measured_peak_bytes"] is not None
    # Each frozen weight is priced at its reads a step and no write: two when a backward saved it.
    assert got.frozen_items and set(got.frozen_items) <= set(got.frozen_names)
    for name, (nbytes, moved) in got.frozen_items.items():
        assert moved == (2 if name in got.bwd_names else 1) * nbytes, name
    # Some frozen weights are kept (the first block's, whose own graph holds them anyway, and what fits
    # beside them), the others stream:
    # written once (in the first step, before the plan), never again, read every step they move.
    kept_frozen = {n for n in got.frozen_items if n not in got.moved_names}
    assert kept_frozen and got.moved_names
    assert {n for n in got.frozen_names if n.startswith("blocks.0.")} <= kept_frozen
    assert got.frozen_written[1:] == got.frozen_written[:1] * (STEPS - 1) and got.frozen_written[0] > 0
    sizes = {n: t.numel() * t.element_size() for n, t in got.state_dict.items()}
    last_step_reads = got.frozen_read[-1] - got.frozen_read[-2]
    assert last_step_reads == sum(sizes[n] * (2 if n in got.bwd_names else 1) for n in got.moved_names)


def test_lora_per_block_with_inductor(tmp_path_factory):
    """Inductor's backward may save a view or a copy of a frozen weight where the eager one saves the
    weight (Note: [A backward reads the frozen weights it saved]): the weights it reads back must still
    be the ones it needs."""
    ref = train(tmp_path_factory.mktemp("ind-ref"), False, inner="inductor")
    got = train(tmp_path_factory.mktemp("ind"), True, inner="inductor")
    assert_same(ref, got)
    assert_frozen_written_once(got)


class _Quantized(nn.Parameter):
    """Stands for a quantized frozen base weight (bitsandbytes' Params4bit is a Parameter subclass)."""


def test_setup_says_how_many_frozen_weights_move(tmp_path, caplog):
    """One INFO line at setup; a frozen weight of a tensor subclass stays in memory and is counted so."""
    model = lora_gpt()
    head = model.head.weight
    model.head.weight = _Quantized(head.detach().clone(), requires_grad=False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    with caplog.at_level("INFO", logger="teraio"):
        states = StateOffload(
            opt,
            runtime_config=RuntimeConfig(dirs=[str(tmp_path)], backend="posix"),
            model=model,
            offload_parameters=True,
            min_param_bytes=0,
        )
    try:
        frozen = [p for p in model.parameters() if not p.requires_grad]
        nbytes = sum(p.numel() * p.element_size() for p in frozen)
        f = states.residency.frozen
        assert (f.count, f.nbytes) == (len(frozen), nbytes)
        assert f.offloadable_count == len(frozen) - 1
        assert f.offloadable_nbytes == nbytes - head.numel() * head.element_size()
        lines = [r.getMessage() for r in caplog.records if "frozen parameters" in r.getMessage()]
        assert len(lines) == 1 and f"{len(frozen) - 1} frozen parameters" in lines[0]
        assert "1 (" in lines[0] and "tensor subclass" in lines[0]
    finally:
        states.close()
