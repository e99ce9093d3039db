"""The phases a captured graph moves through, from its first call to the compilation it keeps.

A runner (:class:`teraio.lifecycle.runner.GraphRunner`) moves through them in one place, the backend's
``advance``, always at a forward call and never inside a backward:

- ``PROFILING``: its training forward and backward run through a timing interpreter
  (``teraio.profiling.op_timing``) for ``profile_steps`` complete forward+backward pairs (the first is
  warm-up), and with ``hardware="calibrate"`` on a short CPU step, ``teraio.profiling.transfer_probe.PROBE_STEPS``
  more that price moving tensors under the graph's own compute;
- ``PLANNING``: profiled; at the next forward the backend plans every profiled graph of the step
  together (one budget for the step: ``teraio.planner.budget_split``) and recompiles them;
- ``RUNNING``: the compiled graphs carry the plan's ``teraio::`` migration ops (or none: no budget,
  ``enabled=False``, or a shape beyond ``max_shapes``);
- ``INFERENCE``: a graph without a backward (under ``no_grad``/``inference_mode``, or no input requires
  grad) is compiled as it is; it is never profiled, planned or measured.
"""

from __future__ import annotations

from enum import Enum


class Phase(Enum):
    PROFILING = "profiling"
    PLANNING = "planning"
    RUNNING = "running"
    INFERENCE = "inference"
