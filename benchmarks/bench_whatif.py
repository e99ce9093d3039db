"""What-if at GPU scale: ``teraio estimate`` on Llama3-8B- and Llama3-70B-shaped models in TERAIO's
settings, the SSD-count sweep, the estimate checked against this machine, and published figures beside
ours with every difference explained. No GPU is measured: every GPU figure is an estimate.

Sections of the report (``benchmarks/results/gpu_whatif_<yyyymm>.md``):

1. cpu-local: the estimate of the built-in GPT against a real profile of it on this machine: saved
   activation bytes (equal, or the estimate is wrong), the rank correlation of per-op durations and the
   error of the step total.
2. ``teraio estimate hf:llama-70b --hardware h100-nvl-4x990pro``: wall time and peak RSS of the command,
   run as a subprocess under ``/usr/bin/time -v`` (the issue asks for 10 minutes and 16 GiB).
3. Llama3-8B (batch 1 and 4) and Llama3-70B (batch 1), fp32 (and fp32 with TF32 matmuls), one device's
   share of a 2-GPU run with the model states sharded ZeRO-3 style and streamed from the SSDs, on
   h100-nvl-4x990pro.
4. The SSD-count sweep: 1, 2, 4 and 8 drives.
5. Published figures beside ours: TERAIO, DeepSpeed's model-state estimator on its t5-3b example,
   SSDTrain.

    python -m benchmarks.bench_whatif [--out benchmarks/results/gpu_whatif_202611.md] [--json]
        [--time-limit 60] [--ssds 1 2 4 8] [--no-tf32] [--measure-cpu]

``--measure-cpu`` only times this machine's matmul rate, memory bandwidth and per-op overheads (the
``compute`` figures of the ``cpu-local`` preset) and prints them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from benchmarks.whatif_report import (
    PRESET,
    TERAIO_SETTINGS,
    to_markdown,
)
from teraio.planner.safe_io import OutputError, check_output_file, write_text

#: The report of a run made this month (``gpu_whatif_<yyyymm>.md``).
DEFAULT_OUT = f"benchmarks/results/gpu_whatif_{time.strftime('%Y%m')}.md"
SSD_COUNTS = (1, 2, 4, 8)
#: DeepSpeed's documented ZeRO-3 example: t5-3b on 1 node with 8 GPUs, GB per GPU as printed (GiB).
DEEPSPEED_T5_3B_GPU_GIB = {
    "params+optimizer offloaded": 0.12,
    "optimizer offloaded": 0.79,
    "none offloaded": 6.10,
}
DEEPSPEED_T5_3B_PARAMS = 2851e6  # "2851M total params, 32M largest layer params"


def machine_info() -> dict[str, Any]:
    import ortools
    import torch

    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "ortools": ortools.__version__,
        "pandas": pd.__version__,
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


# ------------------------------------------------------------------------------------- cpu-local
def _median_s(fn: Any, reps: int, warm: int = 3) -> float:
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_cpu_compute(reps: int = 10) -> dict[str, Any]:
    """This machine's ``compute`` figures for the cpu-local preset: matmul FLOP/s per dtype (median over
    the built-in GPT's matmul shapes), memory bandwidth of a large elementwise add (fresh output each
    time, as a graph allocates one), and the time of one tiny aten op and one view (the per-op
    overheads). Timed with the process's default threads."""
    import torch

    rates: dict[str, float] = {}
    shapes = [(4096, 384, 1152), (4096, 384, 1536), (4096, 1536, 384), (4096, 384, 4096)]
    for dtype in (torch.float32, torch.bfloat16):
        samples = []
        for m, k, n in shapes:
            a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
            samples.append(2 * m * k * n / _median_s(lambda a=a, b=b: torch.mm(a, b), reps))
        rates[str(dtype).removeprefix("torch.")] = statistics.median(samples)
    x, y = torch.randn(16 << 20), torch.randn(16 << 20)
    mem_bw = 3 * x.numel() * 4 / _median_s(lambda: torch.add(x, y), reps)
    tiny = torch.randn(4)
    calls = 5000

    def per_call(op: Any) -> float:
        def loop() -> None:
            for _ in range(calls):
                op()

        return _median_s(loop, max(3, reps // 2)) / calls

    return {
        "threads": torch.get_num_threads(),
        "matmul_flops_per_s": rates,
        "mem_bw_bytes_per_s": mem_bw,
        "kernel_overhead_s": per_call(lambda: torch.ops.aten.add.Tensor(tiny, tiny)),
        "view_overhead_s": per_call(lambda: torch.ops.aten.view.default(tiny, [2, 2])),
    }


def _ranks(x: np.ndarray) -> np.ndarray:
    return pd.Series(x).rank().to_numpy()


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation (average ranks for ties), without scipy."""
    if len(a) < 2:
        return float("nan")
    return float(np.corrcoef(_ranks(np.asarray(a, float)), _ranks(np.asarray(b, float)))[0, 1])


def _durations_against(est: Any, real: Any) -> dict[str, Any]:
    """An estimated profile's op durations against a measured one's: rank correlation and totals."""
    d_est = est.ops["duration_us"].to_numpy(float)
    d_real = real.ops["duration_us"].to_numpy(float)
    nf = real.num_fwd_ops
    real_step = float(real.meta["step_s"])
    est_step = float(d_est.sum()) / 1e6
    return {
        "spearman_ops": spearman(d_est, d_real),
        "spearman_fwd": spearman(d_est[:nf], d_real[:nf]),
        "spearman_bwd": spearman(d_est[nf:], d_real[nf:]),
        "estimated_step_s": est_step,
        "estimated_fwd_s": float(d_est[:nf].sum()) / 1e6,
        "estimated_bwd_s": float(d_est[nf:].sum()) / 1e6,
        "step_error": est_step / real_step - 1 if real_step > 0 else float("nan"),
        "largest_ops": _largest_ops(est, real),
    }


def cpu_local_check(
    config: str = "demo", profile_steps: int = 8, inner: str = "eager", compute_reps: int = 10
) -> dict[str, Any]:
    """A real profile of the built-in GPT ``config`` on this machine beside its estimate on ``cpu-local``:
    the saved tensors must be equal; the durations are compared op by op (rank correlation) and in total.

    The op durations are priced twice: with the shipped preset's compute figures, and with the same
    figures measured in this run just before the real profile (:func:`measure_cpu_compute`,
    ``compute_reps`` repetitions). On a shared machine the load moves both sides; the second column
    compares the cost model with a machine in the state the profile saw."""
    from teraio.planner.costmodel import compute_model_from_dict, load_preset
    from teraio.tools.estimate_target import build_target
    from teraio.tools.estimated_profile import SAVED_TENSOR_COLUMNS, capture_graphs, estimated_profile
    from teraio.tools.profile_workload import profile_workload
    from teraio.tools.workloads import builtin_workload

    preset = load_preset("cpu-local")
    now = measure_cpu_compute(compute_reps)
    same_run = compute_model_from_dict(
        {**preset.compute.to_dict(), **{k: v for k, v in now.items() if k != "threads"}}, "this run"
    )
    t0 = time.perf_counter()
    real = profile_workload(builtin_workload(config), profile_steps=profile_steps, inner=inner)[0]
    measured_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    graph = capture_graphs(build_target(f"builtin:{config}"), inner)[0]
    est = estimated_profile(graph, preset.compute, inner, device="estimate:cpu-local").profile
    estimated_s = time.perf_counter() - t1
    est_now = estimated_profile(graph, same_run, inner, device="estimate:this-run").profile
    cols = list(SAVED_TENSOR_COLUMNS)
    same_tensors = est.tensors[cols].reset_index(drop=True).equals(real.tensors[cols].reset_index(drop=True))
    from teraio.planner.lifetimes import analyse

    return {
        "config": config,
        "inner": inner,
        "profile_steps": profile_steps,
        "same_fingerprint": est.fingerprint == real.fingerprint,
        "same_saved_tensors": bool(same_tensors),
        "estimated_activation_bytes": est.activation_bytes(),
        "measured_activation_bytes": real.activation_bytes(),
        "estimated_unplanned_peak_bytes": int(analyse(est).baseline_peak_bytes),
        "measured_unplanned_peak_bytes": int(analyse(real).baseline_peak_bytes),
        "ops": len(real.ops),
        "measured_step_s": float(real.meta["step_s"]),
        "measured_fwd_s": float(real.meta["fwd_s"]),
        "measured_bwd_s": float(real.meta["bwd_s"]),
        "profile_wall_s": measured_s,
        "estimate_wall_s": estimated_s,
        **_durations_against(est, real),
        "preset_compute": preset.compute.to_dict(),
        "same_run_compute": now,
        "same_run": _durations_against(est_now, real),
    }


def _largest_ops(est: Any, real: Any, top: int = 6) -> list[dict[str, Any]]:
    """The measured profile's longest ops beside their estimates (where the model is right or wrong)."""
    rows = []
    real_ops = real.ops.sort_values("duration_us", ascending=False).head(top)
    for r in real_ops.itertuples():
        rows.append(
            {
                "op": r.name,
                "target": r.target,
                "phase": r.phase,
                "measured_us": float(r.duration_us),
                "estimated_us": float(est.ops["duration_us"].iat[int(r.idx)]),
            }
        )
    return rows


# ------------------------------------------------------------------------------------------ DeepSpeed
def deepspeed_t5_3b() -> dict[str, Any]:
    """teraio's model-state accounting on DeepSpeed's documented ZeRO-3 example (t5-3b, 8 GPUs), with the
    parameters counted on a fake-tensor T5 built from t5-3b's config (no weights)."""
    from teraio.planner.model_states import model_states
    from teraio.tools.estimate_target import build_target, count_parameters

    target = build_target("hf:t5-3b")
    total, largest = count_parameters(target.model)
    cases = {
        "params+optimizer offloaded": ("param", "grad", "optimizer_state"),
        "optimizer offloaded": ("grad", "optimizer_state"),
        "none offloaded": (),
    }
    rows = []
    for label, offload in cases.items():
        ours = model_states(
            total, largest_layer_params=largest, precision="fp16-mixed", gpus=8, zero_stage=3, offload=offload
        ).device_nbytes
        # DeepSpeed's own formula (``estimate_zero3_model_states_mem_needs``): 4 bytes per parameter of the
        # largest layer, plus 2 (optimizer offloaded) or 18 (nothing offloaded) bytes per parameter / GPUs.
        per_param = {"params+optimizer offloaded": 0, "optimizer offloaded": 2, "none offloaded": 18}[label]
        formula = 4 * largest + int(per_param * total / 8)
        published = DEEPSPEED_T5_3B_GPU_GIB[label]
        rows.append(
            {
                "case": label,
                "ours_gib": ours / 2**30,
                "deepspeed_formula_gib": formula / 2**30,
                "deepspeed_printed_gib": published,
                "vs_printed": ours / 2**30 / published - 1,
                "vs_formula": ours / formula - 1 if formula else 0.0,
                "prints_as": f"{ours / 2**30:.2f}",
            }
        )
    return {"params": total, "largest_layer_params": largest, "rows": rows}


# ------------------------------------------------------------------------------------------ estimates
def _time_v(cmd: list[str], env: dict[str, str]) -> tuple[subprocess.CompletedProcess, float, int | None]:
    """Run ``cmd``; wall seconds and peak RSS (bytes, from /usr/bin/time -v when it exists)."""
    time_bin = shutil.which("time") or ("/usr/bin/time" if os.path.exists("/usr/bin/time") else None)
    full = [time_bin, "-v", *cmd] if time_bin else cmd
    t0 = time.perf_counter()
    proc = subprocess.run(full, capture_output=True, text=True, env=env, check=False)
    wall_s = time.perf_counter() - t0
    rss = None
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    if m:
        rss = int(m.group(1)) * 1024
    return proc, wall_s, rss


def estimate_cli(target: str, out_dir: Path, *options: str, in_process: bool = False) -> dict[str, Any]:
    """``teraio estimate TARGET --out OUT_DIR --json OPTIONS...`` as a subprocess under ``/usr/bin/time
    -v``: its JSON summary, the command as a user types it, wall time and peak RSS. ``in_process`` runs the
    same command line in this process instead (the smoke test: no interpreter start-up; no RSS)."""
    argv = ["estimate", target, *options, "--out", str(out_dir), "--json"]
    if in_process:
        import contextlib
        import io

        from teraio.cli import main as teraio_main

        out, err = io.StringIO(), io.StringIO()
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = teraio_main(argv)
        wall_s, rss, stdout = time.perf_counter() - t0, None, out.getvalue()
        if code != 0:
            raise RuntimeError(f"teraio {' '.join(argv)} failed ({code}): {err.getvalue().strip()[-2000:]}")
    else:
        cmd = [sys.executable, "-m", "teraio", *argv]
        proc, wall_s, rss = _time_v(cmd, {**os.environ, "HF_HUB_OFFLINE": "1"})
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        stdout = proc.stdout
    summary = json.loads(stdout)
    shown = ["teraio", "estimate", target, *options, "--out", out_dir.name]
    return {"command": " ".join(shown), "summary": summary, "wall_s": wall_s, "peak_rss_bytes": rss}


def teraio_options(
    batch: int,
    *,
    time_limit_s: float,
    tf32: bool = False,
    layers: int | None = None,
    seq: int | None = None,
    solvers: tuple[str, ...] | None = None,
) -> tuple[str, ...]:
    """``teraio estimate`` options for TERAIO's settings (``TERAIO_SETTINGS``) on the H100 NVL preset."""
    s = TERAIO_SETTINGS
    return (
        "--hardware",
        PRESET,
        "--dtype",
        s["dtype"],
        "--gpus",
        str(s["gpus"]),
        "--batch",
        str(batch),
        "--seq",
        str(seq or s["seq"]),
        "--states",
        s["states"],
        "--time-limit",
        f"{time_limit_s:g}",
        *(["--tf32"] if tf32 else []),
        *(["--layers", str(layers)] if layers else []),
        *(["--solvers", ",".join(solvers)] if solvers else []),
    )


def _rows_of(
    model: str, precision: str, ssds: int, summary: dict[str, Any], plans: list[dict[str, Any]]
) -> list[dict]:
    """Report rows of one estimate's plans (``model`` names the model and its batch)."""
    g = summary["graphs"][0]
    traffic = summary["state_traffic_per_step"]
    state_in = sum(v["read_bytes"] for v in traffic.values())
    state_out = sum(v["write_bytes"] for v in traffic.values())
    rows = []
    for r in plans:
        row = {
            "model": model,
            "precision": precision,
            "ssds": ssds,
            "solver": r["solver"],
            "status": r["status"],
        }
        if "planned_peak_bytes" not in r:  # no plan: the solver's status and nothing else
            rows.append(row)
            continue
        rows.append(
            {
                **row,
                "params_b": summary["num_params"] / 1e9,
                "tokens": summary["settings"]["batch"] * summary["settings"]["seq"],
                "activation_gib": g["activation_bytes"] / 2**30,
                "unplanned_peak_gib": r["unplanned_peak_bytes"] / 2**30,
                "budget_gib": r["budget_bytes"] / 2**30,
                "planned_peak_gib": r["planned_peak_bytes"] / 2**30,
                "ideal_step_s": r["ideal_step_s"],
                "step_s": r["step_s"],
                "fraction_of_ideal": r["fraction_of_ideal"],
                "fraction_bound_with_states": r.get("fraction_of_ideal_bound_with_states"),
                "act_out_gib": r["activation_written_bytes"] / 2**30,
                "act_in_gib": r["activation_read_bytes"] / 2**30,
                "state_in_gib": state_in / 2**30,
                "state_out_gib": state_out / 2**30,
                "needed_act_bw_gbps": None
                if r["needed_ssd_bw_bytes_per_s"] is None
                else r["needed_ssd_bw_bytes_per_s"] / 1e9,
                "avg_bw_all_gbps": None
                if r.get("average_ssd_bw_needed_bytes_per_s") is None
                else r["average_ssd_bw_needed_bytes_per_s"] / 1e9,
                "solve_s": r["solve_s"],
            }
        )
    return rows


def ssd_sweep(
    out_dir: Path,
    summary: dict[str, Any],
    counts: tuple[int, ...],
    *,
    time_limit_s: float,
    preset: str = PRESET,
) -> dict[int, list[dict[str, Any]]]:
    """Re-plan an estimate's profile with ``counts`` drives (the same budget and model states); the plan
    rows as ``teraio estimate --json`` has them, by drive count."""
    from teraio.planner.costmodel import load_preset
    from teraio.planner.profile import Profile
    from teraio.planner.whatif import plan_outcomes
    from teraio.tools.estimate_report import io_seconds

    profile = Profile.load(out_dir / "profile")
    p = load_preset(preset)
    budget_arg = summary["budget"]
    traffic = summary["state_traffic_per_step"]
    state_bytes = sum(v["read_bytes"] + v["write_bytes"] for v in traffic.values())
    out: dict[int, list[dict[str, Any]]] = {}
    for n in counts:
        hw = p.hardware_with(ssds=n)
        ssd = hw.tier("ssd")
        rows = []
        for o in plan_outcomes(
            profile, hw, budget_arg, summary["settings"]["solvers"], time_limit_s=time_limit_s
        ):
            row = o.summary()
            if o.plan is not None:
                moved = o.plan.moved_bytes
                io_s = io_seconds(moved, moved, traffic, ssd)
                row["fraction_of_ideal_bound_with_states"] = o.ideal_step_s / max(
                    o.plan.predicted_step_s, io_s
                )
                row["average_ssd_bw_needed_bytes_per_s"] = (2 * moved + state_bytes) / o.ideal_step_s
                row["ssd_aggregate_bw_bytes_per_s"] = ssd.total_write_bw_bytes_per_s
            rows.append(row)
        out[n] = rows
    return out


#: SSDTrain's comparison runs: a GPT (GPT-2 XL, batch 8 x 1024, bf16 mixed precision) on one GPU with one
#: SSD, at the smallest peak with no predicted stall.
SSDTRAIN_PRESETS = ("h100-sxm-1ssd", "a100-40g-g10")


def ssdtrain_comparison(
    out_dir: Path,
    *,
    time_limit_s: float,
    layers: int | None = None,
    presets: tuple[str, ...] = SSDTRAIN_PRESETS,
    in_process: bool = False,
) -> list[dict[str, Any]]:
    """How far activation offloading lowers the activations' peak with no predicted stall (budget "auto"),
    beside SSDTrain's -47%: GPT-2 XL in bf16 on one GPU with one SSD (``presets``)."""
    out = []
    for preset in presets:
        res = estimate_cli(
            "hf:gpt2-xl",
            out_dir / preset,
            "--hardware",
            preset,
            "--dtype",
            "bfloat16",
            "--batch",
            "8",
            "--seq",
            "1024",
            "--budget",
            "auto",
            "--solvers",
            "greedy",
            "--states",
            "resident",
            "--time-limit",
            f"{time_limit_s:g}",
            *(["--layers", str(layers)] if layers else []),
            in_process=in_process,
        )
        g = res["summary"]["graphs"][0]
        r = g["plans"][0]
        planned = "planned_peak_bytes" in r
        out.append(
            {
                "preset": preset,
                "command": res["command"],
                "unplanned_peak_bytes": g["unplanned_peak_bytes"],
                "activation_bytes": g["activation_bytes"],
                "planned_peak_bytes": r.get("planned_peak_bytes"),
                "fraction_of_ideal": r.get("fraction_of_ideal"),
                "step_peak_cut": 1 - r["planned_peak_bytes"] / g["unplanned_peak_bytes"] if planned else None,
                "activation_peak_cut": 1 - r["activation_peak_bytes"] / r["unplanned_activation_peak_bytes"]
                if planned and r["unplanned_activation_peak_bytes"]
                else None,
            }
        )
    return out


# ------------------------------------------------------------------------------------------ the run
#: The estimates of section 3: (model, batch per device). Llama3-8B at batch 1 fits the device without
#: offloading activations, so it also runs at batch 4, where they do not fit.
RUNS: tuple[tuple[str, int], ...] = (("hf:llama-8b", 1), ("hf:llama-8b", 4), ("hf:llama-70b", 1))
#: The runs the SSD-count sweep re-plans.
SWEPT: tuple[tuple[str, int], ...] = (("hf:llama-8b", 4), ("hf:llama-70b", 1))
#: The command the issue asks to finish within 10 minutes and 16 GiB, as a user types it.
ISSUE_COMMAND = ("hf:llama-70b", "--hardware", PRESET)


def run(
    runs: tuple[tuple[str, int], ...] = RUNS,
    ssd_counts: tuple[int, ...] = SSD_COUNTS,
    *,
    swept: tuple[tuple[str, int], ...] = SWEPT,
    time_limit_s: float = 60.0,
    tf32: bool = True,
    layers: int | None = None,
    seq: int | None = None,
    cpu_config: str = "demo",
    cpu_profile_steps: int = 8,
    cpu_compute_reps: int = 10,
    ssdtrain: bool = True,
    ssdtrain_presets: tuple[str, ...] = SSDTRAIN_PRESETS,
    solvers: tuple[str, ...] | None = None,
    issue_command: bool = True,
    in_process: bool = False,
    workdir: str | None = None,
) -> dict[str, Any]:
    """Every section of the report as data (module docstring). ``layers``/``seq``, ``solvers`` (default:
    ``teraio estimate``'s greedy and ilp) and ``ssdtrain_presets`` shrink the work (the smoke test);
    ``issue_command`` times the issue's 70B command as a user runs it (a subprocess, always); the other
    estimates run as subprocesses too, or with ``in_process`` in this process (the smoke test)."""
    from teraio.planner.costmodel import load_preset

    preset = load_preset(PRESET)
    preset_drives = preset.hardware.tier("ssd").count
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_info(),
        "settings": dict(TERAIO_SETTINGS),
        "time_limit_s": time_limit_s,
        "preset": {
            "name": preset.name,
            "drives": preset_drives,
            "drive_bw_bytes_per_s": preset.hardware.tier("ssd").read_bw_bytes_per_s,
            "link_bw_bytes_per_s": preset.link_bw_bytes_per_s,
        },
    }
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        base = Path(tmp)
        results["cpu_local"] = cpu_local_check(cpu_config, cpu_profile_steps, compute_reps=cpu_compute_reps)
        results["deepspeed"] = deepspeed_t5_3b()
        if issue_command:
            target, *options = ISSUE_COMMAND
            res = estimate_cli(target, base / "issue70b", *options)
            results["issue_command"] = {k: v for k, v in res.items() if k != "summary"} | {
                "capture_s": res["summary"]["capture_s"],
                "plan_s": res["summary"]["plan_s"],
                "plans": res["summary"]["graphs"][0]["plans"],
            }
        rows: list[dict[str, Any]] = []
        sweeps: dict[str, Any] = {}
        info: dict[str, Any] = {}
        for model, batch in runs:
            label = f"{model} b{batch}"
            variants = [("fp32", False)] + ([("fp32+tf32", True)] if tf32 else [])
            for precision, use_tf32 in variants:
                out_dir = base / f"{model.replace(':', '_')}-b{batch}-{precision}"
                options = teraio_options(
                    batch, time_limit_s=time_limit_s, tf32=use_tf32, layers=layers, seq=seq, solvers=solvers
                )
                res = estimate_cli(model, out_dir, *options, in_process=in_process)
                summary = res["summary"]
                info[f"{label} {precision}"] = {k: v for k, v in res.items() if k != "summary"} | {
                    "capture_s": summary["capture_s"],
                    "plan_s": summary["plan_s"],
                    "budget_note": summary["budget_note"],
                    "states_note": summary["states_note"],
                }
                rows += _rows_of(label, precision, preset_drives, summary, summary["graphs"][0]["plans"])
                if precision == "fp32" and (model, batch) in swept:
                    others = tuple(n for n in ssd_counts if n != preset_drives)
                    sweep = ssd_sweep(out_dir, summary, others, time_limit_s=time_limit_s)
                    if preset_drives in ssd_counts:  # the estimate itself planned with the preset's drives
                        sweep[preset_drives] = summary["graphs"][0]["plans"]
                    sweeps[label] = {
                        n: _rows_of(label, precision, n, summary, sweep[n]) for n in sorted(sweep)
                    }
        results["rows"] = rows
        results["sweeps"] = sweeps
        results["runs"] = info
        if ssdtrain:
            results["ssdtrain"] = ssdtrain_comparison(
                base / "gpt2-xl",
                time_limit_s=min(time_limit_s, 60.0),
                layers=layers,
                presets=ssdtrain_presets,
                in_process=in_process,
            )
    return results


def load_results(path: str) -> dict[str, Any]:
    """The results an earlier run printed with ``--json``, as :func:`run` returned them (JSON made the
    sweeps' drive counts strings)."""
    from teraio.planner.safe_io import load_json

    results = load_json(path, what="bench_whatif results")
    results["sweeps"] = {m: {int(n): rows for n, rows in by.items()} for m, by in results["sweeps"].items()}
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_whatif", description=__doc__.splitlines()[0])
    p.add_argument(
        "--out", default=DEFAULT_OUT, help=f"the report to write (default {DEFAULT_OUT}; replaced)"
    )
    p.add_argument("--ssds", type=int, nargs="+", default=list(SSD_COUNTS), help="drive counts to sweep")
    p.add_argument("--time-limit", type=float, default=60.0)
    p.add_argument("--no-tf32", action="store_true", help="skip the fp32+tf32 variants")
    p.add_argument(
        "--cpu-config", default="demo", help="the built-in GPT for the cpu-local check (default demo)"
    )
    p.add_argument("--measure-cpu", action="store_true", help="only measure this machine's compute figures")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument(
        "--from-json",
        metavar="FILE",
        help="write the report from the results an earlier run printed with --json (nothing is run again)",
    )
    args = p.parse_args(argv)
    if args.measure_cpu:
        print(json.dumps({"machine": machine_info(), "compute": measure_cpu_compute()}, indent=2))
        return 0
    try:
        check_output_file(args.out, overwrite=True, option="--out")
    except OutputError as exc:
        print(f"bench_whatif: {exc}", file=sys.stderr)
        return 2
    if args.from_json:
        results = load_results(args.from_json)
    else:
        results = run(
            RUNS,
            tuple(args.ssds),
            time_limit_s=args.time_limit,
            tf32=not args.no_tf32,
            cpu_config=args.cpu_config,
        )
    write_text(args.out, to_markdown(results), overwrite=True)
    if args.json:
        print(json.dumps(results, indent=2, default=str))
    else:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
