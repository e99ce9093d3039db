"""The training loop of tests/teraio/test_states.py, also run by itself in a fresh process to finish a run
from a checkpoint: ``python -m tests.teraio.states_loop CHECKPOINT OUT OFFLOAD_DIR``."""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

import teraio
from teraio.tools.workloads import builtin_workload, compute_loss

OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
}
CHUNK_BYTES = "64KiB"  # the tiny GPT's 16 tensors then stream in about a dozen chunks


@dataclass
class Run:
    losses: list[torch.Tensor] = field(default_factory=list)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    opt_state: dict[int, dict[str, Any]] = field(default_factory=dict)
    #: Per step: engine bytes read + written during ``zero_grad()`` (states="offload" only).
    zero_grad_io_bytes: list[int] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    grad_norms: list[torch.Tensor] = field(default_factory=list)  # clip_grad_norm_'s, per step
    val_losses: list[torch.Tensor] = field(default_factory=list)
    state_stats: dict[str, Any] = field(default_factory=dict)
    #: Per step: the peak resident optimizer-state bytes of the streamed step and its chunks' bytes.
    step_peaks: list[tuple[int, list[int]]] = field(default_factory=list)
    #: After ``load_state_dict`` of a checkpoint: optimizer-state bytes resident and written.
    after_load: dict[str, int] = field(default_factory=dict)


def engine_io_bytes(states: Any) -> int:
    st = states.engine.stats()
    return sum(v.nbytes for v in st.transfers.values())


def train(
    opt_name: str,
    offload: bool,
    offload_dir: str,
    *,
    steps: int = 5,
    micro_batches: int = 1,
    first_step: int = 0,
    checkpoint_in: str | None = None,
    checkpoint_out: str | None = None,
    save_after: int | None = None,
    offload_gradients: bool = True,
    clip_norm: float | None = None,
    offload_parameters: bool = False,
    per_block: bool = False,
    validate: bool = False,
    inner: str = "eager",
    memory_budget: str | None = None,
    run_dir: str | None = None,
) -> Run:
    """Steps ``first_step .. steps-1`` of the tiny GPT; ``save_after``: torch.save model and optimizer
    state after that many steps to ``checkpoint_out``; ``checkpoint_in``: start from that checkpoint;
    ``memory_budget``: the whole step's (Note: [The whole-step budget keeps some states in memory] in
    teraio.states.residency), with the activations planned by the greedy and the step's memory measured."""
    torch._dynamo.reset()
    w = builtin_workload("tiny")
    model = copy.deepcopy(w.model)
    opt = OPTIMIZERS[opt_name](model.parameters())
    if offload:
        be = teraio.backend(
            inner=inner,
            profiling=teraio.Profiling(steps=1, measure_memory=memory_budget is not None),
            memory_budget=memory_budget,
            run_dir=run_dir,
            solver="greedy",
            states=teraio.States(
                optimizer=opt,
                chunk_bytes=CHUNK_BYTES,
                gradients=offload_gradients,
                parameters=offload_parameters,
                model=model if offload_parameters else None,
                min_param_bytes=0,
            ),
            offload_dirs=[offload_dir],
            io_backend="posix",
        )
    else:
        be = teraio.backend(
            inner=inner, profiling=teraio.Profiling(steps=1, measure_memory=False), enabled=False
        )
    run = Run()
    if checkpoint_in is not None:
        ckpt = torch.load(checkpoint_in, weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        if offload:
            st = be.states.stats()
            run.after_load = {
                "resident_bytes": st["resident_bytes"]["optimizer_state"],
                "written_bytes": st["written_bytes"]["optimizer_state"],
            }
    if per_block:  # each block compiled on its own (torchtitan's order): one graph called once per block
        for block in model.blocks:
            block.compile(backend=be)
        compiled = model
    else:
        compiled = torch.compile(model, backend=be)
    for step in range(first_step, steps):
        before = engine_io_bytes(be.states) if offload else 0
        opt.zero_grad(set_to_none=True)
        if offload:
            run.zero_grad_io_bytes.append(engine_io_bytes(be.states) - before)
        total = None
        for micro in range(micro_batches):
            loss = compute_loss(compiled, w, step * micro_batches + micro)
            loss.backward()
            total = loss.detach().clone() if total is None else total + loss.detach()
        if validate:  # a validation forward between backward and the step, as loops do
            with torch.no_grad():
                run.val_losses.append(compute_loss(compiled, w, 1000 + step).detach().clone())
        if clip_norm is not None:
            run.grad_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm))
        opt.step()
        run.losses.append(total)
        if offload:
            log = be.states.last_step
            run.step_peaks.append((be.states.stats()["step_peak_resident_state_bytes"], log.chunk_bytes))
        if save_after is not None and step + 1 == save_after:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint_out)
    for n, p in model.named_parameters():
        g = be.states.gradient(p) if offload else p.grad
        run.grads[n] = g.clone()
    # state_dict: offloaded parameters are not read directly (Note: [Reading an offloaded parameter]).
    run.params = {n: t.detach().clone() for n, t in model.state_dict().items()}
    sd = opt.state_dict()
    run.opt_state = {i: {k: v.clone() for k, v in st.items()} for i, st in sd["state"].items()}
    run.stats = be.stats()
    if offload:
        run.state_stats = be.states.stats()
    be.close()
    return run


