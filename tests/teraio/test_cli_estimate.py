"""``teraio estimate``: what it prints and writes, that its files are ordinary profiles and plans the other
commands read, and one-line errors before any tracing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from teraio.planner.hardware import HardwareModel
from teraio.planner.plan import Plan
from teraio.planner.profile import Profile
from teraio.planner.safe_io import artifact_kind

from .cli_helpers import error_line, run_cli, tree
from .shared import once_per_run

TINY = ("estimate", "builtin:tiny", "--inner", "eager", "--time-limit", "5")


@pytest.fixture(scope="module")
def tiny_estimate(tmp_path_factory) -> tuple[Path, dict]:
    """One estimate of the tiny GPT on the H100 preset (greedy and pipeline: fast and deterministic), made
    once per test run (tests.teraio.shared): the xdist workers split this module's tests."""
    from teraio.cli import main

    def estimate() -> tuple[Path, dict]:
        out = tmp_path_factory.mktemp("est") / "tiny"
        import contextlib
        import io

        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            code = main(
                [
                    *TINY,
                    "--hardware",
                    "h100-nvl-4x990pro",
                    "--solvers",
                    "greedy,pipeline",
                    "--budget",
                    "50%",
                    "--out",
                    str(out),
                    "--json",
                ]
            )
        assert code == 0
        return out, json.loads(buf.getvalue())

    return once_per_run("cli-estimate-tiny", estimate)


def test_summary_has_what_a_buyer_asks(tiny_estimate):
    out, s = tiny_estimate
    assert s["device"] == "estimate:h100-nvl-4x990pro" and s["target"] == "builtin:tiny"
    (g,) = s["graphs"]
    assert g["unplanned_peak_bytes"] > 0 and g["activation_bytes"] > 0
    assert [r["solver"] for r in g["plans"]] == ["greedy", "pipeline"]
    for r in g["plans"]:
        assert r["planned_peak_bytes"] <= r["budget_bytes"] < r["unplanned_peak_bytes"]
        assert 0 < r["fraction_of_ideal"] <= 1
        assert r["step_s"] >= r["ideal_step_s"] == pytest.approx(g["compute_s"])
        assert r["activation_written_bytes"] > 0 and "needed_ssd_bw_bytes_per_s" in r
    st = s["model_states"]
    # fp32 AdamW, one GPU, everything resident: 4 + 4 + 8 bytes per parameter.
    assert st["param_nbytes"] == 4 * s["num_params"] and st["optimizer_state_nbytes"] == 8 * s["num_params"]
    assert s["states_mode"] == "resident" and s["state_traffic_per_step"] == {}


def test_outputs_are_ordinary_profiles_and_plans(tiny_estimate, capsys):
    out, s = tiny_estimate
    assert artifact_kind(out) == "estimate"
    profile = Profile.load(out / "profile")
    assert profile.meta["device"] == "estimate:h100-nvl-4x990pro"
    assert profile.meta["estimate"]["preset"] == "h100-nvl-4x990pro"
    assert json.loads((out / "estimate.json").read_text())["plan_files"] == [
        "plan-greedy.json",
        "plan-pipeline.json",
    ]
    hw = HardwareModel.load(out / "hardware.json")
    assert hw.tier("ssd").count == 4
    for name in ("plan-greedy.json", "plan-pipeline.json"):
        plan = Plan.load(out / name, profile=profile)  # checked completely against the profile
        assert plan.hardware == hw
    # The other commands read them as they read a measured profile's.
    code, text, err = run_cli(capsys, "simulate", out / "profile", out / "plan-greedy.json", "--json")
    assert code == 0, err
    assert json.loads(text)["violations"] == []


