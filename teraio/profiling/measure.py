"""Measure what a step really costs: peak memory and wall time, independently of teraio's bookkeeping.

On CPU there are no allocator statistics, so memory comes from the torch profiler's ``[memory]`` events
(docs/measured_facts.md): every allocation and free in the profiled region, in time order; the running sum's
maximum is the peak of bytes allocated during the region (it sees Inductor's buffers too), and its final
value what the region left alive. On CUDA, the device's ``max_memory_allocated`` relative to the start,
asked of that device (``cuda:1`` is not the current device unless the program said so) through
``teraio.runtime.device`` (the fake device in tests). Memory that existed before the region (parameters,
optimizer state, the batch) is not counted.
"""

from __future__ import annotations

import atexit
import bisect
import contextlib
import dataclasses
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from teraio.profiling.collective_frees import (
    WORKER_SPAN_PREFIXES,
    FsdpSpan,
    is_collective_span,
    is_fsdp_all_gather_span,
    is_fsdp_release_span,
    unseen_frees,
)

T = TypeVar("T")


@dataclass(frozen=True)
class MemoryMeasurement:
    peak_bytes: int  # maximum of bytes allocated and not yet freed during the region
    end_bytes: int  # bytes allocated during the region and still alive at its end
    wall_s: float
    method: str  # "torch.profiler" | "cuda"
    #: For a region marked before it stopped: the peak up to the stop, what ran after the mark included
    #: (the optimizer step after a training step's backward), the frees of ``MemoryRecorder.live_before``
    #: counted (Note: [Only the region's own allocations]).
    to_stop_peak_bytes: int | None = None


@dataclass(frozen=True)
class AllocationEvent:
    """One allocation (``nbytes`` > 0) or free (``nbytes`` < 0) the profiler saw."""

    ts_ns: int
    ptr: int
    nbytes: int


def _device_type(device: str) -> str:
    return torch.device(device).type


def _accelerator(device: str) -> Any | None:
    """The runtime device that keeps ``device``'s allocator statistics; None for the CPU path (the torch
    profiler's events), also on a CPU-only build asked about CUDA."""
    if _device_type(device) != "cuda":
        return None
    from teraio.runtime import device as runtime_device

    dev = runtime_device.current()
    return dev if dev.available() else None


def _is_allocation(node: Any) -> bool:
    return node.tag == torch._C._profiler._EventType.Allocation


def allocations_under(nodes: list[Any], device: str) -> list[AllocationEvent]:
    """Every allocation event in the subtrees of ``nodes`` on ``device``'s type, in time order, with the
    frees of collectives' buffers the profiler could not see (Note: [A collective's buffer freed on its
    worker thread] in teraio.profiling.collective_frees)."""
    kind = _device_type(device)
    out: list[AllocationEvent] = []
    in_collectives: list[AllocationEvent] = []
    worker_spans: list[tuple[int, int]] = []
    # Note: [FSDP2 holds its all-gather output past the work] in teraio.profiling.collective_frees.
    fsdp_outputs: dict[tuple[int, int], str] = {}
    fsdp_spans: list[FsdpSpan] = []
    stack: list[tuple[Any, str | None]] = [(n, None) for n in nodes]  # the innermost collective span
    while stack:
        n, collective = stack.pop()
        if _is_allocation(n):
            ef = n.extra_fields
            if ef.device.type == kind:
                out.append(AllocationEvent(int(n.start_time_ns), int(ef.ptr), int(ef.alloc_size)))
                if collective is not None and out[-1].nbytes > 0:
                    in_collectives.append(out[-1])
                    if is_fsdp_all_gather_span(collective):
                        fsdp_outputs[(out[-1].ts_ns, out[-1].ptr)] = collective
        else:
            name = n.name
            if name.startswith(WORKER_SPAN_PREFIXES):
                worker_spans.append((int(n.start_time_ns), int(n.end_time_ns)))
            elif is_fsdp_release_span(name):
                fsdp_spans.append(FsdpSpan(name, int(n.start_time_ns), int(n.end_time_ns)))
            if is_collective_span(name):
                collective = name
        stack.extend((c, collective) for c in n.children)
    out.sort(key=lambda e: e.ts_ns)
    if in_collectives and worker_spans:
        frees = unseen_frees(out, in_collectives, worker_spans, fsdp_outputs, fsdp_spans)
        out += [AllocationEvent(*f) for f in frees]
        out.sort(key=lambda e: e.ts_ns)
    return out


