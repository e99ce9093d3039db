"""Checkpoints of a state larger than memory, saved and loaded one tensor at a time, and the trained
weights exported for ``transformers``: ``backend.states.save_checkpoint(dir)``, ``load_checkpoint(dir)``
and ``save_pretrained(dir)``.

Note: [The checkpoint format]
    A checkpoint directory holds the model's parameters and persistent buffers as Hugging Face names them
    (``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` shards with their
    ``model.safetensors.index.json``; ``config.json`` for a Hugging Face model): the directory is also
    what ``from_pretrained`` and ``save_pretrained`` read and write. The optimizer's tensors go to
    ``optimizer*.safetensors`` under ``state.{parameter name}.{state name}`` (the flattened names of
    ``torch.distributed.checkpoint``'s optimizer state dicts), the rest (param groups, the teraio step
    count, the random generators, a scheduler's or a GradScaler's state) to ``train_state.json`` (Note: [A
    checkpoint's small values round-trip exactly] in teraio.states.train_state), and the manifest
    ``teraio-checkpoint.json``, with every file's size and every tensor's crc32c, last (format version 1;
    version 2 is an FSDP2 job's, each rank's shards in files of its own: Note: [A checkpoint of an FSDP2
    job] in teraio.states.sharded_checkpoint). Why not
    ``torch.distributed.checkpoint``'s own files: its ``FileSystemWriter`` holds every tensor of a file
    until the file closes (the whole rank's state by default), its metadata and non-tensor values are
    pickles (loading would run code), and it has no checksums; its ``HuggingFaceStorageReader`` reads the
    safetensors files here.

Note: [A checkpoint is complete or absent]
    Every file is written into a fresh private directory next to the target (``.{name}.{random}.partial``,
    each file created with ``O_CREAT|O_EXCL|O_NOFOLLOW``), fsynced, the manifest last; then the directory
    is renamed to its name in one step and the parent fsynced. A crash before the rename leaves only the
    hidden directory, without the manifest until its last write, which ``load_checkpoint`` refuses; the
    previous checkpoint, in another directory, is never touched. An existing target is refused:
    checkpoints go to new directories (``ckpt/step-000100``), so the one before is intact whatever
    happens to the next.

Note: [What a checkpoint needs to resume bit for bit]
    Parameters, optimizer states with their ``step`` tensors and param groups (hyperparameters exactly,
    ``initial_lr`` of a scheduler included), the random generators (dropout draws from them), and the
    state of what the user passes as ``extra`` (an LR scheduler, a GradScaler). Gradients are not saved: a
    checkpoint is taken between steps, after ``opt.step()`` and ``opt.zero_grad()``. The plan is not
    saved either: the resumed run profiles and plans again, which changes where tensors live, not their
    values.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from teraio.planner.private_dir import PrivateDir
from teraio.runtime.config import parse_nbytes
from teraio.states.checkpoint_ranks import (
    RANKS,
    on_every_rank,
    rank_and_world,
    write_directory,
    write_together,
)
from teraio.states.errors import CheckpointError
from teraio.states.loading import (
    LoadReport,
    ignored_unexpected,
    is_hf_model,
    load_model,
    model_tensors,
    pretrained_files,
)
from teraio.states.optimizer_stream import RESIDENT_STATE_KEYS
from teraio.states.safetensors_files import (
    Planned,
    crc32c_of,
    headers_by_tensor,
    read_into,
    write_shards,
)
from teraio.states.sharded_checkpoint import (
    SHARDED_FORMAT_VERSION,
    SHARDED_LAYOUT,
    SavedPieces,
    load_model_pieces,
    load_state_pieces,
    merge_rank_results,
    rank_items,
    state_boxes,
    write_rank_files,
)
from teraio.states.shards import is_sharded
from teraio.states.store import Record, Residency
from teraio.states.train_state import decode, encode, restore_rng_state, rng_state

if TYPE_CHECKING:
    from teraio.states.offload import StateOffload

#: ``save_checkpoint`` and ``save_pretrained`` shards (``transformers``' own default is 50GB).
DEFAULT_MAX_SHARD_BYTES = "5GB"

FORMAT = "teraio-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "teraio-checkpoint.json"
TRAIN_STATE = "train_state.json"


def _write_file(d: PrivateDir, name: str, data: bytes) -> None:
    with d.open_new(name) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


# -- what is saved -------------------------------------------------------------------------------------
def _names(
    offload: StateOffload, model: torch.nn.Module
) -> tuple[list[tuple[str, torch.Tensor]], dict[int, str]]:
    """The model's tensors to save (each object once, under its first name) and each optimizer
    parameter's name by index."""
    params, buffers = model_tensors(model)
    tensors = [(s.names[0], s.param) for s in params] + [(b.names[0], b.tensor) for b in buffers]
    by_id = {id(s.param): s.names[0] for s in params}
    fqn: dict[int, str] = {}
    for i, p in enumerate(offload.params):
        if id(p) not in by_id:
            raise CheckpointError(
                f"the optimizer's parameter {i} {tuple(p.shape)} is not the model's: pass the model the "
                "optimizer trains as teraio.States(model=...)"
            )
        fqn[i] = by_id[id(p)]
    return tensors, fqn


