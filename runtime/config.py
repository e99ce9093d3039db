"""The runtime's one configuration dataclass, plus size parsing and backend selection from the environment.

Machine-level settings come from ``TERAIO_*`` environment variables only where the caller left the
option unset, so an explicit argument always wins and a job script can steer the backend without code.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from teraio.runtime.errors import ConfigError
from teraio.sizes import SizeError, nbytes_of

PAGE_NBYTES = 4096
BACKENDS = ("auto", "posix", "kvikio", "host")
CHECKSUMS = ("crc32c", "xxhash")
ENV_BACKEND = "TERAIO_IO_BACKEND"
ENV_DIRS = "TERAIO_OFFLOAD_DIRS"
ENV_XDG_CACHE = "XDG_CACHE_HOME"


def default_offload_dir() -> Path:
    """The per-user offload directory used when none is given: ``$XDG_CACHE_HOME/teraio/offload``
    (``~/.cache/teraio/offload`` by default).

    Stable across runs on purpose: every engine start removes the subdirectories that crashed or
    killed runs left there (``runtime.space.clean_stale_subdirs``), which a fresh temporary directory
    per run would never find again. It is on the home disk rather than in the temp dir because /tmp is
    often tmpfs, where offloading saves no memory. Without a usable home it falls back to a per-user
    directory in the temp dir (``teraio-<uid>/offload``): the engine creates both levels 0700 and
    refuses them unless they are this user's and writable by nobody else (``runtime.space.make_base_dirs``),
    since whoever owns ``teraio-<uid>`` controls what is inside it.
    """
    cache = os.environ.get(ENV_XDG_CACHE, "")
    if cache and os.path.isabs(cache):
        return Path(cache) / "teraio" / "offload"
    home = os.path.expanduser("~")
    if home and home != "~" and os.path.isabs(home) and os.path.isdir(home):
        return Path(home) / ".cache" / "teraio" / "offload"
    import tempfile

    return Path(tempfile.gettempdir()) / f"teraio-{os.geteuid()}" / "offload"


def parse_nbytes(value: int | float | str, *, what: str = "size") -> int:
    """Parse a byte count: an int, a float, or text with a unit ("512MiB", "2GB", "1.5e9", "4096").

    The grammar is the project's one size grammar, :mod:`teraio.sizes` (a leaf module the planner shares).

    Raises:
        ConfigError: the value is negative, not a number, or has an unknown unit (the message names
            ``what``).
    """
    try:
        return nbytes_of(value, what)
    except SizeError as e:
        raise ConfigError(str(e)) from None


# A fault injector is called before every syscall that touches an offload file, with the action
# ("create", "preallocate", "write", "read"), the file path, the file offset and the byte count; it
# may raise OSError to simulate the device failing. See teraio.runtime.testing.FaultInjector.
FaultInjectorFn = Callable[[str, str, int, int], None]


@dataclass
class RuntimeConfig:
    """Options of the offload engine.

    Attributes:
        dirs: offload directories, one per SSD; requests are striped across them. Default: the
            colon-separated ``TERAIO_OFFLOAD_DIRS``, else :func:`default_offload_dir` (per user,
            stable, so leftovers of killed runs are found and removed). Unused by the host backend.
        backend: ``auto|posix|kvikio|host``; None reads ``TERAIO_IO_BACKEND`` (default ``auto``).
        io_threads: I/O worker threads (each runs one chunk at a time).
        chunk_bytes: size of one I/O request and the stripe unit across directories (multiple of 4096).
        reserve_bytes: bytes to preallocate at start, split over ``dirs`` the way requests are striped
            (each directory reserves its share plus one chunk, the most striping can put on one
            directory beyond an even share); the engine fails at start if they do not fit (size the
            planned offloaded bytes here).
        host_capacity_bytes: limit of the host-memory tier; None means unlimited.
        checksum: True (default, = "crc32c"), "crc32c", "xxhash", or False to opt out: one checksum per
            chunk, computed on write and verified on read, so corrupted bytes raise ChecksumError
            instead of training on them.
        rank: distributed rank, part of the per-process subdirectory name.
        direct_io: None tries O_DIRECT and falls back to buffered I/O + fsync + fadvise(DONTNEED)
            with a logged reason; False forces that fallback; True fails if O_DIRECT is refused.
        bounce_reads: True reads every O_DIRECT chunk through the I/O thread's aligned buffer and
            copies it out, even into a 4096-aligned fetched tensor (to test or compare that path);
            False (default) reads straight into aligned tensors (see ``runtime.tiers.posix``).
        fault_injector: test seam, see :data:`FaultInjectorFn` and ``runtime.testing.FaultInjector``.
    """

    dirs: Sequence[str | os.PathLike[str]] = ()
    backend: str | None = None
    io_threads: int = 2
    chunk_bytes: int | float | str = 4 << 20
    reserve_bytes: int | float | str = 0
    host_capacity_bytes: int | float | str | None = None
    checksum: bool | str = True
    rank: int = 0
    direct_io: bool | None = None
    bounce_reads: bool = False
    fault_injector: FaultInjectorFn | None = field(default=None, repr=False)

    def resolved(self) -> ResolvedConfig:
        """Validate every option and return the normalised config the engine runs with.

        Raises:
            ConfigError: naming the bad option and the accepted values.
        """
        backend = self.backend if self.backend is not None else os.environ.get(ENV_BACKEND, "auto")
        backend = backend.strip().lower()
        if backend not in BACKENDS:
            src = "backend" if self.backend is not None else ENV_BACKEND
            raise ConfigError(f"{src}={backend!r} is not a backend: use one of {', '.join(BACKENDS)}")
        dirs: Sequence[Any] = self.dirs
        if isinstance(dirs, (str, os.PathLike)):
            dirs = [dirs]
        if not dirs and os.environ.get(ENV_DIRS):
            dirs = [d for d in os.environ[ENV_DIRS].split(":") if d]
        for d in dirs:
            if not isinstance(d, (str, os.PathLike)) or os.fspath(d) == "":
                raise ConfigError(f"dirs must be non-empty paths, got {d!r}")
        paths = tuple(Path(os.path.abspath(os.fspath(d))) for d in dirs)
        if len(set(paths)) != len(paths):
            raise ConfigError(f"dirs lists a directory twice: {[str(p) for p in paths]}")
        if backend != "host" and not paths:
            paths = (default_offload_dir(),)
        if not isinstance(self.io_threads, int) or isinstance(self.io_threads, bool) or self.io_threads < 1:
            raise ConfigError(f"io_threads must be an int >= 1, got {self.io_threads!r}")
        chunk_nbytes = parse_nbytes(self.chunk_bytes, what="chunk_bytes")
        if chunk_nbytes <= 0 or chunk_nbytes % PAGE_NBYTES:
            raise ConfigError(f"chunk_bytes must be a positive multiple of 4096, got {self.chunk_bytes!r}")
        reserve_nbytes = parse_nbytes(self.reserve_bytes, what="reserve_bytes")
        host_capacity = (
            None
            if self.host_capacity_bytes is None
            else parse_nbytes(self.host_capacity_bytes, what="host_capacity_bytes")
        )
        if self.checksum is True:
            checksum: str | None = "crc32c"
        elif self.checksum is False or self.checksum is None:
            checksum = None
        elif isinstance(self.checksum, str) and self.checksum.lower() in CHECKSUMS:
            checksum = self.checksum.lower()
        else:
            raise ConfigError(f"checksum={self.checksum!r}: use False, True, 'crc32c' or 'xxhash'")
        if not isinstance(self.rank, int) or self.rank < 0:
            raise ConfigError(f"rank must be an int >= 0, got {self.rank!r}")
        if self.direct_io not in (None, True, False):
            raise ConfigError(f"direct_io must be None, True or False, got {self.direct_io!r}")
        if not isinstance(self.bounce_reads, bool):
            raise ConfigError(f"bounce_reads must be True or False, got {self.bounce_reads!r}")
        return ResolvedConfig(
            dirs=paths,
            backend=backend,
            io_threads=self.io_threads,
            chunk_nbytes=chunk_nbytes,
            reserve_nbytes=reserve_nbytes,
            host_capacity_nbytes=host_capacity,
            checksum=checksum,
            rank=self.rank,
            direct_io=self.direct_io,
            bounce_reads=self.bounce_reads,
            fault_injector=self.fault_injector,
        )


@dataclass(frozen=True)
class ResolvedConfig:
    """A validated :class:`RuntimeConfig` with sizes in bytes and the backend chosen."""

    dirs: tuple[Path, ...]
    backend: str
    io_threads: int
    chunk_nbytes: int
    reserve_nbytes: int
    host_capacity_nbytes: int | None
    checksum: str | None
    rank: int
    direct_io: bool | None
    bounce_reads: bool
    fault_injector: FaultInjectorFn | None
