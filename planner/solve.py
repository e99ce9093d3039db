"""One entry point for every solver: a registry of plain functions and the ``solve`` call around them.

A solver is a function ``Problem -> Plan`` registered by name (baselines "none" and "all" are solvers
too, so comparisons are one loop). ``solve`` resolves the budget, rejects budgets below the smallest
achievable peak (an error naming that peak), runs the solver, and for the "auto" budget searches the
smallest stall-free peak by bisection over budgets when the solver cannot do it itself. Every plan's
predicted figures come from the one simulator, through :func:`make_plan`.

Recompute: ``Problem.recompute`` says what a solver may do with a saved tensor: ``"off"``
keep or offload; ``"only"`` keep or recompute (no I/O); ``"joint"`` keep, offload to any tier, or
recompute, in one budget. Solvers declare the modes they plan (``register_solver(recompute_modes=...)``);
``greedy`` is TERAIO's offload-only baseline and declares ``"off"`` alone. ``solve`` plans ``"off"``
unless asked (a library call opts in); the tools (the backend's ``recompute`` option, ``teraio plan``
and ``teraio sweep``) default to :func:`default_recompute`: the most a solver plans, ``"joint"`` where it
can, else ``"off"``.
(A profile without the recompute columns has nothing recomputable, so there every mode plans as
``"off"``.)
"""

from __future__ import annotations

import dataclasses
import importlib
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from teraio.planner.bounds import StepBound, step_lower_bound
from teraio.planner.budget import BudgetError, format_size, infeasible, resolve_budget
from teraio.planner.hardware import HardwareModel
from teraio.planner.lifetimes import Lifetimes, analyse
from teraio.planner.plan import Decision, Plan, PlanError, SolverStats, with_ranks
from teraio.planner.profile import Profile
from teraio.planner.simulate import STALL_TOLERANCE_S, SimResult, Violation, simulate_decisions

#: ``progress(fraction_done, message)``; fraction in [0, 1].
ProgressFn = Callable[[float, str], None]

#: What a solver may do with a saved tensor besides keeping it (module docstring).
RecomputeMode = Literal["off", "only", "joint"]
RECOMPUTE_MODES: tuple[str, ...] = ("off", "only", "joint")
#: The mode ``solve`` plans when none is asked for (the tools' default is :func:`default_recompute`).
DEFAULT_RECOMPUTE: RecomputeMode = "off"

#: Bisection for "auto" stops when the bracket is narrower than this share of the unplanned peak.
AUTO_RESOLUTION = 0.002
#: The least wall time a round of that bisection gets, however little of the time limit is left.
MIN_ROUND_TIME_S = 0.5
#: A lower bound may exceed a plan's simulated step by this share only (float sums in another order);
#: beyond it, ``make_plan`` raises SolverBugError instead of clamping the bound to the step.
BOUND_REL_TOLERANCE = 1e-9


class UnknownSolverError(PlanError):
    """A solver name that is not registered (a user error: the CLI prints it as one line)."""


class SolverBugError(RuntimeError):
    """A solver returned a plan that breaks the execution model's rules, or a check of a solver's own
    claims failed: a bug, not bad input. ``violations`` holds the typed records (``.kind``) behind it."""

    def __init__(self, message: str, violations: Sequence[Violation] = ()) -> None:
        super().__init__(message)
        self.violations: tuple[Violation, ...] = tuple(violations)


