"""Planner benchmark: solve time, status, predicted step, stall, lower bound and gap of ``greedy`` (TERAIO's
baseline), ``pipeline`` (the constructive solver) and ``ilp`` on synthetic 12- to 96-layer GPT profiles, on
an I/O-bound and a compute-bound hardware model (and on a real profile directory when given), in each
recompute mode: offload only ("off"), recompute only ("only") and both in one budget ("joint"); greedy
plans offload only.

Every figure is the simulator's prediction for the solver's plan under the same hardware model, so the
solvers are compared in one run on one judge; the lower bound is ``planner.bounds``' (the same for every
solver of a row group). Solve time is wall time of ``planner.solve.solve`` (``ilp`` includes its starts).
The table comes from ``planner.sweep.budget_sweep``, the sweep behind ``teraio sweep`` and the notebooks.

    python -m benchmarks.bench_planner [--layers 12 24 48 96] [--budget 50% 30%] [--hardware io compute]
        [--recompute off only joint] [--time-limit 60] [--json] [--out rows.csv]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import pandas as pd

from teraio.planner.safe_io import OutputError, atomic_writer, check_output_file

SOLVERS = ("greedy", "pipeline", "ilp")
MODES = ("off", "only", "joint")
#: The two hardware models of the benchmark: the default (this project's machine, compute-bound for these
#: profiles) and a slow SSD where I/O is the bottleneck.
HARDWARE = {
    "compute": {},
    "io": {"write_bw_bytes_per_s": 0.3e9, "read_bw_bytes_per_s": 0.2e9},
}


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
    layers: tuple[int, ...] = (12, 24, 48, 96),
    budgets: tuple[str, ...] = ("50%", "30%"),
    solvers: tuple[str, ...] = SOLVERS,
    hardware: tuple[str, ...] = ("io", "compute"),
    time_limit_s: float = 60.0,
    workers: int = 2,
    hidden: int = 384,
    seq: int = 512,
    batch: int = 8,
    profile_dirs: tuple[str, ...] = (),
    deterministic_time_s: float | None = None,
    split: int = 1,
    modes: tuple[str, ...] = MODES,
) -> pd.DataFrame:
    """One row per (profile, hardware, budget, recompute mode, solver that plans it) with the simulated
    figures of the plan; ``vs_greedy`` is against greedy's offload-only plan.

    ``split`` > 1 splits every synthetic op into that many (``planner.synth.split_ops``): a traced
    step's op granularity (80 layers x 7 is about 11k ops).
    """
    from teraio.planner.hardware import HardwareModel
    from teraio.planner.lifetimes import analyse
    from teraio.planner.profile import Profile
    from teraio.planner.solve import solver_info
    from teraio.planner.sweep import budget_sweep
    from teraio.planner.synth import split_ops, synth_profile

    cases = [
        (
            f"synth-{n}L" + (f"x{split}" if split > 1 else ""),
            split_ops(synth_profile(layers=n, hidden=hidden, seq=seq, batch=batch), split),
        )
        for n in layers
    ]
    cases += [(f"profile:{Path(d).name}", Profile.load(d)) for d in profile_dirs]
    parts = []
    for label, profile in cases:
        lt = analyse(profile)
        for hw_name in hardware:
            hw = (
                HardwareModel().with_overrides("ssd", **HARDWARE[hw_name])
                if HARDWARE[hw_name]
                else HardwareModel()
            )
            for budget in budgets:
                per_mode = []
                for mode in modes:
                    planners = [x for x in solvers if mode in solver_info(x).recompute_modes]
                    if not planners:
                        continue
                    per_mode.append(
                        budget_sweep(
                            profile,
                            [budget],
                            planners,
                            hw,
                            lifetimes=lt,
                            recompute=mode,
                            compare_modes=False,
                            time_limit_s=time_limit_s,
                            workers=workers,
                            deterministic_time_s=deterministic_time_s,
                        )
                    )
                df = pd.concat(per_mode, ignore_index=True)
                df.insert(0, "hardware", hw_name)
                df.insert(0, "candidates", len(lt.candidates))
                df.insert(0, "ops", lt.num_ops)
                df.insert(0, "profile", label)
                df["baseline_peak_bytes"] = lt.baseline_peak_bytes
                df["within_budget"] = df["predicted_peak_bytes"] <= df["budget_bytes"]
                greedy = df.loc[(df["solver"] == "greedy") & (df["recompute"] == "off"), "predicted_step_s"]
                df["vs_greedy"] = df["predicted_step_s"] / greedy.iloc[0] if len(greedy) else float("nan")
                parts.append(df)
    out = pd.concat(parts, ignore_index=True)
    # Kept for readers of older CSVs: the same figures under the names this benchmark used before.
    out["step_s"] = out["predicted_step_s"]
    out["stall_s"] = out["predicted_stall_s"]
    out["budget"] = out["budget_spec"]
    return out


def to_markdown(df: pd.DataFrame) -> str:
    """The table quoted in reports: seconds, overhead against the analytic bound, MiB."""
    mib = 2**20
    out = df.copy()
    overhead = out["predicted_step_s"] - out["compute_s"]
    bound_overhead = out["lower_bound_s"] - out["compute_s"]
    out["solve s"] = out["solve_s"].astype(float).round(1)
    out["step s"] = out["predicted_step_s"].astype(float).round(3)
    out["stall s"] = out["predicted_stall_s"].astype(float).round(3)
    out["lower bound s"] = out["lower_bound_s"].astype(float).round(3)
    out["gap"] = (100 * out["gap"].astype(float)).round(1).astype(str) + "%"
    out["overhead / bound"] = (overhead / bound_overhead.where(bound_overhead > 1e-9)).round(3)
    out["vs greedy"] = out["vs_greedy"].astype(float).round(3)
    out["peak MiB"] = (out["predicted_peak_bytes"].astype(float) / mib).round(1)
    out["moved MiB"] = (out["moved_bytes"].astype(float) / mib).round(1)
    out["rebuilt MiB"] = (out["recomputed_bytes"].astype(float) / mib).round(1)
    out["rebuild s"] = out["recompute_s"].astype(float).round(3)
    cols = [
        "profile",
        "hardware",
        "budget",
        "recompute",
        "solver",
        "status",
        "solve s",
        "step s",
        "stall s",
        "lower bound s",
        "gap",
        "overhead / bound",
        "vs greedy",
        "peak MiB",
        "moved MiB",
        "rebuilt MiB",
        "rebuild s",
    ]
    table = out[cols]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in table.itertuples(index=False)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_planner", description=__doc__.splitlines()[0]
    )
    p.add_argument("--layers", type=int, nargs="+", default=[12, 24, 48, 96])
    p.add_argument(
        "--budget", nargs="+", default=["50%", "30%"], help="budgets to plan for (default 50%% 30%%)"
    )
    p.add_argument(
        "--hardware",
        nargs="+",
        default=["io", "compute"],
        choices=sorted(HARDWARE),
        help="io: SSD write 0.3 GB/s, read 0.2 GB/s; compute: the default model (default both)",
    )
    p.add_argument("--solvers", nargs="+", default=list(SOLVERS))
    p.add_argument(
        "--recompute",
        nargs="+",
        default=list(MODES),
        choices=MODES,
        help="recompute modes to plan: off (offload only), only (recompute only), joint (default all three)",
    )
    p.add_argument("--time-limit", type=float, default=60.0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--split", type=int, default=1, help="split every synthetic op into this many (default 1)")
    p.add_argument("--profile", action="append", default=[], help="also plan this profile directory")
    p.add_argument("--json", action="store_true", help="print rows as JSON instead of a table")
    p.add_argument("--out", help="also write the rows to this CSV file (replaced if it exists)")
    args = p.parse_args(argv)
    if args.out is not None:
        try:  # before the solvers run, not after
            check_output_file(args.out, overwrite=True, option="--out")
        except OutputError as exc:
            print(f"bench_planner: {exc}", file=sys.stderr)
            return 2
    info = machine_info()
    df = run(
        layers=tuple(args.layers),
        budgets=tuple(args.budget),
        solvers=tuple(args.solvers),
        hardware=tuple(args.hardware),
        time_limit_s=args.time_limit,
        workers=args.workers,
        profile_dirs=tuple(args.profile),
        split=args.split,
        modes=tuple(args.recompute),
    )
    if args.out:
        # The safe writer: a fresh temp file renamed over the target, so a planted link is not followed.
        with atomic_writer(args.out, overwrite=True) as f:
            df.to_csv(f, index=False)
    if args.json:
        print(json.dumps({"machine": info, "rows": json.loads(df.to_json(orient="records"))}, indent=2))
    else:
        print(" ".join(f"{k}={v}" for k, v in info.items()), file=sys.stderr)
        print(to_markdown(df))
    return 0


if __name__ == "__main__":
    sys.exit(main())
