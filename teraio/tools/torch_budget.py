"""PyTorch's own ``activation_memory_budget`` at a given peak: the demo's ``torch-budget`` row.

Note: [Finding the ratio that reaches a peak]
    The knob is a ratio of the saved activations, not a peak, and the peak it gives is not monotone in
    it: on the built-in demo GPT with Inductor, ratio 0.5 peaked at 0.54 of the no-budget peak, 0.2 at
    0.40, and 0 at 1.00 (recomputing everything materialises it all again in the backward). The demo
    asks the question a user asks: at the peak teraio reached, which ratio does the compiler's recompute
    need, and how fast is it there? Each probe compiles the model at one ratio without any migration and
    measures one step's peak with the torch profiler (the instrument of every demo row). The first probe
    is the target's share of the no-budget peak, rounded down to PROBE_STEP; then steps of PROBE_STEP
    down while the peak stays above the target, at most MAX_PROBES compiles. The first ratio measured
    within the target wins; when none is, torch "cannot reach" the peak and the row runs at the ratio
    that peaked lowest.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from teraio.sizes import format_size

log = logging.getLogger(__name__)

#: Ratio steps between probes, and the most probes one search compiles.
PROBE_STEP = 0.05
MAX_PROBES = 6


@dataclass
class RatioSearch:
    """The probes of one search: ratio -> measured peak; ``ratio`` is the answer (None: cannot reach)."""

    target_bytes: int
    peaks: dict[float, int] = field(default_factory=dict)
    ratio: float | None = None

    def to_dict(self) -> dict[str, object]:
        return {
            "target_bytes": self.target_bytes,
            "ratio": self.ratio,
            "probes": [{"ratio": r, "peak_bytes": p} for r, p in self.peaks.items()],
        }


def find_ratio(target_bytes: int, no_budget_peak_bytes: int, peak_at: Callable[[float], int]) -> RatioSearch:
    """Note: [Finding the ratio that reaches a peak]. ``peak_at(ratio)`` measures one compile's peak."""
    search = RatioSearch(target_bytes)
    share = min(1.0, target_bytes / no_budget_peak_bytes) if no_budget_peak_bytes > 0 else 1.0
    ratio = round(int(share / PROBE_STEP + 1e-9) * PROBE_STEP, 4)
    while ratio >= 0 and len(search.peaks) < MAX_PROBES:
        search.peaks[ratio] = peak_at(ratio)
        log.info("torch activation_memory_budget %g: peak %s", ratio, format_size(search.peaks[ratio]))
        if search.peaks[ratio] <= target_bytes:
            search.ratio = ratio
            break
        ratio = round(ratio - PROBE_STEP, 4)
    return search


def lowest_peak_ratio(search: RatioSearch) -> float:
    """The ratio whose probe peaked lowest (the row's ratio when none reached the target)."""
    return min(search.peaks, key=lambda r: (search.peaks[r], -r))


__all__ = ["MAX_PROBES", "PROBE_STEP", "RatioSearch", "find_ratio", "lowest_peak_ratio"]
