"""Turn a Plan into graph edits: insert ``teraio::`` migration ops into the partitioned forward/backward.

The pass runs inside the partitioner (the one place that sees both graphs and the saved-tensor split),
on graphs whose fingerprint must equal the plan's. For each moved storage group (saved outputs sharing
one storage) it inserts, at the plan's positions:

forward:  ``h = offload(owner)`` after op ``offload_after_idx``;
          ``tok = wait_write(h, keepalive=owner, anchors=[op before wait_before_idx])`` before that op;
          every saved output of the group is replaced by ``tok``.
backward: ``t = prefetch(tok, anchors)`` before op ``prefetch_before_idx``;
          ``flat = fetch(t, anchors)`` before op ``fetch_before_idx``;
          each saved view is rebuilt as ``as_strided(flat, size, stride, offset)``.

The number of saved outputs does not change (AOTAutograd pairs them with backward placeholders by
position); a group's extra members carry the same token and their placeholders fall unused.

Requires: graphs whose fingerprint matches the plan; every decision's positions valid for its tensor.
Ensures: ``graph.lint()`` passes; no forward output refers to a moved storage; every new node has
``meta["val"]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.multiprocessing.reductions import StorageWeakRef

import teraio.graph.ops  # noqa: F401  (registers torch.ops.teraio)
from teraio.errors import TeraioError
from teraio.graph.capture import CapturedStep, SavedGroup, StepAnalysis, analyse_saved
from teraio.graph.kernel_boundaries import Segmentation, is_extern, offload_source
from teraio.graph.recompute import RebuildAt, Recipe, apply_recompute
from teraio.planner.plan import Decision, Plan, queue_order


class PlanMismatchError(TeraioError):
    """The plan was made for another graph (fingerprint) or names tensors this graph does not save."""


@dataclass(frozen=True)
class RewriteResult:
    step: CapturedStep
    moved_groups: int
    moved_bytes: int


def _fake_mode(gm: fx.GraphModule):
    vals = [n.meta.get("val") for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    mode = detect_fake_mode(vals)
    if mode is None:
        raise TeraioError("rewrite: the graph carries no fake tensors in meta['val']; cannot type new nodes")
    return mode


def _fake_val(mode, target: Any, args: tuple, kwargs: dict | None = None) -> Any:
    def to_val(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return a.meta["val"]
        if isinstance(a, (list, tuple)):
            return type(a)(to_val(x) for x in a)
        return a

    with mode:
        return target(*to_val(args), **(kwargs or {}))


def _allocating_ops(gm: fx.GraphModule) -> set[fx.Node]:
    """Ops whose output is a new storage (a real computation), not a view of an earlier value.

    A view (``permute`` of a weight, ``view`` of an old buffer) is ready as soon as its base is, so a
    node anchored on it could still be hoisted up to the base: anchors must be allocating ops.
    """
    seen: set[StorageWeakRef] = set()
    out: set[fx.Node] = set()
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if not isinstance(v, torch.Tensor):
            continue
        ref = StorageWeakRef(v.untyped_storage())
        if ref not in seen:
            seen.add(ref)
            if n.op == "call_function":
                out.add(n)
    return out


def _materialized(gm: fx.GraphModule) -> set[fx.Node]:
    """Values that exist as buffers whatever the compiler fuses: extern-kernel results and teraio's own.

    Note: [Anchors must not change fusion] An anchor is an input of a custom op, and a custom op's
    inputs must be real buffers: anchoring on a value Inductor would have fused away (a pointwise
    intermediate) forces it to be written out, which changes the kernels and, in bf16, the rounding,
    and keeps a buffer alive that the plan never counted (the step then goes over its budget).
    Graph outputs are buffers too, but not safe anchors: a gradient (a backward output) is often a
    reduction Inductor fuses with the ops that follow it, and a migration op between the two splits
    that kernel. Extern results are computed by a call of their own, so nothing fuses across them. The
    price: a migration op whose interval holds no extern call has no anchor there and may run earlier
    (its I/O then overlaps less). An anchor also creates a path anchor -> migration op -> consumer: if
    the anchor did not already precede the consumer, two kernels on either side of that new path could
    no longer fuse. In backward, where the fetched tensor feeds compute, anchors are therefore chosen
    among the consumer's ancestors. Where the ops go is Note: [Migration ops sit between kernels] in
    ``teraio.graph.kernel_boundaries``; ``test_migration_ops_leave_inductors_kernels_unchanged`` checks both.
    """
    teraio_ops = {str(t) for t in (torch.ops.teraio.offload.default, torch.ops.teraio.wait_write.default)}
    return {
        n for n in gm.graph.nodes if n.op == "call_function" and (is_extern(n) or str(n.target) in teraio_ops)
    }


@dataclass(frozen=True)
class _AnchorIndex:
    """What anchor choice needs of one graph: its ops, which allocate, their depths and last uses."""

    ops: list[fx.Node]
    allocating: set[fx.Node]  # the ops anchors may be chosen from
    depth: dict[fx.Node, int]
    last_use: dict[fx.Node, int]  # index in ``ops`` of the last op reading the node (len(ops): output)
    #: The same, counting only readers that run where the graph puts them, through views (Note: [An
    #: anchor is alive where the compiled code runs it]).
    last_pinned_use: dict[fx.Node, int]

    @classmethod
    def of(
        cls,
        gm: fx.GraphModule,
        ops: list[fx.Node],
        materialized_only: bool = False,
        moved: frozenset[StorageWeakRef] = frozenset(),
    ) -> _AnchorIndex:
        """``moved``: storages the plan takes out of the graph's outputs. Their output use does not
        count as a use: anchoring a later op on one would keep it in memory after its wait."""
        depth: dict[fx.Node, int] = {}
        for n in gm.graph.nodes:
            depth[n] = 1 + max((depth[i] for i in n.all_input_nodes), default=-1)
        index = {n: i for i, n in enumerate(ops)}

        def uses(n: fx.Node) -> list[fx.Node]:
            v = n.meta.get("val")
            if isinstance(v, torch.Tensor) and StorageWeakRef(v.untyped_storage()) in moved:
                return [u for u in n.users if u.op != "output"]
            return list(n.users)

        last_use = {n: max((index.get(u, len(ops)) for u in uses(n)), default=-1) for n in ops}
        # Note: [An anchor is alive where the compiled code runs it]: readers that run where the graph
        # puts them, by storage (a reader of a view counts for its base).
        output = gm.graph.find_nodes(op="output")[0]
        pinned_by_storage: dict[StorageWeakRef, int] = {}
        for pos, reader in [*enumerate(ops), (len(ops), output)]:
            if reader is output or is_extern(reader):
                for x in reader.all_input_nodes:
                    ref = _storage_of(x)
                    if ref is not None and not (reader is output and ref in moved):
                        pinned_by_storage[ref] = max(pinned_by_storage.get(ref, -1), pos)
        last_pinned_use = {}
        for n in ops:
            ref = _storage_of(n)
            last_pinned_use[n] = -1 if ref is None else pinned_by_storage.get(ref, -1)
        allocating = _allocating_ops(gm)
        if materialized_only:
            allocating &= _materialized(gm)
        return cls(ops, allocating, depth, last_use, last_pinned_use)

    def ancestors(self, node: fx.Node) -> set[fx.Node]:
        """Every node ``node`` depends on, transitively."""
        seen: set[fx.Node] = set()
        stack = list(node.all_input_nodes)
        while stack:
            n = stack.pop()
            if n not in seen:
                seen.add(n)
                stack.extend(n.all_input_nodes)
        return seen

    def before(self, pos: int, within: set[fx.Node] | None = None) -> list[fx.Node]:
        """Anchors for a node placed before ``ops[pos]`` (pos == len(ops): after the last op).

        Two anchors, both allocating ops before the position whose values are buffers whatever the
        compiler fuses (Note: [Anchors must not change fusion]) and are still alive there in the
        compiled code (so anchoring never lengthens a lifetime the plan's memory model did not count:
        Note: [An anchor is alive where the compiled code runs it], which also says what is taken when
        no value qualifies), and, with ``within``, among those nodes only (the ancestors of the op that
        will consume the result: then the anchor adds no ordering the graph did not have): the nearest
        one, and the deepest one (longest chain of ops from the inputs, latest on ties). Inductor fuses
        an op into an earlier kernel when it can, so the nearest op alone may be computed early; the
        deepest op sits on the step's critical chain (the residual stream) and cannot run before
        everything that chain needs. Note: [Anchors pin positions] in ``teraio.graph.ops``.
        """
        end = min(pos, len(self.ops))
        made = [n for n in self.ops[:end] if n in self.allocating]
        # Note: [An anchor is alive where the compiled code runs it]
        cands = [n for n in made if self.last_pinned_use[n] >= end and (within is None or n in within)]
        if not cands:
            alive = [n for n in made if self.last_pinned_use[n] >= end]
            if alive:
                return alive[-1:]
            cands = [n for n in made if self.last_use[n] >= end and (within is None or n in within)]
        if not cands:
            return []
        deepest = max(reversed(cands), key=lambda n: self.depth[n])
        nearest = cands[-1]
        return [nearest] if deepest is nearest else [nearest, deepest]


def _storage_of(node: fx.Node) -> StorageWeakRef | None:
    v = node.meta.get("val")
    return StorageWeakRef(v.untyped_storage()) if isinstance(v, torch.Tensor) else None


# Note: [An anchor is alive where the compiled code runs it]
#     An anchor must still be alive at the migration op's position, or the op keeps it alive longer
#     than the plan's memory model counts. Alive in the graph's order is not enough on Inductor: a
#     pointwise reader later in the graph can be fused into a kernel that runs earlier (its inputs were
#     ready), and the value dies there (docs/measured_facts.md, hazard 4). Readers that run where the
#     graph puts them (extern calls, custom ops, the graph's output; through views) prove a value alive
#     in the compiled code too. So anchors are chosen among the values with such a reader at or after
#     the position; when the consumer's ancestors hold none, the op is anchored on the nearest value
#     before it that has one, even outside them: a longer lifetime costs memory the plan never counted,
#     a lost fusion only time. Where no value has one, among values alive in the graph's order, as
#     before (without an anchor the op could run anywhere earlier).


def _rebuild(
    step: CapturedStep,
    a: StepAnalysis,
    seg: Segmentation,
    plan: Plan,
    recipe_by_group: dict[str, Recipe] | None,
    fetched: dict[str, fx.Node],
    fw_mode: Any,
    bw_mode: Any,
    outputs: list[fx.Node],
) -> None:
    """The plan's recompute decisions, inputs first (``teraio.graph.recompute``)."""
    assert recipe_by_group is not None, "checked by check_plan"
    nf = seg.num_fwd
    rec = {d.name: d for d in plan.recomputes}
    order: list[str] = []

    def visit(name: str, seen: set[str]) -> None:
        if name in order or name in seen:
            return
        seen.add(name)
        for x in recipe_by_group[name].input_groups:
            if x in rec:
                visit(x, seen)
        order.append(name)

    for name in sorted(rec, key=lambda n: (rec[n].fetch_before_idx, n)):
        visit(name, set())
    bw_saved = step.bw_saved_placeholders
    # What backward holds over each saved storage at the rebuild points: the kept placeholders and the
    # fetched buffers (a rebuilt storage is added when it is rebuilt).
    base: dict[str, fx.Node] = {g.name: bw_saved[g.members[0]] for g in a.groups if g.members}
    base.update(fetched)
    rebuilds = [RebuildAt(n, seg.bw_first[rec[n].fetch_before_idx - nf]) for n in order]
    apply_recompute(step, a, rebuilds, recipe_by_group, base, fw_mode, bw_mode, outputs)


