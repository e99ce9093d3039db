"""The transfer-cost benchmark runs a tiny plan and reports the engine's calls and the I/O threads' CPU."""

from __future__ import annotations

from benchmarks import transfer_cost


def test_transfer_cost_tiny() -> None:
    # The built-in hardware model: calibrating the directory would double the test's time.
    r = transfer_cost.measure("tiny", "55%", "eager", "greedy", steps=2, hardware=None)
    assert r["round_trips_per_step"] >= 1  # the plan moved something, and every offload was timed
    assert r["calls_s_per_step"]["offload"] > 0 and r["calls_s_per_step"]["fetch"] > 0
    assert r["io_threads_cpu_s_per_round_trip"] > 0  # the I/O threads' clocks were read
    assert r["baseline_fwd_bwd_s"] > 0 and r["predicted_compute_s"] > 0
    assert r["cpu_s_per_transfer"] >= 0
