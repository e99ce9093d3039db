"""Memory budgets: turning what a user types ("512MiB", "40%", "auto") into a number of bytes.

Sizes follow the project's one size grammar, :mod:`teraio.sizes` (plain bytes ``1024`` or ``"1.5e9"``,
decimal units ``kB MB GB TB`` and the bare letters ``K M G T``, binary units ``KiB MiB GiB TiB``); the
CLI, ``teraio.backend`` and the notebooks parse sizes here, and the runtime's ``parse_nbytes`` applies
the same grammar from its byte-identical copy of that module (the runtime may not import the planner).
A budget is a size, a fraction of the unplanned peak (``"40%"``, ``0.4``, ``"0.4"``), or ``"auto"``: the
smallest peak that predicts no stall, which only a solver can find, so it resolves to ``None`` here.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

from teraio.planner.limits import MAX_STEP_NBYTES
from teraio.sizes import SIZE_RE, SizeError, format_size, nbytes_of

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


def parse_size(text: str | int | float) -> int:
    """Parse a size in bytes: ``1024``, ``"512MiB"``, ``"2GB"``, ``"1.5e9"`` (grammar: :mod:`teraio.sizes`).

    Raises:
        BudgetError: the text is not a non-negative size with a known unit.
    """
    try:
        return nbytes_of(text, "size")
    except SizeError as e:
        raise BudgetError(str(e)) from None


@dataclass(frozen=True)
class BudgetSpec:
    """A budget as the user wrote it, checked: ``kind`` "auto", "fraction" (of the unplanned peak) or
    "bytes", with ``value`` the fraction in (0, 1] or the bytes."""

    kind: Literal["auto", "fraction", "bytes"]
    value: float | int | None = None


_WHOLE = re.compile(r"^[0-9]+$")
_GRAMMAR = (
    "write bytes (an int, or a size with a unit: 512MiB, 2GB), a fraction of the unplanned peak in (0, 1] "
    "(0.4, '0.4') or a percentage in (0%, 100%] ('40%'), or 'auto'"
)


def parse_budget(spec: object, what: str = "budget") -> BudgetSpec:
    """Check a budget's grammar without knowing the peak it is a fraction of.

    Bytes: an int, or text with a unit or a whole number ("512MiB", "1024"). A fraction: a float or a
    unitless decimal text in (0, 1] ("0.4"), or a percentage in (0%, 100%] ("40%"). A float above 1
    ("1.5") is refused rather than read as bytes: it would mean 2 bytes while "150%" means a fraction;
    a whole number in exponent form ("1.5e9") is bytes.
    A budget at or above the whole unplanned peak plans nothing and is refused too.

    Raises:
        BudgetError: one line naming ``what``, the value and what to write instead.
    """
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise BudgetError(f"{what} {spec!r} is not a budget; {_GRAMMAR}")
    if isinstance(spec, str) and spec.strip().lower() == AUTO:
        return BudgetSpec("auto")
    if isinstance(spec, float) or (isinstance(spec, str) and spec.strip().endswith("%")):
        text = spec.strip()[:-1] if isinstance(spec, str) else None
        try:
            value = float(text) / 100.0 if text is not None else float(spec)
        except ValueError:
            raise BudgetError(f"{what} {spec!r} does not parse; {_GRAMMAR}") from None
        if not math.isfinite(value) or not 0 < value <= 1:
            if text is not None:
                raise BudgetError(f"{what} {spec!r} is not a percentage in (0%, 100%]; {_GRAMMAR}")
            raise BudgetError(
                f"{what} {spec!r}: a float is a fraction of the unplanned peak and must be in (0, 1]; for "
                f"bytes write an int or a size with a unit ('1.5GiB')"
            )
        return BudgetSpec("fraction", value)
    if isinstance(spec, str):
        m = SIZE_RE.match(spec)
        if m and not m.group(2) and not _WHOLE.match(m.group(1)):
            value = float(m.group(1))
            if 0 < value <= 1:  # "0.4", "5e-1": a fraction
                return BudgetSpec("fraction", value)
            if not (math.isfinite(value) and value == int(value)):  # "1.5": neither bytes nor a fraction
                raise BudgetError(
                    f"{what} {spec!r}: a unitless decimal is a fraction of the unplanned peak and must be in "
                    f"(0, 1]; for bytes write a whole number or a size with a unit ('1.5GiB')"
                )
    try:
        nbytes = parse_size(spec)
    except BudgetError:
        raise BudgetError(f"{what} {spec!r} does not parse; {_GRAMMAR}") from None
    if nbytes <= 0:
        raise BudgetError(f"{what} {spec!r} must be positive; {_GRAMMAR}")
    if nbytes > MAX_STEP_NBYTES:  # "99999999999999999999999999TB" overflowed the planner's int64 arithmetic
        raise BudgetError(
            f"{what} {spec!r} is larger than {MAX_STEP_NBYTES} bytes (64 PiB), the largest budget teraio accepts"
        )
    return BudgetSpec("bytes", nbytes)


def resolve_budget(spec: str | int | float, baseline_peak_bytes: int) -> int | None:
    """Resolve a budget spec to bytes; ``None`` for ``"auto"``.

    Args:
        spec: :func:`parse_budget`'s grammar: bytes, a fraction of ``baseline_peak_bytes`` ("40%", 0.4), or
            "auto".
        baseline_peak_bytes: the unplanned peak, which fractions refer to.

    Raises:
        BudgetError: the spec does not parse, is not positive, or is larger than
            ``planner.limits.MAX_STEP_NBYTES``.
    """
    parsed = parse_budget(spec)
    if parsed.kind == "auto":
        return None
    if parsed.kind == "fraction":
        return int(math.floor(float(parsed.value) * baseline_peak_bytes))  # type: ignore[arg-type]
    return int(parsed.value)  # type: ignore[arg-type]
