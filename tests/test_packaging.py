"""The package boundaries and the wheel's package list, checked on the source tree.

planner/ and runtime/ install as ``teraio.planner`` and ``teraio.runtime`` (setuptools package-dir
mapping in pyproject.toml). planner/ must stay pure (no torch, no teraio outside teraio.planner, no
runtime); runtime/ never imports the planner or teraio outside teraio.runtime. Both are checked twice:
on the source (every import statement, relative ones resolved) and by importing every module in a fresh
interpreter and looking at ``sys.modules`` (which also sees imports the source scan cannot). And every
folder with an ``__init__.py`` must be listed in pyproject's explicit ``packages``, or the wheel silently
lacks it.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[1]


def _imports(path: Path, package: str) -> list[tuple[int, str]]:
    """Absolute module names imported by ``path``, whose package is ``package`` (dotted).

    Relative imports are resolved against ``package`` as Python does (``from ..runtime import x`` in
    teraio.planner is teraio.runtime), so one cannot step around the boundary with dots; one that climbs
    above the top-level package is reported as ``<beyond the top-level package>``.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            parts = package.split(".")
            if node.level > len(parts):
                found.append((node.lineno, BEYOND_TOP))
                continue
            base = ".".join(parts[: len(parts) - node.level + 1])
            if node.module:
                found.append((node.lineno, f"{base}.{node.module}"))
            else:  # from .. import runtime: each name may be a module of ``base``
                found += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return found


BEYOND_TOP = "<beyond the top-level package>"


def _package_of(path: Path, folder: str, installed_as: str) -> str:
    """The dotted package ``path`` belongs to once ``folder`` is installed as ``installed_as``."""
    rel = path.parent.relative_to(REPO / folder).parts
    return ".".join((installed_as, *rel))


#: teraio's leaf modules: standard library only, importable from every package (DESIGN: code both the
#: planner and the runtime need lives once, in a leaf module both may import).
LEAF_MODULES = ("teraio.sizes",)


