"""Offload files on disk: safe creation, preallocation, extent reuse and cleanup.

Three problems live here. (1) Space: each offload directory gets one data file, preallocated with
fallocate so a write never discovers a full disk halfway, and an extent allocator hands out and reuses
ranges of it so a long run does not grow the file step after step. (2) Safety: the bytes are training
data, so the per-process subdirectory is created 0700 and files 0600 with O_EXCL|O_NOFOLLOW (never
following a planted symlink, never reusing a planted file), and cleanup only touches teraio's own
subdirectories; the base directory itself must belong to the user (or root) and may be writable by
others only with the sticky bit, so nobody else can swap our subdirectory under us. (3) Leftovers:
files are removed on close, at interpreter exit and on SIGTERM (:func:`remove_live_files`, from the
handler :func:`install_sigterm_handler` installs), and a process that was killed leaves a subdirectory
whose lock nobody holds, which the next start removes; a live process holds its lock (flock), so its
files are never touched.

Note: [Lock before visible]
    A subdirectory is created under a name cleanup ignores (``.teraio-new-...``), its lock file is
    created and locked inside it, and only then is it renamed to its ``teraio-r<rank>-p<pid>-<hex>``
    name. So cleanup in another process never sees one of our directories without its lock held;
    otherwise a process starting at the same moment could take the fresh lock first, judge the
    directory stale and remove it while its owner starts using it.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import re
import secrets
import signal
import stat
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from teraio.runtime.config import PAGE_NBYTES, FaultInjectorFn
from teraio.runtime.errors import (
    ConfigError,
    OffloadPermissionError,
    OutOfSpaceError,
    RuntimeIOError,
    UnsafePathError,
    map_os_error,
)

log = logging.getLogger(__name__)

SUBDIR_RE = re.compile(r"^teraio-r(\d+)-p(\d+)-([0-9a-f]{8})$")
#: A subdirectory being created (Note: [Lock before visible]); cleaned up when its creator is gone.
NEW_SUBDIR_RE = re.compile(r"^\.teraio-new-r(\d+)-p(\d+)-([0-9a-f]{8})$")
LOCK_NAME = "lock"
DATA_NAME = "data.bin"
CUFILE_CONFIG_NAME = "cufile.json"  # written by the kvikio tier when the machine has none
_OUR_FILES = (DATA_NAME, LOCK_NAME, CUFILE_CONFIG_NAME)
_RAM_FS_MAGICS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def align_up(nbytes: int, align: int = PAGE_NBYTES) -> int:
    """Round ``nbytes`` up to a multiple of ``align``."""
    return (nbytes + align - 1) // align * align


def filesystem_type(path: Path) -> str | None:
    """Return "tmpfs"/"ramfs" when ``path`` lives in RAM, "other" for a real filesystem, None if unknown.

    O_DIRECT "works" on tmpfs on some kernels, so it cannot tell the medium; statfs's f_type can.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
        if libc.statfs(os.fsencode(str(path)), buf) != 0:
            return None
        f_type = ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF
    except (OSError, AttributeError):
        return None
    return _RAM_FS_MAGICS.get(f_type, "other")


