"""Pricing a transfer under the model's own compute (Note: [Pricing transfers under the model's own
compute] in teraio.profiling.transfer_probe): the probed graphs, the paired estimate, and a backend that probes while
training stays bit-identical."""

from __future__ import annotations

import pytest
import torch
from torch import fx

import teraio.lifecycle.runner_profiling
import teraio.profiling.disk_calibration
from teraio.graph.ops import register_engine, unregister_engine
from teraio.lifecycle.backend import TeraioBackend
from teraio.planner.hardware import HardwareModel
from teraio.profiling.transfer_probe import (
    BYTES_PAGE_NBYTES,
    MAX_ROUND_TRIPS,
    MIN_ROUND_TRIPS,
    PROBE_PAIRS,
    PROBE_STEPS,
    ProbeOp,
    ProbeStep,
    ProbeVariant,
    TransferProbe,
    probe_hook,
    probe_variants,
    round_trips_for,
)
from teraio.runtime.errors import DiskIOError

from .loops import CASES, assert_bit_identical, run


def _mlp_graph() -> fx.GraphModule:
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        for _ in range(6):
            x = torch.tanh(x @ w)
        return x.sum()

    return fx.symbolic_trace(f)


def _hooks(gm: fx.GraphModule) -> list[tuple[int, int]]:
    return [(n.args[1], n.args[2]) for n in gm.graph.nodes if n.target is probe_hook]


def _positions(gm: fx.GraphModule, op: ProbeOp) -> list[int]:
    """Where the hooks doing ``op`` sit among the graph's calls."""
    order = [n for n in gm.graph.nodes if n.op == "call_function"]
    return [k for k, n in enumerate(order) if n.target is probe_hook and n.args[1] == op]


def test_probed_graph_computes_the_same_and_spreads_its_round_trips() -> None:
    gm = _mlp_graph()
    probe = TransferProbe(engine_id=0, variants=probe_variants(4))
    try:
        fw, bw = probe.probed(gm, gm, 2)  # four round trips of small pages, each waited half a slot later
        assert _hooks(fw) == [(op, i) for i in range(4) for op in (ProbeOp.OFFLOAD, ProbeOp.WAIT)], (
            "each offload comes before its wait, the round trips in order"
        )
        assert [op for op, _ in _hooks(bw)] == [ProbeOp.PREFETCH, ProbeOp.FETCH] * 4
        # Spread over the graph: compute nodes between consecutive offloads, not all at the start.
        offloads = _positions(fw, ProbeOp.OFFLOAD)
        assert all(b - a > 2 for a, b in zip(offloads, offloads[1:]))
        assert all(n.args[3] == 4096 for n in fw.graph.nodes if n.target is probe_hook)
        fw.graph.lint()
        # The per-byte variant: large pages, each wait a whole slot after its offload (at the next
        # offload; the last one's before returning).
        fw, bw = probe.probed(gm, gm, 3)
        assert all(n.args[3] == BYTES_PAGE_NBYTES for n in fw.graph.nodes if n.target is probe_hook)
        waits, offloads = _positions(fw, ProbeOp.WAIT), _positions(fw, ProbeOp.OFFLOAD)
        assert [w + 1 for w in waits[:3]] == offloads[1:], "each wait just before the next offload"
        order = [n for n in fw.graph.nodes if n.op != "placeholder"]
        assert order[-2].target is probe_hook and order[-2].args[1:3] == (ProbeOp.WAIT, 3)
        # The copies do not touch the original graph.
        assert not _hooks(gm)
    finally:
        probe.close()


