"""``CudaDevice`` maps each call of the Device protocol to the torch.cuda call with CUDA's semantics.

The fake device proves the runtime's ordering rules on CPU against the protocol; these tests close the
gap to the real device without a GPU: torch.cuda's streams, events and copies are replaced by recording
doubles, and each protocol call must reach the right one, on the right stream, without a host wait where
the protocol promises none. (A ``CudaDevice`` whose ``wait`` did nothing, or whose copies were not
``non_blocking``, passed the whole suite before: nothing on CPU called it.)
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch

from teraio.runtime import device as device_module
from teraio.runtime.device import CudaDevice, PendingChecksum, byte_checksum, fold_checksum

CALLS: list[tuple] = []


class _Stream:
    def __init__(self, device=None) -> None:
        self.device = device
        self.cuda_stream = 0x5E0 + len(CALLS)

    def wait_event(self, event) -> None:
        CALLS.append(("wait_event", self, event))

    def synchronize(self) -> None:
        CALLS.append(("stream.synchronize", self))


class _Event:
    def __init__(self, enable_timing: bool = False) -> None:
        self.enable_timing = enable_timing
        self.done = False

    def record(self, stream=None) -> None:
        CALLS.append(("record", self, stream, _current[-1] if _current else None))

    def synchronize(self) -> None:
        CALLS.append(("event.synchronize", self))

    def query(self) -> bool:
        CALLS.append(("query", self))
        return self.done

    def elapsed_time(self, end) -> float:
        return 12.5


_current: list = []


@contextlib.contextmanager
def _stream_context(stream):
    _current.append(stream)
    try:
        yield stream
    finally:
        _current.pop()


@pytest.fixture
def cuda(monkeypatch):
    CALLS.clear()
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "stream", _stream_context)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: CALLS.append(("device.synchronize",)))
    return CudaDevice()


def _host_waits() -> list:
    return [c for c in CALLS if c[0].endswith("synchronize")]


def test_streams_events_and_waits_map_to_torch_cuda(cuda):
    stream = cuda.new_stream(torch.device("cuda", 0))
    assert isinstance(stream, _Stream) and stream.device == torch.device("cuda", 0)
    event = cuda.new_event(timing=True)
    assert event.enable_timing
    cuda.record(event, stream)
    cuda.wait(stream, event)
    assert CALLS == [("record", event, stream, None), ("wait_event", stream, event)]
    assert _host_waits() == []  # record and wait never block the host
    assert cuda.event_done(event) is False and CALLS[-1] == ("query", event)
    cuda.synchronize_event(event)
    cuda.synchronize_stream(stream)
    cuda.synchronize(torch.device("cuda", 0))
    assert _host_waits() == [
        ("event.synchronize", event),
        ("stream.synchronize", stream),
        ("device.synchronize",),
    ]
    assert cuda.raw_stream(stream) == stream.cuda_stream
    assert cuda.elapsed_ms(event, _Event()) == 12.5
    with cuda.stream_context(stream):
        assert _current == [stream]


def test_copies_are_non_blocking_on_the_given_stream(cuda):
    stream = _Stream()
    seen = []
    dst, src = mock.Mock(), mock.Mock()
    dst.copy_.side_effect = lambda s, **kw: seen.append((s, kw, list(_current)))
    cuda.copy_async(dst, src, stream)
    assert seen == [(src, {"non_blocking": True}, [stream])]
    t = mock.Mock()
    cuda.record_stream(t, stream)
    t.record_stream.assert_called_once_with(stream)


def test_checksum_is_queued_on_the_stream_into_pinned_memory_without_a_host_wait(cuda, monkeypatch):
    stream = _Stream()
    pinned = []

    def empty_pinned(nbytes: int) -> torch.Tensor:
        buf = torch.zeros(nbytes, dtype=torch.uint8)
        pinned.append(nbytes)
        return buf

    monkeypatch.setattr(cuda, "empty_pinned", empty_pinned)
    on_stream = []
    real = device_module.byte_checksum
    monkeypatch.setattr(device_module, "byte_checksum", lambda t: on_stream.append(list(_current)) or real(t))
    copies = []
    real_copy = torch.Tensor.copy_

    def copy_(self, src, non_blocking=False):
        copies.append((non_blocking, list(_current)))
        return real_copy(self, src)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    t = torch.randint(0, 256, (10_001,), dtype=torch.uint8)
    pending = cuda.checksum_async(t, stream)
    monkeypatch.undo()
    assert isinstance(pending, PendingChecksum)
    assert on_stream == [[stream]] and pinned == [16]  # the sums on the stream, their result pinned
    assert copies == [(True, [stream])]  # a non-blocking copy on the stream, not a .cpu()
    assert CALLS[-1] == ("record", pending.event, stream, stream)  # the event behind the copy
    assert _host_waits() == []
    assert pending.value() == fold_checksum(byte_checksum(t))


def test_memory_and_availability_calls(cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: 7)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 9)
    reset = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: reset.append(d))
    assert cuda.available() and cuda.memory_allocated(None) == 7 and cuda.max_memory_allocated(None) == 9
    cuda.reset_peak_memory_stats("d")
    assert reset == ["d"]
    assert not cuda.owns(torch.zeros(1)) and cuda.owns(mock.Mock(device=torch.device("cuda", 0)))
    assert cuda.pinned_nbytes(5000) == 8192
    arr = cuda.cuda_array(torch.zeros(3, dtype=torch.float32))
    assert arr.__cuda_array_interface__["shape"] == (12,) and arr.__cuda_array_interface__["typestr"] == "|u1"
