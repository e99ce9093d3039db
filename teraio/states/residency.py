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

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from teraio.planner.budget import BudgetError, format_size
from teraio.planner.kept_states import StateItem, StateResidency, choose_resident_states, state_items
from teraio.states.optimizer_stream import RESIDENT_STATE_KEYS

if TYPE_CHECKING:
    from teraio.states.offload import StateOffload


@dataclass(frozen=True)
class StateMemory:
    """What the model states of one optimizer take, for the whole-step budget (the note above)."""

    param_bytes: int
    grad_bytes: int
    state_bytes: int
    fixed_bytes: int  # parameters that stay in memory whatever the plan
    items: list[StateItem]  # what the plan may keep
    step_window_bytes: int  # the streamed step's working set: three chunks and the resident gradients

    @property
    def total_bytes(self) -> int:
        """Parameters, gradients and optimizer states all in memory."""
        return self.param_bytes + self.grad_bytes + self.state_bytes


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


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
    items = state_items(
        param_nbytes=param_nbytes,
        state_nbytes=state_nbytes,
        offloadable_params=movable,
        optimizer_in_backward=states.in_backward,
        held_by_graphs=held_by_graphs,
        read_only_reads=(
            {i: residency.frozen.reads_per_step(i) for i in range(len(params), len(every))}
            if residency is not None
            else None
        ),
    )
    fixed = sum(n for i, n in enumerate(param_nbytes) if i not in movable)
    order = [i for i in states.step_order() if params[i].requires_grad]
    chunks = [c.nbytes for c in states.stream.cut(order, lambda i: None)]
    window = max((sum(chunks[j : j + 3]) for j in range(len(chunks))), default=0)
    resident_grads = 0 if (states.grads.offload or states.in_backward) else grad_bytes
    return StateMemory(
        param_bytes=sum(param_nbytes),
        grad_bytes=grad_bytes,
        state_bytes=sum(state_nbytes),
        fixed_bytes=fixed,
        items=items,
        step_window_bytes=window + resident_grads,
    )


def plan_residency(
    memory: StateMemory, capacity_bytes: int, region_capacity_bytes: int, solver: str
) -> StateResidency:
    """The items kept within the two capacities (negative: none)."""
    return choose_resident_states(
        memory.items,
        max(0, capacity_bytes),
        region_capacity_bytes=max(0, region_capacity_bytes),
        solver="greedy" if solver == "greedy" else "ilp",
    )


def apply_residency(states: StateOffload, plan: StateResidency | None) -> None:
    """Keep in memory what ``plan`` keeps, and offload again what an earlier plan kept and this one does
    not (None: keep nothing). Between steps only."""
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
    seen: set[int] = set()
    total = 0

    def count(t: Any) -> None:
        nonlocal total
        if not isinstance(t, torch.Tensor):
            return
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in seen:
            return
        seen.add(ptr)
        total += storage.nbytes()

    residency = states.residency
    for p in residency.params[len(states.params) :] if residency is not None else ():
        count(p)  # frozen weights (Note: [Frozen weights are read-only state] in teraio.states.frozen)
    for p in states.params:
        count(p)
        count(p.grad)
        for k, v in (states.optimizer.state.get(p) or {}).items():
            if k not in RESIDENT_STATE_KEYS:
                count(v)
    return total


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
        self._start_bytes: int | None = None
        self.budget_bytes: int | None = None  # the whole step's, as last planned
        #: The activations' unplanned step peak with the memory outside the graphs, as last planned: with
        #: ``state_bytes`` what a fraction budget is of.
        self.unplanned_activation_bytes: int | None = None

    def sizes(self, held_by_graphs: frozenset[int] = frozenset()) -> StateMemory:
        """The states' sizes now (measured once per planning: the first step makes the states)."""
        self.memory = state_memory(self.states, held_by_graphs)
        return self.memory

    def plan(
        self, budget_bytes: int, region_peak_bytes: int, solver: str, unplanned_activation_bytes: int
    ) -> int:
        """Choose and apply the kept states for a step whose graphs peak at ``region_peak_bytes`` (their
        plans' composed peak with the memory outside them); return the whole step's predicted peak
        (Note: [Two moments bound the kept states] in teraio.planner.kept_states)."""
        m = self.memory or self.sizes()
        self.budget_bytes = budget_bytes
        self.unplanned_activation_bytes = unplanned_activation_bytes
        left = budget_bytes - m.fixed_bytes
        if self.keep == "plan":
            self.residency = plan_residency(m, left - m.step_window_bytes, left - region_peak_bytes, solver)
        else:
            self.residency = None
        apply_residency(self.states, self.residency)
        return self.predict(region_peak_bytes)

    def predict(self, region_peak_bytes: int) -> int:
        """The whole step's predicted peak with the kept states as they are, for graphs that peak at
        ``region_peak_bytes`` (before the kept parameters they hold are taken off)."""
        m = self.memory or self.sizes()
        r = self.residency
        kept, kept_region = (r.kept_bytes, r.kept_region_bytes) if r is not None else (0, 0)
        self.predicted_peak_bytes = m.fixed_bytes + max(
            kept_region + region_peak_bytes, kept + m.step_window_bytes
        )
        return self.predicted_peak_bytes

    @property
    def kept_held_bytes(self) -> int:
        """Kept parameters the graphs would otherwise fetch while they run (Note: [Two moments bound the
        kept states] in teraio.planner.kept_states): in memory before the step, so the step allocates them
        no more, and the graphs' predicted step peak (bytes allocated during the step) is that much lower."""
        r, m = self.residency, self.memory
        if r is None or m is None:
            return 0
        return sum(it.nbytes for it in m.items if it.key in r.kept and it.in_region == 0)

    def step_starts(self) -> None:
        """A measured step starts: what the states hold in memory now is part of its peak."""
        self._start_bytes = resident_state_bytes(self.states)

    def step_measured(self, region_peak_bytes: int) -> int | None:
        """The whole step's measured peak: the states held at its start and the step's own peak."""
        if self._start_bytes is None:
            return None
        self.measured_peak_bytes = self._start_bytes + region_peak_bytes
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
            "kept": None if self.residency is None else self.residency.to_dict(),
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "measured_peak_bytes": self.measured_peak_bytes,
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