@dataclass
class Problem:
    """Everything a solver needs. ``budget_bytes is None`` means "auto" (smallest stall-free peak)."""

    profile: Profile
    lifetimes: Lifetimes
    hardware: HardwareModel
    budget_bytes: int | None
    budget_spec: str
    time_limit_s: float = 60.0
    workers: int = 2
    progress: ProgressFn | None = None
    solver: str = ""
    #: CP-SAT's deterministic time limit (its own work units, reproducible on a loaded machine): when
    #: set, exact solvers stop on it rather than on the wall clock (tests use it; the wall-clock
    #: ``time_limit_s`` still caps them).
    deterministic_time_s: float | None = None
    #: Keep/offload ("off"), keep/recompute ("only") or all three ("joint"); see the module docstring.
    recompute: RecomputeMode = DEFAULT_RECOMPUTE
    #: Bytes of the budget left to the offloads' tokens: ``budget_bytes`` is what the solvers plan the
    #: step's memory within, without tokens, and a plan's own budget is the two together (Note: [An
    #: offloaded tensor leaves a token] in planner.lifetimes).
    token_reserve_bytes: int = 0
    _bound: StepBound | None = dataclasses.field(default=None, repr=False)

    @property
    def plans_recompute(self) -> bool:
        """Whether this problem may recompute anything (a mode other than "off" and something recomputable)."""
        return self.recompute != "off" and bool(self.lifetimes.recomputable)

    @property
    def plans_offload(self) -> bool:
        return self.recompute != "only"

    def residual(self, recomputed: Iterable[str]) -> Problem:
        """The offload-only problem left once ``recomputed`` are rebuilt (``Lifetimes.with_recompute``): its
        plans, joined with its ``lifetimes.recompute_decisions``, are plans of this problem."""
        return dataclasses.replace(
            self, lifetimes=self.lifetimes.with_recompute(recomputed), recompute="off", _bound=None
        )

    @property
    def default_tier(self) -> str:
        """The tier single-tier solvers use: "ssd" when available, else the first available tier."""
        tiers = self.hardware.available_tiers()
        if not tiers:
            raise BudgetError("the hardware model has no available tier (every capacity_bytes is 0)")
        return "ssd" if "ssd" in tiers else tiers[0]

    def report(self, fraction: float, message: str = "") -> None:
        if self.progress is not None:
            self.progress(min(max(fraction, 0.0), 1.0), message)

    @property
    def plan_budget_bytes(self) -> int | None:
        """The budget a plan of this problem keeps, tokens included (None: "auto")."""
        return None if self.budget_bytes is None else self.budget_bytes + self.token_reserve_bytes

    def simulate(self, decisions: list[Decision] | tuple[Decision, ...]) -> SimResult:
        """Simulate ``decisions`` as the solvers see memory: without the offloads' tokens, against
        ``budget_bytes`` (budget check included when one is set)."""
        return simulate_decisions(
            self.lifetimes, decisions, self.hardware, budget_bytes=self.budget_bytes, tokens=False
        )

    def with_budget(self, budget_bytes: int | None) -> Problem:
        return dataclasses.replace(self, budget_bytes=budget_bytes, _bound=None)

    def lower_bound(self) -> StepBound:
        """The bandwidth-window lower bound on any plan's step (``planner.bounds``), computed once."""
        if self._bound is None:
            self._bound = step_lower_bound(
                self.lifetimes, self.hardware, self.budget_bytes, recompute=self.recompute
            )
        return self._bound

    def floor_bytes(self) -> int:
        """The smallest peak any plan of this problem could reach (:func:`floor_bytes`)."""
        return floor_bytes(self.lifetimes, self.hardware, self.recompute)


def floor_bytes(lt: Lifetimes, hardware: HardwareModel, recompute: RecomputeMode) -> int:
    """A peak below which no plan exists: every tensor a mode can take away, away over its whole idle
    interval. Offloading reaches the whole of ``lt.min_feasible_peak_bytes`` (when a tier is available);
    recompute frees the same intervals, but only of recomputable tensors, and its extended inputs and
    intermediates only add memory, so for "only" this is a floor, not always reachable."""
    if recompute != "only":
        return lt.min_feasible_peak_bytes if hardware.available_tiers() else _floor_of(lt, recompute)
    return _floor_of(lt, recompute)


