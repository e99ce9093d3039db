"""The simulator: the one judge of every plan, written without reference to any solver.

It replays a Plan against its Profile and a HardwareModel under the project's execution model and
predicts step time, stall per op, the memory timeline and peak, the I/O timeline and bytes moved, and
lists every way the plan breaks the rules (a tensor used while away, a read before its write completes,
a budget or tier capacity exceeded).

The execution model (op boundaries, FIFO channels, queue orders, CPU interference) is
:mod:`planner.execution`'s, whose :func:`~planner.execution.replay` this module calls; on top of it:

- Memory during op ``i`` = the lifetime analysis' baseline minus every moved tensor absent at ``i``
  (``wait_before_idx <= i < prefetch_before_idx``). Bytes held by a tier count against its capacity
  over ops ``offload_after_idx + 1 .. fetch_before_idx``, never against the budget.
- Step time = compute + stall + interference.
- Every rule break is a :class:`Violation` record (kind, tensor, message), never a bare string.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pandas as pd

from teraio.planner.execution import replay
from teraio.planner.hardware import HardwareModel
from teraio.planner.lifetimes import Lifetimes, analyse
from teraio.planner.plan import Decision, Plan, PlanError
from teraio.planner.profile import Profile

IO_COLUMNS = ("name", "tier", "direction", "issue_idx", "issue_s", "start_s", "end_s", "nbytes")
#: Stall below this (seconds) counts as none: float sums of many op durations are not exact.
STALL_TOLERANCE_S = 1e-9
_SECONDS_PER_DAY = 86400.0


ViolationKind = Literal[
    "duplicate",  # more than one decision for a tensor
    "unknown_tensor",  # no such tensor in the profile
    "not_candidate",  # a param/input, not offloadable, or never idle
    "unknown_tier",  # tier not in the hardware model
    "index_range",  # an op index outside the profile
    "name_mismatch",  # op name differs from the profile's (plan for another graph?)
    "tier_unavailable",  # tier with capacity 0
    "nbytes",  # size differs from the profile's
    "order",  # positions out of order (write before producer, wait before issue, fetch before prefetch)
    "used_while_away",  # freed before its last forward use, or fetched after its first backward use
    "phase",  # wait after the end of forward, or read issued in forward
    "queue_order",  # ranks that contradict the issue positions
    "read_before_write",  # read started before the write completed
    "budget",  # peak over the budget
    "capacity",  # a tier holds more than its capacity
    # Found by the checks of a solver's own claims (``planner.solve``, ``planner.solvers.ilp``), never by
    # the simulator itself; they reach users only inside a SolverBugError.
    "model_optimistic",  # the exact model predicts a faster step or a smaller peak than the simulator finds
    "model_pessimistic",  # an optimal model step above the simulated one by more than rounding and CPU charge
    "bound_above_step",  # a lower bound above the simulated step of a plan within the budget
]
#: Violations that make a plan infeasible but not invalid: the plan is sound, only too big.
OVER_LIMIT_KINDS: frozenset[str] = frozenset({"budget", "capacity"})


@dataclass(frozen=True)
class Violation:
    """One way a plan breaks the rules: what kind, which tensor ("" for plan-wide), and a readable line."""

    kind: ViolationKind
    tensor: str
    message: str

    def __str__(self) -> str:
        return self.message

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "tensor": self.tensor, "message": self.message}


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
    violations: list[Violation] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when the plan breaks no rule (including the budget, when one was given)."""
        return not self.violations

    def broken_rules(self) -> list[Violation]:
        """Violations other than budget and capacity: a plan with any is invalid, not merely too big."""
        return [v for v in self.violations if v.kind not in OVER_LIMIT_KINDS]

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
            "violations": [v.to_dict() for v in self.violations],
        }


