"""The simulator: the one judge of every plan, written without reference to any solver.

It replays a Plan against its Profile and a HardwareModel under the project's execution model and
predicts step time, stall per op, the memory timeline and peak, the I/O timeline and bytes moved, and
lists every way the plan breaks the rules (a tensor used while away, a read before its write completes,
a budget or tier capacity exceeded).

The execution model (op boundaries, FIFO channels, queue orders, CPU interference) is
:mod:`planner.execution`'s, whose :func:`~planner.execution.replay` this module calls; on top of it:

- Memory during op ``i`` = the lifetime analysis' baseline minus every moved tensor absent at ``i``
  (``wait_before_idx <= i < prefetch_before_idx``), plus the lifetimes rebuilds extend and the
  intermediates of the rebuilds before ``i``, plus the offloads' tokens (``Lifetimes.memory_with``; Note:
  [An offloaded tensor leaves a token] in planner.lifetimes). Bytes held by a tier count
  against its capacity over ops ``offload_after_idx + 1 .. fetch_before_idx``, never against the budget.
- Step time = compute + rebuilds + stall + interference.
- Recompute decisions are checked on their own terms: the tensor can be recomputed, is dropped after its
  last forward use and rebuilt exactly at its effective need (``planner.execution.effective_needs``);
  and, independently of that rule, every activation its rebuild reads is resident at the rebuild (not
  away, or rebuilt earlier at the same boundary).
- Every rule break is a :class:`Violation` record (kind, tensor, message), never a bare string.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pandas as pd

from teraio.planner.execution import EffectiveNeeds, rebuild_time, replay
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
    "not_recomputable",  # a recompute decision for a tensor that cannot be recomputed
    "recompute_fields",  # a recompute decision with a tier, a write position or queue ranks
    "recompute_cost",  # recompute_us differs from the profile's
    "fetch_not_at_need",  # rebuilt elsewhere than its effective need, or fetched after a rebuild needs it
    "input_not_resident",  # a rebuild reads a tensor that is away (or not yet rebuilt) at that moment
    "recompute_cycle",  # rebuilds that need each other
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
    #: Compute of the rebuilds per step (part of ``step_s``), and the bytes rebuilt.
    recompute_s: float = 0.0
    recomputed_bytes: int = 0
    #: Rebuild compute before each op (seconds).
    rebuild_s_per_op: np.ndarray | None = None

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
            "recompute_s": self.recompute_s,
            "recomputed_bytes": self.recomputed_bytes,
            "peak_bytes": self.peak_bytes,
            "peak_idx": self.peak_idx,
            "budget_bytes": self.budget_bytes,
            "written_bytes": self.written_bytes,
            "read_bytes": self.read_bytes,
            "ssd_tb_written_per_day": self.ssd_tb_written_per_day,
            "tier_peak_bytes": dict(self.tier_peak_bytes),
            "violations": [v.to_dict() for v in self.violations],
        }


def _check_op_refs(
    lt: Lifetimes, d: Decision, labels: tuple[str, ...], problems: list[Violation]
) -> Violation | None:
    """Check the ops ``d`` names at ``<label>_idx``/``<label>_name``: an index outside the profile is
    returned (nothing else about the decision can be checked), a name that is not the op's is added to
    ``problems``."""
    n = lt.num_ops
    for label in labels:
        idx = getattr(d, f"{label}_idx")
        if not 0 <= idx < n:
            message = f"decision for '{d.name}': {label}_idx {idx} is outside the profile's ops 0..{n - 1}"
            return Violation("index_range", d.name, message)
        name = getattr(d, f"{label}_name")
        if name != lt.op_names[idx]:
            message = (
                f"decision for '{d.name}': {label} names op '{name}' but op {idx} is "
                f"'{lt.op_names[idx]}' (plan made for another graph?)"
            )
            problems.append(Violation("name_mismatch", d.name, message))
    return None


def _check_decision(
    lt: Lifetimes, d: Decision, hardware: HardwareModel, needs: EffectiveNeeds | None = None
) -> tuple[list[Violation], bool]:
    """Rule violations of one offload decision, and whether it can be simulated at all. ``needs``: the
    effective needs of the plan's recomputed tensors (an input of a rebuild is needed earlier)."""
    problems: list[Violation] = []
    nf = lt.num_fwd_ops

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
    out_of_range = _check_op_refs(
        lt, d, ("offload_after", "wait_before", "prefetch_before", "fetch_before"), problems
    )
    if out_of_range is not None:
        return [out_of_range], False
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
    elif needs is not None and d.fetch_before_idx > needs.need(d.name, c.first_bwd_use_idx):
        bad(
            "fetch_not_at_need",
            f"'{d.name}' fetched before op {d.fetch_before_idx} but a rebuild reads it before op "
            f"{needs.need(d.name, c.first_bwd_use_idx)}",
        )
    if d.fetch_before_idx < d.prefetch_before_idx:
        bad(
            "order",
            f"'{d.name}' fetched before op {d.fetch_before_idx}, before its read is issued "
            f"(op {d.prefetch_before_idx})",
        )
    return problems, True


