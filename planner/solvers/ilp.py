"""The exact solver: an OR-Tools CP-SAT model of the step, searched from the best constructive plan.

Which tensors move, to which tier, and when each write and read runs, so that memory stays within the
budget at every op and the predicted step (compute + stall + the CPU cost of I/O) is smallest, then the
fewest bytes move. Every plan is re-judged by the simulator; ``ilp`` returns the best plan it has seen,
so it is never worse than its starts (``pipeline`` and ``greedy``).

Search, within ``time_limit_s`` (15% kept in reserve):

1. Starts: the ``pipeline`` and ``greedy`` plans (greedy only for "auto"); the better one simulated is
   the incumbent.
2. Whole step: for steps of at most :data:`FULL_MODEL_MAX_CANDIDATES` candidates (and for "auto"), the
   model below hinted with the incumbent, then a second solve for the fewest bytes at that step time.
3. Large-neighbourhood search: layer windows (:mod:`planner.layers`, :data:`LNS_WIDTH` layers each, most
   simulated stall first) re-solved with every tensor outside the window held to the incumbent's choice.

Legend (times in integer microseconds, op and transfer times rounded up; sizes in bytes, exactly):

- ``E[k]``   end of op ``k``; ``E[k] - E[k-1] >= d[k]`` (the difference beyond ``d[k]`` is op k's stall).
- ``R[k]``   the boundary before op ``k`` is done waiting for writes and issues its reads; a separate
  variable only where waits happen (k <= num_fwd_ops). A forward op starts at its boundary,
  ``E[k] == R[k] + d[k]`` (see the note in ``_build``); the first backward op may wait for fetches.
- ``o[t,r]`` tensor ``t`` moves to tier ``r`` (at most one tier).
- ``W[t,r]``, ``R[t,r]``: optional write/read intervals of fixed length on their tier's channels
  (``NoOverlap`` per :func:`planner.execution.channel_key`).
- ``pe[t]``  when ``t`` stops occupying memory after forward; ``p[t]`` when it occupies memory again.

Memory is a *cumulative* resource over time, not a boolean per (tensor, op): op ``k`` owns the time
``[R[k], E[k])`` with the memory nothing can move (``other_bytes``, params, non-candidates); each
candidate occupies ``[start of its producer, pe[t])`` and ``[p[t], E[last use])``. Reading the plan back
(:meth:`_IlpModel.extract`), a tensor is absent at the ops whose window lies in ``[pe, p)``, the
simulator's ``[wait_before_idx, prefetch_before_idx)``; the model's memory at every op is at least the
simulator's, so the model's plans keep the budget (checked on every solve of the test suite, see below),
with O(tensors + ops) variables instead of the O(tensors x ops) booleans of a per-op formulation.
Cuts: a knapsack cut per over-budget op (bytes that could be away there >= the excess), and the
bandwidth-window cuts of :mod:`planner.bounds` (time between two ops >= bytes that must move / bandwidth),
which put bandwidth into the LP relaxation.

Objective: ``E[last]`` plus the CPU cost of every transfer in full (the simulator charges only the share
that overlaps running ops). With ``budget="auto"`` op times are fixed at their nominal values (no stall)
and the objective is the peak.

How the model's step relates to the simulated step of the plan read back from it (``sim``):

    sim  <=  model  <=  sim + rounding + cpu        (the upper half for OPTIMAL solutions)

- Floor (every solution): the model's times are the simulator's with each op and transfer rounded up,
  no CPU cost, and its memory is at least the simulator's; the plan read back issues, waits and fetches
  no later than the model's schedule, so its replay ends no later than ``E[last]``, and interference adds
  at most the CPU cost the model charges in full.
- Ceiling (OPTIMAL, for the whole step or within a layer window): the read-back plan, replayed in model
  units, is itself a solution of the (sub)model, so the optimum is at most its replayed end plus its CPU
  charge. Rounding each duration up by ``delta`` moves any end by at most the sum of the deltas (each
  time is a longest path through ops and transfers, each on it at most once, and FIFO orders are fixed
  by issue order, not by times), and the simulator's interference only delays. Hence
  ``rounding = sum over ops (d[k] - duration) + sum over moved tensors (write_us - write time) +
  (read_us - read time)`` and ``cpu`` = the model's CPU charge of the moved tensors. On exact units
  (whole-microsecond times, no CPU cost) both are zero and an optimal model step equals the simulated
  step. A FEASIBLE solution may hold slack CP-SAT has not removed yet: no ceiling.

With ``TERAIO_CHECK_OWN_PLANS=1`` in the environment (the test suite sets it for every test, subprocesses
included) every model solution is checked against these relations, and against the budget, the moment it
is found (before any fallback to a start can hide it): a failure raises ``SolverBugError`` whose
violations say which (``budget``, ``model_optimistic``, ``model_pessimistic``). Each solution's record
is in ``stats.extra["own_plans"]`` either way.

Transfer order: the simulator (and the runtime) run each channel FIFO in issue order; the plan's
``write_rank`` / ``read_rank`` carry the model's channel order (see the note in ``extract``).

Recompute (``Problem.recompute`` "only" or "joint", :func:`solve_ilp`). What is exact and what is searched:

- Exact, for a fixed recompute set: the set turns the step into a residual offload problem
  (``Lifetimes.with_recompute``: rebuild compute in the ops' durations, dropped tensors, extended inputs
  and intermediates in the memory, inputs of rebuilds needed earlier), and the model above plans it
  unchanged, with all its checks against the simulator.
- Searched: the recompute set. Starts: the pipeline's plans in the mode (offload only, recompute only,
  and its threshold grid, ``planner.solvers.pipeline``). Then large-neighbourhood moves over layers
  (:mod:`planner.layers`): per layer (and the ops outside layers), recompute all of its recomputable
  tensors, none of them, or the cheaper or the dearer half by rebuild time per I/O time; then, with
  time left, drop single tensors from the set, dearest first. Each candidate set is planned with the
  pipeline on its residual step and judged by the simulator; a move is kept when the plan is better.
  Finally the model above improves the offloads of the best set (the "polish").
- Never worse than the modes it contains: "joint" also runs the recompute-only search and the whole
  offload-only search as ``recompute="off"`` would (the same deterministic budget; of the wall clock,
  everything left when no recompute set beats the offload-only start, else a share), and returns the
  best plan of all. ``stats.extra["recompute"]`` says which won and what every source reached.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from teraio.planner.bounds import bandwidth_windows
from teraio.planner.budget import BudgetError, infeasible
from teraio.planner.execution import channel_key, replay
from teraio.planner.layers import find_layers
from teraio.planner.plan import Decision, Plan, SolverStats
from teraio.planner.simulate import STALL_TOLERANCE_S, SimResult, Violation
from teraio.planner.solve import Problem, SolverBugError, get_solver, make_plan, register_solver
from teraio.planner.solvers.pipeline import Evaluated, better, evaluate, rebuild_ratio, recompute_plans

#: Is one simulated plan better than another (within budget first, then step time, then bytes): the
#: pipeline's judgement, shared so every solver ranks plans alike.
_better = better

#: Memory is counted in units of the largest power of two dividing every size (exact, and keeps the
#: cumulative constraint's numbers small); never coarser than this.
MAX_UNIT_NBYTES = 4096
#: Share of the time limit kept for the second (fewest bytes) solve.
PHASE2_SHARE = 0.25
#: Share of the time limit kept in reserve for CP-SAT's overrun and the simulations after it.
RESERVE_SHARE = 0.15
#: Over-budget ops that get a knapsack cut (the ones with the largest excess; cuts are cheap but not free).
MAX_CUTS = 256
#: Set to "1" to check every model solution against the simulator (module docstring); tests set it.
CHECK_OWN_PLANS_ENV = "TERAIO_CHECK_OWN_PLANS"
#: Float slack of the checks: the simulator sums op times in seconds, the model whole microseconds.
CHECK_TOLERANCE_S = 1e-9

_STATUS = {
    cp_model.OPTIMAL: "OPTIMAL",
    cp_model.FEASIBLE: "FEASIBLE",
    cp_model.INFEASIBLE: "INFEASIBLE",
    cp_model.MODEL_INVALID: "MODEL_INVALID",
    cp_model.UNKNOWN: "UNKNOWN",
}


def _whole_us(duration_s: float) -> tuple[int, bool]:
    """A duration in whole microseconds, rounded up (at least 1), and whether that is exact."""
    us = duration_s * 1e6
    near = round(us)
    if abs(us - near) < 1e-6:
        return max(1, int(near)), near >= 1
    return max(1, math.ceil(us)), False


def _memory_unit(sizes: list[int]) -> int:
    """The largest power of two up to MAX_UNIT_NBYTES dividing every size: sizes in it are exact."""
    unit = MAX_UNIT_NBYTES
    for s in sizes:
        while unit > 1 and s % unit:
            unit //= 2
    return unit


@dataclass
class _Timeline:
    """A schedule in model units: op ends, and per moved tensor its transfer starts and memory edges."""

    end_us: np.ndarray
    ready_us: np.ndarray
    write_start_us: dict[str, int]
    read_start_us: dict[str, int]
    mem_off_us: dict[str, int]
    mem_on_us: dict[str, int]


class _IlpModel:
    """The CP-SAT model of one Problem (see the module docstring for the formulation)."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        lt = problem.lifetimes
        self.n, self.nf = lt.num_ops, lt.num_fwd_ops
        # Durations rounded up to whole microseconds, at least 1 so every op owns a non-empty window.
        self.d = np.maximum(1, np.ceil(lt.duration_us - 1e-9)).astype(np.int64)
        # Whether the model's times are the simulator's exactly (whole-us ops and transfers, no CPU
        # interference): then an optimal model step must equal the simulated one.
        self.exact_units = bool(np.array_equal(self.d, lt.duration_us))
        self.nominal_end = np.cumsum(self.d)
        self.tiers = [r for r in problem.hardware.available_tiers()]
        self.cands = list(lt.candidate_list)
        self.by_name = {c.name: c for c in self.cands}
        fixed = lt.baseline_memory_bytes.astype(np.int64).copy()
        for c in self.cands:
            fixed[c.producer_idx : c.last_use_idx + 1] -= c.nbytes
        self.unit = _memory_unit([c.nbytes for c in self.cands] + [int(x) for x in fixed])
        #: Candidate sizes in memory units.
        self.cunits = {c.name: self.units(c.nbytes) for c in self.cands}
        self.write_us = {}
        self.read_us = {}
        for r in self.tiers:
            tm = problem.hardware.tier(r)
            for c in self.cands:
                w_us, w_exact = _whole_us(tm.write_s(c.nbytes))
                r_us, r_exact = _whole_us(tm.read_s(c.nbytes))
                self.write_us[c.name, r], self.read_us[c.name, r] = w_us, r_us
                self.exact_units = self.exact_units and w_exact and r_exact and not tm.costs_cpu
        # Memory no plan can move, per op, rounded up; candidates are added back as intervals.
        self.fixed_units = np.array([self.units(max(0, x)) for x in fixed], dtype=np.int64)
        self.auto = problem.budget_bytes is None
        self.m = cp_model.CpModel()
        self._build()

    def units(self, nbytes: float) -> int:
        """Bytes in model memory units, rounded up (exact for every size the profile holds)."""
        return int(math.ceil(nbytes / self.unit))

    def rounding_allowance_us(self, decisions: list[Decision] | tuple[Decision, ...]) -> float:
        """How much rounding to whole microseconds lengthens the ops and the transfers of ``decisions``
        (the ``rounding`` of the module docstring's ceiling)."""
        lt, hw = self.problem.lifetimes, self.problem.hardware
        total_us = float((self.d - lt.duration_us).sum())
        for x in decisions:
            tm = hw.tier(x.tier)
            total_us += self.write_us[x.name, x.tier] - tm.write_s(x.nbytes) * 1e6
            total_us += self.read_us[x.name, x.tier] - tm.read_s(x.nbytes) * 1e6
        return total_us

    def cpu_charge_us(self, decisions: list[Decision] | tuple[Decision, ...]) -> int:
        """The CPU cost the objective charges for moving ``decisions`` (each byte written and read, in
        full, rounded up per tensor as in ``cpu_us``)."""
        hw = self.problem.hardware
        return sum(
            math.ceil(2 * hw.tier(x.tier).cpu_s(x.nbytes) * 1e6)
            for x in decisions
            if hw.tier(x.tier).costs_cpu
        ) + sum(self.wake_us(t) for t in {x.tier for x in decisions if x.action == "offload"})

    def wake_us(self, tier: str) -> int:
        """The objective's charge for a step that moves anything through ``tier`` (``cpu_s_per_step_with_io``)."""
        return math.ceil(self.problem.hardware.tier(tier).cpu_s_per_step_with_io * 1e6)

    # ------------------------------------------------------------------------------------------ build
    def _build(self) -> None:
        m, n, nf, d = self.m, self.n, self.nf, self.d
        lt = self.problem.lifetimes
        horizon = int(self.nominal_end[-1]) + sum(self.write_us.values()) + sum(self.read_us.values()) + 1
        if self.auto:
            # "auto" means no stall: every op ends at its nominal time.
            self.E = [m.new_constant(int(x)) for x in self.nominal_end]
        else:
            self.E = [m.new_int_var(int(self.nominal_end[k]), horizon, f"E{k}") for k in range(n)]
            m.add(self.E[0] == int(d[0]))  # op 0 starts at time 0 (see the note below)
            for k in range(1, n):
                m.add(self.E[k] >= self.E[k - 1] + int(d[k]))
        zero = m.new_constant(0)
        # R[k]: the boundary before op k is done waiting for writes and issues its reads. Waits happen
        # only before forward ops and at the end of forward (k <= nf); elsewhere R[k] = E[k-1].
        # Note: [Forward ops start at their boundary] A forward op has no fetch to wait for, so the
        # simulator starts it the moment its boundary's waits are done: E[k] == R[k] + d[k]. Letting it
        # start later (as an earlier version did) let a tensor freed during that slack be counted as gone
        # before the op's outputs exist, while the simulator counts both during the op: plans 0.3-11%
        # over budget. Backward ops may still start after R[k] (their fetches), which only makes the
        # model's memory window of the op longer than the simulator's op: conservative.
        self.R = [zero]
        for k in range(1, n):
            if k <= nf and not self.auto:
                r = m.new_int_var(0, horizon, f"R{k}")
                m.add(r >= self.E[k - 1])
                if k < nf:
                    m.add(r == self.E[k] - int(d[k]))
                else:
                    m.add(r <= self.E[k] - int(d[k]))
                self.R.append(r)
            else:
                self.R.append(self.E[k - 1])

        # Op k owns memory over [R[k], E[k]): the simulator's memory "during op k", from the moment
        # its reads are issued (a read's buffer is allocated then) to its end.
        mem_intervals, mem_demands = [], []
        for k in range(n):
            size = m.new_int_var(int(d[k]), horizon, f"opw{k}")
            mem_intervals.append(m.new_interval_var(self.R[k], size, self.E[k], f"opmem{k}"))
            mem_demands.append(int(self.fixed_units[k]))

        self.o: dict[tuple[str, str], cp_model.IntVar] = {}
        self.ws, self.rs, self.pe, self.p, self.moved = {}, {}, {}, {}, {}
        channels: dict[tuple[str, str], list] = {}
        for c in self.cands:
            lits = []
            for r in self.tiers:
                lits.append(m.new_bool_var(f"o[{c.name},{r}]"))
                self.o[c.name, r] = lits[-1]
            moved = m.new_bool_var(f"moved[{c.name}]")
            m.add(sum(lits) == moved)
            self.moved[c.name] = moved
            prod_start = self.E[c.producer_idx] - int(d[c.producer_idx])
            pe = m.new_int_var(0, horizon, f"pe[{c.name}]")
            p = m.new_int_var(0, horizon, f"p[{c.name}]")
            self.pe[c.name], self.p[c.name] = pe, p
            m.add(pe >= self.E[c.last_fwd_use_idx])  # needed through its last forward use
            m.add(pe <= p)
            m.add(
                p <= self.E[c.first_bwd_use_idx] - int(d[c.first_bwd_use_idx])
            )  # back before its first backward use
            m.add(pe == p).only_enforce_if(moved.Not())
            m.add(pe <= self.R[nf]).only_enforce_if(moved)  # writes are waited by the end of forward
            m.add(p >= self.R[nf]).only_enforce_if(moved)  # reads are issued in backward
            size_a = m.new_int_var(0, horizon, f"sa[{c.name}]")
            size_b = m.new_int_var(0, horizon, f"sb[{c.name}]")
            mem_intervals.append(m.new_interval_var(prod_start, size_a, pe, f"memA[{c.name}]"))
            mem_intervals.append(m.new_interval_var(p, size_b, self.E[c.last_use_idx], f"memB[{c.name}]"))
            mem_demands += [self.cunits[c.name]] * 2
            ws = m.new_int_var(0, horizon, f"ws[{c.name}]")
            rs = m.new_int_var(0, horizon, f"rs[{c.name}]")
            self.ws[c.name], self.rs[c.name] = ws, rs
            m.add(ws >= self.E[c.producer_idx]).only_enforce_if(moved)
            m.add(rs >= p).only_enforce_if(moved)
            for r, lit in zip(self.tiers, lits):
                wd, rd = self.write_us[c.name, r], self.read_us[c.name, r]
                w = m.new_optional_fixed_size_interval_var(ws, wd, lit, f"W[{c.name},{r}]")
                rd_iv = m.new_optional_fixed_size_interval_var(rs, rd, lit, f"R[{c.name},{r}]")
                m.add(ws + wd <= pe).only_enforce_if(lit)
                m.add(rs + rd <= self.E[c.first_bwd_use_idx] - int(d[c.first_bwd_use_idx])).only_enforce_if(
                    lit
                )
                hw = self.problem.hardware
                channels.setdefault(channel_key(hw, r, "write"), []).append(w)
                channels.setdefault(channel_key(hw, r, "read"), []).append(rd_iv)
        for ivs in channels.values():
            m.add_no_overlap(ivs)

        # Host-like tiers with a capacity: every moved tensor is away at the end of forward, so the sum
        # of their sizes is exactly the tier's peak holding.
        for r in self.tiers:
            cap = self.problem.hardware.tier(r).capacity_bytes
            if cap:
                m.add(sum(self.o[c.name, r] * self.cunits[c.name] for c in self.cands) <= cap // self.unit)

        base_units = np.array([self.units(x) for x in lt.baseline_memory_bytes])
        if self.auto:
            hi = int(base_units.max())
            lo = max(0, self.units(lt.min_feasible_peak_bytes) - len(self.cands))
            self.peak = m.new_int_var(lo, hi, "peak")
            # A whole-horizon filler of (hi - peak) units turns a fixed capacity hi into a variable one.
            filler = m.new_interval_var(
                zero, int(self.nominal_end[-1]), m.new_constant(int(self.nominal_end[-1])), "filler"
            )
            mem_intervals.append(filler)
            mem_demands.append(hi - self.peak)
            m.add_cumulative(mem_intervals, mem_demands, hi)
            budget_units = None
        else:
            budget_units = int(self.problem.budget_bytes) // self.unit
            m.add_cumulative(mem_intervals, mem_demands, budget_units)
        self.budget_units = budget_units
        self._add_cuts(base_units)
        if not self.auto:
            self._add_bandwidth_cuts()

        self.moved_units = sum(self.moved[c.name] * self.cunits[c.name] for c in self.cands)
        # The objective: compute + stall (the end of the last op) + CPU interference, charged in full
        # for every byte moved (once written, once read) (the simulator charges only the share that overlaps running ops, so the
        # model's step is never below the simulated one); then, in a second solve, the fewest bytes.
        self.cpu_us = sum(
            self.o[c.name, r] * math.ceil(2 * self.problem.hardware.tier(r).cpu_s(c.nbytes) * 1e6)
            for c in self.cands
            for r in self.tiers
            if self.problem.hardware.tier(r).costs_cpu
        )
        # Waking a tier's I/O path, once per step that moves anything through it.
        self.uses: dict[str, cp_model.IntVar] = {}
        for r in self.tiers:
            wake = self.wake_us(r)
            if wake and self.cands:
                used = self.uses[r] = self.m.new_bool_var(f"uses_{r}")
                for c in self.cands:
                    self.m.add_implication(self.o[c.name, r], used)
                self.cpu_us = self.cpu_us + wake * used
        self.primary = self.peak if self.auto else self.E[-1] + self.cpu_us
        self.m.minimize(self.primary)

    def _add_cuts(self, base_units: np.ndarray) -> None:
        """Knapsack cuts: at an op over the budget, the tensors that can be away there must cover the
        excess. Redundant with the cumulative constraint, but visible to the LP relaxation."""
        if not self.cands:
            return
        start = np.array([c.last_fwd_use_idx + 1 for c in self.cands])
        end = np.array([c.inactive_end_idx for c in self.cands])
        units = np.array([self.cunits[c.name] for c in self.cands])
        # Pages counted exactly as the cumulative sees them: fixed part + every candidate alive there.
        mem_units = self.fixed_units.copy()
        for c in self.cands:
            mem_units[c.producer_idx : c.last_use_idx + 1] += self.cunits[c.name]
        if self.auto:
            # The excess depends on the peak variable: cut only the highest ops.
            for k in np.argsort(-mem_units)[: min(MAX_CUTS, 32)]:
                idx = np.nonzero((start <= k) & (k <= end))[0]
                moved = sum(self.moved[self.cands[i].name] * int(units[i]) for i in idx)
                self.m.add(moved >= int(mem_units[k]) - self.peak)
            return
        excess = mem_units - self.budget_units
        over = np.nonzero(excess > 0)[0]
        for k in over[np.argsort(-excess[over])][:MAX_CUTS]:
            idx = np.nonzero((start <= k) & (k <= end))[0]
            self.m.add(sum(self.moved[self.cands[i].name] * int(units[i]) for i in idx) >= int(excess[k]))

    def _add_bandwidth_cuts(self) -> None:
        """The bandwidth-window cuts of :mod:`planner.bounds`: between the end of op ``a`` and the start
        of op ``b`` at least ``nbytes`` must move, which takes ``min_s``. They put bandwidth into the LP
        relaxation, which otherwise bounds the step by compute time alone."""
        self.num_bandwidth_cuts = 0
        for w in bandwidth_windows(self.problem.lifetimes, self.problem.hardware, self.problem.budget_bytes):
            need_us = int(math.floor(w.min_s * 1e6))
            if w.direction == "write":  # written before the boundary of op b (waits happen there)
                self.m.add(self.R[w.before_idx] - self.E[w.after_idx] >= need_us)
            else:  # issued at the boundary after op a, done before op b starts
                b = w.before_idx
                self.m.add(self.E[b] - int(self.d[b]) - self.R[w.after_idx + 1] >= need_us)
            self.num_bandwidth_cuts += 1

    # ------------------------------------------------------------------------------------ warm start
    def timeline_of(self, decisions: list[Decision] | tuple[Decision, ...]) -> _Timeline:
        """Replay ``decisions`` under the execution model in model units (no CPU interference)."""
        rp = replay(
            list(decisions),
            self.problem.hardware,
            self.d.astype(np.float64),
            transfer=lambda x, direction: (self.write_us if direction == "write" else self.read_us)[
                x.name, x.tier
            ],
            cpu_cost=lambda x: 0.0,
            call_cost=lambda x: 0.0,
            step_cost=lambda tier: 0.0,
        )
        names = [x.name for x in decisions]
        as_int = lambda a: {x: int(round(v)) for x, v in zip(names, a)}  # noqa: E731
        return _Timeline(
            end_us=np.rint(rp.op_end).astype(np.int64),
            ready_us=np.rint(rp.ready).astype(np.int64),
            write_start_us=as_int(rp.w_start),
            read_start_us=as_int(rp.r_start),
            mem_off_us={x.name: int(round(rp.ready[x.wait_before_idx])) for x in decisions},
            mem_on_us=as_int(rp.r_issue),
        )

    def add_hint(self, decisions: list[Decision] | tuple[Decision, ...]) -> None:
        """A complete hint from a plan (greedy's): CP-SAT starts from it and repairs it if needed."""
        tl = self.timeline_of(decisions)
        m = self.m
        if not self.auto:
            for k in range(self.n):
                m.add_hint(self.E[k], int(tl.end_us[k]))
            for k in range(1, self.nf + 1):
                m.add_hint(self.R[k], int(tl.ready_us[k]))
        chosen = {x.name: x for x in decisions if x.name in self.by_name}
        for r, used in self.uses.items():
            m.add_hint(used, int(any(x.tier == r and x.action == "offload" for x in chosen.values())))
        for c in self.cands:
            x = chosen.get(c.name)
            for r in self.tiers:
                m.add_hint(self.o[c.name, r], int(x is not None and x.tier == r))
            m.add_hint(self.moved[c.name], int(x is not None))
            if x is None:
                m.add_hint(self.pe[c.name], int(tl.end_us[c.last_fwd_use_idx]))
                m.add_hint(self.p[c.name], int(tl.end_us[c.last_fwd_use_idx]))
                continue
            m.add_hint(self.pe[c.name], tl.mem_off_us[c.name])
            m.add_hint(self.p[c.name], tl.mem_on_us[c.name])
            m.add_hint(self.ws[c.name], tl.write_start_us[c.name])
            m.add_hint(self.rs[c.name], tl.read_start_us[c.name])

    # --------------------------------------------------------------------------------------- extract
    def extract(self, solver: cp_model.CpSolver) -> list[Decision]:
        """Decisions from a solution, with queue ranks in the model's channel order.

        Note: [Issue order is the model's channel order] A channel runs FIFO in issue order. A write is
        issued after the latest forward op ending at or before the model's write start, which is monotone
        in that start, so the write order is the model's. A read is issued before the op in whose window
        the tensor's memory comes back; that is not monotone in the model's read start, so reads that the
        model runs later are issued no earlier than the ones it runs before them (a later prefetch only
        keeps a tensor away longer: memory never grows). Ranks break ties at one op in model order.
        """
        lt = self.problem.lifetimes
        nf = self.nf
        end = np.array([solver.value(e) for e in self.E], dtype=np.int64)
        ready = np.array([solver.value(r) for r in self.R], dtype=np.int64)
        rows = []
        for c in self.cands:
            tier = next((r for r in self.tiers if solver.boolean_value(self.o[c.name, r])), None)
            if tier is None:
                continue
            ws, pe, p, rs = (solver.value(v[c.name]) for v in (self.ws, self.pe, self.p, self.rs))
            # Issued at the latest forward op end not after the model's write start.
            off = c.producer_idx + int(np.searchsorted(end[c.producer_idx : nf], ws, side="right")) - 1
            off = max(c.producer_idx, off)
            # Freed before the first op whose window [R[k], E[k]) starts at or after pe.
            wait = c.last_fwd_use_idx + 1
            while wait < nf and ready[wait] < pe:
                wait += 1
            # Prefetched before the first op whose window ends after p.
            pref = nf
            while pref < c.first_bwd_use_idx and end[pref] <= p:
                pref += 1
            rows.append([c, tier, off, max(wait, off + 1), pref, ws, rs])
        by_channel: dict[tuple[str, str], list] = {}
        for row in rows:
            by_channel.setdefault(channel_key(self.problem.hardware, row[1], "read"), []).append(row)
        for part in by_channel.values():
            part.sort(key=lambda r: r[6])
            latest = nf
            for row in part:
                latest = row[4] = min(max(row[4], latest), row[0].first_bwd_use_idx)
        decisions = [
            lt.decision(
                c.name,
                tier=tier,
                offload_after_idx=off,
                wait_before_idx=wait,
                prefetch_before_idx=pref,
                fetch_before_idx=c.first_bwd_use_idx,
            )
            for c, tier, off, wait, pref, _, _ in rows
        ]
        w_rank = {r[0].name: k for k, r in enumerate(sorted(rows, key=lambda r: (r[2], r[5])))}
        r_rank = {r[0].name: k for k, r in enumerate(sorted(rows, key=lambda r: (r[4], r[6])))}
        return [
            dataclasses.replace(d, write_rank=w_rank[d.name], read_rank=r_rank[d.name]) for d in decisions
        ]


def own_plan_problems(own: dict) -> list[Violation]:
    """What is wrong with one record of ``stats.extra["own_plans"]`` (empty when nothing is): the plan the
    model found is over the budget, or its step or peak breaks the relations of the module docstring."""
    out: list[Violation] = []
    label = own["label"]
    if own["budget_bytes"] is not None and own["sim_peak_bytes"] > own["budget_bytes"]:
        out.append(
            Violation(
                "budget",
                "",
                f"{label}: simulated peak {own['sim_peak_bytes']} bytes over the budget of "
                f"{own['budget_bytes']} bytes",
            )
        )
    if own["auto"]:
        # "auto" fixes op times and minimises the peak: the model's peak bounds the simulated one.
        if own["model_peak_bytes"] is not None and own["sim_peak_bytes"] > own["model_peak_bytes"]:
            out.append(
                Violation(
                    "model_optimistic",
                    "",
                    f"{label}: model peak {own['model_peak_bytes']} bytes below the simulated peak "
                    f"{own['sim_peak_bytes']} bytes",
                )
            )
        return out
    model_s, sim_s = own["model_step_s"], own["sim_step_s"]
    if sim_s > model_s + CHECK_TOLERANCE_S:
        out.append(
            Violation(
                "model_optimistic",
                "",
                f"{label}: model step {model_s:.9f} s below the simulated {sim_s:.9f} s",
            )
        )
    allowance_s = own["rounding_allowance_s"] + own["cpu_charge_s"]
    if own["status"] == "OPTIMAL" and model_s - sim_s > allowance_s + CHECK_TOLERANCE_S:
        out.append(
            Violation(
                "model_pessimistic",
                "",
                f"{label}: optimal model step {model_s:.9f} s exceeds the simulated {sim_s:.9f} s by more than "
                f"rounding {own['rounding_allowance_s']:.9f} s + CPU charge {own['cpu_charge_s']:.9f} s",
            )
        )
    return out


def _better_auto(a: SimResult, b: SimResult) -> bool:
    a_ok, b_ok = a.stall_s <= STALL_TOLERANCE_S, b.stall_s <= STALL_TOLERANCE_S
    if a_ok != b_ok:
        return a_ok
    if a.peak_bytes != b.peak_bytes:
        return a.peak_bytes < b.peak_bytes
    return a.step_s < b.step_s


def _complete_hint(
    m: cp_model.CpModel, time_limit_s: float, deterministic_s: float | None = None
) -> tuple[bool, float]:
    """Turn a hint on the decision variables into a hint on every variable.

    CP-SAT ignored a partial hint of greedy's plan at 48 layers (no solution in 45 s) although fixing the
    hinted values solved in 0.1 s; hinting every variable makes it start from greedy's plan.
    """
    probe = cp_model.CpSolver()
    probe.parameters.fix_variables_to_their_hinted_value = True
    probe.parameters.num_workers = 1
    probe.parameters.max_time_in_seconds = max(0.05, time_limit_s)
    if deterministic_s is not None:
        probe.parameters.max_deterministic_time = max(0.01, deterministic_s)
    if probe.solve(m) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return False, probe.deterministic_time
    values = list(probe.response_proto.solution)
    m.clear_hints()
    for i, v in enumerate(values):
        m.add_hint(m.get_int_var_from_proto_index(i), v)
    return True, probe.deterministic_time


def _run(
    model: _IlpModel, time_limit_s: float, workers: int, deterministic_s: float | None = None
) -> tuple[cp_model.CpSolver, int]:
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.05, float(time_limit_s))
    if deterministic_s is not None:
        solver.parameters.max_deterministic_time = max(0.01, float(deterministic_s))
    solver.parameters.num_workers = max(1, int(workers))
    solver.parameters.random_seed = 0
    status = solver.solve(model.m)
    return solver, status


