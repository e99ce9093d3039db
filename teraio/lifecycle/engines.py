"""The runtime engines a backend starts, configured from its options in one place.

A backend talks to the runtime through engines: the one its graphs' ``teraio::`` ops call, the one of
its states (``states="offload"``), and a short-lived one on which transfer probes time round trips.
Which directories, which I/O backend, which rank, what checksum: those follow from the backend's config
the same way for each, so the mapping lives here and nowhere else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from teraio.lifecycle.ranks import rank_info

if TYPE_CHECKING:
    from teraio.config import BackendConfig
    from teraio.runtime import RuntimeConfig


def runtime_config(cfg: BackendConfig, reserve_bytes: int | None = None) -> RuntimeConfig:
    """The runtime config of an engine that holds the backend's tensors (its graphs' or its states').

    Args:
        cfg: the backend's config.
        reserve_bytes: bytes the engine reserves at start (None: the runtime's default).
    """
    from teraio.runtime import RuntimeConfig

    # None: TERAIO_OFFLOAD_DIRS, else the runtime's per-user directory, where a killed run's
    # leftovers are found and removed by the next start.
    dirs = cfg.offload_dirs_for(rank_info()) or ()
    io_backend = cfg.io_backend
    if set(cfg.tiers) == {"host"}:
        io_backend = "host"
    reserve: dict[str, Any] = {} if reserve_bytes is None else {"reserve_bytes": reserve_bytes}
    # One subdirectory per process and rank (DDP, torchrun): the runtime names them by both.
    return RuntimeConfig(
        dirs=dirs,
        backend=io_backend,
        **reserve,
        checksum=cfg.checksum,
        **{"rank": rank_info().rank, **cfg.runtime_options},
    )


def calibration_runtime_config(cfg: BackendConfig) -> RuntimeConfig:
    """The runtime config of a posix engine on the directory the offloads go to first: what
    ``hardware="calibrate"`` times, and where transfer probes make their round trips."""
    from teraio.runtime import RuntimeConfig
    from teraio.runtime.space import make_base_dirs

    dirs = cfg.offload_dirs_for(rank_info()) or ()
    directory = RuntimeConfig(dirs=dirs, backend="posix").resolved().dirs[0]
    make_base_dirs(directory)
    return RuntimeConfig(dirs=[directory], backend="posix", checksum=cfg.checksum)


def round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple
