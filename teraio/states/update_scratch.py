"""What the optimizer's update of one chunk allocates beside its parameters, gradients and states.

Note: [The update's scratch is measured, not assumed]
    The streamed step updates a chunk with the stock optimizer's own step (teraio.states.optimizer_stream),
    and that step allocates temporaries while it runs: measured on CPU, Adam and AdamW on their
    single-tensor path (the default on CPU) hold up to two or three copies of the largest parameter, four
    with ``weight_decay`` on Adam; on the foreach path (the default on CUDA) about one copy of every
    parameter of the group; fused, none; SGD with momentum none, with Nesterov or weight decay two copies
    of the largest. That is as large as a chunk's states on a small model, and leaving it out put the
    measured whole step 15-30% above its prediction. It depends on the optimizer, its options, the device
    and torch's version, so it is measured, once per parameter group's options: the group's update runs
    on stand-in parameters of ``PROBE_NUMEL`` elements, three and then six of them, on the parameters'
    device and dtype, and the two peaks give bytes per byte of the largest parameter and per byte of all
    of them (a chunk's update of a group then allocates ``per_largest * largest + per_total * total``).
    Three and six, not one: the single-tensor path's temporaries of one parameter are still alive when
    the next one's are made (three copies of the largest, not two, from the second parameter on), which
    a probe of one parameter would take for a cost per parameter.
    When no measurement can be taken (another memory measurement holds the profiler), the largest
    factors seen above stand in.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from teraio.states.shards import local_nbytes

log = logging.getLogger("teraio")

#: Elements of each stand-in parameter: large enough that the allocator's rounding is noise.
PROBE_NUMEL = 1 << 16


@dataclass(frozen=True)
class UpdateScratch:
    """Bytes an update of one parameter group allocates, per byte of its parameters."""

    per_largest: float  # per byte of the largest parameter updated
    per_total: float  # per byte of all of them
    measured: bool = True

    def nbytes(self, param_nbytes: list[int]) -> int:
        """What an update of parameters of these sizes allocates at its peak."""
        if not param_nbytes:
            return 0
        return int(self.per_largest * max(param_nbytes) + self.per_total * sum(param_nbytes))


#: When no measurement can be taken: the largest factors the note lists.
FALLBACK = UpdateScratch(per_largest=4.0, per_total=1.0, measured=False)

_measured: dict[tuple[Any, ...], UpdateScratch] = {}


def _options(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _key(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], device: torch.device, dtype: torch.dtype
) -> Any:
    return (type(optimizer), str(device), dtype, repr(sorted(_options(group).items(), key=lambda kv: kv[0])))


def _peak_bytes(
    optimizer: torch.optim.Optimizer,
    group: dict[str, Any],
    count: int,
    device: torch.device,
    dtype: torch.dtype,
) -> int:
    from teraio.profiling.measure import measure_memory

    params = [torch.nn.Parameter(torch.zeros(PROBE_NUMEL, device=device, dtype=dtype)) for _ in range(count)]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    probe = type(optimizer)(params)
    probe.param_groups[0].update(_options(group))  # the group's options, an LR scheduler's keys included
    probe.step()  # the states exist, as in the step measured
    _, m = measure_memory(probe.step, device.type)
    return m.peak_bytes


def update_scratch(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], device: torch.device, dtype: torch.dtype
) -> UpdateScratch:
    """Note: [The update's scratch is measured, not assumed]: the group's update's temporaries."""
    key = _key(optimizer, group, device, dtype)
    found = _measured.get(key)
    if found is not None:
        return found
    from teraio.profiling.measure import ProfilerBusyError

    nbytes = PROBE_NUMEL * torch.empty((), dtype=dtype).element_size()
    try:
        with torch.no_grad():
            three = _peak_bytes(optimizer, group, 3, device, dtype)
            six = _peak_bytes(optimizer, group, 6, device, dtype)
    except ProfilerBusyError:
        return FALLBACK  # not cached: measured at the next planning
    per_total = max(0.0, (six - three) / (3 * nbytes))
    found = UpdateScratch(per_largest=max(0.0, three / nbytes - 3 * per_total), per_total=per_total)
    log.debug(
        "%s update scratch: %.2f x the largest parameter + %.2f x all (%s)",
        type(optimizer).__name__,
        found.per_largest,
        found.per_total,
        device,
    )
    _measured[key] = found
    return found


def chunk_scratch_bytes(
    optimizer: torch.optim.Optimizer, params: list[torch.Tensor], groups: list[dict[str, Any] | None]
) -> int:
    """What the stock step allocates while it updates these parameters (``groups``: each one's param
    group): its groups update one after another, so the largest group's scratch."""
    by_group: dict[int, tuple[dict[str, Any], list[torch.Tensor]]] = {}
    for p, g in zip(params, groups, strict=True):
        if g is not None:
            by_group.setdefault(id(g), (g, []))[1].append(p)
    most = 0
    for g, ps in by_group.values():
        model = update_scratch(optimizer, g, ps[0].device, ps[0].dtype)
        most = max(most, model.nbytes([local_nbytes(p) for p in ps]))
    return most


__all__ = ["FALLBACK", "PROBE_NUMEL", "UpdateScratch", "chunk_scratch_bytes", "update_scratch"]
