"""Where `bench_states`'s training thread waited, and three pipeline experiments (issue 41, 2026-11-30).

Not part of teraio or the suite: a ``sitecustomize`` module that the benchmark's training child imports at
start when its directory is on ``PYTHONPATH`` (``bench_states`` passes ``PYTHONPATH`` on to the child).
Copy it to a directory of its own as ``sitecustomize.py`` and run, from the repository root::

    STALL_OUT=/tmp/stalls STALL_FROM=5 PYTHONPATH=DIR python -m benchmarks.bench_states --budget 14GB --steps 8

Every wait the states' engine counts as a stall (``compute_wait_s``) is added to a key made of the phase
(``backward`` while ``torch.autograd.backward`` runs, else ``fwd/step``) and the three innermost teraio
frames that waited, from the ``STALL_FROM``-th backward on; each process writes ``STALL_OUT.<pid>`` (JSON:
key -> [seconds, count]) after every backward.

Experiments, off unless set (they change teraio's behaviour in the child only, for a measurement):

- ``EXP_IO_THREADS=N``: the states' engine with N I/O threads (the runtime's default is 2).
- ``EXP_DEPTH2=1``: the step run in the next forward reads two chunks ahead instead of one.
- ``EXP_GRAD_WINDOW=BYTES``: gradient writes in flight during backward before a hook waits, at least BYTES
  (teraio's default is twice ``states_chunk_bytes``).
- ``EXP_WRITE_LAG2=1``: the step run in the next forward waits for the writes of chunk i-2 after updating
  chunk i (teraio waits for chunk i-1's).
- ``EXP_NO_CHECKSUM=1``: the states' engine without its per-chunk checksums.
- ``EXP_CHECKSUM=NAME``: the states' engine with that checksum (``crc32c``, the default, or ``xxhash``,
  which needs the ``xxhash`` package: not a dependency of teraio, installed by hand for the run).
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import json
import os
import sys
from typing import Any


def _install_stall_attribution(out: str, start_at_backward: int) -> None:
    import torch

    from teraio.runtime import stats

    seconds_by_key: dict[str, float] = collections.defaultdict(float)
    count_by_key: collections.Counter[str] = collections.Counter()
    phase = ["fwd/step"]
    backwards = [0]
    add_stall = stats.StatsCollector.add_stall

    def attributed(self: Any, seconds: float) -> None:
        frame = sys._getframe(1)
        labels: list[str] = []
        while frame is not None and len(labels) < 3:
            path = frame.f_code.co_filename
            if f"{os.sep}teraio{os.sep}" in path and f"{os.sep}runtime{os.sep}" not in path:
                labels.append(f"{os.path.basename(path)}:{frame.f_code.co_name}")
            frame = frame.f_back
        if backwards[0] >= start_at_backward:
            key = f"{phase[0]} | " + " < ".join(labels)
            seconds_by_key[key] += seconds
            count_by_key[key] += 1
        add_stall(self, seconds)

    def dump() -> None:
        ranked = sorted(seconds_by_key.items(), key=lambda kv: -kv[1])
        with open(f"{out}.{os.getpid()}", "w") as f:
            json.dump({k: [v, count_by_key[k]] for k, v in ranked}, f, indent=1)

    backward = torch.autograd.backward

    def phased_backward(*args: Any, **kwargs: Any) -> Any:
        phase[0] = "backward"
        try:
            return backward(*args, **kwargs)
        finally:
            phase[0] = "fwd/step"
            backwards[0] += 1
            dump()

    stats.StatsCollector.add_stall = attributed  # type: ignore[method-assign]
    torch.autograd.backward = phased_backward
    atexit.register(dump)


def _engine_config(**changes: Any) -> None:
    from teraio.lifecycle import engines

    runtime_config = engines.runtime_config

    def changed(cfg: Any, reserve_bytes: int | None = None) -> Any:
        return dataclasses.replace(runtime_config(cfg, reserve_bytes), **changes)

    engines.runtime_config = changed  # the states' engine is made through this module attribute


def _read_two_chunks_ahead() -> None:
    from teraio.states import step_pipeline

    update_chunk = step_pipeline.update_chunk

    def deeper(stream: Any, pos: int, idxs: Any, loads: list[Any], *args: Any, **kwargs: Any) -> Any:
        for ahead in (1, 2):  # in order: the next chunk's reads are queued first
            if pos + ahead < len(loads):
                for rec in loads[pos + ahead]:
                    stream.store.prefetch(rec)
        return update_chunk(stream, pos, idxs, loads, *args, **kwargs)

    step_pipeline.update_chunk = deeper


def _write_lag_two() -> None:
    from teraio.states.step_pipeline import OverlappedStep

    finish_writes, commit = OverlappedStep._finish_chunk_writes, OverlappedStep._commit

    def lagged(self: Any, pos: int, keep: tuple[int, ...]) -> None:
        # Called for chunk i-1 after chunk i's update (and for the last chunk at the end): waits for the
        # one before it instead.
        self.exp_keep = keep
        if pos >= 1:
            finish_writes(self, pos - 1, keep)

    def commit_after_the_last_two(self: Any) -> None:
        for pos in range(max(0, len(self.chunks) - 2), len(self.chunks)):
            finish_writes(self, pos, getattr(self, "exp_keep", ()))
        commit(self)

    OverlappedStep._finish_chunk_writes = lagged  # type: ignore[method-assign]
    OverlappedStep._commit = commit_after_the_last_two  # type: ignore[method-assign]


def _gradient_window(nbytes: int) -> None:
    from teraio.states.grads import GradOffload

    settle = GradOffload._settle

    def wider(self: Any, *, block: bool) -> None:
        window = self.window_bytes
        self.window_bytes = max(window, nbytes)
        try:
            settle(self, block=block)
        finally:
            self.window_bytes = window

    GradOffload._settle = wider  # type: ignore[method-assign]


if os.environ.get("STALL_OUT"):
    _install_stall_attribution(os.environ["STALL_OUT"], int(os.environ.get("STALL_FROM", "4")))
if os.environ.get("EXP_IO_THREADS"):
    _engine_config(io_threads=int(os.environ["EXP_IO_THREADS"]))
if os.environ.get("EXP_NO_CHECKSUM"):
    _engine_config(checksum=False)
if os.environ.get("EXP_CHECKSUM"):
    _engine_config(checksum=os.environ["EXP_CHECKSUM"])
if os.environ.get("EXP_WRITE_LAG2"):
    _write_lag_two()
if os.environ.get("EXP_DEPTH2"):
    _read_two_chunks_ahead()
if os.environ.get("EXP_GRAD_WINDOW"):
    _gradient_window(int(os.environ["EXP_GRAD_WINDOW"]))
