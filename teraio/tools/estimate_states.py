"""What the model states take of the estimated device, and so what budget is left for the activations.

A training step's memory is not only its activations: the parameters, their gradients and the optimizer
states hold device memory too (``teraio.planner.model_states`` counts this device's share under data
parallelism and ZeRO). An estimate decides where they live, resident on the device or streamed through it
from the SSDs (``--states``), says why in one sentence for the report, and gives the activation plans the
device memory the states leave (``--budget device``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from teraio.errors import UserInputError
from teraio.planner.budget import format_size
from teraio.planner.model_states import (
    STATE_KINDS,
    ModelStateError,
    ModelStates,
    Optimizer,
    Precision,
    model_states,
)

StatesMode = Literal["auto", "resident", "streamed"]
STATES_MODES: tuple[str, ...] = get_args(StatesMode)
#: Model-state precision for each compute dtype (teraio.planner.model_states).
PRECISION_OF_DTYPE: dict[str, Precision] = {
    "float32": "fp32",
    "bfloat16": "bf16-mixed",
    "float16": "fp16-mixed",
}


@dataclass(frozen=True)
class StatesEstimate:
    """This device's share of the model states, where they live, and why (for the report)."""

    states: ModelStates
    #: "resident" or "streamed" (an "auto" request resolved).
    mode: str
    note: str

    @property
    def held_nbytes(self) -> int:
        """Bytes of model states the device holds throughout the step: parameters, optimizer states and
        the gathered layer (gradients are in the profile's memory, or leave as they are produced)."""
        st = self.states
        return st.param_nbytes + st.optimizer_state_nbytes + st.gathered_nbytes


def estimate_states(
    num_params: int,
    *,
    largest_layer_params: int,
    precision: Precision,
    optimizer: Optimizer,
    gpus: int,
    zero_stage: int,
    states: StatesMode,
    device_nbytes: int | None,
) -> StatesEstimate:
    """Where the model states live on a device of ``device_nbytes`` (None: no figure) and what they take.

    ``states="auto"``: resident when this device's share of all model states fits in its memory, else
    streamed (gradients then leave the device as they are produced).

    Raises:
        UserInputError: the planner refuses the combination (for example a ZeRO stage with one GPU).
    """

    def states_with(offload: tuple[str, ...]) -> ModelStates:
        """This device's share of the model states, ``offload`` kinds kept off the device."""
        try:
            return model_states(
                num_params,
                largest_layer_params=largest_layer_params,
                precision=precision,
                optimizer=optimizer,
                gpus=gpus,
                zero_stage=zero_stage,
                offload=offload,
            )
        except ModelStateError as e:
            raise UserInputError(str(e)) from None

    all_resident = states_with(())
    mode = states
    if mode == "auto":
        mode = (
            "resident" if device_nbytes is None or all_resident.device_nbytes < device_nbytes else "streamed"
        )
    if mode == "resident":
        return StatesEstimate(
            all_resident,
            "resident",
            "parameters and optimizer states stay on the device; gradients accumulate there as backward "
            "produces them (counted in the profile's memory, in full: a ZeRO reduce-scatter is not modelled)",
        )
    note = (
        "model states live on the SSDs and stream through the device (whole-state offload): the device "
        "holds the largest layer's gathered parameters and gradients, and each gradient leaves as "
        "backward produces it; their transfers are accounted, not scheduled by the plans"
    )
    if states == "auto":
        note = (
            f"this device's share of the model states ({format_size(all_resident.device_nbytes)}) does not "
            f"fit its {format_size(device_nbytes or 0)}: " + note
        )
    return StatesEstimate(states_with(STATE_KINDS), "streamed", note)


def activation_budget(
    budget: str, device_nbytes: int | None, held_nbytes: int, preset_name: str
) -> tuple[int | str, str]:
    """The activation budget to plan with, and how it was found (for the report).

    ``budget="device"``: the device's memory less the model states held there, or "auto" (the smallest
    stall-free peak) when the preset has no device memory figure; anything else is planned as given.
    """
    if budget != "device":
        return budget, "as given"
    if device_nbytes is None:
        return "auto", f"{preset_name} has no device memory figure: the smallest stall-free peak"
    return (
        max(1, device_nbytes - held_nbytes),
        f"the device's {format_size(device_nbytes)} less {format_size(held_nbytes)} of model states held there",
    )
