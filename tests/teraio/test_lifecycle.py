"""The backend's lifecycle as a user meets it: the front door, refusals, messages, shapes, measurement."""

from __future__ import annotations

import json
import logging
import statistics
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import teraio
import teraio.profiling.disk_calibration
import teraio.profiling.op_timing as profiler_module
from teraio.errors import UserInputError
from teraio.lifecycle.backend import Phase, TeraioBackend, check_compile_mode
from teraio.lifecycle.runner import _device_of
from teraio.planner.hardware import HardwareError
from teraio.profiling.op_timing import profiling_split

from .fake_cuda import FWD_S, SCRATCH_NBYTES, LateModel, batch
from .loops import CASES, GPTLoss, assert_bit_identical, loop_backend, run


def test_backend_is_a_function_before_and_after_the_lifecycle_module_loads() -> None:
    code = (
        "import teraio; b = teraio.backend(memory_budget='50%'); print(type(b).__name__);"
        "import torch; torch.compile(torch.nn.Linear(2, 2), backend='teraio');"
        "import teraio.lifecycle.backend; print(type(teraio.backend(memory_budget='50%')).__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["TeraioBackend", "TeraioBackend"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "reduce-overhead"}, "CUDA graphs"),
        ({"options": {"triton.cudagraphs": True}}, "CUDA graphs"),
    ],
)
def test_cuda_graph_modes_are_refused_in_one_line(kwargs, match) -> None:
    torch._dynamo.reset()
    be = TeraioBackend(inner="eager")
    compiled = torch.compile(torch.nn.Linear(4, 4), backend=be, **kwargs)
    with pytest.raises(Exception, match=match) as info:
        compiled(torch.randn(2, 4))
    # Dynamo wraps a backend's error (BackendCompilerFailed); ours is the cause, one line.
    cause = getattr(info.value, "inner_exception", info.value)
    assert isinstance(cause, UserInputError)
    assert len(str(cause).splitlines()) == 1 and "default mode" in str(cause)


def test_inductors_global_cuda_graphs_are_refused_with_inductor() -> None:
    """``torch._inductor.config.triton.cudagraphs = True`` set by the program, not passed to
    torch.compile: Inductor would still capture the graph (the migration ops with it)."""
    torch._dynamo.reset()
    with torch._inductor.config.patch({"triton.cudagraphs": True}):
        assert check_compile_mode(None, None, "eager") == {}  # the FX-only path never uses Inductor
        compiled = torch.compile(torch.nn.Linear(4, 4), backend=TeraioBackend(inner="inductor"))
        with pytest.raises(Exception, match="triton.cudagraphs") as info:
            compiled(torch.randn(2, 4))
    cause = getattr(info.value, "inner_exception", info.value)
    assert isinstance(cause, UserInputError) and len(str(cause).splitlines()) == 1


def _inductor_config_seen(monkeypatch) -> list[dict]:
    """Replace Inductor's compile_fx by a stand-in that notes the config it is called under and returns
    the graph to run as it is (no code generation: the test is about what reaches Inductor)."""
    from torch._inductor import compile_fx as compile_fx_module
    from torch._inductor import config as inductor_config

    seen: list[dict] = []

    def compile_fx(gm, example_inputs, **kwargs):
        keys = ("max_autotune", "coordinate_descent_tuning", "reorder_for_peak_memory", "triton.cudagraphs")
        seen.append({k: inductor_config.get_config_copy()[k] for k in keys})
        return gm

    monkeypatch.setattr(compile_fx_module, "compile_fx", compile_fx)
    return seen


