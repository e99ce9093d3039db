"""Smoke test of the comparison with PyTorch's activation_memory_budget at tiny size: every row runs and
says what it is. By hand (`pytest -m expensive`): it compiles the tiny GPT on Inductor about ten times (the
search's rounds, torch's ratios), minutes of CPU; tests/teraio/test_partitioner_search.py runs the
search in CI."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_vs_torch_budget


@pytest.mark.expensive
def test_run_tiny(capsys) -> None:
    argv = ["--models", "tiny", "--ratios", "0.5", "--low-ratios", "0.2", "--rounds", "1", "--json"]
    argv += ["--cpu-malloc", "release"]  # the worker process keeps glibc's defaults
    assert bench_vs_torch_budget.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    (res,) = out["results"]
    rows = res["rows"]
    assert {"torch", "torch@0.5", "teraio@0.5", "teraio@0.3"} <= set(rows)
    torch_row, teraio_row = rows["torch@0.5"], rows["teraio@0.5"]
    assert teraio_row["budget_bytes"] == torch_row["peak_bytes"]
    assert teraio_row["step_vs_torch"] > 0 and teraio_row["peak_vs_torch"] > 0
    # One round: the per-round ratio is that round's.
    assert teraio_row["step_vs_torch_paired"] == pytest.approx(
        teraio_row["steps_s"][0] / torch_row["steps_s"][0]
    )
    assert teraio_row["partitioner_search"][0]["ratio"] == 1.0
    assert len(teraio_row["steps_s"]) == 1
    assert res["torch_lowest_peak"]["ratio"] == 0.2
