"""Checksums of device reads whose verdicts arrive later than the read.

A device read's checksums run on its read stream behind its copies, and the I/O thread that queued
them does not wait for them (Note: [Device checks are read later] in teraio.runtime.engine). Someone
must still read every verdict and raise on a mismatch, or a corrupted read would go unreported. This
module keeps the pending checks of one engine and reads them: without waiting, those whose event
completed (at the start of each request), or all of them, waiting (``synchronize``, ``close``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from teraio.runtime.device import Device, HostWait, PendingChecksum, host_wait
from teraio.runtime.key_table import Entry
from teraio.runtime.staging import DeviceIO
from teraio.runtime.stats import StatsCollector
from teraio.runtime.tiers.base import Chunk
from teraio.runtime.transfers import _Request, checksum_error


@dataclass(eq=False)
class _DeviceCheck:
    """A device checksum of one read chunk whose verdict is read later (Note: [Device checks are read
    later] in teraio.runtime.engine)."""

    pending: PendingChecksum
    expected: int
    entry: Entry
    chunk: Chunk
    keys: list[str]
    req: _Request


class DeviceChecks:
    """The device checks of one engine whose verdicts nobody read yet.

    ``pending`` is only ever changed in place under ``lock``, so code that holds the list (a stand-in for
    the engine's rule that queues checks, in tests) always sees the live one.

    Args:
        device: the device whose events tell when a check ran.
        stats: the engine's counters (``checksum_failures``).
        entries_lock: the engine's lock, which guards the entries a failed check stops serving.
        chunk_path: where a chunk lives, for the error.
    """

    def __init__(
        self,
        device: Device,
        stats: StatsCollector,
        *,
        entries_lock: Any,
        chunk_path: Callable[[Chunk], str],
    ) -> None:
        self._dev = device
        self._stats = stats
        self._entries_lock = entries_lock
        self._chunk_path = chunk_path
        self.lock = threading.Lock()
        self.pending: list[_DeviceCheck] = []

    def queue_read(
        self, req: _Request, entry: Entry, idxs: list[int], buf: torch.Tensor, io: DeviceIO, keys: list[str]
    ) -> None:
        """Queue the checksum of each of a read's chunks ``idxs`` behind its copies on the I/O thread's read
        stream; :meth:`deliver` reads the verdicts later."""
        checks = []
        for idx in idxs:
            chunk = entry.placement.chunks[idx]
            expected = entry.checksums[idx]
            if expected is None:
                continue
            piece = buf[chunk.region_offset : chunk.region_offset + chunk.nbytes]
            checks.append(
                _DeviceCheck(io.checksum_async(piece, io.read_stream), expected, entry, chunk, keys, req)
            )
            del piece
        with self.lock:
            self.pending.extend(checks)

    def deliver(self, *, wait: bool) -> None:
        """Read the verdicts of device checks whose event completed (all of them, waiting, with ``wait``)
        and raise ``ChecksumError`` for the first mismatch (naming how many more there were).

        A failed read's buffer is no longer served to sibling keys.
        """
        with self.lock:
            if not self.pending:
                return
            if wait:
                ready = list(self.pending)
            else:
                ready = [c for c in self.pending if self._dev.event_done(c.pending.event)]
                if not ready:
                    return
            done = {id(c) for c in ready}
            self.pending[:] = [c for c in self.pending if id(c) not in done]
        failed = []
        for check in ready:
            if wait:
                with host_wait(HostWait.SYNCHRONIZE):
                    self._dev.synchronize_event(check.pending.event)
            if check.pending.value() != check.expected:
                failed.append(check)
        if not failed:
            return
        self._stats.count("checksum_failures", len(failed))
        with self._entries_lock:
            for check in failed:  # its buffer is not served to sibling keys any more
                if check.entry.last_read is check.req:
                    check.entry.loaded_ref = None
                    check.entry.last_read = None
        first = failed[0]
        more = f"; {len(failed) - 1} more chunk(s) failed too" if len(failed) > 1 else ""
        how = "checked on the device after the read" + more
        raise checksum_error(first.keys, first.chunk, how, self._chunk_path(first.chunk))
