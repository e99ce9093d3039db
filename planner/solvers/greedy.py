"""TERAIO's greedy planner (its Algorithm 1), plus the repair pass it needs when I/O cannot hide.

It is TERAIO's baseline and stays offload-only: it plans ``recompute="off"`` alone (``planner.solve``
refuses other modes for it), so comparisons with it show what recompute adds.

Legend (TERAIO's notation, in this code's names):

- ``B`` = ``budget``; ``M_i`` = ``mem[i]``, memory during op ``i``; ``E_i = max(0, M_i - B)`` = ``excess[i]``.
- For a candidate tensor ``t``: size ``s_t`` (``nbytes``), write time ``W_t``, read time ``R_t``; its
  absent window ``[j, p)`` = ``[wait_before_idx, prefetch_before_idx)``.
- ``benefit_t = sum_{i in [j, p)} min(s_t, E_i) * duration_i / (W_t + R_t)``: the memory over budget the
  move removes, integrated over time, per unit of I/O time.

Phase 1 (Algorithm 1, nominal time): repeatedly move the candidate of best benefit. Its write and read
are placed in the channels' free time left by earlier picks (bandwidth already planned), which may
delay the write or advance the read and so shrink the window and the benefit. Transfers are placed at
op boundaries only (a write starts when an op ends, a read when an op starts) on a channel free at that
moment, so in nominal time each starts when issued and the FIFO simulator sees the same schedule.
Benefits only fall as picks accumulate, so a lazy priority queue finds the best pick exactly.

Phase 2 (repair, accepts stall; plain Algorithm 1 can exceed the budget when I/O-bound):
while some op is over budget, make one more tensor absent there: widen an existing window or move a new
tensor, choosing the option of least nominal stall, then one that adds no I/O, then the best fit for the
excess (of the orders tried on sweeps of synthetic steps, the one that stalls least). Ops are repaired
from the outside
in: forward ops first, earliest first, then backward ops, latest first. A tensor made absent at forward
op ``i`` stays absent up to the end of forward, and one made absent at backward op ``k`` from the end of
forward up to ``k``, so each tensor is picked at most once per pass: at most two repairs per candidate.
(Worst op first would widen a window by one op per repair as the peak recedes: the repairs would grow
with the square of the layers.)

Phase 3 (tidy): drop moves the budget no longer needs, then wait for each remaining write as late as
the budget allows (a later wait never adds stall). The simulator judges the result.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from bisect import bisect_left, bisect_right
from dataclasses import dataclass

import numpy as np

from teraio.planner.execution import Candidate, channel_key
from teraio.planner.hardware import HardwareModel
from teraio.planner.lifetimes import Lifetimes
from teraio.planner.plan import Decision, Plan, SolverStats
from teraio.planner.solve import Problem, make_plan, register_solver

_EPS_US = 1e-6


class _Channel:
    """Reserved busy intervals ``[start, end)`` of one FIFO channel, in nominal microseconds."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []

    def blocker(self, a: float, b: float) -> int | None:
        """Index of a reserved interval overlapping ``[a, b)``, or None when the channel is free."""
        k = bisect_right(self.starts, a + _EPS_US) - 1
        if k >= 0 and self.ends[k] > a + _EPS_US:
            return k
        if k + 1 < len(self.starts) and self.starts[k + 1] < b - _EPS_US:
            return k + 1
        return None

    def reserve(self, a: float, b: float) -> None:
        k = bisect_left(self.starts, a)
        self.starts.insert(k, a)
        self.ends.insert(k, b)


@dataclass
class _Placement:
    tier: str
    offload_after_idx: int
    wait_before_idx: int
    prefetch_before_idx: int
    write_us: tuple[float, float]
    read_us: tuple[float, float]
    benefit: float