def _floor_of(lt: Lifetimes, recompute: RecomputeMode) -> int:
    if recompute == "off" or not lt.num_ops:
        return lt.baseline_peak_bytes
    away = np.zeros(lt.num_ops + 1, dtype=np.int64)
    for c in lt.recomputable:
        away[c.inactive_start_idx] += c.nbytes
        away[c.inactive_end_idx + 1] -= c.nbytes
    return int((lt.baseline_memory_bytes - np.cumsum(away)[: lt.num_ops]).max())


SolverFn = Callable[[Problem], Plan]


@dataclass(frozen=True)
class SolverInfo:
    name: str
    fn: SolverFn
    #: Baselines ignore the budget: their plans are returned even when over it (status INFEASIBLE).
    baseline: bool = False
    #: The solver handles ``budget_bytes is None`` itself; otherwise ``solve`` bisects over budgets.
    supports_auto: bool = False
    #: The recompute modes it plans (``Problem.recompute``).
    recompute_modes: tuple[str, ...] = ("off",)


_REGISTRY: dict[str, SolverInfo] = {}


def register_solver(
    name: str,
    *,
    baseline: bool = False,
    supports_auto: bool = False,
    recompute_modes: tuple[str, ...] = ("off",),
) -> Callable[[SolverFn], SolverFn]:
    """Decorator registering ``fn`` as solver ``name``, planning the recompute modes ``recompute_modes``."""

    def deco(fn: SolverFn) -> SolverFn:
        _REGISTRY[name] = SolverInfo(
            name=name, fn=fn, baseline=baseline, supports_auto=supports_auto, recompute_modes=recompute_modes
        )
        return fn

    return deco


def _load_builtin_solvers() -> None:
    # Imported lazily: the solver modules import this one to register themselves.
    importlib.import_module("teraio.planner.solvers")


def solver_info(name: str) -> SolverInfo:
    _load_builtin_solvers()
    if name not in _REGISTRY:
        raise UnknownSolverError(f"unknown solver '{name}'; choose one of: {', '.join(solver_names())}")
    return _REGISTRY[name]


def get_solver(name: str) -> SolverFn:
    """The registered solver function ``name``; UnknownSolverError naming the choices otherwise."""
    return solver_info(name).fn


def default_recompute(solver: str) -> RecomputeMode:
    """The tools' recompute mode for a solver when the user names none: "joint" where it plans it, else
    "off" (TERAIO's greedy baseline and "all" plan offload only)."""
    return "joint" if "joint" in solver_info(solver).recompute_modes else "off"


def solver_names() -> list[str]:
    _load_builtin_solvers()
    return sorted(_REGISTRY)


