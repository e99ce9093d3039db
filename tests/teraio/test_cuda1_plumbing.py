"""The device travels through capture, profile, plan, rewrite and measurement: graphs of fake ``cuda:1`` tensors.

``FakeTensorMode`` makes ``cuda:1`` tensors on a CPU-only build of torch, and runs aten ops on them, but
no autograd graph of them (autograd asks for the CUDA device guard, which a CPU build lacks, and the
process aborts). So the tiny GPT's training step is captured on CPU and then re-typed to ``cuda:1``:
the device arguments of its nodes (``arange(..., device=cpu)``) and every ``meta["val"]`` (propagated
from fake ``cuda:1`` inputs that keep the original storage sharing). The graphs are the ones a CUDA
capture of this model gives up to per-device decompositions, which are not what is tested here; the
device's way from the partitioned graphs to the profile, the plan and the fetch ops is. The graphs run
under the fake mode, with the fake device standing in for the CUDA streams the profiler times on.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.multiprocessing.reductions import StorageWeakRef

import teraio
from teraio.graph.capture import CapturedStep, StepAnalysis, analyse_saved
from teraio.graph.rewrite import apply_plan
from teraio.lifecycle import runner as lifecycle
from teraio.lifecycle.backend import TeraioBackend
from teraio.planner.solve import solve
from teraio.runtime import device as runtime_device
from teraio.runtime.fake_device import FakeDevice

from .captured import captured_tiny_gpt_step

CUDA1 = torch.device("cuda", 1)


def _retarget(a: Any) -> Any:
    if isinstance(a, torch.device) and a.type == "cpu":
        return CUDA1
    if isinstance(a, (list, tuple)):
        return type(a)(_retarget(x) for x in a)
    if isinstance(a, dict):
        return {k: _retarget(v) for k, v in a.items()}
    return a


def _fake_inputs(gm: torch.fx.GraphModule, mode: FakeTensorMode) -> list[Any]:
    """Fake ``cuda:1`` values for ``gm``'s placeholders, sharing storages where the originals did."""
    bases: dict[StorageWeakRef, torch.Tensor] = {}
    out = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        v = n.meta["val"]
        if not isinstance(v, torch.Tensor):
            out.append(v)
            continue
        ref = StorageWeakRef(v.untyped_storage())
        with mode:
            if ref not in bases:
                numel = v.untyped_storage().nbytes() // v.element_size()
                bases[ref] = torch.empty(numel, dtype=v.dtype, device=CUDA1)
            out.append(bases[ref].as_strided(v.shape, v.stride(), v.storage_offset()))
    return out


def _to_cuda1(step: CapturedStep) -> FakeTensorMode:
    """Re-type ``step``'s graphs to ``cuda:1`` in place; return the fake mode their values live in."""
    mode = FakeTensorMode()
    for gm in (step.fw_gm, step.bw_gm):
        for n in gm.graph.nodes:
            n.args, n.kwargs = _retarget(n.args), _retarget(n.kwargs)
        gm.recompile()
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*_fake_inputs(gm, mode))
    return mode


def _summary(a: StepAnalysis) -> list[tuple]:
    return [
        (
            g.name,
            g.members,
            g.nbytes,
            g.dtype,
            g.shape,
            g.producer_idx,
            g.last_fwd_use_idx,
            g.first_bwd_use_idx,
            g.last_use_idx,
            g.owner_covers_storage,
        )
        for g in a.groups
    ]


def test_capture_analysis_is_the_same_on_cuda1() -> None:
    """What a step saves, and where, does not depend on the device; the graph fingerprint does (a plan
    made for the CPU graphs is refused on the ``cuda:1`` ones)."""
    step = captured_tiny_gpt_step()
    on_cpu = analyse_saved(step)
    _to_cuda1(step)
    vals = [
        n.meta["val"]
        for gm in (step.fw_gm, step.bw_gm)
        for n in gm.graph.nodes
        if isinstance(n.meta.get("val"), torch.Tensor)
    ]
    assert vals and {v.device for v in vals} == {CUDA1}
    on_cuda1 = analyse_saved(step)
    assert _summary(on_cuda1) == _summary(on_cpu) and on_cpu.groups
    assert on_cuda1.fingerprint != on_cpu.fingerprint


def test_cuda1_reaches_the_profile_the_measurement_and_the_fetch_ops(monkeypatch) -> None:
    """The backend's partition hook on ``cuda:1`` graphs, called with a CPU index first among the inputs:
    the profiler, the profile and the measurement are on ``cuda:1``; a plan made from that profile
    applies to the graphs, and every fetch (its device argument, its value, the views rebuilt on it) is
    on ``cuda:1``."""
    step = captured_tiny_gpt_step()
    mode = _to_cuda1(step)

    def compile_graph(gm, example_inputs, inner, on_partition, **kwargs):
        on_partition(step)  # what AOTAutograd's partitioner hands the hook
        return lambda *args: None

    monkeypatch.setattr(lifecycle, "compile_graph", compile_graph)
    fw_inputs = _fake_inputs(step.fw_gm, mode)
    index = torch.zeros(2, dtype=torch.long)  # a CPU tensor first, as a step counter or an index may be
    be = TeraioBackend(inner="eager", profiling=teraio.Profiling(steps=2))
    runner = be(step.fw_gm, [index, *fw_inputs])
    prof = runner.profiler
    assert prof is not None and prof.device == "cuda:1"
    assert be._compute_device() == "cuda:1"  # what the peak recorder and the step clock measure

    fake = FakeDevice()  # the profiler's timing events on cuda:1 go to the stand-in streams
    try:
        with runtime_device.installed(fake), torch.no_grad(), mode:
            for invocation in range(2):
                out = prof.run_fwd(_fake_inputs(step.fw_gm, mode))
                prof.bind_last_forward(invocation)
                grads = [torch.ones_like(o) for o in out[: step.num_fwd_outputs]]
                prof.run_bwd([*out[step.num_fwd_outputs :], *grads], invocation=invocation)
    finally:
        fake.close()
    assert not fake.errors, fake.errors
    profile = prof.build_profile()
    assert profile.meta["device"] == "cuda:1"

    plan = solve(profile, budget="50%", solver="greedy")
    assert plan.decisions
    apply_plan(step, plan, engine_id=0, key_prefix="g0")
    fetches = [n for n in step.bw_gm.graph.nodes if n.target is torch.ops.teraio.fetch.default]
    assert fetches
    for fetch in fetches:
        assert fetch.args[6] == CUDA1 and fetch.meta["val"].device == CUDA1
        views = [u for u in fetch.users if u.target is torch.ops.aten.as_strided.default]
        assert views and all(v.meta["val"].device == CUDA1 for v in views)
