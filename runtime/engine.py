"""The offload engine: named requests that move tensors to a tier and back, in the background.

The injected graph ops call ``offload``/``release``/``prefetch``/``fetch``/``drop`` by key. The engine
splits each request into chunks run by a pool of I/O threads (FIFO, so transfers run in the order
the plan issued them), deduplicates storages offloaded twice, serves fetches from memory when the data
is still there, verifies checksums, and turns every OS failure into a typed error at the request that
hit it. It never interprets a plan.

Notes referenced in the code:

Note: [Keepalive until the write completes]
    A write reads the source storage on an I/O thread long after ``offload`` returned. The write
    request holds a strong reference to the source region until ``release`` (which waits for the write
    first) or ``drop``, so a caller that drops its tensor (or an allocator that reuses the buffer)
    cannot change the bytes mid-write. The key record keeps its own reference until ``release`` too.

Note: [Storage identity]
    Dedup and forwarding identify a storage by the Python storage object (torch preserves one object
    per live StorageImpl) through a weak reference, never by data_ptr alone: a freed address is
    reused by the next allocation. The ``_cdata`` pointer is only a dict key; a hit is confirmed by
    ``ref() is storage``, and the version counter rejects a storage that was modified in place.

Note: [No dedup after release]
    A storage is deduplicated only while the entry's write still owns its source, i.e. before any of its
    keys was released. After ``release`` the caller may reuse the memory for new data: Inductor binds a
    later buffer to the same storage object (``buf9 = buf5  # reuse``) and its C++ kernels write through
    raw pointers without bumping the version counter, and the graph ops offload a fresh view
    (``whole_storage``) whose counter starts at 0 anyway. Matching such a storage to the old entry would
    hand the new key the old bytes.

Note: [Fetched buffers are torch memory]
    A read's destination is an ordinary torch allocation made by the tier's ``new_buffer`` in the
    caller's thread (prefetch or fetch): torch's allocator and its profiler then account for every
    fetched byte (teraio measures a step's peak with the profiler's ``[memory]`` events, which are
    recorded per thread), and the buffer is freed normally when the last tensor over it dies.

Note: [Buffers die on the caller's thread]
    I/O threads only borrow the tensors they read or write: a request's buffer is owned by the
    request object (``_Request.buffer``), which only the caller's thread clears (``fetch`` takes a read
    buffer, ``release``/``drop``/``close`` let a write's source go), and a worker drops its local
    reference before it reports its chunk done. So the last reference to a buffer never dies on an
    I/O thread. That matters beyond tidiness: the torch profiler records allocator events per thread,
    so a free on an untracked thread is never seen and the measured peak would keep the buffer
    forever (seen: +256 KiB on the tiny GPT's measured step, in about one run in six); on CUDA, the
    caching allocator would recycle the block from a thread with no stream context.

Note: [No lock in a finalizer or a signal handler]
    A finalizer (``weakref.finalize``, a weakref callback, ``__del__``) runs wherever the garbage
    collector or a reference count happens to hit zero, and a signal handler runs between two bytecodes
    of the main thread: in both cases the interrupted frame may hold any lock of this module
    (``OffloadDir._lock`` inside ``allocate``, a request's lock, the executor's shutdown lock inside
    ``submit``), and taking it again on the same thread hangs forever (seen: the cyclic collector freed a
    failed step's autograd graph inside ``OffloadDir.allocate``; its token finalizer called ``drop``,
    which waited on the lock its own thread held). So neither ever takes a lock: a finalizer that wants a
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
import traceback
import weakref
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from teraio.runtime import device as device_module
from teraio.runtime.buffers import fetch_buffer
from teraio.runtime.config import ResolvedConfig, RuntimeConfig
from teraio.runtime.device import Device, HostWait, PendingChecksum, host_wait
from teraio.runtime.errors import (
    ChecksumError,
    ConfigError,
    EngineClosedError,
    RuntimeIOError,
    UnknownKeyError,
    UnsupportedTensorError,
)
from teraio.runtime.handle import Handle
from teraio.runtime.integrity import make_checksum
from teraio.runtime.space import OffloadDir, install_sigterm_handler
from teraio.runtime.staging import DeviceIO, ThreadStreams
from teraio.runtime.stats import DirStats, RuntimeStats, StatsCollector, tb_per_day
from teraio.runtime.tiers.base import (
    Ability,
    Chunk,
    FileBacked,
    GroupedReads,
    Placement,
    ReadPathCounts,
    Tier,
)
from teraio.runtime.tiers.host import HostTier

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


def _version_of(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return None


def _span_nbytes(t: torch.Tensor) -> tuple[int, int]:
    """Byte range [lo, hi) of the storage that the view ``t`` can touch."""
    itemsize = t.element_size()
    lo = t.storage_offset() * itemsize
    if t.numel() == 0:
        return lo, lo
    extent = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0)
    return lo, lo + extent * itemsize


@dataclass(eq=False)  # identity semantics: entries hold tensors
class _Entry:
    """One stored byte region of one storage, shared by every key that deduplicated onto it."""

    tier: Tier
    device: torch.device
    on_device: bool  # accelerator memory: moved on I/O streams (Note: [CUDA ordering])
    storage_ref: weakref.ref
    storage_id: int
    version: int | None
    region_lo: int
    nbytes: int
    placement: Placement
    write_handle: Handle
    checksums: list[int | None]
    keys: set[str] = field(default_factory=set)
    write_req: _Request | None = None  # owns the source region until release/drop
    read_req: _Request | None = None  # the read in flight or done, until a fetch takes its buffer
    loaded_ref: weakref.ref | None = None  # storage of the last fetched buffer, while users hold it
    last_read: _Request | None = None  # the read that filled it: its device events order later users


@dataclass(eq=False)
class _Key:
    """What one key needs to rebuild its tensor: view metadata plus the in-memory reference."""

    entry: _Entry | None  # None for zero-size tensors (nothing stored)
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    byte_offset: int  # of the view's first element in its storage
    device: torch.device
    tensor: torch.Tensor | None  # held until release (forwarding)


class _Request:
    """Counts down the chunks of one request and completes its handle.

    ``buffer`` is the tensor the chunks read from or write into, cleared only by the caller's thread
    (Note: [Buffers die on the caller's thread]).
    """

    def __init__(self, handle: Handle, nchunks: int, on_done, buffer: torch.Tensor) -> None:
        self.handle = handle
        self.buffer: torch.Tensor | None = buffer
        self.remaining = nchunks
        self.error: BaseException | None = None
        self.lock = threading.Lock()
        self.on_done = on_done
        self.device_events: list[Any] = []  # one per chunk group of a device read, behind its copies
        self.device_streams: list[Any] = []  # the read streams its copies were queued on

    def add_device_stream(self, stream: Any) -> None:
        with self.lock:
            if not any(s is stream for s in self.device_streams):
                self.device_streams.append(stream)

    def add_device_event(self, event: Any) -> None:
        with self.lock:
            self.device_events.append(event)

    def chunk_finished(self, exc: BaseException | None) -> None:
        with self.lock:
            if exc is not None and self.error is None:
                self.error = exc
            self.remaining -= 1
            last = self.remaining == 0
        if last:
            self.on_done(self)


@dataclass(eq=False)
class _DeviceCheck:
    """A device checksum of one read chunk whose verdict is read later (Note: [Device checks are read later])."""

    pending: PendingChecksum
    expected: int
    entry: _Entry
    chunk: Chunk
    keys: list[str]
    req: _Request


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
        self._lock = threading.RLock()
        self._owner_pid = os.getpid()
        self._keys: dict[str, _Key] = {}
        self._offloading: set[str] = set()  # keys inside an offload() call right now
        self._by_storage: dict[int, list[_Entry]] = {}
        self._closed = False
        # Keys finalizers asked to drop (Note: [No lock in a finalizer or a signal handler]).
        self._deferred_drops: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._stats = StatsCollector()
        self._checksum = make_checksum(cfg.checksum)
        self._checks_lock = threading.Lock()
        self._device_checks: list[_DeviceCheck] = []  # Note: [Device checks are read later]
        self._dirs: list[OffloadDir] = []
        self._dev: Device = device if device is not None else device_module.current()
        self._streams = ThreadStreams(self._dev, cfg.chunk_nbytes)
        self.backend = self._choose_backend(cfg.backend)
        host = HostTier(
            chunk_nbytes=cfg.chunk_nbytes, capacity_nbytes=cfg.host_capacity_nbytes, device=self._dev
        )
        self._tiers: dict[str, Tier] = {host.name: host}
        try:
            if self.backend != "host":
                ssd = self._open_ssd_tier()
                self._tiers[ssd.name] = ssd
            for name, plugged in (tiers or {}).items():
                if plugged.name != name:
                    raise ConfigError(
                        f"tiers={{{name!r}: ...}}: the tier's name is {plugged.name!r}; use the same"
                    )
                self._tiers[name] = plugged
        except BaseException:
            for odir in self._dirs:
                odir.close()
            raise
        self.default_tier = "host" if self.backend == "host" else "ssd"
        self._pool = ThreadPoolExecutor(max_workers=cfg.io_threads, thread_name_prefix="teraio-io")
        _LIVE_ENGINES.add(self)
        install_sigterm_handler()  # Note: [No lock in a finalizer or a signal handler]

    # -- set-up ---------------------------------------------------------------------------------
    def _choose_backend(self, requested: str) -> str:
        if requested != "auto":
            return requested
        from teraio.runtime.tiers.gds import kvikio_status

        if not (self._dev.available() and self._dev.supports_gds):
            log.info("TERAIO_IO_BACKEND=auto chose posix: no CUDA device")
            return "posix"
        ok, reason = kvikio_status()
        if not ok:
            log.warning("TERAIO_IO_BACKEND=auto chose posix although CUDA is present: %s", reason)
            return "posix"
        log.info("TERAIO_IO_BACKEND=auto chose kvikio: CUDA device and kvikio present")
        return "kvikio"

    def _open_ssd_tier(self) -> Tier:
        cfg = self.config
        for base in cfg.dirs:
            self._dirs.append(
                OffloadDir(base, rank=cfg.rank, direct_io=cfg.direct_io, fault_injector=cfg.fault_injector)
            )
        if cfg.reserve_nbytes:
            for odir in self._dirs:
                odir.reserve(reserve_share(cfg.reserve_nbytes, len(self._dirs), cfg.chunk_nbytes))
        if self.backend == "kvikio":
            from teraio.runtime.tiers.gds import KvikioTier

            return KvikioTier(
                self._dirs,
                chunk_nbytes=cfg.chunk_nbytes,
                io_threads=cfg.io_threads,
                fault_injector=cfg.fault_injector,
            )
        from teraio.runtime.tiers.posix import PosixTier

        return PosixTier(
            self._dirs,
            chunk_nbytes=cfg.chunk_nbytes,
            fault_injector=cfg.fault_injector,
            bounce_reads=cfg.bounce_reads,
        )

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

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers --------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the runtime engine is closed; create a new Engine")

    def _tier(self, tier: str | None) -> Tier:
        name = tier or self.default_tier
        found = self._tiers.get(name)
        if found is not None:
            return found
        if name == "ssd":
            raise ConfigError("tier 'ssd' needs offload directories; this engine runs backend 'host'")
        names = ", ".join(repr(n) for n in sorted({"ssd", *self._tiers}))
        raise ConfigError(f"tier={tier!r} is not a tier: use {names} or None (the default tier)")

    @property
    def tiers(self) -> dict[str, Tier]:
        """The engine's tiers by name ("host" always, "ssd" unless the backend is host, plus any plugged in)."""
        return dict(self._tiers)

    def _record(self, key: str) -> _Key:
        rec = self._keys.get(key)
        if rec is None:
            raise UnknownKeyError(f"no offloaded tensor under key {key!r}: offload it first")
        return rec

    def _stall(self, seconds: float) -> None:
        self._stats.add_stall(seconds)

    @staticmethod
    def _validate(key: str, tensor: torch.Tensor) -> None:
        if not isinstance(key, str) or not key:
            raise ConfigError(f"key must be a non-empty str, got {key!r}")
        if not isinstance(tensor, torch.Tensor):
            raise UnsupportedTensorError(
                f"offload({key!r}) needs a torch.Tensor, got {type(tensor).__name__}"
            )
        if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_nested:
            raise UnsupportedTensorError(
                f"offload({key!r}): only dense strided tensors can be offloaded, got layout {tensor.layout}"
            )
        if tensor.device.type not in ("cpu", "cuda"):
            raise UnsupportedTensorError(
                f"offload({key!r}): tensors on {tensor.device} are not supported (cpu or cuda only)"
            )

    # -- offload --------------------------------------------------------------------------------
    def offload(self, key: str, tensor: torch.Tensor, tier: str | None = None) -> Handle:
        """Start writing ``tensor`` under ``key``; return at once with a handle on the write.

        An existing ``key`` is dropped first (the step-to-step reuse case). A storage already stored
        (another view of the same buffer) is not written again.

        Raises:
            OutOfSpaceError, TierCapacityError: no room for the bytes (nothing is registered then).
            UnsupportedTensorError, ConfigError: bad arguments.
        """
        self._validate(key, tensor)
        target = self._tier(tier)
        self._settle_deferred_drops()
        self._deliver_checks(wait=False)
        with self._lock:
            self._check_open()
            if key in self._offloading:
                raise ConfigError(
                    f"offload({key!r}) while another thread is offloading the same key: one request per "
                    f"key at a time (use distinct keys, or wait for the first offload to return)"
                )
            self._offloading.add(key)
        try:
            return self._offload(key, tensor, target)
        finally:
            with self._lock:
                self._offloading.discard(key)

    def _offload(self, key: str, tensor: torch.Tensor, target: Tier) -> Handle:
        t = tensor.detach()
        lo, hi = _span_nbytes(t)
        while True:
            with self._lock:
                self._check_open()
                old = self._keys.get(key)
                if old is None:
                    break
            self._drop_record(key)
        meta = dict(
            dtype=t.dtype,
            shape=tuple(t.shape),
            stride=tuple(t.stride()),
            byte_offset=lo,
            device=t.device,
        )
        if t.numel() == 0:
            with self._lock:
                self._keys[key] = _Key(entry=None, tensor=t, **meta)
            return Handle.completed(key, "offload")
        storage = t.untyped_storage()
        storage_id = storage._cdata
        version = _version_of(t)
        with self._lock:
            entry = self._find_entry(storage, storage_id, version, target, t, lo, hi)
            if entry is not None:
                entry.keys.add(key)
                self._keys[key] = _Key(entry=entry, tensor=t, **meta)
                self._stats.count("dedup_hits")
                self._stats.count("dedup_saved_nbytes", hi - lo)
                return entry.write_handle
        # A region: the whole storage when the view covers at least half of it (so sibling views
        # such as q/k/v of one qkv buffer dedup onto it), else only the view's own span.
        storage_nbytes = storage.nbytes()
        region_lo, region_hi = (0, storage_nbytes) if 2 * (hi - lo) >= storage_nbytes else (lo, hi)
        nbytes = region_hi - region_lo
        placement = target.allocate(nbytes)  # raises OutOfSpaceError / TierCapacityError now
        self._stats.hold(target.name, nbytes)
        region = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, region_lo, (nbytes,), (1,))
        handle = Handle(key, "offload", self._stall)
        entry = _Entry(
            tier=target,
            device=t.device,
            on_device=self._dev.owns(t),
            storage_ref=weakref.ref(storage),
            storage_id=storage_id,
            version=version,
            region_lo=region_lo,
            nbytes=nbytes,
            placement=placement,
            write_handle=handle,
            checksums=[None] * len(placement.chunks),
            keys={key},
        )
        # The write request exists before the key is visible: a concurrent drop or release of this key
        # then waits for the write instead of freeing space a chunk is about to fill.
        self._submit_write(entry, region)
        with self._lock:
            self._by_storage.setdefault(storage_id, []).append(entry)
            self._keys[key] = _Key(entry=entry, tensor=t, **meta)
        return handle

    def _find_entry(self, storage, storage_id, version, target, t, lo, hi) -> _Entry | None:
        entries = self._by_storage.get(storage_id)
        if not entries:
            return None
        entries[:] = [e for e in entries if e.storage_ref() is not None]
        for e in entries:
            if (
                e.storage_ref() is storage  # Note: [Storage identity]
                and e.write_req is not None
                and e.write_req.buffer is not None  # Note: [No dedup after release]
                and e.version == version
                and e.tier is target
                and e.region_lo <= lo
                and hi <= e.region_lo + e.nbytes
                and (lo - e.region_lo) % t.element_size() == 0
                and not e.write_handle.failed()
            ):
                return e
        return None

    def _submit_write(self, entry: _Entry, region: torch.Tensor) -> None:
        tier = entry.tier
        kind = f"{tier.name}.write"
        event = None
        if entry.on_device:  # Note: [CUDA ordering] (1): the producer's kernels may still be queued
            event = self._dev.new_event()
            self._dev.record(event, self._dev.current_stream(entry.device))
        checksum = self._checksum

        def on_done(req: _Request) -> None:
            error = req.error
            if error is None:
                try:
                    tier.finish_write(entry.placement)
                except BaseException as exc:  # noqa: BLE001 - delivered through the handle
                    error = exc
            self._stats.finish(kind, entry.nbytes if error is None else 0)
            if error is None:
                req.handle.set_result(None)
            else:
                req.handle.set_exception(_typed(error, f"offload of {sorted(entry.keys)}"))

        # Note: [Keepalive until the write completes]: the request owns the region until release/drop.
        req = entry.write_req = _Request(entry.write_handle, len(entry.placement.chunks), on_done, region)
        del region
        self._stats.start(kind)
        for idx, chunk in enumerate(entry.placement.chunks):
            self._pool.submit(self._write_chunk, req, entry, idx, chunk, event, checksum)

    def _write_chunk(self, req, entry, idx, chunk: Chunk, event, checksum) -> None:
        exc: BaseException | None = None
        region = req.buffer  # borrowed: Note: [Buffers die on the caller's thread]
        try:
            if req.error is None:  # a failed request skips its remaining chunks
                io = self._io(entry)
                if io is not None:
                    self._order_after_producer(io, event)
                pending = None
                if checksum is not None:
                    if io is None:
                        entry.checksums[idx] = checksum(region.data_ptr() + chunk.region_offset, chunk.nbytes)
                    else:  # on the write stream, before the tier's copies of the same bytes
                        piece = region[chunk.region_offset : chunk.region_offset + chunk.nbytes]
                        pending = io.checksum_async(piece, io.write_stream)
                        del piece
                entry.tier.write_chunk(entry.placement, chunk, region, io)
                if pending is not None:
                    # The tier waited for its own later copy on the write stream: already complete.
                    with host_wait(HostWait.WRITE_SOURCE):
                        self._dev.synchronize_event(pending.event)
                    entry.checksums[idx] = pending.value()
                    # Its 16 pinned bytes go back before the request completes: whoever waits on the write
                    # then sees the allocator as the write left it (this thread's frame held them after).
                    pending = None
        except BaseException as e:  # noqa: BLE001 - delivered through the handle
            exc = _without_locals(e)
        del region
        req.chunk_finished(exc)

    # -- device ordering (Note: [CUDA ordering]); named so tests can show what removing each breaks --
    def _io(self, entry: _Entry) -> DeviceIO | None:
        """This I/O thread's stream and staging for the entry's device; None for host memory."""
        return self._streams.get(entry.device) if entry.on_device else None

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

    # -- device checks (Note: [Device checks are read later]) ------------------------------------
    def _deliver_checks(self, *, wait: bool) -> None:
        """Read the verdicts of device checks whose event completed (all of them, waiting, with ``wait``)
        and raise ``ChecksumError`` for the first mismatch (naming how many more there were)."""
        with self._checks_lock:
            if not self._device_checks:
                return
            if wait:
                ready, self._device_checks = self._device_checks, []
            else:
                ready = [c for c in self._device_checks if self._dev.event_done(c.pending.event)]
                if not ready:
                    return
                done = {id(c) for c in ready}
                self._device_checks = [c for c in self._device_checks if id(c) not in done]
        failed = []
        for check in ready:
            if wait:
                with host_wait(HostWait.SYNCHRONIZE):
                    self._dev.synchronize_event(check.pending.event)
            if check.pending.value() != check.expected:
                failed.append(check)
        if not failed:
            return
        self._stats.count("checksum_failures", len(failed))
        with self._lock:
            for check in failed:  # its buffer is not served to sibling keys any more
                if check.entry.last_read is check.req:
                    check.entry.loaded_ref = None
                    check.entry.last_read = None
        first = failed[0]
        more = f"; {len(failed) - 1} more chunk(s) failed too" if len(failed) > 1 else ""
        raise self._checksum_error(first.keys, first.chunk, "checked on the device after the read" + more)

    def synchronize(self) -> None:
        """Wait for the device-side checks of every read so far and raise ``ChecksumError`` if one failed.

        A device read's checksum verdict is otherwise read without waiting by the next request of this
        engine (Note: [Device checks are read later]); call this where a step must end verified.
        """
        with self._lock:
            self._check_open()
        self._deliver_checks(wait=True)

    # -- release --------------------------------------------------------------------------------
    def release(self, key: str) -> None:
        """Wait for ``key``'s write, then drop the engine's in-memory reference to its tensor.

        Raises:
            RuntimeIOError: the write failed; the tensor then stays in memory (fetch still works).
        """
        self._settle_deferred_drops()
        self._deliver_checks(wait=False)
        with self._lock:
            self._check_open()
            rec = self._record(key)
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
            if self._keys.get(key) is rec:
                rec.tensor = None

    # -- prefetch / fetch -----------------------------------------------------------------------
    def prefetch(self, key: str) -> Handle:
        """Start reading ``key`` back into a fresh buffer; return a handle at once.

        Forwards (a done handle, no read) when the data is still in memory.

        Raises:
            ChecksumError: an earlier device read failed its check (Note: [Device checks are read later]).
        """
        self._settle_deferred_drops()
        self._deliver_checks(wait=False)
        with self._lock:
            self._check_open()
            rec = self._record(key)
            entry = rec.entry
            if entry is None or self._memory_copy(entry) is not None:
                return Handle.completed(key, "prefetch")
            if entry.read_req is None:
                entry.read_req = self._submit_read(key, entry)
            return entry.read_req.handle

    def _memory_copy(self, entry: _Entry) -> tuple[torch.UntypedStorage, int] | None:
        """A live storage holding the entry's bytes, and the storage byte offset of region start."""
        for k in entry.keys:
            other = self._keys.get(k)
            if other is not None and other.tensor is not None:
                return other.tensor.untyped_storage(), 0
        if entry.loaded_ref is not None:
            loaded = entry.loaded_ref()
            if loaded is not None:
                return loaded, entry.region_lo
            entry.loaded_ref = None
        return None

    def _submit_read(self, key: str, entry: _Entry) -> _Request:
        tier = entry.tier
        kind = f"{tier.name}.read"
        event = None
        if entry.on_device:  # Note: [CUDA ordering]: allocated for the caller's stream
            buf = self._dev.empty(entry.nbytes, entry.device)
            event = self._dev.new_event()
            self._dev.record(event, self._dev.current_stream(entry.device))
        else:
            buf = fetch_buffer(entry.nbytes)  # Note: [Fetched buffers are torch memory]
        handle = Handle(key, "prefetch", self._stall)
        keys = sorted(entry.keys)

        def on_done(req: _Request) -> None:
            self._stats.finish(kind, entry.nbytes if req.error is None else 0)
            if req.error is None:
                req.handle.set_result(None)  # the buffer stays with the request: fetch takes it
            else:
                req.handle.set_exception(_typed(req.error, f"read of {keys}"))

        verify = self._checksum
        if Ability.GROUPED_READS in tier.abilities and not entry.on_device:
            groups = cast(GroupedReads, tier).group_chunks(entry.placement, self.config.io_threads)
        else:
            groups = [[i] for i in range(len(entry.placement.chunks))]
        req = _Request(handle, len(groups), on_done, buf)
        del buf
        self._stats.start(kind)
        for idxs in groups:
            self._pool.submit(self._read_group, req, entry, idxs, event, verify, keys)
        return req

    def _read_group(self, req, entry, idxs: list[int], event, verify, keys) -> None:
        exc: BaseException | None = None
        buf = req.buffer  # borrowed: Note: [Buffers die on the caller's thread]
        try:
            if req.error is None:
                io = self._io(entry)
                if io is not None:
                    req.add_device_stream(io.read_stream)  # before any copy: Note: [A read nobody ...]
                    self._order_after_allocation(io, event)
                if len(idxs) == 1:
                    entry.tier.read_chunk(entry.placement, entry.placement.chunks[idxs[0]], buf, io)
                else:  # only host buffers are grouped
                    cast(GroupedReads, entry.tier).read_group(entry.placement, idxs, buf)
                if io is None:
                    self._verify(entry, idxs, buf, verify, keys)
                else:
                    if verify is not None:
                        self._check_on_device(req, entry, idxs, buf, io, keys)
                    # Note: [CUDA ordering] (3): fetch orders the consumer after the copies and checks
                    done = self._dev.new_event()
                    self._dev.record(done, io.read_stream)
                    req.add_device_event(done)
        except BaseException as e:  # noqa: BLE001 - delivered through the handle
            exc = _without_locals(e)
        del buf
        req.chunk_finished(exc)

    def _verify(self, entry, idxs: list[int], buf, verify, keys) -> None:
        """Host bytes: ``verify`` (crc32c/xxhash) on the I/O thread, before the handle completes."""
        for idx in idxs:
            chunk = entry.placement.chunks[idx]
            expected = entry.checksums[idx]
            if verify is not None and expected is not None:
                if verify(buf.data_ptr() + chunk.region_offset, chunk.nbytes) != expected:
                    self._stats.count("checksum_failures")
                    raise self._checksum_error(keys, chunk, "")

    def _check_on_device(self, req, entry, idxs: list[int], buf, io: DeviceIO, keys) -> None:
        """Device bytes: queue each chunk's checksum behind its copies (Note: [Device checks are read later])."""
        checks = []
        for idx in idxs:
            chunk = entry.placement.chunks[idx]
            expected = entry.checksums[idx]
            if expected is None:
                continue
            piece = buf[chunk.region_offset : chunk.region_offset + chunk.nbytes]
            checks.append(
                _DeviceCheck(io.checksum_async(piece, io.read_stream), expected, entry, chunk, keys, req)
            )
            del piece
        with self._checks_lock:
            self._device_checks.extend(checks)

    def _checksum_error(self, keys: list[str], chunk: Chunk, how: str) -> ChecksumError:
        path = self._chunk_path(chunk)
        return ChecksumError(
            f"checksum mismatch for key {keys[0]!r}"
            + (f" (shared with {keys[1:]})" if len(keys) > 1 else "")
            + f": {path} at offset {chunk.file_offset}, {chunk.nbytes} bytes read back "
            f"differ from those written{' (' + how + ')' if how else ''}; the device or filesystem "
            "corrupted data",
            key=keys[0],
            path=path,
            file_offset=chunk.file_offset,
        )

    def _chunk_path(self, chunk: Chunk) -> str:
        if chunk.dir_idx < 0:
            return "<host memory>"
        return str(self._dirs[chunk.dir_idx].data_path)

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
        self._settle_deferred_drops()
        self._deliver_checks(wait=False)
        while True:
            with self._lock:
                self._check_open()
                rec = self._record(key)
                entry = rec.entry
                if entry is None:
                    return torch.empty_strided(rec.shape, rec.stride, dtype=rec.dtype, device=rec.device)
                if rec.tensor is not None:
                    self._stats.count("forwarded_fetches")
                    self._stats.count("forwarded_nbytes", entry.nbytes)
                    return rec.tensor.clone() if exclusive else rec.tensor  # still the caller's bytes
                copy = self._memory_copy(entry)
                if copy is not None:
                    self._stats.count("forwarded_fetches")
                    self._stats.count("forwarded_nbytes", entry.nbytes)
                    loaded = entry.loaded_ref() if entry.loaded_ref is not None else None
                    if copy[0] is loaded and entry.last_read is not None and entry.last_read.device_events:
                        # Another stream may fetch the buffer a read filled: order it too (Note: [CUDA ordering] (3), (5)).
                        whole = torch.empty(0, dtype=torch.uint8, device=loaded.device).set_(loaded)
                        self._order_before_consumer(rec.device, entry.last_read.device_events, whole)
                    served = self._rebuild(rec, copy[0], copy[1])
                    return served.clone() if exclusive else served  # others hold that buffer
                req = entry.read_req
                if req is None:
                    req = entry.read_req = self._submit_read(key, entry)
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
                buf, req.buffer = req.buffer, None  # Note: [Buffers die on the caller's thread]
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
        return self._rebuild(rec, buf.untyped_storage(), entry.region_lo)

    @staticmethod
    def _rebuild(rec: _Key, storage: torch.UntypedStorage, storage_lo: int) -> torch.Tensor:
        itemsize = torch.empty(0, dtype=rec.dtype).element_size()
        offset_elems = (rec.byte_offset - storage_lo) // itemsize
        out = torch.empty(0, dtype=rec.dtype, device=storage.device)
        return out.set_(storage, offset_elems, rec.shape, rec.stride)

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
            if key not in self._keys:
                if missing_ok:
                    return
                raise UnknownKeyError(f"no offloaded tensor under key {key!r}: nothing to drop")
        self._drop_record(key)

    def _drop_record(self, key: str) -> None:
        with self._lock:
            rec = self._keys.pop(key, None)
            if rec is None or rec.entry is None:
                return
            entry = rec.entry
            entry.keys.discard(key)
            if entry.keys:
                return
            siblings = self._by_storage.get(entry.storage_id, [])
            if entry in siblings:
                siblings.remove(entry)
            if not siblings:
                self._by_storage.pop(entry.storage_id, None)
            pending = [r for r in (entry.write_req, entry.read_req, entry.last_read) if r is not None]
            entry.read_req = entry.write_req = entry.last_read = None
        for req in pending:  # no chunk may still touch the space: wait for the host side of the I/O
            wait_futures([req.handle])  # Note: [Fetch waits for the disk, never for the device]
            self._settle_device(req)  # device copies: no wait (Note: [A read nobody fetched ...])
            req.buffer = None  # Note: [Buffers die on the caller's thread]
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

    def keys(self) -> list[str]:
        """The keys currently offloaded."""
        self._settle_deferred_drops()
        with self._lock:
            return list(self._keys)

    def close(self) -> None:
        """Wait for in-flight I/O, then remove every file this engine created. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            entries = {id(e): e for es in self._by_storage.values() for e in es}
            entries.update({id(r.entry): r.entry for r in self._keys.values() if r.entry is not None})
            self._keys.clear()
            self._by_storage.clear()
        self._pool.shutdown(wait=True)
        for entry in entries.values():  # Note: [Buffers die on the caller's thread]
            for req in (entry.write_req, entry.read_req, entry.last_read):
                if req is not None:
                    self._settle_device(req)
                    req.buffer = None
        try:
            for tier in self._tiers.values():
                tier.close()
        finally:
            for odir in self._dirs:
                odir.close()
            _LIVE_ENGINES.discard(self)
            self._deliver_checks(wait=True)  # Note: [Device checks are read later]: never lost

    # -- stats ----------------------------------------------------------------------------------
    def stats(self) -> RuntimeStats:
        """A snapshot of the counters (see :class:`runtime.stats.RuntimeStats`)."""
        self._settle_deferred_drops()
        elapsed = max(1e-9, time.perf_counter() - self._stats.started)
        default = self._tiers[self.default_tier]
        files = [t for t in self._tiers.values() if Ability.FILES in t.abilities]
        dir_io_path = cast(FileBacked, files[0]).dir_io_path if files else None
        dirs = tuple(
            DirStats(
                path=str(d.base),
                io_path=dir_io_path(i) if dir_io_path else "none",
                bytes_written=d.usage.bytes_written,
                bytes_read=d.usage.bytes_read,
                file_capacity_nbytes=d.capacity_nbytes,
                used_nbytes=d.allocator.used_nbytes,
                peak_used_nbytes=d.allocator.peak_used_nbytes,
                tb_written_per_day=tb_per_day(d.usage.bytes_written, elapsed),
            )
            for i, d in enumerate(self._dirs)
        )
        read_nbytes: dict[str, int] = {}
        for tier in self._tiers.values():
            if Ability.READ_PATH_COUNTS in tier.abilities:
                for path, n in cast(ReadPathCounts, tier).read_nbytes.items():
                    read_nbytes[path] = read_nbytes.get(path, 0) + n
        return self._stats.snapshot(
            backend=self.backend, io_path=default.io_path, dirs=dirs, read_nbytes=read_nbytes
        )


def reserve_share(reserve_nbytes: int, ndirs: int, chunk_nbytes: int) -> int:
    """Bytes each of ``ndirs`` directories preallocates for a total reservation of ``reserve_nbytes``.

    Requests are striped chunk by chunk onto the least-used directory (``runtime.tiers.posix``), so a
    directory only grows while it holds no more than an even share; it can then exceed that share by
    at most one chunk. An even share plus one chunk per directory therefore holds any set of requests
    totalling ``reserve_nbytes`` without growing a file mid-step.
    """
    if ndirs <= 1:
        return reserve_nbytes
    return -(-reserve_nbytes // ndirs) + chunk_nbytes


def _without_locals(exc: BaseException) -> BaseException:
    """``exc`` with the local variables of its finished frames cleared (the lines stay printable): a
    traceback kept by a handle must not keep the I/O buffers alive (Note: [Buffers die on the caller's
    thread])."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:  # the exception and its causes
        seen.add(id(link))
        traceback.clear_frames(link.__traceback__)
        link = link.__cause__ or link.__context__
    return exc


def _typed(exc: BaseException, what: str) -> BaseException:
    """Keep the runtime's typed errors; wrap anything else so callers catch one base class."""
    if isinstance(exc, RuntimeIOError):
        return exc
    wrapped = RuntimeIOError(f"{what} failed: {type(exc).__name__}: {exc}")
    wrapped.__cause__ = exc
    return wrapped
