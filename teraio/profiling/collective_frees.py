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
    ``FSDP::all_gather`` span, just before the ``c10d::`` op that hands it to the work, and FSDP2 holds its
    own reference through the copy-out at least (Note: [FSDP2 holds its all-gather output past the
    work]); in 2-rank runs of the whole state on disk a measured step carried that block once more (50 KB
    on 365 KB) in about one run of three, never with the free recorded. So the allocations of that span
    count as the collective's. (Its ``FSDP::all_gather_copy_out`` sibling
    allocates the gathered parameters, which FSDP2 frees itself, on the calling thread.)

Note: [FSDP2 holds its all-gather output past the work]
    Unlike a buffer made inside the ``c10d::`` op, FSDP2's flat all-gather output is also held by FSDP2
    itself, past the work: after its own copy-out at the least, and in forward (its synchronous
    all-gather) until the next group's copy-out or the end of the root's forward (``all_gather_state``).
    FSDP2 lets go on the calling thread, so the free is normally recorded there. It goes unrecorded only
    when the worker still holds the work then (it finished its span but had not yet dropped the work: a
    thread kept off the cores on a loaded machine): the worker frees it later, and never before FSDP2 let
    go. Freed at the end of the worker's span, the last block's gathered parameters were missing from
    the measured step at the end of the forward (docs/measured_facts.md, "From teraio/profiling/").
    So the unseen free of an all-gather output is placed where FSDP2 lets go: in backward, at the end of
    its own copy-out; in forward, at the first of the next ``FSDP::all_gather_copy_out`` of another group
    and the end of the root's ``FSDP::post_forward`` (at the end of its own copy-out where neither is in
    the record, and never before the worker's span ends). Holding a backward output to the end of its
    ``FSDP::pre_backward`` instead counted it beside the next block's prefetched output, one block too
    many.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass
from typing import Protocol

#: The record functions of the process group's collective ops on the calling thread.
COLLECTIVE_OP_PREFIX = "c10d::"
#: FSDP2's span around an all-gather that allocates the work's output (``FSDP::all_gather (fqn)``).
FSDP_ALL_GATHER_SPAN = "FSDP::all_gather"
#: FSDP2's spans on the calling thread that bound when it lets go of an all-gather output (Note: [FSDP2
#: holds its all-gather output past the work]): its copy-outs, the root's end of forward, the pre-backwards.
FSDP_COPY_OUT_SPAN = "FSDP::all_gather_copy_out"
FSDP_ROOT_POST_FORWARD_SPAN = "FSDP::post_forward"
FSDP_PRE_BACKWARD_SPAN = "FSDP::pre_backward"
FSDP_RELEASE_SPAN_PREFIXES = (FSDP_COPY_OUT_SPAN, FSDP_ROOT_POST_FORWARD_SPAN, FSDP_PRE_BACKWARD_SPAN)


def is_fsdp_all_gather_span(name: str) -> bool:
    return name == FSDP_ALL_GATHER_SPAN or name.startswith(FSDP_ALL_GATHER_SPAN + " (")


def is_collective_span(name: str) -> bool:
    """Whether allocations under the record function ``name`` are buffers a collective's work holds."""
    return name.startswith(COLLECTIVE_OP_PREFIX) or is_fsdp_all_gather_span(name)


def _group(name: str) -> str:
    """The module an FSDP2 span names (``FSDP::all_gather (gpt.blocks.1)``: ``gpt.blocks.1``; the root's
    spans name none)."""
    return name[name.index(" (") + 2 : -1] if name.endswith(")") and " (" in name else ""


@dataclass(frozen=True)
class FsdpSpan:
    """An FSDP2 span that bounds when FSDP2 lets go of an all-gather output, on the calling thread."""

    name: str
    start_ns: int
    end_ns: int


def is_fsdp_release_span(name: str) -> bool:
    # A module's own post-forward lets go of nothing: only the root's (which names no module) does.
    return name.startswith(FSDP_RELEASE_SPAN_PREFIXES) and not name.startswith(
        FSDP_ROOT_POST_FORWARD_SPAN + " ("
    )


def fsdp_release_ns(alloc_ns: int, gather_span: str, spans: list[FsdpSpan]) -> int | None:
    """Note: [FSDP2 holds its all-gather output past the work]: when FSDP2 lets go of the output its
    all-gather ``gather_span`` allocated at ``alloc_ns``. None: not in the record."""
    group = _group(gather_span)
    own = min(
        (
            sp
            for sp in spans
            if sp.name.startswith(FSDP_COPY_OUT_SPAN) and _group(sp.name) == group and sp.start_ns >= alloc_ns
        ),
        key=lambda sp: sp.start_ns,
        default=None,
    )
    if own is None:
        return None
    if any(
        sp.name.startswith(FSDP_PRE_BACKWARD_SPAN) and sp.start_ns <= own.start_ns and sp.end_ns >= own.end_ns
        for sp in spans
    ):
        return own.end_ns  # in backward FSDP2 lets go right after the copy-out
    moments = []
    for sp in spans:
        if sp.name.startswith(FSDP_COPY_OUT_SPAN):
            if sp.start_ns >= own.end_ns:  # the next unshard's: the previous forward output goes before it
                moments.append(sp.start_ns)
        elif sp.name == FSDP_ROOT_POST_FORWARD_SPAN and sp.end_ns >= own.end_ns:
            moments.append(sp.end_ns)
    return min(moments, default=own.end_ns)  # the own copy-out's end where nothing follows it


#: The spans in which a process group's worker thread runs a work (gloo's; NCCL's buffers are on the
#: device, measured by the allocator, not the profiler).
WORKER_SPAN_PREFIXES = ("gloo:",)


class Event(Protocol):
    ts_ns: int
    ptr: int
    nbytes: int


def unseen_frees(
    events: list[Event],
    collective_allocations: list[Event],
    worker_spans: list[tuple[int, int]],
    fsdp_outputs: dict[tuple[int, int], str] | None = None,
    fsdp_spans: list[FsdpSpan] | None = None,
) -> list[tuple[int, int, int]]:
    """The frees (time, address, -bytes) of ``collective_allocations`` the record lacks.

    ``events`` are every allocation and free of the region in time order (``collective_allocations``
    among them); ``worker_spans`` the (start, end) times of the worker spans; ``fsdp_outputs`` the
    allocations (time, address) FSDP2 made as all-gather outputs, with their ``FSDP::all_gather`` span's
    name, and ``fsdp_spans`` FSDP2's spans that bound when it lets go of them (Note: [FSDP2 holds its
    all-gather output past the work])."""
    by_ptr: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for e in events:
        by_ptr[e.ptr].append((e.ts_ns, e.nbytes))
    spans = sorted(worker_spans)
    starts = [s for s, _ in spans]
    held = fsdp_outputs or {}
    released_by = fsdp_spans or []
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
        gather = held.get((a.ts_ns, a.ptr))
        if gather is not None:
            let_go = fsdp_release_ns(a.ts_ns, gather, released_by)
            if let_go is not None:
                end_ns = max(end_ns, let_go)
        if following is not None and following[0] <= end_ns:
            continue  # its address was reused first: freed by then (Note: [A reused address was freed])
        out.append((end_ns, a.ptr, -a.nbytes))
    return out
