"""The optimizer step overlapped with the next forward: ``opt.step()`` updates what is in memory and
returns; each offloaded parameter's chunk is read, updated and written just before the next forward
first computes with it, behind the forward's compute.

Note: [The step of offloaded parameters runs in the next forward]
    A streamed step after backward runs at the disk's pace while nothing computes: the step time is the
    sum of compute and I/O. Here ``opt.step()`` updates, at once, the chunks of the parameters that stay
    in memory (norms, biases, what the plan keeps: their states are small or kept, and code may read them
    directly), then returns with the offloaded parameters' chunks pending, cut in the order the forward
    took them (``ParamResidency.forward_order``). Before a graph call (or an eager module, or anything
    else) uses a pending parameter, every chunk up to the one holding it is read, updated with the
    stock step (the gradient and the hyperparameters of ``opt.step()``'s time: an LR scheduler stepped
    since does not reach this update) and its writes started; the next chunk's reads start at once. So
    the reads of chunk k+1 and the writes of chunk k run while the forward computes with chunk k, and a
    parameter is read once for its update and its forward (the forward takes it from the update: no
    byte moves twice). Every promise of the serial step holds: the step commits all of its states or
    none (Note: [A step commits all of its states or none] in teraio.states.optimizer_stream); a failure
    raises in the forward that needed the chunk, after the roll back; and whatever must see the step's
    result waits for all of it first (:meth:`OverlappedStep.finish`): the next ``opt.step()``, a read of
    an offloaded parameter, gradient or state outside the forward (served reads go through the guard),
    ``zero_grad(set_to_none=False)``, ``state_dict()`` and ``load_state_dict()`` of the model or the
    optimizer, a checkpoint, a whole-step plan, and ``close()``; a module that runs eagerly updates its
    own parameters first. (The next backward needs nothing more: it only meets parameters its forward
    took, which waited for their update.)

    Why this overlap, and why it suits a GPU too: the step's I/O is most of the step's bytes (states read
    and written, gradients read, parameters read and written), and the forward is the phase with the
    least I/O of its own (its parameter reads, which this overlap shares with the update); clipping over
    all gradients stays exact (the norm is complete before ``opt.step()``); and on a GPU the update's
    kernels queue on the stream between the forward's blocks while the next chunk's reads land, as the
    forward's own prefetches do. An update inside backward (``optimizer_in_backward``) overlaps
    backward instead, but loses clipping and accumulation.

    Gradients: the step takes the offloaded gradient records at ``opt.step()`` (a ``zero_grad()`` after it
    does not drop their bytes) and hands each back after its update when ``param.grad`` still holds it
    (a loop that accumulates across steps), else drops it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import Enum
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from teraio.states.optimizer_stream import StepLog, update_chunk
from teraio.states.store import Kind, Record, Residency

if TYPE_CHECKING:
    from teraio.states.offload import StateOffload


class StepState(Enum):
    """Whether a step's offloaded chunks still wait for their forward."""

    IDLE = "idle"
    PENDING = "pending"


def _copied(value: Any) -> Any:
    """A hyperparameter as ``opt.step()`` saw it (a tensor learning rate copied: a scheduler may change
    it in place)."""
    return value.detach().clone() if isinstance(value, torch.Tensor) else copy.copy(value)


