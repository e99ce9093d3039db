"""The CLI never destroys what it did not write, and every bad input or output is one line, exit 2.

Each case was reproduced before the fix: a project directory reduced to three profile files, a planted
symlink overwritten by calibrate, `plan -o existing.json` replacing an unrelated file, tracebacks for
unwritable outputs (after minutes of work for calibrate and demo), `simulate` exiting 0 on violations.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from teraio.planner.hardware import HardwareModel
from teraio.planner.plan import PLAN_SCHEMA_VERSION
from teraio.planner.profile import Profile
from tests.planner.planner_cases import pyramid, ssd_only
from tests.teraio.cli_helpers import error_line as _error_line
from tests.teraio.cli_helpers import run_cli as _run
from tests.teraio.cli_helpers import tree as _tree

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def files(tmp_path):
    prof = pyramid(duration_us=150_000.0).save(tmp_path / "prof")
    hw = tmp_path / "hw.json"
    ssd_only(write_bw=1e9, read_bw=0.5e9).save(hw)
    return tmp_path, prof, hw


@pytest.fixture
def project(tmp_path) -> Path:
    """A user's project directory that happens to hold a meta.json (and index.json)."""
    p = tmp_path / "project"
    (p / "src").mkdir(parents=True)
    (p / "src" / "train.py").write_text("print('train')\n")
    (p / "meta.json").write_text("{}")
    (p / "index.json").write_text("{}")
    return p


# ------------------------------------------------------------------------------- output directories
@pytest.mark.parametrize("command", ["synth", "profile"])
def test_profile_outputs_refuse_a_project_directory(capsys, project, command):
    before = _tree(project.parent)
    args = (
        ["synth", "--layers", "1", "--out", project]
        if command == "synth"
        else ["profile", "builtin:tiny", "--out", project]
    )
    line = _error_line(capsys, *args)
    assert "not a teraio profile" in line and "--force" in line
    assert _tree(project.parent) == before


@pytest.mark.parametrize("command", ["synth", "profile"])
@pytest.mark.parametrize(("name", "text"), [("meta.json", '{"lr": 0.1}\n'), ("index.json", '{"pages": 3}\n')])
def test_profile_outputs_refuse_a_lone_teraio_named_file(capsys, tmp_path, command, name, text):
    """A directory holding only a user's meta.json (or index.json) was replaced without --force."""
    d = tmp_path / "settings"
    d.mkdir()
    (d / name).write_text(text)
    before = _tree(tmp_path)
    args = ["synth", "--layers", "1"] if command == "synth" else ["profile", "builtin:tiny"]
    line = _error_line(capsys, *args, "--out", d)
    assert "not a teraio profile" in line and str(d) in line and "--force" in line
    assert _tree(tmp_path) == before and (d / name).read_text() == text


def test_synth_force_moves_the_project_aside_never_deletes_it(capsys, project):
    code, _, err = _run(capsys, "synth", "--layers", "1", "--out", project, "--force")
    assert code == 0, err
    assert Profile.load(project).num_fwd_ops > 0
    (kept,) = [p for p in project.parent.iterdir() if p.name.startswith("project.replaced-")]
    assert (kept / "src" / "train.py").read_text() == "print('train')\n"
    # Re-running into a profile replaces it without --force, leaving nothing else behind.
    assert _run(capsys, "synth", "--layers", "2", "--out", project)[0] == 0
    assert sorted(p.name for p in project.parent.iterdir()) == sorted(["project", kept.name])


def test_synth_out_that_is_a_file(capsys, tmp_path):
    (tmp_path / "f").write_text("x")
    assert "not a directory" in _error_line(capsys, "synth", "--out", tmp_path / "f")
    assert (tmp_path / "f").read_text() == "x"


