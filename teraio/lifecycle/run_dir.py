"""Which directories ``teraio.backend(run_dir=...)`` may write into, and how it writes there.

A run directory receives ``config.json``, ``stats.jsonl``, ``hardware.json`` and ``graphN/``
(``profile/``, ``plan.json``, ``trace.json``), and the backend replaces the ones a previous run left. So
an existing, non-empty directory is used only when it is recognisably a teraio run directory: its
``config.json`` is the one a backend writes, or (a run directory whose config.json is gone) it holds
nothing but ``graphN/`` directories of teraio's files and a ``stats.jsonl``, with at least one teraio
profile among them. Anything else (a project directory, a foreign ``config.json``) is refused with a
one-line error before anything is written, since teraio never overwrites what it did not create.

It is also treated like an offload directory (:class:`RunDir`, on ``planner.safe_io.PrivateDir``):
created 0700 whatever the umask, refused when another user owns it or others may write in it, and held
open by a descriptor through which every file and subdirectory is opened with ``O_NOFOLLOW``: a link
planted in it (``graph0 -> a directory of the victim``) is never followed, and files stay 0600.

Pure Python (no torch): the CLI checks ``teraio demo --run-dir`` with it before a long run starts.
"""

from __future__ import annotations

import errno
import fnmatch
import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from teraio.errors import TeraioError, UserInputError
from teraio.planner.safe_io import OutputError, PrivateDir, UnsafeDirError, is_profile_at, read_json_object

log = logging.getLogger("teraio")

#: Keys of the ``config.json`` a backend writes (the fields of ``BackendConfig``; a test keeps them so).
#: A config.json holding all of them is teraio's; any other config.json is the user's. (The backend also
#: writes its ``run_id``.)
RUN_DIR_CONFIG_KEYS: tuple[str, ...] = (
    "memory_budget",
    "offload_dirs",
    "solver",
    "profiling",
    "inner",
    "run_dir",
)
#: The same keys in the flat config.json of earlier releases (``profile_steps`` before ``profiling``): a
#: run directory they wrote stays teraio's.
LEGACY_RUN_DIR_CONFIG_KEYS: tuple[str, ...] = tuple(
    "profile_steps" if k == "profiling" else k for k in RUN_DIR_CONFIG_KEYS
)

#: What a backend writes inside a ``graphN/`` directory.
_GRAPH_ENTRIES = frozenset({"profile", "plan.json", "trace.json"})
_DIR_OPEN = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


# ------------------------------------------------------------------------------------- recognising
def _is_teraio_config(config: dict[str, Any] | None) -> bool:
    return config is not None and any(
        all(k in config for k in keys) for keys in (RUN_DIR_CONFIG_KEYS, LEGACY_RUN_DIR_CONFIG_KEYS)
    )