def whole_state_backend(enabled: bool, budget: str, **states_options: Any) -> Any:
    """A ``make_backend`` for :func:`train_hf`: parameters, gradients and optimizer states on disk
    (``enabled``) under ``budget`` of the whole step, eager, greedy, one profiling step; ``states_options``
    add teraio.States fields."""

    def make_backend(opt: torch.optim.Optimizer, model: torch.nn.Module, directory: str) -> Any:
        return teraio.backend(
            inner="eager",
            solver="greedy",
            enabled=enabled,
            profiling=teraio.Profiling(steps=1),
            memory_budget=budget,
            states=teraio.States(
                optimizer=opt,
                model=model if enabled else None,
                gradients=True,
                parameters=enabled,
                min_param_bytes=0,
                **states_options,
            ),
            offload_dirs=[directory],
        )

    return make_backend


def train_hf(name: str, opt_name: str, offload_dir: str, steps: int, make_backend: Any) -> tuple:
    """``steps`` steps of a model (one of tests/teraio/models.py's ``HF_MODELS``, or ``gpt-tiny``) under
    the backend ``make_backend(opt, model, offload_dir)`` builds, the whole model one graph; returns the
    losses, the final parameters (read through ``model.state_dict()``), the optimizer's state and the
    backend's stats."""
    from .models import HF_MODELS

    torch._dynamo.reset()
    w = builtin_workload("tiny") if name == "gpt-tiny" else HF_MODELS[name]()
    model = w.model
    opt = OPTIMIZERS[opt_name](model.parameters())
    be = make_backend(opt, model, offload_dir)
    compiled = torch.compile(model, backend=be)
    losses = []
    try:
        for step in range(steps):
            loss = compute_loss(compiled, w, step)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        stats = be.stats()
        state = {i: {k: v.clone() for k, v in st.items()} for i, st in opt.state_dict()["state"].items()}
        params = {n: t.detach().clone() for n, t in model.state_dict().items()}
    finally:
        be.close()
    return losses, params, state, stats


def assert_same_hf_run(ref: tuple, got: tuple) -> None:
    """Bit for bit: :func:`train_hf`'s losses, parameters and every optimizer state tensor."""
    assert len(ref[0]) == len(got[0]) and all(torch.equal(a, b) for a, b in zip(ref[0], got[0]))
    assert ref[1].keys() == got[1].keys() and all(torch.equal(ref[1][n], got[1][n]) for n in ref[1])
    assert ref[2].keys() == got[2].keys() and ref[2]
    for i in ref[2]:
        assert ref[2][i].keys() == got[2][i].keys()
        assert all(torch.equal(ref[2][i][k], got[2][i][k]) for k in ref[2][i]), i


def assert_same_run(a: Run, b: Run) -> None:
    """Bit for bit: losses, final parameters and gradients, every optimizer state tensor."""
    assert len(a.losses) == len(b.losses)
    for i, (x, y) in enumerate(zip(a.losses, b.losses)):
        assert torch.equal(x, y), f"loss of step {i}: {x} vs {y}"
    assert a.params.keys() == b.params.keys()
    for n in a.params:
        assert torch.equal(a.params[n], b.params[n]), f"parameter {n}"
        assert torch.equal(a.grads[n], b.grads[n]), f"gradient of {n}"
    assert a.opt_state.keys() == b.opt_state.keys() and a.opt_state
    for i in a.opt_state:
        assert a.opt_state[i].keys() == b.opt_state[i].keys()
        for k in a.opt_state[i]:
            assert torch.equal(a.opt_state[i][k], b.opt_state[i][k]), f"optimizer state {k} of parameter {i}"


if __name__ == "__main__":  # finish an AdamW run from a checkpoint in a fresh process
    checkpoint, out, offload_dir = sys.argv[1:4]
    params_too = "--offload-parameters" in sys.argv[4:]
    budget = sys.argv[sys.argv.index("--budget") + 1] if "--budget" in sys.argv else None
    torch.use_deterministic_algorithms(True)
    finished = train(
        "adamw",
        True,
        offload_dir,
        first_step=3,
        steps=int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 5,
        checkpoint_in=checkpoint,
        offload_parameters=params_too,
        per_block=params_too and budget is None,
        memory_budget=budget,
    )
    torch.save(finished.__dict__, out)
