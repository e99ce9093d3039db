"""Graphs whose shapes change: one profile and plan per concrete shape, from Dynamo's symbolic graph.

A plan is exact for the shapes it was made for (sizes, offsets, bytes moved), so a graph Dynamo traced
with symbolic shapes (``dynamic=True``, or automatic dynamic after a shape changed) gets one
:class:`~teraio.lifecycle.runner.GraphRunner` per concrete shape, up to ``max_shapes``.

Note: [Specialising a symbolic graph]
    Each concrete shape compiles a copy of Dynamo's graph in which every symbolic input is replaced by
    its value at that call: the sizes (``s0`` placeholders) and the Python scalars Dynamo passes as
    0-d tensors and reads back with ``.item()`` under ``dynamic=True`` (a LayerNorm's ``eps``, a
    dropout's ``p``). Tracing that copy with static fake inputs then sees plain numbers everywhere, as a
    static Dynamo graph would have them. Left symbolic, the scalars' ``.item()`` became data-dependent
    values that LayerNorm could not guard on, and every model with one failed at its first call. A
    scalar's value is part of the shape key: a new value compiles a new copy (and is counted against
    ``max_shapes``).

Note: [A graph Dynamo replaced keeps its shape]
    When a shape changes, Dynamo recompiles the frame with dynamic shapes and tries the new graph first,
    so the static graph of the common shape is never called again: left alone, its runner stayed in
    profiling forever, and the common shape was profiled a second time through the dynamic graph. So
    when the dynamic graph meets a shape that a static graph of the same frame was compiled for, it
    captures (traces, without compiling) its specialised copy, and when that computes exactly what the
    static graph computes (``teraio.graph.capture.computation_fingerprint``), it calls the static graph's
    runner, with the arguments picked by their Dynamo sources. That runner keeps its profile, plan and
    phase. A frame recompiled for another reason (train and eval modes) computes something else, and
    gets its own runner.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

if TYPE_CHECKING:
    from teraio.lifecycle.backend import TeraioBackend
    from teraio.lifecycle.runner import GraphRunner

log = logging.getLogger("teraio")


def is_dynamic(example_inputs: list[Any]) -> bool:
    """Whether Dynamo traced this graph with symbolic shapes."""
    for a in example_inputs:
        if isinstance(a, (torch.SymInt, torch.SymFloat)):
            return True
        if isinstance(a, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in a.shape):
            return True
    return False


def _placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def placeholder_sources(gm: fx.GraphModule) -> list[str | None]:
    """Each Dynamo placeholder's source ("L['idx']", "L['idx'].size()[1]"), None where Dynamo gave none."""
    out: list[str | None] = []
    for n in _placeholders(gm):
        source = getattr(n.meta.get("grapharg"), "source", None)
        out.append(source.name if source is not None else None)
    return out


def frame_of(gm: fx.GraphModule) -> int | None:
    """The Dynamo frame a graph was traced from (its recompilations share it), when Dynamo says."""
    compile_id = gm.meta.get("dynamo_compile_id")
    return getattr(compile_id, "frame_id", None)


def scalar_positions(gm: fx.GraphModule) -> frozenset[int]:
    """Positions of the Python scalars Dynamo passes as 0-d tensors (Note: [Specialising a symbolic
    graph])."""
    return frozenset(
        i
        for i, n in enumerate(_placeholders(gm))
        if getattr(n.meta.get("grapharg"), "pass_arg_as_tensor", False)
    )