def test_a_mode_without_cuda_graphs_reaches_inductor_in_every_compile(monkeypatch) -> None:
    """torch.compile hands a custom backend its mode but applies it only to its own Inductor backend:
    the mode the refusal recommends must reach Inductor's config, for the profiling compile and the
    final one, with teraio's own option kept (Note: [Inductor keeps the profiled order])."""
    seen = _inductor_config_seen(monkeypatch)
    torch._dynamo.reset()
    be = TeraioBackend(inner="inductor")
    model = torch.nn.Linear(4, 4)
    compiled = torch.compile(model, backend=be, mode="max-autotune-no-cudagraphs")
    x = torch.randn(2, 4)
    assert torch.equal(compiled(x), model(x))
    (runner,) = be.runners
    runner.compile_final()
    expected = {
        "max_autotune": True,
        "coordinate_descent_tuning": True,
        "reorder_for_peak_memory": False,
        "triton.cudagraphs": False,
    }
    assert seen == [expected, expected]


def test_explicit_options_override_mode_and_teraios_defaults(monkeypatch) -> None:
    seen = _inductor_config_seen(monkeypatch)
    torch._dynamo.reset()
    be = TeraioBackend(inner="inductor")
    compiled = torch.compile(
        torch.nn.Linear(4, 4), backend=be, options={"reorder_for_peak_memory": True, "max_autotune": True}
    )
    compiled(torch.randn(2, 4))
    assert seen[0]["reorder_for_peak_memory"] is True and seen[0]["max_autotune"] is True
    # A mode that asked Inductor to reorder would not undo teraio's order; only an explicit option does.
    with monkeypatch.context() as m:
        m.setattr(
            torch._inductor, "list_mode_options", lambda mode: {"reorder_for_peak_memory": True, "x": 1}
        )
        assert check_compile_mode("some-mode", None, "inductor") == {"x": 1}
    with pytest.raises(UserInputError, match="mode='fastest'"):
        check_compile_mode("fastest", None, "inductor")


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"inner": "tvm"}, "inner must be one of"),
        ({"tiers": ["floppy"]}, "tiers must be one of"),
        ({"profiling": lambda: teraio.Profiling(steps=0)}, "Profiling.steps"),
        ({"on_plan_mismatch": "ignore"}, "on_plan_mismatch"),
    ],
)
def test_bad_options_name_what_is_wrong(options, match) -> None:
    with pytest.raises(UserInputError, match=match):  # an option object is refused when it is built
        teraio.backend(**{k: v() if callable(v) else v for k, v in options.items()})


def test_profile_only_default_says_how_to_offload_once(caplog) -> None:
    caplog.set_level(logging.INFO, logger="teraio")
    be = TeraioBackend(inner="eager", profiling=teraio.Profiling(steps=1))
    run(CASES["gpt"], "plain", be, 3)
    told = [r.getMessage() for r in caplog.records if "no memory_budget was set" in r.getMessage()]
    assert len(told) == 1 and "teraio.backend(memory_budget=" in told[0]
    assert any("profiling graph 0" in r.getMessage() for r in caplog.records)


def test_shapes_beyond_max_shapes_run_unplanned_and_exact(caplog, tmp_path) -> None:
    caplog.set_level(logging.INFO, logger="teraio")
    case = CASES["gpt"]
    kw = {
        "inner": "eager",
        "profiling": teraio.Profiling(steps=1, max_shapes=2),
        "solver": "greedy",
        "memory_budget": "50%",
    }
    ref = TeraioBackend(**{**kw, "enabled": False})
    try:
        expected = run(case, "changing-shapes", ref, 9)
    finally:
        ref.close()
    be = TeraioBackend(**kw, offload_dirs=[str(tmp_path)])
    try:
        got = run(case, "changing-shapes", be, 9)
        assert_bit_identical(got, expected)
        planned = [r for r in be.runners if r.plan is not None and r.plan.decisions]
        assert len(planned) >= 2
        assert any("max_shapes=2" in r.getMessage() for r in caplog.records)
        # The first shape's static graph, then at most max_shapes per-shape graphs of the dynamic one.
        assert len([r for r in be.runners if r.is_training]) <= 1 + 2
    finally:
        be.close()


