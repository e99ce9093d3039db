"""Offloaded gradients and optimizer states that user code can still read without crashing the process.

An offloaded ``param.grad`` or ``opt.state[p]["exp_avg"]`` keeps its object over an empty storage (Note:
[Offloaded tensors keep their object, not their storage] in teraio.states.store): a kernel that reads it
reads a null pointer, and on CPU the process dies with SIGSEGV. While its bytes are only on disk, the
tensor's class is swapped to :class:`OffloadedTensor`, whose ``__torch_function__`` sees every torch call
that takes it, and serves, defers or refuses it (Note: [What a read of an offloaded tensor does]). The
store swaps the class back whenever it makes the record resident again, so the streamed step, autograd's
accumulation and every other path of teraio see plain tensors.

Note: [What a read of an offloaded tensor does]
    Swapping a tensor's ``__class__`` keeps the object (autograd's ``param.grad``, the optimizer's
    ``state`` dict still hold it) and routes every torch function call with it as an argument through
    the guard's ``__torch_function__``, foreach ops and property getters included; C++ code (autograd's
    AccumulateGrad) does not go through it, which is why the store loads a gradient before backward
    accumulates into it. Parameters are guarded only while no module of the model runs: Dynamo's guards
    check a graph input's exact type, and a swap would recompile (Note: [Parameters are guarded while
    no module of the model runs] in teraio.states.entry_gate). The guard decides per call:

    - *Metadata* (``.shape``, ``.dtype``, ``.device``, ``.numel()``, ``.requires_grad``, ``.grad_fn``,
      ``untyped_storage()``, hashing, ...) passes through: nothing is read.
    - *Reads* are served: the record is loaded for that call (a blocking read of its bytes, counted in
      ``read_bytes_by_kind``), the op runs on the real bytes, and the record is evicted again without a
      write (its disk copy did not change). Every read is served rather than a chosen few: a norm,
      ``.item()``, ``.clone()``, ``print``, ``ema.lerp_(g, w)``, ``torch.save(g)`` all cost the same
      one read, and a list of reads worth serving would leave the others to crash or to a surprise
      error. The results are plain tensors with their own memory. A view of an offloaded tensor
      (``g[0]``, ``g.view(-1)``, ``g.T``) is a guarded view: the op and its arguments are kept, and a
      read of the view loads the record and takes the view again; a write through it is refused, since
      the bytes it would change are on disk. A result that shares loaded bytes without being a view of
      the first argument is copied. ``.detach()`` and ``.data`` return another guarded object over the
      whole record, so ``p.grad.data.norm()`` is served and ``p.grad.data.mul_(c)`` does what
      ``p.grad.mul_(c)`` does. What hands the bytes to another library (``.numpy()``, ``__array__``,
      ``__dlpack__``) runs on a copy: its result outlives the call (it does not see later changes, as it
      would share them in memory), and ``.numpy()`` also pins a storage's size, so the eviction after it
      failed (seen).
    - *Scaling and clamping an offloaded gradient* in place (``clip_grad_norm_``'s ``_foreach_mul_``,
      ``clip_grad_value_``'s clamps, a GradScaler's unscale) are deferred: the op and its arguments are
      recorded on the record as pending and replayed, same op and same arguments, whenever its bytes are
      next loaded (the streamed step, a served read, ``backend.states.gradient(p)``), so the result is
      the same bits as the op run at once, and it costs no I/O (Note: [Norms are taken before the
      write] in teraio.states.grad_norms).
    - *Any other in-place change* (an optimizer state's ``mul_``, ``copy_`` into a gradient, ``zero_()``,
      ``.data = ...``) raises a one-line :class:`StatesError` naming the tensor and what to do: changing
      bytes that are on disk needs a read and a write the loop did not plan for, and a silent one would
      hide it.
    - A guarded object whose record teraio no longer tracks (a gradient ``zero_grad`` dropped that the
      loop kept a reference to, a state replaced by ``load_state_dict``) raises a one-line error on any
      read: its bytes are gone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._foreach_utils as _foreach_utils
from torch.utils._pytree import tree_flatten, tree_unflatten

from teraio.states.errors import StatesError
from teraio.states.shards import local

if TYPE_CHECKING:
    from teraio.states.store import Record, TensorStore

__all__ = [
    "OffloadedTensor",
    "PendingOp",
    "guard_of",
    "is_guarded",
    "protect",
    "release",
    "release_record",
    "unguarded",
]

#: Calls that read nothing but the tensor's metadata (property getters by their property's name).
METADATA_OPS = frozenset(
    {
        "shape", "size", "dim", "ndim", "ndimension", "numel", "nelement", "dtype", "device", "layout",
        "is_cuda", "is_cpu", "is_xpu", "is_mps", "is_meta", "is_sparse", "is_sparse_csr", "is_quantized",
        "is_mkldnn", "is_nested", "is_leaf", "requires_grad", "grad", "grad_fn", "_grad_fn", "_version",
        "is_floating_point", "is_complex", "is_signed", "stride", "storage_offset", "is_contiguous",
        "element_size", "nbytes", "itemsize", "names", "name", "get_device", "data_ptr",
        "untyped_storage", "_typed_storage", "storage", "is_pinned", "is_shared", "is_inference",
        "__hash__", "__len__", "requires_grad_", "retain_grad", "retains_grad", "register_hook",
        "register_post_accumulate_grad_hook", "detach_", "_is_view", "_base", "output_nr",
        "_backward_hooks", "_post_accumulate_grad_hooks", "is_conj", "is_neg", "_is_zerotensor",
        "dim_order", "__dir__", "_nested_tensor_size",
    }
)  # fmt: skip
#: Calls that return another object over the same bytes, aliased as a whole: another guarded object.
ALIAS_OPS = frozenset({"detach", "data"})
#: Property setters that change no bytes.
METADATA_SETTERS = frozenset({"requires_grad", "grad", "names", "retains_grad"})
#: In-place dunders (the rest of the in-place ops end with ``_``).
INPLACE_DUNDERS = frozenset(
    {
        "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
        "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__", "__setitem__",
    }
)  # fmt: skip
#: In-place ops on an offloaded gradient deferred until its next load (Note: [What a read of an
#: offloaded tensor does]): scaling and clamping, as ``clip_grad_norm_``, ``clip_grad_value_`` and a
#: GradScaler make them.
PENDABLE_OPS = frozenset(
    {
        "_foreach_mul_", "_foreach_div_", "_foreach_clamp_min_", "_foreach_clamp_max_", "mul_", "div_",
        "__imul__", "__itruediv__", "clamp_", "clamp_min_", "clamp_max_", "clip_",
        "_amp_foreach_non_finite_check_and_unscale_",
    }
)  # fmt: skip


def op_name(func: Callable[..., Any]) -> str:
    """``func``'s name; a property getter or setter by its property's name."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        return getattr(getattr(func, "__self__", None), "__name__", name)
    return name


