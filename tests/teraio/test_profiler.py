"""The profiler on real graphs: it must not change results, and its byte counts must be right."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition

import teraio
from teraio.graph.capture import capturing_partition, unique_storages
from teraio.graph.compilers import fx_only_compiler
from teraio.lifecycle.backend import TeraioBackend
from teraio.profiling.measure import measure_memory
from teraio.profiling.op_timing import _run_uninstrumented
from teraio.runtime import device as runtime_device
from teraio.runtime.fake_device import FakeDevice
from teraio.tools.profile_workload import profile_workload, summarize
from teraio.tools.workloads import compute_loss

from .fake_cuda import FWD_S, LateModel, batch
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
    be = TeraioBackend(inner="eager", profiling=teraio.Profiling(steps=STEPS), enabled=False)
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


# ------------------------------------------------------------------------------- CUDA timing, faked
def test_cuda_profile_times_kernels_on_the_stream_not_their_launch(fake_cuda) -> None:
    """On CUDA an op returns when its kernels are queued: the profile must hold what the stream spent
    on them (timing events), not the launch a host clock sees. The fake's kernels move only the virtual
    clock, so each op's duration is exactly the seconds its kernels took, and every other op's is 0."""
    be = TeraioBackend(inner="eager", profiling=teraio.Profiling(steps=2), enabled=False)
    compiled = torch.compile(LateModel(), backend=be)
    for _ in range(3):  # the census step, the measured step, and the forward that finishes profiling
        compiled(batch()).backward()
    (profile,) = be.profiles
    ops = profile.ops
    late = ops["target"] == str(torch.ops.teraio_test.late_kernel.default)
    assert ops.loc[late, "duration_us"].tolist() == [FWD_S * 1e6, 2 * FWD_S * 1e6]
    assert (ops.loc[~late, "duration_us"] == 0.0).all()
    meta = profile.meta
    assert (meta["device"], meta["fwd_s"], meta["bwd_s"], meta["step_s"]) == (
        "cuda:0",
        FWD_S,
        2 * FWD_S,
        3 * FWD_S,
    )


class _SlowestDevice(FakeDevice):
    """The fake device at its slowest: a kernel launched with ``launch_gated`` runs only once the host
    waits for the device after the launch (a clock read before such a wait misses the kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self._gates: list[threading.Event] = []
        self.ran: list[str] = []

    def launch_gated(self, name: str) -> None:
        gate = threading.Event()
        self._gates.append(gate)

        def kernel() -> None:
            gate.wait()
            self.ran.append(name)

        self.launch(kernel)

    def open_gates(self) -> None:
        for gate in self._gates:
            gate.set()

    def synchronize(self, device) -> None:
        self.open_gates()
        super().synchronize(device)

    def synchronize_event(self, event) -> None:
        self.open_gates()
        super().synchronize_event(event)

    def synchronize_stream(self, stream) -> None:
        self.open_gates()
        super().synchronize_stream(stream)


def test_cuda_calibration_run_is_timed_from_an_idle_device_to_its_last_kernel() -> None:
    """The calibration step (Note: [Calibrated times]) times a graph's generated code as a whole with the
    host clock: on CUDA the device must be idle before the clock starts (earlier queued work is not the
    graph's) and again before it stops (the graph's kernels, not only their launches)."""
    fake = _SlowestDevice()
    seen_at_start: list[list[str]] = []

    def graph_op(x: torch.Tensor) -> torch.Tensor:
        seen_at_start.append(list(fake.ran))
        fake.launch_gated("graph")
        return x + 1

    g = fx.Graph()
    g.output(g.call_function(graph_op, (g.placeholder("x"),)))
    gm = fx.GraphModule(torch.nn.Module(), g)
    try:
        with runtime_device.installed(fake):
            fake.launch_gated("earlier")  # queued by earlier work, still pending when the run starts
            _run_uninstrumented(gm, [torch.zeros(1)], "cuda:0")
            ran_at_return = list(fake.ran)
    finally:
        fake.open_gates()
        fake.close()
    assert seen_at_start == [["earlier"]], "the clock started while earlier work was still queued"
    assert ran_at_return == ["earlier", "graph"], "the clock stopped before the graph's kernel ran"
    assert not fake.errors


def test_the_census_counts_a_backwards_incoming_gradient_until_it_returns() -> None:
    """Note: [A backward's incoming gradients live until it returns] in teraio.profiling.op_timing: the
    caller holds the gradient after the graph's last use of it, so the census counts it to the end."""
    from teraio.profiling.op_timing import TimingInterpreter, incoming_gradients

    graph = fx.Graph()
    saved = graph.placeholder("mul")
    tangent = graph.placeholder("tangents_1")
    scaled = graph.call_function(torch.ops.aten.mul.Tensor, (saved, tangent))  # the tangent's last use
    grad = graph.call_function(torch.ops.aten.cos.default, (scaled,))
    bigger = graph.call_function(torch.ops.aten.cat.default, ([grad, grad],))
    graph.output((bigger,))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    n = 1 << 14  # 64 KiB of float32 per tensor

    def census(held: bool) -> list[int]:
        args = [torch.ones(n), torch.ones(n)]
        kept = incoming_gradients(gm, args)
        assert len(kept) == 1 and kept[0] is args[1]
        interp = TimingInterpreter(gm, set(), census=True, held=kept if held else None)
        del kept
        interp.boxed_run(args)
        return interp.record.live_bytes

    without, with_held = census(False), census(True)
    tensor_bytes = 4 * n
    # After the multiply, the interpreter drops the tangent; the caller's reference keeps it alive.
    assert [b - a for a, b in zip(without, with_held)] == [0, tensor_bytes, tensor_bytes]
