"""One budget over the whole step with states="offload" (Note: [The whole-step budget keeps some states in
memory] in teraio.states.residency): a percentage of parameters + gradients + optimizer states + the
activations' peak, activations planned, the parameters and states that fit kept in memory, the rest
streamed. Every run is compared bit for bit with the same loop without teraio's offload, and the whole
step's measured peak with its prediction."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import teraio
from teraio.errors import UserInputError
from teraio.planner.budget import BudgetError
from teraio.planner.kept_states import choose_resident_states
from teraio.states.residency import apply_residency, resident_state_bytes, state_memory
from teraio.tools.workloads import builtin_workload, compute_loss

from .states_loop import assert_same_hf_run, assert_same_run, train, train_hf, whole_state_backend

ROOT = Path(__file__).resolve().parents[2]
BUDGET = "40%"  # of parameters + gradients + optimizer states + the activations' unplanned step peak
PEAK_TOLERANCE = 0.05  # the whole step's measured peak against its prediction


def _check_whole_step(stats: dict, *, budget_fraction: float, tolerance: float = PEAK_TOLERANCE) -> dict:
    """The whole step's prediction fits the budget, the measurement is within ``tolerance`` of the
    prediction, and the plan kept some state in memory and left some on disk."""
    whole = stats["whole_step"]
    pred, meas = whole["predicted_peak_bytes"], whole["measured_peak_bytes"]
    assert pred is not None and meas is not None, whole
    assert pred <= whole["budget_bytes"], whole
    total = whole["state_bytes"] + whole["unplanned_activation_bytes"]
    assert whole["budget_bytes"] == int(budget_fraction * total), whole
    assert abs(meas / pred - 1) <= tolerance, (meas, pred)
    kept = whole["kept"]
    assert kept["kept_bytes"] > 0, kept
    assert sum(kept["offloaded_bytes_by_kind"].values()) > 0, kept
    return whole


@pytest.fixture(scope="module")
def adamw_runs(tmp_path_factory):
    """The tiny GPT with AdamW, whole model in one graph, without offload and at 40% of the whole step,
    the latter saving a checkpoint after step 3."""
    tmp = tmp_path_factory.mktemp("whole")
    old = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        ref = train("adamw", False, str(tmp / "ref"), steps=6)
        got = train(
            "adamw",
            True,
            str(tmp / "off"),
            steps=6,
            memory_budget=BUDGET,
            offload_parameters=True,
            save_after=3,
            checkpoint_out=str(tmp / "ckpt.pt"),
            run_dir=str(tmp / "run"),
        )
    finally:
        torch.use_deterministic_algorithms(old)
    return ref, got, tmp


def test_adamw_at_40_percent_of_the_whole_step_is_exact_shown_and_resumed(adamw_runs, capsys):
    """One run, three checks (the run is the expensive part, and a module fixture would run once per
    test worker): exact and as predicted; ``teraio show RUN_DIR`` reports its whole step; a checkpoint
    saved at step 3 finishes in a fresh process bit for bit."""
    from teraio.cli import main

    ref, got, tmp = adamw_runs
    assert_same_run(ref, got)
    whole = _check_whole_step(got.stats, budget_fraction=0.4)
    # One graph holds every offloaded parameter while it runs: keeping them costs nothing there, so the
    # plan keeps all of them (the most I/O saved per byte) and streams the optimizer states.
    assert whole["kept"]["kept_bytes_by_kind"]["parameter"] > 0
    assert whole["kept"]["offloaded_bytes_by_kind"]["optimizer_state"] > 0
    moved = got.stats["moved_bytes_by_kind"]
    assert moved["activation"] > 0 and moved["optimizer_state"] > 0 and moved["gradient"] > 0

    # teraio show RUN_DIR: the last stats line's whole-step budget, kept states and peaks.
    assert main(["show", str(tmp / "run"), "--json"]) == 0
    (rank,) = json.loads(capsys.readouterr().out)["ranks"].values()
    shown = rank["last_step"]["whole_step"]
    assert shown["budget_bytes"] == whole["budget_bytes"]
    assert shown["kept"]["kept_bytes_by_kind"] == whole["kept"]["kept_bytes_by_kind"]
    assert main(["show", str(tmp / "run")]) == 0
    out = capsys.readouterr().out
    assert "whole step: budget" in out and "kept in memory parameter" in out and "predicted peak" in out

    # The checkpoint of step 3, finished in a fresh process under the same budget.
    out_file = tmp / "finished.pt"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.teraio.states_loop",
            str(tmp / "ckpt.pt"),
            str(out_file),
            str(tmp / "fresh"),
            "--offload-parameters",
            "--budget",
            BUDGET,
            "--steps",
            "6",
        ],
        cwd=ROOT,
        check=True,
        timeout=600,
    )
    finished = torch.load(out_file, weights_only=False)
    assert len(finished["losses"]) == 3
    for i, (a, b) in enumerate(zip(ref.losses[3:], finished["losses"])):
        assert torch.equal(a, b), f"loss of step {3 + i}"
    for n in ref.params:
        assert torch.equal(ref.params[n], finished["params"][n]), n
    for i in ref.opt_state:
        for k in ref.opt_state[i]:
            assert torch.equal(ref.opt_state[i][k], finished["opt_state"][i][k]), (i, k)
    assert finished["stats"]["whole_step"]["kept"] is not None


# By hand (36 s of CPU on a fresh clone): the whole state on disk with Inductor runs in CI in
# tests/teraio/test_params_offload.py (per block) and tests/teraio/test_frozen_params.py (LoRA per block),
# validation forwards under a whole-step budget on the FX path in tests/teraio/test_loops.py's patterns.
@pytest.mark.expensive
def test_inductor_with_validation_forwards_at_50_percent_is_exact(tmp_path):
    """The whole model one Inductor graph, a validation forward under no_grad after every backward.
    Deterministic mode: Inductor's embedding backward adds its rows in a nondeterministic order
    otherwise (the token embedding's moments then differ in their last bits with or without teraio). At
    40% the tiny GPT's Inductor graph cannot fit (its floor, measured on Inductor's own buffers, is above
    it: a one-line BudgetError), so 50%."""
    old = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        kw = {"steps": 6, "inner": "inductor", "validate": True}
        ref = train("adamw", False, str(tmp_path / "ref"), **kw)
        got = train("adamw", True, str(tmp_path / "off"), memory_budget="50%", offload_parameters=True, **kw)
    finally:
        torch.use_deterministic_algorithms(old)
    assert_same_run(ref, got)
    assert len(got.val_losses) == 6
    assert all(torch.equal(a, b) for a, b in zip(ref.val_losses, got.val_losses))
    _check_whole_step(got.stats, budget_fraction=0.5)


def test_sgd_momentum_per_block_with_gradient_accumulation_is_exact(tmp_path):
    """Each block compiled on its own (one graph called once per block, the next block's parameters read
    ahead), 4 micro-batches accumulated into offloaded gradients. At 40% the tiny GPT's eager embedding
    and head (144 KiB that cannot move) and a block's graph with two blocks' parameters leave no room, so
    60%."""
    ref = train("sgd", False, str(tmp_path / "ref"), steps=6, micro_batches=4, per_block=True)
    got = train(
        "sgd",
        True,
        str(tmp_path / "off"),
        steps=6,
        micro_batches=4,
        per_block=True,
        memory_budget="60%",
        offload_parameters=True,
    )
    assert_same_run(ref, got)
    # The eager embedding's and head's tensors are outside the graphs and below the excess that is
    # planned for (Note: [Memory outside the graphs is measured and planned for]), and the parameters
    # and gradients in flight depend on the disk's pace: measured 4.2% above the prediction on a quiet
    # machine, so a looser bound than the single graph's.
    whole = _check_whole_step(got.stats, budget_fraction=0.6, tolerance=0.10)
    assert whole["fixed_bytes"] > 0  # the eager embedding and head stay


def _hf_run(name: str, opt_name: str, enabled: bool, offload_dir: str, budget: str) -> tuple:
    return train_hf(name, opt_name, offload_dir, 6, whole_state_backend(enabled, budget, chunk_bytes="64KiB"))


@pytest.mark.parametrize(
    ("name", "opt_name", "budget"),
    [
        # By hand: tests/teraio/test_whole_step_budget.py runs GPT-2 with AdamW at 40% in CI, with the
        # plan's own chunks and tighter checks; this one differs only in its 64 KiB chunks.
        pytest.param("hf-gpt2", "adamw", "40%", marks=pytest.mark.expensive),
        # At 40% the Llama-shaped model's one graph, holding all of its parameters while it runs, has no
        # room left for the 64 KiB its loop holds beside the graph once that is measured (the graph's
        # floor with its parameters is 903 KiB of the 919 KiB budget): teraio then warns and runs above
        # the budget. 45% leaves that room.
        ("hf-llama", "sgd", "45%"),
    ],
)
def test_hf_models_under_a_whole_step_budget_are_exact(name, opt_name, budget, tmp_path):
    ref = _hf_run(name, opt_name, False, str(tmp_path / "ref"), budget)
    got = _hf_run(name, opt_name, True, str(tmp_path / "off"), budget)
    assert_same_hf_run(ref, got)
    _check_whole_step(got[3], budget_fraction=int(budget[:-1]) / 100)


def _manual_loop(tmp_path, enabled: bool, between, states_options=None, **options) -> tuple:
    """Seven steps of the tiny GPT with AdamW (the whole model one graph), the parameters and states on
    disk when ``enabled``; ``between(backend, step)`` runs after each backward, before ``opt.step()``;
    ``states_options`` add teraio.States fields, ``options`` backend options.
    Returns the losses, final parameters, optimizer state and the backend's stats."""
    w = builtin_workload("tiny")
    torch._dynamo.reset()
    model = copy.deepcopy(w.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    be = teraio.backend(
        inner="eager",
        solver="greedy",
        profiling=teraio.Profiling(steps=1),
        enabled=enabled,
        states=teraio.States(
            optimizer=opt,
            model=model if enabled else None,
            parameters=enabled,
            chunk_bytes="64KiB",
            min_param_bytes=0,
            **(states_options or {}),
        ),
        offload_dirs=[str(tmp_path / str(enabled))],
        **options,
    )
    compiled = torch.compile(model, backend=be)
    losses = []
    try:
        for step in range(7):
            loss = compute_loss(compiled, w, step)
            loss.backward()
            if enabled:
                between(be, step)
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        params = {n: t.detach().clone() for n, t in model.state_dict().items()}
        state = {i: {k: v.clone() for k, v in st.items()} for i, st in opt.state_dict()["state"].items()}
        stats = be.stats()
    finally:
        be.close()
    return losses, params, state, stats


def _kept(be) -> frozenset:
    return be.states.stream.kept | be.states.residency.kept


def test_kept_states_go_back_to_disk_when_a_later_plan_drops_them(tmp_path):
    """Keep, drop and keep again between steps (what planning again does): the run stays exact and the
    memory the states hold follows the plan."""
    held, first = [], []

    def between(be, step):
        if step not in (2, 4, 6):
            return
        items = state_memory(be.states).items
        if step == 2:  # about half of the items
            plan = choose_resident_states(items, sum(it.nbytes for it in items) // 2)
            first.append(plan)
        elif step == 4:  # none: everything back on disk
            plan = None
        else:  # the items step 2 left on disk
            rest = [it for it in items if it.key not in first[0].kept]
            plan = choose_resident_states(rest, sum(it.nbytes for it in rest))
        be.states.grads.settle()
        apply_residency(be.states, plan)
        held.append((plan.kept_bytes if plan else 0, resident_state_bytes(be.states)))

    ref = _manual_loop(tmp_path, False, between, states_options={"gradients": True})
    got = _manual_loop(tmp_path, True, between, states_options={"gradients": True})
    assert_same_hf_run(ref, got)
    (kept2, res2), (kept4, res4), (kept6, res6) = held
    assert kept2 > 0 and kept4 == 0 and kept6 > 0
    # In memory between backward and the step: the kept items, and the last chunk of parameters the
    # previous step kept for this one's forward.
    assert res2 >= kept2 and res6 >= kept6 and res4 < res2


def test_updates_inside_backward_under_the_whole_step_budget_are_exact(tmp_path):
    """optimizer_in_backward with the whole-step plan; a residency planned while an update made inside
    backward awaits opt.step() (a forward between backward and the step plans) waits for its commit."""
    seen = []

    def between(be, step):
        if step == 4:
            seen.append(_kept(be))
            apply_residency(be.states, choose_resident_states(state_memory(be.states).items, 0))
            seen.append((be.states.after_commit is not None, _kept(be)))
        if step == 5:
            seen.append((be.states.after_commit, _kept(be)))

    ref = _manual_loop(tmp_path, False, between, memory_budget=BUDGET)
    got = _manual_loop(
        tmp_path, True, between, memory_budget=BUDGET, states_options={"optimizer_in_backward": True}
    )
    assert_same_hf_run(ref, got)
    whole = got[3]["whole_step"]
    assert whole["kept"] is not None and whole["kept"]["kept_bytes"] > 0  # planned after step 0
    kept_before, (pending, kept_while_pending), (after, kept_after) = seen
    assert kept_before and pending and kept_while_pending == kept_before  # not applied inside the step
    assert after is None and kept_after == frozenset()  # applied by opt.step(): nothing kept any more


def test_a_budget_below_the_parameters_that_cannot_move_names_them(tmp_path):
    w = builtin_workload("tiny")
    model = w.model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    be = teraio.backend(
        inner="eager",
        solver="greedy",
        profiling=teraio.Profiling(steps=1),
        memory_budget="5%",
        states=teraio.States(optimizer=opt),
        offload_dirs=[str(tmp_path)],
    )
    compiled = torch.compile(model, backend=be)
    try:
        with pytest.raises(BudgetError, match="parameters that cannot move") as info:
            for step in range(3):
                compute_loss(compiled, w, step).backward()
                opt.step()
                opt.zero_grad()
        assert "\n" not in str(info.value) and "teraio.States(parameters=True" in str(info.value)
    finally:
        be.close()


def test_a_bad_states_keep_fails_at_construction():
    opt = torch.optim.AdamW(builtin_workload("tiny").model.parameters())
    with pytest.raises(UserInputError, match="States.keep must be one of 'plan', 'none'") as info:
        teraio.backend(states=teraio.States(optimizer=opt, keep="all"))
    assert "\n" not in str(info.value)
