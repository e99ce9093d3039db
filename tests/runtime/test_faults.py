"""Injected and real faults raise typed errors naming the directory, file, offset and bytes, at the
request that hit them, and leave the engine usable with nothing corrupted."""

from __future__ import annotations

import errno
import os
import subprocess
import uuid
from pathlib import Path

import pytest
import torch

from teraio.runtime import Engine, RuntimeConfig
from teraio.runtime.errors import (
    ChecksumError,
    DiskIOError,
    OffloadPermissionError,
    OutOfSpaceError,
    RuntimeIOError,
)
from teraio.runtime.testing import FaultInjector

from .conftest import make_config
from .corrupt import flip_byte


def _posix_or_kvikio(tier: str) -> None:
    if tier == "host":
        pytest.skip("the host tier has no files")


def test_enospc_on_grow_raises_at_offload_and_keeps_other_keys(tier, tmp_path):
    _posix_or_kvikio(tier)
    inj = FaultInjector().fail("preallocate", errno.ENOSPC, after_nbytes=1 << 20)
    with Engine(make_config(tier, tmp_path, fault_injector=inj)) as eng:
        a = torch.randn(100_000)
        eng.offload("a", a)
        eng.release("a")
        with pytest.raises(OutOfSpaceError) as info:
            eng.offload("b", torch.randn(1 << 20))  # 4 MiB more than the "disk" holds
        err = info.value
        assert err.needed_nbytes > 0 and err.directory in {str(tmp_path / "ssd0"), str(tmp_path / "ssd1")}
        assert err.directory in str(err) and "out of space" in str(err)
        assert "b" not in eng.keys()
        assert torch.equal(eng.fetch("a"), a)  # nothing else lost
        inj.clear()  # space freed: the same request now succeeds
        b = torch.randn(1 << 20)
        eng.offload("b", b).wait()
        eng.release("b")
        assert torch.equal(eng.fetch("b"), b)


@pytest.mark.parametrize("code,exc_type", [(errno.EIO, DiskIOError), (errno.ENOSPC, OutOfSpaceError)])
def test_write_error_surfaces_on_handle_and_keeps_data_in_memory(tier, tmp_path, code, exc_type):
    _posix_or_kvikio(tier)
    inj = FaultInjector().fail("write", code, after_nbytes=200_000, times=1)
    with Engine(make_config(tier, tmp_path, fault_injector=inj)) as eng:
        t = torch.randn(300_000)
        h = eng.offload("t", t)
        with pytest.raises(exc_type) as info:
            h.wait()
        assert "data.bin" in str(info.value) or "ssd" in str(info.value)
        with pytest.raises(exc_type):
            eng.release("t")  # the in-memory copy is kept...
        assert torch.equal(eng.fetch("t"), t)  # ...so the data is not lost
        t2 = torch.randn(300_000)
        eng.offload("t", t2).wait()  # replacing works once the disk recovers
        eng.release("t")
        assert torch.equal(eng.fetch("t"), t2)


def test_read_eio_raises_at_fetch_and_retry_works(tier, tmp_path):
    _posix_or_kvikio(tier)
    inj = FaultInjector()
    with Engine(make_config(tier, tmp_path, fault_injector=inj)) as eng:
        t = torch.randn(200_000)
        eng.offload("t", t)
        eng.release("t")
        inj.fail("read", errno.EIO, times=1)
        with pytest.raises(DiskIOError, match="offset"):
            eng.fetch("t")
        assert torch.equal(eng.fetch("t"), t)


def test_checksum_mismatch_names_key_file_and_offset(tier, tmp_path):
    _posix_or_kvikio(tier)
    with Engine(make_config(tier, tmp_path, checksum="crc32c")) as eng:
        t = torch.randn(100_000)
        eng.offload("weights.7", t)
        eng.release("weights.7")
        chunk = eng._keys["weights.7"].entry.placement.chunks[1]
        path = eng._dirs[chunk.dir_idx].data_path
        flip_byte(path, chunk.file_offset + 17)  # corrupt one byte behind the engine's back
        with pytest.raises(ChecksumError) as info:
            eng.fetch("weights.7")
        err = info.value
        assert err.key == "weights.7" and err.path == str(path) and err.file_offset == chunk.file_offset
        assert "'weights.7'" in str(err) and str(path) in str(err) and str(chunk.file_offset) in str(err)
        assert eng.stats().checksum_failures == 1


def test_permission_error_at_start(tmp_path):
    inj = FaultInjector().fail("create", errno.EACCES)
    with pytest.raises(OffloadPermissionError, match=str(tmp_path)):
        Engine(RuntimeConfig(dirs=[tmp_path], fault_injector=inj))
    assert os.listdir(tmp_path) == []
    (tmp_path / "file").write_text("")
    with pytest.raises(RuntimeIOError, match="not a directory"):
        Engine(RuntimeConfig(dirs=[tmp_path / "file"]))


def _mount(fs_dir: Path, options: str) -> bool:
    fs_dir.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(fs_dir)], capture_output=True)
    return res.returncode == 0


def test_real_too_small_filesystem(tmp_path):
    """A 2 MiB filesystem: the start-up reservation and a mid-run allocation fail with OutOfSpaceError."""
    fs_dir = tmp_path / f"small-{uuid.uuid4().hex[:6]}"
    if os.geteuid() != 0 or not _mount(fs_dir, "size=2m,mode=0700"):
        pytest.skip("cannot mount a small filesystem here (needs root)")
    try:
        with pytest.raises(OutOfSpaceError, match=str(fs_dir)):
            Engine(RuntimeConfig(dirs=[fs_dir], reserve_bytes="8MiB"))
        with Engine(RuntimeConfig(dirs=[fs_dir], chunk_bytes=1 << 20)) as eng:
            a = torch.randn(256 << 10)  # 1 MiB fits
            eng.offload("a", a).wait()
            with pytest.raises(OutOfSpaceError) as info:
                eng.offload("b", torch.randn(512 << 10))  # 2 MiB more does not
            assert info.value.available_nbytes is not None
            assert info.value.available_nbytes < info.value.needed_nbytes
            eng.release("a")
            assert torch.equal(eng.fetch("a"), a)
        assert os.listdir(fs_dir) == []
    finally:
        subprocess.run(["umount", str(fs_dir)], check=False)


def test_read_only_filesystem_is_a_permission_error(tmp_path):
    fs_dir = tmp_path / f"ro-{uuid.uuid4().hex[:6]}"
    if os.geteuid() != 0 or not _mount(fs_dir, "size=1m,ro"):
        pytest.skip("cannot mount a read-only filesystem here (needs root)")
    try:
        with pytest.raises(OffloadPermissionError, match=str(fs_dir)):
            Engine(RuntimeConfig(dirs=[fs_dir]))
    finally:
        subprocess.run(["umount", str(fs_dir)], check=False)


def test_buffered_fallback_is_logged_with_reason(tmp_path, caplog):
    with Engine(RuntimeConfig(dirs=[tmp_path], direct_io=False)) as eng:
        assert eng.stats().io_path == "posix-buffered"
    assert "buffered I/O + fsync + fadvise(DONTNEED)" in caplog.text and "direct_io=False" in caplog.text
