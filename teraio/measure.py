"""Measure what a step really costs: peak memory and wall time, independently of teraio's bookkeeping.

On CPU there are no allocator statistics, so memory comes from the torch profiler's ``[memory]`` events
(docs/measured_facts.md): every allocation and free in the profiled region, in time order; the running sum's
maximum is the peak of bytes allocated during the region (it sees Inductor's buffers too), and its final
value what the region left alive. On CUDA, ``torch.cuda.max_memory_allocated`` relative to the start.
Memory that existed before the region (parameters, optimizer state, the batch) is not counted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

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


class MemoryRecorder:
    """Start/stop form of :func:`measure_memory`, for regions that span calls (a forward+backward)."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self._prof: torch.profiler.profile | None = None
        self._start_bytes = 0
        self._t0 = 0.0
        self._wall_s: float | None = None

    def start(self) -> None:
        if self.device.startswith("cuda") and torch.cuda.is_available():
            torch.cuda.synchronize()
            self._start_bytes = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
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
            torch.cuda.synchronize()
            return MemoryMeasurement(
                peak_bytes=torch.cuda.max_memory_allocated() - self._start_bytes,
                end_bytes=torch.cuda.memory_allocated() - self._start_bytes,
                wall_s=wall,
                method="cuda",
            )
        self._prof.__exit__(None, None, None)
        events = self._prof.profiler.kineto_results.events()
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
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True, record_shapes=False) as prof:
        t0 = time.perf_counter()
        result = fn()
        wall = time.perf_counter() - t0
    running = peak = 0
    for _ts, nbytes in _cpu_memory_events(prof):
        running += nbytes
        peak = max(peak, running)
    return result, MemoryMeasurement(peak_bytes=peak, end_bytes=running, wall_s=wall, method="torch.profiler")