# ------------------------------------------------------------------------------------ output files
def test_plan_out_existing_file_needs_force(capsys, files):
    tmp, prof, hw = files
    other = tmp / "notes.json"
    other.write_text("my notes")
    line = _error_line(capsys, "plan", prof, "--budget", "300MB", "--solver", "greedy", "-o", other)
    assert "exists; pass --force" in line and other.read_text() == "my notes"
    code, _, err = _run(
        capsys, "plan", prof, "--budget", "300MB", "--solver", "greedy", "-o", other, "--force"
    )
    assert code == 0, err
    assert json.loads(other.read_text())["schema_version"] == PLAN_SCHEMA_VERSION


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["plan", "{prof}", "--budget", "50%", "-o", ""], "empty path"),
        (["plan", "{prof}", "--budget", "50%", "-o", "{tmp}"], "is a directory"),
        (["plan", "{prof}", "--budget", "50%", "-o", "{tmp}/no/such/p.json"], "does not exist"),
        (["simulate", "{prof}", "{tmp}/p.json", "--timeline", "{tmp}"], "is a directory"),
        (["simulate", "{prof}", "{tmp}/p.json", "--timeline", ""], "empty path"),
        (["sweep", "{prof}", "--budgets", "50%", "--out", "{tmp}/no/x.csv"], "does not exist"),
        (["sweep", "{prof}", "--budgets", "50%", "--out", "{hw}"], "exists; pass --force"),
        (["synth", "--out", ""], "empty path"),
        (["calibrate", "{tmp}", "--out", ""], "empty path"),
        (["calibrate", "{tmp}", "--out", "{hw}"], "exists; pass --force"),
        (["demo", "--out", ""], "empty path"),
        (["demo", "--out", "{tmp}/no/such/r.json"], "does not exist"),
        (["demo", "--run-dir", "{hw}"], "not a directory"),
        (["profile", "--out", ""], "empty path"),
    ],
)
def test_bad_outputs_fail_in_one_line_before_any_work(capsys, files, monkeypatch, argv, fragment):
    tmp, prof, hw = files
    assert _run(capsys, "plan", prof, "--budget", "300MB", "--solver", "greedy", "-o", tmp / "p.json")[0] == 0

    def no_work(*a, **k):
        raise AssertionError("the long work started before the output was checked")

    import teraio.planner.simulate
    import teraio.profiling.disk_calibration
    import teraio.tools.demo
    import teraio.tools.profile_workload

    for mod, name in (
        (teraio.tools.demo, "run_demo"),
        (teraio.profiling.disk_calibration, "calibrate"),
        (teraio.planner.simulate, "simulate"),
        (teraio.tools.profile_workload, "profile_workload"),
    ):
        monkeypatch.setattr(mod, name, no_work)
    before = _tree(tmp)
    line = _error_line(capsys, *[a.format(tmp=tmp, prof=prof, hw=hw) for a in argv])
    assert fragment in line
    assert _tree(tmp) == before


def test_os_error_on_an_output_is_one_line(capsys, files):
    """A filesystem that refuses the write (here /proc) is reported in one line, exit 2."""
    tmp, prof, hw = files
    assert _run(capsys, "plan", prof, "--budget", "300MB", "--solver", "greedy", "-o", tmp / "p.json")[0] == 0
    line = _error_line(capsys, "simulate", prof, tmp / "p.json", "--timeline", "/proc/version", "--force")
    assert "/proc" in line


def test_simulate_exits_1_on_violations(capsys, files):
    tmp, prof, hw = files
    assert _run(capsys, "plan", prof, "--budget", "200MB", "--solver", "greedy", "-o", tmp / "p.json")[0] == 0
    code, out, _ = _run(capsys, "simulate", prof, tmp / "p.json", "--budget", "100MB")
    assert code == 1 and "violation:" in out and "exceeds the budget" in out
    code, out, _ = _run(capsys, "simulate", prof, tmp / "p.json", "--budget", "100MB", "--json")
    assert code == 1 and json.loads(out)["violations"]
    assert _run(capsys, "simulate", prof, tmp / "p.json")[0] == 0


def test_argument_errors_are_one_line(capsys, files):
    tmp, prof, hw = files
    assert "invalid choice" in _error_line(capsys, "nonsense")
    assert "required" in _error_line(capsys, "plan", prof)
    assert "invalid int value" in _error_line(
        capsys, "plan", prof, "--budget", "1", "--workers", "x", "-o", "p"
    )


