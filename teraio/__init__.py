"""teraio: train PyTorch models whose activations do not fit in memory, with planned offload.

Use ``torch.compile(model, backend="teraio")`` or ``torch.compile(model, backend=teraio.backend(...))``.
Imports are lazy so that ``teraio --help`` does not pay for importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "backend",
    "default_backend",
    "process_stats",
    "warm_up_mkl_vml",
    "TeraioBackend",
    "BackendConfig",
    "__version__",
]

if TYPE_CHECKING:
    from teraio.lifecycle.backend import BackendConfig, TeraioBackend, default_backend


def backend(**options: Any) -> TeraioBackend:
    """A configured backend: ``torch.compile(model, backend=teraio.backend(memory_budget="50%"))``.

    The options are those of :class:`teraio.config.BackendConfig` (the README's option table).
    """
    from teraio.lifecycle.backend import TeraioBackend

    return TeraioBackend(**options)


def process_stats() -> list[dict[str, Any]]:
    """Every live backend of this process, what it holds and did (``teraio.lifecycle.registry.process_stats``)."""
    from teraio.lifecycle.registry import process_stats as stats

    return stats()


def warm_up_mkl_vml() -> tuple[tuple[str, str], ...]:
    """Run each unary op ATen may hand to MKL VML once on one element, on this thread, so that no
    later concurrent first call can pick a low-accuracy kernel (Note: [MKL VML's first concurrent call]
    in teraio.platform.mkl_vml). Constructing a backend does it; a reference loop without teraio can call it."""
    from teraio.platform.mkl_vml import warm_up_mkl_vml as warm

    return warm()


def __getattr__(name: str) -> Any:
    # The lifecycle module imports torch: load it only when one of its names is asked for.
    if name in ("default_backend", "TeraioBackend", "BackendConfig"):
        import teraio.lifecycle.backend as lifecycle

        return getattr(lifecycle, name)
    raise AttributeError(f"module 'teraio' has no attribute {name!r}")
