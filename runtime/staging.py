"""What an I/O thread needs to move device bytes: its own stream per device and pinned staging buffers.

A fresh thread's current CUDA stream is the default stream, so copies issued from I/O threads would
serialise with the training kernels; each I/O thread therefore owns one stream per device
(:class:`ThreadStreams`). Device<->host copies are only asynchronous from and to pinned memory, so
file tiers stage through a small ring of pinned buffers per thread and device (:class:`DeviceIO`).

Note: [Staging reuse waits for its last copy]
    A host-to-device copy reads its staging slot when the stream gets to it, after ``upload`` returned.
    The slot is refilled only after the event recorded behind that copy completed (``acquire``), or a
    later chunk's bytes would be what the earlier chunk's copy delivers. With two slots, reading chunk
    i+1 from the file overlaps the copy of chunk i.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from teraio.runtime.config import PAGE_NBYTES
from teraio.runtime.device import Device

STAGING_SLOTS = 2


class _Slot:
    def __init__(self, device: Device, nbytes: int) -> None:
        self.buffer = device.empty_pinned(nbytes)
        if self.buffer.data_ptr() % PAGE_NBYTES:
            # O_DIRECT into pinned memory needs page alignment; cudaHostAlloc and the fake give it.
            raise RuntimeError("pinned staging memory is not page-aligned; O_DIRECT cannot use it")
        self.event = device.new_event()


class DeviceIO:
    """One I/O thread's stream and staging ring for one device. Only that thread uses it."""

    def __init__(self, device: Device, torch_device: torch.device, slot_nbytes: int) -> None:
        self.device = device
        self.torch_device = torch_device
        self.stream = device.new_stream(torch_device)
        self._slot_nbytes = slot_nbytes
        self._slots: list[_Slot] = []
        self._next = 0

    def wait(self, event: Any) -> None:
        """Order later work on this thread's stream after ``event`` (no host block)."""
        self.device.wait(self.stream, event)

    def acquire(self) -> _Slot:
        """The next staging slot, once the copy that last used it finished.

        Note: [Staging reuse waits for its last copy]
        """
        if len(self._slots) < STAGING_SLOTS:
            self._slots.append(_Slot(self.device, self._slot_nbytes))
            slot = self._slots[-1]
        else:
            slot = self._slots[self._next]
            self._next = (self._next + 1) % STAGING_SLOTS
            self.reuse_wait(slot)
        return slot

    def reuse_wait(self, slot: _Slot) -> None:
        """Block until ``slot``'s last copy ran (a named step so tests can show what removing it breaks)."""
        self.device.synchronize_event(slot.event)

    def download(self, dst_pinned: torch.Tensor, src: torch.Tensor) -> None:
        """Copy device bytes ``src`` into pinned ``dst_pinned`` on this stream and wait until they landed
        (the caller writes them to a file or keeps them as the host copy next)."""
        self.device.copy_async(dst_pinned, src, self.stream)
        done = self.device.new_event()
        self.device.record(done, self.stream)
        self.device.synchronize_event(done)

    def upload(self, dst: torch.Tensor, src_pinned: torch.Tensor, slot: _Slot | None = None) -> None:
        """Enqueue a copy of pinned ``src_pinned`` into device bytes ``dst``; do not wait. With ``slot``,
        mark the slot busy until the copy ran."""
        self.device.copy_async(dst, src_pinned, self.stream)
        if slot is not None:
            self.device.record(slot.event, self.stream)

    def checksum(self, t: torch.Tensor) -> int:
        """The device-side checksum of ``t``, ordered after everything enqueued on this stream."""
        return self.device.checksum(t, self.stream)

    def synchronize(self) -> None:
        """Block this thread until its stream is idle (before a call that is not stream-ordered)."""
        self.device.synchronize_stream(self.stream)


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