# ------------------------------------------------------------------------------------------ calibrate
def test_calibrate_never_follows_a_planted_link(capsys, tmp_path):
    """calibrate wrote '.teraio-calibrate-<pid>' with O_TRUNC and no O_NOFOLLOW in the user's directory.
    It now measures in an offload subdirectory of the runtime's (random name, created O_EXCL, 0700), so
    the directory must also be one teraio would offload to: a shared one needs the sticky bit (like /tmp)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (shared / f".teraio-calibrate-{os.getpid()}").symlink_to(victim)
    code, _, err = _run(
        capsys, "calibrate", shared, "--size", "1MiB", "--block", "512KiB", "--repeats", "1", "--raw-only",
        "-o", tmp_path / "hw.json",
    )  # fmt: skip
    assert code == 0, err
    assert victim.read_text() == "precious"
    assert sorted(p.name for p in shared.iterdir()) == [f".teraio-calibrate-{os.getpid()}"]
    assert HardwareModel.load(tmp_path / "hw.json").tier("ssd").write_bw_bytes_per_s > 0
    shared.chmod(0o777)  # anyone may rename what teraio creates there: refused, in one line
    line = _error_line(capsys, "calibrate", shared, "--size", "1MiB", "--block", "512KiB", "--raw-only")
    assert str(shared) in line and "sticky bit" in line
    assert sorted(p.name for p in shared.iterdir()) == [f".teraio-calibrate-{os.getpid()}"]


def _start_calibration(directory: Path) -> subprocess.Popen:
    """``teraio calibrate`` measuring long enough to be killed mid-measurement (raw I/O in a loop)."""
    return subprocess.Popen(
        [sys.executable, "-m", "teraio", "calibrate", str(directory), "--size", "64MiB", "--block", "1MiB",
         "--repeats", "1000", "--raw-only"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _wait_for_data(directory: Path, proc: subprocess.Popen) -> Path:
    """The calibration's data file, once it holds bytes (the measurement is under way)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        for data in directory.glob("*/*"):  # wherever the calibration keeps its data
            with contextlib.suppress(OSError):
                if data.is_file() and data.stat().st_size > 0:
                    return data
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("the calibration never started writing")


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_calibration_killed_by_sigterm_leaves_nothing(tmp_path):
    """SIGTERM of `teraio calibrate` left .teraio-calibrate-*/data (8-24 MiB) that nothing removed."""
    disk = tmp_path / "disk"
    disk.mkdir()
    proc = _start_calibration(disk)
    _wait_for_data(disk, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM, err[-2000:]  # still dies of the signal
    assert _leftovers(disk) == []


def test_calibration_killed_by_sigkill_is_cleaned_by_the_next_one(capsys, tmp_path):
    """SIGKILL cannot be handled: the next calibration in the directory removes what it left."""
    disk = tmp_path / "disk"
    disk.mkdir()
    proc = _start_calibration(disk)
    data = _wait_for_data(disk, proc)
    proc.kill()
    proc.communicate(timeout=60)
    assert data.exists()  # nothing could clean up
    code, _, err = _run(
        capsys, "calibrate", disk, "--size", "1MiB", "--block", "512KiB", "--repeats", "1", "--raw-only"
    )
    assert code == 0, err
    assert _leftovers(disk) == []


# ------------------------------------------------------------------------- special files at outputs
def _special_files(tmp_path: Path) -> dict[str, Path]:
    """A FIFO, a socket and (as root) a character device with /dev/null's numbers, all in ``tmp_path``:
    the real /dev/null is never touched."""
    import socket

    made = {}
    made["fifo"] = tmp_path / "fifo"
    os.mkfifo(made["fifo"])
    made["socket"] = tmp_path / "sock"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(made["socket"]))
    sock.close()
    with contextlib.suppress(PermissionError, OSError):
        os.mknod(tmp_path / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        made["chardev"] = tmp_path / "null"
    return made


def _kind(path: Path) -> tuple[int, int]:
    st = os.lstat(path)
    return stat.S_IFMT(st.st_mode), st.st_rdev


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "{prof}", "--budget", "300MB", "--solver", "greedy", "-o", "{out}", "--force"],
        ["simulate", "{prof}", "{plan}", "--timeline", "{out}", "--force"],
        ["sweep", "{prof}", "--budgets", "50%", "--out", "{out}", "--force"],
        ["calibrate", "{tmp}/disk", "--size", "8KiB", "--block", "4KiB", "--out", "{out}", "--force"],
        ["demo", "--model", "tiny", "--out", "{out}", "--force"],
    ],
    ids=["plan", "simulate", "sweep", "calibrate", "demo"],
)
def test_force_replaces_only_regular_files(capsys, files, monkeypatch, argv):
    """`plan -o <chardev> --force` replaced a device node with a regular file (as root, -o /dev/null
    --force would have replaced /dev/null); a FIFO or socket went the same way."""
    tmp, prof, hw = files
    (tmp / "disk").mkdir()
    assert _run(capsys, "plan", prof, "--budget", "300MB", "--solver", "greedy", "-o", tmp / "p.json")[0] == 0
    import teraio.profiling.disk_calibration
    import teraio.tools.demo

    def no_work(*a, **k):
        raise AssertionError("the long work started before the output was checked")

    monkeypatch.setattr(teraio.profiling.disk_calibration, "calibrate", no_work)
    monkeypatch.setattr(teraio.tools.demo, "run_demo", no_work)
    specials = _special_files(tmp)
    for name, special in specials.items():
        before = _kind(special)
        args = [a.format(tmp=tmp, prof=prof, plan=tmp / "p.json", out=special) for a in argv]
        line = _error_line(capsys, *args)
        assert "not a regular file" in line and str(special) in line, (name, line)
        assert _kind(special) == before, f"the {name} was replaced"