def test_probe_round_trips_pages_through_the_runtime_and_a_wrong_page_raises(tmp_path) -> None:
    from teraio.runtime import Engine, RuntimeConfig

    with Engine(RuntimeConfig(dirs=[str(tmp_path)], backend="posix")) as engine:
        eid = register_engine(engine)
        probe = TransferProbe(engine_id=eid, variants=probe_variants(2))
        try:
            for op in (ProbeOp.OFFLOAD, ProbeOp.WAIT):
                for i in range(2):
                    probe_hook(probe.probe_id, int(op), i, 4096 if i == 0 else BYTES_PAGE_NBYTES)
            for i in range(2):
                probe_hook(probe.probe_id, int(ProbeOp.PREFETCH), i)
                probe_hook(probe.probe_id, int(ProbeOp.FETCH), i, 4096 if i == 0 else BYTES_PAGE_NBYTES)
            stats = engine.stats()  # read back from the directory, not forwarded from memory
            assert stats.forwarded_fetches == 0
            assert (
                stats.direct_read_nbytes + stats.bounced_read_nbytes + stats.buffered_read_nbytes
                >= 4096 + BYTES_PAGE_NBYTES
            )

            class Corrupting:
                def __getattr__(self, name):
                    return getattr(engine, name)

                def fetch(self, key):
                    return torch.zeros_like(engine.fetch(key))

            bad = register_engine(Corrupting())
            try:
                probe.engine_id = bad
                probe_hook(probe.probe_id, int(ProbeOp.OFFLOAD), 0)
                probe_hook(probe.probe_id, int(ProbeOp.WAIT), 0)
                probe_hook(probe.probe_id, int(ProbeOp.PREFETCH), 0)
                with pytest.raises(DiskIOError, match="came back different"):
                    probe_hook(probe.probe_id, int(ProbeOp.FETCH), 0)
            finally:
                unregister_engine(bad)
        finally:
            probe.close()
            unregister_engine(eid)
        assert engine.keys() == [], "the probe's pages outlived it"


def _steps(pairs: list[tuple[int, float, float]], outside: bool = False) -> list[ProbeStep]:
    """(variant, plain seconds, probed seconds) per pair, as the runner records them."""
    steps = []
    for variant, plain_s, probed_s in pairs:
        steps.append(ProbeStep(0, plain_s, 0.001 if outside else None))
        steps.append(ProbeStep(variant, probed_s, 0.001 + variant * 1e-4 if outside else None))
    return steps


def _pairs(
    small_s: float, large_s: float, bytes_s: float, plain_s: float = 0.004
) -> list[tuple[int, float, float]]:
    """Variant 1 (one round trip) costs ``small_s``, 2 (four) ``large_s``, 3 (four of large pages)
    ``bytes_s``. One slow first probed step of each (as in a fresh process): the medians do not move."""
    extra = {1: small_s, 2: large_s, 3: bytes_s}
    pairs = [(v, plain_s, 0.03) for v in extra]
    for _ in range(PROBE_PAIRS - 1):
        pairs += [(v, plain_s, plain_s + e) for v, e in extra.items()]
    return pairs


