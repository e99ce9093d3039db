"""Fuzzing the CLI and the three file formats with hypothesis.

Random argument lists and random mutations of a valid profile, plan and hardware model go through
``teraio.cli.main`` in-process. Whatever the input: no exception escapes (no traceback), a refused input
exits 2 with one line on stderr and writes nothing, and nothing outside the named output is created,
changed or removed. Where the library's own loader rejects a mutated file, the CLI must exit 2.
Example counts stay small so the suite stays fast.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from teraio.cli import main
from teraio.planner.hardware import HardwareError, HardwareModel
from teraio.planner.plan import PlanError
from teraio.planner.profile import Profile, ProfileError
from teraio.planner.solve import solve
from tests.planner.planner_cases import pyramid, ssd_only
from tests.teraio.cli_helpers import tree as _tree

FUZZ = settings(
    max_examples=int(os.environ.get("TERAIO_FUZZ_EXAMPLES", "25")),
    deadline=None,
    derandomize=os.environ.get("TERAIO_FUZZ_EXAMPLES") is None,  # same examples each run: failures reproduce
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> Path:
    """A read-only source of valid files: profile directory, plan and hardware model."""
    d = tmp_path_factory.mktemp("valid")
    pyramid(duration_us=150_000.0).save(d / "prof")
    solve(pyramid(duration_us=150_000.0), "300MB", "greedy", ssd_only()).save(d / "plan.json")
    ssd_only().save(d / "hw.json")
    return d


def _cli(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    return code, err.getvalue()


def _check(code: int, err: str, before: dict, after: dict, outputs: set[str]) -> None:
    assert code in (0, 1, 2), (code, err)
    assert "Traceback" not in err
    changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
    if code == 2:
        assert len(err.strip().splitlines()) == 1, err
        assert changed == set(), f"a refused command changed {changed}"
    else:
        # Only the named outputs (and what lies inside an output directory) may appear or change.
        stray = {c for c in changed if not any(c == o or c.startswith(o + "/") for o in outputs)}
        assert stray == set(), f"changed outside the outputs: {stray}"


# -------------------------------------------------------------------------------------- argument lists
_TOKENS = [
    "plan", "simulate", "show", "sweep", "synth",
    "{prof}", "{plan}", "{hw}", "{out}", "{outdir}", "{work}", "", "-", "nope", "/proc/version", "..",
    "--budget", "-b", "50%", "300MB", "auto", "0", "-1", "lots", "1e400", "nan", "inf",
    "--solver", "greedy", "none", "magic", "--out", "-o", "--force", "--json", "--hardware",
    "--timeline", "--ssds", "--ssd-bw", "2GB", "--profile", "--tensors", "--budgets", "50%,auto",
    "--layers", "1", "2", "--hidden", "64", "--seq", "16", "--batch", "1", "--vocab", "8",
    "--time-limit", "--workers", "--tflops", "x", "0.5",
]  # fmt: skip


@FUZZ
@given(tokens=st.lists(st.sampled_from(_TOKENS), min_size=0, max_size=10))
def test_random_argument_lists(valid, tokens):
    work = Path(tempfile.mkdtemp(prefix="fuzz-args-"))
    try:
        for name in ("prof", "plan.json", "hw.json"):
            src = valid / name
            (shutil.copytree if src.is_dir() else shutil.copy)(src, work / name)
        subs = {
            "{prof}": str(work / "prof"),
            "{plan}": str(work / "plan.json"),
            "{hw}": str(work / "hw.json"),
            "{out}": str(work / "out.json"),
            "{outdir}": str(work / "outdir"),
            "{work}": str(work),
        }
        argv = [subs.get(t, t) for t in tokens]
        # Small, fast problems whatever the tokens say (argparse keeps the last value of an option).
        if argv and argv[0] in ("plan", "sweep"):
            argv += ["--solver", "greedy", "--time-limit", "5"]
        if argv and argv[0] == "synth":
            argv += ["--layers", "1", "--hidden", "64", "--seq", "16", "--batch", "1", "--vocab", "8"]
        before = _tree(work)
        code, err = _cli(argv)
        outputs = (
            {"out.json", "outdir", "plan.json", "hw.json", "prof"}
            if "--force" in argv
            else {"out.json", "outdir"}
        )
        # Outputs other than the dedicated ones may only appear new (an existing file needs --force).
        new = {k for k in _tree(work) if k not in before}
        _check(code, err, before, _tree(work), outputs | {n.split("/")[0] for n in new})
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ------------------------------------------------------------------------------------- file mutations
_JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path in a JSON document (dict keys and list indices)."""
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*prefix, i))
    return out


