"""Forward invocations in flight, and where a training step begins and ends, whatever the loop does.

A training loop calls compiled graphs in patterns teraio does not choose: one forward and its backward;
several forwards before one backward (gradient accumulation, two losses summed); a forward whose output
is never backpropagated (a validation loss computed with grad enabled); graph breaks that split one
step into several graphs. The backend needs to know, for each forward invocation, when its backward
ran or its autograd graph was freed without one, and where a *step* (what the memory budget bounds)
begins and ends.

Note: [Invocations are autograd nodes]
    AOTAutograd runs each training forward as one ``CompiledFunction`` whose backward node is the
    ``grad_fn`` of the forward's outputs. That node identifies the invocation without adding anything
    to the graphs: a hook on it fires after its backward ran; inside the compiled backward,
    ``torch._C._current_autograd_node()`` is that node (so profiling pairs each backward with its own
    forward); and a finalizer on it fires when the autograd graph is freed, with or without a
    backward. So nothing is leaked or paired wrongly when backwards are skipped or reordered. The
    finalizer only queues the news: it may run inside any lock of the process (the cyclic collector
    frees a failed step's graph wherever it runs), so the tracker's own calls take it into account
    before they do anything else, from a normal context (Note: [No lock in a finalizer or a signal
    handler] in runtime/engine.py); :meth:`StepTracker.settle` does it on demand.

A step begins at a training forward when no invocation is in flight and ends when the last in-flight
invocation has finished (backward ran, or its graph was freed). The sequence of graph calls of the last
complete step is what the budget composes (``teraio.planner.budget_split``).
"""

from __future__ import annotations

import itertools
import queue
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal

import torch

from teraio.profiling.measure import settle_profiler_barriers

#: What a call of a step is, as the planner's step composition (teraio.planner.budget_split) reads it.
CallKind = Literal["fwd", "bwd"]


class InvocationEnd(Enum):
    BACKWARD = "backward"  # its backward ran
    ABANDONED = "abandoned"  # its autograd graph was freed without a backward


@dataclass(eq=False)
class Invocation:
    """One forward call of a training graph, until its backward ran or its graph was freed."""

    id: int
    graph: Any  # the GraphRunner (opaque here)
    step: int
    end: InvocationEnd | None = None
    site: Any = None  # where the loop called it (teraio.lifecycle.discarded_forwards), set by the caller


@dataclass
class StepRecord:
    """The graph calls of one step, in order: what ran, and whether every forward got its backward."""

    index: int
    calls: list[tuple[Any, CallKind, int]] = field(default_factory=list)  # (graph, kind, invocation id)
    abandoned: int = 0
    complete: bool = False


def backward_node(outputs: Any) -> Any | None:
    """The AOTAutograd backward node of a compiled forward's outputs (None when nothing needs grad)."""
    stack = [outputs]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            if o.grad_fn is not None:
                node = o.grad_fn
                # Outputs that are views get a view-replay node on top of the CompiledFunction node.
                for _ in range(4):
                    if node is None or "CompiledFunction" in node.name():
                        return node
                    node = next((f for f, _ in node.next_functions if f is not None), None)
        elif isinstance(o, (list, tuple)):
            stack.extend(reversed(o))
        elif isinstance(o, dict):
            stack.extend(o.values())
    return None


def current_invocation_node() -> Any | None:
    """Inside a compiled backward: the autograd node being run (its forward's invocation)."""
    return torch._C._current_autograd_node()


