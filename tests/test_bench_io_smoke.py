"""Smoke run of benchmarks/bench_io at tiny size: it runs, checks its data, and prints the JSON keys."""

from __future__ import annotations

import json
import os

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


def test_bench_io_removes_fios_data_file_whatever_fio_names_it(tmp_path, capsys, monkeypatch):
    """fio 3.33 names its file after the job ('teraio'), older ones 'teraio.0.0': a stand-in fio on PATH
    (so the test runs with or without a real fio) writes such a file; nothing may be left behind."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "fio"
    fake.write_text(
        "#!/usr/bin/env python3\n"
        "import json, sys\n"
        "args = dict(a[2:].split('=', 1) for a in sys.argv[1:] if '=' in a)\n"
        "open(args['directory'] + '/' + args['name'], 'wb').write(b'x' * 4096)\n"
        "rw = args['rw']\n"
        "print(json.dumps({'jobs': [{rw: {'bw_bytes': 1e9}}]}))\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    data = tmp_path / "data"
    rc = bench_io.main(["--dir", str(data), "--sizes", "1MiB", "--repeats", "1", "--chunk", "1MiB", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fio"] == {"fio_write_gb_per_s": 1.0, "fio_read_gb_per_s": 1.0}
    assert list(data.iterdir()) == []
