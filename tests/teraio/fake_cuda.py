"""The backend's CUDA paths on CPU: the fake asynchronous device standing in for CUDA, with a virtual clock.

On a GPU an op returns when its kernels are queued, and they run later on the stream. Here a custom op
(``teraio_test::late_kernel``) does the same with the fake device: it computes its result on the host
and queues a "kernel" on the fake's current stream that advances a virtual clock by a set number of
seconds when the stream runs it, holding a scratch block of fake device memory while the op runs. Timing
events read that clock, so durations measured on the device are exact numbers (the kernel's seconds),
while a host clock around the op sees only its launch. ``fake_cuda`` makes the backend take its CUDA
paths for these CPU tensors: the device it derives from the graph's inputs is ``cuda:0``, and the
installed fake device answers for it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from teraio.lifecycle import runner as lifecycle
from teraio.runtime import device as runtime_device
from teraio.runtime.fake_device import FakeDevice

FWD_S = 3.0  # the late kernel's virtual seconds in forward; its backward's kernel takes twice as long
SCRATCH_NBYTES = 4096  # fake device memory each late kernel op holds while it runs


class VirtualClock:
    """Seconds that pass only when a fake kernel says so (read by the fake's timing events)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@torch.library.custom_op("teraio_test::late_kernel", mutates_args=())
def late_kernel(x: torch.Tensor, seconds: float) -> torch.Tensor:
    """``x`` copied on the host, plus a queued fake kernel taking ``seconds`` of the virtual clock."""
    dev = runtime_device.current()
    assert isinstance(dev, FakeDevice), "late_kernel runs under the fake device only"
    scratch = dev.empty(SCRATCH_NBYTES, x.device)  # allocated at launch, like a CUDA workspace
    dev.launch(lambda: dev.clock.advance(seconds))
    del scratch
    return x.clone()


@late_kernel.register_fake
def _late_kernel_fake(x: torch.Tensor, seconds: float) -> torch.Tensor:
    return torch.empty_like(x)


def _late_kernel_setup(ctx, inputs, output) -> None:
    ctx.seconds = inputs[1]


def _late_kernel_backward(ctx, grad: torch.Tensor):
    return late_kernel(grad, 2 * ctx.seconds), None


late_kernel.register_autograd(_late_kernel_backward, setup_context=_late_kernel_setup)


class LateModel(nn.Module):
    """A linear layer and one late kernel: forward takes FWD_S on the device, backward 2 * FWD_S."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(late_kernel(self.lin(x), FWD_S)).sum()


def batch() -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


@pytest.fixture
def fake_cuda(monkeypatch) -> Iterator[FakeDevice]:
    """The fake device with a virtual clock, installed; the backend's graphs compute on "cuda:0"."""
    monkeypatch.setattr(lifecycle, "_device_of", lambda example_inputs: "cuda:0")
    fake = FakeDevice(clock=VirtualClock())
    torch._dynamo.reset()
    try:
        with runtime_device.installed(fake):
            yield fake
    finally:
        fake.close()
    assert not fake.errors, fake.errors
