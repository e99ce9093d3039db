"""Price a transfer under the model's own compute: calibration steps that also move pages.

Note: [Pricing transfers under the model's own compute]
On a CPU-only step the time a transfer costs is mostly contention: the compute thread's calls into
the migration ops, and the I/O threads taking cores from torch's intra-op threads (Note: [A transfer's
CPU on a CPU-only step] in teraio.calibrate). How much depends on the compute around it, and blocks of
synthetic ops price it only roughly: on the built-in tiny GPT their figure moved by a factor of 1.7
from one calibration to the next while one plan's measured overhead held within a few percent
(benchmarks/results/demo_2c24g-virtio_202611.md, session 8). So where it can, the backend prices
moving tensors on the profiled graph itself. After the calibration steps, ``PROBE_STEPS`` more
alternate between the graph as it is and a copy whose FX code also makes page round trips through the
same ``teraio::`` ops a plan calls, spread over the forward (offload, then its wait half a slot later)
and the backward (prefetch, then its fetch). The probed steps alternate between two sizes, one round
trip and ``MIN_ROUND_TRIPS`` or more, because a step's first transfer costs more than the next ones
(it wakes the I/O path): a step making one round trip paid about twice per transfer what one making
four did. The median extra time of each size over the plain step just before it gives two points,
and the line through them gives the planner both parts of the price: per transfer
(``cpu_s_per_transfer``) and once per step that moves anything (``cpu_s_per_step_with_io``). It needs
the graph's own Python code (the FX-only path: an Inductor-compiled graph has no place to call from)
and a step short enough that a few dozen round trips show above the step's noise; elsewhere the
synthetic blocks stand. The pages are the probe's own: the model's tensors, its RNG and its
statistics are untouched, so a probed step computes exactly what a plain one does, and the plain
steps between the probed ones calibrate the op times as before (Note: [Calibrated times] in
teraio.profiler).
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
#: Probed steps per size, each paired with the plain step before it: a step of a few milliseconds
#: varies by a tenth from one to the next, and the first probed step of a process is often slow, so
#: each size's figure is the median of this many differences.
PROBE_PAIRS = 8
#: Calibration steps a probe adds: per size, PROBE_PAIRS probed steps, each after a plain one (the
#: first pairs with the last plain calibration step).
PROBE_STEPS = 2 * 2 * PROBE_PAIRS - 1

_PROBES: dict[int, TransferProbe] = {}
_PROBE_IDS = itertools.count(1)
_LOCK = threading.Lock()


class ProbeOp(IntEnum):
    """What a probe hook in the graph does (an int in the graph: FX prints it as a literal)."""

    OFFLOAD = 0
    WAIT = 1
    PREFETCH = 2
    FETCH = 3


def probe_hook(probe_id: int, op: int, index: int) -> None:
    """Called by a probed graph's inserted nodes; returns nothing the graph uses. A closed probe's
    hooks do nothing (a probed step can be under way when the backend closes)."""
    probe = _PROBES.get(probe_id)
    if probe is not None:
        probe.step(ProbeOp(op), index)


def round_trips_for(plain_step_s: float) -> int | None:
    """Round trips per probed step for a graph whose plain step takes ``plain_step_s``; None: too long to
    probe."""
    n = max(MIN_ROUND_TRIPS, round(TARGET_SHARE * plain_step_s / (2 * PRIOR_S_PER_TRANSFER)))
    return n if n <= MAX_ROUND_TRIPS else None


def _compute_nodes(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op not in ("placeholder", "output", "get_attr")]


def _with_hooks(
    gm: fx.GraphModule, probe_id: int, ops: tuple[ProbeOp, ProbeOp], round_trips: int
) -> fx.GraphModule:
    """A copy of ``gm`` that calls ``probe_hook`` for round trip i: ``ops[0]`` at the start of slot i and
    ``ops[1]`` half a slot later, the graph's compute nodes split in ``round_trips`` slots."""
    slots = len(_compute_nodes(gm.graph))
    at: dict[int, list[tuple[ProbeOp, int]]] = {}
    for i in range(round_trips):
        at.setdefault(i * slots // round_trips, []).append((ops[0], i))
        at.setdefault((2 * i + 1) * slots // (2 * round_trips), []).append((ops[1], i))
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    position = 0
    for node in gm.graph.nodes:
        if node.op == "output":  # what is left (a graph without compute nodes): before returning
            for p in sorted(at):
                for op, i in at[p]:
                    graph.call_function(probe_hook, (probe_id, int(op), i))
            at.clear()
        env[node] = graph.node_copy(node, lambda n: env[n])
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        for op, i in at.pop(position, []):  # after the node: the slot's compute is under way
            graph.call_function(probe_hook, (probe_id, int(op), i))
        position += 1
    return fx.GraphModule(gm, graph)


@dataclass
class ProbeStep:
    """One calibration step seen by a probe: its round trips (0: plain), seconds in the graphs, and
    outside them when measured."""

    round_trips: int
    inside_s: float
    outside_s: float | None = None

    def total_s(self, with_outside: bool) -> float:
        if with_outside and self.outside_s is not None:
            return self.inside_s + self.outside_s
        return self.inside_s


@dataclass(frozen=True)
class TransferPrice:
    """What moving tensors costs a step, measured: per transfer (one direction), and once per step that
    moves anything (the planner's ``cpu_s_per_transfer`` and ``cpu_s_per_step_with_io``)."""

    per_transfer_s: float
    per_step_s: float


@dataclass
class TransferProbe:
    """Page round trips made by a graph's probed calibration steps, and the price they measure.

    Probed steps alternate between ``sizes`` round trips, so the price separates into a part per
    transfer and a part per step (two sizes, two unknowns).
    """

    engine_id: int
    sizes: tuple[int, int]
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
        self, fw_gm: fx.GraphModule, bw_gm: fx.GraphModule, round_trips: int
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        """Copies of the forward and backward graphs that also make ``round_trips`` round trips."""
        return (
            _with_hooks(fw_gm, self.probe_id, (ProbeOp.OFFLOAD, ProbeOp.WAIT), round_trips),
            _with_hooks(bw_gm, self.probe_id, (ProbeOp.PREFETCH, ProbeOp.FETCH), round_trips),
        )

    # ---------------------------------------------------------------------------------- the steps
    def record(self, round_trips: int, inside_s: float) -> None:
        self.steps.append(ProbeStep(round_trips, inside_s))

    def record_outside(self, outside_s: float) -> None:
        """The time outside the graphs of the step recorded last (teraio.outside)."""
        if self.steps:
            self.steps[-1].outside_s = outside_s

    @property
    def next_round_trips(self) -> int:
        """The round trips of the next calibration step (0: plain). Plain and probed steps alternate,
        and the probed ones take the size with fewer pairs so far (a loop that calls the graph twice
        before a backward makes two probed steps in a row, which only the first of them pairs)."""
        if not self.steps or self.steps[-1].round_trips:
            return 0
        diffs = self.differences_s()
        return min(self.sizes, key=lambda n: len(diffs.get(n, [])))

    def complete(self) -> bool:
        """Every size has its pairs."""
        diffs = self.differences_s()
        return all(len(diffs.get(n, [])) >= PROBE_PAIRS for n in self.sizes)

    def done(self) -> bool:
        """Nothing more to measure: complete, or closed early (the backend closed)."""
        return self.closed or self.complete()

    def differences_s(self) -> dict[int, list[float]]:
        """Per size, per probed step, how much longer it took than the plain step just before it. The
        outside time counts when both steps have it: the I/O a probe starts can slow the code between
        the graphs."""
        out: dict[int, list[float]] = {}
        for before, probed in itertools.pairwise(self.steps):
            if probed.round_trips and not before.round_trips:
                outside = probed.outside_s is not None and before.outside_s is not None
                diff = probed.total_s(outside) - before.total_s(outside)
                out.setdefault(probed.round_trips, []).append(diff)
        return out

    def estimate(self) -> TransferPrice | None:
        """The price, from the median paired difference of each size: the line through the two points
        (transfers per step, extra seconds). Where noise tilts that line (a negative part), the larger
        size's difference per transfer alone. None before the pairs are done, or when the step's noise
        hid the probe."""
        if not self.complete():
            return None
        diffs = self.differences_s()
        (n1, d1), (n2, d2) = sorted((2 * n, statistics.median(diffs[n])) for n in self.sizes)
        if d2 <= 0:
            return None
        per_transfer = (d2 - d1) / (n2 - n1)
        per_step = d1 - n1 * per_transfer
        if per_transfer <= 0 or per_step < 0:
            return TransferPrice(d2 / n2, 0.0)
        return TransferPrice(per_transfer, per_step)

    # -------------------------------------------------------------------------------- the hooks
    def _reset(self) -> None:
        # Tokens own their keys (Note: [Every invocation owns its bytes] in teraio.ops): dropping them
        # releases a round trip a forward started and no backward finished.
        self._pages.clear()
        self._handles.clear()
        self._tokens.clear()

    def step(self, op: ProbeOp, i: int) -> None:
        ops = torch.ops.teraio
        key, eid = f"probe{self.probe_id}/{i}", self.engine_id
        if op is ProbeOp.OFFLOAD:
            if i == 0:
                self._reset()
            page = torch.full((PAGE_NBYTES // 4,), float(i + 1))
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
                back = ops.fetch(token, [], key, eid, PAGE_NBYTES // 4, torch.float32, torch.device("cpu"))
                if not bool((back == float(i + 1)).all()):
                    raise DiskIOError(
                        f"teraio transfer probe: page {key!r} came back different from what was written "
                        "to the offload directory; check the disk, or pass hardware=None to skip probing"
                    )
