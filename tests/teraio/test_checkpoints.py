"""A state larger than memory from its first byte to its last (issue 39): a pretrained Hugging Face model
loaded straight to disk with ``load_pretrained``, trained, saved with ``save_checkpoint``, resumed by
``load_checkpoint`` in a new process, exported with ``save_pretrained``; bit for bit the run loaded by
``from_pretrained`` and trained without offload. Then what must fail, fails in one line and writes
nothing: malformed pretrained files, damaged checkpoints, a save killed half-way."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import teraio
from teraio.states.errors import CheckpointError

from . import checkpoint_run, fine_tune_run

SCRIPT = Path(checkpoint_run.__file__)
REPO = Path(__file__).resolve().parents[2]


def _script(spec: dict[str, Any], tmp: Path, name: str) -> dict[str, Any]:
    spec_file, out = tmp / f"{name}-spec.json", tmp / f"{name}-out.json"
    spec_file.write_text(json.dumps(spec))
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(spec_file), str(out)], capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small Llama-shaped model saved by ``transformers``, in shards."""
    d = tmp_path_factory.mktemp("pretrained") / "llama"
    fine_tune_run.build("llama").save_pretrained(d, max_shard_size="100KB")
    return d


@pytest.fixture(scope="module")
def runs(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The reference (from_pretrained, no offload, 6 steps); 3 steps loaded with load_pretrained then saved
    and exported; 3 more in a new process from the checkpoint."""
    tmp = tmp_path_factory.mktemp("checkpoints")
    offload = tmp / "offload"
    offload.mkdir()
    base = {"hf_dir": str(hf_dir), "offload_dir": str(offload)}
    ckpt, export = tmp / "ckpt" / "step-000003", tmp / "export"
    reference = checkpoint_run.run({**base, "source": "from_pretrained", "first": 0, "steps": 6})
    first = checkpoint_run.run(
        {
            **base,
            "source": "load_pretrained",
            "first": 0,
            "steps": 3,
            "save": str(ckpt),
            "export": str(export),
        }
    )
    second = _script(
        {**base, "source": "load_checkpoint", "load": str(ckpt), "first": 3, "steps": 3}, tmp, "resume"
    )
    return {"reference": reference, "first": first, "second": second, "ckpt": ckpt, "export": export}


def test_loaded_to_disk_trained_saved_and_resumed_bit_identically(runs: dict[str, Any]) -> None:
    ref, first, second = runs["reference"], runs["first"], runs["second"]
    assert first["losses"] + second["losses"] == ref["losses"]
    assert first["norms"] + second["norms"] == ref["norms"]
    assert second["params_digest"] == ref["params_digest"]
    assert second["optimizer_digest"] == ref["optimizer_digest"]
    assert second["sched"] == ref["sched"]  # the LR scheduler passed as extra
    assert second["rng_digest"] == ref["rng_digest"]  # the generators restored
    for half in (first, second):
        assert half["left_on_meta"] == []
        kinds = half["moved_bytes_by_kind"]
        assert kinds["parameter"] > 0 and kinds["gradient"] > 0 and kinds["optimizer_state"] > 0
    # Straight to disk: every parameter was written to its slot as it was read (min_param_bytes=0).
    loaded = first["loaded"]
    assert loaded["offloaded_bytes"] == loaded["read_bytes"] > 0 and loaded["resident_bytes"] == 0
    assert second["loaded"]["committed_steps"] == 3
    assert second["loaded"]["model"]["offloaded_bytes"] == loaded["read_bytes"]


def test_checkpoint_layout_is_huggingface_and_sharded(runs: dict[str, Any], hf_dir: Path) -> None:
    ckpt: Path = runs["ckpt"]
    names = set(os.listdir(ckpt))
    model_files = sorted(n for n in names if n.startswith("model-"))
    assert len(model_files) >= 3 and "model.safetensors.index.json" in names
    assert {
        "config.json",
        "train_state.json",
        "teraio-checkpoint.json",
        "optimizer.safetensors.index.json",
    } <= names
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(model_files)
    # Nothing else is left beside it: the staging directory was renamed into place.
    assert os.listdir(ckpt.parent) == [ckpt.name]
    # The flattened optimizer names of torch.distributed.checkpoint, AdamW's step a 0-d float32 tensor.
    from safetensors import safe_open

    opt_index = json.loads((ckpt / "optimizer.safetensors.index.json").read_text())
    step_key = "state.model.embed_tokens.weight.step"
    with safe_open(ckpt / opt_index["weight_map"][step_key], framework="pt") as f:
        step = f.get_tensor(step_key)
    assert step.dtype == torch.float32 and step.shape == () and float(step) == 3.0


def test_exports_load_in_transformers_and_equal_the_trained_parameters(runs: dict[str, Any]) -> None:
    import transformers

    for directory in (runs["export"], runs["ckpt"]):
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        assert fine_tune_run._digest(dict(model.state_dict())) == runs["first"]["params_digest"]
    # torch.distributed.checkpoint reads a teraio checkpoint's model in place, as the docs say.
    import torch.distributed.checkpoint as dcp

    loaded = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    dcp.load(loaded, storage_reader=dcp.HuggingFaceStorageReader(str(runs["ckpt"])))
    assert fine_tune_run._digest(loaded) == runs["first"]["params_digest"]


# -- loading onto a meta model without training (cheap) --------------------------------------------------
def _meta_hf(directory: Path) -> torch.nn.Module:
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg)


def _states_backend(model: torch.nn.Module, offload: Path, parameters: bool = True) -> teraio.TeraioBackend:
    offload.mkdir(exist_ok=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return teraio.backend(
        inner="eager",
        states=teraio.States(opt, model=model, gradients=True, parameters=parameters, min_param_bytes="1KiB"),
        io_backend="posix",
        offload_dirs=[str(offload)],
    )


def _contents(d: Path) -> dict[str, bytes]:
    """Every file under ``d`` with its bytes (the engine makes its files when it starts)."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_load_pretrained_equals_from_pretrained_and_draws_no_random_number(arch: str, tmp_path: Path) -> None:
    """GPT-2 ties its head to the token embedding (one file entry for two names); Llama's rotary
    frequencies are a non-persistent buffer computed by the model's own code."""
    import transformers

    src = tmp_path / "hf"
    fine_tune_run.build(arch).save_pretrained(src)
    reference = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model = _meta_hf(src)
    backend = _states_backend(model, tmp_path / "offload")
    rng = torch.get_rng_state()
    report = backend.states.load_pretrained(src)
    assert torch.equal(rng, torch.get_rng_state())
    assert model.training is reference.training is False  # from_pretrained leaves it in eval mode
    assert report.offloaded_bytes > 0 and report.resident_bytes > 0  # norms stay (min_param_bytes)
    mine, theirs = model.state_dict(), reference.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    buffers = dict(reference.named_buffers())
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
    if arch == "gpt2":
        assert model.lm_head.weight is model.transformer.wte.weight
    backend.close()


def test_a_plain_module_loads_from_one_file_and_trains(tmp_path: Path) -> None:
    """Any nn.Module, from one .safetensors file: parameters on disk, gradients reach them (teraio's
    gradient hooks follow the parameter from meta to memory)."""
    from safetensors.torch import save_file

    from teraio.tools.models.gpt import CONFIGS, GPT, build_gpt

    src = build_gpt("tiny")
    save_file(src.state_dict(), tmp_path / "gpt.safetensors")
    with torch.device("meta"):
        model = GPT(CONFIGS["tiny"])
    backend = _states_backend(model, tmp_path / "offload")
    backend.states.load_pretrained(tmp_path / "gpt.safetensors")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), src.state_dict().values()))
    compiled = backend.compile(model)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    compiled(ids, ids).backward()
    assert backend.stats()["moved_bytes_by_kind"]["gradient"] > 0  # the hooks fired: gradients offloaded
    backend.close()


