"""states="offload": gradients and optimizer states on disk, the optimizer step streamed (teraio.states).

Every comparison is bit for bit against the same loop without teraio's offload (``enabled=False``, or
the eager model with a plain optimizer), never with a tolerance.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import teraio
from teraio.errors import UserInputError
from teraio.runtime import Engine, RuntimeConfig
from teraio.runtime.errors import RuntimeIOError
from teraio.runtime.testing import FaultInjector
from teraio.states import StatesError
from teraio.states.offload import StateOffload
from teraio.states.optimizer_stream import Consistency
from teraio.tools.workloads import builtin_workload, compute_loss

from .shared import once_per_run
from .states_loop import assert_same_hf_run, assert_same_run, train, train_hf

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def adamw_runs(tmp_path_factory):
    """The AdamW loop without and with states="offload"; the latter saves a checkpoint after step 3.
    Made once per test run (tests.teraio.shared): the xdist workers split this module's tests between
    them, and a module fixture ran on each."""

    def runs():
        tmp = tmp_path_factory.mktemp("adamw")
        old = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            ref = train("adamw", False, str(tmp / "ref"))
            got = train("adamw", True, str(tmp / "off"), save_after=3, checkpoint_out=str(tmp / "ckpt.pt"))
        finally:
            torch.use_deterministic_algorithms(old)
        return ref, got, tmp

    return once_per_run("states-adamw-runs", runs)


def test_adamw_bit_identical(adamw_runs):
    ref, got, _ = adamw_runs
    assert_same_run(ref, got)
    moved = got.stats["moved_bytes_by_kind"]
    assert set(moved) == {"activation", "parameter", "gradient", "optimizer_state"}
    assert moved["parameter"] == 0 and moved["gradient"] > 0 and moved["optimizer_state"] > 0
    assert ref.stats["moved_bytes_by_kind"]["optimizer_state"] == 0  # enabled=False moves nothing


def test_sgd_momentum_bit_identical(tmp_path):
    ref = train("sgd", False, str(tmp_path / "ref"))
    got = train("sgd", True, str(tmp_path / "off"))
    assert_same_run(ref, got)
    assert set(got.opt_state[0]) == {"momentum_buffer"}


def test_by_default_gradients_stay_readable_and_clipping_is_exact(tmp_path):
    """Note: [Gradients stay readable unless asked] in teraio.states.grads: without offload_gradients the
    gradients stay where autograd put them, so clip_grad_norm_ between backward and step reads them."""
    ref = train("adamw", False, str(tmp_path / "ref"), steps=3, clip_norm=0.5)
    got = train("adamw", True, str(tmp_path / "off"), steps=3, clip_norm=0.5, offload_gradients=False)
    assert_same_run(ref, got)
    assert all(torch.equal(a, b) for a, b in zip(ref.grad_norms, got.grad_norms)) and got.grad_norms
    moved = got.stats["moved_bytes_by_kind"]
    assert moved["gradient"] == 0 and moved["optimizer_state"] > 0, moved


def test_gradient_accumulation_bit_identical(tmp_path):
    ref = train("adamw", False, str(tmp_path / "ref"), steps=2, micro_batches=4)
    got = train("adamw", True, str(tmp_path / "off"), steps=2, micro_batches=4)
    assert_same_run(ref, got)
    # Micro-batches 2..4 read every gradient back before accumulating into it: 3 reads per step, plus
    # the step's own read of each, plus the test's final read of the gradients.
    grad_nbytes = sum(g.numel() * g.element_size() for g in got.grads.values())
    assert got.state_stats["read_bytes"]["gradient"] == (2 * (3 + 1) + 1) * grad_nbytes


def test_checkpoint_loads_in_a_fresh_process(adamw_runs):
    ref, _, tmp = adamw_runs
    out = tmp / "finished.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.teraio.states_loop",
            str(tmp / "ckpt.pt"),
            str(out),
            str(tmp / "fresh"),
        ],
        cwd=ROOT,
        env=env,
        check=True,
        timeout=300,
    )
    finished = torch.load(out, weights_only=False)
    assert len(finished["losses"]) == 2
    for i, loss in enumerate(finished["losses"]):
        assert torch.equal(loss, ref.losses[3 + i]), f"loss of step {3 + i}"
    for n in ref.params:
        assert torch.equal(finished["params"][n], ref.params[n]), f"parameter {n}"
        assert torch.equal(finished["grads"][n], ref.grads[n]), f"gradient of {n}"
    for i, st in ref.opt_state.items():
        for k, v in st.items():
            assert torch.equal(finished["opt_state"][i][k], v), f"optimizer state {k} of parameter {i}"
    # The loaded states went to disk at once (none resident), and were read back by the steps.
    state_nbytes = sum(
        v.numel() * v.element_size() for st in ref.opt_state.values() for k, v in st.items() if k != "step"
    )
    assert finished["after_load"] == {"resident_bytes": 0, "written_bytes": state_nbytes}
    assert finished["state_stats"]["read_bytes"]["optimizer_state"] >= state_nbytes


def test_zero_grad_set_to_none_moves_no_bytes(adamw_runs):
    _, got, _ = adamw_runs
    assert len(got.zero_grad_io_bytes) == 5
    assert got.zero_grad_io_bytes == [0] * 5


def test_step_holds_about_three_chunks(adamw_runs):
    _, got, _ = adamw_runs
    total_state_nbytes = sum(
        v.numel() * v.element_size() for st in got.opt_state.values() for v in st.values()
    )
    for step, (peak, chunk_nbytes) in enumerate(got.step_peaks):
        assert len(chunk_nbytes) >= 6, "the test needs a step of many chunks"
        three = max(sum(chunk_nbytes[i : i + 3]) for i in range(len(chunk_nbytes)))
        assert 0 < peak <= three, f"step {step}: {peak} state bytes resident, three chunks hold {three}"
        assert peak < total_state_nbytes / 2


# -- durability ----------------------------------------------------------------------------------------
def _eager_setup(tmp_path, injector=None):
    w = builtin_workload("tiny")
    model = copy.deepcopy(w.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = Engine(RuntimeConfig(dirs=[str(tmp_path)], backend="posix", fault_injector=injector))
    return w, model, opt, engine


def _eager_step(w, model, opt, step):
    opt.zero_grad(set_to_none=True)
    compute_loss(model, w, step).backward()
    opt.step()


@pytest.mark.parametrize("fault", ["write_fails", "error_in_a_chunk"])
def test_failed_step_leaves_the_last_committed_step(tmp_path, fault):
    w = builtin_workload("tiny")
    ref_model = copy.deepcopy(w.model)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-3)
    for step in range(3):
        _eager_step(w, ref_model, ref_opt, step)
    ckpt = copy.deepcopy({"model": ref_model.state_dict(), "optimizer": ref_opt.state_dict()})
    _eager_step(w, ref_model, ref_opt, 3)

    injector = FaultInjector()
    _, model, opt, engine = _eager_setup(tmp_path / "off", injector)
    states = StateOffload(opt, engine, chunk_bytes=64 << 10)
    try:
        for step in range(3):
            _eager_step(w, model, opt, step)
        assert states.committed_steps == 3
        opt.zero_grad(set_to_none=True)
        compute_loss(model, w, 3).backward()
        if fault == "write_fails":  # the first chunks' writes go through, a later one fails
            injector.fail("write", after_nbytes=300 << 10)
            expected: type[BaseException] = RuntimeIOError
        else:

            def boom(chunk_pos: int) -> None:
                if chunk_pos == 3:
                    raise RuntimeError("an error in the optimizer's code")

            states.stream.before_chunk_update = boom
            expected = RuntimeError
        with pytest.raises(expected):
            opt.step()
        injector.clear()
        states.stream.before_chunk_update = None
        assert states.last_step.updated_chunks >= 2, "the failure must come after some updates"
        # The partial step is never read as valid ...
        assert states.committed_steps == 3
        assert states.consistency is Consistency.PARAMETERS_AHEAD
        with pytest.raises(StatesError, match="step 3's"):
            opt.state_dict()
        with pytest.raises(StatesError):
            opt.step()
        # ... the committed state on disk is step 3's, bit for bit ...
        committed = states.committed_state()
        for i, st in ckpt["optimizer"]["state"].items():
            for k, v in st.items():
                assert torch.equal(committed[i][k], v), f"committed {k} of parameter {i}"
        # ... and loading the step-3 checkpoint continues exactly as the uninterrupted run.
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(copy.deepcopy(ckpt["optimizer"]))
        assert states.consistency is Consistency.COMMITTED
        _eager_step(w, model, opt, 3)
        for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
            assert torch.equal(p, q), f"parameter {n} after the resumed step"
        sd = opt.state_dict()
        for i, st in ref_opt.state_dict()["state"].items():
            for k, v in st.items():
                assert torch.equal(sd["state"][i][k], v), f"{k} of parameter {i} after the resumed step"
    finally:
        states.close()
        engine.close()


def test_states_are_checksummed(tmp_path):
    w, model, opt, engine = _eager_setup(tmp_path)
    states = StateOffload(opt, engine, chunk_bytes=64 << 10)
    try:
        assert engine.config.checksum == "crc32c"
        _eager_step(w, model, opt, 0)
        st = engine.stats()
        assert st.transfers["ssd.write"].nbytes > 0
    finally:
        states.close()
        engine.close()


def test_close_brings_everything_back(tmp_path):
    w, model, opt, engine = _eager_setup(tmp_path)
    ref_model = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-3)
    states = StateOffload(opt, engine, chunk_bytes=64 << 10)
    for step in range(2):
        _eager_step(w, model, opt, step)
        _eager_step(w, ref_model, ref_opt, step)
    states.close()
    engine.close()
    assert "step" not in vars(opt) and "zero_grad" not in vars(opt)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p.grad, q.grad)  # resident again: readable directly
        for k, v in ref_opt.state[q].items():
            assert torch.equal(opt.state[p][k], v)


# -- the option ----------------------------------------------------------------------------------------
class _Subclass(torch.Tensor):
    """A tensor subclass parameter other than a DTensor (a quantized weight)."""


def test_states_option_is_checked_when_the_backend_is_built():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    cases = [
        (lambda: {"states": teraio.States(optimizer=None)}, "needs the optimizer"),
        (lambda: {"states": teraio.States(optimizer=object())}, "must be a torch.optim.Optimizer"),
        (lambda: {"states": teraio.States(optimizer=torch.optim.RMSprop(model.parameters()))}, "not RMSprop"),
        (lambda: {"states": "disk"}, "states must be one of"),
        (lambda: {"states": teraio.States(optimizer=opt, chunk_bytes="lots")}, "chunk_bytes"),
        (
            lambda: {"states": teraio.States(optimizer=torch.optim.SGD([_Subclass(torch.zeros(2))]))},
            "not _Subclass ones",
        ),
        (
            lambda: {"states": teraio.States(optimizer=opt, gradients="yes")},
            "gradients must be True or False",
        ),
    ]
    for options, message in cases:
        with pytest.raises(UserInputError, match=message) as info:
            teraio.backend(**options())
        assert "\n" not in str(info.value)


def test_flat_states_options_are_still_checked_and_warn():
    """The deprecated flat spelling: the combinations it allows are refused as before."""
    cases = [
        ({"states": "offload"}, "needs the optimizer"),
        ({"states_chunk_bytes": "lots"}, "states_chunk_bytes"),
        ({"offload_gradients": True}, "needs states='offload'"),
        ({"offload_gradients": "yes"}, "offload_gradients must be True or False"),
        ({"optimizer_in_backward": True}, "needs states='offload'"),
    ]
    for options, message in cases:
        with pytest.raises(UserInputError, match=message) as info, pytest.warns(DeprecationWarning):
            teraio.backend(**options)
        assert "\n" not in str(info.value)


def test_enabled_false_offloads_nothing():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    be = teraio.backend(enabled=False, states=teraio.States(optimizer=opt))
    try:
        assert be.states is None and "step" not in vars(opt)
    finally:
        be.close()


def _states_backend(
    enabled: bool, opt: torch.optim.Optimizer, offload_dir: str, states_options=None, **options
):
    """The backend of the loops below: FX-only, greedy plans, the optimizer's states on disk in small
    chunks; ``options`` add or override, ``states_options`` add teraio.States fields."""
    return teraio.backend(
        **{
            "inner": "eager",
            "solver": "greedy",
            "enabled": enabled,
            # keep="none": every state streamed, whatever the budget leaves.
            "states": teraio.States(
                optimizer=opt, chunk_bytes="32KiB", keep="none", **(states_options or {})
            ),
            "offload_dirs": [offload_dir],
            **options,
        }
    )


# -- other models, with the activations planned too ----------------------------------------------------
#: Whole-step budgets (Note: [The whole-step budget keeps some states in memory] in teraio.states.residency)
#: under which each model's graph still offloads activations with its parameters resident: between its
#: smallest achievable peak and its unplanned peak, beside the parameters and what the loop holds.
HF_BUDGETS = {"hf-gpt2": "55%", "hf-llama": "44%"}


def _model_run(name: str, opt_name: str, enabled: bool, offload_dir: str, steps: int = 4):
    def make_backend(opt, model, directory):
        return _states_backend(
            enabled, opt, directory, memory_budget=HF_BUDGETS[name], states_options={"gradients": True}
        )

    return train_hf(name, opt_name, offload_dir, steps, make_backend)


@pytest.mark.parametrize(
    ("name", "opt_name"),
    [
        ("hf-llama", "adamw"),
        ("hf-gpt2", "sgd"),
        # The other two pairs add a minute of CPU to CI for little: run by hand (`pytest -m expensive`).
        pytest.param("hf-gpt2", "adamw", marks=pytest.mark.expensive),
        pytest.param("hf-llama", "sgd", marks=pytest.mark.expensive),
    ],
)
def test_hf_models_with_planned_activations_are_exact(name, opt_name, tmp_path):
    """Activations planned under a budget and the gradients and states on disk, in one run."""
    ref = _model_run(name, opt_name, False, str(tmp_path / "ref"))
    got = _model_run(name, opt_name, True, str(tmp_path / "off"))
    assert_same_hf_run(ref, got)
    moved = got[3]["moved_bytes_by_kind"]
    assert moved["activation"] > 0 and moved["gradient"] > 0 and moved["optimizer_state"] > 0, moved


def _users_loop(enabled: bool, offload_dir: str):
    """What a training script does around the step: two param groups (no decay on norms and biases),
    OneCycleLR, fp16 autocast with a GradScaler (unscale_, clipping, a step it may skip), zero_grad both
    ways."""
    torch._dynamo.reset()
    w = builtin_workload("tiny")
    model = copy.deepcopy(w.model)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-3
    )
    be = _states_backend(enabled, opt, offload_dir, memory_budget="50%")
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10)
    scaler = torch.amp.GradScaler("cpu")
    compiled = torch.compile(model, backend=be)
    losses, norms = [], []
    try:
        for step in range(6):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = compute_loss(compiled, w, step)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
            scaler.step(opt)
            scaler.update()
            sched.step()
            opt.zero_grad(set_to_none=step % 2 == 0)
            losses.append(loss.detach())
        sd = opt.state_dict()
        moved = be.stats()["moved_bytes_by_kind"]
    finally:
        be.close()
    return losses, norms, [p.detach().clone() for p in model.parameters()], sd, moved


def test_a_users_loop_around_the_step_is_exact(tmp_path):
    ref = _users_loop(False, str(tmp_path / "ref"))
    got = _users_loop(True, str(tmp_path / "off"))
    for a, b in zip(ref[:3], got[:3]):
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    (sa, sb) = (ref[3], got[3])
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys() and sa["state"]
    for i in sa["state"]:
        assert all(torch.equal(sa["state"][i][k], sb["state"][i][k]) for k in sa["state"][i])
    assert got[4]["optimizer_state"] > 0 and got[4]["activation"] > 0


# -- Note: [The optimizer step inside backward] --------------------------------------------------------
def _in_backward_run(enabled: bool, offload_dir: str, steps: int = 4, micro_batches: int = 1):
    torch._dynamo.reset()
    w = builtin_workload("tiny")
    model = copy.deepcopy(w.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    be = _states_backend(
        enabled, opt, offload_dir, memory_budget="50%", states_options={"optimizer_in_backward": enabled}
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    compiled = torch.compile(model, backend=be)
    losses, grads_after_backward = [], []
    try:
        for step in range(steps):
            for micro in range(micro_batches):
                loss = compute_loss(compiled, w, step * micro_batches + micro)
                loss.backward()
            grads_after_backward.append(sum(p.grad is not None for p in model.parameters()))
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(loss.detach())
        sd = opt.state_dict()
        states = be.states.stats() if enabled else None
    finally:
        be.close()
    return losses, [p.detach().clone() for p in model.parameters()], sd, grads_after_backward, states


def test_the_optimizer_step_inside_backward_is_exact_and_keeps_no_gradient(tmp_path):
    ref = _in_backward_run(False, str(tmp_path / "ref"))
    got = _in_backward_run(True, str(tmp_path / "off"))
    assert all(torch.equal(a, b) for a, b in zip(ref[0], got[0])) and len(ref[0]) == len(got[0])
    assert all(torch.equal(a, b) for a, b in zip(ref[1], got[1]))
    sa, sb = ref[2]["state"], got[2]["state"]
    assert sa.keys() == sb.keys() and sa
    for i in sa:
        assert all(torch.equal(sa[i][k], sb[i][k]) for k in sa[i]), i
    assert all(n > 0 for n in ref[3]) and got[3] == [0] * len(got[3])  # every gradient freed in backward
    states = got[4]
    assert states["read_bytes"]["gradient"] == states["written_bytes"]["gradient"] == 0
    total_state = sum(
        v.numel() * v.element_size() for st in sb.values() for k, v in st.items() if k != "step"
    )
    # One parameter's states at a time, plus the writes in flight (two chunks of 32 KiB).
    assert 0 < states["peak_resident_bytes"]["optimizer_state"] < total_state / 2, (states, total_state)


def test_the_optimizer_step_inside_backward_refuses_accumulation(tmp_path):
    with pytest.raises(StatesError, match="call opt.step\\(\\) after every backward") as info:
        _in_backward_run(True, str(tmp_path / "off"), steps=1, micro_batches=2)
    assert "\n" not in str(info.value)


def _one_offloaded_step(tmp_path):
    torch._dynamo.reset()
    w = builtin_workload("tiny")
    model = copy.deepcopy(w.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    be = teraio.backend(
        inner="eager", states=teraio.States(optimizer=opt, gradients=True), offload_dirs=[str(tmp_path)]
    )
    compiled = torch.compile(model, backend=be)
    compute_loss(compiled, w, 0).backward()
    opt.step()
    compute_loss(compiled, w, 1).backward()  # gradients on disk again
    return w, model, opt, be, compiled


def test_close_refuses_to_restore_what_does_not_fit_and_can_drop_it(tmp_path, monkeypatch):
    from teraio.states import offload

    w, model, opt, be, compiled = _one_offloaded_step(tmp_path)
    monkeypatch.setattr(offload, "available_memory_bytes", lambda device: 1024)
    with pytest.raises(StatesError, match="more than the 1 KiB available") as info:
        be.close()
    assert "\n" not in str(info.value)
    # Nothing was read or closed: the step still works and the states are still offloaded.
    opt.step()
    assert (
        be.states.stats()["resident_bytes"]["optimizer_state"]
        < be.states.stats()["peak_resident_bytes"]["optimizer_state"]
    )
    be.close(restore_states=False)
    assert len(opt.state) == 0 and all(p.grad is None for p in model.parameters())
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]
    # The optimizer is a plain one again: a step from an empty state runs.
    compute_loss(model, w, 2).backward()
    opt.step()
    assert len(opt.state) == len(list(model.parameters()))
