"""Workloads for tests: the built-in tiny GPT and HF transformers models from tiny random configs.

HF models are built from config objects (no downloads). GPT-2 computes its loss outside the model
(passing ``labels`` breaks the graph on a logging call: docs/measured_facts.md); T5 computes its own,
with decoder_start_token_id=0 and pad_token_id=0.
"""

from __future__ import annotations

import torch

from teraio.tools.workloads import Workload, builtin_workload


def _lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)
    )


#: A tiny Llama-shaped config (Llama and Qwen2 share it).
LLAMA_LIKE = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "vocab_size": 256,
    "attention_dropout": 0.0,
}


def _causal_lm(name: str, model: torch.nn.Module, seed: int) -> Workload:
    """A causal LM's workload: two sequences of 32 random tokens, the next-token loss outside the model."""
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(seed))
    return Workload(
        name=name,
        model=model,
        batch={"input_ids": ids},
        loss_fn=lambda out, batch: _lm_loss(out.logits, batch["input_ids"]),
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
    return _causal_lm("hf:gpt2", GPT2LMHeadModel(cfg), seed=1)


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
    return _causal_lm("hf:llama", LlamaForCausalLM(LlamaConfig(**LLAMA_LIKE)), seed=3)


def hf_qwen2() -> Workload:
    """A Qwen2-shaped model: Llama's layout with biases on the attention's projections."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return _causal_lm("hf:qwen2", Qwen2ForCausalLM(Qwen2Config(**LLAMA_LIKE)), seed=4)


def hf_t5() -> Workload:
    """An encoder-decoder (T5): two stacks of blocks, the loss from the model's own labels."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = T5Config(
        num_layers=2,
        num_decoder_layers=2,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_heads=4,
        vocab_size=256,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    model = T5ForConditionalGeneration(cfg)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 256, (2, 32), generator=gen)
    labels = torch.randint(1, 256, (2, 16), generator=gen)
    return Workload(
        name="hf:t5",
        model=model,
        batch={"input_ids": ids, "labels": labels},
        loss_fn=lambda out, batch: out.loss,
    )


WORKLOADS = {
    "gpt-tiny": lambda: builtin_workload("tiny"),
    "hf-gpt2": hf_gpt2,
    "hf-bert": hf_bert,
}

#: The HF architectures of the whole-state tests (not in WORKLOADS: the profiler's matrices stay small).
HF_MODELS = {
    "hf-gpt2": hf_gpt2,
    "hf-bert": hf_bert,
    "hf-llama": hf_llama,
    "hf-qwen2": hf_qwen2,
    "hf-t5": hf_t5,
}
