"""The backend writes only what it owns: a planted stats.jsonl link is not followed, a run_dir that is
not teraio's is refused before anything is written, and a plan that does not fit its graph is refused
before the runtime allocates a byte."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import teraio
from teraio.config import BackendConfig
from teraio.errors import UserInputError
from teraio.graph.rewrite import PlanMismatchError
from teraio.lifecycle.run_dir import RUN_DIR_CONFIG_KEYS, is_teraio_run_dir
from teraio.planner.plan import Plan
from teraio.tools.workloads import builtin_workload, call_model
from tests.planner.planner_cases import pyramid
from tests.teraio.cli_helpers import error_line, tree

from .training import train

#: The options the brief's scenario uses: a few fast steps of the tiny model on the FX-only path.
FAST = {
    "memory_budget": "70%",
    "inner": "eager",
    "solver": "greedy",
    "io_backend": "posix",
    # No profiler-measured step: faster, and not what these tests are about.
    "profiling": teraio.Profiling(steps=1, measure_memory=False),
}


def _one_line(exc: BaseException) -> str:
    msg = str(exc)
    assert len(msg.splitlines()) == 1, msg
    return msg


# --------------------------------------------------------------------------------------- stats.jsonl
def test_stats_log_never_follows_a_link_planted_in_the_run_dir(tmp_path, caplog) -> None:
    """stats.jsonl was opened with open(..., "a"): a link planted in a shared run_dir was appended to. A
    run_dir others can write is now refused (below); the link is planted here by the same user."""
    caplog.set_level(logging.WARNING, logger="teraio")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    run_dir = tmp_path / "run"
    be = teraio.backend(**FAST, run_dir=str(run_dir), offload_dirs=[str(tmp_path)])
    (run_dir / "stats.jsonl").symlink_to(victim)  # planted after the run started
    try:
        train(builtin_workload("tiny"), be, 3)  # profile, plan and compile, then one running step
    finally:
        be.close()
    assert be.step_times_s, "no running step ended: the stats log was never written"
    assert victim.read_text() == "precious\n"
    assert (run_dir / "stats.jsonl").is_symlink()
    warned = [r.getMessage() for r in caplog.records if "stats" in r.getMessage()]
    assert len(warned) == 1 and "stats.jsonl" in warned[0], warned  # said once, training went on
    assert be.run_dir_error is not None and be.run_dir_error.path == str(run_dir / "stats.jsonl")


# ------------------------------------------------------------------------------------------ run_dir
@pytest.mark.parametrize(
    "files",
    [
        {"config.json": '{"lr": 0.1, "epochs": 3}\n'},  # another program's config.json
        {"notes.txt": "mine\n"},
        {"config.json": "[1, 2]\n", "graph0.txt": "x"},
        {"stats.jsonl": '{"step": 1}\n'},  # teraio's name, but nothing proves it is teraio's
    ],
)
def test_run_dir_that_is_not_teraios_is_refused_before_anything_is_written(tmp_path, files) -> None:
    """The backend wrote config.json with overwrite=True into any run_dir: a foreign one was replaced."""
    run_dir = tmp_path / "project"
    run_dir.mkdir()
    for name, text in files.items():
        (run_dir / name).write_text(text)
    before = tree(tmp_path)
    with pytest.raises(UserInputError) as info:
        teraio.backend(**FAST, run_dir=str(run_dir))
    msg = _one_line(info.value)
    assert str(run_dir) in msg and "empty or new directory" in msg
    assert tree(tmp_path) == before


def test_run_dir_that_is_a_file_is_refused(tmp_path) -> None:
    f = tmp_path / "run"
    f.write_text("x")
    with pytest.raises(UserInputError, match="not a directory"):
        teraio.backend(**FAST, run_dir=str(f))
    assert f.read_text() == "x"


def test_new_empty_and_teraio_run_dirs_are_used(tmp_path) -> None:
    new = tmp_path / "a" / "new"
    teraio.backend(**FAST, run_dir=str(new))
    assert is_teraio_run_dir(new)
    (tmp_path / "empty").mkdir()
    teraio.backend(**FAST, run_dir=str(tmp_path / "empty"))
    # A run directory teraio wrote is reused, with the user's own notes beside teraio's files.
    (new / "notes.txt").write_text("mine")
    be = teraio.backend(**{**FAST, "solver": "ilp"}, run_dir=str(new))
    assert json.loads((new / "config.json").read_text())["solver"]["name"] == "ilp"
    assert (new / "notes.txt").read_text() == "mine" and be.run_dir == new
    # A run directory whose config.json is gone: graphN/ with a teraio profile and stats.jsonl.
    old = tmp_path / "old"
    pyramid().save(old / "graph0" / "profile")
    (old / "stats.jsonl").write_text("{}\n")
    teraio.backend(**FAST, run_dir=str(old))
    assert is_teraio_run_dir(old) and (old / "config.json").exists()


def test_graph_dirs_without_a_teraio_profile_are_not_a_run_dir(tmp_path) -> None:
    d = tmp_path / "graphs"
    (d / "graph0").mkdir(parents=True)
    (d / "graph0" / "plan.json").write_text("{}")  # teraio's names only: nothing proves it is teraio's
    assert not is_teraio_run_dir(d)
    pyramid().save(d / "graph1" / "profile")
    (d / "graph1" / "data.csv").write_text("a,b\n")  # a file teraio never writes there
    assert not is_teraio_run_dir(d)
    (d / "graph1" / "data.csv").unlink()
    assert is_teraio_run_dir(d)


def test_run_dir_config_keys_are_backend_options() -> None:
    fields = {f.name for f in dataclasses.fields(BackendConfig)}
    assert set(RUN_DIR_CONFIG_KEYS) <= fields


def test_demo_refuses_a_foreign_run_dir_before_training(capsys, tmp_path) -> None:
    """The demo's backend writes RUN_DIR/teraio: a foreign one failed only after the first method ran."""
    (tmp_path / "run" / "teraio").mkdir(parents=True)
    (tmp_path / "run" / "teraio" / "config.json").write_text('{"theme": "dark"}')
    before = tree(tmp_path)
    line = error_line(capsys, "demo", "--model", "tiny", "--steps", "1", "--run-dir", tmp_path / "run")
    assert "--run-dir" in line and str(tmp_path / "run" / "teraio") in line
    assert tree(tmp_path) == before


