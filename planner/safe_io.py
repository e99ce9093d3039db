"""The one way teraio writes files (never through a planted link, never half a file, never over what
it did not write) and reads its input files (only regular ones, only up to a limit).

Every file teraio writes (profiles, plans, hardware models, run-directory files, CLI outputs) goes
through this module:

- :func:`atomic_writer` / :func:`write_bytes` / :func:`write_text` / :func:`write_json`: the bytes go to
  a fresh temporary file in the target's directory (``O_CREAT|O_EXCL|O_NOFOLLOW``, a random name, so a
  symlink or file planted at a predictable name is never followed or reused), are fsynced, and are
  renamed over the target in one step: a reader sees the old file or the new one, never a mix, and a
  crash leaves at most a hidden temporary file. An existing target is replaced only with
  ``overwrite=True`` (the CLI's ``--force``), and only when it is a regular file: a device node, FIFO or
  socket there is refused even then; the rename replaces a symlink at the target itself, never the file
  it points to.
- :func:`replace_dir`: output directories (profiles) are built in a fresh sibling directory and renamed
  into place. An existing directory is replaced only when it is empty or a complete teraio artefact of
  the same kind (every file of its layout and nothing else, its meta.json / index.json carrying teraio's
  own keys); anything else needs ``force`` and is then moved aside (never deleted), so teraio never
  removes a file it did not write.
- :func:`check_output_file` / :func:`check_output_dir`: the CLI checks its outputs before long work.
- :func:`append_line`: append-only logs (``stats.jsonl``) open with ``O_APPEND|O_NOFOLLOW``.
- :class:`PrivateDir`: a directory held by a descriptor (a run directory), everything in it opened
  relative to it with ``O_NOFOLLOW``.
- :func:`read_input` / :func:`load_json`: inputs are read only when they are regular files (never a
  FIFO, a device or a socket, also behind a link), and only up to a size limit (``planner.limits``).

Errors are :class:`OutputError` (a ``ValueError`` with a one-line message naming the path and what to
do); OSErrors from the filesystem keep their type (the CLI reports both in one line).

This module is pure Python (no torch, no runtime): the planner writes its formats with it and teraio
imports it. The runtime keeps its own private-directory code (``runtime.space``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import stat
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, Literal

from teraio.planner.limits import MAX_JSON_FILE_NBYTES

#: Files (and, with a trailing "/", subdirectories of the same layout) an artefact directory may hold.
ARTIFACT_LAYOUTS: dict[str, tuple[str, ...]] = {
    "profile": ("ops.parquet", "tensors.parquet", "meta.json"),
    # A multi-graph profile: index.json plus one profile directory per captured graph.
    "profile-set": ("index.json", "graph*/"),
    # ``teraio estimate --out``: its summary, the hardware model planned for, the estimated profile (a
    # profile or a profile-set) and one plan per solver (the plans estimate.json names).
    "estimate": ("estimate.json", "hardware.json", "profile/", "plan-*.json"),
}
#: The key every estimate.json carries (with its schema version): a file without it is not teraio's.
ESTIMATE_META_KEY = "estimate_schema_version"

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


# ------------------------------------------------------------------------------------- directories
#: The meta.json keys every teraio profile carries (``planner.profile.META_REQUIRED``; a test keeps the two
#: equal). A meta.json without them was not written by teraio, whatever the directory's file names.
PROFILE_META_KEYS: tuple[str, ...] = ("schema_version", "fingerprint", "num_fwd_ops")


def read_json_object(path: str | os.PathLike, *, dir_fd: int | None = None) -> dict[str, Any] | None:
    """The JSON object in the regular file ``path`` (relative to ``dir_fd`` if given), or None if it is
    missing, a link (not followed), not a regular file, not JSON, or not an object: to recognise files
    teraio wrote without trusting them."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        # teraio's meta.json and index.json are a few kB: a huge file is not one of them.
        if not stat.S_ISREG(st.st_mode) or st.st_size > (16 << 20):
            return None
        with os.fdopen(fd, "rb") as f:
            fd = -1
            obj = json.loads(f.read())
    except (OSError, ValueError, RecursionError):
        return None
    finally:
        if fd >= 0:
            os.close(fd)
    return obj if isinstance(obj, dict) else None


