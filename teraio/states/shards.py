"""A rank's own bytes of a tensor that may be sharded across ranks (FSDP2's DTensors), and its size.

Note: [A sharded tensor's bytes are its local shard]
    FSDP2 (``fully_shard``) replaces each parameter by a DTensor: a wrapper without storage of its own
    whose ``_local_tensor`` holds this rank's shard, and the optimizer's states for it (``exp_avg``, made
    by ``zeros_like``) and the gradient FSDP2 assigns after its reduce-scatter are DTensors over local
    shards too. The wrapper's ``numel()`` is the *global* tensor's, so every size the states count (a
    chunk, a write, a budget) is the local shard's, and every move of bytes (a write, an eviction, a load
    with ``set_``) is made on the local tensor, which keeps its object inside the wrapper as a record's
    tensor keeps its object elsewhere (Note: [Offloaded tensors keep their object, not their storage] in
    teraio.states.store). Elementwise optimizer math on DTensors runs on the local tensors without a
    collective, so a stock step narrowed to some parameters stays the whole step restricted to them.

Note: [A sharded tensor is guarded as a whole]
    An offloaded tensor's object is guarded while its bytes are on disk (Note: [What a read of an
    offloaded tensor does] in teraio.states.guarded). A DTensor's ops do not reach a guard on its local
    tensor: DTensor dispatches below ``__torch_function__`` and calls the ops on its local tensors itself,
    so ``grad.norm()`` or ``exp_avg.full_tensor()`` would read the empty storage. So the DTensor is
    guarded too (its class swapped to a DTensor subclass whose ``__torch_function__`` is the guard's), and
    so is its local tensor (for code that takes ``_local_tensor`` or ``to_local()``). A read through the
    DTensor is served on the DTensor; ops recorded while on disk (a clip's scale) and the norms taken
    before the write apply to the DTensor, as the loop made them (its norms are DTensors); bytes move
    through the local tensor.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["is_sharded", "local", "local_nbytes", "rewrap", "shard_elements", "whole_storage"]


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed support
        return None
    return DTensor


def is_sharded(t: Any) -> bool:
    """Whether ``t`` is a DTensor (FSDP2's parameters, their gradients and optimizer states)."""
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(t, dtensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor that holds this rank's bytes of ``t``: a DTensor's local shard, else ``t`` itself."""
    return t._local_tensor if is_sharded(t) else t  # type: ignore[attr-defined]


def local_nbytes(t: torch.Tensor) -> int:
    """Bytes of this rank's elements of ``t`` (a DTensor's local shard; a plain tensor's elements)."""
    own = local(t)
    return own.numel() * own.element_size()


def whole_storage(t: torch.Tensor) -> torch.Tensor:
    """A new 1-D tensor of ``t``'s dtype over all of ``t``'s storage (an FSDP2 shard's padding included)."""
    storage = t.untyped_storage()
    out = torch.empty(0, dtype=t.dtype, device=t.device)
    with torch.no_grad():
        out.set_(storage, 0, (storage.nbytes() // t.element_size(),), (1,))
    return out


def shard_elements(holder: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """``holder``'s local elements within ``whole``, a copy of its local tensor's whole storage (an FSDP2
    parameter shard's record holds its padded storage: Note: [A parameter shard moves with its padding] in
    teraio.states.fsdp_shards)."""
    shard = local(holder)
    return whole.as_strided(shard.shape, shard.stride(), shard.storage_offset())


def rewrap(like: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``values`` (a local shard's bytes, e.g. read back from disk) as ``like`` is: a DTensor over them
    with ``like``'s mesh, placements, shape and strides when ``like`` is one, else ``values``."""
    if not is_sharded(like):
        return values
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        values,
        like.device_mesh,  # type: ignore[attr-defined]
        like.placements,  # type: ignore[attr-defined]
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )
