"""Training a GPT whose training state does not fit in memory: ``teraio.States`` (issue 23).

A GPT of about 2 billion parameters (hidden 2048, 40 layers: 8 GB of fp32 weights, 8 GB of gradients and
16 GB of AdamW moments, 32 GB of training state on a 24 GiB machine) trains for a few steps with
``teraio.backend(states=teraio.States(optimizer=opt, gradients=True))``: the moments and the gradients
live on disk between their uses and ``opt.step()`` streams them chunk by chunk. By default
(``--offload-parameters``, kept for older scripts) the blocks' weights are on disk between their uses too
(``teraio.States(parameters=True)``) and each block is compiled on its own (the embedding and head, run
eagerly, stay), as the issue asks of every inactive tensor. ``--keep-parameters`` keeps the parameters
resident and compiles the whole model as one graph: the weights are then the floor of the peak, and
every gradient arrives at once at the end of the compiled backward.

One run, in this order, on the same directory:

1. the disk: ``benchmarks.bench_io``'s raw O_DIRECT write and read of one file (``--io-size``), the
   bandwidths the step's I/O lower bound is priced with;
2. the reference: the first step's loss computed by a no-grad forward over the same initial weights,
   layer by layer (each layer built from the same random stream as the model, used, and freed: one
   layer's weights in memory at a time), and the step's compute alone (forward, backward and AdamW
   update of one resident layer, timed and multiplied by the layer count, plus the embedding and head);
3. the training, in a fresh child process (so its peak resident memory, ``VmHWM``, is its own): the
   backend with ``inner="eager"`` (an Inductor compile of a 2B-parameter graph takes far too long on 2
   cores), ``teraio.Profiling(steps=1)`` and ``memory_budget=None`` (activations are not offloaded: at
   batch 1 and 128 tokens they are well under 1 GB; nothing is planned). The first step compiles and
   profiles and is reported apart; the step time is the median of the steps after it.

``--budget B`` gives the backend a ``memory_budget`` of ``B`` for the whole step (parameters,
gradients, optimizer states and activations): the plan keeps in memory the weights and moments that fit
(Note: [The whole-step budget keeps some states in memory] in teraio.states.residency), and the I/O lower
bound counts only what it leaves on disk.

``--optimizer-in-backward`` updates each parameter inside backward
(``teraio.States(optimizer_in_backward=True)``): no gradient is offloaded, and with the parameters on disk
(the default) a block's weights are updated while its backward holds them, so the step reads none.

The training process keeps freed memory for reuse (``--cpu-malloc retain``, the default, as ``teraio
demo`` does; Note: [Freed CPU memory and step time] in teraio.platform.cpu_malloc): on this project's VM memory
given back to the kernel costs more to touch again than the reads that fill it (docs/measured_facts.md,
"Fresh memory on this VM"), a cost a GPU's caching allocator does not have. ``--cpu-malloc release``
measures with the C library's defaults.

The I/O lower bound of a step is the bytes that must move (each gradient written once and read once by
the step unless updated inside backward, each moment read once and written once, with the parameters
on disk (the default) each block weight written once and read twice, for the forward and the backward)
priced at the raw bandwidths: write bytes / raw write bandwidth + read bytes / raw read
bandwidth (one device: a write and a read do not add bandwidth). The compute alone and the raw disk are
measured before training and again after it; the goal uses the smaller compute and the faster disk (the
report keeps both measurements), since load from anything else only inflates them.

``--from-checkpoint`` starts as a user with a pretrained checkpoint larger than memory would (issue 39):
the GPT's initial weights are first written as a safetensors file without ever holding the model
(``benchmarks.gpt_weights``: the submodules built one at a time from the same seed, in ``GPT.__init__``'s
order, each streamed into the file and dropped); the training process builds the model on the meta
device, loads it with ``backend.states.load_pretrained`` (each offloaded parameter straight to its slot
on disk), trains, and after the last step writes ``backend.states.save_checkpoint`` into the run's
private directory (removed at the end). ``peak_rss_by_phase`` then has ``load`` and ``save`` beside the
steps, and ``from_checkpoint`` reports each phase's time and bytes against the raw bandwidths of the same
run and its peak RSS against the largest running step's.

    python -m benchmarks.bench_states [--dir DIR] [--config 2b|tiny] [--steps 4] [--keep-parameters]
                                      [--optimizer-in-backward] [--budget B] [--cpu-malloc release]
                                      [--from-checkpoint] [--json] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

# Page-aligned torch allocations (O_DIRECT reads without a bounce copy); torch reads it at first use.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch  # noqa: E402

from benchmarks.states_phases import (  # noqa: E402
    checkpoint_report,
    delta,
    io_by_kind,
    load_phase,
    log,
    save_phase,
    write_weights_phase,
)
from benchmarks.states_reference import (  # noqa: E402
    LR,
    build_model,
    compute_alone,
    f32_bits,
    machine_info,
    meminfo,
    proc_status_bytes,
    reference_first_loss,
    reset_peak_rss,
    sizes,
)
from benchmarks.states_tables import print_fsdp_table, print_table  # noqa: E402
from benchmarks.step_overlap import EngineMark, overlap_summary, phase_bound, phase_figures, step_figures  # noqa: E402
from teraio.planner.model_states import io_lower_bound_s, offload_step_traffic  # noqa: E402
from teraio.planner.safe_io import OutputError, check_output_file, write_json  # noqa: E402
from teraio.tools.models.gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30

CONFIGS: dict[str, GPTConfig] = {
    # 2.05e9 parameters: 32.8 GB of fp32 weights, gradients and AdamW moments.
    "2b": GPTConfig(layers=40, hidden=2048, heads=16, seq=128, batch=1, vocab=8192),
    # Seconds: the smoke test.
    "tiny": GPTConfig(layers=2, hidden=64, heads=4, seq=32, batch=2, vocab=256),
}


# -- the training child ------------------------------------------------------------------------------
def train_child(spec: dict[str, Any]) -> dict[str, Any]:
    """The training run (in a fresh process: :func:`main` ``--train-child``)."""
    import teraio

    cfg = GPTConfig(**spec["cfg"])
    ckpt = spec.get("from_checkpoint")
    peaks: dict[str, int] = {}
    can_reset = reset_peak_rss()
    t0 = time.perf_counter()
    if ckpt:
        # --from-checkpoint: no byte of the model in memory; load_pretrained gives each parameter its
        # memory (or its disk slot) below. GPT has no buffer, so nothing is left on meta (Note: [Buffers
        # the model computes] in teraio.states.loading).
        with torch.device("meta"):
            model = GPT(cfg)
    else:
        model = build_model(cfg, spec["seed"])
    model.train()
    build_s = time.perf_counter() - t0
    peaks["build"] = proc_status_bytes("VmHWM")
    rss_after_build = proc_status_bytes("VmRSS")
    cpu_malloc = "release"
    if spec.get("cpu_malloc") == "retain":
        # Note: [Freed CPU memory and step time] in teraio.platform.cpu_malloc: every fetched state, gradient and
        # parameter is a fresh allocation, faulted in and zeroed by the kernel inside its O_DIRECT read
        # unless freed blocks are reused. Set after the model is built, so the blocks the model was built
        # in (mapped on their own) still go back to the system when its parameters leave memory.
        from teraio.platform.cpu_malloc import apply_cpu_malloc

        cpu_malloc = apply_cpu_malloc("retain")
    log(f"model built in {build_s:.1f} s, RSS {rss_after_build / 1e9:.2f} GB")
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    be = teraio.backend(
        inner="eager",
        profiling=teraio.Profiling(steps=1, measure_memory=False),
        # --budget: the whole step's (Note: [The whole-step budget keeps some states in memory] in
        # teraio.states.residency); the greedy plans the activations (an ILP over a 2B-parameter profile would
        # spend the run's time planning).
        memory_budget=spec.get("budget"),
        solver="greedy",
        states=teraio.States(
            optimizer=opt,
            # Updated inside backward, a gradient is freed at once: there is none to offload.
            gradients=not spec["optimizer_in_backward"],
            optimizer_in_backward=spec["optimizer_in_backward"],
            parameters=spec["offload_parameters"],
            overlap_step=spec.get("overlap_step", True),
            # load_pretrained and save_checkpoint need the model, whichever parameters move.
            model=model if spec["offload_parameters"] or ckpt else None,
            chunk_bytes=spec["chunk_bytes"],
        ),
        offload_dirs=[spec["dir"]],
        io_backend="posix",
    )
    load: dict[str, Any] | None = None
    if ckpt:
        # Before any compile: a loaded parameter keeps its object through torch.utils.swap_tensors, which
        # nothing else may hold yet (Note: [A loaded parameter keeps its object] in
        # teraio.states.loading).
        load, peaks["load"] = load_phase(be, ckpt["weights"], can_reset)
    if spec["offload_parameters"]:
        # Each block its own graph (torchtitan's order): one block's weights fetched at a time, and each
        # backward returns one block's gradients.
        for block in model.blocks:
            block.compile(backend=be)
        compiled = model
    else:
        compiled = torch.compile(model, backend=be)
    # The resident memory when autograd accumulates the step's first gradient: a compiled backward is one
    # autograd node, which returns every gradient at once, before any of them can be written.
    first_grad_rss: list[int] = []

    def on_grad(_: torch.Tensor) -> None:
        if not first_grad_rss:
            first_grad_rss.append(proc_status_bytes("VmRSS"))

    for prm in model.parameters():
        prm.register_post_accumulate_grad_hook(on_grad)
    steps = []
    before = io_by_kind(be)
    engine_before = EngineMark.now(be.states.engine)
    for step in range(spec["steps"]):
        idx, targets = synthetic_batch(cfg, step)
        if can_reset:
            reset_peak_rss()
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        loss = compiled(idx, targets)
        t1 = time.perf_counter()
        mark_backward = EngineMark.now(be.states.engine)
        rss_before_backward = proc_status_bytes("VmRSS")
        first_grad_rss.clear()
        loss.backward()
        clip_norm = None
        if spec.get("clip") is not None:  # between backward and step, as every LLM recipe clips
            clip_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), spec["clip"]))
        t2 = time.perf_counter()
        mark_step = EngineMark.now(be.states.engine)
        opt.step()
        t3 = time.perf_counter()
        mark_step_end = EngineMark.now(be.states.engine)
        opt.zero_grad(set_to_none=True)  # drops the gradients' disk copies: no I/O
        t4 = time.perf_counter()
        cpu_s = time.process_time() - cpu0
        engine_after = EngineMark.now(be.states.engine)
        waits = step_figures(engine_before, engine_after, t4 - t0)
        waits.update(
            phase_figures(
                [engine_before, mark_backward, mark_step, mark_step_end], [t1 - t0, t2 - t1, t3 - t2]
            )
        )
        engine_before = engine_after
        hwm = proc_status_bytes("VmHWM")
        after = io_by_kind(be)
        moved = delta(before, after)
        before = after
        state_stats = be.states.stats()
        steps.append(
            {
                "step": step,
                "loss": float(loss.item()),
                "loss_bits": f32_bits(loss.detach()),
                "step_s": t4 - t0,
                "forward_s": t1 - t0,
                "backward_s": t2 - t1,  # with --clip, the clip's call too
                "clip_norm": clip_norm,
                "optimizer_step_s": t3 - t2,
                "zero_grad_s": t4 - t3,
                # benchmarks.step_overlap: what the step waited on and what the disk did meanwhile.
                **waits,
                "cpu_s": cpu_s,
                "peak_rss_bytes": hwm,
                "rss_after_bytes": proc_status_bytes("VmRSS"),
                "rss_before_backward_bytes": rss_before_backward,
                "rss_at_first_gradient_bytes": first_grad_rss[0] if first_grad_rss else 0,
                "written_bytes": moved["written"],
                "read_bytes": moved["read"],
                "moved_bytes_by_kind": moved["moved"],
                "step_peak_resident_state_bytes": state_stats["step_peak_resident_state_bytes"],
                "chunks": len(be.states.last_step.chunks) if be.states.last_step else 0,
                # Every graph runs its final compilation (not profiling): a running step.
                "running": all(ph == "running" for ph in after["phase"]),
            }
        )
        peaks[f"step{step}"] = hwm
        del loss
        log(
            f"step {step}: {t4 - t0:.1f} s (fwd {t1 - t0:.1f}, bwd {t2 - t1:.1f}, opt.step {t3 - t2:.1f}), "
            f"peak RSS {hwm / 1e9:.2f} GB (RSS {rss_before_backward / 1e9:.2f} GB before backward, "
            f"{(first_grad_rss or [0])[0] / 1e9:.2f} GB at its first gradient), wrote {sum(moved['written'].values()) / 1e9:.2f} GB, "
            f"read {sum(moved['read'].values()) / 1e9:.2f} GB"
        )
    save: dict[str, Any] | None = None
    if ckpt:
        save, peaks["save"] = save_phase(be, ckpt["checkpoint"], can_reset)
    final = be.stats()
    state_stats = be.states.stats()
    engine = be.states.engine.stats()
    # close() brings every optimizer state back into memory (the states would then be in memory as
    # without teraio): with states larger than memory that cannot succeed, so the run ends by exiting,
    # and the engines' exit hook removes the offload files (Note in teraio.runtime.space).
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    states_resident = weights + state_stats["written_bytes"]["optimizer_state"] // max(1, len(steps))
    closes = states_resident < 0.8 * meminfo().get("MemAvailable", 0)
    result = {
        "steps": steps,
        "build_s": build_s,
        "rss_after_build_bytes": rss_after_build,
        "peak_rss_bytes": max(peaks.values()),
        "peak_rss_by_phase": peaks,
        "peak_rss_window_reset": can_reset,
        "backend_phase": final["phase"],
        "running_steps": final["running_steps"],
        "moved_bytes_by_kind_total": final["moved_bytes_by_kind"],
        "whole_step": final["whole_step"],
        "states_stats": state_stats,
        "io_path": engine.io_path,
        "read_path_bytes": {
            "direct": engine.direct_read_nbytes,
            "bounce": engine.bounced_read_nbytes,
            "buffered": engine.buffered_read_nbytes,
        },
        "checksum": be.states.engine.config.checksum,
        "cpu_malloc": cpu_malloc,
        "closed_with": "close()" if closes else "exit",
        "load": load,
        "save": save,
    }
    if closes:
        be.close()
    return result


def run_train_child(spec: dict[str, Any]) -> dict[str, Any]:
    """Run :func:`train_child` in a fresh interpreter; its result comes back through a private file."""
    with tempfile.TemporaryDirectory(prefix="bench_states-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.bench_states",
            "--train-child",
            str(spec_path),
            str(out_path),
        ]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, check=False)
        if proc.returncode != 0:
            how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit code {proc.returncode}"
            hint = " (SIGKILL: out of memory?)" if proc.returncode == -9 else ""
            raise RuntimeError(f"the training process failed with {how}{hint}")
        return json.loads(out_path.read_text())


# -- the run -------------------------------------------------------------------------------------------
def leftovers(directory: Path) -> list[str]:
    """teraio's own subdirectories left in ``directory`` (its offload files live in them), and
    --from-checkpoint's run directories (a run killed before removing its model file and checkpoint)."""
    if not directory.is_dir():
        return []
    ours = ("teraio-", ".teraio-new-", "bench_states-ckpt-")
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(ours))


