"""A fake asynchronous accelerator for tests on CPU: work queued on its streams runs late.

On a GPU, a copy or kernel enqueued on a stream runs when the stream reaches it, long after the call
returned; two streams run independently unless an event orders them. CPU code gets none of that for
free, so ordering bugs (a write that reads a tensor before its producer kernel ran, a staging buffer
refilled while a copy still reads it, a kernel that reads fetched bytes before they landed) pass
unnoticed. :class:`FakeDevice` implements :class:`teraio.runtime.device.Device` with

- streams that are worker threads executing their queue in order, each op after ``lag_s`` seconds,
  and that can be paused (``pause``/``resume``, or ``pause_new_streams``) to hold work back
  deterministically;
- events that complete only when their stream reaches them; ``wait`` enqueues a wait on the stream,
  ``synchronize_event`` blocks the host;
- "device memory": CPU memory registered with the fake: ``adopt`` declares a tensor device memory;
  ``empty`` hands out blocks from a pool that, like CUDA's caching allocator, reuses a freed block at
  once for the next allocation on the stream it was allocated for, or, when ``record_stream`` declared
  other streams using it, once each of them reached the point of the free (new blocks hold a poison
  byte, like uninitialised GPU memory); ``memory_allocated`` and ``max_memory_allocated`` account them
  until their storage dies;
- pinned memory (page-aligned, accounted with the power-of-two rounding of torch's caching host
  allocator); ``copy_async`` refuses pageable host memory (on CUDA such a copy is not asynchronous);
- copies and checksums that, like CUDA's, hold only raw addresses of pool blocks: a block freed while
  a copy into it is still queued is handed to the next allocation, and the late copy then lands in
  the new owner's bytes, exactly what CUDA does when nothing settled the block. Pinned host memory and
  adopted tensors stay referenced by the queued copy (torch's caching host allocator records an event
  on a pinned block used by a non-blocking copy and reuses it only after that event);
- non-blocking streams from ``new_stream`` (torch's are), and blocking ones from
  ``new_blocking_stream`` (what a library gets with ``cuStreamCreate(..., CU_STREAM_DEFAULT)``): as on
  CUDA's legacy default stream, work on a blocking stream waits for the default stream's queued work
  and the default stream's work waits for every blocking stream's;
- a host-blocked detector (Note: [Every host wait has a reason], runtime/device.py): a host wait
  (``synchronize_event``/``synchronize_stream``/``synchronize``, from any thread) whose work is held
  back by a paused stream, i.e. by busy compute or a busy copy engine, raises
  :class:`HostBlockedError` (also recorded in ``errors``) unless the waiting thread declared a reason
  with ``runtime.device.host_wait``. Every host wait is logged in ``host_waits``;
- ``resize_storage`` of adopted memory (how a parameter's storage is freed and refilled in place):
  freeing bytes that a queued copy or checksum still uses raises
  :class:`FreedUnderQueuedWorkError`, the use-after-free CUDA would not report; grown bytes hold
  ``POISON_BYTE``;
- ``launch(fn)`` to enqueue a test "kernel" on the calling thread's current stream;
- timing events stamped with ``clock`` when their stream reaches them: a test may pass a virtual clock
  that its fake kernels advance, so that durations measured with events are exact numbers instead of
  wall-clock readings.

Errors raised by queued work are collected in ``errors`` (tests assert it stays empty).

The memory (the caching pool, pinned memory, the use-after-free check) is :class:`FakeMemory` in
``runtime.fake_memory``; the host-blocked detector is :class:`HostWaitDetector` below; ``FakeDevice``
ties them to the streams and events and is the one object tests hold.
"""

from __future__ import annotations

import contextlib
import ctypes
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from teraio.runtime import device as device_module
from teraio.runtime.device import HostWait, PendingChecksum, byte_checksum, pow2_ceil
from teraio.runtime.fake_memory import POISON_BYTE, FakeMemory, FreedUnderQueuedWorkError

