"""Fuzzing the CLI and the three file formats with hypothesis.

Random argument lists (words of the CLI's own vocabulary mixed with random text) and random mutations of
a valid profile, plan and hardware model go through ``teraio.cli.main`` in-process. Whatever the input:
no exception escapes (no traceback), a refused input exits 2 with one line on stderr and writes nothing,
and nothing outside the named output is created, changed or removed. Where the library's own loader
rejects a mutated file, the CLI must exit 2.

The commands that do long work (``profile`` trains, ``calibrate`` writes gigabytes, ``demo`` trains three
ways) get only argument lists that must be refused before that work starts: each holds at least one bad
argument, placed last so no later one overrides it, and the work itself is replaced by a stand-in that
fails the test if it is ever reached. Every example runs in its own directory as the working directory,
so a random relative path can only land there.

The random lists also draw special files (a FIFO, a link to /dev/zero, a document nested 200,000 deep)
and numbers out of range (nan, inf, 1e30, 2**62); :func:`test_special_files_and_out_of_range_numbers`
goes through a fixed table of them for every command that reads a file or takes a number, each under a
deadline: no traceback, no hang, every one refused in one line.

Example counts stay small so the suite stays fast (``TERAIO_FUZZ_EXAMPLES`` raises them).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
import signal
import stat
import tempfile
import traceback
from collections import Counter
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


#: Seconds one command may take before it counts as hung (a FIFO opened for reading blocked forever).
DEADLINE_S = float(os.environ.get("TERAIO_FUZZ_DEADLINE_S", "60"))


class Hang(BaseException):
    """Raised by the alarm when a command does not return in time (a BaseException: nothing swallows it)."""


@contextlib.contextmanager
def _deadline(seconds: float):
    """SIGALRM after ``seconds``: interrupts a blocking open() or read() in this (the main) thread."""

    def on_alarm(signum, frame):
        raise Hang(f"no answer in {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _cli(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    try:
        with (
            contextlib.redirect_stderr(err),
            contextlib.redirect_stdout(io.StringIO()),
            _deadline(DEADLINE_S),
        ):
            code = main(argv)
    except Hang:
        raise AssertionError(f"{argv} hung") from None
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


class WorkStarted(BaseException):
    """Raised by the stand-ins for long work: a BaseException, so no handler in the CLI can swallow it."""


@pytest.fixture
def no_long_work(monkeypatch):
    """Replace the first step of each long job (right after its argument checks) with WorkStarted."""
    import teraio.profiling.disk_calibration
    import teraio.tools.demo
    import teraio.tools.estimate
    import teraio.tools.profile_workload

    def started(*args, **kwargs):
        raise WorkStarted("an argument list that must be refused started the real work")

    monkeypatch.setattr(teraio.tools.profile_workload, "profile_workload", started)
    monkeypatch.setattr(teraio.tools.estimate, "build_target", started)  # the capture, after every check
    monkeypatch.setattr(
        teraio.profiling.disk_calibration, "filesystem_type", started
    )  # before its scratch directory
    monkeypatch.setattr(teraio.tools.demo, "run_demo", started)


# Random text as a command line could carry it: no NUL (argv entries are C strings), no surrogates.
# Never an option (a leading '-' could abbreviate --help, which exits 0, or --force); never a path with
# '/' or only dots: relative names resolve inside the example's own working directory.
_TEXT = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00/"), max_size=12
).filter(lambda t: not t.startswith("-") and t.strip(".") != "")


@contextlib.contextmanager
def _inside(work: Path):
    old = os.getcwd()
    os.chdir(work)
    try:
        yield
    finally:
        os.chdir(old)


# ---------------------------------------------------------------------------------------- special files
#: The deepest document the table nests (a 200,000-deep one ended `teraio show` in a RecursionError).
DEEP = 200_000


def _make_specials(work: Path) -> None:
    """Files no command may block on, read without end, or choke on: a FIFO, links to /dev/zero and
    /dev/null, a socket, a directory, JSON nested 200,000 deep, and (as root) a character device with
    /dev/zero's numbers made in ``work`` (the real /dev is never touched)."""
    import socket

    os.mkfifo(work / "fifo")
    (work / "zero").symlink_to("/dev/zero")
    (work / "null").symlink_to("/dev/null")
    (work / "adir").mkdir()
    (work / "deep.json").write_text("[" * DEEP + "]" * DEEP)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(work / "sock"))
    sock.close()
    with contextlib.suppress(PermissionError, OSError):
        os.mknod(work / "chardev", 0o644 | stat.S_IFCHR, os.makedev(1, 5))


