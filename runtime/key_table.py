"""Which bytes each key names: the key records, the stored regions they share, and when to share one.

The engine stores byte regions, not keys. Views of one storage offloaded under several keys (q, k and v
of one qkv buffer, or one tensor offloaded twice) share one region, written once, and a key's tensor
is rebuilt from its region with the key's own dtype, shape, strides and offset. This module holds that
bookkeeping for :class:`teraio.runtime.engine.Engine`: the records, the regions by storage, the rule
that decides whether a new offload may share an existing region, and the in-memory copies a fetch
can be served from instead of the disk. It does no I/O and takes no lock: the engine's lock guards
every call.

Notes referenced in the code:

Note: [Storage identity]
    Dedup and forwarding identify a storage by the Python storage object (torch preserves one object
    per live StorageImpl) through a weak reference, never by data_ptr alone: a freed address is
    reused by the next allocation. The ``_cdata`` pointer is only a dict key; a hit is confirmed by
    ``ref() is storage``, and the version counter rejects a storage that was modified in place.

Note: [No dedup after release]
    A storage is deduplicated only while the entry's write still owns its source, i.e. before any of its
    keys was released. After ``release`` the caller may reuse the memory for new data: Inductor binds a
    later buffer to the same storage object (``buf9 = buf5  # reuse``) and its C++ kernels write through
    raw pointers without bumping the version counter, and the graph ops offload a fresh view
    (``whole_storage``) whose counter starts at 0 anyway. Matching such a storage to the old entry would
    hand the new key the old bytes.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from teraio.runtime.errors import ConfigError, UnknownKeyError, UnsupportedTensorError
from teraio.runtime.handle import Handle
from teraio.runtime.tiers.base import Placement, Tier

if TYPE_CHECKING:
    from teraio.runtime.transfers import _Request


@dataclass(eq=False)  # identity semantics: entries hold tensors
class Entry:
    """One stored byte region of one storage, shared by every key that deduplicated onto it."""

    tier: Tier
    device: torch.device
    on_device: (
        bool  # accelerator memory: moved on I/O streams (Note: [CUDA ordering] in teraio.runtime.engine)
    )
    storage_ref: weakref.ref
    storage_id: int
    version: int | None
    region_lo: int
    nbytes: int
    placement: Placement
    write_handle: Handle
    checksums: list[int | None]
    keys: set[str] = field(default_factory=set)
    write_req: _Request | None = None  # owns the source region until release/drop
    read_req: _Request | None = None  # the read in flight or done, until a fetch takes its buffer
    loaded_ref: weakref.ref | None = None  # storage of the last fetched buffer, while users hold it
    last_read: _Request | None = None  # the read that filled it: its device events order later users

    def requests(self) -> list[_Request]:
        """The requests that may still touch the region's bytes or space (write, read, last read)."""
        return [r for r in (self.write_req, self.read_req, self.last_read) if r is not None]

    def forget_requests(self) -> list[_Request]:
        """Detach :meth:`requests` from the entry (it is being freed) and return them."""
        pending = self.requests()
        self.read_req = self.write_req = self.last_read = None
        return pending


@dataclass(eq=False)
class KeyRecord:
    """What one key needs to rebuild its tensor: view metadata plus the in-memory reference."""

    entry: Entry | None  # None for zero-size tensors (nothing stored)
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    byte_offset: int  # of the view's first element in its storage
    device: torch.device
    tensor: torch.Tensor | None  # held until release (forwarding)


