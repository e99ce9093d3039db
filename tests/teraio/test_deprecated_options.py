"""The flat options of earlier releases keep working for this release: each is folded into its object
(teraio.States, teraio.Solver, teraio.Profiling) with a DeprecationWarning naming the new spelling; an
unknown name, or a flat name mixed with its object, is refused. And config.json records the new shape."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import teraio
from teraio.config import DEPRECATED_OPTIONS, BackendConfig, make_config
from teraio.errors import UserInputError

MODEL = torch.nn.Linear(4, 4)
OPT = torch.optim.AdamW(MODEL.parameters())

#: Per deprecated name: the options that use it (with what it needs beside it), and where its value lands.
CASES = {
    "time_limit": ({"time_limit": 7.0}, lambda c: c.solver.time_limit, 7.0),
    "deterministic_time_limit": (
        {"deterministic_time_limit": 1.5},
        lambda c: c.solver.deterministic_time_limit,
        1.5,
    ),
    "solver_workers": ({"solver_workers": 1}, lambda c: c.solver.workers, 1),
    "recompute": ({"recompute": "only"}, lambda c: c.solver.recompute, "only"),
    "profile_steps": ({"profile_steps": 1}, lambda c: c.profiling.steps, 1),
    "measure_memory": ({"measure_memory": False}, lambda c: c.profiling.measure_memory, False),
    "max_shapes": ({"max_shapes": 2}, lambda c: c.profiling.max_shapes, 2),
    "optimizer": ({"states": "offload", "optimizer": OPT}, lambda c: c.states.optimizer, OPT),
    "model": ({"states": "offload", "optimizer": OPT, "model": MODEL}, lambda c: c.states.model, MODEL),
    "offload_gradients": (
        {"states": "offload", "optimizer": OPT, "offload_gradients": True},
        lambda c: c.states.gradients,
        True,
    ),
    "offload_parameters": (
        {"states": "offload", "optimizer": OPT, "model": MODEL, "offload_parameters": True},
        lambda c: c.states.parameters,
        True,
    ),
    "optimizer_in_backward": (
        {"states": "offload", "optimizer": OPT, "optimizer_in_backward": True},
        lambda c: c.states.optimizer_in_backward,
        True,
    ),
    "states_chunk_bytes": (
        {"states": "offload", "optimizer": OPT, "states_chunk_bytes": "1MiB"},
        lambda c: c.states.chunk_bytes,
        "1MiB",
    ),
    "states_min_param_bytes": (
        {"states": "offload", "optimizer": OPT, "states_min_param_bytes": 0},
        lambda c: c.states.min_param_bytes,
        0,
    ),
    "states_keep": (
        {"states": "offload", "optimizer": OPT, "states_keep": "none"},
        lambda c: c.states.keep,
        "none",
    ),
}


def test_every_deprecated_name_has_a_case() -> None:
    assert sorted(CASES) == sorted(DEPRECATED_OPTIONS)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_deprecated_name_still_works_and_warns_with_the_new_spelling(name) -> None:
    options, read, expected = CASES[name]
    group, new_field = DEPRECATED_OPTIONS[name]
    with pytest.warns(DeprecationWarning) as record:
        cfg = make_config(**options)
    assert read(cfg) == expected
    messages = [str(w.message) for w in record if str(w.message).startswith(f"{name}=")]
    assert len(messages) == 1, messages  # once per name
    assert f"use {group}=teraio.{type(getattr(cfg, group)).__name__}({new_field}=" in messages[0]


def test_the_warning_points_at_the_callers_line() -> None:
    with pytest.warns(DeprecationWarning, match="profile_steps=1 is deprecated") as record:
        make_config(profile_steps=1)
    assert record[0].filename == __file__


def test_the_message_of_the_brief() -> None:
    with pytest.warns(DeprecationWarning) as record:
        make_config(profile_steps=1)
    assert str(record[0].message) == "profile_steps=1 is deprecated: use profiling=teraio.Profiling(steps=1)"


def test_states_keep_and_offload_strings_warn() -> None:
    with pytest.warns(DeprecationWarning, match=r"states='keep' is deprecated: use states=None"):
        assert make_config(states="keep").states is None
    with pytest.warns(DeprecationWarning, match=r"states='offload' is deprecated: use states=teraio.States"):
        cfg = make_config(states="offload", optimizer=OPT)
    assert isinstance(cfg.states, teraio.States) and cfg.states.optimizer is OPT


def test_flat_names_fold_into_one_object_each() -> None:
    with pytest.warns(DeprecationWarning):
        cfg = make_config(solver="greedy", time_limit=5, solver_workers=1, profile_steps=2, max_shapes=3)
    assert cfg.solver == teraio.Solver(name="greedy", time_limit=5, workers=1)
    assert cfg.profiling == teraio.Profiling(steps=2, max_shapes=3)


def test_the_backend_takes_the_deprecated_names_too() -> None:
    with pytest.warns(DeprecationWarning, match="measure_memory=False is deprecated"):
        be = teraio.backend(inner="eager", measure_memory=False)
    try:
        assert be.cfg.profiling == teraio.Profiling(measure_memory=False)
    finally:
        be.close()


def test_the_new_spelling_does_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = make_config(solver="greedy", profiling=teraio.Profiling(steps=1), states=None)
    assert cfg.solver == teraio.Solver(name="greedy")


@pytest.mark.parametrize(
    "options",
    [
        {"profile_steps": 1, "profiling": teraio.Profiling()},
        {"time_limit": 5, "solver": teraio.Solver()},
        {"offload_gradients": True, "states": teraio.States(optimizer=OPT)},
    ],
    ids=["profiling", "solver", "states"],
)
def test_mixing_a_flat_name_with_its_object_is_refused(options) -> None:
    old = next(k for k in options if k in DEPRECATED_OPTIONS)
    with (
        pytest.raises(UserInputError, match=f"{old} and .* both given") as info,
        pytest.warns(DeprecationWarning),
    ):
        make_config(**options)
    assert "\n" not in str(info.value)


def test_an_unknown_option_is_named() -> None:
    with pytest.raises(TypeError, match="'profile_step'"):
        make_config(profile_step=1)
    with pytest.raises(TypeError, match="'budget'"):
        teraio.backend(budget="50%")


def test_the_config_is_frozen() -> None:
    cfg = BackendConfig(tiers="host", offload_dirs=("a",), solver="greedy")
    assert cfg.tiers == ["host"] and cfg.offload_dirs == ["a"] and cfg.solver == teraio.Solver(name="greedy")
    with pytest.raises(AttributeError):
        cfg.memory_budget = "50%"  # type: ignore[misc]


def test_config_json_records_one_object_per_concern() -> None:
    cfg = BackendConfig(
        memory_budget="50%",
        states=teraio.States(optimizer=OPT, model=MODEL, gradients=True),
        solver=teraio.Solver(name="greedy", time_limit=5),
        profiling=teraio.Profiling(steps=1),
        runtime_options={"chunk_bytes": 4096},
    )
    recorded = json.loads(json.dumps(cfg.recorded()))
    assert recorded["states"] == {
        "optimizer": "AdamW",
        "model": "Linear",
        "gradients": True,
        "parameters": False,
        "optimizer_in_backward": False,
        "chunk_bytes": "64MiB",
        "min_param_bytes": "64KiB",
        "keep": "plan",
        "overlap_step": True,
    }
    assert recorded["solver"] == {
        "name": "greedy",
        "time_limit": 5,
        "deterministic_time_limit": None,
        "workers": 2,
        "recompute": None,
        "partitioner_budget": None,
        "runoff_rounds": 3,
    }
    assert recorded["profiling"] == {"steps": 1, "measure_memory": True, "max_shapes": 8}
    assert "runtime_options" not in recorded and recorded["memory_budget"] == "50%"
    assert json.loads(json.dumps(BackendConfig().recorded()))["states"] is None


def test_run_dirs_of_either_shape_are_recognised_as_teraios(tmp_path) -> None:
    """config.json's reader (teraio.lifecycle.run_dir): a run directory this release writes is teraio's,
    and so is one an earlier release wrote with the flat shape (``profile_steps``, ``solver`` a name)."""
    from teraio.lifecycle.run_dir import is_teraio_run_dir

    new, old = tmp_path / "new", tmp_path / "old"
    new.mkdir()
    old.mkdir()
    recorded = BackendConfig(run_dir=str(new)).recorded()
    (new / "config.json").write_text(json.dumps({**recorded, "run_id": "0" * 16}))
    flat = {
        "memory_budget": None,
        "offload_dirs": None,
        "solver": "ilp",
        "profile_steps": 3,
        "inner": "eager",
    }
    (old / "config.json").write_text(json.dumps({**flat, "run_dir": str(old), "run_id": "1" * 16}))
    assert is_teraio_run_dir(new) and is_teraio_run_dir(old)
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "config.json").write_text(json.dumps({"solver": "ilp", "lr": 0.1}))
    assert not is_teraio_run_dir(tmp_path / "foreign")