def _specials(work: Path) -> dict[str, Path]:
    names = ("fifo", "zero", "null", "adir", "deep.json", "sock", "chardev")
    return {n.split(".")[0]: work / n for n in names if os.path.lexists(work / n)}


# -------------------------------------------------------------------------------------- argument lists
_TOKENS = [
    "plan", "simulate", "show", "sweep", "synth",
    "{prof}", "{plan}", "{hw}", "{out}", "{outdir}", "{work}", "", "-", "nope", "/proc/version", "..",
    "--budget", "-b", "50%", "300MB", "auto", "0", "-1", "lots", "1e400", "nan", "inf",
    "--solver", "greedy", "none", "magic", "--out", "-o", "--force", "--json", "--hardware",
    "--timeline", "--ssds", "--ssd-bw", "2GB", "--profile", "--tensors", "--budgets", "50%,auto",
    "--layers", "1", "2", "--hidden", "64", "--seq", "16", "--batch", "1", "--vocab", "8",
    "--time-limit", "--workers", "--tflops", "x", "0.5",
    "{fifo}", "{zero}", "{deep}", "1e30", str(2**62), "99999999999999999999999999TB", "--ssd-bw",
]  # fmt: skip


@FUZZ
@given(tokens=st.lists(st.one_of(st.sampled_from(_TOKENS), _TEXT), min_size=0, max_size=10))
def test_random_argument_lists(valid, tokens):
    work = Path(tempfile.mkdtemp(prefix="fuzz-args-"))
    try:
        for name in ("prof", "plan.json", "hw.json"):
            src = valid / name
            (shutil.copytree if src.is_dir() else shutil.copy)(src, work / name)
        _make_specials(work)
        subs = {
            "{prof}": str(work / "prof"),
            "{plan}": str(work / "plan.json"),
            "{hw}": str(work / "hw.json"),
            "{out}": str(work / "out.json"),
            "{outdir}": str(work / "outdir"),
            "{work}": str(work),
            **{f"{{{k}}}": str(v) for k, v in _specials(work).items()},
        }
        argv = [subs.get(t, t) for t in tokens]
        # Small, fast problems whatever the tokens say (argparse keeps the last value of an option).
        if argv and argv[0] in ("plan", "sweep"):
            argv += ["--solver", "greedy", "--time-limit", "5"]
        if argv and argv[0] == "synth":
            argv += ["--layers", "1", "--hidden", "64", "--seq", "16", "--batch", "1", "--vocab", "8"]
        before = _tree(work)
        with _inside(work):
            code, err = _cli(argv)
        outputs = (
            {"out.json", "outdir", "plan.json", "hw.json", "prof", *_specials(work)}
            if "--force" in argv
            else {"out.json", "outdir"}
        )
        # Outputs other than the dedicated ones may only appear new (an existing file needs --force).
        new = {k for k in _tree(work) if k not in before}
        _check(code, err, before, _tree(work), outputs | {n.split("/")[0] for n in new})
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _refused_before_work(work: Path, argv: list[str]) -> None:
    """Run ``argv`` inside ``work``: exit 2, one line, no traceback, nothing in ``work`` changed."""
    before = _tree(work)
    try:
        with _inside(work):
            code, err = _cli(argv)
    except WorkStarted:
        raise AssertionError(f"{argv} started the real work") from None  # an Exception: hypothesis shrinks it
    assert code == 2, (argv, err)
    _check(code, err, before, _tree(work), set())


def _fill(pieces: list[list[str]], subs: dict[str, str]) -> list[str]:
    return [subs.get(t, t) for piece in pieces for t in piece]


