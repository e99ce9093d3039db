"""Lifetime analysis: when each saved tensor is needed, when it could be away, and what memory that leaves.

The planner needs, for one captured step: the unplanned memory at every op (and its peak), the tensors
that may be offloaded (the *candidates*) with the interval in which each sits idle between its last
forward use and its first backward use, and the smallest peak any plan could reach (every candidate away
over its whole idle interval). :func:`analyse` derives all of this from a networkx graph of the step:
op nodes chained in execution order, tensor nodes with an edge from their producer and to each of their
uses, so the lifetimes come from the graph's structure and a malformed profile (a use before the
producer, a cycle) is caught as a graph error rather than a silent wrong answer.

Memory is counted per op, as the step's own allocations: an activation counts during op ``i`` when it
is alive at ``i`` (``producer_idx <= i <= last_use_idx``), plus the op's ``other_bytes``. Params and graph
inputs existed before the step and outlive it; they are not the step's memory and are not counted
(the same convention as the measured peak: bytes allocated during the step, docs/measured_facts.md). A moved tensor is absent over ``[wait_before_idx, prefetch_before_idx)``: whether a plan
meets a budget depends only on those positions, never on bandwidth (bandwidth decides stall).

Recompute (``planner.execution``'s model): a recomputed tensor is absent over ``[wait_before_idx,
fetch_before_idx)``; the inputs its rebuild reads may live longer than the profile says (their effective
last use), and the rebuilds before op ``i`` add their largest ``recompute_peak_bytes`` to op ``i``.
:meth:`Lifetimes.with_recompute` turns a chosen set of recomputed tensors into a plain offload problem
over the remaining candidates (the *residual* step), which every offload solver plans unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import networkx as nx
import numpy as np
import pandas as pd

from teraio.planner.execution import Candidate, EffectiveNeeds, TensorUse, effective_needs, rebuild_time
from teraio.planner.plan import Decision
from teraio.planner.profile import Profile, ProfileError, recompute_inputs_of

# Note: [An offloaded tensor leaves a token]
#     teraio's rewritten graph moves a saved tensor with four ops (teraio.graph.ops) that hand a small
#     tensor from one to the next: the offload's handle, the wait's token (saved for backward), the
#     prefetch's token. One of them is alive from the op after the offload to the fetch, so an offloaded
#     tensor holds the profile's ``offload_token_bytes`` (meta; 0 when absent) over
#     ``[offload_after_idx + 1, fetch_before_idx)``; a recomputed one holds nothing. Left out, they put
#     measured peaks above their prediction, and above a budget planned to the byte: the tiny GPT on the
#     FX path at 50% measured 104-144 bytes over its prediction, exactly the tokens alive at its peak op,
#     and two HF models' moving plans ended 36-84 bytes over their budgets. The solvers plan without them,
#     within the budget less :attr:`Lifetimes.token_reserve_bytes` (one token per candidate, and one more
#     for the instant a wait or a prefetch holds the token it takes and the one it returns); a plan's
#     predicted figures count each token where it lives (``memory_with(..., tokens=True)``), so they stay
#     exact and the budget holds.

#: Columns of :attr:`Lifetimes.candidates`.
CANDIDATE_COLUMNS = (
    "name",
    "nbytes",
    "producer_idx",
    "last_fwd_use_idx",
    "first_bwd_use_idx",
    "last_use_idx",
    "module",
    "earliest_wait_idx",  # the earliest op before which the write may be waited (last_fwd_use_idx + 1)
    "latest_prefetch_idx",  # the latest op before which the read may start (first_bwd_use_idx)
    "inactive_start_idx",  # first op at which the tensor may be absent
    "inactive_end_idx",  # last op at which the tensor may be absent (inclusive)
    "inactive_us",  # nominal time from the end of the last forward use to the start of the first bwd use
    "recompute_us",  # compute time to rebuild it in backward; NaN: cannot be recomputed
    "recompute_inputs",  # rows its rebuild reads
    "recompute_peak_bytes",  # bytes the rebuild holds beyond its inputs and its result
)


@dataclass(frozen=True)
class Lifetimes:
    """What :func:`analyse` found. Arrays are indexed by op index; times are nominal (no stall)."""

    num_ops: int
    num_fwd_ops: int
    op_names: tuple[str, ...]
    duration_us: np.ndarray
    #: Nominal start of each op (cumulative durations, no stall, no I/O interference).
    op_start_us: np.ndarray
    #: The unplanned memory during each op.
    baseline_memory_bytes: np.ndarray
    baseline_peak_bytes: int
    baseline_peak_idx: int
    #: One row per offload candidate, in profile order; columns :data:`CANDIDATE_COLUMNS`.
    candidates: pd.DataFrame
    #: Memory during each op with every candidate away over its whole idle interval.
    min_memory_bytes: np.ndarray
    min_feasible_peak_bytes: int
    #: The step as a graph: nodes ("op", idx) and ("tensor", name); see the module docstring.
    graph: nx.DiGraph = field(repr=False)
    #: Every activation row by name: what chains of rebuilds need to know (``planner.execution``).
    tensor_uses: dict[str, TensorUse] = field(default_factory=dict, repr=False)
    #: In a residual step (:meth:`with_recompute`): the step it was made from, and its recompute decisions.
    base: Lifetimes | None = field(default=None, repr=False)
    recompute_decisions: tuple[Decision, ...] = ()
    #: What each offloaded tensor's tokens hold (Note: [An offloaded tensor leaves a token]).
    token_bytes: int = 0

    @property
    def op_end_us(self) -> np.ndarray:
        return self.op_start_us + self.duration_us

    @property
    def compute_s(self) -> float:
        return float(self.duration_us.sum()) / 1e6

    @property
    def candidate_bytes(self) -> int:
        return int(self.candidates["nbytes"].sum())

    @property
    def token_reserve_bytes(self) -> int:
        """The most the tokens of any plan's offloads hold at once (Note: [An offloaded tensor leaves a
        token]): one per candidate and one for a migration op's instant; 0 without candidates."""
        return self.token_bytes * (len(self.candidates) + 1) if len(self.candidates) else 0

    @property
    def smallest_peak_bytes(self) -> int:
        """The smallest peak a budget may ask: every candidate away over its whole idle interval, with room
        for their tokens (Note: [An offloaded tensor leaves a token]), or the unplanned peak when that is
        no more (a plan that moves nothing leaves no token)."""
        return min(self.baseline_peak_bytes, self.min_feasible_peak_bytes + self.token_reserve_bytes)

    def token_bytes_with(self, decisions: list[Decision] | tuple[Decision, ...]) -> np.ndarray:
        """The bytes the offloads' tokens hold during each op (Note: [An offloaded tensor leaves a token])."""
        n = self.num_ops
        delta = np.zeros(n + 1, dtype=np.int64)
        for d in decisions:
            if d.action == "offload" and self.token_bytes:
                lo, hi = max(0, d.offload_after_idx + 1), min(max(d.fetch_before_idx, 0), n)
                if hi > lo:
                    delta[lo] += self.token_bytes
                    delta[hi] -= self.token_bytes
        return np.cumsum(delta)[:n]

    def op_name(self, idx: int) -> str:
        """The op's name; index ``num_ops`` (possible only without a backward) is "<end>"."""
        return self.op_names[idx] if 0 <= idx < self.num_ops else "<end>"

    @property
    def candidate_list(self) -> tuple[Candidate, ...]:
        """The candidates as :class:`~planner.execution.Candidate` records, in profile order (what the
        solvers and the simulator work with; the ``candidates`` table is for people and plots)."""
        cache = self.__dict__.get("_candidate_list")
        if cache is None:
            cache = tuple(
                Candidate(
                    name=str(r.name),
                    nbytes=int(r.nbytes),
                    producer_idx=int(r.producer_idx),
                    last_fwd_use_idx=int(r.last_fwd_use_idx),
                    first_bwd_use_idx=int(r.first_bwd_use_idx),
                    last_use_idx=int(r.last_use_idx),
                    module=str(r.module),
                    recompute_us=float(r.recompute_us),
                    recompute_inputs=tuple(r.recompute_inputs),
                    recompute_peak_bytes=int(r.recompute_peak_bytes),
                )
                for r in self.candidates.itertuples(index=False)
            )
            object.__setattr__(self, "_candidate_list", cache)
        return cache

    def candidate_of(self, name: str) -> Candidate:
        """The :class:`~planner.execution.Candidate` for tensor ``name`` (KeyError when it is none)."""
        return self.candidate_list[self._by_name[name]]

    @property
    def _by_name(self) -> dict[str, int]:
        cache = self.__dict__.get("_by_name_cache")
        if cache is None:
            cache = {str(n): i for i, n in enumerate(self.candidates["name"])}
            object.__setattr__(self, "_by_name_cache", cache)
        return cache

    def is_candidate(self, name: str) -> bool:
        return name in self._by_name

    def decision(
        self,
        name: str,
        *,
        tier: str = "ssd",
        offload_after_idx: int | None = None,
        wait_before_idx: int | None = None,
        prefetch_before_idx: int | None = None,
        fetch_before_idx: int | None = None,
    ) -> Decision:
        """A Decision for candidate ``name`` with op names filled in.

        Defaults put the tensor away as long as possible: write issued after the producer, waited
        right after the last forward use, read issued and fetched before the first backward use.
        """
        c = self.candidate_of(name)
        off = c.producer_idx if offload_after_idx is None else int(offload_after_idx)
        wait = c.inactive_start_idx if wait_before_idx is None else int(wait_before_idx)
        fetch = c.first_bwd_use_idx if fetch_before_idx is None else int(fetch_before_idx)
        pre = fetch if prefetch_before_idx is None else int(prefetch_before_idx)
        return Decision(
            name=str(name),
            tier=tier,
            nbytes=c.nbytes,
            offload_after_idx=off,
            offload_after_name=self.op_name(off),
            wait_before_idx=wait,
            wait_before_name=self.op_name(wait),
            prefetch_before_idx=pre,
            prefetch_before_name=self.op_name(pre),
            fetch_before_idx=fetch,
            fetch_before_name=self.op_name(fetch),
            module=c.module,
        )

    @property
    def recomputable(self) -> tuple[Candidate, ...]:
        """The candidates that can be recomputed (a finite ``recompute_us``), in profile order."""
        return tuple(c for c in self.candidate_list if c.recomputable)

    def effective_needs(self, recomputed: Iterable[str]) -> EffectiveNeeds:
        """:func:`planner.execution.effective_needs` of the named candidates (names that are no recomputable
        candidate are ignored)."""
        cands = [self.candidate_of(n) for n in recomputed if self.is_candidate(n)]
        return effective_needs([c for c in cands if c.recomputable], self.tensor_uses)

    def recompute_decision(
        self, name: str, needs: EffectiveNeeds, *, wait_before_idx: int | None = None
    ) -> Decision:
        """A recompute Decision for candidate ``name``: dropped after its last forward use (by default),
        rebuilt before its effective first backward need in ``needs``."""
        c = self.candidate_of(name)
        wait = c.inactive_start_idx if wait_before_idx is None else int(wait_before_idx)
        at = needs.first_need_idx[name]
        return Decision(
            name=str(name),
            tier="",
            nbytes=c.nbytes,
            offload_after_idx=-1,
            offload_after_name="",
            wait_before_idx=wait,
            wait_before_name=self.op_name(wait),
            prefetch_before_idx=at,
            prefetch_before_name=self.op_name(at),
            fetch_before_idx=at,
            fetch_before_name=self.op_name(at),
            module=c.module,
            action="recompute",
            recompute_us=float(c.recompute_us),
        )

    def memory_with(
        self, decisions: list[Decision] | tuple[Decision, ...], *, tokens: bool = False
    ) -> np.ndarray:
        """Memory during each op when ``decisions`` are applied (positions only; no validity checks).

        A tensor is absent over ``[wait_before_idx, prefetch_before_idx)``; recompute decisions also extend
        the lifetimes of their inputs and add their rebuilds' intermediates (``planner.execution``).
        ``tokens``: count the offloads' tokens too (the plan's prediction; the solvers' view leaves them
        to the reserve: Note: [An offloaded tensor leaves a token]).
        """
        n = self.num_ops
        delta = np.zeros(n + 1, dtype=np.int64)
        for d in decisions:
            lo, hi = d.wait_before_idx, d.prefetch_before_idx
            if hi > lo:
                delta[lo] -= d.nbytes
                delta[hi] += d.nbytes
        extra = np.zeros(n, dtype=np.int64)
        rebuilt = [d for d in decisions if d.action == "recompute"]
        if rebuilt:
            needs = self.effective_needs(d.name for d in rebuilt)
            for x, last in needs.last_use_idx.items():
                u = self.tensor_uses[x]
                delta[u.last_use_idx + 1] += u.nbytes
                delta[min(last, n - 1) + 1] -= u.nbytes
            for d in rebuilt:
                if self.is_candidate(d.name) and 0 <= d.fetch_before_idx < n:
                    peak = self.candidate_of(d.name).recompute_peak_bytes
                    extra[d.fetch_before_idx] = max(extra[d.fetch_before_idx], peak)
        memory = self.baseline_memory_bytes + np.cumsum(delta)[:n] + extra
        return memory + self.token_bytes_with(decisions) if tokens else memory

    def with_recompute(self, recomputed: Iterable[str]) -> Lifetimes:
        """The residual step once ``recomputed`` are rebuilt in backward: a plain offload problem whose
        offload plans, joined with :attr:`recompute_decisions`, are plans of this step with the same
        memory and the same replayed times.

        - op durations include the rebuilds before each op (the same compute window, ``execution``);
        - the unplanned memory is this step's with the recompute decisions applied (dropped after the last
          forward use, inputs extended, intermediates added);
        - the candidates are the others, each with its effective first backward need and last use (a
          candidate whose idle interval vanishes is none); none of them can be recomputed.

        Raises:
            ValueError: a name is no recomputable candidate, or rebuilds need each other (a cycle).
        """
        names = list(dict.fromkeys(recomputed))
        for name in names:
            if not self.is_candidate(name) or not self.candidate_of(name).recomputable:
                raise ValueError(f"'{name}' cannot be recomputed (no recomputable candidate)")
        needs = self.effective_needs(names)
        if needs.cycle:
            raise ValueError(f"rebuilds of {', '.join(needs.cycle)} need each other")
        decisions = tuple(self.recompute_decision(name, needs) for name in needs.order)
        rebuild = rebuild_time(decisions, self.num_ops)
        duration = self.duration_us + rebuild
        op_start = np.concatenate([[0.0], np.cumsum(duration)[:-1]]) if self.num_ops else np.zeros(0)
        baseline = self.memory_with(decisions)
        gone = set(names)
        cands = []
        for c in self.candidate_list:
            if c.name in gone:
                continue
            first = needs.first_need_idx.get(c.name, c.first_bwd_use_idx)
            if first - c.last_fwd_use_idx < 2:
                continue  # needed again right after its last forward use: never idle
            cands.append(
                dataclasses.replace(
                    c,
                    first_bwd_use_idx=first,
                    last_use_idx=needs.last_use_idx.get(c.name, c.last_use_idx),
                    recompute_us=math.nan,
                    recompute_inputs=(),
                    recompute_peak_bytes=0,
                )
            )
        frame, away = _candidate_frame(cands, op_start, duration, self.num_ops)
        min_memory = baseline - away
        peak_idx = int(np.argmax(baseline)) if self.num_ops else 0
        return dataclasses.replace(
            self,
            duration_us=duration,
            op_start_us=op_start,
            baseline_memory_bytes=baseline,
            baseline_peak_bytes=int(baseline[peak_idx]) if self.num_ops else self.baseline_peak_bytes,
            baseline_peak_idx=peak_idx,
            candidates=frame,
            min_memory_bytes=min_memory,
            min_feasible_peak_bytes=int(min_memory.max()) if self.num_ops else 0,
            tensor_uses={},
            base=self,
            recompute_decisions=decisions,
        )


