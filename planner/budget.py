"""Memory budgets: turning what a user types ("512MiB", "40%", "auto") into a number of bytes.

Sizes follow the project's one size grammar, :mod:`planner.sizes` (plain bytes ``1024`` or ``"1.5e9"``,
decimal units ``kB MB GB TB`` and the bare letters ``K M G T``, binary units ``KiB MiB GiB TiB``); the
CLI, ``teraio.backend`` and the notebooks parse sizes here, and the runtime's ``parse_nbytes`` applies
the same grammar from its byte-identical copy of that module (the runtime may not import the planner).
A budget is a size, a fraction of the unplanned peak (``"40%"``, ``0.4``, ``"0.4"``), or ``"auto"``: the
smallest peak that predicts no stall, which only a solver can find, so it resolves to ``None`` here.
"""

from __future__ import annotations

import math

from teraio.planner.limits import MAX_STEP_NBYTES
from teraio.planner.sizes import SIZE_RE, SizeError, nbytes_of

AUTO = "auto"


class BudgetError(ValueError):
    """A size or budget does not parse, or cannot be met. The message says what to type instead.

    ``smallest_peak_bytes``: for a budget that cannot be met, the smallest achievable peak (else None),
    so a caller can plan for that instead without parsing the message.
    """

    def __init__(self, message: str, smallest_peak_bytes: int | None = None) -> None:
        super().__init__(message)
        self.smallest_peak_bytes = smallest_peak_bytes


def infeasible(budget_bytes: int, min_feasible_peak_bytes: int, what: str = "budget") -> BudgetError:
    """The error for a budget below the smallest achievable peak (the message names that peak)."""
    return BudgetError(
        f"{what} {format_size(budget_bytes)} ({budget_bytes} bytes) cannot be met: the smallest achievable "
        f"peak is {format_size(min_feasible_peak_bytes)} ({min_feasible_peak_bytes} bytes); "
        f"use a budget of at least that",
        smallest_peak_bytes=int(min_feasible_peak_bytes),
    )


def format_size(nbytes: float) -> str:
    """Human-readable binary size: ``format_size(3 * 2**20) == '3.00 MiB'``."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def parse_size(text: str | int | float) -> int:
    """Parse a size in bytes: ``1024``, ``"512MiB"``, ``"2GB"``, ``"1.5e9"`` (grammar: :mod:`planner.sizes`).

    Raises:
        BudgetError: the text is not a non-negative size with a known unit.
    """
    try:
        return nbytes_of(text, "size")
    except SizeError as e:
        raise BudgetError(str(e)) from None


def _parse_fraction(spec: str | float) -> float | None:
    """The fraction a spec denotes ("40%", 0.4, "0.4"), or None when it is not a fraction."""
    if isinstance(spec, float):
        return spec if 0 < spec <= 1 else None
    if isinstance(spec, str):
        s = spec.strip()
        if s.endswith("%"):
            try:
                return float(s[:-1]) / 100.0
            except ValueError:
                raise BudgetError(f"budget {spec!r} does not parse; write a percentage like 40%") from None
        # A unitless decimal at most 1 ("0.4") is a fraction; "1" or "1024" are bytes.
        m = SIZE_RE.match(s)
        if "." in s and m and not m.group(2):
            value = float(s)
            if 0 < value <= 1:
                return value
    return None


def resolve_budget(spec: str | int | float, baseline_peak_bytes: int) -> int | None:
    """Resolve a budget spec to bytes; ``None`` for ``"auto"``.

    Args:
        spec: bytes (int), a size with units, a fraction of ``baseline_peak_bytes`` ("40%", 0.4), or "auto".
        baseline_peak_bytes: the unplanned peak, which fractions refer to.

    Raises:
        BudgetError: the spec does not parse, is not positive, or is larger than
            ``planner.limits.MAX_STEP_NBYTES``.
    """
    if isinstance(spec, str) and spec.strip().lower() == AUTO:
        return None
    frac = _parse_fraction(spec)
    if frac is not None:
        if not (0 < frac <= 10) or not math.isfinite(frac):
            raise BudgetError(f"budget {spec!r} must be a positive fraction of the unplanned peak, e.g. 40%")
        return int(math.floor(frac * baseline_peak_bytes))
    try:
        nbytes = parse_size(spec)
    except BudgetError:
        raise BudgetError(
            f"budget {spec!r} does not parse; write bytes with units (512MiB, 2GB), a fraction of the "
            f"unplanned peak (40%, 0.4), or auto"
        ) from None
    if nbytes <= 0:
        raise BudgetError(f"budget {spec!r} must be positive")
    if nbytes > MAX_STEP_NBYTES:  # "99999999999999999999999999TB" overflowed the planner's int64 arithmetic
        raise BudgetError(
            f"budget {spec!r} is larger than {MAX_STEP_NBYTES} bytes (64 PiB), the largest budget teraio "
            "accepts"
        )
    return nbytes
