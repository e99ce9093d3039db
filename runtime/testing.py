"""Test seams of the runtime: injected disk faults, a stand-in CUDA driver for kvikio on CPU, and a
fake cuFile for the kvikio tier's GPUDirect path.

The fake asynchronous device lives in :mod:`teraio.runtime.fake_device`; :func:`standin_device_memory`
connects it to the driver stand-in so kvikio sees its memory as device memory and its driver calls run
on the fake's streams. The stand-in is for machines without a GPU only: :func:`load_cuda_driver_standin`
refuses to load where a real driver is present (:func:`real_cuda_driver_present`), so a test suite run
on a GPU machine never runs against it.

Fault injection: ``RuntimeConfig(fault_injector=FaultInjector(...))``. The engine calls the injector
before every syscall on an offload file with ``(action, path, file_offset, nbytes)``, where action is
"create", "preallocate", "write" or "read"; an injector raises ``OSError(errno, ...)`` to make the
device fail there, and the runtime handles it exactly like a real failure (typed error at the request
that hit it). Example, a disk that fills up after 64 MiB of offloads::

    inj = FaultInjector()
    inj.fail("preallocate", errno.ENOSPC, after_nbytes=64 << 20)
    eng = Engine(RuntimeConfig(dirs=[d], fault_injector=inj))
"""

from __future__ import annotations

import ctypes
import errno as errno_mod
import os
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from teraio.runtime.buffers import address_view


@dataclass
class _Rule:
    action: str
    errno: int
    after_nbytes: int
    times: int | None
    path_contains: str | None
    seen_nbytes: int = 0
    fired: int = 0


class FaultInjector:
    """A callable fault seam with simple rules; thread-safe.

    ``fail(action, errno, after_nbytes=0, times=None, path_contains=None)`` makes the matching
    syscalls raise ``OSError(errno)`` once ``after_nbytes`` bytes of that action went through,
    at most ``times`` times (None = every time after). ``calls`` records every call seen.
    """

    ACTIONS = ("create", "preallocate", "write", "read")

    def __init__(self) -> None:
        self._rules: list[_Rule] = []
        self._lock = threading.Lock()
        self.calls: list[tuple[str, str, int, int]] = []

    def fail(
        self,
        action: str,
        errno: int = errno_mod.EIO,
        *,
        after_nbytes: int = 0,
        times: int | None = None,
        path_contains: str | None = None,
    ) -> FaultInjector:
        """Add a rule (see the class docstring); returns self for chaining."""
        if action not in self.ACTIONS:
            raise ValueError(f"action {action!r}: use one of {self.ACTIONS}")
        with self._lock:
            self._rules.append(_Rule(action, errno, after_nbytes, times, path_contains))
        return self

    def clear(self) -> None:
        """Remove every rule (the device "recovers")."""
        with self._lock:
            self._rules.clear()

    def __call__(self, action: str, path: str, file_offset: int, nbytes: int) -> None:
        with self._lock:
            self.calls.append((action, path, file_offset, nbytes))
            for rule in self._rules:
                if rule.action != action or (rule.path_contains and rule.path_contains not in path):
                    continue
                reached = (
                    rule.seen_nbytes >= rule.after_nbytes or rule.seen_nbytes + nbytes > rule.after_nbytes
                )
                if reached and (rule.times is None or rule.fired < rule.times):
                    rule.fired += 1
                    raise OSError(rule.errno, f"{os.strerror(rule.errno)} (injected)")
                rule.seen_nbytes += nbytes


