"""``teraio profile``: capture and time a training step, write its Profile(s), print a summary."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from teraio.commands.plan import add_force_option, check_count
from teraio.planner.safe_io import check_output_dir, replace_dir
from teraio.platform.preflight import check_writable_dir
from teraio.sizes import format_size

#: An existing --out of either kind may be replaced (re-profiling a workload whose graph count changed).
PROFILE_KINDS = ("profile", "profile-set")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile",
        help="profile a training step: per-op times and saved-tensor lifetimes (writes a Profile)",
        description="Compile TARGET with the teraio backend, run the profiling steps, and write the Profile "
        "(parquet tables + meta.json). With one captured graph OUT is the profile; with several, OUT/graphN.",
    )
    p.add_argument(
        "target",
        nargs="?",
        default="builtin:tiny",
        help="builtin:tiny | builtin:demo | path/to/file.py:fn (fn() returns (model, batch[, loss_fn]))",
    )
    p.add_argument("--out", "-o", required=True, help="directory to write the profile into")
    add_force_option(p)
    p.add_argument("--steps", type=int, default=3, help="profiling steps; the first is warm-up (default 3)")
    p.add_argument(
        "--inner",
        choices=["inductor", "eager"],
        default="inductor",
        help="inner compiler the profile is for (its decompositions shape the graph)",
    )
    p.add_argument("--top", type=int, default=10, help="how many top tensors to list")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    out = check_output_dir(args.out, PROFILE_KINDS, force=args.force)
    check_writable_dir(out.parent, option="--out")  # written now: profiling takes a while
    from teraio.planner.limits import MAX_ROWS, MAX_STEPS

    check_count(args.steps, "--steps", 1, MAX_STEPS)
    check_count(args.top, "--top", 0, MAX_ROWS)
    # Heavy imports only now: `teraio --help` stays fast.
    from teraio.tools.profile_workload import profile_workload, summarize
    from teraio.tools.workloads import load_workload

    workload = load_workload(args.target)
    profiles = profile_workload(workload, profile_steps=args.steps, inner=args.inner)

    if len(profiles) == 1:
        profiles[0].validate()
        replace_dir(out, "profile", profiles[0].write_files, force=args.force, replaceable=PROFILE_KINDS)
    else:

        def populate(staged: Path) -> None:
            for p in profiles:
                p.validate()
                sub = staged / f"graph{p.meta['graph_id']}"
                sub.mkdir()
                p.write_files(sub)
            names = [f"graph{p.meta['graph_id']}" for p in profiles]
            (staged / "index.json").write_text(json.dumps({"graphs": names}))

        replace_dir(out, "profile-set", populate, force=args.force, replaceable=PROFILE_KINDS)

    summaries = [summarize(p, top=args.top) for p in profiles]
    if args.json:
        print(json.dumps({"target": args.target, "out": str(out), "graphs": summaries}, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for s in summaries:
        console.print(
            f"[bold]{args.target}[/] graph {s['graph_id']} -> {out}\n"
            f"  ops {s['ops']} ({s['fwd_ops']} fwd, {s['bwd_ops']} bwd)   step {s['step_s']:.3f} s "
            f"(fwd {s['fwd_s']:.3f}, bwd {s['bwd_s']:.3f}; profiling interpreter)\n"
            f"  saved storages {s['saved_tensors']} (outputs {s['saved_outputs']}): activations "
            f"{format_size(s['activation_bytes'])}, params {format_size(s['param_bytes'])}, "
            f"inputs {format_size(s['input_bytes'])}"
        )
        table = Table(title=f"top {len(s['top_tensors'])} tensors by bytes x inactive time")
        for col in ("name", "module", "bytes", "inactive s", "MB*s"):
            table.add_column(col, justify="right" if col not in ("name", "module") else "left")
        for r in s["top_tensors"]:
            table.add_row(
                r["name"],
                r["module"],
                format_size(r["nbytes"]),
                f"{r['inactive_s']:.3f}",
                f"{r['byte_s'] / 1e6:.3g}",
            )
        console.print(table)
    return 0