def test_what_if_overrides_reach_the_hardware_model(tmp_path, capsys):
    out = tmp_path / "o"
    code, text, err = run_cli(
        capsys,
        *TINY,
        "--hardware",
        "h100-nvl-4x990pro",
        "--solvers",
        "greedy",
        "--ssds",
        "8",
        "--ssd-bw",
        "7GB",
        "--budget",
        "60%",
        "--out",
        out,
        "--json",
    )
    assert code == 0, err
    ssd = HardwareModel.load(out / "hardware.json").tier("ssd")
    assert ssd.count == 8 and ssd.read_bw_bytes_per_s == 7e9
    assert json.loads(text)["ssd_aggregate_bw_bytes_per_s"] == 56e9
    # A second estimate may replace the first (it is teraio's); a foreign directory needs --force.
    code, _, err = run_cli(capsys, *TINY, "--hardware", "cpu-local", "--solvers", "greedy", "--out", out)
    assert code == 0, err
    assert HardwareModel.load(out / "hardware.json").name == "cpu-local"


def test_streamed_states_report_their_traffic(tmp_path, capsys):
    code, text, err = run_cli(
        capsys,
        *TINY,
        "--hardware",
        "h100-nvl-4x990pro",
        "--solvers",
        "greedy",
        "--gpus",
        "2",
        "--states",
        "streamed",
        "--out",
        tmp_path / "s",
        "--json",
    )
    assert code == 0, err
    s = json.loads(text)
    n = s["num_params"]
    assert (
        s["model_states"]["zero_stage"] == 3
        and s["model_states"]["device_nbytes"] == s["model_states"]["gathered_nbytes"]
    )
    # One device's share (half) of fp32 parameters: read three times, written once.
    assert s["state_traffic_per_step"]["param"] == {"read_bytes": 3 * 2 * n, "write_bytes": 2 * n}
    (r,) = s["graphs"][0]["plans"]
    assert r["fraction_of_ideal_bound_with_states"] <= r["fraction_of_ideal"]
    # The budget is the device's memory less the gathered layer: all of a tiny model's activations fit.
    assert r["budget_bytes"] == 94_000_000_000 - s["model_states"]["gathered_nbytes"]


def test_the_table_says_it_is_an_estimate(tmp_path, capsys):
    code, text, err = run_cli(
        capsys, *TINY, "--hardware", "cpu-local", "--solvers", "greedy", "--out", tmp_path / "t"
    )
    assert code == 0, err
    assert "estimated from the captured graph" in text and "not measured" in text
    assert "greedy (off)" in text and "of ideal" in text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--hardware", "h200"), "unknown hardware preset 'h200'; choose one of: a100-40g-g10"),
        (("--hardware", "cpu-local", "--ssds", "0"), "--ssds must be at least 1"),
        (("--hardware", "cpu-local", "--ssd-bw", "fast"), "--ssd-bw 'fast' is not a bandwidth"),
        (("--hardware", "cpu-local", "--budget", "lots"), "--budget"),
        (("--hardware", "cpu-local", "--solvers", "magic"), "unknown solver 'magic'"),
        (("--hardware", "cpu-local", "--gpus", "0"), "--gpus must be at least 1"),
        (("--hardware", "cpu-local", "--time-limit", "0"), "--time-limit must be positive"),
        (("--hardware", "cpu-local", "--time-limit", "nan"), "--time-limit must be positive"),
        (("--hardware", "cpu-local", "--workers", "100000"), "--workers must be at most 1024"),
        (("--hardware", "cpu-local", "--seq", str(2**40)), "--seq must be at most"),
        (("--hardware", "cpu-local", "--ssds", "5000"), "--ssds must be at most 4096"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, args, message):
    before = tree(tmp_path)
    line = error_line(capsys, *TINY, *args, "--out", tmp_path / "o")
    assert message in line
    assert tree(tmp_path) == before


def test_a_foreign_directory_is_not_replaced(tmp_path, capsys):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep")
    line = error_line(capsys, *TINY, "--hardware", "cpu-local", "--out", foreign)
    assert "not a teraio estimate" in line and "--force" in line
    assert (foreign / "notes.txt").read_text() == "keep"
