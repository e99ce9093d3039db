"""Human-readable sizes for output. (Parsing sizes and budgets lives in ``planner.budget``.)"""

from __future__ import annotations


def format_bytes(n: float | int | None) -> str:
    """1536 -> '1.5 KiB'; binary units, three significant figures."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    return f"{value} B"