def test_measurement_is_silent_and_changes_no_bit(capfd, tmp_path) -> None:
    """The backend's own measured step runs under the torch profiler: same bits, no profiler noise."""
    kw = {"inner": "eager", "solver": "greedy", "memory_budget": "50%"}
    quiet = TeraioBackend(
        **kw, profiling=teraio.Profiling(steps=1, measure_memory=False), offload_dirs=[str(tmp_path / "a")]
    )
    measured = TeraioBackend(
        **kw, profiling=teraio.Profiling(steps=1, measure_memory=True), offload_dirs=[str(tmp_path / "b")]
    )
    try:
        a = run(CASES["gpt"], "plain", quiet, 6)
        b = run(CASES["gpt"], "plain", measured, 6)
        assert_bit_identical(a, b)
        st = measured.stats()
        assert st["measured_peak_bytes"] is not None
        assert st["measured_peak_bytes"] <= 1.05 * measured.runners[0].step_budget_bytes
    finally:
        quiet.close()
        measured.close()
    err = capfd.readouterr().err
    for noise in ("USDT", "Memory block of unknown size", "disableProfiler"):
        assert noise not in err


@pytest.mark.parametrize("recompute", [None, "only"])
def test_the_fx_path_traces_a_planned_graph_once(monkeypatch, tmp_path, recompute) -> None:
    """Note: [One trace per graph on the FX path] in teraio.graph.compilers: the plan (offloads, or
    rebuilds) goes into the graphs the profiling compile partitioned; the run is the same
    bit for bit as the graph compiled without migration."""
    import teraio.graph.compilers as compilers

    partitions: list[int] = []
    partition = compilers._partition_base

    def counted(*args, **kwargs):
        partitions.append(1)
        return partition(*args, **kwargs)

    monkeypatch.setattr(compilers, "_partition_base", counted)
    solver = {"solver": "pipeline"} if recompute else {}
    planned = loop_backend(
        True,
        "eager",
        "80%" if recompute else "60%",
        recompute=recompute,
        offload_dirs=[str(tmp_path)],
        **solver,
    )
    reference = loop_backend(False, "eager")
    try:
        a = run(CASES["gpt"], "plain", planned, 6)
        assert len(partitions) == 1, "the plan's compile traced the joint graph again"
        (runner,) = planned.runners
        assert runner.phase is Phase.RUNNING and runner.plan is not None and runner.plan.decisions
        assert runner.rewrite is not None and runner.rewrite.moved_groups == len(runner.plan.decisions)
        if recompute:
            assert runner.plan.recomputes
        assert planned.stats()["moved_bytes_per_step"] > 0 or recompute
        b = run(CASES["gpt"], "plain", reference, 6)
        assert_bit_identical(a, b)
    finally:
        planned.close()
        reference.close()


def test_device_of_a_graph_is_its_accelerator_even_after_a_leading_cpu_tensor() -> None:
    """A CPU index or scalar tensor first among a CUDA graph's inputs does not make it a "cpu" graph
    (the profile, step times and peak recorder follow this device)."""
    with FakeTensorMode():
        index = torch.empty(3, dtype=torch.long)
        weight = torch.empty(4, 4, device="cuda:1")
    assert _device_of([index, 2, weight]) == "cuda:1"
    assert _device_of([index]) == "cpu" and _device_of([2]) == "cpu" and _device_of([]) == "cpu"


def test_cuda_step_times_and_peak_are_the_devices_and_exclude_the_optimizer(fake_cuda) -> None:
    """On CUDA a step's time is what the compute stream spent on it (events at the step's start and end,
    read once they completed), and its measured peak is read when the step ends: device memory the
    optimizer step allocates afterwards, before the next forward, is not the step's."""
    be = TeraioBackend(inner="eager", profiling=teraio.Profiling(steps=2), enabled=False)
    compiled = torch.compile(LateModel(), backend=be)
    optimizer_state = []
    for _ in range(6):  # two profiling steps, then running steps (the first compiles before it starts)
        compiled(batch()).backward()
        optimizer_state.append(fake_cuda.empty(1 << 16, None))  # the optimizer step's device memory
    st = be.stats()
    assert st["running_steps"] == 4
    assert be.step_times_s == [3 * FWD_S] * 4  # the kernels' virtual seconds, forward and backward
    assert st["measured_peak_bytes"] == SCRATCH_NBYTES  # the step's own workspace; no optimizer state


