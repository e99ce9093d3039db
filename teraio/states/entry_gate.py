"""Parameters on disk are guarded while no module of the model runs, and plain while one does.

Note: [Parameters are guarded while no module of the model runs]
    A parameter on disk keeps its object over an empty storage, so user code that reads it between its
    uses (an EMA's ``ema.lerp_(p, 0.01)`` after ``opt.step()``, a logged norm, an L2 penalty) would read
    a null pointer and kill the process. Gradients and optimizer states are guarded while on disk by
    swapping their class (Note: [What a read of an offloaded tensor does] in teraio.states.guarded). A
    parameter cannot be guarded where Dynamo sees it: Dynamo's guards check each graph input's exact
    type when a compiled frame is entered, and a guarded parameter would recompile the frame (or fail
    to trace).

    Every compiled frame that takes a module's parameters is entered from ``Module._call_impl``, whose
    frame Dynamo never converts: the frame of ``torch.compile(model)`` (Dynamo compiles the model's
    ``forward``, called by its ``_call_impl``), of ``block.compile()`` and of ``backend.compile``, and a
    submodule's ``forward`` that Dynamo compiles on its own after a graph break. ``_call_impl`` runs the
    module's forward hooks before it enters ``forward``. So every module of the model gets a forward
    pre-hook and an always-called forward hook, whose code Dynamo skips as a frame of its own
    (``torch._dynamo.eval_frame.set_code_exec_strategy``, with the calls they make) and inlines as a no-op where it traces a module's call
    (``torch.compiler.is_compiling()``). The outermost module call that runs eagerly opens the gate:
    every guarded parameter gets its own class back, and stays plain while that call runs (graphs,
    the frames Dynamo resumes after a graph break, nested submodule frames). When it returns (or
    raises) the gate closes and every parameter on disk is guarded again; the backward and the
    optimizer step run with the gate closed, guarding each parameter as it is evicted.

    A graph compiled while the gate is closed was not entered through a module of the model (a function
    compiled with ``torch.compile(fn)`` that calls the model): Dynamo would check its parameters'
    types with nobody to release them first. Its parameters are never guarded (one log line says so,
    and that ``torch.compile(model)`` or ``backend.compile(model)`` guards them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch._dynamo.eval_frame import set_code_exec_strategy
from torch._dynamo.types import FrameAction, FrameExecStrategy

from teraio.states import guarded
from teraio.states.store import Record, Residency, TensorStore

log = logging.getLogger("teraio")


class EntryGate:
    """Note: [Parameters are guarded while no module of the model runs].

    Args:
        store: the store whose evictions guard a record (``Record.guards_reads`` asks :attr:`is_open`).
        records: the parameter records, current at each call.
    """

    def __init__(self, store: TensorStore, records: Callable[[], Iterable[Record]]) -> None:
        self.store = store
        self._records = records
        #: Module calls running eagerly, nested.
        self.depth = 0
        self._hooks: list[Any] = []

    @property
    def is_open(self) -> bool:
        """A module of the model is running: parameters on disk stay plain (unguarded)."""
        return self.depth > 0

    def enter(self) -> None:
        """A module call starts running eagerly: the outermost one gives every parameter its class back."""
        if self.depth == 0:
            for rec in self._records():
                guarded.release_record(rec)
        self.depth += 1

    def exit(self) -> None:
        """A module call returned (or raised): the outermost one guards every parameter on disk again."""
        self.depth = max(self.depth - 1, 0)
        if self.depth == 0:
            self.guard_all()

    def guard_all(self) -> None:
        """Guard every parameter whose bytes are only on disk (and guards reads), a read of them in flight
        or not (a step overlapped with the next forward reads its next chunk ahead between steps)."""
        for rec in self._records():
            if (
                rec.residency in (Residency.DISK, Residency.READING)
                and rec.guards_reads
                and guarded.guard_of(rec.tensor) is None
            ):
                guarded.protect(rec, self.store)

    def settle(self) -> None:
        """No module runs now (the optimizer step starts): a gate a failed call left open closes."""
        if self.depth:
            self.depth = 0
            self.guard_all()

    # -- the hooks -----------------------------------------------------------------------------------
    def attach(self, model: torch.nn.Module) -> None:
        """Give every module of ``model`` the gate's forward pre-hook and forward hook (not an always-called
        one: Dynamo guards on each module's own hook id in ``_forward_hooks_always_called``, so the blocks
        sharing one graph would recompile per block)."""
        pre_hook, post_hook = _hooks(self)
        for module in model.modules():
            self._hooks.append(module.register_forward_pre_hook(pre_hook, prepend=True))
            self._hooks.append(module.register_forward_hook(post_hook))

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.depth = 0


def never_guard(residency: Any, idxs: list[int]) -> None:
    """A graph taking the parameters ``idxs`` (by index) is being compiled with the gate closed, not
    from a module's call (Note: [Parameters are guarded while no module of the model runs]): they are
    never guarded from now on, and one log line says so."""
    fresh = [i for i in idxs if i not in residency.unguarded]
    for i in fresh:
        residency.unguarded.add(i)
        rec = residency.records.get(i)
        if rec is not None:
            rec.entry_guarded = False
            guarded.release_record(rec)
    if fresh and not residency.told_unguarded:
        residency.told_unguarded = True
        log.info(
            "a graph compiled outside the model's modules (torch.compile of a function that calls the "
            "model) takes %d parameter(s) that move to disk: they are not guarded there, and code "
            "outside the graphs must not read one (on CPU the read kills the process); compile the "
            "model itself (torch.compile(model), backend.compile(model)) to have such reads served",
            len(fresh),
        )


def _hooks(gate: EntryGate | None) -> tuple[Callable[..., None], Callable[..., None]]:
    """The gate's forward hooks: functions, not bound methods (``copy.deepcopy(model)`` copies a bound
    method's object, the gate with its store and engine, and returns a function as it is)."""

    def pre_hook(module: torch.nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            return  # inlined where Dynamo traces the module's call: part of a graph, nothing to open
        assert gate is not None
        gate.enter()

    def post_hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        assert gate is not None
        gate.exit()

    return pre_hook, post_hook


# The hooks run eagerly where a compiled frame is entered from Module._call_impl, and so does every call
# they make (Dynamo would otherwise convert their frames, with is_compiling() true, into no-ops, and
# trace the class swaps); where Dynamo traces a module's call, it inlines them as no-ops. Every closure
# _hooks makes shares these two code objects.
for _hook in _hooks(None):
    set_code_exec_strategy(_hook.__code__, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))

__all__ = ["EntryGate", "never_guard"]