# ------------------------------------------------------------------------------------------- plans
def test_a_tampered_plan_is_refused_before_any_byte_is_allocated(tmp_path) -> None:
    workload = builtin_workload("tiny")
    run_dir = tmp_path / "run"
    first = teraio.backend(**FAST, run_dir=str(run_dir), offload_dirs=[str(tmp_path / "off0")])
    try:
        train(workload, first, 2)  # the plan is saved when the second step starts
    finally:
        first.close()
    plan_file = run_dir / "graph0" / "plan.json"
    plan = json.loads(plan_file.read_text())
    assert plan["decisions"], "the plan moves nothing: the test would prove nothing"
    # A decision's size is wrong; the file stays self-consistent (moved_bytes agrees), so only the
    # check against the captured graph can catch it.
    plan["decisions"][0]["nbytes"] += 1 << 20
    plan["moved_bytes"] += 1 << 20
    plan_file.write_text(json.dumps(plan))
    Plan.load(plan_file)  # a well-formed plan file
    offload = tmp_path / "off"
    offload.mkdir()
    be = teraio.backend(inner="eager", plan=str(run_dir), io_backend="posix", offload_dirs=[str(offload)])
    try:
        torch._dynamo.reset()
        compiled = torch.compile(workload.model, backend=be)
        name = plan["decisions"][0]["name"]
        with pytest.raises(PlanMismatchError, match=f"decision for '{name}' says .* bytes") as info:
            call_model(compiled, workload.batch_at(0))  # the first call compiles with the plan
        _one_line(info.value)
        assert be.engine is None, "the runtime started (and reserved space) for a plan that does not fit"
    finally:
        be.close()
    assert list(offload.rglob("*")) == [], "an offload file or directory was created"


