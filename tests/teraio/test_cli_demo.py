"""``teraio demo`` (the main job) through ``teraio.cli.main``, at tiny size: its JSON keys, table and errors."""

from __future__ import annotations

import json
from pathlib import Path

from teraio.cli import main
from teraio.planner.hardware import HardwareModel
from teraio.profiling import disk_calibration

TINY = ["demo", "--model", "tiny", "--steps", "2", "--solver", "greedy"]


# The FX path and the built-in hardware model where a test is about neither Inductor nor calibration
# (compiles, and timing the directory and pricing transfers under the model's compute, took most of a
# demo run: 65 s under a loaded CI): the documented-keys test runs the demo on Inductor with the
# calibration, and the README's `make demo` block (through the installed command) on the FX path with it.
def tiny_fx(tmp_path: Path) -> list[str]:
    hardware = tmp_path / "hw.json"
    HardwareModel().save(hardware)
    return [*TINY, "--inner", "eager", "--hardware", str(hardware)]


def test_demo_json_has_the_documented_keys(capsys, monkeypatch, tmp_path: Path) -> None:
    # The calibration runs, with fewer of its timed pairs of compute blocks (most of its time on a loaded
    # machine): their count is tests/teraio/test_cli_planner.py's business, the demo's keys are this one's.
    monkeypatch.setattr(disk_calibration, "COMPUTE_BLOCK_PAIRS", 8)
    offload_dir = tmp_path / "off"
    offload_dir.mkdir()
    out_file = tmp_path / "demo.json"
    argv = [*TINY, "--json", "--offload-dir", str(offload_dir), "--out", str(out_file), "--round-steps", "3"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert json.loads(out_file.read_text()) == result
    # Two timed steps per method (fewer than a round), after one untimed switch step each.
    assert result["round_steps"] == 3 and result["switch_steps"] == 1
    rows = {r["method"]: r for r in result["rows"]}
    assert list(rows) == ["no-offload", "teraio", "torch-budget", "checkpoint", "teraio@checkpoint"]
    for row in rows.values():
        assert row["peak_bytes"] > 0 and row["step_s"] > 0 and 0 < row["fwd_bwd_s"] <= row["step_s"]
        assert len(row["step_times_s"]) == 2
        assert row["activation_bytes"] > 0  # saved by this method's own graph
    assert (
        result["activation_bytes"]
        == rows["no-offload"]["activation_bytes"]
        == rows["teraio"]["activation_bytes"]
    )
    assert rows["checkpoint"]["activation_bytes"] < result["activation_bytes"]
    teraio = rows["teraio"]
    assert teraio["predicted_peak_bytes"] > 0 and teraio["predicted_step_s"] > 0
    assert 0 <= teraio["predicted_stall_s"] < teraio["predicted_step_s"]
    assert teraio["moved_bytes_per_step"] > 0
    # Planned with the offload directory as timed before planning, in a process that keeps freed CPU
    # memory (Note: [Freed CPU memory and step time] in teraio.platform.cpu_malloc).
    assert teraio["hardware"] == f"calibrated:{offload_dir}"
    assert result["cpu_malloc"] == "retain"
    assert teraio["peak_bytes"] < rows["no-offload"]["peak_bytes"]
    # teraio at checkpointing's own measured peak: within 5% of it, exact (issue #13).
    at = rows["teraio@checkpoint"]
    assert at["budget_bytes"] == rows["checkpoint"]["peak_bytes"]
    assert at["peak_bytes"] <= 1.05 * rows["checkpoint"]["peak_bytes"]
    # PyTorch's own recompute at teraio's peak: the largest ratio measured within it, or its floor.
    torch_row = rows["torch-budget"]
    probes = [(p["ratio"], p["peak_bytes"]) for p in torch_row["ratio_probes"]]
    ratios = [r for r, _ in probes]
    assert torch_row["target_peak_bytes"] == teraio["peak_bytes"] and probes
    assert ratios == sorted(ratios, reverse=True) and len(set(ratios)) == len(ratios)  # stepping down
    within = [r for r, peak in probes if peak <= teraio["peak_bytes"]]
    assert torch_row["reaches_target"] is bool(within)
    if within:
        assert within == [ratios[-1]] == [torch_row["activation_memory_budget"]]
    else:
        assert torch_row["activation_memory_budget"] == min(probes, key=lambda p: p[1])[0]
    assert result["losses_bit_identical"] is True
    assert result["losses_bit_identical_by_method"] == {"teraio": True, "teraio@checkpoint": True}
    assert result["loss_differences_by_method"] == {"teraio": [], "teraio@checkpoint": []}
    assert list(offload_dir.iterdir()) == [], "the runtime left files in --offload-dir"


def test_teraio_at_checkpoint_below_teraio_floor_plans_for_the_floor(
    capsys, monkeypatch, caplog, tmp_path: Path
) -> None:
    # On the demo config checkpointing measured 234.3 MiB and teraio's floor was 236.0 MiB: the row
    # must run at the floor and say so, not end the demo with a budget error.
    import teraio.tools.demo as demo

    warm_up = demo._warm_up

    def checkpoint_far_below_the_floor(name, *args):
        m = warm_up(name, *args)
        if name == "checkpoint":
            m.peak_bytes //= 4
        return m

    monkeypatch.setattr(demo, "_warm_up", checkpoint_far_below_the_floor)
    methods = "no-offload,checkpoint,teraio@checkpoint"
    assert main([*tiny_fx(tmp_path), "--json", "--methods", methods]) == 0
    rows = {r["method"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    at = rows["teraio@checkpoint"]
    assert at["budget_raised_from_bytes"] == rows["checkpoint"]["peak_bytes"] < at["budget_bytes"]
    assert at["peak_bytes"] <= 1.05 * at["budget_bytes"]
    assert "below teraio's smallest achievable step peak" in caplog.text


def test_demo_refuses_teraio_at_checkpoint_without_checkpoint_first(capsys) -> None:
    assert main([*TINY, "--methods", "no-offload,teraio@checkpoint,checkpoint"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs checkpoint before it" in err


def test_demo_table_names_every_method_and_figure(capsys, tmp_path: Path) -> None:
    assert main([*tiny_fx(tmp_path), "--methods", "no-offload,teraio"]) == 0
    out = capsys.readouterr().out
    for word in ("no-offload", "teraio", "peak", "step s", "fwd+bwd s", "overhead", "predicted peak"):
        assert word in out, word
    assert "losses bit-identical to no-offload: yes" in out


def test_demo_rejects_bad_options_with_one_line(capsys, tmp_path: Path) -> None:
    for argv, needle in (
        ([*TINY, "--offload-dir", str(tmp_path / "missing")], "--offload-dir"),
        ([*TINY, "--methods", "teraio,magic"], "--methods"),
        ([*TINY, "--steps", "0"], "--steps"),
        ([*TINY, "--round-steps", "0"], "--round-steps"),
        ([*TINY, "--hardware", str(tmp_path / "missing.json")], "does not exist"),
        ([*TINY, "--cpu-malloc", "sometimes"], "--cpu-malloc"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err


def test_rounds_run_short_steps_in_a_row_and_every_method_the_same_steps() -> None:
    """Note: [Timing runs of steps] in teraio.tools.demo: the choice by step time, and the rounds' order."""
    from teraio.tools.demo import SHORT_STEP_ROUND_STEPS, DemoConfig, round_steps_for, run_rounds

    order: list[tuple[str, int]] = []

    class Fake:
        def __init__(self, name: str, step_s: float) -> None:
            self.name, self.steps_run, self.times, self.fwd_bwd_times = name, 0, [], []
            self.warm_up_times = [9.0] + [step_s] * 5  # the first step compiles

        def step(self, step: int, cfg: DemoConfig) -> tuple[float, float]:
            assert step == self.steps_run
            self.steps_run += 1
            order.append((self.name, step))
            return 0.001, 0.001

    short, long = [Fake("a", 0.005), Fake("b", 0.006)], [Fake("a", 2.0), Fake("b", 2.1)]
    assert round_steps_for(short, DemoConfig()) == SHORT_STEP_ROUND_STEPS
    assert round_steps_for(long, DemoConfig()) == 1
    assert round_steps_for(long, DemoConfig(round_steps=3)) == 3
    assert run_rounds(short, DemoConfig(steps=5), 3) == 2  # rounds of 3, then 2, each after a switch step
    assert [m.steps_run for m in short] == [7, 7] and [len(m.times) for m in short] == [5, 5]
    assert order == [
        *[("a", s) for s in range(4)],
        *[("b", s) for s in range(4)],
        *[("a", s) for s in range(4, 7)],
        *[("b", s) for s in range(4, 7)],
    ]
    order.clear()
    assert run_rounds(long, DemoConfig(steps=2), 1) == 0  # one step of each per round, none untimed
    assert order == [("a", 0), ("b", 0), ("a", 1), ("b", 1)]
