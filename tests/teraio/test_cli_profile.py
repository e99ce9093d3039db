"""``teraio profile``: writes a loadable profile, a stable fingerprint, and clean errors on bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from teraio.cli import main
from teraio.planner.profile import Profile

REPO = Path(__file__).resolve().parents[2]


def _teraio(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "teraio", *args], capture_output=True, text=True, cwd=cwd or REPO, timeout=300
    )


def test_profile_builtin_tiny_json_and_fingerprint_stable_across_processes(tmp_path: Path, capsys) -> None:
    out_a = tmp_path / "a"
    assert (
        main(["profile", "builtin:tiny", "--out", str(out_a), "--inner", "eager", "--steps", "2", "--json"])
        == 0
    )
    summary = json.loads(capsys.readouterr().out)
    (g,) = summary["graphs"]
    prof = Profile.load(out_a)
    assert g["fingerprint"] == prof.fingerprint
    assert g["activation_bytes"] == prof.activation_bytes() > 0
    assert {"idx", "name", "target", "phase", "duration_us"} <= set(prof.ops.columns)
    assert {
        "name",
        "nbytes",
        "dtype",
        "shape",
        "kind",
        "producer_idx",
        "last_fwd_use_idx",
        "first_bwd_use_idx",
        "last_use_idx",
    } <= set(prof.tensors.columns)
    for key in ("schema_version", "fingerprint", "torch_version", "device", "step_s"):
        assert key in prof.meta
    # A second process, same model and batch shape: same fingerprint.
    out_b = tmp_path / "b"
    r = _teraio("profile", "builtin:tiny", "--out", str(out_b), "--inner", "eager", "--steps", "2", "--json")
    assert r.returncode == 0, r.stderr
    assert Profile.load(out_b).fingerprint == prof.fingerprint


def _user_file(tmp_path: Path, body: str) -> Path:
    f = tmp_path / "target.py"
    f.write_text(body)
    return f


RETURNS_INT = "def fn():\n    return 3\n"
RETURNS_NON_MODULE = "import torch\ndef fn():\n    return 1, torch.ones(2)\n"

BAD_TARGETS = {
    "missing file": (lambda tmp: f"{tmp}/nope.py:fn", "does not exist"),
    "no such function": (lambda tmp: f"{_user_file(tmp, 'x = 1')}:fn", "has no function 'fn'"),
    "wrong return": (lambda tmp: f"{_user_file(tmp, RETURNS_INT)}:fn", "must return (model, batch)"),
    "not a module": (lambda tmp: f"{_user_file(tmp, RETURNS_NON_MODULE)}:fn", "expected a torch.nn.Module"),
    "bad builtin": (lambda tmp: "builtin:huge", "unknown built-in workload"),
}


@pytest.mark.parametrize("case", list(BAD_TARGETS))
def test_profile_bad_targets_exit_2_with_one_line(tmp_path: Path, capsys, case: str) -> None:
    make_target, expected = BAD_TARGETS[case]
    out = tmp_path / "out"
    assert main(["profile", make_target(tmp_path), "--out", str(out), "--inner", "eager"]) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and len(err.splitlines()) == 1, err
    assert not out.exists()


def test_profile_non_scalar_loss_is_a_clear_error(tmp_path: Path, capsys) -> None:
    target = _user_file(
        tmp_path, "import torch\ndef fn():\n    return torch.nn.Linear(4, 3), torch.ones(2, 4)\n"
    )
    out = tmp_path / "out"
    assert main(["profile", f"{target}:fn", "--out", str(out), "--inner", "eager"]) == 2
    err = capsys.readouterr().err
    assert "loss must be a scalar" in err and "loss_fn" in err
    assert not out.exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_profile_unwritable_out_nonroot(tmp_path: Path, capsys) -> None:
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    assert main(["profile", "builtin:tiny", "--out", str(ro / "p"), "--inner", "eager"]) == 2
    assert "not writable" in capsys.readouterr().err


def test_profile_unwritable_out_subprocess_no_traceback(tmp_path: Path) -> None:
    # A path under a regular file cannot be created, even by root.
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = _teraio("profile", "builtin:tiny", "--out", str(blocker / "p"), "--inner", "eager")
    assert r.returncode == 2
    assert (
        "Traceback" not in r.stderr and "is a file" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    ), r.stderr
    assert blocker.read_text() == "x"


def test_help_lists_subcommands() -> None:
    r = _teraio("--help")
    assert r.returncode == 0 and "profile" in r.stdout
