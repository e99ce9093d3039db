"""Gradient clipping and loss scaling over offloaded gradients, bit-exact and without extra I/O.

``torch.nn.utils.clip_grad_norm_`` reads every gradient twice between ``backward()`` and ``opt.step()``
(its norm, then an in-place scale), ``clip_grad_value_`` clamps each in place, and a
``torch.amp.GradScaler`` checks each for inf/NaN while unscaling it in place. With
``teraio.States(gradients=True)`` those gradients are on disk by then (guarded: teraio.states.guarded).
This module answers those calls from what was computed while each gradient was in memory anyway, and
defers the in-place changes to the gradient's next load (Note: [Norms are taken before the write]).

Note: [Norms are taken before the write]
    ``clip_grad_norm_`` takes one norm per gradient with ``torch._foreach_norm`` (the foreach path: an
    offloaded gradient is a foreach-supported type, teraio.states.guarded), then the norm of those norms,
    then ``torch._foreach_mul_(grads, coef)``. A gradient is complete when the hook after its
    AccumulateGrad runs, just before teraio writes it (teraio.states.grads); the hook then takes its norm
    with the same call on a one-element list (``torch._foreach_norm([grad], ord)``: on CPU a
    ``linalg.vector_norm`` per tensor whatever the list, on CUDA a per-tensor reduction over the same
    chunks of that tensor), and keeps the 0-dim result with the record. When the clip asks, the cached
    norms are returned: the same bits, no read. With micro-batches accumulated the hook runs after each;
    the last one's norm is the one kept. The hook takes a norm only once the loop has asked for one (its
    order, its dtype): the first clip of a run is served by reading each gradient once (the loop cannot
    be known to clip before it does), every later one from the cache.

    The scale that follows is recorded on each gradient as a pending op (Note: [What a read of an
    offloaded tensor does] in teraio.states.guarded) and replayed, the same kernel with the same 0-dim
    coefficient, when the streamed step loads the gradient: the step sees the same bytes as after an
    eager scale. ``clip_grad_value_``'s clamps are pending ops the same way.

    A pending op changes the values, so a cached norm holds only for the chain of pending ops it was
    taken after: the cache is keyed by that chain (each op and its arguments by value). A norm asked
    for after pending ops (the usual AMP recipe: ``scaler.unscale_(opt)`` then the clip) would be served
    by reading every gradient, one gradient's bytes a step more than without the clip. Since a loop makes
    the same calls every step, the hook also takes the norm of a copy of the gradient with the chain the
    previous step had when its norm was asked (for a GradScaler: the unscale by the previous inverse
    scale): when this step's chain is the same op with the same arguments, the cached norm is the exact
    one, with no read; when the scale changed (after a skipped step or a growth), that one step reads.
    That costs one gradient-sized copy at a time in the hook. Scaling the cached norm instead
    (``norm(g) * inv_scale``) would be exact only without subnormals or overflow, which fp16 gradients
    have.

Note: [A GradScaler's check from the norm]
    ``unscale_`` calls ``torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)``:
    it sets ``found_inf`` when an element of any gradient is inf or NaN, and multiplies each by
    ``inv_scale``. A finite p-norm with p >= 1 of a gradient proves all of its elements finite (an inf or
    NaN element makes the sum of powers inf or NaN; an overflow only makes the proof fail), so for a
    gradient whose cached norm is finite ``found_inf`` gets nothing and the unscale is a pending op,
    replayed with the same kernel on a one-element list and a scratch ``found_inf``. Otherwise the
    gradient is read, checked and unscaled for real (the op still recorded as pending, since its bytes
    on disk are not rewritten). A GradScaler's first unscale makes the hook take 2-norms from then on.
    When ``found_inf`` is set, ``scaler.step`` does not call ``opt.step()``: no streamed step runs, the
    gradients stay on disk with their pending ops, and ``zero_grad`` drops them as usual.

Note: [Clipping when the update runs in backward]
    With ``optimizer_in_backward=True`` each parameter is updated as soon as its gradient is complete,
    and its gradient freed (``param.grad`` is None after backward). ``clip_grad_norm_`` scales every
    gradient by a factor that depends on all of them, known only when backward ends, after every update
    has run: exact clipping would undo and redo every update (the states and parameters read and
    written a second time: twice the step's I/O), or keep every gradient until the end of backward,
    which is ``gradients=True``. So it is refused: over ``None`` gradients ``clip_grad_norm_`` would
    return a zero norm and clip nothing, and a GradScaler would find no inf and let updates made with
    scaled gradients commit, both silently wrong. Once an update inside backward consumed a gradient
    (until ``zero_grad`` or the next backward), ``clip_grad_norm_`` (through the helper it calls with
    the parameters, ``torch.nn.utils.clip_grad._clip_grads_with_norm_``, whoever imported it),
    ``torch.nn.utils.clip_grad_value_`` and a GradScaler's unscale (``GradScaler._unscale_grads_``,
    which ``scaler.step`` calls too) over such a parameter raise one line pointing at
    ``gradients=True``. The wrappers are installed the first time an update runs inside backward and
    check nothing else.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from teraio.states.errors import StatesError
from teraio.states.guarded import (
    PENDABLE_OPS,
    PendingOp,
    evict_after_call,
    guard_of,
    is_guarded,
    load_for_call,
    real,
    refuse_mutation,
)

if TYPE_CHECKING:
    from teraio.states.grads import GradOffload
    from teraio.states.store import Record

__all__ = ["GradNorms", "serve_foreach_norm", "serve_in_place", "watch_in_backward"]

#: (norm order, dtype) as ``torch._foreach_norm`` takes them.
NormKind = tuple[float, Any]
UNSCALE = "_amp_foreach_non_finite_check_and_unscale_"


def chain_signature(ops: list[PendingOp]) -> tuple[Any, ...]:
    return tuple(op.signature() for op in ops)


def _norm(t: torch.Tensor, kind: NormKind) -> torch.Tensor:
    """One tensor's norm by the kernel ``clip_grad_norm_`` uses (Note: [Norms are taken before the write])."""
    ord_, dtype = kind
    with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
        if dtype is None:
            return torch._foreach_norm([t], ord_)[0]
        return torch._foreach_norm([t], ord_, dtype=dtype)[0]


