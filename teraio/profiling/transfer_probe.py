"""Price a transfer under the model's own compute: calibration steps that also move pages.

Note: [Pricing transfers under the model's own compute]
On a CPU-only step the time a transfer costs is mostly contention: the compute thread's calls into the
migration ops, and the I/O threads taking cores from torch's intra-op threads (Note: [A transfer's CPU on a
CPU-only step] in teraio.profiling.disk_calibration). How much depends on the compute around it, and blocks of
synthetic ops price it only roughly: their figure moves from one calibration to the next far more than a
plan's measured overhead does (benchmarks/results/demo_2c24g-virtio_202611.md). So where it can, the backend
prices moving tensors on the profiled graph itself. After the calibration steps, ``PROBE_STEPS`` more
alternate between the graph as it is and a copy whose FX code also makes page round trips through the same
``teraio::`` ops a plan calls, spread over the forward (offload, then its wait half a slot later) and the
backward (prefetch, then its fetch). The probed steps alternate between three variants, because the price has
three parts. One round trip of a page and ``MIN_ROUND_TRIPS`` or more separate a part per transfer from a part
per step: a step's first transfer costs more than the next ones (it wakes the I/O path), so a step making one
round trip pays more per transfer than one making several. The larger count again with pages of
``BYTES_PAGE_NBYTES`` adds a part per byte (the I/O threads' copies and checksums taking a core from the
step), which the built-in model otherwise takes from the demo model's megabyte tensors. The median extra time
of each variant over the plain step just before it gives three points, and they give the planner the three
parts of the price: ``cpu_s_per_transfer``, ``cpu_s_per_step_with_io`` and ``cpu_s_per_byte``. It needs the
graph's own Python code (the FX-only path: an Inductor-compiled graph has no place to call from) and a step
short enough that a few dozen round trips show above the step's noise; elsewhere the synthetic blocks stand.
The pages are the probe's own: the model's tensors, its RNG and its statistics are untouched, so a probed step
computes exactly what a plain one does, and the plain steps between the probed ones calibrate the op times as
before (Note: [Calibrated times] in teraio.profiling.op_timing).
"""

from __future__ import annotations

import itertools
import statistics
import threading
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import torch
from torch import fx

from teraio.runtime.errors import DiskIOError

PAGE_NBYTES = 4096
#: The page of the per-byte variant: about the saved tensors of the graphs that are probed (short steps:
#: the tiny GPT's are 64-260 KiB), and enough bytes at the larger round-trip count for a cost of 0.1 ns
#: per byte to show as 0.2 ms above a step's noise.
BYTES_PAGE_NBYTES = 256 << 10
#: The larger probe's round trips per step are chosen so it adds about this share to the step, at the
#: prior price below: enough to stand above a step's noise, not so many that they queue behind each other.
TARGET_SHARE = 0.25
#: The price assumed when sizing a probe (its order on the machines measured; the probe then measures
#: the real one).
PRIOR_S_PER_TRANSFER = 250e-6
#: The larger probe makes at least this many round trips per step: far enough from the smaller one
#: (one) for the line through the two to have a slope, and as many as a plan worth making moves.
MIN_ROUND_TRIPS = 4
#: Above this many round trips the step is long enough that a transfer's CPU barely matters to its time
#: (and the probe would be lost in the step's noise): the synthetic calibration is used.
MAX_ROUND_TRIPS = 64
#: Probed steps per variant, each paired with the plain step before it: a step of a few milliseconds
#: varies by a tenth from one to the next, and the first probed step of a process is often slow, so
#: each variant's figure is the median of this many differences.
PROBE_PAIRS = 8
#: Calibration steps a probe adds: per variant (three), PROBE_PAIRS probed steps, each after a plain
#: one (the first pairs with the last plain calibration step).
PROBE_STEPS = 2 * 3 * PROBE_PAIRS - 1

#: A probe page carries its mark at every this many float32 elements (one per 4 KiB): what the fetch
#: checks, besides the runtime's own checksums.
_MARK_STRIDE = PAGE_NBYTES // 4

