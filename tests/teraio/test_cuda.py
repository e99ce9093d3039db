"""teraio's CUDA paths on a real GPU (marked ``cuda``; they skip on machines without one).

The same behaviour is tested on CPU with the fake device standing in for CUDA (test_profiler.py,
test_measure.py, test_lifecycle.py, test_cuda1_plumbing.py); these run it against torch.cuda. None of
them has run yet: see docs/gpu_checklist.md for what to run on the first GPU machine.
"""

from __future__ import annotations

import os

import pytest
import torch

import teraio
from teraio.lifecycle.backend import TeraioBackend
from teraio.profiling.measure import MemoryRecorder

from .loops import CASES, GPTLoss

# tests/teraio/conftest.py turns deterministic algorithms on; cuBLAS then needs this workspace setting,
# read when its first handle is made (after collection, when a test first multiplies on the GPU).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SPIN_CYCLES = 50_000_000  # tens of milliseconds of GPU clock: far above any launch time


@torch.library.custom_op("teraio_cuda_test::spin", mutates_args=())
def spin(x: torch.Tensor) -> torch.Tensor:
    """``x`` copied, after a kernel that spins for SPIN_CYCLES on the current stream (returns at launch)."""
    torch.cuda._sleep(SPIN_CYCLES)
    return x.clone()


@spin.register_fake
def _spin_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


spin.register_autograd(lambda ctx, grad: grad, setup_context=lambda ctx, inputs, output: None)


class SpinModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(spin(self.lin(x))).sum()


def _event_ms(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def test_cuda_profile_times_the_kernel_not_its_launch() -> None:
    """The spinning op's profiled duration is the kernel's (CUDA events around it: tens of ms), not its
    launch (microseconds)."""
    x = torch.randn(8, 64, device="cuda")
    spin(x)  # warm-up
    reference_us = _event_ms(lambda: spin(x)) * 1e3
    torch._dynamo.reset()
    be = TeraioBackend(inner="eager", profiling=teraio.Profiling(steps=2), enabled=False)
    compiled = torch.compile(SpinModel().cuda(), backend=be)
    for _ in range(3):
        compiled(x).backward()
    (profile,) = be.profiles
    ops = profile.ops
    assert profile.meta["device"] == f"cuda:{torch.cuda.current_device()}"
    spun = ops.loc[ops["target"] == str(torch.ops.teraio_cuda_test.spin.default), "duration_us"]
    assert len(spun) == 1 and float(spun.iloc[0]) >= 0.5 * reference_us, (float(spun.iloc[0]), reference_us)


def test_cuda_peak_recorder_reads_its_own_device_at_the_mark() -> None:
    """Allocations on the recorder's device (the last one, not made current) up to ``mark_end`` count;
    an allocation after the mark (the optimizer step) does not."""
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    rec = MemoryRecorder(str(device))
    rec.start()
    scratch = torch.empty(8 << 20, dtype=torch.uint8, device=device)
    del scratch
    kept = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    rec.mark_end()
    after = torch.empty(16 << 20, dtype=torch.uint8, device=device)
    result = rec.stop()
    assert (result.peak_bytes, result.end_bytes, result.method) == (8 << 20, 1 << 20, "cuda")
    del kept, after


def _train(backend: TeraioBackend, steps: int = 8) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPTLoss().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    compiled = torch.compile(model, backend=backend)
    out = []
    for i in range(steps):
        loss = compiled(*(t.cuda() for t in CASES["gpt"].batch(i, 32)))
        loss.backward()
        out.append((loss.detach().clone(), [p.grad.clone() for p in model.parameters()]))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


def test_cuda_inductor_training_with_a_plan_is_bit_identical(tmp_path) -> None:
    """The Inductor path on CUDA: profiled on the GPU, planned, run with offloads and prefetches through
    the runtime, and every loss and gradient equal to the same compile without migration."""
    kw = {
        "inner": "inductor",
        "profiling": teraio.Profiling(steps=2),
        "solver": "greedy",
        "memory_budget": "50%",
    }
    ref = TeraioBackend(**kw, enabled=False)
    be = TeraioBackend(**kw, offload_dirs=[str(tmp_path)])
    try:
        expected = _train(ref)
        got = _train(be)
        st = be.stats()
    finally:
        ref.close()
        be.close()
    for (loss_a, grads_a), (loss_b, grads_b) in zip(expected, got):
        assert torch.equal(loss_a, loss_b)
        assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
    assert all(p.meta["device"].startswith("cuda") for p in be.profiles)
    assert st["moved_bytes_per_step"] > 0 and st["prefetched_bytes"] > 0 and st["step_s"] is not None
