"""``StateOffload``: a stock ``torch.optim`` optimizer whose gradients and states live on disk, with the
user's loop unchanged (``loss.backward(); opt.step(); opt.zero_grad()``).

It wires three pieces to one runtime engine: the gradient hooks (:mod:`teraio.states.grads`), the streamed
step (:mod:`teraio.states.optimizer_stream`) installed as the optimizer's ``step``, and the checkpoint
hooks (``state_dict()`` reads the committed states back, ``load_state_dict()`` writes the loaded ones out).
With ``offload_parameters=True`` a fourth piece, :class:`teraio.states.params.ParamResidency`, keeps the
parameters compiled graphs take on disk between their uses, the model's frozen weights among them,
read-only (:mod:`teraio.states.frozen`).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from teraio.planner.budget import format_size
from teraio.runtime import Engine, RuntimeConfig
from teraio.states.checkpoint import Checkpoints
from teraio.states.errors import StatesError
from teraio.states.frozen import frozen_parameters
from teraio.states.fsdp_shards import ShardGathers
from teraio.states.grads import GradOffload
from teraio.states.optimizer_stream import Consistency, StepLog, StreamedStep
from teraio.states.params import ParamResidency
from teraio.states.residency import model_states_record
from teraio.states.shards import is_sharded, local, local_nbytes, rewrap
from teraio.states.step_pipeline import attach_overlap
from teraio.states.store import Kind, Record, Residency, TensorStore

if TYPE_CHECKING:
    pass

DEFAULT_CHUNK_BYTES = 64 << 20

#: Parameters smaller than this stay resident with offload_parameters=True (norms, biases: Note: [When a
#: parameter is resident] in teraio.states.params).
DEFAULT_MIN_PARAM_BYTES = 64 << 10


def _adam_states(group: dict[str, Any]) -> int:
    return 3 if group.get("amsgrad", False) else 2


def _sgd_states(group: dict[str, Any]) -> int:
    return 1 if group.get("momentum", 0) != 0 else 0


#: The optimizer classes whose step is known to update each parameter from its own gradient and states
#: only (so a chunk's step equals the whole step restricted to the chunk), and the count of offloaded
#: state tensors of a parameter in a group (for cutting chunks before the first step made them).
SUPPORTED: dict[type[torch.optim.Optimizer], Callable[[dict[str, Any]], int]] = {
    torch.optim.Adam: _adam_states,
    torch.optim.AdamW: _adam_states,
    torch.optim.SGD: _sgd_states,
}


def check_optimizer(
    optimizer: object, option: str = "optimizer", *, optimizer_in_backward: bool = False
) -> None:
    """Raise ``StatesError`` (one line) unless ``optimizer`` is a supported ``torch.optim.Optimizer`` (and
    ``optimizer_in_backward`` supported with its parameters)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise StatesError(
            f"{option} must be a torch.optim.Optimizer (AdamW, Adam or SGD), not {type(optimizer).__name__}"
        )
    if type(optimizer) not in SUPPORTED:
        names = ", ".join(sorted(c.__name__ for c in SUPPORTED))
        raise StatesError(
            f"{option}: teraio.States supports {names}, not {type(optimizer).__name__} (its step may mix "
            "parameters, so it cannot be streamed chunk by chunk); use states=None"
        )
    for g in optimizer.param_groups:
        if g.get("differentiable", False):
            raise StatesError(f"{option}: teraio.States does not support differentiable=True")
        for p in g["params"]:
            if is_sharded(p) and type(local(p)) in (torch.nn.Parameter, torch.Tensor):
                if optimizer_in_backward:
                    # FSDP2 hands over a sharded gradient after its reduce-scatter, outside the graph
                    # calls whose holds an update inside backward relies on.
                    raise StatesError(
                        f"{option}: optimizer_in_backward=True does not take FSDP2's sharded parameters "
                        "yet: use gradients=True to move the gradient shards instead"
                    )
                continue  # Note: [A sharded tensor's bytes are its local shard] in teraio.states.shards
            if type(p) not in (torch.nn.Parameter, torch.Tensor):
                # Another tensor subclass (a quantized weight) keeps its bytes in inner tensors that the
                # states' storage swap cannot reach.
                raise StatesError(
                    f"{option}: teraio.States supports plain parameters and FSDP2's DTensors, not "
                    f"{type(p).__name__} ones; use states=None with them"
                )


