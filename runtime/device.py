"""The one door to the accelerator: streams, events, device<->host copies, pinned memory, memory stats.

Every CUDA call of the runtime goes through a :class:`Device`, so the ordering rules that matter on a
GPU (a copy must wait for the kernel that produced its source, a buffer must not be refilled while a
copy still reads it, a kernel must not read bytes still in flight) can be tested on a machine without
one: tests install :class:`teraio.runtime.fake_device.FakeDevice`, whose streams run their work late on
worker threads, so a missing wait shows up as wrong bytes instead of passing by luck.

The real implementation, :class:`CudaDevice`, is a thin layer over ``torch.cuda``. teraio's measurement
(op timing with events, the step's peak from ``max_memory_allocated``) may use the same object
(``current()``); the runtime never imports teraio.

Streams and events are opaque objects owned by the device that made them: pass them back to it, never
call their methods directly (the fake's objects are not torch's). Whether a tensor is device memory is
``dev.owns(t)``, not ``t.is_cuda``: the fake's device memory is CPU memory it registered.

For measurement (teraio's profiler and peak recorder), with ``dev = current()``:

- time an op on the device, not its launch: ``start, end = dev.new_event(timing=True), ...``;
  ``dev.record(start, dev.current_stream(d))``, run the op, ``dev.record(end, ...)``; after the step
  ``dev.synchronize_event(end)`` and ``dev.elapsed_ms(start, end)``;
- the peak of one step: ``dev.synchronize(d)``, ``base = dev.memory_allocated(d)``,
  ``dev.reset_peak_memory_stats(d)``, run the step, ``dev.synchronize(d)``,
  ``dev.max_memory_allocated(d) - base``.

The fake makes both testable on CPU: ``fake.launch(fn)`` queues a "kernel" that runs late, its timing
events bracket the kernel's execution, and ``fake.empty``/``fake.adopt`` memory is counted.

Note: [Every host wait has a reason]
    A runtime thread that blocks on the device (``synchronize_event``/``synchronize_stream``/
    ``synchronize``) does so inside ``with host_wait(HostWait.X):``, where ``X`` names the Note that
    justifies it; there are only the few listed in :class:`HostWait`, and none is on the path of
    ``fetch``, ``prefetch`` or ``drop``. The fake device's host-blocked detector
    (``runtime.fake_device``) fails any wait that would be held back by paused (busy) device work
    unless it carries such a reason, so a new, unjustified wait shows up as a failing test.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol, runtime_checkable

import torch

# The checksum of device bytes views them as rows of this many bytes (see byte_checksum).
CHECKSUM_ROW_NBYTES = 4096


class HostWait(Enum):
    """The reasons a runtime thread may block on the device (Note: [Every host wait has a reason]).

    Each value is the Note that justifies the wait; the fake device's detector lets a wait through only
    inside ``host_wait(reason)``.
    """

    #: An I/O thread waits for its own device-to-host copy of a write's source (which runs after the
    #: producer's kernels) before it can write the bytes to the file: the file write needs them.
    WRITE_SOURCE = "Note: [A write waits for its source bytes] (runtime/staging.py)"
    #: An I/O thread waits for a GPUDirect read into its staging memory: a disk read, ordered after
    #: nothing else (the stream carries no other work), like a POSIX pread.
    DISK_READ = "Note: [GDS reads land in staging first] (runtime/tiers/gds.py)"
    #: ``Engine.synchronize``/``close``: the caller asked for every transfer and check to finish.
    SYNCHRONIZE = "Note: [Device checks are read later] (runtime/engine.py)"


_wait_reason = threading.local()


@contextlib.contextmanager
def host_wait(reason: HostWait) -> Iterator[None]:
    """Declare why the calling thread is about to block on the device (see :class:`HostWait`)."""
    previous = getattr(_wait_reason, "value", None)
    _wait_reason.value = reason
    try:
        yield
    finally:
        _wait_reason.value = previous


def current_host_wait() -> HostWait | None:
    """The reason the calling thread declared with :func:`host_wait`, if it is inside one."""
    return getattr(_wait_reason, "value", None)


@dataclass(eq=False)
class PendingChecksum:
    """A device checksum on its way to the host: ``result`` (2 pinned int64 values) is valid once
    ``event`` completed; :meth:`value` reads it without waiting (the caller checks the event first)."""

    result: torch.Tensor
    event: Any

    def value(self) -> int:
        return fold_checksum(self.result)


@runtime_checkable
class Device(Protocol):
    """What the runtime needs from an accelerator. ``Stream``/``Event`` values are opaque.

    Attributes:
        name: "cuda" or "fake" (logged, and part of the stats' io_path reasoning).
        supports_gds: whether GPUDirect Storage can be tried at all (False for the fake device).
    """

    name: str
    supports_gds: bool

    def available(self) -> bool:
        """Whether device tensors can exist (CUDA present, or the fake installed)."""
        ...

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives in this device's memory (it then needs streams and pinned staging)."""
        ...

    # -- streams and events ----------------------------------------------------------------------
    def current_stream(self, device: torch.device) -> Any:
        """The calling thread's current stream on ``device`` (the compute stream for training code)."""
        ...

    def new_stream(self, device: torch.device) -> Any:
        """A new non-blocking stream on ``device``: no implicit ordering with the legacy default stream
        (a blocking stream's work would wait for every kernel queued on torch's default compute stream).
        Each I/O thread owns a few per device (``runtime.staging``)."""
        ...

    def stream_context(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Make ``stream`` the calling thread's current stream inside the ``with`` block."""
        ...

    def new_event(self, *, timing: bool = False) -> Any:
        """A new event; ``timing=True`` allows :meth:`elapsed_ms` on it."""
        ...

    def record(self, event: Any, stream: Any) -> None:
        """Enqueue ``event`` on ``stream``: it completes when the stream reaches it."""
        ...

    def wait(self, stream: Any, event: Any) -> None:
        """Make later work on ``stream`` wait for ``event`` (as last recorded); the host does not block."""
        ...

    def synchronize_event(self, event: Any) -> None:
        """Block the calling host thread until ``event`` completed (at once if never recorded)."""
        ...

    def event_done(self, event: Any) -> bool:
        """Whether ``event`` completed (True if never recorded)."""
        ...

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Milliseconds between two completed timing events."""
        ...

    def synchronize_stream(self, stream: Any) -> None:
        """Block the calling host thread until all work enqueued on ``stream`` is done."""
        ...

    def synchronize(self, device: torch.device) -> None:
        """Block until every stream of ``device`` is idle."""
        ...

    def raw_stream(self, stream: Any) -> int:
        """The driver's handle (``CUstream``) of ``stream``, for kvikio's stream-ordered calls."""
        ...

    # -- memory -----------------------------------------------------------------------------------
    def empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """``nbytes`` of device memory (1-D uint8), allocated for the calling thread's current stream."""
        ...

    def empty_pinned(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of page-locked host memory (1-D uint8, page-aligned)."""
        ...

    def pinned_nbytes(self, nbytes: int) -> int:
        """How many bytes of pinned memory an ``empty_pinned(nbytes)`` really holds."""
        ...

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        """Enqueue a copy of ``src`` into ``dst`` (same byte size; device memory on both sides, or one side
        device memory and the other pinned host memory) on ``stream``; it returns before the copy runs."""
        ...

    def resize_storage(self, t: torch.Tensor, nbytes: int) -> None:
        """Resize device tensor ``t``'s storage object in place to ``nbytes``: every tensor sharing that
        object (autograd's saved aliases of a parameter) sees the change. Shrinking to 0 gives the block
        back to the caching allocator, which hands it to the next allocation on the stream it was
        allocated for at once, so work still queued on another stream that uses it must be finished
        first. Growing allocates fresh memory for the calling thread's current stream; its bytes are
        undefined until a copy fills them."""
        ...

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        """Declare that work on ``stream`` uses device memory ``t``: when ``t``'s storage is freed, the
        caching allocator hands its block to a new allocation only after ``stream`` finished that work
        (a block is otherwise reused at once on the stream it was allocated for). A no-op for the
        allocation stream itself."""
        ...

    def checksum_async(self, t: torch.Tensor, stream: Any) -> PendingChecksum:
        """Enqueue :func:`byte_checksum` of device bytes ``t`` on ``stream`` and a copy of its result into
        pinned host memory; return at once. The value is on the host when the returned event completed
        (no host wait here, and a pinned destination: a copy to pageable memory would block)."""
        ...

    def cuda_array(self, t: torch.Tensor) -> Any:
        """An object exposing ``__cuda_array_interface__`` over device bytes ``t`` (kvikio's input)."""
        ...

    def memory_allocated(self, device: torch.device) -> int:
        """Bytes of device memory held by tensors now."""
        ...

    def max_memory_allocated(self, device: torch.device) -> int:
        """Peak of :meth:`memory_allocated` since the last :meth:`reset_peak_memory_stats`."""
        ...

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        """Start a new peak at the current allocation."""
        ...


def byte_checksum(t: torch.Tensor) -> torch.Tensor:
    """A position-weighted sum of the bytes of the 1-D uint8 tensor ``t``, computed where ``t`` lives.

    Returns a 2-element int64 tensor: (sum of bytes, sum of byte x (position + 1)), modulo 2**64 (int64
    wrap-around, which makes the result independent of reduction order). Any single changed byte changes
    the first, moved bytes change the second. Device-side on purpose: on the GDS path the bytes never
    pass through host memory, and a host checksum would need a full copy.

    A handful of kernels per call and no temporary larger than the tensor's row or column sums: the bytes
    are viewed as rows of ``CHECKSUM_ROW_NBYTES``; with row sums r_k and column sums c_j, the weighted sum
    is ``W * sum_k k r_k + sum_j (j + 1) c_j``.
    """
    width = CHECKSUM_ROW_NBYTES
    n = t.numel()
    main = n - n % width
    acc = torch.zeros(2, dtype=torch.int64, device=t.device)
    if main:
        grid = t[:main].view(-1, width)
        rows = grid.sum(1, dtype=torch.int64)
        cols = grid.sum(0, dtype=torch.int64)
        k = torch.arange(rows.numel(), dtype=torch.int64, device=t.device)
        j1 = torch.arange(1, width + 1, dtype=torch.int64, device=t.device)
        acc[0] += rows.sum()
        acc[1] += (k * rows).sum() * width + (j1 * cols).sum()
    if main < n:
        tail = t[main:].to(torch.int64)
        pos = torch.arange(main + 1, n + 1, dtype=torch.int64, device=t.device)
        acc[0] += tail.sum()
        acc[1] += (tail * pos).sum()
    return acc


def fold_checksum(pair: torch.Tensor) -> int:
    """One Python int from :func:`byte_checksum`'s two host-side values."""
    a, b = (int(v) for v in pair.tolist())
    return (a & 0xFFFFFFFFFFFFFFFF) << 64 | (b & 0xFFFFFFFFFFFFFFFF)


def pow2_ceil(nbytes: int) -> int:
    """The smallest power of two >= ``nbytes`` (torch's caching host allocator rounds pinned blocks so)."""
    return 1 if nbytes <= 1 else 1 << (nbytes - 1).bit_length()


class _CudaArray:
    """``__cuda_array_interface__`` (version 3) over raw device bytes: no autograd, any dtype."""

    def __init__(self, t: torch.Tensor) -> None:
        self._keep = t
        self.__cuda_array_interface__ = {
            "shape": (t.numel() * t.element_size(),),
            "typestr": "|u1",
            "data": (t.data_ptr(), False),
            "version": 3,
            "strides": None,
        }


class CudaDevice:
    """:class:`Device` over ``torch.cuda``. Nothing here runs in this project's CI (no GPU)."""

    name = "cuda"
    supports_gds = True

    def available(self) -> bool:
        return torch.cuda.is_available()

    def owns(self, t: torch.Tensor) -> bool:
        return t.device.type == "cuda"

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def new_stream(self, device: torch.device) -> Any:
        # torch's pool streams are created with cudaStreamNonBlocking (c10/cuda/CUDAStream.cpp,
        # kDefaultFlags): no implicit synchronisation with the legacy default stream.
        return torch.cuda.Stream(device)

    def stream_context(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def new_event(self, *, timing: bool = False) -> Any:
        return torch.cuda.Event(enable_timing=timing)

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def synchronize_event(self, event: Any) -> None:
        event.synchronize()

    def event_done(self, event: Any) -> bool:
        return event.query()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end)

    def synchronize_stream(self, stream: Any) -> None:
        stream.synchronize()

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def raw_stream(self, stream: Any) -> int:
        return stream.cuda_stream

    def empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def empty_pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def pinned_nbytes(self, nbytes: int) -> int:
        # CachingHostAllocator rounds each request up to a power of two (torch 2.13) and keeps the
        # block cached after it is freed.
        return pow2_ceil(nbytes)

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        with torch.cuda.stream(stream):
            # non_blocking from/to pinned memory is a cudaMemcpyAsync on ``stream``; torch records an
            # event on the pinned block so its allocator does not recycle it before the copy ran.
            dst.copy_(src, non_blocking=True)

    def resize_storage(self, t: torch.Tensor, nbytes: int) -> None:
        t.untyped_storage().resize_(nbytes)

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        t.record_stream(stream)

    def checksum_async(self, t: torch.Tensor, stream: Any) -> PendingChecksum:
        with torch.cuda.stream(stream):
            pair = byte_checksum(t)  # allocated on ``stream``: its block is reused only after this copy
            result = self.empty_pinned(16).view(torch.int64)
            # Pinned and non_blocking: a cudaMemcpyAsync on ``stream``; torch records an event on the
            # pinned block, so the block outlives the copy even if ``result`` is dropped first.
            result.copy_(pair, non_blocking=True)
            event = self.new_event()
            self.record(event, stream)
        return PendingChecksum(result, event)

    def cuda_array(self, t: torch.Tensor) -> Any:
        return _CudaArray(t)

    def memory_allocated(self, device: torch.device) -> int:
        return torch.cuda.memory_allocated(device)

    def max_memory_allocated(self, device: torch.device) -> int:
        return torch.cuda.max_memory_allocated(device)

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        torch.cuda.reset_peak_memory_stats(device)


_lock = threading.Lock()
_current: Device = CudaDevice()


def current() -> Device:
    """The installed device (``CudaDevice`` unless a test installed another)."""
    return _current


def set_current(device: Device) -> Device:
    """Install ``device`` process-wide; return the previous one. Engines keep the device they started with."""
    global _current
    if not isinstance(device, Device):
        raise TypeError(f"{type(device).__name__} does not implement teraio.runtime.device.Device")
    with _lock:
        previous, _current = _current, device
    return previous


@contextlib.contextmanager
def installed(device: Device) -> Iterator[Device]:
    """``with installed(FakeDevice()) as dev:`` runs the block with ``dev`` as the current device."""
    previous = set_current(device)
    try:
        yield device
    finally:
        set_current(previous)