def own_running_bytes(events: list[AllocationEvent]) -> list[tuple[int, int]]:
    """After each event, in time order: its time and the bytes the region's own allocations hold then
    (Note: [Only the region's own allocations])."""
    live: dict[int, int] = {}
    running = 0
    out: list[tuple[int, int]] = []
    for e in events:
        if e.nbytes > 0:
            running -= live.pop(e.ptr, 0)  # Note: [A reused address was freed] in own_peak_bytes
            live[e.ptr] = e.nbytes
            running += e.nbytes
        elif e.ptr in live:
            running -= live.pop(e.ptr)
        out.append((e.ts_ns, running))
    return out


def own_peak_bytes(
    events: list[AllocationEvent], end_ns: int | None = None, live_before: dict[int, int] | None = None
) -> tuple[int, int]:
    """Peak and final bytes of the allocations made among ``events`` (up to ``end_ns``).

    Note: [Only the region's own allocations] A free counts only when the allocation it returns was made
    in the region: the garbage collector freeing an earlier step's tensors, or memory that existed before
    the region, must not lower the running sum (it made measured peaks, and op transients taken as
    peak minus end, depend on when the collector ran). ``live_before`` (address: bytes) names memory that
    existed before the region whose frees do count (a whole step's model states, which the step frees
    and reads back): the running sum then goes below zero when they are freed.

    Note: [A reused address was freed] The profiler records the allocations and frees of the threads it
    was enabled on; a block whose last reference goes in another thread (an I/O worker finishing a write)
    can be freed unseen. An allocation at an address that is still live proves the block there was freed
    first, so it leaves the running sum then.
    """
    live: dict[int, int] = dict(live_before or {})
    running = peak = 0
    for e in events:
        if end_ns is not None and e.ts_ns > end_ns:
            break
        if e.nbytes > 0:
            # Note: [A reused address was freed]
            running -= live.pop(e.ptr, 0)
            live[e.ptr] = e.nbytes
            running += e.nbytes
            peak = max(peak, running)
        elif e.ptr in live:
            running -= live.pop(e.ptr)
    return peak, running


_END_MARK = "teraio::measure_end"
_FREED_MARK = "teraio::freed "


def note_freed(storage: Any) -> None:
    """``storage``'s bytes are about to be freed: Note: [Frees of memory older than the session]."""
    if torch.autograd._profiler_enabled():
        ptr = storage.data_ptr()
        if ptr:
            with torch.profiler.record_function(f"{_FREED_MARK}{ptr} {storage.nbytes()}"):
                pass


def noted_frees(roots: list[Any]) -> list[AllocationEvent]:
    """The frees :func:`note_freed` marked under ``roots``, as free events (Note: [Frees of memory older
    than the session])."""
    out: list[AllocationEvent] = []
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n.name.startswith(_FREED_MARK):
            ptr, nbytes = n.name[len(_FREED_MARK) :].split()
            out.append(AllocationEvent(int(n.start_time_ns), int(ptr), -int(nbytes)))
        stack.extend(n.children)
    return out


# Note: [Frees of memory older than the session]
#     The torch profiler reports no free of a block allocated before its session started ("Memory block
#     of unknown size was allocated before the profiling started"). A whole step's measurement starts
#     with the model states in memory and frees them as the step offloads them (a parameter evicted after
#     its forward, read back for its backward): unseen, those frees made the step's measured peak count
#     each such parameter twice (14% above the truth on the tiny GPT). So the store marks each free of a
#     state's storage with a record function (its address and bytes) while a profiler runs, and the
#     measurement reads those marks as free events.

# ------------------------------------------------------------------------------ one session at a time
# torch's profiler does not nest: a second session started on top of a first one corrupts both. Every
# measurement in the process takes this claim.
_SESSION_LOCK = threading.Lock()
_session_owner: object | None = None


# Note: [A session still open at exit is ended]
#     A whole step's measurement spans calls: it starts in one step and stops in the next. A script that
#     ends inside it (two steps of a smoke test, without backend.close()) left the torch profiler's session
#     open, and torch destroys that session after the interpreter is gone, where it crashed (SIGSEGV in
#     ProfilerStateBase's destructor, seen with torch 2.13 on CPU). So the process's open session is
#     ended at exit, unread, while Python still runs; and stderr, which the session quiets, is given back.
@atexit.register
def _end_open_session() -> None:
    owner = _session_owner
    if isinstance(owner, MemoryRecorder):
        with contextlib.suppress(Exception):
            owner.abandon()


class ProfilerBusyError(RuntimeError):
    """Another memory measurement (of this or another backend) is running."""


def claim_profiler(owner: object) -> bool:
    """Take the process's one profiler session for ``owner``. False when someone else holds it."""
    global _session_owner
    with _SESSION_LOCK:
        if _session_owner is not None and _session_owner is not owner:
            return False
        _session_owner = owner
        return True