def test_price_separates_per_transfer_per_step_and_per_byte() -> None:
    probe = TransferProbe(engine_id=0, variants=probe_variants(4))
    big = BYTES_PAGE_NBYTES
    try:
        # 8 transfers of large pages cost 1.2 ms more than of small ones: per byte, 1.2 ms over 8 x the
        # difference in bytes; 2 transfers cost 0.9 ms and 8 cost 2.1 ms less their bytes' part.
        probe.steps = _steps(_pairs(0.0009, 0.0021, 0.0033))
        assert probe.done()
        price = probe.estimate()
        per_byte = 0.0012 / (8 * (big - 4096))
        d1, d2 = 0.0009 - 2 * 4096 * per_byte, 0.0021 - 8 * 4096 * per_byte
        assert price.per_byte_s == pytest.approx(per_byte)
        assert price.per_transfer_s == pytest.approx((d2 - d1) / 6)
        assert price.per_step_s == pytest.approx(d1 - 2 * (d2 - d1) / 6)
        # No measurable per-byte part (large pages no dearer than small, within noise): none, and the
        # line through the small pages as it is: 0.2 ms per transfer, 0.5 ms per step.
        probe.steps = _steps(_pairs(0.0009, 0.0021, 0.0020))
        price = probe.estimate()
        assert price.per_byte_s == 0.0
        assert price.per_transfer_s == pytest.approx(0.0002) and price.per_step_s == pytest.approx(0.0005)
        # Outside time counts when both steps of a pair have it (here 0.1 ms more per variant number).
        probe.steps = _steps(_pairs(0.0009, 0.0021, 0.0020), outside=True)
        price = probe.estimate()
        assert price.per_transfer_s == pytest.approx((0.0021 + 0.0002 - 0.0009 - 0.0001) / 6)
        # Noise tilting the line (more per transfer at one round trip than all of four): the larger
        # count's difference per transfer, nothing per step.
        probe.steps = _steps(_pairs(0.0030, 0.0024, 0.0024))
        price = probe.estimate()
        assert price.per_transfer_s == pytest.approx(0.0003) and price.per_step_s == 0.0
        # Too few pairs, or a probe the noise hid: no price.
        probe.steps = _steps(_pairs(0.0009, 0.0021, 0.0033)[:-1])
        assert not probe.done() and probe.estimate() is None
        probe.steps = _steps(_pairs(-0.0001, -0.0001, 0.0))
        assert probe.estimate() is None
    finally:
        probe.close()


def test_steps_alternate_plain_and_probed_and_the_variants() -> None:
    probe = TransferProbe(engine_id=0, variants=probe_variants(4))
    try:
        probe.record(0, 0.004)
        seen = []
        for _ in range(PROBE_STEPS):
            v = probe.next_variant
            seen.append(v)
            probe.record(v, 0.004 + v * 1e-4)
        assert seen[:7] == [1, 0, 2, 0, 3, 0, 1]
        assert probe.done() and seen.count(1) == seen.count(2) == seen.count(3) == PROBE_PAIRS
    finally:
        probe.close()


def test_probe_variants() -> None:
    small, large, big = probe_variants(6)
    assert (small.round_trips, large.round_trips, big.round_trips) == (1, 6, 6)
    assert small.page_nbytes == large.page_nbytes == 4096 < big.page_nbytes == BYTES_PAGE_NBYTES
    assert big.gap_slots == 1.0 and ProbeVariant(1).label == "1 x 4 KiB"


def test_round_trips_are_sized_to_the_step() -> None:
    assert round_trips_for(0.001) == MIN_ROUND_TRIPS
    assert MIN_ROUND_TRIPS < round_trips_for(0.05) <= MAX_ROUND_TRIPS
    assert round_trips_for(2.0) is None  # a long step: the calibration's blocks price transfers


def _quick_calibration(monkeypatch, tmp_path):
    """The backend's calibration at small sizes, and every graph short enough to probe whatever the
    machine's speed (a loaded CI machine can stretch a small model's step past the limit, and whether
    to probe is a wall-clock decision); returns the offload directory."""
    monkeypatch.setattr(teraio.lifecycle.runner_profiling, "round_trips_for", lambda step_s: MIN_ROUND_TRIPS)
    real = teraio.profiling.disk_calibration.calibrate
    monkeypatch.setattr(
        teraio.profiling.disk_calibration,
        "calibrate",
        lambda d, **kw: real(d, **{**kw, "nbytes": 1 << 20, "block_nbytes": 1 << 20}),
    )
    offload = tmp_path / "offload"
    offload.mkdir()
    return offload


def _probing_backend(offload, budget: str = "60%") -> TeraioBackend:
    """FX-only, calibrating the offload directory: a short step's graph probes after profiling."""
    return TeraioBackend(
        inner="eager",
        profiling=teraio.Profiling(steps=3, measure_memory=False),
        solver="greedy",
        memory_budget=budget,
        hardware="calibrate",
        offload_dirs=[str(offload)],
    )


