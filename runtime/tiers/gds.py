"""The kvikio tier: GPUDirect Storage for CUDA tensors (kvikio's POSIX compat path otherwise).

kvikio's default compat mode AUTO falls back to POSIX without telling anyone, so this tier asks
kvikio which path it resolved to and reports it (``io_path`` "kvikio-gds" or "kvikio-compat", logged
once). Space, striping and file safety are shared with the POSIX tier: the files are created by
:class:`runtime.space.OffloadDir` (0600, O_EXCL|O_NOFOLLOW, inside a 0700 directory) and kvikio
reopens them by path. Ordering with CUDA streams is the engine's job (see the engine's notes).

Nothing here runs on a GPU in this project's CI (there is none); the host-memory path is tested on
CPU with a stand-in CUDA driver (runtime.testing.load_cuda_driver_standin).
"""

from __future__ import annotations

import logging

import torch

from teraio.runtime.errors import ConfigError, RuntimeIOError, map_os_error
from teraio.runtime.space import OffloadDir
from teraio.runtime.tiers.base import Chunk, Placement
from teraio.runtime.tiers.posix import PosixTier

log = logging.getLogger(__name__)


def kvikio_status() -> tuple[bool, str]:
    """Whether kvikio can be imported, and why not."""
    try:
        import kvikio  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "not usable"
        return False, f"kvikio not importable ({type(exc).__name__}: {exc})"
    return True, "kvikio importable"


def kvikio_io_path() -> tuple[str, str]:
    """Return ("kvikio-gds" | "kvikio-compat", reason) as kvikio itself resolves its compat mode."""
    import kvikio.defaults

    mode = kvikio.defaults.get("compat_mode")
    mode = {0: "OFF", 1: "ON", 2: "AUTO"}.get(int(mode), str(mode)) if isinstance(mode, int) else str(mode)
    if kvikio.defaults.is_compat_mode_preferred():
        return "kvikio-compat", f"kvikio compat_mode={mode}: cuFile/GDS unavailable or disabled, POSIX I/O"
    return "kvikio-gds", f"kvikio compat_mode={mode}: cuFile (GPUDirect Storage) in use"


class KvikioTier(PosixTier):
    """Offload files read and written through kvikio.CuFile, one per directory."""

    name = "ssd"
    group_chunks = None  # reads go through kvikio chunk by chunk, never the POSIX tier's preadv

    def __init__(self, dirs: list[OffloadDir], *, chunk_nbytes: int, fault_injector=None) -> None:
        ok, reason = kvikio_status()
        if not ok:
            raise ConfigError(f"backend 'kvikio' unavailable: {reason}; install the 'gds' extra or use posix")
        import kvikio

        super().__init__(dirs, chunk_nbytes=chunk_nbytes, fault_injector=fault_injector)
        self.io_path, why = kvikio_io_path()
        log.warning("kvikio tier: %s (%s)", self.io_path, why)
        self._files = []
        try:
            for odir in dirs:
                self._files.append(kvikio.CuFile(str(odir.data_path), "r+"))
        except Exception as exc:
            for f in self._files:
                f.close()
            raise RuntimeIOError(f"kvikio could not open {odir.data_path}: {exc}") from exc

    def new_buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        if device.type == "cuda":
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        return super().new_buffer(nbytes, device)

    @staticmethod
    def _as_kvikio_buffer(t: torch.Tensor):
        # kvikio takes __cuda_array_interface__ objects (torch CUDA tensors) or host arrays (numpy).
        return t if t.device.type == "cuda" else t.numpy()

    def write_chunk(self, placement: Placement, chunk: Chunk, src: torch.Tensor) -> None:
        odir = self.dirs[chunk.dir_idx]
        piece = src[chunk.region_offset : chunk.region_offset + chunk.nbytes]
        try:
            if self._inject:
                self._inject("write", str(odir.data_path), chunk.file_offset, chunk.nbytes)
            f = self._files[chunk.dir_idx]
            nwritten = f.pwrite(
                self._as_kvikio_buffer(piece), chunk.nbytes, chunk.file_offset, task_size=chunk.nbytes
            ).get()
            if nwritten != chunk.nbytes:
                raise OSError(5, f"kvikio wrote {nwritten} of {chunk.nbytes} bytes")
        except OSError as exc:
            raise map_os_error(
                exc,
                action="write",
                path=str(odir.data_path),
                directory=str(odir.base),
                needed_nbytes=chunk.nbytes,
                file_offset=chunk.file_offset,
            ) from exc
        except RuntimeError as exc:  # kvikio raises RuntimeError for cuFile/POSIX failures
            raise RuntimeIOError(
                f"kvikio write of {chunk.nbytes} bytes at {odir.data_path} offset {chunk.file_offset} "
                f"failed: {exc}",
                path=str(odir.data_path),
            ) from exc
        with self._usage_lock:
            odir.usage.bytes_written += chunk.nbytes

    def read_chunk(self, placement: Placement, chunk: Chunk, dst: torch.Tensor) -> None:
        odir = self.dirs[chunk.dir_idx]
        piece = dst[chunk.region_offset : chunk.region_offset + chunk.nbytes]
        try:
            if self._inject:
                self._inject("read", str(odir.data_path), chunk.file_offset, chunk.nbytes)
            f = self._files[chunk.dir_idx]
            nread = f.pread(
                self._as_kvikio_buffer(piece), chunk.nbytes, chunk.file_offset, task_size=chunk.nbytes
            ).get()
            if nread != chunk.nbytes:
                raise OSError(5, f"kvikio read {nread} of {chunk.nbytes} bytes")
        except OSError as exc:
            raise map_os_error(
                exc,
                action="read",
                path=str(odir.data_path),
                directory=str(odir.base),
                needed_nbytes=chunk.nbytes,
                file_offset=chunk.file_offset,
            ) from exc
        except RuntimeError as exc:
            raise RuntimeIOError(
                f"kvikio read of {chunk.nbytes} bytes at {odir.data_path} offset {chunk.file_offset} "
                f"failed: {exc}",
                path=str(odir.data_path),
            ) from exc
        with self._usage_lock:
            odir.usage.bytes_read += chunk.nbytes

    def finish_write(self, placement: Placement) -> None:
        # kvikio writes with O_DIRECT where it can (auto_direct_io_write); when the file is not
        # O_DIRECT-capable the POSIX tier's fsync + DONTNEED still keeps the page cache honest.
        super().finish_write(placement)

    def close(self) -> None:
        for f in self._files:
            try:
                f.close()
            except Exception as exc:  # noqa: BLE001 - keep closing; report below
                log.warning("closing a kvikio file failed: %s", exc)
        self._files = []
        super().close()
