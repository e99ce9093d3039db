"""When a collective's buffer was freed, where the profiler did not see the free.

Note: [A collective's buffer freed on its worker thread]
    A gloo collective issued with ``async_op=True`` (FSDP2's reduce-scatter and all-gather) allocates
    its buffers on the calling thread, inside the ``c10d::`` op (the reduce-scatter clones its whole
    input: one block's gradients), and hands them to the work object, which the process group's worker
    thread runs (a ``gloo:`` span on that thread). The buffer is freed when the last reference to the
    work goes: by the caller's ``wait()`` if the worker finished first, which the profiler records; by
    the worker right after its span, if the caller waited first, which it does not (the profiler
    records the threads it was enabled on, and the worker is not one of them outside its spans). Which
    of the two happens is a race. Unseen, the free made the buffer look alive until its address was
    reused (Note: [A reused address was freed] in teraio.profiling.measure): rarely (in a CI run of the
    2-rank FSDP2 test, two of its measured steps; none of 170 measured steps here), the measured step
    peak then carried one more block of gradients (50 KB on a prediction of 360 KB: 14% above it).
    The unseen free is the worker's, right after the span that ran the work: so a buffer allocated in a
    ``c10d::`` op and never freed in the record is freed at the end of the first worker span that starts
    after it, unless its address is reused before then.

    FSDP2's all-gather output is the same race one level up: ``foreach_all_gather`` allocates the flat
    output (the whole block's gathered parameters, this rank's shard its input) inside its
    ``FSDP::all_gather`` span, just before the ``c10d::`` op that hands it to the work, and FSDP2 drops its
    own reference after the copy-out; in 2-rank runs of the whole state on disk a measured step carried
    that block once more (50 KB on 365 KB) in about one run of three, never with the free recorded. So
    the allocations of that span count as the collective's. (Its ``FSDP::all_gather_copy_out`` sibling
    allocates the gathered parameters, which FSDP2 frees itself, on the calling thread.)
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from typing import Protocol

#: The record functions of the process group's collective ops on the calling thread.
COLLECTIVE_OP_PREFIX = "c10d::"
#: FSDP2's span around an all-gather that allocates the work's output (``FSDP::all_gather (fqn)``).
FSDP_ALL_GATHER_SPAN = "FSDP::all_gather"


def is_collective_span(name: str) -> bool:
    """Whether allocations under the record function ``name`` are buffers a collective's work holds."""
    return name.startswith(COLLECTIVE_OP_PREFIX) or (
        name == FSDP_ALL_GATHER_SPAN or name.startswith(FSDP_ALL_GATHER_SPAN + " (")
    )


#: The spans in which a process group's worker thread runs a work (gloo's; NCCL's buffers are on the
#: device, measured by the allocator, not the profiler).
WORKER_SPAN_PREFIXES = ("gloo:",)


class Event(Protocol):
    ts_ns: int
    ptr: int
    nbytes: int


def unseen_frees(
    events: list[Event], collective_allocations: list[Event], worker_spans: list[tuple[int, int]]
) -> list[tuple[int, int, int]]:
    """The frees (time, address, -bytes) of ``collective_allocations`` the record lacks.

    ``events`` are every allocation and free of the region in time order (``collective_allocations``
    among them); ``worker_spans`` the (start, end) times of the worker spans."""
    by_ptr: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for e in events:
        by_ptr[e.ptr].append((e.ts_ns, e.nbytes))
    spans = sorted(worker_spans)
    starts = [s for s, _ in spans]
    out: list[tuple[int, int, int]] = []
    for a in collective_allocations:
        at_ptr = by_ptr[a.ptr]
        i = bisect.bisect_right(at_ptr, (a.ts_ns, a.nbytes))
        following = at_ptr[i] if i < len(at_ptr) else None
        if following is not None and following[1] < 0:
            continue  # its free was recorded
        j = bisect.bisect_left(starts, a.ts_ns)
        if j == len(spans):
            continue  # no work ran after it in the region: alive to its end, as recorded
        end_ns = spans[j][1]
        if following is not None and following[0] <= end_ns:
            continue  # its address was reused first: freed by then (Note: [A reused address was freed])
        out.append((end_ns, a.ptr, -a.nbytes))
    return out
