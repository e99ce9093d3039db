"""Lifetime analysis on hand-made steps: memory timeline, peak, candidates, the smallest achievable peak."""

from __future__ import annotations

import numpy as np
import pytest

from teraio.planner.lifetimes import analyse
from teraio.planner.profile import Profile, ProfileError, make_profile
from tests.planner.planner_cases import MB, act, ops_rows, param, pyramid


def test_pyramid_memory_and_candidates():
    lt = analyse(pyramid())
    assert lt.num_ops == 8 and lt.num_fwd_ops == 4
    assert (lt.baseline_memory_bytes // MB).tolist() == [100, 200, 300, 400, 400, 300, 200, 100]
    assert lt.baseline_peak_bytes == 400 * MB and lt.baseline_peak_idx == 3
    c = lt.candidates.set_index("name")
    assert list(c.index) == ["t0", "t1", "t2"]  # t3 is used by backward right after forward: never idle
    assert c.loc["t0", ["inactive_start_idx", "inactive_end_idx"]].tolist() == [2, 6]
    assert c.loc["t1", ["inactive_start_idx", "inactive_end_idx"]].tolist() == [3, 5]
    assert c.loc["t2", ["inactive_start_idx", "inactive_end_idx"]].tolist() == [4, 4]
    # t0: last forward use op1 ends at 2 ms, first backward use op7 starts at 7 ms.
    assert c.loc["t0", "inactive_us"] == 5000.0
    assert c.loc["t2", "inactive_us"] == 1000.0
    # Everything away over its idle window: t0 at 2..6, t1 at 3..5, t2 at 4.
    assert (lt.min_memory_bytes // MB).tolist() == [100, 200, 200, 200, 100, 100, 100, 100]
    assert lt.min_feasible_peak_bytes == 200 * MB
    assert lt.op_start_us.tolist() == [0, 1000, 2000, 3000, 4000, 5000, 6000, 7000]


def test_params_inputs_other_bytes_and_non_offloadable():
    tensors = [
        param("w", 10),
        act("a", 100, 0, 0, 3, 4),
        act("pinned", 1000, 1, 1, 3, 3, offloadable=False),
        act("fwd_only", 7, 0, 1, -1, 1),
    ]
    p = make_profile(ops_rows([1, 1, 1, 1, 1], 2, other_bytes=[1, 2, 3, 4, 5]), tensors, {"fingerprint": "x"})
    lt = analyse(p)
    # The param w existed before the step: not counted. a 0..4; pinned 1..3; fwd_only 0..1; plus other_bytes.
    expected = [
        100 + 7 + 1,
        100 + 1000 + 7 + 2,
        100 + 1000 + 3,
        100 + 1000 + 4,
        100 + 5,
    ]
    assert lt.baseline_memory_bytes.tolist() == expected
    assert lt.candidates["name"].tolist() == ["a"]
    assert lt.min_memory_bytes.tolist() == [expected[0], expected[1] - 100, expected[2] - 100, *expected[3:]]


def test_graph_has_ops_and_tensors_and_decision_defaults():
    lt = analyse(pyramid())
    g = lt.graph
    assert g.has_edge(("op", 0), ("tensor", "t0")) and g.has_edge(("tensor", "t0"), ("op", 7))
    assert g.has_edge(("op", 3), ("op", 4))
    d = lt.decision("t1")
    assert (d.offload_after_idx, d.wait_before_idx, d.prefetch_before_idx, d.fetch_before_idx) == (1, 3, 6, 6)
    assert (d.offload_after_name, d.wait_before_name, d.fetch_before_name) == ("op1", "op3", "op6")
    assert d.module == "blocks.1" and d.nbytes == 100 * MB
    mem = lt.memory_with([d])
    assert (mem // MB).tolist() == [100, 200, 300, 300, 300, 200, 200, 100]


def test_use_before_producer_is_a_graph_cycle():
    # Non-offloadable tensors are not range-checked by Profile.validate; the graph catches the cycle.
    tensors = [act("bad", 10, 2, 1, 3, 3, offloadable=False)]
    p = Profile(
        ops=make_profile(ops_rows([1] * 4, 3), [], {"fingerprint": "x"}).ops,
        tensors=make_profile(ops_rows([1] * 4, 3), tensors, {"fingerprint": "x"}).tensors,
        meta={"fingerprint": "x", "schema_version": 1, "num_fwd_ops": 3},
    )
    with pytest.raises(ProfileError, match="used before it is produced"):
        analyse(p)


def test_empty_tensors_table():
    p = make_profile(ops_rows([5, 5], 1), [], {"fingerprint": "x"})
    lt = analyse(p)
    assert lt.baseline_peak_bytes == 0 and lt.candidates.empty and lt.min_feasible_peak_bytes == 0
    assert np.array_equal(lt.op_start_us, [0.0, 5.0])
