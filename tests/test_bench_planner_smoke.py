"""Smoke test of the planner benchmark at tiny size: it runs, its rows are consistent, the CLI prints."""

from __future__ import annotations

import json

from benchmarks import bench_planner


def test_run_tiny():
    df = bench_planner.run(layers=(2,), budgets=("80%",), hidden=128, seq=256, batch=4, time_limit_s=5)
    assert list(df["solver"]) == ["all", "greedy", "ilp"]
    by = df.set_index("solver")
    assert by.loc["ilp", "within_budget"] and by.loc["greedy", "within_budget"]
    assert by.loc["ilp", "step_s"] <= by.loc["greedy", "step_s"] + 1e-12
    assert (df["step_s"] >= df["compute_s"]).all()
    assert "| synth-2L | 80% | ilp |" in bench_planner.to_markdown(df)


def test_cli_json(capsys, tmp_path):
    out = tmp_path / "rows.csv"
    args = [
        "--layers",
        "1",
        "--budget",
        "60%",
        "--solvers",
        "greedy",
        "--time-limit",
        "5",
        "--json",
        "--out",
        str(out),
    ]
    assert bench_planner.main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["machine"]["cpus"] >= 1 and doc["rows"][0]["solver"] == "greedy"
    assert out.read_text().startswith("profile,")
