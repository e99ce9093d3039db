"""The races a real GPU would provoke, provoked on CPU with the fake asynchronous device.

Note: [CUDA ordering] (runtime/engine.py) names the waits, the allocator declarations and the staging
rule that keep device bytes right. Each scenario below holds one stream back (``pause``) so that one rule
is the only thing standing between the runtime and wrong bytes, and checks the bytes a user would see.
Each is run twice: as is (it must pass) and with its rule removed by a monkeypatch (it must then fail:
the check detects the race). docs/gpu_checklist.md lists every rule with the scenario that kills it.
Nothing depends on timing: a scenario proceeds when every fake stream is idle, paused or blocked
(``settled``), never after a sleep. Checksums are off (the bytes are the only witness) except where the
check itself is the rule; the fake's host-blocked detector is on throughout.

Every device tier runs them: host, posix, kvikio (its POSIX path: every file here is a compat file)
and kvikio-gds (the tier's GPUDirect path, with the fake cuFile of ``runtime.testing``).
"""

from __future__ import annotations

import ctypes
import errno
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from teraio.runtime import Engine
from teraio.runtime.errors import DiskIOError
from teraio.runtime.fake_device import POISON_BYTE, FakeDevice
from teraio.runtime.staging import DeviceIO, SlotRing
from teraio.runtime.testing import FaultInjector
from teraio.runtime.tiers.gds import KvikioTier

from .conftest import DEVICE_TIERS, device_config, prepare_device_tier

RACE_TIERS = DEVICE_TIERS
NO_FILES = {"host"}  # the host tier keeps bytes in pinned memory: no staging, no file reads to fail


@pytest.fixture
def fake() -> Iterator[FakeDevice]:
    dev = FakeDevice()
    yield dev
    dev.resume()
    dev.close()
    assert not dev.errors, dev.errors


def _engine(fake: FakeDevice, tier: str, tmp_path: Path, **kw) -> Engine:
    kw.setdefault("chunk_bytes", 64 << 10)
    return Engine(device_config(tier, tmp_path, **kw), device=fake)


def _io_streams(fake: FakeDevice) -> list:
    return [s for s in fake.streams if s is not fake.default_stream]


def _hold_io(fake: FakeDevice) -> None:
    """Pause the I/O threads' streams made so far: their copies are held back from now on. (A GDS
    thread's cuFile stream is made at its first read, after this, so its disk reads still run.)"""
    for stream in _io_streams(fake):
        fake.pause(stream)


def _stored_with_io_held(fake: FakeDevice, eng: Engine, expected: torch.Tensor) -> torch.Tensor:
    """Store a device copy of ``expected`` under "x" (written and released), then pause the I/O
    streams so the next read's copies are held back; return ``expected``."""
    eng.offload("x", fake.adopt(expected.clone())).wait()
    eng.release("x")
    _hold_io(fake)
    return expected


def _consume(fake: FakeDevice, out: torch.Tensor) -> torch.Tensor:
    """Enqueue a consumer kernel copying ``out`` on the current stream, let every held stream go once
    nothing can run any more, and return what the consumer saw."""
    seen = torch.empty_like(out)
    fake.launch(lambda: seen.copy_(out))
    fake.wait_until(fake.settled)
    fake.resume()
    fake.synchronize(out.device)
    return seen


def write_after_producer(fake: FakeDevice, tier: str, tmp_path: Path) -> None:
    """(1) A write that starts before the producer finished: the kernel filling ``x`` is still queued on
    the compute stream when ``offload`` returns."""
    with _engine(fake, tier, tmp_path, io_threads=1, checksum=False) as eng:
        x = fake.adopt(torch.zeros(10_000))  # one chunk
        fake.pause(fake.default_stream)
        fake.launch(lambda: x.fill_(7.0))  # the producer kernel, queued
        handle = eng.offload("x", x)
        fake.wait_until(lambda: fake.settled() and (handle.done() or fake.host_waiters > 0))
        fake.resume(fake.default_stream)
        eng.release("x")
        out = eng.fetch("x")
        fake.synchronize(out.device)
        assert torch.equal(out, torch.full((10_000,), 7.0)), (
            f"the write copied the bytes before the producer (read back {out.unique().tolist()[:3]}, not [7.0])"
        )


