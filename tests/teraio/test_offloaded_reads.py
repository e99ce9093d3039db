"""Reading an offloaded gradient or optimizer state directly never crashes the process: each way of
reading gives the values the same loop has without teraio, or raises one line naming the tensor (Note:
[What a read of an offloaded tensor does] in teraio.states.guarded)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

import teraio
from teraio.states import StatesError
from teraio.states.store import Residency
from teraio.tools.workloads import builtin_workload, compute_loss

CHUNK_BYTES = "64KiB"  # the tiny GPT spans about a dozen chunks: nothing stays in memory by luck
PARAM = 0  # the token embedding: 2-D, and far from the last chunk the step keeps

#: Each way of reading, on a tensor ``t``; the result is compared with the same read without teraio.
READS: dict[str, Callable[[torch.Tensor], Any]] = {
    "norm": lambda t: t.norm(),
    "clip_norm_kernel": lambda t: torch._foreach_norm([t], 2.0)[0],
    "item_of_an_element": lambda t: t[3, 5].item(),
    "clone": lambda t: t.clone(),
    "sum": lambda t: t.sum(),
    "lerp_into_another": lambda t: torch.ones_like(t).lerp_(t, 0.25),
    "detach": lambda t: t.detach().sum(),
    "data": lambda t: t.data.norm(),
    "print": lambda t: repr(t) + str(t) + f"{t[0, 0]:.6e}",
    "tolist": lambda t: t[1].tolist(),
    "views": lambda t: (t[2].sum(), t.view(-1)[5].item(), t.T[1].clone(), t[1:3].detach().norm()),
    "iterate": lambda t: [row.sum() for row in t][:4],
    "to_same_dtype": lambda t: t.to(torch.float32).sum(),
    "metadata": lambda t: (tuple(t.shape), t.dtype, t.device, t.numel(), t.requires_grad, t.is_leaf),
}
#: In-place changes other than a scale or a clamp: refused in one line.
MUTATIONS: dict[str, Callable[[torch.Tensor], Any]] = {
    "add_": lambda t: t.add_(1.0),
    "zero_": lambda t: t.zero_(),
    "copy_": lambda t: t.copy_(torch.zeros_like(t)),
    "setitem": lambda t: t.__setitem__(0, 1.0),
    "data_assign": lambda t: setattr(t, "data", torch.zeros_like(t)),
    "through_a_view": lambda t: t[2].add_(1.0),
    "scale_a_view": lambda t: t[2].mul_(0.5),
}


def _loop(enabled: bool, offload_dir: str) -> dict[str, Any]:
    """Two steps of the tiny GPT, then a third backward: the gradients and the optimizer states are on
    disk when every way of reading runs; then the step, whose result shows the reads changed nothing."""
    torch._dynamo.reset()
    w = builtin_workload("tiny")
    model = copy.deepcopy(w.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if enabled:
        be = teraio.backend(
            inner="eager",
            states=teraio.States(optimizer=opt, chunk_bytes=CHUNK_BYTES, gradients=True),
            offload_dirs=[offload_dir],
            io_backend="posix",
        )
    else:
        be = teraio.backend(inner="eager", enabled=False)
    compiled = torch.compile(model, backend=be)
    out: dict[str, Any] = {"reads": {}, "refused": {}, "residency": []}
    try:
        for step in range(3):
            compute_loss(compiled, w, step).backward()
            if step < 2:
                opt.step()
                opt.zero_grad()
        p = list(model.parameters())[PARAM]
        tensors = {"grad": lambda: p.grad, "exp_avg": lambda: opt.state[p]["exp_avg"]}

        def records() -> list[Any]:
            return [be.states.grads.current(PARAM), be.states.stream.records[PARAM]["exp_avg"]]

        for kind, get in tensors.items():
            for name, read in READS.items():
                if enabled:
                    out["residency"].append([r.residency for r in records()])
                out["reads"][(kind, name)] = read(get())
            for name, mutate in MUTATIONS.items():
                try:
                    mutate(get() if enabled else get().clone())  # the reference keeps its values
                except StatesError as exc:
                    out["refused"][(kind, name)] = str(exc)
        if enabled:
            out["residency"].append([r.residency for r in records()])
            out["read_bytes"] = be.stats()["read_bytes_by_kind"]
        kept = p.grad  # a reference kept past zero_grad
        opt.step()
        opt.zero_grad()
        try:
            kept.sum()
        except StatesError as exc:
            out["refused"][("grad", "after_zero_grad")] = str(exc)
        out["params"] = {n: t.detach().clone() for n, t in model.state_dict().items()}
        sd = opt.state_dict()["state"]
        out["state"] = {i: {k: v.clone() for k, v in st.items()} for i, st in sd.items()}
    finally:
        be.close()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reads")
    return _loop(False, str(tmp / "ref")), _loop(True, str(tmp / "off"))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and type(b) is torch.Tensor and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("kind", ["grad", "exp_avg"])
@pytest.mark.parametrize("name", list(READS))
def test_each_read_of_an_offloaded_tensor_gives_the_values_without_teraio(runs, kind, name):
    ref, got = runs
    assert _same(ref["reads"][(kind, name)], got["reads"][(kind, name)]), (ref["reads"][(kind, name)],)


def test_the_tensors_were_on_disk_at_each_read_and_stay_there(runs):
    _, got = runs
    assert got["residency"] and all(r == [Residency.DISK, Residency.DISK] for r in got["residency"])
    assert got["read_bytes"]["gradient"] > 0 and got["read_bytes"]["optimizer_state"] > 0


@pytest.mark.parametrize("kind", ["grad", "exp_avg"])
@pytest.mark.parametrize("name", list(MUTATIONS))
def test_other_in_place_changes_are_refused_in_one_line(runs, kind, name):
    ref, got = runs
    assert (kind, name) not in ref["refused"]
    msg = got["refused"][(kind, name)]
    assert "\n" not in msg and "is on disk" in msg and "of parameter 0" in msg, msg
    assert ("gradient" in msg) if kind == "grad" else ("'exp_avg'" in msg and "opt.state_dict()" in msg)


def test_a_reference_kept_past_zero_grad_raises_in_one_line(runs):
    _, got = runs
    msg = got["refused"][("grad", "after_zero_grad")]
    assert "\n" not in msg and "was dropped by teraio" in msg, msg


def test_the_reads_change_nothing_the_step_computes(runs):
    ref, got = runs
    assert ref["params"].keys() == got["params"].keys()
    assert all(torch.equal(ref["params"][n], got["params"][n]) for n in ref["params"])
    assert ref["state"].keys() == got["state"].keys() and ref["state"]
    for i in ref["state"]:
        assert all(torch.equal(ref["state"][i][k], got["state"][i][k]) for k in ref["state"][i]), i


# -- parameters on disk (Note: [Parameters are guarded behind backend.compile's entries] in
# teraio.lifecycle.model_compile) --------------------------------------------------------------------
def _param_loop(enabled: bool, offload_dir: str) -> dict[str, Any]:
    """The tiny GPT compiled by ``backend.compile`` with every parameter on disk: after a backward, each
    way of reading a parameter (and each refused change); after ``opt.step()``, an EMA of every parameter
    (``ema.lerp_(p, 0.01)``, the read that crashed once the model spanned more than the step's last
    chunk); then more steps, whose results show the reads changed nothing."""
    torch._dynamo.reset()
    w = builtin_workload("tiny")
    model = copy.deepcopy(w.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if enabled:
        states = teraio.States(
            optimizer=opt,
            model=model,
            chunk_bytes=CHUNK_BYTES,
            gradients=True,
            parameters=True,
            min_param_bytes=0,
        )
        be = teraio.backend(inner="eager", states=states, offload_dirs=[offload_dir], io_backend="posix")
    else:
        be = teraio.backend(inner="eager", enabled=False)
    be.compile(model)
    ema = [p.detach().clone() for p in model.parameters()]
    out: dict[str, Any] = {"reads": {}, "refused": {}, "residency": [], "ema": []}
    try:
        for step in range(2):
            compute_loss(model, w, step).backward()
            opt.step()
            opt.zero_grad()
            if enabled:  # the step keeps its last chunk (the first layers') for the next forward
                recs = be.states.residency.records.values()
                out["on_disk_at_ema"] = sum(r.residency is Residency.DISK for r in recs)
            for e, p in zip(ema, model.parameters()):
                e.lerp_(p, 0.01)
            out["ema"].append([e.clone() for e in ema])
        compute_loss(model, w, 2).backward()
        p = list(model.parameters())[PARAM]
        for name, read in READS.items():
            if enabled:
                out["residency"].append(be.states.residency.records[PARAM].residency)
            out["reads"][name] = read(p)
        for name, mutate in MUTATIONS.items():
            try:
                with torch.no_grad():
                    mutate(p if enabled else p.detach().clone())
            except StatesError as exc:
                out["refused"][name] = str(exc)
        out["is_parameter"] = isinstance(p, torch.nn.Parameter)
        opt.step()
        opt.zero_grad()
        compute_loss(model, w, 3).backward()
        opt.step()
        out["params"] = {n: t.detach().clone() for n, t in model.state_dict().items()}
        if enabled:
            out["parameter_read_bytes"] = be.stats()["read_bytes_by_kind"]["parameter"]
    finally:
        be.close()
    return out


@pytest.fixture(scope="module")
def param_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("param-reads")
    return _param_loop(False, str(tmp / "ref")), _param_loop(True, str(tmp / "off"))


def test_each_read_of_an_offloaded_parameter_gives_the_values_without_teraio(param_runs):
    ref, got = param_runs
    assert got["residency"] and all(r is Residency.DISK for r in got["residency"])
    for name in READS:
        assert _same(ref["reads"][name], got["reads"][name]), name
    assert got["is_parameter"] is True  # isinstance(p, nn.Parameter) holds while it is on disk


def test_an_ema_of_parameters_on_disk_after_the_step_is_exact(param_runs):
    ref, got = param_runs
    assert got["on_disk_at_ema"] > len(ref["ema"][0]) // 2
    for step_ref, step_got in zip(ref["ema"], got["ema"], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(step_ref, step_got, strict=True))


def test_changes_to_a_parameter_on_disk_are_refused_in_one_line(param_runs):
    ref, got = param_runs
    assert not ref["refused"]
    for name in MUTATIONS:
        msg = got["refused"][name]
        assert "\n" not in msg and "parameter 0 is on disk" in msg and "load_state_dict" in msg, msg


def test_reads_of_parameters_change_nothing_the_next_steps_compute(param_runs):
    ref, got = param_runs
    assert ref["params"].keys() == got["params"].keys()
    assert all(torch.equal(ref["params"][n], got["params"][n]) for n in ref["params"])
    assert got["parameter_read_bytes"] > 0
