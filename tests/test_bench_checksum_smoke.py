"""The checksum benchmark runs at tiny size: checksums on and off train to the same losses, none fails."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_checksum


@pytest.mark.expensive  # a minute of CPU: run by hand
def test_bench_checksum_tiny(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the per-user default offload dir
    assert bench_checksum.main(["--model", "tiny", "--steps", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["rows"]) == {"no-offload", "teraio-nocrc", "teraio-crc"}
    assert out["checksum_used"] == {"teraio-nocrc": None, "teraio-crc": "crc32c"}
    assert out["losses_equal"] is True and out["checksum_failures"] == 0
    assert all(r["median_step_s"] > 0 and r["median_step_cpu_s"] > 0 for r in out["rows"].values())
    assert list((tmp_path / "cache" / "teraio" / "offload").iterdir()) == []  # nothing left behind


def test_bench_checksum_bad_steps_is_one_line(capsys) -> None:
    assert bench_checksum.main(["--steps", "0"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