# ------------------------------------------------------------------------ finalizers take no lock
REPO = Path(__file__).resolve().parents[2]


def _python(code: str, *args: str, timeout_s: float) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter; a hang fails the test after ``timeout_s`` instead of blocking it."""
    try:
        return subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code), *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-2000:] if isinstance(e.stderr, bytes) else (e.stderr or "")[-2000:]
        raise AssertionError(f"hung (killed after {timeout_s:.0f} s): {tail}") from None


#: Forces a full garbage collection inside the runtime's allocation (``OffloadDir._lock`` held) and, with
#: "tracker", inside the step tracker's lock: wherever a finalizer could meet a lock its thread holds.
_GC_HOOKS = """
import gc
from teraio.lifecycle import steps
from teraio.runtime import space

gc.disable()  # the forced collections are the only ones: the same places every run
FORCED = [0]

def collecting(fn):
    def wrapper(*args, **kwargs):
        FORCED[0] += 1
        gc.collect()
        return fn(*args, **kwargs)
    return wrapper

def install(which):
    if "allocate" in which:
        space.ExtentAllocator.allocate = collecting(space.ExtentAllocator.allocate)  # OffloadDir._lock held
    if "tracker" in which:
        steps.Invocation.__init__ = collecting(steps.Invocation.__init__)  # the tracker's lock held
"""

_TOKENS_IN_CYCLES = (
    _GC_HOOKS
    + """
import json, sys, tempfile, torch
import teraio.graph.ops as ops
from teraio.runtime import Engine, RuntimeConfig

install("allocate")
eng = Engine(RuntimeConfig(dirs=[sys.argv[1]], backend="posix"))
eid = ops.register_engine(eng)
for i in range(6):
    x = torch.full((1024,), float(i))
    h = torch.ops.teraio.offload(x, [], f"k{i}", eid, [1])
    tok = torch.ops.teraio.wait_write(h, x, [], f"k{i}", eid)
    cycle = [tok]
    cycle.append(cycle)  # only the cyclic collector frees the token: at the next allocation
    del tok, cycle, h, x
gc.collect()
print(json.dumps({"keys": eng.keys(), "used": eng._dirs[0].allocator.used_nbytes, "forced": FORCED[0]}))
ops.unregister_engine(eid)
eng.close()
"""
)


def test_a_token_freed_by_the_collector_inside_an_allocation_does_not_hang(tmp_path) -> None:
    """The token finalizer called Engine.drop -> OffloadDir.free while its own thread held
    OffloadDir._lock inside allocate: a hang forever. Every allocation here runs the cyclic collector,
    which frees the previous key's token."""
    done = _python(_TOKENS_IN_CYCLES, str(tmp_path / "off"), timeout_s=120)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["forced"] >= 6
    assert out["keys"] == [] and out["used"] == 0, out  # every key dropped, its space given back
    assert list((tmp_path / "off").iterdir()) == []


_FAILED_STEPS = (
    _GC_HOOKS
    + """
import copy, json, sys, torch
import teraio
from teraio.tools.workloads import builtin_workload, compute_loss

install(sys.argv[2])
torch.manual_seed(0)
workload = builtin_workload("tiny")
be = teraio.backend(
    memory_budget="70%", inner="eager", solver="greedy", io_backend="posix",
    profiling=teraio.Profiling(steps=1, measure_memory=False), offload_dirs=[sys.argv[1]],
)
model = copy.deepcopy(workload.model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
compiled = torch.compile(model, backend=be)
for step in range(8):
    opt.zero_grad(set_to_none=True)
    loss = compute_loss(compiled, workload, step)
    if step % 2:
        # A failed step (as after a ChecksumError): its autograd graph, with the saved tokens, is held
        # by a reference cycle, so only the collector frees it, at the next step's allocations.
        cycle = {"loss": loss}
        cycle["self"] = cycle
        del cycle, loss
        continue
    loss.backward()
    opt.step()
gc.collect()
engine = be.engine
print(json.dumps({
    "moved": be.stats()["offloaded_bytes"], "keys": engine.keys() if engine else None, "forced": FORCED[0],
}))
be.close()
"""
)


