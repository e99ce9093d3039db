"""The fake device's memory: CPU memory that behaves like CUDA's caching allocator and pinned memory.

:class:`teraio.runtime.fake_device.FakeDevice` runs stream work late; this module decides which bytes
that late work lands in. Device blocks come from a pool that, like CUDA's caching allocator, hands a
freed block to the next allocation on the stream it was allocated for at once (or, once
``record_stream`` declared other streams using it, after each of them reached the point of the free),
so a copy still queued into a freed block writes the new owner's bytes, as on a GPU. New blocks hold
``POISON_BYTE``. Pinned host memory is accounted with the power-of-two rounding of torch's caching
host allocator. Adopted tensors (a test's own tensors declared device memory) may be resized in place,
and freeing bytes that queued work still uses raises :class:`FreedUnderQueuedWorkError`: the
use-after-free CUDA would not report.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from teraio.runtime.buffers import aligned_buffer

if TYPE_CHECKING:
    from teraio.runtime.fake_device import FakeStream

POISON_BYTE = 0xA5  # what fresh fake device memory holds (real device memory is uninitialised)


class FreedUnderQueuedWorkError(RuntimeError):
    """Device memory was freed (``resize_storage`` to fewer bytes) while a queued copy or checksum still
    uses it, or a copy was queued on freed memory: on CUDA the block would go to the next allocation
    at once and the late copy would read, or write, the new owner's bytes."""


@dataclass(frozen=True)
class _Touch:
    """Device bytes a queued copy or checksum uses through their raw address, until its stream ran it."""

    stream: FakeStream
    seq: int
    addr: int
    nbytes: int
    what: str


@dataclass(eq=False)
class _PooledBlock:
    """A pool block while a storage uses it: the stream it was allocated for, and the other streams
    ``record_stream`` declared (the block returns to the pool once each of them reached the free)."""

    block: torch.Tensor
    stream: FakeStream
    uses: set[FakeStream] = field(default_factory=set)