def _is_teraio_meta(path: str) -> bool:
    meta = read_json_object(path)
    return meta is not None and _meta_is_teraios(meta)


def _meta_is_teraios(meta: dict[str, Any]) -> bool:
    if not all(k in meta for k in PROFILE_META_KEYS):
        return False
    version, fingerprint = meta["schema_version"], meta["fingerprint"]
    return (
        isinstance(version, int)
        and not isinstance(version, bool)
        and isinstance(fingerprint, str)
        and bool(fingerprint)
    )


def _real_entries(directory: Path) -> dict[str, os.DirEntry] | None:
    """The entries of a real directory by name, or None if it is unreadable or holds a symlink."""
    try:
        entries = {e.name: e for e in os.scandir(directory)}
    except OSError:
        return None
    if any(e.is_symlink() for e in entries.values()):
        return None
    return entries


def _is_profile(directory: Path) -> bool:
    """Exactly the three profile files, as regular files, with a meta.json teraio wrote."""
    entries = _real_entries(directory)
    layout = ARTIFACT_LAYOUTS["profile"]
    if entries is None or set(entries) != set(layout):
        return False
    if not all(e.is_file(follow_symlinks=False) for e in entries.values()):
        return False
    return _is_teraio_meta(entries["meta.json"].path)


def _is_profile_set(directory: Path) -> bool:
    """index.json naming exactly the graph*/ subdirectories there are (at least one), each a profile."""
    entries = _real_entries(directory)
    if (
        entries is None
        or "index.json" not in entries
        or not entries["index.json"].is_file(follow_symlinks=False)
    ):
        return False
    graphs = {n: e for n, e in entries.items() if n != "index.json"}
    if not graphs or not all(
        _glob1(n, "graph*") and e.is_dir(follow_symlinks=False) for n, e in graphs.items()
    ):
        return False
    index = read_json_object(entries["index.json"].path)
    names = index.get("graphs") if index is not None else None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or set(names) != set(graphs):
        return False
    return all(_is_profile(Path(e.path)) for e in graphs.values())


def _is_estimate(directory: Path) -> bool:
    """estimate.json (teraio's key, naming its plans), hardware.json, a profile or profile-set in
    profile/, and exactly the plan files estimate.json names."""
    entries = _real_entries(directory)
    if entries is None or not {"estimate.json", "hardware.json", "profile"} <= set(entries):
        return False
    summary = read_json_object(entries["estimate.json"].path)
    if summary is None or not isinstance(summary.get(ESTIMATE_META_KEY), int):
        return False
    plans = summary.get("plan_files")
    if not isinstance(plans, list) or not all(isinstance(n, str) and _glob1(n, "plan-*.json") for n in plans):
        return False
    if set(entries) != {"estimate.json", "hardware.json", "profile", *plans}:
        return False
    files = [e for n, e in entries.items() if n != "profile"]
    if not all(e.is_file(follow_symlinks=False) for e in files):
        return False
    profile = entries["profile"]
    return profile.is_dir(follow_symlinks=False) and (
        _is_profile(Path(profile.path)) or _is_profile_set(Path(profile.path))
    )


def _matches_layout(directory: Path, kind: str) -> bool:
    """True if ``directory`` is a complete artefact of ``kind`` that teraio wrote: every file of the layout
    and nothing else (no links), and JSON content with teraio's own keys. A directory that merely holds
    files with teraio's names (a user's meta.json) is not one: replacing it would lose the user's data."""
    if kind == "profile":
        return _is_profile(directory)
    if kind == "profile-set":
        return _is_profile_set(directory)
    if kind == "estimate":
        return _is_estimate(directory)
    raise ValueError(f"unknown artefact kind {kind!r}")


def _glob1(name: str, pattern: str) -> bool:
    import fnmatch

    return fnmatch.fnmatchcase(name, pattern)


