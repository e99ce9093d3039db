"""``teraio plan``: turn a Profile and a memory budget into a Plan file (plus helpers shared by the
planner commands: loading a profile argument, a progress bar only on terminals, the hardware option)."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from teraio.commands.by_kind import by_kind_rows, step_bytes_by_kind
from teraio.errors import UserInputError
from teraio.planner.safe_io import check_output_file
from teraio.sizes import format_size


# --------------------------------------------------------------------------------- shared helpers
def load_profile_arg(path: str):
    """Load a single-graph profile directory; a multi-graph one names its graphs in the error."""
    from teraio.planner.profile import Profile
    from teraio.planner.safe_io import InputError, load_json

    p = Path(path)
    index = p / "index.json"
    if os.path.lexists(index):
        try:
            graphs = load_json(index, what="profile index").get("graphs", [])  # regular file, bounded
        except (InputError, AttributeError):
            graphs = []
        if not isinstance(graphs, list) or not graphs or not all(isinstance(g, str) for g in graphs):
            graphs = []
        raise UserInputError(
            f"profile '{p}' holds {len(graphs)} graphs ({', '.join(graphs)}); plan each one, e.g. '{p / graphs[0]}'"
            if graphs
            else f"profile '{p}' has an unreadable index.json"
        )
    return Profile.load(p)


def check_time_limit(seconds: float, option: str = "--time-limit") -> float:
    """A solver time limit: a finite number of seconds above 0 and at most ``planner.limits``'s (NaN
    passed ``<= 0`` checks and reached the solver)."""
    from teraio.planner.limits import MAX_TIME_LIMIT_S

    if not (math.isfinite(seconds) and 0 < seconds <= MAX_TIME_LIMIT_S):
        raise UserInputError(
            f"{option} must be positive and at most {MAX_TIME_LIMIT_S:g} seconds, got {seconds}"
        )
    return seconds


def check_count(value: int, option: str, lo: int, hi: int) -> int:
    """An integer option within ``lo..hi`` (one line naming the option otherwise)."""
    if value < lo:
        raise UserInputError(f"{option} must be at least {lo}, got {value}")
    if value > hi:
        raise UserInputError(f"{option} must be at most {hi}, got {value}")
    return value


def add_force_option(p: argparse.ArgumentParser) -> None:
    """``--force``: the one way to let a command replace an existing output."""
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an existing output file or directory (a directory that is not teraio's is moved "
        "aside, never deleted)",
    )


def load_hardware_arg(path: str | None):
    from teraio.planner.hardware import HardwareModel

    return HardwareModel.load(path) if path else HardwareModel()


@contextlib.contextmanager
def progress_callback(label: str) -> Iterator[Any]:
    """A ``progress(fraction, message)`` callback drawing a rich bar when stdout is a terminal, else None."""
    if not sys.stdout.isatty():
        yield None
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), transient=True) as bar:
        task = bar.add_task(label, total=1.0)

        def update(fraction: float, message: str) -> None:
            bar.update(task, completed=fraction, description=f"{label}: {message}" if message else label)

        yield update


def console():
    """A rich Console; when piped, wide enough that tables do not wrap into unreadable columns."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=200)


def add_recompute_option(p: argparse.ArgumentParser, help_prefix: str = "") -> None:
    """``--recompute {off,only,joint}``: what the solver may do besides keeping a tensor."""
    from teraio.planner.solve import RECOMPUTE_MODES

    p.add_argument(
        "--recompute",
        choices=RECOMPUTE_MODES,
        default=None,
        help=f"{help_prefix}off: keep or offload; only: keep or recompute in backward; joint: keep, offload "
        "or recompute in one budget (default: joint with the solvers that plan it, ilp and pipeline; off "
        "with the offload-only baselines greedy and all)",
    )


def plan_summary(plan) -> dict[str, Any]:
    """The figures ``teraio plan --json`` prints."""
    return {
        "status": plan.stats.status,
        "solver": plan.solver,
        "solve_s": plan.stats.wall_s,
        "budget_spec": plan.budget_spec,
        "budget_bytes": plan.budget_bytes,
        "baseline_peak_bytes": plan.baseline_peak_bytes,
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "predicted_step_s": plan.predicted_step_s,
        "predicted_stall_s": plan.predicted_stall_s,
        "compute_s": plan.compute_s,
        "moved_bytes": plan.moved_bytes,
        "moved_tensors": len(plan.offloads),
        "recompute": plan.config.get("recompute", "off"),
        "recomputed_tensors": len(plan.recomputes),
        "recomputed_bytes": plan.recomputed_bytes,
        "recompute_s": plan.recompute_s,
        "lower_bound_s": plan.stats.lower_bound_s,
        "gap": plan.stats.gap,
    }


