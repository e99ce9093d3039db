"""The whole-step budget holds on models beyond the suite's own (Note: [The streamed step's chunks are
sized to the budget] in teraio.states.residency): five HF architectures and the tiny GPT, AdamW, the
parameters, gradients and optimizer states on disk with the default ``chunk_bytes`` (64 MiB, more than
each model's whole state), at 40% or 60% of the whole step (the rest by hand: ``CASES``). The plan's prediction stays within the
budget (the streamed step's chunks cut to fit), the measured whole step (the optimizer step included)
is within 5% of the prediction, and every run is bit-identical to the same loop without teraio."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import teraio
from teraio.planner.budget import BudgetError

from .models import HF_MODELS
from .states_loop import train_hf, whole_state_backend

STEPS = 8  # the memory outside the graphs (an HF model's logits) is measured and planned for by then
PEAK_TOLERANCE = 0.05
MODELS = ["gpt-tiny", *HF_MODELS]


def _run(name: str, enabled: bool, budget: str, offload_dir: str) -> dict[str, Any]:
    losses, params, state, stats = train_hf(
        name, "adamw", offload_dir, STEPS, whole_state_backend(enabled, budget)
    )
    return {"losses": losses, "params": params, "state": state, "whole": stats.get("whole_step")}


@functools.cache
def _reference(name: str, offload_dir: str) -> dict[str, Any]:
    return _run(name, False, "40%", offload_dir)


# In CI: the tiny GPT at both budgets (its 40% run is the one whose kept choice pairs states with
# parameters), GPT-2 and BERT at 40% (their default chunks are cut to fit: the assertion below), Llama at
# 60%; the rest by hand (`pytest -m expensive`: 100 s of CPU, T5 alone 26 s at 40% and 32 s at 60% on a
# fresh clone), Qwen2 among them (a decoder like Llama: RMSNorm, rotary positions, grouped-query
# attention) and T5 (an encoder-decoder).
IN_CI = {
    ("gpt-tiny", "40%"),
    ("gpt-tiny", "60%"),
    ("hf-gpt2", "40%"),
    ("hf-bert", "40%"),
    ("hf-llama", "60%"),
}
CASES = [
    pytest.param(
        name, budget, id=f"{name}-{budget}", marks=[] if (name, budget) in IN_CI else [pytest.mark.expensive]
    )
    for name in MODELS
    for budget in ("40%", "60%")
]


@pytest.mark.parametrize(("name", "budget"), CASES)
def test_the_whole_step_budget_holds_and_the_run_is_exact(name, budget, tmp_path_factory):
    ref = _reference(name, str(tmp_path_factory.getbasetemp() / f"ref-{name}"))
    got = _run(name, True, budget, str(tmp_path_factory.mktemp("off")))

    assert len(ref["losses"]) == len(got["losses"]) == STEPS
    assert all(torch.equal(a, b) for a, b in zip(ref["losses"], got["losses"]))
    assert ref["params"].keys() == got["params"].keys()
    assert all(torch.equal(ref["params"][n], got["params"][n]) for n in ref["params"])
    assert ref["state"].keys() == got["state"].keys()
    for i in ref["state"]:
        assert all(torch.equal(ref["state"][i][k], got["state"][i][k]) for k in ref["state"][i]), i

    whole = got["whole"]
    pred, meas, budget_bytes = (
        whole["predicted_peak_bytes"],
        whole["measured_peak_bytes"],
        whole["budget_bytes"],
    )
    assert pred <= budget_bytes, whole
    if name.startswith("hf-") and budget == "40%":  # the default chunk, the whole state, did not fit
        assert whole["chunk_bytes"] < 64 << 20, whole
    assert meas is not None and whole["measured_moments"]["through_optimizer_step_peak_bytes"] is not None
    assert abs(meas / pred - 1) <= PEAK_TOLERANCE, (meas, pred, whole["measured_moments"])
    # Note: [A kept parameter keeps its states when the step overlaps] in teraio.planner.kept_states.
    # (When that choice does not fit, the serial step's is made, and the step may still overlap with it:
    # its kept parameters are then updated in opt.step(), the others in the next forward.)
    kept = {(kind, i) for kind, i in (whole["kept"] or {}).get("kept", [])}
    if name == "gpt-tiny":  # the overlapped step's own choice fits here: the check below is not vacuous
        assert (whole["kept"] or {}).get("states_with_parameters"), whole
    if (whole["kept"] or {}).get("states_with_parameters"):
        assert whole["overlap_step"], whole
        assert all(("optimizer_state", i) in kept for kind, i in kept if kind == "parameter"), kept


def test_a_budget_the_streamed_step_cannot_fit_names_the_smallest_whole_step_peak(tmp_path):
    """Three wide layers and one sample: the graph fits 40% of the whole step with every parameter on
    disk (it holds the three weights while it runs), the streamed step does not (three weights' values,
    gradients and moments at once, even a weight a chunk): one BudgetError naming the smallest peak,
    raised at the planning step, before anything is kept."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 512, bias=False),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 512, bias=False),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 512, bias=False),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    be = teraio.backend(
        inner="eager",
        solver="greedy",
        profiling=teraio.Profiling(steps=1),
        memory_budget="40%",
        states=teraio.States(optimizer=opt, model=model, gradients=True, parameters=True, min_param_bytes=0),
        offload_dirs=[str(tmp_path)],
    )
    compiled = torch.compile(model, backend=be)
    x = torch.randn(1, 512)
    try:
        with pytest.raises(BudgetError, match="streamed optimizer step needs at least") as exc:
            for _ in range(4):
                compiled(x).sum().backward()
                opt.step()
                opt.zero_grad()
    finally:
        be.close()
    assert "\n" not in str(exc.value)
    weight_bytes = 512 * 512 * 4
    # Three weights, each with its gradient and two moments, in memory together.
    assert exc.value.smallest_peak_bytes >= 3 * 4 * weight_bytes


