"""The fake device behaves like a CUDA device where the runtime's correctness depends on it: queued work
runs late and in order per stream, events complete only when their stream reaches them, cross-stream
waits hold a stream back, a freed block may be reused while a copy into it is queued, blocking streams
follow the legacy default stream, memory is accounted as torch.cuda and its caching host allocator do,
and a host wait held back by busy (paused) work fails unless it carries a reason."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from teraio.runtime import device as device_module
from teraio.runtime.device import (
    CudaDevice,
    Device,
    HostWait,
    byte_checksum,
    fold_checksum,
    host_wait,
    pow2_ceil,
)
from teraio.runtime.fake_device import POISON_BYTE, FakeDevice, FreedUnderQueuedWorkError, HostBlockedError


@pytest.fixture
def fake():
    dev = FakeDevice()
    yield dev
    dev.close()
    assert not dev.errors, dev.errors


def test_both_devices_implement_the_protocol(fake):
    assert isinstance(fake, Device) and isinstance(CudaDevice(), Device)
    with device_module.installed(fake):
        assert device_module.current() is fake
    assert isinstance(device_module.current(), CudaDevice)
    with pytest.raises(TypeError, match="Device"):
        device_module.set_current(object())


def test_event_completes_only_when_its_stream_reaches_it(fake):
    stream = fake.default_stream
    fake.pause(stream)
    seen = []
    fake.launch(lambda: seen.append("kernel"))
    ev = fake.new_event()
    fake.record(ev, stream)
    assert not fake.event_done(ev) and seen == []  # the host returned at once; nothing ran
    fake.resume(stream)
    fake.synchronize_event(ev)
    assert seen == ["kernel"] and fake.event_done(ev)


def test_wait_holds_another_stream_back_without_blocking_the_host(fake):
    compute, io = fake.default_stream, fake.new_stream(torch.device("cuda"))
    fake.pause(compute)
    order = []
    fake.launch(lambda: order.append("producer"), stream=compute)
    ev = fake.new_event()
    fake.record(ev, compute)
    fake.wait(io, ev)  # returns at once
    fake.launch(lambda: order.append("consumer"), stream=io)
    fake.wait_until(fake.settled)
    assert order == [] and io.blocked
    fake.resume(compute)
    fake.synchronize_stream(io)
    assert order == ["producer", "consumer"]


def test_copies_need_pinned_host_memory_and_run_late(fake):
    dev_buf = fake.empty(4096, torch.device("cuda"))
    assert fake.owns(dev_buf) and torch.all(dev_buf == POISON_BYTE)
    stream = fake.new_stream(torch.device("cuda"))
    with pytest.raises(ValueError, match="pinned"):
        fake.copy_async(dev_buf, torch.zeros(4096, dtype=torch.uint8), stream)
    pinned = fake.empty_pinned(4096)
    pinned.fill_(7)
    fake.pause(stream)
    fake.copy_async(dev_buf, pinned, stream)
    assert torch.all(dev_buf == POISON_BYTE)
    fake.resume(stream)
    fake.synchronize_stream(stream)
    assert torch.all(dev_buf == 7) and ("copy H2D", stream.name) in fake.log


def test_memory_accounting(fake):
    base = fake.memory_allocated(None)
    a = fake.empty(10_000, None)
    b = fake.adopt(torch.empty(1000, dtype=torch.float32))
    assert fake.memory_allocated(None) == base + 14_000
    del a, b
    gc.collect()
    assert fake.memory_allocated(None) == base and fake.max_memory_allocated(None) == base + 14_000
    fake.reset_peak_memory_stats(None)
    assert fake.max_memory_allocated(None) == base
    p = fake.empty_pinned(5000)  # the caching host allocator rounds to a power of two
    assert fake.pinned_allocated_nbytes == 8192 == pow2_ceil(5000)
    assert p.data_ptr() % 4096 == 0
    del p
    gc.collect()
    assert fake.pinned_allocated_nbytes == 0


def test_device_checksum_sees_every_byte_and_position():
    t = torch.randint(0, 256, (300_001,), dtype=torch.uint8)
    i, j = 10, 299_999
    t[i], t[j] = 1, 2
    ref = fold_checksum(byte_checksum(t))
    flipped = t.clone()
    flipped[123_456] ^= 1
    swapped = t.clone()
    swapped[i], swapped[j] = 2, 1  # same bytes, other places
    assert fold_checksum(byte_checksum(flipped)) != ref
    assert fold_checksum(byte_checksum(swapped)) != ref
    assert fold_checksum(byte_checksum(t.clone())) == ref


def test_device_checksum_equals_the_plain_definition():
    """The row/column decomposition computes exactly sum(b) and sum(b * (i + 1)) (mod 2**64)."""
    for n in [1, 4095, 4096, 4097, 3 * 4096 + 5, 100_000]:
        t = torch.randint(0, 256, (n,), dtype=torch.uint8)
        wide = t.to(torch.int64)
        plain = torch.stack([wide.sum(), (wide * torch.arange(1, n + 1)).sum()])
        assert torch.equal(byte_checksum(t), plain), n


def test_timing_events_measure_the_stream_not_the_launch(fake):
    """What teraio's profiler needs on CUDA: events bracket the kernels' execution, while the host
    returns from the launch at once (a host clock around the launch would measure nothing)."""
    import time

    start, end = fake.new_event(timing=True), fake.new_event(timing=True)
    stream = fake.default_stream
    fake.pause(stream)
    fake.record(start, stream)
    fake.launch(lambda: time.sleep(0.05))
    fake.record(end, stream)
    assert not fake.event_done(end)  # the launch returned; the kernel has not run
    fake.resume(stream)
    fake.synchronize_event(end)
    assert fake.elapsed_ms(start, end) >= 50.0


def test_pool_reuses_a_block_per_stream_and_after_recorded_streams(fake):
    """Like CUDA's caching allocator: a freed block goes at once to the next allocation on its own
    stream, never to another stream's; with ``record_stream``, only once that stream reached the free."""
    side = fake.new_stream(None)
    a = fake.empty(4096, None)
    addr = a.data_ptr()
    del a
    with fake.stream_context(side):
        other = fake.empty(4096, None)  # another stream's allocation: a new block
    assert other.data_ptr() != addr
    b = fake.empty(4096, None)
    assert b.data_ptr() == addr  # same stream: reused at once
    fake.pause(side)
    fake.record_stream(b, side)
    assert fake.stream_uses == [(addr, side.name)]
    del b
    held = fake.empty(4096, None)  # the side stream has not reached the free: not this block
    assert held.data_ptr() != addr
    fake.resume(side)
    fake.synchronize_stream(side)
    assert fake.empty(4096, None).data_ptr() == addr