class StateOffload(Checkpoints):
    """Gradients and optimizer states of ``optimizer`` on disk between their uses; the step streamed.

    Args:
        optimizer: a ``torch.optim.AdamW``, ``Adam`` or ``SGD``; its ``step``, ``zero_grad``,
            ``state_dict`` and ``load_state_dict`` keep working as before.
        engine: the runtime engine to use (not closed by :meth:`close`); None: a new one from
            ``runtime_config`` (closed by :meth:`close`).
        runtime_config: for the engine made when ``engine`` is None (default: ``RuntimeConfig()``).
        chunk_bytes: bytes of gradients and states one chunk of the streamed step holds.
        offload_gradients: gradients on disk too, between the backward that accumulates them and the step
            (Note: [Gradients stay readable unless asked] in teraio.states.grads).
        optimizer_in_backward: update each parameter inside backward once its gradient is complete, and
            free the gradient (Note: [The optimizer step inside backward] in
            teraio.states.optimizer_stream); ``step()`` then commits.
        grad_window_bytes: gradient bytes being written during backward before a hook waits (default:
            two chunks).
        overlap_step: with parameters and gradients offloaded, the offloaded parameters' update runs in
            the next forward, once ``overlap_ready()`` says so (Note: [The step of offloaded parameters
            runs in the next forward] in teraio.states.step_pipeline).

    Raises:
        StatesError: an unsupported optimizer (one line).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        engine: Engine | None = None,
        *,
        runtime_config: RuntimeConfig | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        grad_window_bytes: int | None = None,
        offload_gradients: bool = False,
        optimizer_in_backward: bool = False,
        model: torch.nn.Module | None = None,
        offload_parameters: bool = False,
        min_param_bytes: int = DEFAULT_MIN_PARAM_BYTES,
        overlap_step: bool = True,
    ) -> None:
        check_optimizer(optimizer, optimizer_in_backward=optimizer_in_backward)
        if offload_parameters and model is None:
            raise StatesError(
                "offload_parameters=True needs the model too (model=...): its state_dict and load_state_dict "
                "must read and write the offloaded parameters"
            )

        if getattr(optimizer, "_teraio_states", None) is not None:
            raise StatesError("this optimizer already has a StateOffload attached: close that one first")
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
            raise StatesError(f"chunk_bytes must be a positive number of bytes, not {chunk_bytes!r}")
        self.optimizer = optimizer
        #: The model the optimizer trains (None: not given; checkpoints need it).
        self.model = model
        self._own_engine = engine is None
        self.engine = engine if engine is not None else Engine(runtime_config or RuntimeConfig())
        self.store = TensorStore(self.engine)
        self.params: list[torch.nn.Parameter] = [p for g in optimizer.param_groups for p in g["params"]]
        self.chunk_bytes = chunk_bytes
        window = grad_window_bytes if grad_window_bytes is not None else 2 * chunk_bytes
        if optimizer_in_backward and offload_gradients:
            raise StatesError(
                "optimizer_in_backward frees each gradient once it is used, so there is none to offload: "
                "drop offload_gradients=True"
            )
        self.grads = GradOffload(self.store, self.params, window, offload=offload_gradients)
        self.in_backward = optimizer_in_backward
        self.window_bytes = window
        #: Two chunks' worth, following the chunk size the whole-step plan cuts (Note: [The streamed
        #: step's chunks are sized to the budget] in teraio.states.residency), unless given.
        self.window_follows_chunks = grad_window_bytes is None
        if optimizer_in_backward:
            self.grads.on_complete = self._update_in_backward
        self.stream = StreamedStep(
            optimizer, self.store, self.params, chunk_bytes, SUPPORTED[type(optimizer)]
        )
        #: Note: [When a parameter is resident] in teraio.states.params (None: parameters stay in memory).
        self.residency: ParamResidency | None = None
        #: FSDP2's gathers of offloaded shards (None: no sharded parameter on disk).
        self.shard_gathers: ShardGathers | None = None
        if offload_parameters:
            assert model is not None
            # Note: [Frozen weights are read-only state] in teraio.states.frozen
            frozen = frozen_parameters(model, self.params)
            self.residency = ParamResidency(self.store, self.params, min_param_bytes, frozen)
            self.residency.attach_module(model)
            if any(is_sharded(p) for p in self.params):
                # Note: [A shard is read back before its all-gather] in teraio.states.fsdp_shards
                self.shard_gathers = ShardGathers(self.residency, model)
            self.residency.frozen.log_setup()
            self.stream.residency = self.residency
            self.residency.hold_for_update = optimizer_in_backward
            if optimizer_in_backward:
                self.residency.on_backward_start = self._read_states_ahead
        #: Note: [The step of offloaded parameters runs in the next forward] in teraio.states.step_pipeline
        #: (None: every step runs whole in ``opt.step()``); used while ``overlap_ready()`` (the backend's).
        self.overlapped = attach_overlap(self) if overlap_step else None
        self.overlap_ready: Callable[[], bool] = lambda: False
        self.closed = False
        #: Called once after the next commit of a step made inside backward (teraio.states.residency).
        self.after_commit: Callable[[], None] | None = None
        self._raw_step = getattr(type(optimizer).step, "__wrapped__", type(optimizer).step)
        self._had_step = "step" in vars(optimizer)
        self._had_zero_grad = "zero_grad" in vars(optimizer)
        self._saved_step = vars(optimizer).get("step")
        self._saved_zero_grad = vars(optimizer).get("zero_grad")
        # The streamed step runs the optimizer's step hooks once, as the stock step does
        # (Optimizer.profile_hook_step), and calls the raw algorithm once per chunk.
        streamed = torch.optim.Optimizer.profile_hook_step(_streamed_step)
        # An LR scheduler made before the backend wrapped the stock step to record that it ran, and warns
        # at its first step when that wrapper is gone. The streamed step records it itself
        # (``_opt_called``, below), so it carries the scheduler's mark: no false warning, and the real
        # one (the scheduler stepped before the optimizer) still comes.
        streamed._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        optimizer.step = types.MethodType(streamed, optimizer)  # type: ignore[method-assign]
        optimizer.zero_grad = types.MethodType(_zero_grad, optimizer)  # type: ignore[method-assign]
        self._hooks = [
            optimizer.register_state_dict_post_hook(_state_dict_post_hook),
            optimizer.register_load_state_dict_post_hook(_load_state_dict_post_hook),
        ]
        optimizer._teraio_states = self  # type: ignore[attr-defined]
        if any(optimizer.state.get(p) for p in self.params):  # attached to an optimizer that stepped
            self.stream.adopt_all()

    # -- what the optimizer calls ------------------------------------------------------------------
    def _check_params(self) -> None:
        now = [p for g in self.optimizer.param_groups for p in g["params"]]
        if len(now) != len(self.params) or any(a is not b for a, b in zip(now, self.params)):
            raise StatesError(
                "the optimizer's parameters changed since StateOffload was attached (add_param_group?): "
                "attach a new one after changing them"
            )

    def step_order(self) -> list[int]:
        """Parameter indices in the order the step updates them (Note: [The step streams in backward
        order] in teraio.states.optimizer_stream)."""
        seen = list(self.grads.arrival_order)
        known = set(seen)
        return seen + [i for i in reversed(range(len(self.params))) if i not in known]

    def _update_in_backward(self, idx: int) -> None:
        """Note: [The optimizer step inside backward] in teraio.states.optimizer_stream."""
        order = self.grads.arrival_order
        pos = order.index(idx)
        nxt = order[pos + 1] if pos + 1 < len(order) else None
        opt = self.optimizer
        self.stream.update_in_backward(idx, lambda: self._raw_step(opt), nxt, self.window_bytes)

    def _read_states_ahead(self, idxs: tuple[int, ...]) -> None:
        """A block's backward starts: read its parameters' optimizer states now, so that the updates
        inside that backward find them in memory (Note: [The optimizer step inside backward] in
        teraio.states.optimizer_stream)."""
        for i in idxs:
            for rec in self.stream.records_of(i):
                self.store.prefetch(rec)

    def step(self) -> None:
        """The streamed step (the optimizer's ``step`` calls it through the stock hooks wrapper); with
        ``optimizer_in_backward``, the commit of what backward updated."""
        if self.closed:
            raise StatesError("this StateOffload is closed: the optimizer's states were restored to memory")
        self.settle_step()
        if self.in_backward:
            self.stream.commit_in_backward()
            if self.after_commit is not None:  # a residency planned while the step was in flight
                pending, self.after_commit = self.after_commit, None
                pending()
            return
        self._check_params()
        self.grads.settle()
        if self.residency is not None and self.residency.gate is not None:
            self.residency.gate.settle()  # a forward that raised may have left the gate open
        opt = self.optimizer

        def raw() -> Any:
            return self._raw_step(opt)

        if self.overlapped is not None and self.overlap_ready():
            self.overlapped.start(raw)
        else:
            self.stream.run(self.step_order(), self.grads.current, raw)

    def settle_step(self) -> None:
        """A step whose update runs in the next forward finishes now (teraio.states.step_pipeline)."""
        if self.overlapped is not None:
            self.overlapped.finish()

    def set_chunk_bytes(self, chunk_bytes: int) -> None:
        """The streamed step cuts its chunks at ``chunk_bytes`` from its next step; the gradients written
        during backward wait beyond two of them (unless their window was given)."""
        self.stream.chunk_bytes = chunk_bytes
        if self.window_follows_chunks:
            self.window_bytes = self.grads.window_bytes = 2 * chunk_bytes

    def grad_nbytes(self, idx: int) -> int:
        """The bytes the step reads of parameter ``idx``'s gradient: its size when gradients are offloaded
        (a gradient has its parameter's size), else none."""
        p = self.params[idx]
        return local_nbytes(p) if self.grads.offload else 0

    def zero_grad(self, set_to_none: bool) -> None:
        if not self.closed:
            if not set_to_none:  # zeroing in place would reach the gradients a pending step still reads
                self.settle_step()
            self.grads.zero_grad(set_to_none)

    # -- reading what is on disk -------------------------------------------------------------------
    def parameters_materialized(self) -> Any:
        """A context manager: every offloaded parameter in memory inside it, changes written after
        (Note: [Reading an offloaded parameter] in teraio.states.params); a no-op without
        ``offload_parameters``."""
        import contextlib

        return contextlib.nullcontext() if self.residency is None else self.residency.materialized()

    def gradient(self, param: torch.Tensor) -> torch.Tensor | None:
        """A copy of ``param.grad``'s values (read back if offloaded), or None without a gradient."""
        idx = self._index(param)
        self.settle_step()
        rec = self.grads.current(idx)
        if rec is None:
            g = self.params[idx].grad
            return None if g is None else g.detach().clone()
        self.grads.settle()
        return self.store.read_copy(rec)

    def _index(self, param: torch.Tensor) -> int:
        for i, p in enumerate(self.params):
            if p is param:
                return i
        raise StatesError("not a parameter of this optimizer")

    def committed_state(self) -> dict[int, dict[str, Any]]:
        """The last committed step's optimizer state, by parameter index, read back from disk (copies),
        whatever happened since: what ``state_dict()['state']`` holds when the parameters agree."""
        self.settle_step()
        out: dict[int, dict[str, Any]] = {}
        for idx, p in enumerate(self.params):
            st = self.optimizer.state.get(p)
            if not st:
                continue
            recs = self.stream.records.get(idx, {})
            out[idx] = {
                k: (rewrap(v, self.store.read_copy(recs[k])) if k in recs else v) for k, v in st.items()
            }
        return out

    @property
    def committed_steps(self) -> int:
        """Steps committed to disk by this object (Note: [A step commits all of its states or none])."""
        return self.stream.committed_steps

    @property
    def consistency(self) -> Consistency:
        return self.stream.consistency

    @property
    def last_step(self) -> StepLog | None:
        """The chunks of the last streamed step."""
        return self.stream.last

    def stats(self) -> dict[str, Any]:
        """Bytes moved (written + read) by kind, resident bytes now and at peak, and the I/O counters."""
        s = self.store.stats()
        moved = {k.value: s["written_bytes"][k.value] + s["read_bytes"][k.value] for k in Kind}
        residency = self.residency
        return {
            "moved_bytes_by_kind": {"activation": 0, "parameter": 0, **moved},
            **s,
            # Note: [Frozen weights are read-only state] in teraio.states.frozen (None: parameters resident)
            "frozen_parameters": (
                None if residency is None else residency.frozen.stats(residency.frozen_offloaded_nbytes())
            ),
            "peak_resident_state_bytes": s["peak_resident_bytes"][Kind.OPTIMIZER_STATE.value],
            "step_peak_resident_state_bytes": self.store.counts.window_peak_resident[Kind.OPTIMIZER_STATE],
            "committed_steps": self.committed_steps,
            "consistency": self.consistency.value,
        }

    def model_states(self) -> dict[str, Any]:
        """The parameters, gradients and optimizer states by kind, and the bytes a step moves for each
        (:func:`teraio.states.residency.model_states_record`): a profile's ``model_states``."""
        return model_states_record(self)

    # -- checkpoints ---------------------------------------------------------------------------------
    def _fill_state_dict(self, sd: dict[str, Any]) -> dict[str, Any]:
        self.stream.check_usable()
        self.grads.settle()
        by_tensor: dict[int, Record] = {id(r.tensor): r for r in self.stream.all_records()}
        state = {}
        for pid, entries in sd["state"].items():
            # Note: [A sharded tensor's bytes are its local shard] in teraio.states.shards
            state[pid] = {
                k: (
                    rewrap(v, self.store.read_copy(by_tensor[id(local(v))]))
                    if id(local(v)) in by_tensor
                    else v
                )
                for k, v in entries.items()
            }
        return {**sd, "state": state}

    # -- detach --------------------------------------------------------------------------------------
    def close(self, restore: bool = True) -> None:
        """Restore the optimizer's own methods and close the engine if this object made it.

        ``restore=True`` first brings every gradient and state back into memory (the optimizer then works
        as without teraio); it raises ``StatesError`` before reading a byte when they would not fit in
        the memory available now. ``restore=False`` drops them instead: the optimizer's state is emptied
        and offloaded gradients become None (save a checkpoint first: ``optimizer.state_dict()`` reads
        them from disk).
        """
        if self.closed:
            return
        self.settle_step()
        if self.overlapped is not None:
            self.overlapped.detach()
        self.grads.settle()
        grads = [rec for idx in list(self.grads.records) if (rec := self.grads.current(idx)) is not None]
        params = list(self.residency.records.values()) if self.residency is not None else []
        if restore or params:
            # Parameters come back whatever restore says: the model needs them.
            on_disk = (grads + self.stream.all_records()) if restore else []
            need = sum(r.nbytes for r in on_disk + params if r.residency is Residency.DISK)
            device = self.params[0].device if self.params else torch.device("cpu")
            available = available_memory_bytes(device)
            if available is not None and need > available:
                raise StatesError(
                    f"closing would read {format_size(need)} of offloaded parameters, gradients and optimizer "
                    f"states back into memory, more than the {format_size(available)} available: save a "
                    "checkpoint (model.state_dict() and optimizer.state_dict() read them from disk) and close "
                    "with restore_states=False"
                    + (" (parameters come back even then: the model needs them)" if params else "")
                )
        if self.shard_gathers is not None:
            self.shard_gathers.close()
            self.shard_gathers = None
        if self.residency is not None:
            self.residency.close()
            self.stream.residency = self.residency = None
        if restore:
            for rec in grads:
                self.store.load(rec)
            for rec in self.stream.all_records():
                self.store.load(rec)
        else:
            for idx, p in enumerate(self.params):
                rec = self.grads.current(idx)
                if rec is not None and rec.residency is not Residency.MEMORY:
                    p.grad = None
            self.optimizer.state.clear()
        self.grads.remove_hooks()
        for h in self._hooks:
            h.remove()
        opt = self.optimizer
        for name, had, saved in (
            ("step", self._had_step, self._saved_step),
            ("zero_grad", self._had_zero_grad, self._saved_zero_grad),
        ):
            if had:
                setattr(opt, name, saved)
            else:
                vars(opt).pop(name, None)
        opt._teraio_states = None  # type: ignore[attr-defined]
        self.closed = True
        if self._own_engine:
            self.engine.close()


def available_memory_bytes(device: torch.device) -> int | None:
    """Memory a restore may take now: the device's free memory on CUDA, else Linux's MemAvailable (None:
    unknown, then nothing is refused)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _of(opt: torch.optim.Optimizer) -> StateOffload:
    return opt._teraio_states  # type: ignore[attr-defined]


def _streamed_step(opt: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
    """The optimizer's ``step`` while a StateOffload is attached (wrapped in the stock hooks)."""
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    opt._opt_called = True  # type: ignore[attr-defined]  # an LR scheduler checks it
    _of(opt).step()
    return loss


def _zero_grad(opt: torch.optim.Optimizer, set_to_none: bool = True) -> None:
    _of(opt).zero_grad(set_to_none)
    type(opt).zero_grad(opt, set_to_none)


def _state_dict_post_hook(opt: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
    states = getattr(opt, "_teraio_states", None)
    return sd if states is None else states._fill_state_dict(sd)


def _load_state_dict_post_hook(opt: torch.optim.Optimizer) -> None:
    states = getattr(opt, "_teraio_states", None)
    if states is not None:
        states.stream.adopt_all()
