"""teraio.graph.buffer_reuse's count of migration ops between a buffer's free and an allocation (the rule
itself is tested on generated code in test_inductor.py)."""

from __future__ import annotations

from types import SimpleNamespace

from teraio.graph.buffer_reuse import migration_op_between


def _node(namespace: str | None) -> SimpleNamespace:
    op = SimpleNamespace(namespace=namespace) if namespace else None
    return SimpleNamespace(node=SimpleNamespace(op_overload=op))


def test_only_ops_strictly_between_count() -> None:
    nodes = [_node(None), _node("teraio"), _node(None), _node("aten"), _node("teraio"), _node(None)]
    assert migration_op_between(nodes, 0, 2)  # node 1
    assert not migration_op_between(nodes, 1, 3)  # node 2 only: the free's own node does not count
    assert not migration_op_between(nodes, 2, 4)  # node 3 is aten; node 4 is the allocation's own
    assert migration_op_between(nodes, 3, 5)
    assert not migration_op_between(nodes, 4, 5)  # adjacent


def test_a_new_schedule_is_counted_afresh() -> None:
    first = [_node(None), _node(None), _node(None)]
    assert not migration_op_between(first, 0, 2)
    second = [_node(None), _node("teraio"), _node(None)]
    assert migration_op_between(second, 0, 2)
