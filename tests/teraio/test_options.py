"""Every option of ``teraio.backend(...)`` is checked when the backend is built, in one line naming the
option and what to write instead: never at the fourth step, after profiling and planning."""

from __future__ import annotations

import os

import pytest

import teraio
from teraio.errors import UserInputError


def _refused(build=None, **options) -> str:
    with pytest.raises(UserInputError) as info:
        teraio.backend(**(build() if build is not None else options))
    message = str(info.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize(
    ("budget", "says"),
    [
        ("-5", "does not parse"),
        ("150%", "not a percentage in (0%, 100%]"),
        ("0%", "not a percentage in (0%, 100%]"),
        (1.5, "a float is a fraction of the unplanned peak and must be in (0, 1]"),
        ("1.5", "a unitless decimal is a fraction"),
        (0, "must be positive"),
        (True, "is not a budget"),
        ("lots", "does not parse"),
        (float("inf"), "must be in (0, 1]"),
        ("99999999999999999999999999TB", "the largest budget teraio accepts"),
    ],
)
def test_a_bad_budget_fails_at_construction(budget, says) -> None:
    message = _refused(memory_budget=budget)
    assert message.startswith("memory_budget ") and says in message


@pytest.mark.parametrize("budget", ["40%", "100%", 0.4, 1.0, "0.4", "512MiB", 4096, "1.5e9", "auto"])
def test_good_budgets_are_accepted(budget) -> None:
    teraio.backend(memory_budget=budget).close()


def test_an_offload_dir_below_a_regular_file_names_the_file(tmp_path) -> None:
    blocker = tmp_path / "notes.txt"
    blocker.write_text("mine")
    message = _refused(memory_budget="50%", offload_dirs=[str(blocker / "offload")])
    assert message == (
        f"offload_dirs: '{blocker / 'offload'}' cannot be created: '{blocker}' is a file, not a directory; "
        "name a directory"
    )
    assert blocker.read_text() == "mine"  # nothing touched


def test_an_offload_dir_that_is_a_file_is_refused(tmp_path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"")
    assert "is a file, not a directory" in _refused(memory_budget="50%", offload_dirs=str(f))


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_an_unwritable_offload_dir_is_refused(tmp_path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    try:
        message = _refused(memory_budget="50%", offload_dirs=[str(ro / "sub")])
        assert "not writable by this user" in message
    finally:
        ro.chmod(0o700)


def test_a_missing_offload_dir_that_can_be_created_is_accepted_and_not_created(tmp_path) -> None:
    target = tmp_path / "a" / "b"
    teraio.backend(memory_budget="50%", offload_dirs=[str(target)]).close()
    assert not (tmp_path / "a").exists()  # checked, not created: the engine creates it when it starts


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"solver": "fastest"}, "solver must be one of"),
        (
            {"solver": lambda: teraio.Solver(time_limit=float("nan"))},
            "time_limit must be a positive number of seconds",
        ),
        ({"solver": lambda: teraio.Solver(time_limit=0)}, "time_limit must be a positive number of seconds"),
        (
            {"solver": lambda: teraio.Solver(deterministic_time_limit=0)},
            "deterministic_time_limit must be None or a positive number",
        ),
        (
            {"solver": lambda: teraio.Solver(deterministic_time_limit="1")},
            "deterministic_time_limit must be None or a positive number",
        ),
        ({"solver": lambda: teraio.Solver(workers=0)}, "Solver.workers must be a whole number from 1 to"),
        ({"solver": lambda: teraio.Solver(workers=2.0)}, "Solver.workers must be a whole number from 1 to"),
        ({"checksum": "yes"}, "checksum must be True or False"),
        ({"offload_dirs": []}, "offload_dirs is empty"),
        ({"inner": "cuda"}, "inner must be one of"),
        ({"tiers": ["nvme"]}, "each of tiers must be one of"),
        (
            {"profiling": lambda: teraio.Profiling(steps=0)},
            "Profiling.steps must be a whole number of at least 1",
        ),
    ],
)
def test_other_bad_options_fail_at_construction(options, says) -> None:
    # An option object (teraio.Solver, teraio.Profiling) is refused when it is built.
    assert says in _refused(lambda: {k: v() if callable(v) else v for k, v in options.items()})


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"time_limit": float("nan")}, "time_limit must be a positive number of seconds"),
        ({"deterministic_time_limit": "1"}, "deterministic_time_limit must be None or a positive number"),
        ({"solver_workers": 0}, "solver_workers must be a whole number from 1 to"),
        ({"solver_workers": 2.0}, "solver_workers must be a whole number from 1 to"),
        ({"profile_steps": 0}, "profile_steps must be a whole number of at least 1"),
    ],
)
def test_deprecated_flat_options_fail_at_construction_naming_them(options, says) -> None:
    with pytest.warns(DeprecationWarning, match="is deprecated: use"):
        assert says in _refused(**options)
