"""One half of a training run, for test_user_loops.py's resume test: start (train, save a checkpoint) or
resume (load it in this new process, train on). Losses are written as their exact float hex, the final
parameters as a digest of their bytes, so the test compares runs bit for bit."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import teraio  # noqa: E402
from tests.teraio.loops import CASES  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=("start", "resume"), required=True)
    parser.add_argument("--inner", default="eager")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--offload-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--disabled", action="store_true")
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    if args.inner == "inductor":
        torch.set_num_threads(1)
        torch._inductor.config.deterministic = True
    case = CASES["gpt"]
    model = case.build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    first = 0
    if args.phase == "resume":
        state = torch.load(args.checkpoint, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        first = int(state["step"])
        torch.set_rng_state(state["rng"])
    backend = teraio.backend(
        memory_budget="65%",
        inner=args.inner,
        enabled=not args.disabled,
        solver="greedy",
        profiling=teraio.Profiling(steps=1),
        io_backend="posix",
        offload_dirs=[args.offload_dir],
    )
    compiled = torch.compile(model, backend=backend)
    losses = []
    for step in range(first, first + args.steps):
        loss = compiled(*case.batch(step, case.sizes[0]))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss).hex())
    if args.phase == "start":
        torch.save(
            {
                "model": model.state_dict(),
                "opt": opt.state_dict(),
                "step": first + args.steps,
                "rng": torch.get_rng_state(),
            },
            args.checkpoint,
        )
    digest = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    st = backend.stats()
    backend.close()
    Path(args.out).write_text(
        json.dumps(
            {
                "losses": losses,
                "params_digest": digest.hexdigest(),
                "moved_bytes_per_step": st["moved_bytes_per_step"],
            }
        )
    )


if __name__ == "__main__":
    main()
