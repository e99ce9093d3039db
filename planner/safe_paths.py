"""What teraio may write over at a path, and the low-level pieces every one of its safe writes shares.

An output replaces only a regular file (a symbolic link there is replaced itself, never followed; a
device node, FIFO or socket is refused even with ``--force``), its directory must exist and be
writable, and the check runs before long work (:func:`check_output_file`). The writers of
:mod:`planner.safe_io` and :class:`planner.private_dir.PrivateDir` share the rest: temporary names no
one can predict, fsync of the directory after a rename, and appends that refuse anything but a regular
file. Errors are :class:`OutputError`: one line naming the path and what to do.

Standard library only, so every part of the safe I/O code can import it.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

_TMP_PREFIX = ".teraio-tmp-"
_FILE_MODE = 0o644


class OutputError(ValueError):
    """An output cannot be written safely: it exists (and overwriting was not asked for), it is not what
    teraio would replace, or its directory is missing. The message names the path and what to do."""


def _tmp_name(target_name: str) -> str:
    return f"{_TMP_PREFIX}{target_name[:40]}.{secrets.token_hex(6)}"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories: the rename is still atomic
        pass
    finally:
        os.close(fd)


def check_output_file(path: str | os.PathLike, *, overwrite: bool = False, option: str = "output") -> Path:
    """Check now, before long work, that ``path`` can be written by :func:`atomic_writer`.

    Raises:
        OutputError: the path is empty, a directory, exists without ``overwrite``, or its directory
            is missing or not writable.
    """
    if os.fspath(path) == "":
        raise OutputError(f"{option} is an empty path; give a file name")
    p = Path(path)
    if p.name in ("", ".", ".."):
        raise OutputError(f"{option} '{p}' names a directory, not a file")
    parent = p.parent
    if not parent.is_dir():
        raise OutputError(f"{option} '{p}': directory '{parent}' does not exist; create it first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{option} '{p}': no write permission in directory '{parent}'")
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return p
    if stat.S_ISDIR(st.st_mode):
        raise OutputError(f"{option} '{p}' is a directory; give a file name")
    _refuse_special(p, st.st_mode, option)
    if not overwrite:
        raise OutputError(f"{option} '{p}' exists; pass --force to replace it, or choose another name")
    return p


def _special_kind(mode: int) -> str | None:
    """What a file that is neither a regular file, a symbolic link nor a directory is, in words."""
    for test, name in (
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISFIFO, "FIFO (named pipe)"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISDIR, "directory"),
    ):
        if test(mode):
            return name
    return None if stat.S_ISREG(mode) or stat.S_ISLNK(mode) else "special file"


def _refuse_special(path: str | os.PathLike, mode: int, option: str = "output") -> None:
    """Outputs replace only regular files (a symbolic link is replaced itself, never followed): a device
    node, FIFO or socket at the output path is refused even with --force (as root, ``-o /dev/null
    --force`` would replace /dev/null)."""
    kind = _special_kind(mode)
    if kind is not None:
        raise OutputError(
            f"{option} '{path}' is a {kind}, not a regular file; teraio replaces only regular files, "
            f"even with --force: choose another name"
        )


_APPEND_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


def _append_and_close(fd: int, line: str, shown: str | os.PathLike) -> None:
    """Write ``line`` (newline-terminated) to a log opened with ``_APPEND_FLAGS``, refusing anything but
    a regular file (``shown`` names it in the error); the descriptor is closed in every case."""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OutputError(f"'{shown}' is not a regular file; refusing to append to it")
        data = (line.rstrip("\n") + "\n").encode()
        while data:
            data = data[os.write(fd, data) :]
    finally:
        os.close(fd)


#: How every directory teraio holds by descriptor is opened.
_DIR_OPEN = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
