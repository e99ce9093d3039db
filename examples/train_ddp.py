"""Data-parallel training with teraio on every rank: DDP, launched by torchrun.

    torchrun --nproc_per_node=2 examples/train_ddp.py --steps 8 --run-dir runs/ddp

Each rank profiles and plans for its own memory; the ranks agree on when they plan and on the budget
(the smallest rank's), and each writes its offload files under its own directory (``{local_rank}``).
On GPUs the process group is NCCL and each rank uses its local GPU; on CPU it is gloo.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

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
        choices=["keep", "offload"],
        default="keep",
        help="offload: AdamW's states on disk between steps",
    )
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)  # the same initial weights on every rank
    cfg = GPTConfig(layers=2, hidden=64, heads=2, seq=64, batch=4, vocab=256)
    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    backend = teraio.backend(
        memory_budget=args.budget,
        offload_dirs=[args.offload_dir] if args.offload_dir else None,
        run_dir=args.run_dir,
        inner=args.inner,
        solver=args.solver,
        enabled=not args.disabled,
        states=teraio.States(optimizer=opt) if args.states == "offload" else None,
    )
    compiled = torch.compile(DDP(model), backend=backend)
    rank = dist.get_rank()
    for step in range(args.steps):
        g = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own batch
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g).to(device)
        loss = compiled(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        loss.backward()
        opt.step()
        opt.zero_grad()
    st = backend.stats()
    print(
        f"rank {rank}: {st['running_steps']} running steps, {st['moved_bytes_per_step']} bytes moved per step, "
        f"measured peak {st['measured_peak_bytes']} (predicted {st['predicted_peak_bytes']}), "
        f"median step {st['step_s']} s, moved by kind {st['moved_bytes_by_kind']}",
        flush=True,
    )
    backend.close()
    # The last collective carries no tensor of Python's: see docs/guide.md, "Ending a job".
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