class FakeMemory:
    """Device and pinned memory of one fake device, and what queued work still uses of it.

    Args:
        errors: the fake device's list of errors (a use-after-free is recorded there too).
    """

    def __init__(self, errors: list[BaseException]) -> None:
        self._errors = errors
        self._lock = threading.Lock()
        self._device_storages: dict[int, weakref.ref] = {}
        self._device_nbytes: dict[int, int] = {}  # storage _cdata -> bytes it holds now (resize_storage)
        self._touches: list[_Touch] = []  # queued copies' and checksums' device bytes (resize checks)
        self._blocks: list[
            torch.Tensor
        ] = []  # every pooled device block ever made (kept for the fake's life)
        self._free_blocks: dict[tuple[FakeStream, int], list[torch.Tensor]] = {}  # (stream, nbytes)
        self._pooled: dict[int, _PooledBlock] = {}  # storage _cdata -> its block, while it lives
        self._pinned_storages: dict[int, weakref.ref] = {}
        self.allocated_nbytes = 0
        self.peak_allocated_nbytes = 0
        self.pinned_allocated_nbytes = 0
        self.on_alloc: Callable[[int, int], None] | None = None  # (address, nbytes) of new device memory
        self.on_free: Callable[[int], None] | None = None

    # -- device memory ----------------------------------------------------------------------------
    def adopt(self, storage: torch.UntypedStorage) -> None:
        """Declare ``storage`` (CPU memory) device memory until it dies."""
        self._register_device(storage)

    def _register_device(self, storage: torch.UntypedStorage, pooled: _PooledBlock | None = None) -> None:
        """Account ``storage`` as device memory until it dies; a ``pooled`` block then returns to the pool."""
        nbytes = storage.nbytes()
        addr = storage.data_ptr()
        with self._lock:
            self._device_storages[storage._cdata] = weakref.ref(storage)
            self._device_nbytes[storage._cdata] = nbytes
            if pooled is not None:
                self._pooled[storage._cdata] = pooled
            self.allocated_nbytes += nbytes
            self.peak_allocated_nbytes = max(self.peak_allocated_nbytes, self.allocated_nbytes)
        if pooled is None and self.on_alloc is not None:
            self.on_alloc(addr, nbytes)
        weakref.finalize(storage, self._device_freed, storage._cdata, addr)

    def _device_freed(self, cdata: int, addr: int) -> None:
        with self._lock:
            self._device_storages.pop(cdata, None)
            self.allocated_nbytes -= self._device_nbytes.pop(cdata, 0)
            pooled = self._pooled.pop(cdata, None)
        if pooled is not None:
            self._return_block(pooled)
        elif self.on_free is not None:
            self.on_free(addr)

    def _return_block(self, pooled: _PooledBlock) -> None:
        """Back to its stream's pool at once, or, like CUDA's allocator with streams recorded on the block
        (an event per stream at the free), once every recorded stream reached this point."""
        key = (pooled.stream, pooled.block.numel())
        left = [len(pooled.uses)]

        def reached() -> None:
            with self._lock:
                left[0] -= 1
                if left[0] <= 0:
                    self._free_blocks.setdefault(key, []).append(pooled.block)

        if not pooled.uses:
            reached()
        for stream in pooled.uses:
            stream.when_reached(reached)

    def empty(self, nbytes: int, stream: FakeStream) -> torch.Tensor:
        """``nbytes`` of device memory for ``stream`` (see :meth:`teraio.runtime.fake_device.FakeDevice.empty`)."""
        if nbytes == 0:
            t = torch.empty(0, dtype=torch.uint8)
            self._register_device(t.untyped_storage())
            return t
        with self._lock:
            free = self._free_blocks.get((stream, nbytes))
            block = free.pop() if free else None
        if block is None:
            block = aligned_buffer(nbytes)  # owned by the fake for its lifetime, like a cached segment
            ctypes.memset(block.data_ptr(), POISON_BYTE, nbytes)
            with self._lock:
                self._blocks.append(block)
            if self.on_alloc is not None:
                self.on_alloc(block.data_ptr(), nbytes)
        # A new storage object over the block: identity (and ``owns``) per allocation, memory reused.
        t = torch.frombuffer((ctypes.c_char * nbytes).from_address(block.data_ptr()), dtype=torch.uint8)
        self._register_device(t.untyped_storage(), _PooledBlock(block, stream))
        return t

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage is device memory of this fake (adopted or from the pool)."""
        storage = t.untyped_storage()
        ref = self._device_storages.get(storage._cdata)
        return ref is not None and ref() is storage

    def pooled_block(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage is a block from the pool (not adopted memory)."""
        storage = t.untyped_storage()
        with self._lock:
            pooled = self._pooled.get(storage._cdata)
            ref = self._device_storages.get(storage._cdata)
        return pooled is not None and ref is not None and ref() is storage

    def record_stream(self, t: torch.Tensor, stream: FakeStream) -> None:
        """For a pool block, ``stream`` (unless it is the block's allocation stream) must reach the point
        of the free before the block is handed out again."""
        storage = t.untyped_storage()
        with self._lock:
            pooled = self._pooled.get(storage._cdata)
            ref = self._device_storages.get(storage._cdata)
            if pooled is not None and ref is not None and ref() is storage and stream is not pooled.stream:
                pooled.uses.add(stream)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak_allocated_nbytes = self.allocated_nbytes

    def release_blocks(self) -> None:
        """Report every pool block freed (``on_free``): the fake is closing."""
        if self.on_free is not None:
            with self._lock:
                blocks, self._blocks = self._blocks, []
            for block in blocks:
                self.on_free(block.data_ptr())

    # -- pinned memory ----------------------------------------------------------------------------
    def empty_pinned(self, nbytes: int, held: int) -> torch.Tensor:
        """``nbytes`` of pinned memory, accounted as the ``held`` bytes the host allocator would keep."""
        t = aligned_buffer(max(nbytes, 1))[:nbytes]
        storage = t.untyped_storage()
        with self._lock:
            self._pinned_storages[storage._cdata] = weakref.ref(storage)
            self.pinned_allocated_nbytes += held
        weakref.finalize(storage, self._pinned_freed, storage._cdata, held)
        return t

    def _pinned_freed(self, cdata: int, held: int) -> None:
        with self._lock:
            self._pinned_storages.pop(cdata, None)
            self.pinned_allocated_nbytes -= held

    def is_pinned(self, t: torch.Tensor) -> bool:
        storage = t.untyped_storage()
        ref = self._pinned_storages.get(storage._cdata)
        return ref is not None and ref() is storage

    # -- what queued work uses --------------------------------------------------------------------
    def queued_use(self, stream: FakeStream, seq: int, addr: int, nbytes: int, what: str) -> None:
        """Op ``seq`` queued on ``stream`` uses ``nbytes`` at raw address ``addr`` until it ran."""
        if nbytes <= 0:
            return
        with self._lock:
            self._touches = [x for x in self._touches if x.stream.done_seq < x.seq]
            self._touches.append(_Touch(stream, seq, addr, nbytes, what))

    def check_allocated(self, what: str, *tensors: torch.Tensor) -> None:
        """A copy or checksum queued on device memory whose storage was freed (resized to fewer bytes than
        the tensor spans) raises :class:`FreedUnderQueuedWorkError` instead of touching freed memory."""
        for t in tensors:
            span = (t.storage_offset() + t.numel()) * t.element_size()
            if self.owns(t) and t.numel() and t.untyped_storage().nbytes() < span:
                err = FreedUnderQueuedWorkError(f"a {what} queued on device memory that was already freed")
                self._errors.append(err)
                raise err

    def resize_storage(self, t: torch.Tensor, nbytes: int) -> None:
        """Resize an adopted tensor's storage (see :meth:`teraio.runtime.fake_device.FakeDevice.resize_storage`)."""
        storage = t.untyped_storage()
        if not self.owns(t) or self.pooled_block(t):
            raise ValueError(
                "fake resize_storage: an adopted device tensor only (not host memory, not a pool block)"
            )
        cdata = storage._cdata
        old_addr, old_nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes < old_nbytes:
            with self._lock:
                live = [
                    x
                    for x in self._touches
                    if x.stream.done_seq < x.seq
                    and x.addr < old_addr + old_nbytes
                    and old_addr < x.addr + x.nbytes
                ]
            if live:
                err = FreedUnderQueuedWorkError(
                    f"device memory freed before its queued {live[0].what} on stream {live[0].stream.name} "
                    f"ran ({len(live)} queued use(s)); it would read or write the block's next owner"
                )
                self._errors.append(err)
                raise err
        storage.resize_(nbytes)
        with self._lock:
            self.allocated_nbytes += nbytes - self._device_nbytes.get(cdata, 0)
            self.peak_allocated_nbytes = max(self.peak_allocated_nbytes, self.allocated_nbytes)
            self._device_nbytes[cdata] = nbytes
        if nbytes > old_nbytes:
            ctypes.memset(storage.data_ptr() + old_nbytes, POISON_BYTE, nbytes - old_nbytes)
