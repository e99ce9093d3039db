"""Test seams of the runtime: injected disk faults and a stand-in CUDA driver for kvikio on CPU.

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
/* Test-only stand-in for libcuda.so.1: enough for kvikio to believe no CUDA context exists and
 * treat every buffer as host memory, so its real POSIX path runs on a machine without a GPU. */
typedef int CUresult;
CUresult cuInit(unsigned int flags) { return 0; }
CUresult cuDriverGetVersion(int *v) { if (v) *v = 12040; return 0; }
static const char *msg = "CUDA stand-in: not initialized";
CUresult cuGetErrorString(CUresult e, const char **s) { if (s) *s = msg; return 0; }
CUresult cuGetErrorName(CUresult e, const char **s) { if (s) *s = "CUDA_ERROR_NOT_INITIALIZED"; return 0; }
#define NI(name) CUresult name() { return 3; }
NI(cuMemHostAlloc) NI(cuMemFreeHost) NI(cuMemcpyHtoDAsync_v2) NI(cuMemcpyDtoHAsync_v2)
NI(cuPointerGetAttribute) NI(cuPointerGetAttributes) NI(cuCtxPushCurrent_v2) NI(cuCtxPopCurrent_v2)
NI(cuCtxGetCurrent) NI(cuCtxGetDevice) NI(cuCtxCreate_v2) NI(cuCtxCreate_v4) NI(cuCtxDestroy_v2)
NI(cuMemGetAddressRange_v2) NI(cuDeviceGet) NI(cuDeviceGetCount) NI(cuDeviceGetAttribute)
NI(cuDevicePrimaryCtxRetain) NI(cuDevicePrimaryCtxRelease_v2) NI(cuStreamCreate)
NI(cuStreamSynchronize) NI(cuStreamDestroy_v2) NI(cuEventCreate) NI(cuEventRecord) NI(cuEventQuery)
NI(cuEventSynchronize) NI(cuEventDestroy_v2) NI(cuLaunchHostFunc) NI(cuMemcpyBatchAsync)
NI(cuMemcpyBatchAsync_v2) NI(cuMemHostRegister_v2) NI(cuMemHostUnregister) NI(cuMemHostGetDevicePointer_v2)
NI(cuMemAlloc_v2) NI(cuMemFree_v2) NI(cuMemcpy) NI(cuMemcpyAsync) NI(cuCtxSetCurrent) NI(cuCtxSynchronize)
NI(cuDeviceGetName) NI(cuDeviceGetPCIBusId) NI(cuDriverGetAttribute) NI(cuGetProcAddress)
NI(cuGetProcAddress_v2) NI(cuStreamQuery) NI(cuCtxGetApiVersion) NI(cuDeviceTotalMem_v2)
"""

_standin_lock = threading.Lock()
_standin_handle: ctypes.CDLL | None = None


def load_cuda_driver_standin(build_dir: str | os.PathLike[str] | None = None) -> ctypes.CDLL:
    """Build (with gcc) and load, RTLD_GLOBAL, a fake ``libcuda.so.1`` so kvikio's POSIX path runs on CPU.

    Test-only: never call this where a real CUDA driver is present (it would shadow it). Must run
    before kvikio performs its first I/O. Idempotent within a process.

    Raises:
        RuntimeError: gcc is missing or the build failed.
    """
    global _standin_handle
    with _standin_lock:
        if _standin_handle is not None:
            return _standin_handle
        out_dir = Path(build_dir) if build_dir else Path(tempfile.mkdtemp(prefix="teraio-cuda-standin-"))
        src = out_dir / "standin.c"
        lib = out_dir / "libcuda.so.1"
        src.write_text(_STANDIN_SOURCE)
        try:
            subprocess.run(
                ["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(lib), str(src)],
                check=True,
                capture_output=True,
                text=True,
            )
        except (OSError, subprocess.CalledProcessError) as exc:
            raise RuntimeError(f"could not build the CUDA driver stand-in with gcc: {exc}") from exc
        _standin_handle = ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
        return _standin_handle
