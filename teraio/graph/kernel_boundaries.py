"""Where migration ops may go in a graph that a compiler fuses: between its kernels, never inside one.

Note: [Migration ops sit between kernels]
Inductor turns runs of consecutive pointwise and reduction ops into one kernel (the C++ backend groups
consecutive scheduler nodes by their outer loops; Triton fuses along dependencies); an extern call (a matmul,
a convolution, attention, any op without a lowering) ends such a run. A ``teraio::`` op placed between two ops
of one run is an extern call of its own and splits that kernel, which changes what stays in registers and, in
bf16, the rounding. So with ``inner="inductor"`` the profile's unit of scheduling is the *segment*: the ops of
the graph up to and including the next extern op. A plan made on such a profile names segments, and the
rewrite inserts migration ops only right after a segment's extern op (or at the start or end of a graph),
where a kernel boundary already is. With the FX-only compiler nothing is fused and every op is a segment of
its own.
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import fx

from teraio.graph.capture import SavedGroup, StepAnalysis

Granularity = Literal["op", "kernel-group"]

# Ops Inductor runs as extern kernels (library calls or templates it never fuses into neighbours) in
# its default modes. max-autotune's GEMM templates may fuse epilogues: teraio runs the default modes.
_EXTERN_ATEN = frozenset(
    str(t)
    for t in (
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten.bmm.default,
        torch.ops.aten.baddbmm.default,
        torch.ops.aten.convolution.default,
        torch.ops.aten.convolution_backward.default,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_flash_attention_backward.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
        torch.ops.aten._scaled_dot_product_efficient_attention_backward.default,
        torch.ops.aten._scaled_dot_product_cudnn_attention.default,
        torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default,
    )
)
# Namespaces whose ops Inductor lowers to its own IR (fusible); any other namespace is a custom op,
# which Inductor calls as an extern kernel.
_LOWERED_NAMESPACES = frozenset({"aten", "prims", "_c10d_functional", "c10d_functional", "higher_order"})


def is_extern(node: fx.Node) -> bool:
    """Whether a compiler calls this op as an extern kernel, which already ends a fused kernel."""
    if node.op != "call_function":
        return False
    target = node.target
    if str(target) in _EXTERN_ATEN:
        return True
    return isinstance(target, torch._ops.OpOverload) and target.namespace not in _LOWERED_NAMESPACES


def granularity_for(inner: str) -> Granularity:
    """Inductor fuses (segments of ops between extern calls); the FX-only path runs op by op."""
    return "kernel-group" if inner == "inductor" else "op"


def _segments(ops: list[fx.Node], granularity: Granularity) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if granularity == "op" or not ops:
        idx = tuple(range(len(ops)))
        return idx, idx
    first, last = [0], []
    for i, n in enumerate(ops):
        if is_extern(n) and i + 1 < len(ops):
            last.append(i)
            first.append(i + 1)
    last.append(len(ops) - 1)
    return tuple(first), tuple(last)


@dataclass(frozen=True)
class Segmentation:
    """The segments of one step's forward and backward ops (indices into each graph's op list)."""

    granularity: Granularity
    fw_first: tuple[int, ...]
    fw_last: tuple[int, ...]
    bw_first: tuple[int, ...]
    bw_last: tuple[int, ...]
    num_fw_fx_ops: int

    @classmethod
    def of(cls, a: StepAnalysis, granularity: Granularity) -> Segmentation:
        fw_first, fw_last = _segments(a.fw_ops, granularity)
        bw_first, bw_last = _segments(a.bw_ops, granularity)
        return cls(granularity, fw_first, fw_last, bw_first, bw_last, len(a.fw_ops))

    @property
    def num_fwd(self) -> int:
        return len(self.fw_first)

    @property
    def num_total(self) -> int:
        return len(self.fw_first) + len(self.bw_first)

    def segment_of(self, fx_idx: int) -> int:
        """The step-wide segment index of a step-wide op index (forward ops first, -1 stays -1)."""
        if fx_idx < 0:
            return -1
        if fx_idx < self.num_fw_fx_ops:
            return _bisect_last(self.fw_first, fx_idx)
        return self.num_fwd + _bisect_last(self.bw_first, fx_idx - self.num_fw_fx_ops)

    def members(self, seg_idx: int) -> range:
        """Step-wide op indices of one step-wide segment."""
        if seg_idx < self.num_fwd:
            return range(self.fw_first[seg_idx], self.fw_last[seg_idx] + 1)
        b = seg_idx - self.num_fwd
        off = self.num_fw_fx_ops
        return range(off + self.bw_first[b], off + self.bw_last[b] + 1)


def _bisect_last(firsts: tuple[int, ...], i: int) -> int:
    return bisect.bisect_right(firsts, i) - 1


def plan_fingerprint(a: StepAnalysis, granularity: Granularity) -> str:
    """The fingerprint profiles and plans carry: the graph's, and the unit their indices count in."""
    if granularity == "op":
        return a.fingerprint
    return hashlib.sha256(f"{a.fingerprint}:{granularity}".encode()).hexdigest()


def offload_source(saved_nodes: list[fx.Node], g: SavedGroup, granularity: Granularity) -> fx.Node:
    """The node whose buffer the offload of ``g`` writes (and keeps alive until the write is done).

    Note: [Saved views of fused values] The storage's producer, unless a compiler materialises a
    saved view of it instead: Inductor writes each graph output out as a buffer of its own, so when
    only a view of a fused value was saved (a transposed copy for a matmul's backward), the value is
    computed into that view's buffer where the view is, and offloading the producer would make
    Inductor compute and store it a second time. A view stands in for the storage only when it
    covers all of it (the bytes written are then the storage's, in its layout); the offload cannot
    start before that view exists.
    """
    owner = g.producer
    assert owner is not None, "only produced tensors are offloaded"
    members = [saved_nodes[pos] for pos in g.members]
    if granularity == "op" or is_extern(owner) or owner in members:
        return owner
    for m in members:
        v = m.meta.get("val")
        if (
            isinstance(v, torch.Tensor)
            and v.storage_offset() == 0
            and v.numel() * v.element_size() == v.untyped_storage().nbytes()
        ):
            return m
    return owner


def offload_ready_idx(
    a: StepAnalysis, saved_nodes: list[fx.Node], g: SavedGroup, granularity: Granularity
) -> int:
    """The first op after which the group's offload may start (its producer, or its written view)."""
    if g.producer is None:
        return g.producer_idx
    return max(g.producer_idx, a.op_index[offload_source(saved_nodes, g, granularity)])


def coarsen(a: StepAnalysis, seg: Segmentation, saved_nodes: list[fx.Node]) -> StepAnalysis:
    """The analysis in segment indices, for checking a plan made on a profile of that granularity.

    Each segment is represented by its last op; every saved group's indices are its segments', and its
    producer index is where its offload may first start (Note: [Saved views of fused values]).
    """
    if seg.granularity == "op":
        return a
    groups: list[SavedGroup] = [
        replace(
            g,
            producer_idx=seg.segment_of(offload_ready_idx(a, saved_nodes, g, seg.granularity)),
            last_fwd_use_idx=seg.segment_of(g.last_fwd_use_idx),
            first_bwd_use_idx=seg.segment_of(g.first_bwd_use_idx),
            last_use_idx=seg.segment_of(g.last_use_idx),
        )
        for g in a.groups
    ]
    fw = [a.fw_ops[i] for i in seg.fw_last]
    bw = [a.bw_ops[i] for i in seg.bw_last]
    index = {n: i for i, n in enumerate(fw)}
    index.update({n: len(fw) + i for i, n in enumerate(bw)})
    return StepAnalysis(fw, bw, groups, a.saved_group_of, plan_fingerprint(a, seg.granularity), index)
