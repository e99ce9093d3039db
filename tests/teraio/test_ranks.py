"""teraio's rank agreement refers to no process group past the job's own (Note: [teraio holds no process
group], teraio/lifecycle/ranks.py): once the job destroys its groups they are freed, their gloo threads
with them, and a job that makes new groups in the same process is agreed on over the new ones."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch.distributed as dist

from teraio.lifecycle.ranks import RankAgreement


def _init(tmp_path: Path, name: str) -> None:
    dist.init_process_group("gloo", init_method=(tmp_path / name).as_uri(), rank=0, world_size=1)


def test_the_default_gloo_group_is_freed_after_destroy_and_a_new_one_is_used(tmp_path: Path) -> None:
    agreement = RankAgreement()
    _init(tmp_path, "store1")
    try:
        first = weakref.ref(agreement._pg())
        assert first() is dist.group.WORLD
    finally:
        dist.destroy_process_group()
    gc.collect()
    assert first() is None, "teraio kept the destroyed default group (and its gloo threads) alive"
    _init(tmp_path, "store2")
    try:
        assert agreement._pg() is dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_a_group_of_teraios_own_lives_as_long_as_the_jobs_groups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On a job whose default group is not gloo (NCCL), teraio makes a gloo group of its own.
    monkeypatch.setattr(dist, "get_backend", lambda *a, **k: "nccl")
    agreement = RankAgreement()
    _init(tmp_path, "store1")
    try:
        own = agreement._pg()
        assert own is not dist.group.WORLD
        assert agreement._pg() is own  # made once per job: new_group is a collective
        first = weakref.ref(own)
        del own
    finally:
        dist.destroy_process_group()
    gc.collect()
    assert first() is None, "teraio kept its own destroyed group (and its gloo threads) alive"
    _init(tmp_path, "store2")
    try:
        again = agreement._pg()
        assert again is not dist.group.WORLD and agreement._pg() is again
        assert dist.get_process_group_ranks(again) == [0]  # registered in the new job
    finally:
        dist.destroy_process_group()