class GradNorms:
    """The norms the loop asks of its gradients, taken in the hook before each gradient's write."""

    def __init__(self) -> None:
        #: The (order, dtype) of every norm the loop asked for so far.
        self.wanted: set[NormKind] = set()
        #: Per parameter: the pending ops its gradient had when its norm was last asked for.
        self.chains: dict[int | None, list[PendingOp]] = {}

    def fill(self, rec: Record) -> None:
        """``rec.tensor`` is complete and in memory: take the norms the loop will ask for (Note: [Norms are
        taken before the write])."""
        rec.norms.clear()
        if not self.wanted:
            return
        t = rec.target  # a DTensor's norm is a DTensor (Note: [A sharded tensor is guarded as a whole])
        variants = [((), t)]
        chain = self.chains.get(rec.param_idx)
        if chain:
            copy = t.detach().clone()
            for op in chain:
                op.apply(copy)
            variants.append((chain_signature(chain), copy))
        for sig, x in variants:
            for kind in self.wanted:
                rec.norms[(kind, sig)] = _norm(x, kind)

    def cached(self, rec: Record, kind: NormKind) -> torch.Tensor | None:
        return rec.norms.get((kind, chain_signature(rec.pending)))

    def proves_finite(self, rec: Record) -> bool:
        """Note: [A GradScaler's check from the norm]."""
        sig = chain_signature(rec.pending)
        for ((ord_, _), s), v in rec.norms.items():
            if s == sig and ord_ >= 1 and bool(torch.isfinite(v)):
                return True
        return False


