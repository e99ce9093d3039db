"""The kvikio tier: GPUDirect Storage for CUDA tensors where the machine really does P2P DMA, and
kvikio's POSIX path with teraio's own pinned staging everywhere else.

What each file really does is decided per file and reported (``dir_io_path``, ``dir_io_reason``, one
log line): "kvikio-gds" only when the file was registered with cuFile with kvikio's compat mode OFF
(so a refusal raises instead of falling back silently), the nvidia-fs driver is loaded (cuFile's
``is_gds_available``: without it cuFile serves registered files through its own compat mode, e.g. on
cloud GPUs without nvidia-fs), cuFile's configuration forbids that compat mode (``allow_compat_mode``
false, so a registration proves P2P DMA), and cuFile's stream API can serve kvikio's stream-ordered
calls. Everything else is "kvikio-compat", with the reason. kvikio 26.10, source reading (no GPU here;
docs/gpu_checklist.md says which claims come from where):

- kvikio's own compat path for device memory (``posix_device_io``) copies through its pinned bounce
  buffer on a stream it creates per thread with ``CU_STREAM_DEFAULT``, a blocking stream: every copy
  waits for all kernels queued on the legacy default stream (torch's compute stream), and kvikio then
  synchronises that stream on its thread. Its ``raw_read_async`` in compat mode first synchronises the
  stream it is given. So on compat files kvikio never sees device memory here: the I/O thread reads
  into one of its pinned staging slots (host memory: kvikio's plain POSIX path, no stream) and copies
  to the device itself on its own non-blocking read stream (Note: [Staging slots are recycled by
  events], runtime/staging.py); writes copy down into a slot first (Note: [A write waits for its source
  bytes]).
- A registered file opened in compat mode AUTO whose stream API is unusable (no ``cuFileReadAsync``,
  or no cuFile config file) makes ``raw_*_async`` synchronise the given stream and call the
  synchronous read, which synchronises the null stream first. So this tier never opens a file in AUTO
  mode, and where the machine has no cuFile config (neither ``CUFILE_ENV_PATH_JSON`` nor
  /etc/cufile.json) the first kvikio tier of the process writes one into its own offload directory
  (``allow_compat_mode`` false) and points ``CUFILE_ENV_PATH_JSON`` at it while cuFile starts
  (Note: [teraio's cuFile configuration]).
- GDS files: Note: [GDS reads land in staging first].

Host tensors use kvikio's ``pread``/``pwrite`` (host memory never involves a stream). kvikio's thread
pool is sized to the runtime's I/O threads (its default is one thread, which would funnel reads behind
writes). Compat reads go through the page cache (kvikio's ``auto_direct_io_read`` is off by default),
so the read range is dropped from it afterwards (fadvise DONTNEED), as the POSIX tier does for
buffered reads.

Note: [GDS reads land in staging first]
    A read's buffer is allocated on the compute stream (Note: [CUDA ordering] (4), runtime/engine.py):
    a cuFile read into it would have to wait for the compute stream to reach that point, and checking
    how many bytes it moved (``check_bytes_done``, which synchronises its stream; so does dropping the
    future) would then wait on compute. So a GDS read lands in a device staging slot on a stream of its
    own that carries nothing else (``DeviceIO.gds_stream``): waiting for it is waiting for the disk
    (``HostWait.DISK_READ``), like a POSIX pread. The I/O thread then copies the slot into the buffer
    on its read stream, behind the allocation's event; the slot is recycled by that copy's event. One
    device-to-device copy per chunk buys a read path that never waits on compute. Writes go straight
    from the tensor on the write stream (after the producer) and wait for their bytes (Note: [A write
    waits for its source bytes]).

Note: [teraio's cuFile configuration]
    cuFile reads its configuration once per process, when its driver opens, and kvikio caches the
    path it found (``config_path()``, a static). So the decision is made once, by the first kvikio
    tier of the process, before any cuFile call: an existing ``CUFILE_ENV_PATH_JSON`` or
    /etc/cufile.json is used as it is (and checked: ``allow_compat_mode`` true there keeps files on
    "kvikio-compat", logged with the fix); otherwise teraio writes ``{"properties":
    {"allow_compat_mode": false}}`` into its own offload directory (0600, removed at close) and sets
    ``CUFILE_ENV_PATH_JSON`` while its files are opened, then restores the environment (child
    processes do not inherit a path that disappears). If something else in the process used cuFile
    before the first engine, cuFile already runs with whatever it found then.

Space, striping and file safety are shared with the POSIX tier: the files are created by
:class:`runtime.space.OffloadDir` (0600, O_EXCL|O_NOFOLLOW, inside a 0700 directory) and kvikio
reopens them by path. Nothing here has run on a GPU in this project's CI (there is none); the host
and compat device paths are tested on CPU with the stand-in driver of ``runtime.testing``, the GDS
device path with its fake cuFile (``runtime.testing.fake_cufile``).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import threading
from typing import Any, Literal

import torch

from teraio.runtime.device import HostWait, host_wait
from teraio.runtime.errors import ConfigError, RuntimeIOError, map_os_error
from teraio.runtime.space import CUFILE_CONFIG_NAME, OffloadDir
from teraio.runtime.staging import DeviceIO
from teraio.runtime.tiers.base import Ability, Chunk, Placement
from teraio.runtime.tiers.posix import PosixTier

log = logging.getLogger(__name__)

ENV_CUFILE_CONFIG = "CUFILE_ENV_PATH_JSON"
SYSTEM_CUFILE_CONFIG = "/etc/cufile.json"
#: What teraio writes when the machine has no cuFile configuration (Note: [teraio's cuFile configuration]).
TERAIO_CUFILE_CONFIG = {"properties": {"allow_compat_mode": False}}

KvikioPath = Literal["kvikio-gds", "kvikio-compat"]


def kvikio_status() -> tuple[bool, str]:
    """Whether kvikio can be imported, and why not."""
    try:
        import kvikio  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "not usable"
        return False, f"kvikio not importable ({type(exc).__name__}: {exc})"
    return True, "kvikio importable"


def _compat_mode_name(mode: object) -> str:
    return {0: "OFF", 1: "ON", 2: "AUTO"}.get(int(mode), str(mode)) if isinstance(mode, int) else str(mode)


def _driver_property(name: str) -> tuple[bool | None, str]:
    try:
        import kvikio.cufile_driver

        return bool(kvikio.cufile_driver.get(name)), f"cuFile driver property {name}"
    except Exception as exc:  # noqa: BLE001 - no libcufile / no driver: reported, not fatal
        return None, f"cuFile driver not queryable ({type(exc).__name__}: {exc})"


def gds_available() -> tuple[bool | None, str]:
    """cuFile's answer to "is the nvidia-fs driver loaded" (``is_gds_available``; None when the driver
    cannot be asked), and why. Without it cuFile serves registered files through its own compat mode."""
    return _driver_property("is_gds_available")


_config_lock = threading.Lock()
_process_config: tuple[str, str] | None = None  # (path or "", origin) cuFile saw in this process


def process_cufile_config() -> tuple[str, str] | None:
    """The cuFile configuration decided for this process (path, origin), once a kvikio tier started."""
    return _process_config


def _decide_cufile_config(odir: OffloadDir) -> tuple[tuple[str, str], str | None]:
    """Note: [teraio's cuFile configuration]. Returns ((path, origin), the env value to set while
    cuFile starts, or None to leave the environment alone)."""
    global _process_config
    with _config_lock:
        if _process_config is not None:
            return _process_config, None
        env = os.environ.get(ENV_CUFILE_CONFIG)
        if env and os.path.exists(env):
            decided, set_env = (env, f"{ENV_CUFILE_CONFIG} (yours)"), None
        elif os.path.exists(SYSTEM_CUFILE_CONFIG):
            decided, set_env = (SYSTEM_CUFILE_CONFIG, "the machine's"), None
        else:
            path = str(odir.write_private_file(CUFILE_CONFIG_NAME, json.dumps(TERAIO_CUFILE_CONFIG).encode()))
            decided, set_env = (path, "written by teraio: the machine has none"), path
        _process_config = decided
        return decided, set_env


def cufile_stream_api_status() -> tuple[bool, str]:
    """Whether cuFile's stream API can serve kvikio's raw async calls, as kvikio 26.10 decides it
    (``CompatModeManager``): libcufile exports ``cuFileReadAsync`` and a cuFile config file was found
    when kvikio first looked (``CUFILE_ENV_PATH_JSON`` or /etc/cufile.json)."""
    decided = _process_config
    config = decided[0] if decided else ""
    if not config:
        return False, "no cuFile config file (CUFILE_ENV_PATH_JSON or /etc/cufile.json)"
    try:
        lib = ctypes.CDLL("libcufile.so.0")
    except OSError as exc:
        return False, f"libcufile.so.0 not loadable ({exc})"
    if not hasattr(lib, "cuFileReadAsync"):
        return False, "libcufile has no stream API (cuFileReadAsync)"
    return True, f"cuFile stream API present, config {config}"


def gds_conditions() -> tuple[bool, str]:
    """Whether a file cuFile registered really does P2P DMA with stream-ordered calls, and why (not).

    Process-wide conditions (see the module docstring): nvidia-fs loaded, cuFile's compat mode
    forbidden by its configuration, cuFile's stream API usable.
    """
    gds, gds_why = gds_available()
    if not gds:
        return False, (
            f"nvidia-fs is not loaded (is_gds_available={gds}, {gds_why}): cuFile would serve the file "
            "through its own compat mode (POSIX), not P2P DMA"
        )
    allow, allow_why = _driver_property("allow_compat_mode")
    config = _process_config[0] if _process_config else "?"
    if allow is not False:
        return False, (
            f"cuFile's configuration {config} allows its compat mode (allow_compat_mode={allow}, "
            f"{allow_why}): a registered file may still run cuFile's POSIX fallback; set "
            '"allow_compat_mode": false under "properties" there to use GDS'
        )
    stream_ok, stream_why = cufile_stream_api_status()
    if not stream_ok:
        return False, f"{stream_why}: kvikio's stream-ordered calls would synchronise streams on the host"
    return True, f"cuFile registered it, nvidia-fs loaded, allow_compat_mode=false, {stream_why}"


def kvikio_io_path() -> tuple[KvikioPath, str]:
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
        (config, origin), set_env = _decide_cufile_config(dirs[0])
        saved_env = os.environ.get(ENV_CUFILE_CONFIG)
        if set_env is not None:
            os.environ[ENV_CUFILE_CONFIG] = set_env
        self._files: list = []
        self._dir_paths: list[KvikioPath] = []
        self._dir_reasons: list[str] = []
        try:
            wanted, why = kvikio_io_path()
            for odir in dirs:
                f, path, file_why = self._open(kvikio, odir, want_gds=wanted == "kvikio-gds")
                self._files.append(f)
                self._dir_paths.append(path)
                self._dir_reasons.append(file_why)
        except BaseException:
            for f in self._files:
                f.close()
            raise
        finally:
            if set_env is not None:  # cuFile and kvikio have read it by now: do not leak it to children
                if saved_env is None:
                    os.environ.pop(ENV_CUFILE_CONFIG, None)
                else:
                    os.environ[ENV_CUFILE_CONFIG] = saved_env
        self.io_path = "kvikio-gds" if all(p == "kvikio-gds" for p in self._dir_paths) else "kvikio-compat"
        log.warning(
            "kvikio tier: %s (%s; cuFile config %s: %s; per directory: %s)",
            self.io_path,
            why,
            config or "<none>",
            origin,
            "; ".join(f"{d.base}={p} ({r})" for d, p, r in zip(dirs, self._dir_paths, self._dir_reasons)),
        )

    @staticmethod
    def _open(kvikio, odir: OffloadDir, *, want_gds: bool) -> tuple[Any, KvikioPath, str]:
        """Open ``odir``'s file: with compat mode OFF where GDS is wanted (a cuFile refusal raises) and kept
        only when :func:`gds_conditions` hold; otherwise (re)opened with compat mode ON. Never AUTO:
        see the module docstring. Returns (file, path, reason)."""
        path = str(odir.data_path)
        try:
            why = "kvikio prefers its compat mode (no usable cuFile)"
            if want_gds:
                try:
                    with kvikio.defaults.set("compat_mode", kvikio.CompatMode.OFF):
                        f = kvikio.CuFile(path, "r+")
                except Exception as exc:  # noqa: BLE001 - any cuFile/open failure: fall back, say why
                    why = f"cuFile cannot register it ({type(exc).__name__}: {exc})"
                    log.warning("kvikio: %s falls back to compat mode: %s", path, why)
                else:
                    usable, why = gds_conditions()
                    if usable:
                        return f, "kvikio-gds", why
                    f.close()
                    log.warning(
                        "kvikio: %s is registered with cuFile but stays on compat mode: %s", path, why
                    )
            with kvikio.defaults.set("compat_mode", kvikio.CompatMode.ON):
                return kvikio.CuFile(path, "r+"), "kvikio-compat", why
        except Exception as exc:
            raise RuntimeIOError(f"kvikio could not open {path}: {exc}", path=path) from exc

    def dir_io_path(self, dir_idx: int) -> str:
        return self._dir_paths[dir_idx]

    def dir_io_reason(self, dir_idx: int) -> str:
        """Why directory ``dir_idx`` takes the path :meth:`dir_io_path` reports."""
        return self._dir_reasons[dir_idx]

    def _transfer(self, action: str, chunk: Chunk, piece: torch.Tensor, io: DeviceIO | None) -> None:
        odir = self.dirs[chunk.dir_idx]
        f = self._files[chunk.dir_idx]
        n = chunk.nbytes
        try:
            if self._inject:
                self._inject(action, str(odir.data_path), chunk.file_offset, n)
            if io is None:  # host memory: kvikio's POSIX path (its thread pool), no stream involved
                moved = self._host_io(f, action, piece, chunk)
            elif self._dir_paths[chunk.dir_idx] == "kvikio-gds":
                moved = self._gds_device_io(f, action, piece, chunk, io)
            else:
                moved = self._staged_device_io(f, action, piece, chunk, io)
            if moved != n:
                raise OSError(5, f"kvikio {action} moved {moved} of {n} bytes")
            if action == "read" and self._dir_paths[chunk.dir_idx] == "kvikio-compat":
                os.posix_fadvise(odir.fd, chunk.file_offset, n, os.POSIX_FADV_DONTNEED)
        except OSError as exc:
            raise map_os_error(
                exc,
                action=action,
                path=str(odir.data_path),
                directory=str(odir.base),
                needed_nbytes=n,
                file_offset=chunk.file_offset,
            ) from exc
        except RuntimeError as exc:  # kvikio raises RuntimeError for cuFile/POSIX failures
            raise RuntimeIOError(
                f"kvikio {action} of {n} bytes at {odir.data_path} offset {chunk.file_offset} failed: {exc}",
                path=str(odir.data_path),
            ) from exc
        with self._usage_lock:
            if action == "read":
                odir.usage.bytes_read += n
            else:
                odir.usage.bytes_written += n

    @staticmethod
    def _host_io(f, action: str, host: torch.Tensor, chunk: Chunk) -> int:
        call = f.pread if action == "read" else f.pwrite
        return call(host.numpy(), chunk.nbytes, chunk.file_offset, task_size=chunk.nbytes).get()

    def _staged_device_io(self, f, action: str, piece: torch.Tensor, chunk: Chunk, io: DeviceIO) -> int:
        """A compat file and device bytes: kvikio moves host memory (a pinned staging slot), the I/O
        thread's own streams move the device side (see the module docstring)."""
        slot = io.acquire()
        staging = slot.buffer[: chunk.nbytes]
        if action == "write":
            io.download(staging, piece)  # Note: [A write waits for its source bytes]
            return self._host_io(f, "write", staging, chunk)
        moved = self._host_io(f, "read", staging, chunk)
        io.upload(piece, staging, slot)  # on the read stream, after the allocation; the slot stays busy
        return moved

    @staticmethod
    def _gds_device_io(f, action: str, piece: torch.Tensor, chunk: Chunk, io: DeviceIO) -> int:
        """A GDS file: cuFile's stream API on streams teraio owns (Note: [GDS reads land in staging first])."""
        dev = io.device
        n = chunk.nbytes
        if action == "write":
            future = f.raw_write_async(
                dev.cuda_array(piece), dev.raw_stream(io.write_stream), n, chunk.file_offset
            )
            with host_wait(HostWait.WRITE_SOURCE):
                return future.check_bytes_done()
        slot = io.acquire_device_slot()
        staging = slot.buffer[:n]
        future = f.raw_read_async(
            dev.cuda_array(staging), dev.raw_stream(io.gds_stream), n, chunk.file_offset
        )
        with host_wait(HostWait.DISK_READ):
            moved = future.check_bytes_done()
        del future  # checked: dropping it synchronises nothing more
        dev.record_stream(slot.buffer, io.read_stream)  # the slot's block is the GDS stream's
        io.upload(piece, staging, slot)
        return moved

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
