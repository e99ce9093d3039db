"""The main job: train the built-in GPT five ways in one run and compare memory and time.

- ``no-offload``: the teraio backend with ``enabled=False`` (same compile, no migration ops): the
  reference for exactness and overhead.
- ``teraio``: profile, plan for the memory budget, recompile with migration ops, train.
- ``torch-budget``: PyTorch's own ``activation_memory_budget`` (the min-cut partitioner's recompute) at the
  ratio that reaches the ``teraio`` method's measured peak, without migration (teraio.tools.torch_budget).
- ``checkpoint``: full activation checkpointing (``torch.utils.checkpoint`` per block), compiled the
  same way: the classic alternative that trades memory for recomputation.
- ``teraio@checkpoint``: teraio with a budget equal to the ``checkpoint`` method's measured peak (so it
  runs after it): keep, offload and recompute planned together against checkpointing on its own ground.

Every method trains a fresh copy of the same initial weights on the same batches with AdamW. Step times
are medians over the measured steps (profiling, compile and the memory-measurement step excluded); peak
memory is measured around one full forward+backward with the torch profiler's memory events (CUDA:
``max_memory_allocated``), independently of the runtime's bookkeeping.
"""

from __future__ import annotations

import copy
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from teraio.config import BackendConfig, Profiling, Solver
from teraio.lifecycle.backend import Phase, TeraioBackend
from teraio.lifecycle.partitioner_runoff import trial_steps_at_most
from teraio.planner.budget import BudgetError, format_size
from teraio.platform.cpu_malloc import CpuMalloc, apply_cpu_malloc
from teraio.profiling.measure import MemoryRecorder
from teraio.profiling.transfer_probe import PROBE_STEPS
from teraio.runtime.config import default_offload_dir
from teraio.tools.models import GPT, build_gpt, synthetic_batch
from teraio.tools.torch_budget import find_ratio, lowest_peak_ratio

log = logging.getLogger(__name__)

METHODS = ("no-offload", "teraio", "torch-budget", "checkpoint", "teraio@checkpoint")
#: The teraio method whose budget is the checkpoint method's measured peak.
AT_CHECKPOINT = "teraio@checkpoint"
#: PyTorch's own activation_memory_budget at the teraio method's measured peak (Note: [Finding the ratio
#: that reaches a peak] in teraio.tools.torch_budget), so it comes after teraio.
TORCH_BUDGET = "torch-budget"


@dataclass
class DemoConfig:
    model: str = "demo"
    steps: int = 12  # timed steps per method, after warm-up/profiling/compile and the memory step
    budget: str = "55%"
    solver: str = "ilp"
    time_limit: float = 30.0
    inner: str = "eager"
    offload_dir: str | None = None
    methods: tuple[str, ...] = METHODS
    run_dir: str | None = None
    seed: int = 0
    profile_steps: int = (
        6  # 2 timed op by op, 4 calibrating (Note: [Calibrated times] in teraio.profiling.op_timing)
    )
    lr: float = 1e-4
    checksum: bool = True  # per-chunk crc32c of offloaded bytes, verified on read (the runtime default)
    # What teraio's plans assume of the disk: "calibrate" times the offload directory before planning
    # (the built-in model's per-request latency can be far from the machine's, which misleads small models);
    # or a HardwareModel JSON (teraio calibrate --out); None: the built-in model.
    hardware: str | None = "calibrate"
    # Note: [Freed CPU memory and step time] in teraio.platform.cpu_malloc
    cpu_malloc: CpuMalloc = "retain"
    # Timed steps of one method in a row per round, after one untimed switch step; None: by step time
    # (Note: [Timing runs of steps]).
    round_steps: int | None = None
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


