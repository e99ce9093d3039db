"""Device tensors through every tier, on CPU: the fake asynchronous device stands for CUDA, and for kvikio
the driver stand-in reports the fake's memory as device memory, so kvikio 26.10's device branch runs.

What a GPU user would notice: bit-exact round trips (unaligned, sub-16 KiB, multi-chunk, striped),
fetched tensors in device memory, copies on the I/O threads' own streams (never the compute stream),
checksums computed on the device that catch corruption, the host tier's capacity counting what the
pinned allocator really holds, and ``io_path`` saying what kvikio really does per file.
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

from .conftest import HAS_KVIKIO, TIERS, make_config
from .corrupt import flip_byte

SIZES = [1, 4095, 5000, 16383, 65537, 300_007]  # sub-page, sub-16 KiB (kvikio's gds_threshold), multi-chunk


@pytest.fixture
def fake() -> Iterator[FakeDevice]:
    dev = FakeDevice()
    yield dev
    dev.close()
    assert not dev.errors, dev.errors


@pytest.fixture(params=TIERS)
def device_engine(request, fake, tmp_path) -> Iterator:
    """``factory(**overrides) -> (engine, standin)`` on the parametrised tier with the fake device."""
    tier = request.param
    standin = None
    if tier == "kvikio":
        if not HAS_KVIKIO:
            pytest.skip("kvikio not installed")
        from teraio.runtime.testing import standin_device_memory

        standin = standin_device_memory(fake)
    engines: list[Engine] = []

    def factory(**kw):
        kw.setdefault("chunk_bytes", 64 << 10)
        eng = Engine(make_config(tier, tmp_path, **kw), device=fake)
        engines.append(eng)
        return eng, standin

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
    st = eng.stats()
    assert st.checksum_failures == 0
    if eng.default_tier == "ssd":
        assert all(d.bytes_written > 0 and d.bytes_read > 0 for d in st.dirs)  # striped over both
    if standin is not None:  # kvikio's device branch moved the bytes (its bounce buffers, our stand-in)
        moved = sum(t.numel() * t.element_size() for t in expected.values())
        assert standin.teraio_standin_device_copies() > copies_before
        assert st.io_path == "kvikio-compat"
        assert [d.io_path for d in st.dirs] == ["kvikio-compat", "kvikio-compat"]
        assert st.transfers["ssd.read"].nbytes >= moved


def test_device_checksum_catches_corruption(fake, tmp_path):
    with Engine(make_config("posix", tmp_path, chunk_bytes=64 << 10, checksum=True), device=fake) as eng:
        t = fake.adopt(torch.randn(100_000))
        eng.offload("w", t)
        eng.release("w")
        chunk = eng._keys["w"].entry.placement.chunks[1]
        path = eng._dirs[chunk.dir_idx].data_path
        flip_byte(path, chunk.file_offset + 100)
        with pytest.raises(ChecksumError, match="'w'"):
            eng.fetch("w")
        assert eng.stats().checksum_failures == 1


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
def test_standin_reports_registered_ranges_as_device_memory(fake, tmp_path):
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
def test_kvikio_tier_reports_its_path_and_sizes_kvikio_threads(fake, tmp_path, caplog):
    import kvikio.defaults

    from teraio.runtime.testing import standin_device_memory

    standin_device_memory(fake)
    caplog.set_level(logging.WARNING, logger="teraio.runtime.tiers.gds")
    with Engine(make_config("kvikio", tmp_path, io_threads=3), device=fake) as eng:
        assert kvikio.defaults.get("num_threads") == 3
        assert eng.stats().io_path == "kvikio-compat"
    (message,) = [r.getMessage() for r in caplog.records if "kvikio tier:" in r.getMessage()]
    assert "is_gds_available=" in message and "kvikio-compat" in message and str(tmp_path / "ssd0") in message


@pytest.mark.skipif(not HAS_KVIKIO, reason="kvikio not installed")
def test_kvikio_falls_back_per_file_with_its_reason_when_gds_is_wanted(tmp_path, caplog, monkeypatch):
    """Where GDS is wanted, files are opened with compat mode OFF so cuFile's refusal raises instead of
    falling back silently; here (no NVFS driver) each file falls back, and the log says why."""
    import teraio.runtime.tiers.gds as gds
    from teraio.runtime.testing import load_cuda_driver_standin

    load_cuda_driver_standin()
    monkeypatch.setenv(
        "CUFILE_LOGFILE_PATH", str(tmp_path / "cufile.log")
    )  # cuFile logs to the cwd otherwise
    monkeypatch.setattr(gds, "kvikio_io_path", lambda: ("kvikio-gds", "test: GDS wanted"))
    caplog.set_level(logging.WARNING, logger="teraio.runtime.tiers.gds")
    with Engine(make_config("kvikio", tmp_path)) as eng:
        st = eng.stats()
        t = torch.randn(100_000)
        eng.offload("t", t)
        eng.release("t")
        assert torch.equal(eng.fetch("t"), t)
    assert st.io_path == "kvikio-compat" and [d.io_path for d in st.dirs] == ["kvikio-compat"] * 2
    fallbacks = [r.getMessage() for r in caplog.records if "falls back to compat mode" in r.getMessage()]
    assert len(fallbacks) == 2 and all("cuFile cannot register" in m for m in fallbacks)


@pytest.mark.skipif(not HAS_KVIKIO, reason="kvikio not installed")
def test_kvikio_gds_file_without_stream_api_is_reopened_in_auto_mode(tmp_path, caplog, monkeypatch):
    """A file cuFile registers (compat OFF succeeds) but whose stream API kvikio would refuse is reopened
    in AUTO mode, stays on GDS, and the log says its transfers sync the default stream. kvikio.CuFile is
    replaced by a recorder here (no cuFile on this machine); the decision logic is what is tested."""
    import kvikio
    import kvikio.defaults

    import teraio.runtime.tiers.gds as gds
    from teraio.runtime.testing import load_cuda_driver_standin

    load_cuda_driver_standin()
    opened: list[tuple[str, int]] = []

    class RecordingCuFile:
        def __init__(self, path, flags):
            opened.append((path, int(kvikio.defaults.get("compat_mode"))))

        def close(self):
            return None

    monkeypatch.setattr(kvikio, "CuFile", RecordingCuFile)
    monkeypatch.setattr(gds, "kvikio_io_path", lambda: ("kvikio-gds", "test: GDS wanted"))
    monkeypatch.setattr(gds, "cufile_stream_api_status", lambda: (False, "test: no stream API"))
    caplog.set_level(logging.WARNING, logger="teraio.runtime.tiers.gds")
    with Engine(make_config("kvikio", tmp_path)) as eng:
        st = eng.stats()
    assert st.io_path == "kvikio-gds" and [d.io_path for d in st.dirs] == ["kvikio-gds"] * 2
    off, auto = int(kvikio.CompatMode.OFF), int(kvikio.CompatMode.AUTO)
    assert [mode for _, mode in opened] == [off, auto, off, auto]
    assert sum("synchronise the default CUDA stream" in r.getMessage() for r in caplog.records) == 2


@pytest.mark.skipif(shutil.which("gcc") is None, reason="the driver stand-in is built with gcc")
def test_driver_standin_build_never_follows_links_planted_in_its_build_dir(tmp_path):
    """It wrote standin.c (and gcc wrote libcuda.so.1) at fixed names in ``build_dir``: links planted
    there were followed. Now it builds in a fresh private directory inside it. In a subprocess: the
    stand-in is loaded once per process, RTLD_GLOBAL."""
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