def test_show_flags_every_whole_step_measured_over_its_budget(tmp_path, capsys):
    """``teraio show RUN_DIR`` reads every stats line: a measurement over the budget is flagged once
    (the lines after it repeat it), one within the budget is not."""
    import json

    from teraio.cli import main

    def line(step: int, measured: int) -> str:
        whole = {
            "budget_bytes": 1000,
            "predicted_peak_bytes": 990,
            "measured_peak_bytes": measured,
            "state_bytes": 800,
            "unplanned_activation_bytes": 1700,
            "fixed_bytes": 0,
            "kept": {"kept_bytes_by_kind": {}},
        }
        return json.dumps({"step": step, "whole_step": whole})

    (tmp_path / "stats.jsonl").write_text(
        "\n".join([line(3, 980), line(4, 1100), line(5, 1100), line(6, 1000), line(7, 1050)]) + "\n"
    )
    assert main(["show", str(tmp_path), "--json"]) == 0
    (rank,) = json.loads(capsys.readouterr().out)["ranks"].values()
    over = rank["whole_step_over_budget"]
    assert [(o["step"], o["measured_peak_bytes"]) for o in over] == [(4, 1100), (7, 1050)]
    assert over[0]["over_fraction"] == pytest.approx(0.1)
    assert main(["show", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("OVER its budget") == 2 and "+10.0%" in out and "as of step 4" in out


def test_the_benchmark_reports_the_same_runs(capsys):
    """``python -m benchmarks.bench_whole_step_budget``: its rows for one model and budget."""
    import json

    from benchmarks.bench_whole_step_budget import main

    assert main(["--models", "gpt-tiny", "--budgets", "60%", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["model"] == "gpt-tiny" and row["bit_identical"] is True
    assert row["predicted_of_budget"] <= 1.0 and row["measured_peak_bytes"] > 0
