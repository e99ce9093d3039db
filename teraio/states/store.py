"""Tensors that keep their identity while their bytes live on disk: the records of gradients and
optimizer states, their residency, and the byte accounting by kind.

A gradient (``param.grad``) or an optimizer state (``optimizer.state[p]["exp_avg"]``) is a tensor object
other code holds: autograd accumulates into ``param.grad``, the stock optimizer looks its moments up in
``optimizer.state[p]``. So the object stays; only its storage comes and goes (Note: [Offloaded tensors
keep their object, not their storage]). Every move goes through :class:`TensorStore`, which counts the
bytes read and written per kind and the bytes resident per kind, with their peaks.

Note: [Offloaded tensors keep their object, not their storage]
    While its bytes are on disk, a record's tensor points at an empty storage with its shape, strides
    and dtype unchanged (FSDP2 frees an unsharded parameter the same way, by its storage). It is brought
    back with ``set_`` onto the buffer the runtime read, so a load costs no copy. Those reads are
    exclusive (Note: [Exclusive fetches are not served again] in teraio.runtime.engine): the step then
    updates the buffer in place, and autograd accumulates into it, without the engine ever serving the
    changed bytes as the key's. Eviction points the tensor at a fresh empty storage rather than resizing
    its storage in place: a gradient autograd handed over may share its storage with other tensors,
    which must keep theirs. A kernel reading an evicted tensor would read a null pointer (on CPU the
    process dies), so an evicted gradient or optimizer state is guarded while its bytes are only on
    disk: its class is swapped and every torch call with it is served, deferred or refused in one line
    (Note: [What a read of an offloaded tensor does] in teraio.states.guarded). Every path that gives a
    record memory again (``load``, ``make_resident_zeros``) makes it a plain tensor first and replays
    its pending ops (an in-place scale or clamp deferred while it was on disk) after: its memory is
    then its value, and a write clears them. An offloaded parameter is guarded only while no module of
    the model runs (Note: [Parameters are guarded while no module of the model runs] in
    teraio.states.entry_gate).

Note: [Device bytes of the store go through the engine's Device]
    On a GPU the store's own moves of device bytes are stream work: refilling a parameter's storage
    (``resize_`` then a copy from the fetched buffer) and freeing it (``resize_(0)``). They go through
    the engine's :class:`teraio.runtime.device.Device`, like every copy the engine makes, so the fake
    device runs them late and in order and the tests in tests/teraio/test_states_device_order.py show
    each ordering they rely on failing when its rule is removed: the refill is queued on the current
    stream, which ``Engine.fetch`` made wait for the read (rule 3 of Note: [CUDA ordering] in
    teraio.runtime.engine), and a free comes only after the write's bytes left the device
    (``finish_write`` waits for them: ``Engine.release``). A record moved onto a fetched buffer
    (``set_``, no copy) needs nothing more than rule 3.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch

from teraio.profiling.measure import note_freed
from teraio.runtime import Engine, Handle
from teraio.runtime.device import Device
from teraio.states import guarded
from teraio.states.shards import is_sharded, local, rewrap

if TYPE_CHECKING:
    from teraio.states.grad_norms import GradNorms


class Kind(Enum):
    """What a record holds; the values are the keys of ``moved_bytes_by_kind``."""

    PARAMETER = "parameter"
    GRADIENT = "gradient"
    OPTIMIZER_STATE = "optimizer_state"


class Residency(Enum):
    """Where a record's bytes are. Every state but ``DISK`` holds memory."""

    MEMORY = "memory"  # only in memory: new, or changed since its last write
    WRITING = "writing"  # in memory, its write in flight
    SAVED = "saved"  # in memory and on disk, the same bytes
    READING = "reading"  # on disk, a read into a fresh buffer in flight
    DISK = "disk"  # only on disk: the tensor's storage is empty


