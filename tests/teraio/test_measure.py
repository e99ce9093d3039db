"""Memory measurement counts a region's own allocations only (Note: [Only the region's own allocations]).

A free inside an op's span of memory allocated before the span (the garbage collector reclaiming
earlier values) must not count as the op's transient bytes: counting it raised a tiny model's floor
by 80 KiB in one full-suite run and made its budget infeasible. Scratch that intra-op worker threads
allocate and free during the span does count.
"""

from __future__ import annotations

import threading

import torch

from teraio.measure import AllocationEvent, MemoryRecorder, op_transient_bytes, own_peak_bytes

MiB = 1 << 20


def test_own_peak_ignores_frees_of_memory_from_before_the_region() -> None:
    events = [
        AllocationEvent(1, ptr=10, nbytes=100),
        AllocationEvent(2, ptr=99, nbytes=-5000),  # allocated before the region: not ours
        AllocationEvent(3, ptr=11, nbytes=300),
        AllocationEvent(4, ptr=11, nbytes=-300),
        AllocationEvent(5, ptr=11, nbytes=50),  # the address is reused by a new allocation
        AllocationEvent(6, ptr=10, nbytes=-100),
    ]
    assert own_peak_bytes(events) == (400, 50)
    assert own_peak_bytes(events, end_ns=3) == (400, 400)


def _session(fn) -> list:
    rec = MemoryRecorder("cpu")
    rec.start()
    try:
        fn()
    finally:
        rec.stop()
    return rec.events


def test_op_transients_ignore_frees_of_older_memory() -> None:
    kept: list[torch.Tensor] = []

    def worker() -> None:
        t = torch.ones(8 * MiB // 4)
        del t

    def body() -> None:
        # Allocated in the session before the op, freed inside the op's span (as a collection would).
        foreign = [torch.ones(4 * MiB // 4)]
        with torch.profiler.record_function("teraio::op0"):
            scratch = torch.ones(MiB // 4)
            kept.append(scratch[:1024].clone())  # 4 KiB output the op leaves alive
            del scratch
            foreign.clear()
            th = threading.Thread(target=worker)
            th.start()
            th.join()

    transients = op_transient_bytes(_session(body), "teraio::op", 1)
    # The op's scratch only: not the foreign free, and the Python thread is not profiled at all (torch's
    # intra-op workers inherit the profiler's state; their scratch is in the span and counts).
    assert transients == [MiB]
