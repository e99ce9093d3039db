"""Tiers plug in by name behind the declared protocol: a tier the engine has never heard of, written
against ``runtime.tiers.base.Tier`` only, carries offloads; the built-in tiers declare exactly the
optional abilities they implement."""

from __future__ import annotations

import pytest
import torch

from teraio.runtime import Engine, RuntimeConfig
from teraio.runtime.buffers import memmove
from teraio.runtime.errors import ConfigError
from teraio.runtime.staging import DeviceIO
from teraio.runtime.tiers.base import Ability, Chunk, Placement, split_chunks


class DictTier:
    """Host memory in a dict of bytearrays, one per chunk: the smallest honest tier."""

    name = "mem"
    io_path = "mem-dict"
    abilities: frozenset[Ability] = frozenset()

    def __init__(self) -> None:
        self.closed = False
        self.frees = 0

    def allocate(self, nbytes: int) -> Placement:
        pieces = split_chunks(nbytes, 1 << 16)
        return Placement(nbytes, [Chunk(off, n, -1, i) for i, (off, n) in enumerate(pieces)], private={})

    def free(self, placement: Placement) -> None:
        self.frees += 1
        placement.private.clear()

    def write_chunk(self, placement: Placement, chunk: Chunk, src: torch.Tensor, io: DeviceIO | None) -> None:
        assert io is None, "host tensors only"
        placement.private[chunk.file_offset] = bytes(
            src[chunk.region_offset : chunk.region_offset + chunk.nbytes].numpy()
        )

    def read_chunk(self, placement: Placement, chunk: Chunk, dst: torch.Tensor, io: DeviceIO | None) -> None:
        data = placement.private[chunk.file_offset]
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        memmove(dst.data_ptr() + chunk.region_offset, src.data_ptr(), chunk.nbytes)

    def finish_write(self, placement: Placement) -> None:
        return None

    def close(self) -> None:
        self.closed = True


def test_a_plugged_in_tier_carries_offloads_by_name():
    tier = DictTier()
    with Engine(RuntimeConfig(backend="host", checksum=True), tiers={"mem": tier}) as eng:
        t = torch.randn(50_001)
        eng.offload("a", t, tier="mem")
        eng.release("a")
        assert torch.equal(eng.fetch("a"), t)
        st = eng.stats()
        assert st.transfers["mem.write"].nbytes == st.transfers["mem.read"].nbytes == t.nbytes
        assert st.held_nbytes["mem"] == t.nbytes
        eng.drop("a")
        assert tier.frees == 1 and eng.stats().held_nbytes["mem"] == 0
        with pytest.raises(ConfigError, match="'mem'"):
            eng.offload("b", t, tier="tape")
    assert tier.closed


def test_a_tier_must_be_plugged_in_under_its_own_name():
    with pytest.raises(ConfigError, match="name is 'mem'"):
        Engine(RuntimeConfig(backend="host"), tiers={"other": DictTier()})


def test_builtin_tiers_declare_what_they_implement(tmp_path):
    methods = {
        Ability.GROUPED_READS: ("group_chunks", "read_group"),
        Ability.READ_PATH_COUNTS: ("read_nbytes",),
        Ability.FILES: ("dir_io_path",),
    }
    with Engine(RuntimeConfig(backend="posix", dirs=[tmp_path])) as eng:
        for tier in eng.tiers.values():
            for ability, names in methods.items():
                has = all(hasattr(tier, n) for n in names)
                assert has or ability not in tier.abilities, (tier.name, ability)
        assert eng.tiers["ssd"].abilities == frozenset(methods)
        assert eng.tiers["host"].abilities == frozenset()