def _inductor_layouts(step: CapturedStep) -> dict[fx.Node, list[int]]:
    """Note: [Saved tensors keep Inductor's layout]

    When Inductor optimises layouts (convolutions on CPU), it gives a dense 4-d forward value that a
    convolution reads or that follows one channels-last strides, and a saved output keeps them: a
    graph output is realised with channels-last strides, not with the strides of the graph's fake
    value, and AOTAutograd restrides the backward's placeholder to the strides the compiled forward
    reported, so the backward's kernels are generated for channels-last inputs. A moved tensor must
    come back the same: written in that layout (``offload`` then takes the buffer as it is, no
    staging copy) and rebuilt in backward with those strides, or the backward's kernels index (and
    vectorise, and reduce) their inputs in another order, and a reduction then adds in another order:
    not bit-exact. Inductor's rule, mirrored here from ``GraphLowering.run_node`` on the graph as
    partitioned: layout optimisation on for this forward (``decide_layout_opt``), the node among
    ``find_nodes_prefer_channels_last``, its value dense and 4-d, not one of the forward's own outputs
    (those keep their eager strides), not read by an ``as_strided``.

    Returns the saved nodes whose output strides differ from their fake value's in memory order, with
    the strides Inductor gives them (strides of size-1 dims address nothing: a ``(1, C, 1, 1)`` value
    is the same bytes in either layout and is left as it is). Empty without layout optimisation. A
    prediction that misses costs a copy, never exactness: ``offload`` writes the bytes in the strides
    it is given and the backward reads them with the same; ``kernels()`` in the Inductor tests of
    ``tests/teraio/test_loops.py`` checks the prediction.
    """
    from types import SimpleNamespace

    from torch._inductor.graph import GraphLowering
    from torch._prims_common import is_non_overlapping_and_dense_or_false, make_channels_last_strides_for

    fw_gm = step.fw_gm
    if not GraphLowering.decide_layout_opt(fw_gm, is_inference=False):
        return {}
    prefer = set(GraphLowering.find_nodes_prefer_channels_last(SimpleNamespace(module=fw_gm)))
    outputs = _output_nodes(fw_gm)
    user_visible = set(outputs[: step.num_fwd_outputs])
    as_strided = {
        torch.ops.aten.as_strided.default,
        torch.ops.aten.as_strided_.default,
        torch.ops.aten.as_strided_scatter.default,
        torch.ops.aten.resize.default,
        torch.ops.aten.resize_as.default,
    }
    strides: dict[fx.Node, list[int]] = {}
    for node in step.saved_nodes:
        v = node.meta.get("val")
        if (
            node not in prefer
            or node in user_visible
            or not isinstance(v, torch.Tensor)
            or v.dim() != 4
            or not is_non_overlapping_and_dense_or_false(v)
            or any(u.target in as_strided for u in node.users)
        ):
            continue
        cl = [int(x) for x in make_channels_last_strides_for(v.shape)]
        if any(size > 1 and int(st) != c for size, st, c in zip(v.shape, v.stride(), cl)):
            strides[node] = cl
    return strides


