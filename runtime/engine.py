"""The offload engine: named requests that move tensors to a tier and back, in the background.

The injected graph ops call ``offload``/``release``/``prefetch``/``fetch``/``drop`` by key. The engine
splits each request into chunks run by a pool of I/O threads (FIFO, so transfers run in the order
the plan issued them), deduplicates storages offloaded twice, serves fetches from memory when the data
is still there, verifies checksums, and turns every OS failure into a typed error at the request that
hit it. It never interprets a plan.

:class:`Engine` is the public face and the place where the rules across threads and streams meet;
it delegates to four collaborators, each in its own module:

- ``runtime.tier_set`` (:class:`TierSet`): the tiers by name and the offload directories under them;
- ``runtime.key_table`` (:class:`KeyTable`): which bytes each key names, and when a new offload may
  share a stored region (Note: [Storage identity], Note: [No dedup after release]);
- ``runtime.transfers`` (:class:`Transfers`): the I/O pool that runs each request chunk by chunk
  (Note: [Buffers die on the caller's thread], Note: [Fetched buffers are torch memory]);
- ``runtime.device_checks`` (:class:`DeviceChecks`): the device checksums whose verdicts nobody read
  yet (Note: [Device checks are read later]).

The engine keeps the device rules below as methods of its own (``_order_*``, ``_keep_block_for_consumer``,
``_settle_device``, ``_check_on_device``), named so that tests can remove one and show what breaks; the
I/O threads reach them through ``transfers.DeviceRules``.

Notes referenced in the code:

Note: [Keepalive until the write completes]
    A write reads the source storage on an I/O thread long after ``offload`` returned. The write
    request holds a strong reference to the source region until ``release`` (which waits for the write
    first) or ``drop``, so a caller that drops its tensor (or an allocator that reuses the buffer)
    cannot change the bytes mid-write. The key record keeps its own reference until ``release`` too.

Note: [No lock in a finalizer or a signal handler]
    A finalizer (``weakref.finalize``, a weakref callback, ``__del__``) runs wherever the garbage
    collector or a reference count happens to hit zero, and a signal handler runs between two bytecodes
    of the main thread: in both cases the interrupted frame may hold any lock of the runtime
    (``OffloadDir._lock`` inside ``allocate``, a request's lock, the executor's shutdown lock inside
    ``submit``), and taking it again on the same thread hangs forever (a finalizer that calls ``drop``
    from inside ``OffloadDir.allocate`` waits on the lock its own thread holds). So neither ever takes
    a lock: a finalizer that wants a
    key gone calls :meth:`Engine.drop_later`, which only appends the key to a reentrant queue
    (``queue.SimpleQueue``, whose ``put`` is safe in finalizers), and every public call of the engine
    drains that queue first, from a normal context, before it takes a lock. The SIGTERM handler only
    removes this process's offload files with system calls on directory descriptors the directories
    already hold (``runtime.space.remove_live_files``), then lets the signal kill the process.

Note: [CUDA ordering]
    Every stream, event and copy goes through ``self._dev`` (``runtime.device``; a fake in tests). Each
    I/O thread owns a write and a read stream per device (``runtime.staging``), non-blocking, so
    transfers never queue behind, or hold up, the training kernels on the compute stream. Four waits,
    two allocator declarations and the staging ring's event check order them, and the fake-device tests
    in tests/runtime/test_device_races.py fail when any one is removed (docs/gpu_checklist.md lists
    each rule with the test that kills it):
    (1) producer -> write: a device tensor's producing kernels may still be queued when ``offload``
        returns; an event recorded then on the caller's current stream is made a dependency of the
        I/O thread's write stream before its first copy (``_order_after_producer``), without blocking
        the host.
    (2) staging reuse: Note: [Staging slots are recycled by events] (runtime/staging.py).
    (3) read -> consumer: a read's last copies (and its device checksums) may still be queued when its
        handle completes; each I/O thread records an event behind them and ``fetch`` makes the
        caller's current stream wait for all of them (``_order_before_consumer``) instead of copying
        synchronously on the critical path. Kernels the caller enqueues after ``fetch`` see the bytes,
        after they were checked.
    (4) allocation -> read: a read buffer is allocated in the caller's thread on its current stream, so
        the caching allocator may hand it a block that kernels queued earlier on that stream still
        write; an event recorded right after the allocation orders the read stream's copies after them
        (``_order_after_allocation``). This is the one place a read depends on the compute stream, so
        nothing on the read path may wait for the read stream on the host (Note: [Every host wait has
        a reason], runtime/device.py).
    (5) consumer -> reuse: the read buffer's block belongs to the stream that was current at
        ``prefetch``; a ``fetch`` from another stream (a side stream, or a sibling key forwarded from the
        live buffer) reads it there, and once the tensor is freed the allocator would hand the block to
        the next allocation on the first stream while those kernels still read it. ``fetch`` records
        the consumer's stream on the buffer (``record_stream``, in ``_keep_block_for_consumer``), so the
        block is reused only after that stream finished its work up to the free.
    (6) settle: Note: [A read nobody fetched is settled by the allocator].

Note: [Exclusive fetches are not served again]
    A fetched buffer is remembered (weakly) so sibling keys and later fetches share it while its users
    hold it. A caller that changes the fetched bytes in place (teraio.states updates optimizer states in
    the buffer it fetched, and autograd accumulates into a fetched gradient) would then have its changed
    bytes served as the key's: ``fetch(key, exclusive=True)`` leaves the buffer unremembered, so the key
    keeps meaning its bytes on disk whatever happens to the buffer, and however long something (a
    traceback's frame, say) keeps it alive.

Note: [A read nobody fetched is settled by the allocator]
    A read buffer that no ``fetch`` took (the read failed, or its key was dropped or the engine closed
    first) may still have copies and checksums queued on I/O read streams when the engine lets it go.
    CUDA's caching allocator would hand its block to the next allocation on the compute stream at
    once, and the late copy would land in the new owner's bytes. ``_settle_device`` records every read
    stream the request used on the buffer before letting it go, so the block is reused only after
    those streams reached this point: no host wait. A fetched read needs nothing: its buffer belongs
    to the caller's tensors, ordered by (3) and (5), and ``drop`` waits for nothing. Host memory needs
    nothing either: pinned blocks and staging slots are kept until their copies ran (torch's host
    allocator records an event per non-blocking copy; Note: [Staging slots are recycled by events]),
    and a file read has finished on the host before its handle completes, so file space may be freed.

Note: [Fetch waits for the disk, never for the device]
    A read's handle completes when its host side is done: the file's bytes are in host memory (a CPU
    tensor, or a pinned staging slot whose copy to the device is queued) and verified when they are host
    bytes. Nothing on that path waits for a device stream (Note: [Every host wait has a reason]), so
    ``fetch`` (and ``drop`` of a read nobody fetched, which must let the file reads finish before the
    space is reused) waits for the disk only. One indirect case remains: the I/O pool runs requests in
    the order they were issued, so a read queued behind a write on the same I/O thread starts after
    that write, which waits for its producer's kernels (Note: [A write waits for its source bytes],
    runtime/staging.py); the plan issues offloads in the forward pass and reads in the backward.

Note: [Device checks are read later]
    A device read's checksums are computed on its read stream behind its copies, and their results
    copied to pinned host memory there (``Device.checksum_async``): the I/O thread does not wait for
    them, since the copies may wait for the compute stream (4). The read's completion event is
    recorded behind the checks, so the consumer's kernels run after them (3). The verdicts are read
    without waiting at the start of every ``offload``, ``release``, ``prefetch`` and ``fetch`` of this
    engine (those whose event completed), and with a wait (``HostWait.SYNCHRONIZE``) by
    ``synchronize()`` and ``close()``. A mismatch raises ``ChecksumError`` from the first of those calls
    after the device finished the check, before the call does anything; the read's buffer is no
    longer served to sibling keys. ``drop`` never raises it (it runs from finalizers, which would
    swallow it) and never discards it: a pending verdict stays with the engine until one of those calls
    reads it. So a corrupted read can reach the kernels already queued behind its fetch, but never
    without an error from the same engine afterwards, at the latest from ``close()``.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Mapping
from concurrent.futures import wait as wait_futures
from typing import Any

import torch

from teraio.runtime import device as device_module
from teraio.runtime.config import ResolvedConfig, RuntimeConfig
from teraio.runtime.device import Device
from teraio.runtime.device_checks import DeviceChecks
from teraio.runtime.errors import ConfigError, EngineClosedError, UnknownKeyError
from teraio.runtime.handle import Handle
from teraio.runtime.integrity import make_checksum
from teraio.runtime.key_table import (
    Entry,
    KeyRecord,
    KeyTable,
    new_entry,
    rebuild,
    span_nbytes,
    validate_request,
    version_of,
)
from teraio.runtime.space import install_sigterm_handler
from teraio.runtime.staging import DeviceIO
from teraio.runtime.stats import RuntimeStats, StatsCollector
from teraio.runtime.tier_set import TierSet, reserve_share
from teraio.runtime.tiers.base import Tier
from teraio.runtime.transfers import Transfers, _Request

__all__ = ["Engine", "read_buffer_storages", "reserve_share"]

log = logging.getLogger(__name__)

_LIVE_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _close_live_engines() -> None:
    """Remove every offload file at interpreter exit, even if the user forgot close().

    Only engines this process created: a forked child inherits the set (and runs atexit hooks when it
    exits normally) but its parent's files are still in use.
    """
    for engine in list(_LIVE_ENGINES):
        if engine._owner_pid != os.getpid():
            continue
        try:
            engine.close()
        except Exception as exc:  # noqa: BLE001 - best effort at exit
            log.warning("closing a teraio runtime engine at exit failed: %s", exc)


def choose_backend(requested: str, device: Device) -> str:
    """The I/O backend for ``requested``: itself, or for "auto" kvikio when a CUDA device with GPUDirect
    Storage support and a usable kvikio are present, else posix; the choice is logged with its reason."""
    if requested != "auto":
        return requested
    from teraio.runtime.tiers.gds import kvikio_status

    if not (device.available() and device.supports_gds):
        log.info("TERAIO_IO_BACKEND=auto chose posix: no CUDA device")
        return "posix"
    ok, reason = kvikio_status()
    if not ok:
        log.warning("TERAIO_IO_BACKEND=auto chose posix although CUDA is present: %s", reason)
        return "posix"
    log.info("TERAIO_IO_BACKEND=auto chose kvikio: CUDA device and kvikio present")
    return "kvikio"


class _RulesForIOThreads:
    """The engine's device rules as the I/O threads call them (``transfers.DeviceRules``). Each call looks
    the rule up on the engine at that moment, so a rule removed from :class:`Engine` (as the race tests
    do) is removed for the I/O threads too."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def after_producer(self, io: DeviceIO, producer_event: Any) -> None:
        self._engine._order_after_producer(io, producer_event)

    def after_allocation(self, io: DeviceIO, alloc_event: Any) -> None:
        self._engine._order_after_allocation(io, alloc_event)

    def check_on_device(self, req, entry, idxs: list[int], buf, io: DeviceIO, keys: list[str]) -> None:
        self._engine._check_on_device(req, entry, idxs, buf, io, keys)


