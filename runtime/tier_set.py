"""The engine's tiers by name, opened from its config: host memory always, the SSD tier over its
offload directories unless the backend is host, and any tier plugged in.

Opening the SSD tier means creating this process's private subdirectories (reserving space up front
when asked), then the posix or kvikio tier over them; a failure on the way closes what was opened. A
request names its tier (or takes the default), and a wrong name gets an error that lists the valid
ones. The counters of each offload directory (one per SSD) come from here too, and so does the order
of closing: tiers first, then their directories.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

from teraio.runtime.config import ResolvedConfig
from teraio.runtime.device import Device
from teraio.runtime.errors import ConfigError
from teraio.runtime.space import OffloadDir
from teraio.runtime.stats import DirStats, tb_per_day
from teraio.runtime.tiers.base import Ability, Chunk, FileBacked, ReadPathCounts, Tier
from teraio.runtime.tiers.host import HostTier


class TierSet:
    """Tiers by name and the offload directories under the file tiers, owned (and closed) together.

    Args:
        config: the engine's resolved config (directories, chunk size, reservation, faults).
        backend: the I/O backend already chosen ("host", "posix" or "kvikio").
        device: the device every stream, event and copy goes through.
        plugged: more tiers (or replacements) by name; each one's ``name`` must be its key.

    Raises:
        ConfigError: a plugged tier's name differs from its key.
        OSError, OutOfSpaceError: an offload directory could not be created or reserved.
    """

    def __init__(
        self, config: ResolvedConfig, backend: str, device: Device, plugged: Mapping[str, Tier] | None
    ) -> None:
        self.backend = backend
        self.dirs: list[OffloadDir] = []
        host = HostTier(
            chunk_nbytes=config.chunk_nbytes, capacity_nbytes=config.host_capacity_nbytes, device=device
        )
        self._tiers: dict[str, Tier] = {host.name: host}
        try:
            if backend != "host":
                ssd = self._open_ssd_tier(config)
                self._tiers[ssd.name] = ssd
            for name, tier in (plugged or {}).items():
                if tier.name != name:
                    raise ConfigError(
                        f"tiers={{{name!r}: ...}}: the tier's name is {tier.name!r}; use the same"
                    )
                self._tiers[name] = tier
        except BaseException:
            for odir in self.dirs:
                odir.close()
            raise
        self.default = "host" if backend == "host" else "ssd"

    def _open_ssd_tier(self, cfg: ResolvedConfig) -> Tier:
        for base in cfg.dirs:
            self.dirs.append(
                OffloadDir(base, rank=cfg.rank, direct_io=cfg.direct_io, fault_injector=cfg.fault_injector)
            )
        if cfg.reserve_nbytes:
            for odir in self.dirs:
                odir.reserve(reserve_share(cfg.reserve_nbytes, len(self.dirs), cfg.chunk_nbytes))
        if self.backend == "kvikio":
            from teraio.runtime.tiers.gds import KvikioTier

            return KvikioTier(
                self.dirs,
                chunk_nbytes=cfg.chunk_nbytes,
                io_threads=cfg.io_threads,
                fault_injector=cfg.fault_injector,
            )
        from teraio.runtime.tiers.posix import PosixTier

        return PosixTier(
            self.dirs,
            chunk_nbytes=cfg.chunk_nbytes,
            fault_injector=cfg.fault_injector,
            bounce_reads=cfg.bounce_reads,
        )

    @property
    def by_name(self) -> dict[str, Tier]:
        """A copy of the tiers by name."""
        return dict(self._tiers)

    def get(self, tier: str | None) -> Tier:
        """The tier called ``tier`` (None: the default one).

        Raises:
            ConfigError: no such tier here (the message lists the names that are).
        """
        name = tier or self.default
        found = self._tiers.get(name)
        if found is not None:
            return found
        if name == "ssd":
            raise ConfigError("tier 'ssd' needs offload directories; this engine runs backend 'host'")
        names = ", ".join(repr(n) for n in sorted({"ssd", *self._tiers}))
        raise ConfigError(f"tier={tier!r} is not a tier: use {names} or None (the default tier)")

    def chunk_path(self, chunk: Chunk) -> str:
        """Where ``chunk`` lives, for error messages."""
        if chunk.dir_idx < 0:
            return "<host memory>"
        return str(self.dirs[chunk.dir_idx].data_path)

    def default_io_path(self) -> str:
        """The I/O path of the default tier (e.g. "posix-odirect"), as the stats report it."""
        return self._tiers[self.default].io_path

    def dir_stats(self, elapsed_s: float) -> tuple[DirStats, ...]:
        """The counters of each offload directory, endurance projected over ``elapsed_s``."""
        files = [t for t in self._tiers.values() if Ability.FILES in t.abilities]
        dir_io_path = cast(FileBacked, files[0]).dir_io_path if files else None
        return tuple(
            DirStats(
                path=str(d.base),
                io_path=dir_io_path(i) if dir_io_path else "none",
                bytes_written=d.usage.bytes_written,
                bytes_read=d.usage.bytes_read,
                file_capacity_nbytes=d.capacity_nbytes,
                used_nbytes=d.allocator.used_nbytes,
                peak_used_nbytes=d.allocator.peak_used_nbytes,
                tb_written_per_day=tb_per_day(d.usage.bytes_written, elapsed_s),
            )
            for i, d in enumerate(self.dirs)
        )

    def read_nbytes(self) -> dict[str, int]:
        """Bytes read per read path ("direct", "bounce", ...), summed over the tiers that count them."""
        read_nbytes: dict[str, int] = {}
        for tier in self._tiers.values():
            if Ability.READ_PATH_COUNTS in tier.abilities:
                for path, n in cast(ReadPathCounts, tier).read_nbytes.items():
                    read_nbytes[path] = read_nbytes.get(path, 0) + n
        return read_nbytes

    def close_tiers(self) -> None:
        """Close every tier (before :meth:`close_dirs`: a tier's files live in the directories)."""
        for tier in self._tiers.values():
            tier.close()

    def close_dirs(self) -> None:
        """Remove this process's offload files and subdirectories."""
        for odir in self.dirs:
            odir.close()


def reserve_share(reserve_nbytes: int, ndirs: int, chunk_nbytes: int) -> int:
    """Bytes each of ``ndirs`` directories preallocates for a total reservation of ``reserve_nbytes``.

    Requests are striped chunk by chunk onto the least-used directory (``runtime.tiers.posix``), so a
    directory only grows while it holds no more than an even share; it can then exceed that share by
    at most one chunk. An even share plus one chunk per directory therefore holds any set of requests
    totalling ``reserve_nbytes`` without growing a file mid-step.
    """
    if ndirs <= 1:
        return reserve_nbytes
    return -(-reserve_nbytes // ndirs) + chunk_nbytes