def _pieces(valid: list[list[str]], bad: list[list[str]]) -> st.SearchStrategy[list[list[str]]]:
    """Random options (valid, bad or random text), then one bad option last (so it is not overridden)."""
    anything = st.one_of(st.sampled_from(valid), st.sampled_from(bad), _TEXT.map(lambda t: [t]))
    return st.tuples(st.lists(anything, max_size=5), st.sampled_from(bad)).map(lambda p: [*p[0], p[1]])


_TARGET_FILE = """
import torch
raises = lambda: 1 / 0
not_tuple = lambda: torch.nn.Linear(2, 2)
not_module = lambda: ("model", torch.zeros(1))
no_tensors = lambda: (torch.nn.Linear(2, 2), [1, 2])
bad_loss = lambda: (torch.nn.Linear(2, 2), torch.zeros(1, 2), "loss")
not_callable = 3
"""
_BAD_TARGETS = [
    "builtin:nope", "builtin:", "builtin:TINY", "nope", ":fn", "t.py:", "missing.py:make", "t.py:missing",
    "t.py:raises", "t.py:not_tuple", "t.py:not_module", "t.py:no_tensors", "t.py:bad_loss",
    "t.py:not_callable", "broken.py:make", "notes.txt:make", "{work}/t.py:raises", "{work}:make",
]  # fmt: skip
_PROFILE_VALID = [["--steps", "2"], ["--inner", "eager"], ["--top", "3"], ["--json"], ["--out", "{work}/p2"]]  # fmt: skip
_PROFILE_BAD = [
    ["--steps", "0"], ["--steps", "-1"], ["--steps", "x"], ["--inner", "tvm"], ["--top", "-1"], ["--top", "y"],
    ["--out", "notes.txt/p"], ["--out", "notes.txt"], ["--out", "settings"], ["--out", ""], ["--out"],
]  # fmt: skip
_ANY_TARGET = st.one_of(
    st.sampled_from(_BAD_TARGETS), _TEXT.filter(lambda t: t not in ("builtin:tiny", "builtin:demo"))
)


@FUZZ
@given(
    # A bad target with any options, or the good one with a bad option last.
    case=st.one_of(
        st.tuples(
            _ANY_TARGET,
            st.lists(
                st.one_of(st.sampled_from(_PROFILE_VALID + _PROFILE_BAD), _TEXT.map(lambda t: [t])),
                max_size=5,
            ),
        ),
        st.tuples(st.just("builtin:tiny"), _pieces(_PROFILE_VALID, _PROFILE_BAD)),
    )
)
def test_profile_refuses_bad_targets_and_options_before_profiling(no_long_work, case):
    target, pieces = case
    work = Path(tempfile.mkdtemp(prefix="fuzz-profile-"))
    try:
        (work / "t.py").write_text(_TARGET_FILE)
        (work / "broken.py").write_text("def make(:\n")
        (work / "notes.txt").write_text("not python")
        (work / "settings").mkdir()
        (work / "settings" / "meta.json").write_text('{"lr": 0.1}')  # a user's directory, not a profile
        subs = {t: t.replace("{work}", str(work)) for t in _BAD_TARGETS if "{work}" in t}
        subs.update(
            {p: p.replace("{work}", str(work)) for piece in _PROFILE_VALID + _PROFILE_BAD for p in piece}
        )
        # The target comes first, so it is the positional whatever follows.
        argv = ["profile", subs.get(target, target), "--out", str(work / "p"), *_fill(pieces, subs)]
        _refused_before_work(work, argv)
    finally:
        shutil.rmtree(work, ignore_errors=True)


_CALIBRATE_VALID = [["--size", "8KiB"], ["--block", "4KiB"], ["--repeats", "1"], ["--raw-only"], ["--json"], ["--out", "{work}/hw.json"]]  # fmt: skip
_CALIBRATE_BAD = [
    ["--size", "0"], ["--size", "-1"], ["--size", "lots"], ["--size", "1e400"], ["--size", "nan"],
    ["--size", "4097"], ["--size", "6KiB", "--block", "4KiB"], ["--block", "0"], ["--block", "1000"],
    ["--block", "4MiB", "--size", "1MiB"], ["--repeats", "0"], ["--repeats", "-2"], ["--repeats", "x"],
    ["--out", "{work}/missing/hw.json"], ["--out", "{existing}"], ["--out", ""], ["--out", "{work}"],
]  # fmt: skip
_CALIBRATE_DIRS = ["{work}/disk", "{work}/missing", "{existing}", "", "disk", "{work}/missing/deeper"]


@FUZZ
@given(directory=st.one_of(st.sampled_from(_CALIBRATE_DIRS), _TEXT), data=st.data())
def test_calibrate_refuses_bad_dirs_and_sizes_before_measuring(no_long_work, directory, data):
    work = Path(tempfile.mkdtemp(prefix="fuzz-calibrate-"))
    try:
        (work / "disk").mkdir()
        (work / "existing.json").write_text("{}")
        subs = {"{work}": str(work), "{existing}": str(work / "existing.json")}
        subs.update(
            {
                p: p.replace("{work}", str(work))
                for piece in _CALIBRATE_VALID + _CALIBRATE_BAD
                for p in piece
                if "{work}" in p
            }
        )
        subs.update({d: d.replace("{work}", str(work)) for d in _CALIBRATE_DIRS if "{work}" in d})
        pieces = data.draw(_pieces(_CALIBRATE_VALID, _CALIBRATE_BAD))
        _refused_before_work(work, ["calibrate", subs.get(directory, directory), *_fill(pieces, subs)])
    finally:
        shutil.rmtree(work, ignore_errors=True)


_DEMO_VALID = [
    ["--model", "tiny"], ["--steps", "1"], ["--budget", "50%"], ["--budget", "auto"], ["--solver", "greedy"],
    ["--inner", "eager"], ["--json"], ["--methods", "teraio"], ["--offload-dir", "{work}"],
    ["--out", "{work}/demo.json"], ["--run-dir", "{work}/run"], ["--time-limit", "5"],
]  # fmt: skip
_DEMO_BAD = [
    ["--model", "gpt"], ["--steps", "0"], ["--steps", "-1"], ["--steps", "x"], ["--budget", "lots"],
    ["--budget", "0"], ["--budget", "0%"], ["--budget", "1e400"], ["--solver", "magic"], ["--solver", ""],
    ["--time-limit", "0"], ["--time-limit", "nan"], ["--time-limit", "-1"], ["--time-limit", "inf"],
    ["--inner", "tvm"], ["--offload-dir", "{work}/missing"], ["--offload-dir", "{existing}"],
    ["--methods", "magic"], ["--methods", ","], ["--methods", "teraio,magic"], ["--out", "{existing}"],
    ["--out", "{work}/missing/x.json"], ["--out", ""], ["--out", "{work}"], ["--run-dir", "{existing}"],
    ["--run-dir", "{work}/foreign"], ["--run-dir", ""],
]  # fmt: skip


@FUZZ
@given(data=st.data())
def test_demo_refuses_bad_arguments_before_training(no_long_work, data):
    work = Path(tempfile.mkdtemp(prefix="fuzz-demo-"))
    try:
        (work / "existing.json").write_text("{}")
        (work / "foreign" / "teraio").mkdir(parents=True)
        (work / "foreign" / "teraio" / "config.json").write_text('{"theme": "dark"}')
        subs = {"{work}": str(work), "{existing}": str(work / "existing.json")}
        subs.update(
            {
                p: p.replace("{work}", str(work))
                for piece in _DEMO_VALID + _DEMO_BAD
                for p in piece
                if "{work}" in p
            }
        )
        pieces = data.draw(_pieces(_DEMO_VALID, _DEMO_BAD))
        _refused_before_work(work, ["demo", *_fill(pieces, subs)])
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.parametrize(
    "argv",
    [
        # Found by these tests: each was accepted and failed only after the work (or never).
        ["demo", "--model", "tiny", "--budget", "lots"],
        ["demo", "--model", "tiny", "--solver", "magic"],
        ["demo", "--model", "tiny", "--time-limit", "nan"],
        ["profile", "builtin:tiny", "--out", "p", "--top", "-1"],
        # A line break in an argument made argparse's error two lines.
        ["calibrate", "disk", "--size", "1\n2"],
        ["profile", "builtin:tiny", "--out", "p", "extra\x85argument"],
    ],
)
def test_found_by_fuzzing(no_long_work, tmp_path, argv):
    (tmp_path / "disk").mkdir()
    _refused_before_work(tmp_path, argv)


