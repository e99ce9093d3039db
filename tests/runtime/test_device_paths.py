"""Device tensors through every tier, on CPU: the fake asynchronous device stands for CUDA; for kvikio
the driver stand-in reports the fake's memory as device memory and runs its streams on the fake, and the
tier's GPUDirect path runs with the fake cuFile.

What a GPU user would notice: bit-exact round trips (unaligned, sub-16 KiB, multi-chunk, striped),
fetched tensors in device memory, copies on the I/O threads' own streams (never the compute stream, and
never kvikio's own blocking stream), checksums computed on the device that catch corruption and raise
at the engine's next call, the host tier's capacity counting what the pinned allocator really holds, and
``io_path`` saying what kvikio really does per file.
"""

from __future__ import annotations

import logging
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from teraio.runtime import Engine
from teraio.runtime.errors import ChecksumError, TierCapacityError
from teraio.runtime.fake_device import FakeDevice

from .conftest import DEVICE_TIERS, HAS_KVIKIO, device_config, make_config, prepare_device_tier
from .corrupt import flip_byte

SIZES = [1, 4095, 5000, 16383, 65537, 300_007]  # sub-page, sub-16 KiB (kvikio's gds_threshold), multi-chunk


@pytest.fixture
def fake() -> Iterator[FakeDevice]:
    dev = FakeDevice()
    yield dev
    dev.close()
    assert not dev.errors, dev.errors


@pytest.fixture(params=DEVICE_TIERS + ["posix-buffered"])
def device_engine(request, fake, tmp_path, monkeypatch) -> Iterator:
    """``factory(**overrides) -> (engine, standin)`` on the parametrised tier with the fake device."""
    tier = request.param
    standin = prepare_device_tier(tier, fake, monkeypatch)
    engines: list[Engine] = []

    def factory(**kw):
        kw.setdefault("chunk_bytes", 64 << 10)
        eng = Engine(device_config(tier, tmp_path, **kw), device=fake)
        engines.append(eng)
        return eng, standin

    factory.tier = tier
    yield factory
    for eng in engines:
        eng.close()


def _device_tensors(fake: FakeDevice) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for n in SIZES:  # a view 3 bytes into its storage: unaligned everywhere
        out[f"u8.{n}"] = fake.adopt(torch.randint(0, 256, (n + 3,), dtype=torch.uint8, generator=g))[3:]
    out["bf16"] = fake.adopt(torch.randn(70_001, generator=g).to(torch.bfloat16))
    out["i64"] = fake.adopt(torch.randint(-(2**62), 2**62, (9_999,), dtype=torch.int64, generator=g))
    out["strided"] = fake.adopt(torch.randn(257, 129, generator=g)).t()[5:, 3:77]
    return out


def test_device_round_trips_are_bit_exact(device_engine, fake):
    eng, standin = device_engine(io_threads=2)
    copies_before = standin.teraio_standin_device_copies() if standin else 0
    blocking_before = standin.teraio_standin_blocking_streams() if standin else 0
    tensors = _device_tensors(fake)
    expected = {k: t.clone() for k, t in tensors.items()}
    strides = {k: t.stride() for k, t in tensors.items()}
    for key, t in tensors.items():
        eng.offload(key, t)
    for i, key in enumerate(tensors):
        eng.release(key)
        if i % 2:
            eng.prefetch(key)
    for key, ref in expected.items():
        out = eng.fetch(key)
        fake.synchronize(out.device)
        assert fake.owns(out), f"{key} came back in host memory"
        assert out.dtype == ref.dtype and out.shape == ref.shape and out.stride() == strides[key]
        assert torch.equal(out, ref), key
    copy_streams = {stream for what, stream in fake.log if what.startswith("copy")}
    assert fake.default_stream.name not in copy_streams  # the compute stream never carries I/O copies
    eng.synchronize()  # every read's device check passed
    st = eng.stats()
    assert st.checksum_failures == 0
    if eng.default_tier == "ssd":
        assert all(d.bytes_written > 0 and d.bytes_read > 0 for d in st.dirs)  # striped over both
    if standin is not None:
        moved = sum(t.numel() * t.element_size() for t in expected.values())
        # kvikio was never handed device memory: its own compat copies (through a blocking stream it
        # creates, which would wait for the compute stream) never ran; the I/O threads' streams did.
        assert standin.teraio_standin_device_copies() == copies_before
        assert standin.teraio_standin_blocking_streams() == blocking_before
        assert st.transfers["ssd.read"].nbytes >= moved
        path = "kvikio-gds" if device_engine.tier == "kvikio-gds" else "kvikio-compat"
        assert st.io_path == path and [d.io_path for d in st.dirs] == [path, path]
        cufile_reads = sum(what == "cufile read" for what, _ in fake.log)
        assert (cufile_reads > 0) == (path == "kvikio-gds")  # GDS reads went through cuFile's stream API


