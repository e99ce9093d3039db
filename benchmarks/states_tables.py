"""The tables ``benchmarks.bench_states`` prints without ``--json``: the figures a person reads first."""

from __future__ import annotations

from typing import Any

from benchmarks.step_overlap import PHASES


def _fmt_gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def print_table(r: dict[str, Any]) -> None:
    print(
        f"GPT {r['config']}: {r['params'] / 1e9:.3f}e9 parameters, {r['gpt']['layers']} layers x hidden "
        f"{r['gpt']['hidden']}, batch {r['gpt']['batch']} x {r['gpt']['seq']} tokens"
    )
    print(
        f"training state {_fmt_gb(r['state_bytes'])} (weights {_fmt_gb(r['weight_bytes'])}, gradients "
        f"{_fmt_gb(r['gradient_bytes'])}, AdamW moments {_fmt_gb(r['optimizer_state_bytes'])}) vs MemTotal "
        f"{_fmt_gb(r['mem_total_bytes'])}: exceeds memory: {r['state_exceeds_mem_total']}"
    )
    print(
        f"peak RSS {_fmt_gb(r['peak_rss_bytes'])} ({r['peak_rss_vs_mem_total']:.0%} of MemTotal; "
        f"{_fmt_gb(r['rss_after_build_bytes'])} after building the model)"
    )
    print(
        "step  time_s  cpu_s  fwd_s  bwd_s  opt_s  peak_rss_GB  grad_w_GB  grad_r_GB  state_w_GB  state_r_GB"
        "  param_w_GB  param_r_GB  loss"
    )
    for s in r["per_step"]:
        w, rd = s["written_bytes"], s["read_bytes"]
        print(
            f"{s['step']:>4}  {s['step_s']:6.1f}  {s['cpu_s']:5.1f}  {s['forward_s']:5.1f}  {s['backward_s']:5.1f}  "
            f"{s['optimizer_step_s']:5.1f}  {s['peak_rss_bytes'] / 1e9:11.2f}  {w['gradient'] / 1e9:9.2f}  "
            f"{rd['gradient'] / 1e9:9.2f}  {w['optimizer_state'] / 1e9:10.2f}  {rd['optimizer_state'] / 1e9:10.2f}"
            f"  {w.get('parameter', 0) / 1e9:10.2f}  {rd.get('parameter', 0) / 1e9:10.2f}  {s['loss']:.6f}"
        )
    print(
        f"median step (steps 1..) {r['median_step_s']:.1f} s; compute alone {r['compute_s']:.1f} s; I/O lower "
        f"bound {r['io_lower_bound_s']:.1f} s ({_fmt_gb(r['io_must_write_bytes'])} written at "
        f"{r['disk']['raw_write_gb_per_s']:.2f} GB/s + {_fmt_gb(r['io_must_read_bytes'])} read at "
        f"{r['disk']['raw_read_gb_per_s']:.2f} GB/s; {r['io_bound_at_engine_rates_s']:.1f} s at the engine's "
        f"{r['disk']['write_gb_per_s']:.2f} and {r['disk']['read_gb_per_s']:.2f} GB/s)"
    )
    print(
        f"step / I/O lower bound {r['step_vs_io_lower_bound']:.2f}; step / max(compute, I/O) "
        f"{r['step_vs_max_compute_io']:.2f} (goal <= 1.3: {r['within_1_3x_of_max_compute_io']})"
    )
    ov = r["overlap"]
    print(
        f"median split: forward {ov['forward_s']:.1f} s, backward {ov['backward_s']:.1f} s, opt.step() "
        f"{ov['optimizer_step_s']:.1f} s; waited on I/O {ov['compute_wait_s']:.1f} s; disk idle "
        f"{ov['disk_idle_s']:.1f} s of the step; I/O threads' CPU {ov['io_threads_user_s_per_gb']:.3f} s user + "
        f"{ov['io_threads_system_s_per_gb']:.3f} s system per GB moved"
    )
    if "forward_compute_wait_s" in ov:
        print(
            "by phase, waited / disk idle (and bytes moved): "
            + ", ".join(
                f"{ph} {ov[f'{ph}_compute_wait_s']:.1f} / {ov[f'{ph}_disk_idle_s']:.1f} s "
                f"(read {ov[f'{ph}_read_gb']:.1f} GB, wrote {ov[f'{ph}_written_gb']:.1f} GB)"
                for ph in PHASES
            )
        )
    pb = r.get("phase_bound")
    if pb:
        print(
            f"phase bound {pb['phase_bound_s']:.1f} s (compute alone / I/O at raw rates: "
            + ", ".join(
                f"{ph} {pb[f'{ph}_compute_alone_s']:.1f} / {pb[f'{ph}_io_at_raw_rates_s']:.1f} s"
                for ph in PHASES
            )
            + f"); step / phase bound {r['step_vs_phase_bound']:.2f}"
        )
    ck = r.get("from_checkpoint")
    if ck:
        for name in ("write_initial_weights", "load", "save"):
            ph = ck[name]
            print(
                f"{name}: {ph['seconds']:.1f} s, read {_fmt_gb(ph['read_bytes'])} ({ph['read_gb_per_s']:.2f} GB/s, "
                f"{ph['ratio_to_raw_read']:.2f}x raw), wrote {_fmt_gb(ph['written_bytes'])} "
                f"({ph['write_gb_per_s']:.2f} GB/s, {ph['ratio_to_raw_write']:.2f}x raw); "
                f"{ph['seconds'] / max(ph['io_lower_bound_s'], 1e-9):.2f}x its raw-disk time; peak RSS "
                f"{_fmt_gb(ph['peak_rss_bytes'])}"
            )
        ratios = ", ".join(f"{k} {v:.2f}" for k, v in ck["peak_rss_vs_running_step"].items() if v is not None)
        print(
            f"peak RSS by phase / largest running step's ({_fmt_gb(r['peak_rss_running_step_bytes'])}): {ratios} "
            f"(goal <= 1.25: {ck['every_phase_within_1_25x_of_running_step']})"
        )
    print(
        f"first loss {r['first_loss']!r} vs layer-by-layer reference {r['reference_first_loss']!r}: bit-equal "
        f"{r['first_loss_bit_equal']}; files left in the directory: {r['leftovers'] or 'none'}"
    )


def print_fsdp_table(r: dict[str, Any]) -> None:
    """The figures of ``--fsdp`` (benchmarks.states_fsdp) a person reads first."""
    print(
        f"{r['config']} over {r['world_size']} FSDP2 ranks: {r['params'] / 1e9:.3f}e9 parameters, training "
        f"state {_fmt_gb(r['state_bytes'])} (exceeds MemTotal: {r['state_exceeds_mem_total']})"
    )
    for rank, (peak, moved) in enumerate(
        zip(r["peak_rss_bytes_by_rank"], r["moved_bytes_per_step_by_kind_by_rank"])
    ):
        kinds = ", ".join(f"{k} {_fmt_gb(v)}" for k, v in moved.items() if v)
        print(f"  rank {rank}: peak RSS {_fmt_gb(peak)}; moved per step: {kinds}")
    print(
        f"  median running step {r['median_step_s']:.2f} s; compute {r['compute_s']:.2f} s, I/O lower bound of "
        f"the shared disk {r['io_lower_bound_s']:.2f} s: {r['step_vs_max_compute_io']:.2f}x of their max"
    )
    print(
        f"  first loss {r['first_loss']:.6f} (reference {r['reference_first_loss']:.6f}, bit-equal: "
        f"{r['first_loss_bit_equal']})"
    )