#: Problems with at most this many candidates get the whole-step model first; larger ones go straight to
#: the layer-window search (at 48 layers CP-SAT found no whole-step solution in 60 s, even hinted).
FULL_MODEL_MAX_CANDIDATES = 300
#: Layers per window of the large-neighbourhood search, and the CP-SAT time per window (seconds). At real
#: op granularity (synthetic ops split 7 ways, 16 or 80 layers) a window's presolve and propagation take
#: seconds while CP-SAT's deterministic clock counts hundredths, so this wall-clock cap, not
#: ``deterministic_time_s``, ends each window there: such runs are not reproducible across machines.
LNS_WIDTH = 4
LNS_WINDOW_S = 4.0


@dataclass
class _Search:
    """The incumbent and what every model solution looked like (``own``: one record per solution, checked
    by :func:`own_plan_problems` when the environment asks, see the module docstring)."""

    problem: Problem
    model: _IlpModel
    decisions: list[Decision]
    sim: SimResult
    source: str
    status: str = "HEURISTIC"
    own: list[dict] = dataclasses.field(default_factory=list)
    improvements: int = 0
    #: CP-SAT's deterministic time over every solve so far (its own work units, see ``Problem``).
    cpsat_deterministic_s: float = 0.0

    def offer(self, solver: cp_model.CpSolver, status: int, label: str) -> bool:
        """Extract the solution, judge it in the simulator, keep it when better. True when kept."""
        decisions = self.model.extract(solver)
        sim = self.problem.simulate(decisions)
        m = self.model
        own = {
            "label": label,
            "model_step_s": None if m.auto else solver.value(m.E[-1] + m.cpu_us) / 1e6,
            "model_peak_bytes": solver.value(m.peak) * m.unit if m.auto else None,
            "sim_step_s": sim.step_s,
            "sim_peak_bytes": sim.peak_bytes,
            "budget_bytes": self.problem.budget_bytes,
            "status": _STATUS.get(status, str(status)),
            "auto": m.auto,
            "exact_units": m.exact_units,
            "rounding_allowance_s": m.rounding_allowance_us(decisions) / 1e6,
            "cpu_charge_s": m.cpu_charge_us(decisions) / 1e6,
        }
        self.own.append(own)
        if os.environ.get(CHECK_OWN_PLANS_ENV) == "1":
            problems = own_plan_problems(own)
            if problems:
                raise SolverBugError(
                    f"ilp: the model's own plan ({label}) disagrees with the simulator: {problems[0]}",
                    problems,
                )
        better = _better_auto if m.auto else _better
        if better(sim, self.sim) or (label == "whole step" and not better(self.sim, sim)):
            self.decisions, self.sim, self.source = decisions, sim, label
            self.status = "OPTIMAL" if status == cp_model.OPTIMAL and label == "whole step" else "FEASIBLE"
            self.improvements += 1
            return True
        return False


def _lns(search: _Search, windows: list[tuple[int, ...]], layers, deadline: float, det: float | None) -> int:
    """Re-solve the model with only one layer window's tensors free, the rest fixed to the incumbent.

    Windows are visited worst first (most simulated stall in their ops), the incumbent hinted in full.
    Returns the number of windows solved.
    """
    model, problem = search.model, search.problem
    spans = layers.layers

    def stall_in(window: tuple[int, ...]) -> float:
        st = search.sim.stall_s_per_op
        return sum(
            float(st[s.fwd_start_idx : s.fwd_stop_idx].sum() + st[s.bwd_start_idx : s.bwd_stop_idx].sum())
            for s in (spans[i] for i in window)
        )

    order = sorted(windows, key=lambda w: -stall_in(w))
    solved = 0
    for window in order:
        left = deadline - time.perf_counter()
        if left < 0.5:
            break
        free = {name for i in window for name in spans[i].tensor_names}
        chosen = {d.name: d for d in search.decisions}
        m = model.m
        m.clear_hints()
        model.add_hint(search.decisions)
        sub = m.clone()
        for c in model.cands:
            if c.name in free:
                continue
            d = chosen.get(c.name)
            for r in model.tiers:
                var = sub.get_bool_var_from_proto_index(model.o[c.name, r].index)
                sub.add(var == int(d is not None and d.tier == r))
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = max(0.2, min(LNS_WINDOW_S, left))
        if det is not None:
            solver.parameters.max_deterministic_time = max(0.01, det / max(1, len(order)))
        solver.parameters.num_workers = max(1, problem.workers)
        solver.parameters.random_seed = 0
        status = solver.solve(sub)
        search.cpsat_deterministic_s += solver.deterministic_time
        solved += 1
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            search.offer(solver, status, f"window {window[0]}-{window[-1]}")
    return solved


@register_solver("ilp", supports_auto=True, recompute_modes=("off", "only", "joint"))
def solve_ilp(problem: Problem) -> Plan:
    """The exact solver: the best of the ``pipeline`` and ``greedy`` plans, improved with CP-SAT (the whole
    step when it is small, then a large-neighbourhood search over layer windows), judged by the simulator;
    with recompute, a search over recompute sets around that model (module docstring).

    Raises:
        BudgetError: the budget is below the smallest achievable peak (or, recompute only, no recompute set
            meets it).
    """
    if problem.plans_recompute:
        return _solve_with_recompute(problem)
    return _solve_offload(problem)


#: Shares of the time limit in a recompute search: the recompute-only search, the joint set search, and
#: the offload-only run when recomputing wins (else it gets all that is left); the rest polishes the
#: best set's offloads with the model.
OFFLOAD_SHARE = 0.35
ONLY_SHARE = 0.1
SET_SEARCH_SHARE = 0.2
#: Recompute sets evaluated per deterministic second of a search share (Note: [The set search counts sets
#: when the clock must not decide]).
SETS_PER_DETERMINISTIC_S = 200

# Note [The set search counts sets when the clock must not decide]
# The search over recompute sets is not CP-SAT: each set is judged by the pipeline's offloads and the
# simulator, so CP-SAT's deterministic clock does not reach it. With a deterministic time limit it stops
# after a number of evaluated sets proportional to that limit (its share of it, times
# SETS_PER_DETERMINISTIC_S), so a loaded machine evaluates the same sets and returns the same plan as a
# quiet one; the wall-clock deadline still caps it. Without one, the wall clock alone stops it.


def _set_search(problem: Problem, start, deadline: float, budget: int, counter: list[int], share: float):
    """Layer moves, then single-tensor drops, over recompute sets from ``start`` (module docstring).

    Stops at a local optimum, at ``deadline`` (wall clock), or, with a deterministic time limit, after
    ``share`` of its evaluations (Note: [The set search counts sets when the clock must not decide])."""
    det = problem.deterministic_time_s
    max_evals = None if det is None else counter[0] + max(1, int(det * share * SETS_PER_DETERMINISTIC_S))
    lt = problem.lifetimes
    rec = {c.name: c for c in lt.recomputable}
    ratio = (
        rebuild_ratio(problem)
        if problem.hardware.available_tiers()
        else {n: c.recompute_us for n, c in rec.items()}
    )
    layers = find_layers(problem.profile)
    groups: list[list[str]] = []
    in_layer: set[str] = set()
    for span in layers.layers:
        names = [n for n in span.tensor_names if n in rec]
        if names:
            groups.append(names)
            in_layer.update(names)
    rest = [n for n in rec if n not in in_layer]
    if rest:
        groups.append(rest)
    best = start

    def out_of_time() -> bool:
        if max_evals is not None and counter[0] >= max_evals:
            return True
        return time.perf_counter() > deadline

    def attempt(names: set[str], label: str) -> bool:
        nonlocal best
        key = tuple(n for n in rec if n in names)  # profile order: one key per set
        if key == best.recomputed or out_of_time():
            return False
        counter[0] += 1
        e = evaluate(problem, key, budget, label)
        if e is not None and better(e.sim, best.sim):
            best = e
            return True
        return False

    improved = True
    while improved and not out_of_time():
        improved = False
        for g in groups:
            cur = set(best.recomputed)
            by_ratio = sorted(g, key=lambda n: ratio[n])
            half = max(1, len(g) // 2)
            for names, label in (
                (cur | set(g), "add layer"),
                (cur - set(g), "drop layer"),
                (cur | set(by_ratio[:half]), "add cheap half"),
                (cur - set(by_ratio[half:]), "drop dear half"),
            ):
                if attempt(names, label):
                    improved = True
                    break
    for name in sorted(best.recomputed, key=lambda n: -rec[n].recompute_us):
        if out_of_time():
            break
        if name in best.recomputed:
            attempt(set(best.recomputed) - {name}, "drop one")
    return best


def _solve_with_recompute(problem: Problem) -> Plan:
    """Recompute "only" or "joint" (module docstring)."""
    t0 = time.perf_counter()
    limit = problem.time_limit_s * (1 - RESERVE_SHARE)
    budget = problem.budget_bytes
    counter = [0]
    pool: list = []
    extra: dict = {
        "exact": "the offload schedule of a fixed recompute set (CP-SAT on the residual step)",
        "searched": "the recompute set: the pipeline's plans, then layer add/drop moves and single drops, "
        "each set's offloads by the pipeline, judged by the simulator",
    }
    problem.report(0.0, "ilp: recompute sets")
    starts = recompute_plans(problem, budget)
    pool += starts
    only_problem = dataclasses.replace(problem, recompute="only")
    only_starts = [e for e in starts if e.label == "recompute only"]
    if only_starts:
        found = _set_search(
            only_problem,
            only_starts[0],
            time.perf_counter() + limit * ONLY_SHARE,
            budget,
            counter,
            ONLY_SHARE,
        )
        pool.append(dataclasses.replace(found, label="ilp recompute only"))
    joint_best = None
    offloading = problem.plans_offload and bool(problem.hardware.available_tiers())
    if problem.recompute == "joint" and offloading:
        with_sets = [e for e in starts if e.recomputed]
        if with_sets:
            start = with_sets[0]
            for e in with_sets[1:]:
                if better(e.sim, start.sim):
                    start = e
            joint_best = _set_search(
                problem,
                start,
                time.perf_counter() + limit * SET_SEARCH_SHARE,
                budget,
                counter,
                SET_SEARCH_SHARE,
            )
            pool.append(joint_best)
    # Whether rebuilding anything beats the offload-only start decides where the rest of the time goes:
    # to the offload-only model alone when it does not (then "joint" plans as well as "off" would in
    # the same time), else a share to it and the rest to the best set's offloads.
    off_start = next((e for e in starts if not e.recomputed and e.label == "offload only"), None)
    recompute_wins = joint_best is not None and (off_start is None or better(joint_best.sim, off_start.sim))
    if offloading:
        problem.report(0.4, "ilp: offload only")
        left_s = max(0.5, limit - (time.perf_counter() - t0))
        off_s = min(left_s, problem.time_limit_s * OFFLOAD_SHARE) if recompute_wins else left_s
        # Same deterministic budget as recompute="off" (so "joint" is never worse under it), the rest of
        # the wall clock or a share of it.
        off = _solve_offload(
            dataclasses.replace(
                problem, recompute="off", time_limit_s=off_s / (1 - RESERVE_SHARE), progress=None
            )
        )
        pool.append(Evaluated((), list(off.decisions), problem.simulate(off.decisions), "ilp offload only"))
        extra["offload_only"] = {"status": off.stats.status, "chosen": off.stats.extra.get("chosen")}
    if recompute_wins and joint_best.recomputed and joint_best.sim.within_budget:
        problem.report(0.7, "ilp: offloads of the best recompute set")
        res = problem.residual(joint_best.recomputed)
        left = max(0.5, limit - (time.perf_counter() - t0)) / (1 - RESERVE_SHARE)
        try:
            polished = _solve_offload(dataclasses.replace(res, time_limit_s=left, progress=None))
        except BudgetError:
            polished = None
        if polished is not None:
            decisions = [*res.lifetimes.recompute_decisions, *polished.decisions]
            pool.append(Evaluated(joint_best.recomputed, decisions, problem.simulate(decisions), "ilp joint"))
            extra["polish"] = {"status": polished.stats.status, "chosen": polished.stats.extra.get("chosen")}
    if not pool:
        raise BudgetError(
            f"no recompute set brings the peak within {budget} bytes (recompute={problem.recompute}); "
            f"allow offloading or a larger budget"
        )
    best = pool[0]
    for e in pool[1:]:
        if better(e.sim, best.sim):
            best = e
    extra["recompute"] = {
        "mode": problem.recompute,
        "chosen": best.label,
        "sources": {e.label: e.sim.step_s if e.sim.within_budget else None for e in pool},
        "sets_evaluated": counter[0],
        "recomputed": len(best.recomputed),
        "recomputed_bytes": best.sim.recomputed_bytes,
        "recompute_s": best.sim.recompute_s,
    }
    stats = SolverStats(
        solver="ilp",
        status="FEASIBLE" if best.sim.within_budget else "INFEASIBLE",
        wall_s=time.perf_counter() - t0,
        extra=extra,
    )
    problem.report(1.0, "ilp: done")
    return make_plan(problem, best.decisions, stats)


def _solve_offload(problem: Problem) -> Plan:
    """The offload-only solver of the module docstring (CP-SAT around the pipeline and greedy starts)."""
    t0 = time.perf_counter()
    lt = problem.lifetimes
    if problem.budget_bytes is not None and problem.hardware.available_tiers():
        if problem.budget_bytes < lt.min_feasible_peak_bytes:
            raise infeasible(problem.budget_bytes, lt.min_feasible_peak_bytes)
    auto = problem.budget_bytes is None
    better = _better_auto if auto else _better
    # CP-SAT overruns its limit a little (presolve, shutdown) and the simulations after it take time:
    # keep a reserve so the whole call stays within the time limit.
    deadline = t0 + problem.time_limit_s * (1 - RESERVE_SHARE)
    det = problem.deterministic_time_s

    def left_s() -> float:
        return max(0.05, deadline - time.perf_counter())

    problem.report(0.0, "ilp: starts")
    starts: dict[str, tuple[list[Decision], SimResult]] = {}
    for name in ("greedy",) if auto else ("pipeline", "greedy"):
        try:
            plan = get_solver(name)(dataclasses.replace(problem, progress=None))
        except BudgetError:
            continue
        starts[name] = (list(plan.decisions), problem.simulate(plan.decisions))
    best_start = None
    for name, (_, sim) in starts.items():
        if best_start is None or better(sim, starts[best_start][1]):
            best_start = name

    layers = find_layers(problem.profile)
    extra: dict = {
        "layers": layers.summary(),
        "starts": {k: v[1].step_s for k, v in starts.items()},
        "warm_start": best_start or "none",
        # Whether each model solution was checked against the simulator (module docstring).
        "own_plans_checked": os.environ.get(CHECK_OWN_PLANS_ENV) == "1",
    }
    if not len(lt.candidates) or (not auto and lt.baseline_peak_bytes <= problem.budget_bytes):
        # Nothing needs to move (or nothing can): the empty plan has no stall and moves no byte.
        stats = SolverStats(
            solver="ilp",
            status="OPTIMAL",
            objective=lt.compute_s,
            bound=lt.compute_s,
            wall_s=time.perf_counter() - t0,
            extra={**extra, "chosen": "empty plan (already within budget)"},
        )
        if not auto or not len(lt.candidates):
            return make_plan(problem, [], stats)

    build_t0 = time.perf_counter()
    model = _IlpModel(problem)
    extra["model"] = {
        "candidates": len(model.cands),
        "ops": model.n,
        "tiers": model.tiers,
        "memory_unit_nbytes": model.unit,
        "build_s": round(time.perf_counter() - build_t0, 3),
        "variables": len(model.m.proto.variables),
        "constraints": len(model.m.proto.constraints),
        "bandwidth_cuts": getattr(model, "num_bandwidth_cuts", 0),
    }
    extra["proven_for"] = "the model: op and transfer times rounded up to whole us, CPU cost of I/O in full"
    if best_start is None:
        empty_sim = problem.simulate([])
        search = _Search(problem, model, [], empty_sim, "none", status="UNKNOWN")
    else:
        search = _Search(problem, model, starts[best_start][0], starts[best_start][1], best_start)
    objective = bound = None

    if auto or len(model.cands) <= FULL_MODEL_MAX_CANDIDATES:
        problem.report(0.1, f"ilp: whole step ({len(model.cands)} candidates, {model.n} ops)")
        if search.decisions:
            model.add_hint(search.decisions)
        # Half the time on the whole step (all of it for "auto"); a hint on every variable when CP-SAT
        # finds nothing from the hint alone.
        share = 1.0 if auto or not layers.num_layers else 0.5
        phase1_s = left_s() * share * (1 - PHASE2_SHARE)
        solver, status = _run(model, phase1_s * 0.5, problem.workers, det * 0.25 if det else None)
        search.cpsat_deterministic_s += solver.deterministic_time
        if search.decisions and status not in (cp_model.OPTIMAL, cp_model.FEASIBLE, cp_model.INFEASIBLE):
            hinted_ok, used_s = _complete_hint(
                model.m, min(0.1 * phase1_s, left_s()), det * 0.1 if det else None
            )
            search.cpsat_deterministic_s += used_s
            if hinted_ok:
                solver, status = _run(model, phase1_s * 0.5, problem.workers, det * 0.25 if det else None)
                search.cpsat_deterministic_s += solver.deterministic_time
        extra["phase1_status"] = _STATUS.get(status, str(status))
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            objective, bound = solver.objective_value, solver.best_objective_bound
            search.offer(solver, status, "whole step")
            # Phase 2: hold the first objective at its best value, move the fewest units.
            best1 = int(round(solver.objective_value))
            model.m.add(model.primary <= best1)
            model.m.clear_hints()
            hinted = [
                *model.o.values(),
                *model.pe.values(),
                *model.p.values(),
                *model.ws.values(),
                *model.rs.values(),
                *model.moved.values(),
            ]
            if not model.auto:
                hinted += [*model.E, *model.R[1 : model.nf + 1]]
            for var in hinted:
                model.m.add_hint(var, solver.value(var))
            model.m.minimize(model.moved_units)
            problem.report(0.5, "ilp: fewest bytes at that step time")
            solver2, status2 = _run(
                model, left_s() * share * PHASE2_SHARE, problem.workers, det * 0.25 if det else None
            )
            search.cpsat_deterministic_s += solver2.deterministic_time
            extra["phase2_status"] = _STATUS.get(status2, str(status2))
            if status2 in (cp_model.OPTIMAL, cp_model.FEASIBLE):
                search.offer(solver2, status, "whole step")  # optimal in phase 1's objective
            model.m.minimize(model.primary)
    if not auto and layers.num_layers >= 2 and search.decisions and left_s() > 0.5:
        problem.report(0.6, "ilp: layer windows")
        extra["lns_windows_solved"] = _lns(
            search, layers.windows(LNS_WIDTH), layers, deadline, det * 0.5 if det else None
        )
    if model.auto:
        extra["objective_unit"] = "peak bytes"
        if objective is not None:
            objective, bound = objective * model.unit, bound * model.unit
    else:
        extra["objective_unit"] = "model step time s (compute + stall + full CPU cost of I/O)"
        if objective is not None:
            objective, bound = objective / 1e6, bound / 1e6
    extra["chosen"] = search.source
    extra["own_plans"] = search.own
    extra["improvements"] = search.improvements
    extra["cpsat_deterministic_s"] = search.cpsat_deterministic_s
    status_out = search.status
    if search.sim.budget_bytes is not None and not search.sim.within_budget:
        status_out = "INFEASIBLE"
    stats = SolverStats(
        solver="ilp",
        status=status_out,
        objective=objective,
        bound=bound,
        wall_s=time.perf_counter() - t0,
        extra=extra,
    )
    problem.report(1.0, "ilp: done")
    return make_plan(problem, search.decisions, stats)