class _State:
    """Phase 1's picture of the step: memory, excess and channel reservations."""

    def __init__(self, problem: Problem, budget: int) -> None:
        self.lt: Lifetimes = problem.lifetimes
        self.hw: HardwareModel = problem.hardware
        self.budget = budget
        self.mem = self.lt.baseline_memory_bytes.astype(np.int64).copy()
        self.tiers = [t for t in self.hw.available_tiers()]
        self.channels: dict[tuple[str, str], _Channel] = {}
        self.held: dict[str, np.ndarray] = {
            t: np.zeros(self.lt.num_ops + 1, dtype=np.int64)
            for t in self.tiers
            if self.hw.tiers[t].capacity_bytes is not None
        }
        # Lists, not arrays: bisect on a numpy array is slow element access.
        self.start_us: list[float] = self.lt.op_start_us.tolist()
        self.end_us: list[float] = self.lt.op_end_us.tolist()
        self.dur_us = self.lt.duration_us
        #: Where the last channel search per (tensor, tier, direction) stopped (see ``place``).
        self.resume: dict[tuple[str, str, str], int] = {}

    def channel(self, tier: str, direction: str) -> _Channel:
        return self.channels.setdefault(channel_key(self.hw, tier, direction), _Channel())

    def excess(self) -> np.ndarray:
        return np.maximum(self.mem - self.budget, 0)

    def tier_fits(self, tier: str, nbytes: int, lo: int, hi: int) -> bool:
        """Whether ``tier`` can hold ``nbytes`` more over ops ``lo..hi`` (inclusive)."""
        cap = self.hw.tiers[tier].capacity_bytes
        if cap is None:
            return True
        held = np.cumsum(self.held[tier])[lo : hi + 1]
        return bool(held.size == 0 or held.max() + nbytes <= cap)

    def hold(self, tier: str, nbytes: int, lo: int, hi: int) -> None:
        if tier in self.held:
            self.held[tier][lo] += nbytes
            self.held[tier][hi + 1] -= nbytes

    def place(self, c: Candidate, tier: str, excess: np.ndarray) -> _Placement | None:
        """The stall-free placement (in nominal time) of candidate ``c`` on ``tier``, or None."""
        lt, nf = self.lt, self.lt.num_fwd_ops
        t = self.hw.tiers[tier]
        nbytes = c.nbytes
        w_us = t.write_s(nbytes) * 1e6
        r_us = t.read_s(nbytes) * 1e6
        # Earliest op k >= producer whose end finds the write channel free for the whole write.
        wch = self.channel(tier, "write")
        # Channels only fill up, so an op end found blocked before stays blocked: resume the search
        # where the last one for this tensor and tier stopped (the same answer, without re-walking).
        k = self.resume.get((c.name, tier, "write"), c.producer_idx)
        write = None
        while k < nf:
            a = self.end_us[k]
            blk = wch.blocker(a, a + w_us)
            if blk is None:
                write = (a, a + w_us)
                break
            k = bisect_left(self.end_us, wch.ends[blk] - _EPS_US, lo=k + 1)
        self.resume[c.name, tier, "write"] = k
        if write is None:
            return None
        # The write must be complete before an op j in (max(k, last_fwd), nf].
        j = max(k, c.last_fwd_use_idx) + 1
        j = max(j, bisect_left(self.start_us, write[1] - _EPS_US, lo=j))
        if j > nf or (j < lt.num_ops and self.start_us[j] < write[1] - _EPS_US):
            return None
        # Latest backward op p <= first use whose start finds the read channel free and the read done in time.
        rch = self.channel(tier, "read")
        first = c.first_bwd_use_idx
        deadline = self.start_us[first]
        p = min(first, bisect_right(self.start_us, deadline - r_us + _EPS_US) - 1)
        p = min(p, self.resume.get((c.name, tier, "read"), p))
        read = None
        while p >= max(nf, j):
            a = self.start_us[p]
            if a < write[1] - _EPS_US:
                break
            blk = rch.blocker(a, a + r_us)
            if blk is None:
                read = (a, a + r_us)
                break
            p = min(p - 1, bisect_right(self.start_us, rch.starts[blk] - r_us + _EPS_US) - 1)
        if read is not None:
            self.resume[c.name, tier, "read"] = p
        if read is None or p <= j:
            return None
        if not self.tier_fits(tier, nbytes, k + 1, first):
            return None
        gain = float(np.minimum(excess[j:p], nbytes) @ self.dur_us[j:p])
        return _Placement(tier, k, j, p, write, read, gain / max(w_us + r_us, _EPS_US))

    def best_placement(self, c: Candidate, excess: np.ndarray) -> _Placement | None:
        best = None
        for tier in self.tiers:
            pl = self.place(c, tier, excess)
            if pl is not None and (best is None or pl.benefit > best.benefit):
                best = pl
        return best

    def commit(self, c: Candidate, pl: _Placement) -> Decision:
        self.channel(pl.tier, "write").reserve(*pl.write_us)
        self.channel(pl.tier, "read").reserve(*pl.read_us)
        self.mem[pl.wait_before_idx : pl.prefetch_before_idx] -= c.nbytes
        self.hold(pl.tier, c.nbytes, pl.offload_after_idx + 1, c.first_bwd_use_idx)
        return self.lt.decision(
            c.name,
            tier=pl.tier,
            offload_after_idx=pl.offload_after_idx,
            wait_before_idx=pl.wait_before_idx,
            prefetch_before_idx=pl.prefetch_before_idx,
        )


