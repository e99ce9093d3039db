"""Planner benchmark: solve time, predicted step time and peak of ``all``, ``greedy`` and ``ilp`` on
synthetic 12-, 24- and 48-layer GPT profiles (and on a real profile directory when given).

Every figure is the simulator's prediction for the solver's plan under the same hardware model, so the
solvers are compared in one run on one judge. Solve time is wall time of ``planner.solve.solve`` (greedy
warm start included in ``ilp``'s).

    python -m benchmarks.bench_planner [--layers 12 24 48] [--budget 50% 25%] [--time-limit 60] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import pandas as pd

SOLVERS = ("all", "greedy", "ilp")


def machine_info() -> dict:
    """Versions and machine facts printed with every run."""
    import numpy
    import ortools

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "ortools": ortools.__version__,
        "pandas": pd.__version__,
        "numpy": numpy.__version__,
    }


def run(
    layers: tuple[int, ...] = (12, 24, 48),
    budgets: tuple[str, ...] = ("50%", "25%"),
    solvers: tuple[str, ...] = SOLVERS,
    time_limit_s: float = 60.0,
    workers: int = 2,
    hidden: int = 384,
    seq: int = 512,
    batch: int = 8,
    profile_dirs: tuple[str, ...] = (),
) -> pd.DataFrame:
    """One row per (profile, budget, solver) with the simulated figures of the plan."""
    from teraio.planner.budget import BudgetError
    from teraio.planner.hardware import HardwareModel
    from teraio.planner.lifetimes import analyse
    from teraio.planner.profile import Profile
    from teraio.planner.solve import solve
    from teraio.planner.synth import synth_profile

    hardware = HardwareModel()
    cases = [(f"synth-{n}L", synth_profile(layers=n, hidden=hidden, seq=seq, batch=batch)) for n in layers]
    cases += [(f"profile:{Path(d).name}", Profile.load(d)) for d in profile_dirs]
    rows = []
    for label, profile in cases:
        lt = analyse(profile)
        for budget in budgets:
            for solver in solvers:
                row = {
                    "profile": label,
                    "ops": lt.num_ops,
                    "candidates": len(lt.candidates),
                    "budget": budget,
                    "solver": solver,
                    "baseline_peak_bytes": lt.baseline_peak_bytes,
                    "compute_s": lt.compute_s,
                }
                t0 = time.perf_counter()
                try:
                    plan = solve(
                        profile,
                        budget,
                        solver,
                        hardware,
                        time_limit_s=time_limit_s,
                        workers=workers,
                        lifetimes=lt,
                    )
                except BudgetError as e:
                    row.update(status="NO PLAN", solve_s=time.perf_counter() - t0, error=str(e))
                    rows.append(row)
                    continue
                row.update(
                    status=plan.stats.status,
                    solve_s=time.perf_counter() - t0,
                    budget_bytes=plan.budget_bytes,
                    peak_bytes=plan.predicted_peak_bytes,
                    within_budget=plan.predicted_peak_bytes <= plan.budget_bytes,
                    step_s=plan.predicted_step_s,
                    stall_s=plan.predicted_stall_s,
                    moved_bytes=plan.moved_bytes,
                    gap=plan.stats.gap,
                    chosen=plan.stats.extra.get("chosen", ""),
                )
                rows.append(row)
    return pd.DataFrame(rows)


def to_markdown(df: pd.DataFrame) -> str:
    """The table quoted in reports: MiB, seconds, slowdown over compute."""
    mib = 2**20
    out = df.copy()
    out["peak MiB"] = (out.get("peak_bytes", 0) / mib).round(1)
    out["budget MiB"] = (out.get("budget_bytes", 0) / mib).round(1)
    out["moved MiB"] = (out.get("moved_bytes", 0) / mib).round(1)
    out["step s"] = out.get("step_s").round(3)
    out["stall s"] = out.get("stall_s").round(3)
    out["solve s"] = out["solve_s"].round(2)
    out["vs compute"] = (out["step_s"] / out["compute_s"]).round(3)
    cols = [
        "profile",
        "budget",
        "solver",
        "status",
        "solve s",
        "step s",
        "stall s",
        "vs compute",
        "peak MiB",
        "budget MiB",
        "moved MiB",
    ]
    table = out[cols]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in table.itertuples(index=False)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_planner", description=__doc__.splitlines()[0]
    )
    p.add_argument("--layers", type=int, nargs="+", default=[12, 24, 48])
    p.add_argument(
        "--budget", nargs="+", default=["50%", "25%"], help="budgets to plan for (default 50%% 25%%)"
    )
    p.add_argument("--solvers", nargs="+", default=list(SOLVERS))
    p.add_argument("--time-limit", type=float, default=60.0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--profile", action="append", default=[], help="also plan this profile directory")
    p.add_argument("--json", action="store_true", help="print rows as JSON instead of a table")
    p.add_argument("--out", help="also write the rows to this CSV file")
    args = p.parse_args(argv)
    info = machine_info()
    df = run(
        layers=tuple(args.layers),
        budgets=tuple(args.budget),
        solvers=tuple(args.solvers),
        time_limit_s=args.time_limit,
        workers=args.workers,
        profile_dirs=tuple(args.profile),
    )
    if args.out:
        df.to_csv(args.out, index=False)
    if args.json:
        print(json.dumps({"machine": info, "rows": json.loads(df.to_json(orient="records"))}, indent=2))
    else:
        print(" ".join(f"{k}={v}" for k, v in info.items()), file=sys.stderr)
        print(to_markdown(df))
    return 0


if __name__ == "__main__":
    sys.exit(main())