# -- what must fail ----------------------------------------------------------------------------------------
def _llama_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    import transformers

    return dict(transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).state_dict())


def _malformed(case: str, hf_dir: Path, d: Path) -> tuple[Path, str]:
    """A pretrained source broken one way, and the words its error must say."""
    from safetensors.torch import save_file

    tensors = _llama_tensors(hf_dir)
    target = d / "model.safetensors"
    if case == "missing key":
        tensors.pop("model.layers.1.mlp.up_proj.weight")
        save_file({k: v.contiguous() for k, v in tensors.items()}, target)
        return target, "no tensor for parameter 'model.layers.1.mlp.up_proj.weight'"
    if case == "unexpected key":
        save_file({**tensors, "model.extra.weight": torch.zeros(2)}, target)
        return target, "'model.extra.weight', which the model does not have"
    if case == "wrong shape":
        tensors["model.norm.weight"] = torch.ones(32)
        save_file(tensors, target)
        return target, "'model.norm.weight' has shape (32,)"
    if case == "wrong dtype":
        tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.bfloat16)
        save_file(tensors, target)
        return target, "'model.norm.weight' is torch.bfloat16"
    if case == "truncated shard":
        shard = sorted(hf_dir.glob("model-*.safetensors"))[1]
        copy = d / "hf"
        copy.mkdir()
        for f in hf_dir.iterdir():
            (copy / f.name).write_bytes(f.read_bytes())
        data = (copy / shard.name).read_bytes()
        (copy / shard.name).write_bytes(data[: len(data) - 100])
        return copy, "is truncated"
    if case == "unknown directory":
        (d / "empty").mkdir()
        return d / "empty", "is not a Hugging Face model directory"
    if case == "missing path":
        return d / "nowhere", "does not exist"
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case",
    [
        "missing key",
        "unexpected key",
        "wrong shape",
        "wrong dtype",
        "truncated shard",
        "unknown directory",
        "missing path",
    ],
)
def test_malformed_pretrained_input_is_one_line_and_writes_nothing(
    case: str, hf_dir: Path, tmp_path: Path
) -> None:
    source, words = _malformed(case, hf_dir, tmp_path)
    model = _meta_hf(hf_dir)
    offload = tmp_path / "offload"
    backend = _states_backend(model, offload)
    before = _contents(offload)
    with pytest.raises(CheckpointError) as info:
        backend.states.load_pretrained(source)
    message = str(info.value)
    assert "\n" not in message and words in message, message
    assert all(p.is_meta for p in model.parameters())  # nothing allocated...
    assert _contents(offload) == before  # ...nor written
    assert backend.states.stats()["written_bytes"]["parameter"] == 0
    backend.close()


