"""The module map in docs/development.md is the newcomer's index of the code, so it must match the tree.

A map that omits modules or names ones that moved sends a reader to the wrong file (the README's old
Development tree omitted ``states/`` and 14 modules without anyone noticing). Here every Python module of
the three packages (but ``__init__`` and ``__main__``, which their folder's line covers) must have its own
line in the map, every package folder too, and every path the map names must exist.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
MAP_DOCUMENT = REPO_ROOT / "docs" / "development.md"
MAP_HEADING = "## The module map"
PACKAGES = ("teraio", "planner", "runtime")
# One entry per line: "- `path`: what it holds".
ENTRY = re.compile(r"^- `(?P<path>[^`]+)`:", re.MULTILINE)


def map_entries() -> list[str]:
    """The paths the module map names, in its order."""
    text = MAP_DOCUMENT.read_text()
    assert MAP_HEADING in text, f"{MAP_DOCUMENT.name} has no section {MAP_HEADING!r}"
    section = text.split(MAP_HEADING, 1)[1]
    section = re.split(r"^## ", section, maxsplit=1, flags=re.MULTILINE)[0]
    return [m.group("path") for m in ENTRY.finditer(section)]


def tree_modules() -> set[str]:
    """Every module of the three packages, as a repository path, and every package folder (with '/')."""
    found: set[str] = set()
    for package in PACKAGES:
        for path in (REPO_ROOT / package).rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            rel = path.relative_to(REPO_ROOT)
            if path.stem in ("__init__", "__main__"):
                found.add(rel.parent.as_posix() + "/")
            else:
                found.add(rel.as_posix())
    return found


def test_every_module_and_package_has_a_line_in_the_map() -> None:
    entries = set(map_entries())
    missing = sorted(tree_modules() - entries)
    assert not missing, f"modules or packages missing from the module map in docs/development.md: {missing}"


def test_every_path_in_the_map_exists_once() -> None:
    entries = map_entries()
    assert len(entries) >= 50, f"the module map was not found or lost most of its lines: {entries}"
    gone = [p for p in entries if not (REPO_ROOT / p).exists()]
    assert not gone, f"the module map names paths that do not exist: {gone}"
    folders = [p for p in entries if p.endswith("/") != (REPO_ROOT / p).is_dir()]
    assert not folders, f"write folders with a trailing '/' and files without one: {folders}"
    twice = sorted({p for p in entries if entries.count(p) > 1})
    assert not twice, f"paths with more than one line in the module map: {twice}"
