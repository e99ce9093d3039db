"""The one way teraio writes files (never through a planted link, never half a file, never over what
it did not write) and reads its input files (only regular ones, only up to a limit).

Every file teraio writes (profiles, plans, hardware models, run-directory files, CLI outputs) goes
through this module. The file writers live here; the rest is split by what it guards, and every public
name is importable from here:

- :func:`atomic_writer` / :func:`write_bytes` / :func:`write_text` / :func:`write_json`: the bytes go to
  a fresh temporary file in the target's directory (``O_CREAT|O_EXCL|O_NOFOLLOW``, a random name, so a
  symlink or file planted at a predictable name is never followed or reused), are fsynced, and are
  renamed over the target in one step: a reader sees the old file or the new one, never a mix, and a
  crash leaves at most a hidden temporary file. An existing target is replaced only with
  ``overwrite=True`` (the CLI's ``--force``), and only when it is a regular file: a device node, FIFO or
  socket there is refused even then; the rename replaces a symlink at the target itself, never the file
  it points to.
- :func:`append_line`: append-only logs (``stats.jsonl``) open with ``O_APPEND|O_NOFOLLOW``.
- :func:`check_output_file` (:mod:`planner.safe_paths`): the CLI checks its output files before long
  work, with the same rules as the writers.
- :func:`replace_dir` / :func:`check_output_dir` (:mod:`planner.safe_dirs`): output directories
  (profiles) are built in a fresh sibling directory and renamed into place. An existing directory is
  replaced only when it is empty or a complete teraio artefact of the same kind (every file of its
  layout and nothing else, its meta.json / index.json carrying teraio's own keys: :func:`artifact_kind`,
  :mod:`planner.artifacts`); anything else needs ``force`` and is then moved aside (never deleted), so
  teraio never removes a file it did not write.
- :class:`PrivateDir` (:mod:`planner.private_dir`): a directory held by a descriptor (a run directory),
  everything in it opened relative to it with ``O_NOFOLLOW``.
- :func:`read_input` / :func:`load_json` (:mod:`planner.safe_read`): inputs are read only when they are
  regular files (never a FIFO, a device or a socket, also behind a link), and only up to a size limit
  (``planner.limits``).

Errors are :class:`OutputError` (a ``ValueError`` with a one-line message naming the path and what to
do); OSErrors from the filesystem keep their type (the CLI reports both in one line).

This module and its parts are pure Python (no torch, no runtime): the planner writes its formats with
them and teraio imports them. The runtime keeps its own private-directory code (``runtime.space``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from teraio.planner.artifacts import (
    ARTIFACT_LAYOUTS,
    ESTIMATE_META_KEY,
    PROFILE_META_KEYS,
    artifact_kind,
    is_profile_at,
    read_json_object,
)
from teraio.planner.private_dir import PrivateDir, UnsafeDirError
from teraio.planner.safe_dirs import check_output_dir, replace_dir
from teraio.planner.safe_paths import (
    _APPEND_FLAGS,
    _FILE_MODE,
    OutputError,
    _append_and_close,
    _fsync_dir,
    _refuse_special,
    _tmp_name,
    check_output_file,
)
from teraio.planner.safe_read import InputError, load_json, read_input


@contextlib.contextmanager
def atomic_writer(
    path: str | os.PathLike, *, overwrite: bool = False, binary: bool = False, mode: int = _FILE_MODE
) -> Iterator[IO[Any]]:
    """Open a fresh temporary file next to ``path``; on success fsync it and rename it over ``path``.

    The temporary file is created with ``O_CREAT|O_EXCL|O_NOFOLLOW`` under a random name, so nothing
    planted in the directory is followed or reused. If the body raises, the temporary file is removed
    and ``path`` is untouched.

    Args:
        path: the file to write.
        overwrite: replace an existing ``path`` (a symlink there is replaced itself, not followed).
        binary: yield a binary file object instead of a text one (UTF-8).
        mode: permission bits of the new file (before umask).

    Raises:
        OutputError: ``path`` exists and ``overwrite`` is False, or it is a directory.
        OSError: the filesystem refused (permission, space, missing directory).
    """
    target = check_output_file(path, overwrite=overwrite)
    parent = target.parent
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(16):
        tmp = parent / _tmp_name(target.name)
        try:
            fd = os.open(tmp, flags, mode)
            break
        except FileExistsError:
            continue
    else:  # pragma: no cover - 16 collisions of 48 random bits
        raise OutputError(f"could not create a temporary file in '{parent}'")
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        if not overwrite:
            # link() fails if the name appeared meanwhile: never replace a file created since the check.
            try:
                os.link(tmp, target)
            except FileExistsError:
                raise OutputError(
                    f"'{target}' appeared while it was being written; pass --force to replace it"
                ) from None
            except OSError as exc:
                if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                    raise
                # A filesystem without hard links: rename, after checking once more.
                if os.path.lexists(target):
                    raise OutputError(
                        f"'{target}' appeared while it was being written; pass --force to replace it"
                    ) from None
                os.rename(tmp, target)
            else:
                os.unlink(tmp)
        else:
            with contextlib.suppress(FileNotFoundError):  # looked at again: it may have changed since
                _refuse_special(target, os.lstat(target).st_mode)
            os.replace(tmp, target)
        _fsync_dir(parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_bytes(path: str | os.PathLike, data: bytes, *, overwrite: bool = False) -> Path:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_writer`); return the path."""
    with atomic_writer(path, overwrite=overwrite, binary=True) as f:
        f.write(data)
    return Path(path)


def write_text(path: str | os.PathLike, text: str, *, overwrite: bool = False) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically (see :func:`atomic_writer`); return the path."""
    with atomic_writer(path, overwrite=overwrite) as f:
        f.write(text)
    return Path(path)


def write_json(path: str | os.PathLike, obj: Any, *, overwrite: bool = False, indent: int | None = 2) -> Path:
    """Serialise ``obj`` as JSON (``default=str``) and write it atomically; return the path.

    The JSON is built before the file is created, so an unserialisable object writes nothing.
    """
    return write_text(path, json.dumps(obj, indent=indent, default=str), overwrite=overwrite)


def append_line(path: str | os.PathLike, line: str) -> None:
    """Append one line to a log file (``O_APPEND|O_NOFOLLOW``: a symlink planted there is refused)."""
    fd = os.open(path, _APPEND_FLAGS, _FILE_MODE)
    _append_and_close(fd, line, path)


__all__ = [
    "ARTIFACT_LAYOUTS",
    "ESTIMATE_META_KEY",
    "InputError",
    "OutputError",
    "PROFILE_META_KEYS",
    "PrivateDir",
    "UnsafeDirError",
    "append_line",
    "artifact_kind",
    "atomic_writer",
    "check_output_dir",
    "check_output_file",
    "is_profile_at",
    "load_json",
    "read_input",
    "read_json_object",
    "replace_dir",
    "write_bytes",
    "write_json",
    "write_text",
]