def test_a_freed_block_is_reused_while_a_copy_into_it_is_queued(fake):
    """As on CUDA: the queued copy holds a raw pointer, so once the host frees the tensor its block goes
    to the next allocation on the same stream, and the late copy lands in the new owner's bytes. (This
    is what the runtime's settle rule guards against; an allocator-aware copy would hide the bug.)"""
    io = fake.new_stream(None)
    fake.pause(io)
    src = fake.empty_pinned(4096)
    src.fill_(1)
    dst = fake.empty(4096, None)
    addr = dst.data_ptr()
    fake.copy_async(dst, src, io)
    del dst
    reused = fake.empty(4096, None)
    assert reused.data_ptr() == addr
    reused.fill_(2)
    fake.resume(io)
    fake.synchronize_stream(io)
    assert torch.all(reused == 1)  # the stale copy overwrote the new owner


def test_record_stream_keeps_a_block_until_the_queued_copy_ran(fake):
    io = fake.new_stream(None)
    fake.pause(io)
    src = fake.empty_pinned(4096)
    dst = fake.empty(4096, None)
    addr = dst.data_ptr()
    fake.copy_async(dst, src, io)
    fake.record_stream(dst, io)
    del dst
    assert fake.empty(4096, None).data_ptr() != addr
    fake.resume(io)
    fake.synchronize_stream(io)
    assert fake.empty(4096, None).data_ptr() == addr


