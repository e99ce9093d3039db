"""Reading an offloaded gradient or optimizer state directly never crashes the process: each way of
reading gives the values the same loop has without teraio, or raises one line naming the tensor (Note:
[What a read of an offloaded tensor does] in teraio.states.guarded)."""

from __future__ import annotations

import copy
import gc
import weakref
from collections.abc import Callable
from typing import Any

import numpy
import pytest
import torch
import torch.nn.functional as F

import teraio
from teraio.states import StatesError
from teraio.states.guarded import is_guarded
from teraio.states.store import Residency
from teraio.tools.models.gpt import GPT
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
    # Copied at once: without teraio the result shares the tensor's memory, and sees the later steps.
    "numpy": lambda t: torch.from_numpy(t.detach().numpy().copy()),
    "array": lambda t: torch.from_numpy(numpy.asarray(t.detach()).copy()),
    "dlpack": lambda t: torch.from_dlpack(t.detach()).clone(),
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
                if step == 1:  # Note: [A dropped record's guarded objects are not a reference cycle]
                    grads = [weakref.ref(q.grad) for q in model.parameters() if q.grad is not None]
                    on_disk = sum(is_guarded(r()) for r in grads)
                    gc.disable()  # freed by reference counting, or not at all
                    try:
                        opt.zero_grad()
                        out["grads_alive"] = (sum(r() is not None for r in grads), len(grads), on_disk)
                    finally:
                        gc.enable()
                else:
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


def test_gradients_dropped_on_disk_are_freed_without_the_cyclic_collector(runs):
    _, got = runs
    alive, grads, on_disk = got["grads_alive"]
    assert on_disk == grads > 0, f"{on_disk} of {grads} gradients on disk at zero_grad"  # not vacuous
    assert alive == 0, f"{alive} of {grads} gradients outlived zero_grad"


def test_the_reads_change_nothing_the_step_computes(runs):
    ref, got = runs
    assert ref["params"].keys() == got["params"].keys()
    assert all(torch.equal(ref["params"][n], got["params"][n]) for n in ref["params"])
    assert ref["state"].keys() == got["state"].keys() and ref["state"]
    for i in ref["state"]:
        assert all(torch.equal(ref["state"][i][k], got["state"][i][k]) for k in ref["state"][i]), i


# -- parameters on disk (Note: [Parameters are guarded while no module of the model runs] in
# teraio.states.entry_gate) -------------------------------------------------------------------------------
class _GPTWithBreaks(GPT):
    """The tiny GPT whose forward breaks the graph between blocks: Dynamo resumes the forward in frames
    of its own, entered with no hook of a module in between."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            torch._dynamo.graph_break()
            x = block(x)
        torch._dynamo.graph_break()
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


#: How the model is compiled, and which parameter the reads take (a 2-D one that moves: under
#: ``block.compile`` the embeddings run eagerly and stay in memory).
COMPILES = {
    "backend.compile": "tok.weight",
    "torch.compile": "tok.weight",
    "torch.compile with graph breaks": "tok.weight",
    "block.compile": "blocks.0.up.weight",
}


def _compile(how: str, model: torch.nn.Module, be: Any) -> torch.nn.Module:
    if how == "backend.compile":
        return be.compile(model)
    if how == "block.compile":
        for block in model.blocks:
            block.compile(backend=be)
        return model
    if how == "torch.compile with graph breaks":
        model.__class__ = _GPTWithBreaks
    return torch.compile(model, backend=be)


def _tiny_with_parameters_on_disk(enabled: bool, offload_dir: str) -> tuple[Any, Any, Any, Any]:
    """The tiny GPT (a fresh copy), AdamW, and a backend with its parameters, gradients and states on
    disk (``enabled``) or without teraio; Dynamo reset and its counters cleared."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
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
    return w, model, opt, be


