"""What the CLI trains: the built-in GPT, or a user's ``path/to/file.py:fn``.

The contract for a user function (documented in docs/cli.md):

- ``fn()`` takes no arguments and returns ``(model, batch)`` or ``(model, batch, loss_fn)``.
- ``batch`` is a tensor (called as ``model(batch)``), a tuple/list (``model(*batch)``) or a dict
  (``model(**batch)``).
- Without ``loss_fn`` the model's output must be a scalar tensor: the loss. With it, the loss is
  ``loss_fn(output, batch)`` and must be a scalar tensor.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from teraio.errors import UserInputError

BUILTIN_PREFIX = "builtin:"


@dataclass
class Workload:
    name: str
    model: torch.nn.Module
    batch: Any
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    batch_for_step: Callable[[int], Any] | None = None

    def batch_at(self, step: int) -> Any:
        return self.batch_for_step(step) if self.batch_for_step is not None else self.batch


def call_model(model: Callable[..., Any], batch: Any) -> Any:
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def compute_loss(model: Callable[..., Any], workload: Workload, step: int = 0) -> torch.Tensor:
    """One forward pass of ``model`` (compiled or not) on the workload's batch, reduced to the loss."""
    batch = workload.batch_at(step)
    out = call_model(model, batch)
    loss = workload.loss_fn(out, batch) if workload.loss_fn is not None else out
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        what = (
            type(loss).__name__
            if not isinstance(loss, torch.Tensor)
            else f"a tensor of shape {tuple(loss.shape)}"
        )
        raise UserInputError(
            f"{workload.name}: the loss must be a scalar tensor, got {what}; return (model, batch, loss_fn) "
            "with a loss_fn(output, batch) that reduces the output to a scalar"
        )
    return loss


def builtin_workload(config: str, seed: int = 0) -> Workload:
    from teraio.tools.models import CONFIGS, build_gpt, synthetic_batch

    if config not in CONFIGS:
        raise UserInputError(
            f"unknown built-in workload 'builtin:{config}'; choose from "
            + ", ".join(f"builtin:{c}" for c in CONFIGS)
        )
    model = build_gpt(config, seed=seed)
    cfg = model.cfg
    return Workload(
        name=f"builtin:{config}",
        model=model,
        batch=synthetic_batch(cfg, 0, seed),
        batch_for_step=lambda step: synthetic_batch(cfg, step, seed),
    )


def _load_user_function(spec: str) -> Callable[[], Any]:
    path_str, sep, fn_name = spec.rpartition(":")
    if not sep or not path_str or not fn_name:
        raise UserInputError(f"target '{spec}' must be builtin:NAME or path/to/file.py:function")
    path = Path(path_str)
    if not path.is_file():
        raise UserInputError(f"target file '{path}' does not exist")
    mod_name = f"_teraio_target_{abs(hash(path.resolve()))}"
    module_spec = importlib.util.spec_from_file_location(mod_name, path)
    if module_spec is None or module_spec.loader is None:
        raise UserInputError(f"target file '{path}' cannot be imported as Python")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[mod_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        raise UserInputError(f"importing '{path}' failed: {type(e).__name__}: {e}") from None
    fn = getattr(module, fn_name, None)
    if fn is None:
        raise UserInputError(f"'{path}' has no function '{fn_name}'")
    if not callable(fn):
        raise UserInputError(f"'{path}:{fn_name}' is not callable")
    return fn


def load_workload(target: str) -> Workload:
    """Resolve a CLI TARGET (``builtin:NAME`` or ``file.py:fn``) into a Workload, checking the contract."""
    if target.startswith(BUILTIN_PREFIX):
        return builtin_workload(target[len(BUILTIN_PREFIX) :])
    fn = _load_user_function(target)
    try:
        result = fn()
    except Exception as e:
        raise UserInputError(f"'{target}' raised {type(e).__name__}: {e}") from None
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise UserInputError(
            f"'{target}' must return (model, batch) or (model, batch, loss_fn), got {type(result).__name__}"
        )
    model, batch = result[0], result[1]
    loss_fn = result[2] if len(result) == 3 else None
    if not isinstance(model, torch.nn.Module):
        raise UserInputError(
            f"'{target}' returned {type(model).__name__} as the model; expected a torch.nn.Module"
        )
    if loss_fn is not None and not callable(loss_fn):
        raise UserInputError(f"'{target}' returned a loss_fn that is not callable")
    leaves = (
        batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) else [batch]
    )
    if not any(isinstance(x, torch.Tensor) for x in leaves):
        raise UserInputError(
            f"'{target}' returned a batch with no tensors; expected a tensor, tuple or dict of tensors"
        )
    return Workload(name=target, model=model, batch=batch, loss_fn=loss_fn)
