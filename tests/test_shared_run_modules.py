"""The suite's own scheduling: modules that share runs among their tests are dealt to one xdist worker.

Note: [A module's shared runs stay on one worker] in tests/conftest.py. A module added later with a module
fixture or a ``once_per_run`` result, and not listed there, would again compute it on both workers (or
leave one waiting on the other): this test names it.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import SHARED_RUN_MODULES, shared_run_group

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARES_RUNS = re.compile(r"@pytest\.fixture\(scope=\"(module|session)\"|\bonce_per_run\(")
# Modules whose module fixtures take milliseconds: computing them on both workers costs nothing.
CHEAP_MODULE_FIXTURES = {
    "tests/planner/test_synth.py": "a synthetic profile from shapes only",
    "tests/planner/test_whatif.py": "a synthetic profile from shapes only",
    "tests/test_readme.py": "its session fixture runs each document once per run under a file lock, and "
    "the documents' first blocks are dealt out on their own so that they start first",
}


def test_every_module_sharing_runs_is_dealt_to_one_worker() -> None:
    modules = sorted(str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "tests").rglob("test_*.py"))
    sharing = [m for m in modules if SHARES_RUNS.search((REPO_ROOT / m).read_text())]
    assert "tests/teraio/test_inductor.py" in sharing  # the pattern still finds what it is for
    missing = [m for m in sharing if m not in SHARED_RUN_MODULES and m not in CHEAP_MODULE_FIXTURES]
    assert not missing, f"add these to SHARED_RUN_MODULES in tests/conftest.py: {missing}"
    gone = sorted(SHARED_RUN_MODULES - set(modules))
    assert not gone, f"SHARED_RUN_MODULES names modules that no longer exist: {gone}"


def test_a_group_is_its_module() -> None:
    assert shared_run_group("tests/teraio/test_inductor.py::test_x[a]") == "tests/teraio/test_inductor.py"
    assert shared_run_group("tests/teraio/test_loops.py::test_fx_matrix[gpt-all]") is None