def _param_loop(how: str, enabled: bool, offload_dir: str) -> dict[str, Any]:
    """The tiny GPT compiled ``how`` with every parameter on disk: after a backward, each way of reading
    a parameter (and each refused change); after ``opt.step()``, an EMA of every parameter
    (``ema.lerp_(p, 0.01)``, the read that crashed once the model spanned more than the step's last
    chunk); then more steps, whose results show the reads changed nothing and compiled nothing more."""
    w, model, opt, be = _tiny_with_parameters_on_disk(enabled, offload_dir)
    compiled = _compile(how, model, be)
    names = [n for n, _ in model.named_parameters()]
    idx = names.index(COMPILES[how])
    ema = [p.detach().clone() for p in model.parameters()]
    out: dict[str, Any] = {"reads": {}, "refused": {}, "residency": [], "ema": [], "idx": idx}
    try:
        for step in range(2):
            compute_loss(compiled, w, step).backward()
            opt.step()
            opt.zero_grad()
            if enabled:  # the step keeps its last chunk (the first layers') for the next forward
                recs = be.states.residency.records.values()
                out["on_disk_at_ema"] = sum(r.residency is Residency.DISK for r in recs)
            for e, p in zip(ema, model.parameters()):
                e.lerp_(p, 0.01)
            out["ema"].append([e.clone() for e in ema])
            if step == 0:
                out["frames_compiled_first"] = dict(torch._dynamo.utils.counters["frames"])
        compute_loss(compiled, w, 2).backward()
        p = list(model.parameters())[idx]
        for name, read in READS.items():
            if enabled:
                out["residency"].append(be.states.residency.records[idx].residency)
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
        compute_loss(compiled, w, 3).backward()
        opt.step()
        out["params"] = {n: t.detach().clone() for n, t in model.state_dict().items()}
        out["frames_compiled_later"] = dict(torch._dynamo.utils.counters["frames"])
        if enabled:
            out["parameter_read_bytes"] = be.stats()["read_bytes_by_kind"]["parameter"]
    finally:
        be.close()
    return out


@pytest.fixture(scope="module", params=list(COMPILES))
def param_runs(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("param-reads")
    how = request.param
    return _param_loop(how, False, str(tmp / "ref")), _param_loop(how, True, str(tmp / "off"))


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
        assert "\n" not in msg and f"parameter {got['idx']} is on disk" in msg and "load_state_dict" in msg, (
            msg
        )


def test_reads_of_parameters_change_nothing_the_next_steps_compute(param_runs):
    ref, got = param_runs
    assert ref["params"].keys() == got["params"].keys()
    assert all(torch.equal(ref["params"][n], got["params"][n]) for n in ref["params"])
    assert got["parameter_read_bytes"] > 0


def test_guarding_parameters_compiles_no_frame_again(param_runs):
    """Dynamo checks each graph input's exact type when it enters a compiled frame: a parameter still
    guarded there (on disk since the first step) would compile the frame again."""
    for run in param_runs:
        assert run["frames_compiled_first"]["ok"] > 0
        assert run["frames_compiled_later"] == run["frames_compiled_first"]


def test_a_function_compiled_around_the_model_trains_exactly_with_its_parameters_unguarded(tmp_path, caplog):
    """``torch.compile(fn)`` of a function that calls the model enters its frame with no module's hook
    in between: its parameters on disk stay plain (Dynamo would compile the frame again for a guarded
    one), the loop is exact, and one line says how to have reads served."""

    def run(enabled: bool) -> dict[str, Any]:
        w, model, opt, be = _tiny_with_parameters_on_disk(enabled, str(tmp_path))
        fn = torch.compile(lambda idx, targets: model(idx, targets), backend=be)
        out: dict[str, Any] = {}
        try:
            for step in range(4):
                compute_loss(fn, w, step).backward()
                opt.step()
                opt.zero_grad()
                if step == 0:
                    out["frames_first"] = dict(torch._dynamo.utils.counters["frames"])
            out["frames_later"] = dict(torch._dynamo.utils.counters["frames"])
            if enabled:
                recs = be.states.residency.records.values()
                out["on_disk"] = [r for r in recs if r.residency is Residency.DISK]
                out["guarded"] = [r for r in out["on_disk"] if type(r.tensor) is not torch.nn.Parameter]
            out["params"] = {n: t.detach().clone() for n, t in model.state_dict().items()}
        finally:
            be.close()
        return out

    ref = run(False)
    with caplog.at_level("INFO", logger="teraio"):
        got = run(True)
    assert got["frames_later"] == got["frames_first"]
    assert got["on_disk"] and not got["guarded"]
    assert all(torch.equal(ref["params"][n], got["params"][n]) for n in ref["params"])
    lines = [
        r.getMessage() for r in caplog.records if "compiled outside the model's modules" in r.getMessage()
    ]
    assert len(lines) == 1 and "torch.compile(model)" in lines[0]
