"""A small training loop for tests: losses and gradients of every step, for bit-exact comparisons."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from teraio.tools.workloads import Workload, compute_loss


@dataclass
class Trace:
    losses: list[torch.Tensor] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)


def train(workload: Workload, backend, steps: int, model: torch.nn.Module | None = None) -> Trace:
    """``steps`` AdamW steps of a fresh copy of the workload's model compiled with ``backend``."""
    torch._dynamo.reset()
    model = model if model is not None else copy.deepcopy(workload.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = torch.compile(model, backend=backend)
    trace = Trace()
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = compute_loss(compiled, workload, step)
        loss.backward()
        trace.losses.append(loss.detach().clone())
        trace.grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
    trace.params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return trace


def assert_bit_identical(a: Trace, b: Trace) -> None:
    assert len(a.losses) == len(b.losses)
    for step, (la, lb) in enumerate(zip(a.losses, b.losses)):
        assert torch.equal(la, lb), f"loss differs at step {step}: {la} vs {lb}"
    for step, (ga, gb) in enumerate(zip(a.grads, b.grads)):
        assert ga and ga.keys() == gb.keys()
        for name in ga:
            assert torch.equal(ga[name], gb[name]), f"gradient of {name} differs at step {step}"
    for name in a.params:
        assert torch.equal(a.params[name], b.params[name]), f"parameter {name} differs after training"


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Parameters and optimizer state, cloned: to check a failed step changed nothing."""
    snap = {f"param:{n}": p.detach().clone() for n, p in model.named_parameters()}
    for i, st in enumerate(opt.state.values()):
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                snap[f"opt:{i}:{k}"] = v.clone()
    return snap


def assert_same_snapshot(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} changed"
