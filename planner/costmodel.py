"""How long an op would take on a machine we do not have: a roofline over FLOPs and bytes, and the
hardware presets ``teraio estimate`` plans for.

``teraio estimate`` captures a training step's graphs without running them, so no op has a measured
duration. This module gives each op one from two counts its caller supplies (FLOPs from torch's flop
counter, bytes read and written from the tensors' shapes) and a :class:`ComputeModel` of the device:

    duration = max(flops / matmul rate of the op's dtype, bytes / memory bandwidth) + kernel overhead

Assumptions, each a source of error the benchmark reports against measured profiles:

- Only ops torch's flop counter counts have FLOPs (matmuls, convolutions, attention); they run at the
  preset's *achieved* matmul rate for their dtype, a fraction of the datasheet's dense peak. Every other
  op is bound by memory traffic: its inputs read once and its outputs written once, at the achieved
  memory bandwidth. Caches are ignored (a small op is charged its bytes as if from DRAM/HBM).
- Ops are not fused. Under Inductor a fused kernel reads its inputs and writes its outputs once, not
  once per op, so memory-bound time is an upper bound there; matmuls, which dominate large models, are
  extern calls either way.
- Attention is charged what the flop counter counts, which ignores causal masking (a flash kernel skips
  about half of the masked work).
- Each op that launches a kernel pays ``kernel_overhead_s`` (a launch and its tail on a GPU; the
  dispatch on a CPU); an op that only makes a view of its input (no data moves) pays ``view_overhead_s``
  (0 on a GPU, where views are host-side metadata overlapped with the device's queue).
- Ops run one after another (one stream), as the planner's execution model assumes.

Presets (``presets/*.json``, shipped as package data) pair a :class:`ComputeModel` with a
:class:`~planner.hardware.HardwareModel` for the SSD and host tiers, plus ``link_bw_bytes_per_s``, the
per-direction bandwidth of the link every SSD's traffic crosses (PCIe to the GPU): more drives than the
link can feed do not add bandwidth (:meth:`Preset.hardware_with`). Every figure of a preset has its
source in the file's ``sources`` map: a datasheet, a paper, a measurement on this project's machine, or
an assumption said to be one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

from teraio.planner.hardware import HardwareError, HardwareModel
from teraio.planner.safe_io import InputError, load_json

PRESET_SCHEMA_VERSION = 1
#: The dtypes a matmul rate may be given for. "tf32" is float32 on tensor cores (PyTorch's
#: ``torch.backends.cuda.matmul.allow_tf32``); "float32" without them.
RATE_DTYPES = ("float32", "tf32", "bfloat16", "float16")


class CostModelError(ValueError):
    """A preset or compute model is missing or malformed; the message names the file and the field."""


@dataclass(frozen=True)
class ComputeModel:
    """What one device computes per second, and what an op costs besides its work."""

    #: Achieved FLOP/s of the ops that have FLOPs, by dtype (keys from :data:`RATE_DTYPES`).
    matmul_flops_per_s: Mapping[str, float]
    #: Achieved bytes/s of device memory for memory-bound ops.
    mem_bw_bytes_per_s: float
    #: Time every op that launches a kernel adds, whatever its size.
    kernel_overhead_s: float = 0.0
    #: Time an op that only makes a view adds (no kernel).
    view_overhead_s: float = 0.0
    #: The device's memory (None: unknown, e.g. a CPU whose memory the model states share).
    device_memory_bytes: int | None = None

    def rate_flops_per_s(self, dtype: str) -> float:
        """The matmul rate for ``dtype``.

        Raises:
            CostModelError: the model has no rate for that dtype (the message lists the ones it has).
        """
        rate = self.matmul_flops_per_s.get(dtype)
        if rate is None:
            have = ", ".join(sorted(self.matmul_flops_per_s))
            raise CostModelError(f"the compute model has no matmul rate for dtype '{dtype}' (it has: {have})")
        return rate

    def op_seconds(self, flops: float, nbytes: float, dtype: str, *, kernel: bool = True) -> float:
        """The roofline duration of one op (module docstring)."""
        if not kernel:
            return self.view_overhead_s
        compute_s = flops / self.rate_flops_per_s(dtype) if flops > 0 else 0.0
        memory_s = nbytes / self.mem_bw_bytes_per_s if nbytes > 0 else 0.0
        return max(compute_s, memory_s) + self.kernel_overhead_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "matmul_flops_per_s": dict(self.matmul_flops_per_s),
            "mem_bw_bytes_per_s": self.mem_bw_bytes_per_s,
            "kernel_overhead_s": self.kernel_overhead_s,
            "view_overhead_s": self.view_overhead_s,
            "device_memory_bytes": self.device_memory_bytes,
        }


def _positive(value: Any, where: str, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise CostModelError(f"{where} is {value!r}, expected a finite number")
    if value < 0 or (value == 0 and not allow_zero):
        raise CostModelError(f"{where} is {value!r}, expected a number {'>=' if allow_zero else '>'} 0")
    return float(value)


def compute_model_from_dict(d: Any, source: str) -> ComputeModel:
    """A ComputeModel from its JSON form, every field checked.

    Raises:
        CostModelError: naming ``source`` and the field.
    """
    if not isinstance(d, dict):
        raise CostModelError(f"{source}: 'compute' must be an object")
    known = {
        "matmul_flops_per_s",
        "mem_bw_bytes_per_s",
        "kernel_overhead_s",
        "view_overhead_s",
        "device_memory_bytes",
    }
    unknown = sorted(set(d) - known)
    if unknown:
        raise CostModelError(
            f"{source}: 'compute' has unknown field '{unknown[0]}' (known: {', '.join(sorted(known))})"
        )
    rates = d.get("matmul_flops_per_s")
    if not isinstance(rates, dict) or not rates:
        raise CostModelError(f"{source}: 'compute.matmul_flops_per_s' must be an object of FLOP/s by dtype")
    for dtype, rate in rates.items():
        if dtype not in RATE_DTYPES:
            raise CostModelError(
                f"{source}: 'compute.matmul_flops_per_s' has dtype '{dtype}'; expected one of {', '.join(RATE_DTYPES)}"
            )
        _positive(rate, f"{source}: 'compute.matmul_flops_per_s.{dtype}'")
    if "mem_bw_bytes_per_s" not in d:
        raise CostModelError(f"{source}: 'compute' lacks 'mem_bw_bytes_per_s' (bytes per second, > 0)")
    memory = d.get("device_memory_bytes")
    if memory is not None and (isinstance(memory, bool) or not isinstance(memory, int) or memory <= 0):
        raise CostModelError(
            f"{source}: 'compute.device_memory_bytes' is {memory!r}, expected null or an integer > 0"
        )
    return ComputeModel(
        matmul_flops_per_s={k: float(v) for k, v in rates.items()},
        mem_bw_bytes_per_s=_positive(d["mem_bw_bytes_per_s"], f"{source}: 'compute.mem_bw_bytes_per_s'"),
        kernel_overhead_s=_positive(
            d.get("kernel_overhead_s", 0.0), f"{source}: 'compute.kernel_overhead_s'", allow_zero=True
        ),
        view_overhead_s=_positive(
            d.get("view_overhead_s", 0.0), f"{source}: 'compute.view_overhead_s'", allow_zero=True
        ),
        device_memory_bytes=memory,
    )


@dataclass(frozen=True)
class Preset:
    """A named machine to estimate on: one device's compute, its storage tiers, and the figures' sources."""

    name: str
    description: str
    compute: ComputeModel
    hardware: HardwareModel
    #: Per-direction bandwidth of the link the SSDs' traffic crosses (None: no cap).
    link_bw_bytes_per_s: float | None = None
    #: Where each figure comes from, keyed by its dotted path in the preset file.
    sources: Mapping[str, str] = field(default_factory=dict)
    path: str = ""

    def hardware_with(
        self, *, ssds: int | None = None, ssd_bw_bytes_per_s: float | None = None
    ) -> HardwareModel:
        """The preset's HardwareModel with what-if changes to its SSD tier.

        ``ssds`` drives striped together and ``ssd_bw_bytes_per_s`` per drive (read and write) replace the
        preset's; then each drive's share of the link caps its bandwidth (``link_bw_bytes_per_s / count``),
        so drives beyond what the link can feed add nothing.

        Raises:
            CostModelError: a count below 1 or a bandwidth that is not positive.
        """
        tier = self.hardware.tier("ssd")
        changes: dict[str, Any] = {}
        if ssds is not None:
            if isinstance(ssds, bool) or not isinstance(ssds, int) or ssds < 1:
                raise CostModelError(f"--ssds is {ssds!r}; expected an integer >= 1")
            changes["count"] = ssds
        if ssd_bw_bytes_per_s is not None:
            bw = _positive(ssd_bw_bytes_per_s, "--ssd-bw")
            changes["read_bw_bytes_per_s"] = bw
            changes["write_bw_bytes_per_s"] = bw
        tier = replace(tier, **changes)
        if self.link_bw_bytes_per_s is not None:
            share = self.link_bw_bytes_per_s / tier.count
            tier = replace(
                tier,
                read_bw_bytes_per_s=min(tier.read_bw_bytes_per_s, share),
                write_bw_bytes_per_s=min(tier.write_bw_bytes_per_s, share),
            )
        name = self.name
        if changes:
            name += "".join(f",{k}={v:g}" for k, v in sorted(changes.items()))
        return replace(self.hardware, tiers={**self.hardware.tiers, "ssd": tier}, name=name)


def _leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Dotted paths of every number in a JSON object (booleans and nulls are not figures)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield prefix, obj


#: Keys of a preset file that are not figures.
_NOT_FIGURES = {"schema_version", "hardware.schema_version"}


def figures_without_source(d: dict[str, Any]) -> list[str]:
    """Dotted paths of a preset's numbers that its ``sources`` map does not explain."""
    sources = d.get("sources") or {}
    return [
        path
        for path, _ in _leaves({k: v for k, v in d.items() if k != "sources"})
        if path not in _NOT_FIGURES and not str(sources.get(path, "")).strip()
    ]


