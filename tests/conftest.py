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