class _Sources:
    """Where each tensor of a file comes from: a record on disk (read back, one at a time, the next one's
    read started while the current one is written) or a tensor in memory (written from it, no copy)."""

    def __init__(self, offload: StateOffload, sources: dict[str, Record | torch.Tensor]) -> None:
        self.offload = offload
        self.sources = sources

    def _on_disk(self, name: str) -> Record | None:
        src = self.sources[name]
        if isinstance(src, torch.Tensor) or src.residency is not Residency.DISK:
            return None
        return src

    def prefetch(self, pl: Planned) -> None:
        rec = self._on_disk(pl.name)
        if rec is not None and rec.saved_key is not None:
            self.offload.engine.prefetch(rec.saved_key)

    def fetch(self, pl: Planned) -> torch.Tensor:
        src = self.sources[pl.name]
        if isinstance(src, torch.Tensor):
            return src.detach()
        return self.offload.store.read_copy(src)


def _model_sources(offload: StateOffload, tensors: list[tuple[str, torch.Tensor]]) -> _Sources:
    res = offload.residency
    records = {} if res is None else {id(res.params[i]): r for i, r in res.records.items()}
    return _Sources(offload, {name: records.get(id(t), t) for name, t in tensors})


def _check_between_steps(offload: StateOffload, action: str) -> None:
    if offload.closed:
        raise CheckpointError(f"{action}: these states are closed")
    offload.settle_step()
    offload.stream.check_usable()
    if offload.stream.updating_in_backward:
        raise CheckpointError(f"{action}: an update made inside backward awaits opt.step(); call it first")
    offload.grads.settle()
    pending = [
        i for i, p in enumerate(offload.params) if p.grad is not None or offload.grads.current(i) is not None
    ]
    if pending:
        raise CheckpointError(
            f"{action}: {len(pending)} parameters have gradients; a checkpoint is taken between steps, after "
            "opt.step() and opt.zero_grad()"
        )


def _save_model(
    offload: StateOffload, model: torch.nn.Module, d: PrivateDir, max_shard_bytes: int
) -> dict[str, dict[str, int]]:
    tensors, _ = _names(offload, model)
    planned = [Planned(n, t.dtype, tuple(t.shape)) for n, t in tensors]
    sources = _model_sources(offload, tensors)
    sums = write_shards(
        d.open_new,
        "model",
        planned,
        sources.fetch,
        max_shard_bytes=max_shard_bytes,
        metadata={"format": "pt"},
        prefetch=sources.prefetch,
    )
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        _write_file(d, "config.json", config.to_json_string().encode())
    return sums


def _save_pretrained(
    offload: StateOffload, model: torch.nn.Module, directory: str | os.PathLike, *, max_shard_bytes: int
) -> Path:
    """The model's parameters and persistent buffers as a Hugging Face model directory (Note: [The
    checkpoint format]), one tensor in memory at a time."""
    rank, _ = rank_and_world()

    def write() -> Path:
        if offload.closed:
            raise CheckpointError("save_pretrained: these states are closed")
        offload.settle_step()
        offload.stream.check_usable()
        if rank != 0:  # Note: [A checkpoint of a DDP job] in teraio.states.checkpoint_ranks
            return Path(os.path.abspath(os.fspath(directory)))
        return write_directory(
            directory, lambda d: _save_model(offload, model, d, max_shard_bytes), what="model"
        )

    return on_every_rank(write, "save_pretrained")


