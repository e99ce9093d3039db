"""One half of a training run, for test_user_loops.py's resume test: start (train, save a checkpoint) or
resume (load it in this new process, train on). Losses are written as their exact float hex, the final
parameters as a digest of their bytes, so the test compares runs bit for bit.

One process runs the half of each mode it is given, in order, each from a model built anew, with its own
checkpoint (``ckpt-<mode>.pt``) and results (``<phase>-<mode>.json``) in ``--dir``: the test runs the
planned half first, in a process that has run nothing else, and the half with ``enabled=False`` it is
compared with after it (Dynamo reset in between)."""

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

MODES = {"planned": True, "disabled": False}  # mode: enabled=


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=("start", "resume"), required=True)
    parser.add_argument("--inner", default="eager")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dir", required=True, help="checkpoints, results and the offload directory")
    parser.add_argument("--modes", default="planned,disabled", help="comma-separated, run in this order")
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    if args.inner == "inductor":
        torch.set_num_threads(1)
        torch._inductor.config.deterministic = True
    for mode in args.modes.split(","):
        torch._dynamo.reset()
        half(args.phase, args.inner, args.steps, Path(args.dir), mode)


def half(phase: str, inner: str, steps: int, directory: Path, mode: str) -> None:
    checkpoint = directory / f"ckpt-{mode}.pt"
    case = CASES["gpt"]
    model = case.build()  # seeds the global generator: every mode starts from the same state
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    first = 0
    if phase == "resume":
        state = torch.load(checkpoint, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        first = int(state["step"])
        torch.set_rng_state(state["rng"])
    backend = teraio.backend(
        memory_budget="65%",
        inner=inner,
        enabled=MODES[mode],
        solver="greedy",
        profiling=teraio.Profiling(steps=1),
        io_backend="posix",
        offload_dirs=[str(directory / "off")],
    )
    compiled = torch.compile(model, backend=backend)
    losses = []
    for step in range(first, first + steps):
        loss = compiled(*case.batch(step, case.sizes[0]))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss).hex())
    if phase == "start":
        torch.save(
            {
                "model": model.state_dict(),
                "opt": opt.state_dict(),
                "step": first + steps,
                "rng": torch.get_rng_state(),
            },
            checkpoint,
        )
    digest = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    st = backend.stats()
    backend.close()
    (directory / f"{phase}-{mode}.json").write_text(
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
