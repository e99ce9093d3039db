"""HF ``Trainer`` the usual way with parameters, gradients and optimizer states on disk (docs/guide.md,
"With the whole state on disk"): its default ``max_grad_norm=1.0`` clips every step, a warmup-cosine
schedule, two micro-batches accumulated; every logged loss and gradient norm and the final parameters and
optimizer states equal the same Trainer with ``teraio.backend(enabled=False)``, bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import teraio

from .fine_tune_run import build, optimizer_digest


def _train(enabled: bool, tmp_path: Path) -> dict[str, Any]:
    from transformers import Trainer, TrainingArguments

    torch._dynamo.reset()
    model = build("llama")  # the fine-tuning check's Llama-shaped model, seeded
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (16, 32))]
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    )
    states = teraio.States(opt, model=model, gradients=True, parameters=True, min_param_bytes=0)
    backend = teraio.backend(
        states=states,
        inner="eager",
        enabled=enabled,
        offload_dirs=[str(tmp_path / "off")],
        io_backend="posix",
    )
    (tmp_path / "off").mkdir(exist_ok=True)
    backend.compile(model)
    args = TrainingArguments(
        output_dir=str(tmp_path / f"trainer-{enabled}"),
        max_steps=4,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        lr_scheduler_type="cosine",
        warmup_steps=1,
        logging_steps=1,
        torch_compile=False,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, None))
    trainer.train()
    try:
        return {
            "log": [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h],
            "params": {n: t.detach().clone() for n, t in model.state_dict().items()},
            "optimizer_digest": optimizer_digest(opt),
            "moved": backend.stats().get("moved_bytes_by_kind"),
        }
    finally:
        backend.close()


def test_hf_trainer_with_the_whole_state_on_disk_is_bit_identical(tmp_path: Path) -> None:
    ref = _train(False, tmp_path)
    got = _train(True, tmp_path)
    assert len(got["log"]) == 4 and got["log"] == ref["log"]
    assert any(norm > 1.0 for _, norm in ref["log"])  # max_grad_norm=1.0 clips
    assert ref["params"].keys() == got["params"].keys()
    assert all(torch.equal(ref["params"][n], got["params"][n]) for n in ref["params"])
    assert got["optimizer_digest"] == ref["optimizer_digest"]
    assert all(got["moved"][k] > 0 for k in ("parameter", "gradient", "optimizer_state"))
