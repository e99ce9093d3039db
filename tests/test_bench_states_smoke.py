"""The states benchmark at tiny size: it trains in a child process, reports every figure, and leaves no
offload file behind. Structure and invariants only, never timing."""

from __future__ import annotations

import json

from benchmarks import bench_states


def test_bench_states_tiny(capsys, tmp_path) -> None:
    data = tmp_path / "offload"
    out_file = tmp_path / "report.json"
    argv = ["--config", "tiny", "--dir", str(data), "--steps", "3", "--io-size", "1MiB", "--json"]
    # Clipping every step: the gradients' norms are taken before they are written, so from the second
    # step on a step reads each gradient once, as without --clip (the assertions below).
    assert bench_states.main([*argv, "--keep-parameters", "--clip", "1.0", "--out", str(out_file)]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["options"]["clip_grad_norm"] == 1.0
    assert all(s["clip_norm"] > 0 for s in r["per_step"])
    assert json.loads(out_file.read_text())["state_bytes"] == r["state_bytes"]
    for key in ("state_bytes", "peak_rss_bytes", "compute_s", "io_lower_bound_s", "median_step_s"):
        assert r[key] > 0, key
    assert len(r["step_s"]) == 3 and len(r["per_step"]) == 3
    assert r["first_loss_bit_equal"] is True and r["losses_finite"] is True
    n = r["params"]
    assert r["state_bytes"] == 16 * n and r["optimizer_state_bytes"] == 8 * n
    assert r["state_exceeds_mem_total"] is False  # the tiny model fits, and the report says so
    for s in r["per_step"][1:]:  # every step after the first reads and writes each gradient and moment
        assert set(s["written_bytes"]) == {"activation", "parameter", "gradient", "optimizer_state"}
        assert s["written_bytes"]["gradient"] == r["gradient_bytes"] == s["read_bytes"]["gradient"]
        assert s["written_bytes"]["optimizer_state"] == r["optimizer_state_bytes"]
        assert s["read_bytes"]["optimizer_state"] == r["optimizer_state_bytes"]
        assert s["moved_bytes_by_kind"]["optimizer_state"] > 0 and s["moved_bytes_by_kind"]["gradient"] > 0
        assert s["moved_bytes_by_kind"]["parameter"] == 0
    first = r["per_step"][0]  # no moment exists before the first step: nothing to read
    assert first["read_bytes"]["optimizer_state"] == 0 and first["written_bytes"]["optimizer_state"] > 0
    assert r["measured_written_bytes_per_step"] >= r["io_must_write_bytes"]
    assert r["leftovers"] == [] and r["training"]["closed_with"] == "close()"
    assert list(data.iterdir()) == []  # the disk measurement's and the backend's files are gone


def test_bench_states_bad_args_are_one_line(capsys, tmp_path) -> None:
    assert bench_states.main(["--config", "tiny", "--steps", "1"]) == 2
    assert bench_states.main(["--config", "tiny", "--out", str(tmp_path / "missing" / "r.json")]) == 2
    assert bench_states.main(["--config", "tiny", "--budget", "150%"]) == 2
    assert bench_states.main(["--config", "tiny", "--keep-parameters", "--offload-parameters"]) == 2
    assert bench_states.main(["--config", "tiny", "--clip", "0"]) == 2
    assert bench_states.main(["--config", "tiny", "--clip", "1", "--optimizer-in-backward"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 6 and "--steps" in err and "does not exist" in err and "--budget" in err
    assert "contradict" in err and "positive max norm" in err and "inside it" in err


def test_bench_states_tiny_with_parameters_on_disk(capsys, tmp_path) -> None:
    data = tmp_path / "offload"
    argv = ["--config", "tiny", "--dir", str(data), "--steps", "4", "--io-size", "1MiB", "--json"]
    assert bench_states.main(argv) == 0  # the default since 2026-11-27 (--offload-parameters, kept)
    r = json.loads(capsys.readouterr().out)
    assert r["options"]["offload_parameters"] is True and r["options"]["compiled"] == "each block"
    assert r["options"]["overlap_step"] is True
    assert r["first_loss_bit_equal"] is True and r["losses_finite"] is True
    # From the third step on, the update of the step before runs in this step's forward: the blocks'
    # larger weights are read twice (for the update, which the forward computes with, and for the
    # backward) and written once, nothing more (no byte moves twice).
    for s in r["per_step"][2:]:
        w, rd = s["written_bytes"]["parameter"], s["read_bytes"]["parameter"]
        assert 0 < w <= r["block_weight_bytes"] and rd == 2 * w, (w, rd)
        assert s["compute_wait_s"] >= 0 and s["disk_busy_s"] > 0 and s["disk_idle_s"] >= 0
        # The phases' waits are parts of the step's (which also counts zero_grad()'s).
        phases = ("forward", "backward", "optimizer_step")
        assert 0 <= sum(s[f"{ph}_compute_wait_s"] for ph in phases) <= s["compute_wait_s"] + 1e-6
        assert all(s[f"{ph}_disk_idle_s"] >= 0 for ph in phases)
        # The gradients are written in the backward (the tiny model's update reads finish in opt.step()).
        assert s["backward_written_gb"] > 0
        assert all(s[f"{ph}_{what}"] >= 0 for ph in phases for what in ("read_gb", "written_gb"))
    assert set(r["overlap"]) >= {"forward_s", "optimizer_step_s", "compute_wait_s", "disk_idle_s"}
    assert {"forward_compute_wait_s", "backward_disk_idle_s", "optimizer_step_disk_idle_s"} <= set(
        r["overlap"]
    )
    assert r["overlap"]["io_threads_user_s_per_gb"] >= 0 and r["overlap"]["io_threads_system_s_per_gb"] >= 0
    # The phases split the step's compute alone without losing or counting twice any of it (the
    # embeddings and head in the backward, the update between the forward and opt.step()).
    pb = r["phase_bound"]
    split = sum(pb[f"{ph}_compute_alone_s"] for ph in phases)
    assert abs(split - r["compute_s"]) <= 1e-9 * r["compute_s"], (split, r["compute_s"])
    assert pb["phase_bound_s"] >= r["compute_s"]
    assert r["step_vs_phase_bound"] == r["median_step_s"] / pb["phase_bound_s"]
    assert (
        r["io_must_write_bytes"] == r["gradient_bytes"] + r["optimizer_state_bytes"] + r["block_weight_bytes"]
    )
    assert r["leftovers"] == [] and list(data.iterdir()) == []


def test_gpt_weights_file_equals_build_gpt_bit_for_bit(tmp_path) -> None:
    """The file written one submodule at a time holds ``build_gpt``'s initial weights, every bit, in the
    state dict's order; the generator is left as it was (a different seed gives other weights: the
    comparison can fail)."""
    import os

    import torch

    from benchmarks.gpt_weights import write_gpt_weights
    from teraio.states.safetensors_files import read_header, read_into
    from teraio.tools.models.gpt import CONFIGS, build_gpt

    rng = torch.get_rng_state()
    report = write_gpt_weights(CONFIGS["tiny"], 3, tmp_path / "w")
    assert torch.equal(torch.get_rng_state(), rng)
    path = tmp_path / "w" / "model.safetensors"
    assert report.files == ["model.safetensors"] and sorted(os.listdir(tmp_path / "w")) == report.files
    header = read_header(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        got = {}
        for name, entry in header.entries.items():
            got[name] = torch.empty(entry.shape, dtype=entry.dtype)
            read_into(fd, entry, got[name])
    finally:
        os.close(fd)
    want = build_gpt("tiny", 3).state_dict()
    assert list(header.entries) == list(want) and report.tensors == len(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    other = build_gpt("tiny", 4).state_dict()
    assert not any(torch.equal(got[k], other[k]) for k in want if k.endswith(("qkv.weight", "tok.weight")))


def test_bench_states_tiny_from_checkpoint(capsys, tmp_path) -> None:
    """--from-checkpoint: the weights written without the model, loaded onto the meta-built model by
    load_pretrained, trained, saved by save_checkpoint; load and save reported beside the steps, and the
    first loss still the layer-by-layer reference's, bit for bit."""
    data = tmp_path / "offload"
    argv = ["--config", "tiny", "--dir", str(data), "--steps", "2", "--io-size", "1MiB", "--json"]
    assert bench_states.main([*argv, "--from-checkpoint"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["options"]["from_checkpoint"] is True
    assert r["first_loss_bit_equal"] is True and r["losses_finite"] is True
    assert set(r["peak_rss_by_phase"]) == {"build", "load", "step0", "step1", "save"}
    assert all(v > 0 for v in r["peak_rss_by_phase"].values())
    ck = r["from_checkpoint"]
    assert set(ck["peak_rss_vs_running_step"]) == set(r["peak_rss_by_phase"])
    assert isinstance(ck["every_phase_within_1_25x_of_running_step"], bool)
    write, load, save = ck["write_initial_weights"], ck["load"], ck["save"]
    for phase in (write, load, save):
        for key in (
            "seconds",
            "read_gb_per_s",
            "ratio_to_raw_read",
            "ratio_to_raw_write",
            "io_lower_bound_s",
        ):
            assert phase[key] >= 0, key
    # Every weight written once, read once by the load; the large ones written to their disk slots.
    assert write["tensor_bytes"] == r["weight_bytes"] == load["read_bytes"]
    assert load["tensors"] == write["tensors"]
    assert load["offloaded_bytes"] + load["resident_bytes"] == r["weight_bytes"]
    assert 0 < load["offloaded_bytes"] == load["written_bytes"] == load["written_bytes_by_kind"]["parameter"]
    # The save reads back every moment from disk and writes weights and moments (with headers).
    assert save["read_bytes_by_kind"]["optimizer_state"] == r["optimizer_state_bytes"]
    assert save["offload_written_bytes"] == 0
    assert save["written_bytes"] > r["weight_bytes"] + r["optimizer_state_bytes"]
    assert {
        "model.safetensors",
        "optimizer.safetensors",
        "train_state.json",
        "teraio-checkpoint.json",
    } <= set(save["files"])
    assert r["leftovers"] == [] and list(data.iterdir()) == []  # the model file and checkpoint too


def test_bench_states_fsdp_tiny_under_torchrun(tmp_path) -> None:
    """``--fsdp`` at tiny size under torchrun, 2 gloo ranks: each rank loads its shards from the weights
    file, trains, moves its gradient and optimizer-state shards, and rank 0's first loss is the reference
    loss bit for bit (benchmarks.states_fsdp). Structure and invariants only, never timing."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "report.json"
    data = tmp_path / "offload"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv-backend=c10d"]
    cmd += ["--rdzv-endpoint=localhost:0", "-m", "benchmarks.bench_states", "--fsdp", "--config", "tiny"]
    cmd += ["--steps", "3", "--io-size", "1MiB", "--dir", str(data), "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["world_size"] == 2 and r["first_loss_bit_equal"] is True and r["losses_finite"] is True
    assert r["losses_by_rank"][0] != r["losses_by_rank"][1]  # each rank trains on its own batches
    n = r["params"]
    assert r["io_must_write_bytes"] == r["gradient_bytes"] + r["optimizer_state_bytes"] == 12 * n
    for rank in r["ranks"]:
        assert rank["load"]["read_bytes"] > 0 and rank["peak_rss_bytes"] > 0
        for s in rank["steps"][1:]:  # each rank writes and reads its half of every gradient and moment
            assert s["written_bytes"]["gradient"] == s["read_bytes"]["gradient"] > 0
            assert s["written_bytes"]["optimizer_state"] == s["read_bytes"]["optimizer_state"] > 0
        assert rank["closed_with"] == "close()"
    halves = [rank["steps"][1]["written_bytes"]["optimizer_state"] for rank in r["ranks"]]
    assert sum(halves) == r["optimizer_state_bytes"], halves
    for key in ("compute_s", "io_lower_bound_s", "median_step_s", "step_vs_max_compute_io"):
        assert r[key] > 0, key
    assert list(data.iterdir()) == []  # the disk measurement's, the weights' and the backend's files are gone