@dataclass(eq=False)
class Record:
    """One offloaded tensor: the object others hold, and the engine key of its bytes on disk."""

    kind: Kind
    tensor: torch.Tensor = field(repr=False)  # a repr of a guarded tensor reads it (teraio.states.guarded)
    nbytes: int
    #: The optimizer state's name ("exp_avg"), or "grad".
    name: str = "grad"
    residency: Residency = Residency.MEMORY
    #: The key whose bytes are this record's valid copy on disk (None: none).
    saved_key: str | None = None
    #: The key a write in flight, or a write not committed yet, goes to.
    staged_key: str | None = None
    handle: Handle | None = None
    #: Evicted and loaded through its own storage object (resized to zero bytes and back) instead of a
    #: new one: a parameter, whose storage autograd's saved tensors share (Note: [A parameter keeps its
    #: storage object] in teraio.states.params).
    in_place: bool = False
    #: The index of the parameter it belongs to (in the optimizer's order), for messages.
    param_idx: int | None = None
    #: False once the store stopped tracking it (``forget``): a guarded object of it raises on reads.
    tracked: bool = True
    #: In-place ops deferred while its bytes are on disk, replayed on every load (Note: [What a read of
    #: an offloaded tensor does] in teraio.states.guarded); cleared by a write.
    pending: list[Any] = field(default_factory=list, repr=False)
    #: Norms of its value taken before its write, by (order, dtype) and chain of pending ops (Note:
    #: [Norms are taken before the write] in teraio.states.grad_norms).
    norms: dict[Any, torch.Tensor] = field(default_factory=dict, repr=False)

    #: A parameter guarded while on disk and no module of the model runs (Note: [Parameters are guarded
    #: while no module of the model runs] in teraio.states.entry_gate), as gradients and states are.
    entry_guarded: bool = False
    #: That note's gate (an ``EntryGate``): while it is open, the parameter stays plain.
    entry_gate: Any = field(default=None, repr=False)
    #: The DTensor whose local shard ``tensor`` is (FSDP2's gradients and optimizer states), guarded
    #: with it (Note: [A sharded tensor is guarded as a whole] in teraio.states.shards); None: plain.
    holder: torch.Tensor | None = field(default=None, repr=False)

    @property
    def version(self) -> int:
        """The version counter of the value: its DTensor's local shard's (what in-place updates of the
        DTensor bump), else its tensor's."""
        return local(self.holder)._version if self.holder is not None else self.tensor._version

    @property
    def target(self) -> torch.Tensor:
        """The object ops on the record's value apply to: its DTensor, else its tensor (pending ops,
        norms). Bytes move through ``tensor``."""
        return self.holder if self.holder is not None else self.tensor

    @property
    def disk_key(self) -> str | None:
        """The key of its newest bytes on disk: a finished write not committed yet (Note: [The step of
        offloaded parameters runs in the next forward] in teraio.states.step_pipeline) before the
        committed one."""
        if self.staged_key is not None and self.residency in (Residency.DISK, Residency.READING):
            return self.staged_key
        return self.saved_key

    @property
    def guards_reads(self) -> bool:
        """Guarded while on disk (teraio.states.guarded): gradients, optimizer states, and parameters
        while no module of the model runs."""
        if self.kind is Kind.PARAMETER:
            return self.entry_guarded and not (self.entry_gate is not None and self.entry_gate.is_open)
        return not self.in_place


def tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes of the tensor's elements (what an offload writes for a dense tensor)."""
    return t.numel() * t.element_size()


def _point_at_empty(t: torch.Tensor) -> None:
    """Note: [Offloaded tensors keep their object, not their storage]: ``t`` keeps its shape, strides and
    dtype over a fresh storage resized to zero bytes; its old storage dies with its last reference."""
    span_elems = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0) if t.numel() else 0
    fresh = torch.UntypedStorage(span_elems * t.element_size(), device=t.device)  # untouched pages
    with torch.no_grad():
        t.set_(fresh, 0, t.shape, t.stride())
    fresh.resize_(0)