def test_the_library_writer_refuses_special_files_too(tmp_path):
    """The check also runs at the rename, for library callers and for a file swapped in meanwhile."""
    from teraio.planner.safe_io import OutputError, write_json

    for name, special in _special_files(tmp_path).items():
        before = _kind(special)
        with pytest.raises(OutputError, match="not a regular file"):
            write_json(special, {"a": 1}, overwrite=True)
        assert _kind(special) == before, name
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".teraio-tmp")) == []


# ------------------------------------------------------------------------- directories written first
@pytest.fixture
def read_only_dir(tmp_path):
    """A directory nobody can write: a read-only tmpfs as root (root passes permission checks), else a
    directory without write permission."""
    d = tmp_path / "ro"
    d.mkdir()
    if os.geteuid() != 0:
        d.chmod(0o500)
        yield d
        d.chmod(0o700)
        return
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(d)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--model", "tiny", "--offload-dir", "{ro}"],
        ["demo", "--model", "tiny", "--offload-dir", "{tmp}/disk", "--run-dir", "{ro}/run"],
        ["calibrate", "{ro}", "--size", "8KiB", "--block", "4KiB"],
        ["profile", "builtin:tiny", "--out", "{ro}/prof"],
    ],
    ids=["demo-offload-dir", "demo-run-dir", "calibrate", "profile"],
)
def test_every_directory_an_option_names_is_written_before_the_work(
    capsys, tmp_path, read_only_dir, monkeypatch, argv
):
    """`demo --offload-dir` on a read-only filesystem failed after 32 s of profiling, not before."""
    import teraio.profiling.disk_calibration
    import teraio.tools.demo
    import teraio.tools.profile_workload

    def no_work(*a, **k):
        raise AssertionError("the long work started before the directories were written")

    monkeypatch.setattr(teraio.tools.demo, "run_demo", no_work)
    monkeypatch.setattr(teraio.profiling.disk_calibration, "calibrate", no_work)
    monkeypatch.setattr(teraio.tools.profile_workload, "profile_workload", no_work)
    (tmp_path / "disk").mkdir()
    line = _error_line(capsys, *[a.format(ro=read_only_dir, tmp=tmp_path) for a in argv])
    assert str(read_only_dir) in line and ("cannot be written" in line or "not writable" in line), line
    assert os.listdir(read_only_dir) == []


def test_the_writability_check_leaves_nothing_behind(tmp_path):
    from teraio.platform.preflight import check_writable_dir

    check_writable_dir(tmp_path, option="--offload-dir")
    check_writable_dir(tmp_path / "new" / "deeper", option="--offload-dir")  # tested where it will be made
    assert os.listdir(tmp_path) == []
