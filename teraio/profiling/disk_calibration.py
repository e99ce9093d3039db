"""Measure what an offload directory can really do, and write it down as the planner's HardwareModel.

The planner's predictions are only as good as its bandwidth figures, and disks differ, even from run to run
(docs/measured_facts.md). So ``teraio calibrate DIR`` times, in one run: the runtime engine's own write and
read of a test tensor (``runtime.Engine`` with the posix backend: what offloading will actually achieve,
chunking and staging copies included) and raw aligned ``O_DIRECT`` pwrite/pread of the same size (the disk's
baseline), plus the latency of one 4 KiB request through the engine (and, for reference, one raw direct
request). Medians of several repeats go into the SSD tier of a HardwareModel. A directory on tmpfs/ramfs is
flagged: offloading there saves no memory.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from teraio.errors import UserInputError
from teraio.planner.hardware import HardwareModel

log = logging.getLogger(__name__)

PAGE_NBYTES = 4096
#: ``hardware="calibrate"`` (the backend's quick calibration before its first plan): bytes per timed
#: transfer. Small enough to take well under a second, large enough that a 4 MiB request size
#: dominates over per-request cost, as it does in the plans of a model worth offloading.
QUICK_NBYTES = 64 * 2**20
LATENCY_REPEATS = 16
RAM_FILESYSTEMS = ("tmpfs", "ramfs")


@dataclass
class Calibration:
    """Measured figures for one directory. Bandwidths are medians over ``repeats``."""

    dir: str
    nbytes: int
    block_nbytes: int
    repeats: int
    fs_type: str
    #: "runtime.Engine(posix)" when the engine measured the model's figures, else "O_DIRECT".
    method: str
    write_bw_bytes_per_s: float
    read_bw_bytes_per_s: float
    write_latency_s: float
    read_latency_s: float
    direct_write_bw_bytes_per_s: float
    direct_read_bw_bytes_per_s: float
    #: One 4 KiB O_DIRECT request (the disk alone); the model's latencies are the engine's own when it ran.
    direct_write_latency_s: float = 0.0
    direct_read_latency_s: float = 0.0
    #: The step time one transfer costs, one direction (0: not measured): the compute thread's time in
    #: the migration ops' calls, plus, where the CPU computes, the I/O threads' CPU for the transfer.
    #:
    #: Note: [A transfer's CPU on a CPU-only step]
    #: Where training computes on the CPU, every core runs the step's ops, so the CPU the I/O threads
    #: spend on a transfer (waking up, the request's bookkeeping, the checksum, the system calls) is
    #: taken from compute as surely as the calls on the compute thread are; and under compute each
    #: costs more than alone (the GIL passes between threads, a parallel op waits for the core an I/O
    #: thread took, caches refill), so a round trip made inside a block of small ops costs more than
    #: the calls and the I/O threads' CPU together. So on a CPU-only machine the figure is that one:
    #: measured as the extra time of blocks of small ops that make a round trip against the same
    #: blocks without (``_round_trips_under_compute``), with the calls and the I/O threads' CPU
    #: (measured alone) as the fallback. A model with many small tensors moves mostly pages. The
    #: blocks include pointwise ops wide enough that every intra-op thread takes part, as a model's
    #: step does: after such an op torch's OpenMP threads spin on their cores for a while, so an I/O
    #: thread that wakes then competes with them, and small ops alone leave that cost out. With an
    #: accelerator computing, the host's I/O threads overlap it and only the calls count. The backend
    #: replaces this figure with the profiled graph's own where it can measure it (Note: [Pricing
    #: transfers under the model's own compute] in teraio.profiling.transfer_probe).
    cpu_s_per_transfer: float = 0.0
    samples: dict[str, list[float]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def hardware_model(self, base: HardwareModel | None = None) -> HardwareModel:
        """``base`` (default: the built-in model) with its SSD tier replaced by these measurements."""
        hw = base if base is not None else HardwareModel()
        hw = hw.with_overrides(
            "ssd",
            write_bw_bytes_per_s=self.write_bw_bytes_per_s,
            read_bw_bytes_per_s=self.read_bw_bytes_per_s,
            write_latency_s=self.write_latency_s,
            read_latency_s=self.read_latency_s,
            cpu_s_per_transfer=self.cpu_s_per_transfer,
            count=1,
        )
        return replace(hw, name=f"calibrated:{self.dir}")


def filesystem_type(path: str | os.PathLike) -> str:
    """The filesystem type of ``path`` from /proc/mounts (longest matching mount point), or "unknown"."""
    real = os.path.realpath(path)
    best, fs = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) > len(best):
                    best, fs = mnt, parts[2]
    except OSError:
        pass
    return fs


def _open_direct(path: Path, flags: int) -> tuple[int, bool]:
    """Open with O_DIRECT when the filesystem allows it; (fd, direct?)."""
    try:
        return os.open(path, flags | os.O_DIRECT, 0o600), True
    except OSError:
        return os.open(path, flags, 0o600), False


def _direct_round_trip(path: Path, nbytes: int, block_nbytes: int) -> tuple[float, float, bool]:
    """Write ``nbytes`` in aligned blocks, then read them back; (write_s, read_s, used O_DIRECT)."""
    buf = mmap.mmap(-1, block_nbytes)  # page-aligned, as O_DIRECT requires
    buf.write(os.urandom(min(block_nbytes, 1 << 20)) * (block_nbytes // min(block_nbytes, 1 << 20)))
    fd, direct = _open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW)
    try:
        t0 = time.perf_counter()
        for off in range(0, nbytes, block_nbytes):
            os.pwrite(fd, buf, off)
        os.fsync(fd)
        write_s = time.perf_counter() - t0
        if not direct:  # buffered fallback: push the bytes out of the page cache before reading
            os.posix_fadvise(fd, 0, nbytes, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    fd, _ = _open_direct(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        t0 = time.perf_counter()
        for off in range(0, nbytes, block_nbytes):
            os.preadv(fd, [buf], off)
        read_s = time.perf_counter() - t0
    finally:
        os.close(fd)
        buf.close()
    return write_s, read_s, direct


def _latency(path: Path, repeats: int = 16) -> tuple[float, float]:
    """Median time of one 4 KiB direct write and one 4 KiB direct read (no fsync: the runtime does none per chunk)."""
    buf = mmap.mmap(-1, PAGE_NBYTES)
    writes, reads = [], []
    fd, _ = _open_direct(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW)
    try:
        for i in range(repeats):
            t0 = time.perf_counter()
            os.pwrite(fd, buf, i * PAGE_NBYTES)
            writes.append(time.perf_counter() - t0)
        for i in range(repeats):
            t0 = time.perf_counter()
            os.preadv(fd, [buf], i * PAGE_NBYTES)
            reads.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
        buf.close()
    return statistics.median(writes), statistics.median(reads)


def _engine_round_trip(
    directory: Path, nbytes: int, repeats: int, checksum: bool = True
) -> tuple[list[float], list[float], str]:
    """Time ``runtime.Engine`` (posix) offloading a uint8 tensor and reading it back, ``repeats`` times."""
    import torch

    from teraio.runtime.config import RuntimeConfig
    from teraio.runtime.engine import Engine

    writes, reads = [], []
    # A generator of its own: the backend calibrates between a user's training steps, and drawing from
    # torch's global one would change every later dropout mask (training would no longer be bit-identical
    # to the same loop without teraio).
    gen = torch.Generator().manual_seed(0)
    with Engine(RuntimeConfig(dirs=[str(directory)], backend="posix", checksum=checksum)) as engine:
        for i in range(repeats):
            key = f"calibrate-{i}"
            src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
            t0 = time.perf_counter()
            engine.offload(key, src).wait()
            writes.append(time.perf_counter() - t0)
            engine.release(key)
            expected = src[:: max(1, nbytes // 4096)].clone()
            del src
            # No live copy is left (src had no other reference): the prefetch must read the file, and
            # ``forwarded_fetches`` below proves it did.
            t0 = time.perf_counter()
            engine.prefetch(key).wait()
            reads.append(time.perf_counter() - t0)
            back = engine.fetch(key)
            if not torch.equal(back[:: max(1, nbytes // 4096)], expected):
                raise RuntimeError("runtime engine returned different bytes during calibration")
            del back
            engine.drop(key)
        stats = engine.stats()
        if stats.forwarded_fetches:
            raise RuntimeError("runtime engine served the calibration read from memory, not the disk")
        io_path = stats.io_path
    return writes, reads, io_path


def _io_threads_cpu_s() -> float:
    """CPU seconds used so far by the runtime's I/O threads (``teraio-io*``) of this process."""
    import threading

    total = 0.0
    for t in threading.enumerate():
        if t.name.startswith("teraio-io") and t.ident is not None:
            try:
                total += time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            except (OSError, ProcessLookupError):  # the thread ended in between
                pass
    return total


