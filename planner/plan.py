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

- ``action``: "offload" (the above) or "recompute" (schema 3): the tensor is dropped and rebuilt in
  backward from its profile's recompute inputs (``planner.execution``). A recompute decision has
  ``tier = ""``, ``offload_after_idx = -1``, ``offload_after_name = ""``, ``wait_before_idx`` = the forward
  op before which the in-memory copy is dropped (after its last forward use; normally the op right after
  it), ``prefetch_before_idx == fetch_before_idx`` = the backward op before which it is rebuilt (its
  effective first backward need), ``write_rank = read_rank = -1`` and ``recompute_us`` = the rebuild's
  compute time (from the profile, so ``teraio show`` needs none).

Plan-level figures in the JSON, derived from the decisions (written for readers, ignored on load):
``moved_bytes`` (offloaded: each written once and read once per step), ``recomputed_bytes`` (rebuilt per
step) and ``recompute_s`` (their rebuild compute per step).

Schema history: version 1 had no ranks (ties were broken by the decisions' order in the file); it loads
as version 2 with the ranks that order implies, which is the same schedule. Version 2 had no ``action``:
it loads as version 3 with every decision an offload.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from teraio.planner.hardware import HardwareError, HardwareModel
from teraio.planner.limits import MAX_OP_US, MAX_ROWS, MAX_SECONDS, MAX_STEP_NBYTES, MAX_TENSOR_NBYTES
from teraio.planner.safe_io import InputError, load_json, write_text

if TYPE_CHECKING:
    from teraio.planner.profile import Profile

PLAN_SCHEMA_VERSION = 3
#: Older versions this code converts on load (see the module docstring).
CONVERTIBLE_VERSIONS = (1, 2)
#: What a decision does with its tensor.
Action = Literal["offload", "recompute"]
ACTIONS: tuple[str, ...] = ("offload", "recompute")


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
    #: "offload", or "recompute" (rebuilt before ``fetch_before_idx``; see the module docstring).
    action: Action = "offload"
    #: The rebuild's compute time (recompute decisions only; 0 for offloads).
    recompute_us: float = 0.0

    @property
    def recomputed(self) -> bool:
        return self.action == "recompute"


def queue_order(decisions: Sequence[Decision], direction: Literal["write", "read"]) -> list[int]:
    """Indices of ``decisions`` in the order their transfers of ``direction`` are issued.

    Issue position first (``offload_after_idx`` for writes, ``prefetch_before_idx`` for reads), then the
    plan's rank, then the decision's place in the plan (decisions without a rank keep plan order).
    Recompute decisions transfer nothing and are left out.
    """
    moved = [k for k, d in enumerate(decisions) if d.action == "offload"]
    if direction == "write":
        key = {k: (decisions[k].offload_after_idx, decisions[k].write_rank, k) for k in moved}
    else:
        key = {k: (decisions[k].prefetch_before_idx, decisions[k].read_rank, k) for k in moved}
    return sorted(moved, key=key.__getitem__)


def with_ranks(decisions: Sequence[Decision]) -> list[Decision]:
    """The decisions with explicit, plan-wide ``write_rank`` and ``read_rank``: each transfer's place in
    its issue order (:func:`queue_order`), so the ranks alone give the order (``0 .. len-1``)."""
    w = {k: r for r, k in enumerate(queue_order(decisions, "write"))}
    r = {k: r for r, k in enumerate(queue_order(decisions, "read"))}
    return [
        d
        if (d.write_rank, d.read_rank) == (w.get(k, -1), r.get(k, -1))
        else dataclasses.replace(d, write_rank=w.get(k, -1), read_rank=r.get(k, -1))
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
        """Bytes offloaded per step (recomputed tensors move nothing)."""
        return sum(d.nbytes for d in self.decisions if d.action == "offload")

    @property
    def recomputed_bytes(self) -> int:
        """Bytes dropped in forward and rebuilt in backward per step."""
        return sum(d.nbytes for d in self.decisions if d.action == "recompute")

    @property
    def recompute_s(self) -> float:
        """Compute spent on rebuilds per step (seconds)."""
        return sum(d.recompute_us for d in self.decisions if d.action == "recompute") / 1e6

    @property
    def offloads(self) -> tuple[Decision, ...]:
        return tuple(d for d in self.decisions if d.action == "offload")

    @property
    def recomputes(self) -> tuple[Decision, ...]:
        return tuple(d for d in self.decisions if d.action == "recompute")

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
            "recomputed_bytes": self.recomputed_bytes,
            "recompute_s": self.recompute_s,
            "config": self.config,
            "decisions": [asdict(d) for d in self.decisions],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, d: Any, *, source: str = "plan") -> Plan:
        """Build a Plan from its JSON form, every field checked first (see :func:`check_plan_dict`).

        Raises:
            PlanError: naming ``source``, the field and the expected value.
        """
        check_plan_dict(d, source)
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
            raise PlanError(f"{source} lacks key {e}") from None
        except HardwareError as e:
            raise PlanError(str(e)) from None
        except (TypeError, ValueError) as e:
            raise PlanError(f"{source} is malformed: {e}") from None

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> None:
        """Write through the safe writer (fresh temp file, fsync, atomic rename).

        Raises:
            OutputError: ``path`` exists and ``overwrite`` is False.
        """
        write_text(path, self.to_json(), overwrite=overwrite)

    @classmethod
    def load(
        cls, path: str | os.PathLike, expect_fingerprint: str | None = None, profile: Profile | None = None
    ) -> Plan:
        """Load a plan; with ``expect_fingerprint``, refuse a plan made for another graph; with
        ``profile``, also check it completely against that profile (:func:`validate_plan`)."""
        p = Path(path)
        try:
            # A regular file only, read up to a limit; NaN, Infinity and deep nesting refused.
            d = load_json(p, what="plan")
        except InputError as e:
            raise PlanError(str(e)) from None
        plan = cls.from_dict(d, source=f"plan '{p}'")
        if profile is not None and expect_fingerprint is None:
            expect_fingerprint = profile.fingerprint
        if expect_fingerprint is not None and plan.fingerprint != expect_fingerprint:
            raise PlanError(
                f"plan '{p}' was made for graph {plan.fingerprint[:12]}, not this one "
                f"({expect_fingerprint[:12]}); re-plan from this graph's profile"
            )
        if profile is not None:
            validate_plan(plan, profile, source=f"plan '{p}'")
        return plan


# ------------------------------------------------------------------------------------------ checks
# Sizes, indices and times beyond these are corrupt files, not plans (``planner.limits``).
_MAX_NBYTES = MAX_STEP_NBYTES
_MAX_IDX = MAX_ROWS
_DECISION_INTS = ("nbytes", "offload_after_idx", "wait_before_idx", "prefetch_before_idx", "fetch_before_idx")
_DECISION_STRS = (
    "name",
    "tier",
    "offload_after_name",
    "wait_before_name",
    "prefetch_before_name",
    "fetch_before_name",
)


def _int(value: Any, where: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"{where} is {value!r}, expected an integer")
    if not lo <= value <= hi:
        raise PlanError(f"{where} is {value}, expected {lo}..{hi}")
    return value


def _float(value: Any, where: str, *, optional: bool = False, hi: float | None = None) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise PlanError(f"{where} is {value!r}, expected a finite number" + (" or null" if optional else ""))
    if value < 0 and not optional:
        raise PlanError(f"{where} is {value!r}, expected >= 0")
    if hi is not None and value > hi:
        raise PlanError(f"{where} is {value!r}, expected at most {hi:g}")


def check_plan_dict(d: Any, source: str = "plan") -> None:
    """Check the JSON form of a plan field by field: types, finiteness, signs, sizes, tiers, duplicates.

    Runs before any object is built from the file, so a tampered plan is refused with one line naming
    the field instead of failing later (or preallocating a size it made up).

    Raises:
        PlanError: naming ``source``, the field and the expected value.
    """
    if not isinstance(d, dict):
        raise PlanError(f"{source}: expected a JSON object, got {type(d).__name__}")
    version = d.get("schema_version")
    if isinstance(version, bool) or version not in (PLAN_SCHEMA_VERSION, *CONVERTIBLE_VERSIONS):
        raise PlanError(
            f"{source}: schema_version {version!r} is not supported (this teraio reads "
            f"{PLAN_SCHEMA_VERSION}); re-plan with this version"
        )
    for key in ("fingerprint", "budget_spec"):
        if not isinstance(d.get(key), str):
            raise PlanError(f"{source}: '{key}' is {d.get(key)!r}, expected a string")
    for key in ("budget_bytes", "baseline_peak_bytes", "predicted_peak_bytes"):
        if key not in d:
            raise PlanError(f"{source} lacks key '{key}'")
        _int(d[key], f"{source}: '{key}'", 0, _MAX_NBYTES)
    for key in ("predicted_step_s", "predicted_stall_s", "compute_s"):
        if key not in d:
            raise PlanError(f"{source} lacks key '{key}'")
        _float(d[key], f"{source}: '{key}'", hi=MAX_SECONDS)
    if not isinstance(d.get("config", {}), dict):
        raise PlanError(f"{source}: 'config' must be an object")
    stats = d.get("stats")
    if not isinstance(stats, dict):
        raise PlanError(f"{source}: 'stats' is {stats!r}, expected an object")
    for key in ("solver", "status"):
        if not isinstance(stats.get(key), str):
            raise PlanError(f"{source}: 'stats.{key}' is {stats.get(key)!r}, expected a string")
    for key in ("objective", "bound", "gap"):
        _float(stats.get(key), f"{source}: 'stats.{key}'", optional=True)
    _float(stats.get("lower_bound_s"), f"{source}: 'stats.lower_bound_s'", optional=True, hi=MAX_SECONDS)
    _float(stats.get("wall_s", 0.0), f"{source}: 'stats.wall_s'", hi=MAX_SECONDS)
    if not isinstance(stats.get("extra", {}), dict):
        raise PlanError(f"{source}: 'stats.extra' must be an object")
    try:
        hardware = HardwareModel.from_dict(d.get("hardware"), source=f"{source}: 'hardware'")
    except HardwareError as e:
        raise PlanError(str(e)) from None
    decisions = d.get("decisions")
    if not isinstance(decisions, list):
        raise PlanError(f"{source}: 'decisions' is {type(decisions).__name__}, expected a list")
    if len(decisions) > MAX_ROWS:
        raise PlanError(f"{source}: {len(decisions)} decisions, more than the {MAX_ROWS} allowed")
    seen: set[str] = set()
    for i, x in enumerate(decisions):
        where = f"{source}: decisions[{i}]"
        if not isinstance(x, dict):
            raise PlanError(f"{where} is {type(x).__name__}, expected an object")
        for key in _DECISION_STRS:
            if not isinstance(x.get(key), str):
                raise PlanError(f"{where}.{key} is {x.get(key)!r}, expected a string")
        if not isinstance(x.get("module", ""), str):
            raise PlanError(f"{where}.module is {x.get('module')!r}, expected a string")
        action = x.get("action", "offload")  # schema 3; older plans only offload
        if action not in ACTIONS:
            raise PlanError(f"{where}.action is {action!r}, expected one of {', '.join(ACTIONS)}")
        _int(x.get("nbytes"), f"{where}.nbytes", 1, MAX_TENSOR_NBYTES)
        if action == "recompute":
            _check_recompute_fields(x, where)
        else:
            for key in _DECISION_INTS[1:]:
                _int(x.get(key), f"{where}.{key}", 0, _MAX_IDX)
            for key in ("write_rank", "read_rank"):  # schema 2; -1: plan order
                _int(x.get(key, -1), f"{where}.{key}", -1, _MAX_IDX)
            if x.get("recompute_us", 0.0) != 0.0:
                raise PlanError(f"{where}.recompute_us is {x.get('recompute_us')!r}; an offload has 0")
        if action == "offload" and x["tier"] not in hardware.tiers:
            raise PlanError(
                f"{where}.tier is {x['tier']!r}, expected one of the plan's hardware tiers "
                f"({', '.join(hardware.tiers)})"
            )
        if x["name"] in seen:
            raise PlanError(f"{where}: tensor '{x['name']}' has a second decision; a tensor moves once")
        seen.add(x["name"])


def _check_recompute_fields(x: dict, where: str) -> None:
    """The fixed fields of a recompute decision (module docstring)."""
    for key in ("wait_before_idx", "prefetch_before_idx", "fetch_before_idx"):
        _int(x.get(key), f"{where}.{key}", 0, _MAX_IDX)
    for key, want in (("tier", ""), ("offload_after_name", "")):
        if x.get(key) != want:
            raise PlanError(f"{where}.{key} is {x.get(key)!r}, expected {want!r} for a recompute decision")
    for key in ("offload_after_idx", "write_rank", "read_rank"):
        if x.get(key, -1) != -1 or isinstance(x.get(key, -1), bool):
            raise PlanError(f"{where}.{key} is {x.get(key)!r}, expected -1 for a recompute decision")
    if x["prefetch_before_idx"] != x["fetch_before_idx"]:
        raise PlanError(
            f"{where}: prefetch_before_idx {x['prefetch_before_idx']} differs from fetch_before_idx "
            f"{x['fetch_before_idx']}; a recompute decision has one rebuild point"
        )
    us = x.get("recompute_us")
    if (
        isinstance(us, bool)
        or not isinstance(us, (int, float))
        or not math.isfinite(us)
        or not 0 <= us <= MAX_OP_US
    ):
        raise PlanError(f"{where}.recompute_us is {us!r}, expected a finite number in 0..{MAX_OP_US:g}")


def validate_plan(plan: Plan, profile: Profile, *, source: str = "plan") -> None:
    """Check ``plan`` completely against the profile it was made for, before anything runs it.

    Every decision must name an offload candidate of ``profile`` with its exact size, on a tier of the
    plan's hardware model with capacity, at op positions the simulator's rules accept (the same checks
    ``teraio simulate`` reports); the moved bytes must fit the profile. Call it before allocating or
    preallocating anything from the plan.

    Raises:
        PlanError: the first problem, naming ``source`` and the decision.
    """
    from teraio.planner.lifetimes import analyse
    from teraio.planner.simulate import check_decisions

    if plan.fingerprint != profile.fingerprint:
        raise PlanError(
            f"{source} was made for graph {plan.fingerprint[:12]}, not this one "
            f"({profile.fingerprint[:12]}); re-plan from this graph's profile"
        )
    names = [dec.name for dec in plan.decisions]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise PlanError(f"{source}: tensor '{dup}' has more than one decision; a tensor moves once")
    lt = analyse(profile)
    problems = check_decisions(lt, plan.decisions, plan.hardware).violations
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise PlanError(f"{source}: {problems[0]}{more}")
    if plan.moved_bytes > profile.activation_bytes():
        raise PlanError(
            f"{source} moves {plan.moved_bytes} bytes but the profile holds only "
            f"{profile.activation_bytes()} bytes of activations"
        )