class StepTracker:
    """Invocations in flight and step boundaries of one backend. Thread-safe: hooks and finalizers run
    on autograd's threads."""

    def __init__(
        self,
        on_step_end: Callable[[StepRecord], None] | None = None,
        on_invocation_end: Callable[[Invocation], None] | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._in_flight: dict[int, Invocation] = {}
        self._by_node: dict[int, Invocation] = {}
        self._current: StepRecord | None = None
        self._next_index = 0
        self.last_complete: StepRecord | None = None
        self.completed_steps = 0
        self._on_step_end = on_step_end
        # Called without the lock, in a backward hook or in settle(): it may only note what happened.
        self._on_invocation_end = on_invocation_end
        # Invocations whose autograd graph a finalizer saw freed, not yet accounted (settle()).
        self._freed: queue.SimpleQueue[tuple[Invocation, int]] = queue.SimpleQueue()

    @property
    def in_flight(self) -> int:
        self.settle()
        with self._lock:
            return len(self._in_flight)

    def in_flight_of(self, graph: Any) -> int:
        """How many of ``graph``'s forwards still wait for their backward (their autograd graph alive)."""
        self.settle()
        with self._lock:
            return sum(1 for inv in self._in_flight.values() if inv.graph is graph)

    @property
    def current_step(self) -> StepRecord | None:
        return self._current

    @property
    def next_step_index(self) -> int:
        """The index the next step opened will have."""
        return self._next_index

    def step_index_now(self) -> int:
        """The index of the step in progress, or of the next one between steps."""
        with self._lock:
            current = self._current
            return current.index if current is not None and not current.complete else self._next_index

    def begin_forward(self, graph: Any) -> StepRecord:
        """A training forward is about to run: opens a step when none is in flight."""
        self.settle()
        with self._lock:
            if self._current is None or self._current.complete:
                self._current = StepRecord(self._next_index)
                self._next_index += 1
            return self._current

    def end_forward(self, graph: Any, outputs: Any, site: Any = None) -> Invocation | None:
        """The forward returned: register its invocation by its backward node (None: no backward)."""
        node = backward_node(outputs)
        self.settle()
        with self._lock:
            step = self._current
            assert step is not None, "end_forward without begin_forward"
            inv = Invocation(next(self._ids), graph, step.index, site=site)
            step.calls.append((graph, "fwd", inv.id))
            if node is None:
                inv.end = InvocationEnd.ABANDONED
                step.abandoned += 1
                self._maybe_close(step)
            else:
                self._in_flight[inv.id] = inv
                self._by_node[id(node)] = inv
        if node is None:
            if self._on_invocation_end is not None:
                self._on_invocation_end(inv)
            return inv
        node.register_hook(lambda grad_inputs, grad_outputs, inv=inv: self._backward_ran(inv))
        weakref.finalize(node, self._node_freed, inv, id(node))
        return inv

    def invocation_of_current_backward(self) -> Invocation | None:
        """Inside a compiled backward: which forward invocation it belongs to."""
        node = current_invocation_node()
        if node is None:
            return None
        self.settle()
        with self._lock:
            return self._by_node.get(id(node))

    def _backward_ran(self, inv: Invocation) -> None:
        self.settle()
        # A backward runs outside the forwards' compiled frames: profiler barriers left in them go
        # (Note: [A session never ends under another session's record functions] in teraio.profiling.measure).
        settle_profiler_barriers()
        ended = False
        with self._lock:
            step = self._current
            if step is not None and step.index == inv.step:
                step.calls.append((inv.graph, "bwd", inv.id))
            if inv.end is None:
                inv.end = InvocationEnd.BACKWARD
                ended = True
                self._in_flight.pop(inv.id, None)
                if step is not None and step.index == inv.step:
                    self._maybe_close(step)
        if ended and self._on_invocation_end is not None:
            self._on_invocation_end(inv)

    def _node_freed(self, inv: Invocation, node_id: int) -> None:
        # A finalizer: queue only (Note: [Invocations are autograd nodes]). SimpleQueue.put is reentrant.
        self._freed.put((inv, node_id))

    def settle(self) -> None:
        """Account for the invocations whose autograd graph was freed since the last call (an abandoned
        forward ends there; so may its step). Call from a normal context, never from a finalizer."""
        while True:
            try:
                inv, node_id = self._freed.get_nowait()
            except queue.Empty:
                return
            ended = False
            with self._lock:
                if self._by_node.get(node_id) is inv:
                    del self._by_node[node_id]
                if inv.end is None:
                    inv.end = InvocationEnd.ABANDONED
                    ended = True
                    self._in_flight.pop(inv.id, None)
                    step = self._current
                    if step is not None and step.index == inv.step:
                        step.abandoned += 1
                        self._maybe_close(step)
            if ended and self._on_invocation_end is not None:
                self._on_invocation_end(inv)

    def _maybe_close(self, step: StepRecord) -> None:
        # Called with the lock held.
        if self._in_flight or step.complete:
            return
        step.complete = True
        self.completed_steps += 1
        if step.abandoned == 0:
            self.last_complete = step
        if self._on_step_end is not None:
            self._on_step_end(step)


def invocation_ordinals(calls: list[tuple[Any, CallKind, int]]) -> dict[int, int]:
    """Per invocation id in a step's calls: how many forwards of its graph came before it in that step.

    Note: [A graph called several times per step is planned per call] in teraio.lifecycle.step_planner: the
    ordinal picks the call's plan. ``calls`` may hold several steps one after the other (each kind of step the
    backend saw): counting restarts whenever a step's first forward comes (nothing in flight).
    """
    ordinals: dict[int, int] = {}
    seen: dict[Any, int] = {}
    in_flight: set[int] = set()
    for graph, kind, inv in calls:
        if kind == "fwd":
            if not in_flight:
                seen.clear()  # a new step
            ordinals[inv] = seen.get(graph, 0)
            seen[graph] = ordinals[inv] + 1
            in_flight.add(inv)
        else:
            in_flight.discard(inv)
    return ordinals
