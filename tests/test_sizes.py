"""One size grammar for the planner and the runtime (the leaf module ``teraio.sizes``, which both import).

These tests fail when the planner's ``parse_size`` and the runtime's ``parse_nbytes`` give different
answers (or different errors) on any input of one shared table, and when the formatter changes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from teraio.planner.budget import BudgetError, parse_size
from teraio.runtime import parse_nbytes
from teraio.runtime.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]

#: (input, bytes): every parser must give exactly these.
ACCEPTED = [
    (0, 0),
    (1024, 1024),
    (2**60 + 1, 2**60 + 1),  # ints stay exact, whatever their size
    (np.int64(4096), 4096),
    (1.5, 2),  # floats round to the nearest byte (halves to even)
    (2.5, 2),
    (2.0e3, 2000),
    (np.float64(7.6), 8),
    ("0", 0),
    ("1024", 1024),
    ("123456789012345678901", 123456789012345678901),  # whole numbers in text are exact too
    ("1.9999", 2),  # rounded, not truncated
    ("1.5e9", 1_500_000_000),
    ("1.5E9", 1_500_000_000),
    ("2e-3KB", 2),
    (".5GB", 500_000_000),
    ("0.1GB", 100_000_000),
    ("4.35kB", 4350),  # 4.35 * 1000 is 4349.999... in floats: truncation would say 4349
    ("512MiB", 512 * 2**20),
    ("512 MiB", 512 * 2**20),
    ("1 GiB", 2**30),
    ("  3 TiB  ", 3 * 2**40),
    ("1.5GiB", 3 * 2**29),
    ("2GB", 2 * 10**9),
    ("2gb", 2 * 10**9),
    ("3T", 3 * 10**12),
    ("7b", 7),
    ("7B", 7),
    ("1KiB", 1024),
    ("1kib", 1024),
    ("1KIB", 1024),
    ("1KB", 1000),
    ("1kB", 1000),
    ("1kb", 1000),
    ("1k", 1000),
    ("1K", 1000),
    ("1M", 10**6),
    ("1G", 10**9),
]

#: Inputs every parser must refuse.
REFUSED = [
    True,
    False,
    -1,
    -0.5,
    float("nan"),
    float("inf"),
    float("-inf"),
    "",
    "   ",
    "-5MB",
    "+5MB",
    "-1",
    "nan",
    "inf",
    "1e999",
    "abc",
    "MB",
    "12 parsecs",
    "1 2",
    "5.",
    "1,024",
    "1KiBB",
    "1 Ki B",
    "0x10",
    None,
    b"1024",
    [1024],
    np.bool_(True),
]


def test_the_planner_and_the_runtime_share_one_grammar():
    import teraio.planner.budget as budget
    import teraio.runtime.config as runtime_config
    import teraio.sizes as sizes

    assert budget.nbytes_of is sizes.nbytes_of and runtime_config.nbytes_of is sizes.nbytes_of


def test_format_size_says_none_for_a_missing_figure():
    from teraio.sizes import format_size

    assert (format_size(None), format_size(1536), format_size(0)) == ("-", "1.5 KiB", "0 B")


@pytest.mark.parametrize(("value", "nbytes"), ACCEPTED, ids=[repr(v) for v, _ in ACCEPTED])
def test_both_parsers_accept(value, nbytes):
    got = (parse_size(value), parse_nbytes(value))
    assert got == (nbytes, nbytes)
    assert all(type(x) is int for x in got)


@pytest.mark.parametrize("value", REFUSED, ids=[repr(v) for v in REFUSED])
def test_both_parsers_refuse_with_the_same_message(value):
    with pytest.raises(BudgetError) as planner_error:
        parse_size(value)
    with pytest.raises(ConfigError) as runtime_error:
        parse_nbytes(value)
    message = str(planner_error.value)
    assert message == str(runtime_error.value)
    assert message.startswith(f"size {value!r} ") and "\n" not in message


def test_runtime_messages_name_the_option():
    with pytest.raises(ConfigError, match=r"^chunk_bytes '12 parsecs' does not parse"):
        parse_nbytes("12 parsecs", what="chunk_bytes")