@dataclass(eq=False)
class PendingOp:
    """An in-place op on one offloaded gradient, replayed on its bytes when they are next loaded."""

    func: Callable[..., Any]
    #: The arguments after the tensor (a foreach op takes it as a one-element list).
    rest: tuple[Any, ...]
    kwargs: dict[str, Any]
    foreach: bool

    def apply(self, t: torch.Tensor) -> None:
        rest = self.rest
        if op_name(self.func) == "_amp_foreach_non_finite_check_and_unscale_":
            # found_inf is the caller's; a replay only scales (its check was answered when recorded)
            rest = (torch.zeros_like(rest[0]), *rest[1:])
        with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
            self.func([t] if self.foreach else t, *rest, **self.kwargs)

    def signature(self) -> tuple[Any, ...]:
        """What makes two pending ops the same op on the same bytes (their arguments by value)."""
        args = (
            self.rest[1:] if op_name(self.func) == "_amp_foreach_non_finite_check_and_unscale_" else self.rest
        )
        return (op_name(self.func), tuple(_value_key(a) for a in args), tuple(sorted(self.kwargs.items())))


def _value_key(a: Any) -> Any:
    """An argument by its bits (-0.0 and 0.0 scale differently; a NaN equals itself here)."""
    if isinstance(a, torch.Tensor):
        raw = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        return (str(a.dtype), str(a.device), tuple(a.shape), bytes(raw.tolist()))
    if isinstance(a, float):
        return ("float", a.hex())
    return (type(a).__name__, repr(a))