_STANDIN_SOURCE = r"""
/* Test-only stand-in for libcuda.so.1, enough for kvikio 26.10 on a machine without a GPU.
 * Host memory: cuPointerGetAttributes fails with CUDA_ERROR_NOT_INITIALIZED, which kvikio reads as
 * "host memory", so its real POSIX path runs. Device memory: address ranges registered with
 * teraio_standin_register() are reported as device memory of device 0 in one fake context; kvikio's
 * compat path then stages them through its pinned bounce buffers (cuMemHostAlloc = aligned malloc)
 * with cuMemcpy*Async (= memcpy, counted) and synchronous streams, unless hooks are set
 * (teraio_standin_set_hooks): then streams, copies and stream synchronisations are the fake device's
 * (runtime.testing.standin_device_memory), so kvikio's own streams, blocking ones included, take part in
 * its ordering and its host-blocked detector. Stream creations are counted by their flags. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
#define OK 0
#define NOT_INITIALIZED 3
static void *const CTX = (void *)0x7e7a10;
static void *const STREAM = (void *)0x7e7a20;
#define MAX_RANGES 4096
static uintptr_t range_base[MAX_RANGES];
static size_t range_size[MAX_RANGES];
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static unsigned long long device_copies = 0, device_bytes = 0;
static unsigned long long blocking_streams = 0, nonblocking_streams = 0, next_stream = 0x5e000;
typedef int (*create_hook_t)(unsigned flags, unsigned long long handle);
typedef int (*copy_hook_t)(unsigned long long dst, unsigned long long src, size_t n, unsigned long long stream);
typedef int (*sync_hook_t)(unsigned long long stream);
static create_hook_t create_hook = 0;
static copy_hook_t copy_hook = 0;
static sync_hook_t sync_hook = 0;
void teraio_standin_set_hooks(create_hook_t c, copy_hook_t cp, sync_hook_t sy) {
  create_hook = c; copy_hook = cp; sync_hook = sy;
}
unsigned long long teraio_standin_blocking_streams(void) { return blocking_streams; }
unsigned long long teraio_standin_nonblocking_streams(void) { return nonblocking_streams; }

int teraio_standin_register(uintptr_t base, size_t size) {
  pthread_mutex_lock(&mu);
  for (int i = 0; i < MAX_RANGES; i++)
    if (range_size[i] == 0) { range_base[i] = base; range_size[i] = size; pthread_mutex_unlock(&mu); return 0; }
  pthread_mutex_unlock(&mu);
  return -1;
}
void teraio_standin_unregister(uintptr_t base) {
  pthread_mutex_lock(&mu);
  for (int i = 0; i < MAX_RANGES; i++)
    if (range_size[i] && range_base[i] == base) { range_size[i] = 0; break; }
  pthread_mutex_unlock(&mu);
}
unsigned long long teraio_standin_device_copies(void) { return device_copies; }
unsigned long long teraio_standin_device_bytes(void) { return device_bytes; }
static int find(uintptr_t p, uintptr_t *base, size_t *size) {
  int found = 0;
  pthread_mutex_lock(&mu);
  for (int i = 0; i < MAX_RANGES; i++)
    if (range_size[i] && p >= range_base[i] && p < range_base[i] + range_size[i]) {
      if (base) *base = range_base[i];
      if (size) *size = range_size[i];
      found = 1;
      break;
    }
  pthread_mutex_unlock(&mu);
  return found;
}
static int set_attr(int attr, void *data, CUdeviceptr p, uintptr_t base, size_t size) {
  switch (attr) {
    case 1: *(void **)data = CTX; return OK;                      /* CONTEXT */
    case 2: *(unsigned *)data = 2; return OK;                     /* MEMORY_TYPE = DEVICE */
    case 3: *(CUdeviceptr *)data = p; return OK;                  /* DEVICE_POINTER */
    case 4: *(void **)data = 0; return OK;                        /* HOST_POINTER */
    case 8: *(unsigned *)data = 0; return OK;                     /* IS_MANAGED */
    case 9: *(int *)data = 0; return OK;                          /* DEVICE_ORDINAL */
    case 11: *(CUdeviceptr *)data = base; return OK;              /* RANGE_START_ADDR */
    case 12: *(size_t *)data = size; return OK;                   /* RANGE_SIZE */
    default: return 1;                                            /* INVALID_VALUE */
  }
}
CUresult cuPointerGetAttributes(unsigned n, int *attrs, void **data, CUdeviceptr p) {
  uintptr_t base; size_t size;
  if (!find(p, &base, &size)) return NOT_INITIALIZED;
  for (unsigned i = 0; i < n; i++) set_attr(attrs[i], data[i], p, base, size);
  return OK;
}
CUresult cuPointerGetAttribute(void *data, int attr, CUdeviceptr p) {
  uintptr_t base; size_t size;
  if (!find(p, &base, &size)) return NOT_INITIALIZED;
  return set_attr(attr, data, p, base, size);
}
CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p) {
  uintptr_t b; size_t s;
  if (!find(p, &b, &s)) return 1;
  if (base) *base = b;
  if (size) *size = s;
  return OK;
}
#define HOOK_FAILED 999 /* CUDA_ERROR_UNKNOWN */
static CUresult copy(CUdeviceptr dst, CUdeviceptr src, size_t n, void *st) {
  if (find(dst, 0, 0) || find(src, 0, 0)) {
    __atomic_add_fetch(&device_copies, 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&device_bytes, n, __ATOMIC_RELAXED);
  }
  if (copy_hook) return copy_hook(dst, src, n, (unsigned long long)(uintptr_t)st) ? HOOK_FAILED : OK;
  memcpy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
  return OK;
}
CUresult cuStreamSynchronize(void *s) {
  if (sync_hook) return sync_hook((unsigned long long)(uintptr_t)s) ? HOOK_FAILED : OK;
  return OK;  /* without hooks, copies are synchronous */
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *s, size_t n, void *st) { return copy(d, (CUdeviceptr)(uintptr_t)s, n, st); }
CUresult cuMemcpyDtoHAsync_v2(void *d, CUdeviceptr s, size_t n, void *st) { return copy((CUdeviceptr)(uintptr_t)d, s, n, st); }
CUresult cuMemcpyAsync(CUdeviceptr d, CUdeviceptr s, size_t n, void *st) { return copy(d, s, n, st); }
CUresult cuMemcpy(CUdeviceptr d, CUdeviceptr s, size_t n) {
  CUresult r = copy(d, s, n, 0);  /* the legacy default stream, then wait: a synchronous copy */
  return r == OK ? cuStreamSynchronize(0) : r;
}
/* CUDA 12.8+ batch copy, which kvikio 26.10 (cu12) prefers on non-default streams; _v2 (CUDA 13) has no
 * failIdx argument. */
CUresult cuMemcpyBatchAsync(CUdeviceptr *d, CUdeviceptr *s, size_t *n, size_t count, void *attrs,
                            size_t *attr_idxs, size_t nattrs, size_t *fail_idx, void *st) {
  for (size_t i = 0; i < count; i++) { CUresult r = copy(d[i], s[i], n[i], st); if (r != OK) return r; }
  return OK;
}
CUresult cuMemcpyBatchAsync_v2(CUdeviceptr *d, CUdeviceptr *s, size_t *n, size_t count, void *attrs,
                               size_t *attr_idxs, size_t nattrs, void *st) {
  for (size_t i = 0; i < count; i++) { CUresult r = copy(d[i], s[i], n[i], st); if (r != OK) return r; }
  return OK;
}
CUresult cuMemHostAlloc(void **pp, size_t n, unsigned flags) {
  return posix_memalign(pp, 4096, n ? n : 1) == 0 ? OK : 2;
}
CUresult cuMemFreeHost(void *p) { free(p); return OK; }
CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned f) { return OK; }
CUresult cuMemHostUnregister(void *p) { return OK; }
CUresult cuInit(unsigned int flags) { return OK; }
CUresult cuDriverGetVersion(int *v) { if (v) *v = 12040; return OK; }
CUresult cuCtxPushCurrent_v2(void *c) { return OK; }
CUresult cuCtxPopCurrent_v2(void **c) { if (c) *c = CTX; return OK; }
CUresult cuCtxGetCurrent(void **c) { if (c) *c = CTX; return OK; }
CUresult cuCtxSetCurrent(void *c) { return OK; }
CUresult cuCtxGetDevice(int *d) { if (d) *d = 0; return OK; }
CUresult cuCtxSynchronize(void) { return OK; }
CUresult cuDeviceGet(int *d, int ordinal) { if (d) *d = ordinal; return OK; }
CUresult cuDevicePrimaryCtxRetain(void **c, int d) { if (c) *c = CTX; return OK; }
CUresult cuDevicePrimaryCtxRelease_v2(int d) { return OK; }
CUresult cuStreamCreate(void **s, unsigned f) {
  /* CU_STREAM_DEFAULT (0) is a blocking stream; CU_STREAM_NON_BLOCKING is 1. */
  __atomic_add_fetch((f & 1) ? &nonblocking_streams : &blocking_streams, 1, __ATOMIC_RELAXED);
  unsigned long long h = __atomic_add_fetch(&next_stream, 1, __ATOMIC_RELAXED);
  if (create_hook && create_hook(f, h)) return HOOK_FAILED;
  if (s) *s = create_hook ? (void *)(uintptr_t)h : STREAM;
  return OK;
}
CUresult cuStreamDestroy_v2(void *s) { return OK; }
static const char *msg = "CUDA stand-in: not initialized";
CUresult cuGetErrorString(CUresult e, const char **s) { if (s) *s = msg; return OK; }
CUresult cuGetErrorName(CUresult e, const char **s) { if (s) *s = "CUDA_ERROR_NOT_INITIALIZED"; return OK; }
#define NI(name) CUresult name() { return NOT_INITIALIZED; }
NI(cuCtxCreate_v2) NI(cuCtxCreate_v4) NI(cuCtxDestroy_v2) NI(cuDeviceGetCount) NI(cuDeviceGetAttribute)
NI(cuEventCreate) NI(cuEventRecord) NI(cuEventQuery) NI(cuEventSynchronize) NI(cuEventDestroy_v2)
NI(cuLaunchHostFunc) NI(cuMemHostGetDevicePointer_v2)
NI(cuMemAlloc_v2) NI(cuMemFree_v2) NI(cuDeviceGetName) NI(cuDeviceGetPCIBusId) NI(cuDriverGetAttribute)
NI(cuGetProcAddress) NI(cuGetProcAddress_v2) NI(cuStreamQuery) NI(cuCtxGetApiVersion) NI(cuDeviceTotalMem_v2)
"""