def _check_decision(lt: Lifetimes, d: Decision, hardware: HardwareModel) -> tuple[list[Violation], bool]:
    """Rule violations of one decision, and whether it can be simulated at all."""
    problems: list[Violation] = []
    n, nf = lt.num_ops, lt.num_fwd_ops

    def bad(kind: ViolationKind, message: str) -> None:
        problems.append(Violation(kind, d.name, message))

    if not lt.graph.has_node(("tensor", d.name)):
        return [
            Violation("unknown_tensor", d.name, f"decision for '{d.name}': no such tensor in the profile")
        ], False
    if not lt.is_candidate(d.name):
        message = (
            f"decision for '{d.name}': not an offload candidate (param/input, not offloadable, "
            f"or never idle between forward and backward)"
        )
        return [Violation("not_candidate", d.name, message)], False
    if d.tier not in hardware.tiers:
        message = f"decision for '{d.name}': tier '{d.tier}' is not in the hardware model"
        return [Violation("unknown_tier", d.name, message)], False
    for label, idx in (
        ("offload_after", d.offload_after_idx),
        ("wait_before", d.wait_before_idx),
        ("prefetch_before", d.prefetch_before_idx),
        ("fetch_before", d.fetch_before_idx),
    ):
        if not 0 <= idx < n:
            message = f"decision for '{d.name}': {label}_idx {idx} is outside the profile's ops 0..{n - 1}"
            return [Violation("index_range", d.name, message)], False
        name = getattr(d, f"{label}_name")
        if name != lt.op_names[idx]:
            bad(
                "name_mismatch",
                f"decision for '{d.name}': {label} names op '{name}' but op {idx} is "
                f"'{lt.op_names[idx]}' (plan made for another graph?)",
            )
    c = lt.candidate_of(d.name)
    if hardware.tiers[d.tier].capacity_bytes == 0:
        bad("tier_unavailable", f"'{d.name}' goes to tier '{d.tier}', which is unavailable (capacity 0)")
    if d.nbytes != c.nbytes:
        bad("nbytes", f"'{d.name}' has nbytes {d.nbytes} in the plan but {c.nbytes} in the profile")
    if d.offload_after_idx < c.producer_idx:
        bad(
            "order",
            f"'{d.name}' write issued after op {d.offload_after_idx}, before its producer op {c.producer_idx}",
        )
    if d.offload_after_idx >= d.wait_before_idx:
        bad(
            "order",
            f"'{d.name}' write waited before op {d.wait_before_idx}, not after it is issued "
            f"(after op {d.offload_after_idx})",
        )
    if d.wait_before_idx <= c.last_fwd_use_idx:
        bad(
            "used_while_away",
            f"'{d.name}' used while away: waited (freed) before op {d.wait_before_idx} but "
            f"used in forward by op {c.last_fwd_use_idx}",
        )
    if d.wait_before_idx > nf:
        bad(
            "phase",
            f"'{d.name}' write waited before op {d.wait_before_idx}, after the end of forward ({nf})",
        )
    if d.prefetch_before_idx < nf:
        bad("phase", f"'{d.name}' read issued before op {d.prefetch_before_idx}, a forward op")
    if d.fetch_before_idx > c.first_bwd_use_idx:
        bad(
            "used_while_away",
            f"'{d.name}' used while away: fetched before op {d.fetch_before_idx} but first "
            f"used in backward by op {c.first_bwd_use_idx}",
        )
    if d.fetch_before_idx < d.prefetch_before_idx:
        bad(
            "order",
            f"'{d.name}' fetched before op {d.fetch_before_idx}, before its read is issued "
            f"(op {d.prefetch_before_idx})",
        )
    return problems, True