def test_backend_prices_transfers_under_the_graph_and_trains_bit_identically(monkeypatch, tmp_path) -> None:
    offload = _quick_calibration(monkeypatch, tmp_path)
    steps = 3 + PROBE_STEPS + 3  # profiling, the probe's steps, the planning step and two more
    be = _probing_backend(offload)
    off = TeraioBackend(
        inner="eager", profiling=teraio.Profiling(steps=3, measure_memory=False), enabled=False
    )
    try:
        probed = run(CASES["gpt"], "plain", be, steps)
        (runner,) = [r for r in be.runners if r.is_training]
        assert runner.plan is not None, "planned after the probe's steps"
        (result,) = be.transfer_probes
        assert result["round_trips"][0] == 1 and result["round_trips"][1] >= MIN_ROUND_TRIPS
        assert [len(d) for d in result["differences_s"].values()] == [PROBE_PAIRS] * 3
        assert result["page_bytes"] == [4096, 4096, BYTES_PAGE_NBYTES]
        ssd = runner.plan.hardware.tiers["ssd"]
        if result["per_transfer_s"] is not None:
            assert be.transfer_price is not None
            assert ssd.cpu_s_per_transfer == result["per_transfer_s"] > 0
            assert ssd.cpu_s_per_step_with_io == result["per_step_s"] >= 0
            assert ssd.cpu_s_per_byte == result["per_byte_s"] >= 0
        else:  # the step's noise hid the probe: the blocks' figure stands, nothing per step
            assert be.transfer_price is None and ssd.cpu_s_per_step_with_io == 0
            assert ssd.cpu_s_per_byte == HardwareModel().tiers["ssd"].cpu_s_per_byte
        # The plain calibration steps still calibrate the op times, the probed ones do not.
        assert runner.profile.meta["calibration_steps"] == 1 + (PROBE_STEPS - 1) // 2
        assert be._probe_engine is None, "the probe's engine outlived the first plan"
    finally:
        be.close()
    assert_bit_identical(probed, run(CASES["gpt"], "plain", off, steps))
    assert not [p for p in offload.iterdir() if p.name.startswith("teraio-")]


def test_probing_in_every_loop_pattern_across_a_graph_break_stays_bit_identical(
    monkeypatch, tmp_path
) -> None:
    """Validation under no_grad, a forward never backpropagated, accumulation and two forwards before
    one backward while two graphs probe: training is bit-identical to ``enabled=False``, each graph is
    planned, and nothing is left in the offload directory."""
    offload = _quick_calibration(monkeypatch, tmp_path)
    steps = 3 + PROBE_STEPS + 4
    case = CASES["gpt-graph-break"]
    be = _probing_backend(offload, "70%")
    try:
        probed = run(case, "all-fp32", be, steps)
        # Both halves of the graph break (a graph called once, by one of the loop's odd calls, stays
        # profiling, as without a probe).
        assert len([r for r in be.runners if r.is_training and r.plan is not None]) == 2
        assert be.transfer_probes and be._probe_engine is None
    finally:
        be.close()
    off = TeraioBackend(
        inner="eager", profiling=teraio.Profiling(steps=3, measure_memory=False), enabled=False
    )
    assert_bit_identical(probed, run(case, "all-fp32", off, steps))
    assert not [p for p in offload.iterdir() if p.name.startswith("teraio-")]


def test_closing_the_backend_while_probing_stops_the_probe(monkeypatch, tmp_path) -> None:
    offload = _quick_calibration(monkeypatch, tmp_path)
    be = _probing_backend(offload)
    run(CASES["gpt"], "plain", be, 6)  # three profiling steps, then three of the probe's
    (runner,) = [r for r in be.runners if r.is_training]
    probe = runner.profiler.probe
    assert probe is not None and not probe.done()
    be.close()
    assert probe.closed and probe.done() and be._probe_engine is None
    probe_hook(probe.probe_id, int(ProbeOp.OFFLOAD), 0)  # a hook of a closed probe does nothing
    assert not [p for p in offload.iterdir() if p.name.startswith("teraio-")]
