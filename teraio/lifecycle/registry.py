"""What every teraio backend in this process does, seen from one place.

Several backends may share a process (two models, a GAN's generator and discriminator, a validation
model beside a training one). Each plans and measures its own steps, but they share the process's memory,
its one torch profiler session and its disk. This module is the process-wide view of the live backends
(``teraio.process_stats()``); the count of forward calls across them is
:mod:`teraio.profiling.forward_count`.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any

_lock = threading.Lock()
_backends: weakref.WeakSet[Any] = weakref.WeakSet()
_ids = itertools.count(0)


def new_id() -> int:
    """A backend's id in this process, taken as its construction starts (in order of construction)."""
    with _lock:
        return next(_ids)


def register(backend: Any) -> None:
    """Add a constructed backend to the process-wide view (held weakly: a backend nobody uses leaves it).
    Only once constructed: the view calls its public methods (``finish_recorders``, ``stats``)."""
    with _lock:
        _backends.add(backend)


def unregister(backend: Any) -> None:
    """A closed backend leaves the view."""
    with _lock:
        _backends.discard(backend)


def backends() -> list[Any]:
    """The live backends, oldest first."""
    with _lock:
        return sorted(_backends, key=lambda b: b.backend_id)


def finish_measurements_everywhere() -> None:
    """Read every live backend's measurements whose steps ended (outside any backward only): the torch
    profiler's session is the process's one, so a backend about to plan or measure frees it for all."""
    for b in backends():
        b.finish_recorders()


def process_stats() -> list[dict[str, Any]]:
    """What each live backend of the process holds and did, one entry each, oldest first: its id, run
    directory, graphs, forward invocations in flight (their saved tensors held between forward and
    backward), bytes its runtime stores per tier now and at most, and the figures of ``stats()`` for the
    model it trained last (measured and predicted step peak, bytes moved per step)."""
    out = []
    for b in backends():
        st = b.stats()
        held = b.engine.stats() if b.engine is not None else None
        out.append(
            {
                "backend": b.backend_id,
                "run_dir": str(b.run_dir) if b.run_dir is not None else None,
                "graphs": st["graphs"],
                "models": len(st["models"]),
                "in_flight": b.tracker.in_flight,
                "held_nbytes": dict(held.held_nbytes) if held else {},
                "peak_held_nbytes": dict(held.peak_held_nbytes) if held else {},
                "measured_peak_bytes": st["measured_peak_bytes"],
                "predicted_peak_bytes": st["predicted_peak_bytes"],
                "moved_bytes_per_step": st["moved_bytes_per_step"],
            }
        )
    return out