def _optimizer_tensors(
    offload: StateOffload, fqn: dict[int, str]
) -> tuple[list[tuple[str, torch.Tensor, Record | None]], dict[str, Any]]:
    """The optimizer's tensors to save (``state.{name}.{key}``, each with its record when it lives on
    disk), and its non-tensor state values by parameter name."""
    opt = offload.optimizer
    items: list[tuple[str, torch.Tensor, Record | None]] = []
    values: dict[str, Any] = {}
    for i, p in enumerate(offload.params):
        st = opt.state.get(p)
        if not st:
            continue
        recs = offload.stream.records.get(i, {})
        order = []
        for k, v in st.items():
            order.append(k)
            if isinstance(v, torch.Tensor):
                items.append((f"state.{fqn[i]}.{k}", v, recs.get(k)))
            else:
                values.setdefault(fqn[i], {})[k] = encode(v, f"optimizer state {fqn[i]}.{k}")
        values.setdefault(fqn[i], {})["__order__"] = order
    return items, values


def _save_checkpoint(
    offload: StateOffload,
    model: torch.nn.Module,
    directory: str | os.PathLike,
    *,
    extra: dict[str, Any] | None,
    max_shard_bytes: int,
) -> Path:
    """Note: [The checkpoint format], [A checkpoint is complete or absent], [A checkpoint of a DDP job] (in
    teraio.states.checkpoint_ranks);
    FSDP2's shards: Note: [A checkpoint of an FSDP2 job] in teraio.states.sharded_checkpoint."""
    if any(is_sharded(p) for p in model.parameters()):
        return _save_sharded(offload, model, directory, extra=extra, max_shard_bytes=max_shard_bytes)
    rank, world = rank_and_world()

    def prepare() -> tuple[dict[str, Any], list[Planned], dict[str, Any]]:
        _check_between_steps(offload, "save_checkpoint")
        _, fqn = _names(offload, model)
        items, values = _optimizer_tensors(offload, fqn)
        planned = [Planned(n, v.dtype, tuple(v.shape)) for n, v, _ in items]
        sources = {n: (v if rec is None else rec) for n, v, rec in items}
        return _train_state(offload, fqn, values, extra), planned, sources

    train_state, planned, sources = on_every_rank(prepare, "save_checkpoint")
    rngs = RANKS.gather_objects(train_state.pop("rng"))
    train_state["world_size"] = world
    train_state["rng_by_rank"] = rngs
    states = _Sources(offload, sources)

    def populate(d: PrivateDir) -> None:
        sums = _save_model(offload, model, d, max_shard_bytes)
        model_files = list(sums)
        opt_sums = write_shards(
            d.open_new,
            "optimizer",
            planned,
            states.fetch,
            max_shard_bytes=max_shard_bytes,
            prefetch=states.prefetch,
        )
        sums.update(opt_sums)
        state_bytes = json.dumps(train_state, indent=1).encode()
        _write_file(d, TRAIN_STATE, state_bytes)
        files = {n: os.stat(n, dir_fd=d.fd).st_size for n in os.listdir(d.fd)}
        manifest = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "model_files": model_files,
            "optimizer_files": list(opt_sums),
            "file_bytes": files,
            "crc32c": sums,
            "train_state_crc32c": crc32c_of(torch.frombuffer(bytearray(state_bytes), dtype=torch.uint8)),
        }
        _write_file(
            d, MANIFEST, json.dumps(manifest, indent=1).encode()
        )  # last: Note: [A checkpoint is complete or absent]

    def write() -> Path:
        if rank != 0:  # every rank holds the same state under DDP: rank 0 writes it once
            return Path(os.path.abspath(os.fspath(directory)))
        return write_directory(directory, populate, what="checkpoint")

    return on_every_rank(write, "save_checkpoint")


