"""Tables and plots for looking at a Profile and the Plans made from it (the notebooks' toolbox).

Notebooks only import and plot, so everything they show is built here: a one-row profile summary,
the tensors worth offloading, plan comparisons, a budget sweep, the memory timeline (unplanned,
smallest achievable, planned, budget) and the I/O timeline as a Gantt chart. matplotlib is imported
inside the plotting functions so ``import teraio.tools.analysis`` stays cheap (no matplotlib, no torch).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from teraio.planner.budget import format_size
from teraio.planner.sweep import SWEEP_COLUMNS as SWEEP_COLUMNS  # re-exported for the notebooks

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from teraio.planner.hardware import HardwareModel
    from teraio.planner.lifetimes import Lifetimes
    from teraio.planner.plan import Plan
    from teraio.planner.profile import Profile
    from teraio.planner.simulate import SimResult
    from teraio.planner.solve import RecomputeMode

#: Columns of :func:`plan_table`.
PLAN_COLUMNS = (
    "plan",
    "solver",
    "status",
    "budget",
    "predicted_peak",
    "simulated_peak",
    "predicted_step_s",
    "predicted_stall_s",
    "moved",
    "decisions",
    "wall_s",
    "violations",
    "recomputed",
    "recompute_s",
)

_MIB = 1024**2


__all__ = [
    "profile_summary",
    "top_inactive_tensors",
    "plan_table",
    "offload_states_of",
    "kept_states_sweep",
    "step_by_kind",
    "budget_sweep",
    "plot_memory_timeline",
    "plot_io_timeline",
    "plot_sweep",
    "plot_recompute_crossover",
]


def profile_summary(profile: Profile, lifetimes: Lifetimes) -> pd.DataFrame:
    """One row per headline figure of a profile: sizes of the tables, peaks and nominal step time.

    Returns:
        A two-column DataFrame (``figure``, ``value``) with human-readable values.
    """
    lt = lifetimes
    rows: list[tuple[str, Any]] = [
        ("ops (fwd + bwd)", f"{lt.num_ops} ({lt.num_fwd_ops} fwd)"),
        ("saved tensors", len(profile.tensors)),
        ("offload candidates", len(lt.candidates)),
        ("candidate bytes", format_size(lt.candidate_bytes)),
        # Rebuild recipes in the profile (its recompute columns): what recompute could take away.
        ("recomputable candidates", len(lt.recomputable)),
        ("unplanned peak", f"{format_size(lt.baseline_peak_bytes)} at op {lt.op_name(lt.baseline_peak_idx)}"),
        ("smallest achievable peak", format_size(lt.smallest_peak_bytes)),
        ("compute per step", f"{lt.compute_s:.3f} s"),
    ]
    return pd.DataFrame(rows, columns=["figure", "value"])


def top_inactive_tensors(lifetimes: Lifetimes, n: int = 10) -> pd.DataFrame:
    """The ``n`` candidates with the largest bytes x inactive time: the cheapest memory to move away.

    A tensor that is big and idle for long between its last forward use and its first backward use
    frees the most memory-time per byte of I/O.

    Returns:
        Candidate rows sorted by ``mib_s`` (MiB x seconds idle), with ``size`` and ``inactive_s`` added.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    cand = lifetimes.candidates
    out = pd.DataFrame(
        {
            "name": cand["name"],
            "module": cand["module"],
            "size": [format_size(b) for b in cand["nbytes"]],
            "nbytes": cand["nbytes"],
            "inactive_s": cand["inactive_us"] / 1e6,
            "inactive_ops": cand["inactive_end_idx"] - cand["inactive_start_idx"] + 1,
            "mib_s": cand["nbytes"] / _MIB * cand["inactive_us"] / 1e6,
        }
    )
    return out.sort_values("mib_s", ascending=False, kind="stable").head(n).reset_index(drop=True)


def plan_table(plans: Mapping[str, Plan], sims: Mapping[str, SimResult] | None = None) -> pd.DataFrame:
    """One row per labelled plan: solver, status, budget, the predicted (and re-simulated) figures, and what
    it recomputes (bytes rebuilt, rebuild seconds per step).

    Args:
        plans: label -> Plan.
        sims: label -> the simulator's replay of that plan; adds ``simulated_peak`` and ``violations``.
    """
    rows = []
    for label, plan in plans.items():
        sim = sims.get(label) if sims is not None else None
        rows.append(
            {
                "plan": label,
                "solver": plan.solver,
                "status": plan.stats.status,
                "budget": format_size(plan.budget_bytes),
                "predicted_peak": format_size(plan.predicted_peak_bytes),
                "simulated_peak": format_size(sim.peak_bytes) if sim is not None else "",
                "predicted_step_s": plan.predicted_step_s,
                "predicted_stall_s": plan.predicted_stall_s,
                "moved": format_size(plan.moved_bytes),
                "decisions": len(plan.decisions),
                "wall_s": plan.stats.wall_s,
                "violations": len(sim.violations) if sim is not None else np.nan,
                "recomputed": format_size(plan.recomputed_bytes),
                "recompute_s": plan.recompute_s,
            }
        )
    return pd.DataFrame(rows, columns=list(PLAN_COLUMNS))


