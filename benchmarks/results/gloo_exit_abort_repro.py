"""A gloo job that aborts at exit: ``terminate called without an active exception`` (SIGABRT).

One rank, five ``all_gather_object`` calls, ``destroy_process_group``, exit. With ``keep`` a reference to
the default group outlives ``destroy_process_group`` (as FSDP2's modules, a compiled model or, before the
fix, teraio's rank agreement hold one), so the group's gloo worker threads run on into the interpreter's
exit; a worker that drops the last reference to a collective's tensors made in Python then needs the GIL
after Python is gone. ``none`` holds no reference (``destroy_process_group`` destroys the group and joins
its threads); ``keep-barrier`` holds one but ends with ``dist.barrier()``.

    for i in $(seq 120); do rm -f /tmp/store; python gloo_exit_abort_repro.py /tmp/store keep || echo abort; done

Figures: docs/measured_facts.md, "From teraio/lifecycle/".
"""

from __future__ import annotations

import sys

import torch.distributed as dist

store, variant = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
keep = dist.group.WORLD if variant in ("keep", "keep-barrier") else None
for _ in range(5):
    out: list[object] = [None]
    dist.all_gather_object(out, {"x": list(range(100))})
if variant == "keep-barrier":
    dist.barrier()
dist.destroy_process_group()
