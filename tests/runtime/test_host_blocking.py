"""With the compute stream busy, ``prefetch``, ``fetch`` and ``drop`` return without waiting for it, on
every device tier, with checksums on and off.

"Busy" is the fake device's compute stream paused with a kernel queued: on a GPU, the host runs ahead
of kernels that take long to finish. Whatever the runtime would wait for on the host behind that
kernel never comes, so the fake's host-blocked detector (Note: [Every host wait has a reason],
runtime/device.py) turns such a wait into a HostBlockedError at once instead of a hang. The test also
reads the fake's log of host waits: the calling thread makes none at all. Each rule that keeps a wait
off this path is removed once below (the old behaviour put back), and the same scenario must then fail.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from teraio.runtime import Engine
from teraio.runtime.device_checks import _DeviceCheck
from teraio.runtime.errors import RuntimeIOError
from teraio.runtime.fake_device import FakeDevice, HostBlockedError
from teraio.runtime.staging import SlotRing, _Slot

from .conftest import DEVICE_TIERS, device_config, prepare_device_tier

CHUNK_NBYTES = 64 << 10
# Sizes in chunks: 7 is more than two chunks per I/O thread (the staging ring's old host wait), 1 a
# single chunk, and a sub-chunk tensor.
SIZES = {"a": 7 * CHUNK_NBYTES // 4, "b": CHUNK_NBYTES // 4, "c": 3 * CHUNK_NBYTES // 4 + 5, "d": 1000}


@pytest.fixture
def fake() -> Iterator[FakeDevice]:
    dev = FakeDevice()
    yield dev
    dev.resume()
    dev.close()
    assert not dev.errors, dev.errors


def _with_compute_busy(fake: FakeDevice, calls: Callable[[], None], timeout_s: float = 120) -> None:
    """Run ``calls`` on another thread while the compute stream is paused with a kernel queued; wait
    until they returned (a deadlock guard only: a blocked call never returns while compute is paused)."""
    fake.pause(fake.default_stream)
    fake.launch(lambda: None)  # the long-running kernel the host ran ahead of
    done = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            calls()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
            failure.append(exc)
        finally:
            done.set()

    caller = threading.Thread(target=run, name="training-thread")
    caller.start()
    try:
        fake.wait_until(done.is_set, timeout_s=timeout_s)
    finally:
        fake.resume()
        caller.join(timeout=120)
    if failure:
        raise failure[0]


def fetch_and_drop_while_compute_is_busy(fake: FakeDevice, tier: str, tmp_path: Path, checksum: bool) -> None:
    config = device_config(tier, tmp_path, chunk_bytes=CHUNK_NBYTES, io_threads=2, checksum=checksum)
    with Engine(config, device=fake) as eng:
        expected = {k: torch.randn(n) for k, n in SIZES.items()}
        for key, t in expected.items():
            eng.offload(key, fake.adopt(t.clone())).wait()
            eng.release(key)
        fetched: dict[str, torch.Tensor] = {}
        seen = {k: torch.empty_like(t) for k, t in expected.items() if k != "c"}
        first_wait = len(fake.host_waits)

        def training_step() -> None:
            eng.prefetch("a").wait()  # the read's host side finishes; its copies wait for compute
            eng.prefetch("c")  # prefetched and never fetched: dropped below
            fetched["a"] = eng.fetch("a")
            fetched["b"] = eng.fetch("b")  # no prefetch: read inside fetch
            fetched["d"] = eng.fetch("d")
            for key, out in fetched.items():  # consumers, queued behind the busy kernel
                fake.launch(lambda key=key, out=out: seen[key].copy_(out))
            eng.drop("a")  # a fetched read: waits for nothing
            eng.drop("c")  # a read nobody fetched: settled by the allocator, no device wait
            eng.drop("d")

        _with_compute_busy(fake, training_step)
        on_caller = [w for w in fake.host_waits[first_wait:] if w.thread == "training-thread"]
        assert on_caller == [], f"the training thread waited on the device: {on_caller}"
        unjustified = [w for w in fake.host_waits[first_wait:] if w.held_by and w.reason is None]
        assert unjustified == [], unjustified
        fake.synchronize(None)
        for key, got in seen.items():
            assert torch.equal(got, expected[key]), f"the consumer of {key!r} saw wrong bytes"
        eng.synchronize()  # every device check passed (checksums on), nothing pending (off)
        assert eng.stats().checksum_failures == 0


@pytest.mark.parametrize("checksum", [True, False], ids=["checksums", "no-checksums"])
@pytest.mark.parametrize("tier", DEVICE_TIERS)
def test_fetch_and_drop_return_while_compute_is_busy(fake, tier, checksum, tmp_path, monkeypatch):
    prepare_device_tier(tier, fake, monkeypatch)
    fetch_and_drop_while_compute_is_busy(fake, tier, tmp_path, checksum)


@pytest.mark.parametrize("tier", DEVICE_TIERS)
def test_a_write_is_not_held_behind_a_read_waiting_for_compute(fake, tier, tmp_path, monkeypatch):
    """Reads and writes have their own I/O streams: a read prefetched while compute is busy waits for
    it on the device (its buffer's allocation), and a write issued after it on the same I/O thread,
    whose producer ran on an idle side stream, must not queue behind that wait (``release`` would
    block until compute finished)."""
    prepare_device_tier(tier, fake, monkeypatch)
    config = device_config(tier, tmp_path, chunk_bytes=CHUNK_NBYTES, io_threads=1)
    with Engine(config, device=fake) as eng:
        eng.offload("r", fake.adopt(torch.randn(SIZES["a"]))).wait()
        eng.release("r")
        side = fake.new_stream(None)
        written = torch.randn(SIZES["c"])

        def step() -> None:
            eng.prefetch("r").wait()  # its copies wait behind the busy compute stream
            with fake.stream_context(side):  # produced on an idle stream
                eng.offload("w", fake.adopt(written.clone())).wait()
                eng.release("w")

        _with_compute_busy(fake, step, timeout_s=30)
        out = eng.fetch("w")
        fake.synchronize(None)
        assert torch.equal(out, written)


# -- the old behaviours, put back one at a time: each must make the scenario fail ---------------------


def _checks_waited_on_the_io_thread(self, req, entry, idxs, buf, io, keys) -> None:
    """The device checksum read back on the I/O thread before the handle completes (a ``.cpu()``)."""
    for idx in idxs:
        chunk = entry.placement.chunks[idx]
        pending = io.checksum_async(
            buf[chunk.region_offset : chunk.region_offset + chunk.nbytes], io.read_stream
        )
        self._dev.synchronize_event(pending.event)
        with self._checks_lock:
            self._device_checks.append(_DeviceCheck(pending, entry.checksums[idx], entry, chunk, keys, req))


def _ring_waiting_on_the_host(self) -> _Slot:
    """Two slots, refilled after a host wait for the slot's last copy."""
    if len(self.slots) < 2:
        self.slots.append(_Slot(self.device, self._make()))
        return self.slots[-1]
    slot = self.slots[self._next]
    self._next = (self._next + 1) % 2
    self.device.synchronize_event(slot.event)
    return slot


def _settle_waiting_on_the_host(self, req) -> None:
    """drop/close/failed fetch waiting on the host for the read's device events."""
    with req.lock:
        events = list(req.device_events)
    for event in events:
        self._dev.synchronize_event(event)


def _kvikio_given_device_memory(self, f, action, piece, chunk, io) -> int:
    """kvikio's own compat path for device memory: its bounce buffer and a blocking stream it creates."""
    call = f.pread if action == "read" else f.pwrite
    return call(io.device.cuda_array(piece), chunk.nbytes, chunk.file_offset, task_size=chunk.nbytes).get()


def _patch_kvikio(monkeypatch, name, stub) -> None:
    from teraio.runtime.tiers.gds import KvikioTier

    monkeypatch.setattr(KvikioTier, name, stub)


OLD_WAITS: dict[str, tuple[Callable, list[str]]] = {
    "checksum_read_on_io_thread": (
        lambda mp: mp.setattr(Engine, "_check_on_device", _checks_waited_on_the_io_thread),
        DEVICE_TIERS,
    ),
    "staging_ring_host_wait": (
        lambda mp: mp.setattr(SlotRing, "acquire", _ring_waiting_on_the_host),
        ["posix", "kvikio", "kvikio-gds"],
    ),
    "settle_by_host_wait": (
        lambda mp: mp.setattr(Engine, "_settle_device", _settle_waiting_on_the_host),
        DEVICE_TIERS,
    ),
    "kvikio_compat_copies": (
        lambda mp: _patch_kvikio(mp, "_staged_device_io", _kvikio_given_device_memory),
        ["kvikio"],
    ),
}


@pytest.mark.parametrize(
    "old, tier", [(old, tier) for old, (_, tiers) in OLD_WAITS.items() for tier in tiers]
)
def test_fetch_or_drop_blocks_with_the_old_behaviour(fake, old, tier, tmp_path, monkeypatch):
    """Each rule is real: with the old wait back, the host (or an I/O thread it depends on) waits on the
    busy compute stream, and the detector fails the scenario."""
    prepare_device_tier(tier, fake, monkeypatch)
    patch, _ = OLD_WAITS[old]
    patch(monkeypatch)
    with pytest.raises((HostBlockedError, RuntimeIOError), match="HostBlockedError|paused stream|failed"):
        fetch_and_drop_while_compute_is_busy(fake, tier, tmp_path, checksum=True)
    assert any(isinstance(e, HostBlockedError) for e in fake.errors), fake.errors
    fake.errors.clear()
