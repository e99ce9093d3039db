"""The loop a fine-tuner writes, for test_fine_tuning.py: an HF causal LM, AdamW with two parameter groups
(no decay on norms and biases), a warmup-cosine ``LambdaLR``, bf16 autocast, two micro-batches
accumulated, ``clip_grad_norm_(1.0)`` every step, a checkpoint (model, optimizer and scheduler state
dicts) saved after a given step and resumed in a new process. Run in the test's process or as a script
(``python fine_tune_run.py SPEC.json OUT.json``, for the resumed half); losses and clip norms are written
as their exact float hex, the final parameters and optimizer states as digests of their bytes, so runs are
compared bit for bit."""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import teraio  # noqa: E402

VOCAB = 128
MICRO_BATCHES = 2
WARMUP_STEPS = 2
TOTAL_STEPS = 6


def build(arch: str) -> torch.nn.Module:
    """A small HF model of the architecture: ``llama`` (rotary, RMSNorm, SwiGLU, grouped KV heads; its
    head is its own weight) or ``gpt2`` (learned positions, LayerNorm with biases, a head tied to the
    token embedding)."""
    import transformers

    torch.manual_seed(0)
    if arch == "llama":
        cfg = transformers.LlamaConfig(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            max_position_embeddings=64,
        )
        return transformers.LlamaForCausalLM(cfg)
    if arch == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=64, vocab_size=VOCAB)
        return transformers.GPT2LMHeadModel(cfg)
    raise ValueError(f"unknown arch {arch!r}")


def param_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Weight decay on matrices, none on norms and biases (the usual recipe)."""
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def warmup_cosine(step: int) -> float:
    if step < WARMUP_STEPS:
        return (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, TOTAL_STEPS - WARMUP_STEPS)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def batch(step: int, micro: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randint(0, VOCAB, (2, 16), generator=gen)


def _digest(tensors: dict[str, Any]) -> str:
    digest = hashlib.sha256()
    for name, value in sorted(tensors.items()):
        digest.update(name.encode())
        if isinstance(value, torch.Tensor):
            digest.update(value.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            digest.update(repr(value).encode())
    return digest.hexdigest()


def optimizer_digest(opt: torch.optim.Optimizer) -> str:
    sd = opt.state_dict()
    flat = {f"{i}/{k}": v for i, state in sd["state"].items() for k, v in state.items()}
    flat["groups"] = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
    return _digest(flat)


def train_step(
    compiled: Any, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, step: int
) -> tuple[list[str], str]:
    """One optimizer step of the loop: micro-batches under bf16 autocast, the clip, the step, the
    schedule; the losses and the clip norm as exact float hex."""
    losses = []
    for micro in range(MICRO_BATCHES):
        ids = batch(step, micro)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = compiled(input_ids=ids, labels=ids).loss
        (loss / MICRO_BATCHES).backward()
        losses.append(float(loss.detach()).hex())
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    opt.zero_grad()
    return losses, float(norm).hex()


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Train ``spec["steps"]`` optimizer steps from ``spec["first"]`` (loading ``spec["load"]`` when set,
    saving ``spec["save"]`` at the end when set)."""
    torch.use_deterministic_algorithms(True)
    model = build(spec["arch"])
    opt = torch.optim.AdamW(param_groups(model), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
    states = teraio.States(
        opt,
        model=model,
        gradients=True,
        parameters=True,
        min_param_bytes=0,
        chunk_bytes=spec.get("chunk_bytes", "64KiB"),  # several chunks: nothing stays resident by luck
    )
    backend = teraio.backend(
        enabled=spec["enabled"],
        inner="eager",
        states=states,
        io_backend="posix",
        offload_dirs=[spec["offload_dir"]],
        profiling=teraio.Profiling(steps=1),
    )
    if spec.get("load"):
        ckpt = torch.load(spec["load"], weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        torch.set_rng_state(ckpt["rng"])
    if spec["compile"] == "whole":
        compiled = torch.compile(model, backend=backend)
    else:
        compiled = backend.compile(model)
    losses, norms, written = [], [], []
    for step in range(spec["first"], spec["first"] + spec["steps"]):
        before = (backend.stats().get("written_bytes_by_kind") or {}).get("parameter", 0)
        step_losses, norm = train_step(compiled, model, opt, sched, step)
        losses += step_losses
        norms.append(norm)
        after = (backend.stats().get("written_bytes_by_kind") or {}).get("parameter", 0)
        written.append(after - before)
    if spec.get("save"):
        torch.save(
            {
                "model": model.state_dict(),
                "opt": opt.state_dict(),
                "sched": sched.state_dict(),
                "rng": torch.get_rng_state(),
            },
            spec["save"],
        )
    stats = backend.stats()
    result = {
        "losses": losses,
        "norms": norms,
        "params_digest": _digest(dict(model.state_dict())),
        "optimizer_digest": optimizer_digest(opt),
        "parameter_written_bytes_per_step": written,
        "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "moved_bytes_by_kind": stats.get("moved_bytes_by_kind"),
        "graphs": stats["graphs"],
    }
    backend.close()
    return result


if __name__ == "__main__":
    spec_path, out_path = sys.argv[1:3]
    Path(out_path).write_text(json.dumps(run(json.loads(Path(spec_path).read_text()))))
