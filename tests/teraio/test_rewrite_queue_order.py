"""The rewrite follows the plan's queue orders: offloads tied after one op, and prefetches tied before one
op, sit in the graph in ``write_rank`` / ``read_rank`` order, not in the order of the plan's decisions;
and every prefetch before an op precedes every fetch there (two of the tied tensors are first used by
that op: a fetch placed between the prefetches once held the later reads back).

Each channel runs FIFO in issue order, so the order of tied transfers is part of the schedule the
simulator predicted (``planner.execution``). The plan here is made by hand on the tiny built-in GPT's
captured graphs: several saved tensors offloaded after one forward op and prefetched before the first
backward op, with write and read orders that differ from each other and from the decisions' order.
Nothing runs after the rewrite: the test reads the graphs.
"""

from __future__ import annotations

import torch

from teraio.graph.capture import StepAnalysis, analyse_saved
from teraio.graph.rewrite import apply_plan
from teraio.planner.hardware import HardwareModel
from teraio.planner.plan import Decision, Plan, SolverStats

from .captured import captured_tiny_gpt_step

TIED = 4  # decisions tied at the offload op and at the prefetch op


def _tied_plan(a: StepAnalysis) -> Plan:
    """``TIED`` tensors offloaded after one forward op, waited at the end of forward, all prefetched
    before the first backward op; write ranks reverse the decisions' order, read ranks interleave."""
    nf = a.num_fwd_ops
    ops = a.fw_ops + a.bw_ops
    movable = [
        g for g in a.groups if g.producer is not None and g.owner_covers_storage and g.first_bwd_use_idx >= 0
    ]
    assert len(movable) >= TIED, "the tiny GPT saves fewer tensors than this test needs"
    # The ones made last: one op after all of their producers is a valid offload position for each.
    chosen = sorted(movable, key=lambda g: g.producer_idx)[-TIED:]
    offload_after = max(g.producer_idx for g in chosen)
    assert offload_after < nf - 1
    write_order = list(reversed(range(TIED)))  # decision i has write rank write_order[i]
    read_order = [1, 3, 0, 2]
    decisions = [
        Decision(
            name=g.name,
            tier="ssd",
            nbytes=g.nbytes,
            offload_after_idx=offload_after,
            offload_after_name=ops[offload_after].name,
            wait_before_idx=nf,
            wait_before_name="<end>",
            prefetch_before_idx=nf,
            prefetch_before_name=ops[nf].name,
            fetch_before_idx=g.first_bwd_use_idx,
            fetch_before_name=ops[g.first_bwd_use_idx].name,
            write_rank=write_order[i],
            read_rank=read_order[i],
        )
        for i, g in enumerate(chosen)
    ]
    return Plan(
        fingerprint=a.fingerprint,
        budget_bytes=1,
        budget_spec="by hand",
        hardware=HardwareModel(),
        stats=SolverStats(solver="by hand", status="HEURISTIC"),
        decisions=tuple(decisions),
        baseline_peak_bytes=1,
        predicted_peak_bytes=1,
        predicted_step_s=0.0,
        predicted_stall_s=0.0,
        compute_s=0.0,
    )


def _positions(gm: torch.fx.GraphModule, target) -> list[tuple[int, torch.fx.Node]]:
    return [(i, n) for i, n in enumerate(gm.graph.nodes) if n.op == "call_function" and n.target == target]


def test_tied_offloads_and_prefetches_follow_the_plans_ranks() -> None:
    step = captured_tiny_gpt_step()
    a = analyse_saved(step)
    plan = _tied_plan(a)
    offload_op = a.fw_ops[plan.decisions[0].offload_after_idx]
    first_bwd_op = a.bw_ops[0]
    apply_plan(step, plan, engine_id=0, key_prefix="g0", analysis=a)

    by_name = {d.name: d for d in plan.decisions}
    fw_order = {n: i for i, n in enumerate(step.fw_gm.graph.nodes)}
    bw_order = {n: i for i, n in enumerate(step.bw_gm.graph.nodes)}

    offloads = _positions(step.fw_gm, torch.ops.teraio.offload.default)
    written = [n.name.removeprefix("teraio_offload_") for _, n in offloads]
    assert written == sorted(by_name, key=lambda x: by_name[x].write_rank)
    assert written != [d.name for d in plan.decisions]  # the ranks decided, not the plan's order
    # All right after their op (nothing else in between), each chained on the one before it.
    assert [i for i, _ in offloads] == [fw_order[offload_op] + 1 + k for k in range(TIED)]
    for (_, prev), (_, node) in zip(offloads, offloads[1:]):
        assert prev in node.args[1]

    prefetches = _positions(step.bw_gm, torch.ops.teraio.prefetch.default)
    read = [n.name.removeprefix("teraio_prefetch_") for _, n in prefetches]
    assert read == sorted(by_name, key=lambda x: by_name[x].read_rank)
    assert read not in ([d.name for d in plan.decisions], written)
    for (_, prev), (_, node) in zip(prefetches, prefetches[1:]):
        assert prev in node.args[1]
    # Issued at the boundary before the first backward op, all of them before any read is waited for
    # there (the execution model issues a boundary's reads, then waits for the ones needed next).
    assert max(i for i, _ in prefetches) < bw_order[first_bwd_op]
    fetches = _positions(step.bw_gm, torch.ops.teraio.fetch.default)
    assert len(fetches) == TIED
    assert max(i for i, _ in prefetches) < min(i for i, _ in fetches)
