"""The host-memory tier (TERAIO's CPU tier): bytes kept in host buffers, pinned when a device exists.

It has a capacity limit so a plan that spills to host memory cannot silently exhaust the machine:
an offload that would exceed it fails at once with TierCapacityError. The limit counts what the memory
really holds: torch's caching host allocator rounds each pinned block up to a power of two, so a
region is kept as one pinned block per chunk (chunk sizes default to a power of two, so nothing is
wasted; an odd last chunk costs at most its own size again) and each block is counted rounded.

Device tensors are copied straight between device memory and the pinned blocks on the I/O thread's
stream (no staging needed: the blocks are pinned already).
"""

from __future__ import annotations

import threading

import torch

from teraio.runtime.buffers import aligned_buffer, memmove
from teraio.runtime.device import Device
from teraio.runtime.errors import TierCapacityError
from teraio.runtime.staging import DeviceIO
from teraio.runtime.tiers.base import Ability, Chunk, Placement, split_chunks


class HostTier:
    """Host memory with an optional byte limit."""

    name = "host"
    abilities: frozenset[Ability] = frozenset()

    def __init__(self, *, chunk_nbytes: int, capacity_nbytes: int | None, device: Device) -> None:
        self.chunk_nbytes = chunk_nbytes
        self.capacity_nbytes = capacity_nbytes
        self.held_nbytes = 0  # what the buffers really occupy (pinned blocks rounded up)
        self._lock = threading.Lock()
        self._device = device
        self.pinned = device.available()
        self.io_path = "host-pinned" if self.pinned else "host-pageable"

    def held_for(self, nbytes: int) -> int:
        """Bytes of host memory a region of ``nbytes`` really occupies in this tier."""
        if not self.pinned:
            return nbytes
        return sum(self._device.pinned_nbytes(n) for _, n in split_chunks(nbytes, self.chunk_nbytes))

    def allocate(self, nbytes: int) -> Placement:
        held = self.held_for(nbytes)
        with self._lock:
            if self.capacity_nbytes is not None and self.held_nbytes + held > self.capacity_nbytes:
                raise TierCapacityError(
                    f"host tier full: {nbytes} more bytes ({held} in pinned blocks) would exceed "
                    f"host_capacity_bytes={self.capacity_nbytes} ({self.held_nbytes} held); raise the "
                    "limit or offload to ssd",
                    needed_nbytes=held,
                    capacity_nbytes=self.capacity_nbytes,
                    held_nbytes=self.held_nbytes,
                )
            self.held_nbytes += held
        pieces = split_chunks(nbytes, self.chunk_nbytes)
        try:
            if self.pinned:
                blocks = [self._device.empty_pinned(n) for _, n in pieces]
            else:
                whole = aligned_buffer(nbytes)
                blocks = [whole[off : off + n] for off, n in pieces]
        except BaseException:
            with self._lock:
                self.held_nbytes -= held
            raise
        # file_offset indexes the block: chunk i lives in blocks[i] at offset 0.
        chunks = [Chunk(off, n, -1, i) for i, (off, n) in enumerate(pieces)]
        return Placement(nbytes=nbytes, chunks=chunks, private=(blocks, held))

    def free(self, placement: Placement) -> None:
        _, held = placement.private
        with self._lock:
            self.held_nbytes -= held
        placement.private = None

    def write_chunk(self, placement: Placement, chunk: Chunk, src: torch.Tensor, io: DeviceIO | None) -> None:
        block: torch.Tensor = placement.private[0][chunk.file_offset]
        piece = src[chunk.region_offset : chunk.region_offset + chunk.nbytes]
        if io is None:
            memmove(block.data_ptr(), piece.data_ptr(), chunk.nbytes)
        else:
            io.download(block, piece)

    def read_chunk(self, placement: Placement, chunk: Chunk, dst: torch.Tensor, io: DeviceIO | None) -> None:
        block: torch.Tensor = placement.private[0][chunk.file_offset]
        piece = dst[chunk.region_offset : chunk.region_offset + chunk.nbytes]
        if io is None:
            memmove(piece.data_ptr(), block.data_ptr(), chunk.nbytes)
        else:
            # In flight when this returns. The copy keeps the pinned block until it ran (torch's host
            # allocator records an event on it), so ``free`` needs no wait (Note: [A read nobody
            # fetched is settled by the allocator], runtime/engine.py).
            io.upload(piece, block)

    def finish_write(self, placement: Placement) -> None:
        return None

    def close(self) -> None:
        return None
