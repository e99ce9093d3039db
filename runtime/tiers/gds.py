"""The kvikio tier: GPUDirect Storage for CUDA tensors (kvikio's POSIX compat path otherwise).

Which path really runs is decided per file by cuFile, not by kvikio's global preference: kvikio's
compat mode AUTO falls back to POSIX silently when a file cannot be registered with cuFile. So where
GDS is wanted (kvikio does not prefer compat mode), each file is opened with compat mode forced OFF,
which makes a registration failure raise; the tier then logs the reason and reopens that file in compat
mode. ``io_path`` is "kvikio-gds" only when every file is registered with cuFile ("kvikio-compat"
otherwise), and each directory's path is reported in the stats (``dir_io_path``). Whether cuFile says
GDS is available at all (``is_gds_available``) is logged with it.

Device tensors (kvikio 26.10, see docs/gpu_checklist.md):
- Transfers use ``raw_read_async``/``raw_write_async`` on the I/O thread's own stream. kvikio's
  ``pread``/``pwrite`` synchronise the legacy default stream before a GDS transfer, i.e. torch's compute
  stream: every transfer would wait for all queued training kernels. The raw calls do not. cuFile's
  stream API is ordered on the stream; kvikio's compat path for them is not (it copies through its
  own bounce buffer and stream), so the I/O thread synchronises its stream first (it waits for the
  producer or the buffer's allocation, never the compute stream) and waits for each transfer
  (``check_bytes_done``) before the next, which the write path needs anyway.
- Host tensors keep ``pread``/``pwrite`` (host memory never syncs a stream).
kvikio's thread pool is sized to the runtime's I/O threads (its default is one thread, which would
funnel reads behind writes). Compat-mode reads go through the page cache (kvikio's
``auto_direct_io_read`` is off by default), so the read range is dropped from it afterwards
(fadvise DONTNEED), as the POSIX tier does for buffered reads.

Space, striping and file safety are shared with the POSIX tier: the files are created by
:class:`runtime.space.OffloadDir` (0600, O_EXCL|O_NOFOLLOW, inside a 0700 directory) and kvikio
reopens them by path. Nothing here has run on a GPU in this project's CI (there is none); the host
and device-memory paths are tested on CPU with the stand-in driver of ``runtime.testing``.
"""

from __future__ import annotations

import ctypes
import logging
import os

import torch

from teraio.runtime.errors import ConfigError, RuntimeIOError, map_os_error
from teraio.runtime.space import OffloadDir
from teraio.runtime.staging import DeviceIO
from teraio.runtime.tiers.base import Ability, Chunk, Placement
from teraio.runtime.tiers.posix import PosixTier

log = logging.getLogger(__name__)


def kvikio_status() -> tuple[bool, str]:
    """Whether kvikio can be imported, and why not."""
    try:
        import kvikio  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "not usable"
        return False, f"kvikio not importable ({type(exc).__name__}: {exc})"
    return True, "kvikio importable"


def _compat_mode_name(mode: object) -> str:
    return {0: "OFF", 1: "ON", 2: "AUTO"}.get(int(mode), str(mode)) if isinstance(mode, int) else str(mode)


def gds_available() -> tuple[bool | None, str]:
    """cuFile's own answer to "is GDS available" (None when the driver cannot be asked), and why."""
    try:
        import kvikio.cufile_driver

        return bool(kvikio.cufile_driver.get("is_gds_available")), "cuFile driver property is_gds_available"
    except Exception as exc:  # noqa: BLE001 - no libcufile / no driver: reported, not fatal
        return None, f"cuFile driver not queryable ({type(exc).__name__}: {exc})"


