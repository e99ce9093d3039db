"""The memory a compiled graph really holds, segment by segment: Inductor's own timeline for the planner.

Note: [The budget is of the graph that runs]
    The profile's memory timeline comes from a census taken while the partitioned FX graph runs op by op
    (``teraio.profiling.op_timing``). Inductor does not run that graph: it fuses pointwise ops into kernels
    (their intermediates never exist), allocates each kernel's outputs before the kernel runs, reuses buffers,
    and in backward allocates gradient buffers early and frees inputs at its own points. So its no-offload
    peak can lie above the FX census's, plans made on the census then go over the budget by as much, and a
    percentage budget is taken of a peak the step never has. So on the Inductor path one profiling step runs
    Inductor's own kernels for the unplanned graph under the torch profiler, and its allocation events give
    the live bytes of every segment (the ops up to and including the next extern call: Note: [Migration ops
    sit between kernels] in teraio.graph.kernel_boundaries). The extern calls themselves (matmuls,
    convolutions, attention) appear in the profiler's event tree with their input shapes, so each is matched
    to the graph's extern op of the same family whose input shapes it starts with (the earliest such op not
    yet matched): the window of the timeline that ends with an extern event is the memory of the segment that
    extern op ends. The match tolerates Inductor's own order, which differs from the graph's in backward (it
    calls weight gradients' matmuls late, after the convolutions' backward that come later in the graph). The
    profile's ``other_bytes`` then carry what the census did not see, and the planner, the budget and the
    prediction all describe the kernels' memory.

    When the extern events do not match the graph's extern ops one to one (a compiler pass that merged
    or split matmuls, a profiler that missed an event), the mapping is refused and the census is kept,
    with a warning naming both: a wrong mapping would put memory at the wrong op.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import fx

from teraio.graph.kernel_boundaries import is_extern
from teraio.profiling.measure import AllocationEvent, own_running_bytes

#: record_function names that delimit the forward's and the backward's kernels in the profiled step.
FWD_MARK = "teraio::kernels_fwd"
BWD_MARK = "teraio::kernels_bwd"

# Extern ops a compiler may call under another name of the same family: an ``addmm`` whose bias add it
# moves into the next kernel is called as ``mm``, and ``mm`` with a bias epilogue as ``addmm``.
_FAMILIES = {
    "mm": "matmul",
    "addmm": "matmul",
    "bmm": "bmm",
    "baddbmm": "bmm",
    "convolution": "conv",
    "_convolution": "conv",
    "mkldnn_convolution": "conv",
    "convolution_backward": "conv_bwd",
}


def extern_family(name: str) -> str:
    """The family of an extern op or profiler event: ``aten.addmm.default`` and ``aten::addmm`` are both
    "matmul"; ops outside a family are their own (``teraio::offload``, ``aten::_scaled_dot_product_...``)."""
    op = name.replace("::", ".").split(".")
    base = op[1] if len(op) > 1 else op[0]
    return _FAMILIES.get(base, base)


@dataclass(frozen=True)
class ExternSig:
    """What identifies an extern op in the profiler's events: its family and its tensor inputs' shapes."""

    family: str
    shapes: tuple[tuple[int, ...], ...]


def _arg_shapes(node: fx.Node) -> tuple[tuple[int, ...], ...]:
    out = []
    for a in node.args:
        v = a.meta.get("val") if isinstance(a, fx.Node) else None
        if v is not None and hasattr(v, "shape"):
            try:
                out.append(tuple(int(d) for d in v.shape))
            except TypeError:  # symbolic sizes: match on the family alone
                return ()
    return tuple(out)


def expected_externs(ops: Sequence[fx.Node], last_of_segment: Sequence[int]) -> list[ExternSig | None]:
    """Per segment of one graph, in order: the extern op that ends it (None when the segment ends at the
    graph's end instead)."""
    out: list[ExternSig | None] = []
    for last in last_of_segment:
        n = ops[last]
        out.append(ExternSig(extern_family(str(n.target)), _arg_shapes(n)) if is_extern(n) else None)
    return out


@dataclass(frozen=True)
class KernelMemory:
    """What the kernels held while one step ran, per segment of the profile (forward then backward)."""

    segment_live_bytes: list[int]  # the most live bytes during each segment, counted from the step's start
    after_fwd_bytes: int  # live bytes when the forward's kernels returned
    peak_bytes: int


class MappingError(ValueError):
    """The profiler's extern events do not match the graph's extern ops (the message says how)."""


def _event_shapes(node: Any) -> tuple[tuple[int, ...], ...]:
    inputs = getattr(node.extra_fields, "inputs", None) or []
    return tuple(tuple(int(d) for d in i.sizes) for i in inputs if hasattr(i, "sizes"))


def _outermost(roots: list[Any], window: tuple[int, int], families: set[str]) -> list[tuple[int, ExternSig]]:
    """End times and signatures of the outermost events of ``families`` inside ``window``, in time
    order."""
    found: list[tuple[int, ExternSig]] = []
    stack = list(roots)
    while stack:
        n = stack.pop()
        start, end = int(n.start_time_ns), int(n.end_time_ns)
        if end < window[0] or start > window[1]:
            continue
        fam = extern_family(n.name)
        if fam in families and window[0] <= start and end <= window[1]:
            found.append((end, ExternSig(fam, _event_shapes(n))))
            continue  # an extern op's own inner calls are not segment ends
        stack.extend(n.children)
    found.sort(key=lambda e: e[0])
    return found


def _match(seen: list[ExternSig], expected: list[ExternSig | None]) -> list[int]:
    """For each extern event in time order, the segment whose extern op it is: the earliest unmatched one
    of its family whose input shapes the event's start with, else the earliest unmatched of its family.

    Raises:
        MappingError: an event has no unmatched op of its family left, or ops are left unmatched.
    """
    free = [i for i, e in enumerate(expected) if e is not None]
    out = []
    for sig in seen:
        same = [i for i in free if expected[i].family == sig.family]  # type: ignore[union-attr]
        shaped = [i for i in same if sig.shapes[: len(expected[i].shapes)] == expected[i].shapes]  # type: ignore[union-attr]
        pick = (shaped or same or [None])[0]
        if pick is None:
            raise MappingError(f"an extern call ({sig.family}) that the graph does not have")
        free.remove(pick)
        out.append(pick)
    if free:
        raise MappingError(
            f"{len(free)} of the graph's extern ops ({', '.join(expected[i].family for i in free[:4])}) "  # type: ignore[union-attr]
            "did not appear among the kernels' calls"
        )
    return out


def _window(roots: list[Any], name: str) -> tuple[int, int]:
    spans = []
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n.name == name:
            spans.append((int(n.start_time_ns), int(n.end_time_ns)))
        stack.extend(n.children)
    if len(spans) != 1:
        raise MappingError(f"expected one '{name}' span in the profiled step, found {len(spans)}")
    return spans[0]


def segment_memory(
    roots: list[Any],
    events: list[AllocationEvent],
    expected_fwd: list[ExternSig | None],
    expected_bwd: list[ExternSig | None],
) -> KernelMemory:
    """Map one profiled step's allocations onto the segments (Note: [The budget is of the graph that runs]).

    Args:
        roots: the profiler's event tree of a step whose forward kernels ran inside ``FWD_MARK`` and
            backward kernels inside ``BWD_MARK``.
        events: its allocation events on the compute device, in time order.
        expected_fwd, expected_bwd: :func:`expected_externs` of each graph's segments.

    Raises:
        MappingError: the extern events inside a window do not match the expected sequence.
    """
    running = own_running_bytes(events)  # (ts_ns, bytes live after the event)
    times = [t for t, _ in running]
    values = [b for _, b in running]
    out: list[int] = []
    after_fwd = 0
    for mark, expected in ((FWD_MARK, expected_fwd), (BWD_MARK, expected_bwd)):
        window = _window(roots, mark)
        seen = _outermost(roots, window, {e.family for e in expected if e is not None})
        try:
            segments = _match([sig for _, sig in seen], expected)
        except MappingError as exc:
            phase = "forward" if mark == FWD_MARK else "backward"
            raise MappingError(f"{phase}: {exc}") from None
        live = [0] * len(expected)
        start = window[0]
        for (end, _), seg in zip(seen, segments):
            live[seg] = _max_between(times, values, start, end)
            start = end
        # What runs after the last extern call belongs to the graph's last segment when that one ends at
        # the graph's end, else to the segment of the last extern call.
        tail = _max_between(times, values, start, window[1])
        last = len(expected) - 1 if expected and expected[-1] is None else (segments[-1] if segments else 0)
        if expected:
            live[last] = max(live[last], tail)
        out.extend(live)
        if mark == FWD_MARK:
            after_fwd = _value_at(times, values, window[1])
    return KernelMemory(out, after_fwd, max(out) if out else 0)


def _value_at(times: list[int], values: list[int], t: int) -> int:
    import bisect

    i = bisect.bisect_right(times, t) - 1
    return values[i] if i >= 0 else 0


def _max_between(times: list[int], values: list[int], start: int, end: int) -> int:
    """The most bytes live at any moment in [start, end]: what was live at ``start`` or any later value."""
    import bisect

    best = _value_at(times, values, start)
    lo, hi = bisect.bisect_right(times, start), bisect.bisect_right(times, end)
    for v in values[lo:hi]:
        best = max(best, v)
    return best
