"""The fine-tuner's loop of fine_tune_run.py started from a pretrained model directory and resumed from a
checkpoint, for test_checkpoints.py: the model either loaded by ``from_pretrained`` into memory (the
reference, without teraio's offload), or built on the meta device and loaded by
``backend.states.load_pretrained`` / ``load_checkpoint`` straight to disk. Run in the test's process or
as a script (``python checkpoint_run.py SPEC.json OUT.json``) for the resumed half; results are exact
(float hex, digests of bytes)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import teraio  # noqa: E402
from tests.teraio.fine_tune_run import (  # noqa: E402
    _digest,
    optimizer_digest,
    param_groups,
    train_step,
    warmup_cosine,
)


def _model(spec: dict[str, Any]) -> torch.nn.Module:
    import transformers

    if spec["source"] == "from_pretrained":
        return transformers.AutoModelForCausalLM.from_pretrained(spec["hf_dir"], dtype=torch.float32)
    cfg = transformers.AutoConfig.from_pretrained(spec["hf_dir"])
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg)


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Train ``spec["steps"]`` steps from ``spec["first"]``, the model from ``spec["source"]``
    (``from_pretrained``, ``load_pretrained`` or ``load_checkpoint`` of ``spec["load"]``); then
    ``save_checkpoint`` to ``spec["save"]`` and ``save_pretrained`` to ``spec["export"]`` when set."""
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(1234)
    model = _model(spec)
    opt = torch.optim.AdamW(param_groups(model), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
    offload = spec["source"] != "from_pretrained"
    backend = teraio.backend(
        enabled=offload,
        inner="eager",
        states=teraio.States(
            opt, model=model, gradients=True, parameters=True, min_param_bytes=0, chunk_bytes="64KiB"
        ),
        io_backend="posix",
        offload_dirs=[spec["offload_dir"]],
        profiling=teraio.Profiling(steps=1),
    )
    loaded: dict[str, Any] = {}
    if spec["source"] == "load_pretrained":
        loaded = backend.states.load_pretrained(spec["hf_dir"]).as_dict()
    elif spec["source"] == "load_checkpoint":
        loaded = backend.states.load_checkpoint(spec["load"], extra={"lr_scheduler": sched})
    loaded_on_meta = [n for n, p in model.named_parameters() if p.is_meta]
    compiled = backend.compile(model)
    losses, norms = [], []
    for step in range(spec["first"], spec["first"] + spec["steps"]):
        step_losses, norm = train_step(compiled, model, opt, sched, step)
        losses += step_losses
        norms.append(norm)
    if spec.get("save"):
        backend.states.save_checkpoint(spec["save"], extra={"lr_scheduler": sched}, max_shard_size="40KB")
    if spec.get("export"):
        backend.states.save_pretrained(spec["export"], max_shard_size="40KB")
    stats = backend.stats()
    result = {
        "losses": losses,
        "norms": norms,
        "params_digest": _digest(dict(model.state_dict())),
        "optimizer_digest": optimizer_digest(opt),
        "sched": repr(sched.state_dict()),
        "rng_digest": _digest({"rng": torch.get_rng_state()}),
        "loaded": loaded,
        "left_on_meta": loaded_on_meta,
        "moved_bytes_by_kind": stats.get("moved_bytes_by_kind"),
    }
    backend.close()
    return result


if __name__ == "__main__":
    spec_path, out_path = sys.argv[1:3]
    Path(out_path).write_text(json.dumps(run(json.loads(Path(spec_path).read_text()))))