def serve_foreach_norm(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``torch._foreach_norm(tensors, ord, dtype)`` with offloaded gradients among ``tensors``: the cached
    norms, else each read once (Note: [Norms are taken before the write])."""
    tensors = list(args[0])
    ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
    kind: NormKind = (float(ord_), dtype)
    out: list[torch.Tensor | None] = [None] * len(tensors)
    plain = [i for i, t in enumerate(tensors) if not is_guarded(t)]
    if plain:
        with torch._C.DisableTorchFunctionSubclass():
            for i, n in zip(plain, func([tensors[i] for i in plain], *args[1:], **kwargs)):
                out[i] = n
    for i, t in enumerate(tensors):
        if out[i] is not None:
            continue
        guard = guard_of(t)
        assert guard is not None and guard.record is not None and guard.store is not None
        rec, norms = guard.record, guard.store.grad_norms
        whole = not guard.view and guard.primary is rec.target  # a DTensor's local shard is not its whole
        if whole and norms is not None and rec.kind.value == "gradient":
            norms.wanted.add(kind)
            norms.chains[rec.param_idx] = list(rec.pending)
            hit = norms.cached(rec, kind)
            if hit is not None:
                out[i] = hit
                continue
        loaded = load_for_call([t])
        try:
            n = _norm(real(t), kind)
        finally:
            evict_after_call(loaded)
        if whole:
            rec.norms[(kind, chain_signature(rec.pending))] = n
        out[i] = n
    return tuple(out)


def _per_index(args: tuple[Any, ...], n: int, i: int) -> tuple[Any, ...]:
    """The arguments after a foreach op's first list, for its element ``i`` (lists of length ``n`` are
    per element, the rest shared)."""
    return tuple(a[i] if isinstance(a, (list, tuple)) and len(a) == n else a for a in args)


def _frozen(a: Any) -> Any:
    return a.detach().clone() if isinstance(a, torch.Tensor) else a


def serve_in_place(
    func: Callable[..., Any],
    name: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    mutated: list[torch.Tensor],
) -> Any:
    """An in-place op that writes into offloaded tensors: deferred on gradients for scaling and clamping
    (a pending op), refused otherwise in one line (Note: [What a read of an offloaded tensor does] in
    teraio.states.guarded)."""
    if name in ACCUMULATE_OPS and all(_accumulated_shard(t) for t in mutated):
        return _serve_accumulation(func, args, kwargs, mutated)
    for t in mutated:
        guard = guard_of(t)
        assert guard is not None and guard.record is not None
        if (
            name not in PENDABLE_OPS
            or guard.record.kind.value != "gradient"
            or guard.view
            or guard.primary is not guard.record.target  # a DTensor's local shard: ops apply to the DTensor
        ):
            raise refuse_mutation(t, name)
    foreach = name.startswith("_foreach_") or name == UNSCALE
    selves = list(args[0]) if foreach else [args[0]]
    rest = args[1:]
    for a in rest:  # another offloaded tensor as an argument (a scale by a gradient): not a scale
        for x in a if isinstance(a, (list, tuple)) else [a]:
            if is_guarded(x):
                raise StatesError(
                    f"{name}() takes an offloaded gradient or state as an argument; read it first "
                    "(backend.states.gradient(p), opt.state_dict())"
                )
    n = len(selves)
    plain = [i for i, t in enumerate(selves) if not is_guarded(t)]
    if plain:  # the plain tensors of a foreach list: the op as the caller made it, on them alone
        sub = [[a[i] for i in plain] if isinstance(a, (list, tuple)) and len(a) == n else a for a in rest]
        with torch._C.DisableTorchFunctionSubclass():
            func([selves[i] for i in plain], *sub, **kwargs)
    for i, t in enumerate(selves):
        guard = guard_of(t)
        if guard is None:
            continue
        rec, store = guard.record, guard.store
        assert rec is not None and store is not None
        mine = _per_index(rest, n, i) if foreach else rest
        op = PendingOp(func, tuple(_frozen(a) for a in mine), dict(kwargs), foreach)
        from teraio.states.store import Residency

        if rec.residency not in (Residency.DISK, Residency.READING):
            # an alias of a record in memory now: change it there
            with torch._C.DisableTorchFunctionSubclass():
                func([rec.target] if foreach else rec.target, *mine, **kwargs)
            store.mark_changed(rec)
            continue
        norms = store.grad_norms
        if name == UNSCALE:
            if norms is not None:
                norms.wanted.add((2.0, None))
            if norms is None or not norms.proves_finite(rec):
                # Note: [A GradScaler's check from the norm]: checked on its bytes (found_inf is the
                # caller's), and still pending: the bytes on disk stay the scaled ones.
                loaded = load_for_call([t])
                try:
                    with torch._C.DisableTorchFunctionSubclass():
                        func([rec.target], *mine, **kwargs)
                    rec.pending.append(op)
                finally:
                    evict_after_call(loaded)
                continue
        rec.pending.append(op)
    return None if foreach else args[0]


#: The in-place adds FSDP2 accumulates a micro-batch's gradient shard with (Note: [FSDP2 accumulates into
#: the local shard]).
ACCUMULATE_OPS = frozenset({"__iadd__", "add_"})


def _accumulated_shard(t: torch.Tensor) -> bool:
    guard = guard_of(t)
    return (
        guard is not None
        and guard.record.kind.value == "gradient"
        and guard.record.holder is not None
        and guard.primary is guard.record.tensor
        and not guard.view
    )


def _serve_accumulation(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], mutated: list[torch.Tensor]
) -> Any:
    """Note: [FSDP2 accumulates into the local shard]
    FSDP2 adds a later micro-batch's reduce-scattered gradient into the sharded gradient's local
    tensor itself (``grad._local_tensor += new``), in Python, then runs the parameter's
    post-accumulate hooks, which write it again (teraio.states.grads). The add is the gradient's
    accumulation, as AccumulateGrad's is on one process: the shard is read back into its own
    object (a blocking read, its pending ops replayed), the add runs on it, and it is marked
    changed, in memory until that hook's write."""
    loaded = load_for_call(mutated)
    with torch._C.DisableTorchFunctionSubclass():
        out = func(*args, **kwargs)
    for rec, store in loaded:
        store.mark_changed(rec)
    return out


