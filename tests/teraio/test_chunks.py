"""How the streamed optimizer step cuts parameters into chunks (teraio.states.optimizer_stream.cut_chunks):
Note: [Small parameters ride with their neighbours]."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from teraio.states.step_chunks import cut_chunks

CHUNK = 64 << 20


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=1, max_value=5 * CHUNK), min_size=1, max_size=40),
    chunk_bytes=st.sampled_from([4096, 1 << 20, CHUNK]),
)
def test_chunks_partition_the_order_within_their_bound(sizes, chunk_bytes):
    order = list(range(len(sizes)))[::-1]
    chunks = cut_chunks(order, lambda i: sizes[i], chunk_bytes)
    assert [i for c in chunks for i in c.param_idxs] == order  # in order, each parameter once
    for c in chunks:
        assert c.param_idxs and c.nbytes == sum(sizes[i] for i in c.param_idxs)
        largest = max(sizes[i] for i in c.param_idxs)
        assert c.nbytes <= max(chunk_bytes, largest) + chunk_bytes // 8 or len(c.param_idxs) == 1
    for a, b in zip(chunks, chunks[1:]):  # a chunk closes only when the next parameter did not fit
        first = sizes[b.param_idxs[0]]
        largest = max(sizes[i] for i in a.param_idxs)
        assert a.nbytes + first > max(chunk_bytes, largest, first) + chunk_bytes // 8


def test_a_bias_after_a_large_weight_is_not_a_chunk_of_its_own():
    """The 2048-wide GPT's shape: 256 MiB weights each followed by a few KiB of bias or norm. Before, every
    bias was a chunk between two large ones, and reading one chunk ahead covered a few KiB."""
    sizes = [256 << 20, 8 << 10] * 6 + [16 << 10]
    chunks = cut_chunks(list(range(len(sizes))), lambda i: sizes[i], CHUNK)
    assert len(chunks) == 6
    assert all(c.nbytes >= 256 << 20 for c in chunks)