def _free_in_place(t: torch.Tensor, dev: Device | None) -> None:
    """Note: [A parameter keeps its storage object] in teraio.states.params: every alias of ``t``'s
    storage (autograd's saved tensors) loses its bytes with it. Device memory goes through ``dev``
    (Note: [Device bytes of the store go through the engine's Device])."""
    if dev is not None:
        dev.resize_storage(t, 0)
    else:
        t.untyped_storage().resize_(0)


def _fill_in_place(t: torch.Tensor, src: torch.Tensor, dev: Device | None) -> None:
    """``t``'s own storage object gets its bytes back with ``src``'s values; its version counter does not
    move (autograd checks it on the tensors a forward saved, and the values are the ones it saved).
    With device memory the copy is queued on the current stream, behind the read's event that
    ``Engine.fetch`` made that stream wait for (Note: [Device bytes of the store go through the
    engine's Device])."""
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(t):
        if dev is not None:
            dev.resize_storage(t, tensor_nbytes(t))
            dev.copy_async(t, src, dev.current_stream(t.device))
        else:
            t.untyped_storage().resize_(tensor_nbytes(t))
            t.copy_(src)


def _point_at(t: torch.Tensor, src: torch.Tensor) -> None:
    """``t`` takes ``src``'s storage and layout (no copy)."""
    with torch.no_grad():
        t.set_(src.untyped_storage(), src.storage_offset(), src.shape, src.stride())


def _free(rec: Record, dev: Device | None) -> None:
    note_freed(rec.tensor.untyped_storage())  # Note: [Frees of memory older than the session]
    if rec.in_place:
        _free_in_place(rec.tensor, dev)
    else:
        _point_at_empty(rec.tensor)


@dataclass
class ByteCounts:
    """Bytes moved and resident, per kind."""

    written: dict[Kind, int] = field(default_factory=lambda: dict.fromkeys(Kind, 0))
    read: dict[Kind, int] = field(default_factory=lambda: dict.fromkeys(Kind, 0))
    resident: dict[Kind, int] = field(default_factory=lambda: dict.fromkeys(Kind, 0))
    peak_resident: dict[Kind, int] = field(default_factory=lambda: dict.fromkeys(Kind, 0))
    #: Peak since the last :meth:`TensorStore.reset_window_peak` (the streamed step resets it).
    window_peak_resident: dict[Kind, int] = field(default_factory=lambda: dict.fromkeys(Kind, 0))