def preset_from_dict(d: Any, source: str) -> Preset:
    """A Preset from its JSON form.

    Raises:
        CostModelError: a missing or malformed field, or a figure without a source.
    """
    if not isinstance(d, dict):
        raise CostModelError(f"{source}: expected a JSON object")
    version = d.get("schema_version")
    if version != PRESET_SCHEMA_VERSION:
        raise CostModelError(f"{source}: 'schema_version' is {version!r}, expected {PRESET_SCHEMA_VERSION}")
    known = {"schema_version", "name", "description", "compute", "hardware", "link_bw_bytes_per_s", "sources"}
    unknown = sorted(set(d) - known)
    if unknown:
        raise CostModelError(f"{source}: unknown key '{unknown[0]}' (known: {', '.join(sorted(known))})")
    name = d.get("name")
    if not isinstance(name, str) or not name:
        raise CostModelError(f"{source}: 'name' must be a non-empty string")
    sources = d.get("sources")
    if not isinstance(sources, dict) or not all(isinstance(v, str) for v in sources.values()):
        raise CostModelError(
            f"{source}: 'sources' must be an object of strings (where each figure comes from)"
        )
    missing = figures_without_source(d)
    if missing:
        raise CostModelError(
            f"{source}: figure '{missing[0]}' has no entry in 'sources'; say where it comes from"
        )
    try:
        hardware = HardwareModel.from_dict(d.get("hardware"), source=f"{source}: 'hardware'")
    except HardwareError as e:
        raise CostModelError(str(e)) from None
    if "ssd" not in hardware.tiers:
        raise CostModelError(f"{source}: 'hardware' has no 'ssd' tier")
    link = d.get("link_bw_bytes_per_s")
    return Preset(
        name=name,
        description=str(d.get("description", "")),
        compute=compute_model_from_dict(d.get("compute"), source),
        hardware=hardware,
        link_bw_bytes_per_s=None if link is None else _positive(link, f"{source}: 'link_bw_bytes_per_s'"),
        sources=dict(sources),
        path=source,
    )


