"""Model-state accounting (planner/model_states.py): bytes per parameter, sharding, offload, the gathered
layer, streamed traffic, and DeepSpeed's documented t5-3b example reproduced from it."""

from __future__ import annotations

import pytest

from teraio.planner.model_states import (
    ModelStateError,
    bytes_per_param,
    model_states,
    offload_step_traffic,
    streamed_traffic,
)

# t5-3b counted on a fake-tensor model from its published config (tests/teraio/test_estimate.py checks
# the count): DeepSpeed's "2851M total params, 32M largest layer params".
T5_3B_PARAMS = 2_851_598_336
T5_3B_LARGEST = 32_899_072


@pytest.mark.parametrize(
    ("precision", "optimizer", "expected"),
    [
        ("fp32", "adamw", (4, 4, 8)),  # the 4 + 4 + 8
        ("fp32", "sgd-momentum", (4, 4, 4)),
        ("fp32", "sgd", (4, 4, 0)),
        ("bf16-mixed", "adamw", (2, 4, 12)),  # fp32 master + two moments; fp32 gradients
        ("fp16-mixed", "adam", (2, 4, 12)),
        ("bf16-mixed", "sgd", (2, 4, 4)),  # the master copy alone
    ],
)
def test_bytes_per_param_table(precision, optimizer, expected):
    b = bytes_per_param(precision, optimizer)
    assert (b.param_nbytes, b.grad_nbytes, b.optimizer_state_nbytes) == expected
    assert b.total_nbytes == sum(expected)


def test_gradients_accumulated_in_the_working_dtype():
    assert bytes_per_param("bf16-mixed", "adamw", grad_accum="param").grad_nbytes == 2
    assert bytes_per_param("fp32", "adamw", grad_accum="param").grad_nbytes == 4


def test_replicated_states_are_whole_on_every_device():
    s = model_states(1000, largest_layer_params=100, gpus=4)
    assert (s.param_nbytes, s.grad_nbytes, s.optimizer_state_nbytes) == (4000, 4000, 8000)
    assert s.gathered_nbytes == 0  # parameters are all there: nothing to gather
    assert s.device_nbytes == 16000 and s.offloaded_nbytes == 0


@pytest.mark.parametrize(
    ("stage", "expected"),
    [(1, (4000, 4000, 2000, 0)), (2, (4000, 1000, 2000, 0)), (3, (1000, 1000, 2000, 800))],
)
def test_zero_stages_shard_kind_by_kind(stage, expected):
    s = model_states(1000, largest_layer_params=100, gpus=4, zero_stage=stage)
    assert (s.param_nbytes, s.grad_nbytes, s.optimizer_state_nbytes, s.gathered_nbytes) == expected


def test_offloaded_kinds_leave_the_device_and_count_elsewhere():
    s = model_states(
        1000, largest_layer_params=100, gpus=2, zero_stage=3, offload=("grad", "optimizer_state")
    )
    assert (s.param_nbytes, s.grad_nbytes, s.optimizer_state_nbytes) == (2000, 0, 0)
    assert s.offloaded_nbytes_by_kind == {"grad": 2000, "optimizer_state": 4000}
    assert s.share_nbytes("grad") == 2000
    # Offloaded parameters are gathered a layer at a time, even without sharding.
    assert model_states(1000, largest_layer_params=100, offload=("param",)).gathered_nbytes == 800


