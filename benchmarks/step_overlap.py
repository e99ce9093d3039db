"""What a training step waited on and what the disk did meanwhile, per step (``bench_states``).

Issue 41 asks for the overlap of the optimizer step with compute to be seen, not inferred:

- ``compute_wait_s``: seconds the training thread spent blocked on the states' engine (a fetch waiting
  for its read, a write's release waiting for the disk): the engine's ``stall_s`` over the step.
- ``disk_busy_s`` / ``disk_idle_s``: seconds during which at least one read or write of the states'
  engine was in flight (``io_busy_s``), and the rest of the step's wall time.
- ``io_threads_cpu_s``: CPU seconds (user and system) of the engine's I/O threads over the step, read
  from ``/proc/self/task/<tid>/stat``: checksums and bounce copies run as user time there, syscalls and
  the page faults of fresh read buffers as system time. On a CPU machine they compete with compute for
  the same cores; per GB moved they say how much.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def io_threads_cpu_s() -> tuple[float, float]:
    """User and system CPU seconds of the live teraio I/O threads of this process."""
    user = system = 0.0
    for t in threading.enumerate():
        if not t.name.startswith("teraio-io") or t.native_id is None:
            continue
        try:
            with open(f"/proc/self/task/{t.native_id}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # After the command's closing parenthesis: state is field 3, utime 14 and stime 15 (1-based).
        user += int(fields[11]) / _TICKS_PER_S
        system += int(fields[12]) / _TICKS_PER_S
    return user, system


@dataclass(frozen=True)
class EngineMark:
    """The counters a step's figures are differences of."""

    stall_s: float
    io_busy_s: float
    io_user_s: float
    io_system_s: float

    @classmethod
    def now(cls, engine: Any) -> EngineMark:
        st = engine.stats()
        user, system = io_threads_cpu_s()
        return cls(st.stall_s, st.io_busy_s, user, system)


def step_figures(before: EngineMark, after: EngineMark, step_s: float) -> dict[str, float]:
    """One step's wait, disk and I/O-thread figures (see the module's docstring)."""
    busy = after.io_busy_s - before.io_busy_s
    return {
        "compute_wait_s": after.stall_s - before.stall_s,
        "disk_busy_s": busy,
        "disk_idle_s": max(0.0, step_s - busy),
        "io_threads_user_s": after.io_user_s - before.io_user_s,
        "io_threads_system_s": after.io_system_s - before.io_system_s,
    }


def overlap_summary(running: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the running steps, and the I/O threads' CPU seconds per GB moved."""
    import statistics

    def med(key: str) -> float:
        return statistics.median(r[key] for r in running)

    moved_gb = statistics.median(
        (sum(r["written_bytes"].values()) + sum(r["read_bytes"].values())) / 1e9 for r in running
    )
    user, system = med("io_threads_user_s"), med("io_threads_system_s")
    return {
        "forward_s": med("forward_s"),
        "backward_s": med("backward_s"),
        "optimizer_step_s": med("optimizer_step_s"),
        "compute_wait_s": med("compute_wait_s"),
        "disk_busy_s": med("disk_busy_s"),
        "disk_idle_s": med("disk_idle_s"),
        "moved_gb_per_step": moved_gb,
        "io_threads_user_s_per_gb": user / moved_gb if moved_gb else 0.0,
        "io_threads_system_s_per_gb": system / moved_gb if moved_gb else 0.0,
    }
