"""The model's module hooks over parameters on disk (Note: [Reading an offloaded parameter] in
teraio.states.params): ``state_dict()`` returns copies read back from disk, ``load_state_dict()`` fetches
each module's own parameters before it copies into them and frees them after, and a module that runs
eagerly keeps its parameters in memory (Note: [A parameter eager code uses stays resident])."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from teraio.states.errors import StatesError
from teraio.states.shards import is_sharded, rewrap, shard_elements
from teraio.states.store import Residency

if TYPE_CHECKING:
    from teraio.states.params import ParamResidency

__all__ = ["model_hooks"]


def model_hooks(residency: ParamResidency, model: torch.nn.Module) -> list[Any]:
    """Register the hooks on every module of ``model`` that owns an offloadable parameter; their handles."""
    handles: list[Any] = []
    for module in model.modules():
        own = tuple(
            residency.index_of[id(p)] for p in module.parameters(recurse=False) if id(p) in residency.index_of
        )
        if not own:
            continue
        handles.append(module.register_state_dict_post_hook(_state_dict_hook(residency, own)))
        # FSDP2 gathers a module's shards before it computes, eagerly or not: they are read back then
        # (teraio.states.fsdp_shards), so eager code does not pin them.
        unsharded = tuple(i for i in own if not is_sharded(residency.params[i]))
        if unsharded:
            handles.append(
                module.register_forward_pre_hook(
                    lambda mod, args, own=unsharded: residency.eager_use(mod, own)
                )
            )
        handles.append(
            module.register_load_state_dict_pre_hook(lambda *a, own=own, **k: _before_load(residency, own))
        )
        handles.append(
            module.register_load_state_dict_post_hook(
                lambda *a, own=own, **k: residency.release(residency.offloaded(own))
            )
        )
    return handles


def _before_load(residency: ParamResidency, own: tuple[int, ...]) -> None:
    """``load_state_dict`` reaches a module: its offloaded parameters in memory for the copy."""
    ours = residency.offloaded(own)
    if any(is_sharded(residency.params[i]) for i in ours):
        # Loaded into shards on disk through torch.distributed.checkpoint's set_model_state_dict, a 2-rank
        # job's parameters came out different from the checkpoint's (seen; not read yet): a refusal
        # rather than wrong values.
        raise StatesError(
            "loading a state dict into FSDP2 parameter shards on disk is not supported yet: load it "
            "before making teraio.States (or with parameters=False); saving works (model.state_dict() "
            "and opt.state_dict() read the shards back)"
        )
    residency.acquire(ours)


def _state_dict_hook(residency: ParamResidency, own: tuple[int, ...]) -> Any:
    """``module.state_dict()`` returns copies of its offloaded parameters, read back from disk."""
    by_tensor = {id(residency.params[i]): i for i in own}

    def hook(mod: torch.nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        for name, p in mod.named_parameters(recurse=False):
            i = by_tensor.get(id(p))
            key = prefix + name
            if i is not None and i in residency.records and key in state_dict:
                rec = residency.records[i]
                if i in residency.frozen and rec.residency in (Residency.DISK, Residency.READING):
                    residency.frozen.read_bytes += rec.nbytes
                copy = residency.store.read_copy(rec).detach()
                if rec.holder is not None:  # the shard's elements of its padded storage, as a DTensor
                    copy = rewrap(rec.holder, shard_elements(rec.holder, copy))
                state_dict[key] = copy

    return hook
