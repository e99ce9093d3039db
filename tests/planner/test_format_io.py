"""Loading profiles, plans and hardware models: every malformed field is a typed error naming the file,
the field and the expected value (the cases a review reproduced as tracebacks or silent acceptance)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from teraio.planner.hardware import HardwareError, HardwareModel
from teraio.planner.plan import Plan, PlanError, validate_plan
from teraio.planner.profile import Profile, ProfileError
from teraio.planner.solve import solve
from tests.planner.planner_cases import MB, pyramid


@pytest.fixture
def prof_dir(tmp_path: Path) -> Path:
    return pyramid().save(tmp_path / "prof")


@pytest.fixture
def plan_file(tmp_path: Path) -> Path:
    plan = solve(pyramid(), "300MB", "greedy")
    assert plan.decisions
    plan.save(tmp_path / "plan.json")
    return tmp_path / "plan.json"


# ------------------------------------------------------------------------------------------ profile
@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("schema_version", "one", "'schema_version' is 'one', expected an integer"),
        ("schema_version", True, "expected an integer"),
        ("num_fwd_ops", "4", "'num_fwd_ops' is '4', expected an integer"),
        ("num_fwd_ops", 99, "expected 0..8"),
        ("fingerprint", 7, "'fingerprint' must be a non-empty string"),
    ],
)
def test_profile_meta_types(prof_dir, key, value, fragment):
    meta = json.loads((prof_dir / "meta.json").read_text())
    meta[key] = value
    (prof_dir / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ProfileError, match=fragment) as e:
        Profile.load(prof_dir)
    assert str(prof_dir) in str(e.value)


def _states_record() -> dict:
    from teraio.planner.model_states import offload_states_record

    return offload_states_record(
        param_tensors=2,
        param_nbytes=800,
        offloaded_param_nbytes=800,
        state_tensors=4,
        state_nbytes=1600,
        offload_gradients=True,
        optimizer_in_backward=False,
    )


def _broken_traffic(record: dict) -> dict:
    record["traffic"]["gradient"]["read_bytes"] = -1
    return record


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (lambda r: [r], "model_states must be a JSON object, not list"),
        (
            lambda r: {k: v for k, v in r.items() if k != "gradient"},
            "model_states lacks the object 'gradient'",
        ),
        (_broken_traffic, "model_states 'traffic' 'gradient' 'read_bytes' is -1"),
        (lambda r: {**r, "traffic": {"weights": {}}}, "entry 'weights' that is not a kind's object"),
    ],
)
def test_a_malformed_model_states_is_refused_in_one_line(prof_dir, change, fragment):
    """A states="offload" profile's model_states (teraio plan and simulate read its traffic)."""
    meta = json.loads((prof_dir / "meta.json").read_text())
    meta["model_states"] = _states_record()
    (prof_dir / "meta.json").write_text(json.dumps(meta))
    assert Profile.load(prof_dir).meta["model_states"]["traffic"]["gradient"]["read_bytes"] == 800
    meta["model_states"] = change(_states_record())
    (prof_dir / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ProfileError, match=fragment) as e:
        Profile.load(prof_dir)
    assert str(prof_dir) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_profile_with_nan_or_inf_durations_is_refused(prof_dir, bad):
    """Such a profile used to yield a plan with predicted_step_s NaN."""
    p = Profile.load(prof_dir)
    p.ops.loc[2, "duration_us"] = bad
    with pytest.raises(ProfileError, match="'duration_us' has NaN or infinite values"):
        p.validate()
    p.ops.to_parquet(prof_dir / "ops.parquet", index=False)
    with pytest.raises(ProfileError, match="duration_us"):
        Profile.load(prof_dir)


# ----------------------------------------------------------------------------------------- hardware
@pytest.mark.parametrize(
    ("doc", "fragment"),
    [
        ({"tiers": []}, "'tiers' must be an object"),
        ({"tiers": "ssd"}, "'tiers' must be an object"),
        ({"tiers": {"ssd": {"write_bw_bytes_per_s": "fast", "read_bw_bytes_per_s": 1e9}}}, "'write_bw_bytes_per_s' is 'fast', expected a finite number"),
        ({"tiers": {"ssd": {"write_bw_bytes_per_s": 1e9, "read_bw_bytes_per_s": 0}}}, "expected > 0"),
        ({"tiers": {"ssd": {"write_bw_bytes_per_s": 1e9, "read_bw_bytes_per_s": 1e9, "count": 1.5}}}, "'count' is 1.5"),
        ({"tiers": {"ssd": {"write_bw_bytes_per_s": 1e9, "read_bw_bytes_per_s": 1e9, "shared_channel": "no"}}}, "true or false"),
        ({"tiers": {"ssd": {"write_bw_bytes_per_s": 1e9, "read_bw_bytes_per_s": 1e9, "capacity_bytes": -1}}}, "capacity_bytes"),
        ({"tiers": {"ssd": {"write_bw_bytes_per_s": 1e9, "read_bw_bytes_per_s": 1e9, "speed": 3}}}, "unknown field 'speed'"),
        ({"tiers": {"floppy": {"write_bw_bytes_per_s": 1e9, "read_bw_bytes_per_s": 1e9}}}, "tier 'floppy' is not a tier"),
        ({"tiers": {"ssd": [1, 2]}}, "expected an object of tier fields"),
        ({"schema_version": "1", "tiers": {}}, "'schema_version' is '1'"),
        ({"schema_version": 1.0, "tiers": {}}, "'schema_version' is 1.0"),
        ({"name": 3, "tiers": {}}, "'name' is 3"),
        ([1, 2], "expected a JSON object"),
    ],
)  # fmt: skip
def test_hardware_model_fields(tmp_path, doc, fragment):
    f = tmp_path / "hw.json"
    f.write_text(json.dumps(doc))
    with pytest.raises(HardwareError, match=fragment) as e:
        HardwareModel.load(f)
    assert str(f) in str(e.value) and "\n" not in str(e.value)