def test_stats_count_steps_not_graph_calls(tmp_path) -> None:
    """Two graphs (a graph break): one step each iteration, bytes moved summed over the step's calls."""
    be = TeraioBackend(
        inner="eager",
        profiling=teraio.Profiling(steps=1),
        solver="greedy",
        memory_budget="70%",
        offload_dirs=[str(tmp_path)],
    )
    try:
        run(CASES["gpt-graph-break"], "plain", be, 5)
        st = be.stats()
        assert st["steps"] == 5
        assert st["graphs"] >= 2 and len(st["per_graph"]) == st["graphs"]
        # Dynamo recompiles the second graph once (it specialises on the printed float first): the
        # graphs of a step are the two called every step, not every graph ever compiled.
        every_step = [g for g in st["per_graph"] if g["invocations"] >= 3]
        assert len(every_step) == 2
        assert st["moved_bytes_per_step"] == sum(g["moved_bytes_per_invocation"] for g in every_step) > 0
        # step_s: only steps where every graph ran its final compilation (no compile time inside).
        assert st["running_steps"] >= 1 and st["step_s"] is not None
    finally:
        be.close()


def test_forward_only_graph_stops_being_profiled() -> None:
    """A loss computed with grad enabled on every call and never backpropagated."""
    be = TeraioBackend(inner="eager", profiling=teraio.Profiling(steps=2))
    torch._dynamo.reset()
    model = GPTLoss()
    compiled = torch.compile(model, backend=be)
    batch = CASES["gpt"].batch(0, 32)
    for _ in range(8):
        compiled(*batch)
    (runner,) = be.runners
    assert runner.phase is Phase.RUNNING and runner.profile is None


@pytest.mark.parametrize("hold_mib", [0, 4])
def test_memory_outside_the_graphs_is_reported(hold_mib: int, caplog, tmp_path) -> None:
    """A loop that keeps its own tensors through backward (or code torch.compile runs eagerly) uses memory
    no plan can see: the measured step says so, and stays silent when the plan accounts for everything."""
    caplog.set_level(logging.INFO, logger="teraio")
    torch._dynamo.reset()
    model = GPTLoss()
    case = CASES["gpt"]
    be = TeraioBackend(
        inner="eager",
        profiling=teraio.Profiling(steps=1),
        solver="greedy",
        memory_budget="60%",
        offload_dirs=[str(tmp_path)],
    )
    compiled = torch.compile(model, backend=be)
    try:
        for step in range(5):
            loss = compiled(*case.batch(step, case.sizes[0]))
            held = torch.ones(hold_mib * (1 << 18))  # hold_mib MiB of float32, alive through backward
            loss.backward()
            del held
        be.stats()  # finishes the measurement
        assert be.measured_peak_bytes is not None
        warned = [r for r in caplog.records if "above the predicted" in r.getMessage()]
        warned += [
            r for r in caplog.records if "outside teraio" in r.getMessage() and r.levelno >= logging.WARNING
        ]
        assert bool(warned) == bool(hold_mib), [r.getMessage() for r in warned]
    finally:
        be.close()


@pytest.mark.parametrize(
    ("profile_steps", "split"), [(1, (1, 0)), (2, (2, 0)), (3, (2, 1)), (5, (2, 3)), (6, (2, 4))]
)
def test_profile_steps_split_into_op_timed_and_calibration_steps(profile_steps, split) -> None:
    assert profiling_split(profile_steps) == split