def write_done_before_release(fake: FakeDevice, tier: str, tmp_path: Path) -> None:
    """(1') A write completes only once its bytes left the device (Note: [A write waits for its source
    bytes]): ``release`` waits for it, and the caller may then reuse the memory. With the write's copies
    held back, a write that reported done early would send bytes the caller changed after release."""
    with _engine(fake, tier, tmp_path, io_threads=1, checksum=False) as eng:
        eng.offload("warm-up", fake.adopt(torch.zeros(10))).wait()  # the I/O thread's streams exist now
        eng.release("warm-up")
        _hold_io(fake)
        x = fake.adopt(torch.full((10_000,), 3.0))
        handle = eng.offload("x", x)
        fake.wait_until(lambda: fake.settled() and (handle.done() or fake.host_waiters > 0))
        if not handle.done():
            fake.resume()  # the write is waiting for its copy: let it run
        eng.release("x")
        x.fill_(-1.0)  # released: the caller's memory is its own again
        fake.resume()
        out = eng.fetch("x")
        fake.synchronize(out.device)
        assert torch.equal(out, torch.full((10_000,), 3.0)), (
            "the write reported done before its bytes were copied off the device "
            f"(read back {out.unique().tolist()[:3]}, not [3.0])"
        )


def gds_copy_after_disk_read(fake: FakeDevice, tier: str, tmp_path: Path) -> None:
    """(7) kvikio-gds: a read's device-to-device copy out of its staging slot runs only after the cuFile
    read into the slot finished (Note: [GDS reads land in staging first]): the I/O thread waits for the
    GDS stream, held back here, before queueing the copy."""
    with _engine(fake, tier, tmp_path, io_threads=1, checksum=False) as eng:
        expected = torch.randn(10_000)
        eng.offload("x", fake.adopt(expected.clone())).wait()
        eng.release("x")
        fake.pause_new_streams = True  # the thread's GDS stream, made at its first read, starts paused
        got: list[torch.Tensor] = []
        fetching = threading.Thread(target=lambda: got.append(eng.fetch("x")))
        fetching.start()
        fake.wait_until(lambda: fake.settled() and (got or fake.host_waiters > 0))
        fake.resume()
        fetching.join(timeout=60)
        seen = _consume(fake, got[0])
        assert torch.equal(seen, expected), (
            "the copy out of the GDS staging slot ran before the cuFile read landed in it "
            f"(bytes {seen.view(torch.uint8)[:4].tolist()}, poison is {POISON_BYTE})"
        )


