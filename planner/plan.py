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
- ``write_rank`` / ``read_rank``: the plan's two queue orders. Each channel runs its transfers FIFO in
  issue order; transfers issued at the same op boundary are issued in ascending rank. :func:`make_plan`
  (``planner.solve``) numbers them plan-wide, ``0 .. len-1`` in issue order, so a runtime may simply
  issue writes by ``write_rank`` and reads by ``read_rank``. A rank of -1 (a hand-made decision) means
  "in plan order".

Schema history: version 1 had no ranks (ties were broken by the decisions' order in the file); it loads
as version 2 with the ranks that order implies, which is the same schedule.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from teraio.planner.hardware import HardwareModel

PLAN_SCHEMA_VERSION = 2
#: Older versions this code converts on load (see the module docstring).
CONVERTIBLE_VERSIONS = (1,)


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
    #: Place of this tensor's write in the plan's write order (issue order); -1 = plan order.
    write_rank: int = -1
    #: Place of this tensor's read in the plan's read order (issue order); -1 = plan order.
    read_rank: int = -1


def queue_order(decisions: Sequence[Decision], direction: Literal["write", "read"]) -> list[int]:
    """Indices of ``decisions`` in the order their transfers of ``direction`` are issued.

    Issue position first (``offload_after_idx`` for writes, ``prefetch_before_idx`` for reads), then the
    plan's rank, then the decision's place in the plan (decisions without a rank keep plan order).
    """
    if direction == "write":
        key = [(d.offload_after_idx, d.write_rank, k) for k, d in enumerate(decisions)]
    else:
        key = [(d.prefetch_before_idx, d.read_rank, k) for k, d in enumerate(decisions)]
    return sorted(range(len(decisions)), key=key.__getitem__)


def with_ranks(decisions: Sequence[Decision]) -> list[Decision]:
    """The decisions with explicit, plan-wide ``write_rank`` and ``read_rank``: each transfer's place in
    its issue order (:func:`queue_order`), so the ranks alone give the order (``0 .. len-1``)."""
    w = {k: r for r, k in enumerate(queue_order(decisions, "write"))}
    r = {k: r for r, k in enumerate(queue_order(decisions, "read"))}
    return [
        d
        if (d.write_rank, d.read_rank) == (w[k], r[k])
        else dataclasses.replace(d, write_rank=w[k], read_rank=r[k])
        for k, d in enumerate(decisions)
    ]


@dataclass(frozen=True)
class SolverStats:
    solver: str
    status: str  # OPTIMAL | FEASIBLE | HEURISTIC | BASELINE | INFEASIBLE (over budget) | UNKNOWN
    objective: float | None = None
    bound: float | None = None
    gap: float | None = None
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    #: A lower bound on any plan's step time for this profile, budget and hardware (``planner.bounds``,
    #: or a solver's proven bound when tighter); ``gap`` is then (predicted step - this) / predicted step.
    lower_bound_s: float | None = None


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
        if version not in (PLAN_SCHEMA_VERSION, *CONVERTIBLE_VERSIONS):
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
                decisions=tuple(with_ranks([Decision(**x) for x in d["decisions"]])),
                baseline_peak_bytes=int(d["baseline_peak_bytes"]),
                predicted_peak_bytes=int(d["predicted_peak_bytes"]),
                predicted_step_s=float(d["predicted_step_s"]),
                predicted_stall_s=float(d["predicted_stall_s"]),
                compute_s=float(d["compute_s"]),
                config=dict(d.get("config", {})),
                schema_version=PLAN_SCHEMA_VERSION,
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