def test_the_work_stand_ins_are_reached_by_valid_arguments(no_long_work, tmp_path):
    """The fuzz tests prove something only if valid arguments do reach the stand-ins."""
    (tmp_path / "disk").mkdir()
    for argv in (
        ["profile", "builtin:tiny", "--out", str(tmp_path / "p")],
        ["calibrate", str(tmp_path / "disk"), "--size", "8KiB", "--block", "4KiB"],
        ["demo", "--model", "tiny", "--steps", "1", "--solver", "greedy", "--run-dir", str(tmp_path / "run")],
    ):
        with pytest.raises(WorkStarted):
            _cli(argv)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk"]


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


# ---------------------------------------------------- special files and out-of-range numbers, table
_BIG = [str(2**62), str(10**30), "1e30"]
_NOT_FINITE = ["nan", "inf", "-inf", "1e400"]


def _variant(doc: Any, path: tuple, value: Any) -> Any:
    doc = json.loads(json.dumps(doc))
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    parent[path[-1]] = value
    return doc


def _file_variants(work: Path, valid: Path) -> tuple[list[Path], list[Path], list[Path]]:
    """Plans, hardware models and profile directories that are special files or hold numbers out of
    range; every one must be refused."""
    import pandas as pd

    specials = list(_specials(work).values())
    plan_doc = json.loads((valid / "plan.json").read_text())
    plans = list(specials)
    for path, value in [
        (("predicted_step_s",), float("nan")),
        (("predicted_step_s",), float("inf")),
        (("predicted_step_s",), 1e30),
        (("budget_bytes",), 2**62),
        (("budget_bytes",), 10**30),
        (("decisions", 0, "nbytes"), 2**62),
        (("decisions", 0, "prefetch_before_idx"), 10**30),
        (("stats", "wall_s"), 1e30),
        (("hardware", "tiers", "ssd", "count"), 10**30),
    ]:
        f = work / f"plan-{len(plans)}.json"
        f.write_text(json.dumps(_variant(plan_doc, path, value)))
        plans.append(f)
    hw_doc = json.loads((valid / "hw.json").read_text())
    hardware = list(specials)
    for field, value in [
        ("count", 10**30), ("count", 2**62), ("write_bw_bytes_per_s", float("nan")),
        ("write_bw_bytes_per_s", float("inf")), ("write_bw_bytes_per_s", 1e30),
        ("read_bw_bytes_per_s", 2**62), ("capacity_bytes", 2**62), ("read_latency_s", 1e30),
        ("cpu_s_per_byte", 1e30),
    ]:  # fmt: skip
        f = work / f"hw-{len(hardware)}.json"
        f.write_text(json.dumps(_variant(hw_doc, ("tiers", "ssd", field), value)))
        hardware.append(f)
    profiles = []

    def profile_dir(name: str) -> Path:
        d = work / f"prof-{name}"
        shutil.copytree(valid / "prof", d)
        profiles.append(d)
        return d

    for file in ("meta.json", "ops.parquet", "tensors.parquet"):
        for special in ("fifo", "zero", "deep", "adir"):
            d = profile_dir(f"{file}-{special}")
            (d / file).unlink()
            src = _specials(work)[special]
            if special == "fifo":
                os.mkfifo(d / file)
            elif special == "adir":
                (d / file).mkdir()
            elif special == "deep":
                shutil.copy(src, d / file)
            else:
                (d / file).symlink_to("/dev/zero")
    meta = json.loads((valid / "prof" / "meta.json").read_text())
    for key, value in [
        ("step_s", float("nan")), ("fwd_s", float("inf")), ("bwd_s", 1e30), ("outside_s", 1e30),
        ("census_after_fwd_bytes", 2**62), ("graph_id", 10**30), ("num_fwd_ops", 10**30),
    ]:  # fmt: skip
        d = profile_dir(f"meta-{key}")
        (d / "meta.json").write_text(json.dumps({**meta, key: value}))
    for table, col, value in [
        ("tensors", "nbytes", 2**62),
        ("tensors", "nbytes", 2**48 + 1),
        ("ops", "duration_us", 1e30),
        ("ops", "duration_us", float("inf")),
        ("ops", "other_bytes", 2**62),
    ]:
        d = profile_dir(f"{table}-{col}-{value}")
        df = pd.read_parquet(d / f"{table}.parquet")
        if col not in df.columns:  # an optional column
            df[col] = 0
        df[col] = df[col].astype(type(value) if not isinstance(value, int) else "int64")
        df.loc[0, col] = value
        df.to_parquet(d / f"{table}.parquet", index=False)
    for special in ("fifo", "zero", "deep"):
        d = work / f"profset-{special}"
        d.mkdir()
        src = _specials(work)[special]
        if special == "fifo":
            os.mkfifo(d / "index.json")
        elif special == "zero":
            (d / "index.json").symlink_to("/dev/zero")
        else:
            shutil.copy(src, d / "index.json")
        profiles.append(d)
    return plans, hardware, profiles


