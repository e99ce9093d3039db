"""teraio.tools.estimate: a step captured with fake tensors gives exactly the saved tensors of a real profile,
op costs from FLOPs and bytes, a memory timeline from the graph, and the published models' parameters."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from teraio.errors import UserInputError
from teraio.planner.costmodel import load_preset
from teraio.planner.lifetimes import analyse
from teraio.tools.estimate_target import HF_MODELS, build_target, count_parameters
from teraio.tools.estimated_profile import (
    SAVED_TENSOR_COLUMNS,
    capture_graphs,
    estimated_profile,
    flop_formulas,
    gradient_storages,
    op_work,
    storages_of,
)
from teraio.tools.profile_workload import profile_workload
from teraio.tools.workloads import builtin_workload, load_workload

from .shared import once_per_run

SAVED_COLUMNS = list(SAVED_TENSOR_COLUMNS)
CPU = load_preset("cpu-local").compute


def _estimate(target: str, inner: str = "eager", **kwargs):
    graph = capture_graphs(build_target(target, **kwargs), inner)[0]
    return graph, estimated_profile(graph, CPU, inner, device="estimate:cpu-local").profile


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    def ranks(x: np.ndarray) -> np.ndarray:
        return np.argsort(np.argsort(x, kind="stable"), kind="stable").astype(float)

    return float(np.corrcoef(ranks(a), ranks(b))[0, 1])


@pytest.fixture(scope="module")
def tiny_pair():
    """The built-in tiny GPT: a real profile (FX-only path) and its estimate, in one process; made once per
    test run (tests.teraio.shared): the xdist workers split this module's tests."""

    def pair():
        torch.use_deterministic_algorithms(True)
        real = profile_workload(builtin_workload("tiny"), profile_steps=2, inner="eager")[0]
        _, est = _estimate("builtin:tiny")
        return real, est

    return once_per_run("estimate-tiny-pair", pair)


def test_saved_tensors_equal_a_real_profile_exactly(tiny_pair):
    real, est = tiny_pair
    assert est.activation_bytes() == real.activation_bytes() > 0
    assert est.tensors[SAVED_COLUMNS].equals(real.tensors[SAVED_COLUMNS])
    assert est.fingerprint == real.fingerprint  # so a plan made on the estimate fits the real graph
    assert est.meta["device"] == "estimate:cpu-local" and real.meta["device"] == "cpu"
    assert list(est.ops["name"]) == list(real.ops["name"])


def test_memory_timeline_is_the_census_without_in_op_temporaries(tiny_pair):
    """The real census adds what an op allocates and frees inside itself (measured with the torch
    profiler); the static census is everything else, so it may only be lower, and by those bytes."""
    real, est = tiny_pair
    e, r = est.ops["other_bytes"].to_numpy(), real.ops["other_bytes"].to_numpy()
    assert (e <= r).all()
    assert (e == r).mean() > 0.9
    assert analyse(est).baseline_peak_bytes == analyse(real).baseline_peak_bytes


def test_op_durations_rank_like_measured_ones(tiny_pair):
    real, est = tiny_pair
    assert _spearman(est.ops["duration_us"].to_numpy(), real.ops["duration_us"].to_numpy()) > 0


@pytest.mark.expensive
def test_saved_tensors_equal_a_real_inductor_profile_exactly():
    """Inductor's joint-graph passes run in the capture too: the same segments and saved storages.

    Expensive (an Inductor compile of the real profile, 25 s on 2 cores): the default run checks the same
    equality on the FX-only path (test_saved_tensors_equal_a_real_profile_exactly), and docs/cli.md's
    ``teraio estimate`` blocks capture with Inductor."""
    torch.use_deterministic_algorithms(True)
    real = profile_workload(builtin_workload("tiny"), profile_steps=2, inner="inductor")[0]
    _, est = _estimate("builtin:tiny", "inductor")
    assert est.meta["granularity"] == real.meta["granularity"] == "kernel-group"
    assert est.fingerprint == real.fingerprint
    assert est.tensors[SAVED_COLUMNS].equals(real.tensors[SAVED_COLUMNS])


def test_a_user_file_follows_the_profile_contract(tmp_path: Path):
    f = tmp_path / "mlp.py"
    f.write_text(
        textwrap.dedent(
            """
            import torch


            def make():
                torch.manual_seed(0)
                model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))
                batch = torch.randn(32, 64)
                return model, batch, lambda out, batch: out.square().mean()
            """
        )
    )
    real = profile_workload(load_workload(f"{f}:make"), profile_steps=2, inner="eager")[0]
    _, est = _estimate(f"{f}:make")
    assert est.activation_bytes() == real.activation_bytes() > 0
    assert est.tensors[SAVED_COLUMNS].equals(real.tensors[SAVED_COLUMNS])
    with pytest.raises(UserInputError, match="--batch apply to builtin: and hf: targets"):
        build_target(f"{f}:make", batch=4)


