"""Time a captured training step op by op and turn it into a planner Profile.

The forward and backward graphs run through a timing FX interpreter for the first few steps. Each op is
timed with a monotonic clock on CPU and with timing events on the current stream on CUDA (Note: [Device
time, not launch time] in teraio.profiling.clock), and after each op the interpreter takes a census of the storages its
environment holds (graph inputs excluded: parameters and the batch exist before the step), which gives
the step's memory timeline at op granularity. The static analysis of ``teraio.graph.capture`` says which
storages are saved and where they are used; together they make the Profile the planner reads.

The interpreter computes with the same aten ops in the same order as a plain GraphModule call, so loss
and gradients while profiling are bit-identical to the FX-only compile.

Note: [A backward's incoming gradients live until it returns]
    The interpreter drops a value from its environment after its last use, as compiled code frees it,
    but a backward graph's incoming gradients (its ``tangents_*`` placeholders) are also held by the
    caller: AOTAutograd's ``CompiledFunction.backward(ctx, *flat_args)`` keeps the tuple it was called
    with until the compiled backward returns, and so does the autograd engine's call into it. So the
    census counts them to the end of the backward, as a measured step sees them. For a model compiled as
    one graph that is the loss's 4-byte gradient; for blocks compiled on their own, each block's
    backward holds the gradient of its output, an activation's size, through its whole backward.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from teraio.graph.capture import CapturedStep, StepAnalysis, analyse_saved, node_module
from teraio.graph.kernel_boundaries import Granularity, Segmentation, offload_ready_idx, plan_fingerprint
from teraio.graph.kernel_memory import KernelMemory
from teraio.graph.ops import offload_token_bytes
from teraio.planner.profile import Profile, make_profile
from teraio.profiling import forward_count
from teraio.profiling.clock import Clock
from teraio.profiling.kernel_memory_step import KernelMemoryStep
from teraio.profiling.transfer_probe import TransferProbe


@dataclass
class GraphRun:
    """One execution of one graph: per-op time (device time on CUDA) and live bytes, aligned with its ops."""

    duration_ns: list[int] = field(default_factory=list)
    live_bytes: list[int] = field(default_factory=list)  # census after each op (values it left alive)
    transient_bytes: list[int] = field(default_factory=list)  # allocated and freed inside each op
    wall_s: float = 0.0
    #: Ran as the graph's own generated code, not op by op: only ``wall_s`` (Note: [Calibrated times]).
    uninstrumented: bool = False
    #: The transfer probe's variant whose round trips it also made, 1-based (Note: [Pricing transfers
    #: under the model's own compute] in teraio.profiling.transfer_probe), 0: none. Its time prices transfers, not the ops.
    probed: int = 0
    #: Ran the compiler's kernels under the torch profiler for their memory timeline (Note: [The budget is
    #: of the graph that runs] in teraio.graph.kernel_memory): neither timed nor censused.
    kernel_memory: bool = False
    #: The process's forward count (teraio.profiling.forward_count) when the forward began: equal to the
    #: count when its backward ended iff no other forward ran in between.
    forwards_at_start: int = -1


_OP_MARK = "teraio::op"


class TimingInterpreter(fx.Interpreter):
    """Runs a GraphModule op by op, recording each op's duration and the bytes live while it ran."""

    def __init__(
        self,
        gm: fx.GraphModule,
        excluded: set[StorageWeakRef],
        census: bool = True,
        device: str = "cpu",
        held: list[torch.Tensor] | None = None,
    ) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.excluded = excluded
        #: Inputs the caller keeps alive for the whole run, counted by the census after their last use
        #: (Note: [A backward's incoming gradients live until it returns]).
        self.held = list(held or [])
        self.census = census
        self.device = device
        self.record = GraphRun()
        self.clock = Clock(device)
        self._marks: list[tuple[Any, Any]] = []  # (start, end) per op, read once the run finished

    def _live_bytes(self, extra: Any) -> int:
        seen: set[StorageWeakRef] = set()
        total = 0
        for v in [*self.env.values(), extra, self.held]:
            for t in tree_leaves(v):
                if isinstance(t, torch.Tensor) and not isinstance(t, torch._subclasses.FakeTensor):
                    st = t.untyped_storage()
                    ref = StorageWeakRef(st)
                    if ref in seen or ref in self.excluded:
                        continue
                    seen.add(ref)
                    total += int(st.nbytes())
        return total

    def boxed_run(self, args_list: list[Any]) -> Any:
        """Run, timing each op and the whole run (``record.duration_ns``, ``record.wall_s``).

        On CUDA the ops' events are read after one wait for the run's last event (Note: [Device time,
        not launch time] in teraio.profiling.clock).
        """
        begin = self.clock.mark()
        out = self._run_with_transients(args_list)
        end = self.clock.mark()
        self.clock.settle(end)
        self.record.duration_ns = [self.clock.elapsed_ns(a, b) for a, b in self._marks]
        self.record.wall_s = self.clock.elapsed_ns(begin, end) / 1e9
        return out

    def _run_with_transients(self, args_list: list[Any]) -> Any:
        """On a census run, also measure each op's internal transients with the torch profiler.

        The profiler is the process's one session (``teraio.profiling.measure``): when another measurement holds
        it, the transients of this run stay unknown (zeros) rather than disturb that measurement.
        """
        if not self.census:
            return super().boxed_run(args_list)
        from teraio.profiling.measure import MemoryRecorder, ProfilerBusyError, op_transient_bytes

        rec = MemoryRecorder("cpu")
        try:
            rec.start(local=True)  # stopped below, before this graph run returns
        except ProfilerBusyError:
            rec = None
        try:
            return super().boxed_run(args_list)
        finally:
            n = len(self.record.live_bytes)
            if rec is not None:
                rec.stop()
                self.record.transient_bytes = op_transient_bytes(rec.events, _OP_MARK, n, self.device)
            else:
                self.record.transient_bytes = [0] * n

    def run_node(self, n: fx.Node) -> Any:
        if n.op != "call_function":
            return super().run_node(n)
        start = self.clock.mark()
        if self.census:
            with torch.profiler.record_function(f"{_OP_MARK}{len(self._marks)}"):
                out = super().run_node(n)
        else:
            out = super().run_node(n)
        self._marks.append((start, self.clock.mark()))
        # Census before the interpreter frees this op's last-used inputs: memory *during* the op. It walks
        # the whole environment, so it runs only on the warm-up step and leaves the timed steps alone.
        if self.census:
            self.record.live_bytes.append(self._live_bytes(out))
        return out


