"""The whole training state of a GPT sharded by FSDP2 over the ranks of one machine, each rank's shards on
the disk they share (issue 40): ``torchrun --nproc_per_node=2 -m benchmarks.bench_states --fsdp [--json]``.

Every rank is a torchrun process running this, in this order:

1. rank 0 alone: the disk (``benchmarks.bench_io``'s raw O_DIRECT write and read, as the single-process
   run measures it), the GPT's initial weights written as a safetensors file tensor by tensor
   (``benchmarks.gpt_weights``: the model is never in memory), and the reference first loss (a no-grad
   forward layer by layer: ``benchmarks.states_reference``);
2. every rank at once: the compute alone (one block's forward, backward and update timed, times the layer
   count, plus the embeddings and head), with the ranks sharing the cores as they do in training; the
   slowest rank's figure is the job's;
3. every rank: the GPT built on the meta device, ``fully_shard`` per block and at the root,
   ``to_empty`` (this rank's shards only), AdamW over the shards, ``teraio.States`` with the parameters,
   gradients and optimizer states on disk, ``load_pretrained`` of the weights file (each rank its blocks
   of every tensor: Note: [A checkpoint of an FSDP2 job] in teraio.states.sharded_checkpoint), each block
   compiled on its own, then ``--steps`` steps. Rank ``r`` trains on synthetic batch ``step * world + r``,
   so rank 0's first step sees the single-process run's first batch and weights: its loss must equal the
   reference bit for bit;
4. rank 0: the disk and the compute measured again (the faster disk and the smaller compute kept, as in
   the single-process run), then the report: per rank its peak resident memory (``VmHWM``, reset before
   each phase), bytes moved per step by kind and step times; for the job, the median running step
   against max(compute, I/O lower bound of the shared disk). Every rank's shards together are the model's
   state, and they move over the one disk, so the lower bound is the single-process run's: the bytes that
   must move per step over the raw write and read bandwidths.

The training state (32.8 GB at 2B) exceeds the machine's memory, so the ranks end by exiting rather than
``close()`` (which would bring every state back into memory) and each engine's exit hook removes its
files, as the single-process run does.
"""

from __future__ import annotations

import datetime
import math
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.states_phases import delta, io_by_kind, log
from benchmarks.states_reference import (
    LR,
    compute_alone,
    f32_bits,
    machine_info,
    meminfo,
    proc_status_bytes,
    reference_first_loss,
    reset_peak_rss,
    sizes,
)
from teraio.planner.model_states import io_lower_bound_s, offload_step_traffic
from teraio.tools.models.gpt import GPT, GPTConfig, synthetic_batch


def _one(value: Any) -> Any:
    """Rank 0's ``value`` on every rank."""
    out = [value]
    dist.broadcast_object_list(out, src=0)
    return out[0]


