"""Gradients, optimizer states and (with ``parameters=True``) parameters offloaded to disk, the
optimizer step streamed.

``teraio.backend(states=teraio.States(optimizer=opt))`` attaches a :class:`StateOffload` to a stock
optimizer; :func:`attach_states` is what the backend calls. The options are :class:`teraio.States`
(:mod:`teraio.states.config`). With a ``memory_budget`` the budget is the whole
step's, and the parameters and optimizer states it leaves room for stay in memory (teraio.states.residency).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from teraio.planner.model_states import MOVED_KINDS
from teraio.states.errors import StatesError

if TYPE_CHECKING:
    from teraio.config import BackendConfig
    from teraio.states.offload import StateOffload

__all__ = ["StateOffload", "StatesError", "attach_states", "io_bytes_by_kind"]

#: The kinds of ``moved_bytes_by_kind``, in the order the backend reports them.
KINDS = MOVED_KINDS


def __getattr__(name: str) -> Any:
    if name == "StateOffload":  # imports torch: only when asked for
        from teraio.states.offload import StateOffload

        return StateOffload
    raise AttributeError(f"module 'teraio.states' has no attribute {name!r}")


def attach_states(cfg: BackendConfig) -> StateOffload | None:
    """The backend's StateOffload for ``cfg`` (None unless ``cfg.states`` is set and enabled), with its own
    engine on the backend's offload directories, I/O backend, checksum and runtime options."""
    states = cfg.states
    if states is None or not cfg.enabled:
        return None
    from teraio.lifecycle.engines import runtime_config
    from teraio.runtime.config import parse_nbytes
    from teraio.states.offload import StateOffload

    runtime = runtime_config(cfg)
    return StateOffload(
        states.optimizer,
        runtime_config=runtime,
        chunk_bytes=parse_nbytes(states.chunk_bytes),
        offload_gradients=states.gradients,
        optimizer_in_backward=states.optimizer_in_backward,
        model=states.model,
        offload_parameters=states.parameters,
        min_param_bytes=parse_nbytes(states.min_param_bytes),
        overlap_step=states.overlap_step,
    )


def io_bytes_by_kind(io_stats: dict[str, Any], states: StateOffload | None) -> dict[str, dict[str, int]]:
    """Bytes per kind since the start, under the keys ``stats()`` and ``stats.jsonl`` give them:
    ``written_bytes_by_kind``, ``read_bytes_by_kind`` and their sum ``moved_bytes_by_kind``.
    Activations come from the backend's own engine (``io_stats``: its ``offloaded_bytes`` and
    ``prefetched_bytes``), gradients, optimizer states and parameters from ``states``."""
    written, read = dict.fromkeys(KINDS, 0), dict.fromkeys(KINDS, 0)
    written["activation"] = int(io_stats.get("offloaded_bytes", 0))
    read["activation"] = int(io_stats.get("prefetched_bytes", 0))
    if states is not None:
        s = states.stats()
        for out, key in ((written, "written_bytes"), (read, "read_bytes")):
            for kind, nbytes in s[key].items():
                if kind != "activation":
                    out[kind] += nbytes
    return {
        "moved_bytes_by_kind": {k: written[k] + read[k] for k in KINDS},
        "written_bytes_by_kind": written,
        "read_bytes_by_kind": read,
    }
