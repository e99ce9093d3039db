"""Corrupting an offload file behind the engine's back, for the checksum tests."""

from __future__ import annotations

import os


def flip_byte(path: str | os.PathLike, offset: int) -> None:
    """Invert every bit of the byte at ``offset`` (so the file really changes, whatever the byte was:
    writing a fixed value left a random tensor's file unchanged one time in 256) and sync it."""
    fd = os.open(path, os.O_RDWR)
    try:
        (old,) = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([old ^ 0xFF]), offset)
        os.fsync(fd)
    finally:
        os.close(fd)
