"""Gradient clipping and a GradScaler with the gradients on disk (``teraio.States(gradients=True)``): the
same bits as without teraio, and no gradient read for them once the loop has shown it clips (Note:
[Norms are taken before the write] in teraio.states.grad_norms)."""

from __future__ import annotations

import copy

import pytest
import torch

import teraio
from teraio.states import StatesError
from teraio.tools.workloads import builtin_workload, compute_loss

CHUNK_BYTES = "64KiB"  # the tiny GPT spans about a dozen chunks: nothing stays in memory by luck
STEPS = 4
MICRO_BATCHES = 2


def _backend(enabled: bool, opt: torch.optim.Optimizer, offload_dir: str, **states: object) -> object:
    if not enabled:
        return teraio.backend(inner="eager", enabled=False)
    return teraio.backend(
        inner="eager",
        states=teraio.States(optimizer=opt, chunk_bytes=CHUNK_BYTES, gradients=True, **states),
        offload_dirs=[offload_dir],
        io_backend="posix",
    )


def _adamw_two_groups(model: torch.nn.Module) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-3
    )


def _read_bytes(be: object) -> int:
    return sum(be.stats()["read_bytes_by_kind"].values())  # type: ignore[attr-defined]


def _clip_loop(enabled: bool, offload_dir: str, clip: bool = True) -> dict[str, object]:
    """AdamW with two parameter groups, two micro-batches accumulated, ``clip_grad_norm_`` every step
    (max_norm 1.0, which does not clip the tiny GPT, then 0.05, which does) and ``clip_grad_value_``."""
    torch._dynamo.reset()
    w = builtin_workload("tiny")
    model = copy.deepcopy(w.model)
    opt = _adamw_two_groups(model)
    be = _backend(enabled, opt, offload_dir)
    compiled = torch.compile(model, backend=be)
    losses, norms, step_reads = [], [], []
    try:
        for step in range(STEPS):
            before = _read_bytes(be) if enabled else 0
            for micro in range(MICRO_BATCHES):
                loss = compute_loss(compiled, w, step * MICRO_BATCHES + micro)
                loss.backward()
                losses.append(loss.detach())
            if clip:
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), (1.0, 0.05)[step % 2]))
                torch.nn.utils.clip_grad_value_(model.parameters(), 2e-3)
            opt.step()
            step_reads.append(_read_bytes(be) - before if enabled else 0)
            if step < STEPS - 1:
                opt.zero_grad()
        grads = {
            n: (be.states.gradient(p) if enabled else p.grad.clone())  # type: ignore[attr-defined]
            for n, p in model.named_parameters()
        }
        sd = opt.state_dict()
        state = {i: {k: v.clone() for k, v in st.items()} for i, st in sd["state"].items()}
        params = {n: t.detach().clone() for n, t in model.state_dict().items()}
    finally:
        be.close()  # type: ignore[attr-defined]
    return {
        "losses": losses,
        "norms": norms,
        "grads": grads,
        "state": state,
        "params": params,
        "reads": step_reads,
    }


def _assert_same(ref: dict[str, object], got: dict[str, object]) -> None:
    for key in ("losses", "norms"):
        a, b = ref[key], got[key]
        assert len(a) == len(b), key  # type: ignore[arg-type]
        for i, (x, y) in enumerate(zip(a, b)):  # type: ignore[call-overload]
            assert torch.equal(x.view(torch.int32), y.view(torch.int32)), (key, i, x, y)  # NaN bits too
    for key in ("grads", "params"):
        a, b = ref[key], got[key]
        assert a.keys() == b.keys() and a, key  # type: ignore[attr-defined]
        assert all(torch.equal(a[n], b[n]) for n in a), key  # type: ignore[index]
    sa, sb = ref["state"], got["state"]
    assert sa.keys() == sb.keys() and sa  # type: ignore[attr-defined]
    for i in sa:  # type: ignore[attr-defined]
        assert all(torch.equal(sa[i][k], sb[i][k]) for k in sa[i]), i  # type: ignore[index]


def test_clipping_offloaded_gradients_is_exact_and_reads_nothing_more(tmp_path):
    ref = _clip_loop(False, str(tmp_path / "ref"))
    got = _clip_loop(True, str(tmp_path / "off"))
    _assert_same(ref, got)
    norms = got["norms"]
    assert norms[0] < 1.0 < norms[0] / 0.05 and norms[1] > 0.05  # type: ignore[index]  # 0.05 clips
    unclipped = _clip_loop(True, str(tmp_path / "noclip"), clip=False)
    # The first clip reads each gradient once (the loop has not shown it clips yet); from the second
    # step on the norms come from the cache and the scales are replayed as the step loads each gradient.
    assert got["reads"][0] > unclipped["reads"][0]  # type: ignore[index]
    assert got["reads"][1:] == unclipped["reads"][1:], (got["reads"], unclipped["reads"])