def _save_sharded(
    offload: StateOffload,
    model: torch.nn.Module,
    directory: str | os.PathLike,
    *,
    extra: dict[str, Any] | None,
    max_shard_bytes: int,
) -> Path:
    """Note: [A checkpoint of an FSDP2 job] in teraio.states.sharded_checkpoint."""
    rank, world = rank_and_world()

    def prepare() -> tuple[dict[str, Any], Any, Any]:
        _check_between_steps(offload, "save_checkpoint")
        tensors, fqn = _names(offload, model)
        res = offload.residency
        records = {} if res is None else {id(res.params[i]): r for i, r in res.records.items()}
        model_items = rank_items([(n, t, records.get(id(t))) for n, t in tensors], rank)
        items, values = _optimizer_tensors(offload, fqn)
        return _train_state(offload, fqn, values, extra), model_items, rank_items(items, rank)

    train_state, model_items, opt_items = on_every_rank(prepare, "save_checkpoint")
    train_state["world_size"] = world
    train_state["rng_by_rank"] = RANKS.gather_objects(train_state.pop("rng"))

    def finish(d: PrivateDir, results: list[dict[str, Any]]) -> None:
        merged = merge_rank_results(results, d)
        state_bytes = json.dumps(train_state, indent=1).encode()
        _write_file(d, TRAIN_STATE, state_bytes)
        manifest = {
            "format": FORMAT,
            "version": SHARDED_FORMAT_VERSION,
            "layout": SHARDED_LAYOUT,
            "world_size": world,
            "model_files": merged["model_files"],
            "optimizer_files": merged["optimizer_files"],
            "file_bytes": {n: os.stat(n, dir_fd=d.fd).st_size for n in os.listdir(d.fd)},
            "crc32c": merged["crc32c"],
            "train_state_crc32c": crc32c_of(torch.frombuffer(bytearray(state_bytes), dtype=torch.uint8)),
            "pieces": merged["pieces"],
        }
        _write_file(d, MANIFEST, json.dumps(manifest, indent=1).encode())  # last

    return write_together(
        directory,
        lambda d: write_rank_files(offload, d, rank, model_items, opt_items, max_shard_bytes),
        finish,
    )


def _train_state(
    offload: StateOffload, fqn: dict[int, str], values: dict[str, Any], extra: dict[str, Any] | None
) -> dict[str, Any]:
    """``train_state.json``'s content (``values``: the optimizer's non-tensor state by parameter name), but
    the generators of the other ranks (Note: [What a checkpoint needs to resume bit for bit])."""
    opt = offload.optimizer
    groups = []
    for g in opt.param_groups:
        entry = {k: encode(v, f"param group setting {k!r}") for k, v in g.items() if k != "params"}
        entry["params"] = [fqn[offload.stream.by_id[id(p)]] for p in g["params"]]
        groups.append(entry)
    extras = {}
    for key, obj in (extra or {}).items():
        if not hasattr(obj, "state_dict") or not hasattr(obj, "load_state_dict"):
            raise CheckpointError(
                f"extra[{key!r}] has no state_dict()/load_state_dict(): pass an LR scheduler, a GradScaler, ..."
            )
        extras[key] = encode(obj.state_dict(), f"extra[{key!r}]")
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "optimizer": {"class": type(opt).__name__, "param_groups": groups, "state_values": values},
        "committed_steps": offload.committed_steps,
        "arrival_order": [fqn[i] for i in offload.grads.arrival_order],
        "rng": rng_state(),
        "extra": extras,
        "torch_version": torch.__version__,
    }


# -- loading -------------------------------------------------------------------------------------------
def _load_pretrained(
    offload: StateOffload, model: torch.nn.Module, path: str | os.PathLike, *, device: torch.device
) -> LoadReport:
    """Note: [A model is loaded one tensor at a time] in teraio.states.loading; under a process group every
    rank loads the same files (Note: [A checkpoint of a DDP job] in teraio.states.checkpoint_ranks)."""

    def load() -> LoadReport:
        _check_fresh(offload, "load_pretrained")
        files = pretrained_files(path)
        if any(is_sharded(p) for p in model.parameters()):  # each rank its blocks of the whole tensors
            ignored = ignored_unexpected(model)
            report = load_model_pieces(
                model,
                SavedPieces.from_whole_files(files),
                residency=offload.residency,
                device=device,
                source=f"'{path}'",
                checksums=None,
                ignored=lambda name: any(p.search(name) for p in ignored),
            )
        else:
            report = load_model(model, files, residency=offload.residency, device=device, source=f"'{path}'")
        if is_hf_model(model):
            model.eval()  # as from_pretrained leaves it: the same dropout from the same loop
        return report

    return on_every_rank(load, "load_pretrained")


