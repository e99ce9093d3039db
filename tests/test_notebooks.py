"""Every notebook runs top to bottom, and the analysis helpers the notebooks call give the right tables.

The notebooks are executed in a fresh kernel that runs *this* interpreter: the test writes its own
kernelspec (``sys.executable -m ipykernel_launcher``) into a temporary ``JUPYTER_PATH`` entry, so a
clean clone with only ``pip install -e .[dev]`` works, and a user-level ``python3`` kernelspec pointing
at another Python cannot hijack the run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from teraio.planner.lifetimes import analyse
from teraio.planner.synth import synth_profile
from teraio.tools import analysis

REPO_ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO_ROOT / "notebooks").glob("*.ipynb"))
KERNEL_NAME = "teraio-test-python"


@pytest.fixture(scope="module")
def small_profile():
    profile = synth_profile(layers=2)
    return profile, analyse(profile)


@pytest.fixture
def test_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A kernelspec running this interpreter, found first through JUPYTER_PATH; returns its name."""
    spec_dir = tmp_path / "jupyter" / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "teraio test kernel",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    # The kernel inherits the environment: headless plotting.
    monkeypatch.setenv("MPLBACKEND", "Agg")
    return KERNEL_NAME


def test_there_are_notebooks() -> None:
    assert NOTEBOOKS, "no notebooks found under notebooks/"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path: Path, test_kernel: str) -> None:
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    # Stored without outputs so diffs stay small.
    stale = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not stale, f"{path.name}: clear the outputs of cells {stale} before committing"
    client = NotebookClient(
        nb,
        kernel_name=test_kernel,
        timeout=300,
        allow_errors=False,  # any cell error raises CellExecutionError naming the cell
        resources={"metadata": {"path": str(REPO_ROOT)}},
    )
    client.execute()
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code_cells), "some code cells did not run"
    errors = [o for c in code_cells for o in c.outputs if o.output_type == "error"]
    assert not errors


def test_import_is_cheap() -> None:
    code = "import sys, teraio.tools.analysis; print(sorted(m for m in ('torch', 'matplotlib') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_budget_sweep_rows_and_columns(small_profile) -> None:
    profile, lt = small_profile
    budgets = ["100%", "60%", "45%"]
    sweep = analysis.budget_sweep(profile, budgets, solver="greedy", lifetimes=lt)
    assert list(sweep.columns) == list(analysis.SWEEP_COLUMNS)
    assert sweep["budget_spec"].tolist() == budgets and (sweep["solver"] == "greedy").all()
    # The notebook's sweep is the planner's (one implementation), with a bound and a gap per plan.
    from teraio.planner.sweep import SWEEP_COLUMNS

    assert analysis.SWEEP_COLUMNS == SWEEP_COLUMNS
    assert (sweep["lower_bound_s"] <= sweep["predicted_step_s"]).all() and (sweep["gap"] >= 0).all()
    assert (sweep["predicted_peak_bytes"] <= sweep["budget_bytes"]).all()
    # At 100% nothing needs to move; tighter budgets give lower peaks.
    assert sweep.loc[0, "predicted_peak_bytes"] == lt.baseline_peak_bytes
    assert sweep["predicted_peak_bytes"].is_monotonic_decreasing
    assert sweep.loc[2, "predicted_peak_bytes"] < sweep.loc[1, "predicted_peak_bytes"]


def test_budget_sweep_keeps_going_past_an_impossible_budget(small_profile) -> None:
    profile, lt = small_profile
    too_small = lt.min_feasible_peak_bytes - 1
    sweep = analysis.budget_sweep(profile, ["50%", too_small], solver="greedy", lifetimes=lt)
    assert sweep["status"].tolist()[1] == "NO PLAN"
    assert sweep["predicted_peak_bytes"].isna().tolist() == [False, True]
    assert "smallest achievable peak" in sweep.loc[1, "note"]


