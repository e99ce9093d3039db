"""Gradients on disk between the backward that accumulates them and the optimizer step that reads them.

After autograd accumulates a parameter's gradient (``register_post_accumulate_grad_hook``) its bytes are
written and, once written, its memory is freed: ``param.grad`` keeps its object over an empty storage
(Note: [Offloaded tensors keep their object, not their storage] in teraio.states.store). When a later
micro-batch's backward accumulates into it again, a hook that runs before AccumulateGrad (a tensor hook on
the leaf, ``param.register_hook``) reads it back into the same object first, so AccumulateGrad adds into
the same values as without teraio. ``zero_grad(set_to_none=True)`` drops the disk copies: no I/O.

Note: [Gradients stay readable unless asked]
    An offloaded gradient keeps its object over an empty storage. Reads of it between ``backward()`` and
    ``step()`` are guarded (Note: [What a read of an offloaded tensor does] in teraio.states.guarded):
    gradient clipping and a GradScaler are answered without I/O (Note: [Norms are taken before the
    write] in teraio.states.grad_norms), any other read costs a read of that gradient. Gradients still
    move only when the user asks (``offload_gradients=True``): a loop that reads its gradients in other
    ways pays a read per read, and by default only the optimizer's states move, which nothing outside
    the step reads.

Note: [Gradient writes are bounded during backward]
    Writes run in the background while backward goes on; each hook first frees the gradients whose
    writes finished, then, while more than ``window_bytes`` are still being written, waits for the
    oldest. So the gradients resident during backward stay near the window plus those of the graph whose
    backward just ran: a compiled graph's backward returns all of its gradients together (AOTAutograd),
    before the first hook, so with the whole model in one graph that is every gradient for a moment. At the end of backward (a callback queued on autograd's
    engine) every write is waited for and every gradient freed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from teraio.states.grad_norms import GradNorms, watch_in_backward
from teraio.states.shards import local
from teraio.states.store import Kind, Record, Residency, TensorStore


def grad_key(param_idx: int) -> str:
    """The engine key of a parameter's gradient."""
    return f"grad/{param_idx}"


