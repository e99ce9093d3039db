"""The I/O pool: one write or read request split into chunks that I/O threads move to or from a tier.

A request is the whole region of one entry (``runtime.key_table``); each chunk (or, for host reads from
a tier that can group them, each group of chunks contiguous in a file) is one task on a FIFO thread
pool, so transfers run in the order the engine issued them. The last chunk to finish completes the
request's handle, with the first error any chunk hit turned into the runtime's typed error. Host
bytes are checksummed on the I/O thread; device bytes move on the thread's own streams and are checked
on the device, in the order the engine's device rules set (Note: [CUDA ordering] in
teraio.runtime.engine), which this module applies through :class:`DeviceRules` without knowing them.

Notes referenced in the code:

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
    forever; on CUDA, the caching allocator would recycle the block from a thread with no stream
    context.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, cast

import torch

from teraio.runtime.buffers import fetch_buffer
from teraio.runtime.device import Device, HostWait, host_wait
from teraio.runtime.errors import ChecksumError, RuntimeIOError
from teraio.runtime.handle import Handle
from teraio.runtime.integrity import ChecksumFn
from teraio.runtime.key_table import Entry
from teraio.runtime.staging import DeviceIO, ThreadStreams
from teraio.runtime.stats import StatsCollector
from teraio.runtime.tiers.base import Ability, Chunk, GroupedReads


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


class DeviceRules(Protocol):
    """What the I/O threads ask of the engine's device rules (Note: [CUDA ordering] in teraio.runtime.engine)."""

    def after_producer(self, io: DeviceIO, producer_event: Any) -> None:
        """(1) Order the write stream's copies after the kernels queued before ``offload`` returned."""
        ...

    def after_allocation(self, io: DeviceIO, alloc_event: Any) -> None:
        """(4) Order the read stream's copies after earlier kernels on the read buffer's block."""
        ...

    def check_on_device(
        self, req: _Request, entry: Entry, idxs: list[int], buf: torch.Tensor, io: DeviceIO, keys: list[str]
    ) -> None:
        """Queue the device checksums of chunks ``idxs`` of a read behind their copies."""
        ...


class Transfers:
    """The I/O thread pool and the chunked write and read requests it runs.

    Args:
        device: the device every stream, event and copy goes through.
        chunk_nbytes: the staging slot size of each I/O thread's device I/O.
        io_threads: pool size (also how many groups a grouped read is split into).
        checksum: host-bytes checksum, or None when checks are off.
        stats: the engine's counters (transfers, stalls, checksum failures).
        rules: the engine's device rules, applied on the I/O threads.
        chunk_path: where a chunk lives, for checksum errors.
    """

    def __init__(
        self,
        *,
        device: Device,
        chunk_nbytes: int,
        io_threads: int,
        checksum: ChecksumFn | None,
        stats: StatsCollector,
        rules: DeviceRules,
        chunk_path: Callable[[Chunk], str],
    ) -> None:
        self._dev = device
        self._streams = ThreadStreams(device, chunk_nbytes)
        self._io_threads = io_threads
        self._checksum = checksum
        self._stats = stats
        self._rules = rules
        self._chunk_path = chunk_path
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="teraio-io")

    def shutdown(self) -> None:
        """Let every queued chunk run, then stop the I/O threads."""
        self._pool.shutdown(wait=True)

    def _io(self, entry: Entry) -> DeviceIO | None:
        """This I/O thread's stream and staging for the entry's device; None for host memory."""
        return self._streams.get(entry.device) if entry.on_device else None

    # -- writes ---------------------------------------------------------------------------------
    def submit_write(self, entry: Entry, region: torch.Tensor) -> None:
        """Start writing ``region`` (the entry's source bytes) chunk by chunk; completes
        ``entry.write_handle``. ``entry.write_req`` owns the region from now on."""
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

        # Note: [Keepalive until the write completes] (teraio.runtime.engine): the request owns the
        # region until release/drop.
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
                    self._rules.after_producer(io, event)
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

    # -- reads ----------------------------------------------------------------------------------
    def submit_read(self, key: str, entry: Entry) -> _Request:
        """Start reading the entry's region into a new buffer (Note: [Fetched buffers are torch memory])
        allocated here, in the caller's thread; the request's handle completes when the host side is
        done, and the buffer stays with the request until a fetch takes it."""
        tier = entry.tier
        kind = f"{tier.name}.read"
        event = None
        if entry.on_device:  # Note: [CUDA ordering]: allocated for the caller's stream
            buf = self._dev.empty(entry.nbytes, entry.device)
            event = self._dev.new_event()
            self._dev.record(event, self._dev.current_stream(entry.device))
        else:
            buf = fetch_buffer(entry.nbytes)  # Note: [Fetched buffers are torch memory]
        handle = Handle(key, "prefetch", self._stats.add_stall)
        keys = sorted(entry.keys)

        def on_done(req: _Request) -> None:
            self._stats.finish(kind, entry.nbytes if req.error is None else 0)
            if req.error is None:
                req.handle.set_result(None)  # the buffer stays with the request: fetch takes it
            else:
                req.handle.set_exception(_typed(req.error, f"read of {keys}"))

        verify = self._checksum
        if Ability.GROUPED_READS in tier.abilities and not entry.on_device:
            groups = cast(GroupedReads, tier).group_chunks(entry.placement, self._io_threads)
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
                    # Before any copy: Note: [A read nobody fetched is settled by the allocator]
                    # (teraio.runtime.engine).
                    req.add_device_stream(io.read_stream)
                    self._rules.after_allocation(io, event)
                if len(idxs) == 1:
                    entry.tier.read_chunk(entry.placement, entry.placement.chunks[idxs[0]], buf, io)
                else:  # only host buffers are grouped
                    cast(GroupedReads, entry.tier).read_group(entry.placement, idxs, buf)
                if io is None:
                    self._verify(entry, idxs, buf, verify, keys)
                else:
                    if verify is not None:
                        self._rules.check_on_device(req, entry, idxs, buf, io, keys)
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
                    raise checksum_error(keys, chunk, "", self._chunk_path(chunk))


def checksum_error(keys: list[str], chunk: Chunk, how: str, path: str) -> ChecksumError:
    """The error for chunk ``chunk`` of the region ``keys`` name, read back from ``path``, failing its check."""
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
