"""What every teraio backend in this process does, seen from one place.

Several backends may share a process (two models, a GAN's generator and discriminator, a validation
model beside a training one). Each plans and measures its own steps, but they share the process's memory,
its one torch profiler session and its disk. This module is the process-wide view they consult: a count
of forward calls across all backends (a measurement of one backend's step is valid only when no other
forward ran inside it) and the live backends themselves (``teraio.process_stats()``).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any

_lock = threading.Lock()
_forward_calls = itertools.count(1)
_last_forward = 0
_backends: weakref.WeakSet[Any] = weakref.WeakSet()


def note_forward() -> int:
    """Count one forward call of any compiled graph of any backend; returns its number."""
    global _last_forward
    with _lock:
        _last_forward = next(_forward_calls)
        return _last_forward


def forward_calls() -> int:
    """How many forward calls all backends of this process have seen so far."""
    return _last_forward


def register(backend: Any) -> None:
    """Add a backend to the process-wide view (held weakly: a backend nobody uses leaves it)."""
    with _lock:
        _backends.add(backend)


def backends() -> list[Any]:
    """The live backends, oldest first."""
    with _lock:
        return sorted(_backends, key=lambda b: b.backend_id)
