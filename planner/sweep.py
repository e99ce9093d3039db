"""The budget sweep: one plan per (solver, budget), tabulated. The one implementation behind
``teraio sweep``, ``teraio.tools.analysis.budget_sweep`` (the notebooks) and ``benchmarks.bench_planner``.

A budget no plan can meet is a row too (status ``NO PLAN``, the planner's message in ``note``), so the
table always has every budget asked: the point of a sweep is to see where plans stop existing.

Recompute: each row's plan is made in the sweep's ``recompute`` mode (``recompute`` column;
"off" for a solver that plans offload only, such as ``greedy``), and, with ``compare_modes``, the same
solver also plans the budget offload only, recompute only and joint: ``offload_step_s``,
``recompute_step_s`` and ``joint_step_s`` (NaN where the solver does not plan that mode or no plan of
that mode meets the budget), so the crossover between moving bytes and rebuilding them is visible per
budget. ``recomputed_bytes`` and ``recompute_s`` are the row's plan's rebuilds.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pandas as pd

from teraio.planner.budget import BudgetError
from teraio.planner.hardware import HardwareModel
from teraio.planner.lifetimes import Lifetimes, analyse
from teraio.planner.profile import Profile
from teraio.planner.solve import (
    DEFAULT_RECOMPUTE,
    ProgressFn,
    RecomputeMode,
    default_recompute,
    solve,
    solver_info,
)

#: Status of a row whose budget no plan met.
NO_PLAN = "NO PLAN"

#: Columns of :func:`budget_sweep`, in order.
SWEEP_COLUMNS = (
    "solver",
    "budget_spec",
    "budget_bytes",
    "status",
    "predicted_peak_bytes",
    "peak_fraction",
    "predicted_step_s",
    "predicted_stall_s",
    "compute_s",
    "slowdown",
    "lower_bound_s",
    "gap",
    "moved_bytes",
    "decisions",
    "solve_s",
    "note",
    # Recompute (module docstring); appended so the columns above keep their places.
    "recompute",
    "recomputed_bytes",
    "recompute_s",
    "offload_step_s",
    "recompute_step_s",
    "joint_step_s",
)
#: The per-mode step columns, by recompute mode.
MODE_STEP_COLUMNS = {"off": "offload_step_s", "only": "recompute_step_s", "joint": "joint_step_s"}
_INT_COLUMNS = ("budget_bytes", "predicted_peak_bytes", "moved_bytes", "decisions", "recomputed_bytes")


def budget_sweep(
    profile: Profile,
    budgets: Iterable[str | int | float],
    solvers: Iterable[str] = ("greedy",),
    hardware: HardwareModel | None = None,
    *,
    lifetimes: Lifetimes | None = None,
    progress: ProgressFn | None = None,
    recompute: RecomputeMode | None = DEFAULT_RECOMPUTE,
    compare_modes: bool = True,
    **solve_kwargs: Any,
) -> pd.DataFrame:
    """Plan ``profile`` at each budget with each solver; one row per (solver, budget).

    Args:
        budgets: anything :func:`planner.solve.solve` accepts ("50%", 0.5, "512MiB", bytes, "auto").
        solvers: registered solver names (an unknown name raises UnknownSolverError).
        lifetimes: ``analyse(profile)`` when the caller already has it.
        progress: called with (fraction done, "solver @ budget") before each solve.
        recompute: the mode of each row's plan (module docstring); None: each solver's default
            (:func:`planner.solve.default_recompute`).
        compare_modes: also plan every recompute mode the solver plans, for the per-mode step columns.
        solve_kwargs: passed to :func:`planner.solve.solve` (``time_limit_s``, ``workers``, ...).

    Returns:
        Columns :data:`SWEEP_COLUMNS`; integer columns are nullable (``<NA>`` where no plan exists).
    """
    lt = lifetimes if lifetimes is not None else analyse(profile)
    budgets, solvers = list(budgets), list(solvers)
    rows = []
    total = max(1, len(budgets) * len(solvers))
    for s_i, solver in enumerate(solvers):
        modes = solver_info(solver).recompute_modes
        mode = (
            default_recompute(solver) if recompute is None else (recompute if recompute in modes else "off")
        )
        for b_i, budget in enumerate(budgets):
            if progress is not None:
                progress((s_i * len(budgets) + b_i) / total, f"{solver} @ {budget}")
            row: dict[str, Any] = {
                "solver": solver,
                "budget_spec": str(budget),
                "compute_s": lt.compute_s,
                "recompute": mode,
            }
            steps: dict[str, float] = {}
            for other in modes if compare_modes else ():
                if other == mode:
                    continue
                try:
                    other_plan = solve(
                        profile, budget, solver, hardware, lifetimes=lt, recompute=other, **solve_kwargs
                    )
                    steps[MODE_STEP_COLUMNS[other]] = other_plan.predicted_step_s
                except BudgetError:
                    pass
            try:
                plan = solve(profile, budget, solver, hardware, lifetimes=lt, recompute=mode, **solve_kwargs)
            except BudgetError as e:
                rows.append({**row, **steps, "status": NO_PLAN, "note": str(e)})
                continue
            if compare_modes:
                steps[MODE_STEP_COLUMNS[mode]] = plan.predicted_step_s
            rows.append(
                {
                    **row,
                    **steps,
                    "recomputed_bytes": plan.recomputed_bytes,
                    "recompute_s": plan.recompute_s,
                    "budget_bytes": plan.budget_bytes,
                    "status": plan.stats.status,
                    "predicted_peak_bytes": plan.predicted_peak_bytes,
                    "peak_fraction": plan.predicted_peak_bytes / lt.baseline_peak_bytes
                    if lt.baseline_peak_bytes
                    else 1.0,
                    "predicted_step_s": plan.predicted_step_s,
                    "predicted_stall_s": plan.predicted_stall_s,
                    "slowdown": plan.predicted_step_s / lt.compute_s if lt.compute_s else 1.0,
                    "lower_bound_s": plan.stats.lower_bound_s,
                    "gap": plan.stats.gap,
                    "moved_bytes": plan.moved_bytes,
                    "decisions": len(plan.decisions),
                    "solve_s": plan.stats.wall_s,
                    "note": "",
                }
            )
    df = pd.DataFrame(rows, columns=list(SWEEP_COLUMNS))
    for col in _INT_COLUMNS:
        df[col] = df[col].astype("Int64")
    for col in ("lower_bound_s", "gap", "recompute_s", *MODE_STEP_COLUMNS.values()):
        df[col] = df[col].astype("float64")
    df["note"] = df["note"].fillna("")
    return df
