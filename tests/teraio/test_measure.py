"""Memory measurement counts a region's own allocations only (Note: [Only the region's own allocations]).

A free inside an op's span of memory allocated before the span (the garbage collector reclaiming
earlier values) must not count as the op's transient bytes: counting it raised a tiny model's floor
by 80 KiB in one full-suite run and made its budget infeasible. Scratch that intra-op worker threads
allocate and free during the span does count.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import torch

from teraio.profiling.measure import (
    AllocationEvent,
    MemoryRecorder,
    allocations_under,
    measure_memory,
    op_transient_bytes,
    own_peak_bytes,
    own_running_bytes,
)
from teraio.runtime import device as runtime_device
from teraio.runtime.fake_device import FakeDevice

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


# ------------------------------------------------------------------------------- the CUDA path, faked
class _AskedDevice(FakeDevice):
    """The fake device, noting the device each allocator statistic and synchronisation was asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[tuple[str, torch.device]] = []

    def memory_allocated(self, device):
        self.asked.append(("memory_allocated", device))
        return super().memory_allocated(device)

    def max_memory_allocated(self, device):
        self.asked.append(("max_memory_allocated", device))
        return super().max_memory_allocated(device)

    def reset_peak_memory_stats(self, device):
        self.asked.append(("reset_peak_memory_stats", device))
        super().reset_peak_memory_stats(device)

    def synchronize(self, device):
        self.asked.append(("synchronize", device))
        super().synchronize(device)


def test_cuda_recorder_reads_its_own_device_at_the_mark() -> None:
    """A cuda:1 recorder asks about device 1 (not the current device), and the region ends at
    ``mark_end`` (the step's end, in a backward hook): device memory allocated between the mark and
    ``stop`` (the optimizer step, before the next forward) is not the step's."""
    fake = _AskedDevice()
    try:
        with runtime_device.installed(fake):
            before = fake.empty(1 << 20, None)  # exists before the region: not counted
            rec = MemoryRecorder("cuda:1")
            rec.start()
            scratch = fake.empty(4096, None)
            del scratch
            kept = fake.empty(1000, None)  # what the step leaves alive
            rec.mark_end()
            optimizer_state = fake.empty(1 << 16, None)
            result = rec.stop()
    finally:
        fake.close()
    assert (result.peak_bytes, result.end_bytes, result.method) == (4096, 1000, "cuda")
    asked = {what for what, _ in fake.asked}
    assert asked == {"memory_allocated", "max_memory_allocated", "reset_peak_memory_stats", "synchronize"}
    assert {device for _, device in fake.asked} == {torch.device("cuda", 1)}
    del before, kept, optimizer_state


def test_cuda_measure_memory_asks_its_own_device() -> None:
    fake = _AskedDevice()

    def region() -> torch.Tensor:
        scratch = fake.empty(3000, None)
        del scratch
        return fake.empty(100, None)

    try:
        with runtime_device.installed(fake):
            kept, result = measure_memory(region, "cuda:1")
    finally:
        fake.close()
    assert (result.peak_bytes, result.end_bytes, result.method) == (3000, 100, "cuda")
    assert fake.asked and {device for _, device in fake.asked} == {torch.device("cuda", 1)}


# ------------------------------------------------- a collective's buffer freed on its worker thread
def _alloc(ts: int, ptr: int, nbytes: int) -> SimpleNamespace:
    fields = SimpleNamespace(device=SimpleNamespace(type="cpu"), ptr=ptr, alloc_size=nbytes)
    return SimpleNamespace(
        tag=torch._C._profiler._EventType.Allocation, extra_fields=fields, start_time_ns=ts, children=[]
    )


def _span(name: str, start: int, end: int, *children: SimpleNamespace) -> SimpleNamespace:
    tag = torch._C._profiler._EventType.TorchOp
    return SimpleNamespace(tag=tag, name=name, start_time_ns=start, end_time_ns=end, children=list(children))


def test_a_collectives_buffer_the_profiler_saw_no_free_of_is_freed_after_its_work() -> None:
    """Note: [A collective's buffer freed on its worker thread] in teraio.profiling.collective_frees: the
    reduce-scatter's clone (ptr 1) is freed unseen by the worker after its span; a later activation (ptr
    2) must not stack on it. A recorded free (ptr 3), an address reused before the span ends (ptr 4) and
    a buffer whose work never ran in the region (ptr 5) keep what the record says."""
    block = 50_816
    main = _span(
        "ProfilerStep",
        0,
        200,
        _span("c10d::_reduce_scatter_base_", 10, 20, _alloc(11, 1, block)),
        _span("c10d::_reduce_scatter_base_", 21, 22, _alloc(21, 3, 64)),
        _alloc(25, 3, -64),
        _span("c10d::_allgather_base_", 23, 24, _alloc(23, 4, 32)),
        _alloc(26, 4, 16),  # the allocator handed the address out again: freed by then
        _alloc(40, 2, 100_000),
        _alloc(50, 2, -100_000),
        _span("c10d::_reduce_scatter_base_", 150, 160, _alloc(151, 5, 8)),
    )
    workers = [
        _span("gloo:all_reduce", 15, 30),
        _span("gloo:all_reduce", 22, 35),
        _span("gloo:all_gather", 24, 45),
    ]
    events = allocations_under([main, *workers], "cpu")
    assert own_peak_bytes(events) == (100_016, 24)
    frees = [(e.ts_ns, e.ptr, e.nbytes) for e in events if e.nbytes < 0]
    assert frees == [(25, 3, -64), (30, 1, -block), (50, 2, -100_000)]


