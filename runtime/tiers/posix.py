"""The POSIX file tier: O_DIRECT reads and writes, striped over directories.

Why O_DIRECT: a buffered write lands in the page cache, so the "offloaded" bytes still occupy RAM.
Where a filesystem refuses O_DIRECT the tier writes buffered, then fdatasync + fadvise(DONTNEED) so
the cache lets go (the fallback is logged once by :class:`runtime.space.OffloadDir`).

Writes: source tensors are rarely 4096-aligned, so each chunk is staged into a per-thread aligned
buffer with a GIL-free memmove. Device tensors are staged through the I/O thread's pinned slots
(``runtime.staging``): device-to-host on the thread's write stream, then the same O_DIRECT write; reads
land in a pinned slot and are copied to the device on its read stream without waiting (Note: [Staging
slots are recycled by events]).

Reads land in an ordinary torch allocation (``runtime.buffers.fetch_buffer``), so the torch profiler
and allocator see every fetched byte. Two paths, chosen per read by the destination's address and
counted in ``read_nbytes`` (logged once each, with the reason):

- "direct": the allocation is 4096-aligned (torch page-aligns allocations >= 2 MiB when
  ``THP_MEM_ALLOC_ENABLE=1`` was set before its first allocation): whole pages are read with O_DIRECT
  straight into it, a run of chunks with one scattering preadv; only a partial last page is bounced.
- "bounce": otherwise (torch's default alignment is 64 bytes), each chunk is read with O_DIRECT into
  the I/O thread's aligned buffer and copied out with a single-threaded memmove that releases the GIL.

The staging/bounce buffers are anonymous mmaps, one per I/O thread and reused (so their pages are
faulted in once): a constant ``io_threads x chunk_bytes`` the torch profiler does not see.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import replace

import torch

from teraio.runtime.buffers import address_view, aligned_buffer, memmove, memset
from teraio.runtime.config import PAGE_NBYTES, FaultInjectorFn
from teraio.runtime.errors import RuntimeIOError, map_os_error
from teraio.runtime.space import OffloadDir, align_up
from teraio.runtime.staging import DeviceIO
from teraio.runtime.tiers.base import Ability, Chunk, Placement, split_chunks

log = logging.getLogger(__name__)

_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
ENV_THP = "THP_MEM_ALLOC_ENABLE"  # read by torch's CPU allocator (c10 alloc_cpu), not by us


def _preadv_full(fd: int, views: list[memoryview], file_offset: int) -> int:
    """Fill every view from ``file_offset`` on, retrying short reads; return the end offset.

    A failure carries the offset it happened at in ``exc.file_offset_reached``.
    """
    pending = [v for v in views if len(v)]
    pos = file_offset
    try:
        while pending:
            got = os.preadv(fd, pending[:_IOV_MAX], pos)
            if got <= 0:
                raise OSError(5, f"short read: end of file at offset {pos}")
            pos += got
            while got and pending:  # drop the filled views, trim a partly filled one
                if got >= len(pending[0]):
                    got -= len(pending[0])
                    pending.pop(0)
                else:
                    pending[0] = pending[0][got:]
                    got = 0
    except OSError as exc:
        exc.file_offset_reached = pos
        raise
    return pos


class PosixTier:
    """Files in one or more offload directories, written with os.pwrite / read with os.preadv."""

    name = "ssd"
    abilities: frozenset[Ability] = frozenset(
        {Ability.GROUPED_READS, Ability.READ_PATH_COUNTS, Ability.FILES}
    )

    def __init__(
        self,
        dirs: list[OffloadDir],
        *,
        chunk_nbytes: int,
        fault_injector: FaultInjectorFn | None = None,
        bounce_reads: bool = False,
    ) -> None:
        self.dirs = dirs
        self.chunk_nbytes = chunk_nbytes
        self._inject = fault_injector
        self._next_dir = 0
        self._rr_lock = threading.Lock()
        self._local = threading.local()
        self._usage_lock = threading.Lock()
        self.bounce_reads = bounce_reads
        self.read_nbytes = {"direct": 0, "bounce": 0, "buffered": 0}  # bytes read by each path
        self._logged_paths: set[str] = set()
        direct = all(d.direct for d in dirs)
        self.io_path = "posix-odirect" if direct else "posix-buffered"

    # -- placement ------------------------------------------------------------------------------
    def allocate(self, nbytes: int) -> Placement:
        """Stripe ``nbytes`` chunk by chunk over the directories, one extent per directory.

        Each chunk goes to the directory holding the fewest bytes (ties rotate), so no directory holds
        more than an even share of the live bytes plus one chunk: what ``Engine`` reserves per
        directory (``runtime.tier_set.reserve_share``). Plain round-robin could put every large request on
        one directory when large and small requests alternate.
        """
        pieces = split_chunks(nbytes, self.chunk_nbytes)
        ndirs = len(self.dirs)
        per_dir = [0] * ndirs
        assignment = []
        extents: list[tuple[int, int, int]] = []
        with self._rr_lock:  # one placement at a time, so each sees the others' usage
            first = self._next_dir
            self._next_dir = (first + 1) % ndirs
            used = [d.allocator.used_nbytes for d in self.dirs]
            for off, length in pieces:
                d = min(range(ndirs), key=lambda j: (used[j] + per_dir[j], (j - first) % ndirs))
                assignment.append((off, length, d, per_dir[d]))
                per_dir[d] += align_up(length)
            try:
                for d, total in enumerate(per_dir):
                    if total:
                        extents.append((d, self.dirs[d].allocate(total), total))
            except BaseException:
                for d, base, total in extents:
                    self.dirs[d].free(base, total)
                raise
        base_of = {d: base for d, base, _ in extents}
        chunks = [Chunk(off, length, d, base_of[d] + rel) for off, length, d, rel in assignment]
        return Placement(nbytes=nbytes, chunks=chunks, private=extents)

    def free(self, placement: Placement) -> None:
        for d, base, total in placement.private:
            self.dirs[d].free(base, total)

    def dir_io_path(self, dir_idx: int) -> str:
        return "posix-odirect" if self.dirs[dir_idx].direct else "posix-buffered"

    # -- I/O ------------------------------------------------------------------------------------
    def _staging(self) -> tuple[torch.Tensor, int]:
        buf = getattr(self._local, "staging", None)
        if buf is None:
            buf = aligned_buffer(self.chunk_nbytes)
            self._local.staging = buf
        return buf, buf.data_ptr()

    def write_chunk(self, placement: Placement, chunk: Chunk, src: torch.Tensor, io: DeviceIO | None) -> None:
        odir = self.dirs[chunk.dir_idx]
        n = chunk.nbytes
        piece = src[chunk.region_offset : chunk.region_offset + n]
        if io is not None:
            # Device memory: copy the chunk into a pinned, page-aligned staging slot on the I/O thread's
            # stream (ordered after the producer by the engine), wait for it, write from the slot.
            slot = io.acquire()
            io.download(slot.buffer[:n], piece)
            src_addr = slot.buffer.data_ptr()
            if odir.direct and n != align_up(n):
                memset(src_addr + n, 0, align_up(n) - n)  # the slot is chunk-sized: pad in place
            view = address_view(src_addr, align_up(n) if odir.direct else n)
        elif not odir.direct:
            view = address_view(piece.data_ptr(), n)
        else:
            io_nbytes = align_up(n)
            src_addr = piece.data_ptr()
            if src_addr % PAGE_NBYTES == 0 and n == io_nbytes:
                view = address_view(src_addr, n)  # already aligned (e.g. a fetched tensor): no copy
            else:
                staging, staging_addr = self._staging()
                memmove(staging_addr, src_addr, n)
                if io_nbytes != n:
                    memset(staging_addr + n, 0, io_nbytes - n)
                view = address_view(staging_addr, io_nbytes)
        self._pwrite_all(odir, view, chunk.file_offset, n)
        with self._usage_lock:
            odir.usage.bytes_written += n

    def _pwrite_all(self, odir: OffloadDir, view: memoryview, file_offset: int, n: int) -> None:
        done = 0
        try:
            if self._inject:
                self._inject("write", str(odir.data_path), file_offset, n)
            while done < len(view):
                written = os.pwrite(odir.fd, view[done:], file_offset + done)
                if written <= 0:
                    raise OSError(5, "pwrite wrote 0 bytes")
                done += written
        except OSError as exc:
            raise map_os_error(
                exc,
                action="write",
                path=str(odir.data_path),
                directory=str(odir.base),
                needed_nbytes=n,
                file_offset=file_offset + done,
            ) from exc

    def read_chunk(self, placement: Placement, chunk: Chunk, dst: torch.Tensor, io: DeviceIO | None) -> None:
        odir = self.dirs[chunk.dir_idx]
        if io is None:
            self._read_run(odir, [chunk], dst)
            return
        # Device memory: read into a pinned staging slot (page-aligned, so O_DIRECT lands in it), then
        # enqueue the host-to-device copy; the slot stays busy until that copy ran.
        slot = io.acquire()
        self._read_run(odir, [replace(chunk, region_offset=0)], slot.buffer)
        io.upload(
            dst[chunk.region_offset : chunk.region_offset + chunk.nbytes], slot.buffer[: chunk.nbytes], slot
        )

    def group_chunks(self, placement: Placement, parts: int) -> list[list[int]]:
        """Indices of chunks to read together: per directory, runs contiguous in the file, cut into
        about ``parts`` groups. One large preadv keeps many requests in flight inside the kernel,
        which reads markedly faster than 4 MiB requests on a disk that rewards queue depth."""
        by_dir: dict[int, list[int]] = {}
        for idx, ch in enumerate(placement.chunks):
            by_dir.setdefault(ch.dir_idx, []).append(idx)
        groups: list[list[int]] = []
        for idxs in by_dir.values():
            idxs.sort(key=lambda i: placement.chunks[i].file_offset)
            per_group = min(_IOV_MAX, max(1, -(-len(idxs) // parts)))
            run: list[int] = []
            for i in idxs:
                ch = placement.chunks[i]
                if run:
                    prev = placement.chunks[run[-1]]
                    contiguous = prev.file_offset + align_up(prev.nbytes) == ch.file_offset
                    if not contiguous or len(run) >= per_group or prev.nbytes != align_up(prev.nbytes):
                        groups.append(run)
                        run = []
                run.append(i)
            if run:
                groups.append(run)
        return groups

    def read_group(self, placement: Placement, idxs: list[int], dst: torch.Tensor) -> None:
        """Read chunks contiguous in one file (see :meth:`group_chunks`) with few large preadv calls."""
        chunks = [placement.chunks[i] for i in idxs]
        self._read_run(self.dirs[chunks[0].dir_idx], chunks, dst)

    def read_path(self, odir: OffloadDir, dst_addr: int) -> str:
        """How a read into memory at ``dst_addr`` runs: "direct" (O_DIRECT into it), "bounce" (O_DIRECT
        into the thread's aligned buffer, then a copy) or "buffered" (no O_DIRECT on this directory)."""
        if not odir.direct:
            return "buffered"
        if self.bounce_reads or dst_addr % PAGE_NBYTES:
            return "bounce"
        return "direct"

    def _read_run(self, odir: OffloadDir, chunks: list[Chunk], dst: torch.Tensor) -> None:
        """Read ``chunks`` (contiguous in ``odir``'s file, in file order) into ``dst``."""
        dst_addr = dst.data_ptr()
        path = self.read_path(odir, dst_addr)
        self._log_path_once(path, dst_addr)
        start = chunks[0].file_offset
        nbytes = sum(ch.nbytes for ch in chunks)
        pos = start  # file offset reached, for the error message
        counted = {"direct": 0, "bounce": 0, "buffered": 0}
        try:
            if self._inject:
                self._inject("read", str(odir.data_path), start, nbytes)
            if path == "buffered":
                views = [address_view(dst_addr + ch.region_offset, ch.nbytes) for ch in chunks]
                pos = _preadv_full(odir.fd, views, start)
                os.posix_fadvise(odir.fd, start, nbytes, os.POSIX_FADV_DONTNEED)
                counted["buffered"] = nbytes
            elif path == "direct":
                # Whole pages straight into the tensor; a partial last page (only the run's last chunk
                # can have one) cannot: the tensor ends inside it, so it goes through the bounce buffer.
                last = chunks[-1]
                tail_nbytes = last.nbytes % PAGE_NBYTES
                views = [address_view(dst_addr + ch.region_offset, ch.nbytes) for ch in chunks[:-1]]
                if last.nbytes - tail_nbytes:
                    views.append(address_view(dst_addr + last.region_offset, last.nbytes - tail_nbytes))
                if views:
                    pos = _preadv_full(odir.fd, views, start)
                counted["direct"] = nbytes - tail_nbytes
                if tail_nbytes:
                    tail_offset = last.nbytes - tail_nbytes
                    pos = last.file_offset + tail_offset
                    self._bounce_read(odir, pos, dst_addr + last.region_offset + tail_offset, tail_nbytes)
                    counted["bounce"] = tail_nbytes
            else:
                for ch in chunks:
                    pos = ch.file_offset
                    self._bounce_read(odir, pos, dst_addr + ch.region_offset, ch.nbytes)
                counted["bounce"] = nbytes
        except OSError as exc:
            raise map_os_error(
                exc,
                action="read",
                path=str(odir.data_path),
                directory=str(odir.base),
                needed_nbytes=nbytes,
                file_offset=getattr(exc, "file_offset_reached", pos),
            ) from exc
        with self._usage_lock:
            odir.usage.bytes_read += nbytes
            for name, n in counted.items():
                self.read_nbytes[name] += n

    def _bounce_read(self, odir: OffloadDir, file_offset: int, dst_addr: int, n: int) -> None:
        """O_DIRECT-read ``n`` bytes (padded to whole pages) into the thread's aligned buffer, copy them out."""
        _, bounce_addr = self._staging()
        _preadv_full(odir.fd, [address_view(bounce_addr, align_up(n))], file_offset)
        memmove(dst_addr, bounce_addr, n)

    def _log_path_once(self, path: str, dst_addr: int) -> None:
        if path in self._logged_paths:
            return
        with self._usage_lock:
            if path in self._logged_paths:
                return
            self._logged_paths.add(path)
        thp = os.environ.get(ENV_THP, "<unset>")
        if path == "direct":
            why = (
                f"fetched tensors are 4096-aligned torch allocations (torch page-aligns CPU allocations "
                f">= 2 MiB when {ENV_THP}=1 is set before its first allocation; {ENV_THP}={thp} here), so "
                "O_DIRECT reads land in them without a copy; a partial last page is bounced"
            )
        elif path == "bounce":
            if self.bounce_reads:
                why = "bounce_reads=True forces it"
            else:
                why = (
                    f"a fetched tensor's torch allocation is not 4096-aligned (at {dst_addr % PAGE_NBYTES} "
                    f"bytes past a page; torch aligns CPU memory to 64 bytes unless {ENV_THP}=1 is set "
                    f"before its first allocation, and then only allocations >= 2 MiB; {ENV_THP}={thp} "
                    "here), so each chunk is read with O_DIRECT into a per-thread aligned buffer and copied"
                )
        else:
            why = "O_DIRECT is off for an offload directory: reads go through the page cache into the tensor"
        log.info("ssd reads take the %s path: %s", path, why)

    def finish_write(self, placement: Placement) -> None:
        """In buffered mode, push the bytes to the device and drop them from the page cache."""
        for d, base, total in placement.private:
            odir = self.dirs[d]
            if odir.direct:
                continue
            try:
                os.fdatasync(odir.fd)
                os.posix_fadvise(odir.fd, base, total, os.POSIX_FADV_DONTNEED)
            except OSError as exc:
                raise map_os_error(
                    exc,
                    action="fsync",
                    path=str(odir.data_path),
                    directory=str(odir.base),
                    needed_nbytes=total,
                ) from exc

    def close(self) -> None:
        errors = []
        for odir in self.dirs:
            try:
                odir.close()
            except OSError as exc:  # keep closing the others
                errors.append(exc)
        if errors:
            raise RuntimeIOError(f"closing offload directories failed: {errors[0]}")
