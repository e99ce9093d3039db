"""The ``teraio::`` custom ops that a rewritten graph calls to move saved tensors, and the engines they use.

Order between migration ops and compute is carried by data, never by graph position alone, because
compilers reorder and reuse buffers (docs/measured_facts.md, three proven hazards):

- ``offload(x, anchors) -> handle`` starts writing the whole storage behind ``x``.
- ``wait_write(handle, keepalive=x, anchors) -> token`` blocks until the write is done and lets the
  engine drop its reference. See Note: [Keepalive until the write completes].
- ``prefetch(token, anchors) -> token`` starts reading the bytes back.
- ``fetch(token, anchors) -> flat`` returns the storage as a fresh 1-D tensor; the graph rebuilds every
  saved view of it with ``as_strided``.

Note: [Every invocation owns its bytes]
A graph's ops carry a fixed key per saved tensor, but one compiled forward may run several times before
any backward (two forwards then one backward; gradient accumulation) or never see its backward (a
validation loss computed with grad enabled). So ``offload`` draws a fresh invocation number and the
runtime key is ``<graph key>#<number>``; the number travels as the value of the handle and token
tensors into ``wait_write``, the saved token, ``prefetch`` and ``fetch``. The tokens own the key: each
live token holds one reference and the key is dropped when the last one dies. The saved token lives as
long as the autograd graph keeps it (through every backward with ``retain_graph``; until the graph is
freed when no backward runs); a backward that frees it at its last use (the boxed convention does) has
already made the prefetch token, which lives until the fetch. Nothing leaks, nothing is dropped while a
fetch may still need it, and no invocation reads another's bytes.

Note: [Keepalive until the write completes]
An asynchronous write reads the tensor's memory after ``offload`` returns. If nothing in the graph used
that tensor afterwards, Inductor would free or reuse its buffer (``buf7 = buf3; del buf3  # reuse``) while
the write still reads it, and the file would hold the new bytes: silently wrong gradients. So the wait
takes the source tensor as an input: the buffer lives until the write is known complete.

Note: [Anchors pin positions]
Inductor hoists a node whose inputs are all ready as early as it likes: a wait placed at the end of the
forward moved to right after its offload, making the I/O synchronous. Every wait/prefetch/fetch takes
``anchors``: outputs of the op just before its planned position, so it cannot run earlier than planned.
"""

from __future__ import annotations

import itertools
import threading
import weakref

import torch

_ENGINES: dict[int, object] = {}
_ENGINE_IDS = itertools.count(1)
_LOCK = threading.Lock()


def register_engine(engine: object) -> int:
    """Make an engine reachable from graph ops by a small integer id (graphs cannot hold objects)."""
    with _LOCK:
        eid = next(_ENGINE_IDS)
        _ENGINES[eid] = engine
        return eid


def unregister_engine(engine_id: int) -> None:
    with _LOCK:
        _ENGINES.pop(engine_id, None)


class RegisteredEngine:
    """An engine reachable from graph ops by ``id`` until :meth:`close`, which closes the engine and takes
    it off the registry together (also on leaving a ``with`` block): no id outlives its engine's owner."""

    def __init__(self, engine: object) -> None:
        self.engine = engine
        self.id = register_engine(engine)

    def close(self) -> None:
        try:
            self.engine.close()  # type: ignore[attr-defined]
        finally:
            unregister_engine(self.id)

    def __enter__(self) -> RegisteredEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def get_engine(
    engine_id: int,
):  # -> runtime.Engine (untyped here: ops must not import teraio.runtime eagerly)
    try:
        return _ENGINES[engine_id]
    except KeyError:
        raise RuntimeError(
            f"teraio engine {engine_id} is not registered in this process; the compiled graph outlived "
            "its backend (recompile with a live teraio backend)"
        ) from None


_INVOCATIONS = itertools.count(1)


#: The bytes of one handle or token: one int64 element, always in host memory, so they count against a
#: budget only when the graph computes on the CPU (Note: [An offloaded tensor leaves a token] in
#: planner.lifetimes).
TOKEN_BYTES = 8


def offload_token_bytes(device: str) -> int:
    """What each offloaded tensor's tokens hold in ``device``'s memory (the profile's ``offload_token_bytes``)."""
    return TOKEN_BYTES if device.split(":")[0] == "cpu" else 0


def _token(number: int) -> torch.Tensor:
    return torch.tensor([number], dtype=torch.int64)


def _invocation_key(key: str, token: torch.Tensor) -> str:
    """The runtime key of this invocation's copy (Note: [Every invocation owns its bytes])."""
    return f"{key}#{int(token[0])}"


#: The live tokens of each (engine, key), by token number: the key is dropped when the set empties.
_TOKEN_REFS: dict[tuple[int, str], set[int]] = {}
_TOKEN_IDS = itertools.count(1)


def _owning_token(number: int, engine_id: int, key: str) -> torch.Tensor:
    """A token that keeps ``key`` alive (Note: [Every invocation owns its bytes])."""
    token = _token(number)
    token_id = next(_TOKEN_IDS)
    # One C-level call each (setdefault, add): atomic under the GIL, so no lock is needed here, and none
    # in the finalizer that undoes it. A key gets its second token (prefetch) while its first one is an
    # argument of that call, so a finalizer never empties the set in between.
    _TOKEN_REFS.setdefault((engine_id, key), set()).add(token_id)
    weakref.finalize(token, _token_freed, engine_id, key, token_id)
    return token


