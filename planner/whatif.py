"""What a plan means for the machine: fraction of ideal speed, bytes moved, and the SSD bandwidth needed.

``teraio estimate`` and ``benchmarks.bench_whatif`` plan an estimated Profile with several solvers and
ask the same questions of each plan. The answers come from the one simulator every plan is judged by:

- the *ideal* step: compute only, with unlimited memory (the ``none`` plan: nothing moves, no stall);
  a plan's *fraction of ideal* is the ideal step over the plan's predicted step;
- bytes moved per step: what the plan writes to and reads back from its tiers (activations);
- the activations' peak: the most bytes of saved activations alive at once, with and without the plan;
- the SSD bandwidth the step needs to hide its I/O: the smallest aggregate SSD bandwidth at which the
  same plan (same tensors, same issue points) simulates with a stall of at most
  :data:`HIDDEN_STALL_SHARE` of the ideal step. Memory does not depend on bandwidth (a tensor is away
  between fixed ops), so only the stall changes; it never grows with more bandwidth, so a bisection over
  the bandwidth finds it. Below the plan's own bandwidth it says how much slower drives would do, above
  it how much faster ones the plan would need to stop stalling. ``None`` when even unlimited bandwidth
  leaves stall (latency or CPU cost per transfer, not bandwidth, is what stalls).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from teraio.planner.budget import BudgetError
from teraio.planner.hardware import HardwareModel
from teraio.planner.lifetimes import Lifetimes, analyse
from teraio.planner.plan import Plan
from teraio.planner.profile import Profile
from teraio.planner.simulate import simulate_decisions
from teraio.planner.solve import default_recompute, solve

#: A step whose stall is at most this share of the ideal step counts as hiding its I/O.
HIDDEN_STALL_SHARE = 0.01
#: Bisection rounds over log(bandwidth): the answer is within a factor 2**(range/2**rounds) of exact.
BANDWIDTH_ROUNDS = 24


@dataclass(frozen=True)
class PlanOutcome:
    """One solver's plan of the step, and what it means (module docstring)."""

    solver: str
    recompute: str
    status: str
    plan: Plan | None
    #: Why there is no plan (the budget cannot be met by this solver), else "".
    error: str = ""
    ideal_step_s: float = 0.0
    needed_ssd_bw_bytes_per_s: float | None = None
    #: The most bytes of saved activations alive at once, without and with the plan (the memory of an op
    #: less its ``other_bytes``): what SSDTrain calls the activations' peak.
    unplanned_activation_peak_bytes: int = 0
    activation_peak_bytes: int = 0

    @property
    def fraction_of_ideal(self) -> float | None:
        if self.plan is None or self.plan.predicted_step_s <= 0:
            return None
        return self.ideal_step_s / self.plan.predicted_step_s

    def summary(self) -> dict[str, Any]:
        """JSON-ready figures (``teraio estimate --json``)."""
        if self.plan is None:
            return {
                "solver": self.solver,
                "recompute": self.recompute,
                "status": self.status,
                "error": self.error,
            }
        p = self.plan
        return {
            "solver": self.solver,
            "recompute": self.recompute,
            "status": p.stats.status,
            "solve_s": p.stats.wall_s,
            "budget_bytes": p.budget_bytes,
            "unplanned_peak_bytes": p.baseline_peak_bytes,
            "planned_peak_bytes": p.predicted_peak_bytes,
            "step_s": p.predicted_step_s,
            "stall_s": p.predicted_stall_s,
            "ideal_step_s": self.ideal_step_s,
            "fraction_of_ideal": self.fraction_of_ideal,
            "offloaded_tensors": len(p.offloads),
            "activation_written_bytes": p.moved_bytes,
            "activation_read_bytes": p.moved_bytes,
            "recomputed_tensors": len(p.recomputes),
            "recomputed_bytes": p.recomputed_bytes,
            "recompute_s": p.recompute_s,
            "needed_ssd_bw_bytes_per_s": self.needed_ssd_bw_bytes_per_s,
            "unplanned_activation_peak_bytes": self.unplanned_activation_peak_bytes,
            "activation_peak_bytes": self.activation_peak_bytes,
        }


