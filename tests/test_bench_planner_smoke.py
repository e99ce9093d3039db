"""Smoke test of the planner benchmark at tiny size: it runs, its rows are consistent, the CLI prints."""

from __future__ import annotations

import json

from benchmarks import bench_planner


def test_run_tiny():
    df = bench_planner.run(
        layers=(2,),
        budgets=("80%",),
        hardware=("io", "compute"),
        hidden=128,
        seq=256,
        batch=4,
        time_limit_s=60,
        deterministic_time_s=1,
    )
    assert list(df["solver"]) == ["greedy", "pipeline", "ilp"] * 2
    assert list(df["hardware"]) == ["io"] * 3 + ["compute"] * 3
    assert df["within_budget"].all()
    for _, rows in df.groupby("hardware"):
        by = rows.set_index("solver")
        assert by.loc["ilp", "step_s"] <= min(by.loc["greedy", "step_s"], by.loc["pipeline", "step_s"])
        # One bound per row group, below every plan's step.
        assert rows["lower_bound_s"].nunique() == 1 and (rows["lower_bound_s"] <= rows["step_s"]).all()
    assert (df["step_s"] >= df["compute_s"]).all()
    table = bench_planner.to_markdown(df)
    assert "| synth-2L | io | 80% | ilp |" in table and "overhead / bound" in table


def test_cli_json(capsys, tmp_path):
    out = tmp_path / "rows.csv"
    args = [
        "--layers",
        "1",
        "--budget",
        "60%",
        "--solvers",
        "greedy",
        "--hardware",
        "compute",
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