__all__ = [  # the memory's names stay importable from here, where tests and tools import the fake
    "POISON_BYTE",
    "FakeDevice",
    "FakeEvent",
    "FakeStream",
    "FreedUnderQueuedWorkError",
    "HostBlockedError",
    "HostWaitDetector",
    "HostWaitRecord",
]


class HostBlockedError(RuntimeError):
    """A thread waited on the fake device for work held back by a paused stream, without a reason."""


@dataclass(frozen=True)
class HostWaitRecord:
    """One host wait on the fake device: who waited, on what, why, and which paused stream held it."""

    thread: str
    what: str
    reason: HostWait | None
    held_by: str | None


def _raw_view(addr: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` at ``addr``: what a kernel sees through its raw pointer."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(addr), dtype=torch.uint8)


class FakeEvent:
    """Completes when the stream it was last recorded on reaches it."""

    def __init__(self, device: FakeDevice, timing: bool) -> None:
        self._device = device
        self._cond = threading.Condition()
        self._recorded = 0  # generation of the last record()
        self._completed = 0  # highest generation its stream reached
        self._positions: dict[int, tuple[FakeStream, int]] = {}  # generation -> (stream, op number)
        self.time_s: float | None = None
        self.timing = timing

    def _complete(self, generation: int) -> None:
        with self._cond:
            self._completed = max(self._completed, generation)
            if self.timing:
                self.time_s = self._device.clock()
            self._cond.notify_all()

    def _wait_for(self, generation: int) -> None:
        with self._cond:
            while self._completed < generation:
                self._cond.wait()

    def done(self) -> bool:
        with self._cond:
            return self._completed >= self._recorded


class FakeStream:
    """A queue run in order by its own thread. ``blocked`` is True while it waits on an event.

    Ops are numbered in enqueue order (``enqueued_seq``); ``done_seq`` counts those that ran, so "the
    stream reached op n" is ``done_seq >= n``. ``blocking`` streams follow the legacy default stream's
    implicit synchronisation (see :meth:`FakeDevice.new_blocking_stream`).
    """

    def __init__(
        self, device: FakeDevice, name: str, lag_s: float, paused: bool, handle: int, blocking: bool = False
    ) -> None:
        self.device = device
        self.name = name
        self.lag_s = lag_s
        self.blocking = blocking
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._run = threading.Event()
        if not paused:
            self._run.set()
        self._cond = threading.Condition()
        self.pending = 0  # ops enqueued and not finished
        self.enqueued_seq = 0
        self.done_seq = 0
        self.blocked = False
        # (op number of a wait op, event, generation): what this stream waits for, for the detector
        self.waits: list[tuple[int, FakeEvent, int]] = []
        self.handle = handle
        self._thread = threading.Thread(target=self._loop, name=f"fake-stream-{name}", daemon=True)
        self._thread.start()

    def enqueue(self, op: Callable[[], None]) -> int:
        """Enqueue ``op`` after the implicit waits of a blocking stream; return its op number."""
        self.device._implicit_sync(self)
        return self._put(op)

    def _put(self, op: Callable[[], None], waits_for: tuple[FakeEvent, int] | None = None) -> int:
        with self._cond:
            self.pending += 1
            self.enqueued_seq += 1
            seq = self.enqueued_seq
            if waits_for is not None:
                self.waits = [w for w in self.waits if w[0] > self.done_seq]
                self.waits.append((seq, *waits_for))
            self._queue.put(op)
        return seq

    def _loop(self) -> None:
        while True:
            op = self._queue.get()
            if op is None:
                return
            self._run.wait()
            if self.lag_s:
                time.sleep(self.lag_s)
            try:
                op()
            except BaseException as exc:  # noqa: BLE001 - reported through device.errors
                self.device.errors.append(exc)
            # The op's closure (and any tensor it holds) goes when the op ran, not when the next op
            # arrives: a stream that is idle holds no memory, so frees are deterministic in tests.
            op = None
            with self._cond:
                self.pending -= 1
                self.done_seq += 1
                self._cond.notify_all()

    def when_reached(self, op: Callable[[], None]) -> None:
        """Run ``op`` when the stream gets to this point: bookkeeping (the allocator's), not stream work,
        so none of a blocking stream's implicit waits."""
        self._put(op)

    def paused(self) -> bool:
        return not self._run.is_set()

    def synchronize(self) -> None:
        with self._cond:
            while self.pending:
                self._cond.wait()

    def settled(self) -> bool:
        """Nothing left it could run now: idle, paused, or blocked on an event."""
        with self._cond:
            return self.pending == 0 or self.blocked or not self._run.is_set()

    def close(self) -> None:
        self._run.set()
        self._queue.put(None)


class HostWaitDetector:
    """The fake's host-blocked detector (Note: [Every host wait has a reason], runtime/device.py).

    Logs every host wait in ``records``, counts the host threads blocked right now in ``waiters``, and
    raises :class:`HostBlockedError` (also appended to ``errors``) for a wait that work held back by a
    paused stream blocks, unless the waiting thread declared a reason with ``runtime.device.host_wait``.
    """

    def __init__(self, errors: list[BaseException]) -> None:
        self._errors = errors
        self._lock = threading.Lock()
        self.records: list[HostWaitRecord] = []  # every host wait, in order
        self.waiters = 0  # host threads blocked in synchronize_event / synchronize_stream

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Count the calling thread among ``waiters`` while it blocks."""
        with self._lock:
            self.waiters += 1
        try:
            yield
        finally:
            with self._lock:
                self.waiters -= 1

    def held_by(
        self, stream: FakeStream, seq: int, seen: set[tuple[int, int]] | None = None
    ) -> FakeStream | None:
        """The paused stream holding back op ``seq`` of ``stream`` (directly, or through the events its
        wait ops wait for), or None when that op will run without anyone resuming a stream."""
        seen = set() if seen is None else seen
        if (id(stream), seq) in seen:
            return None
        seen.add((id(stream), seq))
        with stream._cond:
            if stream.done_seq >= seq:
                return None
            waits = [w for w in stream.waits if stream.done_seq < w[0] <= seq]
        if stream.paused():
            return stream
        for _, event, generation in waits:
            with event._cond:
                if event._completed >= generation:
                    continue
                where = event._positions.get(generation)
            if where is not None:
                held = self.held_by(where[0], where[1], seen)
                if held is not None:
                    return held
        return None

    def check(self, targets: list[tuple[FakeStream, int]], what: str) -> None:
        """Log a host wait for ops ``targets`` (stream, op number), and raise when paused work holds it
        back and the thread declared no reason (Note: [Every host wait has a reason])."""
        held = None
        for stream, seq in targets:
            held = self.held_by(stream, seq)
            if held is not None:
                break
        reason = device_module.current_host_wait()
        thread = threading.current_thread().name
        with self._lock:
            self.records.append(HostWaitRecord(thread, what, reason, held.name if held else None))
        if held is not None and reason is None:
            err = HostBlockedError(
                f"host thread {thread!r} waits on {what}, which paused stream {held.name!r} holds back "
                "(busy device work): a host wait with no reason from runtime.device.HostWait "
                "(Note: [Every host wait has a reason])"
            )
            self._errors.append(err)
            raise err


class FakeDevice:
    """A :class:`teraio.runtime.device.Device` whose streams run late on worker threads (see module doc).

    Args:
        lag_s: delay before each op on every stream (default 0: ordering comes from pausing).
        pause_new_streams: streams made by ``new_stream`` (the runtime's I/O streams) start paused.
        clock: seconds, read when a timing event completes (default ``time.perf_counter``).
    """

    name = "fake"
    supports_gds = False

    def __init__(
        self,
        *,
        lag_s: float = 0.0,
        pause_new_streams: bool = False,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.lag_s = lag_s
        self.pause_new_streams = pause_new_streams
        self.clock = clock
        self.errors: list[BaseException] = []
        self.log: list[tuple[str, str]] = []  # (what, stream name) of every copy and kernel run
        self.stream_uses: list[tuple[int, str]] = []  # (address, stream name) of every record_stream
        self.queued: list[tuple[str, FakeStream, int]] = []  # (what, stream, op number) of each copy/kernel
        self._lock = threading.Lock()
        self._streams: list[FakeStream] = []
        self._by_handle: dict[int, FakeStream] = {}
        self._local = threading.local()
        # Handle 0 is CUDA's legacy default stream (what a driver call with a NULL stream means).
        self.default_stream = self._make_stream("default", paused=False)
        self.memory = FakeMemory(self.errors)  # device and pinned memory (runtime.fake_memory)
        self._detector = HostWaitDetector(self.errors)
        self.host_waits = self._detector.records  # every host wait, in order

    # -- test controls ---------------------------------------------------------------------------
    def _make_stream(self, name: str, paused: bool, blocking: bool = False) -> FakeStream:
        with self._lock:
            handle = 0 if not self._streams else 0x7E7A0000 + len(self._streams)
        stream = FakeStream(self, name, self.lag_s, paused, handle, blocking)
        with self._lock:
            self._streams.append(stream)
            self._by_handle[handle] = stream
        return stream

    def new_blocking_stream(self, name: str | None = None) -> FakeStream:
        """A stream with CUDA's legacy implicit synchronisation, like one a library creates with
        ``cuStreamCreate(&s, CU_STREAM_DEFAULT)``: its work waits for the work queued on the default
        stream before it, and later default-stream work waits for it. (torch's own streams, and the
        runtime's from :meth:`new_stream`, are non-blocking.)"""
        return self._make_stream(name or f"blocking{len(self._streams)}", paused=False, blocking=True)

    def stream_for_handle(self, handle: int) -> FakeStream:
        """The stream whose :meth:`raw_stream` is ``handle`` (0: the legacy default stream)."""
        with self._lock:
            stream = self._by_handle.get(handle)
        if stream is None:
            raise ValueError(f"fake device: no stream with handle {handle:#x}")
        return stream

    def _implicit_sync(self, stream: FakeStream) -> None:
        """CUDA's legacy default stream semantics: a blocking stream's next op waits for the default
        stream's queued work; a default-stream op waits for every blocking stream's queued work."""
        if stream.blocking:
            others = [self.default_stream]
        elif stream is self.default_stream:
            others = [s for s in self.streams if s.blocking]
        else:
            return
        for other in others:
            with other._cond:
                busy = other.pending > 0
            if busy:
                marker = FakeEvent(self, timing=False)
                self._record_raw(marker, other)
                self._wait_raw(stream, marker)

    @property
    def streams(self) -> list[FakeStream]:
        with self._lock:
            return list(self._streams)

    def pause(self, stream: FakeStream) -> None:
        """Hold back everything ``stream`` has not started yet."""
        stream._run.clear()

    def resume(self, stream: FakeStream | None = None) -> None:
        """Let ``stream`` (every stream when None) run again; also clears ``pause_new_streams``."""
        if stream is None:
            self.pause_new_streams = False
        for s in [stream] if stream is not None else self.streams:
            s._run.set()

    def launch(self, kernel: Callable[[], None], stream: FakeStream | None = None) -> None:
        """Enqueue ``kernel`` (a Python callable standing for a CUDA kernel) on ``stream`` or the
        calling thread's current stream."""
        target = stream or self._current()

        def op() -> None:
            self.log.append(("kernel", target.name))
            kernel()

        self.queued.append(("kernel", target, target.enqueue(op)))

    def ordered_after(self, earlier: tuple[FakeStream, int], later: tuple[FakeStream, int]) -> bool:
        """Whether op ``later`` (stream, op number) cannot run before op ``earlier`` has: same stream and
        later in it, or behind a wait for an event recorded after ``earlier`` (transitively). Ask before
        the ops ran (the record of waits that already ran is dropped)."""
        seen: set[tuple[int, int]] = set()

        def after(stream: FakeStream, seq: int) -> bool:
            if stream is earlier[0]:
                return seq > earlier[1]
            if (id(stream), seq) in seen:
                return False
            seen.add((id(stream), seq))
            with stream._cond:
                waits = [w for w in stream.waits if w[0] < seq]
            for _, event, generation in waits:
                with event._cond:
                    where = event._positions.get(generation)
                if where is not None and after(*where):
                    return True
            return False

        return after(*later)

    def settled(self) -> bool:
        """Every stream idle, paused or blocked on an event (nothing would run without help)."""
        return all(s.settled() for s in self.streams)

    def wait_until(self, condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
        """Poll ``condition`` until true; raise TimeoutError after ``timeout_s`` (a deadlock guard only)."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError("fake device: condition not reached (deadlock?)")
            time.sleep(0.001)

    def adopt(self, t: torch.Tensor) -> torch.Tensor:
        """Declare CPU tensor ``t``'s storage device memory of this fake; return ``t``."""
        self.memory.adopt(t.untyped_storage())
        return t

    @property
    def host_waiters(self) -> int:
        """Host threads blocked in ``synchronize_event`` / ``synchronize_stream`` / ``synchronize`` now."""
        return self._detector.waiters

    # The memory's counters and hooks, where tests and the driver stand-in read and set them.
    @property
    def allocated_nbytes(self) -> int:
        return self.memory.allocated_nbytes

    @property
    def peak_allocated_nbytes(self) -> int:
        return self.memory.peak_allocated_nbytes

    @property
    def pinned_allocated_nbytes(self) -> int:
        return self.memory.pinned_allocated_nbytes

    @property
    def on_alloc(self) -> Callable[[int, int], None] | None:
        """Called with (address, nbytes) of new device memory (the driver stand-in registers it)."""
        return self.memory.on_alloc

    @on_alloc.setter
    def on_alloc(self, hook: Callable[[int, int], None] | None) -> None:
        self.memory.on_alloc = hook

    @property
    def on_free(self) -> Callable[[int], None] | None:
        """Called with the address of device memory freed for good."""
        return self.memory.on_free

    @on_free.setter
    def on_free(self, hook: Callable[[int], None] | None) -> None:
        self.memory.on_free = hook

    def close(self) -> None:
        """Stop every stream thread (pending work still runs first)."""
        for s in self.streams:
            s.close()
        for s in self.streams:
            s._thread.join(timeout=60)
        self.memory.release_blocks()

    # -- Device: streams and events ------------------------------------------------------------------
    def available(self) -> bool:
        return True

    def owns(self, t: torch.Tensor) -> bool:
        return self.memory.owns(t)

    def _current(self) -> FakeStream:
        return getattr(self._local, "stream", None) or self.default_stream

    def current_stream(self, device: torch.device) -> Any:
        return self._current()

    def new_stream(self, device: torch.device) -> Any:
        return self._make_stream(f"s{len(self._streams)}", paused=self.pause_new_streams)

    @contextlib.contextmanager
    def stream_context(self, stream: Any) -> Iterator[Any]:
        previous = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield stream
        finally:
            self._local.stream = previous

    def new_event(self, *, timing: bool = False) -> Any:
        return FakeEvent(self, timing)

    def record(self, event: FakeEvent, stream: FakeStream) -> None:
        self._implicit_sync(stream)
        self._record_raw(event, stream)

    def _record_raw(self, event: FakeEvent, stream: FakeStream) -> None:
        with event._cond:
            event._recorded += 1
            generation = event._recorded
            # Numbered before it is queued, so a host wait right after sees where it is.
            seq = stream._put(lambda: event._complete(generation))
            # Keep the generations a stream may still wait for (older ones completed).
            event._positions = {g: w for g, w in event._positions.items() if g > event._completed}
            event._positions[generation] = (stream, seq)

    def wait(self, stream: FakeStream, event: FakeEvent) -> None:
        self._implicit_sync(stream)
        self._wait_raw(stream, event)

    def _wait_raw(self, stream: FakeStream, event: FakeEvent) -> None:
        with event._cond:
            generation = event._recorded

        def op() -> None:
            with stream._cond:
                stream.blocked = True
            try:
                event._wait_for(generation)
            finally:
                with stream._cond:
                    stream.blocked = False

        stream._put(op, waits_for=(event, generation))

    def synchronize_event(self, event: FakeEvent) -> None:
        with event._cond:
            generation = event._recorded
            where = event._positions.get(generation)
        if where is not None:
            self._detector.check([where], f"an event on stream {where[0].name!r}")
        with self._detector.waiting():
            event._wait_for(generation)

    def event_done(self, event: FakeEvent) -> bool:
        return event.done()

    def elapsed_ms(self, start: FakeEvent, end: FakeEvent) -> float:
        if start.time_s is None or end.time_s is None:
            raise RuntimeError("elapsed_ms needs two completed events made with timing=True")
        return (end.time_s - start.time_s) * 1e3

    def synchronize_stream(self, stream: FakeStream) -> None:
        self._detector.check([(stream, stream.enqueued_seq)], f"stream {stream.name!r}")
        with self._detector.waiting():
            stream.synchronize()

    def synchronize(self, device: torch.device) -> None:
        streams = self.streams
        self._detector.check([(s, s.enqueued_seq) for s in streams], "every stream (device synchronize)")
        with self._detector.waiting():
            for s in streams:
                s.synchronize()

    def raw_stream(self, stream: FakeStream) -> int:
        return stream.handle  # stream_for_handle maps it back (the driver stand-in's hooks use it)

    # -- Device: memory (runtime.fake_memory) -----------------------------------------------------
    def empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """Device memory from a pool that behaves like CUDA's caching allocator: a block freed by the host
        is handed out again at once to an allocation on the stream it was allocated for (same size, last
        freed first) with its old bytes, even while kernels queued earlier still use it; a block on which
        ``record_stream`` declared other streams waits for them (see :meth:`record_stream`). Only a new
        block holds ``POISON_BYTE``."""
        return self.memory.empty(nbytes, self._current())

    def empty_pinned(self, nbytes: int) -> torch.Tensor:
        return self.memory.empty_pinned(nbytes, held=self.pinned_nbytes(nbytes))

    def is_pinned(self, t: torch.Tensor) -> bool:
        return self.memory.is_pinned(t)

    def pinned_nbytes(self, nbytes: int) -> int:
        return pow2_ceil(nbytes)

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, stream: FakeStream) -> None:
        nbytes = dst.numel() * dst.element_size()
        if nbytes != src.numel() * src.element_size() or not (dst.is_contiguous() and src.is_contiguous()):
            raise ValueError("fake copy_async: contiguous tensors of equal byte size only")
        host = [t for t in (dst, src) if not self.owns(t)]
        if any(not self.is_pinned(t) for t in host):
            raise ValueError(
                "fake copy_async: host side is pageable memory; CUDA copies from/to pageable memory are "
                "not asynchronous: stage through pinned memory"
            )
        what = "copy D2H" if host and host[0] is dst else ("copy H2D" if host else "copy D2D")
        self.memory.check_allocated(what, dst, src)
        dst_addr, src_addr = dst.data_ptr(), src.data_ptr()
        # Like a CUDA copy, hold raw addresses only of pool blocks (their memory lives as long as the
        # fake; a freed one may already belong to the next allocation when the copy runs). Pinned host
        # memory stays referenced (torch's host allocator keeps a block until its copy's event), and so
        # does adopted memory (the test's own tensors, not pooled).
        keep = tuple(t for t in (dst, src) if not self.memory.pooled_block(t))

        def op() -> None:
            self.log.append((what, stream.name))
            ctypes.memmove(dst_addr, src_addr, nbytes)
            del keep_alive[:]

        keep_alive = list(keep)
        seq = stream.enqueue(op)
        self.queued.append((what, stream, seq))
        self._touch(stream, seq, what, *(t for t in (dst, src) if self.owns(t)))

    def _touch(self, stream: FakeStream, seq: int, what: str, *tensors: torch.Tensor) -> None:
        for t in tensors:
            self.queued_use(stream, seq, t.data_ptr(), t.numel() * t.element_size(), what)

    def queued_use(self, stream: FakeStream, seq: int, addr: int, nbytes: int, what: str) -> None:
        """Declare that op ``seq`` queued on ``stream`` uses ``nbytes`` at raw address ``addr`` until it
        ran (the driver stand-in's copies and the fake cuFile's transfers, which hold raw addresses):
        :meth:`resize_storage` refuses to free those bytes under it."""
        self.memory.queued_use(stream, seq, addr, nbytes, what)

    def resize_storage(self, t: torch.Tensor, nbytes: int) -> None:
        """Resize an adopted tensor's storage object (pool blocks have a fixed size). Shrinking it while a
        copy or checksum queued on any stream still uses its bytes raises
        :class:`FreedUnderQueuedWorkError` (recorded in ``errors`` too) and frees nothing. On CUDA that
        is a bug for work on another stream than the block's allocation stream; for work on that stream
        CUDA would be safe (the next allocation is ordered after it), but the fake is stricter there,
        since its freed bytes go back to the C allocator at once and the late copy would touch freed
        memory. Growing fills the new bytes with ``POISON_BYTE`` (the old bytes stay, as torch's resize
        copies them)."""
        self.memory.resize_storage(t, nbytes)

    def record_stream(self, t: torch.Tensor, stream: FakeStream) -> None:
        """Logged in ``stream_uses``; for a pool block, ``stream`` (unless it is the block's allocation
        stream) must reach the point of the free before the block is handed out again."""
        self.stream_uses.append((t.untyped_storage().data_ptr(), stream.name))
        self.memory.record_stream(t, stream)

    def checksum_async(self, t: torch.Tensor, stream: FakeStream) -> PendingChecksum:
        """The checksum "kernel" reads ``t`` through its raw address when the stream reaches it (a freed
        and reused pool block gives the new owner's bytes, as on CUDA); its result lands in 16 pinned
        bytes, and the returned event completes behind that copy."""
        self.memory.check_allocated("checksum", t)
        result = self.empty_pinned(16).view(torch.int64)
        addr, nbytes = t.data_ptr(), t.numel() * t.element_size()
        keep_alive = [] if self.memory.pooled_block(t) else [t]

        def op() -> None:
            self.log.append(("checksum", stream.name))
            result.copy_(byte_checksum(_raw_view(addr, nbytes)))
            del keep_alive[:]

        seq = stream.enqueue(op)
        self.queued.append(("checksum", stream, seq))
        self._touch(stream, seq, "checksum", t)
        event = FakeEvent(self, timing=False)
        self.record(event, stream)
        return PendingChecksum(result, event)

    def cuda_array(self, t: torch.Tensor) -> Any:
        from teraio.runtime.device import _CudaArray

        return _CudaArray(t)

    def memory_allocated(self, device: torch.device) -> int:
        return self.memory.allocated_nbytes

    def max_memory_allocated(self, device: torch.device) -> int:
        return self.memory.peak_allocated_nbytes

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        self.memory.reset_peak()
