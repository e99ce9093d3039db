"""What a backend reports: ``stats()``, the figures a user reads of what it did.

The figures come from every room of the backend (the runners' plans and phases, the step tracker, the
measured steps, the engine's I/O, the states) and are grouped per model (Note: [Models of one backend]
in teraio.lifecycle.step_stats); their keys are part of the public surface (``stats()``,
``stats.jsonl``, ``teraio.process_stats()``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from teraio.lifecycle.steps import invocation_ordinals
from teraio.planner.plan import Plan
from teraio.states import io_bytes_by_kind

if TYPE_CHECKING:
    from teraio.lifecycle.backend import TeraioBackend
    from teraio.lifecycle.runner import GraphRunner


def backend_stats(backend: TeraioBackend) -> dict[str, Any]:
    """What the backend did, for the model it trained last, per model, and per graph.

    Note: [Models of one backend] in teraio.lifecycle.step_stats. The top-level figures describe the model of
    the latest complete step (``model`` indexes ``models``): ``running_steps`` and ``step_s`` (the
    median wall time of its steps that ran every graph's final compilation), its latest measured
    peak and the prediction for that same step, the bytes it moves per step. ``steps`` counts every
    complete training step of the backend (a step runs every forward in flight to its backward or its
    end), and the I/O figures are the backend's totals since the start. ``models`` has the same
    figures for each model the backend compiled.
    """
    backend.tracker.settle()
    backend.measurement.finish()
    backend.measurement.read_step_times(wait=True)
    models = backend.step_stats.models(_parameter_links(backend.runners))

    def moved_bytes_of(calls: list[tuple[Any, str, int]]) -> int:
        """Bytes a step with these calls moves: each forward's plan, when the backend runs plans."""
        if not backend.cfg.enabled:
            return 0
        return sum(p.moved_bytes for p in forward_plans(calls))

    summaries = [{"model": i, **backend.step_stats.summary(m, moved_bytes_of)} for i, m in enumerate(models)]
    last = backend.step_stats.last_kind
    current = next((x for x, m in zip(summaries, models) if last is not None and last <= m), None)
    graphs = [
        {
            "graph": r.graph_id,
            "phase": r.phase.value,
            "invocations": r.invocations,
            "moved_bytes_per_invocation": r.plan.moved_bytes if r.plan else 0,
            # Note: [A graph called several times per step is planned per call] in
            # teraio.lifecycle.step_planner: per call of a step, when its calls have plans of their own
            # (the first is ``moved_bytes_per_invocation``).
            "moved_bytes_by_call": [p.moved_bytes for _, p in sorted(r.plans.items())],
            "predicted_peak_bytes": r.plan.predicted_peak_bytes if r.plan else None,
            "predicted_step_s": r.plan.predicted_step_s if r.plan else None,
            "profiled_s": r.profile.meta.get("step_s") if r.profile is not None else None,
            "memory_from": r.profile.meta.get("memory_from") if r.profile is not None else None,
            # Forwards from lines of the loop whose outputs are never backpropagated, run without the
            # plan (Note: [Forwards never backpropagated move nothing] in teraio.lifecycle.discarded_forwards).
            "unplanned_calls": r.unplanned_calls,
            # Note: [The partitioner's budget is part of the plan] in teraio.lifecycle.partitioner_search
            "partitioner_budget": r.partitioner_budget,
        }
        for r in backend.runners
    ]
    if current is not None:
        kind = max(
            (k for k in backend.step_stats.kinds if k <= models[current["model"]]),
            key=lambda k: backend.step_stats.kinds[k].steps,
        )
        calls = backend.step_stats.kinds[kind].last_calls
        top = {k: v for k, v in current.items() if k not in ("graphs", "steps")}
        if top["predicted_peak_bytes"] is None:  # not measured yet: the prediction for its latest step
            top["predicted_peak_bytes"] = backend.planner.predicted_peak(calls)
    else:
        calls = []
        top = {
            "model": None,
            "running_steps": 0,
            "step_s": None,
            "measured_peak_bytes": None,
            "predicted_peak_bytes": backend.predicted_step_peak_bytes,
            "measured_step": None,
            "measure_note": None,
            "moved_bytes_per_step": 0,
        }
    planned = forward_plans(calls)
    io = io_stats(backend.engine)
    return {
        "steps": backend.tracker.completed_steps,
        "graphs": len(backend.runners),
        **top,
        "predicted_step_s": sum(p.predicted_step_s for p in planned) if planned else None,
        "phase": [r.phase.value for r in backend.runners],
        "settled": backend.settled,
        "models": summaries,
        "per_graph": graphs,
        **io,
        **io_bytes_by_kind(io, backend.states),
        # Note: [The whole-step budget keeps some states in memory] in teraio.states.residency
        "whole_step": backend.whole_step.stats() if backend.whole_step is not None else None,
        # Note: [Memory outside the graphs is measured and planned for] in teraio.lifecycle.measurement:
        # the step budget the graphs were last planned under, the memory outside them planned for, and
        # how many plannings that memory took.
        "step_budget_bytes": next(
            (r.step_budget_bytes for r in backend.runners if r.step_budget_bytes is not None), None
        ),
        "outside_memory_bytes": backend.outside_memory.bytes,
        "outside_memory_plannings": backend.outside_memory.rounds,
        # Each ratio the partitioner search planned (None: no search ran).
        "partitioner_search": (
            backend.partitioner_search.summary() if backend.partitioner_search is not None else None
        ),
    }


def io_stats(engine: Any) -> dict[str, Any]:
    """The bytes a backend's engine (None: not started) moved since the start, and its stalls."""
    if engine is None:
        return {"offloaded_bytes": 0, "prefetched_bytes": 0, "stall_s": 0.0}
    st = engine.stats()
    written = sum(v.nbytes for k, v in st.transfers.items() if k.endswith(".write"))
    read = sum(v.nbytes for k, v in st.transfers.items() if k.endswith(".read"))
    return {
        "offloaded_bytes": written,
        "prefetched_bytes": read,
        "stall_s": st.stall_s,
        "io_backend": st.backend,
        "io_path": st.io_path,
    }


def _parameter_links(runners: list[GraphRunner]) -> list[frozenset[int]]:
    """Graphs that compute with the same parameters (one model's shapes, a graph Dynamo recompiled)."""
    by_param: dict[int, set[int]] = {}
    for r in runners:
        for p in r.parameter_ids:
            by_param.setdefault(p, set()).add(r.graph_id)
    return [frozenset(g) for g in by_param.values() if len(g) > 1]


def forward_plans(calls: list[tuple[Any, str, int]]) -> list[Plan]:
    """The plan each forward of a step with these calls runs (its graph's plan for that call)."""
    ordinals = invocation_ordinals(calls)
    plans = (g.plan_for(ordinals.get(i, 0)) for g, k, i in calls if k == "fwd")
    return [p for p in plans if p is not None]
