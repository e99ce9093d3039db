"""Is an Inductor-compiled training step bit-reproducible while the torch profiler measures its memory?

Two identical compiles of the built-in tiny GPT (teraio backend, ``enabled=False``: no migration op at
all), Inductor in deterministic mode, one intra-op thread, AdamW; the backend measures memory (torch
profiler, ``profile_memory=True``) on every other running step. Prints, per step, whether the two runs'
gradients are bit-identical. ``--copies N`` runs N such processes at once: on the project's 2-core VM
the first profiled step differed in some runs only when another process competed for the cores (after
which the weights diverge, so every later step differs too). teraio's exactness tests therefore compare
steps that run without the profiler (``measure_memory=False``).

    python -m benchmarks.profiler_determinism [--steps 16] [--copies 2]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys


def _train(steps: int) -> tuple[list[dict], list[bool]]:
    import torch

    from teraio.config import Profiling
    from teraio.lifecycle.backend import TeraioBackend
    from teraio.profiling.measure import MemoryRecorder
    from teraio.tools.workloads import builtin_workload, compute_loss

    torch._dynamo.reset()
    workload = builtin_workload("tiny")
    backend = TeraioBackend(inner="inductor", enabled=False, profiling=Profiling(measure_memory=False))
    compiled = torch.compile(workload.model, backend=backend)
    opt = torch.optim.AdamW(workload.model.parameters(), lr=1e-3)
    grads, profiled = [], []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        # Every other step runs under the torch profiler's memory recording, as a measured step does.
        rec = MemoryRecorder() if step % 2 else None
        if rec is not None:
            rec.start()
        loss = compute_loss(compiled, workload, step)
        loss.backward()
        if rec is not None:
            rec.stop()
        profiled.append(rec is not None)
        grads.append({n: p.grad.clone() for n, p in workload.model.named_parameters()})
        opt.step()
    return grads, profiled


def compare(steps: int) -> int:
    """Run two identical trainings; print one line per step; return the number of differing steps."""
    import torch

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    torch._inductor.config.deterministic = True
    a, profiled = _train(steps)
    b, _ = _train(steps)
    differing = 0
    for step in range(steps):
        names = [n for n in a[step] if not torch.equal(a[step][n], b[step][n])]
        differing += bool(names)
        verdict = f"DIFFER ({len(names)} gradients)" if names else "identical"
        print(f"step {step:3d} profiled={profiled[step]!s:5} {verdict}", flush=True)
    return differing


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--copies", type=int, default=1, help="processes to run at once (competing for cores)")
    args = ap.parse_args(argv)
    os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")  # read when torch is imported
    env = dict(os.environ)
    if args.copies > 1:
        cmd = [sys.executable, "-m", "benchmarks.profiler_determinism", "--steps", str(args.steps)]
        procs = [
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True) for _ in range(args.copies)
        ]
        outs = [p.communicate()[0] for p in procs]
        for i, out in enumerate(outs):
            print(f"--- copy {i}\n{out}", end="")
        return 0
    differing = compare(args.steps)
    print(f"{differing} of {args.steps} steps differ between two identical compiles")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