def _mutate(doc: Any, data: st.DataObject) -> Any:
    paths = _paths(doc)
    path = data.draw(st.sampled_from(paths))
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    if data.draw(st.booleans()) and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = data.draw(_JUNK)
    return doc


def _dump(doc: Any) -> str:
    # Python's json writes NaN/Infinity/1e400 as tokens other tools would too: keep them.
    return json.dumps(doc, allow_nan=True)


@FUZZ
@given(data=st.data())
def test_mutated_plans(valid, data):
    work = Path(tempfile.mkdtemp(prefix="fuzz-plan-"))
    try:
        shutil.copytree(valid / "prof", work / "prof")
        doc = _mutate(json.loads((valid / "plan.json").read_text()), data)
        readable = False
        (work / "plan.json").write_text(_dump(doc))
        from teraio.planner.plan import Plan, validate_plan

        try:
            plan = Plan.load(work / "plan.json")
            readable = True
            validate_plan(plan, Profile.load(work / "prof"))
            consistent = True
        except PlanError:
            consistent = False
        before = _tree(work)
        for argv in (
            ["show", str(work / "plan.json"), "--profile", str(work / "prof")],
            ["simulate", str(work / "prof"), str(work / "plan.json"), "--timeline", str(work / "t.csv")],
        ):
            code, err = _cli(argv)
            if not consistent:
                # show refuses; simulate reports a plan that breaks its profile's rules as violations (1)
                # and refuses (2) one it cannot even read.
                expected = (1, 2) if argv[0] == "simulate" and readable else (2,)
                assert code in expected, (argv, err)
            _check(code, err, before, _tree(work), {"t.csv"})
            with contextlib.suppress(FileNotFoundError):
                os.unlink(work / "t.csv")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _loads(loader, path: Path, error: type[Exception]) -> bool:
    """Whether the library's own loader accepts the file (the oracle for the CLI's exit code)."""
    try:
        loader(path)
    except error:
        return False
    return True


def _plan_and_check(work: Path, argv: list[str], loadable: bool) -> int:
    before = _tree(work)
    code, err = _cli(argv)
    if not loadable:
        assert code == 2, err
    _check(code, err, before, _tree(work), {"p.json"})
    return code


@FUZZ
@given(data=st.data())
def test_mutated_hardware_models(valid, data):
    work = Path(tempfile.mkdtemp(prefix="fuzz-hw-"))
    try:
        shutil.copytree(valid / "prof", work / "prof")
        doc = _mutate(json.loads((valid / "hw.json").read_text()), data)
        (work / "hw.json").write_text(_dump(doc))
        loadable = _loads(HardwareModel.load, work / "hw.json", HardwareError)
        argv = ["plan", str(work / "prof"), "-b", "300MB", "--solver", "greedy", "--hardware", str(work / "hw.json"), "-o", str(work / "p.json")]  # fmt: skip
        _plan_and_check(work, argv, loadable)
    finally:
        shutil.rmtree(work, ignore_errors=True)


_COLUMN_JUNK = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(2**62), max_value=2**62),
    st.sampled_from(["", "fwd", "bwd", "activation", "x"]),
)


@FUZZ
@given(data=st.data())
def test_mutated_profiles(valid, data):
    import pandas as pd

    work = Path(tempfile.mkdtemp(prefix="fuzz-prof-"))
    try:
        shutil.copytree(valid / "prof", work / "prof")
        what = data.draw(st.sampled_from(["meta", "ops", "tensors"]))
        if what == "meta":
            doc = _mutate(json.loads((work / "prof" / "meta.json").read_text()), data)
            (work / "prof" / "meta.json").write_text(_dump(doc))
        else:
            df = pd.read_parquet(work / "prof" / f"{what}.parquet")
            col = data.draw(st.sampled_from([c for c in df.columns if c != "shape"]))
            row = data.draw(st.integers(0, len(df) - 1))
            value = data.draw(_COLUMN_JUNK)
            df[col] = df[col].astype(object)
            df.loc[row, col] = value
            try:
                df.to_parquet(work / "prof" / f"{what}.parquet", index=False)
            except Exception:  # noqa: BLE001 - pyarrow cannot store this mix: not a file anyone could write
                return
        try:
            Profile.load(work / "prof")
            loadable = True
        except ProfileError:
            loadable = False
        before = _tree(work)
        code, err = _cli(
            ["plan", str(work / "prof"), "-b", "50%", "--solver", "greedy", "-o", str(work / "p.json")]
        )
        if not loadable:
            assert code == 2, err
        _check(code, err, before, _tree(work), {"p.json"})
        if code == 0:
            plan = json.loads((work / "p.json").read_text())
            assert math.isfinite(plan["predicted_step_s"])  # NaN profiles no longer make NaN plans
    finally:
        shutil.rmtree(work, ignore_errors=True)