# -- Note: [Clipping when the update runs in backward] ---------------------------------------------------
_WATCHED: weakref.WeakSet[GradOffload] = weakref.WeakSet()
CONSUMED_MESSAGE = (
    "gradient clipping needs the gradients after backward; optimizer_in_backward=True applies each in "
    "backward: use gradients=True instead"
)


def refuse_consumed(params: list[Any]) -> None:
    """Raise the one line when an update inside backward consumed the gradient of one of ``params``."""
    ids = {id(p) for p in params}
    for grads in list(_WATCHED):
        if grads.consumed and any(id(grads.params[i]) in ids for i in grads.consumed):
            raise StatesError(CONSUMED_MESSAGE)


def _params_of(parameters: Any) -> list[Any]:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def watch_in_backward(grads: GradOffload) -> None:
    """``grads`` consumes gradients in backward: install the checks of the note (once per process)."""
    _WATCHED.add(grads)
    import torch.nn.utils as nn_utils
    import torch.nn.utils.clip_grad as clip_grad

    if getattr(clip_grad._clip_grads_with_norm_, "_teraio_checked", False):
        return
    scale = clip_grad._clip_grads_with_norm_

    @functools.wraps(scale)
    def clip_grads_with_norm_(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        params = _params_of(parameters)
        refuse_consumed(params)
        return scale(params, *args, **kwargs)

    clamp = clip_grad.clip_grad_value_

    @functools.wraps(clamp)
    def clip_grad_value_(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        params = _params_of(parameters)
        refuse_consumed(params)
        return clamp(params, *args, **kwargs)

    unscale = torch.amp.GradScaler._unscale_grads_

    @functools.wraps(unscale)
    def _unscale_grads_(self: Any, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        refuse_consumed([p for g in optimizer.param_groups for p in g["params"]])
        return unscale(self, optimizer, *args, **kwargs)

    for f in (clip_grads_with_norm_, clip_grad_value_, _unscale_grads_):
        f._teraio_checked = True  # type: ignore[attr-defined]
    clip_grad._clip_grads_with_norm_ = clip_grads_with_norm_
    clip_grad.clip_grad_value_ = clip_grad_value_
    nn_utils.clip_grad_value_ = clip_grad_value_
    torch.amp.GradScaler._unscale_grads_ = _unscale_grads_  # type: ignore[method-assign]
