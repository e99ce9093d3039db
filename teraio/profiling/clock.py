"""Time work where it runs: the host clock on CPU, timing events on the current stream on CUDA.

A CUDA kernel launch returns before the kernel runs, so a host clock read around an op measures the
launch, not the op. On a CUDA device a :class:`Clock` marks time with timing events recorded on the
calling thread's current stream, through ``teraio.runtime.device`` (the fake device in tests).

Note: [Device time, not launch time]
    An event completes when its stream reaches it, so the difference between two events is what the
    stream spent on the work enqueued between them, whenever the host enqueued it. Events are read only
    once they completed: the profiler waits on the last event of a graph run (one host wait per run,
    none per op); the backend's step times read events that already completed and wait only when
    ``stats()`` asks, so training never waits for its own timing.
"""

from __future__ import annotations

import time
from typing import Any

import torch


class Clock:
    """Marks and durations for work on ``device``: host nanoseconds, or CUDA timing events."""

    def __init__(self, device: str | torch.device) -> None:
        from teraio.runtime import device as runtime_device  # the engine's package: only when timing

        self.device = torch.device(device)
        dev = runtime_device.current()
        # Without an available device (a CPU-only build), fake CUDA tensors still time on the host.
        self._dev = dev if self.device.type == "cuda" and dev.available() else None

    @property
    def on_device(self) -> bool:
        """Whether marks are device events (they complete later than they are made)."""
        return self._dev is not None

    def mark(self) -> Any:
        """Now: a host timestamp, or an event recorded on the current stream (Note: [Device time, ...])."""
        if self._dev is None:
            return time.perf_counter_ns()
        event = self._dev.new_event(timing=True)
        self._dev.record(event, self._dev.current_stream(self.device))
        return event

    def done(self, mark: Any) -> bool:
        """Whether ``mark`` can be read without a host wait."""
        return self._dev is None or self._dev.event_done(mark)

    def settle(self, mark: Any) -> None:
        """Block until the work enqueued before ``mark`` ran (nothing to wait for on the host clock)."""
        if self._dev is not None:
            self._dev.synchronize_event(mark)

    def synchronize(self) -> None:
        """Block until every stream of the device is idle (nothing to wait for on the host clock)."""
        if self._dev is not None:
            self._dev.synchronize(self.device)

    def elapsed_ns(self, start: Any, end: Any) -> int:
        """Nanoseconds from ``start`` to ``end``; device marks must have completed (:meth:`settle`)."""
        if self._dev is None:
            return int(end - start)
        return round(self._dev.elapsed_ms(start, end) * 1e6)
