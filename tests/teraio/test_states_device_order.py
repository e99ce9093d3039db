"""The states' store on the fake asynchronous device: each ordering it relies on holds, and fails when its
rule is removed (Note: [Device bytes of the store go through the engine's Device] in
teraio.states.store).

A parameter is freed and refilled in place (its storage object resized, then filled by a copy queued
on the current stream); a gradient or an optimizer state is moved onto the fetched buffer. On a GPU
each of these is stream work, so the scenarios hold the I/O streams back and check what a later kernel
on the compute stream sees, and what the disk got, exactly as tests/runtime/test_device_races.py does
for the engine's own rules. ``test_store_order_fails_without_its_rule`` runs every scenario with its
rule removed and sees it fail.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from teraio.runtime import Engine
from teraio.runtime.fake_device import FakeDevice, FreedUnderQueuedWorkError
from teraio.states import store as store_module
from teraio.states.store import Kind, Record, Residency, TensorStore, tensor_nbytes
from tests.runtime.conftest import DEVICE_TIERS, device_config, prepare_device_tier
from tests.runtime.test_device_races import _consume, _hold_io

N = 10_000  # float32 elements: one 64 KiB chunk at most


def _engine(fake: FakeDevice, tier: str, tmp_path: Path) -> Engine:
    return Engine(
        device_config(tier, tmp_path, chunk_bytes=64 << 10, io_threads=1, checksum=False), device=fake
    )


def _warm_up(fake: FakeDevice, eng: Engine) -> None:
    """One write, so the I/O thread's streams exist and pausing them holds the next copies. (No read: a
    GDS thread's cuFile stream is made at its first read, after the pause, so its disk reads run.)"""
    eng.offload("warm-up", fake.adopt(torch.zeros(16))).wait()
    eng.release("warm-up")
    eng.drop("warm-up")


@contextmanager
def _warm_store(fake: FakeDevice, tier: str, tmp_path: Path) -> Iterator[TensorStore]:
    """A store over an engine on the fake device whose I/O streams exist (``_warm_up``)."""
    with _engine(fake, tier, tmp_path) as eng:
        _warm_up(fake, eng)
        yield TensorStore(eng)


def _device_floats(fake: FakeDevice, values: torch.Tensor) -> torch.Tensor:
    """A pool block holding ``values``, as a tensor without a ``_base`` (a view would keep the block
    alive after the record moved off it, and the engine would serve the bytes from memory)."""
    block = fake.empty(values.numel() * 4, torch.device("cpu"))
    t = torch.empty(0, dtype=torch.float32).set_(block.untyped_storage(), 0, values.shape, (1,))
    t.copy_(values)
    return t


def _record(store: TensorStore, t: torch.Tensor, kind: Kind, in_place: bool) -> Record:
    rec = store.new_record(kind, t, name="grad" if kind is Kind.GRADIENT else "w")
    rec.in_place = in_place
    return rec


def _saved(store: TensorStore, rec: Record, key: str) -> None:
    store.write(rec, key)
    rec.saved_key = store.finish_write(rec)
    rec.staged_key = None


def _until_copy_queued(fake: FakeDevice, rec: Record) -> None:
    """Wait until the I/O thread queued the write's device-to-host copy and waits for it (a write is
    handed to the I/O thread: without this the copy could be queued after the free)."""
    fake.wait_until(lambda: fake.settled() and (rec.handle.done() or fake.host_waiters > 0))


@contextmanager
def _write_held(fake: FakeDevice, store: TensorStore, rec: Record, key: str) -> Iterator[None]:
    """Write the record with its device-to-host copy held back and wait for it as the store does
    (``finish_write``); the ``with`` body then runs (a free), and the held streams are let go once the
    caller waits in ``Engine.release`` or, if it did not wait, after the body: the order of events
    never depends on timing."""
    _hold_io(fake)
    waiting, done = threading.Event(), threading.Event()
    real_release = store.engine.release

    def release(k: str, *a, **kw):
        waiting.set()
        return real_release(k, *a, **kw)

    def let_go() -> None:
        while not (waiting.wait(0.01) or done.is_set()):
            pass
        fake.resume()

    store.engine.release = release  # instrumentation only: the same call, announced
    helper = threading.Thread(target=let_go, daemon=True)
    helper.start()
    try:
        store.write(rec, key)
        _until_copy_queued(fake, rec)
        rec.saved_key = store.finish_write(rec)
        rec.staged_key = None
        yield
    finally:
        done.set()
        helper.join(timeout=60)
        del store.engine.release