#: Columns of :func:`step_by_kind`.
KIND_COLUMNS = ("kind", "tensors", "bytes", "offloaded_bytes", "written_bytes", "read_bytes")


def offload_states_of(
    profile: Profile,
    *,
    states_per_param: int = 2,
    offload_parameters: bool = True,
    offload_gradients: bool = True,
    optimizer_in_backward: bool = False,
) -> dict[str, Any]:
    """What ``states="offload"`` would hold and move for the parameters in ``profile`` (its tensors of kind
    ``param``): a ``model_states`` record (``teraio.planner.model_states.offload_states_record``) for a
    profile that has none, a synthetic one say. ``states_per_param``: 2 for AdamW, 1 for SGD with
    momentum. The step's last chunk is taken to keep no parameter (an upper bound on the reads)."""
    from teraio.planner.model_states import offload_states_record

    params = profile.tensors[profile.tensors["kind"] == "param"]
    param_nbytes = int(params["nbytes"].sum())
    return offload_states_record(
        param_tensors=len(params),
        param_nbytes=param_nbytes,
        offloaded_param_nbytes=param_nbytes if offload_parameters else 0,
        state_tensors=states_per_param * len(params),
        state_nbytes=states_per_param * param_nbytes,
        offload_gradients=offload_gradients,
        optimizer_in_backward=optimizer_in_backward,
    )


def kept_states_sweep(
    profile: Profile,
    capacities_bytes: list[int],
    *,
    states_per_param: int = 2,
    optimizer_in_backward: bool = False,
    solver: str = "ilp",
    hardware: HardwareModel | None = None,
) -> pd.DataFrame:
    """What a whole-step budget keeps in memory (Note: [The whole-step budget keeps some states in
    memory] in teraio.states.residency) for each room left beside the activations, for the parameters in
    ``profile`` (its tensors of kind ``param``, each offloadable, each with ``states_per_param`` states
    of its size). One row per capacity: the bytes of parameters and states kept, what the others move
    per step (``teraio.planner.kept_states``'s items: a parameter 4x its bytes, 3x with
    ``optimizer_in_backward``, a state 2x) and their I/O lower bound at the ``ssd`` bandwidth of
    ``hardware`` (``io_lower_bound_s``; gradients not counted)."""
    from teraio.planner.hardware import HardwareModel as Hardware
    from teraio.planner.kept_states import choose_resident_states, state_items
    from teraio.planner.model_states import io_lower_bound_s

    sizes = [int(n) for n in profile.tensors.loc[profile.tensors["kind"] == "param", "nbytes"]]
    items = state_items(
        param_nbytes=sizes,
        state_nbytes=[states_per_param * n for n in sizes],
        offloadable_params=range(len(sizes)),
        optimizer_in_backward=optimizer_in_backward,
    )
    ssd = (hardware or Hardware()).tier("ssd")
    rows = []
    for cap in capacities_bytes:
        r = choose_resident_states(items, int(cap), solver=solver)  # type: ignore[arg-type]
        moved = sum(r.moved_bytes_by_kind.values())
        written = sum(r.offloaded_bytes_by_kind.values())  # each offloaded item is written once a step
        rows.append(
            {
                "capacity_bytes": int(cap),
                "kept_parameter_bytes": r.kept_bytes_by_kind["parameter"],
                "kept_optimizer_state_bytes": r.kept_bytes_by_kind["optimizer_state"],
                "moved_bytes": moved,
                "io_lower_bound_s": io_lower_bound_s(
                    written, moved - written, ssd.total_write_bw_bytes_per_s, ssd.total_read_bw_bytes_per_s
                ),
                "optimal": r.optimal,
            }
        )
    return pd.DataFrame(rows)


