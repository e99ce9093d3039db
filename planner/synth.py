"""Synthetic profiles: a GPT-style training step built from shapes and FLOPs, without tracing anything.

Tests and benchmarks need planner inputs of any size (a 48-layer model cannot be profiled
for real on a small CPU machine), with realistic tensor sizes, op times and memory shape. :func:`synth_profile` writes
out the step of an N-layer decoder-only transformer (pre-LayerNorm, 4x MLP, GELU, no dropout):

- forward: ``embed``; per layer ``ln1, qkv, attn, proj, add1, ln2, up, gelu, down, add2``; then
  ``ln_f, head, loss``. Attention is one fused op (scaled-dot-product attention saving q/k/v, its output
  and the log-sum-exp, as PyTorch's CPU kernel does) or, with ``attention="explicit"``, three ops
  ``scores, softmax, context`` that save the full ``[B, heads, S, S]`` probabilities;
- backward: one op per forward op, in reverse, taking ``bwd_factor`` (2x) the forward op's time;
- tensors: one row per saved storage (float32, sizes from the shapes), params as kind ``param`` and the
  token ids as kind ``input`` (neither offloadable);
- ``other_bytes``: what the tensors table does not hold: outputs nobody saves (alive from producer to
  their last forward use), gradient temporaries of each backward op, and parameter gradients from the
  backward op that produces them to the end of the step.

Rebuild recipes: with ``recompute`` (the default) every saved activation carries the
profile's recompute columns, as a tracer would derive them from the graph: a rebuild reads saved tensors
(and parameters) and re-runs the forward ops between them and the tensor, at those ops' profiled times.
Norm outputs and statistics rebuild from the norm's input, GELU from the ``up`` output, matmul outputs
from their input activation and weight, attention from ``qkv`` (explicit attention: probabilities from
``qkv`` through the scores, which the rebuild holds as its intermediate), each residual sum from the
previous residual and the branch's saved input through the projection (holding the projection's output),
the log-softmax from ``ln_f`` through the head (holding the logits). Chains reach back to the layer
input, so recomputing every saved tensor of a block but its input is activation checkpointing.

Op times come from FLOPs (matmuls, attention) at ``flops_per_s`` and from bytes touched (norms, GELU,
adds) at ``mem_bw_bytes_per_s``, plus ``op_overhead_us`` each. The defaults are tuned so the mid-size GPT
measured in docs/measured_facts.md (6 layers, hidden 384, seq 512, batch 8) comes out close to its measured
op times and saved bytes: see ``tests/planner/test_synth.py``.

The fingerprint is a hash of every parameter, so the same call gives the same profile, bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field

import numpy as np

from teraio.planner.limits import (
    MAX_OP_US,
    MAX_STEP_NBYTES,
    MAX_SYNTH_DIM,
    MAX_SYNTH_LAYERS,
    MAX_TENSOR_NBYTES,
)
from teraio.planner.profile import Profile, ProfileError, make_profile

SYNTH_VERSION = 1
FLOAT32_NBYTES = 4
INT64_NBYTES = 8
ATTENTION_KINDS = ("fused", "explicit")


@dataclass(frozen=True)
class SynthConfig:
    """Parameters of a synthetic GPT step. Defaults: the mid-size GPT of docs/measured_facts.md."""

    layers: int = 6
    hidden: int = 384
    seq: int = 512
    batch: int = 8
    heads: int | None = None  # default hidden // 64
    vocab: int = 4096
    attention: str = "fused"
    causal: bool = True
    #: Effective matmul throughput of the machine (FLOP/s) and of memory-bound ops (bytes/s).
    flops_per_s: float = 160e9
    mem_bw_bytes_per_s: float = 6.0e9
    op_overhead_us: float = 20.0
    bwd_factor: float = 2.0
    #: Free-form tags that also go into the fingerprint (e.g. a variant name in a benchmark).
    tags: tuple[str, ...] = field(default_factory=tuple)
    #: Give saved activations rebuild recipes (the recompute columns; module docstring).
    recompute: bool = True

    @property
    def num_heads(self) -> int:
        return self.heads if self.heads is not None else max(1, self.hidden // 64)

    def check(self) -> SynthConfig:
        """Raise ProfileError naming the first parameter that makes no sense."""
        for name in ("layers", "hidden", "seq", "batch", "vocab"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ProfileError(f"synthetic profile: {name} must be a positive integer, got {value!r}")
            # Bounded before anything is built: 10**8 layers grew without limit, a hidden size of 10**9
            # overflowed int64 (planner.limits).
            most = MAX_SYNTH_LAYERS if name == "layers" else MAX_SYNTH_DIM
            if value > most:
                raise ProfileError(f"synthetic profile: {name} must be at most {most}, got {value!r}")
        if self.num_heads < 1 or self.hidden % self.num_heads:
            raise ProfileError(
                f"synthetic profile: hidden {self.hidden} must be divisible by heads {self.num_heads}"
            )
        if self.attention not in ATTENTION_KINDS:
            raise ProfileError(
                f"synthetic profile: attention must be one of {', '.join(ATTENTION_KINDS)}, got {self.attention!r}"
            )
        for name in ("flops_per_s", "mem_bw_bytes_per_s", "bwd_factor"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ProfileError(f"synthetic profile: {name} must be a positive number, got {value!r}")
        if not (math.isfinite(self.op_overhead_us) and 0 <= self.op_overhead_us <= MAX_OP_US):
            raise ProfileError(
                f"synthetic profile: op_overhead_us must be in 0..{MAX_OP_US:g}, got {self.op_overhead_us!r}"
            )
        return self

    def fingerprint(self) -> str:
        """A deterministic hash of every parameter (and the generator version)."""
        d = asdict(self)
        d["heads"] = self.num_heads
        d["tags"] = list(self.tags)
        if self.recompute:
            # Profiles with recipes (the default) keep the hash they had before recipes existed; one
            # without them is another profile (a plan that recomputes cannot run on it).
            del d["recompute"]
        d["synth_version"] = SYNTH_VERSION
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


@dataclass
class _FwdOp:
    name: str
    module: str
    target: str
    duration_us: float
    reads: list[str]  # tensor names read in forward
    saves: list[str]  # tensor names the matching backward op reads
    outputs: list[tuple[str, tuple[int, ...], str]]  # (name, shape, dtype)
    params: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    #: Bytes of workspace the op holds while running, beyond its inputs and outputs.
    workspace_nbytes: int = 0


def _numel(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64)) if shape else 1


class _Builder:
    """Accumulates forward ops for one config; durations from FLOPs or bytes touched."""

    def __init__(self, cfg: SynthConfig) -> None:
        self.cfg = cfg
        self.ops: list[_FwdOp] = []
        self.shapes: dict[str, tuple[tuple[int, ...], str]] = {}
        #: Saved tensor -> (rows its rebuild reads, forward ops it re-runs, intermediate held: a name or 0).
        self.recipes: dict[str, tuple[list[str], list[str], str | int]] = {}

    def recipe(self, outs: list[str], inputs: list[str], ops: list[str], held: str | int = 0) -> None:
        """Rebuild ``outs`` from ``inputs`` by re-running ``ops``, holding ``held`` (a tensor's name:
        its bytes, or a byte count) beyond the inputs and the result."""
        for out in outs:
            self.recipes[out] = (list(inputs), list(ops), held)

    def nbytes(self, name: str) -> int:
        shape, dtype = self.shapes[name]
        return _numel(shape) * (INT64_NBYTES if dtype == "int64" else FLOAT32_NBYTES)

    def matmul_us(self, flops: float) -> float:
        return self.cfg.op_overhead_us + flops / self.cfg.flops_per_s * 1e6

    def memory_us(self, nbytes: float) -> float:
        return self.cfg.op_overhead_us + nbytes / self.cfg.mem_bw_bytes_per_s * 1e6

    def add(self, op: _FwdOp) -> None:
        for name, shape, dtype in op.outputs:
            self.shapes[name] = (shape, dtype)
        self.ops.append(op)

    def elementwise(self, name, module, target, reads, saves, out, shape, params=(), extra_outputs=()):
        """A memory-bound op: reads its inputs, writes its outputs once."""
        outputs = [(out, shape, "float32"), *extra_outputs]
        touched = sum(self.nbytes(r) for r in reads) + sum(_numel(s) * FLOAT32_NBYTES for _, s, _ in outputs)
        self.add(
            _FwdOp(
                name, module, target, self.memory_us(touched), list(reads), list(saves), outputs, list(params)
            )
        )


def _build_forward(cfg: SynthConfig) -> _Builder:
    b = _Builder(cfg)
    B, S, H, V, nh = cfg.batch, cfg.seq, cfg.hidden, cfg.vocab, cfg.num_heads
    T = B * S
    act = (B, S, H)
    b.shapes["tokens"] = ((B, S), "int64")
    b.add(
        _FwdOp(
            "embed",
            "embed",
            "aten.embedding",
            b.memory_us(2 * T * H * FLOAT32_NBYTES),
            ["tokens"],
            ["tokens"],
            [("embed.out", act, "float32")],
            [("embed.weight", (V, H)), ("pos.weight", (S, H))],
        )
    )
    x = "embed.out"
    b.recipe([x], ["tokens", "embed.weight", "pos.weight"], ["embed"])
    causal = 0.5 if cfg.causal else 1.0
    for layer in range(cfg.layers):
        p = f"layers.{layer}"
        b.recipe([f"{p}.ln1.out", f"{p}.ln1.stats"], [x, f"{p}.ln1.weight", f"{p}.ln1.bias"], [f"{p}.ln1"])
        b.recipe([f"{p}.qkv.out"], [f"{p}.ln1.out", f"{p}.qkv.weight", f"{p}.qkv.bias"], [f"{p}.qkv"])
        b.elementwise(
            f"{p}.ln1",
            f"{p}.ln1",
            "aten.native_layer_norm",
            [x],
            [x, f"{p}.ln1.stats"],
            f"{p}.ln1.out",
            act,
            [(f"{p}.ln1.weight", (H,)), (f"{p}.ln1.bias", (H,))],
            [(f"{p}.ln1.stats", (2, B, S, 1), "float32")],
        )
        b.add(
            _FwdOp(
                f"{p}.qkv",
                f"{p}.attn",
                "aten.addmm",
                b.matmul_us(2 * T * H * 3 * H),
                [f"{p}.ln1.out"],
                [f"{p}.ln1.out"],
                [(f"{p}.qkv.out", (B, S, 3 * H), "float32")],
                [(f"{p}.qkv.weight", (3 * H, H)), (f"{p}.qkv.bias", (3 * H,))],
            )
        )
        attn_flops = 4 * B * S * S * H * causal
        if cfg.attention == "fused":
            b.add(
                _FwdOp(
                    f"{p}.attn",
                    f"{p}.attn",
                    "aten._scaled_dot_product_flash_attention_for_cpu",
                    b.matmul_us(attn_flops),
                    [f"{p}.qkv.out"],
                    [f"{p}.qkv.out", f"{p}.attn.out", f"{p}.attn.lse"],
                    [(f"{p}.attn.out", act, "float32"), (f"{p}.attn.lse", (B, nh, S), "float32")],
                    workspace_nbytes=2 * B * nh * 64 * S * FLOAT32_NBYTES,
                )
            )
            b.recipe(
                [f"{p}.attn.out", f"{p}.attn.lse"],
                [f"{p}.qkv.out"],
                [f"{p}.attn"],
                2 * B * nh * 64 * S * FLOAT32_NBYTES,
            )
        else:
            probs = (B, nh, S, S)
            b.add(
                _FwdOp(
                    f"{p}.scores",
                    f"{p}.attn",
                    "aten.bmm",
                    b.matmul_us(attn_flops / 2),
                    [f"{p}.qkv.out"],
                    [f"{p}.qkv.out"],
                    [(f"{p}.scores.out", probs, "float32")],
                )
            )
            b.elementwise(
                f"{p}.softmax",
                f"{p}.attn",
                "aten._softmax",
                [f"{p}.scores.out"],
                [f"{p}.softmax.out"],
                f"{p}.softmax.out",
                probs,
            )
            b.add(
                _FwdOp(
                    f"{p}.context",
                    f"{p}.attn",
                    "aten.bmm",
                    b.matmul_us(attn_flops / 2),
                    [f"{p}.softmax.out", f"{p}.qkv.out"],
                    [f"{p}.softmax.out", f"{p}.qkv.out"],
                    [(f"{p}.attn.out", act, "float32")],
                )
            )
            b.recipe(
                [f"{p}.softmax.out"], [f"{p}.qkv.out"], [f"{p}.scores", f"{p}.softmax"], f"{p}.scores.out"
            )
            b.recipe([f"{p}.attn.out"], [f"{p}.softmax.out", f"{p}.qkv.out"], [f"{p}.context"])
        b.add(
            _FwdOp(
                f"{p}.proj",
                f"{p}.attn",
                "aten.addmm",
                b.matmul_us(2 * T * H * H),
                [f"{p}.attn.out"],
                [f"{p}.attn.out"],
                [(f"{p}.proj.out", act, "float32")],
                [(f"{p}.proj.weight", (H, H)), (f"{p}.proj.bias", (H,))],
            )
        )
        b.elementwise(f"{p}.add1", p, "aten.add", [x, f"{p}.proj.out"], [], f"{p}.add1.out", act)
        h = f"{p}.add1.out"
        b.recipe(
            [h],
            [x, f"{p}.attn.out", f"{p}.proj.weight", f"{p}.proj.bias"],
            [f"{p}.proj", f"{p}.add1"],
            f"{p}.proj.out",
        )
        b.recipe([f"{p}.ln2.out", f"{p}.ln2.stats"], [h, f"{p}.ln2.weight", f"{p}.ln2.bias"], [f"{p}.ln2"])
        b.recipe([f"{p}.up.out"], [f"{p}.ln2.out", f"{p}.up.weight", f"{p}.up.bias"], [f"{p}.up"])
        b.recipe([f"{p}.gelu.out"], [f"{p}.up.out"], [f"{p}.gelu"])
        b.elementwise(
            f"{p}.ln2",
            f"{p}.ln2",
            "aten.native_layer_norm",
            [h],
            [h, f"{p}.ln2.stats"],
            f"{p}.ln2.out",
            act,
            [(f"{p}.ln2.weight", (H,)), (f"{p}.ln2.bias", (H,))],
            [(f"{p}.ln2.stats", (2, B, S, 1), "float32")],
        )
        b.add(
            _FwdOp(
                f"{p}.up",
                f"{p}.mlp",
                "aten.addmm",
                b.matmul_us(2 * T * H * 4 * H),
                [f"{p}.ln2.out"],
                [f"{p}.ln2.out"],
                [(f"{p}.up.out", (B, S, 4 * H), "float32")],
                [(f"{p}.up.weight", (4 * H, H)), (f"{p}.up.bias", (4 * H,))],
            )
        )
        b.elementwise(
            f"{p}.gelu",
            f"{p}.mlp",
            "aten.gelu",
            [f"{p}.up.out"],
            [f"{p}.up.out"],
            f"{p}.gelu.out",
            (B, S, 4 * H),
        )
        b.add(
            _FwdOp(
                f"{p}.down",
                f"{p}.mlp",
                "aten.addmm",
                b.matmul_us(2 * T * 4 * H * H),
                [f"{p}.gelu.out"],
                [f"{p}.gelu.out"],
                [(f"{p}.down.out", act, "float32")],
                [(f"{p}.down.weight", (H, 4 * H)), (f"{p}.down.bias", (H,))],
            )
        )
        b.elementwise(f"{p}.add2", p, "aten.add", [h, f"{p}.down.out"], [], f"{p}.add2.out", act)
        x = f"{p}.add2.out"
        b.recipe(
            [x],
            [h, f"{p}.gelu.out", f"{p}.down.weight", f"{p}.down.bias"],
            [f"{p}.down", f"{p}.add2"],
            f"{p}.down.out",
        )
    b.recipe(["ln_f.out", "ln_f.stats"], [x, "ln_f.weight", "ln_f.bias"], ["ln_f"])
    b.recipe(["loss.logp"], ["ln_f.out", "head.weight"], ["head", "loss"], "head.out")
    b.elementwise(
        "ln_f",
        "ln_f",
        "aten.native_layer_norm",
        [x],
        [x, "ln_f.stats"],
        "ln_f.out",
        act,
        [("ln_f.weight", (H,)), ("ln_f.bias", (H,))],
        [("ln_f.stats", (2, B, S, 1), "float32")],
    )
    b.add(
        _FwdOp(
            "head",
            "head",
            "aten.mm",
            b.matmul_us(2 * T * H * V),
            ["ln_f.out"],
            ["ln_f.out"],
            [("head.out", (B, S, V), "float32")],
            [("head.weight", (V, H))],
        )
    )
    # Cross-entropy saves its log-softmax; the logits themselves die with the loss op.
    b.elementwise(
        "loss",
        "loss",
        "aten._log_softmax",
        ["head.out"],
        ["loss.logp", "tokens"],
        "loss.out",
        (),
        extra_outputs=[("loss.logp", (B, S, V), "float32")],
    )
    return b


def _recompute_columns(cfg: SynthConfig, b: _Builder, name: str, op_us: dict[str, float]) -> dict:
    """The recompute columns of one row (none without ``cfg.recompute``; NaN where no recipe)."""
    if not cfg.recompute:
        return {}
    recipe = b.recipes.get(name)
    if recipe is None:
        return {"recompute_us": float("nan"), "recompute_inputs": (), "recompute_peak_bytes": 0}
    inputs, ops, held = recipe
    return {
        "recompute_us": float(sum(op_us[o] for o in ops)),
        "recompute_inputs": tuple(inputs),
        "recompute_peak_bytes": int(b.nbytes(held) if isinstance(held, str) else held),
    }


def synth_profile(
    layers: int = 6,
    hidden: int = 384,
    seq: int = 512,
    batch: int = 8,
    **kwargs,
) -> Profile:
    """A synthetic GPT training-step profile (see the module docstring).

    Args:
        layers, hidden, seq, batch: model and batch shape.
        **kwargs: further :class:`SynthConfig` fields (``heads``, ``vocab``, ``attention``,
            ``flops_per_s``, ``mem_bw_bytes_per_s``, ``op_overhead_us``, ``bwd_factor``, ``tags``).

    Raises:
        ProfileError: a parameter is out of range (the message names it).
    """
    try:
        cfg = SynthConfig(layers=layers, hidden=hidden, seq=seq, batch=batch, **kwargs)
    except TypeError as e:
        raise ProfileError(f"synthetic profile: {e}") from None
    return profile_from_config(cfg)


def profile_from_config(cfg: SynthConfig) -> Profile:
    """Build the Profile for a :class:`SynthConfig`."""
    cfg.check()
    b = _build_forward(cfg)
    # Python ints so far: refuse sizes the int64 tables below could not hold (planner.limits).
    sizes = [b.nbytes(name) for name in b.shapes]
    biggest = max(sizes, default=0)
    if biggest > MAX_TENSOR_NBYTES or sum(sizes) > MAX_STEP_NBYTES:
        raise ProfileError(
            f"synthetic profile: a tensor of {biggest} bytes ({sum(sizes)} in all) is more than the "
            f"{MAX_TENSOR_NBYTES} per tensor ({MAX_STEP_NBYTES} per step) teraio accepts; use smaller "
            f"hidden, seq, batch or vocab"
        )
    fwd = b.ops
    nf = len(fwd)
    n = 2 * nf

    def bwd_idx(fwd_idx: int) -> int:
        return n - 1 - fwd_idx

    producer: dict[str, int] = {}
    for i, op in enumerate(fwd):
        for name, _, _ in op.outputs:
            producer[name] = i
    last_fwd_use: dict[str, int] = {}
    saved_by: dict[str, list[int]] = {}
    for i, op in enumerate(fwd):
        for r in op.reads:
            last_fwd_use[r] = max(last_fwd_use.get(r, -1), i)
        for s in op.saves:
            saved_by.setdefault(s, []).append(i)

    other = np.zeros(n, dtype=np.int64)
    op_us = {op.name: op.duration_us for op in fwd}
    tensor_rows = []
    for name, (shape, dtype) in b.shapes.items():
        nbytes = b.nbytes(name)
        prod = producer.get(name, -1)
        lfu = last_fwd_use.get(name, prod)
        if name not in saved_by:
            # Not saved: a temporary alive from its producer to its last forward reader.
            other[prod : max(lfu, prod) + 1] += nbytes
            continue
        bwd_uses = [bwd_idx(i) for i in saved_by[name]]
        kind = "input" if prod < 0 else "activation"
        module = fwd[prod].module if prod >= 0 else ""
        tensor_rows.append(
            {
                **_recompute_columns(cfg, b, name, op_us),
                "name": name,
                "nbytes": nbytes,
                "dtype": dtype,
                "shape": shape,
                "kind": kind,
                "offloadable": kind == "activation",
                "producer_idx": prod,
                "last_fwd_use_idx": lfu,
                "first_bwd_use_idx": min(bwd_uses),
                "last_use_idx": max(bwd_uses),
                "module": module,
            }
        )
    for i, op in enumerate(fwd):
        other[i] += op.workspace_nbytes
        j = bwd_idx(i)
        # Backward op j holds the gradient of the op's outputs and produces those of its inputs.
        grads = sum(
            _numel(s) * FLOAT32_NBYTES for o, s, dt in op.outputs if dt == "float32" and o in last_fwd_use
        )
        grads += sum(b.nbytes(r) for r in op.reads if b.shapes[r][1] == "float32")
        other[j] += grads + op.workspace_nbytes
        for pname, pshape in op.params:
            pbytes = _numel(pshape) * FLOAT32_NBYTES
            other[j:] += pbytes  # the parameter's gradient, from this op to the end of the step
            tensor_rows.append(
                {
                    "name": pname,
                    "nbytes": pbytes,
                    "dtype": "float32",
                    "shape": pshape,
                    "kind": "param",
                    "offloadable": False,
                    "producer_idx": -1,
                    "last_fwd_use_idx": i,
                    "first_bwd_use_idx": j,
                    "last_use_idx": j,
                    "module": op.module,
                    **_recompute_columns(cfg, b, pname, op_us),
                }
            )

    ops_rows = []
    for i, op in enumerate(fwd):
        ops_rows.append(
            {
                "idx": i,
                "name": op.name,
                "target": op.target,
                "phase": "fwd",
                "duration_us": float(op.duration_us),
                "module": op.module,
            }
        )
    for i in reversed(range(nf)):
        op = fwd[i]
        ops_rows.append(
            {
                "idx": bwd_idx(i),
                "name": f"{op.name}_bwd",
                "target": f"{op.target}_backward",
                "phase": "bwd",
                "duration_us": float(op.duration_us * cfg.bwd_factor),
                "module": op.module,
            }
        )
    for row, ob in zip(ops_rows, other):
        row["other_bytes"] = int(ob)
    durations = np.array([r["duration_us"] for r in ops_rows])
    meta = {
        "fingerprint": cfg.fingerprint(),
        "num_fwd_ops": nf,
        "source": "synth",
        "device": "synthetic",
        "synth": {
            **asdict(cfg),
            "heads": cfg.num_heads,
            "tags": list(cfg.tags),
            "synth_version": SYNTH_VERSION,
        },
        "step_s": float(durations.sum()) / 1e6,
        "fwd_s": float(durations[:nf].sum()) / 1e6,
        "bwd_s": float(durations[nf:].sum()) / 1e6,
    }
    return make_profile(ops_rows, tensor_rows, meta)


def split_ops(profile: Profile, ways: int) -> Profile:
    """The same step at a finer op granularity: every op split into ``ways`` consecutive ops.

    A traced step has many more, smaller ops than :func:`synth_profile`'s one op per layer part (about 12k
    ops at 80 layers: views, casts, reductions). Splitting reproduces that scale for the planner: each
    sub-op takes ``1 / ways`` of the time and holds the op's ``other_bytes``; a tensor is produced by the
    op's last sub-op, and a use keeps it alive over the whole op (first backward use at the first sub-op,
    last uses at the last one).

    Raises:
        ProfileError: ``ways`` is not a positive integer.
    """
    if not isinstance(ways, int) or isinstance(ways, bool) or ways < 1:
        raise ProfileError(f"split_ops: ways must be a positive integer, got {ways!r}")
    if ways == 1:
        return profile
    ops = profile.ops.loc[profile.ops.index.repeat(ways)].reset_index(drop=True)
    part = np.tile(np.arange(ways), len(profile.ops))
    ops["idx"] = np.arange(len(ops), dtype=np.int64)
    ops["name"] = [f"{n}.{j}" for n, j in zip(ops["name"], part)]
    ops["duration_us"] = ops["duration_us"].astype(np.float64) / ways
    t = profile.tensors.copy()

    def first(col: str) -> None:
        t[col] = np.where(t[col] >= 0, t[col] * ways, t[col])

    def last(col: str) -> None:
        t[col] = np.where(t[col] >= 0, t[col] * ways + ways - 1, t[col])

    last("producer_idx")
    last("last_fwd_use_idx")
    first("first_bwd_use_idx")
    last("last_use_idx")
    meta = {
        **profile.meta,
        "fingerprint": hashlib.sha256(f"{profile.fingerprint}/split{ways}".encode()).hexdigest(),
        "num_fwd_ops": profile.num_fwd_ops * ways,
        "split_ways": ways,
    }
    return make_profile(ops, t, meta)
