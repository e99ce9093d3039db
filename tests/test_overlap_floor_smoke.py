"""Smoke run of benchmarks/overlap_floor at tiny size: the bytes it says it moved are the bytes the engine
moved, in every round, with the I/O on a thread and in a process of its own."""

from __future__ import annotations

import json

import pytest

from benchmarks import overlap_floor

MIB = 1 << 20


@pytest.mark.parametrize("io_in", ["thread", "process"])
def test_overlap_floor_moves_the_bytes_it_reports(tmp_path, io_in):
    out = tmp_path / "floor.json"
    rc = overlap_floor.main(["--dir", str(tmp_path / "d"), "--config", "tiny", "--unit", "1MiB", "--units", "5",
                             "--read-gb", str(3 * MIB / 1e9), "--write-gb", str(2 * MIB / 1e9),
                             "--checksums", "crc32c", "--reps", "1", "--io-size", "1MiB", "--io-in", io_in,
                             "--out", str(out)])  # fmt: skip
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["io_in"] == io_in
    (v,) = report["variants"]
    assert v["checksum"] == "crc32c"
    assert (v["read_bytes"], v["written_bytes"]) == (3 * MIB, 2 * MIB)
    (row,) = v["rounds"]
    for io in (row["io_alone"], {k.removeprefix("io_"): x for k, x in row["together"].items()}):
        assert (io["read_bytes"], io["written_bytes"]) == (3 * MIB, 2 * MIB)
    together = row["together"]
    assert together["wall_s"] >= max(together["compute_s"], together["io_s"])
    bound = max(v["compute_alone_s"], v["io_bound_s"])
    assert v["floor_vs_max_compute_io"] == pytest.approx(v["together_wall_s"] / bound)
    assert v["together_cores_busy"] > 0 and v["io_alone_cores_busy"] > 0
    assert v["together_minor_faults"] >= 0 and v["io_alone_minor_faults"] >= 0
    assert [p.name for p in (tmp_path / "d").iterdir()] == []  # nothing left behind in its directory


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--reps", "0"], "--reps"),
        (["--units", "4"], "--units"),
        (["--unit", "1000"], "--unit"),
        (["--engine-chunk", "lots"], "--engine-chunk"),
        (["--from-report", "REPORT"], "--from-report"),
    ],
)
def test_overlap_floor_bad_input_is_one_line_before_any_work(tmp_path, capsys, args, names):
    (tmp_path / "report.json").write_text('{"median_step_s": 1.0}')
    args = [str(tmp_path / "report.json") if a == "REPORT" else a for a in args]
    assert overlap_floor.main(["--dir", str(tmp_path / "d"), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and names in err
    assert not (tmp_path / "d").exists()  # nothing measured or created