def _output_nodes(gm: fx.GraphModule) -> list[Any]:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return list(out.args[0])


def _realize_where_computed(
    step: CapturedStep, moved: list[SavedGroup], inductor_strides: dict[fx.Node, list[int]]
) -> None:
    """Note: [Outputs are realised where they are computed]

    Inductor writes every graph output out as a buffer where it is computed, with the output's strides
    (channels-last for a 4-d value next to convolutions when it optimises layouts), and the ops after
    it read that buffer; a value that is not an output stays inlined into its consumers until one of
    them needs a buffer. The saved outputs a plan moves stop being graph outputs (the token takes their
    place), so they are marked to be realised where they are computed still, with the strides Inductor
    would have given them. An extern kernel's result (or a view of it) is a buffer from the start.

    The mark realises a value with the strides of its fake value, which Inductor recomputes (its
    FakeTensorProp) before it lowers the graph: it cannot carry other strides. So a value Inductor
    would have written channels-last, in another memory order than its fake value's
    (``inductor_strides``, Note: [Saved tensors keep Inductor's layout]), is left unmarked: the
    convolution that reads it realises it channels-last, as before; the mark would realise it in the
    graph's (contiguous) order and add a copy for that convolution. A value whose channels-last and
    fake strides differ only in size-1 dims (BatchNorm's ``(1, C, 1, 1)`` statistics) is the same
    bytes either way and is marked like any other. Call on the forward graph as partitioned, before
    its outputs change.
    """
    for g in moved:
        if g.producer is None or is_extern(g.producer):
            continue
        for pos in g.members:
            node = step.saved_nodes[pos]
            if node not in inductor_strides:
                node.meta["inductor_realize_to_strides"] = True


