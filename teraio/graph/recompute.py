"""Recompute instead of keep or move: how a saved tensor is rebuilt in backward, and the graph edits.

A tensor the forward saves can be rebuilt in backward from values backward has anyway: other saved
tensors (kept, fetched back, or rebuilt themselves) and the parameters and inputs the graph saves. Its
*recipe* is the forward slice between those values and the tensor: the ops that computed it from them.
The profile carries each recipe's cost (``recompute_us``: the slice's profiled duration), what it reads
(``recompute_inputs``: names of other tensors-table rows) and the memory of its intermediates
(``recompute_peak_bytes``); the planner decides (``action == "recompute"``); :func:`apply_recompute`
drops the tensor from the forward's outputs and copies the slice into the backward graph right before
the tensor is first needed.

Note: [Only what replays bit for bit is recomputed]
A slice is a recipe only if running it again gives the same bits: no op that draws random numbers
(tagged ``nondeterministic_seeded``: dropout, bernoulli, rand*, Inductor's seed generator) and no op that
mutates (BatchNorm's running statistics are updated by a ``copy_`` in the forward; doing that twice
would change them). Dropout's mask is itself saved and read by the recipe of dropout's output, so the
output is rebuilt from the same mask. With Inductor's functional RNG, a random op whose seed is a saved
value replays exactly and may be recomputed; one whose seed would have to be drawn again may not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

from teraio.graph.capture import CapturedStep, SavedGroup, StepAnalysis

#: Random ops outside aten's tags (Inductor's prims draw their seeds with ``inductor_seeds``).
_SEEDED_NAMES = ("inductor_seeds",)


@dataclass(frozen=True)
class Recipe:
    """How one saved storage is rebuilt: the slice of forward ops, in graph order, and what it reads."""

    group: str
    ops: tuple[fx.Node, ...]  # forward call_function nodes, topologically ordered; the last is the owner
    #: Forward nodes the slice reads that backward has, each with the saved group it lives in.
    inputs: tuple[tuple[fx.Node, str], ...]
    input_groups: tuple[str, ...]  # the saved groups the slice reads (names of tensors-table rows)
    peak_bytes: int  # bytes of the slice's intermediates (everything but the rebuilt storage)
    #: Parameters the slice reads that backward is not given: resident anyway, saved when recomputing.
    params: tuple[fx.Node, ...] = ()


def _val(n: fx.Node) -> torch.Tensor | None:
    v = n.meta.get("val")
    return v if isinstance(v, torch.Tensor) else None


def _replays_exactly(n: fx.Node) -> bool:
    """Note: [Only what replays bit for bit is recomputed]"""
    t = n.target
    if isinstance(t, torch._ops.OpOverload):
        if torch.Tag.nondeterministic_seeded in t.tags or t._schema.is_mutable:
            return False
        return not any(name in t.name() for name in _SEEDED_NAMES)
    return True  # operator.getitem and other Python callables on tuples


def recipes(
    step: CapturedStep, a: StepAnalysis, param_positions: frozenset[int] = frozenset()
) -> dict[str, Recipe]:
    """The recipe of every saved activation that can be rebuilt, by group name.

    ``param_positions``: forward placeholders (by position) that are parameters: a recipe may read them
    although backward is not given them (the rewrite then saves them too, which costs no memory).
    """
    placeholders = [n for n in step.fw_gm.graph.nodes if n.op == "placeholder"]
    params = frozenset(placeholders[i] for i in param_positions if i < len(placeholders))
    saved_ref_group: dict[StorageWeakRef, SavedGroup] = {}
    for g in a.groups:
        node = g.producer or g.placeholder
        v = _val(node) if node is not None else None
        if v is not None:
            saved_ref_group[StorageWeakRef(v.untyped_storage())] = g
    order = {n: i for i, n in enumerate(step.fw_gm.graph.nodes)}
    out: dict[str, Recipe] = {}
    for g in a.groups:
        if g.producer is None:
            continue
        recipe = _slice(g, saved_ref_group, order, params)
        if recipe is not None:
            out[g.name] = recipe
    return out


def _slice(
    g: SavedGroup,
    saved_ref_group: dict[StorageWeakRef, SavedGroup],
    order: dict[fx.Node, int],
    params: frozenset[fx.Node],
) -> Recipe | None:
    owner = g.producer
    assert owner is not None
    own_ref = StorageWeakRef(_val(owner).untyped_storage()) if _val(owner) is not None else None
    ops: set[fx.Node] = set()
    inputs: dict[fx.Node, str] = {}
    read_params: set[fx.Node] = set()
    stack = [owner]
    while stack:
        n = stack.pop()
        if n in ops or n in inputs or n in read_params:
            continue
        v = _val(n)
        ref = StorageWeakRef(v.untyped_storage()) if v is not None else None
        if n is not owner and ref is not None and ref in saved_ref_group and ref != own_ref:
            inputs[n] = saved_ref_group[ref].name  # backward has it: stop here
            continue
        if n in params:
            read_params.add(n)
            continue
        if n.op == "placeholder":
            return None  # a batch input backward is not given: saving it would cost its memory
        if n.op != "call_function" or not _replays_exactly(n):
            return None
        ops.add(n)
        stack.extend(n.all_input_nodes)
    ordered = tuple(sorted(ops, key=order.__getitem__))
    intermediates = {
        StorageWeakRef(v.untyped_storage()): int(v.untyped_storage().nbytes())
        for n in ordered
        if (v := _val(n)) is not None
    }
    intermediates.pop(own_ref, None)
    read = sorted(inputs, key=order.__getitem__)
    return Recipe(
        group=g.name,
        ops=ordered,
        inputs=tuple((n, inputs[n]) for n in read),
        input_groups=tuple(dict.fromkeys(inputs[n] for n in read)),
        peak_bytes=sum(intermediates.values()),
        params=tuple(sorted(read_params, key=order.__getitem__)),
    )


def recompute_columns(
    a: StepAnalysis, recipe_by_group: dict[str, Recipe], op_duration_us: list[float]
) -> dict[str, dict[str, object]]:
    """Per group name: the tensors-table columns ``recompute_us``, ``recompute_inputs``,
    ``recompute_peak_bytes`` (``op_duration_us`` per forward-then-backward op, as profiled)."""
    cols: dict[str, dict[str, object]] = {}
    for g in a.groups:
        r = recipe_by_group.get(g.name)
        if r is None:
            cols[g.name] = {"recompute_us": math.nan, "recompute_inputs": [], "recompute_peak_bytes": 0}
            continue
        cols[g.name] = {
            "recompute_us": float(sum(op_duration_us[a.op_index[n]] for n in r.ops if n in a.op_index)),
            "recompute_inputs": list(r.input_groups),
            "recompute_peak_bytes": r.peak_bytes,
        }
    return cols


@dataclass(frozen=True)
class RebuildAt:
    """One recompute decision as the rewrite needs it: the group and the backward op index (in the
    graph's own ops) before which it is rebuilt."""

    group: str
    bw_op_idx: int


def _fake(mode, target, args: tuple, kwargs: dict | None = None) -> object:
    def to_val(x: object) -> object:
        if isinstance(x, fx.Node):
            return x.meta["val"]
        if isinstance(x, (list, tuple)):
            return type(x)(to_val(y) for y in x)
        return x

    with mode:
        return target(*to_val(args), **{k: to_val(v) for k, v in (kwargs or {}).items()})


def _insert(graph: fx.Graph, mode, before: fx.Node, target, args: tuple, kwargs: dict, name: str) -> fx.Node:
    with graph.inserting_before(before):
        node = graph.create_node("call_function", target, args, kwargs, name=name)
    node.meta["val"] = _fake(mode, target, args, kwargs)
    return node


def _view_like(
    graph: fx.Graph, mode, before: fx.Node, base: fx.Node, like: torch.Tensor, name: str
) -> fx.Node:
    """A backward value with ``like``'s size, strides and storage offset over ``base``'s storage."""
    args = (base, list(like.shape), list(like.stride()), int(like.storage_offset()))
    return _insert(graph, mode, before, torch.ops.aten.as_strided.default, args, {}, name)


def apply_recompute(
    step: CapturedStep,
    a: StepAnalysis,
    rebuilds: list[RebuildAt],
    recipe_by_group: dict[str, Recipe],
    storage_base: dict[str, fx.Node],
    fw_mode,
    bw_mode,
    outputs: list[fx.Node],
) -> None:
    """Drop each rebuilt group's saved outputs from the forward and rebuild it in backward.

    ``rebuilds`` come inputs first (a chain rebuilds an input before the tensor reading it).
    ``storage_base``: per group name, a backward node over that group's whole storage as it is at the
    rebuild points (a kept group's first saved placeholder, an offloaded group's fetched buffer); rebuilt
    groups are added as they are rebuilt. ``outputs`` is the forward's output list, edited in place.
    """
    groups = {g.name: g for g in a.groups}
    saved0 = step.num_fwd_outputs
    fw_graph, bw_graph = step.fw_gm.graph, step.bw_gm.graph
    fw_out = next(n for n in reversed(fw_graph.nodes) if n.op == "output")
    bw_placeholders = step.bw_saved_placeholders
    param_in_bw = _save_params(
        [p for rb in rebuilds for p in recipe_by_group[rb.group].params],
        outputs,
        saved0,
        bw_placeholders,
        bw_mode,
    )
    for rb in rebuilds:
        g, recipe = groups[rb.group], recipe_by_group[rb.group]
        owner = g.producer
        assert owner is not None
        at = a.bw_ops[rb.bw_op_idx]
        # Forward: the saved outputs make way for empty tensors (the slot count must not change).
        old_vals = {pos: bw_placeholders[pos].meta["val"] for pos in g.members}
        for pos in g.members:
            v = old_vals[pos]
            empty = _insert(
                fw_graph,
                fw_mode,
                fw_out,
                torch.ops.aten.empty.memory_format,
                ([0],),
                {"dtype": v.dtype, "device": v.device},
                f"teraio_dropped_{bw_placeholders[pos].name}",
            )
            outputs[saved0 + pos] = empty
            bw_placeholders[pos].meta["val"] = empty.meta["val"]
        # Backward: the recipe's inputs as views of what backward holds, then the recipe's ops.
        env: dict[fx.Node, fx.Node] = {p: param_in_bw[p] for p in recipe.params}
        for k, (inp, group) in enumerate(recipe.inputs):
            base = storage_base[group]
            env[inp] = _view_like(bw_graph, bw_mode, at, base, inp.meta["val"], f"teraio_rc_in{k}_{g.name}")
        for n in recipe.ops:
            args = fx.node.map_arg(n.args, env.__getitem__)
            kwargs = fx.node.map_arg(n.kwargs, env.__getitem__)
            env[n] = _insert(bw_graph, bw_mode, at, n.target, args, kwargs, f"teraio_rc_{n.name}")
        rebuilt = env[owner]
        storage_base[g.name] = rebuilt
        # Every saved member is a view of the rebuilt storage, as it was of the original.
        for pos in g.members:
            ph = bw_placeholders[pos]
            view = _view_like(bw_graph, bw_mode, at, rebuilt, old_vals[pos], f"teraio_rc_view_{ph.name}")
            ph.replace_all_uses_with(view)


def _save_params(
    params: list[fx.Node], outputs: list[fx.Node], saved0: int, bw_saved: list[fx.Node], bw_mode
) -> dict[fx.Node, fx.Node]:
    """Save forward parameters for backward (outputs and backward placeholders), once each.

    AOTAutograd counts the saved values from the partitioned graphs, tensors first, then symbolic ints,
    each paired with a backward placeholder by position: new tensors go just before the first saved
    symbolic int, on both sides, so no position of an existing saved value changes.
    """
    out: dict[fx.Node, fx.Node] = {}
    for pos, node in enumerate(outputs[saved0:]):
        if node in params and pos < len(bw_saved):
            out[node] = bw_saved[pos]
    new = [p for p in dict.fromkeys(params) if p not in out]
    if not new:
        return out
    saved = outputs[saved0:]
    first_sym = next(
        (i for i, n in enumerate(saved) if not isinstance(n.meta.get("val"), torch.Tensor)), len(saved)
    )
    bw_graph = bw_saved[0].graph if bw_saved else None
    assert bw_graph is not None, "a step that saves nothing cannot be rebuilt"
    before = bw_saved[first_sym] if first_sym < len(bw_saved) else bw_saved[-1].next
    for k, p in enumerate(new):
        outputs.insert(saved0 + first_sym + k, p)
        v = p.meta["val"]
        with bw_graph.inserting_before(before):
            ph = bw_graph.create_node("placeholder", f"teraio_saved_{p.name}")
        ph.meta["val"] = _fake(
            bw_mode,
            torch.empty_strided,
            (list(v.shape), list(v.stride())),
            {"dtype": v.dtype, "device": v.device},
        )
        out[p] = ph
    return out
