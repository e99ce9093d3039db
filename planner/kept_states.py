"""Which parameters and optimizer states stay in memory under a whole-step budget (``states="offload"``).

With ``states="offload"`` a step's memory is the activations the graphs hold (planned per tensor by the
graph plans) plus the model states: parameters, gradients and optimizer states. Each parameter and each
parameter's optimizer states are one *item* here. An offloaded item costs I/O every step and a kept
one costs its bytes in memory for the whole step, forward, backward and optimizer step alike, since a
parameter is needed again at the next forward and a state at the next step: a kept item is one
constant term of the step's peak. So once the graphs' plans and the streaming working set are fixed,
what the budget leaves (the *capacity*) is best spent on the items that save the most I/O, a 0/1
knapsack: keep the set of items whose bytes fit in the capacity and whose step traffic is largest.

Note: [What keeping an item saves]
    The bytes a step moves for an offloaded item are those ``planner.model_states.offload_step_traffic``
    counts for it: an optimizer state is read and written once per step (2x its bytes); a parameter is
    read for forward, for backward and by the streamed step and written once (4x), or with
    ``optimizer_in_backward`` read twice and written once (3x); a frozen weight, never updated, is read for
    forward, for backward when the backward saved it, and never written (2x or 1x: Note: [A backward
    reads the frozen weights it saved] in teraio.states.frozen). (The streamed step's last chunk stays
    in memory for the next forward, one forward read fewer for a few parameters; the item ignores it,
    which overstates what keeping those saves by at most one chunk's parameter bytes.) Per byte of
    memory a parameter saves more than a state, and both save the same whatever their position in the
    step. Gradients are not items: their lifetime runs from their backward to the step, and whether they
    move at all is the loop's choice (``offload_gradients``: a loop that clips reads them). Were they
    items, a kept gradient would save what a kept moment saves per byte (a write and a read, 2x), so
    swapping one for the other would not lower a step's I/O; what it would change is when the memory
    is needed (a gradient from its backward to ``zero_grad``, a moment all step), which only pays where
    the two moments of the note below differ widely, and would need ``zero_grad``'s behaviour
    (``set_to_none``) to be known at planning time.

Note: [Two moments bound the kept states]
    A step's memory peaks either while the graphs run (activations, fetched parameters, gradients) or
    in the streamed optimizer step (its chunks). A kept item adds its bytes to the second moment, and to
    the first unless it is a parameter a graph holds anyway while it runs: with the whole model in one
    graph every offloaded parameter is fetched for that graph (Note: [Fetched parameters are the graph's
    memory] in teraio.states.residency), so keeping it changes nothing there (``region_nbytes=0``). Hence two
    capacities, one per moment, and a knapsack with two constraints.

Note: [A kept parameter keeps its states when the step overlaps]
    When the step of offloaded parameters runs in the next forward (Note: [The step of offloaded
    parameters runs in the next forward] in teraio.states.step_pipeline), the update's I/O is hidden
    behind the forward's compute, but only for offloaded parameters: a parameter kept in memory is
    updated in ``opt.step()`` itself (user code may read it directly after the step, and a kept tensor
    cannot be guarded), so its offloaded states would be read and written there, with nothing to
    compute beside them. Keeping such a parameter saves its own traffic (read for forward and for
    backward, the forward's read doubling as the update's, and written: 3x its bytes) but turns its
    states' traffic from hidden into serial, which on the benchmark's 2B GPT under a 14 GB budget cost
    13-14 s of a 27 s step (benchmarks/results/states_overlap_2c24g-virtio_202611.md). So with
    ``keep_states_with_parameters`` a parameter is kept only with its states (one more constraint of the
    knapsack: keeping the parameter implies keeping its states); a state may still be kept alone (its
    traffic leaves the forward's I/O). Frozen weights have no states and are unaffected.

The knapsack is solved exactly by CP-SAT (deterministic time, one worker, hinted with the greedy
solution) and, for ``solver="greedy"`` or when CP-SAT cannot prove optimality in its time, by the
ratio-first greedy (most I/O saved per byte, larger first), whose result CP-SAT never does worse than.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

StateItemKind = Literal["parameter", "optimizer_state"]
STATE_ITEM_KINDS: tuple[str, ...] = get_args(StateItemKind)
StateSolver = Literal["ilp", "greedy"]

#: CP-SAT's deterministic time for one knapsack (seconds of its deterministic clock, not wall time).
DEFAULT_DETERMINISTIC_S = 2.0


class StatePlanError(ValueError):
    """An argument of the state plan is out of range; the message names it."""


@dataclass(frozen=True)
class StateItem:
    """One parameter, or one parameter's optimizer states, that may stay in memory or move."""

    param_idx: int
    kind: str  # one of STATE_ITEM_KINDS
    nbytes: int  # what keeping it costs, for the whole step
    moved_bytes: int  # what a step moves for it when offloaded (Note: [What keeping an item saves])
    #: What keeping it adds while the graphs run (Note: [Two moments bound the kept states]); None: nbytes.
    region_nbytes: int | None = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.kind, self.param_idx)

    @property
    def in_region(self) -> int:
        return self.nbytes if self.region_nbytes is None else self.region_nbytes