@dataclass
class _Method:
    """One method's model, optimizer, backend and measurements while the demo interleaves them."""

    name: str
    model: GPT
    opt: torch.optim.Optimizer
    backend: TeraioBackend
    compiled: Any
    times: list[float] = field(default_factory=list)
    fwd_bwd_times: list[float] = field(default_factory=list)  # the part of a step a plan predicts
    losses: list[torch.Tensor] = field(default_factory=list)
    peak_bytes: int | None = None
    io_before: dict[str, Any] = field(default_factory=dict)
    # teraio@checkpoint only: the checkpoint peak, when it was below teraio's floor and the floor was used.
    budget_raised_from: int | None = None
    steps_run: int = 0
    warm_up_times: list[float] = field(default_factory=list)  # whole steps, before the memory step

    def step(self, step: int, cfg: DemoConfig, measure: bool = False) -> tuple[float, float]:
        """Training step ``step`` (the next one: every method trains on the same batches in the same
        order); returns (whole step s, forward+backward s)."""
        assert step == self.steps_run, "steps run in order"
        self.steps_run += 1
        idx, targets = synthetic_batch(self.model.cfg, step, cfg.seed)
        self.opt.zero_grad(set_to_none=True)
        rec = MemoryRecorder("cpu") if measure else None
        if rec is not None:
            self.io_before = self.backend.stats()
            rec.start()
        t0 = time.perf_counter()
        loss = self.compiled(idx, targets)
        loss.backward()
        fwd_bwd_s = time.perf_counter() - t0
        if rec is not None:
            rec.mark_end()
            self.peak_bytes = rec.stop().peak_bytes
        self.opt.step()
        dt = time.perf_counter() - t0
        self.losses.append(loss.detach().clone())
        return dt, fwd_bwd_s


def _setup(
    method: str,
    base: GPT,
    cfg: DemoConfig,
    offload_dir: str | None,
    budget: str | int | None = None,
    partitioner_budget: float | None = None,
    profile_steps: int | None = None,
) -> _Method:
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    if method in ("teraio", AT_CHECKPOINT):
        be = TeraioBackend(
            BackendConfig(
                memory_budget=budget if budget is not None else cfg.budget,
                # Note: [The partitioner's budget is part of the plan] in teraio.lifecycle.partitioner_search:
                # on Inductor, where the partitioner's recompute is fused into the backward kernels.
                solver=Solver(
                    name=cfg.solver,
                    time_limit=cfg.time_limit,
                    partitioner_budget="search" if cfg.inner == "inductor" else None,
                ),
                inner=cfg.inner,
                offload_dirs=[offload_dir] if offload_dir else None,
                profiling=Profiling(steps=cfg.profile_steps, measure_memory=False),
                run_dir=f"{cfg.run_dir}/{method}" if cfg.run_dir else None,
                checksum=cfg.checksum,
                hardware=cfg.hardware,
            )
        )
        runnable: torch.nn.Module = model
    else:
        be = TeraioBackend(
            BackendConfig(
                enabled=False,
                inner=cfg.inner,
                profiling=Profiling(steps=profile_steps or cfg.profile_steps, measure_memory=False),
                solver=Solver(partitioner_budget=partitioner_budget),
            )
        )
        runnable = CheckpointedGPT(model) if method == "checkpoint" else model
    return _Method(method, model, opt, be, torch.compile(runnable, backend=be))


def _warm_up(
    name: str,
    base: GPT,
    cfg: DemoConfig,
    offload_dir: str | None,
    budget: int | None,
    warmup: int,
    methods: list[_Method],
    partitioner_budget: float | None = None,
    profile_steps: int | None = None,
) -> _Method:
    """Set up a method (appended to ``methods`` at once, so it is closed whatever happens), run its
    warm-up (profiling, planning, compiling) and its memory-measurement step."""
    m = _setup(name, base, cfg, offload_dir, budget, partitioner_budget, profile_steps)
    methods.append(m)
    for step in range(warmup):
        m.warm_up_times.append(m.step(step, cfg)[0])
    # A plan may come later than ``profile_steps``: the backend goes on calibrating while it prices a
    # transfer under the model's own compute (Note: [Pricing transfers under the model's own compute]
    # in teraio.profiling.transfer_probe). Bounded, in case a graph never finishes profiling.
    # The partitioner search profiles the step again at up to two more ratios (Note: [The partitioner's
    # budget is part of the plan] in teraio.lifecycle.partitioner_search).
    # Then it times the finalists in turns (Note: [The search's finalists are timed against each other] in
    # teraio.lifecycle.partitioner_runoff).
    rounds = 3 if m.backend.partitioner_search is not None else 1
    trial = (
        0 if m.backend.partitioner_search is None else trial_steps_at_most(m.backend.cfg.solver.runoff_rounds)
    )
    while m.steps_run < rounds * (warmup + 2) + PROBE_STEPS + trial and not m.backend.settled:
        m.warm_up_times.append(m.step(m.steps_run, cfg)[0])
    m.step(m.steps_run, cfg, measure=True)
    return m