def cufile_stream_api_status() -> tuple[bool, str]:
    """Whether cuFile's stream-ordered API can serve kvikio's raw async calls, as kvikio 26.10 decides
    it: the library exports ``cuFileReadAsync`` and a cuFile config file exists (``CUFILE_ENV_PATH_JSON``
    or /etc/cufile.json). Asked after a file was registered, so libcufile is already loaded."""
    env = os.environ.get("CUFILE_ENV_PATH_JSON")
    config = (
        env
        if env and os.path.exists(env)
        else ("/etc/cufile.json" if os.path.exists("/etc/cufile.json") else "")
    )
    if not config:
        return False, "no cuFile config file (CUFILE_ENV_PATH_JSON or /etc/cufile.json)"
    try:
        lib = ctypes.CDLL("libcufile.so.0")
    except OSError as exc:
        return False, f"libcufile.so.0 not loadable ({exc})"
    if not hasattr(lib, "cuFileReadAsync"):
        return False, "libcufile has no stream API (cuFileReadAsync)"
    return True, f"cuFile stream API present, config {config}"


def kvikio_io_path() -> tuple[str, str]:
    """kvikio's global preference: ("kvikio-gds" | "kvikio-compat", reason). Files may still fall back."""
    import kvikio.defaults

    mode = _compat_mode_name(kvikio.defaults.get("compat_mode"))
    if kvikio.defaults.is_compat_mode_preferred():
        return "kvikio-compat", f"kvikio compat_mode={mode}: cuFile/GDS unavailable or disabled, POSIX I/O"
    return "kvikio-gds", f"kvikio compat_mode={mode}: cuFile (GPUDirect Storage) wanted"


