"""Which path each kvikio file really takes, the cuFile configuration the tier writes or checks, and
kvikio 26.10's own device-memory behaviour that the tier avoids (confirmed on the driver stand-in).

A GPU user would notice: ``io_path`` saying "kvikio-gds" only where P2P DMA really runs (never for a file
cuFile serves through its own compat mode), the reason in the log for every file that is not on GDS,
no file ever opened in kvikio's AUTO mode (whose stream-ordered calls synchronise the null stream when
cuFile's stream API is unusable), and the stand-in driver never loaded over a real one.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
import torch

from teraio.runtime import Engine
from teraio.runtime.fake_device import FakeDevice, HostBlockedError

from .conftest import HAS_KVIKIO, make_config, use_kvikio_driver

pytestmark = pytest.mark.skipif(not HAS_KVIKIO, reason="kvikio not installed")


@pytest.fixture
def fake() -> Iterator[FakeDevice]:
    dev = FakeDevice()
    yield dev
    dev.resume()
    dev.close()


class _Recorder:
    """Stands for kvikio.CuFile: records the compat mode each file is opened with (and the cuFile config
    environment at that moment); opening with OFF fails when ``refuse`` says so."""

    opened: list[tuple[str, str, str | None]] = []
    refuse = False

    def __init__(self, path, flags):
        import kvikio
        import kvikio.defaults

        mode = {int(kvikio.CompatMode.OFF): "OFF", int(kvikio.CompatMode.ON): "ON"}.get(
            int(kvikio.defaults.get("compat_mode")), "AUTO"
        )
        type(self).opened.append((path, mode, os.environ.get("CUFILE_ENV_PATH_JSON")))
        if mode == "OFF" and type(self).refuse:
            raise RuntimeError("cuFile: file system not supported (test)")

    def close(self):
        return None


@pytest.fixture
def recorder(monkeypatch):
    import kvikio

    import teraio.runtime.tiers.gds as gds

    use_kvikio_driver()
    _Recorder.opened = []
    _Recorder.refuse = False
    monkeypatch.setattr(kvikio, "CuFile", _Recorder)
    monkeypatch.setattr(gds, "kvikio_io_path", lambda: ("kvikio-gds", "test: GDS wanted"))
    return _Recorder


def test_kvikio_falls_back_per_file_with_its_reason_when_gds_is_wanted(tmp_path, caplog, monkeypatch):
    """Where GDS is wanted, files are opened with compat mode OFF so cuFile's refusal raises instead of
    falling back silently; here (no NVFS driver) each file falls back, and the log says why."""
    import teraio.runtime.tiers.gds as gds

    use_kvikio_driver()
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


@pytest.mark.parametrize(
    "why",
    [
        "nvidia-fs is not loaded (is_gds_available=False): cuFile would serve the file through its own compat mode",
        "cuFile's configuration allows its compat mode (allow_compat_mode=True)",
        "libcufile has no stream API (cuFileReadAsync)",
    ],
)
def test_a_registered_file_without_p2p_is_reopened_in_compat_mode_never_auto(
    tmp_path, caplog, monkeypatch, recorder, why
):
    """cuFile registered the file (compat OFF succeeded) but cannot do P2P DMA with stream-ordered calls:
    it is reopened with compat mode ON (teraio stages through pinned memory), never AUTO, and reported
    as "kvikio-compat" with the reason."""
    import teraio.runtime.tiers.gds as gds

    monkeypatch.setattr(gds, "gds_conditions", lambda: (False, why))
    caplog.set_level(logging.WARNING, logger="teraio.runtime.tiers.gds")
    with Engine(make_config("kvikio", tmp_path)) as eng:
        st = eng.stats()
        reasons = [eng.tiers["ssd"].dir_io_reason(i) for i in range(2)]
    assert st.io_path == "kvikio-compat" and [d.io_path for d in st.dirs] == ["kvikio-compat"] * 2
    assert [mode for _, mode, _ in recorder.opened] == ["OFF", "ON", "OFF", "ON"]
    assert reasons == [why, why]
    assert (
        sum("stays on compat mode" in r.getMessage() and why in r.getMessage() for r in caplog.records) == 2
    )


def test_a_file_with_p2p_stays_registered_and_is_reported_gds(tmp_path, monkeypatch, recorder):
    import teraio.runtime.tiers.gds as gds

    monkeypatch.setattr(gds, "gds_conditions", lambda: (True, "test: P2P"))
    with Engine(make_config("kvikio", tmp_path)) as eng:
        st = eng.stats()
    assert st.io_path == "kvikio-gds" and [d.io_path for d in st.dirs] == ["kvikio-gds"] * 2
    assert [mode for _, mode, _ in recorder.opened] == ["OFF", "OFF"]


def test_gds_needs_nvidia_fs_no_cufile_compat_mode_and_the_stream_api(monkeypatch):
    """``gds_conditions`` from cuFile's own driver properties (kvikio 26.10: ``is_gds_available`` is the
    nvidia-fs version being non-zero, ``allow_compat_mode`` the config's flag) and the stream API."""
    import teraio.runtime.tiers.gds as gds

    props = {"is_gds_available": True, "allow_compat_mode": False}
    monkeypatch.setattr(gds, "_driver_property", lambda name: (props[name], f"test {name}"))
    monkeypatch.setattr(gds, "cufile_stream_api_status", lambda: (True, "test stream API"))
    assert gds.gds_conditions()[0]
    props["is_gds_available"] = False
    ok, why = gds.gds_conditions()
    assert not ok and "nvidia-fs is not loaded" in why and "its own compat mode" in why
    props.update(is_gds_available=True, allow_compat_mode=True)
    ok, why = gds.gds_conditions()
    assert not ok and "allow_compat_mode" in why and "set" in why
    props["allow_compat_mode"] = False
    monkeypatch.setattr(gds, "cufile_stream_api_status", lambda: (False, "no cuFile config file"))
    ok, why = gds.gds_conditions()
    assert not ok and "no cuFile config file" in why