def _table(work: Path, valid: Path) -> list[list[str]]:
    plans, hardware, profiles = _file_variants(work, valid)
    prof, plan, out = str(work / "prof"), str(work / "plan.json"), str(work / "new.json")
    specials = _specials(work)
    cases: list[list[str]] = []
    for p in map(str, plans):
        cases += [["show", p], ["show", p, "--profile", prof], ["simulate", prof, p]]
    for h in map(str, hardware):
        cases += [
            ["plan", prof, "-b", "300MB", "--solver", "greedy", "--hardware", h, "-o", out],
            ["sweep", prof, "--budgets", "50%", "--hardware", h],
            ["simulate", prof, plan, "--hardware", h],
            ["demo", "--model", "tiny", "--hardware", h],
        ]
    for d in map(str, profiles):
        cases += [
            ["plan", d, "-b", "50%", "--solver", "greedy", "-o", out],
            ["show", plan, "--profile", d],
            ["simulate", d, plan],
            ["sweep", d, "--budgets", "50%"],
        ]
    for name, special in specials.items():
        cases.append(["profile", f"{special}:make", "--out", str(work / "p-out")])
        if name != "adir":  # a real directory: calibrate would measure it
            cases.append(["calibrate", str(special)])
        if name in ("fifo", "sock", "chardev", "adir"):  # links at an output are replaced themselves
            cases += [
                ["plan", prof, "-b", "300MB", "--solver", "greedy", "-o", str(special), "--force"],
                ["simulate", prof, plan, "--timeline", str(special), "--force"],
                ["sweep", prof, "--budgets", "50%", "--out", str(special), "--force"],
                ["calibrate", str(work / "disk"), "--out", str(special), "--force"],
                ["demo", "--model", "tiny", "--out", str(special), "--force"],
            ]
    budgets = [*_BIG, *_NOT_FINITE, "99999999999999999999999999TB", "1e30%", "nan%", "-1", "0"]
    seconds = [*_BIG, *_NOT_FINITE, "0", "-1"]
    for b in budgets:
        cases += [
            ["plan", prof, "-b", b, "--solver", "greedy", "-o", out],
            ["sweep", prof, "--budgets", b],
            ["simulate", prof, plan, "--budget", b],
            ["demo", "--model", "tiny", "--budget", b],
        ]
    for t in seconds:
        cases += [
            ["plan", prof, "-b", "50%", "--time-limit", t, "-o", out],
            ["sweep", prof, "--time-limit", t],
            ["demo", "--model", "tiny", "--time-limit", t],
        ]
    for n in [str(2**62), str(10**30), "0", "-1"]:
        cases += [
            ["plan", prof, "-b", "50%", "--workers", n, "-o", out],
            ["sweep", prof, "--workers", n],
            ["simulate", prof, plan, "--ssds", n],
            ["demo", "--model", "tiny", "--steps", n],
            ["demo", "--model", "tiny", "--round-steps", n],
            ["profile", "builtin:tiny", "--out", str(work / "p-out"), "--steps", n],
            ["calibrate", str(work / "disk"), "--repeats", n],
        ]
    for opt in ("--ssd-bw", "--ssd-write-bw", "--ssd-read-bw"):
        for v in [*_BIG, *_NOT_FINITE, "0"]:
            cases.append(["simulate", prof, plan, opt, v])
    for opt in ("--layers", "--hidden", "--seq", "--batch", "--vocab", "--heads"):
        for v in [str(2**62), str(10**30), "100000000", "1000000000", "0"]:
            cases.append(["synth", opt, v, "--out", str(work / "s-out")])
    for v in [*_BIG, *_NOT_FINITE, "0"]:
        cases.append(["synth", "--tflops", v, "--out", str(work / "s-out")])
    for opt, v in [("--size", "1e30"), ("--size", str(2**62)), ("--size", "nan"), ("--block", "1e30")]:
        cases.append(["calibrate", str(work / "disk"), opt, v])
    cases.append(["profile", "builtin:tiny", "--out", str(work / "p-out"), "--top", str(2**62)])
    est = ["estimate", "builtin:tiny", "--out", str(work / "e-out")]
    for special in specials.values():  # a preset file given by path is read like any other input
        cases.append([*est, "--hardware", str(special)])
    for t in seconds:
        cases.append([*est, "--hardware", "cpu-local", "--time-limit", t])
    for b in budgets:
        cases.append([*est, "--hardware", "cpu-local", "--budget", b])
    for v in [*_BIG, *_NOT_FINITE, "0"]:
        cases.append([*est, "--hardware", "cpu-local", "--ssd-bw", v])
    for opt in ("--workers", "--ssds", "--gpus", "--batch", "--seq", "--layers"):
        for n in [str(2**62), str(10**30), "0", "-1"]:
            cases.append([*est, "--hardware", "cpu-local", opt, n])
    return cases


