"""The partitioned graphs of one training step, captured on CPU through the FX-only compiler."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.backends.common import aot_autograd

from teraio.graph.capture import CapturedStep, capturing_partition
from teraio.graph.compilers import fx_only_compiler


def captured_steps(forward: Callable[[Any], torch.Tensor]) -> list[CapturedStep]:
    """Every graph's captured step when ``forward(backend)`` (which compiles the model with ``backend``
    and returns its loss) runs and is backpropagated once."""
    seen: list[CapturedStep] = []
    torch._dynamo.reset()
    backend = aot_autograd(
        fw_compiler=fx_only_compiler,
        bw_compiler=fx_only_compiler,
        partition_fn=capturing_partition(seen.append),
    )
    forward(backend).backward()
    return seen


def captured_tiny_gpt_step() -> CapturedStep:
    """The tiny GPT's one graph."""
    from teraio.tools.workloads import compute_loss

    from .models import WORKLOADS

    workload = WORKLOADS["gpt-tiny"]()
    (step,) = captured_steps(
        lambda backend: compute_loss(torch.compile(workload.model, backend=backend), workload)
    )
    return step