def release_profiler(owner: object) -> None:
    global _session_owner
    with _SESSION_LOCK:
        if _session_owner is owner:
            _session_owner = None


# Note: [A session never ends under another session's record functions]
#     A torch RecordFunction keeps the profiler callbacks that were active when it started. When it ends,
#     the profiler's exit callback looks up the session active on the thread *now* and, if there is one,
#     writes the end time and thread id (8 bytes each) into the event the start callback allocated, in
#     the event storage of the session active at the *start*. A session's stop frees that storage (torch
#     2.13: ThreadLocalSubqueue::TorchOpStorage::materialize, inside _disable_profiler). So a record
#     function that starts while session 1 records and ends while session 2 records, session 1 having
#     stopped in between, writes into freed heap memory: whatever reused it is corrupted, and the process
#     dies later (benchmarks/results/gan_two_backends_crash_202611.md has the evidence).
#
#     teraio's sessions that span calls (a step's measurement, a kernel-memory step) start in one
#     compiled call and stop in a later one: the stop runs inside record functions that started while
#     the session recorded, at least the "Torch-Compiled Region" Dynamo opens around every compiled frame
#     and the autograd Function AOTAutograd's graph runs in. That stop is harmless; starting another
#     session before those end is not (two backends: one's measurement stops in a forward, the other's
#     starts in the same forward). So a stop inside a Dynamo-compiled frame leaves a barrier: the
#     outermost compiled frame running then (its identity and code), and no session may start on that
#     thread while that frame runs (ProfilerBusyError: the measurement is tried again at a later call, as
#     when the profiler is busy). A start outside every compiled frame is always allowed, and the barrier
#     goes once its frame is seen gone (at a start, or a backward: StepTracker). A new frame of the same
#     code at the same address looks like the old one: the barrier then holds until the next backward, a
#     delay, never a risk. A session started and stopped inside one call (``start(local=True)``: the
#     census, ``measure_memory``) ends before any record function that was open at its start, so it
#     neither leaves nor heeds a barrier.
#
#     Not covered, since teraio cannot see it: a record_function the loop itself opens while a teraio
#     session records and keeps open past that session's end and the next one's start.
_barriers: dict[int, tuple[int, Any]] = {}  # thread id -> (id, code) of the frame a session stopped in


def _compiled_frames(frame: Any) -> list[Any]:
    """The frames running Dynamo-compiled code from ``frame`` outwards, innermost first (empty where
    Dynamo's map of its code objects is not available)."""
    try:
        from torch._dynamo.utils import orig_code_map
    except ImportError:  # pragma: no cover - a torch without that map: no barrier
        return []
    out = []
    while frame is not None:
        if frame.f_code in orig_code_map:
            out.append(frame)
        frame = frame.f_back
    return out


def _running(thread_id: int, key: tuple[int, Any]) -> bool:
    """Whether the frame ``key`` identifies is (or looks like it is) on that thread's stack."""
    frame = sys._getframe() if thread_id == threading.get_ident() else sys._current_frames().get(thread_id)
    while frame is not None:
        if id(frame) == key[0] and frame.f_code is key[1]:
            return True
        frame = frame.f_back
    return False


def settle_profiler_barriers() -> None:
    """Forget the barriers whose frame returned (Note: [A session never ends under another session's
    record functions]). Cheap; from any ordinary context."""
    with _SESSION_LOCK:
        for tid, key in list(_barriers.items()):
            if not _running(tid, key):
                del _barriers[tid]


def _leave_barrier() -> None:
    """After a session spanning calls stopped: bar new sessions while the compiled frame it stopped in runs."""
    frames = _compiled_frames(sys._getframe())
    if frames:
        outermost = frames[-1]
        with _SESSION_LOCK:
            _barriers[threading.get_ident()] = (id(outermost), outermost.f_code)


def _barred_here() -> bool:
    """Whether a session starting now on this thread could outlive record functions of a stopped one."""
    tid = threading.get_ident()
    with _SESSION_LOCK:
        key = _barriers.get(tid)
        if key is None:
            return False
        if _running(tid, key):
            return True
        del _barriers[tid]
        return False


# The profiler's C++ side writes these to stderr on every session; they say nothing to a user.
_NOISE = re.compile(
    r"(USDT:.*profiler_(start|stop))|(Memory block of unknown size was allocated before the profiling)"
    r"|(disableProfiler called but no active profiling session)"
)