class OverlappedStep:
    """Note: [The step of offloaded parameters runs in the next forward] for one ``StateOffload``."""

    def __init__(self, states: StateOffload) -> None:
        self.states = states
        self.stream = states.stream
        self.store = states.store
        self.state = StepState.IDLE
        self._busy = False
        self._reset()
        self.hooks: list[Any] = []
        #: Steps whose update was left pending by ``opt.step()`` (``stats()["whole_step"]``).
        self.overlapped_steps = 0

    def detach(self) -> None:
        """Remove the hooks (``StateOffload.close``, after :meth:`finish`)."""
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
        residency = self.states.residency
        if residency is not None:
            residency.before_use = None
        self.store.before_guarded_use = None

    def _reset(self) -> None:
        self.chunks: list[list[int]] = []
        self.loads: list[list[Record]] = []
        self.written: list[list[Record]] = []
        self.touched: list[Record] = []
        self.snapshots: list[dict[int, dict[str, Any]]] = []
        self.chunk_of: dict[int, int] = {}
        self.next_pos = 0
        self.log = StepLog()
        #: The gradient each parameter of the step had at ``opt.step()``, and its record when offloaded.
        self.grad_tensors: dict[int, torch.Tensor] = {}
        self.grad_records: dict[int, Record] = {}
        self.hyper: list[dict[str, Any]] = []
        self.raw_step: Callable[[], Any] | None = None
        #: Parameters the forward took since ``opt.step()``: an updated parameter no call took yet stays
        #: in memory for the call that will (chunks follow the forward's order, and a chunk may hold the
        #: start of the next call's parameters), so no byte is read twice.
        self.used: set[int] = set()

    @property
    def pending(self) -> bool:
        return self.state is StepState.PENDING

    # -- opt.step() ----------------------------------------------------------------------------------
    def start(self, raw_step: Callable[[], Any]) -> None:
        """``opt.step()``: update the chunks in memory now, leave the offloaded ones pending."""
        states, stream = self.states, self.stream
        residency = states.residency
        assert residency is not None and not self.pending
        stream.check_usable()
        order = states.step_order()
        live = [i for i in order if stream.params[i].grad is not None]
        residency.sync(live)
        offloaded = [i for i in residency.forward_order(live) if i in residency.records]
        later = set(offloaded)
        now = [i for i in live if i not in later]
        grad_nbytes = {i: (0 if (g := states.grads.current(i)) is None else g.nbytes) for i in live}
        chunks_now = stream.cut(now, grad_nbytes.__getitem__)
        chunks = chunks_now + stream.cut(offloaded, grad_nbytes.__getitem__)
        n_now = len(chunks_now)
        self._reset()
        self.chunks = [c.param_idxs for c in chunks]
        self.log = stream.last = StepLog(self.chunks, [c.nbytes for c in chunks])
        self.chunk_of = {i: pos for pos, c in enumerate(self.chunks) for i in c}
        self.raw_step = raw_step
        self.hyper = [{k: _copied(v) for k, v in g.items() if k != "params"} for g in stream.opt.param_groups]
        for i in live:
            self.grad_tensors[i] = stream.params[i].grad
            rec = states.grads.current(i)
            if rec is not None:  # ours now: a zero_grad() before the update must not drop its bytes
                states.grads.records.pop(i)
                self.grad_records[i] = rec
        for c in self.chunks:
            recs = [r for i in c for r in stream.records_of(i)]
            recs += [self.grad_records[i] for i in c if i in self.grad_records]
            recs += [r for i in c if (r := stream.param_record(i)) is not None]
            self.loads.append(recs)
            self.written.append([])
        self.store.reset_window_peak()
        self.state = StepState.PENDING
        self.overlapped_steps += 1
        if not self.chunks:
            self._commit()
            return
        for r in self.loads[0]:
            self.store.prefetch(r)
        self._run_until(n_now - 1, keep=())

    # -- the forward -----------------------------------------------------------------------------------
    def ensure(self, idxs: tuple[int, ...]) -> None:
        """Parameters ``idxs`` (optimizer indices) are about to be used: update every chunk up to theirs."""
        if not self.pending or self._busy:
            return
        target = max((self.chunk_of.get(i, -1) for i in idxs), default=-1)
        self.used.update(idxs)
        if target >= self.next_pos:
            self._run_until(target, keep=idxs)

    def finish(self) -> bool:
        """Everything that must see the step's result: the rest of it now (True: some was pending)."""
        if not self.pending or self._busy:
            return False
        self.used.update(self.chunk_of)  # nothing waits for a forward's use any more
        self._run_until(len(self.chunks) - 1, keep=())
        return True

    def _run_until(self, target: int, keep: tuple[int, ...]) -> None:
        self._busy = True
        try:
            while self.next_pos <= target:
                self._advance(keep)
            if self.next_pos == len(self.chunks):
                self._finish_chunk_writes(len(self.chunks) - 1, keep)
                self._commit()
        except BaseException as exc:
            self._fail(exc)
            raise
        finally:
            self._busy = False

    def _advance(self, keep: tuple[int, ...]) -> None:
        """Note: [Three chunks in memory] in teraio.states.optimizer_stream, one chunk at a time."""
        pos, stream = self.next_pos, self.stream
        idxs = self.chunks[pos]
        update_chunk(
            stream,
            pos,
            idxs,
            self.loads,
            self.touched,
            self.snapshots,
            self.written,
            partial(self._update, idxs),
        )
        residency = self.states.residency
        assert residency is not None
        for i in idxs:
            if stream.param_record(i) is not None:  # its value of this step is in its staged slot
                residency.mark_written(i)
            self._done_with_gradient(i)
        self.next_pos += 1
        if pos >= 1:
            self._finish_chunk_writes(pos - 1, keep)

    def _update(self, idxs: list[int]) -> None:
        """The stock step on ``idxs`` as ``opt.step()`` called it."""
        assert self.raw_step is not None
        with self._as_at_step(idxs):
            self.stream.update_narrowed(idxs, self.raw_step, self.log)

    @contextmanager
    def _as_at_step(self, idxs: list[int]) -> Iterator[None]:
        """The stock step sees what ``opt.step()`` saw: each parameter's gradient of then (a
        ``zero_grad()`` since set it to None) and the param groups' hyperparameters of then."""
        params = self.stream.params
        now_grads = {i: params[i].grad for i in idxs}
        groups = self.stream.opt.param_groups
        now_hyper = [{k: g[k] for k in h if k in g} for g, h in zip(groups, self.hyper)]
        try:
            for i in idxs:
                if params[i].grad is not self.grad_tensors[i]:
                    params[i].grad = self.grad_tensors[i]
            for g, h in zip(groups, self.hyper):
                g.update(h)
            yield
        finally:
            for g, h in zip(groups, now_hyper):
                g.update(h)
            for i in idxs:
                if params[i].grad is not now_grads[i]:
                    params[i].grad = now_grads[i]

    def _done_with_gradient(self, i: int) -> None:
        """The update used parameter ``i``'s gradient: back to the gradients when ``param.grad`` still
        holds it, else its bytes go."""
        rec = self.grad_records.pop(i, None)
        self.grad_tensors.pop(i, None)
        if rec is None:
            return
        grads = self.states.grads
        if rec.residency is Residency.SAVED:
            self.store.evict(rec)  # unchanged by the step: its disk copy is still valid
        if self.stream.params[i].grad is rec.tensor and i not in grads.records:
            grads.records[i] = rec
            return
        if rec.residency is Residency.READING:
            self.store.drain_read(rec)
        self.store.drop_key(rec.saved_key)
        self.store.forget(rec)

    def _finish_chunk_writes(self, pos: int, keep: tuple[int, ...]) -> None:
        """Wait for chunk ``pos``'s writes; free their memory but for the parameters a graph holds or is
        about to take (``keep``)."""
        residency = self.states.residency
        assert residency is not None
        recs = self.written[pos]
        for rec in recs:
            if rec.residency is Residency.WRITING:
                self.store.finish_write(rec)
        for rec in recs:
            if rec.kind is Kind.PARAMETER:
                i = rec.param_idx
                if i in keep or i not in self.used or residency.uses.get(i, 0) > 0:
                    continue  # the graph call's release frees it (its copy on disk is the one written)
            if rec.residency is Residency.SAVED:
                self.store.evict(rec)

    def _commit(self) -> None:
        self.stream.commit(self.touched)
        self.state = StepState.IDLE
        self._reset()

    def _fail(self, exc: BaseException) -> None:
        """Note: [A step commits all of its states or none]: back to the last committed step; the
        gradients not used yet go back to the gradients."""
        for i in list(self.grad_records):
            rec = self.grad_records.pop(i)
            if rec.residency is Residency.READING:
                self.store.drain_read(rec)
            elif rec.residency is Residency.SAVED:
                self.store.evict(rec)
            if self.stream.params[i].grad is rec.tensor and i not in self.states.grads.records:
                self.states.grads.records[i] = rec
            else:
                self.store.drop_key(rec.saved_key)
                self.store.forget(rec)
        loads = [[r for r in recs if r.kind is not Kind.GRADIENT] for recs in self.loads]
        self.stream.roll_back(self.touched, loads, self.snapshots, self.log, exc)
        self.state = StepState.IDLE
        self._reset()