def is_incoming_gradient(node: fx.Node) -> bool:
    """Whether ``node`` is a backward graph's incoming gradient (AOTAutograd names them ``tangents_*``):
    Note: [A backward's incoming gradients live until it returns]."""
    return node.op == "placeholder" and node.name.startswith("tangents")


def incoming_gradients(bw_gm: fx.GraphModule, args_list: list[Any]) -> list[torch.Tensor]:
    """The tensors of ``args_list`` a backward graph takes as its incoming gradients."""
    placeholders = [n for n in bw_gm.graph.nodes if n.op == "placeholder"]
    return [
        a for n, a in zip(placeholders, args_list) if is_incoming_gradient(n) and isinstance(a, torch.Tensor)
    ]


def classify_inputs(args: list[Any]) -> list[str]:
    """'param' for parameters (leaves that require grad), 'input' for everything else."""
    kinds = []
    for a in args:
        is_param = isinstance(a, torch.nn.Parameter) or (
            isinstance(a, torch.Tensor) and a.requires_grad and a.is_leaf
        )
        kinds.append("param" if is_param else "input")
    return kinds


def _run_uninstrumented(
    gm: fx.GraphModule, args_list: list[Any], device: str = "cpu", kernels: Any = None
) -> tuple[Any, float]:
    """Run the graph's own generated code, as the FX-only compile does, or the compiler's ``kernels``
    for it (Note: [Calibrating on the compiler's own code] in teraio.graph.compilers): boxed, so each input
    is freed after its last use (holding every saved tensor to the end makes the step slower).

    On CUDA the device is idle before the clock starts and again before it stops: the wall time is the
    graph's kernels, not earlier queued work nor only their launches.
    """
    run = kernels
    if run is None:
        if not getattr(gm, "_teraio_boxed", False):
            from teraio.graph.compilers import fx_only_compiler

            fx_only_compiler(gm, [])
            gm._teraio_boxed = True  # type: ignore[attr-defined]
        run = gm
    clock = Clock(device)
    clock.synchronize()
    t0 = time.perf_counter()
    out = run(args_list)
    clock.synchronize()
    return out, time.perf_counter() - t0


