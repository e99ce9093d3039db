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

With recompute (``recompute="only"`` or ``"joint"``), bytes can also be freed by rebuilding them, at
compute cost instead of I/O. Write ``X = step - compute`` = rebuilds + stall + interference, ``R`` the
recomputed set, ``c_T`` a rebuild's time and ``b_T`` its bytes.

- Only (no I/O): ``X = sum c_T``, and at every op ``k`` the recomputed tensors idle at ``k`` must cover
  ``E_k`` (extended inputs and intermediates only add memory). So ``X >= max_k K_k(E_k)``, ``K_k`` the
  fractional knapsack: the cheapest rebuild time (per byte, cheapest first) of ``E_k`` bytes among the
  recomputable tensors idle at ``k``.
- Joint. A window's bytes to move shrink by at most the recomputed bytes idle at its op: ``need_w(R) >=
  need_w - rho_w(R)``. Rebuilds at a boundary inside a read window (after its reads are issued, before
  its fetch) add time in which I/O runs; rebuilds never lie inside a write window (its writes are waited
  before the boundary's rebuilds). With ``y_w = need_w / bw - gap_w`` and ``r_w`` the rebuild time inside
  window ``w``, the window's stall and interference are at least ``y_w(R) - r_w``, so over disjoint
  windows ``X >= sum_R c_T + sum_w (y_w - rho_w / bw - r_w)``. Every rebuild lies in at most one window,
  hence

      X >= sum_w y_w - sum_T max(0, b_T * sum_{w: T idle at k_w} 1 / bw_w - c_T * [T cannot be rebuilt
           inside any read window])                                                          (B1)

  over the windows ``w`` of the bound without recompute. Also (B2): the bound of the first part with each
  op's excess lowered by every recomputable byte idle there (recompute for free). And (B3), one op at a
  time: if the recomputed set frees ``rho`` bytes at op ``k``, then ``X >= sum c_T >= K_k(rho)``, and for
  any window ``w`` of op ``k``, ``X >= sum c_T + (y_w(R) - r_w) >= y_w - rho / bw`` (as ``r_w <= sum
  c_T``), so ``X >= min_rho max(K_k(rho), max_w y_w - rho / bw)``: increasing against decreasing in
  ``rho``, found by bisection. The joint bound is ``max(B1, B2, B3, 0)``; the CP-SAT cuts (:func:`bandwidth_windows`) stay offload-only: the exact model plans
  a residual step whose recompute set is fixed.
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
    ``direction``; at ``bw_bytes_per_s`` that takes ``min_s``, ``overhead_s`` more than the compute in it.
    ``op_idx``: the over-budget op whose excess the bytes are."""

    direction: str
    after_idx: int
    before_idx: int
    nbytes: int
    min_s: float
    overhead_s: float
    op_idx: int = -1


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


def _all_windows(
    lt: Lifetimes,
    hardware: HardwareModel,
    budget_bytes: int,
    *,
    best_only: bool,
    freed: np.ndarray | None = None,
):
    """Yield windows (see the module docstring); with ``best_only`` the best of each kind per op, else
    arrays ``(direction, after_idx array, before_idx array, need array, overhead array, op)`` per op.
    ``freed``: bytes per op that need not move (the excess is lowered by them)."""
    n, nf = lt.num_ops, lt.num_fwd_ops
    w_bw, r_bw = _bandwidths(hardware)
    cands = lt.candidate_list
    if not n or not cands or w_bw <= 0 or r_bw <= 0:
        return
    dur = lt.duration_us / 1e6
    start = np.concatenate([[0.0], np.cumsum(dur)[:-1]])
    end = start + dur
    excess = np.maximum(lt.baseline_memory_bytes.astype(np.float64) - budget_bytes, 0.0)
    if freed is not None:
        excess = np.maximum(excess - freed, 0.0)
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
            yield from _emit("write", a, np.full(dl, dl), need, w_bw, over, best_only, k)
        # Reads: issued from boundary st on; fetched before op f in [st, n).
        st = max(k + 1, nf)
        if st < n:
            later = np.bincount(first[idle], nbytes[idle], minlength=n + 1)
            after_f = np.cumsum(later[::-1])[::-1]  # after_f[f] = bytes first used at or after f
            f = np.arange(st, n)
            need = e - after_f[f + 1]
            gap = start[f] - end[st - 1]
            over = need / r_bw - gap
            yield from _emit("read", np.full(f.size, st - 1), f, need, r_bw, over, best_only, k)


def _emit(direction, after, before, need, bw, over, best_only, k):
    pos = over > 1e-12
    if not pos.any():
        return
    if best_only:
        i = int(np.argmax(over))
        yield Window(
            direction, int(after[i]), int(before[i]), int(need[i]), float(need[i] / bw), float(over[i]), k
        )
        return
    yield direction, after[pos], before[pos], need[pos], over[pos], k


def step_lower_bound(
    lt: Lifetimes, hardware: HardwareModel, budget_bytes: int | None, *, recompute: str = "off"
) -> StepBound:
    """The lower bound on any plan's step time that may use ``recompute`` ("off", "only", "joint"; see
    the module docstring).

    ``budget_bytes is None`` ("auto": no stall by definition) and budgets at or above the unplanned peak
    give compute time.
    """
    compute_s = float(lt.duration_us.sum()) / 1e6
    if budget_bytes is None or budget_bytes >= lt.baseline_peak_bytes:
        return StepBound(compute_s, 0.0, ())
    rec = lt.recomputable if recompute != "off" else ()
    if recompute == "only":
        return StepBound(compute_s, _rebuild_bound(lt, rec, budget_bytes), ())
    plain = _window_bound(lt, hardware, budget_bytes)
    if not rec:
        return plain
    # B2: recompute for free lowers each op's excess by every recomputable byte idle there.
    idle = np.zeros(lt.num_ops + 1)
    for c in rec:
        idle[c.inactive_start_idx] += c.nbytes
        idle[c.inactive_end_idx + 1] -= c.nbytes
    free = _window_bound(lt, hardware, budget_bytes, freed=np.cumsum(idle)[: lt.num_ops])
    # B1: the windows of the plain bound, less what recomputing can save in them.
    saving = 0.0
    w_bw, r_bw = _bandwidths(hardware)
    cell = _cell(lt.num_ops)
    reads = [w for w in plain.windows if w.direction == "read"]
    for c in rec:
        gain = sum(
            c.nbytes / (w_bw if w.direction == "write" else r_bw)
            for w in plain.windows
            if c.inactive_start_idx <= w.op_idx <= c.inactive_end_idx
        )
        if gain <= 0:
            continue
        # Rebuilt at a boundary in [num_fwd_ops, first use]; inside a read window its time hides I/O.
        inside = any(
            (w.after_idx // cell) * cell <= c.first_bwd_use_idx
            and lt.num_fwd_ops <= -(-w.before_idx // cell) * cell
            for w in reads
        )
        saving += max(0.0, gain - (0.0 if inside else c.recompute_us / 1e6))
    b1 = plain.overhead_s - saving
    b3 = _one_op_bound(lt, hardware, rec, budget_bytes)
    if b1 >= max(free.overhead_s, b3) and b1 > 0:
        return StepBound(compute_s, b1, plain.windows)
    if b3 > free.overhead_s:
        return StepBound(compute_s, b3, ())
    return free if free.overhead_s > 0 else StepBound(compute_s, 0.0, ())


def _one_op_bound(lt: Lifetimes, hardware: HardwareModel, rec, budget_bytes: int) -> float:
    """B3 of the module docstring: per over-budget op, the best split of its excess between rebuild time
    and the strongest window; the largest over the ops."""
    w_bw, r_bw = _bandwidths(hardware)
    best_w: dict[int, float] = {}
    best_r: dict[int, float] = {}
    for w in _all_windows(lt, hardware, budget_bytes, best_only=True):
        target = best_w if w.direction == "write" else best_r
        target[w.op_idx] = max(target.get(w.op_idx, 0.0), w.overhead_s)
    order = sorted(rec, key=lambda c: c.recompute_us / c.nbytes)
    lo = np.array([c.inactive_start_idx for c in order])
    hi = np.array([c.inactive_end_idx for c in order])
    nbytes = np.array([c.nbytes for c in order], dtype=np.float64)
    cost = np.array([c.recompute_us / 1e6 for c in order])
    out = 0.0
    for k in set(best_w) | set(best_r):
        wo, ro = best_w.get(k, 0.0), best_r.get(k, 0.0)
        idle = (lo <= k) & (k <= hi)
        cum_b = np.concatenate([[0.0], np.cumsum(nbytes[idle])])
        cum_c = np.concatenate([[0.0], np.cumsum(cost[idle])])

        def rebuild_s(rho: float, cum_b: np.ndarray = cum_b, cum_c: np.ndarray = cum_c) -> float:
            # The fractional knapsack K_k: cheapest per byte first (``order``), the last one in part.
            j = int(np.searchsorted(cum_b, rho, side="left"))
            if j == 0:
                return 0.0
            part = (rho - cum_b[j - 1]) / (cum_b[j] - cum_b[j - 1])
            return float(cum_c[j - 1] + part * (cum_c[j] - cum_c[j - 1]))

        def io_s(rho: float, wo: float = wo, ro: float = ro) -> float:
            return max(0.0, wo - rho / w_bw if w_bw > 0 else 0.0, ro - rho / r_bw if r_bw > 0 else 0.0)

        a, b = 0.0, float(cum_b[-1])
        if rebuild_s(b) < io_s(b):
            out = max(out, io_s(b))  # even every idle rebuild leaves I/O on top
            continue
        for _ in range(60):
            mid = (a + b) / 2
            if rebuild_s(mid) < io_s(mid):
                a = mid
            else:
                b = mid
        # Left of a the I/O side is at least io_s(a), right of b the rebuild side at least rebuild_s(b),
        # and between them each side is at least its value at the far end.
        out = max(out, min(io_s(a), rebuild_s(b), max(rebuild_s(a), io_s(b))))
    return out


def _rebuild_bound(lt: Lifetimes, rec, budget_bytes: int) -> float:
    """``max_k K_k(E_k)``: the cheapest rebuild time covering each op's excess (module docstring)."""
    if not rec:
        return 0.0
    excess = lt.baseline_memory_bytes.astype(np.float64) - budget_bytes
    order = sorted(rec, key=lambda c: c.recompute_us / c.nbytes)
    best = 0.0
    for k in np.nonzero(excess > 0)[0]:
        left, cost = float(excess[k]), 0.0
        for c in order:
            if c.inactive_start_idx <= k <= c.inactive_end_idx:
                take = min(1.0, left / c.nbytes)
                cost += take * c.recompute_us / 1e6
                left -= take * c.nbytes
                if left <= 0:
                    break
        best = max(best, cost)
    return best


def _cell(n: int) -> int:
    return max(1, math.ceil(n / MAX_CELLS))


def _window_bound(
    lt: Lifetimes, hardware: HardwareModel, budget_bytes: int, freed: np.ndarray | None = None
) -> StepBound:
    """The bandwidth-window bound (first part of the module docstring), excess lowered by ``freed``."""
    compute_s = float(lt.duration_us.sum()) / 1e6
    n = lt.num_ops
    # Window [after+1 .. before] of op boundaries; cells widen it to [cell edges] (still valid).
    cell = _cell(n)
    g = n // cell + 2
    weight = np.zeros((g, g))
    for _, after, before, _, over, _ in _all_windows(
        lt, hardware, budget_bytes, best_only=False, freed=freed
    ):
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
    for direction, after, before, need, over, k in _all_windows(
        lt, hardware, budget_bytes, best_only=False, freed=freed
    ):
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
                    int(k),
                )
    return StepBound(compute_s, float(best[-1]), tuple(windows[k] for k in sorted(windows)))
