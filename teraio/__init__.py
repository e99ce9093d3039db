"""teraio: train PyTorch models whose activations do not fit in memory, with planned offload.

Use ``torch.compile(model, backend="teraio")`` or ``torch.compile(model, backend=teraio.backend(...))``.
Imports are lazy so that ``teraio --help`` does not pay for importing torch.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["backend", "default_backend", "TeraioBackend", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("backend", "default_backend", "TeraioBackend", "BackendConfig"):
        from teraio import backend as _backend_mod

        return getattr(_backend_mod, name)
    raise AttributeError(f"module 'teraio' has no attribute {name!r}")