_standin_lock = threading.Lock()
_standin_handle: ctypes.CDLL | None = None


class StandinRefusedError(RuntimeError):
    """A real CUDA driver is present: the stand-in would shadow it (tests that need it skip)."""


def real_cuda_driver_present() -> bool:
    """Whether a real ``libcuda.so.1`` can be loaded in this process (asked before the stand-in is
    loaded; once it is, the name resolves to the stand-in, which exports ``teraio_standin_register``)."""
    if _standin_handle is not None:
        return False
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return not hasattr(lib, "teraio_standin_register")


def load_cuda_driver_standin(build_dir: str | os.PathLike[str] | None = None) -> ctypes.CDLL:
    """Build (with gcc) and load, RTLD_GLOBAL, a fake ``libcuda.so.1`` so kvikio's POSIX path runs on CPU.

    Test-only. Must run before kvikio performs its first I/O. Idempotent within a process. The source
    and library are written into a fresh private (0700) directory, made inside ``build_dir`` when one
    is given (the temp dir otherwise), never at a fixed name in a directory others may write.

    Raises:
        StandinRefusedError: a real CUDA driver is present (the stand-in would shadow it).
        RuntimeError: gcc is missing or the build failed.
    """
    global _standin_handle
    with _standin_lock:
        if _standin_handle is not None:
            return _standin_handle
        if real_cuda_driver_present():
            raise StandinRefusedError(
                "a real CUDA driver (libcuda.so.1) is present on this machine: the test stand-in would "
                "shadow it, so it is not loaded (tests that need it skip)"
            )
        out_dir = Path(tempfile.mkdtemp(prefix="teraio-cuda-standin-", dir=build_dir or None))
        src = out_dir / "standin.c"
        lib = out_dir / "libcuda.so.1"
        src.write_text(_STANDIN_SOURCE)
        try:
            subprocess.run(
                ["gcc", "-shared", "-fPIC", "-pthread", "-Wl,-soname,libcuda.so.1", "-o", str(lib), str(src)],
                check=True,
                capture_output=True,
                text=True,
            )
        except (OSError, subprocess.CalledProcessError) as exc:
            raise RuntimeError(f"could not build the CUDA driver stand-in with gcc: {exc}") from exc
        handle = ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
        handle.teraio_standin_register.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
        handle.teraio_standin_unregister.argtypes = [ctypes.c_size_t]
        handle.teraio_standin_device_copies.restype = ctypes.c_ulonglong
        handle.teraio_standin_device_bytes.restype = ctypes.c_ulonglong
        handle.teraio_standin_blocking_streams.restype = ctypes.c_ulonglong
        handle.teraio_standin_nonblocking_streams.restype = ctypes.c_ulonglong
        handle.teraio_standin_set_hooks.argtypes = [_CREATE_HOOK, _COPY_HOOK, _SYNC_HOOK]
        _standin_handle = handle
        return handle


