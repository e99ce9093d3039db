"""The execution model in one place: the offload candidate, the transfer channels, and the replay of a plan.

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
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
    """A saved tensor that may be offloaded: idle from ``last_fwd_use_idx + 1`` to ``first_bwd_use_idx - 1``."""

    name: str
    nbytes: int
    producer_idx: int
    last_fwd_use_idx: int
    first_bwd_use_idx: int
    last_use_idx: int
    module: str = ""

    @property
    def inactive_start_idx(self) -> int:
        """The first op at which the tensor may be absent (its write waited before it)."""
        return self.last_fwd_use_idx + 1

    @property
    def inactive_end_idx(self) -> int:
        """The last op at which the tensor may be absent (inclusive)."""
        return self.first_bwd_use_idx - 1


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
) -> Replay:
    """Run ``decisions`` through the execution model (module docstring) on ops of ``duration``.

    Args:
        decisions: checked decisions (every index in range, every tier in ``hardware``).
        duration: per-op compute time, in any unit; ``transfer`` and ``cpu_cost`` must use the same.
        transfer: duration of one transfer; default the tier's ``write_s`` / ``read_s`` (seconds).
        cpu_cost: compute lost to one transfer; default ``nbytes * cpu_s_per_byte`` (seconds).
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

    writes_after: dict[int, list[int]] = defaultdict(list)
    reads_before: dict[int, list[int]] = defaultdict(list)
    for k in queue_order(decisions, "write"):
        writes_after[decisions[k].offload_after_idx].append(k)
    for k in queue_order(decisions, "read"):
        reads_before[decisions[k].prefetch_before_idx].append(k)
    waits_before: dict[int, list[int]] = defaultdict(list)
    fetches_before: dict[int, list[int]] = defaultdict(list)
    for k, d in enumerate(decisions):
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
        for k in reads_before.get(i, ()):
            out.r_issue[k], out.r_issue_idx[k] = ready, i
            out.r_start[k], out.r_end[k] = issue(k, "read", ready)
        start = ready
        for k in fetches_before.get(i, ()):
            start = max(start, out.r_end[k])
        out.stall[i] = start - t
        win_end = start + duration[i]
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
        out.interference[i] = charged
        out.op_start[i] = start
        t = out.op_end[i] = win_end + charged
        for k in writes_after.get(i, ()):
            out.w_issue[k], out.w_issue_idx[k] = t, i
            out.w_start[k], out.w_end[k] = issue(k, "write", t)
    return out
