"""Shared test set-up: deterministic torch, no stale compile caches, small thread counts for 2 cores.

``TERAIO_CHECK_OWN_PLANS=1``: every ILP solve anywhere in the suite (the planner tests, the backend's
end-to-end runs, the CLI in-process and in subprocesses, which inherit this environment, the benchmark
smoke tests) checks each solution of its model against the simulator before any fallback can hide it,
and raises SolverBugError when one is over budget or disagrees with the simulated step beyond the
documented rounding (``planner/solvers/ilp.py``).
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ["TERAIO_CHECK_OWN_PLANS"] = "1"


# Note: [The longest tests start first]
#     On two xdist workers the suite ends when the slower worker does. A long test that starts last (the
#     README's blocks, `make demo` and two torchrun jobs among them, run together on the first block's test:
#     3-5 minutes) leaves the other worker idle for its whole length; started first, it runs beside
#     everything else. So the collection is reordered: each document's first block first, then the
#     modules with Inductor compiles, subprocess jobs and big solves, then the rest in file order, and the
#     documents' other tests (which read the first one's outcomes) last. The Makefile passes
#     `--maxschedchunk 1` so that xdist hands tests out two at a time instead of in chunks of an eighth of
#     the collection, which pinned long stretches of file order to one worker. A module's tests stay
#     contiguous in the order; the order is the same on every worker, as xdist requires.
HEAVY_MODULES = (
    "tests/teraio/test_inductor.py",
    "tests/teraio/test_loops.py",
    "tests/test_bench_e2e_smoke.py",
    "tests/teraio/test_cli_demo.py",
    "tests/teraio/test_distributed.py",
    "tests/teraio/test_user_loops.py",
    "tests/teraio/test_params_offload.py",
    "tests/planner/test_ilp.py",
    "tests/teraio/test_probe.py",
    "tests/teraio/test_backend_safety.py",
    "tests/teraio/test_states.py",
    "tests/teraio/test_recompute.py",
    "tests/teraio/test_offload_e2e.py",
    "tests/teraio/test_lifecycle.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    first_block: dict[str, object] = {}
    for item in items:
        if item.nodeid.startswith("tests/test_readme.py::test_block_runs["):
            document = item.nodeid.split("[", 1)[1].rsplit(":", 1)[0]
            first_block.setdefault(document, item)
    starters = set(map(id, first_block.values()))

    def rank(item) -> tuple[int, int]:
        if id(item) in starters:
            return (0, 0)
        path = item.nodeid.split("::", 1)[0]
        if path == "tests/test_readme.py":
            return (3, 0)
        if path in HEAVY_MODULES:
            return (1, HEAVY_MODULES.index(path))
        return (2, 0)

    items.sort(key=rank)  # stable: file order within each rank
