"""Price a transfer under the model's own compute: calibration steps that also move pages.

Note: [Pricing transfers under the model's own compute]
On a CPU-only step the time a transfer costs is mostly contention: the compute thread's calls into
the migration ops, and the I/O threads taking cores from torch's intra-op threads (Note: [A transfer's
CPU on a CPU-only step] in teraio.calibrate). How much depends on the compute around it, so blocks of
synthetic ops price it only roughly: on the built-in tiny GPT they gave 285-570 us per transfer from
one calibration to the next (in one process, the plain blocks' own time steady within 2%), while the
step's measured overhead under one plan was the same within 4% in nine runs, at about 250 us per
transfer. So where it can, the backend prices a transfer on the profiled graph itself: the calibration
steps alternate between the graph as it is and a copy that also makes ``round_trips`` round trips of
one page through the same ``teraio::`` ops a plan calls, spread over the forward (offload, then its
wait half a slot later) and the backward (prefetch, then its fetch). The extra time of those steps
over the plain ones, per transfer, is the price (``TransferProbe.estimate``). It needs the graph's own
Python code (the FX-only path: an Inductor-compiled graph has no place to call from) and a step short
enough that a few dozen round trips show above the step's noise; elsewhere the synthetic blocks stand.
The pages are the probe's own: the model's tensors, its RNG and its statistics are untouched, so a
probed step computes exactly what a plain one does.
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
#: Round trips per probed step are chosen so the probe adds about this share to the step, at the prior
#: price below: enough to stand above a step's noise, not so many that they queue behind each other.
TARGET_SHARE = 0.25
#: The price assumed when sizing a probe (the order of what this machine measured; the probe then
#: measures the real one).
PRIOR_S_PER_TRANSFER = 250e-6
#: At least this many round trips per probed step: the price of a transfer falls as a step makes more
#: of them (the first wakes the I/O threads; on the tiny GPT one round trip per step priced a transfer
#: at 660-700 us, two at about 400, four at 315-330), and a plan worth making moves several.
MIN_ROUND_TRIPS = 4
#: Above this many round trips the step is long enough that a transfer's CPU barely matters to its time
#: (and the probe would be lost in the step's noise): the synthetic calibration is used.
MAX_ROUND_TRIPS = 64
#: Probed steps, each paired with the plain step before it: a step of a few milliseconds varies by a
#: tenth from one to the next, and the first probed step of a process is often slow, so the price is
#: the median of this many differences.
PROBE_PAIRS = 8

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
    """Called by a probed graph's inserted nodes; returns nothing the graph uses."""
    _PROBES[probe_id].step(ProbeOp(op), index)


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
    """One calibration step seen by a probe: seconds in the graphs, and outside them when measured."""

    probed: bool
    inside_s: float
    outside_s: float | None = None

    def total_s(self, with_outside: bool) -> float:
        return self.inside_s + (self.outside_s or 0.0 if with_outside else 0.0)


@dataclass
class TransferProbe:
    """Page round trips made by a graph's probed calibration steps, and the price they measure."""

    engine_id: int
    round_trips: int
    #: The calibration steps in order: the plain step before the probe began, then probed and plain
    #: steps alternating.
    steps: list[ProbeStep] = field(default_factory=list)
    probe_id: int = 0
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
        self._reset()

    def probed(self, fw_gm: fx.GraphModule, bw_gm: fx.GraphModule) -> tuple[fx.GraphModule, fx.GraphModule]:
        """Copies of the forward and backward graphs that also make this probe's round trips."""
        n = self.round_trips
        return (
            _with_hooks(fw_gm, self.probe_id, (ProbeOp.OFFLOAD, ProbeOp.WAIT), n),
            _with_hooks(bw_gm, self.probe_id, (ProbeOp.PREFETCH, ProbeOp.FETCH), n),
        )

    # ---------------------------------------------------------------------------------- the steps
    def record(self, probed: bool, inside_s: float) -> None:
        self.steps.append(ProbeStep(probed, inside_s))

    def record_outside(self, outside_s: float) -> None:
        """The time outside the graphs of the step recorded last (teraio.outside)."""
        if self.steps:
            self.steps[-1].outside_s = outside_s

    @property
    def steps_probed(self) -> int:
        return sum(s.probed for s in self.steps)

    @property
    def next_probed(self) -> bool:
        """Whether the next calibration step probes: they alternate, from a plain one."""
        return bool(self.steps) and not self.steps[-1].probed

    def done(self) -> bool:
        return self.steps_probed >= PROBE_PAIRS

    def differences_s(self) -> list[float]:
        """Per probed step, how much longer it took than the plain step just before it. The outside
        time counts when both steps have it: the I/O a probe starts can slow the code between the graphs."""
        out = []
        for before, probed in itertools.pairwise(self.steps):
            if probed.probed and not before.probed:
                outside = probed.outside_s is not None and before.outside_s is not None
                out.append(probed.total_s(outside) - before.total_s(outside))
        return out

    def estimate(self) -> float | None:
        """Seconds one transfer (one direction) adds to the step: the median of the paired differences,
        per transfer. None before the pairs are done, or when the step's noise hid the probe."""
        diffs = self.differences_s()
        if len(diffs) < PROBE_PAIRS:
            return None
        extra_s = statistics.median(diffs)
        return extra_s / (2 * self.round_trips) if extra_s > 0 else None

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
