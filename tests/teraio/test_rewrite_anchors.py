"""Anchors of migration ops are values alive where the compiled code runs the op (Note: [An anchor is
alive where the compiled code runs it] in teraio.graph.rewrite). The graphs are traced on fake tensors;
nothing runs."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from teraio.graph.rewrite import _AnchorIndex


def _graph():
    def step(a: torch.Tensor, b: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = torch.mm(a, w)  # read later only by a pointwise op, which a compiler may fuse earlier
        grad = torch.mm(b, w)  # a graph output: alive to the end wherever the compiled code puts it
        out = torch.mm(m.relu(), w)
        return grad, out

    x = torch.randn(4, 4)
    gm = make_fx(step, tracing_mode="fake")(x, x, x)
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert [str(n.target) for n in ops] == [
        "aten.mm.default",
        "aten.mm.default",
        "aten.relu.default",
        "aten.mm.default",
    ]
    return gm, ops


def test_an_anchor_read_only_by_a_fusable_op_gives_way_to_one_read_where_the_code_runs() -> None:
    gm, ops = _graph()
    index = _AnchorIndex.of(gm, ops, materialized_only=True)
    m, grad, relu, _ = ops
    # Before the relu, among the consumer's ancestors only ``m`` is alive in the graph's order; its one
    # reader is pointwise, so the compiled code may already have freed it there.
    assert index.before(2, {m}) == [grad]
    assert index.before(3) == [grad]  # outside the ancestors too: the rules of before() pick it
    # Where no value before the position is read where the code runs, the anchor stays: without one the
    # op could run anywhere earlier.
    assert index.before(1, {m}) == [m]


def test_a_value_read_where_the_code_runs_is_preferred_to_a_nearer_one_read_only_by_a_fusable_op() -> None:
    def step(a: torch.Tensor, b: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = torch.mm(a, w)  # read again by the last matmul
        n = torch.mm(b, w)  # nearer, but read only by the relu
        return torch.mm(n.relu(), w), torch.mm(m, w)

    x = torch.randn(4, 4)
    gm = make_fx(step, tracing_mode="fake")(x, x, x)
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    m, n = ops[0], ops[1]
    assert str(ops[2].target) == "aten.relu.default"
    index = _AnchorIndex.of(gm, ops, materialized_only=True)
    # Both are alive before the relu in the graph's order; the nearest one (the rule before) is ``n``,
    # which a compiler may free as soon as a fused relu ran earlier.
    assert index.before(2, {m, n}) == [m]