def _outcome(work: Path, argv: list[str]) -> tuple[str, str]:
    """How one command ended: "exit N", "traceback", "hang" or "started work", and what it printed."""
    err = io.StringIO()
    try:
        with _inside(work), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            with _deadline(DEADLINE_S):
                code = main(argv)
    except Hang:
        return "hang", err.getvalue()
    except WorkStarted:
        return "started work", err.getvalue()
    except BaseException:  # noqa: BLE001 - what escapes main() is a traceback for the user
        return "traceback", traceback.format_exc()
    return f"exit {code}", err.getvalue()


def test_special_files_and_out_of_range_numbers(no_long_work, valid, tmp_path, capsys):
    """The red team's 296 inputs left 3 tracebacks, a FIFO that blocked forever and a link to /dev/zero
    read without end; NaN, infinities, a count of 10**30 and sizes of 2**62 were accepted. Every input of
    this table must be refused in one line (exit 2), quickly, changing nothing."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "disk").mkdir()
    for name in ("prof", "plan.json", "hw.json"):
        src = valid / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, work / name)
    _make_specials(work)
    cases = _table(work, valid)
    outcomes: Counter[str] = Counter()
    wrong = []
    for argv in cases:
        before = _tree(work)
        outcome, text = _outcome(work, argv)
        outcomes[outcome] += 1
        after = _tree(work)
        changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
        lines = text.strip().splitlines()
        if outcome != "exit 2" or len(lines) != 1 or "Traceback" in text or changed:
            wrong.append((argv, outcome, text[-600:], sorted(changed)))
    with capsys.disabled():
        print(f"\nspecial files and out-of-range numbers: {len(cases)} inputs, outcomes {dict(outcomes)}")
    assert len(cases) >= 250
    assert wrong == [], wrong[:5]