def ideal_step_s(profile: Profile, lifetimes: Lifetimes | None = None) -> float:
    """The step with compute only and unlimited memory: nothing moves, nothing stalls."""
    lt = lifetimes if lifetimes is not None else analyse(profile)
    return simulate_decisions(lt, [], HardwareModel()).step_s


def activation_peak_bytes(profile: Profile, lifetimes: Lifetimes, plan: Plan | None = None) -> int:
    """The most bytes of saved activations (and what rebuilds hold) alive during any op, with ``plan``
    applied (unplanned without one): each op's memory less the ``other_bytes`` no plan moves."""
    memory = lifetimes.memory_with(plan.decisions if plan is not None else ())
    if "other_bytes" in profile.ops.columns:
        memory = memory - profile.ops["other_bytes"].to_numpy(dtype="int64")
    return int(memory.max()) if len(memory) else 0


def _with_ssd_bandwidth(hardware: HardwareModel, aggregate_bytes_per_s: float) -> HardwareModel:
    tier = hardware.tier("ssd")
    per_device = aggregate_bytes_per_s / tier.count
    return hardware.with_overrides("ssd", read_bw_bytes_per_s=per_device, write_bw_bytes_per_s=per_device)


def needed_ssd_bandwidth(plan: Plan, lifetimes: Lifetimes, ideal_s: float) -> float | None:
    """The smallest aggregate SSD bandwidth (bytes/s, read and write alike) at which ``plan`` stalls at
    most ``HIDDEN_STALL_SHARE`` of ``ideal_s`` (module docstring). 0 for a plan that moves nothing to an
    SSD; None when no bandwidth is enough."""
    decisions = list(plan.decisions)
    if not any(d.action == "offload" and d.tier == "ssd" for d in decisions):
        return 0.0
    allowed_s = HIDDEN_STALL_SHARE * ideal_s

    def hides(bw: float) -> bool:
        sim = simulate_decisions(lifetimes, decisions, _with_ssd_bandwidth(plan.hardware, bw))
        return sim.stall_s <= allowed_s

    moved = max(1, plan.moved_bytes)
    hi = max(1.0, moved / max(ideal_s, 1e-9)) * 1e6  # a million times the average rate the step needs
    if not hides(hi):
        return None
    lo = max(1.0, moved / max(ideal_s, 1e-9)) / 1e3
    if hides(lo):
        return lo
    for _ in range(BANDWIDTH_ROUNDS):
        mid = math.sqrt(lo * hi)
        if hides(mid):
            hi = mid
        else:
            lo = mid
    return hi


def plan_outcomes(
    profile: Profile,
    hardware: HardwareModel,
    budget: str | int | float,
    solvers: Sequence[str] = ("greedy", "ilp"),
    *,
    time_limit_s: float = 60.0,
    workers: int = 2,
    deterministic_time_s: float | None = None,
    bandwidth: bool = True,
) -> list[PlanOutcome]:
    """Plan ``profile`` with each solver (in its tools' default recompute mode) and measure the plans.

    A budget a solver cannot meet is an outcome with ``plan=None`` and the planner's one-line reason, not
    an error: the other solvers' answers still stand.
    """
    lt = analyse(profile)
    ideal = ideal_step_s(profile, lt)
    unplanned_act = activation_peak_bytes(profile, lt)
    out: list[PlanOutcome] = []
    for name in solvers:
        mode = default_recompute(name)
        try:
            plan = solve(
                profile,
                budget,
                name,
                hardware,
                time_limit_s=time_limit_s,
                workers=workers,
                lifetimes=lt,
                deterministic_time_s=deterministic_time_s,
                recompute=mode,
            )
        except BudgetError as e:
            out.append(
                PlanOutcome(
                    name,
                    mode,
                    "NO_PLAN",
                    None,
                    error=str(e),
                    ideal_step_s=ideal,
                    unplanned_activation_peak_bytes=unplanned_act,
                )
            )
            continue
        outcome = PlanOutcome(
            name,
            mode,
            plan.stats.status,
            plan,
            ideal_step_s=ideal,
            unplanned_activation_peak_bytes=unplanned_act,
            activation_peak_bytes=activation_peak_bytes(profile, lt, plan),
        )
        if bandwidth:
            outcome = replace(outcome, needed_ssd_bw_bytes_per_s=needed_ssd_bandwidth(plan, lt, ideal))
        out.append(outcome)
    return out
