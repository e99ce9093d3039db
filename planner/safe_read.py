"""Reading teraio's input files: only regular files, only up to a size limit, JSON without surprises.

An input path a user gives may name a FIFO (an open blocks), a device such as /dev/zero (a read never
ends), a socket or a huge file, also behind a link. :func:`read_input` refuses all of them before a byte
is read and reads with the limit (``planner.limits``); :func:`load_json` also refuses ``NaN`` and
infinities and turns too-deep nesting into an error. Errors are :class:`InputError`, one line naming the
file, which loaders re-raise as their own typed error.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any

from teraio.planner.limits import MAX_JSON_FILE_NBYTES
from teraio.planner.safe_paths import _special_kind


class InputError(ValueError):
    """An input file cannot be read safely: missing, not a regular file (a FIFO, a device such as
    /dev/zero, a socket, a directory), larger than teraio reads, or not the JSON it should be. One line
    naming the file; loaders re-raise it as their own typed error (PlanError, HardwareError, ProfileError)."""


def read_input(path: str | os.PathLike, *, limit_nbytes: int, what: str = "input") -> bytes:
    """The bytes of the regular file ``path`` (links followed), at most ``limit_nbytes`` of them.

    Opened with ``O_NONBLOCK``, so a FIFO never blocks the open, then checked with ``fstat`` on the
    descriptor that is read: anything but a regular file is refused before a byte is read (a link to
    /dev/zero would read without end, a FIFO would block forever). Read with the limit, so a file that
    grows meanwhile cannot exceed it either.

    Raises:
        InputError: naming ``what``, the path and what is wrong.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise InputError(f"{what} '{path}' does not exist") from None
    except OSError as exc:
        raise InputError(f"{what} '{path}' cannot be read: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise InputError(f"{what} '{path}' is a directory, expected a file")
        kind = _special_kind(st.st_mode)
        if kind is not None:
            raise InputError(f"{what} '{path}' is a {kind}, not a regular file; give a file")
        too_big = f"{what} '{path}' is larger than {limit_nbytes} bytes, the most teraio reads from one"
        if st.st_size > limit_nbytes:
            raise InputError(too_big)
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, min(1 << 20, limit_nbytes + 1 - total))
            if not chunk:
                return b"".join(chunks)
            total += len(chunk)
            if total > limit_nbytes:
                raise InputError(too_big)
            chunks.append(chunk)
    except OSError as exc:
        raise InputError(f"{what} '{path}' cannot be read: {exc.strerror}") from None
    finally:
        os.close(fd)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number teraio accepts")


def load_json(
    path: str | os.PathLike, *, what: str = "input", limit_nbytes: int = MAX_JSON_FILE_NBYTES
) -> Any:
    """The JSON document in the regular file ``path`` (see :func:`read_input`). ``NaN``, ``Infinity``
    and ``-Infinity`` are refused, and a document nested too deeply for the parser is an error, not a
    ``RecursionError`` traceback.

    Raises:
        InputError: naming ``what``, the path and what is wrong.
    """
    data = read_input(path, limit_nbytes=limit_nbytes, what=what)
    try:
        return json.loads(data, parse_constant=_no_constant)
    except RecursionError:
        raise InputError(f"{what} '{path}' is not valid JSON: it nests too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, a refused constant
        raise InputError(f"{what} '{path}' is not valid JSON: {exc}") from None
