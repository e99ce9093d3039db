"""The whole-step budget over the model states: which parameters and optimizer states stay in memory.

Note: [The whole-step budget keeps some states in memory]
    With ``states="offload"`` and a ``memory_budget``, the budget bounds the whole step: activations,
    parameters, gradients and optimizer states. A fraction or percentage is of the step's whole
    unplanned peak, the parameters, gradients and optimizer states all in memory plus the activations'
    unplanned step peak (and memory measured outside the graphs). The budget is shared out in three
    parts:

    1. *Fixed*: what stays in memory whatever the plan: parameters that cannot move (smaller than
       ``states_min_param_bytes``, used by eager code, or all of them without ``offload_parameters``).
       With ``offload_parameters`` the parameters include the model's frozen weights (Note: [Frozen
       weights are read-only state] in teraio.states.frozen): no gradient, no state, and as items they
       save their reads (one or two a step) and no write.
    2. *The graphs*: the activation plans get the budget less the fixed part and the memory measured
       outside the graphs (the gradients backward hands to autograd, what the loop holds), as before;
       the offloaded parameters a graph fetches are in its own profile (the note below).
    3. *Kept states*: what remains below the budget is filled with parameters and optimizer states kept
       in memory for good, chosen by ``teraio.planner.kept_states`` (the most step I/O saved: Note: [What
       keeping an item saves] there). A kept item holds its bytes for the whole step, and two moments
       bound them (Note: [Two moments bound the kept states] there): while the graphs run, beside
       their predicted step peak and the memory outside them, and in the streamed optimizer step,
       beside its working set (its three chunks and the gradients in memory).

    Activations come first: the graph plans time their moves behind compute, while what the streamed
    step reads and writes waits on the disk (a state's I/O is on the step's critical path, an
    activation's mostly is not). The prediction of the whole step's peak is then the fixed part plus the
    larger of the two moments, each with what the kept items add to it; the measurement is the bytes of
    parameters, gradients and optimizer states in memory when the measured step starts (read from their
    storages) plus the step's measured peak. When the memory outside the graphs is measured and planned
    for once more (Note: [Memory outside the graphs is measured and planned for] in teraio.lifecycle.measurement),
    the kept states are chosen again with it. ``states_keep="none"`` keeps nothing beyond the fixed
    part (every state that can move, moves), and without a ``memory_budget`` nothing is kept either.

Note: [The streamed step's chunks are sized to the budget]
    The streamed step holds three chunks at once (Note: [Three chunks in memory] in
    teraio.states.optimizer_stream), each up to ``teraio.States(chunk_bytes=...)`` of parameters,
    gradients and states (64 MiB by default): a working set fixed whatever the budget, which on a model
    of a few chunks is most of its states, and which alone took the whole step's prediction and
    measurement over the budget. So the chunk size is part of the plan: before the kept states are
    chosen, the chunks are cut at the largest size up to ``chunk_bytes`` whose working set fits the
    budget less what cannot move (the working set only grows with the chunk size: chunks merge). When
    even one parameter a chunk does not fit, the plan fails with a ``BudgetError`` naming the smallest
    achievable step peak, as when the graphs cannot fit. A budget planned again with more room cuts
    larger chunks again, up to ``chunk_bytes``.

Note: [The overlapped step's moments]
    When the step of offloaded parameters runs in the next forward (Note: [The step of offloaded
    parameters runs in the next forward] in teraio.states.step_pipeline), its working set meets the
    forward's memory instead of the step after backward. Two moments then bound the whole step besides
    the graphs': ``opt.step()`` itself, which updates the chunks of parameters that stay in memory (their
    three-chunk window), and each graph call of the forward that runs chunks: the bytes the earlier
    calls' invocations hold when it starts (the composed plans' ``held_at_forward_calls``, with the
    memory outside the graphs), the parameters of this call already updated (they stay for it), and the
    three-chunk window of the chunk being updated. The chunks are cut as the step will cut them, in the
    order the last forward's calls took the parameters. The step overlaps only when the larger of these
    and the graphs' moment fits the budget; otherwise the plan predicts, and the step runs, the serial
    step. A measured step counts the reads it inherits: the buffers of reads in flight when it starts
    (the next forward's first chunk, read ahead by ``opt.step()``) are memory it holds at its start.

Note: [Fetched parameters are the graph's memory]
    With ``offload_parameters=True`` a graph call fetches its offloaded parameters before its forward and
    again before its backward, and frees them after each (Note: [When a parameter is resident] in
    teraio.states.params): they are allocated inside the step, beside the activations, for as long as
    the graph runs. A profile counts only what the graph allocates, so the profile of such a graph adds
    them to every op's ``other_bytes`` (and records them as ``meta["fetched_parameter_bytes"]``): the
    graph's plan then finds its peak with them, as the measured step does. A graph that runs once per
    block reads the next call's parameters ahead while it runs, so it holds two calls' worth: the largest
    call's, twice. With the whole model in one graph, every offloaded parameter is in memory while it
    runs, so a parameter the plan keeps adds nothing to that moment (it is in memory before the step
    instead of being fetched in it: the graphs' predicted step peak, which counts what the step
    allocates, is lowered by the kept parameters they fetched, ``WholeStepStates.kept_held_bytes``).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from teraio.planner.budget import BudgetError, format_size
from teraio.planner.kept_states import StateItem, StateResidency, choose_resident_states, state_items
from teraio.planner.model_states import offload_states_record
from teraio.runtime.engine import read_buffer_storages
from teraio.states.optimizer_stream import RESIDENT_STATE_KEYS
from teraio.states.shards import local, local_nbytes
from teraio.states.step_chunks import cut_chunks

if TYPE_CHECKING:
    from teraio.states.offload import StateOffload

log = logging.getLogger("teraio")


@dataclass(frozen=True)
class StateMemory:
    """What the model states of one optimizer take, for the whole-step budget (the note above)."""

    param_bytes: int
    grad_bytes: int
    state_bytes: int
    fixed_bytes: int  # parameters that stay in memory whatever the plan
    items: list[StateItem]  # what the plan may keep
    #: The same items when the step overlaps the next forward (Note: [A kept parameter keeps its states
    #: when the step overlaps] in teraio.planner.kept_states: a parameter is read once fewer).
    overlap_items: list[StateItem]
    step_window_bytes: int  # the streamed step's working set: three chunks and the resident gradients

    @property
    def total_bytes(self) -> int:
        """Parameters, gradients and optimizer states all in memory."""
        return self.param_bytes + self.grad_bytes + self.state_bytes


def _nbytes(t: torch.Tensor) -> int:
    return local_nbytes(t)  # Note: [A sharded tensor's bytes are its local shard] in teraio.states.shards


def state_memory(states: StateOffload, held_by_graphs: frozenset[int] = frozenset()) -> StateMemory:
    """The sizes the whole-step budget needs, from the optimizer's parameters and (future) states;
    ``held_by_graphs``: parameters in memory anyway while the graphs run (Note: [Two moments bound the
    kept states] in teraio.planner.kept_states)."""
    params = states.params
    residency = states.residency
    # Note: [Frozen weights are read-only state] in teraio.states.frozen: indexed after the optimizer's.
    every = residency.params if residency is not None else params
    param_nbytes = [_nbytes(p) for p in every]
    state_nbytes = [states.stream.state_footprint(i)[1] for i in range(len(params))]
    state_nbytes += [0] * (len(every) - len(params))
    grad_bytes = sum(n for p, n in zip(params, param_nbytes) if p.requires_grad)
    movable = set() if residency is None else set(residency.movable())
    read_only = (
        {i: residency.frozen.reads_per_step(i) for i in range(len(params), len(every))}
        if residency is not None
        else None
    )
    items, overlap_items = (
        state_items(
            param_nbytes=param_nbytes,
            state_nbytes=state_nbytes,
            offloadable_params=movable,
            optimizer_in_backward=states.in_backward,
            held_by_graphs=held_by_graphs,
            read_only_reads=read_only,
            overlap_step=overlap,
        )
        for overlap in (False, True)
    )
    fixed = sum(n for i, n in enumerate(param_nbytes) if i not in movable)
    return StateMemory(
        param_bytes=sum(param_nbytes),
        grad_bytes=grad_bytes,
        state_bytes=sum(state_nbytes),
        fixed_bytes=fixed,
        items=items,
        overlap_items=overlap_items,
        step_window_bytes=step_window_bytes(states),
    )


def _step_costs(states: StateOffload, kept: frozenset[tuple[str, int]]) -> tuple[Any, Any, Any]:
    """What the step moves of each parameter with the items ``kept`` in memory: the parameters that move,
    ``moved(i)`` (its value when it moves and its states unless kept, the gradient aside) and
    ``cost(chunk)`` (those of a chunk, and its gradients that move)."""
    params, stream, residency = states.params, states.stream, states.residency
    moving_params = (residency.movable() if residency is not None else frozenset()) - {
        i for k, i in kept if k == "parameter"
    }
    kept_states = {i for k, i in kept if k == "optimizer_state"}

    def moved(i: int) -> int:
        return (_nbytes(params[i]) if i in moving_params else 0) + (
            0 if i in kept_states else stream.state_footprint(i)[1]
        )

    def cost(c: Any) -> tuple[int, int]:
        return sum(moved(i) for i in c.param_idxs), sum(states.grad_nbytes(i) for i in c.param_idxs)

    return moving_params, moved, cost


def _window_at(states: StateOffload, chunks: list[Any], costs: list[tuple[int, int]], pos: int) -> int:
    """Note: [Three chunks in memory] in teraio.states.optimizer_stream while chunk ``pos`` is updated."""
    written = costs[pos - 1][0] if pos >= 1 else 0
    read = sum(costs[pos + 1]) if pos + 1 < len(chunks) else 0
    return written + sum(costs[pos]) + states.stream.update_scratch_bytes(chunks[pos]) + read


def step_window_bytes(
    states: StateOffload, chunk_bytes: int | None = None, kept: frozenset[tuple[str, int]] = frozenset()
) -> int:
    """The streamed step's working set with its chunks cut at ``chunk_bytes`` (None: the step's own) and
    the items ``kept`` in memory (counted elsewhere): Note: [Three chunks in memory] in
    teraio.states.optimizer_stream, the chunk before the one updated being written (its gradients gone),
    the one after it being read, and the update's scratch (Note: [The update's scratch is measured, not
    assumed] in teraio.states.update_scratch); and the gradients when they stay in memory until the
    step."""
    params = states.params
    _, moved, cost = _step_costs(states, kept)
    order = [i for i in states.step_order() if params[i].requires_grad]
    size = chunk_bytes or states.stream.chunk_bytes
    chunks = cut_chunks(order, lambda i: moved(i) + states.grad_nbytes(i), size)
    costs = [cost(c) for c in chunks]
    window = max((_window_at(states, chunks, costs, pos) for pos in range(len(chunks))), default=0)
    if states.grads.offload or states.in_backward:
        return window
    return window + sum(_nbytes(p) for p in params if p.requires_grad)


def overlapped_step_bytes(
    states: StateOffload, forward_held: list[int] | None, kept: frozenset[tuple[str, int]] = frozenset()
) -> tuple[int, int]:
    """Note: [The overlapped step's moments]: the working set of ``opt.step()`` (the chunks of parameters
    in memory) and the most the forward holds while it runs the offloaded chunks, its graphs' own bytes
    at each call's start (``forward_held``, per graph call in order; None: unknown, the largest) with it,
    the items ``kept`` aside."""
    params, residency = states.params, states.residency
    assert residency is not None
    moving_params, moved, cost = _step_costs(states, kept)
    live = [i for i in states.step_order() if params[i].requires_grad]
    later = [i for i in residency.forward_order(live) if i in moving_params]
    deferred = set(later)
    now = [i for i in live if i not in deferred]
    size = states.stream.chunk_bytes

    def nbytes_of(i: int) -> int:
        return moved(i) + states.grad_nbytes(i)

    chunks_now, chunks = cut_chunks(now, nbytes_of, size), cut_chunks(later, nbytes_of, size)
    costs_now = [cost(c) for c in chunks_now]
    now_bytes = max((_window_at(states, chunks_now, costs_now, p) for p in range(len(chunks_now))), default=0)
    costs = [cost(c) for c in chunks]
    chunk_of = {i: pos for pos, c in enumerate(chunks) for i in c.param_idxs}
    calls = residency.forward_calls
    held = forward_held if forward_held is not None and len(forward_held) == len(calls) else None
    most_held = max(forward_held or [0])
    peak, pos = 0, 0
    for c, call in enumerate(calls):
        target = max((chunk_of.get(i, -1) for i in call), default=-1)
        while pos <= target:  # the chunks this call's ensure runs; the call's earlier ones stay for it
            gathered = sum(_nbytes(params[i]) for i in call if chunk_of.get(i, pos) < pos - 1)
            at_start = held[c] if held is not None else most_held
            peak = max(peak, at_start + gathered + _window_at(states, chunks, costs, pos))
            pos += 1
    for rest in range(pos, len(chunks)):  # never reached by a call: finished later, say at the backward
        peak = max(peak, most_held + _window_at(states, chunks, costs, rest))
    return now_bytes, peak


def fit_chunk_bytes(
    states: StateOffload,
    most_chunk_bytes: int,
    capacity_bytes: int,
    kept: frozenset[tuple[str, int]] = frozenset(),
) -> int | None:
    """Note: [The streamed step's chunks are sized to the budget]: the largest chunk size up to
    ``most_chunk_bytes`` whose working set (with ``kept`` in memory) fits ``capacity_bytes`` (None: not
    even one parameter a chunk does)."""
    if step_window_bytes(states, most_chunk_bytes, kept) <= capacity_bytes:
        return most_chunk_bytes
    if step_window_bytes(states, 1, kept) > capacity_bytes:
        return None
    lo, hi = 1, most_chunk_bytes  # window(lo) fits, window(hi) does not; larger chunks hold more
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if step_window_bytes(states, mid, kept) <= capacity_bytes:
            lo = mid
        else:
            hi = mid
    # Mostly larger chunks hold more, not always (where a chunk closes moves): take the size found only
    # once it fits, else smaller ones.
    while lo > 1 and step_window_bytes(states, lo, kept) > capacity_bytes:
        lo = lo * 7 // 8
    return lo


# Note: [The kept items of an overlapped step]
#     When the step may overlap the next forward, the items are chosen for that step first: a parameter
#     only with its states (Note: [A kept parameter keeps its states when the step overlaps] in
#     teraio.planner.kept_states), within what the overlapped step's two moments leave (Note: [The
#     overlapped step's moments]): ``opt.step()``'s chunks of kept parameters, and the forward holding
#     its graph's memory, the parameters of the call it runs and three chunks. Those moments are
#     computed with nothing kept; the kept items leave the chunks, which then take other parameters, so
#     the prediction with the choice can still be over: the capacity shrinks by the excess and the
#     choice is made again (four times at most). If the overlapped step still does not fit, the
#     serial step's own choice is made (within its streamed step's window), and the step still overlaps
#     with it where that fits: its kept parameters are updated in ``opt.step()`` with their states, the
#     others in the next forward, never slower than the whole step in ``opt.step()`` (kept parameters
#     held by the graphs can lower the forward's moment, which the moments with nothing kept miss).
#     Else the step runs serially, which an info line says. ``stats()["whole_step"]["kept"]
#     ["states_with_parameters"]`` tells the two choices apart.


def plan_residency(
    memory: StateMemory,
    capacity_bytes: int,
    region_capacity_bytes: int,
    solver: str,
    overlap_step: bool = False,
) -> StateResidency:
    """The items kept within the two capacities (negative: none); ``overlap_step``: for a step that
    overlaps the next forward (Note: [A kept parameter keeps its states when the step overlaps] in
    teraio.planner.kept_states)."""
    return choose_resident_states(
        memory.overlap_items if overlap_step else memory.items,
        max(0, capacity_bytes),
        region_capacity_bytes=max(0, region_capacity_bytes),
        solver="greedy" if solver == "greedy" else "ilp",
        keep_states_with_parameters=overlap_step,
    )


def apply_residency(states: StateOffload, plan: StateResidency | None) -> None:
    """Keep in memory what ``plan`` keeps, and offload again what an earlier plan kept and this one does
    not (None: keep nothing). Between steps only."""
    states.settle_step()  # a step pending in the forward (teraio.states.step_pipeline) uses the records
    if states.stream.updating_in_backward:  # a step inside backward awaits opt.step(): apply after it
        states.after_commit = lambda: apply_residency(states, plan)
        return
    kept = plan.kept if plan is not None else frozenset()
    states.stream.keep(frozenset(i for k, i in kept if k == "optimizer_state"))
    if states.residency is not None:
        states.residency.keep(frozenset(i for k, i in kept if k == "parameter"))


def resident_state_bytes(states: StateOffload) -> int:
    """Bytes of parameters, gradients and optimizer states in memory now, read from their storages (an
    offloaded tensor's storage is empty): what a measured step holds before it starts."""
    return sum(resident_state_storages(states).values())


def resident_state_storages(states: StateOffload) -> dict[int, int]:
    """The storages of :func:`resident_state_bytes`: address and bytes of each."""
    seen: dict[int, int] = {}

    def count(t: Any) -> None:
        if not isinstance(t, torch.Tensor):
            return
        storage = local(t).untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in seen:
            return
        seen[ptr] = storage.nbytes()

    residency = states.residency
    for p in residency.params[len(states.params) :] if residency is not None else ():
        count(p)  # frozen weights (Note: [Frozen weights are read-only state] in teraio.states.frozen)
    for p in states.params:
        count(p)
        count(p.grad)
        for k, v in (states.optimizer.state.get(p) or {}).items():
            if k not in RESIDENT_STATE_KEYS:
                count(v)
    return seen


class WholeStepStates:
    """The backend's side of the note above: the state bytes a fraction budget is of, the fixed part the
    graphs leave, the kept states chosen and applied, and the whole step's predicted and measured peak."""

    def __init__(self, states: StateOffload, keep: str) -> None:
        self.states = states
        self.keep = keep  # BackendConfig.states_keep
        self.memory: StateMemory | None = None
        self.residency: StateResidency | None = None
        self.predicted_peak_bytes: int | None = None  # the whole step's
        self.measured_peak_bytes: int | None = None
        #: The measured peak's parts: the states in memory at the step's start, the peak above them up to
        #: the end of the backward, and through the optimizer step (None: not measured yet).
        self.measured_moments: dict[str, int | None] | None = None
        self._start_bytes: int | None = None
        self.budget_bytes: int | None = None  # the whole step's, as last planned
        #: The activations' unplanned step peak with the memory outside the graphs, as last planned: with
        #: ``state_bytes`` what a fraction budget is of.
        self.unplanned_activation_bytes: int | None = None
        #: ``teraio.States(chunk_bytes=...)``: the largest chunk the streamed step may cut (Note: [The
        #: streamed step's chunks are sized to the budget]).
        self.most_chunk_bytes = states.stream.chunk_bytes
        #: Whether the step's working set fits beside the forward (Note: [The step of offloaded parameters
        #: runs in the next forward] in teraio.states.step_pipeline): no budget, or the plan says so.
        self.overlap_fits = True
        #: The overlapped step's predicted peak, as last predicted (Note: [The overlapped step's moments]).
        self.overlapped_peak_bytes = 0

    def sizes(self, held_by_graphs: frozenset[int] = frozenset()) -> StateMemory:
        """The states' sizes now (measured once per planning: the first step makes the states)."""
        self.states.settle_step()
        self.memory = state_memory(self.states, held_by_graphs)
        return self.memory

    def fit_step_window(self, budget_bytes: int) -> BudgetError | None:
        """Note: [The streamed step's chunks are sized to the budget]: cut the streamed step's chunks so
        that its working set fits beside what cannot move; the error (not raised) when even one parameter
        a chunk does not fit."""
        m = self.memory or self.sizes()
        capacity = budget_bytes - m.fixed_bytes
        chunk = fit_chunk_bytes(self.states, self.most_chunk_bytes, capacity)
        if chunk is None:
            least = step_window_bytes(self.states, 1)
            smallest = m.fixed_bytes + least
            return BudgetError(
                f"memory_budget {format_size(budget_bytes)} cannot be met for the whole step: the parameters "
                f"that cannot move hold {format_size(m.fixed_bytes)} and the streamed optimizer step needs "
                f"at least {format_size(least)} beside them (three parameters' values, gradients and states "
                f"at once); the smallest achievable step peak is about {format_size(smallest)} ({smallest} "
                "bytes): use a budget of at least that, or let more parameters move "
                "(teraio.States(parameters=True, model=model), a smaller min_param_bytes)",
                smallest_peak_bytes=smallest,
            )
        if chunk != self.states.stream.chunk_bytes:
            log.info(
                "whole step: the streamed step's chunks are cut at %s (States.chunk_bytes %s) so that its "
                "working set fits the budget beside what cannot move",
                format_size(chunk),
                format_size(self.most_chunk_bytes),
            )
            self.states.set_chunk_bytes(chunk)
        self.memory = dataclasses.replace(m, step_window_bytes=step_window_bytes(self.states))
        return None

    def plan(
        self,
        budget_bytes: int,
        region_peak_bytes: int,
        solver: str,
        unplanned_activation_bytes: int,
        forward_held: list[int] | None = None,
    ) -> int:
        """Choose and apply the kept states for a step whose graphs peak at ``region_peak_bytes`` (their
        plans' composed peak with the memory outside them); return the whole step's predicted peak
        (Note: [Two moments bound the kept states] in teraio.planner.kept_states)."""
        m = self.memory or self.sizes()
        self.budget_bytes = budget_bytes
        self.unplanned_activation_bytes = unplanned_activation_bytes
        chunk_bytes = self.states.stream.chunk_bytes  # as fit_step_window cut them
        left = budget_bytes - m.fixed_bytes
        # Note: [The kept items of an overlapped step]. The prediction reads the chosen items, not what
        # is in memory: only the final choice is applied.
        peak = None
        if self.states.overlapped is not None:
            held = forward_held if forward_held is not None else [region_peak_bytes]
            now, in_forward = overlapped_step_bytes(self.states, held)
            capacity = left - max(now, in_forward)
            for _ in range(4):
                self.states.set_chunk_bytes(chunk_bytes)
                self._choose(m, capacity, left - region_peak_bytes, solver, overlap=True)
                peak = self.predict(region_peak_bytes, forward_held)
                if self.overlap_fits or capacity <= 0 or self.keep != "plan":
                    break
                # The kept items' chunks hold more than the moments with nothing kept: keep less.
                capacity -= self.overlapped_peak_bytes - budget_bytes
        if peak is None or not self.overlap_fits:
            self.states.set_chunk_bytes(chunk_bytes)
            self._choose(m, left - m.step_window_bytes, left - region_peak_bytes, solver, overlap=False)
            peak = self.predict(region_peak_bytes, forward_held)
            if self.states.overlapped is not None and not self.overlap_fits:
                log.info(
                    "whole step: the optimizer step overlapped with the next forward would peak at %s "
                    "(budget %s): it runs serially in opt.step()",
                    format_size(self.overlapped_peak_bytes),
                    format_size(budget_bytes),
                )
        apply_residency(self.states, self.residency)
        return peak

    def _choose(
        self, m: StateMemory, capacity_bytes: int, region_capacity_bytes: int, solver: str, overlap: bool
    ) -> None:
        """Choose the kept items within the two capacities (the chunks cut smaller where they no longer fit
        beside them)."""
        left = (self.budget_bytes or 0) - m.fixed_bytes
        if self.keep == "plan":
            self.residency = plan_residency(
                m, capacity_bytes, region_capacity_bytes, solver, overlap_step=overlap
            )
        else:
            self.residency = None
        r = self.residency
        if r is not None and r.kept:
            # Kept items leave the chunks, which then take more parameters (and their update more
            # scratch) up to the same chunk size: cut them smaller if the two no longer fit together.
            kept_chunk = fit_chunk_bytes(
                self.states, self.states.stream.chunk_bytes, left - r.kept_bytes, r.kept
            )
            if kept_chunk is None:
                self.residency = None  # nothing kept fits (the chunks were sized with nothing kept)
            elif kept_chunk != self.states.stream.chunk_bytes:
                self.states.set_chunk_bytes(kept_chunk)

    def predict(self, region_peak_bytes: int, forward_held: list[int] | None = None) -> int:
        """The whole step's predicted peak with the kept states as they are, for graphs that peak at
        ``region_peak_bytes`` (before the kept parameters they hold are taken off), the step overlapped
        with the next forward when that fits the budget (Note: [The overlapped step's moments])."""
        m = self.memory or self.sizes()
        r = self.residency
        kept, kept_region = (r.kept_bytes, r.kept_region_bytes) if r is not None else (0, 0)
        kept_items = r.kept if r is not None else frozenset()
        # The working set without the kept items, whose bytes ``kept`` counts.
        window = step_window_bytes(self.states, kept=r.kept) if r is not None else m.step_window_bytes
        graphs = kept_region + region_peak_bytes
        serial = m.fixed_bytes + max(graphs, kept + window)
        self.overlap_fits = False
        if self.states.overlapped is not None:
            held = forward_held if forward_held is not None else [region_peak_bytes]  # unknown: the most
            now, in_forward = overlapped_step_bytes(self.states, held, kept_items)
            overlapped = m.fixed_bytes + max(graphs, kept + now, kept + in_forward)
            self.overlapped_peak_bytes = overlapped
            self.overlap_fits = self.budget_bytes is None or overlapped <= self.budget_bytes
            if self.overlap_fits:
                self.predicted_peak_bytes = overlapped
                return overlapped
        self.predicted_peak_bytes = serial
        return serial

    @property
    def kept_held_bytes(self) -> int:
        """Kept parameters the graphs would otherwise fetch while they run (Note: [Two moments bound the
        kept states] in teraio.planner.kept_states): in memory before the step, so the step allocates them
        no more, and the graphs' predicted step peak (bytes allocated during the step) is that much lower."""
        r, m = self.residency, self.memory
        if r is None or m is None:
            return 0
        return sum(it.nbytes for it in m.items if it.key in r.kept and it.in_region == 0)

    def step_starts(self) -> dict[int, int]:
        """A measured step starts: what the states hold in memory now is part of its peak. Returns their
        storages (address: bytes), whose frees in the step lower its memory."""
        storages = resident_state_storages(self.states)
        # Reads already started (a step overlapped with this forward read its first chunk ahead: Note:
        # [The step of offloaded parameters runs in the next forward] in teraio.states.step_pipeline) hold
        # their buffers before the step; those buffers become the records' memory or are freed in it.
        storages.update(read_buffer_storages(self.states.engine))
        self._start_bytes = sum(storages.values())
        return storages

    def step_measured(self, region_peak_bytes: int, to_stop_peak_bytes: int | None = None) -> int | None:
        """The whole step's measured peak: the states held at its start and the step's own peak, the
        optimizer step's included (``to_stop_peak_bytes``: the measurement's peak through the next
        call, with the frees of the states held at the start; ``region_peak_bytes``: up to the end of
        the backward, without them, when there is no such figure)."""
        if self._start_bytes is None:
            return None
        peak = to_stop_peak_bytes if to_stop_peak_bytes is not None else region_peak_bytes
        self.measured_moments = {
            "start_bytes": self._start_bytes,
            "graphs_peak_bytes": region_peak_bytes,
            "through_optimizer_step_peak_bytes": to_stop_peak_bytes,
        }
        self.measured_peak_bytes = self._start_bytes + peak
        self._start_bytes = None
        return self.measured_peak_bytes

    def stats(self) -> dict[str, Any]:
        """``stats()["whole_step"]``: the sizes, the kept states and the whole step's peaks."""
        m = self.memory
        return {
            "states_keep": self.keep,
            "budget_bytes": self.budget_bytes,
            "state_bytes": None if m is None else m.total_bytes,
            "unplanned_activation_bytes": self.unplanned_activation_bytes,
            "fixed_bytes": None if m is None else m.fixed_bytes,
            "step_window_bytes": None if m is None else m.step_window_bytes,
            "chunk_bytes": self.states.stream.chunk_bytes,
            # Note: [The overlapped step's moments]: whether the step overlaps the next forward (the
            # plan's choice) and how many steps did.
            "overlap_step": self.states.overlapped is not None and self.overlap_fits,
            "overlapped_steps": 0
            if self.states.overlapped is None
            else self.states.overlapped.overlapped_steps,
            "kept": None if self.residency is None else self.residency.to_dict(),
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "measured_peak_bytes": self.measured_peak_bytes,
            "measured_moments": self.measured_moments,
        }


def add_fetched_parameters(profile: Any, residency: Any, calls: set[tuple[int, ...]]) -> None:
    """Note: [Fetched parameters are the graph's memory]: add to every op of ``profile`` (a graph's, whose
    calls took the offloaded parameters ``calls`` while it was profiled) what it holds of them."""
    if not calls:
        return
    working = fetched_parameter_bytes(residency, calls)
    ops = profile.ops
    base = ops["other_bytes"] if "other_bytes" in ops.columns else 0
    ops["other_bytes"] = (base + working).astype("int64")
    profile.meta["fetched_parameter_bytes"] = working


def held_by_graphs(param_calls: list[set[tuple[int, ...]]]) -> frozenset[int]:
    """The offloaded parameters that each graph taking them holds all the time it runs (graphs called
    once per step; ``param_calls``: per graph, the parameters of each of its calls): keeping one adds
    nothing while the graphs run (Note: [Two moments bound the kept states] in
    teraio.planner.kept_states)."""
    once: set[int] = set()
    several: set[int] = set()
    for calls in param_calls:
        for c in calls:
            (once if len(calls) == 1 else several).update(c)
    return frozenset(once - several)


def whole_step_budget_error(
    exc: BudgetError, budget_bytes: int, fixed_bytes: int, outside_bytes: int
) -> BudgetError:
    """The graphs' BudgetError restated for the whole step: what cannot move, what the graphs need at
    the least, and the smallest budget, in one line."""
    if exc.smallest_peak_bytes is None:
        return exc
    graphs = exc.smallest_peak_bytes
    smallest = graphs + outside_bytes + fixed_bytes
    return BudgetError(
        f"memory_budget {format_size(budget_bytes)} cannot be met for the whole step: the parameters that "
        f"cannot move hold {format_size(fixed_bytes)} and the graphs need at least {format_size(graphs)} "
        f"beside them; the smallest achievable step peak is about {format_size(smallest)} ({smallest} "
        "bytes): use a budget of at least that, or let more parameters move (teraio.States(parameters=True, "
        "model=model), a smaller min_param_bytes)",
        smallest_peak_bytes=smallest,
    )


def fetched_parameter_bytes(residency: Any, calls: set[tuple[int, ...]]) -> int:
    """Note: [Fetched parameters are the graph's memory]: what a graph whose calls take the offloaded
    parameters ``calls`` (one index tuple per distinct call) holds of them while it runs."""
    records = residency.records
    per_call = [sum(records[i].nbytes for i in c if i in records) for c in calls]
    largest = max(per_call, default=0)
    return 2 * largest if len(calls) > 1 else largest


def model_states_record(states: StateOffload) -> dict[str, Any]:
    """The parameters, gradients and optimizer states by kind (``tensors``, ``bytes``,
    ``offloaded_bytes``) and the bytes a step moves for each (``traffic``: ``read_bytes``,
    ``written_bytes``; ``teraio.planner.model_states.offload_states_record``). A profile records it
    as its ``model_states`` (``teraio plan`` and ``teraio simulate`` show it by kind). Optimizer states
    the optimizer has not made yet are counted at the size its first step will make them."""
    param_nbytes = sum(local_nbytes(p) for p in states.params)
    residency = states.residency
    offloaded_params = (
        sum(r.nbytes for i, r in residency.records.items() if i not in residency.frozen)
        if residency is not None
        else 0
    )
    footprints = [states.stream.state_footprint(i) for i in range(len(states.params))]
    kept = 0
    if states.residency is not None and not states.in_backward and states.overlapped is None:
        # Note: [When a parameter is resident]: the step's last chunk keeps its parameters for the
        # next forward. The chunks as the step will cut them (every parameter with a gradient).
        order = [i for i in states.step_order() if states.params[i].requires_grad]
        chunks = states.stream.cut(order, states.grad_nbytes)
        if chunks:
            recs = states.residency.records
            kept = sum(recs[i].nbytes for i in chunks[-1].param_idxs if i in recs)
    record = offload_states_record(
        param_tensors=len(states.params),
        param_nbytes=param_nbytes,
        offloaded_param_nbytes=offloaded_params,
        state_tensors=sum(n for n, _ in footprints),
        state_nbytes=sum(b for _, b in footprints),
        offloaded_state_nbytes=sum(b for i, (_, b) in enumerate(footprints) if i not in states.stream.kept),
        offload_gradients=states.grads.offload,
        optimizer_in_backward=states.in_backward,
        kept_param_nbytes=kept,
        overlap_step=states.overlapped is not None,
    )
    if residency is not None and residency.frozen.count:
        # Note: [Frozen weights are read-only state] in teraio.states.frozen: parameters without a
        # gradient or a state, read for forward (and backward when it saved them), never written by a
        # step.
        frozen = residency.frozen
        recs = {i: r for i, r in residency.records.items() if i in frozen}
        param = record["parameter"]
        param["tensors"] += frozen.count
        param["bytes"] += frozen.nbytes
        param["offloaded_bytes"] += sum(r.nbytes for r in recs.values())
        reads = sum(frozen.reads_per_step(i) * r.nbytes for i, r in recs.items())
        record["traffic"]["parameter"]["read_bytes"] += reads
    return record