def test_hardware_model_roundtrip_and_directory(tmp_path):
    hw = HardwareModel().with_overrides("ssd", count=2, capacity_bytes=10 * MB)
    hw.save(tmp_path / "hw.json")
    assert HardwareModel.load(tmp_path / "hw.json") == hw
    with pytest.raises(HardwareError, match="is a directory"):
        HardwareModel.load(tmp_path)


# --------------------------------------------------------------------------------------------- plan
def _mutate(plan_file: Path, fn) -> Path:
    text = plan_file.read_text()
    d = json.loads(text)
    fn(d)
    out = plan_file.with_name("bad.json")
    out.write_text(json.dumps(d) if not isinstance(d, str) else d)
    return out


def _set(path, value):
    def fn(d):
        node = d
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value

    return fn


@pytest.mark.parametrize(
    ("mutation", "fragment"),
    [
        (_set(("decisions", 0, "nbytes"), 10**30), "decisions\\[0\\].nbytes is 1000000000000000000000000000000, expected 1.."),
        (_set(("decisions", 0, "nbytes"), 1e15), "decisions\\[0\\].nbytes is 1000000000000000.0, expected an integer"),
        (_set(("decisions", 0, "nbytes"), "100"), "expected an integer"),
        (_set(("decisions", 0, "nbytes"), -5), "expected 1.."),
        (_set(("decisions", 0, "offload_after_idx"), "2"), "offload_after_idx is '2', expected an integer"),
        (_set(("decisions", 0, "fetch_before_idx"), None), "fetch_before_idx is None"),
        (_set(("decisions", 0, "tier"), "floppy"), "tier is 'floppy', expected one of the plan's hardware tiers"),
        (_set(("decisions", 0, "name"), 3), "decisions\\[0\\].name is 3"),
        (_set(("decisions", 0), "x"), "decisions\\[0\\] is str"),
        (_set(("decisions",), {}), "'decisions' is dict, expected a list"),
        (lambda d: d["decisions"].append(dict(d["decisions"][0])), "has a second decision"),
        (_set(("budget_bytes",), "300MB"), "'budget_bytes' is '300MB', expected an integer"),
        (_set(("predicted_step_s",), "fast"), "'predicted_step_s' is 'fast'"),
        (_set(("predicted_step_s",), -1.0), "expected >= 0"),
        (_set(("stats", "gap"), "none"), "'stats.gap'"),
        (_set(("stats",), []), "'stats' is \\[\\]"),
        (_set(("hardware", "tiers"), []), "'tiers' must be an object"),
        (_set(("schema_version",), "1"), "schema_version '1' is not supported"),
        (_set(("fingerprint",), None), "'fingerprint' is None"),
        (lambda d: d.pop("compute_s"), "lacks key 'compute_s'"),
    ],
)  # fmt: skip
def test_plan_fields(plan_file, mutation, fragment):
    bad = _mutate(plan_file, mutation)
    with pytest.raises(PlanError, match=fragment) as e:
        Plan.load(bad)
    assert str(bad) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("token", ["1e400", "Infinity", "NaN", "-Infinity"])
def test_plan_with_non_finite_numbers(plan_file, token):
    text = plan_file.read_text().replace('"predicted_step_s": ', f'"predicted_step_s": {token}, "x": ', 1)
    bad = plan_file.with_name("bad.json")
    bad.write_text(text)
    with pytest.raises(PlanError, match="predicted_step_s|not valid JSON"):
        Plan.load(bad)


def test_plan_checked_against_its_profile(plan_file, prof_dir):
    profile = Profile.load(prof_dir)
    plan = Plan.load(plan_file, profile=profile)
    validate_plan(plan, profile)
    bad = _mutate(plan_file, _set(("decisions", 0, "nbytes"), 46 * MB))
    with pytest.raises(PlanError, match="has nbytes 46000000 in the plan but 100000000 in the profile"):
        Plan.load(bad, profile=profile)
    bad = _mutate(plan_file, _set(("decisions", 0, "name"), "ghost"))
    with pytest.raises(PlanError, match="'ghost': no such tensor"):
        Plan.load(bad, profile=profile)
    bad = _mutate(plan_file, _set(("decisions", 0, "offload_after_idx"), 10**6))
    with pytest.raises(PlanError, match="outside the profile's ops"):
        Plan.load(bad, profile=profile)
    with pytest.raises(PlanError, match="re-plan"):
        Plan.load(plan_file, profile=pyramid(fingerprint="other"))


def test_plan_save_needs_overwrite(plan_file):
    plan = Plan.load(plan_file)
    from teraio.planner.safe_io import OutputError

    with pytest.raises(OutputError, match="--force"):
        plan.save(plan_file)
    plan.save(plan_file, overwrite=True)
    assert Plan.load(plan_file) == plan
