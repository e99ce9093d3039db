"""Fixtures for runtime tests: one engine factory parametrised over every tier this machine can run.

host always; posix (O_DIRECT) and posix-buffered (the fallback) on a real directory; kvikio through
its real POSIX path (with the machine's CUDA driver, or the stand-in where there is none), skipped when
kvikio is not installed. Tests that need the stand-in itself ask for the ``cuda_standin`` fixture.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

from teraio.runtime import Engine, RuntimeConfig

HAS_KVIKIO = importlib.util.find_spec("kvikio") is not None
TIERS = ["host", "posix", "posix-buffered", "kvikio"]


def make_config(tier: str, base: Path, **kw) -> RuntimeConfig:
    """A config for ``tier`` with offload directories under ``base``."""
    kw.setdefault("checksum", True)
    kw.setdefault("chunk_bytes", 64 << 10)  # small chunks: many chunks even for small tensors
    if tier == "host":
        return RuntimeConfig(backend="host", **kw)
    dirs = kw.pop("dirs", [base / "ssd0", base / "ssd1"])
    if tier == "posix":
        return RuntimeConfig(backend="posix", dirs=dirs, direct_io=True, **kw)
    if tier == "posix-buffered":
        return RuntimeConfig(backend="posix", dirs=dirs, direct_io=False, **kw)
    if tier == "kvikio":
        if not HAS_KVIKIO:
            pytest.skip("kvikio not installed (pip install the 'gds' extra, see README)")
        use_kvikio_driver()
        return RuntimeConfig(backend="kvikio", dirs=dirs, **kw)
    raise ValueError(tier)


def use_kvikio_driver() -> None:
    """kvikio needs a CUDA driver for any I/O, even of host memory: the real one where the machine has
    it, else the stand-in (which is never loaded over a real driver)."""
    from teraio.runtime.testing import load_cuda_driver_standin, real_cuda_driver_present

    if not real_cuda_driver_present():
        load_cuda_driver_standin()


@pytest.fixture
def cuda_standin():
    """The stand-in driver, for tests that need it (fake device memory seen by kvikio); skips on a
    machine with a real CUDA driver, where loading it would shadow the driver for the whole process."""
    from teraio.runtime.testing import StandinRefusedError, load_cuda_driver_standin

    try:
        return load_cuda_driver_standin()
    except StandinRefusedError as exc:
        pytest.skip(str(exc))


@pytest.fixture(params=TIERS)
def tier(request) -> str:
    return request.param


@pytest.fixture
def make_engine(tier: str, tmp_path: Path) -> Iterator:
    """Factory: ``make_engine(**config_overrides)`` -> Engine on the parametrised tier; closed after."""
    engines: list[Engine] = []

    def factory(**kw) -> Engine:
        eng = Engine(make_config(tier, tmp_path, **kw))
        engines.append(eng)
        return eng

    yield factory
    for eng in engines:
        eng.close()


# -- device tiers: the fake device through every tier ---------------------------------------------------

#: Tiers a device tensor can take on CPU: "kvikio" is kvikio's POSIX path on compat files (every file
#: here: no cuFile), "kvikio-gds" the tier's GPUDirect path with the fake cuFile of runtime.testing.
DEVICE_TIERS = ["host", "posix", "kvikio", "kvikio-gds"]


def device_config(tier: str, base: Path, **kw) -> RuntimeConfig:
    """``make_config`` for a device tier (``kvikio-gds`` is the kvikio backend)."""
    return make_config("kvikio" if tier == "kvikio-gds" else tier, base, **kw)


def prepare_device_tier(tier: str, fake, monkeypatch):
    """Make ``tier`` usable with the fake device ``fake``; return the driver stand-in (kvikio tiers) or
    None. kvikio tiers see the fake's memory as device memory and run their driver calls on its streams
    (so a device copy handed to kvikio would be caught by the fake's ordering and its host-blocked
    detector); ``kvikio-gds`` opens files with the fake cuFile and the GDS conditions made to hold."""
    if not tier.startswith("kvikio"):
        return None
    if not HAS_KVIKIO:
        pytest.skip("kvikio not installed")
    from teraio.runtime.testing import StandinRefusedError, fake_cufile, standin_device_memory

    try:
        standin = standin_device_memory(fake)  # its hooks go when the fake closes
    except StandinRefusedError as exc:
        pytest.skip(str(exc))
    if tier == "kvikio-gds":
        import kvikio

        import teraio.runtime.tiers.gds as gds

        monkeypatch.setattr(kvikio, "CuFile", fake_cufile(fake))
        monkeypatch.setattr(gds, "kvikio_io_path", lambda: ("kvikio-gds", "test: GDS wanted"))
        monkeypatch.setattr(gds, "gds_conditions", lambda: (True, "test: the fake cuFile does GDS"))
    return standin
