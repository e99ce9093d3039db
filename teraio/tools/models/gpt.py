"""A small decoder-only GPT, the built-in workload: its saved activations dominate a training step's memory.

Written here (no downloads) so that profiles, plans and the demo are reproducible on any machine. The
``demo`` config is sized from measurements: on 2 CPU cores a step takes about 2-3 s and saves about 0.7 GB of
activations (about 0.1 GB per block), so offloading them at this disk's 1-2 GB/s can hide behind compute.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    layers: int
    hidden: int
    heads: int
    seq: int
    batch: int
    vocab: int
    mlp_ratio: int = 4
    dropout: float = 0.0  # after attention and the MLP; 0 leaves the graph without random ops

    def to_dict(self) -> dict[str, int | float]:
        return asdict(self)


CONFIGS: dict[str, GPTConfig] = {
    # Seconds to compile and run: for tests.
    "tiny": GPTConfig(layers=2, hidden=64, heads=4, seq=64, batch=4, vocab=256),
    # A few hundred MB of saved activations; 1-3 s per step on 2 cores.
    "demo": GPTConfig(layers=6, hidden=384, heads=6, seq=512, batch=8, vocab=4096),
}


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.dropout = cfg.dropout
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.up = nn.Linear(cfg.hidden, cfg.mlp_ratio * cfg.hidden)
        self.down = nn.Linear(cfg.mlp_ratio * cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        # Explicit attention (not SDPA) keeps the op set identical across CPU builds and deterministic.
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(h // self.heads))
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        att = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, s, h)
        a = self.proj(y)
        if self.dropout > 0:
            a = F.dropout(a, self.dropout, self.training)
        x = x + a
        m = self.down(F.gelu(self.up(self.ln2(x))))
        if self.dropout > 0:
            m = F.dropout(m, self.dropout, self.training)
        return x + m


class GPT(nn.Module):
    """``forward(idx, targets)`` returns the mean cross-entropy loss (a scalar), computed inside the graph."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Embedding(cfg.seq, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def build_gpt(name: str = "tiny", seed: int = 0) -> GPT:
    """A GPT with the named config and deterministic initial weights."""
    if name not in CONFIGS:
        raise KeyError(f"unknown GPT config '{name}' (choose from {', '.join(CONFIGS)})")
    gen_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        return GPT(CONFIGS[name])
    finally:
        torch.random.set_rng_state(gen_state)


def synthetic_batch(cfg: GPTConfig, step: int = 0, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens and next-token targets, a pure function of (seed, step)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
