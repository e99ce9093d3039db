"""Smoke test of the what-if benchmark at tiny size: every section runs and the report says what it is."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_whatif, whatif_report


# By hand (`pytest -m expensive`): 150 s of one worker in a fresh clone of 89ddcae, a benchmark's
# minutes. CI covers its parts: the estimate from an HF config (tests/teraio/test_estimate.py), the what-if
# sweeps and presets (tests/planner/test_whatif.py), the report's helpers below.
@pytest.mark.slow
@pytest.mark.expensive
def test_run_tiny(tmp_path):
    r = bench_whatif.run(
        (("hf:llama-8b", 1),),
        (1, 4),
        swept=(("hf:llama-8b", 1),),
        time_limit_s=5,
        tf32=False,
        layers=1,
        seq=64,
        cpu_config="tiny",
        cpu_profile_steps=3,
        cpu_compute_reps=1,
        ssdtrain=True,
        ssdtrain_presets=("a100-40g-g10",),
        solvers=("greedy",),
        issue_command=False,
        in_process=True,
        workdir=str(tmp_path),
    )
    c = r["cpu_local"]
    assert c["same_saved_tensors"] and c["estimated_activation_bytes"] == c["measured_activation_bytes"]
    assert -1 <= c["spearman_ops"] <= 1 and -1 <= c["same_run"]["spearman_ops"] <= 1
    # The same graph priced with this run's own compute figures: only the durations differ.
    assert c["same_run_compute"]["matmul_flops_per_s"]["float32"] > 0
    assert len(c["same_run"]["largest_ops"]) == len(c["largest_ops"])
    assert [(x["model"], x["precision"], x["ssds"], x["solver"]) for x in r["rows"]] == [
        ("hf:llama-8b b1", "fp32", 4, "greedy")
    ]
    assert sorted(r["sweeps"]["hf:llama-8b b1"]) == [1, 4]
    for x in r["rows"]:
        assert 0 < x["fraction_bound_with_states"] <= x["fraction_of_ideal"] <= 1
    assert [round(x["ours_gib"], 2) for x in r["deepspeed"]["rows"]] == [0.12, 0.79, 6.10]
    assert [x["preset"] for x in r["ssdtrain"]] == ["a100-40g-g10"]
    assert all(0 <= x["activation_peak_cut"] <= 1 for x in r["ssdtrain"])
    text = bench_whatif.to_markdown(r)
    for heading in ("## 1.", "## 3.", "## 4.", "## 5.", "## 6."):
        assert heading in text
    assert "Every GPU figure here is an estimate" in text and "| TERAIO, Llama3-70B" not in text
    assert "- hf:llama-8b b1, greedy: the activations' I/O gives" in text  # where more drives stop helping
    assert "| DeepSpeed ZeRO-3 estimator, t5-3b" in text and "| SSDTrain" in text
    # --from-json writes the same report from the results a run printed with --json.
    saved = tmp_path / "results.json"
    saved.write_text(json.dumps(r, default=str))
    assert bench_whatif.to_markdown(bench_whatif.load_results(str(saved))) == text


def test_spearman_without_scipy():
    import numpy as np

    assert bench_whatif.spearman(np.array([1, 2, 3, 4]), np.array([10, 20, 30, 40])) == pytest.approx(1.0)
    assert bench_whatif.spearman(np.array([1, 2, 3, 4]), np.array([4, 3, 2, 1])) == pytest.approx(-1.0)


def test_sweep_findings_name_where_more_drives_stop_helping():
    def row(solver: str, fraction: float, bound: float) -> dict:
        return {
            "solver": solver,
            "step_s": 1.0,
            "fraction_of_ideal": fraction,
            "fraction_bound_with_states": bound,
        }

    sweeps = {
        "m b1": {
            1: [row("greedy", 0.60, 0.10)],
            2: [row("greedy", 0.90, 0.20)],
            4: [row("greedy", 0.998, 0.40)],
            8: [row("greedy", 1.0, 0.80)],
        }
    }
    (line, blank) = whatif_report.sweep_findings(sweeps)
    assert line.startswith("- m b1, greedy: the activations' I/O gives 100.0% of ideal from 4 drives on")
    assert "(more drives, 8, add nothing to it)" in line
    assert "rises with every drive: 10.0% at 1, 20.0% at 2, 40.0% at 4, 80.0% at 8." in line
    assert blank == "" and whatif_report.sweep_findings({}) == []