@dataclass(eq=False)
class ViewStep:
    """A view op from a tensor: ``func(t, *rest, **kwargs)``, its output leaf ``leaf``."""

    func: Callable[..., Any]
    rest: tuple[Any, ...]
    kwargs: dict[str, Any]
    leaf: int

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        with torch._C.DisableTorchFunctionSubclass():
            return tree_flatten(self.func(t, *self.rest, **self.kwargs))[0][self.leaf]


@dataclass(eq=False)
class Guard:
    """What an :class:`OffloadedTensor` knows: its record and store, and the object it aliases."""

    store: TensorStore
    record: Record
    #: The record's own object this one stands for: ``record.tensor``, or ``record.holder`` (a DTensor
    #: over it: Note: [A sharded tensor is guarded as a whole] in teraio.states.shards).
    primary: torch.Tensor | None
    #: The views from the record's tensor to this object (empty: the whole tensor).
    view: tuple[ViewStep, ...] = ()
    #: The class the object had before it was guarded, given back by :func:`release`.
    original: type = torch.Tensor

    def label(self) -> str:
        rec = self.record
        idx = "?" if rec.param_idx is None else rec.param_idx
        if rec.kind.value == "parameter":
            what = "parameter"
        else:
            what = "the gradient" if rec.name == "grad" else f"optimizer state {rec.name!r}"
            what += " of parameter"
        return f"{'a view of ' if self.view else ''}{what} {idx}"

    @property
    def on_holder(self) -> bool:
        """Whether this object stands for the record's DTensor (else for its local tensor)."""
        return self.primary is not None and self.primary is self.record.holder

    def tracked(self) -> bool:
        rec = self.record
        return (
            rec.tracked
            and (rec.tensor is self.primary or (rec.holder is not None and rec.holder is self.primary))
            and rec.saved_key is not None
        )


class OffloadedTensor(torch.Tensor):
    """The class of an offloaded gradient or optimizer state while its bytes are on disk (Note: [What a
    read of an offloaded tensor does]). Never constructed: :func:`protect` swaps a tensor's class to it."""

    def __repr__(self, **kwargs: Any) -> str:  # type: ignore[override]
        # A parameter prints as one (its values served like any read); nn.Parameter's own __repr__
        # cannot take this object (not its subclass for super()).
        text = torch.Tensor.__repr__(self, **kwargs)
        if issubclass(_guard_of(self).original, torch.nn.Parameter):
            return "Parameter containing:\n" + text
        return text

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name = op_name(func)
        with torch._C.DisableTorchFunctionSubclass():
            if name in METADATA_OPS:
                return func(*args, **kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        guarded = [x for x in leaves if is_guarded(x)]
        if not guarded:  # another subclass dispatched here: nothing of ours in the call
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if getattr(func, "__name__", "") == "__set__":
            if name in METADATA_SETTERS:
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **kwargs)
            raise _refusal(_guard_of(args[0]), f"setting .{name}")
        hook = _guard_of(guarded[0]).store.before_guarded_use
        if hook is not None and hook():  # a pending step finished (teraio.states.step_pipeline): what
            return func(*args, **kwargs)  # is guarded now may have changed, so dispatch again
        for g in guarded:
            guard = _guard_of(g)
            if not guard.tracked():
                raise StatesError(
                    f"{guard.label()} was dropped by teraio (zero_grad, load_state_dict or close) while "
                    "on disk: read the current one (param.grad, opt.state[p]) instead of a kept reference"
                )
        if name in ALIAS_OPS:
            return alias_of(args[0])
        mutated = _mutated(name, args, kwargs)
        if mutated:
            from teraio.states import grad_norms

            return grad_norms.serve_in_place(func, name, args, kwargs, mutated)
        if name == "_foreach_norm":
            from teraio.states import grad_norms

            return grad_norms.serve_foreach_norm(func, args, kwargs)
        return serve_read(func, args, kwargs, leaves, spec)


def _guard_of(t: torch.Tensor) -> Guard:
    return t.__dict__["_teraio_guard"]


#: The guarded classes: OffloadedTensor, and OffloadedDTensor once a DTensor was guarded.
_GUARDED_TYPES: set[type] = {OffloadedTensor}