@dataclass(frozen=True)
class StateResidency:
    """The items a plan keeps in memory, what they take and what the others still move per step."""

    kept: frozenset[tuple[str, int]]  # (kind, param_idx)
    capacity_bytes: int
    region_capacity_bytes: int
    kept_region_bytes: int  # what the kept items add while the graphs run
    kept_bytes_by_kind: dict[str, int]
    offloaded_bytes_by_kind: dict[str, int]
    moved_bytes_by_kind: dict[str, int]  # per step, by the offloaded items
    saved_bytes: int  # per step, by the kept items
    solver: str  # "ilp" | "greedy" | "none" (nothing to decide)
    optimal: bool  # proven optimal for the knapsack
    #: Chosen with a parameter kept only with its states (Note: [A kept parameter keeps its states when
    #: the step overlaps]).
    states_with_parameters: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def kept_bytes(self) -> int:
        return sum(self.kept_bytes_by_kind.values())

    def to_dict(self) -> dict[str, object]:
        return {
            "kept": sorted([k, i] for k, i in self.kept),
            "capacity_bytes": self.capacity_bytes,
            "region_capacity_bytes": self.region_capacity_bytes,
            "kept_bytes": self.kept_bytes,
            "kept_region_bytes": self.kept_region_bytes,
            "kept_bytes_by_kind": dict(self.kept_bytes_by_kind),
            "offloaded_bytes_by_kind": dict(self.offloaded_bytes_by_kind),
            "moved_bytes_by_kind": dict(self.moved_bytes_by_kind),
            "saved_bytes": self.saved_bytes,
            "solver": self.solver,
            "optimal": self.optimal,
            "states_with_parameters": self.states_with_parameters,
        }


