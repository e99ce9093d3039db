"""The package boundaries and the wheel's package list, checked on the source tree.

planner/ and runtime/ install as ``teraio.planner`` and ``teraio.runtime`` (setuptools package-dir
mapping in pyproject.toml). planner/ must stay pure (no torch, no teraio outside teraio.planner, no
runtime); runtime/ never imports the planner or teraio outside teraio.runtime. And every folder with an
``__init__.py`` must be listed in pyproject's explicit ``packages``, or the wheel silently lacks it.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> list[tuple[int, str]]:
    """Absolute module names imported by ``path`` (relative imports resolve inside its own package)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def _violations(folder: str, allowed_own: str, forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for path in sorted((REPO / folder).rglob("*.py")):
        for lineno, mod in _imports(path):
            top = mod.split(".")[0]
            if mod == allowed_own or mod.startswith(allowed_own + "."):
                continue
            if top in forbidden or top == "teraio":  # teraio outside the folder's own subpackage
                bad.append(f"{path.relative_to(REPO)}:{lineno} imports {mod}")
    return bad


def test_planner_imports_neither_torch_nor_runtime_nor_teraio():
    assert _violations("planner", "teraio.planner", ("torch", "runtime", "planner")) == []


def test_runtime_imports_neither_planner_nor_teraio():
    assert _violations("runtime", "teraio.runtime", ("planner", "runtime")) == []


def test_boundary_scan_catches_a_violation(tmp_path, monkeypatch):
    """The scan itself can fail: a planted forbidden import is reported."""
    pkg = tmp_path / "planner"
    pkg.mkdir()
    (pkg / "bad.py").write_text(
        "import torch\nfrom teraio.runtime.engine import Engine\nfrom teraio.planner import plan\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    bad = _violations("planner", "teraio.planner", ("torch", "runtime", "planner"))
    assert bad == ["planner/bad.py:1 imports torch", "planner/bad.py:2 imports teraio.runtime.engine"]


def test_pyproject_lists_every_package_folder():
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    dirs = cfg["package-dir"]
    expected = set()
    for name, folder in dirs.items():
        root = REPO / folder
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root).parts
            expected.add(".".join((name, *rel)))
    assert expected, "no packages found: package-dir changed?"
    missing = sorted(expected - listed)
    assert missing == [], (
        f"pyproject [tool.setuptools] packages lacks {missing}: they would not be in the wheel"
    )
    stale = sorted(p for p in listed if p not in expected)
    assert stale == [], f"pyproject lists packages without an __init__.py: {stale}"