_CREATE_HOOK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint, ctypes.c_ulonglong)
_COPY_HOOK = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.c_size_t, ctypes.c_ulonglong
)
_SYNC_HOOK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_ulonglong)
_stream_flags: dict[int, int] = {}  # the stand-in's stream handle -> cuStreamCreate flags (process-wide)
_hooks: tuple[Any, ...] | None = None  # the installed callbacks, kept alive while the library holds them


def _install_hooks(lib: ctypes.CDLL, fake: Any) -> None:
    """Route the stand-in's streams, copies and synchronisations to ``fake``.

    kvikio caches one stream per (context, thread) for the whole process, so a handle outlives the fake
    device it was first used with: each fake maps handles to its own streams on first use (blocking
    when the handle was created with ``CU_STREAM_DEFAULT``; 0 is the legacy default stream).
    """
    global _hooks
    streams: dict[int, Any] = {}

    def stream_of(handle: int) -> Any:
        if handle == 0:
            return fake.default_stream
        if handle not in streams:
            blocking = not (_stream_flags.get(handle, 0) & 1)
            streams[handle] = (
                fake.new_blocking_stream(f"driver{handle:#x}") if blocking else fake.new_stream(None)
            )
        return streams[handle]

    def create(flags: int, handle: int) -> int:
        _stream_flags[handle] = flags
        return 0

    def copy(dst: int, src: int, nbytes: int, handle: int) -> int:
        try:
            stream = stream_of(handle)

            def op() -> None:
                fake.log.append(("copy (driver)", stream.name))
                ctypes.memmove(dst, src, nbytes)

            seq = stream.enqueue(op)
            fake.queued_use(stream, seq, dst, nbytes, "copy (driver)")
            fake.queued_use(stream, seq, src, nbytes, "copy (driver)")
            return 0
        except Exception as exc:  # noqa: BLE001 - becomes a CUDA error for kvikio
            fake.errors.append(exc)
            return 1

    def sync(handle: int) -> int:
        try:
            fake.synchronize_stream(stream_of(handle))
            return 0
        except Exception:  # noqa: BLE001 - the detector recorded it in fake.errors already
            return 1

    _hooks = (_CREATE_HOOK(create), _COPY_HOOK(copy), _SYNC_HOOK(sync))
    lib.teraio_standin_set_hooks(*_hooks)