def make_plan(problem: Problem, decisions: list[Decision] | tuple[Decision, ...], stats: SolverStats) -> Plan:
    """Simulate ``decisions`` and wrap them in a Plan with the predicted figures.

    A plan over its budget or a tier's capacity gets status INFEASIBLE. For "auto", the plan's budget is its predicted peak.

    Raises:
        SolverBugError: the decisions break a rule other than the budget (the solver is wrong), or the
            lower bound exceeds the simulated step of this plan within its budget (the bound is wrong).
    """
    # Every saved plan carries explicit queue orders (ranks) for the runtime to follow.
    decisions = with_ranks(decisions)
    # The plan's figures count the tokens, against the budget they were reserved from (Note: [An
    # offloaded tensor leaves a token] in planner.lifetimes).
    sim = simulate_decisions(
        problem.lifetimes, decisions, problem.hardware, budget_bytes=problem.plan_budget_bytes
    )
    # Over the budget or a tier's capacity: the plan is valid but infeasible. Anything else is a bug.
    broken = sim.broken_rules()
    if broken:
        raise SolverBugError(f"solver '{stats.solver}' produced an invalid plan: {broken[0]}", broken)
    if sim.violations and stats.status != "INFEASIBLE":
        stats = dataclasses.replace(stats, status="INFEASIBLE")
    bound_s = problem.lower_bound().step_s
    if stats.lower_bound_s is not None:
        bound_s = max(bound_s, stats.lower_bound_s)
    if problem.budget_bytes is None or sim.violations:
        bound_s = None  # "auto" minimises the peak, and an infeasible plan has no gap to speak of
    elif bound_s > sim.step_s * (1 + BOUND_REL_TOLERANCE):
        message = (
            f"solver '{stats.solver}': the lower bound {bound_s!r} s is above the simulated step "
            f"{sim.step_s!r} s of a plan within the budget (the bound or the simulator is wrong)"
        )
        raise SolverBugError(message, [Violation("bound_above_step", "", message)])
    else:
        # Within the tolerance: the bound sums op times in another order than the simulator (last bits).
        bound_s = min(bound_s, sim.step_s)
    stats = dataclasses.replace(
        stats,
        lower_bound_s=bound_s,
        gap=None if bound_s is None else max(0.0, (sim.step_s - bound_s) / sim.step_s if sim.step_s else 0.0),
    )
    lt = problem.lifetimes
    return Plan(
        fingerprint=problem.profile.fingerprint,
        budget_bytes=int(problem.plan_budget_bytes if problem.budget_bytes is not None else sim.peak_bytes),
        budget_spec=problem.budget_spec,
        hardware=problem.hardware,
        stats=stats,
        decisions=tuple(decisions),
        baseline_peak_bytes=lt.baseline_peak_bytes,
        predicted_peak_bytes=sim.peak_bytes,
        predicted_step_s=sim.step_s,
        predicted_stall_s=sim.stall_s,
        compute_s=sim.compute_s,
        config={
            "time_limit_s": problem.time_limit_s,
            "workers": problem.workers,
            "min_feasible_peak_bytes": lt.min_feasible_peak_bytes,
            "recompute": problem.recompute,
        },
    )


def _stall_free(plan: Plan) -> bool:
    return plan.predicted_stall_s <= STALL_TOLERANCE_S and plan.predicted_peak_bytes <= plan.budget_bytes


