"""The optimizer step overlapped with the next forward (Note: [The step of offloaded parameters runs in the
next forward] in teraio.states.step_pipeline): bit-identical to ``enabled=False`` in the loops users write
(clipping, accumulation, an LR scheduler stepped after ``opt.step()``, a validation forward and an EMA read
while the update is pending, one graph per block or one for the model), each byte moved once, and a
failure in the forward that runs the update leaves the last committed step."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

import teraio
from teraio.errors import UserInputError
from teraio.tools.workloads import builtin_workload, compute_loss

STEPS = 5
CHUNK_BYTES = "64KiB"  # the tiny GPT's blocks then span several chunks, and chunks several blocks


@dataclass
class Loop:
    losses: list[torch.Tensor] = field(default_factory=list)
    val_losses: list[torch.Tensor] = field(default_factory=list)
    eager_outputs: list[torch.Tensor] = field(default_factory=list)
    norms: list[torch.Tensor] = field(default_factory=list)
    ema: dict[str, torch.Tensor] = field(default_factory=dict)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    opt_state: dict[int, dict[str, Any]] = field(default_factory=dict)
    lrs: list[float] = field(default_factory=list)
    per_step_io: list[dict[str, dict[str, int]]] = field(default_factory=list)
    overlapped_steps: int = 0
    chunks_in_forward: int = 0
    trained_offloaded_bytes: int = 0
    grad_bytes: int = 0
    state_bytes: int = 0


def _backend(
    enabled: bool, model: torch.nn.Module, opt: torch.optim.Optimizer, offload_dir: str
) -> teraio.TeraioBackend:
    """The whole state on disk (``enabled``), the overlapped step on by default; else plain training."""
    return teraio.backend(
        inner="eager",
        solver="greedy",
        enabled=enabled,
        profiling=teraio.Profiling(steps=1, measure_memory=False),
        states=teraio.States(
            optimizer=opt,
            model=model if enabled else None,
            gradients=True,
            parameters=enabled,
            chunk_bytes=CHUNK_BYTES,
            min_param_bytes=0,
        ),
        offload_dirs=[offload_dir],
        io_backend="posix",
    )


def _loop(
    enabled: bool, offload_dir: str, *, per_block: bool, micro_batches: int = 1, extras: bool = True
) -> Loop:
    """Training as a user writes it: accumulation, clipping, a scheduler after the step, a validation
    forward and an EMA read right after ``opt.step()`` (while the update is pending); ``extras=False``:
    only the forward, backward and step."""
    torch._dynamo.reset()
    w = builtin_workload("tiny")
    model = copy.deepcopy(w.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    be = _backend(enabled, model, opt, offload_dir)
    if per_block:
        for block in model.blocks:
            block.compile(backend=be)
        compiled = model
    else:
        compiled = torch.compile(model, backend=be)
    ema = [torch.zeros_like(p) for p in model.parameters()]
    probe = torch.randn(2, 3, model.blocks[-1].up.in_features, generator=torch.Generator().manual_seed(0))
    out = Loop()
    counts = {"chunks": 0, "in_forward": 0}
    if enabled:
        overlapped = be.states.overlapped
        assert overlapped is not None
        real_ensure, real_advance = overlapped.ensure, overlapped._advance

        def ensure(idxs: tuple[int, ...]) -> None:  # a forward's graph call (or an eager module)
            counts["in_forward"] += 1
            try:
                real_ensure(idxs)
            finally:
                counts["in_forward"] -= 1

        def advance(keep: tuple[int, ...]) -> None:  # counts the chunks updated inside a forward
            counts["chunks"] += counts["in_forward"] > 0
            real_advance(keep)

        overlapped.ensure, overlapped._advance = ensure, advance
        if be.states.residency.before_use is not None:  # graph calls wait for their chunks
            be.states.residency.before_use = ensure
    prev: dict[str, dict[str, int]] = {}
    try:
        for step in range(STEPS):
            total = None
            for micro in range(micro_batches):
                loss = compute_loss(compiled, w, step * micro_batches + micro) / micro_batches
                loss.backward()
                total = loss.detach() if total is None else total + loss.detach()
            out.losses.append(total)
            if extras:
                out.norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5))
            opt.step()
            if enabled and be.states.overlapped.pending:
                out.overlapped_steps += 1
            opt.zero_grad()
            if extras:
                sched.step()  # changes the lr before the pending update runs: it must not reach it
                out.lrs.append(opt.param_groups[0]["lr"])
                # A submodule called by itself (eager code: its parameters stay in memory from now on)
                # on a fixed input, a validation forward and an EMA (which reads every parameter), all
                # while the update is pending: one graph per block validates first, the model in one
                # graph last.
                with torch.no_grad():
                    out.eager_outputs.append(model.blocks[-1].up(probe).clone())
                for what in ("validate", "ema") if per_block else ("ema", "validate"):
                    if what == "validate":
                        with torch.no_grad():
                            out.val_losses.append(compute_loss(compiled, w, 1000 + step).detach())
                    else:
                        for e, p in zip(ema, model.parameters()):
                            e.lerp_(p.detach(), 0.1)
            if enabled:
                st = be.stats()
                out.per_step_io.append(
                    {
                        k: {kind: st[k][kind] - prev.get(k, {}).get(kind, 0) for kind in st[k]}
                        for k in ("read_bytes_by_kind", "written_bytes_by_kind")
                    }
                )
                prev = st
        names = [n for n, _ in model.named_parameters()]
        out.ema = {n: e.clone() for n, e in zip(names, ema)}
        out.params = {n: t.detach().clone() for n, t in model.state_dict().items()}
        sd = opt.state_dict()
        out.opt_state = {i: {k: v.clone() for k, v in st.items()} for i, st in sd["state"].items()}
        if enabled:
            whole = be.stats()["whole_step"]
            assert whole["overlap_step"] is True and whole["overlapped_steps"] == out.overlapped_steps
            residency = be.states.residency
            out.chunks_in_forward = counts["chunks"]
            out.trained_offloaded_bytes = sum(r.nbytes for i, r in residency.records.items())
            out.grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            out.state_bytes = 2 * out.grad_bytes
    finally:
        be.close()
    return out


def assert_same(a: Loop, b: Loop) -> None:
    for name in ("losses", "val_losses", "norms", "eager_outputs"):
        xs, ys = getattr(a, name), getattr(b, name)
        assert len(xs) == len(ys) == STEPS
        for i, (x, y) in enumerate(zip(xs, ys)):
            assert torch.equal(x, y), f"{name}[{i}]: {x} vs {y}"
    assert a.lrs == b.lrs
    for attr in ("ema", "params"):
        x, y = getattr(a, attr), getattr(b, attr)
        assert x.keys() == y.keys() and x
        for n in x:
            assert torch.equal(x[n], y[n]), f"{attr} {n}"
    assert a.opt_state.keys() == b.opt_state.keys() and a.opt_state
    for i in a.opt_state:
        for k in a.opt_state[i]:
            assert torch.equal(a.opt_state[i][k], b.opt_state[i][k]), f"optimizer state {k} of {i}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Loop]:
    d = tmp_path_factory.mktemp("overlap")
    return {
        "reference": _loop(False, str(d / "ref"), per_block=True, micro_batches=2),
        "per_block": _loop(True, str(d / "blocks"), per_block=True, micro_batches=2),
        "reference_one_graph": _loop(False, str(d / "ref1"), per_block=False),
        "one_graph": _loop(True, str(d / "one"), per_block=False),
        "plain": _loop(True, str(d / "plain"), per_block=True, extras=False),
    }


def test_the_overlapped_step_is_exact_one_graph_per_block(runs):
    assert_same(runs["reference"], runs["per_block"])


def test_the_overlapped_step_is_exact_with_the_model_one_graph(runs):
    assert_same(runs["reference_one_graph"], runs["one_graph"])


@pytest.mark.parametrize("name", ["per_block", "plain"])
def test_the_update_of_offloaded_parameters_runs_in_the_next_forward(runs, name):
    got = runs[name]
    # Every step whose graphs run their plans (here the first already: no budget, nothing to plan) leaves
    # its update pending when opt.step() returns, and the forward's calls run its chunks.
    assert got.overlapped_steps >= STEPS - 1
    assert got.chunks_in_forward >= 2 * got.overlapped_steps


def test_no_byte_moves_twice(runs):
    """A running step reads each offloaded parameter twice (for its update, which the forward then
    computes with, and for the backward) and writes it once; it reads and writes each gradient and
    optimizer state once. Nothing more."""
    got = runs["plain"]
    params, grads, states = got.trained_offloaded_bytes, got.grad_bytes, got.state_bytes
    assert 0 < params < grads  # the embedding and head run eagerly: they stay (updated in opt.step())
    # From the third step on, the update of the step before runs in this step's forward.
    assert got.overlapped_steps >= STEPS - 1
    for io in got.per_step_io[2:]:
        read, written = io["read_bytes_by_kind"], io["written_bytes_by_kind"]
        assert read["parameter"] == 2 * params and written["parameter"] == params, (read, written)
        assert read["gradient"] == written["gradient"] == grads, (read, written)
        assert read["optimizer_state"] == written["optimizer_state"] == states, (read, written)


def test_overlap_step_option_is_checked_at_construction():
    opt = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    with pytest.raises(UserInputError, match="overlap_step must be True or False"):
        teraio.States(optimizer=opt, overlap_step="yes")


def _reference_states(steps: int) -> tuple[dict[str, torch.Tensor], dict[int, dict[str, Any]]]:
    """The tiny GPT's parameters and AdamW states after ``steps`` plain steps (no teraio)."""
    w = builtin_workload("tiny")
    model = copy.deepcopy(w.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(steps):
        compute_loss(model, w, step).backward()
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()["state"]
    return {n: t.detach().clone() for n, t in model.state_dict().items()}, sd


def test_a_failure_in_the_forward_that_runs_the_update_leaves_the_last_committed_step(tmp_path):
    """The update of step 1 fails on its third chunk inside step 2's forward: that forward raises the
    error, the parameters and states are step 0's (the last committed), and the loop can run step 1
    again and go on, bit-identical to a run without the failure."""
    torch._dynamo.reset()
    w = builtin_workload("tiny")
    model = copy.deepcopy(w.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    be = teraio.backend(
        inner="eager",
        solver="greedy",
        profiling=teraio.Profiling(steps=1, measure_memory=False),
        states=teraio.States(
            optimizer=opt,
            model=model,
            gradients=True,
            parameters=True,
            chunk_bytes=CHUNK_BYTES,
            min_param_bytes=0,
        ),
        offload_dirs=[str(tmp_path)],
        io_backend="posix",
    )
    compiled = torch.compile(model, backend=be)
    after_one, states_after_one = _reference_states(1)
    after_three, states_after_three = _reference_states(3)

    def fail_third(pos: int) -> None:
        if pos == 2:
            raise RuntimeError("injected failure of chunk 2")

    try:
        for step in range(2):
            compute_loss(compiled, w, step).backward()
            opt.step()
            opt.zero_grad()
        assert be.states.overlapped.pending  # step 1's update waits for the next forward
        be.states.stream.before_chunk_update = fail_third
        with pytest.raises(RuntimeError, match="injected failure of chunk 2"):
            compute_loss(compiled, w, 2)
        be.states.stream.before_chunk_update = None
        assert not be.states.overlapped.pending
        assert be.states.committed_steps == 1 and be.states.consistency.value == "committed"
        params = {n: t.detach().clone() for n, t in model.state_dict().items()}
        assert all(torch.equal(params[n], after_one[n]) for n in after_one)
        state = opt.state_dict()["state"]
        for i, st in states_after_one.items():
            assert all(torch.equal(state[i][k], v) for k, v in st.items()), i
        for step in (1, 2):  # step 1 again (its gradients went with the failed update), then step 2
            compute_loss(compiled, w, step).backward()
            opt.step()
            opt.zero_grad()
        params = {n: t.detach().clone() for n, t in model.state_dict().items()}
        assert all(torch.equal(params[n], after_three[n]) for n in after_three)
        state = opt.state_dict()["state"]
        for i, st in states_after_three.items():
            assert all(torch.equal(state[i][k], v) for k, v in st.items()), i
    finally:
        be.close()


def _two_models_changing_shapes(enabled: bool, offload_dir: str) -> dict[str, Any]:
    """Two models, each with its backend and optimizer, trained in turn (one's update pending while the
    other trains), the sequence length changing every other step (a new shape profiled while an update
    is pending): model A one graph per block, model B one graph."""
    torch._dynamo.reset()
    lengths = (64, 64, 48, 64, 48, 64)  # a second shape is enough: a third only compiled more
    out: dict[str, Any] = {"losses": [], "overlapped": {"a": 0, "b": 0}}
    runs = {}
    for name, seed in (("a", 0), ("b", 1)):
        w = builtin_workload("tiny", seed=seed)
        model = copy.deepcopy(w.model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        be = _backend(enabled, model, opt, f"{offload_dir}/{name}")
        if name == "a":
            for block in model.blocks:
                block.compile(backend=be)
            compiled = model
        else:
            compiled = torch.compile(model, backend=be)
        runs[name] = (w, model, opt, be, compiled)
    try:
        for step, length in enumerate(lengths):
            for name, (w, model, opt, be, compiled) in runs.items():
                idx, targets = w.batch_at(step)
                loss = compiled(idx[:, :length].contiguous(), targets[:, :length].contiguous())
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()
                if enabled and be.states.overlapped.pending:
                    out["overlapped"][name] += 1
                opt.zero_grad()
                out["losses"].append(loss.detach())
        for name, (_, model, opt, _, _) in runs.items():
            out[f"params_{name}"] = {n: t.detach().clone() for n, t in model.state_dict().items()}
            sd = opt.state_dict()["state"]
            out[f"state_{name}"] = {i: {k: v.clone() for k, v in st.items()} for i, st in sd.items()}
    finally:
        for _, _, _, be, _ in runs.values():
            be.close()
    return out


def test_two_models_and_changing_shapes_with_updates_pending_are_exact(tmp_path):
    ref = _two_models_changing_shapes(False, str(tmp_path / "ref"))
    got = _two_models_changing_shapes(True, str(tmp_path / "got"))
    assert len(got["losses"]) == len(ref["losses"]) == 12
    for i, (x, y) in enumerate(zip(ref["losses"], got["losses"])):
        assert torch.equal(x, y), f"loss {i}: {x} vs {y}"
    for name in ("a", "b"):
        assert got["overlapped"][name] >= 2, got["overlapped"]  # updates were pending across the other
        for n, t in ref[f"params_{name}"].items():
            assert torch.equal(t, got[f"params_{name}"][n]), f"model {name}: {n}"
        for i, st in ref[f"state_{name}"].items():
            for k, v in st.items():
                assert torch.equal(v, got[f"state_{name}"][i][k]), f"model {name}: state {k} of {i}"