def _insert(graph: fx.Graph, mode, before: fx.Node, target: Any, args: tuple, name: str) -> fx.Node:
    with graph.inserting_before(before):
        node = graph.create_node("call_function", target, args, name=name)
    node.meta["val"] = _fake_val(mode, target, args)
    return node


def check_decision(
    d: Decision, g: SavedGroup, num_fwd_ops: int, num_ops: int, needed_at: int | None = None
) -> None:
    """Positions that a correct plan must respect (the planner's simulator checks the same).

    ``needed_at``: the earliest backward op at which a rebuild of another tensor reads this one (it
    must then be back, or rebuilt, by then).
    """
    problems = []
    if g.producer is None:
        problems.append("it is not produced by a forward op (a parameter or input)")
    # Where backward first needs it: its own first use, or a rebuild that reads it, whichever is first.
    uses = [x for x in (g.first_bwd_use_idx, needed_at) if x is not None and x >= 0]
    need = min(uses) if uses else -1
    if d.recomputed:
        if not (g.last_fwd_use_idx < d.wait_before_idx <= num_fwd_ops):
            problems.append(f"wait_before_idx {d.wait_before_idx} is not after its last forward use")
        if need >= 0 and not (num_fwd_ops <= d.prefetch_before_idx == d.fetch_before_idx <= need):
            problems.append(f"it is not rebuilt in backward before it is first needed (op {need})")
    else:
        if not (g.producer_idx <= d.offload_after_idx < num_fwd_ops):
            problems.append(
                f"offload_after_idx {d.offload_after_idx} is not in [{g.producer_idx}, {num_fwd_ops})"
            )
        if not (max(g.last_fwd_use_idx, d.offload_after_idx) < d.wait_before_idx <= num_fwd_ops):
            problems.append(
                f"wait_before_idx {d.wait_before_idx} is not after its last forward use "
                f"{g.last_fwd_use_idx} and within the forward"
            )
        if need >= 0:
            if d.fetch_before_idx != need:
                problems.append(
                    f"fetch_before_idx {d.fetch_before_idx} is not where it is first needed ({need})"
                )
            if not (num_fwd_ops <= d.prefetch_before_idx <= d.fetch_before_idx < num_ops):
                problems.append(
                    f"prefetch_before_idx {d.prefetch_before_idx} is not a backward op at or before "
                    f"fetch_before_idx {d.fetch_before_idx}"
                )
    if problems:
        raise PlanMismatchError(f"plan decision for '{d.name}' is invalid: {'; '.join(problems)}")


