"""The README's loop on a built-in GPT, whose loss runs eagerly outside every graph: does the measured step
stay within its budget once the memory outside the graphs is planned for?
``python -m benchmarks.bench_outside_memory [--model demo] [--budget 50%] [--steps 24] [--inner eager] [--json]``

One process: ``backend.compile(model)`` with ``teraio.backend(memory_budget=B, inner=...)``, AdamW, the given
steps, then ``backend.stats()``. It reports the budget, the predicted and measured step peaks, how many
plannings the memory outside the graphs took and how much of it was planned for (Note: [Memory outside
the graphs is measured and planned for] in teraio.lifecycle.measurement), the bytes moved per step and the
median running step. Freed CPU memory stays in the process (``--cpu-malloc retain``, the default), as
``teraio demo`` does. It reports; the tests assert (tests/teraio/test_outside_memory.py).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any


def run(model_name: str, budget: str, steps: int, inner: str) -> dict[str, Any]:
    """Train ``model_name`` for ``steps`` steps under ``budget`` and return the figures."""
    import torch

    import teraio
    from teraio.tools.workloads import builtin_workload

    work = builtin_workload(model_name)
    backend = teraio.backend(memory_budget=budget, inner=inner)
    model = backend.compile(work.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    t0 = time.perf_counter()
    try:
        for step in range(steps):
            loss = model(*work.batch_at(step))
            loss.backward()
            opt.step()
            opt.zero_grad()
        stats = backend.stats()
        out = {
            "model": model_name,
            "memory_budget": budget,
            "inner": inner,
            "steps": steps,
            "budget_bytes": stats["step_budget_bytes"],
            "predicted_peak_bytes": stats["predicted_peak_bytes"],
            "measured_peak_bytes": stats["measured_peak_bytes"],
            "outside_plannings": stats["outside_memory_plannings"],
            "outside_bytes": stats["outside_memory_bytes"],
            "moved_bytes_per_step": stats["moved_bytes_per_step"],
            "step_s": stats["step_s"],
            "running_steps": stats["running_steps"],
            "wall_s": time.perf_counter() - t0,
        }
    finally:
        backend.close()
    measured, budget_bytes = out["measured_peak_bytes"], out["budget_bytes"]
    out["measured_vs_budget"] = measured / budget_bytes if measured and budget_bytes else None
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo", choices=["demo", "tiny"], help="the built-in GPT")
    parser.add_argument("--budget", default="50%", help="memory_budget (default 50%%)")
    parser.add_argument("--steps", type=int, default=24, help="training steps (default 24)")
    parser.add_argument("--inner", default="eager", choices=["eager", "inductor"], help="inner compiler")
    parser.add_argument(
        "--cpu-malloc",
        default="retain",
        choices=["retain", "release"],
        help="keep freed CPU memory in the process (default) or glibc's defaults",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, not {args.steps}")
    from teraio.planner.budget import BudgetError, parse_budget

    try:
        parse_budget(args.budget, "--budget")
    except BudgetError as e:
        parser.error(str(e))
    if args.cpu_malloc == "retain":
        from teraio.platform import cpu_malloc

        cpu_malloc.retain_freed_memory()
    out = run(args.model, args.budget, args.steps, args.inner)
    if args.json:
        print(json.dumps(out))
    else:
        for key, value in out.items():
            print(f"{key:>22}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
