"""Estimate a training step on hardware this machine does not have, without materialising a weight.

Users decide before they buy SSDs or book GPUs: with this model, batch and hardware, what peak, what
step time, how many drives. ``teraio estimate`` answers from the real training graph: the model and its
batch are built inside a ``FakeTensorMode`` (every tensor is metadata: a 70B-parameter model costs a few
hundred MB of Python objects), torch.compile traces it, and the captured graphs go through AOTAutograd
and the very partitioner hook the backend uses, stopped before code generation. So the saved tensors are
exactly those a real profile of the same model, batch and inner compiler records; what a real profile
measures (op durations, the memory timeline) is estimated from the graph instead.

An estimate runs in four parts, one module each:

- ``teraio.tools.estimate_target``: the target (``builtin:``, ``hf:`` or ``file.py:fn``) built as fake
  tensors, its parameters counted;
- ``teraio.tools.estimated_profile``: each captured graph's Profile, with roofline op durations and a
  static memory census;
- ``teraio.tools.estimate_states``: where the model states live and the activation budget they leave;
- ``teraio.tools.estimate_report``: the result, its JSON summary and its output directory.

This module runs them in order (:func:`run_estimate`, what ``teraio estimate`` calls) and keeps the
public names importable from here.
"""

from __future__ import annotations

import logging
import time

from teraio.errors import UserInputError
from teraio.graph.compilers import InnerCompiler
from teraio.planner.model_states import OPTIMIZERS, Optimizer
from teraio.tools.estimate_report import ESTIMATE_SCHEMA_VERSION, EstimateResult, io_seconds
from teraio.tools.estimate_states import (
    PRECISION_OF_DTYPE,
    STATES_MODES,
    StatesMode,
    activation_budget,
    estimate_states,
)
from teraio.tools.estimate_target import (
    DTYPES,
    HF_MODELS,
    HF_PREFIX,
    DType,
    EstimateTarget,
    build_target,
    count_parameters,
    hf_config,
    require_positive,
)
from teraio.tools.estimated_profile import (
    SAVED_TENSOR_COLUMNS,
    CapturedGraph,
    EstimatedGraph,
    OpWork,
    capture_graphs,
    estimated_profile,
    flop_formulas,
    gradient_storages,
    op_work,
    static_census,
    storages_of,
)

__all__ = [
    "DTYPES",
    "ESTIMATE_SCHEMA_VERSION",
    "HF_MODELS",
    "HF_PREFIX",
    "SAVED_TENSOR_COLUMNS",
    "STATES_MODES",
    "CapturedGraph",
    "DType",
    "EstimateResult",
    "EstimateTarget",
    "EstimatedGraph",
    "OpWork",
    "StatesMode",
    "build_target",
    "capture_graphs",
    "count_parameters",
    "estimated_profile",
    "flop_formulas",
    "gradient_storages",
    "hf_config",
    "io_seconds",
    "op_work",
    "run_estimate",
    "static_census",
    "storages_of",
]

log = logging.getLogger("teraio")


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
    from teraio.planner.costmodel import load_preset
    from teraio.planner.whatif import plan_outcomes

    stage = _check_options(states, optimizer, gpus, zero_stage, solvers, budget)
    preset = load_preset(hardware)
    hw = preset.hardware_with(ssds=ssds, ssd_bw_bytes_per_s=ssd_bw_bytes_per_s)

    t0 = time.perf_counter()
    built = build_target(target, batch=batch, seq=seq, dtype=dtype, layers=layers)
    num_params, largest = count_parameters(built.model)
    captured = capture_graphs(built, inner)
    capture_s = time.perf_counter() - t0

    precision = PRECISION_OF_DTYPE.get(built.settings.get("dtype", "float32"), "fp32")
    device_nbytes = preset.compute.device_memory_bytes
    placed = estimate_states(
        num_params,
        largest_layer_params=largest,
        precision=precision,
        optimizer=optimizer,
        gpus=gpus,
        zero_stage=stage,
        states=states,
        device_nbytes=device_nbytes,
    )
    mode = placed.mode
    planned_budget, budget_note = activation_budget(budget, device_nbytes, placed.held_nbytes, preset.name)

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
        states=placed.states,
        states_mode=mode,
        states_note=placed.note,
        budget=planned_budget,
        budget_note=budget_note,
        graphs=graphs,
        outcomes=outcomes,
        capture_s=capture_s,
        profile_s=profile_s,
        plan_s=plan_s,
    )


def _check_options(
    states: str,
    optimizer: str,
    gpus: int,
    zero_stage: int | None,
    solvers: tuple[str, ...],
    budget: str,
) -> int:
    """Refuse a bad option before anything is traced (one line, with the remedy); the ZeRO stage to use.

    Raises:
        UserInputError: a bad states mode, optimizer, GPU count, ZeRO stage or budget.
        UnknownSolverError: an unknown solver.
    """
    from teraio.planner.budget import BudgetError, resolve_budget
    from teraio.planner.solve import solver_info

    if states not in STATES_MODES:
        raise UserInputError(f"--states must be one of {', '.join(STATES_MODES)}, got {states!r}")
    if optimizer not in OPTIMIZERS:
        raise UserInputError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    require_positive(gpus, "--gpus")
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
    return stage