def _scaler_loop(enabled: bool, offload_dir: str, explicit_unscale: bool) -> dict[str, object]:
    """fp16 autocast with a GradScaler on CPU, two micro-batches, ``unscale_`` then ``clip_grad_norm_``
    (or ``scaler.step`` unscaling by itself), and a step that overflows (an inf in the loss at step 2):
    the scaler skips it and halves its scale."""
    torch._dynamo.reset()
    w = builtin_workload("tiny")
    model = copy.deepcopy(w.model)
    opt = _adamw_two_groups(model)
    be = _backend(enabled, opt, offload_dir)
    compiled = torch.compile(model, backend=be)
    scaler = torch.amp.GradScaler("cpu")
    losses, norms, scales, grad_reads = [], [], [], []
    try:
        for step in range(STEPS):
            for micro in range(MICRO_BATCHES):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = compute_loss(compiled, w, step * MICRO_BATCHES + micro)
                if step == 2 and micro == 1:
                    loss = loss * float("inf")  # every gradient inf or NaN: the step is skipped
                scaler.scale(loss).backward()
                losses.append(loss.detach())
            before = be.stats()["read_bytes_by_kind"]["gradient"] if enabled else 0  # type: ignore[attr-defined]
            if explicit_unscale:
                scaler.unscale_(opt)
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
            if enabled:  # gradients read between backward and the step, for the unscale and the clip
                grad_reads.append(be.stats()["read_bytes_by_kind"]["gradient"] - before)  # type: ignore[attr-defined]
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
            opt.zero_grad(set_to_none=step % 2 == 0)
        sd = opt.state_dict()
        state = {i: {k: v.clone() for k, v in st.items()} for i, st in sd["state"].items()}
        params = {n: t.detach().clone() for n, t in model.state_dict().items()}
        grads = {n: torch.zeros(()) for n, _ in model.named_parameters()}
        committed = be.states.committed_steps if enabled else None  # type: ignore[attr-defined]
    finally:
        be.close()  # type: ignore[attr-defined]
    return {
        "losses": losses,
        "norms": norms,
        "grads": grads,
        "state": state,
        "params": params,
        "scales": scales,
        "grad_reads": grad_reads,
        "committed": committed,
    }


@pytest.mark.parametrize("explicit_unscale", [True, False], ids=["unscale_and_clip", "step_unscales"])
def test_a_grad_scaler_with_offloaded_gradients_is_exact(tmp_path, explicit_unscale):
    ref = _scaler_loop(False, str(tmp_path / "ref"), explicit_unscale)
    got = _scaler_loop(True, str(tmp_path / "off"), explicit_unscale)
    _assert_same(ref, got)
    assert ref["scales"] == got["scales"] and got["scales"][2] == got["scales"][1] / 2  # type: ignore[index]
    assert got["committed"] == STEPS - 1  # the overflowing step was skipped: no streamed step ran
    if not explicit_unscale:
        return
    reads = got["grad_reads"]
    # Step 0 reads every gradient once (nothing asked for yet); step 1 unscales from the finite norms
    # and (unscale_ then clip) takes the norm of the unscaled gradients from the hook's copy: no read.
    # Step 2 overflows: its norms are not finite, so its unscale reads to set found_inf.
    assert reads[0] > 0 and reads[1] == 0 and reads[2] > 0, reads  # type: ignore[index]


def test_clipping_with_the_update_inside_backward_is_refused_in_one_line(tmp_path):
    torch._dynamo.reset()
    w = builtin_workload("tiny")
    model = copy.deepcopy(w.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    be = teraio.backend(
        inner="eager",
        states=teraio.States(optimizer=opt, chunk_bytes=CHUNK_BYTES, optimizer_in_backward=True),
        offload_dirs=[str(tmp_path)],
        io_backend="posix",
    )
    compiled = torch.compile(model, backend=be)
    scaler = torch.amp.GradScaler("cpu")
    try:
        scaler.scale(compute_loss(compiled, w, 0)).backward()
        assert all(p.grad is None for p in model.parameters())  # consumed inside backward
        for clip in (
            lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0),
            lambda: torch.nn.utils.clip_grad_value_(model.parameters(), 1.0),
            lambda: scaler.unscale_(opt),
        ):
            with pytest.raises(
                StatesError, match="optimizer_in_backward=True applies each in backward"
            ) as info:
                clip()
            assert "\n" not in str(info.value)
        opt.step()  # the updates made in backward still commit
        opt.zero_grad()
        assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)) == 0.0  # no gradient: fine
        assert be.states.committed_steps == 1
    finally:
        be.close()
