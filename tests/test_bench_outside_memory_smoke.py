"""Smoke test of benchmarks/bench_outside_memory.py on the tiny GPT: it runs and reports every figure."""

from __future__ import annotations

import json

from benchmarks import bench_outside_memory


def test_run_tiny(capsys) -> None:
    argv = ["--model", "tiny", "--budget", "60%", "--steps", "6", "--cpu-malloc", "release", "--json"]
    assert bench_outside_memory.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "tiny" and out["steps"] == 6 and out["budget_bytes"] > 0
    for key in ("predicted_peak_bytes", "measured_peak_bytes", "outside_plannings", "outside_bytes"):
        assert key in out, key
    assert out["measured_peak_bytes"] > 0 and out["running_steps"] >= 1


def test_bad_steps_exit_non_zero(capsys) -> None:
    try:
        bench_outside_memory.main(["--steps", "0"])
    except SystemExit as e:
        assert e.code == 2
    else:
        raise AssertionError("--steps 0 was accepted")
    assert "--steps must be at least 1" in capsys.readouterr().err