def is_guarded(t: object) -> bool:
    """Whether ``t`` is an offloaded tensor's guarded object (a tensor or a DTensor over one)."""
    return type(t) in _GUARDED_TYPES


def guard_of(t: object) -> Guard | None:
    """The guard of an offloaded tensor (None: a plain tensor or not a tensor)."""
    if not is_guarded(t):
        return None
    return _guard_of(t)  # type: ignore[arg-type]


_DTENSOR_GUARD: list[type] = []


def _holder_class() -> type:
    """The guarded class of a DTensor (Note: [A sharded tensor is guarded as a whole] in
    teraio.states.shards): a DTensor to ``isinstance`` and to the foreach checks, whose torch calls go
    through the guard as an :class:`OffloadedTensor`'s do. Made at the first use: torch.distributed may
    be absent."""
    if not _DTENSOR_GUARD:
        from torch.distributed.tensor import DTensor
        from torch.optim import optimizer as _optimizer

        class OffloadedDTensor(DTensor):  # type: ignore[misc]
            __slots__ = ()
            __torch_function__ = OffloadedTensor.__dict__["__torch_function__"]

            # DTensor's own Python methods that read the local shard (collectives over it) are not torch
            # calls: served through the guard as reads.
            def full_tensor(self, *args: Any, **kwargs: Any) -> Any:
                return OffloadedDTensor.__torch_function__(DTensor.full_tensor, (), (self, *args), kwargs)

            def redistribute(self, *args: Any, **kwargs: Any) -> Any:
                return OffloadedDTensor.__torch_function__(DTensor.redistribute, (), (self, *args), kwargs)

        _GUARDED_TYPES.add(OffloadedDTensor)
        # clip_grad_norm_ and the optimizers take the foreach path over DTensors: over guarded ones too.
        for supported in (_foreach_utils._foreach_supported_types, _optimizer._foreach_supported_types):
            if DTensor in supported and OffloadedDTensor not in supported:
                supported.append(OffloadedDTensor)
        _DTENSOR_GUARD.append(OffloadedDTensor)
    return _DTENSOR_GUARD[0]


def _refusal(guard: Guard, what: str) -> StatesError:
    rec = guard.record
    if rec is not None and rec.kind.value == "parameter":
        return StatesError(
            f"{guard.label()} is on disk (teraio.States(parameters=True)): {what} would change it in place; "
            "change it with model.load_state_dict(), or inside `with backend.states.parameters_materialized():`"
        )
    if rec is not None and rec.name == "grad":
        return StatesError(
            f"{guard.label()} is on disk (teraio.States(gradients=True)): {what} would change it in place, "
            "and only scaling and clamping (clip_grad_norm_, clip_grad_value_, a GradScaler) are applied "
            "to an offloaded gradient; read a copy with backend.states.gradient(p)"
        )
    return StatesError(
        f"{guard.label()} is on disk (teraio.States): {what} would change it in place; read it through "
        "opt.state_dict() (copies) and change it with opt.load_state_dict()"
    )


