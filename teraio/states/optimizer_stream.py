"""The optimizer step streamed through memory: the stock optimizer's own step, one chunk of parameters at
a time, with the reads of the next chunk and the writes of the previous one in flight meanwhile.

Where a chunk closes is ``teraio.states.step_chunks``; the updates made inside backward, and their commit
by ``opt.step()``, are ``teraio.states.update_in_backward``'s. :class:`StreamedStep` holds the records on
disk and the step over them, and offers the in-backward updates the same moves its own step makes
(the stock step narrowed to some parameters, a write to the other slot, the commit, the rollback).

Note: [The step streams in backward order]
    Chunks are cut (by bytes of gradients and states: Note: [Small parameters ride with their
    neighbours] in teraio.states.step_chunks) from the parameters in the order their gradients
    arrived in the first backward: the last layers first, the first layers last. The first layers are
    then the last ones updated and written, the ones still in memory when the step returns, and the ones
    the next forward needs first (ZeRO-Infinity's swapper and DeepCompile stream in a fixed order too;
    here the order is the one the next forward consumes from the end of the step). Parameters whose
    gradient never arrived keep the optimizer's order, last layers first (reversed).

Note: [Three chunks in memory]
    For chunk i the loop starts the reads of chunk i+1, waits for chunk i's reads, runs the stock step on
    chunk i, starts chunk i's writes, and only then waits for chunk i-1's writes and frees chunk i-1. So at
    most chunks i-1 (writing), i (updating) and i+1 (reading) hold memory, and a chunk's reads overlap
    the update of the one before it and the writes of the one before that.

Note: [A step commits all of its states or none]
    Each state tensor has two slots on disk. A step reads every state from its committed slot and writes
    the updated state to the other slot; only when every write of the step has finished does one
    assignment switch the committed slots, after which the old slots are dropped. An exception anywhere
    in the step (a failed read, a failed write, an error in the optimizer's own code) drops the slots the
    step wrote, frees the memory the step loaded, and restores the resident scalars (``step``) from a
    copy taken before each chunk's update: the optimizer's state is then the last committed step's, bit
    for bit. Offloaded parameters (teraio.states.params) take part like the states: the step writes each
    updated one to its other slot and the commit switches them too, so a failure leaves them at the
    committed step. Resident parameters are updated in place by the stock step and cannot be rolled
    back: when the failure came after the update of a chunk with one, the offload says so and refuses
    ``state_dict()`` and ``step()`` until a checkpoint is loaded (``Consistency.PARAMETERS_AHEAD``).

Note: [The optimizer step inside backward]
    With ``optimizer_in_backward=True`` a parameter is updated as soon as its gradient is complete (the
    hook after AccumulateGrad), by the same stock step narrowed to that parameter, and its gradient is
    freed at once: no gradient is written to disk or kept until the step, and only one parameter's
    states are updated at a time (at most ``window_bytes`` of writes in flight). With offloaded
    parameters (teraio.states.params) the states of a block's parameters are read when the block's
    backward starts, behind its compute, and each parameter is updated while that backward still holds
    it. A compiled
    graph's backward still returns all of its gradients together (AOTAutograd), so they are freed one
    graph at a time: one block's with each block compiled on its own, the whole model's with one graph.
    A parameter's value is not used by backward after its gradient is complete (every op that saved it
    contributes to that gradient first), so the result is the same, bit for bit, as the update after
    backward. ``opt.step()`` then commits what backward wrote (Note: [A step commits all of its states
    or none]); a second backward before it (gradient accumulation) is refused in one line, and clipping
    or a GradScaler cannot work, since the gradients are gone when backward returns: a clip or an unscale
    over them raises one line (Note: [Clipping when the update runs in backward] in
    teraio.states.grad_norms).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import Enum
from functools import partial
from typing import Any

import torch

from teraio.states.errors import StatesError
from teraio.states.params import ParamResidency, param_key
from teraio.states.shards import local, local_nbytes, rewrap
from teraio.states.step_chunks import Chunk, StepLog, cut_chunks
from teraio.states.store import Kind, Record, Residency, TensorStore
from teraio.states.update_in_backward import InBackwardUpdates
from teraio.states.update_scratch import chunk_scratch_bytes

__all__ = [
    "RESIDENT_STATE_KEYS",
    "Chunk",
    "Consistency",
    "StepLog",
    "StreamedStep",
    "cut_chunks",
    "narrowed",
    "slot_of",
    "state_key",
]


class Consistency(Enum):
    """Whether the parameters and the committed optimizer state describe the same step."""

    COMMITTED = "committed"
    PARAMETERS_AHEAD = "parameters_ahead"  # a failed step updated some parameters, the states are older


#: The state entries that stay resident: tiny scalars the stock optimizers update every step.
RESIDENT_STATE_KEYS = frozenset({"step"})


def state_key(param_idx: int, name: str, slot: int) -> str:
    """The engine key of one slot of one optimizer state tensor."""
    return f"state/{param_idx}/{name}/{slot}"


def slot_of(key: str) -> int:
    return int(key.rsplit("/", 1)[1])


@contextmanager
def narrowed(opt: torch.optim.Optimizer, params: set[int], by_id: dict[int, int]) -> Iterator[None]:
    """Every param group lists only the parameters in ``params`` (indices; ``by_id`` maps ``id(p)`` to
    its index); restored afterwards, whatever happens."""
    saved = [(g, g["params"]) for g in opt.param_groups]
    try:
        for g, ps in saved:
            g["params"] = [p for p in ps if by_id[id(p)] in params]
        yield
    finally:
        for g, ps in saved:
            g["params"] = ps


class StreamedStep:
    """The optimizer states on disk and the streamed step over them (see the module's notes)."""

    def __init__(
        self,
        opt: torch.optim.Optimizer,
        store: TensorStore,
        params: list[torch.nn.Parameter],
        chunk_bytes: int,
        states_per_param: Callable[[dict[str, Any]], int],
    ) -> None:
        self.opt = opt
        self.store = store
        self.params = params
        self.by_id = {id(p): i for i, p in enumerate(params)}
        self.chunk_bytes = chunk_bytes
        self.states_per_param = states_per_param
        #: param index -> state name -> its record; the record's ``saved_key`` is the committed slot.
        self.records: dict[int, dict[str, Record]] = {}
        self.committed_steps = 0
        self.consistency = Consistency.COMMITTED
        self.failure: str | None = None
        self.last: StepLog | None = None
        #: Test seam: called with the chunk's position before its stock step.
        self.before_chunk_update: Callable[[int], None] | None = None
        # Note: [The optimizer step inside backward]: the step in progress inside backward.
        self._in_backward = InBackwardUpdates(self)
        #: Note: [When a parameter is resident] in teraio.states.params (None: parameters stay resident).
        self.residency: ParamResidency | None = None
        #: Note: [The whole-step budget keeps some states in memory] in teraio.states.residency: parameters
        #: whose optimizer states stay in memory (updated in place by the stock step, like ``step``).
        self.kept: frozenset[int] = frozenset()
        self._group_of = {}
        for g in opt.param_groups:
            for p in g["params"]:
                self._group_of[id(p)] = g

    # -- records -----------------------------------------------------------------------------------
    def records_of(self, idx: int) -> list[Record]:
        return list(self.records.get(idx, {}).values())

    def all_records(self) -> list[Record]:
        return [r for recs in self.records.values() for r in recs.values()]

    def _offloaded_items(self, idx: int) -> list[tuple[str, torch.Tensor]]:
        """The state tensors of ``params[idx]`` that live on disk (DTensors under FSDP2: Note: [A sharded
        tensor's bytes are its local shard] in teraio.states.shards)."""
        st = self.opt.state.get(self.params[idx])
        if not st or idx in self.kept:
            return []
        return [
            (k, v)
            for k, v in st.items()
            if isinstance(k, str) and isinstance(v, torch.Tensor) and k not in RESIDENT_STATE_KEYS
        ]

    def reconcile(self, idx: int) -> list[Record]:
        """Records for the state tensors the stock step left in ``opt.state[p]`` (new on the first step,
        or objects it replaced), marked changed: they are written next."""
        out = []
        recs = self.records.setdefault(idx, {})
        for name, v in self._offloaded_items(idx):
            rec = recs.get(name)
            if rec is None:
                rec = recs[name] = self.store.new_record(Kind.OPTIMIZER_STATE, v, name, param_idx=idx)
            elif rec.tensor is not local(v):
                self.store.adopt(rec, v)
            self.store.mark_changed(rec)
            out.append(rec)
        return out

    @property
    def updating_in_backward(self) -> bool:
        """Note: [The optimizer step inside backward]: updates made in backward await their commit."""
        return self._in_backward.active

    def keep(self, idxs: frozenset[int]) -> None:
        """Note: [The whole-step budget keeps some states in memory] in teraio.states.residency: the states of
        the parameters ``idxs`` stay in memory from now on (read back, their disk slots dropped); those of
        the parameters the plan kept before go to disk now (written to slot 0 and committed there), so
        the next step finds every offloaded state with a committed copy. Call between steps only."""
        if self._in_backward.active:
            raise RuntimeError(
                "the states' residency changes between steps, not during an update in backward"
            )
        for i in sorted(idxs - self.kept):
            for rec in self.records.pop(i, {}).values():
                self.store.load(rec)
                self.store.drop_key(rec.saved_key)
                self.store.drop_key(rec.staged_key)
                rec.saved_key = rec.staged_key = None
                self.store.forget(rec)
        leaving = sorted(self.kept - idxs)
        self.kept = frozenset(idxs)
        self._write_committed([(i, name, v) for i in leaving for name, v in self._offloaded_items(i)])

    def write_loaded(self, idx: int, name: str, tensor: torch.Tensor) -> None:
        """A state tensor just loaded from a checkpoint (and put in ``opt.state``): written to slot 0,
        committed there, its memory freed (teraio.states.checkpoint)."""
        self._write_committed([(idx, name, tensor)])

    def _write_committed(self, items: list[tuple[int, str, torch.Tensor]]) -> None:
        """New records for these state tensors ``(param index, name, tensor)``, written to slot 0 and
        committed there, their memory freed."""
        fresh: list[Record] = []
        for i, name, v in items:
            rec = self.store.new_record(Kind.OPTIMIZER_STATE, v, name, param_idx=i)
            self.records.setdefault(i, {})[name] = rec
            self.store.write(rec, state_key(i, name, 0))
            fresh.append(rec)
        for rec in fresh:
            rec.saved_key = self.store.finish_write(rec)
            rec.staged_key = None
            self.store.evict(rec)

    def kept_state_nbytes(self) -> int:
        """Bytes of the optimizer states kept in memory by the plan (those that exist now)."""
        total = 0
        for i in self.kept:
            st = self.opt.state.get(self.params[i]) or {}
            total += sum(
                local_nbytes(v)
                for k, v in st.items()
                if isinstance(v, torch.Tensor) and k not in RESIDENT_STATE_KEYS
            )
        return total

    def state_footprint(self, idx: int) -> tuple[int, int]:
        """The optimizer state tensors of ``params[idx]`` and their bytes: those it has, or before its
        first step those the optimizer will make (each the parameter's size)."""
        recs = self.records_of(idx)
        if recs:
            return len(recs), sum(r.nbytes for r in recs)
        p = self.params[idx]
        n = self.states_per_param(self._group_of.get(id(p), {}))
        return n, n * local_nbytes(p)

    def moved_nbytes(self, idx: int, grad_nbytes: int) -> int:
        """What the step reads and writes for ``params[idx]``: the parameter when it is offloaded, its
        gradient's ``grad_nbytes`` (0: in memory), and its states unless the plan keeps them."""
        p = self.params[idx]
        param_nbytes = local_nbytes(p) if self.param_record(idx) is not None else 0
        state_nbytes = 0 if idx in self.kept else self.state_footprint(idx)[1]
        return param_nbytes + grad_nbytes + state_nbytes

    def cut(
        self, order: list[int], grad_nbytes: Callable[[int], int], chunk_bytes: int | None = None
    ) -> list[Chunk]:
        """The chunks a step over the parameters ``order`` streams (Note: [Three chunks in memory]), each
        of what it reads and writes (``grad_nbytes(idx)``: the bytes of an offloaded gradient, 0 for one
        in memory), cut at ``chunk_bytes`` (None: the step's own)."""
        size = self.chunk_bytes if chunk_bytes is None else chunk_bytes
        return cut_chunks(order, lambda i: self.moved_nbytes(i, grad_nbytes(i)), size)

    def update_scratch_bytes(self, chunk: Chunk) -> int:
        """What the stock step allocates while it updates ``chunk`` (teraio.states.update_scratch)."""
        groups = [self._group_of.get(id(self.params[i])) for i in chunk.param_idxs]
        return chunk_scratch_bytes(self.opt, [self.params[i] for i in chunk.param_idxs], groups)

    def param_record(self, idx: int) -> Record | None:
        """The record of ``params[idx]`` when it is offloaded (teraio.states.params); None: resident."""
        return None if self.residency is None else self.residency.records.get(idx)

    # -- the step ----------------------------------------------------------------------------------
    def check_usable(self) -> None:
        """Refuse a step after one that failed and left the parameters ahead of the states."""
        if self.consistency is Consistency.PARAMETERS_AHEAD:
            raise StatesError(
                self.failure or "a failed optimizer step left the parameters ahead of the states"
            )

    def run(
        self,
        order: list[int],
        grad_record: Callable[[int], Record | None],
        raw_step: Callable[[], Any],
    ) -> None:
        """One step over the parameters that have a gradient, in ``order`` (Note: [The step streams in
        backward order]). ``grad_record(idx)`` is the record of an offloaded gradient (None: resident or
        absent); ``raw_step()`` runs the stock step on the narrowed param groups."""
        self.check_usable()
        live = [i for i in order if self.params[i].grad is not None]
        if self.residency is not None:  # a failed step goes back to what is on disk: it must be there
            self.residency.sync(live)
        chunks = self.cut(live, lambda i: 0 if (g := grad_record(i)) is None else g.nbytes)
        log = self.last = StepLog([c.param_idxs for c in chunks], [c.nbytes for c in chunks])
        self.store.reset_window_peak()
        loads: list[list[Record]] = []
        for c in chunks:
            recs = [r for i in c.param_idxs for r in self.records_of(i)]
            recs += [g for i in c.param_idxs if (g := grad_record(i)) is not None]
            recs += [r for i in c.param_idxs if (r := self.param_record(i)) is not None]
            loads.append(recs)
        touched: list[Record] = []  # state records whose memory or staged slot this step changed
        snapshots: list[dict[int, dict[str, Any]]] = []
        written: list[list[Record]] = [[] for _ in chunks]
        try:
            for r in loads[0] if chunks else []:
                self.store.prefetch(r)
            for pos, c in enumerate(chunks):
                update = partial(self.update_narrowed, c.param_idxs, raw_step, log)
                update_chunk(self, pos, c.param_idxs, loads, touched, snapshots, written, update)
                for r in loads[pos]:
                    if r.kind is Kind.GRADIENT and r.residency is Residency.SAVED:
                        self.store.evict(r)  # unchanged by the step: its disk copy is still valid
                if pos >= 1:
                    self.finish_writes(written[pos - 1])
            if chunks:
                # Note: [When a parameter is resident]: the last chunk's parameters (the first layers)
                # stay for the next forward.
                self.finish_writes(written[-1], keep_parameters=True)
        except BaseException as exc:
            self.roll_back(touched, loads, snapshots, log, exc)
            raise
        self.commit(touched)

    def update_narrowed(self, idxs: list[int], raw_step: Callable[[], Any], log: StepLog) -> None:
        """Run the stock step (``raw_step``) on the parameters ``idxs`` alone, counted in ``log``."""
        with narrowed(self.opt, set(idxs), self.by_id):
            log.updated_chunks += 1
            if any(self.param_record(i) is None for i in idxs):
                log.updated_resident_chunks += 1
            raw_step()

    def write_staged(self, idx: int, rec: Record) -> None:
        """Start writing ``rec`` (a state or the parameter of ``params[idx]``, changed by the step) to its
        slot other than the committed one (Note: [A step commits all of its states or none])."""
        other = 1 - slot_of(rec.saved_key) if rec.saved_key is not None else 0
        key = param_key(idx, other) if rec.kind is Kind.PARAMETER else state_key(idx, rec.name, other)
        self.store.write(rec, key)

    # -- Note: [The optimizer step inside backward] ------------------------------------------------
    def update_in_backward(
        self, idx: int, raw_step: Callable[[], Any], prefetch_next: int | None, window_bytes: int
    ) -> None:
        """Update ``params[idx]`` now (its gradient is complete), free its gradient, write its states
        (``teraio.states.update_in_backward``)."""
        self._in_backward.update(idx, raw_step, prefetch_next, window_bytes)

    def commit_in_backward(self) -> bool:
        """``opt.step()`` after a backward that updated parameters: wait for the writes and commit (False:
        no update ran since the last commit)."""
        return self._in_backward.commit()

    # -- Note: [A step commits all of its states or none] ------------------------------------------
    def finish_writes(self, recs: list[Record], keep_parameters: bool = False) -> None:
        """Wait for the writes of ``recs`` and free their memory (parameters that a graph still computes
        with, or ``keep_parameters``, stay)."""
        for rec in recs:
            self.store.finish_write(rec)
        for rec in recs:
            if rec.kind is Kind.PARAMETER and (keep_parameters or self._held(rec)):
                continue
            self.store.evict(rec)

    def _held(self, rec: Record) -> bool:
        """A graph running now computes with this parameter (it is freed when that graph releases it)."""
        return self.residency is not None and self.residency.uses.get(rec.param_idx, 0) > 0

    def commit(self, touched: list[Record]) -> None:
        """Note: [A step commits all of its states or none]: every write finished; switch the slots."""
        old = [(r.saved_key, r.staged_key) for r in touched if r.staged_key is not None]
        for rec in touched:
            if rec.staged_key is not None:
                rec.saved_key, rec.staged_key = rec.staged_key, None
        self.committed_steps += 1
        if self.residency is not None:
            for rec in touched:
                if rec.kind is Kind.PARAMETER:
                    self.residency.saved(rec.param_idx)
        for previous, new in old:
            if previous is not None and previous != new:
                self.store.drop_key(previous)

    def snapshot(self, idxs: list[int]) -> dict[int, dict[str, Any]]:
        """The resident state entries of these parameters before their update (None: no state yet)."""
        snap: dict[int, dict[str, Any]] = {}
        for i in idxs:
            st = self.opt.state.get(self.params[i])
            if st is None:
                snap[i] = {}
                continue
            snap[i] = {
                k: (v.clone() if isinstance(v, torch.Tensor) else v)
                for k, v in st.items()
                if not (isinstance(v, torch.Tensor) and k not in RESIDENT_STATE_KEYS)
            }
            snap[i]["__offloaded__"] = {
                k: v for k, v in st.items() if isinstance(v, torch.Tensor) and k not in RESIDENT_STATE_KEYS
            }
        return snap

    def roll_back(
        self,
        touched: list[Record],
        loads: list[list[Record]],
        snapshots: list[dict[int, dict[str, Any]]],
        log: StepLog,
        exc: BaseException,
    ) -> None:
        """Note: [A step commits all of its states or none]: back to the last committed step."""
        for recs in loads:  # reads in flight or done: their memory goes (gradients keep their disk copy)
            for r in recs:
                if r.kind is Kind.PARAMETER and r in touched:
                    continue  # discarded below: its committed slot holds the value before the step
                if r.kind in (Kind.GRADIENT, Kind.PARAMETER):
                    if r.residency is Residency.READING:
                        self.store.drain_read(r)
                    elif r.residency is Residency.SAVED:
                        self.store.evict(r)
        for rec in touched + [r for recs in loads for r in recs if r.kind is Kind.OPTIMIZER_STATE]:
            self.store.discard(rec)
            if rec.staged_key is not None and rec.staged_key != rec.saved_key:
                self.store.drop_key(rec.staged_key)
            rec.staged_key = None
        for snap in snapshots:
            for i, entries in snap.items():
                p = self.params[i]
                if not entries:  # no state before this step: the step's new entries go
                    for rec in self.records.pop(i, {}).values():
                        self.store.forget(rec)
                    self.opt.state.pop(p, None)
                    continue
                st = self.opt.state[p]
                offloaded = entries["__offloaded__"]
                for k, v in entries.items():
                    if k == "__offloaded__":
                        continue
                    if isinstance(v, torch.Tensor) and isinstance(st.get(k), torch.Tensor):
                        with torch.no_grad():
                            st[k].copy_(v)
                    else:
                        st[k] = v
                for k, v in offloaded.items():  # the committed objects, whatever the step assigned
                    st[k] = v
                    rec = self.records.get(i, {}).get(k)
                    if rec is not None and rec.tensor is not local(v):
                        self.store.forget(rec)
                        rec.tensor = local(v)
        if log.updated_resident_chunks:
            self.consistency = Consistency.PARAMETERS_AHEAD
            self.failure = (
                f"optimizer step {self.committed_steps + 1} failed ({type(exc).__name__}: {exc}) after "
                f"updating the parameters of {log.updated_chunks} of {len(log.chunks)} chunks: the optimizer "
                f"state on disk is step {self.committed_steps}'s, some parameters are not; load a checkpoint "
                "(the model's and optimizer.load_state_dict) before saving or stepping again"
            )

    # -- whole-state moves (checkpoints) ------------------------------------------------------------
    def adopt_all(self) -> None:
        """After ``load_state_dict``: forget the old records, write every state tensor ``opt.state`` holds
        now to slot 0 and free it (Note: [A step commits all of its states or none])."""
        for rec in self.all_records():
            self.store.drop_key(rec.saved_key)
            self.store.drop_key(rec.staged_key)
            self.store.forget(rec)
        self.records.clear()
        items: list[tuple[int, str, torch.Tensor]] = []
        for idx, p in enumerate(self.params):
            st = self.opt.state.get(p)
            if not st:
                continue
            for name, v in self._offloaded_items(idx):
                # Our own object over the loaded storage: the caller's loaded tensors must not be freed.
                loaded = local(v)
                own = torch.empty(0, dtype=loaded.dtype, device=loaded.device)
                with torch.no_grad():
                    own.set_(loaded.untyped_storage(), loaded.storage_offset(), loaded.shape, loaded.stride())
                st[name] = rewrap(v, own)  # a DTensor's state stays one, over our local shard
                items.append((idx, name, st[name]))
        self._write_committed(items)
        self.consistency = Consistency.COMMITTED
        self.failure = None


def update_chunk(
    stream: StreamedStep,
    pos: int,
    idxs: list[int],
    loads: list[list[Record]],
    touched: list[Record],
    snapshots: list[dict[int, dict[str, Any]]],
    written: list[list[Record]],
    update: Callable[[], None],
) -> None:
    """Chunk ``pos`` (the parameters ``idxs``) of a streamed step, whether ``opt.step()`` runs it or the
    next forward (teraio.states.step_pipeline): the next chunk's reads started (Note: [Three chunks in
    memory]), this chunk's records (``loads[pos]``) in memory, its state entries snapshot for a roll back,
    the stock step run by ``update``, and what it changed (offloaded parameters, states) being written to
    their other slots (Note: [A step commits all of its states or none]), each listed in ``touched`` and
    ``written[pos]``."""
    store = stream.store
    if pos + 1 < len(loads):
        for r in loads[pos + 1]:
            store.prefetch(r)
    for r in loads[pos]:
        if r.kind is Kind.OPTIMIZER_STATE:
            touched.append(r)
        store.load(r)
    snapshots.append(stream.snapshot(idxs))
    if stream.before_chunk_update is not None:
        stream.before_chunk_update(pos)
    update()
    for i in idxs:
        if (prec := stream.param_record(i)) is not None:  # updated in place: to its other slot
            touched.append(prec)
            store.mark_changed(prec)
            stream.write_staged(i, prec)
            written[pos].append(prec)
        for rec in stream.reconcile(i):
            if rec not in touched:
                touched.append(rec)
            stream.write_staged(i, rec)
            written[pos].append(rec)
