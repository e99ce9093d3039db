"""A directory teraio writes into for a whole run, held by a descriptor and private to this user.

A run directory lives for the length of a training run, in a place the user chose, perhaps a shared
one. Opening each file in it by path would follow a link planted meanwhile (``graph0 -> a directory of
the victim``) or a rename of a parent; :class:`PrivateDir` opens everything relative to its descriptor
with ``O_NOFOLLOW``, uses a subdirectory only when it is a real directory private to this user, and
writes files as :mod:`planner.safe_io` does (a fresh temporary file, renamed into place). What is not
private raises :class:`UnsafeDirError`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import stat
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from teraio.planner.artifacts import _matches_layout_at, _matches_layout_at_name
from teraio.planner.safe_paths import (
    _APPEND_FLAGS,
    _DIR_OPEN,
    OutputError,
    _append_and_close,
    _refuse_special,
    _tmp_name,
)


class UnsafeDirError(OutputError):
    """A directory teraio writes into is not private to this user (another user's, writable by others),
    or a link or other file stands where one of teraio's directories belongs. One line naming it and
    what to do."""


_PRIVATE_FILE_MODE = 0o600
_PRIVATE_DIR_MODE = 0o700


def _trusted_uid(uid: int) -> bool:
    return uid in (os.geteuid(), 0)


def _check_private_dir(st: os.stat_result, what: str) -> None:
    """``st`` (of an open directory) is owned by this user (or root) and writable by nobody else."""
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirError(f"{what} is not a directory; choose an empty or new directory")
    if not _trusted_uid(st.st_uid):
        raise UnsafeDirError(
            f"{what} belongs to uid {st.st_uid}, not to you (uid {os.geteuid()}); use a directory of your own"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeDirError(
            f"{what} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}), who could plant links "
            f"in it; chmod go-w it, or give a new directory (teraio creates it 0700)"
        )


def _one_name(name: str) -> str:
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise ValueError(f"internal: {name!r} is not a single file name")
    return name


class PrivateDir:
    """A directory held open by a descriptor, private to this user: what teraio writes into it (a run
    directory) never goes anywhere else.

    Every file and subdirectory in it is opened relative to the descriptor with ``O_NOFOLLOW``, so a link
    planted in it (``graph0 -> a directory of the victim``), or a rename of it or of a parent, is never
    followed; a subdirectory is used only when it is a real directory private to this user. Files are
    created 0600 (``O_CREAT|O_EXCL``, a random temporary name, then renamed into place as
    :func:`atomic_writer` does), subdirectories 0700 whatever the umask. Errors: :class:`UnsafeDirError`
    for what is not private, ``OSError`` (with the name relative to this directory) from the filesystem.
    The descriptor is closed by :meth:`close` (or when the object is collected).
    """

    def __init__(self, fd: int, path: Path) -> None:
        self.fd = fd
        self.path = path
        self._closer = weakref.finalize(self, os.close, fd)  # os.close: no lock, safe in a finalizer

    # ------------------------------------------------------------------------------------ opening
    @classmethod
    def open(cls, path: str | os.PathLike, *, what: str = "directory") -> PrivateDir:
        """Open ``path`` as a private directory, creating it and its missing parents one level at a time,
        each 0700 whatever the umask (through the parent's descriptor, never by a path a link could
        redirect).

        An existing ``path`` may be a symbolic link if this user (or root) owns the link. What is opened
        must be owned by this user (or root) and writable by nobody else.

        Raises:
            UnsafeDirError: naming ``what``, the path and what to do.
            OSError: a component is not a directory, or the filesystem refused.
        """
        p = Path(os.path.abspath(os.fspath(path)))
        missing: list[str] = []
        top = p
        while not os.path.lexists(top) and top.parent != top:
            missing.append(top.name)
            top = top.parent
        if not missing:
            link = os.lstat(p)
            if stat.S_ISLNK(link.st_mode) and not _trusted_uid(link.st_uid):
                raise UnsafeDirError(
                    f"{what} '{p}' is a symbolic link owned by uid {link.st_uid}, not by you; give the real "
                    f"directory"
                )
        fd = os.open(p if not missing else top, _DIR_OPEN)
        try:
            for name in reversed(missing):
                try:
                    os.mkdir(name, _PRIVATE_DIR_MODE, dir_fd=fd)
                    created = True
                except FileExistsError:  # created meanwhile: checked like any other below
                    created = False
                child = os.open(name, _DIR_OPEN | os.O_NOFOLLOW, dir_fd=fd)
                os.close(fd)
                fd = child
                if created:
                    os.fchmod(fd, _PRIVATE_DIR_MODE)  # the umask may only take bits away; make it exact
            _check_private_dir(os.fstat(fd), f"{what} '{p}'")
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, p)

    def subdir(self, name: str, *, create: bool = True) -> tuple[PrivateDir, bool]:
        """The subdirectory ``name``, created 0700 if missing (and ``create``); (it, created now?).

        Raises:
            UnsafeDirError: ``name`` is a symbolic link, not a directory, or not private to this user.
        """
        _one_name(name)
        created = False
        if create:
            try:
                os.mkdir(name, _PRIVATE_DIR_MODE, dir_fd=self.fd)
                created = True
            except FileExistsError:
                pass
        try:
            fd = os.open(name, _DIR_OPEN | os.O_NOFOLLOW, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise UnsafeDirError(
                    f"'{self.path / name}' is a symbolic link or not a directory; teraio never follows a "
                    f"link there: remove it"
                ) from None
            raise
        try:
            if created:
                os.fchmod(fd, _PRIVATE_DIR_MODE)
            _check_private_dir(os.fstat(fd), f"'{self.path / name}'")
        except BaseException:
            os.close(fd)
            raise
        return PrivateDir(fd, self.path / name), created

    def close(self) -> None:
        self._closer()

    def __enter__(self) -> PrivateDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------ writing
    def open_new(self, name: str) -> IO[bytes]:
        """A new file ``name`` for writing (binary): ``O_CREAT|O_EXCL|O_NOFOLLOW``, mode 0600."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        return os.fdopen(os.open(_one_name(name), flags, _PRIVATE_FILE_MODE, dir_fd=self.fd), "wb")

    def write_bytes(self, name: str, data: bytes, *, overwrite: bool = True) -> None:
        """Write ``name`` atomically: a fresh temporary file, fsynced, renamed over ``name`` (a link there
        is replaced itself; a directory, device node, FIFO or socket is refused)."""
        _one_name(name)
        for _ in range(16):
            tmp = _tmp_name(name)
            try:
                f = self.open_new(tmp)
                break
            except FileExistsError:
                continue
        else:  # pragma: no cover - 16 collisions of 48 random bits
            raise OutputError(f"could not create a temporary file in '{self.path}'")
        try:
            with f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            try:
                st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            if st is not None:
                _refuse_special(self.path / name, st.st_mode)
                if not overwrite:
                    raise OutputError(f"'{self.path / name}' exists; pass --force to replace it")
                os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
            else:
                os.link(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd, follow_symlinks=False)
                os.unlink(tmp, dir_fd=self.fd)
            with contextlib.suppress(OSError):
                os.fsync(self.fd)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=self.fd)
            raise

    def write_json(self, name: str, obj: Any, *, overwrite: bool = True, indent: int | None = 2) -> None:
        """``obj`` as JSON (``default=str``), written atomically (see :meth:`write_bytes`)."""
        self.write_bytes(name, json.dumps(obj, indent=indent, default=str).encode(), overwrite=overwrite)

    def append_line(self, name: str, line: str) -> None:
        """Append one line to the log ``name`` (``O_APPEND|O_NOFOLLOW``, created 0600)."""
        fd = os.open(_one_name(name), _APPEND_FLAGS, _PRIVATE_FILE_MODE, dir_fd=self.fd)
        _append_and_close(fd, line, self.path / name)

    def replace_subdir(self, name: str, kind: str, populate: Callable[[PrivateDir], None]) -> None:
        """Build the artefact directory ``name`` of ``kind`` with ``populate(staged)`` in a fresh private
        sibling, then rename it into place. An existing ``name`` is replaced only when it is empty or a
        complete teraio artefact of the same kind, which is then removed file by file.

        Raises:
            UnsafeDirError: ``name`` is a link, a file, or a directory that is not such an artefact.
        """
        _one_name(name)
        staged_name = f".{name[:40]}.{secrets.token_hex(6)}"
        os.mkdir(staged_name, _PRIVATE_DIR_MODE, dir_fd=self.fd)
        pending: str | None = staged_name
        try:
            staged, _ = self.subdir(staged_name, create=False)
            with staged:
                os.fchmod(staged.fd, _PRIVATE_DIR_MODE)  # made by mkdir above: exact whatever the umask
                populate(staged)
                if not _matches_layout_at(staged.fd, kind):  # a bug in populate, not user input
                    raise OutputError(f"internal: '{self.path / name}' would not be a valid {kind} layout")
                os.fsync(staged.fd)
            aside: str | None = None
            try:
                st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            if st is not None:
                if not stat.S_ISDIR(st.st_mode) or not (
                    _matches_layout_at_name(self.fd, name, kind) or _empty_dir_at(self.fd, name)
                ):
                    raise UnsafeDirError(
                        f"'{self.path / name}' is not a teraio {kind}; teraio does not replace it: move it away"
                    )
                aside = f".{name[:40]}.old-{secrets.token_hex(4)}"
                os.rename(name, aside, src_dir_fd=self.fd, dst_dir_fd=self.fd)
            os.rename(staged_name, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
            pending = aside
            with contextlib.suppress(OSError):
                os.fsync(self.fd)
        finally:
            if pending is not None:
                self._remove_ours(pending)

    def create_subdir(self, name: str, populate: Callable[[PrivateDir], None]) -> None:
        """Build the new subdirectory ``name`` with ``populate(staged)`` in a fresh private sibling
        (``.{name}.{random}.partial``), fsync it, and rename it to ``name`` only if nothing is there: the
        name is then absent or complete, never partial. A failure removes the staged directory; a crash
        leaves it, hidden.

        Raises:
            OutputError: ``name`` exists (when the rename comes; callers check first for a clearer message).
        """
        _one_name(name)
        staged_name = f".{name[:60]}.{secrets.token_hex(6)}.partial"
        os.mkdir(staged_name, _PRIVATE_DIR_MODE, dir_fd=self.fd)
        done = False
        try:
            staged, _ = self.subdir(staged_name, create=False)
            with staged:
                os.fchmod(staged.fd, _PRIVATE_DIR_MODE)  # made by mkdir above: exact whatever the umask
                populate(staged)
                os.fsync(staged.fd)
            try:
                _rename_noreplace(self.fd, staged_name, name)
            except FileExistsError:
                raise OutputError(
                    f"'{self.path / name}' appeared while it was being written; it was left alone"
                ) from None
            done = True
            with contextlib.suppress(OSError):
                os.fsync(self.fd)  # the rename is durable once the parent is
        finally:
            if not done:
                self._remove_ours(staged_name)

    def _remove_ours(self, name: str) -> None:
        """Remove a subdirectory this process created or just moved aside as a teraio artefact (its
        regular files, then itself); anything else in it keeps it in place."""
        try:
            fd = os.open(name, _DIR_OPEN | os.O_NOFOLLOW, dir_fd=self.fd)
        except OSError:
            return
        try:
            for entry in os.listdir(fd):
                with contextlib.suppress(OSError):
                    if stat.S_ISREG(os.stat(entry, dir_fd=fd, follow_symlinks=False).st_mode):
                        os.unlink(entry, dir_fd=fd)
        finally:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.rmdir(name, dir_fd=self.fd)


_RENAME_NOREPLACE = 1  # linux/fs.h


def _rename_noreplace(dir_fd: int, src: str, dst: str) -> None:
    """Rename ``src`` to ``dst`` in ``dir_fd`` unless ``dst`` exists: Linux's ``renameat2`` with
    ``RENAME_NOREPLACE`` (Python's ``os`` has no such call); where the kernel or filesystem lacks it, a
    plain rename after a last check (an empty directory created in between would then be replaced)."""
    import ctypes

    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is not None:
        if fn(dir_fd, src.encode(), dir_fd, dst.encode(), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            raise FileExistsError(err, os.strerror(err), dst)
        if err not in (errno.ENOSYS, errno.EINVAL):
            raise OSError(err, os.strerror(err), dst)
    try:
        os.stat(dst, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        os.rename(src, dst, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        return
    raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), dst)


def _empty_dir_at(parent_fd: int, name: str) -> bool:
    try:
        fd = os.open(name, _DIR_OPEN | os.O_NOFOLLOW, dir_fd=parent_fd)
    except OSError:
        return False
    try:
        return not os.listdir(fd)
    finally:
        os.close(fd)
