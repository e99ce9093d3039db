"""End-to-end benchmark: the demo's five methods in one run (no offload, teraio, PyTorch's
``activation_memory_budget`` at teraio's peak, checkpointing, and teraio with the checkpoint method's
measured peak as its budget).

A thin wrapper over ``teraio.tools.demo.run_demo`` that adds machine and version info and writes the rows as
JSON/CSV. Step times are medians of the timed steps, which run in rounds (one step of each method per
round, or on steps under 0.1 s a few in a row after an untimed switch step: Note [Timing runs of
steps] in teraio.tools.demo) so the shared machine's noise falls on every method alike; warm-up, profiling,
compile and the memory-measurement step are excluded.

    python -m benchmarks.bench_e2e [--model demo] [--budget 55%] [--solver ilp] [--steps 12] [--json] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from typing import Any

import pandas as pd

from teraio.planner.hardware import HardwareError, HardwareModel
from teraio.planner.safe_io import OutputError, atomic_writer, check_output_file

# Page-aligned torch allocations (O_DIRECT reads without a bounce copy); torch reads it at first use.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def machine_info() -> dict[str, Any]:
    import torch

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "thp_mem_alloc_enable": os.environ.get("THP_MEM_ALLOC_ENABLE"),
    }


def run(
    model: str = "demo",
    budget: str = "55%",
    solver: str = "ilp",
    steps: int = 12,
    inner: str = "eager",
    time_limit: float = 30.0,
    offload_dir: str | None = None,
    hardware: str = "calibrate",
) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Rows per method (peak, step time, overhead, bytes moved, predicted figures) and the raw result."""
    from teraio.tools.demo import DemoConfig, run_demo

    result = run_demo(
        DemoConfig(
            model=model,
            budget=budget,
            solver=solver,
            steps=steps,
            inner=inner,
            time_limit=time_limit,
            offload_dir=offload_dir,
            hardware=hardware,
        )
    )
    return pd.DataFrame(result["rows"]), result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo", choices=["demo", "tiny"])
    p.add_argument("--budget", default="55%")
    p.add_argument("--solver", default="ilp")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--inner", default="eager", choices=["eager", "inductor"])
    p.add_argument("--time-limit", type=float, default=30.0)
    p.add_argument("--offload-dir", default=None)
    p.add_argument(
        "--hardware",
        default="calibrate",
        help="HardwareModel JSON for teraio's plans, or 'calibrate' (default): time the offload directory "
        "and, on short steps, price transfers under the model's compute, as teraio demo does",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", default=None, help="write the rows as CSV (replaced if it exists)")
    args = p.parse_args(argv)
    # Checked now: the run takes minutes and must not be lost to a bad path at the end.
    try:
        if args.out is not None:
            check_output_file(args.out, overwrite=True, option="--out")
        if args.hardware != "calibrate":
            HardwareModel.load(args.hardware)
    except OutputError as exc:
        print(f"bench_e2e: {exc}", file=sys.stderr)
        return 2
    except HardwareError as exc:
        print(f"bench_e2e: --hardware: {exc}", file=sys.stderr)
        return 2
    info = machine_info()
    if not args.json:
        print(json.dumps(info), file=sys.stderr)
    df, result = run(
        args.model,
        args.budget,
        args.solver,
        args.steps,
        args.inner,
        args.time_limit,
        args.offload_dir,
        args.hardware,
    )
    if args.out:
        # The safe writer: a fresh temp file renamed over the target, so a planted link is not followed.
        with atomic_writer(args.out, overwrite=True) as f:
            df.to_csv(f, index=False)
    if args.json:
        print(json.dumps({"machine": info, **result}, indent=2, default=str))
    else:
        cols = [
            c
            for c in (
                "method",
                "peak_bytes",
                "peak_vs_no_offload",
                "step_s",
                "overhead",
                "moved_bytes_per_step",
                "io_gb_per_s",
                "predicted_peak_bytes",
                "predicted_step_s",
            )
            if c in df.columns
        ]
        print(df[cols].to_string(index=False))
        print(f"losses bit-identical: {result.get('losses_bit_identical')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
