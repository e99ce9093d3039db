"""What ``benchmarks/bench_states.py`` measures besides training: the model's sizes, the machine's memory
and peak RSS, and the references a run is judged against (the first loss computed layer by layer, and the
compute of a step alone, without I/O).

Imported by the benchmark after it sets ``THP_MEM_ALLOC_ENABLE`` (torch reads it at its first allocation).
"""

from __future__ import annotations

import os
import platform
import struct
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.bench_whatif import _median_s
from teraio.tools.models.gpt import GPT, Block, GPTConfig, synthetic_batch

#: AdamW keeps two fp32 moments per parameter (``step`` is a resident scalar).
ADAM_STATES = 2
LR = 1e-4


# -- sizes and the machine -------------------------------------------------------------------------
def param_count(cfg: GPTConfig) -> int:
    """Exact, from the model built on the meta device (no memory)."""
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(cfg).parameters())


def sizes(cfg: GPTConfig) -> dict[str, int]:
    """Bytes of the training state (fp32) by part."""
    n = param_count(cfg)
    with torch.device("meta"):
        block_params = sum(p.numel() for p in GPT(cfg).blocks.parameters())
    weights = grads = 4 * n
    states = ADAM_STATES * 4 * n
    return {
        "params": n,
        "weight_bytes": weights,
        "block_weight_bytes": 4 * block_params,
        "gradient_bytes": grads,
        "optimizer_state_bytes": states,
        "state_bytes": weights + grads + states,
        # Two slots per moment while a step is written (Note: [A step commits all of its states or
        # none] in teraio.states.optimizer_stream) and every gradient: the offload file's high mark.
        "disk_bytes_needed": 2 * states + grads + 2 * weights,
    }


def meminfo() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[-1] == "kB":
                out[key] = int(parts[0]) * 1024
    return out


def proc_status_bytes(field: str) -> int:
    """``VmHWM``, ``VmRSS``... of this process, in bytes (0 if unreadable)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def reset_peak_rss() -> bool:
    """Start a new VmHWM window (``echo 5 > /proc/self/clear_refs``); False if the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def machine_info() -> dict[str, Any]:
    mi = meminfo()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "mem_total_bytes": mi.get("MemTotal", 0),
        "swap_total_bytes": mi.get("SwapTotal", 0),
        "loadavg": os.getloadavg(),  # other users of the shared cores
        "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE", "<unset>"),
    }


def f32_bits(x: torch.Tensor) -> int:
    """The bits of a float32 scalar, for a bit-for-bit comparison across processes."""
    return struct.unpack("<I", struct.pack("<f", float(x.item())))[0] if x.dtype == torch.float32 else -1


def build_model(cfg: GPTConfig, seed: int = 0) -> GPT:
    """The GPT with deterministic initial weights (as ``teraio.tools.models.build_gpt``, for any config)."""
    gen_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        return GPT(cfg)
    finally:
        torch.random.set_rng_state(gen_state)


# -- the reference and the compute alone ----------------------------------------------------------
@torch.no_grad()
def reference_first_loss(cfg: GPTConfig, seed: int = 0) -> torch.Tensor:
    """The loss of ``build_model(cfg, seed)`` on step 0's batch, computed one layer at a time: each module
    is built from the same random stream ``GPT.__init__`` draws from, in the same order (embeddings,
    blocks, final norm, head), used and freed, so only one block's weights are ever in memory."""
    idx, targets = synthetic_batch(cfg, 0)
    gen_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        tok = nn.Embedding(cfg.vocab, cfg.hidden)
        pos = nn.Embedding(cfg.seq, cfg.hidden)
        x = tok(idx) + pos(torch.arange(idx.shape[1]))
        del tok, pos
        for _ in range(cfg.layers):
            block = Block(cfg)
            x = block(x)
            del block
        ln_f = nn.LayerNorm(cfg.hidden)
        head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        logits = head(ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))
    finally:
        torch.random.set_rng_state(gen_state)


def _layer_s(cfg: GPTConfig, reps: int) -> tuple[float, float, float]:
    """Forward and backward, the AdamW update, and the forward alone (building the graph backward
    needs) of one resident block (medians of ``reps``)."""
    block = Block(cfg)
    opt = torch.optim.AdamW(block.parameters(), lr=LR)
    x = torch.randn(cfg.batch, cfg.seq, cfg.hidden, requires_grad=True)
    grad_out = torch.randn(cfg.batch, cfg.seq, cfg.hidden)

    def forward_backward() -> None:
        opt.zero_grad(set_to_none=True)
        x.grad = None
        block(x).backward(grad_out)

    def forward() -> None:
        block(x)  # with autograd recording, as in training; the graph is dropped unused

    fwd_bwd_s = _median_s(forward_backward, reps, warm=1)
    update_s = _median_s(opt.step, reps, warm=1)  # the gradients of the last backward
    return fwd_bwd_s, update_s, _median_s(forward, reps, warm=1)


def _embedding_and_head_s(cfg: GPTConfig, reps: int) -> float:
    """The same for the embeddings, the final norm, the head and the loss."""
    b, s, h = cfg.batch, cfg.seq, cfg.hidden
    idx, targets = synthetic_batch(cfg, 0)
    ends = nn.ModuleDict(
        {
            "tok": nn.Embedding(cfg.vocab, h),
            "pos": nn.Embedding(cfg.seq, h),
            "ln_f": nn.LayerNorm(h),
            "head": nn.Linear(h, cfg.vocab, bias=False),
        }
    )
    opt = torch.optim.AdamW(ends.parameters(), lr=LR)
    last = torch.randn(b, s, h, requires_grad=True)  # what the last block hands the final norm
    grad_out = torch.randn(b, s, h)

    def embedding_and_head() -> None:
        (ends["tok"](idx) + ends["pos"](torch.arange(s))).backward(grad_out)
        logits = ends["head"](ends["ln_f"](last))
        F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        last.grad = None

    return _median_s(embedding_and_head, reps, warm=1)


def compute_alone(cfg: GPTConfig, reps: int = 3, seed: int = 0) -> dict[str, float]:
    """The step's compute without I/O: forward, backward and AdamW update of one resident block (median
    of ``reps``), times the layer count, plus the same for the embeddings and the final norm and head."""
    torch.manual_seed(seed)
    fwd_bwd_s, update_s, forward_s = _layer_s(cfg, reps)
    ends_s = _embedding_and_head_s(cfg, reps)
    return {
        "layer_forward_backward_s": fwd_bwd_s,
        "layer_forward_s": forward_s,
        "layer_update_s": update_s,
        "layer_s": fwd_bwd_s + update_s,
        "embedding_and_head_s": ends_s,
        "compute_s": (fwd_bwd_s + update_s) * cfg.layers + ends_s,
    }
