"""Pricing a transfer under the model's own compute (Note: [Pricing transfers under the model's own
compute] in teraio.probe): the probed graphs, the paired estimate, and a backend that probes while
training stays bit-identical."""

from __future__ import annotations

import pytest
import torch
from torch import fx

import teraio.calibrate
from teraio.lifecycle import TeraioBackend
from teraio.ops import register_engine, unregister_engine
from teraio.probe import (
    MAX_ROUND_TRIPS,
    MIN_ROUND_TRIPS,
    PROBE_PAIRS,
    ProbeOp,
    ProbeStep,
    TransferProbe,
    probe_hook,
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


def test_probed_graph_computes_the_same_and_spreads_its_round_trips() -> None:
    gm = _mlp_graph()
    probe = TransferProbe(engine_id=0, round_trips=4)
    try:
        fw, bw = probe.probed(gm, gm)
        assert _hooks(fw) == [(op, i) for i in range(4) for op in (ProbeOp.OFFLOAD, ProbeOp.WAIT)], (
            "each offload comes before its wait, the round trips in order"
        )
        assert [op for op, _ in _hooks(bw)] == [ProbeOp.PREFETCH, ProbeOp.FETCH] * 4
        # Spread over the graph: compute nodes between consecutive offloads, not all at the start.
        order = [n for n in fw.graph.nodes if n.op == "call_function"]
        offloads = [k for k, n in enumerate(order) if n.target is probe_hook and n.args[1] == ProbeOp.OFFLOAD]
        assert all(b - a > 2 for a, b in zip(offloads, offloads[1:]))
        fw.graph.lint()
        # The copies do not touch the original graph.
        assert not _hooks(gm)
    finally:
        probe.close()


def test_probe_round_trips_pages_through_the_runtime_and_a_wrong_page_raises(tmp_path) -> None:
    from teraio.runtime import Engine, RuntimeConfig

    with Engine(RuntimeConfig(dirs=[str(tmp_path)], backend="posix")) as engine:
        eid = register_engine(engine)
        probe = TransferProbe(engine_id=eid, round_trips=2)
        try:
            for op in (ProbeOp.OFFLOAD, ProbeOp.WAIT):
                for i in range(2):
                    probe_hook(probe.probe_id, int(op), i)
            for i in range(2):
                probe_hook(probe.probe_id, int(ProbeOp.PREFETCH), i)
                probe_hook(probe.probe_id, int(ProbeOp.FETCH), i)
            stats = engine.stats()  # read back from the directory, not forwarded from memory
            assert stats.forwarded_fetches == 0
            assert (
                stats.direct_read_nbytes + stats.bounced_read_nbytes + stats.buffered_read_nbytes >= 2 * 4096
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


def _steps(pairs: list[tuple[float, float]], outside: bool = False) -> list[ProbeStep]:
    steps = []
    for plain_s, probed_s in pairs:
        steps.append(ProbeStep(False, plain_s, 0.001 if outside else None))
        steps.append(ProbeStep(True, probed_s, 0.003 if outside else None))
    return steps


def test_estimate_is_the_median_paired_difference_per_transfer() -> None:
    probe = TransferProbe(engine_id=0, round_trips=4)
    try:
        # One slow first probed step (as in a fresh process) does not move the median.
        pairs = [(0.004, 0.030)] + [(0.004, 0.0064)] * (PROBE_PAIRS - 1)
        probe.steps = _steps(pairs)
        assert probe.done()
        assert probe.estimate() == pytest.approx(0.0024 / 8)
        # Outside time counts when both steps of a pair have it.
        probe.steps = _steps(pairs, outside=True)
        assert probe.estimate() == pytest.approx((0.0024 + 0.002) / 8)
        # Too few pairs, or a probe the noise hid: no price.
        probe.steps = _steps(pairs[:-1])
        assert not probe.done() and probe.estimate() is None
        probe.steps = _steps([(0.004, 0.0039)] * PROBE_PAIRS)
        assert probe.estimate() is None
    finally:
        probe.close()


def test_round_trips_are_sized_to_the_step() -> None:
    assert round_trips_for(0.001) == MIN_ROUND_TRIPS
    assert MIN_ROUND_TRIPS < round_trips_for(0.05) <= MAX_ROUND_TRIPS
    assert round_trips_for(2.0) is None  # a long step: the calibration's blocks price transfers


def test_backend_prices_transfers_under_the_graph_and_trains_bit_identically(monkeypatch, tmp_path) -> None:
    real = teraio.calibrate.calibrate
    monkeypatch.setattr(
        teraio.calibrate,
        "calibrate",
        lambda d, **kw: real(d, **{**kw, "nbytes": 1 << 20, "block_nbytes": 1 << 20}),
    )
    offload = tmp_path / "offload"
    offload.mkdir()
    steps = 3 + 2 * PROBE_PAIRS + 3  # profiling, the probe's pairs, the planning step and two more
    be = TeraioBackend(
        inner="eager",
        profile_steps=3,
        solver="greedy",
        memory_budget="60%",
        hardware="calibrate",
        offload_dirs=[str(offload)],
        measure_memory=False,
    )
    off = TeraioBackend(inner="eager", profile_steps=3, enabled=False, measure_memory=False)
    try:
        probed = run(CASES["gpt"], "plain", be, steps)
        (runner,) = [r for r in be.runners if r.is_training]
        assert runner.plan is not None, "planned after the probe's steps"
        (result,) = be.transfer_probes
        assert result["round_trips"] >= MIN_ROUND_TRIPS
        assert len(result["differences_s"]) == PROBE_PAIRS
        price = runner.plan.hardware.tiers["ssd"].cpu_s_per_transfer
        if result["price_s"] is not None:  # else the noise hid it and the blocks' figure stands
            assert price == result["price_s"]
        # The plain calibration steps still calibrate the op times, the probed ones do not.
        assert runner.profile.meta["calibration_steps"] == PROBE_PAIRS  # 1, then 7 between the 8 probed
        assert be._probe_engine is None, "the probe's engine outlived the first plan"
    finally:
        be.close()
    assert_bit_identical(probed, run(CASES["gpt"], "plain", off, steps))
    assert not [p for p in offload.iterdir() if p.name.startswith("teraio-")]
