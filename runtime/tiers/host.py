"""The host-memory tier (TERAIO's CPU tier): bytes kept in (pinned, when CUDA exists) host buffers.

It has a capacity limit so a plan that spills to host memory cannot silently exhaust the machine:
an offload that would exceed it fails at once with TierCapacityError.
"""

from __future__ import annotations

import threading

import torch

from teraio.runtime.buffers import aligned_buffer, fetch_buffer, memmove
from teraio.runtime.errors import TierCapacityError
from teraio.runtime.tiers.base import Chunk, Placement, split_chunks


class HostTier:
    """Host memory with an optional byte limit."""

    name = "host"

    def __init__(self, *, chunk_nbytes: int, capacity_nbytes: int | None) -> None:
        self.chunk_nbytes = chunk_nbytes
        self.capacity_nbytes = capacity_nbytes
        self.held_nbytes = 0
        self._lock = threading.Lock()
        self.pinned = torch.cuda.is_available()
        self.io_path = "host-pinned" if self.pinned else "host-pageable"

    def allocate(self, nbytes: int) -> Placement:
        with self._lock:
            if self.capacity_nbytes is not None and self.held_nbytes + nbytes > self.capacity_nbytes:
                raise TierCapacityError(
                    f"host tier full: {nbytes} more bytes would exceed host_capacity_bytes="
                    f"{self.capacity_nbytes} ({self.held_nbytes} held); raise the limit or offload to ssd",
                    needed_nbytes=nbytes,
                    capacity_nbytes=self.capacity_nbytes,
                    held_nbytes=self.held_nbytes,
                )
            self.held_nbytes += nbytes
        try:
            if self.pinned:
                buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            else:
                buf = aligned_buffer(nbytes)
        except BaseException:
            with self._lock:
                self.held_nbytes -= nbytes
            raise
        chunks = [Chunk(off, n, -1, off) for off, n in split_chunks(nbytes, self.chunk_nbytes)]
        return Placement(nbytes=nbytes, chunks=chunks, private=buf)

    def free(self, placement: Placement) -> None:
        with self._lock:
            self.held_nbytes -= placement.nbytes
        placement.private = None

    def new_buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        if device.type == "cpu":  # a torch allocation, so the profiler sees fetched bytes
            return fetch_buffer(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def write_chunk(self, placement: Placement, chunk: Chunk, src: torch.Tensor) -> None:
        dst: torch.Tensor = placement.private
        if src.device.type == "cpu":
            memmove(dst.data_ptr() + chunk.file_offset, src.data_ptr() + chunk.region_offset, chunk.nbytes)
        else:
            dst[chunk.file_offset : chunk.file_offset + chunk.nbytes].copy_(
                src[chunk.region_offset : chunk.region_offset + chunk.nbytes]
            )

    def read_chunk(self, placement: Placement, chunk: Chunk, dst: torch.Tensor) -> None:
        src: torch.Tensor = placement.private
        if dst.device.type == "cpu":
            memmove(dst.data_ptr() + chunk.region_offset, src.data_ptr() + chunk.file_offset, chunk.nbytes)
        else:
            dst[chunk.region_offset : chunk.region_offset + chunk.nbytes].copy_(
                src[chunk.file_offset : chunk.file_offset + chunk.nbytes]
            )

    def finish_write(self, placement: Placement) -> None:
        return None

    def close(self) -> None:
        return None
