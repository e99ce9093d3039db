"""The runtime's CUDA paths on a real GPU (marked ``cuda``; they skip on machines without one).

The same behaviour is tested on CPU with the fake device (test_device_races.py, test_device_paths.py);
these run it against torch.cuda and, where installed, real kvikio/cuFile. See docs/gpu_checklist.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from teraio.runtime import Engine, RuntimeConfig
from teraio.runtime.device import CudaDevice, pow2_ceil

from .conftest import HAS_KVIKIO

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA_TIERS = ["host", "posix"] + (["kvikio"] if HAS_KVIKIO else [])


def _engine(tier: str, base: Path, **kw) -> Engine:
    dirs = [] if tier == "host" else [base / "ssd0", base / "ssd1"]
    kw.setdefault("chunk_bytes", 1 << 20)
    return Engine(RuntimeConfig(backend=tier, dirs=dirs, checksum=True, **kw))


def _busy(x: torch.Tensor, iters: int = 40) -> torch.Tensor:
    for _ in range(iters):
        x = torch.tanh(x @ x)
    return x


@pytest.mark.parametrize("tier", CUDA_TIERS)
def test_cuda_round_trip_is_bit_exact_and_stays_on_device(tier, tmp_path):
    with _engine(tier, tmp_path) as eng:
        for i, n in enumerate([1, 4095, 16383, (3 << 20) + 7]):
            t = torch.randint(0, 256, (n + 3,), dtype=torch.uint8, device="cuda")[3:]
            ref = t.clone()
            eng.offload(f"k{i}", t)
            eng.release(f"k{i}")
            out = eng.fetch(f"k{i}")
            assert out.is_cuda and torch.equal(out, ref)
        assert eng.stats().checksum_failures == 0


@pytest.mark.parametrize("tier", ["host", "posix"])
def test_cuda_producer_and_consumer_are_ordered(tier, tmp_path):
    with _engine(tier, tmp_path, io_threads=2) as eng:
        produced = _busy(torch.randn(2048, 2048, device="cuda") / 64)  # still queued at offload
        eng.offload("p", produced)
        expected = produced.clone()
        eng.release("p")
        del produced
        consumed = eng.fetch("p") * 1  # enqueued right after fetch returns
        assert torch.equal(consumed, expected)


def test_cuda_fetch_does_not_block_the_host_on_the_copy(tmp_path):
    with _engine("host", tmp_path) as eng:
        eng.offload("x", torch.randn(64 << 20, device="cuda")).wait()
        eng.release("x")
        _busy(torch.randn(4096, 4096, device="cuda") / 128, 20)  # keep the compute stream busy
        out = eng.fetch("x")  # ordered by an event wait, not a host synchronisation
        assert not torch.cuda.current_stream().query()  # the busy kernels are still queued
        torch.cuda.synchronize()
        assert out.is_cuda


def test_cuda_host_tier_accounting_matches_the_pinned_allocator(tmp_path):
    dev = CudaDevice()
    assert dev.pinned_nbytes(5000) == pow2_ceil(5000)
    before = torch.cuda.host_memory_stats().get("active_bytes.current", 0)
    with _engine("host", tmp_path, chunk_bytes=4 << 20) as eng:
        for i, n in enumerate([5000, (3 << 20) + 1]):
            eng.offload(f"k{i}", torch.ones(n, dtype=torch.uint8, device="cuda")).wait()
        held = eng.tiers["host"].held_nbytes
        after = torch.cuda.host_memory_stats().get("active_bytes.current", 0)
    assert after - before == held


@pytest.mark.skipif(not HAS_KVIKIO, reason="kvikio not installed")
def test_cuda_kvikio_reports_a_path_per_directory(tmp_path):
    with _engine("kvikio", tmp_path) as eng:
        st = eng.stats()
    assert st.io_path in ("kvikio-gds", "kvikio-compat")
    assert all(d.io_path in ("kvikio-gds", "kvikio-compat") for d in st.dirs)
    assert (st.io_path == "kvikio-gds") == all(d.io_path == "kvikio-gds" for d in st.dirs)