def _candidate_frame(
    cands: list[Candidate], op_start_us: np.ndarray, duration_us: np.ndarray, n: int
) -> tuple[pd.DataFrame, np.ndarray]:
    """The ``candidates`` table of ``cands`` and the bytes they free at each op when all are away."""
    away_delta = np.zeros(n + 1, dtype=np.int64)
    rows = []
    for c in cands:
        start, end = c.last_fwd_use_idx + 1, c.first_bwd_use_idx - 1
        away_delta[start] += c.nbytes
        away_delta[end + 1] -= c.nbytes
        rows.append(
            {
                "name": c.name,
                "nbytes": c.nbytes,
                "producer_idx": c.producer_idx,
                "last_fwd_use_idx": c.last_fwd_use_idx,
                "first_bwd_use_idx": c.first_bwd_use_idx,
                "last_use_idx": c.last_use_idx,
                "module": c.module,
                "earliest_wait_idx": start,
                "latest_prefetch_idx": c.first_bwd_use_idx,
                "inactive_start_idx": start,
                "inactive_end_idx": end,
                "inactive_us": float(
                    op_start_us[c.first_bwd_use_idx]
                    - (op_start_us[c.last_fwd_use_idx] + duration_us[c.last_fwd_use_idx])
                ),
                "recompute_us": c.recompute_us,
                "recompute_inputs": c.recompute_inputs,
                "recompute_peak_bytes": c.recompute_peak_bytes,
            }
        )
    frame = pd.DataFrame(rows, columns=list(CANDIDATE_COLUMNS))
    for col in CANDIDATE_COLUMNS:
        if col.endswith("_idx") or col in ("nbytes", "recompute_peak_bytes"):
            frame[col] = frame[col].astype("int64")
    frame["recompute_us"] = frame["recompute_us"].astype("float64")
    return frame, np.cumsum(away_delta)[:n]


