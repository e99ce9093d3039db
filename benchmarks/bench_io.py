"""Throughput of the runtime engine against the raw disk, measured in the same run on the same directory.

The raw baseline is the best a single process can get from the directory: one large O_DIRECT pwrite
(pread) of the same bytes from (into) a page-aligned buffer, on a preallocated file like the engine's.
The engine figure is offload()+wait() of an ordinary (unaligned) torch tensor and fetch() of it after
release(); the fetched tensor is an ordinary torch allocation, read with O_DIRECT straight into it when
torch page-aligns it (``THP_MEM_ALLOC_ENABLE=1`` in the environment) or through a bounce buffer
otherwise (the summary's ``read_path``). Runs are interleaved (raw, engine, raw, engine, ...) so drift hits both; the first round
is a warm-up and is excluded; medians are reported.

    python -m benchmarks.bench_io --dir /nvme/x [--size 1GiB] [--repeats 5] [--json] [--out r.csv]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from teraio.planner.safe_io import atomic_writer
from teraio.runtime import Engine, RuntimeConfig, parse_nbytes
from teraio.runtime.buffers import aligned_buffer, memmove

MIB = 1 << 20


def _raw_write(path: Path, buf: torch.Tensor) -> float:
    """Seconds for one O_DIRECT pwrite of ``buf`` into a preallocated file."""
    view = memoryview(buf.numpy())
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        os.posix_fallocate(fd, 0, len(view))
        t0 = time.perf_counter()
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], done)
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def _raw_read(path: Path, buf: torch.Tensor) -> float:
    """Seconds for one O_DIRECT pread of the file into ``buf``."""
    view = memoryview(buf.numpy())
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        t0 = time.perf_counter()
        done = 0
        while done < len(view):
            done += os.preadv(fd, [view[done:]], done)
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def _fio(directory: Path, nbytes: int) -> dict[str, float] | None:
    """fio's sequential direct write/read in GB/s (1 MiB blocks, QD16), or None if fio is absent."""
    if shutil.which("fio") is None:
        return None
    out = {}
    # fio names its data file after the job ("teraio.0.0", or "teraio" in fio 3.33): run it in a private
    # directory of our own and remove that directory, whatever fio left in it.
    with tempfile.TemporaryDirectory(dir=directory, prefix="fio-") as fio_dir:
        for rw in ("write", "read"):
            res = subprocess.run(
                ["fio", "--name=teraio", f"--directory={fio_dir}", f"--rw={rw}", "--bs=1M", "--direct=1",
                 "--ioengine=libaio", "--iodepth=16", f"--size={nbytes}", "--output-format=json"],
                capture_output=True, text=True, check=False,
            )  # fmt: skip
            if res.returncode != 0:
                return None
            try:
                job = json.loads(res.stdout)["jobs"][0][rw]
                out[f"fio_{rw}_gb_per_s"] = job["bw_bytes"] / 1e9
            except (ValueError, KeyError, IndexError, TypeError):
                return None
    return out


def machine_info() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "machine": platform.machine(),
        "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE", "<unset>"),
    }


