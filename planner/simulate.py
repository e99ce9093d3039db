"""The simulator: the one judge of every plan, written without reference to any solver.

It replays a Plan against its Profile and a HardwareModel under the project's execution model and
predicts step time, stall per op, the memory timeline and peak, the I/O timeline and bytes moved, and
lists every way the plan breaks the rules (a tensor used while away, a read before its write completes,
a budget or tier capacity exceeded).

Execution model (shared with the solvers and the runtime):

- Ops run in index order. At the boundary before op ``i`` (time ``t`` = end of op ``i-1``), in order:
  (1) wait for every write with ``wait_before_idx == i``; (2) issue every read with
  ``prefetch_before_idx == i``; (3) wait for every read with ``fetch_before_idx == i``. Op ``i`` starts
  when all of that is done; the delay after ``t`` is op ``i``'s stall. Waits and fetches at
  ``num_fwd_ops`` are the end of forward. Waiting before issuing guarantees a read issued at the same
  boundary as its own wait starts after the write completed.
- A write is issued when op ``offload_after_idx`` ends.
- Transfers run on FIFO channels in issue order (ties: decision order in the plan): per tier one write
  queue and one read queue, or a single queue when the tier's ``shared_channel`` is set. A transfer
  takes ``latency + nbytes / (bw * count)``.
- Memory during op ``i`` = the lifetime analysis' baseline minus every moved tensor absent at ``i``
  (``wait_before_idx <= i < prefetch_before_idx``). Bytes held by a tier count against its capacity
  over ops ``offload_after_idx + 1 .. fetch_before_idx``, never against the budget.
- CPU interference: a transfer costs ``nbytes * cpu_s_per_byte`` of compute, charged to the ops it
  overlaps in proportion to the overlap (measured against each op's nominal duration window). Overlap
  with a stall is free: the compute thread is idle then. Step time = compute + stall + interference.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from teraio.planner.hardware import HardwareModel
from teraio.planner.lifetimes import Lifetimes, analyse
from teraio.planner.plan import Decision, Plan, PlanError
from teraio.planner.profile import Profile

IO_COLUMNS = ("name", "tier", "direction", "issue_idx", "issue_s", "start_s", "end_s", "nbytes")
#: Stall below this (seconds) counts as none: float sums of many op durations are not exact.
STALL_TOLERANCE_S = 1e-9
_SECONDS_PER_DAY = 86400.0


@dataclass
class SimResult:
    """What one simulated step looked like. Per-op arrays are indexed by op index."""

    step_s: float
    stall_s: float
    compute_s: float
    interference_s: float
    peak_bytes: int
    peak_idx: int
    memory_bytes: np.ndarray
    stall_s_per_op: np.ndarray
    op_start_s: np.ndarray
    op_end_s: np.ndarray
    io_timeline: pd.DataFrame
    written_bytes: int
    read_bytes: int
    ssd_tb_written_per_day: float
    tier_peak_bytes: dict[str, int] = field(default_factory=dict)
    budget_bytes: int | None = None
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when the plan breaks no rule (including the budget, when one was given)."""
        return not self.violations

    @property
    def within_budget(self) -> bool:
        return self.budget_bytes is None or self.peak_bytes <= self.budget_bytes

    def summary(self) -> dict[str, Any]:
        """Scalar figures as a JSON-ready dict (the CLI's ``--json``)."""
        return {
            "step_s": self.step_s,
            "stall_s": self.stall_s,
            "compute_s": self.compute_s,
            "interference_s": self.interference_s,
            "peak_bytes": self.peak_bytes,
            "peak_idx": self.peak_idx,
            "budget_bytes": self.budget_bytes,
            "written_bytes": self.written_bytes,
            "read_bytes": self.read_bytes,
            "ssd_tb_written_per_day": self.ssd_tb_written_per_day,
            "tier_peak_bytes": dict(self.tier_peak_bytes),
            "violations": list(self.violations),
        }


