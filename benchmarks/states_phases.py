"""bench_states' phases around the training steps: the bytes each moved by kind, ``--from-checkpoint``'s
weights write, load and save, and their report against the raw disk of the same run (issue 39)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.states_reference import proc_status_bytes, reset_peak_rss
from teraio.planner.model_states import io_lower_bound_s
from teraio.tools.models.gpt import GPTConfig


def log(msg: str) -> None:
    print(f"[bench_states {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


KINDS = ("activation", "parameter", "gradient", "optimizer_state")


def io_by_kind(be: Any) -> dict[str, dict[str, int]]:
    """Cumulative bytes written and read per kind: activations from the backend's engine, gradients and
    optimizer states and parameters from ``backend.states``."""
    st = be.stats()
    ss = be.states.stats()
    written = dict.fromkeys(KINDS, 0)
    read = dict.fromkeys(KINDS, 0)
    written["activation"] = int(st.get("offloaded_bytes", 0))
    read["activation"] = int(st.get("prefetched_bytes", 0))
    for k in ("parameter", "gradient", "optimizer_state"):
        written[k] = ss["written_bytes"][k]
        read[k] = ss["read_bytes"][k]
    return {"written": written, "read": read, "moved": dict(st["moved_bytes_by_kind"]), "phase": st["phase"]}


def delta(a: dict[str, dict[str, int]], b: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {
        what: {k: b[what][k] - a[what].get(k, 0) for k in b[what]} for what in ("written", "read", "moved")
    }


def load_phase(be: Any, weights: str, can_reset: bool) -> tuple[dict[str, Any], int]:
    """``backend.states.load_pretrained(weights)``: what it did (its ``LoadReport``, the bytes the
    states wrote by kind) and the phase's peak resident memory."""
    if can_reset:
        reset_peak_rss()
    before = io_by_kind(be)
    loaded = be.states.load_pretrained(weights).as_dict()
    peak = proc_status_bytes("VmHWM")
    moved = delta(before, io_by_kind(be))
    out = {
        **loaded,
        "written_bytes": sum(moved["written"].values()),
        "written_bytes_by_kind": moved["written"],
        "peak_rss_bytes": peak,
        "rss_after_bytes": proc_status_bytes("VmRSS"),
    }
    log(
        f"load_pretrained: {loaded['tensors']} tensors, read {loaded['read_bytes'] / 1e9:.2f} GB, wrote "
        f"{out['written_bytes'] / 1e9:.2f} GB to the offload files in {loaded['seconds']:.1f} s, peak RSS "
        f"{peak / 1e9:.2f} GB"
    )
    return out, peak


def save_phase(be: Any, directory: str, can_reset: bool) -> tuple[dict[str, Any], int]:
    """``backend.states.save_checkpoint(directory)`` after the last step: time, the bytes read back from
    the offload files by kind, the files written, and the phase's peak resident memory. The last step's
    update, left pending for a next forward (teraio.states.step_pipeline), runs first, outside the
    phase's figures: it is the step's work, which a checkpoint waits for."""
    be.states.settle_step()
    if can_reset:
        reset_peak_rss()
    before = io_by_kind(be)
    t0 = time.perf_counter()
    path = be.states.save_checkpoint(directory)
    seconds = time.perf_counter() - t0
    peak = proc_status_bytes("VmHWM")
    moved = delta(before, io_by_kind(be))
    files = {p.name: p.stat().st_size for p in sorted(Path(path).iterdir())}
    out = {
        "seconds": seconds,
        "read_bytes": sum(moved["read"].values()),
        "read_bytes_by_kind": moved["read"],
        # What the offload files got meanwhile (nothing: a save only reads them).
        "offload_written_bytes": sum(moved["written"].values()),
        "written_bytes": sum(files.values()),
        "files": files,
        "peak_rss_bytes": peak,
        "rss_after_bytes": proc_status_bytes("VmRSS"),
    }
    log(
        f"save_checkpoint: {len(files)} files, {out['written_bytes'] / 1e9:.2f} GB written, "
        f"{out['read_bytes'] / 1e9:.2f} GB read back from the offload files in {seconds:.1f} s, peak RSS "
        f"{peak / 1e9:.2f} GB"
    )
    return out, peak


