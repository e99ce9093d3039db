"""A lower bound on the step time of every plan: the bandwidth-window bound.

Solvers report how far a plan may be from the best possible one (``lower_bound_s`` and ``gap`` in a plan's
solver stats). CP-SAT's own bound never sees bandwidth in its relaxation, so on its own it says "compute
time" and the gap means nothing; this module computes a bound that does, from the profile alone.

The argument, for an op ``k`` whose unplanned memory exceeds the budget by ``E_k`` bytes:

- Writes. Bytes away at ``k`` were written before op ``min(k, nf)`` started (``nf`` = number of forward
  ops; every write is waited by the end of forward), each after its producer ended. For a cut-off op
  ``a``, at least ``E_k`` minus the bytes of the candidates idle at ``k`` produced before ``a`` must be
  written between the end of op ``a`` and the start of op ``min(k, nf)``: on a channel of total write
  bandwidth ``W`` that takes ``need / W``, so the stall and CPU interference in that window are at
  least ``need / W`` minus the compute time inside it.
- Reads, alike. Bytes away at ``k`` are read after op ``max(k + 1, nf)`` is reached and before their
  first backward use. For a cut-off op ``f``, the bytes away at ``k`` first used at or before ``f`` must
  be read between those two points at total read bandwidth ``R``.
- Windows that share no op boundary add up (stall and interference inside one cannot serve another), so
  the best set of disjoint windows (weighted interval scheduling) bounds the step's overhead.

Valid for any plan on any tier mix (bandwidths of all available tiers are summed, latencies dropped);
:func:`bandwidth_windows` also gives the strongest window per op, which the exact solver adds as cuts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from teraio.planner.hardware import HardwareModel
from teraio.planner.lifetimes import Lifetimes

#: The interval scheduling runs on at most this many boundary cells (windows are widened to cell edges,
#: which keeps the bound valid): 12k-op profiles stay cheap.
MAX_CELLS = 1500


@dataclass(frozen=True)
class Window:
    """Between the end of op ``after_idx`` and the start of op ``before_idx``, ``nbytes`` must move in
    ``direction``; at ``bw_bytes_per_s`` that takes ``min_s``, ``overhead_s`` more than the compute in it."""

    direction: str
    after_idx: int
    before_idx: int
    nbytes: int
    min_s: float
    overhead_s: float


@dataclass(frozen=True)
class StepBound:
    """The bound: ``compute_s + overhead_s``; ``windows`` are the disjoint windows that prove it."""

    compute_s: float
    overhead_s: float
    windows: tuple[Window, ...]

    @property
    def step_s(self) -> float:
        return self.compute_s + self.overhead_s


def _bandwidths(hardware: HardwareModel) -> tuple[float, float]:
    tiers = [hardware.tier(t) for t in hardware.available_tiers()]
    return (
        sum(t.total_write_bw_bytes_per_s for t in tiers),
        sum(t.total_read_bw_bytes_per_s for t in tiers),
    )


def bandwidth_windows(lt: Lifetimes, hardware: HardwareModel, budget_bytes: int) -> list[Window]:
    """Per over-budget op, its strongest write window and its strongest read window (positive only)."""
    return [w for w in _all_windows(lt, hardware, budget_bytes, best_only=True)]


def _all_windows(lt: Lifetimes, hardware: HardwareModel, budget_bytes: int, *, best_only: bool):
    """Yield windows (see the module docstring); with ``best_only`` the best of each kind per op, else
    arrays ``(direction, after_idx array, before_idx array, overhead array)`` per op."""
    n, nf = lt.num_ops, lt.num_fwd_ops
    w_bw, r_bw = _bandwidths(hardware)
    cands = lt.candidate_list
    if not n or not cands or w_bw <= 0 or r_bw <= 0:
        return
    dur = lt.duration_us / 1e6
    start = np.concatenate([[0.0], np.cumsum(dur)[:-1]])
    end = start + dur
    excess = np.maximum(lt.baseline_memory_bytes.astype(np.float64) - budget_bytes, 0.0)
    nbytes = np.array([c.nbytes for c in cands], dtype=np.float64)
    prod = np.array([c.producer_idx for c in cands])
    first = np.array([c.first_bwd_use_idx for c in cands])
    lo = np.array([c.inactive_start_idx for c in cands])
    hi = np.array([c.inactive_end_idx for c in cands])
    for k in np.nonzero(excess > 0)[0]:
        k = int(k)
        idle = (lo <= k) & (k <= hi)
        if not idle.any():
            continue
        e = excess[k]
        # Writes: cut-off a in [0, dl); bytes produced before a may have been written earlier.
        dl = min(k, nf)
        if dl >= 1:
            before = np.concatenate([[0.0], np.cumsum(np.bincount(prod[idle], nbytes[idle], minlength=n))])
            a = np.arange(dl)
            need = e - before[a]  # produced at or after a (before[a] = produced before a)
            gap = start[dl] - end[a]
            over = need / w_bw - gap
            yield from _emit("write", a, np.full(dl, dl), need, w_bw, over, best_only)
        # Reads: issued from boundary st on; fetched before op f in [st, n).
        st = max(k + 1, nf)
        if st < n:
            later = np.bincount(first[idle], nbytes[idle], minlength=n + 1)
            after_f = np.cumsum(later[::-1])[::-1]  # after_f[f] = bytes first used at or after f
            f = np.arange(st, n)
            need = e - after_f[f + 1]
            gap = start[f] - end[st - 1]
            over = need / r_bw - gap
            yield from _emit("read", np.full(f.size, st - 1), f, need, r_bw, over, best_only)


def _emit(direction, after, before, need, bw, over, best_only):
    pos = over > 1e-12
    if not pos.any():
        return
    if best_only:
        i = int(np.argmax(over))
        yield Window(
            direction, int(after[i]), int(before[i]), int(need[i]), float(need[i] / bw), float(over[i])
        )
        return
    yield direction, after[pos], before[pos], need[pos], over[pos]


def step_lower_bound(lt: Lifetimes, hardware: HardwareModel, budget_bytes: int | None) -> StepBound:
    """The bandwidth-window lower bound on any plan's step time (see the module docstring).

    ``budget_bytes is None`` ("auto": no stall by definition) and budgets at or above the unplanned peak
    give compute time.
    """
    compute_s = float(lt.duration_us.sum()) / 1e6
    if budget_bytes is None or budget_bytes >= lt.baseline_peak_bytes:
        return StepBound(compute_s, 0.0, ())
    n = lt.num_ops
    # Window [after+1 .. before] of op boundaries; cells widen it to [cell edges] (still valid).
    cell = max(1, math.ceil(n / MAX_CELLS))
    g = n // cell + 2
    weight = np.zeros((g, g))
    for _, after, before, _, over in _all_windows(lt, hardware, budget_bytes, best_only=False):
        # The state before a window: boundaries <= after are free; after it: boundaries <= before used.
        np.maximum.at(weight, (after // cell, -(-before // cell)), over)
    best = np.zeros(g)
    choice: list[tuple[int, int] | None] = [None] * g
    for c in range(1, g):
        cand = best[:c] + weight[:c, c]
        j = int(np.argmax(cand))
        if cand[j] > best[c - 1]:
            best[c], choice[c] = cand[j], (j, c)
        else:
            best[c], choice[c] = best[c - 1], None
    chosen: set[tuple[int, int]] = set()
    c = g - 1
    while c > 0:
        if choice[c] is None:
            c -= 1
            continue
        chosen.add(choice[c])
        c = choice[c][0]
    # A second pass names the window behind each chosen cell pair (for reports and tests).
    windows: dict[tuple[int, int], Window] = {}
    w_bw, r_bw = _bandwidths(hardware)
    for direction, after, before, need, over in _all_windows(lt, hardware, budget_bytes, best_only=False):
        for key in chosen - windows.keys():
            hit = np.nonzero(
                (after // cell == key[0]) & (-(-before // cell) == key[1]) & (over >= weight[key])
            )[0]
            if hit.size:
                i = int(hit[0])
                bw = w_bw if direction == "write" else r_bw
                windows[key] = Window(
                    direction,
                    int(after[i]),
                    int(before[i]),
                    int(need[i]),
                    float(need[i] / bw),
                    float(over[i]),
                )
    return StepBound(compute_s, float(best[-1]), tuple(windows[k] for k in sorted(windows)))
