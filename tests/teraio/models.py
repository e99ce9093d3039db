"""Workloads for tests: the built-in tiny GPT and HF transformers models from tiny random configs.

HF models are built from config objects (no downloads). GPT-2 computes its loss outside the model
(passing ``labels`` breaks the graph on a logging call: docs/measured_facts.md); T5 would need
decoder_start_token_id=0 and pad_token_id=0.
"""

from __future__ import annotations

import torch

from teraio.tools.workloads import Workload, builtin_workload


def _lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)
    )


def hf_gpt2() -> Workload:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        n_positions=64,
        vocab_size=256,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    return Workload(
        name="hf:gpt2",
        model=model,
        batch={"input_ids": ids},
        loss_fn=lambda out, batch: _lm_loss(out.logits, batch["input_ids"]),
    )


def hf_bert() -> Workload:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    cfg = BertConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=256,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = BertForMaskedLM(cfg)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2))
    return Workload(
        name="hf:bert",
        model=model,
        batch={"input_ids": ids, "attention_mask": torch.ones_like(ids)},
        loss_fn=lambda out, batch: torch.nn.functional.cross_entropy(
            out.logits.reshape(-1, out.logits.shape[-1]), batch["input_ids"].reshape(-1)
        ),
    )


def hf_llama() -> Workload:
    """A Llama-shaped model: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        vocab_size=256,
        attention_dropout=0.0,
    )
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    return Workload(
        name="hf:llama",
        model=model,
        batch={"input_ids": ids},
        loss_fn=lambda out, batch: _lm_loss(out.logits, batch["input_ids"]),
    )


WORKLOADS = {
    "gpt-tiny": lambda: builtin_workload("tiny"),
    "hf-gpt2": hf_gpt2,
    "hf-bert": hf_bert,
}
