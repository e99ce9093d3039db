"""A step's bytes by kind for ``teraio plan`` and ``teraio simulate``: the plan's activations with the
parameters, gradients and optimizer states that a run with ``states=teraio.States(...)`` records in its
profile (its ``model_states``, ``teraio.states.StateOffload.model_states``), and the step's I/O lower
bound on the hardware model's disk."""

from __future__ import annotations

from typing import Any

from teraio.planner.hardware import HardwareModel
from teraio.planner.model_states import step_io_by_kind
from teraio.sizes import format_size


def step_bytes_by_kind(
    model_states: dict[str, Any] | None,
    activation_written_bytes: int,
    activation_read_bytes: int,
    hardware: HardwareModel,
) -> dict[str, Any]:
    """The JSON keys both commands add (``teraio.planner.model_states.step_io_by_kind``), the I/O lower
    bound at the bandwidth of the hardware model's ``ssd`` tier."""
    ssd = hardware.tier("ssd")
    return step_io_by_kind(
        model_states,
        activation_written_bytes,
        activation_read_bytes,
        ssd.total_write_bw_bytes_per_s,
        ssd.total_read_bw_bytes_per_s,
    )


def by_kind_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """Table rows for :func:`step_bytes_by_kind`'s result: the state tensors (when the profile has them),
    the bytes moved per step by kind, and the I/O lower bound."""
    rows = []
    ms = summary["model_states"]
    if ms:
        rows.append(
            (
                "state tensors",
                ", ".join(
                    f"{kind} {ms[kind]['tensors']} ({format_size(ms[kind]['bytes'])}, "
                    f"{format_size(ms[kind]['offloaded_bytes'])} offloaded)"
                    for kind in ("parameter", "gradient", "optimizer_state")
                    if kind in ms
                ),
            )
        )
    moved = summary["moved_bytes_by_kind"]
    rows.append(
        (
            "moved per step",
            ", ".join(f"{kind} {format_size(n)}" for kind, n in moved.items() if n or kind == "activation"),
        )
    )
    rows.append(
        (
            "I/O lower bound",
            f"{summary['io_lower_bound_s']:.4f} s (every kind's bytes at the disk's bandwidth)",
        )
    )
    return rows
