"""Gradients and optimizer states that are DTensors (FSDP2's), on disk: the bytes move through their
local shards, and the DTensors are guarded as a whole (Note: [A sharded tensor's bytes are its local
shard], Note: [A sharded tensor is guarded as a whole] in teraio.states.shards). One process, a 1-rank
gloo group and mesh; the 2-rank FSDP2 jobs are in test_distributed.py."""

from __future__ import annotations

import copy
import gc
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from teraio.runtime import Engine, RuntimeConfig
from teraio.states import StatesError
from teraio.states.guarded import is_guarded
from teraio.states.offload import StateOffload


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[object]:
    from torch.distributed.tensor import init_device_mesh

    dist.init_process_group("gloo", init_method=(tmp_path / "store").as_uri(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _model(mesh: object) -> torch.nn.Module:
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    for name, p in list(model.named_parameters()):
        setattr(model, name, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
    return model


def _loss(model: torch.nn.Module, step: int, mesh: object) -> torch.Tensor:
    from torch.distributed.tensor import Replicate, distribute_tensor

    x = distribute_tensor(
        torch.randn(4, 16, generator=torch.Generator().manual_seed(step)), mesh, [Replicate()]
    )
    return model(x).pow(2).mean().full_tensor()


def test_dtensor_gradients_dropped_on_disk_are_freed_without_the_cyclic_collector(
    mesh: object, tmp_path: Path
) -> None:
    """Note: [A dropped record's guarded objects are not a reference cycle]: under FSDP2 a gradient's
    local shard can hold its whole group's reduce-scatter buffer."""
    model = _model(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = Engine(RuntimeConfig(dirs=[str(tmp_path / "off")], backend="posix"))
    states = StateOffload(opt, engine, offload_gradients=True)
    try:
        for step in range(2):
            _loss(model, step, mesh).backward()
            opt.step()
            grads = [(weakref.ref(p.grad), weakref.ref(p.grad.to_local())) for p in model.parameters()]
            assert all(is_guarded(g()) for g, _ in grads)
            gc.disable()  # freed by reference counting, or not at all
            try:
                opt.zero_grad()
                alive = [i for i, refs in enumerate(grads) for r in refs if r() is not None]
            finally:
                gc.enable()
            assert not alive, f"step {step}: gradients {alive} outlived zero_grad"
    finally:
        states.close()
        engine.close()


def test_dtensor_gradients_and_states_on_disk_are_served_and_exact(mesh: object, tmp_path: Path) -> None:
    reference = _model(mesh)
    model = copy.deepcopy(reference)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = Engine(RuntimeConfig(dirs=[str(tmp_path / "off")], backend="posix"))
    states = StateOffload(opt, engine, offload_gradients=True)
    try:
        for step in range(3):
            norms = []
            for m, o in ((reference, ref_opt), (model, opt)):
                _loss(m, step, mesh).backward()
                # On disk: the norms are served, the scale deferred to the step's load of each gradient.
                norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05).full_tensor())
                o.step()
                o.zero_grad()
            assert torch.equal(norms[0], norms[1])
        _loss(reference, 3, mesh).backward()
        _loss(model, 3, mesh).backward()
        p, q = model.weight, reference.weight
        assert is_guarded(p.grad) and is_guarded(opt.state[p]["exp_avg"])  # on disk, guarded as DTensors
        assert torch.equal(p.grad.full_tensor(), q.grad.full_tensor())
        assert torch.equal(p.grad.sum().full_tensor(), q.grad.sum().full_tensor())
        assert torch.equal(p.grad.to_local().clone(), q.grad.to_local())
        exp_avg = opt.state[p]["exp_avg"]
        assert torch.equal(exp_avg.full_tensor(), ref_opt.state[q]["exp_avg"].full_tensor())
        assert torch.equal(exp_avg.norm().full_tensor(), ref_opt.state[q]["exp_avg"].norm().full_tensor())
        with pytest.raises(StatesError, match="on disk"):
            exp_avg.add_(1.0)
        with pytest.raises(StatesError, match="on disk"):
            p.grad.zero_()
        saved = opt.state_dict()["state"]  # copies, DTensors as the optimizer's own
        want = ref_opt.state_dict()["state"]
        for i in want:
            for k in ("exp_avg", "exp_avg_sq"):
                assert type(saved[i][k]).__name__ == "DTensor"
                assert torch.equal(saved[i][k].full_tensor(), want[i][k].full_tensor())
        opt.step()
        ref_opt.step()
        for a, b in zip(model.parameters(), reference.parameters()):
            assert torch.equal(a.full_tensor(), b.full_tensor())
        assert states.stats()["moved_bytes_by_kind"]["gradient"] > 0
    finally:
        states.close()
        engine.close()


def test_an_update_inside_backward_over_sharded_parameters_is_refused_in_one_line(mesh: object) -> None:
    import teraio

    opt = torch.optim.AdamW(_model(mesh).parameters())
    with pytest.raises(StatesError, match="optimizer_in_backward=True does not take FSDP2's sharded"):
        teraio.States(optimizer=opt, optimizer_in_backward=True)


def _sequential(shard: bool, meta: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Two linear layers, each ``fully_shard``-ed and the model at the root when ``shard``, and AdamW."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    if shard:
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> torch.Tensor:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(i))
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def test_fsdp2_parameter_shards_on_one_rank_train_exactly_and_refuse_a_load(
    mesh: object, tmp_path: Path
) -> None:
    """FSDP2 on a 1-rank mesh (its gather reads the shard in ``wait_for_unshard``: Note: [A shard is read
    back before its all-gather] in teraio.states.fsdp_shards), the whole state on disk, eager: bit-identical
    to the same loop without teraio; a state dict loaded into the shards on disk is refused in one line."""
    reference, ref_opt = _sequential(shard=True)
    model, opt = _sequential(shard=True)
    engine = Engine(RuntimeConfig(dirs=[str(tmp_path / "off")], backend="posix"))
    states = StateOffload(
        opt, engine, offload_gradients=True, offload_parameters=True, model=model, min_param_bytes=0
    )
    try:
        for i in range(3):
            assert torch.equal(_step(model, opt, i), _step(reference, ref_opt, i))
        assert states.stats()["moved_bytes_by_kind"]["parameter"] > 0
        saved = model.state_dict()  # copies read back, DTensors
        for (name, got), want in zip(saved.items(), reference.state_dict().values()):
            assert torch.equal(got.full_tensor(), want.full_tensor()), name
        with pytest.raises(StatesError, match="into FSDP2 parameter shards on disk is not supported yet"):
            model.load_state_dict(saved)
    finally:
        states.close()
        engine.close()


def test_an_fsdp2_checkpoint_on_one_rank_loads_into_fsdp2_and_into_a_plain_model(
    mesh: object, tmp_path: Path
) -> None:
    """Saved rank by rank (Note: [A checkpoint of an FSDP2 job] in teraio.states.sharded_checkpoint), loaded
    into a fresh FSDP2 model and into the same model without FSDP2: the same parameters and optimizer
    states, and the next step bit-identical; a shard still on the meta device is refused in one line."""
    from teraio.states.errors import CheckpointError

    def full(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    def values(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        st = opt.state_dict()["state"]
        return [full(p).detach().clone() for p in model.parameters()] + [
            full(v).clone() for i in sorted(st) for _, v in sorted(st[i].items())
        ]

    def offload(model: torch.nn.Module, opt: torch.optim.Optimizer, name: str) -> tuple[Engine, StateOffload]:
        engine = Engine(RuntimeConfig(dirs=[str(tmp_path / name)], backend="posix"))
        states = StateOffload(
            opt, engine, offload_gradients=True, offload_parameters=True, model=model, min_param_bytes=0
        )
        return engine, states

    model, opt = _sequential(shard=True)
    engine, states = offload(model, opt, "off")
    try:
        for i in range(2):
            _step(model, opt, i)
        states.save_checkpoint(tmp_path / "ckpt")
        saved = values(model, opt)
        after = _step(model, opt, 2)
    finally:
        states.close()
        engine.close()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir())[:2] == [
        "model.rank00000.safetensors",
        "optimizer.rank00000.safetensors",
    ]
    for shard in (True, False):
        model, opt = _sequential(shard=shard)
        engine, states = offload(model, opt, f"off-{shard}")
        try:
            report = states.load_checkpoint(tmp_path / "ckpt")
            assert report["committed_steps"] == 2
            got = values(model, opt)
            assert len(got) == len(saved) and all(torch.equal(a, b) for a, b in zip(got, saved)), shard
            assert torch.equal(_step(model, opt, 2), after), shard
        finally:
            states.close()
            engine.close()
    model, opt = _sequential(shard=True, meta=True)
    engine, states = offload(model, opt, "off-meta")
    try:
        with pytest.raises(CheckpointError, match=r"FSDP2 shard on the meta device: .*model\.to_empty"):
            states.load_checkpoint(tmp_path / "ckpt")
    finally:
        states.close()
        engine.close()
