"""How the streamed optimizer step cuts its parameters into chunks, and the log of what a step updated.

The streamed step (``teraio.states.optimizer_stream``) reads, updates and writes the parameters' optimizer
states a chunk at a time, three chunks in memory at once (Note: [Three chunks in memory] in
teraio.states.optimizer_stream). How large a chunk is, and where one closes, decides how well the reads
of the next chunk hide behind the update of the current one.

Note: [Small parameters ride with their neighbours]
    A chunk closes when the next parameter would take it past ``chunk_bytes``, or past its largest
    parameter's bytes when one alone is larger, by more than an eighth of ``chunk_bytes``. Without that
    slack, a model whose weights are each a chunk or more (a 2048-wide GPT's MLP weights make 256 MiB
    chunks at 64 MiB) cuts every bias and norm into a chunk of its own between two large ones; the read
    ahead of one chunk (Note: [Three chunks in memory] in teraio.states.optimizer_stream) then covers a
    few KiB, and the disk stands idle while a large chunk is updated, then the update waits for the next
    large chunk's whole read. Which chunk a parameter is updated in does not change its update: each
    parameter's step reads only its own gradient and states.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Chunk:
    """Parameters updated together, by their index in the optimizer's parameter order."""

    param_idxs: list[int]
    nbytes: int


def cut_chunks(order: list[int], nbytes_of: Callable[[int], int], chunk_bytes: int) -> list[Chunk]:
    """Consecutive runs of ``order``: each of at most ``chunk_bytes``, or its largest parameter's bytes
    when larger, plus up to an eighth of ``chunk_bytes`` of small neighbours (Note: [Small parameters
    ride with their neighbours])."""
    slack_bytes = chunk_bytes // 8
    chunks: list[Chunk] = []
    cur: list[int] = []
    cur_bytes = 0
    cur_largest_bytes = 0
    for idx in order:
        n = nbytes_of(idx)
        limit_bytes = max(chunk_bytes, cur_largest_bytes, n) + slack_bytes
        if cur and cur_bytes + n > limit_bytes:
            chunks.append(Chunk(cur, cur_bytes))
            cur, cur_bytes, cur_largest_bytes = [], 0, 0
        cur.append(idx)
        cur_bytes += n
        cur_largest_bytes = max(cur_largest_bytes, n)
    if cur:
        chunks.append(Chunk(cur, cur_bytes))
    return chunks


@dataclass
class StepLog:
    """What one streamed step did (for tests and stats)."""

    chunks: list[list[int]] = field(default_factory=list)
    chunk_bytes: list[int] = field(default_factory=list)
    updated_chunks: int = 0
    #: Updated chunks with a resident parameter (updated in place, no copy on disk to go back to).
    updated_resident_chunks: int = 0
