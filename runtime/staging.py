"""What an I/O thread needs to move device bytes: its own streams per device and staging buffers.

A fresh thread's current CUDA stream is the default stream, so copies issued from I/O threads would
serialise with the training kernels; each I/O thread therefore owns its streams per device
(:class:`ThreadStreams`), created non-blocking. Writes and reads get a stream each: a write's copies
wait for the kernels that produced its source (Note: [CUDA ordering] (1), runtime/engine.py), a
read's copies for the kernels that last used its buffer's recycled block ((4)); on one stream, a write
would queue behind an earlier read's wait for the compute stream, and the I/O thread's wait for the
write (below) would then wait on compute for a read it does not need. Device<->host copies are only
asynchronous from and to pinned memory, so file tiers stage through pinned buffers per thread and
device (:class:`DeviceIO`).

Note: [Staging slots are recycled by events]
    A host-to-device copy reads its staging slot when the stream gets to it, long after ``upload``
    returned: a read's copies wait for the compute stream to reach the read buffer's allocation
    (Note: [CUDA ordering] (4)). A slot is refilled only once the event recorded behind its last copy
    completed, or a later chunk's bytes would be what the earlier chunk's copy delivers; whether it
    completed is a query (``slot_free``), never a host wait: a thread that finds every slot busy takes
    a new one, so reading the file never waits for the GPU and ``fetch`` never waits on compute. The
    ring grows to the bytes whose copies are still queued (at most the read itself, when the compute
    stream is far behind the host) and gives idle extra slots back, keeping ``STAGING_SLOTS``.

Note: [A write waits for its source bytes]
    A write's device bytes reach the file through a pinned slot: the I/O thread copies them down on
    its write stream (after the producer's kernels) and must wait for that copy before ``pwrite`` can
    send them (``download``, declared ``HostWait.WRITE_SOURCE``). The wait is on the I/O thread, for its
    own write; ``release`` (which waits for the whole write) is where the training thread can feel it,
    and the plan places that wait late.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from teraio.runtime.config import PAGE_NBYTES
from teraio.runtime.device import Device, HostWait, PendingChecksum, host_wait

STAGING_SLOTS = 2  # slots kept per ring; more are made while all are busy, and given back when idle


class _Slot:
    """One staging buffer and the event recorded behind the last copy that used it."""

    def __init__(self, device: Device, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        self.event = device.new_event()  # never recorded: complete, so a new slot is free


class SlotRing:
    """Staging buffers of one size recycled by their events (Note: [Staging slots are recycled by events])."""

    def __init__(self, device: Device, make: Callable[[], torch.Tensor]) -> None:
        self.device = device
        self._make = make
        self.slots: list[_Slot] = []
        self.peak_slots = 0
        self._next = 0

    def slot_free(self, slot: _Slot) -> bool:
        """Whether the copy that last used ``slot`` ran (a query: the host never waits for it)."""
        return self.device.event_done(slot.event)

    def acquire(self) -> _Slot:
        """A slot whose last copy ran, taken round-robin; a new one when every slot is busy."""
        self._trim()
        n = len(self.slots)
        for i in range(n):
            slot = self.slots[(self._next + i) % n]
            if self.slot_free(slot):
                self._next = (self._next + i + 1) % n
                return slot
        slot = _Slot(self.device, self._make())
        self.slots.append(slot)
        self.peak_slots = max(self.peak_slots, len(self.slots))
        return slot

    def _trim(self) -> None:
        """Give back idle slots beyond ``STAGING_SLOTS`` (made while the compute stream was behind)."""
        while len(self.slots) > STAGING_SLOTS:
            idle = next((s for s in reversed(self.slots) if self.slot_free(s)), None)
            if idle is None:
                return
            self.slots.remove(idle)
            self._next %= len(self.slots)


class DeviceIO:
    """One I/O thread's streams and staging for one device. Only that thread uses it."""

    def __init__(self, device: Device, torch_device: torch.device, slot_nbytes: int) -> None:
        self.device = device
        self.torch_device = torch_device
        self.write_stream = device.new_stream(torch_device)
        self.read_stream = device.new_stream(torch_device)
        self._slot_nbytes = slot_nbytes
        self.pinned = SlotRing(device, self._new_pinned)
        self._gds_stream: Any = None
        self._gds_slots: SlotRing | None = None

    def _new_pinned(self) -> torch.Tensor:
        buffer = self.device.empty_pinned(self._slot_nbytes)
        if buffer.data_ptr() % PAGE_NBYTES:
            # O_DIRECT into pinned memory needs page alignment; cudaHostAlloc and the fake give it.
            raise RuntimeError("pinned staging memory is not page-aligned; O_DIRECT cannot use it")
        return buffer

    # -- ordering ---------------------------------------------------------------------------------
    def order_write_after(self, event: Any) -> None:
        """Later work on the write stream waits for ``event`` (the producer's kernels); no host block."""
        self.device.wait(self.write_stream, event)

    def order_read_after(self, event: Any) -> None:
        """Later work on the read stream waits for ``event`` (the buffer's allocation); no host block."""
        self.device.wait(self.read_stream, event)

    # -- staging ----------------------------------------------------------------------------------
    def acquire(self) -> _Slot:
        """A pinned staging slot whose last copy ran (Note: [Staging slots are recycled by events])."""
        return self.pinned.acquire()

    def download(self, dst_pinned: torch.Tensor, src: torch.Tensor) -> None:
        """Copy device bytes ``src`` into pinned ``dst_pinned`` on the write stream and wait until they
        landed: the caller writes them to a file or keeps them as the host copy next
        (Note: [A write waits for its source bytes])."""
        self.device.copy_async(dst_pinned, src, self.write_stream)
        done = self.device.new_event()
        self.device.record(done, self.write_stream)
        with host_wait(HostWait.WRITE_SOURCE):
            self.device.synchronize_event(done)

    def upload(self, dst: torch.Tensor, src: torch.Tensor, slot: _Slot | None = None) -> None:
        """Enqueue a copy of ``src`` (pinned, or a device staging slot) into device bytes ``dst`` on the
        read stream; do not wait. With ``slot``, the slot stays busy until the copy ran."""
        self.device.copy_async(dst, src, self.read_stream)
        if slot is not None:
            self.device.record(slot.event, self.read_stream)

    def checksum_async(self, t: torch.Tensor, stream: Any) -> PendingChecksum:
        """The device-side checksum of ``t``, ordered after everything enqueued on ``stream``."""
        return self.device.checksum_async(t, stream)

    # -- GPUDirect reads (runtime/tiers/gds.py) ----------------------------------------------------
    @property
    def gds_stream(self) -> Any:
        """A stream that carries only this thread's cuFile reads into device staging: it waits for
        nothing, so waiting for it is waiting for the disk (Note: [GDS reads land in staging first])."""
        if self._gds_stream is None:
            self._gds_stream = self.device.new_stream(self.torch_device)
        return self._gds_stream

    def acquire_device_slot(self) -> _Slot:
        """A device staging slot (chunk-sized, allocated for the GDS stream) whose last copy ran."""
        if self._gds_slots is None:
            self._gds_slots = SlotRing(self.device, self._new_device_slot)
        return self._gds_slots.acquire()

    def _new_device_slot(self) -> torch.Tensor:
        with self.device.stream_context(self.gds_stream):
            return self.device.empty(self._slot_nbytes, self.torch_device)


class ThreadStreams:
    """The :class:`DeviceIO` of each (I/O thread, device), made on first use in that thread."""

    def __init__(self, device: Device, slot_nbytes: int) -> None:
        self.device = device
        self.slot_nbytes = slot_nbytes
        self._local = threading.local()

    def get(self, torch_device: torch.device) -> DeviceIO:
        per_thread: dict[torch.device, DeviceIO] | None = getattr(self._local, "ios", None)
        if per_thread is None:
            per_thread = self._local.ios = {}
        io = per_thread.get(torch_device)
        if io is None:
            io = per_thread[torch_device] = DeviceIO(self.device, torch_device, self.slot_nbytes)
        return io
