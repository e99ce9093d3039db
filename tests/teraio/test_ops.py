"""The teraio:: custom ops: schema, fake kernels, autograd registration (opcheck), and round trips."""

from __future__ import annotations

import pytest
import torch

import teraio.ops as ops
from teraio.runtime import Engine, RuntimeConfig


@pytest.fixture(params=["host", "posix"])
def engine_id(request, tmp_path):
    eng = Engine(RuntimeConfig(dirs=[tmp_path], backend=request.param))
    eid = ops.register_engine(eng)
    yield eid
    ops.unregister_engine(eid)
    eng.close()


def _offload(eid: int, key: str, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.teraio.offload(x, [], key, eid, list(x.stride()))


def test_opcheck_offload_and_wait(engine_id: int) -> None:
    x = torch.randn(33, 17)
    torch.library.opcheck(torch.ops.teraio.offload.default, (x, [x], "k", engine_id, list(x.stride())))
    h = _offload(engine_id, "k", x)
    # opcheck calls the op on copies of its inputs; a copy as keepalive is refused (tested below), so
    # check the op once the write is waited for (the keepalive check then has nothing in flight).
    torch.ops.teraio.wait_write(h, x, [], "k", engine_id)
    torch.library.opcheck(torch.ops.teraio.wait_write.default, (h, x, [x], "k", engine_id))


def test_opcheck_prefetch_and_fetch(engine_id: int) -> None:
    x = torch.randn(5, 7, dtype=torch.float64)
    h = _offload(engine_id, "k", x)
    tok = torch.ops.teraio.wait_write(h, x, [], "k", engine_id)
    torch.library.opcheck(torch.ops.teraio.prefetch.default, (tok, [], "k", engine_id))
    args = (tok, [x], "k", engine_id, x.numel(), x.dtype, x.device)
    torch.library.opcheck(torch.ops.teraio.fetch.default, args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool])
def test_round_trip_is_bit_exact(engine_id: int, dtype: torch.dtype) -> None:
    x = (torch.randn(1000, 3) * 100).to(dtype)
    h = _offload(engine_id, "rt", x)
    tok = torch.ops.teraio.wait_write(h, x, [], "rt", engine_id)
    tok = torch.ops.teraio.prefetch(tok, [], "rt", engine_id)
    flat = torch.ops.teraio.fetch(tok, [], "rt", engine_id, x.numel(), x.dtype, x.device)
    assert torch.equal(flat.view(1000, 3), x)
    assert flat.storage_offset() == 0


def test_offload_in_another_layout_writes_the_promised_layout(engine_id: int) -> None:
    """Note: [Exact layout of offloaded tensors]: a buffer in another layout is written as promised."""
    logical = torch.arange(24.0).reshape(2, 3, 4)
    other_layout = logical.permute(2, 0, 1).contiguous().permute(1, 2, 0)  # same values, other strides
    assert other_layout.stride() != logical.stride()
    h = torch.ops.teraio.offload(other_layout, [], "lay", engine_id, list(logical.stride()))
    tok = torch.ops.teraio.wait_write(h, other_layout, [], "lay", engine_id)
    flat = torch.ops.teraio.fetch(tok, [], "lay", engine_id, 24, torch.float32, torch.device("cpu"))
    assert torch.equal(flat.as_strided((2, 3, 4), logical.stride(), 0), logical)


def test_keepalive_that_is_not_the_written_buffer_is_refused(engine_id: int) -> None:
    """Note: [Keepalive until the write completes]: a copy as keepalive protects nothing; say so."""
    x = torch.randn(64, 64)
    h = _offload(engine_id, "ka", x)
    with pytest.raises(RuntimeError, match="keepalive is not the buffer being written"):
        torch.ops.teraio.wait_write(h, x.clone(), [], "ka", engine_id)


def test_unknown_engine_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="not registered"):
        _offload(987654, "k", torch.ones(3))


def test_keepalive_check_is_per_engine(tmp_path) -> None:
    """Two backends use the same keys ("g0/..."): one engine's write must not stand in for another's."""
    engines = [Engine(RuntimeConfig(dirs=[tmp_path], backend="host")) for _ in range(2)]
    ids = [ops.register_engine(e) for e in engines]
    try:
        a, b = torch.randn(32, 32), torch.randn(32, 32)
        ha, hb = _offload(ids[0], "g0/x", a), _offload(ids[1], "g0/x", b)
        torch.ops.teraio.wait_write(ha, a, [], "g0/x", ids[0])  # passes: a is engine 0's buffer
        with pytest.raises(RuntimeError, match="keepalive is not the buffer being written"):
            torch.ops.teraio.wait_write(hb, a, [], "g0/x", ids[1])
    finally:
        for eid, e in zip(ids, engines):
            ops.unregister_engine(eid)
            e.close()
