"""What a transfer costs inside a running step: the compute thread's time in the runtime engine's calls
and the I/O threads' CPU, per step and per round trip, against the plan's predicted step.

Trains the built-in GPT with the teraio backend until its plan runs, then times ``--steps`` running
steps with the engine's ``offload``, ``release``, ``prefetch``, ``fetch`` and ``drop`` wrapped in a
timer (each call's time on the calling thread, nested waits included) and the I/O threads' CPU clocks
read around them. Compare the per-round-trip figures with the hardware model's
``cpu_s_per_transfer`` (printed; per direction, so a round trip is twice it). A report, not a test:
the figures move with the machine's load.

    python -m benchmarks.transfer_cost [--model tiny] [--budget 55%] [--inner eager] [--steps 60]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

ENGINE_CALLS = ("offload", "release", "prefetch", "fetch", "drop")


def _timed(fn: Callable[..., Any], name: str, spent_s: dict[str, float], calls: dict[str, int]):
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent_s[name] += time.perf_counter() - t0
            calls[name] += 1

    return wrapper


def _baseline_fwd_bwd_s(gpt: Any, inner: str, steps: int, first_step: int) -> float:
    """Median forward+backward of a copy of ``gpt`` compiled the same way with ``enabled=False`` (no
    migration)."""
    import copy

    import torch

    from teraio.config import Profiling
    from teraio.lifecycle.backend import TeraioBackend
    from teraio.tools.models import synthetic_batch

    twin = copy.deepcopy(gpt)
    backend = TeraioBackend(enabled=False, inner=inner, profiling=Profiling(measure_memory=False))
    try:
        compiled = torch.compile(twin, backend=backend)
        times = []
        for i in range(backend.cfg.profiling.steps + 3 + steps):
            idx, targets = synthetic_batch(twin.cfg, first_step + i, 0)
            twin.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            compiled(idx, targets).backward()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[-steps:])
    finally:
        backend.close()


def measure(
    model: str,
    budget: str,
    inner: str,
    solver: str,
    steps: int,
    hardware: str | None = "calibrate",
    profile_steps: int = 6,
) -> dict[str, Any]:
    """Run the plan for ``steps`` timed steps; per-step figures in seconds (see the module docstring).
    ``hardware``: as the backend's (``"calibrate"``: time the offload directory before planning)."""
    import torch

    from teraio.config import Profiling
    from teraio.lifecycle.backend import Phase, TeraioBackend
    from teraio.platform.cpu_malloc import retain_freed_memory
    from teraio.profiling.disk_calibration import _io_threads_cpu_s
    from teraio.profiling.transfer_probe import PROBE_STEPS
    from teraio.runtime.engine import Engine
    from teraio.tools.models import build_gpt, synthetic_batch

    retain_freed_memory()  # as teraio demo does: Note: [Freed CPU memory and step time] in teraio.platform.cpu_malloc
    spent_s: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    originals = {name: getattr(Engine, name) for name in ENGINE_CALLS}
    for name, fn in originals.items():
        setattr(Engine, name, _timed(fn, name, spent_s, calls))
    torch._dynamo.reset()
    gpt = build_gpt(model, seed=0)
    opt = torch.optim.AdamW(gpt.parameters(), lr=1e-4)
    backend = TeraioBackend(
        memory_budget=budget,
        inner=inner,
        solver=solver,
        hardware=hardware,
        # As teraio demo: 4 calibrating steps, whose median times the ops.
        profiling=Profiling(steps=profile_steps, measure_memory=False),
    )
    try:
        compiled = torch.compile(gpt, backend=backend)

        def step(index: int) -> float:
            idx, targets = synthetic_batch(gpt.cfg, index, 0)
            opt.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            compiled(idx, targets).backward()
            fwd_bwd_s = time.perf_counter() - t0
            opt.step()
            return fwd_bwd_s

        # Profiling, the step that plans and compiles, two more; with hardware="calibrate" on a short
        # step the backend first prices transfers under the model's own compute (PROBE_STEPS more).
        warmup = backend.cfg.profiling.steps + 3
        for i in range(warmup):
            step(i)
        while warmup < backend.cfg.profiling.steps + PROBE_STEPS + 3 and any(
            r.phase is not Phase.RUNNING for r in backend.runners if r.is_training
        ):
            step(warmup)
            warmup += 1
        runner = backend.runners[0]
        if runner.plan is None or not runner.plan.decisions:
            raise ValueError(f"no transfer planned at budget {budget}: nothing to time; give a lower one")
        spent_s.clear()
        calls.clear()
        stall0_s = backend.stats().get("stall_s", 0.0)
        io_cpu0_s = _io_threads_cpu_s()
        times = [step(warmup + i) for i in range(steps)]
        io_cpu_s = _io_threads_cpu_s() - io_cpu0_s
        stall_s = backend.stats().get("stall_s", 0.0) - stall0_s
        plan = runner.plan
        baseline_s = _baseline_fwd_bwd_s(gpt, inner, steps, warmup)
        round_trips = calls["offload"] / steps  # per step
        hw = plan.hardware.tier("ssd")
        return {
            "fwd_bwd_s": statistics.median(times),
            "predicted_step_s": plan.predicted_step_s,
            # The same model compiled without migration (enabled=False), timed right after: the paired
            # overhead against the plan's predicted overhead over its own profiled step.
            "baseline_fwd_bwd_s": baseline_s,
            "overhead": statistics.median(times) / baseline_s - 1.0,
            "predicted_overhead": plan.predicted_step_s / plan.compute_s - 1.0,
            "predicted_compute_s": plan.compute_s,
            "profiled_ops_s": float(runner.profile.ops["duration_us"].sum()) / 1e6,
            "profiled_outside_s": runner.profile.outside_s,
            "round_trips_per_step": round_trips,
            "calls_s_per_step": {name: spent_s[name] / steps for name in ENGINE_CALLS},
            "top_level_calls_s_per_round_trip": sum(spent_s[n] for n in ENGINE_CALLS)
            / steps
            / max(round_trips, 1e-9),
            "io_threads_cpu_s_per_round_trip": io_cpu_s / steps / max(round_trips, 1e-9),
            "cpu_s_per_transfer": hw.cpu_s_per_transfer,
            "cpu_s_per_step_with_io": hw.cpu_s_per_step_with_io,
            "cpu_s_per_byte": hw.cpu_s_per_byte,
            "stall_s_per_step": stall_s / steps,
        }
    finally:
        backend.close()
        for name, fn in originals.items():
            setattr(Engine, name, fn)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", choices=["tiny", "demo"])
    p.add_argument("--budget", default="55%")
    p.add_argument("--inner", default="eager", choices=["eager", "inductor"])
    p.add_argument("--solver", default="ilp")
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be at least 1")
    from teraio.planner.budget import BudgetError, resolve_budget
    from teraio.planner.solve import solver_info

    try:  # a typo fails now, not after the profiling steps
        resolve_budget(args.budget, 1)
        solver_info(args.solver)
        r = measure(args.model, args.budget, args.inner, args.solver, args.steps)
    except (BudgetError, ValueError) as e:
        p.error(str(e))
    print(
        f"fwd+bwd {r['fwd_bwd_s'] * 1e3:.3f} ms (predicted {r['predicted_step_s'] * 1e3:.3f} ms), "
        f"{r['round_trips_per_step']:.1f} round trips per step; without migration "
        f"{r['baseline_fwd_bwd_s'] * 1e3:.3f} ms: overhead {r['overhead']:+.1%} "
        f"(predicted {r['predicted_overhead']:+.1%})"
    )
    for name, s in r["calls_s_per_step"].items():
        print(f"  {name:9s} {s * 1e6:8.0f} us per step")
    print(
        f"per round trip: engine calls {r['top_level_calls_s_per_round_trip'] * 1e6:.0f} us on the compute "
        f"thread, I/O threads {r['io_threads_cpu_s_per_round_trip'] * 1e6:.0f} us of CPU; the plan priced "
        f"{2 * r['cpu_s_per_transfer'] * 1e6:.0f} us (cpu_s_per_transfer x 2), and "
        f"{r['cpu_s_per_step_with_io'] * 1e6:.0f} us once per step (cpu_s_per_step_with_io), "
        f"{r['cpu_s_per_byte'] * 1e9:.3f} ns per byte (cpu_s_per_byte)"
    )
    print(
        f"the plan's step without migration {r['predicted_compute_s'] * 1e3:.3f} ms: profiled ops "
        f"{r['profiled_ops_s'] * 1e3:.3f} ms, outside the graphs {r['profiled_outside_s'] * 1e3:.3f} ms"
    )
    print(f"stall {r['stall_s_per_step'] * 1e6:.0f} us per step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