def _check_ranks(decisions: list[Decision]) -> list[Violation]:
    """Ranks must agree with issue positions: a transfer issued later may not have a smaller rank."""
    out = []
    for direction, pos, rank in (
        ("write", "offload_after_idx", "write_rank"),
        ("read", "prefetch_before_idx", "read_rank"),
    ):
        ranked = sorted(
            (getattr(d, rank), getattr(d, pos), d.name) for d in decisions if getattr(d, rank) >= 0
        )
        for (r0, p0, n0), (r1, p1, n1) in zip(ranked, ranked[1:]):
            if r0 == r1 or p1 < p0:
                out.append(
                    Violation(
                        "queue_order",
                        n1,
                        f"'{n1}' has {rank} {r1} but its {direction} is issued at op {p1}, "
                        f"while '{n0}' ({rank} {r0}) is issued at op {p0}: ranks must follow issue order",
                    )
                )
    return out


def simulate_decisions(
    lifetimes: Lifetimes,
    decisions: list[Decision] | tuple[Decision, ...],
    hardware: HardwareModel,
    *,
    budget_bytes: int | None = None,
) -> SimResult:
    """Simulate ``decisions`` on the step described by ``lifetimes``.

    Decisions that cannot be placed at all (unknown tensor or tier, index out of range) are reported
    as violations and left out; every other rule break is reported and simulated as written.
    """
    lt = lifetimes
    n = lt.num_ops
    violations: list[Violation] = []
    seen: set[str] = set()
    valid: list[Decision] = []
    for d in decisions:
        if d.name in seen:
            violations.append(Violation("duplicate", d.name, f"'{d.name}' has more than one decision"))
            continue
        seen.add(d.name)
        problems, usable = _check_decision(lt, d, hardware)
        violations.extend(problems)
        if usable:
            valid.append(d)
    violations.extend(_check_ranks(valid))

    dur_s = lt.duration_us / 1e6
    rp = replay(valid, hardware, dur_s)
    for k, d in enumerate(valid):
        if rp.r_start[k] < rp.w_end[k] - STALL_TOLERANCE_S:
            violations.append(
                Violation(
                    "read_before_write",
                    d.name,
                    f"'{d.name}' read starts at {rp.r_start[k]:.6f} s, before its write completes "
                    f"at {rp.w_end[k]:.6f} s",
                )
            )

    memory = lt.memory_with(valid)
    peak_idx = int(np.argmax(memory)) if n else 0
    peak = int(memory[peak_idx]) if n else 0
    if budget_bytes is not None and peak > budget_bytes:
        violations.append(
            Violation(
                "budget",
                "",
                f"peak {peak} bytes at op {peak_idx} ('{lt.op_name(peak_idx)}') exceeds the budget "
                f"of {budget_bytes} bytes",
            )
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
                Violation(
                    "capacity",
                    "",
                    f"tier '{tier_name}' holds {tier_peak[tier_name]} bytes, over its capacity of {cap} bytes",
                )
            )

    rows = []
    for k, d in enumerate(valid):
        rows.append(
            (
                d.name,
                d.tier,
                "write",
                int(rp.w_issue_idx[k]),
                rp.w_issue[k],
                rp.w_start[k],
                rp.w_end[k],
                d.nbytes,
            )
        )
        rows.append(
            (
                d.name,
                d.tier,
                "read",
                int(rp.r_issue_idx[k]),
                rp.r_issue[k],
                rp.r_start[k],
                rp.r_end[k],
                d.nbytes,
            )
        )
    io = pd.DataFrame(rows, columns=list(IO_COLUMNS)).sort_values(["issue_s", "direction"], kind="stable")
    io = io.reset_index(drop=True)

    compute_s = float(dur_s.sum())
    step_s = rp.step
    written = sum(d.nbytes for d in valid)
    ssd_written = sum(d.nbytes for d in valid if d.tier == "ssd")
    tb_per_day = ssd_written / step_s * _SECONDS_PER_DAY / 1e12 if step_s > 0 else 0.0
    return SimResult(
        step_s=step_s,
        stall_s=float(rp.stall.sum()),
        compute_s=compute_s,
        interference_s=float(rp.interference.sum()),
        peak_bytes=peak,
        peak_idx=peak_idx,
        memory_bytes=memory,
        stall_s_per_op=rp.stall,
        op_start_s=rp.op_start,
        op_end_s=rp.op_end,
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
