"""states="offload" with offload_parameters=True: parameters on disk between the graph calls that compute
with them (teraio.states.params), updated by the streamed step, committed with the optimizer's states.

Every comparison is bit for bit against the same loop with ``enabled=False``, never with a tolerance.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import teraio
from teraio.errors import UserInputError
from teraio.runtime.errors import RuntimeIOError
from teraio.runtime.testing import FaultInjector
from teraio.states.optimizer_stream import Consistency
from teraio.tools.models.gpt import GPT, GPTConfig, synthetic_batch
from teraio.tools.workloads import builtin_workload, compute_loss

from .states_loop import assert_same_run, train

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("opt_name", "per_block"),
    [("adamw", True), ("adamw", False), ("sgd", True)],
    ids=["adamw-blocks", "adamw-whole", "sgd-blocks"],
)
def test_parameters_on_disk_train_bit_identical(opt_name, per_block, tmp_path):
    """With a validation forward under no_grad between backward and the step, as loops do."""
    ref = train(opt_name, False, str(tmp_path / "ref"), per_block=per_block, validate=True)
    got = train(
        opt_name, True, str(tmp_path / "off"), offload_parameters=True, per_block=per_block, validate=True
    )
    assert_same_run(ref, got)
    assert len(got.val_losses) == len(ref.val_losses) == 5
    for a, b in zip(ref.val_losses, got.val_losses):
        assert torch.equal(a, b)
    moved = got.state_stats["moved_bytes_by_kind"]
    assert moved["parameter"] > 0 and moved["optimizer_state"] > 0
    assert got.stats["moved_bytes_by_kind"]["parameter"] == moved["parameter"]
    assert got.state_stats["peak_resident_bytes"]["parameter"] > 0


def test_parameters_on_disk_with_inductor(tmp_path):
    ref = train("adamw", False, str(tmp_path / "ref"), per_block=True, steps=3, inner="inductor")
    got = train(
        "adamw",
        True,
        str(tmp_path / "off"),
        offload_parameters=True,
        per_block=True,
        steps=3,
        inner="inductor",
    )
    assert_same_run(ref, got)
    assert got.state_stats["moved_bytes_by_kind"]["parameter"] > 0


def test_one_block_and_the_next_in_memory_at_a_time(tmp_path):
    """Six blocks, each compiled on its own: while a block computes, forward or backward, the only blocks
    whose weights are in memory are itself and the one read ahead (the next in forward, the previous in
    backward); the embedding and head, which run eagerly, are never offloaded."""
    torch._dynamo.reset()
    cfg = GPTConfig(layers=6, hidden=64, heads=4, seq=32, batch=2, vocab=256)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    be = _offload_backend(tmp_path, model, opt)
    for block in model.blocks:
        block.compile(backend=be)
    residency = be.states.residency
    block_of = {
        residency.index_of[id(p)]: b for b, block in enumerate(model.blocks) for p in block.parameters()
    }
    seen: list[tuple[str, int, set[int]]] = []

    def resident_blocks() -> set[int]:
        return {block_of[i] for i, r in residency.records.items() if r.residency.value != "disk"}

    real_forward, real_acquire = residency.around_forward, residency.acquire

    def around_forward(idxs, first_of_step):
        real_forward(idxs, first_of_step)
        seen.append(("forward", block_of[idxs[0]], resident_blocks()))

    def acquire(idxs):
        real_acquire(idxs)
        if torch._C._current_graph_task_id() != -1:  # inside backward
            seen.append(("backward", block_of[idxs[0]], resident_blocks()))

    residency.around_forward, residency.acquire = around_forward, acquire
    try:
        for step in range(3):
            opt.zero_grad(set_to_none=True)
            model(*synthetic_batch(cfg, step)).backward()
            opt.step()
        # Six forwards of one graph before the step's first backward are not "a forward never
        # backpropagated": the block graph was profiled.
        (runner,) = be.runners
        assert runner.profile is not None and runner.abandoned_forwards == 0
        offloaded = {id(residency.params[i]) for i in residency.records}
        assert offloaded == {id(p) for block in model.blocks for p in block.parameters()}
    finally:
        be.close()
    last_step = seen[-12:]  # 6 forwards, 6 backwards
    assert [k for k, _, _ in last_step] == ["forward"] * 6 + ["backward"] * 6
    for kind, b, resident in last_step:
        ahead = {b + 1} if kind == "forward" else {b - 1}
        assert resident <= {b} | ahead, (kind, b, resident)


def _offload_backend(tmp_path, model, opt, states_options=None, **options) -> teraio.TeraioBackend:
    """A backend with ``model``'s parameters and ``opt``'s states on disk (``options`` add to or
    override its options, ``states_options`` its teraio.States fields)."""
    states = teraio.States(
        optimizer=opt,
        model=model,
        parameters=True,
        min_param_bytes=0,
        chunk_bytes="64KiB",
        **(states_options or {}),
    )
    defaults = {
        "inner": "eager",
        "profiling": teraio.Profiling(steps=1, measure_memory=False),
        "offload_dirs": [str(tmp_path)],
        "io_backend": "posix",
    }
    return teraio.backend(states=states, **{**defaults, **options})


def _backend_loop(tmp_path, injector=None, per_block=True, **options):
    """The tiny GPT, AdamW, and a backend with its parameters and optimizer states on disk (``options``
    adds to or overrides the backend's options); each block compiled on its own unless ``per_block`` is
    False."""
    torch._dynamo.reset()
    w = builtin_workload("tiny")
    model = copy.deepcopy(w.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if injector is not None:
        options["runtime_options"] = {"fault_injector": injector}
    be = _offload_backend(tmp_path, model, opt, **options)
    if not per_block:
        return w, torch.compile(model, backend=be), opt, be
    for block in model.blocks:
        block.compile(backend=be)
    return w, model, opt, be


def _in_backward(tmp_path, enabled: bool, steps: int = 3):
    w, model, opt, be = _backend_loop(
        tmp_path, enabled=enabled, states_options={"optimizer_in_backward": True}
    )
    losses, reads = [], []
    try:
        for step in range(steps):
            before = be.states.stats()["read_bytes"]["parameter"] if enabled else 0
            loss = compute_loss(model, w, step)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
            if enabled:
                reads.append(be.states.stats()["read_bytes"]["parameter"] - before)
        params = {n: t.clone() for n, t in model.state_dict().items()}
        sd = opt.state_dict()
        stats = be.states.stats() if enabled else None
        offloaded = be.states.residency.offloaded_nbytes() if enabled else 0
    finally:
        be.close()
    return losses, params, sd, stats, reads, offloaded


def test_parameters_updated_inside_backward_are_exact_and_read_twice_a_step(tmp_path):
    """optimizer_in_backward with offload_parameters: each block's parameters, fetched for its backward,
    are updated there and written, never read again by the step; no gradient touches the disk."""
    ref_losses, ref_params, ref_sd, _, _, _ = _in_backward(tmp_path / "ref", False)
    losses, params, sd, stats, reads, offloaded = _in_backward(tmp_path / "off", True)
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses)) and len(losses) == 3
    for n in ref_params:
        assert torch.equal(params[n], ref_params[n]), n
    for i, st in ref_sd["state"].items():
        for k, v in st.items():
            assert torch.equal(sd["state"][i][k], v), (i, k)
    assert stats["read_bytes"]["gradient"] == stats["written_bytes"]["gradient"] == 0
    # After the first step (which writes every parameter once at its first release): once for the
    # forward, once for the backward, and the update reads nothing.
    assert offloaded > 0 and all(r == 2 * offloaded for r in reads[1:]), (reads, offloaded)


def test_gradient_accumulation_into_offloaded_parameters_and_gradients(tmp_path):
    ref = train("adamw", False, str(tmp_path / "ref"), micro_batches=4, steps=3, per_block=True)
    got = train(
        "adamw",
        True,
        str(tmp_path / "off"),
        micro_batches=4,
        steps=3,
        per_block=True,
        offload_parameters=True,
    )
    assert_same_run(ref, got)


def test_checkpoint_of_offloaded_parameters_finishes_in_a_fresh_process(tmp_path):
    """model.state_dict() reads the offloaded parameters back (copies); a fresh process loads them."""
    ref = train("adamw", False, str(tmp_path / "ref"), per_block=True)
    ckpt = tmp_path / "ckpt.pt"
    train(
        "adamw",
        True,
        str(tmp_path / "off"),
        per_block=True,
        offload_parameters=True,
        save_after=3,
        checkpoint_out=str(ckpt),
    )
    out = tmp_path / "finished.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.teraio.states_loop",
            str(ckpt),
            str(out),
            str(tmp_path / "fresh"),
            "--offload-parameters",
        ],
        cwd=ROOT,
        env=env,
        check=True,
        timeout=300,
    )
    finished = torch.load(out, weights_only=False)
    assert [torch.equal(a, b) for a, b in zip(finished["losses"], ref.losses[3:])] == [True, True]
    for n in ref.params:
        assert torch.equal(finished["params"][n], ref.params[n]), f"parameter {n}"
    assert finished["state_stats"]["moved_bytes_by_kind"]["parameter"] > 0


def _step(w, model, opt, step):
    opt.zero_grad(set_to_none=True)
    compute_loss(model, w, step).backward()
    opt.step()


@pytest.mark.parametrize("fault", ["write_fails", "error_in_a_chunk"])
def test_a_failed_step_rolls_the_offloaded_parameters_back(tmp_path, fault):
    """Note: [A step commits all of its states or none]: offloaded parameters go back to their committed
    slot with the states, so the step can simply be run again (no PARAMETERS_AHEAD). The whole model is
    one graph, so every parameter is offloaded (a parameter only eager code uses stays resident, is
    updated in place, and a failure after its update leaves PARAMETERS_AHEAD as without
    offload_parameters)."""
    w = builtin_workload("tiny")
    ref_model = copy.deepcopy(w.model)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-3)
    ref_compiled = torch.compile(ref_model, backend="eager")
    for step in range(4):
        _step(w, ref_compiled, ref_opt, step)

    injector = FaultInjector()
    w, model, opt, be = _backend_loop(tmp_path / "off", injector, per_block=False)
    states = be.states
    try:
        for step in range(3):
            _step(w, model, opt, step)
        opt.zero_grad(set_to_none=True)
        compute_loss(model, w, 3).backward()
        if fault == "write_fails":
            injector.fail("write", after_nbytes=200 << 10)
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
        assert states.consistency is Consistency.COMMITTED and states.committed_steps == 3
        opt.step()  # the same step again, from the committed parameters and states
        final = model._orig_mod.state_dict()
        for n, q in ref_model.state_dict().items():
            assert torch.equal(final[n], q), f"parameter {n} after the step run again"
        sd = opt.state_dict()
        for i, st in ref_opt.state_dict()["state"].items():
            for k, v in st.items():
                assert torch.equal(sd["state"][i][k], v), f"{k} of parameter {i}"
    finally:
        be.close()


def test_loading_a_checkpoint_mid_run_and_closing(tmp_path):
    """load_state_dict fetches each module's parameters before copying into them and writes them after;
    close() brings every parameter back into memory, readable directly."""
    w, model, opt, be = _backend_loop(tmp_path / "off")
    ref_model = copy.deepcopy(model)
    try:
        for step in range(2):
            _step(w, model, opt, step)
        offloaded = be.states.residency.offloaded_nbytes()
        assert offloaded > 0
        model.load_state_dict(ref_model.state_dict())  # back to the initial weights, mid-run
        assert be.states.residency.offloaded_nbytes() == offloaded  # written and freed again
        got = model.state_dict()
        for n, q in ref_model.state_dict().items():
            assert torch.equal(got[n], q), n
        with be.states.parameters_materialized():
            norm = sum(p.detach().square().sum() for p in model.parameters())
        assert torch.equal(norm, sum(p.detach().square().sum() for p in ref_model.parameters()))
    finally:
        be.close()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)  # resident again and readable


def test_offload_parameters_options_are_checked_at_construction():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(UserInputError, match="needs the model"):
        teraio.backend(states=teraio.States(optimizer=opt, parameters=True))
    with pytest.raises(UserInputError, match="needs states='offload'"), pytest.warns(DeprecationWarning):
        teraio.backend(offload_parameters=True, model=model)  # the deprecated flat spelling
    with pytest.raises(UserInputError, match="min_param_bytes"):
        teraio.backend(states=teraio.States(optimizer=opt, model=model, parameters=True, min_param_bytes="x"))


class _TiedHead(torch.nn.Module):
    """Blocks compiled one by one and an eager head whose weight is the first block's (tied)."""

    def __init__(self, width: int = 64, blocks: int = 3) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()) for _ in range(blocks)
        )
        self.head = torch.nn.Linear(width, width, bias=False)
        self.head.weight = self.blocks[0][0].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


