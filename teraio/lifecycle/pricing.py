"""What plans assume moving a tensor costs: the storage's hardware model and the price of a transfer.

A plan trades memory for I/O, so the planner needs the storage's bandwidths and latencies, and, on a CPU
that computes, how much of the step's own compute each transfer takes. They come from the ``hardware``
file, a quick calibration of the offload directory (``hardware="calibrate"``, made once before the first
plan), or the built-in model; with ``"calibrate"`` on a short CPU step, from transfer probes run during
profiling (Note: [Pricing transfers under the model's own compute] in teraio.profiling.transfer_probe),
on an engine of their own that lives only while a probe runs. The model is then adjusted to the run:
local ranks sharing a disk, the tiers the backend may use.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from teraio.config import CALIBRATE
from teraio.lifecycle.engines import calibration_runtime_config
from teraio.lifecycle.ranks import disk_sharers, rank_info
from teraio.planner.hardware import HardwareModel
from teraio.profiling.transfer_probe import TransferPrice, TransferProbe

if TYPE_CHECKING:
    from teraio.config import BackendConfig
    from teraio.graph.ops import RegisteredEngine
    from teraio.lifecycle.runner import GraphRunner
    from teraio.planner.plan import Plan

log = logging.getLogger("teraio")


def _ms(seconds: list[float]) -> str:
    return "/".join(f"{s * 1e3:.1f}" for s in seconds) + " ms"


class TransferPricing:
    """The hardware model one backend plans with, and the transfer probes that price it."""

    def __init__(
        self,
        cfg: BackendConfig,
        runners: list[GraphRunner],
        plans_from_file: list[Plan],
        save_hardware: Callable[[HardwareModel], None],
    ) -> None:
        self.cfg = cfg
        self.runners = runners  # the backend's, as they come
        self.plans_from_file = plans_from_file
        self.save_hardware = save_hardware  # what the plans were made with (run_dir)
        self._hardware: HardwareModel | None = None
        self._told_sharing = False
        # Note: [Pricing transfers under the model's own compute] in teraio.profiling.transfer_probe
        self.probe_engine: RegisteredEngine | None = None
        #: Per probed graph: each variant's round trips and page bytes, its probed-minus-plain seconds,
        #: and the price (None: hidden).
        self.transfer_probes: list[dict[str, Any]] = []
        #: The price of moving tensors measured under the graphs' own compute (the first probe's).
        self.transfer_price: TransferPrice | None = None
        if self.cfg.hardware is not None and self.cfg.hardware != CALIBRATE:
            # A bad file fails here, in one line, not when the first plan is made steps later.
            self._hardware = HardwareModel.load(self.cfg.hardware)

    def hardware_model(self) -> HardwareModel:
        """What plans assume of the storage: the ``hardware`` file, a quick calibration of the offload
        directory (``hardware="calibrate"``, made once, before the first plan), or the built-in model;
        with ``"calibrate"``, the price of moving tensors measured under the graphs' own compute once a
        probe has it (Note: [Pricing transfers under the model's own compute] in
        teraio.profiling.transfer_probe)."""
        if self._hardware is None:
            self._hardware = self._calibrate_hardware() if self.cfg.hardware == CALIBRATE else HardwareModel()
        hw = self._hardware
        if self.transfer_price is not None:
            hw = hw.with_overrides(
                "ssd",
                cpu_s_per_transfer=self.transfer_price.per_transfer_s,
                cpu_s_per_step_with_io=self.transfer_price.per_step_s,
                cpu_s_per_byte=self.transfer_price.per_byte_s,
            )
        self.save_hardware(hw)
        tiers = set(self.cfg.tiers)
        info = rank_info()
        sharers = disk_sharers(self.cfg.offload_dirs, info) if info.distributed else 1
        if sharers > 1 and "ssd" in tiers:
            # Local ranks writing to the same disk share its bandwidth: each plans with its part of it.
            ssd = hw.tier("ssd")
            hw = hw.with_overrides(
                "ssd",
                write_bw_bytes_per_s=ssd.write_bw_bytes_per_s / sharers,
                read_bw_bytes_per_s=ssd.read_bw_bytes_per_s / sharers,
            )
            if not self._told_sharing:
                self._told_sharing = True
                log.info(
                    "%d local ranks share this rank's offload disk: each plans with 1/%d of its bandwidth",
                    sharers,
                    sharers,
                )
        if "host" in tiers and hw.tiers["host"].capacity_bytes == 0:
            hw = hw.with_overrides("host", capacity_bytes=None)
        if "ssd" not in tiers:
            hw = hw.with_overrides("ssd", capacity_bytes=0)
        return hw

    def _calibrate_hardware(self) -> HardwareModel:
        """Time the runtime engine on the directory offloads will go to (teraio.profiling.disk_calibration,
        small sizes)."""
        if "ssd" not in self.cfg.tiers:
            return HardwareModel()
        from teraio.profiling.disk_calibration import quick_calibration

        directory = calibration_runtime_config(self.cfg).dirs[0]
        t0 = time.perf_counter()
        cal, age_s = quick_calibration(directory, checksum=bool(self.cfg.checksum))
        if age_s is not None:
            log.info("reusing this process's calibration of %s from %.0f s ago", directory, age_s)
            return cal.hardware_model()
        log.info(
            "calibrated %s in %.1f s: write %.2f GB/s, read %.2f GB/s, %.0f/%.0f us per request, "
            "%.0f us of compute per transfer%s",
            directory,
            time.perf_counter() - t0,
            cal.write_bw_bytes_per_s / 1e9,
            cal.read_bw_bytes_per_s / 1e9,
            cal.write_latency_s * 1e6,
            cal.read_latency_s * 1e6,
            cal.cpu_s_per_transfer * 1e6,
            " (blocks of synthetic ops; the graph's own price replaces it)" if self.transfer_price else "",
        )
        for w in cal.warnings:
            log.warning("calibration: %s", w)
        return cal.hardware_model()

    # ------------------------------------------------------------------------------------ probes
    def wants_transfer_price(self) -> bool:
        """Whether a graph's calibration steps should price moving tensors under its own compute (Note:
        [Pricing transfers under the model's own compute] in teraio.profiling.transfer_probe): plans are
        made from a calibration of the offload directory, for a CPU that computes, and no probe has the
        price yet."""
        from teraio.profiling.disk_calibration import accelerator_computes

        return (
            self.cfg.enabled
            and self.cfg.memory_budget is not None
            and self.cfg.hardware == CALIBRATE
            and self.transfer_price is None
            and "ssd" in self.cfg.tiers
            and not self.plans_from_file
            and not accelerator_computes()
        )

    def probe_engine_id(self) -> int:
        """The engine transfer probes use (posix, on the directory being calibrated), while any runs."""
        if self.probe_engine is None:
            from teraio.graph.ops import RegisteredEngine
            from teraio.runtime import Engine

            engine = Engine(calibration_runtime_config(self.cfg))
            self.probe_engine = RegisteredEngine(engine)
            # One round trip before any is timed: the first makes the engine's file and wakes its threads.
            page = torch.zeros(1024)
            engine.offload("probe-warm-up", page).wait()
            engine.release("probe-warm-up")
            del page
            engine.prefetch("probe-warm-up").wait()
            engine.fetch("probe-warm-up")
            engine.drop("probe-warm-up")
        return self.probe_engine.id

    def collect_probes(self) -> None:
        """Take the price of moving tensors from the graphs whose probes have finished (the first time
        one has), close those probes, and the probes' engine once none is running."""
        probes = [
            (r, r.profiler.probe)
            for r in self.runners
            if r.profiler is not None and r.profiler.probe is not None
        ]
        done = [(r, p) for r, p in probes if not p.closed and p.complete()]
        if done:
            measured = self._probed_price(done)
            if measured is not None and self.transfer_price is None:
                self.transfer_price, how = measured
                log.info(
                    "priced moving tensors under the model's own compute: %.0f us per transfer, %.0f us "
                    "per step that moves any and %.3f ns per byte (%s)",
                    self.transfer_price.per_transfer_s * 1e6,
                    self.transfer_price.per_step_s * 1e6,
                    self.transfer_price.per_byte_s * 1e9,
                    how,
                )
            for _, p in done:
                p.close()
        if not any(not p.closed for _, p in probes):
            self._close_probe_engine()

    def close(self) -> None:
        """Close every probe and the probes' engine."""
        for r in self.runners:
            if r.profiler is not None and r.profiler.probe is not None:
                r.profiler.probe.close()
        self._close_probe_engine()

    def _close_probe_engine(self) -> None:
        if self.probe_engine is not None:
            self.probe_engine.close()
            self.probe_engine = None

    def _probed_price(
        self, done: list[tuple[GraphRunner, TransferProbe]]
    ) -> tuple[TransferPrice, str] | None:
        """The price measured by finished probes (the median over graphs), and how; each recorded in
        ``transfer_probes``."""
        priced: list[tuple[TransferPrice, str]] = []
        for r, p in done:
            price = p.estimate()
            diffs = p.differences_s()
            self.transfer_probes.append(
                {
                    "graph": r.graph_id,
                    # Per variant: round trips per step and the bytes of each page.
                    "round_trips": [v.round_trips for v in p.variants],
                    "page_bytes": [v.page_nbytes for v in p.variants],
                    "differences_s": {p.variants[v - 1].label: d for v, d in sorted(diffs.items())},
                    "per_transfer_s": price.per_transfer_s if price else None,
                    "per_step_s": price.per_step_s if price else None,
                    "per_byte_s": price.per_byte_s if price else None,
                }
            )
            shown = "; ".join(f"{p.variants[v - 1].label}: {_ms(d)}" for v, d in sorted(diffs.items()))
            if price is None:
                log.info(
                    "%s: the probe's round trips did not show above the step's noise (probed minus plain, "
                    "%s); pricing transfers from the calibration's blocks instead",
                    r.name,
                    shown,
                )
            else:
                priced.append((price, f"{r.name}, probed minus plain: {shown}"))
        if not priced:
            return None
        price = TransferPrice(
            statistics.median(p.per_transfer_s for p, _ in priced),
            statistics.median(p.per_step_s for p, _ in priced),
            statistics.median(p.per_byte_s for p, _ in priced),
        )
        return price, " | ".join(how for _, how in priced)
