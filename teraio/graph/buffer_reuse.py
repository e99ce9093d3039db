"""Inductor's buffer reuse in a graph with migration ops: never across one.

Note: [A dead buffer is not kept across a migration op]
    Inductor's wrapper does not always free a buffer after its last reader: it pools it, and a later
    allocation of the same size, device and dtype takes the pooled buffer instead of fresh memory, so the
    dead buffer stays alive until then. It accepts such a reuse when its own estimate of the graph's peak
    says the held bytes do not raise the peak (``AllocateLine.should_reuse_buffer``). That estimate sees
    the buffers of the graph's IR only: a ``teraio::prefetch`` returns a one-element token while the
    runtime holds the whole tensor it reads from then on, and a ``teraio::fetch`` returns the tensor. So in
    a planned graph Inductor makes reuses the unplanned kernels never made, holding a dead buffer across
    the prefetches that fill the memory the plan freed for them (for instance a dead attention-sized
    buffer kept for a tensor the plan rebuilds several segments later). The plan was priced on the unplanned
    kernels' timeline, where that buffer was freed, so the step peaks above its prediction by the buffer
    (benchmarks/results/vs_torch_budget_2c24g-virtio_202611.md). So in a graph that holds
    migration ops, a pooled buffer is reused only by an allocation with no migration op between its free
    and that allocation; across one it is freed where Inductor would have pooled it and the allocation takes
    fresh memory. A refused reuse never raises the memory at any point: a reuse only keeps a dead buffer
    alive longer, and the allocation's bytes are the same either way. Graphs without migration
    ops (every compile that is not a teraio plan's) keep Inductor's own rule.

    Inductor offers no hook for this, so its method is wrapped, once per process, at teraio's first Inductor
    compile. When this torch lacks the method (a version that moved it), nothing is wrapped, a warning says
    so, and the measured step (which compares its peak with the prediction) is what remains.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("teraio")

#: The namespace of teraio's migration ops (teraio.graph.ops).
MIGRATION_NAMESPACE = "teraio"

_INSTALL_LOCK = threading.Lock()
_installed = False


def _is_migration_op(scheduler_node: Any) -> bool:
    op = getattr(getattr(scheduler_node, "node", None), "op_overload", None)
    return getattr(op, "namespace", None) == MIGRATION_NAMESPACE


def _migration_ops_before(nodes: list[Any]) -> list[int]:
    """For each index i: how many migration ops come before node i (a prefix count, len(nodes) + 1)."""
    counts = [0]
    for n in nodes:
        counts.append(counts[-1] + (1 if _is_migration_op(n) else 0))
    return counts


class _PrefixCache:
    """The prefix counts of the scheduler being generated (one graph at a time per thread: Inductor's
    virtualized state is thread-local)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def counts(self, nodes: list[Any]) -> list[int]:
        cached = getattr(self._local, "entry", None)
        if cached is None or cached[0] is not nodes or len(cached[1]) != len(nodes) + 1:
            cached = (nodes, _migration_ops_before(nodes))
            self._local.entry = cached
        return cached[1]


_CACHE = _PrefixCache()


def migration_op_between(nodes: list[Any], free_index: int, alloc_index: int) -> bool:
    """Whether a migration op sits strictly between scheduler nodes ``free_index`` and ``alloc_index``."""
    if alloc_index - free_index <= 1:
        return False
    counts = _CACHE.counts(nodes)
    return counts[alloc_index] - counts[free_index + 1] > 0


def _wrap(original: Callable[..., bool]) -> Callable[..., bool]:
    from torch._inductor.virtualized import V

    def should_reuse_buffer(self: Any, free_line: Any, size: int) -> bool:
        freed_at = getattr(free_line, "scheduler_node_index", None)
        allocated_at = getattr(self, "scheduler_node_index", None)
        if not getattr(self, "comm_buffer", False) and freed_at is not None and allocated_at is not None:
            if migration_op_between(V.graph.scheduler.nodes, freed_at, allocated_at):
                return False
        return original(self, free_line, size)

    return should_reuse_buffer


def install() -> bool:
    """Wrap Inductor's reuse rule (Note: [A dead buffer is not kept across a migration op]); idempotent.
    Returns whether the rule is in place."""
    global _installed
    with _INSTALL_LOCK:
        if _installed:
            return True
        try:
            from torch._inductor.codegen.wrapper import AllocateLine
        except ImportError:  # pragma: no cover - a torch without Inductor's Python wrapper
            AllocateLine = None  # noqa: N806
        original = getattr(AllocateLine, "should_reuse_buffer", None)
        if original is None:
            log.warning(
                "this torch's Inductor has no AllocateLine.should_reuse_buffer: a planned graph may hold a dead "
                "buffer across a migration op; the measured step peak shows it"
            )
            return False
        AllocateLine.should_reuse_buffer = _wrap(original)
        _installed = True
        return True
