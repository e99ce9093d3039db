"""The execution model in one place: the candidate, the transfer channels, the effective needs of rebuilt
tensors, and the replay of a plan.

The simulator, the exact solver (its warm start and its check of its own plans) and the heuristics all
need to know when each op runs and each transfer moves under a given set of decisions. They all call
:func:`replay`; nothing else encodes the event loop.

Execution model (what the runtime does, what every solver assumes):

- Ops run in index order. At the boundary before op ``i`` (time ``t`` = end of op ``i-1``), in order:
  (1) wait for every write with ``wait_before_idx == i``; (2) issue every read with
  ``prefetch_before_idx == i``; (3) wait for every read with ``fetch_before_idx == i``. Op ``i`` starts
  when all of that is done; the delay after ``t`` is op ``i``'s stall. Waiting before issuing guarantees
  a read issued at the same boundary as its own wait starts after the write completed.
- A write is issued when op ``offload_after_idx`` ends.
- Transfers run on FIFO channels (:func:`channel_key`): per tier one write queue and one read queue, or a
  single queue when the tier's ``shared_channel`` is set. Transfers issued at the same moment enter their
  queue in ``write_rank`` / ``read_rank`` order (the plan's queue orders; see ``planner.plan``). A
  transfer takes ``latency + nbytes / (bw * count)``.
- CPU interference: a transfer costs ``nbytes * cpu_s_per_byte`` of compute, charged to the ops it
  overlaps in proportion to the overlap (measured against each op's nominal duration window). Overlap
  with a stall is free: the compute thread is idle then.
- Waking the I/O path: the first migration call of a step on a tier also costs that tier's
  ``cpu_s_per_step_with_io``, once, in the same place as the call.
- Migration calls: each transfer also costs its tier's ``cpu_s_per_transfer`` on the compute thread,
  where the graph calls the ops: a write's after op ``offload_after_idx`` (the write is issued when the
  call ends, and the next op starts after it), a read's at its prefetch boundary, after the waits of (1)
  (the read is issued when its call ends, the op starts after every call). It counts in the op's
  ``interference``, never as stall.

Recompute (a decision with ``action == "recompute"``; plan schema 3):

- (4) After (1)-(3) at the boundary before op ``i``, the rebuilds of every recompute decision with
  ``fetch_before_idx == i`` run, inputs before the tensors that read them (:attr:`EffectiveNeeds.order`),
  each taking its ``recompute_us`` of compute; then op ``i`` starts. The rebuilds and op ``i`` form one
  compute window: CPU interference from transfers is charged to it as to an op, and a stall happens only
  before it (waits come first).
- Memory: a recomputed tensor is absent from ``wait_before_idx`` through ``fetch_before_idx - 1`` (it is
  dropped before op ``wait_before_idx``, rebuilt before op ``fetch_before_idx``). The rebuilds before
  op ``i`` are counted with op ``i``: its memory plus the largest ``recompute_peak_bytes`` among them
  (their intermediates). This counts every tensor rebuilt at ``i`` and op ``i``'s own temporaries at
  once, which is never less than the memory at any moment of the rebuilds: conservative.
- Effective needs (chains, :func:`effective_needs`): a rebuild reads its ``recompute_inputs``. An
  activation input ``X`` of a recomputed ``T`` must be resident when ``T`` is rebuilt, so its effective
  first backward need is ``f(X) = min(first_bwd_use_idx(X), f(T))`` and its effective last use is
  ``max(last_use_idx(X), f(T))``; a recomputed tensor's own ``f`` is where it is rebuilt. An offloaded
  ``X`` is fetched by ``f(X)``; a recomputed ``X`` is rebuilt at ``f(X)`` (before ``T`` when equal); a
  kept ``X`` stays resident through its effective last use, which may extend its lifetime past the
  profile's. Param and input rows are always resident.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from teraio.planner.hardware import HardwareModel
from teraio.planner.plan import Decision, queue_order

Direction = Literal["write", "read"]
ChannelKey = tuple[str, str]


def channel_key(hardware: HardwareModel, tier: str, direction: Direction) -> ChannelKey:
    """The FIFO queue a transfer of ``direction`` to ``tier`` waits in: ``(tier, "rw")`` when the tier's
    reads and writes share one channel, else ``(tier, direction)``."""
    return (tier, "rw") if hardware.tier(tier).shared_channel else (tier, direction)


@dataclass(frozen=True, slots=True)
class Candidate:
    """A saved tensor that may be offloaded (or recomputed, when ``recomputable``): idle from
    ``last_fwd_use_idx + 1`` to ``first_bwd_use_idx - 1``."""

    name: str
    nbytes: int
    producer_idx: int
    last_fwd_use_idx: int
    first_bwd_use_idx: int
    last_use_idx: int
    module: str = ""
    #: Compute time to rebuild it in backward; NaN when it cannot be recomputed.
    recompute_us: float = math.nan
    #: Rows its rebuild reads (activations must be resident then; params and inputs always are).
    recompute_inputs: tuple[str, ...] = ()
    #: Bytes the rebuild holds beyond its inputs and its result.
    recompute_peak_bytes: int = 0

    @property
    def recomputable(self) -> bool:
        return math.isfinite(self.recompute_us)

    @property
    def inactive_start_idx(self) -> int:
        """The first op at which the tensor may be absent (its write waited before it)."""
        return self.last_fwd_use_idx + 1

    @property
    def inactive_end_idx(self) -> int:
        """The last op at which the tensor may be absent (inclusive)."""
        return self.first_bwd_use_idx - 1


@dataclass(frozen=True)
class TensorUse:
    """What the effective needs of a chain need to know of one activation row."""

    nbytes: int
    producer_idx: int
    #: -1 when backward never reads it.
    first_bwd_use_idx: int
    #: The last op it is alive at without any plan.
    last_use_idx: int


@dataclass(frozen=True)
class EffectiveNeeds:
    """Where a set of recomputed tensors makes tensors needed (see the module docstring).

    ``first_need_idx`` holds every recomputed tensor (the op before which it is rebuilt) and every
    activation input of one (the op by which it must be resident); ``last_use_idx`` only the tensors whose
    lifetime a rebuild extends past the profile's. ``order`` lists the recomputed tensors in rebuild order
    (by ``first_need_idx``, inputs first). ``cycle`` names tensors whose rebuilds need each other (a
    profile that passed validation has none); they are left out of everything else.
    """

    first_need_idx: dict[str, int]
    last_use_idx: dict[str, int]
    order: tuple[str, ...]
    cycle: tuple[str, ...] = ()
    #: Recomputed tensor -> the activation inputs its rebuild reads.
    inputs: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def need(self, name: str, default: int) -> int:
        return self.first_need_idx.get(name, default)


def effective_needs(recomputed: Iterable[Candidate], uses: Mapping[str, TensorUse]) -> EffectiveNeeds:
    """The effective needs of ``recomputed`` (module docstring): the one place chains are resolved, used by
    the simulator, the solvers and the bounds.

    Args:
        recomputed: the candidates rebuilt in backward.
        uses: every activation row by name; names not in it (params, inputs) are always resident.
    """
    rec = {c.name: c for c in recomputed}
    inputs = {
        t: tuple(dict.fromkeys(x for x in c.recompute_inputs if x in uses and x != t)) for t, c in rec.items()
    }
    # consumers[x] = recomputed tensors whose rebuild reads x.
    consumers: dict[str, list[str]] = defaultdict(list)
    for t, xs in inputs.items():
        for x in xs:
            consumers[x].append(t)
    # Kahn's algorithm from the readers down to their inputs: a tensor's need is final once every
    # recomputed reader's is. Ties go by name so the order is deterministic.
    pending = {t: sum(1 for c in consumers.get(t, ()) if c in rec) for t in rec}
    ready = [t for t, k in pending.items() if k == 0]
    heapq.heapify(ready)
    topo: list[str] = []
    need: dict[str, int] = {}
    while ready:
        t = heapq.heappop(ready)
        topo.append(t)
        readers = [need[c] for c in consumers.get(t, ()) if c in need]
        fbu = rec[t].first_bwd_use_idx
        need[t] = min([fbu, *readers]) if fbu >= 0 else min(readers, default=fbu)
        for x in inputs[t]:
            if x in rec:
                pending[x] -= 1
                if pending[x] == 0:
                    heapq.heappush(ready, x)
    cycle = tuple(sorted(t for t in rec if t not in need))
    last: dict[str, int] = {}
    for x, readers in consumers.items():
        at = [need[c] for c in readers if c in need]
        if not at:
            continue
        u = uses[x]
        if x not in rec:
            need[x] = min(at) if u.first_bwd_use_idx < 0 else min(u.first_bwd_use_idx, *at)
        if max(at) > u.last_use_idx:
            last[x] = max(at)
    # Rebuild order: by the op they are rebuilt before; at one op, inputs first (reverse topological).
    rank = {t: k for k, t in enumerate(reversed(topo))}
    order = tuple(sorted((t for t in topo), key=lambda t: (need[t], rank[t])))
    return EffectiveNeeds(
        first_need_idx=need,
        last_use_idx=last,
        order=order,
        cycle=cycle,
        inputs={t: inputs[t] for t in topo},
    )


@dataclass
class Replay:
    """When every op and transfer ran. Per-decision arrays follow the order of the decisions replayed."""

    op_start: np.ndarray
    op_end: np.ndarray
    #: When the boundary before each op is done waiting for writes (and issues its reads).
    ready: np.ndarray
    stall: np.ndarray
    interference: np.ndarray
    w_issue: np.ndarray
    w_start: np.ndarray
    w_end: np.ndarray
    r_issue: np.ndarray
    r_start: np.ndarray
    r_end: np.ndarray
    w_issue_idx: np.ndarray
    r_issue_idx: np.ndarray
    #: Compute of the rebuilds before each op (they start when its boundary's waits are done).
    rebuild: np.ndarray | None = None

    @property
    def step(self) -> float:
        return float(self.op_end[-1]) if len(self.op_end) else 0.0


def replay(
    decisions: Sequence[Decision],
    hardware: HardwareModel,
    duration: np.ndarray,
    *,
    transfer: Callable[[Decision, Direction], float] | None = None,
    cpu_cost: Callable[[Decision], float] | None = None,
    rebuild: np.ndarray | None = None,
    call_cost: Callable[[Decision], float] | None = None,
    step_cost: Callable[[str], float] | None = None,
) -> Replay:
    """Run ``decisions`` through the execution model (module docstring) on ops of ``duration``.

    Args:
        decisions: checked decisions (every index in range, every tier in ``hardware``). Recompute
            decisions move nothing: their compute comes in through ``rebuild``.
        duration: per-op compute time, in any unit; ``transfer``, ``cpu_cost`` and ``rebuild`` must use
            the same.
        transfer: duration of one transfer; default the tier's ``write_s`` / ``read_s`` (seconds).
        cpu_cost: compute lost to one transfer while it runs; default ``nbytes * cpu_s_per_byte`` (seconds).
        call_cost: compute-thread time of one transfer's migration calls; default the tier's
            ``cpu_s_per_transfer`` (seconds).
        step_cost: compute time of a step's first migration call on a tier; default the tier's
            ``cpu_s_per_step_with_io`` (seconds).
        rebuild: per op, the compute of the rebuilds before it (:func:`rebuild_time`); None: no rebuilds.
    """
    n = len(duration)
    m = len(decisions)
    if transfer is None:

        def transfer(d: Decision, direction: Direction) -> float:
            t = hardware.tier(d.tier)
            return t.write_s(d.nbytes) if direction == "write" else t.read_s(d.nbytes)

    if cpu_cost is None:

        def cpu_cost(d: Decision) -> float:
            return d.nbytes * hardware.tier(d.tier).cpu_s_per_byte

    if call_cost is None:

        def call_cost(d: Decision) -> float:
            return hardware.tier(d.tier).cpu_s_per_transfer

    if step_cost is None:

        def step_cost(tier: str) -> float:
            return hardware.tier(tier).cpu_s_per_step_with_io

    woken: set[str] = set()

    def calls_of(d: Decision) -> float:
        """The calls of one transfer, and the step's wake-up of its tier's I/O path if it is the first."""
        if d.tier in woken:
            return call_cost(d)
        woken.add(d.tier)
        return call_cost(d) + step_cost(d.tier)

    writes_after: dict[int, list[int]] = defaultdict(list)
    reads_before: dict[int, list[int]] = defaultdict(list)
    for k in queue_order(decisions, "write"):
        writes_after[decisions[k].offload_after_idx].append(k)
    for k in queue_order(decisions, "read"):
        reads_before[decisions[k].prefetch_before_idx].append(k)
    waits_before: dict[int, list[int]] = defaultdict(list)
    fetches_before: dict[int, list[int]] = defaultdict(list)
    for k, d in enumerate(decisions):
        if d.action != "offload":
            continue
        waits_before[d.wait_before_idx].append(k)
        fetches_before[d.fetch_before_idx].append(k)

    out = Replay(
        op_start=np.zeros(n),
        op_end=np.zeros(n),
        ready=np.zeros(n),
        stall=np.zeros(n),
        interference=np.zeros(n),
        w_issue=np.full(m, np.nan),
        w_start=np.full(m, np.nan),
        w_end=np.full(m, np.nan),
        r_issue=np.full(m, np.nan),
        r_start=np.full(m, np.nan),
        r_end=np.full(m, np.nan),
        w_issue_idx=np.full(m, -1),
        r_issue_idx=np.full(m, -1),
        rebuild=None if rebuild is None else np.asarray(rebuild, dtype=np.float64),
    )
    free: dict[ChannelKey, float] = defaultdict(float)
    # Per channel, transfers not yet fully charged for CPU interference: (start, end, cost).
    in_flight: dict[ChannelKey, deque[tuple[float, float, float]]] = defaultdict(deque)

    def issue(k: int, direction: Direction, at: float) -> tuple[float, float]:
        d = decisions[k]
        ch = channel_key(hardware, d.tier, direction)
        start = max(at, free[ch])
        end = start + transfer(d, direction)
        free[ch] = end
        cost = cpu_cost(d)
        if cost > 0 and end > start:
            in_flight[ch].append((start, end, cost))
        return start, end

    t = 0.0
    for i in range(n):
        ready = t
        for k in waits_before.get(i, ()):
            ready = max(ready, out.w_end[k])
        out.ready[i] = ready
        calls = 0.0  # the prefetch calls before op i (module docstring: migration calls)
        for k in reads_before.get(i, ()):
            calls += calls_of(decisions[k])
            out.r_issue[k], out.r_issue_idx[k] = ready + calls, i
            out.r_start[k], out.r_end[k] = issue(k, "read", ready + calls)
        start = ready + calls
        for k in fetches_before.get(i, ()):
            start = max(start, out.r_end[k])
        # Never below zero: with nothing to wait for, start - t - calls can come out a rounding error
        # under it, which would show as a negative stall in a plan.
        out.stall[i] = max(0.0, start - (t + calls))
        # The rebuilds and the op are one compute window (module docstring); written as start + (rebuild +
        # duration) so a replay of ops whose durations already include the rebuilds ends on the same bits.
        rb = 0.0 if rebuild is None else float(rebuild[i])
        win_end = start + (rb + duration[i]) if rb else start + duration[i]
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
        out.op_start[i] = start + rb
        t = out.op_end[i] = win_end + charged
        for k in writes_after.get(i, ()):
            call = calls_of(decisions[k])
            calls += call
            t = out.op_end[i] = t + call
            out.w_issue[k], out.w_issue_idx[k] = t, i
            out.w_start[k], out.w_end[k] = issue(k, "write", t)
        out.interference[i] = charged + calls
    return out


def rebuild_time(decisions: Sequence[Decision], num_ops: int) -> np.ndarray:
    """Per op, the ``recompute_us`` of the recompute decisions rebuilt before it, in microseconds."""
    out = np.zeros(num_ops)
    for d in decisions:
        if d.action == "recompute" and 0 <= d.fetch_before_idx < num_ops:
            out[d.fetch_before_idx] += d.recompute_us
    return out
