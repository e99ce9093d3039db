"""Fetched tensors are ordinary torch allocations the torch profiler sees, and both O_DIRECT read
paths (straight into an aligned torch allocation, or through a bounce buffer) return exact bytes.

The profiler check is written without teraio: it reads the allocation events (address and size) of
``prof.profiler.kineto_results.experimental_event_tree()``, the events teraio measures a step's peak on
CPU with (docs/measured_facts.md), and looks for the fetched buffer's own allocation at its address (Note:
[What else the profiled window sees]). The direct path needs torch to page-align its allocations, which it
does only when ``THP_MEM_ALLOC_ENABLE=1`` is set before its first allocation: that runs in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch._C._profiler import _EventType
from torch.profiler import profile

from teraio.runtime import Engine
from teraio.runtime.buffers import aligned_buffer

from .conftest import make_config

REPO = Path(__file__).resolve().parents[2]


# Note: [What else the profiled window sees]
#     A profiled window records every allocation and free of this thread, not only the fetch's: the
#     garbage collector, or anything else that runs in the process (an earlier test's tensors under
#     xdist), may free inside the window a block torch had seen allocated in an earlier window, and a
#     sum over the window then comes out short (it did, by 4,096 bytes: ``([3995900], 3999996)``). So
#     the checks look at the fetched buffer's own address: the last event there must be its allocation,
#     of exactly its bytes, whatever else the window holds. A buffer torch's allocator did not hand out
#     (an mmap wrapped by torch.frombuffer) has no event at its address, and fails them.
def _events_at(prof, ptr: int) -> list[int]:
    """The sizes of the allocations (> 0) and frees (< 0) the window recorded at address ``ptr``, in time
    order (Note: [What else the profiled window sees])."""
    found, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        kind, fields = event.typed
        if kind == _EventType.Allocation and fields.ptr == ptr:
            found.append((event.start_time_ns, fields.alloc_size))
    return [nbytes for _, nbytes in sorted(found)]


def test_profiler_method_does_not_see_mmap_buffers():
    """Control: the measurement distinguishes torch memory from foreign memory (why this change)."""
    nbytes = 3 << 20
    with profile(profile_memory=True) as prof:
        foreign = aligned_buffer(nbytes)
    seen = _events_at(prof, foreign.data_ptr())
    assert not seen or seen[-1] < 0, seen  # no live allocation at the mmap's address
    with profile(profile_memory=True) as prof:
        own = torch.empty(nbytes, dtype=torch.uint8)
    assert _events_at(prof, own.data_ptr())[-1:] == [nbytes]
    del foreign, own


@pytest.mark.parametrize("prefetch", [False, True], ids=["fetch", "prefetch+fetch"])
def test_fetched_bytes_are_seen_by_torch_profiler(make_engine, prefetch):
    eng = make_engine(chunk_bytes=256 << 10)
    t = torch.randn(3, 333_333)  # 4 MB, not a multiple of the page or chunk size
    eng.offload("t", t).wait()
    eng.release("t")
    with profile(profile_memory=True) as prof:
        if prefetch:
            eng.prefetch("t").wait()
        out = eng.fetch("t")
    assert out.data_ptr() != t.data_ptr()  # really read back
    assert torch.equal(out, t)
    # The buffer is exactly the tensor's bytes (teraio's fetch op clones anything larger).
    assert out.untyped_storage().nbytes() == out.nbytes and out.storage_offset() == 0
    # Allocated by torch inside the window, and still alive at its end.
    seen = _events_at(prof, out.data_ptr())
    assert seen[-1:] == [out.nbytes], (seen, out.nbytes)
    del out
    with profile(profile_memory=True) as prof:
        out = eng.fetch("t")  # the key still reads back after the first buffer died
        ptr = out.data_ptr()
        del out
    assert _events_at(prof, ptr)[-2:] == [t.nbytes, -t.nbytes]  # freed normally: the free is seen too


def test_bounce_path_roundtrip_bit_exact(tmp_path):
    cfg = make_config("posix", tmp_path, bounce_reads=True, chunk_bytes=64 << 10)
    with Engine(cfg) as eng:
        tensors = {
            "odd": torch.randn(300_007),
            "big": torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)[17:],  # unaligned source
            "page": torch.randn(1024),  # exactly one page
            "view": torch.randn(257, 129).t(),
        }
        for key, t in tensors.items():
            eng.offload(key, t).wait()
            eng.release(key)
        for key, t in tensors.items():
            out = eng.fetch(key)
            assert out.dtype == t.dtype and out.shape == t.shape and out.stride() == t.stride()
            assert torch.equal(out, t), key
        stats = eng.stats()
    total = sum(d.bytes_read for d in stats.dirs)
    assert stats.bounced_read_nbytes == total > 0
    assert stats.direct_read_nbytes == 0 and stats.read_path == "bounce"


def test_read_path_follows_the_allocation_alignment(tmp_path, caplog):
    """Whatever THP setting this process runs with, the counted path matches the buffer's address."""
    caplog.set_level("INFO", logger="teraio.runtime.tiers.posix")
    with Engine(make_config("posix", tmp_path, chunk_bytes=64 << 10)) as eng:
        t = torch.randn(1 << 20)  # 4 MiB, whole pages
        eng.offload("t", t).wait()
        eng.release("t")
        out = eng.fetch("t")
        assert torch.equal(out, t)
        aligned = out.untyped_storage().data_ptr() % 4096 == 0
        stats = eng.stats()
    assert stats.read_path == ("direct" if aligned else "bounce")
    assert (stats.direct_read_nbytes, stats.bounced_read_nbytes) == (
        (t.nbytes, 0) if aligned else (0, t.nbytes)
    )
    messages = [r.getMessage() for r in caplog.records if "ssd reads take the" in r.getMessage()]
    assert len(messages) == 1 and "THP_MEM_ALLOC_ENABLE" in messages[0]


_CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    from torch.profiler import profile
    from torch._C._profiler import _EventType
    from teraio.runtime import Engine, RuntimeConfig

    def events_at(prof, ptr):  # the test module's _events_at: Note: [What else the profiled window sees]
        found, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            event = stack.pop()
            stack.extend(event.children)
            kind, fields = event.typed
            if kind == _EventType.Allocation and fields.ptr == ptr:
                found.append((event.start_time_ns, fields.alloc_size))
        return [nbytes for _, nbytes in sorted(found)]

    base = sys.argv[1]
    cfg = RuntimeConfig(backend="posix", dirs=[base + "/ssd0", base + "/ssd1"], direct_io=True,
                        chunk_bytes=256 << 10, checksum=True)
    sizes = [1 << 20, (3 << 20) + 12_345, 5 << 20, 3000]  # >= 2 MiB, a partial last page, < 2 MiB
    report = {"ok": [], "aligned": [], "seen": [], "nbytes": []}
    with Engine(cfg) as eng:
        tensors = [torch.randint(0, 256, (n + 5,), dtype=torch.uint8)[5:] for n in sizes]
        tensors.append(torch.randn(1024, 769).t())  # a strided view, 3 MB
        for i, t in enumerate(tensors):
            eng.offload(f"k{i}", t).wait()
            eng.release(f"k{i}")
        for i, t in enumerate(tensors):
            with profile(profile_memory=True) as prof:
                out = eng.fetch(f"k{i}")
            storage = out.untyped_storage()
            report["seen"].append(events_at(prof, storage.data_ptr())[-1:] == [storage.nbytes()])
            report["ok"].append(torch.equal(out, t) and out.stride() == t.stride())
            report["aligned"].append(storage.data_ptr() % 4096 == 0)
            report["nbytes"].append(storage.nbytes())
            del out, storage
        s = eng.stats()
    report.update(direct=s.direct_read_nbytes, bounced=s.bounced_read_nbytes, path=s.read_path,
                  read=sum(d.bytes_read for d in s.dirs))
    print(json.dumps(report))
    """
)


def _run_child(tmp_path: Path, thp: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if thp is not None:
        env["THP_MEM_ALLOC_ENABLE"] = thp
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    res = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path)], env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_direct_path_with_thp_alloc_roundtrip_bit_exact(tmp_path):
    rep = _run_child(tmp_path, "1")
    assert all(rep["ok"]) and all(rep["seen"])
    # torch page-aligns allocations >= 2 MiB under THP_MEM_ALLOC_ENABLE=1 (smaller ones only by chance).
    assert [a for a, n in zip(rep["aligned"], rep["nbytes"]) if n >= 2 << 20] == [True, True, True]
    assert rep["path"] == "direct"
    # Bounced: unaligned buffers whole, and the partial last page of aligned ones (3 MiB + 12,345).
    expected_bounced = sum(n if not a else n % 4096 for a, n in zip(rep["aligned"], rep["nbytes"]))
    assert rep["bounced"] == expected_bounced and rep["bounced"] >= ((3 << 20) + 12_345) % 4096
    assert rep["direct"] + rep["bounced"] == rep["read"] == sum(rep["nbytes"])


def test_without_thp_alloc_every_read_bounces(tmp_path):
    rep = _run_child(tmp_path, None)
    assert all(rep["ok"]) and all(rep["seen"])
    # Without THP torch aligns to 64 bytes: a buffer lands on a page boundary only by chance (glibc's
    # heap, about one in 64), and then it is read directly, as it should be; every other one bounces.
    expected_bounced = sum(n if not a else n % 4096 for a, n in zip(rep["aligned"], rep["nbytes"]))
    assert rep["bounced"] == expected_bounced and rep["direct"] + rep["bounced"] == rep["read"]
    if not any(rep["aligned"]):
        assert rep["path"] == "bounce" and rep["direct"] == 0
