"""Parameters on disk between their uses: fetched for each graph call that computes with them, freed after
it, updated and written by the streamed optimizer step (``offload_parameters=True``).

Note: [A parameter keeps its storage object]
    A parameter is held by the model, the optimizer, and, between a forward and its backward, by autograd
    as a saved tensor that shares its storage (AOTAutograd saves the weights a backward needs). So neither
    the object nor its storage object changes: while its bytes are on disk the storage is resized to zero
    bytes, and it is resized back and filled before a graph computes with it (FSDP2 frees unsharded
    parameters the same way). The fill keeps the version counter where it was, since autograd checks it on
    the tensors the forward saved, and the values are the ones saved. Gradients and optimizer states,
    whose storage nobody else shares, swap storage objects instead (teraio.states.store).

Note: [When a parameter is resident]
    A parameter is fetched (waiting for its read) just before a compiled graph that takes it as an input
    runs, forward or backward, and freed when no running graph needs it any more. While graph call k of a
    step runs forward, the parameters of call k+1 of the previous step's order are read ahead; while the
    backward of a call runs, those of the call whose backward comes next (the one before it in forward
    order). Between steps the streamed step holds them (Note: [The step streams in backward order] in
    teraio.states.optimizer_stream): it updates and writes each chunk, commits them with the optimizer's
    states, and keeps the last chunk (the first layers) resident for the next forward. Parameters under
    ``min_nbytes`` (norms, biases) stay resident. Frozen weights (``requires_grad=False``, not in the
    optimizer) move the same way but read-only (Note: [Frozen weights are read-only state] in
    teraio.states.frozen). A value changed outside the step (``load_state_dict``,
    an edit under ``no_grad``) is seen by its version counter when it is freed and written first.

Note: [A parameter eager code uses stays resident]
    A parameter a compiled graph takes may also be used by a module that runs eagerly: weights tied between a
    compiled block and an eager head, a submodule the loop also calls on its own. (A graph break inside a
    module's forward does not make Dynamo run that module eagerly.) Eager code reads the tensor's storage
    directly, and its autograd keeps it for a backward no teraio hook sees, so such a parameter must stay in
    memory. Every module owning an offloadable parameter gets a forward pre-hook that does nothing while
    Dynamo traces it (it is not part of any graph) and, when the module runs eagerly, brings its offloaded
    parameters back into memory for good: their disk copies are dropped, they leave the residency (the
    streamed step then treats them as resident parameters), and no graph adopts them again; a log line names
    them. A parameter whose update is written but not committed yet (an in-backward step before
    ``opt.step()``) is held in memory until the commit and leaves then.

Note: [Reading an offloaded parameter]
    An offloaded parameter's storage is empty between uses (on CPU a direct read dereferences a null
    pointer). While no module of the model runs it is guarded, its reads served (Note: [Parameters are
    guarded while no module of the model runs] in teraio.states.entry_gate); modules that run eagerly
    keep theirs (Note: [A parameter eager code uses stays resident]). ``model.state_dict()`` returns
    copies read back from disk (hooks on every module), ``model.load_state_dict()`` fetches each module's
    parameters before it copies into them and frees them after, and :meth:`ParamResidency.materialized`
    brings all of them back for code that must (an EMA, a norm for logging).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from teraio.states.entry_gate import EntryGate, never_guard
from teraio.states.errors import StatesError
from teraio.states.frozen import FrozenWeights, saved_by_backward
from teraio.states.param_hooks import model_hooks
from teraio.states.shards import is_sharded, local, local_nbytes, whole_storage
from teraio.states.store import Kind, Record, Residency, TensorStore

log = logging.getLogger("teraio")


def param_key(idx: int, slot: int) -> str:
    """The engine key of parameter ``idx``'s bytes in ``slot`` (two slots: Note: [A step commits all of
    its states or none] in teraio.states.optimizer_stream)."""
    return f"param/{idx}/{slot}"


def _owns_its_storage(p: torch.Tensor) -> bool:
    """A dense parameter whose storage holds exactly its elements: freeing that storage frees nothing
    another tensor uses. A tensor subclass (a quantized frozen base) keeps its bytes in inner tensors the
    storage swap cannot reach; an FSDP2 shard's storage is FSDP2's padded shard of it, which holds nothing
    else (Note: [A parameter shard moves with its padding] in teraio.states.fsdp_shards)."""
    if is_sharded(p):
        own = local(p)
        return type(own) is torch.Tensor and own.layout is torch.strided and own.is_contiguous()
    return (
        type(p) in (torch.nn.Parameter, torch.Tensor)
        and p.layout is torch.strided
        and p.is_contiguous()
        and p.storage_offset() == 0
        and p.untyped_storage().nbytes() == p.numel() * p.element_size()
    )


class ParamResidency:
    """Which parameters are in memory, with their records in ``store`` (see the module's notes).

    Args:
        store: the states' store (one engine, one byte count per kind).
        params: the optimizer's parameters, by index.
        min_nbytes: parameters smaller than this stay resident.
        frozen: the model's frozen weights, indexed after ``params`` (Note: [Frozen weights are read-only
            state] in teraio.states.frozen).
    """

    def __init__(
        self,
        store: TensorStore,
        params: list[torch.nn.Parameter],
        min_nbytes: int,
        frozen: list[torch.nn.Parameter] | None = None,
    ) -> None:
        self.store = store
        self.params = list(params) + list(frozen or ())
        #: Offloaded parameters: those a compiled graph took as inputs (Note: [When a parameter is
        #: resident]); the others (used only by eager code, say) stay in memory.
        self.records: dict[int, Record] = {}
        #: Parameters that may be offloaded, by ``id``: large enough, and owning their storage.
        self.index_of: dict[int, int] = {
            id(p): i
            for i, p in enumerate(self.params)
            if local_nbytes(p) >= max(min_nbytes, 1) and _owns_its_storage(p)
        }
        self.uses: dict[int, int] = {}
        #: The value's version when its bytes on disk were last made equal to memory (Note: [When a
        #: parameter is resident]: a change outside the step is written before the memory goes).
        self._version: dict[int, int] = {}
        #: Per step, the offloaded parameters of each graph call in forward order; the previous step's
        #: order decides the reads ahead of this step's.
        self._order: list[tuple[int, ...]] = []
        self._last_order: list[tuple[int, ...]] = []
        #: Per graph call of ``_order``: the parameters its backward reads (Note: [A backward reads the
        #: frozen weights it saved] in teraio.states.frozen).
        self._bwd_order: list[tuple[int, ...]] = []
        self._hooks: list[Any] = []
        #: Note: [The optimizer step inside backward] in teraio.states.optimizer_stream: a backward keeps
        #: its parameters until each is updated (no read for the update), then the update releases it.
        self.hold_for_update = False
        self._held: set[int] = set()
        #: Called with a graph call's parameters when its backward starts (the in-backward update reads
        #: their optimizer states ahead, while the backward computes).
        self.on_backward_start: Callable[[tuple[int, ...]], None] | None = None
        #: Note: [A parameter eager code uses stays resident]: held until their commit, then resident.
        self._leaving: set[int] = set()
        self._eager: set[int] = set()  # used by eager code: never offloaded again
        #: Every parameter a graph took (or a load wrote to disk): movable unless eager code uses it.
        self._adopted: set[int] = set()
        self._offloadable = frozenset(self.index_of.values())
        n = len(params)
        movable = [p for i, p in enumerate(self.params[n:], n) if i in self._offloadable]
        self.frozen = FrozenWeights(
            first_idx=n,
            count=len(self.params) - n,
            nbytes=sum(local_nbytes(p) for p in self.params[n:]),
            offloadable_count=len(movable),
            offloadable_nbytes=sum(local_nbytes(p) for p in movable),
        )
        #: Note: [The whole-step budget keeps some states in memory] in teraio.states.residency.
        self.kept: frozenset[int] = frozenset()
        #: Note: [Parameters are guarded while no module of the model runs] in teraio.states.entry_gate:
        #: set by attach_module; parameters a graph compiled outside the model's modules takes are never
        #: guarded (by index).
        self.gate: EntryGate | None = None
        self.unguarded: set[int] = set()
        self.told_unguarded = False
        #: Called with the parameters about to be fetched (teraio.states.step_pipeline).
        self.before_use: Callable[[tuple[int, ...]], None] | None = None
        #: The shards FSDP2's gathers took, group by group in the last step's order: their forward order,
        #: which no graph call shows (Note: [The step follows FSDP2's gathers] in teraio.states.fsdp_shards).
        self.gather_order: Callable[[], list[tuple[int, ...]]] | None = None

    # -- which graph inputs --------------------------------------------------------------------------
    def indices(self, args: Any) -> tuple[int, ...]:
        """The parameters among a graph call's inputs, in input order, offloaded from now on."""
        out = []
        for a in args:
            i = self.index_of.get(id(a))
            if i is not None and i not in out:
                out.append(i)
                if i not in self.records:
                    self._new_record(i)
        return tuple(out)

    def _new_record(self, i: int) -> Record:
        p = self.params[i]
        if is_sharded(p):  # Note: [A parameter shard moves with its padding] in teraio.states.fsdp_shards
            rec = self.store.new_record(Kind.PARAMETER, whole_storage(local(p)), name="param", param_idx=i)
            rec.holder = p
        else:
            rec = self.store.new_record(Kind.PARAMETER, p, name="param", param_idx=i)
        rec.in_place = True
        rec.entry_gate = self.gate
        rec.entry_guarded = self.gate is not None and i not in self.unguarded
        self.records[i] = rec
        self._adopted.add(i)
        self.uses[i] = 0
        return rec

    def start_offload_loaded(self, i: int) -> bool:
        """Parameter ``i`` was just loaded (teraio.states.loading): start writing it to slot 0, before any
        graph takes it, so a model larger than memory can be loaded (Note: [A model is loaded one tensor
        at a time] in teraio.states.loading); :meth:`finish_offload_loaded` waits and frees it. False: it
        stays in memory (too small, or not a tensor the storage swap can free)."""
        if self.index_of.get(id(self.params[i])) != i or i in self.records:  # not offloadable (any more)
            return False
        rec = self._new_record(i)
        self.store.write(rec, param_key(i, 0))
        return True

    def finish_offload_loaded(self, i: int) -> None:
        """Wait for the write :meth:`start_offload_loaded` started; the parameter's memory goes."""
        rec = self.records[i]
        rec.saved_key = self.store.finish_write(rec)
        rec.staged_key = None
        if i in self.frozen:  # Note: [Frozen weights are read-only state] in teraio.states.frozen
            self.frozen.written_bytes += rec.nbytes
        self._version[i] = rec.version
        self.store.evict(rec)

    def compiled_outside_modules(self, args: Iterable[Any]) -> None:
        """A graph is being compiled while no module of the model runs: teraio.states.entry_gate."""
        if self.gate is not None and not self.gate.is_open:
            idxs = [i for i in (self.index_of.get(id(a)) for a in args) if i is not None]
            never_guard(self, idxs)

    # -- fetch and free ------------------------------------------------------------------------------
    def acquire(self, idxs: tuple[int, ...]) -> None:
        """Bring these parameters into memory (waiting for their reads) and hold them until released."""
        if self.before_use is not None:  # a pending step updates them first (teraio.states.step_pipeline)
            self.before_use(idxs)
        idxs = self.offloaded(idxs)
        for i in idxs:
            self.uses[i] += 1
        for i in idxs:
            rec = self.records[i]
            if rec.residency in (Residency.DISK, Residency.READING):
                self.store.load(rec)
                self._version[i] = rec.version
                if i in self.frozen:
                    self.frozen.read_bytes += rec.nbytes

    def release(self, idxs: tuple[int, ...]) -> None:
        """Drop one hold on each; a parameter no call holds any more leaves memory (written first when it
        has no copy on disk, or its value changed since)."""
        for i in self.offloaded(idxs):
            self.uses[i] -= 1
            if self.uses[i] == 0:
                self._free(i)

    def prefetch(self, idxs: tuple[int, ...]) -> None:
        for i in self.offloaded(idxs):
            self.store.prefetch(self.records[i])

    def _free(self, i: int) -> None:
        rec = self.records[i]
        if rec.residency is Residency.SAVED and self._version.get(i) != rec.version:
            self.store.mark_changed(rec)  # changed outside the step (load_state_dict, an edit)
        if rec.residency is Residency.MEMORY:
            self.write_now(i)
        if rec.residency is Residency.SAVED:
            self.store.evict(rec)

    def write_now(self, i: int) -> None:
        """Write parameter ``i``'s value to its other slot, wait, and make that slot its copy on disk."""
        rec = self.records[i]
        old = rec.saved_key
        slot = 1 - int(old.rsplit("/", 1)[1]) if old is not None else 0
        self.store.write(rec, param_key(i, slot))
        rec.saved_key = self.store.finish_write(rec)
        if i in self.frozen:  # Note: [Frozen weights are read-only state] in teraio.states.frozen
            self.frozen.written_bytes += rec.nbytes
        rec.staged_key = None
        self._version[i] = rec.version
        if old is not None and old != rec.saved_key:
            self.store.drop_key(old)

    def sync(self, idxs: list[int]) -> None:
        """Each of these offloaded parameters has its current value on disk (before a step, which goes
        back to the values on disk when it fails)."""
        for i in idxs:
            rec = self.records.get(i)
            if rec is None:
                continue
            if rec.residency is Residency.SAVED and self._version.get(i) != rec.version:
                self.store.mark_changed(rec)
            if rec.residency is Residency.MEMORY:
                self.write_now(i)

    def mark_written(self, i: int) -> None:
        """Parameter ``i``'s value, as it is now, is being written by the step."""
        self._version[i] = self.records[i].version

    @property
    def forward_calls(self) -> list[tuple[int, ...]]:
        """The offloaded parameters of each graph call of the last forward, in call order."""
        return self._order or self._last_order

    def forward_order(self, idxs: list[int]) -> list[int]:
        """``idxs`` in the order the last forward's graph calls (or FSDP2's gathers) took them, those it
        did not take last."""
        wanted = set(idxs)
        calls = self.forward_calls
        if self.gather_order is not None:
            calls = [*self.gather_order(), *calls]
        taken = dict.fromkeys(i for call in calls for i in call if i in wanted)
        return list(taken) + [i for i in reversed(idxs) if i not in taken]

    def updated_in_backward(self, i: int) -> None:
        """Parameter ``i`` was updated inside backward and its write started: drop the backward's hold."""
        if i in self._held:
            self._held.discard(i)
            self.release((i,))

    def release_held_for_update(self) -> None:
        """Drop the holds of parameters whose update never came (no gradient), or whose step failed."""
        held, self._held = tuple(self._held), set()
        self.release(held)

    def saved(self, i: int) -> None:
        """The streamed step committed parameter ``i``'s bytes: memory and disk agree from now."""
        self._version[i] = self.records[i].version
        if i in self._leaving:  # Note: [A parameter eager code uses stays resident]
            self._leaving.discard(i)
            self.uses[i] -= 1
            self._stay_resident(i)

    # -- graph calls ---------------------------------------------------------------------------------
    def around_forward(self, idxs: tuple[int, ...], first_of_step: bool) -> None:
        """Before a graph call's forward: read ahead the next call's parameters, fetch this call's."""
        if first_of_step:
            self._last_order, self._order = self._order or self._last_order, []
            self._bwd_order = []
        pos = len(self._order)
        self._order.append(idxs)
        self._bwd_order.append(idxs)
        if pos + 1 < len(self._last_order):
            self.prefetch(self._last_order[pos + 1])
        self.acquire(idxs)

    def hook_backward(self, node: Any, idxs: tuple[int, ...]) -> None:
        """Fetch this call's parameters before its backward node runs and free them after it."""
        pos = len(self._order) - 1
        order = self._bwd_order
        trained = tuple(i for i in idxs if i not in self.frozen)
        frozen = {i: self.params[i] for i in idxs if i in self.frozen}
        if frozen:  # Note: [A backward reads the frozen weights it saved] in teraio.states.frozen
            saved = saved_by_backward(node, frozen)
            needed = set(frozen) if saved is None else saved
            self.frozen.read_in_backward |= needed
            # Forward-only frozen weights leave with the forward's hold (released by the caller).
            idxs = tuple(i for i in idxs if i not in frozen or i in needed)
            if 0 <= pos < len(order):
                order[pos] = idxs

        def before(grad_outputs: Any) -> None:
            if 0 < pos <= len(order) - 1:
                self.prefetch(order[pos - 1])  # the call whose backward comes next
            self.acquire(idxs)
            if self.on_backward_start is not None and trained:
                self.on_backward_start(trained)

        def after(grad_inputs: Any, grad_outputs: Any) -> None:
            if not self.hold_for_update:
                self.release(idxs)
                return
            # Frozen weights get no update to wait for (Note: [Frozen weights are read-only state] in
            # teraio.states.frozen): released now.
            self.release(tuple(i for i in idxs if i in self.frozen))
            for i in trained:  # one hold per parameter until its update (a repeated input holds once)
                if i in self._held:
                    self.release((i,))
                else:
                    self._held.add(i)

        node.register_prehook(before)
        node.register_hook(after)

    # -- everything at once --------------------------------------------------------------------------
    @contextmanager
    def materialized(self) -> Iterator[None]:
        """Every offloaded parameter in memory inside the block (changes made there are written after)."""
        idxs = tuple(self.records)
        self.acquire(idxs)
        try:
            yield
        finally:
            self.release(idxs)

    def attach_module(self, model: torch.nn.Module) -> None:
        """``model.state_dict()`` returns copies of offloaded parameters; ``model.load_state_dict()``
        fetches each module's own parameters before it copies into them (Note: [Reading an offloaded
        parameter])."""
        in_model = {id(p) for p in model.parameters()}
        missing = [i for i in self.index_of.values() if id(self.params[i]) not in in_model]
        if missing:
            raise StatesError(
                f"offload_parameters: {len(missing)} of the optimizer's parameters are not the model's "
                "(pass the model the optimizer trains as model=)"
            )
        self.gate = EntryGate(self.store, self.records.values)
        self.gate.attach(model)
        self._hooks += model_hooks(self, model)

    def offloaded(self, idxs: tuple[int, ...]) -> tuple[int, ...]:
        """Those of ``idxs`` that are offloaded (have a record)."""
        return tuple(i for i in idxs if i in self.records)

    # -- eager code ----------------------------------------------------------------------------------
    def eager_use(self, module: torch.nn.Module, own: tuple[int, ...]) -> None:
        """A module's forward pre-hook: Note: [A parameter eager code uses stays resident]."""
        if torch.compiler.is_compiling():
            return  # traced into a graph: the graph call fetches its parameters
        for i in own:
            self.index_of.pop(id(self.params[i]), None)  # no graph adopts it from now on
            self._eager.add(i)
            if i in self.records and i not in self._leaving:
                log.info(
                    "a parameter of %s (%s, %s bytes) is used by eager code: it stays in memory from now on",
                    type(module).__name__,
                    tuple(self.params[i].shape),
                    self.records[i].nbytes,
                )
                self._stay_resident(i)

    def _stay_resident(self, i: int) -> None:
        """Parameter ``i`` back in memory for good: its disk copies dropped, its record forgotten (the
        streamed step then treats it as resident); held until its commit when a written update awaits it."""
        rec = self.records[i]
        if rec.staged_key is not None:  # an update inside backward, committed by opt.step()
            self.acquire((i,))
            self._leaving.add(i)
            return
        self.store.load(rec)
        self.store.drop_key(rec.saved_key)
        rec.saved_key = None
        self.store.forget(rec)
        del self.records[i]
        self.uses.pop(i, None)
        self._version.pop(i, None)

    def movable(self) -> frozenset[int]:
        """The parameters that may be on disk: those a compiled graph took (or takes again at its next
        call, once kept no more), not used by eager code."""
        return frozenset((set(self.records) | self.kept | self._adopted) - self._eager)

    def keep(self, idxs: frozenset[int]) -> None:
        """Note: [The whole-step budget keeps some states in memory] in teraio.states.residency: the
        parameters ``idxs`` stay in memory from now on (their disk copies dropped); the others the plan
        kept before may be offloaded again (adopted at their next graph call)."""
        for i in sorted(idxs - self.kept):
            self.index_of.pop(id(self.params[i]), None)
            if i in self.records and i not in self._leaving:
                self._stay_resident(i)
        for i in sorted(self.kept - idxs):
            if i in self._offloadable and i not in self._eager:
                self.index_of[id(self.params[i])] = i
        self.kept = frozenset(idxs)

    def close(self) -> None:
        """Every parameter back in memory for good, hooks removed, disk copies dropped."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self.gate is not None:
            self.gate.close()
        for rec in self.records.values():
            self.store.load(rec)
            self.store.drop_key(rec.saved_key)
            self.store.drop_key(rec.staged_key)
            rec.saved_key = rec.staged_key = None
            self.store.forget(rec)
        self.records.clear()
        self.index_of.clear()

    def frozen_offloaded_nbytes(self) -> int:
        """Bytes of the frozen weights that move (adopted by a graph, not kept by the plan)."""
        return sum(r.nbytes for i, r in self.records.items() if i in self.frozen)

    def offloaded_nbytes(self) -> int:
        """Bytes of the parameters that are not in memory now."""
        return sum(r.nbytes for r in self.records.values() if r.residency is Residency.DISK)