def _tied_run(tmp_path, enabled: bool, steps: int = 4):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _TiedHead()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    be = _offload_backend(tmp_path, model, opt, enabled=enabled)
    for block in model.blocks:
        block.compile(backend=be)
    losses = []
    try:
        for step in range(steps):
            loss = model(torch.randn(8, 64, generator=torch.Generator().manual_seed(step)))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        offloaded = set(be.states.residency.records) if enabled else set()
        moved = be.states.stats()["moved_bytes_by_kind"]["parameter"] if enabled else 0
        params = {n: t.clone() for n, t in model.state_dict().items()}
    finally:
        be.close()
    return losses, params, offloaded, moved


def test_a_parameter_eager_code_also_uses_stays_resident(tmp_path):
    """Note: [A parameter eager code uses stays resident]: the head runs eagerly with the first block's
    weight; that weight leaves the disk at the head's first call and the run stays bit-exact (without
    the hook, the head reads an empty storage)."""
    ref_losses, ref_params, _, _ = _tied_run(tmp_path / "ref", False)
    losses, params, offloaded, moved = _tied_run(tmp_path / "off", True)
    assert len(losses) == 4 and all(torch.equal(a, b) for a, b in zip(ref_losses, losses))
    for n in ref_params:
        assert torch.equal(params[n], ref_params[n]), n
    # The optimizer's parameters in order: block 0's weight (tied to the head) and bias, block 1's, ...
    assert 0 not in offloaded and {1, 2, 3, 4, 5} <= offloaded, offloaded
    assert moved > 0


