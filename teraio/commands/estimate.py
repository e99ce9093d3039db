"""``teraio estimate``: plan a model on hardware this machine does not have, from its real training graph.

Captures TARGET's step with fake tensors (nothing materialised), prices each op with the preset's
roofline, writes the estimated Profile, plans it with each solver and prints what a user asks before
buying: unplanned and planned peak, step time and fraction of ideal, bytes moved per step by kind, and
the SSD bandwidth the step needs to hide its I/O.
"""

from __future__ import annotations

import argparse
import json

from teraio.commands.plan import add_force_option, check_count, check_time_limit, console
from teraio.commands.simulate import _bw
from teraio.errors import UserInputError
from teraio.planner.safe_io import check_output_dir
from teraio.sizes import format_size


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "estimate",
        help="estimate peak memory and step time of a model on GPU hardware, without a GPU (writes a Profile and plans)",
        description="Capture TARGET's training step with fake tensors (no weight is materialised), give each op "
        "a roofline duration on the hardware PRESET, write the estimated Profile, and plan it with each solver: "
        "unplanned and planned peak, step time and fraction of ideal, bytes moved per step by kind, and the SSD "
        "bandwidth needed to hide the I/O. Figures are estimates, never measurements.",
    )
    p.add_argument(
        "target",
        help="builtin:tiny | builtin:demo | hf:llama-8b | hf:llama-70b | hf:gpt2-xl | hf:t5-3b | path/to/file.py:fn",
    )
    p.add_argument(
        "--hardware",
        required=True,
        help="a preset (h100-nvl-4x990pro, h100-sxm-1ssd, a100-40g-g10, cpu-local) or a preset JSON file",
    )
    p.add_argument("--batch", type=int, help="batch size per device (builtin: and hf: targets)")
    p.add_argument("--seq", type=int, help="sequence length (builtin: and hf: targets)")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="parameter and compute dtype (default float32)",
    )
    p.add_argument("--layers", type=int, help="override the model's layer count (builtin: and hf: targets)")
    p.add_argument(
        "--gpus", type=int, default=1, help="data-parallel devices; this is one device's share (default 1)"
    )
    p.add_argument(
        "--zero-stage",
        type=int,
        choices=[0, 1, 2, 3],
        help="how model states are sharded over --gpus, as ZeRO stages (default 3 with several GPUs, else 0)",
    )
    p.add_argument(
        "--optimizer", choices=["adamw", "adam", "sgd-momentum", "sgd"], default="adamw", help="default adamw"
    )
    p.add_argument(
        "--states",
        choices=["auto", "resident", "streamed"],
        default="auto",
        help="model states on the device, or streamed from the SSDs (auto: resident when they fit)",
    )
    p.add_argument(
        "--budget",
        default="device",
        help="activation budget: device (the device's memory less the model states held there; default), "
        "a size (80GB), a fraction of the unplanned peak (40%%) or auto",
    )
    p.add_argument(
        "--solvers", default="greedy,ilp", help="comma-separated solvers to plan with (default greedy,ilp)"
    )
    p.add_argument(
        "--time-limit", type=float, default=60.0, help="each solver's time limit, seconds (default 60)"
    )
    p.add_argument("--workers", type=int, default=2, help="CP-SAT worker threads (default 2)")
    p.add_argument(
        "--inner",
        choices=["inductor", "eager"],
        default="inductor",
        help="the inner compiler the graph is captured for (default inductor)",
    )
    p.add_argument("--tf32", action="store_true", help="float32 matmuls on tensor cores (TF32 rates)")
    p.add_argument("--ssd-bw", help="what-if: per-SSD read and write bandwidth, bytes/s with units (7GB)")
    p.add_argument("--ssds", type=int, help="what-if: number of SSDs striped together")
    p.add_argument("--out", "-o", required=True, help="directory to write the estimate into")
    add_force_option(p)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


