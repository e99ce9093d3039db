"""Typed errors of the offload runtime.

Callers (the injected graph ops, the CLI) must tell "the disk is full" from "the disk is broken" from
"you asked for something wrong" without parsing messages, and every message must name what went wrong
and what to do. All errors derive from :class:`RuntimeIOError`.
"""

from __future__ import annotations

import errno as errno_mod


class RuntimeIOError(RuntimeError):
    """Base class of every error raised by the runtime.

    Attributes:
        errno: the operating-system error number behind the failure, if any.
        path: the file or directory involved, if any.
    """

    def __init__(self, message: str, *, errno: int | None = None, path: str | None = None) -> None:
        super().__init__(message)
        self.errno = errno
        self.path = path


class ConfigError(RuntimeIOError, ValueError):
    """A runtime option or a request argument is invalid."""


class UnknownKeyError(RuntimeIOError, KeyError):
    """A request names a key that was never offloaded (or was dropped)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class UnsupportedTensorError(RuntimeIOError, TypeError):
    """The tensor cannot be offloaded (sparse, quantized, meta, or on an unsupported device)."""


class EngineClosedError(RuntimeIOError):
    """A request reached an engine after close()."""


class OutOfSpaceError(RuntimeIOError):
    """A directory cannot hold the bytes a request (or the start-up reservation) needs.

    Attributes:
        directory: the offload directory that ran out of space.
        needed_nbytes: bytes the failing allocation asked for.
        available_nbytes: free bytes the filesystem reported at the time, if known.
    """

    def __init__(
        self, message: str, *, directory: str, needed_nbytes: int, available_nbytes: int | None = None
    ) -> None:
        super().__init__(message, errno=errno_mod.ENOSPC, path=directory)
        self.directory = directory
        self.needed_nbytes = needed_nbytes
        self.available_nbytes = available_nbytes


class TierCapacityError(RuntimeIOError):
    """The host-memory tier is full (its ``host_capacity_bytes`` limit would be exceeded)."""

    def __init__(self, message: str, *, needed_nbytes: int, capacity_nbytes: int, held_nbytes: int) -> None:
        super().__init__(message)
        self.needed_nbytes = needed_nbytes
        self.capacity_nbytes = capacity_nbytes
        self.held_nbytes = held_nbytes


class DiskIOError(RuntimeIOError):
    """The device reported an I/O error (EIO) reading or writing an offload file."""


class OffloadPermissionError(RuntimeIOError, PermissionError):
    """The runtime may not create or use an offload directory or file (EACCES, EPERM, EROFS)."""


class UnsafePathError(RuntimeIOError):
    """An offload path is not what the runtime created (a symlink, foreign owner, wrong mode)."""


class ChecksumError(RuntimeIOError):
    """Bytes read back differ from the bytes written (checksum mismatch).

    Attributes:
        key: the request key whose data is corrupt.
        file_offset: byte offset in ``path`` of the chunk that failed.
    """

    def __init__(self, message: str, *, key: str, path: str, file_offset: int) -> None:
        super().__init__(message, errno=errno_mod.EIO, path=path)
        self.key = key
        self.file_offset = file_offset


_PERMISSION_ERRNOS = {errno_mod.EACCES, errno_mod.EPERM, errno_mod.EROFS}
_SPACE_ERRNOS = {errno_mod.ENOSPC, errno_mod.EDQUOT, errno_mod.EFBIG}


def map_os_error(
    exc: OSError,
    *,
    action: str,
    path: str,
    directory: str,
    needed_nbytes: int,
    available_nbytes: int | None = None,
    file_offset: int | None = None,
) -> RuntimeIOError:
    """Turn an OSError from a syscall into the runtime's typed error with a one-line message.

    Args:
        exc: the error raised by the syscall.
        action: what the runtime was doing ("write", "read", "preallocate", "create").
        path: the file involved.
        directory: the offload directory the file lives in.
        needed_nbytes: bytes the failing request needed.
        available_nbytes: free bytes in ``directory`` if known.
        file_offset: offset of the failing chunk, for reads and writes.
    """
    code = exc.errno
    where = f"{path}" + (f" at offset {file_offset}" if file_offset is not None else "")
    reason = exc.strerror or str(exc)
    if code in _SPACE_ERRNOS:
        avail = f", {available_nbytes} bytes free" if available_nbytes is not None else ""
        return OutOfSpaceError(
            f"offload directory {directory} is out of space: {action} of {needed_nbytes} bytes failed "
            f"({reason}{avail}); free space there, add another directory, or lower the offload budget",
            directory=directory,
            needed_nbytes=needed_nbytes,
            available_nbytes=available_nbytes,
        )
    if code in _PERMISSION_ERRNOS:
        return OffloadPermissionError(
            f"no permission to {action} {where} in offload directory {directory} ({reason}); "
            f"choose a writable directory you own",
            errno=code,
            path=path,
        )
    if code == errno_mod.EIO:
        return DiskIOError(
            f"I/O error during {action} of {needed_nbytes} bytes to {where} in {directory} ({reason}); "
            f"the device may be failing: check dmesg and use another directory",
            errno=code,
            path=path,
        )
    return RuntimeIOError(
        f"{action} of {needed_nbytes} bytes at {where} in {directory} failed: {reason}",
        errno=code,
        path=path,
    )
