"""The built-in solvers. Importing this package registers all of them with ``planner.solve``.

The ILP solver lives in its own module; it is imported when present so the registry is complete
whatever was imported first.
"""

from __future__ import annotations

import importlib.util

from teraio.planner.solvers import baselines, greedy, pipeline

__all__ = ["baselines", "greedy", "pipeline"]

if importlib.util.find_spec("teraio.planner.solvers.ilp") is not None:
    from teraio.planner.solvers import ilp  # noqa: F401

    __all__.append("ilp")