class _QuietStderr:
    """Holds fd 2 in a temporary file while a session runs, then writes back all but the profiler's
    own noise (so the user's messages arrive, a step late, and the noise does not)."""

    def __init__(self) -> None:
        self._saved_fd: int | None = None
        self._tmp: tempfile._TemporaryFileWrapper | None = None

    def __enter__(self) -> _QuietStderr:
        try:
            sys.stderr.flush()
            self._tmp = tempfile.TemporaryFile(mode="w+b")
            self._saved_fd = os.dup(2)
            os.dup2(self._tmp.fileno(), 2)
        except (OSError, ValueError, AttributeError):
            self._restore()
        return self

    def _restore(self) -> bytes:
        data = b""
        if self._saved_fd is not None:
            try:
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
            os.dup2(self._saved_fd, 2)
            os.close(self._saved_fd)
            self._saved_fd = None
        if self._tmp is not None:
            self._tmp.seek(0)
            data = self._tmp.read()
            self._tmp.close()
            self._tmp = None
        return data

    def __exit__(self, *exc: object) -> None:
        data = self._restore()
        kept = [ln for ln in data.decode(errors="replace").splitlines(keepends=True) if not _NOISE.search(ln)]
        if kept:
            os.write(2, "".join(kept).encode())


class MemoryRecorder:
    """Start/stop form of :func:`measure_memory`, for regions that span calls (a forward+backward)."""

    def __init__(self, device: str = "cpu", timeline: bool = False, record_shapes: bool = False) -> None:
        """``timeline``: record the torch profiler's allocation events on every device (``events`` after
        :meth:`stop`), not only the peak; on CUDA too, where the peak otherwise comes from the allocator's
        statistics."""
        self.device = device
        self.timeline = timeline
        self.record_shapes = record_shapes
        self._quiet: _QuietStderr | None = None
        self._prof: torch.profiler.profile | None = None
        self.events: list[Any] = []  # the session's event tree (root per thread), after stop (CPU path)
        self._dev: Any = None  # the runtime device on the CUDA path
        self._start_bytes = 0
        self._t0 = 0.0
        self._wall_s: float | None = None
        self._marked: MemoryMeasurement | None = None  # CUDA: read at mark_end
        self._local = False  # start(local=True): stopped within the call that started it
        #: Memory alive before the start whose frees count in ``to_stop_peak_bytes`` (address: bytes).
        self.live_before: dict[int, int] | None = None

    def start(self, *, local: bool = False) -> None:
        """Start measuring.

        ``local``: the caller stops this recorder before it returns (a region inside one call, such as
        one graph run), so the session ends before every record function open now (Note: [A session never
        ends under another session's record functions]); otherwise it may span calls.

        Raises:
            ProfilerBusyError: another measurement holds the process's profiler session, or a session
                stopped inside the compiled call that is still running here.
        """
        dev = None if self.timeline else _accelerator(self.device)
        if dev is None and not local and _barred_here():
            raise ProfilerBusyError(
                "a torch profiler session ended inside the compiled call still running here; measure at a "
                "later call"
            )
        if not claim_profiler(self):
            raise ProfilerBusyError(
                "another teraio memory measurement is running; measure one step at a time"
            )
        self._local = local
        self._dev = dev
        self._marked = None
        if self._dev is not None:
            d = torch.device(self.device)
            self._dev.synchronize(d)
            self._start_bytes = self._dev.memory_allocated(d)
            self._dev.reset_peak_memory_stats(d)
        else:
            self._quiet = _QuietStderr().__enter__()
            self._prof = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU],
                profile_memory=True,
                record_shapes=self.record_shapes,
            )
            self._prof.__enter__()
        self._t0 = time.perf_counter()

    @property
    def marked(self) -> bool:
        """Whether :meth:`mark_end` ran (the region ended where it should, not at :meth:`stop`)."""
        return self._marked is not None or self._wall_s is not None

    def mark_end(self) -> None:
        """Mark the end of the measured region without stopping the profiler.

        Note: [Profiler state inside backward] The autograd engine runs backward under a copy of the
        caller's thread-local state and restores it afterwards, so a profiler stopped inside backward
        is still enabled for the caller. Backward hooks therefore only mark the end (an annotation
        event); ``stop`` runs later on the caller's side and ignores events after the mark.

        On CUDA the region's figures are read here, after the device finished the region's work: what
        runs between the mark and ``stop`` (the optimizer step, before the next forward) is not counted.
        """
        if self._dev is not None:
            self._marked = self._read_device()
            return
        self._wall_s = time.perf_counter() - self._t0
        if self._prof is not None:
            with torch.profiler.record_function(_END_MARK):
                pass

    def abandon(self) -> None:
        """End the session without reading it (Note: [A session still open at exit is ended])."""
        prof, self._prof = self._prof, None
        try:
            if prof is not None:
                prof.__exit__(None, None, None)
                _release_session(prof)
        finally:
            if self._quiet is not None:
                self._quiet.__exit__(None, None, None)
                self._quiet = None
            if not self._local:
                _leave_barrier()
            self._dev = self._marked = None
            release_profiler(self)

    def _read_device(self) -> MemoryMeasurement:
        d = torch.device(self.device)
        self._dev.synchronize(d)
        return MemoryMeasurement(
            peak_bytes=self._dev.max_memory_allocated(d) - self._start_bytes,
            end_bytes=self._dev.memory_allocated(d) - self._start_bytes,
            wall_s=time.perf_counter() - self._t0,
            method="cuda",
        )

    def stop(self) -> MemoryMeasurement:
        """End the measurement: the region up to :meth:`mark_end` if it was marked, else up to now."""
        if self._dev is not None:
            release_profiler(self)
            now = self._read_device()
            result = now
            if self._marked is not None:
                result = dataclasses.replace(self._marked, to_stop_peak_bytes=now.peak_bytes)
            self._dev = self._marked = None
            return result
        wall = self._wall_s if self._wall_s is not None else time.perf_counter() - self._t0
        try:
            self._prof.__exit__(None, None, None)
        finally:
            if not self._local:
                _leave_barrier()
            if self._quiet is not None:
                self._quiet.__exit__(None, None, None)
                self._quiet = None
            release_profiler(self)
        prof, self._prof = self._prof, None
        roots = self.events = list(prof.profiler.kineto_results.experimental_event_tree())
        _release_session(prof)
        end_ns = _first_start_ns(roots, _END_MARK)
        events = sorted(allocations_under(roots, self.device) + noted_frees(roots), key=lambda e: e.ts_ns)
        peak, running = own_peak_bytes(events, end_ns)
        return MemoryMeasurement(
            peak_bytes=peak,
            end_bytes=running,
            wall_s=wall,
            method="torch.profiler",
            to_stop_peak_bytes=own_peak_bytes(events, None, self.live_before)[0]
            if end_ns is not None
            else None,
        )