def _solve_auto_by_bisection(problem: Problem, fn: SolverFn) -> Plan:
    """The smallest stall-free peak, found by bisecting the budget between the floor and the baseline.

    Assumes a stall-free plan at budget b usually implies one at any larger budget (true for an exact
    solver; a heuristic may break it, in which case we still return the best stall-free plan seen).
    """
    lt = problem.lifetimes
    lo, hi = problem.floor_bytes(), lt.baseline_peak_bytes
    step = max(1, int(AUTO_RESOLUTION * lt.baseline_peak_bytes))
    rounds = 0
    total = max(1, (max(hi - lo, 1) // step).bit_length())
    # The time limits are for the whole search, not per round: a user's time_limit bounds the call.
    deadline = time.perf_counter() + problem.time_limit_s

    def limited(budget_bytes: int, rounds_left: int) -> Problem:
        share = 1 / max(1, rounds_left)
        det = problem.deterministic_time_s
        return dataclasses.replace(
            problem.with_budget(budget_bytes),
            time_limit_s=max(MIN_ROUND_TIME_S, (deadline - time.perf_counter()) * share),
            deterministic_time_s=None if det is None else det / (total + 1),
        )

    best = fn(limited(hi, total + 1))
    while hi - lo > step:
        mid = (lo + hi) // 2
        problem.report(rounds / total, f"auto: trying budget {format_size(mid)}")
        try:
            plan = fn(limited(mid, total - rounds))
        except BudgetError:
            plan = None
        if plan is not None and _stall_free(plan):
            best, hi = plan, mid
        else:
            lo = mid
        rounds += 1
    problem.report(1.0, "auto: done")
    # Report the smallest stall-free peak itself as the budget that was met.
    return dataclasses.replace(best, budget_bytes=best.predicted_peak_bytes, budget_spec=problem.budget_spec)


def solve(
    profile: Profile,
    budget: str | int | float = "auto",
    solver: str = "ilp",
    hardware: HardwareModel | None = None,
    time_limit_s: float = 60.0,
    workers: int = 2,
    progress: ProgressFn | None = None,
    *,
    lifetimes: Lifetimes | None = None,
    deterministic_time_s: float | None = None,
    recompute: RecomputeMode = DEFAULT_RECOMPUTE,
) -> Plan:
    """Plan ``profile`` under ``budget`` with solver ``solver``.

    Args:
        budget: bytes, a size ("512MiB"), a fraction of the unplanned peak ("40%", 0.4), or "auto".
        hardware: defaults to ``HardwareModel()`` (this project's measured machine).
        lifetimes: ``analyse(profile)`` when the caller already has it.
        deterministic_time_s: stop CP-SAT on its deterministic clock (reproducible results).
        recompute: "off", "only" or "joint" (module docstring; default :data:`DEFAULT_RECOMPUTE`).

    Raises:
        BudgetError: the budget does not parse, is below the smallest achievable peak, or the (non
            baseline) solver found no plan within it; the message names the smallest achievable peak.
        UnknownSolverError: no solver of that name, or one that does not plan ``recompute``.
    """
    info = solver_info(solver)
    if recompute not in RECOMPUTE_MODES:
        raise UnknownSolverError(f"recompute mode {recompute!r} is none of {', '.join(RECOMPUTE_MODES)}")
    if recompute not in info.recompute_modes:
        raise UnknownSolverError(
            f"solver '{solver}' plans recompute={'/'.join(info.recompute_modes)} only"
            + (" (TERAIO's offload-only baseline)" if solver == "greedy" else "")
            + f", not recompute={recompute}; choose another solver or recompute mode"
        )
    lt = lifetimes if lifetimes is not None else analyse(profile)
    hw = hardware if hardware is not None else HardwareModel()
    budget_bytes = resolve_budget(budget, lt.baseline_peak_bytes)
    # Note: [An offloaded tensor leaves a token] in planner.lifetimes: no tokens without offloads, and
    # none needed where the unplanned step fits.
    needs_moves = budget_bytes is None or budget_bytes < lt.baseline_peak_bytes
    reserve = lt.token_reserve_bytes if recompute != "only" and hw.available_tiers() and needs_moves else 0
    floor = min(lt.baseline_peak_bytes, floor_bytes(lt, hw, recompute) + reserve)
    if budget_bytes is not None and budget_bytes < floor and not info.baseline:
        raise infeasible(budget_bytes, floor, what=f"budget {budget!r} =")
    problem = Problem(
        profile=profile,
        lifetimes=lt,
        hardware=hw,
        budget_bytes=None if budget_bytes is None else max(0, budget_bytes - reserve),
        token_reserve_bytes=reserve,
        budget_spec=str(budget),
        time_limit_s=float(time_limit_s),
        workers=int(workers),
        progress=progress,
        solver=solver,
        deterministic_time_s=deterministic_time_s,
        recompute=recompute,
    )
    t0 = time.perf_counter()
    auto_itself = info.supports_auto and not problem.plans_recompute
    if budget_bytes is None and not auto_itself and not info.baseline:
        plan = _solve_auto_by_bisection(problem, info.fn)
    else:
        plan = info.fn(problem)
    wall_s = time.perf_counter() - t0
    plan = dataclasses.replace(plan, stats=dataclasses.replace(plan.stats, wall_s=wall_s))
    if not info.baseline and (
        plan.predicted_peak_bytes > plan.budget_bytes or plan.stats.status == "INFEASIBLE"
    ):
        raise BudgetError(
            f"solver '{solver}' found no plan within {format_size(plan.budget_bytes)} (its best peaks at "
            f"{format_size(plan.predicted_peak_bytes)}); the smallest achievable peak is "
            f"{format_size(floor)} ({floor} bytes): try another solver or a larger budget"
        )
    return plan
