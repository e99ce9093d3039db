"""``teraio simulate``: replay a Plan on its Profile and predict step time, stall, memory and I/O, with
what-if overrides of the SSD bandwidth, SSD count and budget."""

from __future__ import annotations

import argparse
import json

from teraio.commands.by_kind import by_kind_rows, step_bytes_by_kind
from teraio.commands.plan import add_force_option, check_count, console, load_hardware_arg, load_profile_arg
from teraio.errors import UserInputError
from teraio.planner.safe_io import atomic_writer, check_output_file
from teraio.sizes import format_size


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="predict a plan's step time, stall, memory peak and I/O (with what-if hardware)",
        description="Replay PLAN on PROFILE in the simulator. What-if options change the plan's hardware "
        "model (bandwidths per SSD, number of SSDs) or budget without re-planning. Exits 1 when the plan "
        "violates its budget or ordering rules (listed), 2 on bad input.",
    )
    p.add_argument("profile", help="profile directory the plan was made for")
    p.add_argument("plan", help="plan file written by 'teraio plan'")
    p.add_argument("--hardware", help="hardware model JSON replacing the plan's")
    p.add_argument("--ssd-bw", help="what-if: per-SSD read and write bandwidth, bytes/s with units (2GB)")
    p.add_argument("--ssd-write-bw", help="what-if: per-SSD write bandwidth, bytes/s")
    p.add_argument("--ssd-read-bw", help="what-if: per-SSD read bandwidth, bytes/s")
    p.add_argument("--ssds", type=int, help="what-if: number of SSDs striped together")
    p.add_argument("--budget", help="what-if: check against this budget instead of the plan's")
    p.add_argument("--timeline", help="write the I/O timeline as CSV to this file")
    add_force_option(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def _bw(text: str, option: str) -> float:
    from teraio.planner.budget import BudgetError, parse_size

    try:
        value = parse_size(text)
    except BudgetError:
        raise UserInputError(
            f"{option} {text!r} is not a bandwidth; write bytes per second like 2GB or 1.5e9"
        ) from None
    from teraio.planner.limits import MAX_BW_BYTES_PER_S

    if not 0 < value <= MAX_BW_BYTES_PER_S:
        raise UserInputError(
            f"{option} must be positive and at most {MAX_BW_BYTES_PER_S:g} B/s, got {text!r}"
        )
    return float(value)


def run(args: argparse.Namespace) -> int:
    from teraio.planner.budget import resolve_budget
    from teraio.planner.lifetimes import analyse
    from teraio.planner.plan import Plan
    from teraio.planner.simulate import simulate

    if args.timeline is not None:
        check_output_file(args.timeline, overwrite=args.force, option="--timeline")
    profile = load_profile_arg(args.profile)
    plan = Plan.load(args.plan, expect_fingerprint=profile.fingerprint)
    hw = load_hardware_arg(args.hardware) if args.hardware else plan.hardware
    changes: dict[str, float | int] = {}
    if args.ssd_bw:
        changes["write_bw_bytes_per_s"] = changes["read_bw_bytes_per_s"] = _bw(args.ssd_bw, "--ssd-bw")
    if args.ssd_write_bw:
        changes["write_bw_bytes_per_s"] = _bw(args.ssd_write_bw, "--ssd-write-bw")
    if args.ssd_read_bw:
        changes["read_bw_bytes_per_s"] = _bw(args.ssd_read_bw, "--ssd-read-bw")
    if args.ssds is not None:
        from teraio.planner.limits import MAX_DEVICES

        changes["count"] = check_count(args.ssds, "--ssds", 1, MAX_DEVICES)
    if changes:
        hw = hw.with_overrides("ssd", **changes)
    lt = analyse(profile)
    budget = resolve_budget(args.budget, lt.baseline_peak_bytes) if args.budget else None
    if args.budget and budget is None:
        raise UserInputError("--budget auto has no meaning for a simulation; give bytes or a fraction")
    res = simulate(profile, plan, hw, budget_bytes=budget, lifetimes=lt)
    if args.timeline is not None:
        with atomic_writer(args.timeline, overwrite=args.force) as f:
            res.io_timeline.to_csv(f, index=False)
    # A plan that breaks its budget or ordering rules is a failed check: exit 1 (bad input is 2).
    code = 1 if res.violations else 0
    kinds = step_bytes_by_kind(profile.meta.get("model_states"), res.written_bytes, res.read_bytes, hw)
    if args.json:
        out = {
            **res.summary(),
            **kinds,
            "baseline_peak_bytes": lt.baseline_peak_bytes,
            "plan_predicted_step_s": plan.predicted_step_s,
            "plan_predicted_peak_bytes": plan.predicted_peak_bytes,
            "hardware": hw.to_dict(),
        }
        print(json.dumps(out, indent=2))
        return code
    from rich.table import Table

    t = Table(title=f"simulate {args.plan}", show_header=False)
    t.add_row(
        "step",
        f"{res.step_s:.4f} s (compute {res.compute_s:.4f}, rebuilds {res.recompute_s:.4f}, "
        f"stall {res.stall_s:.4f}, I/O interference {res.interference_s:.4f})",
    )
    t.add_row(
        "peak",
        f"{format_size(res.peak_bytes)} at op {res.peak_idx} (unplanned "
        f"{format_size(lt.baseline_peak_bytes)}, budget {format_size(res.budget_bytes)})",
    )
    t.add_row("I/O per step", f"written {format_size(res.written_bytes)}, read {format_size(res.read_bytes)}")
    t.add_row(
        "recompute per step",
        f"{format_size(res.recomputed_bytes)} rebuilt, {res.recompute_s:.4f} s of compute"
        if res.recomputed_bytes
        else "none",
    )
    for label, text in by_kind_rows(kinds):
        t.add_row(label, text)
    t.add_row("SSD wear", f"{res.ssd_tb_written_per_day:.2f} TB written per day")
    worst = res.stall_s_per_op.argsort()[::-1][:3]
    t.add_row(
        "worst stalls",
        ", ".join(f"op {i} {res.stall_s_per_op[i]:.4f} s" for i in worst if res.stall_s_per_op[i] > 0)
        or "none",
    )
    console().print(t)
    for v in res.violations:
        print(f"violation: {v}")
    return code
