"""First-GPU-machine checks for teraio: one verdict line per check (see docs/gpu_checklist.md).

Each check runs something a user runs and compares it with an independent measurement on the GPU:
the runtime's round trips per tier, the stream ordering a fake device only simulates on CPU (checksums
on and off), whether ``fetch`` and ``drop`` return while the compute stream is busy, I/O overlapping
compute (CUDA-event timings), the host tier's accounting against torch's pinned allocator, ``io_path``
against NVIDIA's ``gdscheck``, the profile's op durations against the kernels' own times on a
compute-bound model, and the backend's measured peak against ``max_memory_allocated``. Verdicts: PASS,
FAIL (with the numbers), SKIP (with the reason: CUDA absent, no kvikio, no gdscheck) and MANUAL (a step
for a person, e.g. reading an Nsight Systems trace). Without CUDA every check says SKIP and the exit
status is 0; with CUDA the exit status is 1 if any check FAILed.

The ``host_blocking`` and ``ordering`` checks run against a small compute adapter (:class:`CudaCompute`
on a GPU); ``rehearse_on_fake_device`` runs the same code on CPU with the fake device standing in
(:class:`FakeCompute`), which is what the smoke test exercises: the code paths and the bytes, not the
timings.

    python -m benchmarks.gpu_check [--dir /nvme/x] [--size 256MiB] [--only NAME ...] [--json] [--rehearse]
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch

from teraio.runtime import Engine, RuntimeConfig, parse_nbytes

MIB = 1 << 20
VerdictName = Literal["PASS", "FAIL", "SKIP", "MANUAL"]
#: The longest a single ``fetch`` or ``drop`` may take on the host while the compute stream is busy
#: (docs/gpu_checklist.md): bookkeeping and a stream-event wait take well under a millisecond; a host
#: wait for the busy kernels would take as long as they have left to run (hundreds of milliseconds).
HOST_BLOCKING_MAX_MS = 5.0


@dataclass(frozen=True)
class Verdict:
    check: str
    verdict: VerdictName
    detail: str


@dataclass(frozen=True)
class Context:
    dir: Path
    size_nbytes: int
    device: torch.device


def _cuda_tensor(nbytes: int, device: torch.device, seed: int) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=g)


def _tiers() -> list[str]:
    from teraio.runtime.tiers.gds import kvikio_status

    return ["host", "posix"] + (["kvikio"] if kvikio_status()[0] else [])


def _engine(ctx: Context, backend: str, sub: str, device=None, **kw) -> Engine:
    dirs = [] if backend == "host" else [ctx.dir / f"{sub}0", ctx.dir / f"{sub}1"]
    kw.setdefault("checksum", True)
    return Engine(RuntimeConfig(backend=backend, dirs=dirs, **kw), device=device)


def check_roundtrip(ctx: Context) -> list[Verdict]:
    """Bit-exact CUDA round trips through every tier, sizes around kvikio's 16 KiB threshold and chunks."""
    out = []
    sizes = [1, 4095, 16383, 16385, (4 << 20) + 7, ctx.size_nbytes]
    for tier in _tiers():
        with _engine(ctx, tier, f"rt-{tier}") as eng:
            ok = True
            for i, n in enumerate(sizes):
                t = _cuda_tensor(n, ctx.device, i)
                ref = t.clone()
                eng.offload(f"k{i}", t[3:] if n > 3 else t)
                eng.release(f"k{i}")
                got = eng.fetch(f"k{i}")
                ok &= got.is_cuda and torch.equal(got, ref[3:] if n > 3 else ref)
            st = eng.stats()
        out.append(
            Verdict(
                f"roundtrip[{tier}]",
                "PASS" if ok and st.checksum_failures == 0 else "FAIL",
                f"io_path={st.io_path} checksum_failures={st.checksum_failures} sizes={sizes}",
            )
        )
    return out


def _busy(x: torch.Tensor, iters: int) -> torch.Tensor:
    """A chain of matmuls on the current stream: long-running kernels that produce ``x``'s new bytes."""
    for _ in range(iters):
        x = torch.tanh(x @ x)
    return x


