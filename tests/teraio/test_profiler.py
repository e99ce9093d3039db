"""The profiler on real graphs: it must not change results, and its byte counts must be right."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition

from teraio.capture import capturing_partition, unique_storages
from teraio.compilers import fx_only_compiler
from teraio.lifecycle import TeraioBackend
from teraio.measure import measure_memory
from teraio.profile_run import profile_workload, summarize
from teraio.workload import compute_loss

from .models import WORKLOADS

STEPS = 3


def _train(model: torch.nn.Module, backend, workload, steps: int = STEPS):
    """Loss and every gradient of each step, compiled with ``backend`` (None = eager)."""
    torch._dynamo.reset()
    fn = torch.compile(model, backend=backend) if backend is not None else model
    results = []
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        loss = compute_loss(fn, workload, step)
        loss.backward()
        results.append(
            (
                loss.detach().clone(),
                {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            )
        )
    return results


def _fx_only_backend():
    return aot_autograd(
        fw_compiler=fx_only_compiler,
        bw_compiler=fx_only_compiler,
        partition_fn=min_cut_rematerialization_partition,
    )


def _assert_bit_identical(a, b) -> None:
    assert len(a) == len(b)
    for (loss_a, grads_a), (loss_b, grads_b) in zip(a, b):
        assert torch.equal(loss_a, loss_b), (loss_a, loss_b)
        assert grads_a.keys() == grads_b.keys()
        assert grads_a, "no gradients were produced"
        for name in grads_a:
            assert torch.equal(grads_a[name], grads_b[name]), name


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_profiling_is_bit_identical_to_fx_only_compile(name: str) -> None:
    workload = WORKLOADS[name]()
    base = copy.deepcopy(workload.model)
    reference = _train(copy.deepcopy(base), _fx_only_backend(), workload)
    be = TeraioBackend(inner="eager", profile_steps=STEPS, enabled=False)
    profiled = _train(copy.deepcopy(base), be, workload)
    assert len(be.profiles) == 1, "expected one captured graph"
    _assert_bit_identical(reference, profiled)
    # And FX-only is itself bit-identical to eager here (docs/measured_facts.md).
    _assert_bit_identical(_train(copy.deepcopy(base), None, workload), reference)


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_activation_bytes_match_an_independent_count(name: str) -> None:
    """Profile's activation bytes == unique storages among the saved outputs, params and inputs excluded."""
    workload = WORKLOADS[name]()
    model = copy.deepcopy(workload.model)
    seen: dict[str, int] = {}

    def on_partition(step):
        seen["n"] = step.num_fwd_outputs

    def fw(gm, example_inputs):
        def run(*args):
            out = gm(*args)
            saved = out[seen["n"] :]
            inputs = unique_storages(args)
            saved_storages = unique_storages(saved)
            seen["bytes"] = sum(b for ref, b in saved_storages.items() if ref not in inputs)
            return out

        return run

    torch._dynamo.reset()
    be = aot_autograd(
        fw_compiler=fw, bw_compiler=fx_only_compiler, partition_fn=capturing_partition(on_partition)
    )
    compiled = torch.compile(model, backend=be)
    compute_loss(compiled, workload).backward()

    (profile,) = profile_workload(_fresh(workload), profile_steps=2, inner="eager")
    assert profile.activation_bytes() == seen["bytes"]
    assert profile.activation_bytes() > 0


def _fresh(workload):
    w = copy.copy(workload)
    w.model = copy.deepcopy(workload.model)
    return w


def test_live_bytes_after_forward_match_torch_profiler() -> None:
    """Bytes left alive by the forward (torch profiler memory events) == profile activation bytes, within 5%."""
    workload = WORKLOADS["gpt-tiny"]()
    (profile,) = profile_workload(_fresh(workload), profile_steps=2, inner="eager")
    model = copy.deepcopy(workload.model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=_fx_only_backend())
    compute_loss(compiled, workload).backward()  # compile outside the measured region
    model.zero_grad(set_to_none=True)
    loss, mem = measure_memory(lambda: compute_loss(compiled, workload))
    # What the forward leaves alive: the saved activations (and the scalar loss).
    assert mem.end_bytes == pytest.approx(profile.activation_bytes(), rel=0.05)
    loss.backward()


def test_summary_ranks_offload_candidates() -> None:
    (profile,) = profile_workload(WORKLOADS["gpt-tiny"](), profile_steps=2, inner="eager")
    s = summarize(profile, top=5)
    assert s["ops"] == len(profile.ops) and s["fwd_ops"] + s["bwd_ops"] == s["ops"]
    assert len(s["top_tensors"]) == 5
    scores = [t["byte_s"] for t in s["top_tensors"]]
    assert scores == sorted(scores, reverse=True) and scores[0] > 0
    # Parameters are recorded but never offloadable.
    t = profile.tensors
    assert (t.loc[t["kind"] == "param", "offloadable"] == False).all()  # noqa: E712
    assert (t["kind"] == "param").any() and (t["kind"] == "input").any()