KILLER = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {repo!r})
    import torch, teraio
    from teraio.states import safetensors_files
    from tests.teraio.test_checkpoints import _meta_hf, _states_backend
    from pathlib import Path

    model = _meta_hf(Path({hf!r}))
    backend = _states_backend(model, Path({offload!r}))
    backend.states.load_pretrained({hf!r})
    backend.states.save_checkpoint({first!r}, max_shard_size="40KB")
    written = []
    original = safetensors_files.ShardWriter.write

    def write(self, name, tensor):
        written.append(name)
        if len(written) == 5:  # half-way through the second checkpoint's files
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, name, tensor)

    safetensors_files.ShardWriter.write = write
    backend.states.save_checkpoint({second!r}, max_shard_size="40KB")
    """
)


def test_a_save_killed_half_way_leaves_the_previous_checkpoint_and_nothing_that_loads(
    hf_dir: Path, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    first, second = ckpt / "step-000000", ckpt / "step-000001"
    code = KILLER.format(
        repo=str(REPO), hf=str(hf_dir), offload=str(tmp_path / "off1"), first=str(first), second=str(second)
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    assert not second.exists()
    partial = [p for p in ckpt.iterdir() if p.name.startswith(".step-000001.")]
    assert len(partial) == 1 and not (partial[0] / "teraio-checkpoint.json").exists()
    model = _meta_hf(hf_dir)
    backend = _states_backend(model, tmp_path / "off2")
    with pytest.raises(CheckpointError, match="not a complete teraio checkpoint"):
        backend.states.load_checkpoint(partial[0])
    assert all(p.is_meta for p in model.parameters())
    backend.states.load_checkpoint(first)  # the previous one loads, equal to the pretrained weights
    theirs = _llama_tensors(hf_dir)
    assert all(torch.equal(v, theirs[k]) for k, v in model.state_dict().items())
    backend.close()


def _saved(hf_dir: Path, tmp_path: Path) -> Path:
    model = _meta_hf(hf_dir)
    backend = _states_backend(model, tmp_path / "off-save")
    backend.states.load_pretrained(hf_dir)
    out = backend.states.save_checkpoint(tmp_path / "ckpt", max_shard_size="40KB")
    with pytest.raises(CheckpointError, match="exists: save each checkpoint to a new directory"):
        backend.states.save_checkpoint(out)
    with pytest.raises(CheckpointError, match="has no state_dict"):
        backend.states.save_checkpoint(tmp_path / "other", extra={"bad": 3})
    assert (
        not (tmp_path / "other").exists()
        and [p.name for p in tmp_path.iterdir() if p.name.startswith(".other")] == []
    )
    backend.close()
    return out


@pytest.mark.parametrize("damage", ["truncated", "flipped byte", "train_state edited"])
def test_a_damaged_checkpoint_is_refused_in_one_line(damage: str, hf_dir: Path, tmp_path: Path) -> None:
    ckpt = _saved(hf_dir, tmp_path)
    shard = sorted(ckpt.glob("model-*.safetensors"))[1]
    if damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:-8])
        words = "changed size since it was saved"
    elif damage == "flipped byte":
        data = bytearray(shard.read_bytes())
        data[-3] ^= 0xFF
        shard.write_bytes(bytes(data))
        words = "does not match its checksum"
    else:
        state = ckpt / "train_state.json"
        state.write_text(state.read_text().replace('"committed_steps": 0', '"committed_steps": 7'))
        words = "does not match its checksum"
    model = _meta_hf(hf_dir)
    backend = _states_backend(model, tmp_path / "off-load")
    with pytest.raises(CheckpointError) as info:
        backend.states.load_checkpoint(ckpt)
    assert "\n" not in str(info.value) and words in str(info.value), str(info.value)
    backend.close()


def test_a_meta_buffer_of_a_plain_module_is_refused_before_anything_moves(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    class WithBuffer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(64, 64)
            self.register_buffer("scale", torch.ones(64), persistent=False)

    save_file(WithBuffer().state_dict(), tmp_path / "w.safetensors")
    with torch.device("meta"):
        model = WithBuffer()
    backend = _states_backend(model, tmp_path / "offload")
    before = _contents(tmp_path / "offload")
    with pytest.raises(CheckpointError, match="buffer 'scale' is on the meta device"):
        backend.states.load_pretrained(tmp_path / "w.safetensors")
    assert all(p.is_meta for p in model.parameters()) and _contents(tmp_path / "offload") == before
    backend.close()


def test_a_scheduler_made_before_the_backend_does_not_warn(tmp_path: Path) -> None:
    """The fine-tuner's order (optimizer, scheduler, then the backend, which replaces ``opt.step``): torch's
    "optimizer.step() has been overridden" warning would be false; stepping the scheduler first still warns."""
    import warnings

    def attached() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any, teraio.TeraioBackend]:
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LinearLR(opt, total_iters=4)
        backend = teraio.backend(
            inner="eager", states=teraio.States(opt), io_backend="posix", offload_dirs=[str(tmp_path)]
        )
        assert getattr(opt, "_teraio_states", None) is not None
        return model, opt, sched, backend

    model, opt, sched, backend = attached()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        sched.step()
    assert [str(w.message) for w in caught if "optimizer.step()" in str(w.message)] == []
    backend.close()
    _, _, sched, backend = attached()
    with pytest.warns(UserWarning, match=r"before `optimizer.step\(\)`"):
        sched.step()
    backend.close()