class CudaCompute:
    """The compute side of the ``ordering`` and ``host_blocking`` checks on a GPU: kernels on the current
    (compute) stream. Any object with these methods can stand in (``FakeCompute`` on CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.runtime_device = None  # the engine's default: runtime.device.current(), i.e. CUDA
        self._a = torch.randn(4096, 4096, device=device) / 128

    def random(self, nbytes: int, seed: int) -> torch.Tensor:
        """Device bytes that are ready (no kernel still producing them)."""
        t = _cuda_tensor(nbytes, self.device, seed)
        torch.cuda.synchronize(self.device)
        return t

    def produce(self) -> torch.Tensor:
        """A tensor whose producing kernels are still queued when this returns."""
        return _busy(torch.randn(2048, 2048, device=self.device) / 64, 50)

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A consumer kernel on the compute stream: a copy of ``t`` as the stream sees it then."""
        return t.clone()

    def busy(self) -> None:
        """Queue long-running kernels (hundreds of milliseconds on any current GPU)."""
        _busy(self._a, 200)

    def still_busy(self) -> bool:
        return not torch.cuda.current_stream(self.device).query()

    def finish(self) -> None:
        torch.cuda.synchronize(self.device)


class FakeCompute:
    """``CudaCompute`` on CPU with the runtime's fake device: "busy" is the compute stream paused with a
    kernel queued (its host-blocked detector turns any host wait behind it into an error)."""

    def __init__(self) -> None:
        from teraio.runtime.fake_device import FakeDevice

        self.runtime_device = FakeDevice()
        self.device = torch.device("cpu")
        self._gen = torch.Generator().manual_seed(0)

    def random(self, nbytes: int, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return self.runtime_device.adopt(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g))

    def produce(self) -> torch.Tensor:
        fake = self.runtime_device
        out = fake.empty(1 << 20, None)
        src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=self._gen)
        fake.launch(lambda: out.copy_(src))  # the producer kernel, queued
        return out

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        fake = self.runtime_device
        out = fake.empty(t.numel() * t.element_size(), None).view(t.dtype).view(t.shape)
        fake.launch(lambda: out.copy_(t))
        return out

    def busy(self) -> None:
        self.runtime_device.pause(self.runtime_device.default_stream)
        self.runtime_device.launch(lambda: None)

    def still_busy(self) -> bool:
        stream = self.runtime_device.default_stream
        return stream.paused() and stream.pending > 0

    def finish(self) -> None:
        self.runtime_device.resume()
        self.runtime_device.synchronize(None)

    def close(self) -> list[BaseException]:
        """Stop the fake's streams; return what its queued work and its host-blocked detector raised."""
        self.finish()
        self.runtime_device.close()
        return list(self.runtime_device.errors)


def ordering_once(eng: Engine, compute) -> bool:
    """producer -> write -> (compute busy) -> read -> consumer, as the graph ops do it; True when the
    consumer saw exactly the produced bytes. With the compute stream busy at ``fetch``, the read's copies
    wait behind it (its buffer's allocation) and the consumer is queued right after them: a missing
    read->consumer wait would show, with checksums on or off."""
    produced = compute.produce()  # queued, not finished, when offload is called
    eng.offload("p", produced)
    expected = compute.copy(produced)  # ordered after the producer on the compute stream
    eng.release("p")
    del produced
    compute.busy()
    consumed = compute.copy(eng.fetch("p"))  # the consumer kernel, enqueued at once
    compute.finish()
    eng.drop("p")
    eng.synchronize()  # the read's device checks passed (checksums on)
    return torch.equal(consumed, expected)


def check_ordering(ctx: Context) -> list[Verdict]:
    """The races the fake device simulates, on the real GPU, checksums on and off: a write issued while
    its producer is still queued, staging reuse across many chunks, a consumer enqueued right after a
    fetch issued while the compute stream is busy."""
    out = []
    for tier in _tiers():
        for checksum in (True, False):
            compute = CudaCompute(ctx.device)
            with _engine(
                ctx, tier, f"ord-{tier}", chunk_bytes=1 * MIB, io_threads=2, checksum=checksum
            ) as eng:
                ok = ordering_once(eng, compute)
            out.append(
                Verdict(
                    f"ordering[{tier},checksum={'on' if checksum else 'off'}]",
                    "PASS" if ok else "FAIL",
                    "producer->write, staging, read->consumer with the compute stream busy at fetch",
                )
            )
    return out


