"""What a backend leaves for the user to read: its run directory's files, and plans as traces.

With ``run_dir`` set, a backend writes its config, each graph's profile, each plan with the trace of the
step it predicts, the hardware model the plans were made with, and one ``stats.jsonl`` line per timed
step, all through :class:`teraio.lifecycle.run_dir.RunDir` (Note: [Run-directory files are by-products]
in teraio.lifecycle.run_dir). This module decides what goes into those files; ``run_dir`` how they are
written. It also reads plans back (``plan=``).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from teraio.lifecycle.ranks import rank_info
from teraio.lifecycle.run_dir import RunDir, RunDirError, refuse_foreign_run_dir
from teraio.planner.plan import Plan
from teraio.planner.profile import Profile

if TYPE_CHECKING:
    from teraio.config import BackendConfig
    from teraio.lifecycle.runner import GraphRunner
    from teraio.planner.hardware import HardwareModel


class RunRecord:
    """One backend's run directory (or none: ``run_dir=None``), and what is written into it."""

    def __init__(self, cfg: BackendConfig) -> None:
        self.cfg = cfg
        #: Made once per backend: in config.json and on every stats.jsonl line (runs may share a run_dir).
        self.run_id = secrets.token_hex(8)
        self.run_dir = Path(self.cfg.run_dir) if self.cfg.run_dir else None
        info = rank_info()
        if self.run_dir is not None and info.distributed:
            # Under torchrun every rank writes its own: rank0/, rank1/, ... (teraio show reads them all).
            self.run_dir = self.run_dir / f"rank{info.rank}"
        # Before anything is written: never replace another program's files.
        refuse_foreign_run_dir(self.run_dir)
        # Every write into run_dir goes through it: Note: [Run-directory files are by-products].
        self._run: RunDir | None = None
        self._saved_hardware: HardwareModel | None = None
        if self.run_dir is not None:
            self._run = RunDir.open(self.run_dir, self.run_id)
            self._run.write_config(json.loads(json.dumps(self.cfg.recorded(), default=str)))

    @property
    def error(self) -> RunDirError | None:
        """The write into ``run_dir`` that failed, after which the run went on without it (None: none)."""
        return self._run.error if self._run is not None else None

    def save_hardware(self, hw: HardwareModel) -> None:
        """The hardware model the plans are made with, whenever it changes."""
        if self._run is not None and hw != self._saved_hardware:
            self._run.save_hardware(hw.to_dict())
            self._saved_hardware = hw

    def save_profile(self, runner: GraphRunner) -> None:
        if self._run is not None and runner.profile is not None:
            self._run.save_profile(runner.graph_id, runner.profile)

    def save_plan(self, runner: GraphRunner) -> None:
        """A graph's plan with its predicted trace, and each later call's own plan."""
        if self._run is None or runner.plan is None or self._run.error is not None:
            return  # (no simulation for a trace that would not be written)
        self._run.save_plan(runner.graph_id, runner.plan.to_json(), trace_of(runner.profile, runner.plan))
        # Note: [A graph called several times per step is planned per call] in teraio.lifecycle.step_planner:
        # each later call's own plan, also over the files of an earlier plan with more calls (they then
        # show the plan calls run now).
        calls = max(len(runner.plans), runner.saved_call_plans)
        for j in range(1, calls):
            p = runner.plan_for(j)
            assert p is not None
            self._run.save_plan(runner.graph_id, p.to_json(), trace_of(runner.profile, p), call=j)
        runner.saved_call_plans = calls

    def append_stats(self, line: Callable[[], dict[str, Any]]) -> None:
        """One ``stats.jsonl`` line, made by ``line`` only when there is a file to write it to. In a
        backward hook: a failure is warned once, never raised (Note: [Run-directory files are
        by-products] in teraio.lifecycle.run_dir)."""
        if self._run is not None:
            self._run.append_stats(line())


def write_trace(profile: Profile, plan: Plan, path: Path) -> None:
    """The plan's predicted step as a Chrome trace (chrome://tracing, Perfetto) in ``path``."""
    from teraio.planner.safe_io import write_json

    write_json(path, trace_of(profile, plan), overwrite=True, indent=None)


def trace_of(profile: Profile, plan: Plan) -> dict[str, Any]:
    """The plan's predicted step as a Chrome trace (chrome://tracing, Perfetto): ops and transfers."""
    from teraio.planner.simulate import simulate

    sim = simulate(profile, plan)
    events: list[dict[str, Any]] = []
    for i, (name, start_s, end_s) in enumerate(zip(profile.ops["name"], sim.op_start_s, sim.op_end_s)):
        phase = "fwd" if i < profile.num_fwd_ops else "bwd"
        events.append(
            {
                "name": name,
                "cat": phase,
                "ph": "X",
                "pid": 0,
                "tid": "compute",
                "ts": float(start_s) * 1e6,
                "dur": float(end_s - start_s) * 1e6,
                "args": {"idx": i},
            }
        )
    for r in sim.io_timeline.itertuples():
        events.append(
            {
                "name": f"{r.direction} {r.name}",
                "cat": str(r.tier),
                "ph": "X",
                "pid": 0,
                "tid": f"{r.tier} {r.direction}",
                "ts": float(r.start_s) * 1e6,
                "dur": float(r.end_s - r.start_s) * 1e6,
                "args": {"nbytes": int(r.nbytes)},
            }
        )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"predicted_step_s": sim.step_s, "peak_bytes": sim.peak_bytes},
    }


def load_plans(path: str) -> list[Plan]:
    """A plan file, or a run directory holding graph*/plan.json (one plan per captured graph)."""
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("graph*/plan.json")) or sorted(p.glob("*.json"))
        if not files:
            from teraio.planner.plan import PlanError

            raise PlanError(f"plan directory '{p}' holds no graph*/plan.json")
        return [Plan.load(f) for f in files]
    return [Plan.load(p)]