def test_op_times_are_calibrated_on_the_median_of_every_calibration_step(monkeypatch) -> None:
    """profile_steps=5: the census step and one step timed op by op, then three uninstrumented steps
    whose median forward and backward wall times set the profile's totals (Note: [Calibrated times])."""
    be = TeraioBackend(inner="eager", profiling=teraio.Profiling(steps=5), enabled=False)
    walls: list[float] = []
    real = profiler_module._run_uninstrumented

    def recorded(gm, args_list, device, kernels=None):
        out, wall_s = real(gm, args_list, device, kernels)
        walls.append(wall_s)
        return out, wall_s

    monkeypatch.setattr(profiler_module, "_run_uninstrumented", recorded)
    try:
        run(CASES["gpt"], "plain", be, 6)
        (runner,) = [r for r in be.runners if r.is_training]
        assert runner.phase is Phase.RUNNING
        meta = runner.profile.meta
    finally:
        be.close()
    # Five profiling steps: the census, one timed op by op, three calibrating.
    assert meta["calibrated"] and meta["calibration_steps"] == 3 and meta["measured_steps"] == 1
    assert meta["profile_steps"] == 2
    fwd, bwd = walls[0::2], walls[1::2]
    assert len(fwd) == len(bwd) == 3
    assert meta["fwd_s"] == statistics.median(fwd) and meta["bwd_s"] == statistics.median(bwd)
    assert meta["calibration_step_s"] == [f + b for f, b in zip(fwd, bwd)]
    # Each phase's op durations are scaled down to its calibrated total (never up: instrumenting only
    # adds time, so a scale of 1 means the interpreted ops already summed to less).
    ops = runner.profile.ops
    n_fwd = runner.profile.num_fwd_ops
    for phase, total_us, wall_s in (
        ("fwd", float(ops["duration_us"][:n_fwd].sum()), meta["fwd_s"]),
        ("bwd", float(ops["duration_us"][n_fwd:].sum()), meta["bwd_s"]),
    ):
        scale = meta[f"calibration_scale_{phase}"]
        assert 0 < scale <= 1.0
        if scale < 1.0:
            assert total_us == pytest.approx(wall_s * 1e6, rel=1e-9)
        else:
            assert total_us <= wall_s * 1e6


def test_a_bad_hardware_file_is_refused_when_the_backend_is_made(tmp_path) -> None:
    with pytest.raises(HardwareError, match="does not exist"):
        TeraioBackend(hardware=str(tmp_path / "missing.json"))


def test_hardware_calibrate_times_the_offload_directory_once_and_plans_with_it(monkeypatch, tmp_path) -> None:
    """``hardware="calibrate"``: before the first plan the backend times the runtime engine on the
    directory offloads go to, plans with those figures, and writes them into the run directory; the
    timing draws nothing from torch's global RNG, so a model with dropout still trains bit-identically."""
    calls: list[str] = []
    real = teraio.profiling.disk_calibration.calibrate

    def counted(directory, **kw):
        calls.append(str(directory))
        return real(directory, **{**kw, "nbytes": 1 << 20, "block_nbytes": 1 << 20})

    monkeypatch.setattr(teraio.profiling.disk_calibration, "calibrate", counted)
    offload = tmp_path / "offload"
    offload.mkdir()
    be = TeraioBackend(
        inner="eager",
        profiling=teraio.Profiling(steps=1, measure_memory=False),
        solver="greedy",
        memory_budget="60%",
        hardware="calibrate",
        offload_dirs=[str(offload)],
        run_dir=str(tmp_path / "run"),
    )
    try:
        calibrated = run(CASES["gpt"], "plain", be, 4)
        (runner,) = [r for r in be.runners if r.is_training]
        hw = runner.plan.hardware
    finally:
        be.close()
    assert runner.plan.decisions
    off = TeraioBackend(
        inner="eager", profiling=teraio.Profiling(steps=1, measure_memory=False), enabled=False
    )
    assert_bit_identical(calibrated, run(CASES["gpt"], "plain", off, 4))
    assert calls == [str(offload)]
    assert hw.name == f"calibrated:{offload}"
    saved = json.loads((tmp_path / "run" / "hardware.json").read_text())
    assert saved["name"] == hw.name
    assert saved["tiers"]["ssd"]["write_latency_s"] == hw.tiers["ssd"].write_latency_s > 0
    assert not [p for p in offload.iterdir() if p.name.startswith(".teraio-calibrate-")]