def check_plan(a: StepAnalysis, plan: Plan, recipe_by_group: dict[str, Recipe] | None = None) -> None:
    """Everything a plan must agree on with the captured graph, checked before anything runs it.

    Raises:
        PlanMismatchError: another graph's plan, a tensor this graph does not save, a size that is not
            the tensor's, or a position the tensor's uses do not allow.
    """
    if a.fingerprint != plan.fingerprint:
        raise PlanMismatchError(
            f"plan is for graph {plan.fingerprint[:12]} but this graph is {a.fingerprint[:12]}; "
            "re-profile and re-plan (or pass on_plan_mismatch='reprofile')"
        )
    groups = {g.name: g for g in a.groups}
    num_ops = len(a.fw_ops) + len(a.bw_ops)
    # Where rebuilds read other tensors (teraio.graph.recompute): those must be back by then.
    needed_at: dict[str, int] = {}
    for d in plan.recomputes:
        recipe = (recipe_by_group or {}).get(d.name)
        if recipe is None:
            raise PlanMismatchError(
                f"plan recomputes '{d.name}', which this graph cannot rebuild exactly; re-profile and re-plan"
            )
        for x in recipe.input_groups:
            needed_at[x] = min(needed_at.get(x, d.fetch_before_idx), d.fetch_before_idx)
    for d in plan.decisions:
        g = groups.get(d.name)
        if g is None:
            raise PlanMismatchError(f"plan moves '{d.name}', which this graph does not save; re-plan")
        if d.nbytes != g.nbytes:
            raise PlanMismatchError(
                f"plan decision for '{d.name}' says {d.nbytes} bytes but the tensor has {g.nbytes}; re-plan"
            )
        check_decision(d, g, a.num_fwd_ops, num_ops, needed_at.get(d.name))