def build_graph(profile: Profile) -> nx.DiGraph:
    """The step as a DAG: ops chained in order; producer -> tensor -> each recorded use.

    Params and inputs (``producer_idx == -1``) hang off a single ("input",) node.
    """
    g = nx.DiGraph()
    ops = profile.ops
    nf = profile.num_fwd_ops
    names = ops["name"].astype(str).tolist()
    for i, name in enumerate(names):
        g.add_node(
            ("op", i),
            name=name,
            phase="fwd" if i < nf else "bwd",
            duration_us=float(ops["duration_us"].iat[i]),
        )
        if i:
            g.add_edge(("op", i - 1), ("op", i), kind="order")
    g.add_node(("input",))
    if names:
        g.add_edge(("input",), ("op", 0), kind="order")
    t = profile.tensors
    cols = {
        c: t[c].to_numpy() for c in ("producer_idx", "last_fwd_use_idx", "first_bwd_use_idx", "last_use_idx")
    }
    for k, (name, nbytes, kind) in enumerate(zip(t["name"], t["nbytes"], t["kind"])):
        node = ("tensor", str(name))
        g.add_node(node, nbytes=int(nbytes), kind=str(kind), row=k)
        prod = int(cols["producer_idx"][k])
        g.add_edge(("input",) if prod < 0 else ("op", prod), node, kind="produces")
        for col, role in (
            ("last_fwd_use_idx", "last_fwd_use"),
            ("first_bwd_use_idx", "first_bwd_use"),
            ("last_use_idx", "last_use"),
        ):
            use = int(cols[col][k])
            # A "use" at the producer itself means "no later use": an edge would make a self-loop cycle.
            if use >= 0 and use != prod:
                if g.has_edge(node, ("op", use)):
                    g.edges[node, ("op", use)]["roles"].append(role)
                else:
                    g.add_edge(node, ("op", use), kind="uses", roles=[role])
    return g


