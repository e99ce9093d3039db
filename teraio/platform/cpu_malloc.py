"""Keep freed CPU memory in the process, as the CUDA caching allocator keeps freed device memory.

Note: [Freed CPU memory and step time]
torch's CPU tensors come from glibc's malloc. glibc hands large blocks back to the kernel when they are
freed (``munmap``, or a trim of the heap's top), so the next step faults every page of them in again
and the kernel zeroes it. That cost grows with the step's peak, so on CPU a plan's smaller peak makes
its steps faster than no offload for a reason no GPU run has (the CUDA caching allocator reuses its
blocks) and no cost model of compute and I/O predicts (docs/measured_facts.md, "Freed CPU memory and
step time"). :func:`retain_freed_memory` sets glibc's documented ``mallopt`` parameters so freed blocks
stay in the process and are reused: step times then measure compute and I/O. It changes the whole
process, so the library never calls it on its own; ``teraio demo`` does, unless ``--cpu-malloc release``.

A thread other than the main one allocates from an arena of its own, whose heaps are at most 64 MiB:
glibc maps a larger block on its own there whatever ``M_MMAP_MAX`` says, and unmaps it when it is freed.
Retained memory would then hold for the main thread only (measured: with the other parameters set, a
second thread allocating and freeing 64 MiB tensors faulted in about 545 pages for each, the main thread
none after its first), so glibc creates no arena after the call. Arenas made before it stay: a thread
that allocated earlier keeps its own (``import torch`` starts one), and glibc hands a new thread the
existing arenas in turn, so a thread started later may still get one of them. To cover every thread,
start the process with ``GLIBC_TUNABLES=glibc.malloc.arena_max=1``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from typing import Literal

log = logging.getLogger(__name__)

CpuMalloc = Literal["retain", "release"]

# glibc's <malloc.h> parameter numbers for mallopt().
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8

#: No block is mapped on its own: every size comes from the heap, where a freed block is reused (with
#: mapping allowed, glibc maps every request above 32 MiB, its largest threshold, and unmaps it on free).
MMAP_MAX = 0
#: The mapping threshold, in case a C library ignores ``MMAP_MAX``: its largest allowed value on 64-bit.
MMAP_THRESHOLD_BYTES = 32 << 20
#: The heap's free top is returned to the kernel only above this (the largest value mallopt accepts).
TRIM_THRESHOLD_BYTES = 2**31 - 1
#: No arena made after the call (Note: [Freed CPU memory and step time]); those made before it stay.
ARENA_MAX = 1
#: Extra bytes the heap grows by at a time, so a growing step does not fault in small increments.
TOP_PAD_BYTES = 256 << 20

_retained = False


def retain_freed_memory() -> bool:
    """Make glibc keep freed blocks for reuse (Note: [Freed CPU memory and step time]).

    Returns False, and changes nothing, where the C library is not glibc. Calling it again is harmless.
    The process keeps its highest heap size until it exits: resident memory does not shrink after a peak.
    """
    global _retained
    if _retained:
        return True
    path = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(path)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        log.info("cpu malloc: no glibc mallopt here; freed memory goes back to the system")
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = all(
        mallopt(param, value) == 1
        for param, value in (
            (_M_MMAP_MAX, MMAP_MAX),
            (_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
            (_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
            (_M_TOP_PAD, TOP_PAD_BYTES),
            (_M_ARENA_MAX, ARENA_MAX),
        )
    )
    if not ok:
        log.warning("cpu malloc: glibc refused a mallopt parameter; freed memory may go back to the system")
        return False
    _retained = True
    return True


def apply_cpu_malloc(mode: CpuMalloc) -> CpuMalloc:
    """``retain``: :func:`retain_freed_memory`; ``release``: leave the C library's defaults.

    Returns what is in effect: glibc's parameters cannot be put back, so ``release`` after a ``retain``
    in the same process still retains (and says so); ``retain`` without glibc releases.
    """
    if mode == "retain":
        return "retain" if retain_freed_memory() else "release"
    if _retained:
        log.warning("cpu malloc: this process already retains freed memory; 'release' cannot undo it")
        return "retain"
    return "release"