def _check_decision(lt: Lifetimes, d: Decision, hardware: HardwareModel) -> tuple[list[str], bool]:
    """Rule violations of one decision, and whether it can be simulated at all."""
    problems: list[str] = []
    n, nf = lt.num_ops, lt.num_fwd_ops
    if not lt.graph.has_node(("tensor", d.name)):
        return [f"decision for '{d.name}': no such tensor in the profile"], False
    if not lt.is_candidate(d.name):
        return [
            f"decision for '{d.name}': not an offload candidate (param/input, not offloadable, "
            f"or never idle between forward and backward)"
        ], False
    if d.tier not in hardware.tiers:
        return [f"decision for '{d.name}': tier '{d.tier}' is not in the hardware model"], False
    for label, idx in (
        ("offload_after", d.offload_after_idx),
        ("wait_before", d.wait_before_idx),
        ("prefetch_before", d.prefetch_before_idx),
        ("fetch_before", d.fetch_before_idx),
    ):
        if not 0 <= idx < n:
            return [
                f"decision for '{d.name}': {label}_idx {idx} is outside the profile's ops 0..{n - 1}"
            ], False
        name = getattr(d, f"{label}_name")
        if name != lt.op_names[idx]:
            problems.append(
                f"decision for '{d.name}': {label} names op '{name}' but op {idx} is "
                f"'{lt.op_names[idx]}' (plan made for another graph?)"
            )
    c = lt.candidate(d.name)
    if hardware.tiers[d.tier].capacity_bytes == 0:
        problems.append(f"'{d.name}' goes to tier '{d.tier}', which is unavailable (capacity 0)")
    if d.nbytes != int(c["nbytes"]):
        problems.append(f"'{d.name}' has nbytes {d.nbytes} in the plan but {int(c['nbytes'])} in the profile")
    if d.offload_after_idx < c["producer_idx"]:
        problems.append(
            f"'{d.name}' write issued after op {d.offload_after_idx}, before its producer "
            f"op {int(c['producer_idx'])}"
        )
    if d.offload_after_idx >= d.wait_before_idx:
        problems.append(
            f"'{d.name}' write waited before op {d.wait_before_idx}, not after it is issued "
            f"(after op {d.offload_after_idx})"
        )
    if d.wait_before_idx <= c["last_fwd_use_idx"]:
        problems.append(
            f"'{d.name}' used while away: waited (freed) before op {d.wait_before_idx} but "
            f"used in forward by op {int(c['last_fwd_use_idx'])}"
        )
    if d.wait_before_idx > nf:
        problems.append(
            f"'{d.name}' write waited before op {d.wait_before_idx}, after the end of forward ({nf})"
        )
    if d.prefetch_before_idx < nf:
        problems.append(f"'{d.name}' read issued before op {d.prefetch_before_idx}, a forward op")
    if d.fetch_before_idx > c["first_bwd_use_idx"]:
        problems.append(
            f"'{d.name}' used while away: fetched before op {d.fetch_before_idx} but first "
            f"used in backward by op {int(c['first_bwd_use_idx'])}"
        )
    if d.fetch_before_idx < d.prefetch_before_idx:
        problems.append(
            f"'{d.name}' fetched before op {d.fetch_before_idx}, before its read is issued "
            f"(op {d.prefetch_before_idx})"
        )
    return problems, True


def _channel(hardware: HardwareModel, tier: str, direction: str) -> tuple[str, str]:
    return (tier, "rw") if hardware.tiers[tier].shared_channel else (tier, direction)


