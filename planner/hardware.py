"""HardwareModel: what the machine can move, and what moving costs, as the planner sees it.

A plain dataclass with JSON in and out. Per tier: bandwidths and per-request latency for each direction,
how many devices stripe together, whether reads and writes share one channel (one queue) or run on two,
and a capacity. ``cpu_s_per_byte`` charges compute time per byte moved: on a machine with few cores I/O threads
steal cycles from the step (docs/measured_facts.md).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from teraio.planner.limits import (
    MAX_BW_BYTES_PER_S,
    MAX_CPU_S_PER_BYTE,
    MAX_DEVICES,
    MAX_SECONDS,
    MAX_STEP_NBYTES,
)
from teraio.planner.safe_io import InputError, load_json, write_json

HARDWARE_SCHEMA_VERSION = 1
TIERS = ("ssd", "host")


class HardwareError(ValueError):
    """A hardware model file is missing or malformed."""


@dataclass(frozen=True)
class TierModel:
    """One storage tier. Bandwidths are per device; ``count`` devices stripe together."""

    write_bw_bytes_per_s: float
    read_bw_bytes_per_s: float
    write_latency_s: float = 0.0
    read_latency_s: float = 0.0
    count: int = 1
    shared_channel: bool = False
    capacity_bytes: int | None = None
    #: Compute time lost per byte moved through this tier (I/O threads competing for cores).
    cpu_s_per_byte: float = 0.0
    #: Compute time lost per transfer whatever its size: the compute thread's calls into the migration
    #: ops of one direction (offload and its wait, or prefetch and its fetch). Dominates small tensors.
    cpu_s_per_transfer: float = 0.0
    #: Compute time lost once per step that moves anything through this tier, on top of the transfers'
    #: own: on a CPU-only step the first transfer wakes the I/O path, and a step making one round trip
    #: paid about twice per transfer what one making four did (docs/reference.md, hardware model).
    cpu_s_per_step_with_io: float = 0.0

    @property
    def total_write_bw_bytes_per_s(self) -> float:
        return self.write_bw_bytes_per_s * self.count

    @property
    def total_read_bw_bytes_per_s(self) -> float:
        return self.read_bw_bytes_per_s * self.count

    def write_s(self, nbytes: int) -> float:
        return self.write_latency_s + nbytes / self.total_write_bw_bytes_per_s

    def read_s(self, nbytes: int) -> float:
        return self.read_latency_s + nbytes / self.total_read_bw_bytes_per_s

    def cpu_s(self, nbytes: int) -> float:
        """Compute time one transfer of ``nbytes`` (one direction) costs the step."""
        return nbytes * self.cpu_s_per_byte + self.cpu_s_per_transfer

    @property
    def costs_cpu(self) -> bool:
        return self.cpu_s_per_byte > 0 or self.cpu_s_per_transfer > 0


def _default_tiers() -> dict[str, TierModel]:
    # Defaults from the project's measured machines (docs/measured_facts.md): O_DIRECT write and read
    # bandwidths of its SSD tier. Host tier: a memcpy on one core, capacity unknown (None = unlimited).
    return {
        "ssd": TierModel(
            write_bw_bytes_per_s=1.3e9,
            read_bw_bytes_per_s=0.8e9,
            write_latency_s=1e-4,
            read_latency_s=1e-4,
            cpu_s_per_byte=0.15e-9,
        ),
        "host": TierModel(write_bw_bytes_per_s=8e9, read_bw_bytes_per_s=8e9, capacity_bytes=0),
    }


_FLOAT_FIELDS = {  # field -> (minimum, minimum allowed?, maximum: planner.limits)
    "write_bw_bytes_per_s": (0.0, False, MAX_BW_BYTES_PER_S),
    "read_bw_bytes_per_s": (0.0, False, MAX_BW_BYTES_PER_S),
    "write_latency_s": (0.0, True, MAX_SECONDS),
    "read_latency_s": (0.0, True, MAX_SECONDS),
    "cpu_s_per_byte": (0.0, True, MAX_CPU_S_PER_BYTE),
    "cpu_s_per_transfer": (0.0, True, MAX_SECONDS),
    "cpu_s_per_step_with_io": (0.0, True, MAX_SECONDS),
}


def _number(
    value: Any, where: str, field_name: str, minimum: float, inclusive: bool, maximum: float
) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise HardwareError(f"{where}: '{field_name}' is {value!r}, expected a finite number")
    if value < minimum or (value == minimum and not inclusive):
        relation = ">=" if inclusive else ">"
        raise HardwareError(f"{where}: '{field_name}' is {value!r}, expected {relation} {minimum:g}")
    if value > maximum:
        raise HardwareError(f"{where}: '{field_name}' is {value!r}, expected at most {maximum:g}")
    return float(value)


def _tier_from_dict(t: Any, where: str) -> TierModel:
    """One tier from JSON, every field type- and range-checked."""
    if not isinstance(t, dict):
        raise HardwareError(f"{where}: expected an object of tier fields, got {type(t).__name__}")
    known = {f.name for f in fields(TierModel)}
    unknown = sorted(set(t) - known)
    if unknown:
        raise HardwareError(f"{where}: unknown field '{unknown[0]}' (expected: {', '.join(sorted(known))})")
    for required in ("write_bw_bytes_per_s", "read_bw_bytes_per_s"):
        if required not in t:
            raise HardwareError(f"{where}: lacks '{required}' (bytes per second, > 0)")
    kwargs: dict[str, Any] = {}
    for key, (minimum, inclusive, maximum) in _FLOAT_FIELDS.items():
        if key in t:
            kwargs[key] = _number(t[key], where, key, minimum, inclusive, maximum)
    if "count" in t:
        count = t["count"]
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_DEVICES:
            raise HardwareError(f"{where}: 'count' is {count!r}, expected an integer in 1..{MAX_DEVICES}")
        kwargs["count"] = count
    if "shared_channel" in t:
        if not isinstance(t["shared_channel"], bool):
            raise HardwareError(
                f"{where}: 'shared_channel' is {t['shared_channel']!r}, expected true or false"
            )
        kwargs["shared_channel"] = t["shared_channel"]
    if "capacity_bytes" in t and t["capacity_bytes"] is not None:
        cap = t["capacity_bytes"]
        if isinstance(cap, bool) or not isinstance(cap, int) or not 0 <= cap <= MAX_STEP_NBYTES:
            raise HardwareError(
                f"{where}: 'capacity_bytes' is {cap!r}, expected null or an integer in 0..{MAX_STEP_NBYTES}"
            )
        kwargs["capacity_bytes"] = cap
    return TierModel(**kwargs)


@dataclass(frozen=True)
class HardwareModel:
    """Tiers by name ("ssd", "host"). A tier with ``capacity_bytes == 0`` is unavailable."""

    tiers: dict[str, TierModel] = field(default_factory=_default_tiers)
    name: str = "default"
    schema_version: int = HARDWARE_SCHEMA_VERSION

    def tier(self, name: str) -> TierModel:
        if name not in self.tiers:
            raise HardwareError(f"hardware model has no tier '{name}' (has: {', '.join(self.tiers)})")
        return self.tiers[name]

    def available_tiers(self) -> list[str]:
        return [n for n, t in self.tiers.items() if t.capacity_bytes is None or t.capacity_bytes > 0]

    def with_overrides(self, tier: str = "ssd", **changes: Any) -> HardwareModel:
        """A copy with fields of one tier replaced (what-if analysis: bandwidth, count, capacity)."""
        tiers = dict(self.tiers)
        tiers[tier] = replace(self.tier(tier), **changes)
        return replace(self, tiers=tiers)

    # ---------------------------------------------------------------------------------------- json io
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "name": self.name,
            "tiers": {k: asdict(v) for k, v in self.tiers.items()},
        }

    @classmethod
    def from_dict(cls, d: Any, *, source: str = "hardware model") -> HardwareModel:
        """Build and validate a model from its JSON form.

        Raises:
            HardwareError: naming ``source``, the field and the expected value.
        """
        if not isinstance(d, dict) or "tiers" not in d:
            raise HardwareError(f"{source}: expected a JSON object with a 'tiers' key")
        version = d.get("schema_version", HARDWARE_SCHEMA_VERSION)
        if isinstance(version, bool) or not isinstance(version, int):
            raise HardwareError(
                f"{source}: 'schema_version' is {version!r}, expected {HARDWARE_SCHEMA_VERSION}"
            )
        if version != HARDWARE_SCHEMA_VERSION:
            raise HardwareError(
                f"{source}: schema_version {version} is not supported (expected {HARDWARE_SCHEMA_VERSION})"
            )
        name = d.get("name", "custom")
        if not isinstance(name, str):
            raise HardwareError(f"{source}: 'name' is {name!r}, expected a string")
        if not isinstance(d["tiers"], dict) or not d["tiers"]:
            raise HardwareError(
                f"{source}: 'tiers' must be an object of tiers by name ({', '.join(TIERS)}), got "
                f"{type(d['tiers']).__name__}"
            )
        tiers = {}
        for tier_name, t in d["tiers"].items():
            if tier_name not in TIERS:
                raise HardwareError(
                    f"{source}: tier '{tier_name}' is not a tier (expected {', '.join(TIERS)})"
                )
            tiers[tier_name] = _tier_from_dict(t, f"{source}: tier '{tier_name}'")
        return cls(tiers=tiers, name=name, schema_version=version)

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> None:
        """Write the model as JSON through the safe writer (``overwrite`` replaces an existing file)."""
        write_json(path, self.to_dict(), overwrite=overwrite)

    @classmethod
    def load(cls, path: str | os.PathLike) -> HardwareModel:
        p = Path(path)
        try:
            # A regular file only, read up to a limit; NaN, Infinity and deep nesting refused.
            d = load_json(p, what="hardware model")
        except InputError as e:
            raise HardwareError(str(e)) from None
        return cls.from_dict(d, source=f"hardware model '{p}'")
