"""Exactness tests compare bits across runs: use deterministic kernels, so a difference means teraio.

Some CPU kernels (parallel accumulations such as the embedding backward) may order additions
differently from run to run under load; deterministic mode removes that source of noise.
"""

from __future__ import annotations

import pytest
import torch

from . import shared


@pytest.fixture(scope="session", autouse=True)
def shared_runs_directory(tmp_path_factory: pytest.TempPathFactory):
    """Where ``shared.once_per_run`` keeps the runs several tests compare against: this test run's
    directory, common to its xdist workers."""
    shared.set_directory(shared.run_directory(tmp_path_factory.getbasetemp()))
    yield
    shared.set_directory(None)


@pytest.fixture(autouse=True)
def deterministic_kernels():
    old = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(old)


from .fake_cuda import fake_cuda  # noqa: E402, F401  (the fixture, for every test here)
