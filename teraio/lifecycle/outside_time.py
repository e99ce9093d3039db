"""How long a training step spends outside its graphs' own code, measured while profiling calibrates.

The calibration steps (Note: [Calibrated times] in teraio.profiling.op_timing) time each graph's generated code as
a whole. What a user times around ``loss = model(x); loss.backward()`` is more: the compiled function's
wrappers around the forward and the backward, the loop's code between them, the autograd engine
starting a backward and accumulating gradients after it. On a small model that is a large part of the
step, and a prediction made of op times alone misses it (Note: [Time outside the graphs] in
teraio.planner.lifetimes).

So during a step in which every graph call is a calibration run, the backend times the step from its
first forward call to the end of the backward pass (an engine callback queued by the hook that ends
the step, so gradient accumulation is inside) and subtracts the time spent inside the graphs' calls;
the rest, shared among the step's graphs by their number of calls, is each graph's ``outside_s``.
A step with another training call in it (a graph still timed op by op, or already running its plan), a
compile, or a forward without its backward is not used; what the loop itself does inside the step
(a metric, a ``no_grad`` call of a compiled model) is part of the step the user times, and counts.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class _Window:
    start_s: float
    inside_s: float = 0.0  # summed wall time of the graph calls
    calls: Counter[Any] = field(default_factory=Counter)  # graph -> calls, forward and backward
    usable: bool = True


def _at_end_of_backward(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the current backward pass has finished (gradients accumulated), or now when
    no backward is running (a step ended by a finalizer)."""
    try:
        torch.autograd.Variable._execution_engine.queue_callback(fn)
    except RuntimeError:
        fn()


class OutsideTimer:
    """Step windows of the calibration steps of one backend. Thread-safe (hooks run on autograd's
    threads)."""

    def __init__(self, on_sample: Callable[[Any, float], None]) -> None:
        self._lock = threading.Lock()
        self._windows: dict[int, _Window] = {}
        self._on_sample = on_sample  # (graph, its share of the step's outside time in seconds)

    def forward_starts(self, step_index: int, first_call: bool, calibrating: bool) -> None:
        """A training forward is about to run in ``step_index`` (``first_call``: the step's first)."""
        with self._lock:
            if first_call:
                self._windows.pop(step_index, None)
                if calibrating:
                    self._windows[step_index] = _Window(time.perf_counter())
            elif not calibrating and step_index in self._windows:
                self._windows[step_index].usable = False

    def graph_ran(self, step_index: int | None, graph: Any, seconds: float) -> None:
        """A calibration run of ``graph`` (forward or backward) took ``seconds`` inside its call."""
        with self._lock:
            w = self._windows.get(step_index) if step_index is not None else None
            if w is not None:
                w.inside_s += seconds
                w.calls[graph] += 1

    def step_ended(self, step_index: int, clean: bool) -> None:
        """The step's last invocation finished (called from the hook or finalizer that ends it)."""
        with self._lock:
            w = self._windows.pop(step_index, None)
        if w is None or not clean or not w.usable or not w.calls:
            return

        def sample() -> None:
            outside_s = max(0.0, time.perf_counter() - w.start_s - w.inside_s)
            total = sum(w.calls.values())
            for graph, n in w.calls.items():
                self._on_sample(graph, outside_s * n / total)

        _at_end_of_backward(sample)