def _check_recompute(lt: Lifetimes, d: Decision) -> tuple[list[Violation], bool]:
    """Rule violations of one recompute decision that need no other decision, and whether it can be
    simulated at all."""
    problems: list[Violation] = []
    nf = lt.num_fwd_ops

    def bad(kind: ViolationKind, message: str) -> None:
        problems.append(Violation(kind, d.name, message))

    if not lt.graph.has_node(("tensor", d.name)):
        return [
            Violation("unknown_tensor", d.name, f"decision for '{d.name}': no such tensor in the profile")
        ], False
    if not lt.is_candidate(d.name) or not lt.candidate_of(d.name).recomputable:
        message = (
            f"recompute decision for '{d.name}': it cannot be recomputed (no rebuild recipe in the "
            f"profile, or not a saved activation idle between forward and backward)"
        )
        return [Violation("not_recomputable", d.name, message)], False
    out_of_range = _check_op_refs(lt, d, ("wait_before", "prefetch_before", "fetch_before"), problems)
    if out_of_range is not None:
        return [out_of_range], False
    c = lt.candidate_of(d.name)
    if (d.tier, d.offload_after_idx, d.offload_after_name, d.write_rank, d.read_rank) != ("", -1, "", -1, -1):
        bad(
            "recompute_fields",
            f"recompute decision for '{d.name}' has a tier, a write position or queue ranks "
            f"(tier {d.tier!r}, offload_after_idx {d.offload_after_idx}, ranks {d.write_rank}/{d.read_rank})",
        )
    if d.nbytes != c.nbytes:
        bad("nbytes", f"'{d.name}' has nbytes {d.nbytes} in the plan but {c.nbytes} in the profile")
    if not abs(d.recompute_us - c.recompute_us) <= 1e-9 * max(1.0, c.recompute_us):
        bad(
            "recompute_cost",
            f"'{d.name}' has recompute_us {d.recompute_us!r} in the plan but {c.recompute_us!r} in the profile",
        )
    if d.wait_before_idx <= c.last_fwd_use_idx:
        bad(
            "used_while_away",
            f"'{d.name}' used while away: dropped before op {d.wait_before_idx} but used in forward by "
            f"op {c.last_fwd_use_idx}",
        )
    if d.wait_before_idx > nf:
        bad("phase", f"'{d.name}' dropped before op {d.wait_before_idx}, after the end of forward ({nf})")
    if d.prefetch_before_idx != d.fetch_before_idx:
        bad(
            "order",
            f"'{d.name}' is recomputed with prefetch_before_idx {d.prefetch_before_idx} != "
            f"fetch_before_idx {d.fetch_before_idx}; a rebuild has one position",
        )
    if d.fetch_before_idx <= d.wait_before_idx:
        bad(
            "order",
            f"'{d.name}' rebuilt before op {d.fetch_before_idx}, not after it is dropped (before op "
            f"{d.wait_before_idx})",
        )
    return problems, True


@dataclass
class Checked:
    """What :func:`check_decisions` found: the violations that need no replay, the decisions that can be
    simulated (recompute decisions in rebuild order, then offloads), and the effective needs."""

    violations: list[Violation]
    usable: list[Decision]
    needs: EffectiveNeeds


