"""One rank of a distributed training run, for test_distributed.py (torch.multiprocessing.spawn, gloo).

Each rank trains the tiny GPT loss model on its own batches and writes what must be bit-identical between
a run with a memory budget and the same run with ``enabled=False`` (every loss, a digest of every
gradient, the final parameters), its backend's figures, and which files its offload directory holds after
``close()``.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import signal
import tempfile
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

#: The backend's figures a run reports.
STAT_KEYS = (
    "running_steps",
    "moved_bytes_per_step",
    "offloaded_bytes",
    "prefetched_bytes",
    "measured_peak_bytes",
    "predicted_peak_bytes",
    "graphs",
    "moved_bytes_by_kind",
)


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _files_under(path: str) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in Path(path).rglob("*") if p.is_file())


def worker(
    rank: int,
    world: int,
    rendezvous: str,
    mode: str,
    enableds: list[bool | tuple[str, bool, dict[str, Any]]],
    out_dir: str,
    options: dict[str, Any],
) -> None:
    """Train once per value of ``enableds`` in this process (one process start for every run). A value is
    ``enabled``, or ``(name, enabled, more_options)`` for runs of one job that differ in their options;
    each run's result is ``{mode}-{int(enabled)}-{rank}.json`` or ``{mode}-{name}-{rank}.json``."""
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group(
        "gloo", init_method=rendezvous, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    torch.use_deterministic_algorithms(True)
    for run in enableds:
        name, enabled, more = (str(int(run)), run, {}) if isinstance(run, bool) else run
        torch._dynamo.reset()
        train = _train_fsdp_states if mode == "fsdp-states" else _train
        train(rank, world, mode, enabled, out_dir, {**options, **more}, f"{mode}-{name}-{rank}.json")
        dist.barrier()
    dist.destroy_process_group()


def _train(
    rank: int, world: int, mode: str, enabled: bool, out_dir: str, options: dict[str, Any], out_name: str
) -> None:
    torch.manual_seed(0)
    import teraio
    from tests.teraio.loops import GPTLoss, _tokens

    if options.get("inner") == "inductor":
        # Inductor's embedding backward adds its rows in a nondeterministic order otherwise: the reference
        # and the planned run would differ in the last bits whatever teraio does.
        torch.use_deterministic_algorithms(True)

    # Note: [A checkpoint of a DDP job] in teraio.states.checkpoint_ranks: a resumed run builds its model on the
    # meta device and loads every tensor from the checkpoint the run before it saved.
    resume = options.get("resume")
    ckpt_root = Path(out_dir).parent
    if resume:
        with torch.device("meta"):
            model = GPTLoss()
    else:
        model = GPTLoss()
    first = int(options.get("first", 0))
    steps = int(options.get("steps", 6))
    kill_at = options.get("kill_rank_at")
    # teraio.States needs the optimizer when the backend is built (DDP keeps the model's parameters).
    opt_first = torch.optim.AdamW(model.parameters(), lr=1e-3) if options.get("states") else None
    states = None
    if opt_first is not None and options.get(
        "offload_parameters"
    ):  # read after close(), which brings them back
        states = teraio.States(optimizer=opt_first, parameters=True, model=model, min_param_bytes=0)
    elif opt_first is not None:
        states = teraio.States(optimizer=opt_first)
    backend = teraio.backend(
        states=states,
        memory_budget=options.get("budget", "85%"),
        inner=options.get("inner", "eager"),
        solver=options.get("solver", "greedy"),
        profiling=teraio.Profiling(steps=1),
        io_backend="posix",
        enabled=enabled,
        offload_dirs=options["offload_dirs"],
        run_dir=options.get("run_dir"),
    )
    if mode.startswith("ddp"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        torch._dynamo.config.optimize_ddp = {
            "ddp-split": "ddp_optimizer",
            "ddp-nosplit": False,
            "ddp-compiled-autograd": "python_reducer",
        }[mode]
        # Small buckets, so that DDP's graph optimizer splits the tiny model into several graphs.
        dist._DEFAULT_FIRST_BUCKET_BYTES = 16 * 1024
        if resume:
            backend.states.load_checkpoint(ckpt_root / resume)
        # Loaded from the same checkpoint on every rank, the parameters are on disk: nothing to broadcast.
        compiled = torch.compile(DDP(model, bucket_cap_mb=0.02, init_sync=not resume), backend=backend)
        params = model.parameters()
    elif mode == "fsdp-per-block":
        from torch.distributed.fsdp import fully_shard

        for block in model.gpt.blocks:
            block.compile(backend=backend)
            fully_shard(block)
        fully_shard(model)
        compiled = model
        params = model.parameters()
    else:
        raise ValueError(mode)
    opt = opt_first if opt_first is not None else torch.optim.AdamW(params, lr=1e-3)
    make = _tokens(64, 2)
    losses, grads = [], []
    try:
        for step in range(first, steps):
            if kill_at is not None and rank == 1 and step == kill_at:
                os.kill(
                    os.getpid(), signal.SIGKILL
                )  # no cleanup at all: the next run's start finds the files
            loss = compiled(*make(step * world + rank, 32))
            # Compiled autograd once teraio runs its plans (Note: [Compiled autograd runs its own copy of
            # the backward] in teraio.lifecycle.runner): python_reducer then hands DDP's reduction to it.
            if mode == "ddp-compiled-autograd" and step >= options.get("compiled_autograd_from", 2):
                with torch._dynamo.compiled_autograd._enable(torch.compile(backend="eager")):
                    loss.backward()
            else:
                loss.backward()
            losses.append(float(loss).hex())
            grads.append(_digest({n: _full(p.grad) for n, p in model.named_parameters()}))
            opt.step()
            opt.zero_grad()
            if options.get("save_at") == step + 1:
                backend.states.save_checkpoint(ckpt_root / options["save_to"])
        refused = None
        if options.get("refused_save"):  # rank 1 alone has a gradient pending: every rank must raise
            first_param = next(model.parameters())
            if rank == 1:
                first_param.grad = torch.zeros_like(first_param)
            try:
                backend.states.save_checkpoint(ckpt_root / options["refused_save"])
            except Exception as exc:  # noqa: BLE001 - recorded for the test
                refused = f"{type(exc).__name__}: {exc}"
            first_param.grad = None
        state = {n: _full(p) for n, p in model.named_parameters()}
        st = backend.stats()
        counters = dict(torch._dynamo.utils.counters.get("compiled_autograd", {}))
    finally:
        backend.close()
    result = {
        "losses": losses,
        "grads": grads,
        "params": _digest(state),
        "stats": {k: st[k] for k in STAT_KEYS},
        "compiled_autograd": counters,
        "refused_save": refused,
        "leftover_files": [f for d in options["offload_dirs_resolved"][rank] for f in _files_under(d)],
    }
    Path(out_dir, out_name).write_text(json.dumps(result))


def _full(t: Any) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def model_digests(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, str]:
    """Digests of the full parameters and optimizer states (each rank's shards gathered)."""
    opt_state = opt.state_dict()["state"]
    return {
        "params": _digest({n: _full(p) for n, p in model.named_parameters()}),
        "optimizer_states": _digest(
            {f"{i}/{k}": _full(v).reshape(-1) for i, e in opt_state.items() for k, v in e.items()}
        ),
    }


def _checkpoint_failures(states: Any, rank: int, base: str) -> dict[str, Any]:
    """Every rank hears one rank's failure to save, and nothing is left behind (Note: [A checkpoint of an
    FSDP2 job] in teraio.states.sharded_checkpoint): a target that exists (rank 0's check), and rank 1
    failing to write its files."""
    from teraio.states import checkpoint
    from teraio.states.errors import CheckpointError

    out: dict[str, Any] = {}
    for case in ("exists", "rank 1 fails"):
        target = Path(base, case.replace(" ", "-"))
        if case == "exists" and rank == 0:
            target.mkdir()
        real = checkpoint.write_rank_files

        def failing(*args: Any, real: Any = real, **kwargs: Any) -> Any:
            if rank == 1:
                raise OSError(28, "No space left on device")
            return real(*args, **kwargs)

        if case == "rank 1 fails":
            checkpoint.write_rank_files = failing  # type: ignore[assignment]
        try:
            states.save_checkpoint(target)
            out[case] = "saved"
        except CheckpointError as exc:
            out[case] = str(exc)
        finally:
            checkpoint.write_rank_files = real  # type: ignore[assignment]
        dist.barrier()
        out[f"{case}: left"] = sorted(os.listdir(base))
    return out


def _train_fsdp_states(
    rank: int, world: int, mode: str, enabled: bool, out_dir: str, options: dict[str, Any], out_name: str
) -> None:
    """FSDP2 (``fully_shard`` per block and at the root, each block compiled on its own) with AdamW, and
    ``options["states"]``: None, "optimizer" (its states on disk), "whole" (parameters, gradients and
    states on disk); ``options["model"]``: "gpt" (the tiny GPT) or "hf-llama" (a Llama-shaped model);
    ``options["variant"]``: "accumulated" for 2 micro-batches a step that FSDP2 accumulates into the
    sharded gradients, bf16 compute (``MixedPrecisionPolicy``) and ``reshard_after_forward=False``.
    Checkpoints (``states="whole"``): ``options["save_at"]`` saves to ``options["checkpoint"]`` after that
    many steps; ``options["load"]`` loads a checkpoint before the first step and goes on from its step
    count (``options["restore_rng"]``, default True); ``options["save_failures"]`` tries saves that fail;
    ``options["digest_at"]`` records the digests after that many steps."""
    from torch.distributed.fsdp import fully_shard

    import teraio

    torch.manual_seed(0)
    if options.get("model", "gpt") == "hf-llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        from tests.teraio.models import LLAMA_LIKE, _lm_loss

        llama = LlamaForCausalLM(LlamaConfig(**LLAMA_LIKE))
        blocks = list(llama.model.layers)
        model: torch.nn.Module = llama

        def loss_of(step: int) -> torch.Tensor:
            g = torch.Generator().manual_seed(1000 * step + rank)
            ids = torch.randint(0, 256, (2, 32), generator=g)
            return _lm_loss(llama(input_ids=ids).logits, ids)

    else:
        from tests.teraio.loops import GPTLoss, _tokens

        model = GPTLoss()
        blocks = list(model.gpt.blocks)
        make = _tokens(64, 2)

        def loss_of(step: int) -> torch.Tensor:
            return model(*make(step * world + rank, 32))

    shard_options: dict[str, Any] = {}
    micro_batches = 1
    if options.get("variant") == "accumulated":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        shard_options = {
            "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
            "reshard_after_forward": False,
        }
        micro_batches = 2
    for block in blocks:
        fully_shard(block, **shard_options)
    fully_shard(model, **shard_options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    kind = options.get("states")
    states = None
    if kind == "optimizer":
        states = teraio.States(optimizer=opt)
    elif kind == "whole":
        states = teraio.States(optimizer=opt, gradients=True, parameters=True, model=model, min_param_bytes=0)
    backend = teraio.backend(
        states=states,
        memory_budget=options.get("budget"),
        inner=options.get("inner", "eager"),
        solver="greedy",
        profiling=teraio.Profiling(steps=1),
        io_backend="posix",
        enabled=enabled,
        offload_dirs=options["offload_dirs"],
    )
    for block in blocks:
        block.compile(backend=backend)
    losses, grads = [], []
    checkpoints: dict[str, Any] = {}
    start = 0
    try:
        if options.get("load"):
            report = backend.states.load_checkpoint(
                options["load"], restore_rng=options.get("restore_rng", True)
            )
            start = report["committed_steps"]
            checkpoints["loaded"] = model_digests(model, opt)
        for step in range(start, int(options.get("steps", 8))):
            for micro in range(micro_batches):
                loss = loss_of(step * micro_batches + micro)
                loss.backward()
                losses.append(float(loss.detach()).hex())
            if options.get("clip"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            # A read of an offloaded shard's gradient is served (Note: [A sharded tensor is guarded as a
            # whole] in teraio.states.shards), each rank taking part in the gather.
            grads.append(_digest({n: _full(p.grad) for n, p in model.named_parameters()}))
            opt.step()
            opt.zero_grad()
            if step + 1 == options.get("digest_at"):
                checkpoints["at_step"] = model_digests(model, opt)
            if step + 1 == options.get("save_at"):
                backend.states.save_checkpoint(options["checkpoint"])
                checkpoints["at_save"] = model_digests(model, opt)
        if options.get("save_failures"):
            checkpoints["failures"] = _checkpoint_failures(backend.states, rank, options["save_failures"])
        # Copies read back from disk, DTensors as without teraio.
        opt_state = opt.state_dict()["state"]
        state = {n: _full(p) for n, p in model.named_parameters()}
        st = backend.stats()
    finally:
        backend.close()
    whole = st.get("whole_step") or {}
    result = {
        "losses": losses,
        "grads": grads,
        "params": _digest(state),
        "optimizer_states": _digest(
            {f"{i}/{k}": _full(v).reshape(-1) for i, e in opt_state.items() for k, v in e.items()}
        ),
        "stats": {k: st[k] for k in STAT_KEYS},
        "whole_step": whole,
        "leftover_files": [f for d in options["offload_dirs_resolved"][rank] for f in _files_under(d)],
        "checkpoints": checkpoints,
    }
    Path(out_dir, out_name).write_text(json.dumps(result))


def rendezvous_file(directory: Path) -> str:
    """Where one job's ranks meet: a file of its own (torch's FileStore), not a TCP port. A port found
    free and handed to the job could be taken by any other process on the machine (another test run's
    job) before rank 0 bound it, and a job that reuses a file would read the last one's keys."""
    return (Path(directory) / f"rendezvous-{uuid.uuid4().hex}").resolve().as_uri()


def scratch() -> str:
    return tempfile.mkdtemp(prefix="teraio-dist-")