def step_by_kind(
    profile: Profile,
    sim: SimResult,
    hardware: HardwareModel | None = None,
    model_states: dict[str, Any] | None = None,
) -> pd.DataFrame:
    """One row per kind of tensor in a step (activation, parameter, gradient, optimizer_state): how many,
    their bytes, the bytes offloaded, and the bytes written and read per step; the activations from the
    simulated plan, the others from ``model_states`` (default: the profile's own, which a
    ``states="offload"`` run records). ``df.attrs["io_lower_bound_s"]``: the step's I/O lower bound,
    every kind's bytes at the ``ssd`` bandwidth of ``hardware`` (default: the built-in model)."""
    from teraio.planner.hardware import HardwareModel as Hardware
    from teraio.planner.model_states import MOVED_KINDS, step_io_by_kind

    ms = model_states if model_states is not None else profile.meta.get("model_states")
    ssd = (hardware or Hardware()).tier("ssd")
    io = step_io_by_kind(
        ms, sim.written_bytes, sim.read_bytes, ssd.total_write_bw_bytes_per_s, ssd.total_read_bw_bytes_per_s
    )
    acts = profile.tensors[profile.tensors["kind"] == "activation"]
    rows = []
    for kind in MOVED_KINDS:
        if kind == "activation":
            held = {
                "tensors": len(acts),
                "bytes": int(acts["nbytes"].sum()),
                "offloaded_bytes": sim.written_bytes,
            }
        else:
            held = (ms or {}).get(kind, {"tensors": 0, "bytes": 0, "offloaded_bytes": 0})
        rows.append(
            {
                "kind": kind,
                **{k: int(held[k]) for k in ("tensors", "bytes", "offloaded_bytes")},
                "written_bytes": io["written_bytes_by_kind"][kind],
                "read_bytes": io["read_bytes_by_kind"][kind],
            }
        )
    df = pd.DataFrame(rows, columns=list(KIND_COLUMNS))
    df.attrs["io_lower_bound_s"] = io["io_lower_bound_s"]
    return df


def budget_sweep(
    profile: Profile,
    budgets: Iterable[str | int | float] = ("100%", "75%", "50%", "30%"),
    solver: str = "greedy",
    *,
    lifetimes: Lifetimes | None = None,
    recompute: RecomputeMode = "off",
    compare_modes: bool = True,
    **solve_kwargs: Any,
) -> pd.DataFrame:
    """Plan ``profile`` at each budget and tabulate the predicted peak, step time, stall and bound.

    The one sweep of the project (:func:`planner.sweep.budget_sweep`, also behind ``teraio sweep`` and
    the planner benchmark) for one solver: a budget no plan can meet gives a row with status ``NO PLAN``,
    NaN figures and the planner's message in ``note``.

    Args:
        budgets: anything :func:`planner.solve.solve` accepts ("50%", 0.5, "512MiB", bytes).
        solver: a registered solver name (an unknown name raises UnknownSolverError).
        lifetimes: ``analyse(profile)`` when the caller already has it.
        recompute: the recompute mode of each row's plan ("off", "only", "joint").
        compare_modes: also plan offload only, recompute only and joint (``offload_step_s``,
            ``recompute_step_s``, ``joint_step_s``; what :func:`plot_recompute_crossover` draws).
        solve_kwargs: passed to :func:`planner.solve.solve` (``hardware``, ``time_limit_s``, ...).

    Returns:
        One row per budget, columns :data:`SWEEP_COLUMNS` (``planner.sweep``'s).
    """
    from teraio.planner.sweep import budget_sweep as sweep

    return sweep(
        profile,
        budgets,
        [solver],
        lifetimes=lifetimes,
        recompute=recompute,
        compare_modes=compare_modes,
        **solve_kwargs,
    )


def _new_axes(ax: Axes | None, figsize: tuple[float, float]) -> Axes:
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    _, new_ax = plt.subplots(figsize=figsize)
    return new_ax


def plot_memory_timeline(
    lifetimes: Lifetimes,
    sims: Mapping[str, SimResult] | None = None,
    *,
    budget_bytes: int | None = None,
    show_floor: bool = True,
    ax: Axes | None = None,
    title: str = "Memory per op",
) -> Axes:
    """Plot memory during each op: unplanned, the smallest achievable, each planned run, and the budget.

    Args:
        lifetimes: ``analyse(profile)``; gives the unplanned and smallest achievable timelines.
        sims: label -> SimResult; each is drawn as a step line of its ``memory_bytes``.
        budget_bytes: draws a horizontal budget line when given.
        show_floor: draw the memory with every candidate away over its whole idle interval.
        ax: axes to draw on; a new figure when None.

    Returns:
        The axes drawn on (MiB on the y axis, op index on the x axis, forward/backward boundary marked).
    """
    ax = _new_axes(ax, (10, 4))
    idx = np.arange(lifetimes.num_ops)
    ax.step(
        idx, lifetimes.baseline_memory_bytes / _MIB, where="mid", color="black", lw=1.5, label="unplanned"
    )
    if show_floor:
        ax.step(
            idx,
            lifetimes.min_memory_bytes / _MIB,
            where="mid",
            color="grey",
            lw=1,
            ls=":",
            label="smallest achievable",
        )
    for label, sim in (sims or {}).items():
        ax.step(idx, np.asarray(sim.memory_bytes) / _MIB, where="mid", lw=1.2, label=label)
    if budget_bytes is not None:
        ax.axhline(
            budget_bytes / _MIB, color="red", ls="--", lw=1, label=f"budget {format_size(budget_bytes)}"
        )
    ax.axvline(lifetimes.num_fwd_ops - 0.5, color="grey", lw=0.8, alpha=0.6)
    ax.text(lifetimes.num_fwd_ops - 0.5, ax.get_ylim()[1], " bwd ->", va="top", ha="left", fontsize=8)
    ax.set_xlabel("op index")
    ax.set_ylabel("memory (MiB)")
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=8)
    return ax