def test_resize_storage_frees_and_refills_an_adopted_tensor_in_place(fake):
    """How a parameter's storage object comes and goes (teraio.states.store): accounted as device memory,
    grown bytes poisoned like fresh device memory, aliases see the change."""
    t = fake.adopt(torch.ones(1024))
    alias = t.view(32, 32)
    assert fake.memory_allocated(None) == 4096
    fake.resize_storage(t, 0)
    assert alias.untyped_storage().nbytes() == 0 and fake.memory_allocated(None) == 0
    fake.resize_storage(t, 4096)
    assert fake.owns(alias) and fake.memory_allocated(None) == 4096 == fake.max_memory_allocated(None)
    assert torch.all(t.view(torch.uint8) == POISON_BYTE)
    with pytest.raises(ValueError, match="adopted"):
        fake.resize_storage(fake.empty(64, None), 0)


def test_resize_storage_refuses_to_free_bytes_a_copy_on_another_stream_still_uses(fake):
    io = fake.new_stream(None)
    fake.pause(io)
    t = fake.adopt(torch.ones(1024))
    pinned = fake.empty_pinned(4096)
    fake.copy_async(pinned, t.view(torch.uint8), io)  # a write's device-to-host copy, held back
    with pytest.raises(FreedUnderQueuedWorkError, match="copy D2H on stream"):
        fake.resize_storage(t, 0)
    assert t.untyped_storage().nbytes() == 4096  # nothing freed
    fake.errors.clear()
    fake.resume(io)
    fake.synchronize_stream(io)
    fake.resize_storage(t, 0)  # the copy ran: free
    assert torch.all(pinned.view(torch.float32) == 1)


def test_resize_storage_is_stricter_than_cuda_on_the_allocation_stream(fake):
    """Freeing under work queued on the block's own stream is safe on CUDA, but the fake's freed bytes go
    back to the C allocator at once: it refuses, rather than let the late copy read freed memory. A copy
    queued on freed memory is refused too."""
    fake.pause(fake.default_stream)
    t = fake.adopt(torch.ones(1024))
    pinned = fake.empty_pinned(4096)
    fake.copy_async(pinned, t.view(torch.uint8), fake.default_stream)
    with pytest.raises(FreedUnderQueuedWorkError, match="on stream default"):
        fake.resize_storage(t, 0)
    fake.resume(fake.default_stream)
    fake.synchronize_stream(fake.default_stream)
    fake.resize_storage(t, 0)
    with pytest.raises(FreedUnderQueuedWorkError, match="already freed"):
        fake.copy_async(pinned, t.view(torch.uint8), fake.default_stream)
    fake.errors.clear()


def test_pinned_memory_stays_alive_while_its_copy_is_queued(fake):
    """torch's caching host allocator keeps a pinned block used by a non-blocking copy until the copy's
    event: the fake's queued copy keeps the pinned tensor."""
    io = fake.new_stream(None)
    fake.pause(io)
    dst = fake.empty(4096, None)
    src = fake.empty_pinned(4096)
    src.fill_(9)
    fake.copy_async(dst, src, io)
    del src
    gc.collect()
    assert fake.pinned_allocated_nbytes == 4096
    fake.resume(io)
    fake.synchronize_stream(io)
    assert torch.all(dst == 9)
    gc.collect()
    assert fake.pinned_allocated_nbytes == 0