def _mutated(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The guarded tensors this call writes into: the first argument of an in-place op, ``out=``."""
    written: list[Any] = []
    if name in INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("__")):
        if args:
            written += list(args[0]) if isinstance(args[0], (list, tuple)) else [args[0]]
    out = kwargs.get("out")
    if out is not None:
        written += list(out) if isinstance(out, (list, tuple)) else [out]
    return [t for t in written if is_guarded(t)]


def refuse_mutation(t: torch.Tensor, name: str) -> StatesError:
    """The one-line error for an in-place ``name`` on the offloaded ``t``."""
    return _refusal(_guard_of(t), f"{name}()")


# -- serving a read -------------------------------------------------------------------------------------
def load_for_call(tensors: list[torch.Tensor]) -> list[tuple[Record, TensorStore]]:
    """Load the records behind these guarded objects (each once) for one call; the caller evicts them
    again with :func:`evict_after_call` (no write: their disk copies did not change)."""
    from teraio.states.store import Residency

    loaded: list[tuple[Record, TensorStore]] = []
    for guard in [_guard_of(t) for t in tensors]:  # all read before a load makes one of them plain
        rec, store = guard.record, guard.store
        assert rec is not None and store is not None
        if any(r is rec for r, _ in loaded):
            continue
        if rec.residency in (Residency.DISK, Residency.READING):
            store.load(rec)  # the class of rec.tensor is plain again, its pending ops replayed
            loaded.append((rec, store))
    return loaded


def evict_after_call(loaded: list[tuple[Record, TensorStore]]) -> None:
    for rec, store in loaded:
        store.evict(rec)


def real(t: Any) -> Any:
    """The record's own tensor for a guarded object, or its view of it (its bytes loaded by the
    caller), else ``t``."""
    guard = guard_of(t)
    if guard is None:
        return t
    out = guard.record.holder if guard.on_holder else guard.record.tensor
    for step in guard.view:
        out = step.apply(out)
    return out


#: Tensor methods whose result shares the tensor's memory outside torch: served on a copy (Note: [What a
#: read of an offloaded tensor does]).
_EXPORTS_MEMORY = frozenset({"numpy", "__array__", "__dlpack__"})


def serve_read(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], leaves: list[Any], spec: Any
) -> Any:
    """Note: [What a read of an offloaded tensor does]: load, run, evict. A result over the bytes of the
    first argument's record (a view) becomes a guarded view of it; any other result sharing loaded bytes
    is copied; the record's own object comes back as itself."""
    base = guard_of(args[0]) if args else None  # before the load makes the record's tensor plain
    rest_guarded = any(is_guarded(x) for x in tree_flatten((args[1:], kwargs))[0])
    loaded = load_for_call([x for x in leaves if is_guarded(x)])
    views: list[tuple[int, torch.Tensor]] = []
    try:
        real_args, real_kwargs = tree_unflatten([real(x) for x in leaves], spec)
        with torch._C.DisableTorchFunctionSubclass():
            if getattr(func, "__name__", None) in _EXPORTS_MEMORY and isinstance(real_args[0], torch.Tensor):
                # The copy needs grad as the guarded object does (``p.detach()`` is guarded over ``p``).
                copy = real_args[0].detach().clone().requires_grad_(bool(args[0].requires_grad))
                real_args = (copy, *real_args[1:])
            out = func(*real_args, **real_kwargs)
            own = {id(r.tensor) for r, _ in loaded} | {id(r.holder) for r, _ in loaded}
            ptrs = {r.tensor.untyped_storage().data_ptr() for r, _ in loaded} - {0}
            # A DTensor's bytes are its local shard's (Note: [A sharded tensor's bytes are its local shard]).
            base_ptr = local(real_args[0]).untyped_storage().data_ptr() if base is not None else None
            out_leaves, out_spec = tree_flatten(out)
            for i, x in enumerate(out_leaves):
                if (
                    not isinstance(x, torch.Tensor)
                    or id(x) in own
                    or local(x).untyped_storage().data_ptr() not in ptrs
                ):
                    continue
                if local(x).untyped_storage().data_ptr() == base_ptr and not rest_guarded and x is local(x):
                    views.append((i, x))
                else:
                    out_leaves[i] = x.clone()
    finally:
        evict_after_call(loaded)
    for i, x in views:  # the loaded bytes went with the eviction's new storage: these alias them
        assert base is not None
        with torch._C.DisableTorchFunctionSubclass():
            x.untyped_storage().resize_(0)
        step = ViewStep(func, args[1:], kwargs, i)
        x.__dict__["_teraio_guard"] = Guard(base.store, base.record, base.primary, (*base.view, step))
        x.__class__ = OffloadedTensor
    return tree_unflatten(out_leaves, out_spec)


# -- swapping the class ------------------------------------------------------------------------------------
# A guarded gradient takes the foreach path in clip_grad_norm_ and clip_grad_value_ as a plain one does
# (their per-tensor fallback runs other kernels than the reference's on CUDA): the foreach call then
# reaches the guard with the whole list (teraio.states.grad_norms).
if OffloadedTensor not in _foreach_utils._foreach_supported_types:
    _foreach_utils._foreach_supported_types.append(OffloadedTensor)