def host_blocking_once(eng: Engine, compute, nbytes: int, keys: int = 4) -> dict:
    """Time ``fetch`` and ``drop`` on the host while the compute stream is busy (a prefetched read whose
    copies wait behind the busy kernels, a read inside ``fetch``, the drop of a fetched read and of a
    read nobody fetched). Returns the per-call milliseconds, whether compute was still busy when the
    last call returned (else the timings prove nothing), and whether the consumers saw the right bytes."""
    tensors = [compute.random(nbytes, seed=100 + i) for i in range(keys)]
    expected = [t.clone() for t in tensors]
    for i, t in enumerate(tensors):
        eng.offload(f"hb{i}", t).wait()
        eng.release(f"hb{i}")
    del tensors
    compute.finish()
    compute.busy()
    fetch_ms: list[float] = []
    drop_ms: list[float] = []
    prefetched = [eng.prefetch(f"hb{i}") for i in range(keys - 1)]  # the last one is read by fetch
    for handle in prefetched:
        handle.wait()  # the file reads (host side) finished; the copies wait for the busy kernels
    consumed = []
    for i in range(keys - 1):
        t0 = time.perf_counter()
        got = eng.fetch(f"hb{i}")
        fetch_ms.append((time.perf_counter() - t0) * 1e3)
        consumed.append(compute.copy(got))
        del got
        t0 = time.perf_counter()
        eng.drop(f"hb{i}")
        drop_ms.append((time.perf_counter() - t0) * 1e3)
    eng.prefetch(f"hb{keys - 1}").wait()  # a read nobody fetches
    t0 = time.perf_counter()
    eng.drop(f"hb{keys - 1}")
    drop_ms.append((time.perf_counter() - t0) * 1e3)
    still_busy = compute.still_busy()
    compute.finish()
    eng.synchronize()
    bytes_ok = all(torch.equal(c.view(torch.uint8).flatten(), e) for c, e in zip(consumed, expected))
    return {"fetch_ms": fetch_ms, "drop_ms": drop_ms, "still_busy": still_busy, "bytes_ok": bytes_ok}


def host_blocking_verdict(name: str, got: dict, *, timed: bool = True) -> Verdict:
    """PASS: compute was still busy after the last call, the bytes were right and (``timed``) no call
    took longer than ``HOST_BLOCKING_MAX_MS``."""
    worst = max(got["fetch_ms"] + got["drop_ms"])
    ok = got["still_busy"] and got["bytes_ok"] and (not timed or worst <= HOST_BLOCKING_MAX_MS)
    detail = (
        f"fetch max {max(got['fetch_ms']):.2f} ms, drop max {max(got['drop_ms']):.2f} ms "
        f"(limit {HOST_BLOCKING_MAX_MS} ms), compute still busy after: {got['still_busy']}, "
        f"bytes right: {got['bytes_ok']}"
    )
    return Verdict(name, "PASS" if ok else "FAIL", detail)


def check_host_blocking(ctx: Context) -> list[Verdict]:
    """``fetch`` and ``drop`` return while the compute stream is busy, checksums on (the default)."""
    out = []
    for tier in _tiers():
        compute = CudaCompute(ctx.device)
        with _engine(ctx, tier, f"hb-{tier}", chunk_bytes=4 * MIB, io_threads=2) as eng:
            host_blocking_once(eng, compute, 8 * MIB)  # warm-up: streams, staging, files
            got = host_blocking_once(eng, compute, 64 * MIB)
        out.append(host_blocking_verdict(f"host_blocking[{tier}]", got))
    return out


def rehearse_on_fake_device(base: Path) -> list[Verdict]:
    """The ``host_blocking`` and ``ordering`` checks' code on CPU, with the fake device standing in for
    CUDA (host and posix tiers). Verdicts judge the bytes, that compute was still busy after the calls
    and that nothing waited behind it (the fake's detector, whose errors fail the check); not the
    timings."""
    out = []
    for tier in ("host", "posix"):
        for checksum in (True, False):
            suffix = f"[{tier},checksum={'on' if checksum else 'off'},fake]"
            for check in ("ordering", "host_blocking"):
                compute = FakeCompute()
                ctx = Context(dir=base, size_nbytes=MIB, device=compute.device)
                sub = f"{check}-{tier}-{'on' if checksum else 'off'}"
                verdict = None
                try:
                    with _engine(
                        ctx, tier, sub, compute.runtime_device, chunk_bytes=64 << 10, checksum=checksum
                    ) as eng:
                        if check == "ordering":
                            ok = ordering_once(eng, compute)
                            verdict = Verdict(
                                check + suffix, "PASS" if ok else "FAIL", "consumer saw the bytes"
                            )
                        else:
                            got = host_blocking_once(eng, compute, 300_000)
                            verdict = host_blocking_verdict(check + suffix, got, timed=False)
                except Exception as exc:  # noqa: BLE001 - a crashing check is a failed check
                    verdict = Verdict(check + suffix, "FAIL", f"{type(exc).__name__}: {exc}")
                finally:
                    errors = compute.close()
                if errors:
                    names = ", ".join(f"{type(e).__name__}: {e}" for e in errors[:2])
                    verdict = Verdict(verdict.check, "FAIL", f"{verdict.detail}; fake device errors: {names}")
                out.append(verdict)
    return out