class KeyTable:
    """The engine's keys and the regions they name. Not thread-safe: the engine's lock guards each call."""

    def __init__(self) -> None:
        self.records: dict[str, KeyRecord] = {}
        self._by_storage: dict[int, list[Entry]] = {}
        self._offloading: set[str] = set()  # keys inside an offload() call right now

    def __contains__(self, key: str) -> bool:
        return key in self.records

    def get(self, key: str) -> KeyRecord | None:
        return self.records.get(key)

    def record(self, key: str) -> KeyRecord:
        """``key``'s record.

        Raises:
            UnknownKeyError: nothing is offloaded under ``key``.
        """
        rec = self.records.get(key)
        if rec is None:
            raise UnknownKeyError(f"no offloaded tensor under key {key!r}: offload it first")
        return rec

    def begin_offload(self, key: str) -> None:
        """Mark ``key`` as being offloaded by one caller; a second concurrent offload of it is an error."""
        if key in self._offloading:
            raise ConfigError(
                f"offload({key!r}) while another thread is offloading the same key: one request per "
                f"key at a time (use distinct keys, or wait for the first offload to return)"
            )
        self._offloading.add(key)

    def end_offload(self, key: str) -> None:
        self._offloading.discard(key)

    def add(self, key: str, rec: KeyRecord) -> None:
        """Make ``key`` name ``rec`` (its entry, if any, is already registered or shared)."""
        self.records[key] = rec

    def add_entry(self, entry: Entry) -> None:
        """Register a newly stored region so later offloads of its storage can share it."""
        self._by_storage.setdefault(entry.storage_id, []).append(entry)

    def find_shared(
        self,
        storage: torch.UntypedStorage,
        version: int | None,
        target: Tier,
        t: torch.Tensor,
        lo: int,
        hi: int,
    ) -> Entry | None:
        """A stored region the view ``t`` (bytes [lo, hi) of ``storage``) may share instead of a new write."""
        entries = self._by_storage.get(storage._cdata)
        if not entries:
            return None
        entries[:] = [e for e in entries if e.storage_ref() is not None]
        for e in entries:
            if (
                e.storage_ref() is storage  # Note: [Storage identity]
                and e.write_req is not None
                and e.write_req.buffer is not None  # Note: [No dedup after release]
                and e.version == version
                and e.tier is target
                and e.region_lo <= lo
                and hi <= e.region_lo + e.nbytes
                and (lo - e.region_lo) % t.element_size() == 0
                and not e.write_handle.failed()
            ):
                return e
        return None

    def unlink(self, key: str) -> Entry | None:
        """Forget ``key``. Return its entry when no other key names that region any more (the caller frees
        it), else None."""
        rec = self.records.pop(key, None)
        if rec is None or rec.entry is None:
            return None
        entry = rec.entry
        entry.keys.discard(key)
        if entry.keys:
            return None
        siblings = self._by_storage.get(entry.storage_id, [])
        if entry in siblings:
            siblings.remove(entry)
        if not siblings:
            self._by_storage.pop(entry.storage_id, None)
        return entry

    def take_all(self) -> list[Entry]:
        """Forget every key and region (the engine is closing); return each region once."""
        entries = {id(e): e for es in self._by_storage.values() for e in es}
        entries.update({id(r.entry): r.entry for r in self.records.values() if r.entry is not None})
        self.records.clear()
        self._by_storage.clear()
        return list(entries.values())

    def memory_copy(self, entry: Entry) -> tuple[torch.UntypedStorage, int] | None:
        """A live storage holding the entry's bytes, and the storage byte offset of region start."""
        for k in entry.keys:
            other = self.records.get(k)
            if other is not None and other.tensor is not None:
                return other.tensor.untyped_storage(), 0
        if entry.loaded_ref is not None:
            loaded = entry.loaded_ref()
            if loaded is not None:
                return loaded, entry.region_lo
            entry.loaded_ref = None
        return None


def validate_request(key: str, tensor: torch.Tensor) -> None:
    """Reject a key or tensor the engine cannot store, with the typed error that names why."""
    if not isinstance(key, str) or not key:
        raise ConfigError(f"key must be a non-empty str, got {key!r}")
    if not isinstance(tensor, torch.Tensor):
        raise UnsupportedTensorError(f"offload({key!r}) needs a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_nested:
        raise UnsupportedTensorError(
            f"offload({key!r}): only dense strided tensors can be offloaded, got layout {tensor.layout}"
        )
    if tensor.device.type not in ("cpu", "cuda"):
        raise UnsupportedTensorError(
            f"offload({key!r}): tensors on {tensor.device} are not supported (cpu or cuda only)"
        )


def version_of(t: torch.Tensor) -> int | None:
    """``t``'s version counter, or None for an inference tensor (which has none)."""
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return None


def span_nbytes(t: torch.Tensor) -> tuple[int, int]:
    """Byte range [lo, hi) of the storage that the view ``t`` can touch."""
    itemsize = t.element_size()
    lo = t.storage_offset() * itemsize
    if t.numel() == 0:
        return lo, lo
    extent = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0)
    return lo, lo + extent * itemsize


def stored_region(storage_nbytes: int, lo: int, hi: int) -> tuple[int, int]:
    """The byte range of a storage to store for a view over [lo, hi) of it.

    The whole storage when the view covers at least half of it, so sibling views such as q/k/v of one
    qkv buffer dedup onto it; else only the view's own span.
    """
    return (0, storage_nbytes) if 2 * (hi - lo) >= storage_nbytes else (lo, hi)


def new_entry(
    key: str,
    t: torch.Tensor,
    version: int | None,
    lo: int,
    hi: int,
    target: Tier,
    on_device: bool,
    on_stall: Callable[[float], None],
) -> tuple[Entry, torch.Tensor]:
    """A new region for ``key``'s view ``t`` (bytes [lo, hi) of its storage), placed on ``target``, with
    its write handle; and the uint8 tensor over the region's source bytes, to write.

    Raises:
        OutOfSpaceError, TierCapacityError: no room on ``target``.
    """
    storage = t.untyped_storage()
    region_lo, region_hi = stored_region(storage.nbytes(), lo, hi)
    nbytes = region_hi - region_lo
    placement = target.allocate(nbytes)
    region = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, region_lo, (nbytes,), (1,))
    entry = Entry(
        tier=target,
        device=t.device,
        on_device=on_device,
        storage_ref=weakref.ref(storage),
        storage_id=storage._cdata,
        version=version,
        region_lo=region_lo,
        nbytes=nbytes,
        placement=placement,
        write_handle=Handle(key, "offload", on_stall),
        checksums=[None] * len(placement.chunks),
        keys={key},
    )
    return entry, region


def rebuild(rec: KeyRecord, storage: torch.UntypedStorage, storage_lo: int) -> torch.Tensor:
    """``rec``'s view over ``storage``, whose byte ``storage_lo`` holds the region's first byte."""
    itemsize = torch.empty(0, dtype=rec.dtype).element_size()
    offset_elems = (rec.byte_offset - storage_lo) // itemsize
    out = torch.empty(0, dtype=rec.dtype, device=storage.device)
    return out.set_(storage, offset_elems, rec.shape, rec.stride)