_PROBES: dict[int, TransferProbe] = {}
_PROBE_IDS = itertools.count(1)
_LOCK = threading.Lock()


class ProbeOp(IntEnum):
    """What a probe hook in the graph does (an int in the graph: FX prints it as a literal)."""

    OFFLOAD = 0
    WAIT = 1
    PREFETCH = 2
    FETCH = 3


def probe_hook(probe_id: int, op: int, index: int, page_nbytes: int = PAGE_NBYTES) -> None:
    """Called by a probed graph's inserted nodes; returns nothing the graph uses. A closed probe's
    hooks do nothing (a probed step can be under way when the backend closes)."""
    probe = _PROBES.get(probe_id)
    if probe is not None:
        probe.step(ProbeOp(op), index, page_nbytes)


@dataclass(frozen=True)
class ProbeVariant:
    """What one kind of probed step moves: ``round_trips`` pages of ``page_nbytes``, each offload waited
    on (and each prefetch fetched) ``gap_slots`` of a slot later (a slot: the graph's compute split in
    ``round_trips``)."""

    round_trips: int
    page_nbytes: int = PAGE_NBYTES
    gap_slots: float = 0.5

    @property
    def label(self) -> str:
        return f"{self.round_trips} x {self.page_nbytes >> 10} KiB"


def probe_variants(round_trips: int) -> tuple[ProbeVariant, ProbeVariant, ProbeVariant]:
    """The three variants of a probe whose larger count is ``round_trips``. The per-byte one waits a
    whole slot: a page of ``BYTES_PAGE_NBYTES`` can take as long to write as half a slot of a short
    step's forward, and a wait that stalls would price the stall as CPU (the planner models stalls
    from the bandwidths)."""
    return (
        ProbeVariant(1),
        ProbeVariant(round_trips),
        ProbeVariant(round_trips, BYTES_PAGE_NBYTES, gap_slots=1.0),
    )


def round_trips_for(plain_step_s: float) -> int | None:
    """Round trips per probed step for a graph whose plain step takes ``plain_step_s``; None: too long to
    probe."""
    n = max(MIN_ROUND_TRIPS, round(TARGET_SHARE * plain_step_s / (2 * PRIOR_S_PER_TRANSFER)))
    return n if n <= MAX_ROUND_TRIPS else None


def _compute_nodes(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op not in ("placeholder", "output", "get_attr")]


