"""Sharded training with teraio: FSDP2 with every block compiled on its own (torchtitan's order), and the
embeddings and head as graphs of their own (``backend.compile(model)``).

    torchrun --nproc_per_node=2 examples/train_fsdp.py --steps 8 --run-dir runs/fsdp
    torchrun --nproc_per_node=2 examples/train_fsdp.py --states offload
    torchrun --nproc_per_node=2 examples/train_fsdp.py --states offload --steps 4 --save ckpt/step-4
    torchrun --nproc_per_node=2 examples/train_fsdp.py --states offload --steps 8 --resume ckpt/step-4

``--states offload`` keeps each rank's shards of the parameters, gradients and AdamW states on its own
disk between their uses (each parameter shard read back before FSDP2 gathers it), under one budget over
the whole step; ``--states optimizer`` moves AdamW's states alone. With it, ``--save`` writes a checkpoint
after the last step (each rank its own shards) and ``--resume`` loads one before the first step and goes
on from its step count.

``fully_shard`` frees each block's gathered parameters after its forward and gathers them again for its
backward, outside teraio's graphs: teraio measures that memory in the first running step and plans for
it. One block graph runs once per block per step, with a plan per call: the first block's activations,
idle longest, are moved; the last block's, used again at once, stay.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import teraio
from teraio.tools.models.gpt import GPT, GPTConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--budget", default="85%")
    parser.add_argument("--offload-dir", default=None, help="may say {local_rank}; default: teraio's own")
    parser.add_argument("--run-dir", default=None, help="each rank writes RUN_DIR/rank<r>/")
    parser.add_argument(
        "--inner",
        choices=["inductor", "eager"],
        default="inductor",
        help="the compiler teraio hands the planned graphs to (eager: the FX path, compiles in seconds)",
    )
    parser.add_argument(
        "--solver",
        default="ilp",
        help="the planner's solver: ilp (CP-SAT, optimal within its time limit), greedy, pipeline",
    )
    parser.add_argument(
        "--disabled", action="store_true", help="enabled=False: the same run without teraio's plan"
    )
    parser.add_argument(
        "--states",
        choices=["keep", "optimizer", "offload"],
        default="keep",
        help="offload: each rank's shards of parameters, gradients and AdamW states on disk between their "
        "uses; optimizer: AdamW's states alone",
    )
    parser.add_argument(
        "--save", default=None, metavar="DIR", help="with --states offload: a checkpoint after the last step"
    )
    parser.add_argument(
        "--resume",
        default=None,
        metavar="DIR",
        help="with --states offload: load this checkpoint before the first step and go on from its step",
    )
    args = parser.parse_args()
    if (args.save or args.resume) and args.states != "offload":
        parser.error("--save and --resume need --states offload (the checkpoints of backend.states)")

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)
    cfg = GPTConfig(layers=2, hidden=64, heads=2, seq=64, batch=4, vocab=256)
    model = GPT(cfg).to(device)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # over the shards (DTensors)
    states = None
    if args.states == "offload":
        # min_param_bytes=0: this GPT's shards are all under the 64 KiB that stay in memory by default
        states = teraio.States(optimizer=opt, gradients=True, parameters=True, model=model, min_param_bytes=0)
    elif args.states == "optimizer":
        states = teraio.States(optimizer=opt)
    backend = teraio.backend(
        memory_budget=args.budget,
        offload_dirs=[args.offload_dir] if args.offload_dir else None,
        run_dir=args.run_dir,
        inner=args.inner,
        solver=args.solver,
        enabled=not args.disabled,
        states=states,
    )
    backend.compile(model)  # each block, the embeddings and the head as graphs of their own, in place
    rank = dist.get_rank()
    first = 0
    if args.resume:  # every rank loads its own blocks of the checkpoint's tensors, before the first step
        first = backend.states.load_checkpoint(args.resume)["committed_steps"]
    loss = None
    for step in range(first, args.steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g).to(device)
        loss = model(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        loss.backward()
        opt.step()
        opt.zero_grad()
    if args.save:
        backend.states.save_checkpoint(args.save)  # every rank calls it; each writes its own shards
    if loss is not None:
        print(f"rank {rank}: loss at step {args.steps} {float(loss.detach()):.6f}", flush=True)
    st = backend.stats()
    print(
        f"rank {rank}: {st['running_steps']} running steps, {st['moved_bytes_per_step']} bytes moved per step, "
        f"measured peak {st['measured_peak_bytes']} (predicted {st['predicted_peak_bytes']}), "
        f"median step {st['step_s']} s",
        flush=True,
    )
    if st["whole_step"] is not None:
        whole = st["whole_step"]
        print(
            f"rank {rank}: whole step measured {whole['measured_peak_bytes']} bytes (predicted "
            f"{whole['predicted_peak_bytes']}, budget {whole['budget_bytes']}); moved by kind "
            f"{st['moved_bytes_by_kind']}",
            flush=True,
        )
    backend.close()
    # The last collective carries no tensor of Python's: see docs/guide.md, "Ending a job".
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