@pytest.mark.parametrize(
    "options",
    [{"gradients": True}, {"optimizer_in_backward": True}],
    ids=["gradients_offloaded", "in_backward"],
)
def test_show_reports_a_steps_bytes_by_kind_and_its_io_lower_bound(tmp_path, capsys, options):
    """``teraio show RUN_DIR``: the last step's bytes written and read by kind (the difference of the
    last two stats lines) and its I/O lower bound at the bandwidth of the run's hardware.json; each step
    writes every offloaded parameter and optimizer state once. ``teraio plan`` and ``teraio simulate``
    predict the same bytes from the profile."""
    from teraio.cli import main
    from teraio.planner.hardware import HardwareModel
    from teraio.planner.model_states import io_lower_bound_s

    w, model, opt, be = _backend_loop(
        tmp_path / "off",
        per_block=False,
        run_dir=str(tmp_path / "run"),
        memory_budget="90%",
        # keep="none": every parameter and state streamed, whatever the budget leaves.
        states_options={"keep": "none", **options},
    )
    try:
        for step in range(4):
            compute_loss(model, w, step).backward()
            opt.step()
            opt.zero_grad()
        param_bytes = sum(r.nbytes for r in be.states.residency.records.values())
        state_bytes = sum(r.nbytes for r in be.states.stream.all_records())
        whole = be.stats()["whole_step"]
        assert whole["states_keep"] == "none" and whole["kept"] is None  # nothing kept, whatever the room
        assert whole["budget_bytes"] is not None
    finally:
        be.close()
    assert main(["show", str(tmp_path / "run"), "--json"]) == 0
    (rank,) = json.loads(capsys.readouterr().out)["ranks"].values()
    io = rank["step_io"]
    assert io["step"] == 3
    written, read = io["written_bytes_by_kind"], io["read_bytes_by_kind"]
    assert written["parameter"] == param_bytes > 0 and written["optimizer_state"] == state_bytes > 0
    assert read["parameter"] > 0 and read["optimizer_state"] == state_bytes
    assert (written["gradient"] > 0) == ("gradients" in options)
    ssd = HardwareModel.load(tmp_path / "run" / "hardware.json").tier("ssd")
    assert io["io_lower_bound_s"] == io_lower_bound_s(
        sum(written.values()),
        sum(read.values()),
        ssd.total_write_bw_bytes_per_s,
        ssd.total_read_bw_bytes_per_s,
    )
    assert main(["show", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "step 3 wrote / read by kind" in out and "I/O lower bound" in out

    # teraio plan and simulate predict, from the profile's model_states, the bytes show measured for the
    # parameters, gradients and optimizer states (the activations are the plan's own).
    (profile,) = (tmp_path / "run").glob("graph*/profile")
    plan_file = tmp_path / "plan.json"
    assert (
        main(["plan", str(profile), "-b", "90%", "--solver", "greedy", "-o", str(plan_file), "--json"]) == 0
    )
    planned = json.loads(capsys.readouterr().out)
    assert main(["simulate", str(profile), str(plan_file), "--json"]) == 0
    simulated = json.loads(capsys.readouterr().out)
    for got in (planned, simulated):
        assert set(got["moved_bytes_by_kind"]) == {"activation", "parameter", "gradient", "optimizer_state"}
        for kind in ("parameter", "gradient", "optimizer_state"):
            assert got["written_bytes_by_kind"][kind] == written[kind], kind
            assert got["read_bytes_by_kind"][kind] == read[kind], kind
        ms = got["model_states"]
        assert ms["parameter"]["offloaded_bytes"] == param_bytes
        assert ms["optimizer_state"]["bytes"] == state_bytes
        assert got["io_lower_bound_s"] > 0
    assert planned["written_bytes_by_kind"]["activation"] == planned["moved_bytes"]
    assert simulated["written_bytes_by_kind"]["activation"] == simulated["written_bytes"]
    assert (
        main(["plan", str(profile), "-b", "90%", "--solver", "greedy", "-o", str(plan_file), "--force"]) == 0
    )
    out = capsys.readouterr().out
    assert "state tensors" in out and "moved per step" in out and "optimizer_state" in out