def apply_plan(
    step: CapturedStep,
    plan: Plan,
    engine_id: int,
    key_prefix: str,
    analysis: StepAnalysis | None = None,
    segmentation: Segmentation | None = None,
    recipe_by_group: dict[str, Recipe] | None = None,
) -> RewriteResult:
    """Insert the plan's migration ops and rebuilds into ``step``'s graphs (in place) and return them.

    ``segmentation`` says what the plan's op indices count (Note: [Migration ops sit between kernels]
    in ``teraio.graph.kernel_boundaries``); by default single ops. ``recipe_by_group``: how each recomputed tensor is
    rebuilt (``teraio.graph.recompute.recipes``); required when the plan recomputes anything.
    """
    from teraio.graph.kernel_boundaries import coarsen

    a = analysis or analyse_saved(step)
    seg = segmentation or Segmentation.of(a, "op")
    check_plan(coarsen(a, seg, step.saved_nodes), plan, recipe_by_group)
    groups = {g.name: (i, g) for i, g in enumerate(a.groups)}
    offloads = [d for d in plan.decisions if not d.recomputed]
    nf = seg.num_fwd  # the plan's forward indices are below this
    fused = seg.granularity != "op"
    # Note: [Saved tensors keep Inductor's layout] (predicted on the graph as partitioned, before
    # anything is inserted).
    inductor_strides = _inductor_layouts(step) if fused else {}
    layout_of: dict[str, list[int]] = {}  # group name -> the strides its bytes are written in
    fw_graph, bw_graph = step.fw_gm.graph, step.bw_gm.graph
    fw_mode, bw_mode = _fake_mode(step.fw_gm), _fake_mode(step.bw_gm)
    fw_out = next(n for n in reversed(fw_graph.nodes) if n.op == "output")
    outputs = list(fw_out.args[0])
    saved_pos0 = step.num_fwd_outputs
    bw_placeholders = step.bw_saved_placeholders
    ops_teraio = torch.ops.teraio
    moved_bytes = 0
    # Note: [Anchors must not change fusion]
    moved_storages = frozenset(
        StorageWeakRef(groups[d.name][1].producer.meta["val"].untyped_storage()) for d in plan.decisions
    )
    fw_anchor = _AnchorIndex.of(step.fw_gm, a.fw_ops, materialized_only=True, moved=moved_storages)
    bw_anchor = _AnchorIndex.of(step.bw_gm, a.bw_ops, materialized_only=True)

    # Note: [Queue orders] Each channel runs its transfers FIFO in issue order, and the plan says that
    # order (``write_rank``/``read_rank``). Offloads issued after the same op are chained one after the
    # other in write order; prefetches before the same op are inserted in read order, and all of them
    # before any fetch at that op: the execution model issues a boundary's reads, then waits for the
    # ones needed next (a fetch placed between two prefetches would hold the later read back until the
    # earlier one completed, which a read on another channel need not wait for).
    last_offload_at: dict[int, fx.Node] = {}
    last_prefetch_at: dict[int, fx.Node] = {}
    first_fetch_at: dict[int, fx.Node] = {}
    tokens: dict[int, fx.Node] = {}
    for k in queue_order(offloads, "write"):
        d = offloads[k]
        g = groups[d.name][1]
        owner = offload_source(step.saved_nodes, g, seg.granularity)
        key = f"{key_prefix}/{g.name}"

        # Forward: offload right after its start segment, wait before the segment that needs the memory
        # gone (segments are single ops on the FX-only path).
        owner_stride = [int(x) for x in owner.meta["val"].stride()]
        # Restrided only when the owner is the group's one saved value, over its whole storage: the
        # saved views of a restrided base would have strides no fake value here knows.
        if (
            owner in inductor_strides
            and g.owner_covers_storage
            and all(step.saved_nodes[pos] is owner for pos in g.members)
        ):
            owner_stride = layout_of[g.name] = inductor_strides[owner]
        off_fx = seg.fw_last[d.offload_after_idx]
        # Anchored on the op it follows, so the write is issued where the plan (and the FIFO order of
        # the simulator) has it, not as soon as the tensor exists.
        offload_anchors = fw_anchor.before(off_fx + 1)
        if off_fx in last_offload_at:  # chained: a compiler may not swap tied offloads
            offload_anchors = [*offload_anchors, last_offload_at[off_fx]]
        offload_args = (owner, offload_anchors, key, engine_id, owner_stride)
        after = last_offload_at.get(off_fx, a.fw_ops[off_fx])
        with fw_graph.inserting_after(after):
            h = fw_graph.create_node(
                "call_function", ops_teraio.offload.default, offload_args, name=f"teraio_offload_{g.name}"
            )
        h.meta["val"] = _fake_val(fw_mode, ops_teraio.offload.default, offload_args)
        last_offload_at[off_fx] = h
        wait_fx = seg.fw_first[d.wait_before_idx] if d.wait_before_idx < nf else len(a.fw_ops)
        wait_at = a.fw_ops[wait_fx] if wait_fx < len(a.fw_ops) else fw_out
        anchors = fw_anchor.before(wait_fx)
        tok = _insert(
            fw_graph,
            fw_mode,
            wait_at,
            ops_teraio.wait_write.default,
            (h, owner, anchors, key, engine_id),
            f"teraio_wait_{g.name}",
        )
        for pos in g.members:
            outputs[saved_pos0 + pos] = tok
        tokens[k] = tok

    fetched: dict[str, fx.Node] = {}  # group name -> the fetched buffer over its whole storage
    for k in queue_order(offloads, "read"):
        d = offloads[k]
        g = groups[d.name][1]
        key = f"{key_prefix}/{g.name}"
        tok = tokens[k]
        # Backward: the first member's placeholder now receives the token.
        ph = bw_placeholders[g.members[0]]
        old_vals = {pos: bw_placeholders[pos].meta["val"] for pos in g.members}
        for pos in g.members:
            bw_placeholders[pos].meta["val"] = tok.meta["val"]
        if g.first_bwd_use_idx < 0:
            moved_bytes += g.nbytes
            continue
        bw_ops = a.bw_ops
        pf_fx = seg.bw_first[d.prefetch_before_idx - nf]
        fetch_fx = seg.bw_first[d.fetch_before_idx - nf]
        p_at = bw_ops[pf_fx]
        f_at = bw_ops[fetch_fx]
        # Note: [Anchors must not change fusion]: anchors every consumer of the tensor already follows.
        consumers = {u for pos in g.members for u in bw_placeholders[pos].users if u.op == "call_function"}
        precede = set.intersection(*(bw_anchor.ancestors(u) for u in consumers)) if consumers else set()
        pf_anchors = bw_anchor.before(pf_fx, precede)
        if pf_fx in last_prefetch_at:  # chained in read order, like tied offloads
            pf_anchors = [*pf_anchors, last_prefetch_at[pf_fx]]
        pf = _insert(
            bw_graph,
            bw_mode,
            first_fetch_at.get(d.prefetch_before_idx, p_at),  # Note: [Queue orders]
            ops_teraio.prefetch.default,
            (ph, pf_anchors, key, engine_id),
            f"teraio_prefetch_{g.name}",
        )
        last_prefetch_at[pf_fx] = pf
        numel = g.nbytes // old_vals[g.members[0]].element_size()
        dtype, device = old_vals[g.members[0]].dtype, old_vals[g.members[0]].device
        f_anchor = bw_anchor.before(fetch_fx, precede)
        flat = _insert(
            bw_graph,
            bw_mode,
            f_at,
            ops_teraio.fetch.default,
            (pf, f_anchor, key, engine_id, numel, dtype, device),
            f"teraio_fetch_{g.name}",
        )
        first_fetch_at.setdefault(d.fetch_before_idx, flat)
        fetched[g.name] = flat
        for pos in g.members:
            member_ph = bw_placeholders[pos]
            v = old_vals[pos]
            view = _insert(
                bw_graph,
                bw_mode,
                f_at,
                torch.ops.aten.as_strided.default,
                (flat, list(v.shape), layout_of.get(g.name, list(v.stride())), int(v.storage_offset())),
                f"teraio_view_{member_ph.name}",
            )
            # The token placeholder also feeds the prefetch: only the compute uses move to the view.
            member_ph.replace_all_uses_with(
                view, delete_user_cb=lambda user, keep=(view, pf): user not in keep
            )
        moved_bytes += g.nbytes

    if plan.recomputes:
        _rebuild(step, a, seg, plan, recipe_by_group, fetched, fw_mode, bw_mode, outputs)
    if fused:
        _realize_where_computed(step, [groups[d.name][1] for d in offloads], inductor_strides)
    fw_out.update_arg(0, tuple(outputs))
    for gm in (step.fw_gm, step.bw_gm):
        gm.graph.lint()
        gm.recompile()
    _ensure_nothing_moved_is_saved(step, a, plan)
    _ensure_moved_die_at_their_wait(step.fw_gm, moved_storages)
    return RewriteResult(step=step, moved_groups=len(plan.decisions), moved_bytes=moved_bytes)