def simulate_decisions(
    lifetimes: Lifetimes,
    decisions: list[Decision] | tuple[Decision, ...],
    hardware: HardwareModel,
    *,
    budget_bytes: int | None = None,
) -> SimResult:
    """Simulate ``decisions`` (in plan order) on the step described by ``lifetimes``.

    Decisions that cannot be placed at all (unknown tensor or tier, index out of range) are reported
    as violations and left out; every other rule break is reported and simulated as written.
    """
    lt = lifetimes
    n = lt.num_ops
    violations: list[str] = []
    seen: set[str] = set()
    valid: list[Decision] = []
    for d in decisions:
        if d.name in seen:
            violations.append(f"'{d.name}' has more than one decision")
            continue
        seen.add(d.name)
        problems, usable = _check_decision(lt, d, hardware)
        violations.extend(problems)
        if usable:
            valid.append(d)

    writes_after: dict[int, list[int]] = defaultdict(list)
    waits_before: dict[int, list[int]] = defaultdict(list)
    reads_before: dict[int, list[int]] = defaultdict(list)
    fetches_before: dict[int, list[int]] = defaultdict(list)
    for k, d in enumerate(valid):
        writes_after[d.offload_after_idx].append(k)
        waits_before[d.wait_before_idx].append(k)
        reads_before[d.prefetch_before_idx].append(k)
        fetches_before[d.fetch_before_idx].append(k)

    m = len(valid)
    w_issue = np.full(m, np.nan)
    w_start = np.full(m, np.nan)
    w_end = np.full(m, np.nan)
    r_issue = np.full(m, np.nan)
    r_start = np.full(m, np.nan)
    r_end = np.full(m, np.nan)
    w_issue_idx = np.full(m, -1)
    r_issue_idx = np.full(m, -1)
    free_s: dict[tuple[str, str], float] = defaultdict(float)
    # Per channel, transfers not yet fully charged for CPU interference: (start, end, cost_s).
    in_flight: dict[tuple[str, str], deque[tuple[float, float, float]]] = defaultdict(deque)

    def issue(k: int, direction: str, at_s: float) -> tuple[float, float]:
        d = valid[k]
        tier = hardware.tiers[d.tier]
        ch = _channel(hardware, d.tier, direction)
        start = max(at_s, free_s[ch])
        dur = tier.write_s(d.nbytes) if direction == "write" else tier.read_s(d.nbytes)
        end = start + dur
        free_s[ch] = end
        cost = d.nbytes * tier.cpu_s_per_byte
        if cost > 0 and end > start:
            in_flight[ch].append((start, end, cost))
        return start, end

    dur_s = lt.duration_us / 1e6
    stall = np.zeros(n)
    interference = np.zeros(n)
    op_start = np.zeros(n)
    op_end = np.zeros(n)
    t = 0.0
    for i in range(n):
        ready = t
        for k in waits_before.get(i, ()):
            ready = max(ready, w_end[k])
        for k in reads_before.get(i, ()):
            r_issue[k], r_issue_idx[k] = ready, i
            r_start[k], r_end[k] = issue(k, "read", ready)
        start = ready
        for k in fetches_before.get(i, ()):
            start = max(start, r_end[k])
        stall[i] = start - t
        win_end = start + dur_s[i]
        charged = 0.0
        for queue in in_flight.values():
            while queue and queue[0][1] <= start:
                queue.popleft()
            for x_start, x_end, cost in queue:
                if x_start >= win_end:
                    break
                overlap = min(x_end, win_end) - max(x_start, start)
                if overlap > 0:
                    charged += cost * overlap / (x_end - x_start)
        interference[i] = charged
        op_start[i] = start
        t = op_end[i] = win_end + charged
        for k in writes_after.get(i, ()):
            w_issue[k], w_issue_idx[k] = t, i
            w_start[k], w_end[k] = issue(k, "write", t)

    for k, d in enumerate(valid):
        if r_start[k] < w_end[k] - STALL_TOLERANCE_S:
            violations.append(
                f"'{d.name}' read starts at {r_start[k]:.6f} s, before its write completes "
                f"at {w_end[k]:.6f} s"
            )

    memory = lt.memory_with(valid)
    peak_idx = int(np.argmax(memory)) if n else 0
    peak = int(memory[peak_idx]) if n else 0
    if budget_bytes is not None and peak > budget_bytes:
        violations.append(
            f"peak {peak} bytes at op {peak_idx} ('{lt.op_name(peak_idx)}') exceeds the budget "
            f"of {budget_bytes} bytes"
        )

    tier_peak: dict[str, int] = {}
    for tier_name in sorted({d.tier for d in valid}):
        held = np.zeros(n + 1, dtype=np.int64)
        for d in valid:
            if d.tier == tier_name:
                held[d.offload_after_idx + 1] += d.nbytes
                held[d.fetch_before_idx + 1] -= d.nbytes
        tier_peak[tier_name] = int(np.cumsum(held)[:n].max())
        cap = hardware.tiers[tier_name].capacity_bytes
        if cap and tier_peak[tier_name] > cap:
            violations.append(
                f"tier '{tier_name}' holds {tier_peak[tier_name]} bytes, over its capacity of {cap} bytes"
            )

    rows = []
    for k, d in enumerate(valid):
        rows.append(
            (d.name, d.tier, "write", int(w_issue_idx[k]), w_issue[k], w_start[k], w_end[k], d.nbytes)
        )
        rows.append((d.name, d.tier, "read", int(r_issue_idx[k]), r_issue[k], r_start[k], r_end[k], d.nbytes))
    io = pd.DataFrame(rows, columns=list(IO_COLUMNS)).sort_values(["issue_s", "direction"], kind="stable")
    io = io.reset_index(drop=True)

    compute_s = float(dur_s.sum())
    stall_s = float(stall.sum())
    interference_s = float(interference.sum())
    step_s = float(op_end[-1]) if n else 0.0
    written = sum(d.nbytes for d in valid)
    ssd_written = sum(d.nbytes for d in valid if d.tier == "ssd")
    tb_per_day = ssd_written / step_s * _SECONDS_PER_DAY / 1e12 if step_s > 0 else 0.0
    return SimResult(
        step_s=step_s,
        stall_s=stall_s,
        compute_s=compute_s,
        interference_s=interference_s,
        peak_bytes=peak,
        peak_idx=peak_idx,
        memory_bytes=memory,
        stall_s_per_op=stall,
        op_start_s=op_start,
        op_end_s=op_end,
        io_timeline=io,
        written_bytes=int(written),
        read_bytes=int(written),
        ssd_tb_written_per_day=float(tb_per_day),
        tier_peak_bytes=tier_peak,
        budget_bytes=budget_bytes,
        violations=violations,
    )


def simulate(
    profile: Profile,
    plan: Plan,
    hardware: HardwareModel | None = None,
    *,
    budget_bytes: int | None = None,
    lifetimes: Lifetimes | None = None,
) -> SimResult:
    """Replay ``plan`` on ``profile`` (see the module docstring for the execution model).

    Args:
        hardware: what-if hardware; defaults to the hardware model stored in the plan.
        budget_bytes: what-if budget; defaults to the plan's budget.
        lifetimes: ``analyse(profile)`` when the caller already has it (saves the analysis).

    Raises:
        PlanError: the plan was made for another profile (fingerprints differ).
    """
    if plan.fingerprint != profile.fingerprint:
        raise PlanError(
            f"plan was made for graph {plan.fingerprint[:12]}, not this profile's ({profile.fingerprint[:12]}); "
            f"re-plan from this profile"
        )
    lt = lifetimes if lifetimes is not None else analyse(profile)
    hw = hardware if hardware is not None else plan.hardware
    budget = budget_bytes if budget_bytes is not None else plan.budget_bytes
    return simulate_decisions(lt, plan.decisions, hw, budget_bytes=budget)