def artifact_kind(directory: str | os.PathLike) -> str | None:
    """The artefact kind of ``directory`` ("profile", "profile-set", "estimate") if it is a complete one
    teraio wrote.

    None for an empty directory, an incomplete layout, any file teraio would not have written, or a
    meta.json / index.json whose content is not teraio's.
    """
    d = Path(directory)
    if not d.is_dir() or d.is_symlink():
        return None
    for kind in ARTIFACT_LAYOUTS:
        if _matches_layout(d, kind):
            return kind
    return None


def check_output_dir(
    path: str | os.PathLike, kinds: tuple[str, ...], *, force: bool = False, option: str = "--out"
) -> Path:
    """Check now, before long work, that :func:`replace_dir` may write ``path``.

    Allowed: a missing path whose nearest existing ancestor is a writable directory, an empty
    directory, a teraio artefact of one of ``kinds``, or (with ``force``) any directory, which will be
    moved aside, not deleted.

    Raises:
        OutputError: naming the path and the remedy.
    """
    if os.fspath(path) == "":
        raise OutputError(f"{option} is an empty path; give a directory name")
    p = Path(path)
    if p.is_symlink():
        raise OutputError(f"{option} '{p}' is a symbolic link; give the real directory")
    if p.exists() and not p.is_dir():
        raise OutputError(f"{option} '{p}' exists and is not a directory; choose another name")
    probe = p if p.exists() else p.parent
    while not probe.exists():
        if probe == probe.parent:
            break
        probe = probe.parent
    if not probe.is_dir():
        raise OutputError(f"{option} '{p}' cannot be created: '{probe}' is a file, not a directory")
    parent = p.parent if p.exists() else probe
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{option} '{p}' is not writable (no write permission in '{parent}')")
    if p.exists() and any(p.iterdir()) and artifact_kind(p) not in kinds and not force:
        raise OutputError(
            f"{option} '{p}' is a non-empty directory that is not a teraio {' or '.join(kinds)}; choose "
            f"another directory, or pass --force to replace it (the old one is moved aside, not deleted)"
        )
    return p


def _remove_artifact(directory: Path, kind: str) -> bool:
    """Remove an artefact directory file by file (only layout names; never rmtree). True if it is gone."""
    if not _matches_layout(directory, kind):
        return False
    try:
        for e in os.scandir(directory):
            if e.is_dir(follow_symlinks=False):
                sub_kind = artifact_kind(e.path)
                if sub_kind is None or not _remove_artifact(Path(e.path), sub_kind):
                    return False
            else:
                os.unlink(e.path)
        os.rmdir(directory)
    except OSError:
        return False
    return True


def replace_dir(
    path: str | os.PathLike,
    kind: Literal["profile", "profile-set", "estimate"],
    populate: Callable[[Path], None],
    *,
    force: bool = False,
    option: str = "--out",
    replaceable: tuple[str, ...] | None = None,
) -> Path:
    """Build an artefact directory of ``kind`` with ``populate(tmp_dir)`` and rename it to ``path``.

    ``populate`` writes into a fresh private sibling directory (nothing else sees it half-written).
    An existing ``path`` is then replaced: an empty one or a teraio artefact of the same kind is
    removed file by file after the swap; any other directory needs ``force`` and is moved aside to
    ``<path>.replaced-<time>`` (logged, never deleted). ``replaceable`` lists the artefact kinds that
    may be replaced without ``force`` (default: ``kind`` only).

    Raises:
        OutputError: see :func:`check_output_dir`; also when populate writes an unexpected layout.
        OSError: the filesystem refused.
    """
    kinds = replaceable if replaceable is not None else (kind,)
    out = check_output_dir(path, kinds, force=force, option=option)
    out.parent.mkdir(parents=True, exist_ok=True)
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name[:40]}.", dir=out.parent))
    created_tmp = tmp
    try:
        populate(tmp)
        if not _matches_layout(tmp, kind):  # a bug in populate, not user input
            raise OutputError(f"internal: '{out}' would not be a valid {kind} layout")
        aside: Path | None = None
        if os.path.lexists(out):
            aside = out.parent / f".{out.name[:40]}.old-{secrets.token_hex(4)}"
            os.rename(out, aside)
        try:
            os.rename(tmp, out)
        except BaseException:
            if aside is not None:
                os.rename(aside, out)
            raise
        created_tmp = None
        _fsync_dir(out.parent)
        old_kind = artifact_kind(aside) if aside is not None else None
        if aside is not None and not (old_kind in kinds and _remove_artifact(aside, old_kind)):
            try:
                empty = not any(aside.iterdir())
            except OSError:
                empty = False
            if empty:
                os.rmdir(aside)
            else:
                # Not ours (the user passed --force): keep it, visibly, next to the new one.
                kept = out.parent / f"{out.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}"
                while os.path.lexists(kept):
                    kept = kept.with_name(kept.name + "-" + secrets.token_hex(2))
                os.rename(aside, kept)
                import logging

                logging.getLogger(__name__).warning("moved the previous '%s' aside to '%s'", out, kept)
    finally:
        if created_tmp is not None and created_tmp.exists():
            _remove_tree_we_created(created_tmp)
    return out