def _torch_budget(
    base: GPT, cfg: DemoConfig, warmup: int, methods: list[_Method]
) -> tuple[_Method, dict[str, Any]]:
    """The ``torch-budget`` method: PyTorch's activation_memory_budget at the ratio whose peak reaches
    the teraio method's (Note: [Finding the ratio that reaches a peak] in teraio.tools.torch_budget), or
    at the ratio that peaked lowest when none does; and the search's record."""
    by_name = {m.name: m for m in methods}
    teraio_m = by_name.get("teraio")
    if teraio_m is None or teraio_m.peak_bytes is None:
        raise ValueError(f"{TORCH_BUDGET} needs the teraio method before it: its measured peak is the target")
    ref = by_name.get("no-offload")

    def peak_at(ratio: float) -> int:
        probe = _setup(f"{TORCH_BUDGET}-probe", base, cfg, None, partitioner_budget=ratio, profile_steps=1)
        try:
            while probe.steps_run < 8 and (
                not probe.backend.runners
                or any(r.phase in (Phase.PROFILING, Phase.PLANNING) for r in probe.backend.runners)
            ):
                probe.step(probe.steps_run, cfg)
            probe.step(probe.steps_run, cfg, measure=True)
            assert probe.peak_bytes is not None
            return probe.peak_bytes
        finally:
            probe.backend.close()

    no_budget = ref.peak_bytes if ref is not None and ref.peak_bytes is not None else peak_at(1.0)
    search = find_ratio(teraio_m.peak_bytes, no_budget, peak_at)
    ratio = search.ratio if search.ratio is not None else lowest_peak_ratio(search)
    m = _warm_up(TORCH_BUDGET, base, cfg, None, None, warmup, methods, partitioner_budget=ratio)
    return m, {
        "activation_memory_budget": ratio,
        "reaches_target": search.ratio is not None,
        "target_peak_bytes": teraio_m.peak_bytes,
        "ratio_probes": search.to_dict()["probes"],
    }


#: Below this step time (the first method's warm-up median), the timed rounds run each method's steps
#: in a row (Note: [Timing runs of steps]).
SHORT_STEP_S = 0.1  # the CLI's --round-steps help repeats it
#: Timed steps of one method in a row per round on short steps.
SHORT_STEP_ROUND_STEPS = 4


def round_steps_for(methods: list[_Method], cfg: DemoConfig) -> int:
    """Timed steps of one method in a row per round: ``cfg.round_steps``, or by the step time.

    Note: [Timing runs of steps]
    A user trains one model, step after step; the demo trains several in one process. Interleaving them one
    step each per round cancels the shared machine's slow and fast periods, which matters on steps of seconds
    (the demo model's), but on steps of milliseconds each step then starts on another model's cache contents
    and after another model's I/O, which no user's loop and no profile sees, and runs measurably slower than
    in runs of a few steps of one model. So on short steps each method runs ``SHORT_STEP_ROUND_STEPS`` timed
    steps in a row per round, after one untimed switch step that absorbs the change of model; the rounds still
    alternate the methods every few milliseconds, so drift still falls on all alike. Every method runs the
    same steps (the switch steps train too), so the losses still compare batch for batch.
    """
    if cfg.round_steps is not None:
        return cfg.round_steps
    times = methods[0].warm_up_times[1:] if methods else []  # the first step compiles
    if times and statistics.median(times) < SHORT_STEP_S:
        return SHORT_STEP_ROUND_STEPS
    return 1


def run_rounds(methods: list[_Method], cfg: DemoConfig, round_steps: int) -> int:
    """Run ``cfg.steps`` timed steps of every method in rounds of ``round_steps`` each (Note: [Timing
    runs of steps]); return the number of untimed switch steps each method ran."""
    switch_steps = 0
    left = cfg.steps
    while left > 0:
        n = min(round_steps, left)
        for m in methods:
            if round_steps > 1:
                m.step(m.steps_run, cfg)  # the switch step: untimed
            for _ in range(n):
                step_s, fwd_bwd_s = m.step(m.steps_run, cfg)
                m.times.append(step_s)
                m.fwd_bwd_times.append(fwd_bwd_s)
        switch_steps += 1 if round_steps > 1 else 0
        left -= n
    assert len({m.steps_run for m in methods}) <= 1, "every method ran the same steps"
    return switch_steps


def same_step(methods: list[_Method], cfg: DemoConfig) -> int:
    """Bring every method to the same step, so all train on the same batches from the same state (a
    plan can come later in one than in another); return that step."""
    first = max(m.steps_run for m in methods)
    for m in methods:
        while m.steps_run < first:
            m.step(m.steps_run, cfg)
    return first


