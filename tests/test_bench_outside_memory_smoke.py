"""Smoke test of benchmarks/bench_outside_memory.py on the tiny GPT: it runs and reports every figure."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_outside_memory


def test_run_tiny(capsys) -> None:
    argv = ["--model", "tiny", "--budget", "60%", "--steps", "6", "--cpu-malloc", "release", "--json"]
    assert bench_outside_memory.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "tiny" and out["steps"] == 6 and out["budget_bytes"] > 0
    for key in ("predicted_peak_bytes", "measured_peak_bytes", "outside_plannings", "outside_bytes"):
        assert key in out, key
    assert out["measured_peak_bytes"] > 0 and out["running_steps"] >= 1


@pytest.mark.parametrize(
    ("argv", "words"), [(["--steps", "0"], "--steps must be at least 1"), (["--budget", "abc"], "--budget")]
)
def test_bad_input_exits_non_zero_before_any_work(argv, words, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        bench_outside_memory.main(argv)
    assert info.value.code == 2
    assert words in capsys.readouterr().err