def available_nbytes(path: Path) -> int | None:
    """Free bytes an unprivileged writer may use in the filesystem holding ``path``."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


class ExtentAllocator:
    """First-fit allocator of page-aligned byte ranges inside one growable file.

    Freed ranges are coalesced, so a step that allocates and frees the same sizes as the last one
    lands on the same ranges and the file stops growing after the first step.
    """

    def __init__(self, capacity_nbytes: int = 0) -> None:
        self.capacity_nbytes = capacity_nbytes
        self.used_nbytes = 0
        self.peak_used_nbytes = 0
        # Sorted, non-adjacent free ranges as parallel lists (offsets for bisect).
        self._free_offsets: list[int] = [0] if capacity_nbytes else []
        self._free_lengths: list[int] = [capacity_nbytes] if capacity_nbytes else []

    def allocate(self, nbytes: int) -> int | None:
        """Return the offset of a free range of ``nbytes`` (page-aligned), or None if none fits."""
        nbytes = align_up(nbytes)
        for i, length in enumerate(self._free_lengths):
            if length >= nbytes:
                offset = self._free_offsets[i]
                if length == nbytes:
                    del self._free_offsets[i], self._free_lengths[i]
                else:
                    self._free_offsets[i] += nbytes
                    self._free_lengths[i] -= nbytes
                self.used_nbytes += nbytes
                self.peak_used_nbytes = max(self.peak_used_nbytes, self.used_nbytes)
                return offset
        return None

    def growth_needed(self, nbytes: int) -> int:
        """Bytes to append to the file so that ``allocate(nbytes)`` succeeds (reusing a free tail)."""
        nbytes = align_up(nbytes)
        tail = 0
        if self._free_offsets and self._free_offsets[-1] + self._free_lengths[-1] == self.capacity_nbytes:
            tail = self._free_lengths[-1]
        return nbytes - tail

    def extend(self, new_capacity_nbytes: int) -> None:
        """Record that the file now holds ``new_capacity_nbytes`` (the new tail is free)."""
        if new_capacity_nbytes <= self.capacity_nbytes:
            return
        added = new_capacity_nbytes - self.capacity_nbytes
        old = self.capacity_nbytes
        self.capacity_nbytes = new_capacity_nbytes
        self._insert_free(old, added)

    def free(self, offset: int, nbytes: int) -> None:
        """Return a range obtained from :meth:`allocate`."""
        nbytes = align_up(nbytes)
        self.used_nbytes -= nbytes
        self._insert_free(offset, nbytes)

    def _insert_free(self, offset: int, nbytes: int) -> None:
        i = bisect.bisect_left(self._free_offsets, offset)
        if i < len(self._free_offsets) and self._free_offsets[i] < offset + nbytes:
            raise AssertionError(f"double free of extent at {offset}")
        if i > 0 and self._free_offsets[i - 1] + self._free_lengths[i - 1] > offset:
            raise AssertionError(f"double free of extent at {offset}")
        # Merge with the following range, then with the preceding one.
        if i < len(self._free_offsets) and self._free_offsets[i] == offset + nbytes:
            nbytes += self._free_lengths[i]
            del self._free_offsets[i], self._free_lengths[i]
        if i > 0 and self._free_offsets[i - 1] + self._free_lengths[i - 1] == offset:
            self._free_lengths[i - 1] += nbytes
        else:
            self._free_offsets.insert(i, offset)
            self._free_lengths.insert(i, nbytes)

    @property
    def free_extents(self) -> list[tuple[int, int]]:
        """The free ranges as (offset, nbytes), for tests and diagnostics."""
        return list(zip(self._free_offsets, self._free_lengths))


def _pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists. Any number is accepted: one outside the kernel's pid range
    (a corrupt or planted name) is no live process."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError, ValueError):
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def check_base_dir(fd: int, path: Path) -> None:
    """Refuse a base directory someone else controls.

    It must be owned by this user (or root), and if group or others may write in it, it must have the
    sticky bit (like /tmp), so no other user can rename or remove our subdirectory and plant their own.

    Raises:
        UnsafePathError: naming the directory, its owner and mode, and what to do.
    """
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"offload directory {path} is not a directory")
    if st.st_uid not in (os.geteuid(), 0):
        raise UnsafePathError(
            f"offload directory {path} belongs to uid {st.st_uid}, not to you (uid {os.geteuid()}); "
            f"use a directory you own",
            path=str(path),
        )
    writable_by_others = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if writable_by_others and not st.st_mode & stat.S_ISVTX:
        raise UnsafePathError(
            f"offload directory {path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}) "
            f"without the sticky bit; use a directory only you can write, or chmod go-w/+t it",
            path=str(path),
        )


def _trusted(uid: int) -> bool:
    return uid in (os.geteuid(), 0)


def _is_shared_dir(st: os.stat_result) -> bool:
    """A directory everyone may write in, made safe by the sticky bit and a trusted owner (like /tmp)."""
    return bool(st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and st.st_mode & stat.S_ISVTX) and _trusted(
        st.st_uid
    )


def make_base_dirs(base: Path) -> None:
    """Create ``base``'s missing directories one at a time, each 0700, checking the path from the top.

    Every directory between the nearest shared directory above ``base`` (world- or group-writable with
    the sticky bit and owned by root or this user, like /tmp) and ``base`` must be owned by this user
    (or root) and writable by nobody else (one with the sticky bit counts as a shared directory itself,
    as for :func:`check_base_dir`), whether teraio creates it or finds it: the owner of
    ``/tmp/teraio-<uid>`` may rename anything inside it, so another user who created it first could
    swap the offload directory for one of theirs. Symbolic links there must be ours too. The path is
    walked top-down and nothing is created below a directory that fails, so a refused path is left as
    it was. ``base`` itself is checked by :func:`check_base_dir` once opened. (``os.makedirs`` would
    give the parents it creates the umask's mode, 0777 under ``umask 0``.)

    Raises:
        UnsafePathError: naming the directory, its owner or mode, and what to do.
        OSError: a component is not a directory, or the filesystem refused.
    """
    base = Path(os.path.abspath(base))
    shared: Path | None = None
    for d in [*reversed(base.parents), base]:
        try:
            link = os.lstat(d)
        except FileNotFoundError:
            with contextlib.suppress(FileExistsError):  # created meanwhile: checked below like any other
                os.mkdir(d, 0o700)
            link = os.lstat(d)
        if d == base:
            if not os.path.isdir(d):  # a file, or a dangling link: as os.makedirs reported it
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(d))
            return
        st = os.stat(d) if stat.S_ISLNK(link.st_mode) else link
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(d))
        if shared is None:
            if _is_shared_dir(st):
                shared = d  # the first shared root: what lies below it is checked against it
            continue
        where = f"offload directory {base}: {d} (in the shared directory {shared})"
        # The owner of a link is checked first: another user's link to a shared directory (one more
        # sticky directory) would otherwise pass as a shared root of its own.
        if stat.S_ISLNK(link.st_mode) and not _trusted(link.st_uid):
            raise UnsafePathError(
                f"{where} is a symbolic link owned by uid {link.st_uid}, not by you; use another directory",
                path=str(d),
            )
        if _is_shared_dir(st):
            shared = d  # a shared directory below another: what lies below it is checked against it
            continue
        if not _trusted(st.st_uid):
            raise UnsafePathError(
                f"{where} belongs to uid {st.st_uid}, not to you (uid {os.geteuid()}); another user "
                f"created it: use another directory",
                path=str(d),
            )
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise UnsafePathError(
                f"{where} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}); chmod go-w it, "
                f"or use another directory",
                path=str(d),
            )


def clean_stale_subdirs(base: Path) -> list[str]:
    """Remove teraio subdirectories in ``base`` left by dead processes; return the removed names.

    A subdirectory is stale when nobody holds its lock (flock is released when a process dies, even
    by SIGKILL), or, if it has no lock file, when the pid in its name is gone. One still being created
    (``.teraio-new-...``) is stale only when the pid in its name is gone. Only our own names,
    only real directories owned by us, and only our own file names inside are ever removed.
    """
    removed: list[str] = []
    try:
        base_fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return removed
    try:
        for name in os.listdir(base_fd):
            match = SUBDIR_RE.match(name) or NEW_SUBDIR_RE.match(name)
            if not match:
                continue
            try:
                st = os.stat(name, dir_fd=base_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                continue
            pid = int(match.group(2))
            if match.re is NEW_SUBDIR_RE and (pid == os.getpid() or _pid_alive(pid)):
                continue  # still being created: its lock may not be taken yet (Note: [Lock before visible])
            if _remove_if_stale(base_fd, name, pid):
                removed.append(name)
    finally:
        os.close(base_fd)
    if removed:
        log.warning("removed %d stale offload subdirectories of dead processes in %s", len(removed), base)
    return removed


def _remove_if_stale(base_fd: int, name: str, pid: int) -> bool:
    try:
        dfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=base_fd)
    except OSError:
        return False
    try:
        try:
            lock_fd = os.open(LOCK_NAME, os.O_RDWR | os.O_NOFOLLOW, dir_fd=dfd)
        except FileNotFoundError:
            lock_fd = None
        except OSError:
            return False
        if lock_fd is None:
            if pid == os.getpid() or _pid_alive(pid):
                return False  # a live process's directory without a lock yet (being created)
        else:
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(lock_fd)
                return False  # its owner is alive
        try:
            for fname in _OUR_FILES:
                try:
                    os.unlink(fname, dir_fd=dfd)
                except FileNotFoundError:
                    pass
        finally:
            if lock_fd is not None:
                os.close(lock_fd)
    finally:
        os.close(dfd)
    try:
        os.rmdir(name, dir_fd=base_fd)
    except OSError as exc:  # someone put other files there: leave them, say so
        log.warning("stale offload subdirectory %s left in place: %s", name, exc.strerror)
        return False
    return True


@dataclass
class DirUsage:
    """Byte counters of one offload directory."""

    bytes_written: int = 0
    bytes_read: int = 0


class OffloadDir:
    """One offload directory: its private subdirectory, its lock, one data file and its allocator.

    Args:
        base: the user's directory (one per SSD); created 0700 if missing.
        rank: distributed rank, part of the subdirectory name.
        direct_io: None = try O_DIRECT, fall back with a logged reason; True = require; False = never.
        fault_injector: test seam called before create/preallocate syscalls.
    """

    def __init__(
        self, base: Path, *, rank: int, direct_io: bool | None, fault_injector: FaultInjectorFn | None
    ) -> None:
        self.base = base
        self._inject = fault_injector
        self._lock = threading.Lock()
        self.usage = DirUsage()
        self.closed = False
        self.fs_type = None
        self._base_fd = -1
        self._dir_fd = -1
        self._lock_fd = -1
        self.fd = -1
        self._subdir_name = ""  # the subdirectory's current name in base (for remove_files_now)
        # Only the process that created the files removes them (a forked child inherits this object).
        self._owner_pid = os.getpid()
        install_sigterm_handler()
        self._create_base()
        self.fs_type = filesystem_type(base)
        if self.fs_type in ("tmpfs", "ramfs"):
            log.warning(
                "offload directory %s is on %s: offloaded bytes stay in RAM and save no memory; "
                "use a directory on an SSD",
                base,
                self.fs_type,
            )
        clean_stale_subdirs(base)
        try:
            self._create_subdir(rank)
            self._open_data_file(direct_io)
        except BaseException:
            self.close()
            raise
        self.allocator = ExtentAllocator(0)

    # -- creation -------------------------------------------------------------------------------
    def _create_base(self) -> None:
        try:
            make_base_dirs(self.base)
            link = os.lstat(self.base)
            if stat.S_ISLNK(link.st_mode) and link.st_uid not in (os.geteuid(), 0):
                raise UnsafePathError(
                    f"offload directory {self.base} is a symbolic link owned by uid {link.st_uid}, "
                    f"not by you; use the real directory",
                    path=str(self.base),
                )
            self._base_fd = os.open(self.base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            check_base_dir(self._base_fd, self.base)
        except RuntimeIOError:
            if self._base_fd >= 0:
                os.close(self._base_fd)
                self._base_fd = -1
            raise
        except (NotADirectoryError, FileExistsError) as exc:
            # Name the component that is in the way (a file at /tmp/teraio-<uid> for .../offload).
            where = os.fsdecode(exc.filename) if exc.filename else str(self.base)
            if os.path.abspath(where) == os.path.abspath(self.base):
                raise ConfigError(f"offload directory {self.base} exists and is not a directory") from exc
            raise ConfigError(
                f"offload directory {self.base}: {where} is not a directory; remove it or choose another "
                f"offload directory"
            ) from exc
        except OSError as exc:
            raise map_os_error(
                exc, action="create", path=str(self.base), directory=str(self.base), needed_nbytes=0
            ) from exc

    def _create_subdir(self, rank: int) -> None:
        for _ in range(8):
            token = f"r{rank}-p{os.getpid()}-{secrets.token_hex(4)}"
            new_name, name = f".teraio-new-{token}", f"teraio-{token}"
            path = self.base / name
            try:
                if self._inject:
                    self._inject("create", str(path), 0, 0)
                # mkdir never follows a symlink at its last component: a planted one gives EEXIST.
                os.mkdir(new_name, mode=0o700, dir_fd=self._base_fd)
            except FileExistsError:
                continue
            except OSError as exc:
                raise map_os_error(
                    exc, action="create", path=str(path), directory=str(self.base), needed_nbytes=0
                ) from exc
            if os.path.lexists(path):  # (rename would replace an empty directory of that name)
                os.rmdir(new_name, dir_fd=self._base_fd)
                continue
            self._subdir_name = new_name
            _LIVE_DIRS.add(self)  # SIGTERM removes it from now on (remove_live_files)
            break
        else:
            raise UnsafePathError(f"could not create a fresh subdirectory in {self.base}: names collide")
        self._dir_fd = os.open(
            new_name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._base_fd
        )
        self.path = self.base / new_name
        st = os.fstat(self._dir_fd)
        if st.st_uid != os.geteuid() or not stat.S_ISDIR(st.st_mode):
            raise UnsafePathError(f"{path} is not a directory owned by this user; refusing to use it")
        os.fchmod(self._dir_fd, 0o700)  # umask may only take bits away; make it exact anyway
        self._lock_fd = self._create_file(LOCK_NAME, 0)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # Note: [Lock before visible]: only now may cleanup in other processes see the directory.
        os.rename(new_name, name, src_dir_fd=self._base_fd, dst_dir_fd=self._base_fd)
        self._subdir_name = name
        self.path = path

    def write_private_file(self, name: str, data: bytes) -> Path:
        """Create ``name`` (one of this module's known names, removed at close) in the private
        subdirectory, 0600 with O_EXCL|O_NOFOLLOW, and write ``data`` to it; return its path."""
        if name not in _OUR_FILES or name in (DATA_NAME, LOCK_NAME):
            raise ValueError(f"{name!r} is not a file OffloadDir writes on request")
        fd = self._create_file(name, 0)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        return self.path / name

    def _create_file(self, name: str, extra_flags: int) -> int:
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | extra_flags
        fd = os.open(name, flags, 0o600, dir_fd=self._dir_fd)
        os.fchmod(fd, 0o600)
        return fd

    def _open_data_file(self, direct_io: bool | None) -> None:
        self.data_path = self.path / DATA_NAME
        self.direct = False
        self.fallback_reason: str | None = None
        if self._inject:
            self._inject("create", str(self.data_path), 0, 0)
        want_direct = direct_io is not False and _O_DIRECT != 0
        try:
            try:
                self.fd = self._create_file(DATA_NAME, _O_DIRECT if want_direct else 0)
                self.direct = want_direct
            except OSError as exc:
                if not want_direct or exc.errno != errno.EINVAL:
                    raise
                self.fallback_reason = f"open with O_DIRECT refused ({exc.strerror})"
                self.fd = self._create_file(DATA_NAME, 0)
            if self.direct:
                self._probe_direct()
        except RuntimeIOError:
            raise
        except OSError as exc:
            raise map_os_error(
                exc, action="create", path=str(self.data_path), directory=str(self.base), needed_nbytes=0
            ) from exc
        if direct_io is True and not self.direct:
            raise ConfigError(f"direct_io=True but {self.base} refuses O_DIRECT: {self.fallback_reason}")
        if direct_io is False:
            self.fallback_reason = "direct_io=False"
        if not self.direct:
            log.warning(
                "offload directory %s: using buffered I/O + fsync + fadvise(DONTNEED) instead of "
                "O_DIRECT (%s)",
                self.base,
                self.fallback_reason,
            )

    def _probe_direct(self) -> None:
        """Write one aligned page with O_DIRECT; some filesystems accept the flag and refuse the I/O."""
        import mmap

        page = mmap.mmap(-1, PAGE_NBYTES)
        try:
            os.posix_fallocate(self.fd, 0, PAGE_NBYTES)
            os.pwrite(self.fd, page, 0)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self.fallback_reason = f"O_DIRECT write refused ({exc.strerror})"
            fl = fcntl.fcntl(self.fd, fcntl.F_GETFL)
            fcntl.fcntl(self.fd, fcntl.F_SETFL, fl & ~_O_DIRECT)
            self.direct = False
        finally:
            page.close()

    # -- space ----------------------------------------------------------------------------------
    def reserve(self, nbytes: int) -> None:
        """Preallocate the file to at least ``nbytes`` now, failing now if the disk cannot hold it.

        Raises:
            OutOfSpaceError: naming the directory, the bytes needed and the bytes free.
        """
        with self._lock:
            target = align_up(nbytes)
            if target > self.allocator.capacity_nbytes:
                self._grow_locked(target - self.allocator.capacity_nbytes, reason="reserve")

    def allocate(self, nbytes: int) -> int:
        """Return the file offset of ``nbytes`` (page-aligned) of free space, growing the file if needed.

        Raises:
            OutOfSpaceError: the filesystem cannot grow the file.
        """
        with self._lock:
            offset = self.allocator.allocate(nbytes)
            if offset is None:
                self._grow_locked(self.allocator.growth_needed(nbytes), reason="allocate")
                offset = self.allocator.allocate(nbytes)
                assert offset is not None
            return offset

    def free(self, offset: int, nbytes: int) -> None:
        """Give back a range from :meth:`allocate` for reuse."""
        with self._lock:
            if not self.closed:
                self.allocator.free(offset, nbytes)

    def _grow_locked(self, add_nbytes: int, *, reason: str) -> None:
        old = self.allocator.capacity_nbytes
        new = old + align_up(add_nbytes)
        avail = available_nbytes(self.base)
        try:
            if self._inject:
                self._inject("preallocate", str(self.data_path), old, new - old)
            if avail is not None and new - old > avail:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            os.posix_fallocate(self.fd, old, new - old)
        except OSError as exc:
            err = map_os_error(
                exc,
                action="preallocate" if reason == "reserve" else "allocate",
                path=str(self.data_path),
                directory=str(self.base),
                needed_nbytes=new - old,
                available_nbytes=avail,
            )
            raise err from exc
        self.allocator.extend(new)

    @property
    def capacity_nbytes(self) -> int:
        return self.allocator.capacity_nbytes

    # -- teardown -------------------------------------------------------------------------------
    def remove_files_now(self) -> None:
        """Unlink this process's files and remove its subdirectory, by system calls on the descriptors
        this object holds; nothing else (for :func:`remove_live_files`, in a signal handler)."""
        if os.getpid() != self._owner_pid:
            return
        dir_fd, base_fd, name = self._dir_fd, self._base_fd, self._subdir_name
        if dir_fd >= 0:
            for fname in _OUR_FILES:
                try:
                    os.unlink(fname, dir_fd=dir_fd)
                except OSError:
                    pass
        if base_fd >= 0 and name:
            try:
                os.rmdir(name, dir_fd=base_fd)
            except OSError:
                pass

    def close(self) -> None:
        """Close and delete this process's files and subdirectory (only those)."""
        if self.closed:
            return
        self.closed = True
        _LIVE_DIRS.discard(self)
        # Each descriptor is forgotten before it is closed, so remove_files_now (a signal handler) never
        # uses a number the kernel may already have handed to another file.
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)
        if os.getpid() != self._owner_pid:
            # A forked child: the files are its parent's, still in use. Close our copies only.
            for attr in ("_dir_fd", "_lock_fd", "_base_fd"):
                fd = getattr(self, attr)
                if fd >= 0:
                    setattr(self, attr, -1)
                    os.close(fd)
            return
        if self._dir_fd >= 0:
            for name in _OUR_FILES:
                try:
                    os.unlink(name, dir_fd=self._dir_fd)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    log.warning("could not remove %s/%s: %s", self.path, name, exc.strerror)
            fd, self._dir_fd = self._dir_fd, -1
            os.close(fd)
            try:
                os.rmdir(self.path.name, dir_fd=self._base_fd)
            except OSError as exc:
                log.warning("could not remove offload subdirectory %s: %s", self.path, exc.strerror)
        if self._lock_fd >= 0:
            fd, self._lock_fd = self._lock_fd, -1
            os.close(fd)  # releasing the lock last: the directory is gone by now
        if self._base_fd >= 0:
            fd, self._base_fd = self._base_fd, -1
            os.close(fd)


# ------------------------------------------------------------------------------------------- SIGTERM
#: Every OffloadDir of this process whose subdirectory exists, for the SIGTERM handler. Weak: a directory
#: the program dropped without closing is not kept alive by it.
_LIVE_DIRS: weakref.WeakSet[OffloadDir] = weakref.WeakSet()


def remove_live_files() -> None:
    """Remove the files and subdirectories of every open :class:`OffloadDir` of this process, now.

    Made for a signal handler (Note: [No lock in a finalizer or a signal handler] in runtime/engine.py):
    only ``unlinkat``/``rmdir`` calls on the directory descriptors each directory holds, no lock, no
    logging, no waiting for I/O in flight (a thread still writing keeps writing into an unlinked file,
    which the kernel frees when the process dies). The descriptors stay open: the process is about to
    die, and closing one another thread may be using could hand its number to an unrelated file.
    (``OffloadDir.close`` forgets each descriptor before closing it; only a close running on another
    thread at that very moment could still close one between this function reading it and using it.)
    """
    for ref in list(_LIVE_DIRS.data):  # one C-level copy of the set: no thread can change it midway
        odir = ref()
        if odir is not None:
            odir.remove_files_now()


_sigterm_installed = False
_previous_sigterm: Any = None


def _on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM: remove every offload file like a normal exit would, then die of the signal as the default
    action would (exit status -SIGTERM).

    Nothing here takes a lock (Note: [No lock in a finalizer or a signal handler] in runtime/engine.py):
    the handler may run inside ``ThreadPoolExecutor.submit`` or ``OffloadDir.allocate`` holding their
    locks, where closing the engines hung (the executor's shutdown waits on the lock ``submit`` holds).
    A handler the user installed before the first offload directory is called instead and decides (it may
    shut down gracefully and let atexit clean up, or keep running; the engines stay usable then).
    """
    previous = _previous_sigterm
    if callable(previous):
        previous(signum, frame)
        return
    remove_live_files()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def install_sigterm_handler() -> None:
    """Chain the SIGTERM cleanup in front of the process's handler, once, from the main thread only."""
    global _sigterm_installed, _previous_sigterm
    if _sigterm_installed or threading.current_thread() is not threading.main_thread():
        return
    try:
        previous = signal.getsignal(signal.SIGTERM)
    except ValueError:
        return
    if previous == signal.SIG_IGN or previous is None:  # ignored on purpose, or set from C: leave it
        _sigterm_installed = True
        return
    _previous_sigterm = previous if callable(previous) else None
    signal.signal(signal.SIGTERM, _on_sigterm)
    _sigterm_installed = True


__all__ = [
    "ExtentAllocator",
    "OffloadDir",
    "OffloadPermissionError",
    "OutOfSpaceError",
    "align_up",
    "available_nbytes",
    "clean_stale_subdirs",
    "filesystem_type",
    "install_sigterm_handler",
    "remove_live_files",
]