def _solvers(text: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    if not names:
        raise UserInputError("--solvers is empty; name at least one solver, e.g. greedy,ilp")
    return names


def run(args: argparse.Namespace) -> int:
    from teraio.planner.limits import MAX_DEVICES, MAX_SYNTH_DIM, MAX_SYNTH_LAYERS, MAX_WORKERS

    # Every number is checked before any tracing (one line naming the option), as the other commands do.
    check_time_limit(args.time_limit)
    check_count(args.workers, "--workers", 1, MAX_WORKERS)
    check_count(args.gpus, "--gpus", 1, MAX_DEVICES)
    if args.ssds is not None:
        check_count(args.ssds, "--ssds", 1, MAX_DEVICES)
    for value, option, most in (
        (args.batch, "--batch", MAX_SYNTH_DIM),
        (args.seq, "--seq", MAX_SYNTH_DIM),
        (args.layers, "--layers", MAX_SYNTH_LAYERS),
    ):
        if value is not None:
            check_count(value, option, 1, most)
    ssd_bw = _bw(args.ssd_bw, "--ssd-bw") if args.ssd_bw is not None else None
    out = check_output_dir(args.out, ("estimate",), force=args.force)
    # Heavy imports only now: `teraio --help` stays fast.
    from teraio.planner.costmodel import CostModelError
    from teraio.tools.estimate import run_estimate

    try:
        result = run_estimate(
            args.target,
            args.hardware,
            batch=args.batch,
            seq=args.seq,
            dtype=args.dtype,
            layers=args.layers,
            gpus=args.gpus,
            zero_stage=args.zero_stage,
            optimizer=args.optimizer,
            states=args.states,
            budget=args.budget,
            solvers=_solvers(args.solvers),
            time_limit_s=args.time_limit,
            workers=args.workers,
            inner=args.inner,
            tf32=args.tf32,
            ssds=args.ssds,
            ssd_bw_bytes_per_s=ssd_bw,
        )
    except CostModelError as e:
        raise UserInputError(str(e)) from None
    written = result.write(out, force=args.force)
    summary = {**result.summary(), "out": str(written)}
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
        return 0
    _print(summary)
    return 0


def _count(n: int) -> str:
    for div, unit in ((1e9, " B"), (1e6, " M"), (1e3, " k")):
        if n >= div:
            return f"{n / div:.4g}{unit}"
    return str(n)


def _gbps(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e9:.2f} GB/s"


def _print(s: dict) -> None:
    from rich.table import Table

    c = console()
    st = s["model_states"]
    settings = s["settings"]
    shape = ", ".join(
        f"{k} {settings[k]}"
        for k in ("batch", "seq", "dtype", "layers", "num_hidden_layers", "n_layer")
        if k in settings
    )
    c.print(
        f"[bold]{s['target']}[/] on [bold]{s['hardware']}[/] ({s['hardware_model']}): estimated from the "
        f"captured graph and the preset's roofline, not measured -> {s['out']}\n"
        f"  {_count(s['num_params'])} parameters; {shape}; captured in {s['capture_s']:.1f} s, "
        f"planned in {s['plan_s']:.1f} s\n"
        f"  model states per device ({st['precision']}, {st['optimizer']}, {st['gpus']} GPU(s), ZeRO stage "
        f"{st['zero_stage']}, {s['states_mode']}): parameters {format_size(st['param_nbytes'])}, gradients "
        f"{format_size(st['grad_nbytes'])}, optimizer states {format_size(st['optimizer_state_nbytes'])}, "
        f"gathered layer {format_size(st['gathered_nbytes'])}, elsewhere {format_size(st['offloaded_nbytes'])}\n"
        f"  {s['states_note']}\n"
        f"  budget {format_size(s['budget']) if isinstance(s['budget'], int) else s['budget']}: "
        f"{s['budget_note']}"
    )
    traffic = s["state_traffic_per_step"]
    for g in s["graphs"]:
        t = Table(
            title=f"graph {g['graph_id']}: {g['fwd_ops']} + {g['bwd_ops']} ops, activations "
            f"{format_size(g['activation_bytes'])}, unplanned peak {format_size(g['unplanned_peak_bytes'])}, "
            f"ideal step {g['compute_s']:.4g} s"
        )
        for col in (
            "solver",
            "status",
            "planned peak",
            "step s",
            "of ideal",
            "activations out/in per step",
            "SSD bw to hide",
            "solve s",
        ):
            t.add_column(col, justify="left" if col in ("solver", "status") else "right")
        for r in g["plans"]:
            if "planned_peak_bytes" not in r:
                t.add_row(r["solver"], r["status"], "-", "-", "-", "-", "-", "-")
                continue
            t.add_row(
                f"{r['solver']} ({r['recompute']})",
                r["status"],
                format_size(r["planned_peak_bytes"]),
                f"{r['step_s']:.4g}",
                f"{100 * r['fraction_of_ideal']:.1f}%",
                f"{format_size(r['activation_written_bytes'])} / {format_size(r['activation_read_bytes'])}",
                _gbps(r["needed_ssd_bw_bytes_per_s"]),
                f"{r['solve_s']:.1f}",
            )
        c.print(t)
        for r in g["plans"]:
            if "error" in r:
                c.print(f"  {r['solver']}: {r['error']}")
        if traffic:
            parts = ", ".join(
                f"{k} {format_size(v['read_bytes'])} in / {format_size(v['write_bytes'])} out"
                for k, v in traffic.items()
            )
            bounds = ", ".join(
                f"{r['solver']} {100 * r['fraction_of_ideal_bound_with_states']:.1f}% "
                f"(SSDs busy {r['total_io_s']:.3g} s; average {_gbps(r['average_ssd_bw_needed_bytes_per_s'])} needed)"
                for r in g["plans"]
                if r.get("fraction_of_ideal_bound_with_states") is not None
            )
            c.print(f"  streamed model states per step: {parts}\n  with them, at most: {bounds}")
