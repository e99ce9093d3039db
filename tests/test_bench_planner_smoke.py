"""Smoke test of the planner benchmark at tiny size: it runs, its rows are consistent, the CLI prints."""

from __future__ import annotations

import json

import pytest

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
        deterministic_time_s=0.2,
    )
    order = [("greedy", "off"), ("pipeline", "off"), ("ilp", "off")]
    order += [("pipeline", "only"), ("ilp", "only"), ("pipeline", "joint"), ("ilp", "joint")]
    assert list(zip(df["solver"], df["recompute"])) == order * 2
    assert list(df["hardware"]) == ["io"] * 7 + ["compute"] * 7
    assert df["within_budget"].all()
    for _, rows in df.groupby("hardware"):
        by = rows.set_index(["solver", "recompute"])["step_s"]
        assert by["ilp", "off"] <= min(by["greedy", "off"], by["pipeline", "off"])
        assert by["ilp", "joint"] <= min(by["ilp", "off"], by["ilp", "only"], by["pipeline", "joint"])
        # One bound per mode, below every plan's step of that mode.
        for _, same in rows.groupby("recompute"):
            assert same["lower_bound_s"].nunique() == 1 and (same["lower_bound_s"] <= same["step_s"]).all()
    assert (df["step_s"] >= df["compute_s"]).all()
    table = bench_planner.to_markdown(df)
    assert "| synth-2L | io | 80% | joint | ilp |" in table and "overhead / bound" in table
    assert "rebuilt MiB" in table


def test_cli_json(capsys, tmp_path):
    # --out in a world-writable directory where another user planted rows.csv -> a victim file: the safe
    # writer replaces the link itself (plain to_csv followed it and overwrote the victim).
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = shared / "rows.csv"
    out.symlink_to(victim)
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
    assert out.read_text().startswith("profile,") and not out.is_symlink()
    assert victim.read_text() == "precious\n"
    assert sorted(p.name for p in shared.iterdir()) == ["rows.csv"]  # no temporary file left


def test_cli_bad_out_is_one_line_before_any_solver_runs(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(
        bench_planner, "run", lambda **kw: pytest.fail("the solvers ran before --out was checked")
    )
    assert bench_planner.main(["--layers", "1", "--out", str(tmp_path / "missing" / "rows.csv")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err