def _corrupted(fake: FakeDevice, eng: Engine, key: str = "w") -> torch.Tensor:
    """Store a device tensor under ``key`` and flip one byte of its second chunk on disk."""
    t = fake.adopt(torch.randn(100_000))
    eng.offload(key, t)
    eng.release(key)
    chunk = eng._keys[key].entry.placement.chunks[1]
    flip_byte(eng._dirs[chunk.dir_idx].data_path, chunk.file_offset + 100)
    return t


def test_device_checksum_mismatch_raises_at_the_next_call_never_lost(fake, tmp_path):
    """Note: [Device checks are read later]: the fetch returns (its check runs on the device), the next
    request of the engine raises ChecksumError naming the key; the bad buffer is not served again."""
    with Engine(make_config("posix", tmp_path, chunk_bytes=64 << 10, checksum=True), device=fake) as eng:
        _corrupted(fake, eng)
        eng.offload("other", fake.adopt(torch.ones(10))).wait()
        eng.release("other")
        out = eng.fetch("w")  # no host wait for the check
        fake.synchronize(None)  # the device ran the check
        assert fake.owns(out)
        with pytest.raises(ChecksumError, match="'w'.*checked on the device"):
            eng.prefetch("other")
        assert eng.stats().checksum_failures == 1
        eng.prefetch("other").wait()  # raised once; the engine goes on
        assert eng._keys["w"].entry.loaded_ref is None  # the next fetch of "w" reads again


def test_device_checksum_mismatch_survives_drop_and_raises_at_close(fake, tmp_path):
    """A verdict still pending when its key is dropped is not lost: drop (which runs from finalizers)
    never raises it, close does."""
    eng = Engine(make_config("posix", tmp_path, chunk_bytes=64 << 10, checksum=True), device=fake)
    _corrupted(fake, eng)
    fake.pause(fake.default_stream)  # the compute stream is busy: the read's copies cannot run yet
    eng.fetch("w")
    eng.drop("w")  # returns at once and raises nothing
    fake.resume()
    with pytest.raises(ChecksumError, match="'w'"):
        eng.close()
    assert eng.stats().checksum_failures == 1


def test_engine_synchronize_waits_for_the_checks_and_raises(fake, tmp_path):
    with Engine(make_config("posix", tmp_path, chunk_bytes=64 << 10, checksum=True), device=fake) as eng:
        _corrupted(fake, eng)
        eng.fetch("w")
        with pytest.raises(ChecksumError, match="'w'"):
            eng.synchronize()
        eng.synchronize()  # delivered once: nothing pending any more


def test_host_tier_counts_pinned_blocks_as_the_allocator_holds_them(fake):
    with Engine(
        make_config("host", None, chunk_bytes=64 << 10, host_capacity_bytes=12_000), device=fake
    ) as eng:
        host = eng.tiers["host"]
        assert eng.stats().io_path == "host-pinned"
        eng.offload("a", fake.adopt(torch.ones(5000, dtype=torch.uint8))).wait()
        assert host.held_nbytes == fake.pinned_allocated_nbytes == 8192  # 5000 rounded to 2**13
        # 3000 logical bytes would fit under 12,000 but the allocator would hold 4096 more: refused.
        with pytest.raises(TierCapacityError, match="pinned"):
            eng.offload("b", fake.adopt(torch.ones(3000, dtype=torch.uint8)))
        eng.drop("a")
        assert host.held_nbytes == 0
        eng.offload("b", fake.adopt(torch.ones(3000, dtype=torch.uint8))).wait()
        assert host.held_nbytes == 4096


