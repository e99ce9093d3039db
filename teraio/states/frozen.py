"""Frozen weights on disk: the parameters a model computes with but nobody trains (``requires_grad=False``,
not in the optimizer: the base of a LoRA fine-tune), offloaded with ``offload_parameters=True`` as
read-only state. They are most of a fine-tune's memory, so leaving them resident while the few adapters
move would miss the point of offloading the parameters.

Note: [Frozen weights are read-only state]
    A frozen weight joins the parameter residency (teraio.states.params) under an index after the
    optimizer's parameters (``FrozenWeights.first_idx`` on): adopted when a compiled graph first takes it
    as an input, written once (to slot 0, the first time it leaves memory), read back before each graph
    call's forward and backward that computes with it (read ahead as the others), freed after. It has no
    gradient and no optimizer state, and the streamed step never sees it (the step's order, its chunks
    and its commit, Note: [A step commits all of its states or none] in teraio.states.optimizer_stream,
    cover the optimizer's parameters only), so its one copy on disk stays valid across steps and across
    the step's slot switches: it is never written again, unless its value changes outside the graphs (a
    ``load_state_dict``, an edit under ``no_grad``), which its version counter shows when it is freed,
    and then it is written to its other slot and the old one dropped (one copy on disk at a time). With
    ``optimizer_in_backward`` a backward releases it at once instead of holding it for an update that
    never comes.

Note: [A backward reads the frozen weights it saved]
    A trained parameter is read back for its graph call's backward (its gradient needs it). A frozen
    weight is needed there only when AOTAutograd saved it for the backward: the weight of a matmul whose
    input needs a gradient (a LoRA adapter's input path runs through the frozen matmul, so that is most
    of them), not a bias, nor the weight of a first layer whose input needs no gradient. Right after a
    graph call's forward, while its parameters are still in memory, :func:`saved_by_backward` finds the
    frozen weights whose storage the backward node saved (the saved tensor is the weight, or a view of
    its storage); only those are read back (and read ahead) for that backward. When the saved tensors
    cannot be looked at without running someone's code (``saved_tensors_hooks`` active: their unpack
    may copy or read) or looking fails, every frozen weight of the call is read back, as a trained one
    is: a read too many, never a missing weight. So a frozen weight moves one read a step, or two when a
    backward saved it, and no write, which is what the whole-step budget prices it at
    (``read_only_reads`` in teraio.planner.kept_states). Frozen weights smaller than
    ``min_param_bytes``, not owning their storage, or used by eager code stay resident, as trained ones
    do.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from teraio.planner.budget import format_size

log = logging.getLogger("teraio")


def frozen_parameters(model: torch.nn.Module, trained: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """The model's parameters with ``requires_grad=False`` that the optimizer does not hold, in the model's
    order (each once)."""
    held = {id(p) for p in trained}
    return [p for p in model.parameters() if not p.requires_grad and id(p) not in held]


def saved_by_backward(node: Any, params: dict[int, torch.Tensor]) -> set[int] | None:
    """Note: [A backward reads the frozen weights it saved]: which of ``params`` (index -> a frozen weight
    in memory now) the backward ``node`` saved; None: unknown (read them all)."""
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        return None  # unpacking would run the hooks' code
    try:
        saved = node.saved_tensors
    except Exception:  # noqa: BLE001 - not a node whose saved tensors can be looked at: read them all
        return None
    ptrs = {t.untyped_storage().data_ptr() for t in saved if isinstance(t, torch.Tensor)}
    ptrs.discard(0)
    return {i for i, p in params.items() if p.untyped_storage().data_ptr() in ptrs}


@dataclass
class FrozenWeights:
    """Which residency indices are frozen weights (Note: [Frozen weights are read-only state]), and the
    bytes moved for them."""

    first_idx: int  # residency indices from here on are frozen weights
    count: int
    nbytes: int
    offloadable_count: int = 0
    offloadable_nbytes: int = 0
    written_bytes: int = 0
    read_bytes: int = 0
    #: Frozen weights some graph call's backward saved (Note: [A backward reads the frozen weights it
    #: saved]): two reads a step; the others one.
    read_in_backward: set[int] = field(default_factory=set)

    def reads_per_step(self, idx: int) -> int:
        """The reads a step makes of frozen weight ``idx`` when it is offloaded."""
        return 2 if idx in self.read_in_backward else 1

    def __contains__(self, idx: int) -> bool:
        return idx >= self.first_idx

    def log_setup(self) -> None:
        """One INFO line: how many frozen weights (and bytes) move read-only, and how many stay."""
        if not self.count:
            return
        stay = self.count - self.offloadable_count
        log.info(
            "offload_parameters: %d frozen parameters (%s; requires_grad=False, not in the optimizer) are "
            "offloaded read-only once a compiled graph takes them (written once, read where used)%s",
            self.offloadable_count,
            format_size(self.offloadable_nbytes),
            f"; {stay} ({format_size(self.nbytes - self.offloadable_nbytes)}) stay in memory (smaller than "
            "min_param_bytes, sharing storage, or of a tensor subclass such as a quantized weight)"
            if stay
            else "",
        )

    def stats(self, offloaded_nbytes: int) -> dict[str, int]:
        """``StateOffload.stats()["frozen_parameters"]``: the frozen weights, those that moved, and their
        bytes written (once each) and read (included in the ``parameter`` kind's counts)."""
        return {
            "tensors": self.count,
            "bytes": self.nbytes,
            "offloadable_bytes": self.offloadable_nbytes,
            "offloaded_bytes": offloaded_nbytes,
            "written_bytes": self.written_bytes,
            "read_bytes": self.read_bytes,
            "read_in_backward": len(self.read_in_backward),
        }
