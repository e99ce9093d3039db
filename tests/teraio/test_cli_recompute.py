"""The planner commands with recompute: ``teraio plan --recompute``, ``teraio show`` (no profile needed),
``teraio simulate`` and ``teraio sweep``'s per-mode columns, in-process through ``teraio.cli.main``."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from teraio.planner.plan import Plan
from tests.planner.planner_cases import MB, block, ssd_only
from tests.teraio.cli_helpers import error_line as _error_line
from tests.teraio.cli_helpers import run_cli as _run


@pytest.fixture
def files(tmp_path):
    """The block profile (h1 rebuilds from x in 0.1 ms) and a slow SSD (100 MB: 1 s each way)."""
    prof = block().save(tmp_path / "prof")
    hw = tmp_path / "hw.json"
    ssd_only(write_bw=0.1e9, read_bw=0.1e9).save(hw)
    return tmp_path, prof, hw


def test_plan_show_simulate_with_recompute(files, capsys):
    tmp, prof, hw = files
    args = ("plan", prof, "--budget", "200MB", "--solver", "pipeline", "--hardware", hw, "--json")
    code, out, _ = _run(capsys, *args, "--recompute", "joint", "-o", tmp / "p.json")
    assert code == 0
    res = json.loads(out)
    assert res["recompute"] == "joint" and res["recomputed_tensors"] == 1 and res["moved_tensors"] == 0
    assert res["recomputed_bytes"] == 100 * MB and res["recompute_s"] == pytest.approx(1e-4)
    assert res["predicted_step_s"] == pytest.approx(0.0081)
    doc = json.loads((tmp / "p.json").read_text())
    assert doc["schema_version"] == 3 and doc["recomputed_bytes"] == 100 * MB
    assert doc["decisions"][0]["action"] == "recompute" and doc["decisions"][0]["recompute_us"] == 100.0
    # Without --recompute, a solver that plans recompute plans joint; --recompute off only offloads.
    code, out, _ = _run(capsys, *args, "-o", tmp / "default.json")
    assert json.loads(out)["recompute"] == "joint" and json.loads(out)["recomputed_tensors"] == 1
    code, out, _ = _run(capsys, *args, "--recompute", "off", "-o", tmp / "off.json")
    assert json.loads(out)["recomputed_tensors"] == 0 and json.loads(out)["predicted_step_s"] > 1.0
    code, out, _ = _run(capsys, *args[:-3], "--solver", "greedy", "--json", "-o", tmp / "greedy.json")
    assert code == 0 and json.loads(out)["recompute"] == "off"  # TERAIO's baseline plans offload only

    # show needs no profile to say what is recomputed and what it costs.
    code, out, _ = _run(capsys, "show", tmp / "p.json", "--tensors")
    assert code == 0 and "1 tensors, 95.4 MiB rebuilt in backward, 0.0001 s of compute per step" in out
    assert "recompute" in out and "h1" in out
    shown = json.loads(_run(capsys, "show", tmp / "p.json", "--json", "--tensors")[1])
    assert shown["recomputed_tensors"] == 1 and shown["layers"][0]["recomputed"] == 1
    assert shown["decisions"][0]["action"] == "recompute"

    code, out, _ = _run(capsys, "simulate", prof, tmp / "p.json", "--json")
    sim = json.loads(out)
    assert code == 0 and sim["violations"] == [] and sim["recomputed_bytes"] == 100 * MB
    assert sim["step_s"] == pytest.approx(0.0081) and sim["recompute_s"] == pytest.approx(1e-4)
    code, out, _ = _run(capsys, "simulate", prof, tmp / "p.json")
    assert code == 0 and "rebuilds 0.0001" in out and "95.4 MiB rebuilt" in out


def test_simulate_reports_a_broken_recompute_decision(files, capsys):
    tmp, prof, hw = files
    _run(
        capsys,
        "plan",
        prof,
        "-b",
        "200MB",
        "--solver",
        "pipeline",
        "--hardware",
        hw,
        "--recompute",
        "only",
        "-o",
        tmp / "p.json",
    )
    doc = json.loads((tmp / "p.json").read_text())
    doc["decisions"][0]["fetch_before_idx"] = 7
    doc["decisions"][0]["prefetch_before_idx"] = 7
    doc["decisions"][0]["fetch_before_name"] = doc["decisions"][0]["prefetch_before_name"] = "op7"
    (tmp / "bad.json").write_text(json.dumps(doc))
    code, out, _ = _run(capsys, "simulate", prof, tmp / "bad.json", "--json")
    assert code == 1
    kinds = {v["kind"] for v in json.loads(out)["violations"]}
    assert "used_while_away" in kinds or "fetch_not_at_need" in kinds
    # Loading the plan with its profile refuses it with one line.
    assert "effective first backward need" in _error_line(capsys, "show", tmp / "bad.json", "--profile", prof)
    assert Plan.load(tmp / "bad.json").recomputes  # without the profile it still loads


def test_greedy_with_recompute_is_a_one_line_error(files, capsys):
    tmp, prof, hw = files
    line = _error_line(
        capsys,
        "plan",
        prof,
        "-b",
        "200MB",
        "--solver",
        "greedy",
        "--recompute",
        "joint",
        "-o",
        tmp / "g.json",
    )
    assert "offload-only baseline" in line


def test_sweep_shows_the_three_modes(files, capsys):
    tmp, prof, hw = files
    args = ("sweep", prof, "--budgets", "100%,75%,50%", "--solver", "pipeline,greedy", "--hardware", hw)
    code, out, _ = _run(capsys, *args, "--out", tmp / "s.csv")
    assert code == 0 and "joint s" in out
    df = pd.read_csv(tmp / "s.csv")
    for col in (
        "recompute",
        "recomputed_bytes",
        "recompute_s",
        "offload_step_s",
        "recompute_step_s",
        "joint_step_s",
    ):
        assert col in df.columns
    p = df[df.solver == "pipeline"].set_index("budget_spec")
    # 75% of 300 MB: h1 must go; offloading it stalls about 2 s, rebuilding it costs 0.1 ms.
    assert p.loc["75%", "offload_step_s"] > 1.0
    assert p.loc["75%", "recompute_step_s"] == pytest.approx(0.0081)
    assert p.loc["75%", "joint_step_s"] == pytest.approx(0.0081)
    # Each solver's rows are planned in its default mode: joint for pipeline.
    assert p.loc["75%", "recompute"] == "joint" and p.loc["75%", "recomputed_bytes"] == 100 * MB
    g = df[df.solver == "greedy"].set_index("budget_spec")
    assert g["recompute_step_s"].isna().all() and g["joint_step_s"].isna().all()
    # 50%: no plan of any mode (x and h1 are both alive at op 1).
    assert p.loc["50%", "status"] == "NO PLAN" and pd.isna(p.loc["50%", "joint_step_s"])
    rows = json.loads(_run(capsys, *args, "--recompute", "joint", "--json")[1])
    joint = [r for r in rows if r["solver"] == "pipeline" and r["budget_spec"] == "75%"][0]
    assert joint["recompute"] == "joint" and joint["recomputed_bytes"] == 100 * MB
    assert joint["predicted_step_s"] == pytest.approx(0.0081)
