"""Note: [MKL VML's first concurrent call] in teraio.platform.mkl_vml: a backend resolves MKL VML's dispatch on one
thread before training can call a VML op on two."""

from __future__ import annotations

import math
import threading

import pytest
import torch

import teraio
from teraio.platform import mkl_vml


@pytest.fixture
def unwarmed(monkeypatch):
    monkeypatch.setattr(mkl_vml, "_warmed", None)


def test_constructing_a_backend_runs_each_vml_op_on_one_element_of_each_dtype_on_its_thread(
    unwarmed, monkeypatch
):
    calls: list[tuple[str, torch.dtype, int, int]] = []
    for name in ("sqrt", "exp", "tanh"):
        real = getattr(torch, name)

        def spy(x, *args, _real=real, _name=name, **kwargs):
            calls.append((_name, x.dtype, x.numel(), threading.get_ident()))
            return _real(x, *args, **kwargs)

        monkeypatch.setattr(torch, name, spy)
    assert not mkl_vml.mkl_vml_warmed()
    be = teraio.backend(enabled=False)
    try:
        assert mkl_vml.mkl_vml_warmed()
        if not torch.backends.mkl.is_available():
            assert calls == []
            return
        me = threading.get_ident()
        for name in ("sqrt", "exp", "tanh"):
            for dtype in (torch.float32, torch.float64):
                # One element never splits across intra-op threads: the dispatch resolves on this one.
                assert (name, dtype, 1, me) in calls
        # A second backend does not run them again.
        before = len(calls)
        teraio.backend(enabled=False).close()
        assert len(calls) == before
    finally:
        be.close()


def test_every_warmed_op_gets_an_input_inside_its_domain(unwarmed):
    pairs = teraio.warm_up_mkl_vml()
    if not torch.backends.mkl.is_available():
        assert pairs == ()
        return
    assert {op for op, _ in pairs} == set(mkl_vml.VML_OPS)
    assert {dt for _, dt in pairs} == {"float32", "float64"}
    for op in mkl_vml.VML_OPS:
        value = getattr(torch, op)(torch.tensor([mkl_vml._WARM_INPUT], dtype=torch.float64)).item()
        assert math.isfinite(value), f"{op}({mkl_vml._WARM_INPUT}) = {value}"
    assert teraio.warm_up_mkl_vml() is pairs  # idempotent