def _phase1(state: _State, cands: dict[str, Candidate], problem: Problem) -> dict[str, Decision]:
    """TERAIO Algorithm 1 with a lazy priority queue (benefits never rise as picks accumulate)."""
    chosen: dict[str, Decision] = {}
    excess = state.excess()
    total0 = float(excess @ state.dur_us) or 1.0
    heap: list[tuple[float, int, str]] = []
    for seq, (name, c) in enumerate(cands.items()):
        pl = state.best_placement(c, excess)
        if pl is not None and pl.benefit > 0:
            heap.append((-pl.benefit, seq, name))
    heapq.heapify(heap)
    while heap and excess.any():
        _, seq, name = heapq.heappop(heap)
        pl = state.best_placement(cands[name], excess)
        if pl is None or pl.benefit <= 0:
            continue
        if heap and pl.benefit < -heap[0][0] * (1 - 1e-12):
            heapq.heappush(heap, (-pl.benefit, seq, name))  # stale: someone else may be better now
            continue
        chosen[name] = state.commit(cands[name], pl)
        excess = state.excess()
        problem.report(0.8 * (1 - float(excess @ state.dur_us) / total0), f"greedy: {len(chosen)} moved")
    return chosen


def _phase2(
    state: _State, cands: dict[str, Candidate], chosen: dict[str, Decision], tier: str
) -> tuple[dict[str, Decision], int]:
    """Repair: make tensors absent at over-budget ops until none is left (stall accepted).

    Ops in the order of the module docstring (at most two repairs per candidate); each repair scores
    every option at once with numpy (one pass over the candidates), so a repair costs O(candidates + ops).
    Returns the decisions and the number of repairs.
    """
    lt, nf = state.lt, state.lt.num_fwd_ops
    mem = lt.memory_with(list(chosen.values()))
    names = list(cands)
    rows = [cands[x] for x in names]
    nbytes = np.array([c.nbytes for c in rows], dtype=np.int64)
    prod = np.array([c.producer_idx for c in rows], dtype=np.int64)
    first = np.array([c.first_bwd_use_idx for c in rows], dtype=np.int64)
    starts = np.array([c.inactive_start_idx for c in rows], dtype=np.int64)
    ends = np.array([c.inactive_end_idx for c in rows], dtype=np.int64)
    name_rank = np.argsort(np.argsort(np.array(names, dtype=object)))
    # The current window of every candidate; a candidate not moved has an empty one.
    moved = np.array([x in chosen for x in names], dtype=bool)
    off = np.array([chosen[x].offload_after_idx if x in chosen else -1 for x in names], dtype=np.int64)
    wait = np.array([chosen[x].wait_before_idx if x in chosen else 0 for x in names], dtype=np.int64)
    pref = np.array([chosen[x].prefetch_before_idx if x in chosen else 0 for x in names], dtype=np.int64)
    tier_of = [chosen[x].tier if x in chosen else tier for x in names]
    w_us = np.array([state.hw.tiers[t].write_s(int(b)) * 1e6 for t, b in zip(tier_of, nbytes)])
    r_us = np.array([state.hw.tiers[t].read_s(int(b)) * 1e6 for t, b in zip(tier_of, nbytes)])
    start_us = np.asarray(state.start_us)
    end_us = np.asarray(state.end_us)
    repaired = 0
    while True:
        over = mem - state.budget
        # Outside in (module docstring): repairs only lower memory, so the earliest over-budget forward
        # op only moves later and the latest over-budget backward op only earlier.
        bad = np.flatnonzero(over > 0)
        if not bad.size:
            return chosen, repaired
        i = int(bad[0]) if bad[0] < nf else int(bad[-1])
        need = int(over[i])
        ok = (starts <= i) & (ends >= i) & ~(moved & (wait <= i) & (i < pref))
        idx = np.nonzero(ok)[0]
        if not idx.size:
            raise AssertionError(f"op {i} over budget with nothing left to move (floor check missed it)")
        is_new = ~moved[idx]
        fi = min(i, nf)
        # The smallest window change that makes each option absent at op i, and its nominal stall
        # (queues ignored): a write must end before the wait, a read before the first use.
        o = np.where(is_new, prod[idx], np.minimum(off[idx], np.maximum(prod[idx], fi - 1)))
        wt = np.where(is_new, fi, np.minimum(wait[idx], fi))
        pr = np.where(is_new, max(i + 1, nf), np.maximum(pref[idx], i + 1))
        stall = np.maximum(w_us[idx] - (start_us[wt] - end_us[o]), 0.0) + np.maximum(
            r_us[idx] - (start_us[first[idx]] - start_us[pr]), 0.0
        )
        # Least stall, then no new I/O, then best fit: the smallest tensor covering the excess, else
        # the largest.
        b = nbytes[idx]
        covers = b >= need
        pick = int(np.lexsort((name_rank[idx], np.where(covers, b, -b), ~covers, is_new, stall))[0])
        j = int(idx[pick])
        c = rows[j]
        if is_new[pick]:
            new = lt.decision(names[j], tier=tier, wait_before_idx=fi, prefetch_before_idx=max(i + 1, nf))
            # The fastest tier with room for the copy, else the default tier.
            for t in sorted(
                state.tiers,
                key=lambda t: state.hw.tiers[t].write_s(c.nbytes) + state.hw.tiers[t].read_s(c.nbytes),
            ):
                if state.tier_fits(t, c.nbytes, new.offload_after_idx + 1, new.fetch_before_idx):
                    new = dataclasses.replace(new, tier=t)
                    break
            state.hold(new.tier, c.nbytes, new.offload_after_idx + 1, new.fetch_before_idx)
            w_us[j] = state.hw.tiers[new.tier].write_s(c.nbytes) * 1e6
            r_us[j] = state.hw.tiers[new.tier].read_s(c.nbytes) * 1e6
        else:
            new = lt.decision(
                names[j],
                tier=chosen[names[j]].tier,
                offload_after_idx=int(o[pick]),
                wait_before_idx=int(wt[pick]),
                prefetch_before_idx=int(pr[pick]),
            )
            mem[wait[j] : pref[j]] += nbytes[j]
        chosen[names[j]] = new
        moved[j] = True
        off[j], wait[j], pref[j] = new.offload_after_idx, new.wait_before_idx, new.prefetch_before_idx
        mem[wait[j] : pref[j]] -= nbytes[j]
        repaired += 1