def _row(m: _Method, ref: _Method | None) -> dict[str, Any]:
    """One method's figures (docs/cli.md lists the keys).

    Note: [Predicted against measured overhead]
    A plan predicts its step from the profiling steps, taken seconds before the timed rounds; on a shared
    machine the speed of a small step drifts over seconds, so measured/predicted mixes that drift with the
    model's error. The overhead the plan adds to the same profile (``predicted_overhead``: predicted step over
    the profiled step without migration, minus 1) against the paired forward+backward overhead measured in the
    rounds (``fwd_bwd_overhead``) compares the part the plan decides, free of that drift.
    """
    stats = m.backend.stats()
    plan = m.backend.runners[0].plan if m.backend.runners else None

    profile = m.backend.runners[0].profile if m.backend.runners else None
    n = len(m.times) + 1  # the timed steps and the memory-measurement step
    moved = stats["offloaded_bytes"] - m.io_before.get("offloaded_bytes", 0)
    read = stats["prefetched_bytes"] - m.io_before.get("prefetched_bytes", 0)
    step_s = statistics.median(m.times)
    row: dict[str, Any] = {
        "method": m.name,
        "peak_bytes": int(m.peak_bytes) if m.peak_bytes is not None else None,
        "step_s": step_s,
        # Forward+backward only: what a plan's predicted_step_s predicts (step_s adds the optimizer).
        "fwd_bwd_s": statistics.median(m.fwd_bwd_times),
        "step_times_s": list(m.times),  # per timed step, in the order they ran
        "fwd_bwd_times_s": list(m.fwd_bwd_times),
        "steps_measured": len(m.times),
        "activation_bytes": profile.activation_bytes() if profile is not None else None,
        "moved_bytes_per_step": int(moved / n) if moved else 0,
        "io_gb_per_s": (moved + read) / n / 1e9 / step_s if moved else 0.0,
        "stall_s_per_step": (stats["stall_s"] - m.io_before.get("stall_s", 0.0)) / n if moved else 0.0,
        "final_loss": float(m.losses[-1]),
    }
    if ref is not None:
        # Paired by round and place in it: both methods ran within milliseconds or seconds of each
        # other, so machine noise mostly cancels.
        row["overhead"] = statistics.median(t / r for t, r in zip(m.times, ref.times)) - 1.0
        row["fwd_bwd_overhead"] = (
            statistics.median(t / r for t, r in zip(m.fwd_bwd_times, ref.fwd_bwd_times)) - 1.0
        )
    if profile is not None:
        # The profiling steps' compute for this method's own graph: how well profiling timed it.
        row["profiled_compute_s"] = float(profile.ops["duration_us"].sum()) / 1e6
    if plan is not None:
        row.update(
            predicted_peak_bytes=plan.predicted_peak_bytes,
            predicted_step_s=plan.predicted_step_s,
            predicted_stall_s=plan.predicted_stall_s,  # against the measured stall_s_per_step
            # Note: [Predicted against measured overhead]
            predicted_overhead=plan.predicted_step_s / plan.compute_s - 1.0 if plan.compute_s else None,
            baseline_peak_bytes=plan.baseline_peak_bytes,
            budget_bytes=plan.budget_bytes,
            solver=plan.solver,
            solver_status=plan.stats.status,
            io_path=stats.get("io_path"),
            recomputed_bytes=plan.recomputed_bytes,
            recompute_s=plan.recompute_s,
            hardware=plan.hardware.name,  # "calibrated:<dir>" when the method timed its directory
        )
    if m.budget_raised_from is not None:
        row["budget_raised_from_bytes"] = m.budget_raised_from
    return row


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    """Train with every method in ``cfg.methods``; return ``{"rows": [...], ...}`` (see docs/cli.md).

    Each method first runs its warm-up (profiling, planning, compiling) and one memory-measurement
    step; then the timed steps run in rounds that alternate the methods (one step of each, or a few in
    a row on short steps: Note: [Timing runs of steps]), so that the shared machine's slow and fast
    periods fall on every method alike.
    """
    cpu_malloc = apply_cpu_malloc(cfg.cpu_malloc)
    base = build_gpt(cfg.model, seed=cfg.seed)
    # The runtime's per-user default directory, not a fresh temp dir: the engine removes its own
    # subdirectory on close, and a later start removes what a killed run left there.
    offload_dir = cfg.offload_dir if cfg.offload_dir is not None else str(default_offload_dir())
    warmup = cfg.profile_steps + 1  # profiling steps, then the step that plans and compiles
    methods: list[_Method] = []
    torch._dynamo.reset()
    if AT_CHECKPOINT in cfg.methods and (
        "checkpoint" not in cfg.methods or cfg.methods.index("checkpoint") > cfg.methods.index(AT_CHECKPOINT)
    ):
        raise ValueError(
            f"{AT_CHECKPOINT} needs the checkpoint method before it: its measured peak is the budget"
        )
    extra: dict[str, dict[str, Any]] = {}  # per method, figures only it has
    # Every method (and each torch-budget probe) compiles its own copy of one model class: one Dynamo
    # cache entry each, past the default limit of 8, beyond which Dynamo would run the model eagerly.
    recompile_limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = max(recompile_limit, 32)
    try:
        for name in cfg.methods:
            budget = None
            if name == TORCH_BUDGET:
                _, extra[name] = _torch_budget(base, cfg, warmup, methods)
                continue
            if name == AT_CHECKPOINT:
                budget = next(m.peak_bytes for m in methods if m.name == "checkpoint")
            try:
                m = _warm_up(name, base, cfg, offload_dir, budget, warmup, methods)
            except BudgetError as e:
                # Checkpointing may reach a peak teraio cannot: what neither an offload nor a rebuild
                # removes (the logits, the loss, an op's scratch) can exceed what checkpointing's
                # own graph holds. The row then plans for teraio's smallest peak, and says so.
                if name != AT_CHECKPOINT or e.smallest_peak_bytes is None:
                    raise
                if methods and methods[-1].name == name:  # the failed attempt, if it got that far
                    methods.pop().backend.close()
                log.warning(
                    "%s: the checkpoint peak %s is below teraio's smallest achievable step peak %s; "
                    "planning for that instead",
                    name,
                    format_size(budget),
                    format_size(e.smallest_peak_bytes),
                )
                m = _warm_up(name, base, cfg, offload_dir, e.smallest_peak_bytes, warmup, methods)
                m.budget_raised_from = budget
        same_step(methods, cfg)
        round_steps = round_steps_for(methods, cfg)
        switch_steps = run_rounds(methods, cfg, round_steps)
        by_name = {m.name: m for m in methods}
        ref = by_name.get("no-offload")
        rows = [{**_row(m, ref), **extra.get(m.name, {})} for m in methods]
    finally:
        torch._dynamo.config.recompile_limit = recompile_limit
        for m in methods:
            m.backend.close()
    for row in rows:
        if cfg.on_row is not None:
            cfg.on_row(row)
    ref_row = next((r for r in rows if r["method"] == "no-offload"), None)
    for r in rows:
        if ref_row is not None and ref_row["peak_bytes"]:
            r["peak_vs_no_offload"] = r["peak_bytes"] / ref_row["peak_bytes"]
    result: dict[str, Any] = {
        "model": cfg.model,
        "config": base.cfg.to_dict(),
        "inner": cfg.inner,
        "budget": cfg.budget,
        "steps": cfg.steps,
        # Timed steps of one method in a row per round, and the untimed switch steps each method ran
        # (Note: [Timing runs of steps]).
        "round_steps": round_steps,
        "switch_steps": switch_steps,
        "cpu_malloc": cpu_malloc,
        "rows": rows,
        # Saved activations of one step without offload (the bytes a plan can move).
        "activation_bytes": next((r["activation_bytes"] for r in rows if r["method"] == "no-offload"), None),
        "torch_version": torch.__version__,
    }
    # A teraio row the partitioner search ran at another ratio computes with other kernels than no-offload's
    # (on Inductor, other last bits): its losses are not compared, and the result says so.
    other_partition = {
        n: ratios
        for n in ("teraio", AT_CHECKPOINT)
        if n in by_name
        and (ratios := sorted({r.partitioner_budget for r in by_name[n].backend.runners} - {None, 1.0}))
    }
    if other_partition:
        result["partitioner_budget_by_method"] = other_partition
    if "no-offload" in by_name:
        a = by_name["no-offload"].losses
        same = {
            n: len(a) == len(by_name[n].losses)
            and all(torch.equal(x, y) for x, y in zip(a, by_name[n].losses))
            for n in ("teraio", AT_CHECKPOINT)
            if n in by_name and n not in other_partition
        }
        if same:
            result["losses_bit_identical"] = all(same.values())
            result["losses_bit_identical_by_method"] = same
            # Which steps differ (0 is the first; the first profile_steps profile the graph), and by how
            # much: a difference only in profiling steps, with the later steps equal, is not the plan's.
            result["loss_differences_by_method"] = {
                n: [
                    {"step": i, "abs_diff": float((x - y).abs())}
                    for i, (x, y) in enumerate(zip(a, by_name[n].losses))
                    if not torch.equal(x, y)
                ]
                for n in same
            }
    return result