def _remove_tree_we_created(directory: Path) -> None:
    """Remove a temporary directory this process created with mkdtemp (nobody else can write in it: 0700)."""
    for root, dirs, files in os.walk(directory, topdown=False):
        for name in files:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(root, name))
        for name in dirs:
            p = os.path.join(root, name)
            with contextlib.suppress(OSError):
                if os.path.islink(p):
                    os.unlink(p)
                else:
                    os.rmdir(p)
    with contextlib.suppress(OSError):
        os.rmdir(directory)


# ------------------------------------------------------------------------------------------ inputs
class InputError(ValueError):
    """An input file cannot be read safely: missing, not a regular file (a FIFO, a device such as
    /dev/zero, a socket, a directory), larger than teraio reads, or not the JSON it should be. One line
    naming the file; loaders re-raise it as their own typed error (PlanError, HardwareError, ProfileError)."""


def read_input(path: str | os.PathLike, *, limit_nbytes: int, what: str = "input") -> bytes:
    """The bytes of the regular file ``path`` (links followed), at most ``limit_nbytes`` of them.

    Opened with ``O_NONBLOCK``, so a FIFO never blocks the open, then checked with ``fstat`` on the
    descriptor that is read: anything but a regular file is refused before a byte is read (a link to
    /dev/zero used to read without end, a FIFO blocked forever). Read with the limit, so a file that
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


# ------------------------------------------------------------------------------ private directories
class UnsafeDirError(OutputError):
    """A directory teraio writes into is not private to this user (another user's, writable by others),
    or a link or other file stands where one of teraio's directories belongs. One line naming it and
    what to do."""


_DIR_OPEN = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
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


def _lstat_entries(dir_fd: int) -> dict[str, os.stat_result] | None:
    """The entries of the open directory ``dir_fd`` by name, not following links; None if unreadable."""
    try:
        return {n: os.stat(n, dir_fd=dir_fd, follow_symlinks=False) for n in os.listdir(dir_fd)}
    except OSError:
        return None


def is_profile_at(dir_fd: int) -> bool:
    """:func:`_is_profile` for an open directory: exactly the three files, regular, teraio's meta.json."""
    entries = _lstat_entries(dir_fd)
    if entries is None or set(entries) != set(ARTIFACT_LAYOUTS["profile"]):
        return False
    if not all(stat.S_ISREG(st.st_mode) for st in entries.values()):
        return False
    meta = read_json_object("meta.json", dir_fd=dir_fd)
    return meta is not None and _meta_is_teraios(meta)


def _matches_layout_at(dir_fd: int, kind: str) -> bool:
    if kind == "profile":
        return is_profile_at(dir_fd)
    raise ValueError(f"unknown artefact kind {kind!r} for a directory held by descriptor")


def _matches_layout_at_name(parent_fd: int, name: str, kind: str) -> bool:
    try:
        fd = os.open(name, _DIR_OPEN | os.O_NOFOLLOW, dir_fd=parent_fd)
    except OSError:
        return False
    try:
        return _matches_layout_at(fd, kind)
    finally:
        os.close(fd)


def _empty_dir_at(parent_fd: int, name: str) -> bool:
    try:
        fd = os.open(name, _DIR_OPEN | os.O_NOFOLLOW, dir_fd=parent_fd)
    except OSError:
        return False
    try:
        return not os.listdir(fd)
    finally:
        os.close(fd)


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
