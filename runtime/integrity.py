"""Checksums of offloaded chunks, so a read that returns wrong bytes raises instead of training on them."""

from __future__ import annotations

from collections.abc import Callable

from teraio.runtime.buffers import address_view
from teraio.runtime.errors import ConfigError

ChecksumFn = Callable[[int, int], int]


def make_checksum(name: str | None) -> ChecksumFn | None:
    """Return ``fn(addr, nbytes) -> int`` for "crc32c" or "xxhash" (None for no checksum).

    Both libraries release the GIL on large buffers, so checksums run in parallel on the I/O threads.

    Raises:
        ConfigError: the library for ``name`` is not installed.
    """
    if name is None:
        return None
    if name == "crc32c":
        import crc32c

        return lambda addr, nbytes: crc32c.crc32c(address_view(addr, nbytes))
    if name == "xxhash":
        try:
            import xxhash
        except ImportError as exc:
            raise ConfigError("checksum='xxhash' needs the xxhash package: pip install xxhash") from exc
        return lambda addr, nbytes: xxhash.xxh3_64_intdigest(address_view(addr, nbytes))
    raise ConfigError(f"checksum={name!r}: use 'crc32c' or 'xxhash'")