def run(
    config: str = "2b",
    directory: str | os.PathLike[str] | None = None,
    *,
    steps: int = 4,
    layers: int | None = None,
    io_size: int = GIB,
    io_repeats: int = 2,
    compute_reps: int = 3,
    chunk_bytes: str = "64MiB",
    keep_free: int = 8 * GIB,
    seed: int = 0,
    offload_parameters: bool = True,
    optimizer_in_backward: bool = False,
    budget: str | None = None,
    cpu_malloc: str = "retain",
    clip: float | None = None,
    from_checkpoint: bool = False,
    overlap_step: bool = True,
) -> dict[str, Any]:
    """The whole benchmark (see the module docstring); returns the report."""
    from benchmarks import bench_io
    from teraio.runtime.config import default_offload_dir

    cfg = CONFIGS[config]
    if layers is not None:
        cfg = replace(cfg, layers=layers)
    directory = Path(directory) if directory is not None else default_offload_dir()
    directory.mkdir(parents=True, exist_ok=True)
    size = sizes(cfg)
    free = shutil.disk_usage(directory).free
    # --from-checkpoint: the initial weights' file and the checkpoint (weights and moments) too.
    files_needed = 2 * size["weight_bytes"] + size["optimizer_state_bytes"] if from_checkpoint else 0
    needed = size["disk_bytes_needed"] + files_needed
    if free - needed - io_size < keep_free:
        raise RuntimeError(
            f"{directory} has {free / 1e9:.1f} GB free; the run needs {needed / 1e9:.1f} GB for the states and "
            f"gradients{' and the model and checkpoint files' if from_checkpoint else ''} and must leave "
            f"{keep_free / 1e9:.1f} GB free: use fewer --layers"
        )
    machine = machine_info()
    t_start = time.perf_counter()
    log(
        f"{config}: {size['params'] / 1e9:.3f}e9 parameters, training state {size['state_bytes'] / 1e9:.1f} GB, "
        f"MemTotal {machine['mem_total_bytes'] / 1e9:.1f} GB; measuring the disk in {directory}"
    )
    _, disk = bench_io.run(directory, io_size, sizes=[io_size], repeats=io_repeats)
    log(f"raw write {disk['raw_write_gb_per_s']:.2f} GB/s, raw read {disk['raw_read_gb_per_s']:.2f} GB/s")
    t0 = time.perf_counter()
    ref_loss = reference_first_loss(cfg, seed)
    reference_s = time.perf_counter() - t0
    log(f"reference loss {ref_loss.item():.6f} ({reference_s:.1f} s, layer by layer)")
    compute = compute_alone(cfg, compute_reps, seed)
    log(f"compute alone {compute['compute_s']:.2f} s per step")
    spec = {
        "cfg": asdict(cfg),
        "seed": seed,
        "steps": steps,
        "dir": str(directory),
        "chunk_bytes": chunk_bytes,
        "offload_parameters": offload_parameters,
        "optimizer_in_backward": optimizer_in_backward,
        "budget": budget,
        "cpu_malloc": cpu_malloc,
        "clip": clip,
        "overlap_step": overlap_step,
    }
    work: Path | None = None
    written: dict[str, Any] | None = None
    try:
        if from_checkpoint:
            # The model's file and the checkpoint on the disk the offload files use (and the raw
            # bandwidths were measured on), in a private directory of this run.
            work = Path(tempfile.mkdtemp(prefix="bench_states-ckpt-", dir=directory))
            written = write_weights_phase(cfg, seed, work / "gpt-init")
            spec["from_checkpoint"] = {
                "weights": written["directory"],
                "checkpoint": str(work / "checkpoint"),
            }
        child = run_train_child(spec)
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
        left = leftovers(directory)
    # Both figures of max(compute, I/O lower bound) are measured again after training, and the smaller
    # compute and the faster disk are used: anything else running on the machine only ever inflates
    # them, and a larger figure would make the goal easier (one compute figure taken right after the
    # reference run measured 27.3 s against 12.5-14.4 s; benchmarks/results/states_*_202611.md).
    compute_after = compute_alone(cfg, compute_reps, seed)
    _, disk_after = bench_io.run(directory, io_size, sizes=[io_size], repeats=io_repeats)
    log(
        f"after training: compute alone {compute_after['compute_s']:.2f} s per step, raw write "
        f"{disk_after['raw_write_gb_per_s']:.2f} GB/s, raw read {disk_after['raw_read_gb_per_s']:.2f} GB/s"
    )
    compute_before = compute
    compute = min(compute_before, compute_after, key=lambda c: c["compute_s"])
    disk_before = disk
    disk = {
        **disk_before,
        "raw_write_gb_per_s": max(disk_before["raw_write_gb_per_s"], disk_after["raw_write_gb_per_s"]),
        "raw_read_gb_per_s": max(disk_before["raw_read_gb_per_s"], disk_after["raw_read_gb_per_s"]),
        "write_gb_per_s": max(disk_before["write_gb_per_s"], disk_after["write_gb_per_s"]),
        "read_gb_per_s": max(disk_before["read_gb_per_s"], disk_after["read_gb_per_s"]),
    }
    rows = child["steps"]
    # The running steps: after the first (compile and profile), every graph in its final compilation.
    running = [r for r in rows[1:] if r["running"]] or rows[1:]
    step_s = [r["step_s"] for r in running]
    median_step = statistics.median(step_s)
    # What must move per step (the embedding and head run eagerly and stay resident, so only the blocks'
    # weights move); the streamed step's own read of the weights is not counted: updating inside
    # backward avoids it.
    # With --budget, what the plan keeps in memory does not move.
    kept = ((child.get("whole_step") or {}).get("kept") or {}).get("kept_bytes_by_kind") or {}
    traffic = offload_step_traffic(
        offloaded_param_nbytes=(size["block_weight_bytes"] if offload_parameters else 0)
        - kept.get("parameter", 0),
        grad_nbytes=size["gradient_bytes"],
        optimizer_state_nbytes=size["optimizer_state_bytes"] - kept.get("optimizer_state", 0),
        offload_gradients=not optimizer_in_backward,
        optimizer_in_backward=optimizer_in_backward,
        lower_bound=True,
    )
    must_write = sum(t.write_nbytes for t in traffic.values())
    must_read = sum(t.read_nbytes for t in traffic.values())
    wbw, rbw = disk["raw_write_gb_per_s"] * 1e9, disk["raw_read_gb_per_s"] * 1e9
    io_lower_bound = io_lower_bound_s(must_write, must_read, wbw, rbw)
    # The same bytes at the engine's own figures from the same measurement (offload of an ordinary
    # tensor, fetch into a fresh one): what teraio's I/O path gets, page faults and checksums included.
    io_bound_engine = io_lower_bound_s(
        must_write, must_read, disk["write_gb_per_s"] * 1e9, disk["read_gb_per_s"] * 1e9
    )
    measured_written = statistics.median(sum(r["written_bytes"].values()) for r in running)
    measured_read = statistics.median(sum(r["read_bytes"].values()) for r in running)
    bound = max(compute["compute_s"], io_lower_bound)
    overlap = overlap_summary(running)
    # benchmarks.step_overlap.phase_bound: the share of the blocks' update the next forward runs is the
    # offloaded weights' (the kept ones are updated in opt.step()).
    overlapped = bool(
        (child.get("whole_step") or {}).get("overlap_step", overlap_step and offload_parameters)
    )
    in_forward = 0.0
    if overlapped and not optimizer_in_backward and size["block_weight_bytes"]:
        in_forward = 1.0 - kept.get("parameter", 0) / size["block_weight_bytes"]
    phases_bound = (
        phase_bound(
            compute,
            cfg.layers,
            overlap,
            disk["raw_read_gb_per_s"],
            disk["raw_write_gb_per_s"],
            in_forward,
            optimizer_in_backward,
        )
        if "forward_read_gb" in overlap
        else None
    )
    phases = child["peak_rss_by_phase"]
    running_peak = max((phases[f"step{r['step']}"] for r in running), default=0)
    checkpoint = (
        checkpoint_report(written, child, phases, running_peak, wbw, rbw) if from_checkpoint else None
    )
    return {
        "config": config,
        "gpt": asdict(cfg),
        **size,
        "mem_total_bytes": machine["mem_total_bytes"],
        "state_exceeds_mem_total": size["state_bytes"] > machine["mem_total_bytes"],
        "peak_rss_bytes": child["peak_rss_bytes"],
        "peak_rss_vs_mem_total": child["peak_rss_bytes"] / machine["mem_total_bytes"],
        "peak_rss_by_phase": child["peak_rss_by_phase"],
        "rss_after_build_bytes": child["rss_after_build_bytes"],
        "step_s": [r["step_s"] for r in rows],
        "running_step_s": step_s,
        "median_step_s": median_step,
        "first_step_s": rows[0]["step_s"],
        "compute_s": compute["compute_s"],
        "compute": compute,
        "compute_before_s": compute_before["compute_s"],
        "compute_after_s": compute_after["compute_s"],
        "io_lower_bound_s": io_lower_bound,
        "io_bound_at_engine_rates_s": io_bound_engine,
        "io_must_write_bytes": must_write,
        "io_must_read_bytes": must_read,
        "measured_written_bytes_per_step": measured_written,
        "measured_read_bytes_per_step": measured_read,
        "step_vs_io_lower_bound": median_step / io_lower_bound,
        # benchmarks.step_overlap: the split of the step, what it waited on, the disk's idle time.
        "overlap": overlap,
        # benchmarks.step_overlap.phase_bound: the bound the step's phases allow (forward, backward with
        # the clip, opt.step() one after the other), and the median step against it.
        "phase_bound": phases_bound,
        "step_vs_phase_bound": median_step / phases_bound["phase_bound_s"] if phases_bound else None,
        # teraio's stats()["whole_step"] at the end: the kept items, whether the step overlapped.
        "whole_step": child.get("whole_step"),
        "read_bytes_vs_must_read": measured_read / must_read if must_read else None,
        "written_bytes_vs_must_write": measured_written / must_write if must_write else None,
        "step_vs_max_compute_io": median_step / bound,
        "within_1_3x_of_max_compute_io": median_step <= 1.3 * bound,
        "first_loss": rows[0]["loss"],
        "reference_first_loss": float(ref_loss.item()),
        "first_loss_bit_equal": rows[0]["loss_bits"] == f32_bits(ref_loss),
        "losses": [r["loss"] for r in rows],
        "losses_finite": all(math.isfinite(r["loss"]) for r in rows),
        "per_step": rows,
        "disk": {
            k: disk[k]
            for k in (
                "dir",
                "size_nbytes",
                "raw_write_gb_per_s",
                "raw_read_gb_per_s",
                "raw_read_fresh_buffer_gb_per_s",
                "write_gb_per_s",
                "read_gb_per_s",
                "io_path",
                "read_path",
                "fio",
            )
        },
        "disk_before": {k: disk_before[k] for k in DISK_RATES},
        "disk_after": {k: disk_after[k] for k in DISK_RATES},
        "training": {k: v for k, v in child.items() if k not in ("steps", "peak_rss_by_phase")},
        "reference_s": reference_s,
        "leftovers": left,
        # The largest peak RSS of a running step: the yardstick of every phase's (issue 39: at most 1.25x).
        "peak_rss_running_step_bytes": running_peak,
        "from_checkpoint": checkpoint,
        "options": {
            "inner": "eager",
            "memory_budget": budget,
            "profile_steps": 1,
            "offload_gradients": not optimizer_in_backward,
            "optimizer_in_backward": optimizer_in_backward,
            "offload_parameters": offload_parameters,
            "compiled": "each block" if offload_parameters else "the whole model",
            "states_chunk_bytes": chunk_bytes,
            "cpu_malloc": child.get("cpu_malloc", "release"),
            "clip_grad_norm": clip,
            "from_checkpoint": from_checkpoint,
            "overlap_step": overlap_step,
            "optimizer": f"AdamW(lr={LR})",
            "steps": steps,
        },
        "machine": machine,
        "loadavg_at_end": os.getloadavg(),
        "wall_s": time.perf_counter() - t_start,
    }