def plot_io_timeline(
    sim: SimResult,
    *,
    num_fwd_ops: int | None = None,
    ax: Axes | None = None,
    title: str = "I/O timeline",
) -> Axes:
    """Plot a simulated run's transfers as a Gantt chart: one row per tensor, writes and reads as bars.

    A thin line before each bar runs from the moment the transfer was issued to the moment its
    channel started it: time spent queued behind other transfers.

    Args:
        sim: a SimResult; its ``io_timeline`` has columns name, tier, direction, issue_s, start_s,
            end_s, nbytes.
        num_fwd_ops: when given, marks the end of forward (the start of op ``num_fwd_ops``).
        ax: axes to draw on; a new figure sized to the number of tensors when None.

    Returns:
        The axes drawn on (seconds on the x axis).
    """
    io = sim.io_timeline
    names = list(dict.fromkeys(io.sort_values("start_s", kind="stable")["name"]))
    ax = _new_axes(ax, (10, max(2.5, 0.18 * len(names) + 1.0)))
    row = {name: k for k, name in enumerate(names)}
    colors = {"write": "tab:orange", "read": "tab:blue"}
    for direction, part in io.groupby("direction", sort=True):
        y = part["name"].map(row).to_numpy()
        color = colors.get(str(direction), "tab:grey")
        ax.barh(
            y,
            (part["end_s"] - part["start_s"]).to_numpy(),
            left=part["start_s"].to_numpy(),
            height=0.7,
            color=color,
            label=str(direction),
        )
        ax.hlines(y, part["issue_s"].to_numpy(), part["start_s"].to_numpy(), color=color, lw=0.8, alpha=0.6)
    if num_fwd_ops is not None and 0 <= num_fwd_ops < len(sim.op_start_s):
        ax.axvline(sim.op_start_s[num_fwd_ops], color="grey", lw=0.8, ls="--", label="end of forward")
    ax.set_xlim(0, max(sim.step_s, float(io["end_s"].max()) if len(io) else 0.0))
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("time in step (s)")
    ax.set_title(f"{title} ({len(names)} tensors, stall {sim.stall_s * 1e3:.1f} ms)")
    ax.legend(loc="lower right", fontsize=8)
    return ax


def plot_sweep(sweep: pd.DataFrame, *, ax: Axes | None = None, title: str = "Budget sweep") -> Axes:
    """Plot a :func:`budget_sweep` table: predicted peak (bars) and step time (line) per budget."""
    ax = _new_axes(ax, (7, 3.5))
    ok = sweep.dropna(subset=["predicted_peak_bytes"])
    x = np.arange(len(ok))
    ax.bar(x, ok["predicted_peak_bytes"].astype(float) / _MIB, color="tab:green", alpha=0.7, label="peak")
    ax.set_xticks(x)
    ax.set_xticklabels(ok["budget_spec"].tolist())
    ax.set_xlabel("budget")
    ax.set_ylabel("predicted peak (MiB)")
    step_ax = ax.twinx()
    step_ax.plot(x, ok["predicted_step_s"].astype(float), color="black", marker="o", label="step")
    step_ax.set_ylabel("predicted step (s)")
    ax.set_title(title)
    return ax


def plot_recompute_crossover(
    sweep: pd.DataFrame, *, ax: Axes | None = None, title: str = "Offload, recompute or both"
) -> Axes:
    """Plot a :func:`budget_sweep` table's per-mode steps: offload only, recompute only and the joint plan
    against the budget, so the budget where rebuilding starts to beat moving bytes is visible. A mode
    with no plan at a budget leaves a gap in its curve."""
    ax = _new_axes(ax, (7, 3.5))
    x = np.arange(len(sweep))
    for col, label, style in (
        ("offload_step_s", "offload only", {"color": "tab:orange", "marker": "o"}),
        ("recompute_step_s", "recompute only", {"color": "tab:blue", "marker": "s"}),
        ("joint_step_s", "joint", {"color": "black", "marker": "^", "lw": 2}),
    ):
        ax.plot(x, sweep[col].astype(float), label=label, **style)
    ax.axhline(float(sweep["compute_s"].iloc[0]), color="grey", ls=":", lw=1, label="compute")
    ax.set_xticks(x)
    ax.set_xticklabels(sweep["budget_spec"].tolist())
    ax.set_xlabel("budget")
    ax.set_ylabel("predicted step (s)")
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=8)
    return ax