def _nonneg(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise StatePlanError(f"{name} must be a non-negative integer, not {value!r}")
    return value


def state_items(
    *,
    param_nbytes: Sequence[int],
    state_nbytes: Sequence[int],
    offloadable_params: Iterable[int],
    optimizer_in_backward: bool,
    held_by_graphs: Iterable[int] = (),
    read_only_reads: Mapping[int, int] | None = None,
    overlap_step: bool = False,
) -> list[StateItem]:
    """The items of a model (Note: [What keeping an item saves]): every parameter in
    ``offloadable_params`` (those ``offload_parameters`` may move) and every parameter's optimizer states
    with a non-zero size. ``param_nbytes[i]`` and ``state_nbytes[i]`` are parameter ``i``'s bytes and its
    states' total bytes; the parameters in ``held_by_graphs`` are in memory anyway while the graphs run
    (Note: [Two moments bound the kept states]); ``read_only_reads`` maps the frozen weights (never
    written) to the reads a step makes of each; ``overlap_step``: the update of an offloaded parameter
    runs in the next forward, whose read of it is the update's (Note: [A kept parameter keeps its states
    when the step overlaps])."""
    if len(param_nbytes) != len(state_nbytes):
        raise StatePlanError(
            f"param_nbytes has {len(param_nbytes)} entries and state_nbytes {len(state_nbytes)}: "
            "one per parameter"
        )
    reads = 2 if optimizer_in_backward or overlap_step else 3
    held = set(held_by_graphs)
    read_only = dict(read_only_reads or {})
    items = []
    for i in sorted(set(offloadable_params)):
        if not 0 <= i < len(param_nbytes):
            raise StatePlanError(f"offloadable parameter {i} is not among the {len(param_nbytes)} parameters")
        n = _nonneg(param_nbytes[i], f"param_nbytes[{i}]")
        moved = read_only[i] * n if i in read_only else (reads + 1) * n
        if n:
            items.append(StateItem(i, "parameter", n, moved, 0 if i in held else None))
    for i, s in enumerate(state_nbytes):
        if _nonneg(s, f"state_nbytes[{i}]"):
            items.append(StateItem(i, "optimizer_state", s, 2 * s))
    return items


def _needs(items: Sequence[StateItem], keep_states_with_parameters: bool) -> dict[int, StateItem]:
    """Per item (by ``id``), the item that must be kept with it (Note: [A kept parameter keeps its states
    when the step overlaps]): a parameter's states."""
    if not keep_states_with_parameters:
        return {}
    states = {it.param_idx: it for it in items if it.kind == "optimizer_state"}
    return {id(it): states[it.param_idx] for it in items if it.kind == "parameter" and it.param_idx in states}


def _greedy(
    items: Sequence[StateItem], capacity: int, region_capacity: int, needs: Mapping[int, StateItem]
) -> list[StateItem]:
    """Most I/O saved per byte first (larger first among equals, then by position): every item that
    still fits both moments is kept, with the item it ``needs`` when that is not kept yet (a parameter
    whose ratio comes first brings its states)."""
    order = sorted(items, key=lambda it: (-it.moved_bytes / it.nbytes, -it.nbytes, it.kind, it.param_idx))
    kept: list[StateItem] = []
    kept_ids: set[int] = set()
    left, region_left = capacity, region_capacity
    for it in order:
        if id(it) in kept_ids:
            continue
        group = [it]
        need = needs.get(id(it))
        if need is not None and id(need) not in kept_ids:
            group.append(need)
        nbytes = sum(g.nbytes for g in group)
        region = sum(g.in_region for g in group)
        if nbytes <= left and region <= region_left:
            kept.extend(group)
            kept_ids.update(id(g) for g in group)
            left -= nbytes
            region_left -= region
    return kept


def _cp_sat(
    items: Sequence[StateItem],
    capacity: int,
    region_capacity: int,
    hint: Sequence[StateItem],
    deterministic_s: float,
    needs: Mapping[int, StateItem],
) -> tuple[list[StateItem], bool] | None:
    """The exact knapsack, or None when CP-SAT found nothing better than ``hint`` to prove."""
    from ortools.sat.python import cp_model

    model = cp_model.CpModel()
    keep = [model.NewBoolVar(f"k{j}") for j in range(len(items))]
    model.Add(sum(it.nbytes * k for it, k in zip(items, keep)) <= capacity)
    model.Add(sum(it.in_region * k for it, k in zip(items, keep)) <= region_capacity)
    var = {id(it): k for it, k in zip(items, keep)}
    for it, k in zip(items, keep):
        need = needs.get(id(it))
        if need is not None:
            model.AddImplication(k, var[id(need)])
    model.Maximize(sum(it.moved_bytes * k for it, k in zip(items, keep)))
    hinted = {id(it) for it in hint}
    for it, k in zip(items, keep):
        model.AddHint(k, id(it) in hinted)
    solver = cp_model.CpSolver()
    solver.parameters.max_deterministic_time = max(0.01, float(deterministic_s))
    solver.parameters.num_workers = 1
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    return [it for it, k in zip(items, keep) if solver.Value(k)], status == cp_model.OPTIMAL


def choose_resident_states(
    items: Sequence[StateItem],
    capacity_bytes: int,
    *,
    region_capacity_bytes: int | None = None,
    solver: StateSolver = "ilp",
    deterministic_s: float = DEFAULT_DETERMINISTIC_S,
    keep_states_with_parameters: bool = False,
) -> StateResidency:
    """The items to keep in memory: the most step traffic saved (module docstring) with their bytes
    within ``capacity_bytes`` and their bytes while the graphs run within ``region_capacity_bytes``
    (default: ``capacity_bytes``; Note: [Two moments bound the kept states]). ``solver="ilp"`` is
    CP-SAT (never worse than the greedy, which hints it); ``"greedy"`` the ratio-first greedy alone.
    ``keep_states_with_parameters``: a parameter is kept only with its states (Note: [A kept parameter
    keeps its states when the step overlaps])."""
    _nonneg(capacity_bytes, "capacity_bytes")
    region_cap = capacity_bytes if region_capacity_bytes is None else region_capacity_bytes
    _nonneg(region_cap, "region_capacity_bytes")
    if solver not in get_args(StateSolver):
        raise StatePlanError(f"solver must be one of {', '.join(get_args(StateSolver))}, not {solver!r}")
    seen: set[tuple[str, int]] = set()
    for it in items:
        if it.kind not in STATE_ITEM_KINDS:
            raise StatePlanError(f"item kind must be one of {', '.join(STATE_ITEM_KINDS)}, not {it.kind!r}")
        if it.nbytes <= 0 or it.moved_bytes < 0 or not 0 <= it.in_region <= it.nbytes:
            raise StatePlanError(
                f"item {it.key} has {it.nbytes} bytes and moves {it.moved_bytes}: sizes must be > 0"
            )
        if it.key in seen:
            raise StatePlanError(f"item {it.key} is listed twice")
        seen.add(it.key)
    fitting = [it for it in items if it.nbytes <= capacity_bytes and it.in_region <= region_cap]
    needs = _needs(fitting, keep_states_with_parameters)
    if keep_states_with_parameters:  # a parameter whose states cannot be kept cannot be either
        with_states = {it.param_idx for it in items if it.kind == "optimizer_state"}
        fitting = [
            it
            for it in fitting
            if it.kind != "parameter" or id(it) in needs or it.param_idx not in with_states
        ]
    kept = _greedy(fitting, capacity_bytes, region_cap, needs)
    used, optimal = "greedy", False
    if (
        sum(it.nbytes for it in fitting) <= capacity_bytes
        and sum(it.in_region for it in fitting) <= region_cap
    ):  # everything fits: nothing to decide
        kept, used, optimal = list(fitting), "none", True
    elif solver == "ilp" and fitting:
        found = _cp_sat(fitting, capacity_bytes, region_cap, kept, deterministic_s, needs)
        if found is not None and sum(it.moved_bytes for it in found[0]) >= sum(it.moved_bytes for it in kept):
            kept, optimal = found
            used = "ilp"
    kept_keys = frozenset(it.key for it in kept)
    by_kind = {k: 0 for k in STATE_ITEM_KINDS}
    off = {k: 0 for k in STATE_ITEM_KINDS}
    moved = {k: 0 for k in STATE_ITEM_KINDS}
    for it in items:
        if it.key in kept_keys:
            by_kind[it.kind] += it.nbytes
        else:
            off[it.kind] += it.nbytes
            moved[it.kind] += it.moved_bytes
    return StateResidency(
        kept=kept_keys,
        capacity_bytes=capacity_bytes,
        region_capacity_bytes=region_cap,
        kept_region_bytes=sum(it.in_region for it in kept),
        kept_bytes_by_kind=by_kind,
        offloaded_bytes_by_kind=off,
        moved_bytes_by_kind=moved,
        saved_bytes=sum(it.moved_bytes for it in kept),
        solver=used,
        optimal=optimal,
        states_with_parameters=keep_states_with_parameters,
    )
