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
    argv = ["--config", "tiny", "--dir", str(data), "--steps", "3", "--io-size", "1MiB", "--json"]
    assert bench_states.main(argv) == 0  # the default since 2026-11-27 (--offload-parameters, kept)
    r = json.loads(capsys.readouterr().out)
    assert r["options"]["offload_parameters"] is True and r["options"]["compiled"] == "each block"
    assert r["first_loss_bit_equal"] is True and r["losses_finite"] is True
    for s in r["per_step"][
        1:
    ]:  # the blocks' larger weights: read for forward and backward, written by the step
        w, rd = s["written_bytes"]["parameter"], s["read_bytes"]["parameter"]
        assert 0 < w <= r["block_weight_bytes"] and w < rd <= 3 * w
    assert (
        r["io_must_write_bytes"] == r["gradient_bytes"] + r["optimizer_state_bytes"] + r["block_weight_bytes"]
    )
    assert r["leftovers"] == [] and list(data.iterdir()) == []