def _read_manifest(directory: Path) -> dict[str, Any]:
    if not directory.is_dir():
        raise CheckpointError(f"'{directory}' is not a directory: give a checkpoint save_checkpoint wrote")
    try:
        manifest = json.loads((directory / MANIFEST).read_bytes())
    except FileNotFoundError:
        raise CheckpointError(
            f"'{directory}' is not a complete teraio checkpoint (no {MANIFEST}): a save that did not finish, or "
            "another kind of directory; load the checkpoint before it"
        ) from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"'{directory / MANIFEST}' cannot be read: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"'{directory / MANIFEST}' is not a teraio checkpoint manifest")
    if manifest.get("version") not in (FORMAT_VERSION, SHARDED_FORMAT_VERSION):
        raise CheckpointError(
            f"'{directory}' is a version {manifest.get('version')} checkpoint; this teraio reads versions "
            f"{FORMAT_VERSION} and {SHARDED_FORMAT_VERSION}"
        )
    for name, size in manifest["file_bytes"].items():
        p = directory / name
        if not p.is_file() or p.stat().st_size != size:
            raise CheckpointError(
                f"'{p}' is missing or has changed size since it was saved: the checkpoint is damaged"
            )
    return manifest


def _check_fresh(offload: StateOffload, action: str) -> None:
    opt = offload.optimizer
    if offload.closed:
        raise CheckpointError(f"{action}: these states are closed")
    if offload.committed_steps or any(opt.state.get(p) for p in offload.params):
        raise CheckpointError(
            f"{action} comes before the first step: this optimizer has state already; build a fresh model, "
            "optimizer and backend (the model on the meta device) and load into them"
        )
    if offload.residency is not None and offload.residency.records:
        raise CheckpointError(
            f"{action} comes before the first compiled call: parameters are already on disk; load into a fresh "
            "model, optimizer and backend"
        )


def _load_checkpoint(
    offload: StateOffload,
    model: torch.nn.Module,
    directory: str | os.PathLike,
    *,
    extra: dict[str, Any] | None,
    restore_rng: bool,
    device: torch.device,
) -> dict[str, Any]:
    """Restore what :func:`_save_checkpoint` wrote into a fresh model, optimizer and backend, straight to
    disk (Note: [What a checkpoint needs to resume bit for bit]); under a process group every rank loads
    the same directory (Note: [A checkpoint of a DDP job] in teraio.states.checkpoint_ranks)."""
    return on_every_rank(
        lambda: _load_here(offload, model, Path(directory), extra, restore_rng, device), "load_checkpoint"
    )


