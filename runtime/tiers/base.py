"""The protocol every storage tier implements, and the chunk layout they share.

The engine owns requests, handles, dedup, forwarding and checksums; a tier only knows how to place a
request's bytes (allocate/free) and how to move one chunk of them (write_chunk/read_chunk) on an I/O
thread. Keeping the tier this small is what lets posix, kvikio and host memory be swapped by an option.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class Chunk:
    """One unit of I/O: ``nbytes`` at ``region_offset`` of a request's bytes, stored at ``location``.

    For file tiers ``dir_idx`` names the offload directory and ``file_offset`` the byte offset in its
    data file; for the host tier ``file_offset`` is the offset in the host buffer and ``dir_idx`` is -1.
    """

    region_offset: int
    nbytes: int
    dir_idx: int
    file_offset: int


@dataclass(eq=False)
class Placement:
    """Where one stored region lives: its chunks plus tier-private state (extents, host buffer)."""

    nbytes: int
    chunks: list[Chunk]
    private: Any = field(default=None, repr=False)


class Tier(Protocol):
    """A place bytes can be moved to and back.

    ``name`` is "ssd" or "host" (the stats key); ``io_path`` says which path really runs
    ("posix-odirect", "posix-buffered", "kvikio-gds", "kvikio-compat", "host-pinned", "host-pageable").
    """

    name: str
    io_path: str

    def allocate(self, nbytes: int) -> Placement:
        """Reserve space for ``nbytes``; raise OutOfSpaceError/TierCapacityError at once if it cannot."""
        ...

    def free(self, placement: Placement) -> None:
        """Give the space back (no I/O may still be running on it)."""
        ...

    def write_chunk(self, placement: Placement, chunk: Chunk, src: torch.Tensor) -> None:
        """Copy ``src[chunk.region_offset : +chunk.nbytes]`` (a 1-D uint8 tensor) to the tier."""
        ...

    def read_chunk(self, placement: Placement, chunk: Chunk, dst: torch.Tensor) -> None:
        """Copy the chunk from the tier into ``dst[chunk.region_offset : +chunk.nbytes]``."""
        ...

    def finish_write(self, placement: Placement) -> None:
        """Called once after all chunks of a write succeeded (e.g. fsync in buffered mode)."""
        ...

    def new_buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A fresh 1-D uint8 buffer of ``nbytes`` that read_chunk can fill directly."""
        ...

    def close(self) -> None:
        """Release files and memory; remove every file the tier created."""
        ...


def split_chunks(nbytes: int, chunk_nbytes: int) -> list[tuple[int, int]]:
    """Split ``nbytes`` into (offset, length) pieces of at most ``chunk_nbytes``."""
    return [(off, min(chunk_nbytes, nbytes - off)) for off in range(0, nbytes, chunk_nbytes)]
