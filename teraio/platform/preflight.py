"""Checks before long work: every directory an option names is tested for writing before profiling.

``teraio demo`` profiles and calibrates for half a minute before its first offload file is written, and a
backend profiles for several steps: a read-only offload directory (a read-only mount, a full disk, a directory
of another user) found only then costs the whole run. So the CLI commands (and the backend, for its
``offload_dirs`` and ``run_dir``) call :func:`check_writable_dir` first, for every directory an option names,
and fail in one line before any work.

The test writes for real: ``os.access`` is not enough, since root passes every permission check and
nothing but a write finds a full disk. It creates an unnamed file in the directory (``O_TMPFILE``: it
never has a name, so nothing is left behind even if the process dies) and writes one page to it;
where the filesystem has no ``O_TMPFILE``, it creates and removes a private directory with a random
hidden name instead.

Pure Python (no torch).
"""

from __future__ import annotations

import errno
import os
import secrets
from pathlib import Path

from teraio.errors import UserInputError

_PAGE = b"\0" * 4096
#: errno values by which a filesystem says it has no O_TMPFILE (the kernel's, or the filesystem's).
_NO_TMPFILE = {errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT}


def check_writable_dir(path: str | os.PathLike, *, option: str, create: bool = True) -> Path:
    """Test now, before long work, that teraio can create and write files in the directory ``path``.

    Args:
        path: the directory an option names.
        option: how the error names it ("--offload-dir", "offload_dirs", "run_dir").
        create: a missing ``path`` is fine (teraio creates it): its nearest existing ancestor is tested,
            since that is where it will be created. Otherwise it must exist.

    Returns:
        The absolute path of ``path``.

    Raises:
        UserInputError: one line naming the option, the directory and why it cannot be written.
    """
    if os.fspath(path) == "":
        raise UserInputError(f"{option} is an empty path; give a directory")
    p = Path(os.path.abspath(os.fspath(path)))
    probe = p
    while not os.path.lexists(probe) and probe.parent != probe:
        if not create:
            raise UserInputError(f"{option} '{p}' is not a directory (it does not exist); create it first")
        probe = probe.parent
    if not probe.is_dir():
        where = "" if probe == p else f": '{probe}'"
        raise UserInputError(f"{option} '{p}'{where} is not a directory")
    try:
        _write_probe(probe)
    except OSError as exc:
        where = "" if probe == p else f" (it would be created in '{probe}')"
        reason = "the filesystem is full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else exc.strerror
        raise UserInputError(
            f"{option} '{p}' cannot be written{where}: {reason}; choose another directory"
        ) from None
    return p


def _write_probe(directory: Path) -> None:
    """Create an unnamed file in ``directory`` and write a page to it (or, without O_TMPFILE, create and
    remove a private subdirectory). Raises the OSError of the first step that fails."""
    tmpfile = getattr(os, "O_TMPFILE", 0)
    if tmpfile:
        try:
            fd = os.open(directory, tmpfile | os.O_WRONLY | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            if exc.errno not in _NO_TMPFILE:
                raise
        else:
            try:
                os.write(fd, _PAGE)
                os.fsync(fd)  # a full disk shows at the latest here
            finally:
                os.close(fd)
            return
    name = directory / f".teraio-probe-{secrets.token_hex(6)}"
    os.mkdir(name, 0o700)
    os.rmdir(name)


__all__ = ["check_writable_dir"]