def test_streamed_gradients_leave_memory_as_backward_makes_them():
    graph, kept = _estimate("builtin:tiny")
    streamed = estimated_profile(graph, CPU, "eager", device="x", grads_stream=True).profile
    nf = kept.num_fwd_ops
    a, b = kept.ops["other_bytes"].to_numpy(), streamed.ops["other_bytes"].to_numpy()
    assert (a[:nf] == b[:nf]).all()  # forward is the same
    model = build_target("builtin:tiny").model
    grad_nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # At the end of backward every gradient is alive when they accumulate; when they stream, only the
    # one the last op makes (the embedding's) is there, at that op.
    grads = gradient_storages(graph.step, graph.input_kinds)
    last = [n for n in graph.step.bw_gm.graph.nodes if n.op == "call_function"][-1]
    made_last = sum(nbytes for ref, nbytes in dict(storages_of(last.meta["val"])).items() if ref in grads)
    assert 0 < made_last < grad_nbytes
    assert a[-1] - b[-1] == grad_nbytes - made_last
    assert streamed.meta["estimate"]["grads_stream"] is True


def test_flops_and_bytes_per_op():
    graph = capture_graphs(build_target("builtin:tiny"), "eager")[0]
    formulas = flop_formulas()
    fw = [n for n in graph.step.fw_gm.graph.nodes if n.op == "call_function"]
    mm = next(n for n in fw if n.target is torch.ops.aten.mm.default)
    (m, k), (_, n) = (tuple(a.meta["val"].shape) for a in mm.args)
    w = op_work(mm, formulas)
    assert w.kernel and w.flops == 2 * m * k * n and w.dtype == "float32"
    assert op_work(mm, formulas, tf32=True).dtype == "tf32"
    assert w.nbytes == 4 * (m * k + k * n + m * n)
    view = next(n for n in fw if n.target is torch.ops.aten.view.default)
    assert not op_work(view, formulas).kernel  # metadata only


def test_cpu_flash_attention_has_flops():
    """torch's flop counter does not list the CPU flash-attention kernels; the estimate counts them as
    the CUDA ones."""
    graph = capture_graphs(build_target("hf:llama-8b", layers=1, seq=32), "eager")[0]
    formulas = flop_formulas()
    attn = [
        n
        for n in (*graph.step.fw_gm.graph.nodes, *graph.step.bw_gm.graph.nodes)
        if "flash_attention_for_cpu" in str(n.target)
    ]
    assert len(attn) == 2  # forward and backward
    assert all(op_work(n, formulas).flops > 0 for n in attn)


@pytest.mark.parametrize(
    ("name", "params", "largest"),
    [
        ("llama-8b", 8_030_261_248, 525_336_576),  # Meta-Llama-3-8B: 8.03B
        ("llama-70b", 70_553_706_496, 1_050_673_152),  # Meta-Llama-3-70B: 70.55B
        ("t5-3b", 2_851_598_336, 32_899_072),  # DeepSpeed: "2851M total params, 32M largest layer params"
        ("gpt2-xl", 1_557_611_200, 80_411_200),  # GPT-2 XL: 1.5B
    ],
)
def test_published_models_are_built_without_weights(name, params, largest):
    target = build_target(f"hf:{name}")
    assert count_parameters(target.model) == (params, largest)
    assert all(isinstance(p, torch._subclasses.FakeTensor) for p in target.model.parameters())


def test_targets_and_options_are_checked():
    with pytest.raises(UserInputError, match="choose one of: hf:llama-8b"):
        build_target("hf:llama-405b")
    with pytest.raises(UserInputError, match="choose from builtin:tiny"):
        build_target("builtin:huge")
    with pytest.raises(UserInputError, match="--seq 9000 exceeds hf:llama-8b's 8192 positions"):
        build_target("hf:llama-8b", seq=9000)
    with pytest.raises(UserInputError, match="--batch must be a positive integer"):
        build_target("builtin:tiny", batch=0)
    assert set(HF_MODELS) >= {"llama-8b", "llama-70b"}


def test_batch_seq_dtype_and_layers_reach_the_graph():
    _, base = _estimate("builtin:tiny")
    _, bigger = _estimate("builtin:tiny", batch=8, seq=32, layers=3, dtype="bfloat16")
    assert set(bigger.tensors.loc[bigger.tensors["kind"] == "param", "dtype"]) == {"bfloat16"}
    blocks = {m.split(".")[1] for m in bigger.tensors["module"] if m.startswith("blocks.")}
    assert blocks == {"0", "1", "2"}
    tokens = bigger.tensors.loc[bigger.tensors["kind"] == "input", "shape"]
    assert any(tuple(s) == (8, 32) for s in tokens)
