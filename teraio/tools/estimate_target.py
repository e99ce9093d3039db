"""The step an estimate is made of: a model and its batch built as fake tensors, without a weight.

``teraio estimate`` names its target as ``builtin:NAME`` (a built-in GPT config), ``hf:NAME`` (a published
Hugging Face model's dimensions, built from a transformers config object: nothing is downloaded) or
``file.py:fn`` (the user's own model and batch). Each is built inside a fresh ``FakeTensorMode``: every
tensor is metadata, nothing is allocated, and the options that resize the target (batch, sequence,
dtype, layers) are checked here, before anything is traced.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
import torch.nn.functional as F

from teraio.errors import UserInputError
from teraio.tools.workloads import BUILTIN_PREFIX

HF_PREFIX = "hf:"
DType = Literal["float32", "bfloat16", "float16"]
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

#: Published dimensions of the Hugging Face models a target may name (their config.json files), built
#: from transformers config objects: nothing is downloaded.
HF_MODELS: dict[str, dict[str, Any]] = {
    # meta-llama/Meta-Llama-3-8B
    "llama-8b": {
        "family": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    },
    # meta-llama/Meta-Llama-3-70B
    "llama-70b": {
        "family": "llama",
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    },
    # openai-community/gpt2-xl
    "gpt2-xl": {
        "family": "gpt2",
        "n_embd": 1600,
        "n_layer": 48,
        "n_head": 25,
        "n_positions": 1024,
        "vocab_size": 50257,
    },
    # google-t5/t5-3b (DeepSpeed's memory-estimator example)
    "t5-3b": {
        "family": "t5",
        "d_model": 1024,
        "d_ff": 16384,
        "num_layers": 24,
        "num_heads": 32,
        "d_kv": 128,
        "vocab_size": 32128,
        "decoder_start_token_id": 0,
        "pad_token_id": 0,
    },
}
#: The config key holding each family's layer count (for ``layers=``) and its default sequence length.
_LAYER_KEY = {"llama": "num_hidden_layers", "gpt2": "n_layer", "t5": "num_layers"}
_DEFAULT_SEQ = {"llama": 4096, "gpt2": 1024, "t5": 512}


@dataclass
class EstimateTarget:
    """A model and its batch, built as fake tensors (metadata only), and how the step computes its loss."""

    name: str
    model: torch.nn.Module
    batch: Any
    fake_mode: Any
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    #: What was built: the config's dimensions, batch, sequence length, dtype (for the estimate's meta).
    settings: dict[str, Any] = field(default_factory=dict)


class _CausalLMLoss(torch.nn.Module):
    """A causal LM returning the mean next-token cross-entropy from its logits, in one graph (the model's
    own loss path can break the graph: a logging call in GPT-2's); logits in fp32, as HF's loss does."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=input_ids, use_cache=False).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class _Seq2SeqLoss(torch.nn.Module):
    """An encoder-decoder model whose loss comes from ``labels`` (T5 captures in one graph with them)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels, use_cache=False).loss


def require_positive(value: int | None, option: str) -> None:
    """Refuse ``value`` unless it is None or a positive integer (``option`` names it in the message)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise UserInputError(f"{option} must be a positive integer, got {value!r}")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build parameters in ``dtype`` directly (``Module.to`` cannot swap fake parameters in place)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def hf_config(name: str, *, layers: int | None = None) -> Any:
    """The transformers config object of a named model (``HF_MODELS``), optionally with fewer layers.

    Raises:
        UserInputError: an unknown name (the message lists the known ones), or transformers missing.
    """
    if name not in HF_MODELS:
        raise UserInputError(
            f"unknown Hugging Face model 'hf:{name}'; choose one of: {', '.join('hf:' + n for n in HF_MODELS)}"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # config objects only: never reach for the Hub
    try:
        import transformers
    except ImportError:
        raise UserInputError("hf: targets need the transformers package: pip install transformers") from None
    spec = dict(HF_MODELS[name])
    family = spec.pop("family")
    if layers is not None:
        spec[_LAYER_KEY[family]] = layers
    cls = {"llama": "LlamaConfig", "gpt2": "GPT2Config", "t5": "T5Config"}[family]
    return getattr(transformers, cls)(**spec)


def _hf_model(name: str, config: Any) -> torch.nn.Module:
    import transformers

    family = HF_MODELS[name]["family"]
    cls = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel", "t5": "T5ForConditionalGeneration"}[family]
    model = getattr(transformers, cls)(config)
    return _Seq2SeqLoss(model) if family == "t5" else _CausalLMLoss(model)


def build_target(
    target: str,
    *,
    batch: int | None = None,
    seq: int | None = None,
    dtype: DType | None = None,
    layers: int | None = None,
) -> EstimateTarget:
    """Build ``target`` inside a fresh FakeTensorMode: ``builtin:NAME``, ``hf:NAME`` or ``file.py:fn``.

    ``batch``, ``seq``, ``dtype`` and ``layers`` override the target's own (built-in and hf: targets; a
    file target builds its own model and batch, so they are refused for it).

    Raises:
        UserInputError: an unknown target or an option it does not take, with the remedy.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    for value, option in ((batch, "--batch"), (seq, "--seq"), (layers, "--layers")):
        require_positive(value, option)
    if dtype is not None and dtype not in DTYPES:
        raise UserInputError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    torch_dtype = DTYPES[dtype or "float32"]
    if target.startswith(BUILTIN_PREFIX):
        from teraio.tools.models import CONFIGS, GPT, synthetic_batch

        name = target[len(BUILTIN_PREFIX) :]
        if name not in CONFIGS:
            raise UserInputError(
                f"unknown built-in workload '{target}'; choose from "
                + ", ".join(f"builtin:{c}" for c in CONFIGS)
            )
        cfg = replace(
            CONFIGS[name],
            **{k: v for k, v in (("batch", batch), ("seq", seq), ("layers", layers)) if v is not None},
        )
        with mode, _default_dtype(torch_dtype):
            model = GPT(cfg)
            tokens = synthetic_batch(cfg)
        settings = {**cfg.to_dict(), "dtype": str(torch_dtype).removeprefix("torch.")}
        return EstimateTarget(target, model, tokens, mode, settings=settings)
    if target.startswith(HF_PREFIX):
        name = target[len(HF_PREFIX) :]
        config = hf_config(name, layers=layers)
        family = HF_MODELS[name]["family"]
        b, s = batch or 1, seq or _DEFAULT_SEQ[family]
        max_positions = getattr(config, "max_position_embeddings", getattr(config, "n_positions", None))
        if family != "t5" and max_positions is not None and s > max_positions:
            raise UserInputError(
                f"--seq {s} exceeds hf:{name}'s {max_positions} positions; choose --seq {max_positions} or less"
            )
        with mode, _default_dtype(torch_dtype):
            model = _hf_model(name, config)
            ids = torch.randint(0, config.vocab_size, (b, s))
            labels = torch.randint(0, config.vocab_size, (b, s))
        settings = {
            **{k: v for k, v in HF_MODELS[name].items() if k != "family"},
            "family": family,
            **({_LAYER_KEY[family]: layers} if layers is not None else {}),
            "batch": b,
            "seq": s,
            "dtype": str(torch_dtype).removeprefix("torch."),
        }
        return EstimateTarget(target, model, (ids, labels), mode, settings=settings)
    given = [
        o for v, o in ((batch, "--batch"), (seq, "--seq"), (dtype, "--dtype"), (layers, "--layers")) if v
    ]
    if given:
        raise UserInputError(
            f"{', '.join(given)} apply to builtin: and hf: targets; '{target}' builds its own model and batch"
        )
    from teraio.tools.workloads import load_workload

    with mode:
        work = load_workload(target)  # the user's function runs inside the fake mode: nothing is allocated
    return EstimateTarget(target, work.model, work.batch, mode, loss_fn=work.loss_fn, settings={})


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(parameters, parameters of the largest module on its own): shared parameters once, as DeepSpeed's
    estimator counts them (``model_to_params``), by identity rather than address (fake tensors have none)."""
    total = sum(p.numel() for p in model.parameters())  # parameters() yields a shared one once
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return int(total), int(largest)