def _token_freed(engine_id: int, key: str, token_id: int) -> None:
    """A token died: the last one of its key has the engine drop the key.

    A finalizer: it runs wherever the collector frees the token, maybe on a thread that holds one of the
    engine's locks, so it takes none; it only queues the drop for the engine's next call (Note: [No lock
    in a finalizer or a signal handler] in runtime/engine.py). Possibly at interpreter exit, after the
    engine was closed and unregistered: then there is nothing to drop.
    """
    refs = _TOKEN_REFS.get((engine_id, key))
    if refs is not None:
        refs.discard(token_id)
        if refs:
            return
        _TOKEN_REFS.pop((engine_id, key), None)
    engine = _ENGINES.get(engine_id)
    if engine is not None:
        engine.drop_later(key)


def whole_storage(x: torch.Tensor) -> torch.Tensor:
    """A 1-D tensor over the entire storage behind ``x`` (views of one buffer share it)."""
    storage = x.untyped_storage()
    numel = storage.nbytes() // x.element_size()
    return torch.empty(0, dtype=x.dtype, device=x.device).set_(storage, 0, (numel,), (1,))


# Storage address of each in-flight write by (engine, key), to check the keepalive really is the
# written buffer. Keys repeat across backends ("g0/..."), so the engine is part of the identity.
_INFLIGHT: dict[tuple[int, str], int] = {}


# Note: [Exact layout of offloaded tensors]
# The backward rebuilds saved views from the fetched bytes with the strides the graph's fake tensors promise.
# Inductor is free to give a buffer another layout, and reading its bytes back with the promised strides would
# give silently wrong gradients. So ``offload`` takes the buffer as it is (flexible_layout: no compiler
# copies) and, when its layout is not the promised one, writes a copy in the promised layout; the engine owns
# that copy until the write is done, so no keepalive is needed for it.
@torch.library.custom_op("teraio::offload", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def offload(
    x: torch.Tensor, anchors: list[torch.Tensor], key: str, engine: int, stride: list[int]
) -> torch.Tensor:
    """Start writing the storage behind ``x`` under ``key``; return a handle token at once."""
    handle = _token(next(_INVOCATIONS))
    key = _invocation_key(key, handle)
    covers = x.storage_offset() == 0 and x.untyped_storage().nbytes() == x.numel() * x.element_size()
    if list(x.stride()) == list(stride) and covers:
        get_engine(engine).offload(key, whole_storage(x))
        _INFLIGHT[(engine, key)] = x.untyped_storage().data_ptr()
    else:
        staged = torch.empty_strided(tuple(x.shape), tuple(stride), dtype=x.dtype, device=x.device)
        staged.copy_(x)
        get_engine(engine).offload(key, whole_storage(staged))
    return handle


@offload.register_fake
def _offload_fake(
    x: torch.Tensor, anchors: list[torch.Tensor], key: str, engine: int, stride: list[int]
) -> torch.Tensor:
    return torch.empty(1, dtype=torch.int64)


@torch.library.custom_op("teraio::wait_write", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def wait_write(
    handle: torch.Tensor, keepalive: torch.Tensor, anchors: list[torch.Tensor], key: str, engine: int
) -> torch.Tensor:
    """Block until ``key``'s write is complete, then release the engine's in-memory reference.

    ``keepalive`` is the tensor being written (Note: [Keepalive until the write completes]); ``anchors``
    pin the position (Note: [Anchors pin positions]). flexible_layout: the compiler must hand over the
    buffer itself, never a copy, or the keepalive would protect the wrong memory; checked below.
    """
    key = _invocation_key(key, handle)
    written = _INFLIGHT.pop((engine, key), None)
    if written is not None and keepalive.untyped_storage().data_ptr() != written:
        get_engine(engine).release(key)
        raise RuntimeError(
            f"teraio wait {key!r}: the keepalive is not the buffer being written (the compiler copied it); "
            "the write may have read reused memory, so this step's saved tensor cannot be trusted"
        )
    get_engine(engine).release(key)
    return _owning_token(int(handle[0]), engine, key)


@wait_write.register_fake
def _wait_write_fake(handle, keepalive, anchors, key, engine) -> torch.Tensor:
    return torch.empty(1, dtype=torch.int64)


@torch.library.custom_op("teraio::prefetch", mutates_args=())
def prefetch(token: torch.Tensor, anchors: list[torch.Tensor], key: str, engine: int) -> torch.Tensor:
    """Start reading ``key`` back (the engine forwards from memory when it still holds the bytes)."""
    key = _invocation_key(key, token)
    get_engine(engine).prefetch(key)
    return _owning_token(int(token[0]), engine, key)


@prefetch.register_fake
def _prefetch_fake(token, anchors, key, engine) -> torch.Tensor:
    return torch.empty(1, dtype=torch.int64)


@torch.library.custom_op("teraio::fetch", mutates_args=())
def fetch(
    token: torch.Tensor,
    anchors: list[torch.Tensor],
    key: str,
    engine: int,
    numel: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Wait for ``key``'s read and return the whole storage as a fresh 1-D tensor of ``numel`` elements."""
    key = _invocation_key(key, token)
    t = get_engine(engine).fetch(key)
    if t.dtype != dtype or t.numel() != numel or t.dim() != 1:
        raise RuntimeError(
            f"teraio fetch {key!r}: engine returned {t.dtype}[{tuple(t.shape)}], expected {dtype}[{numel}]"
        )
    if t.device != device:
        t = t.to(device)
    # A custom op must not return memory the engine may hand out again (forwarding from a live copy):
    # share nothing with another key's tensor. The engine's buffer is ours when it came from a read.
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.storage_offset() != 0:
        t = t.clone()
    return t


@fetch.register_fake
def _fetch_fake(token, anchors, key, engine, numel, dtype, device) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, device=device)