#: The rates measured before and after training; the report's ``disk`` holds the faster of each.
DISK_RATES = (
    "raw_write_gb_per_s",
    "raw_read_gb_per_s",
    "raw_read_fresh_buffer_gb_per_s",
    "write_gb_per_s",
    "read_gb_per_s",
    "read_path",
)


def main(argv: list[str] | None = None) -> int:
    from teraio.runtime import parse_nbytes

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--dir", default=None, help="where the offloaded state goes (default: teraio's per-user dir)"
    )
    p.add_argument("--config", default="2b", choices=sorted(CONFIGS))
    p.add_argument("--layers", type=int, default=None, help="override the config's layer count")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps; the first compiles (default 4)")
    p.add_argument("--io-size", default="1GiB", help="file size of the raw disk measurement")
    p.add_argument("--chunk", default="64MiB", help="states_chunk_bytes")
    p.add_argument("--keep-free", default="8GiB", help="refuse to start unless this much disk stays free")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", default=None, help="also write the JSON report here (replaced if it exists)")
    p.add_argument(
        "--offload-parameters",
        action="store_true",
        help="the blocks' weights on disk too (teraio.States(parameters=True)), each block compiled on its "
        "own: the default, kept for older scripts",
    )
    p.add_argument(
        "--keep-parameters",
        action="store_true",
        help="the parameters stay resident and the whole model is one graph (the default before 2026-11-27)",
    )
    p.add_argument(
        "--optimizer-in-backward",
        action="store_true",
        help="update each parameter inside backward (teraio.States(optimizer_in_backward=True)): no gradient "
        "is offloaded",
    )
    p.add_argument(
        "--budget",
        default=None,
        help="memory_budget of the whole step (parameters, gradients, states and activations; e.g. 14GB): "
        "the plan keeps in memory the weights and moments that fit (default: none, everything streams)",
    )
    p.add_argument(
        "--cpu-malloc",
        choices=("release", "retain"),
        default="retain",
        help="retain (default, as teraio demo does): the training process keeps freed memory for reuse "
        "(teraio.platform.cpu_malloc), so fetched tensors are not faulted in and zeroed again, as a GPU's caching "
        "allocator would not; resident memory then stays at its high mark. release: the C library's "
        "defaults",
    )
    p.add_argument(
        "--clip",
        type=float,
        default=None,
        metavar="MAX_NORM",
        help="torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM) between backward and opt.step() "
        "every step (the offloaded gradients' norms are taken before they are written: no extra I/O)",
    )
    p.add_argument(
        "--from-checkpoint",
        action="store_true",
        help="write the GPT's initial weights as a safetensors file tensor by tensor (the model never in "
        "memory), build the model on the meta device, load it with backend.states.load_pretrained, train, "
        "and save_checkpoint after the last step; reports the load and save phases (issue 39)",
    )
    p.add_argument(
        "--no-overlap",
        action="store_true",
        help="teraio.States(overlap_step=False): the whole optimizer step runs in opt.step(), after backward "
        "(the step before issue 41's overlap, for comparison)",
    )
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="under torchrun (torchrun --nproc_per_node=2 -m benchmarks.bench_states --fsdp): the GPT sharded "
        "by FSDP2 over the ranks, each rank's parameter, gradient and optimizer-state shards on the shared "
        "disk, loaded from a weights file into the shards (benchmarks.states_fsdp, issue 40)",
    )
    p.add_argument("--train-child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.train_child is not None:
        spec_path, out_path = args.train_child
        result = train_child(json.loads(Path(spec_path).read_text()))
        Path(out_path).write_text(json.dumps(result))
        return 0
    try:
        if args.steps < 2:
            raise ValueError("--steps must be at least 2 (the first compiles and profiles)")
        if args.layers is not None and args.layers < 1:
            raise ValueError("--layers must be at least 1")
        if args.budget is not None:
            from teraio.planner.budget import parse_budget

            parse_budget(args.budget, "--budget")
        io_size = parse_nbytes(args.io_size, what="--io-size")
        keep_free = parse_nbytes(args.keep_free, what="--keep-free")
        if args.out is not None:
            check_output_file(args.out, overwrite=True, option="--out")
        if args.clip is not None and not args.clip > 0:
            raise ValueError(f"--clip must be a positive max norm, not {args.clip}")
        if args.clip is not None and args.optimizer_in_backward:
            raise ValueError(
                "--clip needs the gradients after backward; --optimizer-in-backward applies each inside it"
            )
        if args.keep_parameters and args.offload_parameters:
            raise ValueError("--keep-parameters and --offload-parameters contradict each other: give one")
        if args.fsdp:
            given = [
                flag
                for flag, on in (
                    ("--keep-parameters", args.keep_parameters),
                    ("--optimizer-in-backward", args.optimizer_in_backward),
                    ("--clip", args.clip is not None),
                    ("--from-checkpoint", args.from_checkpoint),
                )
                if on
            ]
            if given:
                raise ValueError(
                    f"--fsdp takes {given[0]} not yet: it moves the whole state and loads the weights file"
                )
    except (ValueError, OutputError) as exc:
        print(f"bench_states: {exc}", file=sys.stderr)
        return 2
    if args.fsdp:
        from benchmarks.states_fsdp import fsdp_main

        try:
            fsdp_report = fsdp_main(args, io_size=io_size, keep_free=keep_free, config=CONFIGS[args.config])
        except Exception as exc:  # one line, not a traceback
            print(f"bench_states: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 2
        if fsdp_report is not None:  # rank 0
            _emit(args, fsdp_report, print_fsdp_table)
        return 0
    try:
        report = run(
            args.config,
            args.dir,
            steps=args.steps,
            layers=args.layers,
            io_size=io_size,
            chunk_bytes=args.chunk,
            keep_free=keep_free,
            offload_parameters=not args.keep_parameters,
            budget=args.budget,
            optimizer_in_backward=args.optimizer_in_backward,
            cpu_malloc=args.cpu_malloc,
            clip=args.clip,
            from_checkpoint=args.from_checkpoint,
            overlap_step=not args.no_overlap,
        )
    except Exception as exc:  # one line, not a traceback
        print(f"bench_states: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    _emit(args, report, print_table)
    return 0


def _emit(args: argparse.Namespace, report: dict[str, Any], table: Any) -> None:
    """The report to ``--out``, and as JSON (``--json``) or a table on stdout."""
    if args.out:
        write_json(args.out, report, overwrite=True)
    if args.json:
        print(json.dumps(report, default=str))
    else:
        table(report)


if __name__ == "__main__":
    sys.exit(main())