def check_decisions(
    lt: Lifetimes, decisions: list[Decision] | tuple[Decision, ...], hardware: HardwareModel
) -> Checked:
    """Every rule of the execution model that a plan's positions alone decide (no replay, no budget)."""
    violations: list[Violation] = []
    seen: set[str] = set()
    offloads: list[Decision] = []
    rebuilt: dict[str, Decision] = {}
    for d in decisions:
        if d.name in seen:
            violations.append(Violation("duplicate", d.name, f"'{d.name}' has more than one decision"))
            continue
        seen.add(d.name)
        if d.action == "recompute":
            problems, usable = _check_recompute(lt, d)
            violations.extend(problems)
            if usable:
                rebuilt[d.name] = d
        else:
            offloads.append(d)
    needs = lt.effective_needs(rebuilt)
    for name in needs.cycle:
        violations.append(
            Violation("recompute_cycle", name, f"the rebuild of '{name}' needs itself through a chain")
        )
        del rebuilt[name]
    for name in needs.order:
        d, at = rebuilt[name], needs.first_need_idx[name]
        if d.fetch_before_idx != at:
            violations.append(
                Violation(
                    "fetch_not_at_need",
                    name,
                    f"'{name}' rebuilt before op {d.fetch_before_idx}, not at its effective first backward "
                    f"need (op {at})",
                )
            )
    usable = [rebuilt[name] for name in needs.order]
    for d in offloads:
        problems, ok = _check_decision(lt, d, hardware, needs)
        violations.extend(problems)
        if ok:
            usable.append(d)
    violations.extend(_check_ranks([d for d in usable if d.action == "offload"]))
    violations.extend(_inputs_resident(lt, usable, needs))
    return Checked(violations=violations, usable=usable, needs=needs)


def _inputs_resident(lt: Lifetimes, usable: list[Decision], needs: EffectiveNeeds) -> list[Violation]:
    """Independently of the effective-needs rule: at each rebuild, every activation it reads is there
    (produced, not away, and, if rebuilt at the same boundary, rebuilt before it)."""
    out = []
    by_name = {d.name: d for d in usable}
    rank = {name: k for k, name in enumerate(needs.order)}
    for name in needs.order:
        i = by_name[name].fetch_before_idx
        for x in needs.inputs.get(name, ()):
            u = lt.tensor_uses[x]
            d = by_name.get(x)
            if u.producer_idx >= i:
                why = "not produced yet"
            elif d is None:
                continue
            elif d.action == "recompute":
                if d.fetch_before_idx < i or (d.fetch_before_idx == i and rank[x] < rank[name]):
                    continue
                why = f"rebuilt only before op {d.fetch_before_idx}"
            elif d.fetch_before_idx <= i or i < d.wait_before_idx:
                continue
            else:
                why = f"away until its fetch before op {d.fetch_before_idx}"
            out.append(
                Violation(
                    "input_not_resident",
                    name,
                    f"the rebuild of '{name}' before op {i} reads '{x}', which is {why}",
                )
            )
    return out


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
    tokens: bool = True,
) -> SimResult:
    """Simulate ``decisions`` on the step described by ``lifetimes``.

    Decisions that cannot be placed at all (unknown tensor or tier, index out of range) are reported
    as violations and left out; every other rule break is reported and simulated as written.
    ``tokens=False``: the solvers' view of memory, without the offloads' tokens (Note: [An offloaded
    tensor leaves a token] in planner.lifetimes).
    """
    lt = lifetimes
    n = lt.num_ops
    checked = check_decisions(lt, decisions, hardware)
    violations = checked.violations
    valid = checked.usable
    moved = [d for d in valid if d.action == "offload"]

    dur_s = lt.duration_us / 1e6
    rebuild_s = rebuild_time(valid, n) / 1e6
    rp = replay(moved, hardware, dur_s, rebuild=rebuild_s if any(d.recomputed for d in valid) else None)
    for k, d in enumerate(moved):
        if rp.r_start[k] < rp.w_end[k] - STALL_TOLERANCE_S:
            violations.append(
                Violation(
                    "read_before_write",
                    d.name,
                    f"'{d.name}' read starts at {rp.r_start[k]:.6f} s, before its write completes "
                    f"at {rp.w_end[k]:.6f} s",
                )
            )

    memory = lt.memory_with(valid, tokens=tokens)
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
    for tier_name in sorted({d.tier for d in moved}):
        held = np.zeros(n + 1, dtype=np.int64)
        for d in moved:
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
    for k, d in enumerate(moved):
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
    written = sum(d.nbytes for d in moved)
    ssd_written = sum(d.nbytes for d in moved if d.tier == "ssd")
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
        recompute_s=float(rebuild_s.sum()),
        recomputed_bytes=int(sum(d.nbytes for d in valid if d.recomputed)),
        rebuild_s_per_op=rebuild_s,
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