def _load_here(
    offload: StateOffload,
    model: torch.nn.Module,
    path: Path,
    extra: dict[str, Any] | None,
    restore_rng: bool,
    device: torch.device,
) -> dict[str, Any]:
    _check_fresh(offload, "load_checkpoint")
    manifest = _read_manifest(path)
    state_bytes = (path / TRAIN_STATE).read_bytes()
    if (
        crc32c_of(torch.frombuffer(bytearray(state_bytes), dtype=torch.uint8))
        != manifest["train_state_crc32c"]
    ):
        raise CheckpointError(
            f"'{path / TRAIN_STATE}' does not match its checksum: the checkpoint is damaged"
        )
    train = json.loads(state_bytes)
    opt = offload.optimizer
    saved_opt = train["optimizer"]
    if saved_opt["class"] != type(opt).__name__:
        raise CheckpointError(
            f"'{path}' holds a {saved_opt['class']} optimizer's state, this one is a {type(opt).__name__}"
        )
    _, fqn = _names(offload, model)
    groups = saved_opt["param_groups"]
    mine = [[fqn[offload.stream.by_id[id(p)]] for p in g["params"]] for g in opt.param_groups]
    if [g["params"] for g in groups] != mine:
        raise CheckpointError(
            f"'{path}': the optimizer's param groups do not hold the same parameters as when it was saved "
            f"({len(groups)} groups there, {len(mine)} here): build the optimizer as the saved run did"
        )
    opt_files = [path / n for n in manifest["optimizer_files"]]
    # Note: [A checkpoint of an FSDP2 job] in teraio.states.sharded_checkpoint: read as pieces when it was
    # saved rank by rank or is loaded into shards.
    saved_in_pieces = manifest.get("layout") == SHARDED_LAYOUT
    by_pieces = saved_in_pieces or any(is_sharded(p) for p in model.parameters())
    model_pieces = opt_pieces = None
    if saved_in_pieces:
        model_pieces = SavedPieces.from_manifest(path, manifest, "model")
        opt_pieces = SavedPieces.from_manifest(path, manifest, "optimizer")
    elif by_pieces:
        model_pieces = SavedPieces.from_whole_files(path / n for n in manifest["model_files"])
        opt_pieces = SavedPieces.from_whole_files(opt_files)
    opt_headers: Any = opt_pieces if opt_pieces is not None else headers_by_tensor(opt_files)
    index = {name: i for i, name in fqn.items()}
    values = saved_opt["state_values"]
    wanted: list[tuple[int, str, str]] = []
    for name_fqn, entries in values.items():
        if name_fqn not in index:
            raise CheckpointError(
                f"'{path}': optimizer state for {name_fqn!r}, which the model does not have"
            )
        for k in entries["__order__"]:
            if k not in entries:
                tname = f"state.{name_fqn}.{k}"
                if tname not in opt_headers:
                    raise CheckpointError(f"'{path}': the optimizer files lack {tname!r}")
                wanted.append((index[name_fqn], k, tname))
    rank, world = rank_and_world()
    if restore_rng and train["world_size"] != world:
        raise CheckpointError(
            f"'{path}' was saved by a job of {train['world_size']} ranks, this one has {world}: the random "
            "generators cannot be restored rank by rank; pass restore_rng=False"
        )
    extras = train.get("extra", {})
    for key in extra or {}:
        if key not in extras:
            raise CheckpointError(
                f"'{path}' holds no state for extra[{key!r}] (it has: {sorted(extras) or 'none'})"
            )
    checksums = manifest["crc32c"]
    if model_pieces is not None and opt_pieces is not None:
        boxes = state_boxes(offload, wanted, opt_pieces)
        # Everything checked (the model's tensors first thing in load_model_pieces): now the bytes move.
        report = load_model_pieces(
            model,
            model_pieces,
            residency=offload.residency,
            device=device,
            source=f"'{path}'",
            checksums=checksums,
        )
        states_bytes = load_state_pieces(offload, wanted, boxes, opt_pieces, checksums, device)
        _order_states(offload, values, fqn)
    else:
        # Everything checked: now the bytes move.
        report = load_model(
            model,
            [path / n for n in manifest["model_files"]],
            residency=offload.residency,
            device=device,
            source=f"'{path}'",
            checksums=checksums,
        )
        states_bytes = _load_optimizer_states(offload, wanted, values, opt_headers, checksums, device, fqn)
    for g, saved in zip(opt.param_groups, groups):
        for k, v in saved.items():
            if k != "params":
                g[k] = decode(v)
    offload.stream.committed_steps = int(train["committed_steps"])
    order = [index[n] for n in train.get("arrival_order", []) if n in index]
    offload.grads.arrival_order[:] = order
    offload.grads._seen = set(order)
    for key, obj in (extra or {}).items():
        obj.load_state_dict(decode(extras[key]))
    if restore_rng:
        restore_rng_state(train["rng_by_rank"][rank])
    return {
        "committed_steps": offload.committed_steps,
        "model": report.as_dict(),
        "optimizer_state_bytes": states_bytes,
    }


def _load_optimizer_states(
    offload: StateOffload,
    wanted: list[tuple[int, str, str]],
    values: dict[str, Any],
    headers: dict[str, Any],
    checksums: dict[str, dict[str, int]],
    device: torch.device,
    fqn: dict[int, str],
) -> int:
    """Each state tensor read into its own memory and, unless it stays resident (``step``), written to
    slot 0 on disk and freed before the next (Note: [A model is loaded one tensor at a time] in
    teraio.states.loading)."""
    opt = offload.optimizer
    total = 0
    fds: dict[Path, int] = {}
    try:
        for idx, k, tname in wanted:
            header = headers[tname]
            entry = header.entries[tname]
            buf = torch.empty(entry.shape, dtype=entry.dtype)
            if header.path not in fds:
                fds[header.path] = os.open(header.path, os.O_RDONLY | os.O_CLOEXEC)
            read_into(fds[header.path], entry, buf, path=header.path)
            if crc32c_of(buf) != checksums.get(header.path.name, {}).get(tname):
                raise CheckpointError(
                    f"'{header.path}': {tname!r} does not match its checksum: the checkpoint is damaged"
                )
            t = buf if device.type == "cpu" or k in RESIDENT_STATE_KEYS else buf.to(device)
            total += entry.nbytes
            p = offload.params[idx]
            st = opt.state.setdefault(p, {})
            st[k] = t
            if k not in RESIDENT_STATE_KEYS:
                offload.stream.write_loaded(idx, k, t)
            del buf, t
    finally:
        for fd in fds.values():
            os.close(fd)
    _order_states(offload, values, fqn)
    return total


