"""Runs that several tests compare against, made once per test run and shared by the xdist workers.

A reference run with ``enabled=False`` costs a compile (an Inductor one takes 20-40 s on 2 cores), and
several tests may need the very same one. ``once_per_run(key, compute)`` runs ``compute`` the first time
any worker of this test run asks for ``key``, under a file lock in the run's shared temporary directory
(the parent of each worker's base directory, as for tests/test_readme.py's documents), and every later
request, in any worker, loads what it saved (``torch.save``: tensors come back bit for bit). Nothing is
kept from one test run to the next. Outside pytest (a test module run as a script), it just computes.
``key`` must name everything the result depends on.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from filelock import FileLock

T = TypeVar("T")

_DIRECTORY: Path | None = None  # set by the session fixture of tests/teraio/conftest.py
_MEMO: dict[str, Any] = {}


def run_directory(base_temp: Path) -> Path:
    """This test run's directory, common to its xdist workers: the parent of a worker's base temporary
    directory, or the base itself in a run without workers. (PYTEST_XDIST_WORKER, not xdist's
    ``worker_id`` fixture, which does not exist under ``-p no:xdist``.)"""
    return base_temp.parent if os.environ.get("PYTEST_XDIST_WORKER") else base_temp


def set_directory(path: Path | None) -> None:
    global _DIRECTORY
    _DIRECTORY = path


def once_per_run(key: str, compute: Callable[[], T]) -> T:
    if key in _MEMO:
        return _MEMO[key]
    if _DIRECTORY is None:
        return compute()
    readable = re.sub(r"[^\w.-]", "_", key)[:80]
    path = _DIRECTORY / f"shared-{readable}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"
    with FileLock(str(path) + ".lock"):
        if path.is_file():
            value = torch.load(path, weights_only=False)
        else:
            value = compute()
            torch.save(value, path)
    _MEMO[key] = value
    return value