def _graph_dir_state_at(dir_fd: int) -> bool | None:
    """True: a graphN/ (open as ``dir_fd``) holding a teraio profile and only teraio's files; False:
    something else is there; None: only teraio's names, but no profile to prove it."""
    try:
        entries = {n: os.stat(n, dir_fd=dir_fd, follow_symlinks=False) for n in os.listdir(dir_fd)}
    except OSError:
        return False
    if set(entries) - _GRAPH_ENTRIES:
        return False
    for name, st in entries.items():
        wanted = stat.S_ISDIR if name == "profile" else stat.S_ISREG
        if not wanted(st.st_mode):  # a link, or a file where a directory belongs
            return False
    if "profile" not in entries:
        return None
    try:
        fd = os.open("profile", _DIR_OPEN | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        return is_profile_at(fd)
    finally:
        os.close(fd)


def is_teraio_run_dir_at(dir_fd: int) -> bool:
    """True if the open directory ``dir_fd`` is one a teraio backend wrote (see the module docstring);
    nothing in it is followed if it is a link."""
    try:
        names = os.listdir(dir_fd)
    except OSError:
        return False
    if "config.json" in names:
        return _is_teraio_config(read_json_object("config.json", dir_fd=dir_fd))
    proven = False
    for name in names:
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            return False
        if name == "stats.jsonl" and stat.S_ISREG(st.st_mode):
            continue
        if not (fnmatch.fnmatchcase(name, "graph*") and stat.S_ISDIR(st.st_mode)):
            return False
        try:
            fd = os.open(name, _DIR_OPEN | os.O_NOFOLLOW, dir_fd=dir_fd)
        except OSError:
            return False
        try:
            ok = _graph_dir_state_at(fd)
        finally:
            os.close(fd)
        if ok is False:
            return False
        proven = proven or bool(ok)
    return proven


def is_teraio_run_dir(path: str | os.PathLike) -> bool:
    """True if ``path`` is a directory a teraio backend wrote (see the module docstring)."""
    try:
        fd = os.open(path, _DIR_OPEN)
    except OSError:
        return False
    try:
        return is_teraio_run_dir_at(fd)
    finally:
        os.close(fd)


def _is_empty_at(dir_fd: int) -> bool:
    return not os.listdir(dir_fd)


def refuse_foreign_run_dir(path: str | os.PathLike | None, *, option: str = "run_dir") -> None:
    """Raise a one-line :class:`UserInputError` unless ``path`` may be used as a run directory: it is
    unset, missing (it will be created 0700), an empty directory, or a teraio run directory, and it is
    this user's (or root's) and writable by nobody else.

    Raises:
        UserInputError: ``path`` is not a directory, is a non-empty directory teraio did not write, or is
            not private to this user.
    """
    if path is None or os.fspath(path) == "":
        return
    p = Path(path)
    if not p.exists():
        if p.is_symlink():
            raise UserInputError(
                f"{option} '{p}' is a dangling symbolic link; choose an empty or new directory"
            )
        return
    if not p.is_dir():
        raise UserInputError(
            f"{option} '{p}' exists and is not a directory; choose an empty or new directory"
        )
    try:
        with PrivateDir.open(p, what=option) as d:
            empty = _is_empty_at(d.fd)
            ours = empty or is_teraio_run_dir_at(d.fd)
    except UnsafeDirError as exc:
        raise UserInputError(str(exc)) from None
    except OSError as exc:
        raise UserInputError(
            f"{option} '{p}' cannot be read ({exc.strerror}); choose another directory"
        ) from None
    if not ours:
        raise UserInputError(
            f"{option} '{p}' is not empty and is not a teraio run directory (no config.json written by "
            f"teraio); choose an empty or new directory, teraio does not overwrite files it did not write"
        )


# ---------------------------------------------------------------------------------------- writing
class RunDirError(TeraioError):
    """A write into a run directory failed: the filesystem is full, refused, or a link or foreign file is
    in the way. The message names the file and what to do.

    Attributes:
        path: the file or directory that could not be written.
        errno: the operating system's error number, if the filesystem refused.
    """

    def __init__(self, message: str, *, path: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.errno = errno


_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_REFUSED = {errno.EACCES, errno.EPERM, errno.EROFS}


class RunDir:
    """An open run directory: where one backend writes its configuration, profiles, plans and statistics.

    Note: [Run-directory files are by-products]
        Training is the job; a run directory records it. ``config.json`` is written when the backend is
        built (:meth:`write_config` raises, so a run directory that cannot be written fails before any
        step). Every later write (profiles, plans, traces, ``hardware.json``, ``stats.jsonl``) happens
        in the middle of training, in a forward call or a backward hook: the first one that fails (a
        full disk, ENOSPC; a read-only remount; a link or another file where teraio's belongs) logs one
        warning naming the file, the typed :class:`RunDirError` is kept in :attr:`error`, and the run
        goes on without the run directory (later writes are skipped, so the directory is not left with
        some graphs' files and not others'). Nothing is half-written: files appear by rename, a profile
        directory by rename of a finished one, and a ``graphN/`` that the failed write created is
        removed again.
    """

    def __init__(self, directory: PrivateDir, run_id: str) -> None:
        self._dir = directory
        self.run_id = run_id
        self.error: RunDirError | None = None

    @classmethod
    def open(cls, path: str | os.PathLike, run_id: str, *, option: str = "run_dir") -> RunDir:
        """Open (creating it 0700 if missing) the run directory ``path`` of a backend whose ``run_id``
        every ``stats.jsonl`` line carries.

        Raises:
            UserInputError: the directory is not private to this user, or is a non-empty directory that
                is not a teraio run directory (checked through the descriptor that is kept, so it cannot
                be swapped between the check and the writes).
            RunDirError: the filesystem refused to create or open it.
        """
        refuse_foreign_run_dir(path, option=option)
        try:
            d = PrivateDir.open(path, what=option)
        except UnsafeDirError as exc:
            raise UserInputError(str(exc)) from None
        except OSError as exc:
            raise _os_error(Path(os.path.abspath(path)), "", exc) from None
        if not (_is_empty_at(d.fd) or is_teraio_run_dir_at(d.fd)):
            d.close()
            raise UserInputError(
                f"{option} '{path}' is not empty and is not a teraio run directory; choose an empty or new "
                f"directory"
            )
        return cls(d, run_id)

    @property
    def path(self) -> Path:
        return self._dir.path

    def close(self) -> None:
        self._dir.close()

    # ------------------------------------------------------------------------------------ the files
    def write_config(self, config: dict[str, Any]) -> None:
        """Write ``config.json`` (with this run's ``run_id``). Raises :class:`RunDirError` on failure."""
        try:
            self._dir.write_json("config.json", {**config, "run_id": self.run_id})
        except (OSError, OutputError) as exc:
            raise self._error("config.json", exc) from None

    def save_profile(self, graph_id: int, profile: Any) -> None:
        """``graphN/profile`` (a ``planner.profile.Profile``), replacing the one a previous run wrote."""
        self._in_graph(
            graph_id, "profile", lambda g: g.replace_subdir("profile", "profile", profile.write_into)
        )

    def save_plan(
        self, graph_id: int, plan_json: str, trace: dict[str, Any], call: int | None = None
    ) -> None:
        """``graphN/plan.json`` and ``graphN/trace.json`` (the plan's predicted step, Chrome trace); with
        ``call``, a later call's own plan in a step (``plan_call<j>.json``, ``trace_call<j>.json``)."""
        suffix = "" if call is None else f"_call{call}"

        def write(g: PrivateDir) -> None:
            g.write_bytes(f"plan{suffix}.json", plan_json.encode())
            g.write_json(f"trace{suffix}.json", trace, indent=None)

        self._in_graph(graph_id, f"plan{suffix}.json", write)

    def save_hardware(self, hardware: dict[str, Any]) -> None:
        """``hardware.json``: the hardware model the plans were made with."""
        self._attempt("hardware.json", lambda: self._dir.write_json("hardware.json", hardware))

    def append_stats(self, record: dict[str, Any]) -> None:
        """One line of ``stats.jsonl``, starting with this run's ``run_id`` (runs sharing a directory
        interleave their lines)."""
        import json

        line = json.dumps({"run_id": self.run_id, **record})
        self._attempt("stats.jsonl", lambda: self._dir.append_line("stats.jsonl", line))

    # ------------------------------------------------------------------------------------- failures
    def _in_graph(self, graph_id: int, what: str, write: Callable[[PrivateDir], None]) -> None:
        name = f"graph{graph_id}"

        def attempt() -> None:
            g, created = self._dir.subdir(name)
            try:
                with g:
                    write(g)
            except BaseException:
                if created:  # never an empty graphN/ left by a write that failed (rmdir: only if empty)
                    try:
                        os.rmdir(name, dir_fd=self._dir.fd)
                    except OSError:
                        pass
                raise

        self._attempt(f"{name}/{what}", attempt)

    def _attempt(self, what: str, write: Callable[[], None]) -> None:
        """Run ``write`` unless an earlier write failed (Note: [Run-directory files are by-products])."""
        if self.error is not None:
            return
        try:
            write()
        except (OSError, OutputError) as exc:
            self.error = self._error(what, exc)
            log.warning("%s; training goes on without writing to the run directory", self.error)

    def _error(self, what: str, exc: BaseException) -> RunDirError:
        if isinstance(exc, OSError):
            return _os_error(self.path, what, exc)
        return RunDirError(
            f"run directory '{self.path}': cannot write {what}: {exc}", path=str(self.path / what)
        )


def _os_error(root: Path, what: str, exc: OSError) -> RunDirError:
    where = root / what if what else root
    code = errno.errorcode.get(exc.errno or 0, "")
    reason = f"{exc.strerror or exc} ({code})" if code else f"{exc.strerror or exc}"
    if exc.errno in _FULL:
        hint = "the filesystem is full: free space there or choose another run_dir"
    elif exc.errno in _REFUSED:
        hint = "the directory is not writable: choose another run_dir"
    elif exc.errno == errno.ELOOP:
        hint = "a symbolic link is in the way, and teraio never follows one there: remove it"
    else:
        hint = "choose another run_dir"
    label = f"run directory '{root}'" + (f": cannot write {what}" if what else ": cannot create or open it")
    return RunDirError(f"{label}: {reason}; {hint}", path=str(where), errno=exc.errno)


__all__ = [
    "RUN_DIR_CONFIG_KEYS",
    "RunDir",
    "RunDirError",
    "is_teraio_run_dir",
    "is_teraio_run_dir_at",
    "refuse_foreign_run_dir",
]