def _order_states(offload: StateOffload, values: dict[str, Any], fqn: dict[int, str]) -> None:
    """The non-tensor values, and each state's keys in their saved order (state_dict() lists them so)."""
    opt = offload.optimizer
    index = {n: i for i, n in fqn.items()}
    for name, entries in values.items():
        p = offload.params[index[name]]
        loaded = opt.state.get(p, {})
        opt.state[p] = {k: (decode(entries[k]) if k in entries else loaded[k]) for k in entries["__order__"]}


class Checkpoints:
    """The checkpoint methods of ``backend.states`` (:class:`teraio.states.offload.StateOffload` has them),
    kept with the code they call."""

    model: torch.nn.Module | None

    def _model_for(self, action: str) -> torch.nn.Module:
        if self.model is None:
            raise CheckpointError(f"{action} needs the model: teraio.States(optimizer=opt, model=model, ...)")
        if action == "save_pretrained" and any(is_sharded(p) for p in self.model.parameters()):
            # Its files hold whole tensors, each rank has a shard of each.
            raise CheckpointError(
                "save_pretrained does not take FSDP2's sharded parameters: save_checkpoint writes each rank's "
                "shards, and load_checkpoint in one process without FSDP2 reads them whole (restore_rng=False); "
                "save_pretrained from there"
            )
        return self.model

    def load_pretrained(self, path: str | os.PathLike, *, device: str | torch.device = "cpu") -> LoadReport:
        """Load the model's weights from ``path`` (a ``.safetensors`` file or a Hugging Face model
        directory) straight to their place, one tensor at a time: offloaded parameters to disk, the others
        into memory on ``device`` (Note: [A model is loaded one tensor at a time] in
        teraio.states.loading). Call it after making the backend, before the first step, on a model built on
        the meta device (or a real one, whose values are replaced).

        Raises:
            CheckpointError: one line naming the first missing, unexpected or mismatched tensor, before
                any byte is written.
        """
        return _load_pretrained(self, self._model_for("load_pretrained"), path, device=torch.device(device))

    def save_checkpoint(
        self,
        directory: str | os.PathLike,
        *,
        extra: dict[str, Any] | None = None,
        max_shard_size: int | str = DEFAULT_MAX_SHARD_BYTES,
    ) -> Path:
        """Save parameters, optimizer states, param groups, teraio's step count, the random generators
        and ``extra``'s state (``{"lr_scheduler": sched, "scaler": scaler}``) to the new directory
        ``directory``, one tensor in memory at a time, complete or not at all (Note: [The checkpoint
        format] in teraio.states.checkpoint). Call it between steps (after ``opt.step()`` and
        ``opt.zero_grad()``)."""
        model = self._model_for("save_checkpoint")
        return _save_checkpoint(
            self,
            model,
            directory,
            extra=extra,
            max_shard_bytes=parse_nbytes(max_shard_size, what="max_shard_size"),
        )

    def load_checkpoint(
        self,
        directory: str | os.PathLike,
        *,
        extra: dict[str, Any] | None = None,
        restore_rng: bool = True,
        device: str | torch.device = "cpu",
    ) -> dict[str, Any]:
        """Restore a checkpoint of :meth:`save_checkpoint` into this fresh model, optimizer and backend,
        straight to disk; ``extra``'s objects get their saved state, and (``restore_rng``) the random
        generators theirs. Returns what was loaded (``committed_steps``, bytes)."""
        model = self._model_for("load_checkpoint")
        return _load_checkpoint(
            self, model, directory, extra=extra, restore_rng=restore_rng, device=torch.device(device)
        )

    def save_pretrained(
        self, directory: str | os.PathLike, *, max_shard_size: int | str = DEFAULT_MAX_SHARD_BYTES
    ) -> Path:
        """Export the model's parameters (and persistent buffers) as a Hugging Face model directory that
        ``from_pretrained`` loads (``config.json`` too for a Hugging Face model), one tensor in memory at a
        time."""
        model = self._model_for("save_pretrained")
        return _save_pretrained(
            self, model, directory, max_shard_bytes=parse_nbytes(max_shard_size, what="max_shard_size")
        )
