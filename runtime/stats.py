"""Counters of the engine, reported as a plain dataclass.

What a user needs to judge an offload run: how many bytes moved where and how fast (achieved GB/s
over the time a tier was busy, not over the whole run), how long training waited on I/O (stall),
how much each tier held at its peak, and how many bytes each SSD absorbed, projected to TB per day,
because SSD endurance is rated in TB written.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

SECONDS_PER_DAY = 86400.0


@dataclass(frozen=True)
class TransferStats:
    """One tier and direction: bytes, requests, busy seconds and the achieved rate."""

    nbytes: int = 0
    requests: int = 0
    busy_s: float = 0.0

    @property
    def gb_per_s(self) -> float:
        """Bytes per second (in GB, 1e9) while at least one request of this kind was in flight."""
        return self.nbytes / self.busy_s / 1e9 if self.busy_s > 0 else 0.0


@dataclass(frozen=True)
class DirStats:
    """One offload directory (one SSD)."""

    path: str
    io_path: str
    bytes_written: int
    bytes_read: int
    file_capacity_nbytes: int
    used_nbytes: int
    peak_used_nbytes: int
    tb_written_per_day: float


@dataclass(frozen=True)
class RuntimeStats:
    """A snapshot of the engine's counters.

    Attributes:
        backend: the backend in use (posix, kvikio or host) after resolving ``auto``.
        io_path: the path the SSD tier really takes (posix-odirect, posix-buffered, kvikio-gds,
            kvikio-compat) or host-pinned/host-pageable for the host backend.
        elapsed_s: seconds since the engine started.
        transfers: keyed "ssd.write", "ssd.read", "host.write", "host.read" (and "<name>.write"/".read"
            of a tier plugged in with ``Engine(tiers=...)`` once it moved something).
        stall_s: seconds callers spent blocked in wait/release/fetch.
        io_busy_s: seconds during which at least one transfer of any kind was in flight (the rest of
            ``elapsed_s`` the engine's storage sat idle).
        held_nbytes / peak_held_nbytes: bytes stored per tier ("ssd", "host") now and at the peak.
        dirs: per-directory bytes and the projected TB written per day at the current rate.
        dedup_hits / dedup_saved_nbytes: offloads served by an already stored storage.
        forwarded_fetches / forwarded_nbytes: fetches served from memory without a read.
        checksum_failures: chunks whose checksum did not match on read.
        direct_read_nbytes: SSD bytes read with O_DIRECT straight into fetched tensors' memory.
        bounced_read_nbytes: SSD bytes read with O_DIRECT into an I/O thread's aligned buffer and
            copied into the fetched tensor (its torch allocation was not 4096-aligned).
        buffered_read_nbytes: SSD bytes read through the page cache (O_DIRECT off).
        read_path (property): the path that carried most SSD read bytes, "none" before any read.
    """

    backend: str
    io_path: str
    elapsed_s: float
    transfers: dict[str, TransferStats]
    stall_s: float
    held_nbytes: dict[str, int]
    peak_held_nbytes: dict[str, int]
    dirs: tuple[DirStats, ...]
    dedup_hits: int
    dedup_saved_nbytes: int
    forwarded_fetches: int
    forwarded_nbytes: int
    checksum_failures: int
    direct_read_nbytes: int = 0
    bounced_read_nbytes: int = 0
    buffered_read_nbytes: int = 0
    io_busy_s: float = 0.0

    @property
    def read_path(self) -> str:
        """ "direct", "bounce" or "buffered": the read path that moved most SSD bytes ("none" if none)."""
        by_path = {
            "direct": self.direct_read_nbytes,
            "bounce": self.bounced_read_nbytes,
            "buffered": self.buffered_read_nbytes,
        }
        best = max(by_path, key=by_path.__getitem__)
        return best if by_path[best] else "none"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict, with each transfer's gb_per_s and the read_path included."""
        out = asdict(self)
        out["read_path"] = self.read_path
        for name, tr in self.transfers.items():
            out["transfers"][name]["gb_per_s"] = tr.gb_per_s
        return out


@dataclass
class _Busy:
    """Accumulates the time during which at least one request of one kind is in flight."""

    nbytes: int = 0
    requests: int = 0
    busy_s: float = 0.0
    inflight: int = 0
    since: float = 0.0


@dataclass
class StatsCollector:
    """Thread-safe counters updated by the engine and its I/O threads."""

    started: float = field(default_factory=time.perf_counter)
    lock: threading.Lock = field(default_factory=threading.Lock)
    busy: dict[str, _Busy] = field(default_factory=dict)
    stall_s: float = 0.0
    held: dict[str, int] = field(default_factory=lambda: {"ssd": 0, "host": 0})
    peak: dict[str, int] = field(default_factory=lambda: {"ssd": 0, "host": 0})
    dedup_hits: int = 0
    dedup_saved_nbytes: int = 0
    forwarded_fetches: int = 0
    forwarded_nbytes: int = 0
    checksum_failures: int = 0
    #: Any transfer in flight, whatever its kind.
    any_busy: _Busy = field(default_factory=_Busy)

    def start(self, kind: str) -> None:
        """A request of ``kind`` ("ssd.write", ...) was submitted."""
        with self.lock:
            for busy in (self.busy.setdefault(kind, _Busy()), self.any_busy):
                if busy.inflight == 0:
                    busy.since = time.perf_counter()
                busy.inflight += 1

    def finish(self, kind: str, nbytes: int) -> None:
        """A request of ``kind`` that moved ``nbytes`` (0 if it failed) finished."""
        with self.lock:
            busy = self.busy[kind]
            busy.inflight -= 1
            busy.nbytes += nbytes
            busy.requests += 1
            if busy.inflight == 0:
                busy.busy_s += time.perf_counter() - busy.since
            any_busy = self.any_busy
            any_busy.inflight -= 1
            if any_busy.inflight == 0:
                any_busy.busy_s += time.perf_counter() - any_busy.since

    def add_stall(self, seconds: float) -> None:
        with self.lock:
            self.stall_s += seconds

    def hold(self, tier: str, nbytes: int) -> None:
        """``nbytes`` more (or fewer, if negative) are stored in ``tier``."""
        with self.lock:
            self.held[tier] = self.held.get(tier, 0) + nbytes
            self.peak[tier] = max(self.peak.get(tier, 0), self.held[tier])

    def count(self, name: str, amount: int = 1) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + amount)

    def snapshot(
        self,
        *,
        backend: str,
        io_path: str,
        dirs: tuple[DirStats, ...],
        read_nbytes: dict[str, int] | None = None,
    ) -> RuntimeStats:
        """The counters now; ``read_nbytes`` are the SSD tier's bytes per read path (it counts them)."""
        read_nbytes = read_nbytes or {}
        now = time.perf_counter()
        with self.lock:
            transfers = {}
            # The built-in tiers always appear; a plugged-in tier once it moved something.
            for kind in ("ssd.write", "ssd.read", "host.write", "host.read", *sorted(self.busy)):
                busy = self.busy.get(kind, _Busy())
                busy_s = busy.busy_s + (now - busy.since if busy.inflight else 0.0)
                transfers[kind] = TransferStats(busy.nbytes, busy.requests, busy_s)
            return RuntimeStats(
                backend=backend,
                io_path=io_path,
                elapsed_s=now - self.started,
                transfers=transfers,
                stall_s=self.stall_s,
                held_nbytes=dict(self.held),
                peak_held_nbytes=dict(self.peak),
                dirs=dirs,
                dedup_hits=self.dedup_hits,
                dedup_saved_nbytes=self.dedup_saved_nbytes,
                forwarded_fetches=self.forwarded_fetches,
                forwarded_nbytes=self.forwarded_nbytes,
                checksum_failures=self.checksum_failures,
                direct_read_nbytes=read_nbytes.get("direct", 0),
                bounced_read_nbytes=read_nbytes.get("bounce", 0),
                buffered_read_nbytes=read_nbytes.get("buffered", 0),
                io_busy_s=self.any_busy.busy_s
                + (now - self.any_busy.since if self.any_busy.inflight else 0.0),
            )


def tb_per_day(nbytes: int, elapsed_s: float) -> float:
    """Project ``nbytes`` written in ``elapsed_s`` to terabytes (1e12) per day."""
    return nbytes / elapsed_s * SECONDS_PER_DAY / 1e12 if elapsed_s > 0 else 0.0