#: Steps timed op by op before the calibration steps: the census step, then one measured step. More
#: instrumented steps refine only the split of a phase's time between its ops; the calibration steps fix
#: the totals (Note: [Calibrated times]).
INSTRUMENTED_STEPS = 2


def profiling_split(profile_steps: int) -> tuple[int, int]:
    """``profile_steps`` as (instrumented, calibration) steps: from three on, all but two calibrate."""
    if profile_steps >= INSTRUMENTED_STEPS + 1:
        return INSTRUMENTED_STEPS, profile_steps - INSTRUMENTED_STEPS
    return profile_steps, 0


class StepProfiler:
    """Collects per-step timings of one captured graph and builds its Profile.

    ``run_fwd``/``run_bwd`` are the profiling 'compiled' graphs: they interpret and record. The first
    recorded step is warm-up (and takes the memory census) and is excluded when more than one step was
    recorded.

    Note: [Calibrated times]
    Timing op by op costs time of its own: the interpreter's dispatch per op, the clock reads. On small
    ops that overhead dominates (the summed op times can be many times the real step), so a plan
    made from raw op times would expect compute to hide far more I/O than it can. When asked
    (``calibrate_next``), a step runs the partitioned graphs' own generated code, timed only as a whole,
    and the forward's and backward's op durations are scaled so their sums equal the median wall times
    of those steps. One such step is not enough: single steps vary from one to the next on a shared
    machine, and the first uninstrumented steps of a process tend to be the slow ones, so the profile
    takes the median of every calibration step it was given (``profile_steps`` beyond the two timed op
    by op: :func:`profiling_split`).
    """

    def __init__(
        self, step: CapturedStep, graph_id: int = 0, device: str = "cpu", granularity: Granularity = "op"
    ) -> None:
        self.step = step
        self.analysis: StepAnalysis = analyse_saved(step)
        # Note: [Migration ops sit between kernels] in teraio.graph.kernel_boundaries
        self.segmentation = Segmentation.of(self.analysis, granularity)
        self.graph_id = graph_id
        self.device = device
        self.fwd_runs: list[GraphRun] = []  # complete pairs only, aligned with ``bwd_runs``
        self.bwd_runs: list[GraphRun] = []
        self.input_kinds: list[str] | None = None
        self._input_refs: set[StorageWeakRef] = set()
        self._last_fwd: GraphRun | None = None
        self._pending: dict[int, GraphRun] = {}  # invocation id -> its forward's record
        self.calibrate_next = False  # the next forward (and its backward) runs uninstrumented
        #: Set by the runner: the graph's transfer probe, and whether the next calibration step makes
        #: its round trips (Note: [Pricing transfers under the model's own compute] in teraio.profiling.transfer_probe).
        self.probe: TransferProbe | None = None
        self.probe_next = 0  # the probe's variant, 1-based; 0: plain
        self._last_calibration_probed = False
        self.last_backward_calibrated = False  # the backward that just ran was a calibration run
        self._probed_gms: dict[int, tuple[fx.GraphModule, fx.GraphModule]] = {}
        #: The uninstrumented steps, (forward, backward) each (Note: [Calibrated times]).
        self.calibrations: list[tuple[GraphRun, GraphRun]] = []
        #: This graph's share of each calibration step's time outside the graphs (teraio.lifecycle.outside_time).
        self.outside_samples_s: list[float] = []
        #: The compiler's own code for the forward and the backward, when it is not the GraphModule.
        self._kernels: dict[bool, Any] = {}
        #: Note: [The budget is of the graph that runs] in teraio.graph.kernel_memory. Set by the runner: the next
        #: forward (and its backward) runs the kernels under the profiler for their memory timeline.
        self.memory_next = False
        self._memory = KernelMemoryStep(self.analysis, self.segmentation, device)

    @property
    def last_forward_calibrated(self) -> bool:
        """Whether the forward that just ran was a calibration run (uninstrumented)."""
        return self._last_fwd is not None and self._last_fwd.uninstrumented

    @property
    def has_kernels(self) -> bool:
        """Whether the calibration steps run the compiler's kernels, not the GraphModule's own code."""
        return bool(self._kernels)

    def set_kernels(self, kernels: Any, is_backward: bool) -> None:
        """Calibrate on ``kernels`` (Note: [Calibrating on the compiler's own code] in teraio.graph.compilers)."""
        self._kernels[is_backward] = kernels

    def run_fwd(self, args_list: list[Any]) -> Any:
        """Boxed: the interpreter clears ``args_list`` so inputs die as they would in compiled code."""
        if self.input_kinds is None:
            self.input_kinds = classify_inputs(args_list)
        self._input_refs = {
            StorageWeakRef(a.untyped_storage()) for a in args_list if isinstance(a, torch.Tensor)
        }
        forwards_at_start = forward_count.forward_calls()
        if self.memory_next and self.fwd_runs and self._kernels:
            self.memory_next = False
            rec = self._memory.start()
            if rec is not None:
                out = self._memory.run_forward(rec, self._kernels[False], args_list)
                self._last_fwd = GraphRun(uninstrumented=True, kernel_memory=True)
                return out
        if self.calibrate_next and self.fwd_runs:
            self.calibrate_next = False
            probed = self.probe_next if self.probe is not None else 0
            self.probe_next = 0
            gm = self._probed_graphs(probed)[0] if probed else self.step.fw_gm
            out, wall_s = _run_uninstrumented(gm, args_list, self.device, self._kernels.get(False))
            self._last_fwd = GraphRun(wall_s=wall_s, uninstrumented=True, probed=probed)
            self._last_fwd.forwards_at_start = forwards_at_start
            return out
        interp = TimingInterpreter(self.step.fw_gm, self._input_refs, not self.fwd_runs, self.device)
        out = interp.boxed_run(args_list)
        self._last_fwd = interp.record
        self._last_fwd.forwards_at_start = forwards_at_start
        return out

    def bind_last_forward(self, invocation: int, abandoned: bool = False) -> None:
        """Name the forward that just ran by its invocation, so its backward pairs with it."""
        rec, self._last_fwd = self._last_fwd, None
        if rec is not None and rec.kernel_memory and abandoned:
            self.finish_kernel_memory(abandoned=True)
        if rec is not None and not abandoned:
            self._pending[invocation] = rec

    def discard_pending(self) -> None:
        """Drop the forward records still waiting for their backward (profiling is given up)."""
        self._pending.clear()

    def run_bwd(self, args_list: list[Any], invocation: int | None = None) -> Any:
        """Boxed, like ``run_fwd``: saved tensors are freed after their last use, as in compiled code.

        Saved activations arrive as arguments but were allocated in this step: the census counts them.
        Only the storages that existed before the step (the forward's inputs) are excluded. The record
        pairs with its own forward's (``invocation``); a backward whose forward is unknown is not kept.
        """
        fwd = self._pending.pop(invocation, None) if invocation is not None else None
        if fwd is not None and fwd.kernel_memory:
            self.last_backward_calibrated = False
            return self._memory.run_backward(self._kernels[True], args_list)
        self.last_backward_calibrated = fwd is not None and fwd.uninstrumented
        if fwd is not None and fwd.uninstrumented:
            gm = self._probed_graphs(fwd.probed)[1] if fwd.probed else self.step.bw_gm
            out, wall_s = _run_uninstrumented(gm, args_list, self.device, self._kernels.get(True))
            self._observe_alone(fwd)
            self._last_calibration_probed = bool(fwd.probed)
            if self.probe is not None:
                self.probe.record(fwd.probed, fwd.wall_s + wall_s)
            if not fwd.probed:
                self.calibrations.append((fwd, GraphRun(wall_s=wall_s, uninstrumented=True)))
            return out
        census = fwd is not None and not self.bwd_runs
        held = incoming_gradients(self.step.bw_gm, args_list) if census else []
        interp = TimingInterpreter(self.step.bw_gm, self._input_refs, census, self.device, held)
        out = interp.boxed_run(args_list)
        if fwd is not None:
            self._observe_alone(fwd)
        if fwd is not None and (self.fwd_runs or fwd.live_bytes):
            self.fwd_runs.append(fwd)
            self.bwd_runs.append(interp.record)
        return out

    def _observe_alone(self, fwd: GraphRun) -> None:
        """Tell the kernel-memory step whether the step that just ended ran this graph alone (its backward
        ended now, ``fwd`` is its forward's record)."""
        if self._kernels and fwd.forwards_at_start >= 0:
            self._memory.observe(alone=forward_count.forward_calls() == fwd.forwards_at_start)

    # ------------------------------------------------------------ Note: [The budget is of the graph that runs]
    # The measurement itself is a KernelMemoryStep's (teraio.profiling.kernel_memory_step); the runner asks
    # and steers it through the profiler.
    MEMORY_ATTEMPTS = KernelMemoryStep.MEMORY_ATTEMPTS

    @property
    def kernel_memory(self) -> KernelMemory | None:
        """The kernels' measured memory timeline, once measured."""
        return self._memory.timeline

    @property
    def kernel_memory_note(self) -> str | None:
        """Why the kernels' memory is not used (the census is), once that is known; None otherwise."""
        return self._memory.note

    @property
    def kernel_memory_settled(self) -> bool:
        """Whether profiling may end as far as the kernels' memory goes: it was measured, given up, or a
        step that measured it ended and is read when the profile is built."""
        return not self._kernels or self._memory.settled

    @property
    def wants_kernel_memory(self) -> bool:
        """Whether a step should still measure the kernels' memory timeline."""
        return bool(self._kernels) and self._memory.wanted

    def abandon_kernel_memory(self) -> None:
        """Stop a kernel-memory step's recorder without reading it (the backend is closing): the process's
        profiler session and stderr go back to the process."""
        self._memory.abandon()

    @property
    def memory_step_running(self) -> bool:
        """A kernel-memory step's forward ran and its backward has not ended yet."""
        return self._memory.running

    @property
    def kernel_memory_ended(self) -> bool:
        """A kernel-memory step's backward ended; :meth:`finish_kernel_memory` reads it (outside backward)."""
        return self._memory.ended

    def finish_kernel_memory(self, abandoned: bool = False) -> None:
        """Stop a kernel-memory step's recorder (outside backward) and map its timeline onto the segments
        (``KernelMemoryStep.finish``: kept only when the step ran this graph alone)."""
        self._memory.finish(abandoned)

    def add_outside_sample(self, outside_s: float) -> None:
        """The time outside the graphs of the calibration step that just ended (teraio.lifecycle.outside_time). A
        probed step's goes to the probe: the I/O it started can slow the code outside the graphs too."""
        if self.probe is not None:
            self.probe.record_outside(outside_s)
        if not self._last_calibration_probed:
            self.outside_samples_s.append(outside_s)

    def _probed_graphs(self, variant: int) -> tuple[fx.GraphModule, fx.GraphModule]:
        if variant not in self._probed_gms:
            assert self.probe is not None
            self._probed_gms[variant] = self.probe.probed(self.step.fw_gm, self.step.bw_gm, variant)
        return self._probed_gms[variant]

    def record_step(self, fwd: GraphRun, bwd: GraphRun) -> None:
        """Record one step's forward and backward that ran elsewhere (``teraio.tools.estimate`` builds them from
        a cost model and a static census); the first recorded step also gives the memory timeline."""
        if len(fwd.duration_ns) != len(self.analysis.fw_ops) or len(bwd.duration_ns) != len(
            self.analysis.bw_ops
        ):
            raise ValueError(
                f"record_step: {len(fwd.duration_ns)} forward and {len(bwd.duration_ns)} backward op times "
                f"for a graph of {len(self.analysis.fw_ops)} and {len(self.analysis.bw_ops)} ops"
            )
        self.fwd_runs.append(fwd)
        self.bwd_runs.append(bwd)

    @property
    def steps_recorded(self) -> int:
        return len(self.bwd_runs)

    @property
    def steps_calibrated(self) -> int:
        return len(self.calibrations)

    def calibrated_wall_s(self) -> tuple[float, float] | None:
        """Median forward and backward wall seconds of the calibration steps (None without any)."""
        if not self.calibrations:
            return None
        return (
            statistics.median(f.wall_s for f, _ in self.calibrations),
            statistics.median(b.wall_s for _, b in self.calibrations),
        )

    def _measured(self, runs: list[GraphRun]) -> list[GraphRun]:
        n = self.steps_recorded
        runs = runs[:n]
        return runs[1:] if n > 1 else runs

    def _tensor_rows(
        self, durations: list[float], params: frozenset[int]
    ) -> tuple[list[dict[str, Any]], list[int]]:
        """The Profile's ``tensors`` table, one row per saved storage with its uses by segment index, and
        the bytes of saved activations alive at each segment (the rest of a segment's memory is
        ``other_bytes``). ``params``: the forward placeholders that are parameters."""
        from teraio.graph.recompute import recipes, recompute_columns

        a = self.analysis
        seg = self.segmentation
        at = seg.segment_of
        # How each saved activation could be rebuilt in backward (teraio.graph.recompute), at profiled cost.
        rebuild = recompute_columns(a, recipes(self.step, a, params), durations)
        kinds = self.input_kinds or []
        fw_placeholders = [n for n in self.step.fw_gm.graph.nodes if n.op == "placeholder"]
        tensor_rows = []
        activation_alive = [0] * seg.num_total
        for g in a.groups:
            if g.placeholder is not None:
                pos = fw_placeholders.index(g.placeholder)
                kind = kinds[pos] if pos < len(kinds) else "input"
            else:
                kind = "activation"
            offloadable = kind == "activation" and g.nbytes > 0 and g.owner_covers_storage
            # Note: [Saved views of fused values] in teraio.graph.kernel_boundaries
            ready = offload_ready_idx(a, self.step.saved_nodes, g, seg.granularity)
            producer, last_use = at(ready), at(g.last_use_idx)
            tensor_rows.append(
                {
                    "name": g.name,
                    "nbytes": g.nbytes,
                    "dtype": str(g.dtype).removeprefix("torch."),
                    "shape": g.shape,
                    "kind": kind,
                    "offloadable": offloadable,
                    "producer_idx": producer,
                    "last_fwd_use_idx": at(g.last_fwd_use_idx),
                    "first_bwd_use_idx": at(g.first_bwd_use_idx),
                    "last_use_idx": last_use,
                    "module": g.module,
                    "aliases": len(g.members),
                    **rebuild[g.name],
                }
            )
            if kind == "activation":
                for i in range(max(producer, 0), last_use + 1):
                    activation_alive[i] += g.nbytes
        return tensor_rows, activation_alive

    def build_profile(self, extra_meta: dict[str, Any] | None = None) -> Profile:
        """The Profile of the recorded steps (median op durations over the measured steps)."""
        if self.steps_recorded == 0:
            raise RuntimeError("no complete forward+backward step was recorded")
        a = self.analysis
        fwd, bwd = self._measured(self.fwd_runs), self._measured(self.bwd_runs)
        fwd_us = [statistics.median(r.duration_ns[i] for r in fwd) / 1e3 for i in range(len(a.fw_ops))]
        bwd_us = [statistics.median(r.duration_ns[i] for r in bwd) / 1e3 for i in range(len(a.bw_ops))]
        scales = {"fwd": 1.0, "bwd": 1.0}
        calibrated = self.calibrated_wall_s()
        if calibrated is not None:  # Note: [Calibrated times]
            for phase, us, wall_s in (("fwd", fwd_us, calibrated[0]), ("bwd", bwd_us, calibrated[1])):
                if sum(us) > 0:
                    scales[phase] = min(1.0, wall_s * 1e6 / sum(us))
            fwd_us = [d * scales["fwd"] for d in fwd_us]
            bwd_us = [d * scales["bwd"] for d in bwd_us]
        durations = fwd_us + bwd_us
        ops_of = [*a.fw_ops, *a.bw_ops]
        # Memory is deterministic: the census of the first step is the step's memory timeline, each op
        # with what it allocates and frees inside itself on top.
        live = [
            int(b) + int(t)
            for run in (self.fwd_runs[0], self.bwd_runs[0])
            for b, t in zip(run.live_bytes, run.transient_bytes or [0] * len(run.live_bytes))
        ]
        # Rows per segment (one op each on the FX-only path): durations add up, memory is the segment's
        # highest, and every index counts segments.
        seg = self.segmentation
        num_fwd = seg.num_fwd
        ops_nodes = [
            ("fwd" if i < num_fwd else "bwd", ops_of[seg.members(i)[-1]]) for i in range(seg.num_total)
        ]
        seg_duration = [sum(durations[j] for j in seg.members(i)) for i in range(seg.num_total)]
        seg_live = [max(live[j] for j in seg.members(i)) for i in range(seg.num_total)]
        after_fwd = int(self.fwd_runs[0].live_bytes[-1]) if self.fwd_runs[0].live_bytes else 0
        kmem = self.kernel_memory
        if kmem is not None and len(kmem.segment_live_bytes) != seg.num_total:
            self._memory.note = f"the kernels' timeline has {len(kmem.segment_live_bytes)} segments, the graph {seg.num_total}"
            kmem = None
        if kmem is not None:  # Note: [The budget is of the graph that runs] in teraio.graph.kernel_memory
            seg_live = list(kmem.segment_live_bytes)
            after_fwd = kmem.after_fwd_bytes

        params = frozenset(i for i, kind in enumerate(self.input_kinds or []) if kind == "param")
        tensor_rows, activation_alive = self._tensor_rows(durations, params)
        ops_rows = [
            {
                "idx": i,
                "name": n.name,
                "target": str(n.target),
                "phase": phase,
                "duration_us": float(seg_duration[i]),
                "module": node_module(n),
                "other_bytes": max(0, int(seg_live[i]) - activation_alive[i]),
            }
            for i, (phase, n) in enumerate(ops_nodes)
        ]
        fwd_s = statistics.median(r.wall_s for r in fwd)
        bwd_s = statistics.median(r.wall_s for r in bwd)
        if calibrated is not None:
            fwd_s, bwd_s = calibrated
        outside_s = statistics.median(self.outside_samples_s) if self.outside_samples_s else 0.0
        meta = {
            "fingerprint": plan_fingerprint(a, seg.granularity),
            "graph_fingerprint": a.fingerprint,
            "granularity": seg.granularity,
            "graph_id": self.graph_id,
            "num_fwd_ops": num_fwd,
            "num_saved_outputs": len(self.step.saved_nodes),
            "torch_version": torch.__version__,
            "device": self.device,
            "step_s": fwd_s + bwd_s,
            "fwd_s": fwd_s,
            "bwd_s": bwd_s,
            "op_sum_s": sum(durations) / 1e6,
            "calibration_scale_fwd": scales["fwd"],
            "calibration_scale_bwd": scales["bwd"],
            "calibrated": calibrated is not None,
            # What the calibration steps ran: the compiler's kernels or the GraphModule itself (Note:
            # [Calibrating on the compiler's own code] in teraio.graph.compilers).
            "calibrated_on": ("kernels" if self._kernels else "graph") if calibrated is not None else None,
            "calibration_steps": self.steps_calibrated,
            # Per calibration step, forward+backward: how much single steps varied.
            "calibration_step_s": [f.wall_s + b.wall_s for f, b in self.calibrations],
            # Note: [Time outside the graphs] in teraio.planner.lifetimes. On CPU the host's wrappers and
            # the autograd engine hold the thread that computes; on an accelerator they overlap its queue,
            # so there the figure is only reported (``outside_host_s``) and the timeline leaves it out.
            "outside_s": outside_s if self.device == "cpu" else 0.0,
            "outside_host_s": outside_s,
            "outside_steps": len(self.outside_samples_s),
            "profile_steps": self.steps_recorded,
            "measured_steps": len(fwd),
            "census_peak_bytes": int(max(seg_live)) if seg_live else 0,
            # Note: [An offloaded tensor leaves a token] in planner.lifetimes
            "offload_token_bytes": offload_token_bytes(self.device),
            # Where the memory timeline came from: the compiler's kernels run under the profiler, or the
            # census of the graph run op by op (and why not the kernels, when they ran).
            "memory_from": "kernels" if kmem is not None else "census",
            "memory_note": self.kernel_memory_note,
            # Which forward placeholders are parameters (the rewrite may save them for a rebuild).
            "param_positions": sorted(params),
            "census_after_fwd_bytes": after_fwd,
            "created_unix_s": time.time(),
        }
        meta.update(extra_meta or {})
        return make_profile(ops_rows, tensor_rows, meta)