def recompute_text(plan) -> str:
    """The plan's rebuilds for a table row: count, bytes and compute per step."""
    if not plan.recomputes:
        return "none"
    return (
        f"{len(plan.recomputes)} tensors, {format_size(plan.recomputed_bytes)} rebuilt in backward, "
        f"{plan.recompute_s:.4f} s of compute per step"
    )


def bound_text(plan) -> str:
    """The plan's lower bound and gap for a table row ("-" when the plan has none, e.g. for "auto")."""
    if plan.stats.lower_bound_s is None:
        return "-"
    return f"{plan.stats.lower_bound_s:.4f} s (gap {100 * (plan.stats.gap or 0.0):.1f}%)"


# ---------------------------------------------------------------------------------------- command
def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="plan which saved tensors to offload, and when, under a memory budget (writes a Plan)",
        description="Solve for a Plan: which saved tensors move to which tier, where their writes and reads "
        "start, predicted peak and step time. The budget is bytes (512MiB, 2GB), a fraction of the "
        "unplanned peak (40%%, 0.4), or auto (the smallest peak with no predicted stall).",
    )
    p.add_argument("profile", help="profile directory written by 'teraio profile' or 'teraio synth'")
    p.add_argument("--budget", "-b", required=True, help="memory budget: 512MiB | 2GB | 40%% | 0.4 | auto")
    p.add_argument("--solver", default="ilp", help="ilp | pipeline | greedy | all | none (default ilp)")
    p.add_argument("--time-limit", type=float, default=60.0, help="solver time limit in seconds (default 60)")
    p.add_argument("--workers", type=int, default=2, help="solver worker threads (default 2)")
    p.add_argument("--hardware", help="hardware model JSON (from 'teraio calibrate'); default: built-in")
    add_recompute_option(p)
    p.add_argument("--out", "-o", required=True, help="plan file to write (JSON)")
    add_force_option(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from teraio.planner.limits import MAX_WORKERS
    from teraio.planner.solve import default_recompute, solve

    check_time_limit(args.time_limit)
    check_count(args.workers, "--workers", 1, MAX_WORKERS)
    out = check_output_file(args.out, overwrite=args.force, option="--out")
    profile = load_profile_arg(args.profile)
    hardware = load_hardware_arg(args.hardware)
    with progress_callback(f"planning ({args.solver})") as progress:
        plan = solve(
            profile,
            args.budget,
            args.solver,
            hardware,
            time_limit_s=args.time_limit,
            workers=args.workers,
            progress=progress,
            recompute=args.recompute or default_recompute(args.solver),
        )
    plan.save(out, overwrite=args.force)
    # Every offloaded activation is written once and read once per step.
    kinds = step_bytes_by_kind(
        profile.meta.get("model_states"), plan.moved_bytes, plan.moved_bytes, plan.hardware
    )
    summary = {**plan_summary(plan), **kinds, "out": str(out)}
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    from rich.table import Table

    t = Table(title=f"plan -> {out}", show_header=False)
    t.add_row("solver / status", f"{plan.solver} / {plan.stats.status} ({plan.stats.wall_s:.2f} s)")
    t.add_row("budget", f"{plan.budget_spec} = {format_size(plan.budget_bytes)}")
    t.add_row("peak", f"{format_size(plan.baseline_peak_bytes)} -> {format_size(plan.predicted_peak_bytes)}")
    t.add_row(
        "step",
        f"{plan.compute_s:.4f} s -> {plan.predicted_step_s:.4f} s (stall {plan.predicted_stall_s:.4f} s)",
    )
    t.add_row("lower bound", bound_text(plan))
    t.add_row("moved", f"{len(plan.offloads)} tensors, {format_size(plan.moved_bytes)}")
    t.add_row("recomputed", recompute_text(plan))
    for label, text in by_kind_rows(kinds):
        t.add_row(label, text)
    console().print(t)
    return 0
