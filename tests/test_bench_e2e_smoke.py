"""The end-to-end benchmark runs at tiny size and reports every method with sane figures."""

from __future__ import annotations

import json

from benchmarks import bench_e2e


def test_bench_e2e_tiny(capsys) -> None:
    assert bench_e2e.main(["--model", "tiny", "--steps", "2", "--solver", "greedy", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["method"]: r for r in out["rows"]}
    assert set(rows) == {"no-offload", "teraio", "checkpoint"}
    assert out["losses_bit_identical"] is True
    t = rows["teraio"]
    assert t["moved_bytes_per_step"] > 0 and t["peak_bytes"] < rows["no-offload"]["peak_bytes"]
    # Peak prediction accuracy is asserted in tests/teraio/test_offload_e2e.py::test_stats_and_run_dir;
    # here only that the benchmark reports it (on tiny, one extra 256 KiB buffer is 13%: open, issue #4).
    assert t["predicted_peak_bytes"] > 0
    assert "torch" in out["machine"]