def _all(value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _prepare(cfg: GPTConfig, directory: Path, io_size: int, keep_free: int, seed: int) -> dict[str, Any]:
    """Step 1, on rank 0: the disk, the weights file, the reference loss."""
    from benchmarks import bench_io
    from benchmarks.states_phases import write_weights_phase
    from teraio.runtime.space import clean_stale_subdirs

    clean_stale_subdirs(directory)  # a killed run's offload files count against the free space otherwise
    size = sizes(cfg)
    needed = size["disk_bytes_needed"] + size["weight_bytes"]  # the states, and the weights file
    free = shutil.disk_usage(directory).free
    if free - needed - io_size < keep_free:
        raise RuntimeError(
            f"{directory} has {free / 1e9:.1f} GB free; the run needs {needed / 1e9:.1f} GB for the states, "
            f"gradients and the weights file and must leave {keep_free / 1e9:.1f} GB free: use fewer --layers"
        )
    _, disk = bench_io.run(directory, io_size, sizes=[io_size], repeats=2)
    log(f"raw write {disk['raw_write_gb_per_s']:.2f} GB/s, raw read {disk['raw_read_gb_per_s']:.2f} GB/s")
    work = Path(tempfile.mkdtemp(prefix="bench_states-ckpt-", dir=directory))
    written = write_weights_phase(cfg, seed, work / "gpt-init")
    t0 = time.perf_counter()
    ref = reference_first_loss(cfg, seed)
    log(f"reference loss {ref.item():.6f} ({time.perf_counter() - t0:.1f} s, layer by layer)")
    return {
        "disk": disk,
        "work": str(work),
        "weights": written["directory"],
        "written": written,
        "reference_first_loss": float(ref.item()),
        "reference_bits": f32_bits(ref),
    }


def _train_rank(cfg: GPTConfig, spec: dict[str, Any], weights: str) -> dict[str, Any]:
    """Step 3 on this rank: the sharded model loaded from the weights file, trained ``spec["steps"]``."""
    from torch.distributed.fsdp import fully_shard

    import teraio

    rank, world = dist.get_rank(), dist.get_world_size()
    peaks: dict[str, int] = {}
    can_reset = reset_peak_rss()
    with torch.device("meta"):
        model = GPT(cfg)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")  # this rank's shards only; their values come from the file
    model.train()
    if spec["cpu_malloc"] == "retain":  # as the single-process run (Note in teraio.platform.cpu_malloc)
        from teraio.platform.cpu_malloc import apply_cpu_malloc

        apply_cpu_malloc("retain")
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    be = teraio.backend(
        inner="eager",
        profiling=teraio.Profiling(steps=1, measure_memory=False),
        memory_budget=spec["budget"],
        solver="greedy",
        states=teraio.States(
            optimizer=opt,
            gradients=True,
            parameters=True,
            model=model,
            chunk_bytes=spec["chunk_bytes"],
            overlap_step=spec["overlap_step"],
        ),
        offload_dirs=[spec["dir"]],
        io_backend="posix",
    )
    t0 = time.perf_counter()
    loaded = be.states.load_pretrained(weights).as_dict()
    peaks["load"] = proc_status_bytes("VmHWM")
    log(f"rank {rank}: loaded its shards in {time.perf_counter() - t0:.1f} s")
    for block in model.blocks:
        block.compile(backend=be)
    rows = []
    before = io_by_kind(be)
    for step in range(spec["steps"]):
        idx, targets = synthetic_batch(cfg, step * world + rank)
        if can_reset:
            reset_peak_rss()
        t0 = time.perf_counter()
        loss = model(idx, targets)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        t4 = time.perf_counter()
        after = io_by_kind(be)
        moved = delta(before, after)
        before = after
        peaks[f"step{step}"] = proc_status_bytes("VmHWM")
        rows.append(
            {
                "step": step,
                "loss": float(loss.item()),
                "loss_bits": f32_bits(loss.detach()),
                "step_s": t4 - t0,
                "forward_s": t1 - t0,
                "backward_s": t2 - t1,
                "optimizer_step_s": t3 - t2,
                "peak_rss_bytes": peaks[f"step{step}"],
                "written_bytes": moved["written"],
                "read_bytes": moved["read"],
                "moved_bytes_by_kind": moved["moved"],
                "running": all(ph == "running" for ph in after["phase"]),
            }
        )
        del loss
        log(
            f"rank {rank} step {step}: {t4 - t0:.1f} s (fwd {t1 - t0:.1f}, bwd {t2 - t1:.1f}, opt.step "
            f"{t3 - t2:.1f}), peak RSS {peaks[f'step{step}'] / 1e9:.2f} GB, wrote "
            f"{sum(moved['written'].values()) / 1e9:.2f} GB, read {sum(moved['read'].values()) / 1e9:.2f} GB"
        )
    final = be.stats()
    residency = be.states.residency
    offloaded_params = residency.offloaded_nbytes() if residency is not None else 0
    # close() brings every state back into memory: only when this rank's share fits with room to spare
    # (the ranks share the machine); else the rank exits and the engine's exit hook removes its files.
    local_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    closes = 4 * local_bytes < 0.4 * meminfo().get("MemAvailable", 0) / int(
        os.environ.get("LOCAL_WORLD_SIZE", world)
    )
    if closes:
        be.close()
    return {
        "rank": rank,
        "steps": rows,
        "peak_rss_bytes": max(peaks.values()),
        "peak_rss_by_phase": peaks,
        "peak_rss_window_reset": can_reset,
        "load": loaded,
        "whole_step": final["whole_step"],
        "moved_bytes_by_kind_total": final["moved_bytes_by_kind"],
        "offloaded_parameter_bytes": offloaded_params,
        "threads": torch.get_num_threads(),
        "closed_with": "close()" if closes else "exit",
    }


def _faster_disk(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    keys = ("raw_write_gb_per_s", "raw_read_gb_per_s", "write_gb_per_s", "read_gb_per_s")
    return {**a, **{k: max(a[k], b[k]) for k in keys}}


def run_fsdp(
    config: GPTConfig,
    config_name: str,
    directory: Path,
    *,
    steps: int,
    io_size: int,
    chunk_bytes: str,
    keep_free: int,
    budget: str | None,
    cpu_malloc: str,
    overlap_step: bool = True,
    compute_reps: int = 3,
    seed: int = 0,
) -> dict[str, Any] | None:
    """The whole benchmark on this rank (the module docstring): the report on rank 0, None elsewhere."""
    from benchmarks import bench_io

    t_start = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    directory.mkdir(parents=True, exist_ok=True)
    size = sizes(config)
    prep: dict[str, Any] = {}
    if rank == 0:
        try:
            log(
                f"{config_name} over {world} ranks: {size['params'] / 1e9:.3f}e9 parameters, training state "
                f"{size['state_bytes'] / 1e9:.1f} GB; measuring the disk in {directory}"
            )
            prep = _prepare(config, directory, io_size, keep_free, seed)
        except Exception as exc:  # every rank hears it, not only rank 0
            prep = {"error": f"{type(exc).__name__}: {exc}"}
    prep = _one(prep)
    if "error" in prep:
        raise RuntimeError(f"rank 0: {prep['error']}")
    try:
        compute_before = _all(compute_alone(config, compute_reps, seed))
        spec = {"steps": steps, "budget": budget, "chunk_bytes": chunk_bytes, "cpu_malloc": cpu_malloc}
        spec["overlap_step"] = overlap_step
        spec["dir"] = str(directory)
        mine = _train_rank(config, spec, prep["weights"])
        dist.barrier()
        compute_after = _all(compute_alone(config, compute_reps, seed))
        ranks = _all(mine)
    finally:
        if rank == 0:
            shutil.rmtree(prep["work"], ignore_errors=True)
    if rank != 0:
        return None
    disk_after = bench_io.run(directory, io_size, sizes=[io_size], repeats=2)[1]
    disk = _faster_disk(prep["disk"], disk_after)
    # The job's compute: the slowest rank's (they run at once), the smaller of before and after training.
    compute_s = min(max(c["compute_s"] for c in compute_before), max(c["compute_s"] for c in compute_after))
    # A step ends when its slowest rank ends (FSDP2's collectives keep them in step).
    n = len(ranks[0]["steps"])
    running = [i for i in range(1, n) if all(r["steps"][i]["running"] for r in ranks)] or list(range(1, n))
    step_s = [max(r["steps"][i]["step_s"] for r in ranks) for i in running]
    median_step = statistics.median(step_s)
    kept: dict[str, int] = {}
    for r in ranks:
        for kind, nbytes in (
            ((r.get("whole_step") or {}).get("kept") or {}).get("kept_bytes_by_kind") or {}
        ).items():
            kept[kind] = kept.get(kind, 0) + nbytes
    traffic = offload_step_traffic(
        offloaded_param_nbytes=sum(r["offloaded_parameter_bytes"] for r in ranks) - kept.get("parameter", 0),
        grad_nbytes=size["gradient_bytes"],
        optimizer_state_nbytes=size["optimizer_state_bytes"] - kept.get("optimizer_state", 0),
        offload_gradients=True,
        optimizer_in_backward=False,
        lower_bound=True,
    )
    must_write = sum(t.write_nbytes for t in traffic.values())
    must_read = sum(t.read_nbytes for t in traffic.values())
    io_bound = io_lower_bound_s(
        must_write, must_read, disk["raw_write_gb_per_s"] * 1e9, disk["raw_read_gb_per_s"] * 1e9
    )
    bound = max(compute_s, io_bound)
    machine = machine_info()
    first = ranks[0]["steps"][0]
    per_step_bytes = [
        {
            kind: statistics.median(r["steps"][i]["moved_bytes_by_kind"].get(kind, 0) for i in running)
            for kind in ("activation", "parameter", "gradient", "optimizer_state")
        }
        for r in ranks
    ]
    return {
        "config": config_name,
        "gpt": asdict(config),
        **size,
        "world_size": world,
        "mem_total_bytes": machine["mem_total_bytes"],
        "state_exceeds_mem_total": size["state_bytes"] > machine["mem_total_bytes"],
        "peak_rss_bytes_by_rank": [r["peak_rss_bytes"] for r in ranks],
        "peak_rss_by_phase_by_rank": [r["peak_rss_by_phase"] for r in ranks],
        "peak_rss_sum_bytes": sum(r["peak_rss_bytes"] for r in ranks),
        "moved_bytes_per_step_by_kind_by_rank": per_step_bytes,
        "step_s": [max(r["steps"][i]["step_s"] for r in ranks) for i in range(n)],
        "running_step_s": step_s,
        "median_step_s": median_step,
        "compute_s": compute_s,
        "compute_by_rank_before": compute_before,
        "compute_by_rank_after": compute_after,
        "io_lower_bound_s": io_bound,
        "io_must_write_bytes": must_write,
        "io_must_read_bytes": must_read,
        "step_vs_max_compute_io": median_step / bound,
        "first_loss": first["loss"],
        "reference_first_loss": prep["reference_first_loss"],
        "first_loss_bit_equal": first["loss_bits"] == prep["reference_bits"],
        "losses_by_rank": [[s["loss"] for s in r["steps"]] for r in ranks],
        "losses_finite": all(math.isfinite(s["loss"]) for r in ranks for s in r["steps"]),
        "ranks": ranks,
        "weights_file": prep["written"],
        "disk": {
            k: disk[k] for k in ("raw_write_gb_per_s", "raw_read_gb_per_s", "write_gb_per_s", "read_gb_per_s")
        },
        "disk_before": {k: prep["disk"][k] for k in ("raw_write_gb_per_s", "raw_read_gb_per_s")},
        "disk_after": {k: disk_after[k] for k in ("raw_write_gb_per_s", "raw_read_gb_per_s")},
        "options": {
            "fsdp": "fully_shard per block and at the root",
            "inner": "eager",
            "memory_budget": budget,
            "states_chunk_bytes": chunk_bytes,
            "cpu_malloc": cpu_malloc,
            "overlap_step": overlap_step,
            "optimizer": f"AdamW(lr={LR})",
            "steps": steps,
            "threads_per_rank": ranks[0]["threads"],
        },
        "machine": machine,
        "wall_s": time.perf_counter() - t_start,
    }


def fsdp_main(args: Any, *, io_size: int, keep_free: int, config: GPTConfig) -> dict[str, Any] | None:
    """``bench_states --fsdp`` under torchrun: the process group, then :func:`run_fsdp`."""
    from teraio.runtime.config import default_offload_dir

    if "RANK" not in os.environ:
        raise RuntimeError(
            "--fsdp runs under torchrun: torchrun --nproc_per_node=2 -m benchmarks.bench_states --fsdp"
        )
    # A rank that failed leaves the others in a collective: they give up after this long.
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=20))
    try:
        if args.layers is not None:
            config = replace(config, layers=args.layers)
        directory = Path(args.dir) if args.dir is not None else default_offload_dir()
        report = run_fsdp(
            config,
            args.config,
            directory,
            steps=args.steps,
            io_size=io_size,
            chunk_bytes=args.chunk,
            keep_free=keep_free,
            budget=args.budget,
            cpu_malloc=args.cpu_malloc,
            overlap_step=not args.no_overlap,
        )
        # Rank 0 builds the report after the results' all-gather; the others wait for it here, so that
        # the last collective of every rank carries no tensor of Python's (docs/guide.md, "Ending a job").
        dist.barrier()
        return report
    finally:
        dist.destroy_process_group()
