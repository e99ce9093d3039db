"""The optimizer step made inside backward: each parameter updated as soon as its gradient is complete.

With ``optimizer_in_backward=True`` no gradient is written to disk or kept until ``opt.step()``: the
streamed step (``teraio.states.optimizer_stream.StreamedStep``) updates each parameter from the hook after
its AccumulateGrad, writes its states with a bounded window of writes in flight, and ``opt.step()`` then
only commits (Note: [The optimizer step inside backward] in teraio.states.optimizer_stream). This module
holds what the updates of one backward did so far, so the commit, or a rollback to the last committed
step, covers exactly them (Note: [A step commits all of its states or none] in
teraio.states.optimizer_stream).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from teraio.states.errors import StatesError
from teraio.states.step_chunks import StepLog
from teraio.states.store import Record

if TYPE_CHECKING:
    from teraio.states.optimizer_stream import StreamedStep


@dataclass
class _Pending:
    """What the updates of one backward did so far."""

    updated: set[int] = field(default_factory=set)
    touched: list[Record] = field(default_factory=list)
    loads: list[list[Record]] = field(default_factory=list)
    snapshots: list[dict[int, dict[str, Any]]] = field(default_factory=list)
    writing: list[Record] = field(default_factory=list)
    writing_bytes: int = 0
    log: StepLog = field(default_factory=StepLog)


class InBackwardUpdates:
    """The updates one backward makes through ``step``, until ``opt.step()`` commits them."""

    def __init__(self, step: StreamedStep) -> None:
        self.step = step
        self._pending: _Pending | None = None

    @property
    def active(self) -> bool:
        """Updates made in backward await their commit."""
        return self._pending is not None

    def update(
        self, idx: int, raw_step: Callable[[], Any], prefetch_next: int | None, window_bytes: int
    ) -> None:
        """Update ``params[idx]`` now (its gradient is complete), free its gradient, write its states;
        read ahead the states of ``prefetch_next``; keep at most ``window_bytes`` of writes in flight."""
        step = self.step
        store = step.store
        step.check_usable()
        ib = self._pending
        if ib is None:
            ib = self._pending = _Pending()
            store.reset_window_peak()
        if idx in ib.updated:
            exc = StatesError(
                "optimizer_in_backward updates each parameter once its gradient is complete: call "
                "opt.step() after every backward (no gradient accumulation), or set optimizer_in_backward=False"
            )
            self._fail(exc)
            raise exc
        try:
            recs = step.records_of(idx)
            for r in recs:
                ib.touched.append(r)
                store.load(r)
            prec = step.param_record(idx)
            if prec is not None:  # held since its backward (ParamResidency.hook_backward): no read
                ib.touched.append(prec)
                store.load(prec)
            ib.loads.append(recs)
            ib.snapshots.append(step.snapshot([idx]))
            step.update_narrowed([idx], raw_step, ib.log)
            ib.updated.add(idx)
            ib.log.chunks.append([idx])
            step.params[idx].grad = None  # used: freed now
            for rec in step.reconcile(idx):
                if rec not in ib.touched:
                    ib.touched.append(rec)
                step.write_staged(idx, rec)
                ib.writing.append(rec)
                ib.writing_bytes += rec.nbytes
            if prec is not None:
                store.mark_changed(prec)
                step.write_staged(idx, prec)
                ib.writing.append(prec)
                ib.writing_bytes += prec.nbytes
                assert step.residency is not None
                step.residency.updated_in_backward(idx)
            ib.log.chunk_bytes.append(sum(r.nbytes for r in step.records_of(idx)))
            if prefetch_next is not None:
                for r in step.records_of(prefetch_next):
                    store.prefetch(r)
            while ib.writing and (ib.writing_bytes > window_bytes or store.write_done(ib.writing[0])):
                rec = ib.writing.pop(0)
                ib.writing_bytes -= rec.nbytes
                step.finish_writes([rec])
        except BaseException as exc:
            self._fail(exc)
            raise

    def commit(self) -> bool:
        """``opt.step()`` after a backward that updated parameters: wait for the writes and commit (False:
        no update ran since the last commit)."""
        step = self.step
        ib = self._pending
        if ib is None:
            return False
        try:
            step.finish_writes(ib.writing)
        except BaseException as exc:
            self._fail(exc)
            raise
        self._pending = None
        step.last = ib.log
        step.commit(ib.touched)
        if step.residency is not None:
            step.residency.release_held_for_update()  # parameters that got no gradient
        return True

    def _fail(self, exc: BaseException) -> None:
        """Back to the last committed step, whatever this backward updated so far."""
        ib, self._pending = self._pending, None
        if ib is not None:
            self.step.roll_back(ib.touched, ib.loads, ib.snapshots, ib.log, exc)
        if self.step.residency is not None:
            self.step.residency.release_held_for_update()