class GradOffload:
    """The gradients of ``params`` (in the optimizer's order), offloaded through ``store``."""

    def __init__(
        self, store: TensorStore, params: list[torch.nn.Parameter], window_bytes: int, offload: bool = True
    ) -> None:
        self.store = store
        #: False: gradients stay where autograd puts them (Note: [Gradients stay readable unless asked]);
        #: only the order they arrive in is recorded, for the step's order.
        self.offload = offload
        #: Note: [The optimizer step inside backward] in teraio.states.optimizer_stream: called with a
        #: parameter's index once its gradient is complete, instead of offloading it.
        self.on_complete: Callable[[int], None] | None = None
        self.params = params
        self.window_bytes = window_bytes
        self.records: dict[int, Record] = {}
        #: Parameter indices in the order their first gradient arrived (the backward order).
        self.arrival_order: list[int] = []
        self._seen: set[int] = set()
        self._writing: deque[int] = deque()
        self._writing_bytes = 0
        self._callback_queued = False
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self.enabled = True
        #: Note: [Norms are taken before the write] in teraio.states.grad_norms.
        self.norms = GradNorms()
        if offload:
            store.grad_norms = self.norms
        #: Note: [Clipping when the update runs in backward] in teraio.states.grad_norms: parameters whose
        #: gradient an update inside backward consumed since the last ``zero_grad``.
        self.consumed: set[int] = set()
        for idx, p in enumerate(params):
            self._handles.append(p.register_hook(self._before_accumulate_hook(idx)))
            self._handles.append(p.register_post_accumulate_grad_hook(self._after_accumulate_hook(idx)))

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # -- the record of a parameter's current gradient ------------------------------------------------
    def current(self, idx: int) -> Record | None:
        """The record of ``params[idx].grad``, or None when the parameter's gradient is not ours (never
        offloaded, set to None, or replaced by the user: then the stale disk copy is dropped, no I/O)."""
        rec = self.records.get(idx)
        if rec is None:
            return None
        grad = self.params[idx].grad
        # Note: [A sharded tensor's bytes are its local shard] in teraio.states.shards
        if grad is not None and local(grad) is rec.tensor:
            return rec
        self._forget(idx)
        return None

    def _forget(self, idx: int) -> None:
        rec = self.records.pop(idx, None)
        if rec is None:
            return
        if rec.residency is Residency.WRITING:
            self._writing.remove(idx)
            self._writing_bytes -= rec.nbytes
        if rec.residency is Residency.READING:
            self.store.drain_read(rec)
        self.store.drop_key(rec.staged_key)
        self.store.drop_key(rec.saved_key)
        self.store.forget(rec)

    # -- hooks ---------------------------------------------------------------------------------------
    def _before_accumulate_hook(self, idx: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if self.enabled:
                self._before_accumulate(idx)

        return hook

    def _after_accumulate_hook(self, idx: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if self.enabled:
                self._after_accumulate(idx)

        return hook

    def _before_accumulate(self, idx: int) -> None:
        """A new gradient for ``params[idx]`` arrives: bring the accumulated one back first."""
        self.consumed.discard(idx)
        rec = self.current(idx)
        if rec is None:
            return
        if rec.residency is Residency.WRITING:
            self._finish_one(idx, evict=False)
        self.store.load(rec)
        self.store.mark_changed(rec)  # AccumulateGrad adds into it next
        self._prefetch_after(idx)

    def _prefetch_after(self, idx: int) -> None:
        """Start reading the gradient backward accumulates into next (one ahead, in arrival order)."""
        try:
            pos = self.arrival_order.index(idx)
        except ValueError:
            return
        for nxt in self.arrival_order[pos + 1 :]:
            rec = self.current(nxt)
            if rec is not None and rec.residency is Residency.DISK:
                self.store.prefetch(rec)
                return
            if rec is not None and rec.residency is Residency.READING:
                return

    def _after_accumulate(self, idx: int) -> None:
        """``params[idx].grad`` holds its accumulated value: write it, free what finished writing."""
        if idx not in self._seen:
            self._seen.add(idx)
            self.arrival_order.append(idx)
        grad = self.params[idx].grad
        if grad is not None and self.on_complete is not None:
            watch_in_backward(self)
            self.on_complete(idx)
            self.consumed.add(idx)
            return
        if grad is None or not self.offload:
            return
        rec = self.records.get(idx)
        # Note: [A sharded tensor's bytes are its local shard] in teraio.states.shards
        if rec is None or rec.tensor is not local(grad):
            if rec is not None:
                self._forget(idx)
            rec = self.records[idx] = self.store.new_record(Kind.GRADIENT, grad, param_idx=idx)
        self.store.mark_changed(rec)
        self.norms.fill(rec)  # Note: [Norms are taken before the write] in teraio.states.grad_norms
        self.store.write(rec, grad_key(idx))
        self._writing.append(idx)
        self._writing_bytes += rec.nbytes
        self._settle(block=False)
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self.settle()

    # -- writes --------------------------------------------------------------------------------------
    def _finish_one(self, idx: int, *, evict: bool) -> None:
        rec = self.records[idx]
        self._writing.remove(idx)
        self._writing_bytes -= rec.nbytes
        rec.saved_key = self.store.finish_write(rec)
        rec.staged_key = None
        if evict:
            self.store.evict(rec)

    def _settle(self, *, block: bool) -> None:
        """Note: [Gradient writes are bounded during backward]."""
        while self._writing:
            idx = self._writing[0]
            rec = self.records[idx]
            if not (block or self._writing_bytes > self.window_bytes or self.store.write_done(rec)):
                break
            self._finish_one(idx, evict=True)

    def settle(self) -> None:
        """Wait for every gradient write and free those gradients."""
        self._settle(block=True)

    def zero_grad(self, set_to_none: bool) -> None:
        """Before the stock ``zero_grad``: drop every disk copy (no I/O); with ``set_to_none=False`` give
        the offloaded gradients zeroed memory, as the stock call expects tensors it can zero."""
        self.consumed.clear()
        for idx in list(self.records):
            rec = self.current(idx)
            if rec is None:
                continue
            if set_to_none:
                self._forget(idx)
            else:
                if rec.residency is Residency.WRITING:
                    self._finish_one(idx, evict=False)
                self.store.make_resident_zeros(rec)
                self.store.mark_changed(rec)
                self.store.drop_key(rec.saved_key)
                rec.saved_key = None