def run(
    directory: str | os.PathLike[str],
    size_nbytes: int = 1 << 30,
    *,
    sizes: list[int] | None = None,
    repeats: int = 3,
    io_threads: int = 2,
    chunk_bytes: int = 4 * MIB,
    backend: str = "posix",
) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Measure engine and raw throughput for each tensor size; return (per-run rows, summary).

    ``sizes`` defaults to 64 MiB, 256 MiB, ... up to ``size_nbytes``. The summary's headline figures
    are the medians at the largest size.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if sizes is None:
        sizes = [s for s in (64 * MIB, 256 * MIB, 1024 * MIB) if s < size_nbytes] + [size_nbytes]
    rows = []
    cfg = RuntimeConfig(
        dirs=[directory], backend=backend, io_threads=io_threads, chunk_bytes=chunk_bytes,
        reserve_bytes=max(sizes),
    )  # fmt: skip
    with Engine(cfg) as eng, tempfile.TemporaryDirectory(dir=directory, prefix="raw-") as raw_dir:
        raw_path = Path(raw_dir) / "raw.bin"
        for nbytes in sizes:
            src = torch.randint(0, 256, (nbytes + 64,), dtype=torch.uint8)[64:]  # unaligned, like real
            raw_buf = aligned_buffer(nbytes)
            memmove(raw_buf.data_ptr(), src.data_ptr(), nbytes)
            raw_back = aligned_buffer(nbytes)
            for rep in range(repeats + 1):  # round 0 is the warm-up
                write_s = _raw_write(raw_path, raw_buf)
                t0 = time.perf_counter()
                eng.offload("bench", src).wait()
                eng_write_s = time.perf_counter() - t0
                eng.release("bench")
                read_s = _raw_read(raw_path, raw_back)
                # The same read into freshly mapped memory, as the engine must (its result is a new
                # tensor): separates the disk from the cost of faulting in new pages.
                fresh = aligned_buffer(nbytes)
                fresh_read_s = _raw_read(raw_path, fresh)
                del fresh
                t0 = time.perf_counter()
                back = eng.fetch("bench")
                eng_read_s = time.perf_counter() - t0
                if rep == 0:
                    if not torch.equal(back, src) or not torch.equal(raw_back, raw_buf):
                        raise RuntimeError("benchmark data came back wrong")
                    del back
                    continue
                del back
                for what, direction, secs in (
                    ("raw", "write", write_s),
                    ("engine", "write", eng_write_s),
                    ("raw", "read", read_s),
                    ("raw_fresh", "read", fresh_read_s),
                    ("engine", "read", eng_read_s),
                ):
                    rows.append(dict(nbytes=nbytes, what=what, direction=direction, rep=rep,
                                     seconds=secs, gb_per_s=nbytes / secs / 1e9))  # fmt: skip
            raw_path.unlink()
            del raw_buf, raw_back, src
        stats = eng.stats()
    df = pd.DataFrame(rows)
    med = df.groupby(["nbytes", "what", "direction"])["gb_per_s"].median()
    top = max(sizes)
    summary: dict[str, Any] = {
        "dir": str(directory),
        "io_path": stats.io_path,
        "read_path": stats.read_path,
        "direct_read_nbytes": stats.direct_read_nbytes,
        "bounced_read_nbytes": stats.bounced_read_nbytes,
        "io_threads": io_threads,
        "chunk_bytes": chunk_bytes,
        "repeats": repeats,
        "size_nbytes": top,
        "write_gb_per_s": med[(top, "engine", "write")],
        "read_gb_per_s": med[(top, "engine", "read")],
        "raw_write_gb_per_s": med[(top, "raw", "write")],
        "raw_read_gb_per_s": med[(top, "raw", "read")],
        "raw_read_fresh_buffer_gb_per_s": med[(top, "raw_fresh", "read")],
        "per_size": [
            {
                "nbytes": n,
                **{f"{w}_{d}_gb_per_s": med[(n, w, d)] for w in ("engine", "raw") for d in ("write", "read")},
                "raw_read_fresh_buffer_gb_per_s": med[(n, "raw_fresh", "read")],
            }
            for n in sizes
        ],
        "machine": machine_info(),
    }
    summary["write_ratio"] = summary["write_gb_per_s"] / summary["raw_write_gb_per_s"]
    summary["read_ratio"] = summary["read_gb_per_s"] / summary["raw_read_gb_per_s"]
    fio = _fio(directory, top)
    summary["fio"] = fio if fio is not None else "fio not installed"
    return df, summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="directory on the disk to measure")
    parser.add_argument("--size", default="1GiB", help="largest tensor size (default 1GiB)")
    parser.add_argument("--sizes", default=None, help="comma-separated sizes instead of 64MiB..--size")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per size (after 1 warm-up)")
    parser.add_argument("--io-threads", type=int, default=2)
    parser.add_argument("--chunk", default="4MiB", help="engine chunk size")
    parser.add_argument("--backend", default="posix", choices=["posix", "kvikio", "host"])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", default=None, help="write per-run rows to this .csv or .json")
    args = parser.parse_args(argv)
    try:
        sizes = [parse_nbytes(s, what="--sizes") for s in args.sizes.split(",")] if args.sizes else None
        df, summary = run(
            args.dir,
            parse_nbytes(args.size, what="--size"),
            sizes=sizes,
            repeats=args.repeats,
            io_threads=args.io_threads,
            chunk_bytes=parse_nbytes(args.chunk, what="--chunk"),
            backend=args.backend,
        )
    except Exception as exc:  # one line, not a traceback
        print(f"bench_io: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    if args.out:
        with atomic_writer(args.out, overwrite=True) as f:
            (df.to_json(f, orient="records") if args.out.endswith(".json") else df.to_csv(f))
    if args.json:
        print(json.dumps(summary))
        return 0
    print(json.dumps(summary["machine"]))
    print(
        f"dir {summary['dir']} ({summary['io_path']}, reads {summary['read_path']}), "
        f"{args.io_threads} I/O threads, chunk {args.chunk}"
    )
    table = pd.DataFrame(summary["per_size"])
    table.insert(0, "MiB", table.pop("nbytes") // MIB)
    print(table.to_string(index=False, float_format=lambda x: f"{x:.2f}"))
    print(
        f"engine/raw at {summary['size_nbytes'] // MIB} MiB: write {summary['write_ratio']:.0%}, "
        f"read {summary['read_ratio']:.0%} (vs a raw read into fresh memory: "
        f"{summary['read_gb_per_s'] / summary['raw_read_fresh_buffer_gb_per_s']:.0%}); fio: {summary['fio']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
