"""``fetch(key, exclusive=True)``: the caller may change the buffer; the key keeps its bytes on disk."""

from __future__ import annotations

import torch

from teraio.runtime import Engine


def test_exclusive_fetch_is_not_served_again(tmp_path):
    with Engine(dirs=[str(tmp_path)], backend="posix") as engine:
        src = torch.arange(4096, dtype=torch.float32)
        engine.offload("k", src)
        engine.release("k")
        got = engine.fetch("k", exclusive=True)
        got.add_(1)  # the caller's own buffer
        again = engine.fetch("k")
        assert torch.equal(again, torch.arange(4096, dtype=torch.float32))
        assert again.untyped_storage().data_ptr() != got.untyped_storage().data_ptr()


def test_shared_fetch_is_served_again(tmp_path):
    with Engine(dirs=[str(tmp_path)], backend="posix") as engine:
        engine.offload("k", torch.arange(4096, dtype=torch.float32))
        engine.release("k")
        got = engine.fetch("k")
        again = engine.fetch("k")  # from memory while the first fetch's tensor lives
        assert again.untyped_storage().data_ptr() == got.untyped_storage().data_ptr()


def test_exclusive_fetch_from_memory_is_a_copy(tmp_path):
    with Engine(dirs=[str(tmp_path)], backend="posix") as engine:
        src = torch.arange(4096, dtype=torch.float32)
        engine.offload("k", src)  # not released: the engine still forwards ``src``
        got = engine.fetch("k", exclusive=True)
        got.add_(1)
        assert torch.equal(src, torch.arange(4096, dtype=torch.float32))