def protect(rec: Record, store: TensorStore) -> None:
    """The record's bytes are only on disk now: its tensor becomes guarded. A parameter stays an
    ``nn.Parameter`` to ``isinstance`` (torch's ``_is_param`` mark, which the check honours for any
    tensor) while guarded (Note: [Parameters are guarded while no module of the model runs] in
    teraio.states.entry_gate)."""
    for t, cls in [(rec.tensor, OffloadedTensor)] + (
        [(rec.holder, _holder_class())] if rec.holder is not None else []
    ):
        original = _guard_of(t).original if is_guarded(t) else type(t)
        t.__dict__["_teraio_guard"] = Guard(store=store, record=rec, primary=t, original=original)
        if issubclass(original, torch.nn.Parameter):
            t.__dict__["_is_param"] = True
        t.__class__ = cls


def drop_guards(rec: Record) -> None:
    """The store stops tracking these objects of ``rec`` (``forget``, or ``adopt`` of new ones): their
    guards keep raising on reads, and no longer hold ``rec`` (Note: [A dropped record's guarded objects
    are not a reference cycle])."""
    tombstone: Record | None = None
    for t in (rec.tensor, rec.holder):
        guard = guard_of(t)
        if guard is None or guard.record is not rec:
            continue
        if tombstone is None:
            tombstone = replace(
                rec,
                tensor=_DROPPED,
                holder=None,
                tracked=False,
                handle=None,
                pending=[],
                norms={},
                entry_gate=None,
            )
        t.__dict__["_teraio_guard"] = replace(guard, record=tombstone, primary=None)  # type: ignore[union-attr]


# Note: [A dropped record's guarded objects are not a reference cycle]
#     A guarded object holds its guard (in its ``__dict__``), the guard its record and itself (as
#     ``primary``), and the record the object: a reference cycle, harmless while the store tracks the
#     record (it is alive anyway), but once ``zero_grad`` drops a gradient on disk it is garbage that only
#     Python's cyclic collector frees, whenever it next runs, and with it whatever the gradient keeps
#     alive (under FSDP2, the reduce-scatter output of its whole group: the evidence is in
#     docs/measured_facts.md). So when the store stops tracking a record, its guarded objects get a
#     guard over a tombstone: a copy of the record's description (kind, name, index) that holds no
#     tensor, not tracked, so a kept reference still raises its one-line error on a read, and the record
#     and its bytes are freed by reference counting as soon as the loop drops the object.
_DROPPED = torch.empty(0)


def release(t: torch.Tensor) -> None:
    """The tensor's bytes are (about to be) in memory: its own class again."""
    if is_guarded(t):
        guard = t.__dict__.pop("_teraio_guard", None)
        t.__class__ = guard.original if guard is not None else torch.Tensor
        if guard is not None and issubclass(guard.original, torch.nn.Parameter):
            t.__dict__.pop("_is_param", None)


def release_record(rec: Record) -> None:
    """The record's bytes are (about to be) in memory: its tensor, and the DTensor over it, plain again."""
    release(rec.tensor)
    if rec.holder is not None:
        release(rec.holder)


@contextmanager
def unguarded(objs: Iterable[Any]) -> Iterator[None]:
    """These objects in their own classes for a while, guarded again after if still on disk: a graph
    compiled with a guarded parameter among its example inputs (teraio compiles a graph's final version
    while other graphs' parameters are on disk) reads their metadata only, but fake-tensor conversion
    would take the guard's calls for reads."""
    from teraio.states.store import Residency

    guards = [(t, _guard_of(t)) for t in objs if is_guarded(t)]
    for t, _ in guards:
        release(t)
    try:
        yield
    finally:
        for t, guard in guards:
            rec = guard.record
            if (
                (rec.tensor is t or rec.holder is t)
                and not guard.view
                and rec.residency is Residency.DISK
                and rec.guards_reads
            ):
                protect(rec, guard.store)


def alias_of(t: torch.Tensor) -> torch.Tensor:
    """``t.detach()`` / ``t.data`` of a guarded ``t``: another guarded object over the same record (a
    detach reads no bytes: it shares ``t``'s empty storage)."""
    guard = _guard_of(t)
    with torch._C.DisableTorchFunctionSubclass():
        out = t.detach()
    out.__dict__["_teraio_guard"] = Guard(guard.store, guard.record, guard.primary, guard.view)
    out.__class__ = type(t)
    return out