def test_fetch_allocates_device_memory_seen_by_the_peak(fake, tmp_path):
    with Engine(make_config("posix", tmp_path, chunk_bytes=64 << 10), device=fake) as eng:
        t = fake.adopt(torch.randn(50_000))
        eng.offload("t", t)
        eng.release("t")
        del t
        fake.reset_peak_memory_stats(None)
        before = fake.memory_allocated(None)
        out = eng.fetch("t")
        fake.synchronize(None)
        assert fake.max_memory_allocated(None) - before >= out.nbytes
        del out
        assert fake.memory_allocated(None) == before


@pytest.mark.skipif(not HAS_KVIKIO, reason="kvikio not installed")
def test_standin_reports_registered_ranges_as_device_memory(fake, tmp_path, cuda_standin):
    """kvikio's own pread/pwrite ask cuPointerGetAttributes whether a buffer is host memory: registered
    ranges take its device branch (bounce buffer + copies), everything else its host branch."""
    import kvikio

    from teraio.runtime.testing import standin_device_memory

    standin = standin_device_memory(fake)
    path = tmp_path / "f.bin"
    path.write_bytes(b"\0" * 20_000)
    src = fake.adopt(torch.randint(0, 256, (12_345,), dtype=torch.uint8))
    dst = fake.empty(12_345, None)
    before = standin.teraio_standin_device_copies()
    with kvikio.CuFile(str(path), "r+") as f:
        assert f.pwrite(fake.cuda_array(src), 12_345, 4096).get() == 12_345
        assert f.pread(fake.cuda_array(dst), 12_345, 4096).get() == 12_345
        host = torch.zeros(12_345, dtype=torch.uint8)
        assert f.pread(host.numpy(), 12_345, 4096).get() == 12_345
    assert torch.equal(dst, src) and torch.equal(host, src)
    assert standin.teraio_standin_device_copies() - before >= 2  # only the two device transfers


@pytest.mark.skipif(not HAS_KVIKIO, reason="kvikio not installed")
def test_kvikio_tier_reports_its_path_and_sizes_kvikio_threads(fake, tmp_path, caplog, cuda_standin):
    import kvikio.defaults

    caplog.set_level(logging.WARNING, logger="teraio.runtime.tiers.gds")
    with Engine(make_config("kvikio", tmp_path, io_threads=3), device=fake) as eng:
        assert kvikio.defaults.get("num_threads") == 3
        assert eng.stats().io_path == "kvikio-compat"
        reason = eng.tiers["ssd"].dir_io_reason(0)
    (message,) = [r.getMessage() for r in caplog.records if "kvikio tier:" in r.getMessage()]
    assert "kvikio-compat" in message and str(tmp_path / "ssd0") in message and reason in message
    assert "cuFile config" in message


@pytest.mark.skipif(shutil.which("gcc") is None, reason="the driver stand-in is built with gcc")
def test_driver_standin_build_never_follows_links_planted_in_its_build_dir(tmp_path):
    """It wrote standin.c (and gcc wrote libcuda.so.1) at fixed names in ``build_dir``: links planted
    there were followed. Now it builds in a fresh private directory inside it. In a subprocess: the
    stand-in is loaded once per process, RTLD_GLOBAL."""
    from teraio.runtime.testing import real_cuda_driver_present

    if real_cuda_driver_present():
        pytest.skip("a real CUDA driver is present: the stand-in is never loaded here")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    for name in ("standin.c", "libcuda.so.1"):
        (shared / name).symlink_to(victim)
    code = "import sys; from teraio.runtime.testing import load_cuda_driver_standin as f; f(build_dir=sys.argv[1])"
    out = subprocess.run(
        [sys.executable, "-c", code, str(shared)], capture_output=True, text=True, timeout=120
    )
    assert victim.read_text() == "precious\n"
    assert out.returncode == 0, out.stderr
    (private,) = [p for p in shared.iterdir() if not p.is_symlink()]
    assert private.name.startswith("teraio-cuda-standin-") and stat.S_IMODE(private.stat().st_mode) == 0o700
    assert (private / "libcuda.so.1").is_file()