def _with_hooks(
    gm: fx.GraphModule, probe_id: int, ops: tuple[ProbeOp, ProbeOp], variant: ProbeVariant
) -> fx.GraphModule:
    """A copy of ``gm`` that calls ``probe_hook`` for round trip i: ``ops[0]`` at the start of slot i and
    ``ops[1]`` ``variant.gap_slots`` of a slot later, the graph's compute nodes split in
    ``variant.round_trips`` slots (a wait a whole slot after the last slot's start: before returning)."""
    nodes = len(_compute_nodes(gm.graph))
    n = variant.round_trips
    at: dict[int, list[tuple[ProbeOp, int]]] = {}
    for i in range(n):
        at.setdefault(i * nodes // n, []).append((ops[0], i))
        at.setdefault(int((i + variant.gap_slots) * nodes / n), []).append((ops[1], i))
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    position = 0
    for node in gm.graph.nodes:
        if node.op == "output":  # what is left (a graph without compute nodes): before returning
            for p in sorted(at):
                for op, i in at[p]:
                    graph.call_function(probe_hook, (probe_id, int(op), i, variant.page_nbytes))
            at.clear()
        env[node] = graph.node_copy(node, lambda n: env[n])
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        for op, i in at.pop(position, []):  # after the node: the slot's compute is under way
            graph.call_function(probe_hook, (probe_id, int(op), i, variant.page_nbytes))
        position += 1
    return fx.GraphModule(gm, graph)


@dataclass
class ProbeStep:
    """One calibration step seen by a probe: its variant (1-based in the probe's ``variants``; 0:
    plain), seconds in the graphs, and outside them when measured."""

    variant: int
    inside_s: float
    outside_s: float | None = None

    def total_s(self, with_outside: bool) -> float:
        if with_outside and self.outside_s is not None:
            return self.inside_s + self.outside_s
        return self.inside_s


@dataclass(frozen=True)
class TransferPrice:
    """What moving tensors costs a step, measured: per transfer (one direction), once per step that
    moves anything, and per byte moved (the planner's ``cpu_s_per_transfer``, ``cpu_s_per_step_with_io``
    and ``cpu_s_per_byte``)."""

    per_transfer_s: float
    per_step_s: float
    per_byte_s: float


@dataclass
class TransferProbe:
    """Page round trips made by a graph's probed calibration steps, and the price they measure.

    Probed steps alternate between the ``variants`` (:func:`probe_variants`): two counts of small
    pages separate a part per transfer from a part per step, and the larger count with large pages
    adds a part per byte (three variants, three unknowns).
    """

    engine_id: int
    variants: tuple[ProbeVariant, ...]
    #: The calibration steps in order: the plain step before the probe began, then probed and plain
    #: steps alternating.
    steps: list[ProbeStep] = field(default_factory=list)
    probe_id: int = 0
    closed: bool = False
    _pages: dict[int, torch.Tensor] = field(default_factory=dict)
    _handles: dict[int, Any] = field(default_factory=dict)
    _tokens: dict[int, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        with _LOCK:
            self.probe_id = next(_PROBE_IDS)
            _PROBES[self.probe_id] = self

    def close(self) -> None:
        """Forget the probe (its tokens die with it, and with them its pages on disk)."""
        with _LOCK:
            _PROBES.pop(self.probe_id, None)
        self.closed = True
        self._reset()

    def probed(
        self, fw_gm: fx.GraphModule, bw_gm: fx.GraphModule, variant: int
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        """Copies of the forward and backward graphs that also make the round trips of ``variant``
        (1-based)."""
        v = self.variants[variant - 1]
        return (
            _with_hooks(fw_gm, self.probe_id, (ProbeOp.OFFLOAD, ProbeOp.WAIT), v),
            _with_hooks(bw_gm, self.probe_id, (ProbeOp.PREFETCH, ProbeOp.FETCH), v),
        )

    # ---------------------------------------------------------------------------------- the steps
    def record(self, variant: int, inside_s: float) -> None:
        self.steps.append(ProbeStep(variant, inside_s))

    def record_outside(self, outside_s: float) -> None:
        """The time outside the graphs of the step recorded last (teraio.lifecycle.outside_time)."""
        if self.steps:
            self.steps[-1].outside_s = outside_s

    @property
    def next_variant(self) -> int:
        """The variant of the next calibration step (0: plain). Plain and probed steps alternate, and
        the probed ones take the variant with fewest pairs so far (a loop that calls the graph twice
        before a backward makes two probed steps in a row, which only the first of them pairs)."""
        if not self.steps or self.steps[-1].variant:
            return 0
        diffs = self.differences_s()
        return min(range(1, len(self.variants) + 1), key=lambda v: len(diffs.get(v, [])))

    def complete(self) -> bool:
        """Every variant has its pairs."""
        diffs = self.differences_s()
        return all(len(diffs.get(v, [])) >= PROBE_PAIRS for v in range(1, len(self.variants) + 1))

    def done(self) -> bool:
        """Nothing more to measure: complete, or closed early (the backend closed)."""
        return self.closed or self.complete()

    def differences_s(self) -> dict[int, list[float]]:
        """Per variant (1-based), per probed step, how much longer it took than the plain step just
        before it. The outside time counts when both steps have it: the I/O a probe starts can slow the
        code between the graphs."""
        out: dict[int, list[float]] = {}
        for before, probed in itertools.pairwise(self.steps):
            if probed.variant and not before.variant:
                outside = probed.outside_s is not None and before.outside_s is not None
                diff = probed.total_s(outside) - before.total_s(outside)
                out.setdefault(probed.variant, []).append(diff)
        return out

    def estimate(self) -> TransferPrice | None:
        """The price, from the median paired difference of each variant. The two counts of small
        pages give a line (transfers per step, extra seconds); where noise tilts it (a negative part),
        the larger count's difference per transfer alone. The large pages' difference over the small
        ones at the same count gives the part per byte, none where noise makes it negative. None before
        the pairs are done, or when the step's noise hid the probe."""
        if not self.complete():
            return None
        diffs = self.differences_s()
        d = {v: statistics.median(diffs[v]) for v in diffs}
        small = sorted(
            (2 * self.variants[v - 1].round_trips, d[v], self.variants[v - 1].page_nbytes)
            for v in d
            if self.variants[v - 1].page_nbytes == PAGE_NBYTES
        )
        large = [
            (2 * self.variants[v - 1].round_trips, d[v], self.variants[v - 1].page_nbytes)
            for v in d
            if self.variants[v - 1].page_nbytes != PAGE_NBYTES
        ]
        (n1, d1, _), (n2, d2, _) = small
        if d2 <= 0:
            return None
        per_byte = 0.0
        for n3, d3, nbytes in large:
            same = [dd for nn, dd, _ in small if nn == n3]
            if same:
                per_byte = max(0.0, (d3 - same[0]) / (n3 * (nbytes - PAGE_NBYTES)))
        # The small pages' own bytes are priced per byte; the rest of their cost is per transfer.
        d1, d2 = d1 - n1 * PAGE_NBYTES * per_byte, d2 - n2 * PAGE_NBYTES * per_byte
        per_transfer = (d2 - d1) / (n2 - n1)
        per_step = d1 - n1 * per_transfer
        if per_transfer <= 0 or per_step < 0:
            return TransferPrice(max(d2, 0.0) / n2, 0.0, per_byte)
        return TransferPrice(per_transfer, per_step, per_byte)

    # -------------------------------------------------------------------------------- the hooks
    def _reset(self) -> None:
        # Tokens own their keys (Note: [Every invocation owns its bytes] in teraio.graph.ops): dropping them
        # releases a round trip a forward started and no backward finished.
        self._pages.clear()
        self._handles.clear()
        self._tokens.clear()

    def step(self, op: ProbeOp, i: int, page_nbytes: int = PAGE_NBYTES) -> None:
        ops = torch.ops.teraio
        key, eid = f"probe{self.probe_id}/{i}", self.engine_id
        if op is ProbeOp.OFFLOAD:
            if i == 0:
                self._reset()
            # Marked once per 4 KiB, not filled: the compute thread's own work must not grow with the
            # page (a plan's tensors are already computed), or it would be priced as the transfer's.
            # The rest is what the allocator handed out, this process's own memory, written to the
            # engine's own files (owner-only, removed when the probe's engine closes).
            page = torch.empty(page_nbytes // 4)
            page[::_MARK_STRIDE] = float(i + 1)
            self._pages[i] = page
            self._handles[i] = ops.offload(page, [], key, eid, [1])
        elif op is ProbeOp.WAIT:
            # The page's only reference goes: the prefetch must read the file, as a plan's does.
            self._tokens[i] = ops.wait_write(self._handles.pop(i), self._pages.pop(i), [], key, eid)
        elif op is ProbeOp.PREFETCH:
            token = self._tokens.pop(i, None)
            if token is not None:  # None: this backward's forward was not probed
                self._tokens[i] = ops.prefetch(token, [], key, eid)
        else:
            token = self._tokens.pop(i, None)
            if token is not None:
                back = ops.fetch(token, [], key, eid, page_nbytes // 4, torch.float32, torch.device("cpu"))
                if not bool((back[::_MARK_STRIDE] == float(i + 1)).all()):
                    raise DiskIOError(
                        f"teraio transfer probe: page {key!r} came back different from what was written "
                        "to the offload directory; check the disk, or pass hardware=None to skip probing"
                    )