def test_a_blocking_stream_follows_the_legacy_default_stream(fake):
    """CU_STREAM_DEFAULT streams wait for the default stream's queued work and the default stream waits
    for theirs; the runtime's streams (new_stream) are non-blocking and wait for nothing."""
    order: list[str] = []
    fake.pause(fake.default_stream)
    fake.launch(lambda: order.append("compute"))
    blocking, nonblocking = fake.new_blocking_stream(), fake.new_stream(None)
    fake.launch(lambda: order.append("non-blocking copy"), stream=nonblocking)
    fake.launch(lambda: order.append("blocking copy"), stream=blocking)
    fake.synchronize_stream(nonblocking)
    fake.wait_until(fake.settled)
    assert order == ["non-blocking copy"] and blocking.blocked  # held behind the compute kernel
    fake.resume(fake.default_stream)
    fake.synchronize_stream(blocking)
    assert order == ["non-blocking copy", "compute", "blocking copy"]
    fake.pause(blocking)
    fake.launch(lambda: order.append("blocking 2"), stream=blocking)
    fake.launch(lambda: order.append("compute 2"))  # the default stream waits for the blocking one
    fake.wait_until(fake.settled)
    assert order[-1] == "blocking copy"
    fake.resume(blocking)
    fake.synchronize(None)
    assert order[-2:] == ["blocking 2", "compute 2"]


def test_host_blocked_detector(fake):
    """A host wait held back by a paused stream raises (and is recorded) unless it carries a reason;
    waits on work that will run by itself pass; every wait is logged."""
    compute, io = fake.default_stream, fake.new_stream(None)
    fake.pause(compute)
    fake.launch(lambda: None)
    with pytest.raises(HostBlockedError, match="paused stream 'default'"):
        fake.synchronize_stream(compute)
    # Transitively: the I/O stream waits for an event behind the busy kernel.
    behind = fake.new_event()
    fake.record(behind, compute)
    fake.wait(io, behind)
    done = fake.new_event()
    fake.record(done, io)
    with pytest.raises(HostBlockedError, match="paused stream 'default'"):
        fake.synchronize_event(done)
    assert len(fake.errors) == 2
    fake.errors.clear()
    # A declared reason lets the wait through (it blocks until the stream is resumed).
    waited = threading.Event()

    def declared() -> None:
        with host_wait(HostWait.WRITE_SOURCE):
            fake.synchronize_event(done)
        waited.set()

    waiter = threading.Thread(target=declared)
    waiter.start()
    fake.wait_until(lambda: fake.host_waiters == 1)
    fake.resume(compute)
    waiter.join(timeout=60)
    assert waited.is_set() and not fake.errors
    # Pending work on a running stream is not "held back".
    fake.launch(lambda: None)
    fake.synchronize_stream(compute)
    reasons = [(w.reason, w.held_by) for w in fake.host_waits]
    assert reasons[:3] == [(None, "default"), (None, "default"), (HostWait.WRITE_SOURCE, "default")]
    assert reasons[-1] == (None, None)


def test_checksum_async_reads_through_the_raw_address_when_the_stream_gets_there(fake):
    io = fake.new_stream(None)
    fake.pause(io)
    t = fake.empty(10_000, None)
    t.fill_(3)
    pending = fake.checksum_async(t, io)
    assert not fake.event_done(pending.event)
    t.fill_(4)  # changed before the "kernel" ran: it sees the new bytes, as a GPU kernel would
    fake.resume(io)
    fake.synchronize_event(pending.event)
    assert pending.value() == fold_checksum(byte_checksum(torch.full((10_000,), 4, dtype=torch.uint8)))
    assert fake.is_pinned(pending.result)


def test_ordered_after_follows_event_waits(fake):
    a, b, c = fake.new_stream(None), fake.new_stream(None), fake.new_stream(None)
    for s in (a, b, c):
        fake.pause(s)
    fake.launch(lambda: None, stream=a)
    first = fake.queued[-1][1:]
    ev = fake.new_event()
    fake.record(ev, a)
    fake.wait(b, ev)
    fake.launch(lambda: None, stream=b)
    on_b = fake.queued[-1][1:]
    fake.launch(lambda: None, stream=c)
    on_c = fake.queued[-1][1:]
    assert fake.ordered_after(first, on_b) and not fake.ordered_after(first, on_c)
    fake.resume()
