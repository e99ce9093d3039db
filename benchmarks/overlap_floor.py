"""The best overlap this machine allows a step's compute and I/O: both at once, neither waiting for the other.

``bench_states`` judges a whole-state step against max(compute alone, I/O at the raw disk rates). That
bound assumes computing and moving bytes do not slow each other down. On a CPU machine they share the
cores and the memory: the I/O threads checksum every byte, and the intra-op threads wait at their
barriers while an I/O thread holds a core. This benchmark measures what the sharing costs with nothing
else in the way:

- the step's compute: ``bench_states``'s compute-alone measure run as one loop (each block's forward,
  backward and AdamW update on one resident block, ``layers`` times, then the embeddings and head);
- the step's I/O: a second thread (``--io-in process``: a process of its own) drives the runtime engine (the states' configuration: posix, its
  default threads and chunk) through the step's must-move bytes, 64 MiB units fetched a few ahead and
  written back (the streamed step's unit), cycling over files larger than the raw measure's;
- both together, started at once, with no dependency between them.

The process keeps freed memory as bench_states' training does (``teraio.platform.cpu_malloc``). The step
allocates its fetched buffers on its main thread, which reuses them; the floor's I/O thread reuses them
only when glibc gives it the main arena, and ``together_minor_faults`` shows the rounds it did not (Note:
[Freed CPU memory and step time]). Rounds are interleaved (compute alone, I/O alone, both) after a warm-up round;
medians are reported. The together run's wall time is what a perfect pipeline of those bytes and that compute could reach on
this machine; ``floor_vs_max_compute_io`` is the best ``step_vs_max_compute_io`` any schedule of the
step could show (bench_states measures the disk the same way, before and after, and takes the faster).

    python -m benchmarks.overlap_floor [--config 2b] [--read-gb 24.37 --write-gb 20.39 | --from-report R.json]
                                       [--checksums crc32c none] [--io-threads 2] [--reps 3] [--json] [--out F]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Literal

# The states' fetched buffers are page-aligned torch allocations (O_DIRECT without a bounce copy), as in
# bench_states; torch reads it at its first allocation.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.step_overlap import EngineMark  # noqa: E402
from teraio.runtime import Engine, RuntimeConfig, parse_nbytes  # noqa: E402
from teraio.tools.models.gpt import Block, GPTConfig, synthetic_batch  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30
UNIT_NBYTES = 64 * MIB  # the streamed step's default states_chunk_bytes
#: The 2B model's must-move bytes per step at ``--budget 14GB`` (bench_states' io_must_read_bytes and
#: io_must_write_bytes; the plan keeps the same items in every run).
BUDGET_14GB_READ_BYTES = 24_374_362_112
BUDGET_14GB_WRITE_BYTES = 20_393_902_080


class ComputeLoop:
    """The compute of one step without I/O, as one run (bench_states' compute alone, not extrapolated)."""

    def __init__(self, cfg: GPTConfig, lr: float = 1e-4) -> None:
        self.cfg = cfg
        self.block = Block(cfg)
        self.opt = torch.optim.AdamW(self.block.parameters(), lr=lr)
        b, s, h = cfg.batch, cfg.seq, cfg.hidden
        self.x = torch.randn(b, s, h, requires_grad=True)
        self.grad_out = torch.randn(b, s, h)
        self.idx, self.targets = synthetic_batch(cfg, 0)
        self.ends = nn.ModuleDict(
            {
                "tok": nn.Embedding(cfg.vocab, h),
                "pos": nn.Embedding(cfg.seq, h),
                "ln_f": nn.LayerNorm(h),
                "head": nn.Linear(h, cfg.vocab, bias=False),
            }
        )
        self.ends_opt = torch.optim.AdamW(self.ends.parameters(), lr=lr)
        self.last = torch.randn(b, s, h, requires_grad=True)

    def run(self) -> float:
        """Seconds for the step's compute."""
        t0 = time.perf_counter()
        for _ in range(self.cfg.layers):
            self.opt.zero_grad(set_to_none=True)
            self.x.grad = None
            self.block(self.x).backward(self.grad_out)
            self.opt.step()
        ends, s = self.ends, self.cfg.seq
        (ends["tok"](self.idx) + ends["pos"](torch.arange(s))).backward(self.grad_out)
        logits = ends["head"](ends["ln_f"](self.last))
        F.cross_entropy(logits.view(-1, logits.shape[-1]), self.targets.view(-1)).backward()
        self.ends_opt.step()
        self.ends_opt.zero_grad(set_to_none=True)
        self.last.grad = None
        return time.perf_counter() - t0


class IOLoop:
    """The step's must-move bytes through the runtime engine: ``unit_nbytes`` units read ``ahead`` ahead and
    written back in the proportion writes bear to reads, at most ``write_window`` writes in flight."""

    def __init__(
        self,
        directory: Path,
        read_nbytes: int,
        write_nbytes: int,
        *,
        checksum: str | None,
        io_threads: int,
        units: int,
        unit_nbytes: int = UNIT_NBYTES,
        engine_chunk_nbytes: int | None = None,
        ahead: int = 2,
        write_window: int = 2,
    ) -> None:
        if units <= ahead + write_window:
            raise ValueError(f"units={units}: need more than ahead + write_window = {ahead + write_window}")
        self.n_reads = max(1, round(read_nbytes / unit_nbytes))
        self.n_writes = min(self.n_reads, round(write_nbytes / unit_nbytes))
        self.units, self.ahead, self.write_window = units, ahead, write_window
        self.engine = Engine(
            RuntimeConfig(
                dirs=[directory],
                backend="posix",
                io_threads=io_threads,
                checksum=checksum if checksum is not None else False,
                reserve_bytes=2 * units * unit_nbytes,
                **({} if engine_chunk_nbytes is None else {"chunk_bytes": engine_chunk_nbytes}),
            )
        )
        for u in range(units):
            self.engine.offload(self._key(u), torch.randint(0, 256, (unit_nbytes,), dtype=torch.uint8)).wait()
            self.engine.release(self._key(u))

    @staticmethod
    def _key(unit: int) -> str:
        return f"unit{unit}"

    def run(self) -> dict[str, float]:
        """Seconds, bytes moved and I/O-thread CPU for one step's I/O."""
        eng = self.engine
        before = EngineMark.now(eng)
        pending: collections.deque[str] = collections.deque()
        t0 = time.perf_counter()

        def prefetch(i: int) -> None:
            key = self._key(i % self.units)
            if key in pending:  # still in memory until its write is released: read it from the disk
                pending.remove(key)
                eng.release(key)
            eng.prefetch(key)

        for i in range(min(self.ahead, self.n_reads)):
            prefetch(i)
        for i in range(self.n_reads):
            if i + self.ahead < self.n_reads:
                prefetch(i + self.ahead)
            key = self._key(i % self.units)
            t = eng.fetch(key, exclusive=True)
            if (i + 1) * self.n_writes // self.n_reads > i * self.n_writes // self.n_reads:
                eng.offload(key, t)
                pending.append(key)
                if len(pending) > self.write_window:
                    eng.release(pending.popleft())
            del t
        while pending:
            eng.release(pending.popleft())
        seconds = time.perf_counter() - t0
        after = EngineMark.now(eng)
        return {
            "seconds": seconds,
            "read_bytes": after.read_bytes - before.read_bytes,
            "written_bytes": after.written_bytes - before.written_bytes,
            "io_cpu_s": (after.io_user_s - before.io_user_s) + (after.io_system_s - before.io_system_s),
        }

    def close(self) -> None:
        self.engine.close()


def _io_child(conn: Any, args: tuple, kwargs: dict[str, Any]) -> None:
    """The I/O loop in a process of its own: ``"run"`` runs it and sends its figures back."""
    from teraio.platform.cpu_malloc import apply_cpu_malloc

    apply_cpu_malloc("retain")
    io = IOLoop(*args, **kwargs)
    conn.send((io.n_reads, io.n_writes))
    try:
        while conn.recv() == "run":
            cpu0, flt0 = time.process_time(), _minor_faults()
            figures = io.run()
            conn.send(
                {
                    **figures,
                    "process_cpu_s": time.process_time() - cpu0,
                    "process_minor_faults": _minor_faults() - flt0,
                }
            )
    finally:
        io.close()


class ChildIOLoop:
    """:class:`IOLoop` in a child process: the control that tells the machine's sharing (cores, memory,
    the disk's interrupts) from what the step's threads share in one process (the GIL, glibc's arenas)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(target=_io_child, args=(child_conn, args, kwargs), name="overlap-floor-io")
        self._proc.start()
        self.n_reads, self.n_writes = self._conn.recv()

    def run(self) -> dict[str, float]:
        self._conn.send("run")
        return self._conn.recv()

    def close(self) -> None:
        self._conn.send("stop")
        self._proc.join()


def _together(compute: ComputeLoop, io: IOLoop | ChildIOLoop) -> dict[str, float]:
    """Both started at once on two threads of this process (as in a step); each one's seconds and the wall."""
    out: dict[str, Any] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def drive_io() -> None:
        try:
            start.wait()
            out["io"] = io.run()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread
            errors.append(exc)

    thread = threading.Thread(target=drive_io, name="overlap-floor-io")
    thread.start()
    start.wait()
    t0 = time.perf_counter()
    compute_s = compute.run()
    thread.join()
    wall_s = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return {"compute_s": compute_s, "io_s": out["io"]["seconds"], "wall_s": wall_s, **{
        f"io_{k}": v for k, v in out["io"].items() if k != "seconds"
    }}  # fmt: skip


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _round(compute: ComputeLoop, io: IOLoop | ChildIOLoop) -> dict[str, Any]:
    """Compute alone, I/O alone, both together, each with the CPU seconds it took and the pages it faulted
    in (this process's, plus the I/O child's when there is one)."""
    cpu0, flt0 = time.process_time(), _minor_faults()
    compute_s = compute.run()
    compute_cpu_s, compute_faults = time.process_time() - cpu0, _minor_faults() - flt0
    cpu0, flt0 = time.process_time(), _minor_faults()
    io_alone = io.run()
    io_alone["cpu_s"] = io_alone.get("process_cpu_s", time.process_time() - cpu0)
    io_alone["minor_faults"] = io_alone.get("process_minor_faults", _minor_faults() - flt0)
    cpu0, flt0 = time.process_time(), _minor_faults()
    together = _together(compute, io)
    together["cpu_s"] = time.process_time() - cpu0 + together.get("io_process_cpu_s", 0.0)
    together["minor_faults"] = _minor_faults() - flt0 + together.get("io_process_minor_faults", 0)
    return {"compute_alone_s": compute_s, "compute_alone_cpu_s": compute_cpu_s,
            "compute_alone_minor_faults": compute_faults, "io_alone": io_alone,
            "together": together}  # fmt: skip


def run(
    config: str = "2b",
    directory: str | os.PathLike[str] | None = None,
    *,
    read_nbytes: int = BUDGET_14GB_READ_BYTES,
    write_nbytes: int = BUDGET_14GB_WRITE_BYTES,
    checksums: tuple[str | None, ...] = ("crc32c", None),
    io_threads: int = 2,
    units: int = 128,
    unit_nbytes: int = UNIT_NBYTES,
    engine_chunk_nbytes: int | None = None,
    reps: int = 3,
    io_size: int = GIB,
    layers: int | None = None,
    io_in: Literal["thread", "process"] = "thread",
) -> dict[str, Any]:
    """The whole benchmark (see the module docstring); returns the report."""
    from dataclasses import asdict, replace

    from benchmarks import bench_io
    from benchmarks.bench_states import CONFIGS
    from benchmarks.states_reference import machine_info
    from teraio.platform.cpu_malloc import apply_cpu_malloc
    from teraio.runtime.config import default_offload_dir

    cfg = CONFIGS[config]
    if layers is not None:
        cfg = replace(cfg, layers=layers)
    base = Path(directory) if directory is not None else default_offload_dir()
    base.mkdir(parents=True, exist_ok=True)
    # bench_states trains with freed blocks retained (fetched buffers reuse faulted-in pages).
    apply_cpu_malloc("retain")
    torch.manual_seed(0)
    compute = ComputeLoop(cfg)
    _, disk_before = bench_io.run(base, io_size, sizes=[io_size], repeats=2)
    variants = []
    make = ChildIOLoop if io_in == "process" else IOLoop
    with tempfile.TemporaryDirectory(dir=base, prefix="overlap-floor-") as work:
        for checksum in checksums:
            io = make(
                Path(work) / (checksum or "none"), read_nbytes, write_nbytes,
                checksum=checksum, io_threads=io_threads, units=units, unit_nbytes=unit_nbytes,
                engine_chunk_nbytes=engine_chunk_nbytes,
            )  # fmt: skip
            try:
                rounds = []
                for rnd in range(reps + 1):  # round 0 warms up both loops and the pages they touch
                    row = _round(compute, io)
                    print(
                        f"[overlap_floor] checksum={checksum}: round {rnd}: compute {row['compute_alone_s']:.2f} s, "
                        f"I/O {row['io_alone']['seconds']:.2f} s, together {row['together']['wall_s']:.2f} s "
                        f"(compute {row['together']['compute_s']:.2f}, I/O {row['together']['io_s']:.2f})",
                        file=sys.stderr,
                        flush=True,
                    )
                    if rnd:
                        rounds.append(row)
            finally:
                io.close()
            variants.append((checksum, io, rounds))
    _, disk_after = bench_io.run(base, io_size, sizes=[io_size], repeats=2)
    raw_read = max(disk_before["raw_read_gb_per_s"], disk_after["raw_read_gb_per_s"]) * 1e9
    raw_write = max(disk_before["raw_write_gb_per_s"], disk_after["raw_write_gb_per_s"]) * 1e9
    report_variants = []
    for checksum, io, rounds in variants:
        moved_read = io.n_reads * unit_nbytes
        moved_written = io.n_writes * unit_nbytes
        io_bound_s = moved_read / raw_read + moved_written / raw_write
        med = statistics.median
        compute_alone_s = med(r["compute_alone_s"] for r in rounds)
        io_alone_s = med(r["io_alone"]["seconds"] for r in rounds)
        wall_s = med(r["together"]["wall_s"] for r in rounds)
        bound_s = max(compute_alone_s, io_bound_s)
        report_variants.append(
            {
                "checksum": checksum or "none",
                "read_bytes": moved_read,
                "written_bytes": moved_written,
                "io_bound_s": io_bound_s,
                "compute_alone_s": compute_alone_s,
                "io_alone_s": io_alone_s,
                "io_alone_vs_io_bound": io_alone_s / io_bound_s,
                "io_cpu_s_per_gb": med(
                    r["io_alone"]["io_cpu_s"]
                    / ((r["io_alone"]["read_bytes"] + r["io_alone"]["written_bytes"]) / 1e9)
                    for r in rounds
                ),
                "together_wall_s": wall_s,
                "together_compute_s": med(r["together"]["compute_s"] for r in rounds),
                "together_io_s": med(r["together"]["io_s"] for r in rounds),
                "compute_slowdown": med(r["together"]["compute_s"] / r["compute_alone_s"] for r in rounds),
                "io_slowdown": med(r["together"]["io_s"] / r["io_alone"]["seconds"] for r in rounds),
                "floor_vs_max_compute_io": wall_s / bound_s,
                # CPU seconds (all threads, and the I/O child) over wall seconds: 2.0 on this VM's 2 cores
                # means nothing more can run at once.
                "compute_alone_cores_busy": med(
                    r["compute_alone_cpu_s"] / r["compute_alone_s"] for r in rounds
                ),
                "io_alone_cores_busy": med(r["io_alone"]["cpu_s"] / r["io_alone"]["seconds"] for r in rounds),
                "together_cores_busy": med(r["together"]["cpu_s"] / r["together"]["wall_s"] for r in rounds),
                # Pages faulted in (fetched buffers landing on fresh memory cost the kernel's zeroing).
                "io_alone_minor_faults": med(r["io_alone"]["minor_faults"] for r in rounds),
                "together_minor_faults": med(r["together"]["minor_faults"] for r in rounds),
                "rounds": rounds,
            }
        )
    return {
        "config": config,
        "gpt": asdict(cfg),
        "unit_nbytes": unit_nbytes,
        "engine_chunk_nbytes": engine_chunk_nbytes or parse_nbytes(RuntimeConfig.chunk_bytes),
        "units": units,
        "io_threads": io_threads,
        "io_in": io_in,
        # Set before the process started, it decides which arena a new thread allocates from (Note: [Freed
        # CPU memory and step time] in teraio.platform.cpu_malloc).
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
        "reps": reps,
        "raw_read_gb_per_s": raw_read / 1e9,
        "raw_write_gb_per_s": raw_write / 1e9,
        "disk_before": {k: disk_before[k] for k in ("raw_read_gb_per_s", "raw_write_gb_per_s", "read_path")},
        "disk_after": {k: disk_after[k] for k in ("raw_read_gb_per_s", "raw_write_gb_per_s", "read_path")},
        "variants": report_variants,
        "machine": machine_info(),
        "loadavg_at_end": os.getloadavg(),
    }


def _checked_sizes(args: argparse.Namespace) -> dict[str, Any]:
    """The byte counts ``run`` takes, from the command line; raises with a one-line message naming the
    option at fault."""
    from teraio.sizes import nbytes_of

    for name, value, least in (("--reps", args.reps, 1), ("--io-threads", args.io_threads, 1),
                               ("--units", args.units, 5), ("--layers", args.layers or 1, 1)):  # fmt: skip
        if value < least:
            raise ValueError(f"{name} {value}: must be at least {least}")
    read_nbytes, write_nbytes = BUDGET_14GB_READ_BYTES, BUDGET_14GB_WRITE_BYTES
    if args.from_report:
        report = json.loads(Path(args.from_report).read_text())
        if "io_must_read_bytes" not in report or "io_must_write_bytes" not in report:
            raise ValueError(
                f"--from-report {args.from_report}: not a bench_states report (no io_must_*_bytes)"
            )
        read_nbytes, write_nbytes = report["io_must_read_bytes"], report["io_must_write_bytes"]
    if args.read_gb is not None:
        read_nbytes = int(args.read_gb * 1e9)
    if args.write_gb is not None:
        write_nbytes = int(args.write_gb * 1e9)
    if read_nbytes <= 0 or write_nbytes < 0:
        raise ValueError(f"bytes per step read {read_nbytes}, written {write_nbytes}: read must be positive")
    unit_nbytes = nbytes_of(args.unit, "--unit")
    engine_chunk = None if args.engine_chunk is None else nbytes_of(args.engine_chunk, "--engine-chunk")
    for name, n in (("--unit", unit_nbytes), ("--engine-chunk", engine_chunk)):
        if n is not None and (n <= 0 or n % 4096):
            raise ValueError(f"{name} {n}: must be a positive multiple of 4096 bytes (O_DIRECT)")
    return {"read_nbytes": read_nbytes, "write_nbytes": write_nbytes, "unit_nbytes": unit_nbytes,
            "engine_chunk_nbytes": engine_chunk, "io_size": nbytes_of(args.io_size, "--io-size")}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.overlap_floor", description=__doc__.split("\n")[0])
    p.add_argument("--dir", default=None, help="offload directory (default: teraio's)")
    p.add_argument(
        "--config",
        default="2b",
        choices=["2b", "tiny"],
        help="the GPT whose compute runs (bench_states' configs)",
    )
    p.add_argument("--layers", type=int, default=None, help="override the config's layer count")
    p.add_argument(
        "--read-gb", type=float, default=None, help="GB read per step (default: the 14 GB budget's)"
    )
    p.add_argument("--write-gb", type=float, default=None, help="GB written per step")
    p.add_argument("--from-report", default=None, help="take the must-move bytes from a bench_states JSON")
    p.add_argument("--checksums", nargs="+", default=["crc32c", "none"], choices=["crc32c", "xxhash", "none"])
    p.add_argument("--io-threads", type=int, default=2)
    p.add_argument(
        "--io-in", default="thread", choices=["thread", "process"],
        help="drive the I/O from a thread of this process (as a step does) or from a process of its own",
    )  # fmt: skip
    p.add_argument("--unit", default="64MiB", help="bytes read or written at once (states_chunk_bytes)")
    p.add_argument("--engine-chunk", default=None, help="the engine's chunk_bytes (default: the runtime's)")
    p.add_argument("--units", type=int, default=128, help="units cycled over (the files' size)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--io-size", default="1GiB", help="bytes of the raw disk measure")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--out", default=None, help="write the JSON report here")
    args = p.parse_args(argv)
    try:  # every input checked before the disk is measured or a byte allocated
        sizes = _checked_sizes(args)
    except (ValueError, OSError) as exc:
        print(f"overlap_floor: {exc}", file=sys.stderr)
        return 2
    report = run(
        args.config, args.dir,
        checksums=tuple(None if c == "none" else c for c in args.checksums),
        io_threads=args.io_threads, units=args.units, reps=args.reps,
        layers=args.layers, io_in=args.io_in, **sizes,
    )  # fmt: skip
    text = json.dumps(report, indent=2)
    if args.out:
        from teraio.planner.safe_io import atomic_writer

        with atomic_writer(args.out, overwrite=True) as f:
            f.write(text)
    if args.json:
        print(text)
    else:
        for v in report["variants"]:
            print(
                f"checksum {v['checksum']}: compute alone {v['compute_alone_s']:.2f} s, I/O bound "
                f"{v['io_bound_s']:.2f} s (engine alone {v['io_alone_s']:.2f} s), together "
                f"{v['together_wall_s']:.2f} s = {v['floor_vs_max_compute_io']:.2f}x max(compute, I/O bound); "
                f"compute x{v['compute_slowdown']:.2f}, I/O x{v['io_slowdown']:.2f} when together"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
