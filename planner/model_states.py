"""Model states: how many bytes a model's parameters, gradients and optimizer states take, and where.

Activations are what a Profile plans; the *model states* are the rest of a training run's memory: the
parameters, their gradients and the optimizer's states (Adam's two moments, and with mixed precision
the fp32 master copy of every weight). They do not change size with the batch, and for large models they
outweigh the activations: a 70B-parameter model in fp32 with AdamW holds 16 bytes per parameter, 1.1 TB.
Before anyone buys GPUs or SSDs they want to know how many of those bytes stay on each device, how many
live elsewhere, and how many cross the link every step if they are streamed. This module is teraio's one
accounting of that, in plain arithmetic (no torch): ``teraio estimate`` reports it, and whole-state
offload reuses it.

Bytes per parameter (:func:`bytes_per_param`), with ``optimizer`` holding ``optimizer_state_nbytes``:

==============  =====  ====  ==========================================================
precision       param  grad  optimizer states (adamw / adam, sgd with momentum, sgd)
==============  =====  ====  ==========================================================
fp32            4      4     8 (two fp32 moments)      / 4 / 0
bf16-mixed      2      4     12 (fp32 master + moments) / 8 / 4
fp16-mixed      2      4     12                         / 8 / 4
==============  =====  ====  ==========================================================

Mixed precision keeps a low-precision working copy of the weights (what forward and backward compute
with), accumulates gradients in fp32 (``grad_accum="fp32"``, DeepSpeed's default
``gradient_accumulation_dtype``; ``"param"`` accumulates in the working dtype, 2 bytes) and counts the
fp32 master weights among the optimizer states, because only the optimizer step reads them.

Placement (:func:`model_states`), per device of ``gpus`` data-parallel devices:

- ``zero_stage`` shards state across the devices as ZeRO does: 1 the optimizer states, 2 also the
  gradients, 3 also the parameters; 0 keeps a full copy of everything on every device.
- ``offload`` names the kinds kept off the device (host memory or SSD); their bytes are counted as
  ``offloaded_nbytes`` (this device's share: sharded kinds 1/gpus, replicated kinds whole).
- When parameters are sharded (stage 3) or offloaded, a device must still gather one layer's full
  parameters, and hold that layer's gradients, in the working dtype while it computes the layer: the
  ``gathered_nbytes`` of the largest layer (``largest_layer_params`` x (param + grad bytes in the working
  dtype)). Only that one layer is counted: prefetching the next layer while computing this one would
  double it, and is left to the plan.

Traffic of streamed states (:func:`streamed_traffic`): when a kind lives off the device and is brought
in for each step, each step reads and writes this device's share of it as follows (an assumption about
a streamed GPU step, stated so it can be checked): parameters are read for forward and again for
backward, and the updated ones written back once (fp32 training also reads them in the optimizer step,
which has no master copy to read instead); gradients are written once as backward produces them and read
once by the optimizer step; optimizer states are read and written once by the optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

Precision = Literal["fp32", "bf16-mixed", "fp16-mixed"]
Optimizer = Literal["adamw", "adam", "sgd-momentum", "sgd"]
StateKind = Literal["param", "grad", "optimizer_state"]
GradAccum = Literal["fp32", "param"]

PRECISIONS: tuple[str, ...] = get_args(Precision)
OPTIMIZERS: tuple[str, ...] = get_args(Optimizer)
STATE_KINDS: tuple[str, ...] = get_args(StateKind)
ZERO_STAGES = (0, 1, 2, 3)

#: Bytes of one element of each precision's working copy of the weights.
_WORKING_NBYTES = {"fp32": 4, "bf16-mixed": 2, "fp16-mixed": 2}
#: fp32 moments per parameter that each optimizer keeps.
_MOMENTS = {"adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0}
FP32_NBYTES = 4


class ModelStateError(ValueError):
    """An argument of the model-state accounting is out of range; the message names it."""


@dataclass(frozen=True)
class BytesPerParam:
    """Bytes each parameter costs, by kind, before any sharding or offload (module docstring table)."""

    param_nbytes: int  # the working copy forward and backward compute with
    grad_nbytes: int  # the gradient as accumulated until the optimizer step
    optimizer_state_nbytes: int  # moments, plus the fp32 master copy under mixed precision
    #: While a layer is computed with gathered parameters: its parameters and its gradients in the
    #: working dtype.
    gathered_nbytes: int

    @property
    def total_nbytes(self) -> int:
        return self.param_nbytes + self.grad_nbytes + self.optimizer_state_nbytes

    def of(self, kind: str) -> int:
        """The bytes of one kind ("param", "grad", "optimizer_state")."""
        return {
            "param": self.param_nbytes,
            "grad": self.grad_nbytes,
            "optimizer_state": self.optimizer_state_nbytes,
        }[kind]


def _choice(value: object, name: str, choices: tuple) -> None:
    if value not in choices:
        raise ModelStateError(f"{name} is {value!r}; choose one of {', '.join(map(str, choices))}")


def _count(value: object, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ModelStateError(f"{name} is {value!r}; expected an integer >= {minimum}")
    return value


def bytes_per_param(
    precision: Precision = "fp32", optimizer: Optimizer = "adamw", *, grad_accum: GradAccum = "fp32"
) -> BytesPerParam:
    """Bytes per parameter of each kind (the module docstring's table).

    Raises:
        ModelStateError: an unknown precision, optimizer or gradient accumulation dtype.
    """
    _choice(precision, "precision", PRECISIONS)
    _choice(optimizer, "optimizer", OPTIMIZERS)
    _choice(grad_accum, "grad_accum", get_args(GradAccum))
    working = _WORKING_NBYTES[precision]
    mixed = working != FP32_NBYTES
    grad = FP32_NBYTES if grad_accum == "fp32" else working
    # The fp32 master weights exist only under mixed precision; only the optimizer step reads them.
    master = FP32_NBYTES if mixed else 0
    return BytesPerParam(
        param_nbytes=working,
        grad_nbytes=grad,
        optimizer_state_nbytes=master + _MOMENTS[optimizer] * FP32_NBYTES,
        gathered_nbytes=2 * working,
    )


@dataclass(frozen=True)
class ModelStates:
    """One device's model states (see :func:`model_states`). All ``*_nbytes`` are per device."""

    num_params: int
    largest_layer_params: int
    precision: str
    optimizer: str
    gpus: int
    zero_stage: int
    offload: frozenset[str]
    per_param: BytesPerParam
    #: Resident on the device, by kind (0 for an offloaded kind).
    param_nbytes: int
    grad_nbytes: int
    optimizer_state_nbytes: int
    #: One layer's gathered parameters and gradients (0 unless parameters are sharded or offloaded).
    gathered_nbytes: int
    #: This device's share of the kinds kept off the device, by kind.
    offloaded_nbytes_by_kind: dict[str, int]

    @property
    def device_nbytes(self) -> int:
        """Everything the model states hold on the device."""
        return self.param_nbytes + self.grad_nbytes + self.optimizer_state_nbytes + self.gathered_nbytes

    @property
    def offloaded_nbytes(self) -> int:
        return sum(self.offloaded_nbytes_by_kind.values())

    def share_nbytes(self, kind: str) -> int:
        """This device's share of ``kind`` wherever it lives (resident or offloaded)."""
        resident = {
            "param": self.param_nbytes,
            "grad": self.grad_nbytes,
            "optimizer_state": self.optimizer_state_nbytes,
        }[kind]
        return resident + self.offloaded_nbytes_by_kind.get(kind, 0)

    def to_dict(self) -> dict[str, object]:
        return {
            "num_params": self.num_params,
            "largest_layer_params": self.largest_layer_params,
            "precision": self.precision,
            "optimizer": self.optimizer,
            "gpus": self.gpus,
            "zero_stage": self.zero_stage,
            "offload": sorted(self.offload),
            "bytes_per_param": {
                "param": self.per_param.param_nbytes,
                "grad": self.per_param.grad_nbytes,
                "optimizer_state": self.per_param.optimizer_state_nbytes,
            },
            "param_nbytes": self.param_nbytes,
            "grad_nbytes": self.grad_nbytes,
            "optimizer_state_nbytes": self.optimizer_state_nbytes,
            "gathered_nbytes": self.gathered_nbytes,
            "device_nbytes": self.device_nbytes,
            "offloaded_nbytes_by_kind": dict(self.offloaded_nbytes_by_kind),
            "offloaded_nbytes": self.offloaded_nbytes,
        }


#: The kinds each ZeRO stage shards over the devices.
_SHARDED_BY_STAGE: dict[int, frozenset[str]] = {
    0: frozenset(),
    1: frozenset({"optimizer_state"}),
    2: frozenset({"optimizer_state", "grad"}),
    3: frozenset({"optimizer_state", "grad", "param"}),
}


def model_states(
    num_params: int,
    *,
    largest_layer_params: int = 0,
    precision: Precision = "fp32",
    optimizer: Optimizer = "adamw",
    gpus: int = 1,
    zero_stage: int = 0,
    offload: tuple[str, ...] | frozenset[str] = (),
    grad_accum: GradAccum = "fp32",
) -> ModelStates:
    """One device's share of the model states of ``num_params`` parameters (module docstring).

    Args:
        num_params: parameters of the model (shared ones once).
        largest_layer_params: parameters of the largest module counted on its own (what is gathered at
            once when parameters are sharded or offloaded).
        gpus: data-parallel devices the states are sharded over (``zero_stage`` > 0).
        zero_stage: 0 (replicated), 1 (optimizer states sharded), 2 (+ gradients), 3 (+ parameters).
        offload: kinds kept off the device: any of "param", "grad", "optimizer_state".

    Raises:
        ModelStateError: naming the argument that is out of range.
    """
    _count(num_params, "num_params", 0)
    _count(largest_layer_params, "largest_layer_params", 0)
    _count(gpus, "gpus", 1)
    _choice(zero_stage, "zero_stage", ZERO_STAGES)
    offload_set = frozenset(offload)
    for kind in offload_set:
        _choice(kind, "offload kind", STATE_KINDS)
    per = bytes_per_param(precision, optimizer, grad_accum=grad_accum)
    sharded = _SHARDED_BY_STAGE[zero_stage]
    resident: dict[str, int] = {}
    away: dict[str, int] = {}
    for kind in STATE_KINDS:
        total = num_params * per.of(kind)
        # A sharded kind's share is rounded down as a partition of whole bytes would be; DeepSpeed's
        # estimator does the same (``int(... / total_gpus)``).
        share = total // gpus if kind in sharded else total
        if kind in offload_set:
            away[kind] = share
            resident[kind] = 0
        else:
            resident[kind] = share
    gathers = "param" in sharded or "param" in offload_set
    return ModelStates(
        num_params=num_params,
        largest_layer_params=largest_layer_params,
        precision=precision,
        optimizer=optimizer,
        gpus=gpus,
        zero_stage=zero_stage,
        offload=offload_set,
        per_param=per,
        param_nbytes=resident["param"],
        grad_nbytes=resident["grad"],
        optimizer_state_nbytes=resident["optimizer_state"],
        gathered_nbytes=largest_layer_params * per.gathered_nbytes if gathers else 0,
        offloaded_nbytes_by_kind=away,
    )


@dataclass(frozen=True)
class Traffic:
    """Bytes one device reads from and writes to where a kind lives, per training step."""

    read_nbytes: int
    write_nbytes: int

    @property
    def total_nbytes(self) -> int:
        return self.read_nbytes + self.write_nbytes


def streamed_traffic(states: ModelStates, kinds: tuple[str, ...] | None = None) -> dict[str, Traffic]:
    """Per step, the bytes this device moves for each streamed kind (module docstring, "Traffic").

    ``kinds`` defaults to the states' ``offload`` set: what lives off the device has to come in. Any
    kind may be asked for, to price streaming it (a kind that is resident now is priced at its share).

    Raises:
        ModelStateError: an unknown kind.
    """
    chosen = tuple(sorted(states.offload)) if kinds is None else kinds
    mixed = states.per_param.param_nbytes != FP32_NBYTES
    out: dict[str, Traffic] = {}
    for kind in chosen:
        _choice(kind, "kind", STATE_KINDS)
        share = states.share_nbytes(kind)
        if kind == "param":
            # Forward and backward each read the weights; fp32 training also reads them in the optimizer
            # step (mixed precision reads the master copy there instead); the updated ones go back once.
            reads = 2 if mixed else 3
            out[kind] = Traffic(read_nbytes=reads * share, write_nbytes=share)
        else:  # "grad": written by backward, read by the step; "optimizer_state": read and written by it
            out[kind] = Traffic(read_nbytes=share, write_nbytes=share)
    return out


def io_lower_bound_s(
    written_bytes: float, read_bytes: float, write_bw_bytes_per_s: float, read_bw_bytes_per_s: float
) -> float:
    """The I/O lower bound of a step: the bytes that must be written and read over the disk's bandwidth
    in each direction. Writes and reads are taken to share the drive, so their times add: the bound
    holds for a drive that cannot write and read at full speed at once."""
    return written_bytes / write_bw_bytes_per_s + read_bytes / read_bw_bytes_per_s


#: The kinds of a training step's tensors, as ``moved_bytes_by_kind`` names them (teraio's backend stats,
#: ``teraio plan``/``simulate``/``show``).
MOVED_KINDS: tuple[str, ...] = ("activation", "parameter", "gradient", "optimizer_state")


def offload_step_traffic(
    *,
    offloaded_param_nbytes: int,
    grad_nbytes: int,
    optimizer_state_nbytes: int,
    offload_gradients: bool,
    optimizer_in_backward: bool,
    kept_param_nbytes: int = 0,
    lower_bound: bool = False,
    overlap_step: bool = False,
) -> dict[str, Traffic]:
    """Per step, the bytes ``states="offload"`` moves for the parameters, gradients and optimizer states.

    The optimizer states are read and written once by the step. An offloaded gradient is written once,
    when backward completes it, and read once by the step; with ``optimizer_in_backward`` no gradient
    reaches the disk. An offloaded parameter is read for forward and again for backward, and its update
    written once; the streamed step after backward reads it a third time (the update inside backward
    finds it still in memory), and the next forward finds the ``kept_param_nbytes`` of its last chunk
    still in memory (the first layers, which that forward needs first). ``lower_bound`` leaves the third
    read out: the bytes a step has to move at the least, whatever the order of its updates. So does
    ``overlap_step``: the update of an offloaded parameter runs in the next forward, which computes with
    the value the update read and wrote (one read for both).
    """
    for name, value in (
        ("offloaded_param_nbytes", offloaded_param_nbytes),
        ("grad_nbytes", grad_nbytes),
        ("optimizer_state_nbytes", optimizer_state_nbytes),
        ("kept_param_nbytes", kept_param_nbytes),
    ):
        _count(value, name, 0)
    if kept_param_nbytes > offloaded_param_nbytes:
        raise ModelStateError(
            f"kept_param_nbytes ({kept_param_nbytes}) exceeds offloaded_param_nbytes ({offloaded_param_nbytes})"
        )
    grads = grad_nbytes if offload_gradients and not optimizer_in_backward else 0
    if optimizer_in_backward or lower_bound or overlap_step:
        param_read_nbytes = 2 * offloaded_param_nbytes
    else:
        param_read_nbytes = 3 * offloaded_param_nbytes - kept_param_nbytes
    return {
        "parameter": Traffic(read_nbytes=param_read_nbytes, write_nbytes=offloaded_param_nbytes),
        "gradient": Traffic(read_nbytes=grads, write_nbytes=grads),
        "optimizer_state": Traffic(read_nbytes=optimizer_state_nbytes, write_nbytes=optimizer_state_nbytes),
    }


def offload_states_record(
    *,
    param_tensors: int,
    param_nbytes: int,
    offloaded_param_nbytes: int,
    state_tensors: int,
    state_nbytes: int,
    offload_gradients: bool,
    optimizer_in_backward: bool,
    kept_param_nbytes: int = 0,
    offloaded_state_nbytes: int | None = None,
    overlap_step: bool = False,
) -> dict[str, Any]:
    """A profile's ``model_states`` (what ``states="offload"`` holds and moves besides the activations):
    per kind (``parameter``, ``gradient``, ``optimizer_state``) its ``tensors``, ``bytes`` and
    ``offloaded_bytes``; ``optimizer_in_backward``; and ``traffic``, per kind the ``read_bytes`` and
    ``written_bytes`` of one step (:func:`offload_step_traffic`). Gradients have the parameters' sizes;
    ``offloaded_state_nbytes`` (default: all of ``state_nbytes``) are the states on disk, the rest kept in
    memory by a whole-step plan (teraio.states.residency); ``overlap_step``: the offloaded parameters'
    update runs in the next forward (teraio.states.step_pipeline)."""
    grads_offloaded = offload_gradients and not optimizer_in_backward
    moved_states = state_nbytes if offloaded_state_nbytes is None else offloaded_state_nbytes
    traffic = offload_step_traffic(
        offloaded_param_nbytes=offloaded_param_nbytes,
        grad_nbytes=param_nbytes,
        optimizer_state_nbytes=moved_states,
        offload_gradients=offload_gradients,
        optimizer_in_backward=optimizer_in_backward,
        kept_param_nbytes=kept_param_nbytes,
        overlap_step=overlap_step,
    )
    return {
        "parameter": {
            "tensors": param_tensors,
            "bytes": param_nbytes,
            "offloaded_bytes": offloaded_param_nbytes,
        },
        "gradient": {
            "tensors": param_tensors,
            "bytes": param_nbytes,
            "offloaded_bytes": param_nbytes if grads_offloaded else 0,
        },
        "optimizer_state": {"tensors": state_tensors, "bytes": state_nbytes, "offloaded_bytes": moved_states},
        "optimizer_in_backward": optimizer_in_backward,
        "overlap_step": overlap_step,
        "traffic": {
            kind: {"read_bytes": t.read_nbytes, "written_bytes": t.write_nbytes}
            for kind, t in traffic.items()
        },
    }


def step_io_by_kind(
    model_states: dict[str, Any] | None,
    activation_written_bytes: int,
    activation_read_bytes: int,
    write_bw_bytes_per_s: float,
    read_bw_bytes_per_s: float,
) -> dict[str, Any]:
    """One step's bytes by kind: the activations' (a plan's or a simulation's) with the ``traffic`` of a
    profile's ``model_states`` (:func:`offload_states_record`; None: activations only). Returns
    ``written_bytes_by_kind``, ``read_bytes_by_kind``, ``moved_bytes_by_kind`` (written + read, keyed by
    :data:`MOVED_KINDS` as the backend's ``stats()`` is), ``io_lower_bound_s`` (:func:`io_lower_bound_s`
    at the given bandwidths) and ``model_states``."""
    written = dict.fromkeys(MOVED_KINDS, 0)
    read = dict.fromkeys(MOVED_KINDS, 0)
    written["activation"] = int(activation_written_bytes)
    read["activation"] = int(activation_read_bytes)
    for kind, t in ((model_states or {}).get("traffic") or {}).items():
        if kind in written:
            written[kind] = int(t["written_bytes"])
            read[kind] = int(t["read_bytes"])
    return {
        "model_states": model_states,
        "written_bytes_by_kind": written,
        "read_bytes_by_kind": read,
        "moved_bytes_by_kind": {k: written[k] + read[k] for k in MOVED_KINDS},
        "io_lower_bound_s": io_lower_bound_s(
            sum(written.values()), sum(read.values()), write_bw_bytes_per_s, read_bw_bytes_per_s
        ),
    }


def check_states_record(record: object) -> None:
    """Raise :class:`ModelStateError` naming what is wrong unless ``record`` has the shape
    :func:`offload_states_record` gives (a profile's ``model_states``, read from a file)."""
    if not isinstance(record, dict):
        raise ModelStateError(f"model_states must be a JSON object, not {type(record).__name__}")
    for kind in ("parameter", "gradient", "optimizer_state"):
        entry = record.get(kind)
        if not isinstance(entry, dict):
            raise ModelStateError(f"model_states lacks the object '{kind}'")
        for key in ("tensors", "bytes", "offloaded_bytes"):
            _count(entry.get(key), f"model_states '{kind}' '{key}'", 0)
    traffic = record.get("traffic")
    if not isinstance(traffic, dict):
        raise ModelStateError("model_states lacks the object 'traffic'")
    for kind, t in traffic.items():
        if kind not in MOVED_KINDS or not isinstance(t, dict):
            raise ModelStateError(f"model_states 'traffic' has an entry '{kind}' that is not a kind's object")
        for key in ("read_bytes", "written_bytes"):
            _count(t.get(key), f"model_states 'traffic' '{kind}' '{key}'", 0)
