"""One count of forward calls across every teraio backend in the process.

Several backends may share a process (two models, a GAN's generator and discriminator, a validation model
beside a training one), and they share its memory and its one torch profiler session: a measurement of
one backend's step is valid only when no other forward ran inside it. Comparing this count before and
after the measurement tells.
"""

from __future__ import annotations

import itertools
import threading

_lock = threading.Lock()
_forward_calls = itertools.count(1)
_last_forward = 0


def note_forward() -> int:
    """Count one forward call of any compiled graph of any backend; returns its number."""
    global _last_forward
    with _lock:
        _last_forward = next(_forward_calls)
        return _last_forward


def forward_calls() -> int:
    """How many forward calls all backends of this process have seen so far."""
    return _last_forward
