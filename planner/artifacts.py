"""Recognising teraio's own artefact directories (profiles, profile sets, estimates) without trusting them.

teraio replaces an existing output directory only when it is empty or a complete artefact it wrote:
every file of the layout (:data:`ARTIFACT_LAYOUTS`) and nothing else, no links, and JSON content
carrying teraio's own keys (:data:`PROFILE_META_KEYS`, :data:`ESTIMATE_META_KEY`). A directory that
merely holds files with teraio's names (a user's meta.json) is not one: replacing it would lose the
user's data. Recognised by path (:func:`artifact_kind`) or, inside a directory held by a descriptor,
by descriptor (:func:`is_profile_at`).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from teraio.planner.safe_paths import _DIR_OPEN

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