# -- the scenarios --------------------------------------------------------------------------------------
def parameter_refilled_after_read(fake: FakeDevice, tier: str, tmp_path: Path) -> None:
    """A parameter's storage is refilled in place from the fetched buffer: the copy must run behind the
    read (queued on the compute stream, which ``fetch`` made wait for it), so the next kernel sees the
    parameter's bytes, not the buffer's before the read landed."""
    with _warm_store(fake, tier, tmp_path) as store:
        expected = torch.randn(N)
        p = fake.adopt(expected.clone())
        rec = _record(store, p, Kind.PARAMETER, in_place=True)
        _saved(store, rec, "param/0/0")
        store.evict(rec)
        assert p.untyped_storage().nbytes() == 0
        _hold_io(fake)
        store.load(rec)  # returns with the read's copy held back
        assert p.untyped_storage().nbytes() == tensor_nbytes(p)
        seen = _consume(fake, p)
        assert rec.residency is Residency.SAVED
        assert torch.equal(seen, expected), (
            "the parameter was refilled before its read landed "
            f"(a kernel saw bytes {seen.view(torch.uint8)[:4].tolist()})"
        )


def parameter_freed_after_write(fake: FakeDevice, tier: str, tmp_path: Path) -> None:
    """A parameter's storage is freed only after its write's bytes left the device: ``finish_write``
    waits for them. Freed earlier, the late copy would read the block's next owner."""
    with _warm_store(fake, tier, tmp_path) as store:
        eng = store.engine
        expected = torch.randn(N)
        p = fake.adopt(expected.clone())
        rec = _record(store, p, Kind.PARAMETER, in_place=True)
        with _write_held(fake, store, rec, "param/0/0"):
            try:
                store.evict(rec)
            except FreedUnderQueuedWorkError as exc:
                fake.errors.remove(exc)
                raise AssertionError(f"the parameter was freed before its write's copy ran: {exc}") from None
        out = eng.fetch(rec.saved_key)
        fake.synchronize(out.device)
        assert torch.equal(out, expected), "the disk got other bytes than the parameter's before its free"


def state_moved_onto_read(fake: FakeDevice, tier: str, tmp_path: Path) -> None:
    """A gradient or optimizer state is moved onto the fetched buffer (no copy): the next kernel on the
    compute stream must wait for the read (the engine's rule 3)."""
    with _warm_store(fake, tier, tmp_path) as store:
        expected = torch.randn(N)
        m = fake.adopt(expected.clone())  # not a pool block: the read's fresh block holds poison
        rec = _record(store, m, Kind.OPTIMIZER_STATE, in_place=False)
        _saved(store, rec, "state/0/exp_avg/0")
        store.evict(rec)
        del m
        _hold_io(fake)
        store.load(rec)
        assert fake.owns(rec.tensor)
        seen = _consume(fake, rec.tensor)
        assert torch.equal(seen, expected), (
            "a kernel read the optimizer state before its read landed "
            f"(it saw bytes {seen.view(torch.uint8)[:4].tolist()})"
        )


def state_freed_after_write(fake: FakeDevice, tier: str, tmp_path: Path) -> None:
    """A gradient's block goes back to the allocator only after its write's bytes left the device. Freed
    earlier, the next allocation on the stream gets the block at once, and the late copy sends the new
    owner's bytes to disk."""
    with _warm_store(fake, tier, tmp_path) as store:
        eng = store.engine
        expected = torch.randn(N)
        g = _device_floats(fake, expected)
        rec = _record(store, g, Kind.GRADIENT, in_place=False)
        del g
        with _write_held(fake, store, rec, "grad/0"):
            store.evict(rec)  # the block returns to the pool
            reuse = fake.empty(N * 4, torch.device("cpu"))
            reuse.fill_(0x5A)  # the next owner writes its bytes
        out = eng.fetch(rec.saved_key)
        fake.synchronize(out.device)
        del reuse
        assert torch.equal(out, expected), (
            "the gradient's block was handed on before its write's copy ran "
            f"(the disk got bytes {out.view(torch.uint8)[:4].tolist()})"
        )


