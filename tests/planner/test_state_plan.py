"""planner.state_plan: which parameters and optimizer states stay in memory under the whole-step budget."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from teraio.planner.kept_states import (
    StateItem,
    StatePlanError,
    choose_resident_states,
    state_items,
)


def _best_by_enumeration(items: list[StateItem], cap: int, region_cap: int) -> int:
    best = 0
    for r in range(len(items) + 1):
        for subset in itertools.combinations(items, r):
            if sum(it.nbytes for it in subset) <= cap and sum(it.in_region for it in subset) <= region_cap:
                best = max(best, sum(it.moved_bytes for it in subset))
    return best


def test_items_count_what_a_step_moves_for_each():
    items = state_items(
        param_nbytes=[400, 40, 400],
        state_nbytes=[800, 80, 0],
        offloadable_params=[0, 2],
        optimizer_in_backward=False,
        held_by_graphs=[2],
    )
    by_key = {it.key: it for it in items}
    # A parameter: read for forward, backward and the step, written once; a state: read and written once.
    assert by_key[("parameter", 0)].moved_bytes == 4 * 400
    assert by_key[("parameter", 0)].in_region == 400
    assert by_key[("parameter", 2)].in_region == 0  # held by its graph while it runs anyway
    assert by_key[("optimizer_state", 0)].moved_bytes == 2 * 800
    assert ("parameter", 1) not in by_key  # cannot move: not an item
    assert ("optimizer_state", 2) not in by_key  # no state (SGD without momentum)
    in_bwd = state_items(
        param_nbytes=[400], state_nbytes=[800], offloadable_params=[0], optimizer_in_backward=True
    )
    assert {it.key: it.moved_bytes for it in in_bwd}[("parameter", 0)] == 3 * 400


def test_everything_that_fits_is_kept_and_nothing_is_decided():
    items = state_items(
        param_nbytes=[100, 200],
        state_nbytes=[200, 400],
        offloadable_params=[0, 1],
        optimizer_in_backward=False,
    )
    r = choose_resident_states(items, 10_000)
    assert r.solver == "none" and r.optimal
    assert r.kept_bytes == 900 and r.moved_bytes_by_kind == {"parameter": 0, "optimizer_state": 0}


def test_a_parameter_saves_more_per_byte_than_a_state():
    items = [StateItem(0, "parameter", 100, 400), StateItem(0, "optimizer_state", 100, 200)]
    for solver in ("ilp", "greedy"):
        r = choose_resident_states(items, 150, solver=solver)
        assert r.kept == frozenset({("parameter", 0)}), solver
        assert r.saved_bytes == 400 and r.moved_bytes_by_kind["optimizer_state"] == 200


def test_the_region_capacity_binds_only_what_the_graphs_do_not_hold():
    # 300 bytes free in the step, 100 while the graphs run: the held parameter costs nothing there.
    items = [
        StateItem(0, "parameter", 200, 800, region_nbytes=0),
        StateItem(1, "optimizer_state", 100, 200),
        StateItem(2, "optimizer_state", 150, 300),
    ]
    r = choose_resident_states(items, 300, region_capacity_bytes=100)
    assert r.kept == frozenset({("parameter", 0), ("optimizer_state", 1)})
    assert r.kept_bytes == 300 and r.kept_region_bytes == 100 and r.optimal


def test_cp_sat_beats_the_greedy_where_ratios_mislead():
    # Greedy keeps the best ratio (51 bytes) and then nothing fits; two 50-byte items save more.
    items = [
        StateItem(0, "optimizer_state", 51, 110),
        StateItem(1, "optimizer_state", 50, 100),
        StateItem(2, "optimizer_state", 50, 100),
    ]
    greedy = choose_resident_states(items, 100, solver="greedy")
    exact = choose_resident_states(items, 100, solver="ilp")
    assert greedy.saved_bytes == 110 and not greedy.optimal
    assert exact.saved_bytes == 200 and exact.optimal and exact.solver == "ilp"


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(
        st.tuples(st.integers(1, 60), st.integers(0, 200), st.booleans(), st.booleans()),
        min_size=1,
        max_size=8,
    ),
    cap=st.integers(0, 250),
    region_cap=st.integers(0, 250),
)
def test_the_exact_knapsack_matches_enumeration_and_the_greedy_fits(sizes, cap, region_cap):
    items = [
        StateItem(
            j, "parameter" if is_param else "optimizer_state", n, moved, 0 if held and is_param else None
        )
        for j, (n, moved, is_param, held) in enumerate(sizes)
    ]
    exact = choose_resident_states(items, cap, region_capacity_bytes=region_cap, deterministic_s=5.0)
    greedy = choose_resident_states(items, cap, region_capacity_bytes=region_cap, solver="greedy")
    for r in (exact, greedy):
        kept = [it for it in items if it.key in r.kept]
        assert sum(it.nbytes for it in kept) == r.kept_bytes <= cap
        assert sum(it.in_region for it in kept) == r.kept_region_bytes <= region_cap
        assert r.saved_bytes == sum(it.moved_bytes for it in kept)
        moved = sum(r.moved_bytes_by_kind.values())
        assert moved + r.saved_bytes == sum(it.moved_bytes for it in items)
    assert exact.optimal
    assert exact.saved_bytes == _best_by_enumeration(items, cap, region_cap) >= greedy.saved_bytes


def test_an_overlapped_step_keeps_a_parameter_only_with_its_states():
    # Note: [A kept parameter keeps its states when the step overlaps]: a parameter read once fewer (3x),
    # and kept only with its states, which may be kept alone.
    items = state_items(
        param_nbytes=[100, 100, 100],
        state_nbytes=[200, 200, 0],
        offloadable_params=[0, 1, 2],
        optimizer_in_backward=False,
        overlap_step=True,
    )
    assert {it.key: it.moved_bytes for it in items}[("parameter", 0)] == 3 * 100
    for solver in ("ilp", "greedy"):
        # Serial: the parameters alone save the most per byte. Overlapped: a parameter and its states
        # (300 bytes) or the stateless parameter with one parameter's states.
        serial = choose_resident_states(items, 300, solver=solver)
        assert serial.kept == {("parameter", 0), ("parameter", 1), ("parameter", 2)}, solver
        paired = choose_resident_states(items, 300, solver=solver, keep_states_with_parameters=True)
        for kind, i in paired.kept:
            assert kind != "parameter" or i == 2 or ("optimizer_state", i) in paired.kept, solver
        assert paired.saved_bytes == 700, solver  # parameter 2 (300) and a state (400)
    # A parameter whose states do not fit is not kept either.
    big = [StateItem(0, "parameter", 10, 30), StateItem(0, "optimizer_state", 500, 1000)]
    for solver in ("ilp", "greedy"):
        r = choose_resident_states(big, 100, solver=solver, keep_states_with_parameters=True)
        assert r.kept == frozenset(), solver


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(1, 60), st.integers(0, 120)), min_size=1, max_size=4),
    cap=st.integers(0, 300),
)
def test_the_paired_knapsack_matches_enumeration(sizes, cap):
    items = state_items(
        param_nbytes=[p for p, _ in sizes],
        state_nbytes=[s for _, s in sizes],
        offloadable_params=range(len(sizes)),
        optimizer_in_backward=False,
        overlap_step=True,
    )
    exact = choose_resident_states(items, cap, deterministic_s=5.0, keep_states_with_parameters=True)
    greedy = choose_resident_states(items, cap, solver="greedy", keep_states_with_parameters=True)
    best = 0
    for r in range(len(items) + 1):
        for subset in itertools.combinations(items, r):
            keys = {it.key for it in subset}
            paired = all(
                it.kind != "parameter"
                or ("optimizer_state", it.param_idx) in keys
                or not sizes[it.param_idx][1]
                for it in subset
            )
            if paired and sum(it.nbytes for it in subset) <= cap:
                best = max(best, sum(it.moved_bytes for it in subset))
    for r in (exact, greedy):
        assert r.kept_bytes <= cap
        assert all(k != "parameter" or ("optimizer_state", i) in r.kept or not sizes[i][1] for k, i in r.kept)
    assert exact.optimal and exact.saved_bytes == best >= greedy.saved_bytes


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: choose_resident_states([], -1), "capacity_bytes"),
        (lambda: choose_resident_states([], 1, solver="exact"), "solver"),
        (lambda: choose_resident_states([StateItem(0, "gradient", 1, 2)], 1), "kind"),
        (lambda: choose_resident_states([StateItem(0, "parameter", 0, 2)], 1), "sizes"),
        (lambda: choose_resident_states([StateItem(0, "parameter", 2, 2, region_nbytes=3)], 1), "sizes"),
        (lambda: choose_resident_states([StateItem(0, "parameter", 1, 2)] * 2, 1), "twice"),
        (
            lambda: state_items(
                param_nbytes=[1], state_nbytes=[], offloadable_params=[], optimizer_in_backward=False
            ),
            "one per parameter",
        ),
        (
            lambda: state_items(
                param_nbytes=[1], state_nbytes=[1], offloadable_params=[3], optimizer_in_backward=False
            ),
            "not among",
        ),
    ],
)
def test_bad_arguments_are_one_line_errors(call, message):
    with pytest.raises(StatePlanError, match=message) as info:
        call()
    assert "\n" not in str(info.value)