def release_standin_hooks() -> None:
    """Back to the plain stand-in (synchronous copies, no-op stream syncs): call when the fake closes."""
    global _hooks
    if _standin_handle is not None and _hooks is not None:
        _standin_handle.teraio_standin_set_hooks(_CREATE_HOOK(), _COPY_HOOK(), _SYNC_HOOK())
    _hooks = None


def standin_device_memory(fake) -> ctypes.CDLL:
    """Make the memory of ``fake`` (a :class:`teraio.runtime.fake_device.FakeDevice`) device memory for
    kvikio: each allocation's address range is registered with the driver stand-in (and unregistered
    when freed), so kvikio takes its device-memory branch for it, and the stand-in's streams, copies and
    stream synchronisations run on the fake (:func:`_install_hooks`; undo with
    :func:`release_standin_hooks`, which ``fake.close()`` calls). Returns the stand-in library, whose
    ``teraio_standin_device_copies()`` / ``teraio_standin_device_bytes()`` count kvikio's copies that
    touched such ranges (proof that the device branch ran), and ``teraio_standin_blocking_streams()`` /
    ``teraio_standin_nonblocking_streams()`` the streams created with and without
    ``CU_STREAM_NON_BLOCKING``.

    Test-only, like :func:`load_cuda_driver_standin` (which it calls).
    """
    lib = load_cuda_driver_standin()
    _install_hooks(lib, fake)
    close = fake.close

    def close_and_release() -> None:  # the hooks must not outlive the fake they run on
        release_standin_hooks()
        close()

    fake.close = close_and_release

    def on_alloc(addr: int, nbytes: int) -> None:
        if lib.teraio_standin_register(addr, nbytes) != 0:
            raise RuntimeError("CUDA driver stand-in: too many registered device ranges")

    fake.on_alloc = on_alloc
    fake.on_free = lib.teraio_standin_unregister
    return lib