def parameter_read_back_before_commit(fake: FakeDevice, tier: str, tmp_path: Path) -> None:
    """A step overlapped with the next forward (teraio.states.step_pipeline) writes an updated parameter
    to its other slot and commits the slots only when its last chunk is written; a parameter freed in
    between and fetched again (by the backward, or a later call) must come back from the slot just
    written, not from the committed one, which holds the value before the update."""
    with _warm_store(fake, tier, tmp_path) as store:
        before, updated = torch.randn(N), torch.randn(N)
        p = fake.adopt(before.clone())
        rec = _record(store, p, Kind.PARAMETER, in_place=True)
        _saved(store, rec, "param/0/0")  # the committed slot
        with torch.no_grad():
            p.copy_(fake.adopt(updated.clone()))  # the update
        store.mark_changed(rec)
        store.write(rec, "param/0/1")  # to the other slot, not committed yet
        store.finish_write(rec)
        store.evict(rec)
        store.load(rec)
        seen = _consume(fake, p)
        assert torch.equal(seen, updated), "the parameter came back with its value from before the update"


# -- the rules removed --------------------------------------------------------------------------------
def _fill_on_the_host(t: torch.Tensor, src: torch.Tensor, dev) -> None:
    """The refill as plain torch calls on the host (the code before the copy went through the Device)."""
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(t):
        if dev is not None:
            dev.resize_storage(t, tensor_nbytes(t))
        else:
            t.untyped_storage().resize_(tensor_nbytes(t))
        t.copy_(src)


def _finish_write_without_waiting(self: TensorStore, rec: Record) -> str:
    """The record marked saved while its write may still be copying its bytes off the device."""
    key = rec.staged_key
    self.counts.written[rec.kind] += rec.nbytes
    rec.handle = None
    self._set(rec, Residency.SAVED)
    return key


def _no_consumer_wait(self, device, events, buffer) -> None:
    """The engine's rule 3 removed: the consumer's stream does not wait for the read."""


SCENARIOS: dict[str, Callable[..., None]] = {
    "parameter_refilled_after_read": parameter_refilled_after_read,
    "parameter_freed_after_write": parameter_freed_after_write,
    "state_moved_onto_read": state_moved_onto_read,
    "state_freed_after_write": state_freed_after_write,
    "parameter_read_back_before_commit": parameter_read_back_before_commit,
}


def _committed_key(self: Record) -> str | None:
    """Reads from the committed slot only (before the overlapped step: a freed record's newest bytes
    were always its committed ones)."""
    return self.saved_key


#: The rule each scenario relies on, removed. ``state_freed_after_write`` has none of its own to remove:
#: the engine keeps a written tensor's storage until ``release`` as well, so a gradient's block cannot
#: go back to the allocator under its write even if the store did not wait (a parameter's storage
#: object, resized in place, has no such second guard).
RULES: dict[str, tuple[object, str, object]] = {
    "parameter_refilled_after_read": (store_module, "_fill_in_place", _fill_on_the_host),
    "parameter_freed_after_write": (TensorStore, "finish_write", _finish_write_without_waiting),
    "state_moved_onto_read": (Engine, "_order_before_consumer", _no_consumer_wait),
    "parameter_read_back_before_commit": (Record, "disk_key", property(_committed_key)),
}


@pytest.mark.parametrize("tier", DEVICE_TIERS)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_store_order_holds(fake_device, tier, scenario, tmp_path, monkeypatch):
    prepare_device_tier(tier, fake_device, monkeypatch)
    SCENARIOS[scenario](fake_device, tier, tmp_path)


@pytest.mark.parametrize("tier", DEVICE_TIERS)
@pytest.mark.parametrize("scenario", list(RULES))
def test_store_order_fails_without_its_rule(fake_device, tier, scenario, tmp_path, monkeypatch):
    prepare_device_tier(tier, fake_device, monkeypatch)
    owner, name, stub = RULES[scenario]
    monkeypatch.setattr(owner, name, stub)
    with pytest.raises(AssertionError, match="before"):
        SCENARIOS[scenario](fake_device, tier, tmp_path)