@pytest.mark.parametrize(
    ("case", "offload", "printed_gib", "per_param"),
    [
        ("params and optimizer offloaded", ("param", "grad", "optimizer_state"), 0.12, 0),
        ("optimizer offloaded", ("grad", "optimizer_state"), 0.79, 2),
        ("nothing offloaded", (), 6.10, 18),
    ],
)
def test_deepspeed_t5_3b_example_per_gpu(case, offload, printed_gib, per_param):
    """DeepSpeed's documented ZeRO-3 example, t5-3b on 8 GPUs (docs/code-docs/source/memory.rst):
    0.12 / 0.79 / 6.10 GB per GPU, its "GB" being GiB printed with two decimals."""
    ours = model_states(
        T5_3B_PARAMS,
        largest_layer_params=T5_3B_LARGEST,
        precision="fp16-mixed",
        gpus=8,
        zero_stage=3,
        offload=offload,
    ).device_nbytes
    # DeepSpeed's formula, estimate_zero3_model_states_mem_needs: 4 bytes per parameter of the largest
    # layer, plus 2 (optimizer offloaded) or 18 (nothing offloaded) bytes per parameter over the GPUs.
    formula = 4 * T5_3B_LARGEST + int(per_param * T5_3B_PARAMS / 8)
    assert abs(ours / formula - 1) <= 0.02, case
    assert f"{ours / 2**30:.2f}" == f"{printed_gib:.2f}", case  # what DeepSpeed prints
    assert abs(ours / 2**30 - printed_gib) <= 0.005  # within the printed figure's rounding


def test_streamed_traffic_per_step():
    fp32 = model_states(1000, gpus=2, zero_stage=3, offload=("param", "grad", "optimizer_state"))
    t = streamed_traffic(fp32)
    # fp32: parameters read for forward, backward and the optimizer step, written once.
    assert (t["param"].read_nbytes, t["param"].write_nbytes) == (3 * 2000, 2000)
    assert (t["grad"].read_nbytes, t["grad"].write_nbytes) == (2000, 2000)
    assert (t["optimizer_state"].read_nbytes, t["optimizer_state"].write_nbytes) == (4000, 4000)
    mixed = model_states(1000, precision="bf16-mixed", offload=("param",))
    # Mixed precision reads the master copy in the step, not the working copy.
    assert streamed_traffic(mixed)["param"].read_nbytes == 2 * 2000
    assert streamed_traffic(model_states(1000)) == {}  # nothing offloaded, nothing streams
    assert set(streamed_traffic(model_states(1000), ("grad",))) == {"grad"}


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"precision": "fp8"}, "precision"),
        ({"optimizer": "lion"}, "optimizer"),
        ({"gpus": 0}, "gpus"),
        ({"zero_stage": 4}, "zero_stage"),
        ({"offload": ("weights",)}, "offload kind"),
        ({"largest_layer_params": -1}, "largest_layer_params"),
    ],
)
def test_bad_arguments_are_named(kwargs, names):
    with pytest.raises(ModelStateError, match=names):
        model_states(1000, **kwargs)


def _traffic(**overrides):
    args = {
        "offloaded_param_nbytes": 1000,
        "grad_nbytes": 1200,
        "optimizer_state_nbytes": 2400,
        "offload_gradients": True,
        "optimizer_in_backward": False,
    }
    return offload_step_traffic(**{**args, **overrides})


def test_offload_step_traffic_by_kind():
    """What ``states="offload"`` moves per step (``teraio plan``/``simulate`` show it by kind)."""
    t = _traffic(kept_param_nbytes=100)
    # Parameters: forward, backward and the step read them; the next forward finds the kept ones.
    assert (t["parameter"].read_nbytes, t["parameter"].write_nbytes) == (3 * 1000 - 100, 1000)
    assert (t["gradient"].read_nbytes, t["gradient"].write_nbytes) == (1200, 1200)
    assert (t["optimizer_state"].read_nbytes, t["optimizer_state"].write_nbytes) == (2400, 2400)
    # Updated inside backward: no gradient on disk, no third read of the parameters.
    ib = _traffic(offload_gradients=False, optimizer_in_backward=True)
    assert (ib["parameter"].read_nbytes, ib["gradient"].total_nbytes) == (2000, 0)
    bound = _traffic(lower_bound=True)
    assert bound["parameter"].read_nbytes == 2000 and bound["gradient"].total_nbytes == 2400
    assert _traffic(offload_gradients=False)["gradient"].total_nbytes == 0
    with pytest.raises(ModelStateError, match="kept_param_nbytes"):
        _traffic(offloaded_param_nbytes=10, kept_param_nbytes=11)
    with pytest.raises(ModelStateError, match="grad_nbytes"):
        _traffic(grad_nbytes=-1)