def _ensure_nothing_moved_is_saved(step: CapturedStep, a: StepAnalysis, plan: Plan) -> None:
    """No saved output still holds a moved or rebuilt storage (it would stay in memory)."""
    groups = {g.name: g for g in a.groups}
    gone = {
        StorageWeakRef(groups[d.name].producer.meta["val"].untyped_storage()): d.name for d in plan.decisions
    }
    for node in step.saved_nodes:
        v = node.meta.get("val")
        if node.target is torch.ops.teraio.wait_write.default or not isinstance(v, torch.Tensor):
            continue
        name = gone.get(StorageWeakRef(v.untyped_storage()))
        if name is not None:
            raise TeraioError(f"rewrite left saved output {node.name} of moved tensor {name} in memory")


def _ensure_moved_die_at_their_wait(fw_gm: fx.GraphModule, moved: frozenset[StorageWeakRef]) -> None:
    """No node reads a moved storage after the wait that lets it go (an anchor would keep it alive)."""
    nodes = list(fw_gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    wait = torch.ops.teraio.wait_write.default
    last_wait: dict[StorageWeakRef, int] = {}
    for n in nodes:
        if n.target is wait:
            ref = StorageWeakRef(n.args[1].meta["val"].untyped_storage())
            last_wait[ref] = max(last_wait.get(ref, -1), order[n])
    for n in nodes:
        v = n.meta.get("val")
        if not isinstance(v, torch.Tensor) or n.op == "placeholder":
            continue
        ref = StorageWeakRef(v.untyped_storage())
        if ref not in moved:
            continue
        late = [u.name for u in n.users if u.op != "output" and order[u] > last_wait.get(ref, len(nodes))]
        if late:
            raise TeraioError(f"rewrite: {', '.join(late)} read(s) moved {n.name} after its wait")