_CONFIG_PROBE = textwrap.dedent(
    """
    import json, os, stat, sys
    import kvikio
    import teraio.runtime.tiers.gds as gds
    from teraio.runtime import Engine, RuntimeConfig
    from teraio.runtime.testing import load_cuda_driver_standin, real_cuda_driver_present
    if not real_cuda_driver_present():
        load_cuda_driver_standin()
    seen = []
    class Recorder:
        def __init__(self, path, flags):
            env = os.environ.get("CUFILE_ENV_PATH_JSON")
            seen.append(env)
            if env:
                st = os.stat(env)
                seen.append((json.load(open(env)), stat.S_IMODE(st.st_mode)))
        def close(self):
            pass
    kvikio.CuFile = Recorder
    base = sys.argv[1]
    with Engine(RuntimeConfig(backend="kvikio", dirs=[base + "/a"])) as eng:
        written = gds.process_cufile_config()
        env_after = os.environ.get("CUFILE_ENV_PATH_JSON")
        exists = os.path.exists(written[0])
    print(json.dumps({"seen": seen, "config": written, "env_after": env_after, "exists_while_open": exists,
                      "exists_after_close": os.path.exists(written[0])}))
    """
)


def _probe(tmp_path, env: dict) -> dict:
    base = {k: v for k, v in os.environ.items() if k != "CUFILE_ENV_PATH_JSON"}
    out = subprocess.run(
        [sys.executable, "-c", _CONFIG_PROBE, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**base, "CUFILE_LOGFILE_PATH": str(tmp_path / "cufile.log"), **env},
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(os.path.exists("/etc/cufile.json"), reason="this machine has a cuFile config")
def test_without_a_cufile_config_the_tier_writes_one_while_cufile_starts(tmp_path):
    """Note: [teraio's cuFile configuration]: in a fresh process with no config anywhere, the first
    kvikio tier writes ``allow_compat_mode: false`` into its own directory (0600), points
    CUFILE_ENV_PATH_JSON at it while its files open, restores the environment, removes it at close."""
    got = _probe(tmp_path, {})
    path, origin = got["config"]
    assert origin.startswith("written by teraio") and path.startswith(str(tmp_path / "a"))
    assert got["seen"][0] == path and got["seen"][1] == [{"properties": {"allow_compat_mode": False}}, 0o600]
    assert got["env_after"] is None and got["exists_while_open"] and not got["exists_after_close"]


def test_a_cufile_config_of_the_user_is_used_not_replaced(tmp_path):
    mine = tmp_path / "mine.json"
    text = '{"properties": {"allow_compat_mode": true}}'
    mine.write_text(text)
    got = _probe(tmp_path, {"CUFILE_ENV_PATH_JSON": str(mine)})
    assert got["config"] == [str(mine), "CUFILE_ENV_PATH_JSON (yours)"]
    assert got["seen"][0] == str(mine) and got["env_after"] == str(mine)
    assert not list(tmp_path.rglob("cufile.json")) and mine.read_text() == text


# -- kvikio 26.10's own behaviour with device memory, on the stand-in: what the tier avoids ----------------


def test_kvikio_compat_copies_use_a_blocking_stream_that_waits_for_compute(fake, tmp_path, cuda_standin):
    """Source reading (kvikio 26.10 ``posix_device_io``, ``StreamCachePerThreadAndContext``): device memory
    in compat mode goes through kvikio's bounce buffer on a stream it creates with CU_STREAM_DEFAULT,
    which it then synchronises. With the driver stand-in running those calls on the fake device: the
    stream is created blocking, and with the compute stream busy, kvikio's read waits for it."""
    import kvikio

    from teraio.runtime.testing import standin_device_memory

    standin = standin_device_memory(fake)
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(20_000))
    dst = fake.empty(20_000, None)
    fake.pause(fake.default_stream)
    fake.launch(lambda: None)  # busy compute
    with kvikio.CuFile(str(path), "r+") as f, pytest.raises(RuntimeError):
        f.pread(fake.cuda_array(dst), 20_000, 0).get()
    assert any(isinstance(e, HostBlockedError) and "paused stream 'default'" in str(e) for e in fake.errors)
    # kvikio made its streams with CU_STREAM_DEFAULT (counted process-wide by the stand-in: once per
    # thread, kvikio caches them), never non-blocking ones.
    assert standin.teraio_standin_blocking_streams() > 0 and standin.teraio_standin_nonblocking_streams() == 0
    fake.errors.clear()
    from teraio.runtime.testing import release_standin_hooks

    release_standin_hooks()