def _phase3(lt: Lifetimes, chosen: dict[str, Decision], budget: int) -> tuple[list[Decision], int]:
    """Drop moves the budget does not need (last picked first), then wait as late as allowed."""
    nf = lt.num_fwd_ops
    mem = lt.memory_with(list(chosen.values()))
    dropped = 0
    for name in reversed(list(chosen)):
        d = chosen[name]
        lo, hi = d.wait_before_idx, d.prefetch_before_idx
        if hi <= lo or (mem[lo:hi] + d.nbytes).max() <= budget:
            mem[lo:hi] += d.nbytes
            del chosen[name]
            dropped += 1
    out = []
    for d in sorted(chosen.values(), key=lambda d: d.wait_before_idx):
        wait = d.wait_before_idx
        while wait < nf and mem[wait] + d.nbytes <= budget:
            mem[wait] += d.nbytes
            wait += 1
        if wait >= d.prefetch_before_idx:
            continue  # absent nowhere any more: moving it would only cost I/O
        out.append(
            d
            if wait == d.wait_before_idx
            else lt.decision(
                d.name,
                tier=d.tier,
                offload_after_idx=d.offload_after_idx,
                wait_before_idx=wait,
                prefetch_before_idx=d.prefetch_before_idx,
                fetch_before_idx=d.fetch_before_idx,
            )
        )
    # Plan order breaks FIFO ties: reads issued together go most urgent first.
    out.sort(key=lambda d: (d.prefetch_before_idx, d.fetch_before_idx, d.offload_after_idx, d.name))
    return out, dropped


def greedy_decisions(problem: Problem, budget: int) -> tuple[list[Decision], dict]:
    """The greedy plan's decisions for ``budget`` bytes, and counters for the solver stats."""
    lt = problem.lifetimes
    state = _State(problem, budget)
    cand_rows = lt.candidate_list
    # Only tensors that could be away at some over-budget op can help.
    over = lt.baseline_memory_bytes > budget
    over_cum = np.concatenate([[0], np.cumsum(over)])
    cands = {
        c.name: c for c in cand_rows if over_cum[c.inactive_end_idx + 1] > over_cum[c.inactive_start_idx]
    }
    chosen = _phase1(state, cands, problem)
    phase1 = len(chosen)
    chosen, repaired = _phase2(state, cands, chosen, problem.default_tier)
    decisions, dropped = _phase3(lt, chosen, budget)
    return decisions, {"phase1_moves": phase1, "repairs": repaired, "dropped": dropped}


@register_solver("greedy")
def solve_greedy(problem: Problem) -> Plan:
    """TERAIO's Algorithm 1 with a stall-accepting repair pass (see the module docstring).

    With ``budget_bytes is None`` it plans for the smallest achievable peak (``solve`` handles "auto"
    by bisecting over budgets instead).
    """
    t0 = time.perf_counter()
    lt = problem.lifetimes
    budget = problem.budget_bytes if problem.budget_bytes is not None else lt.min_feasible_peak_bytes
    decisions, extra = greedy_decisions(problem, budget)
    problem.report(1.0, f"greedy: {len(decisions)} moved")
    stats = SolverStats(solver="greedy", status="HEURISTIC", wall_s=time.perf_counter() - t0, extra=extra)
    return make_plan(problem, decisions, stats)
