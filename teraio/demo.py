"""The main job: train the built-in GPT three ways in one run and compare memory and time.

- ``no-offload``: the teraio backend with ``enabled=False`` (same compile, no migration ops): the
  reference for exactness and overhead.
- ``teraio``: profile, plan for the memory budget, recompile with migration ops, train.
- ``checkpoint``: full activation checkpointing (``torch.utils.checkpoint`` per block), compiled the
  same way: the classic alternative that trades memory for recomputation.

Every method trains a fresh copy of the same initial weights on the same batches with AdamW. Step times
are medians over the measured steps (profiling, compile and the memory-measurement step excluded); peak
memory is measured around one full forward+backward with the torch profiler's memory events (CUDA:
``max_memory_allocated``), independently of the runtime's bookkeeping.
"""

from __future__ import annotations

import copy
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from teraio.backend import TeraioBackend
from teraio.measure import MemoryRecorder
from teraio.models import GPT, build_gpt, synthetic_batch

METHODS = ("no-offload", "teraio", "checkpoint")


@dataclass
class DemoConfig:
    model: str = "demo"
    steps: int = 8  # measured steps per method, after warm-up/profiling/compile
    budget: str = "50%"
    solver: str = "ilp"
    time_limit: float = 30.0
    inner: str = "eager"
    offload_dir: str | None = None
    methods: tuple[str, ...] = METHODS
    run_dir: str | None = None
    seed: int = 0
    profile_steps: int = 3
    lr: float = 1e-4
    on_row: Callable[[dict[str, Any]], None] | None = field(default=None, repr=False)


class CheckpointedGPT(torch.nn.Module):
    """The same GPT, each block under ``torch.utils.checkpoint`` (its activations recomputed in backward)."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        g = self.gpt
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = g.tok(idx) + g.pos(pos)
        for block in g.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        logits = g.head(g.ln_f(x))
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def _train(
    method: str, base: GPT, cfg: DemoConfig, offload_dir: str | None
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    torch._dynamo.reset()
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    if method == "teraio":
        be = TeraioBackend(
            memory_budget=cfg.budget,
            solver=cfg.solver,
            time_limit=cfg.time_limit,
            inner=cfg.inner,
            offload_dirs=[offload_dir] if offload_dir else None,
            profile_steps=cfg.profile_steps,
            run_dir=f"{cfg.run_dir}/teraio" if cfg.run_dir else None,
            measure_memory=False,
        )
        runnable: torch.nn.Module = model
    else:
        be = TeraioBackend(
            enabled=False, inner=cfg.inner, profile_steps=cfg.profile_steps, measure_memory=False
        )
        runnable = CheckpointedGPT(model) if method == "checkpoint" else model
    compiled = torch.compile(runnable, backend=be)
    mcfg = base.cfg
    warmup = cfg.profile_steps + 1  # profiling steps, then the step that plans and compiles
    total = warmup + 1 + cfg.steps  # + the memory-measurement step
    times: list[float] = []
    losses: list[torch.Tensor] = []
    peak_bytes = None
    io_before: dict[str, Any] = {}
    try:
        for step in range(total):
            idx, targets = synthetic_batch(mcfg, step, cfg.seed)
            opt.zero_grad(set_to_none=True)
            measure = step == warmup
            if measure:
                io_before = be.stats()
                rec = MemoryRecorder("cpu")
                rec.start()
            t0 = time.perf_counter()
            loss = compiled(idx, targets)
            loss.backward()
            if measure:
                rec.mark_end()
                peak_bytes = rec.stop().peak_bytes
            opt.step()
            dt = time.perf_counter() - t0
            losses.append(loss.detach().clone())
            if step > warmup:
                times.append(dt)
        stats = be.stats()
    finally:
        be.close()
    plan = be.runners[0].plan if be.runners and be.runners[0].plan is not None else None
    moved = stats["offloaded_bytes"] - io_before.get("offloaded_bytes", 0)
    read = stats["prefetched_bytes"] - io_before.get("prefetched_bytes", 0)
    measured_steps = len(times) + 1  # the steps after the measurement step, and that step
    step_s = statistics.median(times)
    profile = be.runners[0].profile if be.runners else None
    row: dict[str, Any] = {
        "method": method,
        "peak_bytes": int(peak_bytes) if peak_bytes is not None else None,
        "step_s": step_s,
        "steps_measured": len(times),
        "activation_bytes": profile.activation_bytes() if profile is not None else None,
        "moved_bytes_per_step": int(moved / measured_steps) if moved else 0,
        "io_gb_per_s": (moved + read) / measured_steps / 1e9 / step_s if moved else 0.0,
        "stall_s_per_step": (stats["stall_s"] - io_before.get("stall_s", 0.0)) / measured_steps
        if moved
        else 0.0,
        "final_loss": float(losses[-1]),
    }
    if plan is not None:
        row.update(
            predicted_peak_bytes=plan.predicted_peak_bytes,
            predicted_step_s=plan.predicted_step_s,
            baseline_peak_bytes=plan.baseline_peak_bytes,
            budget_bytes=plan.budget_bytes,
            solver=plan.solver,
            solver_status=plan.stats.status,
            io_path=stats.get("io_path"),
        )
    return row, losses


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    """Train with every method in ``cfg.methods``; return ``{"rows": [...], ...}`` (see the README)."""
    base = build_gpt(cfg.model, seed=cfg.seed)
    own_dir = cfg.offload_dir is None
    offload_dir = tempfile.mkdtemp(prefix="teraio-demo-") if own_dir else cfg.offload_dir
    rows, losses = [], {}
    try:
        for method in cfg.methods:
            row, losses[method] = _train(method, base, cfg, offload_dir)
            rows.append(row)
            if cfg.on_row is not None:
                cfg.on_row(row)
    finally:
        if own_dir:
            shutil.rmtree(offload_dir, ignore_errors=True)
    by = {r["method"]: r for r in rows}
    ref = by.get("no-offload")
    for r in rows:
        if ref is not None and ref["peak_bytes"]:
            r["peak_vs_no_offload"] = r["peak_bytes"] / ref["peak_bytes"]
            r["overhead"] = r["step_s"] / ref["step_s"] - 1.0
    result: dict[str, Any] = {
        "model": cfg.model,
        "config": base.cfg.to_dict(),
        "inner": cfg.inner,
        "budget": cfg.budget,
        "rows": rows,
        "torch_version": torch.__version__,
    }
    if "no-offload" in losses and "teraio" in losses:
        a, b = losses["no-offload"], losses["teraio"]
        result["losses_bit_identical"] = len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    return result
