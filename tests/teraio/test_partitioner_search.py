"""The partitioner's own recompute as part of the plan (Note: [The partitioner's budget is part of the
plan] in teraio.lifecycle.partitioner_search): the option, the choice of ratios, the search end to end
(on the FX path in CI: the search's rounds are the same on both inner compilers, and each of Inductor's
takes 20-40 s to compile), and a fixed ratio bit-identical to the same compile without migration on both
inner compilers."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

import teraio
from teraio.config import BackendConfig
from teraio.errors import UserInputError
from teraio.lifecycle import partitioner_runoff
from teraio.lifecycle.backend import TeraioBackend
from teraio.lifecycle.partitioner_runoff import MAX_FINALISTS, RunOff
from teraio.lifecycle.partitioner_search import (
    RATIO_STEP,
    Candidate,
    PartitionerSearch,
    _GraphState,
    profile_steps,
    ratio_to_fit,
)
from teraio.lifecycle.phases import Phase
from teraio.planner.budget import BudgetError
from teraio.profiling.op_timing import profiling_split
from teraio.tools.workloads import builtin_workload

from .models import HF_MODELS
from .training import assert_bit_identical, train

STEPS = 16
#: The search's rounds (about 15 steps), its trial (about 12) and steps after it.
TRIAL_STEPS = 34
RUNOFF_ROUNDS = 3
DETERMINISTIC = {"deterministic_time_limit": 2.0, "workers": 1}
UNMEASURED = teraio.Profiling(measure_memory=False)


# ------------------------------------------------------------------------------------------- option
@pytest.mark.parametrize("value", [1.5, -0.1, "auto", True, "0.5"])
def test_a_partitioner_budget_that_is_not_a_ratio_or_search_is_refused(value) -> None:
    with pytest.raises(UserInputError, match="Solver.partitioner_budget must be a ratio from 0 to 1"):
        teraio.Solver(partitioner_budget=value)


@pytest.mark.parametrize("budget", [None, "auto"])
def test_the_search_without_a_memory_budget_is_refused_at_construction(budget) -> None:
    with pytest.raises(UserInputError, match="compares plans within a memory_budget"):
        teraio.backend(memory_budget=budget, solver=teraio.Solver(partitioner_budget="search"))


def test_ratios_fit_the_need_linearly_and_stop_at_zero() -> None:
    assert ratio_to_fit(1000, 0, 1.0) == 1.0
    assert ratio_to_fit(1000, 500, 1.0) == pytest.approx(0.5)
    assert ratio_to_fit(1000, 501, 1.0) == pytest.approx(0.49)  # rounded down: the estimate must fit
    assert ratio_to_fit(1000, 250, 0.8) == pytest.approx(0.6)  # from the process's own ratio
    assert ratio_to_fit(1000, 1000, 1.0) == 0.0 and ratio_to_fit(1000, 5000, 1.0) == 0.0
    assert ratio_to_fit(0, 10, 1.0) == 0.0
    assert (
        abs(ratio_to_fit(1000, 333, 1.0) / RATIO_STEP - round(ratio_to_fit(1000, 333, 1.0) / RATIO_STEP))
        < 1e-6
    )


def test_each_candidate_is_timed_on_three_calibration_steps_at_least() -> None:
    """Note: [The partitioner's budget is part of the plan]: candidates are compared on their calibrated
    times, never on one step each."""
    search = teraio.Solver(partitioner_budget="search")
    for solver, steps, states, expected in [
        (search, 3, None, 5),
        (search, 6, None, 6),  # more when asked
        (teraio.Solver(), 3, None, 3),  # no search: as asked
        (teraio.Solver(partitioner_budget=0.5), 3, None, 3),
        (search, 3, teraio.States(optimizer=torch.optim.SGD([torch.zeros(1)])), 3),  # no search with states
    ]:
        cfg = BackendConfig(
            memory_budget="50%", solver=solver, profiling=teraio.Profiling(steps=steps), states=states
        )
        assert profile_steps(cfg) == expected, (solver, steps, states)
    assert profiling_split(profile_steps(BackendConfig(memory_budget="50%", solver=search))) == (2, 3)


def test_a_fit_still_over_the_budget_is_followed_by_a_lower_ratio_then_between() -> None:
    """The built-in GPT's figures: the default partition peaked at 948 MiB, the first fit (0.39) still at
    467 MiB for a 379 MiB budget; the secant through both asks for 0.27, then halfway back is 0.69."""
    search = PartitionerSearch(SimpleNamespace(budget_bytes_override=379))
    search._fit = 0.39
    search.candidates = [Candidate(1.0, unplanned_bytes=948), Candidate(0.39, unplanned_bytes=467)]
    assert search._next_ratio([]) == pytest.approx(0.27)
    search.candidates.append(Candidate(0.27, unplanned_bytes=371))
    assert search._next_ratio([]) == pytest.approx(0.69)
    search.candidates.append(Candidate(0.69, unplanned_bytes=659))
    assert search._next_ratio([]) is None


def test_below_a_fit_that_cannot_meet_the_budget_the_search_goes_back_up() -> None:
    """At 0.3 of the built-in GPT's peak the first fit (0.29) could not be met at all: lower ratios peak
    higher there, so the next is halfway back (0.64), then none."""
    search = PartitionerSearch(SimpleNamespace(budget_bytes_override=285))
    search._fit = 0.29
    failed = Candidate(0.29, unplanned_bytes=440, failure=BudgetError("no", smallest_peak_bytes=314))
    search.candidates = [Candidate(1.0, unplanned_bytes=948), failed]
    assert search._next_ratio([]) == pytest.approx(0.64)
    search.candidates.append(Candidate(0.64, unplanned_bytes=659))
    assert search._next_ratio([]) is None


@pytest.mark.parametrize("rounds", [-1, 1.5, True, "3", 51])
def test_runoff_rounds_that_are_not_a_whole_number_in_range_are_refused(rounds) -> None:
    with pytest.raises(UserInputError, match="Solver.runoff_rounds must be a whole number from 0 to 50"):
        teraio.Solver(runoff_rounds=rounds)


# ------------------------------------------------------------------------------------------ the trial
def test_the_finalists_are_the_candidates_predicted_near_the_fastest() -> None:
    """Note: [The search's finalists are timed against each other]: within RUNOFF_MARGIN, fastest first,
    at most MAX_FINALISTS."""
    c = [
        Candidate(r, predicted_step_s=t)
        for r, t in [(1.0, 2.0), (0.5, 1.0), (0.7, 1.1), (0.3, 1.15), (0.6, 1.12)]
    ]
    assert [f.ratio for f in partitioner_runoff.finalists(c)] == [0.5, 0.7, 0.6]
    assert [f.ratio for f in partitioner_runoff.finalists(c[:2])] == [0.5]  # 2.0 is far from 1.0: no trial


def _finalists(n: int) -> list[Candidate]:
    return [Candidate(1.0 - i / 10, predicted_step_s=1.0 + i / 100) for i in range(n)]


def test_the_trial_runs_one_timed_step_per_turn_after_each_finalists_compile() -> None:
    runoff = RunOff(_finalists(2), rounds=2)
    a, b = runoff.finalists
    order = []
    for step in range(100):
        f = runoff.next_finalist(step)
        if f is None:
            break
        order.append(f)
        runoff.timed(step, {id(a): 3.0, id(b): 2.0}[id(f)] + step / 1000)
    # a: its compile's step, then a timed one; b the same; then one each.
    assert order == [a, a, b, b, a, b]
    assert a.times_s == [3.001, 3.004] and b.times_s == [2.003, 2.005]
    assert runoff.done and runoff.winner() is b and runoff.next_finalist(7) is None


def test_a_time_that_arrives_late_counts_for_the_finalist_that_ran_the_step() -> None:
    """On a GPU a step's time is read from CUDA events, possibly after the next step started."""
    runoff = RunOff(_finalists(2), rounds=1)
    a, b = runoff.finalists
    assert [runoff.next_finalist(s) for s in (0, 1, 2)] == [a, a, a]  # step 1's time not read yet
    runoff.timed(1, 5.0)
    assert runoff.next_finalist(3) is b and a.times_s == [5.0]
    runoff.timed(0, 9.0)  # the compile's step: never counted
    assert a.times_s == [5.0]


def test_a_turn_whose_steps_are_never_timed_ends_and_an_untimed_finalist_cannot_win() -> None:
    runoff = RunOff(_finalists(2), rounds=1)
    a, b = runoff.finalists
    steps = [runoff.next_finalist(s) for s in range(partitioner_runoff.MAX_TURN_STEPS + 1)]
    assert steps == [a] * partitioner_runoff.MAX_TURN_STEPS + [b]  # none of a's steps was timed
    runoff.next_finalist(5)
    runoff.timed(5, 7.0)
    assert runoff.next_finalist(6) is None and runoff.winner() is b
    nobody = RunOff(_finalists(3), rounds=3)
    while nobody.next_finalist(nobody.steps) is not None:
        pass
    assert nobody.winner() is nobody.finalists[0]  # nothing timed: the fastest predicted
    # A round without any timed step ends the trial: one round of untimed turns, not three.
    assert nobody.steps == 3 * partitioner_runoff.MAX_TURN_STEPS


class _Graph:
    """A runner as the search's end sees it."""

    def __init__(self, partition: float) -> None:
        self.is_training, self.partitioner_budget, self.profile = True, partition, None


def _state(partition: float, tag: str) -> _GraphState:
    return _GraphState(
        partitioner_budget=partition,
        profile=None,
        profiler=None,
        profiling=None,
        plan=tag,  # type: ignore[arg-type]
        plans={},
        step_budget_bytes=None,
        computation_fingerprint=tag,
    )


def test_a_candidate_planned_on_a_graph_the_step_no_longer_calls_is_left_out() -> None:
    """Dynamo compiled the step again during the search: the first candidate planned a graph no longer
    called, so it cannot be compared, however fast predicted; only the graphs compiled next are restored,
    each with the partition of its own state (one profiling for a later round keeps its own)."""
    gone, step_graph, profiling = _Graph(0.5), _Graph(0.7), _Graph(0.7)
    planner = SimpleNamespace(predicted_step_peak_bytes=None)
    search = PartitionerSearch(planner)  # type: ignore[arg-type]
    search.candidates = [
        Candidate(1.0, predicted_step_s=0.1, graphs={gone: _state(1.0, "a")}),
        Candidate(
            0.5, predicted_step_s=0.2, graphs={step_graph: _state(0.5, "b"), profiling: _state(0.5, "b")}
        ),
        Candidate(0.7, predicted_step_s=0.3, graphs={step_graph: _state(0.7, "c")}),
    ]
    search._done = True  # as plan() sets it before the end
    assert search._end([step_graph]) is False  # type: ignore[list-item]
    assert (step_graph.partitioner_budget, step_graph.plan) == (0.5, "b")
    assert (profiling.partitioner_budget, getattr(profiling, "plan", None)) == (0.7, None)
    assert (gone.partitioner_budget, getattr(gone, "plan", None)) == (0.5, None)
    assert search.ratio_for_new_graph() == 0.5


def test_a_loop_that_ends_during_the_trial_saves_the_plans_that_ran_last() -> None:
    """close() during the trial: the run directory gets the profiles and plans of the finalist whose code
    the graphs ran last (without it, no plan of the searched graphs was written), with the times so far."""
    saved: list[tuple[str, object]] = []
    first, second = _Graph(0.5), _Graph(0.7)
    for g in (first, second):
        g.profile = object()  # type: ignore[assignment]
        g.backend = SimpleNamespace(save_profile=lambda r: saved.append(("profile", r)))  # type: ignore[attr-defined]
    planner = SimpleNamespace(save_plan=lambda r: saved.append(("plan", r)), predicted_step_peak_bytes=None)
    search = PartitionerSearch(planner)  # type: ignore[arg-type]
    a = Candidate(0.5, predicted_step_s=0.1, graphs={first: _state(0.5, "a")})
    b = Candidate(0.7, predicted_step_s=0.1, graphs={second: _state(0.7, "b")})
    search.candidates, search._done = [a, b], True
    search.runoff = RunOff([a, b], rounds=3)
    for step in range(3):  # a's compile step, a's timed step, then b's compile step
        search.runoff.next_finalist(step)
        search.runoff.timed(step, 1.0)
    assert search.on_trial and search.runoff.active.candidate is b
    search.at_close()
    assert saved == [("profile", second), ("plan", second)]
    assert not search.on_trial and search.ratio_for_new_graph() == 0.7
    assert (a.measured_step_s, a.timed_steps, b.measured_step_s, b.timed_steps) == (1.0, 1, None, 0)
    search.at_close()  # at interpreter exit again: nothing more
    assert len(saved) == 2


# ------------------------------------------------------------------------------------- end to end
def searching_backend(offload_dir) -> TeraioBackend:
    """The FX path at 60% of the step with the partitioner search, on CP-SAT's deterministic clock."""
    return TeraioBackend(
        inner="eager",
        memory_budget="60%",
        offload_dirs=[str(offload_dir)],
        solver=teraio.Solver(partitioner_budget="search", runoff_rounds=RUNOFF_ROUNDS, **DETERMINISTIC),
        profiling=UNMEASURED,
    )


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """The tiny GPT on the FX path at 60% with the search, every fitting candidate a finalist of the trial
    (Note: [The search's finalists are timed against each other] in teraio.lifecycle.partitioner_runoff),
    its step times replaced by fixed ones in which the slowest predicted finalist is the fastest; and the
    same steps without migration at the ratio it chose."""
    tmp = tmp_path_factory.mktemp("search")
    workload = builtin_workload("tiny")
    ran: list[tuple[int, float]] = []  # (step, ratio of the finalist that ran it)
    fake: dict[float, float] = {}
    next_finalist, timed = RunOff.next_finalist, RunOff.timed

    def recording_next(self, step_index):
        f = next_finalist(self, step_index)
        if f is not None:
            ran.append((step_index, f.candidate.ratio))
            if not fake:  # the slowest predicted takes 1 s a step, the others 2 s
                slowest = max(self.finalists, key=lambda g: g.candidate.predicted_step_s)
                fake.update({g.candidate.ratio: 1.0 if g is slowest else 2.0 for g in self.finalists})
        return f

    def fixed_times(self, step_index, seconds):
        f = self._step_of.get(step_index)
        return timed(self, step_index, fake[f.candidate.ratio] if f is not None else seconds)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(partitioner_runoff, "RUNOFF_MARGIN", float("inf"))
        mp.setattr(RunOff, "next_finalist", recording_next)
        mp.setattr(RunOff, "timed", fixed_times)
        be = searching_backend(tmp)
        settled: list[bool] = []  # at each step boundary of the trial
        boundary = be.partitioner_search.at_step_boundary

        def recording_boundary(step_index):
            settled.append(be.settled)
            return boundary(step_index)

        be.partitioner_search.at_step_boundary = recording_boundary
        try:
            got = train(workload, be, TRIAL_STEPS)
            stats = be.stats()
        finally:
            be.close()
    stats["settled_in_trial"] = settled
    chosen = be.runners[0].partitioner_budget
    reference = train(
        workload,
        TeraioBackend(
            inner="eager",
            enabled=False,
            profiling=UNMEASURED,
            solver=teraio.Solver(partitioner_budget=chosen),
        ),
        TRIAL_STEPS,
    )
    return be, stats, got, reference, ran, fake


def test_the_search_plans_several_ratios_and_times_its_finalists_in_turns(searched) -> None:
    be, stats, _, _, ran, fake = searched
    tried = stats["partitioner_search"]
    assert len(tried) >= 2, f"the default partition's plan moved nothing: no search ({tried})"
    assert tried[0]["ratio"] == 1.0 and all(t["ratio"] < 1.0 for t in tried[1:])
    fitting = [t for t in tried if t["fits"]]
    assert len(fitting) >= 2, f"one candidate fits: no trial ({tried})"
    finalists = sorted(fitting, key=lambda t: t["predicted_step_s"])[:MAX_FINALISTS]
    assert set(fake) == {t["ratio"] for t in finalists}
    # Turns: one timed step each, round after round; a finalist's first turn has its compile's step too.
    turns = [r for i, (_, r) in enumerate(ran) if i == 0 or ran[i - 1][1] != r]
    order = [t["ratio"] for t in finalists]
    assert turns == order * RUNOFF_ROUNDS, ran
    assert [s for s, _ in ran] == list(range(ran[0][0], ran[0][0] + len(ran))), "a step ran outside the turns"
    for t in fitting:
        timed = t["ratio"] in fake
        assert t["timed_steps"] == (RUNOFF_ROUNDS if timed else 0)
        assert t["measured_step_s"] == (fake[t["ratio"]] if timed else None)
    winner = min(finalists, key=lambda t: fake[t["ratio"]])
    assert winner is max(finalists, key=lambda t: t["predicted_step_s"]), "the trial decided nothing"
    assert be.runners[0].partitioner_budget == winner["ratio"]
    assert [g["partitioner_budget"] for g in stats["per_graph"]] == [winner["ratio"]]
    assert be.runners[0].profile.meta["calibration_steps"] >= 3  # the winner's, from its own round
    budget = be.runners[0].step_budget_bytes
    assert all(t["predicted_peak_bytes"] <= budget for t in fitting), (budget, fitting)
    assert stats["predicted_step_s"] == pytest.approx(winner["predicted_step_s"])
    # Not settled while the finalists were timed; settled since.
    assert stats["settled_in_trial"] and not any(stats["settled_in_trial"]) and stats["settled"]
    # The trial's steps stay out of the step statistics: only the steps after it were counted.
    after_trial = TRIAL_STEPS - (ran[-1][0] + 1)
    assert after_trial > 0 and stats["running_steps"] == after_trial


def test_every_candidate_is_planned_for_the_budget_of_the_default_partition(searched) -> None:
    """A fraction is of the step without teraio: the smaller peak of a lower ratio does not shrink it."""
    be, *_ = searched
    assert be.planner.budget_bytes_override == be.runners[0].step_budget_bytes
    assert be.runners[0].plan.budget_bytes <= be.runners[0].step_budget_bytes


def test_the_searched_run_is_bit_identical_to_no_migration_at_the_chosen_ratio(searched) -> None:
    """On the FX path the partitioner's recompute runs the same aten ops: every step, the search's rounds
    included, computes the bits of the compile without migration at the ratio the search chose."""
    be, _, got, reference, _, _ = searched
    assert (
        any(r.plan is not None and r.plan.decisions for r in be.runners)
        or be.runners[0].partitioner_budget < 1
    )
    assert_bit_identical(reference, got)


# Inductor by hand (`pytest -m expensive`, 60-90 s of six Inductor compiles each): CI runs the FX path,
# whose partitioner call and compiles take the ratio the same way.
@pytest.mark.parametrize(
    ("model", "inner"),
    [
        ("gpt-tiny", "eager"),
        ("hf-llama", "eager"),
        pytest.param("gpt-tiny", "inductor", marks=pytest.mark.expensive),
        pytest.param("hf-llama", "inductor", marks=pytest.mark.expensive),
        pytest.param("hf-gpt2", "inductor", marks=pytest.mark.expensive),
    ],
)
def test_a_fixed_ratio_with_a_plan_is_bit_identical_to_the_same_ratio_without(model, inner, tmp_path) -> None:
    """The plan on top of the partitioner's recompute (``partitioner_budget=0.5``): the same bits as the
    same partition without migration, from the same state, on both inner compilers."""
    workload = builtin_workload("tiny") if model == "gpt-tiny" else HF_MODELS[model]()
    old, threads = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    try:
        with torch._inductor.config.patch(deterministic=True):
            traces = []
            for enabled in (False, True):
                be = TeraioBackend(
                    inner=inner,
                    enabled=enabled,
                    # At ratio 0.5 less is left to move: the largest budgets that still move something.
                    memory_budget={"gpt-tiny": "85%", "hf-llama": "96%", "hf-gpt2": "97%"}[model],
                    offload_dirs=[str(tmp_path)],
                    profiling=UNMEASURED,
                    solver=teraio.Solver(name="greedy", partitioner_budget=0.5),
                )
                try:
                    traces.append(train(workload, be, 8))
                finally:
                    be.close()
                training = [r for r in be.runners if r.is_training]
                assert training and all(r.partitioner_budget == 0.5 for r in training)
                if enabled:
                    assert any(r.plan is not None and r.plan.decisions for r in training)
    finally:
        torch.use_deterministic_algorithms(old)
        torch.set_num_threads(threads)
    assert_bit_identical(traces[0], traces[1])


def test_a_ratio_profiled_before_the_last_runs_its_own_plan(monkeypatch, tmp_path) -> None:
    """The search chooses the default partition after profiling another ratio: the plan is compiled for
    the default partition's graphs (on the FX path the last profiled graphs are another partition's: Note:
    [One trace per graph on the FX path] in teraio.graph.compilers), and the run is exact."""
    end = PartitionerSearch._end

    def the_first_candidate_wins(self, ready):
        for c in self.candidates[1:]:
            if c.predicted_step_s is not None:
                c.predicted_step_s += 1e6
        return end(self, ready)

    monkeypatch.setattr(PartitionerSearch, "_end", the_first_candidate_wins)
    workload = builtin_workload("tiny")
    be = searching_backend(tmp_path)
    try:
        got = train(workload, be, STEPS)
        tried = be.stats()["partitioner_search"]
    finally:
        be.close()
    assert len(tried) >= 2 and be.runners[0].partitioner_budget == tried[0]["ratio"] == 1.0
    assert not any(t["timed_steps"] for t in tried), "one finalist: no trial"
    reference = train(
        workload,
        TeraioBackend(
            inner="eager", enabled=False, profiling=UNMEASURED, solver=teraio.Solver(partitioner_budget=1.0)
        ),
        STEPS,
    )
    assert_bit_identical(reference, got)


def test_a_batch_of_another_size_during_the_search_keeps_every_graph_on_its_own_partition(tmp_path) -> None:
    """A smaller batch arrives once the search profiles its second ratio, then every fourth step: Dynamo
    compiles the frame again with dynamic shapes. The full batch's shape stays with the graph the search
    re-partitioned (no second profile of it, which planned the default partition's profile under another
    ratio and failed to compile), the small batch's graph starts at the round's ratio, and the run is
    bit-identical to the same batches without migration (the partition changes no bit on the FX path)."""
    base = builtin_workload("tiny")
    full = base.batch_at(0)
    small_steps: list[int] = []
    joined_at: list[float | None] = []  # the search's ratio when the small batch first ran
    be = searching_backend(tmp_path)
    search = be.partitioner_search

    def batch(step: int):
        if small_steps or search.candidates:  # from the second round on
            if not small_steps or step - small_steps[-1] == 4:
                if not small_steps:
                    joined_at.append(search.ratio_for_new_graph())
                small_steps.append(step)
        return tuple(t[:2] for t in full) if step in small_steps else full

    steps = 40
    try:
        got = train(dataclasses.replace(base, batch_for_step=batch), be, steps)
        stats = be.stats()
    finally:
        be.close()
    tried = stats["partitioner_search"]
    assert len(tried) >= 2 and small_steps and joined_at[0] == tried[1]["ratio"] < 1.0, (tried, joined_at)
    training = [r for r in be.runners if r.is_training]
    assert len(training) == 2, "the full batch's shape was profiled a second time"
    big, little = training
    assert big.phase is Phase.RUNNING and big.partitioner_budget in {t["ratio"] for t in tried}
    # Planned by itself at the partition it was profiled at (it was never ready in a round).
    assert little.phase is Phase.RUNNING and little.partitioner_budget == joined_at[0]
    assert little.plan is not None and little.profile is not None
    reference = train(
        dataclasses.replace(
            base, batch_for_step=lambda step: tuple(t[:2] for t in full) if step in small_steps else full
        ),
        TeraioBackend(
            inner="eager",
            enabled=False,
            profiling=UNMEASURED,
            solver=teraio.Solver(partitioner_budget=big.partitioner_budget),
        ),
        steps,
    )
    assert_bit_identical(reference, got)
