"""The protocol every storage tier implements, and the chunk layout they share.

The engine owns requests, handles, dedup, forwarding, checksums and stream ordering; a tier only knows
how to place a request's bytes (allocate/free) and how to move one chunk of them (write_chunk/read_chunk)
on an I/O thread. Keeping the tier this small is what lets posix, kvikio and host memory be swapped by an
option. Optional abilities are declared (``Tier.abilities``), never discovered with getattr.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from teraio.runtime.staging import DeviceIO


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


class Ability(Enum):
    """Optional abilities a tier declares in ``abilities`` (the engine never probes attributes)."""

    #: ``group_chunks`` + ``read_group``: read several chunks contiguous in a file with one call
    #: (host-memory destinations only). See :class:`GroupedReads`.
    GROUPED_READS = "grouped_reads"
    #: ``read_nbytes``: bytes read per path ("direct", "bounce", "buffered"). See :class:`ReadPathCounts`.
    READ_PATH_COUNTS = "read_path_counts"
    #: ``dir_io_path(dir_idx)``: the path each offload directory really takes. See :class:`FileBacked`.
    FILES = "files"


class Tier(Protocol):
    """A place bytes can be moved to and back.

    ``name`` is the tier's key in the engine ("ssd" or "host", also the stats key); ``io_path`` says
    which path really runs ("posix-odirect", "posix-buffered", "kvikio-gds", "kvikio-compat",
    "host-pinned", "host-pageable"); ``abilities`` lists the optional protocols it implements.

    Chunk methods run on an I/O thread. ``io`` is None when the request's tensor is host memory; for
    device memory it is that thread's :class:`teraio.runtime.staging.DeviceIO` (its write stream,
    already ordered after the producer, its read stream, already ordered after the buffer's allocation,
    and its staging rings). A tier moves device bytes only through ``io`` and returns once its copies are
    *enqueued*: a write must have read the source completely before it returns (the engine then lets the
    source go; Note: [A write waits for its source bytes]), a read may leave its copies in flight on
    ``io.read_stream`` (the engine records the completion event behind them) and must never wait for the
    read stream on the host (Note: [Every host wait has a reason], runtime/device.py).
    """

    name: str
    io_path: str
    abilities: frozenset[Ability]

    def allocate(self, nbytes: int) -> Placement:
        """Reserve space for ``nbytes``; raise OutOfSpaceError/TierCapacityError at once if it cannot."""
        ...

    def free(self, placement: Placement) -> None:
        """Give the space back (no I/O, host or device, may still be running on it)."""
        ...

    def write_chunk(self, placement: Placement, chunk: Chunk, src: torch.Tensor, io: DeviceIO | None) -> None:
        """Copy ``src[chunk.region_offset : +chunk.nbytes]`` (a 1-D uint8 tensor) to the tier."""
        ...

    def read_chunk(self, placement: Placement, chunk: Chunk, dst: torch.Tensor, io: DeviceIO | None) -> None:
        """Copy the chunk from the tier into ``dst[chunk.region_offset : +chunk.nbytes]``."""
        ...

    def finish_write(self, placement: Placement) -> None:
        """Called once after all chunks of a write succeeded (e.g. fsync in buffered mode)."""
        ...

    def close(self) -> None:
        """Release files and memory; remove every file the tier created."""
        ...


class GroupedReads(Protocol):
    """:attr:`Ability.GROUPED_READS`."""

    def group_chunks(self, placement: Placement, parts: int) -> list[list[int]]:
        """Indices of chunks to read together, in about ``parts`` groups."""
        ...

    def read_group(self, placement: Placement, idxs: list[int], dst: torch.Tensor) -> None:
        """Read the chunks ``idxs`` (one group) into host memory ``dst``."""
        ...


class ReadPathCounts(Protocol):
    """:attr:`Ability.READ_PATH_COUNTS`."""

    read_nbytes: dict[str, int]


class FileBacked(Protocol):
    """:attr:`Ability.FILES`."""

    def dir_io_path(self, dir_idx: int) -> str:
        """The path offload directory ``dir_idx`` really takes (e.g. "posix-odirect", "kvikio-gds")."""
        ...


def split_chunks(nbytes: int, chunk_nbytes: int) -> list[tuple[int, int]]:
    """Split ``nbytes`` into (offset, length) pieces of at most ``chunk_nbytes``."""
    return [(off, min(chunk_nbytes, nbytes - off)) for off in range(0, nbytes, chunk_nbytes)]
