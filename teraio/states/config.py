"""The states' own options: which of an optimizer's parameters, gradients and states live on disk.

``teraio.backend(states=teraio.States(optimizer=opt))`` turns on :mod:`teraio.states`; ``states=None`` (the
default) leaves them in memory, as without teraio. One object holds every states option, so that an option
which only means something with offloaded states cannot be written without them, and the combinations
that cannot work together are refused here, in one line, when the object is built.

Importing this module does not import torch: the optimizer and model are checked only when a ``States``
is built (by then the caller has torch loaded anyway).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from teraio.errors import UserInputError

#: With a memory budget, which parameters and optimizer states stay in memory: "plan" (what the
#: whole-step budget leaves, chosen for the most I/O saved: Note: [The whole-step budget keeps some states
#: in memory] in teraio.states.residency), "none" (every one that can move, moves).
StatesKeepOption = Literal["plan", "none"]


def _nbytes(value: object, name: str) -> int:
    from teraio.sizes import SizeError, nbytes_of

    try:
        return nbytes_of(value, name)
    except SizeError as exc:
        raise UserInputError(str(exc)) from None


@dataclass(frozen=True)
class States:
    """Gradients and optimizer states of ``optimizer`` on disk between their uses, its step streamed
    chunk by chunk (:mod:`teraio.states`); optionally its gradients and parameters too."""

    optimizer: Any = field(repr=False)
    """The ``torch.optim.Optimizer`` whose states move (AdamW, Adam or SGD; plain parameters or FSDP2's
    sharded ones)."""

    model: Any = field(default=None, repr=False)
    """The ``torch.nn.Module`` the optimizer trains; needed by ``parameters=True`` (its ``state_dict`` and
    ``load_state_dict`` read and write the offloaded parameters)."""

    gradients: bool = False
    """Gradients on disk too between backward and the step; ``param.grad`` must then not be read before
    the step (Note: [Gradients stay readable unless asked] in teraio.states.grads)."""

    parameters: bool = False
    """The optimizer's parameters on disk too between the graph calls that compute with them
    (teraio.states.params), and the model's frozen ones (``requires_grad=False``, not in the optimizer: a
    LoRA base) read-only, written once (teraio.states.frozen); needs ``model``. Guarded while on disk (reads
    served, writes refused) when the model is compiled by ``backend.compile(model)``; otherwise code
    outside the compiled graphs must not read them directly."""

    optimizer_in_backward: bool = False
    """Each parameter updated inside backward once its gradient is complete, the gradient freed at once;
    ``opt.step()`` commits (teraio.states.optimizer_stream). Excludes ``gradients`` (none is left to move)."""

    chunk_bytes: int | str = "64MiB"
    """Gradient and state bytes per chunk of the streamed step (bytes, or a size such as "32MiB")."""

    min_param_bytes: int | str = "64KiB"
    """With ``parameters=True``, parameters smaller than this stay resident (norms, biases)."""

    overlap_step: bool = True
    """With ``parameters=True`` and ``gradients=True``, once every graph is planned: ``opt.step()`` updates
    what is in memory and returns, and each offloaded parameter's update runs in the next forward just
    before its first use, its reads and writes behind the forward's compute (Note: [The step of offloaded
    parameters runs in the next forward] in teraio.states.step_pipeline); False: the whole step runs in
    ``opt.step()``."""

    keep: StatesKeepOption = "plan"
    """With a memory budget, "plan": the parameters and states the whole-step budget leaves room for stay
    in memory (the most I/O saved first); "none": every one that can move, moves."""

    def __post_init__(self) -> None:
        for name in ("gradients", "parameters", "optimizer_in_backward", "overlap_step"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise UserInputError(f"States.{name} must be True or False, not {value!r}")
        if self.keep not in get_args(StatesKeepOption):
            choices = ", ".join(map(repr, get_args(StatesKeepOption)))
            raise UserInputError(f"States.keep must be one of {choices}, not {self.keep!r}")
        if _nbytes(self.chunk_bytes, "States.chunk_bytes") <= 0:
            raise UserInputError(f"States.chunk_bytes must be positive, not {self.chunk_bytes!r}")
        if _nbytes(self.min_param_bytes, "States.min_param_bytes") < 0:
            raise UserInputError(f"States.min_param_bytes must be >= 0, not {self.min_param_bytes!r}")
        if self.optimizer_in_backward and self.gradients:
            raise UserInputError(
                "States(optimizer_in_backward=True) frees each gradient once it is used, so there is none "
                "to offload: drop gradients=True"
            )
        if self.optimizer is None:
            raise UserInputError("States needs the optimizer: teraio.States(optimizer=opt)")
        if self.parameters and not _is_module(self.model):
            raise UserInputError(
                "States(parameters=True) needs the model: teraio.States(optimizer=opt, parameters=True, "
                "model=model)"
            )
        from teraio.states.offload import check_optimizer  # imports torch: a States holds an optimizer

        check_optimizer(self.optimizer, optimizer_in_backward=self.optimizer_in_backward)

    def recorded(self) -> dict[str, Any]:
        """The options as ``run_dir/config.json`` records them: the optimizer and model by class name."""
        return {
            "optimizer": type(self.optimizer).__name__,
            "model": None if self.model is None else type(self.model).__name__,
            "gradients": self.gradients,
            "parameters": self.parameters,
            "optimizer_in_backward": self.optimizer_in_backward,
            "chunk_bytes": self.chunk_bytes,
            "min_param_bytes": self.min_param_bytes,
            "keep": self.keep,
            "overlap_step": self.overlap_step,
        }


def _is_module(value: object) -> bool:
    import torch

    return isinstance(value, torch.nn.Module)
