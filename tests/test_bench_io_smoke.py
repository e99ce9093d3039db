"""Smoke run of benchmarks/bench_io at tiny size: it runs, checks its data, and prints the JSON keys."""

from __future__ import annotations

import json

from benchmarks import bench_io


def test_bench_io_smoke(tmp_path, capsys):
    rc = bench_io.main(["--dir", str(tmp_path), "--sizes", "1MiB,3MiB", "--repeats", "2", "--chunk", "1MiB",
                        "--json", "--out", str(tmp_path / "rows.csv")])  # fmt: skip
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    for k in ("write_gb_per_s", "read_gb_per_s", "raw_write_gb_per_s", "raw_read_gb_per_s"):
        assert out[k] > 0
    assert out["size_nbytes"] == 3 << 20 and len(out["per_size"]) == 2
    assert (tmp_path / "rows.csv").read_text().count("\n") == 1 + 2 * 2 * 5
    assert [p.name for p in tmp_path.iterdir()] == ["rows.csv"]  # no files left behind


def test_bench_io_bad_size_is_one_line(tmp_path, capsys):
    assert bench_io.main(["--dir", str(tmp_path), "--size", "lots"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--size" in err
