"""FSDP2's parameter shards on disk between their all-gathers (``teraio.States(parameters=True)`` with a
model ``fully_shard`` made).

Note: [A parameter shard moves with its padding]
    FSDP2 keeps each rank's shard of a parameter in a flat padded buffer of its own
    (``FSDPParam._sharded_param_data``); the parameter the optimizer holds is a DTensor whose local tensor
    is a view at the start of that buffer. Every all-gather reads the buffer (padding included, on the
    rank whose shard is short), and nothing else shares its storage. So a sharded parameter's record is
    a tensor over that whole storage, moved in place (resized to zero bytes and back, as any offloaded
    parameter: Note: [A parameter keeps its storage object] in teraio.states.params); the DTensor is the
    record's ``holder``, guarded with it while no module of the model runs, and the optimizer's in-place
    update of the DTensor writes into the same storage.

Note: [A shard is read back before its all-gather]
    Every all-gather of a group of FSDP2 parameters (its forward, its backward, FSDP2's prefetch of the
    next group, an explicit ``unshard()``) goes through ``FSDPParamGroup.unshard``, and the shard is read
    by the all-gather itself; FSDP2 has no public hook there, so each group's ``unshard`` and
    ``wait_for_unshard`` are wrapped on the instance. Before an ``unshard`` that will gather, the group's
    offloaded shards are fetched (held like a graph call's parameters, and the next group's, in the order
    of the last step's gathers, read ahead); after the matching ``wait_for_unshard`` (by then the
    gathered copy exists, on a GPU ordered after the copy-in on the current stream) the hold is dropped
    and an unchanged shard's memory goes, without a write. The gathered parameters are FSDP2's, outside
    teraio's graphs (measured and planned for as outside memory). FSDP2's lazy initialisation at the first
    forward re-derives the shards' views from their storage, which must be whole then: shards are adopted
    at their group's first gather, which comes after it.

Note: [The step follows FSDP2's gathers]
    The overlapped optimizer step (Note: [The step of offloaded parameters runs in the next forward] in
    teraio.states.step_pipeline) cuts its chunks in the order the forward takes the parameters, and
    updates every chunk up to the one a use needs. Under FSDP2 no graph call takes a shard (the graphs
    take the gathered parameters), so that order was the optimizer's reversed: the root group's
    embeddings came last, the forward's first gather ran the whole step at once, and every updated shard
    stayed in memory until its own gather (seen: 4 GB a rank on the 2B GPT over 2 ranks). The order is
    the groups' gathers of the last step instead, so each gather updates its own group's chunk behind
    the one before, and frees it after its all-gather.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from teraio.states.shards import is_sharded

if TYPE_CHECKING:
    from teraio.states.params import ParamResidency

__all__ = ["ShardGathers", "fsdp_groups"]


def fsdp_groups(model: torch.nn.Module) -> list[Any]:
    """The FSDP2 parameter groups of ``model``'s modules (``fully_shard``), in module order."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return []
    out = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group  # type: ignore[attr-defined]
            if group is not None:
                out.append(group)
    return out


class ShardGathers:
    """Note: [A shard is read back before its all-gather]: wraps the gathers of ``model``'s FSDP2 groups so
    that ``residency`` has each group's offloaded shards in memory while FSDP2 reads them."""

    def __init__(self, residency: ParamResidency, model: torch.nn.Module) -> None:
        self.residency = residency
        self.groups = fsdp_groups(model)
        self._held: dict[int, tuple[int, ...]] = {}  # id(group) -> the shards its gather holds
        #: Groups by ``id`` in the order of this step's gathers, and the last step's (read ahead).
        self._order: list[int] = []
        self._last_order: list[int] = []
        self._params_of: dict[int, list[torch.Tensor]] = {}
        self._restore: list[tuple[Any, str, Any]] = []
        for group in self.groups:
            self._params_of[id(group)] = [
                fp.sharded_param for fp in group.fsdp_params if is_sharded(fp.sharded_param)
            ]
            for name, make in (("unshard", self._unshard), ("wait_for_unshard", self._wait_for_unshard)):
                had = name in vars(group)
                self._restore.append((group, name, vars(group).get(name) if had else None))
                setattr(group, name, make(group, getattr(group, name)))
        self._by_id = {id(g): g for g in self.groups}
        residency.gather_order = self.gather_order
        # Before FSDP2's own hook on the root, which may gather the root's group.
        self._step_hook = model.register_forward_pre_hook(lambda *_: self.new_step(), prepend=True)

    def gather_order(self) -> list[tuple[int, ...]]:
        """Note: [The step follows FSDP2's gathers]: each group's offloaded shards, in the order of this
        step's gathers (the last step's before the first)."""
        order = self._order or self._last_order
        return [self.residency.indices(self._params_of[g]) for g in order if g in self._params_of]

    def new_step(self) -> None:
        """The next gathers are a new step's (the model's forward starts)."""
        if self._order:
            self._last_order, self._order = self._order, []

    def _unshard(self, group: Any, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def unshard(*args: Any, **kwargs: Any) -> Any:
            gathers = group._all_gather_result is None and not group.is_unsharded
            if gathers and id(group) not in self._held:
                self._hold(group)
            try:
                return original(*args, **kwargs)
            except BaseException:
                self._drop(group)
                raise

        return unshard

    def _wait_for_unshard(self, group: Any, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def wait_for_unshard(*args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            finally:
                self._drop(group)

        return wait_for_unshard

    def _hold(self, group: Any) -> None:
        residency = self.residency
        idxs = residency.indices(self._params_of[id(group)])
        self._order.append(id(group))
        pos = len(self._order) - 1
        if pos + 1 < len(self._last_order):  # read the next gather's shards behind this one
            nxt = self._by_id.get(self._last_order[pos + 1])
            if nxt is not None:
                residency.prefetch(residency.indices(self._params_of[id(nxt)]))
        residency.acquire(idxs)
        self._held[id(group)] = idxs

    def _drop(self, group: Any) -> None:
        idxs = self._held.pop(id(group), None)
        if idxs is not None:
            self.residency.release(idxs)

    def close(self) -> None:
        """Give the groups their own methods back (holds in flight are dropped)."""
        self._step_hook.remove()
        if self.residency.gather_order == self.gather_order:
            self.residency.gather_order = None
        for group in list(self._by_id.values()):
            self._drop(group)
        for group, name, saved in self._restore:
            if saved is None:
                vars(group).pop(name, None)
            else:
                setattr(group, name, saved)
        self._restore.clear()
