"""The CP-SAT model of the ILP solver: one Problem's offload decisions and schedule as integer variables.

What the model decides: which tensors move, to which tier, and when each write and read runs, so that
memory stays within the budget at every op and the step (compute + stall + the CPU cost of I/O) is
smallest. The search around it (starts, windows, checks) is :mod:`planner.solvers.ilp_search`; how its
step relates to the simulated one is argued in :mod:`planner.solvers.ilp`.

Legend (times in integer microseconds, op and transfer times rounded up; sizes in bytes, exactly):

- ``d[k]``   the duration of op ``k``, rounded up to whole microseconds (at least 1).
- ``E[k]``   end of op ``k``; ``E[k] - E[k-1] >= d[k]`` (the difference beyond ``d[k]`` is op k's stall).
- ``R[k]``   the boundary before op ``k`` is done waiting for writes and issues its reads. A separate
  variable only where waits happen (k <= num_fwd_ops). A forward op starts at its boundary,
  ``E[k] == R[k] + d[k]`` (Note: [Forward ops start at their boundary]); the first backward op may
  wait for fetches.
- ``o[t,r]`` tensor ``t`` moves to tier ``r`` (at most one tier).
- ``W[t,r]``, ``R[t,r]``: optional write/read intervals of fixed length on their tier's channels
  (``NoOverlap`` per :func:`planner.execution.channel_key`).
- ``pe[t]``  when ``t`` stops occupying memory after forward; ``p[t]`` when it occupies memory again.

Memory is a *cumulative* resource over time, not a boolean per (tensor, op): op ``k`` owns the time
``[R[k], E[k])`` with the memory nothing can move (``other_bytes``, params, non-candidates); each
candidate occupies ``[start of its producer, pe[t])`` and ``[p[t], E[last use])``. Reading the plan back
(:meth:`_IlpModel.extract`), a tensor is absent at the ops whose window lies in ``[pe, p)``, the
simulator's ``[wait_before_idx, prefetch_before_idx)``; the model's memory at every op is at least the
simulator's, so the model's plans keep the budget (checked on every solve of the test suite, see
:mod:`planner.solvers.ilp`), with O(tensors + ops) variables instead of the O(tensors x ops) booleans
of a per-op formulation.
Cuts: a knapsack cut per over-budget op (bytes that could be away there >= the excess), and the
bandwidth-window cuts of :mod:`planner.bounds` (time between two ops >= bytes that must move / bandwidth),
which put bandwidth into the LP relaxation.

Objective: ``E[last]`` plus the CPU cost of every transfer in full (the simulator charges only the share
that overlaps running ops). With ``budget="auto"`` op times are fixed at their nominal values (no stall)
and the objective is the peak.

Transfer order: the simulator (and the runtime) run each channel FIFO in issue order; the plan's
``write_rank`` / ``read_rank`` carry the model's channel order (Note: [Issue order is the model's
channel order]).
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from teraio.planner.bounds import bandwidth_windows
from teraio.planner.execution import channel_key, replay
from teraio.planner.plan import Decision
from teraio.planner.solve import Problem

#: Memory is counted in units of the largest power of two dividing every size (exact, and keeps the
#: cumulative constraint's numbers small); never coarser than this.
MAX_UNIT_NBYTES = 4096
#: Over-budget ops that get a knapsack cut (the ones with the largest excess; cuts are cheap but not free).
MAX_CUTS = 256

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
        (the ``rounding`` of the ceiling argued in :mod:`planner.solvers.ilp`)."""
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
        """The variables and constraints of the module docstring, in a fixed order (CP-SAT's search, and
        so the plan under a deterministic limit, depends on the order variables are created in)."""
        horizon = int(self.nominal_end[-1]) + sum(self.write_us.values()) + sum(self.read_us.values()) + 1
        zero = self._add_op_times(horizon)
        mem_intervals, mem_demands = self._add_op_windows(horizon)
        self._add_candidates(horizon, mem_intervals, mem_demands)
        self._add_memory(zero, mem_intervals, mem_demands)
        self._add_objective()

    def _add_op_times(self, horizon: int) -> cp_model.IntVar:
        """``E[k]`` and ``R[k]``; returns the constant 0 the first boundary and the "auto" filler use."""
        m, n, nf, d = self.m, self.n, self.nf, self.d
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
        # start later would let a tensor freed during that slack be counted as gone before the op's
        # outputs exist, while the simulator counts both during the op: the model's plans would go over
        # the budget. Backward ops may still start after R[k] (their fetches), which only makes the
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
        return zero

    def _add_op_windows(self, horizon: int) -> tuple[list, list]:
        """Op k owns memory over [R[k], E[k]): the simulator's memory "during op k", from the moment its
        reads are issued (a read's buffer is allocated then) to its end. Returns the cumulative's
        intervals and demands so far (the memory nothing can move)."""
        m, d = self.m, self.d
        mem_intervals, mem_demands = [], []
        for k in range(self.n):
            size = m.new_int_var(int(d[k]), horizon, f"opw{k}")
            mem_intervals.append(m.new_interval_var(self.R[k], size, self.E[k], f"opmem{k}"))
            mem_demands.append(int(self.fixed_units[k]))
        return mem_intervals, mem_demands

    def _add_candidates(self, horizon: int, mem_intervals: list, mem_demands: list) -> None:
        """Per candidate: its tier choice, memory edges, memory intervals (appended to the cumulative's)
        and transfer intervals, one ``NoOverlap`` per channel."""
        m, nf, d = self.m, self.nf, self.d
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

    def _add_memory(self, zero: cp_model.IntVar, mem_intervals: list, mem_demands: list) -> None:
        """Tier capacities, the cumulative memory constraint (the budget, or the peak for "auto") and
        its cuts."""
        m, lt = self.m, self.problem.lifetimes
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

    def _add_objective(self) -> None:
        """The step (or the peak for "auto") as ``primary``, minimised; ``moved_units`` for phase 2."""
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


def _complete_hint(
    m: cp_model.CpModel, time_limit_s: float, deterministic_s: float | None = None
) -> tuple[bool, float]:
    """Turn a hint on the decision variables into a hint on every variable.

    On large steps CP-SAT may ignore a partial hint of greedy's plan (no solution for a long time) although
    fixing the hinted values solves at once; hinting every variable makes it start from greedy's plan.
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


# Note: [A solve that stopped improving ends]
#     CP-SAT ends at its time limit unless it proves its solution optimal, and on these models its bound is
#     often too weak to prove it: on a block of the tiny GPT (22 candidates, 204 ops) the whole step's
#     last better solution came after 1.5 s and the solve ran on to its 9.5 s limit, and a user waited for
#     each graph's plan for as long as the limit allowed, whatever its size. So a solve given ``patience``
#     stops once it has found nothing better for as long as it took to find its last better solution (and
#     at least PATIENCE_MIN_S): a solve that keeps improving runs to its limit as before, one that found its
#     answer early ends at about twice that time. The clock is the wall's, so a solve with a deterministic
#     limit (the tests', for reproducible plans) never stops early: it ends where its deterministic time does.
#: The shortest wait for a better solution before a solve with ``patience`` ends.
PATIENCE_MIN_S = 0.5
#: How often the wait is checked.
_PATIENCE_POLL_S = 0.05


class _Improvements(cp_model.CpSolverSolutionCallback):
    """When the solve found its last (better) solution, in seconds since ``t0``."""

    def __init__(self, t0: float) -> None:
        super().__init__()
        self.t0 = t0
        self.last_s: float | None = None

    def on_solution_callback(self) -> None:
        self.last_s = time.perf_counter() - self.t0


def _solve_with_patience(solver: cp_model.CpSolver, m: cp_model.CpModel) -> int:
    """Note: [A solve that stopped improving ends]."""
    t0 = time.perf_counter()
    found = _Improvements(t0)
    done = threading.Event()

    def watch() -> None:
        while not done.wait(_PATIENCE_POLL_S):
            last = found.last_s
            if last is not None and time.perf_counter() - t0 - last >= max(PATIENCE_MIN_S, last):
                solver.stop_search()
                return

    watcher = threading.Thread(target=watch, name="teraio-ilp-patience", daemon=True)
    watcher.start()
    try:
        return solver.solve(m, found)
    finally:
        done.set()
        watcher.join()


def _run(
    model: _IlpModel,
    time_limit_s: float,
    workers: int,
    deterministic_s: float | None = None,
    *,
    patience: bool = False,
) -> tuple[cp_model.CpSolver, int]:
    """Solve ``model`` within the limits; with ``patience`` (and no deterministic limit) stop once it stops
    improving (Note: [A solve that stopped improving ends])."""
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.05, float(time_limit_s))
    if deterministic_s is not None:
        solver.parameters.max_deterministic_time = max(0.01, float(deterministic_s))
    solver.parameters.num_workers = max(1, int(workers))
    solver.parameters.random_seed = 0
    if patience and deterministic_s is None:
        return solver, _solve_with_patience(solver, model.m)
    status = solver.solve(model.m)
    return solver, status
