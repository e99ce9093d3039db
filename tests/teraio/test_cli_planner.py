"""The planner commands end to end, in-process through ``teraio.cli.main`` (plus one real subprocess)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch.overrides import TorchFunctionMode

from teraio.cli import main
from teraio.planner.hardware import HardwareModel
from teraio.planner.plan import Plan
from teraio.profiling.disk_calibration import COMPUTE_BLOCK_PAIRS, _round_trips_under_compute
from tests.planner.planner_cases import MB, pyramid, ssd_only
from tests.teraio.cli_helpers import error_line as _error_line
from tests.teraio.cli_helpers import run_cli as _run

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def files(tmp_path):
    """A saved 8-op profile (ops of 150 ms), a hardware model of 1 GB/s write / 0.5 GB/s read."""
    prof = pyramid(duration_us=150_000.0).save(tmp_path / "prof")
    hw = tmp_path / "hw.json"
    ssd_only(write_bw=1e9, read_bw=0.5e9).save(hw)
    return tmp_path, prof, hw


def test_plan_json_then_simulate_show_roundtrip(files, capsys):
    tmp, prof, hw = files
    code, out, _ = _run(
        capsys,
        "plan",
        prof,
        "--budget",
        "300MB",
        "--solver",
        "greedy",
        "--hardware",
        hw,
        "-o",
        tmp / "p.json",
        "--json",
    )
    assert code == 0
    res = json.loads(out)
    for key in (
        "status",
        "solver",
        "solve_s",
        "baseline_peak_bytes",
        "predicted_peak_bytes",
        "predicted_step_s",
        "predicted_stall_s",
        "moved_bytes",
        "lower_bound_s",
        "gap",
    ):
        assert key in res
    assert res["solver"] == "greedy" and res["baseline_peak_bytes"] == 400 * MB
    # The lower bound is the plan's own (stored in its stats) and never above its step.
    assert res["lower_bound_s"] <= res["predicted_step_s"] and 0 <= res["gap"] < 1
    assert res["predicted_peak_bytes"] <= 300 * MB and res["moved_bytes"] == 100 * MB
    plan = Plan.load(tmp / "p.json")
    assert plan.predicted_peak_bytes == res["predicted_peak_bytes"] and plan.hardware.name == "test"

    code, out, _ = _run(capsys, "simulate", prof, tmp / "p.json", "--json")
    sim = json.loads(out)
    assert code == 0 and sim["violations"] == []
    assert (sim["peak_bytes"], sim["step_s"], sim["stall_s"], sim["written_bytes"]) == (
        plan.predicted_peak_bytes,
        plan.predicted_step_s,
        plan.predicted_stall_s,
        100 * MB,
    )

    code, out, _ = _run(capsys, "show", tmp / "p.json")
    assert code == 0 and "moved tensors by layer" in out and "blocks.0" in out and "greedy" in out
    assert f"{res['lower_bound_s']:.4f} s (gap" in out
    code, out, _ = _run(capsys, "show", tmp / "p.json", "--profile", prof, "--json", "--tensors")
    shown = json.loads(out)
    assert shown["layers"] == [
        {
            "layer": "blocks.0",
            "tensors": 1,
            "nbytes": 100 * MB,
            "tiers": ["ssd"],
            "recomputed": 0,
            "recomputed_bytes": 0,
            "recompute_s": 0.0,
        }
    ]
    assert shown["decisions"][0]["name"] == "t0"
    assert (shown["decisions"][0]["write_rank"], shown["decisions"][0]["read_rank"]) == (0, 0)
    assert (shown["lower_bound_s"], shown["gap"]) == (res["lower_bound_s"], res["gap"])


def test_simulate_what_if_and_timeline(files, capsys):
    tmp, prof, hw = files
    assert (
        main(
            [
                "plan",
                str(prof),
                "--budget",
                "200MB",
                "--solver",
                "greedy",
                "--hardware",
                str(hw),
                "-o",
                str(tmp / "p.json"),
            ]
        )
        == 0
    )
    capsys.readouterr()
    slow = json.loads(_run(capsys, "simulate", prof, tmp / "p.json", "--json")[1])
    assert slow["stall_s"] > 0
    fast = json.loads(
        _run(
            capsys,
            "simulate",
            prof,
            tmp / "p.json",
            "--json",
            "--ssds",
            "4",
            "--ssd-bw",
            "4GB",
            "--timeline",
            tmp / "io.csv",
        )[1]
    )
    assert fast["stall_s"] == 0 and fast["hardware"]["tiers"]["ssd"]["count"] == 4
    io = pd.read_csv(tmp / "io.csv")
    assert set(io["direction"]) == {"write", "read"} and len(io) == 2 * len(
        Plan.load(tmp / "p.json").decisions
    )
    tight = json.loads(_run(capsys, "simulate", prof, tmp / "p.json", "--json", "--budget", "100MB")[1])
    assert [v["kind"] for v in tight["violations"]] == ["budget"]
    assert "exceeds the budget" in tight["violations"][0]["message"]
    code, out, _ = _run(capsys, "simulate", prof, tmp / "p.json")
    assert code == 0 and "worst stalls" in out and "TB written per day" in out


def test_sweep_table_and_csv(files, capsys):
    tmp, prof, hw = files
    code, out, _ = _run(
        capsys,
        "sweep",
        prof,
        "--budgets",
        "100%,75%,50%,25%,auto",
        "--solver",
        "greedy,none",
        "--hardware",
        hw,
        "--out",
        tmp / "s.csv",
    )
    assert code == 0 and "budget sweep" in out
    df = pd.read_csv(tmp / "s.csv")
    assert len(df) == 10 and list(df.columns[:4]) == ["solver", "budget_spec", "budget_bytes", "status"]
    g = df[df.solver == "greedy"].set_index("budget_spec")
    assert g.loc["25%", "status"] == "NO PLAN" and "smallest achievable peak" in g.loc["25%", "note"]
    assert g.loc["50%", "predicted_peak_bytes"] == 200 * MB
    assert g.loc["100%", "predicted_step_s"] <= g.loc["50%", "predicted_step_s"]
    assert g.loc["auto", "predicted_stall_s"] == 0
    n = df[df.solver == "none"].set_index("budget_spec")
    assert (n["predicted_peak_bytes"] == 400 * MB).all()
    code, out, _ = _run(capsys, "sweep", prof, "--budgets", "50%", "--json")
    assert code == 0 and json.loads(out)[0]["solver"] == "greedy"


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--budget", "lots"], "does not parse"),
        (["--budget", "100MB"], "smallest achievable peak is 191 MiB (200000000 bytes)"),
        (["--budget", "50%", "--solver", "magic"], "unknown solver 'magic'"),
        (["--budget", "50%", "--time-limit", "0"], "--time-limit must be positive"),
    ],
)
def test_plan_bad_input(files, capsys, args, fragment):
    tmp, prof, hw = files
    line = _error_line(capsys, "plan", prof, *args, "-o", tmp / "p.json")
    assert fragment in line
    assert not (tmp / "p.json").exists()


def test_bad_profiles_and_plans(files, capsys):
    tmp, prof, hw = files
    assert "does not exist" in _error_line(
        capsys, "plan", tmp / "nope", "--budget", "50%", "-o", tmp / "p.json"
    )
    (tmp / "empty").mkdir()
    assert "lacks ops.parquet" in _error_line(
        capsys, "plan", tmp / "empty", "--budget", "50%", "-o", tmp / "p.json"
    )
    (tmp / "multi").mkdir()
    (tmp / "multi" / "index.json").write_text(json.dumps({"graphs": ["graph0", "graph1"]}))
    assert "holds 2 graphs" in _error_line(
        capsys, "plan", tmp / "multi", "--budget", "50%", "-o", tmp / "x.json"
    )
    (tmp / "hw_bad.json").write_text("{")
    assert "not valid JSON" in _error_line(
        capsys, "plan", prof, "--budget", "50%", "--hardware", tmp / "hw_bad.json", "-o", tmp / "p.json"
    )

    assert main(["plan", str(prof), "--budget", "75%", "--solver", "greedy", "-o", str(tmp / "p.json")]) == 0
    good = json.loads((tmp / "p.json").read_text())
    (tmp / "corrupt.json").write_text((tmp / "p.json").read_text()[:100])
    assert "not valid JSON" in _error_line(capsys, "simulate", prof, tmp / "corrupt.json")
    (tmp / "future.json").write_text(json.dumps({**good, "schema_version": 99}))
    assert "schema_version 99 is not supported" in _error_line(capsys, "show", tmp / "future.json")
    other = pyramid(fingerprint="another-graph").save(tmp / "other")
    assert "re-plan" in _error_line(capsys, "simulate", other, tmp / "p.json")
    assert "re-plan" in _error_line(capsys, "show", tmp / "p.json", "--profile", other)
    assert "not a bandwidth" in _error_line(capsys, "simulate", prof, tmp / "p.json", "--ssd-bw", "fast")
    assert "--ssds must be at least 1" in _error_line(capsys, "simulate", prof, tmp / "p.json", "--ssds", "0")
    assert "does not parse" in _error_line(capsys, "sweep", prof, "--budgets", "50%,lots")


def test_calibrate_tiny_writes_a_hardware_model(tmp_path, capsys):
    out = tmp_path / "hw.json"
    code, stdout, _ = _run(
        capsys,
        "calibrate",
        tmp_path,
        "--size",
        "2MiB",
        "--block",
        "512KiB",
        "--repeats",
        "2",
        "-o",
        out,
        "--json",
    )
    assert code == 0
    res = json.loads(stdout)
    hw = HardwareModel.load(out)
    ssd = hw.tier("ssd")
    assert ssd.write_bw_bytes_per_s == res["write_bw_bytes_per_s"] > 0
    assert ssd.read_bw_bytes_per_s == res["read_bw_bytes_per_s"] > 0
    assert len(res["samples"]["direct_write_s"]) == 2 and res["direct_read_bw_bytes_per_s"] > 0
    # The runtime engine measures the model's figures; if it could not, the reason is in the warnings.
    assert res["method"].startswith("runtime.Engine") or any("runtime engine" in w for w in res["warnings"])
    assert "engine_write_s" in res["samples"] or res["method"] == "O_DIRECT"
    if res["method"].startswith("runtime.Engine"):
        # The compute thread's time in the graph's migration ops, per transfer: half a round trip.
        calls = res["samples"]["op_calls_round_trip_s"]
        assert len(calls) == 16 and ssd.cpu_s_per_transfer == res["cpu_s_per_transfer"] > 0
        # Note: [A transfer's CPU on a CPU-only step]: the I/O threads' CPU is measured (every request
        # wakes a thread), and with no accelerator the step pays the round trip made under compute.
        io_cpu = res["samples"]["io_threads_cpu_round_trip_s"]
        assert len(io_cpu) == 16 and statistics.median(io_cpu) > 0
        if not torch.cuda.is_available():
            under = res["samples"]["round_trip_under_compute_s"]
            assert len(under) == COMPUTE_BLOCK_PAIRS
            parts = statistics.median(c + io for c, io in zip(calls, io_cpu)) / 2
            expected = statistics.median(under) / 2 if statistics.median(under) > 0 else parts
            assert res["cpu_s_per_transfer"] == expected
    assert not list(tmp_path.glob(".teraio-calibrate-*"))  # the test file is removed


class _PointwiseSizes(TorchFunctionMode):
    """Records the number of elements of every tanh the block runs."""

    def __init__(self) -> None:
        super().__init__()
        self.numels: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.tanh:
            self.numels.append(args[0].numel())
        return func(*args, **(kwargs or {}))


def test_round_trips_under_compute_keep_every_intra_op_thread_busy(tmp_path) -> None:
    """Note: [A transfer's CPU on a CPU-only step]: the calibration's compute blocks must include ops that
    torch splits over its intra-op threads (above its 32768-element grain), as a model's step does, or
    they leave out the I/O threads' competition with those threads and price a transfer too low."""
    sizes = _PointwiseSizes()
    with sizes:
        extra = _round_trips_under_compute(tmp_path, pairs=1, checksum=False)
    assert len(extra) == 1
    wide = [n for n in sizes.numels if n >= 2 * 32768]
    assert len(wide) >= len(sizes.numels) // 4, sizes.numels


def test_calibrate_bad_input(tmp_path, capsys):
    assert "is not a directory" in _error_line(capsys, "calibrate", tmp_path / "nope", "--raw-only")
    assert "multiple of 4096" in _error_line(capsys, "calibrate", tmp_path, "--block", "1000", "--raw-only")
    assert "does not parse" in _error_line(capsys, "calibrate", tmp_path, "--size", "big", "--raw-only")


def test_subprocess_bad_budget_exits_2_without_traceback(tmp_path):
    prof = pyramid().save(tmp_path / "prof")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "teraio",
            "plan",
            str(prof),
            "--budget",
            "1MB",
            "-o",
            str(tmp_path / "p.json"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "smallest achievable peak" in r.stderr


def test_subprocess_ilp_checks_its_own_plans(files):
    """The check of the ILP's own plans (``TERAIO_CHECK_OWN_PLANS``, set in tests/conftest.py) reaches the
    CLI run as a subprocess: ``plan`` defaults to the ILP, whose plan records that it checked them."""
    tmp, prof, hw = files
    r = subprocess.run(
        [sys.executable, "-m", "teraio", "plan", str(prof), "--budget", "300MB", "--hardware", str(hw)]
        + ["-o", str(tmp / "p.json")],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    plan = Plan.load(tmp / "p.json")
    assert plan.solver == "ilp" and plan.stats.extra["own_plans_checked"] is True
    assert plan.stats.extra["own_plans"], "the model found no plan of its own to check"
