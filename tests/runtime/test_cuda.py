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
    kw.setdefault("checksum", True)
    return Engine(RuntimeConfig(backend=tier, dirs=dirs, **kw))


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


@pytest.mark.parametrize("checksum", [True, False], ids=["checksums", "no-checksums"])
@pytest.mark.parametrize("tier", CUDA_TIERS)
def test_cuda_fetch_and_drop_do_not_block_the_host_while_compute_is_busy(tier, checksum, tmp_path):
    """Checksums on (the default) too: the device check runs on the read stream and is read later."""
    with _engine(tier, tmp_path, checksum=checksum, chunk_bytes=4 << 20, io_threads=2) as eng:
        x, y = torch.randn(16 << 20, device="cuda"), torch.randn(4 << 20, device="cuda")
        ref = x.clone()
        for key, t in (("x", x), ("y", y)):
            eng.offload(key, t).wait()
            eng.release(key)
        torch.cuda.synchronize()
        _busy(torch.randn(4096, 4096, device="cuda") / 128, 200)  # keep the compute stream busy
        eng.prefetch("x").wait()  # the file side; the copies wait behind the busy kernels
        eng.prefetch("y").wait()
        out = eng.fetch("x")  # ordered by an event wait, not a host synchronisation
        consumed = out * 1
        eng.drop("x")  # a fetched read: waits for nothing
        eng.drop("y")  # a read nobody fetched: settled by the allocator
        assert not torch.cuda.current_stream().query()  # the busy kernels are still queued
        torch.cuda.synchronize()
        assert out.is_cuda and torch.equal(consumed, ref)
        eng.synchronize()  # the device checks passed


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
    from teraio.runtime.tiers.gds import gds_available

    if not gds_available()[0]:  # no nvidia-fs: cuFile's own compat mode is never labelled GDS
        assert st.io_path == "kvikio-compat"
