"""The Plan: which saved tensors move, to which tier, and where in the step each transfer starts and ends.

A frozen dataclass serialised as versioned JSON (never pickle), so plans can be inspected, diffed, and
checked against the profile they were made for. Positions are op indices of the Profile (forward then
backward, see ``planner.profile``), with the op names alongside for humans.

Per moved tensor (a :class:`Decision`), in step order:

- ``offload_after_idx``: the write starts when this forward op finishes (>= the producer).
- ``wait_before_idx``: the write must be complete before this op starts; the in-memory copy is freed
  there. It is a forward op after the tensor's last forward use, or ``num_fwd_ops`` meaning "at the end
  of the forward graph".
- ``prefetch_before_idx``: the read starts (and its buffer is allocated) before this backward op.
- ``fetch_before_idx``: the read must be complete before this op: the tensor's first backward use.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from teraio.planner.hardware import HardwareModel

PLAN_SCHEMA_VERSION = 1


class PlanError(ValueError):
    """A plan file is corrupt, from another schema version, or made for another profile."""


@dataclass(frozen=True)
class Decision:
    name: str
    tier: str
    nbytes: int
    offload_after_idx: int
    offload_after_name: str
    wait_before_idx: int
    wait_before_name: str
    prefetch_before_idx: int
    prefetch_before_name: str
    fetch_before_idx: int
    fetch_before_name: str
    #: The producer's nn.Module path ("blocks.3.attn"), "" when unknown: lets ``teraio show`` group by layer.
    module: str = ""


@dataclass(frozen=True)
class SolverStats:
    solver: str
    status: str  # OPTIMAL | FEASIBLE | HEURISTIC | BASELINE | INFEASIBLE (over budget) | UNKNOWN
    objective: float | None = None
    bound: float | None = None
    gap: float | None = None
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    fingerprint: str
    budget_bytes: int
    budget_spec: str
    hardware: HardwareModel
    stats: SolverStats
    decisions: tuple[Decision, ...]
    baseline_peak_bytes: int
    predicted_peak_bytes: int
    predicted_step_s: float
    predicted_stall_s: float
    compute_s: float
    config: dict[str, Any] = field(default_factory=dict)
    schema_version: int = PLAN_SCHEMA_VERSION

    @property
    def moved_bytes(self) -> int:
        return sum(d.nbytes for d in self.decisions)

    @property
    def solver(self) -> str:
        return self.stats.solver

    def decision_for(self, name: str) -> Decision | None:
        for d in self.decisions:
            if d.name == name:
                return d
        return None

    # ---------------------------------------------------------------------------------------- json io
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "fingerprint": self.fingerprint,
            "budget_bytes": self.budget_bytes,
            "budget_spec": self.budget_spec,
            "hardware": self.hardware.to_dict(),
            "stats": asdict(self.stats),
            "baseline_peak_bytes": self.baseline_peak_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "predicted_step_s": self.predicted_step_s,
            "predicted_stall_s": self.predicted_stall_s,
            "compute_s": self.compute_s,
            "moved_bytes": self.moved_bytes,
            "config": self.config,
            "decisions": [asdict(d) for d in self.decisions],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, d: Any) -> Plan:
        if not isinstance(d, dict):
            raise PlanError("plan JSON must be an object")
        version = d.get("schema_version")
        if version != PLAN_SCHEMA_VERSION:
            raise PlanError(
                f"plan schema_version {version!r} is not supported (this teraio reads "
                f"{PLAN_SCHEMA_VERSION}); re-plan with this version"
            )
        try:
            return cls(
                fingerprint=str(d["fingerprint"]),
                budget_bytes=int(d["budget_bytes"]),
                budget_spec=str(d["budget_spec"]),
                hardware=HardwareModel.from_dict(d["hardware"]),
                stats=SolverStats(**d["stats"]),
                decisions=tuple(Decision(**x) for x in d["decisions"]),
                baseline_peak_bytes=int(d["baseline_peak_bytes"]),
                predicted_peak_bytes=int(d["predicted_peak_bytes"]),
                predicted_step_s=float(d["predicted_step_s"]),
                predicted_stall_s=float(d["predicted_stall_s"]),
                compute_s=float(d["compute_s"]),
                config=dict(d.get("config", {})),
                schema_version=int(version),
            )
        except KeyError as e:
            raise PlanError(f"plan JSON lacks key {e}") from None
        except (TypeError, ValueError) as e:
            raise PlanError(f"plan JSON is malformed: {e}") from None

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically (temp file + rename) so a crash never leaves half a plan."""
        p = Path(path)
        tmp = p.with_name(f".{p.name}.tmp")
        tmp.write_text(self.to_json())
        os.replace(tmp, p)

    @classmethod
    def load(cls, path: str | os.PathLike, expect_fingerprint: str | None = None) -> Plan:
        """Load a plan; with ``expect_fingerprint``, refuse a plan made for another graph."""
        p = Path(path)
        try:
            d = json.loads(p.read_text())
        except FileNotFoundError:
            raise PlanError(f"plan '{p}' does not exist") from None
        except (OSError, ValueError) as e:
            raise PlanError(f"plan '{p}' is not valid JSON: {e}") from None
        plan = cls.from_dict(d)
        if expect_fingerprint is not None and plan.fingerprint != expect_fingerprint:
            raise PlanError(
                f"plan '{p}' was made for graph {plan.fingerprint[:12]}, not this one "
                f"({expect_fingerprint[:12]}); re-plan from this graph's profile"
            )
        return plan