def _uses_by_role(g: nx.DiGraph, node: tuple) -> dict[str, int]:
    out: dict[str, int] = {}
    for _, op, data in g.out_edges(node, data=True):
        for role in data["roles"]:
            out[role] = op[1]
    return out


def analyse(profile: Profile) -> Lifetimes:
    """Lifetime analysis of one step (see the module docstring).

    Note: [Time outside the graphs]
    A step as the user times it is more than its graphs' ops: the compiled function's wrappers around
    the forward and the backward, the code between them (``loss.backward()``, the autograd engine
    starting) and the engine's work after them (gradient accumulation). On a small model that is a
    quarter of the step. The profile measures it as ``outside_s`` and the timeline charges it to the
    compute thread at the boundary between forward and backward, where most of it happens (so
    transfers in flight overlap it, as they do in the running step). ``duration_us`` below includes
    it; the profile's ops table does not.

    Raises:
        ProfileError: the step's graph has a cycle (a tensor used before it is produced).
    """
    g = build_graph(profile)
    if not nx.is_directed_acyclic_graph(g):
        cycle = nx.find_cycle(g)
        raise ProfileError(
            f"profile: a tensor is used before it is produced (graph cycle through {cycle[0][0]})"
        )
    n = len(profile.ops)
    nf = profile.num_fwd_ops
    duration_us = profile.ops["duration_us"].to_numpy(dtype=np.float64)
    if n and profile.outside_s > 0:
        # Note: [Time outside the graphs]
        duration_us = duration_us.copy()
        duration_us[max(nf - 1, 0)] += profile.outside_s * 1e6
    op_start_us = np.concatenate([[0.0], np.cumsum(duration_us)[:-1]]) if n else np.zeros(0)
    if "other_bytes" in profile.ops.columns:
        other = profile.ops["other_bytes"].fillna(0).to_numpy(dtype=np.int64)
    else:
        other = np.zeros(n, dtype=np.int64)

    # Alive intervals as a difference array: +nbytes at the first op, -nbytes after the last.
    alive_delta = np.zeros(n + 1, dtype=np.int64)
    t = profile.tensors
    modules = t["module"] if "module" in t.columns else None
    rec_us = t["recompute_us"].to_numpy(dtype=np.float64) if "recompute_us" in t.columns else None
    rec_in = t["recompute_inputs"] if "recompute_inputs" in t.columns else None
    rec_peak = t["recompute_peak_bytes"] if "recompute_peak_bytes" in t.columns else None
    cands: list[Candidate] = []
    uses_by_name: dict[str, TensorUse] = {}
    for k, (name, offloadable) in enumerate(zip(t["name"], t["offloadable"])):
        node = ("tensor", str(name))
        data = g.nodes[node]
        nbytes = data["nbytes"]
        (pred,) = g.predecessors(node)
        uses = _uses_by_role(g, node)
        if data["kind"] != "activation" or pred == ("input",):
            lo, hi = 0, n - 1  # params and graph inputs live for the whole step
        else:
            lo = pred[1]
            hi = max([lo, *uses.values()])
        if n and data["kind"] == "activation":
            alive_delta[lo] += nbytes
            alive_delta[hi + 1] -= nbytes
        last_fwd = uses.get("last_fwd_use", lo)
        first_bwd = uses.get("first_bwd_use", -1)
        if data["kind"] == "activation" and pred != ("input",):
            uses_by_name[str(name)] = TensorUse(int(nbytes), int(lo), int(first_bwd), int(hi))
        # A candidate must be offloadable, read again in backward, and idle for at least one op.
        if not (offloadable and nbytes > 0 and first_bwd >= nf and first_bwd - last_fwd >= 2):
            continue
        cands.append(
            Candidate(
                name=str(name),
                nbytes=int(nbytes),
                producer_idx=int(lo),
                last_fwd_use_idx=int(last_fwd),
                first_bwd_use_idx=int(first_bwd),
                last_use_idx=int(hi),
                module=str(modules.iat[k]) if modules is not None and modules.iat[k] is not None else "",
                recompute_us=float(rec_us[k]) if rec_us is not None else math.nan,
                recompute_inputs=(recompute_inputs_of(rec_in.iat[k]) or ()) if rec_in is not None else (),
                recompute_peak_bytes=int(rec_peak.iat[k]) if rec_peak is not None else 0,
            )
        )
    baseline = other + np.cumsum(alive_delta)[:n]
    candidates, away = _candidate_frame(cands, op_start_us, duration_us, n)
    min_memory = baseline - away
    peak_idx = int(np.argmax(baseline)) if n else 0
    names = tuple(profile.ops["name"].astype(str).tolist())
    return Lifetimes(
        num_ops=n,
        num_fwd_ops=nf,
        op_names=names,
        duration_us=duration_us,
        op_start_us=op_start_us,
        baseline_memory_bytes=baseline,
        baseline_peak_bytes=int(baseline[peak_idx]) if n else int(other.sum()),
        baseline_peak_idx=peak_idx,
        candidates=candidates,
        min_memory_bytes=min_memory,
        min_feasible_peak_bytes=int(min_memory.max()) if n else 0,
        graph=g,
        tensor_uses=uses_by_name,
        token_bytes=int(profile.meta.get("offload_token_bytes", 0)),
    )