def test_fsdp2s_all_gather_output_the_profiler_saw_no_free_of_is_freed_after_its_work() -> None:
    """The same race for FSDP2's flat all-gather output (ptr 1), allocated in the ``FSDP::all_gather``
    span before the ``c10d::`` op; the gathered parameters its copy-out allocates (ptr 6, alive past the
    region's last worker span: FSDP2 frees them itself) are not the work's."""
    block = 50_816
    main = _span(
        "ProfilerStep",
        0,
        200,
        _span(
            "FSDP::all_gather (gpt.blocks.0)",
            10,
            20,
            _alloc(11, 1, block),
            _span("c10d::_allgather_base_", 12, 13),
        ),
        _span("FSDP::all_gather_copy_out (gpt.blocks.0)", 21, 22, _alloc(21, 6, block)),
        _alloc(40, 2, 100_000),
        _alloc(50, 2, -100_000),
    )
    events = allocations_under([main, _span("gloo:all_gather", 15, 30)], "cpu")
    frees = [(e.ts_ns, e.ptr, e.nbytes) for e in events if e.nbytes < 0]
    assert frees == [(30, 1, -block), (50, 2, -100_000)]
    assert own_peak_bytes(events) == (block + 100_000, block)


def test_fsdp2s_all_gather_output_is_freed_no_earlier_than_fsdp2_lets_go_of_it() -> None:
    """Note: [FSDP2 holds its all-gather output past the work] in teraio.profiling.collective_frees: the
    last block's forward output (ptr 1) is kept by FSDP2 to the end of the root's forward, and freed unseen
    by a worker that dropped the work after that: the loss computed before then (ptr 2) stacks on it. A
    forward output of an earlier block (ptr 3) goes before the next group's copy-out (a later
    activation, ptr 4, does not stack on it); a backward output (ptr 5) at the end of its copy-out, before
    the next block's prefetched output (ptr 7) in the same pre-backward."""
    block = 25_408
    main = _span(
        "ProfilerStep",
        0,
        500,
        _span(
            "FSDP::pre_forward (gpt.blocks.0)",
            1,
            9,
            _span(
                "FSDP::all_gather (gpt.blocks.0)",
                2,
                5,
                _alloc(3, 3, block),
                _span("c10d::_allgather_base_", 4, 5),
            ),
            _span("FSDP::all_gather_copy_out (gpt.blocks.0)", 6, 8),
        ),
        _span(
            "FSDP::pre_forward (gpt.blocks.1)",
            10,
            29,
            _span(
                "FSDP::all_gather (gpt.blocks.1)",
                10,
                20,
                _alloc(11, 1, block),
                _span("c10d::_allgather_base_", 12, 13),
            ),
            _span("FSDP::all_gather_copy_out (gpt.blocks.1)", 21, 22),
        ),
        _alloc(40, 4, 1_000),
        _alloc(45, 4, -1_000),
        _alloc(100, 2, 100_000),
        _alloc(110, 2, -100_000),
        _span("FSDP::post_forward (gpt.blocks.1)", 115, 116),
        _span("FSDP::post_forward", 120, 130),
        _span(
            "FSDP::pre_backward (gpt.blocks.1)",
            200,
            260,
            _span(
                "FSDP::all_gather (gpt.blocks.1)",
                201,
                210,
                _alloc(202, 5, block),
                _span("c10d::_allgather_base_", 203, 204),
            ),
            _span("FSDP::all_gather_copy_out (gpt.blocks.1)", 230, 240),
            _span("FSDP::all_gather (gpt.blocks.0)", 245, 250, _alloc(246, 7, block)),
        ),
        _alloc(300, 6, 10),
    )
    workers = [
        _span("gloo:all_gather", 4, 5),
        _span("gloo:all_gather", 14, 18),
        _span("gloo:all_gather", 205, 208),
    ]
    events = allocations_under([main, *workers], "cpu")
    frees = [(e.ts_ns, e.ptr, e.nbytes) for e in events if e.nbytes < 0]
    assert frees == [(21, 3, -block), (45, 4, -1_000), (110, 2, -100_000), (130, 1, -block), (240, 5, -block)]
    assert own_peak_bytes(events)[0] == block + 100_000
    assert max(r for t, r in own_running_bytes(events) if t > 200) == block + 10  # ptr 7 never beside ptr 5