def _timed(device: torch.device, fn: Callable[[], object]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / 1e3


def _wall(device: torch.device, fn: Callable[[], object]) -> float:
    """Host seconds from an idle device to ``fn``'s work finished (host-side I/O included)."""
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def check_overlap(ctx: Context) -> list[Verdict]:
    """Compute alone, I/O alone, both at once (CUDA events on the compute stream + wall clock): the I/O
    must run beside the kernels, not behind them."""
    out = []
    a = torch.randn(4096, 4096, device=ctx.device) / 128
    for tier in _tiers():
        if tier == "host":
            continue
        with _engine(ctx, tier, f"ov-{tier}") as eng:
            data = _cuda_tensor(ctx.size_nbytes, ctx.device, 7)

            def io(eng: Engine = eng, data: torch.Tensor = data) -> None:
                eng.offload("d", data)
                eng.release("d")
                eng.fetch("d")

            def compute() -> None:
                _busy(a, 40)

            def both(eng: Engine = eng, data: torch.Tensor = data) -> None:
                eng.offload("d", data)
                _busy(a, 40)
                eng.release("d")
                eng.prefetch("d")
                _busy(a, 40)
                eng.fetch("d")

            io()  # warm-up: files grown, streams and staging made
            compute_s = statistics.median(_timed(ctx.device, compute) for _ in range(3)) * 2
            io_s = statistics.median(_wall(ctx.device, io) for _ in range(3))
            both_s = statistics.median(_wall(ctx.device, both) for _ in range(3))
        serial_s = compute_s + io_s
        ok = both_s < 0.9 * serial_s
        out.append(
            Verdict(
                f"overlap[{tier}]",
                "PASS" if ok else "FAIL",
                f"compute {compute_s:.3f} s, io {io_s:.3f} s, both {both_s:.3f} s (serial would be {serial_s:.3f} s)",
            )
        )
    out.append(
        Verdict(
            "nsight_trace",
            "MANUAL",
            "nsys profile -t cuda,nvtx,osrt -o teraio_overlap python -m benchmarks.gpu_check --only overlap; "
            "open it: memcpy DtoH/HtoD rows on non-default streams overlap the matmul kernels "
            "(docs/gpu_checklist.md)",
        )
    )
    return out


def check_pinned_accounting(ctx: Context) -> list[Verdict]:
    """The host tier's capacity bookkeeping against torch's pinned allocator (active bytes)."""
    if not hasattr(torch.cuda, "host_memory_stats"):
        return [Verdict("pinned_accounting", "SKIP", "torch.cuda.host_memory_stats missing in this torch")]
    with _engine(ctx, "host", "pin", chunk_bytes=4 * MIB) as eng:
        before = torch.cuda.host_memory_stats().get("active_bytes.current", 0)
        for i, n in enumerate([5000, 3 * MIB + 1, 9 * MIB]):
            eng.offload(f"k{i}", _cuda_tensor(n, ctx.device, i)).wait()
        held = eng.tiers["host"].held_nbytes
        after = torch.cuda.host_memory_stats().get("active_bytes.current", 0)
    ok = after - before == held
    return [
        Verdict(
            "pinned_accounting", "PASS" if ok else "FAIL", f"tier holds {held}, allocator +{after - before}"
        )
    ]


def _gdscheck() -> str | None:
    for cand in (shutil.which("gdscheck"), "/usr/local/cuda/gds/tools/gdscheck"):
        if cand and Path(cand).exists():
            return cand
    return None


def check_io_path(ctx: Context) -> list[Verdict]:
    """kvikio's reported io_path against gdscheck's verdict for this machine."""
    from teraio.runtime.tiers.gds import gds_available, kvikio_status

    if not kvikio_status()[0]:
        return [Verdict("io_path_vs_gdscheck", "SKIP", "kvikio not installed (pip install teraio[gds])")]
    with _engine(ctx, "kvikio", "gds") as eng:
        st = eng.stats()
        tier = eng.tiers["ssd"]
        reasons = [tier.dir_io_reason(i) for i in range(len(st.dirs))]
    gds, why = gds_available()
    tool = _gdscheck()
    if tool is None:
        return [
            Verdict(
                "io_path_vs_gdscheck",
                "SKIP",
                f"gdscheck not found; io_path={st.io_path} because {reasons}, is_gds_available={gds}",
            )
        ]
    res = subprocess.run([tool, "-p"], capture_output=True, text=True, timeout=120)
    text = res.stdout + res.stderr
    nvme_supported = any(
        "NVMe" in line and "Supported" in line and "Unsupported" not in line for line in text.splitlines()
    )
    expected = "kvikio-gds" if nvme_supported else "kvikio-compat"
    ok = st.io_path == expected
    return [
        Verdict(
            "io_path_vs_gdscheck",
            "PASS" if ok else "FAIL",
            f"io_path={st.io_path} per dir {[d.io_path for d in st.dirs]} because {reasons}; gdscheck NVMe "
            f"supported={nvme_supported}; is_gds_available={gds} ({why}); offload dir {ctx.dir} must be on "
            "the NVMe gdscheck lists",
        )
    ]


#: A GPT whose step is compute-bound on any current GPU (8192 tokens through 2048-wide layers: matmuls
#: of hundreds of GFLOP), so a kernel's time is far longer than its launch.
COMPUTE_BOUND_GPT = dict(layers=4, hidden=2048, heads=16, seq=1024, batch=8, vocab=8192)


def _gpt_step(
    ctx: Context, backend_options: dict, config: dict | None = None
) -> tuple[object, object, Callable[[int], None]]:
    import teraio
    from teraio.tools.models.gpt import GPT, GPTConfig, build_gpt, synthetic_batch

    model = (GPT(GPTConfig(**config)) if config else build_gpt("tiny")).to(ctx.device)
    be = teraio.backend(**backend_options)
    compiled = torch.compile(model, backend=be)

    def step(i: int) -> None:
        idx, targets = (t.to(ctx.device) for t in synthetic_batch(model.cfg, i))
        compiled(idx, targets).backward()

    return model, be, step


def _kernel_s(device: torch.device, fn: Callable[[], object]) -> float:
    """Seconds the GPU spent in kernels (and copies) running ``fn``, from the CUDA profiler's own
    records: independent of how teraio's profiler timed its ops."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    total_us = 0.0
    for evt in prof.key_averages():
        total_us += getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0.0)
    return total_us / 1e6


def check_profile_durations(ctx: Context) -> list[Verdict]:
    """The profile the planner plans from, against the kernels' own time for the same forward+backward,
    on a compute-bound model (on a launch-bound one, launch and kernel times are alike and the
    comparison could not tell them apart)."""
    _, be, step = _gpt_step(
        ctx,
        {"enabled": True, "memory_budget": 0.6, "offload_dirs": [str(ctx.dir / "prof")]},
        COMPUTE_BOUND_GPT,
    )
    for i in range(8):  # profile, plan, recompile, run
        step(i)
    profiles = be.profiles
    if not profiles:
        return [Verdict("profile_durations", "FAIL", "the backend produced no profile")]
    profiled_s = sum(float(p.ops["duration_us"].sum()) for p in profiles) / 1e6
    kernel_s = statistics.median(_kernel_s(ctx.device, lambda i=i: step(100 + i)) for i in range(3))
    ratio = profiled_s / kernel_s
    ok = 0.5 <= ratio <= 2.0
    return [
        Verdict(
            "profile_durations",
            "PASS" if ok else "FAIL",
            f"sum of profiled op durations {profiled_s * 1e3:.2f} ms vs the kernels' own time "
            f"{kernel_s * 1e3:.2f} ms for fwd+bwd of a compute-bound GPT {COMPUTE_BOUND_GPT} "
            f"(ratio {ratio:.2f}; timing launches instead of kernels gives << 1)",
        )
    ]


def check_measured_peak(ctx: Context) -> list[Verdict]:
    """The backend's measured step peak against max_memory_allocated over one forward+backward.

    The loop is a training loop: an optimizer step follows each backward, before the next forward. Its
    allocations (AdamW's state and temporaries) are not the step's: a backend that read its peak at the
    next forward instead of at the backward's end would count them and fail here.
    """
    from teraio.config import Profiling

    model, be, step = _gpt_step(ctx, {"enabled": False, "profiling": Profiling(measure_memory=True)})
    optimizer = torch.optim.AdamW(model.parameters())

    def train(i: int) -> None:
        step(i)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for i in range(6):
        train(i)
    measured = be.stats().get("measured_peak_bytes")
    torch.cuda.synchronize(ctx.device)
    start = torch.cuda.memory_allocated(ctx.device)
    torch.cuda.reset_peak_memory_stats(ctx.device)
    step(50)  # forward+backward only: the reference excludes the optimizer step too
    torch.cuda.synchronize(ctx.device)
    reference = torch.cuda.max_memory_allocated(ctx.device) - start
    if not measured:
        return [
            Verdict(
                "measured_peak", "FAIL", f"backend measured no peak; max_memory_allocated says {reference}"
            )
        ]
    ok = abs(measured - reference) <= 0.1 * reference
    return [
        Verdict(
            "measured_peak",
            "PASS" if ok else "FAIL",
            f"backend {measured} B vs max_memory_allocated {reference} B",
        )
    ]


CHECKS: dict[str, Callable[[Context], list[Verdict]]] = {
    "roundtrip": check_roundtrip,
    "ordering": check_ordering,
    "host_blocking": check_host_blocking,
    "overlap": check_overlap,
    "pinned_accounting": check_pinned_accounting,
    "io_path": check_io_path,
    "profile_durations": check_profile_durations,
    "measured_peak": check_measured_peak,
}


def run(*, dir: str | None = None, size: str = "256MiB", only: list[str] | None = None) -> list[Verdict]:
    """Run the checks (all, or ``only``); without CUDA return one SKIP per check."""
    names = only or list(CHECKS)
    unknown = sorted(set(names) - set(CHECKS))
    if unknown:
        raise ValueError(f"unknown check(s) {unknown}: use {', '.join(CHECKS)}")
    if not torch.cuda.is_available():
        reason = (
            f"CUDA absent (torch {torch.__version__}, torch.cuda.is_available() is False): nothing measured"
        )
        return [Verdict(name, "SKIP", reason) for name in names]
    base = Path(dir) if dir else Path(tempfile.mkdtemp(prefix="teraio-gpu-check-"))
    ctx = Context(
        dir=base,
        size_nbytes=parse_nbytes(size, what="size"),
        device=torch.device("cuda", torch.cuda.current_device()),
    )
    verdicts: list[Verdict] = []
    for name in names:
        try:
            verdicts.extend(CHECKS[name](ctx))
        except Exception as exc:  # noqa: BLE001 - a crashing check is a failed check, the others still run
            verdicts.append(Verdict(name, "FAIL", f"{type(exc).__name__}: {exc}"))
    return verdicts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="offload directory on the NVMe to check (default: a temp dir)")
    parser.add_argument("--size", default="256MiB", help="bytes per transfer in the I/O checks")
    parser.add_argument("--only", nargs="+", choices=list(CHECKS), help="run only these checks")
    parser.add_argument("--json", action="store_true", help="print the verdicts as JSON too")
    parser.add_argument(
        "--rehearse",
        action="store_true",
        help="also run the host_blocking and ordering checks' code on CPU with the fake device (no timings)",
    )
    args = parser.parse_args(argv)
    machine = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    print(json.dumps(machine))
    verdicts = run(dir=args.dir, size=args.size, only=args.only)
    if args.rehearse:
        with tempfile.TemporaryDirectory(prefix="teraio-gpu-rehearsal-") as tmp:
            verdicts += rehearse_on_fake_device(Path(tmp))
    width = max(len(v.check) for v in verdicts)
    for v in verdicts:
        print(f"{v.verdict:<6} {v.check:<{width}}  {v.detail}")
    if args.json:
        print(json.dumps([asdict(v) for v in verdicts]))
    return 1 if any(v.verdict == "FAIL" for v in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