def test_step_by_kind_puts_the_state_tensors_beside_the_plans_activations(small_profile) -> None:
    from teraio.planner.hardware import HardwareModel
    from teraio.planner.model_states import io_lower_bound_s
    from teraio.planner.simulate import simulate
    from teraio.planner.solve import solve

    profile, lt = small_profile
    sim = simulate(profile, solve(profile, budget="50%", solver="greedy", lifetimes=lt), lifetimes=lt)
    params = profile.tensors[profile.tensors["kind"] == "param"]
    p_bytes = int(params["nbytes"].sum())
    assert p_bytes > 0
    states = analysis.offload_states_of(profile)
    df = analysis.step_by_kind(profile, sim, model_states=states).set_index("kind")
    assert list(df.index) == ["activation", "parameter", "gradient", "optimizer_state"]
    assert df.loc["activation", "written_bytes"] == sim.written_bytes > 0
    # AdamW: two moments per parameter; weights read for forward, backward and the step, written once.
    assert df.loc["optimizer_state", "bytes"] == 2 * p_bytes == df.loc["optimizer_state", "written_bytes"]
    assert (df.loc["parameter", "read_bytes"], df.loc["parameter", "written_bytes"]) == (3 * p_bytes, p_bytes)
    assert df.loc["gradient", "read_bytes"] == p_bytes
    ssd = HardwareModel().tier("ssd")
    assert df.attrs["io_lower_bound_s"] == io_lower_bound_s(
        df["written_bytes"].sum(),
        df["read_bytes"].sum(),
        ssd.total_write_bw_bytes_per_s,
        ssd.total_read_bw_bytes_per_s,
    )
    ib = analysis.step_by_kind(
        profile,
        sim,
        model_states=analysis.offload_states_of(profile, optimizer_in_backward=True, offload_gradients=False),
    ).set_index("kind")
    assert ib.loc["gradient", "written_bytes"] == 0 and ib.loc["parameter", "read_bytes"] == 2 * p_bytes
    assert ib.attrs["io_lower_bound_s"] < df.attrs["io_lower_bound_s"]
    # A profile without model_states (states="keep"): activations only.
    keep = analysis.step_by_kind(profile, sim).set_index("kind")
    assert keep.loc[["parameter", "gradient", "optimizer_state"], "written_bytes"].sum() == 0


def test_top_inactive_tensors_ranks_by_bytes_times_idle_time(small_profile) -> None:
    _, lt = small_profile
    top = analysis.top_inactive_tensors(lt, n=5)
    assert len(top) == 5
    assert top["mib_s"].is_monotonic_decreasing
    cand = lt.candidates
    score = cand["nbytes"] * cand["inactive_us"]
    assert top.loc[0, "name"] == cand.loc[score.idxmax(), "name"]


def test_plots_draw_what_they_say(small_profile) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from teraio.planner.simulate import simulate
    from teraio.planner.solve import solve

    profile, lt = small_profile
    plan = solve(profile, budget="50%", solver="greedy", lifetimes=lt)
    sim = simulate(profile, plan, lifetimes=lt)
    try:
        ax = analysis.plot_memory_timeline(lt, {"greedy": sim}, budget_bytes=plan.budget_bytes)
        labels = [line.get_label() for line in ax.get_lines()]
        assert labels[:3] == ["unplanned", "smallest achievable", "greedy"]
        assert ax.get_lines()[2].get_ydata().max() == pytest.approx(sim.peak_bytes / 1024**2)

        ax = analysis.plot_io_timeline(sim, num_fwd_ops=lt.num_fwd_ops)
        # One write bar and one read bar per moved tensor.
        assert len(ax.patches) == 2 * len(plan.decisions)
        assert len(ax.get_yticklabels()) == len(plan.decisions)
    finally:
        plt.close("all")


def test_kept_states_sweep_keeps_weights_first_and_moves_less_with_more_room(small_profile) -> None:
    profile, _ = small_profile
    params = int(profile.tensors.loc[profile.tensors["kind"] == "param", "nbytes"].sum())
    rooms = [0, params // 2, params, 2 * params, 3 * params]
    df = analysis.kept_states_sweep(profile, rooms)
    assert list(df["capacity_bytes"]) == rooms and df["optimal"].all()
    assert (df["kept_parameter_bytes"] + df["kept_optimizer_state_bytes"] <= df["capacity_bytes"]).all()
    moved = list(df["moved_bytes"])
    assert moved[0] == 4 * params + 2 * 2 * params  # nothing kept: 3 reads + 1 write, 2 moments r+w
    assert moved == sorted(moved, reverse=True) and moved[-1] == 0  # everything fits in 3x
    room_for_weights = df.iloc[2]
    assert room_for_weights["kept_parameter_bytes"] == params  # a weight saves twice what a moment does
    assert room_for_weights["kept_optimizer_state_bytes"] == 0
    assert (df["io_lower_bound_s"].diff().dropna() <= 0).all()
