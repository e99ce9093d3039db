"""Which directories ``teraio.backend(run_dir=...)`` may write into.

A run directory receives ``config.json``, ``stats.jsonl`` and ``graphN/`` (``profile/``, ``plan.json``,
``trace.json``), and the backend replaces the ones a previous run left. So an existing, non-empty
directory is used only when it is recognisably a teraio run directory: its ``config.json`` is the one a
backend writes, or (a run directory whose config.json is gone) it holds nothing but ``graphN/``
directories of teraio's files and a ``stats.jsonl``, with at least one teraio profile among them.
Anything else (a project directory, a foreign ``config.json``) is refused with a one-line error before
anything is written, since teraio never overwrites what it did not create.

Pure Python (no torch): the CLI checks ``teraio demo --run-dir`` with it before a long run starts.
"""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path

from teraio.errors import UserInputError
from teraio.planner.safe_io import artifact_kind, read_json_object

#: Keys of the ``config.json`` a backend writes (the fields of ``BackendConfig``; a test keeps them so).
#: A config.json holding all of them is teraio's; any other config.json is the user's.
RUN_DIR_CONFIG_KEYS: tuple[str, ...] = (
    "memory_budget",
    "offload_dirs",
    "solver",
    "profile_steps",
    "inner",
    "run_dir",
)

#: What a backend writes inside a ``graphN/`` directory.
_GRAPH_ENTRIES = frozenset({"profile", "plan.json", "trace.json"})


def _is_teraio_config(path: Path) -> bool:
    config = read_json_object(path)  # not followed if it is a link
    return config is not None and all(k in config for k in RUN_DIR_CONFIG_KEYS)


def _is_teraio_graph_dir(path: Path) -> bool | None:
    """True: a graphN/ holding a teraio profile (and only teraio's files); False: something else is
    there; None: only teraio's names, but no profile to prove it."""
    try:
        entries = {e.name: e for e in os.scandir(path)}
    except OSError:
        return False
    if set(entries) - _GRAPH_ENTRIES or any(e.is_symlink() for e in entries.values()):
        return False
    for name in ("plan.json", "trace.json"):
        if name in entries and not entries[name].is_file(follow_symlinks=False):
            return False
    if "profile" not in entries:
        return None
    return artifact_kind(entries["profile"].path) == "profile"


def is_teraio_run_dir(path: str | os.PathLike) -> bool:
    """True if ``path`` is a directory a teraio backend wrote (see the module docstring)."""
    p = Path(path)
    if not p.is_dir():
        return False
    if (p / "config.json").exists() or (p / "config.json").is_symlink():
        return _is_teraio_config(p / "config.json")
    try:
        entries = list(os.scandir(p))
    except OSError:
        return False
    proven = False
    for e in entries:
        if e.name == "stats.jsonl" and e.is_file(follow_symlinks=False):
            continue
        if not (fnmatch.fnmatchcase(e.name, "graph*") and e.is_dir(follow_symlinks=False)):
            return False
        ok = _is_teraio_graph_dir(Path(e.path))
        if ok is False:
            return False
        proven = proven or bool(ok)
    return proven


def refuse_foreign_run_dir(path: str | os.PathLike | None, *, option: str = "run_dir") -> None:
    """Raise a one-line :class:`UserInputError` unless ``path`` may be used as a run directory: it is
    unset, missing (it will be created), an empty directory, or a teraio run directory.

    Raises:
        UserInputError: ``path`` is not a directory, or is a non-empty directory teraio did not write.
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
        empty = not any(p.iterdir())
    except OSError as exc:
        raise UserInputError(
            f"{option} '{p}' cannot be read ({exc.strerror}); choose another directory"
        ) from None
    if not empty and not is_teraio_run_dir(p):
        raise UserInputError(
            f"{option} '{p}' is not empty and is not a teraio run directory (no config.json written by "
            f"teraio); choose an empty or new directory, teraio does not overwrite files it did not write"
        )


__all__ = ["RUN_DIR_CONFIG_KEYS", "is_teraio_run_dir", "refuse_foreign_run_dir"]