def _arg_key(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return (tuple(a.shape), tuple(a.stride()), a.dtype, str(a.device), a.requires_grad)
    return a


def shape_key(args: tuple[Any, ...] | list[Any], scalars: frozenset[int] = frozenset()) -> tuple[Any, ...]:
    """What a plan depends on in a call's arguments: tensors' shapes, strides, dtypes, devices and
    whether they require grad; other arguments and the scalars' values as they are."""
    return tuple(
        ("scalar", a.item()) if i in scalars and isinstance(a, torch.Tensor) else _arg_key(a)
        for i, a in enumerate(args)
    )


def specialize(
    gm: fx.GraphModule, args: tuple[Any, ...], scalars: frozenset[int]
) -> tuple[fx.GraphModule, list[int]]:
    """A copy of ``gm`` for one call's values (Note: [Specialising a symbolic graph]), and the positions
    of the call's arguments it takes: symbolic sizes and scalars read with ``.item()`` become constants
    and their inputs are dropped, so the copy has the inputs a static graph of that shape would have
    (with inputs left unread, AOTAutograd saw symbolic integers and partitioned differently)."""
    out = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    out.meta = dict(gm.meta)
    # What AOTAutograd reads of a Dynamo graph beyond its nodes (which inputs are parameters, their
    # sources): without it, it planned the copy as a graph of unknown origin and partitioned differently.
    if hasattr(gm, "_param_name_to_source"):
        out._param_name_to_source = gm._param_name_to_source
    for original, node in zip(_placeholders(gm), _placeholders(out)):
        if hasattr(original, "_dynamo_source"):
            node._dynamo_source = original._dynamo_source
    kept: list[int] = []
    for i, node in enumerate(_placeholders(out)):
        value = args[i]
        if isinstance(value, (int, float, bool)) and not isinstance(value, torch.Tensor):
            const: Any = value
            targets = [node]
        elif i in scalars and isinstance(value, torch.Tensor):
            const = value.item()
            targets = [u for u in node.users if u.op == "call_method" and u.target == "item"]
        else:
            kept.append(i)
            continue
        for t in targets:
            for user in list(t.users):
                user.args = fx.node.map_arg(user.args, lambda a, t=t, c=const: c if a is t else a)
                user.kwargs = fx.node.map_arg(user.kwargs, lambda a, t=t, c=const: c if a is t else a)
            if t is not node and not t.users:
                out.graph.erase_node(t)
        if node.users:  # a scalar also used as a tensor
            kept.append(i)
        else:
            out.graph.erase_node(node)
    out.graph.lint()
    out.recompile()
    return out, kept


def static_examples(args: tuple[Any, ...]) -> list[Any]:
    """Example inputs for compiling one concrete shape: fakes of the call's tensors (no data kept), the
    other arguments as they are."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    return [mode.from_tensor(a, static_shapes=True) if isinstance(a, torch.Tensor) else a for a in args]


class _Alias:
    """Calls a runner with some of a call's arguments: a specialised copy's (Note: [Specialising a symbolic
    graph]), or a static graph's with those of the dynamic graph that replaced it (Note: [A graph Dynamo
    replaced keeps its shape])."""

    def __init__(self, runner: GraphRunner, positions: list[int]) -> None:
        self.runner = runner
        self.positions = positions

    def __call__(self, *args: Any) -> Any:
        return self.runner(*[args[i] for i in self.positions])


class ShapeDispatch:
    """A graph with dynamic shapes: one GraphRunner (profile, plan) per concrete shape, bounded.

    After ``max_shapes`` shapes, further shapes run the captured graph as it is, without compiling or
    migration (logged once).
    """

    def __init__(self, backend: TeraioBackend, gm: fx.GraphModule, example_inputs: list[Any]) -> None:
        self.backend = backend
        self.gm = gm
        self.example_inputs = example_inputs
        self.scalars = scalar_positions(gm)
        self.sources = placeholder_sources(gm)
        self.frame = frame_of(gm)
        self.by_shape: dict[tuple[Any, ...], Callable[..., Any]] = {}
        self._warned = False
        self._lock = threading.Lock()

    @property
    def shapes(self) -> int:
        """Shapes compiled for (the ones a replaced static graph serves included)."""
        return len(self.by_shape)

    def __call__(self, *args: Any) -> Any:
        key = shape_key(args, self.scalars)
        with self._lock:
            entry = self.by_shape.get(key)
            if entry is None:
                if len(self.by_shape) < self.backend.cfg.profiling.max_shapes:
                    entry = self._twin(args) or self._specialised(args)
                    self.by_shape[key] = entry
                else:
                    if not self._warned:
                        self._warned = True
                        log.warning(
                            "a graph has seen more than max_shapes=%d shapes; further shapes run uncompiled "
                            "and without migration (raise max_shapes to plan them)",
                            self.backend.cfg.profiling.max_shapes,
                        )
                    return self.gm(*args)
        return entry(*args)

    def _specialised(self, args: tuple[Any, ...]) -> _Alias:
        gm, kept = specialize(self.gm, args, self.scalars)
        runner = self.backend.new_runner(gm, static_examples(tuple(args[i] for i in kept)))
        return _Alias(runner, kept)

    def _twin(self, args: tuple[Any, ...]) -> _Alias | None:
        """The static runner of this frame that serves this call's shape, when it computes the same
        (Note: [A graph Dynamo replaced keeps its shape])."""
        from teraio.graph.capture import computation_fingerprint
        from teraio.graph.compilers import capture_step

        if self.frame is None:
            return None
        where = {s: i for i, s in enumerate(self.sources) if s is not None}
        for runner in self.backend.runners:
            if runner.frame != self.frame or runner.computation_fingerprint is None or runner.sources is None:
                continue
            if any(s is None or s not in where for s in runner.sources):
                continue
            positions = [where[s] for s in runner.sources]  # type: ignore[index]
            if shape_key([args[i] for i in positions]) != runner.signature:
                continue
            gm, kept = specialize(self.gm, args, self.scalars)
            step = capture_step(
                gm,
                static_examples(tuple(args[i] for i in kept)),
                runner.cfg.inner,
                inductor_options=self.backend.inductor_options,
                # The runner's fingerprint is of its partition, which the partitioner search may have
                # changed: captured at another, the same computation saves other tensors and never matched.
                partitioner_budget=runner.partitioner_budget,
            )
            if step is not None and computation_fingerprint(step) == runner.computation_fingerprint:
                log.info(
                    "%s serves its shape for the dynamic graph Dynamo compiled in its place (no second profile)",
                    runner.name,
                )
                return _Alias(runner, positions)
        return None