@pytest.mark.parametrize("hooks", ["allocate", "tracker"])
def test_training_with_failed_steps_and_the_collector_at_every_allocation(tmp_path, hooks) -> None:
    """The issue's hang, end to end: a failed step's graph is freed by the collector while the next step
    holds a lock (the allocator's, or the step tracker's when it registers an invocation). The run
    must finish, every key dropped and every file removed."""
    done = _python(_FAILED_STEPS, str(tmp_path / "off"), hooks, timeout_s=240)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["moved"] > 0 and out["forced"] > 0, out  # offloads ran, and so did the forced collections
    assert out["keys"] == [], out
    assert list((tmp_path / "off").iterdir()) == []


_ENDS_MID_MEASUREMENT = """
import sys
import torch
import teraio
from tests.teraio.loops import GPTLoss, _tokens

model = GPTLoss()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
backend = teraio.backend(offload_dirs=[sys.argv[1]])
for block in model.gpt.blocks:  # one graph, called twice a step: its kernels' memory is measured over calls
    block.compile(backend=backend)
make = _tokens(64, 2)
for step in range(2):
    model(*make(step, 32)).backward()
    opt.step()
    opt.zero_grad()
print("trained", flush=True)
"""


def test_a_script_that_ends_inside_a_measurement_exits_cleanly(tmp_path) -> None:
    """Two steps and no close(): the script ended inside the torch profiler session of a measurement that
    spans calls (the kernels' memory of a graph called twice a step), which torch then destroyed after the
    interpreter, with SIGSEGV (Note: [A session still open at exit is
    ended] in teraio.profiling.measure)."""
    done = _python(_ENDS_MID_MEASUREMENT, str(tmp_path / "off"), timeout_s=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    assert done.stdout.strip().endswith("trained")


# ------------------------------------------------------------------ run directories like offload dirs
@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_a_run_dir_others_can_write_is_refused(tmp_path, mode) -> None:
    """An empty 0777 run_dir was used: anyone could plant graph0 -> a directory of the victim's once
    config.json appeared. (Unlike an offload base, the sticky bit is no excuse: teraio writes fixed names
    straight into a run directory.)"""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run_dir.chmod(mode)
    with pytest.raises(UserInputError) as info:
        teraio.backend(**FAST, run_dir=str(run_dir))
    msg = _one_line(info.value)
    assert str(run_dir) in msg and "writable by other users" in msg
    assert list(run_dir.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create a directory owned by another user")
def test_a_run_dir_of_another_user_is_refused(tmp_path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o755)
    os.chown(run_dir, 4242, 4242)
    with pytest.raises(UserInputError, match="belongs to uid 4242"):
        teraio.backend(**FAST, run_dir=str(run_dir))
    assert list(run_dir.iterdir()) == []


def test_a_new_run_dir_is_private_whatever_the_umask(tmp_path) -> None:
    """Under umask 000 teraio itself created the run directory 0777 (and its missing parents)."""
    run_dir = tmp_path / "a" / "b" / "run"
    old = os.umask(0)
    try:
        teraio.backend(**FAST, run_dir=str(run_dir))
    finally:
        os.umask(old)
    for d in (tmp_path / "a", tmp_path / "a" / "b", run_dir):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
    assert stat.S_IMODE(os.stat(run_dir / "config.json").st_mode) == 0o600


def test_a_link_planted_in_the_run_dir_is_never_followed(tmp_path, caplog) -> None:
    """The issue's attack: once config.json appears, graph0 -> a directory of the victim is planted; the
    victim then overwrote its own plan.json and trace.json there, their mode widened from 0600 to 0644.
    (Planted by the same user here: a run directory others can write is refused, see above.)"""
    caplog.set_level(logging.WARNING, logger="teraio")
    victim = tmp_path / "victim"
    victim.mkdir()
    for name in ("plan.json", "trace.json"):
        (victim / name).write_text(f"the victim's {name}\n")
        (victim / name).chmod(0o600)
    before = tree(victim)
    run_dir = tmp_path / "run"
    be = teraio.backend(**FAST, run_dir=str(run_dir), offload_dirs=[str(tmp_path / "off")])
    assert (run_dir / "config.json").exists()
    (run_dir / "graph0").symlink_to(victim)  # planted once config.json appeared
    try:
        train(builtin_workload("tiny"), be, 3)  # the plan is made and saved at the second step
    finally:
        be.close()
    assert be.step_times_s, "training did not go on"
    assert tree(victim) == before
    for name in ("plan.json", "trace.json"):
        assert (victim / name).read_text() == f"the victim's {name}\n"
        assert stat.S_IMODE((victim / name).stat().st_mode) == 0o600
    assert (run_dir / "graph0").is_symlink()
    err = be.run_dir_error
    assert err is not None and err.path.startswith(str(run_dir / "graph0")), err
    warned = [r.getMessage() for r in caplog.records if "run directory" in r.getMessage()]
    assert len(warned) == 1 and "graph0" in warned[0] and "link" in warned[0], warned


def test_two_runs_sharing_a_run_dir_tell_their_stats_lines_apart(tmp_path) -> None:
    """Two runs in one run directory interleaved stats.jsonl lines with no run id."""
    run_dir = tmp_path / "run"
    backends = []
    for _ in range(2):
        be = teraio.backend(**FAST, run_dir=str(run_dir), offload_dirs=[str(tmp_path / "off")])
        try:
            train(builtin_workload("tiny"), be, 3)
        finally:
            be.close()
        backends.append(be)
    ids = [be.run_id for be in backends]
    assert len(set(ids)) == 2 and all(len(i) >= 16 for i in ids)
    lines = [json.loads(x) for x in (run_dir / "stats.jsonl").read_text().splitlines()]
    assert lines and {x["run_id"] for x in lines} == set(ids)
    assert json.loads((run_dir / "config.json").read_text())["run_id"] == ids[-1]


@pytest.fixture
def small_filesystem(tmp_path):
    """A 256 KiB tmpfs mounted in tmp_path (root only): a disk that fills up."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_run_dir_is_a_typed_error_warned_once_and_training_goes_on(small_filesystem, tmp_path, caplog):
    """ENOSPC on the run directory was a bare OSError naming no path, and the run finished with an empty
    graph0/ and no warning."""
    import errno

    caplog.set_level(logging.WARNING, logger="teraio")
    run_dir = small_filesystem / "run"
    be = teraio.backend(**FAST, run_dir=str(run_dir), offload_dirs=[str(tmp_path / "off")])
    with open(small_filesystem / "filler", "wb", buffering=0) as f:  # the disk fills up now
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 4096)
    try:
        train(builtin_workload("tiny"), be, 3)
    finally:
        be.close()
    assert be.step_times_s, "training did not go on"
    err = be.run_dir_error
    assert err is not None and err.errno == errno.ENOSPC, err
    assert err.path.startswith(str(run_dir / "graph0")) and "ENOSPC" in str(err) and "full" in str(err)
    assert sorted(os.listdir(run_dir)) == ["config.json"], "a graph0/ (or a part of it) was left behind"
    warned = [r.getMessage() for r in caplog.records if "run directory" in r.getMessage()]
    assert warned == [f"{err}; training goes on without writing to the run directory"], warned
