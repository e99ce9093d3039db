"""The teraio:: custom ops: schema, fake kernels, autograd registration (opcheck), and round trips."""

from __future__ import annotations

import pytest
import torch

import teraio.graph.ops as ops
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


# offload, wait_write and prefetch return a token whose value is a fresh invocation number (Note:
# [Every invocation owns its bytes]), so two calls never return equal outputs: opcheck's comparison of
# eager against AOT-traced outputs cannot apply to them. Their schema, fake kernels and autograd
# registration are checked here; the compiled path is exercised end to end in test_offload_e2e.py.
TOKEN_OP_CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor")


def test_opcheck_offload_and_wait(engine_id: int) -> None:
    x = torch.randn(33, 17)
    torch.library.opcheck(
        torch.ops.teraio.offload.default,
        (x, [x], "k", engine_id, list(x.stride())),
        test_utils=TOKEN_OP_CHECKS,
    )
    # opcheck calls the op on copies of its inputs; a copy as keepalive is refused (tested below), so
    # check the op once the write is waited for (the keepalive check then has nothing in flight).
    h = _offload(engine_id, "k", x)
    _keep = torch.ops.teraio.wait_write(
        h, x, [], "k", engine_id
    )  # keeps the key while opcheck repeats the wait
    torch.library.opcheck(
        torch.ops.teraio.wait_write.default, (h, x, [x], "k", engine_id), test_utils=TOKEN_OP_CHECKS
    )


def test_opcheck_prefetch_and_fetch(engine_id: int) -> None:
    x = torch.randn(5, 7, dtype=torch.float64)
    h = _offload(engine_id, "k", x)
    tok = torch.ops.teraio.wait_write(h, x, [], "k", engine_id)
    torch.library.opcheck(
        torch.ops.teraio.prefetch.default, (tok, [], "k", engine_id), test_utils=TOKEN_OP_CHECKS
    )
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


def test_invocations_of_one_key_keep_their_own_bytes(engine_id: int) -> None:
    """Two offloads under one graph key before any fetch (two forwards, then their backwards)."""
    a, b = torch.randn(300, 7), torch.randn(300, 7)
    toks = []
    for x in (a, b):
        h = _offload(engine_id, "g0/x", x)
        toks.append(torch.ops.teraio.wait_write(h, x, [], "g0/x", engine_id))
    for x, tok in reversed(list(zip((a, b), toks))):
        pf = torch.ops.teraio.prefetch(tok, [], "g0/x", engine_id)
        flat = torch.ops.teraio.fetch(pf, [], "g0/x", engine_id, x.numel(), x.dtype, x.device)
        assert torch.equal(flat.view(300, 7), x)


def test_key_is_dropped_when_its_last_token_dies(engine_id: int) -> None:
    """The saved token owns the runtime's copy: freeing it (an abandoned forward) frees the bytes."""
    eng = ops.get_engine(engine_id)
    x = torch.randn(256, 16)
    h = _offload(engine_id, "g0/y", x)
    tok = torch.ops.teraio.wait_write(h, x, [], "g0/y", engine_id)
    assert len(eng.keys()) == 1
    pf = torch.ops.teraio.prefetch(tok, [], "g0/y", engine_id)
    del tok  # the backward's boxed convention frees the saved token at its last use: the prefetch
    assert len(eng.keys()) == 1, "dropped while the prefetch token still needs the bytes"
    torch.ops.teraio.fetch(pf, [], "g0/y", engine_id, x.numel(), x.dtype, x.device)
    del pf
    assert eng.keys() == []
    h = _offload(engine_id, "g0/y", x)
    tok = torch.ops.teraio.wait_write(h, x, [], "g0/y", engine_id)
    del h, tok  # never prefetched: the graph was freed without a backward
    assert eng.keys() == []


def test_every_handle_and_token_is_the_size_the_planner_counts(engine_id: int) -> None:
    # Note: [An offloaded tensor leaves a token] in planner.lifetimes: the profile's offload_token_bytes.
    x = torch.randn(64)
    handle = ops.offload(x, [], "size", engine_id, list(x.stride()))
    token = ops.wait_write(handle, x, [], "size", engine_id)
    again = ops.prefetch(token, [], "size", engine_id)
    for t in (handle, token, again):
        assert t.device.type == "cpu" and t.untyped_storage().nbytes() == ops.TOKEN_BYTES
    assert torch.equal(ops.fetch(again, [], "size", engine_id, 64, x.dtype, x.device), x)
    assert ops.offload_token_bytes("cpu") == ops.TOKEN_BYTES
    assert ops.offload_token_bytes("cuda:0") == ops.offload_token_bytes("estimate:h100-sxm-1ssd") == 0