class TensorStore:
    """Moves records between memory and the engine, keeping :class:`ByteCounts` up to date.

    Only the caller's thread calls it (the training loop, autograd's hooks, the optimizer step).
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.counts = ByteCounts()
        #: The gradients' norms (teraio.states.grad_norms), when gradients are offloaded.
        self.grad_norms: GradNorms | None = None
        #: Called before a guarded tensor is used (Note: [The step of offloaded parameters runs in the next
        #: forward] in teraio.states.step_pipeline: a pending step finishes first; True when it did).
        self.before_guarded_use: Callable[[], bool] | None = None

    def _device(self, t: torch.Tensor) -> Device | None:
        """The engine's Device when ``t`` is its memory (None for host memory: plain torch calls)."""
        dev = self.engine.accelerator
        return dev if dev.owns(t) else None

    # -- accounting -------------------------------------------------------------------------------
    def _set(self, rec: Record, residency: Residency) -> None:
        was_resident = rec.residency is not Residency.DISK
        now_resident = residency is not Residency.DISK
        rec.residency = residency
        if was_resident != now_resident:
            self._add_resident(rec.kind, rec.nbytes if now_resident else -rec.nbytes)

    def _add_resident(self, kind: Kind, nbytes: int) -> None:
        c = self.counts
        c.resident[kind] += nbytes
        c.peak_resident[kind] = max(c.peak_resident[kind], c.resident[kind])
        c.window_peak_resident[kind] = max(c.window_peak_resident[kind], c.resident[kind])

    def reset_window_peak(self) -> None:
        """Start a new window for ``counts.window_peak_resident`` at the bytes resident now."""
        self.counts.window_peak_resident = dict(self.counts.resident)

    def new_record(
        self, kind: Kind, tensor: torch.Tensor, name: str = "grad", param_idx: int | None = None
    ) -> Record:
        """A record for a tensor that is in memory now (counted resident); a DTensor's bytes move through
        its local shard (Note: [A sharded tensor's bytes are its local shard] in teraio.states.shards)."""
        holder = tensor if is_sharded(tensor) else None
        tensor = local(tensor)
        rec = Record(
            kind=kind,
            tensor=tensor,
            holder=holder,
            nbytes=tensor_nbytes(tensor),
            name=name,
            residency=Residency.DISK,
            param_idx=param_idx,
        )
        self._set(rec, Residency.MEMORY)
        return rec

    def adopt(self, rec: Record, tensor: torch.Tensor) -> None:
        """The record's object was replaced by ``tensor`` (in memory); its saved bytes stay until replaced."""
        self._set(rec, Residency.DISK)
        guarded.drop_guards(rec)
        rec.holder = tensor if is_sharded(tensor) else None
        rec.tensor = local(tensor)
        rec.nbytes = tensor_nbytes(rec.tensor)
        rec.pending.clear()
        rec.norms.clear()
        self._set(rec, Residency.MEMORY)

    def forget(self, rec: Record) -> None:
        """Stop tracking ``rec`` (its tensor is no longer ours); its keys are the caller's to drop. A
        guarded object of it raises on reads from now on (its bytes are gone)."""
        self._set(rec, Residency.DISK)
        rec.tracked = False
        guarded.drop_guards(rec)

    # -- moves ------------------------------------------------------------------------------------
    def write(self, rec: Record, key: str) -> None:
        """Start writing the record's bytes under ``key`` (replacing whatever ``key`` held)."""
        if rec.residency not in (Residency.MEMORY, Residency.SAVED):
            raise AssertionError(f"write of a record in state {rec.residency.value}")
        if key == rec.saved_key:
            rec.saved_key = None  # the engine drops the old bytes of the key first
        rec.handle = self.engine.offload(key, rec.tensor)
        rec.staged_key = key
        rec.pending.clear()  # replayed into the bytes written
        self._set(rec, Residency.WRITING)

    def write_done(self, rec: Record) -> bool:
        """Whether the record's write has finished (successfully or not)."""
        return rec.handle is None or rec.handle.done()

    def finish_write(self, rec: Record) -> str:
        """Wait for the record's write; it is ``SAVED`` under its staged key (returned) afterwards.

        Raises:
            RuntimeIOError: the write failed (the record stays ``WRITING``; see :meth:`abandon`).
        """
        key = rec.staged_key
        assert rec.residency is Residency.WRITING and key is not None
        self.engine.release(key)  # waits; raises when the write failed
        self.counts.written[rec.kind] += rec.nbytes
        rec.handle = None
        self._set(rec, Residency.SAVED)
        return key

    def prefetch(self, rec: Record) -> None:
        """Start reading an evicted record back (no-op unless ``DISK``)."""
        if rec.residency is Residency.DISK and rec.disk_key is not None:
            self.engine.prefetch(rec.disk_key)
            self._set(rec, Residency.READING)

    def load(self, rec: Record) -> None:
        """Bring the record's bytes back into its own tensor (waits for its read)."""
        if rec.residency not in (Residency.DISK, Residency.READING):
            return
        key = rec.disk_key
        assert key is not None, "an evicted record without saved bytes"
        if rec.residency is Residency.DISK:
            self._set(rec, Residency.READING)  # the read's buffer is allocated now
        try:
            fetched = self.engine.fetch(key, exclusive=True)
        except BaseException:
            self._set(rec, Residency.DISK)
            raise
        if rec.in_place:
            guarded.release_record(rec)
            _fill_in_place(rec.tensor, fetched, self._device(rec.tensor))
            note_freed(fetched.untyped_storage())  # copied: the buffer goes (it may predate a measurement)
        else:
            guarded.release_record(rec)
            _point_at(rec.tensor, fetched)
            for op in rec.pending:  # its value is its disk copy with them applied
                op.apply(rec.target)
        del fetched
        self.counts.read[rec.kind] += rec.nbytes
        self._set(rec, Residency.SAVED)

    def read_copy(self, rec: Record) -> torch.Tensor:
        """A new tensor with the record's bytes: its own memory, or a copy read from disk (the record
        stays where it is). The copy is never a buffer the engine would serve again (Note: [Offloaded
        tensors keep their object, not their storage])."""
        if rec.residency not in (Residency.DISK, Residency.READING):
            return rec.tensor.detach().clone()
        assert rec.disk_key is not None
        out = self.engine.fetch(rec.disk_key, exclusive=True)
        self.counts.read[rec.kind] += rec.nbytes
        target = out if rec.holder is None else rewrap(rec.holder, out)  # ops apply to a DTensor over it
        for op in rec.pending:
            op.apply(target)
        return out

    def drain_read(self, rec: Record) -> None:
        """Let a read in flight finish and its buffer go, ignoring its outcome (cleaning up a failure)."""
        if rec.residency is Residency.READING and rec.disk_key is not None:
            try:
                self.engine.fetch(rec.disk_key, exclusive=True)
            except Exception:  # noqa: BLE001 - the step that needed it already failed
                pass
            self._set(rec, Residency.DISK)

    def evict(self, rec: Record) -> None:
        """Free the record's memory; its bytes must be saved (``SAVED``)."""
        if rec.residency is Residency.DISK:
            return
        if rec.residency is not Residency.SAVED:
            raise AssertionError(f"evicting a record in state {rec.residency.value}: its bytes would be lost")
        _free(rec, self._device(rec.tensor))
        self._set(rec, Residency.DISK)
        if rec.guards_reads:
            guarded.protect(rec, self)

    def discard(self, rec: Record) -> None:
        """Free the record's memory whatever it held (a failed step's values); a write in flight is
        dropped with its key. Its ``saved_key`` (if any) is again the record's only copy."""
        if rec.residency is Residency.READING:
            self.drain_read(rec)
            return
        if rec.residency is Residency.WRITING:
            assert rec.staged_key is not None
            self.engine.drop(rec.staged_key, missing_ok=True)  # waits for the write
            rec.staged_key = None
            rec.handle = None
        if rec.residency is not Residency.DISK:
            _free(rec, self._device(rec.tensor))
            self._set(rec, Residency.DISK)
            if rec.guards_reads:
                guarded.protect(rec, self)

    def make_resident_zeros(self, rec: Record) -> None:
        """Give an evicted record fresh zeroed memory (``zero_grad(set_to_none=False)``: no read)."""
        if rec.residency is Residency.READING:
            self.drain_read(rec)
        if rec.residency is Residency.DISK:
            t = rec.tensor
            guarded.release_record(rec)
            _point_at(t, torch.zeros_like(t, memory_format=torch.preserve_format))
            rec.pending.clear()
            rec.norms.clear()
            self._set(rec, Residency.MEMORY)

    def mark_changed(self, rec: Record) -> None:
        """The record's tensor is about to change in memory: its saved bytes stop being its copy (and
        its norms its norms)."""
        rec.norms.clear()
        if rec.residency is Residency.SAVED:
            self._set(rec, Residency.MEMORY)

    def drop_key(self, key: str | None) -> None:
        """Free a key's space on disk (no I/O)."""
        if key is not None:
            self.engine.drop(key, missing_ok=True)

    def stats(self) -> dict[str, Any]:
        """Plain numbers by kind value."""
        c = self.counts
        return {
            "written_bytes": {k.value: v for k, v in c.written.items()},
            "read_bytes": {k.value: v for k, v in c.read.items()},
            "resident_bytes": {k.value: v for k, v in c.resident.items()},
            "peak_resident_bytes": {k.value: v for k, v in c.peak_resident.items()},
        }