def test_a_quick_calibration_is_reused_by_later_backends_of_the_process(monkeypatch, tmp_path) -> None:
    """Note: [One quick calibration per directory and process]: the same directory and checksum setting
    within ``QUICK_REUSE_S`` are timed once; another setting, another directory or an older calibration
    are timed again."""
    calls: list[tuple[str, bool]] = []

    def counted(directory, **kw):  # the reuse, not the timing, is under test: a stand-in result
        calls.append((str(directory), kw["checksum"]))
        return object()

    monkeypatch.setattr(teraio.profiling.disk_calibration, "calibrate", counted)
    monkeypatch.setattr(teraio.profiling.disk_calibration, "_quick", {})
    quick = teraio.profiling.disk_calibration.quick_calibration
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    first, age = quick(a, checksum=True)
    assert age is None
    again, age = quick(str(a) + "/.", checksum=True)  # the same directory, spelled differently
    assert again is first and age is not None and age >= 0
    quick(a, checksum=False)
    quick(b, checksum=True)
    assert calls == [(str(a), True), (str(a), False), (str(b), True)]
    monkeypatch.setattr(teraio.profiling.disk_calibration, "QUICK_REUSE_S", 0.0)
    assert quick(a, checksum=True)[1] is None
    assert len(calls) == 4


def _phases_by_step(enabled: bool, tmp_path) -> list[tuple[str, ...]]:
    """The tiny GPT compiled per block (``backend.compile``), 50% of its step: each runner's phase after
    every step."""
    from teraio.tools.workloads import builtin_workload

    torch._dynamo.reset()
    work = builtin_workload("tiny")
    be = teraio.backend(
        memory_budget="50%",
        enabled=enabled,
        inner="eager",
        solver="greedy",
        profiling=teraio.Profiling(steps=2, measure_memory=False),
        offload_dirs=[str(tmp_path / str(enabled))],
    )
    phases = []
    try:
        model = be.compile(work.model)
        for step in range(6):
            model(*work.batch_at(step)).backward()
            phases.append(tuple(r.phase.value for r in be.runners))
    finally:
        be.close()
    return phases


def test_the_reference_run_waits_for_the_steps_profiles_as_the_planned_run_does(tmp_path) -> None:
    """Note: [The step is planned once every graph it calls is profiled] in teraio.lifecycle.step_planner:
    a graph waiting to be planned still runs its profiling code (on Inductor: the graph op by op, not its
    kernels). ``enabled=False`` is the reference of the run with a plan, so it waits too: had it compiled at
    once, the two would have computed different bits in those steps (found with DDP's graph splitting on
    Inductor)."""
    planned = _phases_by_step(True, tmp_path)
    reference = _phases_by_step(False, tmp_path)
    waited = [p for p in planned if "planning" in p and "profiling" in p]
    assert waited, planned  # the block graph finished profiling first and waited: the check is not vacuous
    assert reference == planned


def test_the_graph_after_a_graph_break_on_inductor_is_measured_and_planned(tmp_path) -> None:
    """Note: [A graph that is never the step's first measures inside the step] in
    teraio.lifecycle.runner_profiling: the graph after the break is never the step's first forward; it
    stayed profiling for ever (and the first graph, which never runs alone to its backward, was planned
    alone at the end of its wait). (Its measurement still falls back to the census here: not yet read why.)"""
    be = loop_backend(True, "inductor", "70%", offload_dirs=[str(tmp_path)])
    try:
        run(CASES["gpt-graph-break"], "plain", be, 12)
        st = be.stats()
    finally:
        be.close()
    called = [g for g in st["per_graph"] if g["invocations"] >= 6]  # Dynamo replaced one graph once
    assert len(called) == 2, st["per_graph"]
    assert all(g["phase"] == "running" for g in called), st["per_graph"]
    assert st["running_steps"] >= 1, st
