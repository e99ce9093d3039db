"""Space: extent reuse without growth, file safety (modes, symlinks, O_EXCL), cleanup, start-up checks."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from teraio.runtime import Engine, RuntimeConfig
from teraio.runtime.errors import OutOfSpaceError
from teraio.runtime.space import ExtentAllocator, clean_stale_subdirs

REPO = Path(__file__).resolve().parents[2]


def test_allocator_first_fit_coalesces():
    a = ExtentAllocator(0)
    assert a.allocate(10) is None
    a.extend(5 * 4096)
    offs = [a.allocate(4096) for _ in range(5)]
    assert offs == [0, 4096, 8192, 12288, 16384]
    assert a.allocate(1) is None and a.growth_needed(1) == 4096
    a.free(4096, 4096)
    a.free(12288, 4096)
    a.free(8192, 4096)  # merges the three into one range
    assert a.free_extents == [(4096, 3 * 4096)]
    assert a.allocate(3 * 4096) == 4096
    a.free(16384, 4096)
    assert a.growth_needed(2 * 4096) == 4096  # reuses the free tail
    with pytest.raises(AssertionError, match="double free"):
        a.free(16384, 4096)


def test_no_file_growth_over_1000_reuse_cycles(tmp_path):
    sizes = [3000, 70_000, 12_345, 1 << 18, 5]
    with Engine(RuntimeConfig(dirs=[tmp_path / "a", tmp_path / "b"], chunk_bytes=64 << 10)) as eng:
        tensors = [torch.full((n,), float(i), dtype=torch.float32) for i, n in enumerate(sizes)]
        capacities = []
        for step in range(1000):
            for i, t in enumerate(tensors):  # the same keys every step, replaced each time
                eng.offload(f"act{i}", t)
            for i in range(len(tensors)):
                eng.release(f"act{i}")
            if step % 100 == 0:
                assert torch.equal(eng.fetch("act3"), tensors[3])
            capacities.append(tuple(d.file_capacity_nbytes for d in eng.stats().dirs))
        sizes_on_disk = [os.stat(p + "/data.bin").st_size for p in eng.offload_paths]
    assert capacities[1] == capacities[-1], "offload files grew after the first step"
    assert sum(capacities[-1]) <= sum(-(-n * 4 // 4096) * 4096 for n in sizes) + 2 * (64 << 10)
    assert sizes_on_disk == list(capacities[-1])


def test_files_private_and_removed_on_close(tmp_path):
    eng = Engine(RuntimeConfig(dirs=[tmp_path], reserve_bytes="1MiB"))
    (sub,) = eng.offload_paths
    assert stat.S_IMODE(os.stat(sub).st_mode) == 0o700
    for name in os.listdir(sub):
        assert stat.S_IMODE(os.stat(os.path.join(sub, name)).st_mode) == 0o600
    assert os.stat(os.path.join(sub, "data.bin")).st_blocks * 512 >= 1 << 20  # really preallocated
    eng.offload("x", torch.ones(10)).wait()
    eng.close()
    eng.close()  # idempotent
    assert os.listdir(tmp_path) == []


def test_reserve_that_cannot_fit_fails_at_start(tmp_path):
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    with pytest.raises(OutOfSpaceError) as info:
        Engine(RuntimeConfig(dirs=[tmp_path], reserve_bytes=free + (1 << 40)))
    err = info.value
    assert err.directory == str(tmp_path) and err.needed_nbytes >= free
    assert str(tmp_path) in str(err) and "bytes" in str(err)
    assert os.listdir(tmp_path) == []  # nothing left behind


def test_cleanup_never_touches_foreign_files_or_follows_symlinks(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep")
    base = tmp_path / "base"
    base.mkdir()
    (base / "user-file").write_text("keep")
    # A planted symlink with a teraio-looking name pointing outside, and a look-alike directory of a
    # dead pid holding a foreign file.
    os.symlink(outside, base / "teraio-r0-p999999-deadbeef")
    fake = base / "teraio-r0-p999998-cafebabe"
    fake.mkdir()
    (fake / "notes.txt").write_text("keep")
    with Engine(RuntimeConfig(dirs=[base])) as eng:
        eng.offload("x", torch.ones(100)).wait()
    assert (outside / "precious").read_text() == "keep"
    assert (base / "user-file").exists() and (fake / "notes.txt").exists()
    assert os.path.islink(base / "teraio-r0-p999999-deadbeef")


def test_offload_dir_symlink_file_is_not_followed(tmp_path):
    """A file planted where the engine creates data.bin must make creation fail, not be reused."""
    from teraio.runtime.space import OffloadDir

    odir = OffloadDir(tmp_path, rank=0, direct_io=None, fault_injector=None)
    try:
        target = tmp_path / "victim"
        target.write_text("x")
        os.unlink(odir.path / "data.bin")
        os.symlink(target, odir.path / "data.bin")
        with pytest.raises(FileExistsError):
            odir._create_file("data.bin", 0)  # O_EXCL|O_NOFOLLOW
        assert target.read_text() == "x"
    finally:
        odir.close()


_CHILD = textwrap.dedent(
    """
    import sys, time, torch
    from teraio.runtime import Engine, RuntimeConfig
    eng = Engine(RuntimeConfig(dirs=[sys.argv[1]], reserve_bytes="8MiB"))
    eng.offload("x", torch.ones(1 << 20)).wait()
    print(eng.offload_paths[0], flush=True)
    time.sleep(120)
    """
)


def _spawn(base: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(base)], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    line = proc.stdout.readline().strip()
    assert line, "child did not start"
    return proc, line


def test_sigkilled_process_files_cleaned_at_next_start_live_ones_kept(tmp_path):
    (dead, dead_dir), (live, live_dir) = _spawn(tmp_path), _spawn(tmp_path)
    try:
        dead.send_signal(signal.SIGKILL)
        dead.wait(timeout=30)
        assert os.path.exists(dead_dir)  # SIGKILL skips atexit: files are left behind
        removed = clean_stale_subdirs(tmp_path)
        assert removed == [os.path.basename(dead_dir)]
        assert not os.path.exists(dead_dir)
        assert os.path.exists(os.path.join(live_dir, "data.bin"))  # a live process is never touched
        with Engine(RuntimeConfig(dirs=[tmp_path])):
            assert os.path.exists(live_dir)
    finally:
        live.kill()
        live.wait(timeout=30)
    assert clean_stale_subdirs(tmp_path) == [os.path.basename(live_dir)]
    assert os.listdir(tmp_path) == []


def test_files_removed_at_interpreter_exit(tmp_path):
    code = "import sys, torch; from teraio.runtime import Engine, RuntimeConfig\n"
    code += "eng = Engine(RuntimeConfig(dirs=[sys.argv[1]])); eng.offload('x', torch.ones(99))\n"
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, cwd=REPO)
    assert os.listdir(tmp_path) == []


def test_tmpfs_directory_warns(caplog):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    from teraio.runtime.space import filesystem_type

    if filesystem_type(Path("/dev/shm")) != "tmpfs":
        pytest.skip("/dev/shm is not tmpfs here")
    import tempfile

    with tempfile.TemporaryDirectory(dir="/dev/shm") as d, Engine(RuntimeConfig(dirs=[d])):
        pass
    assert "tmpfs" in caplog.text and "save no memory" in caplog.text
