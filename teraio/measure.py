"""Measure what a step really costs: peak memory and wall time, independently of teraio's bookkeeping.

On CPU there are no allocator statistics, so memory comes from the torch profiler's ``[memory]`` events
(docs/measured_facts.md): every allocation and free in the profiled region, in time order; the running sum's
maximum is the peak of bytes allocated during the region (it sees Inductor's buffers too), and its final
value what the region left alive. On CUDA, ``torch.cuda.max_memory_allocated`` relative to the start.
Memory that existed before the region (parameters, optimizer state, the batch) is not counted.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

T = TypeVar("T")


@dataclass(frozen=True)
class MemoryMeasurement:
    peak_bytes: int  # maximum of bytes allocated and not yet freed during the region
    end_bytes: int  # bytes allocated during the region and still alive at its end
    wall_s: float
    method: str  # "torch.profiler" | "cuda"


def _cpu_memory_events(prof: torch.profiler.profile) -> list[tuple[int, int]]:
    # prof.events() drops most [memory] events (docs/measured_facts.md): read kineto's raw results instead.
    events = prof.profiler.kineto_results.events()
    out = [(e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"]
    out.sort(key=lambda x: x[0])
    return out


_END_MARK = "teraio::measure_end"

# ------------------------------------------------------------------------------ one session at a time
# torch's profiler does not nest: a second session started on top of a first one corrupts both (seen:
# wrong gradients with two overlapping sessions). Every measurement in the process takes this claim.
_SESSION_LOCK = threading.Lock()
_session_owner: object | None = None


class ProfilerBusyError(RuntimeError):
    """Another memory measurement (of this or another backend) is running."""


def claim_profiler(owner: object) -> bool:
    """Take the process's one profiler session for ``owner``. False when someone else holds it."""
    global _session_owner
    with _SESSION_LOCK:
        if _session_owner is not None and _session_owner is not owner:
            return False
        _session_owner = owner
        return True


def release_profiler(owner: object) -> None:
    global _session_owner
    with _SESSION_LOCK:
        if _session_owner is owner:
            _session_owner = None


# The profiler's C++ side writes these to stderr on every session; they say nothing to a user.
_NOISE = re.compile(
    r"(USDT:.*profiler_(start|stop))|(Memory block of unknown size was allocated before the profiling)"
    r"|(disableProfiler called but no active profiling session)"
)


class _QuietStderr:
    """Holds fd 2 in a temporary file while a session runs, then writes back all but the profiler's
    own noise (so the user's messages arrive, a step late, and the noise does not)."""

    def __init__(self) -> None:
        self._saved_fd: int | None = None
        self._tmp: tempfile._TemporaryFileWrapper | None = None

    def __enter__(self) -> _QuietStderr:
        try:
            sys.stderr.flush()
            self._tmp = tempfile.TemporaryFile(mode="w+b")
            self._saved_fd = os.dup(2)
            os.dup2(self._tmp.fileno(), 2)
        except (OSError, ValueError, AttributeError):
            self._restore()
        return self

    def _restore(self) -> bytes:
        data = b""
        if self._saved_fd is not None:
            try:
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
            os.dup2(self._saved_fd, 2)
            os.close(self._saved_fd)
            self._saved_fd = None
        if self._tmp is not None:
            self._tmp.seek(0)
            data = self._tmp.read()
            self._tmp.close()
            self._tmp = None
        return data

    def __exit__(self, *exc: object) -> None:
        data = self._restore()
        kept = [ln for ln in data.decode(errors="replace").splitlines(keepends=True) if not _NOISE.search(ln)]
        if kept:
            os.write(2, "".join(kept).encode())


class MemoryRecorder:
    """Start/stop form of :func:`measure_memory`, for regions that span calls (a forward+backward)."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self._quiet: _QuietStderr | None = None
        self._prof: torch.profiler.profile | None = None
        self.events: list[Any] = []  # the session's raw profiler events, after stop (CPU path)
        self._start_bytes = 0
        self._t0 = 0.0
        self._wall_s: float | None = None

    def start(self) -> None:
        """Start measuring.

        Raises:
            ProfilerBusyError: another measurement holds the process's profiler session.
        """
        if not claim_profiler(self):
            raise ProfilerBusyError(
                "another teraio memory measurement is running; measure one step at a time"
            )
        if self.device.startswith("cuda") and torch.cuda.is_available():
            torch.cuda.synchronize()
            self._start_bytes = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            self._quiet = _QuietStderr().__enter__()
            self._prof = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True, record_shapes=False
            )
            self._prof.__enter__()
        self._t0 = time.perf_counter()

    def mark_end(self) -> None:
        """Mark the end of the measured region without stopping the profiler.

        Note: [Profiler state inside backward] The autograd engine runs backward under a copy of the
        caller's thread-local state and restores it afterwards, so a profiler stopped inside backward
        is still enabled for the caller. Backward hooks therefore only mark the end (an annotation
        event); ``stop`` runs later on the caller's side and ignores events after the mark.
        """
        self._wall_s = time.perf_counter() - self._t0
        if self._prof is not None:
            with torch.profiler.record_function(_END_MARK):
                pass

    def stop(self) -> MemoryMeasurement:
        wall = self._wall_s if self._wall_s is not None else time.perf_counter() - self._t0
        if self._prof is None:
            release_profiler(self)
            torch.cuda.synchronize()
            return MemoryMeasurement(
                peak_bytes=torch.cuda.max_memory_allocated() - self._start_bytes,
                end_bytes=torch.cuda.memory_allocated() - self._start_bytes,
                wall_s=wall,
                method="cuda",
            )
        try:
            self._prof.__exit__(None, None, None)
        finally:
            if self._quiet is not None:
                self._quiet.__exit__(None, None, None)
                self._quiet = None
            release_profiler(self)
        events = self.events = list(self._prof.profiler.kineto_results.events())
        end_ns = min((e.start_ns() for e in events if e.name() == _END_MARK), default=None)
        running = peak = 0
        for ts, nbytes in _cpu_memory_events(self._prof):
            if end_ns is not None and ts > end_ns:
                break
            running += nbytes
            peak = max(peak, running)
        self._prof = None
        return MemoryMeasurement(peak_bytes=peak, end_bytes=running, wall_s=wall, method="torch.profiler")


def measure_memory(fn: Callable[[], T], device: str = "cpu") -> tuple[T, MemoryMeasurement]:
    """Run ``fn()`` once and measure the bytes it allocates: peak and what stays alive at the end."""
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        return result, MemoryMeasurement(
            peak_bytes=torch.cuda.max_memory_allocated() - start,
            end_bytes=torch.cuda.memory_allocated() - start,
            wall_s=wall,
            method="cuda",
        )
    rec = MemoryRecorder(device)
    rec.start()
    try:
        result = fn()
    except BaseException:
        rec.stop()
        raise
    return result, rec.stop()


def op_transient_bytes(events: list[Any], marker_prefix: str, num_ops: int) -> list[int]:
    """Per op marked ``<marker_prefix><i>`` (a ``record_function``): bytes the op allocated and freed
    again inside itself, above what was live when it returned (scratch buffers, masks, workspaces).

    A census between ops cannot see these; the profiler's allocation events can.
    """
    spans: dict[int, tuple[int, int]] = {}
    mem: list[tuple[int, int]] = []
    for e in events:
        name = e.name()
        if name == "[memory]":
            mem.append((e.start_ns(), e.nbytes()))
        elif name.startswith(marker_prefix):
            spans[int(name[len(marker_prefix) :])] = (e.start_ns(), e.start_ns() + e.duration_ns())
    mem.sort()
    out = [0] * num_ops
    j, running = 0, 0
    for i in sorted(spans):
        start, end = spans[i]
        while j < len(mem) and mem[j][0] < start:
            running += mem[j][1]
            j += 1
        peak = running
        while j < len(mem) and mem[j][0] <= end:
            running += mem[j][1]
            peak = max(peak, running)
            j += 1
        if 0 <= i < num_ops:
            out[i] = max(0, peak - running)
    return out
