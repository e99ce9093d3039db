"""The profile's recompute columns: optional, validated with one-line errors, kept through save/load, and
filled by the synthetic profiles with realistic rebuild chains."""

from __future__ import annotations

import math

import numpy as np
import pytest

from teraio.planner.profile import Profile, ProfileError, make_profile
from teraio.planner.synth import synth_profile
from tests.planner.planner_cases import MB, act, ops_rows, param


def _profile(**cols) -> Profile:
    tensors = [act("a", MB, 0, 1, 4), act("b", MB, 1, 2, 3), param("w", MB)]
    for name, values in cols.items():
        for row, v in zip(tensors, values):
            row[name] = v
    return make_profile(ops_rows([10.0] * 6, 3), tensors, {"fingerprint": "rc"})


def test_profiles_without_the_columns_load_and_recompute_nothing():
    p = make_profile(ops_rows([10.0] * 6, 3), [act("a", MB, 0, 1, 4)], {"fingerprint": "rc"})
    assert not p.has_recompute


def test_one_column_implies_the_others_with_their_defaults():
    p = _profile(recompute_us=[5.0, math.nan, math.nan])
    assert p.has_recompute
    assert list(p.tensors["recompute_inputs"]) == [(), (), ()]
    assert list(p.tensors["recompute_peak_bytes"]) == [0, 0, 0]


@pytest.mark.parametrize(
    "cols, words",
    [
        ({"recompute_us": [-1.0, 1.0, math.nan]}, ["'recompute_us'", "'a'", ">= 0 or NaN"]),
        ({"recompute_us": [math.inf, 1.0, math.nan]}, ["'recompute_us'", "'a'"]),
        ({"recompute_inputs": [("zz",), (), ()]}, ["'recompute_inputs'", "'a'", "'zz'", "not a row"]),
        ({"recompute_inputs": [("a",), (), ()]}, ["'recompute_inputs'", "'a'", "itself"]),
        ({"recompute_inputs": ["a", (), ()]}, ["'recompute_inputs'", "'a'", "list of tensor names"]),
        (
            {"recompute_us": [1.0, 1.0, math.nan], "recompute_inputs": [("b",), ("a",), ()]},
            ["'recompute_inputs'", "cycle"],
        ),
        ({"recompute_peak_bytes": [-5, 0, 0]}, ["'recompute_peak_bytes'", "'a'"]),
    ],
)
def test_bad_recompute_columns_are_one_line_errors(cols, words):
    with pytest.raises(ProfileError) as e:
        _profile(**cols)
    assert "\n" not in str(e.value)
    for w in words:
        assert w in str(e.value)


def test_a_cycle_through_rows_that_cannot_be_recomputed_is_no_cycle():
    # 'b' cannot be recomputed (NaN): its inputs are never followed.
    p = _profile(recompute_us=[1.0, math.nan, math.nan], recompute_inputs=[("b", "w"), ("a",), ()])
    assert p.has_recompute


def test_save_and_load_keep_the_columns(tmp_path):
    p = synth_profile(layers=2, hidden=64, seq=32, batch=1)
    p.save(tmp_path / "p")
    q = Profile.load(tmp_path / "p")
    assert list(q.tensors["recompute_inputs"]) == list(p.tensors["recompute_inputs"])
    np.testing.assert_array_equal(q.tensors["recompute_us"], p.tensors["recompute_us"])
    assert list(q.tensors["recompute_peak_bytes"]) == list(p.tensors["recompute_peak_bytes"])


def test_synth_rebuild_recipes_form_chains_back_to_the_layer_input():
    p = synth_profile(layers=2, hidden=64, seq=32, batch=1)
    t = p.tensors.set_index("name")
    ops = p.ops.set_index("name")["duration_us"]
    # Every saved activation has a recipe; params and the token ids have none.
    assert np.isfinite(t.loc[t["kind"] == "activation", "recompute_us"]).all()
    assert np.isnan(t.loc[t["kind"] != "activation", "recompute_us"]).all()
    # Matmul output at the matmul's cost, from its input activation and weight.
    assert t.at["layers.1.up.out", "recompute_us"] == ops["layers.1.up"]
    assert t.at["layers.1.up.out", "recompute_inputs"] == (
        "layers.1.ln2.out",
        "layers.1.up.weight",
        "layers.1.up.bias",
    )
    # The residual sum through the projection, holding the projection's output.
    assert t.at["layers.1.add1.out", "recompute_us"] == ops["layers.1.proj"] + ops["layers.1.add1"]
    assert t.at["layers.1.add1.out", "recompute_peak_bytes"] == t.at["layers.1.add1.out", "nbytes"]
    # Following inputs from gelu.out reaches the layer input (layers.0.add2.out) and stops at params.
    seen, todo = set(), ["layers.1.gelu.out"]
    while todo:
        x = todo.pop()
        if x in seen or t.at[x, "kind"] != "activation":
            continue
        seen.add(x)
        if x != "layers.0.add2.out":
            todo += list(t.at[x, "recompute_inputs"])
    assert "layers.0.add2.out" in seen and "layers.1.qkv.out" in seen
    # Without recipes: no columns, and the same fingerprint as the default one (the step is the same).
    plain = synth_profile(layers=2, hidden=64, seq=32, batch=1, recompute=False)
    assert not plain.has_recompute and "recompute_us" not in plain.tensors.columns
    assert plain.fingerprint != p.fingerprint


def test_explicit_attention_rebuilds_probabilities_from_qkv_holding_the_scores():
    p = synth_profile(layers=1, hidden=64, seq=32, batch=1, attention="explicit")
    t = p.tensors.set_index("name")
    assert t.at["layers.0.softmax.out", "recompute_inputs"] == ("layers.0.qkv.out",)
    assert t.at["layers.0.softmax.out", "recompute_peak_bytes"] == t.at["layers.0.softmax.out", "nbytes"]
