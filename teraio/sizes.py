"""The project's one size grammar and its one byte formatter: what a user may write for a number of
bytes, and how a number of bytes is written back.

A leaf module: it imports only the standard library, so the planner (which may not import torch, the
runtime or the rest of teraio), the runtime (which may not import the planner) and the training process
all import it, and the grammar lives once (``tests/test_packaging.py`` lets ``teraio.planner`` and
``teraio.runtime`` import this module and nothing else of teraio). The planner's ``parse_size`` and the
runtime's ``parse_nbytes`` wrap :func:`nbytes_of` in their own error types; ``tests/test_sizes.py`` checks
that they agree on a shared table of accepted and refused sizes.

Accepted, in bytes:

- a non-negative ``int`` (exact);
- a finite, non-negative ``float``, rounded to the nearest byte (halves to even, as ``round``);
- text: a non-negative decimal number (``1024``, ``1.5``, ``.5``, ``1.5e9``), optionally followed by a
  unit, spaces allowed around both. Units, case-insensitive: ``B``; decimal ``k kB M MB G GB T TB``;
  binary ``KiB MiB GiB TiB``. Whole numbers without a unit are exact; anything else is rounded to the
  nearest byte (``"1.9999"`` is 2, ``".5GB"`` is 500000000).

Refused: ``bool`` (``True`` is not a size), negative numbers, signs, NaN and infinities (also as text,
``"nan"``, ``"1e999"``), empty text, unknown units, and every other type.
"""

from __future__ import annotations

import math
import numbers
import re

#: Bytes per unit; keys lower case (units are matched case-insensitively).
UNIT_NBYTES: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
#: A size as text: group 1 the number, group 2 the unit (possibly empty, checked against UNIT_NBYTES).
SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_WHOLE_RE = re.compile(r"^[0-9]+$")


class SizeError(ValueError):
    """A value is not a size in the grammar above. The message names the value and what to write."""


def nbytes_of(value: int | float | str, what: str = "size") -> int:
    """The number of bytes ``value`` denotes (the grammar of the module docstring).

    Args:
        value: an int, a float or text such as ``"512MiB"``, ``"2GB"``, ``"1.5e9"``.
        what: how error messages name the value (an option name, say).

    Raises:
        SizeError: the value is refused; the message starts with ``what`` and the value.
    """
    if isinstance(value, bool):
        raise SizeError(f"{what} {value!r} is not a number of bytes")
    if isinstance(value, numbers.Integral):
        nbytes = int(value)
        if nbytes < 0:
            raise SizeError(f"{what} {value!r} must be a finite, non-negative number of bytes")
        return nbytes
    if isinstance(value, numbers.Real):
        number, unit = float(value), ""
    elif isinstance(value, str):
        m = SIZE_RE.match(value)
        if not m or m.group(2).lower() not in UNIT_NBYTES:
            raise SizeError(
                f"{what} {value!r} does not parse; write bytes or a number with a unit, e.g. 512MiB, 2GB, 1.5e9"
            )
        unit = m.group(2).lower()
        if _WHOLE_RE.match(m.group(1)):
            # Whole numbers stay exact (a float has 53 bits: "123456789012345678" would not).
            return int(m.group(1)) * UNIT_NBYTES[unit]
        number = float(m.group(1))
    else:
        raise SizeError(f"{what} {value!r} is not a number of bytes: write an int or text like '512MiB'")
    if not math.isfinite(number) or number < 0:
        raise SizeError(f"{what} {value!r} must be a finite, non-negative number of bytes")
    return int(round(number * UNIT_NBYTES[unit]))


def format_size(nbytes: float | int | None) -> str:
    """A number of bytes for people, in binary units with three significant figures: ``1536`` is
    ``'1.5 KiB'``, ``200_000_000`` is ``'191 MiB'``, ``512`` is ``'512 B'``; None (a figure not measured)
    is ``'-'``. Messages that must be exact say the bytes beside it."""
    if nbytes is None:
        return "-"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            if unit == "B" or abs(value) >= 100:
                return f"{value:.0f} {unit}"
            return f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
