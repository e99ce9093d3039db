"""Host buffers for the runtime: fetched tensors in torch's own memory, page-aligned scratch for O_DIRECT,
and GIL-free copies between them.

A fetched tensor must be an ordinary torch allocation (:func:`fetch_buffer`): the torch profiler's
``[memory]`` events, which teraio uses to measure a step's peak on CPU, see only what torch's allocator
hands out, so a tensor wrapped around foreign memory (an mmap through torch.frombuffer) would make an
offloaded step look smaller than it is. Such a buffer is freed normally when its last tensor dies.

O_DIRECT needs 4096-aligned addresses, which torch's CPU allocator gives only sometimes (64-byte
alignment by default; page alignment for allocations >= 2 MiB when ``THP_MEM_ALLOC_ENABLE=1`` was set
before its first allocation). Scratch buffers that must be aligned (:func:`aligned_buffer`: the I/O
threads' staging/bounce buffers, the host tier's stored bytes) are anonymous mmaps: page-aligned, and
returned to the OS when the last tensor using them dies.
"""

from __future__ import annotations

import ctypes
import mmap

import torch

from teraio.runtime.config import PAGE_NBYTES


def fetch_buffer(nbytes: int) -> torch.Tensor:
    """A 1-D uint8 CPU tensor of exactly ``nbytes`` from torch's allocator (visible to its profiler)."""
    return torch.empty(nbytes, dtype=torch.uint8)


def aligned_buffer(nbytes: int) -> torch.Tensor:
    """A 1-D uint8 CPU tensor of ``nbytes`` whose data is page-aligned and whose backing memory is
    rounded up to a whole page, so an O_DIRECT read of the last partial page stays inside it.

    The memory is an mmap, invisible to torch's allocator and profiler: use it for scratch space only.
    """
    mapped = mmap.mmap(-1, max(PAGE_NBYTES, -(-nbytes // PAGE_NBYTES) * PAGE_NBYTES))
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes)


def address_view(addr: int, nbytes: int) -> memoryview:
    """A writable memoryview of ``nbytes`` at raw address ``addr`` (the caller keeps the memory alive)."""
    return memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B")


def memmove(dst_addr: int, src_addr: int, nbytes: int) -> None:
    """Single-threaded copy that releases the GIL (a 2-thread torch copy_ collapses when another
    process holds a core: docs/measured_facts.md)."""
    ctypes.memmove(dst_addr, src_addr, nbytes)


def memset(dst_addr: int, value: int, nbytes: int) -> None:
    """Fill ``nbytes`` at ``dst_addr`` with ``value``."""
    ctypes.memset(dst_addr, value, nbytes)