class Engine:
    """Offload, prefetch and fetch tensors by key. See the module docstring and ``RuntimeConfig``.

    ``device`` is the :class:`teraio.runtime.device.Device` all stream, event and copy calls go through
    (default: ``runtime.device.current()``, i.e. CUDA; tests pass a ``FakeDevice``). ``tiers`` plugs in
    more tiers (or replaces one) by name: objects implementing :class:`teraio.runtime.tiers.base.Tier`,
    owned (and closed) by the engine from then on; ``offload(..., tier=name)`` uses them. Usable as a
    context manager; ``close()`` waits for in-flight I/O and removes every file.
    """

    def __init__(
        self,
        config: RuntimeConfig | None = None,
        *,
        device: Device | None = None,
        tiers: Mapping[str, Tier] | None = None,
        **kwargs: Any,
    ) -> None:
        if config is None:
            config = RuntimeConfig(**kwargs)
        elif kwargs:
            raise ConfigError("pass either a RuntimeConfig or keyword options, not both")
        self.config: ResolvedConfig = config.resolved()
        cfg = self.config
        self._lock = threading.RLock()  # guards the key table and every entry's requests
        self._owner_pid = os.getpid()
        self._table = KeyTable()
        self._keys = self._table.records  # key -> record (tests read entries through it)
        self._closed = False
        # Keys finalizers asked to drop (Note: [No lock in a finalizer or a signal handler]).
        self._deferred_drops: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._stats = StatsCollector()
        self._dev: Device = device if device is not None else device_module.current()
        self.backend = choose_backend(cfg.backend, self._dev)
        self._tier_set = TierSet(cfg, self.backend, self._dev, tiers)
        self._dirs = self._tier_set.dirs  # the offload directories (one per SSD)
        self.default_tier = self._tier_set.default
        self._transfers = Transfers(
            device=self._dev,
            chunk_nbytes=cfg.chunk_nbytes,
            io_threads=cfg.io_threads,
            checksum=make_checksum(cfg.checksum),
            stats=self._stats,
            rules=_RulesForIOThreads(self),
            chunk_path=self._tier_set.chunk_path,
        )
        self._checks = DeviceChecks(  # Note: [Device checks are read later]
            self._dev, self._stats, entries_lock=self._lock, chunk_path=self._tier_set.chunk_path
        )
        # The pending checks and their lock under the engine's own names: a stand-in for
        # ``_check_on_device`` (tests put old behaviours back that way) queues its checks through them.
        self._checks_lock = self._checks.lock
        self._device_checks = self._checks.pending
        _LIVE_ENGINES.add(self)
        install_sigterm_handler()  # Note: [No lock in a finalizer or a signal handler]

    @property
    def offload_paths(self) -> list[str]:
        """This process's private subdirectories (one per offload directory)."""
        return [str(d.path) for d in self._dirs]

    @property
    def accelerator(self) -> Device:
        """The :class:`teraio.runtime.device.Device` every stream, event and copy goes through (CUDA, or
        a fake in tests): code that moves device bytes in and out of tensors the engine read or wrote
        uses it too, so that the fake device orders (and tests) its work the same way."""
        return self._dev

    @property
    def tiers(self) -> dict[str, Tier]:
        """The engine's tiers by name ("host" always, "ssd" unless the backend is host, plus any plugged in)."""
        return self._tier_set.by_name

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the runtime engine is closed; create a new Engine")

    def _settle(self) -> None:
        """What every request does first, holding no lock: drop the keys finalizers queued, and raise the
        verdict of a device check that failed (Note: [Device checks are read later])."""
        self._settle_deferred_drops()
        self._checks.deliver(wait=False)

    # -- offload / release ----------------------------------------------------------------------
    def offload(self, key: str, tensor: torch.Tensor, tier: str | None = None) -> Handle:
        """Start writing ``tensor`` under ``key``; return at once with a handle on the write.

        An existing ``key`` is dropped first (the step-to-step reuse case). A storage already stored
        (another view of the same buffer) is not written again.

        Raises:
            OutOfSpaceError, TierCapacityError: no room for the bytes (nothing is registered then).
            UnsupportedTensorError, ConfigError: bad arguments.
        """
        validate_request(key, tensor)
        target = self._tier_set.get(tier)
        self._settle()
        with self._lock:
            self._check_open()
            self._table.begin_offload(key)
        try:
            return self._offload(key, tensor, target)
        finally:
            with self._lock:
                self._table.end_offload(key)

    def _offload(self, key: str, tensor: torch.Tensor, target: Tier) -> Handle:
        t = tensor.detach()
        lo, hi = span_nbytes(t)
        while True:
            with self._lock:
                self._check_open()
                if key not in self._table:
                    break
            self._drop_record(key)
        meta = dict(
            dtype=t.dtype, shape=tuple(t.shape), stride=tuple(t.stride()), byte_offset=lo, device=t.device
        )
        if t.numel() == 0:
            with self._lock:
                self._table.add(key, KeyRecord(entry=None, tensor=t, **meta))
            return Handle.completed(key, "offload")
        storage = t.untyped_storage()
        version = version_of(t)
        with self._lock:
            entry = self._table.find_shared(storage, version, target, t, lo, hi)
            if entry is not None:
                entry.keys.add(key)
                self._table.add(key, KeyRecord(entry=entry, tensor=t, **meta))
                self._stats.count("dedup_hits")
                self._stats.count("dedup_saved_nbytes", hi - lo)
                return entry.write_handle
        # Raises OutOfSpaceError / TierCapacityError now, before anything is registered.
        entry, region = new_entry(key, t, version, lo, hi, target, self._dev.owns(t), self._stats.add_stall)
        self._stats.hold(target.name, entry.nbytes)
        handle = entry.write_handle
        # The write request exists before the key is visible: a concurrent drop or release of this key
        # then waits for the write instead of freeing space a chunk is about to fill.
        self._transfers.submit_write(entry, region)  # Note: [Keepalive until the write completes]
        with self._lock:
            self._table.add_entry(entry)
            self._table.add(key, KeyRecord(entry=entry, tensor=t, **meta))
        return handle

    def release(self, key: str) -> None:
        """Wait for ``key``'s write, then drop the engine's in-memory reference to its tensor.

        Raises:
            RuntimeIOError: the write failed; the tensor then stays in memory (fetch still works).
        """
        self._settle()
        with self._lock:
            self._check_open()
            rec = self._table.record(key)
            if rec.tensor is None or rec.entry is None:
                if rec.entry is None:
                    rec.tensor = None
                return
            entry = rec.entry
            handle = entry.write_handle
        handle.wait()
        with self._lock:
            if entry.write_req is not None:  # the write is done: its source may go
                entry.write_req.buffer = None
            if self._table.get(key) is rec:
                rec.tensor = None

    # -- device ordering (Note: [CUDA ordering]); named so tests can show what removing each breaks --
    def _order_after_producer(self, io: DeviceIO, producer_event: Any) -> None:
        """(1) The write's copies run after the kernels queued before ``offload`` returned."""
        io.order_write_after(producer_event)

    def _order_after_allocation(self, io: DeviceIO, alloc_event: Any) -> None:
        """(4) The read's copies run after earlier kernels that used the read buffer's recycled block."""
        io.order_read_after(alloc_event)

    def _order_before_consumer(self, device: torch.device, events: list[Any], buffer: torch.Tensor) -> None:
        """(3) Work the caller enqueues after ``fetch`` runs after the read's copies landed; (5) the
        buffer's block is not reused before that work is done."""
        stream = self._dev.current_stream(device)
        for event in events:
            self._dev.wait(stream, event)
        self._keep_block_for_consumer(buffer, stream)

    def _keep_block_for_consumer(self, buffer: torch.Tensor, stream: Any) -> None:
        """(5) The allocator hands ``buffer``'s block out again only after ``stream`` used it (a no-op when
        ``stream`` is the one the buffer was allocated for)."""
        self._dev.record_stream(buffer, stream)

    def _settle_device(self, req: _Request) -> None:
        """Before an unfetched read buffer is let go: the allocator reuses its block only after every read
        stream that queued copies into it reached this point (Note: [A read nobody fetched is settled
        by the allocator]). No host wait; nothing to do for a fetched read or a write."""
        with req.lock:
            streams = list(req.device_streams)
        buffer = req.buffer
        if buffer is None or not streams or not self._dev.owns(buffer):
            return
        for stream in streams:
            self._dev.record_stream(buffer, stream)

    # -- device checks (Note: [Device checks are read later]) ------------------------------------
    def _check_on_device(self, req, entry, idxs: list[int], buf, io: DeviceIO, keys) -> None:
        """Device bytes: queue each chunk's checksum behind its copies (Note: [Device checks are read later])."""
        self._checks.queue_read(req, entry, idxs, buf, io, keys)

    def synchronize(self) -> None:
        """Wait for the device-side checks of every read so far and raise ``ChecksumError`` if one failed.

        A device read's checksum verdict is otherwise read without waiting by the next request of this
        engine (Note: [Device checks are read later]); call this where a step must end verified.
        """
        with self._lock:
            self._check_open()
        self._checks.deliver(wait=True)

    # -- prefetch / fetch -----------------------------------------------------------------------
    def prefetch(self, key: str) -> Handle:
        """Start reading ``key`` back into a fresh buffer; return a handle at once.

        Forwards (a done handle, no read) when the data is still in memory.

        Raises:
            ChecksumError: an earlier device read failed its check (Note: [Device checks are read later]).
        """
        self._settle()
        with self._lock:
            self._check_open()
            entry = self._table.record(key).entry
            if entry is None or self._table.memory_copy(entry) is not None:
                return Handle.completed(key, "prefetch")
            if entry.read_req is None:
                entry.read_req = self._transfers.submit_read(key, entry)
            return entry.read_req.handle

    def fetch(self, key: str, *, exclusive: bool = False) -> torch.Tensor:
        """Return ``key``'s tensor with its dtype, shape, strides and bytes (from memory if still
        there, else from the prefetched or a new read). Views deduplicated onto one storage come back
        as views of one buffer.

        ``exclusive=True``: a buffer this call reads is the caller's alone, which may change it in place:
        it is never served to a later fetch or prefetch of this or a sibling key, which read the disk
        again (Note: [Exclusive fetches are not served again]).

        Raises:
            ChecksumError, DiskIOError, RuntimeIOError: the read failed (the key stays readable); or an
                earlier device read failed its check (Note: [Device checks are read later]).
        """
        self._settle()
        while True:
            with self._lock:
                self._check_open()
                rec = self._table.record(key)
                entry = rec.entry
                if entry is None:
                    return torch.empty_strided(rec.shape, rec.stride, dtype=rec.dtype, device=rec.device)
                served = self._served_from_memory(rec, entry)
                if served is not None:
                    return served.clone() if exclusive else served  # others hold that buffer
                req = entry.read_req
                if req is None:
                    req = entry.read_req = self._transfers.submit_read(key, entry)
            try:
                req.handle.wait()  # Note: [Fetch waits for the disk, never for the device]
            except BaseException:
                self._settle_device(req)  # failed chunks may have left copies into the buffer in flight
                with self._lock:
                    if entry.read_req is req:
                        entry.read_req = None  # a later fetch retries the read
                    req.buffer = None
                raise
            with self._lock:
                # Note: [Buffers die on the caller's thread] (runtime/transfers.py)
                buf, req.buffer = req.buffer, None
                if entry.read_req is req:
                    entry.read_req = None
                if buf is not None:
                    # The buffer now belongs to the returned tensors; remember it only weakly so sibling
                    # keys share it while someone holds it and the memory goes when they let go.
                    if not exclusive:  # Note: [Exclusive fetches are not served again]
                        entry.loaded_ref = weakref.ref(buf.untyped_storage())
                        entry.last_read = req
                    break
            # A concurrent fetch of a sibling key took the buffer: look again (memory, or a new read).
        if req.device_events:
            self._order_before_consumer(rec.device, req.device_events, buf)
        return rebuild(rec, buf.untyped_storage(), entry.region_lo)

    def _served_from_memory(self, rec: KeyRecord, entry: Entry) -> torch.Tensor | None:
        """``rec``'s tensor from bytes still in memory (the caller's tensor until release, or a buffer a
        fetch filled), or None. Holding the engine's lock."""
        if rec.tensor is not None:
            self._stats.count("forwarded_fetches")
            self._stats.count("forwarded_nbytes", entry.nbytes)
            return rec.tensor  # still the caller's bytes
        copy = self._table.memory_copy(entry)
        if copy is None:
            return None
        self._stats.count("forwarded_fetches")
        self._stats.count("forwarded_nbytes", entry.nbytes)
        loaded = entry.loaded_ref() if entry.loaded_ref is not None else None
        if copy[0] is loaded and entry.last_read is not None and entry.last_read.device_events:
            # Another stream may fetch the buffer a read filled: order it too (Note: [CUDA ordering] (3), (5)).
            whole = torch.empty(0, dtype=torch.uint8, device=loaded.device).set_(loaded)
            self._order_before_consumer(rec.device, entry.last_read.device_events, whole)
        return rebuild(rec, copy[0], copy[1])

    # -- drop / close ---------------------------------------------------------------------------
    def drop(self, key: str, *, missing_ok: bool = False) -> None:
        """Forget ``key``; when no other key shares its bytes, free its space for reuse.

        Waits for the disk I/O still running on those bytes (a read never fetched, a write never
        released), never for a device stream: a fetched read's buffer is the caller's, and one nobody
        fetched is settled by the allocator (Note: [A read nobody fetched is settled by the
        allocator]). Raises UnknownKeyError unless ``missing_ok``. Never call it from a finalizer or a
        signal handler: use :meth:`drop_later` there (Note: [No lock in a finalizer or a signal handler]).
        """
        self._settle_deferred_drops()
        with self._lock:
            self._check_open()
            if key not in self._table:
                if missing_ok:
                    return
                raise UnknownKeyError(f"no offloaded tensor under key {key!r}: nothing to drop")
        self._drop_record(key)

    def _drop_record(self, key: str) -> None:
        with self._lock:
            entry = self._table.unlink(key)
            if entry is None:
                return
            pending = entry.forget_requests()
        for req in pending:  # no chunk may still touch the space: wait for the host side of the I/O
            wait_futures([req.handle])  # Note: [Fetch waits for the disk, never for the device]
            self._settle_device(req)  # device copies: no wait (Note: [A read nobody fetched ...])
            req.buffer = None  # Note: [Buffers die on the caller's thread] (runtime/transfers.py)
        entry.tier.free(entry.placement)
        self._stats.hold(entry.tier.name, -entry.nbytes)

    def drop_later(self, key: str) -> None:
        """Drop ``key`` (missing keys are ignored) at this engine's next call from a normal context.

        The one way to drop from a finalizer, a weakref callback or a signal handler: it takes no lock and
        does no I/O, it only queues the key (Note: [No lock in a finalizer or a signal handler]). Every
        public method drains the queue before it does anything else; ``close`` forgets it.
        """
        self._deferred_drops.put(key)

    def _settle_deferred_drops(self) -> None:
        """Drop the keys :meth:`drop_later` queued. Called first by every public method, holding no lock."""
        while not self._closed:
            try:
                key = self._deferred_drops.get_nowait()
            except queue.Empty:
                return
            self._drop_record(key)

    def keys(self) -> list[str]:
        """The keys currently offloaded."""
        self._settle_deferred_drops()
        with self._lock:
            return list(self._table.records)

    def close(self) -> None:
        """Wait for in-flight I/O, then remove every file this engine created. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            entries = self._table.take_all()
        self._transfers.shutdown()
        for entry in entries:  # Note: [Buffers die on the caller's thread] (runtime/transfers.py)
            for req in entry.requests():
                self._settle_device(req)
                req.buffer = None
        try:
            self._tier_set.close_tiers()
        finally:
            self._tier_set.close_dirs()
            _LIVE_ENGINES.discard(self)
            self._checks.deliver(wait=True)  # Note: [Device checks are read later]: never lost

    # -- stats ----------------------------------------------------------------------------------
    def stats(self) -> RuntimeStats:
        """A snapshot of the counters (see :class:`runtime.stats.RuntimeStats`)."""
        self._settle_deferred_drops()
        elapsed = max(1e-9, time.perf_counter() - self._stats.started)
        return self._stats.snapshot(
            backend=self.backend,
            io_path=self._tier_set.default_io_path(),
            dirs=self._tier_set.dir_stats(elapsed),
            read_nbytes=self._tier_set.read_nbytes(),
        )


def read_buffer_storages(engine: Engine) -> dict[int, int]:
    """The buffers of reads started and not yet fetched (address: bytes): memory the process holds for
    them already (a measurement that starts while they are in flight counts them as held before it)."""
    out: dict[int, int] = {}
    with engine._lock:
        for rec in engine._table.records.values():
            req = rec.entry.read_req if rec.entry is not None else None
            buf = req.buffer if req is not None else None
            if buf is not None:
                storage = buf.untyped_storage()
                out[storage.data_ptr()] = storage.nbytes()
    return out
