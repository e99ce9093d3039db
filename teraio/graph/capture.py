"""Capture a training step's forward and backward graphs from torch.compile, and analyse what they save.

torch.compile hands the backend one FX graph per captured region; AOTAutograd turns it into a joint
forward+backward graph and a partitioner splits it into the forward graph, whose trailing outputs are the
tensors saved for backward, and the backward graph, whose leading placeholders receive them. Partitioning
is the one place that sees both graphs and the split point (``num_fwd_outputs`` reaches only the partition
function: docs/measured_facts.md), so capture wraps the partitioner.

``analyse_saved`` works on the graphs alone (fake tensors in ``node.meta["val"]``): which saved outputs
share a storage (views of one buffer), which op produced each storage, and where forward and backward use
it. No tensor data is needed, so it is exact and cheap.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.multiprocessing.reductions import StorageWeakRef

PartitionFn = Callable[..., tuple[fx.GraphModule, fx.GraphModule]]


@dataclass
class CapturedStep:
    """The partitioned graphs of one captured region, as the partitioner produced them."""

    fw_gm: fx.GraphModule
    bw_gm: fx.GraphModule
    num_fwd_outputs: int

    @property
    def saved_nodes(self) -> list[fx.Node]:
        """Forward output nodes that are saved for backward (after the user outputs)."""
        return list(_output_args(self.fw_gm)[self.num_fwd_outputs :])

    @property
    def bw_saved_placeholders(self) -> list[fx.Node]:
        """Backward placeholders receiving the saved values, in the same order as ``saved_nodes``."""
        phs = [n for n in self.bw_gm.graph.nodes if n.op == "placeholder"]
        return phs[: len(self.saved_nodes)]


def _output_args(gm: fx.GraphModule) -> tuple[Any, ...]:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    args = out.args[0]
    return tuple(args) if isinstance(args, (list, tuple)) else (args,)


def capturing_partition(
    on_partition: Callable[[CapturedStep], CapturedStep | None],
    base: PartitionFn = min_cut_rematerialization_partition,
) -> PartitionFn:
    """A partition function that partitions with ``base``, then hands the result to ``on_partition``.

    ``on_partition`` may return a CapturedStep with rewritten graphs (the rewrite pass) or None to keep
    the partitioner's graphs.
    """

    def partition(
        joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        fw_gm, bw_gm = base(joint, joint_inputs, **kwargs)
        step = CapturedStep(fw_gm, bw_gm, int(kwargs["num_fwd_outputs"]))
        result = on_partition(step) or step
        return result.fw_gm, result.bw_gm

    return partition


# ------------------------------------------------------------------------------------ static analysis
def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _storage_ref(node: Any) -> StorageWeakRef | None:
    v = _val(node)
    if isinstance(v, torch.Tensor):
        return StorageWeakRef(v.untyped_storage())
    return None


def _input_nodes(node: fx.Node) -> list[fx.Node]:
    return list(node.all_input_nodes)


@dataclass
class SavedGroup:
    """Saved outputs that share one storage: offloaded once, views rebuilt after fetching."""

    name: str
    members: list[int]  # positions among the saved outputs
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    producer: fx.Node | None  # the fwd op that allocated the storage; None when it is a graph input
    placeholder: fx.Node | None  # the fwd placeholder owning the storage (params, batch)
    producer_idx: int = -1
    last_fwd_use_idx: int = -1
    first_bwd_use_idx: int = -1
    last_use_idx: int = -1
    module: str = ""
    #: The owner's value spans its whole storage (offset 0, numel * itemsize == nbytes): the storage
    #: can be offloaded through it and every member rebuilt from the bytes. Otherwise not offloadable.
    owner_covers_storage: bool = True


@dataclass
class StepAnalysis:
    """Ops of the step (forward then backward) and the saved storages with their use indices."""

    fw_ops: list[fx.Node]
    bw_ops: list[fx.Node]
    groups: list[SavedGroup]
    saved_group_of: list[int | None]  # per saved output: index into ``groups`` (None for non-tensors)
    fingerprint: str
    op_index: dict[fx.Node, int] = field(default_factory=dict)

    @property
    def num_fwd_ops(self) -> int:
        return len(self.fw_ops)


def node_module(node: fx.Node) -> str:
    """The nn.Module path an op came from ("blocks.3.attn" style), or "" when unknown."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        fwd_meta = node.meta.get("fwd_nn_module_stack")
        stack = fwd_meta or {}
    if not stack:
        return ""
    _key, (path, _cls) = list(stack.items())[-1]
    path = str(path)
    # Dynamo names look like "L['self'].blocks[3].attn" or "L__self___blocks_3": normalise the first kind.
    path = path.replace("L['self'].", "").replace("L['self']", "")
    path = path.replace("[", ".").replace("]", "").replace("'", "")
    return path.strip(".")


def _ops(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def graph_fingerprint(step: CapturedStep) -> str:
    """A stable hash of both graphs' structure, node names, shapes and dtypes.

    Same model and batch shape give the same fingerprint across processes; any change to what is
    computed, saved or how big it is changes it.
    """
    h = hashlib.sha256()
    h.update(f"num_fwd_outputs={step.num_fwd_outputs}".encode())
    for tag, gm in (("fwd", step.fw_gm), ("bwd", step.bw_gm)):
        index = {n: i for i, n in enumerate(gm.graph.nodes)}

        def enc(a: Any, index: dict[fx.Node, int] = index) -> Any:
            if isinstance(a, fx.Node):
                return f"%{index[a]}"
            if isinstance(a, (list, tuple)):
                return [enc(x) for x in a]
            if isinstance(a, dict):
                return {str(k): enc(v) for k, v in sorted(a.items())}
            return repr(a)

        h.update(tag.encode())
        for n in gm.graph.nodes:
            v = _val(n)
            sig = (tuple(v.shape), str(v.dtype), tuple(v.stride())) if isinstance(v, torch.Tensor) else None
            h.update(repr((n.op, n.name, str(n.target), enc(n.args), enc(n.kwargs), sig)).encode())
    return h.hexdigest()


def computation_fingerprint(step: CapturedStep) -> str:
    """A hash of what both graphs compute, independent of how their inputs are named and of inputs no op
    reads: equal for two captures of one computation that torch.compile traced from different Dynamo
    graphs (a static graph and the dynamic one that replaced it, specialised to the same shapes).

    Unlike :func:`graph_fingerprint` (which plans and profiles carry), node names are left out and only
    the inputs that are read count, numbered in order, with their shapes, strides and dtypes.
    """
    h = hashlib.sha256()
    h.update(f"num_fwd_outputs={step.num_fwd_outputs}".encode())
    for tag, gm in (("fwd", step.fw_gm), ("bwd", step.bw_gm)):
        index: dict[fx.Node, str] = {}
        used = 0
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                if n.users:
                    index[n] = f"in{used}"
                    used += 1
            else:
                index[n] = f"%{len(index) - used}"

        def enc(a: Any, index: dict[fx.Node, str] = index) -> Any:
            if isinstance(a, fx.Node):
                return index[a]
            if isinstance(a, (list, tuple)):
                return [enc(x) for x in a]
            if isinstance(a, dict):
                return {str(k): enc(v) for k, v in sorted(a.items())}
            return repr(a)

        h.update(tag.encode())
        for n in gm.graph.nodes:
            if n not in index:
                continue  # an input no op reads
            v = _val(n)
            sig = (tuple(v.shape), str(v.dtype), tuple(v.stride())) if isinstance(v, torch.Tensor) else None
            h.update(repr((n.op, index[n], str(n.target), enc(n.args), enc(n.kwargs), sig)).encode())
    return h.hexdigest()


def analyse_saved(step: CapturedStep) -> StepAnalysis:
    """Group saved outputs by storage and find each storage's producer and its forward/backward uses."""
    fw_ops, bw_ops = _ops(step.fw_gm), _ops(step.bw_gm)
    op_index: dict[fx.Node, int] = {n: i for i, n in enumerate(fw_ops)}
    op_index.update({n: len(fw_ops) + i for i, n in enumerate(bw_ops)})

    # Which storage each forward node's value lives in, and who created it first.
    first_owner: dict[StorageWeakRef, fx.Node] = {}
    for n in step.fw_gm.graph.nodes:
        ref = _storage_ref(n)
        if ref is not None and ref not in first_owner:
            first_owner[ref] = n

    groups: list[SavedGroup] = []
    group_of_ref: dict[StorageWeakRef, int] = {}
    saved_group_of: list[int | None] = []
    for pos, s in enumerate(step.saved_nodes):
        ref = _storage_ref(s)
        if ref is None:
            saved_group_of.append(None)
            continue
        if ref not in group_of_ref:
            owner = first_owner.get(ref, s)
            v = _val(s)
            base_val = _val(owner) if isinstance(_val(owner), torch.Tensor) else v
            group_of_ref[ref] = len(groups)
            groups.append(
                SavedGroup(
                    name=owner.name,
                    members=[],
                    nbytes=int(v.untyped_storage().nbytes()),
                    dtype=v.dtype,
                    shape=tuple(int(x) for x in base_val.shape),
                    producer=owner if owner.op == "call_function" else None,
                    placeholder=owner if owner.op == "placeholder" else None,
                    module=node_module(owner) if owner.op == "call_function" else "",
                    owner_covers_storage=isinstance(_val(owner), torch.Tensor)
                    and base_val.storage_offset() == 0
                    and base_val.numel() * base_val.element_size() == int(v.untyped_storage().nbytes()),
                )
            )
        g = group_of_ref[ref]
        groups[g].members.append(pos)
        saved_group_of.append(g)

    for g in groups:
        g.producer_idx = op_index[g.producer] if g.producer is not None else -1
        g.last_fwd_use_idx = g.producer_idx

    # Forward uses: any op reading a node that lives in the group's storage (views count: they need it).
    for n in fw_ops:
        for inp in _input_nodes(n):
            ref = _storage_ref(inp)
            if ref is not None and ref in group_of_ref:
                g = groups[group_of_ref[ref]]
                g.last_fwd_use_idx = max(g.last_fwd_use_idx, op_index[n])

    # Backward uses: through the placeholders that receive the saved values, and their views.
    bw_ref_group: dict[StorageWeakRef, int] = {}
    for ph, g in zip(step.bw_saved_placeholders, saved_group_of):
        ref = _storage_ref(ph)
        if g is not None and ref is not None:
            bw_ref_group[ref] = g
    for n in bw_ops:
        for inp in _input_nodes(n):
            ref = _storage_ref(inp)
            if ref is not None and ref in bw_ref_group:
                g = groups[bw_ref_group[ref]]
                i = op_index[n]
                if g.first_bwd_use_idx < 0:
                    g.first_bwd_use_idx = i
                g.last_use_idx = max(g.last_use_idx, i)
    for g in groups:
        if g.last_use_idx < 0:
            g.last_use_idx = g.last_fwd_use_idx
    return StepAnalysis(fw_ops, bw_ops, groups, saved_group_of, graph_fingerprint(step), op_index)


def unique_storages(tensors: Iterable[Any]) -> dict[StorageWeakRef, int]:
    """Unique storages among real tensors, with their sizes in bytes."""
    out: dict[StorageWeakRef, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            out.setdefault(StorageWeakRef(st), int(st.nbytes()))
    return out
