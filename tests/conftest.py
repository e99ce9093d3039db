"""Shared test set-up: deterministic torch, no stale compile caches, small thread counts for 2 cores.

``TERAIO_CHECK_OWN_PLANS=1``: every ILP solve anywhere in the suite (the planner tests, the backend's
end-to-end runs, the CLI in-process and in subprocesses, which inherit this environment, the benchmark
smoke tests) checks each solution of its model against the simulator before any fallback can hide it,
and raises SolverBugError when one is over budget or disagrees with the simulated step beyond the
documented rounding (``planner/solvers/ilp.py``).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

# Note: [Compile caches in the suite]
#     No compile may be served from another compile of a graph or a plan (docs/measured_facts.md, hazard
#     3): the FX graph cache is off by default, and with it the AOTAutograd cache, whose entries point at
#     FX graph cache entries (teraio turns both off for its own compiles anyway: teraio/graph/compilers.py);
#     Dynamo's profile-guided dynamism is off. What stays on are the caches keyed by the generated code
#     itself: Inductor's C++ kernels and wrapper modules, compiled once per source text instead of once
#     per compile. With TORCHINDUCTOR_FORCE_DISABLE_CACHES=1, every compile built every kernel again with
#     gcc: a reference run with ``enabled=False`` and the run with the plan compile the same kernels (the
#     tests assert it), and so do the two ranks of a torchrun job. They live in a directory of this run
#     only (shared by its xdist workers and subprocesses, which inherit this environment) that is removed
#     at its end, so nothing from another run or checkout is ever served. This overrides a blanket
#     TORCHINDUCTOR_FORCE_DISABLE_CACHES in the environment; TERAIO_TEST_FRESH_COMPILES=1 restores it
#     (every cache off, every kernel compiled again), e.g. to reproduce the last-bit differences between
#     separate compiles seen only that way (benchmarks/results/gan_two_backends_crash_202611.md).
if os.environ.get("TERAIO_TEST_FRESH_COMPILES") == "1":
    os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"
else:
    os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "0"
    os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE_DEFAULT"] = "0"  # a default: compile_caches_on lifts it
    os.environ["TORCH_DYNAMO_AUTOMATIC_DYNAMIC_LOCAL_PGO"] = "0"
    if "TERAIO_TEST_INDUCTOR_CACHE_DIR" not in os.environ:  # set: an xdist worker of this run
        _cache_dir = tempfile.mkdtemp(prefix="teraio-test-inductor-")
        atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
        os.environ["TERAIO_TEST_INDUCTOR_CACHE_DIR"] = _cache_dir
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.environ["TERAIO_TEST_INDUCTOR_CACHE_DIR"]
# Note: [One compute thread per test worker]
#     Each xdist worker would run torch's intra-op pool (and Inductor's C++ kernels' OpenMP) with a
#     thread per core, so two workers on 2 cores run four busy threads that wait on each other; with the
#     cores shared out instead, tests measured back to back ran about 20% faster (tests/teraio/test_loops.py:
#     122 s against 97 s; the whole-step budget and planner tests 151 s against 124 s). The environment carries it to
#     the subprocesses (torchrun jobs, the CLI, the README's blocks); a thread count already set wins.
#     No test compares across processes with different counts: a reference and its run share one.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _workers))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ["TERAIO_CHECK_OWN_PLANS"] = "1"


# Note: [The longest tests start first]
#     On two xdist workers the suite ends when the slower worker does. A long test that starts last (the
#     documents' blocks, `make demo` (README) and two torchrun jobs (docs/guide.md) among them, run together on the first block's test:
#     3-5 minutes) leaves the other worker idle for its whole length; started first, it runs beside
#     everything else. So the collection is reordered: each document's first block first (the first that
#     runs: a skip-marked block's test never runs its document), then the
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
    "tests/teraio/test_backend_compile.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    first_block: dict[str, object] = {}
    for item in items:
        if item.nodeid.startswith("tests/test_readme.py::test_block_runs["):
            # A skip-marked first block left docs/guide.md to its other tests, last: one worker ran it
            # (108 s) while the other waited on its lock (100 s).
            if item.callspec.params["block"].skip_reason is not None:
                continue
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


# Note: [A module's shared runs stay on one worker]
#     xdist deals the tests out one by one as its workers free up, so the tests of one module alternate
#     between the two workers. A module fixture then runs on each worker that runs one of its tests (an
#     Inductor reference and a planned run twice: test_inductor.py's took 76 s on one worker and 33 s on
#     the other), and a run shared through ``tests.teraio.shared.once_per_run`` leaves the second worker
#     waiting on its file lock while the first computes it (test_distributed.py's DDP jobs: 26 s idle).
#     The modules below each share such runs among their tests: their tests are handed out together, as
#     one chunk, to whichever worker asks first. Nothing else changes: the order is the collection's
#     (Note: [The longest tests start first]) and every other test is dealt out one at a time.
#     test_module_groups.py fails when a module of tests/ shares a fixture or a run and is not listed.
SHARED_RUN_MODULES = frozenset(
    {
        "tests/test_notebooks.py",
        "tests/teraio/test_checkpoints.py",
        "tests/teraio/test_cli_estimate.py",
        "tests/teraio/test_cli_fuzz.py",
        "tests/teraio/test_distributed.py",
        "tests/teraio/test_estimate.py",
        "tests/teraio/test_frozen_params.py",
        "tests/teraio/test_inductor.py",
        "tests/teraio/test_offload_e2e.py",
        "tests/teraio/test_offloaded_reads.py",
        "tests/teraio/test_overlapped_step.py",
        "tests/teraio/test_partitioner_search.py",
        "tests/teraio/test_per_call_plans.py",
        "tests/teraio/test_recompute.py",
        "tests/teraio/test_states.py",
        "tests/teraio/test_whole_step.py",
    }
)


def shared_run_group(nodeid: str) -> str | None:
    """The module whose tests go to one worker together, or None for a test dealt out on its own."""
    path = nodeid.split("::", 1)[0]
    return path if path in SHARED_RUN_MODULES else None


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: -p no:xdist
def pytest_xdist_make_scheduler(config, log):
    """xdist's load scheduling, with the tests of each module of SHARED_RUN_MODULES sent as one chunk
    (Note: [A module's shared runs stay on one worker]). Other --dist modes are xdist's own."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScheduling

    class SharedRunsTogether(LoadScheduling):
        def _send_tests(self, node, num: int) -> None:
            if 0 < num < len(self.pending):
                group = shared_run_group(self.collection[self.pending[num - 1]])
                while (
                    group is not None
                    and num < len(self.pending)
                    and shared_run_group(self.collection[self.pending[num]]) == group
                ):
                    num += 1
            super()._send_tests(node, num)

    return SharedRunsTogether(config, log)


# Note: [Each test starts with the same environment]
#     Library code that tests run in-process may set environment variables for the rest of the process:
#     ``teraio.cli.main`` sets THP_MEM_ALLOC_ENABLE=1 (torch reads it at its first allocation, long past in
#     a worker, but every subprocess a later test starts inherits it, and reads fetched tensors on another
#     path), ``teraio estimate`` sets HF_HUB_OFFLINE. What a test sees must not depend on which tests its
#     xdist worker ran before, so each variable a test added, changed or removed is put back after it
#     (only those: the rest of the environment is never rewritten under threads that may read it).
@pytest.fixture(autouse=True)
def environment_put_back() -> Iterator[None]:
    before = dict(os.environ)
    yield
    for name in [n for n in os.environ if n not in before]:
        del os.environ[name]
    for name, value in before.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


@pytest.fixture
def fake_device():
    """A fake asynchronous device (teraio.runtime.fake_device) whose streams are let go and closed after
    the test, which fails if queued work raised (``errors``)."""
    from teraio.runtime.fake_device import FakeDevice

    dev = FakeDevice()
    yield dev
    dev.resume()
    dev.close()
    assert not dev.errors, dev.errors
