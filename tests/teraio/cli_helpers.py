"""Helpers shared by the CLI tests: run ``teraio.cli.main`` in-process and snapshot directory trees."""

from __future__ import annotations

import os
from pathlib import Path

from teraio.cli import main


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """Run the CLI in-process; return (exit code, stdout, stderr)."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def error_line(capsys, *argv) -> str:
    """Run a command that must fail as a user error: exit 2, exactly one line on stderr, no traceback."""
    code, out, err = run_cli(capsys, *argv)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` with its size and mtime: compared before and after a command."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out
