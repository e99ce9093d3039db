"""Note: [Buffers die on the caller's thread]: no buffer's last reference is dropped by an I/O thread.

The torch profiler records allocator events per thread, so a free on an I/O thread goes unseen and a
measured peak keeps the buffer forever. The race needs a worker that is still running after it reported
its chunk done; a patched ``chunk_finished`` that lingers makes that window wide enough to hit every time.
"""

from __future__ import annotations

import threading
import time
import weakref

import pytest
import torch

import teraio.runtime.transfers as engine_module
from teraio.profiling.measure import MemoryRecorder


@pytest.fixture
def lingering_workers(monkeypatch):
    original = engine_module._Request.chunk_finished

    def finished_then_linger(self, exc):
        original(self, exc)
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.05)  # the worker is preempted right after completing its request

    monkeypatch.setattr(engine_module._Request, "chunk_finished", finished_then_linger)


def _freed_on(storage: torch.UntypedStorage, where: list[str]) -> weakref.ref:
    return weakref.ref(storage, lambda _ref: where.append(threading.current_thread().name))


def test_written_and_fetched_buffers_are_freed_by_the_caller(make_engine, lingering_workers) -> None:
    eng = make_engine(io_threads=2)
    frees: list[str] = []
    refs = []
    for i in range(3):
        src = torch.randn(70_001)
        expected = src.clone()
        refs.append(_freed_on(src.untyped_storage(), frees))
        eng.offload(f"k{i}", src)
        eng.release(f"k{i}")  # the write is done: the caller's reference is now the last one
        del src
        eng.prefetch(f"k{i}")
        got = eng.fetch(f"k{i}")
        assert torch.equal(got, expected)
        refs.append(_freed_on(got.untyped_storage(), frees))
        del got
    time.sleep(0.2)  # let lingering workers finish: a late free would show up now
    assert len(frees) == 6, "a buffer is still alive after every user let go"
    assert set(frees) == {threading.main_thread().name}, f"buffers freed on {sorted(set(frees))}"


def test_measured_memory_returns_to_zero_after_a_round_trip(make_engine, lingering_workers) -> None:
    eng = make_engine(io_threads=2)
    rec = MemoryRecorder("cpu")
    rec.start()
    src = torch.randn(65_536)
    eng.offload("k", src)
    eng.release("k")
    del src
    got = eng.fetch("k")
    del got
    time.sleep(0.2)
    rec.mark_end()
    measured = rec.stop()
    assert measured.peak_bytes >= 65_536 * 4
    assert measured.end_bytes == 0, "the profiler missed a free: a buffer died on an I/O thread"
