"""``teraio demo``: the main job. Train the built-in GPT with no offload, with teraio, and with checkpointing."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from teraio.commands.plan import add_force_option, check_count, check_time_limit
from teraio.errors import UserInputError
from teraio.lifecycle.run_dir import refuse_foreign_run_dir
from teraio.planner.safe_io import check_output_file, write_json
from teraio.platform.preflight import check_writable_dir
from teraio.sizes import format_size


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="train the built-in GPT three ways (no offload, teraio, checkpointing) and compare",
        description="Train the built-in GPT with no offload, with teraio's planned offload, and with full "
        "activation checkpointing, in one run; print peak memory, step time, overhead, bytes moved, "
        "achieved I/O and predicted-vs-measured figures.",
    )
    p.add_argument(
        "--model", default="demo", choices=["demo", "tiny"], help="built-in GPT config (default demo)"
    )
    p.add_argument("--steps", type=int, default=12, help="timed steps per method, run in rounds (default 12)")
    p.add_argument(
        "--round-steps",
        type=int,
        default=None,
        help="timed steps of one method in a row per round, after one untimed switch step when above 1 "
        "(default: 4 on steps under 0.1 s, else 1)",
    )
    p.add_argument("--budget", default="55%", help="teraio memory budget: bytes, units, fraction or auto")
    p.add_argument("--solver", default="ilp", help="planner solver (ilp, greedy, all, none)")
    p.add_argument("--time-limit", type=float, default=30.0, help="solver time limit in seconds")
    p.add_argument("--inner", default="eager", choices=["eager", "inductor"], help="inner compiler")
    p.add_argument(
        "--hardware",
        default="calibrate",
        help="HardwareModel JSON for teraio's plans (teraio calibrate --out), or 'calibrate' (default): "
        "time the offload directory before planning",
    )
    p.add_argument(
        "--offload-dir",
        default=None,
        help="where offloaded bytes go (default: the per-user $XDG_CACHE_HOME/teraio/offload; the run's "
        "files are removed after it, and a killed run's at the next start)",
    )
    p.add_argument(
        "--methods",
        default="no-offload,teraio,torch-budget,checkpoint,teraio@checkpoint",
        help="comma list of methods to run, in order (torch-budget: PyTorch's activation_memory_budget at "
        "the ratio that reaches teraio's measured peak, so it comes after teraio; teraio@checkpoint: teraio "
        "with the checkpoint "
        "method's measured peak as its budget, so it comes after checkpoint)",
    )
    p.add_argument(
        "--cpu-malloc",
        default="retain",
        choices=["retain", "release"],
        help="retain: freed CPU memory stays in the process for reuse, as the CUDA caching allocator "
        "does (default); release: glibc's default, which returns large blocks to the kernel and faults "
        "them in again every step, a cost that grows with the peak (docs/cli.md)",
    )
    p.add_argument("--run-dir", default=None, help="write profile, plan, config and stats here")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--out", default=None, help="also write the JSON result to this file")
    add_force_option(p)
    p.set_defaults(func=run)


def check_run_dir(path: str) -> None:
    """A run directory must be a writable directory, or creatable inside one, and its ``teraio/``
    subdirectory (the backend's run_dir) empty, new, or one a teraio backend wrote."""
    if path == "":
        raise UserInputError("--run-dir is an empty path; give a directory name")
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UserInputError(f"--run-dir '{p}' exists and is not a directory")
    probe = p
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise UserInputError(f"--run-dir '{p}' cannot be written (no writable directory at '{probe}')")
    # The demo's backends write into RUN_DIR/<method>: refuse a foreign one now, not after a method ran.
    for method in ("teraio", "teraio@checkpoint"):
        refuse_foreign_run_dir(p / method, option="--run-dir")


def _table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    rows = result["rows"]
    t = Table(
        title=f"teraio demo: GPT '{result['model']}' {result['config']}, inner={result['inner']}, "
        f"budget {result['budget']}"
    )
    for col in (
        "method",
        "peak",
        "vs no-offload",
        "step s",
        "fwd+bwd s",
        "overhead",
        "moved/step",
        "rebuilt/step",
        "I/O GB/s",
        "predicted peak",
        "predicted step s",
    ):
        t.add_column(col, justify="left" if col == "method" else "right")
    for r in rows:
        t.add_row(
            r["method"],
            format_size(r["peak_bytes"]),
            f"{r.get('peak_vs_no_offload', float('nan')):.1%}",
            f"{r['step_s']:.3f}",
            f"{r['fwd_bwd_s']:.3f}",
            f"{r.get('overhead', float('nan')):+.1%}",
            format_size(r["moved_bytes_per_step"]) if r["moved_bytes_per_step"] else "-",
            format_size(r["recomputed_bytes"]) if r.get("recomputed_bytes") else "-",
            f"{r['io_gb_per_s']:.2f}" if r["io_gb_per_s"] else "-",
            format_size(r["predicted_peak_bytes"]) if "predicted_peak_bytes" in r else "-",
            f"{r['predicted_step_s']:.3f}" if "predicted_step_s" in r else "-",
        )
    console = Console(width=max(Console().width, 132))
    console.print(t)
    k = result.get("round_steps", 1)
    console.print(
        f"timed: {result['steps']} steps per method, in rounds of {k}"
        + (" after an untimed switch step" if k > 1 else " (one step of each method per round)")
    )
    acts = next((r["activation_bytes"] for r in rows if r["method"] == "no-offload"), None)
    if acts:
        console.print(f"saved activations without offload: {format_size(acts)}")
    for tr in rows:
        if "predicted_peak_bytes" not in tr:
            continue
        console.print(
            f"{tr['method']}: plan by {tr['solver']} ({tr['solver_status']}), io path {tr.get('io_path')}; "
            f"measured/predicted peak {tr['peak_bytes'] / tr['predicted_peak_bytes']:.2f}, forward+backward "
            f"{tr['fwd_bwd_s'] / tr['predicted_step_s']:.2f} (predicted {tr['predicted_step_s']:.3f} s)"
            + (
                f"; forward+backward overhead {tr['fwd_bwd_overhead']:+.1%} (predicted {tr['predicted_overhead']:+.1%})"
                if tr.get("fwd_bwd_overhead") is not None and tr.get("predicted_overhead") is not None
                else ""
            )
        )
    for tr in rows:
        if "activation_memory_budget" in tr:
            probes = ", ".join(f"{p['ratio']:g}: {format_size(p['peak_bytes'])}" for p in tr["ratio_probes"])
            console.print(
                f"{tr['method']}: PyTorch's activation_memory_budget "
                + (
                    f"{tr['activation_memory_budget']:g} reaches teraio's peak"
                    if tr["reaches_target"]
                    else f"cannot reach teraio's peak {format_size(tr['target_peak_bytes'])}; shown at "
                    f"{tr['activation_memory_budget']:g}, the ratio that peaked lowest"
                )
                + f" (peak per ratio tried: {probes})"
            )
        if "budget_raised_from_bytes" in tr:
            console.print(
                f"{tr['method']}: the checkpoint peak {format_size(tr['budget_raised_from_bytes'])} is below "
                f"teraio's smallest achievable step peak: planned for {format_size(tr['budget_bytes'])}"
            )
    for name, ratios in result.get("partitioner_budget_by_method", {}).items():
        console.print(
            f"{name}: ran at the partitioner's activation_memory_budget {', '.join(f'{r:g}' for r in ratios)} "
            "(teraio.Solver(partitioner_budget='search')): its losses are not compared with no-offload's, "
            "whose partition differs (on Inductor another partition computes other last bits)"
        )
    if "losses_bit_identical" in result:
        console.print(
            f"losses bit-identical to no-offload: {'yes' if result['losses_bit_identical'] else 'NO'}"
            + "".join(
                f"; {n} differs at steps {', '.join(str(d['step']) for d in diffs)}"
                for n, diffs in result.get("loss_differences_by_method", {}).items()
                if diffs
            )
        )


def run(args: argparse.Namespace) -> int:
    # Everything that needs no torch is checked first, so a bad argument fails in well under a second.
    from teraio.planner.limits import MAX_STEPS

    check_count(args.steps, "--steps", 1, MAX_STEPS)
    if args.round_steps is not None:
        check_count(args.round_steps, "--round-steps", 1, MAX_STEPS)
    # The budget and solver are used only after the first method has run and teraio's has profiled:
    # a typo must fail now, not minutes in. (The unplanned peak a fraction refers to is not known yet,
    # so this only checks that the budget parses and is positive.)
    from teraio.planner.budget import resolve_budget
    from teraio.planner.solve import solver_info

    resolve_budget(args.budget, 1)
    solver_info(args.solver)
    check_time_limit(args.time_limit)
    if args.offload_dir is not None and not Path(args.offload_dir).is_dir():
        raise UserInputError(f"--offload-dir '{args.offload_dir}' is not an existing directory")
    # Outputs are checked now: a demo run takes minutes and must not be lost to a bad path at the end.
    if args.out is not None:
        check_output_file(args.out, overwrite=args.force, option="--out")
    if args.run_dir is not None:
        check_run_dir(args.run_dir)
    # Every directory the run will write, written to now, before any profiling (teraio.platform.preflight).
    if args.offload_dir is not None:
        check_writable_dir(args.offload_dir, option="--offload-dir")
    if args.run_dir is not None:
        check_writable_dir(args.run_dir, option="--run-dir")
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    from teraio.runtime.config import default_offload_dir
    from teraio.tools.demo import AT_CHECKPOINT, METHODS, TORCH_BUDGET, DemoConfig, run_demo

    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise UserInputError(f"--methods: unknown {bad or methods}; choose from {', '.join(METHODS)}")
    if AT_CHECKPOINT in methods and (
        "checkpoint" not in methods or methods.index("checkpoint") > methods.index(AT_CHECKPOINT)
    ):
        raise UserInputError(
            f"--methods: {AT_CHECKPOINT} needs checkpoint before it (its measured peak is the budget)"
        )
    if TORCH_BUDGET in methods and (
        "teraio" not in methods or methods.index("teraio") > methods.index(TORCH_BUDGET)
    ):
        raise UserInputError(
            f"--methods: {TORCH_BUDGET} needs teraio before it (its measured peak is the target)"
        )
    if args.offload_dir is None:  # the per-user default: created if missing, as the runtime will
        check_writable_dir(default_offload_dir(), option="the offload directory")

    def progress(row: dict[str, Any]) -> None:
        if not args.json:
            print(
                f"  {row['method']}: step {row['step_s']:.3f} s, peak {format_size(row['peak_bytes'])}",
                file=sys.stderr,
                flush=True,
            )

    if args.hardware is not None and args.hardware != "calibrate":
        from teraio.commands.plan import load_hardware_arg

        load_hardware_arg(args.hardware)  # a bad file fails now, in one line, not after a method ran
    cfg = DemoConfig(
        hardware=args.hardware,
        model=args.model,
        steps=args.steps,
        round_steps=args.round_steps,
        budget=args.budget,
        solver=args.solver,
        time_limit=args.time_limit,
        inner=args.inner,
        offload_dir=args.offload_dir,
        methods=methods,
        run_dir=args.run_dir,
        cpu_malloc=args.cpu_malloc,
        on_row=progress,
    )
    result = run_demo(cfg)
    if args.out is not None:
        write_json(args.out, result, overwrite=args.force)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _table(result)
    return 0
