"""A graph called several times per step gets a plan per call (Note: [A graph called several times per
step is planned per call] in teraio.lifecycle.step_planner): each block of a model compiled on its own, torchtitan's way."""

from __future__ import annotations

import pytest
import torch

import teraio
from teraio.lifecycle.steps import invocation_ordinals
from teraio.planner.budget_split import GraphMemory, split_budget, step_peak
from teraio.tools.models.gpt import GPT, GPTConfig

from .shared import once_per_run

LAYERS = 4


def _train(enabled: bool, inner: str, budget: str, steps: int = 9, run_dir: str | None = None):
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = GPTConfig(layers=LAYERS, hidden=32, heads=2, seq=32, batch=2, vocab=64)
    model = GPT(cfg)
    backend = teraio.backend(
        memory_budget=budget,
        inner=inner,
        enabled=enabled,
        run_dir=run_dir,
        # The same plan on a loaded machine as on a quiet one: CP-SAT on its deterministic clock, one
        # worker, and a wall-clock limit that a 4-layer model never reaches.
        solver=teraio.Solver(time_limit=120, deterministic_time_limit=1.0, workers=1),
    )
    for block in model.blocks:
        block.compile(backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, grads = [], []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g)
        loss = model(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    stats = backend.stats()
    runner = backend.runners[0]
    budget_bytes = runner.step_budget_bytes
    backend.close()
    params = [p.detach().clone() for p in model.parameters()]
    return losses, grads, params, stats, budget_bytes


@pytest.fixture(scope="module")
def per_block_eager(tmp_path_factory):
    """Made once per test run (tests.teraio.shared): the xdist workers split this module's tests."""

    def runs():
        run_dir = tmp_path_factory.mktemp("per-call") / "run"
        return _train(False, "eager", "60%"), _train(True, "eager", "60%", run_dir=str(run_dir)), run_dir

    return once_per_run("per-call-plans-per-block-eager", runs)


def test_each_call_of_a_block_graph_has_its_own_plan_and_the_run_is_exact(per_block_eager) -> None:
    (l0, g0, p0, _, _), (l1, g1, p1, st, budget_bytes), _ = per_block_eager
    assert all(torch.equal(a, b) for a, b in zip(l0, l1))
    assert all(torch.equal(a, b) for ga, gb in zip(g0, g1) for a, b in zip(ga, gb))
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
    (graph,) = st["per_graph"]
    assert graph["invocations"] == 9 * LAYERS
    by_call = graph["moved_bytes_by_call"]
    assert len(by_call) == LAYERS, by_call
    # The first block's saved tensors are held longest, the last block's backward follows its forward.
    assert by_call[0] > by_call[-1], by_call
    assert by_call == sorted(by_call, reverse=True), by_call
    assert st["moved_bytes_per_step"] == sum(by_call)
    assert st["offloaded_bytes"] > 0 and st["prefetched_bytes"] == st["offloaded_bytes"]


def test_the_per_call_prediction_is_what_the_step_measures(per_block_eager) -> None:
    _, (_, _, _, st, budget_bytes), _ = per_block_eager
    measured, predicted = st["measured_peak_bytes"], st["predicted_peak_bytes"]
    assert measured is not None and predicted is not None, st
    # Once in a fresh clone (2026-11-29) the measurement was 22% below this same plan's prediction
    # (289,976 against 370,816; 379,752 in 10 runs since, alone and under load): what it printed then.
    seen = {k: st.get(k) for k in ("measured_step", "running_steps", "steps", "moved_bytes_per_step")}
    assert abs(measured - predicted) <= 0.05 * predicted, (measured, predicted, seen)
    assert measured <= 1.05 * budget_bytes, (measured, budget_bytes)


def test_teraio_show_lists_each_calls_plan(per_block_eager) -> None:
    from teraio.commands.show import _run_dir_summary

    _, (_, _, _, st, _), run_dir = per_block_eager
    (rank,) = _run_dir_summary(str(run_dir))["ranks"].values()
    shown = {g["graph"]: g["moved_bytes"] for g in rank["graphs"]}
    by_call = st["per_graph"][0]["moved_bytes_by_call"]
    assert shown["graph0"] == by_call[0]
    for j in range(1, len(by_call)):
        assert shown[f"graph0 call {j}"] == by_call[j], shown


def test_invocation_ordinals_count_a_graphs_forwards_within_each_step() -> None:
    a, b = object(), object()
    calls = [
        (a, "fwd", 1), (b, "fwd", 2), (a, "fwd", 3), (a, "bwd", 3), (b, "bwd", 2), (a, "bwd", 1),
        (a, "fwd", 4), (a, "bwd", 4),  # the next step starts again from 0
    ]  # fmt: skip
    assert invocation_ordinals(calls) == {1: 0, 2: 0, 3: 1, 4: 0}


def test_split_budget_gives_the_latest_calls_their_memory_first() -> None:
    """Four calls of one graph in flight together: a call's budget bounds its peak, and what it holds
    after its forward shrinks as its budget does. The earliest calls move the most."""
    calls = [((0, j), "fwd", j) for j in range(4)] + [((0, j), "bwd", j) for j in reversed(range(4))]
    nodes = [(0, j) for j in range(4)]

    def plan_graph(node, budget: int, fast: bool) -> GraphMemory:
        return GraphMemory(budget, max(10, budget - 60))

    unplanned = {n: GraphMemory(100, 40) for n in nodes}
    budgets = split_budget(
        calls, 200, unplanned, plan_graph, {n: 70 for n in nodes}, {n: 10 for n in nodes}, str,
        relax=list(reversed(nodes)),
    )  # fmt: skip
    memory = {n: plan_graph(n, b, False) for n, b in budgets.items()}
    assert step_peak(calls, memory)[0] <= 200
    assert budgets[(0, 3)] > budgets[(0, 0)], budgets
    assert budgets[(0, 0)] == 70, budgets  # the first call moves everything it can


def test_stats_lines_report_the_bytes_moved_by_kind(per_block_eager) -> None:
    import json

    _, (_, _, _, st, _), run_dir = per_block_eager
    last = json.loads((run_dir / "stats.jsonl").read_text().splitlines()[-1])
    by_kind = last["moved_bytes_by_kind"]
    assert set(by_kind) == {"activation", "parameter", "gradient", "optimizer_state"}
    assert by_kind["activation"] == last["offloaded_bytes"] + last["prefetched_bytes"] > 0
    assert by_kind["parameter"] == by_kind["gradient"] == by_kind["optimizer_state"] == 0
    assert st["moved_bytes_by_kind"]["activation"] >= by_kind["activation"]