@contextlib.contextmanager
def _registered_engine(directory: Path, checksum: bool) -> Iterator[int]:
    """A posix runtime engine on ``directory``, reachable from the ``teraio::`` ops by the id yielded."""
    import teraio.graph.ops
    from teraio.runtime.config import RuntimeConfig
    from teraio.runtime.engine import Engine

    engine = Engine(RuntimeConfig(dirs=[str(directory)], backend="posix", checksum=checksum))
    with teraio.graph.ops.RegisteredEngine(engine) as registered:
        yield registered.id


def _op_calls(directory: Path, repeats: int, checksum: bool = True) -> tuple[list[float], list[float]]:
    """Per round trip of one page through the graph's own migration ops (``teraio::offload``,
    ``wait_write``, ``prefetch``, ``fetch``): the seconds the calling thread spends inside those calls,
    and the CPU seconds the I/O threads spend on it (Note: [A transfer's CPU on a CPU-only step]).

    Each transfer gets time to finish before the call that waits for it, so what is timed is the cost
    of the calls themselves (op dispatch, the engine's request and bookkeeping), which a training step
    pays on its compute thread for every tensor it moves, not the disk's latency.
    """
    import torch

    ops = torch.ops.teraio
    settle_s = 0.001  # longer than a page takes through the engine here, short enough to keep caches warm
    rounds, io_cpu = [], []
    with _registered_engine(directory, checksum) as eid:
        for i in range(repeats):
            key = f"calibrate-op-{i}"
            x = torch.zeros(PAGE_NBYTES // 4)
            io0_s = _io_threads_cpu_s()
            t0 = time.perf_counter()
            handle = ops.offload(x, [], key, eid, [1])
            spent = time.perf_counter() - t0
            time.sleep(settle_s)
            t0 = time.perf_counter()
            token = ops.wait_write(handle, x, [], key, eid)
            del x
            fetching = ops.prefetch(token, [], key, eid)
            spent += time.perf_counter() - t0
            time.sleep(settle_s)
            t0 = time.perf_counter()
            back = ops.fetch(fetching, [], key, eid, PAGE_NBYTES // 4, torch.float32, torch.device("cpu"))
            spent += time.perf_counter() - t0
            io_cpu.append(_io_threads_cpu_s() - io0_s)
            if int(back.count_nonzero()):
                raise RuntimeError("runtime engine returned different bytes during calibration")
            del back, token, fetching, handle
            rounds.append(spent)
    return rounds, io_cpu


#: ``_round_trips_under_compute``: small ops per timed block (a small model's: a 32x128 by 128x128
#: matmul and a tanh, tens of microseconds each, and every other one a pointwise op over all the
#: intra-op threads), and pairs of blocks.
COMPUTE_BLOCK_OPS = 40
COMPUTE_BLOCK_PAIRS = 40


def _round_trips_under_compute(directory: Path, pairs: int, checksum: bool = True) -> list[float]:
    """Per pair of blocks of the same small ops, one of them also making one page's round trip through
    the migration ops (offload after the first op, its wait a quarter in, the prefetch half way, the
    fetch three quarters in, so the I/O finishes in between, as in a planned step): how much longer
    that block took. Note: [A transfer's CPU on a CPU-only step]
    """
    import torch

    ops = torch.ops.teraio
    n = COMPUTE_BLOCK_OPS
    gen = torch.Generator().manual_seed(0)
    act, weight = torch.randn(32, 128, generator=gen), torch.randn(128, 128, generator=gen) * 0.1
    # Large enough that every intra-op thread takes part (torch splits pointwise ops above 32768
    # elements): a model's step has such ops, and between them the idle threads spin on the cores the
    # I/O threads need. Note: [A transfer's CPU on a CPU-only step]
    wide = torch.randn(8 * 32768, generator=gen)

    def block(key: str | None, eid: int) -> float:
        x = torch.zeros(PAGE_NBYTES // 4) if key is not None else None
        y = act
        t0 = time.perf_counter()
        for k in range(n):
            if key is not None:
                if k == 0:
                    handle = ops.offload(x, [], key, eid, [1])
                elif k == n // 4:
                    token = ops.wait_write(handle, x, [], key, eid)
                    x = None
                elif k == n // 2:
                    fetching = ops.prefetch(token, [], key, eid)
                elif k == 3 * n // 4:
                    back = ops.fetch(
                        fetching, [], key, eid, PAGE_NBYTES // 4, torch.float32, torch.device("cpu")
                    )
            y = torch.tanh(torch.mm(y, weight))
            if k % 2:
                torch.tanh(wide)
        spent = time.perf_counter() - t0
        if key is not None and int(back.count_nonzero()):
            raise RuntimeError("runtime engine returned different bytes during calibration")
        return spent

    extra = []
    with _registered_engine(directory, checksum) as eid:
        block(None, eid)  # warm-up
        block("calibrate-compute-warm", eid)
        for i in range(pairs):
            base = block(None, eid)
            extra.append(block(f"calibrate-compute-{i}", eid) - base)
    return extra


#: Note: [One quick calibration per directory and process]
#:     ``hardware="calibrate"`` times the offload directory before a backend's first plan: tens of
#:     seconds of CPU on a CPU-only machine (most of it the blocks of ``_round_trips_under_compute``),
#:     and much longer while other processes load the cores. A process that makes several backends on
#:     the same directory (``teraio demo``'s methods, a sweep of budgets, a notebook re-running a cell)
#:     would pay it each time for figures that describe the same disk minutes apart. So the quick
#:     calibration is kept per (directory, checksum) for ``QUICK_REUSE_S``; later backends reuse it and
#:     log that they did. A disk's speed drifts over hours and days (docs/measured_facts.md), not
#:     minutes; ``teraio calibrate`` always measures.
QUICK_REUSE_S = 15 * 60.0
_quick: dict[tuple[str, bool], tuple[float, Calibration]] = {}


def quick_calibration(directory: str | os.PathLike, checksum: bool) -> tuple[Calibration, float | None]:
    """The quick calibration of ``directory`` (``QUICK_NBYTES``), measured now or reused from this
    process (Note: [One quick calibration per directory and process]); with its age in seconds when
    reused, else None."""
    key = (os.path.realpath(directory), bool(checksum))
    now = time.monotonic()
    kept = _quick.get(key)
    if kept is not None and now - kept[0] < QUICK_REUSE_S:
        return kept[1], now - kept[0]
    cal = calibrate(directory, nbytes=QUICK_NBYTES, checksum=checksum)
    _quick[key] = (time.monotonic(), cal)
    return cal, None


def accelerator_computes() -> bool:
    """Whether training computes on an accelerator here (then the host's I/O threads do not slow it)."""
    import torch

    return bool(torch.cuda.is_available())


def calibrate(
    directory: str | os.PathLike,
    nbytes: int = 256 * 2**20,
    block_nbytes: int = 4 * 2**20,
    repeats: int = 3,
    use_engine: bool = True,
    checksum: bool = True,
) -> Calibration:
    """Measure ``directory`` (see the module docstring). ``checksum``: the engine verifies what it reads,
    as the runtime will (its cost is part of the latency a transfer pays).

    Raises:
        UserInputError: the directory is missing or not writable, a size is not a positive multiple of
            4 KiB, or more than the directory's filesystem has free.
        RuntimeIOError: the runtime refuses the directory for offload files (``UnsafePathError``: another
            user's, or writable by others without the sticky bit); Note: [Calibration data is offload data].
    """
    d = Path(directory)
    if not d.is_dir():
        raise UserInputError(
            f"calibrate: '{d}' is not a directory; create it on the disk you will offload to"
        )
    if not os.access(d, os.W_OK | os.X_OK):
        raise UserInputError(f"calibrate: '{d}' is not writable")
    if block_nbytes <= 0 or block_nbytes % PAGE_NBYTES:
        raise UserInputError(
            f"calibrate: block size {block_nbytes} must be a positive multiple of 4096 bytes"
        )
    if nbytes < block_nbytes or nbytes % block_nbytes:
        raise UserInputError(
            f"calibrate: size {nbytes} must be a positive multiple of the block size {block_nbytes}"
        )
    if repeats < 1:
        raise UserInputError("calibrate: --repeats must be at least 1")
    try:
        st = os.statvfs(d)
        free_nbytes = st.f_bavail * st.f_frsize
    except OSError:
        free_nbytes = None
    if free_nbytes is not None and nbytes > free_nbytes:  # before measuring, not at ENOSPC minutes in
        raise UserInputError(
            f"calibrate: size {nbytes} bytes is more than the {free_nbytes} bytes free in '{d}'; "
            f"give a smaller --size"
        )
    warnings: list[str] = []
    fs = filesystem_type(d)
    if fs in RAM_FILESYSTEMS:
        warnings.append(f"'{d}' is on {fs}: offloading there keeps the bytes in RAM and saves no memory")
    # Note: [Calibration data is offload data]
    # The raw measurements write into the data file of an offload directory of the runtime's own
    # (``runtime.space.OffloadDir``): a fresh private (0700) subdirectory with a random name, locked
    # while this process lives, its files created O_EXCL|O_NOFOLLOW. So they get what offload files get:
    # removed at exit and on SIGTERM, and after a SIGKILL by the next engine start, calibration or demo
    # in the same directory (a scratch directory of its own was left behind by all three), and the
    # directory itself must be one teraio would offload to (yours, writable by nobody else unless sticky).
    from teraio.runtime.space import OffloadDir

    scratch = OffloadDir(Path(os.path.abspath(d)), rank=0, direct_io=None, fault_injector=None)
    path = scratch.data_path
    samples: dict[str, list[float]] = {"direct_write_s": [], "direct_read_s": []}
    try:
        used_direct = True
        for _ in range(repeats):
            w, r, direct = _direct_round_trip(path, nbytes, block_nbytes)
            samples["direct_write_s"].append(w)
            samples["direct_read_s"].append(r)
            used_direct = used_direct and direct
        if not used_direct:
            warnings.append(f"O_DIRECT is not supported on '{d}': measured buffered I/O with fsync + fadvise")
        lat_w, lat_r = _latency(path)
    finally:
        scratch.close()
    direct_lat_w, direct_lat_r = lat_w, lat_r
    direct_w = nbytes / statistics.median(samples["direct_write_s"])
    direct_r = nbytes / statistics.median(samples["direct_read_s"])
    method, write_bw, read_bw = "O_DIRECT", direct_w, direct_r
    cpu_per_transfer = 0.0
    if use_engine:
        try:
            writes, reads, io_path = _engine_round_trip(d, nbytes, repeats, checksum)
        except Exception as e:  # the runtime may be missing or broken: say why once, keep the raw figures
            msg = f"runtime engine not usable for calibration ({type(e).__name__}: {e}); model uses raw O_DIRECT"
            log.warning(msg)
            warnings.append(msg)
        else:
            samples["engine_write_s"], samples["engine_read_s"] = writes, reads
            method = f"runtime.Engine(posix, {io_path})"
            write_bw = nbytes / statistics.median(writes)
            read_bw = nbytes / statistics.median(reads)
            # The latency a transfer really pays: one page through the engine (request, I/O thread,
            # checksum, completion), not the disk alone. With many small tensors (a small model) this
            # fixed cost is most of the I/O time.
            small_w, small_r, _ = _engine_round_trip(d, PAGE_NBYTES, LATENCY_REPEATS, checksum)
            samples["engine_page_write_s"], samples["engine_page_read_s"] = small_w, small_r
            direct_lat_w, direct_lat_r = lat_w, lat_r
            lat_w, lat_r = statistics.median(small_w), statistics.median(small_r)
            calls, io_cpu = _op_calls(d, LATENCY_REPEATS, checksum)
            samples["op_calls_round_trip_s"] = calls
            samples["io_threads_cpu_round_trip_s"] = io_cpu
            cpu_per_transfer = statistics.median(calls) / 2
            if not accelerator_computes():
                # Note: [A transfer's CPU on a CPU-only step]
                cpu_per_transfer = statistics.median(c + io for c, io in zip(calls, io_cpu)) / 2
                under = _round_trips_under_compute(d, COMPUTE_BLOCK_PAIRS, checksum)
                samples["round_trip_under_compute_s"] = under
                if statistics.median(under) > 0:  # noise could make it meaningless; then the parts' sum
                    cpu_per_transfer = statistics.median(under) / 2
    return Calibration(
        dir=str(d),
        nbytes=nbytes,
        block_nbytes=block_nbytes,
        repeats=repeats,
        fs_type=fs,
        method=method,
        write_bw_bytes_per_s=write_bw,
        read_bw_bytes_per_s=read_bw,
        write_latency_s=lat_w,
        read_latency_s=lat_r,
        direct_write_bw_bytes_per_s=direct_w,
        direct_read_bw_bytes_per_s=direct_r,
        direct_write_latency_s=direct_lat_w,
        direct_read_latency_s=direct_lat_r,
        cpu_s_per_transfer=cpu_per_transfer,
        samples=samples,
        warnings=warnings,
    )