class _Done:
    """A finished kvikio ``IOFuture`` (``get()`` returns the bytes moved)."""

    def __init__(self, nbytes: int) -> None:
        self._nbytes = nbytes

    def get(self) -> int:
        return self._nbytes

    def done(self) -> bool:
        return True


class _FakeStreamFuture:
    """kvikio's ``IOFutureStream`` on the fake device: ``check_bytes_done`` synchronises the stream (as
    kvikio 26.10's ``StreamFuture::check_bytes_done`` does), and so does dropping it unchecked (its
    destructor calls it)."""

    def __init__(self, fake: Any, stream: Any, result: list) -> None:
        self._fake, self._stream, self._result = fake, stream, result
        self._synced = False

    def check_bytes_done(self) -> int:
        if not self._synced:
            self._synced = True
            self._fake.synchronize_stream(self._stream)
        value = self._result[0]
        if isinstance(value, BaseException):
            raise RuntimeError(f"cuFile (fake) transfer failed: {value}")
        return value

    def __del__(self) -> None:
        if not self._synced:
            try:
                self.check_bytes_done()
            except Exception:  # noqa: BLE001 - a destructor; kvikio prints and goes on
                pass


def fake_cufile(fake: Any) -> type:
    """A stand-in for ``kvikio.CuFile`` on a GDS-registered file, for the fake device ``fake``: host
    buffers are read and written at once (kvikio's POSIX path), and ``raw_read_async``/
    ``raw_write_async`` run on the fake stream whose handle they are given, when the stream gets there,
    as cuFile's stream API does; the bytes move between the file and the raw device address then.
    Test-only: the kvikio tier's GPUDirect path on CPU (monkeypatch ``kvikio.CuFile`` with it and make
    ``runtime.tiers.gds.gds_conditions`` hold)."""

    class FakeCuFile:
        def __init__(self, path: str, flags: str = "r") -> None:
            self._fd = os.open(path, os.O_RDWR)

        def close(self) -> None:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

        def pread(self, buf: Any, size: int, file_offset: int = 0, task_size: int | None = None) -> _Done:
            return _Done(os.preadv(self._fd, [memoryview(buf).cast("B")[:size]], file_offset))

        def pwrite(self, buf: Any, size: int, file_offset: int = 0, task_size: int | None = None) -> _Done:
            return _Done(os.pwritev(self._fd, [memoryview(buf).cast("B")[:size]], file_offset))

        def _async(self, arr: Any, raw_stream: int, size: int, file_offset: int, write: bool):
            addr = arr.__cuda_array_interface__["data"][0]
            stream = fake.stream_for_handle(raw_stream)
            result: list = [None]
            fd = self._fd

            def op() -> None:
                view = address_view(addr, size)
                try:
                    moved = (
                        os.pwritev(fd, [view], file_offset) if write else os.preadv(fd, [view], file_offset)
                    )
                    result[0] = moved
                except OSError as exc:
                    result[0] = exc
                fake.log.append(("cufile write" if write else "cufile read", stream.name))

            seq = stream.enqueue(op)
            fake.queued_use(stream, seq, addr, size, "cufile write" if write else "cufile read")
            return _FakeStreamFuture(fake, stream, result)

        def raw_read_async(
            self, arr: Any, raw_stream: int, size: int, file_offset: int = 0, dev_offset: int = 0
        ):
            return self._async(arr, raw_stream, size, file_offset, write=False)

        def raw_write_async(
            self, arr: Any, raw_stream: int, size: int, file_offset: int = 0, dev_offset: int = 0
        ):
            return self._async(arr, raw_stream, size, file_offset, write=True)

    return FakeCuFile