class KvikioTier(PosixTier):
    """Offload files read and written through kvikio.CuFile, one per directory."""

    name = "ssd"
    # Reads go through kvikio chunk by chunk, never the POSIX tier's preadv groups.
    abilities: frozenset[Ability] = frozenset({Ability.READ_PATH_COUNTS, Ability.FILES})

    def __init__(
        self, dirs: list[OffloadDir], *, chunk_nbytes: int, io_threads: int, fault_injector=None
    ) -> None:
        ok, reason = kvikio_status()
        if not ok:
            raise ConfigError(f"backend 'kvikio' unavailable: {reason}; install the 'gds' extra or use posix")
        import kvikio
        import kvikio.defaults

        super().__init__(dirs, chunk_nbytes=chunk_nbytes, fault_injector=fault_injector)
        # Note: kvikio's pool is process-wide; the last engine opened sets it.
        kvikio.defaults.set("num_threads", io_threads)
        wanted, why = kvikio_io_path()
        gds, gds_why = gds_available()
        self._files: list = []
        self._dir_paths: list[str] = []
        try:
            for odir in dirs:
                f, path = self._open(kvikio, odir, want_gds=wanted == "kvikio-gds")
                self._files.append(f)
                self._dir_paths.append(path)
        except BaseException:
            for f in self._files:
                f.close()
            raise
        self.io_path = "kvikio-gds" if all(p == "kvikio-gds" for p in self._dir_paths) else "kvikio-compat"
        log.warning(
            "kvikio tier: %s (%s; is_gds_available=%s from %s; per directory: %s)",
            self.io_path,
            why,
            gds,
            gds_why,
            ", ".join(f"{d.base}={p}" for d, p in zip(dirs, self._dir_paths)),
        )

    @staticmethod
    def _open(kvikio, odir: OffloadDir, *, want_gds: bool):
        """Open ``odir``'s file; where GDS is wanted, with compat mode OFF so a cuFile failure raises.

        kvikio 26.10 refuses stream-ordered calls on a file opened with compat mode OFF when cuFile's
        stream API or its config file is missing (``validate_compat_mode_for_async``); such a file is
        reopened in AUTO mode (registration already succeeded, so it stays on GDS) and its device
        transfers then synchronise the default CUDA stream first, which is logged.
        """
        path = str(odir.data_path)
        try:
            if want_gds:
                try:
                    with kvikio.defaults.set("compat_mode", kvikio.CompatMode.OFF):
                        f = kvikio.CuFile(path, "r+")
                except Exception as exc:  # noqa: BLE001 - any cuFile/open failure: fall back, say why
                    log.warning(
                        "kvikio: cuFile cannot register %s (%s: %s); this file falls back to compat mode",
                        path,
                        type(exc).__name__,
                        exc,
                    )
                else:
                    usable, why = cufile_stream_api_status()
                    if usable:
                        return f, "kvikio-gds"
                    f.close()
                    log.warning(
                        "kvikio: %s is on GDS but %s: its device transfers synchronise the default CUDA "
                        "stream (the compute stream) before each call",
                        path,
                        why,
                    )
                    with kvikio.defaults.set("compat_mode", kvikio.CompatMode.AUTO):
                        return kvikio.CuFile(path, "r+"), "kvikio-gds"
            with kvikio.defaults.set("compat_mode", kvikio.CompatMode.ON):
                return kvikio.CuFile(path, "r+"), "kvikio-compat"
        except Exception as exc:
            raise RuntimeIOError(f"kvikio could not open {path}: {exc}", path=path) from exc

    def dir_io_path(self, dir_idx: int) -> str:
        return self._dir_paths[dir_idx]

    def _transfer(self, action: str, chunk: Chunk, piece: torch.Tensor, io: DeviceIO | None) -> None:
        odir = self.dirs[chunk.dir_idx]
        f = self._files[chunk.dir_idx]
        try:
            if self._inject:
                self._inject(action, str(odir.data_path), chunk.file_offset, chunk.nbytes)
            if io is None:  # host memory: kvikio's POSIX path (its thread pool), no stream involved
                call = f.pread if action == "read" else f.pwrite
                moved = call(piece.numpy(), chunk.nbytes, chunk.file_offset, task_size=chunk.nbytes).get()
            else:
                io.synchronize()  # producer / allocation waits are on this stream: see module doc
                call = f.raw_read_async if action == "read" else f.raw_write_async
                arr = io.device.cuda_array(piece)
                moved = call(
                    arr, io.device.raw_stream(io.stream), chunk.nbytes, chunk.file_offset
                ).check_bytes_done()
            if moved != chunk.nbytes:
                raise OSError(5, f"kvikio {action} moved {moved} of {chunk.nbytes} bytes")
            if action == "read" and self._dir_paths[chunk.dir_idx] == "kvikio-compat":
                os.posix_fadvise(odir.fd, chunk.file_offset, chunk.nbytes, os.POSIX_FADV_DONTNEED)
        except OSError as exc:
            raise map_os_error(
                exc,
                action=action,
                path=str(odir.data_path),
                directory=str(odir.base),
                needed_nbytes=chunk.nbytes,
                file_offset=chunk.file_offset,
            ) from exc
        except RuntimeError as exc:  # kvikio raises RuntimeError for cuFile/POSIX failures
            raise RuntimeIOError(
                f"kvikio {action} of {chunk.nbytes} bytes at {odir.data_path} offset {chunk.file_offset} "
                f"failed: {exc}",
                path=str(odir.data_path),
            ) from exc
        with self._usage_lock:
            if action == "read":
                odir.usage.bytes_read += chunk.nbytes
            else:
                odir.usage.bytes_written += chunk.nbytes

    def write_chunk(self, placement: Placement, chunk: Chunk, src: torch.Tensor, io: DeviceIO | None) -> None:
        self._transfer("write", chunk, src[chunk.region_offset : chunk.region_offset + chunk.nbytes], io)

    def read_chunk(self, placement: Placement, chunk: Chunk, dst: torch.Tensor, io: DeviceIO | None) -> None:
        self._transfer("read", chunk, dst[chunk.region_offset : chunk.region_offset + chunk.nbytes], io)
        with self._usage_lock:
            self.read_nbytes["direct" if self._dir_paths[chunk.dir_idx] == "kvikio-gds" else "buffered"] += (
                chunk.nbytes
            )

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
