"""Synthetic profiles: realistic against the measured mid-size GPT, deterministic, validated, and the CLI."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from teraio.cli import main
from teraio.planner.layers import find_layers, layer_key
from teraio.planner.lifetimes import analyse
from teraio.planner.profile import Profile, ProfileError
from teraio.planner.synth import SynthConfig, synth_profile

MB = 1e6


@pytest.fixture(scope="module")
def gpt6():
    return synth_profile()  # defaults: the measured 6/384/512/8 GPT (docs/measured_facts.md)


def test_defaults_match_the_measured_mid_size_gpt(gpt6):
    # docs/measured_facts.md: 14.0M params, fwd 0.84 s, bwd 1.74 s, 685 MB saved (101 MB/block), peak 819 MB.
    t = gpt6.tensors
    params = t.loc[t["kind"] == "param", "nbytes"].sum() / 4
    assert params == pytest.approx(14.0e6, rel=0.01)
    assert gpt6.meta["fwd_s"] == pytest.approx(0.84, rel=0.05)
    assert gpt6.meta["bwd_s"] == pytest.approx(1.74, rel=0.10)
    assert gpt6.activation_bytes() / MB == pytest.approx(685, rel=0.01)
    in_block = (t["module"] == "layers.3") | t["module"].str.startswith("layers.3.")
    block = t.loc[(t["kind"] == "activation") & in_block, "nbytes"].sum()
    assert block / MB == pytest.approx(101, rel=0.01)
    # The planner counts the step's own allocations (params predate the step); the measured 819 MB peak
    # matches the synthetic step when the weights are added back.
    weights = t.loc[t["kind"] == "param", "nbytes"].sum()
    assert (analyse(gpt6).baseline_peak_bytes + weights) / MB == pytest.approx(819, rel=0.03)


def test_structure_of_the_step(gpt6):
    ops = gpt6.ops
    nf = gpt6.num_fwd_ops
    assert nf == 1 + 10 * 6 + 3 and len(ops) == 2 * nf
    assert ops["name"].iloc[nf] == "loss_bwd" and ops["name"].iloc[-1] == "embed_bwd"
    # Backward op i mirrors forward op n-1-i at twice the time.
    fwd = ops["duration_us"].iloc[:nf].to_numpy()
    bwd = ops["duration_us"].iloc[nf:].to_numpy()[::-1]
    assert (bwd == 2 * fwd).all()
    t = gpt6.tensors.set_index("name")
    assert t.loc["layers.3.up.out", "nbytes"] == 8 * 512 * 4 * 384 * 4
    assert t.loc["layers.3.up.out", "module"] == "layers.3.mlp"
    assert not t.loc["layers.3.qkv.weight", "offloadable"] and t.loc["layers.3.qkv.weight", "kind"] == "param"
    assert t.loc["tokens", "kind"] == "input"
    # The layer input is saved by ln1 and read again by the residual add.
    x = t.loc["layers.2.add2.out"]
    assert ops["name"].iloc[x["last_fwd_use_idx"]] == "layers.3.add1"
    assert ops["name"].iloc[x["first_bwd_use_idx"]] == "layers.3.ln1_bwd"
    # Parameter gradients accumulate: backward other_bytes end higher than they start.
    assert ops["other_bytes"].iloc[-1] > ops["other_bytes"].iloc[nf + 5]


def test_deterministic_and_fingerprinted():
    a, b = synth_profile(layers=2), synth_profile(layers=2)
    pd.testing.assert_frame_equal(a.ops, b.ops)
    pd.testing.assert_frame_equal(a.tensors, b.tensors)
    assert a.fingerprint == b.fingerprint
    assert synth_profile(layers=3).fingerprint != a.fingerprint
    assert synth_profile(layers=2, batch=4).fingerprint != a.fingerprint
    assert synth_profile(layers=2, flops_per_s=1e12).fingerprint != a.fingerprint


def test_sizes_scale_with_shape():
    small = synth_profile(layers=2, hidden=128, seq=64, batch=2)
    double_batch = synth_profile(layers=2, hidden=128, seq=64, batch=4)
    assert double_batch.activation_bytes() == 2 * small.activation_bytes()
    more_layers = synth_profile(layers=4, hidden=128, seq=64, batch=2)
    per_layer = (more_layers.activation_bytes() - small.activation_bytes()) / 2
    assert per_layer == 2 * 64 * 128 * 4 * (5 + 3 + 2 * 4) + 2 * 2 * 2 * 64 * 4 + 2 * 2 * 64 * 4


def test_explicit_attention_saves_probabilities():
    fused = synth_profile(layers=1, hidden=128, seq=64, batch=2)
    explicit = synth_profile(layers=1, hidden=128, seq=64, batch=2, attention="explicit")
    t = explicit.tensors.set_index("name")
    assert t.loc["layers.0.softmax.out", "nbytes"] == 2 * 2 * 64 * 64 * 4
    assert explicit.activation_bytes() > fused.activation_bytes()


def test_save_load_round_trip(tmp_path):
    p = synth_profile(layers=2)
    q = Profile.load(p.save(tmp_path / "prof"))
    pd.testing.assert_frame_equal(p.ops, q.ops)
    assert q.fingerprint == p.fingerprint and q.meta["synth"]["layers"] == 2


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"layers": 0}, "layers"),
        ({"hidden": 100, "heads": 3}, "divisible"),
        ({"attention": "flash"}, "attention"),
        ({"flops_per_s": -1.0}, "flops_per_s"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_bad_parameters_are_named(kwargs, needle):
    with pytest.raises(ProfileError, match=needle):
        synth_profile(**kwargs)


def test_config_fingerprint_is_stable():
    # Pinned: a change to the generator must bump SYNTH_VERSION, which changes every fingerprint.
    assert SynthConfig().fingerprint() == SynthConfig(layers=6, hidden=384, seq=512, batch=8).fingerprint()
    assert len(SynthConfig().fingerprint()) == 64


# ------------------------------------------------------------------------------------------- layers
@pytest.mark.parametrize(
    ("module", "key"),
    [
        ("layers.3.mlp", "layers.3"),
        ("transformer.h.11.attn", "transformer.h.11"),
        ("embed", None),
        ("", None),
        ("model.layers.0", "model.layers.0"),
    ],
)
def test_layer_key(module, key):
    assert layer_key(module) == key


def test_find_layers_groups_identical_layers():
    s = find_layers(synth_profile(layers=8, hidden=128, seq=64, batch=2))
    assert s.num_layers == 8
    assert [x.key for x in s.layers] == [f"layers.{i}" for i in range(8)]
    # Interior layers are identical; the first and last differ in how their inputs/outputs are used.
    assert set(range(1, 7)) <= set(s.largest_class)
    assert s.layers[1].fwd_stop_idx - s.layers[1].fwd_start_idx == 10
    assert s.windows(4) == [(0, 1, 2, 3), (2, 3, 4, 5), (4, 5, 6, 7)]
    changed = synth_profile(layers=8, hidden=128, seq=64, batch=2)
    changed.ops.loc[changed.ops["name"] == "layers.4.up", "duration_us"] *= 1.5
    assert 4 not in find_layers(changed).largest_class


# ---------------------------------------------------------------------------------------------- CLI
def test_cli_synth_writes_a_loadable_profile(tmp_path, capsys):
    out = tmp_path / "p"
    assert (
        main(
            [
                "synth",
                "--layers",
                "2",
                "--hidden",
                "128",
                "--seq",
                "64",
                "--batch",
                "2",
                "--out",
                str(out),
                "--json",
            ]
        )
        == 0
    )
    summary = json.loads(capsys.readouterr().out)
    p = Profile.load(out)
    assert (
        summary["fingerprint"]
        == p.fingerprint
        == synth_profile(layers=2, hidden=128, seq=64, batch=2).fingerprint
    )
    assert summary["ops"] == len(p.ops)


def test_cli_synth_defaults_are_the_mid_size_gpt(tmp_path, capsys):
    assert main(["synth", "--out", str(tmp_path / "p")]) == 0
    assert "6 layers" in capsys.readouterr().out
    assert Profile.load(tmp_path / "p").fingerprint == synth_profile().fingerprint


def test_cli_synth_errors_are_one_line(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["synth", "--out", str(f)]) == 2
    err = capsys.readouterr().err.strip()
    assert "is not a directory" in err and len(err.splitlines()) == 1
    assert main(["synth", "--hidden", "100", "--heads", "3", "--out", str(tmp_path / "q")]) == 2
    assert "divisible" in capsys.readouterr().err
