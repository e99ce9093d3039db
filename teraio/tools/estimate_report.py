"""What ``teraio estimate`` found, as a user reads it: the JSON summary and the directory of artifacts.

An estimate ends with one profile per captured graph, each graph's plans (one per solver), the model
states' share of the device and their traffic when they stream. This module holds them together
(:class:`EstimateResult`), turns them into the summary ``teraio estimate --json`` prints (the SSD time a
step needs for the moved activations and the streamed states, and what that bounds), and writes them as
estimate.json, hardware.json, profile/ and the plan files: the files ``teraio plan``, ``simulate``,
``show`` and ``sweep`` read (docs/cli.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from teraio.planner.costmodel import Preset
from teraio.planner.hardware import HardwareModel
from teraio.planner.lifetimes import analyse
from teraio.planner.model_states import ModelStates
from teraio.planner.whatif import PlanOutcome
from teraio.tools.estimated_profile import EstimatedGraph

#: The version of estimate.json's layout (its key ``estimate_schema_version``).
ESTIMATE_SCHEMA_VERSION = 1


@dataclass
class EstimateResult:
    """Everything ``teraio estimate`` found: the estimated profiles, the model states, each graph's plans."""

    target: str
    preset: Preset
    #: The HardwareModel planned for: the preset's, with ``ssds`` / ``ssd_bw_bytes_per_s`` applied.
    hardware: HardwareModel
    settings: dict[str, Any]
    num_params: int
    largest_layer_params: int
    #: This device's share of the model states.
    states: ModelStates
    states_mode: str
    states_note: str
    #: The activation budget as planned: bytes, or the text given ("40%", "auto").
    budget: int | str
    budget_note: str
    graphs: list[EstimatedGraph]
    outcomes: list[list[PlanOutcome]]  # per graph, one per solver
    capture_s: float
    profile_s: float
    plan_s: float

    def state_traffic(self) -> dict[str, Any]:
        """Per step, the model-state bytes this device reads and writes where they live (streamed only)."""
        from teraio.planner.model_states import streamed_traffic

        if self.states_mode != "streamed":
            return {}
        return {
            k: {"read_bytes": t.read_nbytes, "write_bytes": t.write_nbytes}
            for k, t in streamed_traffic(self.states).items()
        }

    def summary(self) -> dict[str, Any]:
        """The JSON ``teraio estimate --json`` prints (and writes as estimate.json)."""
        traffic = self.state_traffic()
        state_bytes = sum(v["read_bytes"] + v["write_bytes"] for v in traffic.values())
        ssd = self.hardware.tier("ssd")
        graphs = []
        for g, outcomes in zip(self.graphs, self.outcomes):
            p = g.profile
            lt = analyse(p)
            rows = []
            for o in outcomes:
                row = o.summary()
                if o.plan is not None:
                    moved = o.plan.moved_bytes
                    io_s = io_seconds(moved, moved, traffic, ssd)
                    row["total_ssd_bytes_per_step"] = 2 * moved + state_bytes
                    row["total_io_s"] = io_s
                    # Streamed states' transfers are not scheduled by the plan: the step cannot be shorter
                    # than the SSDs take to move everything, so this bounds the fraction of ideal from above.
                    row["fraction_of_ideal_bound_with_states"] = (
                        o.ideal_step_s / max(o.plan.predicted_step_s, io_s)
                        if o.plan.predicted_step_s > 0
                        else None
                    )
                    row["average_ssd_bw_needed_bytes_per_s"] = (
                        (2 * moved + state_bytes) / o.ideal_step_s if o.ideal_step_s > 0 else None
                    )
                rows.append(row)
            graphs.append(
                {
                    "graph_id": p.meta.get("graph_id", 0),
                    "fwd_ops": p.num_fwd_ops,
                    "bwd_ops": len(p.ops) - p.num_fwd_ops,
                    "fx_ops": g.ops,
                    "saved_tensors": len(p.tensors),
                    "activation_bytes": p.activation_bytes(),
                    "unplanned_peak_bytes": int(lt.baseline_peak_bytes),
                    "smallest_peak_bytes": int(lt.smallest_peak_bytes),
                    "flops": g.flops,
                    "compute_s": float(p.ops["duration_us"].sum()) / 1e6,
                    "plans": rows,
                }
            )
        return {
            "estimate_schema_version": ESTIMATE_SCHEMA_VERSION,
            "target": self.target,
            "hardware": self.preset.name,
            "hardware_model": self.hardware.name,
            "device": f"estimate:{self.preset.name}",
            "settings": self.settings,
            "num_params": self.num_params,
            "largest_layer_params": self.largest_layer_params,
            "model_states": self.states.to_dict(),
            "states_mode": self.states_mode,
            "states_note": self.states_note,
            "state_traffic_per_step": traffic,
            "budget": self.budget,
            "budget_note": self.budget_note,
            "ssd_aggregate_bw_bytes_per_s": ssd.total_write_bw_bytes_per_s,
            "graphs": graphs,
            "capture_s": self.capture_s,
            "profile_s": self.profile_s,
            "plan_s": self.plan_s,
        }

    def write(self, out: str | os.PathLike, *, force: bool = False) -> Any:
        """Write estimate.json, hardware.json, profile/ and one plan per solver into ``out`` through the
        safe writer (``planner.safe_io.replace_dir``: built aside, renamed into place)."""
        import json
        from pathlib import Path

        from teraio.planner.safe_io import replace_dir

        summary = self.summary()
        plan_files = []
        for gi, outcomes in enumerate(self.outcomes):
            for o in outcomes:
                if o.plan is not None:
                    suffix = f"-graph{gi}" if len(self.graphs) > 1 else ""
                    plan_files.append((f"plan-{o.solver}{suffix}.json", o.plan))
        summary["plan_files"] = [name for name, _ in plan_files]

        def populate(staged: Path) -> None:
            prof_dir = staged / "profile"
            prof_dir.mkdir()
            if len(self.graphs) == 1:
                self.graphs[0].profile.validate().write_files(prof_dir)
            else:
                names = []
                for g in self.graphs:
                    sub = prof_dir / f"graph{g.profile.meta['graph_id']}"
                    sub.mkdir()
                    g.profile.validate().write_files(sub)
                    names.append(sub.name)
                (prof_dir / "index.json").write_text(json.dumps({"graphs": names}))
            (staged / "hardware.json").write_text(json.dumps(self.hardware.to_dict(), indent=2))
            for name, plan in plan_files:
                (staged / name).write_text(plan.to_json())
            (staged / "estimate.json").write_text(json.dumps(summary, indent=2, default=str))

        return replace_dir(out, "estimate", populate, force=force)


def io_seconds(written: int, read: int, traffic: dict[str, Any], ssd: Any) -> float:
    """Seconds the SSD tier needs for a step's bytes: activations written and read, plus streamed states."""
    w = written + sum(v["write_bytes"] for v in traffic.values())
    r = read + sum(v["read_bytes"] for v in traffic.values())
    if ssd.shared_channel:
        return w / ssd.total_write_bw_bytes_per_s + r / ssd.total_read_bw_bytes_per_s
    return max(w / ssd.total_write_bw_bytes_per_s, r / ssd.total_read_bw_bytes_per_s)
