"""Resolve MKL VML's kernel dispatch before any concurrent use, so a fresh process computes the same bits.

Note: [MKL VML's first concurrent call]
    On CPU, ATen hands contiguous float32 and float64 unary ops (``sqrt``, ``exp``, ``log``, ``tanh``, ...) to
    MKL's vector math library, split across the intra-op threads (2048 elements per thread at least). The
    oneMKL bundled with the torch wheels (2024.2, the version ``torch.__config__.show()`` prints) picks each
    function's kernel on that function's first call. When the first call of a function in a process runs on
    two threads at once, one thread can run a low-accuracy kernel (the AVX2 "enhanced performance" one, about
    12 correct bits) on its whole share, although ATen asks for high accuracy. Later calls are correct. So a
    fresh process may compute one op of its first step differently from every later run: PyTorch issue 188792
    (open, with a fix proposed in pull request 188791; oneMKL 2025.0 and later do not race). Evidence:
    benchmarks/results/states_resume_flake_202611.md.

    teraio promises the same bits as the loop without it, and resuming in a fresh process is part of
    that promise; so constructing a backend calls :func:`warm_up_mkl_vml` first: each such op once, on
    one element of each dtype, on the calling thread (one element never splits across threads), which
    resolves every dispatch before training can call it concurrently. A loop that runs big unary ops
    before it constructs a backend, or a reference loop without teraio, can call
    ``teraio.warm_up_mkl_vml()`` itself first.
"""

from __future__ import annotations

import threading

#: The unary ops ATen may route to MKL VML, with an input inside every op's domain. A name that is not
#: VML-routed in some torch version costs one tiny op and changes nothing.
VML_OPS: tuple[str, ...] = (
    "abs",
    "acos",
    "asin",
    "atan",
    "cos",
    "cosh",
    "erf",
    "erfc",
    "erfinv",
    "exp",
    "expm1",
    "lgamma",
    "log",
    "log10",
    "log1p",
    "log2",
    "reciprocal",
    "rsqrt",
    "sin",
    "sinh",
    "sqrt",
    "tan",
    "tanh",
    "trunc",
)
_WARM_INPUT = 0.5  # inside the domain of every op above (acos, asin and erfinv need |x| < 1)

_lock = threading.Lock()
_warmed: tuple[tuple[str, str], ...] | None = None


def warm_up_mkl_vml() -> tuple[tuple[str, str], ...]:
    """Note: [MKL VML's first concurrent call]: run every VML-routed unary op once on one element of
    float32 and of float64, on this thread. Returns the (op, dtype) pairs run; empty when torch was built
    without MKL. Idempotent: later calls return the first call's pairs without running anything."""
    global _warmed
    with _lock:
        if _warmed is not None:
            return _warmed
        import torch

        done: list[tuple[str, str]] = []
        if torch.backends.mkl.is_available():
            with torch.no_grad():
                for dtype in (torch.float32, torch.float64):
                    x = torch.full((1,), _WARM_INPUT, dtype=dtype)
                    for name in VML_OPS:
                        getattr(torch, name)(x)
                        done.append((name, str(dtype).removeprefix("torch.")))
        _warmed = tuple(done)
        return _warmed


def mkl_vml_warmed() -> bool:
    """Whether :func:`warm_up_mkl_vml` has run in this process."""
    return _warmed is not None