def staging_reuse(fake: FakeDevice, tier: str, tmp_path: Path) -> None:
    """(2) A staging slot refilled while a copy still reads it: one I/O thread reads four chunks through
    its staging slots while its stream's copies are held back (the handle completes regardless)."""
    with _engine(fake, tier, tmp_path, io_threads=1, checksum=False) as eng:
        # Four chunks, all different.
        expected = _stored_with_io_held(fake, eng, torch.arange(4 * (64 << 10) // 4, dtype=torch.int32))
        eng.prefetch("x").wait()  # the file reads finished; every copy is still held
        fake.resume()
        out = eng.fetch("x")
        fake.synchronize(out.device)
        bad = sorted({int(i) // (16 << 10) for i in (out != expected).nonzero().flatten()})
        assert torch.equal(out, expected), (
            f"a staging slot was refilled before its copy ran (wrong chunks {bad})"
        )


def consumer_after_read(fake: FakeDevice, tier: str, tmp_path: Path) -> None:
    """(3) A consumer that runs before its read completed: ``fetch`` returns while the read's copy is
    still held back on the I/O stream, and the next kernel on the compute stream reads the tensor."""
    with _engine(fake, tier, tmp_path, io_threads=1, checksum=False) as eng:
        expected = _stored_with_io_held(fake, eng, torch.randn(10_000))
        out = eng.fetch("x")  # returns without waiting for the copy: no host sync on the critical path
        seen = _consume(fake, out)
        assert torch.equal(seen, expected), (
            "the consumer kernel read the tensor before the read landed "
            f"(it saw bytes {seen.view(torch.uint8)[:4].tolist()}, poison is {POISON_BYTE})"
        )


def consumer_on_another_stream(fake: FakeDevice, tier: str, tmp_path: Path) -> None:
    """(3') A second fetch of the same bytes from another stream, served from the buffer the first
    fetch's read is still filling: that stream's consumer must wait for the read too."""
    with _engine(fake, tier, tmp_path, io_threads=1, checksum=False) as eng:
        expected = _stored_with_io_held(fake, eng, torch.randn(10_000))
        first = eng.fetch("x")
        other = fake.new_stream(first.device)
        with fake.stream_context(other):
            out = eng.fetch("x")  # forwarded from the live buffer: no new read
            assert out.data_ptr() == first.data_ptr()
            seen = _consume(fake, out)
        assert torch.equal(seen, expected), (
            "the consumer kernel read the tensor before the read landed "
            f"(on a second stream it saw bytes {seen.view(torch.uint8)[:4].tolist()})"
        )


def consumer_after_check(fake: FakeDevice, tier: str, tmp_path: Path) -> None:
    """(3'') With checksums on, the consumer's kernels are ordered after the read's device checks, not
    only after its copies (Note: [Device checks are read later]): a kernel never uses bytes the
    device has not checked yet. Asked of the fake's dependency record before anything ran."""
    with _engine(fake, tier, tmp_path, io_threads=1, checksum=True) as eng:
        _stored_with_io_held(fake, eng, torch.randn(40_000))  # three chunks
        fake.pause(fake.default_stream)
        before = len(fake.queued)  # the write's own checks are not the point
        out = eng.fetch("x")
        fake.launch(lambda: out.sum())
        checks = [(s, n) for what, s, n in fake.queued[before:] if what == "checksum"]
        consumer = next((s, n) for what, s, n in reversed(fake.queued) if what == "kernel")
        unordered = [n for s, n in checks if not fake.ordered_after((s, n), consumer)]
        fake.resume()
        fake.synchronize(None)
        assert len(checks) == 3 and not unordered, (
            f"the consumer may run before the read's device checks ({len(checks)} checks queued, "
            f"{len(unordered)} not ordered before the consumer)"
        )


def read_into_recycled_block(fake: FakeDevice, tier: str, tmp_path: Path) -> None:
    """(4) A read buffer that the caching allocator recycled while a kernel queued earlier still writes
    into the block: the read's copies must land after that kernel (the allocation event)."""
    with _engine(fake, tier, tmp_path, io_threads=1, checksum=False) as eng:
        expected = torch.randn(10_000)
        eng.offload("x", fake.adopt(expected.clone())).wait()
        eng.release("x")
        fake.pause(fake.default_stream)
        scratch = fake.empty(expected.nbytes, None)
        addr = scratch.data_ptr()
        # A queued kernel writing the scratch block; like a CUDA kernel it holds a raw pointer only.
        fake.launch(lambda: ctypes.memset(addr, 0x5A, expected.nbytes))
        del scratch  # the host frees it: the allocator hands the block to the next allocation
        out = eng.fetch("x")
        assert out.data_ptr() == addr, "precondition: the read buffer reuses the freed block"
        seen = _consume(fake, out)
        assert torch.equal(seen, expected), (
            "the read's copy landed before the kernel queued on the recycled block "
            f"(bytes {seen.view(torch.uint8)[:4].tolist()}, the kernel writes 90)"
        )


def _block_reused_under_consumer(fake: FakeDevice, tier: str, tmp_path: Path, forwarded: bool) -> None:
    with _engine(fake, tier, tmp_path, io_threads=1, checksum=False) as eng:
        first, second = torch.randn(10_000), torch.randn(10_000)
        for key, t in (("a", first), ("b", second)):
            eng.offload(key, fake.adopt(t.clone())).wait()
            eng.release(key)
        eng.prefetch("a").wait()  # its buffer is allocated for the compute (default) stream
        fake.synchronize(None)  # its copies ran: only fetched tensors hold the buffer from now on
        on_compute = eng.fetch("a") if forwarded else None
        side = fake.new_stream(None)
        fake.pause(side)
        seen = torch.empty_like(first)
        with fake.stream_context(side):
            out = eng.fetch("a")
            if forwarded:
                assert out.data_ptr() == on_compute.data_ptr(), "precondition: forwarded from the live buffer"
            addr, nbytes = out.data_ptr(), out.nbytes
            # The consumer kernel: like a CUDA kernel it holds a raw pointer, not the tensor.
            fake.launch(lambda: ctypes.memmove(seen.data_ptr(), addr, nbytes))
        del out, on_compute  # the host is done with the buffer; the side stream is not
        eng.fetch("b")  # a new read buffer, allocated on the compute stream
        # The read of "b" landed: the default stream waits for its copies.
        fake.synchronize_stream(fake.default_stream)
        fake.resume(side)
        fake.synchronize_stream(side)
        assert torch.equal(seen, first), (
            "the allocator handed the fetched block to another read before the side stream's consumer "
            f"read it (the consumer saw the other key's bytes: {torch.equal(seen, second)})"
        )


def block_reused_under_consumer(fake: FakeDevice, tier: str, tmp_path: Path) -> None:
    """(5) A buffer prefetched for the compute stream and fetched on a side stream: the host frees the
    tensor while the side stream's consumer kernel is still queued, and the next read allocates on the
    compute stream. The allocator must not hand it the block the consumer has yet to read."""
    _block_reused_under_consumer(fake, tier, tmp_path, forwarded=False)


def block_reused_under_forwarded_consumer(fake: FakeDevice, tier: str, tmp_path: Path) -> None:
    """(5') The same through a forwarded fetch: the compute stream fetched the key, the side stream's
    fetch is served from that live buffer, then both tensors die while the side consumer is queued."""
    _block_reused_under_consumer(fake, tier, tmp_path, forwarded=True)


def _new_owner_keeps_its_bytes(fake: FakeDevice, nbytes: int, what: str) -> None:
    """After a read buffer was let go with its copies still held: a new compute-stream allocation of the
    same size gets a block (the same one, unless the engine settled it) and a kernel fills it; once the
    held copies run, the new owner's bytes must still be the kernel's."""
    reuse = fake.empty(nbytes, None)
    addr = reuse.data_ptr()
    fake.launch(lambda: ctypes.memset(addr, 0x5A, nbytes))
    fake.synchronize_stream(fake.default_stream)
    fake.resume()
    fake.synchronize(None)
    landed = int((reuse != 0x5A).sum())
    assert landed == 0, (
        f"{what}'s queued copy landed in memory the allocator had handed to a new tensor ({landed} bytes "
        "overwritten): the block was reused before the I/O stream was done with it"
    )


def settle_after_failed_fetch(fake: FakeDevice, tier: str, tmp_path: Path) -> None:
    """(6) A fetch whose read fails after an earlier chunk's copy was queued: the buffer is let go with
    that copy still held, and the next allocation of that size on the compute stream must not get its
    block before the copy ran (the settle in ``fetch``)."""
    inj = FaultInjector()
    with _engine(fake, tier, tmp_path, io_threads=1, checksum=False, fault_injector=inj) as eng:
        expected = _stored_with_io_held(fake, eng, torch.randn(2 * (64 << 10) // 4))  # two chunks
        inj.fail("read", errno.EIO, after_nbytes=64 << 10, times=1)  # the second chunk's read fails
        with pytest.raises(DiskIOError):
            eng.fetch("x")
        _new_owner_keeps_its_bytes(fake, expected.nbytes, "the failed read")


def settle_after_drop(fake: FakeDevice, tier: str, tmp_path: Path) -> None:
    """(6') A read prefetched and never fetched, dropped while its copies are held: the drop lets the
    buffer go without waiting (the allocator settles it)."""
    with _engine(fake, tier, tmp_path, io_threads=1, checksum=False) as eng:
        expected = _stored_with_io_held(fake, eng, torch.randn(2 * (64 << 10) // 4))
        eng.prefetch("x").wait()  # the host side is done; the copies are held
        eng.drop("x")
        _new_owner_keeps_its_bytes(fake, expected.nbytes, "the dropped read")


def settle_after_close(fake: FakeDevice, tier: str, tmp_path: Path) -> None:
    """(6'') The same when the engine closes with a prefetched read nobody fetched."""
    with _engine(fake, tier, tmp_path, io_threads=1, checksum=False) as eng:
        expected = _stored_with_io_held(fake, eng, torch.randn(2 * (64 << 10) // 4))
        eng.prefetch("x").wait()
    _new_owner_keeps_its_bytes(fake, expected.nbytes, "the read left by close")


def _no_producer_wait(self, io, event) -> None:
    return None


def _download_without_wait(self, dst_pinned, src) -> None:
    self.device.copy_async(dst_pinned, src, self.write_stream)


def _gds_without_byte_checks(f, action, piece, chunk, io) -> int:
    """The GDS path with its ``check_bytes_done`` calls removed (the futures kept, never asked)."""
    dev = io.device
    if action == "write":
        _kept.append(
            f.raw_write_async(
                dev.cuda_array(piece), dev.raw_stream(io.write_stream), chunk.nbytes, chunk.file_offset
            )
        )
        return chunk.nbytes
    slot = io.acquire_device_slot()
    staging = slot.buffer[: chunk.nbytes]
    _kept.append(
        f.raw_read_async(
            dev.cuda_array(staging), dev.raw_stream(io.gds_stream), chunk.nbytes, chunk.file_offset
        )
    )
    io.upload(piece, staging, slot)
    return chunk.nbytes


_kept: list = []  # futures never checked: dropping one would synchronise its stream (kvikio's destructor)


def _slot_always_free(self, slot) -> bool:
    return True


def _no_consumer_wait(self, device, events, buffer) -> None:
    return None


def _no_consumer_use(self, buffer, stream) -> None:
    return None


def _no_allocation_wait(self, io, event) -> None:
    return None


def _no_settle(self, req) -> None:
    return None


def _no_device_checks(self, req, entry, idxs, buf, io, keys) -> None:
    return None


RACES = {
    "write_after_producer": (write_after_producer, (Engine, "_order_after_producer", _no_producer_wait)),
    "write_done_before_release": (write_done_before_release, (DeviceIO, "download", _download_without_wait)),
    "gds_write_done_before_release": (
        write_done_before_release,
        (KvikioTier, "_gds_device_io", staticmethod(_gds_without_byte_checks)),
    ),
    "gds_copy_after_disk_read": (
        gds_copy_after_disk_read,
        (KvikioTier, "_gds_device_io", staticmethod(_gds_without_byte_checks)),
    ),
    "staging_reuse": (staging_reuse, (SlotRing, "slot_free", _slot_always_free)),
    "consumer_after_read": (consumer_after_read, (Engine, "_order_before_consumer", _no_consumer_wait)),
    "consumer_on_another_stream": (
        consumer_on_another_stream,
        (Engine, "_order_before_consumer", _no_consumer_wait),
    ),
    "consumer_after_check": (consumer_after_check, (Engine, "_check_on_device", _no_device_checks)),
    "read_into_recycled_block": (
        read_into_recycled_block,
        (Engine, "_order_after_allocation", _no_allocation_wait),
    ),
    "block_reused_under_consumer": (
        block_reused_under_consumer,
        (Engine, "_keep_block_for_consumer", _no_consumer_use),
    ),
    "block_reused_under_forwarded_consumer": (
        block_reused_under_forwarded_consumer,
        (Engine, "_keep_block_for_consumer", _no_consumer_use),
    ),
    "settle_after_failed_fetch": (settle_after_failed_fetch, (Engine, "_settle_device", _no_settle)),
    "settle_after_drop": (settle_after_drop, (Engine, "_settle_device", _no_settle)),
    "settle_after_close": (settle_after_close, (Engine, "_settle_device", _no_settle)),
}


def _skip_if_not_applicable(race: str, tier: str) -> None:
    if tier in NO_FILES and race in ("staging_reuse", "settle_after_failed_fetch"):
        pytest.skip("the host tier copies from its own pinned blocks: no staging, no file read to fail")
    if race.startswith("gds_") and tier != "kvikio-gds":
        pytest.skip("the GPUDirect path's own rule")
    if race == "write_done_before_release" and tier == "kvikio-gds":
        pytest.skip(
            "a GDS write waits for cuFile's stream write, not a download: gds_write_done_before_release"
        )


@pytest.mark.parametrize("tier", RACE_TIERS)
@pytest.mark.parametrize("race", list(RACES))
def test_race_is_ordered(fake, tier, race, tmp_path, monkeypatch):
    _skip_if_not_applicable(race, tier)
    prepare_device_tier(tier, fake, monkeypatch)
    scenario, _ = RACES[race]
    scenario(fake, tier, tmp_path)


@pytest.mark.parametrize("tier", RACE_TIERS)
@pytest.mark.parametrize("race", list(RACES))
def test_race_fails_without_its_rule(fake, tier, race, tmp_path, monkeypatch):
    """The check of each scenario is real: with its one rule removed it sees wrong bytes (or, for the
    checks, a consumer no longer ordered after them)."""
    _skip_if_not_applicable(race, tier)
    prepare_device_tier(tier, fake, monkeypatch)
    scenario, (owner, name, stub) = RACES[race]
    monkeypatch.setattr(owner, name, stub)
    with pytest.raises(AssertionError, match="before"):
        scenario(fake, tier, tmp_path)
