"""teraio: train PyTorch models whose activations do not fit in memory, with planned offload.

Use ``torch.compile(model, backend="teraio")`` or ``torch.compile(model, backend=teraio.backend(...))``.
Imports are lazy so that ``teraio --help`` does not pay for importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["backend", "default_backend", "process_stats", "TeraioBackend", "BackendConfig", "__version__"]

if TYPE_CHECKING:
    from teraio.lifecycle import BackendConfig, TeraioBackend, default_backend


def backend(**options: Any) -> TeraioBackend:
    """A configured backend: ``torch.compile(model, backend=teraio.backend(memory_budget="50%"))``.

    The options are those of :class:`teraio.config.BackendConfig` (the README's option table).
    """
    from teraio.lifecycle import TeraioBackend

    return TeraioBackend(**options)


def process_stats() -> list[dict[str, Any]]:
    """Every live backend of this process, what it holds and did (``teraio.process.process_stats``)."""
    from teraio.process import process_stats as stats

    return stats()


def __getattr__(name: str) -> Any:
    # The lifecycle module imports torch: load it only when one of its names is asked for.
    if name in ("default_backend", "TeraioBackend", "BackendConfig"):
        import teraio.lifecycle as lifecycle

        return getattr(lifecycle, name)
    raise AttributeError(f"module 'teraio' has no attribute {name!r}")
