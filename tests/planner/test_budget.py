"""Sizes and budgets as users type them."""

from __future__ import annotations

import pytest

from teraio.planner.budget import (
    BudgetError,
    format_size,
    infeasible,
    parse_budget,
    parse_size,
    resolve_budget,
)


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        (1024, 1024),
        ("1024", 1024),
        ("512MiB", 512 * 2**20),
        ("512 MiB", 512 * 2**20),
        ("2GB", 2 * 10**9),
        ("2gb", 2 * 10**9),
        ("1.5e9", 1_500_000_000),
        ("1.5GiB", 3 * 2**29),
        ("4k", 4000),
        ("10kB", 10_000),
        ("3T", 3 * 10**12),
        ("0", 0),
        (2.0e3, 2000),
    ],
)
def test_parse_size(text, nbytes):
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["", "abc", "12 parsecs", "-5MB", "1e999", "MB", "nan", True, float("inf")])
def test_parse_size_rejects(text):
    with pytest.raises(BudgetError):
        parse_size(text)


@pytest.mark.parametrize(
    ("spec", "nbytes"),
    [
        ("40%", 400),
        ("100%", 1000),
        ("1.5e9", 1_500_000_000),
        ("5e-1", 500),
        (0.4, 400),
        ("0.25", 250),
        (1.0, 1000),
        ("512MiB", 512 * 2**20),
        (777, 777),
        ("1", 1),
        ("AUTO", None),
        (" auto ", None),
    ],
)
def test_resolve_budget(spec, nbytes):
    assert resolve_budget(spec, baseline_peak_bytes=1000) == nbytes


@pytest.mark.parametrize(
    "spec",
    [
        "0%",
        "-10%",
        "abc%",
        "half",
        "0",
        0,
        "0MB",
        "1e999%",
        "150%",
        1.5,
        "1.5",
        "-5",
        True,
        float("nan"),
        "99999999999999999999999999TB",
        2.0,
    ],
)
def test_resolve_budget_rejects_with_one_line_hint(spec):
    with pytest.raises(BudgetError) as e:
        resolve_budget(spec, baseline_peak_bytes=1000)
    assert "\n" not in str(e.value) and repr(spec) in str(e.value)


def test_infeasible_names_the_smallest_peak():
    msg = str(infeasible(100, 2 * 2**20))
    assert "2097152 bytes" in msg and "2 MiB" in msg and "smallest achievable peak" in msg


def test_format_size():
    assert format_size(512) == "512 B"
    assert format_size(3 * 2**20) == "3 MiB"
    assert format_size(5 * 2**50) == "5120 TiB"


@pytest.mark.parametrize(
    ("spec", "kind", "value"),
    [
        ("auto", "auto", None),
        ("40%", "fraction", 0.4),
        (0.4, "fraction", 0.4),
        ("100%", "fraction", 1.0),
        (1.0, "fraction", 1.0),
        ("512MiB", "bytes", 512 * 2**20),
        (4096, "bytes", 4096),
        ("1024", "bytes", 1024),
    ],
)
def test_parse_budget_without_a_peak(spec, kind, value):
    """The grammar is checked where the peak is not known yet (a backend's options at construction)."""
    parsed = parse_budget(spec, "memory_budget")
    assert (parsed.kind, parsed.value) == (kind, value)


def test_a_float_above_one_is_refused_and_says_what_to_write():
    with pytest.raises(
        BudgetError, match=r"memory_budget 1\.5: a float is a fraction .* \(0, 1\]; for bytes"
    ):
        parse_budget(1.5, "memory_budget")
