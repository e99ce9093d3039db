"""Fixtures for runtime tests: one engine factory parametrised over every tier this machine can run.

host always; posix (O_DIRECT) and posix-buffered (the fallback) on a real directory; kvikio through
its real POSIX path with the stand-in CUDA driver, skipped when kvikio is not installed.
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
        from teraio.runtime.testing import load_cuda_driver_standin

        load_cuda_driver_standin()
        return RuntimeConfig(backend="kvikio", dirs=dirs, **kw)
    raise ValueError(tier)


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
