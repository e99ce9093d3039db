"""``teraio sweep``: the budget-to-step-time trade-off of one profile, one solve per budget and solver.

Each row is a plan's predicted peak and step time; budgets that cannot be met are rows too (status
NO PLAN, with the smallest achievable peak in the note), so the table always has every budget asked. The
table is ``planner.sweep.budget_sweep``'s, the same the notebooks and the planner benchmark use.
"""

from __future__ import annotations

import argparse
import json

from teraio.commands.plan import (
    add_force_option,
    add_recompute_option,
    check_count,
    check_time_limit,
    console,
    load_hardware_arg,
    load_profile_arg,
    progress_callback,
)
from teraio.errors import UserInputError
from teraio.planner.safe_io import atomic_writer, check_output_file
from teraio.sizes import format_size


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", help="budget-to-step-time table: one plan per budget (CSV with --out)")
    p.add_argument("profile", help="profile directory")
    p.add_argument(
        "--budgets",
        default="100%,75%,50%,25%,auto",
        help="comma-separated budgets (default 100%%,75%%,50%%,25%%,auto)",
    )
    p.add_argument("--solver", default="greedy", help="comma-separated solvers (default greedy)")
    p.add_argument("--time-limit", type=float, default=60.0, help="time limit per solve in seconds")
    p.add_argument("--workers", type=int, default=2, help="solver worker threads")
    p.add_argument("--hardware", help="hardware model JSON; default: built-in")
    add_recompute_option(p, "the mode of each row's plan (the per-mode step columns plan all three): ")
    p.add_argument("--out", help="write the table as CSV here")
    add_force_option(p)
    p.add_argument("--json", action="store_true", help="print the table as JSON records")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import pandas as pd

    from teraio.planner.budget import resolve_budget
    from teraio.planner.solve import solver_info
    from teraio.planner.sweep import budget_sweep

    if args.out is not None:
        check_output_file(args.out, overwrite=args.force, option="--out")
    from teraio.planner.limits import MAX_WORKERS

    check_time_limit(args.time_limit)
    check_count(args.workers, "--workers", 1, MAX_WORKERS)
    budgets = [b.strip() for b in args.budgets.split(",") if b.strip()]
    solvers = [s.strip() for s in args.solver.split(",") if s.strip()]
    if not budgets or not solvers:
        raise UserInputError("--budgets and --solver need at least one comma-separated value")
    for s in solvers:
        solver_info(s)  # unknown names fail before any solving
    profile = load_profile_arg(args.profile)
    for b in budgets:
        resolve_budget(b, 1)  # malformed budgets fail before any solving
    hardware = load_hardware_arg(args.hardware)
    with progress_callback("sweep") as progress:
        df = budget_sweep(
            profile,
            budgets,
            solvers,
            hardware,
            time_limit_s=args.time_limit,
            workers=args.workers,
            progress=progress,
            recompute=args.recompute,
        )
    if args.out is not None:
        with atomic_writer(args.out, overwrite=args.force) as f:
            df.to_csv(f, index=False)
    if args.json:
        print(json.dumps(json.loads(df.to_json(orient="records")), indent=2))
        return 0
    from rich.table import Table

    t = Table(title=f"budget sweep of {args.profile}")
    for col in (
        "solver",
        "budget",
        "status",
        "peak",
        "peak %",
        "step s",
        "stall s",
        "bound s",
        "gap",
        "slowdown",
        "moved",
        "rebuilt",
        "solve s",
        "offload s",
        "recompute s",
        "joint s",
    ):
        t.add_column(col)

    def step(value) -> str:
        return "-" if pd.isna(value) else f"{value:.4f}"

    modes = [step(r.offload_step_s) for r in df.itertuples()]
    for k, r in enumerate(df.itertuples()):
        per_mode = (modes[k], step(r.recompute_step_s), step(r.joint_step_s))
        if pd.isna(r.predicted_peak_bytes):  # no plan for this budget
            t.add_row(r.solver, r.budget_spec, r.status, *["-"] * 10, *per_mode)
            continue
        t.add_row(
            r.solver,
            r.budget_spec,
            r.status,
            format_size(r.predicted_peak_bytes),
            f"{100 * r.peak_fraction:.1f}",
            f"{r.predicted_step_s:.4f}",
            f"{r.predicted_stall_s:.4f}",
            "-" if pd.isna(r.lower_bound_s) else f"{r.lower_bound_s:.4f}",
            "-" if pd.isna(r.gap) else f"{100 * r.gap:.1f}%",
            f"{r.slowdown:.3f}",
            format_size(r.moved_bytes),
            format_size(r.recomputed_bytes),
            f"{r.solve_s:.2f}",
            *per_mode,
        )
    console().print(t)
    for r in df.itertuples():
        if r.note:
            print(f"{r.solver} @ {r.budget_spec}: {r.note}")
    if args.out is not None:
        print(f"wrote {args.out}")
    return 0