# Note: [A profiler session's results die before the next session starts]
#     torch.profiler.profile keeps bound methods of itself in a dict (its schedule's action map), so a
#     finished session is only freed by the cyclic garbage collector, at whatever allocation triggers it:
#     often while a later session records, where freeing it is where corrupted memory shows. So the
#     results are dropped by hand as soon as their events have been read; the event tree keeps what it
#     needs on its own. The corruption itself comes from record functions ending under another session
#     (Note: [A session never ends under another session's record functions]).
def _release_session(prof: torch.profiler.profile) -> None:
    inner = prof.profiler
    if inner is not None:
        inner.kineto_results = None
    prof.profiler = None
    prof.action_map = {}


def measure_memory(fn: Callable[[], T], device: str = "cpu") -> tuple[T, MemoryMeasurement]:
    """Run ``fn()`` once and measure the bytes it allocates: peak and what stays alive at the end."""
    rec = MemoryRecorder(device)
    rec.start(local=True)
    try:
        result = fn()
    except BaseException:
        rec.stop()
        raise
    return result, rec.stop()


def _first_start_ns(roots: list[Any], name: str) -> int | None:
    found: int | None = None
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n.name == name and (found is None or n.start_time_ns < found):
            found = int(n.start_time_ns)
        stack.extend(n.children)
    return found


def op_transient_bytes(roots: list[Any], marker_prefix: str, num_ops: int, device: str = "cpu") -> list[int]:
    """Per op marked ``<marker_prefix><i>`` (a ``record_function``): bytes the op allocated and freed
    again inside itself, above what it left alive when it returned (scratch buffers, masks, workspaces).

    A census between ops cannot see these; the profiler's allocation events can. An op's allocations
    are those of any thread during its span (intra-op worker threads allocate scratch too), and a free
    counts only for memory allocated in that span (Note: [Only the region's own allocations]).
    """
    spans: dict[int, tuple[int, int]] = {}
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n.name.startswith(marker_prefix):
            i = int(n.name[len(marker_prefix) :])
            if 0 <= i < num_ops:
                spans[i] = (int(n.start_time_ns), int(n.end_time_ns))
        stack.extend(n.children)
    events = allocations_under(roots, device)
    times = [e.ts_ns for e in events]
    out = [0] * num_ops
    for i, (start, end) in spans.items():
        lo, hi = bisect.bisect_left(times, start), bisect.bisect_right(times, end)
        peak, kept = own_peak_bytes(events[lo:hi])
        out[i] = max(0, peak - kept)
    return out