def write_weights_phase(cfg: GPTConfig, seed: int, target: Path) -> dict[str, Any]:
    """--from-checkpoint's first phase, in this process: the GPT's initial weights written tensor by
    tensor (benchmarks.gpt_weights), with this process's peak resident memory meanwhile."""
    from benchmarks.gpt_weights import write_gpt_weights

    can_reset = reset_peak_rss()
    before = proc_status_bytes("VmRSS")
    report = write_gpt_weights(cfg, seed, target).as_dict()
    report["peak_rss_bytes"] = proc_status_bytes("VmHWM")
    report["rss_before_bytes"] = before
    report["peak_rss_window_reset"] = can_reset
    log(
        f"initial weights written: {report['file_bytes'] / 1e9:.2f} GB in {report['seconds']:.1f} s, peak RSS "
        f"of this process {report['peak_rss_bytes'] / 1e9:.2f} GB ({before / 1e9:.2f} GB before)"
    )
    return report


def rates(seconds: float, read_bytes: int, written_bytes: int, wbw: float, rbw: float) -> dict[str, Any]:
    """A phase's bytes against the raw bandwidths of the same run: its own rates, their ratio to the raw
    ones, and its time against moving the same bytes at the raw rates (one device: a read and a write do
    not add bandwidth)."""
    bound = io_lower_bound_s(written_bytes, read_bytes, wbw, rbw)
    secs = max(seconds, 1e-9)
    return {
        "seconds": seconds,
        "read_bytes": read_bytes,
        "written_bytes": written_bytes,
        "read_gb_per_s": read_bytes / secs / 1e9,
        "write_gb_per_s": written_bytes / secs / 1e9,
        "ratio_to_raw_read": read_bytes / secs / rbw,
        "ratio_to_raw_write": written_bytes / secs / wbw,
        "io_lower_bound_s": bound,
        "seconds_vs_io_lower_bound": seconds / bound if bound > 0 else None,
    }


def checkpoint_report(
    written: dict[str, Any] | None,
    child: dict[str, Any],
    phases: dict[str, int],
    running_peak: int,
    wbw: float,
    rbw: float,
) -> dict[str, Any]:
    """--from-checkpoint's phases: the initial weights' write (this process), the load and the save (the
    training process), each against the raw disk, and every phase's peak RSS against the running steps'."""
    assert written is not None and child["load"] is not None and child["save"] is not None
    load, save = child["load"], child["save"]
    ratios = {k: v / running_peak if running_peak else None for k, v in phases.items()}
    return {
        "write_initial_weights": {
            **rates(written["seconds"], 0, written["file_bytes"], wbw, rbw),
            **{k: written[k] for k in ("files", "tensors", "tensor_bytes", "dropped_page_cache")},
            "peak_rss_bytes": written["peak_rss_bytes"],
            "process": "the benchmark's (not the training process)",
        },
        "load": {
            **rates(load["seconds"], load["read_bytes"], load["written_bytes"], wbw, rbw),
            **{
                k: load[k]
                for k in ("tensors", "offloaded_bytes", "resident_bytes", "written_bytes_by_kind", "files")
            },
            "peak_rss_bytes": load["peak_rss_bytes"],
        },
        "save": {
            **rates(save["seconds"], save["read_bytes"], save["written_bytes"], wbw, rbw),
            **{k: save[k] for k in ("read_bytes_by_kind", "offload_written_bytes", "files")},
            "peak_rss_bytes": save["peak_rss_bytes"],
        },
        "peak_rss_vs_running_step": ratios,
        # Issue 39's target: no phase of the training process above 1.25x its largest running step.
        "every_phase_within_1_25x_of_running_step": all(r is not None and r <= 1.25 for r in ratios.values()),
    }
