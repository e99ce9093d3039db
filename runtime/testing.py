"""Test seams of the runtime: injected disk faults and a stand-in CUDA driver for kvikio on CPU.

The fake asynchronous device lives in :mod:`teraio.runtime.fake_device`; :func:`standin_device_memory`
connects it to the driver stand-in so kvikio sees its memory as device memory.

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
 * with cuMemcpy*Async (= memcpy, counted) and synchronous streams. */
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
static CUresult copy(CUdeviceptr dst, CUdeviceptr src, size_t n) {
  if (find(dst, 0, 0) || find(src, 0, 0)) {
    __atomic_add_fetch(&device_copies, 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&device_bytes, n, __ATOMIC_RELAXED);
  }
  memcpy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
  return OK;
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *s, size_t n, void *st) { return copy(d, (CUdeviceptr)(uintptr_t)s, n); }
CUresult cuMemcpyDtoHAsync_v2(void *d, CUdeviceptr s, size_t n, void *st) { return copy((CUdeviceptr)(uintptr_t)d, s, n); }
CUresult cuMemcpyAsync(CUdeviceptr d, CUdeviceptr s, size_t n, void *st) { return copy(d, s, n); }
CUresult cuMemcpy(CUdeviceptr d, CUdeviceptr s, size_t n) { return copy(d, s, n); }
/* CUDA 12.8+ batch copy, which kvikio 26.10 (cu12) prefers on non-default streams; _v2 (CUDA 13) has no
 * failIdx argument. */
CUresult cuMemcpyBatchAsync(CUdeviceptr *d, CUdeviceptr *s, size_t *n, size_t count, void *attrs,
                            size_t *attr_idxs, size_t nattrs, size_t *fail_idx, void *st) {
  for (size_t i = 0; i < count; i++) copy(d[i], s[i], n[i]);
  return OK;
}
CUresult cuMemcpyBatchAsync_v2(CUdeviceptr *d, CUdeviceptr *s, size_t *n, size_t count, void *attrs,
                               size_t *attr_idxs, size_t nattrs, void *st) {
  for (size_t i = 0; i < count; i++) copy(d[i], s[i], n[i]);
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
CUresult cuStreamCreate(void **s, unsigned f) { if (s) *s = STREAM; return OK; }
CUresult cuStreamSynchronize(void *s) { return OK; }  /* copies above are synchronous */
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


def load_cuda_driver_standin(build_dir: str | os.PathLike[str] | None = None) -> ctypes.CDLL:
    """Build (with gcc) and load, RTLD_GLOBAL, a fake ``libcuda.so.1`` so kvikio's POSIX path runs on CPU.

    Test-only: never call this where a real CUDA driver is present (it would shadow it). Must run
    before kvikio performs its first I/O. Idempotent within a process. The source and library are
    written into a fresh private (0700) directory, made inside ``build_dir`` when one is given (the
    temp dir otherwise), never at a fixed name in a directory others may write.

    Raises:
        RuntimeError: gcc is missing or the build failed.
    """
    global _standin_handle
    with _standin_lock:
        if _standin_handle is not None:
            return _standin_handle
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
        _standin_handle = handle
        return handle


def standin_device_memory(fake) -> ctypes.CDLL:
    """Make the memory of ``fake`` (a :class:`teraio.runtime.fake_device.FakeDevice`) device memory for
    kvikio: each allocation's address range is registered with the driver stand-in (and unregistered
    when freed), so kvikio takes its device-memory branch for it. Returns the stand-in library, whose
    ``teraio_standin_device_copies()`` / ``teraio_standin_device_bytes()`` count kvikio's copies that
    touched such ranges (proof that the device branch ran).

    Test-only, like :func:`load_cuda_driver_standin` (which it calls).
    """
    lib = load_cuda_driver_standin()

    def on_alloc(addr: int, nbytes: int) -> None:
        if lib.teraio_standin_register(addr, nbytes) != 0:
            raise RuntimeError("CUDA driver stand-in: too many registered device ranges")

    fake.on_alloc = on_alloc
    fake.on_free = lib.teraio_standin_unregister
    return lib
