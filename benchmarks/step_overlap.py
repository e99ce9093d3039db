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
    #: Bytes the disk tier finished reading and writing (a transfer counts when it completes).
    read_bytes: int = 0
    written_bytes: int = 0

    @classmethod
    def now(cls, engine: Any) -> EngineMark:
        st = engine.stats()
        user, system = io_threads_cpu_s()
        read = st.transfers.get("ssd.read")
        written = st.transfers.get("ssd.write")
        return cls(
            st.stall_s,
            st.io_busy_s,
            user,
            system,
            read.nbytes if read is not None else 0,
            written.nbytes if written is not None else 0,
        )


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


PHASES = ("forward", "backward", "optimizer_step")


def phase_figures(marks: list[EngineMark], times_s: list[float]) -> dict[str, float]:
    """Each phase's wait and disk-idle seconds (``marks`` at the phases' boundaries: forward, backward
    with the clip, ``opt.step()``), so the overlap is seen phase by phase: ``forward_compute_wait_s``,
    ``forward_disk_idle_s``, ``forward_read_gb``, ``forward_written_gb`` and the same for ``backward``
    and ``optimizer_step`` (bytes of the transfers that completed in the phase)."""
    out: dict[str, float] = {}
    for name, a, b, dt in zip(PHASES, marks, marks[1:], times_s):
        out[f"{name}_compute_wait_s"] = b.stall_s - a.stall_s
        out[f"{name}_disk_idle_s"] = max(0.0, dt - (b.io_busy_s - a.io_busy_s))
        out[f"{name}_read_gb"] = (b.read_bytes - a.read_bytes) / 1e9
        out[f"{name}_written_gb"] = (b.written_bytes - a.written_bytes) / 1e9
    return out


def phase_bound(
    compute: dict[str, float],
    layers: int,
    overlap: dict[str, float],
    raw_read_gb_per_s: float,
    raw_write_gb_per_s: float,
    update_in_forward: float,
    update_in_backward: bool = False,
) -> dict[str, float]:
    """The fastest step with the phases this step has, on this CPU and disk: each phase at the larger of
    its compute alone and its bytes (as moved, medians) at the raw disk rates, the phases one after the
    other. max(compute, I/O bound) assumes any byte can move while anything computes; a step that clips
    over all gradients cannot move its update's bytes before the backward has ended (and, under a
    budget, has no memory to read them ahead), so this is the bound its phases allow.
    ``update_in_forward``: the fraction of the blocks' update the next forward runs (the offloaded
    parameters' share; the rest runs in ``opt.step()``)."""
    n = layers
    update_s = n * compute["layer_update_s"]
    forward_s = n * compute["layer_forward_s"]
    backward_s = n * (compute["layer_forward_backward_s"] - compute["layer_forward_s"])
    backward_s += compute["embedding_and_head_s"]
    computes = {
        "forward": forward_s + (0.0 if update_in_backward else update_in_forward * update_s),
        "backward": backward_s + (update_s if update_in_backward else 0.0),
        "optimizer_step": 0.0 if update_in_backward else (1.0 - update_in_forward) * update_s,
    }
    out: dict[str, float] = {}
    total = 0.0
    for ph in PHASES:
        io_s = overlap[f"{ph}_read_gb"] / raw_read_gb_per_s + overlap[f"{ph}_written_gb"] / raw_write_gb_per_s
        out[f"{ph}_compute_alone_s"] = computes[ph]
        out[f"{ph}_io_at_raw_rates_s"] = io_s
        total += max(computes[ph], io_s)
    out["phase_bound_s"] = total
    return out


def overlap_summary(running: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the running steps, and the I/O threads' CPU seconds per GB moved."""
    import statistics

    def med(key: str) -> float:
        return statistics.median(r[key] for r in running)

    moved_gb = statistics.median(
        (sum(r["written_bytes"].values()) + sum(r["read_bytes"].values())) / 1e9 for r in running
    )
    user, system = med("io_threads_user_s"), med("io_threads_system_s")
    by_phase = {
        f"{ph}_{what}": med(f"{ph}_{what}")
        for ph in PHASES
        for what in ("compute_wait_s", "disk_idle_s", "read_gb", "written_gb")
        if all(f"{ph}_{what}" in r for r in running)
    }
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
        **by_phase,
    }
