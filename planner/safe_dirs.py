"""Output directories (profiles, profile sets, estimates) built aside and renamed into place.

:func:`replace_dir` builds the artefact in a fresh sibling directory, so nothing sees it half-written,
and renames it over the target. An existing target is replaced only when it is empty or a complete
teraio artefact of an allowed kind (:mod:`planner.artifacts`), which is then removed file by file;
anything else needs ``force`` and is moved aside, never deleted, so teraio never removes a file it did
not write. :func:`check_output_dir` runs the same checks before long work.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from teraio.planner.artifacts import _matches_layout, artifact_kind
from teraio.planner.safe_paths import OutputError, _fsync_dir


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

                # Logged under the safe writer's name, the one users' log filters know.
                logging.getLogger("teraio.planner.safe_io").warning(
                    "moved the previous '%s' aside to '%s'", out, kept
                )
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