def _presets_dir() -> Any:
    return resources.files("teraio.planner") / "presets"


def preset_names() -> list[str]:
    """The presets shipped with the package, by name."""
    return sorted(p.name.removesuffix(".json") for p in _presets_dir().iterdir() if p.name.endswith(".json"))


def load_preset(name_or_path: str) -> Preset:
    """A shipped preset by name (``h100-nvl-4x990pro``), or a preset JSON file by path.

    Raises:
        CostModelError: no such preset or file (the message lists the shipped names), or a bad file.
    """
    if name_or_path.endswith(".json") or "/" in name_or_path:
        p = Path(name_or_path)
        try:
            # A user's file is untrusted input: a regular file only, read up to a limit; NaN, Infinity
            # and deep nesting refused (as every loader of the planner reads its files).
            d = load_json(p, what="hardware preset file")
        except InputError as e:
            raise CostModelError(str(e)) from None
        return preset_from_dict(d, f"hardware preset '{p}'")
    entry = _presets_dir() / f"{name_or_path}.json"
    if not entry.is_file():
        raise CostModelError(
            f"unknown hardware preset '{name_or_path}'; choose one of: {', '.join(preset_names())} "
            "(or give a preset JSON file)"
        )
    where = f"hardware preset '{name_or_path}'"
    try:
        d = json.loads(entry.read_text())
    except ValueError as e:
        raise CostModelError(f"{where} is not valid JSON: {e}") from None
    return preset_from_dict(d, where)
