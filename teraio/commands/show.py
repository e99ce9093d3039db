"""``teraio show``: a readable summary of a Plan file: predicted figures, and the tensors moved or
recomputed, by layer. Recompute decisions carry their rebuild time, so no profile is needed. Given a
backend's run directory (``run_dir``), it summarises every graph's plan and the last line of the run's
statistics; under ``torchrun`` every rank writes its own ``rank<r>/``, and it summarises each.

Layers come from each decision's ``module`` label (stored in the plan by the solvers); ``--profile``
fills the label for plans whose decisions lack it and checks the plan belongs to that profile.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

from teraio.commands.plan import bound_text, console, load_profile_arg, plan_summary, recompute_text
from teraio.errors import UserInputError
from teraio.sizes import format_size

if TYPE_CHECKING:
    from teraio.planner.hardware import HardwareModel

_LAYER_RE = re.compile(r"^(.*?\.\d+)(?:\.|$)")


def layer_of(module: str) -> str:
    """The layer a module path belongs to: up to its first numeric part ("blocks.3.attn" -> "blocks.3")."""
    if not module:
        return "(unknown)"
    m = _LAYER_RE.match(module)
    return m.group(1) if m else module


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("show", help="summarise a plan: predicted figures and moved tensors by layer")
    p.add_argument(
        "plan",
        help="plan file written by 'teraio plan', or a backend's run directory (one rank's or a distributed "
        "run's, with rank0/, rank1/, ...)",
    )
    p.add_argument(
        "--profile", help="the plan's profile: checks the plan against it and fills missing layer labels"
    )
    p.add_argument(
        "--tensors", action="store_true", help="also list every moved or recomputed tensor (action column)"
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


def _run_dir_summary(path: str) -> dict:
    """Per rank, per graph: the plan's figures, and the last ``stats.jsonl`` line of the rank's run."""

    from teraio.planner.plan import Plan
    from teraio.planner.safe_io import load_json

    root = Path(path)
    ranks = sorted(
        (p for p in root.glob("rank*") if p.is_dir() and p.name[4:].isdigit()), key=lambda p: int(p.name[4:])
    )
    out: dict = {"run_dir": str(root), "ranks": {}}
    for rank_dir in ranks or [root]:
        graphs = []
        for plan_file in sorted(rank_dir.glob("graph*/plan.json"), key=lambda p: int(p.parent.name[5:] or 0)):
            plan = Plan.load(plan_file)
            graphs.append({"graph": plan_file.parent.name, **plan_summary(plan)})
            # A graph called several times per step with a plan per call: each later call's own plan.
            calls = sorted(plan_file.parent.glob("plan_call*.json"), key=lambda p: int(p.stem[9:] or 0))
            for call_file in calls:
                call = Plan.load(call_file)
                graphs.append(
                    {"graph": f"{plan_file.parent.name} call {call_file.stem[9:]}", **plan_summary(call)}
                )
        last = per_step = None
        over: list[dict] = []
        stats = rank_dir / "stats.jsonl"
        if stats.is_file():
            parsed = [json.loads(ln) for ln in stats.read_text().splitlines() if ln.strip()]
            last = parsed[-1] if parsed else None
            per_step = _last_step_io(parsed[-2:], _load_hardware(rank_dir / "hardware.json"))
            over = _over_budget(parsed)
        config = rank_dir / "config.json"
        out["ranks"][rank_dir.name[4:] if ranks else "0"] = {
            "graphs": graphs,
            "last_step": last,
            "step_io": per_step,
            "whole_step_over_budget": over,
            "run_id": load_json(config).get("run_id") if config.is_file() else None,
        }
    if not any(r["graphs"] or r["last_step"] for r in out["ranks"].values()):
        raise UserInputError(
            f"'{path}' is a directory but holds no teraio run (no graph*/plan.json, no stats.jsonl)"
        )
    return out


def _load_hardware(path: Path) -> HardwareModel | None:
    """The hardware model a run planned with (None: the run wrote none, or it cannot be read)."""
    from teraio.planner.hardware import HardwareError, HardwareModel

    if not path.is_file():
        return None
    try:
        return HardwareModel.load(path)
    except (HardwareError, OSError, ValueError):
        return None


def _last_step_io(lines: list[dict], hardware: HardwareModel | None) -> dict | None:
    """Bytes written and read by kind in the last step (the difference of the last two ``stats.jsonl``
    lines, which are cumulative and written as each step's backward ends: one step's I/O, the optimizer
    step before it included), and the step's I/O lower bound: those bytes over the disk's bandwidth in
    ``hardware.json`` (writes and reads share the disk, so their times add). None: fewer than two
    consecutive steps, or a run older than these keys."""
    if len(lines) < 2 or lines[1].get("step") != lines[0].get("step", -2) + 1:
        return None
    keys = ("written_bytes_by_kind", "read_bytes_by_kind")
    if not all(isinstance(ln.get(k), dict) for ln in lines for k in keys):
        return None
    out: dict = {"step": lines[1]["step"]}
    for k in keys:
        out[k] = {kind: int(n) - int(lines[0][k].get(kind, 0)) for kind, n in lines[1][k].items()}
    out["io_lower_bound_s"] = None
    if hardware is not None:
        from teraio.planner.model_states import io_lower_bound_s

        ssd = hardware.tier("ssd")
        out["io_lower_bound_s"] = io_lower_bound_s(
            sum(out["written_bytes_by_kind"].values()),
            sum(out["read_bytes_by_kind"].values()),
            ssd.total_write_bw_bytes_per_s,
            ssd.total_read_bw_bytes_per_s,
        )
    return out


def _over_budget(lines: list[dict]) -> list[dict]:
    """Each whole-step measurement above its budget, once, with the first step whose line shows it (a
    ``stats.jsonl`` line carries the latest measurement, so consecutive lines repeat it)."""
    out: list[dict] = []
    seen: set[tuple] = set()
    for line in lines:
        whole = line.get("whole_step") or {}
        measured, budget = whole.get("measured_peak_bytes"), whole.get("budget_bytes")
        if measured is None or budget is None or measured <= budget:
            continue
        key = (measured, budget, whole.get("predicted_peak_bytes"))
        if key in seen:
            continue
        seen.add(key)
        out.append(
            {
                "step": line.get("step"),
                "measured_peak_bytes": measured,
                "budget_bytes": budget,
                "predicted_peak_bytes": whole.get("predicted_peak_bytes"),
                "over_fraction": measured / budget - 1,
            }
        )
    return out


def _show_run_dir(args: argparse.Namespace) -> int:
    summary = _run_dir_summary(args.plan)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    from rich.table import Table

    t = Table(title=f"run {summary['run_dir']}")
    for col in ("rank", "graph", "moved", "bytes/step", "recomputed", "predicted peak", "predicted step s"):
        t.add_column(col, justify="left" if col in ("rank", "graph") else "right")
    for rank, r in summary["ranks"].items():
        for g in r["graphs"]:
            t.add_row(
                rank,
                g["graph"],
                str(g["moved_tensors"]),
                format_size(g["moved_bytes"]),
                str(g["recomputed_tensors"]),
                format_size(g["predicted_peak_bytes"]),
                f"{g['predicted_step_s']:.4f}",
            )
    con = console()
    con.print(t)
    for rank, r in summary["ranks"].items():
        if r["last_step"]:
            last = r["last_step"]
            con.print(
                f"rank {rank}: step {last.get('step')} took {last.get('step_s', 0):.4f} s; "
                f"{format_size(last.get('offloaded_bytes', 0))} offloaded, "
                f"{format_size(last.get('prefetched_bytes', 0))} read back so far"
            )
            by_kind = last.get("moved_bytes_by_kind")
            if by_kind:
                con.print(
                    f"rank {rank}: moved so far (written + read) by kind: "
                    + ", ".join(f"{kind} {format_size(n)}" for kind, n in by_kind.items())
                )
        whole = (r["last_step"] or {}).get("whole_step") or {}
        if whole.get("budget_bytes") is not None:
            kept = whole.get("kept") or {}
            measured = whole.get("measured_peak_bytes")
            con.print(
                f"rank {rank}: whole step: budget {format_size(whole['budget_bytes'])} of "
                f"{format_size(whole['state_bytes'] + whole['unplanned_activation_bytes'])}; kept in memory "
                + ", ".join(
                    f"{k} {format_size(n)}" for k, n in (kept.get("kept_bytes_by_kind") or {}).items()
                )
                + f" ({format_size(whole['fixed_bytes'])} of parameters cannot move); predicted peak "
                + f"{format_size(whole['predicted_peak_bytes'])}, measured "
                + (format_size(measured) if measured is not None else "not yet")
            )
        for o in r.get("whole_step_over_budget") or []:
            con.print(
                f"[bold red]rank {rank}: whole step measured OVER its budget[/]: "
                f"{format_size(o['measured_peak_bytes'])} for a budget of {format_size(o['budget_bytes'])} "
                f"({100 * o['over_fraction']:+.1f}%; predicted {format_size(o['predicted_peak_bytes'] or 0)}), "
                f"as of step {o['step']}"
            )
        io = r.get("step_io")
        if io:
            w, rd = io["written_bytes_by_kind"], io["read_bytes_by_kind"]
            con.print(
                f"rank {rank}: step {io['step']} wrote / read by kind: "
                + ", ".join(f"{kind} {format_size(w[kind])} / {format_size(rd.get(kind, 0))}" for kind in w)
                + (
                    f"; I/O lower bound {io['io_lower_bound_s']:.4f} s at the run's disk bandwidth"
                    if io["io_lower_bound_s"] is not None
                    else "; no hardware.json in the run (it is written when a plan is made): no I/O bound"
                )
            )
    return 0


def run(args: argparse.Namespace) -> int:
    import os

    from teraio.planner.plan import Plan

    if os.path.isdir(args.plan):
        return _show_run_dir(args)

    modules: dict[str, str] = {}
    if args.profile:
        profile = load_profile_arg(args.profile)
        plan = Plan.load(args.plan, profile=profile)  # checked completely against its profile
        if "module" in profile.tensors.columns:
            modules = dict(zip(profile.tensors["name"], profile.tensors["module"].fillna("")))
    else:
        plan = Plan.load(args.plan)
    by_layer: dict[str, dict] = defaultdict(
        lambda: {
            "tensors": 0,
            "nbytes": 0,
            "tiers": set(),
            "first_idx": 1 << 62,
            "recomputed": 0,
            "recomputed_bytes": 0,
            "recompute_us": 0.0,
        }
    )
    for d in plan.decisions:
        row = by_layer[layer_of(d.module or modules.get(d.name, ""))]
        # A recompute decision has no write: its drop point orders its layer.
        row["first_idx"] = min(row["first_idx"], d.wait_before_idx if d.recomputed else d.offload_after_idx)
        if d.recomputed:
            row["recomputed"] += 1
            row["recomputed_bytes"] += d.nbytes
            row["recompute_us"] += d.recompute_us
            continue
        row["tensors"] += 1
        row["nbytes"] += d.nbytes
        row["tiers"].add(d.tier)
    layers = [
        {
            "layer": k,
            "tensors": v["tensors"],
            "nbytes": v["nbytes"],
            "tiers": sorted(v["tiers"]),
            "recomputed": v["recomputed"],
            "recomputed_bytes": v["recomputed_bytes"],
            "recompute_s": v["recompute_us"] / 1e6,
        }
        for k, v in sorted(by_layer.items(), key=lambda kv: kv[1]["first_idx"])  # in execution order
    ]
    if args.json:
        out = {
            **plan_summary(plan),
            "fingerprint": plan.fingerprint,
            "hardware": plan.hardware.name,
            "layers": layers,
        }
        if args.tensors:
            out["decisions"] = [d.__dict__ for d in plan.decisions]
        print(json.dumps(out, indent=2))
        return 0
    from rich.table import Table

    con = console()
    head = Table(title=f"plan {args.plan}", show_header=False)
    head.add_row("solver / status", f"{plan.solver} / {plan.stats.status} ({plan.stats.wall_s:.2f} s)")
    head.add_row("budget", f"{plan.budget_spec} = {format_size(plan.budget_bytes)}")
    head.add_row(
        "peak",
        f"{format_size(plan.baseline_peak_bytes)} unplanned -> "
        f"{format_size(plan.predicted_peak_bytes)} predicted",
    )
    head.add_row(
        "step",
        f"{plan.compute_s:.4f} s compute -> {plan.predicted_step_s:.4f} s predicted "
        f"(stall {plan.predicted_stall_s:.4f} s)",
    )
    head.add_row("lower bound", bound_text(plan))
    head.add_row("moved", f"{len(plan.offloads)} tensors, {format_size(plan.moved_bytes)} per step")
    head.add_row("recomputed", recompute_text(plan))
    head.add_row("hardware", plan.hardware.name)
    head.add_row("graph", plan.fingerprint[:16])
    con.print(head)
    t = Table(title="moved tensors by layer (offloaded and recomputed)")
    numeric = ("tensors", "bytes", "recomputed", "rebuilt bytes", "rebuild s")
    for col in ("layer", "tensors", "bytes", "tiers", "recomputed", "rebuilt bytes", "rebuild s"):
        t.add_column(col, justify="right" if col in numeric else "left")
    for row in layers:
        t.add_row(
            row["layer"],
            str(row["tensors"]),
            format_size(row["nbytes"]),
            ",".join(row["tiers"]),
            str(row["recomputed"]),
            format_size(row["recomputed_bytes"]),
            f"{row['recompute_s']:.4f}",
        )
    con.print(t)
    if args.tensors:
        t = Table(title="decisions")
        for col in (
            "tensor",
            "action",
            "tier",
            "bytes",
            "write after",
            "wait before",
            "prefetch before",
            "fetch before",
            "write rank",
            "read rank",
            "rebuild s",
        ):
            t.add_column(col)
        for d in plan.decisions:
            # A recompute decision: dropped at "wait before", rebuilt at "fetch before"; no write, no read.
            t.add_row(
                d.name,
                d.action,
                d.tier or "-",
                format_size(d.nbytes),
                "-" if d.recomputed else f"{d.offload_after_idx} {d.offload_after_name}",
                f"{d.wait_before_idx} {d.wait_before_name}",
                "-" if d.recomputed else f"{d.prefetch_before_idx} {d.prefetch_before_name}",
                f"{d.fetch_before_idx} {d.fetch_before_name}",
                "-" if d.recomputed else str(d.write_rank),
                "-" if d.recomputed else str(d.read_rank),
                f"{d.recompute_us / 1e6:.4f}" if d.recomputed else "-",
            )
        con.print(t)
    return 0
