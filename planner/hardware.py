"""HardwareModel: what the machine can move, and what moving costs, as the planner sees it.

A plain dataclass with JSON in and out. Per tier: bandwidths and per-request latency for each direction,
how many devices stripe together, whether reads and writes share one channel (one queue) or run on two,
and a capacity. ``cpu_s_per_byte`` charges compute time per byte moved: on a 2-core CPU box I/O threads
steal cycles from the step (measured: about 0.3-0.45 s of step time per GB round trip).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

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


def _default_tiers() -> dict[str, TierModel]:
    # Defaults measured on the project's 2-core ext4 virtio machines (docs/measured_facts.md): O_DIRECT write
    # ~1.3 GB/s, read ~0.8 GB/s. Host tier: a memcpy on one core, capacity unknown (None = unlimited).
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
    def from_dict(cls, d: dict[str, Any]) -> HardwareModel:
        if not isinstance(d, dict) or "tiers" not in d:
            raise HardwareError("hardware model JSON must be an object with a 'tiers' key")
        version = int(d.get("schema_version", HARDWARE_SCHEMA_VERSION))
        if version != HARDWARE_SCHEMA_VERSION:
            raise HardwareError(
                f"hardware model schema_version {version} is not supported (expected "
                f"{HARDWARE_SCHEMA_VERSION})"
            )
        tiers = {}
        for name, t in d["tiers"].items():
            try:
                tiers[name] = TierModel(**t)
            except TypeError as e:
                raise HardwareError(f"hardware model tier '{name}': {e}") from None
            if tiers[name].write_bw_bytes_per_s <= 0 or tiers[name].read_bw_bytes_per_s <= 0:
                raise HardwareError(f"hardware model tier '{name}': bandwidths must be positive")
        return cls(tiers=tiers, name=str(d.get("name", "custom")), schema_version=version)

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def load(cls, path: str | os.PathLike) -> HardwareModel:
        p = Path(path)
        try:
            d = json.loads(p.read_text())
        except FileNotFoundError:
            raise HardwareError(f"hardware model '{p}' does not exist") from None
        except (OSError, ValueError) as e:
            raise HardwareError(f"hardware model '{p}' is not valid JSON: {e}") from None
        return cls.from_dict(d)
