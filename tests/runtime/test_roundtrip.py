"""Round trips through every tier must return bit-identical tensors with the same dtype/shape/strides."""

from __future__ import annotations

import os

import pytest
import torch

from teraio.runtime import Engine, RuntimeConfig
from teraio.runtime.errors import ConfigError, EngineClosedError, UnknownKeyError, UnsupportedTensorError

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool]


def _random(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype == torch.int64:
        return torch.randint(-(2**62), 2**62, shape, generator=g, dtype=torch.int64)
    return (torch.randn(shape, generator=g) * 1e3).to(dtype)


def _roundtrip(eng: Engine, key: str, t: torch.Tensor, prefetch: bool) -> torch.Tensor:
    eng.offload(key, t).wait()
    eng.release(key)
    if prefetch:
        eng.prefetch(key).wait()
    return eng.fetch(key)


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtypes_roundtrip_bit_exact(make_engine, dtype):
    eng = make_engine()
    # 300_007 elements: not a multiple of 4096 bytes nor of the chunk size.
    t = _random((300_007,), dtype)
    out = _roundtrip(eng, "t", t, prefetch=True)
    _same(out, t)
    assert out.data_ptr() != t.data_ptr()  # really read back, not forwarded


@pytest.mark.parametrize(
    "make_view",
    [
        lambda b: b.t(),  # non-contiguous
        lambda b: b[3:17, 5:40:3],  # strided slice into a larger storage
        lambda b: b[100:101],  # tiny view of a big storage: only its span is stored
        lambda b: b.reshape(-1)[7:],  # storage offset not page aligned
        lambda b: b.expand(2, *b.shape)[1],  # stride 0 dims
        lambda b: b[:, :0],  # zero-size
    ],
    ids=["transpose", "strided-slice", "small-view", "offset", "expand", "zero"],
)
def test_views_keep_strides(make_engine, make_view):
    eng = make_engine()
    base = _random((257, 129), torch.float32, seed=1)
    v = make_view(base)
    out = _roundtrip(eng, "v", v, prefetch=False)
    _same(out, v)
    assert out.storage_offset() >= 0


def test_zero_size_and_scalar(make_engine):
    eng = make_engine()
    for i, t in enumerate([torch.empty(0), torch.empty(3, 0, 2, dtype=torch.int64), torch.tensor(3.5)]):
        _same(_roundtrip(eng, f"z{i}", t, prefetch=True), t)


def test_page_boundary_sizes(make_engine):
    eng = make_engine()
    for n in [1, 4095, 4096, 4097, 65535, 65536, 65537, 3 * 65536 + 1]:
        t = _random((n,), torch.bool, seed=n)
        _same(_roundtrip(eng, f"n{n}", t, prefetch=n % 2 == 0), t)


def test_dedup_views_written_once_and_fetched_as_views_of_one_buffer(make_engine):
    eng = make_engine()
    qkv = _random((64, 3 * 256), torch.float32, seed=2)
    q, k, v = qkv.chunk(3, dim=1)
    for name, t in (("q", q), ("k", k), ("v", v)):
        eng.offload(name, t)
    for name in "qkv":
        eng.release(name)
    st = eng.stats()
    assert st.dedup_hits == 2
    written = st.transfers[f"{eng.default_tier}.write"].nbytes
    assert written == qkv.numel() * 4  # the storage once, not three times
    outs = [eng.fetch(n) for n in "qkv"]
    for out, ref in zip(outs, (q, k, v)):
        _same(out, ref)
    assert len({o.untyped_storage().data_ptr() for o in outs}) == 1  # aliasing preserved
    assert eng.stats().transfers[f"{eng.default_tier}.read"].requests == 1


def test_freed_address_reuse_is_not_deduplicated(make_engine):
    """Identity is by storage: a new tensor at a recycled address must be written again."""
    eng = make_engine()
    a = torch.full((1 << 16,), 1.0)
    eng.offload("a", a)
    eng.release("a")
    addr = a.data_ptr()
    del a
    b = torch.full((1 << 16,), 2.0)  # the allocator very likely hands back the same address
    eng.offload("b", b)
    eng.release("b")
    assert eng.stats().dedup_hits == 0, f"reused address {addr == b.data_ptr()}"
    assert torch.equal(eng.fetch("a"), torch.full((1 << 16,), 1.0))
    assert torch.equal(eng.fetch("b"), b)


def _fresh_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A float view over the whole storage with its own version counter (what the graph ops offload)."""
    return torch.empty(0).set_(storage, 0, (storage.nbytes() // 4,), (1,))


def test_storage_reused_after_release_is_written_again(make_engine):
    """Note: [No dedup after release]: a compiler reuses a released buffer for new data, writing through
    raw pointers (no version bump); the new key must get the new bytes, not the old entry's."""
    eng = make_engine()
    buf = torch.full((1 << 16,), 1.0)
    storage = buf.untyped_storage()
    eng.offload("a", _fresh_view(storage))
    eng.release("a")
    before = buf._version
    buf.numpy()[:] = 2.0  # a write the version counter does not see, like an Inductor C++ kernel's
    assert buf._version == before
    eng.offload("b", _fresh_view(storage))
    eng.release("b")
    assert eng.stats().dedup_hits == 0
    assert torch.equal(eng.fetch("a"), torch.full((1 << 16,), 1.0))
    assert torch.equal(eng.fetch("b"), torch.full((1 << 16,), 2.0))


def test_in_place_modification_defeats_dedup(make_engine):
    eng = make_engine()
    base = torch.zeros(10_000)
    eng.offload("before", base[:6000])
    eng.release("before")  # contract: no in-place change before release (the write reads it)
    base.add_(1)  # bumps the shared version counter
    eng.offload("after", base[:7000])
    eng.release("after")
    del base
    assert eng.stats().dedup_hits == 0
    assert torch.equal(eng.fetch("before"), torch.zeros(6000))
    assert torch.equal(eng.fetch("after"), torch.ones(7000))


def test_forwarding_serves_unreleased_data_from_memory(make_engine):
    eng = make_engine()
    t = _random((100_000,), torch.float32)
    eng.offload("t", t)
    h = eng.prefetch("t")
    assert h.done()
    out = eng.fetch("t")  # write may still run: served from memory
    assert out.data_ptr() == t.data_ptr()
    st = eng.stats()
    assert st.forwarded_fetches == 1 and st.transfers[f"{eng.default_tier}.read"].requests == 0


def test_replace_key_and_drop(make_engine):
    eng = make_engine()
    eng.offload("k", torch.ones(5000)).wait()
    eng.offload("k", torch.arange(300)).wait()  # replaces
    eng.release("k")
    assert torch.equal(eng.fetch("k"), torch.arange(300))
    eng.drop("k")
    with pytest.raises(UnknownKeyError, match="'k'"):
        eng.fetch("k")
    with pytest.raises(UnknownKeyError):
        eng.drop("k")
    eng.drop("k", missing_ok=True)
    assert eng.stats().held_nbytes[eng.default_tier] == 0


def test_fetched_buffer_is_freed_with_its_tensor(make_engine):
    eng = make_engine()
    t = _random((50_000,), torch.float32)
    eng.offload("t", t)
    eng.release("t")
    a = eng.fetch("t")
    b = eng.fetch("t")  # forwarded from the live buffer
    assert a.data_ptr() == b.data_ptr()
    del a, b
    c = eng.fetch("t")  # buffer gone: a new read
    assert torch.equal(c, t)
    assert eng.stats().transfers[f"{eng.default_tier}.read"].requests == 2


def test_bad_requests_raise_typed_errors(make_engine):
    eng = make_engine()
    with pytest.raises(UnsupportedTensorError, match="dense strided"):
        eng.offload("s", torch.eye(3).to_sparse())
    with pytest.raises(UnsupportedTensorError, match="torch.Tensor"):
        eng.offload("s", [1, 2])
    with pytest.raises(ConfigError, match="key"):
        eng.offload("", torch.ones(1))
    with pytest.raises(ConfigError, match="tier"):
        eng.offload("x", torch.ones(1), tier="tape")
    with pytest.raises(UnknownKeyError):
        eng.prefetch("never")
    eng.close()
    with pytest.raises(EngineClosedError):
        eng.offload("x", torch.ones(1))


def test_config_errors_name_the_option(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="backend"):
        RuntimeConfig(backend="nfs", dirs=[tmp_path]).resolved()
    monkeypatch.setenv("TERAIO_IO_BACKEND", "bogus")
    with pytest.raises(ConfigError, match="TERAIO_IO_BACKEND"):
        RuntimeConfig(dirs=[tmp_path]).resolved()
    monkeypatch.setenv("TERAIO_IO_BACKEND", "host")
    assert RuntimeConfig().resolved().backend == "host"
    monkeypatch.delenv("TERAIO_IO_BACKEND")
    monkeypatch.delenv("TERAIO_OFFLOAD_DIRS", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    # No directory given: the stable per-user default (safety tests cover its cleanup).
    assert RuntimeConfig(backend="posix").resolved().dirs == (tmp_path / "cache" / "teraio" / "offload",)
    with pytest.raises(ConfigError, match="dirs"):
        RuntimeConfig(backend="posix", dirs=[""]).resolved()
    with pytest.raises(ConfigError, match="chunk_bytes"):
        RuntimeConfig(dirs=[tmp_path], chunk_bytes=1000).resolved()
    with pytest.raises(ConfigError, match="reserve_bytes"):
        RuntimeConfig(dirs=[tmp_path], reserve_bytes="12 parsecs").resolved()
    cfg = RuntimeConfig(dirs=[tmp_path], reserve_bytes="1.5GiB", chunk_bytes="1MiB").resolved()
    assert cfg.reserve_nbytes == 3 << 29 and cfg.chunk_nbytes == 1 << 20


def test_auto_backend_is_posix_without_cuda(tmp_path, caplog):
    caplog.set_level("INFO", logger="teraio.runtime.engine")
    with Engine(RuntimeConfig(dirs=[tmp_path], backend="auto")) as eng:
        assert eng.backend == "posix"
        assert eng.stats().io_path == "posix-odirect"
    assert "auto chose posix" in caplog.text


def test_stats_report_throughput_and_endurance(tmp_path):
    with Engine(RuntimeConfig(dirs=[tmp_path / "a", tmp_path / "b"], chunk_bytes=1 << 20)) as eng:
        t = torch.randn(4 << 20)  # 16 MiB: 8 chunks per directory
        eng.offload("t", t)
        eng.release("t")
        assert torch.equal(eng.fetch("t"), t)
        st = eng.stats()
    assert st.transfers["ssd.write"].nbytes == t.numel() * 4
    assert st.transfers["ssd.write"].gb_per_s > 0 and st.transfers["ssd.read"].gb_per_s > 0
    assert [d.bytes_written for d in st.dirs] == [8 << 20, 8 << 20]  # striped evenly
    assert all(d.tb_written_per_day > 0 for d in st.dirs)
    assert st.peak_held_nbytes["ssd"] == 16 << 20
    assert st.to_dict()["transfers"]["ssd.write"]["gb_per_s"] > 0


def test_host_tier_capacity(tmp_path):
    from teraio.runtime.errors import TierCapacityError

    with Engine(RuntimeConfig(backend="host", host_capacity_bytes="1MiB")) as eng:
        eng.offload("a", torch.zeros(200_000))  # 800 kB
        with pytest.raises(TierCapacityError, match="host_capacity_bytes"):
            eng.offload("b", torch.zeros(100_000))
        eng.drop("a")
        eng.offload("b", torch.zeros(100_000)).wait()
    with Engine(RuntimeConfig(dirs=[tmp_path], host_capacity_bytes=4096)) as eng:
        eng.offload("small", torch.ones(10), tier="host").wait()
        eng.offload("big", torch.ones(10_000)).wait()  # default tier ssd
        assert eng.stats().held_nbytes == {"ssd": 40_000, "host": 40}
    assert os.listdir(tmp_path) == []


def test_two_regions_of_one_storage_drop_independently(make_engine):
    """Small disjoint views of one storage are stored as separate regions; dropping one keeps the other."""
    eng = make_engine()
    base = _random((64, 1024), torch.float32, seed=5)
    a, b = base[0:4], base[40:44]
    eng.offload("a", a)
    eng.offload("b", b)
    eng.release("a")
    eng.release("b")
    assert eng.stats().dedup_hits == 0
    eng.drop("a")  # regression: entries were compared by value (tensor fields) here
    _same(eng.fetch("b"), b)


def test_handle_is_a_future(make_engine):
    from concurrent.futures import Future, wait

    eng = make_engine()
    h = eng.offload("t", torch.randn(100_000))
    assert isinstance(h, Future)
    assert not h.cancel()  # submitted I/O cannot be cancelled
    done, _ = wait([h], timeout=60)
    assert done == {h} and h.result() is None and h.exception() is None and not h.failed()
