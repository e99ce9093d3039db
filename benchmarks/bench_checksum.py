"""What checksums cost on the demo: the built-in GPT trained with teraio, checksums on vs off, in one run.

Three methods train fresh copies of the same weights on the same batches, interleaved round by round (one
step of each per round) so the shared machine's slow and fast periods fall on all of them alike:
``no-offload`` (the reference), ``teraio-nocrc`` (``checksum=False``) and ``teraio-crc`` (the default:
per-chunk crc32c computed on write and verified on read). The figure reported is the median over rounds
of (crc step / no-crc step) - 1, next to each one's paired overhead against no offload. On a shared,
loaded machine wall time is noisy, so the process CPU time of each step (``time.process_time``: the
compute threads and the I/O threads that checksum) is reported too: the extra CPU checksums cost per
step, which is what they take from the step on a machine whose cores are busy. Warm-up
(profiling, planning, compiling) and the memory-measurement step are excluded, as in ``teraio demo``.

    python -m benchmarks.bench_checksum [--model demo] [--steps 16] [--json] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import replace
from typing import Any

import torch

from teraio.planner.safe_io import write_json
from teraio.runtime.config import default_offload_dir
from teraio.tools.demo import DemoConfig, _Method, _warm_up, same_step
from teraio.tools.models import build_gpt

VARIANTS = {
    "no-offload": ("no-offload", None),
    "teraio-nocrc": ("teraio", False),
    "teraio-crc": ("teraio", True),
}


def run(model: str = "demo", steps: int = 16, budget: str = "55%", solver: str = "greedy") -> dict[str, Any]:
    """Train the three variants interleaved; return per-variant step times and the paired ratios."""
    cfg = DemoConfig(model=model, steps=steps, budget=budget, solver=solver)
    base = build_gpt(cfg.model, seed=cfg.seed)
    offload_dir = str(default_offload_dir())
    warmup = cfg.profile_steps + 1
    warmed: list[_Method] = []  # in VARIANTS' order; _warm_up appends at once, so the finally closes each
    torch._dynamo.reset()
    try:
        for method, checksum in VARIANTS.values():
            _warm_up(method, base, replace(cfg, checksum=bool(checksum)), offload_dir, None, warmup, warmed)
        methods = dict(zip(VARIANTS, warmed))
        first_timed = same_step(warmed, cfg)
        cpu_s: dict[str, list[float]] = {name: [] for name in methods}
        for r in range(steps):
            for name, m in methods.items():
                c0 = time.process_time()
                step_s, _ = m.step(first_timed + r, cfg)
                cpu_s[name].append(time.process_time() - c0)
                m.times.append(step_s)
        # Straight from the runtime engines: which checksum each really ran, and how many chunks failed.
        engines = {name: methods[name].backend.engine for name in ("teraio-nocrc", "teraio-crc")}
        checksum_used = {name: e.config.checksum if e is not None else None for name, e in engines.items()}
        checksum_failures = sum(e.stats().checksum_failures for e in engines.values() if e is not None)
    finally:
        for m in warmed:
            m.backend.close()
    ref = methods["no-offload"].times
    rows = {
        name: {
            "median_step_s": statistics.median(m.times),
            "paired_overhead_vs_no_offload": statistics.median(t / r for t, r in zip(m.times, ref)) - 1.0,
            "peak_bytes": m.peak_bytes,
            "median_step_cpu_s": statistics.median(cpu_s[name]),
            "step_times_s": m.times,
            "step_cpu_s": cpu_s[name],
        }
        for name, m in methods.items()
    }
    on, off = methods["teraio-crc"].times, methods["teraio-nocrc"].times
    return {
        "model": model,
        "budget": budget,
        "solver": solver,
        "steps": steps,
        "rows": rows,
        "checksum_overhead": statistics.median(a / b for a, b in zip(on, off)) - 1.0,
        "checksum_overhead_of_medians": statistics.median(on) / statistics.median(off) - 1.0,
        "checksum_cpu_s_per_step": statistics.median(cpu_s["teraio-crc"])
        - statistics.median(cpu_s["teraio-nocrc"]),
        "checksum_cpu_fraction": statistics.median(cpu_s["teraio-crc"])
        / statistics.median(cpu_s["teraio-nocrc"])
        - 1.0,
        "checksum_failures": checksum_failures,
        "checksum_used": checksum_used,
        "losses_equal": all(
            torch.equal(a, b) for a, b in zip(methods["teraio-crc"].losses, methods["teraio-nocrc"].losses)
        ),
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpus": __import__("os").cpu_count(),
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo", choices=["demo", "tiny"])
    p.add_argument("--steps", type=int, default=16, help="timed rounds (default 16)")
    p.add_argument("--budget", default="55%")
    p.add_argument(
        "--solver", default="greedy", help="planner solver (default greedy: same plan, no solve time)"
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default=None, help="also write the JSON result here (replaced if it exists)")
    args = p.parse_args(argv)
    if args.steps < 1:
        print("bench_checksum: error: --steps must be at least 1", file=sys.stderr)
        return 2
    res = run(args.model, args.steps, args.budget, args.solver)
    if args.out:
        write_json(args.out, res, overwrite=True)
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    for name, r in res["rows"].items():
        print(
            f"{name:14s} median step {r['median_step_s']:.3f} s (CPU {r['median_step_cpu_s']:.3f} s), paired "
            f"overhead vs no-offload {r['paired_overhead_vs_no_offload']:+.1%}"
        )
    print(
        f"checksums on vs off: {res['checksum_overhead']:+.2%} (median of paired ratios over {args.steps} rounds; "
        f"ratio of medians {res['checksum_overhead_of_medians']:+.2%}); checksum failures "
        f"{res['checksum_failures']}; losses equal: {res['losses_equal']}"
    )
    print(
        f"checksum CPU per step: {res['checksum_cpu_s_per_step'] * 1e3:+.0f} ms "
        f"({res['checksum_cpu_fraction']:+.2%} of the no-checksum step's CPU time)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