def _violations(folder: str, allowed_own: str, forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for path in sorted((REPO / folder).rglob("*.py")):
        for lineno, mod in _imports(path, _package_of(path, folder, allowed_own)):
            top = mod.split(".")[0]
            if mod == allowed_own or mod.startswith(allowed_own + ".") or mod in LEAF_MODULES:
                continue
            if mod == BEYOND_TOP or top in forbidden or top == "teraio":  # teraio outside its own subpackage
                bad.append(f"{path.relative_to(REPO)}:{lineno} imports {mod}")
    return bad


def test_planner_imports_neither_torch_nor_runtime_nor_teraio():
    assert _violations("planner", "teraio.planner", ("torch", "runtime", "planner")) == []


def test_runtime_imports_neither_planner_nor_teraio():
    assert _violations("runtime", "teraio.runtime", ("planner", "runtime")) == []


def test_boundary_scan_catches_a_violation(tmp_path, monkeypatch):
    """The scan itself can fail: a planted forbidden import is reported, relative ones too."""
    pkg = tmp_path / "planner"
    (pkg / "solvers").mkdir(parents=True)
    (pkg / "bad.py").write_text(
        "import torch\nfrom teraio.runtime.engine import Engine\nfrom teraio.planner import plan\n"
        "from ..runtime import engine\nfrom .. import runtime, lifecycle\nfrom . import plan\n"
        "from .plan import Plan\nfrom ... import anything\n"
    )
    (pkg / "solvers" / "bad.py").write_text("from ...runtime.engine import Engine\nfrom ..plan import Plan\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    bad = _violations("planner", "teraio.planner", ("torch", "runtime", "planner"))
    assert bad == [
        "planner/bad.py:1 imports torch",
        "planner/bad.py:2 imports teraio.runtime.engine",
        "planner/bad.py:4 imports teraio.runtime",
        "planner/bad.py:5 imports teraio.runtime",
        "planner/bad.py:5 imports teraio.lifecycle",
        f"planner/bad.py:8 imports {BEYOND_TOP}",
        "planner/solvers/bad.py:1 imports teraio.runtime.engine",
    ]


def _room_imports(room: str) -> list[tuple[str, int, str]]:
    """Every module ``teraio/<room>`` imports: (file, line, module), relative imports resolved."""
    out = []
    for path in sorted((REPO / "teraio" / room).rglob("*.py")):
        package = ".".join(("teraio", *path.parent.relative_to(REPO / "teraio").parts))
        out += [(str(path.relative_to(REPO)), line, mod) for line, mod in _imports(path, package)]
    return out


@pytest.mark.parametrize("room", ["graph", "profiling", "platform"])
def test_graph_profiling_and_platform_rooms_never_import_the_lifecycle_room(room):
    """Graph surgery and measurement are handed what they need; they never reach into the backend."""
    assert (REPO / "teraio" / room / "__init__.py").exists()
    bad = [
        f"{path}:{line} imports {mod}"
        for path, line, mod in _room_imports(room)
        if mod == "teraio.lifecycle" or mod.startswith("teraio.lifecycle.")
    ]
    assert bad == []


def test_the_room_scan_sees_lifecycle_imports():
    """The room scan can fail: the lifecycle room itself is seen importing its own modules."""
    assert any(mod.startswith("teraio.lifecycle.") for _, _, mod in _room_imports("lifecycle"))


# What each side may not load at import time, whatever the route (lazy imports inside functions are
# the files' business; an import at module level that pulls the other side in is a boundary break).
_LOAD = "import importlib, json, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\nprint(json.dumps(sorted(sys.modules)))"


def _modules_of(folder: str, installed_as: str) -> list[str]:
    names = []
    for path in sorted((REPO / folder).rglob("*.py")):
        parts = path.relative_to(REPO / folder).with_suffix("").parts
        names.append(".".join((installed_as, *(parts[:-1] if parts[-1] == "__init__" else parts))))
    return names


def _loaded_by_importing(modules: list[str], cwd: Path) -> list[str]:
    # Run outside the source tree: the folders planner/ and runtime/ must not be importable by those names.
    out = subprocess.run(
        [sys.executable, "-c", _LOAD, *modules], capture_output=True, text=True, timeout=300, cwd=cwd
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _under(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_importing_the_planner_loads_neither_torch_nor_the_runtime(tmp_path):
    modules = _modules_of("planner", "teraio.planner")
    assert "teraio.planner.solve" in modules and "teraio.planner.simulate" in modules
    loaded = _loaded_by_importing(modules, tmp_path)
    assert set(modules) <= set(loaded)
    bad = [
        m
        for m in loaded
        if _under(m, "torch", "planner", "runtime")
        or (_under(m, "teraio") and m not in ("teraio", *LEAF_MODULES) and not _under(m, "teraio.planner"))
    ]
    assert bad == []


def test_importing_the_runtime_does_not_load_the_planner(tmp_path):
    modules = _modules_of("runtime", "teraio.runtime")
    loaded = _loaded_by_importing(modules, tmp_path)
    assert set(modules) <= set(loaded) and "torch" in loaded  # the check sees what was imported
    bad = [
        m
        for m in loaded
        if _under(m, "planner", "runtime")
        or (_under(m, "teraio") and m not in ("teraio", *LEAF_MODULES) and not _under(m, "teraio.runtime"))
    ]
    assert bad == []


@pytest.mark.parametrize("leaf", LEAF_MODULES)
def test_a_leaf_module_imports_only_the_standard_library(leaf):
    path = REPO / (leaf.replace(".", "/") + ".py")
    mods = {m.split(".")[0] for _, m in _imports(path, leaf.rpartition(".")[0])}
    assert mods and mods <= set(sys.stdlib_module_names) | {"__future__"}, sorted(mods)


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


PRESETS = ("a100-40g-g10", "cpu-local", "h100-nvl-4x990pro", "h100-sxm-1ssd")


def test_the_installed_package_finds_the_hardware_presets(tmp_path):
    """``pip install -e`` (the dev install): the presets load through importlib.resources from outside
    the source tree."""
    code = (
        "import json\nfrom teraio.planner.costmodel import load_preset, preset_names\n"
        "print(json.dumps([preset_names(), load_preset('h100-nvl-4x990pro').hardware.tier('ssd').count]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    names, count = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(PRESETS) <= set(names) and count == 4


def test_a_built_wheel_carries_the_hardware_presets(tmp_path):
    """pyproject's package-data: a wheel built from the sources holds every preset (a copy of the tree is
    built, so the worktree gets no build/ directory)."""
    import shutil
    import zipfile

    src = tmp_path / "src"
    src.mkdir()
    for name in ("teraio", "planner", "runtime"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    dist = tmp_path / "dist"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(dist),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    (wheel,) = dist.glob("teraio-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"teraio/planner/presets/{p}.json" for p in PRESETS} <= names