def test_kvikio_raw_read_async_in_compat_mode_synchronises_the_given_stream(fake, tmp_path, cuda_standin):
    """Source reading (kvikio 26.10 ``FileHandle::read_async``): in compat mode it synchronises the stream
    it is given before reading. Given a teraio read stream that waits for the compute stream (a read
    buffer's allocation event), the calling I/O thread would wait for compute."""
    import kvikio

    from teraio.runtime.testing import release_standin_hooks, standin_device_memory

    standin_device_memory(fake)
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(8192))
    dst = fake.empty(8192, None)
    io = fake.new_stream(None)
    fake.pause(fake.default_stream)
    fake.launch(lambda: None)
    allocated = fake.new_event()
    fake.record(allocated, fake.default_stream)
    fake.wait(io, allocated)  # what Note: [CUDA ordering] (4) puts on a read stream
    with kvikio.CuFile(str(path), "r+") as f, pytest.raises(RuntimeError):
        f.raw_read_async(fake.cuda_array(dst), fake.raw_stream(io), 8192, 0).check_bytes_done()
    assert any(isinstance(e, HostBlockedError) for e in fake.errors)
    fake.errors.clear()
    release_standin_hooks()


def test_the_standin_is_never_loaded_over_a_real_driver(tmp_path):
    """On a machine with a real libcuda.so.1 the stand-in refuses to load (the suite would otherwise run
    against it, RTLD_GLOBAL, for the whole process). Simulated in a fresh process."""
    code = textwrap.dedent(
        """
        import teraio.runtime.testing as t
        t.real_cuda_driver_present = lambda: True
        try:
            t.load_cuda_driver_standin()
        except t.StandinRefusedError as exc:
            print("refused:", exc)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("refused: a real CUDA driver")