def attach_module_hooks(overlapped: OverlappedStep, model: torch.nn.Module) -> list[Any]:
    """A module that runs eagerly updates its own pending parameters first (before the hooks that bring
    its parameters into memory for eager code)."""
    by_id = overlapped.stream.by_id
    hooks = []
    for module in model.modules():
        own = tuple(by_id[id(p)] for p in module.parameters(recurse=False) if id(p) in by_id)
        if not own:
            continue

        def pre_hook(mod: torch.nn.Module, args: Any, own: tuple[int, ...] = own) -> None:
            if not torch.compiler.is_compiling():
                overlapped.ensure(own)

        hooks.append(module.register_forward_pre_hook(pre_hook, prepend=True))
    return hooks


def attach_overlap(states: StateOffload) -> OverlappedStep | None:
    """The overlapped step for ``states`` and its hooks, when its parameters and gradients are offloaded
    (None: the step runs whole in ``opt.step()``)."""
    residency, model = states.residency, states.model
    if residency is None or model is None or not states.grads.offload or states.in_backward:
        return None
    overlapped = OverlappedStep(states)
    residency.before_use = overlapped.ensure
    states.store.before_guarded_use = overlapped.finish
    opt = states.optimizer

    def finish(*args: Any, **kwargs: Any) -> None:  # a pre-hook that returns a value replaces the input
        overlapped.finish()

    overlapped.hooks = attach_module_hooks(overlapped, model) + [
        model.register_state_dict_pre_hook(finish),
        model.register_load_state_dict_pre_hook(finish),
        opt.register_state_dict_pre_hook(finish),
        opt.register_load_state_dict_pre_hook(finish),
    ]
    return overlapped
